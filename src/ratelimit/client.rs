//! Who is asking: the client's identity for rate limiting.
//!
//! With `key = "api_key"` the client is the value of `api_key_header`, falling back to the
//! client IP when the header is absent; with `key = "ip"` it is the client IP. The client IP is
//! the TCP peer, unless the peer is inside `trusted_proxies`: then `X-Forwarded-For` is read from
//! the right, skipping trusted proxies, and the first untrusted entry is the client (entries to
//! its left were written by the client itself and prove nothing). Keys are hashed (SHA-256,
//! 16 bytes) so an API key — a credential — is never stored in Redis, and every local entry
//! has the same small size whatever the client sends.

use std::{
    fmt,
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use axum::{
    extract::ConnectInfo,
    http::{HeaderMap, HeaderName, Request},
};
use sha2::{Digest, Sha256};
use tower_governor::{GovernorError, key_extractor::KeyExtractor};

use super::redis::REDIS_KEY_PREFIX;
use crate::config::{Cidr, RateLimitKey, RateLimitSettings};

/// A client's identity for rate limiting: a 16-byte digest of what identifies it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ClientKey([u8; 16]);

impl ClientKey {
    fn digest(kind: &str, value: &[u8]) -> Self {
        let mut h = Sha256::new();
        h.update(kind.as_bytes());
        h.update([0]);
        h.update(value);
        let mut key = [0; 16];
        key.copy_from_slice(&h.finalize()[..16]);
        Self(key)
    }

    /// The client's key in Redis.
    pub(crate) fn redis_key(&self) -> String {
        format!("{REDIS_KEY_PREFIX}{}", hex::encode(self.0))
    }
}

impl fmt::Debug for ClientKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ClientKey({})", hex::encode(self.0))
    }
}

/// Who is asking: the API key or the client IP, per `rate_limit.key`.
#[derive(Debug, Clone)]
pub(crate) struct ClientKeyExtractor {
    by: RateLimitKey,
    api_key_header: HeaderName,
    trusted: Arc<[Cidr]>,
}

impl ClientKeyExtractor {
    pub(crate) fn new(settings: &RateLimitSettings) -> Self {
        Self {
            by: settings.key,
            api_key_header: settings.api_key_header.clone(),
            trusted: settings.trusted_proxies.iter().copied().collect(),
        }
    }

    /// The key of the client that sent these headers over a connection from `peer`.
    pub(crate) fn key(&self, headers: &HeaderMap, peer: Option<IpAddr>) -> ClientKey {
        if self.by == RateLimitKey::ApiKey
            && let Some(api_key) = headers.get(&self.api_key_header).filter(|v| !v.is_empty())
        {
            return ClientKey::digest("api_key", api_key.as_bytes());
        }
        match client_ip(headers, peer, &self.trusted) {
            Some(ip) => ClientKey::digest("ip", ip.to_string().as_bytes()),
            // Only without a connection (in-process `oneshot` tests): one shared bucket.
            None => ClientKey::digest("ip", b"unknown"),
        }
    }
}

impl KeyExtractor for ClientKeyExtractor {
    type Key = ClientKey;

    fn extract<T>(&self, req: &Request<T>) -> Result<Self::Key, GovernorError> {
        let peer = req
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0.ip());
        Ok(self.key(req.headers(), peer))
    }
}

/// The client's address: the peer, unless the peer is a trusted proxy; then `X-Forwarded-For`
/// is walked from the right past trusted proxies, and the first untrusted entry is the client.
/// An entry that does not parse stops the walk at the last trusted hop: anything further left
/// could have been written by anyone.
pub(crate) fn client_ip(
    headers: &HeaderMap,
    peer: Option<IpAddr>,
    trusted: &[Cidr],
) -> Option<IpAddr> {
    let peer = peer?.to_canonical();
    let is_trusted = |ip: IpAddr| trusted.iter().any(|c| c.contains(ip));
    if !is_trusted(peer) {
        return Some(peer);
    }
    // Several X-Forwarded-For fields are one list, in order (RFC 9110, 5.3).
    let hops: Vec<&str> = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let mut nearest = peer;
    for hop in hops.iter().rev() {
        match parse_hop(hop) {
            Some(ip) if is_trusted(ip) => nearest = ip,
            Some(ip) => return Some(ip),
            None => return Some(nearest),
        }
    }
    Some(nearest)
}

