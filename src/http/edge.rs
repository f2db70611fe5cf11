//! The edge: rate limiting and admission, decided before any other work on a request.
//!
//! Under overload most requests are turned away, so what a "no" costs decides how much of the
//! core is left for the requests admitted. Here it costs a path match, a semaphore try and a
//! pre-rendered answer, decided when the layer is called (a tower service with a future of its
//! own, not a `from_fn` middleware that would box and clone the stack first): no request span,
//! no task-local context, no trace-context parsing, no log line (the counters,
//! `tributary_admission_rejections_total` and the RED metrics, and one rate-limited warning
//! from the admission control loop carry it), and no timer unless a wait can help
//! ([`crate::admission::Limiter::try_admit`]). That is why this layer is the
//! outermost of the request layers (axum runs them after routing, around each route). It
//! classifies the path itself, three fixed prefixes, and a unit test keeps that classification
//! equal to the admission-controlled routes.
//!
//! 429 comes before 503: a client over its own rate limit must not take an admission slot from
//! the others. A 503 to an HTTP/1 client that came back before its last `Retry-After` is held
//! until then ([`super::pushback`]), the edge's own and one from beneath it alike (a required
//! part's open circuit answers 503 with `Retry-After` too).

use std::{
    convert::Infallible,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
};

use axum::{
    body::Body,
    extract::{ConnectInfo, Request},
    http::{HeaderValue, Response, StatusCode, Version, header},
    response::IntoResponse,
};
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt};

use super::{DASHBOARD, ORDER, ORDERS, middleware::request_id_or_new, pushback::Pushback};
use crate::{
    admission::{Admission, Decision, Limiter, Permit, Rejected},
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

/// The edge as a tower layer; [`Edge::active`] says whether it is needed at all.
#[derive(Clone)]
pub(crate) struct EdgeLayer(pub(crate) Arc<Edge>);

impl<S> Layer<S> for EdgeLayer {
    type Service = EdgeService<S>;

    fn layer(&self, inner: S) -> EdgeService<S> {
        EdgeService {
            inner,
            edge: Arc::clone(&self.0),
        }
    }
}

/// [`EdgeLayer`]'s service. The common answers are decided when it is called, with no
/// allocation of its own: a path that is not admission-controlled passes, a permit taken at
/// once is held by the response future, and a "no" is a ready 503. Only what must wait (a rate
/// limit decision, which may ask Redis, or a permit within `max_wait`) becomes a boxed future
/// that owns a clone of the stack beneath.
#[derive(Clone)]
pub(crate) struct EdgeService<S> {
    inner: S,
    edge: Arc<Edge>,
}

type ApiResponse = axum::response::Response;

impl<S> Service<Request> for EdgeService<S>
where
    S: Service<Request, Response = ApiResponse, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = ApiResponse;
    type Error = Infallible;
    type Future = EdgeFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request) -> Self::Future {
        let arrived = Instant::now();
        let Some((group, route)) = classify(request.uri().path()) else {
            return EdgeFuture::Pass {
                inner: self.inner.call(request),
            };
        };
        request.extensions_mut().insert(Arrival(arrived));
        let edge = &self.edge;
        if edge.rate_limiter.is_some() {
            // The called service is the one that was made ready; its clone takes its place.
            let inner = self.inner.clone();
            let inner = std::mem::replace(&mut self.inner, inner);
            let edge = Arc::clone(edge);
            return EdgeFuture::Waiting {
                inner: Box::pin(rate_limited(edge, group, route, request, inner, arrived)),
            };
        }
        let Some(admission) = &edge.admission else {
            return EdgeFuture::Pass {
                inner: self.inner.call(request),
            };
        };
        let limiter: Arc<Limiter> = admission.limiter(group);
        match limiter.try_admit() {
            Decision::Admitted(permit) => EdgeFuture::Admitted {
                pushback: connection_pushback(edge, &request).cloned(),
                inner: self.inner.call(request),
                permit: Some(permit),
            },
            Decision::Rejected(rejected) => EdgeFuture::Ready {
                response: Some(shed(edge, route, &request, rejected, arrived)),
            },
            Decision::Wait => {
                let inner = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, inner);
                let edge = Arc::clone(edge);
                EdgeFuture::Waiting {
                    inner: Box::pin(async move {
                        waited(&edge, &limiter, route, request, inner, arrived).await
                    }),
                }
            }
        }
    }
}

pin_project! {
    /// What the edge decided: pass, admitted with its permit held until the answer is ready
    /// (and the connection's pushback, for a 503 from beneath), answered already, or waiting
    /// (boxed: the rare case).
    #[project = EdgeProj]
    pub(crate) enum EdgeFuture<F> {
        Pass { #[pin] inner: F },
        Admitted {
            #[pin] inner: F,
            permit: Option<Permit>,
            pushback: Option<Arc<Pushback>>,
        },
        Ready { response: Option<ApiResponse> },
        Waiting { inner: Pin<Box<dyn Future<Output = ApiResponse> + Send>> },
    }
}

impl<F> Future for EdgeFuture<F>
where
    F: Future<Output = Result<ApiResponse, Infallible>>,
{
    type Output = Result<ApiResponse, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            EdgeProj::Pass { inner } => inner.poll(cx),
            EdgeProj::Admitted {
                inner,
                permit,
                pushback,
            } => {
                let Ok(mut response) = ready!(inner.poll(cx));
                drop(permit.take());
                if let Some(pushback) = pushback.take() {
                    push_back(&mut response, &pushback);
                }
                Poll::Ready(Ok(response))
            }
            EdgeProj::Ready { response } => Poll::Ready(Ok(response
                .take()
                .expect("EdgeFuture::Ready polled after it completed"))),
            EdgeProj::Waiting { inner } => inner.as_mut().poll(cx).map(Ok),
        }
    }
}

