//! `POST /api/v1/orders` (idempotent by `Idempotency-Key`) and `GET /api/v1/orders/{id}`.

use axum::{
    Json,
    extract::State,
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::{
    AppState,
    extract::{JsonBody, Object, PositiveId, Whole},
    openapi::{
        BadRequest, Conflict, GatewayTimeout, NotFound, PayloadTooLarge, RequestTimeout,
        ServiceUnavailable, TooManyRequests, UnsupportedMediaType,
    },
};
use crate::db::orders::Order;
use crate::{
    db::orders::{CreateOutcome, NewItem, NewOrder},
    error::ApiError,
};

const IDEMPOTENCY_KEY: &str = "idempotency-key";
const MAX_ITEMS: usize = 100;

// The request body as sent; validated into a `NewOrder`. Every field is required; they are
// `Option`s so that a missing one is reported by `validate` under its own name (serde would
// name the object that lacks it). The schema in the OpenAPI document is the one `validate`
// enforces: every field required, with its bounds.
/// A new order: the user and one to 100 items. Unknown fields are refused.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct CreateOrder {
    #[schema(value_type = i64, minimum = 1)]
    pub user_id: Option<Whole<i64>>,
    #[schema(value_type = Vec<CreateItem>, min_items = 1, max_items = 100)]
    pub items: Option<Vec<Object<CreateItem>>>,
}

/// One line of a new order.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct CreateItem {
    /// Printable ASCII; whitespace around it is trimmed.
    #[schema(value_type = String, pattern = r"^[!-~]{1,64}$", example = "SKU-1")]
    pub sku: Option<String>,
    #[schema(value_type = i32, minimum = 1, maximum = 10_000)]
    pub quantity: Option<Whole<i32>>,
    /// The order's total (the sum of quantity × unit price) must fit a signed 64-bit
    /// integer; beyond it, a 400.
    #[schema(value_type = i64, minimum = 0)]
    pub unit_price_cents: Option<Whole<i64>>,
}

/// A required field's value, or a 400 that names it.
fn required<T>(value: Option<T>, field: impl FnOnce() -> String) -> Result<T, ApiError> {
    value.ok_or_else(|| ApiError::validation(field(), "is required"))
}

/// Checks every field and computes the total; the error names the first bad field.
pub(super) fn validate(req: CreateOrder) -> Result<(NewOrder, i64), ApiError> {
    let Whole(user_id) = required(req.user_id, || "user_id".into())?;
    let req_items = required(req.items, || "items".into())?;
    if user_id <= 0 {
        return Err(ApiError::validation(
            "user_id",
            "must be a positive integer",
        ));
    }
    if req_items.is_empty() {
        return Err(ApiError::validation(
            "items",
            "must contain at least one item",
        ));
    }
    if req_items.len() > MAX_ITEMS {
        return Err(ApiError::validation(
            "items",
            format!("must contain at most {MAX_ITEMS} items"),
        ));
    }
    let mut total: i64 = 0;
    let mut items = Vec::with_capacity(req_items.len());
    for (i, Object(item)) in req_items.into_iter().enumerate() {
        let field = |name: &str| format!("items[{i}].{name}");
        let sku = required(item.sku, || field("sku"))?;
        let Whole(quantity) = required(item.quantity, || field("quantity"))?;
        let Whole(unit_price_cents) =
            required(item.unit_price_cents, || field("unit_price_cents"))?;
        let sku = sku.trim();
        if sku.is_empty() || sku.len() > 64 || !sku.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ApiError::validation(
                field("sku"),
                "must be 1 to 64 printable ASCII characters",
            ));
        }
        if !(1..=10_000).contains(&quantity) {
            return Err(ApiError::validation(
                field("quantity"),
                "must be between 1 and 10000",
            ));
        }
        if unit_price_cents < 0 {
            return Err(ApiError::validation(
                field("unit_price_cents"),
                "must not be negative",
            ));
        }
        total = i64::from(quantity)
            .checked_mul(unit_price_cents)
            .and_then(|line| total.checked_add(line))
            .ok_or_else(|| {
                ApiError::validation(field("unit_price_cents"), "order total overflows")
            })?;
        items.push(NewItem {
            sku: sku.to_owned(),
            quantity,
            unit_price_cents,
        });
    }
    Ok((NewOrder { user_id, items }, total))
}

