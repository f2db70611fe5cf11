//! Benchmark server for the experiments that must not live in the gateway (see `bench/`).
//!
//! Three experiments of the benchmark lab are about *where work runs* rather than about
//! fan-out, so they run here, in a small axum server that `bench/run` pins to one core next to
//! a load generator on the other:
//!
//! - **`GET /cpu/{inline|blocking|rayon}`** (CPU only, 5 ms of SHA-256). Every request does
//!   about 5 ms of chained SHA-256. `inline` runs it on the async worker, which then cannot poll
//!   anything else for 5 ms; `blocking` moves it to `tokio::task::spawn_blocking`; `rayon` sends it
//!   to a bounded rayon pool and awaits a oneshot channel. On one core none of them can exceed
//!   200 req/s; the difference shows up in the latency of unrelated light requests
//!   (`GET /light`) that the bench runs at the same time.
//! - **`GET /mixed/{inline|offload|blocking}`** (mixed: 10 ms I/O + 2 ms JSON and regex).
//!   Every request waits 10 ms of simulated I/O (`tokio::time::sleep`: the worker is free
//!   meanwhile), then parses a large JSON document and regex-masks e-mail addresses and card
//!   numbers in it, about 2 ms of CPU: `inline` on the worker, `offload` on the bounded rayon pool,
//!   `blocking` with `spawn_blocking` (offloaded, but one OS thread per request in flight, which
//!   the kernel then time-slices against the worker).
//! - **`GET /pinning/{mutex|async-mutex|moka}`** (a lock around a cache update that does
//!   blocking I/O, and its fixes). `mutex` is the deliberate anti-pattern: a `std::sync::Mutex`
//!   held while a blocking 5 ms load runs on the async worker thread. That pins the worker:
//!   nothing else on that worker runs until the load is done. `async-mutex` holds a
//!   `tokio::sync::Mutex` across an async load: the worker is free, but every update is still
//!   serialised through one lock. `moka` uses `moka::future::Cache::get_with`: an async load,
//!   coalesced per key, with no global lock.
//! - **`GET /light`** answers at once; it is the probe whose tail latency shows a pinned or
//!   monopolised worker. **`GET /info`** reports the calibration so every run can record it.
//!
//! CPU work is calibrated at start-up (iterations of SHA-256, size of the JSON document) so that
//! it costs the configured milliseconds on *this* machine, measured on the core the server is
//! pinned to; `bench/run` calibrates once per scenario and passes the result to every later start
//! (`BENCH_SHA256_ITERATIONS`, `BENCH_MIXED_RECORDS`), so all variants do the same work.
//! Configuration is read once from the environment:
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `BENCH_LISTEN` | `127.0.0.1:8090` | listen address |
//! | `BENCH_WORKER_THREADS` | one per available core | tokio worker threads |
//! | `BENCH_RAYON_THREADS` | one per available core | size of the rayon pool |
//! | `BENCH_CPU_MS` | `5` | CPU cost of `/cpu/*` |
//! | `BENCH_MIXED_IO_MS` | `10` | simulated I/O of `/mixed/*` |
//! | `BENCH_MIXED_CPU_MS` | `2` | CPU cost of `/mixed/*` |
//! | `BENCH_PINNING_LOAD_MS` | `5` | duration of the cache loader in `/pinning/*` |
//! | `BENCH_PINNING_KEYS` | `0` | key space of `/pinning/*`; `0` draws a fresh key per request, so every request runs the loader |
//! | `BENCH_SHA256_ITERATIONS` | calibrated | fixes the work of `/cpu/*` instead of calibrating it |
//! | `BENCH_MIXED_RECORDS` | calibrated | fixes the size of the `/mixed/*` document instead of calibrating it |
//!
//! Run it with `cargo run --release --example bench_server`; `bench/run cpu|mixed|pinning` starts
//! it for you.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::str::FromStr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use regex::Regex;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest as _, Sha256};

fn main() -> anyhow::Result<()> {
    let config = Config::from_env()?;
    // Calibrate before the runtime starts, on the main thread of the (pinned) process, so the
    // measurement is not disturbed by our own workers.
    let calibration = Calibration::measure(&config)?;
    println!("{}", serde_json::to_string(&calibration)?);

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.worker_threads.get())
        .thread_name("bench-worker")
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    runtime.block_on(serve(config, calibration))
}

