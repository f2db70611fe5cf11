//! The downstream simulator: the five services the gateway fans out to, with latency, errors
//! and failure modes you can set — at start-up by flags, and per service at run time through
//! a small control API (`PUT /_sim/services/{service}`), which is how the fault-injection tests
//! make one dependency slow, hang, fail or reset connections while the gateway keeps running.
//!
//! It also keeps score of what it saw: requests, in-flight calls, calls abandoned by the caller
//! before they finished (the proof that the gateway cancels), and a bounded journal of the
//! request ids, trace context and budgets that arrived with each call.
//!
//! It is a crate of its own, beside the gateway's: a library so that the gateway's tests can run
//! it in-process on port 0, and the `downstream-sim` binary, a thin wrapper for compose,
//! Kubernetes and the benchmark lab. It depends on the gateway's library only for the
//! vocabulary (`Service`) and the listener set-up, so the production library carries none of
//! it.

use std::{
    collections::{BTreeMap, VecDeque},
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use axum::{
    Json, Router,
    extract::{Path, State},
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::{get, put},
};
use rand::Rng;
use serde::{Deserialize, Serialize};

use tributary::domain::Service;

/// How a service behaves.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Behaviour {
    /// Base latency.
    #[serde(with = "humantime_serde")]
    pub latency: Duration,
    /// Uniform jitter added to or taken from the latency.
    #[serde(with = "humantime_serde")]
    pub jitter: Duration,
    /// Share of requests answered with 500.
    pub error_rate: f64,
    /// Approximate size of each JSON body.
    pub body_bytes: usize,
    /// CPU burnt per request (busy loop on a blocking thread), to model a CPU-heavy service.
    #[serde(with = "humantime_serde")]
    pub cpu_work: Duration,
    pub mode: Mode,
    /// `Cache-Control` sent with every successful answer (none when unset), for the gateway's
    /// cache tests and the lab's caching scenario.
    #[serde(default)]
    pub cache_control: Option<String>,
}

impl Default for Behaviour {
    fn default() -> Self {
        Self {
            latency: Duration::from_millis(20),
            jitter: Duration::ZERO,
            error_rate: 0.0,
            body_bytes: 512,
            cpu_work: Duration::ZERO,
            mode: Mode::Normal,
            cache_control: None,
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    Normal,
    /// Never answers.
    Hang,
    /// Closes the connection without an answer.
    Reset,
    /// Answers 200 with a body that is not JSON.
    InvalidJson,
    /// Answers 404.
    NotFound,
}

/// One call as the simulator saw it.
#[derive(Debug, Clone, Serialize)]
pub struct Seen {
    pub service: Service,
    pub user_id: i64,
    pub request_id: Option<String>,
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
    pub budget_ms: Option<u64>,
    /// The gateway's `x-tributary-variant`: which variant (grey release) it meant to call.
    pub variant: Option<String>,
    pub user_agent: Option<String>,
    pub accept: Option<String>,
    /// `Authorization`, as sent (a test's own credentials, never a real secret).
    pub authorization: Option<String>,
    /// The protocol the call came over: `HTTP/1.1` or `HTTP/2.0`.
    pub http_version: String,
}

#[derive(Debug, Default, Serialize, Clone)]
pub struct ServiceStats {
    pub requests: u64,
    pub in_flight: u64,
    pub completed: u64,
    /// Calls whose caller went away before the answer was sent.
    pub cancelled: u64,
}

const JOURNAL: usize = 20_000;

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    in_flight: AtomicU64,
    completed: AtomicU64,
    cancelled: AtomicU64,
}

/// Shared simulator state, per service indexed by [`Service`].
pub struct Sim {
    behaviour: Mutex<[Behaviour; 5]>,
    counters: [Counters; 5],
    journal: Mutex<VecDeque<Seen>>,
    /// TCP connections accepted, over all services (they share one listener).
    connections: AtomicU64,
}

impl Sim {
    pub fn new(default: Behaviour) -> Arc<Self> {
        Arc::new(Self {
            behaviour: Mutex::new(Service::ALL.map(|_| default.clone())),
            counters: Default::default(),
            journal: Mutex::new(VecDeque::with_capacity(1024)),
            connections: AtomicU64::new(0),
        })
    }

    pub fn set(&self, service: Service, behaviour: Behaviour) {
        self.behaviour.lock().unwrap_or_else(|p| p.into_inner())[service as usize] = behaviour;
    }

