//! The per-downstream cache, from outside: shared and per-user entries, one call for many
//! concurrent misses, `Cache-Control`, stale answers standing in for a failing service, a
//! waiter that leaves without cancelling the call, the memory bound and invalidation. The
//! simulator's call counters are the proof of how many calls were made; outcomes are asserted,
//! never latencies.

use std::time::Duration;

use futures::future::join_all;
use serde_json::Value;
use tributary::{config::CacheKey, domain::Service};
use tributary_sim::Mode;

use crate::helpers::{TestApp, cache, degraded, eventually, problem, spawn_app_with, stale};

const HOUR: Duration = Duration::from_secs(3600);

async fn counter(app: &TestApp, name: &str, service: Service) -> f64 {
    metric(app, name, &[("downstream", service.as_str())]).await
}

async fn metric(app: &TestApp, name: &str, labels: &[(&str, &str)]) -> f64 {
    app.metric(name, labels).await
}

/// Dashboards for `user_id` every 20 ms until one satisfies `done` or `within` passes: the
/// last body, and whether it did.
async fn dashboard_until(
    app: &TestApp,
    user_id: i64,
    within: Duration,
    done: impl Fn(&Value) -> bool,
) -> (bool, Value) {
    let give_up = tokio::time::Instant::now() + within;
    loop {
        let (_, body) = app.dashboard(user_id).await;
        if done(&body) || tokio::time::Instant::now() >= give_up {
            return (done(&body), body);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_hundred_concurrent_dashboards_of_different_users_make_one_shared_promotions_call() {
    // Generous budgets and no admission limit: this test counts calls, it does not measure,
    // and 500 dashboards at once in a debug build beside the rest of the suite take a while.
    let app = spawn_app_with(|s| {
        s.admission.enabled = false;
        s.server.request_deadline = Duration::from_secs(45);
        for d in s.downstreams.iter_mut() {
            d.timeout = Duration::from_secs(30);
        }
        s.database.acquire_timeout = Duration::from_secs(10);
        s.http_client.connect_timeout = Duration::from_secs(5);
        s.downstreams.promotions.cache = Some(cache(CacheKey::Shared, HOUR));
    })
    .await;
    // Slow enough that the requests arrive while the one call is in flight.
    app.set_service(Service::Promotions, |b| {
        b.latency = Duration::from_millis(300)
    });
    let before = (
        counter(&app, "tributary_cache_coalesced_total", Service::Promotions).await,
        counter(&app, "tributary_cache_hits_total", Service::Promotions).await,
    );

    let n = 500;
    let bodies = join_all((1..=n).map(|user| {
        let request = app
            .client
            .get(app.url(&format!("/api/v1/dashboard/{user}")))
            .timeout(Duration::from_secs(60))
            .send();
        async move {
            let resp = request.await.expect("request");
            let status = resp.status().as_u16();
            (status, resp.json::<Value>().await.unwrap_or(Value::Null))
        }
    }))
    .await;

    let first = bodies[0].1["promotions"].clone();
    assert!(first.is_object(), "{first}");
    for (i, (status, body)) in bodies.iter().enumerate() {
        assert_eq!(*status, 200, "{body}");
        assert_eq!(body["user_id"], i as i64 + 1);
        assert_eq!(
            body["promotions"], first,
            "every user shares the one answer"
        );
        assert!(stale(body).is_empty() && !degraded(body).contains(&"promotions".into()));
    }
    assert_eq!(app.calls(Service::Promotions), 1, "one call for all");
    assert_eq!(
        app.calls(Service::Carts),
        n as u64,
        "the uncached parts are still called per request"
    );
    let after = (
        counter(&app, "tributary_cache_coalesced_total", Service::Promotions).await,
        counter(&app, "tributary_cache_hits_total", Service::Promotions).await,
    );
    assert!(
        (after.0 - before.0) + (after.1 - before.1) >= (n - 1) as f64,
        "all but one request waited for the call or found its answer: {before:?} -> {after:?}"
    );
}

#[tokio::test]
async fn per_user_entries_are_never_served_to_another_user() {
    let app = spawn_app_with(|s| {
        s.downstreams.carts.cache = Some(cache(CacheKey::PerUser, HOUR));
    })
    .await;

    let first = app.get("/api/v1/dashboard/1").await;
    let timing = first.headers()["server-timing"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(timing.contains("carts;desc=miss;dur="), "{timing}");
    let again = app.get("/api/v1/dashboard/1").await;
    let timing = again.headers()["server-timing"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(timing.contains("carts;desc=hit;dur="), "{timing}");
    assert!(
        timing.contains("promotions;dur="),
        "an uncached part has no desc: {timing}"
    );
    let again: Value = again.json().await.unwrap();
    assert_eq!(again["cart"]["user_id"], 1);
    assert_eq!(
        app.calls(Service::Carts),
        1,
        "user 1's second dashboard is a hit"
    );

    let (status, other) = app.dashboard(2).await;
    assert_eq!(status, 200);
    assert_eq!(other["cart"]["user_id"], 2, "user 2 gets its own cart");
    assert_eq!(app.calls(Service::Carts), 2);
}

#[tokio::test]
async fn a_no_store_answer_is_never_stored() {
    let app = spawn_app_with(|s| {
        s.downstreams.promotions.cache = Some(cache(CacheKey::Shared, HOUR));
        s.downstreams.carts.cache = Some(cache(CacheKey::PerUser, HOUR));
    })
    .await;
    for service in [Service::Promotions, Service::Carts] {
        app.set_service(service, |b| b.cache_control = Some("no-store".into()));
    }
    for _ in 0..3 {
        let (status, body) = app.dashboard(1).await;
        assert_eq!(status, 200);
        assert!(body["promotions"].is_object() && body["cart"].is_object());
    }
    assert_eq!(app.calls(Service::Promotions), 3);
    assert_eq!(app.calls(Service::Carts), 3);
}

#[tokio::test]
async fn a_private_answer_is_kept_per_user_but_neither_stored_nor_handed_on_in_a_shared_cache() {
    let app = spawn_app_with(|s| {
        s.downstreams.promotions.cache = Some(cache(CacheKey::Shared, HOUR));
        s.downstreams.carts.cache = Some(cache(CacheKey::PerUser, HOUR));
    })
    .await;
    for service in [Service::Promotions, Service::Carts] {
        app.set_service(service, |b| b.cache_control = Some("private".into()));
    }
    app.dashboard(1).await;
    app.dashboard(1).await;
    assert_eq!(app.calls(Service::Carts), 1, "per user, private is stored");
    assert_eq!(app.calls(Service::Promotions), 2, "shared, private is not");

    // User 2 waits for user 1's call in flight; the answer is user 1's own, so user 2's
    // request makes its own call instead of receiving it.
    app.set_service(Service::Promotions, |b| {
        b.latency = Duration::from_millis(400)
    });
    let one = tokio::spawn({
        let url = app.url("/api/v1/dashboard/1");
        let client = app.client.clone();
        async move {
            let body: Value = client.get(url).send().await.unwrap().json().await.unwrap();
            body
        }
    });
    assert!(
        eventually(Duration::from_secs(5), || async {
            app.sim.sim.stats(Service::Promotions).in_flight == 1
        })
        .await
    );
    let (status, two) = app.dashboard(2).await;
    assert_eq!(status, 200);
    assert_eq!(two["promotions"]["user_id"], 2, "{two}");
    assert_eq!(one.await.unwrap()["promotions"]["user_id"], 1);
    assert_eq!(app.calls(Service::Promotions), 4);
}

#[tokio::test]
async fn max_age_shortens_the_ttl() {
    let app = spawn_app_with(|s| {
        s.downstreams.promotions.cache = Some(cache(CacheKey::Shared, HOUR));
    })
    .await;
    app.set_service(Service::Promotions, |b| {
        b.cache_control = Some("public, max-age=1".into())
    });
    app.dashboard(1).await;
    app.dashboard(2).await;
    assert_eq!(app.calls(Service::Promotions), 1, "fresh for a second");
    // With an hour's ttl only the service's max-age can make the entry stale.
    assert!(
        eventually(Duration::from_secs(10), || async {
            app.dashboard(3).await;
            app.calls(Service::Promotions) == 2
        })
        .await,
        "the entry was never refreshed"
    );
}

#[tokio::test]
async fn a_failing_service_is_served_stale_until_stale_if_error_has_passed_then_degrades() {
    let app = spawn_app_with(|s| {
        let mut policy = cache(CacheKey::Shared, Duration::from_millis(200));
        policy.stale_if_error = Duration::from_secs(3);
        s.downstreams.promotions.cache = Some(policy);
    })
    .await;
    let (_, warm) = app.dashboard(1).await;
    assert!(warm["promotions"].is_object() && stale(&warm).is_empty());
    let before = counter(
        &app,
        "tributary_cache_stale_served_total",
        Service::Promotions,
    )
    .await;

    app.set_service(Service::Promotions, |b| b.error_rate = 1.0);
    // Past the ttl the service is called again, fails, and the old answer stands in.
    let (was_stale, served) = dashboard_until(&app, 2, Duration::from_secs(3), |body| {
        stale(body) == ["promotions"]
    })
    .await;
    assert!(was_stale, "never served stale: {served}");
    assert_eq!(served["promotions"], warm["promotions"]);
    assert!(
        degraded(&served).is_empty(),
        "stale is not degraded: {served}"
    );
    assert!(
        counter(
            &app,
            "tributary_cache_stale_served_total",
            Service::Promotions
        )
        .await
            > before
    );

    // Once stale_if_error has passed too, the part is null and degraded like any failure.
    let (gone, last) = dashboard_until(&app, 3, Duration::from_secs(10), |body| {
        body["promotions"].is_null() && degraded(body) == ["promotions"] && stale(body).is_empty()
    })
    .await;
    assert!(gone, "still served after stale_if_error: {last}");
}

#[tokio::test]
async fn a_stale_answer_stands_in_for_a_hanging_service_within_the_callers_budget() {
    let app = spawn_app_with(|s| {
        let mut policy = cache(CacheKey::Shared, Duration::from_millis(100));
        policy.stale_if_error = Duration::from_secs(60);
        s.downstreams.promotions.cache = Some(policy);
    })
    .await;
    let (_, warm) = app.dashboard(1).await;
    app.hang(Service::Promotions);
    tokio::time::sleep(Duration::from_millis(150)).await;

    // The refresh hangs; the request's own deadline ends its wait and the stale entry answers.
    let (status, body) = app.dashboard_within(2, 300).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(stale(&body), ["promotions"], "{body}");
    assert_eq!(body["promotions"], warm["promotions"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_budget_runs_out_leaves_without_cancelling_the_call_for_the_others() {
    let app = spawn_app_with(|s| {
        let promotions = &mut s.downstreams.promotions;
        promotions.timeout = Duration::from_secs(5);
        promotions.cache = Some(cache(CacheKey::Shared, HOUR));
    })
    .await;
    app.set_service(Service::Promotions, |b| {
        b.latency = Duration::from_millis(800)
    });

    // The impatient request starts the call, then its 150 ms budget runs out.
    let impatient = tokio::spawn({
        let url = app.url("/api/v1/dashboard/1");
        let client = app.client.clone();
        async move {
            let resp = client
                .get(url)
                .header("x-request-budget-ms", "150")
                .send()
                .await
                .unwrap();
            (resp.status().as_u16(), resp.json::<Value>().await.unwrap())
        }
    });
    assert!(
        eventually(Duration::from_secs(5), || async {
            app.sim.sim.stats(Service::Promotions).in_flight == 1
        })
        .await
    );
    let (status, left) = impatient.await.unwrap();
    assert_eq!(status, 200, "{left}");
    assert!(left["promotions"].is_null(), "{left}");
    assert!(degraded(&left).contains(&"promotions".to_owned()), "{left}");

    // The call it started goes on, and a patient request gets its answer.
    let (status, patient) = app.dashboard(2).await;
    assert_eq!(status, 200);
    assert!(patient["promotions"].is_object(), "{patient}");
    let stats = app.sim.sim.stats(Service::Promotions);
    assert_eq!(stats.requests, 1, "the call was made once");
    assert_eq!(stats.cancelled, 0, "and never cancelled");
}

#[tokio::test]
async fn the_cache_stays_within_max_bytes() {
    let max_bytes = 32 * 1024;
    let app = spawn_app_with(|s| {
        let mut policy = cache(CacheKey::PerUser, HOUR);
        policy.max_bytes = std::num::NonZeroU64::new(max_bytes).unwrap();
        s.downstreams.carts.cache = Some(policy);
    })
    .await;
    app.set_service(Service::Carts, |b| b.body_bytes = 2048);
    let size_evictions = || {
        metric(
            &app,
            "tributary_cache_evictions_total",
            &[("downstream", "carts"), ("cause", "size")],
        )
    };
    let before = size_evictions().await;

    // Sixty users' carts, about 120 KiB of bodies: far past the bound.
    for user in 1..=60 {
        let (status, body) = app.dashboard(user).await;
        assert_eq!(status, 200);
        assert!(body["cart"].is_object());
    }

    let cache = app
        .state
        .downstreams
        .cache(Service::Carts)
        .expect("a cache");
    cache.run_pending_tasks().await;
    assert!(
        cache.weighted_size() <= max_bytes,
        "{} bytes held",
        cache.weighted_size()
    );
    assert!(cache.entry_count() > 0 && cache.entry_count() < 60);
    assert!(size_evictions().await > before, "the evictions are counted");
}

#[tokio::test]
async fn admin_invalidation_drops_one_downstreams_entries_or_one_key() {
    let app = spawn_app_with(|s| {
        s.server.admin = true;
        s.downstreams.promotions.cache = Some(cache(CacheKey::Shared, HOUR));
        s.downstreams.carts.cache = Some(cache(CacheKey::PerUser, HOUR));
    })
    .await;
    app.dashboard(1).await;
    app.dashboard(2).await;
    assert_eq!(app.calls(Service::Promotions), 1);
    assert_eq!(app.calls(Service::Carts), 2);

    assert_eq!(
        app.ops_delete("/admin/cache/promotions").await.status(),
        204
    );
    assert_eq!(app.ops_delete("/admin/cache/carts/1").await.status(), 204);
    app.dashboard(1).await;
    app.dashboard(2).await;
    assert_eq!(
        app.calls(Service::Promotions),
        2,
        "the shared entry was dropped"
    );
    assert_eq!(
        app.calls(Service::Carts),
        3,
        "user 1's cart was dropped, user 2's kept"
    );
    assert_eq!(
        app.ops_delete("/admin/cache/promotions/shared")
            .await
            .status(),
        204
    );
    app.dashboard(1).await;
    assert_eq!(app.calls(Service::Promotions), 3);

    let (status, body) = problem(app.ops_delete("/admin/cache/payments").await).await;
    assert_eq!(status, 404);
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .contains("not a downstream"),
        "{body}"
    );
    let (status, body) = problem(app.ops_delete("/admin/cache/users").await).await;
    assert_eq!(status, 404);
    assert_eq!(body["detail"], "users has no cache");
    let (status, body) = problem(app.ops_delete("/admin/cache/carts/shared").await).await;
    assert_eq!(status, 400);
    assert_eq!(body["field"], "key");
}

#[tokio::test]
async fn the_admin_endpoints_are_not_there_unless_enabled() {
    let app = spawn_app_with(|s| {
        s.downstreams.promotions.cache = Some(cache(CacheKey::Shared, HOUR));
    })
    .await;
    app.dashboard(1).await;
    let (status, _) = problem(app.ops_delete("/admin/cache/promotions").await).await;
    assert_eq!(status, 404);
    app.dashboard(1).await;
    assert_eq!(app.calls(Service::Promotions), 1, "nothing was dropped");
    assert_eq!(
        app.client
            .delete(app.url("/admin/cache/promotions"))
            .send()
            .await
            .unwrap()
            .status(),
        404,
        "never on the API's port"
    );
}

#[tokio::test]
async fn errors_are_not_cached() {
    let app = spawn_app_with(|s| {
        s.downstreams.promotions.cache = Some(cache(CacheKey::Shared, HOUR));
    })
    .await;
    app.set_service(Service::Promotions, |b| b.mode = Mode::InvalidJson);
    let (_, body) = app.dashboard(1).await;
    assert_eq!(degraded(&body), ["promotions"]);
    app.set_service(Service::Promotions, |b| b.mode = Mode::Normal);
    let (_, body) = app.dashboard(1).await;
    assert!(body["promotions"].is_object(), "{body}");
    assert_eq!(app.calls(Service::Promotions), 2);
}
