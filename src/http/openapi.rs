//! The OpenAPI 3.1 document of the API, generated from the code: each handler's
//! `#[utoipa::path]` attribute says its route, parameters and responses, and the types it reads
//! and writes derive their schemas, so a route cannot be served without being described.
//!
//! `utoipa-axum` registers a handler's route and its operation in one call ([`routes`]), so the
//! router in [`super::router`] is built from the same list as the document. What every route
//! shares, the request layers' headers (`x-request-id`, `x-request-budget-ms`, `traceparent`,
//! `tracestate`) and their answers (431, 500, the connection limit's 503), is added here once,
//! by [`common`]; the error answers are named responses in `components`, one per status.
//!
//! The document is static: it is rendered once, into [`Bytes`], and served at
//! `GET /openapi.json`. The committed `openapi.json` at the repository root is the same text;
//! `tributary openapi > openapi.json` (`make openapi`) writes it, and a test fails when it is
//! stale.

use std::sync::LazyLock;

use axum::{
    body::Bytes,
    http::{Method, header},
    response::{IntoResponse, Response},
};
use serde_json::{Value, json};
use utoipa::{
    OpenApi, ToResponse,
    openapi::{
        self, ContentBuilder, HeaderBuilder, ObjectBuilder, RefOr, ResponseBuilder,
        path::{HttpMethod, Operation, ParameterBuilder, ParameterIn, PathItem},
        schema::Type,
    },
};
use utoipa_axum::{router::OpenApiRouter, routes};

use super::AppState;
use crate::{
    downstream::BUDGET_HEADER,
    error::{PROBLEM_JSON, Problem},
};

/// The routes of the API's listener, each with its operation.
pub(super) fn api() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(super::dashboard::get_dashboard))
        .routes(routes!(super::orders::create_order))
        .routes(routes!(super::orders::get_order))
        .routes(routes!(super::health::healthz))
        .routes(routes!(super::health::readyz))
        .routes(routes!(openapi_json))
}

/// Every (route, method) a document describes: the router registers their request counters
/// at start-up.
pub(super) fn routes(doc: &openapi::OpenApi) -> Vec<(&str, Method)> {
    doc.paths
        .paths
        .iter()
        .flat_map(|(path, item)| {
            [
                (Method::GET, &item.get),
                (Method::POST, &item.post),
                (Method::PUT, &item.put),
                (Method::PATCH, &item.patch),
                (Method::DELETE, &item.delete),
            ]
            .into_iter()
            .filter(|(_, operation)| operation.is_some())
            .map(move |(method, _)| (path.as_str(), method))
        })
        .collect()
}

/// The whole document: the API's routes, what they share, and the operations listener's
/// `/metrics`.
pub fn document() -> openapi::OpenApi {
    let mut doc = api().into_openapi();
    common(&mut doc);
    doc.paths.paths.insert("/metrics".into(), metrics_path());
    doc
}

/// The document as served and committed: pretty JSON with a final newline.
pub fn render() -> String {
    let mut doc = serde_json::to_value(document()).expect("an OpenAPI document serialises");
    mark_required_headers(&mut doc);
    let mut text = serde_json::to_string_pretty(&doc).expect("a JSON value serialises");
    text.push('\n');
    text
}

/// Rendered once, on first use; [`prepare`] makes that first use the start-up.
static DOCUMENT: LazyLock<Bytes> = LazyLock::new(|| Bytes::from(render()));

/// Renders the document now, so that no request pays for it.
pub(super) fn prepare() {
    LazyLock::force(&DOCUMENT);
}

