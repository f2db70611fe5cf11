#!/usr/bin/env bash
# API conformance: schemathesis generates requests from the committed openapi.json and runs them
# against a live gateway, checking every answer against the document.
#
#   bash .ci/check-api.sh                    # BIN_DIR=target/debug by default (cargo build --bins)
#   API_CHECK_EXAMPLES=200 bash .ci/check-api.sh
#
# What it starts, each on a port the kernel chose (port 0, read back from the process's output):
# a fresh database (tributary_api_check_<random> on the local Postgres, migrated and seeded with
# 100 users), one downstream simulator serving all five services, and the gateway. Then it waits
# for /readyz and runs `schemathesis run` with the stateless checks (not_a_server_error,
# status_code_conformance, content_type_conformance, response_schema_conformance,
# response_headers_conformance), a fixed seed (API_CHECK_SEED) and at most API_CHECK_EXAMPLES
# test cases per operation, three times; it fails when any check fails:
#   1. every parameter and header generated, including `x-request-budget-ms: 0`, whose right
#      answer is a 504: that run accepts a 504 as not a server error
#      (.ci/schemathesis-any-budget.toml), and still checks it against the document;
#   2. the same with the budget pinned to 10 s: no 5xx is accepted;
#   3. `/metrics`, which the document serves from the operations listener, against that port.
#
# The gateway runs with rate limiting off (its default) and admission in static mode with a limit
# no run reaches, so that no 429 or 503 is caused by the checker's own pace: both answers are in
# the document, and what they look like is tested in tests/api; here they would only hide the
# handlers behind them.
#
# Everything it starts is stopped on exit (trap), the database dropped and the work directory
# removed; the whole run is bounded by API_CHECK_TIMEOUT seconds (default 600).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$0")/lib.sh"

ci_bound API_CHECK 600 "$@"
ci_prelude tributary_api_check
SEED=${API_CHECK_SEED:-20261201}
EXAMPLES=${API_CHECK_EXAMPLES:-50}
WORK=$(mktemp -d /tmp/tributary-api-check.XXXXXX)

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  ci_stop_all
  ci_drop_db "check-api: "
  if ((rc != 0)); then
    local f
    for f in "$WORK"/{sim,gateway}.log; do
      [[ -e $f ]] || continue
      echo "---- last lines of $(basename "$f")"
      tail -n 30 "$f" || :
    done
  fi
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'echo "check-api: interrupted or timed out (API_CHECK_TIMEOUT=${API_CHECK_TIMEOUT}s)"; exit 124' INT TERM

say() { printf '==> %s\n' "$*"; }
die() { printf 'check-api: %s\n' "$*" >&2; exit 1; }

for bin in tributary downstream-sim; do
  [[ -x $BIN_DIR/$bin ]] || die "$BIN_DIR/$bin is missing: cargo build --locked --bins"
done
command -v psql >/dev/null || die "psql not found: apt-get install postgresql-client"
command -v curl >/dev/null || die "curl not found: apt-get install curl"

VENV=$(scripts/venv.sh .ci/requirements-api.txt)
SCHEMATHESIS=$VENV/bin/schemathesis

# The committed document must be the code's (the test suite checks it too; this says so before
# a long run against a stale one).
if ! diff -q <("$BIN_DIR/tributary" openapi) openapi.json >/dev/null; then
  die "openapi.json is not what the code generates: run make openapi and commit it"
fi

# wait_for_addr FILE PATTERN PID: the address (HOST:PORT) on the first line of FILE that contains
# PATTERN (a fixed string), waiting up to 60 s while PID lives.
wait_for_addr() {
  local file=$1 pattern=$2 pid=$3 addr
  for _ in $(seq 600); do
    addr=$(grep -m1 -F -- "$pattern" "$file" 2>/dev/null | grep -oE '[0-9]+(\.[0-9]+){3}:[0-9]+' | head -n1 || :)
    if [[ -n $addr ]]; then
      printf '%s\n' "$addr"
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}

