//! The Postgres pool and everything that touches it.
//!
//! The pool is the gateway's scarcest resource: thousands of cheap concurrent requests in front
//! of a few dozen connections is exactly where latency goes when it is sized wrong. So every
//! acquire is measured, and the time spent *waiting* for a pooled connection is kept apart from the time
//! spent *opening* one (sqlx reports neither; see `Db::acquire`). Every statement runs with a
//! `statement_timeout` derived from the request's remaining budget, so a query is never left
//! running on the server after its caller has given up.

pub(crate) mod orders;
mod seed;

use std::{
    cell::Cell,
    str::FromStr,
    sync::{
        Arc,
        atomic::{AtomicI64, Ordering},
    },
    time::Duration,
};

use futures::FutureExt;
use metrics::{Counter, Gauge, Histogram};
use sqlx::{
    PgConnection, PgPool,
    migrate::Migrator,
    pool::PoolConnection,
    postgres::{PgConnectOptions, PgPoolOptions},
};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::{config::DatabaseSettings, telemetry::Family};

/// The migrations in `migrations/`, embedded in the binary.
pub(crate) static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// Statement timeouts are never set below this: a budget that small cannot do useful work, and
/// the caller will not start the query at all (see [`Db::acquire_for_request`]).
const MIN_STATEMENT_TIMEOUT: Duration = Duration::from_millis(5);

tokio::task_local! {
    /// Set to true by the pool's `after_connect` hook when an acquire had to open a connection.
    /// The hook runs inside the acquiring task, so a task-local is exactly scoped to one acquire.
    static OPENED_CONNECTION: Cell<bool>;
}

/// A handle to the pool plus its instruments. Cheap to clone.
#[derive(Clone)]
pub struct Db {
    pool: PgPool,
    metrics: Arc<PoolMetrics>,
}

pub(crate) const POOL_CONNECTIONS: Family = Family::gauge(
    "tributary_db_pool_connections",
    "Database pool connections by state (idle, in_use).",
);
pub(crate) const POOL_MAX_CONNECTIONS: Family = Family::gauge(
    "tributary_db_pool_max_connections",
    "Configured maximum size of the database pool.",
);
pub(crate) const POOL_WAITERS: Family = Family::gauge(
    "tributary_db_pool_waiters",
    "Tasks currently waiting to acquire a database connection.",
);
pub(crate) const POOL_ACQUIRE_WAIT: Family = Family::seconds(
    "tributary_db_pool_acquire_wait_seconds",
    "Time spent waiting for a pooled database connection (acquires that reused one).",
);
pub(crate) const POOL_CONNECT_DURATION: Family = Family::seconds(
    "tributary_db_pool_connect_duration_seconds",
    "Time of request acquires that had to open a new database connection (connections opened in the background for min_connections are not requests' latency and are not included).",
);
pub(crate) const POOL_ACQUIRE_TIMEOUTS: Family = Family::counter(
    "tributary_db_pool_acquire_timeouts_total",
    "Acquires that gave up waiting for a database connection.",
);
pub(crate) const QUERY_DURATION: Family = Family::seconds(
    "tributary_db_query_duration_seconds",
    "Database statement latency by statement name.",
);

/// The families this module records.
pub(crate) const FAMILIES: &[Family] = &[
    POOL_CONNECTIONS,
    POOL_MAX_CONNECTIONS,
    POOL_WAITERS,
    POOL_ACQUIRE_WAIT,
    POOL_CONNECT_DURATION,
    POOL_ACQUIRE_TIMEOUTS,
    QUERY_DURATION,
];

/// How often the pool's occupancy is sampled into its gauges.
const POOL_SAMPLE_EVERY: Duration = Duration::from_secs(1);

struct PoolMetrics {
    waiters: AtomicI64,
    waiters_gauge: Gauge,
    acquire_wait: Histogram,
    connect: Histogram,
    acquire_timeouts: Counter,
    idle: Gauge,
    in_use: Gauge,
    max: Gauge,
    /// Statement latency, one histogram per [`Statement`], indexed by it.
    queries: [Histogram; 3],
}

/// The statements the gateway runs: the bounded `statement` label of query metrics and spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Statement {
    RecentOrders = 0,
    GetOrder = 1,
    CreateOrder = 2,
}

impl PoolMetrics {
    fn register(max_connections: u32) -> Self {
        let this = Self {
            waiters: AtomicI64::new(0),
            waiters_gauge: metrics::gauge!(POOL_WAITERS.name),
            acquire_wait: metrics::histogram!(POOL_ACQUIRE_WAIT.name),
            connect: metrics::histogram!(POOL_CONNECT_DURATION.name),
            acquire_timeouts: metrics::counter!(POOL_ACQUIRE_TIMEOUTS.name),
            idle: metrics::gauge!(POOL_CONNECTIONS.name, "state" => "idle"),
            in_use: metrics::gauge!(POOL_CONNECTIONS.name, "state" => "in_use"),
            max: metrics::gauge!(POOL_MAX_CONNECTIONS.name),
            queries: Statement::ALL
                .map(|s| metrics::histogram!(QUERY_DURATION.name, "statement" => s.name())),
        };
        this.max.set(f64::from(max_connections));
        this
    }
}

