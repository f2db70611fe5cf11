//! One typed client per downstream service.
//!
//! Each [`Downstream`] owns everything about calling one service: its base URL, its timeout,
//! its bulkhead (a bound on concurrent calls, so one slow dependency cannot absorb all the
//! gateway's capacity), its circuit breaker, its retry
//! budget and its instruments. Handlers never touch the HTTP client: the exchange itself, over
//! reqwest or hyper-util's client (`http_client.transport`), is [`transport`]'s.
//!
//! Every call is bounded by the request's deadline: the effective timeout is
//! `min(call timeout, remaining budget)`, a call that cannot fit in the remaining budget is not
//! started, and the remaining budget travels downstream in `x-request-budget-ms` so the callee
//! can give up in time too. Retries are for idempotent calls only, jittered, capped by a retry
//! budget (a share of traffic), and never run past the deadline.
//!
//! The circuit breaker is shared by every client, so only failures that say something about
//! the downstream may count against it. Two kinds of timeout do not ([`TimeoutCause`]): one
//! that the caller's own tiny `x-request-budget-ms` made inevitable (or one client could open
//! the circuit for everyone), and one that fired while the gateway's own runtime was saturated
//! ([`crate::overload`]): the answer may well have arrived in time and waited for a worker.
//! They are counted in `tributary_downstream_breaker_ignored_total`. While the runtime is
//! saturated there are no retries and no hedges either: they would add load to the one
//! resource that is short.
//!
//! One file (over 500 lines with its tests) because a call's path — breaker ticket, bulkhead,
//! retries, hedging, the exchange and the verdict on its failure — is one sequence, best read
//! top to bottom; the breaker, which has state of its own, is [`breaker`], and the optional
//! answer cache in front of a client is [`cache`].

pub mod breaker;
pub mod cache;
pub(crate) mod transport;
pub mod window;

use std::{
    sync::{Arc, OnceLock},
    time::Duration,
};

use http::{HeaderName, HeaderValue};
use metrics::{Counter, Gauge, Histogram};
use rand::Rng;
use serde_json::value::RawValue;
use tokio::{
    sync::{OwnedSemaphorePermit, Semaphore},
    time::Instant,
};
use tower::retry::budget::{Budget, TpsBudget};
use tracing::{Instrument, Span};

use crate::{
    config::{
        HttpClientSettings, HttpUrl, RetrySettings, Settings, VariantSettings, routing::STABLE,
    },
    context::remaining,
    domain::Service,
    overload::QueueDelay,
    telemetry::Family,
};
use breaker::Breaker;
use cache::{Directives, PartCache, Source};
pub(crate) use transport::Client;
use transport::Transport;
use window::Window;

/// Header naming the variant a call was routed to (`stable` for the downstream's own
/// deployment), sent only by a downstream that has variants: the colour follows the request.
///
/// The header names a call sends are `HeaderName` constants, not `&str`: a custom name given
/// as a string is parsed and copied into a new allocation on every insert, three times a call.
pub const VARIANT_HEADER: HeaderName = HeaderName::from_static("x-tributary-variant");

/// Header carrying the caller's remaining budget in whole milliseconds.
pub(crate) const BUDGET_HEADER: HeaderName = HeaderName::from_static("x-request-budget-ms");

/// The budget header's value for `ms`. Every call sends one, and `HeaderValue::from(u64)`
/// formats it into new allocations (which reqwest's copy of every request, made then for its
/// retries, promoted to a shared buffer): made once, 12 fewer allocations a dashboard
/// (`bench/profile instructions`, 319 against 331). Values up to
/// [`BUDGET_VALUES`] milliseconds (the shipped call timeouts are 500 ms, the request deadline 1
/// s) are made once, over one static text, and cloning one copies two pointers; a larger value
/// is formatted as before.
pub(crate) fn budget_value(ms: u64) -> HeaderValue {
    static TABLE: OnceLock<Vec<HeaderValue>> = OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut text = String::new();
        let ends: Vec<usize> = (0..BUDGET_VALUES)
            .map(|v| {
                text.push_str(itoa::Buffer::new().format(v));
                text.len()
            })
            .collect();
        // Made once per process and kept for its life, like a static table.
        let text: &'static str = Box::leak(text.into_boxed_str());
        let mut start = 0;
        ends.into_iter()
            .map(|end| {
                let value = HeaderValue::from_static(&text[start..end]);
                start = end;
                value
            })
            .collect()
    });
    usize::try_from(ms)
        .ok()
        .and_then(|i| table.get(i))
        .cloned()
        .unwrap_or_else(|| HeaderValue::from(ms))
}

