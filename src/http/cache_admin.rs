//! Operator actions on the operations listener, mounted only with `server.admin`: dropping a
//! downstream's cached answers after a change the cache cannot see (a promotion withdrawn, a
//! user's data corrected), rather than waiting out its `ttl`.
//!
//! - `DELETE /admin/cache/{downstream}`: every entry of that downstream's cache;
//! - `DELETE /admin/cache/{downstream}/{key}`: one entry, `key` being the user id in a
//!   `per_user` cache and `shared` in a `shared` one.
//!
//! Both answer 204, also when there was nothing to drop (DELETE is idempotent); a downstream
//! that does not exist or has no cache is a 404 problem, a key of the wrong kind a 400. A call
//! in flight when its entry is dropped still answers the requests waiting for it but stores
//! nothing.

use axum::{
    extract::{Path, State},
    http::StatusCode,
};

use super::AppState;
use crate::{domain::Service, downstream::cache::PartCache, error::ApiError};

fn cache_of<'a>(state: &'a AppState, downstream: &str) -> Result<&'a PartCache, ApiError> {
    let service: Service = downstream
        .parse()
        .map_err(|_| ApiError::NoSuchCache(format!("{downstream:?} is not a downstream")))?;
    state
        .downstreams
        .cache(service)
        .ok_or_else(|| ApiError::NoSuchCache(format!("{service} has no cache")))
}

pub(super) async fn invalidate_all(
    State(state): State<AppState>,
    Path(downstream): Path<String>,
) -> Result<StatusCode, ApiError> {
    cache_of(&state, &downstream)?.invalidate_all();
    tracing::info!(%downstream, "cache invalidated");
    Ok(StatusCode::NO_CONTENT)
}

pub(super) async fn invalidate_key(
    State(state): State<AppState>,
    Path((downstream, key)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    let cache = cache_of(&state, &downstream)?;
    let parsed = cache
        .key_from_path(&key)
        .map_err(|detail| ApiError::validation("key", detail))?;
    cache.invalidate(parsed).await;
    tracing::info!(%downstream, %key, "cache entry invalidated");
    Ok(StatusCode::NO_CONTENT)
}
