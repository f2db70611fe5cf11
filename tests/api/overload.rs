//! Overload: the gateway's own saturation and a caller's tiny budget are not downstream
//! failures; a rejection costs a counter and a small answer; a client that retries at once
//! waits on its own connection.

use std::{sync::Arc, time::Duration};

use axum::{Router, routing::get};
use futures::future::join_all;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    task::JoinHandle,
    time::Instant,
};
use tributary::{
    admission::Limiter, config::AdmissionMode, domain::Service, downstream::breaker::State,
};
use tributary_sim::Behaviour;

use crate::helpers::{
    TestApp, eventually, log_lines, metric_value, nz, optional, spawn_app_full, spawn_app_with,
};

/// Takes the only worker thread for a while: what a saturated core looks like to every task
/// on it, compressed into one poll.
async fn hogs_the_worker() -> &'static str {
    // Deliberately wrong, as the test needs: nothing else on this worker runs meanwhile.
    std::thread::sleep(Duration::from_millis(300));
    "hogged"
}

fn breakers_closed(app: &TestApp) -> bool {
    app.state
        .downstreams
        .all()
        .iter()
        .all(|d| d.breaker_state() == State::Closed)
}

/// Admission rejections of the dashboard group, of one reason or (`""`) of all; -1 when absent.
async fn rejected(app: &TestApp, reason: &str) -> f64 {
    let mut labels = vec![("group", "dashboard")];
    if !reason.is_empty() {
        labels.push(("reason", reason));
    }
    metric_value(
        &app.metrics().await,
        "tributary_admission_rejections_total",
        &labels,
    )
    .unwrap_or(-1.0)
}

async fn ignored(app: &TestApp, reason: &str) -> f64 {
    metric_value(
        &app.metrics().await,
        "tributary_downstream_breaker_ignored_total",
        &[("reason", reason)],
    )
    .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn the_gateways_own_saturation_opens_no_circuit_and_requests_succeed_after_it() {
    let app = spawn_app_full(
        |s| {
            s.overload.queue_delay_target = Duration::from_millis(5);
            s.circuit_breaker.min_calls = 5;
            for d in s.downstreams.iter_mut() {
                d.timeout = Duration::from_millis(100);
            }
        },
        Router::new().route("/test/hog", get(hogs_the_worker)),
        Behaviour {
            latency: Duration::from_millis(50),
            ..Behaviour::default()
        },
    )
    .await;

    for _ in 0..4 {
        // Dashboards whose downstream calls are in flight when the worker is taken: their
        // 100 ms timers come due while nothing can run, and fire 200 ms late.
        let calls = join_all((0..10).map(|i| app.dashboard(i + 1)));
        let hog = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            app.get("/test/hog").await.status()
        };
        let (_answers, hog) = tokio::join!(calls, hog);
        assert_eq!(hog, 200);
    }

    assert!(
        breakers_closed(&app),
        "a circuit opened on the gateway's own saturation"
    );
    assert!(
        ignored(&app, "gateway_saturated").await > 0.0,
        "the test must produce timeouts during saturation to mean anything"
    );
    // Calm again: admitted requests get every part.
    let full = eventually(Duration::from_secs(5), || async {
        let (status, body) = app.dashboard(1).await;
        status == 200 && optional().iter().all(|(_, part)| !body[*part].is_null())
    })
    .await;
    assert!(full, "requests after the saturation must succeed in full");
}

#[tokio::test]
async fn a_caller_with_a_tiny_budget_cannot_open_the_shared_circuit() {
    let app = spawn_app_with(|s| s.circuit_breaker.min_calls = 5).await;
    for service in Service::ALL {
        app.set_service(service, |b| b.latency = Duration::from_millis(30));
    }
    for _ in 0..40 {
        let _ = app
            .client
            .get(app.url("/api/v1/dashboard/1"))
            .header("x-request-budget-ms", "8")
            .send()
            .await
            .unwrap();
    }
    assert!(breakers_closed(&app), "one caller opened a circuit for all");
    assert!(
        ignored(&app, "request_budget").await > 0.0,
        "the tiny budget must have cut calls short"
    );
    let (status, _) = app.dashboard(1).await;
    assert_eq!(status, 200, "a normal client is still served");
}

#[tokio::test]
async fn a_rejection_costs_a_counter_and_a_small_answer_not_a_log_line() {
    let app = spawn_app_with(|s| {
        s.admission.mode = AdmissionMode::Static;
        s.admission.max_in_flight = nz(1);
        s.admission.max_wait = Duration::ZERO;
        s.admission.pushback = false;
    })
    .await;
    // Exported before any rejection (at 0 in a fresh process; this one is shared by the tests).
    let before = rejected(&app, "overloaded").await;
    assert!(
        before >= 0.0,
        "the counter is exported before any rejection"
    );
    let red_503 = |text: &str| {
        metric_value(
            text,
            "http_server_request_duration_seconds_count",
            &[
                ("http_route", "/api/v1/dashboard/{user_id}"),
                ("http_response_status_code", "503"),
            ],
        )
        .unwrap_or(0.0)
    };
    let red_before = red_503(&app.metrics().await);
    let (holder, limiter) = hold_the_only_permit(&app).await;

    let resp = app
        .client
        .get(app.url("/api/v1/dashboard/2"))
        .header("x-request-id", "shed-me-1")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.headers()["content-type"], "application/problem+json");
    assert_eq!(resp.headers()["x-request-id"], "shed-me-1");
    let retry_after: u64 = resp.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry_after >= 1);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["type"], "/problems/unavailable");
    assert_eq!(holder.await.unwrap(), 200);

    assert!(rejected(&app, "overloaded").await >= before + 1.0);
    assert_eq!(
        limiter.rejected(),
        1,
        "exactly the one request was turned away"
    );
    assert!(
        red_503(&app.metrics().await) >= red_before + 1.0,
        "the shed request is in the RED metrics"
    );
    let logged = log_lines()
        .into_iter()
        .any(|l| l.to_string().contains("shed-me-1"));
    assert!(!logged, "a rejection must not write a log line");
}