/// How many budget values [`budget_value`] keeps made, from 0 ms: 2,048 of 40 bytes, 80 KB.
const BUDGET_VALUES: u64 = 2_048;

/// A call is not started with less budget than this left: it could not complete anyway.
pub(crate) const MIN_CALL_BUDGET: Duration = Duration::from_millis(2);

/// Largest downstream body accepted; a larger one is an error, not an allocation.
const MAX_BODY_BYTES: usize = 1024 * 1024;

/// How a downstream call ended; also the `outcome` metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Ok,
    Error,
    Timeout,
    Shed,
    CircuitOpen,
    BudgetExhausted,
}

impl Outcome {
    pub(crate) const ALL: [Outcome; 6] = [
        Outcome::Ok,
        Outcome::Error,
        Outcome::Timeout,
        Outcome::Shed,
        Outcome::CircuitOpen,
        Outcome::BudgetExhausted,
    ];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Error => "error",
            Outcome::Timeout => "timeout",
            Outcome::Shed => "shed",
            Outcome::CircuitOpen => "circuit_open",
            Outcome::BudgetExhausted => "budget_exhausted",
        }
    }
}

/// Whose fault a timeout was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TimeoutCause {
    /// The downstream did not answer within a fair timeout: it counts against its breaker.
    Downstream,
    /// The caller's budget cut the call to less than half of what it would have had.
    RequestBudget,
    /// The gateway's runtime was saturated during the call, or the timer fired late.
    GatewaySaturated,
}

impl TimeoutCause {
    /// Classifies a timeout: `timeout` is what the call had, `fair` what it would have had
    /// under the gateway's own deadline.
    fn of(timeout: Duration, fair: Duration, fired_late: bool, saturated: bool) -> Self {
        if fired_late || saturated {
            TimeoutCause::GatewaySaturated
        } else if timeout * 2 < fair {
            TimeoutCause::RequestBudget
        } else {
            TimeoutCause::Downstream
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            TimeoutCause::Downstream => "downstream",
            TimeoutCause::RequestBudget => "request_budget",
            TimeoutCause::GatewaySaturated => "gateway_saturated",
        }
    }
}

impl std::fmt::Display for TimeoutCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TimeoutCause::Downstream => "no answer in time",
            TimeoutCause::RequestBudget => "the caller's budget was too short",
            TimeoutCause::GatewaySaturated => "the gateway was saturated",
        })
    }
}

/// Why a call produced no usable body. `Clone`, so that one cached call's failure can answer
/// every request that waited for it.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum CallError {
    #[error("{service} timed out: {cause}")]
    Timeout {
        service: Service,
        cause: TimeoutCause,
    },
    #[error("{service} answered {status}")]
    Status { service: Service, status: u16 },
    #[error("{service} could not be reached: {source}")]
    Transport {
        service: Service,
        /// A connect or read timeout of the HTTP client.
        timed_out: bool,
        #[source]
        source: Arc<dyn std::error::Error + Send + Sync>,
    },
    #[error("{service} sent an invalid body: {reason}")]
    InvalidBody { service: Service, reason: String },
    #[error("{service} bulkhead full")]
    Shed { service: Service },
    #[error("{service} circuit open")]
    CircuitOpen { service: Service },
    #[error("no budget left to call {service}")]
    BudgetExhausted { service: Service },
    /// A cached call's task ended without an answer (it panicked, or the runtime is shutting
    /// down).
    #[error("the call to {service} was abandoned")]
    Abandoned { service: Service },
}

impl CallError {
    pub(crate) fn outcome(&self) -> Outcome {
        match self {
            CallError::Timeout { .. } => Outcome::Timeout,
            CallError::Status { .. }
            | CallError::Transport { .. }
            | CallError::InvalidBody { .. }
            | CallError::Abandoned { .. } => Outcome::Error,
            CallError::Shed { .. } => Outcome::Shed,
            CallError::CircuitOpen { .. } => Outcome::CircuitOpen,
            CallError::BudgetExhausted { .. } => Outcome::BudgetExhausted,
        }
    }

