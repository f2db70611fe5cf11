//! OpenTelemetry's standard environment (`OTEL_*`), resolved together with the gateway's own
//! `telemetry.*` keys into one [`OtelSettings`] that says, for every value, where it came from.
//!
//! An OpenTelemetry deployment (a collector's Helm chart, an operator's injection, a platform's
//! defaults) configures a service through these variables; honouring them means the gateway
//! needs no deployment-specific keys to join one. The gateway's own keys still win when set:
//! they are the more specific instruction (the config file, `TRIBUTARY_TELEMETRY__*`).
//! Off-switches win over both: `OTEL_SDK_DISABLED=true` turns every signal off, and
//! `OTEL_TRACES_EXPORTER=none` / `OTEL_METRICS_EXPORTER=none` one of them.
//!
//! Resolution reads the environment it is given (the loader's [`super::Sources`]), never the
//! process's, so tests pass their own. The OpenTelemetry SDK is told every value explicitly
//! and never left to read these variables itself, except the exporter's own transport knobs
//! (see docs/observability.md).

use std::{fmt, time::Duration};

use http::{HeaderName, HeaderValue};
use serde::{Deserialize, Deserializer, Serialize, Serializer, de::Error as _};

use super::{HttpUrl, Ratio, TelemetrySettings};

/// Where an effective value came from, as `check-config` prints it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// A `telemetry.*` key (the config file or its `TRIBUTARY_TELEMETRY__*` variable).
    Key(&'static str),
    /// A standard OpenTelemetry environment variable.
    Env(&'static str),
    /// Nothing set it.
    Default,
}

impl Serialize for Source {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Source::Key(key) => s.collect_str(&format_args!("telemetry.{key}")),
            Source::Env(var) => s.collect_str(&format_args!("env {var}")),
            Source::Default => s.serialize_str("default"),
        }
    }
}

/// A value and where it came from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sourced<T> {
    pub value: T,
    pub from: Source,
}

impl<T> Sourced<T> {
    fn new(value: T, from: Source) -> Self {
        Self { value, from }
    }
}

/// The trace sampler, named as `OTEL_TRACES_SAMPLER` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SamplerKind {
    AlwaysOn,
    AlwaysOff,
    /// A share of traces, by trace id (the ratio is `sampling_ratio` / `OTEL_TRACES_SAMPLER_ARG`).
    Traceidratio,
    /// The caller's decision when there is one; otherwise every trace.
    ParentbasedAlwaysOn,
    ParentbasedAlwaysOff,
    ParentbasedTraceidratio,
}

impl SamplerKind {
    const ALL: [(&'static str, SamplerKind); 6] = [
        ("always_on", SamplerKind::AlwaysOn),
        ("always_off", SamplerKind::AlwaysOff),
        ("traceidratio", SamplerKind::Traceidratio),
        ("parentbased_always_on", SamplerKind::ParentbasedAlwaysOn),
        ("parentbased_always_off", SamplerKind::ParentbasedAlwaysOff),
        (
            "parentbased_traceidratio",
            SamplerKind::ParentbasedTraceidratio,
        ),
    ];

    /// Whether the sampler takes a ratio.
    pub fn uses_ratio(self) -> bool {
        matches!(
            self,
            SamplerKind::Traceidratio | SamplerKind::ParentbasedTraceidratio
        )
    }
}

/// Headers sent with every OTLP export (an API key, a tenant). Written `key=value,key=value`
/// as `OTEL_EXPORTER_OTLP_HEADERS` writes them, values percent-decoded. The values are
/// credentials as a rule, so they print as `***`; the keys are shown.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct OtlpHeaders(Vec<(HeaderName, HeaderValue)>);

impl OtlpHeaders {
    /// The headers to send.
    pub fn iter(&self) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
        self.0.iter().map(|(k, v)| (k, v))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::str::FromStr for OtlpHeaders {
    type Err = String;

    /// Never repeats a value in its error: it is a credential.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut headers = Vec::new();
        for (n, (key, value)) in key_values(s)?.into_iter().enumerate() {
            let name = HeaderName::from_bytes(key.as_bytes())
                .map_err(|_| format!("entry {} has no valid header name", n + 1))?;
            let value = HeaderValue::from_str(&value)
                .map_err(|_| format!("entry {} ({name}) has no valid header value", n + 1))?;
            headers.push((name, value));
        }
        Ok(Self(headers))
    }
}

impl fmt::Debug for OtlpHeaders {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OtlpHeaders({self})")
    }
}

