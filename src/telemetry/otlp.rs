//! OpenTelemetry's side of telemetry: the resource every signal carries, the trace sampler,
//! and metrics over OTLP through a bridge from the `metrics` facade.
//!
//! The `metrics` facade stays the one recording API. With OTLP metrics on, the global recorder
//! is a fan-out (`metrics_util::layers::Fanout`) to the Prometheus recorder and to
//! [`OtelRecorder`], which feeds an OpenTelemetry SDK meter; with them off the Prometheus
//! recorder is installed alone and nothing here runs. A bridge of our own, not a crate: the
//! maintained ones are built against older OpenTelemetry releases (a second copy of the SDK),
//! and none maps names and attributes to OpenTelemetry's conventions or reuses the
//! Prometheus side's bucket boundaries.
//!
//! Counters and gauges are atomics read by observable instruments when the SDK collects, so a
//! recording costs one atomic operation, as on the Prometheus side; histograms are the SDK's
//! own synchronous histogram, whose recording looks its attribute set up in a hash map (the
//! cost is measured in docs/observability.md).

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, OnceLock, RwLock,
        atomic::{AtomicU64, Ordering},
    },
};

use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
    SharedString, Unit,
};
use opentelemetry::{
    KeyValue,
    metrics::{Meter, MeterProvider as _},
};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::{
    Resource,
    metrics::{PeriodicReader, SdkMeterProvider},
    resource::TelemetryResourceDetector,
    trace::Sampler,
};

use super::metrics::{Family, Kind, LATENCY_BUCKETS};
use crate::{
    build_info,
    config::{OtelSettings, SamplerKind},
};

/// The meter provider of the process's OTLP metrics, for the final export at exit.
static METER_PROVIDER: Mutex<Option<SdkMeterProvider>> = Mutex::new(None);

/// This process's `service.instance.id`: one per process, shared by traces and metrics, so
/// that a backend can tell replicas (and restarts) apart.
fn instance_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| uuid::Uuid::new_v4().to_string())
}

/// The resource every exported span and metric carries: `service.name`, `service.version`,
/// `service.instance.id` (unless `OTEL_RESOURCE_ATTRIBUTES` gives one, e.g. the pod's name),
/// the attributes of `OTEL_RESOURCE_ATTRIBUTES` and the SDK's own `telemetry.sdk.*`. Built
/// from the resolved settings only: the SDK's environment detectors are not used, so that
/// the gateway's keys keep their precedence.
pub(super) fn resource(otel: &OtelSettings) -> Resource {
    let given = &otel.resource_attributes.value;
    let mut builder = Resource::builder_empty()
        .with_detector(Box::new(TelemetryResourceDetector))
        .with_attribute(KeyValue::new("service.version", build_info::VERSION));
    if !given.iter().any(|(k, _)| k == "service.instance.id") {
        builder = builder.with_attribute(KeyValue::new("service.instance.id", instance_id()));
    }
    builder
        .with_attributes(
            given
                .iter()
                .map(|(k, v)| KeyValue::new(k.clone(), v.clone())),
        )
        .with_service_name(otel.service_name.value.clone())
        .build()
}

/// The trace sampler named by the settings.
pub(super) fn sampler(otel: &OtelSettings) -> Sampler {
    let ratio = otel.sampler_ratio.value.get();
    match otel.sampler.value {
        SamplerKind::AlwaysOn => Sampler::AlwaysOn,
        SamplerKind::AlwaysOff => Sampler::AlwaysOff,
        SamplerKind::Traceidratio => Sampler::TraceIdRatioBased(ratio),
        SamplerKind::ParentbasedAlwaysOn => Sampler::ParentBased(Box::new(Sampler::AlwaysOn)),
        SamplerKind::ParentbasedAlwaysOff => Sampler::ParentBased(Box::new(Sampler::AlwaysOff)),
        SamplerKind::ParentbasedTraceidratio => {
            Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(ratio)))
        }
    }
}

/// The headers sent with every export.
pub(super) fn headers(otel: &OtelSettings) -> HashMap<String, String> {
    otel.headers
        .value
        .iter()
        .filter_map(|(k, v)| Some((k.to_string(), v.to_str().ok()?.to_owned())))
        .collect()
}

