//! The routing admin endpoints (grey releases), on the operations listener and only with
//! `routing.admin = true`:
//!
//! - `GET /admin/routing`: the routing table and the live comparison of each variant with
//!   stable (calls, error ratio and p99 over the rollback window, in-flight calls, status);
//! - `POST /admin/routing/{downstream}/{variant}/pause` and `.../resume`: take a variant's
//!   percentage traffic away, or give it back (also after an automatic rollback);
//! - `POST /admin/routing/reload`: what SIGHUP does, with the verdict in the answer.
//!
//! Off by default and never on the API's port: these routes change where traffic goes, and the
//! operations port is for operators and Prometheus. A module of its own so that other admin
//! routes on the same listener stay apart from these.

use axum::{
    Json, Router,
    extract::{Path, State},
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use serde_json::json;

use super::AppState;
use crate::error::Problem;

/// `router` with the routing admin routes when `routing.admin` is on; `router` as it is
/// otherwise.
pub fn with_routing_admin(router: Router, state: &AppState) -> Router {
    if !state.settings.routing.admin {
        return router;
    }
    router.merge(
        Router::new()
            .route("/admin/routing", get(table))
            .route("/admin/routing/reload", post(reload))
            .route("/admin/routing/{downstream}/{variant}/pause", post(pause))
            .route("/admin/routing/{downstream}/{variant}/resume", post(resume))
            .with_state(state.clone()),
    )
}

async fn table(State(state): State<AppState>) -> Response {
    Json(state.routing.describe()).into_response()
}

async fn pause(
    State(state): State<AppState>,
    Path((downstream, variant)): Path<(String, String)>,
) -> Response {
    match state.routing.pause(&downstream, &variant) {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => problem(StatusCode::NOT_FOUND, "not-found", e.to_string()),
    }
}

async fn resume(
    State(state): State<AppState>,
    Path((downstream, variant)): Path<(String, String)>,
) -> Response {
    match state.routing.resume(&downstream, &variant) {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => problem(StatusCode::NOT_FOUND, "not-found", e.to_string()),
    }
}

async fn reload(State(state): State<AppState>) -> Response {
    match state.routing.reload("admin").await {
        Ok(generation) => Json(json!({ "generation": generation })).into_response(),
        // The running routing stays; the reason is the configuration's own one-line message.
        Err(reason) => problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "configuration-refused",
            reason,
        ),
    }
}

fn problem(status: StatusCode, kind: &str, detail: String) -> Response {
    let body = Problem {
        kind: format!("/problems/{kind}"),
        title: status.canonical_reason().unwrap_or("Error"),
        status: status.as_u16(),
        detail: Some(detail),
        field: None,
        request_id: None,
    };
    let mut response = (status, Json(body)).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}