    /// Worth another attempt: the failure may be transient and the call is idempotent.
    fn retryable(&self) -> bool {
        match self {
            CallError::Transport { .. } => true,
            CallError::Status { status, .. } => matches!(status, 502..=504),
            _ => false,
        }
    }
}

pub(crate) const REQUEST_DURATION: Family = Family::seconds(
    "tributary_downstream_request_duration_seconds",
    "Duration of downstream calls, by service, variant (stable, or a configured grey-release variant) and outcome.",
);
pub(crate) const REQUESTS: Family = Family::counter(
    "tributary_downstream_requests_total",
    "Downstream calls by service, variant (stable, or a configured grey-release variant) and outcome (ok, error, timeout, shed, circuit_open, budget_exhausted).",
);
pub(crate) const IN_FLIGHT: Family = Family::gauge(
    "tributary_downstream_in_flight",
    "Downstream calls in flight per service and variant (bulkhead occupancy).",
);
pub(crate) const CIRCUIT_STATE: Family = Family::gauge(
    "tributary_downstream_circuit_state",
    "Circuit breaker state per service and variant: 0 closed, 1 half-open, 2 open.",
);
pub(crate) const RETRIES: Family = Family::counter(
    "tributary_downstream_retries_total",
    "Retried downstream calls per service.",
);
pub(crate) const HEDGES: Family = Family::counter(
    "tributary_downstream_hedges_total",
    "Hedged second requests sent per service.",
);
pub(crate) const CIRCUIT_TRANSITIONS: Family = Family::counter(
    "tributary_downstream_circuit_transitions_total",
    "Circuit breaker state changes per service, by the state entered (closed, half_open, open).",
);
pub(crate) const BREAKER_IGNORED: Family = Family::counter(
    "tributary_downstream_breaker_ignored_total",
    "Failed downstream calls not counted against the circuit breaker, by reason (request_budget: the caller's budget was too short; gateway_saturated: the gateway's runtime was saturated).",
);

/// The families this module records.
pub(crate) const FAMILIES: &[Family] = &[
    REQUEST_DURATION,
    REQUESTS,
    IN_FLIGHT,
    CIRCUIT_STATE,
    RETRIES,
    HEDGES,
    CIRCUIT_TRANSITIONS,
    BREAKER_IGNORED,
];

/// One service's instruments.
struct Instruments {
    in_flight: Gauge,
    retries: Counter,
    hedges: Counter,
    requests: [Counter; 6],
    duration: [Histogram; 6],
    /// By [`TimeoutCause`] other than `Downstream`: request_budget, gateway_saturated.
    ignored: [Counter; 2],
}

impl Instruments {
    /// `variant` is a bounded label: `stable`, or a name the configuration declares.
    fn register(service: Service, variant: &str) -> Self {
        let service = service.as_str();
        let v = || variant.to_owned();
        Self {
            in_flight: metrics::gauge!(IN_FLIGHT.name, "downstream" => service, "variant" => v()),
            retries: metrics::counter!(RETRIES.name, "downstream" => service, "variant" => v()),
            hedges: metrics::counter!(HEDGES.name, "downstream" => service, "variant" => v()),
            requests: Outcome::ALL.map(|o| {
                metrics::counter!(REQUESTS.name, "downstream" => service, "variant" => v(), "outcome" => o.as_str())
            }),
            duration: Outcome::ALL.map(|o| {
                metrics::histogram!(REQUEST_DURATION.name, "downstream" => service, "variant" => v(), "outcome" => o.as_str())
            }),
            ignored: [TimeoutCause::RequestBudget, TimeoutCause::GatewaySaturated].map(|c| {
                let counter = metrics::counter!(BREAKER_IGNORED.name, "downstream" => service, "variant" => v(), "reason" => c.as_str());
                counter.increment(0);
                counter
            }),
        }
    }

    fn record(&self, outcome: Outcome, elapsed: Duration) {
        let i = outcome as usize;
        self.requests[i].increment(1);
        self.duration[i].record(elapsed.as_secs_f64());
    }
}

