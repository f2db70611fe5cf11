//! The gateway's vocabulary as types: what the configuration, the clients, the fan-out, the
//! metrics and the tests all name.
//!
//! A leaf: it imports nothing from the crate, so every other module can use it. Each noun is an
//! enum with its `ALL` list and its `as_str`, the one place its spelling lives; the spelling is
//! also the configuration key and the metric label.

use std::fmt;

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
}
