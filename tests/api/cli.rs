//! The `tributary` binary's own command line, run as a process.

use std::process::Command;

/// The revision this test was compiled with: the same `TRIBUTARY_GIT_REVISION` cargo gave the
/// binary (CI's container check builds the image with a real one and reads it back).
fn build_revision() -> &'static str {
    option_env!("TRIBUTARY_GIT_REVISION")
        .filter(|r| !r.is_empty())
        .unwrap_or("unknown")
}

#[test]
fn version_names_the_package_version_and_the_git_revision() {
    let out = Command::new(env!("CARGO_BIN_EXE_tributary"))
        .arg("--version")
        .output()
        .expect("run tributary --version");

    assert!(out.status.success(), "exit status {}", out.status);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!(
            "tributary {} (revision {})\n",
            env!("CARGO_PKG_VERSION"),
            build_revision()
        )
    );
}
