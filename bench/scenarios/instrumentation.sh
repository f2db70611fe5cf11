#!/usr/bin/env bash
# instrumentation: the seed-baseline load with the metrics recorder off vs on (throughput ratio,
# CPU per request), and with the per-request log line turned off (log level warn). Repetitions alternate so that drift hits both variants alike.
# shellcheck source-path=SCRIPTDIR source=../lib/common.sh
source "$(dirname "$0")/../lib/common.sh"
bench_init instrumentation

conns=$(bench_pick "${BENCH_INSTRUMENTATION_CONNECTIONS:-500}" 8)
reps=${BENCH_REPS:-$(bench_pick 3 1)}
duration=${BENCH_DURATION:-$(bench_pick 20 3)}
warmup=$(bench_pick 3 1)
limit=$((conns * 10))
basis="Little's law: $conns connections ÷ 100 ms downstream = $limit req/s"

bench_db_prepare
bench_start_sims 100ms
for rep in $(seq 1 "$reps"); do
  # variant:metrics_enabled:log_level; the third shows what the per-request log line costs.
  for spec in metrics-off:false:info metrics-on:true:info metrics-on-logs-warn:true:warn; do
    IFS=: read -r variant metrics level <<<"$spec"
    GATEWAY_SETTINGS=("TRIBUTARY_TELEMETRY__METRICS_ENABLED=$metrics" "TRIBUTARY_TELEMETRY__LOG_LEVEL=$level")
    bench_gateway_point "$variant" "$conns" "$rep" "$duration" "$warmup" "$limit" "$basis"
  done
done
bench_stop_sims
bench_report "instrumentation: metrics recorder off vs on under the seed-baseline load (gateway on one core)"
