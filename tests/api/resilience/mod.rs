//! The fault-injection suite: the real gateway, simulator and Postgres, with one thing broken
//! at a time, a file per concern:
//! - [`downstreams`]: slow, hanging, failing and resetting downstreams, breakers, retries;
//! - [`database`]: an outage, a flapping database, a saturated pool, a silent network;
//! - [`admission`]: bursts, memory, disconnect storms, readiness under shedding, the adaptive
//!   limit;
//! - [`limits`]: header limits, slowloris, the connection cap.
//!
//! Every test asserts outcomes (statuses, the `degraded` list, counters, what the simulator and
//! Postgres saw, gauges back at zero), never latencies: this runs on small shared machines.
//! Waits are bounded and generous. The tests here run one at a time (see [`serial`]): several
//! of them saturate the machine on purpose, and several read process-wide gauges that another
//! overload test running beside them would move.

mod admission;
mod database;
mod downstreams;
mod limits;

use tokio::sync::{Mutex, MutexGuard};

use crate::{
    chaos::ChaosProxy,
    helpers::{TestApp, server_url, spawn_app_with},
};

/// Serialises these tests: each one gets the machine (two cores, shared) to itself, and the
/// process-wide gauges it reads are moved only by its own gateway. A tokio mutex, so the guard
/// may be held across `.await`; a test that panics releases it while unwinding.
static SERIAL: Mutex<()> = Mutex::const_new(());

async fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().await
}

/// `host:port` of the Postgres server the tests use.
fn postgres_addr() -> String {
    let url = reqwest::Url::parse(&server_url()).expect("DATABASE_URL is a URL");
    format!(
        "{}:{}",
        url.host_str().unwrap_or("127.0.0.1"),
        url.port().unwrap_or(5432)
    )
}

/// The same database URL, reached through the proxy.
fn through(proxy: &ChaosProxy, url: &str) -> String {
    let mut url = reqwest::Url::parse(url).expect("database URL");
    url.set_host(Some("127.0.0.1")).unwrap();
    url.set_port(Some(proxy.addr().port())).unwrap();
    url.to_string()
}

/// A gateway whose database connections all go through a chaos proxy (the test database
/// itself is created directly on the real server, and `app.db` stays direct).
async fn spawn_app_behind(
    proxy: &ChaosProxy,
    configure: impl FnOnce(&mut tributary::Settings),
) -> TestApp {
    spawn_app_with(|s| {
        let url = through(proxy, s.database.url.expose());
        s.database.url = tributary::config::Secret::new(url);
        configure(s);
    })
    .await
}
