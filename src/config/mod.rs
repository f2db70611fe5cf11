//! Typed settings, parsed once at the edge: the bottom layer, which imports nothing that runs.
//!
//! Layering, lowest to highest precedence:
//! 1. built-in defaults (the `Default` impls below, which mirror `config/default.toml`);
//! 2. a TOML file (`--config PATH`, `TRIBUTARY_CONFIG`, or `config/default.toml` when present);
//! 3. environment variables `TRIBUTARY_<SECTION>__<KEY>` (double underscore between levels,
//!    e.g. `TRIBUTARY_DOWNSTREAMS__USERS__TIMEOUT=250ms`);
//! 4. `DATABASE_URL`, the de-facto standard name, overriding `database.url`, and `RUST_LOG`,
//!    overriding `telemetry.log_level`.
//!
//! Each value is parsed into a type that holds its invariant (`NonZero*` for limits and sizes,
//! [`Ratio`], [`HttpUrl`], [`Cidr`], [`Secret`], positive durations, [`RouteGroup`] keys), so a
//! bad value fails start-up with its key's path and the code that uses it never checks again;
//! [`Settings::validate`] keeps only the rules that relate two keys. Unknown keys are rejected,
//! in the file and in the environment alike (a `TRIBUTARY_*` variable that names no key is
//! reported with the closest one), so that a typo fails start-up instead of being silently
//! ignored. Nothing outside this module reads the environment.
//!
//! Every section is in this one file, each struct beside its `Default`, so that everything
//! the gateway can be told reads in one place (and `config/default.toml` beside it); the
//! loader is in `load`, the value types in `types`, the tests in `tests`.

mod load;
mod otel;
pub mod routing;
mod types;

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    num::{NonZeroU32, NonZeroUsize},
    time::Duration,
};

use http::HeaderName;
use serde::{Deserialize, Serialize};

pub use crate::domain::{RouteGroup, Service};
pub use load::{ConfigError, Sources};
pub use otel::{OtelEnv, OtelSettings, OtlpHeaders, SamplerKind, Source, Sourced};
pub use routing::{RoutingSettings, VariantName, VariantSettings};
pub use types::{Cidr, HttpUrl, Ratio, Secret};

/// `n` as a `NonZeroUsize` in a `const` (the defaults below).
const fn nonzero(n: usize) -> NonZeroUsize {
    NonZeroUsize::new(n).expect("a non-zero default")
}

/// `n` as a `NonZeroU32` in a `const`.
const fn nonzero_u32(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("a non-zero default")
}

