//! Per-request context in a `tokio::task_local!`.
//!
//! Request data kept per thread is wrong both ways: with a thread per request every value is a
//! per-request copy, and with a reused pool thread a value leaks from one request into the
//! next. A task-local has neither problem: it lives exactly as long as the request's future, it is visible to every `.await`
//! inside that future regardless of which worker thread polls it, and it is invisible to every
//! other task. The one thing it does not do is follow work into `tokio::spawn`ed tasks; such
//! work must be wrapped with [`scope`] (see [`spawn`]) explicitly — which is why the fan-out
//! runs its parts as futures inside the request task instead of spawning them.
//!
//! The context is set once, by the request layer (`http::middleware::ContextLayer`), and
//! read wherever needed: the log span, outgoing downstream headers, database statement
//! timeouts, and every bound on the request's time ([`deadline`], [`remaining`]).

use std::{
    fmt,
    future::Future,
    sync::{Arc, OnceLock},
    time::Duration,
};

use http::{HeaderName, HeaderValue};
use tokio::time::Instant;

tokio::task_local! {
    static CURRENT: Arc<RequestContext>;
}

/// The request id's header, on the way in, on every answer and on every downstream call.
pub const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// What every part of a request needs to know about it.
#[derive(Debug)]
pub struct RequestContext {
    /// Taken from `x-request-id` when well-formed, generated otherwise.
    pub request_id: Arc<str>,
    /// W3C trace context of this request (trace id, this hop's span id, sampled flag).
    pub trace: TraceIds,
    /// The whole request must be answered by then; every downstream call and query gets at most
    /// the time that is left.
    pub deadline: Instant,
    /// `request_id` as a header value, made once: the answer and every downstream call send it
    /// (`None` for an id that is not a valid header value, which the request layer never makes).
    request_id_header: Option<HeaderValue>,
    /// This request's `traceparent` and `tracestate` for outgoing calls, made at the first call
    /// and cloned (a reference count) for the others: five calls per dashboard would otherwise
    /// format and copy the same two values five times.
    trace_headers: OnceLock<TraceHeaders>,
    /// Set by handlers once the path has been parsed.
    user_id: OnceLock<i64>,
    /// The variants the request's parts went to (`carts=canary`), when any did not go to
    /// stable; set by the dashboard handler once it has routed the request.
    variants: OnceLock<Box<str>>,
}

/// The W3C trace headers of a request, as header values.
#[derive(Debug, Clone, Default)]
pub(crate) struct TraceHeaders {
    pub(crate) traceparent: Option<HeaderValue>,
    pub(crate) tracestate: Option<HeaderValue>,
}

/// Trace identifiers as lowercase hex, ready for `traceparent`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceIds {
    pub trace_id: String,
    pub span_id: String,
    pub sampled: bool,
    /// The caller's `tracestate`, forwarded (vendor data we do not interpret), at most 32
    /// list members and 512 characters (`telemetry::bounded_tracestate`).
    pub tracestate: Option<String>,
}

impl RequestContext {
    /// Only the request layer makes one; public (and hidden) for the request-context
    /// micro-benchmark in `benches/`, which times the scope around a context it built itself.
    #[doc(hidden)]
    pub fn new(request_id: Arc<str>, trace: TraceIds, deadline: Instant) -> Self {
        Self {
            request_id_header: HeaderValue::from_str(&request_id).ok(),
            request_id,
            trace,
            deadline,
            trace_headers: OnceLock::new(),
            user_id: OnceLock::new(),
            variants: OnceLock::new(),
        }
    }

    /// Time left before the deadline (zero once it has passed).
    pub fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    pub fn set_user_id(&self, user_id: i64) {
        // A request concerns one user; a second call with another id is a programming error
        // we would rather see in tests than silently overwrite.
        let stored = self.user_id.get_or_init(|| user_id);
        debug_assert_eq!(*stored, user_id, "user id set twice with different values");
    }

    pub fn user_id(&self) -> Option<i64> {
        self.user_id.get().copied()
    }

    /// Records where the request's parts went (the first call wins: a request is routed once).
    pub fn set_variants(&self, tag: impl Into<Box<str>>) {
        let _ = self.variants.set(tag.into());
    }

    /// `carts=canary,promotions=v2`, when any part went to a variant.
    pub fn variants(&self) -> Option<&str> {
        self.variants.get().map(|v| &**v)
    }

    /// The `traceparent` header value for an outgoing call made on behalf of this request.
    pub fn traceparent(&self) -> String {
        traceparent(
            &self.trace.trace_id,
            &self.trace.span_id,
            self.trace.sampled,
        )
    }

    /// The request id as a header value, for the answer and for outgoing calls.
    pub fn request_id_header(&self) -> Option<&HeaderValue> {
        self.request_id_header.as_ref()
    }

