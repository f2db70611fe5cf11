//! Metrics exposition and the long-poll detector (the async analogue of pinned carriers).

use std::{
    collections::{BTreeMap, BTreeSet},
    time::Duration,
};

use axum::{Router, routing::get};
use tributary::{config::Secret, domain::Service, startup::METRIC_FAMILIES};
use tributary_sim::Behaviour;

use crate::helpers::{
    eventually, log_lines, metric_value, nz, spawn_app, spawn_app_full, spawn_app_with,
};

/// A handler that does what no async handler may: block its worker thread.
async fn blocks_the_worker() -> &'static str {
    // Deliberately wrong: the detector under test must catch exactly this.
    std::thread::sleep(Duration::from_millis(120));
    "done"
}

#[tokio::test]
async fn a_blocking_handler_is_reported_as_a_long_poll_in_its_request_span() {
    let app = spawn_app_full(
        |s| s.telemetry.long_poll_threshold = Duration::from_millis(50),
        Router::new().route("/test/blocking", get(blocks_the_worker)),
        Behaviour::default(),
    )
    .await;
    let before = metric_value(
        &app.metrics().await,
        "tributary_runtime_long_polls_total",
        &[],
    )
    .unwrap_or(0.0);

    let resp = app
        .client
        .get(app.url("/test/blocking"))
        .header("x-request-id", "blocker-1")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);

    let after = metric_value(
        &app.metrics().await,
        "tributary_runtime_long_polls_total",
        &[],
    )
    .unwrap();
    assert!(after >= before + 1.0, "long polls {before} -> {after}");
    let line = log_lines()
        .into_iter()
        .find(|l| l["span"]["request_id"] == "blocker-1")
        .expect("a long-poll warning inside the request span");
    assert!(
        line["message"].as_str().unwrap().starts_with("long poll"),
        "{line}"
    );
    assert_eq!(line["span"]["http.route"], "/test/blocking");
    assert!(line["poll_ms"].as_f64().unwrap() >= 100.0, "{line}");
}

#[tokio::test]
async fn a_well_behaved_request_is_not_reported() {
    let app = spawn_app().await;
    let resp = app
        .client
        .get(app.url("/api/v1/dashboard/1"))
        .header("x-request-id", "polite-1")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(!log_lines().iter().any(|l| {
        l["span"]["request_id"] == "polite-1"
            && l["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("long poll"))
    }));
}

/// The families in an exposition: name and type from every `# TYPE` line, and the names that
/// have a `# HELP` line.
fn families_in(text: &str) -> (BTreeMap<String, String>, BTreeSet<String>) {
    let mut typed = BTreeMap::new();
    let mut described = BTreeSet::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        match (words.next(), words.next(), words.next(), words.next()) {
            (Some("#"), Some("TYPE"), Some(name), Some(kind)) => {
                typed.insert(name.to_owned(), kind.to_owned());
            }
            (Some("#"), Some("HELP"), Some(name), _) => {
                described.insert(name.to_owned());
            }
            _ => {}
        }
    }
    (typed, described)
}

