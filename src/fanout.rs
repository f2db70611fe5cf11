//! The dashboard fan-out: six parts, concurrently, within one request's deadline.
//!
//! The parts run as futures joined inside the request's own task rather than as spawned tasks.
//! That choice carries three properties for free: the task-local request context is visible in
//! every part without being copied; cancellation is structural — when the client goes away the
//! request future is dropped and every part with it, and when the required part fails
//! `try_join!` drops the optional ones at once; and no part can outlive its request. It costs
//! nothing in concurrency, because the parts spend their time waiting on I/O, not on a CPU.
//!
//! Each part is timed: the slowest one is the request's critical path (counted by part), and
//! the request time minus the slowest part is the gateway's own overhead — the direct answer
//! to "is the gateway the bottleneck?". Both are also sent to the client in `Server-Timing`.

use std::{fmt::Write, time::Duration};

use metrics::{Counter, Histogram};
use serde::Serialize;
use serde_json::value::RawValue;
use tokio::time::Instant;

use crate::{
    db::orders::OrderSummary,
    downstream::{CallError, Downstream},
    error::ApiError,
    http::AppState,
    telemetry::Family,
};

pub const CRITICAL_PATH: Family = Family::counter(
    "tributary_fanout_critical_path_total",
    "Dashboard requests by the part that was slowest (the critical path).",
);
pub const GATEWAY_OVERHEAD: Family = Family::seconds(
    "tributary_fanout_gateway_overhead_seconds",
    "Request time minus the slowest part: the gateway's own overhead.",
);
pub const DEGRADED: Family = Family::counter(
    "tributary_fanout_degraded_total",
    "Optional dashboard parts returned as null, by part and reason.",
);

/// The families this module records.
pub const FAMILIES: &[Family] = &[CRITICAL_PATH, GATEWAY_OVERHEAD, DEGRADED];

/// The merged response.
#[derive(Debug, Serialize)]
pub struct Dashboard {
    pub user_id: i64,
    pub profile: Box<RawValue>,
    pub cart: Option<Box<RawValue>>,
    pub recommendations: Option<Box<RawValue>>,
    pub promotions: Option<Box<RawValue>>,
    pub notifications: Option<Box<RawValue>>,
    pub recent_orders: Option<Vec<OrderSummary>>,
    /// Optional parts that failed or timed out and are `null` above.
    pub degraded: Vec<&'static str>,
}