async fn serve(config: Config, calibration: Calibration) -> anyhow::Result<()> {
    let state = AppState::new(&config, calibration)?;
    let app = Router::new()
        .route("/light", get(light))
        .route("/info", get(info))
        .route("/cpu/{mode}", get(cpu))
        .route("/mixed/{mode}", get(mixed))
        .route("/pinning/{mode}", get(pinning))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding {}", config.listen))?;
    eprintln!("bench_server listening on {}", listener.local_addr()?);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await
        .context("serving")
}

/// Resolves on SIGINT or SIGTERM; `bench/run` stops the server with SIGTERM between runs.
async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminate => {}
    }
}

/// Settings, read once from `BENCH_*` environment variables (see the module doc).
#[derive(Debug, Clone)]
struct Config {
    listen: SocketAddr,
    worker_threads: NonZeroUsize,
    rayon_threads: NonZeroUsize,
    cpu: Duration,
    mixed_io: Duration,
    mixed_cpu: Duration,
    pinning_load: Duration,
    pinning_keys: u64,
    sha256_iterations: Option<u32>,
    mixed_records: Option<usize>,
}

impl Config {
    fn from_env() -> anyhow::Result<Self> {
        // `available_parallelism` honours the affinity mask, so under `taskset -c 0` it is 1.
        let cores = std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN);
        Ok(Self {
            listen: env_or("BENCH_LISTEN", SocketAddr::from(([127, 0, 0, 1], 8090)))?,
            worker_threads: env_or("BENCH_WORKER_THREADS", cores)?,
            rayon_threads: env_or("BENCH_RAYON_THREADS", cores)?,
            cpu: Duration::from_millis(env_or("BENCH_CPU_MS", 5)?),
            mixed_io: Duration::from_millis(env_or("BENCH_MIXED_IO_MS", 10)?),
            mixed_cpu: Duration::from_millis(env_or("BENCH_MIXED_CPU_MS", 2)?),
            pinning_load: Duration::from_millis(env_or("BENCH_PINNING_LOAD_MS", 5)?),
            pinning_keys: env_or("BENCH_PINNING_KEYS", 0)?,
            sha256_iterations: env_or("BENCH_SHA256_ITERATIONS", 0)
                .map(|n: u32| (n > 0).then_some(n))?,
            mixed_records: env_or("BENCH_MIXED_RECORDS", 0).map(|n: usize| (n > 0).then_some(n))?,
        })
    }
}

fn env_or<T>(name: &str, default: T) -> anyhow::Result<T>
where
    T: FromStr,
    T::Err: std::error::Error + Send + Sync + 'static,
{
    match std::env::var(name) {
        Ok(raw) => raw.parse().with_context(|| format!("{name}={raw:?}")),
        Err(std::env::VarError::NotPresent) => Ok(default),
        Err(err) => Err(err).with_context(|| name.to_owned()),
    }
}

/// How much work reproduces the configured CPU costs on this machine; served on `/info`.
#[derive(Debug, Clone, Serialize)]
struct Calibration {
    worker_threads: usize,
    rayon_threads: usize,
    sha256_iterations: u32,
    sha256_ms: f64,
    mixed_io_ms: f64,
    mixed_document_records: usize,
    mixed_document_bytes: usize,
    mixed_cpu_ms: f64,
    pinning_load_ms: f64,
    pinning_keys: u64,
    #[serde(skip)]
    document: Arc<[u8]>,
}

