//! Per-client rate limiting: 429 "you are too fast", kept apart from admission's 503
//! "we are full". The middleware (`http::middleware::rate_limit`) sits before admission, so a
//! client over its rate never takes an admission slot; health and metrics are never limited.
//!
//! # The algorithm
//! GCRA, the algorithm of governor: a client's state is one "theoretical arrival time" (TAT).
//! With emission interval `T = 1 s / per_second` and tolerance `tau = T × (burst − 1)`, a request
//! at `now` is allowed when `now ≥ TAT − tau`, and then `TAT = max(TAT, now) + T`. The Redis
//! script implements the same arithmetic, so the two backends agree on every number.
//!
//! # Local limiter: what comes from tower_governor, and why not its layer
//! tower_governor supplies the [`KeyExtractor`] trait, which [`ClientKeyExtractor`] implements,
//! and the [`GovernorConfigBuilder`] that turns `per_second`/`burst` into governor's keyed
//! limiter with `StateInformationMiddleware` (the remaining burst capacity behind
//! `RateLimit-Remaining`). Its `GovernorLayer` is not in the stack, because:
//! - its decision is a synchronous `check_key`, so it cannot consult Redis first and fall back
//!   to the local limiter within `redis_timeout`;
//! - its 429 is a `text/plain` body with `x-ratelimit-after`, not our problem+json from
//!   `ApiError::RateLimited`, and its wait time is truncated to whole seconds (so `0`, an
//!   invitation to retry at once, for sub-second waits);
//! - it sets `x-ratelimit-*` rather than the IETF `RateLimit-*` fields, and only on some
//!   responses.
//!
//! # Memory
//! The local state is one map entry (16-byte key, 8-byte TAT) per client seen recently. A task
//! calls governor's `retain_recent()` every [`SWEEP_EVERY`] (off the async workers, in
//! `spawn_blocking`), dropping every client whose state has returned to "fresh", i.e. that has
//! been quiet for `burst / per_second` seconds (2 s at the defaults). The map therefore holds at
//! most the clients seen in the last sweep interval plus that refill time; its size is exported
//! as `tributary_ratelimit_local_keys`. In Redis each key carries a `PX` expiry equal to its
//! refill time, so Redis drops quiet clients itself.
//!
//! The client's identity is in [`client`], the shared limit in [`redis`].

mod client;
mod redis;

use std::{net::IpAddr, sync::Arc, time::Duration};

use anyhow::Context as _;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use governor::{
    clock::{Clock, DefaultClock},
    middleware::StateInformationMiddleware,
    state::keyed::DefaultKeyedStateStore,
};
use metrics::Counter;
use tokio_util::sync::CancellationToken;
use tower_governor::governor::{GovernorConfigBuilder, SharedRateLimiter};

use client::{ClientKey, ClientKeyExtractor};
use redis::SharedLimit;

use crate::{config::RateLimitSettings, telemetry::Family};

/// How often quiet clients are dropped from the local limiter's map.
pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(10);

pub(crate) const REJECTIONS: Family = Family::counter(
    "tributary_ratelimit_rejections_total",
    "Requests rejected with 429 by per-client rate limiting, by backend.",
);
pub(crate) const LOCAL_KEYS: Family = Family::gauge(
    "tributary_ratelimit_local_keys",
    "Clients tracked by this replica's local rate limiter after the last sweep.",
);

/// The families this module records.
pub(crate) const FAMILIES: &[Family] = &[REJECTIONS, redis::FALLBACKS, redis::DURATION, LOCAL_KEYS];

/// 429s by the backend that decided them; the `redis` series exists only with Redis.
struct Rejections {
    local: Counter,
    redis: Option<Counter>,
}

impl Rejections {
    fn register(with_redis: bool) -> Self {
        Self {
            local: metrics::counter!(REJECTIONS.name, "backend" => "local"),
            redis: with_redis.then(|| metrics::counter!(REJECTIONS.name, "backend" => "redis")),
        }
    }
}

const RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("ratelimit-limit");
const RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("ratelimit-remaining");
const RATELIMIT_RESET: HeaderName = HeaderName::from_static("ratelimit-reset");

/// What the limiter decided, with the headers the response should carry.
pub(crate) enum Decision {
    /// Go on; the response carries `RateLimit-*`.
    Allowed { headers: HeaderMap },
    /// 429; `retry_after` becomes `Retry-After` (at least 1 s) next to `RateLimit-*`.
    Limited {
        headers: HeaderMap,
        retry_after: Duration,
    },
}

/// The local limiter: governor's keyed GCRA, built by tower_governor.
type LocalLimiter = SharedRateLimiter<ClientKey, StateInformationMiddleware>;
/// What [`LocalLimiter`] points to; the sweeper holds it weakly.
type LocalState = governor::RateLimiter<
    ClientKey,
    DefaultKeyedStateStore<ClientKey>,
    DefaultClock,
    StateInformationMiddleware,
>;

/// The per-client rate limiter: Redis-shared when configured, local otherwise and as fallback.
pub(crate) struct RateLimiter {
    keys: ClientKeyExtractor,
    burst: u32,
    period: Duration,
    local: LocalLimiter,
    redis: Option<Arc<SharedLimit>>,
    rejections: Rejections,
}

impl RateLimiter {
    /// Builds the limiter and starts its sweeper. With a Redis URL, connects and loads the
    /// script within [`REDIS_CONNECT_TIMEOUT`]; an unreachable Redis is logged, not an error.
    /// Its background tasks (the sweeper, a Redis prober during an outage) stop when
    /// `shutdown` is cancelled.
    pub(crate) async fn new(
        settings: &RateLimitSettings,
        shutdown: CancellationToken,
    ) -> anyhow::Result<Self> {
        let burst = settings.burst;
        let period = Duration::from_secs(1) / settings.per_second.get();
        let keys = ClientKeyExtractor::new(settings);
        let config = GovernorConfigBuilder::default()
            .key_extractor(keys.clone())
            .period(period)
            .burst_size(burst.get())
            .use_headers()
            .finish()
            .context("rate_limit.per_second is too large for a nanosecond clock")?;
        let local = Arc::clone(config.limiter());
        spawn_sweeper(Arc::clone(&local), shutdown.clone());
        let redis = match &settings.redis_url {
            Some(url) => {
                Some(SharedLimit::connect(url, settings, period, burst.get(), shutdown).await?)
            }
            None => None,
        };
        Ok(Self {
            keys,
            burst: burst.get(),
            period,
            local,
            rejections: Rejections::register(redis.is_some()),
            redis,
        })
    }

    /// Decides one request. Never fails: Redis trouble falls back to the local limiter.
    pub(crate) async fn check(&self, headers: &HeaderMap, peer: Option<IpAddr>) -> Decision {
        let key = self.keys.key(headers, peer);
        let (verdict, rejections) = match &self.redis {
            Some(redis) => match redis.decide(&key).await {
                Ok(verdict) => (verdict, self.rejections.redis.as_ref()),
                Err(reason) => {
                    redis.count_fallback(reason);
                    (self.check_local(&key), None)
                }
            },
            None => (self.check_local(&key), None),
        };
        let mut h = HeaderMap::with_capacity(3);
        h.insert(RATELIMIT_LIMIT, HeaderValue::from(self.burst));
        h.insert(RATELIMIT_REMAINING, HeaderValue::from(verdict.remaining));
        h.insert(RATELIMIT_RESET, HeaderValue::from(ceil_secs(verdict.reset)));
        if verdict.allowed {
            Decision::Allowed { headers: h }
        } else {
            rejections.unwrap_or(&self.rejections.local).increment(1);
            Decision::Limited {
                headers: h,
                retry_after: verdict.retry_after,
            }
        }
    }

