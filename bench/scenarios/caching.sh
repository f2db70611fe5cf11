#!/usr/bin/env bash
# caching: the dashboard with no downstream cache against a realistic cache set-up (a shared
# promotions cache, per-user caches for profiles and recommendations) under a Zipf-distributed
# user population, at the same 500 connections. Each point records downstream calls per request
# (the simulators' counters) and the cache hit ratio (the gateway's counters) beside the lab's
# usual figures. Repetitions alternate the two variants so that drift in the machine hits them
# alike. The cache under a load spike is its own scenario, caching-spike.
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
bench_sim_stats_args
point_args=(--wrk-env "WRK_ZIPF_S=$BENCH_ZIPF_S" --meta "zipf_s=$BENCH_ZIPF_S" "${BENCH_SIM_STATS_ARGS[@]}")
for rep in $(seq 1 "$reps"); do
  GATEWAY_SETTINGS=()
  bench_gateway_point uncached "$conns" "$rep" "$duration" "$warmup" "$limit" "$basis" "${point_args[@]}"
  GATEWAY_SETTINGS=("${BENCH_CACHE_SETTINGS[@]}")
  bench_gateway_point cached "$conns" "$rep" "$duration" "$warmup" "$limit" "$basis" "${point_args[@]}"
done
bench_stop_sims
bench_report "caching: the dashboard without and with downstream caches, Zipf users (one core)"
