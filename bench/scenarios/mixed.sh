#!/usr/bin/env bash
# mixed: 10 ms of I/O plus ~2 ms of JSON parsing and regex masking, inline vs offloaded to a
# bounded rayon pool vs spawn_blocking.
# shellcheck source-path=SCRIPTDIR source=../lib/common.sh
source "$(dirname "$0")/../lib/common.sh"
bench_init mixed
bench_calibrate_server

read -r -a levels <<<"$(bench_pick "4 32" "4")"
reps=${BENCH_REPS:-$(bench_pick 3 1)}
duration=${BENCH_DURATION:-$(bench_pick 10 3)}
warmup=$(bench_pick 2 1)

for rep in $(seq 1 "$reps"); do
  for conns in "${levels[@]}"; do
    # Little's law: conns ÷ 12 ms; the core: 1 ÷ 2 ms = 500 req/s. The lower one binds.
    little=$((conns * 1000 / 12))
    limit=$((little < 500 ? little : 500))
    basis="min(Little's law: connections ÷ 12 ms, CPU: 1 core ÷ 2 ms = 500 req/s)"
    for mode in inline offload blocking; do
      bench_server_run "$mode" "/mixed/$mode" "$conns" "$rep" "$limit" "$basis" "$duration" "$warmup"
    done
  done
done
bench_report "mixed: 10 ms I/O + 2 ms JSON/regex per request, inline vs rayon pool vs spawn_blocking (one core)"