impl Calibration {
    fn measure(config: &Config) -> anyhow::Result<Self> {
        let sha256_iterations = match config.sha256_iterations {
            Some(iterations) => iterations,
            None => {
                let probe_iterations = 2_000;
                let per_iteration = fastest_of(9, || {
                    std::hint::black_box(sha256_chain(probe_iterations));
                }) / probe_iterations;
                u32::try_from((config.cpu.as_nanos() / per_iteration.as_nanos().max(1)).max(1))
                    .context("SHA-256 iteration count overflows u32")?
            }
        };
        let sha256_ms = millis(fastest_of(5, || {
            std::hint::black_box(sha256_chain(sha256_iterations));
        }));

        let masker = Masker::new();
        let records = match config.mixed_records {
            Some(records) => records,
            None => {
                let probe_records = 200;
                let probe_document = json_document(probe_records);
                masker
                    .parse_and_mask(&probe_document)
                    .context("the generated document must parse")?;
                // Results are checked above; the timed runs only need the work done.
                let probe_cost = fastest_of(9, || {
                    let _ = std::hint::black_box(masker.parse_and_mask(&probe_document));
                });
                usize::try_from(
                    (config.mixed_cpu.as_nanos() * probe_records as u128)
                        / probe_cost.as_nanos().max(1),
                )
                .context("document size overflows usize")?
                .max(1)
            }
        };
        let document: Arc<[u8]> = json_document(records).into();
        masker
            .parse_and_mask(&document)
            .context("the generated document must parse")?;
        let mixed_cpu_ms = millis(fastest_of(5, || {
            let _ = std::hint::black_box(masker.parse_and_mask(&document));
        }));

        Ok(Self {
            worker_threads: config.worker_threads.get(),
            rayon_threads: config.rayon_threads.get(),
            sha256_iterations,
            sha256_ms,
            mixed_io_ms: millis(config.mixed_io),
            mixed_document_records: records,
            mixed_document_bytes: document.len(),
            mixed_cpu_ms,
            pinning_load_ms: millis(config.pinning_load),
            pinning_keys: config.pinning_keys,
            document,
        })
    }
}

/// The fastest of `runs` timings. Interference (another process on the core, a page fault)
/// only ever adds time, so the minimum is the estimate that does not depend on how busy the
/// machine happened to be while calibrating.
fn fastest_of(runs: u32, mut work: impl FnMut()) -> Duration {
    (0..runs)
        .map(|_| {
            let start = Instant::now();
            work();
            start.elapsed()
        })
        .min()
        .unwrap_or_default()
}

fn millis(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1_000.0
}

/// `iterations` rounds of SHA-256, each over a 1 KiB block and the previous digest, so the
/// compiler cannot skip any of them.
fn sha256_chain(iterations: u32) -> [u8; 32] {
    let block = [0x5a_u8; 1024];
    let mut digest = [0_u8; 32];
    for _ in 0..iterations {
        let mut hasher = Sha256::new();
        hasher.update(block);
        hasher.update(digest);
        digest = hasher.finalize().into();
    }
    digest
}

/// A large JSON document of user records carrying personal data, as a downstream might return.
fn json_document(records: usize) -> Vec<u8> {
    let users: Vec<Value> = (0..records)
        .map(|i| {
            serde_json::json!({
                "id": i,
                "name": format!("User {i}"),
                "email": format!("user{i}@example.com"),
                "card": format!("4111 1111 1111 {:04}", i % 10_000),
                "address": { "street": format!("{i} Main Street"), "city": "Springfield", "zip": format!("{:05}", i % 100_000) },
                "notes": format!("Contact user{i}@example.org or use card 5500-0000-0000-{:04} for refunds.", i % 10_000),
                "tags": ["customer", "newsletter", if i % 2 == 0 { "even" } else { "odd" }],
            })
        })
        .collect();
    serde_json::to_vec(&serde_json::json!({ "users": users })).unwrap_or_default()
}

/// Parses a JSON document and masks e-mail addresses and card numbers in every string in it.
#[derive(Debug, Clone)]
struct Masker {
    email: Regex,
    card: Regex,
}

/// What `/mixed/*` answers: proof that the work was done, not the (large) masked document.
#[derive(Debug, Serialize)]
struct MaskSummary {
    masked_strings: usize,
    output_bytes: usize,
}

impl Masker {
    fn new() -> Self {
        Self {
            email: Regex::new(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}")
                .expect("static e-mail pattern compiles"),
            card: Regex::new(r"\b\d{4}[ -]?\d{4}[ -]?\d{4}[ -]?(\d{4})\b")
                .expect("static card pattern compiles"),
        }
    }

    fn parse_and_mask(&self, document: &[u8]) -> Result<MaskSummary, serde_json::Error> {
        let mut value: Value = serde_json::from_slice(document)?;
        let masked_strings = self.mask(&mut value);
        let output_bytes = serde_json::to_vec(&value)?.len();
        Ok(MaskSummary {
            masked_strings,
            output_bytes,
        })
    }

