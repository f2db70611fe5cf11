//! Admission: every API request takes a permit at the edge before anything else is spent on it
//! and gives it back when it ends; under overload most requests end at the "no". Both should be
//! a few atomics: no allocation beyond the permit's `Arc` clone, no lock on the static path
//! (the adaptive limit samples each permit's hold time under a mutex on release).

use divan::Bencher;
use tributary::config::RouteGroup;

use crate::fixture::GATEWAY;

/// A permit taken and dropped (released), with a limit far from reached.
#[divan::bench(args = ["static", "adaptive"])]
fn admit_and_release(bencher: Bencher, mode: &str) {
    let state = match mode {
        "static" => &GATEWAY.fixed,
        _ => &GATEWAY.adaptive,
    };
    let limiter = state
        .admission
        .as_ref()
        .expect("admission is on")
        .limiter(RouteGroup::Dashboard);
    bencher.bench_local(|| {
        let permit = limiter.try_admit_for_bench();
        assert!(permit.is_some(), "a limiter far from its limit admits");
        drop(permit);
    });
}

/// The "no" of a full limiter (limit 1, its permit held, no wait allowed): the rejection is
/// counted and its `Retry-After` computed.
#[divan::bench]
fn reject_when_full(bencher: Bencher) {
    let limiter = GATEWAY
        .fixed
        .admission
        .as_ref()
        .expect("admission is on")
        .limiter(RouteGroup::Orders);
    let held = limiter.try_admit_for_bench();
    assert!(held.is_some(), "the one permit");
    let rejected_before = limiter.rejected();
    bencher.bench_local(|| {
        let permit = limiter.try_admit_for_bench();
        assert!(permit.is_none(), "a full limiter turns requests away");
    });
    assert!(
        limiter.rejected() > rejected_before,
        "the rejections were counted"
    );
    drop(held);
}
