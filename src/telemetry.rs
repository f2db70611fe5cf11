//! Logs, traces, metrics and the async runtime's own health.
//!
//! The Java teams in the field reports watched active virtual threads, pinned-carrier events,
//! carrier utilisation, semaphore queues and pool waiters. The async-Rust equivalents live here:
//! - per-worker busy ratio (carrier utilisation), poll counts, alive tasks, queue depths and the
//!   blocking pool, sampled from the runtime's own metrics once a second;
//! - scheduling lag, measured by a heartbeat task that asks to wake every 100 ms and records
//!   how late it actually ran (a saturated or blocked runtime wakes it late);
//! - long polls: [`PollTimer`] times every poll of a request's future, and a poll that holds a
//!   worker longer than `telemetry.long_poll_threshold` — a blocking call, a lock held around
//!   slow work, a CPU-heavy loop — is counted and logged *inside the request's span*, so the
//!   offending route and request can be found (the analogue of `-Djdk.tracePinnedThreads`).
//!
//! Metrics go through the `metrics` facade into a Prometheus recorder rendered by our own
//! `/metrics` route; with `telemetry.metrics_enabled = false` no recorder is installed and every
//! instrument is a no-op, which is how the benchmark lab measures instrumentation cost.

use std::{
    collections::HashMap,
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex, OnceLock, RwLock},
    task::{Context, Poll},
    time::Duration,
};

use axum::http::{HeaderMap, Method};
use metrics::{
    Counter, Gauge, Histogram, Unit, describe_counter, describe_gauge, describe_histogram,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::time::Instant;
use tracing_subscriber::{
    EnvFilter, Layer,
    filter::{FilterExt, Targets, filter_fn},
    fmt::MakeWriter,
    layer::SubscriberExt,
    registry::LookupSpan,
    util::SubscriberInitExt,
};

use crate::{
    build_info,
    config::{LogFormat, TelemetrySettings},
    context::TraceIds,
};

/// Latency buckets that resolve both 1 ms and 1 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// The installed Prometheus recorder: the `metrics` facade has one global recorder per process.
/// A mutex, not a `OnceLock`, because installing can fail and check-then-install must be atomic
/// when several applications start at once (tests do); nothing awaits while it is held.
static PROMETHEUS: Mutex<Option<PrometheusHandle>> = Mutex::new(None);

mod log_sink;

use log_sink::{LogSink, LogSinkGuard};

/// The process's log sink, for the count of lines it dropped because its buffer was full.
static LOG_SINK: OnceLock<LogSink> = OnceLock::new();

/// At most this many bytes of log lines wait in memory for the writer thread (about 10,000
/// request lines); beyond it lines are dropped and counted.
const LOG_BUFFER_BYTES: usize = 4 << 20;

/// Process-wide flag: whether spans are exported through OpenTelemetry.
static OTEL_ACTIVE: OnceLock<bool> = OnceLock::new();

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
        if let Some(provider) = self.provider.take() {
            let _ = provider.shutdown();
        }
    }
}

/// The name of the one span per request; the log layer sees no other span.
pub const REQUEST_SPAN: &str = "http.request";

/// Installs the global `tracing` subscriber: JSON or human-readable logs on stdout, and the
/// OpenTelemetry layer when an OTLP endpoint is configured. Call once, early in `main`.
pub fn init_tracing(settings: &TelemetrySettings) -> anyhow::Result<TracingGuard> {
    // Log lines never wait for stdout: see `log_sink`.
    let (writer, logs_guard) = LogSink::spawn(std::io::stdout(), LOG_BUFFER_BYTES)?;
    let _ = LOG_SINK.set(writer.clone());
    #[cfg_attr(not(feature = "otel"), allow(unused_variables))]
    let provider = install_subscriber(settings, writer)?;
    Ok(TracingGuard {
        _logs: logs_guard,
        #[cfg(feature = "otel")]
        provider,
    })
}

