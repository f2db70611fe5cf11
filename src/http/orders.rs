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
    extract::{JsonBody, PositiveId},
};
use crate::{
    db::orders::{CreateOutcome, NewItem, NewOrder},
    error::ApiError,
};

const IDEMPOTENCY_KEY: &str = "idempotency-key";
const MAX_ITEMS: usize = 100;

/// The request body as sent; validated into a [`NewOrder`].
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CreateOrder {
    pub user_id: i64,
    pub items: Vec<CreateItem>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CreateItem {
    pub sku: String,
    pub quantity: i32,
    pub unit_price_cents: i64,
}

/// Checks every field and computes the total; the error names the first bad field.
pub(super) fn validate(req: CreateOrder) -> Result<(NewOrder, i64), ApiError> {
    if req.user_id <= 0 {
        return Err(ApiError::validation(
            "user_id",
            "must be a positive integer",
        ));
    }
    if req.items.is_empty() {
        return Err(ApiError::validation(
            "items",
            "must contain at least one item",
        ));
    }
    if req.items.len() > MAX_ITEMS {
        return Err(ApiError::validation(
            "items",
            format!("must contain at most {MAX_ITEMS} items"),
        ));
    }
    let mut total: i64 = 0;
    let mut items = Vec::with_capacity(req.items.len());
    for (i, item) in req.items.into_iter().enumerate() {
        let sku = item.sku.trim();
        if sku.is_empty() || sku.len() > 64 || !sku.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ApiError::validation(
                format!("items[{i}].sku"),
                "must be 1 to 64 printable ASCII characters",
            ));
        }
        if !(1..=10_000).contains(&item.quantity) {
            return Err(ApiError::validation(
                format!("items[{i}].quantity"),
                "must be between 1 and 10000",
            ));
        }
        if item.unit_price_cents < 0 {
            return Err(ApiError::validation(
                format!("items[{i}].unit_price_cents"),
                "must not be negative",
            ));
        }
        total = i64::from(item.quantity)
            .checked_mul(item.unit_price_cents)
            .and_then(|line| total.checked_add(line))
            .ok_or_else(|| {
                ApiError::validation(
                    format!("items[{i}].unit_price_cents"),
                    "order total overflows",
                )
            })?;
        items.push(NewItem {
            sku: sku.to_owned(),
            quantity: item.quantity,
            unit_price_cents: item.unit_price_cents,
        });
    }
    Ok((
        NewOrder {
            user_id: req.user_id,
            items,
        },
        total,
    ))
}

fn idempotency_key(headers: &HeaderMap) -> Result<String, ApiError> {
    let value = headers
        .get(IDEMPOTENCY_KEY)
        .ok_or_else(|| ApiError::validation("Idempotency-Key", "header is required"))?;
    let key = value
        .to_str()
        .ok()
        .map(str::trim)
        .filter(|k| (1..=255).contains(&k.len()) && k.bytes().all(|b| b.is_ascii_graphic()))
        .ok_or_else(|| {
            ApiError::validation(
                "Idempotency-Key",
                "must be 1 to 255 printable ASCII characters",
            )
        })?;
    Ok(key.to_owned())
}

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

pub(super) async fn get_order(
    State(state): State<AppState>,
    PositiveId(id): PositiveId,
) -> Result<Response, ApiError> {
    match state.db.get_order(id).await? {
        Some(order) => Ok(Json(order).into_response()),
        None => Err(ApiError::NotFound),
    }
}
