//! The connection pool: deadpool over sqlx's `PgConnection`, not sqlx's own pool.
//!
//! sqlx's pool sends a `Sync` to every connection it takes back and waits for the answer
//! before the connection is idle again (`return_to_pool`'s ping). That cannot be turned off
//! (`test_before_acquire(false)` only drops the ping *before* an acquire), so a dashboard's one
//! query cost two round trips. Measured in the lab (docs/benchmarks.md, "sqlx pings every
//! connection it takes back"): 3–4.5 % of a dashboard's CPU and 1.2 system calls per answer, and
//! 6–19 % of goodput under overload on a whole core, where every returned connection needed three
//! wake-ups instead of one. The ping also has no timeout: a database that goes silent strands
//! every connection on its way back.
//!
//! The ping exists for one case: a connection given back in the middle of a statement (its
//! caller's future was dropped, say at the request's deadline), whose answer is still on the
//! wire. Here the code that ran the statements says when a connection is settled
//! ([`Pooled::settle`]), and only one that was not is drained (a `Sync` and its answer, bounded
//! by [`DRAIN_TIMEOUT`]) when it is next checked out, and closed if that fails. A transaction
//! dropped before its `COMMIT` queues its `ROLLBACK` in sqlx's write buffer, and the next
//! statement on the connection sends it first, so a settled connection is never mid-transaction.
//!
//! The rest of what sqlx's pool did for us is small and lives here: connections older than
//! `max_lifetime` are closed at checkout instead of reused ([`Connections::recycle`]); those
//! idle past `idle_timeout`, beyond `min_connections`, are closed by [`maintain`], which the
//! pool sampler calls once a second; and the same call opens connections in the background
//! while fewer than `min_connections` are open and the database is not known to be down.

use std::{
    cell::Cell,
    ops::{Deref, DerefMut},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use deadpool::managed::{self, Metrics, RecycleError, RecycleResult};
use sqlx::{ConnectOptions, Connection, PgConnection, postgres::PgConnectOptions};

use crate::overload::StandingQueue;

/// How long an unsettled connection may take to answer its drain before it is closed instead.
/// Its statement was given the caller's remaining budget as `statement_timeout`, so the server
/// gives up on it within that; one second is longer than any request's budget by default.
pub(crate) const DRAIN_TIMEOUT: Duration = Duration::from_secs(1);
/// How long background work on a connection may take: a graceful close (`Terminate`) of a
/// retired one, or a connect that warms the pool up.
const BACKGROUND_TIMEOUT: Duration = Duration::from_secs(1);

tokio::task_local! {
    /// Set to true by [`Connections::create`] when an acquire had to open a connection. The
    /// pool runs `create` inside the acquiring task, so a task-local is exactly scoped to one
    /// acquire (see `Db::acquire_raw`).
    pub(crate) static OPENED_CONNECTION: Cell<bool>;
}

/// The pool of Postgres connections.
pub(crate) type Pool = managed::Pool<Connections>;
/// A connection checked out of the pool; back in the pool when dropped.
pub(crate) type Conn = managed::Object<Connections>;

/// Opens and recycles the pool's connections.
pub(crate) struct Connections {
    options: Arc<PgConnectOptions>,
    max_lifetime: Duration,
    /// The pool's wait line: told while a connection is being opened, so that a line formed
    /// while the pool is still growing is not taken for one it is too small for.
    line: StandingQueue,
}

impl Connections {
    pub(crate) fn new(
        options: Arc<PgConnectOptions>,
        max_lifetime: Duration,
        line: StandingQueue,
    ) -> Self {
        Self {
            options,
            max_lifetime,
            line,
        }
    }
}

/// A pooled connection, and whether the last user let its statements finish.
pub(crate) struct Pooled {
    conn: PgConnection,
    settled: bool,
}

impl Pooled {
    /// Says that every statement sent on this connection has been answered: it goes back to
    /// the pool as it is. A connection checked out and never settled (its user's future was
    /// dropped mid-statement, or its user forgot) is drained before its next use.
    pub(crate) fn settle(&mut self) {
        self.settled = true;
    }
}

impl Deref for Pooled {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        &self.conn
    }
}

impl DerefMut for Pooled {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.conn
    }
}

impl managed::Manager for Connections {
    type Type = Pooled;
    type Error = sqlx::Error;

    async fn create(&self) -> Result<Pooled, sqlx::Error> {
        // Boxed: a connect's future is several KB, and inline it would be part of every
        // acquire's future, paid (and moved) by the many acquires that reuse a connection.
        let _growing = self.line.growing();
        let conn = Box::pin(self.options.connect()).await?;
        let _ = OPENED_CONNECTION.try_with(|opened| opened.set(true));
        Ok(Pooled {
            conn,
            settled: false,
        })
    }

