//! The `tributary` binary's own command line, run as a process: what `--version` and
//! `check-config` print, and how a bad environment stops it before anything starts.

use std::process::{Command, Output};

/// Runs `tributary <args>` in the repository root (where `config/default.toml` is) with only
/// `env` in its environment.
fn tributary(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tributary"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_clear()
        .envs(env.iter().copied())
        .output()
        .expect("the tributary binary runs")
}

/// The revision this test was compiled with: the same `TRIBUTARY_GIT_REVISION` cargo gave the
/// binary (CI's container check builds the image with a real one and reads it back).
fn build_revision() -> &'static str {
    option_env!("TRIBUTARY_GIT_REVISION")
        .filter(|r| !r.is_empty())
        .unwrap_or("unknown")
}

#[test]
fn version_names_the_package_version_and_the_git_revision() {
    let out = Command::new(env!("CARGO_BIN_EXE_tributary"))
        .arg("--version")
        .output()
        .expect("run tributary --version");

    assert!(out.status.success(), "exit status {}", out.status);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!(
            "tributary {} (revision {})\n",
            env!("CARGO_PKG_VERSION"),
            build_revision()
        )
    );
}

#[test]
fn check_config_masks_every_secret_and_every_url_password() {
    let out = tributary(
        &["check-config"],
        &[
            ("DATABASE_URL", "postgres://app:pw-database@db:5432/app"),
            (
                "TRIBUTARY_RATE_LIMIT__REDIS_URL",
                "redis://:pw-redis@cache:6379",
            ),
            (
                "TRIBUTARY_TELEMETRY__OTLP_ENDPOINT",
                "https://otel:pw-otlp@collector:4318",
            ),
            (
                "TRIBUTARY_DOWNSTREAMS__CARTS__BASE_URL",
                "http://gateway:pw-carts@carts:8080",
            ),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    for password in ["pw-database", "pw-redis", "pw-otlp", "pw-carts"] {
        assert!(!stdout.contains(password), "{password} printed:\n{stdout}");
    }
    let shown: serde_json::Value = serde_json::from_str(&stdout).expect("check-config prints JSON");
    assert_eq!(shown["database"]["url"], "***");
    assert_eq!(shown["rate_limit"]["redis_url"], "***");
    assert_eq!(
        shown["telemetry"]["otlp_endpoint"],
        "https://otel:***@collector:4318/"
    );
    assert_eq!(
        shown["downstreams"]["carts"]["base_url"],
        "http://gateway:***@carts:8080/"
    );
}

#[test]
fn check_config_shows_where_each_opentelemetry_value_came_from_and_masks_the_headers() {
    let out = tributary(
        &["check-config"],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"),
            ("OTEL_EXPORTER_OTLP_HEADERS", "api-key=pw-header"),
            ("OTEL_SERVICE_NAME", "from-env"),
            ("TRIBUTARY_TELEMETRY__SERVICE_NAME", "from-key"),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        !stdout.contains("pw-header"),
        "a header value printed:\n{stdout}"
    );
    let shown: serde_json::Value = serde_json::from_str(&stdout).expect("check-config prints JSON");
    let otel = &shown["opentelemetry"];
    assert_eq!(
        otel["service_name"],
        serde_json::json!({"value": "from-key", "from": "telemetry.service_name"}),
        "the tributary key wins"
    );
    assert_eq!(
        otel["traces_endpoint"],
        serde_json::json!({
            "value": "http://collector:4318/v1/traces",
            "from": "env OTEL_EXPORTER_OTLP_ENDPOINT"
        })
    );
    assert_eq!(
        otel["metrics_endpoint"]["value"],
        "http://collector:4318/v1/metrics"
    );
    assert_eq!(otel["headers"]["value"], "api-key=***");
    assert_eq!(otel["sampler"]["from"], "default");
}

#[test]
fn an_invalid_otel_variable_stops_start_up_with_one_line_naming_it() {
    let out = tributary(&["check-config"], &[("OTEL_TRACES_SAMPLER", "sometimes")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        stderr.contains("OTEL_TRACES_SAMPLER: unknown sampler \"sometimes\""),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
}

#[test]
fn a_variable_that_names_no_setting_stops_start_up_with_the_closest_key() {
    let out = tributary(
        &["check-config"],
        &[("TRIBUTARY_DATABASE_URL", "postgres://app:pw@db/app")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        stderr.contains(
            "TRIBUTARY_DATABASE_URL names no setting; did you mean TRIBUTARY_DATABASE__URL?"
        ),
        "{stderr}"
    );
    assert!(
        !stderr.contains("pw"),
        "the value is not repeated: {stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
}

#[test]
fn capacity_refuses_bad_numbers_with_one_line_and_exit_2_never_a_panic() {
    for bad in [
        &[
            "--target-rps",
            "100",
            "--latency-ms",
            "100",
            "--db-latency-ms=-1",
        ][..],
        &["--target-rps", "100", "--latency-ms", "1e30"],
        &[
            "--target-rps",
            "100",
            "--latency-ms",
            "100",
            "--replicas",
            "0",
        ],
        &[
            "--target-rps",
            "100",
            "--latency-ms",
            "100",
            "--db-queries-per-request=-2",
        ],
        &["--target-rps", "NaN", "--latency-ms", "100"],
        &[
            "--target-rps",
            "100",
            "--latency-ms",
            "100",
            "--headroom",
            "0.5",
        ],
    ] {
        let out = tributary(&[&["capacity"][..], bad].concat(), &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{bad:?}: {stderr}");
        assert!(stderr.contains("invalid value"), "{bad:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{bad:?}: nothing on stdout");
    }
}

#[test]
fn capacity_runs_despite_an_unrelated_bad_setting_and_takes_the_pool_budget_from_the_settings() {
    let out = tributary(
        &["capacity", "--target-rps", "1000", "--latency-ms", "100"],
        &[
            ("TRIBUTARY_SERVER__LISTEN", "not an address"),
            ("TRIBUTARY_DATABASE__SERVER_MAX_CONNECTIONS", "300"),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("built-in defaults"), "{stderr}");
    assert!(
        stdout.contains("admission limit     = ceil(100.0 × 1.5) = 150"),
        "{stdout}"
    );

    let out = tributary(
        &["capacity", "--target-rps", "1000", "--latency-ms", "100"],
        &[("TRIBUTARY_DATABASE__SERVER_MAX_CONNECTIONS", "300")],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("fleet ceiling       = (300 − 10) / 1 = 290 per replica"),
        "the server's max_connections comes from the settings: {stdout}"
    );
}

/// The commit this checkout is at, when it is a git checkout.
fn git_head() -> Option<String> {
    let out = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

#[test]
fn a_build_in_a_git_checkout_names_its_commit_without_being_told() {
    // A build told its revision (the Dockerfile's) reports that one; the test above checks it.
    let told = std::env::var("TRIBUTARY_GIT_REVISION").is_ok_and(|r| !r.is_empty());
    let Some(head) = git_head().filter(|_| !told) else {
        return;
    };

    let out = tributary(&["--version"], &[]);

    let version = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        version,
        format!(
            "tributary {} (revision {head})\n",
            env!("CARGO_PKG_VERSION")
        )
    );
}

/// `tributary <args>` against the database `url` (its logs on stdout, as JSON lines).
fn against_database(args: &[&str], url: &str) -> Output {
    tributary(
        args,
        &[
            ("DATABASE_URL", url),
            ("TRIBUTARY_SERVER__LISTEN", "127.0.0.1:0"),
            ("TRIBUTARY_SERVER__OPS_LISTEN", "127.0.0.1:0"),
        ],
    )
}

#[tokio::test]
async fn a_database_that_does_not_exist_stops_migrate_and_serve_at_once_with_how_to_create_it() {
    let server = crate::helpers::server_url();
    let (prefix, _) = server.rsplit_once('/').unwrap();
    let name = format!("tributary_test_missing_{}", uuid::Uuid::new_v4().simple());
    let url = format!("{prefix}/{name}");

    for command in ["migrate", "serve"] {
        let out = tokio::task::spawn_blocking({
            let url = url.clone();
            move || against_database(&[command], &url)
        })
        .await
        .unwrap();

        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(!out.status.success(), "{command}: {out:?}");
        assert_eq!(stderr.lines().count(), 1, "{command}: one line:\n{stderr}");
        assert!(
            stderr.contains(&format!("database \"{name}\" does not exist"))
                && stderr.contains("createdb -h "),
            "{command}: {stderr}"
        );
        // No retries: the database will not appear by waiting.
        assert!(!stdout.contains("retrying"), "{command}: {stdout}");
    }
    assert!(!crate::helpers::database_exists(&name).await);
}

#[tokio::test]
async fn migrating_an_up_to_date_database_logs_no_server_notice() {
    let db = crate::helpers::fresh_database().await;
    let url = db.url();

    let runs = tokio::task::spawn_blocking(move || {
        [
            against_database(&["migrate"], &url),
            against_database(&["migrate"], &url),
        ]
    })
    .await
    .unwrap();

    for out in &runs {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{out:?}");
        // sqlx logs the server's NOTICE for `CREATE TABLE IF NOT EXISTS _sqlx_migrations`.
        assert!(
            !stdout.contains("sqlx::postgres::notice") && !stdout.contains("already exists"),
            "{stdout}"
        );
        assert!(stdout.contains("migrations applied"), "{stdout}");
    }
}