/// This document.
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "meta",
    responses((status = 200, description = "This OpenAPI document", body = Object,
        content_type = "application/json")),
)]
async fn openapi_json() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        DOCUMENT.clone(),
    )
        .into_response()
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "tributary",
        description = "A gateway-aggregation service (a BFF): one request fans out to five \
            services and Postgres, and whatever failed or was too slow is reported as degraded. \
            Errors are RFC 9457 problem documents.",
    ),
    servers((url = "http://127.0.0.1:8080", description = "The API listener (`server.listen`)")),
    tags(
        (name = "dashboard", description = "The aggregated page"),
        (name = "orders", description = "Idempotent order creation, and reading an order back"),
        (name = "health", description = "Liveness and readiness probes (never rate-limited or admission-controlled)"),
        (name = "meta", description = "This document"),
        (name = "operations", description = "The operations listener (`server.ops_listen`)"),
    ),
    components(
        schemas(Problem),
        responses(
            BadRequest, NotFound, RequestTimeout, Conflict, PayloadTooLarge,
            UnsupportedMediaType, TooManyRequests, HeaderFieldsTooLarge, InternalServerError,
            BadGateway, ServiceUnavailable, GatewayTimeout,
        ),
    ),
)]
struct ApiDoc;

/// `Retry-After`, in whole seconds, never 0.
fn retry_after() -> openapi::Header {
    HeaderBuilder::new()
        .schema(
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .minimum(Some(1)),
        )
        .description(Some("Seconds to wait before retrying; at least 1"))
        .build()
}

fn request_id() -> openapi::Header {
    HeaderBuilder::new()
        .schema(request_id_schema())
        .description(Some(
            "The caller's request id when it sent a well-formed one, else a generated one",
        ))
        .build()
}

fn request_id_schema() -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .pattern(Some("^[A-Za-z0-9._:-]{1,128}$"))
}

fn string_header(description: &str) -> openapi::Header {
    HeaderBuilder::new()
        .schema(ObjectBuilder::new().schema_type(Type::String))
        .description(Some(description))
        .build()
}

/// A problem-document response with the headers its status carries.
fn problem(description: &str, status: u16) -> RefOr<openapi::Response> {
    let mut response = ResponseBuilder::new()
        .description(description)
        .content(
            PROBLEM_JSON,
            ContentBuilder::new()
                .schema(Some(openapi::Ref::from_schema_name("Problem")))
                .build(),
        )
        .header("x-request-id", request_id());
    if matches!(status, 429 | 503) {
        response = response.header("Retry-After", retry_after());
    }
    if status == 429 {
        for (name, what) in [
            ("RateLimit-Limit", "The bucket size (`rate_limit.burst`)"),
            ("RateLimit-Remaining", "Requests left in the bucket: 0"),
            ("RateLimit-Reset", "Seconds until the bucket is full again"),
        ] {
            response = response.header(name, string_header(what));
        }
    }
    if matches!(status, 408 | 413 | 431) {
        response = response.header(
            "Connection",
            string_header("`close`: the rest of the request is not read"),
        );
    }
    response.build().into()
}

/// The named error responses, one per status; handlers list the ones they can give.
macro_rules! problem_responses {
    ($($name:ident = $status:literal: $description:literal;)*) => {$(
        #[doc = $description]
        pub(super) struct $name;

        impl<'r> ToResponse<'r> for $name {
            fn response() -> (&'r str, RefOr<openapi::Response>) {
                (stringify!($name), problem($description, $status))
            }
        }
    )*};
}

problem_responses! {
    BadRequest = 400: "A path parameter, header or body field is invalid; `field` names it";
    NotFound = 404: "The resource does not exist (for the dashboard: the users service does not know the user)";
    RequestTimeout = 408: "The body was not complete within `server.body_read_timeout` or the request's deadline; the connection is closed";
    Conflict = 409: "The `Idempotency-Key` was already used with a different order";
    PayloadTooLarge = 413: "The body is larger than `server.max_body_bytes`; the connection is closed";
    UnsupportedMediaType = 415: "The body is not JSON (`application/json` or a `+json` type)";
    TooManyRequests = 429: "This client is over its rate limit (\"you are too fast\"); only when `rate_limit.enabled`";
    HeaderFieldsTooLarge = 431: "More than `server.max_headers` headers, or a head over `server.max_header_bytes` (beyond twice those, hyper answers a bare 431 without a body)";
    InternalServerError = 500: "A fault of the gateway or of the database; the body is opaque and the cause is logged";
    BadGateway = 502: "The required users service failed or answered something that is not JSON";
    ServiceUnavailable = 503: "The gateway is full (admission, the connection limit), the users service's circuit is open or it is at its concurrency limit, the database pool is exhausted, or the database is unavailable";
    GatewayTimeout = 504: "The request's deadline passed (`server.request_deadline`, or the caller's `x-request-budget-ms`), or the users service timed out";
}