#[tokio::test]
async fn the_exposition_holds_exactly_the_catalogued_families_each_described() {
    // Rate limiting on, with a Redis nobody listens on, so its families exist as well.
    let no_redis = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let app = spawn_app_with(|s| {
        s.rate_limit.enabled = true;
        s.rate_limit.redis_url = Some(Secret::new(format!("redis://{no_redis}")));
    })
    .await;
    app.seed(2, 3).await;
    for _ in 0..3 {
        assert_eq!(app.get("/api/v1/dashboard/1").await.status(), 200);
    }
    assert_eq!(app.get("/api/v1/dashboard/2").await.status(), 200);
    app.set_service(Service::Carts, |b| b.error_rate = 1.0);
    assert_eq!(app.get("/api/v1/dashboard/2").await.status(), 200);
    let catalogue: BTreeMap<String, String> = METRIC_FAMILIES
        .iter()
        .copied()
        .flatten()
        .map(|f| (f.name.to_owned(), f.kind.as_str().to_owned()))
        .collect();

    // The samplers run once a second: wait for their first round.
    let give_up = tokio::time::Instant::now() + Duration::from_secs(10);
    let text = loop {
        let text = app.metrics().await;
        if families_in(&text).0 == catalogue || tokio::time::Instant::now() > give_up {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };

    let (typed, described) = families_in(&text);
    let settled = typed == catalogue;
    let missing: Vec<_> = catalogue
        .keys()
        .filter(|n| !typed.contains_key(*n))
        .collect();
    let unknown: Vec<_> = typed
        .keys()
        .filter(|n| !catalogue.contains_key(*n))
        .collect();
    assert!(
        settled,
        "catalogued but not exported: {missing:?}; exported but not catalogued: {unknown:?}; \
         exported as another type: {:?}",
        typed
            .iter()
            .filter(|(n, k)| catalogue.get(*n).is_some_and(|c| c != *k))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        described,
        catalogue.keys().cloned().collect::<BTreeSet<_>>(),
        "every exported family has its help text"
    );
    // Route templates, never raw paths or user ids.
    assert!(text.contains(r#"http_route="/api/v1/dashboard/{user_id}""#));
    assert!(
        !text.contains("/api/v1/dashboard/1\""),
        "raw path leaked into a label"
    );
    let ok = metric_value(
        &text,
        "tributary_http_requests_total",
        &[
            ("http_route", "/api/v1/dashboard/{user_id}"),
            ("status_class", "2xx"),
        ],
    )
    .unwrap();
    assert!(ok >= 4.0);
    // The process's threads are counted (this test process runs several).
    assert!(metric_value(&text, "process_threads", &[]).is_some_and(|n| n >= 2.0));
    // 1 ms and 1 s are both bucket boundaries, and 100–300 ms is resolved every 50 ms.
    assert!(text.contains(r#"le="0.001""#) && text.contains(r#"le="1""#));
    for le in ["0.1", "0.15", "0.2", "0.25", "0.3"] {
        let bucket = format!(r#"le="{le}""#);
        assert!(
            text.lines().any(|l| {
                l.starts_with("http_server_request_duration_seconds_bucket{") && l.contains(&bucket)
            }),
            "a request-duration bucket at {le} s"
        );
    }
}

#[tokio::test]
async fn every_request_line_carries_ids_route_status_and_latency() {
    let app = spawn_app().await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent_id = "00f067aa0ba902b7";
    let resp = app
        .client
        .get(app.url("/api/v1/dashboard/3"))
        .header("x-request-id", "logline-1")
        .header("traceparent", format!("00-{trace_id}-{parent_id}-01"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);

    let line = log_lines()
        .into_iter()
        .find(|l| l["span"]["request_id"] == "logline-1" && l["message"] == "request completed")
        .expect("a request line for the request");
    assert_eq!(line["level"], "INFO", "{line}");
    assert_eq!(line["span"]["name"], "http.request", "{line}");
    assert_eq!(line["span"]["trace_id"], trace_id, "{line}");
    let span_id = line["span"]["span_id"].as_str().expect("span_id");
    assert!(
        span_id.len() == 16
            && span_id.bytes().all(|b| b.is_ascii_hexdigit())
            && span_id != parent_id,
        "this hop's own span id: {line}"
    );
    assert_eq!(line["route"], "/api/v1/dashboard/{user_id}", "{line}");
    assert_eq!(
        line["span"]["http.route"], "/api/v1/dashboard/{user_id}",
        "{line}"
    );
    assert_eq!(line["status"], 200, "{line}");
    assert_eq!(line["user_id"], 3, "{line}");
    let latency = line["latency_ms"].as_f64().expect("latency_ms");
    assert!(latency > 0.0 && latency < 10_000.0, "{line}");
    // Milliseconds to the microsecond: at most three decimals, never a float's noise.
    let written = line["latency_ms"].to_string();
    let decimals = written.split_once('.').map_or(0, |(_, d)| d.len());
    assert!(decimals <= 3, "latency_ms {written}: {line}");

    // The per-call and per-query spans are for traces: no log line is ever attributed to one.
    let lines = log_lines();
    assert!(
        lines
            .iter()
            .all(|l| l["span"]["name"].is_null() || l["span"]["name"] == "http.request"),
        "a log line carried a span other than the request span"
    );
}

#[tokio::test]
async fn a_request_without_trace_context_gets_fresh_ids_in_its_line() {
    let app = spawn_app().await;
    let resp = app
        .client
        .get(app.url("/api/v1/orders/999999999"))
        .header("x-request-id", "logline-2")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    let line = log_lines()
        .into_iter()
        .find(|l| l["span"]["request_id"] == "logline-2" && l["message"] == "request completed")
        .expect("a request line for the request");
    let hex = |v: &serde_json::Value, n: usize| {
        v.as_str()
            .is_some_and(|s| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit()))
    };
    assert!(hex(&line["span"]["trace_id"], 32), "{line}");
    assert!(hex(&line["span"]["span_id"], 16), "{line}");
    assert_eq!(line["status"], 404, "{line}");
    assert_eq!(line["route"], "/api/v1/orders/{id}", "{line}");
    assert!(line["user_id"].is_null(), "{line}");
}

#[tokio::test]
async fn a_request_the_client_abandons_is_recorded_as_499() {
    let app = spawn_app().await;
    for service in Service::ALL {
        app.set_service(service, |b| b.latency = Duration::from_secs(5));
    }
    let abandoned = |text: &str| {
        metric_value(
            text,
            "http_server_request_duration_seconds_count",
            &[
                ("http_route", "/api/v1/dashboard/{user_id}"),
                ("http_response_status_code", "499"),
            ],
        )
        .unwrap_or(0.0)
    };
    let before = abandoned(&app.metrics().await);

    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let gave_up = impatient
        .get(app.url("/api/v1/dashboard/1"))
        .header("x-request-id", "abandoned-1")
        .send()
        .await;
    assert!(gave_up.is_err(), "the client was meant to give up first");

    let line = |l: &serde_json::Value| l["span"]["request_id"] == "abandoned-1";
    assert!(
        eventually(Duration::from_secs(5), || async {
            log_lines().iter().any(line)
        })
        .await,
        "no access line for the abandoned request"
    );
    let lines: Vec<_> = log_lines().into_iter().filter(line).collect();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["message"], "request abandoned by the client");
    assert_eq!(lines[0]["status"], 499);
    assert!(
        lines[0]["latency_ms"].as_f64().unwrap() >= 150.0,
        "{}",
        lines[0]
    );
    // The line is written after the metrics, so one scrape sees them.
    assert_eq!(abandoned(&app.metrics().await), before + 1.0);
}

async fn panics() -> &'static str {
    panic!("a bug in a handler")
}

#[tokio::test]
async fn only_unexpected_errors_are_logged_at_error_and_each_error_once() {
    let app = spawn_app_full(
        |s| {
            s.admission.max_in_flight = nz(1);
            s.admission.mode = tributary::config::AdmissionMode::Static;
            s.admission.max_wait = Duration::from_millis(1);
            // The client's pooled connections go on to the next requests at once.
            s.admission.pushback = false;
            s.server.request_deadline = Duration::from_secs(4);
            s.downstreams.carts.timeout = Duration::from_secs(3);
            s.downstreams.users.timeout = Duration::from_millis(300);
        },
        Router::new().route("/test/panics", get(panics)),
        Behaviour {
            latency: Duration::from_millis(5),
            ..Behaviour::default()
        },
    )
    .await;
    let get = |path: &str, id: &str| {
        app.client
            .get(app.url(path))
            .header("x-request-id", id)
            .send()
    };

    // Act: the one dashboard slot is held by a slow request; the next one is shed.
    app.set_service(Service::Carts, |b| b.latency = Duration::from_secs(1));
    let holder = tokio::spawn(get("/api/v1/dashboard/1", "holder-1"));
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
        .await
    );
    assert_eq!(
        get("/api/v1/dashboard/1", "shed-1").await.unwrap().status(),
        503
    );
    assert_eq!(holder.await.unwrap().unwrap().status(), 200);
    // A required part that times out: 504.
    app.set_service(Service::Carts, |b| b.latency = Duration::from_millis(5));
    app.hang(Service::Users);
    assert_eq!(
        get("/api/v1/dashboard/1", "timeout-1")
            .await
            .unwrap()
            .status(),
        504
    );
    // A bug: 500.
    assert_eq!(get("/test/panics", "panic-1").await.unwrap().status(), 500);

    // Assert: the expected errors are one INFO access line each; the bug is one ERROR line.
    let lines_of = |id: &str| -> Vec<serde_json::Value> {
        log_lines()
            .into_iter()
            .filter(|l| l["span"]["request_id"] == id)
            .collect()
    };
    // A rejection is decided at the edge and writes no line: under overload there are
    // thousands a second, and the counters and the RED metrics carry them.
    assert_eq!(lines_of("shed-1"), Vec::<serde_json::Value>::new());
    // The expected error is one INFO access line.
    let lines = lines_of("timeout-1");
    assert_eq!(lines.len(), 1, "one access line, nothing else: {lines:?}");
    assert_eq!(lines[0]["level"], "INFO", "{}", lines[0]);
    assert_eq!(lines[0]["status"], 504, "{}", lines[0]);
    assert!(
        lines[0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("gateway timeout")),
        "{}",
        lines[0]
    );
    let lines = lines_of("panic-1");
    let errors: Vec<_> = lines.iter().filter(|l| l["level"] == "ERROR").collect();
    assert_eq!(errors.len(), 1, "one error line for the bug: {lines:?}");
    assert!(
        errors[0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("handler panicked: a bug in a handler")),
        "{}",
        errors[0]
    );
    assert!(
        lines
            .iter()
            .any(|l| l["message"] == "request completed" && l["status"] == 500),
        "{lines:?}"
    );
}

/// The captured lines of one request, by its `x-request-id`.
fn lines_of(request_id: &str) -> Vec<serde_json::Value> {
    log_lines()
        .into_iter()
        .filter(|l| l["span"]["request_id"] == request_id)
        .collect()
}

#[tokio::test]
async fn a_degraded_part_is_one_warning_that_names_the_part_the_reason_and_the_cause() {
    let app = spawn_app().await;
    app.set_service(Service::Carts, |b| b.error_rate = 1.0);

    let resp = app
        .client
        .get(app.url("/api/v1/dashboard/4"))
        .header("x-request-id", "degraded-log-1")
        .send()
        .await
        .unwrap();

    assert_eq!(resp.status(), 200);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["degraded"], serde_json::json!(["cart"]), "{body}");
    let lines = lines_of("degraded-log-1");
    let warnings: Vec<_> = lines
        .iter()
        .filter(|l| l["level"] == "WARN" || l["level"] == "ERROR")
        .collect();
    assert_eq!(
        warnings.len(),
        1,
        "one warning for one degraded part: {warnings:#?}"
    );
    let warning = warnings[0];
    assert_eq!(warning["message"], "dashboard part degraded", "{warning}");
    assert_eq!(warning["part"], "cart", "{warning}");
    assert_eq!(warning["reason"], "error", "{warning}");
    assert_eq!(warning["error"], "carts answered 500", "{warning}");
}

#[tokio::test]
async fn a_failed_required_call_logs_its_cause_once() {
    let app = spawn_app().await;
    app.set_service(Service::Users, |b| b.error_rate = 1.0);

    let resp = app
        .client
        .get(app.url("/api/v1/dashboard/4"))
        .header("x-request-id", "required-failed-1")
        .send()
        .await
        .unwrap();

    assert_eq!(resp.status(), 502);
    let lines = lines_of("required-failed-1");
    let with_cause: Vec<_> = lines
        .iter()
        .filter(|l| l.to_string().contains("users answered 500"))
        .collect();
    assert_eq!(with_cause.len(), 1, "the cause once: {lines:#?}");
    assert_eq!(with_cause[0]["level"], "ERROR", "{}", with_cause[0]);
    // The cancelled optional parts are not degraded parts of a page that was never served.
    assert!(
        !lines
            .iter()
            .any(|l| l["message"] == "dashboard part degraded"),
        "{lines:#?}"
    );
}

#[tokio::test]
async fn health_probes_are_not_logged_at_info() {
    let app = spawn_app().await;

    for (path, id) in [("/healthz", "probe-log-1"), ("/readyz", "probe-log-2")] {
        let resp = app
            .client
            .get(app.url(path))
            .header("x-request-id", id)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{path}");
    }
    // A request after them, whose line shows that theirs would have been written by now.
    let resp = app
        .client
        .get(app.url("/api/v1/orders/999999999"))
        .header("x-request-id", "probe-log-3")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);

    assert!(
        eventually(Duration::from_secs(5), || async {
            !lines_of("probe-log-3").is_empty()
        })
        .await
    );
    assert!(
        lines_of("probe-log-1").is_empty(),
        "{:?}",
        lines_of("probe-log-1")
    );
    assert!(
        lines_of("probe-log-2").is_empty(),
        "{:?}",
        lines_of("probe-log-2")
    );
}