    pub fn behaviour(&self, service: Service) -> Behaviour {
        self.behaviour.lock().unwrap_or_else(|p| p.into_inner())[service as usize].clone()
    }

    pub fn stats(&self, service: Service) -> ServiceStats {
        let c = &self.counters[service as usize];
        ServiceStats {
            requests: c.requests.load(Ordering::Relaxed),
            in_flight: c.in_flight.load(Ordering::Relaxed),
            completed: c.completed.load(Ordering::Relaxed),
            cancelled: c.cancelled.load(Ordering::Relaxed),
        }
    }

    /// TCP connections accepted since the simulator started.
    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }

    pub fn journal(&self) -> Vec<Seen> {
        self.journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    fn record(&self, seen: Seen) {
        let mut j = self.journal.lock().unwrap_or_else(|p| p.into_inner());
        if j.len() == JOURNAL {
            j.pop_front();
        }
        j.push_back(seen);
    }
}

/// Marks a call cancelled unless it completed: the handler future is dropped mid-way when the
/// caller closes the connection.
struct CallGuard<'a> {
    counters: &'a Counters,
    done: bool,
}

impl Drop for CallGuard<'_> {
    fn drop(&mut self) {
        self.counters.in_flight.fetch_sub(1, Ordering::Relaxed);
        if self.done {
            self.counters.completed.fetch_add(1, Ordering::Relaxed);
        } else {
            self.counters.cancelled.fetch_add(1, Ordering::Relaxed);
        }
    }
}

pub fn router(sim: Arc<Sim>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/_sim/services/{service}",
            put(set_behaviour).get(get_behaviour),
        )
        .route("/_sim/stats", get(stats))
        .route("/_sim/journal", get(journal))
        .route("/{service}/{user_id}", get(serve))
        .with_state(sim)
}

