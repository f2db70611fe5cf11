//! The loader and the types, from the outside: what a file and an environment turn into, and
//! what they are refused with.

use std::path::Path;

use super::*;

fn load(env: &[(&str, &str)]) -> Result<Settings, ConfigError> {
    Settings::load(&Sources {
        file: None,
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    })
}

fn problems(env: &[(&str, &str)]) -> String {
    load(env).expect_err("invalid settings").to_string()
}

#[test]
fn defaults_are_valid() {
    let s = load(&[]).expect("defaults must validate");
    assert_eq!(s.database.acquire_timeout, Duration::from_secs(2));
    assert_eq!(s.admission.max_in_flight.get(), 2000);
    assert_eq!(s.admission.max_wait, Duration::from_millis(100));
}

#[test]
fn the_shipped_default_file_matches_the_built_in_defaults() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/default.toml");
    let from_file = Settings::load(&Sources {
        file: Some(path),
        env: vec![],
    })
    .expect("config/default.toml must load");
    assert_eq!(
        from_file,
        Settings::default(),
        "config/default.toml drifted from the Default impls"
    );
}

#[test]
fn environment_overrides_nested_keys() {
    let s = load(&[
        ("TRIBUTARY_DOWNSTREAMS__CARTS__TIMEOUT", "250ms"),
        ("TRIBUTARY_DATABASE__MAX_CONNECTIONS", "7"),
        ("TRIBUTARY_ADMISSION__MODE", "gradient2"),
        ("TRIBUTARY_ADMISSION__GROUPS__ORDERS__MAX_IN_FLIGHT", "50"),
        ("DATABASE_URL", "postgres://app@db:5432/app"),
        ("RUST_LOG", "warn,tributary=debug"),
        ("TRIBUTARY_CONFIG", "ignored.toml"),
        ("TRIBUTARY_GIT_REVISION", "abc123"),
    ])
    .unwrap();
    assert_eq!(s.downstreams.carts.timeout, Duration::from_millis(250));
    assert_eq!(s.database.max_connections.get(), 7);
    assert_eq!(s.admission.mode, AdmissionMode::Gradient2);
    assert_eq!(s.database.url.expose(), "postgres://app@db:5432/app");
    assert_eq!(s.telemetry.log_level, "warn,tributary=debug");
    assert_eq!(s.admission_for(RouteGroup::Orders).0.get(), 50);
}

#[test]
fn unknown_keys_are_rejected_with_their_path() {
    let err = problems(&[("TRIBUTARY_DATABASE__MAX_CONECTIONS", "7")]);
    assert!(
        err.contains("TRIBUTARY_DATABASE__MAX_CONECTIONS names no setting")
            && err.contains("did you mean TRIBUTARY_DATABASE__MAX_CONNECTIONS?"),
        "{err}"
    );
}

#[test]
fn a_variable_with_a_single_underscore_between_levels_names_the_key_it_missed() {
    let err = problems(&[("TRIBUTARY_DATABASE_URL", "postgres://app@db/app")]);
    assert!(
        err.contains(
            "TRIBUTARY_DATABASE_URL names no setting; did you mean TRIBUTARY_DATABASE__URL?"
        ),
        "{err}"
    );
    assert!(!err.contains("app@db"), "the value is not repeated: {err}");
    let err = problems(&[("TRIBUTARY_ADMISSION__GROUPS__ORDER__MAX_WAIT", "5ms")]);
    assert!(
        err.contains("did you mean TRIBUTARY_ADMISSION__GROUPS__ORDERS__MAX_WAIT?"),
        "{err}"
    );
}

