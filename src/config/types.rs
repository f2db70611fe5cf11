//! Setting types that carry their invariant: a value of one of them is valid by construction, so
//! the code that uses it never checks again, and a bad value fails at load time with the key's
//! path in the message.
//!
//! Error messages never repeat the value they reject when it can hold a credential (a URL's
//! userinfo, a connection string): a configuration error goes to a terminal or a log.

use std::{fmt, net::IpAddr, str::FromStr, time::Duration};

use serde::{Deserialize, Deserializer, Serialize, Serializer, de::Error as _};

/// A string that never shows up in output: `Debug` and `Serialize` both write `***`, so
/// printing the settings (`tributary check-config`) masks it without being told to.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value itself, for the one place that uses it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str("***")
    }
}

/// A Postgres connection URL, as a [`Secret`] (it holds the password).
pub(super) fn postgres_url<'de, D: Deserializer<'de>>(d: D) -> Result<Secret, D::Error> {
    let url = String::deserialize(d)?;
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(D::Error::custom(
            "not a Postgres URL (it must start with postgres:// or postgresql://)",
        ));
    }
    // sqlx's messages name the part that is wrong, not the URL.
    sqlx::postgres::PgConnectOptions::from_str(&url)
        .map_err(|e| D::Error::custom(format!("not a valid Postgres URL ({e})")))?;
    Ok(Secret(url))
}

/// An optional Redis URL, as a [`Secret`] (it may hold the password).
pub(super) fn redis_url<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Secret>, D::Error> {
    let Some(url) = Option::<String>::deserialize(d)? else {
        return Ok(None);
    };
    if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
        return Err(D::Error::custom("must start with redis:// or rediss://"));
    }
    Ok(Some(Secret(url)))
}

/// A share between 0 and 1 inclusive; NaN is not one.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd, Serialize)]
#[serde(transparent)]
pub struct Ratio(f64);

impl Ratio {
    /// `value` as a ratio; panics (at compile time in a `const`) when it is not in 0..=1.
    pub const fn of(value: f64) -> Self {
        assert!(value >= 0.0 && value <= 1.0, "a ratio is between 0 and 1");
        Self(value)
    }

    pub fn new(value: f64) -> Option<Self> {
        // NaN is in no range, so it is rejected too.
        (0.0..=1.0).contains(&value).then_some(Self(value))
    }

    pub fn get(self) -> f64 {
        self.0
    }
}

impl<'de> Deserialize<'de> for Ratio {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let value = f64::deserialize(d)?;
        Ratio::new(value)
            .ok_or_else(|| D::Error::custom(format!("must be between 0 and 1, got {value}")))
    }
}

/// A ratio that is not zero (a smoothing weight: zero would never move).
pub(super) fn positive_ratio<'de, D: Deserializer<'de>>(d: D) -> Result<Ratio, D::Error> {
    let ratio = Ratio::deserialize(d)?;
    if ratio.get() == 0.0 {
        return Err(D::Error::custom("must be greater than 0 and at most 1"));
    }
    Ok(ratio)
}

/// A factor of at least 1 (a tolerance: below 1 the limit would shrink at steady latency).
pub(super) fn at_least_one<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    let value = f64::deserialize(d)?;
    // Written so that NaN is rejected too.
    if value >= 1.0 {
        Ok(value)
    } else {
        Err(D::Error::custom(format!(
            "must be at least 1.0, got {value}"
        )))
    }
}

/// A duration such as `250ms` or `2s` that must not be zero (a zero timeout fails everything).
pub(super) mod positive_duration {
    use super::*;

    pub(crate) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        humantime_serde::serialize(d, s)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let value: Duration = humantime_serde::deserialize(d)?;
        if value.is_zero() {
            return Err(D::Error::custom("must be greater than zero"));
        }
        Ok(value)
    }
}

/// An HTTP header name, e.g. `x-api-key`.
pub(super) mod header_name {
    use http::HeaderName;

    use super::*;

    pub(crate) fn serialize<S: Serializer>(h: &HeaderName, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(h.as_str())
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<HeaderName, D::Error> {
        let name = String::deserialize(d)?;
        HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| D::Error::custom(format!("{name:?} is not a valid header name")))
    }
}

/// An absolute `http` or `https` URL with a host: a downstream's base URL, an OTLP endpoint.
///
/// It prints (`Display`, `Debug`, `Serialize`) with the password of its userinfo replaced by
/// `***` (a user name without a password, often a token, as well); [`HttpUrl::as_str`] is
/// the URL to connect to.
#[derive(Clone, PartialEq, Eq)]
pub struct HttpUrl(url::Url);

impl HttpUrl {
    /// The whole URL, credentials included.
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }

    /// The parsed URL, credentials included.
    pub fn url(&self) -> &url::Url {
        &self.0
    }
}

impl FromStr for HttpUrl {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        // url's parse errors name what is wrong ("invalid port number"), never the input.
        let url = url::Url::parse(s).map_err(|e| format!("not a valid URL ({e})"))?;
        if !matches!(url.scheme(), "http" | "https") || !url.has_host() {
            return Err("must be an http:// or https:// URL with a host".into());
        }
        Ok(Self(url))
    }
}

impl fmt::Display for HttpUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.password().is_none() && self.0.username().is_empty() {
            return f.write_str(self.0.as_str());
        }
        let mut shown = self.0.clone();
        // Cannot fail: the URL has a host, so it can carry credentials. A user name without a
        // password is masked too: it is often a token.
        if shown.password().is_some() {
            let _ = shown.set_password(Some("***"));
        } else {
            let _ = shown.set_username("***");
        }
        f.write_str(shown.as_str())
    }
}

impl fmt::Debug for HttpUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HttpUrl({self})")
    }
}

