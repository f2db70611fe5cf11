//! The request layers (admission and rate limiting are the edge's, `super::edge`), composed in
//! [`super::router`] outermost first:
//!
//! - [`ContextLayer`] is the one place a request's identity is established: it validates or
//!   generates the request id, reads the caller's trace context and budget, fixes the
//!   deadline, and runs the rest of the stack inside the task-local context and the request
//!   span;
//! - [`RecordLayer`] measures the request (RED metrics by route template, never raw paths),
//!   writes its one access line and, for an error nobody expected, its one error line with the
//!   cause chain. It does so from a guard, so a request the client abandons is recorded too, as
//!   499;
//! - [`WatchPollsLayer`] times every poll of the request future and reports one that blocks the
//!   worker thread, from inside the request's span;
//! - [`HeaderLimitsLayer`] answers the configured header limits with a 431 problem;
//! - [`DeadlineLayer`] bounds every route by the request's deadline: past it, a 504.
//!
//! Each is a tower [`Layer`] whose service wraps the inner service's future in a named one,
//! not an `axum::middleware::from_fn`: a `from_fn` layer clones the whole stack beneath it and
//! its state, and boxes two futures, on every request, and for five layers on a hot path that
//! was measurable (docs/benchmarks.md, "Instructions per dashboard": 6 % of a dashboard's).
//! Their work before the inner service is called is synchronous, so nothing is lost: the
//! context layer calls the stack beneath it inside the request span and the task-local
//! context, so that what the inner layers read when they are called (the span, the deadline)
//! is the request's.

use std::{
    any::Any,
    convert::Infallible,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
    time::Duration,
};

use axum::{
    extract::{MatchedPath, Request},
    http::{HeaderMap, HeaderValue, Method, Response, StatusCode},
    response::IntoResponse,
};
use futures::future::{Either, Ready};
use pin_project_lite::pin_project;
use tokio::{task::futures::TaskLocalFuture, time::Instant};
use tower::{Layer, Service};
use tracing::{Instrument, Span, instrument::Instrumented};

use super::edge::Arrival;
use crate::{
    config::ServerSettings,
    context::{self, REQUEST_ID_HEADER, RequestContext, TraceIds},
    downstream::BUDGET_HEADER,
    error::{ApiError, chain},
    telemetry::{self, ActiveGuard, PollTimer, Telemetry},
};

/// The health probes' routes: their access lines are written at DEBUG, not INFO.
const PROBES: [&str; 2] = ["/healthz", "/readyz"];

/// The status recorded for a request whose client went away before it was answered (the
/// convention nginx started): no response was sent, so no real status exists.
pub(super) const CLIENT_CLOSED_REQUEST: u16 = 499;

/// How long after its deadline the edge gives up on a request. Every part of a request bounds
/// itself by the deadline and answers for itself (a degraded part, a 504 of its own); the edge
/// is the safety net for whatever does not, such as a statement on a database that went
/// silent, and must not race those answers.
const DEADLINE_GRACE: Duration = Duration::from_millis(100);

/// A request id we are willing to echo and log: short, printable, no separators that could
/// forge log fields or headers.
fn valid_request_id(v: &HeaderValue) -> Option<&str> {
    let s = v.to_str().ok()?;
    let ok = (1..=128).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'));
    ok.then_some(s)
}

/// The caller's request id when it sent a valid one, else a new one.
pub(super) fn request_id_or_new(headers: &HeaderMap) -> Arc<str> {
    match headers.get(REQUEST_ID_HEADER).and_then(valid_request_id) {
        Some(id) => id.into(),
        None => {
            // Encoded into a buffer: `to_string` would go through `fmt`.
            let mut text = [0u8; uuid::fmt::Simple::LENGTH];
            (&*uuid::Uuid::new_v4().simple().encode_lower(&mut text)).into()
        }
    }
}

/// When the request arrived: at the edge when it passed one, else now.
fn arrival(request: &Request) -> Instant {
    request
        .extensions()
        .get::<Arrival>()
        .map_or_else(Instant::now, |a| a.0)
}

