//! Grey (canary) releases: a downstream's variants, the rules that send a request to one, and
//! the `[routing]` section (the admin endpoints and the automatic rollback).
//!
//! A file of its own, not beside the other sections in `mod.rs`, because this is the one part
//! of the configuration that is reloaded while the gateway runs (SIGHUP, the admin endpoint):
//! everything in it is checked again on every reload, by the same types, and a reload that does
//! not validate is refused as a whole. Keeping the rules here keeps that surface in one place.
//!
//! ```toml
//! [downstreams.carts.variants.canary]
//! base_url = "http://carts-canary:8080"
//! max_concurrency = 64
//!
//! [[downstreams.carts.rules]]          # evaluated in order; the first match decides
//! variant = "canary"
//! header = "x-gray-version"
//! matches = "^v2"                       # a regex; or equals = "v2"
//!
//! [[downstreams.carts.rules]]
//! variant = "canary"
//! user_ids = [42]
//! user_ranges = [[1000, 1999]]          # inclusive
//!
//! [[downstreams.carts.rules]]
//! variant = "canary"
//! percent = 10                          # sticky per user (a fixed hash of the user id)
//! ```

use std::{collections::BTreeMap, fmt, num::NonZeroUsize, str::FromStr, time::Duration};

use http::HeaderName;
use serde::{Deserialize, Deserializer, Serialize, Serializer, de::Error as _};

use super::{HttpUrl, Ratio, types};

/// The name every downstream's own deployment goes by; no variant may take it.
pub const STABLE: &str = "stable";

/// A variant's name: 1 to 32 of `a-z`, `0-9`, `-` and `_`, not `stable`. It is a metric label
/// value, a header value and a path segment of the admin endpoints, hence the small alphabet.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VariantName(String);

impl VariantName {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for VariantName {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let ok = (1..=32).contains(&s.len())
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
        if !ok {
            return Err(format!(
                "{s:?} is not a variant name (1 to 32 of a-z, 0-9, - and _)"
            ));
        }
        if s == STABLE {
            return Err("\"stable\" is the name of the downstream itself, not a variant".into());
        }
        Ok(Self(s.to_owned()))
    }
}

impl fmt::Display for VariantName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for VariantName {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for VariantName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(D::Error::custom)
    }
}

/// Another deployment of a downstream service: an instance of its own, with its own address,
/// timeout, bulkhead, circuit breaker and connection pool, so that a slow canary fills its own
/// bulkhead and never stable's.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct VariantSettings {
    /// Required: where the variant runs; calls go to `{base_url}/{service}/{user_id}`.
    pub base_url: HttpUrl,
    /// Per-call timeout (default 500ms).
    #[serde(with = "types::positive_duration", default = "default_timeout")]
    pub timeout: Duration,
    /// The variant's own bulkhead (default 1024).
    #[serde(default = "default_concurrency")]
    pub max_concurrency: NonZeroUsize,
    #[serde(with = "humantime_serde", default)]
    pub hedge_after: Option<Duration>,
    /// Idle keep-alive connections kept to the variant (its own pool; default 256).
    #[serde(default = "default_pool")]
    pub pool_max_idle_per_host: usize,
    /// A disabled variant gets no traffic from any rule; its instance is kept.
    #[serde(default = "enabled")]
    pub enabled: bool,
}

fn default_timeout() -> Duration {
    Duration::from_millis(500)
}

fn default_concurrency() -> NonZeroUsize {
    NonZeroUsize::new(1024).expect("non-zero")
}

fn default_pool() -> usize {
    256
}

fn enabled() -> bool {
    true
}

impl VariantSettings {
    /// Whether an instance built from `self` can serve as one built from `other`: everything
    /// but `enabled` is the same. A reload keeps such an instance (its bulkhead, breaker and
    /// pool) and builds a new one otherwise.
    pub fn same_instance(&self, other: &Self) -> bool {
        self.base_url == other.base_url
            && self.timeout == other.timeout
            && self.max_concurrency == other.max_concurrency
            && self.hedge_after == other.hedge_after
            && self.pool_max_idle_per_host == other.pool_max_idle_per_host
    }
}

