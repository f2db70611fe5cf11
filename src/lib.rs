//! tributary: a gateway-aggregation (BFF) service — one request in, a concurrent fan-out to
//! five services and Postgres, one merged answer out — built so that the failure modes of
//! cheap concurrency (a worker thread held by blocking work, request data copied or leaked
//! between requests, pools sized against each other, overload that turns into an avalanche)
//! are handled by construction and visible in metrics.
//!
//! The tree reads as the architecture, bottom layer first; a module uses only the ones above
//! it in this list:
//! - leaves: [`domain`] (the route groups, services and dashboard parts as types),
//!   [`allocator`] (the process's memory policy: transparent huge pages off),
//!   [`build_info`] (the version and git revision the binary was built from), [`config`]
//!   (typed settings, parsed once), [`context`] (the per-request context in a task-local),
//!   `tls` (the process-wide TLS provider) and [`telemetry`] (logs, traces, metrics and
//!   runtime health, one module per signal), then [`overload`] (the runtime's queueing
//!   delay: whether the gateway's own CPU is the bottleneck);
//! - the parts that do the work: [`db`] (the Postgres pool, queries and seed data),
//!   [`downstream`] (one typed client per service, with bulkhead, breaker and retries),
//!   [`admission`] and `ratelimit` (overload protection, 503, and per-client limits, 429),
//!   and [`capacity`] (Little's-law sizing);
//! - [`routing`]: grey releases — which deployment of a downstream serves a request, the live
//!   comparison with stable, the automatic rollback and the reload;
//! - `error`: the API's error type, every outcome a client can see, and the mapping of the
//!   work's errors to them;
//! - `fanout`: the concurrent dashboard fan-out with deadlines and partial results;
//! - [`http`]: routes, handlers and the tower stack, in one place;
//! - [`startup`]: building the application from settings and serving it until told to stop.
//!
//! `main.rs` is a table of contents over [`startup`]. The public surface is what the binaries,
//! the simulator (`tributary-sim`) and the integration tests use; everything else is
//! `pub(crate)`, which the lint below keeps true.

#![warn(unreachable_pub)]

pub mod admission;
pub mod allocator;
pub mod build_info;
pub mod capacity;
pub mod config;
pub mod context;
pub mod db;
pub mod domain;
pub mod downstream;
pub(crate) mod error;
pub(crate) mod fanout;
pub mod http;
pub mod overload;
pub(crate) mod ratelimit;
pub mod routing;
pub mod startup;
pub mod telemetry;
pub(crate) mod tls;

pub use config::Settings;
pub use startup::Application;

#[cfg(test)]
mod layering {
    //! The order in the crate doc above, checked: a module's source names (`crate::x`) only
    //! modules in layers below its own.

    use std::{fs, path::Path};

    /// Bottom first; modules on one line are siblings and do not use each other.
    const LAYERS: &[&[&str]] = &[
        &["domain"],
        &["allocator"],
        &["build_info"],
        &["config"],
        &["context"],
        &["tls"],
        &["telemetry"],
        &["overload"],
        &["db", "downstream", "admission", "ratelimit", "capacity"],
        &["routing"],
        &["error"],
        &["fanout"],
        &["http"],
        &["startup"],
    ];

    fn layer_of(module: &str) -> usize {
        LAYERS
            .iter()
            .position(|layer| layer.contains(&module))
            .unwrap_or_else(|| panic!("module {module} is in no layer: add it to LAYERS"))
    }

    /// The first path segment of every `crate::` path in `source`, including each one in a
    /// `crate::{a::b, c}` group.
    fn crate_paths(source: &str) -> Vec<String> {
        let mut found = Vec::new();
        let mut rest = source;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let (mut depth, mut end) = (1, 0);
                for (i, c) in group.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => depth -= 1,
                        _ => {}
                    }
                    if depth == 0 {
                        end = i;
                        break;
                    }
                }
                let (mut depth, mut start) = (0, 0);
                let inner = &group[..end];
                for (i, c) in inner.char_indices().chain([(inner.len(), ',')]) {
                    match c {
                        '{' => depth += 1,
                        '}' => depth -= 1,
                        ',' if depth == 0 => {
                            found.push(first_segment(&inner[start..i]));
                            start = i + 1;
                        }
                        _ => {}
                    }
                }
            } else {
                found.push(first_segment(rest));
            }
        }
        found.retain(|m| !m.is_empty());
        found
    }

    fn first_segment(path: &str) -> String {
        path.trim()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    }

    fn sources(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                sources(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }

    #[test]
    fn no_module_uses_a_module_above_it_or_a_sibling() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        sources(&src, &mut files);
        let mut wrong = Vec::new();
        for file in files {
            let relative = file.strip_prefix(&src).unwrap();
            let module = relative
                .components()
                .next()
                .unwrap()
                .as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_owned();
            if ["lib", "main"].contains(&module.as_str()) {
                continue;
            }
            let own = layer_of(&module);
            for used in crate_paths(&fs::read_to_string(&file).unwrap()) {
                if used == module || ["Settings", "Application"].contains(&used.as_str()) {
                    continue;
                }
                if layer_of(&used) >= own {
                    wrong.push(format!("{} uses crate::{used}", relative.display()));
                }
            }
        }
        assert!(
            wrong.is_empty(),
            "imports that point up or sideways: {wrong:#?}"
        );
    }

    #[test]
    fn the_path_scanner_finds_grouped_and_nested_imports() {
        let source = "use crate::{a::B, c::{d, e}, f};\nlet x = crate::g::h();";
        assert_eq!(crate_paths(source), ["a", "c", "f", "g"]);
    }
}
