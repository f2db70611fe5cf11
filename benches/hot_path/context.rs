//! The request context: every request runs inside `context::scope`, and every downstream
//! call and query reads it. What it should cost is a task-local set and reset around each poll
//! and an `Arc` clone: no allocation once the context exists.

use std::{
    future::Future,
    pin::pin,
    sync::Arc,
    task::{Context, Poll, Waker},
};

use divan::Bencher;
use tributary::context::{self, RequestContext};

use crate::fixture;

/// Polls a future that is ready at once, with no runtime: what is timed is the future itself.
fn ready<F: Future>(fut: F) -> F::Output {
    match pin!(fut).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(out) => out,
        Poll::Pending => unreachable!("the benchmarked futures never wait"),
    }
}

/// The scope alone, around a future that does nothing.
#[divan::bench]
fn scope_around_a_ready_future(bencher: Bencher) {
    let ctx = fixture::request_context();
    bencher.bench_local(|| ready(context::scope(Arc::clone(&ctx), async {})));
}

/// The scope around a future that reads the deadline, as every downstream call and query does.
#[divan::bench]
fn scope_and_read_the_deadline(bencher: Bencher) {
    let ctx = fixture::request_context();
    bencher.bench_local(|| {
        ready(context::scope(Arc::clone(&ctx), async {
            context::deadline()
        }))
    });
}

/// What the request layer does per request for the context: make it (its ids are made before,
/// by the layer), put it in an `Arc`, and scope the request in it.
#[divan::bench]
fn new_context_and_scope(bencher: Bencher) {
    let template = fixture::request_context();
    bencher
        .with_inputs(|| {
            (
                Arc::clone(&template.request_id),
                template.trace.clone(),
                template.deadline,
            )
        })
        .bench_local_values(|(request_id, trace, deadline)| {
            let ctx = Arc::new(RequestContext::new(request_id, trace, deadline));
            ready(context::scope(ctx, async { context::deadline() }))
        });
}