/// The request headers every route of the API's listener reads.
fn common_parameters() -> [openapi::path::Parameter; 4] {
    let header = |name: &str, schema: ObjectBuilder, description: &str| {
        ParameterBuilder::new()
            .name(name)
            .parameter_in(ParameterIn::Header)
            .required(openapi::Required::False)
            .schema(Some(schema))
            .description(Some(description))
            .build()
    };
    let string = || ObjectBuilder::new().schema_type(Type::String);
    [
        header(
            "x-request-id",
            request_id_schema(),
            "The caller's request id, echoed and logged; any other value is replaced by a \
             generated one",
        ),
        header(
            BUDGET_HEADER.as_str(),
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .format(Some(openapi::SchemaFormat::KnownFormat(
                    openapi::KnownFormat::Int64,
                )))
                .minimum(Some(0)),
            "The caller's remaining time budget in milliseconds: the request's deadline is the \
             smaller of it and `server.request_deadline`; a value that is not a whole number is \
             ignored",
        ),
        header(
            "traceparent",
            string().pattern(Some("^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")),
            "W3C trace context; the request joins the caller's trace. A value whose fields are \
             not lowercase hex of their exact lengths is ignored",
        ),
        header(
            "tracestate",
            string().max_length(Some(512)),
            "W3C trace state, passed on to the downstreams (its first 32 members; not at all \
             when those are longer than 512 characters)",
        ),
    ]
}

/// Adds what every route of the API's listener shares: the request layers' headers, their
/// answers (431, 500, and the connection limit's 503 where a route has no 503 of its own) and
/// `x-request-id` on every response.
fn common(doc: &mut openapi::OpenApi) {
    let shared = [
        (431, "HeaderFieldsTooLarge"),
        (500, "InternalServerError"),
        (503, "ServiceUnavailable"),
    ];
    for item in doc.paths.paths.values_mut() {
        for operation in operations(item) {
            operation
                .parameters
                .get_or_insert_with(Vec::new)
                .extend(common_parameters());
            for (status, name) in shared {
                operation
                    .responses
                    .responses
                    .entry(status.to_string())
                    .or_insert_with(|| openapi::Ref::from_response_name(name).into());
            }
            for response in operation.responses.responses.values_mut() {
                if let RefOr::T(response) = response {
                    response
                        .headers
                        .entry("x-request-id".into())
                        .or_insert_with(request_id);
                }
            }
        }
    }
}

fn operations(item: &mut PathItem) -> impl Iterator<Item = &mut Operation> {
    [
        item.get.as_mut(),
        item.put.as_mut(),
        item.post.as_mut(),
        item.delete.as_mut(),
        item.options.as_mut(),
        item.head.as_mut(),
        item.patch.as_mut(),
        item.trace.as_mut(),
    ]
    .into_iter()
    .flatten()
}

/// `/metrics` is served by the operations listener only, without the request layers.
fn metrics_path() -> PathItem {
    let text = |description: &str| {
        ResponseBuilder::new()
            .description(description)
            .content(
                "text/plain; version=0.0.4; charset=utf-8",
                ContentBuilder::new()
                    .schema(Some(ObjectBuilder::new().schema_type(Type::String)))
                    .build(),
            )
            .build()
    };
    let mut operation = Operation::new();
    operation.tags = Some(vec!["operations".into()]);
    operation.operation_id = Some("metrics".into());
    operation.summary = Some("Prometheus metrics, in the text exposition format".into());
    operation.description = Some(
        "Served on `server.ops_listen` (default port 9090) with copies of `/healthz` and \
         `/readyz`; the API's listener answers 404."
            .into(),
    );
    operation.responses = openapi::ResponsesBuilder::new()
        .response("200", text("The metrics"))
        .response(
            "404",
            text("Metrics are disabled (`telemetry.metrics_enabled = false`)"),
        )
        .build();
    let mut item = PathItem::new(HttpMethod::Get, operation);
    item.servers = Some(vec![
        openapi::server::ServerBuilder::new()
            .url("http://127.0.0.1:9090")
            .description(Some("The operations listener (`server.ops_listen`)"))
            .build(),
    ]);
    item
}

