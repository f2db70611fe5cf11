//! The dashboard contract: six concurrent parts, partial results, required-part failure,
//! deadlines and cancellation.

use std::time::Duration;

use serde_json::Value;
use tributary::domain::Service;
use tributary_sim::Mode;

use crate::helpers::{eventually, optional, problem, spawn_app, spawn_app_with};

#[tokio::test]
async fn dashboard_merges_all_six_parts() {
    let app = spawn_app().await;
    app.seed(3, 7).await;

    let resp = app.get("/api/v1/dashboard/2").await;
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().contains_key("x-request-id"));
    let timing = resp.headers()["server-timing"].to_str().unwrap().to_owned();
    for part in [
        "users",
        "carts",
        "recommendations",
        "promotions",
        "notifications",
        "recent_orders",
        "gateway",
        "total",
    ] {
        assert!(timing.contains(&format!("{part};dur=")), "{timing}");
    }
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["user_id"], 2);
    assert_eq!(body["profile"]["service"], "users");
    assert_eq!(body["profile"]["user_id"], 2);
    assert_eq!(body["cart"]["service"], "carts");
    assert_eq!(body["recommendations"]["service"], "recommendations");
    assert_eq!(body["promotions"]["service"], "promotions");
    assert_eq!(body["notifications"]["service"], "notifications");
    assert_eq!(body["degraded"], serde_json::json!([]));
    assert_eq!(
        body["stale"],
        serde_json::json!([]),
        "no cache, nothing stale"
    );
    assert!(
        !timing.contains("desc="),
        "no part is marked cached: {timing}"
    );
    let orders = body["recent_orders"].as_array().unwrap();
    assert_eq!(orders.len(), 5, "five most recent of seven");
    let times: Vec<&str> = orders
        .iter()
        .map(|o| o["created_at"].as_str().unwrap())
        .collect();
    let mut sorted = times.clone();
    sorted.sort_by(|a, b| b.cmp(a));
    assert_eq!(times, sorted, "newest first");
    for o in orders {
        for field in ["id", "status", "total_cents", "created_at"] {
            assert!(!o[field].is_null(), "{field} missing in {o}");
        }
    }
}

#[tokio::test]
async fn all_six_parts_run_concurrently_not_one_after_another() {
    // Each downstream takes 300 ms; sequential calls would need 1.5 s, beyond the 1 s deadline.
    let app = spawn_app_with(|s| s.server.request_deadline = Duration::from_secs(1)).await;
    for service in Service::ALL {
        app.set_service(service, |b| b.latency = Duration::from_millis(300));
    }
    let resp = app.get("/api/v1/dashboard/1").await;
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["degraded"], serde_json::json!([]), "{body}");
}

#[tokio::test]
async fn each_optional_part_that_fails_becomes_null_and_degraded() {
    let app = spawn_app().await;
    for (service, field) in optional() {
        app.set_service(service, |b| b.error_rate = 1.0);
        let body: Value = app.get("/api/v1/dashboard/1").await.json().await.unwrap();
        assert!(body[field].is_null(), "{field} should be null: {body}");
        assert_eq!(body["degraded"], serde_json::json!([field]));
        assert_eq!(body["profile"]["service"], "users");
        app.set_service(service, |b| b.error_rate = 0.0);
    }
}

