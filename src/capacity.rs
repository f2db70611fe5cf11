//! Sizing by Little's law, so that pool sizes and limits are arithmetic, not folklore.
//!
//! Little's law: the average number of requests in a system equals the arrival rate times the
//! average time each spends in it, `L = λ · W`. For the gateway that gives
//! - the admission limit: `λ_target · W_request` (requests in flight at the target rate), plus
//!   headroom for latency variance;
//! - the database pool: `λ_db · W_query` connections busy on average, where `λ_db` is the query
//!   rate (requests per second × queries per request), plus headroom;
//! - and, across an autoscaled fleet sharing one Postgres, the budget
//!   `pool_max × max_replicas ≤ server_max_connections − reserved`.
//!
//! The last one fails silently until the fleet scales out: each replica's pool is fine, and the
//! replicas together ask the server for more connections than it has, with connection
//! timeouts as the only symptom; start-up warns about it (`check_pool_budget`).

use std::{fmt, time::Duration};

use serde::Serialize;

use crate::config::DatabaseSettings;

/// What the operator knows or has measured.
#[derive(Debug, Clone)]
pub struct CapacityInput {
    pub target_rps: f64,
    /// Mean request latency at the target rate (e.g. from the benchmark lab).
    pub request_latency: Duration,
    pub db_queries_per_request: f64,
    /// Mean time a query holds its connection.
    pub db_latency: Duration,
    /// Multiplier for variance and bursts, e.g. 1.5.
    pub headroom: f64,
    pub replicas: u32,
    pub server_max_connections: u32,
    pub reserved_connections: u32,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Recommendation {
    /// Requests in flight per replica at the target rate (L = λ·W), before headroom.
    pub in_flight_per_replica: f64,
    pub admission_limit: u32,
    /// Busy connections per replica (L = λ·W), before headroom.
    pub busy_connections_per_replica: f64,
    pub pool_size: u32,
    /// The most connections each replica may hold without exceeding the server.
    pub pool_ceiling_per_replica: u32,
    pub fits_fleet_budget: bool,
}

pub fn recommend(input: &CapacityInput) -> Recommendation {
    let replicas = f64::from(input.replicas.max(1));
    let rps_per_replica = input.target_rps / replicas;
    let in_flight = rps_per_replica * input.request_latency.as_secs_f64();
    let busy = rps_per_replica * input.db_queries_per_request * input.db_latency.as_secs_f64();
    let admission_limit = (in_flight * input.headroom).ceil().max(1.0) as u32;
    let pool_size = (busy * input.headroom).ceil().max(1.0) as u32;
    let ceiling = input
        .server_max_connections
        .saturating_sub(input.reserved_connections)
        / input.replicas.max(1);
    Recommendation {
        in_flight_per_replica: in_flight,
        admission_limit,
        busy_connections_per_replica: busy,
        pool_size,
        pool_ceiling_per_replica: ceiling,
        fits_fleet_budget: pool_size <= ceiling,
    }
}

/// The worked arithmetic behind a [`Recommendation`], one line per quantity, as
/// `tributary capacity` prints it.
pub struct Report<'a> {
    input: &'a CapacityInput,
    recommendation: &'a Recommendation,
}

impl<'a> Report<'a> {
    pub fn new(input: &'a CapacityInput, recommendation: &'a Recommendation) -> Self {
        Self {
            input,
            recommendation,
        }
    }
}

/// A duration in milliseconds, exact to the microsecond (so `2.5` prints as `2.5`).
fn millis(d: Duration) -> f64 {
    d.as_micros() as f64 / 1000.0
}

impl fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (i, r) = (self.input, self.recommendation);
        let replicas = i.replicas;
        let per_replica = i.target_rps / f64::from(replicas.max(1));
        let headroom = i.headroom;
        writeln!(
            f,
            "Little's law, per replica ({replicas} replica(s), {per_replica:.0} req/s each):"
        )?;
        writeln!(
            f,
            "  requests in flight  = {per_replica:.0} req/s × {} ms = {:.1}",
            millis(i.request_latency),
            r.in_flight_per_replica
        )?;
        writeln!(
            f,
            "  admission limit     = ceil({:.1} × {headroom}) = {}",
            r.in_flight_per_replica, r.admission_limit
        )?;
        writeln!(
            f,
            "                        (for admission.mode = \"static\"; the default, adaptive, finds it)"
        )?;
        writeln!(
            f,
            "  busy connections    = {per_replica:.0} req/s × {} q/req × {} ms = {:.2}",
            i.db_queries_per_request,
            millis(i.db_latency),
            r.busy_connections_per_replica
        )?;
        writeln!(
            f,
            "  pool size           = ceil({:.2} × {headroom}) = {}",
            r.busy_connections_per_replica, r.pool_size
        )?;
        writeln!(
            f,
            "  fleet ceiling       = ({} − {}) / {replicas} = {} per replica",
            i.server_max_connections, i.reserved_connections, r.pool_ceiling_per_replica
        )?;
        writeln!(
            f,
            "  fits the fleet budget: {}",
            if r.fits_fleet_budget {
                "yes"
            } else {
                "NO — raise max_connections on the server or add capacity per replica"
            }
        )
    }
}

