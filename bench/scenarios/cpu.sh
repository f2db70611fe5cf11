#!/usr/bin/env bash
# cpu: 5 ms of SHA-256 per request, inline on the async worker vs spawn_blocking vs a rayon pool.
# shellcheck source-path=SCRIPTDIR source=../lib/common.sh
source "$(dirname "$0")/../lib/common.sh"
bench_init cpu
bench_calibrate_server

conns=$(bench_pick 16 4)
reps=${BENCH_REPS:-$(bench_pick 3 1)}
duration=${BENCH_DURATION:-$(bench_pick 10 3)}
warmup=$(bench_pick 2 1)
# One core does at most 1 / 5 ms = 200 hashes per second, whatever the concurrency allows.
limit=200
basis="CPU: 1 core ÷ 5 ms = 200 req/s (Little's law alone would allow $conns ÷ 5 ms = $((conns * 200)) req/s)"

for rep in $(seq 1 "$reps"); do
  for mode in inline blocking rayon; do
    bench_server_run "$mode" "/cpu/$mode" "$conns" "$rep" "$limit" "$basis" "$duration" "$warmup"
  done
done
bench_report "cpu: 5 ms SHA-256 per request, inline vs spawn_blocking vs rayon (one core)"
