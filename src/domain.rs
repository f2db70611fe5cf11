//! The gateway's vocabulary as types: the route groups, the five services and the six dashboard
//! parts, which the configuration, the clients, the fan-out, the metrics, the simulator and the
//! tests all name.
//!
//! A leaf: it imports nothing from the crate, so every other module can use it. Each noun is an
//! enum with its `ALL` list and its `as_str`, the one place its spelling lives; the spelling is
//! also the configuration key and the metric label.

use std::{fmt, str::FromStr};

use serde::{Deserialize, Serialize};

/// A group of routes that shares one admission limiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RouteGroup {
    /// `GET /api/v1/dashboard/{user_id}`.
    Dashboard,
    /// `POST /api/v1/orders` and `GET /api/v1/orders/{id}`.
    Orders,
}

impl RouteGroup {
    /// Every group, in the order of their discriminants (an index into per-group arrays).
    pub const ALL: [RouteGroup; 2] = [RouteGroup::Dashboard, RouteGroup::Orders];

    pub fn as_str(self) -> &'static str {
        match self {
            RouteGroup::Dashboard => "dashboard",
            RouteGroup::Orders => "orders",
        }
    }
}

impl fmt::Display for RouteGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The five downstream services the dashboard is assembled from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Service {
    /// The user's profile: the required part.
    Users,
    Carts,
    Recommendations,
    Promotions,
    Notifications,
}

impl Service {
    /// Every service, in the order of their discriminants (an index into per-service arrays).
    pub const ALL: [Service; 5] = [
        Service::Users,
        Service::Carts,
        Service::Recommendations,
        Service::Promotions,
        Service::Notifications,
    ];

    /// The service's name: its configuration key, its path segment downstream, its metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Service::Users => "users",
            Service::Carts => "carts",
            Service::Recommendations => "recommendations",
            Service::Promotions => "promotions",
            Service::Notifications => "notifications",
        }
    }
}

impl fmt::Display for Service {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Service {
    type Err = UnknownService;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Service::ALL
            .into_iter()
            .find(|service| service.as_str() == s)
            .ok_or(UnknownService)
    }
}

/// A name that is none of the five services.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("not one of the downstream services")]
pub struct UnknownService;

/// The six parts of a dashboard: one per service, and the recent orders from Postgres.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Part {
    /// From `users`; the one required part: without it there is no dashboard.
    Profile,
    Cart,
    Recommendations,
    Promotions,
    Notifications,
    RecentOrders,
}

impl Part {
    /// Every part, in the order of their discriminants (an index into per-part arrays).
    pub const ALL: [Part; 6] = [
        Part::Profile,
        Part::Cart,
        Part::Recommendations,
        Part::Promotions,
        Part::Notifications,
        Part::RecentOrders,
    ];

    /// The parts a dashboard is still served without (as `null`, named in `degraded`).
    pub const OPTIONAL: [Part; 5] = [
        Part::Cart,
        Part::Recommendations,
        Part::Promotions,
        Part::Notifications,
        Part::RecentOrders,
    ];

    /// The service the part comes from; `None` for the one that comes from Postgres.
    pub fn service(self) -> Option<Service> {
        match self {
            Part::Profile => Some(Service::Users),
            Part::Cart => Some(Service::Carts),
            Part::Recommendations => Some(Service::Recommendations),
            Part::Promotions => Some(Service::Promotions),
            Part::Notifications => Some(Service::Notifications),
            Part::RecentOrders => None,
        }
    }

    /// The part that `service` fills.
    pub fn of(service: Service) -> Part {
        match service {
            Service::Users => Part::Profile,
            Service::Carts => Part::Cart,
            Service::Recommendations => Part::Recommendations,
            Service::Promotions => Part::Promotions,
            Service::Notifications => Part::Notifications,
        }
    }

    /// The part's field in the dashboard JSON, and its name in `degraded`.
    pub fn field(self) -> &'static str {
        match self {
            Part::Profile => "profile",
            Part::Cart => "cart",
            Part::Recommendations => "recommendations",
            Part::Promotions => "promotions",
            Part::Notifications => "notifications",
            Part::RecentOrders => "recent_orders",
        }
    }

    /// The part's metric label and `Server-Timing` name: its service's name, or
    /// `recent_orders`.
    pub fn label(self) -> &'static str {
        self.service().map_or("recent_orders", Service::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_lists_every_group_at_its_own_index() {
        for (i, group) in RouteGroup::ALL.into_iter().enumerate() {
            assert_eq!(group as usize, i);
            let json = serde_json::to_string(&group).unwrap();
            assert_eq!(json, format!("\"{group}\""));
        }
    }

    #[test]
    fn services_and_parts_map_onto_each_other_and_sit_at_their_index() {
        for (i, service) in Service::ALL.into_iter().enumerate() {
            assert_eq!(service as usize, i);
            assert_eq!(service.as_str().parse(), Ok(service));
            assert_eq!(Part::of(service).service(), Some(service));
            assert_eq!(
                serde_json::to_string(&service).unwrap(),
                format!("\"{service}\"")
            );
        }
        for (i, part) in Part::ALL.into_iter().enumerate() {
            assert_eq!(part as usize, i);
        }
        assert_eq!("orders".parse::<Service>(), Err(UnknownService));
        assert_eq!(Part::RecentOrders.label(), "recent_orders");
        assert_eq!(Part::Cart.label(), "carts");
        assert!(!Part::OPTIONAL.contains(&Part::Profile));
    }
}
