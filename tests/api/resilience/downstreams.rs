//! Slow, hanging, failing and resetting downstreams: parts degrade, the required one fails the
//! request with the right status, calls are cancelled, breakers open and close, retries stop
//! at the deadline.

use std::time::Duration;

use futures::future::join_all;
use tokio::{io::AsyncWriteExt, net::TcpStream};
use tributary::{config::Ratio, domain::Service};
use tributary_sim::Mode;

use super::serial;
use crate::helpers::{degraded, eventually, metric_value, nz, optional, problem, spawn_app_with};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_simulator_ten_times_slower_than_the_timeouts_degrades_optional_parts_and_times_out_the_required_one()
 {
    let _serial = serial().await;
    // Arrange: every optional service ten times slower than its timeout.
    let timeout = Duration::from_millis(200);
    let app = spawn_app_with(|s| {
        s.server.request_deadline = Duration::from_secs(1);
        for d in s.downstreams.iter_mut() {
            d.timeout = timeout;
        }
    })
    .await;
    for (service, _) in optional() {
        app.set_service(service, |b| b.latency = timeout * 10);
    }
    let mut timeouts_before = Vec::new();
    for (service, _) in optional() {
        timeouts_before.push(
            app.metric(
                "tributary_fanout_degraded_total",
                &[("part", service.as_str()), ("reason", "timeout")],
            )
            .await,
        );
    }

    // Act
    let (status, body) = app.dashboard(1).await;

    // Assert: the optional parts degrade as timeouts, and none of the slow calls ran on.
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["profile"]["service"], "users");
    assert_eq!(
        degraded(&body),
        ["cart", "recommendations", "promotions", "notifications"]
    );
    for (_, field) in optional() {
        assert!(body[field].is_null(), "{field} should be null: {body}");
    }
    for ((service, _), before) in optional().iter().zip(timeouts_before) {
        let after = app
            .metric(
                "tributary_fanout_degraded_total",
                &[("part", service.as_str()), ("reason", "timeout")],
            )
            .await;
        assert!(after > before, "{service} not degraded as a timeout");
    }
    // The gateway did not wait for the slow answers: every slow call was abandoned, none ran
    // to completion.
    assert!(
        eventually(Duration::from_secs(5), || async {
            optional().iter().all(|(s, _)| {
                let st = app.sim.sim.stats(*s);
                st.cancelled == 1 && st.in_flight == 0 && st.completed == 0
            })
        })
        .await,
        "slow calls outlived their timeout"
    );

    // Act and assert again: now the required part is ten times slower too; a 504, and again
    // nothing left running.
    app.set_service(Service::Users, |b| b.latency = timeout * 10);
    let users_before = app.sim.sim.stats(Service::Users);
    let (status, body) = problem(app.get("/api/v1/dashboard/1").await).await;
    assert_eq!(status, 504);
    assert_eq!(body["type"], "/problems/gateway-timeout");
    assert!(
        eventually(Duration::from_secs(5), || async {
            let st = app.sim.sim.stats(Service::Users);
            st.cancelled == users_before.cancelled + 1
                && st.completed == users_before.completed
                && st.in_flight == 0
        })
        .await,
        "the required call outlived its timeout"
    );
    assert!(
        eventually(Duration::from_secs(5), || async {
            Service::ALL
                .iter()
                .all(|s| app.sim.sim.stats(*s).in_flight == 0)
        })
        .await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_downstream_hanging_forever_is_null_and_degraded_and_its_in_flight_count_returns_to_zero()
{
    let _serial = serial().await;
    let app = spawn_app_with(|s| {
        for d in s.downstreams.iter_mut() {
            d.max_concurrency = nz(8);
        }
        s.downstreams.recommendations.timeout = Duration::from_millis(200);
    })
    .await;
    app.hang(Service::Recommendations);

    let responses = join_all((1..=5).map(|user| app.dashboard(user))).await;

    for (status, body) in &responses {
        assert_eq!(*status, 200, "{body}");
        assert!(body["recommendations"].is_null(), "{body}");
        assert_eq!(degraded(body), ["recommendations"]);
        for field in ["profile", "cart", "promotions", "notifications"] {
            assert!(!body[field].is_null(), "{field} missing: {body}");
        }
        assert!(body["recent_orders"].is_array(), "{body}");
    }
    assert_eq!(app.sim.sim.stats(Service::Recommendations).requests, 5);
    assert!(
        eventually(Duration::from_secs(5), || async {
            app.sim.sim.stats(Service::Recommendations).in_flight == 0
                && app
                    .state
                    .downstreams
                    .all()
                    .iter()
                    .all(|d| d.available_permits() == 8)
        })
        .await,
        "hanging calls or their bulkhead permits outlived their requests: {:?} {:?}",
        app.sim.sim.stats(Service::Recommendations),
        app.state
            .downstreams
            .all()
            .map(|d| (d.service(), d.available_permits()))
    );
    assert!(
        eventually(Duration::from_secs(10), || async {
            app.metric(
                "tributary_downstream_in_flight",
                &[("downstream", "recommendations")],
            )
            .await
                == 0.0
        })
        .await,
        "the in-flight gauge did not return to zero"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_and_resetting_downstreams_open_their_circuits_and_half_open_probes_close_them() {
    let _serial = serial().await;
    let open_for = Duration::from_millis(500);
    let app = spawn_app_with(|s| {
        s.circuit_breaker.min_calls = 4;
        s.circuit_breaker.failure_ratio = Ratio::of(0.5);
        s.circuit_breaker.window = Duration::from_secs(30);
        s.circuit_breaker.open_for = open_for;
        s.circuit_breaker.half_open_probes = 2;
        s.retry.max_retries = 1;
        s.retry.backoff_base = Duration::from_millis(2);
        s.retry.budget_min_per_sec = 1000;
    })
    .await;
    app.set_service(Service::Carts, |b| b.error_rate = 1.0);
    app.set_service(Service::Promotions, |b| b.mode = Mode::Reset);
    let retries_before = app
        .metric(
            "tributary_downstream_retries_total",
            &[("downstream", "promotions")],
        )
        .await;

    // Phase 1, closed: every call reaches the simulator and fails; after min_calls failures,
    // the circuits open.
    for _ in 0..4 {
        let (status, body) = app.dashboard(1).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(degraded(&body), ["cart", "promotions"]);
    }
    let broken = [Service::Carts, Service::Promotions];
    for service in broken {
        assert_eq!(
            app.state.downstreams.get(service).breaker_state(),
            tributary::downstream::breaker::State::Open,
            "{service}"
        );
    }
    let retries_after = app
        .metric(
            "tributary_downstream_retries_total",
            &[("downstream", "promotions")],
        )
        .await;
    assert!(
        retries_after >= retries_before + 4.0,
        "a reset connection is retried: {retries_before} -> {retries_after}"
    );

    // Phase 2, open: the parts degrade without the simulator hearing about it. A burst fired at once
    // fits in one open period; at most one half-open round (probes plus their retries) may
    // slip through on a slow machine.
    let seen = |s: Service| app.sim.sim.stats(s).requests;
    let (carts_before, promotions_before) = (seen(Service::Carts), seen(Service::Promotions));
    let open_before = app
        .metric(
            "tributary_downstream_requests_total",
            &[("downstream", "carts"), ("outcome", "circuit_open")],
        )
        .await;
    let burst = join_all((0..10).map(|_| app.dashboard(1))).await;
    for (status, body) in &burst {
        assert_eq!(*status, 200, "{body}");
        assert_eq!(degraded(body), ["cart", "promotions"]);
    }
    let slipped = 2 * 2;
    assert!(
        seen(Service::Carts) - carts_before <= slipped,
        "carts still called"
    );
    assert!(
        seen(Service::Promotions) - promotions_before <= slipped,
        "promotions still called"
    );
    let open_after = app
        .metric(
            "tributary_downstream_requests_total",
            &[("downstream", "carts"), ("outcome", "circuit_open")],
        )
        .await;
    assert!(
        open_after >= open_before + 8.0,
        "{open_before} -> {open_after}"
    );
    // The state gauge says "open" (2). Traffic keeps flowing while we look, so a failed
    // half-open probe re-opens the circuit and sets the gauge again even if another gateway in
    // this process (they share one recorder) was built in between.
    assert!(
        eventually(Duration::from_secs(5), || async {
            let _ = app.dashboard(1).await;
            let text = app.metrics().await;
            broken.iter().all(|s| {
                metric_value(
                    &text,
                    "tributary_downstream_circuit_state",
                    &[("downstream", s.as_str())],
                ) == Some(2.0)
            })
        })
        .await,
        "circuit state gauge never showed open"
    );

    // Phase 3, healthy again: after open_for, half-open probes succeed and close the circuits.
    app.set_service(Service::Carts, |b| b.error_rate = 0.0);
    app.set_service(Service::Promotions, |b| b.mode = Mode::Normal);
    let closed = eventually(Duration::from_secs(10), || async {
        let (status, body) = app.dashboard(1).await;
        status == 200
            && degraded(&body).is_empty()
            && broken.iter().all(|s| {
                app.state.downstreams.get(*s).breaker_state()
                    == tributary::downstream::breaker::State::Closed
            })
    })
    .await;
    assert!(
        closed,
        "circuits did not close after the services recovered"
    );
    let text = app.metrics().await;
    for s in broken {
        assert_eq!(
            metric_value(
                &text,
                "tributary_downstream_circuit_state",
                &[("downstream", s.as_str())]
            ),
            Some(0.0)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_circuit_whose_half_open_probes_are_abandoned_still_closes() {
    let _serial = serial().await;
    let open_for = Duration::from_millis(300);
    let app = spawn_app_with(|s| {
        s.server.request_deadline = Duration::from_secs(10);
        s.downstreams.carts.timeout = Duration::from_secs(5);
        s.circuit_breaker.min_calls = 4;
        s.circuit_breaker.window = Duration::from_secs(30);
        s.circuit_breaker.open_for = open_for;
        s.circuit_breaker.half_open_probes = 2;
    })
    .await;
    app.set_service(Service::Carts, |b| b.error_rate = 1.0);
    for _ in 0..4 {
        let (_, body) = app.dashboard(1).await;
        assert_eq!(degraded(&body), ["cart"]);
    }
    let carts = app.state.downstreams.get(Service::Carts);
    assert_eq!(
        carts.breaker_state(),
        tributary::downstream::breaker::State::Open
    );

    // Once open_for has passed, two requests become the half-open probes: carts is healthy
    // now but slow, and both clients hang up while their probes are still waiting for it.
    app.set_service(Service::Carts, |b| {
        b.error_rate = 0.0;
        b.latency = Duration::from_secs(5);
    });
    tokio::time::sleep(open_for + Duration::from_millis(100)).await;
    let probes_before = app.sim.sim.stats(Service::Carts).requests;
    let mut clients = Vec::new();
    for user in 1..=2 {
        let mut stream = TcpStream::connect(app.addr).await.unwrap();
        let request = format!("GET /api/v1/dashboard/{user} HTTP/1.1\r\nhost: gateway\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        clients.push(stream);
    }
    let probing = eventually(Duration::from_secs(5), || async {
        app.sim.sim.stats(Service::Carts).requests == probes_before + 2
    })
    .await;
    drop(clients);
    assert!(probing, "the half-open probes never reached carts");
    assert!(
        eventually(Duration::from_secs(5), || async {
            app.sim.sim.stats(Service::Carts).in_flight == 0
        })
        .await,
        "the abandoned probes were not cancelled"
    );

    // carts is fast again: the circuit must be able to probe it and close, not stay wedged
    // in half-open with slots held by probes that will never report.
    app.set_service(Service::Carts, |b| b.latency = Duration::from_millis(5));
    let closed = eventually(Duration::from_secs(5), || async {
        let (_, body) = app.dashboard(1).await;
        degraded(&body).is_empty()
            && carts.breaker_state() == tributary::downstream::breaker::State::Closed
    })
    .await;
    assert!(
        closed,
        "circuit stuck in {:?} after its probes were abandoned",
        carts.breaker_state()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_of_a_failing_required_part_stop_at_the_deadline() {
    let _serial = serial().await;
    let deadline = Duration::from_millis(300);
    let app = spawn_app_with(|s| {
        s.server.request_deadline = deadline;
        s.downstreams.users.timeout = Duration::from_secs(5);
        // Many retries allowed and a generous budget: only the deadline can stop them.
        s.retry.max_retries = 50;
        s.retry.backoff_base = Duration::from_millis(20);
        s.retry.budget_min_per_sec = 10_000;
        s.circuit_breaker.enabled = false;
    })
    .await;
    app.set_service(Service::Users, |b| b.mode = Mode::Reset);
    let retries_before = app
        .metric(
            "tributary_downstream_retries_total",
            &[("downstream", "users")],
        )
        .await;

    let (status, body) = problem(app.get("/api/v1/dashboard/1").await).await;

    // Usually the reset itself (502): the loop stops retrying while there is still time to
    // answer. On a starved machine the last attempt may run out of budget instead (504).
    assert!(matches!(status, 502 | 504), "{status} {body}");
    let budgets: Vec<u64> = app
        .sim
        .sim
        .journal()
        .iter()
        .filter(|s| s.service == Service::Users)
        .map(|s| s.budget_ms.expect("budget header"))
        .collect();
    assert!(budgets.len() >= 2, "the reset was retried: {budgets:?}");
    assert!(
        budgets.len() < 51,
        "the deadline, not max_retries, ended the retries: {budgets:?}"
    );
    assert!(
        budgets
            .iter()
            .all(|b| *b >= 1 && *b <= deadline.as_millis() as u64),
        "every attempt ran inside the deadline: {budgets:?}"
    );
    assert!(
        budgets.windows(2).all(|w| w[1] <= w[0]),
        "each retry had less budget than the one before: {budgets:?}"
    );
    let retries_after = app
        .metric(
            "tributary_downstream_retries_total",
            &[("downstream", "users")],
        )
        .await;
    assert!(retries_after - retries_before >= (budgets.len() - 1) as f64);
}

/// Every way a downstream can fail an exchange, on both transports and over HTTP/2 as well as
/// HTTP/1.1: a reset connection (a reset stream on HTTP/2), a 404, a body that is not JSON and
/// one over the 1 MiB bound each degrade their part alone.
#[tokio::test]
async fn each_broken_exchange_degrades_only_its_part_on_either_transport() {
    for (transport, http2) in [
        (tributary::config::TransportKind::Reqwest, false),
        (tributary::config::TransportKind::Hyper, false),
        (tributary::config::TransportKind::Reqwest, true),
        (tributary::config::TransportKind::Hyper, true),
    ] {
        let app = spawn_app_with(|s| {
            s.http_client.transport = transport;
            s.http_client.http2_prior_knowledge = http2;
            s.retry.max_retries = 0;
        })
        .await;
        app.set_service(Service::Carts, |b| b.mode = Mode::NotFound);
        app.set_service(Service::Recommendations, |b| b.mode = Mode::Reset);
        app.set_service(Service::Promotions, |b| b.body_bytes = 2 << 20);
        app.set_service(Service::Notifications, |b| b.mode = Mode::InvalidJson);

        let request_id = format!("broken-exchanges-{transport:?}-{http2}");
        let resp = app
            .client
            .get(app.url("/api/v1/dashboard/1"))
            .header("x-request-id", &request_id)
            .send()
            .await
            .unwrap();
        let status = resp.status();
        let body: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(status, 200, "{transport:?}: {body}");
        let mut parts = degraded(&body);
        parts.sort_unstable();
        assert_eq!(
            parts,
            ["cart", "notifications", "promotions", "recommendations"],
            "{transport:?}"
        );
        assert_eq!(
            body["profile"]["user_id"], 1,
            "{transport:?}: the healthy part is served"
        );
        // Each for its own reason, named in its warning.
        let causes: std::collections::BTreeMap<String, String> = crate::helpers::log_lines()
            .into_iter()
            .filter(|l| l["span"]["request_id"] == request_id.as_str())
            .filter(|l| l["message"] == "dashboard part degraded")
            .map(|l| {
                (
                    l["part"].as_str().unwrap().to_owned(),
                    l["error"].to_string(),
                )
            })
            .collect();
        assert!(causes["cart"].contains("carts answered 404"), "{causes:?}");
        assert!(
            causes["promotions"].contains("promotions sent an invalid body: body too large"),
            "{causes:?}"
        );
        assert!(
            causes["notifications"].contains("notifications sent an invalid body"),
            "{causes:?}"
        );
        assert!(
            causes["recommendations"].contains("recommendations could not be reached"),
            "{causes:?}"
        );
    }
}

/// `http_client.http2_prior_knowledge`: every call is an HTTP/2 stream, and a burst of
/// concurrent dashboards shares a connection instead of opening one per call, on either
/// transport. The same burst over HTTP/1.1 is the control: it needs a connection per call in
/// flight, so the count below could not pass with the option ignored.
#[tokio::test]
async fn http2_prior_knowledge_multiplexes_concurrent_calls_on_a_shared_connection() {
    const BURST: usize = 20;
    for (transport, http2) in [
        (tributary::config::TransportKind::Reqwest, false),
        (tributary::config::TransportKind::Reqwest, true),
        (tributary::config::TransportKind::Hyper, true),
    ] {
        let app = spawn_app_with(|s| {
            s.http_client.transport = transport;
            s.http_client.http2_prior_knowledge = http2;
            s.server.request_deadline = Duration::from_secs(5);
            for d in s.downstreams.iter_mut() {
                d.timeout = Duration::from_secs(3);
            }
        })
        .await;
        app.seed(BURST as i64, 1).await;
        // Long enough that every call of the burst is in flight at once, even on a loaded
        // machine: HTTP/1.1 could reuse a connection only for a dashboard that arrives a
        // second after another.
        for service in Service::ALL {
            app.set_service(service, |b| b.latency = Duration::from_secs(1));
        }
        let before = app.sim.sim.connections();

        let answers = join_all((1..=BURST as i64).map(|id| app.dashboard(id))).await;

        for (status, body) in &answers {
            assert_eq!(*status, 200, "{transport:?} http2={http2}: {body}");
            assert_eq!(degraded(body), Vec::<String>::new(), "{body}");
        }
        let opened = app.sim.sim.connections() - before;
        let versions: std::collections::BTreeSet<String> = app
            .sim
            .sim
            .journal()
            .into_iter()
            .map(|seen| seen.http_version)
            .collect();
        if http2 {
            assert_eq!(versions, ["HTTP/2.0".to_owned()].into(), "{transport:?}");
            assert!(
                opened <= 2,
                "{transport:?}: {opened} connections for {} concurrent calls",
                BURST * 5
            );
        } else {
            assert_eq!(versions, ["HTTP/1.1".to_owned()].into());
            assert!(
                opened >= BURST as u64,
                "HTTP/1.1 needs a connection per call in flight: {opened}"
            );
        }
    }
}
