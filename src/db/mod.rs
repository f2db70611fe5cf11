//! The Postgres pool and everything that touches it.
//!
//! The pool is the gateway's scarcest resource: thousands of cheap concurrent requests in front
//! of a few dozen connections is exactly where latency goes when it is sized wrong. So every
//! acquire is measured, and the time spent *waiting* for a pooled connection is kept apart from
//! the time spent *opening* one (see `Db::acquire_until`). The pool is deadpool's, not sqlx's:
//! `pool` says why. Every statement runs with a `statement_timeout` derived from the request's
//! remaining budget, so a query is never left running on the server after its caller has given
//! up.
//!
//! A restarted database leaves the pool full of dead connections, and the pool finds out only
//! when one is used. A statement that fails because its connection is gone is therefore run once
//! more on another connection, when that is safe: always for reads, and for the order
//! transaction only when it failed before `COMMIT` was sent (the server rolls back a
//! transaction whose connection died; after `COMMIT` the outcome is unknown, the client gets a
//! 503, and its idempotency key makes its retry safe). For a while after a dead connection was
//! found, reused connections are tested before use, so the retry does not meet the dead one's
//! idle siblings. What the gateway knows about the database as a whole is in `health`.

mod health;
pub(crate) mod orders;
mod pool;
mod seed;

/// The dashboard micro-benchmark (`benches/`) hands the merge rows it built itself; nothing
/// else outside the crate needs the type.
#[doc(hidden)]
pub use orders::OrderSummary;

use std::{cell::Cell, str::FromStr, sync::Arc, time::Duration};

use deadpool::managed::PoolError;
use metrics::{Counter, Gauge, Histogram};
use sqlx::{
    ConnectOptions, Connection, PgConnection, migrate::Migrator, postgres::PgConnectOptions,
};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::{config::DatabaseSettings, overload::StandingQueue, telemetry::Family};
pub(crate) use health::DbState;
use health::Health;
use pool::{Conn, Connections, OPENED_CONNECTION, Pool, Upkeep};

/// The migrations in `migrations/`, embedded in the binary.
pub(crate) static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// Statement timeouts are never set below this: a budget that small cannot do useful work, and
/// the caller will not start the query at all (see [`Db::acquire_for_request`]).
const MIN_STATEMENT_TIMEOUT: Duration = Duration::from_millis(5);

/// How long a health check may take; also the bound of `/readyz`'s own check.
const CHECK_TIMEOUT: Duration = Duration::from_secs(1);
/// How often the database is checked while it is up, and while it is not.
const CHECK_EVERY_WHILE_UP: Duration = Duration::from_secs(5);
const CHECK_EVERY_WHILE_DOWN: Duration = Duration::from_secs(1);
/// Postgres's `undefined_table`: `_sqlx_migrations` does not exist, nothing was migrated.
const UNDEFINED_TABLE: &str = "42P01";