impl Statement {
    const ALL: [Statement; 3] = [Self::RecentOrders, Self::GetOrder, Self::CreateOrder];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::RecentOrders => "recent_orders",
            Self::GetOrder => "get_order",
            Self::CreateOrder => "create_order",
        }
    }
}

/// Why a database operation produced no result. The HTTP status each one means is decided in
/// `error.rs`, not here.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DbError {
    /// The request's remaining budget is too small to run a statement.
    #[error("request budget exhausted before the database was reached")]
    BudgetExhausted,
    /// The pool stayed empty for the whole acquire timeout (or the remaining budget).
    #[error("timed out waiting for a database connection")]
    PoolTimedOut,
    /// The server cancelled a statement at its `statement_timeout`: the request's budget ran
    /// out while it ran.
    #[error("the statement outlived the request's budget and was cancelled")]
    StatementTimeout,
    /// Anything else the driver or the server reported.
    #[error(transparent)]
    Database(sqlx::Error),
}

/// Postgres's `query_canceled`, which a `statement_timeout` raises.
const QUERY_CANCELED: &str = "57014";

impl From<sqlx::Error> for DbError {
    fn from(e: sqlx::Error) -> Self {
        match &e {
            sqlx::Error::Database(db) if db.code().as_deref() == Some(QUERY_CANCELED) => {
                DbError::StatementTimeout
            }
            _ => DbError::Database(e),
        }
    }
}

impl Db {
    /// Builds the pool without connecting: the gateway starts (and reports not-ready) while the
    /// database is down, and connections are opened on demand up to `max_connections`.
    pub fn connect_lazy(settings: &DatabaseSettings) -> anyhow::Result<Self> {
        let options =
            PgConnectOptions::from_str(settings.url.expose())?.application_name("tributary");
        let pool = PgPoolOptions::new()
            .max_connections(settings.max_connections.get())
            .min_connections(settings.min_connections)
            .acquire_timeout(settings.acquire_timeout)
            .idle_timeout(settings.idle_timeout)
            .max_lifetime(settings.max_lifetime)
            // No ping before every acquire (sqlx's default): it is a round trip on the hot path,
            // held with the connection. A connection broken by a server restart fails its next
            // statement instead, is discarded by sqlx, and that one part degrades.
            .test_before_acquire(false)
            .after_connect(|_conn, _meta| {
                let _ = OPENED_CONNECTION.try_with(|opened| opened.set(true));
                futures::future::ready(Ok(())).boxed()
            })
            .connect_lazy_with(options);
        let metrics = Arc::new(PoolMetrics::register(settings.max_connections.get()));
        let db = Self { pool, metrics };
        db.record_pool_gauges();
        Ok(db)
    }

    pub(crate) fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies pending migrations.
    pub async fn migrate(&self) -> anyhow::Result<()> {
        MIGRATOR.run(&self.pool).await?;
        Ok(())
    }

    /// Readiness: the database answers and every embedded migration has been applied.
    pub(crate) async fn is_ready(&self) -> Result<(), String> {
        let latest = MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
        let check = async {
            let mut conn = self.acquire(Duration::from_secs(1)).await?;
            // The connection may carry a request's short statement_timeout; give the check its own.
            set_statement_timeout(&mut conn, Duration::from_secs(1)).await?;
            let applied: Option<i64> =
                sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations WHERE success")
                    .fetch_one(&mut *conn)
                    .await
                    .map_err(DbError::Database)?;
            Ok::<_, DbError>(applied)
        };
        // Within the request's deadline, so that the answer is this one and not the edge's 504.
        let give_up = (Instant::now() + Duration::from_secs(2)).min(crate::context::deadline());
        match tokio::time::timeout_at(give_up, check).await {
            Ok(Ok(Some(applied))) if applied >= latest => Ok(()),
            Ok(Ok(applied)) => Err(format!(
                "migrations pending: applied {applied:?}, latest {latest}"
            )),
            Ok(Err(e)) => Err(format!("database unreachable: {e}")),
            Err(_) => Err("database check timed out".into()),
        }
    }