    async fn recycle(&self, pooled: &mut Pooled, metrics: &Metrics) -> RecycleResult<sqlx::Error> {
        if metrics.age() >= self.max_lifetime {
            return Err(RecycleError::message("older than database.max_lifetime"));
        }
        if !pooled.settled {
            // Boxed, timer and all, for the same reason as the connect: it is the rare path.
            let conn = &mut pooled.conn;
            match Box::pin(tokio::time::timeout(DRAIN_TIMEOUT, conn.ping())).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(RecycleError::Backend(e)),
                Err(_) => return Err(RecycleError::message("no answer while draining")),
            }
        }
        // Checked out again: unsettled until its new user says otherwise.
        pooled.settled = false;
        Ok(())
    }
}

/// What [`maintain`] needs besides the pool.
pub(crate) struct Upkeep {
    pub(crate) min_connections: usize,
    pub(crate) idle_timeout: Duration,
    /// Set while a warm-up task runs, so that at most one does.
    warming: AtomicBool,
}

impl Upkeep {
    pub(crate) fn new(min_connections: usize, idle_timeout: Duration) -> Self {
        Self {
            min_connections,
            idle_timeout,
            warming: AtomicBool::new(false),
        }
    }
}

/// Closes idle connections past `idle_timeout` (keeping `min_connections` open) or past the
/// manager's `max_lifetime`, and opens connections in the background while fewer than
/// `min_connections` are open, unless `database_down`. Called once a second; never waits.
pub(crate) fn maintain(pool: &Pool, upkeep: &Arc<Upkeep>, database_down: bool) {
    let max_lifetime = pool.manager().max_lifetime;
    let mut open = pool.status().size;
    let removed = pool
        .retain(|_, m: Metrics| {
            let retire = m.age() >= max_lifetime
                || (m.last_used() >= upkeep.idle_timeout && open > upkeep.min_connections);
            if retire {
                open -= 1;
            }
            !retire
        })
        .removed;
    if !removed.is_empty() {
        tokio::spawn(close_gracefully(removed));
    }
    if open >= upkeep.min_connections
        || database_down
        || upkeep.warming.swap(true, Ordering::AcqRel)
    {
        return;
    }
    let (pool, upkeep) = (pool.clone(), Arc::clone(upkeep));
    tokio::spawn(async move {
        // Held together, so that each checkout past the idle ones opens a new connection. Not
        // in `OPENED_CONNECTION`'s scope: background connects are not a request's latency.
        let mut held = Vec::with_capacity(upkeep.min_connections);
        while held.len() < upkeep.min_connections {
            match tokio::time::timeout(BACKGROUND_TIMEOUT, pool.get()).await {
                Ok(Ok(mut conn)) => {
                    conn.settle();
                    held.push(conn);
                }
                _ => break,
            }
        }
        drop(held);
        upkeep.warming.store(false, Ordering::Release);
    });
}

/// Closes the pool: waiters fail at once, idle connections are closed gracefully, and those in
/// use are dropped (their sockets closed) as they come back.
pub(crate) async fn close(pool: &Pool) {
    let removed = pool.retain(|_, _| false).removed;
    pool.close();
    close_gracefully(removed).await;
}

/// Closes connections taken out of the pool with a `Terminate` each, within
/// [`BACKGROUND_TIMEOUT`] each.
async fn close_gracefully(connections: Vec<Pooled>) {
    for pooled in connections {
        let _ = tokio::time::timeout(BACKGROUND_TIMEOUT, pooled.conn.close()).await;
    }
}

#[cfg(test)]
mod tests {
    use std::{str::FromStr, time::Instant};

    use deadpool::managed::Manager;
    use sqlx::Executor;

    use super::*;

    /// Against the real Postgres the integration tests use (`DATABASE_URL`).
    fn url() -> String {
        std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
    }

    fn manager(max_lifetime: Duration) -> Connections {
        manager_with_line(max_lifetime, line())
    }

    fn line() -> StandingQueue {
        StandingQueue::new(
            metrics::gauge!("test_pool_line"),
            metrics::gauge!("test_pool_line_length"),
        )
    }

    fn manager_with_line(max_lifetime: Duration, line: StandingQueue) -> Connections {
        let options = PgConnectOptions::from_str(&url()).expect("DATABASE_URL");
        Connections::new(Arc::new(options), max_lifetime, line)
    }

    #[tokio::test]
    async fn opening_a_connection_keeps_the_line_from_standing_in_that_window() {
        let line = line();
        let manager = manager_with_line(Duration::from_secs(60), line.clone());
        let target = Duration::from_millis(5);
        // One window in which every wait was long: a line, not yet standing.
        line.waited(Duration::from_millis(40));
        assert!(!line.close_window(target, false));
        // The next window's waits are as long, but the pool opened a connection in it: the
        // line is the pool growing, not a pool too small.
        let _conn = manager.create().await.expect("Postgres at DATABASE_URL");
        line.waited(Duration::from_millis(40));
        assert!(
            !line.close_window(target, false),
            "a connection was opened in the window"
        );
        // Without a connect, two such windows stand.
        line.waited(Duration::from_millis(40));
        assert!(!line.close_window(target, false));
        line.waited(Duration::from_millis(40));
        assert!(
            line.close_window(target, false),
            "the pool done growing: it stands"
        );
    }

