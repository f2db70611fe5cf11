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
//!
//! A service with a cache (`downstreams.<service>.cache`) answers through it; a part that a
//! stale entry stood in for is listed in `stale` (it is not degraded: the client has data, only
//! older), and `Server-Timing` says which parts came from the cache.

use std::time::Duration;

use metrics::{Counter, Histogram};
use serde::Serialize;
use serde_json::value::RawValue;
use tokio::time::Instant;

use crate::{
    context,
    db::{Db, DbError, orders::OrderSummary},
    domain::{Part, Service},
    downstream::{CallError, Outcome, cache::Source},
    error::{ApiError, chain},
    routing::Route,
    telemetry::Family,
};

pub(crate) const CRITICAL_PATH: Family = Family::counter(
    "tributary_fanout_critical_path_total",
    "Dashboard requests by the part that was slowest (the critical path).",
);
pub(crate) const GATEWAY_OVERHEAD: Family = Family::seconds(
    "tributary_fanout_gateway_overhead_seconds",
    "Request time minus the slowest part: the gateway's own overhead.",
);
pub(crate) const DEGRADED: Family = Family::counter(
    "tributary_fanout_degraded_total",
    "Optional dashboard parts returned as null, by part and reason.",
);

/// The families this module records.
pub(crate) const FAMILIES: &[Family] = &[CRITICAL_PATH, GATEWAY_OVERHEAD, DEGRADED];

/// The merged response. Each downstream's part is its JSON body, embedded as it came (any
/// JSON value: the gateway checks that it is JSON, not its shape).
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct Dashboard {
    #[schema(minimum = 1)]
    pub user_id: i64,
    /// From the users service; the required part.
    #[schema(value_type = serde_json::Value)]
    pub profile: Box<RawValue>,
    /// From the carts service; `null` when degraded.
    #[schema(value_type = Option<serde_json::Value>)]
    pub cart: Option<Box<RawValue>>,
    /// From the recommendations service; `null` when degraded.
    #[schema(value_type = Option<serde_json::Value>)]
    pub recommendations: Option<Box<RawValue>>,
    /// From the promotions service; `null` when degraded.
    #[schema(value_type = Option<serde_json::Value>)]
    pub promotions: Option<Box<RawValue>>,
    /// From the notifications service; `null` when degraded.
    #[schema(value_type = Option<serde_json::Value>)]
    pub notifications: Option<Box<RawValue>>,
    /// The user's five newest orders, from Postgres; `null` when degraded.
    #[schema(max_items = 5)]
    pub recent_orders: Option<Vec<OrderSummary>>,
    /// Optional parts that failed or timed out and are `null` above.
    #[schema(schema_with = degraded_schema)]
    pub degraded: Vec<&'static str>,
    /// Parts whose fresh call failed or was too late and that a cached answer, older than its
    /// freshness but within `stale_if_error`, stands in for.
    #[schema(schema_with = stale_schema)]
    pub stale: Vec<&'static str>,
}

/// `degraded`: a list of the optional parts' names.
fn degraded_schema() -> utoipa::openapi::Array {
    let part = utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .enum_values(Some(Part::OPTIONAL.map(Part::field)));
    utoipa::openapi::ArrayBuilder::new()
        .items(part)
        .max_items(Some(Part::OPTIONAL.len()))
        .unique_items(true)
        .build()
}

/// `stale`: a list of the parts' names (the required profile included: a stale profile is
/// still a profile).
fn stale_schema() -> utoipa::openapi::Array {
    let part = utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .enum_values(Some(Part::ALL.map(Part::field)));
    utoipa::openapi::ArrayBuilder::new()
        .items(part)
        .max_items(Some(Part::ALL.len()))
        .unique_items(true)
        .build()
}

