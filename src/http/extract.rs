//! Extractors whose rejections are problem documents that name the offending input.

use std::{fmt, marker::PhantomData};

use axum::{
    body::Bytes,
    extract::{FromRequest, FromRequestParts, Path, Request},
    http::{HeaderMap, StatusCode, header, request::Parts},
};
use serde::{
    Deserialize, Deserializer,
    de::{DeserializeOwned, MapAccess, Visitor, value::MapAccessDeserializer},
};
use serde_json::error::Category;

use super::AppState;
use crate::{context, error::ApiError};

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

/// A JSON object body, read within the body bounds and parsed strictly: nothing may follow
/// the object, an array never stands in for an object, and an error names the field that was
/// wrong (`items[1].quantity: invalid type ...`) or says where the JSON broke.
///
/// The bounds are `server.max_body_bytes` (a larger declared `Content-Length` is refused
/// before a byte is read; a body that grows past it is cut off by the router's
/// `DefaultBodyLimit`) and `server.body_read_timeout` or the request's deadline, whichever
/// comes first: a body that is not complete by then is a 408, so a client that sends its body
/// a byte at a time cannot hold the request's admission permit for longer than that.
pub(super) struct JsonBody<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        if !is_json(req.headers()) {
            return Err(ApiError::UnsupportedMediaType);
        }
        let server = &state.settings.server;
        let limit = server.max_body_bytes.get();
        if declared_length(req.headers()).is_some_and(|n| n > limit as u64) {
            return Err(ApiError::PayloadTooLarge { limit });
        }
        let within = server.body_read_timeout.min(context::remaining());
        let bytes = match tokio::time::timeout(within, Bytes::from_request(req, state)).await {
            Err(_) => return Err(ApiError::RequestTimeout { within }),
            Ok(Err(rejection)) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                return Err(ApiError::PayloadTooLarge { limit });
            }
            Ok(Err(_)) => return Err(ApiError::validation("body", "could not be read")),
            Ok(Ok(bytes)) => bytes,
        };
        parse_object(&bytes).map(JsonBody)
    }
}

/// `application/json` or a structured `+json` type (`application/merge-patch+json`), compared
/// case-insensitively as media types are; a bare `+json` or `json` is neither.
pub(super) fn is_json(headers: &HeaderMap) -> bool {
    let Some(essence) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
    else {
        return false;
    };
    let Some((kind, subtype)) = essence.trim().split_once('/') else {
        return false;
    };
    let token = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$&-^_.+".contains(&b))
    };
    if !token(kind) || !token(subtype) {
        return false;
    }
    if kind.eq_ignore_ascii_case("application") && subtype.eq_ignore_ascii_case("json") {
        return true;
    }
    // A structured syntax suffix needs a subtype in front of it.
    subtype.len() > "+json".len()
        && subtype
            .get(subtype.len() - "+json".len()..)
            .is_some_and(|suffix| suffix.eq_ignore_ascii_case("+json"))
}

/// The body length the client declared, if it declared one that parses.
fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Parses one JSON object and nothing after it into `T`.
pub(super) fn parse_object<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let not_json = |e: &serde_json::Error| {
        ApiError::validation(
            "body",
            format!(
                "body is not valid JSON at line {} column {}",
                e.line(),
                e.column()
            ),
        )
    };
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    let Object(value) = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let inner = e.inner();
        if matches!(inner.classify(), Category::Syntax | Category::Eof) {
            return not_json(inner);
        }
        let path = e.path().to_string();
        let field = if path == "." { "body".to_owned() } else { path };
        ApiError::validation(field, inner.to_string())
    })?;
    // Valid JSON followed by anything but whitespace is not one JSON document.
    de.end().map_err(|e| not_json(&e))?;
    Ok(value)
}

/// A `T` that must be written as a JSON object. serde's derived structs also accept an array of
/// their fields in order (`[1, [["SKU-1", 2, 1250]]]` for an order); a public API should not:
/// nobody documents it, and it silently changes meaning when a field is added.
#[derive(Debug)]
pub(super) struct Object<T>(pub T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ObjectVisitor<T>(PhantomData<T>);

        impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjectVisitor<T> {
            type Value = T;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(MapAccessDeserializer::new(map))
            }
        }

        deserializer
            .deserialize_map(ObjectVisitor(PhantomData))
            .map(Object)
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;
    use serde_json::json;

    use super::*;

    fn content_type(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_str(value).unwrap());
        headers
    }

    #[test]
    fn json_media_types_are_json_and_a_bare_suffix_is_not() {
        for ok in [
            "application/json",
            "Application/JSON; charset=utf-8",
            "application/problem+json",
            "application/merge-patch+JSON",
        ] {
            assert!(is_json(&content_type(ok)), "{ok}");
        }
        for bad in [
            "+json",
            "application/+json",
            "/json",
            "json",
            "text/plain",
            "application/jsonx",
            "application/x+json/y",
        ] {
            assert!(!is_json(&content_type(bad)), "{bad}");
        }
        assert!(!is_json(&HeaderMap::new()));
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Pair {
        a: i64,
        b: Vec<Object<Inner>>,
    }

    #[derive(Debug, Deserialize)]
    struct Inner {
        c: String,
    }

    /// The field and the detail of a parse error.
    fn rejection(body: &str) -> (String, String) {
        match parse_object::<Pair>(body.as_bytes()) {
            Err(ApiError::Validation { field, detail }) => (field, detail),
            other => panic!("{body}: expected a validation error, got {other:?}"),
        }
    }

    #[test]
    fn one_json_object_parses_and_nothing_else_does() {
        let ok = parse_object::<Pair>(br#" {"a": 1, "b": [{"c": "x"}]} "#).unwrap();
        assert_eq!(ok.a, 1);
        assert_eq!(ok.b[0].0.c, "x");

        let (field, detail) = rejection(r#"{"a": 1, "b": []} garbage"#);
        assert_eq!(field, "body");
        assert_eq!(detail, "body is not valid JSON at line 1 column 19");
        let (field, _) = rejection(r#"{"a": 1, "b": []}{"a": 2, "b": []}"#);
        assert_eq!(field, "body");

        let (field, detail) = rejection("{\n  \"a\": 1,\n  \"b\": [");
        assert_eq!(field, "body");
        assert_eq!(detail, "body is not valid JSON at line 3 column 8");

        let (field, detail) = rejection(&json!([1, [["x"]]]).to_string());
        assert_eq!(field, "body");
        assert!(detail.contains("expected a JSON object"), "{detail}");
        let (field, detail) = rejection(&json!({"a": 1, "b": [["x"]]}).to_string());
        assert_eq!(field, "b[0]");
        assert!(detail.contains("expected a JSON object"), "{detail}");

        let (field, _) = rejection(&json!({"a": "1", "b": []}).to_string());
        assert_eq!(field, "a");
    }

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
