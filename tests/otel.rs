//! OpenTelemetry export, end to end: the gateway exports OTLP/HTTP protobuf to an in-process
//! receiver that decodes the real `ExportTraceServiceRequest` and `ExportMetricsServiceRequest`;
//! the span tree, the metrics (against `/metrics`) and the standard `OTEL_*` environment are
//! asserted.
//!
//! A separate test binary because it installs the process-wide `tracing` subscriber with the
//! OTLP layer and the process-wide metrics recorder with the OTLP fan-out, which the main
//! suite would otherwise own. The environment tests build their settings from an environment
//! they pass in, never from the process's.

#[path = "api/helpers.rs"]
#[allow(
    dead_code,
    reason = "the shared harness has helpers this binary does not use"
)]
mod helpers;

use std::{
    sync::{Arc, Mutex, OnceLock},
    time::Duration,
};

use axum::{Router, body::Bytes, extract::State, routing::get, routing::post};
use opentelemetry::trace::{Tracer as _, TracerProvider as _};
use opentelemetry_proto::tonic::{
    collector::{metrics::v1::ExportMetricsServiceRequest, trace::v1::ExportTraceServiceRequest},
    common::v1::{AnyValue, KeyValue, any_value},
    metrics::v1::{Metric, metric, number_data_point},
    trace::v1::Span,
};
use prost::Message;
use tributary::{Settings, config::Sources, domain::Service};
use tributary_sim::Behaviour;

/// What the in-process OTLP receiver got: every span with its resource's attributes, and
/// every metrics export.
#[derive(Default)]
struct Received {
    spans: Vec<(Vec<KeyValue>, Span)>,
    metrics: Vec<ExportMetricsServiceRequest>,
}

type Shared = Arc<Mutex<Received>>;

async fn receive_traces(State(got): State<Shared>, body: Bytes) -> &'static str {
    let request = ExportTraceServiceRequest::decode(body).expect("valid OTLP protobuf");
    let mut got = got.lock().unwrap();
    for rs in request.resource_spans {
        let resource = rs.resource.map(|r| r.attributes).unwrap_or_default();
        for ss in rs.scope_spans {
            got.spans
                .extend(ss.spans.into_iter().map(|s| (resource.clone(), s)));
        }
    }
    ""
}

async fn receive_metrics(State(got): State<Shared>, body: Bytes) -> &'static str {
    let request = ExportMetricsServiceRequest::decode(body).expect("valid OTLP protobuf");
    got.lock().unwrap().metrics.push(request);
    ""
}

/// The receiver (one per test binary, on a thread and runtime of its own so that it outlives
/// every test's runtime) and its base URL.
fn receiver() -> &'static (String, Shared) {
    static RECEIVER: OnceLock<(String, Shared)> = OnceLock::new();
    RECEIVER.get_or_init(|| {
        let got = Shared::default();
        let routes = Router::new()
            .route("/v1/traces", post(receive_traces))
            .route("/v1/metrics", post(receive_metrics))
            .with_state(Arc::clone(&got));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                axum::serve(listener, routes).await.unwrap();
            });
        });
        (url, got)
    })
}

/// The process-wide pipelines, installed once before any application is built: the `tracing`
/// subscriber exporting spans to the receiver, and (through the first application's settings,
/// see [`exporting_metrics`]) the metrics fan-out.
fn install_pipelines() {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        let mut telemetry = Settings::default().telemetry;
        telemetry.otlp_endpoint = Some(receiver().0.parse().expect("the receiver's URL"));
        telemetry.log_level = "warn,tributary=info".into();
        let guard = tributary::telemetry::init_tracing(&telemetry)
            .expect("tracing with OTLP export installs");
        // The pipeline lives as long as the test binary.
        std::mem::forget(guard);
    });
}

/// Every application in this binary exports metrics to the receiver, often: whichever is
/// built first installs the process's recorder.
fn exporting_metrics(settings: &mut Settings) {
    settings.telemetry.otlp_metrics_endpoint = Some(
        format!("{}/v1/metrics", receiver().0)
            .parse()
            .expect("the receiver's URL"),
    );
    settings.telemetry.otlp_metrics_interval = Some(Duration::from_millis(200));
}

fn attr<'a>(attributes: &'a [KeyValue], key: &str) -> Option<&'a any_value::Value> {
    attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v: &AnyValue| v.value.as_ref())
}