/// The `Idempotency-Key`, exactly once. Whitespace around a header value is HTTP's optional
/// whitespace, not part of the value (RFC 9110, section 5.5): the HTTP layer strips it before
/// the key is read, so `Idempotency-Key:  k1 ` is the key `k1`. Whitespace inside is refused.
fn idempotency_key(headers: &HeaderMap) -> Result<String, ApiError> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let value = values
        .next()
        .ok_or_else(|| ApiError::validation("Idempotency-Key", "header is required"))?;
    if values.next().is_some() {
        // Which of two keys names the order is a guess either way; a wrong guess creates a
        // duplicate order or replays someone else's answer.
        return Err(ApiError::validation(
            "Idempotency-Key",
            "header must be sent exactly once",
        ));
    }
    let key = value
        .to_str()
        .ok()
        .filter(|k| (1..=255).contains(&k.len()) && k.bytes().all(|b| b.is_ascii_graphic()))
        .ok_or_else(|| {
            ApiError::validation(
                "Idempotency-Key",
                "must be 1 to 255 printable ASCII characters",
            )
        })?;
    Ok(key.to_owned())
}

/// Creates an order, once per `Idempotency-Key`.
///
/// The same key with the same order replays the stored response byte for byte (with
/// `idempotent-replayed: true`); the same key with a different order is a 409. Concurrent
/// duplicates create exactly one order.
#[utoipa::path(
    post,
    path = "/api/v1/orders",
    tag = "orders",
    params(
        ("Idempotency-Key" = String, Header,
            description = "1 to 255 printable ASCII characters, sent once; names the order for retries",
            pattern = r"^[!-~]{1,255}$", example = "order-2026-12-01-0001"),
    ),
    request_body(content = CreateOrder, content_type = "application/json"),
    responses(
        (status = 201, description = "The order, created now or replayed for a repeated key",
            body = Order,
            headers(("idempotent-replayed" = String,
                description = "`true` when this is the stored response of an earlier request with this key"))),
        (status = 400, response = BadRequest),
        (status = 408, response = RequestTimeout),
        (status = 409, response = Conflict),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 429, response = TooManyRequests),
        (status = 503, response = ServiceUnavailable),
        (status = 504, response = GatewayTimeout),
    ),
)]
pub(super) async fn create_order(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<CreateOrder>,
) -> Result<Response, ApiError> {
    let key = idempotency_key(&headers)?;
    let (order, total) = validate(body)?;
    if let Some(ctx) = crate::context::current() {
        ctx.set_user_id(order.user_id);
    }
    // The hash is over the validated, normalised request, so the same order sent with other
    // whitespace or key order replays instead of conflicting.
    let canonical = serde_json::to_vec(&order).map_err(anyhow::Error::from)?;
    let hash = Sha256::digest(&canonical);
    let outcome = state.db.create_order(&key, &hash, &order, total).await?;
    Ok(match outcome {
        CreateOutcome::Created { body } => stored_response(StatusCode::CREATED, body, false),
        CreateOutcome::Replayed { status, body } => stored_response(
            StatusCode::from_u16(status).unwrap_or(StatusCode::CREATED),
            body,
            true,
        ),
        CreateOutcome::Conflict => return Err(ApiError::IdempotencyConflict),
    })
}

fn stored_response(status: StatusCode, body: String, replayed: bool) -> Response {
    let mut response = (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response();
    if replayed {
        response
            .headers_mut()
            .insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    response
}

/// Reads an order back.
#[utoipa::path(
    get,
    path = "/api/v1/orders/{id}",
    tag = "orders",
    params(("id" = i64, Path, minimum = 1, description = "The order's id: a positive 64-bit integer, digits only")),
    responses(
        (status = 200, description = "The order", body = Order),
        (status = 400, response = BadRequest),
        (status = 404, response = NotFound),
        (status = 429, response = TooManyRequests),
        (status = 503, response = ServiceUnavailable),
        (status = 504, response = GatewayTimeout),
    ),
)]
pub(super) async fn get_order(
    State(state): State<AppState>,
    PositiveId(id): PositiveId,
) -> Result<Response, ApiError> {
    match state.db.get_order(id).await? {
        Some(order) => Ok(Json(order).into_response()),
        None => Err(ApiError::NotFound),
    }
}
