#!/usr/bin/env bash
# overload-curve: successful (full, non-degraded 200) req/s against offered load, 0.5x to 20x the
# gateway's capacity, in three load shapes (closed loop, open loop, a client honouring
# Retry-After), for four admission configurations. Load from examples/loadgen.rs.
# shellcheck source-path=SCRIPTDIR source=../lib/common.sh
source "$(dirname "$0")/../lib/common.sh"
bench_init overload-curve

duration=${BENCH_DURATION:-$(bench_pick 10 2)}
warmup=$(bench_pick 3 1)
# Points: the full run is 4 configurations x 14 points of ~17 s (3 s warm-up, 10 s measured,
# gateway start and the quiet-machine check) plus the calibration: about 18 minutes.
read -r -a closed_points <<<"${BENCH_CLOSED:-$(bench_pick "250 500 1000 2500 5000 10000" "100")}"
read -r -a open_factors <<<"${BENCH_OPEN:-$(bench_pick "0.5 1 2 5 10 20" "0.5 2")}"
read -r -a retry_points <<<"${BENCH_RETRY:-$(bench_pick "1000 5000" "100")}"
read -r -a configs <<<"${BENCH_CONFIGS:-none reports capacity default}"
open_cap=${BENCH_OPEN_MAX_CONNECTIONS:-$(bench_pick 10000 500)}
calib_light=${BENCH_CAPACITY_LIGHT_CONNECTIONS:-$(bench_pick 50 10)}
calib_conns=${BENCH_CAPACITY_CONNECTIONS:-$(bench_pick 500 50)}
calib_max=${BENCH_CAPACITY_MAX_CONNECTIONS:-$(bench_pick 4000 100)}

loadgen="$(bench_example_bin loadgen)"
tributary="$(bench_gateway_bin tributary)"

# Settings of each configuration (environment only: the admission code may change under it).
# A name joined with `+` (e.g. `static-270+hold5`) takes the settings of each part.
config_env() {
  if [[ "$1" == *+* ]]; then
    local part parts
    IFS=+ read -r -a parts <<<"$1"
    for part in "${parts[@]}"; do config_env "$part"; done | xargs
    return
  fi
  case "$1" in
    none) echo "TRIBUTARY_ADMISSION__ENABLED=false" ;;
    reports) echo "TRIBUTARY_ADMISSION__MODE=static TRIBUTARY_ADMISSION__MAX_IN_FLIGHT=2000 TRIBUTARY_ADMISSION__MAX_WAIT=100ms" ;;
    capacity) echo "TRIBUTARY_ADMISSION__MODE=static TRIBUTARY_ADMISSION__MAX_IN_FLIGHT=$capacity_limit" ;;
    default) echo "" ;;
    # Experiments, not in the default plan (name them in BENCH_CONFIGS): the shipped defaults with
    # the admission limit blind to the database pool's line, with a 10 ms queueing-delay target,
    # or with pushback holding a 503 for at most 2 s or 5 s.
    pool-blind) echo "TRIBUTARY_OVERLOAD__FOLLOW_DB_POOL=false" ;;
    target10) echo "TRIBUTARY_OVERLOAD__QUEUE_DELAY_TARGET=10ms" ;;
    hold2) echo "TRIBUTARY_ADMISSION__PUSHBACK_MAX_HOLD=2s" ;;
    hold5) echo "TRIBUTARY_ADMISSION__PUSHBACK_MAX_HOLD=5s" ;;
    # nopush: no pushback, every 503 answered at once (what a gateway behind an L7 proxy runs).
    nopush) echo "TRIBUTARY_ADMISSION__PUSHBACK=false" ;;
    # unchecked: every window of the core's queue over the target cuts the adaptive limit, as
    # before overload.check_core_cuts.
    unchecked) echo "TRIBUTARY_OVERLOAD__CHECK_CORE_CUTS=false" ;;
    # probe: while the core's queue is left out (a cut did not shorten it), grow the limit.
    probe) echo "TRIBUTARY_OVERLOAD__PROBE_PAST_CORE=true" ;;
    noprobe) echo "TRIBUTARY_OVERLOAD__PROBE_PAST_CORE=false" ;;
    # settle: after a cut the limit holds for a permit-hold time before it grows back.
    settle) echo "TRIBUTARY_OVERLOAD__SETTLE_AFTER_CUT=true" ;;
    # target-N: the shipped defaults with an N ms queueing-delay target.
    target-[0-9]*) echo "TRIBUTARY_OVERLOAD__QUEUE_DELAY_TARGET=${1#target-}ms" ;;
    # static-N: a static limit of N permits (the shipped wait), to compare with a learnt one.
    static-[0-9]*) echo "TRIBUTARY_ADMISSION__MODE=static TRIBUTARY_ADMISSION__MAX_IN_FLIGHT=${1#static-}" ;;
    # standing-N: a standing admission wait queue kept to half of what returns within N ms
    # (admission.standing_wait; 30 ms in the shipped defaults, standing-100 turns it off).
    standing-[0-9]*) echo "TRIBUTARY_ADMISSION__STANDING_WAIT=${1#standing-}ms" ;;
    # dbpool-N: the shipped defaults with N pooled database connections (max_replicas lowered so
    # that N × replicas still fits the server's connections, as start-up checks).
    dbpool-[0-9]*) echo "TRIBUTARY_DATABASE__MAX_CONNECTIONS=${1#dbpool-} TRIBUTARY_DATABASE__MAX_REPLICAS=1" ;;
    # wait-N: the shipped defaults with admission.max_wait N ms (the wait queue holds half of
    # what the release rate returns within it).
    wait-[0-9]*) echo "TRIBUTARY_ADMISSION__MAX_WAIT=${1#wait-}ms" ;;
    # no-thp: mimalloc's transparent huge pages off (every page the allocator touches for the
    # first time is a 4 KiB fault to zero, not 2 MiB): the binary's own default since 2026-12-07
    # (src/allocator.rs), so this matters for builds before it; thp: huge pages kept, as before.
    no-thp) echo "MIMALLOC_ALLOW_THP=0" ;;
    thp) echo "MIMALLOC_ALLOW_THP=1" ;;
    # initial-N: the shipped defaults with the adaptive limit starting at N
    # (admission.adaptive.initial_limit).
    initial-[0-9]*) echo "TRIBUTARY_ADMISSION__ADAPTIVE__INITIAL_LIMIT=${1#initial-}" ;;
    *) bench_log "unknown configuration $1 (none, reports, capacity, default, pool-blind, target10, hold2, hold5, nopush, unchecked, probe, noprobe, settle, no-thp, thp, target-N, static-N, standing-N, dbpool-N, wait-N, initial-N)"; exit 2 ;;
  esac
}

