//! The access line: one JSON line per request, written by the gateway's subscriber (installed
//! by `main`, as the gateway's `main` does) into `std::io::sink`. The request span's fields are
//! serialised once, when it is made, and copied into the line; the event's own fields are
//! formatted per line. The line is the largest fixed allocation of a request.

use std::sync::Arc;

use divan::Bencher;
use http::Method;
use tributary::http::{access_line, request_span};

use crate::fixture;

const ROUTE: &str = "/api/v1/dashboard/{user_id}";
const PATH: &str = "/api/v1/dashboard/42";

/// The line alone, inside a span that already exists (the request layer made it).
#[divan::bench]
fn completed_line(bencher: Bencher) {
    let ctx = fixture::request_context();
    let span = request_span(&Method::GET, ROUTE, PATH, &ctx.request_id, Some(&ctx.trace));
    bencher.bench_local(|| {
        let _entered = span.enter();
        access_line(200, ROUTE, Some(42), None, 12.345, None);
    });
}

/// The request's whole logging: the span made (its fields serialised), entered, the line
/// written, the span closed.
#[divan::bench]
fn span_and_line(bencher: Bencher) {
    let ctx = fixture::request_context();
    let request_id: Arc<str> = Arc::clone(&ctx.request_id);
    bencher.bench_local(|| {
        let span = request_span(&Method::GET, ROUTE, PATH, &request_id, Some(&ctx.trace));
        let _entered = span.enter();
        access_line(200, ROUTE, Some(42), None, 12.345, None);
    });
}
