//! OpenTelemetry export, end to end: the gateway exports OTLP/HTTP protobuf to an in-process
//! receiver that decodes the real `ExportTraceServiceRequest`, and the span tree is asserted.
//!
//! A separate test binary because it installs the process-wide `tracing` subscriber with the
//! OTLP layer, which the main suite's subscriber would otherwise own.

#[path = "api/helpers.rs"]
#[allow(
    dead_code,
    reason = "the shared harness has helpers this binary does not use"
)]
mod helpers;

use std::{sync::Arc, time::Duration};

use axum::{Router, body::Bytes, extract::State, routing::post};
use opentelemetry_proto::tonic::{
    collector::trace::v1::ExportTraceServiceRequest, trace::v1::Span,
};
use prost::Message;
use tokio::sync::Mutex;
use tributary::domain::Service;

type Received = Arc<Mutex<Vec<Span>>>;

async fn receive(State(spans): State<Received>, body: Bytes) -> &'static str {
    let request = ExportTraceServiceRequest::decode(body).expect("valid OTLP protobuf");
    let mut all = spans.lock().await;
    for rs in request.resource_spans {
        for ss in rs.scope_spans {
            all.extend(ss.spans);
        }
    }
    ""
}

fn attr<'a>(
    span: &'a Span,
    key: &str,
) -> Option<&'a opentelemetry_proto::tonic::common::v1::AnyValue> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dashboard_request_exports_one_server_span_with_six_children_in_the_callers_trace() {
    // Arrange: an OTLP receiver on port 0, the gateway's subscriber exporting to it.
    let spans: Received = Arc::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let receiver = format!("http://{}", listener.local_addr().unwrap());
    let app = Router::new()
        .route("/v1/traces", post(receive))
        .with_state(Arc::clone(&spans));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let mut telemetry = tributary::Settings::default().telemetry;
    telemetry.otlp_endpoint = Some(receiver.parse().expect("the receiver's URL"));
    telemetry.log_level = "warn,tributary=info".into();
    // The exporter's blocking HTTP client must be created outside async context.
    let guard = tokio::task::spawn_blocking(move || tributary::telemetry::init_tracing(&telemetry))
        .await
        .unwrap()
        .expect("tracing with OTLP export installs");

    let app = helpers::spawn_app().await;
    app.seed(1, 5).await;
    // Act: one dashboard request in the caller's trace.
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let resp = app
        .client
        .get(app.url("/api/v1/dashboard/1"))
        .header("traceparent", format!("00-{trace_id}-00f067aa0ba902b7-01"))
        .header("tracestate", "vendor=abc")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);

    // Assert, on the wire: the downstream calls carried the same trace, each with its own call
    // span as parent.
    let journal = app.sim.sim.journal();
    assert_eq!(journal.len(), 5);
    for seen in &journal {
        let tp = seen.traceparent.as_deref().unwrap();
        assert_eq!(&tp[3..35], trace_id, "{tp}");
        assert_eq!(seen.tracestate.as_deref(), Some("vendor=abc"));
    }

    // Assert, in the export: one server span parented on the caller's, with one child per
    // part. The batch exporter flushes every 500 ms; wait for the server span to arrive.
    let wanted = hex_id(trace_id);
    let mut server = None;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let all = spans.lock().await;
        server = all
            .iter()
            .find(|s| s.trace_id == wanted && s.name == "GET /api/v1/dashboard/{user_id}")
            .cloned();
        if server.is_some() {
            // Children end before their parent, so they are in this or an earlier batch.
            break;
        }
    }
    let server = server.expect("the server span was exported");
    assert_eq!(
        server.parent_span_id,
        hex_id("00f067aa0ba902b7"),
        "parented on the caller's span"
    );
    assert_eq!(server.kind, 2, "SPAN_KIND_SERVER");
    let all = spans.lock().await;
    let children: Vec<&Span> = all
        .iter()
        .filter(|s| s.trace_id == wanted && s.parent_span_id == server.span_id)
        .collect();
    let mut names: Vec<&str> = children.iter().map(|s| s.name.as_str()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "GET /carts/{user_id}",
            "GET /notifications/{user_id}",
            "GET /promotions/{user_id}",
            "GET /recommendations/{user_id}",
            "GET /users/{user_id}",
            "recent_orders",
        ],
        "one child per part"
    );
    for child in &children {
        let expected_kind = 3; // SPAN_KIND_CLIENT
        assert_eq!(child.kind, expected_kind, "{}", child.name);
    }
    let db = children.iter().find(|s| s.name == "recent_orders").unwrap();
    assert!(attr(db, "db.system.name").is_some());
    // The downstream call's traceparent named that call's span as parent.
    let users = children
        .iter()
        .find(|s| s.name == "GET /users/{user_id}")
        .unwrap();
    // The downstream's status is on the call's span (and not on the server span's: that one
    // carries the gateway's own status).
    let status = |s: &Span| {
        attr(s, "http.response.status_code").and_then(|v| match v.value {
            Some(opentelemetry_proto::tonic::common::v1::any_value::Value::IntValue(i)) => Some(i),
            _ => None,
        })
    };
    assert_eq!(status(users), Some(200), "{:?}", users.attributes);
    assert_eq!(status(&server), Some(200), "{:?}", server.attributes);
    let users_call = journal
        .iter()
        .find(|s| s.service == Service::Users)
        .unwrap();
    assert_eq!(
        &users_call.traceparent.as_deref().unwrap()[36..52],
        hex::encode(&users.span_id)
    );
    drop(all);
    drop(app);
    tokio::task::spawn_blocking(move || drop(guard))
        .await
        .unwrap();
}

fn hex_id(s: &str) -> Vec<u8> {
    hex::decode(s).unwrap()
}
