//! The fault-injection suite: the real gateway, simulator and Postgres, with one thing broken
//! at a time — slow or hanging downstreams, failing and resetting ones, a database that goes
//! away or is saturated, bursts, disconnect storms, sustained overload and abusive clients.
//!
//! Every test asserts outcomes (statuses, the `degraded` list, counters, what the simulator and
//! Postgres saw, gauges back at zero), never latencies: this runs on small shared machines.
//! Waits are bounded and generous. The tests in this module run one at a time (see [`serial`]):
//! several of them saturate the machine on purpose, and several read process-wide gauges that
//! another overload test running beside them would move.

use std::{
    future::Future,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use futures::future::join_all;
use serde_json::{Value, json};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    sync::{Mutex, MutexGuard},
    time::Instant,
};
use tributary::{
    config::{Ratio, RouteGroup},
    domain::Service,
    sim::Mode,
};

use crate::{
    chaos::ChaosProxy,
    helpers::{
        TestApp, eventually, metric_value, nz, nz32, optional, problem, server_url, spawn_app_with,
    },
};

/// Serialises this module's tests: each one gets the machine (two cores, shared) to itself,
/// and the process-wide gauges it reads are moved only by its own gateway. A tokio mutex, so
/// the guard may be held across `.await`; a test that panics releases it while unwinding.
static SERIAL: Mutex<()> = Mutex::const_new(());

async fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().await
}

