"""The heap at its peak, by call site, from heaptrack's folded stacks.

bench/profile heap writes `heaptrack_print --flamegraph-cost-type peak -F FILE` (one line per
backtrace, root first, frames separated by `;`, the bytes that backtrace held at the peak last),
demangled with rustfilt. Every Rust allocation goes through the same few frames of `alloc` and
`std` (`__rdl_alloc`, `RawVec::grow`, `Box::new`, ...), so a backtrace is named here by the first
frames above them: the code that asked for the memory. Sites that share those frames are summed.

    python3 heap.py FOLDED [--frames N] [--top N]
"""

import argparse
import collections
import re

# The frames every allocation passes through, whoever asks: the allocator, RawVec's growth, Box
# and Arc construction, hashbrown's growth, the `with_capacity` family.
PLUMBING = re.compile(
    r"^(<std::alloc::System as .*|std::sys::alloc::.*|__rustc::__rdl_\w+|alloc::alloc::\w+|alloc|allocate|alloc_impl\w*|try_allocate_in|"
    r"box_new_uninit|new_uninit\w*|new_uninitialized|reserve\w*|finish_grow|grow\w*|realloc|"
    r"with_capacity\w*|try_with_capacity\w*|allocate_for_\w+|malloc|calloc|posix_memalign|exchange_malloc)(<>)?$"
)
# Box::new and Box::pin are named `new`/`pin` in boxed.rs: plumbing too, unlike other `new`s.
BOXED = re.compile(r"^(new|pin)(<>)?( \(boxed\.rs\))$")


def frame_name(frame: str) -> str:
    return frame.split(" (", 1)[0]


def site(frames: list[str], depth: int) -> str:
    """The last `depth` frames of the backtrace that are not allocator plumbing, in heaptrack's
    order. heaptrack lists a physical frame's inlined frames after it, innermost first, so the
    order is not strictly the call order; the names are what identifies the site."""
    kept = [f for f in frames if not (PLUMBING.match(frame_name(f)) or BOXED.match(f))]
    return " ; ".join(f[:120] for f in kept[-depth:]) or "(allocator frames only)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folded")
    parser.add_argument("--frames", type=int, default=4)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    total = 0
    sites: collections.Counter[str] = collections.Counter()
    for line in open(args.folded, encoding="utf-8", errors="replace"):
        stack, _, cost = line.rstrip("\n").rpartition(" ")
        if not cost.isdigit() or int(cost) == 0:
            continue
        total += int(cost)
        sites[site([f for f in stack.split(";") if f], args.frames)] += int(cost)
    print(f"heap at the peak: {total / 1e6:.1f} MB in {len(sites)} call sites")
    for name, cost in sites.most_common(args.top):
        print(f"{cost / 1e6:7.2f} MB {100 * cost / total:5.1f} %  {name}")


if __name__ == "__main__":
    main()
