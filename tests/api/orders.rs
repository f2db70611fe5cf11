//! Idempotent order creation and read-back.

use std::time::Duration;

use futures::future::join_all;
use serde_json::{Value, json};

use crate::helpers::{TestApp, order, problem, spawn_app, spawn_app_with};

async fn orders_of(app: &TestApp, user_id: i64) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM orders WHERE user_id = $1")
        .bind(user_id)
        .fetch_one(&app.db)
        .await
        .unwrap()
}

#[tokio::test]
async fn an_order_is_created_in_one_transaction_and_reads_back() {
    let app = spawn_app().await;
    let resp = app.post_order(Some("k-create"), &order(42)).await;
    assert_eq!(resp.status(), 201);
    let created: Value = resp.json().await.unwrap();
    assert_eq!(created["total_cents"], 2 * 1250 + 499);
    assert_eq!(created["status"], "created");
    assert_eq!(created["items"].as_array().unwrap().len(), 2);
    let items: i64 = sqlx::query_scalar("SELECT count(*) FROM order_items WHERE order_id = $1")
        .bind(created["id"].as_i64().unwrap())
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(items, 2);

    let read: Value = app
        .get(&format!("/api/v1/orders/{}", created["id"]))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(read, created);
}

#[tokio::test]
async fn the_same_key_and_body_replays_and_a_different_body_conflicts() {
    let app = spawn_app().await;
    let first = app.post_order(Some("k-replay"), &order(7)).await;
    assert_eq!(first.status(), 201);
    let first_body = first.text().await.unwrap();

    // Same order, different formatting and key order: still a replay.
    let same = json!({"items": order(7)["items"], "user_id": 7});
    let again = app.post_order(Some("k-replay"), &same).await;
    assert_eq!(again.status(), 201);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.text().await.unwrap(), first_body);
    assert_eq!(orders_of(&app, 7).await, 1);

    let (status, body) = problem(app.post_order(Some("k-replay"), &order(8)).await).await;
    assert_eq!(status, 409);
    assert_eq!(body["type"], "/problems/idempotency-conflict");
    assert_eq!(orders_of(&app, 8).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_create_exactly_one_order() {
    let app = spawn_app().await;
    let body = order(99);
    let responses = join_all((0..20).map(|_| app.post_order(Some("k-race"), &body))).await;
    let mut ids = Vec::new();
    for resp in responses {
        assert_eq!(resp.status(), 201);
        let body: Value = resp.json().await.unwrap();
        ids.push(body["id"].as_i64().unwrap());
    }
    ids.dedup();
    assert_eq!(ids.len(), 1, "every duplicate got the same order");
    assert_eq!(orders_of(&app, 99).await, 1);
}

#[tokio::test]
async fn invalid_orders_are_400_problems_that_name_the_field() {
    let app = spawn_app().await;
    let (status, body) = problem(app.post_order(None, &order(1)).await).await;
    assert_eq!(
        (status, body["field"].as_str()),
        (400, Some("Idempotency-Key"))
    );

    let cases = [
        (json!({"user_id": 0, "items": order(1)["items"]}), "user_id"),
        (json!({"user_id": 1, "items": []}), "items"),
        (
            json!({"user_id": 1, "items": [{"sku": "A", "quantity": 0, "unit_price_cents": 1}]}),
            "items[0].quantity",
        ),
        (
            json!({"user_id": 1, "items": [{"sku": "A", "quantity": 1, "unit_price_cents": -1}]}),
            "items[0].unit_price_cents",
        ),
        (
            json!({"user_id": 1, "items": [{"sku": "", "quantity": 1, "unit_price_cents": 1}]}),
            "items[0].sku",
        ),
        (
            json!({"user_id": 1, "items": [{"sku": "A", "quantity": "two", "unit_price_cents": 1}]}),
            "items[0].quantity",
        ),
        (json!({"user_id": "x", "items": []}), "user_id"),
        (
            json!({"user_id": 1, "items": [], "coupon": "FREE"}),
            "coupon",
        ),
    ];
    for (body, field) in cases {
        let (status, problem) = problem(app.post_order(Some("k-bad"), &body).await).await;
        assert_eq!(status, 400, "{body}");
        assert!(
            problem["field"].as_str().unwrap().contains(field)
                || problem["detail"].as_str().unwrap().contains(field),
            "expected {field} in {problem} for {body}"
        );
    }
    let resp = app
        .client
        .post(app.url("/api/v1/orders"))
        .header("idempotency-key", "k")
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(problem(resp).await.0, 400);
    assert_eq!(
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders")
            .fetch_one(&app.db)
            .await
            .unwrap(),
        0
    );
}

#[tokio::test]
async fn oversized_bodies_are_413_and_unknown_orders_404() {
    let app = spawn_app().await;
    let huge = json!({"user_id": 1, "items": [{"sku": "A".repeat(100_000), "quantity": 1, "unit_price_cents": 1}]});
    let (status, body) = problem(app.post_order(Some("k-huge"), &huge).await).await;
    assert_eq!(status, 413);
    assert_eq!(
        body["detail"], "the request body must not exceed 65536 bytes",
        "the detail states the configured limit"
    );
    let (status, _) = problem(app.get("/api/v1/orders/123456").await).await;
    assert_eq!(status, 404);
    let (status, body) = problem(app.get("/api/v1/orders/nope").await).await;
    assert_eq!((status, body["field"].as_str()), (400, Some("id")));
}

#[tokio::test]
async fn an_order_whose_statement_outlives_the_deadline_is_a_504_not_a_500() {
    let app = spawn_app_with(|s| s.server.request_deadline = Duration::from_secs(10)).await;
    // Another client holds the table: the gateway's statement waits until the server cancels
    // it at its statement_timeout (the request's budget: the caller's 500 ms here, so the retry
    // below runs under the gateway's 10 s and a loaded machine cannot time it out too).
    let mut locker = app.db.begin().await.unwrap();
    sqlx::query("LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *locker)
        .await
        .unwrap();

    let slow = app
        .client
        .post(app.url("/api/v1/orders"))
        .header("idempotency-key", "k-slow")
        .header("x-request-budget-ms", "500")
        .json(&order(5))
        .send()
        .await
        .expect("request");
    let (status, body) = problem(slow).await;
    locker.rollback().await.unwrap();

    assert_eq!(status, 504, "{body}");
    assert_eq!(body["type"], "/problems/gateway-timeout");
    assert_eq!(orders_of(&app, 5).await, 0, "nothing was written");
    assert_eq!(
        app.post_order(Some("k-slow"), &order(5)).await.status(),
        201
    );
}

/// Posts `body` as raw bytes with a JSON content type.
async fn post_raw(app: &TestApp, key: &str, content_type: &str, body: &str) -> reqwest::Response {
    app.client
        .post(app.url("/api/v1/orders"))
        .header("idempotency-key", key)
        .header("content-type", content_type)
        .body(body.to_owned())
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn order_bodies_are_one_json_object_and_errors_say_where() {
    let app = spawn_app().await;
    let valid = order(3).to_string();
    let cases = [
        // Valid JSON followed by garbage is not one document.
        (
            format!("{valid} garbage"),
            "body",
            Some(format!(
                "body: body is not valid JSON at line 1 column {}",
                valid.len() + 2
            )),
        ),
        (format!("{valid}{valid}"), "body", None),
        // An array of the fields in order is not an order, at the top or inside.
        (r#"[1,[["a",1,1]]]"#.to_owned(), "body", None),
        (
            r#"{"user_id":1,"items":[["a",1,1]]}"#.to_owned(),
            "items[0]",
            None,
        ),
        // A missing field is named.
        (
            json!({"items": order(3)["items"]}).to_string(),
            "user_id",
            Some("user_id: is required".into()),
        ),
        (json!({"user_id": 3}).to_string(), "items", None),
        (
            json!({"user_id": 3, "items": [{"sku": "A", "quantity": 1}]}).to_string(),
            "items[0].unit_price_cents",
            None,
        ),
        // Truncated JSON says where it ends.
        (
            "{\"user_id\": 3,\n \"items\": [".to_owned(),
            "body",
            Some("body: body is not valid JSON at line 2 column 11".into()),
        ),
    ];
    for (body, field, detail) in cases {
        let (status, problem) =
            problem(post_raw(&app, "k-strict", "application/json", &body).await).await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(problem["field"], field, "{body}: {problem}");
        if let Some(detail) = detail {
            assert_eq!(problem["detail"], detail.as_str(), "{body}");
        }
    }
    assert_eq!(orders_of(&app, 3).await, 0);
    assert_eq!(orders_of(&app, 1).await, 0);
}

#[tokio::test]
async fn content_types_must_be_json_and_the_suffix_is_case_insensitive() {
    let app = spawn_app().await;
    let body = order(4).to_string();
    for bad in ["+json", "text/plain", "application/+json"] {
        let (status, problem) = problem(post_raw(&app, "k-ct", bad, &body).await).await;
        assert_eq!(status, 415, "{bad}: {problem}");
    }
    let resp = post_raw(
        &app,
        "k-ct",
        "Application/Vnd.Order+JSON; charset=utf-8",
        &body,
    )
    .await;
    assert_eq!(resp.status(), 201);
    assert_eq!(orders_of(&app, 4).await, 1);
}

#[tokio::test]
async fn two_idempotency_keys_are_refused_and_whitespace_around_one_is_not_part_of_it() {
    let app = spawn_app().await;
    let resp = app
        .client
        .post(app.url("/api/v1/orders"))
        .header("idempotency-key", "k-one")
        .header("idempotency-key", "k-two")
        .json(&order(6))
        .send()
        .await
        .unwrap();
    let (status, problem) = problem(resp).await;
    assert_eq!(
        (status, problem["field"].as_str()),
        (400, Some("Idempotency-Key"))
    );
    assert!(
        problem["detail"].as_str().unwrap().contains("exactly once"),
        "{problem}"
    );
    assert_eq!(orders_of(&app, 6).await, 0);

    // Whitespace around the value is HTTP's optional whitespace, not part of the key.
    let padded = app
        .client
        .post(app.url("/api/v1/orders"))
        .header("idempotency-key", "   k-padded \t")
        .json(&order(6))
        .send()
        .await
        .unwrap();
    assert_eq!(padded.status(), 201);
    let replay = app.post_order(Some("k-padded"), &order(6)).await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(orders_of(&app, 6).await, 1);
}

#[tokio::test]
async fn a_database_that_refuses_the_gateways_role_makes_orders_503_and_readyz_keeps_it_quiet() {
    let app = spawn_app_with(|s| {
        let mut url = reqwest::Url::parse(s.database.url.expose()).unwrap();
        url.set_username("tributary_no_such_role").unwrap();
        s.database.url = tributary::config::Secret::new(url.to_string());
        s.database.run_migrations = false;
    })
    .await;

    let resp = app.get("/api/v1/orders/1").await;
    assert!(
        resp.headers().contains_key("retry-after"),
        "{:?}",
        resp.headers()
    );
    let (status, body) = problem(resp).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["type"], "/problems/unavailable");
    let (status, _) = problem(app.post_order(Some("k-role"), &order(1)).await).await;
    assert_eq!(status, 503);

    // Readiness says the database is unavailable, not what the server said about the role.
    let resp = app.get("/readyz").await;
    let text = resp.text().await.unwrap();
    let ready: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(ready["database"], "unavailable", "{text}");
    assert!(!text.contains("tributary_no_such_role"), "{text}");
    assert!(!text.contains("role"), "{text}");
}

#[tokio::test]
async fn whole_numbers_written_with_a_zero_fraction_are_accepted_and_fractions_are_not() {
    let app = spawn_app().await;
    // JSON Schema's `integer` (openapi.json) includes 2.0; encoders that keep numbers as doubles
    // write whole numbers so.
    let whole = json!({"user_id": 7.0, "items": [{"sku": "SKU-1", "quantity": 2.0, "unit_price_cents": 1.25e3}]});

    let resp = app.post_order(Some("whole-1"), &whole).await;

    assert_eq!(resp.status(), 201);
    let created: Value = resp.json().await.unwrap();
    assert_eq!(created["user_id"], 7);
    assert_eq!(created["items"][0]["quantity"], 2);
    assert_eq!(created["total_cents"], 2500);

    let fraction = json!({"user_id": 7, "items": [{"sku": "SKU-1", "quantity": 2.5, "unit_price_cents": 1250}]});
    let (status, body) = problem(app.post_order(Some("whole-2"), &fraction).await).await;
    assert_eq!(status, 400);
    assert_eq!(body["field"], "items[0].quantity", "{body}");
}