/// Per-part durations for `Server-Timing`; `None` for a part that never finished.
#[derive(Debug, Default)]
pub struct Timings {
    parts: Vec<(&'static str, Duration)>,
    total: Duration,
}

impl Timings {
    /// `Server-Timing: users;dur=12.1, carts;dur=9.8, ..., gateway;dur=0.3, total;dur=12.6`
    pub fn header_value(&self) -> String {
        let mut out = String::with_capacity(160);
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        for (name, d) in &self.parts {
            let _ = write!(out, "{name};dur={:.1}, ", ms(*d));
        }
        let slowest = self.parts.iter().map(|p| p.1).max().unwrap_or_default();
        let _ = write!(
            out,
            "gateway;dur={:.1}, total;dur={:.1}",
            ms(self.total.saturating_sub(slowest)),
            ms(self.total)
        );
        out
    }
}

/// Metric label and `degraded` name for each part.
const PARTS: [(&str, &str); 6] = [
    ("users", "profile"),
    ("carts", "cart"),
    ("recommendations", "recommendations"),
    ("promotions", "promotions"),
    ("notifications", "notifications"),
    ("recent_orders", "recent_orders"),
];

/// An optional part's result: its value, or why it is missing.
type Optional<T> = (Result<T, &'static str>, Duration);

async fn optional_call(d: &Downstream, user_id: i64) -> Result<Optional<Box<RawValue>>, CallError> {
    let started = Instant::now();
    let r = d.fetch_user_part(user_id).await;
    Ok((r.map_err(|e| e.outcome().as_str()), started.elapsed()))
}

/// Runs the fan-out for one user.
pub async fn dashboard(state: &AppState, user_id: i64) -> Result<(Dashboard, Timings), ApiError> {
    let started = Instant::now();
    let deadline = crate::context::current()
        .map(|c| c.deadline)
        .unwrap_or_else(|| Instant::now() + Duration::from_secs(30));
    let ds = &state.downstreams;
    let required = async {
        let t = Instant::now();
        ds.users
            .fetch_user_part(user_id)
            .await
            .map(|v| (v, t.elapsed()))
    };
    let orders = async {
        let t = Instant::now();
        // The pool wait is bounded by the budget and the server cancels the statement at its
        // statement_timeout, but only a reachable server can say so: if the network goes
        // silent mid-query (a partition), that answer never arrives. Bound the part here too,
        // like every downstream call, so it degrades instead of the safety net below turning
        // the whole dashboard into a 504.
        let r = match tokio::time::timeout_at(deadline, state.db.recent_orders(user_id)).await {
            Ok(r) => r.map_err(|e| {
                tracing::warn!(error = %e, "recent orders unavailable");
                match e {
                    crate::db::AcquireError::TimedOut => "shed",
                    crate::db::AcquireError::BudgetExhausted => "budget_exhausted",
                    crate::db::AcquireError::Database(_) => "error",
                }
            }),
            Err(_) => {
                tracing::warn!("recent orders unavailable: no answer within the deadline");
                Err("timeout")
            }
        };
        Ok::<_, CallError>((r, t.elapsed()))
    };
    // Every part bounds itself by the deadline; the request layer's edge deadline is the
    // safety net for one that does not.
    let joined = tokio::try_join!(
        required,
        optional_call(&ds.carts, user_id),
        optional_call(&ds.recommendations, user_id),
        optional_call(&ds.promotions, user_id),
        optional_call(&ds.notifications, user_id),
        orders,
    );
    let (profile, cart, recommendations, promotions, notifications, recent_orders) =
        joined.map_err(required_failure)?;
    let total = started.elapsed();

    let mut timings = Timings {
        parts: Vec::with_capacity(6),
        total,
    };
    timings.parts.push((PARTS[0].0, profile.1));
    let mut degraded = Vec::new();
    let mut take = |i: usize, (r, d): Optional<Box<RawValue>>| {
        timings.parts.push((PARTS[i].0, d));
        r.map_err(|reason| degrade(&mut degraded, i, reason)).ok()
    };
    let cart = take(1, cart);
    let recommendations = take(2, recommendations);
    let promotions = take(3, promotions);
    let notifications = take(4, notifications);
    timings.parts.push((PARTS[5].0, recent_orders.1));
    let recent_orders = recent_orders
        .0
        .map_err(|reason| degrade(&mut degraded, 5, reason))
        .ok();

    state.fanout_metrics.record(&timings);
    Ok((
        Dashboard {
            user_id,
            profile: profile.0,
            cart,
            recommendations,
            promotions,
            notifications,
            recent_orders,
            degraded,
        },
        timings,
    ))
}

fn degrade(degraded: &mut Vec<&'static str>, part: usize, reason: &'static str) {
    degraded.push(PARTS[part].1);
    metrics::counter!(DEGRADED.name, "part" => PARTS[part].0, "reason" => reason).increment(1);
}

/// The fan-out's per-request instruments, registered once.
pub struct FanoutMetrics {
    critical_path: [(&'static str, Counter); 6],
    overhead: Histogram,
}

impl FanoutMetrics {
    pub fn new() -> Self {
        Self {
            critical_path: PARTS.map(|(label, _)| {
                (
                    label,
                    metrics::counter!(CRITICAL_PATH.name, "part" => label),
                )
            }),
            overhead: metrics::histogram!(GATEWAY_OVERHEAD.name),
        }
    }

    fn record(&self, t: &Timings) {
        if let Some((part, slowest)) = t.parts.iter().max_by_key(|p| p.1) {
            if let Some((_, counter)) = self.critical_path.iter().find(|(l, _)| l == part) {
                counter.increment(1);
            }
            self.overhead
                .record(t.total.saturating_sub(*slowest).as_secs_f64());
        }
    }
}

impl Default for FanoutMetrics {
    fn default() -> Self {
        Self::new()
    }
}

/// The required part failed: the status says whose fault it was.
fn required_failure(e: CallError) -> ApiError {
    match e {
        CallError::Timeout { .. } | CallError::BudgetExhausted { .. } => ApiError::GatewayTimeout,
        CallError::CircuitOpen { service } => ApiError::Unavailable {
            reason: match service {
                "users" => "the users service is failing (circuit open)",
                _ => "a required dependency is failing (circuit open)",
            },
            retry_after: Duration::from_secs(5),
        },
        CallError::Shed { .. } => ApiError::Unavailable {
            reason: "the users service is at its concurrency limit",
            retry_after: Duration::from_secs(1),
        },
        CallError::Status { status: 404, .. } => ApiError::NotFound,
        CallError::Status { service, .. }
        | CallError::Transport { service, .. }
        | CallError::InvalidBody { service, .. } => ApiError::BadGateway { service, cause: e },
    }
}