/// A handle to the pool plus its instruments. Cheap to clone.
#[derive(Clone)]
pub struct Db {
    pool: Pool,
    /// Idle timeout, lifetime and `min_connections`, kept by the pool sampler.
    upkeep: Arc<Upkeep>,
    /// The longest wait for a pooled connection (`database.acquire_timeout`).
    acquire_timeout: Duration,
    metrics: Arc<PoolMetrics>,
    health: Arc<Health>,
    /// For the health check's own connection, which tells "the pool is full" from "the
    /// database is down" (the pool's acquire hides a refused connect behind its timeout).
    /// Behind an `Arc`: the application state, and this with it, is cloned for every request
    /// (axum's `State` and `from_fn_with_state`), and a `PgConnectOptions` clone copies its
    /// host, user, database and application name, four allocations each time.
    options: Arc<PgConnectOptions>,
    /// Whether admitted requests stand in line for a connection: admission shrinks its limit
    /// while they do (see [`crate::overload::StandingQueue`]).
    queue: StandingQueue,
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

pub(crate) const POOL_QUEUE_STANDING: Family = Family::gauge(
    "tributary_db_pool_queue_standing",
    "1 while every wait for a pooled connection over the last 100 ms was longer than overload.queue_delay_target, or the waits averaged over twice it (more requests admitted than the pool serves; the adaptive admission limit shrinks), else 0.",
);

/// The families this module records.
pub(crate) const FAMILIES: &[Family] = &[
    POOL_CONNECTIONS,
    POOL_QUEUE_STANDING,
    POOL_MAX_CONNECTIONS,
    POOL_WAITERS,
    POOL_ACQUIRE_WAIT,
    POOL_CONNECT_DURATION,
    POOL_ACQUIRE_TIMEOUTS,
    QUERY_DURATION,
    health::DB_UP,
];

/// How often the pool's occupancy is sampled into its gauges.
const POOL_SAMPLE_EVERY: Duration = Duration::from_secs(1);

struct PoolMetrics {
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
    /// The database cannot be reached or refuses the gateway: a connection refused, closed
    /// or reset, a failed login (a wrong role or password), a missing database, a server
    /// shutting down or out of connection slots.
    #[error("the database is unavailable")]
    Unavailable(#[source] sqlx::Error),
    /// Not attempted: the database is known to be down (see `health`).
    #[error("the database is known to be down")]
    KnownDown,
    /// Anything else the driver or the server reported.
    #[error(transparent)]
    Database(sqlx::Error),
}

/// The database named in `database.url` does not exist on its server. Waiting cannot help,
/// so start-up stops at once with this one line instead of retrying.
#[derive(Debug, thiserror::Error)]
#[error(
    "database \"{name}\" does not exist on {host}:{port}: create it with \
     `createdb -h {host} -p {port} -U {user} {name}` (make dev creates it for you)"
)]
pub struct MissingDatabase {
    name: String,
    host: String,
    port: u16,
    user: String,
}

/// Postgres's `invalid_catalog_name`: the database in the connection string does not exist.
const INVALID_CATALOG_NAME: &str = "3D000";

/// Whether an error, or one of its causes, is the server saying the database does not exist.
fn names_missing_database(e: &(dyn std::error::Error + 'static)) -> bool {
    std::iter::successors(Some(e), |e| e.source()).any(|e| {
        e.downcast_ref::<sqlx::Error>()
            .and_then(sqlx::Error::as_database_error)
            .and_then(|db| db.code())
            .as_deref()
            == Some(INVALID_CATALOG_NAME)
    })
}

/// Postgres's `query_canceled`, which a `statement_timeout` raises.
const QUERY_CANCELED: &str = "57014";

impl From<sqlx::Error> for DbError {
    fn from(e: sqlx::Error) -> Self {
        match &e {
            sqlx::Error::Database(db) if db.code().as_deref() == Some(QUERY_CANCELED) => {
                DbError::StatementTimeout
            }
            sqlx::Error::PoolTimedOut => DbError::PoolTimedOut,
            _ if is_unavailable(&e) => DbError::Unavailable(e),
            _ => DbError::Database(e),
        }
    }
}

impl From<PoolError<sqlx::Error>> for DbError {
    fn from(e: PoolError<sqlx::Error>) -> Self {
        match e {
            PoolError::Backend(e) => e.into(),
            PoolError::Timeout(_) => DbError::PoolTimedOut,
            PoolError::Closed => DbError::Unavailable(sqlx::Error::PoolClosed),
            // No runtime and no hooks are configured (see `Db::connect_lazy`).
            e @ (PoolError::NoRuntimeSpecified | PoolError::PostCreateHook(_)) => {
                DbError::Database(sqlx::Error::Protocol(e.to_string()))
            }
        }
    }
}

impl DbError {
    /// Whether statements failed because their connection was gone (or the database is): run
    /// on another connection they may succeed, the database having come back.
    pub(crate) fn is_connection_lost(&self) -> bool {
        matches!(self, DbError::Unavailable(_))
    }
}

/// Whether an error says the database (or the way to it) is the problem, not the statement.
fn is_unavailable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            // Class 08: connection exception; 28: invalid authorization (no such role, wrong
            // password); 3D000 (INVALID_CATALOG_NAME): no such database; 57P01-03: the server is shutting down,
            // crashed, or not yet accepting connections; 53300: too many connections.
            code.starts_with("08")
                || code.starts_with("28")
                || code.starts_with("57P")
                || code == INVALID_CATALOG_NAME
                || code == "53300"
        }),
        _ => false,
    }
}

