#!/usr/bin/env bash
# Two builds side by side in `bench/run stack` at 250 connections (the bare stack and the shipped
# defaults, 3 repetitions of 15 s each), alternating: A, B, A, B, ...
#
#   bench/results/experiments/core-burst/run.sh ROUNDS A=BIN_DIR B=BIN_DIR
#
# Each BIN_DIR holds `tributary`, `downstream-sim` and `examples/bare_gateway` (a release build:
# `cargo build --release --bins --example bare_gateway`, then copy them out of target/release).
# Writes OUT (default /tmp/core-burst)/NAME-ROUND/stack/report.md and prints, per run, the
# shipped defaults' full 200/s, p99, 503s and the adaptive limit's cuts by cause.
set -euo pipefail
ROUNDS="$1"; shift
REPO="$(cd "$(dirname "$0")/../../../.." && pwd)"
OUT="${OUT:-/tmp/core-burst}"
for round in $(seq "$ROUNDS"); do
  for v in "$@"; do
    name="${v%%=*}" bin="${v#*=}"
    [[ "$bin" == /* ]] || bin="$REPO/$bin"
    dir="$OUT/$name-$round"
    BIN_DIR="$bin" BENCH_OUT="$dir" BENCH_STACK_CONNECTIONS=250 BENCH_STACK_VARIANTS="bare shipped" \
      "$REPO/bench/run" stack >"$dir.log" 2>&1
    python3 - "$dir/stack/runs" "$name-$round" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/shipped-*.json")):
    d = json.load(open(f))
    m = d.get("metrics", {})
    cuts = {k.split("cause=")[1].split(",")[0]: v
            for k, v in m.get("tributary_admission_limit_decreases_total", {}).items()}
    rej = sum(m.get("tributary_admission_rejections_total", {}).values())
    print(sys.argv[2], f.rsplit("/", 1)[1], "503s (admission):", rej, "cuts:", cuts or "none")
PY
    grep "shipped concurrency=250 rep" "$dir.log" | sed "s/^/$name-$round /"
  done
done
