//! Per-client rate limiting: 429 "you are too fast", kept apart from admission's 503
//! "we are full".
//!
//! (Being extended with the Redis-shared limiter; this is the local, per-replica limiter.)

use std::{net::IpAddr, num::NonZeroU32, time::Duration};

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use governor::{
    DefaultKeyedRateLimiter, Quota,
    clock::{Clock, DefaultClock},
};

use crate::config::{RateLimitKey, RateLimitSettings};

/// What the limiter decided, with the headers the response should carry.
pub enum Decision {
    Allowed {
        headers: HeaderMap,
    },
    Limited {
        headers: HeaderMap,
        retry_after: Duration,
    },
}

pub struct RateLimiter {
    settings: RateLimitSettings,
    local: DefaultKeyedRateLimiter<String>,
    trusted: Vec<(IpAddr, u8)>,
}

impl RateLimiter {
    pub async fn new(settings: &RateLimitSettings) -> anyhow::Result<Self> {
        let per_second = NonZeroU32::new(settings.per_second)
            .ok_or_else(|| anyhow::anyhow!("rate_limit.per_second must be at least 1"))?;
        let burst = NonZeroU32::new(settings.burst.max(1)).unwrap_or(per_second);
        Ok(Self {
            settings: settings.clone(),
            local: DefaultKeyedRateLimiter::keyed(Quota::per_second(per_second).allow_burst(burst)),
            trusted: settings
                .trusted_proxies
                .iter()
                .filter_map(|p| parse_cidr(p))
                .collect(),
        })
    }

    fn key(&self, headers: &HeaderMap, peer: Option<IpAddr>) -> String {
        if self.settings.key == RateLimitKey::ApiKey
            && let Some(k) = headers
                .get(self.settings.api_key_header.as_str())
                .and_then(|v| v.to_str().ok())
        {
            return format!("key:{k}");
        }
        format!(
            "ip:{}",
            client_ip(headers, peer, &self.trusted)
                .map_or_else(|| "unknown".into(), |ip| ip.to_string())
        )
    }

    pub async fn check(&self, headers: &HeaderMap, peer: Option<IpAddr>) -> Decision {
        let key = self.key(headers, peer);
        let limit = self.settings.per_second;
        let mut h = HeaderMap::new();
        h.insert(
            HeaderName::from_static("ratelimit-limit"),
            HeaderValue::from(limit),
        );
        match self.local.check_key(&key) {
            Ok(()) => Decision::Allowed { headers: h },
            Err(not_until) => {
                let wait = not_until.wait_time_from(DefaultClock::default().now());
                metrics::counter!("tributary_ratelimit_rejections_total", "backend" => "local")
                    .increment(1);
                h.insert(
                    HeaderName::from_static("ratelimit-remaining"),
                    HeaderValue::from(0),
                );
                Decision::Limited {
                    headers: h,
                    retry_after: wait,
                }
            }
        }
    }
}

/// The client's address: the peer, unless the peer is a trusted proxy, in which case the
/// right-most `X-Forwarded-For` entry that is not itself a trusted proxy.
pub fn client_ip(
    headers: &HeaderMap,
    peer: Option<IpAddr>,
    trusted: &[(IpAddr, u8)],
) -> Option<IpAddr> {
    let peer = peer?;
    if !trusted.iter().any(|c| in_cidr(peer, *c)) {
        return Some(peer);
    }
    let xff = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect::<Vec<_>>()
        .join(",");
    xff.rsplit(',')
        .filter_map(|s| s.trim().parse::<IpAddr>().ok())
        .find(|ip| !trusted.iter().any(|c| in_cidr(*ip, *c)))
        .or(Some(peer))
}

/// Parses `10.0.0.0/8`, `::1/128` or a bare address.
pub fn parse_cidr(s: &str) -> Option<(IpAddr, u8)> {
    let (addr, len) = match s.split_once('/') {
        Some((a, l)) => (
            a.trim().parse::<IpAddr>().ok()?,
            l.trim().parse::<u8>().ok()?,
        ),
        None => {
            let a = s.trim().parse::<IpAddr>().ok()?;
            (a, if a.is_ipv4() { 32 } else { 128 })
        }
    };
    let max = if addr.is_ipv4() { 32 } else { 128 };
    (len <= max).then_some((addr, len))
}

fn in_cidr(ip: IpAddr, (net, len): (IpAddr, u8)) -> bool {
    match (ip, net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            let mask = if len == 0 {
                0
            } else {
                u32::MAX << (32 - u32::from(len))
            };
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            let mask = if len == 0 {
                0
            } else {
                u128::MAX << (128 - u32::from(len))
            };
            u128::from(a) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}