    fn mask(&self, value: &mut Value) -> usize {
        match value {
            Value::String(text) => {
                let emails_masked = self.email.replace_all(text, "***@***");
                let masked = self.card.replace_all(&emails_masked, "**** **** **** $1");
                if masked != text.as_str() {
                    *text = masked.into_owned();
                    1
                } else {
                    0
                }
            }
            Value::Array(items) => items.iter_mut().map(|item| self.mask(item)).sum(),
            Value::Object(fields) => fields.values_mut().map(|field| self.mask(field)).sum(),
            Value::Null | Value::Bool(_) | Value::Number(_) => 0,
        }
    }
}

#[derive(Clone)]
struct AppState {
    calibration: Arc<Calibration>,
    masker: Arc<Masker>,
    rayon: Arc<rayon::ThreadPool>,
    mixed_io: Duration,
    pinning_load: Duration,
    pinning_keys: u64,
    std_cache: Arc<StdMutexCache>,
    async_mutex_cache: Arc<tokio::sync::Mutex<HashMap<u64, Arc<str>>>>,
    moka_cache: moka::future::Cache<u64, Arc<str>>,
}

/// Bound on every cache in the pinning experiment, so memory stays flat during a run.
const CACHE_CAPACITY: usize = 10_000;

impl AppState {
    fn new(config: &Config, calibration: Calibration) -> anyhow::Result<Self> {
        let rayon = rayon::ThreadPoolBuilder::new()
            .num_threads(config.rayon_threads.get())
            .thread_name(|index| format!("bench-rayon-{index}"))
            .build()
            .context("building the rayon pool")?;
        Ok(Self {
            calibration: Arc::new(calibration),
            masker: Arc::new(Masker::new()),
            rayon: Arc::new(rayon),
            mixed_io: config.mixed_io,
            pinning_load: config.pinning_load,
            pinning_keys: config.pinning_keys,
            std_cache: Arc::new(StdMutexCache::default()),
            async_mutex_cache: Arc::default(),
            moka_cache: moka::future::Cache::new(CACHE_CAPACITY as u64),
        })
    }
}

/// A failed experiment request: the work panicked or its result could not be produced.
struct BenchError(String);

impl IntoResponse for BenchError {
    fn into_response(self) -> Response {
        (StatusCode::INTERNAL_SERVER_ERROR, self.0).into_response()
    }
}

async fn light() -> &'static str {
    "ok"
}