/// Everything the gateway can be told.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    pub server: ServerSettings,
    pub database: DatabaseSettings,
    pub http_client: HttpClientSettings,
    pub downstreams: Downstreams,
    pub admission: AdmissionSettings,
    pub overload: OverloadSettings,
    pub rate_limit: RateLimitSettings,
    pub circuit_breaker: CircuitBreakerSettings,
    pub retry: RetrySettings,
    pub telemetry: TelemetrySettings,
    /// Grey releases: the admin endpoints and the automatic rollback (`routing.rs`).
    pub routing: RoutingSettings,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerSettings {
    /// The API, and `/healthz` and `/readyz` for probes.
    pub listen: SocketAddr,
    /// The operations endpoints: `/metrics`, and copies of `/healthz` and `/readyz`. A port of
    /// their own, so that what scrapes and probes the gateway never competes with the API's
    /// clients for connections, and the API's clients never reach the scrape.
    pub ops_listen: SocketAddr,
    /// Budget for a whole request; every downstream call and query gets at most what is left.
    #[serde(with = "types::positive_duration")]
    pub request_deadline: Duration,
    /// How long in-flight requests may run after SIGTERM before the process exits anyway.
    #[serde(with = "humantime_serde")]
    pub drain_timeout: Duration,
    /// Largest accepted request body; a larger declared `Content-Length` is refused at once.
    pub max_body_bytes: NonZeroUsize,
    /// A request body must be complete within this time of the handler starting to read it
    /// (and within the request's deadline); otherwise 408 and the connection is closed. The
    /// slow-body ("R.U.D.Y.") guard: without it a client sending a byte now and then holds its
    /// admission permit for as long as it likes.
    #[serde(with = "types::positive_duration")]
    pub body_read_timeout: Duration,
    /// A response write that makes no progress for this long (the client stopped reading)
    /// closes the connection, and with it the response it pinned in memory.
    #[serde(with = "types::positive_duration")]
    pub write_timeout: Duration,
    /// Answer a client that shuts down its sending side after its request (`socat`, `nc -N`).
    /// TCP cannot tell that from a client that has gone away, so with this on an abandoned
    /// request is no longer cancelled at once: it runs on, holding its admission permit and
    /// its downstream calls, until it completes or its deadline passes.
    pub half_close: bool,
    /// A connection must deliver a complete request head within this time of starting to wait
    /// for one. It is the slowloris guard and, because hyper starts the same timer whenever a
    /// kept-alive connection waits for its next request, also the idle keep-alive timeout.
    #[serde(with = "types::positive_duration")]
    pub header_read_timeout: Duration,
    /// Largest number of request headers accepted.
    pub max_headers: NonZeroUsize,
    /// Largest request head (request line plus headers) in bytes.
    pub max_header_bytes: NonZeroUsize,
    /// Open client connections accepted at once; beyond it a new connection gets a 503.
    pub max_connections: NonZeroUsize,
    /// Kernel accept queue length (capped by `net.core.somaxconn`). tokio's default of 1024
    /// overflows when a fleet of clients connects at once, and a dropped SYN costs the client a
    /// one-second retransmit.
    pub listen_backlog: u32,
    /// Tokio worker threads; unset means one per core.
    pub worker_threads: Option<NonZeroUsize>,
    /// Serve the administrative endpoints (`DELETE /admin/cache/...`) on `ops_listen`. Off by
    /// default: the operations port is often reachable by more than the operators (a scraper,
    /// a sidecar), and dropping a cache on purpose is an operator's decision.
    pub admin: bool,
}

