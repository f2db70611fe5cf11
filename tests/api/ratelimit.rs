//! Per-client rate limiting: 429 with problem+json and `RateLimit-*` headers, keys, the
//! trusted-proxy rule, a limit shared by two gateways through the real Redis, and the local
//! fallback when Redis dies, is slow, or is down from the start.

use std::{
    net::SocketAddr,
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use futures::future::join_all;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    process::{Child, Command},
};
use tributary::{Settings, config::RateLimitKey, domain::Service};

use crate::helpers::{
    TestApp, eventually, log_lines, metric_value, nz, nz32, problem, spawn_app_with,
};

const DASHBOARD: &str = "/api/v1/dashboard/1";
const SHARED_REDIS: &str = "redis://127.0.0.1:6379";

/// A key no other test or earlier run has used, so state left in Redis cannot interfere.
fn unique_key() -> String {
    format!("ratelimit-test-{}", uuid::Uuid::new_v4().simple())
}

fn limit(s: &mut Settings, per_second: u32, burst: u32) {
    s.rate_limit.enabled = true;
    s.rate_limit.per_second = nz32(per_second);
    s.rate_limit.burst = nz32(burst);
}

async fn as_client(app: &TestApp, api_key: &str) -> reqwest::Response {
    app.client
        .get(app.url(DASHBOARD))
        .header("x-api-key", api_key)
        .send()
        .await
        .expect("request")
}

async fn forwarded_for(app: &TestApp, xff: &str) -> reqwest::Response {
    app.client
        .get(app.url(DASHBOARD))
        .header("x-forwarded-for", xff)
        .send()
        .await
        .expect("request")
}

fn header(resp: &reqwest::Response, name: &str) -> Option<String> {
    resp.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_owned())
}

fn number(resp: &reqwest::Response, name: &str) -> u64 {
    header(resp, name)
        .unwrap_or_else(|| panic!("{name} missing on {}", resp.status()))
        .parse()
        .unwrap_or_else(|_| panic!("{name} is not a number"))
}

/// How a series of requests was answered.
#[derive(Debug, Default)]
struct Tally {
    allowed: usize,
    limited: usize,
    server_errors: Vec<u16>,
}

impl Tally {
    fn add(&mut self, resp: &reqwest::Response) {
        match resp.status().as_u16() {
            429 => self.limited += 1,
            s if s >= 500 => self.server_errors.push(s),
            _ => self.allowed += 1,
        }
    }
}

/// `requests` concurrent requests from one client, alternating between the gateways.
async fn burst_across(apps: &[&TestApp], api_key: &str, requests: usize) -> Tally {
    let responses = join_all((0..requests).map(|i| as_client(apps[i % apps.len()], api_key))).await;
    let mut tally = Tally::default();
    for resp in &responses {
        tally.add(resp);
    }
    tally
}

/// Sends requests until the client is limited; a few more than `burst` must be enough.
async fn spend_burst(app: &TestApp, api_key: &str, burst: usize) {
    for _ in 0..burst + 5 {
        if as_client(app, api_key).await.status() == 429 {
            return;
        }
    }
    panic!("never limited after {} requests", burst + 5);
}

fn fallbacks(metrics: &str) -> f64 {
    ["timeout", "error", "unavailable"]
        .iter()
        .map(|r| {
            metric_value(
                metrics,
                "tributary_ratelimit_redis_fallbacks_total",
                &[("reason", r)],
            )
            .unwrap_or(0.0)
        })
        .sum()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A `redis-server` of this test's own, so stopping it disturbs nobody else.
async fn start_redis() -> (Child, u16) {
    let port = free_port();
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("redis-server must be installed (see .ci/run)");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(mut conn) = TcpStream::connect(("127.0.0.1", port)).await {
            let mut pong = [0u8; 7];
            if conn.write_all(b"PING\r\n").await.is_ok()
                && conn.read_exact(&mut pong).await.is_ok()
                && &pong == b"+PONG\r\n"
            {
                return (child, port);
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "redis-server on port {port} did not come up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A TCP proxy to `upstream` that holds every reply for `delay` milliseconds (0: no delay).
async fn delaying_proxy(upstream: SocketAddr, delay: Arc<AtomicU64>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let delay = Arc::clone(&delay);
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    return;
                };
                let (mut client_rx, mut client_tx) = client.into_split();
                let (mut server_rx, mut server_tx) = server.into_split();
                let requests = tokio::io::copy(&mut client_rx, &mut server_tx);
                let replies = async {
                    let mut buf = vec![0u8; 16 * 1024];
                    while let Ok(n @ 1..) = server_rx.read(&mut buf).await {
                        let ms = delay.load(Ordering::Relaxed);
                        if ms > 0 {
                            tokio::time::sleep(Duration::from_millis(ms)).await;
                        }
                        if client_tx.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                };
                tokio::select! {
                    _ = requests => {}
                    _ = replies => {}
                }
            });
        }
    });
    addr
}