/// The caller's remaining budget, if it sent one, so a deadline is never extended hop by hop.
fn caller_budget(headers: &HeaderMap) -> Option<Duration> {
    let ms: u64 = headers.get(BUDGET_HEADER)?.to_str().ok()?.parse().ok()?;
    Some(Duration::from_millis(ms))
}

/// The route template, never the raw path; `unmatched` for the fallback.
fn route_of(request: &Request) -> Option<MatchedPath> {
    request.extensions().get::<MatchedPath>().cloned()
}

fn route_label(route: Option<&MatchedPath>) -> &str {
    route.map_or("unmatched", MatchedPath::as_str)
}

/// Request id, deadline and trace context into the task-local; the request span around the
/// rest of the stack. `request_deadline` is `server.request_deadline`, which a caller's
/// budget header can only shorten.
#[derive(Clone)]
pub(super) struct ContextLayer {
    pub(super) request_deadline: Duration,
}

impl<S> Layer<S> for ContextLayer {
    type Service = WithContext<S>;

    fn layer(&self, inner: S) -> WithContext<S> {
        WithContext {
            inner,
            request_deadline: self.request_deadline,
        }
    }
}

/// [`ContextLayer`]'s service.
#[derive(Clone)]
pub(super) struct WithContext<S> {
    inner: S,
    request_deadline: Duration,
}

type ApiResponse = axum::response::Response;

impl<S> Service<Request> for WithContext<S>
where
    S: Service<Request, Response = ApiResponse, Error = Infallible>,
{
    type Response = ApiResponse;
    type Error = Infallible;
    type Future = ContextFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let started = arrival(&request);
        let route = route_of(&request);
        let route = route_label(route.as_ref());
        let headers = request.headers();
        let request_id = request_id_or_new(headers);
        let budget = self.request_deadline;
        let budget = caller_budget(headers).map_or(budget, |b| b.min(budget));
        let incoming_trace = telemetry::parse_traceparent(headers);

        // Without span export the ids are known now and go into the span as it is created:
        // every later `record` costs the log layer a re-serialisation of the span's fields.
        let otel = telemetry::otel_active();
        let local_trace =
            (!otel).then(|| telemetry::local_trace_ids(incoming_trace.as_ref(), headers));
        let span = request_span(
            request.method(),
            route,
            request.uri().path(),
            &request_id,
            local_trace.as_ref(),
        );
        let trace = match local_trace {
            Some(trace) => trace,
            None => {
                // Only the exported span needs a name built per request.
                span.record("otel.name", format_args!("{} {route}", request.method()));
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

        let ctx = Arc::new(RequestContext::new(request_id, trace, started + budget));
        let request_id = ctx.request_id_header().cloned();
        // The layers beneath are called now, inside the span and the context, as they are
        // polled later.
        let inner = &mut self.inner;
        let future = span.in_scope(|| context::scope_call(ctx, || inner.call(request)));
        ContextFuture {
            inner: future.instrument(span),
            request_id,
        }
    }
}

pin_project! {
    /// The rest of the stack inside the request's span and context; the answer gets the
    /// request id.
    pub(super) struct ContextFuture<F> {
        #[pin]
        inner: Instrumented<TaskLocalFuture<Arc<RequestContext>, F>>,
        request_id: Option<HeaderValue>,
    }
}

impl<F> Future for ContextFuture<F>
where
    F: Future<Output = Result<ApiResponse, Infallible>>,
{
    type Output = Result<ApiResponse, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let Ok(mut response) = ready!(this.inner.poll(cx));
        if let Some(v) = this.request_id.take() {
            response.headers_mut().insert(REQUEST_ID_HEADER, v);
        }
        Poll::Ready(Ok(response))
    }
}

