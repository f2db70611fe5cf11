//! Load generator of the benchmark lab's `overload-curve` scenario (see `bench/`).
//!
//! The rest of the lab drives load with wrk, which can only do one thing: a closed loop, where
//! each connection sends its next request the moment the previous answer arrives. That is the
//! worst client an overloaded server can have (a rejection comes back at once as a new
//! request), but it is not the only one, and it hides two others the overload curve needs:
//!
//! - **open loop** (`--rate R`): requests arrive on a fixed schedule, R per second, whatever the
//!   server does, as real traffic from many independent users does. wrk cannot do this (its
//!   offered load falls as the server slows down: coordinated omission); `oha -q R` can and is an
//!   alternative, but it neither tells a degraded dashboard from a full one nor honours
//!   `Retry-After`. Requests go out over a pool of keep-alive connections; when every
//!   connection is busy a new one is opened, up to `--max-connections`; a request that finds no
//!   free connection at the cap is not sent and counts as `unsent` (late). Latency is measured
//!   from the request's *scheduled* time, so queueing in the client is not hidden.
//! - **a client that honours `Retry-After`** (`--retry-after N`): a closed loop of N connections
//!   that, on a 503 or 429, waits the `Retry-After` seconds (1 s when the header is missing,
//!   which is counted) before its next request on that connection, as SDKs with a retry policy do.
//! - and the closed loop itself (`--closed N`), so all three shapes count outcomes the same way.
//!   In both closed loops a request is timed from when it is sent, as wrk does; the time to
//!   open a new connection is counted apart (`connect_ms`). Until 2026-12-05 it was in the first
//!   request's latency, and at 10,000 connections opened at once (past the server's accept
//!   queue, so some SYNs were dropped and retried after 1, 2, 4 s) some runs still had 800–1,900
//!   connections opening in the first measured seconds: a p99 of full 200s of 1.7–4.3 s, while
//!   the server answered every 200 within 250 ms.
//!   `--spike-to M --spike-at T --spike-for D` adds a step to it: T seconds into the measured
//!   window, M − N more connections join for D seconds and then leave (each finishes the request
//!   it has in flight), the shape of a traffic spike against a server that was coping.
//!
//! Ids: `{id}` in `--path-template` is drawn uniformly from 1..=`--id-max`, or with `--zipf S`
//! from a Zipf distribution of exponent S (id k with weight 1/k^S, id 1 the most frequent): real
//! users are not uniform, and a per-user cache's hit ratio depends on exactly that skew. The draw
//! is one uniform number and a binary search in a precomputed table of the cumulative weights.
//!
//! Outcomes: a **full** 200 (the dashboard's `degraded` list is empty, or the body has no such
//! field), a **degraded** 200 (`"degraded":[...]` names a part: see `src/fanout.rs`), 503, 429,
//! other statuses, and socket errors by kind (connect, read, write, timeout after `--timeout`).
//! Each outcome has its own HDR latency histogram. `--warmup` seconds of the same load come
//! first, on the same connections, and are not counted; the line `LOADGEN_MEASURING` on stdout
//! marks the start of the measured `--duration` (so a caller can take its own snapshots then).
//! Requests still in flight when it ends are counted as `in_flight_at_end`, not as errors. A response with `Connection: close`
//! (or a connection the server closed) makes the client reconnect; that is counted, not an error.
//! A request that never left because the kept-alive connection it was given had just been closed
//! by the server (its idle timeout racing the reuse) is sent once more on a new connection, as
//! real clients do (hyper-util's pool, RFC 9112 §9.3.1); that is counted as `stale_retries`, not
//! as a write error.
//! Besides the totals, `series` has the same outcomes per second of the measured window (by the
//! second an answer arrived) with the requests sent and the most connections open in that
//! second, so a spike can be read over time.
//!
//! The result is one JSON document, written to `--json PATH` (or `$LOADGEN_JSON`), and one
//! summary line on stdout. `bench/lib/measure.py --loadgen` runs it and folds the JSON into the
//! lab's run record. Example:
//!
//! ```sh
//! cargo build --release --example loadgen
//! target/release/examples/loadgen --target http://127.0.0.1:8080 --rate 5000 --duration 10 \
//!     --path-template '/api/v1/dashboard/{id}' --id-max 10000 --json /tmp/run.json
//! ```

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use clap::Parser;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt as _, Empty};
use hyper::client::conn::http1::SendRequest;
use hyper::{Request, header};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Closed-loop, open-loop and Retry-After-honouring HTTP/1.1 load generator")]
struct Args {
    /// Base URL of the server, e.g. http://127.0.0.1:8080
    #[arg(long)]
    target: String,
    /// Closed loop: N connections, each sending its next request as soon as the answer arrives.
    #[arg(long, group = "mode")]
    closed: Option<usize>,
    /// Open loop: R requests per second on a fixed schedule.
    #[arg(long, group = "mode")]
    rate: Option<f64>,
    /// Closed loop of N connections that waits Retry-After seconds after a 503 or 429.
    #[arg(long, group = "mode")]
    retry_after: Option<usize>,
    /// Seconds of measured load.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Seconds of the same load before the measured window, not counted.
    #[arg(long, default_value_t = 0.0)]
    warmup: f64,
    /// Request path; `{id}` is replaced by a random id in 1..=--id-max (uniform, or --zipf).
    #[arg(long, default_value = "/")]
    path_template: String,
    #[arg(long, default_value_t = 1)]
    id_max: u64,
    /// Draw ids from a Zipf distribution with this exponent (e.g. 1.05) instead of uniformly.
    #[arg(long)]
    zipf: Option<f64>,
    /// Closed loop: the connections during a spike (more than --closed).
    #[arg(long, requires = "closed")]
    spike_to: Option<usize>,
    /// Seconds into the measured window at which the spike starts.
    #[arg(long, default_value_t = 0.0)]
    spike_at: f64,
    /// Seconds the spike lasts.
    #[arg(long, default_value_t = 0.0)]
    spike_for: f64,
    /// Open loop: most connections open at once.
    #[arg(long, default_value_t = 10_000)]
    max_connections: usize,
    /// Seconds after which an unanswered request counts as a timeout (wrk's default is 2 s, the lab's 10 s).
    #[arg(long, default_value_t = 10.0)]
    timeout: f64,
    /// Where to write the JSON result (default: $LOADGEN_JSON; neither: stdout only).
    #[arg(long, env = "LOADGEN_JSON")]
    json: Option<PathBuf>,
}