async fn info(State(state): State<AppState>) -> Json<Calibration> {
    Json(Calibration::clone(&state.calibration))
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum CpuMode {
    Inline,
    Blocking,
    Rayon,
}

#[derive(Debug, Serialize)]
struct CpuAnswer {
    digest_prefix: String,
}

async fn cpu(
    State(state): State<AppState>,
    Path(mode): Path<CpuMode>,
) -> Result<Json<CpuAnswer>, BenchError> {
    let iterations = state.calibration.sha256_iterations;
    let digest = match mode {
        // The worker hashes for 5 ms and polls nothing else meanwhile.
        CpuMode::Inline => sha256_chain(iterations),
        // Tokio's blocking pool: unbounded in practice (512 threads), so under load every
        // request gets its own thread and they share the core.
        CpuMode::Blocking => tokio::task::spawn_blocking(move || sha256_chain(iterations))
            .await
            .map_err(|err| BenchError(format!("blocking task failed: {err}")))?,
        // A bounded pool sized to the cores: CPU work queues there, not on the worker.
        CpuMode::Rayon => on_rayon(&state.rayon, move || sha256_chain(iterations)).await?,
    };
    Ok(Json(CpuAnswer {
        digest_prefix: hex::encode(&digest[..8]),
    }))
}

/// Runs `work` on the rayon pool and awaits its result without blocking the async worker.
async fn on_rayon<T: Send + 'static>(
    pool: &rayon::ThreadPool,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, BenchError> {
    let (sender, receiver) = tokio::sync::oneshot::channel();
    pool.spawn(move || {
        // The receiver is gone only if the client hung up; nobody wants the result then.
        let _ = sender.send(work());
    });
    receiver
        .await
        .map_err(|_| BenchError("rayon task panicked".to_owned()))
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum MixedMode {
    Inline,
    Offload,
    Blocking,
}

async fn mixed(
    State(state): State<AppState>,
    Path(mode): Path<MixedMode>,
) -> Result<Json<MaskSummary>, BenchError> {
    // The I/O part: the worker is free to poll other requests while this timer runs.
    tokio::time::sleep(state.mixed_io).await;
    let document = Arc::clone(&state.calibration.document);
    let summary = match mode {
        // About 2 ms of parsing and regex work on the worker, in one poll.
        MixedMode::Inline => state.masker.parse_and_mask(&document),
        // The bounded pool: the work queues behind at most one thread per core.
        MixedMode::Offload => {
            let masker = Arc::clone(&state.masker);
            on_rayon(&state.rayon, move || masker.parse_and_mask(&document)).await?
        }
        // Off the worker too, but on as many OS threads as there are requests in flight.
        MixedMode::Blocking => {
            let masker = Arc::clone(&state.masker);
            tokio::task::spawn_blocking(move || masker.parse_and_mask(&document))
                .await
                .map_err(|err| BenchError(format!("blocking task failed: {err}")))?
        }
    };
    summary
        .map(Json)
        .map_err(|err| BenchError(format!("document did not parse: {err}")))
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum PinningMode {
    Mutex,
    AsyncMutex,
    Moka,
}

#[derive(Debug, Serialize)]
struct PinningAnswer {
    key: u64,
    value: Arc<str>,
}

async fn pinning(
    State(state): State<AppState>,
    Path(mode): Path<PinningMode>,
) -> Json<PinningAnswer> {
    let key = if state.pinning_keys == 0 {
        rand::random::<u64>()
    } else {
        rand::random_range(0..state.pinning_keys)
    };
    let load = state.pinning_load;
    let value = match mode {
        PinningMode::Mutex => state.std_cache.get_or_load_blocking(key, load),
        PinningMode::AsyncMutex => {
            // Correct for the worker (the guard is a tokio one, and the load is async), but the
            // lock is held across the load, so every update waits for the one before it.
            let mut map = state.async_mutex_cache.lock().await;
            if let Some(value) = map.get(&key) {
                Arc::clone(value)
            } else {
                let value = load_async(key, load).await;
                bound(&mut map);
                map.insert(key, Arc::clone(&value));
                value
            }
        }
        // The `computeIfAbsent` analogue: concurrent callers of one key share one async load,
        // different keys load concurrently, and no lock is held across the await.
        PinningMode::Moka => state.moka_cache.get_with(key, load_async(key, load)).await,
    };
    Json(PinningAnswer { key, value })
}

/// The cache loader with non-blocking I/O (an awaited timer standing in for a network call).
async fn load_async(key: u64, latency: Duration) -> Arc<str> {
    tokio::time::sleep(latency).await;
    Arc::from(format!("profile-{key}"))
}

/// The cache of control group C: a `HashMap` behind a `std::sync::Mutex`.
#[derive(Debug, Default)]
struct StdMutexCache {
    map: Mutex<HashMap<u64, Arc<str>>>,
}

impl StdMutexCache {
    /// **The anti-pattern under test; never write this in a service.**
    ///
    /// A blocking loader (a synchronous client, stood in for by `std::thread::sleep`) runs while
    /// a `std::sync::Mutex` is held, and it is called from an async handler, so it runs on the
    /// async worker thread. The crate denies `clippy::await_holding_lock`, and rightly: holding
    /// this guard across an `.await` would not even be `Send`. The code that compiles and still
    /// goes wrong is this one: no await, so no lint, but the worker thread is blocked for the
    /// whole load and every other task scheduled on it (here: every other request, on a
    /// one-worker runtime) waits. Other workers that reach the lock block their threads too.
    fn get_or_load_blocking(&self, key: u64, latency: Duration) -> Arc<str> {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(value) = map.get(&key) {
            return Arc::clone(value);
        }
        std::thread::sleep(latency);
        let value: Arc<str> = Arc::from(format!("profile-{key}"));
        bound(&mut map);
        map.insert(key, Arc::clone(&value));
        value
    }
}

/// Keeps a mutex-guarded map under [`CACHE_CAPACITY`]. Dropping everything is crude but enough
/// here: the experiment measures the update path, and by default every key is fresh anyway.
fn bound(map: &mut HashMap<u64, Arc<str>>) {
    if map.len() >= CACHE_CAPACITY {
        map.clear();
    }
}