/// Per-part durations for `Server-Timing`, with where a cached part came from.
#[derive(Debug, Default)]
pub(crate) struct Timings {
    parts: Vec<(Part, Duration, Option<&'static str>)>,
    total: Duration,
}

impl Timings {
    /// `Server-Timing: users;dur=12.1, carts;dur=9.8, promotions;desc=hit;dur=0.0, ...,
    /// gateway;dur=0.3, total;dur=12.6`
    pub(crate) fn header_value(&self) -> String {
        let mut out = String::with_capacity(160);
        for (part, d, desc) in &self.parts {
            out.push_str(part.label());
            if let Some(desc) = desc {
                out.push_str(";desc=");
                out.push_str(desc);
            }
            out.push_str(";dur=");
            push_ms(&mut out, *d);
            out.push_str(", ");
        }
        let slowest = self.parts.iter().map(|p| p.1).max().unwrap_or_default();
        out.push_str("gateway;dur=");
        push_ms(&mut out, self.total.saturating_sub(slowest));
        out.push_str(", total;dur=");
        push_ms(&mut out, self.total);
        out
    }
}

/// `d` in milliseconds with one decimal (`12.3`), rounded to the nearest tenth: integers only,
/// since formatting an `f64` with a precision costs more than all the rest of the header.
fn push_ms(out: &mut String, d: Duration) {
    let tenths = (d.as_nanos() + 50_000) / 100_000;
    out.push_str(itoa::Buffer::new().format(tenths / 10));
    out.push('.');
    out.push(char::from(b'0' + (tenths % 10) as u8));
}

/// An optional part's result: its value, or why it is missing; and how long it took.
type Optional<T> = (Result<T, Miss>, Duration);

/// Why an optional part is `null`: how its call ended, and the cause when it is news. A circuit
/// that is open or a database known to be down has no cause of its own here: that was logged
/// once, when it happened.
#[derive(Debug)]
struct Miss {
    reason: Outcome,
    cause: Option<String>,
}

impl Miss {
    fn call(e: &CallError) -> Self {
        let reason = e.outcome();
        let cause = (reason != Outcome::CircuitOpen).then(|| chain(e));
        Self { reason, cause }
    }