/// How one request ended.
#[derive(Clone, Copy, PartialEq)]
enum Outcome {
    Full,
    Degraded,
    Rejected503,
    Rejected429,
    Other(u16),
    Connect,
    Read,
    Write,
    Timeout,
}

/// Everything counted, shared by all tasks (the runtime has one thread: the lock is uncontended).
struct Stats {
    full: Histogram<u64>,
    degraded: Histogram<u64>,
    rejected: Histogram<u64>,
    other: Histogram<u64>,
    /// Closed loop: how long opening each new connection took (measured window only). Not in
    /// the requests' latency: a closed-loop request is timed from when it is sent.
    connect: Histogram<u64>,
    status: BTreeMap<u16, u64>,
    errors: BTreeMap<&'static str, u64>,
    /// False during the warm-up: nothing is counted then.
    measuring: bool,
    /// Requests sent and not yet answered (nor failed).
    in_flight: u64,
    sent: u64,
    unsent: u64,
    reconnects: u64,
    /// Requests sent again on a new connection after their kept-alive one was found closed.
    stale_retries: u64,
    connections_opened: u64,
    connections_max: usize,
    open: usize,
    retry_after_waits: u64,
    retry_after_missing: u64,
    retry_after_wait_s: f64,
    /// Start of the measured window: second 0 of `series`.
    measured_from: Instant,
    series: Vec<Second>,
}

/// What happened in one second of the measured window.
#[derive(Default, Clone, serde::Serialize)]
struct Second {
    full: u64,
    degraded: u64,
    /// 503 and 429.
    rejected: u64,
    other: u64,
    /// Socket errors of every kind.
    errors: u64,
    sent: u64,
    /// The most connections open at once in this second.
    open_max: usize,
}

