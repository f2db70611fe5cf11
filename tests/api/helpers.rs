//! The test harness, and the only file that holds helpers the tests share: a real gateway on
//! an ephemeral port, in front of a real simulator on another ephemeral port and a fresh
//! Postgres database of its own (migrated by the gateway at start-up, as in production).
//!
//! Postgres is found through `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`,
//! the server compose exposes and the one CI starts). Every database a test creates is a
//! [`TestDatabase`], `tributary_test_<uuid>`, dropped when the value is (a `TestApp` owns its
//! own).

use std::{
    future::Future,
    net::SocketAddr,
    num::{NonZeroU32, NonZeroUsize},
    sync::{Arc, Mutex, OnceLock},
    time::Duration,
};

use axum::Router;
use serde_json::Value;
use sqlx::{Connection, Executor, PgConnection, PgPool};
use tokio::{sync::oneshot, task::JoinHandle};
use tributary::{
    Application, Settings,
    config::{CacheKey, CacheSettings},
    domain::{Part, Service},
    http::AppState,
};
use tributary_sim::{self as sim, Behaviour, Mode, SimHandle};

/// The Postgres server tests create their databases on.
pub fn server_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

fn url_for(db: &str) -> String {
    let base = server_url();
    let (prefix, _) = base
        .rsplit_once('/')
        .expect("DATABASE_URL has a database path");
    format!("{prefix}/{db}")
}

/// Log lines the gateway wrote during tests, for assertions on logging.
pub fn captured_logs() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let writer = {
            let buf = Arc::clone(&buf);
            move || LogWriter(Arc::clone(&buf))
        };
        // The gateway's own subscriber, as `main` installs it, writing into the buffer. Spans are
        // info-level: a stricter filter would drop the request span from the lines.
        let settings = tributary::config::TelemetrySettings {
            log_level: "warn,tributary=info".into(),
            ..Default::default()
        };
        let _ = tributary::telemetry::install_subscriber(&settings, writer);
        buf
    })
}

struct LogWriter(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(data);
        Ok(data.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

pub fn log_lines() -> Vec<Value> {
    let bytes = captured_logs().lock().unwrap().clone();
    String::from_utf8_lossy(&bytes)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

pub struct TestApp {
    pub addr: SocketAddr,
    /// The operations listener: `/metrics`, `/healthz`, `/readyz`.
    pub ops_addr: SocketAddr,
    pub client: reqwest::Client,
    pub sim: SimHandle,
    pub db: PgPool,
    pub db_name: String,
    pub state: AppState,
    shutdown: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<anyhow::Result<()>>>,
    /// Last, so that it is dropped after everything that uses it.
    _database: TestDatabase,
}

/// Settings for a test: everything on loopback, short timeouts, downstreams at `sim_url`.
pub fn test_settings(sim_url: &str, database_url: &str) -> Settings {
    let mut s = Settings::default();
    s.server.listen = "127.0.0.1:0".parse().unwrap();
    s.server.ops_listen = "127.0.0.1:0".parse().unwrap();
    s.server.request_deadline = Duration::from_millis(1500);
    s.server.drain_timeout = Duration::from_secs(5);
    s.database.url = tributary::config::Secret::new(database_url);
    s.database.min_connections = Some(0);
    s.database.max_connections = nz32(5);
    s.database.max_replicas = 1;
    for d in s.downstreams.iter_mut() {
        d.base_url = sim_url.parse().expect("the simulator's URL");
        d.timeout = Duration::from_millis(500);
    }
    s.telemetry.long_poll_threshold = Duration::from_millis(50);
    // A debug build on a busy test machine queues its tasks for milliseconds; only the tests
    // of overload itself want that to count as saturation, and they lower this.
    s.overload.queue_delay_target = Duration::from_secs(1);
    s
}

/// The optional parts that come from a service, with that service: the ones a test can break
/// through the simulator.
pub fn optional() -> [(Service, &'static str); 4] {
    let mut parts = Part::OPTIONAL
        .into_iter()
        .filter_map(|p| Some((p.service()?, p.field())));
    std::array::from_fn(|_| {
        parts
            .next()
            .expect("four optional parts come from a service")
    })
}

/// `n` as a limit (settings hold limits and sizes as non-zero numbers).
pub fn nz(n: usize) -> NonZeroUsize {
    NonZeroUsize::new(n).expect("a non-zero limit")
}

/// `n` as a 32-bit limit.
pub fn nz32(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("a non-zero limit")
}

/// A database of the test's own on the test server, dropped with this value.
pub struct TestDatabase {
    pub name: String,
}

impl TestDatabase {
    pub fn url(&self) -> String {
        url_for(&self.name)
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let name = self.name.clone();
        // Dropping a database needs async I/O; do it on a thread with its own runtime, because
        // the test's runtime may be blocked in this very `drop`. The pools' connections belong
        // to that runtime, so they are not closed here: `WITH (FORCE)` ends them server-side.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                if let Ok(mut conn) = PgConnection::connect(&server_url()).await {
                    let _ = conn
                        .execute(sqlx::AssertSqlSafe(format!(
                            r#"DROP DATABASE IF EXISTS "{name}" WITH (FORCE)"#
                        )))
                        .await;
                }
            });
        })
        .join();
    }
}