impl fmt::Display for OtlpHeaders {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (name, _)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{name}=***")?;
        }
        Ok(())
    }
}

impl Serialize for OtlpHeaders {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for OtlpHeaders {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(D::Error::custom)
    }
}

/// `key=value` pairs separated by commas, keys trimmed, values trimmed and percent-decoded:
/// the W3C Baggage form that `OTEL_RESOURCE_ATTRIBUTES` and `OTEL_EXPORTER_OTLP_HEADERS` use.
/// Empty entries are skipped. Errors name the entry by position, never by its value.
fn key_values(s: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    for (n, entry) in s.split(',').enumerate() {
        if entry.trim().is_empty() {
            continue;
        }
        let Some((key, value)) = entry.split_once('=') else {
            return Err(format!("entry {} is not key=value", n + 1));
        };
        let key = key.trim();
        if key.is_empty() {
            return Err(format!("entry {} has an empty key", n + 1));
        }
        let value = percent_encoding::percent_decode_str(value.trim())
            .decode_utf8()
            .map_err(|_| format!("entry {} ({key}) is not UTF-8 once decoded", n + 1))?;
        out.push((key.to_owned(), value.into_owned()));
    }
    Ok(out)
}

/// The effective OpenTelemetry settings: what the exporters, the sampler and the resource are
/// built from. Resolved once by the loader; every field says where its value came from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OtelSettings {
    /// `OTEL_SDK_DISABLED`: when true, nothing is exported, whatever else is set.
    pub sdk_disabled: Sourced<bool>,
    /// Where spans are sent (the full URL, `/v1/traces` included); none: not exported.
    pub traces_endpoint: Sourced<Option<HttpUrl>>,
    /// Where metrics are sent (the full URL, `/v1/metrics` included); none: not exported.
    pub metrics_endpoint: Sourced<Option<HttpUrl>>,
    /// Sent with every export of either signal.
    pub headers: Sourced<OtlpHeaders>,
    /// The resource's `service.name`.
    pub service_name: Sourced<String>,
    /// The resource's other attributes (`OTEL_RESOURCE_ATTRIBUTES`), in order; the exporter
    /// adds `service.version` and, unless given here, `service.instance.id`.
    pub resource_attributes: Sourced<Vec<(String, String)>>,
    pub sampler: Sourced<SamplerKind>,
    /// The sampler's ratio, for the two ratio samplers.
    pub sampler_ratio: Sourced<Ratio>,
    /// How often metrics are exported.
    #[serde(with = "humantime_serde")]
    pub metrics_interval: Duration,
    pub metrics_interval_from: Source,
}

/// The default export interval: often enough that a dashboard over OTLP moves about as fast
/// as one over a 10 s Prometheus scrape (the SDK's own default is 60 s).
const DEFAULT_METRICS_INTERVAL: Duration = Duration::from_secs(10);

/// The `OTEL_*` variables the gateway honours, parsed (an empty value counts as unset, as
/// the OpenTelemetry specification says). Kept in the settings as they were given, and merged
/// with the `telemetry.*` keys whenever the effective settings are asked for, so that a key
/// changed after loading (tests and tools do) still wins.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OtelEnv {
    sdk_disabled: Option<bool>,
    traces_exporter: Option<bool>,
    metrics_exporter: Option<bool>,
    endpoint: Option<HttpUrl>,
    traces_endpoint: Option<HttpUrl>,
    metrics_endpoint: Option<HttpUrl>,
    headers: Option<OtlpHeaders>,
    service_name: Option<String>,
    resource_attributes: Option<Vec<(String, String)>>,
    sampler: Option<SamplerKind>,
    sampler_arg: Option<Ratio>,
    metric_export_interval: Option<Duration>,
}