impl Stats {
    fn new(measured_from: Instant) -> Self {
        let h = || Histogram::new_with_bounds(1, 120_000_000, 3).expect("valid bounds");
        Stats {
            full: h(),
            degraded: h(),
            rejected: h(),
            other: h(),
            connect: h(),
            status: BTreeMap::new(),
            errors: ["connect", "read", "write", "timeout"]
                .map(|k| (k, 0))
                .into(),
            measuring: false,
            in_flight: 0,
            sent: 0,
            unsent: 0,
            reconnects: 0,
            stale_retries: 0,
            connections_opened: 0,
            connections_max: 0,
            open: 0,
            retry_after_waits: 0,
            retry_after_missing: 0,
            retry_after_wait_s: 0.0,
            measured_from,
            series: Vec::new(),
        }
    }

    /// This second's entry of the series (created on first use).
    fn second(&mut self) -> &mut Second {
        let at = Instant::now().saturating_duration_since(self.measured_from);
        let index = usize::try_from(at.as_secs()).unwrap_or(usize::MAX);
        if self.series.len() <= index {
            self.series.resize(index + 1, Second::default());
        }
        &mut self.series[index]
    }

    fn send(&mut self) {
        self.in_flight += 1;
        if self.measuring {
            self.sent += 1;
            let open = self.open;
            let second = self.second();
            second.sent += 1;
            second.open_max = second.open_max.max(open);
        }
    }

    fn record(&mut self, outcome: Outcome, latency: Duration) {
        if outcome != Outcome::Connect {
            self.in_flight = self.in_flight.saturating_sub(1);
        }
        if !self.measuring {
            return;
        }
        let us = u64::try_from(latency.as_micros())
            .unwrap_or(u64::MAX)
            .max(1);
        let (histogram, status, error) = match outcome {
            Outcome::Full => (Some(&mut self.full), Some(200), None),
            Outcome::Degraded => (Some(&mut self.degraded), Some(200), None),
            Outcome::Rejected503 => (Some(&mut self.rejected), Some(503), None),
            Outcome::Rejected429 => (Some(&mut self.rejected), Some(429), None),
            Outcome::Other(s) => (Some(&mut self.other), Some(s), None),
            Outcome::Connect => (None, None, Some("connect")),
            Outcome::Read => (None, None, Some("read")),
            Outcome::Write => (None, None, Some("write")),
            Outcome::Timeout => (None, None, Some("timeout")),
        };
        if let Some(h) = histogram {
            h.saturating_record(us);
        }
        let second = self.second();
        match outcome {
            Outcome::Full => second.full += 1,
            Outcome::Degraded => second.degraded += 1,
            Outcome::Rejected503 | Outcome::Rejected429 => second.rejected += 1,
            Outcome::Other(_) => second.other += 1,
            Outcome::Connect | Outcome::Read | Outcome::Write | Outcome::Timeout => {
                second.errors += 1;
            }
        }
        if let Some(s) = status {
            *self.status.entry(s).or_default() += 1;
        }
        if let Some(e) = error {
            *self.errors.entry(e).or_default() += 1;
        }
    }

    fn opened(&mut self) {
        self.open += 1;
        self.connections_opened += 1;
        self.connections_max = self.connections_max.max(self.open);
    }

    /// A closed-loop connection opened in `took`.
    fn connected(&mut self, took: Duration) {
        self.opened();
        if self.measuring {
            let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX).max(1);
            self.connect.saturating_record(us);
        }
    }
}

/// What every task needs: where to send, what, until when.
struct Shared {
    addr: SocketAddr,
    host: String,
    template: String,
    ids: Ids,
    timeout: Duration,
    deadline: Instant,
    stats: Mutex<Stats>,
    /// Open loop: idle keep-alive connections.
    idle: Mutex<Vec<SendRequest<Empty<Bytes>>>>,
}

impl Shared {
    fn stats(&self) -> std::sync::MutexGuard<'_, Stats> {
        self.stats.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn path(&self) -> String {
        if self.template.contains("{id}") {
            let id = self.ids.draw(rand::random::<f64>());
            self.template.replace("{id}", &id.to_string())
        } else {
            self.template.clone()
        }
    }
}