#[test]
fn values_that_break_their_type_are_all_reported_with_their_path() {
    let err = problems(&[
        ("TRIBUTARY_DOWNSTREAMS__USERS__TIMEOUT", "0s"),
        ("TRIBUTARY_DOWNSTREAMS__CARTS__BASE_URL", "not a url"),
        ("TRIBUTARY_DOWNSTREAMS__PROMOTIONS__MAX_CONCURRENCY", "0"),
        ("TRIBUTARY_ADMISSION__UNREADY_SHED_RATIO", "1.5"),
        ("DATABASE_URL", "mysql://nope"),
    ]);
    for needle in [
        "downstreams.users.timeout: must be greater than zero",
        "downstreams.carts.base_url: not a valid URL",
        "downstreams.promotions.max_concurrency: invalid value unsigned int `0`, expected a nonzero",
        "admission.unready_shed_ratio: must be between 0 and 1, got 1.5",
        "database.url: not a Postgres URL",
    ] {
        assert!(err.contains(needle), "missing {needle:?} in {err}");
    }
    // A route group that does not exist names no key, and the other problems still show.
    let err = problems(&[
        ("TRIBUTARY_ADMISSION__GROUPS__CHECKOUT__MAX_IN_FLIGHT", "5"),
        ("TRIBUTARY_SERVER__MAX_BODY_BYTES", "0"),
    ]);
    assert!(err.contains("names no setting"), "{err}");
    assert!(
        err.contains("server.max_body_bytes: invalid value"),
        "{err}"
    );
}

#[test]
fn a_value_that_does_not_parse_and_a_rule_between_two_keys_are_reported_together() {
    let err = problems(&[
        ("TRIBUTARY_DATABASE__MIN_CONNECTIONS", "50"),
        ("TRIBUTARY_SERVER__REQUEST_DEADLINE", "0s"),
    ]);
    assert_eq!(
        err,
        "invalid configuration: server.request_deadline: must be greater than zero; \
         database.min_connections (50) is greater than database.max_connections (20)"
    );
}

#[test]
fn an_unset_pool_minimum_is_the_maximum_so_a_smaller_maximum_alone_is_valid() {
    assert_eq!(load(&[]).unwrap().database.min_connections(), 20);
    let s = load(&[("TRIBUTARY_DATABASE__MAX_CONNECTIONS", "8")]).unwrap();
    assert_eq!(s.database.min_connections(), 8, "a fixed-size pool of 8");
    let s = load(&[("TRIBUTARY_DATABASE__MIN_CONNECTIONS", "2")]).unwrap();
    assert_eq!(s.database.min_connections(), 2);
}

#[test]
fn min_above_max_and_crossed_ratios_are_reported() {
    let err = problems(&[
        ("TRIBUTARY_DATABASE__MIN_CONNECTIONS", "30"),
        ("TRIBUTARY_DATABASE__MAX_CONNECTIONS", "10"),
        ("TRIBUTARY_ADMISSION__READY_SHED_RATIO", "0.6"),
        ("TRIBUTARY_ADMISSION__ADAPTIVE__MIN_LIMIT", "300"),
    ]);
    for needle in [
        "database.min_connections (30) is greater than database.max_connections (10)",
        "admission.ready_shed_ratio must not exceed admission.unready_shed_ratio",
        "admission.adaptive needs min_limit <= initial_limit <= max_limit, got 300 / 200 / 5000",
    ] {
        assert!(err.contains(needle), "missing {needle:?} in {err}");
    }
}

#[test]
fn probing_past_the_core_without_checked_cuts_is_rejected_not_ignored() {
    let err = problems(&[
        ("TRIBUTARY_OVERLOAD__CHECK_CORE_CUTS", "false"),
        ("TRIBUTARY_OVERLOAD__PROBE_PAST_CORE", "true"),
    ]);
    assert_eq!(
        err,
        "invalid configuration: overload.probe_past_core needs overload.check_core_cuts = true \
         (it acts only while a checked cut leaves the core's queue out)"
    );
}