/// The OTLP/HTTP metrics pipeline, when a metrics endpoint is configured: an exporter, a
/// periodic reader on its own thread (every `otlp_metrics_interval`), and the provider.
/// Safe to call on a runtime worker: the exporter builds its blocking HTTP client on a thread
/// of its own, and the reader exports from its own thread.
pub(super) fn meter_provider(otel: &OtelSettings) -> anyhow::Result<Option<SdkMeterProvider>> {
    let Some(endpoint) = &otel.metrics_endpoint.value else {
        return Ok(None);
    };
    crate::tls::install_provider();
    let exporter = opentelemetry_otlp::MetricExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(endpoint.as_str())
        .with_headers(headers(otel))
        .build()?;
    let reader = PeriodicReader::builder(exporter)
        .with_interval(otel.metrics_interval)
        .build();
    Ok(Some(
        SdkMeterProvider::builder()
            .with_reader(reader)
            .with_resource(resource(otel))
            .build(),
    ))
}

/// Remembers the process's meter provider for [`shutdown_meter_provider`].
pub(super) fn keep_meter_provider(provider: SdkMeterProvider) {
    *METER_PROVIDER.lock().unwrap_or_else(|p| p.into_inner()) = Some(provider);
}

/// Exports what was recorded since the last export and stops the reader (at exit).
pub(super) fn shutdown_meter_provider() {
    let provider = METER_PROVIDER
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    if let Some(provider) = provider {
        let _ = provider.shutdown();
    }
}

/// How a Prometheus family is named and typed in OpenTelemetry.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct OtelName {
    pub name: String,
    pub unit: Option<&'static str>,
    /// A gauge that counts things in progress: an UpDownCounter, as the conventions want
    /// (`http.server.active_requests`).
    pub up_down: bool,
}

/// The OpenTelemetry name of a family: the semantic-convention name where one exists, else the
/// Prometheus name without the suffixes that OpenTelemetry carries elsewhere (`_total` is the
/// instrument's type, `_seconds` and `_bytes` its unit). A collector that exports to
/// Prometheus adds those suffixes back, so both routes give the same names.
pub(crate) fn otel_name(prometheus: &str, kind: Kind, unit: Option<Unit>) -> OtelName {
    match prometheus {
        "http_server_request_duration_seconds" => {
            return OtelName {
                name: "http.server.request.duration".into(),
                unit: Some("s"),
                up_down: false,
            };
        }
        "http_server_active_requests" => {
            return OtelName {
                name: "http.server.active_requests".into(),
                unit: Some("{request}"),
                up_down: true,
            };
        }
        _ => {}
    }
    let mut name = prometheus;
    if kind == Kind::Counter {
        name = name.strip_suffix("_total").unwrap_or(name);
    }
    let mut unit = unit.map(ucum);
    for (suffix, ucum) in [("_seconds", "s"), ("_bytes", "By"), ("_ratio", "1")] {
        if let Some(stripped) = name.strip_suffix(suffix) {
            name = stripped;
            unit = Some(ucum);
            break;
        }
    }
    OtelName {
        name: name.to_owned(),
        unit,
        up_down: false,
    }
}

/// A unit as UCUM writes it, as OpenTelemetry wants.
fn ucum(unit: Unit) -> &'static str {
    match unit {
        Unit::Count => "1",
        Unit::Percent => "%",
        Unit::Seconds => "s",
        Unit::Milliseconds => "ms",
        Unit::Microseconds => "us",
        Unit::Nanoseconds => "ns",
        Unit::Bytes => "By",
        Unit::Kibibytes => "KiBy",
        Unit::Mebibytes => "MiBy",
        Unit::Gibibytes => "GiBy",
        Unit::Tebibytes => "TiBy",
        Unit::BitsPerSecond => "bit/s",
        Unit::KilobitsPerSecond => "kbit/s",
        Unit::MegabitsPerSecond => "Mbit/s",
        Unit::GigabitsPerSecond => "Gbit/s",
        Unit::TerabitsPerSecond => "Tbit/s",
        Unit::CountPerSecond => "1/s",
    }
}

/// A label as an OpenTelemetry attribute: the HTTP labels under their semantic-convention
/// names (the status code as the integer the conventions define), the rest as they are.
fn attribute(key: &str, value: &str) -> KeyValue {
    match key {
        "http_route" => KeyValue::new("http.route", value.to_owned()),
        "http_request_method" => KeyValue::new("http.request.method", value.to_owned()),
        "http_response_status_code" => match value.parse::<i64>() {
            Ok(code) => KeyValue::new("http.response.status_code", code),
            Err(_) => KeyValue::new("http.response.status_code", value.to_owned()),
        },
        _ => KeyValue::new(key.to_owned(), value.to_owned()),
    }
}

fn attributes(key: &Key) -> Vec<KeyValue> {
    key.labels()
        .map(|l| attribute(l.key(), l.value()))
        .collect()
}

