#!/usr/bin/env bash
# caching: the seed-baseline load with no downstream cache (the default) against a shared
# promotions cache plus a per-user recommendations cache, at the same 500 connections.
# Repetitions alternate the two variants so that drift in the machine hits them alike.
# shellcheck source-path=SCRIPTDIR source=../lib/common.sh
source "$(dirname "$0")/../lib/common.sh"
bench_init caching

conns=$(bench_pick 500 8)
reps=${BENCH_REPS:-$(bench_pick 3 1)}
duration=${BENCH_DURATION:-$(bench_pick 30 3)}
warmup=$(bench_pick 3 1)
limit=$((conns * 10))
basis="Little's law: $conns connections ÷ 100 ms downstream = $limit req/s"

bench_db_prepare
bench_start_sims 100ms
for rep in $(seq 1 "$reps"); do
  GATEWAY_SETTINGS=()
  bench_gateway_point uncached "$conns" "$rep" "$duration" "$warmup" "$limit" "$basis"
  GATEWAY_SETTINGS=(
    "TRIBUTARY_DOWNSTREAMS__PROMOTIONS__CACHE__KEY=shared"
    "TRIBUTARY_DOWNSTREAMS__PROMOTIONS__CACHE__TTL=30s"
    "TRIBUTARY_DOWNSTREAMS__RECOMMENDATIONS__CACHE__KEY=per_user"
    "TRIBUTARY_DOWNSTREAMS__RECOMMENDATIONS__CACHE__TTL=30s"
  )
  bench_gateway_point cached "$conns" "$rep" "$duration" "$warmup" "$limit" "$basis"
done
bench_stop_sims
bench_report "caching: the dashboard without and with downstream caches (one core)"