impl Db {
    /// Builds the pool without connecting: the gateway starts (and reports not-ready) while the
    /// database is down, and connections are opened on demand up to `max_connections`.
    pub fn connect_lazy(settings: &DatabaseSettings) -> anyhow::Result<Self> {
        let options = Arc::new(
            PgConnectOptions::from_str(settings.url.expose())?.application_name("tributary"),
        );
        // No test before a connection is reused (a round trip on the hot path, held with the
        // connection): one broken by a server restart fails its next statement instead, which
        // is then retried once on another connection (see the module's documentation), and
        // reused connections are pinged for a while after. No pool-level timeouts either: every
        // acquire is bounded by its caller (`acquire_raw`).
        let queue = StandingQueue::new(
            metrics::gauge!(POOL_QUEUE_STANDING.name),
            metrics::gauge!(POOL_WAITERS.name),
        );
        let pool = Pool::builder(Connections::new(
            Arc::clone(&options),
            settings.max_lifetime,
            queue.clone(),
        ))
        .max_size(settings.max_connections.get() as usize)
        .build()?;
        let metrics = Arc::new(PoolMetrics::register(settings.max_connections.get()));
        let db = Self {
            pool,
            upkeep: Arc::new(Upkeep::new(
                settings.min_connections() as usize,
                settings.idle_timeout,
            )),
            acquire_timeout: settings.acquire_timeout,
            metrics,
            health: Arc::new(Health::new()),
            options,
            queue,
        };
        db.record_pool_gauges();
        Ok(db)
    }

    /// A connection for work outside a request (migrations, the seed), within
    /// `database.acquire_timeout`. The caller settles it when its statements are done.
    async fn acquire_plain(&self) -> Result<Conn, DbError> {
        let (conn, _) = self
            .acquire_raw(Instant::now() + self.acquire_timeout)
            .await?;
        Ok(conn)
    }

    /// The pool's wait line, as the admission limit watches it.
    pub(crate) fn queue(&self) -> &StandingQueue {
        &self.queue
    }

    /// Applies pending migrations. A database that does not exist is a [`MissingDatabase`],
    /// which says how to create it.
    pub async fn migrate(&self) -> anyhow::Result<()> {
        let result: anyhow::Result<()> = async {
            let mut conn = self.acquire_plain().await?;
            MIGRATOR.run(&mut **conn).await?;
            conn.settle();
            Ok(())
        }
        .await;
        match result {
            Err(e) if names_missing_database(e.as_ref()) => Err(MissingDatabase {
                name: self.options.get_database().unwrap_or("postgres").to_owned(),
                host: self.options.get_host().to_owned(),
                port: self.options.get_port(),
                user: self.options.get_username().to_owned(),
            }
            .into()),
            r => r,
        }
    }

    /// The database's state for readiness: what the probe last saw when it is up or known
    /// down, and a check of its own otherwise (before the first probe, and while migrations
    /// are pending, so that applying them shows at once).
    pub(crate) async fn readiness(&self) -> DbState {
        match self.health.state() {
            DbState::Up => DbState::Up,
            DbState::Down if self.health.is_known_down() => DbState::Down,
            known => {
                // Within the request's deadline, so that the answer is this one and not the
                // edge's 504; the last known state when the check takes longer.
                let give_up = crate::context::deadline()
                    .checked_sub(Duration::from_millis(50))
                    .unwrap_or_else(Instant::now);
                tokio::time::timeout_at(give_up, self.check())
                    .await
                    .unwrap_or(known)
            }
        }
    }