#[cfg(feature = "otel")]
type TracerProvider = Option<opentelemetry_sdk::trace::SdkTracerProvider>;
#[cfg(not(feature = "otel"))]
type TracerProvider = ();

/// Installs the subscriber with logs going to `writer` (`main` passes the log sink on stdout,
/// tests a buffer) and returns the trace pipeline to keep alive.
///
/// Logs see events and the request span, nothing else: the per-call and per-query spans exist
/// for traces, and formatting their fields on every request for log lines that never show them
/// was most of the cost of logging (measured with `bench/run instrumentation`). An event inside
/// a downstream call still carries the request span's fields (request id, trace id, route).
///
/// Without OpenTelemetry the filters are global, so the per-call spans are disabled at their
/// call sites and cost nothing, and entering the request span on every poll touches no filter
/// state. With it, each layer has its own filter: the log level governs log lines, the sampler
/// governs traces, and `log_level = "warn"` does not silently turn tracing off.
///
/// JSON lines are written by `json-subscriber`, which keeps each span's fields serialised once
/// instead of re-parsing them for every line.
pub fn install_subscriber<W>(
    settings: &TelemetrySettings,
    writer: W,
) -> anyhow::Result<TracerProvider>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let directives = std::env::var("RUST_LOG")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| settings.log_level.clone());
    let filter = LogFilter::parse(&directives)?;
    let only_request_span = filter_fn(|meta| !meta.is_span() || meta.name() == REQUEST_SPAN);

    #[cfg(feature = "otel")]
    if let Some(endpoint) = &settings.otlp_endpoint {
        let (otel_layer, provider) = otel::layer(settings, endpoint)?;
        let log_filter = match filter {
            LogFilter::Targets(t) => FilterExt::boxed(t),
            LogFilter::Env(e) => FilterExt::boxed(e),
        };
        let _ = OTEL_ACTIVE.set(true);
        tracing_subscriber::registry()
            .with(
                log_format_layer(settings.log_format, writer)
                    .with_filter(log_filter.and(only_request_span)),
            )
            .with(otel_layer.with_filter(tracing_subscriber::filter::LevelFilter::INFO))
            .try_init()
            .map_err(|e| anyhow::anyhow!("a tracing subscriber is already installed: {e}"))?;
        return Ok(Some(provider));
    }
    let _ = OTEL_ACTIVE.set(false);
    let (targets, env) = match filter {
        LogFilter::Targets(t) => (Some(t), None),
        LogFilter::Env(e) => (None, Some(e)),
    };
    tracing_subscriber::registry()
        .with(targets)
        .with(env)
        .with(only_request_span)
        .with(log_format_layer(settings.log_format, writer))
        .try_init()
        .map_err(|e| anyhow::anyhow!("a tracing subscriber is already installed: {e}"))?;
    #[cfg(feature = "otel")]
    return Ok(None);
    #[cfg(not(feature = "otel"))]
    Ok(())
}

/// The log filter. Plain `target=level` directives (the shipped `info`, or `warn,tributary=debug`)
/// become a `Targets` filter, which decides per call site once and never looks at a span on
/// enter or exit; directives that need `EnvFilter`'s span and field matching still work, at
/// that filter's cost.
#[allow(clippy::large_enum_variant)] // built once at start-up and moved into the subscriber
enum LogFilter {
    Targets(Targets),
    Env(EnvFilter),
}

impl LogFilter {
    fn parse(directives: &str) -> anyhow::Result<Self> {
        if let Ok(targets) = directives.parse::<Targets>() {
            return Ok(Self::Targets(targets));
        }
        EnvFilter::try_new(directives)
            .map(Self::Env)
            .map_err(|e| anyhow::anyhow!("telemetry.log_level is not a valid filter: {e}"))
    }
}