/// Start-up check of the configured pool against the fleet budget; returns warnings.
pub(crate) fn check_pool_budget(db: &DatabaseSettings) -> Vec<String> {
    let budget = db
        .server_max_connections
        .saturating_sub(db.reserved_connections);
    let fleet = u64::from(db.max_connections.get()) * u64::from(db.max_replicas);
    let mut warnings = Vec::new();
    if fleet > u64::from(budget) {
        warnings.push(format!(
            "pool budget exceeded: database.max_connections ({}) × database.max_replicas ({}) = {} \
             > database.server_max_connections ({}) − database.reserved_connections ({}) = {}; \
             at full scale-out new connections will be refused — lower the pool to at most {} \
             or raise the server limit",
            db.max_connections,
            db.max_replicas,
            fleet,
            db.server_max_connections,
            db.reserved_connections,
            budget,
            budget / db.max_replicas.max(1)
        ));
    }
    warnings
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn littles_law_sizes_the_limit_and_the_pool() {
        // The benchmark lab's seed-baseline: 500 clients, 100 ms downstreams → 5,000 req/s.
        let r = recommend(&CapacityInput {
            target_rps: 5000.0,
            request_latency: Duration::from_millis(100),
            db_queries_per_request: 1.0,
            db_latency: Duration::from_millis(2),
            headroom: 1.5,
            replicas: 1,
            server_max_connections: 100,
            reserved_connections: 10,
        });
        assert!((r.in_flight_per_replica - 500.0).abs() < 1e-9);
        assert_eq!(r.admission_limit, 750);
        assert!((r.busy_connections_per_replica - 10.0).abs() < 1e-9);
        assert_eq!(r.pool_size, 15);
        assert_eq!(r.pool_ceiling_per_replica, 90);
        assert!(r.fits_fleet_budget);
    }

    #[test]
    fn the_report_shows_the_arithmetic_with_the_inputs_as_given() {
        let input = CapacityInput {
            target_rps: 5000.0,
            request_latency: Duration::from_millis(100),
            db_queries_per_request: 1.0,
            db_latency: Duration::from_micros(2500),
            headroom: 1.5,
            replicas: 2,
            server_max_connections: 100,
            reserved_connections: 10,
        };
        let text = Report::new(&input, &recommend(&input)).to_string();
        for line in [
            "Little's law, per replica (2 replica(s), 2500 req/s each):",
            "  requests in flight  = 2500 req/s × 100 ms = 250.0",
            "  admission limit     = ceil(250.0 × 1.5) = 375",
            "                        (for admission.mode = \"static\"; the default, adaptive, finds it)",
            "  busy connections    = 2500 req/s × 1 q/req × 2.5 ms = 6.25",
            "  pool size           = ceil(6.25 × 1.5) = 10",
            "  fleet ceiling       = (100 − 10) / 2 = 45 per replica",
            "  fits the fleet budget: yes",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }

    #[test]
    fn the_fleet_budget_warns_with_numbers() {
        let db = DatabaseSettings {
            max_connections: std::num::NonZeroU32::new(30).unwrap(),
            max_replicas: 4,
            server_max_connections: 100,
            reserved_connections: 10,
            ..DatabaseSettings::default()
        };
        let w = check_pool_budget(&db);
        assert_eq!(w.len(), 1);
        assert!(w[0].contains("= 120"), "{}", w[0]);
        assert!(w[0].contains("at most 22"), "{}", w[0]);
        let ok = DatabaseSettings {
            max_connections: std::num::NonZeroU32::new(20).unwrap(),
            ..db
        };
        assert!(check_pool_budget(&ok).is_empty());
    }
}
