//! Traces: W3C trace context in and out, and the OpenTelemetry exporter.
//!
//! With an OTLP endpoint configured, the request span and every call and query span are
//! exported, and the ids come from the exported spans. Without one, the request still gets
//! trace ids ([`local_trace_ids`]): the caller's trace id or a new one, and a span id of its
//! own, so logs and the `traceparent` of every downstream call join up across services anyway.

use std::sync::OnceLock;

use axum::http::{HeaderMap, HeaderName};

use crate::context::{RequestContext, TraceHeaders, TraceIds};

/// The W3C trace-context headers a downstream call carries (constants: a custom header name
/// given as a string is parsed and allocated on every insert).
pub(crate) const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
pub(crate) const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// Process-wide flag: whether spans are exported through OpenTelemetry.
static OTEL_ACTIVE: OnceLock<bool> = OnceLock::new();

pub(super) fn set_otel_active(active: bool) {
    let _ = OTEL_ACTIVE.set(active);
}

/// Whether spans are exported through OpenTelemetry (an OTLP endpoint is configured).
pub(crate) fn otel_active() -> bool {
    OTEL_ACTIVE.get().copied().unwrap_or(false)
}

/// A parsed W3C `traceparent`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TraceParent {
    pub trace_id: String,
    pub parent_id: String,
    pub sampled: bool,
}

