//! Logs, traces, metrics and the async runtime's own health, one module per signal:
//! - `logs`: the `tracing` subscriber, its filter and line format, over the `log_sink`
//!   that keeps workers from ever waiting on stdout;
//! - `trace`: W3C trace context in and out, and the OpenTelemetry exporter (behind the
//!   `otel` feature);
//! - `metrics`: the Prometheus recorder, the [`metrics::Family`] type every module declares
//!   its metrics with, and the per-request RED instruments;
//! - `otlp` (behind `otel`): the OpenTelemetry resource and sampler, and metrics over OTLP
//!   through a bridge from the `metrics` facade;
//! - `runtime`: runtime and process samplers, and the long-poll detector.
//!
//! This module is a leaf: it knows the configuration, the build's identity and the request
//! context, nothing that records. The modules that record metrics declare their families
//! themselves, and the application hands the catalogue to `Telemetry::new`.

mod json_lines;
mod log_sink;
pub(crate) mod logs;
pub(crate) mod metrics;
#[cfg(feature = "otel")]
pub(crate) mod otlp;
pub(crate) mod runtime;
pub(crate) mod trace;

use std::{sync::Arc, time::Duration};

use ::metrics::{Counter, Gauge};
use axum::http::Method;
use metrics_exporter_prometheus::PrometheusHandle;

pub use logs::install_subscriber;
pub(crate) use metrics::ActiveGuard;
pub use metrics::{Family, Kind};
/// The OTLP metrics bridge, public for `examples/metrics_cost.rs`, which measures it.
#[cfg(feature = "otel")]
pub use otlp::OtelRecorder;
pub(crate) use runtime::PollTimer;
#[cfg(feature = "otel")]
pub use trace::otel::tracer_provider;
pub(crate) use trace::{
    TRACEPARENT, TRACESTATE, attach_trace, local_trace_ids, otel_active, outgoing_trace_headers,
    parse_traceparent,
};

use crate::config::TelemetrySettings;
use log_sink::{LogSink, LogSinkGuard};

/// The name of the one span per request; the log layer sees no other span.
pub(crate) const REQUEST_SPAN: &str = "http.request";

/// A duration as milliseconds for a log field, to the microsecond: `1.872`, not the
/// `1.8718759999999999` of `as_secs_f64() * 1000.0`. (A division of two integers is rounded
/// once, to the double nearest the decimal, which prints as that decimal.)
pub(crate) fn millis(d: Duration) -> f64 {
    d.as_micros() as f64 / 1000.0
}

/// At most this many bytes of log lines wait in memory for the writer thread (about 10,000
/// request lines); beyond it lines are dropped and counted.
const LOG_BUFFER_BYTES: usize = 4 << 20;

/// Keeps the trace pipeline alive; flushes pending spans when dropped.
pub struct TracingGuard {
    /// Writes out buffered log lines when dropped.
    _logs: LogSinkGuard,
    #[cfg(feature = "otel")]
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Drop for TracingGuard {
    fn drop(&mut self) {
        #[cfg(feature = "otel")]
        {
            if let Some(provider) = self.provider.take() {
                let _ = provider.shutdown();
            }
            // The last metrics since the previous export, when they go over OTLP.
            otlp::shutdown_meter_provider();
        }
    }
}

/// Installs the global `tracing` subscriber: JSON or human-readable logs on stdout, and the
/// OpenTelemetry layer when an OTLP endpoint is configured. Call once, early in `main`.
pub fn init_tracing(settings: &TelemetrySettings) -> anyhow::Result<TracingGuard> {
    // Log lines never wait for stdout: see `log_sink`.
    let (writer, logs_guard) = LogSink::spawn(std::io::stdout(), LOG_BUFFER_BYTES)?;
    logs::set_sink(writer.clone());
    #[cfg(feature = "otel")]
    let provider = install_subscriber(settings, writer)?;
    #[cfg(not(feature = "otel"))]
    install_subscriber(settings, writer)?;
    Ok(TracingGuard {
        _logs: logs_guard,
        #[cfg(feature = "otel")]
        provider,
    })
}

/// Instruments shared by every request, created once.
pub(crate) struct Telemetry {
    settings: TelemetrySettings,
    handle: Option<PrometheusHandle>,
    requests: metrics::RequestInstruments,
    active: Gauge,
    long_polls: Counter,
}

impl Telemetry {
    /// Installs the Prometheus recorder (once per process) and describes every family of
    /// `catalogue`, the application's metrics.
    pub(crate) fn new(
        settings: &TelemetrySettings,
        catalogue: &[&[Family]],
    ) -> anyhow::Result<Arc<Self>> {
        let handle = if settings.metrics_enabled {
            Some(metrics::install_recorder(settings, catalogue)?)
        } else {
            None
        };
        Ok(Arc::new(Self {
            settings: settings.clone(),
            handle,
            requests: metrics::RequestInstruments::default(),
            active: ::metrics::gauge!(metrics::ACTIVE_REQUESTS.name),
            long_polls: runtime::long_polls(),
        }))
    }

    /// The Prometheus exposition; `None` when metrics are disabled.
    pub(crate) fn render_metrics(&self) -> Option<String> {
        self.handle.as_ref().map(PrometheusHandle::render)
    }

    /// Registers the RED request counter of every known (route, method) at 0, before the first
    /// request: the router calls this with its routes.
    pub(crate) fn register_routes(&self, routes: &[(&str, Method)]) {
        if self.handle.is_some() {
            metrics::register_routes(routes);
        }
    }

    /// Counts a request as active until the guard is dropped.
    pub(crate) fn active_request(&self) -> ActiveGuard {
        ActiveGuard::new(&self.active)
    }

    /// RED metrics by route template.
    pub(crate) fn record_request(
        &self,
        route: &str,
        method: &Method,
        status: u16,
        elapsed: Duration,
    ) {
        if self.handle.is_none() {
            return;
        }
        let method = metrics::method_label(method);
        let handles = self.requests.handles(route, method, status);
        handles.duration.record(elapsed.as_secs_f64());
        handles.requests.increment(1);
    }

    fn long_poll(&self, took: Duration) {
        self.long_polls.increment(1);
        tracing::warn!(
            poll_ms = millis(took),
            threshold_ms = millis(self.settings.long_poll_threshold),
            "long poll: a task held a worker thread; look for blocking calls or CPU work on the async path"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_durations_are_milliseconds_to_the_microsecond() {
        assert_eq!(
            millis(Duration::from_nanos(1_871_875_999)).to_string(),
            "1871.875"
        );
        assert_eq!(
            millis(Duration::from_nanos(54_691_400)).to_string(),
            "54.691"
        );
        assert_eq!(millis(Duration::from_nanos(1_871_876)).to_string(), "1.871");
        assert_eq!(millis(Duration::ZERO).to_string(), "0");
    }
}
