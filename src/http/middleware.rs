//! The request layer, admission and rate limiting as axum middleware functions.
//!
//! `request_context` is the one place a request's identity is established: it validates or
//! generates the request id, reads the caller's trace context and budget, fixes the deadline,
//! and runs the rest of the stack inside the task-local context and the request span. It also
//! measures the request (RED metrics by route template, never raw paths) and watches every
//! poll of the request future for one that blocks the worker thread.

use std::{any::Any, sync::Arc, time::Duration};

use axum::{
    extract::{ConnectInfo, MatchedPath, Request, State},
    http::{HeaderMap, HeaderValue, Response},
    middleware::Next,
    response::IntoResponse,
};
use tokio::time::Instant;
use tracing::Instrument;

use super::AppState;
use crate::{
    admission::Limiter,
    context::{self, RequestContext},
    downstream::BUDGET_HEADER,
    error::ApiError,
    ratelimit::Decision,
    telemetry::{self, PollTimer},
};

const REQUEST_ID: &str = "x-request-id";

/// A request id we are willing to echo and log: short, printable, no separators that could
/// forge log fields or headers.
fn valid_request_id(v: &HeaderValue) -> Option<&str> {
    let s = v.to_str().ok()?;
    let ok = (1..=128).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'));
    ok.then_some(s)
}

/// The caller's remaining budget, if it sent one, so a deadline is never extended hop by hop.
fn caller_budget(headers: &HeaderMap) -> Option<Duration> {
    let ms: u64 = headers.get(BUDGET_HEADER)?.to_str().ok()?.parse().ok()?;
    Some(Duration::from_millis(ms))
}

pub async fn request_context(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> axum::response::Response {
    let started = Instant::now();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".to_owned());
    let method = request.method().clone();
    let headers = request.headers();
    // The configured header limits, answered with a problem document. hyper enforces twice these
    // values as the hard memory bound and answers beyond that with a bare 431 of its own.
    let server = &state.settings.server;
    let (max_headers, max_header_bytes) = (server.max_headers.get(), server.max_header_bytes.get());
    let head_bytes = request.uri().to_string().len()
        + method.as_str().len()
        + headers
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len() + 4)
            .sum::<usize>();
    if headers.len() > max_headers || head_bytes > max_header_bytes {
        let mut response = ApiError::HeaderFieldsTooLarge {
            max_headers,
            max_bytes: max_header_bytes,
        }
        .into_response();
        response
            .headers_mut()
            .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
        state
            .telemetry
            .record_request(&route, &method, 431, started.elapsed());
        return response;
    }
    let request_id: Arc<str> = match headers.get(REQUEST_ID).and_then(valid_request_id) {
        Some(id) => id.into(),
        None => uuid::Uuid::new_v4().simple().to_string().into(),
    };
    let budget = state.settings.server.request_deadline;
    let budget = caller_budget(headers).map_or(budget, |b| b.min(budget));
    let incoming_trace = telemetry::parse_traceparent(headers);

    // Without span export the ids are known now and go into the span as it is created: every
    // later `record` costs the log layer a re-serialisation of the span's fields.
    let otel = telemetry::otel_active();
    let local_trace = (!otel).then(|| telemetry::local_trace_ids(incoming_trace.as_ref(), headers));
    let span = tracing::info_span!(
        telemetry::REQUEST_SPAN,
        otel.name = tracing::field::Empty,
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        http.request.method = %method,
        http.route = %route,
        url.path = %request.uri().path(),
        http.response.status_code = tracing::field::Empty,
        request_id = %request_id,
        trace_id = local_trace.as_ref().map(|t| t.trace_id.as_str()),
        span_id = local_trace.as_ref().map(|t| t.span_id.as_str()),
        user_id = tracing::field::Empty,
    );
    let trace = match local_trace {
        Some(trace) => trace,
        None => {
            // Only the exported span needs a name built per request.
            span.record("otel.name", format_args!("{method} {route}"));
            match telemetry::attach_trace(&span, headers) {
                Some(trace) => {
                    span.record("trace_id", trace.trace_id.as_str());
                    span.record("span_id", trace.span_id.as_str());
                    trace
                }
                None => telemetry::local_trace_ids(incoming_trace.as_ref(), headers),
            }
        }
    };

    let ctx = Arc::new(RequestContext::new(
        Arc::clone(&request_id),
        trace,
        started + budget,
    ));
    let active = state.telemetry.active_request();
    let inner = context::scope(Arc::clone(&ctx), next.run(request));
    let mut response = PollTimer::new(inner, &state.telemetry)
        .instrument(span.clone())
        .await;
    drop(active);

    let status = response.status();
    if let Ok(v) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert(REQUEST_ID, v);
    }
    let elapsed = started.elapsed();
    state
        .telemetry
        .record_request(&route, &method, status.as_u16(), elapsed);
    let user_id = ctx.user_id();
    if otel {
        // The exported server span's attributes; the log line below carries the same values.
        // An i64: OpenTelemetry has no unsigned integers, and a u64 is exported as a string.
        span.record("http.response.status_code", i64::from(status.as_u16()));
        if status.is_server_error() {
            span.record("otel.status_code", "ERROR");
        }
        if let Some(user_id) = user_id {
            span.record("user_id", user_id);
        }
    }
    let _entered = span.enter();
    tracing::info!(
        status = status.as_u16(),
        route = %route,
        user_id,
        latency_ms = elapsed.as_secs_f64() * 1000.0,
        "request completed"
    );
    response
}

/// Admission for one route group; `None` when admission control is disabled.
pub async fn admission(
    State(limiter): State<Option<Arc<Limiter>>>,
    request: Request,
    next: Next,
) -> axum::response::Response {
    let Some(limiter) = limiter else {
        return next.run(request).await;
    };
    match limiter.acquire().await {
        Ok(permit) => {
            let response = next.run(request).await;
            drop(permit);
            response
        }
        Err(rejected) => ApiError::Unavailable {
            reason: "the gateway is at its concurrency limit",
            retry_after: rejected.retry_after,
        }
        .into_response(),
    }
}

/// Per-client rate limiting (429); a no-op when it is not configured.
pub async fn rate_limit(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> axum::response::Response {
    let Some(limiter) = state.rate_limiter.as_ref() else {
        return next.run(request).await;
    };
    let peer = request
        .extensions()
        .get::<ConnectInfo<std::net::SocketAddr>>()
        .map(|c| c.0.ip());
    match limiter.check(request.headers(), peer).await {
        Decision::Allowed { headers } => {
            let mut response = next.run(request).await;
            response.headers_mut().extend(headers);
            response
        }
        Decision::Limited {
            headers,
            retry_after,
        } => {
            let mut response = ApiError::RateLimited { retry_after }.into_response();
            response.headers_mut().extend(headers);
            response
        }
    }
}

/// A panic inside a handler: an opaque 500 problem, logged once with the panic message.
pub fn panic_response(err: Box<dyn Any + Send + 'static>) -> Response<axum::body::Body> {
    let message = err
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| err.downcast_ref::<&str>().copied())
        .unwrap_or("unknown panic");
    ApiError::Internal(anyhow::anyhow!("handler panicked: {message}")).into_response()
}