/// Slows every downstream to 400 ms (under the calls' 500 ms timeout, so the holder succeeds),
/// starts one dashboard request and waits until it holds the dashboard group's only permit.
/// Returns the holder (its status once answered) and the group's limiter.
async fn hold_the_only_permit(app: &TestApp) -> (JoinHandle<reqwest::StatusCode>, Arc<Limiter>) {
    for service in Service::ALL {
        app.set_service(service, |b| b.latency = Duration::from_millis(400));
    }
    let holder = tokio::spawn({
        let (client, url) = (app.client.clone(), app.url("/api/v1/dashboard/1"));
        async move { client.get(url).send().await.unwrap().status() }
    });
    let limiter = app
        .state
        .admission
        .as_ref()
        .unwrap()
        .limiter(tributary::config::RouteGroup::Dashboard);
    assert!(
        eventually(Duration::from_secs(5), || async {
            limiter.in_flight() == 1
        })
        .await,
        "the holder never took the permit"
    );
    (holder, limiter)
}

/// Sends one request for `path` on `stream` and reads one response; returns its status.
async fn exchange(stream: &mut TcpStream, path: &str) -> u16 {
    let request = format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    read_response(stream).await
}

/// Reads one response with a content-length body; returns its status.
async fn read_response(stream: &mut TcpStream) -> u16 {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        assert_eq!(
            stream.read(&mut byte).await.unwrap(),
            1,
            "connection closed"
        );
        buf.push(byte[0]);
    }
    let head = String::from_utf8(buf).unwrap().to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map_or(0, |v| v.trim().parse().unwrap());
    let mut body = vec![0u8; length];
    stream.read_exact(&mut body).await.unwrap();
    head[9..12].parse().unwrap()
}

#[tokio::test]
async fn a_client_that_retries_at_once_is_decided_at_once_and_answered_after_its_retry_after() {
    let app = spawn_app_with(|s| {
        s.admission.mode = AdmissionMode::Static;
        s.admission.max_in_flight = nz(1);
        s.admission.max_wait = Duration::ZERO;
    })
    .await;
    let (holder, limiter) = hold_the_only_permit(&app).await;

    let mut stream = TcpStream::connect(app.addr).await.unwrap();
    assert_eq!(exchange(&mut stream, "/api/v1/dashboard/2").await, 503);
    let after_first = limiter.rejected();

    // The retry, at once, on the same connection. It is read and decided at once (had the
    // permit been free it would have been admitted and answered without delay); turned away
    // again, its 503 is held until the first one's Retry-After is over.
    let sent = Instant::now();
    stream
        .write_all(b"GET /api/v1/dashboard/3 HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async {
            limiter.rejected() > after_first
        })
        .await,
        "the retry must be read and decided while the permit is held, not left unread"
    );
    let decided = sent.elapsed();
    let status = read_response(&mut stream).await;
    let answered = sent.elapsed();
    assert_eq!(status, 503);
    // Lower bounds only, which a slow machine can only make larger: the answer waits for the
    // rest of the first 503's one second or more of Retry-After.
    assert!(
        answered >= Duration::from_millis(900) && answered >= decided + Duration::from_millis(300),
        "held: decided after {decided:?}, answered after {answered:?}"
    );
    assert_eq!(holder.await.unwrap(), 200);
    // Other connections are not held: health answers at once meanwhile.
    assert_eq!(app.get("/healthz").await.status(), 200);
}

#[tokio::test]
async fn a_client_that_retries_at_once_into_an_open_circuit_is_held_as_well() {
    let app = spawn_app_with(|s| {
        s.circuit_breaker.min_calls = 4;
        s.circuit_breaker.open_for = Duration::from_secs(60);
        s.admission.pushback_max_hold = Duration::from_secs(1);
    })
    .await;
    // The required part fails until its circuit opens: from then on every dashboard is a 503
    // with Retry-After from beneath the edge, admitted but answered without a downstream call.
    app.set_service(Service::Users, |b| b.error_rate = 1.0);
    let users = app.state.downstreams.get(Service::Users);
    let opened = eventually(Duration::from_secs(10), || async {
        app.dashboard(1).await;
        users.breaker_state() == State::Open
    })
    .await;
    assert!(opened, "the users circuit never opened");

    let mut stream = TcpStream::connect(app.addr).await.unwrap();
    let sent = Instant::now();
    assert_eq!(exchange(&mut stream, "/api/v1/dashboard/2").await, 503);
    let first = sent.elapsed();
    // Back at once on the same connection: the circuit is still open, and this 503 waits for
    // the first one's stay-away (the max hold, 1 s, under the circuit's 5 s Retry-After).
    assert_eq!(exchange(&mut stream, "/api/v1/dashboard/3").await, 503);
    let second = sent.elapsed();
    assert!(
        second >= Duration::from_millis(900),
        "held: the first 503 after {first:?}, the second after {second:?}"
    );
    // Other connections are not held: health answers at once meanwhile.
    assert_eq!(app.get("/healthz").await.status(), 200);
}
