//! The edge: rate limiting and admission, decided before any other work on a request.
//!
//! Under overload most requests are turned away, so what a "no" costs decides how much of the
//! core is left for the requests admitted. Here it costs a path match, a semaphore try and a
//! pre-rendered answer: no request span, no task-local context, no trace-context parsing, no
//! log line (the counters, `tributary_admission_rejections_total` and the RED metrics, and one
//! rate-limited warning from the admission control loop carry it), and no timer unless a wait
//! can help ([`crate::admission::Limiter::try_admit`]). That is why this layer is the
//! outermost of the stack, and why it matches paths itself: axum's router has not run yet.
//!
//! 429 comes before 503: a client over its own rate limit must not take an admission slot from
//! the others. A 503 to an HTTP/1 client that came back before its last `Retry-After` is held
//! until then ([`super::pushback`]).

use std::sync::Arc;

use axum::{
    body::Body,
    extract::{ConnectInfo, Request, State},
    http::{HeaderValue, Response, StatusCode, Version, header},
    middleware::Next,
    response::IntoResponse,
};
use tokio::time::Instant;

use super::{DASHBOARD, ORDER, ORDERS, middleware::request_id_or_new, pushback::Pushback};
use crate::{
    admission::{Admission, Decision, Limiter, Rejected},
    config::RouteGroup,
    error::{ApiError, PROBLEM_JSON},
    ratelimit::{self, RateLimiter},
    telemetry::Telemetry,
};

/// When the request reached the gateway; the request's deadline counts from here, so time
/// spent waiting for a permit is part of its budget.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Arrival(pub(crate) Instant);

/// The admission-controlled routes: (group, route template) by path.
fn classify(path: &str) -> Option<(RouteGroup, &'static str)> {
    let one_segment = |rest: &str| !rest.is_empty() && !rest.contains('/');
    if let Some(rest) = path.strip_prefix("/api/v1/dashboard/") {
        return one_segment(rest).then_some((RouteGroup::Dashboard, DASHBOARD));
    }
    if path == ORDERS {
        return Some((RouteGroup::Orders, ORDERS));
    }
    let rest = path.strip_prefix("/api/v1/orders/")?;
    one_segment(rest).then_some((RouteGroup::Orders, ORDER))
}

const SHED_BODY: &str = r#"{"type":"/problems/unavailable","title":"Service Unavailable","status":503,"detail":"the gateway is at its admission limit; retry later"}"#;

/// What the edge needs, built once.
pub(crate) struct Edge {
    pub(crate) admission: Option<Arc<Admission>>,
    pub(crate) rate_limiter: Option<Arc<RateLimiter>>,
    pub(crate) telemetry: Arc<Telemetry>,
    pub(crate) pushback: bool,
}

impl Edge {
    /// Whether the edge has anything to do.
    pub(crate) fn active(&self) -> bool {
        self.admission.is_some() || self.rate_limiter.is_some()
    }
}

/// Rate limit, then admission, for the routes that have them; everything else passes.
pub(crate) async fn edge(
    State(edge): State<Arc<Edge>>,
    mut request: Request,
    next: Next,
) -> axum::response::Response {
    let arrived = Instant::now();
    let Some((group, route)) = classify(request.uri().path()) else {
        return next.run(request).await;
    };
    request.extensions_mut().insert(Arrival(arrived));

    if let Some(limiter) = &edge.rate_limiter {
        let peer = request
            .extensions()
            .get::<ConnectInfo<std::net::SocketAddr>>()
            .map(|c| c.0.ip());
        match limiter.check(request.headers(), peer).await {
            ratelimit::Decision::Allowed { headers } => {
                let mut response = admit(&edge, group, route, request, next, arrived).await;
                response.headers_mut().extend(headers);
                return response;
            }
            ratelimit::Decision::Limited {
                headers,
                retry_after,
            } => {
                let mut response = ApiError::RateLimited { retry_after }.into_response();
                response.headers_mut().extend(headers);
                stamp(&mut response, &request);
                edge.telemetry
                    .record_request(route, request.method(), 429, arrived.elapsed());
                return response;
            }
        }
    }
    admit(&edge, group, route, request, next, arrived).await
}

async fn admit(
    edge: &Edge,
    group: RouteGroup,
    route: &'static str,
    request: Request,
    next: Next,
    arrived: Instant,
) -> axum::response::Response {
    let Some(admission) = &edge.admission else {
        return next.run(request).await;
    };
    let limiter: Arc<Limiter> = admission.limiter(group);
    let permit = match limiter.try_admit() {
        Decision::Admitted(permit) => permit,
        Decision::Rejected(rejected) => return shed(edge, route, &request, rejected, arrived),
        Decision::Wait => match limiter.wait().await {
            Ok(permit) => permit,
            Err(rejected) => return shed(edge, route, &request, rejected, arrived),
        },
    };
    let response = next.run(request).await;
    drop(permit);
    response
}

/// The 503: a pre-rendered problem, `Retry-After`, the request id, the RED metrics, and the
/// connection's pushback.
fn shed(
    edge: &Edge,
    route: &'static str,
    request: &Request,
    rejected: Rejected,
    arrived: Instant,
) -> axum::response::Response {
    let secs = rejected.retry_after.as_secs_f64().ceil().max(1.0) as u64;
    let mut response = Response::new(Body::from(SHED_BODY));
    *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    stamp(&mut response, request);
    if edge.pushback
        && request.version() <= Version::HTTP_11
        && let Some(pushback) = request.extensions().get::<Arc<Pushback>>()
    {
        pushback.rejected(rejected.retry_after);
    }
    edge.telemetry
        .record_request(route, request.method(), 503, arrived.elapsed());
    response
}

/// Every answer carries the request id, the caller's when it sent a valid one.
fn stamp(response: &mut axum::response::Response, request: &Request) {
    let id = request_id_or_new(request.headers());
    if let Ok(v) = HeaderValue::from_str(&id) {
        response.headers_mut().insert("x-request-id", v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_edge_knows_the_admitted_routes_by_path() {
        assert_eq!(
            classify("/api/v1/dashboard/42"),
            Some((RouteGroup::Dashboard, DASHBOARD))
        );
        assert_eq!(
            classify("/api/v1/orders"),
            Some((RouteGroup::Orders, ORDERS))
        );
        assert_eq!(
            classify("/api/v1/orders/7"),
            Some((RouteGroup::Orders, ORDER))
        );
        for other in [
            "/metrics",
            "/readyz",
            "/api/v1/dashboard/",
            "/api/v1/dashboard/1/x",
            "/api/v1/orders/",
            "/api/v1/ordersx",
        ] {
            assert_eq!(classify(other), None, "{other}");
        }
    }

    #[test]
    fn the_shed_body_is_a_problem_document() {
        let v: serde_json::Value = serde_json::from_str(SHED_BODY).unwrap();
        assert_eq!(v["status"], 503);
        assert_eq!(v["type"], "/problems/unavailable");
    }
}
