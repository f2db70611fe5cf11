//! `GET /api/v1/dashboard/{user_id}`.

use std::convert::Infallible;

use axum::{
    Json,
    extract::{FromRequestParts, State},
    http::{HeaderName, HeaderValue, request::Parts},
    response::{IntoResponse, Response},
};

use super::{
    AppState,
    extract::PositiveId,
    openapi::{
        BadGateway, BadRequest, GatewayTimeout, NotFound, ServiceUnavailable, TooManyRequests,
    },
};
use crate::{error::ApiError, fanout, fanout::Dashboard, routing::Captured};

static SERVER_TIMING: HeaderName = HeaderName::from_static("server-timing");

/// The request headers the routing rules read (grey releases), and the routing table they will
/// be read against; nothing is copied while no variant can receive traffic.
pub(super) struct RouteInput(Option<Captured>);

impl FromRequestParts<AppState> for RouteInput {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Infallible> {
        Ok(Self(state.routing.capture(&parts.headers)))
    }
}

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
    RouteInput(captured): RouteInput,
) -> Result<Response, ApiError> {
    let route = state.routing.route(captured, user_id);
    if let Some(ctx) = crate::context::current() {
        ctx.set_user_id(user_id);
        if let Some(tag) = route.tag() {
            ctx.set_variants(tag);
        }
    }
    let (dashboard, timings) =
        fanout::dashboard(&route, &state.db, &state.fanout_metrics, user_id).await?;
    let mut response = Json(dashboard).into_response();
    if let Ok(v) = HeaderValue::from_str(&timings.header_value()) {
        response.headers_mut().insert(SERVER_TIMING.clone(), v);
    }
    Ok(response)
}