fn string_attr<'a>(attributes: &'a [KeyValue], key: &str) -> Option<&'a str> {
    match attr(attributes, key)? {
        any_value::Value::StringValue(s) => Some(s),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dashboard_request_exports_one_server_span_with_six_children_in_the_callers_trace() {
    // Arrange: the gateway's subscriber exporting to the in-process receiver.
    tokio::task::spawn_blocking(install_pipelines)
        .await
        .unwrap();
    let got = &receiver().1;
    let app = helpers::spawn_app_with(exporting_metrics).await;
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
        let got = got.lock().unwrap();
        server = got
            .spans
            .iter()
            .map(|(_, s)| s)
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
    let all: Vec<Span> = got
        .lock()
        .unwrap()
        .spans
        .iter()
        .map(|(_, s)| s.clone())
        .collect();
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
    assert!(attr(&db.attributes, "db.system.name").is_some());
    // The downstream call's traceparent named that call's span as parent.
    let users = children
        .iter()
        .find(|s| s.name == "GET /users/{user_id}")
        .unwrap();
    // The downstream's status is on the call's span (and not on the server span's: that one
    // carries the gateway's own status).
    let status = |s: &Span| {
        attr(&s.attributes, "http.response.status_code").and_then(|v| match v {
            any_value::Value::IntValue(i) => Some(*i),
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
}

fn hex_id(s: &str) -> Vec<u8> {
    hex::decode(s).unwrap()
}

/// The metric named `name` in the newest export that has it.
fn latest_metric(got: &Shared, name: &str) -> Option<(Vec<KeyValue>, Metric)> {
    let got = got.lock().unwrap();
    got.metrics.iter().rev().find_map(|request| {
        request.resource_metrics.iter().find_map(|rm| {
            let resource = rm
                .resource
                .clone()
                .map(|r| r.attributes)
                .unwrap_or_default();
            rm.scope_metrics
                .iter()
                .flat_map(|sm| &sm.metrics)
                .find(|m| m.name == name)
                .map(|m| (resource.clone(), m.clone()))
        })
    })
}

/// The `le` boundaries of a Prometheus histogram series, `+Inf` left out.
fn prometheus_bounds(exposition: &str, name: &str, route: &str) -> Vec<f64> {
    let prefix = format!("{name}_bucket{{");
    exposition
        .lines()
        .filter(|l| l.starts_with(&prefix) && l.contains(&format!("http_route=\"{route}\"")))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            le.parse::<f64>().ok().filter(|b| b.is_finite())
        })
        .collect()
}

const PROBE: &str = "/test/otlp-probe";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_over_otlp_carry_the_conventional_names_units_and_the_counts_of_metrics() {
    // Arrange: a route of this test's own, so that no other test's requests are counted in it.
    tokio::task::spawn_blocking(install_pipelines)
        .await
        .unwrap();
    let got = &receiver().1;
    let app = helpers::spawn_app_full(
        exporting_metrics,
        Router::new().route(PROBE, get(|| async { "probe" })),
        Behaviour::default(),
    )
    .await;

    // Act: three requests.
    for _ in 0..3 {
        let resp = app.client.get(app.url(PROBE)).send().await.unwrap();
        assert_eq!(resp.status(), 200);
    }
    let exposition = app.metrics().await;
    let scraped = helpers::metric_value(
        &exposition,
        "tributary_http_requests_total",
        &[("http_route", PROBE), ("http_request_method", "GET")],
    )
    .expect("the probe's requests on /metrics");
    assert_eq!(scraped, 3.0);

    // Assert: an export (every 200 ms) shows the same count for the same series.
    let route_is_probe =
        |attributes: &[KeyValue]| string_attr(attributes, "http.route") == Some(PROBE);
    let mut counted = None;
    for _ in 0..150 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        counted = latest_metric(got, "tributary_http_requests").and_then(|(_, m)| {
            let Some(metric::Data::Sum(sum)) = m.data else {
                return None;
            };
            assert!(sum.is_monotonic, "a counter is a monotonic sum");
            sum.data_points
                .into_iter()
                .find(|p| {
                    route_is_probe(&p.attributes)
                        && string_attr(&p.attributes, "status_class") == Some("2xx")
                })
                .and_then(|p| match p.value {
                    Some(number_data_point::Value::AsInt(n)) => Some((n, p.attributes)),
                    _ => None,
                })
        });
        if counted.as_ref().is_some_and(|(n, _)| *n == 3) {
            break;
        }
    }
    let (count, attributes) = counted.expect("the request counter was exported");
    assert_eq!(count as f64, scraped, "OTLP and /metrics agree");
    assert_eq!(string_attr(&attributes, "http.request.method"), Some("GET"));
    assert_eq!(string_attr(&attributes, "status_class"), Some("2xx"));

    // The request histogram under its semantic-convention name, in seconds, with the
    // Prometheus side's buckets and the conventions' attributes.
    let (resource, duration) =
        latest_metric(got, "http.server.request.duration").expect("the request histogram");
    assert_eq!(duration.unit, "s");
    assert!(
        duration
            .description
            .starts_with("Duration of HTTP server requests")
    );
    let Some(metric::Data::Histogram(histogram)) = duration.data else {
        panic!("a histogram: {duration:?}");
    };
    let point = histogram
        .data_points
        .iter()
        .find(|p| route_is_probe(&p.attributes))
        .expect("the probe's series");
    assert_eq!(point.count, 3);
    assert_eq!(
        point.explicit_bounds,
        prometheus_bounds(&exposition, "http_server_request_duration_seconds", PROBE),
        "the same bucket boundaries as /metrics"
    );
    assert_eq!(
        string_attr(&point.attributes, "http.request.method"),
        Some("GET")
    );
    assert!(
        matches!(
            attr(&point.attributes, "http.response.status_code"),
            Some(any_value::Value::IntValue(200))
        ),
        "{:?}",
        point.attributes
    );
    let (_, active) =
        latest_metric(got, "http.server.active_requests").expect("the active-requests gauge");
    assert_eq!(active.unit, "{request}");
    assert!(
        matches!(active.data, Some(metric::Data::Sum(ref s)) if !s.is_monotonic),
        "an UpDownCounter: {active:?}"
    );

    // The resource names the service, its version and this instance.
    assert_eq!(string_attr(&resource, "service.name"), Some("tributary"));
    assert_eq!(
        string_attr(&resource, "service.version"),
        Some(env!("CARGO_PKG_VERSION"))
    );
    assert!(string_attr(&resource, "service.instance.id").is_some_and(|id| !id.is_empty()));
}

/// Settings loaded from `env` alone, as `tributary` loads them from its process environment.
fn settings_from(env: &[(&str, String)]) -> Settings {
    Settings::load(&Sources {
        file: None,
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect(),
    })
    .expect("settings load")
}

/// Exports one span named `name` through a tracer provider built from `settings`, flushed;
/// false when the settings build no provider.
fn export_one_span(settings: &Settings, name: &'static str) -> bool {
    let Some(provider) =
        tributary::telemetry::tracer_provider(&settings.telemetry).expect("the provider builds")
    else {
        return false;
    };
    provider.tracer("test").in_span(name, |_| {});
    provider.force_flush().expect("the export completes");
    let _ = provider.shutdown();
    true
}

fn exported_named(name: &str) -> Vec<(Vec<KeyValue>, Span)> {
    receiver()
        .1
        .lock()
        .unwrap()
        .spans
        .iter()
        .filter(|(_, s)| s.name == name)
        .cloned()
        .collect()
}

#[test]
fn the_standard_endpoint_alone_turns_export_on_with_the_service_and_resource_it_names() {
    let settings = settings_from(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver().0.clone()),
        ("OTEL_SERVICE_NAME", "checkout-bff".into()),
        (
            "OTEL_RESOURCE_ATTRIBUTES",
            "k8s.pod.name=tributary-7d9f-abcde,k8s.namespace.name=shop".into(),
        ),
    ]);

    assert!(export_one_span(&settings, "env-endpoint-probe"));

    let spans = exported_named("env-endpoint-probe");
    assert_eq!(spans.len(), 1, "exported to {}/v1/traces", receiver().0);
    let resource = &spans[0].0;
    assert_eq!(string_attr(resource, "service.name"), Some("checkout-bff"));
    assert_eq!(
        string_attr(resource, "k8s.pod.name"),
        Some("tributary-7d9f-abcde")
    );
    assert_eq!(string_attr(resource, "k8s.namespace.name"), Some("shop"));
    assert_eq!(
        string_attr(resource, "service.version"),
        Some(env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn the_always_off_sampler_exports_no_spans_where_always_on_exports_them() {
    let with = |sampler: &str| {
        settings_from(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver().0.clone()),
            ("OTEL_TRACES_SAMPLER", sampler.into()),
        ])
    };

    assert!(export_one_span(&with("always_off"), "sampled-off-probe"));
    assert!(export_one_span(&with("always_on"), "sampled-on-probe"));

    assert_eq!(exported_named("sampled-off-probe").len(), 0);
    assert_eq!(
        exported_named("sampled-on-probe").len(),
        1,
        "the pipeline works"
    );
}

#[test]
fn sdk_disabled_wins_over_every_endpoint_and_key() {
    let mut settings = settings_from(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver().0.clone()),
        ("OTEL_SDK_DISABLED", "true".into()),
    ]);
    settings.telemetry.otlp_traces_endpoint =
        Some(format!("{}/v1/traces", receiver().0).parse().unwrap());

    assert!(!export_one_span(&settings, "disabled-probe"), "no provider");
    let otel = settings.telemetry.otel();
    assert_eq!(otel.metrics_endpoint.value, None, "no metrics either");
    assert_eq!(exported_named("disabled-probe").len(), 0);
}