/// A share of users in hundredths of a percent (0 to 10 000), so that a sticky bucket is an
/// integer comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Percent(u32);

impl Percent {
    /// In hundredths of a percent.
    pub fn basis_points(self) -> u32 {
        self.0
    }

    pub fn as_f64(self) -> f64 {
        f64::from(self.0) / 100.0
    }

    fn parse(value: f64) -> Result<Self, String> {
        // Written so that NaN is rejected too.
        if !(0.0..=100.0).contains(&value) {
            return Err(format!("percent must be between 0 and 100, got {value}"));
        }
        let points = (value * 100.0).round();
        if (points - value * 100.0).abs() > 1e-6 {
            return Err(format!(
                "percent has at most two decimals (0.01 % steps), got {value}"
            ));
        }
        Ok(Self(points as u32))
    }
}

/// How a header's value is matched.
#[derive(Debug, Clone)]
pub enum HeaderMatch {
    /// The whole value, byte for byte.
    Equals(String),
    /// A regular expression (the `regex` crate's syntax: linear time, no backtracking), found
    /// anywhere in the value unless anchored.
    Regex(regex::Regex),
}

impl PartialEq for HeaderMatch {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (HeaderMatch::Equals(a), HeaderMatch::Equals(b)) => a == b,
            (HeaderMatch::Regex(a), HeaderMatch::Regex(b)) => a.as_str() == b.as_str(),
            _ => false,
        }
    }
}

impl HeaderMatch {
    pub fn is_match(&self, value: &[u8]) -> bool {
        match self {
            HeaderMatch::Equals(want) => value == want.as_bytes(),
            HeaderMatch::Regex(re) => std::str::from_utf8(value).is_ok_and(|v| re.is_match(v)),
        }
    }
}

/// What a rule looks at.
#[derive(Debug, Clone, PartialEq)]
pub enum Match {
    /// A request header (by the caller: testers, a client build).
    Header {
        name: HeaderName,
        value: HeaderMatch,
    },
    /// Listed user ids and inclusive ranges of them (staff, beta users).
    Users {
        ids: Vec<i64>,
        ranges: Vec<(i64, i64)>,
    },
    /// A share of all users, the same users every time: the user id's bucket (a fixed hash,
    /// the same in every replica and after every restart) is below the share. Raising the
    /// share keeps every user who was already on the variant there.
    Percent(Percent),
}

/// One routing rule: requests it matches go to `variant`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(try_from = "RuleSpec", into = "RuleSpec")]
pub struct Rule {
    pub variant: VariantName,
    pub when: Match,
}

/// A rule as written: exactly one of `header` (with `equals` or `matches`), `user_ids` /
/// `user_ranges`, or `percent`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RuleSpec {
    variant: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    header: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    equals: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    matches: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    user_ids: Vec<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    user_ranges: Vec<[i64; 2]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    percent: Option<f64>,
}

/// Bound on a compiled pattern: a rule is configuration, not a place for a megabyte automaton.
const REGEX_SIZE_LIMIT: usize = 64 * 1024;

impl TryFrom<RuleSpec> for Rule {
    type Error = String;