    /// [`Self::traceparent`] and the caller's `tracestate` as header values, made once.
    pub(crate) fn trace_headers(&self) -> &TraceHeaders {
        self.trace_headers.get_or_init(|| TraceHeaders {
            traceparent: HeaderValue::try_from(self.traceparent()).ok(),
            tracestate: self
                .trace
                .tracestate
                .as_deref()
                .and_then(|v| HeaderValue::from_str(v).ok()),
        })
    }
}

/// A W3C `traceparent` value (version 00) from ids that format as lowercase hex.
pub(crate) fn traceparent(
    trace_id: impl fmt::Display,
    span_id: impl fmt::Display,
    sampled: bool,
) -> String {
    format!(
        "00-{trace_id}-{span_id}-{}",
        if sampled { "01" } else { "00" }
    )
}

/// Runs `fut` with `ctx` as its request context.
pub async fn scope<F: Future>(ctx: Arc<RequestContext>, fut: F) -> F::Output {
    CURRENT.scope(ctx, fut).await
}

/// `make()`'s future with `ctx` as its request context, `make` itself run inside it too: for
/// the request layer, a tower service that calls the services beneath it (which may read the
/// context when called) and needs its future's type by name.
pub(crate) fn scope_call<F: Future>(
    ctx: Arc<RequestContext>,
    make: impl FnOnce() -> F,
) -> tokio::task::futures::TaskLocalFuture<Arc<RequestContext>, F> {
    let fut = CURRENT.sync_scope(Arc::clone(&ctx), make);
    CURRENT.scope(ctx, fut)
}

/// The current request's context, if this code runs inside a request.
pub fn current() -> Option<Arc<RequestContext>> {
    CURRENT.try_with(Arc::clone).ok()
}

/// How long a request may take when code runs outside one (a background task, a test that
/// calls a client directly): long, but still a bound.
const OUTSIDE_A_REQUEST: Duration = Duration::from_secs(30);

/// The current request's deadline; outside a request, `OUTSIDE_A_REQUEST` from now.
pub fn deadline() -> Instant {
    current().map_or_else(|| Instant::now() + OUTSIDE_A_REQUEST, |c| c.deadline)
}

/// Time left before the current request's deadline (see [`deadline`]).
pub fn remaining() -> Duration {
    deadline().saturating_duration_since(Instant::now())
}

/// Spawns `fut` carrying the current request's context with it (task-locals do not cross
/// `tokio::spawn` on their own). Outside a request it is a plain spawn.
pub fn spawn<F>(fut: F) -> tokio::task::JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    match current() {
        Some(ctx) => tokio::spawn(CURRENT.scope(ctx, fut)),
        None => tokio::spawn(fut),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(id: &str) -> Arc<RequestContext> {
        Arc::new(RequestContext::new(
            id.into(),
            TraceIds {
                trace_id: "0af7651916cd43dd8448eb211c80319c".into(),
                span_id: "b7ad6b7169203331".into(),
                sampled: true,
                tracestate: None,
            },
            Instant::now() + Duration::from_secs(1),
        ))
    }

    #[tokio::test]
    async fn context_is_visible_inside_its_scope_only() {
        assert!(current().is_none());
        let seen = scope(ctx("a"), async {
            tokio::task::yield_now().await;
            current().map(|c| c.request_id.to_string())
        })
        .await;
        assert_eq!(seen.as_deref(), Some("a"));
        assert!(current().is_none());
    }

    #[tokio::test]
    async fn spawn_carries_the_context_and_plain_tokio_spawn_does_not() {
        let (carried, plain) = scope(ctx("b"), async {
            let carried = spawn(async { current().map(|c| c.request_id.to_string()) });
            let plain = tokio::spawn(async { current().map(|c| c.request_id.to_string()) });
            (carried.await.unwrap(), plain.await.unwrap())
        })
        .await;
        assert_eq!(carried.as_deref(), Some("b"));
        assert_eq!(plain, None);
    }

    #[test]
    fn outgoing_headers_are_the_contexts_own_made_once() {
        let c = ctx("req-1");
        assert_eq!(
            c.request_id_header().map(HeaderValue::as_bytes),
            Some(&b"req-1"[..])
        );
        let first = c.trace_headers().traceparent.clone();
        assert_eq!(
            first.as_ref().map(HeaderValue::as_bytes),
            Some(c.traceparent().as_bytes())
        );
        // The second call gets the same value (the one made at the first), not a new one.
        assert!(std::ptr::eq(c.trace_headers(), c.trace_headers()));
        assert!(c.trace_headers().tracestate.is_none());
        // An id that cannot be a header is not sent, rather than sent mangled.
        assert!(ctx("bad\nid").request_id_header().is_none());
    }

    #[test]
    fn traceparent_is_w3c_formatted() {
        assert_eq!(
            ctx("c").traceparent(),
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        );
    }
}
