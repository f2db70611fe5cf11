//! Per-client rate limiting: 429 "you are too fast", kept apart from admission's 503
//! "we are full". The middleware (`http::middleware::rate_limit`) sits before admission, so a
//! client over its rate never takes an admission slot; health and metrics are never limited.
//!
//! # The client
//! With `key = "api_key"` the client is the value of `api_key_header`, falling back to the
//! client IP when the header is absent; with `key = "ip"` it is the client IP. The client IP is
//! the TCP peer, unless the peer is inside `trusted_proxies`: then `X-Forwarded-For` is read from
//! the right, skipping trusted proxies, and the first untrusted entry is the client (entries to
//! its left were written by the client itself and prove nothing). Keys are hashed (SHA-256,
//! 16 bytes) so an API key — a credential — is never stored in Redis, and every local entry
//! has the same small size whatever the client sends.
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
//! # Shared limit through Redis
//! With `redis_url` set, every decision is one `EVALSHA` of [`GCRA_SCRIPT`] (atomic in Redis,
//! using Redis's clock so replicas with skewed clocks agree) on a connection from a deadpool-redis
//! pool. The whole call — waiting for a pooled connection included — is bounded by
//! `redis_timeout`. When it times out or fails, that request is decided by the local limiter,
//! `tributary_ratelimit_redis_fallbacks_total{reason}` counts it, and Redis is marked down:
//! following requests go straight to the local limiter (`reason="unavailable"`) without paying
//! the timeout, while one background task probes Redis every [`REDIS_RETRY_EVERY`] and marks it
//! up again once a connection, the script load and a `PING` within `redis_timeout` all succeed.
//! Logging follows the state, not the traffic: one warning when Redis goes down, one line when it
//! recovers, and a reminder every [`OUTAGE_LOG_EVERY`] while it stays down. Redis trouble never
//! fails a request; start-up does not wait for Redis either (it starts with Redis marked down).
//! During an outage each replica enforces the full limit on its own, so a client can get up to
//! `replicas ×` its limit until Redis is back: the gateway fails open to per-replica limits rather
//! than closed.

