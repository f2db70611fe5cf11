//! The database: an outage, a flapping database under retried orders, a saturated pool, and a
//! network that goes silent mid-statement.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use futures::future::join_all;
use serde_json::Value;
use tributary::config::RouteGroup;

use super::{postgres_addr, serial, spawn_app_behind};
use crate::{
    chaos::ChaosProxy,
    helpers::{TestApp, degraded, eventually, nz32, order, problem, spawn_app_with},
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_keeps_readiness_on_and_fails_recent_orders_fast_until_it_comes_back() {
    let _serial = serial().await;
    let proxy = ChaosProxy::start(postgres_addr()).await;
    let app = spawn_app_behind(&proxy, |s| {
        s.database.acquire_timeout = Duration::from_millis(500);
    })
    .await;
    app.seed(1, 3).await;
    assert_eq!(app.get("/readyz").await.status(), 200);
    let (_, body) = app.dashboard(1).await;
    assert_eq!(body["recent_orders"].as_array().map(Vec::len), Some(3));

    proxy.cut();

    // The replica still serves (degraded): readiness stays on and says what is down.
    let (_, body) = app.dashboard(1).await;
    assert!(body["recent_orders"].is_null(), "{body}");
    assert!(
        eventually(Duration::from_secs(10), || async {
            let ready: Value = app.get("/readyz").await.json().await.unwrap();
            ready["database"] == "unavailable"
        })
        .await,
        "readiness never noticed the outage"
    );
    let resp = app.get("/readyz").await;
    assert_eq!(resp.status(), 200);
    let ready: Value = resp.json().await.unwrap();
    assert_eq!(ready["status"], "ready", "{ready}");
    // While the database is known down, its part is not tried at all: it fails at once
    // (counted as circuit_open), instead of each dashboard waiting for the pool.
    let not_tried = || {
        app.metric(
            "tributary_fanout_degraded_total",
            &[("part", "recent_orders"), ("reason", "circuit_open")],
        )
    };
    let before = not_tried().await;
    let (status, body) = app.dashboard(1).await;
    assert_eq!(status, 200, "{body}");
    assert!(body["recent_orders"].is_null(), "{body}");
    assert_eq!(degraded(&body), ["recent_orders"]);
    assert_eq!(body["profile"]["service"], "users");
    assert!(not_tried().await > before, "the database part was tried");

    proxy.restore();

    // Same gateway, same pool: it reconnects on its own.
    assert!(
        eventually(Duration::from_secs(10), || async {
            let ready: Value = app.get("/readyz").await.json().await.unwrap();
            ready["database"] == "ok"
        })
        .await,
        "the database's state did not come back"
    );
    let (status, body) = app.dashboard(1).await;
    assert_eq!(status, 200);
    assert_eq!(degraded(&body), Vec::<String>::new());
    assert_eq!(body["recent_orders"].as_array().map(Vec::len), Some(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_after_the_database_dropped_every_pooled_connection_succeed_on_fresh_ones() {
    let _serial = serial().await;
    let app = spawn_app_with(|s| {
        s.database.max_connections = nz32(4);
    })
    .await;
    // Arrange: the pool holds several connections (concurrent orders each take one), then the
    // server ends them all, as a restart does, and nothing has used one since.
    let keys: Vec<(String, Value)> = (1..=4).map(|i| (format!("warm-{i}"), order(i))).collect();
    let warm = join_all(
        keys.iter()
            .map(|(key, body)| app.post_order(Some(key), body)),
    )
    .await;
    for resp in warm {
        assert_eq!(resp.status(), 201);
    }
    let created = app.post_order(Some("warm-read"), &order(9)).await;
    let id = created.json::<Value>().await.unwrap()["id"].clone();
    let pooled = terminate_gateway_connections(&app).await;
    assert!(pooled >= 1, "the pool held no connection");

    // Act and assert: more orders than there were dead connections, each created.
    for i in 0..=pooled {
        let (key, body) = (format!("after-{i}"), order(20 + i));
        let resp = app.post_order(Some(&key), &body).await;
        let status = resp.status();
        assert_eq!(status, 201, "order {i}: {}", resp.text().await.unwrap());
    }
    // And a read, after the same again.
    terminate_gateway_connections(&app).await;
    let resp = app.get(&format!("/api/v1/orders/{id}")).await;
    assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_while_the_database_is_down_are_503_with_retry_after_never_500() {
    let _serial = serial().await;
    let proxy = ChaosProxy::start(postgres_addr()).await;
    let app = spawn_app_behind(&proxy, |s| {
        s.database.acquire_timeout = Duration::from_millis(300);
    })
    .await;
    let created = app.post_order(Some("before"), &order(1)).await;
    assert_eq!(created.status(), 201);
    let id = created.json::<Value>().await.unwrap()["id"].clone();

    proxy.cut();

    for (what, resp) in [
        ("create", app.post_order(Some("during"), &order(2)).await),
        ("read", app.get(&format!("/api/v1/orders/{id}")).await),
        (
            "create again",
            app.post_order(Some("during"), &order(2)).await,
        ),
    ] {
        assert!(
            resp.headers().contains_key("retry-after"),
            "{what}: {:?}",
            resp.headers()
        );
        let (status, body) = problem(resp).await;
        assert_eq!(status, 503, "{what}: {body}");
        assert_eq!(body["type"], "/problems/unavailable", "{what}");
    }
    proxy.restore();
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
    let (_, body) = app.dashboard(1).await;
    assert_eq!(body["recent_orders"].as_array().map(Vec::len), Some(3));

    // Arrange: another client holds a lock the recent-orders query needs; the first request
    // takes the gateway's one connection and its query waits behind the lock.
    let mut locker = app.db.begin().await.unwrap();
    sqlx::query("LOCK TABLE orders IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *locker)
        .await
        .unwrap();
    let holder = tokio::spawn(app.client.get(app.url("/api/v1/dashboard/1")).send());
    assert!(
        eventually(Duration::from_secs(5), || async {
            gateway_queries(&app, "Lock").await == 1
        })
        .await,
        "the gateway's query never waited on the lock"
    );
    let timeouts_before = app
        .metric("tributary_db_pool_acquire_timeouts_total", &[])
        .await;
    let shed_before = app
        .metric(
            "tributary_fanout_degraded_total",
            &[("part", "recent_orders"), ("reason", "shed")],
        )
        .await;

    // Act: more requests, with callers' budgets (x-request-budget-ms) that end before the
    // holder's; each waits for the connection only as long as its own budget allows.
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

    // Assert: every one degraded within its budget, and no statement is left on the server.
    for (status, body) in waiters.iter().chain([&holder]) {
        assert_eq!(*status, 200, "{body}");
        assert!(body["recent_orders"].is_null(), "{body}");
        assert_eq!(degraded(body), ["recent_orders"]);
        assert_eq!(body["profile"]["service"], "users");
    }
    let timeouts_after = app
        .metric("tributary_db_pool_acquire_timeouts_total", &[])
        .await;
    assert!(
        timeouts_after >= timeouts_before + 5.0,
        "each waiter gave up on the pool: {timeouts_before} -> {timeouts_after}"
    );
    let shed_after = app
        .metric(
            "tributary_fanout_degraded_total",
            &[("part", "recent_orders"), ("reason", "shed")],
        )
        .await;
    assert!(shed_after >= shed_before + 5.0);
    // The holder's request is over and the lock is still held, yet its query is no longer
    // running: statement_timeout (its remaining budget) made the server cancel it.
    assert!(
        eventually(Duration::from_secs(5), || async {
            gateway_queries(&app, "any").await == 0
        })
        .await,
        "a gateway query is still running after its request ended"
    );

    locker.rollback().await.unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async {
            let (_, body) = app.dashboard(1).await;
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
    let waiting = eventually(Duration::from_secs(5), || async {
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
        let waiting = eventually(Duration::from_secs(5), || async {
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

/// Ends every connection of this test's gateway to its own database from the server's side, as
/// a restart does, and waits until they are gone; returns how many there were.
async fn terminate_gateway_connections(app: &TestApp) -> i64 {
    let ended: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = $1 AND application_name = 'tributary'",
    )
    .bind(&app.db_name)
    .fetch_all(&app.db)
    .await
    .unwrap();
    let gone = eventually(Duration::from_secs(5), || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = $1 AND application_name = 'tributary'",
        )
        .bind(&app.db_name)
        .fetch_one(&app.db)
        .await
        .unwrap()
            == 0
    })
    .await;
    assert!(gone, "the server kept the gateway's connections");
    ended.len() as i64
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

    // Arrange: the database is down when the clients start, then flaps: each outage lasts
    // until some client has been refused by it (so every cut is felt, however slow the
    // machine), then the database is back for a moment before the next cut.
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
                let felt = eventually(Duration::from_secs(10), || async {
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
    // Act: sixteen clients, each retrying its order until the answer is definite.
    let clients = 16;
    let settled = join_all(
        (1..=clients).map(|i| create_until_definite(&app, format!("flap-{i}"), i, &failures)),
    )
    .await;
    done.store(true, Ordering::Relaxed);
    let cuts = flapper.await.unwrap();

    // Assert: one key, one order, for every client; nothing half-written.
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
