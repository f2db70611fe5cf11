#!/usr/bin/env bash
# caching-spike: a closed loop that steps from a load the gateway carries to ten times its
# connections and back, with the downstream caches off and on; goodput (full 200s) and the
# downstream calls per second over time, from examples/loadgen.rs's per-second series and the
# simulators' counters. Repetitions alternate the three variants.
# shellcheck source-path=SCRIPTDIR source=../lib/common.sh
source "$(dirname "$0")/../lib/common.sh"
bench_init caching-spike

base=${BENCH_SPIKE_BASE:-$(bench_pick 200 10)}
peak=${BENCH_SPIKE_PEAK:-$(bench_pick 5000 100)}
# Seconds of the measured window: before the spike, the spike, after it.
before=$(bench_pick 10 2)
length=$(bench_pick 20 4)
after=$(bench_pick 10 2)
warmup=$(bench_pick 5 1)
reps=${BENCH_REPS:-$(bench_pick 2 1)}
duration=$((before + length + after))
limit=$((base * 10))
basis="Little's law at the base load: $base connections ÷ 100 ms downstream = $limit req/s"

# Every connection is a file descriptor in the load generator and the gateway, which also holds
# up to one connection per downstream call in flight (5 bulkheads of 1,024), as in overload-curve.
need=$((peak + 5 * (peak < 1024 ? peak : 1024) + 500))
if ((need > $(ulimit -n))); then
  bench_log "the spike to $peak connections needs ~$need file descriptors (limit $(ulimit -n)); lower BENCH_SPIKE_PEAK"
  exit 1
fi

loadgen="$(bench_example_bin loadgen)"
bench_db_prepare
bench_start_sims 100ms
bench_sim_stats_args
point_args=(
  --loadgen "$loadgen" --shape closed --gauge-series --x-name "base connections"
  --loadgen-arg="--spike-to=$peak" --loadgen-arg="--spike-at=$before" --loadgen-arg="--spike-for=$length"
  --wrk-env "WRK_ZIPF_S=$BENCH_ZIPF_S" --meta "zipf_s=$BENCH_ZIPF_S" "${BENCH_SIM_STATS_ARGS[@]}"
)
for rep in $(seq 1 "$reps"); do
  GATEWAY_SETTINGS=()
  bench_gateway_point uncached "$base" "$rep" "$duration" "$warmup" "$limit" "$basis" "${point_args[@]}"
  GATEWAY_SETTINGS=("${BENCH_CACHE_SETTINGS[@]}")
  bench_gateway_point cached "$base" "$rep" "$duration" "$warmup" "$limit" "$basis" "${point_args[@]}"
  # The same with the admission limit blind to the database pool's line (only the core's
  # queue moves it): what the spike did before overload.follow_db_pool.
  GATEWAY_SETTINGS=("${BENCH_CACHE_SETTINGS[@]}" "TRIBUTARY_OVERLOAD__FOLLOW_DB_POOL=false")
  bench_gateway_point cached-pool-blind "$base" "$rep" "$duration" "$warmup" "$limit" "$basis" "${point_args[@]}"
done
bench_stop_sims
python3 "$BENCH_DIR/lib/spike.py" "$OUT_DIR" --about "$BENCH_DIR/scenarios/$SCENARIO.md" --command "$BENCH_COMMAND"
if [[ -z "${BENCH_OUT:-}" ]]; then
  python3 "$BENCH_DIR/lib/report.py" summary "$RESULTS_ROOT" >/dev/null
fi
