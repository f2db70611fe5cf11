//! One downstream call: `GET /{service}/{user_id}` through the gateway's client as the
//! application builds it (breaker ticket, bulkhead, deadline, request-id, trace and budget
//! headers, reqwest or hyper-util's client (`http_client.transport`) over a kept-alive
//! connection, the body read and validated as JSON, the call's metrics), inside a request's
//! context, on a current-thread runtime. The simulator
//! answers at once from its own thread, so the time is a loopback round trip plus the
//! simulator's handler; the allocations are the gateway's alone (divan counts the benchmark's
//! thread). The dashboard makes five of these per request.

use divan::Bencher;
use tributary::{context, domain::Service};

use crate::fixture::{self, GATEWAY};

#[divan::bench(args = ["reqwest", "hyper"])]
fn get_one_part(bencher: Bencher, transport: &str) {
    let app = match transport {
        "hyper" => &GATEWAY.hyper,
        _ => &GATEWAY.fixed,
    };
    let client = app.downstreams.get(Service::Carts);
    let ctx = fixture::request_context();
    let call = || {
        GATEWAY.rt.block_on(context::scope(
            std::sync::Arc::clone(&ctx),
            client.fetch_user_part_for_bench(42),
        ))
    };
    // The connection is opened here, not in the first sample.
    call().expect("the simulator answers");
    bencher.bench_local(|| call().expect("the simulator answers"));
}