# Every connection is a file descriptor in the load generator and in the gateway, which also holds
# up to one connection per downstream call in flight (5 bulkheads of 1,024): a point that would
# not fit `ulimit -n` is skipped and recorded in stopped.jsonl (as in the sweep).
nofile=$(ulimit -n)
[[ "${BENCH_KEEP_RUNS:-0}" == 1 ]] || rm -f "$OUT_DIR/stopped.jsonl"
fits() {
  local conns="$1" need
  need=$((conns + 5 * (conns < 1024 ? conns : 1024) + 500))
  ((need <= nofile)) && return 0
  bench_log "skipping $conns connections: the gateway would need ~$need file descriptors (limit $nofile)"
  echo "{\"skipped_connections\": $conns, \"gateway_fds_needed\": $need, \"fd_limit\": $nofile}" >>"$OUT_DIR/stopped.jsonl"
  return 1
}

# curve_point NAME OUT CONFIG SHAPE CONNECTIONS [RATE] : one measured run against a fresh gateway
# (fresh, so that peak RSS and the breakers belong to this run); tried twice, then skipped.
curve_point() {
  local name="$1" out="$2" config="$3" shape="$4" conns="$5" rate="${6:-}" try sims
  local -a settings extra=()
  read -r -a settings <<<"$(config_env "$config")"
  [[ -z "$rate" ]] || extra=(--rate "$rate")
  fits "$conns" || return 0
  for try in 1 2; do
    if bench_start_gateway "${settings[@]}"; then
      sims="$(IFS=,; echo "${SIM_PIDS[*]}")"
      if bench_measure --out "$out" --scenario "$SCENARIO" --variant "$config" --x-name "$name" \
        --x-value "${rate:-$conns}" --url "http://127.0.0.1:$GATEWAY_PORT/api/v1/dashboard/1" \
        --wrk-env "WRK_PATH_TEMPLATE=/api/v1/dashboard/{id}" --wrk-env "WRK_ID_MAX=$BENCH_USERS" \
        --loadgen "$loadgen" --shape "$shape" "${extra[@]}" --connections "$conns" \
        --duration "$duration" --warmup "$warmup" --gauge-series \
        --server-pid "$GATEWAY_PID" --server-name gateway --proc "downstream-sim=$sims" \
        --proc-comm "postgres=postgres" --metrics-url "http://127.0.0.1:$GATEWAY_OPS_PORT/metrics" \
        --limit-rps "${capacity_rps:-1}" --limit-basis "${capacity_basis:-calibration run}" \
        --meta "gateway_env=${GATEWAY_ENV[*]}" --meta "config=$config" --meta "users=$BENCH_USERS"; then
        bench_stop "$GATEWAY_PID"
        return 0
      fi
    fi
    bench_log "$config $shape $name=${rate:-$conns} failed (try $try; gateway alive: $(bench_alive "$GATEWAY_PID" && echo yes || echo no))"
    bench_stop "$GATEWAY_PID"
  done
  echo "{\"config\": \"$config\", \"shape\": \"$shape\", \"connections\": $conns, \"rate\": \"$rate\", \"at\": \"$(date -u +%FT%TZ)\"}" >>"$OUT_DIR/failures.jsonl"
  bench_log "skipping $config $shape $name=${rate:-$conns}"
}