fn log_format_layer<S, W>(format: LogFormat, writer: W) -> Box<dyn Layer<S> + Send + Sync + 'static>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    match format {
        LogFormat::Json => json_subscriber::fmt::layer()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .with_writer(writer)
            .boxed(),
        LogFormat::Pretty => tracing_subscriber::fmt::layer()
            .compact()
            // Colours for a terminal, plain text when stdout is a file or a pipe.
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
            .with_writer(writer)
            .boxed(),
    }
}

/// Whether spans are exported through OpenTelemetry (an OTLP endpoint is configured).
pub fn otel_active() -> bool {
    OTEL_ACTIVE.get().copied().unwrap_or(false)
}

/// A parsed W3C `traceparent`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: String,
    pub parent_id: String,
    pub sampled: bool,
}

/// Parses `traceparent` (version 00), rejecting malformed or all-zero ids as the spec requires.
pub fn parse_traceparent(headers: &HeaderMap) -> Option<TraceParent> {
    let v = headers.get("traceparent")?.to_str().ok()?;
    let mut parts = v.trim().split('-');
    let (version, trace_id, parent_id, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
            && s.bytes().any(|b| b != b'0')
    };
    if version != "00" || parts.next().is_some() || !hex(trace_id, 32) || !hex(parent_id, 16) {
        return None;
    }
    let flags = u8::from_str_radix(flags, 16).ok()?;
    Some(TraceParent {
        trace_id: trace_id.to_owned(),
        parent_id: parent_id.to_owned(),
        sampled: flags & 1 == 1,
    })
}

fn random_hex(bytes: usize) -> String {
    use rand::RngCore;
    let mut buf = [0u8; 16];
    rand::rng().fill_bytes(&mut buf[..bytes]);
    hex::encode(&buf[..bytes])
}

/// W3C trace headers for an outgoing call made now: the current span's ids when spans are
/// exported (so the callee's spans hang under this call's span), the request's otherwise; the
/// caller's `tracestate` is passed on either way.
pub fn outgoing_trace_headers() -> (Option<String>, Option<String>) {
    let ctx = crate::context::current();
    let tracestate = ctx.as_ref().and_then(|c| c.trace.tracestate.clone());
    #[cfg(feature = "otel")]
    if otel_active()
        && let Some(tp) = otel::current_traceparent()
    {
        return (Some(tp), tracestate);
    }
    (ctx.map(|c| c.traceparent()), tracestate)
}

/// Links `span` to the caller's trace and returns the ids the exported span got, when spans are
/// exported; `None` otherwise (use [`local_trace_ids`]).
pub fn attach_trace(span: &tracing::Span, headers: &HeaderMap) -> Option<TraceIds> {
    #[cfg(feature = "otel")]
    if otel_active() {
        return otel::attach(span, headers);
    }
    let _ = (span, headers);
    None
}

/// Trace ids for a request when spans are not exported: the caller's trace id (or a new one),
/// a new span id for this hop, and the caller's `tracestate` passed on. They go into logs and
/// into the `traceparent` of every downstream call, so traces still join up across services.
pub fn local_trace_ids(incoming: Option<&TraceParent>, headers: &HeaderMap) -> TraceIds {
    let tracestate = incoming
        .and(headers.get("tracestate"))
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    TraceIds {
        trace_id: incoming.map_or_else(|| random_hex(16), |t| t.trace_id.clone()),
        span_id: random_hex(8),
        sampled: incoming.is_none_or(|t| t.sampled),
        tracestate,
    }
}

/// Instruments shared by every request, created once.
pub struct Telemetry {
    settings: TelemetrySettings,
    handle: Option<PrometheusHandle>,
    requests: RequestInstruments,
    /// The dashboard fan-out's critical-path counters and overhead histogram.
    pub fanout: crate::fanout::FanoutMetrics,
    active: Gauge,
    long_polls: Counter,
}

