//! Extractors whose rejections are problem documents that name the offending input.

use std::{fmt, marker::PhantomData};

use axum::{
    body::Bytes,
    extract::{FromRequest, FromRequestParts, Path, Request},
    http::{HeaderMap, StatusCode, header, request::Parts},
};
use serde::{
    Deserialize, Deserializer,
    de::{self, DeserializeOwned, MapAccess, Unexpected, Visitor, value::MapAccessDeserializer},
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

/// A whole number of type `T`, written as a JSON integer (`2`) or as a number without a fraction
/// (`2.0`, `2e3`). JSON has one number type and JSON Schema's `integer` includes `2.0`, and
/// encoders that hold numbers as doubles (JavaScript's, Python's for a float) write it so;
/// serde's integers refuse it, which turned such a valid order into a 400.
#[derive(Debug, Clone, Copy)]
pub(super) struct Whole<T>(pub T);

impl<'de, T: TryFrom<i64> + TryFrom<u64>> Deserialize<'de> for Whole<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct WholeVisitor<T>(PhantomData<T>);

        impl<T: TryFrom<i64> + TryFrom<u64>> Visitor<'_> for WholeVisitor<T> {
            type Value = T;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "a whole number ({})", std::any::type_name::<T>())
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<T, E> {
                T::try_from(v).map_err(|_| E::invalid_value(Unexpected::Signed(v), &self))
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<T, E> {
                T::try_from(v).map_err(|_| E::invalid_value(Unexpected::Unsigned(v), &self))
            }

            fn visit_f64<E: de::Error>(self, v: f64) -> Result<T, E> {
                // i64's range is [-2^63, 2^63); both bounds are exact as doubles.
                const LIMIT: f64 = 9_223_372_036_854_775_808.0;
                if v.fract() == 0.0 && (-LIMIT..LIMIT).contains(&v) {
                    self.visit_i64(v as i64)
                } else {
                    Err(E::invalid_value(Unexpected::Float(v), &self))
                }
            }
        }

        deserializer
            .deserialize_any(WholeVisitor(PhantomData))
            .map(Whole)
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
    fn a_whole_number_may_be_written_with_a_zero_fraction_and_nothing_else_passes() {
        let whole = |text: &str| serde_json::from_str::<Whole<i32>>(text).map(|w| w.0);
        assert_eq!(whole("2").unwrap(), 2);
        assert_eq!(whole("-2").unwrap(), -2);
        assert_eq!(whole("2.0").unwrap(), 2);
        assert_eq!(whole("2e3").unwrap(), 2000);
        for bad in ["2.5", "1e300", "2147483648", "\"2\"", "true", "[]"] {
            let err = whole(bad).expect_err(bad).to_string();
            assert!(
                err.contains("expected a whole number (i32)"),
                "{bad}: {err}"
            );
        }
        let big = serde_json::from_str::<Whole<i64>>("9223372036854775807").unwrap();
        assert_eq!(big.0, i64::MAX);
        assert!(serde_json::from_str::<Whole<i64>>("9.3e18").is_err());
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