async fn serve(
    State(sim): State<Arc<Sim>>,
    Path((service, user_id)): Path<(String, i64)>,
    version: axum::http::Version,
    headers: HeaderMap,
) -> Response {
    let Ok(service) = service.parse::<Service>() else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let counters = &sim.counters[service as usize];
    let b = sim.behaviour(service);
    counters.requests.fetch_add(1, Ordering::Relaxed);
    counters.in_flight.fetch_add(1, Ordering::Relaxed);
    let mut guard = CallGuard {
        counters,
        done: false,
    };
    let header = |n: &str| {
        headers
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    sim.record(Seen {
        service,
        user_id,
        request_id: header("x-request-id"),
        traceparent: header("traceparent"),
        tracestate: header("tracestate"),
        budget_ms: header("x-request-budget-ms").and_then(|v| v.parse().ok()),
        variant: header("x-tributary-variant"),
        user_agent: header("user-agent"),
        accept: header("accept"),
        authorization: header("authorization"),
        http_version: format!("{version:?}"),
    });

    let delay = {
        let mut rng = rand::rng();
        let jitter = b.jitter.as_secs_f64();
        let offset = if jitter > 0.0 {
            rng.random_range(-jitter..=jitter)
        } else {
            0.0
        };
        Duration::from_secs_f64((b.latency.as_secs_f64() + offset).max(0.0))
    };
    let fail = b.error_rate > 0.0 && rand::rng().random_bool(b.error_rate.min(1.0));
    match b.mode {
        Mode::Hang => std::future::pending::<()>().await,
        Mode::Reset => {
            // Dropping the connection from inside a handler: a body that fails mid-stream makes
            // hyper abort the connection (see `reset_connection`).
            guard.done = true;
            drop(guard);
            return reset_connection();
        }
        _ => {}
    }
    // Not even a zero sleep: tokio's timer rounds a deadline up to its next millisecond tick,
    // so `latency = 0` would still answer up to a millisecond late.
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    if !b.cpu_work.is_zero() {
        let work = b.cpu_work;
        let _ = tokio::task::spawn_blocking(move || burn(work)).await;
    }
    guard.done = true;
    if fail {
        return (StatusCode::INTERNAL_SERVER_ERROR, "simulated failure").into_response();
    }
    match b.mode {
        Mode::InvalidJson => (StatusCode::OK, "{not json").into_response(),
        Mode::NotFound => StatusCode::NOT_FOUND.into_response(),
        _ => {
            let mut response = (
                [(axum::http::header::CONTENT_TYPE, "application/json")],
                body(service, user_id, b.body_bytes),
            )
                .into_response();
            if let Some(value) = b
                .cache_control
                .as_deref()
                .and_then(|v| axum::http::HeaderValue::from_str(v).ok())
            {
                response
                    .headers_mut()
                    .insert(axum::http::header::CACHE_CONTROL, value);
            }
            response
        }
    }
}

/// A response whose body errors mid-stream makes hyper abort the connection: the closest an
/// HTTP server gets to a TCP reset from inside a handler.
fn reset_connection() -> Response {
    let stream = futures::stream::once(async {
        Err::<bytes::Bytes, std::io::Error>(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "simulated reset",
        ))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-length", "100")
        .body(axum::body::Body::from_stream(stream))
        .expect("static response")
}

fn burn(d: Duration) {
    let end = std::time::Instant::now() + d;
    let mut x = 0u64;
    while std::time::Instant::now() < end {
        x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
    }
}

fn body(service: Service, user_id: i64, size: usize) -> String {
    let mut out = format!(r#"{{"service":"{service}","user_id":{user_id},"data":""#);
    let pad = size.saturating_sub(out.len() + 2);
    out.extend(std::iter::repeat_n('x', pad));
    out.push_str("\"}");
    out
}

async fn set_behaviour(
    State(sim): State<Arc<Sim>>,
    Path(service): Path<String>,
    Json(b): Json<Behaviour>,
) -> StatusCode {
    let Ok(service) = service.parse() else {
        return StatusCode::NOT_FOUND;
    };
    sim.set(service, b);
    StatusCode::NO_CONTENT
}

async fn get_behaviour(State(sim): State<Arc<Sim>>, Path(service): Path<String>) -> Response {
    match service.parse() {
        Ok(service) => Json(sim.behaviour(service)).into_response(),
        Err(_) => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn stats(State(sim): State<Arc<Sim>>) -> Json<BTreeMap<Service, ServiceStats>> {
    Json(
        Service::ALL
            .into_iter()
            .map(|s| (s, sim.stats(s)))
            .collect(),
    )
}

async fn journal(State(sim): State<Arc<Sim>>) -> Json<Vec<Seen>> {
    Json(sim.journal())
}

/// A running simulator.
pub struct SimHandle {
    pub addr: SocketAddr,
    pub sim: Arc<Sim>,
    task: tokio::task::JoinHandle<()>,
}

impl SimHandle {
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves the simulator on `addr` (port 0 for an ephemeral port) in a background task.
pub async fn spawn(addr: SocketAddr, default: Behaviour) -> std::io::Result<SimHandle> {
    // The gateway opens one connection per concurrent call; a wide accept queue keeps a cold
    // start with thousands of simultaneous connects from dropping SYNs.
    let listener = tributary::startup::listen(addr, 4096)?;
    let addr = listener.local_addr()?;
    let sim = Sim::new(default);
    let app = router(Arc::clone(&sim));
    // TCP_NODELAY: an HTTP/2 answer is two frames (HEADERS, DATA), which Nagle's algorithm would
    // hold behind the client's delayed ACK, 40 ms a call; an HTTP/1 answer is one write anyway.
    let counted = Arc::clone(&sim);
    let listener = axum::serve::ListenerExt::tap_io(listener, move |tcp| {
        counted.connections.fetch_add(1, Ordering::Relaxed);
        let _ = tcp.set_nodelay(true);
    });
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(SimHandle { addr, sim, task })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a runtime without a timer a sleep panics: this answers only if no timer is armed.
    #[test]
    fn no_latency_answers_without_arming_a_timer() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let sim = Sim::new(Behaviour {
            latency: Duration::ZERO,
            ..Behaviour::default()
        });
        let response = rt.block_on(serve(
            State(sim),
            Path(("carts".into(), 7)),
            axum::http::Version::HTTP_11,
            HeaderMap::new(),
        ));
        assert_eq!(response.status(), StatusCode::OK);
    }

    #[test]
    fn bodies_are_json_of_about_the_requested_size() {
        for size in [0, 64, 512, 4096] {
            let b = body(Service::Carts, 7, size);
            let v: serde_json::Value = serde_json::from_str(&b).unwrap();
            assert_eq!(v["user_id"], 7);
            if size > 64 {
                assert_eq!(b.len(), size);
            }
        }
    }
}
