//! Metrics: the Prometheus recorder, the catalogue of metric families, and the per-request RED
//! instruments.
//!
//! Metrics go through the `metrics` facade into a Prometheus recorder rendered by our own
//! `/metrics` route; with `telemetry.metrics_enabled = false` no recorder is installed and every
//! instrument is a no-op, which is how the benchmark lab measures instrumentation cost.
//!
//! A metric's name, type and help text are written once, as a [`Family`] constant beside the
//! struct that records it (in `admission`, `ratelimit`, `downstream`, `db`, `fanout` and here);
//! the recording site passes the constant's name to the `metrics` macros, and the application
//! hands the whole catalogue to [`install_recorder`], which describes each family. A test
//! checks that the catalogue and the exposition agree in both directions.

use std::{
    collections::HashMap,
    sync::{Mutex, RwLock},
    time::Duration,
};

use axum::http::Method;
use metrics::{Counter, Gauge, Histogram, Unit};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

use crate::{build_info, config::TelemetrySettings};

/// Latency buckets that resolve both 1 ms and 1 s (OTLP histograms get the same ones), and
/// between 100 and 300 ms every 50 ms: where an aggregation gateway's requests land (its
/// downstreams' ~100 ms plus its own queues), and where its latency objectives are set. With
/// 100 and 250 ms alone, a p99 of 105 ms and one of 240 ms were the same bucket, and
/// `histogram_quantile` could only interpolate across it.
pub(super) const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.5, 1.0, 2.5, 5.0,
    10.0,
];

/// The installed Prometheus recorder: the `metrics` facade has one global recorder per process.
/// A mutex, not a `OnceLock`, because installing can fail and check-then-install must be atomic
/// when several applications start at once (tests do); nothing awaits while it is held.
static PROMETHEUS: Mutex<Option<PrometheusHandle>> = Mutex::new(None);

/// The Prometheus type of a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    /// The type as the exposition format's `# TYPE` line writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One metric family: its name, type, unit and help text, declared once as a constant beside
/// the struct that records it.
#[derive(Debug, Clone, Copy)]
pub struct Family {
    pub name: &'static str,
    pub kind: Kind,
    pub help: &'static str,
    unit: Option<Unit>,
}

impl Family {
    pub const fn counter(name: &'static str, help: &'static str) -> Self {
        Self {
            name,
            kind: Kind::Counter,
            help,
            unit: None,
        }
    }

    pub const fn gauge(name: &'static str, help: &'static str) -> Self {
        Self {
            name,
            kind: Kind::Gauge,
            help,
            unit: None,
        }
    }

    /// A histogram of durations in seconds (the latency buckets above apply to every
    /// `_seconds` name).
    pub const fn seconds(name: &'static str, help: &'static str) -> Self {
        Self {
            name,
            kind: Kind::Histogram,
            help,
            unit: Some(Unit::Seconds),
        }
    }

    /// The same family with a unit in its description.
    pub const fn in_unit(self, unit: Unit) -> Self {
        Self {
            unit: Some(unit),
            ..self
        }
    }

    /// The unit, when the family has one.
    pub fn unit(&self) -> Option<Unit> {
        self.unit
    }

    fn describe(&self) {
        let (name, help) = (self.name, self.help);
        match (self.kind, self.unit) {
            (Kind::Counter, Some(unit)) => metrics::describe_counter!(name, unit, help),
            (Kind::Counter, None) => metrics::describe_counter!(name, help),
            (Kind::Gauge, Some(unit)) => metrics::describe_gauge!(name, unit, help),
            (Kind::Gauge, None) => metrics::describe_gauge!(name, help),
            (Kind::Histogram, Some(unit)) => metrics::describe_histogram!(name, unit, help),
            (Kind::Histogram, None) => metrics::describe_histogram!(name, help),
        }
    }
}