impl Telemetry {
    /// Installs the Prometheus recorder (once per process) and describes every metric.
    pub fn new(settings: &TelemetrySettings) -> anyhow::Result<Arc<Self>> {
        let handle = if settings.metrics_enabled {
            Some(install_recorder()?)
        } else {
            None
        };
        Ok(Arc::new(Self {
            settings: settings.clone(),
            handle,
            requests: RequestInstruments::default(),
            fanout: crate::fanout::FanoutMetrics::new(),
            active: metrics::gauge!("http_server_active_requests"),
            long_polls: metrics::counter!("tributary_runtime_long_polls_total"),
        }))
    }

    pub fn render_metrics(&self) -> Option<String> {
        self.handle.as_ref().map(PrometheusHandle::render)
    }

    /// Counts a request as active until the guard is dropped.
    pub fn active_request(&self) -> ActiveGuard<'_> {
        self.active.increment(1.0);
        ActiveGuard(&self.active)
    }

    /// RED metrics by route template.
    pub fn record_request(&self, route: &str, method: &Method, status: u16, elapsed: Duration) {
        if self.handle.is_none() {
            return;
        }
        let method = method_label(method);
        let handles = self.requests.handles(route, method, status);
        handles.duration.record(elapsed.as_secs_f64());
        handles.requests.increment(1);
    }

    fn long_poll(&self, took: Duration) {
        self.long_polls.increment(1);
        tracing::warn!(
            poll_ms = took.as_secs_f64() * 1000.0,
            threshold_ms = self.settings.long_poll_threshold.as_secs_f64() * 1000.0,
            "long poll: a task held a worker thread; look for blocking calls or CPU work on the async path"
        );
    }
}

/// The HTTP method as a bounded label: the methods HTTP defines, and `_OTHER` for anything
/// else, as the OpenTelemetry HTTP conventions say (a client can send any token as a method).
fn method_label(method: &Method) -> &'static str {
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
struct RequestInstruments {
    by_route: RwLock<HashMap<Box<str>, Vec<RequestHandles>>>,
}

#[derive(Clone)]
struct RequestHandles {
    method: &'static str,
    status: u16,
    duration: Histogram,
    requests: Counter,
}

impl RequestInstruments {
    fn handles(&self, route: &str, method: &'static str, status: u16) -> RequestHandles {
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
        let class = match status {
            100..=199 => "1xx",
            200..=299 => "2xx",
            300..=399 => "3xx",
            400..=499 => "4xx",
            _ => "5xx",
        };
        let created = RequestHandles {
            method,
            status,
            duration: metrics::histogram!(
                "http_server_request_duration_seconds",
                "http_route" => route.to_owned(),
                "http_request_method" => method,
                "http_response_status_code" => status.to_string()
            ),
            requests: metrics::counter!(
                "tributary_http_requests_total",
                "http_route" => route.to_owned(),
                "http_request_method" => method,
                "status_class" => class
            ),
        };
        handles.push(created.clone());
        created
    }
}

pub struct ActiveGuard<'a>(&'a Gauge);

impl Drop for ActiveGuard<'_> {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
}

pin_project_lite::pin_project! {
    /// Times each poll of the inner future; a poll longer than the threshold is a worker thread
    /// held hostage, and is reported from inside the request's span.
    pub struct PollTimer<'a, F> {
        #[pin]
        inner: F,
        telemetry: &'a Telemetry,
    }
}

impl<'a, F> PollTimer<'a, F> {
    pub fn new(inner: F, telemetry: &'a Telemetry) -> Self {
        Self { inner, telemetry }
    }
}

impl<F: Future> Future for PollTimer<'_, F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let started = std::time::Instant::now();
        let result = this.inner.poll(cx);
        let took = started.elapsed();
        if took >= this.telemetry.settings.long_poll_threshold {
            this.telemetry.long_poll(took);
        }
        result
    }
}

fn install_recorder() -> anyhow::Result<PrometheusHandle> {
    let mut installed = PROMETHEUS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(h) = installed.as_ref() {
        return Ok(h.clone());
    }
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)?
        .install_recorder()?;
    *installed = Some(handle.clone());
    drop(installed);
    describe_all();
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
    std::thread::Builder::new()
        .name("process-metrics".into())
        .spawn(process::sample_forever)?;
    metrics::gauge!(
        "tributary_build_info",
        "version" => build_info::VERSION,
        "revision" => build_info::REVISION
    )
    .set(1.0);
    Ok(handle)
}

