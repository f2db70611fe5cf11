#!/usr/bin/env bash
# seed-baseline: the headline test on one gateway core: 500 connections, every
# downstream a fixed 100 ms, the dashboard endpoint, 60 s after a warm-up.
# shellcheck source-path=SCRIPTDIR source=../lib/common.sh
source "$(dirname "$0")/../lib/common.sh"
bench_init seed-baseline

conns=$(bench_pick 500 8)
reps=${BENCH_REPS:-$(bench_pick 3 1)}
duration=${BENCH_DURATION:-$(bench_pick 60 5)}
warmup=$(bench_pick 5 1)
limit=$((conns * 10))
basis="Little's law: $conns connections ÷ 100 ms downstream = $limit req/s"

bench_db_prepare
bench_start_sims 100ms
# The shipped defaults: no extra settings. A fresh gateway per repetition, so that its peak RSS
# belongs to that run.
GATEWAY_SETTINGS=()
for rep in $(seq 1 "$reps"); do
  bench_gateway_point baseline "$conns" "$rep" "$duration" "$warmup" "$limit" "$basis"
done
bench_stop_sims
# Counts per answer, which the VM's speed does not move: instructions and allocations
# (callgrind, a light load) and system calls (perf trace, this load), by bench/profile on the
# same binaries; the report adds them. BENCH_COUNTS=0 skips them, as the quick form does.
rm -f "$OUT_DIR/counts.json"
if [[ "${BENCH_COUNTS:-$(bench_pick 1 0)}" == 1 ]]; then
  bench_log "counting instructions, allocations and system calls per answer (bench/profile)"
  if "$BENCH_DIR/profile" instructions >"$LOG_DIR/counts-instructions.txt" 2>&1 &&
    "$BENCH_DIR/profile" syscalls >"$LOG_DIR/counts-syscalls.txt" 2>&1; then
    python3 "$BENCH_DIR/lib/report.py" counts "$LOG_DIR/counts-instructions.txt" \
      "$LOG_DIR/counts-syscalls.txt" >"$OUT_DIR/counts.json"
  else
    bench_log "the counts failed (logs in $LOG_DIR/counts-*.txt); the report has none"
  fi
fi
bench_report "seed-baseline: dashboard fan-out, 500 connections, downstreams fixed at 100 ms (gateway on one core)"
