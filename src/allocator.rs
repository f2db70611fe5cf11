//! The process's memory policy: transparent huge pages off, unless asked for.
//!
//! mimalloc, the `tributary` binary's allocator, advises the kernel to back its arenas with
//! transparent huge pages (`madvise(MADV_HUGEPAGE)`). On a kernel whose THP mode is `madvise`
//! (the common default) the first touch of every 2 MiB region then faults in a whole huge page,
//! zeroed by the kernel on the thread that touched it: the worker. In steady state that is rare
//! and the huge pages save TLB misses. Under overload it is not: the gateway's memory grows by
//! hundreds of megabytes within seconds (each new connection's buffers, the requests and their
//! tasks), and on the lab's slower VM, while an open loop at twice the capacity opened its
//! connections, the kernel zeroing pages took 53 % of the gateway's core for seconds
//! (`clear_page_erms` under `folio_zero_user`, `perf record` of core 0). The runtime's
//! scheduling lag reached 2–3.5 s there, with 15–19 polls over 10 ms in a run, and no admission
//! decision can shed a core the kernel is using. With 4 KiB pages the same points served 14–25 %
//! more full answers (medians of three rounds), the admitted requests' p99 server-side was
//! 1.2–4× lower, and peak RSS a quarter to two fifths lower at every load; below capacity a
//! served request cost between 8 % less and 36 % more CPU in two rounds
//! (`bench/results/experiments/huge-pages`).
//!
//! So the binary turns them off for itself before anything else (`prctl(PR_SET_THP_DISABLE)`:
//! what mimalloc does itself for `MIMALLOC_ALLOW_THP=0`; the flag is read at every page fault,
//! so it also covers the arena mimalloc reserved before `main`). Setting `MIMALLOC_ALLOW_THP`
//! leaves the choice to mimalloc: `MIMALLOC_ALLOW_THP=1` keeps huge pages.

/// What [`apply_huge_page_policy`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HugePages {
    /// Transparent huge pages are off for this process (and the processes it starts).
    Off,
    /// `MIMALLOC_ALLOW_THP` is set: mimalloc decides.
    LeftToMimalloc,
    /// The kernel refused, or this is not Linux: the system's policy applies.
    Unchanged,
}

/// The variable that leaves the choice to mimalloc.
pub const ALLOW_THP: &str = "MIMALLOC_ALLOW_THP";

/// Turns transparent huge pages off for this process unless [`ALLOW_THP`] is set. Call it
/// first in `main`: pages already faulted in keep their size.
pub fn apply_huge_page_policy() -> HugePages {
    if std::env::var_os(ALLOW_THP).is_some() {
        return HugePages::LeftToMimalloc;
    }
    disable()
}

#[cfg(target_os = "linux")]
fn disable() -> HugePages {
    match nix::sys::prctl::set_thp_disable(true) {
        Ok(()) => HugePages::Off,
        Err(_) => HugePages::Unchanged,
    }
}

#[cfg(not(target_os = "linux"))]
fn disable() -> HugePages {
    HugePages::Unchanged
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// `THP_enabled` in /proc/self/status: 0 once the process has turned them off.
    fn thp_enabled() -> Option<u8> {
        std::fs::read_to_string("/proc/self/status")
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix("THP_enabled:"))?
            .trim()
            .parse()
            .ok()
    }

    #[test]
    fn transparent_huge_pages_are_off_after_the_policy_unless_mimalloc_is_told() {
        // The test binary runs with the environment of `cargo test`: the variable is unset
        // there unless a developer set it, and then the policy must leave the process alone.
        let told = std::env::var_os(ALLOW_THP).is_some();
        let applied = apply_huge_page_policy();
        if told {
            assert_eq!(applied, HugePages::LeftToMimalloc);
            return;
        }
        assert_eq!(applied, HugePages::Off);
        assert_eq!(
            thp_enabled(),
            Some(0),
            "the kernel reports transparent huge pages off for the process"
        );
        assert!(nix::sys::prctl::get_thp_disable().unwrap());
    }
}