    fn try_from(spec: RuleSpec) -> Result<Self, String> {
        let variant: VariantName = spec.variant.parse()?;
        let users = !spec.user_ids.is_empty() || !spec.user_ranges.is_empty();
        let kinds = usize::from(spec.header.is_some())
            + usize::from(users)
            + usize::from(spec.percent.is_some());
        if kinds != 1 {
            return Err(format!(
                "the rule for {variant} needs exactly one of header, user_ids/user_ranges or percent"
            ));
        }
        if spec.header.is_none() && (spec.equals.is_some() || spec.matches.is_some()) {
            return Err(format!(
                "the rule for {variant}: equals and matches go with header"
            ));
        }
        let when = if let Some(header) = spec.header {
            let name = HeaderName::from_bytes(header.as_bytes())
                .map_err(|_| format!("{header:?} is not a valid header name"))?;
            let value = match (spec.equals, spec.matches) {
                (Some(v), None) => HeaderMatch::Equals(v),
                (None, Some(pattern)) => HeaderMatch::Regex(
                    regex::RegexBuilder::new(&pattern)
                        .size_limit(REGEX_SIZE_LIMIT)
                        .build()
                        .map_err(|e| {
                            // The regex crate's message spans lines (a caret under the
                            // offending part); a configuration error is one line.
                            let first = e.to_string();
                            let last = first.lines().last().unwrap_or_default().trim().to_owned();
                            format!("{pattern:?} is not a valid regex ({last})")
                        })?,
                ),
                _ => {
                    return Err(format!(
                        "the header rule for {variant} needs exactly one of equals or matches"
                    ));
                }
            };
            Match::Header { name, value }
        } else if users {
            if let Some(bad) = spec.user_ids.iter().find(|id| **id <= 0) {
                return Err(format!("user id {bad} is not a positive integer"));
            }
            if let Some([from, to]) = spec
                .user_ranges
                .iter()
                .find(|[from, to]| *from <= 0 || from > to)
            {
                return Err(format!(
                    "user range [{from}, {to}] must be positive with from <= to"
                ));
            }
            let mut ids = spec.user_ids;
            ids.sort_unstable();
            ids.dedup();
            Match::Users {
                ids,
                ranges: spec.user_ranges.into_iter().map(|[a, b]| (a, b)).collect(),
            }
        } else {
            Match::Percent(Percent::parse(spec.percent.unwrap_or_default())?)
        };
        Ok(Rule { variant, when })
    }
}

impl From<Rule> for RuleSpec {
    fn from(rule: Rule) -> Self {
        let mut spec = RuleSpec {
            variant: rule.variant.0,
            ..RuleSpec::default()
        };
        match rule.when {
            Match::Header { name, value } => {
                spec.header = Some(name.as_str().to_owned());
                match value {
                    HeaderMatch::Equals(v) => spec.equals = Some(v),
                    HeaderMatch::Regex(re) => spec.matches = Some(re.as_str().to_owned()),
                }
            }
            Match::Users { ids, ranges } => {
                spec.user_ids = ids;
                spec.user_ranges = ranges.into_iter().map(|(a, b)| [a, b]).collect();
            }
            Match::Percent(p) => spec.percent = Some(p.as_f64()),
        }
        spec
    }
}

/// A downstream's variants and rules, checked against each other.
pub(super) fn validate(
    service: &str,
    variants: &BTreeMap<VariantName, VariantSettings>,
    rules: &[Rule],
    problems: &mut Vec<String>,
) {
    for (i, rule) in rules.iter().enumerate() {
        if !variants.contains_key(&rule.variant) {
            problems.push(format!(
                "downstreams.{service}.rules[{i}] names variant {:?}, which downstreams.{service}.variants does not declare",
                rule.variant.as_str()
            ));
        }
    }
    let mut total = BTreeMap::<&VariantName, u32>::new();
    for rule in rules {
        if let Match::Percent(p) = rule.when {
            *total.entry(&rule.variant).or_default() += p.basis_points();
        }
    }
    let sum: u32 = total.values().sum();
    if sum > 10_000 {
        problems.push(format!(
            "downstreams.{service}.rules: the percent rules add up to {} %, more than 100",
            f64::from(sum) / 100.0
        ));
    }
}

/// The `[routing]` section.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RoutingSettings {
    /// Serve `/admin/routing` (the table and the live comparison, pause, resume and reload) on
    /// `server.ops_listen`. Off by default: the operations port is reachable by whatever
    /// scrapes it, and these routes change where traffic goes.
    pub admin: bool,
    /// Poll the configuration file every `watch_interval` and reload the routing when it
    /// changed (SIGHUP always reloads).
    pub watch_config: bool,
    #[serde(with = "types::positive_duration")]
    pub watch_interval: Duration,
    pub rollback: RollbackSettings,
}

impl Default for RoutingSettings {
    fn default() -> Self {
        Self {
            admin: false,
            watch_config: false,
            watch_interval: Duration::from_secs(5),
            rollback: RollbackSettings::default(),
        }
    }
}