impl Default for ServerSettings {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([0, 0, 0, 0], 8080)),
            ops_listen: SocketAddr::from(([0, 0, 0, 0], 9090)),
            request_deadline: Duration::from_secs(1),
            drain_timeout: Duration::from_secs(20),
            max_body_bytes: nonzero(64 * 1024),
            body_read_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(10),
            half_close: false,
            header_read_timeout: Duration::from_secs(10),
            max_headers: nonzero(64),
            max_header_bytes: nonzero(16 * 1024),
            max_connections: nonzero(20_000),
            listen_backlog: 4096,
            worker_threads: None,
            admin: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct DatabaseSettings {
    /// Connection URL; contains credentials, hence secret.
    #[serde(deserialize_with = "types::postgres_url")]
    pub url: Secret,
    pub max_connections: NonZeroU32,
    /// Connections kept open while idle. Unset: `max_connections`, a fixed-size pool, as
    /// HikariCP advises (its `minimumIdle` defaults to its maximum): a pool that opens its
    /// connections under the first burst makes that burst wait for connects, and the lab saw
    /// the admission limit cut for that line (`bench/results/experiments/pool-warm-up`).
    pub min_connections: Option<u32>,
    /// Longest wait for a pooled connection before the caller gets an error.
    #[serde(with = "types::positive_duration")]
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

impl DatabaseSettings {
    /// `min_connections`, or `max_connections` when unset.
    pub fn min_connections(&self) -> u32 {
        self.min_connections.unwrap_or(self.max_connections.get())
    }
}

impl Default for DatabaseSettings {
    fn default() -> Self {
        Self {
            url: Secret::new("postgres://postgres@127.0.0.1:5432/tributary"),
            max_connections: nonzero_u32(20),
            min_connections: None,
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

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpClientSettings {
    /// How the calls go out: reqwest, or hyper-util's pooled client without reqwest's layers
    /// (plain `http://` downstreams only). See `downstream::transport`.
    pub transport: TransportKind,
    /// Idle keep-alive connections kept per downstream host; sized for the admission limit so
    /// that steady load never opens new connections.
    pub pool_max_idle_per_host: usize,
    #[serde(with = "humantime_serde")]
    pub pool_idle_timeout: Duration,
    #[serde(with = "types::positive_duration")]
    pub connect_timeout: Duration,
    /// Speak HTTP/2 to every downstream from the first byte (h2c on `http://`, no upgrade, no
    /// ALPN): each call is a stream on a few shared connections instead of a connection of its
    /// own, so the pool holds a handful of sockets and their buffers instead of one per
    /// concurrent call (Little's law: ~1,800 at 500 inbound connections). Off by default:
    /// every downstream must speak HTTP/2, and one that speaks only HTTP/1 fails every call.
    /// hyper keeps one connection per host and never opens a second when the server's
    /// `SETTINGS_MAX_CONCURRENT_STREAMS` is reached (RFC 9113 §9.1; hyperium/hyper#2197): past
    /// that many calls in flight (hyper-based servers 200, Go 250, nginx 128) the next ones
    /// wait in the client, under their timeout, so at 100 ms a call one gateway gets at most
    /// ~2,000 calls/s from a downstream host that allows 200.
    pub http2_prior_knowledge: bool,
}

impl Default for HttpClientSettings {
    fn default() -> Self {
        Self {
            transport: TransportKind::Reqwest,
            pool_max_idle_per_host: 2048,
            pool_idle_timeout: Duration::from_secs(90),
            connect_timeout: Duration::from_millis(250),
            http2_prior_knowledge: false,
        }
    }
}

/// The HTTP client the downstream calls go through (`http_client.transport`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// reqwest: TLS, and the client this service's users expect.
    Reqwest,
    /// hyper-util's client directly: fewer instructions per call, plain `http://` only.
    Hyper,
}

/// The five downstream services, one key per [`Service`] (a test keeps the keys and the
/// service names equal).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
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
            base_url: format!("http://127.0.0.1:{port}")
                .parse()
                .expect("a valid default URL"),
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
    /// One service's settings.
    pub fn get(&self, service: Service) -> &DownstreamSettings {
        match service {
            Service::Users => &self.users,
            Service::Carts => &self.carts,
            Service::Recommendations => &self.recommendations,
            Service::Promotions => &self.promotions,
            Service::Notifications => &self.notifications,
        }
    }

    /// One service's settings, mutably.
    pub fn get_mut(&mut self, service: Service) -> &mut DownstreamSettings {
        match service {
            Service::Users => &mut self.users,
            Service::Carts => &mut self.carts,
            Service::Recommendations => &mut self.recommendations,
            Service::Promotions => &mut self.promotions,
            Service::Notifications => &mut self.notifications,
        }
    }

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
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct DownstreamSettings {
    /// `http(s)://host[:port][/path]`; calls go to `{base_url}/{service}/{user_id}`.
    pub base_url: HttpUrl,
    /// Per-call timeout; the effective timeout is min(this, remaining request budget).
    #[serde(with = "types::positive_duration")]
    pub timeout: Duration,
    /// Bulkhead: calls in flight to this service at once. A full bulkhead degrades an optional
    /// part immediately instead of queueing behind a slow dependency.
    pub max_concurrency: NonZeroUsize,
    /// Send a second, hedged request when the first has not answered after this long.
    #[serde(with = "humantime_serde")]
    pub hedge_after: Option<Duration>,
    /// Grey releases: other deployments of this service, by name (see `routing.rs`).
    pub variants: BTreeMap<VariantName, VariantSettings>,
    /// Which requests go to a variant, in order: the first rule that matches decides; a
    /// request no rule matches goes to this downstream itself (`stable`).
    pub rules: Vec<routing::Rule>,
    /// Cache this service's answers (see `docs/caching.md`); unset (the default) calls the
    /// service for every request and costs nothing.
    pub cache: Option<CacheSettings>,
}

impl Default for DownstreamSettings {
    fn default() -> Self {
        Self {
            base_url: "http://127.0.0.1:9000"
                .parse()
                .expect("a valid default URL"),
            timeout: Duration::from_millis(500),
            max_concurrency: nonzero(1024),
            hedge_after: None,
            variants: BTreeMap::new(),
            rules: Vec::new(),
            cache: None,
        }
    }
}

/// Whose requests share a cached answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheKey {
    /// One entry per user: the answer depends on who asks (a cart, notifications).
    PerUser,
    /// One entry for everybody: the answer is the same for every user (site-wide
    /// promotions). Only for services that ignore the user id in the path.
    Shared,
}

impl CacheKey {
    pub fn as_str(self) -> &'static str {
        match self {
            CacheKey::PerUser => "per_user",
            CacheKey::Shared => "shared",
        }
    }
}

/// One downstream's cache policy.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheSettings {
    pub key: CacheKey,
    /// How long an answer is served without calling the service again (its freshness). A
    /// shorter `max-age` from the service shortens it; nothing lengthens it.
    #[serde(with = "types::positive_duration")]
    pub ttl: Duration,
    /// Follow the service's `Cache-Control`: `no-store` is never stored, `private` never in a
    /// `shared` cache, `no-cache` and `max-age=0` are not fresh, `max-age` (and, in a shared
    /// cache, `s-maxage`) caps `ttl`.
    pub honour_cache_control: bool,
    /// Bound of the cache's memory: the bodies plus their keys, in bytes.
    pub max_bytes: std::num::NonZeroU64,
    /// How long past its freshness an answer is kept to stand in for a failed or late call
    /// (served and listed in the dashboard's `stale`); 0 turns that off.
    #[serde(with = "humantime_serde")]
    pub stale_if_error: Duration,
}