fn describe_all() {
    describe_counter!(
        "tributary_log_lines_dropped_total",
        "Log lines dropped because the log sink's buffer was full (stdout not keeping up)."
    );
    describe_histogram!(
        "http_server_request_duration_seconds",
        Unit::Seconds,
        "Duration of HTTP server requests, by route template, method and status code."
    );
    describe_counter!(
        "tributary_http_requests_total",
        "HTTP requests served, by route template, method and status class."
    );
    describe_gauge!(
        "http_server_active_requests",
        "HTTP requests currently being served."
    );
    describe_gauge!(
        "tributary_admission_permits_in_use",
        "Admission permits held by in-flight requests, per route group."
    );
    describe_gauge!(
        "tributary_admission_limit",
        "Current admission limit per route group (static, or the adaptive limit)."
    );
    describe_histogram!(
        "tributary_admission_wait_seconds",
        Unit::Seconds,
        "Time requests waited for an admission permit."
    );
    describe_counter!(
        "tributary_admission_rejections_total",
        "Requests rejected with 503 by admission control, by group and reason."
    );
    describe_gauge!(
        "tributary_admission_shedding",
        "1 while admission has been shedding heavily (readiness is false), else 0."
    );
    describe_counter!(
        "tributary_ratelimit_rejections_total",
        "Requests rejected with 429 by per-client rate limiting, by backend."
    );
    describe_counter!(
        "tributary_ratelimit_redis_fallbacks_total",
        "Rate-limit decisions that fell back to the local limiter because Redis was slow or down."
    );
    describe_histogram!(
        "tributary_ratelimit_redis_duration_seconds",
        Unit::Seconds,
        "Duration of Redis rate-limit decisions, by outcome (ok, error, timeout)."
    );
    describe_gauge!(
        "tributary_ratelimit_local_keys",
        "Clients tracked by this replica's local rate limiter after the last sweep."
    );
    describe_histogram!(
        "tributary_downstream_request_duration_seconds",
        Unit::Seconds,
        "Duration of downstream calls, by service and outcome."
    );
    describe_counter!(
        "tributary_downstream_requests_total",
        "Downstream calls by service and outcome (ok, error, timeout, shed, circuit_open, budget_exhausted)."
    );
    describe_gauge!(
        "tributary_downstream_in_flight",
        "Downstream calls in flight per service (bulkhead occupancy)."
    );
    describe_gauge!(
        "tributary_downstream_circuit_state",
        "Circuit breaker state per service: 0 closed, 1 half-open, 2 open."
    );
    describe_counter!(
        "tributary_downstream_retries_total",
        "Retried downstream calls per service."
    );
    describe_counter!(
        "tributary_downstream_hedges_total",
        "Hedged second requests sent per service."
    );
    describe_gauge!(
        "tributary_db_pool_connections",
        "Database pool connections by state (idle, in_use)."
    );
    describe_gauge!(
        "tributary_db_pool_max_connections",
        "Configured maximum size of the database pool."
    );
    describe_gauge!(
        "tributary_db_pool_waiters",
        "Tasks currently waiting to acquire a database connection."
    );
    describe_histogram!(
        "tributary_db_pool_acquire_wait_seconds",
        Unit::Seconds,
        "Time spent waiting for a pooled database connection (acquires that reused one)."
    );
    describe_histogram!(
        "tributary_db_pool_connect_duration_seconds",
        Unit::Seconds,
        "Time of request acquires that had to open a new database connection (connections opened in the background for min_connections are not requests' latency and are not included)."
    );
    describe_counter!(
        "tributary_db_pool_acquire_timeouts_total",
        "Acquires that gave up waiting for a database connection."
    );
    describe_histogram!(
        "tributary_db_query_duration_seconds",
        Unit::Seconds,
        "Database statement latency by statement name."
    );
    describe_counter!(
        "tributary_fanout_critical_path_total",
        "Dashboard requests by the part that was slowest (the critical path)."
    );
    describe_histogram!(
        "tributary_fanout_gateway_overhead_seconds",
        Unit::Seconds,
        "Request time minus the slowest part: the gateway's own overhead."
    );
    describe_counter!(
        "tributary_fanout_degraded_total",
        "Optional dashboard parts returned as null, by part and reason."
    );
    describe_gauge!("tributary_runtime_workers", "Tokio worker threads.");
    describe_gauge!(
        "tributary_runtime_worker_busy_ratio",
        "Share of the last sampling interval each worker spent busy (carrier utilisation)."
    );
    describe_counter!(
        "tributary_runtime_polls_total",
        "Task polls across all workers."
    );
    describe_counter!(
        "tributary_runtime_long_polls_total",
        "Polls of request futures that held a worker longer than telemetry.long_poll_threshold."
    );
    describe_gauge!(
        "tributary_runtime_blocking_threads",
        "Threads in the blocking pool."
    );
    describe_gauge!(
        "tributary_runtime_blocking_queue_depth",
        "Tasks queued for the blocking pool."
    );
    describe_gauge!(
        "tributary_runtime_alive_tasks",
        "Tasks alive in the runtime."
    );
    describe_gauge!(
        "tributary_runtime_global_queue_depth",
        "Tasks waiting in the runtime's global (injection) queue."
    );
    describe_histogram!(
        "tributary_runtime_scheduling_lag_seconds",
        Unit::Seconds,
        "How late a 100 ms heartbeat timer task actually ran."
    );
    describe_gauge!(
        "tributary_build_info",
        "Build information: version and git revision."
    );
    describe_gauge!(
        "process_resident_memory_bytes",
        Unit::Bytes,
        "Resident memory size in bytes."
    );
    describe_counter!(
        "process_cpu_seconds_total",
        Unit::Seconds,
        "Total user and system CPU time spent in seconds."
    );
    describe_gauge!("process_open_fds", "Number of open file descriptors.");
    describe_gauge!(
        "process_max_fds",
        "Maximum number of open file descriptors."
    );
    describe_gauge!(
        "process_start_time_seconds",
        Unit::Seconds,
        "Start time of the process since unix epoch in seconds."
    );
}