/// The most a client may be allowed in `elapsed` with a bucket of `burst` refilled at 1/s.
fn most_allowed(burst: usize, elapsed: Duration) -> usize {
    burst + 1 + elapsed.as_secs() as usize
}

#[tokio::test]
async fn a_client_over_its_rate_gets_429_problem_with_retry_after_and_ratelimit_headers() {
    // Admission is off: 429 comes from the rate limiter alone, never from admission.
    let app = spawn_app_with(|s| {
        limit(s, 1, 3);
        s.admission.enabled = false;
    })
    .await;
    let key = unique_key();

    for expected_remaining in [2, 1, 0] {
        let resp = as_client(&app, &key).await;
        assert_eq!(resp.status(), 200);
        assert_eq!(number(&resp, "ratelimit-limit"), 3);
        assert_eq!(number(&resp, "ratelimit-remaining"), expected_remaining);
        assert!(number(&resp, "ratelimit-reset") >= 1);
        assert!(header(&resp, "retry-after").is_none());
    }
    // One request refills per second: if the machine was slow, a refill may let one more in.
    let mut limited = None;
    for _ in 0..3 {
        let resp = as_client(&app, &key).await;
        if resp.status() == 429 {
            limited = Some(resp);
            break;
        }
    }
    let resp = limited.expect("the client over its burst must be limited");
    assert_eq!(number(&resp, "ratelimit-limit"), 3);
    assert_eq!(number(&resp, "ratelimit-remaining"), 0);
    let retry_after = number(&resp, "retry-after");
    assert_eq!(retry_after, 1, "one request refills in 1 s");
    assert!(number(&resp, "ratelimit-reset") >= retry_after);
    let (status, body) = problem(resp).await;
    assert_eq!(status, 429);
    assert!(
        body["type"].as_str().unwrap().ends_with("rate-limited"),
        "{body}"
    );

    // Another API key has its own bucket.
    let other = as_client(&app, &unique_key()).await;
    assert_eq!(other.status(), 200);
    assert_eq!(number(&other, "ratelimit-remaining"), 2);

    // Health and metrics are never limited, whoever asks.
    for url in [app.url("/healthz"), app.ops_url("/metrics")] {
        let resp = app
            .client
            .get(&url)
            .header("x-api-key", &key)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{url}");
        assert!(header(&resp, "ratelimit-limit").is_none(), "{url}");
    }
}

#[tokio::test]
async fn over_its_rate_a_client_gets_429_while_a_full_gateway_gives_others_503() {
    let app = spawn_app_with(|s| {
        limit(s, 1, 2);
        s.admission.max_in_flight = nz(1);
        s.admission.mode = tributary::config::AdmissionMode::Static;
        s.admission.max_wait = Duration::from_millis(50);
        // Not what this test is about: a paused connection would let the bucket refill.
        s.admission.pushback = false;
        s.downstreams.users.timeout = Duration::from_secs(5);
    })
    .await;
    let too_fast = unique_key();
    spend_burst(&app, &too_fast, 2).await;

    // Fill the only admission slot with a request stuck on a hanging required downstream.
    app.hang(Service::Users);
    let holder = {
        let client = app.client.clone();
        let url = app.url(DASHBOARD);
        tokio::spawn(async move {
            client
                .get(url)
                .header("x-api-key", unique_key())
                .send()
                .await
        })
    };
    let admission = app.state.admission.as_ref().unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async {
            admission.in_flight() == 1
        })
        .await
    );

    let (status, _) = problem(as_client(&app, &unique_key()).await).await;
    assert_eq!(status, 503, "a client within its rate meets a full gateway");
    let resp = as_client(&app, &too_fast).await;
    assert!(resp.headers().contains_key("ratelimit-limit"));
    let (status, body) = problem(resp).await;
    assert_eq!(
        status, 429,
        "a client over its rate is told so, not that we are full"
    );
    assert!(
        body["type"].as_str().unwrap().ends_with("rate-limited"),
        "{body}"
    );

    let _ = holder.await;
}

