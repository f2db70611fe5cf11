#!/usr/bin/env bash
# instrumentation: the seed-baseline load with the gateway fully instrumented (the shipped
# defaults: metrics, one JSON line and one span per request) against no instrumentation, and with
# each half off, below saturation (CPU per request) and at saturation (throughput). Repetitions
# alternate the variants so that drift in the machine hits them alike.
# shellcheck source-path=SCRIPTDIR source=../lib/common.sh
source "$(dirname "$0")/../lib/common.sh"
bench_init instrumentation

read -r -a conn_levels <<<"$(bench_pick "${BENCH_INSTRUMENTATION_CONNECTIONS:-150 500}" 8)"
reps=${BENCH_REPS:-$(bench_pick 5 1)}
duration=${BENCH_DURATION:-$(bench_pick 15 3)}
warmup=$(bench_pick 3 1)

bench_db_prepare
bench_start_sims 100ms
for conns in "${conn_levels[@]}"; do
  limit=$((conns * 10))
  basis="Little's law: $conns connections ÷ 100 ms downstream = $limit req/s"
  for rep in $(seq 1 "$reps"); do
    # variant:metrics_enabled:log_level
    for spec in instrumented:true:info uninstrumented:false:warn metrics-off:false:info logs-off:true:warn; do
      IFS=: read -r variant metrics level <<<"$spec"
      GATEWAY_SETTINGS=("TRIBUTARY_TELEMETRY__METRICS_ENABLED=$metrics" "TRIBUTARY_TELEMETRY__LOG_LEVEL=$level")
      bench_gateway_point "$variant" "$conns" "$rep" "$duration" "$warmup" "$limit" "$basis"
    done
  done
done
bench_stop_sims
bench_report "instrumentation: the gateway with and without its metrics and logs (one core)"
