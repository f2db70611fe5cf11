//! `GET /api/v1/dashboard/{user_id}`.

use std::convert::Infallible;

use axum::{
    Json,
    extract::{FromRequestParts, State},
    http::{HeaderName, HeaderValue, request::Parts},
    response::{IntoResponse, Response},
};

use super::{AppState, extract::PositiveId};
use crate::{error::ApiError, fanout, routing::Captured};

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