/// Starts the once-a-second samplers of the current runtime and, if given, the pool gauges.
/// They stop when `shutdown` resolves.
pub fn spawn_runtime_samplers(
    db: Option<crate::db::Db>,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let heartbeat_stop = shutdown.clone();
    tokio::spawn(async move {
        let lag = metrics::histogram!("tributary_runtime_scheduling_lag_seconds");
        let period = Duration::from_millis(100);
        loop {
            let expected = Instant::now() + period;
            tokio::select! {
                _ = heartbeat_stop.cancelled() => return,
                _ = tokio::time::sleep_until(expected) => {}
            }
            lag.record(
                Instant::now()
                    .saturating_duration_since(expected)
                    .as_secs_f64(),
            );
        }
    });
    tokio::spawn(async move {
        let handle = tokio::runtime::Handle::current();
        let rt = handle.metrics();
        let workers = rt.num_workers();
        let busy_gauges: Vec<Gauge> = (0..workers)
            .map(|w| metrics::gauge!("tributary_runtime_worker_busy_ratio", "worker" => w.to_string()))
            .collect();
        let polls: Counter = metrics::counter!("tributary_runtime_polls_total");
        let workers_gauge = metrics::gauge!("tributary_runtime_workers");
        let alive = metrics::gauge!("tributary_runtime_alive_tasks");
        let global = metrics::gauge!("tributary_runtime_global_queue_depth");
        let blocking = metrics::gauge!("tributary_runtime_blocking_threads");
        let blocking_queue = metrics::gauge!("tributary_runtime_blocking_queue_depth");
        let log_drops = metrics::counter!("tributary_log_lines_dropped_total");
        let mut last_busy: Vec<Duration> = (0..workers)
            .map(|w| rt.worker_total_busy_duration(w))
            .collect();
        let mut last_polls: u64 = (0..workers).map(|w| rt.worker_poll_count(w)).sum();
        let mut last = Instant::now();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            let elapsed = last.elapsed().as_secs_f64().max(1e-3);
            last = Instant::now();
            workers_gauge.set(workers as f64);
            for (w, gauge) in busy_gauges.iter().enumerate() {
                let busy = rt.worker_total_busy_duration(w);
                let delta = busy.saturating_sub(last_busy[w]).as_secs_f64();
                last_busy[w] = busy;
                gauge.set((delta / elapsed).min(1.0));
            }
            let total_polls: u64 = (0..workers).map(|w| rt.worker_poll_count(w)).sum();
            polls.increment(total_polls.saturating_sub(last_polls));
            last_polls = total_polls;
            alive.set(rt.num_alive_tasks() as f64);
            global.set(rt.global_queue_depth() as f64);
            blocking.set(rt.num_blocking_threads() as f64);
            blocking_queue.set(rt.blocking_queue_depth() as f64);
            if let Some(sink) = LOG_SINK.get() {
                log_drops.absolute(sink.dropped_lines());
            }
            if let Some(db) = &db {
                db.record_pool_gauges();
            }
        }
    });
}

