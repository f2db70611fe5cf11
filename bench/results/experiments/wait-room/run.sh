#!/usr/bin/env bash
# The wait room of a fresh gateway and of one that was idle: how many requests are turned away
# at once when load past the admission limit arrives (every downstream 100 ms).
#
#   bench/results/experiments/wait-room/run.sh ROUNDS VARIANT...
#
# VARIANT is NAME=BIN_DIR[:ENV=VALUE,...], as in ../pool-warm-up/run.sh. Each round runs every
# variant once, in order: a new gateway (core 0, one worker, shipped defaults plus ENV); a
# `cold` burst of LOAD connections (default 250, over the initial limit of 200) for 2 s; 5 s of
# the same load; 5 s idle; an `idle` burst of 2 s. wrk (2 threads) on core 1 with the
# simulators and Postgres. Writes OUT (default /tmp/wait-room)/NAME-ROUND.{cold,warm,idle}.wrk
# and the metrics before and after each burst (.m*), and prints one line per run with the
# admission's rejections in each burst.
# Uses its own database (created, seeded and dropped) and ports 18080, 19090, 19001-19005.
set -euo pipefail
ROUNDS="$1"; shift
REPO="$(cd "$(dirname "$0")/../../../.." && pwd)"
OUT="${OUT:-/tmp/wait-room}"
LOAD="${LOAD:-250}"
DB=tributary_bench_wait_room
PG=postgres://postgres@127.0.0.1:5432
mkdir -p "$OUT"
SIMS=() GW=""
PM="$(head -n 1 "$(psql "$PG/postgres" -tAc 'SHOW data_directory')/postmaster.pid")"
MASK="$(taskset -p "$PM" | awk '{print $NF}')"
cleanup() {
  [[ -z "$GW" ]] || kill "$GW" 2>/dev/null || true
  for p in "${SIMS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for p in "$PM" $(pgrep -P "$PM"); do taskset -a -p "$MASK" "$p" >/dev/null 2>&1 || true; done
  psql "$PG/postgres" -qc "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true
}
trap cleanup EXIT
psql "$PG/postgres" -qc "CREATE DATABASE $DB" >/dev/null
B="$REPO/target/release"
DATABASE_URL="$PG/$DB" TRIBUTARY_TELEMETRY__LOG_LEVEL=warn "$B/tributary" migrate >/dev/null
DATABASE_URL="$PG/$DB" TRIBUTARY_TELEMETRY__LOG_LEVEL=warn "$B/tributary" seed --users 10000 --orders-per-user 5 >/dev/null
# Postgres on the load generator's core, as in the lab.
for p in "$PM" $(pgrep -P "$PM"); do taskset -a -p -c 1 "$p" >/dev/null; done
i=0
for s in users carts recommendations promotions notifications; do
  SIM_WORKER_THREADS=1 taskset -c 1 "$B/downstream-sim" --listen "127.0.0.1:$((19001 + i))" --latency 100ms >"$OUT/sim-$s.log" 2>&1 &
  SIMS+=($!); i=$((i + 1))
done
sleep 1
cat >"$OUT/path.lua" <<'L'
local n = 0
request = function() n = n + 1; return wrk.format("GET", "/api/v1/dashboard/" .. ((n * 7919) % 10000 + 1)) end
L
run() { # NAME ROUND BIN_DIR ENV...
  local tag="$1-$2" bin="$3"; shift 3
  env -u RUST_LOG -u TRIBUTARY_CONFIG TRIBUTARY_SERVER__LISTEN=127.0.0.1:18080 TRIBUTARY_SERVER__OPS_LISTEN=127.0.0.1:19090 \
    TRIBUTARY_SERVER__WORKER_THREADS=1 DATABASE_URL="$PG/$DB" \
    TRIBUTARY_DOWNSTREAMS__USERS__BASE_URL=http://127.0.0.1:19001 TRIBUTARY_DOWNSTREAMS__CARTS__BASE_URL=http://127.0.0.1:19002 \
    TRIBUTARY_DOWNSTREAMS__RECOMMENDATIONS__BASE_URL=http://127.0.0.1:19003 TRIBUTARY_DOWNSTREAMS__PROMOTIONS__BASE_URL=http://127.0.0.1:19004 \
    TRIBUTARY_DOWNSTREAMS__NOTIFICATIONS__BASE_URL=http://127.0.0.1:19005 "$@" \
    taskset -c 0 "$bin/tributary" serve >"$OUT/$tag.log" 2>&1 &
  GW=$!
  for _ in $(seq 100); do curl -sf localhost:18080/readyz >/dev/null && break; sleep 0.1; done
  rejections() { grep -E '^tributary_admission_rejections_total\{group="dashboard"' "$1" | awk '{s += $2} END {print s + 0}'; }
  burst() { # PHASE SECONDS
    curl -s localhost:19090/metrics >"$OUT/$tag.$1.m0"
    taskset -c 1 wrk -t2 -c"$LOAD" -d"$2"s --latency -s "$OUT/path.lua" http://127.0.0.1:18080 >"$OUT/$tag.$1.wrk" 2>&1
    curl -s localhost:19090/metrics >"$OUT/$tag.$1.m1"
    echo "$1=$(( $(rejections "$OUT/$tag.$1.m1") - $(rejections "$OUT/$tag.$1.m0") ))"
  }
  local cold warm idle
  cold=$(burst cold 2)
  warm=$(burst warm 5)
  sleep 5
  idle=$(burst idle 2)
  kill "$GW"; wait "$GW" 2>/dev/null || true; GW=""
  echo "$tag: 503s from admission: $cold $warm $idle"
}
for round in $(seq "$ROUNDS"); do
  for v in "$@"; do
    name="${v%%=*}" rest="${v#*=}"
    bin="${rest%%:*}" envs=()
    [[ "$rest" == *:* ]] && IFS=, read -ra envs <<<"${rest#*:}"
    [[ "$bin" == /* ]] || bin="$REPO/$bin"
    run "$name" "$round" "$bin" "${envs[@]}"
    sleep 1
  done
done
