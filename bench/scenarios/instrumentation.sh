#!/usr/bin/env bash
# instrumentation: the seed-baseline load with the metrics recorder off vs on (throughput ratio,
# CPU per request). Repetitions alternate so that drift hits both variants alike.
source "$(dirname "$0")/../lib/common.sh"
bench_init instrumentation

conns=$(bench_pick "${BENCH_INSTRUMENTATION_CONNECTIONS:-500}" 8)
reps=$(bench_pick 3 1)
duration=$(bench_pick 20 3)
warmup=$(bench_pick 3 1)
limit=$((conns * 10))
basis="Little's law: $conns connections ÷ 100 ms downstream = $limit req/s"

bench_db_prepare
bench_start_sims 100ms
for rep in $(seq 1 "$reps"); do
  for metrics in false true; do
    variant=$([[ $metrics == true ]] && echo metrics-on || echo metrics-off)
    bench_start_gateway "TRIBUTARY_TELEMETRY__METRICS_ENABLED=$metrics"
    bench_gateway_run "$variant" "$conns" "$rep" "$duration" "$warmup" "$limit" "$basis"
    bench_stop "$GATEWAY_PID"
  done
done
bench_stop_sims
bench_report "instrumentation: metrics recorder off vs on under the seed-baseline load (gateway on one core)"
