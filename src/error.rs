//! The HTTP API's error type: every outcome a client can see that is not a success.
//!
//! Each variant is a client-visible outcome with one status; the mapping is the single `match`
//! in [`ApiError::status`]. Bodies are RFC 9457 `application/problem+json`. Client errors say
//! what was wrong (down to the field); server errors are opaque: their cause chain is never
//! sent. Turning an error into a response logs nothing; the response carries the error in its
//! extensions, and the request layer (`http::middleware::RecordLayer`) logs it once, inside the
//! request's span: every error in the access line, and [the unexpected
//! ones](ApiError::is_unexpected) at ERROR with their cause chain.

use std::{sync::Arc, time::Duration};

use axum::{
    Json,
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use serde::Serialize;

use crate::{db::DbError, domain::Service, downstream::CallError};

pub(crate) const PROBLEM_JSON: &str = "application/problem+json";

#[derive(Debug, thiserror::Error)]
pub(crate) enum ApiError {
    /// 400: a path parameter, header or body field is invalid.
    #[error("invalid {field}: {detail}")]
    Validation { field: String, detail: String },
    /// 404: the route or the resource does not exist.
    #[error("not found")]
    NotFound,
    /// 404: an admin request names a downstream that does not exist or has no cache.
    #[error("no such cache: {0}")]
    NoSuchCache(String),
    /// 405: the route exists but not with this method.
    #[error("method not allowed")]
    MethodNotAllowed,
    /// 409: an idempotency key was reused with a different request body.
    #[error("idempotency key reused with a different request")]
    IdempotencyConflict,
    /// 408: the request body did not arrive within `server.body_read_timeout` (or the
    /// request's deadline, when that comes first).
    #[error("request body not received in time")]
    RequestTimeout { within: Duration },
    /// 413: the request body is larger than `server.max_body_bytes`.
    #[error("request body too large")]
    PayloadTooLarge { limit: usize },
    /// 431: more request headers, or a larger request head, than the server accepts.
    #[error("request header fields too large")]
    HeaderFieldsTooLarge {
        max_headers: usize,
        max_bytes: usize,
    },
    /// 415: the body is not JSON.
    #[error("unsupported media type")]
    UnsupportedMediaType,
    /// 429: this client is sending faster than its rate limit ("you are too fast").
    #[error("rate limit exceeded")]
    RateLimited { retry_after: Duration },
    /// 502: a required downstream answered with an error or an invalid body.
    #[error("required downstream {service} failed")]
    BadGateway {
        service: Service,
        #[source]
        cause: CallError,
    },
    /// 503: the gateway is full or a required dependency is known to be down ("we are full").
    #[error("service unavailable: {reason}")]
    Unavailable {
        reason: &'static str,
        retry_after: Duration,
    },
    /// 504: the request deadline passed, or a required downstream timed out.
    #[error("gateway timeout")]
    GatewayTimeout,
    /// 500: the database reported a fault of its own (not an outage: that is a 503). A value
    /// of our own, not an `anyhow::Error`, so it captures no backtrace: with `RUST_BACKTRACE`
    /// set, anyhow walks the stack for every error it wraps, on the request's worker.
    #[error("database error")]
    Database(#[source] DbError),
    /// 500: anything else; the cause is logged, never shown.
    #[error(transparent)]
    Internal(#[from] anyhow::Error),
}

/// What a database failure means for the request: a database that cannot be reached or refuses
/// the gateway, and an exhausted pool, are "try again later" (503), a budget spent is the
/// deadline's 504, and only the database's other faults are a 500.
impl From<DbError> for ApiError {
    fn from(e: DbError) -> Self {
        match e {
            DbError::BudgetExhausted | DbError::StatementTimeout => ApiError::GatewayTimeout,
            DbError::PoolTimedOut => ApiError::Unavailable {
                reason: "database pool exhausted",
                retry_after: Duration::from_secs(1),
            },
            // The cause is logged once, by the database's health, when it goes down.
            DbError::Unavailable(_) | DbError::KnownDown => ApiError::Unavailable {
                reason: "the database is unavailable",
                retry_after: Duration::from_secs(2),
            },
            e @ DbError::Database(_) => ApiError::Database(e),
        }
    }
}

impl ApiError {
    pub(crate) fn validation(field: impl Into<String>, detail: impl Into<String>) -> Self {
        ApiError::Validation {
            field: field.into(),
            detail: detail.into(),
        }
    }

    /// Whether this error is one nobody intended, worth an ERROR line with its cause: a 500,
    /// or a required downstream that failed. The others are answers the gateway chose (a
    /// full gateway's 503, an open circuit's 503, a deadline's 504, every 4xx); they are in
    /// the access line and the metrics, and logging each at ERROR would flood the log exactly
    /// during the overload they report.
    pub(crate) fn is_unexpected(&self) -> bool {
        matches!(
            self,
            ApiError::Internal(_) | ApiError::Database(_) | ApiError::BadGateway { .. }
        )
    }

    pub(crate) fn status(&self) -> StatusCode {
        match self {
            ApiError::Validation { .. } => StatusCode::BAD_REQUEST,
            ApiError::NotFound | ApiError::NoSuchCache(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::IdempotencyConflict => StatusCode::CONFLICT,
            ApiError::RequestTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::HeaderFieldsTooLarge { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ApiError::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::BadGateway { .. } => StatusCode::BAD_GATEWAY,
            ApiError::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::GatewayTimeout => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Database(_) | ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn problem(&self) -> Problem {
        let status = self.status();
        let (kind, detail, field) = match self {
            ApiError::Validation { field, detail } => (
                "validation",
                Some(format!("{field}: {detail}")),
                Some(field.clone()),
            ),
            ApiError::NotFound => ("not-found", None, None),
            ApiError::NoSuchCache(detail) => ("not-found", Some(detail.clone()), None),
            ApiError::MethodNotAllowed => ("method-not-allowed", None, None),
            ApiError::IdempotencyConflict => (
                "idempotency-conflict",
                Some("this Idempotency-Key was already used with a different request body".into()),
                Some("Idempotency-Key".into()),
            ),
            ApiError::RequestTimeout { within } => (
                "request-timeout",
                Some(format!(
                    "the request body was not complete within {} ms",
                    within.as_millis()
                )),
                None,
            ),
            ApiError::PayloadTooLarge { limit } => (
                "payload-too-large",
                Some(format!("the request body must not exceed {limit} bytes")),
                None,
            ),
            ApiError::HeaderFieldsTooLarge {
                max_headers,
                max_bytes,
            } => (
                "header-fields-too-large",
                Some(format!(
                    "at most {max_headers} request headers and {max_bytes} bytes of request head are accepted"
                )),
                None,
            ),
            ApiError::UnsupportedMediaType => (
                "unsupported-media-type",
                Some("the request body must be application/json".into()),
                None,
            ),
            ApiError::RateLimited { .. } => (
                "rate-limited",
                Some("too many requests from this client; slow down and retry later".into()),
                None,
            ),
            ApiError::BadGateway { service, .. } => (
                "bad-gateway",
                Some(format!("the required {service} service failed")),
                None,
            ),
            ApiError::Unavailable { reason, .. } => {
                ("unavailable", Some(format!("{reason}; retry later")), None)
            }
            ApiError::GatewayTimeout => (
                "gateway-timeout",
                Some("the request could not be answered within its deadline".into()),
                None,
            ),
            ApiError::Database(_) | ApiError::Internal(_) => ("internal", None, None),
        };
        Problem {
            kind: format!("/problems/{kind}"),
            title: status.canonical_reason().unwrap_or("Error"),
            status: status.as_u16(),
            detail,
            field,
            request_id: crate::context::current().map(|c| c.request_id.to_string()),
        }
    }

    /// Answers given while the request body may still be arriving: the connection is closed
    /// after them, so the rest of that body is never read.
    fn closes_connection(&self) -> bool {
        matches!(
            self,
            ApiError::RequestTimeout { .. } | ApiError::PayloadTooLarge { .. }
        )
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            ApiError::RateLimited { retry_after } | ApiError::Unavailable { retry_after, .. } => {
                Some(*retry_after)
            }
            _ => None,
        }
    }
}

/// An error and all its causes on one line (`a: b: c`), for logs: reqwest and hyper keep the
/// interesting part (connection refused, reset by peer) in the source chain. Each part is its
/// `Display`, never its `Debug`, which for an `anyhow::Error` is a whole backtrace when
/// `RUST_BACKTRACE` is set; a cause that only repeats the end of what is already written (sqlx
/// writes the server's message in the error and again in its source) is left out.
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = cause.source();
    }
    out
}

/// RFC 9457 problem details.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct Problem {
    /// A relative URI naming the kind of problem, e.g. `/problems/validation`.
    #[serde(rename = "type")]
    #[schema(example = "/problems/validation")]
    pub kind: String,
    /// The status's reason phrase.
    #[schema(value_type = String, example = "Bad Request")]
    pub title: &'static str,
    #[schema(minimum = 400, maximum = 599)]
    pub status: u16,
    /// What was wrong, for a person.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub detail: Option<String>,
    /// Extension member: which input was wrong (`items[0].quantity`, `Idempotency-Key`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub field: Option<String>,
    /// Extension member: the request id, to quote to support.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub request_id: Option<String>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let mut response = (status, Json(self.problem())).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(after) = self.retry_after() {
            // Retry-After is whole seconds; never advertise 0, which invites an instant retry storm.
            let secs = after.as_secs_f64().ceil().max(1.0) as u64;
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if self.closes_connection() {
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        // For the request layer, which logs it.
        response.extensions_mut().insert(Arc::new(self));
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn internal_errors_do_not_leak_their_cause() {
        let resp =
            ApiError::Internal(anyhow::anyhow!("password=hunter2 at db:5432")).into_response();
        assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(resp.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
        let body = axum::body::to_bytes(resp.into_body(), 4096).await.unwrap();
        let text = String::from_utf8(body.to_vec()).unwrap();
        assert!(!text.contains("hunter2"), "{text}");
        assert!(text.contains("\"status\":500"));
    }

    /// The backtrace anyhow captured for this error, if any.
    fn captured_backtrace(e: &ApiError) -> Option<&std::backtrace::Backtrace> {
        match e {
            ApiError::Internal(e) => Some(e.backtrace())
                .filter(|b| b.status() == std::backtrace::BacktraceStatus::Captured),
            _ => None,
        }
    }

    #[test]
    #[ignore = "run by the next test, in a process of its own with RUST_LIB_BACKTRACE=1"]
    fn with_backtraces_on_a_database_fault_captures_none_and_no_error_line_prints_one() {
        assert_eq!(
            std::env::var("RUST_LIB_BACKTRACE").as_deref(),
            Ok("1"),
            "run with RUST_LIB_BACKTRACE=1"
        );
        let fault = ApiError::from(DbError::Database(sqlx::Error::Protocol(
            "unexpected message".into(),
        )));
        assert_eq!(fault.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert!(fault.is_unexpected());
        assert!(
            captured_backtrace(&fault).is_none(),
            "an expected failure captured a backtrace"
        );
        assert_eq!(
            chain(&fault),
            "database error: encountered unexpected or invalid data: unexpected message"
        );
        // A truly internal error may carry one, but its log line never prints it.
        let internal = ApiError::Internal(anyhow::anyhow!("boom"));
        assert!(captured_backtrace(&internal).is_some(), "backtraces are on");
        assert_eq!(chain(&internal), "boom");
    }

    #[test]
    fn expected_errors_capture_no_backtrace_even_with_backtraces_on() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "error::tests::with_backtraces_on_a_database_fault_captures_none_and_no_error_line_prints_one",
                "--exact",
                "--ignored",
            ])
            .env("RUST_LIB_BACKTRACE", "1")
            .output()
            .expect("the test binary runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn a_cause_that_repeats_its_error_is_written_once() {
        #[derive(Debug, thiserror::Error)]
        #[error("error returned from database: {0}")]
        struct Outer(#[source] Inner);
        #[derive(Debug, thiserror::Error)]
        #[error("relation \"x\" does not exist")]
        struct Inner;
        assert_eq!(
            chain(&Outer(Inner)),
            "error returned from database: relation \"x\" does not exist"
        );
    }

    #[test]
    fn retry_after_is_at_least_one_second() {
        let resp = ApiError::Unavailable {
            reason: "full",
            retry_after: Duration::from_millis(10),
        }
        .into_response();
        assert_eq!(resp.headers()[header::RETRY_AFTER], "1");
    }
}
