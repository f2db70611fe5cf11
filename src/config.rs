//! Typed settings, parsed once at the edge.
//!
//! Layering, lowest to highest precedence:
//! 1. built-in defaults (the `Default` impls below, which mirror `config/default.toml`);
//! 2. a TOML file (`--config PATH`, `TRIBUTARY_CONFIG`, or `config/default.toml` when present);
//! 3. environment variables `TRIBUTARY_<SECTION>__<KEY>` (double underscore between levels,
//!    e.g. `TRIBUTARY_DOWNSTREAMS__USERS__TIMEOUT=250ms`);
//! 4. `DATABASE_URL`, the de-facto standard name, overriding `database.url`.
//!
//! Unknown keys are rejected so that a typo in an override fails start-up instead of being
//! silently ignored, and [`Settings::validate`] turns every inconsistent value into one readable
//! line. Nothing outside this module reads the environment.

use std::{fmt, net::SocketAddr, num::NonZeroUsize, path::Path, str::FromStr, time::Duration};

use figment::{
    Figment,
    providers::{Format, Toml},
};
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgConnectOptions;

/// Everything the gateway can be told.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    pub server: ServerSettings,
    pub database: DatabaseSettings,
    pub http_client: HttpClientSettings,
    pub downstreams: Downstreams,
    pub admission: AdmissionSettings,
    pub rate_limit: RateLimitSettings,
    pub circuit_breaker: CircuitBreakerSettings,
    pub retry: RetrySettings,
    pub telemetry: TelemetrySettings,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerSettings {
    pub listen: SocketAddr,
    /// Budget for a whole request; every downstream call and query gets at most what is left.
    #[serde(with = "humantime_serde")]
    pub request_deadline: Duration,
    /// How long in-flight requests may run after SIGTERM before the process exits anyway.
    #[serde(with = "humantime_serde")]
    pub drain_timeout: Duration,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// A connection must deliver a complete request head within this time of starting to wait
    /// for one. It is the slowloris guard and, because hyper starts the same timer whenever a
    /// kept-alive connection waits for its next request, also the idle keep-alive timeout.
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    /// Largest number of request headers accepted.
    pub max_headers: usize,
    /// Largest request head (request line plus headers) in bytes.
    pub max_header_bytes: usize,
    /// Open client connections accepted at once; beyond it a new connection gets a 503.
    pub max_connections: usize,
    /// Kernel accept queue length (capped by `net.core.somaxconn`). tokio's default of 1024
    /// overflows when a fleet of clients connects at once, and a dropped SYN costs the client a
    /// one-second retransmit.
    pub listen_backlog: u32,
    /// Tokio worker threads; unset means one per core.
    pub worker_threads: Option<NonZeroUsize>,
}

impl Default for ServerSettings {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([0, 0, 0, 0], 8080)),
            request_deadline: Duration::from_secs(1),
            drain_timeout: Duration::from_secs(20),
            max_body_bytes: 64 * 1024,
            header_read_timeout: Duration::from_secs(10),
            max_headers: 64,
            max_header_bytes: 16 * 1024,
            max_connections: 20_000,
            listen_backlog: 4096,
            worker_threads: None,
        }
    }
}

/// A string that never shows up in `Debug` output or logs.
#[derive(Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct DatabaseSettings {
    /// Connection URL; contains credentials, hence secret.
    pub url: Secret,
    pub max_connections: u32,
    pub min_connections: u32,
    /// Longest wait for a pooled connection before the caller gets an error (HikariCP's
    /// `connectionTimeout`, 2 s in the reports).
    #[serde(with = "humantime_serde")]
    pub acquire_timeout: Duration,
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
    /// Connections are retired after this long, so the pool follows a failover or a DNS change
    /// and server-side per-connection memory does not grow without bound.
    #[serde(with = "humantime_serde")]
    pub max_lifetime: Duration,
    /// Apply `migrations/` at start-up. Turn off when a separate job migrates.
    pub run_migrations: bool,
    /// Postgres `max_connections` of the server the fleet shares, for the pool-budget check.
    pub server_max_connections: u32,
    /// Connections kept back for administrators, migrations and other clients.
    pub reserved_connections: u32,
    /// Largest number of gateway replicas expected (the HPA's `maxReplicas`).
    pub max_replicas: u32,
}