json_field() { python3 -c 'import json, sys; d = json.load(open(sys.argv[1]))
for k in sys.argv[2].split("."): d = d[k]
print(d)' "$1" "$2"; }

bench_db_prepare
bench_start_sims 100ms

# 1. Capacity, measured with the shipped defaults (BENCH_CAPACITY_RPS and
#    BENCH_CAPACITY_LATENCY_MS skip it): the unloaded latency W0 at a light closed loop, and the
#    full-200 throughput at a moderate one. They set the x axis and the `capacity` limit.
mkdir -p "$OUT_DIR/calibration"
capacity_rps=${BENCH_CAPACITY_RPS:-}
w0_ms=${BENCH_CAPACITY_LATENCY_MS:-}
if [[ -z "$w0_ms" ]]; then
  curve_point connections "$OUT_DIR/calibration/light.json" default closed "$calib_light"
  w0_ms="$(json_field "$OUT_DIR/calibration/light.json" latency_ms.mean)"
fi
if [[ -z "$capacity_rps" ]]; then
  # Capacity is what the gateway's core carries, so the calibration load must saturate it: a
  # closed loop of N connections can offer no more than N ÷ W0 (Little's law), and on a fast VM
  # 500 connections left the core 30 % idle, which put C under the gateway's real peak and the
  # 500-connection and open-loop 1× points "past capacity" when they were not. The connections
  # double (at most to $calib_max) until the gateway uses ≥ 90 % of its core and doubling gains
  # less than 5 %, and C is the best full-200 rate seen.
  conns=$calib_conns
  capacity_rps=0
  prev_best=0
  rm -f "$OUT_DIR"/calibration/peak*.json # an earlier run's points, which this one may not reach
  while :; do
    curve_point connections "$OUT_DIR/calibration/peak-c$conns.json" default closed "$conns"
    rps="$(json_field "$OUT_DIR/calibration/peak-c$conns.json" goodput.full_rps)"
    util="$(json_field "$OUT_DIR/calibration/peak-c$conns.json" processes.gateway.cpu_util)"
    read -r capacity_rps best < <(python3 -c 'import sys; c, r = map(float, sys.argv[1:]); print(max(c, r), int(r > c))' \
      "$capacity_rps" "$rps")
    ((best == 0)) || calib_best=$conns
    bench_log "calibration: $conns connections, $rps full 200/s, gateway $util of its core"
    calib_used=$conns
    # Done when the gateway uses ≥ 90 % of its allowance (the core, or its CFS quota under
    # BENCH_GATEWAY_CPU_QUOTA) and doubling no longer bought 5 % more: a busier core batches more
    # work per wake-up, so the core can be "full" at a rate below its peak (half a core: 0.49 of
    # it at 1,804 full 200/s with 250 connections, 2,470/s with 1,000).
    python3 -c 'import sys; u, q, r, prev = map(float, sys.argv[1:]); sys.exit(u < 0.9 * q or r > 1.05 * prev)' \
      "$util" "${GATEWAY_CPU_QUOTA:-1}" "$rps" "$prev_best" && break
    prev_best=$capacity_rps
    ((conns * 2 <= calib_max)) || break
    conns=$((conns * 2))
  done
fi
capacity_basis="the best full-200 req/s of the shipped defaults in closed loops from $calib_conns connections, doubled until the gateway used ≥ 90 % of its ${GATEWAY_CPU_QUOTA:+quota of }core and doubling gained < 5 % (last: ${calib_used:-$calib_conns}) (calibration)"
[[ -z "${BENCH_CAPACITY_RPS:-}" ]] || capacity_basis="BENCH_CAPACITY_RPS"
"$tributary" capacity --target-rps "$capacity_rps" --latency-ms "$w0_ms" >"$OUT_DIR/calibration/capacity.txt"
capacity_limit="$(tail -n 1 "$OUT_DIR/calibration/capacity.txt" | python3 -c 'import json, sys; print(json.load(sys.stdin)["admission_limit"])')"
cat >"$OUT_DIR/calibration/capacity.json" <<EOF
{"capacity_rps": $capacity_rps, "w0_ms": $w0_ms, "basis": "$capacity_basis",
 "capacity_command": "tributary capacity --target-rps $capacity_rps --latency-ms $w0_ms",
 "capacity_admission_limit": $capacity_limit}
EOF
bench_log "capacity $capacity_rps full-200 req/s, W0 $w0_ms ms; tributary capacity recommends max_in_flight = $capacity_limit"

# 2. The curves, interleaved: each point is measured with every configuration in turn, and the
#    order of the configurations rotates from one point to the next. Run one configuration after
#    the other (as before 2026-12-04), the last one always ran ~12 minutes later than the first
#    on a VM whose speed drifts by 10-30 % in that time, and the shipped line always ran last.
# 3. The VM's speed drifts (the same build served 1,350-1,600 and then 2,300-2,450 full 200/s at
#    the same half-core points twenty minutes apart on 2026-12-05), and a point is judged against a
#    peak measured up to twenty minutes earlier. So before each point, and after the last, the
#    shipped defaults are measured once more at the calibration's best load (`reference/`,
#    BENCH_REFERENCE=0 skips them): curve.py sets each point beside the references run just
#    before and after it, the capacity of the machine at that moment.
ref_conns=${BENCH_REFERENCE_CONNECTIONS:-${calib_best:-$calib_conns}}
[[ "${BENCH_KEEP_RUNS:-0}" == 1 ]] || rm -rf "$OUT_DIR/reference"
mkdir -p "$OUT_DIR/reference"
reference() {
  [[ "${BENCH_REFERENCE:-1}" != 0 ]] || return 0
  curve_point connections "$OUT_DIR/reference/ref-$1.json" default closed "$ref_conns"
}
points=()
for conns in "${closed_points[@]}"; do points+=("closed $conns"); done
for factor in "${open_factors[@]}"; do points+=("open $factor"); done
for conns in "${retry_points[@]}"; do points+=("retry-after $conns"); done
for i in "${!points[@]}"; do
  read -r shape x <<<"${points[$i]}"
  reference "$i"
  for ((k = 0; k < ${#configs[@]}; k++)); do
    config="${configs[$(((i + k) % ${#configs[@]}))]}"
    case "$shape" in
      closed) curve_point connections "$OUT_DIR/runs/$config-closed-c$x-r1.json" "$config" closed "$x" ;;
      open)
        rate="$(python3 -c "import sys; print(round(float(sys.argv[1]) * float(sys.argv[2])))" "$x" "$capacity_rps")"
        curve_point rate "$OUT_DIR/runs/$config-open-x$x-r1.json" "$config" open "$open_cap" "$rate"
        ;;
      retry-after) curve_point connections "$OUT_DIR/runs/$config-retry-after-c$x-r1.json" "$config" retry-after "$x" ;;
    esac
  done
done
reference "${#points[@]}"
bench_stop_sims
python3 "$BENCH_DIR/lib/curve.py" "$OUT_DIR" --about "$BENCH_DIR/scenarios/$SCENARIO.md" --command "$BENCH_COMMAND"
if [[ -z "${BENCH_OUT:-}" ]]; then
  python3 "$BENCH_DIR/lib/report.py" summary "$RESULTS_ROOT" >/dev/null
fi