impl Default for CacheSettings {
    fn default() -> Self {
        Self {
            key: CacheKey::PerUser,
            ttl: Duration::from_secs(30),
            honour_cache_control: true,
            max_bytes: std::num::NonZeroU64::new(16 * 1024 * 1024).expect("a non-zero default"),
            stale_if_error: Duration::ZERO,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AdmissionMode {
    /// A fixed semaphore of `max_in_flight`; for when per-pod capacity has been measured and
    /// does not change.
    Static,
    /// The limit follows the runtime's queueing delay (see `overload.queue_delay_target`):
    /// it shrinks while the gateway's own CPU is the bottleneck and grows while the queue is
    /// short and the limit is what turns requests away or nine tenths of it are in use (a tenth
    /// of headroom over demand). The default: it needs no per-machine number.
    Adaptive,
    /// Gradient2 (Netflix concurrency-limits): the limit follows measured request latency
    /// against its long-term baseline, between `min_limit` and `max_limit`.
    Gradient2,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionSettings {
    pub enabled: bool,
    pub mode: AdmissionMode,
    /// Requests in flight at once (per route group).
    pub max_in_flight: NonZeroUsize,
    /// Longest wait for a permit before a 503.
    #[serde(with = "humantime_serde")]
    pub max_wait: Duration,
    /// While the wait queue stands (over a whole control interval, 100 ms, requests found no
    /// permit free and none was admitted without waiting), waiting in it buys no throughput (a
    /// waiter is always there to take a returned permit) and only adds its length to every
    /// admitted request's latency. It is then kept to the requests the recent release rate
    /// serves within this (at most `max_wait`; half of it, as for `max_wait`), and the rest
    /// are turned away at once, until an interval in which most requests find a permit free.
    /// CoDel's test, and Facebook's "controlled delay" for server queues. `max_wait` stays the
    /// timeout: a waiter whose permit is late is not turned away sooner. Default 30 ms (the
    /// queue then holds what returns within 15 ms); `max_wait` or more, or unset, turns it off
    /// (a standing queue may then be as long as `max_wait` allows). At 30 ms the lab measured
    /// admitted requests waiting 5–12 ms instead of 15–29 ms on average under overload on a
    /// whole core, their mean server-side latency 11–21 ms lower, and the same goodput (the
    /// medians of six alternating rounds within −3 to +8 %, Retry-After clients included). At
    /// 10 ms (a 5 ms queue) clients that honour `Retry-After` lost 12–19 % of their goodput on
    /// a whole core: turned away at once more often, they stayed away for seconds while
    /// permits went idle (docs/benchmarks.md).
    #[serde(with = "humantime_serde")]
    pub standing_wait: Option<Duration>,
    /// A client on HTTP/1 that comes back before its last 503's `Retry-After` (at most
    /// `pushback_max_hold`) and is turned away again gets that 503 only when the `Retry-After`
    /// is over, so a client that retries at once costs one rejection per pause, not one per
    /// retry; its retries are still read and admitted at once when there is room. The pause
    /// doubles while it keeps coming back early (up to `pushback_max_hold`), and each 503's
    /// `Retry-After` says so. Turn off behind an L7 proxy that multiplexes many clients onto
    /// one upstream connection.
    pub pushback: bool,
    /// The longest a held 503 waits (and so the longest pause a client that ignores
    /// `Retry-After` is given), at most half of `server.write_timeout`: a held write must not
    /// look like a stuck client. Rejections cost at most one per connection per this long.
    #[serde(with = "humantime_serde")]
    pub pushback_max_hold: Duration,
    /// Per-group overrides; keys are `dashboard` and `orders`.
    pub groups: BTreeMap<RouteGroup, AdmissionGroupSettings>,
    pub adaptive: AdaptiveSettings,
    /// Whether heavy shedding (the hysteresis below) turns readiness false. Off by default:
    /// when a whole fleet is overloaded, readiness that follows shedding takes replicas out one
    /// after another and the rest get their traffic on top (a cascade); a replica that sheds is
    /// still serving all it can. Either way the state is in `/readyz`'s body and in
    /// `tributary_admission_shedding`. On suits one hot replica behind a load balancer that
    /// spreads by readiness.
    pub shedding_turns_unready: bool,
    /// Share of rejected requests per second above which shedding is heavy ...
    pub unready_shed_ratio: Ratio,
    /// ... once it has held for this many consecutive seconds,
    pub unready_after_secs: u32,
    /// and below which, for `ready_after_secs`, readiness comes back (hysteresis).
    pub ready_shed_ratio: Ratio,
    pub ready_after_secs: u32,
}

impl Default for AdmissionSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            mode: AdmissionMode::Adaptive,
            max_in_flight: nonzero(2000),
            max_wait: Duration::from_millis(100),
            standing_wait: Some(Duration::from_millis(30)),
            pushback: true,
            pushback_max_hold: Duration::from_secs(5),
            groups: BTreeMap::new(),
            adaptive: AdaptiveSettings::default(),
            shedding_turns_unready: false,
            unready_shed_ratio: Ratio::of(0.5),
            unready_after_secs: 3,
            ready_shed_ratio: Ratio::of(0.05),
            ready_after_secs: 5,
        }
    }
}

/// How the gateway tells that its own CPU is the bottleneck (the `overload` module).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct OverloadSettings {
    /// The runtime is saturated when, over a 100 ms window, every task waited longer than
    /// this for a worker while the workers were busy. It drives the adaptive admission limit,
    /// and while it holds, downstream timeouts do not count against the circuit breakers.
    #[serde(with = "types::positive_duration")]
    pub queue_delay_target: Duration,
    /// The adaptive admission limit also treats the database pool's line as saturation: two
    /// 100 ms windows in a row in which every wait for a connection was over the target, or the
    /// waits averaged over twice it, shrink it. False: only the core's queue moves the limit, and requests
    /// admitted past what the pool serves wait for it (up to their deadline) and lose their
    /// database part instead of getting a 503.
    pub follow_db_pool: bool,
    /// A cut of the adaptive limit made for the core's queue alone is undone when, a permit
    /// hold later, the queue has not shortened (it is then made of something the limit does
    /// not govern, such as the rejections themselves), and the core's queue is left out of the
    /// decision for a second. False: every window over the target cuts.
    pub check_core_cuts: bool,
    /// While the core's queue is left out of the decision (its last cut did not shorten it),
    /// the adaptive limit grows by √limit a second if it is what turns requests away, instead
    /// of holding; the next trial cut judges the grown limit. Without it, cuts that the noise
    /// makes look useful are kept and nothing raises the limit again while rejections keep the
    /// core's queue over the target. Needs `check_core_cuts`: config load rejects it without.
    pub probe_past_core: bool,
    /// After a cut, the adaptive limit does not grow back until one permit-hold time has
    /// passed (the cut's effect on the line that called for it is then seen). False: it grows
    /// back by √limit an interval from the next interval on.
    pub settle_after_cut: bool,
}