/// One `X-Forwarded-For` entry: `1.2.3.4`, `1.2.3.4:5678`, `2001:db8::1` or `[2001:db8::1]:80`.
fn parse_hop(hop: &str) -> Option<IpAddr> {
    if let Ok(ip) = hop.parse::<IpAddr>() {
        return Some(ip.to_canonical());
    }
    hop.parse::<SocketAddr>()
        .ok()
        .map(|s| s.ip().to_canonical())
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;
    use crate::ratelimit::tests::settings;

    fn cidrs(list: &[&str]) -> Vec<Cidr> {
        list.iter().map(|s| s.parse().unwrap()).collect()
    }

    fn xff(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append("x-forwarded-for", HeaderValue::from_str(v).unwrap());
        }
        h
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn forwarded_for_is_ignored_from_an_untrusted_peer() {
        let trusted = cidrs(&["10.0.0.0/8"]);
        let h = xff(&["203.0.113.9"]);
        assert_eq!(
            client_ip(&h, Some(ip("198.51.100.1")), &trusted),
            Some(ip("198.51.100.1"))
        );
        assert_eq!(
            client_ip(&h, Some(ip("10.0.0.1")), &[]),
            Some(ip("10.0.0.1")),
            "no trusted proxies: never believed"
        );
    }

    #[test]
    fn from_a_trusted_peer_the_right_most_untrusted_entry_is_the_client() {
        let trusted = cidrs(&["10.0.0.0/8"]);
        let peer = Some(ip("10.0.0.1"));
        // The client forged the left-most entry; the proxies appended the rest.
        let h = xff(&["1.1.1.1, 203.0.113.9, 10.0.0.7"]);
        assert_eq!(client_ip(&h, peer, &trusted), Some(ip("203.0.113.9")));
        // Split across several fields, in order.
        let h = xff(&["1.1.1.1", "203.0.113.9", "10.0.0.7"]);
        assert_eq!(client_ip(&h, peer, &trusted), Some(ip("203.0.113.9")));
        // Ports and brackets as some proxies write them.
        let h = xff(&["198.51.100.4:5123"]);
        assert_eq!(client_ip(&h, peer, &trusted), Some(ip("198.51.100.4")));
        let h = xff(&["[2001:db8::4]:443"]);
        assert_eq!(client_ip(&h, peer, &trusted), Some(ip("2001:db8::4")));
    }

    #[test]
    fn a_chain_of_only_trusted_hops_or_no_header_yields_the_nearest_known_hop() {
        let trusted = cidrs(&["10.0.0.0/8"]);
        let peer = Some(ip("10.0.0.1"));
        assert_eq!(client_ip(&HeaderMap::new(), peer, &trusted), peer);
        let h = xff(&["10.0.0.9, 10.0.0.7"]);
        assert_eq!(client_ip(&h, peer, &trusted), Some(ip("10.0.0.9")));
        // Garbage stops the walk: the forged address to its left is not believed.
        let h = xff(&["203.0.113.9, unknown, 10.0.0.7"]);
        assert_eq!(client_ip(&h, peer, &trusted), Some(ip("10.0.0.7")));
    }

    #[test]
    fn an_ipv4_mapped_peer_is_treated_as_ipv4() {
        let trusted = cidrs(&["127.0.0.1/32"]);
        let h = xff(&["203.0.113.9"]);
        assert_eq!(
            client_ip(&h, Some(ip("::ffff:127.0.0.1")), &trusted),
            Some(ip("203.0.113.9"))
        );
        assert_eq!(
            client_ip(&HeaderMap::new(), Some(ip("::ffff:192.0.2.1")), &[]),
            Some(ip("192.0.2.1"))
        );
    }
    #[test]
    fn the_api_key_identifies_the_client_and_the_ip_is_the_fallback() {
        let keys = ClientKeyExtractor::new(&settings(RateLimitKey::ApiKey));
        let peer = Some(ip("192.0.2.1"));
        let mut with_key = HeaderMap::new();
        with_key.insert("x-api-key", HeaderValue::from_static("secret-123"));
        let a = keys.key(&with_key, peer);
        assert_eq!(
            a,
            keys.key(&with_key, Some(ip("192.0.2.2"))),
            "same key, any IP"
        );
        assert_ne!(a, keys.key(&HeaderMap::new(), peer));
        assert_eq!(
            keys.key(&HeaderMap::new(), peer),
            ClientKey::digest("ip", b"192.0.2.1")
        );
        assert!(
            !a.redis_key().contains("secret"),
            "credentials never reach Redis"
        );
        assert!(a.redis_key().starts_with(REDIS_KEY_PREFIX));

        let by_ip = ClientKeyExtractor::new(&settings(RateLimitKey::Ip));
        assert_eq!(
            by_ip.key(&with_key, peer),
            by_ip.key(&HeaderMap::new(), peer)
        );
    }

    #[test]
    fn the_tower_governor_extractor_reads_the_peer_from_connect_info() {
        let keys = ClientKeyExtractor::new(&settings(RateLimitKey::Ip));
        let mut req = Request::builder()
            .header("x-forwarded-for", "203.0.113.9")
            .body(())
            .unwrap();
        req.extensions_mut()
            .insert(ConnectInfo(SocketAddr::from(([127, 0, 0, 1], 4000))));
        let key = keys.extract(&req).unwrap();
        assert_eq!(key, ClientKey::digest("ip", b"203.0.113.9"));
    }
}
