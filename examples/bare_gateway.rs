//! The bare stack tributary is built on, serving the same dashboard: the benchmark lab's
//! yardstick for what tributary's own code costs (`bench/run stack`).
//!
//! Same crates (axum, reqwest, sqlx over Postgres, tokio, serde_json, mimalloc), same contract
//! (`GET /api/v1/dashboard/{user_id}`: five downstream calls `GET {base}/{service}/{user_id}` and
//! the user's five newest orders, concurrently, merged into one JSON body with each service's
//! body embedded as it came), and nothing else: no metrics, no logs, no spans, no request
//! context, no admission, rate limit, bulkhead or breaker, no edge limits, no deadline but a
//! 500 ms timeout per call (tributary's default), no `Server-Timing`. Its per-request CPU is
//! therefore the floor that tributary's features are measured against; an optional part that
//! fails is `null` and named in `degraded`, the users part failing is a 502, as in tributary.
//!
//! Not a model to copy: it is what a service with none of tributary's protection costs, and the
//! lab's overload runs show what that protection is for.
//!
//! Settings, all from the environment:
//! - `BARE_LISTEN` (default `127.0.0.1:8080`), `BARE_WORKER_THREADS` (default: one per core);
//! - `DATABASE_URL` (a database migrated and seeded by `tributary migrate` and `tributary seed`),
//!   `BARE_DB_MAX_CONNECTIONS` (default 20, tributary's);
//! - `BARE_DOWNSTREAM_USERS`, `BARE_DOWNSTREAM_CARTS`, `BARE_DOWNSTREAM_RECOMMENDATIONS`,
//!   `BARE_DOWNSTREAM_PROMOTIONS`, `BARE_DOWNSTREAM_NOTIFICATIONS`: each service's base URL
//!   (defaults `http://127.0.0.1:9001` … `9005`, as in tributary's defaults).

use std::{sync::Arc, time::Duration};

use axum::{
    Json, Router,
    extract::{Path, State},
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::get,
};
use serde::Serialize;
use serde_json::value::RawValue;
use sqlx::postgres::PgPoolOptions;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const SERVICES: [&str; 5] = [
    "users",
    "carts",
    "recommendations",
    "promotions",
    "notifications",
];

struct Bare {
    client: reqwest::Client,
    /// `{base}/{service}/` per service, in `SERVICES` order; the user id is appended per call.
    prefixes: [String; 5],
    db: sqlx::PgPool,
}

#[derive(Serialize)]
struct Order {
    id: i64,
    status: String,
    total_cents: i64,
    created_at: chrono::DateTime<chrono::Utc>,
}

#[derive(Serialize)]
struct Dashboard {
    user_id: i64,
    profile: Box<RawValue>,
    cart: Option<Box<RawValue>>,
    recommendations: Option<Box<RawValue>>,
    promotions: Option<Box<RawValue>>,
    notifications: Option<Box<RawValue>>,
    recent_orders: Option<Vec<Order>>,
    degraded: Vec<&'static str>,
    stale: [&'static str; 0],
}

fn main() -> anyhow::Result<()> {
    let var = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
    let listen = var("BARE_LISTEN", "127.0.0.1:8080");
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    if let Ok(n) = std::env::var("BARE_WORKER_THREADS") {
        runtime.worker_threads(n.parse()?);
    }
    // reqwest is built with rustls but without a crypto provider, as in tributary.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let prefixes = std::array::from_fn(|i| {
        let env = format!("BARE_DOWNSTREAM_{}", SERVICES[i].to_uppercase());
        let base = var(&env, &format!("http://127.0.0.1:{}", 9001 + i));
        format!("{}/{}/", base.trim_end_matches('/'), SERVICES[i])
    });
    let database_url =
        std::env::var("DATABASE_URL").map_err(|_| anyhow::anyhow!("DATABASE_URL is not set"))?;
    let max_connections = var("BARE_DB_MAX_CONNECTIONS", "20").parse()?;
    runtime.build()?.block_on(async move {
        let db = PgPoolOptions::new()
            .max_connections(max_connections)
            .connect(&database_url)
            .await?;
        let client = reqwest::Client::builder()
            .timeout(Duration::from_millis(500))
            .build()?;
        let state = Arc::new(Bare {
            client,
            prefixes,
            db,
        });
        let app = Router::new()
            .route("/api/v1/dashboard/{user_id}", get(dashboard))
            .route("/readyz", get(|| async { "ready" }))
            .with_state(state);
        let listener = tokio::net::TcpListener::bind(&listen).await?;
        eprintln!("bare gateway on {}", listener.local_addr()?);
        axum::serve(listener, app).await?;
        anyhow::Ok(())
    })
}

/// One service's body, checked to be JSON and kept as its text.
async fn part(bare: &Bare, service: usize, user_id: i64) -> Option<Box<RawValue>> {
    let url = format!("{}{user_id}", bare.prefixes[service]);
    let response = bare.client.get(url).send().await.ok()?;
    if !response.status().is_success() {
        return None;
    }
    let body = response.bytes().await.ok()?;
    serde_json::from_slice(&body).ok()
}

async fn recent_orders(db: &sqlx::PgPool, user_id: i64) -> Option<Vec<Order>> {
    let rows: Vec<(i64, String, i64, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
        "SELECT id, status, total_cents, created_at FROM orders \
         WHERE user_id = $1 ORDER BY created_at DESC LIMIT 5",
    )
    .bind(user_id)
    .fetch_all(db)
    .await
    .ok()?;
    Some(
        rows.into_iter()
            .map(|(id, status, total_cents, created_at)| Order {
                id,
                status,
                total_cents,
                created_at,
            })
            .collect(),
    )
}

async fn dashboard(State(bare): State<Arc<Bare>>, Path(user_id): Path<i64>) -> Response {
    let b = &*bare;
    let (profile, cart, recommendations, promotions, notifications, orders) = tokio::join!(
        part(b, 0, user_id),
        part(b, 1, user_id),
        part(b, 2, user_id),
        part(b, 3, user_id),
        part(b, 4, user_id),
        recent_orders(&b.db, user_id),
    );
    let Some(profile) = profile else {
        return (StatusCode::BAD_GATEWAY, "users failed").into_response();
    };
    let mut degraded = Vec::new();
    for (name, missing) in [
        ("cart", cart.is_none()),
        ("recommendations", recommendations.is_none()),
        ("promotions", promotions.is_none()),
        ("notifications", notifications.is_none()),
        ("recent_orders", orders.is_none()),
    ] {
        if missing {
            degraded.push(name);
        }
    }
    Json(Dashboard {
        user_id,
        profile,
        cart,
        recommendations,
        promotions,
        notifications,
        recent_orders: orders,
        degraded,
        stale: [],
    })
    .into_response()
}