impl Default for OverloadSettings {
    fn default() -> Self {
        Self {
            queue_delay_target: Duration::from_millis(5),
            follow_db_pool: true,
            check_core_cuts: true,
            probe_past_core: false,
            settle_after_cut: false,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionGroupSettings {
    pub max_in_flight: Option<NonZeroUsize>,
    #[serde(with = "humantime_serde")]
    pub max_wait: Option<Duration>,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdaptiveSettings {
    /// Where the limit starts: 200, under what one core carries (the lab: 250–550 dashboards in
    /// flight on one core, by its speed), so a fresh pod finds its limit from below, growing by a
    /// tenth an interval while calm. From 1000 (2026-12-06, a few hours) a fresh gateway met
    /// its first burst with 1,000 requests admitted at once: on a core that carries ~300, the
    /// cuts of a tenth took two to three seconds to bring the limit down, downstream calls past
    /// their 500 ms timeout meanwhile, and in 3 of 15 fresh starts under 1,000 connections the
    /// `users` breaker opened and the gateway served 300–800 full 200s a second for ten seconds
    /// (`bench/run overload-curve`, AMD EPYC VM, 21:27 UTC; bench/results/experiments/limit-headroom).
    /// Turning requests away for the first second of a pod's life is the cheaper mistake.
    pub initial_limit: usize,
    pub min_limit: NonZeroUsize,
    pub max_limit: usize,
    /// How much latency growth is tolerated before the limit shrinks (Gradient2's
    /// `rttTolerance`); at least 1.
    #[serde(deserialize_with = "types::at_least_one")]
    pub tolerance: f64,
    /// Weight of each new estimate (Gradient2's `smoothing`), in (0, 1].
    #[serde(deserialize_with = "types::positive_ratio")]
    pub smoothing: Ratio,
}

impl Default for AdaptiveSettings {
    fn default() -> Self {
        Self {
            initial_limit: 200,
            min_limit: nonzero(20),
            max_limit: 5000,
            tolerance: 1.5,
            smoothing: Ratio::of(0.2),
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

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RateLimitSettings {
    pub enabled: bool,
    pub key: RateLimitKey,
    /// Request header carrying the client's API key (`key = "api_key"`).
    #[serde(with = "types::header_name")]
    pub api_key_header: HeaderName,
    /// Sustained requests per second per client: one request refills every 1/per_second s.
    pub per_second: NonZeroU32,
    /// Bucket size: the most requests a client with a full bucket may send at once
    /// (`RateLimit-Limit`). A client that was quiet for `burst / per_second` seconds has it all.
    pub burst: NonZeroU32,
    /// Peers whose `X-Forwarded-For` is believed (CIDRs or addresses). Empty: never trusted.
    pub trusted_proxies: Vec<Cidr>,
    /// When set, the per-client limit is shared by every replica through Redis.
    #[serde(deserialize_with = "types::redis_url")]
    pub redis_url: Option<Secret>,
    /// Budget for one Redis decision (getting a pooled connection and running the script);
    /// past it that request is decided by the local limiter.
    #[serde(with = "types::positive_duration")]
    pub redis_timeout: Duration,
    /// Most Redis connections per replica (each is multiplexed, so few are needed).
    pub redis_pool_size: NonZeroUsize,
}

impl Default for RateLimitSettings {
    fn default() -> Self {
        Self {
            enabled: false,
            key: RateLimitKey::ApiKey,
            api_key_header: HeaderName::from_static("x-api-key"),
            per_second: nonzero_u32(100),
            burst: nonzero_u32(200),
            trusted_proxies: Vec::new(),
            redis_url: None,
            redis_timeout: Duration::from_millis(20),
            redis_pool_size: nonzero(16),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct CircuitBreakerSettings {
    pub enabled: bool,
    /// Failure ratio over the window that opens the circuit ...
    pub failure_ratio: Ratio,
    /// ... once at least this many calls were seen in the window.
    pub min_calls: u32,
    #[serde(with = "types::positive_duration")]
    pub window: Duration,
    /// How long the circuit stays open before half-open probes are let through.
    #[serde(with = "types::positive_duration")]
    pub open_for: Duration,
    /// Probes allowed while half-open; all must succeed to close again.
    pub half_open_probes: u32,
}

impl Default for CircuitBreakerSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            failure_ratio: Ratio::of(0.5),
            min_calls: 100,
            window: Duration::from_secs(10),
            open_for: Duration::from_secs(5),
            half_open_probes: 3,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetrySettings {
    /// Extra attempts for an idempotent downstream call (0 disables retries).
    pub max_retries: u32,
    #[serde(with = "humantime_serde")]
    pub backoff_base: Duration,
    /// Retries allowed as a share of calls (the retry budget), e.g. 0.1 = 10 %.
    pub budget_ratio: Ratio,
    /// Retries per second always allowed regardless of the ratio.
    pub budget_min_per_sec: u16,
}

impl Default for RetrySettings {
    fn default() -> Self {
        Self {
            max_retries: 1,
            backoff_base: Duration::from_millis(10),
            budget_ratio: Ratio::of(0.1),
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

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetrySettings {
    pub log_format: LogFormat,
    /// `tracing` filter directives, e.g. `info,tributary=debug`; `RUST_LOG` wins when set.
    pub log_level: String,
    pub metrics_enabled: bool,
    /// OTLP/HTTP base endpoint for every signal (e.g. `http://otel-collector:4318`; traces go
    /// to `/v1/traces` under it, metrics to `/v1/metrics`). Else `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub otlp_endpoint: Option<HttpUrl>,
    /// The traces endpoint, used as it is; wins over `otlp_endpoint`. Else
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`.
    pub otlp_traces_endpoint: Option<HttpUrl>,
    /// The metrics endpoint, used as it is; wins over `otlp_endpoint`. Else
    /// `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`. Metrics are exported over OTLP only when one
    /// of the three resolves to an endpoint.
    pub otlp_metrics_endpoint: Option<HttpUrl>,
    /// Headers for every export, `key=value,key=value` (values masked when printed). Else
    /// `OTEL_EXPORTER_OTLP_HEADERS`.
    pub otlp_headers: Option<OtlpHeaders>,
    /// How often metrics are exported over OTLP. Else `OTEL_METRIC_EXPORT_INTERVAL`, else 10 s.
    #[serde(with = "types::optional_positive_duration")]
    pub otlp_metrics_interval: Option<Duration>,
    /// The trace sampler, as `OTEL_TRACES_SAMPLER` names them (`parentbased_traceidratio`,
    /// `always_off`, ...). Else `OTEL_TRACES_SAMPLER`, else `parentbased_always_on`, or
    /// `parentbased_traceidratio` when only `sampling_ratio` is set.
    pub sampler: Option<SamplerKind>,
    /// The ratio of the two ratio samplers. Else `OTEL_TRACES_SAMPLER_ARG`, else 1.
    pub sampling_ratio: Option<Ratio>,
    /// The resource's `service.name`. Else `OTEL_SERVICE_NAME`, else a `service.name` in
    /// `OTEL_RESOURCE_ATTRIBUTES`, else `tributary`.
    pub service_name: Option<String>,
    /// A single poll that holds a worker thread longer than this is logged and counted.
    #[serde(with = "humantime_serde")]
    pub long_poll_threshold: Duration,
    /// The `OTEL_*` variables, parsed by the loader; [`TelemetrySettings::otel`] merges them
    /// with the keys above.
    #[serde(skip)]
    pub otel_env: OtelEnv,
}

impl Default for TelemetrySettings {
    fn default() -> Self {
        Self {
            log_format: LogFormat::Json,
            log_level: "info".into(),
            metrics_enabled: true,
            otlp_endpoint: None,
            otlp_traces_endpoint: None,
            otlp_metrics_endpoint: None,
            otlp_headers: None,
            otlp_metrics_interval: None,
            sampler: None,
            sampling_ratio: None,
            service_name: None,
            long_poll_threshold: Duration::from_millis(10),
            otel_env: OtelEnv::default(),
        }
    }
}

impl TelemetrySettings {
    /// The effective OpenTelemetry settings: each from its key above when set, else from its
    /// `OTEL_*` variable, else the default, with where it came from.
    pub fn otel(&self) -> OtelSettings {
        otel::merge(self, &self.otel_env)
    }

    /// Takes the `OTEL_*` variables from `env` (the loader does this with its sources; a test
    /// can with its own). Returns every problem, each naming its variable.
    pub fn read_otel_env(&mut self, env: &[(String, String)]) -> Result<(), Vec<String>> {
        self.otel_env = OtelEnv::parse(env)?;
        Ok(())
    }
}

impl Settings {
    /// The rules that relate two keys (everything else is held by the types).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        let db = &self.database;
        if let Some(min) = db.min_connections.filter(|&m| m > db.max_connections.get()) {
            problems.push(format!(
                "database.min_connections ({min}) is greater than database.max_connections ({})",
                db.max_connections
            ));
        }
        let a = &self.admission.adaptive;
        if !(a.min_limit.get() <= a.initial_limit && a.initial_limit <= a.max_limit) {
            problems.push(format!(
                "admission.adaptive needs min_limit <= initial_limit <= max_limit, got {} / {} / {}",
                a.min_limit, a.initial_limit, a.max_limit
            ));
        }
        let server = &self.server;
        if server.listen.port() != 0 && server.listen.port() == server.ops_listen.port() {
            problems.push(format!(
                "server.ops_listen ({}) must use another port than server.listen ({})",
                server.ops_listen, server.listen
            ));
        }
        if self
            .downstreams
            .users
            .cache
            .as_ref()
            .is_some_and(|c| c.key == CacheKey::Shared)
        {
            problems.push(
                "downstreams.users.cache.key must be \"per_user\": the profile is the user's own"
                    .into(),
            );
        }
        let overload = &self.overload;
        if overload.probe_past_core && !overload.check_core_cuts {
            problems.push(
                "overload.probe_past_core needs overload.check_core_cuts = true (it acts only while a checked cut leaves the core's queue out)".into(),
            );
        }
        let adm = &self.admission;
        if adm.ready_shed_ratio > adm.unready_shed_ratio {
            problems.push(
                "admission.ready_shed_ratio must not exceed admission.unready_shed_ratio (no hysteresis otherwise)".into(),
            );
        }
        for service in Service::ALL {
            let d = self.downstreams.get(service);
            routing::validate(service.as_str(), &d.variants, &d.rules, &mut problems);
            if self.http_client.transport == TransportKind::Hyper {
                let variants = d
                    .variants
                    .iter()
                    .map(|(name, v)| (format!(".variants.{name}"), &v.base_url));
                for (at, url) in std::iter::once((String::new(), &d.base_url)).chain(variants) {
                    if url.url().scheme() == "https" {
                        problems.push(format!(
                            "downstreams.{service}{at}.base_url is https://, which http_client.transport = \"hyper\" does not speak (no TLS): use \"reqwest\""
                        ));
                    }
                }
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }

    /// What `check-config` prints: every setting as it was given, and under `opentelemetry`
    /// the effective OpenTelemetry settings, each with where it came from (a `telemetry.*`
    /// key, an `OTEL_*` variable, or the default). Secrets are masked by their types.
    pub fn printable(&self) -> Result<serde_json::Value, serde_json::Error> {
        let mut shown = serde_json::to_value(self)?;
        shown["opentelemetry"] = serde_json::to_value(self.telemetry.otel())?;
        Ok(shown)
    }

    /// Admission settings resolved for one route group: its limit and its longest wait.
    pub fn admission_for(&self, group: RouteGroup) -> (NonZeroUsize, Duration) {
        let g = self.admission.groups.get(&group);
        (
            g.and_then(|g| g.max_in_flight)
                .unwrap_or(self.admission.max_in_flight),
            g.and_then(|g| g.max_wait)
                .unwrap_or(self.admission.max_wait),
        )
    }
}

#[cfg(test)]
mod tests;