/// A successful call: the body, and what the service said about caching it (read only when
/// the service has a cache; otherwise the default, which costs nothing).
pub(crate) struct Fetched {
    pub(crate) body: Box<RawValue>,
    pub(crate) directives: Directives,
}

/// A typed client for one downstream service: its own deployment (`stable`), or one variant of
/// it (a grey release), each an instance of its own with its own pool, bulkhead and breaker.
pub struct Downstream {
    service: Service,
    /// `stable`, or the variant's configured name: the `variant` label and the span's
    /// `service.version`.
    variant: Arc<str>,
    /// [`VARIANT_HEADER`]'s value.
    variant_header: HeaderValue,
    /// The live comparison's window, set once the downstream has variants; while it is unset
    /// (no variants) a call records nothing more and sends no variant header.
    window: OnceLock<Window>,
    /// The client and `{base_url}/{service}/`, prepared once; a call appends the user id.
    /// Handing reqwest a `Url` instead of a string saves a full parse per call (host, IDNA
    /// and all: about 6,000 instructions, 4 % of a dashboard's).
    transport: Transport,
    timeout: Duration,
    hedge_after: Option<Duration>,
    bulkhead: Arc<Semaphore>,
    max_concurrency: usize,
    breaker: Breaker,
    retry: RetrySettings,
    retry_budget: TpsBudget,
    /// The gateway's own deadline: what a call's timeout is judged fair against.
    request_deadline: Duration,
    queue_delay: QueueDelay,
    metrics: Instruments,
    /// Whether `Cache-Control` is read from the answers: only for a service with a cache that
    /// honours it.
    reads_cache_control: bool,
}

/// What one instance is built from: its own part of the settings.
struct Own<'a> {
    base_url: &'a HttpUrl,
    timeout: Duration,
    max_concurrency: usize,
    hedge_after: Option<Duration>,
    /// Whether `Cache-Control` is read from the answers.
    reads_cache_control: bool,
}

impl Downstream {
    /// The client for `service`, from its settings and the shared breaker and retry settings.
    pub(crate) fn new(
        service: Service,
        settings: &Settings,
        client: Client,
        queue_delay: QueueDelay,
    ) -> anyhow::Result<Self> {
        let own = settings.downstreams.get(service);
        let own = Own {
            base_url: &own.base_url,
            timeout: own.timeout,
            max_concurrency: own.max_concurrency.get(),
            hedge_after: own.hedge_after,
            reads_cache_control: own.cache.as_ref().is_some_and(|c| c.honour_cache_control),
        };
        Self::build(service, STABLE.into(), own, settings, client, queue_delay)
    }

    /// The client for one variant of `service`: an instance of its own, with a connection pool
    /// of its own (a pool shared with stable would let a hanging canary hold connections that
    /// stable's calls then wait for), compared with stable over `window`.
    pub(crate) fn variant(
        service: Service,
        name: &str,
        variant: &VariantSettings,
        settings: &Settings,
        queue_delay: QueueDelay,
        window: Duration,
    ) -> anyhow::Result<Self> {
        let client = Client::new(&HttpClientSettings {
            pool_max_idle_per_host: variant.pool_max_idle_per_host,
            ..settings.http_client.clone()
        })?;
        let own = Own {
            base_url: &variant.base_url,
            timeout: variant.timeout,
            max_concurrency: variant.max_concurrency.get(),
            hedge_after: variant.hedge_after,
            // A variant is never cached (the cache holds stable's answers).
            reads_cache_control: false,
        };
        let built = Self::build(service, name.into(), own, settings, client, queue_delay)?;
        built.compare_over(window);
        Ok(built)
    }