impl OtelEnv {
    /// Parses the variables in `env`. Every variable is checked, even one that a tributary key
    /// overrides: a typo in a deployment's environment should not wait for the day the key is
    /// removed. All problems are returned, each naming its variable.
    pub(super) fn parse(env: &[(String, String)]) -> Result<Self, Vec<String>> {
        let mut problems = Vec::new();
        let mut get = |name: &'static str, parse: &dyn Fn(&str) -> Result<(), String>| {
            let value = env
                .iter()
                .rev()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.trim())
                .filter(|v| !v.is_empty())?;
            match parse(value) {
                Ok(()) => Some(value.to_owned()),
                Err(e) => {
                    problems.push(format!("{name}: {e}"));
                    None
                }
            }
        };
        let ok = |r: Result<(), String>| r;
        let sdk_disabled = get("OTEL_SDK_DISABLED", &|v| ok(bool_var(v).map(drop)));
        let traces_exporter = get("OTEL_TRACES_EXPORTER", &|v| ok(exporter_var(v).map(drop)));
        let metrics_exporter = get("OTEL_METRICS_EXPORTER", &|v| ok(exporter_var(v).map(drop)));
        let url = |v: &str| v.parse::<HttpUrl>().map(drop);
        let endpoint = get("OTEL_EXPORTER_OTLP_ENDPOINT", &url);
        let traces_endpoint = get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", &url);
        let metrics_endpoint = get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", &url);
        let headers = get("OTEL_EXPORTER_OTLP_HEADERS", &|v| {
            v.parse::<OtlpHeaders>().map(drop)
        });
        let service_name = get("OTEL_SERVICE_NAME", &|_| Ok(()));
        let resource_attributes = get("OTEL_RESOURCE_ATTRIBUTES", &|v| key_values(v).map(drop));
        let sampler = get("OTEL_TRACES_SAMPLER", &|v| sampler_var(v).map(drop));
        let sampler_arg = get("OTEL_TRACES_SAMPLER_ARG", &|v| ratio_var(v).map(drop));
        let interval = get("OTEL_METRIC_EXPORT_INTERVAL", &|v| millis_var(v).map(drop));
        // Only checked: an exporter configured for gRPC (port 4317) would fail every export,
        // so a protocol this build does not speak stops start-up instead.
        for var in [
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
        ] {
            get(var, &|v| match v {
                "http/protobuf" => Ok(()),
                _ => Err(format!(
                    "{v:?} is not spoken by this build; it exports http/protobuf only"
                )),
            });
        }
        if !problems.is_empty() {
            return Err(problems);
        }
        // Each value below parsed once already.
        Ok(Self {
            sdk_disabled: sdk_disabled.and_then(|v| bool_var(&v).ok()),
            traces_exporter: traces_exporter.and_then(|v| exporter_var(&v).ok()),
            metrics_exporter: metrics_exporter.and_then(|v| exporter_var(&v).ok()),
            endpoint: endpoint.and_then(|v| v.parse().ok()),
            traces_endpoint: traces_endpoint.and_then(|v| v.parse().ok()),
            metrics_endpoint: metrics_endpoint.and_then(|v| v.parse().ok()),
            headers: headers.and_then(|v| v.parse().ok()),
            service_name,
            resource_attributes: resource_attributes.and_then(|v| key_values(&v).ok()),
            sampler: sampler.and_then(|v| sampler_var(&v).ok()),
            sampler_arg: sampler_arg.and_then(|v| ratio_var(&v).ok()),
            metric_export_interval: interval.and_then(|v| millis_var(&v).ok()),
        })
    }
}

fn bool_var(v: &str) -> Result<bool, String> {
    match v.to_ascii_lowercase().as_str() {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err("must be true or false".to_owned()),
    }
}