pub(crate) const REQUEST_DURATION: Family = Family::seconds(
    "http_server_request_duration_seconds",
    "Duration of HTTP server requests, by route template, method and status code.",
);
pub(crate) const REQUESTS: Family = Family::counter(
    "tributary_http_requests_total",
    "HTTP requests served, by route template, method and status class.",
);
pub(crate) const ACTIVE_REQUESTS: Family = Family::gauge(
    "http_server_active_requests",
    "HTTP requests currently being served.",
);
pub(crate) const BUILD_INFO: Family = Family::gauge(
    "tributary_build_info",
    "Build information: version and git revision.",
);

/// The families this module records.
pub(crate) const FAMILIES: &[Family] = &[REQUEST_DURATION, REQUESTS, ACTIVE_REQUESTS, BUILD_INFO];

/// Installs the process's recorder (once per process; later calls return the same handle),
/// describes every family in `catalogue`, and starts the recorder's upkeep and the process
/// sampler on plain threads. Those two run for the life of the process, unlike the
/// application's tasks: they serve the `metrics` facade's global recorder, which outlives any
/// one application (tests build many) and cannot be uninstalled.
///
/// The recorder is the Prometheus one alone, or, when OTLP metrics are configured (and the
/// `otel` feature is built), a fan-out to it and to the OpenTelemetry bridge (see `otlp`).
/// The first application in a process decides which.
pub(super) fn install_recorder(
    settings: &TelemetrySettings,
    catalogue: &[&[Family]],
) -> anyhow::Result<PrometheusHandle> {
    let mut installed = PROMETHEUS.lock().unwrap_or_else(|p| p.into_inner());
    let handle = match installed.as_ref() {
        Some(h) => h.clone(),
        None => {
            let prometheus = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)?
                .build_recorder();
            let handle = prometheus.handle();
            set_global_recorder(settings, catalogue, prometheus)?;
            *installed = Some(handle.clone());
            // Histograms are kept as buckets here, so upkeep only drains internal buffers.
            let upkeep = handle.clone();
            std::thread::Builder::new()
                .name("metrics-upkeep".into())
                .spawn(move || {
                    loop {
                        std::thread::sleep(Duration::from_secs(5));
                        upkeep.run_upkeep();
                    }
                })?;
            super::runtime::spawn_process_sampler()?;
            metrics::gauge!(
                BUILD_INFO.name,
                "version" => build_info::VERSION,
                "revision" => build_info::REVISION
            )
            .set(1.0);
            handle
        }
    };
    drop(installed);
    // Descriptions are idempotent; every application built in this process describes its own
    // catalogue, which is the same one.
    for family in catalogue.iter().copied().flatten() {
        family.describe();
    }
    Ok(handle)
}

/// Installs `prometheus` as the global recorder, behind a fan-out to the OTLP bridge when
/// OTLP metrics are configured. Without them no fan-out layer is installed: recording costs
/// exactly what it did before OTLP existed.
#[cfg(feature = "otel")]
fn set_global_recorder(
    settings: &TelemetrySettings,
    catalogue: &[&[Family]],
    prometheus: PrometheusRecorder,
) -> anyhow::Result<()> {
    match super::otlp::meter_provider(&settings.otel())? {
        Some(provider) => {
            let bridge = super::otlp::OtelRecorder::new(&provider, catalogue);
            let fanout = metrics_util::layers::FanoutBuilder::default()
                .add_recorder(prometheus)
                .add_recorder(bridge)
                .build();
            metrics::set_global_recorder(fanout).map_err(|_| already_installed())?;
            super::otlp::keep_meter_provider(provider);
        }
        None => metrics::set_global_recorder(prometheus).map_err(|_| already_installed())?,
    }
    Ok(())
}

fn already_installed() -> anyhow::Error {
    anyhow::anyhow!("a metrics recorder is already installed in this process")
}

#[cfg(not(feature = "otel"))]
fn set_global_recorder(
    _: &TelemetrySettings,
    _: &[&[Family]],
    prometheus: PrometheusRecorder,
) -> anyhow::Result<()> {
    metrics::set_global_recorder(prometheus).map_err(|_| already_installed())
}

