//! The task-local request context under concurrency: no request ever sees another's.

use std::collections::HashMap;

use axum::{Router, routing::get};
use futures::future::join_all;
use serde_json::Value;

use std::time::Duration;

use tributary::config::TransportKind;

use crate::helpers::{problem, spawn_app_full, spawn_app_with};

/// The request layers are tower services that call the layers beneath them when they are
/// called, not when their futures are first polled: the deadline layer reads the request's
/// deadline then, so the context layer must make the context current for that call as well as
/// for the polls. A route that never answers is the deadline layer's alone to end; outside the
/// request context it would read the 30 s bound for code outside a request, and the test
/// client (10 s) would give up first.
#[tokio::test]
async fn a_route_that_ignores_the_deadline_is_a_504_at_the_requests_deadline() {
    let app = spawn_app_full(
        |s| s.server.request_deadline = Duration::from_millis(300),
        Router::new().route("/test/never", get(std::future::pending::<&'static str>)),
        Default::default(),
    )
    .await;
    let response = app
        .client
        .get(app.url("/test/never"))
        .header("x-request-id", "never-1")
        .send()
        .await
        .expect("an answer before the test client's 10 s timeout");
    assert_eq!(response.headers()["x-request-id"], "never-1");
    let (status, body) = problem(response).await;
    assert_eq!(status, 504, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_never_see_each_others_context() {
    requests_never_see_each_others_context(TransportKind::Reqwest).await;
}

/// The same through hyper-util's client without reqwest's layers: every header a call sends is
/// built by the gateway itself there.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_never_see_each_others_context_through_the_hyper_transport() {
    requests_never_see_each_others_context(TransportKind::Hyper).await;
}

async fn requests_never_see_each_others_context(transport: TransportKind) {
    // Generous budgets: this test is about isolation, and a debug build on a busy CI machine
    // must not turn it into a latency test.
    let app = spawn_app_with(|s| {
        s.http_client.transport = transport;
        // Isolation, not admission: the two variants of this test run at once, 400 requests on
        // one database pool, and on a busy machine the adaptive limit (which follows the pool's
        // queue) would rightly shed some of them.
        s.admission.enabled = false;
        s.server.request_deadline = Duration::from_secs(20);
        for d in s.downstreams.iter_mut() {
            d.timeout = Duration::from_secs(10);
        }
        s.database.acquire_timeout = Duration::from_secs(10);
        // A thousand simultaneous connects to one listener can overflow its accept queue on a
        // busy machine; a dropped SYN is retried after 1 s, past the default connect timeout.
        s.http_client.connect_timeout = Duration::from_secs(5);
    })
    .await;
    let n = 200;
    let responses = join_all((1..=n).map(|user| {
        let req = app
            .client
            .get(app.url(&format!("/api/v1/dashboard/{user}")))
            .header("x-request-id", format!("iso-{user}"))
            .header(
                "traceparent",
                format!("00-{:032x}-00f067aa0ba902b7-01", user),
            )
            .header("tracestate", format!("vendor=u{user}"))
            .send();
        async move {
            let resp = req.await.unwrap();
            let echoed = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
            let body: Value = resp.json().await.unwrap();
            (user, echoed, body)
        }
    }))
    .await;
    for (user, echoed, body) in responses {
        assert_eq!(echoed, format!("iso-{user}"));
        if body["user_id"] != user {
            let causes: Vec<_> = crate::helpers::log_lines()
                .into_iter()
                .filter(|l| l["level"] == "WARN" || l["level"] == "ERROR")
                .map(|l| l.to_string())
                .collect();
            panic!("request {user} failed: {body}\nwarnings: {causes:#?}");
        }
        assert_eq!(body["profile"]["user_id"], user);
    }

    // Inside the downstream calls: every call carried its own request's id and trace id.
    let journal = app.sim.sim.journal();
    assert_eq!(journal.len(), 5 * n as usize);
    let mut per_request: HashMap<String, usize> = HashMap::new();
    for seen in &journal {
        let id = seen
            .request_id
            .clone()
            .expect("x-request-id on every downstream call");
        assert_eq!(id, format!("iso-{}", seen.user_id), "{seen:?}");
        let tp = seen
            .traceparent
            .as_deref()
            .expect("traceparent on every call");
        assert_eq!(
            &tp[3..35],
            format!("{:032x}", seen.user_id),
            "trace id of another request: {seen:?}"
        );
        assert_eq!(
            seen.tracestate,
            Some(format!("vendor=u{}", seen.user_id)),
            "tracestate forwarded"
        );
        *per_request.entry(id).or_default() += 1;
    }
    assert_eq!(per_request.len(), n as usize);
    assert!(per_request.values().all(|c| *c == 5));
}

#[tokio::test]
async fn a_callers_tracestate_is_forwarded_capped_at_32_members_and_dropped_when_huge() {
    let app = crate::helpers::spawn_app().await;
    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01";
    let members: Vec<String> = (0..40).map(|i| format!("v{i}=x")).collect();
    let cases = [
        (members.join(","), Some(members[..32].join(","))),
        (format!("big={}", "x".repeat(15_000)), None),
    ];
    for (tracestate, forwarded) in cases {
        let before = app.sim.sim.journal().len();
        let resp = app
            .client
            .get(app.url("/api/v1/dashboard/1"))
            .header("traceparent", traceparent)
            .header("tracestate", &tracestate)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let journal = app.sim.sim.journal();
        assert_eq!(journal.len() - before, 5);
        for seen in &journal[before..] {
            assert_eq!(seen.tracestate, forwarded, "{:?}", seen.service);
        }
    }
}

#[tokio::test]
async fn every_call_names_the_gateway_asks_for_json_and_carries_the_base_urls_credentials_on_either_transport()
 {
    for transport in [TransportKind::Reqwest, TransportKind::Hyper] {
        let app = spawn_app_with(|s| {
            s.http_client.transport = transport;
            let mut url = s.downstreams.carts.base_url.url().clone();
            url.set_username("svc@corp").unwrap();
            url.set_password(Some("p:ss")).unwrap();
            s.downstreams.carts.base_url = url.as_str().parse().unwrap();
        })
        .await;
        let (status, body) = app.dashboard(1).await;
        assert_eq!(status, 200, "{transport:?}: {body}");
        let journal = app.sim.sim.journal();
        assert_eq!(journal.len(), 5, "{transport:?}");
        for seen in &journal {
            assert_eq!(
                seen.user_agent.as_deref(),
                Some(concat!("tributary/", env!("CARGO_PKG_VERSION"))),
                "{transport:?} {seen:?}"
            );
            let expected = (seen.service == tributary::domain::Service::Carts)
                // base64("svc@corp:p:ss"): the userinfo percent-decoded, as RFC 7617 wants it.
                .then_some("Basic c3ZjQGNvcnA6cDpzcw==");
            assert_eq!(
                seen.authorization.as_deref(),
                expected,
                "{transport:?} {seen:?}"
            );
            assert_eq!(
                seen.accept.as_deref(),
                Some("application/json"),
                "{transport:?}"
            );
            assert!(seen.budget_ms.is_some(), "{transport:?} {seen:?}");
        }
    }
}
