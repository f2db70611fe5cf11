//! Liveness, readiness and graceful shutdown.

use std::time::Duration;

use serde_json::Value;
use tributary::domain::Service;

use crate::helpers::{database_exists, fresh_database, spawn_app, spawn_app_with};

#[tokio::test]
async fn healthz_and_readyz_are_ok_when_the_database_is_migrated() {
    let app = spawn_app().await;
    assert_eq!(app.get("/healthz").await.status(), 200);
    let resp = app.get("/readyz").await;
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["database"], "ok");
}

#[tokio::test]
async fn metrics_are_served_on_the_operations_port_only_and_health_on_both() {
    let app = spawn_app().await;
    assert_ne!(app.ops_addr.port(), app.addr.port());

    for path in ["/healthz", "/readyz"] {
        assert_eq!(app.get(path).await.status(), 200, "{path} on the API port");
        assert_eq!(
            app.ops_get(path).await.status(),
            200,
            "{path} on the ops port"
        );
    }
    let (status, body) = crate::helpers::problem(app.get("/metrics").await).await;
    assert_eq!(
        (status, body["type"].as_str()),
        (404, Some("/problems/not-found"))
    );

    let scrape = app.ops_get("/metrics").await;
    assert_eq!(scrape.status(), 200);
    let text = scrape.text().await.unwrap();
    // The API port's requests are counted; the scrape itself is not API traffic.
    assert!(
        text.contains(r#"http_route="/healthz""#),
        "the scrape has the API's request counts"
    );
    assert!(
        !text.contains(r#"http_route="/metrics""#),
        "a scrape was counted"
    );
}

#[tokio::test]
async fn readyz_stays_200_while_the_database_is_unreachable_and_says_so_in_its_body() {
    // A port nothing listens on: the database is down for the whole test.
    let unused = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let app = spawn_app_with(|s| {
        s.database.url =
            tributary::config::Secret::new(format!("postgres://postgres@{unused}/nothing"));
        s.database.run_migrations = false;
        s.database.acquire_timeout = Duration::from_millis(300);
    })
    .await;
    assert_eq!(app.get("/healthz").await.status(), 200);
    // This replica can serve (the dashboard degrades without its database), so it stays in
    // the load balancer; the body and a gauge say what is down, in words of our own.
    let resp = app.get("/readyz").await;
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.unwrap();
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["status"], "ready", "{text}");
    assert_eq!(body["database"], "unavailable", "{text}");
    assert!(!text.to_lowercase().contains("refused"), "{text}");
    // (The gauge's value is process-wide, shared by the tests' gateways: only its presence
    // is asserted here.)
    assert!(app.metrics().await.contains("\ntributary_db_up "));
    // The dashboard still answers, without its database part.
    let body: Value = app.get("/api/v1/dashboard/1").await.json().await.unwrap();
    assert_eq!(body["degraded"], serde_json::json!(["recent_orders"]));
}

#[tokio::test]
async fn readyz_is_503_until_migrations_are_applied() {
    // The test's own database, empty: the gateway is told not to migrate it.
    let app = spawn_app_with(|s| s.database.run_migrations = false).await;
    let resp = app.get("/readyz").await;
    assert_eq!(resp.status(), 503);
    let body: Value = resp.json().await.unwrap();
    assert!(
        body["database"].as_str().unwrap().contains("migrations"),
        "{body}"
    );

    app.state.db.migrate().await.unwrap();

    assert_eq!(app.get("/readyz").await.status(), 200);
}

#[tokio::test]
async fn every_database_a_test_creates_is_dropped_with_its_handle() {
    let database = fresh_database().await;
    let name = database.name.clone();
    assert!(database_exists(&name).await);
    drop(database);
    assert!(!database_exists(&name).await, "{name} outlived its test");

    let app = spawn_app().await;
    let name = app.db_name.clone();
    drop(app);
    assert!(!database_exists(&name).await, "{name} outlived its app");
}

#[tokio::test]
async fn shutdown_lets_in_flight_requests_finish_and_stops_accepting() {
    let mut app = spawn_app().await;
    for service in Service::ALL {
        app.set_service(service, |b| b.latency = Duration::from_millis(400));
    }
    let in_flight = tokio::spawn(app.client.get(app.url("/api/v1/dashboard/1")).send());
    tokio::time::sleep(Duration::from_millis(100)).await;
    app.stop().await.expect("clean shutdown");
    let resp = in_flight
        .await
        .unwrap()
        .expect("the in-flight request was answered");
    assert_eq!(resp.status(), 200);
    assert!(
        reqwest::Client::new()
            .get(app.url("/healthz"))
            .send()
            .await
            .is_err(),
        "no new connections after shutdown"
    );
}