/// Process metrics read from `/proc` on a plain thread (file reads never touch a worker).
mod process {
    use std::time::Duration;

    pub fn sample_forever() {
        let rss = metrics::gauge!("process_resident_memory_bytes");
        let cpu = metrics::counter!("process_cpu_seconds_total");
        let fds = metrics::gauge!("process_open_fds");
        let max_fds = metrics::gauge!("process_max_fds");
        let start = metrics::gauge!("process_start_time_seconds");
        let ticks = 100.0; // USER_HZ on Linux
        let page = 4096.0;
        let boot = boot_time();
        loop {
            if let Ok(stat) = std::fs::read_to_string("/proc/self/stat") {
                // Fields after the command name, which is in parentheses and may contain spaces.
                if let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) {
                    let f: Vec<&str> = rest.split_whitespace().collect();
                    let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
                    // rest starts at field 3 (state): utime=14, stime=15, starttime=22, rss=24.
                    // A Prometheus counter through the `metrics` facade is an integer: whole
                    // CPU seconds, which is what rate() over minutes needs.
                    let total_ticks = num(11) + num(12);
                    cpu.absolute((total_ticks as f64 / ticks) as u64);
                    rss.set(num(21) as f64 * page);
                    if let Some(boot) = boot {
                        start.set(boot + num(19) as f64 / ticks);
                    }
                }
            }
            if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
                fds.set(dir.count() as f64);
            }
            if let Ok(limits) = std::fs::read_to_string("/proc/self/limits")
                && let Some(line) = limits.lines().find(|l| l.starts_with("Max open files"))
                && let Some(v) = line
                    .split_whitespace()
                    .nth(3)
                    .and_then(|v| v.parse::<f64>().ok())
            {
                max_fds.set(v);
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    }

    fn boot_time() -> Option<f64> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let btime = stat.lines().find_map(|l| l.strip_prefix("btime "))?;
        btime.trim().parse().ok()
    }
}

#[cfg(feature = "otel")]
mod otel {
    use axum::http::HeaderMap;
    use opentelemetry::{
        propagation::{Extractor, TextMapPropagator},
        trace::{TraceContextExt, TracerProvider as _},
    };
    use opentelemetry_otlp::{Protocol, WithExportConfig};
    use opentelemetry_sdk::{
        Resource,
        propagation::TraceContextPropagator,
        trace::{BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider},
    };
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use crate::{config::TelemetrySettings, context::TraceIds};