/// The HTTP method as a bounded label: the methods HTTP defines, and `_OTHER` for anything
/// else, as the OpenTelemetry HTTP conventions say (a client can send any token as a method).
pub(super) fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::CONNECT => "CONNECT",
        Method::OPTIONS => "OPTIONS",
        Method::TRACE => "TRACE",
        Method::PATCH => "PATCH",
        _ => "_OTHER",
    }
}

/// The request histogram and counter for one (route, method, status), registered on first use.
/// Going through the `metrics` macros on every request would build two label sets (allocating
/// the route and status strings) and look both up in the registry; a request instead finds its
/// handles here with one read lock and a short scan. The set is bounded: route templates times
/// the methods above times the status codes the gateway answers with.
#[derive(Default)]
pub(super) struct RequestInstruments {
    by_route: RwLock<HashMap<Box<str>, Vec<RequestHandles>>>,
}

#[derive(Clone)]
pub(super) struct RequestHandles {
    method: &'static str,
    status: u16,
    pub(super) duration: Histogram,
    pub(super) requests: Counter,
}

impl RequestInstruments {
    pub(super) fn handles(&self, route: &str, method: &'static str, status: u16) -> RequestHandles {
        let find = |handles: &[RequestHandles]| {
            handles
                .iter()
                .find(|h| h.status == status && h.method == method)
                .cloned()
        };
        // Neither lock is held across an await; a poisoned lock still holds valid handles.
        if let Some(found) = self
            .by_route
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(route)
            .and_then(|h| find(h))
        {
            return found;
        }
        let mut by_route = self.by_route.write().unwrap_or_else(|p| p.into_inner());
        let handles = by_route.entry(route.into()).or_default();
        if let Some(found) = find(handles) {
            return found;
        }
        let class = status_class(status);
        let created = RequestHandles {
            method,
            status,
            duration: metrics::histogram!(
                REQUEST_DURATION.name,
                "http_route" => route.to_owned(),
                "http_request_method" => method,
                "http_response_status_code" => status.to_string()
            ),
            requests: metrics::counter!(
                REQUESTS.name,
                "http_route" => route.to_owned(),
                "http_request_method" => method,
                "status_class" => class
            ),
        };
        handles.push(created.clone());
        created
    }
}

/// The status class label of the request counter.
fn status_class(status: u16) -> &'static str {
    match status {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}

/// The classes a route's request counter is registered with before its first request: what
/// the gateway answers (success, the caller's error, its own), so that `rate()` over any of
/// them sees the first increase and an error-ratio panel shows 0, not "no data".
const REGISTERED_CLASSES: [&str; 3] = ["2xx", "4xx", "5xx"];

/// Registers the request counter of each known (route, method) at 0 in every class of
/// [`REGISTERED_CLASSES`]. The histogram is labelled by status code, which is not known in
/// advance; it appears with its route's first answer.
pub(super) fn register_routes(routes: &[(&str, Method)]) {
    for (route, method) in routes {
        for class in REGISTERED_CLASSES {
            // The registry keeps the series; the handle is not needed.
            let _ = metrics::counter!(
                REQUESTS.name,
                "http_route" => (*route).to_owned(),
                "http_request_method" => method_label(method),
                "status_class" => class
            );
        }
    }
}

/// Counts a request as active for as long as it lives.
pub(crate) struct ActiveGuard(Gauge);

impl ActiveGuard {
    pub(super) fn new(gauge: &Gauge) -> Self {
        gauge.increment(1.0);
        Self(gauge.clone())
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_methods_are_a_bounded_label() {
        assert_eq!(method_label(&Method::GET), "GET");
        assert_eq!(method_label(&Method::PATCH), "PATCH");
        let custom = Method::from_bytes(b"PURGE").unwrap();
        assert_eq!(method_label(&custom), "_OTHER");
    }

    #[test]
    fn status_codes_fall_into_their_class() {
        assert_eq!(status_class(101), "1xx");
        assert_eq!(status_class(201), "2xx");
        assert_eq!(status_class(304), "3xx");
        assert_eq!(status_class(499), "4xx");
        assert_eq!(status_class(503), "5xx");
    }
}