    /// Opens a pooled connection and ends its server session, as a database restart would,
    /// waiting (up to 5 s) until the server has.
    async fn opened_then_killed(manager: &Connections, admin: &mut PgConnection) -> Pooled {
        let mut pooled = manager.create().await.expect("Postgres at DATABASE_URL");
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut pooled.conn)
            .await
            .unwrap();
        let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 5000)")
            .bind(pid)
            .fetch_one(admin)
            .await
            .unwrap();
        assert!(ended, "the test could not end its connection's session");
        pooled
    }

    /// What this pool is for: a connection whose statements were all answered goes back into
    /// use without a round trip (so a dead one is not noticed at checkout: its next statement
    /// fails and is retried, see `db`'s documentation), while one that was not settled is
    /// tested on the wire first and replaced when that fails.
    #[tokio::test]
    async fn only_an_unsettled_connection_costs_a_round_trip_at_checkout() {
        let manager = manager(Duration::from_secs(600));
        let mut admin = PgConnection::connect(&url()).await.unwrap();
        let fresh = Metrics::default();

        let mut settled = opened_then_killed(&manager, &mut admin).await;
        settled.settle();
        assert!(
            manager.recycle(&mut settled, &fresh).await.is_ok(),
            "a settled connection was tested on the wire at checkout"
        );

        let mut unsettled = opened_then_killed(&manager, &mut admin).await;
        assert!(
            manager.recycle(&mut unsettled, &fresh).await.is_err(),
            "an unsettled dead connection was handed out"
        );
        admin.close().await.unwrap();
    }

    /// A caller that gave up in the middle of a statement leaves its answer on the wire; the
    /// connection is drained at its next checkout, and its next user gets its own answer.
    #[tokio::test]
    async fn a_connection_left_mid_statement_is_drained_and_answers_its_next_user() {
        let manager = manager(Duration::from_secs(600));
        let mut admin = PgConnection::connect(&url()).await.unwrap();
        let mut pooled = manager.create().await.expect("Postgres at DATABASE_URL");
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut pooled.conn)
            .await
            .unwrap();
        let gave_up = tokio::time::timeout(
            Duration::from_millis(50),
            pooled.conn.execute("SELECT pg_sleep(0.5)"),
        )
        .await;
        assert!(gave_up.is_err(), "the statement was meant to be abandoned");
        manager
            .recycle(&mut pooled, &Metrics::default())
            .await
            .expect("the drain");
        let state: String = sqlx::query_scalar("SELECT state FROM pg_stat_activity WHERE pid = $1")
            .bind(pid)
            .fetch_one(&mut admin)
            .await
            .unwrap();
        assert_eq!(
            state, "idle",
            "checked out while its last statement still ran"
        );
        let answer: i32 = sqlx::query_scalar("SELECT 42")
            .fetch_one(&mut pooled.conn)
            .await
            .unwrap();
        assert_eq!(answer, 42);
        pooled.conn.close().await.unwrap();
        admin.close().await.unwrap();
    }

    #[tokio::test]
    async fn a_connection_past_max_lifetime_is_not_reused() {
        let manager = manager(Duration::from_secs(60));
        let mut pooled = manager.create().await.expect("Postgres at DATABASE_URL");
        pooled.settle();
        let old = Metrics {
            created: Instant::now() - Duration::from_secs(61),
            ..Metrics::default()
        };
        assert!(manager.recycle(&mut pooled, &old).await.is_err());
        pooled.settle();
        assert!(
            manager
                .recycle(&mut pooled, &Metrics::default())
                .await
                .is_ok()
        );
        pooled.conn.close().await.unwrap();
    }

    /// What sqlx's pool did in the background, kept: `min_connections` opened while fewer are
    /// open (and not while the database is known down), and idle connections past
    /// `idle_timeout` closed down to `min_connections`.
    #[tokio::test]
    async fn the_sampler_keeps_min_connections_open_and_closes_the_idle_rest() {
        let pool = Pool::builder(manager(Duration::from_secs(600)))
            .max_size(8)
            .build()
            .unwrap();
        let upkeep = Arc::new(Upkeep::new(2, Duration::ZERO));

        maintain(&pool, &upkeep, true);
        assert!(
            !upkeep.warming.load(Ordering::Acquire),
            "warming up while the database is known down"
        );

        maintain(&pool, &upkeep, false);
        // The warm-up runs in its own task; give it up to 5 s to open two connections.
        for _ in 0..500 {
            if !upkeep.warming.load(Ordering::Acquire) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(pool.status().size, 2, "min_connections not opened");

        let held: Vec<Conn> = futures::future::try_join_all((0..4).map(|_| pool.get()))
            .await
            .unwrap();
        for mut conn in held {
            conn.settle();
        }
        assert_eq!(pool.status().size, 4);
        maintain(&pool, &upkeep, false);
        assert_eq!(
            pool.status().size,
            2,
            "idle connections past idle_timeout kept"
        );
        close(&pool).await;
    }
}