impl Default for DatabaseSettings {
    fn default() -> Self {
        Self {
            url: Secret::new("postgres://postgres@127.0.0.1:5432/tributary"),
            max_connections: 20,
            min_connections: 2,
            acquire_timeout: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(600),
            max_lifetime: Duration::from_secs(1800),
            run_migrations: true,
            server_max_connections: 100,
            reserved_connections: 10,
            max_replicas: 4,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpClientSettings {
    /// Idle keep-alive connections kept per downstream host; sized for the admission limit so
    /// that steady load never opens new connections.
    pub pool_max_idle_per_host: usize,
    #[serde(with = "humantime_serde")]
    pub pool_idle_timeout: Duration,
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
}

impl Default for HttpClientSettings {
    fn default() -> Self {
        Self {
            pool_max_idle_per_host: 2048,
            pool_idle_timeout: Duration::from_secs(90),
            connect_timeout: Duration::from_millis(250),
        }
    }
}

/// The five downstream services. Field names are the service names used in metrics and
/// in the `degraded` list.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Downstreams {
    pub users: DownstreamSettings,
    pub carts: DownstreamSettings,
    pub recommendations: DownstreamSettings,
    pub promotions: DownstreamSettings,
    pub notifications: DownstreamSettings,
}

impl Default for Downstreams {
    fn default() -> Self {
        let at = |port: u16| DownstreamSettings {
            base_url: format!("http://127.0.0.1:{port}"),
            ..DownstreamSettings::default()
        };
        Self {
            users: at(9001),
            carts: at(9002),
            recommendations: at(9003),
            promotions: at(9004),
            notifications: at(9005),
        }
    }
}

impl Downstreams {
    /// The five services' settings, mutably (tests and tools that set all of them at once).
    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut DownstreamSettings> {
        [
            &mut self.users,
            &mut self.carts,
            &mut self.recommendations,
            &mut self.promotions,
            &mut self.notifications,
        ]
        .into_iter()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &DownstreamSettings)> {
        [
            ("users", &self.users),
            ("carts", &self.carts),
            ("recommendations", &self.recommendations),
            ("promotions", &self.promotions),
            ("notifications", &self.notifications),
        ]
        .into_iter()
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct DownstreamSettings {
    pub base_url: String,
    /// Per-call timeout; the effective timeout is min(this, remaining request budget).
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// Bulkhead: calls in flight to this service at once. A full bulkhead degrades an optional
    /// part immediately instead of queueing behind a slow dependency.
    pub max_concurrency: usize,
    /// Send a second, hedged request when the first has not answered after this long.
    #[serde(with = "humantime_serde")]
    pub hedge_after: Option<Duration>,
}

impl Default for DownstreamSettings {
    fn default() -> Self {
        Self {
            base_url: "http://127.0.0.1:9000".into(),
            timeout: Duration::from_millis(500),
            max_concurrency: 1024,
            hedge_after: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AdmissionMode {
    /// A fixed semaphore; the right choice when per-pod capacity has been measured.
    Static,
    /// Gradient2: the limit follows measured latency between `min_limit` and `max_limit`.
    Adaptive,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionSettings {
    pub enabled: bool,
    pub mode: AdmissionMode,
    /// Requests in flight at once (per route group).
    pub max_in_flight: usize,
    /// Longest wait for a permit before a 503.
    #[serde(with = "humantime_serde")]
    pub max_wait: Duration,
    /// Per-group overrides; keys are `dashboard` and `orders`.
    pub groups: std::collections::BTreeMap<String, AdmissionGroupSettings>,
    pub adaptive: AdaptiveSettings,
    /// Share of rejected requests per second above which readiness turns false ...
    pub unready_shed_ratio: f64,
    /// ... once it has held for this many consecutive seconds,
    pub unready_after_secs: u32,
    /// and below which, for `ready_after_secs`, readiness comes back (hysteresis).
    pub ready_shed_ratio: f64,
    pub ready_after_secs: u32,
}

impl Default for AdmissionSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            mode: AdmissionMode::Static,
            max_in_flight: 2000,
            max_wait: Duration::from_millis(100),
            groups: Default::default(),
            adaptive: AdaptiveSettings::default(),
            unready_shed_ratio: 0.5,
            unready_after_secs: 3,
            ready_shed_ratio: 0.05,
            ready_after_secs: 5,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionGroupSettings {
    pub max_in_flight: Option<usize>,
    #[serde(with = "humantime_serde")]
    pub max_wait: Option<Duration>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdaptiveSettings {
    pub initial_limit: usize,
    pub min_limit: usize,
    pub max_limit: usize,
    /// How much latency growth is tolerated before the limit shrinks (Gradient2's `rttTolerance`).
    pub tolerance: f64,
    /// Weight of each new estimate (Gradient2's `smoothing`).
    pub smoothing: f64,
}

impl Default for AdaptiveSettings {
    fn default() -> Self {
        Self {
            initial_limit: 200,
            min_limit: 20,
            max_limit: 5000,
            tolerance: 1.5,
            smoothing: 0.2,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RateLimitKey {
    /// The value of `api_key_header`, falling back to the client IP when absent.
    ApiKey,
    /// The client IP (see `trusted_proxies`).
    Ip,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RateLimitSettings {
    pub enabled: bool,
    pub key: RateLimitKey,
    /// Request header carrying the client's API key (`key = "api_key"`).
    pub api_key_header: String,
    /// Sustained requests per second per client: one request refills every 1/per_second s.
    pub per_second: u32,
    /// Bucket size: the most requests a client with a full bucket may send at once
    /// (`RateLimit-Limit`). A client that was quiet for `burst / per_second` seconds has it all.
    pub burst: u32,
    /// Peers whose `X-Forwarded-For` is believed (CIDRs or addresses). Empty: never trusted.
    pub trusted_proxies: Vec<String>,
    /// When set, the per-client limit is shared by every replica through Redis.
    pub redis_url: Option<Secret>,
    /// Budget for one Redis decision (getting a pooled connection and running the script);
    /// past it that request is decided by the local limiter.
    #[serde(with = "humantime_serde")]
    pub redis_timeout: Duration,
    /// Most Redis connections per replica (each is multiplexed, so few are needed).
    pub redis_pool_size: usize,
}

impl Default for RateLimitSettings {
    fn default() -> Self {
        Self {
            enabled: false,
            key: RateLimitKey::ApiKey,
            api_key_header: "x-api-key".into(),
            per_second: 100,
            burst: 200,
            trusted_proxies: Vec::new(),
            redis_url: None,
            redis_timeout: Duration::from_millis(20),
            redis_pool_size: 16,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct CircuitBreakerSettings {
    pub enabled: bool,
    /// Failure ratio over the window that opens the circuit ...
    pub failure_ratio: f64,
    /// ... once at least this many calls were seen in the window.
    pub min_calls: u32,
    #[serde(with = "humantime_serde")]
    pub window: Duration,
    /// How long the circuit stays open before half-open probes are let through.
    #[serde(with = "humantime_serde")]
    pub open_for: Duration,
    /// Probes allowed while half-open; all must succeed to close again.
    pub half_open_probes: u32,
}

impl Default for CircuitBreakerSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            failure_ratio: 0.5,
            min_calls: 100,
            window: Duration::from_secs(10),
            open_for: Duration::from_secs(5),
            half_open_probes: 3,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetrySettings {
    /// Extra attempts for an idempotent downstream call (0 disables retries).
    pub max_retries: u32,
    #[serde(with = "humantime_serde")]
    pub backoff_base: Duration,
    /// Retries allowed as a share of calls (the retry budget), e.g. 0.1 = 10 %.
    pub budget_ratio: f32,
    /// Retries per second always allowed regardless of the ratio.
    pub budget_min_per_sec: u32,
}

impl Default for RetrySettings {
    fn default() -> Self {
        Self {
            max_retries: 1,
            backoff_base: Duration::from_millis(10),
            budget_ratio: 0.1,
            budget_min_per_sec: 10,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    Json,
    Pretty,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetrySettings {
    pub log_format: LogFormat,
    /// `tracing` filter directives, e.g. `info,tributary=debug`; `RUST_LOG` wins when set.
    pub log_level: String,
    pub metrics_enabled: bool,
    /// OTLP/HTTP endpoint (e.g. `http://otel-collector:4318`); unset turns trace export off.
    pub otlp_endpoint: Option<String>,
    /// Share of root traces sampled (parent decisions are honoured).
    pub sampling_ratio: f64,
    pub service_name: String,
    /// A single poll that holds a worker thread longer than this is logged and counted.
    #[serde(with = "humantime_serde")]
    pub long_poll_threshold: Duration,
}

impl Default for TelemetrySettings {
    fn default() -> Self {
        Self {
            log_format: LogFormat::Json,
            log_level: "info".into(),
            metrics_enabled: true,
            otlp_endpoint: None,
            sampling_ratio: 1.0,
            service_name: "tributary".into(),
            long_poll_threshold: Duration::from_millis(10),
        }
    }
}

/// A configuration problem, worded for the person who has to fix it.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("configuration could not be read: {0}")]
    Load(String),
    #[error("invalid configuration: {}", .0.join("; "))]
    Invalid(Vec<String>),
}

/// Where settings come from; a value so that tests can build one without touching the process
/// environment.
#[derive(Debug, Default, Clone)]
pub struct Sources<'a> {
    pub file: Option<&'a Path>,
    /// Environment variables as `(name, value)` pairs.
    pub env: Vec<(String, String)>,
}

impl Sources<'_> {
    /// The real process environment and the default file location.
    pub fn from_process(file: Option<&Path>) -> Sources<'_> {
        Sources {
            file,
            env: std::env::vars().collect(),
        }
    }
}

impl Settings {
    /// Loads and validates settings from the given sources.
    pub fn load(sources: &Sources<'_>) -> Result<Self, ConfigError> {
        let mut figment = Figment::new();
        match sources.file {
            Some(path) if !path.exists() => {
                return Err(ConfigError::Load(format!(
                    "config file {} does not exist",
                    path.display()
                )));
            }
            Some(path) => figment = figment.merge(Toml::file_exact(path)),
            None => {}
        }
        let env: Vec<(String, String)> = sources
            .env
            .iter()
            .filter_map(|(k, v)| {
                let rest = k.strip_prefix("TRIBUTARY_")?;
                // TRIBUTARY_CONFIG names the file and TRIBUTARY_GIT_REVISION is a build input:
                // neither is a setting.
                (rest.contains("__")).then(|| (rest.to_owned(), v.clone()))
            })
            .collect();
        // Environment overrides go through figment as `(dotted.path, value)` pairs built from
        // the given variables, so tests never have to mutate the process environment.
        for (key, value) in env {
            let path = key.to_ascii_lowercase().replace("__", ".");
            let parsed: figment::value::Value = value
                .parse()
                .unwrap_or_else(|_| figment::value::Value::from(value.clone()));
            figment = figment.merge((path, parsed));
        }
        if let Some((_, url)) = sources.env.iter().find(|(k, _)| k == "DATABASE_URL") {
            figment = figment.merge(("database.url", url.clone()));
        }
        let settings: Settings = figment
            .extract()
            .map_err(|e| ConfigError::Load(flatten_figment_error(e)))?;
        settings.validate()?;
        Ok(settings)
    }

    /// Checks values that parse but cannot work together.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        let db = &self.database;
        let url = db.url.expose();
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            problems.push("database.url is not a valid Postgres URL (it must start with postgres:// or postgresql://)".into());
        } else if let Err(e) = PgConnectOptions::from_str(url) {
            problems.push(format!("database.url is not a valid Postgres URL ({e})"));
        }
        if db.max_connections == 0 {
            problems.push("database.max_connections must be at least 1".into());
        }
        if db.min_connections > db.max_connections {
            problems.push(format!(
                "database.min_connections ({}) is greater than database.max_connections ({})",
                db.min_connections, db.max_connections
            ));
        }
        let mut nonzero = |name: &str, d: Duration| {
            if d.is_zero() {
                problems.push(format!("{name} must be greater than zero"));
            }
        };
        nonzero("database.acquire_timeout", db.acquire_timeout);
        nonzero("server.request_deadline", self.server.request_deadline);
        nonzero(
            "server.header_read_timeout",
            self.server.header_read_timeout,
        );
        nonzero(
            "http_client.connect_timeout",
            self.http_client.connect_timeout,
        );
        nonzero("circuit_breaker.window", self.circuit_breaker.window);
        nonzero("circuit_breaker.open_for", self.circuit_breaker.open_for);
        nonzero("rate_limit.redis_timeout", self.rate_limit.redis_timeout);
        for (name, ds) in self.downstreams.iter() {
            nonzero(&format!("downstreams.{name}.timeout"), ds.timeout);
        }
        for (name, ds) in self.downstreams.iter() {
            match reqwest::Url::parse(&ds.base_url) {
                Ok(url) if matches!(url.scheme(), "http" | "https") && url.has_host() => {}
                Ok(_) => problems.push(format!(
                    "downstreams.{name}.base_url must be an http(s) URL with a host, got {:?}",
                    ds.base_url
                )),
                Err(e) => problems.push(format!(
                    "downstreams.{name}.base_url is not a valid URL ({e}): {:?}",
                    ds.base_url
                )),
            }
            if ds.max_concurrency == 0 {
                problems.push(format!(
                    "downstreams.{name}.max_concurrency must be at least 1"
                ));
            }
        }
        let adm = &self.admission;
        if adm.max_in_flight == 0 {
            problems.push("admission.max_in_flight must be at least 1".into());
        }
        for (group, g) in &adm.groups {
            if !crate::admission::GROUPS.contains(&group.as_str()) {
                problems.push(format!(
                    "admission.groups.{group} is not a route group (known: {})",
                    crate::admission::GROUPS.join(", ")
                ));
            }
            if g.max_in_flight == Some(0) {
                problems.push(format!(
                    "admission.groups.{group}.max_in_flight must be at least 1"
                ));
            }
        }
        let a = &adm.adaptive;
        if !(a.min_limit >= 1 && a.min_limit <= a.initial_limit && a.initial_limit <= a.max_limit) {
            problems.push(format!(
                "admission.adaptive needs 1 <= min_limit <= initial_limit <= max_limit, got {} / {} / {}",
                a.min_limit, a.initial_limit, a.max_limit
            ));
        }
        // Written so that NaN is rejected too.
        if a.tolerance.is_nan() || a.tolerance < 1.0 {
            problems.push("admission.adaptive.tolerance must be >= 1.0".into());
        }
        if a.smoothing.is_nan() || a.smoothing <= 0.0 || a.smoothing > 1.0 {
            problems.push("admission.adaptive.smoothing must be in (0, 1]".into());
        }
        for (name, r) in [
            ("admission.unready_shed_ratio", adm.unready_shed_ratio),
            ("admission.ready_shed_ratio", adm.ready_shed_ratio),
            (
                "circuit_breaker.failure_ratio",
                self.circuit_breaker.failure_ratio,
            ),
            ("telemetry.sampling_ratio", self.telemetry.sampling_ratio),
        ] {
            if !(0.0..=1.0).contains(&r) {
                problems.push(format!("{name} must be between 0 and 1, got {r}"));
            }
        }
        if adm.ready_shed_ratio > adm.unready_shed_ratio {
            problems.push(
                "admission.ready_shed_ratio must not exceed admission.unready_shed_ratio (no hysteresis otherwise)".into(),
            );
        }
        let rl = &self.rate_limit;
        if rl.enabled && rl.per_second == 0 {
            problems.push("rate_limit.per_second must be at least 1".into());
        }
        if rl.enabled && rl.burst == 0 {
            problems.push("rate_limit.burst must be at least 1".into());
        }
        if rl.redis_pool_size == 0 {
            problems.push("rate_limit.redis_pool_size must be at least 1".into());
        }
        if http::HeaderName::from_bytes(rl.api_key_header.as_bytes()).is_err() {
            problems.push(format!(
                "rate_limit.api_key_header {:?} is not a valid header name",
                rl.api_key_header
            ));
        }
        for proxy in &rl.trusted_proxies {
            if crate::ratelimit::parse_cidr(proxy).is_none() {
                problems.push(format!(
                    "rate_limit.trusted_proxies entry {proxy:?} is not an IP address or CIDR"
                ));
            }
        }
        if let Some(url) = &rl.redis_url
            && !url.expose().starts_with("redis://")
            && !url.expose().starts_with("rediss://")
        {
            problems.push("rate_limit.redis_url must start with redis:// or rediss://".into());
        }
        if let Some(endpoint) = &self.telemetry.otlp_endpoint
            && reqwest::Url::parse(endpoint).is_err()
        {
            problems.push(format!(
                "telemetry.otlp_endpoint is not a valid URL: {endpoint:?}"
            ));
        }
        if self.server.max_body_bytes == 0 {
            problems.push("server.max_body_bytes must be at least 1".into());
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }

    /// Admission settings resolved for one route group.
    pub fn admission_for(&self, group: &str) -> (usize, Duration) {
        let g = self.admission.groups.get(group);
        (
            g.and_then(|g| g.max_in_flight)
                .unwrap_or(self.admission.max_in_flight),
            g.and_then(|g| g.max_wait)
                .unwrap_or(self.admission.max_wait),
        )
    }
}

fn flatten_figment_error(e: figment::Error) -> String {
    e.into_iter()
        .map(|e| {
            let path = e.path.join(".");
            let kind = e.kind.to_string();
            if path.is_empty() {
                kind
            } else {
                format!("{path}: {kind}")
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(env: &[(&str, &str)]) -> Result<Settings, ConfigError> {
        Settings::load(&Sources {
            file: None,
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        })
    }

    #[test]
    fn defaults_are_valid() {
        let s = load(&[]).expect("defaults must validate");
        assert_eq!(s.database.acquire_timeout, Duration::from_secs(2));
        assert_eq!(s.admission.max_in_flight, 2000);
        assert_eq!(s.admission.max_wait, Duration::from_millis(100));
    }

    #[test]
    fn the_shipped_default_file_matches_the_built_in_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/default.toml");
        let from_file = Settings::load(&Sources {
            file: Some(&path),
            env: vec![],
        })
        .expect("config/default.toml must load");
        let built_in = Settings::default();
        assert_eq!(
            toml_of(&from_file),
            toml_of(&built_in),
            "config/default.toml drifted from the Default impls"
        );
    }

    fn toml_of(s: &Settings) -> String {
        serde_json::to_string(s).unwrap()
    }

    #[test]
    fn environment_overrides_nested_keys() {
        let s = load(&[
            ("TRIBUTARY_DOWNSTREAMS__CARTS__TIMEOUT", "250ms"),
            ("TRIBUTARY_DATABASE__MAX_CONNECTIONS", "7"),
            ("TRIBUTARY_ADMISSION__MODE", "adaptive"),
            ("DATABASE_URL", "postgres://app@db:5432/app"),
            ("TRIBUTARY_CONFIG", "ignored.toml"),
        ])
        .unwrap();
        assert_eq!(s.downstreams.carts.timeout, Duration::from_millis(250));
        assert_eq!(s.database.max_connections, 7);
        assert_eq!(s.admission.mode, AdmissionMode::Adaptive);
        assert_eq!(s.database.url.expose(), "postgres://app@db:5432/app");
    }

    #[test]
    fn unknown_keys_are_rejected_with_their_path() {
        let err = load(&[("TRIBUTARY_DATABASE__MAX_CONECTIONS", "7")]).unwrap_err();
        assert!(err.to_string().contains("max_conections"), "{err}");
    }

    #[test]
    fn min_above_max_zero_timeout_and_bad_urls_are_all_reported() {
        let err = load(&[
            ("TRIBUTARY_DATABASE__MIN_CONNECTIONS", "30"),
            ("TRIBUTARY_DATABASE__MAX_CONNECTIONS", "10"),
            ("TRIBUTARY_DOWNSTREAMS__USERS__TIMEOUT", "0s"),
            ("TRIBUTARY_DOWNSTREAMS__CARTS__BASE_URL", "not a url"),
            ("DATABASE_URL", "mysql://nope"),
        ])
        .unwrap_err()
        .to_string();
        for needle in [
            "database.min_connections (30) is greater than database.max_connections (10)",
            "downstreams.users.timeout must be greater than zero",
            "downstreams.carts.base_url is not a valid URL",
            "database.url is not a valid Postgres URL",
        ] {
            assert!(err.contains(needle), "missing {needle:?} in {err}");
        }
    }

    #[test]
    fn secrets_do_not_print() {
        let s = Settings::default();
        assert!(!format!("{:?}", s).contains("postgres://"));
    }

    #[test]
    fn inconsistent_rate_limit_settings_are_all_reported() {
        let err = load(&[
            ("TRIBUTARY_RATE_LIMIT__ENABLED", "true"),
            ("TRIBUTARY_RATE_LIMIT__BURST", "0"),
            ("TRIBUTARY_RATE_LIMIT__REDIS_TIMEOUT", "0ms"),
            ("TRIBUTARY_RATE_LIMIT__REDIS_POOL_SIZE", "0"),
            ("TRIBUTARY_RATE_LIMIT__API_KEY_HEADER", "x api key"),
            ("TRIBUTARY_RATE_LIMIT__REDIS_URL", "http://cache:6379"),
        ])
        .unwrap_err()
        .to_string();
        for needle in [
            "rate_limit.burst must be at least 1",
            "rate_limit.redis_timeout must be greater than zero",
            "rate_limit.redis_pool_size must be at least 1",
            "rate_limit.api_key_header \"x api key\" is not a valid header name",
            "rate_limit.redis_url must start with redis://",
        ] {
            assert!(err.contains(needle), "missing {needle:?} in {err}");
        }
    }

    #[test]
    fn group_overrides_fall_back_to_the_global_admission_values() {
        let s = load(&[("TRIBUTARY_ADMISSION__GROUPS__ORDERS__MAX_IN_FLIGHT", "50")]).unwrap();
        assert_eq!(s.admission_for("orders").0, 50);
        assert_eq!(s.admission_for("dashboard").0, 2000);
        assert_eq!(s.admission_for("orders").1, Duration::from_millis(100));
    }
}