/// The stack beneath, with `permit` held until it has answered.
async fn held<F>(permit: Permit, pushback: Option<Arc<Pushback>>, response: F) -> ApiResponse
where
    F: Future<Output = Result<ApiResponse, Infallible>>,
{
    let Ok(mut response) = response.await;
    drop(permit);
    if let Some(pushback) = pushback {
        push_back(&mut response, &pushback);
    }
    response
}

/// The connection's pushback, when the edge applies it to this request (HTTP/1 only: an
/// HTTP/2 connection carries many clients' streams).
fn connection_pushback<'r>(edge: &Edge, request: &'r Request) -> Option<&'r Arc<Pushback>> {
    if !edge.pushback || request.version() > Version::HTTP_11 {
        return None;
    }
    request.extensions().get::<Arc<Pushback>>()
}

/// `Retry-After` in whole seconds, never 0 (which invites an instant retry storm).
fn retry_after_secs(after: std::time::Duration) -> HeaderValue {
    HeaderValue::from(after.as_secs_f64().ceil().max(1.0) as u64)
}

/// A 503 with `Retry-After` from beneath the edge (the required part's circuit is open, or its
/// bulkhead is full) is a "come back later" like the edge's own, and a client that retries at
/// once is held for it the same way. Without this such a client was answered at once every
/// time: with 5,000 connections that retried at once the lab's core answered 13,000–20,000 of
/// these 503s a second while the users circuit was open, the half-open probes queued behind
/// them, and the circuit closed up to 3 s after `open_for` ran out; with the hold, within
/// 0.6 s (bench/results/experiments/breaker-pushback).
fn push_back(response: &mut ApiResponse, pushback: &Pushback) {
    if response.status() != StatusCode::SERVICE_UNAVAILABLE {
        return;
    }
    let Some(secs) = response
        .headers()
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
    else {
        return;
    };
    let retry_after = std::time::Duration::from_secs(secs);
    let stay_away = pushback.rejected(retry_after).stay_away;
    if stay_away > retry_after {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, retry_after_secs(stay_away));
    }
}

/// A permit within `max_wait`, then the stack beneath with it held; or the 503.
async fn waited<S>(
    edge: &Edge,
    limiter: &Arc<Limiter>,
    route: &'static str,
    request: Request,
    inner: S,
    arrived: Instant,
) -> ApiResponse
where
    S: Service<Request, Response = ApiResponse, Error = Infallible>,
{
    match limiter.wait().await {
        Ok(permit) => {
            let pushback = connection_pushback(edge, &request).cloned();
            held(permit, pushback, inner.oneshot(request)).await
        }
        Err(rejected) => shed(edge, route, &request, rejected, arrived),
    }
}

/// Rate limit, then admission (waiting for a permit if it must).
async fn rate_limited<S>(
    edge: Arc<Edge>,
    group: RouteGroup,
    route: &'static str,
    request: Request,
    inner: S,
    arrived: Instant,
) -> ApiResponse
where
    S: Service<Request, Response = ApiResponse, Error = Infallible>,
{
    let Some(limiter) = &edge.rate_limiter else {
        return admit(&edge, group, route, request, inner, arrived).await;
    };
    let peer = request
        .extensions()
        .get::<ConnectInfo<std::net::SocketAddr>>()
        .map(|c| c.0.ip());
    match limiter.check(request.headers(), peer).await {
        ratelimit::Decision::Allowed { headers } => {
            let mut response = admit(&edge, group, route, request, inner, arrived).await;
            response.headers_mut().extend(headers);
            response
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
            response
        }
    }
}

async fn admit<S>(
    edge: &Edge,
    group: RouteGroup,
    route: &'static str,
    request: Request,
    inner: S,
    arrived: Instant,
) -> ApiResponse
where
    S: Service<Request, Response = ApiResponse, Error = Infallible>,
{
    let Some(admission) = &edge.admission else {
        let Ok(response) = inner.oneshot(request).await;
        return response;
    };
    let limiter: Arc<Limiter> = admission.limiter(group);
    match limiter.try_admit() {
        Decision::Admitted(permit) => {
            let pushback = connection_pushback(edge, &request).cloned();
            held(permit, pushback, inner.oneshot(request)).await
        }
        Decision::Rejected(rejected) => shed(edge, route, &request, rejected, arrived),
        Decision::Wait => waited(edge, &limiter, route, request, inner, arrived).await,
    }
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
    let mut retry_after = rejected.retry_after;
    if let Some(pushback) = connection_pushback(edge, request) {
        // A client back early is asked to stay away longer each time (the pushback's doubling).
        retry_after = retry_after.max(pushback.rejected(retry_after).stay_away);
    }
    let mut response = Response::new(Body::from(SHED_BODY));
    *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    headers.insert(header::RETRY_AFTER, retry_after_secs(retry_after));
    stamp(&mut response, request);
    edge.telemetry
        .record_request(route, request.method(), 503, arrived.elapsed());
    response
}

/// Every answer carries the request id, the caller's when it sent a valid one.
fn stamp(response: &mut axum::response::Response, request: &Request) {
    let id = request_id_or_new(request.headers());
    if let Ok(v) = HeaderValue::from_str(&id) {
        response
            .headers_mut()
            .insert(crate::context::REQUEST_ID_HEADER, v);
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
