//! Liveness, readiness and the Prometheus scrape endpoint.
//!
//! Liveness says only that the process serves HTTP; restarting a gateway because its database
//! is down would not bring the database back. Readiness says whether *this replica* can serve:
//! it is not draining, its code matches the schema (no migration of this binary pending), and,
//! with `admission.shedding_turns_unready`, admission is not shedding heavily. It does not require the database: every replica shares
//! it, the dashboard degrades without it, and a readiness that followed it would take the whole
//! fleet out of the load balancer during an outage, so that the degraded page is never served.
//! The database's state is in the body (a fixed word, never the driver's error, which is
//! logged once when the state changes) and in `tributary_db_up`.

use axum::{
    Json,
    extract::State,
    http::{StatusCode, header},
    response::{IntoResponse, Response},
};
use serde_json::json;

use super::AppState;
use crate::{db::DbState, error::Problem};

/// What `/healthz` answers.
#[derive(utoipa::ToSchema)]
#[expect(
    dead_code,
    reason = "a schema only: the handler writes the same object with json!"
)]
pub(super) struct Liveness {
    #[schema(schema_with = ok_schema)]
    status: String,
}

/// What `/readyz` answers, ready or not.
#[derive(utoipa::ToSchema)]
#[expect(
    dead_code,
    reason = "a schema only: the handler writes the same object with json!"
)]
pub(super) struct Readiness {
    /// `ready` or `not ready`.
    #[schema(schema_with = ready_schema)]
    status: String,
    /// The database's state, as a fixed word (never the driver's error).
    #[schema(schema_with = database_schema)]
    database: String,
    /// Whether admission is shedding heavily.
    shedding: bool,
    /// Whether shutdown has begun.
    draining: bool,
}

fn words(words: &[&str]) -> utoipa::openapi::Object {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .enum_values(Some(words.iter().copied()))
        .build()
}

fn ok_schema() -> utoipa::openapi::Object {
    words(&["ok"])
}

fn ready_schema() -> utoipa::openapi::Object {
    words(&["ready", "not ready"])
}

fn database_schema() -> utoipa::openapi::Object {
    words(&DbState::ALL.map(DbState::as_str))
}

/// Liveness: the process serves HTTP.
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "health",
    responses((status = 200, description = "The process serves HTTP", body = Liveness)),
)]
pub(super) async fn healthz() -> impl IntoResponse {
    Json(json!({ "status": "ok" }))
}

/// Readiness: this replica can serve (not draining, no migration pending, and, when configured,
/// not shedding heavily). The database's state is reported but does not decide it.
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "health",
    responses(
        (status = 200, description = "Ready", body = Readiness),
        (status = 503, description = "Not ready (draining, a migration pending, or shedding), \
            or the connection limit is reached (a problem document)",
            content(
                (Readiness = "application/json"),
                (Problem = "application/problem+json"),
            )),
    ),
)]
pub(super) async fn readyz(State(state): State<AppState>) -> Response {
    let database = state.db.readiness().await;
    let shedding = state.admission.as_ref().is_some_and(|a| a.is_shedding());
    let draining = state.draining.load(std::sync::atomic::Ordering::Relaxed);
    // Shedding is reported either way; it makes the replica unready only when configured to.
    let shed_out = shedding && state.settings.admission.shedding_turns_unready;
    let ready = database != DbState::MigrationsPending && !shed_out && !draining;
    let body = json!({
        "status": if ready { "ready" } else { "not ready" },
        "database": database.as_str(),
        "shedding": shedding,
        "draining": draining,
    });
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body)).into_response()
}

pub(super) async fn metrics(State(state): State<AppState>) -> Response {
    match state.telemetry.render_metrics() {
        Some(text) => (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        None => (StatusCode::NOT_FOUND, "metrics are disabled\n").into_response(),
    }
}