    /// Checks the database (it answers, and every embedded migration is applied) and records
    /// the result in `health`.
    async fn check(&self) -> DbState {
        let latest = MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
        let applied = tokio::time::timeout(CHECK_TIMEOUT, async {
            // A dead pooled connection says nothing about the database: check on another.
            match self.applied_migrations().await {
                Err(DbError::Unavailable(_)) => self.applied_migrations().await,
                r => r,
            }
        })
        .await;
        let (state, cause) = match applied {
            Ok(Ok(Some(applied))) if applied >= latest => (DbState::Up, None),
            Ok(Ok(_)) => (DbState::MigrationsPending, None),
            Ok(Err(DbError::Database(sqlx::Error::Database(e))))
                if e.code().as_deref() == Some(UNDEFINED_TABLE) =>
            {
                (DbState::MigrationsPending, None)
            }
            // A full pool, or no answer in time: whether the database is down or only busy is
            // for a connection of the check's own to tell.
            Ok(Err(DbError::PoolTimedOut)) | Err(_) => match self.connect_directly().await {
                Ok(()) => match self.health.state() {
                    DbState::Down | DbState::Unknown => (DbState::Up, None),
                    known => (known, None),
                },
                Err(cause) => (DbState::Down, Some(cause)),
            },
            Ok(Err(e)) => (DbState::Down, Some(causes(&e))),
        };
        self.health.record(state, cause);
        state
    }

    /// The latest migration applied, on a pooled connection.
    async fn applied_migrations(&self) -> Result<Option<i64>, DbError> {
        let (mut conn, _) = self
            .acquire_raw(Instant::now() + CHECK_TIMEOUT.min(self.acquire_timeout))
            .await?;
        let result = async {
            // The connection may carry a request's short statement_timeout; give the check its own.
            set_statement_timeout(&mut conn, CHECK_TIMEOUT).await?;
            sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations WHERE success")
                .fetch_one(&mut **conn)
                .await
                .map_err(DbError::from)
        }
        .await;
        self.release(conn, result.as_ref().err());
        result
    }

    /// Opens and closes a connection outside the pool; the error, as a log line, when it fails.
    async fn connect_directly(&self) -> Result<(), String> {
        match tokio::time::timeout(CHECK_TIMEOUT, self.options.connect()).await {
            Ok(Ok(conn)) => {
                let _ = conn.close().await;
                Ok(())
            }
            Ok(Err(e)) => Err(causes(&e)),
            Err(_) => Err(format!("no answer within {CHECK_TIMEOUT:?}")),
        }
    }