/// Parses `traceparent`, rejecting malformed or all-zero ids as the spec requires. Every field
/// is lowercase hex of its exact length: `u8::from_str_radix` alone (and the SDK's own
/// propagator, which is why this parser gates it) would also take flags such as `+1` or `1`.
///
/// A version other than `00` is accepted as the W3C asks, so that a caller a version ahead
/// still joins the trace: its first four fields are read as version 00's, and whatever follows
/// a dash after the flags is ignored. Version `00` has exactly four fields; `ff` is invalid.
pub(crate) fn parse_traceparent(headers: &HeaderMap) -> Option<TraceParent> {
    let v = headers.get("traceparent")?.to_str().ok()?;
    let mut parts = v.trim().split('-');
    let (version, trace_id, parent_id, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, n: usize| {
        s.len() == n && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    };
    let id = |s: &str, n: usize| hex(s, n) && s.bytes().any(|b| b != b'0');
    let more = parts.next().is_some();
    if !hex(version, 2)
        || version == "ff"
        || (version == "00" && more)
        || !id(trace_id, 32)
        || !id(parent_id, 16)
        || !hex(flags, 2)
    {
        return None;
    }
    let flags = u8::from_str_radix(flags, 16).ok()?;
    Some(TraceParent {
        trace_id: trace_id.to_owned(),
        parent_id: parent_id.to_owned(),
        sampled: flags & 1 == 1,
    })
}

/// At most this many list members of a caller's `tracestate` are passed on: the W3C limit.
const TRACESTATE_MAX_MEMBERS: usize = 32;

/// A `tracestate` longer than this, once capped at [`TRACESTATE_MAX_MEMBERS`], is not passed
/// on at all: the W3C asks every hop to propagate at least 512 characters, so a longer one is
/// more than any vendor relies on, and it would be copied into every downstream call.
const TRACESTATE_MAX_LEN: usize = 512;

/// The caller's `tracestate` as it is passed on: its first 32 list members (empty ones
/// dropped, separators normalised), or nothing when that is empty or over 512 characters.
pub(crate) fn bounded_tracestate(raw: &str) -> Option<String> {
    let members: Vec<&str> = raw
        .split(',')
        .map(str::trim)
        .filter(|member| !member.is_empty())
        .take(TRACESTATE_MAX_MEMBERS)
        .collect();
    let joined = members.join(",");
    (!joined.is_empty() && joined.len() <= TRACESTATE_MAX_LEN).then_some(joined)
}

fn random_hex(bytes: usize) -> String {
    use rand::RngCore;
    let mut buf = [0u8; 16];
    rand::rng().fill_bytes(&mut buf[..bytes]);
    // Into a buffer, not `hex::encode`, which collects a `String` one `char` at a time
    // (about 1,200 instructions a request for the two ids).
    let mut text = [0u8; 32];
    let text = &mut text[..bytes * 2];
    hex::encode_to_slice(&buf[..bytes], text).expect("twice as many digits as bytes");
    String::from_utf8(text.to_vec()).expect("hex digits are ASCII")
}

/// W3C trace headers for an outgoing call made now on behalf of `ctx`: the current span's ids
/// when spans are exported (so the callee's spans hang under this call's span), the request's
/// otherwise (made once per request, [`RequestContext::trace_headers`]); the caller's
/// `tracestate` is passed on either way.
pub(crate) fn outgoing_trace_headers(ctx: Option<&RequestContext>) -> TraceHeaders {
    let headers = ctx.map(|c| c.trace_headers().clone()).unwrap_or_default();
    #[cfg(feature = "otel")]
    if otel_active()
        && let Some(tp) = otel::current_traceparent()
    {
        return TraceHeaders {
            traceparent: axum::http::HeaderValue::try_from(tp).ok(),
            ..headers
        };
    }
    headers
}

/// Links `span` to the caller's trace and returns the ids the exported span got, when spans are
/// exported; `None` otherwise (use [`local_trace_ids`]).
pub(crate) fn attach_trace(span: &tracing::Span, headers: &HeaderMap) -> Option<TraceIds> {
    #[cfg(feature = "otel")]
    if otel_active() {
        return otel::attach(span, headers);
    }
    let _ = (span, headers);
    None
}

/// Trace ids for a request when spans are not exported: the caller's trace id (or a new one),
/// a new span id for this hop, and the caller's `tracestate` passed on (bounded by
/// [`bounded_tracestate`]). They go into logs and
/// into the `traceparent` of every downstream call, so traces still join up across services.
pub(crate) fn local_trace_ids(incoming: Option<&TraceParent>, headers: &HeaderMap) -> TraceIds {
    let tracestate = incoming
        .and(headers.get("tracestate"))
        .and_then(|v| v.to_str().ok())
        .and_then(bounded_tracestate);
    TraceIds {
        trace_id: incoming.map_or_else(|| random_hex(16), |t| t.trace_id.clone()),
        span_id: random_hex(8),
        sampled: incoming.is_none_or(|t| t.sampled),
        tracestate,
    }
}

#[cfg(feature = "otel")]
pub(crate) mod otel {
    use axum::http::HeaderMap;
    use opentelemetry::{
        propagation::{Extractor, TextMapPropagator},
        trace::{TraceContextExt, TracerProvider as _},
    };
    use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
    use opentelemetry_sdk::{
        propagation::TraceContextPropagator,
        trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider},
    };
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use crate::{config::TelemetrySettings, context::TraceIds, telemetry::otlp};

    /// The tracer provider, exporting OTLP/HTTP protobuf in batches, when a traces endpoint
    /// is configured (and `OTEL_SDK_DISABLED` is not true); `None` otherwise. Public for the
    /// end-to-end tests, which export through it without installing a global subscriber.
    pub fn tracer_provider(
        settings: &TelemetrySettings,
    ) -> anyhow::Result<Option<SdkTracerProvider>> {
        let otel = &settings.otel();
        let Some(endpoint) = &otel.traces_endpoint.value else {
            return Ok(None);
        };
        crate::tls::install_provider();
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(endpoint.as_str())
            .with_headers(otlp::headers(otel))
            .build()?;
        let processor = BatchSpanProcessor::builder(exporter)
            .with_batch_config(
                BatchConfigBuilder::default()
                    .with_scheduled_delay(std::time::Duration::from_millis(500))
                    .with_max_queue_size(8192)
                    .build(),
            )
            .build();
        Ok(Some(
            SdkTracerProvider::builder()
                .with_span_processor(processor)
                .with_sampler(otlp::sampler(otel))
                .with_resource(otlp::resource(otel))
                .build(),
        ))
    }

    /// The `tracing` layer over `provider`'s tracer.
    pub(in crate::telemetry) fn layer<S>(
        provider: &SdkTracerProvider,
    ) -> tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::Tracer>
    where
        S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
    {
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("tributary"))
            .with_error_records_to_exceptions(true)
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

    /// Parents `span` on the incoming W3C context, when the caller's `traceparent` passes the
    /// gateway's own (stricter) parser, and reads back its ids.
    pub(super) fn attach(span: &tracing::Span, headers: &HeaderMap) -> Option<TraceIds> {
        if super::parse_traceparent(headers).is_some() {
            let parent = TraceContextPropagator::new().extract(&Headers(headers));
            let _ = span.set_parent(parent);
        }
        let cx = span.context();
        let sc = cx.span().span_context().clone();
        let tracestate = sc.trace_state().header();
        sc.is_valid().then(|| TraceIds {
            trace_id: sc.trace_id().to_string(),
            span_id: sc.span_id().to_string(),
            sampled: sc.is_sampled(),
            tracestate: super::bounded_tracestate(&tracestate),
        })
    }

    /// The current span's ids as a `traceparent` value.
    pub(super) fn current_traceparent() -> Option<String> {
        let cx = tracing::Span::current().context();
        let sc = cx.span().span_context().clone();
        sc.is_valid()
            .then(|| crate::context::traceparent(sc.trace_id(), sc.span_id(), sc.is_sampled()))
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
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "0-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "0g-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-+1",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-+1",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-001",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0F",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0g",
        ] {
            assert!(parse_traceparent(&headers(bad)).is_none(), "{bad}");
        }
        let unsampled = parse_traceparent(&headers(
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
        ))
        .expect("flags 00 are valid");
        assert!(!unsampled.sampled);
    }

    #[test]
    fn a_later_traceparent_version_is_read_by_its_first_four_fields() {
        for later in [
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "cc-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-what-the-future-will-be-like",
        ] {
            let tp = parse_traceparent(&headers(later)).expect(later);
            assert_eq!(tp.trace_id, "0af7651916cd43dd8448eb211c80319c");
            assert_eq!(tp.parent_id, "b7ad6b7169203331");
            assert!(tp.sampled);
        }
    }

    #[test]
    fn tracestate_is_capped_at_32_members_and_dropped_when_too_long() {
        assert_eq!(
            bounded_tracestate("a=1 , b=2,,c=3").as_deref(),
            Some("a=1,b=2,c=3")
        );
        let forty: Vec<String> = (0..40).map(|i| format!("v{i}=x")).collect();
        let capped = bounded_tracestate(&forty.join(",")).unwrap();
        assert_eq!(capped, forty[..32].join(","));
        let long = format!("big={}", "x".repeat(600));
        assert_eq!(bounded_tracestate(&long), None);
        assert_eq!(bounded_tracestate(" , "), None);
    }
}
