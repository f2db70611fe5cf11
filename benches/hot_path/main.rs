//! Micro-benchmarks of the gateway's hot-path pieces: what one request costs in each of them,
//! in time and in allocations, so that a per-request regression shows up in seconds instead
//! of in the lab's minutes (`bench/run`), and on any machine.
//!
//! Each module times the library's own code, as the gateway builds and calls it:
//! - [`dashboard`]: merging five downstream bodies and the recent orders into the response and
//!   serialising it;
//! - [`context`]: the task-local request context's scope around a future;
//! - [`admission`]: a permit taken and given back (static and adaptive limits), and a "no"
//!   from a full limiter;
//! - [`downstream`]: one `GET` through the gateway's downstream client to the simulator;
//! - [`access_log`]: one JSON access line, into a writer that discards it.
//!
//! One binary, so that there is one process-wide log subscriber and metrics recorder, as in
//! the gateway, and one link. `cargo bench --bench hot_path` runs everything (about a minute);
//! `cargo bench --bench hot_path -- admission` one module; `cargo test --benches` runs each
//! benchmark once, as a test. What to look for in the numbers: bench/results/micro/report.md.

mod access_log;
mod admission;
mod context;
mod dashboard;
mod downstream;
mod fixture;

use mimalloc::MiMalloc;

/// The gateway's allocator (see `src/main.rs`), counted: divan reports allocations per
/// iteration beside the time.
#[global_allocator]
static ALLOC: divan::AllocProfiler<MiMalloc> = divan::AllocProfiler::new(MiMalloc);

fn main() {
    // Before anything logs: the gateway's own subscriber, as `main` installs it.
    fixture::install_log_subscriber();
    divan::main();
}