#[tokio::test]
async fn x_forwarded_for_is_ignored_from_an_untrusted_peer() {
    let app = spawn_app_with(|s| {
        limit(s, 1, 2);
        s.rate_limit.key = RateLimitKey::Ip;
    })
    .await;
    // Every request claims another address; the peer (127.0.0.1) is not a trusted proxy, so
    // they are all the same client.
    let mut tally = Tally::default();
    for i in 0..6 {
        tally.add(&forwarded_for(&app, &format!("198.51.100.{i}")).await);
    }
    assert!(tally.server_errors.is_empty(), "{tally:?}");
    assert!(
        tally.limited >= 3,
        "spoofed addresses escaped the limit: {tally:?}"
    );
}

#[tokio::test]
async fn x_forwarded_for_is_honoured_from_a_trusted_proxy() {
    let app = spawn_app_with(|s| {
        limit(s, 1, 2);
        s.rate_limit.key = RateLimitKey::Ip;
        s.rate_limit.trusted_proxies = vec!["127.0.0.1/32".parse().unwrap()];
    })
    .await;
    let client = "198.51.100.7";
    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.push(forwarded_for(&app, client).await.status().as_u16());
    }
    assert!(statuses.contains(&429), "{statuses:?}");
    // A forged left-most entry changes nothing: the right-most untrusted entry is the client.
    let forged = forwarded_for(&app, &format!("203.0.113.50, {client}")).await;
    assert_eq!(forged.status(), 429);
    // A different client behind the same proxy has its own bucket.
    let neighbour = forwarded_for(&app, "198.51.100.8").await;
    assert_eq!(neighbour.status(), 200);
    assert_eq!(number(&neighbour, "ratelimit-remaining"), 1);
}

#[tokio::test]
async fn two_gateways_share_one_limit_through_redis() {
    const BURST: usize = 10;
    let configure = |s: &mut Settings| {
        limit(s, 1, BURST as u32);
        s.rate_limit.redis_url = Some(tributary::config::Secret::new(SHARED_REDIS));
        // Sharing is under test here, not latency: a slow CI machine must not fall back.
        s.rate_limit.redis_timeout = Duration::from_secs(1);
    };
    let a = spawn_app_with(configure).await;
    let b = spawn_app_with(configure).await;
    let key = unique_key();

    let started = tokio::time::Instant::now();
    let tally = burst_across(&[&a, &b], &key, 3 * BURST).await;
    let elapsed = started.elapsed();

    assert!(tally.server_errors.is_empty(), "{tally:?}");
    assert!(
        tally.allowed >= BURST,
        "the burst must be honoured: {tally:?}"
    );
    assert!(
        tally.allowed <= most_allowed(BURST, elapsed) && tally.allowed < 2 * BURST,
        "two gateways must share one bucket of {BURST}, not have one each: {tally:?} in {elapsed:?}"
    );
    // Each gateway knows what the other allowed.
    for app in [&a, &b] {
        let resp = as_client(app, &key).await;
        assert_eq!(resp.status(), 429, "{}", app.addr);
    }
}

#[tokio::test]
async fn when_redis_dies_the_local_limiter_takes_over_and_no_request_fails() {
    const BURST: usize = 5;
    let (mut redis, port) = start_redis().await;
    let configure = |s: &mut Settings| {
        limit(s, 1, BURST as u32);
        s.rate_limit.redis_url = Some(tributary::config::Secret::new(format!(
            "redis://127.0.0.1:{port}"
        )));
        s.rate_limit.redis_timeout = Duration::from_secs(1);
    };
    let a = spawn_app_with(configure).await;
    let b = spawn_app_with(configure).await;
    let key = unique_key();

    // Shared while Redis is up.
    let started = tokio::time::Instant::now();
    let shared = burst_across(&[&a, &b], &key, 3 * BURST).await;
    let elapsed = started.elapsed();
    assert!(shared.server_errors.is_empty(), "{shared:?}");
    assert!(
        shared.allowed <= most_allowed(BURST, elapsed) && shared.allowed < 2 * BURST,
        "not shared: {shared:?}"
    );
    let fallbacks_before = fallbacks(&a.metrics().await);

    redis.kill().await.expect("stop our redis-server");

    // Gateway A now decides alone: its local bucket was never used, so the client that Redis
    // was limiting is allowed again, until the local burst is spent.
    let mut after = Tally::default();
    let mut last_limited = None;
    let started = tokio::time::Instant::now();
    for _ in 0..3 * BURST {
        let resp = as_client(&a, &key).await;
        after.add(&resp);
        if resp.status() == 429 {
            last_limited = Some(resp);
        }
    }
    assert!(
        after.server_errors.is_empty(),
        "Redis trouble failed requests: {after:?}"
    );
    assert!(
        after.allowed >= 1,
        "the local limiter must take over: {after:?}"
    );
    assert!(
        after.allowed <= most_allowed(BURST, started.elapsed()),
        "and still limit, to one bucket of {BURST}: {after:?}"
    );
    let limited = last_limited.expect("the local limiter limits once its burst is spent");
    assert!(number(&limited, "retry-after") >= 1);
    assert_eq!(number(&limited, "ratelimit-remaining"), 0);
    let (status, _) = problem(limited).await;
    assert_eq!(status, 429);

    let mut on_b = Tally::default();
    for _ in 0..BURST {
        on_b.add(&as_client(&b, &key).await);
    }
    assert!(on_b.server_errors.is_empty(), "{on_b:?}");

    assert!(
        fallbacks(&a.metrics().await) > fallbacks_before,
        "tributary_ratelimit_redis_fallbacks_total must count the fallbacks"
    );
    // Logged on the change of state, not once per request.
    let ours = format!("127.0.0.1:{port}");
    let warnings = log_lines()
        .into_iter()
        .filter(|l| l["redis"] == ours.as_str() && l["level"] == "WARN")
        .count();
    assert!(
        (1..=2).contains(&warnings),
        "expected one warning per gateway for {} fallbacks, got {warnings}",
        after.allowed + after.limited + on_b.allowed + on_b.limited
    );
}