    fn query(e: &DbError) -> Self {
        let cause = (!matches!(e, DbError::KnownDown)).then(|| chain(e));
        Self {
            reason: db_outcome(e),
            cause,
        }
    }
}

async fn optional_call(
    route: &Route<'_>,
    service: Service,
    user_id: i64,
) -> Result<Optional<(Box<RawValue>, Source)>, CallError> {
    let started = Instant::now();
    let r = route.fetch_part(service, user_id).await;
    Ok((r.map_err(|e| Miss::call(&e)), started.elapsed()))
}

/// How a query for a part ended, in the downstream calls' terms.
fn db_outcome(e: &DbError) -> Outcome {
    match e {
        DbError::PoolTimedOut => Outcome::Shed,
        DbError::BudgetExhausted => Outcome::BudgetExhausted,
        DbError::StatementTimeout => Outcome::Timeout,
        // Not tried: the database is known to be down.
        DbError::KnownDown => Outcome::CircuitOpen,
        DbError::Unavailable(_) | DbError::Database(_) => Outcome::Error,
    }
}

/// Runs the fan-out for one user: the five services' parts and the recent orders, each
/// service's part from the deployment `route` chose for it (stable, or a variant).
pub(crate) async fn dashboard(
    route: &Route<'_>,
    db: &Db,
    metrics: &FanoutMetrics,
    user_id: i64,
) -> Result<(Dashboard, Timings), ApiError> {
    let started = Instant::now();
    // Each part is boxed. A future that is not boxed is moved whole, at its full size, every
    // time the future around it is built and moved: a call is ~1.9 KB and the six parts ~12.7
    // KB, and an unboxed fan-out was copied three to four times over before its first poll
    // (the join's tuple, this function's future, the handler's, axum's box): ~100 KB of
    // `memcpy` a dashboard, 17 % of its instructions. Boxed, each part is copied once, into
    // its box, for six allocations; `bench/profile instructions` has the counts.
    let required = Box::pin(async {
        let t = Instant::now();
        route
            .fetch_part(Service::Users, user_id)
            .await
            .map(|v| (v, t.elapsed()))
    });
    let optional = |service| Box::pin(optional_call(route, service, user_id));
    let orders = Box::pin(async {
        let t = Instant::now();
        // The pool wait is bounded by the budget and the server cancels the statement at its
        // statement_timeout, but only a reachable server can say so: if the network goes
        // silent mid-query (a partition), that answer never arrives. Bound the part here too,
        // like every downstream call, so it degrades instead of the request layer's edge
        // deadline turning the whole dashboard into a 504.
        let r = match tokio::time::timeout_at(context::deadline(), db.recent_orders(user_id)).await
        {
            Ok(r) => r.map_err(|e| Miss::query(&e)),
            Err(_) => Err(Miss {
                reason: Outcome::Timeout,
                cause: Some("no answer within the deadline".into()),
            }),
        };
        Ok::<_, CallError>((r, t.elapsed()))
    });
    // Every part bounds itself by the deadline; the request layer's edge deadline is the
    // safety net for one that does not.
    let joined = tokio::try_join!(
        required,
        optional(Service::Carts),
        optional(Service::Recommendations),
        optional(Service::Promotions),
        optional(Service::Notifications),
        orders,
    );
    let (profile, cart, recommendations, promotions, notifications, recent_orders) =
        joined.map_err(required_failure)?;
    let total = started.elapsed();
    Ok(merge(
        metrics,
        user_id,
        total,
        profile,
        [cart, recommendations, promotions, notifications],
        recent_orders,
    ))
}

/// The answers of a dashboard whose parts all came back fresh, merged as [`dashboard`] merges
/// them: `parts` are the five services' bodies in [`Service::ALL`] order (users first), each
/// with how long it took. The merge without the fan-out, for the dashboard micro-benchmark.
pub(crate) fn merge_fetched(
    metrics: &FanoutMetrics,
    user_id: i64,
    total: Duration,
    parts: [(Box<RawValue>, Duration); 5],
    recent_orders: (Vec<OrderSummary>, Duration),
) -> (Dashboard, Timings) {
    let [profile, cart, recommendations, promotions, notifications] =
        parts.map(|(body, took)| ((body, Source::Downstream), took));
    let fresh = |(body, took)| (Ok(body), took);
    merge(
        metrics,
        user_id,
        total,
        profile,
        [cart, recommendations, promotions, notifications].map(fresh),
        (Ok(recent_orders.0), recent_orders.1),
    )
}

/// Puts the joined parts together: the response, its timings, the `degraded` and `stale`
/// lists, and the part's metrics. `optional` is carts, recommendations, promotions and
/// notifications, in that order.
fn merge(
    metrics: &FanoutMetrics,
    user_id: i64,
    total: Duration,
    profile: ((Box<RawValue>, Source), Duration),
    optional: [Optional<(Box<RawValue>, Source)>; 4],
    recent_orders: Optional<Vec<OrderSummary>>,
) -> (Dashboard, Timings) {
    let [cart, recommendations, promotions, notifications] = optional;
    let mut timings = Timings {
        parts: Vec::with_capacity(Part::ALL.len()),
        total,
    };
    let ((profile, profile_source), profile_took) = profile;
    timings
        .parts
        .push((Part::Profile, profile_took, profile_source.timing_desc()));
    let mut degraded = Vec::new();
    let mut stale = Vec::new();
    if profile_source == Source::Stale {
        stale.push(Part::Profile.field());
    }
    let mut take = |part: Part, (r, d): Optional<(Box<RawValue>, Source)>| {
        let source = r.as_ref().ok().and_then(|(_, source)| source.timing_desc());
        timings.parts.push((part, d, source));
        match r {
            Ok((body, source)) => {
                if source == Source::Stale {
                    stale.push(part.field());
                }
                Some(body)
            }
            Err(miss) => {
                metrics.degrade(&mut degraded, part, miss);
                None
            }
        }
    };
    let cart = take(Part::Cart, cart);
    let recommendations = take(Part::Recommendations, recommendations);
    let promotions = take(Part::Promotions, promotions);
    let notifications = take(Part::Notifications, notifications);
    timings
        .parts
        .push((Part::RecentOrders, recent_orders.1, None));
    let recent_orders = recent_orders
        .0
        .map_err(|miss| metrics.degrade(&mut degraded, Part::RecentOrders, miss))
        .ok();

    metrics.record(&timings);
    (
        Dashboard {
            user_id,
            profile,
            cart,
            recommendations,
            promotions,
            notifications,
            recent_orders,
            degraded,
            stale,
        },
        timings,
    )
}

/// The fan-out's per-request instruments, registered once: every series exists from start-up
/// at 0, so that `rate()` sees its first increase.
pub(crate) struct FanoutMetrics {
    /// By the part that was slowest, indexed by [`Part`].
    critical_path: [Counter; 6],
    /// By optional part (indexed as [`Part::OPTIONAL`]) and reason (as [`Outcome::ALL`]; the
    /// `ok` column is never used).
    degraded: [[Counter; 6]; 5],
    overhead: Histogram,
}

impl FanoutMetrics {
    pub(crate) fn new() -> Self {
        Self {
            critical_path: Part::ALL
                .map(|part| metrics::counter!(CRITICAL_PATH.name, "part" => part.label())),
            degraded: Part::OPTIONAL.map(|part| {
                Outcome::ALL.map(|reason| {
                    if reason == Outcome::Ok {
                        // Not a reason to degrade: a handle that is never registered.
                        Counter::noop()
                    } else {
                        metrics::counter!(
                            DEGRADED.name,
                            "part" => part.label(),
                            "reason" => reason.as_str()
                        )
                    }
                })
            }),
            overhead: metrics::histogram!(GATEWAY_OVERHEAD.name),
        }
    }