/// How `{id}` is drawn.
enum Ids {
    /// Uniform in 1..=max.
    Uniform(u64),
    /// Zipf: `cdf[k - 1]` is the probability of an id ≤ k.
    Zipf(Vec<f64>),
}

impl Ids {
    fn new(max: u64, zipf: Option<f64>) -> Self {
        let max = max.max(1);
        let Some(s) = zipf else {
            return Ids::Uniform(max);
        };
        let mut cdf: Vec<f64> = (1..=max)
            .scan(0.0, |sum, k| {
                *sum += (k as f64).powf(-s);
                Some(*sum)
            })
            .collect();
        let total = cdf.last().copied().unwrap_or(1.0);
        for c in &mut cdf {
            *c /= total;
        }
        Ids::Zipf(cdf)
    }

    /// The id for a uniform `u` in [0, 1).
    fn draw(&self, u: f64) -> u64 {
        match self {
            Ids::Uniform(max) => ((u * *max as f64) as u64).min(max - 1) + 1,
            Ids::Zipf(cdf) => {
                let rank = cdf.partition_point(|&c| c <= u).min(cdf.len() - 1);
                rank as u64 + 1
            }
        }
    }
}

async fn connect(shared: &Shared) -> anyhow::Result<SendRequest<Empty<Bytes>>> {
    let stream = TcpStream::connect(shared.addr).await?;
    stream.set_nodelay(true)?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}

/// A finished exchange: the outcome, whether the connection can be reused, the Retry-After.
struct Answer {
    outcome: Outcome,
    reusable: bool,
    retry_after: Option<Option<u64>>,
}

/// One request on an open connection. `None`: the run ended before the answer arrived.
async fn exchange(shared: &Shared, sender: &mut SendRequest<Empty<Bytes>>) -> Option<Answer> {
    let request = Request::get(shared.path())
        .header(header::HOST, &shared.host)
        .body(Empty::new())
        .expect("a valid request");
    let until = shared.deadline.min(Instant::now() + shared.timeout);
    let work = async {
        if sender.ready().await.is_err() {
            return Err(Outcome::Write);
        }
        let response = sender.send_request(request).await.map_err(|e| {
            if e.is_canceled() || e.is_body_write_aborted() {
                Outcome::Write
            } else {
                Outcome::Read
            }
        })?;
        let status = response.status().as_u16();
        let close = response
            .headers()
            .get(header::CONNECTION)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
        let retry_after = response
            .headers()
            .get(header::RETRY_AFTER)
            .map(|v| v.to_str().ok().and_then(|s| s.trim().parse::<u64>().ok()));
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|_| Outcome::Read)?
            .to_bytes();
        let outcome = match status {
            200 if is_degraded(&body) => Outcome::Degraded,
            200 => Outcome::Full,
            503 => Outcome::Rejected503,
            429 => Outcome::Rejected429,
            s => Outcome::Other(s),
        };
        Ok((outcome, close, retry_after))
    };
    match tokio::time::timeout_at(until, work).await {
        Ok(Ok((outcome, close, retry_after))) => Some(Answer {
            outcome,
            reusable: !close && !sender.is_closed(),
            retry_after: matches!(outcome, Outcome::Rejected503 | Outcome::Rejected429)
                .then_some(retry_after.flatten()),
        }),
        Ok(Err(outcome)) => Some(Answer {
            outcome,
            reusable: false,
            retry_after: None,
        }),
        Err(_) if until < shared.deadline => Some(Answer {
            outcome: Outcome::Timeout,
            reusable: false,
            retry_after: None,
        }),
        Err(_) => None,
    }
}

/// [`exchange`], and once more on a new connection when `reused` (a kept-alive connection) turned
/// out closed before the request left: the server's idle timeout closed it as the client picked
/// it. The request never reached the server, so this is the client's race, not a socket error of
/// the server under test. The new connection replaces `conn`.
async fn exchange_fresh_if_stale(
    shared: &Shared,
    conn: &mut SendRequest<Empty<Bytes>>,
    reused: bool,
) -> Option<Answer> {
    let answer = exchange(shared, conn).await?;
    if !reused || !matches!(answer.outcome, Outcome::Write) {
        return Some(answer);
    }
    match tokio::time::timeout_at(shared.deadline, connect(shared)).await {
        Ok(Ok(fresh)) => {
            *conn = fresh;
            {
                let mut stats = shared.stats();
                stats.stale_retries += 1;
                stats.connections_opened += 1;
            }
            exchange(shared, conn).await
        }
        Ok(Err(_)) => Some(Answer {
            outcome: Outcome::Connect,
            reusable: false,
            retry_after: None,
        }),
        Err(_) => None,
    }
}

