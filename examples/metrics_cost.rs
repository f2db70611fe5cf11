//! What recording costs on the request path with metrics over OTLP off and on: the handles one
//! request records through (the request counter, the request histogram, the active-requests
//! gauge up and down), recorded many times through
//! - the Prometheus recorder alone: what runs with OTLP off, where no fan-out is installed;
//! - the fan-out to the Prometheus recorder and to the OTLP bridge: what runs with OTLP on
//!   (its reader never exports during the run: the network is not what is measured).
//!
//! ```sh
//! cargo run --release --example metrics_cost
//! ```
//!
//! Each case runs on one thread, then on two threads recording into the same series (the
//! contended case: every request of a route shares them), and the histogram recording alone
//! on one thread. Prints nanoseconds per request.

use std::{
    hint::black_box,
    time::{Duration, Instant},
};

use metrics::{Counter, Gauge, Histogram, Recorder};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use tributary::{startup::METRIC_FAMILIES, telemetry::OtelRecorder};

const REQUESTS: u32 = 2_000_000;

/// The same boundaries as the gateway's (a `_seconds` histogram).
const BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

#[derive(Clone)]
struct Handles {
    requests: Counter,
    duration: Histogram,
    active: Gauge,
}

fn handles(recorder: &(dyn Recorder + Sync)) -> Handles {
    metrics::with_local_recorder(recorder, || Handles {
        requests: metrics::counter!(
            "tributary_http_requests_total",
            "http_route" => "/api/v1/dashboard/{user_id}",
            "http_request_method" => "GET",
            "status_class" => "2xx"
        ),
        duration: metrics::histogram!(
            "http_server_request_duration_seconds",
            "http_route" => "/api/v1/dashboard/{user_id}",
            "http_request_method" => "GET",
            "http_response_status_code" => "200"
        ),
        active: metrics::gauge!("http_server_active_requests"),
    })
}

/// Nanoseconds per histogram recording alone, on one thread.
fn measure_histogram(h: &Handles) -> f64 {
    let start = Instant::now();
    for i in 0..REQUESTS {
        h.duration.record(black_box(f64::from(i % 1000) * 0.0001));
    }
    start.elapsed().as_nanos() as f64 / f64::from(REQUESTS)
}

/// Nanoseconds per request, on `threads` threads at once.
fn measure(h: &Handles, threads: u32) -> f64 {
    let per_thread = REQUESTS / threads;
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            let h = h.clone();
            s.spawn(move || {
                for i in 0..per_thread {
                    h.active.increment(1.0);
                    h.duration.record(black_box(f64::from(i % 1000) * 0.0001));
                    h.requests.increment(1);
                    h.active.decrement(1.0);
                }
            });
        }
    });
    start.elapsed().as_nanos() as f64 / f64::from(per_thread)
}

fn prometheus() -> anyhow::Result<metrics_exporter_prometheus::PrometheusRecorder> {
    Ok(PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), BUCKETS)?
        .build_recorder())
}

fn main() -> anyhow::Result<()> {
    // The exporter's HTTP client needs a TLS provider, as in the gateway.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let off = prometheus()?;
    let exporter = opentelemetry_otlp::MetricExporter::builder()
        .with_http()
        .with_endpoint("http://127.0.0.1:9/v1/metrics")
        .build()?;
    let provider = SdkMeterProvider::builder()
        .with_reader(
            PeriodicReader::builder(exporter)
                .with_interval(Duration::from_secs(3600))
                .build(),
        )
        .build();
    let on = metrics_util::layers::FanoutBuilder::default()
        .add_recorder(prometheus()?)
        .add_recorder(OtelRecorder::new(&provider, METRIC_FAMILIES))
        .build();
    let cases: [(&str, &(dyn Recorder + Sync)); 2] = [
        ("OTLP off (Prometheus recorder alone)", &off),
        ("OTLP on (fan-out: Prometheus + OTLP bridge)", &on),
    ];
    println!("{REQUESTS} requests, each: gauge +1, histogram record, counter +1, gauge -1");
    for (name, recorder) in cases {
        let h = handles(recorder);
        measure(&h, 1); // warm-up
        let one = measure(&h, 1);
        let two = measure(&h, 2);
        let histogram = measure_histogram(&h);
        println!(
            "{name:<45} 1 thread: {one:>6.1} ns/request   2 threads: {two:>6.1} ns/request   \
             the histogram alone: {histogram:>6.1} ns"
        );
    }
    // The provider would try a final export to the unreachable endpoint; it is not needed.
    std::mem::forget(provider);
    Ok(())
}