use std::{
    fmt,
    net::{IpAddr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::Context as _;
use axum::{
    extract::ConnectInfo,
    http::{HeaderMap, HeaderName, HeaderValue, Request},
};
use deadpool_redis::{
    Pool, PoolConfig, Runtime,
    redis::{self, Script},
};
use governor::{
    clock::{Clock, DefaultClock},
    middleware::StateInformationMiddleware,
    state::keyed::DefaultKeyedStateStore,
};
use metrics::{Counter, Histogram};
use sha2::{Digest, Sha256};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tower_governor::{
    GovernorError,
    governor::{GovernorConfigBuilder, SharedRateLimiter},
    key_extractor::KeyExtractor,
};

use crate::{
    config::{Cidr, RateLimitKey, RateLimitSettings, Secret},
    telemetry::Family,
};

/// How often quiet clients are dropped from the local limiter's map.
pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(10);
/// How often a Redis marked down is probed again.
pub(crate) const REDIS_RETRY_EVERY: Duration = Duration::from_secs(1);
/// Budget for opening a connection and loading the script, at start-up and in probes. Longer
/// than `redis_timeout`: a connection set-up (TCP, TLS, AUTH) is not a request's round trip,
/// and it happens off the request path.
pub(crate) const REDIS_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// While Redis stays down, how often the outage is logged again.
pub(crate) const OUTAGE_LOG_EVERY: Duration = Duration::from_secs(60);
/// Prefix of every Redis key this module writes.
pub(crate) const REDIS_KEY_PREFIX: &str = "tributary:ratelimit:";

/// GCRA in one atomic step. `KEYS[1]`: the client. `ARGV[1]`: emission interval `T` in µs.
/// `ARGV[2]`: burst. Returns `{allowed (0|1), remaining, retry_after µs, reset µs}`, where
/// reset is the time until the bucket is full again. Times are Redis's own (`TIME`), in µs,
/// which Lua's doubles hold exactly; values written back go through `%d` so that no digit is
/// lost to Lua's default number formatting.
pub(crate) const GCRA_SCRIPT: &str = r#"
if redis.replicate_commands then redis.replicate_commands() end
local t = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local tau = t * (burst - 1)
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if tat < now then tat = now end
local earliest = tat - tau
if now < earliest then
  return {0, 0, earliest - now, tat - now}
end
local new_tat = tat + t
local ttl_ms = math.ceil((new_tat - now) / 1000)
redis.call('SET', KEYS[1], string.format('%d', new_tat), 'PX', string.format('%d', ttl_ms))
return {1, math.floor((now + tau + t - new_tat) / t), 0, new_tat - now}
"#;

pub(crate) const REJECTIONS: Family = Family::counter(
    "tributary_ratelimit_rejections_total",
    "Requests rejected with 429 by per-client rate limiting, by backend.",
);
pub(crate) const REDIS_FALLBACKS: Family = Family::counter(
    "tributary_ratelimit_redis_fallbacks_total",
    "Rate-limit decisions that fell back to the local limiter because Redis was slow or down.",
);
pub(crate) const REDIS_DURATION: Family = Family::seconds(
    "tributary_ratelimit_redis_duration_seconds",
    "Duration of Redis rate-limit decisions, by outcome (ok, error, timeout).",
);
pub(crate) const LOCAL_KEYS: Family = Family::gauge(
    "tributary_ratelimit_local_keys",
    "Clients tracked by this replica's local rate limiter after the last sweep.",
);

/// The families this module records.
pub(crate) const FAMILIES: &[Family] = &[REJECTIONS, REDIS_FALLBACKS, REDIS_DURATION, LOCAL_KEYS];

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

/// The Redis backend's instruments, one handle per label value.
struct RedisInstruments {
    /// By [`Fallback`], indexed by it.
    fallbacks: [Counter; 3],
    /// By outcome, indexed by [`Self::OK`], [`Self::ERROR`], [`Self::TIMEOUT`].
    duration: [Histogram; 3],
}

impl RedisInstruments {
    const OUTCOMES: [&'static str; 3] = ["ok", "error", "timeout"];
    const OK: usize = 0;
    const ERROR: usize = 1;
    const TIMEOUT: usize = 2;

    fn register() -> Self {
        Self {
            fallbacks: Fallback::ALL
                .map(|f| metrics::counter!(REDIS_FALLBACKS.name, "reason" => f.label())),
            duration: Self::OUTCOMES
                .map(|o| metrics::histogram!(REDIS_DURATION.name, "outcome" => o)),
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
                    redis.metrics.fallbacks[reason as usize].increment(1);
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

/// A client's identity for rate limiting: a 16-byte digest of what identifies it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ClientKey([u8; 16]);

impl ClientKey {
    fn digest(kind: &str, value: &[u8]) -> Self {
        let mut h = Sha256::new();
        h.update(kind.as_bytes());
        h.update([0]);
        h.update(value);
        let mut key = [0; 16];
        key.copy_from_slice(&h.finalize()[..16]);
        Self(key)
    }

    /// The client's key in Redis.
    pub(crate) fn redis_key(&self) -> String {
        format!("{REDIS_KEY_PREFIX}{}", hex::encode(self.0))
    }
}

impl fmt::Debug for ClientKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ClientKey({})", hex::encode(self.0))
    }
}

/// Who is asking: the API key or the client IP, per `rate_limit.key`.
#[derive(Debug, Clone)]
pub(crate) struct ClientKeyExtractor {
    by: RateLimitKey,
    api_key_header: HeaderName,
    trusted: Arc<[Cidr]>,
}

impl ClientKeyExtractor {
    pub(crate) fn new(settings: &RateLimitSettings) -> Self {
        Self {
            by: settings.key,
            api_key_header: settings.api_key_header.clone(),
            trusted: settings.trusted_proxies.iter().copied().collect(),
        }
    }

    /// The key of the client that sent these headers over a connection from `peer`.
    pub(crate) fn key(&self, headers: &HeaderMap, peer: Option<IpAddr>) -> ClientKey {
        if self.by == RateLimitKey::ApiKey
            && let Some(api_key) = headers.get(&self.api_key_header).filter(|v| !v.is_empty())
        {
            return ClientKey::digest("api_key", api_key.as_bytes());
        }
        match client_ip(headers, peer, &self.trusted) {
            Some(ip) => ClientKey::digest("ip", ip.to_string().as_bytes()),
            // Only without a connection (in-process `oneshot` tests): one shared bucket.
            None => ClientKey::digest("ip", b"unknown"),
        }
    }
}

impl KeyExtractor for ClientKeyExtractor {
    type Key = ClientKey;

    fn extract<T>(&self, req: &Request<T>) -> Result<Self::Key, GovernorError> {
        let peer = req
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0.ip());
        Ok(self.key(req.headers(), peer))
    }
}

/// The client's address: the peer, unless the peer is a trusted proxy; then `X-Forwarded-For`
/// is walked from the right past trusted proxies, and the first untrusted entry is the client.
/// An entry that does not parse stops the walk at the last trusted hop: anything further left
/// could have been written by anyone.
pub(crate) fn client_ip(
    headers: &HeaderMap,
    peer: Option<IpAddr>,
    trusted: &[Cidr],
) -> Option<IpAddr> {
    let peer = peer?.to_canonical();
    let is_trusted = |ip: IpAddr| trusted.iter().any(|c| c.contains(ip));
    if !is_trusted(peer) {
        return Some(peer);
    }
    // Several X-Forwarded-For fields are one list, in order (RFC 9110, 5.3).
    let hops: Vec<&str> = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let mut nearest = peer;
    for hop in hops.iter().rev() {
        match parse_hop(hop) {
            Some(ip) if is_trusted(ip) => nearest = ip,
            Some(ip) => return Some(ip),
            None => return Some(nearest),
        }
    }
    Some(nearest)
}

/// One `X-Forwarded-For` entry: `1.2.3.4`, `1.2.3.4:5678`, `2001:db8::1` or `[2001:db8::1]:80`.
fn parse_hop(hop: &str) -> Option<IpAddr> {
    if let Ok(ip) = hop.parse::<IpAddr>() {
        return Some(ip.to_canonical());
    }
    hop.parse::<SocketAddr>()
        .ok()
        .map(|s| s.ip().to_canonical())
}

/// Why a decision did not come from Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fallback {
    /// No answer within `redis_timeout`.
    Timeout,
    /// Redis answered with an error, or the connection failed.
    Error,
    /// Not asked: Redis is marked down after a recent failure (or since start-up).
    Unavailable,
}

impl Fallback {
    const ALL: [Fallback; 3] = [Fallback::Timeout, Fallback::Error, Fallback::Unavailable];

    fn label(self) -> &'static str {
        match self {
            Fallback::Timeout => "timeout",
            Fallback::Error => "error",
            Fallback::Unavailable => "unavailable",
        }
    }
}

/// The Redis side: pool, script, and whether Redis is currently believed to be up.
struct SharedLimit {
    pool: Pool,
    script: Script,
    /// `host:port` for logs; the URL itself may hold a password.
    addr: String,
    timeout: Duration,
    period_us: u64,
    burst: u32,
    down: AtomicBool,
    metrics: RedisInstruments,
    /// Stops the prober.
    shutdown: CancellationToken,
}

impl SharedLimit {
    async fn connect(
        url: &Secret,
        settings: &RateLimitSettings,
        period: Duration,
        burst: u32,
        shutdown: CancellationToken,
    ) -> anyhow::Result<Arc<Self>> {
        let mut config = deadpool_redis::Config::from_url(url.expose());
        config.pool = Some(PoolConfig::new(settings.redis_pool_size.get()));
        // Only a malformed URL fails here; nothing is connected yet.
        let pool = config
            .create_pool(Some(Runtime::Tokio1))
            .context("rate_limit.redis_url")?;
        let addr = reqwest::Url::parse(url.expose())
            .ok()
            .map(|u| {
                format!(
                    "{}:{}",
                    u.host_str().unwrap_or("?"),
                    u.port().unwrap_or(6379)
                )
            })
            .unwrap_or_else(|| "?".into());
        let this = Arc::new(Self {
            pool,
            script: Script::new(GCRA_SCRIPT),
            addr,
            timeout: settings.redis_timeout,
            period_us: u64::try_from(period.as_micros()).unwrap_or(u64::MAX).max(1),
            burst,
            down: AtomicBool::new(false),
            metrics: RedisInstruments::register(),
            shutdown,
        });
        match this.probe().await {
            Ok(()) => tracing::info!(redis = %this.addr, "rate limits are shared through Redis"),
            Err(e) => {
                this.down.store(true, Ordering::Release);
                tracing::warn!(
                    redis = %this.addr,
                    error = %format_args!("{e:#}"),
                    "Redis for rate limiting is unreachable at start-up; each replica limits on its own until it answers"
                );
                this.spawn_prober();
            }
        }
        Ok(this)
    }

    /// Redis's decision, or why there is none (counted and, on a change of state, logged).
    async fn decide(self: &Arc<Self>, key: &ClientKey) -> Result<Verdict, Fallback> {
        if self.down.load(Ordering::Acquire) {
            return Err(Fallback::Unavailable);
        }
        let started = Instant::now();
        let answer = tokio::time::timeout(self.timeout, self.eval(key)).await;
        let (outcome, result) = match answer {
            Ok(Ok(verdict)) => (RedisInstruments::OK, Ok(verdict)),
            Ok(Err(e)) => (
                RedisInstruments::ERROR,
                Err((Fallback::Error, format!("{e:#}"))),
            ),
            Err(_) => (
                RedisInstruments::TIMEOUT,
                Err((
                    Fallback::Timeout,
                    format!("no answer within {:?}", self.timeout),
                )),
            ),
        };
        self.metrics.duration[outcome].record(started.elapsed().as_secs_f64());
        result.map_err(|(reason, detail)| {
            self.mark_down(reason, &detail);
            reason
        })
    }

    async fn eval(&self, key: &ClientKey) -> anyhow::Result<Verdict> {
        let mut conn = self.pool.get().await?;
        let (allowed, remaining, retry_us, reset_us): (i64, i64, i64, i64) = self
            .script
            .key(key.redis_key())
            .arg(self.period_us)
            .arg(self.burst)
            .invoke_async(&mut conn)
            .await?;
        let micros = |v: i64| Duration::from_micros(u64::try_from(v).unwrap_or(0));
        Ok(Verdict {
            allowed: allowed == 1,
            remaining: u32::try_from(remaining).unwrap_or(0).min(self.burst),
            retry_after: micros(retry_us),
            reset: micros(reset_us),
        })
    }

    /// Connection (within [`REDIS_CONNECT_TIMEOUT`]), script loaded, and a `PING` answered
    /// within `redis_timeout`: a Redis that answers, but slower than a request may wait, is
    /// not up.
    async fn probe(&self) -> anyhow::Result<()> {
        let mut conn = tokio::time::timeout(REDIS_CONNECT_TIMEOUT, self.pool.get())
            .await
            .context("timed out connecting")??;
        tokio::time::timeout(REDIS_CONNECT_TIMEOUT, self.script.load_async(&mut conn))
            .await
            .context("timed out loading the script")??;
        tokio::time::timeout(
            self.timeout,
            redis::cmd("PING").query_async::<String>(&mut conn),
        )
        .await
        .context("PING slower than rate_limit.redis_timeout")??;
        Ok(())
    }

    fn mark_down(self: &Arc<Self>, reason: Fallback, detail: &str) {
        if !self.down.swap(true, Ordering::AcqRel) {
            tracing::warn!(
                redis = %self.addr,
                reason = reason.label(),
                error = detail,
                "Redis for rate limiting failed; falling back to the local limiter until it recovers"
            );
            self.spawn_prober();
        }
    }

    /// One task per outage: probes until Redis is back, then marks it up and ends (or when
    /// the application shuts down).
    fn spawn_prober(self: &Arc<Self>) {
        let this = Arc::clone(self);
        tokio::spawn(async move {
            let since = Instant::now();
            let mut logged = since;
            loop {
                let probed = tokio::select! {
                    _ = this.shutdown.cancelled() => return,
                    probed = async {
                        tokio::time::sleep(REDIS_RETRY_EVERY).await;
                        this.probe().await
                    } => probed,
                };
                match probed {
                    Ok(()) => {
                        this.down.store(false, Ordering::Release);
                        tracing::info!(
                            redis = %this.addr,
                            down_for_s = since.elapsed().as_secs(),
                            "Redis for rate limiting recovered; limits are shared again"
                        );
                        return;
                    }
                    Err(e) if logged.elapsed() >= OUTAGE_LOG_EVERY => {
                        logged = Instant::now();
                        tracing::warn!(
                            redis = %this.addr,
                            down_for_s = since.elapsed().as_secs(),
                            error = %format_args!("{e:#}"),
                            "Redis for rate limiting is still unavailable; each replica limits on its own"
                        );
                    }
                    Err(e) => {
                        tracing::debug!(redis = %this.addr, error = %format_args!("{e:#}"), "Redis probe failed");
                    }
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;

    fn cidrs(list: &[&str]) -> Vec<Cidr> {
        list.iter().map(|s| s.parse().unwrap()).collect()
    }

    fn xff(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append("x-forwarded-for", HeaderValue::from_str(v).unwrap());
        }
        h
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn forwarded_for_is_ignored_from_an_untrusted_peer() {
        let trusted = cidrs(&["10.0.0.0/8"]);
        let h = xff(&["203.0.113.9"]);
        assert_eq!(
            client_ip(&h, Some(ip("198.51.100.1")), &trusted),
            Some(ip("198.51.100.1"))
        );
        assert_eq!(
            client_ip(&h, Some(ip("10.0.0.1")), &[]),
            Some(ip("10.0.0.1")),
            "no trusted proxies: never believed"
        );
    }

    #[test]
    fn from_a_trusted_peer_the_right_most_untrusted_entry_is_the_client() {
        let trusted = cidrs(&["10.0.0.0/8"]);
        let peer = Some(ip("10.0.0.1"));
        // The client forged the left-most entry; the proxies appended the rest.
        let h = xff(&["1.1.1.1, 203.0.113.9, 10.0.0.7"]);
        assert_eq!(client_ip(&h, peer, &trusted), Some(ip("203.0.113.9")));
        // Split across several fields, in order.
        let h = xff(&["1.1.1.1", "203.0.113.9", "10.0.0.7"]);
        assert_eq!(client_ip(&h, peer, &trusted), Some(ip("203.0.113.9")));
        // Ports and brackets as some proxies write them.
        let h = xff(&["198.51.100.4:5123"]);
        assert_eq!(client_ip(&h, peer, &trusted), Some(ip("198.51.100.4")));
        let h = xff(&["[2001:db8::4]:443"]);
        assert_eq!(client_ip(&h, peer, &trusted), Some(ip("2001:db8::4")));
    }

    #[test]
    fn a_chain_of_only_trusted_hops_or_no_header_yields_the_nearest_known_hop() {
        let trusted = cidrs(&["10.0.0.0/8"]);
        let peer = Some(ip("10.0.0.1"));
        assert_eq!(client_ip(&HeaderMap::new(), peer, &trusted), peer);
        let h = xff(&["10.0.0.9, 10.0.0.7"]);
        assert_eq!(client_ip(&h, peer, &trusted), Some(ip("10.0.0.9")));
        // Garbage stops the walk: the forged address to its left is not believed.
        let h = xff(&["203.0.113.9, unknown, 10.0.0.7"]);
        assert_eq!(client_ip(&h, peer, &trusted), Some(ip("10.0.0.7")));
    }

    #[test]
    fn an_ipv4_mapped_peer_is_treated_as_ipv4() {
        let trusted = cidrs(&["127.0.0.1/32"]);
        let h = xff(&["203.0.113.9"]);
        assert_eq!(
            client_ip(&h, Some(ip("::ffff:127.0.0.1")), &trusted),
            Some(ip("203.0.113.9"))
        );
        assert_eq!(
            client_ip(&HeaderMap::new(), Some(ip("::ffff:192.0.2.1")), &[]),
            Some(ip("192.0.2.1"))
        );
    }

    fn settings(by: RateLimitKey) -> RateLimitSettings {
        RateLimitSettings {
            enabled: true,
            key: by,
            per_second: NonZeroU32::MIN,
            burst: NonZeroU32::new(3).unwrap(),
            trusted_proxies: cidrs(&["127.0.0.1"]),
            ..RateLimitSettings::default()
        }
    }

    #[test]
    fn the_api_key_identifies_the_client_and_the_ip_is_the_fallback() {
        let keys = ClientKeyExtractor::new(&settings(RateLimitKey::ApiKey));
        let peer = Some(ip("192.0.2.1"));
        let mut with_key = HeaderMap::new();
        with_key.insert("x-api-key", HeaderValue::from_static("secret-123"));
        let a = keys.key(&with_key, peer);
        assert_eq!(
            a,
            keys.key(&with_key, Some(ip("192.0.2.2"))),
            "same key, any IP"
        );
        assert_ne!(a, keys.key(&HeaderMap::new(), peer));
        assert_eq!(
            keys.key(&HeaderMap::new(), peer),
            ClientKey::digest("ip", b"192.0.2.1")
        );
        assert!(
            !a.redis_key().contains("secret"),
            "credentials never reach Redis"
        );
        assert!(a.redis_key().starts_with(REDIS_KEY_PREFIX));

        let by_ip = ClientKeyExtractor::new(&settings(RateLimitKey::Ip));
        assert_eq!(
            by_ip.key(&with_key, peer),
            by_ip.key(&HeaderMap::new(), peer)
        );
    }

    #[test]
    fn the_tower_governor_extractor_reads_the_peer_from_connect_info() {
        let keys = ClientKeyExtractor::new(&settings(RateLimitKey::Ip));
        let mut req = Request::builder()
            .header("x-forwarded-for", "203.0.113.9")
            .body(())
            .unwrap();
        req.extensions_mut()
            .insert(ConnectInfo(SocketAddr::from(([127, 0, 0, 1], 4000))));
        let key = keys.extract(&req).unwrap();
        assert_eq!(key, ClientKey::digest("ip", b"203.0.113.9"));
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
