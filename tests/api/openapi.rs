//! The OpenAPI document as the gateway serves it.

use serde_json::Value;

use crate::helpers::spawn_app;

#[tokio::test]
async fn the_gateway_serves_the_committed_openapi_document() {
    let app = spawn_app().await;

    let resp = app.get("/openapi.json").await;

    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "application/json");
    assert!(resp.headers().contains_key("x-request-id"));
    let served = resp.text().await.unwrap();
    let committed = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/openapi.json"))
        .expect("openapi.json at the repository root");
    assert!(
        served == committed,
        "GET /openapi.json differs from the committed openapi.json: run make openapi"
    );
    let doc: Value = serde_json::from_str(&served).unwrap();
    assert_eq!(doc["openapi"], "3.1.0");
    for path in [
        "/api/v1/dashboard/{user_id}",
        "/api/v1/orders",
        "/api/v1/orders/{id}",
        "/healthz",
        "/readyz",
        "/openapi.json",
        "/metrics",
    ] {
        assert!(doc["paths"].get(path).is_some(), "{path} is not described");
    }
}
