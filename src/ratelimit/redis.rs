//! The limit shared by every replica through Redis.
//!
//! With `redis_url` set, every decision is one `EVALSHA` of [`GCRA_SCRIPT`] (atomic in Redis,
//! using Redis's clock so replicas with skewed clocks agree) on a connection from a deadpool
//! pool: one round trip. The pool's manager ([`Connections`]) recycles a connection without
//! asking Redis (deadpool-redis's own sends a `PING` on every checkout, a second round trip
//! per decision): a connection that failed is marked and dropped at its next checkout, and a
//! decision whose connection turns out dead (Redis restarted) is tried again on another one,
//! which costs no wait, since a dead connection fails at once. The whole call — waiting for a
//! pooled connection included — is bounded by `redis_timeout`. When it times out or fails, that request is decided by the local limiter,
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
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::Context as _;
use deadpool::managed;
use deadpool_redis::redis::{self, RedisError, Script, aio::MultiplexedConnection};
use metrics::{Counter, Histogram};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{ClientKey, Verdict};
use crate::{
    config::{RateLimitSettings, Secret},
    telemetry::Family,
};

/// How often a Redis marked down is probed again.
pub(crate) const REDIS_RETRY_EVERY: Duration = Duration::from_secs(1);
/// Budget for opening a connection and loading the script, at start-up and in probes. Longer
/// than `redis_timeout`: a connection set-up (TCP, TLS, AUTH) is not a request's round trip,
/// and it happens off the request path.
pub(crate) const REDIS_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// While Redis stays down, how often the outage is logged again.
pub(crate) const OUTAGE_LOG_EVERY: Duration = Duration::from_secs(60);
/// Prefix of every Redis key this module writes.
pub(super) const REDIS_KEY_PREFIX: &str = "tributary:ratelimit:";

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
pub(crate) const FALLBACKS: Family = Family::counter(
    "tributary_ratelimit_redis_fallbacks_total",
    "Rate-limit decisions that fell back to the local limiter because Redis was slow or down.",
);

pub(crate) const DURATION: Family = Family::seconds(
    "tributary_ratelimit_redis_duration_seconds",
    "Duration of Redis rate-limit decisions, by outcome (ok, error, timeout).",
);

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
                .map(|f| metrics::counter!(FALLBACKS.name, "reason" => f.label())),
            duration: Self::OUTCOMES.map(|o| metrics::histogram!(DURATION.name, "outcome" => o)),
        }
    }
}

/// Why a decision did not come from Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fallback {
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

/// deadpool's pool of multiplexed Redis connections, managed by [`Connections`].
type Pool = managed::Pool<Connections>;

/// Opens connections, and recycles them without a round trip: a connection is reused unless a
/// command on it failed in a way that leaves it unusable.
pub(super) struct Connections {
    client: redis::Client,
}

/// A pooled connection and whether it failed.
pub(super) struct Tracked {
    conn: MultiplexedConnection,
    broken: bool,
}

impl managed::Manager for Connections {
    type Type = Tracked;
    type Error = RedisError;

    async fn create(&self) -> Result<Tracked, RedisError> {
        Ok(Tracked {
            conn: self.client.get_multiplexed_async_connection().await?,
            broken: false,
        })
    }

    async fn recycle(
        &self,
        conn: &mut Tracked,
        _: &managed::Metrics,
    ) -> managed::RecycleResult<RedisError> {
        if conn.broken {
            Err(managed::RecycleError::message("the connection failed"))
        } else {
            Ok(())
        }
    }
}

/// The Redis side: pool, script, and whether Redis is currently believed to be up.
pub(super) struct SharedLimit {
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
    pub(super) async fn connect(
        url: &Secret,
        settings: &RateLimitSettings,
        period: Duration,
        burst: u32,
        shutdown: CancellationToken,
    ) -> anyhow::Result<Arc<Self>> {
        // Only a malformed URL fails here; nothing is connected yet.
        let client = redis::Client::open(url.expose()).context("rate_limit.redis_url")?;
        let pool = Pool::builder(Connections { client })
            .max_size(settings.redis_pool_size.get())
            .build()
            .context("rate_limit.redis_pool_size")?;
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

    /// Counts a decision that fell back to the local limiter, by why.
    pub(super) fn count_fallback(&self, reason: Fallback) {
        self.metrics.fallbacks[reason as usize].increment(1);
    }

    /// Redis's decision, or why there is none (counted and, on a change of state, logged).
    pub(super) async fn decide(self: &Arc<Self>, key: &ClientKey) -> Result<Verdict, Fallback> {
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
        // Every pooled connection may have died at once (a Redis restart): each fails at
        // once, is dropped, and the next is tried; a fresh one ends the loop.
        let mut attempts = self.pool.status().max_size + 1;
        let (allowed, remaining, retry_us, reset_us): (i64, i64, i64, i64) = loop {
            let mut conn = self.pool.get().await?;
            let answer = self
                .script
                .key(key.redis_key())
                .arg(self.period_us)
                .arg(self.burst)
                .invoke_async(&mut conn.conn)
                .await;
            match answer {
                Ok(answer) => break answer,
                Err(e) if e.is_unrecoverable_error() => {
                    conn.broken = true;
                    attempts -= 1;
                    if attempts == 0 {
                        return Err(e.into());
                    }
                }
                Err(e) => return Err(e.into()),
            }
        };
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
        let checked = async {
            tokio::time::timeout(
                REDIS_CONNECT_TIMEOUT,
                self.script.load_async(&mut conn.conn),
            )
            .await
            .context("timed out loading the script")??;
            tokio::time::timeout(
                self.timeout,
                redis::cmd("PING").query_async::<String>(&mut conn.conn),
            )
            .await
            .context("PING slower than rate_limit.redis_timeout")??;
            anyhow::Ok(())
        }
        .await;
        // A probe that failed leaves no suspect connection in the pool.
        conn.broken = checked.is_err();
        checked
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