say "database $DB_NAME"
psql -q -d postgres -c "CREATE DATABASE $DB_NAME" >/dev/null
DB_CREATED=1
export DATABASE_URL="postgres://$PGUSER@$PGHOST:$PGPORT/$DB_NAME"
export TRIBUTARY_TELEMETRY__LOG_FORMAT=json
"$BIN_DIR/tributary" seed --users 100 --orders-per-user 3 >"$WORK/seed.log" 2>&1 ||
  { cat "$WORK/seed.log"; die "migrate and seed failed"; }

say "downstream simulator"
"$BIN_DIR/downstream-sim" --listen 127.0.0.1:0 --latency 2ms --latency-jitter 1ms >"$WORK/sim.log" 2>&1 &
PIDS+=("$!")
SIM_ADDR=$(wait_for_addr "$WORK/sim.log" 'listening on' "${PIDS[-1]}") ||
  die "the simulator did not start"
for service in USERS CARTS RECOMMENDATIONS PROMOTIONS NOTIFICATIONS; do
  export "TRIBUTARY_DOWNSTREAMS__${service}__BASE_URL=http://$SIM_ADDR"
done

say "gateway"
TRIBUTARY_SERVER__LISTEN=127.0.0.1:0 \
  TRIBUTARY_SERVER__OPS_LISTEN=127.0.0.1:0 \
  TRIBUTARY_ADMISSION__MODE=static \
  TRIBUTARY_ADMISSION__MAX_IN_FLIGHT=100000 \
  TRIBUTARY_RATE_LIMIT__ENABLED=false \
  "$BIN_DIR/tributary" serve >"$WORK/gateway.log" 2>&1 &
PIDS+=("$!")
GATEWAY=${PIDS[-1]}
API_ADDR=$(wait_for_addr "$WORK/gateway.log" '"message":"listening"' "$GATEWAY") ||
  die "the gateway did not start"
OPS_ADDR=$(wait_for_addr "$WORK/gateway.log" '"message":"operations endpoints listening"' "$GATEWAY") ||
  die "the gateway's operations listener did not start"
for _ in $(seq 300); do
  [[ $(curl -s -o /dev/null -m 2 -w '%{http_code}' "http://$API_ADDR/readyz") == 200 ]] && break
  kill -0 "$GATEWAY" 2>/dev/null || die "the gateway exited"
  sleep 0.1
done
[[ $(curl -s -o /dev/null -m 2 -w '%{http_code}' "http://$API_ADDR/readyz") == 200 ]] || die "the gateway is not ready"

# The default configuration, explicitly (no schemathesis.toml of the working directory applies).
: >"$WORK/schemathesis.toml"
CHECKS=not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,response_headers_conformance
# run_schemathesis CONFIG ARGS...: one run with CONFIG as its schemathesis.toml, in the work
# directory, where schemathesis keeps its cache (.schemathesis/), so nothing is left behind.
run_schemathesis() {
  local config=$1
  shift
  (cd "$WORK" && "$SCHEMATHESIS" --config-file "$config" run "$ROOT/openapi.json" \
    --checks "$CHECKS" --seed "$SEED" --max-examples "$EXAMPLES" --workers 1 \
    --request-timeout 10 --generation-database none --no-color "$@")
}

VERSION=$("$SCHEMATHESIS" --version | sed 's/.*version //')
say "schemathesis $VERSION against http://$API_ADDR, every header generated (seed $SEED, at most $EXAMPLES cases per operation)"
run_schemathesis "$ROOT/.ci/schemathesis-any-budget.toml" --url "http://$API_ADDR" --exclude-path /metrics
say "schemathesis against http://$API_ADDR with a 10 s budget: no 5xx at all"
run_schemathesis "$WORK/schemathesis.toml" --url "http://$API_ADDR" --exclude-path /metrics \
  --header 'x-request-budget-ms: 10000'
say "schemathesis against the operations listener http://$OPS_ADDR (/metrics)"
run_schemathesis "$WORK/schemathesis.toml" --url "http://$OPS_ADDR" --include-path /metrics
say "check-api: passed"
