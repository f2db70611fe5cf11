//! Grey (canary) releases against the real gateway: two simulators, stable (the app's own) and a
//! canary, with the carts service routed between them by header, user and percentage rules;
//! the canary's isolation, its automatic rollback, and reloads of the routing while requests
//! are in flight.

use std::{path::PathBuf, time::Duration};

use serde_json::{Value, json};
use tributary::{
    config::{Sources, VariantName, routing::Rule},
    domain::Service,
    routing::bucket,
};
use tributary_sim::{self as sim, Behaviour, Mode, SimHandle};

use crate::helpers::{TestApp, degraded, eventually, log_lines, spawn_app_with};

async fn canary_sim() -> SimHandle {
    sim::spawn(
        "127.0.0.1:0".parse().unwrap(),
        Behaviour {
            latency: Duration::from_millis(5),
            ..Behaviour::default()
        },
    )
    .await
    .expect("the canary simulator starts")
}

fn name(n: &str) -> VariantName {
    n.parse().unwrap()
}

/// A variant at `sim`, with `extra` settings (`max_concurrency`, `timeout`).
fn variant_at(sim: &SimHandle, extra: Value) -> tributary::config::VariantSettings {
    let mut v = json!({ "base_url": sim.base_url() });
    v.as_object_mut()
        .unwrap()
        .extend(extra.as_object().cloned().unwrap_or_default());
    serde_json::from_value(v).expect("variant settings")
}

fn rules(v: Value) -> Vec<Rule> {
    serde_json::from_value(v).expect("rules")
}

/// Calls of `service` that `sim` saw, as `(user_id, variant header)`.
fn calls(sim: &SimHandle, service: Service) -> Vec<(i64, Option<String>)> {
    sim.sim
        .journal()
        .into_iter()
        .filter(|s| s.service == service)
        .map(|s| (s.user_id, s.variant))
        .collect()
}

async fn dashboard_with(app: &TestApp, user: i64, header: Option<(&str, &str)>) -> (u16, Value) {
    let mut request = app
        .client
        .get(app.url(&format!("/api/v1/dashboard/{user}")));
    if let Some((k, v)) = header {
        request = request.header(k, v);
    }
    let resp = request.send().await.expect("request");
    (
        resp.status().as_u16(),
        resp.json().await.unwrap_or(Value::Null),
    )
}

/// A configuration file of the test's own, removed when dropped.
struct ConfigFile(PathBuf);

impl ConfigFile {
    fn new() -> Self {
        Self(std::env::temp_dir().join(format!(
            "tributary-grey-{}.toml",
            uuid::Uuid::new_v4().simple()
        )))
    }

    fn write(&self, text: &str) {
        std::fs::write(&self.0, text).expect("write the config file");
    }