/// The one span per request, with the fields every log line of the request carries; the trace
/// ids go in now when they are known (no span export), and the response's fields are recorded
/// later. Public (and hidden) for the access-log micro-benchmark in `benches/`, with
/// [`access_line`]: the request layers are crate-private.
#[doc(hidden)]
pub fn request_span(
    method: &Method,
    route: &str,
    path: &str,
    request_id: &str,
    local_trace: Option<&TraceIds>,
) -> Span {
    tracing::info_span!(
        telemetry::REQUEST_SPAN,
        otel.name = tracing::field::Empty,
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        // Strings as strings, not `%` (Display): the log layer would format each through
        // `fmt::Write` into a new `String`, the same text at several times the instructions.
        http.request.method = method.as_str(),
        http.route = route,
        url.path = path,
        http.response.status_code = tracing::field::Empty,
        request_id = request_id,
        trace_id = local_trace.map(|t| t.trace_id.as_str()),
        span_id = local_trace.map(|t| t.span_id.as_str()),
        user_id = tracing::field::Empty,
    )
}

/// The request's one access line, written inside its span (the caller enters it): abandoned,
/// a probe's (at DEBUG), or completed with its status and the error it was answered from.
#[doc(hidden)]
pub fn access_line(
    status: u16,
    route: &str,
    user_id: Option<i64>,
    variants: Option<&str>,
    latency_ms: f64,
    error: Option<&dyn std::fmt::Display>,
) {
    let error = error.map(tracing::field::display);
    if status == CLIENT_CLOSED_REQUEST {
        tracing::info!(
            status,
            route,
            user_id,
            variants,
            latency_ms,
            "request abandoned by the client"
        );
    } else if PROBES.contains(&route) {
        // A probe every few seconds from every load balancer and kubelet would be most of
        // the log; its answers are in the RED metrics.
        tracing::debug!(status, route, latency_ms, error, "request completed");
    } else {
        tracing::info!(
            status,
            route,
            user_id,
            variants,
            latency_ms,
            error,
            "request completed"
        );
    }
}

/// RED metrics, the access line and the error log, written once per request by a guard; runs
/// inside the request span and context.
#[derive(Clone)]
pub(super) struct RecordLayer {
    pub(super) telemetry: Arc<Telemetry>,
}

impl<S> Layer<S> for RecordLayer {
    type Service = Record<S>;

    fn layer(&self, inner: S) -> Record<S> {
        Record {
            inner,
            telemetry: Arc::clone(&self.telemetry),
        }
    }
}

/// [`RecordLayer`]'s service.
#[derive(Clone)]
pub(super) struct Record<S> {
    inner: S,
    telemetry: Arc<Telemetry>,
}

impl<S> Service<Request> for Record<S>
where
    S: Service<Request, Response = ApiResponse, Error = Infallible>,
{
    type Response = ApiResponse;
    type Error = Infallible;
    type Future = RecordFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let finish = Finish {
            _active: self.telemetry.active_request(),
            telemetry: Arc::clone(&self.telemetry),
            route: route_of(&request),
            method: request.method().clone(),
            started: arrival(&request),
            span: Span::current(),
            response: None,
        };
        RecordFuture {
            inner: self.inner.call(request),
            finish: Some(finish),
        }
    }
}

pin_project! {
    /// The rest of the stack, and the guard that records the request when it is answered or
    /// dropped.
    pub(super) struct RecordFuture<F> {
        #[pin]
        inner: F,
        finish: Option<Finish>,
    }
}

impl<F> Future for RecordFuture<F>
where
    F: Future<Output = Result<ApiResponse, Infallible>>,
{
    type Output = Result<ApiResponse, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let Ok(response) = ready!(this.inner.poll(cx));
        if let Some(mut finish) = this.finish.take() {
            finish.response = Some((response.status(), response.extensions().get().cloned()));
        }
        Poll::Ready(Ok(response))
    }
}