/// utoipa's response header has no `required` member (5.5); OpenAPI's does. The headers the
/// gateway always sends are marked required, so that clients may rely on them and schemathesis'
/// `response_headers_conformance` holds the gateway to them: `x-request-id` on every response
/// but a 503 (the connection limit answers before a request has an id), `Retry-After` on every
/// 429 and every problem 503.
fn mark_required_headers(doc: &mut Value) {
    let require = |response: &mut Value, name: &str| {
        if let Some(header) = response.pointer_mut(&format!("/headers/{name}")) {
            header["required"] = json!(true);
        }
    };
    if let Some(responses) = doc
        .pointer_mut("/components/responses")
        .and_then(Value::as_object_mut)
    {
        for (name, response) in responses {
            if name != "ServiceUnavailable" {
                require(response, "x-request-id");
            }
            require(response, "Retry-After");
        }
    }
    if let Some(paths) = doc.pointer_mut("/paths").and_then(Value::as_object_mut) {
        for operation in paths
            .values_mut()
            .filter_map(Value::as_object_mut)
            .flat_map(|item| item.values_mut())
        {
            let Some(responses) = operation
                .get_mut("responses")
                .and_then(Value::as_object_mut)
            else {
                continue;
            };
            for (status, response) in responses {
                if status != "503" {
                    require(response, "x-request-id");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::{DASHBOARD, ORDER, ORDERS};

    /// `cargo test` runs this in CI (.ci/run's test step), so a stale `openapi.json` fails CI
    /// without a step of its own.
    #[test]
    fn the_committed_openapi_json_is_the_generated_document() {
        let committed = include_str!("../../openapi.json");
        assert!(
            committed == render(),
            "openapi.json is not the document the code generates: regenerate it with \
             `make openapi` (cargo run --quiet -- openapi > openapi.json) and commit it"
        );
    }

    #[test]
    fn the_document_describes_every_route_the_edge_knows() {
        let doc = document();
        for path in [DASHBOARD, ORDERS, ORDER, "/healthz", "/readyz", "/metrics"] {
            assert!(
                doc.paths.paths.contains_key(path),
                "{path} is not described"
            );
        }
    }

    #[test]
    fn the_routes_whose_counters_are_registered_are_the_served_ones() {
        let doc = api().into_openapi();
        let mut routes = routes(&doc);
        routes.sort_by_key(|(path, _)| *path);
        assert_eq!(
            routes,
            [
                (DASHBOARD, Method::GET),
                (ORDERS, Method::POST),
                (ORDER, Method::GET),
                ("/healthz", Method::GET),
                ("/openapi.json", Method::GET),
                ("/readyz", Method::GET),
            ]
        );
    }

    #[test]
    fn every_operation_lists_the_shared_headers_and_answers() {
        let doc: Value = serde_json::from_str(&render()).unwrap();
        for (path, item) in doc["paths"].as_object().unwrap() {
            if path == "/metrics" {
                continue;
            }
            for (method, operation) in item.as_object().unwrap() {
                let names: Vec<&str> = operation["parameters"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|p| p["name"].as_str().unwrap())
                    .collect();
                for header in [
                    "x-request-id",
                    BUDGET_HEADER.as_str(),
                    "traceparent",
                    "tracestate",
                ] {
                    assert!(names.contains(&header), "{method} {path}: no {header}");
                }
                for status in ["431", "500", "503"] {
                    assert!(
                        operation["responses"].get(status).is_some(),
                        "{method} {path}: no {status}"
                    );
                }
            }
        }
        assert_eq!(
            doc["components"]["responses"]["TooManyRequests"]["headers"]["Retry-After"]["required"],
            true
        );
    }
}