    fn build(
        service: Service,
        variant: Arc<str>,
        own: Own<'_>,
        settings: &Settings,
        client: Client,
        queue_delay: QueueDelay,
    ) -> anyhow::Result<Self> {
        let (breaker, retry) = (&settings.circuit_breaker, &settings.retry);
        let mut base = own.base_url.url().clone();
        base.set_path(&format!("{}/{service}/", base.path().trim_end_matches('/')));
        Ok(Self {
            service,
            variant_header: HeaderValue::from_str(&variant)
                .unwrap_or_else(|_| HeaderValue::from_static(STABLE)),
            metrics: Instruments::register(service, &variant),
            window: OnceLock::new(),
            transport: Transport::new(client, &base)?,
            timeout: own.timeout,
            hedge_after: own.hedge_after,
            bulkhead: Arc::new(Semaphore::new(own.max_concurrency)),
            max_concurrency: own.max_concurrency,
            breaker: Breaker::new(
                service.as_str(),
                Arc::clone(&variant),
                breaker.clone(),
                metrics::gauge!(CIRCUIT_STATE.name, "downstream" => service.as_str(), "variant" => variant.to_string()),
            ),
            variant,
            retry: retry.clone(),
            retry_budget: TpsBudget::new(
                Duration::from_secs(10),
                u32::from(retry.budget_min_per_sec),
                retry.budget_ratio.get() as f32,
            ),
            request_deadline: settings.server.request_deadline,
            queue_delay,
            reads_cache_control: own.reads_cache_control,
        })
    }

    pub fn service(&self) -> Service {
        self.service
    }

    /// `stable`, or the variant's name.
    pub fn variant_name(&self) -> &str {
        &self.variant
    }

    /// Starts the live comparison (once; later calls keep the first window): from now on each
    /// call is counted in the window and carries [`VARIANT_HEADER`].
    pub(crate) fn compare_over(&self, window: Duration) {
        self.window.get_or_init(|| Window::new(window));
    }

    /// The live comparison's window, once the downstream has variants.
    pub fn window(&self) -> Option<&Window> {
        self.window.get()
    }

    /// Calls in flight (bulkhead permits taken).
    pub fn in_flight(&self) -> usize {
        self.max_concurrency - self.bulkhead.available_permits()
    }

    pub fn breaker_state(&self) -> breaker::State {
        self.breaker.state()
    }

    /// Calls without the bulkhead's permit taken: for tests and diagnostics.
    pub fn available_permits(&self) -> usize {
        self.bulkhead.available_permits()
    }

    /// `GET {base}/{service}/{user_id}`: the body, validated as JSON and kept as raw text so it
    /// can be embedded in the response without a parse-and-reserialise round trip.
    pub(crate) async fn fetch_user_part(&self, user_id: i64) -> Result<Box<RawValue>, CallError> {
        self.fetch(user_id).await.map(|f| f.body)
    }

    /// [`Self::fetch_user_part`] with the error as its message: public (and hidden) only for
    /// the downstream micro-benchmark in `benches/`, which cannot name the crate-private
    /// [`CallError`]. Not an API.
    #[doc(hidden)]
    pub async fn fetch_user_part_for_bench(&self, user_id: i64) -> Result<Box<RawValue>, String> {
        self.fetch_user_part(user_id)
            .await
            .map_err(|e| e.to_string())
    }

