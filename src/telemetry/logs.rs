//! Logs: the `tracing` subscriber, its filter, and the line format.
//!
//! Logs see events and the request span, nothing else: the per-call and per-query spans exist
//! for traces, and formatting their fields on every request for log lines that never show them
//! was most of the cost of logging (measured with `bench/run instrumentation`). An event inside
//! a downstream call still carries the request span's fields (request id, trace id, route).

use std::sync::OnceLock;

#[cfg(feature = "otel")]
use tracing_subscriber::filter::FilterExt;
use tracing_subscriber::{
    EnvFilter, Layer,
    filter::{Targets, filter_fn},
    fmt::MakeWriter,
    layer::SubscriberExt,
    registry::LookupSpan,
    util::SubscriberInitExt,
};

use super::{REQUEST_SPAN, log_sink::LogSink, metrics::Family, trace};
use crate::config::{LogFormat, TelemetrySettings};

pub(crate) const LINES_DROPPED: Family = Family::counter(
    "tributary_log_lines_dropped_total",
    "Log lines dropped because the log sink's buffer was full (stdout not keeping up).",
);

/// The families this module records.
pub(crate) const FAMILIES: &[Family] = &[LINES_DROPPED];

/// The process's log sink, for the count of lines it dropped because its buffer was full.
static LOG_SINK: OnceLock<LogSink> = OnceLock::new();

/// Remembers the process's log sink so that its drops are exported.
pub(super) fn set_sink(sink: LogSink) {
    let _ = LOG_SINK.set(sink);
}

/// Exports how many lines the log sink dropped: zero when logs do not go through one (tests
/// install the subscriber on their own writer).
pub(super) fn record_dropped_lines() {
    let dropped = LOG_SINK.get().map_or(0, LogSink::dropped_lines);
    metrics::counter!(LINES_DROPPED.name).absolute(dropped);
}

#[cfg(feature = "otel")]
type TracerProvider = Option<opentelemetry_sdk::trace::SdkTracerProvider>;
#[cfg(not(feature = "otel"))]
type TracerProvider = ();

/// Installs the subscriber with logs going to `writer` (`main` passes the log sink on stdout,
/// tests a buffer) and returns the trace pipeline to keep alive.
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
    let filter = LogFilter::parse(&settings.log_level)?;
    let only_request_span = filter_fn(|meta| !meta.is_span() || meta.name() == REQUEST_SPAN);

    #[cfg(feature = "otel")]
    if let Some(provider) = trace::otel::tracer_provider(settings)? {
        let otel_layer = trace::otel::layer(&provider);
        let log_filter = match filter {
            LogFilter::Targets(t) => FilterExt::boxed(t),
            LogFilter::Env(e) => FilterExt::boxed(e),
        };
        trace::set_otel_active(true);
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
    trace::set_otel_active(false);
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
#[expect(
    clippy::large_enum_variant,
    reason = "built once at start-up and moved into the subscriber"
)]
enum LogFilter {
    Targets(Targets),
    Env(EnvFilter),
}

/// Added to the configured filter unless it names sqlx itself: the server's notices at INFO
/// are noise such as `relation "_sqlx_migrations" already exists, skipping` on every start.
const QUIET_NOTICES: &str = "sqlx::postgres::notice=warn";

impl LogFilter {
    fn parse(directives: &str) -> anyhow::Result<Self> {
        let with_quiet;
        let directives = if directives.contains("sqlx") {
            directives
        } else {
            with_quiet = format!("{directives},{QUIET_NOTICES}");
            &with_quiet
        };
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

#[cfg(test)]
mod tests {
    use super::*;

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
        let Ok(LogFilter::Targets(info)) = LogFilter::parse("info") else {
            panic!("info is a plain directive");
        };
        assert!(info.would_enable("tributary::startup", &tracing::Level::INFO));
        assert!(!info.would_enable("sqlx::postgres::notice", &tracing::Level::INFO));
        assert!(info.would_enable("sqlx::postgres::notice", &tracing::Level::WARN));
        let Ok(LogFilter::Targets(asked)) = LogFilter::parse("info,sqlx=debug") else {
            panic!("a plain directive");
        };
        assert!(asked.would_enable("sqlx::postgres::notice", &tracing::Level::INFO));

        let err = LogFilter::parse("tributary=loud")
            .err()
            .expect("an invalid level");
        assert!(err.to_string().contains("telemetry.log_level"), "{err}");
    }
}
