#!/usr/bin/env bash
set -euo pipefail
# The adaptive limit from a fresh start: the gateway on the lab's core, wrk at 500 connections for 16 s,
# /metrics read every 0.2 s (rejections so far, the dashboard limit, cuts by cause). From bench/:
#   BIN_DIR=target/release results/experiments/limit-headroom/timeline.sh
cd "$(dirname "$0")/../../.."
# shellcheck source-path=SCRIPTDIR source=../../../lib/common.sh
source lib/common.sh
BENCH_OUT="$(mktemp -d "${TMPDIR:-/tmp}/bench-timeline.XXXXXX")"; BENCH_TMP_OUT="$BENCH_OUT"
trap 'rm -rf "$BENCH_TMP_OUT"' EXIT
bench_init timeline
bench_db_prepare
bench_start_sims 100ms
bench_start_gateway "$@"
WRK_PATH_TEMPLATE="/api/v1/dashboard/{id}" WRK_ID_MAX="$BENCH_USERS" taskset -c "$LOADGEN_CPUS" wrk -t1 -c500 -d16s -s "$BENCH_DIR/lib/wrk_report.lua" "http://127.0.0.1:$GATEWAY_PORT/api/v1/dashboard/1" > "$LOG_DIR/wrk.out" 2>&1 &
for _ in $(seq 1 75); do
  m=$(curl -s --max-time 2 "$GATEWAY_METRICS_URL")
  rej=$(echo "$m" | awk '/^tributary_admission_rejections_total.*dashboard/ {s+=$2} END {print s+0}')
  lim=$(echo "$m" | awk '/^tributary_admission_limit\{.*dashboard/ {print $2}')
  sat=$(echo "$m" | awk '/^tributary_runtime_saturated / {print $2}')
  dec=$(echo "$m" | awk '/^tributary_admission_limit_decreases_total.*dashboard/ {printf "%s=%s ", $1, $2}' | sed 's/tributary_admission_limit_decreases_total//g; s/group="dashboard"//g')
  echo "$(date +%S.%N | cut -c1-5) rej=$rej limit=$lim sat=$sat $dec"
  sleep 0.2
done
sleep 1
bench_stop "$GATEWAY_PID"; bench_stop_sims