/// `otlp` (export) or `none` (do not).
fn exporter_var(v: &str) -> Result<bool, String> {
    match v {
        "otlp" => Ok(true),
        "none" => Ok(false),
        _ => Err("must be otlp or none (the only exporters this build has)".to_owned()),
    }
}

fn sampler_var(v: &str) -> Result<SamplerKind, String> {
    SamplerKind::ALL
        .iter()
        .find(|(name, _)| *name == v)
        .map(|(_, kind)| *kind)
        .ok_or_else(|| {
            let names: Vec<&str> = SamplerKind::ALL.iter().map(|(n, _)| *n).collect();
            format!(
                "unknown sampler {v:?}; expected one of {}",
                names.join(", ")
            )
        })
}

fn ratio_var(v: &str) -> Result<Ratio, String> {
    v.parse::<f64>()
        .ok()
        .and_then(Ratio::new)
        .ok_or_else(|| "must be a number between 0 and 1".to_owned())
}

fn millis_var(v: &str) -> Result<Duration, String> {
    match v.parse::<u64>() {
        Ok(ms) if ms > 0 => Ok(Duration::from_millis(ms)),
        _ => Err("must be a whole number of milliseconds above 0".to_owned()),
    }
}

/// The effective settings: each value from its `telemetry.*` key when set, else from its
/// `OTEL_*` variable, else the default; the off-switches win over both.
pub(super) fn merge(telemetry: &TelemetrySettings, env: &OtelEnv) -> OtelSettings {
    let sdk_disabled = match env.sdk_disabled {
        Some(v) => Sourced::new(v, Source::Env("OTEL_SDK_DISABLED")),
        None => Sourced::new(false, Source::Default),
    };
    let endpoint = |signal_key: &'static str,
                    own_key: Option<&HttpUrl>,
                    exporter: (&'static str, Option<bool>),
                    signal_var: (&'static str, Option<&HttpUrl>),
                    path: &str|
     -> Sourced<Option<HttpUrl>> {
        if sdk_disabled.value {
            return Sourced::new(None, Source::Env("OTEL_SDK_DISABLED"));
        }
        if exporter.1 == Some(false) {
            return Sourced::new(None, Source::Env(exporter.0));
        }
        if let Some(url) = own_key {
            return Sourced::new(Some(url.clone()), Source::Key(signal_key));
        }
        if let Some(base) = &telemetry.otlp_endpoint {
            return Sourced::new(Some(append_path(base, path)), Source::Key("otlp_endpoint"));
        }
        if let Some(url) = signal_var.1 {
            return Sourced::new(Some(url.clone()), Source::Env(signal_var.0));
        }
        if let Some(base) = &env.endpoint {
            return Sourced::new(
                Some(append_path(base, path)),
                Source::Env("OTEL_EXPORTER_OTLP_ENDPOINT"),
            );
        }
        Sourced::new(None, Source::Default)
    };
    let traces_endpoint = endpoint(
        "otlp_traces_endpoint",
        telemetry.otlp_traces_endpoint.as_ref(),
        ("OTEL_TRACES_EXPORTER", env.traces_exporter),
        (
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            env.traces_endpoint.as_ref(),
        ),
        "v1/traces",
    );
    let metrics_endpoint = endpoint(
        "otlp_metrics_endpoint",
        telemetry.otlp_metrics_endpoint.as_ref(),
        ("OTEL_METRICS_EXPORTER", env.metrics_exporter),
        (
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
            env.metrics_endpoint.as_ref(),
        ),
        "v1/metrics",
    );

    let headers = match (&telemetry.otlp_headers, &env.headers) {
        (Some(h), _) => Sourced::new(h.clone(), Source::Key("otlp_headers")),
        (None, Some(h)) => Sourced::new(h.clone(), Source::Env("OTEL_EXPORTER_OTLP_HEADERS")),
        (None, None) => Sourced::new(OtlpHeaders::default(), Source::Default),
    };

    let mut attributes = match &env.resource_attributes {
        Some(a) => Sourced::new(a.clone(), Source::Env("OTEL_RESOURCE_ATTRIBUTES")),
        None => Sourced::new(Vec::new(), Source::Default),
    };
    // `service.name` has a field of its own; as the specification says, `OTEL_SERVICE_NAME`
    // wins over a `service.name` in the attributes.
    let named_in_attributes = attributes
        .value
        .iter()
        .rev()
        .find(|(k, _)| k == "service.name")
        .map(|(_, v)| v.clone());
    attributes.value.retain(|(k, _)| k != "service.name");
    let service_name = match (&telemetry.service_name, &env.service_name) {
        (Some(name), _) => Sourced::new(name.clone(), Source::Key("service_name")),
        (None, Some(name)) => Sourced::new(name.clone(), Source::Env("OTEL_SERVICE_NAME")),
        (None, None) => match named_in_attributes {
            Some(name) => Sourced::new(name, Source::Env("OTEL_RESOURCE_ATTRIBUTES")),
            None => Sourced::new("tributary".to_owned(), Source::Default),
        },
    };

    let sampler_ratio = match (telemetry.sampling_ratio, env.sampler_arg) {
        (Some(ratio), _) => Sourced::new(ratio, Source::Key("sampling_ratio")),
        (None, Some(ratio)) => Sourced::new(ratio, Source::Env("OTEL_TRACES_SAMPLER_ARG")),
        (None, None) => Sourced::new(Ratio::of(1.0), Source::Default),
    };
    let sampler = match (telemetry.sampler, env.sampler) {
        (Some(kind), _) => Sourced::new(kind, Source::Key("sampler")),
        (None, Some(kind)) => Sourced::new(kind, Source::Env("OTEL_TRACES_SAMPLER")),
        // `sampling_ratio` alone keeps the meaning it always had: a share of root traces,
        // the caller's decision honoured.
        (None, None) if telemetry.sampling_ratio.is_some() => Sourced::new(
            SamplerKind::ParentbasedTraceidratio,
            Source::Key("sampling_ratio"),
        ),
        (None, None) => Sourced::new(SamplerKind::ParentbasedAlwaysOn, Source::Default),
    };

    let (metrics_interval, metrics_interval_from) =
        match (telemetry.otlp_metrics_interval, env.metric_export_interval) {
            (Some(d), _) => (d, Source::Key("otlp_metrics_interval")),
            (None, Some(d)) => (d, Source::Env("OTEL_METRIC_EXPORT_INTERVAL")),
            (None, None) => (DEFAULT_METRICS_INTERVAL, Source::Default),
        };

    OtelSettings {
        sdk_disabled,
        traces_endpoint,
        metrics_endpoint,
        headers,
        service_name,
        resource_attributes: attributes,
        sampler,
        sampler_ratio,
        metrics_interval,
        metrics_interval_from,
    }
}

/// The signal's URL under a base endpoint, as the OTLP specification builds it from
/// `OTEL_EXPORTER_OTLP_ENDPOINT`: the path is appended to the base's own path
/// (`http://collector:4318` → `http://collector:4318/v1/traces`, `https://host/otlp/` →
/// `https://host/otlp/v1/traces`). A base that already ends with the signal's path is kept
/// as it is, which is what `telemetry.otlp_endpoint` always accepted.
fn append_path(base: &HttpUrl, path: &str) -> HttpUrl {
    let whole = base.as_str();
    let (head, query) = match whole.split_once('?') {
        Some((h, q)) => (h, Some(q)),
        None => (whole, None),
    };
    let head = head.trim_end_matches('/');
    let mut url = if head.ends_with(&format!("/{path}")) {
        head.to_owned()
    } else {
        format!("{head}/{path}")
    };
    if let Some(q) = query {
        url.push('?');
        url.push_str(q);
    }
    // The base parsed, and a path appended to it keeps it an http(s) URL with a host.
    url.parse().unwrap_or_else(|_| base.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn resolved(t: &TelemetrySettings, pairs: &[(&str, &str)]) -> OtelSettings {
        merge(t, &OtelEnv::parse(&env(pairs)).expect("parses"))
    }

    #[test]
    fn nothing_set_exports_nothing_and_samples_every_root_trace() {
        let o = resolved(&TelemetrySettings::default(), &[]);
        assert_eq!(o.traces_endpoint, Sourced::new(None, Source::Default));
        assert_eq!(o.metrics_endpoint.value, None);
        assert_eq!(o.service_name.value, "tributary");
        assert_eq!(o.sampler.value, SamplerKind::ParentbasedAlwaysOn);
        assert_eq!(o.metrics_interval, Duration::from_secs(10));
    }

    #[test]
    fn the_generic_endpoint_gets_the_signal_path_and_the_signal_endpoints_are_used_as_is() {
        let o = resolved(
            &TelemetrySettings::default(),
            &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")],
        );
        assert_eq!(
            o.traces_endpoint.value.unwrap().as_str(),
            "http://collector:4318/v1/traces"
        );
        assert_eq!(
            o.metrics_endpoint.value.unwrap().as_str(),
            "http://collector:4318/v1/metrics"
        );
        assert_eq!(
            o.metrics_endpoint.from,
            Source::Env("OTEL_EXPORTER_OTLP_ENDPOINT")
        );

        let o = resolved(
            &TelemetrySettings::default(),
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://host/otlp/"),
                ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "http://m:9/custom"),
            ],
        );
        assert_eq!(
            o.traces_endpoint.value.unwrap().as_str(),
            "https://host/otlp/v1/traces"
        );
        assert_eq!(
            o.metrics_endpoint.value.unwrap().as_str(),
            "http://m:9/custom"
        );
        assert_eq!(
            o.metrics_endpoint.from,
            Source::Env("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
        );
    }

    #[test]
    fn tributary_keys_win_over_the_otel_environment() {
        let t = TelemetrySettings {
            otlp_endpoint: Some("http://ours:4318".parse().unwrap()),
            service_name: Some("gateway".into()),
            sampler: Some(SamplerKind::AlwaysOn),
            sampling_ratio: Some(Ratio::of(0.5)),
            otlp_metrics_interval: Some(Duration::from_secs(3)),
            ..TelemetrySettings::default()
        };
        let o = resolved(
            &t,
            &[
                (
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                    "http://theirs:4318/v1/traces",
                ),
                ("OTEL_SERVICE_NAME", "theirs"),
                ("OTEL_TRACES_SAMPLER", "always_off"),
                ("OTEL_TRACES_SAMPLER_ARG", "0.1"),
                ("OTEL_METRIC_EXPORT_INTERVAL", "60000"),
            ],
        );
        assert_eq!(
            o.traces_endpoint.value.unwrap().as_str(),
            "http://ours:4318/v1/traces"
        );
        assert_eq!(o.traces_endpoint.from, Source::Key("otlp_endpoint"));
        assert_eq!(
            o.service_name,
            Sourced::new("gateway".into(), Source::Key("service_name"))
        );
        assert_eq!(o.sampler.value, SamplerKind::AlwaysOn);
        assert_eq!(o.sampler_ratio.value, Ratio::of(0.5));
        assert_eq!(o.metrics_interval, Duration::from_secs(3));
    }

    #[test]
    fn the_otel_environment_applies_when_no_key_is_set() {
        let o = resolved(
            &TelemetrySettings::default(),
            &[
                ("OTEL_SERVICE_NAME", "checkout-bff"),
                (
                    "OTEL_RESOURCE_ATTRIBUTES",
                    "service.name=ignored, deployment.environment.name=prod,team=a%2Cb",
                ),
                ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
                ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
                ("OTEL_METRIC_EXPORT_INTERVAL", "1500"),
                ("OTEL_EXPORTER_OTLP_HEADERS", "api-key=s3cr%3Dt,x-tenant=7"),
            ],
        );
        assert_eq!(o.service_name.value, "checkout-bff");
        assert_eq!(
            o.resource_attributes.value,
            [
                ("deployment.environment.name".to_owned(), "prod".to_owned()),
                ("team".to_owned(), "a,b".to_owned()),
            ]
        );
        assert_eq!(o.sampler.value, SamplerKind::ParentbasedTraceidratio);
        assert_eq!(o.sampler_ratio.value, Ratio::of(0.25));
        assert_eq!(o.metrics_interval, Duration::from_millis(1500));
        let headers: Vec<(String, String)> = o
            .headers
            .value
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_str().unwrap().to_owned()))
            .collect();
        assert_eq!(
            headers,
            [
                ("api-key".into(), "s3cr=t".into()),
                ("x-tenant".into(), "7".into())
            ]
        );
        let shown = serde_json::to_string(&o).unwrap();
        assert!(!shown.contains("s3cr"), "{shown}");
        assert!(shown.contains("api-key=***"), "{shown}");
    }

    #[test]
    fn a_service_name_in_the_attributes_is_used_when_nothing_else_names_one() {
        let o = resolved(
            &TelemetrySettings::default(),
            &[("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attrs")],
        );
        assert_eq!(o.service_name.value, "from-attrs");
        assert!(o.resource_attributes.value.is_empty());
    }

    #[test]
    fn sdk_disabled_wins_over_every_endpoint() {
        let t = TelemetrySettings {
            otlp_traces_endpoint: Some("http://ours:4318/v1/traces".parse().unwrap()),
            ..TelemetrySettings::default()
        };
        let o = resolved(
            &t,
            &[
                ("OTEL_SDK_DISABLED", "TRUE"),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"),
            ],
        );
        assert_eq!(
            o.traces_endpoint,
            Sourced::new(None, Source::Env("OTEL_SDK_DISABLED"))
        );
        assert_eq!(o.metrics_endpoint.value, None);

        let o = resolved(
            &t,
            &[
                ("OTEL_METRICS_EXPORTER", "none"),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"),
            ],
        );
        assert!(o.traces_endpoint.value.is_some());
        assert_eq!(
            o.metrics_endpoint,
            Sourced::new(None, Source::Env("OTEL_METRICS_EXPORTER"))
        );
    }

    #[test]
    fn empty_variables_count_as_unset() {
        let o = resolved(
            &TelemetrySettings::default(),
            &[
                ("OTEL_SDK_DISABLED", ""),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", " "),
            ],
        );
        assert!(!o.sdk_disabled.value);
        assert_eq!(o.traces_endpoint.value, None);
    }

    #[test]
    fn every_invalid_variable_is_named_and_no_header_value_is_repeated() {
        let problems = OtelEnv::parse(&env(&[
            ("OTEL_SDK_DISABLED", "yes"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318"),
            ("OTEL_TRACES_SAMPLER", "sometimes"),
            ("OTEL_TRACES_SAMPLER_ARG", "1.5"),
            ("OTEL_METRIC_EXPORT_INTERVAL", "10s"),
            ("OTEL_RESOURCE_ATTRIBUTES", "a=1,broken"),
            (
                "OTEL_EXPORTER_OTLP_HEADERS",
                "authorization=Bearer\nhunter2",
            ),
            ("OTEL_METRICS_EXPORTER", "prometheus"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ]))
        .unwrap_err();
        let all = problems.join("; ");
        for var in [
            "OTEL_SDK_DISABLED:",
            "OTEL_EXPORTER_OTLP_ENDPOINT:",
            "OTEL_TRACES_SAMPLER: unknown sampler \"sometimes\"",
            "OTEL_TRACES_SAMPLER_ARG:",
            "OTEL_METRIC_EXPORT_INTERVAL:",
            "OTEL_RESOURCE_ATTRIBUTES: entry 2 is not key=value",
            "OTEL_EXPORTER_OTLP_HEADERS: entry 1 (authorization)",
            "OTEL_METRICS_EXPORTER:",
            "OTEL_EXPORTER_OTLP_PROTOCOL: \"grpc\" is not spoken by this build",
        ] {
            assert!(all.contains(var), "{var} missing from: {all}");
        }
        assert!(!all.contains("hunter2"), "{all}");
        assert_eq!(problems.len(), 9, "{all}");
    }
}