    /// [`Self::fetch_user_part`] with the service's caching directives.
    pub(crate) async fn fetch(&self, user_id: i64) -> Result<Fetched, CallError> {
        let span = tracing::info_span!(
            "downstream.call",
            otel.name = %format_args!("GET /{}/{{user_id}}", self.service),
            otel.kind = "client",
            http.request.method = "GET",
            server.address = self.service.as_str(),
            service.version = &*self.variant,
            downstream = self.service.as_str(),
            http.response.status_code = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        let started = Instant::now();
        // Without span export the call span is disabled, and instrumenting with it would only
        // move the call's future (some 1.9 KB) into a wrapper whose every poll enters nothing.
        let result = if span.is_disabled() {
            self.call(user_id, &span, started).await
        } else {
            self.call(user_id, &span, started)
                .instrument(span.clone())
                .await
        };
        let outcome = match &result {
            Ok(_) => Outcome::Ok,
            Err(e) => e.outcome(),
        };
        span.record("outcome", outcome.as_str());
        let elapsed = started.elapsed();
        self.metrics.record(outcome, elapsed);
        if let Some(window) = self.window.get() {
            window.record(outcome, elapsed);
        }
        result
    }

    /// `started` is when the caller started timing the call: one clock read for both.
    async fn call(
        &self,
        user_id: i64,
        span: &Span,
        started: Instant,
    ) -> Result<Fetched, CallError> {
        let service = self.service;
        // A ticket rather than a bare admission: if this future is dropped mid-call, the
        // ticket still gives a half-open probe slot back (see `breaker::Ticket`).
        let Some(ticket) = self.breaker.ticket() else {
            return Err(CallError::CircuitOpen { service });
        };
        // Bulkhead: never queue behind a saturated dependency; degrade instead.
        let Ok(permit) = Arc::clone(&self.bulkhead).try_acquire_owned() else {
            ticket.release();
            return Err(CallError::Shed { service });
        };
        let _in_flight = InFlight::new(&self.metrics.in_flight, permit);
        self.retry_budget.deposit();
        let mut attempt = 0;
        let result = loop {
            let result = match self.hedge_after {
                // Boxed: a hedge holds two exchanges at once (2.7 KB), and inline it would more
                // than double every call's future, and so every dashboard's, which holds five
                // calls, though hedging is off unless configured.
                Some(after) => Box::pin(self.hedged(user_id, after, span)).await,
                None => self.attempt(user_id, span).await,
            };
            match result {
                // No retry while the gateway's own CPU is short: it would only add load there.
                Err(e)
                    if e.retryable()
                        && attempt < self.retry.max_retries
                        && !self.queue_delay.is_saturated() =>
                {
                    let backoff = jittered(self.retry.backoff_base, attempt);
                    // Never retry past the deadline: the retry must fit in what is left.
                    if remaining() < backoff + MIN_CALL_BUDGET * 5 || !self.retry_budget.withdraw()
                    {
                        break Err(e);
                    }
                    attempt += 1;
                    self.metrics.retries.increment(1);
                    tracing::debug!(downstream = %service, error = %e, attempt, "retrying");
                    tokio::time::sleep(backoff).await;
                }
                other => break other,
            }
        };
        let ignored = match &result {
            Ok(_) => {
                ticket.record(true);
                return result;
            }
            // The caller's own budget running out says nothing about the dependency's health.
            Err(CallError::BudgetExhausted { .. }) => {
                ticket.release();
                return result;
            }
            Err(CallError::Timeout { cause, .. }) if *cause != TimeoutCause::Downstream => {
                Some(*cause)
            }
            // A connect or read timeout of the HTTP client while the runtime was saturated.
            Err(CallError::Transport { timed_out, .. })
                if *timed_out && self.queue_delay.saturated_since(started) =>
            {
                Some(TimeoutCause::GatewaySaturated)
            }
            Err(_) => None,
        };
        match ignored {
            Some(cause) => {
                ticket.release();
                let i = usize::from(cause == TimeoutCause::GatewaySaturated);
                self.metrics.ignored[i].increment(1);
            }
            None => ticket.record(false),
        }
        result
    }

    /// Sends a second request if the first is slower than `after`; the first success wins and
    /// the loser is cancelled by being dropped.
    async fn hedged(
        &self,
        user_id: i64,
        after: Duration,
        span: &Span,
    ) -> Result<Fetched, CallError> {
        let first = self.attempt(user_id, span);
        tokio::pin!(first);
        tokio::select! {
            r = &mut first => return r,
            _ = tokio::time::sleep(after) => {}
        }
        if remaining() < MIN_CALL_BUDGET * 5
            || self.queue_delay.is_saturated()
            || !self.retry_budget.withdraw()
        {
            return first.await;
        }
        self.metrics.hedges.increment(1);
        let second = self.attempt(user_id, span);
        tokio::pin!(second);
        tokio::select! {
            r = &mut first => match r {
                Ok(v) => Ok(v),
                Err(_) => second.await,
            },
            r = &mut second => match r {
                Ok(v) => Ok(v),
                Err(_) => first.await,
            },
        }
    }

    /// One HTTP exchange bounded by min(call timeout, remaining budget); the status goes on
    /// `span`, the call's (a no-op when call spans are not exported).
    async fn attempt(&self, user_id: i64, span: &Span) -> Result<Fetched, CallError> {
        let service = self.service;
        // One clock read for the budget, the timer and the timeout's cause.
        let started = Instant::now();
        let budget = crate::context::deadline().saturating_duration_since(started);
        if budget < MIN_CALL_BUDGET {
            return Err(CallError::BudgetExhausted { service });
        }
        let timeout = self.timeout.min(budget);
        let fair = self.timeout.min(self.request_deadline);
        let mut headers = self.transport.headers();
        headers.insert(BUDGET_HEADER, budget_value(timeout.as_millis() as u64));
        let ctx = crate::context::current();
        if let Some(id) = ctx.as_ref().and_then(|c| c.request_id_header()) {
            headers.insert(crate::context::REQUEST_ID_HEADER, id.clone());
        }
        let trace = crate::telemetry::outgoing_trace_headers(ctx.as_deref());
        if let Some(traceparent) = trace.traceparent {
            headers.insert(crate::telemetry::TRACEPARENT, traceparent);
        }
        if let Some(tracestate) = trace.tracestate {
            headers.insert(crate::telemetry::TRACESTATE, tracestate);
        }
        if self.window.get().is_some() {
            headers.insert(VARIANT_HEADER, self.variant_header.clone());
        }
        let exchange = async {
            let target = self.transport.target(user_id);
            let response = self.transport.send(service, target, headers).await?;
            let status = response.status();
            // An i64: OpenTelemetry has no unsigned integers, and a u64 is exported as a string.
            span.record("http.response.status_code", i64::from(status.as_u16()));
            if !status.is_success() {
                return Err(CallError::Status {
                    service,
                    status: status.as_u16(),
                });
            }
            let directives = if self.reads_cache_control {
                response
                    .headers()
                    .get(http::header::CACHE_CONTROL)
                    .and_then(|v| v.to_str().ok())
                    .map_or_else(Directives::default, Directives::parse)
            } else {
                Directives::default()
            };
            let body = response.body(service).await?;
            // Validate without building a DOM: RawValue keeps the original bytes.
            let text = String::from_utf8(body.into()).map_err(|_| CallError::InvalidBody {
                service,
                reason: "not UTF-8".into(),
            })?;
            let body = RawValue::from_string(text).map_err(|e| CallError::InvalidBody {
                service,
                reason: e.to_string(),
            })?;
            Ok(Fetched { body, directives })
        };
        match tokio::time::timeout_at(started + timeout, exchange).await {
            Ok(result) => result,
            Err(_) => Err(CallError::Timeout {
                service,
                cause: TimeoutCause::of(
                    timeout,
                    fair,
                    self.queue_delay.fired_late(started + timeout),
                    self.queue_delay.saturated_since(started),
                ),
            }),
        }
    }
}

/// Exponential backoff with full jitter: uniform in [0, base × 2^attempt].
fn jittered(base: Duration, attempt: u32) -> Duration {
    let cap = base.saturating_mul(1 << attempt.min(10));
    let nanos = rand::rng().random_range(0..=cap.as_nanos().max(1) as u64);
    Duration::from_nanos(nanos)
}

/// Holds the bulkhead permit and keeps the in-flight gauge right on every exit path,
/// including cancellation.
struct InFlight<'a> {
    gauge: &'a Gauge,
    _permit: OwnedSemaphorePermit,
}

