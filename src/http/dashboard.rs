//! `GET /api/v1/dashboard/{user_id}`.

use axum::{
    Json,
    extract::State,
    http::{HeaderName, HeaderValue},
    response::{IntoResponse, Response},
};

use super::{AppState, extract::PositiveId};
use crate::{error::ApiError, fanout};

static SERVER_TIMING: HeaderName = HeaderName::from_static("server-timing");

pub(super) async fn get_dashboard(
    State(state): State<AppState>,
    PositiveId(user_id): PositiveId,
) -> Result<Response, ApiError> {
    if let Some(ctx) = crate::context::current() {
        ctx.set_user_id(user_id);
    }
    let (dashboard, timings) = fanout::dashboard(
        &state.downstreams,
        &state.db,
        &state.fanout_metrics,
        user_id,
    )
    .await?;
    let mut response = Json(dashboard).into_response();
    if let Ok(v) = HeaderValue::from_str(&timings.header_value()) {
        response.headers_mut().insert(SERVER_TIMING.clone(), v);
    }
    Ok(response)
}