/// Polls an async `check` every 20 ms until it returns true or `within` passes.
async fn until<F, Fut>(within: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A sample from the gateway's `/metrics`, 0 when the series does not exist yet.
async fn metric(app: &TestApp, name: &str, labels: &[(&str, &str)]) -> f64 {
    metric_value(&app.metrics().await, name, labels).unwrap_or(0.0)
}

async fn dashboard(app: &TestApp, user_id: i64) -> (u16, Value) {
    let resp = app.get(&format!("/api/v1/dashboard/{user_id}")).await;
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

fn degraded(body: &Value) -> Vec<String> {
    body["degraded"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// Applies `f` to the settings of all five downstreams.
fn every_downstream(
    s: &mut tributary::Settings,
    f: impl Fn(&mut tributary::config::DownstreamSettings),
) {
    for d in s.downstreams.iter_mut() {
        f(d);
    }
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

// ---------------------------------------------------------------------------------------------
// Slow, hanging, failing and resetting downstreams
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_simulator_ten_times_slower_than_the_timeouts_degrades_optional_parts_and_times_out_the_required_one()
 {
    let _serial = serial().await;
    let timeout = Duration::from_millis(200);
    let app = spawn_app_with(|s| {
        s.server.request_deadline = Duration::from_secs(1);
        every_downstream(s, |d| d.timeout = timeout);
    })
    .await;
    for (service, _) in optional() {
        app.set_service(service, |b| b.latency = timeout * 10);
    }
    let mut timeouts_before = Vec::new();
    for (service, _) in optional() {
        timeouts_before.push(
            metric(
                &app,
                "tributary_fanout_degraded_total",
                &[("part", service.as_str()), ("reason", "timeout")],
            )
            .await,
        );
    }

    let (status, body) = dashboard(&app, 1).await;

    assert_eq!(status, 200, "{body}");
    assert_eq!(body["profile"]["service"], "users");
    assert_eq!(
        degraded(&body),
        ["cart", "recommendations", "promotions", "notifications"]
    );
    for (_, field) in optional() {
        assert!(body[field].is_null(), "{field} should be null: {body}");
    }
    for ((service, _), before) in optional().iter().zip(timeouts_before) {
        let after = metric(
            &app,
            "tributary_fanout_degraded_total",
            &[("part", service.as_str()), ("reason", "timeout")],
        )
        .await;
        assert!(after > before, "{service} not degraded as a timeout");
    }
    // The gateway did not wait for the slow answers: every slow call was abandoned, none ran
    // to completion.
    assert!(
        eventually(Duration::from_secs(5), || optional().iter().all(
            |(s, _)| {
                let st = app.sim.sim.stats(*s);
                st.cancelled == 1 && st.in_flight == 0 && st.completed == 0
            }
        ))
        .await,
        "slow calls outlived their timeout"
    );

    // Now the required part is ten times slower too: a 504, and again nothing left running.
    app.set_service(Service::Users, |b| b.latency = timeout * 10);
    let users_before = app.sim.sim.stats(Service::Users);
    let (status, body) = problem(app.get("/api/v1/dashboard/1").await).await;
    assert_eq!(status, 504);
    assert_eq!(body["type"], "/problems/gateway-timeout");
    assert!(
        eventually(Duration::from_secs(5), || {
            let st = app.sim.sim.stats(Service::Users);
            st.cancelled == users_before.cancelled + 1
                && st.completed == users_before.completed
                && st.in_flight == 0
        })
        .await,
        "the required call outlived its timeout"
    );
    assert!(
        eventually(Duration::from_secs(5), || Service::ALL.iter().all(|s| app
            .sim
            .sim
            .stats(*s)
            .in_flight
            == 0))
        .await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_downstream_hanging_forever_is_null_and_degraded_and_its_in_flight_count_returns_to_zero()
{
    let _serial = serial().await;
    let app = spawn_app_with(|s| {
        every_downstream(s, |d| d.max_concurrency = nz(8));
        s.downstreams.recommendations.timeout = Duration::from_millis(200);
    })
    .await;
    app.hang(Service::Recommendations);

    let responses = join_all((1..=5).map(|user| dashboard(&app, user))).await;

    for (status, body) in &responses {
        assert_eq!(*status, 200, "{body}");
        assert!(body["recommendations"].is_null(), "{body}");
        assert_eq!(degraded(body), ["recommendations"]);
        for field in ["profile", "cart", "promotions", "notifications"] {
            assert!(!body[field].is_null(), "{field} missing: {body}");
        }
        assert!(body["recent_orders"].is_array(), "{body}");
    }
    assert_eq!(app.sim.sim.stats(Service::Recommendations).requests, 5);
    assert!(
        eventually(Duration::from_secs(5), || {
            app.sim.sim.stats(Service::Recommendations).in_flight == 0
                && app
                    .state
                    .downstreams
                    .all()
                    .iter()
                    .all(|d| d.available_permits() == 8)
        })
        .await,
        "hanging calls or their bulkhead permits outlived their requests: {:?} {:?}",
        app.sim.sim.stats(Service::Recommendations),
        app.state
            .downstreams
            .all()
            .map(|d| (d.service(), d.available_permits()))
    );
    assert!(
        until(Duration::from_secs(10), || async {
            metric(
                &app,
                "tributary_downstream_in_flight",
                &[("downstream", "recommendations")],
            )
            .await
                == 0.0
        })
        .await,
        "the in-flight gauge did not return to zero"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_and_resetting_downstreams_open_their_circuits_and_half_open_probes_close_them() {
    let _serial = serial().await;
    let open_for = Duration::from_millis(500);
    let app = spawn_app_with(|s| {
        s.circuit_breaker.min_calls = 4;
        s.circuit_breaker.failure_ratio = Ratio::of(0.5);
        s.circuit_breaker.window = Duration::from_secs(30);
        s.circuit_breaker.open_for = open_for;
        s.circuit_breaker.half_open_probes = 2;
        s.retry.max_retries = 1;
        s.retry.backoff_base = Duration::from_millis(2);
        s.retry.budget_min_per_sec = 1000;
    })
    .await;
    app.set_service(Service::Carts, |b| b.error_rate = 1.0);
    app.set_service(Service::Promotions, |b| b.mode = Mode::Reset);
    let retries_before = metric(
        &app,
        "tributary_downstream_retries_total",
        &[("downstream", "promotions")],
    )
    .await;

    // Closed: every call reaches the simulator and fails; after min_calls failures, open.
    for _ in 0..4 {
        let (status, body) = dashboard(&app, 1).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(degraded(&body), ["cart", "promotions"]);
    }
    let broken = [Service::Carts, Service::Promotions];
    for service in broken {
        assert_eq!(
            app.state.downstreams.get(service).breaker_state(),
            tributary::downstream::breaker::State::Open,
            "{service}"
        );
    }
    let retries_after = metric(
        &app,
        "tributary_downstream_retries_total",
        &[("downstream", "promotions")],
    )
    .await;
    assert!(
        retries_after >= retries_before + 4.0,
        "a reset connection is retried: {retries_before} -> {retries_after}"
    );

    // Open: the parts degrade without the simulator hearing about it. A burst fired at once
    // fits in one open period; at most one half-open round (probes plus their retries) may
    // slip through on a slow machine.
    let seen = |s: Service| app.sim.sim.stats(s).requests;
    let (carts_before, promotions_before) = (seen(Service::Carts), seen(Service::Promotions));
    let open_before = metric(
        &app,
        "tributary_downstream_requests_total",
        &[("downstream", "carts"), ("outcome", "circuit_open")],
    )
    .await;
    let burst = join_all((0..10).map(|_| dashboard(&app, 1))).await;
    for (status, body) in &burst {
        assert_eq!(*status, 200, "{body}");
        assert_eq!(degraded(body), ["cart", "promotions"]);
    }
    let slipped = 2 * 2;
    assert!(
        seen(Service::Carts) - carts_before <= slipped,
        "carts still called"
    );
    assert!(
        seen(Service::Promotions) - promotions_before <= slipped,
        "promotions still called"
    );
    let open_after = metric(
        &app,
        "tributary_downstream_requests_total",
        &[("downstream", "carts"), ("outcome", "circuit_open")],
    )
    .await;
    assert!(
        open_after >= open_before + 8.0,
        "{open_before} -> {open_after}"
    );
    // The state gauge says "open" (2). Traffic keeps flowing while we look, so a failed
    // half-open probe re-opens the circuit and sets the gauge again even if another gateway in
    // this process (they share one recorder) was built in between.
    assert!(
        until(Duration::from_secs(5), || async {
            let _ = dashboard(&app, 1).await;
            let text = app.metrics().await;
            broken.iter().all(|s| {
                metric_value(
                    &text,
                    "tributary_downstream_circuit_state",
                    &[("downstream", s.as_str())],
                ) == Some(2.0)
            })
        })
        .await,
        "circuit state gauge never showed open"
    );

    // Healthy again: after open_for, half-open probes succeed and close the circuits.
    app.set_service(Service::Carts, |b| b.error_rate = 0.0);
    app.set_service(Service::Promotions, |b| b.mode = Mode::Normal);
    let closed = until(Duration::from_secs(10), || async {
        let (status, body) = dashboard(&app, 1).await;
        status == 200
            && degraded(&body).is_empty()
            && broken.iter().all(|s| {
                app.state.downstreams.get(*s).breaker_state()
                    == tributary::downstream::breaker::State::Closed
            })
    })
    .await;
    assert!(
        closed,
        "circuits did not close after the services recovered"
    );
    let text = app.metrics().await;
    for s in broken {
        assert_eq!(
            metric_value(
                &text,
                "tributary_downstream_circuit_state",
                &[("downstream", s.as_str())]
            ),
            Some(0.0)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_circuit_whose_half_open_probes_are_abandoned_still_closes() {
    let _serial = serial().await;
    let open_for = Duration::from_millis(300);
    let app = spawn_app_with(|s| {
        s.server.request_deadline = Duration::from_secs(10);
        s.downstreams.carts.timeout = Duration::from_secs(5);
        s.circuit_breaker.min_calls = 4;
        s.circuit_breaker.window = Duration::from_secs(30);
        s.circuit_breaker.open_for = open_for;
        s.circuit_breaker.half_open_probes = 2;
    })
    .await;
    app.set_service(Service::Carts, |b| b.error_rate = 1.0);
    for _ in 0..4 {
        let (_, body) = dashboard(&app, 1).await;
        assert_eq!(degraded(&body), ["cart"]);
    }
    let carts = app.state.downstreams.get(Service::Carts);
    assert_eq!(
        carts.breaker_state(),
        tributary::downstream::breaker::State::Open
    );

    // Once open_for has passed, two requests become the half-open probes: carts is healthy
    // now but slow, and both clients hang up while their probes are still waiting for it.
    app.set_service(Service::Carts, |b| {
        b.error_rate = 0.0;
        b.latency = Duration::from_secs(5);
    });
    tokio::time::sleep(open_for + Duration::from_millis(100)).await;
    let probes_before = app.sim.sim.stats(Service::Carts).requests;
    let mut clients = Vec::new();
    for user in 1..=2 {
        let mut stream = TcpStream::connect(app.addr).await.unwrap();
        let request = format!("GET /api/v1/dashboard/{user} HTTP/1.1\r\nhost: gateway\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        clients.push(stream);
    }
    let probing = eventually(Duration::from_secs(5), || {
        app.sim.sim.stats(Service::Carts).requests == probes_before + 2
    })
    .await;
    drop(clients);
    assert!(probing, "the half-open probes never reached carts");
    assert!(
        eventually(Duration::from_secs(5), || app
            .sim
            .sim
            .stats(Service::Carts)
            .in_flight
            == 0)
        .await,
        "the abandoned probes were not cancelled"
    );

    // carts is fast again: the circuit must be able to probe it and close, not stay wedged
    // in half-open with slots held by probes that will never report.
    app.set_service(Service::Carts, |b| b.latency = Duration::from_millis(5));
    let closed = until(Duration::from_secs(5), || async {
        let (_, body) = dashboard(&app, 1).await;
        degraded(&body).is_empty()
            && carts.breaker_state() == tributary::downstream::breaker::State::Closed
    })
    .await;
    assert!(
        closed,
        "circuit stuck in {:?} after its probes were abandoned",
        carts.breaker_state()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_of_a_failing_required_part_stop_at_the_deadline() {
    let _serial = serial().await;
    let deadline = Duration::from_millis(300);
    let app = spawn_app_with(|s| {
        s.server.request_deadline = deadline;
        s.downstreams.users.timeout = Duration::from_secs(5);
        // Many retries allowed and a generous budget: only the deadline can stop them.
        s.retry.max_retries = 50;
        s.retry.backoff_base = Duration::from_millis(20);
        s.retry.budget_min_per_sec = 10_000;
        s.circuit_breaker.enabled = false;
    })
    .await;
    app.set_service(Service::Users, |b| b.mode = Mode::Reset);
    let retries_before = metric(
        &app,
        "tributary_downstream_retries_total",
        &[("downstream", "users")],
    )
    .await;

    let (status, body) = problem(app.get("/api/v1/dashboard/1").await).await;

    // Usually the reset itself (502): the loop stops retrying while there is still time to
    // answer. On a starved machine the last attempt may run out of budget instead (504).
    assert!(matches!(status, 502 | 504), "{status} {body}");
    let budgets: Vec<u64> = app
        .sim
        .sim
        .journal()
        .iter()
        .filter(|s| s.service == Service::Users)
        .map(|s| s.budget_ms.expect("budget header"))
        .collect();
    assert!(budgets.len() >= 2, "the reset was retried: {budgets:?}");
    assert!(
        budgets.len() < 51,
        "the deadline, not max_retries, ended the retries: {budgets:?}"
    );
    assert!(
        budgets
            .iter()
            .all(|b| *b >= 1 && *b <= deadline.as_millis() as u64),
        "every attempt ran inside the deadline: {budgets:?}"
    );
    assert!(
        budgets.windows(2).all(|w| w[1] <= w[0]),
        "each retry had less budget than the one before: {budgets:?}"
    );
    let retries_after = metric(
        &app,
        "tributary_downstream_retries_total",
        &[("downstream", "users")],
    )
    .await;
    assert!(retries_after - retries_before >= (budgets.len() - 1) as f64);
}

// ---------------------------------------------------------------------------------------------
// The database: outage, flapping, saturation
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_turns_readiness_off_and_degrades_recent_orders_until_it_comes_back() {
    let _serial = serial().await;
    let proxy = ChaosProxy::start(postgres_addr()).await;
    let app = spawn_app_behind(&proxy, |s| {
        s.database.acquire_timeout = Duration::from_millis(500);
    })
    .await;
    app.seed(1, 3).await;
    assert_eq!(app.get("/readyz").await.status(), 200);
    let (_, body) = dashboard(&app, 1).await;
    assert_eq!(body["recent_orders"].as_array().map(Vec::len), Some(3));

    proxy.cut();

    let resp = app.get("/readyz").await;
    assert_eq!(resp.status(), 503);
    let ready: Value = resp.json().await.unwrap();
    assert_ne!(ready["database"], "ok", "{ready}");
    let (status, body) = dashboard(&app, 1).await;
    assert_eq!(status, 200, "{body}");
    assert!(body["recent_orders"].is_null(), "{body}");
    assert_eq!(degraded(&body), ["recent_orders"]);
    assert_eq!(body["profile"]["service"], "users");

    proxy.restore();

    // Same gateway, same pool: it reconnects on its own.
    assert!(
        until(Duration::from_secs(10), || async {
            app.get("/readyz").await.status() == 200
        })
        .await,
        "readiness did not come back"
    );
    let (status, body) = dashboard(&app, 1).await;
    assert_eq!(status, 200);
    assert_eq!(degraded(&body), Vec::<String>::new());
    assert_eq!(body["recent_orders"].as_array().map(Vec::len), Some(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_pool_degrades_recent_orders_within_the_budget_and_leaves_no_query_running() {
    let _serial = serial().await;
    let app = spawn_app_with(|s| {
        s.database.max_connections = nz32(1);
        s.server.request_deadline = Duration::from_millis(1500);
    })
    .await;
    app.seed(1, 3).await;
    let (_, body) = dashboard(&app, 1).await;
    assert_eq!(body["recent_orders"].as_array().map(Vec::len), Some(3));

    // Another client holds a lock the recent-orders query needs: the first request takes the
    // gateway's one connection and its query waits behind the lock.
    let mut locker = app.db.begin().await.unwrap();
    sqlx::query("LOCK TABLE orders IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *locker)
        .await
        .unwrap();
    let holder = tokio::spawn(app.client.get(app.url("/api/v1/dashboard/1")).send());
    assert!(
        until(Duration::from_secs(5), || async {
            gateway_queries(&app, "Lock").await == 1
        })
        .await,
        "the gateway's query never waited on the lock"
    );
    let timeouts_before = metric(&app, "tributary_db_pool_acquire_timeouts_total", &[]).await;
    let shed_before = metric(
        &app,
        "tributary_fanout_degraded_total",
        &[("part", "recent_orders"), ("reason", "shed")],
    )
    .await;

    // More requests, with callers' budgets (x-request-budget-ms) that end before the holder's:
    // each waits for the connection only as long as its own budget allows.
    let waiters = join_all((0..5).map(|_| async {
        let resp = app
            .client
            .get(app.url("/api/v1/dashboard/1"))
            .header("x-request-budget-ms", "300")
            .send()
            .await
            .unwrap();
        (resp.status().as_u16(), resp.json::<Value>().await.unwrap())
    }))
    .await;
    let holder = holder.await.unwrap().unwrap();
    let holder = (
        holder.status().as_u16(),
        holder.json::<Value>().await.unwrap(),
    );

    for (status, body) in waiters.iter().chain([&holder]) {
        assert_eq!(*status, 200, "{body}");
        assert!(body["recent_orders"].is_null(), "{body}");
        assert_eq!(degraded(body), ["recent_orders"]);
        assert_eq!(body["profile"]["service"], "users");
    }
    let timeouts_after = metric(&app, "tributary_db_pool_acquire_timeouts_total", &[]).await;
    assert!(
        timeouts_after >= timeouts_before + 5.0,
        "each waiter gave up on the pool: {timeouts_before} -> {timeouts_after}"
    );
    let shed_after = metric(
        &app,
        "tributary_fanout_degraded_total",
        &[("part", "recent_orders"), ("reason", "shed")],
    )
    .await;
    assert!(shed_after >= shed_before + 5.0);
    // The holder's request is over and the lock is still held, yet its query is no longer
    // running: statement_timeout (its remaining budget) made the server cancel it.
    assert!(
        until(Duration::from_secs(5), || async {
            gateway_queries(&app, "any").await == 0
        })
        .await,
        "a gateway query is still running after its request ended"
    );

    locker.rollback().await.unwrap();
    assert!(
        until(Duration::from_secs(5), || async {
            let (_, body) = dashboard(&app, 1).await;
            body["recent_orders"].as_array().map(Vec::len) == Some(3)
        })
        .await,
        "recent orders did not come back"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_goes_silent_mid_query_degrades_recent_orders_instead_of_the_dashboard() {
    let _serial = serial().await;
    let proxy = ChaosProxy::start(postgres_addr()).await;
    let app = spawn_app_behind(&proxy, |s| {
        s.server.request_deadline = Duration::from_millis(1000);
    })
    .await;
    app.seed(1, 3).await;

    // The query is on the server, waiting behind a lock; then the network goes silent (a
    // partition: nothing closed, nothing delivered). The server's statement_timeout still
    // fires, but its answer never arrives.
    let mut locker = app.db.begin().await.unwrap();
    sqlx::query("LOCK TABLE orders IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *locker)
        .await
        .unwrap();
    let request = tokio::spawn(app.client.get(app.url("/api/v1/dashboard/1")).send());
    let waiting = until(Duration::from_secs(5), || async {
        gateway_queries(&app, "Lock").await == 1
    })
    .await;
    proxy.stall();
    let resp = request.await.unwrap().unwrap();
    let status = resp.status().as_u16();
    let body: Value = resp.json().await.unwrap();
    proxy.restore();
    locker.rollback().await.unwrap();

    assert!(waiting, "the gateway's query never reached the server");
    assert_eq!(status, 200, "{body}");
    assert!(body["recent_orders"].is_null(), "{body}");
    assert_eq!(degraded(&body), ["recent_orders"]);
    assert_eq!(body["profile"]["service"], "users");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_on_a_database_that_goes_silent_mid_statement_are_504_and_release_their_permit() {
    let _serial = serial().await;
    let proxy = ChaosProxy::start(postgres_addr()).await;
    let app = spawn_app_behind(&proxy, |s| {
        s.server.request_deadline = Duration::from_millis(1000);
    })
    .await;
    let created = app
        .client
        .post(app.url("/api/v1/orders"))
        .header("idempotency-key", "silent-read")
        .json(&order(1))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 201);
    let id = created.json::<Value>().await.unwrap()["id"].clone();
    let limiter = app
        .state
        .admission
        .as_ref()
        .unwrap()
        .limiter(RouteGroup::Orders);

    // Each statement is on the server, waiting behind a lock; then the network goes silent (a
    // partition: nothing closed, nothing delivered). The server's statement_timeout fires, but
    // its answer never arrives, and sqlx has no timeout of its own.
    for (table, request) in [
        (
            "idempotency_keys",
            app.client
                .post(app.url("/api/v1/orders"))
                .header("idempotency-key", "silent-write")
                .json(&order(2)),
        ),
        (
            "orders",
            app.client.get(app.url(&format!("/api/v1/orders/{id}"))),
        ),
    ] {
        let mut locker = app.db.begin().await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"
        )))
        .execute(&mut *locker)
        .await
        .unwrap();
        let request = tokio::spawn(request.send());
        let waiting = until(Duration::from_secs(5), || async {
            gateway_queries(&app, "Lock").await == 1
        })
        .await;
        proxy.stall();
        let answer = request.await.unwrap();
        let held = limiter.in_flight();
        proxy.restore();
        locker.rollback().await.unwrap();

        assert!(
            waiting,
            "the gateway's statement on {table} never reached the server"
        );
        let (status, body) = problem(answer.expect("an answer, not a hung request")).await;
        assert_eq!(status, 504, "{table}: {body}");
        assert_eq!(body["type"], "/problems/gateway-timeout");
        assert_eq!(
            held, 0,
            "{table}: the admission permit outlived the request"
        );
    }
}

/// Active statements of this test's gateway (`application_name = 'tributary'`) on its own
/// database; `wait` = "Lock" counts only those waiting on a lock.
async fn gateway_queries(app: &TestApp, wait: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = $1 AND application_name = 'tributary' AND state = 'active' \
           AND ($2 = 'any' OR wait_event_type = $2)",
    )
    .bind(&app.db_name)
    .bind(wait)
    .fetch_one(&app.db)
    .await
    .unwrap()
}

fn order(user_id: i64) -> Value {
    json!({"user_id": user_id, "items": [
        {"sku": "SKU-1", "quantity": 2, "unit_price_cents": 1250},
        {"sku": "SKU-2", "quantity": 1, "unit_price_cents": 499}
    ]})
}

/// What one retrying client ended with.
struct Settled {
    key: String,
    order_id: i64,
}

/// Posts one order under `key` until the answer is definite (201, first time or replayed),
/// with jittered backoff and a bounded number of attempts. Anything else that is final (4xx)
/// is a bug and fails the test.
async fn create_until_definite(
    app: &TestApp,
    key: String,
    user_id: i64,
    failures: &AtomicUsize,
) -> Settled {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    for _ in 0..60 {
        let resp = client
            .post(app.url("/api/v1/orders"))
            .header("idempotency-key", &key)
            .json(&order(user_id))
            .send()
            .await;
        if let Ok(resp) = resp {
            let status = resp.status().as_u16();
            assert!(
                !(400..500).contains(&status),
                "{key}: a retry must never be refused ({status})"
            );
            if status == 201 {
                let body: Value = resp.json().await.unwrap();
                return Settled {
                    key,
                    order_id: body["id"].as_i64().expect("order id"),
                };
            }
        }
        failures.fetch_add(1, Ordering::Relaxed);
        let backoff = 20 + rand_ms(40);
        tokio::time::sleep(Duration::from_millis(backoff)).await;
    }
    panic!("{key}: no definite answer after 60 attempts");
}

fn rand_ms(max: u64) -> u64 {
    // Enough jitter to de-synchronise the clients; no need for a real RNG.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos() as u64;
    nanos % max
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_orders_retried_through_a_flapping_database_are_neither_lost_nor_duplicated() {
    let _serial = serial().await;
    let proxy = Arc::new(ChaosProxy::start(postgres_addr()).await);
    let app = spawn_app_behind(&proxy, |s| {
        s.database.acquire_timeout = Duration::from_millis(300);
        s.server.request_deadline = Duration::from_secs(1);
    })
    .await;

    // The database is down when the clients start, then flaps: each outage lasts until some
    // client has been refused by it (so every cut is felt, however slow the machine), then
    // the database is back for a moment before the next cut.
    let failures = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicBool::new(false));
    proxy.cut();
    let flapper = tokio::spawn({
        let (proxy, failures, done) =
            (Arc::clone(&proxy), Arc::clone(&failures), Arc::clone(&done));
        async move {
            let mut cuts = 0;
            while cuts < 4 && !done.load(Ordering::Relaxed) {
                let seen = failures.load(Ordering::Relaxed);
                let felt = eventually(Duration::from_secs(10), || {
                    failures.load(Ordering::Relaxed) > seen || done.load(Ordering::Relaxed)
                })
                .await;
                proxy.restore();
                cuts += 1;
                if !felt || done.load(Ordering::Relaxed) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(150)).await;
                proxy.cut();
            }
            proxy.restore();
            cuts
        }
    });
    let clients = 16;
    let settled = join_all(
        (1..=clients).map(|i| create_until_definite(&app, format!("flap-{i}"), i, &failures)),
    )
    .await;
    done.store(true, Ordering::Relaxed);
    let cuts = flapper.await.unwrap();

    assert!(
        failures.load(Ordering::Relaxed) >= 1 && cuts >= 1,
        "the outage never got in the way: nothing was exercised"
    );
    for s in &settled {
        let rows: Vec<Option<i64>> =
            sqlx::query_scalar("SELECT order_id FROM idempotency_keys WHERE key = $1")
                .bind(&s.key)
                .fetch_all(&app.db)
                .await
                .unwrap();
        assert_eq!(rows, [Some(s.order_id)], "{}: one key, one order", s.key);
    }
    let count = |sql: &'static str| {
        let db = app.db.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&db)
                .await
                .unwrap()
        }
    };
    assert_eq!(count("SELECT count(*) FROM orders").await, clients);
    assert_eq!(
        count("SELECT count(DISTINCT user_id) FROM orders").await,
        clients,
        "one order per client"
    );
    assert_eq!(
        count(
            "SELECT count(*) FROM orders o \
             WHERE NOT EXISTS (SELECT 1 FROM idempotency_keys k WHERE k.order_id = o.id)"
        )
        .await,
        0,
        "an order without its key"
    );
    assert_eq!(
        count(
            "SELECT count(*) FROM idempotency_keys WHERE order_id IS NULL OR response_body IS NULL"
        )
        .await,
        0,
        "a key without its order"
    );
}

// ---------------------------------------------------------------------------------------------
// Admission: bursts, memory, disconnects, readiness, adaptive limit
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_ten_times_the_admission_limit_sheds_the_excess_with_503_and_retry_after() {
    let _serial = serial().await;
    let app = spawn_app_with(|s| {
        s.admission.max_in_flight = nz(10);
        s.admission.max_wait = Duration::from_millis(5);
        every_downstream(s, |d| d.timeout = Duration::from_secs(1));
    })
    .await;
    for service in Service::ALL {
        app.set_service(service, |b| b.latency = Duration::from_millis(200));
    }
    let limiter = app
        .state
        .admission
        .as_ref()
        .unwrap()
        .limiter(RouteGroup::Dashboard);
    let rejections_before = metric(
        &app,
        "tributary_admission_rejections_total",
        &[("group", "dashboard")],
    )
    .await;

    let burst = tokio::spawn({
        let client = app.client.clone();
        let url = app.url("/api/v1/dashboard/1");
        async move {
            join_all((0..100).map(|_| {
                let req = client.get(&url).send();
                async move {
                    let resp = req.await.unwrap();
                    let status = resp.status().as_u16();
                    let ct = resp.headers().get("content-type").cloned();
                    let retry_after = resp
                        .headers()
                        .get("retry-after")
                        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
                    let body: Value = resp.json().await.unwrap_or(Value::Null);
                    (status, ct, retry_after, body)
                }
            }))
            .await
        }
    });
    // While the limiter is full, health and metrics still answer: they are never shed.
    let saturated = eventually(Duration::from_secs(5), || limiter.in_flight() == 10).await;
    let health = app.get("/healthz").await.status();
    let metrics = app.get("/metrics").await.status();
    let responses = burst.await.unwrap();

    assert!(saturated, "the burst never filled the limiter");
    assert_eq!((health.as_u16(), metrics.as_u16()), (200, 200));
    let ok = responses.iter().filter(|r| r.0 == 200).count();
    let shed: Vec<_> = responses.iter().filter(|r| r.0 == 503).collect();
    assert_eq!(ok + shed.len(), 100, "only 200 or 503");
    assert!(ok >= 10, "the admitted requests were answered ({ok})");
    assert!(shed.len() >= 50, "the excess was shed ({})", shed.len());
    for (_, ct, retry_after, body) in &shed {
        assert_eq!(ct.as_ref().unwrap(), "application/problem+json");
        assert_eq!(body["type"], "/problems/unavailable");
        assert!(
            retry_after.is_some_and(|s| s >= 1),
            "Retry-After {retry_after:?}"
        );
    }
    let rejections_after = metric(
        &app,
        "tributary_admission_rejections_total",
        &[("group", "dashboard")],
    )
    .await;
    assert!(rejections_after - rejections_before >= shed.len() as f64);
    assert!(
        eventually(Duration::from_secs(5), || limiter.in_flight() == 0).await,
        "admission permits leaked"
    );
}

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("procfs");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status");
    kb * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_stays_bounded_across_repeated_bursts() {
    let _serial = serial().await;
    const BODY: u64 = 256 * 1024;
    const BOUND: u64 = 200 * 1024 * 1024;
    let app = spawn_app_with(|s| {
        s.admission.max_in_flight = nz(20);
        s.admission.max_wait = Duration::from_millis(5);
        s.server.request_deadline = Duration::from_secs(5);
        every_downstream(s, |d| d.timeout = Duration::from_secs(4));
    })
    .await;
    for service in Service::ALL {
        app.set_service(service, |b| {
            b.latency = Duration::from_millis(20);
            b.body_bytes = BODY as usize;
        });
    }
    // A burst of ten times the limit; returns how many were admitted.
    let burst = || async {
        let statuses = join_all((0..200).map(|_| async {
            let resp = app.get("/api/v1/dashboard/1").await;
            let status = resp.status().as_u16();
            let _ = resp.bytes().await;
            status
        }))
        .await;
        assert!(
            statuses.iter().all(|s| *s == 200 || *s == 503),
            "{statuses:?}"
        );
        statuses.iter().filter(|s| **s == 200).count() as u64
    };

    // One burst to warm up allocator arenas, connection pools and the metrics registry.
    burst().await;
    let before = rss_bytes();
    // Each admitted request reads five bodies and writes them out again, merged. Keep going
    // until a leak of every admitted request would have crossed the bound twice over.
    let per_request = 2 * 5 * BODY;
    let (mut admitted, mut bursts) = (0, 0);
    while admitted * per_request < 2 * BOUND && bursts < 30 {
        admitted += burst().await;
        bursts += 1;
    }
    let grown = rss_bytes().saturating_sub(before);

    assert!(
        admitted * per_request >= 2 * BOUND,
        "too little traffic for the bound to mean anything: {admitted} admitted in {bursts} bursts"
    );
    assert!(
        grown < BOUND,
        "RSS grew by {} MiB over {bursts} bursts ({admitted} admitted requests)",
        grown >> 20
    );
    let admission = app.state.admission.as_ref().unwrap();
    assert!(eventually(Duration::from_secs(5), || admission.in_flight() == 0).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_client_disconnects_leaks_no_permits_tasks_or_downstream_calls() {
    let _serial = serial().await;
    let app = spawn_app_with(|s| {
        // Few slots and a long wait: most of the storm is queued for admission when its
        // clients go away, the rest is inside the fan-out with every bulkhead full. Nothing
        // times out by itself before the clients leave.
        s.admission.max_in_flight = nz(16);
        s.admission.max_wait = Duration::from_secs(5);
        s.server.request_deadline = Duration::from_secs(10);
        every_downstream(s, |d| {
            d.max_concurrency = nz(16);
            d.timeout = Duration::from_secs(10);
        });
    })
    .await;
    for service in Service::ALL {
        app.set_service(service, |b| b.latency = Duration::from_secs(10));
    }
    let admission = app.state.admission.as_ref().unwrap();
    let limiter = admission.limiter(RouteGroup::Dashboard);

    // 200 clients send their requests; once the gateway holds them (admitted or queued), all
    // of them hang up at once.
    let mut clients = Vec::new();
    for user in 1..=200 {
        let mut stream = TcpStream::connect(app.addr).await.unwrap();
        let request = format!("GET /api/v1/dashboard/{user} HTTP/1.1\r\nhost: gateway\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        clients.push(stream);
    }
    let held = eventually(Duration::from_secs(5), || {
        admission.in_flight() == 16
            && limiter.waiting() >= 50
            && app
                .state
                .downstreams
                .all()
                .iter()
                .all(|d| d.available_permits() == 0)
    })
    .await;
    let queued = limiter.waiting();
    drop(clients);

    assert!(
        held,
        "the storm never filled the gateway ({} in flight, {queued} queued)",
        admission.in_flight()
    );
    let drained = eventually(Duration::from_secs(10), || {
        admission.in_flight() == 0
            && limiter.waiting() == 0
            && app
                .state
                .downstreams
                .all()
                .iter()
                .all(|d| d.available_permits() == 16)
            && Service::ALL
                .iter()
                .all(|s| app.sim.sim.stats(*s).in_flight == 0)
    })
    .await;
    assert!(
        drained,
        "leaked: admission {} in flight / {} waiting, bulkheads {:?}, simulator {:?}",
        admission.in_flight(),
        limiter.waiting(),
        app.state
            .downstreams
            .all()
            .map(|d| (d.service(), d.available_permits())),
        Service::ALL.map(|s| (s, app.sim.sim.stats(s).in_flight))
    );
    // The abandoned calls were cancelled, not left to finish.
    for service in Service::ALL {
        let stats = app.sim.sim.stats(service);
        assert!(
            stats.cancelled > 0 && stats.completed == 0,
            "{service}: {stats:?}"
        );
    }
    assert!(
        until(Duration::from_secs(10), || async {
            let text = app.metrics().await;
            // The scrape itself is one active request.
            metric_value(&text, "http_server_active_requests", &[]) == Some(1.0)
                && metric_value(&text, "tributary_db_pool_waiters", &[]) == Some(0.0)
        })
        .await,
        "active-request or pool-waiter gauges did not return to zero"
    );
}

/// Keeps `loops` clients sending dashboard requests until `stop` is set; a rejected client
/// pauses briefly so the overload is sustained without burning the whole CPU on 503s.
fn sustained_load(
    app: &TestApp,
    loops: usize,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    let client = app.client.clone();
    let url = app.url("/api/v1/dashboard/1");
    tokio::spawn(async move {
        join_all((0..loops).map(|_| {
            let (client, url, stop) = (client.clone(), url.clone(), Arc::clone(&stop));
            async move {
                while !stop.load(Ordering::Relaxed) {
                    match client.get(&url).send().await {
                        Ok(r) if r.status() == 200 => {
                            let _ = r.bytes().await;
                        }
                        _ => tokio::time::sleep(Duration::from_millis(10)).await,
                    }
                }
            }
        }))
        .await;
    })
}

async fn readiness(app: &TestApp) -> (u16, Value) {
    let resp = app.get("/readyz").await;
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_turns_off_under_heavy_shedding_and_comes_back_only_after_the_hysteresis() {
    let _serial = serial().await;
    let app = spawn_app_with(|s| {
        s.admission.max_in_flight = nz(2);
        s.admission.max_wait = Duration::from_millis(1);
        s.admission.unready_after_secs = 1;
        s.admission.ready_after_secs = 2;
    })
    .await;
    for service in Service::ALL {
        app.set_service(service, |b| b.latency = Duration::from_millis(100));
    }
    assert_eq!(readiness(&app).await.0, 200);

    let stop = Arc::new(AtomicBool::new(false));
    let load = sustained_load(&app, 12, Arc::clone(&stop));
    let unready = until(Duration::from_secs(8), || async {
        let (status, body) = readiness(&app).await;
        status == 503 && body["shedding"] == true && body["database"] == "ok"
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let stopped = Instant::now();
    load.await.unwrap();

    assert!(unready, "readiness stayed on under sustained shedding");
    let (status, body) = readiness(&app).await;
    assert_eq!(
        (status, &body["shedding"]),
        (503, &json!(true)),
        "readiness must not flip back the moment the load stops: {body}"
    );
    let ready = until(Duration::from_secs(10), || async {
        let (status, body) = readiness(&app).await;
        status == 200 && body["shedding"] == false
    })
    .await;
    assert!(ready, "readiness did not come back after the load stopped");
    // A lower bound only, which a slow machine can only make larger: recovery needed
    // ready_after_secs (2) light seconds after the last heavy one.
    assert!(stopped.elapsed() >= Duration::from_secs(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_adaptive_limit_goes_down_when_downstream_latency_rises_under_load() {
    let _serial = serial().await;
    let app = spawn_app_with(|s| {
        s.admission.mode = tributary::config::AdmissionMode::Adaptive;
        s.admission.max_wait = Duration::from_millis(20);
        // More clients than the limit can ever reach, so the limiter is never
        // application-limited (Gradient2 does not move an idle limit, in either direction).
        s.admission.adaptive.initial_limit = 10;
        s.admission.adaptive.min_limit = nz(2);
        s.admission.adaptive.max_limit = 20;
        s.admission.adaptive.smoothing = Ratio::of(0.5);
        s.server.request_deadline = Duration::from_secs(3);
        every_downstream(s, |d| d.timeout = Duration::from_secs(2));
    })
    .await;
    for service in Service::ALL {
        app.set_service(service, |b| b.latency = Duration::from_millis(50));
    }
    let limiter = app
        .state
        .admission
        .as_ref()
        .unwrap()
        .limiter(RouteGroup::Dashboard);
    let stop = Arc::new(AtomicBool::new(false));
    let load = sustained_load(&app, 30, Arc::clone(&stop));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = limiter.limit();

    for service in Service::ALL {
        app.set_service(service, |b| b.latency = Duration::from_millis(800));
    }
    let lowered = eventually(Duration::from_secs(8), || limiter.limit() < before).await;
    // The exported gauge follows (the load keeps it fresh: every closed window sets it).
    let gauge_lowered = until(Duration::from_secs(5), || async {
        metric_value(
            &app.metrics().await,
            "tributary_admission_limit",
            &[("group", "dashboard")],
        )
        .is_some_and(|g| g < before as f64)
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();

    assert!(
        lowered,
        "limit {before} did not go down (now {})",
        limiter.limit()
    );
    assert!(gauge_lowered, "tributary_admission_limit did not follow");
}

// ---------------------------------------------------------------------------------------------
// Input and connection limits
// ---------------------------------------------------------------------------------------------

/// Writes `request` on a fresh connection and reads until the server closes it (or 5 s pass).
/// Returns what was read and whether the connection was closed.
async fn raw_exchange(app: &TestApp, request: &[u8]) -> (String, bool) {
    let mut stream = TcpStream::connect(app.addr).await.unwrap();
    // The server may stop reading (and close) before the whole request is written.
    let _ = stream.write_all(request).await;
    read_until_closed(&mut stream).await
}

async fn read_until_closed(stream: &mut TcpStream) -> (String, bool) {
    let mut out = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .is_ok();
    (String::from_utf8_lossy(&out).into_owned(), closed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_headers_or_an_oversized_request_head_are_431() {
    let _serial = serial().await;
    let app = spawn_app_with(|s| {
        s.server.max_headers = nz(16);
        s.server.max_header_bytes = nz(8192);
    })
    .await;

    let mut many = String::from("GET /healthz HTTP/1.1\r\nhost: gateway\r\n");
    for i in 0..40 {
        many.push_str(&format!("x-extra-{i}: {i}\r\n"));
    }
    many.push_str("\r\n");
    let (response, _) = raw_exchange(&app, many.as_bytes()).await;
    assert!(response.starts_with("HTTP/1.1 431"), "{response:?}");

    let big = format!(
        "GET /healthz HTTP/1.1\r\nhost: gateway\r\nx-big: {}\r\n\r\n",
        "a".repeat(20_000)
    );
    let (response, _) = raw_exchange(&app, big.as_bytes()).await;
    assert!(response.starts_with("HTTP/1.1 431"), "{response:?}");

    // Over the configured limits but within hyper's hard bounds (twice them): a problem document.
    let mut some = String::from("GET /healthz HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n");
    for i in 0..20 {
        some.push_str(&format!("x-extra-{i}: {i}\r\n"));
    }
    some.push_str("\r\n");
    let (response, _) = raw_exchange(&app, some.as_bytes()).await;
    assert!(response.starts_with("HTTP/1.1 431"), "{response:?}");
    assert!(
        response.contains("application/problem+json"),
        "{response:?}"
    );
    assert!(
        response.contains("/problems/header-fields-too-large"),
        "{response:?}"
    );
    let large = format!(
        "GET /healthz HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\nx-big: {}\r\n\r\n",
        "a".repeat(10_000)
    );
    let (response, _) = raw_exchange(&app, large.as_bytes()).await;
    assert!(response.starts_with("HTTP/1.1 431"), "{response:?}");
    assert!(
        response.contains("/problems/header-fields-too-large"),
        "{response:?}"
    );

    // Within the limits the same request is fine.
    let (response, _) = raw_exchange(
        &app,
        b"GET /healthz HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slowloris_client_is_disconnected_after_the_header_read_timeout() {
    let _serial = serial().await;
    let app = spawn_app_with(|s| s.server.header_read_timeout = Duration::from_millis(300)).await;

    // Half a request head, then nothing.
    let (response, closed) =
        raw_exchange(&app, b"GET /api/v1/dashboard/1 HTTP/1.1\r\nhost: gat").await;
    assert!(closed, "a stalled request head kept its connection open");
    assert!(response.is_empty(), "{response:?}");

    // Not even a first byte: the connection is just as stalled.
    let (response, closed) = raw_exchange(&app, b"").await;
    assert!(closed, "a silent connection was kept open");
    assert!(response.is_empty(), "{response:?}");

    // An idle keep-alive connection is closed by the same timer once its request is answered.
    let (response, closed) =
        raw_exchange(&app, b"GET /healthz HTTP/1.1\r\nhost: gateway\r\n\r\n").await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response:?}");
    assert!(closed, "an idle keep-alive connection was kept open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_max_connections_get_a_503_problem() {
    let _serial = serial().await;
    let app = spawn_app_with(|s| s.server.max_connections = nz(2)).await;

    // Two kept-alive connections, each proven established by a completed request.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut stream = TcpStream::connect(app.addr).await.unwrap();
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nhost: gateway\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 1024];
        let n = stream.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        held.push(stream);
    }

    // A real client on a third connection: it sends its request and reads the refusal.
    let client = reqwest::Client::new();
    let (status, body) = problem(client.get(app.url("/healthz")).send().await.unwrap()).await;
    assert_eq!(status, 503);
    assert_eq!(body["type"], "/problems/unavailable");

    drop(held);
    assert!(
        until(Duration::from_secs(5), || async {
            reqwest::Client::new()
                .get(app.url("/healthz"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        })
        .await,
        "closed connections did not free their slots"
    );
}
