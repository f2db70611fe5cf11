//! Metrics exposition and the long-poll detector (the async analogue of pinned carriers).

use std::time::Duration;

use axum::{Router, routing::get};
use tributary::sim::Behaviour;

use crate::helpers::{log_lines, metric_value, spawn_app, spawn_app_full};

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

#[tokio::test]
async fn metrics_expose_every_family_with_bounded_labels() {
    let app = spawn_app().await;
    app.seed(2, 3).await;
    for _ in 0..3 {
        assert_eq!(app.get("/api/v1/dashboard/1").await.status(), 200);
    }
    assert_eq!(app.get("/api/v1/dashboard/2").await.status(), 200);
    // The sampler runs once a second.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let text = app.metrics().await;
    for family in [
        "http_server_request_duration_seconds_bucket",
        "tributary_http_requests_total",
        "http_server_active_requests",
        "tributary_admission_permits_in_use",
        "tributary_admission_limit",
        "tributary_admission_wait_seconds_bucket",
        "tributary_admission_shedding",
        "tributary_downstream_request_duration_seconds_bucket",
        "tributary_downstream_requests_total",
        "tributary_downstream_in_flight",
        "tributary_downstream_circuit_state",
        "tributary_db_pool_connections",
        "tributary_db_pool_max_connections",
        "tributary_db_pool_waiters",
        "tributary_db_query_duration_seconds_bucket",
        "tributary_fanout_critical_path_total",
        "tributary_fanout_gateway_overhead_seconds_bucket",
        "tributary_runtime_workers",
        "tributary_runtime_worker_busy_ratio",
        "tributary_runtime_polls_total",
        "tributary_runtime_alive_tasks",
        "tributary_runtime_blocking_threads",
        "tributary_runtime_blocking_queue_depth",
        "tributary_runtime_global_queue_depth",
        "tributary_runtime_scheduling_lag_seconds_bucket",
        "process_resident_memory_bytes",
        "process_open_fds",
        "tributary_build_info",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(family)),
            "missing {family}"
        );
    }
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
    // 1 ms and 1 s are both bucket boundaries.
    assert!(text.contains(r#"le="0.001""#) && text.contains(r#"le="1""#));
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