    pub fn layer<S>(
        settings: &TelemetrySettings,
        endpoint: &str,
    ) -> anyhow::Result<(
        tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::Tracer>,
        SdkTracerProvider,
    )>
    where
        S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
    {
        let endpoint = endpoint.trim_end_matches('/');
        let url = if endpoint.ends_with("/v1/traces") {
            endpoint.to_owned()
        } else {
            format!("{endpoint}/v1/traces")
        };
        crate::downstream::install_tls_provider();
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(url)
            .build()?;
        let processor = BatchSpanProcessor::builder(exporter)
            .with_batch_config(
                BatchConfigBuilder::default()
                    .with_scheduled_delay(std::time::Duration::from_millis(500))
                    .with_max_queue_size(8192)
                    .build(),
            )
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                settings.sampling_ratio,
            ))))
            .with_resource(
                Resource::builder()
                    .with_service_name(settings.service_name.clone())
                    .build(),
            )
            .build();
        let tracer = provider.tracer("tributary");
        Ok((
            tracing_opentelemetry::layer()
                .with_tracer(tracer)
                .with_error_records_to_exceptions(true),
            provider,
        ))
    }

    struct Headers<'a>(&'a HeaderMap);

    impl Extractor for Headers<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).and_then(|v| v.to_str().ok())
        }
        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(|k| k.as_str()).collect()
        }
    }

    /// Parents `span` on the incoming W3C context and reads back its ids.
    pub fn attach(span: &tracing::Span, headers: &HeaderMap) -> Option<TraceIds> {
        let parent = TraceContextPropagator::new().extract(&Headers(headers));
        let _ = span.set_parent(parent);
        let cx = span.context();
        let sc = cx.span().span_context().clone();
        let tracestate = sc.trace_state().header();
        sc.is_valid().then(|| TraceIds {
            trace_id: sc.trace_id().to_string(),
            span_id: sc.span_id().to_string(),
            sampled: sc.is_sampled(),
            tracestate: (!tracestate.is_empty()).then_some(tracestate),
        })
    }

    pub fn current_traceparent() -> Option<String> {
        let cx = tracing::Span::current().context();
        let sc = cx.span().span_context().clone();
        sc.is_valid().then(|| {
            format!(
                "00-{}-{}-{}",
                sc.trace_id(),
                sc.span_id(),
                if sc.is_sampled() { "01" } else { "00" }
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(tp: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("traceparent", tp.parse().unwrap());
        h
    }

    #[test]
    fn plain_directives_get_the_cheap_filter_and_span_directives_still_work() {
        for plain in ["info", "warn,tributary=debug", "tributary::http=trace,off"] {
            assert!(
                matches!(LogFilter::parse(plain), Ok(LogFilter::Targets(_))),
                "{plain}"
            );
        }
        assert!(matches!(
            LogFilter::parse("warn,tributary[http.request{request_id=abc}]=debug"),
            Ok(LogFilter::Env(_))
        ));
        let err = LogFilter::parse("tributary=loud")
            .err()
            .expect("an invalid level");
        assert!(err.to_string().contains("telemetry.log_level"), "{err}");
    }

    #[test]
    fn http_methods_are_a_bounded_label() {
        assert_eq!(method_label(&Method::GET), "GET");
        assert_eq!(method_label(&Method::PATCH), "PATCH");
        let custom = Method::from_bytes(b"PURGE").unwrap();
        assert_eq!(method_label(&custom), "_OTHER");
    }

    #[test]
    fn traceparent_parsing_follows_the_spec() {
        let ok = parse_traceparent(&headers(
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ))
        .unwrap();
        assert_eq!(ok.trace_id, "0af7651916cd43dd8448eb211c80319c");
        assert!(ok.sampled);
        for bad in [
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
        ] {
            assert!(parse_traceparent(&headers(bad)).is_none(), "{bad}");
        }
    }
}
