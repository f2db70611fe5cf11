//! Liveness, readiness and the Prometheus scrape endpoint.
//!
//! Liveness says only that the process serves HTTP; restarting a gateway because its database
//! is down would not bring the database back. Readiness says whether this replica should get
//! traffic: the database answers, migrations are applied, and admission is not shedding heavily.

use axum::{
    Json,
    extract::State,
    http::{StatusCode, header},
    response::{IntoResponse, Response},
};
use serde_json::json;

use super::AppState;

pub(super) async fn healthz() -> impl IntoResponse {
    Json(json!({ "status": "ok" }))
}

pub(super) async fn readyz(State(state): State<AppState>) -> Response {
    let database = state.db.is_ready().await;
    let shedding = state.admission.as_ref().is_some_and(|a| a.is_shedding());
    let draining = state.draining.load(std::sync::atomic::Ordering::Relaxed);
    // Shedding is reported either way; it makes the replica unready only when configured to.
    let shed_out = shedding && state.settings.admission.shedding_turns_unready;
    let ready = database.is_ok() && !shed_out && !draining;
    let body = json!({
        "status": if ready { "ready" } else { "not ready" },
        "database": match &database { Ok(()) => "ok".to_owned(), Err(e) => e.clone() },
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
