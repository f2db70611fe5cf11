//! What the gateway knows about the database: up, down, or reachable with migrations pending.
//!
//! The state is kept by a background probe (once a second while the database is not known to
//! be up, every few seconds while it is, and at once when a request saw the database fail),
//! and read without I/O by readiness, by the `tributary_db_up` gauge and by every request that
//! would use the database. While the database is *known down* a request does not try it: its
//! dashboard part degrades at once and an order is a 503, instead of each one waiting out its
//! deadline in the pool's connect retries. "Known down" is short-lived by construction: each
//! failed probe extends it by [`KNOWN_DOWN_FOR`], so if nothing confirms the outage any more
//! (the probe stopped), requests try the database again on their own.
//!
//! The database's raw error (which can name a role, a host, a database) is logged once, when
//! the state changes, and never shown to a client or on `/readyz`.

use std::{
    sync::Mutex,
    time::{Duration, Instant},
};

use metrics::Gauge;
use tokio::sync::Notify;

use crate::telemetry::Family;

/// How long one failed check keeps the database "known down".
pub(crate) const KNOWN_DOWN_FOR: Duration = Duration::from_secs(3);

/// How long after a dead pooled connection was found reused connections are tested first.
const SUSPECT_FOR: Duration = Duration::from_secs(10);

pub(crate) const DB_UP: Family = Family::gauge(
    "tributary_db_up",
    "Whether the database answered the gateway's last health check (1) or not (0).",
);

/// The database as the last check saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DbState {
    /// Not checked yet.
    Unknown,
    /// It answers and every embedded migration is applied.
    Up,
    /// It answers, but this binary's migrations are not all applied: this replica's code does
    /// not match the schema.
    MigrationsPending,
    /// It cannot be reached, or refuses the gateway.
    Down,
}

impl DbState {
    /// Every state (the OpenAPI document lists their words).
    pub(crate) const ALL: [DbState; 4] = [
        DbState::Unknown,
        DbState::Up,
        DbState::MigrationsPending,
        DbState::Down,
    ];

    /// How `/readyz` names the state: a fixed word, never the driver's error text.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            DbState::Unknown => "unknown",
            DbState::Up => "ok",
            DbState::MigrationsPending => "migrations pending",
            DbState::Down => "unavailable",
        }
    }
}

struct Snapshot {
    state: DbState,
    /// While the state is `Down`: until when requests need not try.
    down_until: Option<Instant>,
}

pub(crate) struct Health {
    snapshot: Mutex<Snapshot>,
    /// Until when a reused pooled connection is tested before use: a connection was found
    /// dead, so its idle siblings, opened before the same restart, probably are too.
    suspect_until: Mutex<Option<Instant>>,
    /// Wakes the probe early: a request saw the database fail.
    wake: Notify,
    up: Gauge,
}

impl Health {
    pub(crate) fn new() -> Self {
        let up = metrics::gauge!(DB_UP.name);
        up.set(0.0);
        Self {
            snapshot: Mutex::new(Snapshot {
                state: DbState::Unknown,
                down_until: None,
            }),
            suspect_until: Mutex::new(None),
            wake: Notify::new(),
            up,
        }
    }

    pub(crate) fn state(&self) -> DbState {
        self.lock().state
    }

    /// Whether requests should not try the database now.
    pub(crate) fn is_known_down(&self) -> bool {
        let s = self.lock();
        s.state == DbState::Down && s.down_until.is_some_and(|until| Instant::now() < until)
    }

    /// Records what a check (or a failed connect) found; logs the transitions, the cause of
    /// an outage included, once each.
    pub(crate) fn record(&self, state: DbState, cause: Option<String>) {
        let previous = {
            let mut s = self.lock();
            let previous = s.state;
            s.state = state;
            s.down_until = (state == DbState::Down).then(|| Instant::now() + KNOWN_DOWN_FOR);
            previous
        };
        self.up.set(if state == DbState::Down { 0.0 } else { 1.0 });
        if previous == state {
            return;
        }
        match state {
            DbState::Down => {
                let cause = cause.unwrap_or_default();
                tracing::warn!(
                    cause,
                    "database unavailable; requests fail fast until it answers"
                );
            }
            DbState::MigrationsPending => tracing::warn!("database reachable, migrations pending"),
            DbState::Up if previous != DbState::Unknown => {
                tracing::info!("database available again")
            }
            DbState::Up | DbState::Unknown => {}
        }
    }

    /// A pooled connection was found dead (the server restarted, or something between closed
    /// it): for [`SUSPECT_FOR`] every reused connection is tested before it is handed out.
    pub(crate) fn connection_lost(&self) {
        *self
            .suspect_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some(Instant::now() + SUSPECT_FOR);
        self.check_soon();
    }

    /// Whether a reused pooled connection should be tested before use.
    pub(crate) fn pooled_connections_suspect(&self) -> bool {
        self.suspect_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some_and(|until| Instant::now() < until)
    }

    /// Asks the probe to check now.
    pub(crate) fn check_soon(&self) {
        self.wake.notify_one();
    }

    /// Waits for [`check_soon`](Self::check_soon) or `period`, whichever comes first.
    pub(crate) async fn next_check(&self, period: Duration) {
        let _ = tokio::time::timeout(period, self.wake.notified()).await;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Snapshot> {
        // The critical sections only copy a few words; a poisoned lock still holds a valid one.
        self.snapshot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_check_makes_the_database_known_down_and_a_good_one_ends_it() {
        let health = Health::new();
        assert!(!health.is_known_down());
        health.record(DbState::Down, None);
        assert!(health.is_known_down());
        assert_eq!(health.state().as_str(), "unavailable");
        health.record(DbState::Up, None);
        assert!(!health.is_known_down());
        assert_eq!(health.state().as_str(), "ok");
    }
}