    /// Samples the pool's occupancy into its gauges once a second until `shutdown` is
    /// cancelled (sqlx reports no events to count, so occupancy is polled).
    pub(crate) fn spawn_pool_sampler(&self, shutdown: CancellationToken) {
        let db = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(POOL_SAMPLE_EVERY);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tick.tick() => db.record_pool_gauges(),
                }
            }
        });
    }

    /// Samples pool occupancy into the gauges.
    fn record_pool_gauges(&self) {
        let size = self.pool.size() as f64;
        let idle = self.pool.num_idle() as f64;
        self.metrics.idle.set(idle);
        self.metrics.in_use.set((size - idle).max(0.0));
    }

    /// Acquires a connection, waiting at most `max_wait` (and never longer than the pool's own
    /// acquire timeout). Records waiting and connecting separately: an acquire that had to open
    /// a connection is recorded as connect time (its permit wait is part of it, and is short
    /// whenever a slot was free to open), every other acquire as wait time.
    pub(crate) async fn acquire(
        &self,
        max_wait: Duration,
    ) -> Result<PoolConnection<sqlx::Postgres>, DbError> {
        self.acquire_until(Instant::now() + max_wait).await
    }

    /// Acquires a connection, waiting until `deadline` at most.
    async fn acquire_until(
        &self,
        deadline: Instant,
    ) -> Result<PoolConnection<sqlx::Postgres>, DbError> {
        let m = &self.metrics;
        let _waiting = WaiterGuard::new(m);
        let started = Instant::now();
        let (result, opened) = OPENED_CONNECTION
            .scope(Cell::new(false), async {
                let r = tokio::time::timeout_at(deadline, self.pool.acquire()).await;
                (r, OPENED_CONNECTION.with(Cell::get))
            })
            .await;
        let elapsed = started.elapsed().as_secs_f64();
        match result {
            Ok(Ok(conn)) => {
                if opened {
                    m.connect.record(elapsed);
                } else {
                    m.acquire_wait.record(elapsed);
                }
                Ok(conn)
            }
            Ok(Err(sqlx::Error::PoolTimedOut)) | Err(_) => {
                m.acquire_timeouts.increment(1);
                m.acquire_wait.record(elapsed);
                Err(DbError::PoolTimedOut)
            }
            Ok(Err(e)) => Err(DbError::from(e)),
        }
    }

    /// Acquires a connection for the current request: the wait is bounded by the remaining
    /// budget. Returns the budget left once the connection is held; the caller must put it into
    /// the session's `statement_timeout` before its statements ([`set_statement_timeout`], or
    /// inline in the same round trip), so the server abandons a statement its caller can no
    /// longer use.
    pub(crate) async fn acquire_for_request(
        &self,
    ) -> Result<(PoolConnection<sqlx::Postgres>, Duration), DbError> {
        let deadline = crate::context::deadline();
        if deadline.saturating_duration_since(Instant::now()) < MIN_STATEMENT_TIMEOUT {
            return Err(DbError::BudgetExhausted);
        }
        // The request's own deadline instant, not "now + what is left": a caller that bounds
        // this part by the same deadline (the fan-out does) then sees the pool's timeout fire
        // in the same timer tick, first, and the wait is counted as the acquire timeout it is.
        let conn = self.acquire_until(deadline).await?;
        let left = crate::context::remaining();
        if left < MIN_STATEMENT_TIMEOUT {
            return Err(DbError::BudgetExhausted);
        }
        Ok((conn, left))
    }

    /// Times a statement under its name.
    pub(crate) fn query_timer(&self, statement: Statement) -> QueryTimer {
        QueryTimer {
            histogram: self.metrics.queries[statement as usize].clone(),
            started: Instant::now(),
        }
    }

    pub(crate) async fn close(&self) {
        self.pool.close().await;
    }
}

/// Session-level `statement_timeout`; every request path sets it again before its statements,
/// so a value left behind on a pooled connection is always overwritten before use.
pub(crate) async fn set_statement_timeout(
    conn: &mut PgConnection,
    budget: Duration,
) -> Result<(), DbError> {
    let millis = statement_timeout_ms(budget).to_string();
    sqlx::query("SELECT set_config('statement_timeout', $1, false)")
        .bind(millis)
        .execute(conn)
        .await?;
    Ok(())
}

/// The `statement_timeout` for a budget, in whole milliseconds (never below the floor).
pub(crate) fn statement_timeout_ms(budget: Duration) -> u128 {
    budget.as_millis().max(MIN_STATEMENT_TIMEOUT.as_millis())
}

/// Keeps the waiters gauge right even when an acquire is cancelled mid-wait.
struct WaiterGuard<'a>(&'a PoolMetrics);

impl<'a> WaiterGuard<'a> {
    fn new(m: &'a PoolMetrics) -> Self {
        let n = m.waiters.fetch_add(1, Ordering::Relaxed) + 1;
        m.waiters_gauge.set(n as f64);
        Self(m)
    }
}

impl Drop for WaiterGuard<'_> {
    fn drop(&mut self) {
        let n = self.0.waiters.fetch_sub(1, Ordering::Relaxed) - 1;
        self.0.waiters_gauge.set(n as f64);
    }
}

/// Records a statement's latency under its bounded `statement` label when dropped.
pub(crate) struct QueryTimer {
    histogram: Histogram,
    started: Instant,
}

impl Drop for QueryTimer {
    fn drop(&mut self) {
        self.histogram.record(self.started.elapsed().as_secs_f64());
    }
}