#[test]
fn inconsistent_rate_limit_settings_are_all_reported() {
    let err = problems(&[
        ("TRIBUTARY_RATE_LIMIT__ENABLED", "true"),
        ("TRIBUTARY_RATE_LIMIT__BURST", "0"),
        ("TRIBUTARY_RATE_LIMIT__REDIS_TIMEOUT", "0ms"),
        ("TRIBUTARY_RATE_LIMIT__REDIS_POOL_SIZE", "0"),
        ("TRIBUTARY_RATE_LIMIT__API_KEY_HEADER", "x api key"),
        ("TRIBUTARY_RATE_LIMIT__REDIS_URL", "http://cache:6379"),
        ("TRIBUTARY_RATE_LIMIT__TRUSTED_PROXIES", "[\"10.0.0.0/33\"]"),
    ]);
    for needle in [
        "rate_limit.burst: invalid value unsigned int `0`, expected a nonzero u32",
        "rate_limit.redis_timeout: must be greater than zero",
        "rate_limit.redis_pool_size: invalid value unsigned int `0`",
        "rate_limit.api_key_header: \"x api key\" is not a valid header name",
        "rate_limit.redis_url: must start with redis://",
        "rate_limit.trusted_proxies.0: \"10.0.0.0/33\" is not an IP address or CIDR",
    ] {
        assert!(err.contains(needle), "missing {needle:?} in {err}");
    }
}

#[test]
fn a_retry_budget_tower_would_panic_on_is_a_configuration_error() {
    for (key, value) in [
        ("TRIBUTARY_RETRY__BUDGET_RATIO", "-0.5"),
        ("TRIBUTARY_RETRY__BUDGET_RATIO", "2000"),
        ("TRIBUTARY_RETRY__BUDGET_MIN_PER_SEC", "4294967295"),
    ] {
        let err = problems(&[(key, value)]);
        assert!(err.contains("retry.budget_"), "{key}={value}: {err}");
    }
}

#[test]
fn secrets_and_url_passwords_never_print() {
    let s = load(&[
        ("DATABASE_URL", "postgres://app:hunter1@db:5432/app"),
        (
            "TRIBUTARY_RATE_LIMIT__REDIS_URL",
            "redis://:hunter2@cache:6379",
        ),
        (
            "TRIBUTARY_TELEMETRY__OTLP_ENDPOINT",
            "https://otel:hunter3@collector:4318",
        ),
        (
            "TRIBUTARY_DOWNSTREAMS__USERS__BASE_URL",
            "http://svc:hunter4@users:8080",
        ),
    ])
    .unwrap();
    let shown = serde_json::to_string(&s).unwrap();
    let debug = format!("{s:?}");
    for password in ["hunter1", "hunter2", "hunter3", "hunter4"] {
        assert!(!shown.contains(password), "{password} in {shown}");
        assert!(!debug.contains(password), "{password} in {debug}");
    }
    assert!(shown.contains("http://svc:***@users:8080/"), "{shown}");
    assert_eq!(
        s.downstreams.users.base_url.as_str(),
        "http://svc:hunter4@users:8080/"
    );
}

#[test]
fn rejected_values_with_credentials_are_not_repeated_in_the_error() {
    let err = problems(&[
        ("DATABASE_URL", "mysql://app:hunter1@db/app"),
        (
            "TRIBUTARY_RATE_LIMIT__REDIS_URL",
            "http://:hunter2@cache:6379",
        ),
        (
            "TRIBUTARY_TELEMETRY__OTLP_ENDPOINT",
            "grpc://otel:hunter3@collector:4317",
        ),
        (
            "TRIBUTARY_DOWNSTREAMS__USERS__BASE_URL",
            "ftp://svc:hunter4@users",
        ),
    ]);
    assert!(err.matches(": ").count() >= 4, "{err}");
    for password in ["hunter1", "hunter2", "hunter3", "hunter4"] {
        assert!(!err.contains(password), "{password} in {err}");
    }
}

#[test]
fn the_downstream_keys_are_the_service_names() {
    let mut s = Settings::default();
    for service in Service::ALL {
        s.downstreams.get_mut(service).timeout = Duration::from_millis(service as u64 + 1);
    }
    let json = serde_json::to_value(&s.downstreams).unwrap();
    let mut keys: Vec<&str> = json
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    let mut names = Service::ALL.map(Service::as_str);
    names.sort_unstable();
    assert_eq!(keys, names);
    for service in Service::ALL {
        assert_eq!(
            json[service.as_str()]["timeout"],
            format!("{}ms", service as u64 + 1)
        );
    }
}