    fn sources(&self) -> Sources {
        Sources {
            file: Some(self.0.clone()),
            env: vec![],
        }
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A file that gives carts a `canary` at `sim`, routed by `x-gray-version: v2`.
fn canary_file(sim: &SimHandle, timeout: &str) -> String {
    format!(
        r#"
[downstreams.carts.variants.canary]
base_url = "{}"
timeout = "{timeout}"

[[downstreams.carts.rules]]
variant = "canary"
header = "x-gray-version"
equals = "v2"
"#,
        sim.base_url()
    )
}

async fn reload(app: &TestApp) -> (u16, Value) {
    let resp = app
        .client
        .post(app.ops_url("/admin/routing/reload"))
        .send()
        .await
        .expect("reload");
    (
        resp.status().as_u16(),
        resp.json().await.unwrap_or(Value::Null),
    )
}

#[tokio::test]
async fn a_header_rule_sends_that_part_to_the_canary_and_the_colour_follows_the_request() {
    let canary = canary_sim().await;
    let app = spawn_app_with(|s| {
        s.downstreams
            .carts
            .variants
            .insert(name("hdr-canary"), variant_at(&canary, json!({})));
        s.downstreams.carts.rules = rules(json!([
            {"variant": "hdr-canary", "header": "x-gray-version", "matches": "^v2"}
        ]));
    })
    .await;

    let (status, body) = dashboard_with(&app, 3, Some(("x-gray-version", "v2.1"))).await;
    assert_eq!(status, 200, "{body}");
    assert!(degraded(&body).is_empty(), "{body}");
    assert_eq!(body["cart"]["user_id"], 3);
    assert_eq!(
        calls(&canary, Service::Carts),
        [(3, Some("hdr-canary".into()))]
    );
    assert!(
        calls(&canary, Service::Users).is_empty(),
        "only the part with a variant moves"
    );

    for version in [
        None,
        Some(("x-gray-version", "v1")),
        Some(("x-gray-version", "xv2")),
    ] {
        let (status, _) = dashboard_with(&app, 4, version).await;
        assert_eq!(status, 200);
    }
    assert_eq!(calls(&canary, Service::Carts).len(), 1, "no other request");
    let stable = calls(&app.sim, Service::Carts);
    assert_eq!(stable.len(), 3, "{stable:?}");
    assert!(
        stable.iter().all(|(_, v)| v.as_deref() == Some("stable")),
        "a downstream with variants names the stable one too: {stable:?}"
    );
    assert!(
        calls(&app.sim, Service::Users)
            .iter()
            .all(|(_, v)| v.is_none()),
        "a downstream without variants sends no variant header"
    );

    // The access line names the variant; the metrics carry it as a label.
    let line = log_lines()
        .into_iter()
        .find(|l| l["message"] == "request completed" && l["variants"] == "carts=hdr-canary")
        .expect("an access line with the variant");
    assert_eq!(line["user_id"], 3, "{line}");
    let ok = app
        .metric(
            "tributary_downstream_requests_total",
            &[
                ("downstream", "carts"),
                ("variant", "hdr-canary"),
                ("outcome", "ok"),
            ],
        )
        .await;
    assert_eq!(ok, 1.0);
    let stable_ok = app
        .metric(
            "tributary_downstream_requests_total",
            &[
                ("downstream", "users"),
                ("variant", "stable"),
                ("outcome", "ok"),
            ],
        )
        .await;
    assert!(stable_ok >= 4.0, "{stable_ok}");
}

#[tokio::test]
async fn user_lists_and_ranges_route_in_rule_order() {
    let canary = canary_sim().await;
    let app = spawn_app_with(|s| {
        let carts = &mut s.downstreams.carts;
        carts
            .variants
            .insert(name("a"), variant_at(&canary, json!({})));
        carts
            .variants
            .insert(name("b"), variant_at(&canary, json!({})));
        carts.rules = rules(json!([
            {"variant": "a", "header": "x-gray-version", "equals": "v2"},
            {"variant": "b", "user_ids": [7], "user_ranges": [[100, 110]]}
        ]));
    })
    .await;
    for user in [7, 8, 99, 100, 105, 110, 111] {
        assert_eq!(dashboard_with(&app, user, None).await.0, 200);
    }
    assert_eq!(
        dashboard_with(&app, 105, Some(("x-gray-version", "v2")))
            .await
            .0,
        200
    );
    assert_eq!(
        calls(&canary, Service::Carts),
        [
            (7, Some("b".into())),
            (100, Some("b".into())),
            (105, Some("b".into())),
            (110, Some("b".into())),
            (105, Some("a".into())),
        ],
        "the header rule comes first and wins for user 105"
    );
    let stable: Vec<i64> = calls(&app.sim, Service::Carts)
        .into_iter()
        .map(|c| c.0)
        .collect();
    assert_eq!(stable, [8, 99, 111]);
}

#[tokio::test]
async fn a_percentage_takes_its_share_of_users_and_each_user_stays_where_the_hash_puts_them() {
    let canary = canary_sim().await;
    let app = spawn_app_with(|s| {
        let carts = &mut s.downstreams.carts;
        carts
            .variants
            .insert(name("canary"), variant_at(&canary, json!({})));
        carts
            .variants
            .insert(name("second"), variant_at(&canary, json!({})));
        carts.rules = rules(json!([
            {"variant": "canary", "percent": 30},
            {"variant": "second", "percent": 20}
        ]));
    })
    .await;
    let users: Vec<i64> = (1..=300).collect();
    for chunk in users.chunks(10) {
        let answers =
            futures::future::join_all(chunk.iter().map(|u| dashboard_with(&app, *u, None))).await;
        for (status, body) in answers {
            assert_eq!(status, 200, "{body}");
        }
    }
    let on = |variant: &str| {
        let mut users: Vec<i64> = calls(&canary, Service::Carts)
            .into_iter()
            .filter(|c| c.1.as_deref() == Some(variant))
            .map(|c| c.0)
            .collect();
        users.sort_unstable();
        users
    };
    let in_buckets = |range: std::ops::Range<u32>| -> Vec<i64> {
        users
            .iter()
            .copied()
            .filter(|u| range.contains(&bucket(*u)))
            .collect()
    };
    let expected = in_buckets(0..3000);
    assert_eq!(
        on("canary"),
        expected,
        "each user where the fixed hash puts them"
    );
    let share = expected.len() as f64 / users.len() as f64;
    assert!((0.22..=0.38).contains(&share), "share {share}");
    // The second share takes the next stretch of buckets: other users.
    assert_eq!(on("second"), in_buckets(3000..5000));

    // Sticky: the same users, again and again, land on the same side.
    let (inside, outside) = (expected[0], (1..).find(|u| bucket(*u) >= 5000).unwrap());
    for _ in 0..5 {
        dashboard_with(&app, inside, None).await;
        dashboard_with(&app, outside, None).await;
    }
    let canary_calls = calls(&canary, Service::Carts);
    let of = |user: i64| canary_calls.iter().filter(|c| c.0 == user).count();
    assert_eq!(of(inside), 6);
    assert_eq!(of(outside), 0);
}

#[tokio::test]
async fn a_hanging_canary_fills_its_own_bulkhead_and_stable_calls_keep_succeeding() {
    let canary = canary_sim().await;
    canary.sim.set(
        Service::Carts,
        Behaviour {
            mode: Mode::Hang,
            ..Behaviour::default()
        },
    );
    let app = spawn_app_with(|s| {
        // Long enough that the two hung calls are still hanging while the checks below run on
        // a loaded machine; they end on the canary's own timeout.
        s.server.request_deadline = Duration::from_secs(6);
        s.downstreams.carts.variants.insert(
            name("hang-canary"),
            variant_at(&canary, json!({"max_concurrency": 2, "timeout": "5s"})),
        );
        s.downstreams.carts.rules = rules(json!([
            {"variant": "hang-canary", "header": "x-gray-version", "equals": "v2"}
        ]));
    })
    .await;
    let gray = Some(("x-gray-version", "v2"));
    let hung = futures::future::join(dashboard_with(&app, 1, gray), dashboard_with(&app, 2, gray));
    let check = async {
        assert!(
            eventually(Duration::from_secs(5), || async {
                canary.sim.stats(Service::Carts).in_flight == 2
            })
            .await,
            "two calls hang on the canary"
        );
        // The canary's bulkhead is full: a third canary request degrades its cart at once ...
        let (status, body) = dashboard_with(&app, 3, gray).await;
        assert_eq!(status, 200);
        assert_eq!(degraded(&body), ["cart"], "{body}");
        // ... while stable's is untouched, and stable requests get their cart.
        let carts = app.state.downstreams.get(Service::Carts);
        assert_eq!(carts.in_flight(), 0);
        for user in 10..15 {
            let (status, body) = dashboard_with(&app, user, None).await;
            assert_eq!(status, 200);
            assert!(degraded(&body).is_empty(), "{body}");
        }
        assert_eq!(
            app.metric(
                "tributary_downstream_in_flight",
                &[("downstream", "carts"), ("variant", "hang-canary")]
            )
            .await,
            2.0
        );
        assert_eq!(
            app.metric(
                "tributary_downstream_requests_total",
                &[
                    ("downstream", "carts"),
                    ("variant", "hang-canary"),
                    ("outcome", "shed")
                ]
            )
            .await,
            1.0
        );
    };
    let (((s1, b1), (s2, b2)), ()) = futures::future::join(hung, check).await;
    // The hung calls time out on the canary's own timeout: degraded, not failed.
    assert_eq!((s1, s2), (200, 200));
    assert_eq!(degraded(&b1), ["cart"]);
    assert_eq!(degraded(&b2), ["cart"]);
    assert_eq!(calls(&app.sim, Service::Carts).len(), 5);
}

#[tokio::test]
async fn a_failing_canary_loses_its_percentage_traffic_until_resumed_and_header_routing_stays() {
    let canary = canary_sim().await;
    canary.sim.set(
        Service::Carts,
        Behaviour {
            latency: Duration::from_millis(2),
            error_rate: 1.0,
            ..Behaviour::default()
        },
    );
    let app = spawn_app_with(|s| {
        s.routing.admin = true;
        s.routing.rollback.min_calls = 20;
        s.routing.rollback.interval = Duration::from_millis(50);
        s.downstreams
            .carts
            .variants
            .insert(name("rb-canary"), variant_at(&canary, json!({})));
        s.downstreams.carts.rules = rules(json!([
            {"variant": "rb-canary", "header": "x-gray-version", "equals": "v2"},
            {"variant": "rb-canary", "percent": 100}
        ]));
    })
    .await;
    let rolled_back = || async {
        app.metric(
            "tributary_downstream_variant_rolled_back",
            &[("downstream", "carts"), ("variant", "rb-canary")],
        )
        .await
    };
    assert_eq!(rolled_back().await, 0.0);
    let mut user = 0;
    let app_ref = &app;
    let rolled = eventually(Duration::from_secs(20), || {
        user += 1;
        let u = user;
        async move {
            let (_, body) = dashboard_with(app_ref, u, None).await;
            assert!(
                degraded(&body) == ["cart"] || degraded(&body).is_empty(),
                "{body}"
            );
            rolled_back().await == 1.0
        }
    })
    .await;
    assert!(rolled, "rolled back after {user} requests");
    assert!(user >= 20, "not before min_calls: {user}");

    // One WARN with the numbers.
    let warnings: Vec<Value> = log_lines()
        .into_iter()
        .filter(|l| l["level"] == "WARN" && l["variant"] == "rb-canary")
        .collect();
    assert_eq!(warnings.len(), 1, "{warnings:#?}");
    let w = &warnings[0];
    assert!(
        w["message"]
            .as_str()
            .unwrap()
            .contains("error ratio 100.0 %"),
        "{w}"
    );
    assert_eq!(w["variant_error_ratio"], 1.0, "{w}");
    assert!(w["variant_calls"].as_u64().unwrap() >= 20, "{w}");

    // Percentage traffic goes to stable now; the header still reaches the canary.
    let before = calls(&canary, Service::Carts).len();
    let (_, body) = dashboard_with(&app, 5000, None).await;
    assert!(degraded(&body).is_empty(), "{body}");
    assert_eq!(calls(&canary, Service::Carts).len(), before);
    let (_, body) = dashboard_with(&app, 5000, Some(("x-gray-version", "v2"))).await;
    assert_eq!(degraded(&body), ["cart"], "{body}");
    assert_eq!(calls(&canary, Service::Carts).len(), before + 1);

    let table: Value = app.ops_get("/admin/routing").await.json().await.unwrap();
    let v = &table["downstreams"]["carts"]["variants"][0];
    assert_eq!(v["status"], "rolled_back", "{table}");
    assert!(v["reason"].as_str().unwrap().contains("error ratio"), "{v}");

    // It resumes only when told.
    let resp = app
        .client
        .post(app.ops_url("/admin/routing/carts/rb-canary/resume"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 204);
    assert_eq!(rolled_back().await, 0.0);
    dashboard_with(&app, 5001, None).await;
    assert_eq!(calls(&canary, Service::Carts).len(), before + 2);

    let resp = app
        .client
        .post(app.ops_url("/admin/routing/carts/nope/pause"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["detail"], "carts has no variant called \"nope\"");
}

#[tokio::test]
async fn a_valid_file_reloads_the_routing_and_an_invalid_one_is_refused() {
    let canary = canary_sim().await;
    let file = ConfigFile::new();
    let app = spawn_app_with(|s| s.routing.admin = true).await;
    app.state.routing.reload_from(file.sources());
    let gray = Some(("x-gray-version", "v2"));

    dashboard_with(&app, 1, gray).await;
    assert!(calls(&canary, Service::Carts).is_empty());

    file.write(&canary_file(&canary, "500ms"));
    let (status, body) = reload(&app).await;
    assert_eq!(status, 200, "{body}");
    dashboard_with(&app, 2, gray).await;
    assert_eq!(calls(&canary, Service::Carts), [(2, Some("canary".into()))]);

    file.write(&format!(
        "{}\n[[downstreams.carts.rules]]\nvariant = \"nope\"\npercent = 5\n",
        canary_file(&canary, "500ms")
    ));
    let (status, body) = reload(&app).await;
    assert_eq!(status, 422, "{body}");
    let detail = body["detail"].as_str().unwrap();
    assert!(
        detail.contains("downstreams.carts.rules[1] names variant \"nope\""),
        "{detail}"
    );
    assert!(!detail.contains('\n'), "{detail}");
    let refused: Vec<Value> = log_lines()
        .into_iter()
        .filter(|l| {
            l["message"] == "configuration reload refused; the running routing stays"
                && l["reason"].as_str().is_some_and(|r| r.contains("\"nope\""))
        })
        .collect();
    assert_eq!(refused.len(), 1, "{refused:#?}");

    // The running routing stays.
    dashboard_with(&app, 3, gray).await;
    assert_eq!(calls(&canary, Service::Carts).len(), 2);
    let table: Value = app.ops_get("/admin/routing").await.json().await.unwrap();
    assert_eq!(
        table["downstreams"]["carts"]["variants"][0]["name"],
        "canary"
    );

    let (status, body) = {
        file.write("[downstreams.carts]\ntimeout = \"not a duration\"\n");
        reload(&app).await
    };
    assert_eq!(status, 422);
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .contains("downstreams.carts.timeout"),
        "{body}"
    );
    // The metrics registry is the process's, shared with the other tests: at least these.
    assert!(
        app.metric("tributary_routing_reloads_total", &[("result", "refused")])
            .await
            >= 2.0
    );
}

#[tokio::test]
async fn a_request_in_flight_across_a_reload_finishes_on_the_variant_it_started_on() {
    let canary = canary_sim().await;
    canary.sim.set(
        Service::Carts,
        Behaviour {
            // Long enough that the reload below lands while the call is still in flight,
            // even on a loaded machine.
            latency: Duration::from_secs(3),
            ..Behaviour::default()
        },
    );
    let file = ConfigFile::new();
    let app = spawn_app_with(|s| {
        s.routing.admin = true;
        s.server.request_deadline = Duration::from_secs(6);
        s.downstreams.carts.variants.insert(
            name("canary"),
            variant_at(&canary, json!({"timeout": "5s"})),
        );
        s.downstreams.carts.rules = rules(json!([
            {"variant": "canary", "header": "x-gray-version", "equals": "v2"}
        ]));
    })
    .await;
    app.state.routing.reload_from(file.sources());
    let gray = Some(("x-gray-version", "v2"));

    let in_flight = dashboard_with(&app, 9, gray);
    let reload_meanwhile = async {
        assert!(
            eventually(Duration::from_secs(5), || async {
                canary.sim.stats(Service::Carts).in_flight == 1
            })
            .await
        );
        // The new configuration has no variant at all.
        file.write("[downstreams.carts]\ntimeout = \"500ms\"\n");
        assert_eq!(reload(&app).await.0, 200);
        assert_eq!(
            canary.sim.stats(Service::Carts).in_flight,
            1,
            "the reload landed while the call was in flight"
        );
    };
    let ((status, body), ()) = futures::future::join(in_flight, reload_meanwhile).await;
    assert_eq!(status, 200);
    assert!(degraded(&body).is_empty(), "the canary answered: {body}");
    let stats = canary.sim.stats(Service::Carts);
    assert_eq!((stats.completed, stats.cancelled), (1, 0));

    // The next request with the same header goes to stable.
    dashboard_with(&app, 9, gray).await;
    assert_eq!(canary.sim.stats(Service::Carts).requests, 1);
    assert_eq!(
        calls(&app.sim, Service::Carts),
        [(9, Some("stable".into()))]
    );
    let table: Value = app.ops_get("/admin/routing").await.json().await.unwrap();
    assert_eq!(table["active"], false, "{table}");
}

#[tokio::test]
async fn the_admin_routes_are_off_by_default() {
    let app = spawn_app_with(|_| {}).await;
    assert_eq!(app.ops_get("/admin/routing").await.status(), 404);
    let resp = app
        .client
        .post(app.ops_url("/admin/routing/reload"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
}

#[test]
fn check_config_validates_a_file_with_variants_and_refuses_a_bad_one_in_one_line() {
    let run = |text: &str| {
        let file = ConfigFile::new();
        file.write(text);
        std::process::Command::new(env!("CARGO_BIN_EXE_tributary"))
            .args(["--config", file.0.to_str().unwrap(), "check-config"])
            .env_clear()
            .output()
            .expect("the tributary binary runs")
    };
    let good = run(r#"
[downstreams.carts.variants.canary]
base_url = "http://carts-canary:8080"

[[downstreams.carts.rules]]
variant = "canary"
percent = 10
"#);
    assert!(
        good.status.success(),
        "{}",
        String::from_utf8_lossy(&good.stderr)
    );
    let printed: Value = serde_json::from_slice(&good.stdout).unwrap();
    assert_eq!(
        printed["downstreams"]["carts"]["rules"],
        json!([{"variant": "canary", "percent": 10.0}])
    );

    let bad = run(r#"
[downstreams.carts.variants.canary]
base_url = "http://carts-canary:8080"

[[downstreams.carts.rules]]
variant = "canary"
header = "x-gray-version"
matches = "^v2("
"#);
    assert_eq!(bad.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("downstreams.carts.rules") && stderr.contains("not a valid regex"),
        "{stderr}"
    );
}