/// When a variant's percentage traffic is taken away from it automatically.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RollbackSettings {
    pub enabled: bool,
    /// The comparison's window: calls older than this no longer count.
    #[serde(with = "types::positive_duration")]
    pub window: Duration,
    /// How often the variants are compared with stable.
    #[serde(with = "types::positive_duration")]
    pub interval: Duration,
    /// Calls the variant must have had in the window before it is judged (and stable too,
    /// for the p99 comparison).
    pub min_calls: u32,
    /// Rolled back when its error ratio exceeds stable's by more than this (0.05 = five
    /// percentage points).
    pub error_ratio_margin: Ratio,
    /// Rolled back when its p99 exceeds stable's by more than this.
    #[serde(with = "types::positive_duration")]
    pub p99_margin: Duration,
}

impl Default for RollbackSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            window: Duration::from_secs(60),
            interval: Duration::from_secs(5),
            min_calls: 100,
            error_ratio_margin: Ratio::of(0.05),
            p99_margin: Duration::from_millis(250),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(toml: &str) -> Result<Rule, String> {
        use figment::providers::Format;
        #[derive(Deserialize)]
        struct W {
            rule: Rule,
        }
        figment::Figment::from(figment::providers::Toml::string(toml))
            .extract::<W>()
            .map(|w| w.rule)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn each_kind_of_rule_parses() {
        let r =
            rule("[rule]\nvariant = \"canary\"\nheader = \"X-Gray-Version\"\nmatches = \"^v2\"")
                .unwrap();
        let Match::Header { name, value } = &r.when else {
            panic!("{r:?}")
        };
        assert_eq!(name.as_str(), "x-gray-version");
        assert!(value.is_match(b"v2.1") && !value.is_match(b"v1") && !value.is_match(b"xv2"));
        let r = rule("[rule]\nvariant = \"c\"\nuser_ids = [3, 1, 3]\nuser_ranges = [[10, 20]]")
            .unwrap();
        assert_eq!(
            r.when,
            Match::Users {
                ids: vec![1, 3],
                ranges: vec![(10, 20)]
            }
        );
        let r = rule("[rule]\nvariant = \"c\"\npercent = 12.5").unwrap();
        assert_eq!(r.when, Match::Percent(Percent(1250)));
    }

    #[test]
    fn malformed_rules_are_refused_with_one_line() {
        for (toml, expect) in [
            ("variant = \"c\"", "exactly one of"),
            (
                "variant = \"c\"\npercent = 5\nuser_ids = [1]",
                "exactly one of",
            ),
            (
                "variant = \"c\"\nheader = \"x\"",
                "exactly one of equals or matches",
            ),
            (
                "variant = \"c\"\nheader = \"x\"\nmatches = \"(\"",
                "not a valid regex",
            ),
            (
                "variant = \"c\"\nheader = \"bad header\"\nequals = \"1\"",
                "not a valid header name",
            ),
            ("variant = \"c\"\npercent = 101", "between 0 and 100"),
            ("variant = \"c\"\npercent = 1.234", "two decimals"),
            ("variant = \"c\"\nuser_ranges = [[5, 1]]", "from <= to"),
            ("variant = \"c\"\nuser_ids = [0]", "positive"),
            ("variant = \"stable\"\npercent = 1", "not a variant"),
            ("variant = \"Canary\"\npercent = 1", "not a variant name"),
            (
                "variant = \"c\"\nequals = \"v\"\npercent = 1",
                "go with header",
            ),
        ] {
            let err = rule(&format!("[rule]\n{toml}")).expect_err(toml);
            assert!(err.contains(expect), "{toml}: {err}");
            assert!(!err.contains('\n'), "{toml}: {err}");
        }
    }

    #[test]
    fn a_rule_serialises_as_it_is_written() {
        let r = rule("[rule]\nvariant = \"c\"\nheader = \"x-v\"\nequals = \"2\"").unwrap();
        assert_eq!(
            serde_json::to_value(&r).unwrap(),
            serde_json::json!({"variant": "c", "header": "x-v", "equals": "2"})
        );
    }
}