/// One series of a counter or gauge: its attributes and its current value (a gauge's as
/// `f64` bits), read by the instrument's callback.
type Series = Arc<RwLock<Vec<(Vec<KeyValue>, Arc<AtomicU64>)>>>;

/// A histogram series: the SDK's histogram and the series' attributes.
struct HistogramCell {
    histogram: opentelemetry::metrics::Histogram<f64>,
    attributes: Vec<KeyValue>,
}

impl HistogramFn for HistogramCell {
    fn record(&self, value: f64) {
        self.histogram.record(value, &self.attributes);
    }
}

/// What the recorder has registered: every series by key (the facade registers a key each
/// time a macro runs, so a series is looked up before it is made), and one instrument per
/// name. Behind one mutex, taken only when a handle is registered; recording never takes it.
#[derive(Default)]
struct Registered {
    counters: HashMap<Key, Arc<AtomicU64>>,
    gauges: HashMap<Key, Arc<AtomicU64>>,
    histograms: HashMap<Key, Arc<HistogramCell>>,
    /// The series list of each counter or gauge name, read by its instrument's callback.
    series: HashMap<KeyName, Series>,
    histogram_instruments: HashMap<KeyName, opentelemetry::metrics::Histogram<f64>>,
    /// The observable instruments, kept for the life of the recorder.
    observables: Vec<Box<dyn std::any::Any + Send + Sync>>,
}

/// The `metrics` recorder that feeds an OpenTelemetry meter (see the module docs).
pub struct OtelRecorder {
    meter: Meter,
    /// The catalogue, by Prometheus name: each instrument's type, unit and description.
    families: HashMap<&'static str, Family>,
    registered: Mutex<Registered>,
}

/// Where the callbacks of counters and gauges cast their values.
#[derive(Clone, Copy)]
enum Observed {
    Counter,
    Gauge,
}

impl OtelRecorder {
    /// A recorder feeding `provider`'s meter, describing each instrument from `catalogue`.
    pub fn new(provider: &SdkMeterProvider, catalogue: &[&[Family]]) -> Self {
        Self {
            meter: provider.meter("tributary"),
            families: catalogue
                .iter()
                .copied()
                .flatten()
                .map(|f| (f.name, *f))
                .collect(),
            registered: Mutex::default(),
        }
    }

    /// The instrument's name, unit and description: from the catalogue, or (for a name not
    /// in it, which a test rules out) from the name alone.
    fn describe(&self, key: &KeyName, kind: Kind) -> (OtelName, &'static str) {
        match self.families.get(key.as_str()) {
            Some(family) => (
                otel_name(family.name, family.kind, family.unit()),
                family.help,
            ),
            None => (otel_name(key.as_str(), kind, None), ""),
        }
    }

    /// The value cell of a counter or gauge series, made (with its name's instrument, the
    /// first time) when new.
    fn cell(&self, key: &Key, observed: Observed) -> Arc<AtomicU64> {
        let mut registered = self.registered.lock().unwrap_or_else(|p| p.into_inner());
        let by_key = match observed {
            Observed::Counter => &registered.counters,
            Observed::Gauge => &registered.gauges,
        };
        if let Some(cell) = by_key.get(key) {
            return Arc::clone(cell);
        }
        let cell = Arc::new(AtomicU64::new(0));
        let name = key.name_shared();
        let series = match registered.series.get(&name) {
            Some(series) => Arc::clone(series),
            None => {
                let series = Series::default();
                let instrument = self.observable(&name, observed, Arc::clone(&series));
                registered.observables.push(instrument);
                registered.series.insert(name, Arc::clone(&series));
                series
            }
        };
        series
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .push((attributes(key), Arc::clone(&cell)));
        match observed {
            Observed::Counter => registered.counters.insert(key.clone(), Arc::clone(&cell)),
            Observed::Gauge => registered.gauges.insert(key.clone(), Arc::clone(&cell)),
        };
        cell
    }

    fn observable(
        &self,
        name: &KeyName,
        observed: Observed,
        series: Series,
    ) -> Box<dyn std::any::Any + Send + Sync> {
        let kind = match observed {
            Observed::Counter => Kind::Counter,
            Observed::Gauge => Kind::Gauge,
        };
        let (otel, help) = self.describe(name, kind);
        let read = move || series.read().unwrap_or_else(|p| p.into_inner()).clone();
        macro_rules! build {
            ($builder:expr, $value:expr) => {{
                let mut b = $builder.with_description(help);
                if let Some(unit) = otel.unit {
                    b = b.with_unit(unit);
                }
                Box::new(
                    b.with_callback(move |observer| {
                        for (attributes, value) in read() {
                            observer.observe($value(value.load(Ordering::Relaxed)), &attributes);
                        }
                    })
                    .build(),
                )
            }};
        }
        match observed {
            Observed::Counter => build!(self.meter.u64_observable_counter(otel.name), |v| v),
            Observed::Gauge if otel.up_down => build!(
                self.meter.f64_observable_up_down_counter(otel.name),
                f64::from_bits
            ),
            Observed::Gauge => build!(self.meter.f64_observable_gauge(otel.name), f64::from_bits),
        }
    }
}

