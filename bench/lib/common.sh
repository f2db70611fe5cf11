# shellcheck shell=bash
# Shared helpers for bench/scenarios/*.sh: tools, placement, process lifecycle, measurement.
# Sourced, not executed. Every helper is prefixed `bench_`.

set -euo pipefail

BENCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REPO_DIR="$(cd "$BENCH_DIR/.." && pwd)"
BIN_DIR="${BIN_DIR:-$REPO_DIR/target/release}"
[[ "$BIN_DIR" == /* ]] || BIN_DIR="$PWD/$BIN_DIR"
BENCH_QUICK="${BENCH_QUICK:-0}"
# Placement: the server under test alone on core 0, everything else on core 1 (a 2-core machine).
SERVER_CPUS="${BENCH_SERVER_CPUS:-0}"
LOADGEN_CPUS="${BENCH_LOADGEN_CPUS:-1}"
# The local Postgres is part of the rig: its backends answer the gateway's queries, so they belong
# on the rig's core, not beside the server under test. It is a system service the lab does not
# start, so bench_db_prepare pins its processes while a scenario runs (bench_pin_postgres) and
# bench_cleanup gives them back their mask. Left to the scheduler (BENCH_PG_CPUS=any, the placement
# of every run before 2026-12-04), its ~0.3 core of backends ran on core 0 too: the gateway got
# 0.67-0.79 of "its" core while core 0 was 98 % busy and core 1 had a quarter free.
PG_CPUS="${BENCH_PG_CPUS:-$LOADGEN_CPUS}"
# BENCH_GATEWAY_CPU_QUOTA=F (e.g. 0.5) also caps the gateway at F of its core with a CFS quota
# (a cgroup's cpu.cfs_quota_us, or cpu.max on cgroup v2, over a 100 ms period: what Kubernetes
# does for a pod with `limits.cpu: 500m`). On a 2-core machine the rig's core (load generator,
# simulators, Postgres) runs out near the gateway's full-core peak; a gateway held to half a core
# leaves the rig room, so what the lab measures under overload is the gateway, not the rig.
GATEWAY_CPU_QUOTA="${BENCH_GATEWAY_CPU_QUOTA:-}"
GATEWAY_CGROUP=""
export BENCH_GATEWAY_CPU_QUOTA="$GATEWAY_CPU_QUOTA" # measure.py records it with every run
PG_POSTMASTER=""
PG_SAVED_MASK=""
PG_URL_BASE="${BENCH_PG_URL_BASE:-postgres://postgres@127.0.0.1:5432}"
# Free ports, chosen by the kernel, so that a run never talks to somebody else's server.
read -r GATEWAY_PORT GATEWAY_OPS_PORT BENCH_SERVER_PORT OTLP_HTTP_PORT OTLP_GRPC_PORT SIM_PORT_LIST < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(10)]
for s in socks:
    s.bind(("127.0.0.1", 0))
ports = [s.getsockname()[1] for s in socks]
print(*ports[:5], ",".join(map(str, ports[5:])))
')
IFS=, read -r -a SIM_PORTS <<<"$SIM_PORT_LIST"

BENCH_PIDS=()

bench_log() { printf '[bench %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

# Pick one of two values: the full run or the --quick smoke.
bench_pick() { if [[ "$BENCH_QUICK" == 1 ]]; then echo "$2"; else echo "$1"; fi; }

bench_ensure_tools() {
  if ! command -v wrk >/dev/null; then
    bench_log "installing wrk (the load generator) with apt-get"
    apt-get install -y wrk >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y wrk >/dev/null; }
  fi
  command -v taskset >/dev/null || { bench_log "taskset (util-linux) is required"; exit 1; }
  # matplotlib (the plots) comes from the virtualenv under the build directory, never the system
  # Python; its python3 comes first on PATH for the rest of the scenario.
  local venv
  venv="$("$REPO_DIR/scripts/venv.sh" "$BENCH_DIR/requirements.txt")"
  export PATH="$venv/bin:$PATH"
  # High concurrency needs file descriptors: wrk, the gateway and the simulator inherit this.
  ulimit -n "${BENCH_NOFILE:-1048576}" 2>/dev/null || ulimit -n "$(ulimit -Hn)"
}

# Results go to bench/results/<scenario>/ unless BENCH_OUT names another root (the smoke run).
bench_init() {
  SCENARIO="$1"
  bench_ensure_tools
  RESULTS_ROOT="${BENCH_OUT:-$BENCH_DIR/results}"
  OUT_DIR="$RESULTS_ROOT/$SCENARIO"
  LOG_DIR="$(mktemp -d "${TMPDIR:-/tmp}/bench-$SCENARIO.XXXXXX")"
  export BENCH_LOG_DIR="$LOG_DIR" # measure.py's scratch files go here too
  # BENCH_KEEP_RUNS=1 adds runs to the existing ones (e.g. one more variant) instead of starting over.
  if [[ "${BENCH_KEEP_RUNS:-0}" != 1 ]]; then
    rm -rf "$OUT_DIR/runs" "$OUT_DIR/failures.jsonl"
  fi
  mkdir -p "$OUT_DIR/runs"
  python3 "$BENCH_DIR/lib/machine.py" >"$OUT_DIR/machine.json"
  export BENCH_COMMAND="${BENCH_COMMAND:-bench/run $SCENARIO$([[ "$BENCH_QUICK" == 1 ]] && echo ' --quick')}"
  trap bench_cleanup EXIT
  trap 'exit 143' TERM
  trap 'exit 130' INT
  bench_log "scenario $SCENARIO (quick=$BENCH_QUICK), binaries from $BIN_DIR, logs in $LOG_DIR"
}

# On exit: stop every process, drop the database this run created, and remove the logs (after
# printing their ends when the run failed; BENCH_KEEP_LOGS=1 keeps them).
bench_cleanup() {
  local rc=$? pid f
  for pid in "${BENCH_PIDS[@]}"; do
    bench_stop "$pid"
  done
  [[ -z "$GATEWAY_CGROUP" ]] || rmdir "$GATEWAY_CGROUP" 2>/dev/null || bench_log "could not remove $GATEWAY_CGROUP"
  bench_unpin_postgres
  if [[ "$BENCH_DB_CREATED" == 1 ]]; then
    psql "$PG_URL_BASE/postgres" -qc "DROP DATABASE IF EXISTS \"$BENCH_DB\" WITH (FORCE)" >/dev/null 2>&1 ||
      bench_log "could not drop database $BENCH_DB"
  fi
  if [[ -n "${LOG_DIR:-}" && -d "$LOG_DIR" ]]; then
    if [[ "${BENCH_KEEP_LOGS:-0}" == 1 ]]; then
      bench_log "logs kept in $LOG_DIR"
    else
      if ((rc != 0)); then
        for f in "$LOG_DIR"/*.log; do
          [[ -e "$f" ]] || continue
          bench_log "---- last lines of $(basename "$f")"
          tail -n 20 "$f" >&2 || true
        done
      fi
      rm -rf "$LOG_DIR"
    fi
  fi
  [[ -z "${BENCH_TMP_OUT:-}" ]] || rm -rf "$BENCH_TMP_OUT"
  return "$rc"
}

# bench_start NAME CPUS cmd... : start a process in the background (pinned), log to LOG_DIR/NAME.log.
# Sets BENCH_LAST_PID.
bench_start() {
  local name="$1" cpus="$2"
  shift 2
  # Appended, with a header per start, so that the log of a server that died is still there.
  echo "=== $(date -u +%FT%T) start: $*" >>"$LOG_DIR/$name.log"
  taskset -c "$cpus" "$@" >>"$LOG_DIR/$name.log" 2>&1 &
  BENCH_LAST_PID=$!
  BENCH_PIDS+=("$BENCH_LAST_PID")
}

# A started process that exited stays a zombie until reaped, and `kill -0` still succeeds on it.
bench_alive() {
  local state
  state="$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" || return 1
  [[ -n "$state" && "$state" != Z ]]
}

bench_stop() {
  local pid="$1" i
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 1 100); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

# bench_wait_http URL [SECONDS] [PID] : wait until URL answers 200 (and PID is alive).
bench_wait_http() {
  local url="$1" seconds="${2:-30}" pid="${3:-}" i
  for i in $(seq 1 $((seconds * 10))); do
    if [[ -n "$pid" ]] && ! bench_alive "$pid"; then
      bench_log "process $pid died while waiting for $url"
      return 1
    fi
    if [[ "$(curl -s -o /dev/null -w '%{http_code}' "$url")" == 200 ]]; then
      return 0
    fi
    sleep 0.1
  done
  bench_log "timed out waiting for $url"
  return 1
}

# An example binary (bench_server, loadgen); built on demand when missing (release or debug
# after BIN_DIR).
bench_example_bin() {
  local bin="$BIN_DIR/examples/$1"
  if [[ ! -x "$bin" ]]; then
    local profile=()
    [[ "$(basename "$BIN_DIR")" == release ]] && profile=(--release)
    bench_log "building $1 (${profile[*]:-debug})"
    (cd "$REPO_DIR" && cargo build "${profile[@]}" --example "$1" >&2)
  fi
  echo "$bin"
}

bench_server_bin() { bench_example_bin bench_server; }

# Start bench_server on core 0 with one tokio worker; sets SERVER_PID.
bench_start_bench_server() {
  bench_start bench_server "$SERVER_CPUS" env BENCH_LISTEN="127.0.0.1:$BENCH_SERVER_PORT" \
    BENCH_WORKER_THREADS=1 "$@" "$(bench_server_bin)"
  SERVER_PID=$BENCH_LAST_PID
  bench_wait_http "http://127.0.0.1:$BENCH_SERVER_PORT/light" 60 "$SERVER_PID"
}

# bench_measure ARGS... : one measured run (see bench/lib/measure.py --help).
bench_measure() {
  python3 "$BENCH_DIR/lib/measure.py" --machine "$OUT_DIR/machine.json" --loadgen-cpus "$LOADGEN_CPUS" "$@"
}

# bench_report TITLE : aggregate OUT_DIR/runs into report.md, plot.png and summary.json.
bench_report() {
  python3 "$BENCH_DIR/lib/report.py" scenario "$OUT_DIR" --title "$1" \
    --about "$BENCH_DIR/scenarios/$SCENARIO.md" --command "$BENCH_COMMAND"
  if [[ -z "${BENCH_OUT:-}" ]]; then
    python3 "$BENCH_DIR/lib/report.py" summary "$RESULTS_ROOT" >/dev/null
  fi
}

# Wait until the machine is quiet (see measure.py: wait_quiet); used before calibrating.
bench_wait_quiet() {
  (cd "$BENCH_DIR/lib" && python3 -c 'import measure, os
waited, busy = measure.wait_quiet(float(os.environ.get("BENCH_QUIET_THRESHOLD", 0.25)), float(os.environ.get("BENCH_QUIET_WAIT", 90)))
print(f"waited {waited} s for a quiet machine ({busy} cores busy)")') >&2
}

# Calibrate bench_server's CPU work once for the whole scenario (on a quiet machine) and export
# the result, so that every variant and repetition does exactly the same work.
bench_calibrate_server() {
  if [[ -z "${BENCH_SHA256_ITERATIONS:-}" || -z "${BENCH_MIXED_RECORDS:-}" ]]; then
    bench_wait_quiet
    bench_start_bench_server
    curl -s "http://127.0.0.1:$BENCH_SERVER_PORT/info" >"$OUT_DIR/calibration.json"
    bench_stop "$SERVER_PID"
    read -r BENCH_SHA256_ITERATIONS BENCH_MIXED_RECORDS < <(python3 -c '
import json, sys
info = json.load(open(sys.argv[1]))
print(info["sha256_iterations"], info["mixed_document_records"])' "$OUT_DIR/calibration.json")
    export BENCH_SHA256_ITERATIONS BENCH_MIXED_RECORDS
  fi
  bench_log "calibration: $BENCH_SHA256_ITERATIONS SHA-256 iterations (~5 ms), $BENCH_MIXED_RECORDS JSON records (~2 ms)"
}

# bench_server_run VARIANT PATH CONNECTIONS REP LIMIT_RPS LIMIT_BASIS DURATION WARMUP [ENV=VALUE...]
# One measured run against a fresh bench_server (fresh so that peak RSS belongs to this run),
# with a paced /light probe running beside the main load. A failed measurement (the server went
# away, wrk printed nothing) is tried once more with a new server, then skipped with a log line.
bench_server_run() {
  local variant="$1" path="$2" conns="$3" rep="$4" limit="$5" basis="$6" duration="$7" warmup="$8"
  shift 8
  local try base="http://127.0.0.1:$BENCH_SERVER_PORT"
  for try in 1 2; do
    if bench_start_bench_server "$@" && bench_measure --out "$OUT_DIR/runs/${variant}-c${conns}-r${rep}.json" --scenario "$SCENARIO" \
      --variant "$variant" --repetition "$rep" --url "$base$path" --connections "$conns" \
      --duration "$duration" --warmup "$warmup" --probe-url "$base/light" --probe-connections 4 \
      --server-pid "$SERVER_PID" --server-name bench_server --info-url "$base/info" \
      --limit-rps "$limit" --limit-basis "$basis" --meta "server_env=$*"; then
      bench_stop "$SERVER_PID"
      return 0
    fi
    bench_log "measurement $variant c=$conns rep $rep failed (try $try; server alive: $(bench_alive "$SERVER_PID" && echo yes || echo no))"
    bench_stop "$SERVER_PID"
  done
  bench_log "skipping $variant c=$conns rep $rep"
}

# ---------------------------------------------------------------------------------------------
# Gateway scenarios: Postgres database, five simulators, the gateway.

# Each run gets its own database, created, migrated and seeded by bench_db_prepare and dropped on
# exit; BENCH_DB names an existing one to use (and keep) instead.
BENCH_DB="${BENCH_DB:-tributary_bench_$(od -An -N4 -tx4 /dev/urandom | tr -d ' ')}"
BENCH_DB_CREATED=0
BENCH_USERS="${BENCH_USERS:-10000}"
BENCH_ORDERS_PER_USER="${BENCH_ORDERS_PER_USER:-5}"
DATABASE_URL_BENCH="$PG_URL_BASE/$BENCH_DB"
SIM_SERVICES=(users carts recommendations promotions notifications)
SIM_PIDS=()
GATEWAY_SETTINGS=()
GATEWAY_WRAPPER=()
# The caching scenarios' cache set-up (docs/caching.md): site-wide promotions shared by every
# user, and a per-user cache for the profile (short: it is the user's own, edited data) and the
# recommendations. carts and notifications stay uncached: they change with every action.
# shellcheck disable=SC2034 # read by bench/scenarios/caching*.sh
BENCH_CACHE_SETTINGS=(
  "TRIBUTARY_DOWNSTREAMS__PROMOTIONS__CACHE__KEY=shared"
  "TRIBUTARY_DOWNSTREAMS__PROMOTIONS__CACHE__TTL=30s"
  "TRIBUTARY_DOWNSTREAMS__USERS__CACHE__KEY=per_user"
  "TRIBUTARY_DOWNSTREAMS__USERS__CACHE__TTL=5s"
  "TRIBUTARY_DOWNSTREAMS__RECOMMENDATIONS__CACHE__KEY=per_user"
  "TRIBUTARY_DOWNSTREAMS__RECOMMENDATIONS__CACHE__TTL=30s"
)
# Zipf exponent of the user ids in the caching scenarios: id k is drawn with weight 1/k^s.
BENCH_ZIPF_S="${BENCH_ZIPF_S:-1.05}"

bench_gateway_bin() {
  local name="$1"
  if [[ ! -x "$BIN_DIR/$name" ]]; then
    bench_log "$BIN_DIR/$name is missing: build it (cargo build --release --bins) or set BIN_DIR"
    exit 1
  fi
  echo "$BIN_DIR/$name"
}

# The local Postgres's postmaster and its children (backends, background workers). New backends
# fork from the postmaster and inherit its mask, so pinning it places the backends of the run too.
bench_postgres_pids() {
  [[ -n "$PG_POSTMASTER" ]] && kill -0 "$PG_POSTMASTER" 2>/dev/null || return 0
  echo "$PG_POSTMASTER"
  pgrep -P "$PG_POSTMASTER" || true
}

# bench_pin_postgres : move the local Postgres onto PG_CPUS for the scenario (see PG_CPUS). Only a
# server on this machine whose postmaster.pid names a live process is touched; anything else (a
# remote server, no permission) is logged and left where it is, and the placement says so.
bench_pin_postgres() {
  [[ -z "$PG_POSTMASTER" ]] || return 0
  export BENCH_PG_PLACEMENT="unpinned"
  [[ "$PG_CPUS" != any ]] || return 0
  local datadir pid
  datadir="$(psql "$PG_URL_BASE/postgres" -tAc "SHOW data_directory" 2>/dev/null)" || datadir=""
  pid="$(head -n 1 "$datadir/postmaster.pid" 2>/dev/null)" || pid=""
  if [[ -z "$pid" ]] || ! PG_SAVED_MASK="$(taskset -p "$pid" 2>/dev/null | awk '{print $NF}')"; then
    bench_log "Postgres is not a local process this run can place: left unpinned"
    return 0
  fi
  PG_POSTMASTER="$pid"
  local p
  for p in $(bench_postgres_pids); do
    taskset -a -p -c "$PG_CPUS" "$p" >/dev/null 2>&1 || {
      bench_log "could not pin Postgres process $p to cores $PG_CPUS: left unpinned"
      bench_unpin_postgres
      return 0
    }
  done
  # Already on exactly these cores before the run: most likely a run killed before it could give
  # the mask back (SIGKILL runs no trap). Then the run gives it every online core, the service's
  # own placement, rather than keeping the left-over pin.
  if [[ "$(taskset -p "$pid" | awk '{print $NF}')" == "$PG_SAVED_MASK" ]]; then
    PG_SAVED_MASK="$(printf '%x' $(((1 << $(nproc)) - 1)))"
    bench_log "Postgres was already pinned to cores $PG_CPUS (a run killed mid-way?): it gets mask $PG_SAVED_MASK back"
  fi
  BENCH_PG_PLACEMENT="cores $PG_CPUS"
  bench_log "Postgres (postmaster $pid and its backends) pinned to cores $PG_CPUS for this run"
}

bench_unpin_postgres() {
  [[ -n "$PG_POSTMASTER" && -n "$PG_SAVED_MASK" ]] || return 0
  local p
  for p in $(bench_postgres_pids); do
    taskset -a -p "$PG_SAVED_MASK" "$p" >/dev/null 2>&1 || true
  done
  PG_POSTMASTER=""
}

# Create the dedicated database if needed, migrate it and seed it (both idempotent).
bench_db_prepare() {
  local exists
  bench_pin_postgres
  exists="$(psql "$PG_URL_BASE/postgres" -tAc "SELECT 1 FROM pg_database WHERE datname = '$BENCH_DB'")"
  if [[ "$exists" != 1 ]]; then
    bench_log "creating database $BENCH_DB (dropped when the run ends)"
    psql "$PG_URL_BASE/postgres" -qc "CREATE DATABASE \"$BENCH_DB\"" >/dev/null
    BENCH_DB_CREATED=1
  fi
  local tributary
  tributary="$(bench_gateway_bin tributary)"
  (cd "$LOG_DIR" && env -u RUST_LOG -u TRIBUTARY_CONFIG DATABASE_URL="$DATABASE_URL_BENCH" TRIBUTARY_TELEMETRY__LOG_LEVEL=warn \
    "$tributary" migrate >"$LOG_DIR/migrate.log" 2>&1)
  bench_log "seeding $BENCH_USERS users x $BENCH_ORDERS_PER_USER orders into $BENCH_DB"
  (cd "$LOG_DIR" && env -u RUST_LOG -u TRIBUTARY_CONFIG DATABASE_URL="$DATABASE_URL_BENCH" TRIBUTARY_TELEMETRY__LOG_LEVEL=warn \
    "$tributary" seed --users "$BENCH_USERS" --orders-per-user "$BENCH_ORDERS_PER_USER" >"$LOG_DIR/seed.log" 2>&1)
}

# bench_start_otlp_receiver : a real OTLP receiver for the gateway's export, rotel (the same pinned
# collector as the observability check, .ci/requirements-otel.txt, installed into the virtualenv
# on first use) with the blackhole exporter: it decodes every request and drops it. On the
# load-generator core, so that what it costs is not charged to the gateway. Sets OTLP_PID and
# OTLP_ENDPOINT (the base URL: /v1/metrics and /v1/traces are appended).
bench_start_otlp_receiver() {
  local venv rotel i code
  venv="$("$REPO_DIR/scripts/venv.sh" "$REPO_DIR/.ci/requirements-otel.txt")"
  rotel="$("$venv/bin/python" -c 'import pathlib, rotel; print(pathlib.Path(rotel.__file__).parent / "rotel-agent")')"
  bench_start otlp-receiver "$LOADGEN_CPUS" env NO_COLOR=1 "$rotel" start \
    --otlp-http-endpoint "127.0.0.1:$OTLP_HTTP_PORT" --otlp-grpc-endpoint "127.0.0.1:$OTLP_GRPC_PORT" \
    --pid-file "$LOG_DIR/rotel.pid" --exporter blackhole
  OTLP_PID=$BENCH_LAST_PID
  OTLP_ENDPOINT="http://127.0.0.1:$OTLP_HTTP_PORT"
  # Ready when an empty export request (a valid, empty protobuf message) is accepted.
  for i in $(seq 1 300); do
    bench_alive "$OTLP_PID" || { bench_log "the OTLP receiver exited; log: $LOG_DIR/otlp-receiver.log"; return 1; }
    code="$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 -X POST -H 'content-type: application/x-protobuf' \
      --data-binary '' "$OTLP_ENDPOINT/v1/metrics" || true)"
    [[ "$code" == 200 ]] && { bench_log "OTLP receiver ($("$rotel" --version 2>&1 | head -n 1)) on $OTLP_ENDPOINT"; return 0; }
    sleep 0.1
  done
  bench_log "timed out waiting for the OTLP receiver on $OTLP_ENDPOINT"
  return 1
}

# bench_start_sims LATENCY : one simulator per downstream (ports SIM_PORTS), all on core 1,
# one tokio worker each, as in compose. One port per service also gives each downstream its own
# range of ephemeral ports, which matters at high concurrency.
bench_start_sims() {
  local latency="$1" sim i
  sim="$(bench_gateway_bin downstream-sim)"
  SIM_PIDS=()
  for i in "${!SIM_SERVICES[@]}"; do
    bench_start "sim-${SIM_SERVICES[$i]}" "$LOADGEN_CPUS" env SIM_WORKER_THREADS=1 \
      "$sim" --listen "127.0.0.1:${SIM_PORTS[$i]}" --latency "$latency"
    SIM_PIDS+=("$BENCH_LAST_PID")
  done
  for i in "${!SIM_SERVICES[@]}"; do
    bench_wait_http "http://127.0.0.1:${SIM_PORTS[$i]}/healthz" 30 "${SIM_PIDS[$i]}"
  done
}

# bench_sim_stats_args : sets BENCH_SIM_STATS_ARGS to measure.py's --sim-stats for every
# simulator, so that a run records each downstream's calls from the simulator's own counter.
bench_sim_stats_args() {
  local i
  BENCH_SIM_STATS_ARGS=()
  for i in "${!SIM_SERVICES[@]}"; do
    BENCH_SIM_STATS_ARGS+=(--sim-stats "${SIM_SERVICES[$i]}=http://127.0.0.1:${SIM_PORTS[$i]}/_sim/stats")
  done
}

bench_stop_sims() {
  local pid
  for pid in "${SIM_PIDS[@]}"; do bench_stop "$pid"; done
  SIM_PIDS=()
}

# bench_gateway_quota : with BENCH_GATEWAY_CPU_QUOTA set, sets GATEWAY_QUOTA_PREFIX to a command
# prefix that enters the run's CPU-quota cgroup (made on first use, removed by bench_cleanup) and
# execs the rest: the gateway is in the cgroup from its first instruction and keeps its pid.
# Without a quota the prefix is empty.
GATEWAY_QUOTA_PREFIX=()
bench_gateway_quota() {
  [[ -n "$GATEWAY_CPU_QUOTA" ]] || return 0
  local quota_us period_us=100000 root
  if [[ -z "$GATEWAY_CGROUP" ]]; then
    quota_us="$(python3 -c 'import sys; q = float(sys.argv[1]); assert 0 < q <= 64, q; print(round(q * 100000))' \
      "$GATEWAY_CPU_QUOTA")" || { bench_log "BENCH_GATEWAY_CPU_QUOTA=$GATEWAY_CPU_QUOTA is not a number of cores F with 0 < F ≤ 64"; exit 2; }
    if [[ -e /sys/fs/cgroup/cpu/cpu.cfs_quota_us ]]; then
      root=/sys/fs/cgroup/cpu # cgroup v1
      GATEWAY_CGROUP="$root/tributary-bench-$$"
      if ! { mkdir "$GATEWAY_CGROUP" && echo "$period_us" >"$GATEWAY_CGROUP/cpu.cfs_period_us" &&
        echo "$quota_us" >"$GATEWAY_CGROUP/cpu.cfs_quota_us"; }; then
        bench_log "could not set a CPU quota in $GATEWAY_CGROUP"
        exit 1
      fi
    elif grep -qw cpu /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
      root=/sys/fs/cgroup # cgroup v2: the cpu controller must be enabled for the children
      grep -qw cpu "$root/cgroup.subtree_control" || echo +cpu >"$root/cgroup.subtree_control" ||
        { bench_log "could not enable the cpu controller in $root"; exit 1; }
      GATEWAY_CGROUP="$root/tributary-bench-$$"
      if ! { mkdir "$GATEWAY_CGROUP" && echo "$quota_us $period_us" >"$GATEWAY_CGROUP/cpu.max"; }; then
        bench_log "could not set a CPU quota in $GATEWAY_CGROUP"
        exit 1
      fi
    else
      bench_log "BENCH_GATEWAY_CPU_QUOTA needs a writable cgroup cpu controller (/sys/fs/cgroup/cpu or cgroup v2)"
      exit 1
    fi
    bench_log "gateway CPU quota: $quota_us µs per $period_us µs ($GATEWAY_CPU_QUOTA of a core) in $GATEWAY_CGROUP"
  fi
  # shellcheck disable=SC2016 # $$ and $0 are the inner shell's
  GATEWAY_QUOTA_PREFIX=(sh -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$GATEWAY_CGROUP")
}

# bench_start_gateway [ENV=VALUE...] : the gateway on core 0 with one worker, pointed at the
# simulators and the bench database; extra settings override. Sets GATEWAY_PID and GATEWAY_ENV.
bench_start_gateway() {
  local i
  GATEWAY_ENV=(
    "TRIBUTARY_SERVER__LISTEN=127.0.0.1:$GATEWAY_PORT"
    "TRIBUTARY_SERVER__OPS_LISTEN=127.0.0.1:$GATEWAY_OPS_PORT"
    "TRIBUTARY_SERVER__WORKER_THREADS=1"
    "DATABASE_URL=$DATABASE_URL_BENCH"
    "TRIBUTARY_TELEMETRY__LOG_LEVEL=${BENCH_GATEWAY_LOG_LEVEL:-info}"
  )
  for i in "${!SIM_SERVICES[@]}"; do
    GATEWAY_ENV+=("TRIBUTARY_DOWNSTREAMS__${SIM_SERVICES[$i]^^}__BASE_URL=http://127.0.0.1:${SIM_PORTS[$i]}")
  done
  GATEWAY_ENV+=("$@")
  local tributary
  tributary="$(bench_gateway_bin tributary)"
  # Started from the log directory, where there is no config/default.toml: the binary runs on its
  # built-in defaults (equal to that file, a unit test checks) plus the settings above, and a
  # config file edited in the work tree after the build cannot break or change a run.
  cd "$LOG_DIR"
  bench_gateway_quota
  # GATEWAY_WRAPPER (an array, empty by default) runs the binary under a tool: bench/profile's
  # instruction and syscall counts put valgrind or strace there.
  bench_start gateway "$SERVER_CPUS" "${GATEWAY_QUOTA_PREFIX[@]}" env -u RUST_LOG -u TRIBUTARY_CONFIG "${GATEWAY_ENV[@]}" \
    "${GATEWAY_WRAPPER[@]}" "$tributary" serve
  GATEWAY_PID=$BENCH_LAST_PID
  GATEWAY_METRICS_URL="http://127.0.0.1:$GATEWAY_OPS_PORT/metrics"
  cd - >/dev/null
  bench_wait_http "http://127.0.0.1:$GATEWAY_PORT/readyz" "${GATEWAY_START_TIMEOUT:-60}" "$GATEWAY_PID"
}

# bench_build_system_allocator : build the gateway with glibc's malloc instead of mimalloc (the
# `system-allocator` feature: for heaptrack, which intercepts malloc, and the allocator scenario)
# into target/heap-profile, apart from the shipped build; prints its BIN_DIR.
bench_build_system_allocator() {
  local target="$REPO_DIR/target/heap-profile"
  bench_log "building the gateway with glibc's malloc (--features system-allocator) in $target"
  (cd "$REPO_DIR" && cargo build --release --locked --bin tributary --features system-allocator \
    --target-dir "$target" >&2)
  echo "$target/release"
}

# bench_start_bare [ENV=VALUE...] : in the gateway's place (core 0, one worker, its port), the
# bare stack serving the same dashboard (examples/bare_gateway.rs: axum, reqwest and sqlx with
# none of tributary's features), pointed at the same simulators and database. It has no metrics.
# Sets GATEWAY_PID, GATEWAY_ENV and GATEWAY_METRICS_URL (empty), as bench_start_gateway does.
bench_start_bare() {
  local i bare
  GATEWAY_ENV=("BARE_LISTEN=127.0.0.1:$GATEWAY_PORT" "BARE_WORKER_THREADS=1" "DATABASE_URL=$DATABASE_URL_BENCH")
  for i in "${!SIM_SERVICES[@]}"; do
    GATEWAY_ENV+=("BARE_DOWNSTREAM_${SIM_SERVICES[$i]^^}=http://127.0.0.1:${SIM_PORTS[$i]}")
  done
  GATEWAY_ENV+=("$@")
  bare="$(bench_example_bin bare_gateway)"
  bench_gateway_quota
  bench_start gateway "$SERVER_CPUS" "${GATEWAY_QUOTA_PREFIX[@]}" env "${GATEWAY_ENV[@]}" "${GATEWAY_WRAPPER[@]}" "$bare"
  GATEWAY_PID=$BENCH_LAST_PID
  GATEWAY_METRICS_URL=""
  bench_wait_http "http://127.0.0.1:$GATEWAY_PORT/readyz" "${GATEWAY_START_TIMEOUT:-60}" "$GATEWAY_PID"
}

# bench_gateway_point VARIANT CONNECTIONS REP DURATION WARMUP LIMIT BASIS [MEASURE-ARGS...]
# Start a fresh gateway with the settings in the array GATEWAY_SETTINGS (started by the function
# GATEWAY_STARTER names: bench_start_gateway unless set, bench_start_bare for the bare stack), measure, stop. A failed
# measurement is tried once more with a new gateway, then skipped with a log line. Sets
# BENCH_POINT_OK to 1 or 0.
# shellcheck disable=SC2034 # BENCH_POINT_OK is read by the scenario scripts
bench_gateway_point() {
  local try
  BENCH_POINT_OK=0
  for try in 1 2; do
    if "${GATEWAY_STARTER:-bench_start_gateway}" "${GATEWAY_SETTINGS[@]}" && bench_gateway_run "$@"; then
      bench_stop "$GATEWAY_PID"
      BENCH_POINT_OK=1
      return 0
    fi
    if bench_alive "$GATEWAY_PID"; then
      bench_log "measurement $1 c=$2 rep $3 failed (try $try; the gateway is alive)"
      bench_stop "$GATEWAY_PID"
    else
      local status=0
      wait "$GATEWAY_PID" 2>/dev/null || status=$?
      bench_log "measurement $1 c=$2 rep $3 failed (try $try): the gateway had exited with status $status (143: SIGTERM, 137: SIGKILL, 101: panic); log: $LOG_DIR/gateway.log"
      echo "{\"variant\": \"$1\", \"connections\": $2, \"repetition\": $3, \"try\": $try, \"gateway_exit_status\": $status, \"at\": \"$(date -u +%FT%TZ)\"}" >>"$OUT_DIR/failures.jsonl"
    fi
  done
  bench_log "skipping $1 c=$2 rep $3"
}

# bench_gateway_run VARIANT CONNECTIONS REP DURATION WARMUP LIMIT BASIS [MEASURE-ARGS...]
# One measured run of the dashboard endpoint against the running gateway.
bench_gateway_run() {
  local variant="$1" conns="$2" rep="$3" duration="$4" warmup="$5" limit="$6" basis="$7"
  shift 7
  local sims
  sims="$(IFS=,; echo "${SIM_PIDS[*]}")"
  local metrics=()
  [[ -z "${GATEWAY_METRICS_URL:-}" ]] || metrics=(--metrics-url "$GATEWAY_METRICS_URL")
  bench_measure --out "$OUT_DIR/runs/${variant}-c${conns}-r${rep}.json" --scenario "$SCENARIO" \
    --variant "$variant" --repetition "$rep" \
    --url "http://127.0.0.1:$GATEWAY_PORT/api/v1/dashboard/1" \
    --wrk-env "WRK_PATH_TEMPLATE=/api/v1/dashboard/{id}" --wrk-env "WRK_ID_MAX=$BENCH_USERS" \
    --connections "$conns" --duration "$duration" --warmup "$warmup" \
    --server-pid "$GATEWAY_PID" --server-name gateway --proc "downstream-sim=$sims" \
    --proc-comm "postgres=postgres" "${metrics[@]}" \
    --limit-rps "$limit" --limit-basis "$basis" \
    --meta "gateway_env=${GATEWAY_ENV[*]}" --meta "users=$BENCH_USERS" "$@"
}