    /// Checks the database until `shutdown` is cancelled: every few seconds while it is up,
    /// every second while it is not, and at once when a request saw it fail. The first check
    /// waits a period: until then readiness checks by itself, and a check racing the first
    /// requests at start-up made the OpenTelemetry test lose their trace context (seen, not
    /// yet explained).
    fn spawn_health_probe(&self, shutdown: CancellationToken) {
        let db = self.clone();
        tokio::spawn(async move {
            loop {
                let period = match db.health.state() {
                    DbState::Up => CHECK_EVERY_WHILE_UP,
                    _ => CHECK_EVERY_WHILE_DOWN,
                };
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = db.health.next_check(period) => {}
                }
                db.check().await;
            }
        });
    }

    /// Samples the pool's occupancy into its gauges once a second until `shutdown` is
    /// cancelled (the pool reports no events to count, so occupancy is polled), and keeps the
    /// pool (`pool::maintain`); starts the health probe beside it.
    pub(crate) fn spawn_pool_sampler(&self, shutdown: CancellationToken) {
        self.spawn_health_probe(shutdown.clone());
        let db = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(POOL_SAMPLE_EVERY);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tick.tick() => {
                        pool::maintain(&db.pool, &db.upkeep, db.health.is_known_down());
                        db.record_pool_gauges();
                    }
                }
            }
        });
    }

    /// Samples pool occupancy into the gauges.
    fn record_pool_gauges(&self) {
        let status = self.pool.status();
        self.metrics.idle.set(status.available as f64);
        self.metrics
            .in_use
            .set(status.size.saturating_sub(status.available) as f64);
    }

    /// Acquires a connection, waiting until `deadline` at most. Records waiting and connecting
    /// separately: an acquire that had to open a connection is recorded as connect time (its
    /// permit wait is part of it, and is short whenever a slot was free to open), every other
    /// acquire as wait time.
    async fn acquire_until(&self, deadline: Instant) -> Result<Conn, DbError> {
        let m = &self.metrics;
        // Counted (and in the waiters gauge) until the acquire ends, however it ends.
        let _in_line = self.queue.enter();
        let started = Instant::now();
        let result = self
            .acquire_raw(deadline.min(started + self.acquire_timeout))
            .await;
        let waited = started.elapsed();
        let elapsed = waited.as_secs_f64();
        match result {
            Ok((conn, opened)) => {
                if opened {
                    // Opening a connection is not waiting in line for one.
                    m.connect.record(elapsed);
                } else {
                    m.acquire_wait.record(elapsed);
                    self.queue.waited(waited);
                }
                Ok(conn)
            }
            Err(DbError::PoolTimedOut) => {
                m.acquire_timeouts.increment(1);
                m.acquire_wait.record(elapsed);
                self.queue.waited(waited);
                // A full pool, or a database that does not answer a connect: the probe tells
                // which.
                self.health.check_soon();
                Err(DbError::PoolTimedOut)
            }
            Err(e) => {
                if let DbError::Unavailable(cause) = &e {
                    // A connect that failed: refused, a login refused, no such database.
                    self.health.record(DbState::Down, Some(causes(cause)));
                }
                Err(e)
            }
        }
    }

    /// Acquires a connection until `deadline` (callers keep it within `database.acquire_timeout`),
    /// and whether it had to be opened. While pooled connections are suspect, a reused one is
    /// pinged first and a dead one discarded.
    async fn acquire_raw(&self, deadline: Instant) -> Result<(Conn, bool), DbError> {
        loop {
            // Boxed: deadpool's checkout future is some 700 bytes, and inline it would make
            // every future above it, up to the dashboard's orders part, as large, each moved
            // whole into its parent's state on the first poll.
            let (result, opened) = OPENED_CONNECTION
                .scope(Cell::new(false), async {
                    let get = Box::pin(self.pool.get());
                    let r = tokio::time::timeout_at(deadline, get).await;
                    (r, OPENED_CONNECTION.with(Cell::get))
                })
                .await;
            let mut conn = match result {
                Ok(Ok(conn)) => conn,
                Ok(Err(e)) => return Err(DbError::from(e)),
                Err(_) => return Err(DbError::PoolTimedOut),
            };
            if opened || !self.health.pooled_connections_suspect() {
                return Ok((conn, opened));
            }
            match tokio::time::timeout_at(deadline, conn.ping()).await {
                Ok(Ok(())) => return Ok((conn, opened)),
                Ok(Err(_)) => self.discard(conn),
                Err(_) => return Err(DbError::PoolTimedOut),
            }
        }
    }

    /// Closes a connection found dead instead of returning it to the pool, and makes its
    /// siblings suspect.
    pub(crate) fn discard(&self, conn: Conn) {
        drop(deadpool::managed::Object::take(conn));
        self.health.connection_lost();
    }

    /// Gives a connection back after its statements ended with `error` (or none): discarded
    /// when the error says the connection is gone, settled otherwise (every statement was
    /// answered, so it goes back without a drain).
    pub(crate) fn release(&self, mut conn: Conn, error: Option<&DbError>) {
        if error.is_some_and(DbError::is_connection_lost) {
            self.discard(conn);
        } else {
            conn.settle();
        }
    }

    /// Acquires a connection for the current request: the wait is bounded by the remaining
    /// budget. Returns the budget left once the connection is held; the caller must put it into
    /// the session's `statement_timeout` before its statements ([`set_statement_timeout`], or
    /// inline in the same round trip), so the server abandons a statement its caller can no
    /// longer use.
    pub(crate) async fn acquire_for_request(&self) -> Result<(Conn, Duration), DbError> {
        let deadline = crate::context::deadline();
        if deadline.saturating_duration_since(Instant::now()) < MIN_STATEMENT_TIMEOUT {
            return Err(DbError::BudgetExhausted);
        }
        if self.health.is_known_down() {
            return Err(DbError::KnownDown);
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
        pool::close(&self.pool).await;
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

/// An error and its causes on one line, for the health log (`error::chain` is a layer above).
fn causes(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
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