impl Recorder for OtelRecorder {
    // The catalogue describes every instrument when it is made; later descriptions add nothing.
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let cell = self.cell(key, Observed::Counter);
        // The cell is the counter's value: the same atomic the callback reads.
        Counter::from_arc(Arc::new(CounterRef(cell)))
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(Arc::new(GaugeRef(self.cell(key, Observed::Gauge))))
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        let mut registered = self.registered.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(cell) = registered.histograms.get(key) {
            return Histogram::from_arc(Arc::clone(cell));
        }
        let name = key.name_shared();
        let histogram = match registered.histogram_instruments.get(&name) {
            Some(h) => h.clone(),
            None => {
                let (otel, help) = self.describe(&name, Kind::Histogram);
                let mut builder = self.meter.f64_histogram(otel.name).with_description(help);
                if let Some(unit) = otel.unit {
                    builder = builder.with_unit(unit);
                }
                // The same boundaries as the Prometheus side gives every `_seconds` name.
                if name.as_str().ends_with("_seconds") {
                    builder = builder.with_boundaries(LATENCY_BUCKETS.to_vec());
                }
                let h = builder.build();
                registered.histogram_instruments.insert(name, h.clone());
                h
            }
        };
        let cell = Arc::new(HistogramCell {
            histogram,
            attributes: attributes(key),
        });
        registered.histograms.insert(key.clone(), Arc::clone(&cell));
        Histogram::from_arc(cell)
    }
}

/// A counter handle over a series' cell.
struct CounterRef(Arc<AtomicU64>);

impl CounterFn for CounterRef {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::Relaxed);
    }

    fn absolute(&self, value: u64) {
        self.0.fetch_max(value, Ordering::Relaxed);
    }
}

/// A gauge handle over a series' cell (`f64` bits).
struct GaugeRef(Arc<AtomicU64>);

impl GaugeRef {
    fn update(&self, f: impl Fn(f64) -> f64) {
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some(f(f64::from_bits(bits)).to_bits())
            });
    }
}

impl GaugeFn for GaugeRef {
    fn increment(&self, value: f64) {
        self.update(|v| v + value);
    }

    fn decrement(&self, value: f64) {
        self.update(|v| v - value);
    }

    fn set(&self, value: f64) {
        self.0.store(value.to_bits(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_conventions_where_they_exist_and_drop_the_unit_suffixes_elsewhere() {
        let name = |n, k, u| {
            let o = otel_name(n, k, u);
            (o.name, o.unit, o.up_down)
        };
        assert_eq!(
            name(
                "http_server_request_duration_seconds",
                Kind::Histogram,
                Some(Unit::Seconds)
            ),
            ("http.server.request.duration".into(), Some("s"), false)
        );
        assert_eq!(
            name("http_server_active_requests", Kind::Gauge, None),
            (
                "http.server.active_requests".into(),
                Some("{request}"),
                true
            )
        );
        assert_eq!(
            name("tributary_http_requests_total", Kind::Counter, None),
            ("tributary_http_requests".into(), None, false)
        );
        assert_eq!(
            name("process_cpu_seconds_total", Kind::Counter, None),
            ("process_cpu".into(), Some("s"), false)
        );
        assert_eq!(
            name(
                "process_resident_memory_bytes",
                Kind::Gauge,
                Some(Unit::Bytes)
            ),
            ("process_resident_memory".into(), Some("By"), false)
        );
        assert_eq!(
            name("tributary_runtime_worker_busy_ratio", Kind::Gauge, None),
            ("tributary_runtime_worker_busy".into(), Some("1"), false)
        );
    }

    #[test]
    fn http_labels_become_semantic_convention_attributes() {
        assert_eq!(
            attribute("http_response_status_code", "503"),
            KeyValue::new("http.response.status_code", 503_i64)
        );
        assert_eq!(
            attribute("http_route", "/a/{id}"),
            KeyValue::new("http.route", "/a/{id}")
        );
        assert_eq!(
            attribute("service", "carts"),
            KeyValue::new("service", "carts")
        );
    }
}
