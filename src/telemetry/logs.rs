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
/// JSON lines are written by [`super::json_lines`], which renders each span's fields once and
/// writes an event's as it visits them.
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
        LogFormat::Json => super::json_lines::JsonLines::new(writer).boxed(),
        LogFormat::Pretty => tracing_subscriber::fmt::layer()
            .compact()
            // Colours for a terminal, plain text when stdout is a file or a pipe.
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
            .with_writer(writer)
            .boxed(),
    }
}

/// Now as the lines' `timestamp`: UTC, RFC 3339 with microseconds, the same text as
/// `tracing_subscriber`'s `SystemTime` timer (`2026-12-07T10:58:01.123456Z`), without going
/// through `fmt` for each of its seven numbers (about 1,200 instructions a line).
pub(super) fn now_rfc3339() -> [u8; 27] {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    rfc3339_micros(since_epoch.as_secs(), since_epoch.subsec_micros())
}

/// `YYYY-MM-DDTHH:MM:SS.ffffffZ` for `secs` seconds and `micros` microseconds after the Unix
/// epoch. The date is Howard Hinnant's `civil_from_days`, exact for every day after the epoch
/// (years up to 9999; a clock beyond that would need a wider field).
fn rfc3339_micros(secs: u64, micros: u32) -> [u8; 27] {
    fn put(out: &mut [u8], mut value: u64) {
        for digit in out.iter_mut().rev() {
            *digit = b'0' + (value % 10) as u8;
            value /= 10;
        }
    }
    let days = secs / 86_400;
    let of_day = secs % 86_400;
    // Days since 0000-03-01, counted in 400-year eras of 146,097 days.
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);

    let mut out = *b"0000-00-00T00:00:00.000000Z";
    put(&mut out[0..4], year);
    put(&mut out[5..7], month);
    put(&mut out[8..10], day);
    put(&mut out[11..13], of_day / 3_600);
    put(&mut out[14..16], of_day % 3_600 / 60);
    put(&mut out[17..19], of_day % 60);
    put(&mut out[20..26], u64::from(micros));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339_with_microseconds_as_chrono_formats_them() {
        let mut secs: Vec<u64> = vec![
            0,
            59,
            86_399,
            86_400,
            951_782_400,     // 2000-02-29
            951_868_799,     // 2000-02-29T23:59:59
            1_709_164_800,   // 2024-02-29
            1_798_675_199,   // 2026-12-31T23:59:59
            4_107_542_400,   // 2100-03-01 (2100 is not a leap year)
            253_402_300_799, // 9999-12-31T23:59:59
        ];
        // Every day from 1970 to 2100, at a time of day that moves with it.
        secs.extend((0..47_500u64).map(|d| d * 86_400 + (d * 7_919) % 86_400));
        for s in secs {
            for micros in [0, 1, 999_999, 123_456] {
                let expected = chrono::DateTime::from_timestamp(s as i64, micros * 1_000)
                    .expect("in range")
                    .format("%Y-%m-%dT%H:%M:%S%.6fZ")
                    .to_string();
                let got = rfc3339_micros(s, micros);
                assert_eq!(
                    std::str::from_utf8(&got).unwrap(),
                    expected,
                    "{s} s {micros} µs"
                );
            }
        }
    }

    #[test]
    fn now_is_now() {
        let text = now_rfc3339();
        let text = std::str::from_utf8(&text).unwrap();
        let parsed = chrono::DateTime::parse_from_rfc3339(text).expect("RFC 3339");
        let skew = chrono::Utc::now().signed_duration_since(parsed);
        assert!(skew.num_seconds().abs() < 60, "{text}");
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