impl<'a> InFlight<'a> {
    fn new(gauge: &'a Gauge, permit: OwnedSemaphorePermit) -> Self {
        gauge.increment(1.0);
        Self {
            gauge,
            _permit: permit,
        }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.gauge.decrement(1.0);
    }
}

/// The five clients, built once at start-up, and the caches in front of those that have one.
pub struct Downstreams {
    /// One per service, indexed by it; shared with the tasks of cached calls.
    clients: [Arc<Downstream>; 5],
    /// Indexed by service; `None` for a service without `cache` settings.
    caches: [Option<PartCache>; 5],
}

impl Downstreams {
    pub(crate) fn new(
        settings: &Settings,
        client: Client,
        queue_delay: &QueueDelay,
    ) -> anyhow::Result<Self> {
        let mut clients = Vec::with_capacity(Service::ALL.len());
        for service in Service::ALL {
            let client = Downstream::new(service, settings, client.clone(), queue_delay.clone())?;
            clients.push(Arc::new(client));
        }
        Ok(Self {
            clients: clients
                .try_into()
                .unwrap_or_else(|_| unreachable!("one per service")),
            // Every series exists from start-up, cached or not, as the other per-service ones.
            caches: Service::ALL.map(|service| {
                let metrics = cache::Instruments::register(service);
                let policy = settings.downstreams.get(service).cache.as_ref()?;
                Some(PartCache::new(
                    service,
                    policy,
                    settings.server.request_deadline,
                    metrics,
                ))
            }),
        })
    }