#[tokio::test]
async fn a_slow_redis_falls_back_to_the_local_limiter_within_the_timeout() {
    const BURST: usize = 3;
    let delay = Arc::new(AtomicU64::new(0));
    let proxy = delaying_proxy("127.0.0.1:6379".parse().unwrap(), Arc::clone(&delay)).await;
    let app = spawn_app_with(|s| {
        limit(s, 1, BURST as u32);
        s.rate_limit.redis_url = Some(tributary::config::Secret::new(format!("redis://{proxy}")));
        s.rate_limit.redis_timeout = Duration::from_millis(300);
    })
    .await;
    let key = unique_key();
    // Redis spends the client's burst.
    spend_burst(&app, &key, BURST).await;
    let timeouts_before = metric_value(
        &app.metrics().await,
        "tributary_ratelimit_redis_fallbacks_total",
        &[("reason", "timeout")],
    )
    .unwrap_or(0.0);

    // Redis now answers ten times slower than the gateway may wait.
    delay.store(3_000, Ordering::Relaxed);
    let resp = as_client(&app, &key).await;
    assert_eq!(
        resp.status(),
        200,
        "Redis would say 429; the local limiter, untouched so far, allows"
    );
    let mut rest = Tally::default();
    for _ in 0..2 * BURST {
        rest.add(&as_client(&app, &key).await);
    }
    assert!(rest.server_errors.is_empty(), "{rest:?}");
    assert!(
        rest.limited >= 1,
        "the local limiter still limits: {rest:?}"
    );
    let timeouts_after = metric_value(
        &app.metrics().await,
        "tributary_ratelimit_redis_fallbacks_total",
        &[("reason", "timeout")],
    )
    .unwrap_or(0.0);
    assert!(timeouts_after > timeouts_before);
}

#[tokio::test]
async fn the_gateway_starts_and_limits_locally_when_redis_is_down_from_the_start() {
    let closed = free_port();
    let app = spawn_app_with(|s| {
        limit(s, 1, 2);
        s.rate_limit.redis_url = Some(tributary::config::Secret::new(format!(
            "redis://127.0.0.1:{closed}"
        )));
    })
    .await;
    let unavailable = |m: &str| {
        metric_value(
            m,
            "tributary_ratelimit_redis_fallbacks_total",
            &[("reason", "unavailable")],
        )
        .unwrap_or(0.0)
    };
    let before = unavailable(&app.metrics().await);
    let key = unique_key();
    let mut tally = Tally::default();
    for _ in 0..6 {
        tally.add(&as_client(&app, &key).await);
    }
    assert!(tally.server_errors.is_empty(), "{tally:?}");
    assert!(tally.allowed >= 2 && tally.limited >= 1, "{tally:?}");
    assert!(unavailable(&app.metrics().await) > before);
}