    fn check_local(&self, key: &ClientKey) -> Verdict {
        match self.local.check_key(key) {
            Ok(snapshot) => {
                let remaining = snapshot.remaining_burst_capacity().min(self.burst);
                Verdict {
                    allowed: true,
                    remaining,
                    retry_after: Duration::ZERO,
                    // Each missing unit refills in one period; exact up to the current period's
                    // fraction, which only makes this an upper bound.
                    reset: self.period * (self.burst - remaining),
                }
            }
            Err(not_until) => {
                let retry_after = not_until.wait_time_from(self.local.clock().now());
                Verdict {
                    allowed: false,
                    remaining: 0,
                    retry_after,
                    reset: retry_after + self.period * (self.burst - 1),
                }
            }
        }
    }
}

/// One decision, whichever backend made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Verdict {
    allowed: bool,
    /// Requests the client may still send at once after this one.
    remaining: u32,
    /// When denied: how long until one request will be allowed.
    retry_after: Duration,
    /// How long until the bucket is full again.
    reset: Duration,
}

/// Whole seconds, rounded up: a header that says 0 while the client is still limited would
/// invite an immediate retry.
fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

fn spawn_sweeper(local: Arc<LocalState>, shutdown: CancellationToken) {
    let keys_gauge = metrics::gauge!(LOCAL_KEYS.name);
    // Nothing is tracked before the first request.
    keys_gauge.set(0.0);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(SWEEP_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            let limiter = Arc::clone(&local);
            // `retain_recent` walks every shard under its lock: keep that off the async workers.
            let swept = tokio::task::spawn_blocking(move || {
                limiter.retain_recent();
                limiter.shrink_to_fit();
                limiter.len()
            })
            .await;
            if let Ok(keys) = swept {
                keys_gauge.set(keys as f64);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;
    use crate::config::RateLimitKey;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// Three requests of burst, one a second, the API key identifying the client and a
    /// trusted proxy on loopback.
    pub(super) fn settings(by: RateLimitKey) -> RateLimitSettings {
        RateLimitSettings {
            enabled: true,
            key: by,
            per_second: NonZeroU32::MIN,
            burst: NonZeroU32::new(3).unwrap(),
            trusted_proxies: vec!["127.0.0.1".parse().unwrap()],
            ..RateLimitSettings::default()
        }
    }

    #[tokio::test]
    async fn the_local_limiter_allows_the_burst_then_limits_with_consistent_headers() {
        let limiter = RateLimiter::new(&settings(RateLimitKey::ApiKey), CancellationToken::new())
            .await
            .unwrap();
        let mut h = HeaderMap::new();
        h.insert("x-api-key", HeaderValue::from_static("k"));
        let peer = Some(ip("192.0.2.1"));
        for expected_remaining in [2, 1, 0] {
            match limiter.check(&h, peer).await {
                Decision::Allowed { headers } => {
                    assert_eq!(headers[&RATELIMIT_LIMIT], "3");
                    assert_eq!(
                        headers[&RATELIMIT_REMAINING],
                        expected_remaining.to_string()
                    );
                    assert_eq!(
                        headers[&RATELIMIT_RESET],
                        (3 - expected_remaining).to_string()
                    );
                }
                Decision::Limited { .. } => panic!("within the burst"),
            }
        }
        match limiter.check(&h, peer).await {
            Decision::Limited {
                headers,
                retry_after,
            } => {
                assert_eq!(headers[&RATELIMIT_REMAINING], "0");
                assert!(retry_after > Duration::ZERO && retry_after <= Duration::from_secs(1));
                assert_eq!(headers[&RATELIMIT_RESET], "3");
            }
            Decision::Allowed { .. } => panic!("over the burst"),
        }
        h.insert("x-api-key", HeaderValue::from_static("other"));
        assert!(matches!(
            limiter.check(&h, peer).await,
            Decision::Allowed { .. }
        ));
    }

    #[test]
    fn header_seconds_round_up() {
        assert_eq!(ceil_secs(Duration::ZERO), 0);
        assert_eq!(ceil_secs(Duration::from_millis(1)), 1);
        assert_eq!(ceil_secs(Duration::from_secs(2)), 2);
        assert_eq!(ceil_secs(Duration::from_millis(2001)), 3);
    }
}