/// Creates an empty database (no migrations applied).
pub async fn fresh_database() -> TestDatabase {
    let name = format!("tributary_test_{}", uuid::Uuid::new_v4().simple());
    let mut conn = PgConnection::connect(&server_url())
        .await
        .expect("Postgres must be reachable at DATABASE_URL (see README: Tests)");
    conn.execute(sqlx::AssertSqlSafe(format!(r#"CREATE DATABASE "{name}""#)))
        .await
        .expect("create test database");
    TestDatabase { name }
}

/// Whether a database of this name exists on the test server.
pub async fn database_exists(name: &str) -> bool {
    let mut conn = PgConnection::connect(&server_url())
        .await
        .expect("Postgres");
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(name)
        .fetch_one(&mut conn)
        .await
        .expect("pg_database")
}

pub async fn spawn_app() -> TestApp {
    spawn_app_with(|_| {}).await
}

pub async fn spawn_app_with(configure: impl FnOnce(&mut Settings)) -> TestApp {
    spawn_app_full(
        configure,
        Router::new(),
        Behaviour {
            latency: Duration::from_millis(5),
            ..Behaviour::default()
        },
    )
    .await
}

/// The general form: settings tweaks, extra routes behind the request layer, simulator defaults.
pub async fn spawn_app_full(
    configure: impl FnOnce(&mut Settings),
    extra: Router<AppState>,
    behaviour: Behaviour,
) -> TestApp {
    captured_logs();
    let sim = sim::spawn("127.0.0.1:0".parse().unwrap(), behaviour)
        .await
        .expect("simulator starts");
    let database = fresh_database().await;
    let mut settings = test_settings(&sim.base_url(), &database.url());
    configure(&mut settings);
    let app = Application::build_with(settings, extra)
        .await
        .expect("application builds");
    let addr = app.local_addr();
    let ops_addr = app.ops_addr();
    let state = app.state().clone();
    let (tx, rx) = oneshot::channel();
    let server = tokio::spawn(app.run_until_stopped(async {
        let _ = rx.await;
    }));
    let db = PgPool::connect(&database.url()).await.expect("test pool");
    TestApp {
        addr,
        ops_addr,
        client: reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap(),
        sim,
        db,
        db_name: database.name.clone(),
        state,
        shutdown: Some(tx),
        server: Some(server),
        _database: database,
    }
}

impl TestApp {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// A URL on the operations listener.
    pub fn ops_url(&self, path: &str) -> String {
        format!("http://{}{}", self.ops_addr, path)
    }

    /// `GET` on the operations listener.
    pub async fn ops_get(&self, path: &str) -> reqwest::Response {
        self.client
            .get(self.ops_url(path))
            .send()
            .await
            .expect("request")
    }

    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.client
            .get(self.url(path))
            .send()
            .await
            .expect("request")
    }

    pub async fn seed(&self, users: i64, orders_per_user: i32) {
        self.state
            .db
            .seed(users, orders_per_user)
            .await
            .expect("seed");
    }

    /// Changes one simulated service's behaviour.
    pub fn set_service(&self, service: Service, change: impl FnOnce(&mut Behaviour)) {
        let mut b = self.sim.sim.behaviour(service);
        change(&mut b);
        self.sim.sim.set(service, b);
    }

    pub fn hang(&self, service: Service) {
        self.set_service(service, |b| b.mode = Mode::Hang);
    }

    /// `DELETE` on the operations listener (the admin endpoints).
    pub async fn ops_delete(&self, path: &str) -> reqwest::Response {
        self.client
            .delete(self.ops_url(path))
            .send()
            .await
            .expect("request")
    }

    /// Calls the simulator has seen for one service.
    pub fn calls(&self, service: Service) -> u64 {
        self.sim.sim.stats(service).requests
    }

    /// The gateway's `/metrics` text, from the operations listener.
    pub async fn metrics(&self) -> String {
        self.ops_get("/metrics").await.text().await.unwrap()
    }

    /// A sample from the gateway's `/metrics`, 0 when the series does not exist yet.
    pub async fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        metric_value(&self.metrics().await, name, labels).unwrap_or(0.0)
    }

    /// `GET /api/v1/dashboard/{user_id}`: the status and the body (`null` when not JSON).
    pub async fn dashboard(&self, user_id: i64) -> (u16, Value) {
        let resp = self.get(&format!("/api/v1/dashboard/{user_id}")).await;
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    /// The dashboard with a caller's budget (`x-request-budget-ms`): status and body.
    pub async fn dashboard_within(&self, user_id: i64, budget_ms: u64) -> (u16, Value) {
        let resp = self
            .client
            .get(self.url(&format!("/api/v1/dashboard/{user_id}")))
            .header("x-request-budget-ms", budget_ms.to_string())
            .send()
            .await
            .expect("request");
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    /// `POST /api/v1/orders` with `body`, under `key` when given.
    pub fn post_order(
        &self,
        key: Option<&str>,
        body: &Value,
    ) -> impl Future<Output = reqwest::Response> {
        let mut request = self.client.post(self.url("/api/v1/orders")).json(body);
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        async move { request.send().await.expect("request") }
    }

    /// Stops the server gracefully and waits for it.
    pub async fn stop(&mut self) -> anyhow::Result<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        match self.server.take() {
            Some(handle) => handle.await.expect("server task"),
            None => Ok(()),
        }
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// Polls `check` every 20 ms until it returns true or `within` passes; says whether it did.
pub async fn eventually<F, Fut>(within: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A cache policy for a test: the defaults with this key and ttl.
pub fn cache(key: CacheKey, ttl: Duration) -> CacheSettings {
    CacheSettings {
        key,
        ttl,
        ..CacheSettings::default()
    }
}

/// A dashboard's `degraded` list.
pub fn degraded(body: &Value) -> Vec<String> {
    names(body, "degraded")
}

/// A dashboard's `stale` list.
pub fn stale(body: &Value) -> Vec<String> {
    names(body, "stale")
}

fn names(body: &Value, list: &str) -> Vec<String> {
    body[list]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// A valid order for `user_id`: two lines, 2 × 12.50 + 4.99.
pub fn order(user_id: i64) -> Value {
    serde_json::json!({"user_id": user_id, "items": [
        {"sku": "SKU-1", "quantity": 2, "unit_price_cents": 1250},
        {"sku": "SKU-2", "quantity": 1, "unit_price_cents": 499}
    ]})
}

/// The sum of the Prometheus samples whose labels include these (in any order), if any is
/// present: one value for a fully labelled series, the total over the rest (e.g. every
/// `reason`) otherwise.
pub fn metric_value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (metric, rest) = match series.split_once('{') {
                Some((m, r)) => (m, r.trim_end_matches('}')),
                None => (series, ""),
            };
            if metric != name {
                return None;
            }
            let all = labels
                .iter()
                .all(|(k, v)| rest.split(',').any(|kv| kv == format!("{k}=\"{v}\"")));
            all.then(|| value.parse::<f64>().ok()).flatten()
        })
        .reduce(|a, b| a + b)
}

/// A problem document's fields, asserting the content type.
pub async fn problem(resp: reqwest::Response) -> (u16, Value) {
    let status = resp.status().as_u16();
    let ct = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert_eq!(ct, "application/problem+json", "status {status}");
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["status"], status);
    (status, body)
}
