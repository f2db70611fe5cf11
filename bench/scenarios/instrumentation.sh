#!/usr/bin/env bash
# instrumentation: the seed-baseline load with the gateway fully instrumented (the shipped
# defaults: metrics, one JSON line and one span per request) against no instrumentation, with
# each half off, and with the metrics exported over OTLP as well, below saturation (CPU per
# request) and at saturation (throughput). Repetitions alternate the variants so that drift in
# the machine hits them alike.
#
#   BENCH_INSTRUMENTATION_VARIANTS="instrumented otlp"   the variants to run, in this order
#                                                        (default: all five, see instrumentation.md)
#   BENCH_INSTRUMENTATION_CONNECTIONS="150"              the connection levels (default 150 500;
#                                                        quick: 8)
# shellcheck source-path=SCRIPTDIR source=../lib/common.sh
source "$(dirname "$0")/../lib/common.sh"
bench_init instrumentation

# variant -> metrics_enabled:log_level:otlp_metrics
declare -A variant_spec=(
  [instrumented]=true:info:off
  [uninstrumented]=false:warn:off
  [metrics-off]=false:info:off
  [logs-off]=true:warn:off
  [otlp]=true:info:on
)
read -r -a variants <<<"${BENCH_INSTRUMENTATION_VARIANTS:-instrumented uninstrumented metrics-off logs-off otlp}"
for variant in "${variants[@]}"; do
  [[ -n "${variant_spec[$variant]:-}" ]] ||
    { bench_log "unknown variant '$variant' in BENCH_INSTRUMENTATION_VARIANTS (known: ${!variant_spec[*]})"; exit 2; }
done
# The report's ratios are against uninstrumented; a run without it compares with its first variant.
if [[ " ${variants[*]} " != *" uninstrumented "* ]]; then
  export BENCH_BASELINE_VARIANT="${variants[0]}"
fi
read -r -a conn_levels <<<"${BENCH_INSTRUMENTATION_CONNECTIONS:-$(bench_pick "150 500" 8)}"
reps=${BENCH_REPS:-$(bench_pick 5 1)}
duration=${BENCH_DURATION:-$(bench_pick 15 3)}
warmup=$(bench_pick 3 1)

bench_db_prepare
bench_start_sims 100ms
# The receiver of the otlp variant, started once and only when that variant runs.
if [[ " ${variants[*]} " == *" otlp "* ]]; then
  bench_start_otlp_receiver
fi
for conns in "${conn_levels[@]}"; do
  limit=$((conns * 10))
  basis="Little's law: $conns connections ÷ 100 ms downstream = $limit req/s"
  for rep in $(seq 1 "$reps"); do
    for variant in "${variants[@]}"; do
      IFS=: read -r metrics level otlp <<<"${variant_spec[$variant]}"
      GATEWAY_SETTINGS=("TRIBUTARY_TELEMETRY__METRICS_ENABLED=$metrics" "TRIBUTARY_TELEMETRY__LOG_LEVEL=$level")
      extra=()
      if [[ "$otlp" == on ]]; then
        # Metrics over OTLP beside the Prometheus recorder, at the shipped export interval;
        # traces stay unexported, as in every other variant. The receiver's CPU is measured too.
        GATEWAY_SETTINGS+=("TRIBUTARY_TELEMETRY__OTLP_METRICS_ENDPOINT=$OTLP_ENDPOINT/v1/metrics")
        extra=(--proc "otlp-receiver=$OTLP_PID")
      fi
      bench_gateway_point "$variant" "$conns" "$rep" "$duration" "$warmup" "$limit" "$basis" "${extra[@]}"
    done
  done
done
bench_stop_sims
bench_report "instrumentation: the gateway with and without its metrics and logs, and with OTLP metrics (one core)"
