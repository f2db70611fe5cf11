//! Gives the build its git revision, for `tributary --version` and `tributary_build_info`.
//!
//! `TRIBUTARY_GIT_REVISION` from the environment wins (the Dockerfile passes it: the image's build
//! context has no `.git/`). Otherwise, in a git checkout, the revision is asked of git, so that a
//! plain `cargo build` names the commit it was built at (changes not yet committed are not
//! marked: watching them would rebuild the crate on every `git add`). Without either it is
//! `unknown`. The script reruns only when HEAD or the branch it names moves (a commit, a
//! checkout); the crate is then recompiled, which is the price of a version that is right.

use std::{path::Path, process::Command};

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Reruns the script when `file` in the git directory changes. Only files that exist: cargo
/// reruns a script on every build for a path that does not.
fn watch(file: &str) {
    if let Some(path) = git(&["rev-parse", "--git-path", file])
        && Path::new(&path).exists()
    {
        println!("cargo:rerun-if-changed={path}");
    }
}

fn main() {
    println!("cargo:rerun-if-env-changed=TRIBUTARY_GIT_REVISION");
    if std::env::var_os("TRIBUTARY_GIT_REVISION").is_some_and(|v| !v.is_empty()) {
        // src/build_info.rs reads it with option_env!.
        return;
    }
    let Some(revision) = git(&["rev-parse", "--short=12", "HEAD"]) else {
        return;
    };
    watch("HEAD");
    // The branch HEAD names, as a loose ref or in packed-refs.
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watch(&branch);
    }
    watch("packed-refs");
    println!("cargo:rustc-env=TRIBUTARY_GIT_REVISION={revision}");
}