/// Records a request when it is dropped: with its response's status when there is one, as
/// [`CLIENT_CLOSED_REQUEST`] when the request future was dropped first (the client hung up).
/// Either way the latency histogram gets the sample, so the slowest requests, the ones clients
/// give up on, do not vanish from it.
struct Finish {
    telemetry: Arc<Telemetry>,
    /// Counts the request as active until the record is written.
    _active: ActiveGuard,
    route: Option<MatchedPath>,
    method: Method,
    started: Instant,
    /// The request span: the guard may be dropped while the span is entered for the drop
    /// only, so it records on the span it was created in.
    span: Span,
    /// The status, and the error the response was made from, if any.
    response: Option<(StatusCode, Option<Arc<ApiError>>)>,
}

impl Drop for Finish {
    fn drop(&mut self) {
        let elapsed = self.started.elapsed();
        let route = route_label(self.route.as_ref());
        let (status, error) = match self.response.take() {
            Some((status, error)) => (status.as_u16(), error),
            None => (CLIENT_CLOSED_REQUEST, None),
        };
        self.telemetry
            .record_request(route, &self.method, status, elapsed);
        let ctx = context::current();
        let user_id = ctx.as_ref().and_then(|c| c.user_id());
        // Where the parts went, when any went to a variant (grey releases).
        let variants = ctx.as_ref().and_then(|c| c.variants());
        if telemetry::otel_active() {
            // The exported server span's attributes; the log line below carries the same
            // values. An i64: OpenTelemetry has no unsigned integers, and a u64 is exported as
            // a string.
            self.span
                .record("http.response.status_code", i64::from(status));
            if status >= 500 {
                self.span.record("otel.status_code", "ERROR");
            }
            if let Some(user_id) = user_id {
                self.span.record("user_id", user_id);
            }
        }
        let _entered = self.span.enter();
        let latency_ms = telemetry::millis(elapsed);
        if let Some(error) = error.as_deref().filter(|e| e.is_unexpected()) {
            // The one place a server-side error's cause is logged; the client never sees it.
            tracing::error!(status, error = %chain(error), "request failed");
        }
        access_line(
            status,
            route,
            user_id,
            variants,
            latency_ms,
            error.as_deref().map(|e| e as &dyn std::fmt::Display),
        );
    }
}

/// Long-poll detection: a poll of the request future that holds the worker thread longer than
/// `telemetry.long_poll_threshold` is counted and logged.
#[derive(Clone)]
pub(super) struct WatchPollsLayer {
    pub(super) telemetry: Arc<Telemetry>,
}

impl<S> Layer<S> for WatchPollsLayer {
    type Service = WatchPolls<S>;

    fn layer(&self, inner: S) -> WatchPolls<S> {
        WatchPolls {
            inner,
            telemetry: Arc::clone(&self.telemetry),
        }
    }
}

/// [`WatchPollsLayer`]'s service.
#[derive(Clone)]
pub(super) struct WatchPolls<S> {
    inner: S,
    telemetry: Arc<Telemetry>,
}

impl<S> Service<Request> for WatchPolls<S>
where
    S: Service<Request, Response = ApiResponse, Error = Infallible>,
{
    type Response = ApiResponse;
    type Error = Infallible;
    type Future = PollTimer<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        PollTimer::new(self.inner.call(request), Arc::clone(&self.telemetry))
    }
}

/// The configured header limits, answered with a problem document. hyper enforces twice these
/// values as the hard memory bound and answers beyond that with a bare 431 of its own.
#[derive(Clone)]
pub(super) struct HeaderLimitsLayer {
    pub(super) server: Arc<ServerSettings>,
}

impl<S> Layer<S> for HeaderLimitsLayer {
    type Service = HeaderLimits<S>;

    fn layer(&self, inner: S) -> HeaderLimits<S> {
        HeaderLimits {
            inner,
            server: Arc::clone(&self.server),
        }
    }
}

/// [`HeaderLimitsLayer`]'s service.
#[derive(Clone)]
pub(super) struct HeaderLimits<S> {
    inner: S,
    server: Arc<ServerSettings>,
}