    /// The client of one service.
    pub fn get(&self, service: Service) -> &Downstream {
        &self.clients[service as usize]
    }

    pub fn all(&self) -> [&Downstream; 5] {
        self.clients.each_ref().map(|c| &**c)
    }

    /// The cache in front of one service, if it has one.
    pub fn cache(&self, service: Service) -> Option<&PartCache> {
        self.caches[service as usize].as_ref()
    }

    /// One service's part for `user_id`: through its cache when it has one, where it may be
    /// a cached or a stale answer ([`Source`]); straight from the service otherwise.
    pub(crate) async fn fetch_part(
        &self,
        service: Service,
        user_id: i64,
    ) -> Result<(Box<RawValue>, Source), CallError> {
        let client = &self.clients[service as usize];
        match &self.caches[service as usize] {
            None => client
                .fetch_user_part(user_id)
                .await
                .map(|body| (body, Source::Downstream)),
            Some(cache) => cache.fetch(client, user_id).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeout_is_the_downstreams_only_if_it_had_a_fair_chance_on_a_calm_gateway() {
        let ms = Duration::from_millis;
        let of = TimeoutCause::of;
        assert_eq!(of(ms(500), ms(500), false, false), TimeoutCause::Downstream);
        assert_eq!(
            of(ms(300), ms(500), false, false),
            TimeoutCause::Downstream,
            "a budget that cut the call a little still leaves the downstream responsible"
        );
        assert_eq!(
            of(ms(8), ms(500), false, false),
            TimeoutCause::RequestBudget,
            "an 8 ms budget says nothing about a service given 500 ms"
        );
        assert_eq!(
            of(ms(500), ms(500), true, false),
            TimeoutCause::GatewaySaturated,
            "a timer that fired late waited for a worker"
        );
        assert_eq!(
            of(ms(500), ms(500), false, true),
            TimeoutCause::GatewaySaturated
        );
    }

    #[test]
    fn a_budget_value_is_the_number_formatted_whether_made_once_or_per_call() {
        let edges = [0, 1, 9, 10, 99, 100, 500, 999, 1000, 2047, 2048, 10_000];
        for ms in edges.into_iter().chain([u64::MAX]) {
            assert_eq!(budget_value(ms), HeaderValue::from(ms), "at {ms} ms");
        }
    }

    #[test]
    fn jitter_stays_within_the_exponential_cap() {
        for attempt in 0..4 {
            for _ in 0..100 {
                let d = jittered(Duration::from_millis(10), attempt);
                assert!(d <= Duration::from_millis(10 << attempt));
            }
        }
    }

    /// Every dashboard holds five calls' futures at once, each in a box the size of its
    /// largest state: a hedge (two exchanges in flight) inline would make every call carry two
    /// exchanges' room, hedging configured or not. Sizes are the compiler's, not timings.
    #[test]
    fn a_call_future_holds_room_for_one_exchange_not_a_hedges_two() {
        use crate::config::TransportKind;
        let settings = Settings::default();
        for transport in [TransportKind::Reqwest, TransportKind::Hyper] {
            let http = HttpClientSettings {
                transport,
                ..settings.http_client.clone()
            };
            let queue_delay = QueueDelay::manual(Duration::from_millis(5));
            let downstream = Downstream::new(
                Service::Carts,
                &settings,
                Client::new(&http).unwrap(),
                queue_delay,
            )
            .unwrap();
            let span = Span::none();
            let exchange = std::mem::size_of_val(&downstream.attempt(1, &span));
            let hedge =
                std::mem::size_of_val(&downstream.hedged(1, Duration::from_millis(1), &span));
            let call = std::mem::size_of_val(&downstream.call(1, &span, Instant::now()));
            assert!(
                hedge >= 2 * exchange,
                "{transport:?}: a hedge holds two exchanges"
            );
            assert!(
                call < exchange + exchange / 2,
                "{transport:?}: a call's future is {call} bytes, an exchange's {exchange}: the hedge is inline"
            );
        }
    }
}