#[test]
fn group_overrides_fall_back_to_the_global_admission_values() {
    let s = load(&[("TRIBUTARY_ADMISSION__GROUPS__ORDERS__MAX_IN_FLIGHT", "50")]).unwrap();
    assert_eq!(s.admission_for(RouteGroup::Orders).0.get(), 50);
    assert_eq!(s.admission_for(RouteGroup::Dashboard).0.get(), 2000);
    assert_eq!(
        s.admission_for(RouteGroup::Orders).1,
        Duration::from_millis(100)
    );
}

#[test]
fn a_downstream_cache_is_off_by_default_and_set_up_by_its_keys() {
    let s = load(&[]).unwrap();
    assert!(
        Service::ALL
            .iter()
            .all(|d| s.downstreams.get(*d).cache.is_none())
    );
    assert!(!s.server.admin);
    let s = load(&[
        ("TRIBUTARY_DOWNSTREAMS__PROMOTIONS__CACHE__KEY", "shared"),
        ("TRIBUTARY_DOWNSTREAMS__PROMOTIONS__CACHE__TTL", "5s"),
        (
            "TRIBUTARY_DOWNSTREAMS__PROMOTIONS__CACHE__STALE_IF_ERROR",
            "1m",
        ),
        ("TRIBUTARY_DOWNSTREAMS__CARTS__CACHE__MAX_BYTES", "65536"),
        ("TRIBUTARY_SERVER__ADMIN", "true"),
    ])
    .unwrap();
    let promotions = s.downstreams.promotions.cache.as_ref().unwrap();
    assert_eq!(promotions.key, CacheKey::Shared);
    assert_eq!(promotions.ttl, Duration::from_secs(5));
    assert_eq!(promotions.stale_if_error, Duration::from_secs(60));
    assert!(promotions.honour_cache_control);
    let carts = s.downstreams.carts.cache.as_ref().unwrap();
    assert_eq!(
        carts.key,
        CacheKey::PerUser,
        "per_user unless told otherwise"
    );
    assert_eq!(carts.max_bytes.get(), 65536);
    assert!(s.server.admin);
}

#[test]
fn bad_cache_settings_are_reported_with_their_path() {
    let err = problems(&[
        ("TRIBUTARY_DOWNSTREAMS__PROMOTIONS__CACHE__KEY", "everyone"),
        ("TRIBUTARY_DOWNSTREAMS__CARTS__CACHE__TTL", "0s"),
        (
            "TRIBUTARY_DOWNSTREAMS__NOTIFICATIONS__CACHE__MAX_BYTES",
            "0",
        ),
        ("TRIBUTARY_DOWNSTREAMS__USERS__CACHE__KEY", "shared"),
        ("TRIBUTARY_DOWNSTREAMS__RECOMMENDATIONS__CACHE__TTLL", "1s"),
    ]);
    for needle in [
        "downstreams.promotions.cache.key: unknown variant: found `everyone`",
        "downstreams.carts.cache.ttl: must be greater than zero",
        "downstreams.notifications.cache.max_bytes: invalid value",
        "downstreams.users.cache.key must be \"per_user\"",
        "did you mean TRIBUTARY_DOWNSTREAMS__RECOMMENDATIONS__CACHE__TTL?",
    ] {
        assert!(err.contains(needle), "missing {needle:?} in {err}");
    }
}

#[test]
fn the_hyper_transport_refuses_an_https_downstream_and_names_it() {
    let err = problems(&[
        ("TRIBUTARY_HTTP_CLIENT__TRANSPORT", "hyper"),
        (
            "TRIBUTARY_DOWNSTREAMS__CARTS__BASE_URL",
            "https://carts.internal",
        ),
    ]);
    assert_eq!(
        err,
        "invalid configuration: downstreams.carts.base_url is https://, which \
         http_client.transport = \"hyper\" does not speak (no TLS): use \"reqwest\""
    );
    // The same downstream through reqwest is fine; an unknown transport is not.
    let settings = load(&[(
        "TRIBUTARY_DOWNSTREAMS__CARTS__BASE_URL",
        "https://carts.internal",
    )]);
    assert!(settings.is_ok(), "{settings:?}");
    let err = problems(&[("TRIBUTARY_HTTP_CLIENT__TRANSPORT", "curl")]);
    assert!(
        err.contains("http_client.transport: unknown variant: found `curl`"),
        "{err}"
    );
}