    /// An optional part is null: listed in `degraded`, counted, and logged as one line that
    /// names the part, the reason and the cause (inside the request's span, so with its id).
    fn degrade(&self, degraded: &mut Vec<&'static str>, part: Part, miss: Miss) {
        let reason = miss.reason;
        tracing::warn!(
            part = part.field(),
            reason = reason.as_str(),
            error = miss.cause.as_deref(),
            "dashboard part degraded"
        );
        degraded.push(part.field());
        let row = Part::OPTIONAL.iter().position(|p| *p == part);
        let column = Outcome::ALL.iter().position(|o| *o == reason);
        if let (Some(row), Some(column)) = (row, column) {
            self.degraded[row][column].increment(1);
        }
    }

    fn record(&self, t: &Timings) {
        if let Some((part, slowest, _)) = t.parts.iter().max_by_key(|p| p.1) {
            self.critical_path[*part as usize].increment(1);
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
        CallError::CircuitOpen { .. } => ApiError::Unavailable {
            reason: "the users service is failing (circuit open)",
            retry_after: Duration::from_secs(5),
        },
        CallError::Shed { .. } => ApiError::Unavailable {
            reason: "the users service is at its concurrency limit",
            retry_after: Duration::from_secs(1),
        },
        CallError::Status { status: 404, .. } => ApiError::NotFound,
        CallError::Status { service, .. }
        | CallError::Transport { service, .. }
        | CallError::InvalidBody { service, .. }
        | CallError::Abandoned { service } => ApiError::BadGateway { service, cause: e },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dashboard_has_a_field_for_every_part_and_the_degraded_list() {
        let dashboard = Dashboard {
            user_id: 1,
            profile: RawValue::from_string("{}".into()).unwrap(),
            cart: None,
            recommendations: None,
            promotions: None,
            notifications: None,
            recent_orders: None,
            degraded: vec![],
            stale: vec![],
        };
        let json = serde_json::to_value(&dashboard).unwrap();
        let mut fields: Vec<&str> = json
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        fields.sort_unstable();
        let mut expected: Vec<&str> = Part::ALL.map(Part::field).to_vec();
        expected.extend(["degraded", "stale", "user_id"]);
        expected.sort_unstable();
        assert_eq!(fields, expected);
    }

    #[test]
    fn server_timing_names_each_part_in_milliseconds_to_a_tenth() {
        let us = Duration::from_micros;
        let timings = Timings {
            parts: vec![
                (Part::Profile, us(12_349), None),
                (Part::Cart, us(12_350), Some("hit")),
                (Part::RecentOrders, us(40), None),
            ],
            total: us(1_000_000),
        };
        assert_eq!(
            timings.header_value(),
            "users;dur=12.3, carts;desc=hit;dur=12.4, recent_orders;dur=0.0, \
             gateway;dur=987.7, total;dur=1000.0"
        );
    }
}