/// A 200 is degraded when the dashboard's `"degraded":[...]` list (after every part; only
/// `stale` follows it) names a part.
fn is_degraded(body: &[u8]) -> bool {
    const KEY: &[u8] = b"\"degraded\":[";
    body.windows(KEY.len())
        .rposition(|w| w == KEY)
        .is_some_and(|at| body.get(at + KEY.len()).is_some_and(|&c| c != b']'))
}

/// One closed-loop connection until `until` (at most the run's deadline); with `honour`, it
/// waits Retry-After after a rejection.
async fn closed_loop(shared: Arc<Shared>, honour: bool, until: Instant) {
    let mut sender: Option<SendRequest<Empty<Bytes>>> = None;
    let until = until.min(shared.deadline);
    while Instant::now() < until {
        let connecting = Instant::now();
        let reused = sender.is_some();
        let mut conn = match sender.take() {
            Some(s) => s,
            None => match tokio::time::timeout_at(shared.deadline, connect(&shared)).await {
                Ok(Ok(s)) => {
                    shared.stats().connected(connecting.elapsed());
                    s
                }
                Ok(Err(_)) => {
                    shared
                        .stats()
                        .record(Outcome::Connect, connecting.elapsed());
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
                Err(_) => return,
            },
        };
        // Timed from here, as wrk does: a connection that took seconds to open (10,000 opened at
        // once overflow the server's accept queue, and a dropped SYN is retried after 1, 2, 4 s)
        // must not show as a slow answer. Its time is in `connect_ms`.
        let started = Instant::now();
        shared.stats().send();
        let Some(answer) = exchange_fresh_if_stale(&shared, &mut conn, reused).await else {
            return;
        };
        let latency = started.elapsed();
        let wait = {
            let mut stats = shared.stats();
            stats.record(answer.outcome, latency);
            if answer.reusable {
                sender = Some(conn);
            } else {
                stats.open -= 1;
                stats.reconnects += 1;
            }
            match answer.retry_after {
                Some(seconds) if honour && !stats.measuring => {
                    Some(Duration::from_secs(seconds.unwrap_or(1)))
                }
                Some(seconds) if honour => {
                    stats.retry_after_waits += 1;
                    stats.retry_after_missing += u64::from(seconds.is_none());
                    let wait = Duration::from_secs(seconds.unwrap_or(1));
                    stats.retry_after_wait_s += wait.as_secs_f64();
                    Some(wait)
                }
                _ => None,
            }
        };
        if let Some(wait) = wait {
            tokio::time::sleep_until(until.min(Instant::now() + wait)).await;
        }
    }
    if sender.is_some() {
        shared.stats().open -= 1;
    }
}

/// The spike: `extra` more closed-loop connections from `start` for `length`.
async fn spike(shared: Arc<Shared>, extra: usize, start: Instant, length: Duration) {
    tokio::time::sleep_until(start).await;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..extra {
        tasks.spawn(closed_loop(Arc::clone(&shared), false, start + length));
    }
    while tasks.join_next().await.is_some() {}
}

/// One open-loop request, scheduled for `at`, on `sender` or on a new connection.
async fn open_request(shared: Arc<Shared>, at: Instant, sender: Option<SendRequest<Empty<Bytes>>>) {
    let reused = sender.is_some();
    let mut conn = match sender {
        Some(s) => s,
        None => match tokio::time::timeout_at(shared.deadline, connect(&shared)).await {
            Ok(Ok(s)) => s,
            Ok(Err(_)) => {
                let mut stats = shared.stats();
                stats.open -= 1;
                stats.record(Outcome::Connect, at.elapsed());
                return;
            }
            Err(_) => return,
        },
    };
    shared.stats().send();
    let answer = exchange_fresh_if_stale(&shared, &mut conn, reused).await;
    let mut stats = shared.stats();
    match answer {
        Some(a) if a.reusable => {
            stats.record(a.outcome, at.elapsed());
            drop(stats);
            shared
                .idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(conn);
        }
        Some(a) => {
            stats.record(a.outcome, at.elapsed());
            stats.open -= 1;
            stats.reconnects += 1;
        }
        None => stats.open -= 1,
    }
}

/// The open-loop schedule: request i is due at start + i / rate.
async fn open_loop(shared: Arc<Shared>, rate: f64, max_connections: usize) {
    let start = Instant::now();
    let mut dispatched: u64 = 0;
    while Instant::now() < shared.deadline {
        let due = (start.elapsed().as_secs_f64() * rate) as u64;
        while dispatched < due {
            let at = start + Duration::from_secs_f64(dispatched as f64 / rate);
            dispatched += 1;
            let idle = shared
                .idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop();
            if idle.is_none() {
                let mut stats = shared.stats();
                if stats.open >= max_connections {
                    stats.unsent += u64::from(stats.measuring);
                    continue;
                }
                stats.opened();
            }
            tokio::spawn(open_request(Arc::clone(&shared), at, idle));
        }
        let next = start + Duration::from_secs_f64(dispatched as f64 / rate);
        tokio::time::sleep_until(next.max(Instant::now() + Duration::from_micros(500))).await;
    }
}

fn summary(h: &Histogram<u64>) -> Value {
    let ms = |us: u64| us as f64 / 1000.0;
    if h.is_empty() {
        return json!({"count": 0});
    }
    let q = |q: f64| ms(h.value_at_quantile(q));
    json!({
        "count": h.len(), "mean": h.mean() / 1000.0, "max": ms(h.max()),
        "p50": q(0.5), "p75": q(0.75), "p90": q(0.9), "p99": q(0.99), "p99.9": q(0.999), "p99.99": q(0.9999),
    })
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let uri: hyper::Uri = args.target.parse().context("--target must be a URL")?;
    let authority = uri.authority().context("--target needs host:port")?.clone();
    let port = authority.port_u16().unwrap_or(80);
    let addr = tokio::net::lookup_host((authority.host(), port))
        .await?
        .next()
        .context("--target does not resolve")?;
    let (mode, load) = match (args.closed, args.rate, args.retry_after) {
        (Some(n), None, None) => ("closed", n as f64),
        (None, Some(r), None) if r > 0.0 => ("open", r),
        (None, None, Some(n)) => ("retry-after", n as f64),
        _ => anyhow::bail!("give exactly one of --closed N, --rate R (> 0), --retry-after N"),
    };
    if let Some(s) = args.zipf {
        anyhow::ensure!(
            s.is_finite() && s > 0.0,
            "--zipf must be a positive exponent"
        );
    }
    if let Some(to) = args.spike_to {
        anyhow::ensure!(
            to > args.closed.unwrap_or(0) && args.spike_at >= 0.0 && args.spike_for > 0.0,
            "--spike-to needs more connections than --closed and a --spike-for > 0"
        );
    }
    let started = Instant::now();
    let measured_from = started + Duration::from_secs_f64(args.warmup);
    let shared = Arc::new(Shared {
        addr,
        host: authority.to_string(),
        template: args.path_template.clone(),
        ids: Ids::new(args.id_max, args.zipf),
        timeout: Duration::from_secs_f64(args.timeout),
        deadline: measured_from + Duration::from_secs_f64(args.duration),
        stats: Mutex::new(Stats::new(measured_from)),
        idle: Mutex::new(Vec::new()),
    });
    let mut tasks = tokio::task::JoinSet::new();
    let marker = Arc::clone(&shared);
    tokio::spawn(async move {
        tokio::time::sleep_until(measured_from).await;
        marker.stats().measuring = true;
        // stdout is line-buffered: the caller sees this line now.
        println!("LOADGEN_MEASURING");
    });
    match mode {
        "open" => {
            tasks.spawn(open_loop(Arc::clone(&shared), load, args.max_connections));
        }
        _ => {
            for _ in 0..load as usize {
                tasks.spawn(closed_loop(
                    Arc::clone(&shared),
                    mode == "retry-after",
                    shared.deadline,
                ));
            }
            if let Some(to) = args.spike_to {
                tasks.spawn(spike(
                    Arc::clone(&shared),
                    to - load as usize,
                    measured_from + Duration::from_secs_f64(args.spike_at),
                    Duration::from_secs_f64(args.spike_for),
                ));
            }
        }
    }
    while tasks.join_next().await.is_some() {}
    // Open-loop requests still in flight: give them until the deadline (they already have it).
    tokio::time::sleep_until(shared.deadline).await;
    let elapsed = measured_from.elapsed().as_secs_f64();
    let s = shared.stats();
    let answered: u64 = s.status.values().sum();
    let errors: u64 = s.errors.values().sum();
    let full = s.full.len();
    let result = json!({
        "schema": 1,
        "mode": mode,
        "connections": (mode != "open").then_some(load as u64),
        "rate": (mode == "open").then_some(load),
        "max_connections": (mode == "open").then_some(args.max_connections),
        "duration_s": elapsed,
        "sent": s.sent,
        "unsent_late": s.unsent,
        "answered": answered,
        "warmup_s": args.warmup,
        "in_flight_at_end": s.in_flight,
        "outcomes": {
            "full": full, "degraded": s.degraded.len(),
            "503": s.status.get(&503).copied().unwrap_or(0), "429": s.status.get(&429).copied().unwrap_or(0),
            "other": s.other.len(),
        },
        "status": s.status.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
        "errors": s.errors,
        "latency_ms": {
            "full": summary(&s.full), "degraded": summary(&s.degraded),
            "rejected": summary(&s.rejected), "other": summary(&s.other),
        },
        "connect_ms": summary(&s.connect),
        "connections_opened": s.connections_opened,
        "connections_max": s.connections_max,
        "reconnects": s.reconnects,
        "stale_retries": s.stale_retries,
        "retry_after": {"waits": s.retry_after_waits, "missing": s.retry_after_missing, "wait_s": s.retry_after_wait_s},
        "ids": {"max": args.id_max, "zipf": args.zipf},
        "spike": args.spike_to.map(|to| json!({"to": to, "at_s": args.spike_at, "for_s": args.spike_for})),
        "series": s.series,
    });
    println!(
        "loadgen {mode} {load}: {:.0} full 200/s, {answered} answers ({:?}), {errors} socket errors, {} unsent",
        full as f64 / elapsed,
        s.status,
        s.unsent
    );
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&result)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{
        Bytes, Empty, Ids, Outcome, SendRequest, Shared, Stats, connect, exchange_fresh_if_stale,
        is_degraded,
    };
    use std::{sync::Mutex, time::Duration};
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        time::Instant,
    };

    /// A server that answers one request per connection with a kept-alive 200 and then closes
    /// the connection, as a server does whose idle timeout fires right after an answer.
    async fn one_answer_per_connection() -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    let mut head = Vec::new();
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        let Ok(n) = socket.read(&mut buf).await else {
                            return;
                        };
                        if n == 0 {
                            return;
                        }
                        head.extend_from_slice(&buf[..n]);
                    }
                    let _ = socket
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                        .await;
                    // Dropped: closed after the answer, without `Connection: close`.
                });
            }
        });
        addr
    }

    /// Until the client has seen the server close `conn` (at most 5 s).
    async fn closed(conn: &SendRequest<Empty<Bytes>>) {
        let give_up = Instant::now() + Duration::from_secs(5);
        while !conn.is_closed() && Instant::now() < give_up {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn a_request_on_a_kept_alive_connection_the_server_closed_goes_out_on_a_new_one() {
        let addr = one_answer_per_connection().await;
        let shared = Shared {
            addr,
            host: addr.to_string(),
            template: "/".into(),
            ids: Ids::new(1, None),
            timeout: Duration::from_secs(5),
            deadline: Instant::now() + Duration::from_secs(30),
            stats: Mutex::new(Stats::new(Instant::now())),
            idle: Mutex::new(Vec::new()),
        };
        let mut conn = connect(&shared).await.unwrap();
        let first = exchange_fresh_if_stale(&shared, &mut conn, false)
            .await
            .unwrap();
        assert!(matches!(first.outcome, Outcome::Full));
        // The server has closed it by the time the client reuses it.
        closed(&conn).await;
        let stale = exchange_fresh_if_stale(&shared, &mut conn, true)
            .await
            .unwrap();
        assert!(
            matches!(stale.outcome, Outcome::Full),
            "sent again on a new connection, not a write error"
        );
        assert_eq!(shared.stats().stale_retries, 1);
        // On a connection that was not kept alive from an earlier answer nothing is retried:
        // a failure there is the server's.
        closed(&conn).await;
        let fresh = exchange_fresh_if_stale(&shared, &mut conn, false)
            .await
            .unwrap();
        assert!(matches!(fresh.outcome, Outcome::Write));
        assert_eq!(shared.stats().stale_retries, 1);
    }

    #[test]
    fn zipf_ids_follow_their_weights_and_stay_in_range() {
        let ids = Ids::new(10, Some(1.0));
        // P(id 1) = 1 / H(10) = 0.3414; the table's edges map to the first and last id.
        let harmonic: f64 = (1..=10).map(|k| 1.0 / f64::from(k)).sum();
        assert_eq!(ids.draw(0.0), 1);
        assert_eq!(ids.draw(1.0 / harmonic - 1e-9), 1);
        assert_eq!(ids.draw(1.0 / harmonic + 1e-9), 2);
        assert_eq!(ids.draw(0.999_999_999), 10);
        let draws = 100_000;
        let mut counts = [0u32; 10];
        for i in 0..draws {
            let id = ids.draw(f64::from(i) / f64::from(draws));
            counts[usize::try_from(id).unwrap() - 1] += 1;
        }
        let share = |id: usize| f64::from(counts[id - 1]) / f64::from(draws);
        assert!((share(1) - 1.0 / harmonic).abs() < 0.001, "{}", share(1));
        assert!((share(10) - 0.1 / harmonic).abs() < 0.001, "{}", share(10));
    }

    #[test]
    fn uniform_ids_cover_the_range_evenly() {
        let ids = Ids::new(4, None);
        let drawn: Vec<u64> = [0.0, 0.24, 0.25, 0.5, 0.75, 0.999_999]
            .map(|u| ids.draw(u))
            .into();
        assert_eq!(drawn, [1, 1, 2, 3, 4, 4]);
    }

    #[tokio::test(start_paused = true)]
    async fn the_series_counts_each_outcome_in_the_second_it_arrived() {
        let mut stats = Stats::new(Instant::now());
        stats.measuring = true;
        stats.opened();
        stats.send();
        stats.record(Outcome::Full, Duration::from_millis(5));
        tokio::time::advance(Duration::from_millis(1500)).await;
        stats.send();
        stats.send();
        stats.record(Outcome::Degraded, Duration::from_millis(5));
        stats.record(Outcome::Rejected503, Duration::from_millis(5));
        stats.record(Outcome::Timeout, Duration::from_millis(5));
        let s = &stats.series;
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].full, s[0].sent, s[0].open_max), (1, 1, 1));
        assert_eq!(
            (
                s[1].full,
                s[1].degraded,
                s[1].rejected,
                s[1].errors,
                s[1].sent
            ),
            (0, 1, 1, 1, 2)
        );
    }

    #[test]
    fn a_dashboard_is_degraded_only_when_its_degraded_list_names_a_part() {
        assert!(!is_degraded(br#"{"user_id":1,"cart":{},"degraded":[]}"#));
        assert!(is_degraded(
            br#"{"user_id":1,"cart":null,"degraded":["cart"]}"#
        ));
        // A body without the field (another endpoint) counts as full.
        assert!(!is_degraded(br#"{"status":"ok"}"#));
        // The dashboard's own field is its last one: a part's payload with a field of that
        // name earlier in the body does not decide.
        assert!(!is_degraded(
            br#"{"profile":{"degraded":["x"]},"degraded":[]}"#
        ));
    }
}
