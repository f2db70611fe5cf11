//! What this binary is: the package version and the git revision it was built from.
//!
//! The revision is a compile-time input, `TRIBUTARY_GIT_REVISION`, read with `option_env!`: the
//! Dockerfile sets it from its `GIT_REVISION` build argument (the image's build context has no
//! `.git/`), and otherwise `build.rs` sets it from `git rev-parse --short=12 HEAD` when the
//! build runs in a git checkout, so that `cargo build` and `make dev` name their commit too.
//! `tributary --version` and the `tributary_build_info{version,revision}` gauge report the same
//! two values.

use std::sync::LazyLock;

/// The package version from `Cargo.toml`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The git revision given at build time or found by `build.rs`, or `unknown` without either.
pub const REVISION: &str = match option_env!("TRIBUTARY_GIT_REVISION") {
    Some(revision) if !revision.is_empty() => revision,
    _ => "unknown",
};

/// `0.1.0 (revision 3f2a…)`: what `--version` prints after the program's name.
pub fn version_line() -> &'static str {
    static LINE: LazyLock<String> = LazyLock::new(|| format!("{VERSION} (revision {REVISION})"));
    &LINE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_line_names_the_package_version_and_the_revision() {
        assert_eq!(
            version_line(),
            format!("{} (revision {REVISION})", env!("CARGO_PKG_VERSION"))
        );
        assert!(!REVISION.is_empty());
    }
}
