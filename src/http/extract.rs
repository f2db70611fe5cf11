//! Extractors whose rejections are problem documents that name the offending input.

use axum::{
    body::Bytes,
    extract::{FromRequest, FromRequestParts, Path, Request},
    http::{StatusCode, header, request::Parts},
};
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// A positive 64-bit id from the single path parameter (`{user_id}`, `{id}`).
pub(super) struct PositiveId(pub i64);

impl<S: Send + Sync> FromRequestParts<S> for PositiveId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Path(params) = Path::<Vec<(String, String)>>::from_request_parts(parts, state)
            .await
            .map_err(|_| ApiError::validation("path", "malformed path"))?;
        let (name, raw) = params
            .into_iter()
            .next()
            .ok_or_else(|| ApiError::validation("path", "missing id"))?;
        parse_positive_id(&raw)
            .map(PositiveId)
            .ok_or_else(|| ApiError::validation(name, "must be a positive 64-bit integer"))
    }
}

pub(super) fn parse_positive_id(raw: &str) -> Option<i64> {
    // Digits only: no sign, no whitespace, no leading '+', which `str::parse` would accept.
    if raw.is_empty() || !raw.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    raw.parse::<i64>().ok().filter(|v| *v > 0)
}

/// A JSON body whose errors say which field was wrong (`items[1].quantity: invalid type ...`).
pub(super) struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let is_json = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|m| {
                let m = m.trim();
                m.eq_ignore_ascii_case("application/json") || m.ends_with("+json")
            });
        if !is_json {
            return Err(ApiError::UnsupportedMediaType);
        }
        let limit = req
            .extensions()
            .get::<BodyLimit>()
            .map(|l| l.0)
            .unwrap_or(usize::MAX);
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge { limit }
            } else {
                ApiError::validation("body", "could not be read")
            }
        })?;
        let de = &mut serde_json::Deserializer::from_slice(&bytes);
        serde_path_to_error::deserialize(de)
            .map(JsonBody)
            .map_err(|e| {
                let path = e.path().to_string();
                let field = if path == "." { "body".to_owned() } else { path };
                ApiError::validation(field, e.inner().to_string())
            })
    }
}

/// The configured body limit, for the 413 problem's detail.
#[derive(Clone, Copy)]
pub(super) struct BodyLimit(pub usize);

#[cfg(test)]
mod tests {
    use super::parse_positive_id;

    #[test]
    fn ids_must_be_plain_positive_integers() {
        assert_eq!(parse_positive_id("1"), Some(1));
        assert_eq!(parse_positive_id("9223372036854775807"), Some(i64::MAX));
        for bad in [
            "0",
            "-1",
            "+1",
            " 1",
            "1.0",
            "abc",
            "",
            "9223372036854775808",
        ] {
            assert_eq!(parse_positive_id(bad), None, "{bad:?}");
        }
    }
}
