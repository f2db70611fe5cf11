#!/usr/bin/env bash
set -euo pipefail
# A required downstream fails for a few seconds under a closed loop that retries at once: how
# soon does goodput come back once it is healthy again? The gateway on the lab's core with its
# shipped defaults, examples/loadgen.rs closed loop of CONNS connections for 30 s (3 s warm-up);
# 5 s into the measured window (by the clock of this script, which starts when the loadgen
# prints LOADGEN_MEASURING) the users simulator answers every call with 500 for FAULT_S
# seconds, then is healthy again. /metrics is read every 0.5 s (users breaker state, calls
# short-circuited, rejections). Variants alternate: each is a directory of release binaries.
# From bench/:
#   CONNS=5000 REPS=3 results/experiments/breaker-pushback/fault.sh OUT base=/tmp/bin-base fix=/tmp/bin-fix
cd "$(dirname "$0")/../../.."
out="$(realpath -m "$1")"; shift
mkdir -p "$out"
conns=${CONNS:-5000}
reps=${REPS:-3}
fault_s=${FAULT_S:-4}
# shellcheck source-path=SCRIPTDIR source=../../../lib/common.sh
source lib/common.sh
BENCH_OUT="$(mktemp -d "${TMPDIR:-/tmp}/bench-fault.XXXXXX")"; BENCH_TMP_OUT="$BENCH_OUT"
trap 'rm -rf "$BENCH_TMP_OUT"' EXIT
bench_init fault
bench_db_prepare
bench_start_sims 100ms
users_url="http://127.0.0.1:${SIM_PORTS[0]}/_sim/services/users"
healthy="$(curl -s "$users_url")"
set_users_errors() {
  python3 -c 'import json,sys; b=json.loads(sys.argv[1]); b["error_rate"]=float(sys.argv[2]); print(json.dumps(b))' \
    "$healthy" "$1" | curl -s -X PUT -H 'content-type: application/json' --data-binary @- "$users_url"
}
loadgen="$BIN_DIR/examples/loadgen"
for rep in $(seq 1 "$reps"); do
  for variant in "$@"; do
    name="${variant%%=*}"
    BIN_DIR="${variant#*=}"
    run="$out/$name-c$conns-r$rep"
    bench_wait_quiet
    bench_start_gateway "${GATEWAY_SETTINGS[@]}"
    taskset -c "$LOADGEN_CPUS" "$loadgen" --target "http://127.0.0.1:$GATEWAY_PORT" --closed "$conns" \
      --warmup 3 --duration 30 --path-template "/api/v1/dashboard/{id}" --id-max "$BENCH_USERS" \
      --json "$run.json" >"$run.loadgen.out" 2>&1 &
    lg=$!
    until grep -q LOADGEN_MEASURING "$run.loadgen.out" 2>/dev/null; do sleep 0.05; done
    ms() { local t=${EPOCHREALTIME/./}; echo $((t / 1000)); }
    started=$(ms)
    on=0 off=0
    : >"$run.metrics.txt"
    for _ in $(seq 1 60); do
      t=$(($(ms) - started))
      if ((on == 0 && t >= 5000)); then
        set_users_errors 1.0; on=$t; echo "fault on at ${t} ms" >>"$run.metrics.txt"
      fi
      if ((on > 0 && off == 0 && t >= on + fault_s * 1000)); then
        set_users_errors 0.0; off=$t; echo "fault off at ${t} ms" >>"$run.metrics.txt"
      fi
      m=$(curl -s --max-time 2 "$GATEWAY_METRICS_URL" || true)
      state=$(echo "$m" | awk '/^tributary_downstream_circuit_state\{.*downstream="users"/ {print $2}')
      short=$(echo "$m" | awk '/^tributary_downstream_requests_total\{/ && /downstream="users"/ && /circuit_open/ {s+=$2} END {print s+0}')
      rej=$(echo "$m" | awk '/^tributary_admission_rejections_total.*dashboard/ {s+=$2} END {print s+0}')
      echo "${t} ms users_circuit=$state short_circuited=$short rejections=$rej" >>"$run.metrics.txt"
      sleep 0.5
    done
    wait "$lg" || true
    bench_stop "$GATEWAY_PID"
    set_users_errors 0.0 >/dev/null
    bench_log "$name rep $rep: $(tail -1 "$run.loadgen.out")"
  done
done
bench_stop_sims