#[tokio::test]
async fn a_fresh_gateway_exports_its_labelled_counters_at_zero() {
    let app = spawn_app_with(|s| {
        limit(s, 100, 100);
        s.rate_limit.redis_url = Some(tributary::config::Secret::new(SHARED_REDIS));
    })
    .await;
    // Nothing has been rejected, fallen back or degraded yet: the series exist anyway, so
    // that rate() sees their first increase and dashboards show 0, not "no data".
    let text = app.metrics().await;
    let mut missing = Vec::new();
    for (name, labels) in [
        (
            "tributary_ratelimit_rejections_total",
            vec![("backend", "local")],
        ),
        (
            "tributary_ratelimit_rejections_total",
            vec![("backend", "redis")],
        ),
        (
            "tributary_ratelimit_redis_fallbacks_total",
            vec![("reason", "timeout")],
        ),
        (
            "tributary_fanout_degraded_total",
            vec![("part", "recent_orders"), ("reason", "circuit_open")],
        ),
        (
            "tributary_fanout_degraded_total",
            vec![("part", "promotions"), ("reason", "timeout")],
        ),
        (
            "tributary_fanout_critical_path_total",
            vec![("part", "carts")],
        ),
        ("tributary_db_pool_acquire_timeouts_total", vec![]),
        // No request ever gets a 4xx from /healthz (the tests share one recorder, so a series
        // another test could have produced would prove nothing): only registration at
        // start-up makes this one exist.
        (
            "tributary_http_requests_total",
            vec![
                ("http_route", "/healthz"),
                ("http_request_method", "GET"),
                ("status_class", "4xx"),
            ],
        ),
    ] {
        if metric_value(&text, name, &labels).is_none() {
            missing.push(format!("{name}{labels:?}"));
        }
    }
    assert!(
        missing.is_empty(),
        "not exported before their first increment: {missing:?}"
    );
}

/// Sends one inline command to the Redis on `port` and returns its reply, as text.
async fn redis_command(port: u16, command: &str) -> String {
    let mut conn = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    conn.write_all(format!("{command}\r\n").as_bytes())
        .await
        .unwrap();
    let mut reply = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = conn.read(&mut buf).await.unwrap();
        reply.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&reply);
        // A bulk string (`$len\r\n...\r\n`) or a one-line reply.
        let complete = match text.strip_prefix('$') {
            Some(rest) => rest
                .split_once("\r\n")
                .is_some_and(|(len, body)| body.len() >= len.parse::<usize>().unwrap_or(0) + 2),
            None => text.ends_with("\r\n"),
        };
        if n == 0 || complete {
            return text.into_owned();
        }
    }
}

/// How many times Redis has run `command` (from `INFO commandstats`).
async fn redis_calls(port: u16, command: &str) -> u64 {
    let stats = redis_command(port, "INFO commandstats").await;
    stats
        .lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_decision_is_one_round_trip_with_no_ping_per_checkout() {
    let (_redis, port) = start_redis().await;
    let app = spawn_app_with(|s| {
        limit(s, 1000, 1000);
        s.rate_limit.redis_url = Some(tributary::config::Secret::new(format!(
            "redis://127.0.0.1:{port}"
        )));
    })
    .await;
    let pings_before = redis_calls(port, "ping").await;

    let decisions = 50;
    for _ in 0..decisions {
        assert_eq!(as_client(&app, &unique_key()).await.status(), 200);
    }

    let scripts = redis_calls(port, "evalsha").await + redis_calls(port, "eval").await;
    assert!(scripts >= decisions, "{scripts} decisions reached Redis");
    let pings = redis_calls(port, "ping").await - pings_before;
    assert!(
        pings < 5,
        "{pings} PINGs for {decisions} decisions: a checkout costs a round trip"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_go_on_through_redis_when_its_connections_were_killed() {
    let (_redis, port) = start_redis().await;
    let app = spawn_app_with(|s| {
        limit(s, 1000, 1000);
        s.rate_limit.redis_url = Some(tributary::config::Secret::new(format!(
            "redis://127.0.0.1:{port}"
        )));
        // Reconnecting is the point here, not the 20 ms budget: on a loaded test machine a
        // fresh connection can take longer than that, and the decision would fall back.
        s.rate_limit.redis_timeout = Duration::from_secs(2);
    })
    .await;
    // Several pooled connections, then Redis drops every client, as a restart does.
    let warm = join_all((0..8).map(|_| as_client(&app, "warm"))).await;
    assert!(warm.iter().all(|r| r.status() == 200));
    let killed = redis_command(port, "CLIENT KILL TYPE normal").await;
    assert!(killed.starts_with(':'), "{killed}");
    let before = redis_calls(port, "evalsha").await;

    for _ in 0..5 {
        assert_eq!(as_client(&app, "after").await.status(), 200);
    }

    // (This Redis is the test's own: its counts are this gateway's alone. A decision that
    // fell back would have marked Redis down, and the next ones would not have reached it.)
    let decided = redis_calls(port, "evalsha").await - before;
    assert!(
        decided >= 5,
        "{decided} of 5 decisions reached Redis after its connections were killed"
    );
}