impl Serialize for HttpUrl {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for HttpUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(D::Error::custom)
    }
}

/// An address block, e.g. `10.0.0.0/8`, or a single address (a /32 or /128).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    net: IpAddr,
    len: u8,
}

impl Cidr {
    /// Whether `ip` is inside the block. IPv4-mapped IPv6 addresses count as IPv4.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (ip.to_canonical(), self.net) {
            (IpAddr::V4(a), IpAddr::V4(n)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.len)).unwrap_or(0);
                u32::from(a) & mask == u32::from(n) & mask
            }
            (IpAddr::V6(a), IpAddr::V6(n)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.len))
                    .unwrap_or(0);
                u128::from(a) & mask == u128::from(n) & mask
            }
            _ => false,
        }
    }
}

impl FromStr for Cidr {
    type Err = String;

    /// Parses `10.0.0.0/8`, `::1/128` or a bare address.
    fn from_str(s: &str) -> Result<Self, String> {
        let invalid = || format!("{s:?} is not an IP address or CIDR");
        let (addr, len) = match s.split_once('/') {
            Some((a, l)) => (
                a.trim().parse::<IpAddr>().map_err(|_| invalid())?,
                l.trim().parse::<u8>().map_err(|_| invalid())?,
            ),
            None => {
                let a = s.trim().parse::<IpAddr>().map_err(|_| invalid())?;
                (a, if a.is_ipv4() { 32 } else { 128 })
            }
        };
        let max = if addr.is_ipv4() { 32 } else { 128 };
        if len > max {
            return Err(invalid());
        }
        let net = addr.to_canonical();
        // `::ffff:10.0.0.0/104` is `10.0.0.0/8`.
        let len = if addr.is_ipv6() && net.is_ipv4() {
            len.checked_sub(96).ok_or_else(invalid)?
        } else {
            len
        };
        Ok(Cidr { net, len })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.net, self.len)
    }
}

impl Serialize for Cidr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Cidr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(D::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidr(s: &str) -> Cidr {
        s.parse().unwrap()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn cidr_matching_covers_v4_v6_prefixes_and_bare_addresses() {
        let net = cidr("10.0.0.0/8");
        assert!(net.contains(ip("10.255.1.2")));
        assert!(!net.contains(ip("11.0.0.1")));
        let host = cidr("192.168.1.7");
        assert!(host.contains(ip("192.168.1.7")));
        assert!(!host.contains(ip("192.168.1.8")));
        let odd = cidr("172.16.0.0/12");
        assert!(odd.contains(ip("172.31.255.255")));
        assert!(!odd.contains(ip("172.32.0.0")));
        let all = cidr("0.0.0.0/0");
        assert!(all.contains(ip("8.8.8.8")));
        assert!(
            !all.contains(ip("2001:db8::1")),
            "a v4 block never holds v6"
        );
        let v6 = cidr("2001:db8::/32");
        assert!(v6.contains(ip("2001:db8:ffff::1")));
        assert!(!v6.contains(ip("2001:db9::1")));
        assert!(!v6.contains(ip("10.0.0.1")));
        assert!(cidr("::/0").contains(ip("::1")));
        let host_bits_set = cidr("10.1.2.3/8");
        assert!(host_bits_set.contains(ip("10.9.9.9")));
    }

    #[test]
    fn ipv4_mapped_addresses_match_ipv4_blocks() {
        let net = cidr("127.0.0.1/32");
        assert!(net.contains(ip("::ffff:127.0.0.1")));
        assert_eq!(cidr("::ffff:10.0.0.0/104"), cidr("10.0.0.0/8"));
    }

    #[test]
    fn malformed_cidrs_are_rejected() {
        for bad in [
            "10.0.0.0/33",
            "::/129",
            "10.0.0/8",
            "ten/8",
            "10.0.0.0/",
            "",
            "::ffff:10.0.0.0/95",
        ] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn ratios_outside_zero_to_one_and_nan_are_rejected() {
        assert_eq!(Ratio::new(0.0).map(Ratio::get), Some(0.0));
        assert_eq!(Ratio::new(1.0).map(Ratio::get), Some(1.0));
        for bad in [-0.01, 1.01, f64::NAN, f64::INFINITY] {
            assert!(Ratio::new(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn urls_print_without_their_password() {
        let url: HttpUrl = "https://user:hunter2@collector:4318/v1".parse().unwrap();
        assert_eq!(url.to_string(), "https://user:***@collector:4318/v1");
        assert!(!format!("{url:?}").contains("hunter2"));
        assert_eq!(
            serde_json::to_string(&url).unwrap(),
            "\"https://user:***@collector:4318/v1\""
        );
        assert!(
            url.as_str().contains("hunter2"),
            "the URL to connect to is whole"
        );
        let plain: HttpUrl = "http://users:9001".parse().unwrap();
        assert_eq!(plain.to_string(), "http://users:9001/");
        let token: HttpUrl = "https://tok3n@collector:4318".parse().unwrap();
        assert_eq!(token.to_string(), "https://***@collector:4318/");
    }

    #[test]
    fn rejected_urls_are_not_repeated_in_the_error() {
        for bad in [
            "ftp://user:hunter2@host",
            "http://user:hunter2@host:99999",
            "user:hunter2",
        ] {
            let err = bad.parse::<HttpUrl>().unwrap_err();
            assert!(!err.contains("hunter2"), "{err}");
        }
    }

    #[test]
    fn secrets_serialise_masked() {
        let s = Secret::new("redis://:hunter2@cache:6379");
        assert_eq!(serde_json::to_string(&s).unwrap(), "\"***\"");
        assert_eq!(format!("{s:?}"), "Secret(***)");
    }
}
