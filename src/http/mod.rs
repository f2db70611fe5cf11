//! The HTTP surface: state, routes, and the tower stack, declared in one place.
//!
//! Layers are listed outermost first in [`router`]; each carries a one-line reason. The health
//! routes are not admission-controlled or rate-limited (the edge passes them): they must answer
//! precisely when the gateway is overloaded, and they are cheap. `/metrics` is not on the API's
//! port at all: it is served, with copies of the health routes, by [`ops_router`] on
//! `server.ops_listen`.

pub mod admin;
mod cache_admin;
mod dashboard;
mod edge;
mod extract;
mod health;
mod middleware;
pub mod openapi;
mod orders;
pub(crate) mod pushback;

/// Hidden seams for the micro-benchmarks in `benches/` (the handlers and the request layers are
/// crate-private): the dashboard's merge and serialisation, the request span and the access
/// line. Not an API.
#[doc(hidden)]
pub use dashboard::dashboard_response;
#[doc(hidden)]
pub use middleware::{access_line, request_span};

use std::sync::{Arc, atomic::AtomicBool};

use axum::{Router, extract::DefaultBodyLimit, routing::get};
use tower::ServiceBuilder;

use crate::{
    admission::Admission, config::Settings, db::Db, downstream::Downstreams, error::ApiError,
    fanout::FanoutMetrics, ratelimit::RateLimiter, routing::Routing, telemetry::Telemetry,
};

/// The admission-controlled routes; the edge matches them by path before the router runs.
/// They are the paths of the handlers' `#[utoipa::path]` attributes, which register the routes
/// (a test in `openapi` checks that the document has each).
pub(crate) const DASHBOARD: &str = "/api/v1/dashboard/{user_id}";
pub(crate) const ORDERS: &str = "/api/v1/orders";
pub(crate) const ORDER: &str = "/api/v1/orders/{id}";

/// Everything a handler may need, built once at start-up. Cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub settings: Arc<Settings>,
    pub db: Db,
    pub downstreams: Arc<Downstreams>,
    /// Grey releases: which deployment of each downstream serves a request.
    pub routing: Arc<Routing>,
    pub admission: Option<Arc<Admission>>,
    pub(crate) rate_limiter: Option<Arc<RateLimiter>>,
    pub(crate) telemetry: Arc<Telemetry>,
    /// The dashboard fan-out's critical-path counters and overhead histogram.
    pub(crate) fanout_metrics: Arc<FanoutMetrics>,
    /// Set once shutdown has begun: readiness turns false so load balancers stop routing here.
    pub(crate) draining: Arc<AtomicBool>,
}

/// The operations endpoints, served on `server.ops_listen`: `/metrics`, `/healthz` and
/// `/readyz`, and with `server.admin` the cache invalidation of [`cache_admin`] (the routing admin
/// routes of [`admin`] are added by the application, with `routing.admin`). No request layers:
/// a scrape is not API traffic, so it is neither limited nor counted in the API's RED metrics.
pub fn ops_router(state: AppState) -> Router {
    let router = Router::new()
        .route("/metrics", get(health::metrics))
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz));
    // Not mounted at all unless asked for: a disabled admin API is a 404, like any unknown path.
    let router = if state.settings.server.admin {
        router
            .route(
                "/admin/cache/{downstream}",
                axum::routing::delete(cache_admin::invalidate_all),
            )
            .route(
                "/admin/cache/{downstream}/{key}",
                axum::routing::delete(cache_admin::invalidate_key),
            )
    } else {
        router
    };
    router
        .fallback(|| async { ApiError::NotFound })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
        .with_state(state)
}

/// The whole application as a pure value: tests can drive it with `oneshot` or serve it.
/// `extra` routes (tests, diagnostics) get the same request layers as the API.
pub fn router(state: AppState, extra: Router<AppState>) -> Router {
    // The API's routes and the probes (pointed at the API's port: what they check is that
    // this port answers), each registered with its OpenAPI operation; the document is
    // rendered now, once.
    let (api, doc) = openapi::api().split_for_parts();
    openapi::prepare();
    let api = api.merge(extra);

    // Their request counters exist at 0 from start-up (the `extra` routes of tests are not
    // known here; they appear with their first request).
    state.telemetry.register_routes(&openapi::routes(&doc));

    let server = Arc::new(state.settings.server.clone());
    let edge = Arc::new(edge::Edge {
        admission: state.admission.clone(),
        rate_limiter: state.rate_limiter.clone(),
        telemetry: Arc::clone(&state.telemetry),
        pushback: state.settings.admission.pushback,
    });
    // A disabled feature adds no layer.
    let edge = edge.active().then(|| edge::EdgeLayer(edge));
    api.fallback(|| async { ApiError::NotFound })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
        .layer(
            ServiceBuilder::new()
                // Rate limit (429) then admission (503), before anything else is spent on the
                // request: under overload most requests end here, and what a "no" costs
                // decides what is left for the admitted ones.
                .option_layer(edge)
                // Request id, deadline and trace context into the task-local; the request span
                // around everything below.
                .layer(middleware::ContextLayer {
                    request_deadline: state.settings.server.request_deadline,
                })
                // RED metrics by route template, the one access line, and the one error line
                // with the cause chain for unexpected errors; a request the client abandons is
                // recorded as 499.
                .layer(middleware::RecordLayer {
                    telemetry: Arc::clone(&state.telemetry),
                })
                // A poll that blocks the worker thread is counted and logged in the request's
                // span.
                .layer(middleware::WatchPollsLayer {
                    telemetry: Arc::clone(&state.telemetry),
                })
                // 431 problem for heads over the configured limits, before any work is done.
                .layer(middleware::HeaderLimitsLayer { server })
                // Every route is bounded by the request's deadline: 504, and whatever the
                // request held (admission permit, pooled connection) is let go.
                .layer(middleware::DeadlineLayer)
                // A panic in a handler becomes an opaque 500 instead of a dropped connection.
                .layer(tower_http::catch_panic::CatchPanicLayer::custom(
                    middleware::panic_response,
                ))
                // Marks credentials as sensitive, so that no layer that logs headers (there is
                // none today) could print them.
                .layer(
                    tower_http::sensitive_headers::SetSensitiveRequestHeadersLayer::new([
                        http::header::AUTHORIZATION,
                        http::header::COOKIE,
                    ]),
                )
                // Bodies beyond the limit are refused with 413 before they are buffered.
                .layer(DefaultBodyLimit::max(
                    state.settings.server.max_body_bytes.get(),
                )),
        )
        .with_state(state)
}
