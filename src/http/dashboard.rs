//! `GET /api/v1/dashboard/{user_id}`.

use std::{convert::Infallible, time::Duration};

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
use serde_json::value::RawValue;

use crate::{
    db::OrderSummary,
    error::ApiError,
    fanout::{self, Dashboard, Timings},
    routing::Captured,
};

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
    Ok(respond(dashboard, &timings))
}

/// The merged dashboard as a response: the JSON body and `Server-Timing`.
fn respond(dashboard: Dashboard, timings: &Timings) -> Response {
    let mut response = Json(dashboard).into_response();
    if let Ok(v) = HeaderValue::from_str(&timings.header_value()) {
        response.headers_mut().insert(SERVER_TIMING.clone(), v);
    }
    response
}

/// What the handler does after the fan-out, without the fan-out: the five services' bodies
/// (in [`Service::ALL`](crate::domain::Service::ALL) order, users first) and the recent
/// orders, each with how long it took, merged and serialised into the response, the parts'
/// metrics recorded on `state`'s instruments. Every part counts as fresh.
///
/// Public (and hidden) only for the dashboard micro-benchmark in `benches/`: the fan-out and
/// the handler are crate-private, and the merge has no seam of its own outside the crate.
#[doc(hidden)]
pub fn dashboard_response(
    state: &AppState,
    user_id: i64,
    parts: [(Box<RawValue>, Duration); 5],
    recent_orders: (Vec<OrderSummary>, Duration),
    total: Duration,
) -> Response {
    let (dashboard, timings) =
        fanout::merge_fetched(&state.fanout_metrics, user_id, total, parts, recent_orders);
    respond(dashboard, &timings)
}