#[tokio::test]
async fn each_optional_part_that_times_out_becomes_null_and_degraded() {
    let app = spawn_app_with(|s| {
        for d in [
            &mut s.downstreams.carts,
            &mut s.downstreams.recommendations,
            &mut s.downstreams.promotions,
            &mut s.downstreams.notifications,
        ] {
            d.timeout = Duration::from_millis(100);
        }
    })
    .await;
    for (service, field) in optional() {
        app.hang(service);
        let resp = app.get("/api/v1/dashboard/1").await;
        assert_eq!(resp.status(), 200);
        let body: Value = resp.json().await.unwrap();
        assert!(body[field].is_null());
        assert_eq!(body["degraded"], serde_json::json!([field]));
        app.set_service(service, |b| b.mode = Mode::Normal);
    }
    let metrics = app.metrics().await;
    assert!(
        metrics.contains(r#"tributary_fanout_degraded_total{part="carts",reason="timeout"}"#),
        "{metrics}"
    );
}

#[tokio::test]
async fn invalid_json_from_an_optional_part_degrades_it() {
    let app = spawn_app().await;
    app.set_service(Service::Promotions, |b| b.mode = Mode::InvalidJson);
    let body: Value = app.get("/api/v1/dashboard/1").await.json().await.unwrap();
    assert!(body["promotions"].is_null());
    assert_eq!(body["degraded"], serde_json::json!(["promotions"]));
}

#[tokio::test]
async fn recent_orders_degrade_when_the_query_fails() {
    let app = spawn_app().await;
    sqlx::query("ALTER TABLE orders RENAME TO orders_elsewhere")
        .execute(&app.db)
        .await
        .unwrap();
    let resp = app.get("/api/v1/dashboard/1").await;
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    assert!(body["recent_orders"].is_null());
    assert_eq!(body["degraded"], serde_json::json!(["recent_orders"]));
}

/// Waits until every optional service has seen `n` calls abandoned by the gateway.
async fn siblings_cancelled(app: &crate::helpers::TestApp, n: u64) -> bool {
    eventually(Duration::from_secs(5), || async {
        optional()
            .iter()
            .all(|(s, _)| app.sim.sim.stats(*s).cancelled >= n)
    })
    .await
}

#[tokio::test]
async fn a_failing_required_part_is_a_502_and_cancels_its_siblings() {
    let app = spawn_app().await;
    app.set_service(Service::Users, |b| {
        b.error_rate = 1.0;
        b.latency = Duration::from_millis(20);
    });
    for (service, _) in optional() {
        app.set_service(service, |b| b.latency = Duration::from_secs(5));
    }
    let (status, body) = problem(app.get("/api/v1/dashboard/1").await).await;
    assert_eq!(status, 502);
    assert_eq!(body["type"], "/problems/bad-gateway");
    assert!(
        siblings_cancelled(&app, 1).await,
        "optional calls were not cancelled"
    );
    for (service, _) in optional() {
        assert_eq!(
            app.sim.sim.stats(service).completed,
            0,
            "{service} ran to completion"
        );
    }
}

#[tokio::test]
async fn a_required_part_that_times_out_is_a_504_and_cancels_its_siblings() {
    let app = spawn_app_with(|s| s.downstreams.users.timeout = Duration::from_millis(100)).await;
    app.hang(Service::Users);
    for (service, _) in optional() {
        app.set_service(service, |b| b.latency = Duration::from_secs(5));
    }
    let (status, body) = problem(app.get("/api/v1/dashboard/1").await).await;
    assert_eq!(status, 504);
    assert_eq!(body["type"], "/problems/gateway-timeout");
    assert!(siblings_cancelled(&app, 1).await);
}

#[tokio::test]
async fn a_missing_user_is_a_404() {
    let app = spawn_app().await;
    app.set_service(Service::Users, |b| b.mode = Mode::NotFound);
    let (status, _) = problem(app.get("/api/v1/dashboard/1").await).await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn a_client_that_goes_away_cancels_every_downstream_call() {
    let app = spawn_app().await;
    for service in Service::ALL {
        app.set_service(service, |b| b.latency = Duration::from_secs(5));
    }
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let result = impatient.get(app.url("/api/v1/dashboard/1")).send().await;
    assert!(result.is_err(), "the client gave up");
    let all_cancelled = eventually(Duration::from_secs(5), || async {
        Service::ALL
            .iter()
            .all(|s| app.sim.sim.stats(*s).cancelled == 1 && app.sim.sim.stats(*s).in_flight == 0)
    })
    .await;
    assert!(all_cancelled, "downstream calls outlived their request");
    // Nothing leaked on the gateway side either.
    assert!(
        eventually(Duration::from_secs(2), || async {
            app.state.admission.as_ref().unwrap().in_flight() == 0
        })
        .await
    );
    for d in app.state.downstreams.all() {
        assert_eq!(
            d.available_permits(),
            1024,
            "{} bulkhead permit leaked",
            d.service()
        );
    }
}

#[tokio::test]
async fn the_request_deadline_bounds_every_call_and_is_sent_downstream() {
    let app = spawn_app_with(|s| {
        s.server.request_deadline = Duration::from_millis(300);
        s.downstreams.carts.timeout = Duration::from_secs(10);
    })
    .await;
    app.hang(Service::Carts);
    let resp = app.get("/api/v1/dashboard/1").await;
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(
        body["degraded"],
        serde_json::json!(["cart"]),
        "carts must give up at the deadline, not its 10 s timeout"
    );
    let budgets: Vec<u64> = app
        .sim
        .sim
        .journal()
        .iter()
        .filter_map(|s| s.budget_ms)
        .collect();
    assert_eq!(budgets.len(), 5);
    assert!(
        budgets.iter().all(|b| *b <= 300),
        "budget header must not exceed the deadline: {budgets:?}"
    );
}

#[tokio::test]
async fn bad_ids_are_400_problems_that_name_the_field() {
    let app = spawn_app().await;
    for bad in ["0", "-3", "abc", "1.5", "99999999999999999999"] {
        let (status, body) = problem(app.get(&format!("/api/v1/dashboard/{bad}")).await).await;
        assert_eq!(status, 400, "{bad}");
        assert_eq!(body["field"], "user_id");
    }
    assert_eq!(
        app.sim.sim.stats(Service::Users).requests,
        0,
        "bad ids never reach a downstream"
    );
}

#[tokio::test]
async fn unknown_routes_and_wrong_methods_are_problems() {
    let app = spawn_app().await;
    let (status, _) = problem(app.get("/api/v1/nothing-here").await).await;
    assert_eq!(status, 404);
    let resp = app
        .client
        .delete(app.url("/api/v1/dashboard/1"))
        .send()
        .await
        .unwrap();
    let (status, _) = problem(resp).await;
    assert_eq!(status, 405);
}

#[tokio::test]
async fn request_ids_are_echoed_when_well_formed_and_replaced_otherwise() {
    let app = spawn_app().await;
    let resp = app
        .client
        .get(app.url("/healthz"))
        .header("x-request-id", "abc-123")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-request-id"], "abc-123");
    let resp = app
        .client
        .get(app.url("/healthz"))
        .header("x-request-id", "bad id with spaces")
        .send()
        .await
        .unwrap();
    let id = resp.headers()["x-request-id"].to_str().unwrap();
    assert_ne!(id, "bad id with spaces");
    assert_eq!(id.len(), 32);
}
