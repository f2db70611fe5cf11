//! How long one rate-limit decision through Redis takes, measured without load: a real gateway
//! in this process, every request decided by Redis, 2,000 requests one after the other, and the
//! mean of `tributary_ratelimit_redis_duration_seconds{outcome="ok"}` over them — the decision
//! itself, the pooled connection's checkout included, without the HTTP around it.
//!
//! ```sh
//! cargo run --release --example ratelimit_latency            # Redis on 127.0.0.1:6379
//! REDIS_URL=redis://host:6379 cargo run --release --example ratelimit_latency
//! ```
//!
//! It needs no database: the gateway's database is a port nothing listens on, and the requests
//! (`GET /api/v1/orders/1`) are answered 503 right after the rate limiter let them through.

use std::{num::NonZeroU32, time::Instant};

use tributary::{Application, Settings, config::Secret};

const WARM_UP: usize = 200;
const DECISIONS: usize = 2_000;

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let redis = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let mut settings = Settings::default();
    settings.server.listen = "127.0.0.1:0".parse()?;
    settings.database.url = Secret::new("postgres://postgres@127.0.0.1:1/none");
    settings.database.run_migrations = false;
    settings.database.min_connections = Some(0);
    settings.admission.enabled = false;
    settings.rate_limit.enabled = true;
    // Far above what one client sends here: every decision is "allowed", by Redis.
    settings.rate_limit.per_second = NonZeroU32::new(1_000_000).expect("non-zero");
    settings.rate_limit.burst = NonZeroU32::new(1_000_000).expect("non-zero");
    settings.rate_limit.redis_url = Some(Secret::new(redis));
    let app = Application::build(settings).await?;
    let base = format!("http://{}", app.local_addr());
    tokio::spawn(app.run_until_stopped(std::future::pending::<()>()));
    let client = reqwest::Client::new();

    let send = |n: usize| {
        let (client, base) = (client.clone(), base.clone());
        async move {
            for _ in 0..n {
                client.get(format!("{base}/api/v1/orders/1")).send().await?;
            }
            anyhow::Ok(())
        }
    };
    send(WARM_UP).await?;
    let before = decisions(&client, &base).await?;
    let started = Instant::now();
    send(DECISIONS).await?;
    let wall = started.elapsed();
    let after = decisions(&client, &base).await?;

    let count = after.1 - before.1;
    anyhow::ensure!(
        count >= DECISIONS as f64,
        "only {count} of {DECISIONS} requests were decided by Redis: is it running?"
    );
    let mean_us = (after.0 - before.0) / count * 1e6;
    println!(
        "{DECISIONS} sequential decisions through Redis: mean {mean_us:.1} µs per decision \
         (pool checkout included); mean {:.1} µs per whole request",
        wall.as_secs_f64() / DECISIONS as f64 * 1e6
    );
    Ok(())
}

/// `(sum, count)` of the successful Redis decisions so far.
async fn decisions(client: &reqwest::Client, base: &str) -> anyhow::Result<(f64, f64)> {
    let text = client
        .get(format!("{base}/metrics"))
        .send()
        .await?
        .text()
        .await?;
    let sample = |suffix: &str| {
        let name = format!("tributary_ratelimit_redis_duration_seconds_{suffix}{{outcome=\"ok\"}}");
        text.lines()
            .find_map(|l| l.strip_prefix(&name))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    Ok((sample("sum"), sample("count")))
}
