#!/usr/bin/env bash
# overload: ten times more clients than the admission limit (50 in flight, 500 connections):
# admitted latency, rejection latency, memory. Two queue settings: the default 100 ms wait for a
# permit, and fail-fast (no wait).
# shellcheck source-path=SCRIPTDIR source=../lib/common.sh
source "$(dirname "$0")/../lib/common.sh"
bench_init overload

max_in_flight=$(bench_pick 50 2)
conns=$((max_in_flight * 10))
reps=${BENCH_REPS:-$(bench_pick 3 1)}
duration=${BENCH_DURATION:-$(bench_pick 15 3)}
warmup=$(bench_pick 3 1)
limit=$((max_in_flight * 10))
basis="admitted: $max_in_flight permits ÷ 100 ms downstream = $limit req/s ($conns connections offered)"

bench_db_prepare
bench_start_sims 100ms
for rep in $(seq 1 "$reps"); do
  for wait in 100ms 0ms; do
    variant=$([[ $wait == 0ms ]] && echo fail-fast || echo "queue-$wait")
    GATEWAY_SETTINGS=("TRIBUTARY_ADMISSION__MAX_IN_FLIGHT=$max_in_flight" "TRIBUTARY_ADMISSION__MAX_WAIT=$wait")
    bench_gateway_point "$variant" "$conns" "$rep" "$duration" "$warmup" "$limit" "$basis"
  done
done
bench_stop_sims
bench_report "overload: 500 connections against an admission limit of 50 (gateway on one core)"
