//! tributary: a gateway-aggregation (BFF) service — one request in, a concurrent fan-out to
//! five services and Postgres, one merged answer out — built so that the failure modes of
//! cheap concurrency (a worker thread held by blocking work, request data copied or leaked
//! between requests, pools sized against each other, overload that turns into an avalanche)
//! are handled by construction and visible in metrics.
//!
//! The tree reads as the architecture:
//! - [`config`]: typed settings, layered and validated once;
//! - [`build_info`]: the version and git revision the binary was built from;
//! - [`context`]: the per-request context in a task-local;
//! - [`http`]: routes, handlers and the tower stack;
//! - [`fanout`]: the concurrent dashboard fan-out with deadlines and partial results;
//! - [`downstream`]: one typed client per service, with bulkhead, breaker and retries;
//! - [`admission`] and [`ratelimit`]: overload protection (503) and per-client limits (429);
//! - [`db`]: the Postgres pool, migrations, queries and seed data;
//! - [`capacity`]: Little's-law sizing;
//! - [`telemetry`]: logs, traces, metrics and runtime health;
//! - [`tls`]: the process-wide TLS crypto provider;
//! - [`startup`]: building and serving the application;

pub mod admission;
pub mod build_info;
pub mod capacity;
pub mod config;
pub mod context;
pub mod db;
pub mod domain;
pub mod downstream;
pub mod error;
pub mod fanout;
pub mod http;
pub mod ratelimit;
pub mod startup;
pub mod telemetry;
pub mod tls;

pub use config::Settings;
pub use startup::Application;