impl<S> Service<Request> for HeaderLimits<S>
where
    S: Service<Request, Response = ApiResponse, Error = Infallible>,
{
    type Response = ApiResponse;
    type Error = Infallible;
    type Future = Either<Ready<Result<ApiResponse, Infallible>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        match over_header_limits(&self.server, &request) {
            Some(response) => Either::Left(futures::future::ready(Ok(response))),
            None => Either::Right(self.inner.call(request)),
        }
    }
}

/// The 431 for a request head over the configured limits, if it is.
fn over_header_limits(server: &ServerSettings, request: &Request) -> Option<ApiResponse> {
    let (max_headers, max_header_bytes) = (server.max_headers.get(), server.max_header_bytes.get());
    let headers = request.headers();
    let head_bytes = uri_len(request.uri())
        + request.method().as_str().len()
        + headers
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len() + 4)
            .sum::<usize>();
    if headers.len() <= max_headers && head_bytes <= max_header_bytes {
        return None;
    }
    let mut response = ApiError::HeaderFieldsTooLarge {
        max_headers,
        max_bytes: max_header_bytes,
    }
    .into_response();
    response
        .headers_mut()
        .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
    Some(response)
}

/// The length of the URI as it is displayed (`Uri`'s `Display`), without formatting it: a
/// request's target is nearly always the origin form, a path and a query.
fn uri_len(uri: &http::Uri) -> usize {
    let scheme = uri.scheme_str().map_or(0, |s| s.len() + 3);
    let authority = uri.authority().map_or(0, |a| a.as_str().len());
    let path_and_query = uri.path_and_query().map_or(0, |pq| pq.as_str().len());
    scheme + authority + path_and_query
}

/// Bounds the rest of the stack by the request's deadline (plus [`DEADLINE_GRACE`]): a 504,
/// and everything the request held (an admission permit, a pooled connection) let go. The
/// deadline is read from the request context when the stack is called, which the context
/// layer does inside it.
#[derive(Clone)]
pub(super) struct DeadlineLayer;

impl<S> Layer<S> for DeadlineLayer {
    type Service = Deadline<S>;

    fn layer(&self, inner: S) -> Deadline<S> {
        Deadline { inner }
    }
}

/// [`DeadlineLayer`]'s service.
#[derive(Clone)]
pub(super) struct Deadline<S> {
    inner: S,
}

/// The stack beneath (`tower_http`'s panic layer first) answers with its own body type; the
/// answer is made an axum response here, as `from_fn`'s `Next` would.
impl<S> Service<Request> for Deadline<S>
where
    S: Service<Request, Error = Infallible>,
    S::Response: IntoResponse,
{
    type Response = ApiResponse;
    type Error = Infallible;
    type Future = DeadlineFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let deadline = context::deadline() + DEADLINE_GRACE;
        DeadlineFuture {
            inner: tokio::time::timeout_at(deadline, self.inner.call(request)),
        }
    }
}

pin_project! {
    /// The rest of the stack, or a 504 at the deadline.
    pub(super) struct DeadlineFuture<F> {
        #[pin]
        inner: tokio::time::Timeout<F>,
    }
}

impl<F, R> Future for DeadlineFuture<F>
where
    F: Future<Output = Result<R, Infallible>>,
    R: IntoResponse,
{
    type Output = Result<ApiResponse, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Poll::Ready(match ready!(self.project().inner.poll(cx)) {
            Ok(Ok(response)) => Ok(response.into_response()),
            Err(_) => Ok(ApiError::GatewayTimeout.into_response()),
        })
    }
}

/// A panic inside a handler: an opaque 500 problem, logged once with the panic message.
pub(super) fn panic_response(err: Box<dyn Any + Send + 'static>) -> Response<axum::body::Body> {
    let message = err
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| err.downcast_ref::<&str>().copied())
        .unwrap_or("unknown panic");
    ApiError::Internal(anyhow::anyhow!("handler panicked: {message}")).into_response()
}
