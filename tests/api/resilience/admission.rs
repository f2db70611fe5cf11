//! Admission: bursts shed with 503 and `Retry-After`, memory stays bounded, disconnect storms
//! leak nothing, readiness follows heavy shedding with hysteresis, the adaptive limit follows
//! latency and the database pool's line.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use futures::future::join_all;
use serde_json::{Value, json};
use tokio::{io::AsyncWriteExt, net::TcpStream, time::Instant};
use tributary::{
    config::{Ratio, RouteGroup},
    domain::Service,
};

use super::serial;
use crate::helpers::{TestApp, eventually, metric_value, nz, nz32, spawn_app_with};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_ten_times_the_admission_limit_sheds_the_excess_with_503_and_retry_after() {
    let _serial = serial().await;
    // Arrange: ten slots, every request holding one for 200 ms.
    let app = spawn_app_with(|s| {
        s.admission.max_in_flight = nz(10);
        s.admission.mode = tributary::config::AdmissionMode::Static;
        s.admission.max_wait = Duration::from_millis(5);
        for d in s.downstreams.iter_mut() {
            d.timeout = Duration::from_secs(1);
        }
    })
    .await;
    for service in Service::ALL {
        app.set_service(service, |b| b.latency = Duration::from_millis(200));
    }
    let limiter = dashboard_limiter(&app);
    let rejections_before = app
        .metric(
            "tributary_admission_rejections_total",
            &[("group", "dashboard")],
        )
        .await;

    // Act: a hundred requests at once against ten slots.
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
    let saturated = eventually(Duration::from_secs(5), || async {
        limiter.in_flight() == 10
    })
    .await;
    let health = app.get("/healthz").await.status();
    let metrics = app.ops_get("/metrics").await.status();
    let responses = burst.await.unwrap();

    // Assert
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
    let rejections_after = app
        .metric(
            "tributary_admission_rejections_total",
            &[("group", "dashboard")],
        )
        .await;
    assert!(rejections_after - rejections_before >= shed.len() as f64);
    assert!(
        eventually(Duration::from_secs(5), || async {
            limiter.in_flight() == 0
        })
        .await,
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
        s.admission.mode = tributary::config::AdmissionMode::Static;
        s.admission.max_wait = Duration::from_millis(5);
        s.server.request_deadline = Duration::from_secs(5);
        for d in s.downstreams.iter_mut() {
            d.timeout = Duration::from_secs(4);
        }
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
    assert!(
        eventually(Duration::from_secs(5), || async {
            admission.in_flight() == 0
        })
        .await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_client_disconnects_leaks_no_permits_tasks_or_downstream_calls() {
    let _serial = serial().await;
    // Arrange
    let app = spawn_app_with(|s| {
        // Few slots and a long wait: most of the storm is queued for admission when its
        // clients go away, the rest is inside the fan-out with every bulkhead full. Nothing
        // times out by itself before the clients leave.
        s.admission.max_in_flight = nz(16);
        s.admission.mode = tributary::config::AdmissionMode::Static;
        s.admission.max_wait = Duration::from_secs(5);
        s.server.request_deadline = Duration::from_secs(10);
        for d in s.downstreams.iter_mut() {
            d.max_concurrency = nz(16);
            d.timeout = Duration::from_secs(10);
        }
    })
    .await;
    for service in Service::ALL {
        app.set_service(service, |b| b.latency = Duration::from_secs(10));
    }
    let admission = app.state.admission.as_ref().unwrap();
    let limiter = admission.limiter(RouteGroup::Dashboard);

    // Act: 200 clients send their requests; once the gateway holds them (admitted or queued),
    // all of them hang up at once.
    let mut clients = Vec::new();
    for user in 1..=200 {
        let mut stream = TcpStream::connect(app.addr).await.unwrap();
        let request = format!("GET /api/v1/dashboard/{user} HTTP/1.1\r\nhost: gateway\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        clients.push(stream);
    }
    let held = eventually(Duration::from_secs(5), || async {
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

    // Assert: every permit, bulkhead slot, downstream call and gauge comes back.
    assert!(
        held,
        "the storm never filled the gateway ({} in flight, {queued} queued)",
        admission.in_flight()
    );
    let drained = eventually(Duration::from_secs(10), || async {
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
        eventually(Duration::from_secs(10), || async {
            let text = app.metrics().await;
            // The scrape is served on the operations port, outside the request layers.
            metric_value(&text, "http_server_active_requests", &[]) == Some(0.0)
                && metric_value(&text, "tributary_db_pool_waiters", &[]) == Some(0.0)
        })
        .await,
        "active-request or pool-waiter gauges did not return to zero"
    );
}

/// The dashboard group's admission limiter of a gateway with admission on.
fn dashboard_limiter(app: &TestApp) -> Arc<tributary::admission::Limiter> {
    app.state
        .admission
        .as_ref()
        .expect("admission is on")
        .limiter(RouteGroup::Dashboard)
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
        s.admission.mode = tributary::config::AdmissionMode::Static;
        // The load's clients retry after 10 ms; paused connections would make the shedding
        // light, which is pushback's point but not this test's.
        s.admission.pushback = false;
        s.admission.max_wait = Duration::from_millis(1);
        s.admission.shedding_turns_unready = true;
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
    let unready = eventually(Duration::from_secs(8), || async {
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
    let ready = eventually(Duration::from_secs(10), || async {
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
async fn by_default_heavy_shedding_is_reported_in_readiness_without_turning_it_off() {
    let _serial = serial().await;
    let app = spawn_app_with(|s| {
        s.admission.max_in_flight = nz(2);
        s.admission.mode = tributary::config::AdmissionMode::Static;
        s.admission.pushback = false;
        s.admission.max_wait = Duration::from_millis(1);
        s.admission.unready_after_secs = 1;
    })
    .await;
    for service in Service::ALL {
        app.set_service(service, |b| b.latency = Duration::from_millis(100));
    }
    let admission = Arc::clone(app.state.admission.as_ref().unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let load = sustained_load(&app, 12, Arc::clone(&stop));
    let shedding = eventually(Duration::from_secs(8), || async { admission.is_shedding() }).await;
    let (status, body) = readiness(&app).await;
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();

    assert!(
        shedding,
        "the load must shed heavily for this test to mean anything"
    );
    assert_eq!(
        (status, &body["shedding"]),
        (200, &json!(true)),
        "shedding is reported, and the replica stays in the load balancer: {body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_adaptive_limit_goes_down_when_downstream_latency_rises_under_load() {
    let _serial = serial().await;
    let app = spawn_app_with(|s| {
        s.admission.mode = tributary::config::AdmissionMode::Gradient2;
        s.admission.max_wait = Duration::from_millis(20);
        // More clients than the limit can ever reach, so the limiter is never
        // application-limited (Gradient2 does not move an idle limit, in either direction).
        s.admission.adaptive.initial_limit = 10;
        s.admission.adaptive.min_limit = nz(2);
        s.admission.adaptive.max_limit = 20;
        s.admission.adaptive.smoothing = Ratio::of(0.5);
        s.server.request_deadline = Duration::from_secs(3);
        for d in s.downstreams.iter_mut() {
            d.timeout = Duration::from_secs(2);
        }
    })
    .await;
    for service in Service::ALL {
        app.set_service(service, |b| b.latency = Duration::from_millis(50));
    }
    let limiter = dashboard_limiter(&app);
    let stop = Arc::new(AtomicBool::new(false));
    let load = sustained_load(&app, 30, Arc::clone(&stop));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = limiter.limit();

    for service in Service::ALL {
        app.set_service(service, |b| b.latency = Duration::from_millis(800));
    }
    let lowered = eventually(Duration::from_secs(8), || async {
        limiter.limit() < before
    })
    .await;
    // The exported gauge follows (the load keeps it fresh: every closed window sets it).
    let gauge_lowered = eventually(Duration::from_secs(5), || async {
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

/// Ten clients against a gateway with one database connection, whose query waits behind a lock
/// another client holds: the core is calm, and every admitted request stands in line for the
/// pool. Returns the dashboard limit once it fell below its start (or after 6 s, if it never
/// did), and whether the pool's standing gauge was seen at 1.
async fn limit_while_requests_wait_for_the_pool(follow_db_pool: bool) -> (usize, bool) {
    let app = spawn_app_with(|s| {
        s.admission.mode = tributary::config::AdmissionMode::Adaptive;
        s.admission.adaptive.initial_limit = 10;
        s.admission.adaptive.min_limit = nz(2);
        s.admission.adaptive.max_limit = 10;
        s.overload.follow_db_pool = follow_db_pool;
        s.database.max_connections = nz32(1);
        s.server.request_deadline = Duration::from_millis(1500);
    })
    .await;
    app.seed(1, 3).await;
    let limiter = dashboard_limiter(&app);
    let mut locker = app.db.begin().await.unwrap();
    sqlx::query("LOCK TABLE orders IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *locker)
        .await
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let load = sustained_load(&app, 10, Arc::clone(&stop));
    let lowered = eventually(Duration::from_secs(6), || async { limiter.limit() < 10 }).await;
    let standing_seen = eventually(Duration::from_secs(if lowered { 3 } else { 1 }), || async {
        metric_value(
            &app.metrics().await,
            "tributary_db_pool_queue_standing",
            &[],
        ) == Some(1.0)
    })
    .await;
    let limit = limiter.limit();
    stop.store(true, Ordering::Relaxed);
    locker.rollback().await.unwrap();
    load.await.unwrap();
    (limit, standing_seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_adaptive_limit_shrinks_while_admitted_requests_stand_in_line_for_the_database_pool() {
    let _serial = serial().await;
    let (limit, standing) = limit_while_requests_wait_for_the_pool(true).await;
    assert!(
        limit < 10,
        "every request waited for the one connection, yet the limit stayed at {limit}"
    );
    assert!(
        standing,
        "tributary_db_pool_queue_standing never showed the line"
    );

    // The same with overload.follow_db_pool = false: only the core's queue moves the limit, and
    // the core is calm, so it stays where it started. This is what the limit did before the
    // pool was watched.
    let (blind, _) = limit_while_requests_wait_for_the_pool(false).await;
    assert_eq!(
        blind, 10,
        "blind to the pool, a calm core must not move the limit"
    );
}
