//! `GET /api/v1/dashboard/{user_id}`.

use axum::{
    Json,
    extract::State,
    http::{HeaderName, HeaderValue},
    response::{IntoResponse, Response},
};

use super::{
    AppState,
    extract::PositiveId,
    openapi::{
        BadGateway, BadRequest, GatewayTimeout, NotFound, ServiceUnavailable, TooManyRequests,
    },
};
use crate::{error::ApiError, fanout, fanout::Dashboard};

static SERVER_TIMING: HeaderName = HeaderName::from_static("server-timing");

/// The user's dashboard: six parts fetched concurrently; the optional ones that fail are
/// `null` and named in `degraded`.
#[utoipa::path(
    get,
    path = "/api/v1/dashboard/{user_id}",
    tag = "dashboard",
    params(("user_id" = i64, Path, minimum = 1, description = "A positive 64-bit integer, digits only")),
    responses(
        (status = 200, description = "The dashboard, possibly degraded", body = Dashboard,
            headers(("server-timing" = String,
                description = "Each part's duration, the gateway's own overhead and the total, in ms"))),
        (status = 400, response = BadRequest),
        (status = 404, response = NotFound),
        (status = 429, response = TooManyRequests),
        (status = 502, response = BadGateway),
        (status = 503, response = ServiceUnavailable),
        (status = 504, response = GatewayTimeout),
    ),
)]
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
