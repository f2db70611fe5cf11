#!/usr/bin/env bash
# Observability check: the repository's Prometheus config, alert rules, Grafana dashboards and
# prometheus-adapter rules, validated statically and then against a real Prometheus scraping a
# real gateway under traffic; and the same gateway's OTLP export (traces and metrics) received by a
# real OpenTelemetry collector.
#
#   bash .ci/check-observability.sh            # BIN_DIR=target/debug by default
#   BIN_DIR=target/release bash .ci/check-observability.sh
#
# Steps (one PASS/FAIL line each, summary at the end, exit 1 if anything failed):
#   1. install what a fresh machine lacks: prometheus (promtool) and wrk with apt-get, PyYAML and
#      rotel (a collector, .ci/requirements-otel.txt) into the virtualenv target/venv
#      (scripts/venv.sh), npm ci in grafana/schema-check;
#   2. promtool check config / check rules / test rules; the @grafana/schema type check of every
#      dashboard; prometheus/check_queries.py static (panel hygiene, PromQL syntax of every
#      dashboard query, compose mounts);
#   3. a fresh database (tributary_obs_check_<random> on the local Postgres, dropped on exit),
#      `tributary migrate` and
#      `tributary seed`, three downstream simulators (healthy, slow, flaky), the gateway with a tiny
#      admission limit, a tiny pool, rate limiting with an unreachable Redis and a low long-poll
#      threshold, and one downstream not listening at all, so that shedding, degradation, timeouts,
#      errors, retries, an open circuit, 429s, Redis fallbacks and long polls all happen; Prometheus with a copy of prometheus/prometheus.yml
#      scraping the gateway every second; rotel as an OTLP/HTTP receiver, to which the gateway
#      exports spans and (every second) metrics through the standard OTEL_* variables alone;
#   4. bounded traffic (wrk plus curl loops: dashboards, order POSTs with Idempotency-Key, order
#      GETs, bad requests, 404s);
#   5. through Prometheus' HTTP API: the target is up, and every dashboard query, every recording
#      and alerting rule and every prometheus-adapter rule parses and returns data
#      (prometheus/check_queries.py live); every metric those queries name is in the live scrape;
#   6. `promtool check metrics` on a live scrape of /metrics (on the operations port; the API port
#      must not serve it);
#   7. what rotel received (recorded by the Python processor .ci/otlp_capture.py, as JSON lines):
#      spans with the configured service name and resource attribute, a server span per dashboard
#      request with a client span (a downstream call) as its child in the same trace; metrics with
#      the same resource, among them the HTTP server duration histogram (unit s) and the
#      downstream and database instruments.
#
# Everything it starts is killed on exit (trap) and its database dropped; the whole run is bounded
# by OBS_CHECK_TIMEOUT seconds (default 600). Its work directory (logs, Prometheus' TSDB) is removed
# on exit; when a check failed the last lines of each log are printed first, and OBS_KEEP_WORK=1
# keeps the directory.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$0")/lib.sh"

# The whole run is time-bounded (OBS_CHECK_TIMEOUT, default 600 s); the TERM trap below stops
# everything started.
ci_bound OBS_CHECK 600 "$@"
ci_prelude tributary_obs_check
TRAFFIC_SECONDS=${TRAFFIC_SECONDS:-25}
DATABASE_URL="postgres://$PGUSER@$PGHOST:$PGPORT/$DB_NAME"
OBS_WORK=$(mktemp -d /tmp/tributary-obs-check.XXXXXX)

PASSED=0
FAILED=0
FAILURES=()

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  # Newest first, so that the traffic stops before the gateway does.
  ci_stop_all
  ci_drop_db ""
  if [[ -n ${OBS_KEEP_WORK:-} ]]; then
    echo "work directory kept: $OBS_WORK"
  else
    if [[ $rc -ne 0 ]]; then
      local f
      for f in "$OBS_WORK"/{gateway,sim-ok,sim-slow,sim-flaky,prometheus,rotel,wrk}.log; do
        [[ -e $f ]] || continue
        echo "---- last lines of $(basename "$f")"
        tail -n 25 "$f" || :
      done
    fi
    rm -rf "$OBS_WORK"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'echo "FAIL  interrupted or timed out (OBS_CHECK_TIMEOUT=${OBS_CHECK_TIMEOUT}s)"; exit 124' INT TERM

log() { printf '==> %s\n' "$*"; }
pass() { PASSED=$((PASSED + 1)); printf 'PASS  %s\n' "$1"; }
fail() { FAILED=$((FAILED + 1)); FAILURES+=("$1"); printf 'FAIL  %s\n' "$1"; }
die() { fail "$1"; summary; exit 1; }
summary() {
  echo
  echo "check-observability summary: $PASSED passed, $FAILED failed"
  local f
  for f in "${FAILURES[@]+"${FAILURES[@]}"}"; do echo "  failed: $f"; done
}

# check NAME CMD...: run CMD bounded by 300 s, output indented, PASS/FAIL by its exit status.
check() {
  local name=$1
  shift
  local out=$OBS_WORK/check-$((PASSED + FAILED)).log
  if timeout 300 "$@" >"$out" 2>&1; then
    sed 's/^/      /' "$out"
    pass "$name"
  else
    local rc=$?
    sed 's/^/      /' "$out"
    fail "$name (exit $rc)"
  fi
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# wait_http URL SECONDS: poll until URL answers 2xx.
wait_http() {
  local url=$1 deadline=$((SECONDS + $2))
  until curl -fsS -o /dev/null --max-time 2 "$url" 2>/dev/null; do
    ((SECONDS < deadline)) || return 1
    sleep 0.2
  done
}

# ---------------------------------------------------------------------------
log "1. tools"
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null || ! command -v wrk >/dev/null; then
  echo "    installing prometheus (promtool) and wrk with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  timeout 300 apt-get update -qq
  timeout 300 apt-get install -y -qq --no-install-recommends prometheus wrk >"$OBS_WORK/apt.log" 2>&1 ||
    { cat "$OBS_WORK/apt.log"; die "apt-get install prometheus wrk"; }
fi
# PyYAML for check_queries.py, from the virtualenv under the build directory (not the system Python).
VENV=$(scripts/venv.sh prometheus/requirements.txt .ci/requirements-otel.txt) ||
  die "scripts/venv.sh prometheus/requirements.txt .ci/requirements-otel.txt"
export PATH="$VENV/bin:$PATH"
# The wheel has no entry point for the binary: it sits in the package's folder.
ROTEL=$(python3 -c 'import pathlib, rotel; print(pathlib.Path(rotel.__file__).parent / "rotel-agent")') ||
  die "rotel is not importable from $VENV"
[[ -x $ROTEL ]] || die "no rotel-agent binary at $ROTEL"
(cd grafana/schema-check && timeout 300 npm ci --no-audit --no-fund --loglevel=error >"$OBS_WORK/npm.log" 2>&1) ||
  { cat "$OBS_WORK/npm.log"; die "npm ci in grafana/schema-check"; }
echo "    $(prometheus --version 2>&1 | head -n 1); $(wrk --version 2>&1 | head -n 1 | cut -c1-40); $("$ROTEL" --version 2>&1 | head -n 1)"

# ---------------------------------------------------------------------------
log "2. static checks"
check "promtool check config prometheus/prometheus.yml" promtool check config prometheus/prometheus.yml
check "promtool check config prometheus/prometheus-otel.yml (the compose collector variant)" \
  promtool check config prometheus/prometheus-otel.yml
check "promtool check rules prometheus/alerts.yml" promtool check rules prometheus/alerts.yml
check "promtool test rules prometheus/alerts_test.yml (a firing and a silent case per alert)" \
  promtool test rules prometheus/alerts_test.yml
check "grafana dashboards satisfy @grafana/schema (tsc --strict)" node grafana/schema-check/check-dashboards.mjs
check "dashboards: panel hygiene, PromQL syntax, compose mounts (check_queries.py static)" \
  python3 prometheus/check_queries.py static

# ---------------------------------------------------------------------------
log "3. gateway, simulators and Prometheus"
if [[ ! -x $BIN_DIR/tributary || ! -x $BIN_DIR/downstream-sim ]]; then
  if [[ $BIN_DIR == "$ROOT/target/debug" ]]; then
    log "building the binaries (cargo build --bins)"
    timeout 1200 cargo build --bins --quiet || die "cargo build --bins"
  else
    die "no tributary / downstream-sim binaries in $BIN_DIR"
  fi
fi

pg_isready -q -t 10 || die "Postgres at $PGHOST:$PGPORT is not accepting connections"
DB_CREATED=1
psql -q -v ON_ERROR_STOP=1 -d postgres -c "CREATE DATABASE $DB_NAME" || die "create database $DB_NAME"
export DATABASE_URL
check "tributary migrate" "$BIN_DIR/tributary" migrate
check "tributary seed --users 200 --orders-per-user 5" "$BIN_DIR/tributary" seed --users 200 --orders-per-user 5

SIM_OK=$(free_port)
SIM_SLOW=$(free_port)
SIM_FLAKY=$(free_port)
GATEWAY=$(free_port)
OPS=$(free_port) # the gateway's operations listener: /metrics
PROM=$(free_port)
OTLP_HTTP=$(free_port)    # rotel's OTLP/HTTP receiver
OTLP_GRPC=$(free_port)    # and its gRPC one, which nothing uses (its default port may be taken)
REDIS_CLOSED=$(free_port) # nothing listens here: every Redis call fails and falls back
SIM_DOWN=$(free_port)     # nor here: notifications is "down", its calls fail to connect and are retried

# Healthy: users, carts.
"$BIN_DIR/downstream-sim" --listen "127.0.0.1:$SIM_OK" --latency 5ms --latency-jitter 3ms \
  >"$OBS_WORK/sim-ok.log" 2>&1 &
PIDS+=("$!")
# Slower than the promotions timeout (150ms): timeouts and degraded responses.
"$BIN_DIR/downstream-sim" --listen "127.0.0.1:$SIM_SLOW" --latency 400ms \
  >"$OBS_WORK/sim-slow.log" 2>&1 &
PIDS+=("$!")
# Answers 500 to 60% of calls: errors (not retried: a 500 is not transient) and an opened circuit
# for recommendations.
"$BIN_DIR/downstream-sim" --listen "127.0.0.1:$SIM_FLAKY" --latency 5ms --error-rate 0.6 \
  >"$OBS_WORK/sim-flaky.log" 2>&1 &
PIDS+=("$!")
for port in "$SIM_OK" "$SIM_SLOW" "$SIM_FLAKY"; do
  wait_http "http://127.0.0.1:$port/healthz" 30 || die "downstream-sim on :$port did not become healthy"
done
pass "three downstream simulators answer /healthz"

# A real collector for the gateway's OTLP export, started before the gateway so that the first
# exports find it. Its Python processor writes what arrives to otlp-capture.jsonl (step 7); the
# blackhole exporter drops it afterwards.
OTLP_CAPTURE=$OBS_WORK/otlp-capture.jsonl
OTLP_CAPTURE=$OTLP_CAPTURE NO_COLOR=1 "$ROTEL" start --otlp-http-endpoint "127.0.0.1:$OTLP_HTTP" \
  --otlp-grpc-endpoint "127.0.0.1:$OTLP_GRPC" --pid-file "$OBS_WORK/rotel.pid" --exporter blackhole \
  --otlp-with-trace-processor .ci/otlp_capture.py --otlp-with-metrics-processor .ci/otlp_capture.py \
  >"$OBS_WORK/rotel.log" 2>&1 &
ROTEL_PID=$!
PIDS+=("$ROTEL_PID")
# Ready when an empty export request (a valid, empty protobuf message) is accepted.
rotel_deadline=$((SECONDS + 30))
until [[ $(curl -s -o /dev/null -w '%{http_code}' --max-time 2 -X POST -H 'content-type: application/x-protobuf' \
  --data-binary '' "http://127.0.0.1:$OTLP_HTTP/v1/traces") == 200 ]]; do
  if ! kill -0 "$ROTEL_PID" 2>/dev/null || ((SECONDS >= rotel_deadline)); then
    tail -n 30 "$OBS_WORK/rotel.log" | sed 's/^/      /'
    die "rotel did not accept OTLP/HTTP on :$OTLP_HTTP"
  fi
  sleep 0.2
done
pass "rotel ($("$ROTEL" --version 2>&1 | head -n 1)) accepts OTLP/HTTP on :$OTLP_HTTP"

# Grey releases: carts gets a canary on the flaky simulator for half of the users, judged every
# second, so the variant series, the canary-against-stable rules and the rollback alert have data.
# The rollback must not come before Prometheus has seen the canary's calls over two scrapes, or
# its rate is 0 and the canary-against-stable rules are NaN for the whole run. Waiting a fixed
# number of calls for that is a race with the machine's load (it was lost once in CI), so the
# judge starts out with a min_calls no run reaches; once Prometheus has the canary's p99 and
# failure ratio against stable's (step 4), the file is rewritten with a reachable min_calls and
# SIGHUP reloads it.
grey_config() {
  cat >"$OBS_WORK/grey.toml" <<EOF
[routing.rollback]
min_calls = $1

[downstreams.carts.variants.canary]
base_url = "http://127.0.0.1:$SIM_FLAKY"

[[downstreams.carts.rules]]
variant = "canary"
percent = 50
EOF
}
grey_config 1000000000

(
  export TRIBUTARY_CONFIG=$OBS_WORK/grey.toml
  export TRIBUTARY_ROUTING__ROLLBACK__INTERVAL=1s
  export TRIBUTARY_SERVER__LISTEN=127.0.0.1:$GATEWAY
  export TRIBUTARY_SERVER__OPS_LISTEN=127.0.0.1:$OPS
  export TRIBUTARY_DOWNSTREAMS__USERS__BASE_URL=http://127.0.0.1:$SIM_OK
  export TRIBUTARY_DOWNSTREAMS__CARTS__BASE_URL=http://127.0.0.1:$SIM_OK
  export TRIBUTARY_DOWNSTREAMS__NOTIFICATIONS__BASE_URL=http://127.0.0.1:$SIM_DOWN
  export TRIBUTARY_DOWNSTREAMS__PROMOTIONS__BASE_URL=http://127.0.0.1:$SIM_SLOW
  export TRIBUTARY_DOWNSTREAMS__PROMOTIONS__TIMEOUT=150ms
  export TRIBUTARY_DOWNSTREAMS__RECOMMENDATIONS__BASE_URL=http://127.0.0.1:$SIM_FLAKY
  # Few permits and almost no queueing: some requests are shed. A static limit: the adaptive
  # default follows the queueing delay and ignores max_in_flight.
  export TRIBUTARY_ADMISSION__MODE=static
  export TRIBUTARY_ADMISSION__MAX_IN_FLIGHT=4
  export TRIBUTARY_ADMISSION__MAX_WAIT=1ms
  # A tiny pool: waiters, acquire waits and some acquire timeouts.
  export TRIBUTARY_DATABASE__MAX_CONNECTIONS=1
  # Migrations were applied above; with no start-up migration and min 0, requests open the
  # connection themselves, so the connect-time histogram has data.
  export TRIBUTARY_DATABASE__RUN_MIGRATIONS=false
  export TRIBUTARY_DATABASE__MIN_CONNECTIONS=0
  # Short-lived connections: requests keep reopening them during the traffic window.
  export TRIBUTARY_DATABASE__MAX_LIFETIME=2s
  export TRIBUTARY_DATABASE__ACQUIRE_TIMEOUT=5ms
  # Rate limiting shared through a Redis that is not there: 429s and local fallbacks.
  export TRIBUTARY_RATE_LIMIT__ENABLED=true
  export TRIBUTARY_RATE_LIMIT__PER_SECOND=20
  export TRIBUTARY_RATE_LIMIT__BURST=10
  export TRIBUTARY_RATE_LIMIT__REDIS_URL=redis://127.0.0.1:$REDIS_CLOSED
  # The breaker opens quickly on the flaky simulator.
  export TRIBUTARY_CIRCUIT_BREAKER__MIN_CALLS=5
  export TRIBUTARY_CIRCUIT_BREAKER__FAILURE_RATIO=0.3
  # Low enough that a debug build under load records long polls.
  export TRIBUTARY_TELEMETRY__LONG_POLL_THRESHOLD=500us
  export TRIBUTARY_TELEMETRY__LOG_FORMAT=json
  # OTLP export of both signals, configured the way an OpenTelemetry deployment does it: only
  # the standard variables, no tributary key. Metrics every second, so that a short run has
  # several exports.
  export OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:$OTLP_HTTP
  export OTEL_SERVICE_NAME=tributary-obs-check
  export OTEL_RESOURCE_ATTRIBUTES=deployment.environment.name=obs-check
  export OTEL_METRIC_EXPORT_INTERVAL=1000
  exec "$BIN_DIR/tributary" serve
) >"$OBS_WORK/gateway.log" 2>&1 &
GATEWAY_PID=$!
PIDS+=("$GATEWAY_PID")
if wait_http "http://127.0.0.1:$GATEWAY/readyz" 60; then
  pass "gateway on :$GATEWAY is ready (/readyz 200)"
else
  tail -n 30 "$OBS_WORK/gateway.log" | sed 's/^/      /'
  die "gateway did not become ready"
fi

python3 prometheus/check_queries.py render-config --target "127.0.0.1:$OPS" --self "127.0.0.1:$PROM" \
  --out "$OBS_WORK/prometheus.yml" | sed 's/^/    /'
check "promtool check config on the rewritten copy" promtool check config "$OBS_WORK/prometheus.yml"
prometheus --config.file="$OBS_WORK/prometheus.yml" --storage.tsdb.path="$OBS_WORK/tsdb" \
  --web.listen-address="127.0.0.1:$PROM" --log.level=warn >"$OBS_WORK/prometheus.log" 2>&1 &
PIDS+=("$!")
wait_http "http://127.0.0.1:$PROM/-/ready" 60 || die "Prometheus did not become ready (its log is printed below)"
pass "Prometheus on :$PROM is ready"
SINCE=$(date +%s)

# ---------------------------------------------------------------------------
log "4. traffic for ${TRAFFIC_SECONDS}s"
GW=http://127.0.0.1:$GATEWAY
cat >"$OBS_WORK/dashboard.lua" <<'EOF'
-- Dashboards of random seeded users. Most clients stay within their rate limit; "greedy" does not.
math.randomseed(os.time())
local keys = { "client-a", "client-b", "client-c", "client-d", "client-e", "client-f" }
request = function()
  local key = keys[math.random(#keys)]
  if math.random(100) <= 20 then key = "greedy" end
  return wrk.format("GET", "/api/v1/dashboard/" .. math.random(1, 200), { ["x-api-key"] = key })
end
EOF
wrk -t 2 -c 8 -d "${TRAFFIC_SECONDS}s" --timeout 5s -s "$OBS_WORK/dashboard.lua" "$GW" >"$OBS_WORK/wrk.log" 2>&1 &
WRK_PID=$!
PIDS+=("$WRK_PID")

# Orders, bad requests and 404s, each loop bounded by the same end time.
END=$(($(date +%s) + TRAFFIC_SECONDS))
(
  n=0
  while (($(date +%s) < END)); do
    n=$((n + 1))
    # Every third POST replays the previous one (same Idempotency-Key and body): the stored
    # response comes back and no second order is created.
    if ((n % 3 != 0)); then
      key="obs-check-$$-$n"
      body="{\"user_id\": $((n % 200 + 1)), \"items\": [{\"sku\": \"SKU-$n\", \"quantity\": 1, \"unit_price_cents\": 1299}]}"
    fi
    curl -s --max-time 3 -X POST "$GW/api/v1/orders" -H 'content-type: application/json' \
      -H "x-api-key: orders-$((n % 4))" -H "Idempotency-Key: $key" -d "$body" -o /dev/null \
      -w "POST /api/v1/orders %{http_code}\n" || :
    curl -s --max-time 3 -H "x-api-key: orders-$((n % 4))" "$GW/api/v1/orders/$((n % 1000 + 1))" -o /dev/null \
      -w "GET /api/v1/orders/{id} %{http_code}\n" || :
    sleep 0.05
  done
) >"$OBS_WORK/orders.log" 2>&1 &
ORDERS_PID=$!
PIDS+=("$ORDERS_PID")
(
  while (($(date +%s) < END)); do
    # 400s: malformed JSON, a missing Idempotency-Key, a non-numeric id.
    curl -s -o /dev/null --max-time 3 -w "bad: malformed JSON %{http_code}\n" -X POST "$GW/api/v1/orders" \
      -H 'content-type: application/json' -H 'Idempotency-Key: obs-bad' -H 'x-api-key: bad-client' -d '{"user_id": ' || :
    curl -s -o /dev/null --max-time 3 -w "bad: no Idempotency-Key %{http_code}\n" -X POST "$GW/api/v1/orders" \
      -H 'content-type: application/json' -H 'x-api-key: bad-client' -d '{"user_id": 1, "items": []}' || :
    curl -s -o /dev/null --max-time 3 -w "bad: non-numeric user id %{http_code}\n" -H 'x-api-key: bad-client' \
      "$GW/api/v1/dashboard/not-a-number" || :
    # 404s: an unknown route and an unknown order.
    curl -s -o /dev/null --max-time 3 -w "bad: unknown route %{http_code}\n" -H 'x-api-key: bad-client' "$GW/api/v1/nope" || :
    curl -s -o /dev/null --max-time 3 -w "bad: unknown order %{http_code}\n" -H 'x-api-key: bad-client' \
      "$GW/api/v1/orders/987654321" || :
    sleep 0.2
  done
) >"$OBS_WORK/bad.log" 2>&1 &
BAD_PID=$!
PIDS+=("$BAD_PID")

# The first successful scrape takes a few seconds (target discovery): poll for it.
up_deadline=$((SECONDS + 30))
until [[ $(curl -s --max-time 2 "http://127.0.0.1:$PROM/api/v1/query" --data-urlencode 'query=up{job="tributary"} == 1' |
  python3 -c 'import json, sys; print(len(json.load(sys.stdin)["data"]["result"]))' 2>/dev/null) == 1 ]]; do
  ((SECONDS < up_deadline)) || die "Prometheus never saw up{job=\"tributary\"} == 1"
  sleep 0.5
done
pass "Prometheus scrapes the gateway (up == 1)"

# The canary against stable, as the recording rules see it: both differences must be numbers
# (not NaN) before the rollback may take the canary's traffic away.
canary_seen() {
  local rule n
  for rule in job_downstream_variant:tributary_downstream_failures:ratio_rate5m_minus_stable \
    job_downstream_variant:tributary_downstream_request_duration_seconds:p99_5m_minus_stable; do
    n=$(curl -s --max-time 2 "http://127.0.0.1:$PROM/api/v1/query" --data-urlencode "query=$rule{variant=\"canary\"}" |
      python3 -c 'import json, math, sys; r = json.load(sys.stdin)["data"]["result"]; print(sum(not math.isnan(float(s["value"][1])) for s in r))' 2>/dev/null)
    [[ $n == 1 ]] || return 1
  done
}
seen_deadline=$((SECONDS + TRAFFIC_SECONDS))
until canary_seen; do
  ((SECONDS < seen_deadline)) || break
  sleep 0.5
done
if canary_seen; then
  pass "Prometheus has the canary against stable (both recording rules are numbers)"
else
  fail "Prometheus never had the canary against stable as numbers; rolling back anyway"
fi
grey_config 100
kill -HUP "$GATEWAY_PID"

if wait "$WRK_PID"; then pass "wrk ran for ${TRAFFIC_SECONDS}s"; else fail "wrk exited non-zero"; fi
sed 's/^/      /' "$OBS_WORK/wrk.log"
wait "$ORDERS_PID" "$BAD_PID" || :
echo "    responses of the curl loops:"
cat "$OBS_WORK/orders.log" "$OBS_WORK/bad.log" | sort | uniq -c | sed 's/^/      /'

# ---------------------------------------------------------------------------
log "5. every query against the live Prometheus"
curl -fsS --max-time 5 "http://127.0.0.1:$OPS/metrics" >"$OBS_WORK/metrics.txt" || die "GET /metrics on the ops port"
if [[ $(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$GW/metrics") == 404 ]]; then
  pass "/metrics is not served on the API port"
else
  fail "/metrics answers on the API port"
fi
check "every dashboard, rule and adapter query returns data; every metric they name is scraped" \
  python3 prometheus/check_queries.py live --prom "http://127.0.0.1:$PROM" --since "$SINCE" --deadline 45 \
  --metrics-file "$OBS_WORK/metrics.txt"

# ---------------------------------------------------------------------------
log "6. promtool check metrics on a live scrape"
check "promtool check metrics on GET /metrics" promtool check metrics <"$OBS_WORK/metrics.txt"

# ---------------------------------------------------------------------------
log "7. what the real collector received (rotel)"
# otlp_check NAME SIGNAL ARGS...: poll the capture (bounded), PASS/FAIL; on FAIL, rotel's log tail.
otlp_check() {
  local name=$1 failed_before=$FAILED
  shift
  check "$name" python3 .ci/otlp_capture.py "$@" "$OTLP_CAPTURE" --service tributary-obs-check \
    --attribute deployment.environment.name=obs-check --deadline 30
  if ((FAILED > failed_before)); then
    echo "      ---- last lines of rotel.log"
    tail -n 25 "$OBS_WORK/rotel.log" | sed 's/^/      /'
  fi
}
otlp_check "rotel received the gateway's spans: its service name and resource, a dashboard server span with a downstream client span as its child" \
  traces
otlp_check "rotel received the gateway's metrics: its service name and resource, http.server.request.duration (histogram, s), the request counter, the downstream and pool instruments" \
  metrics --metric http.server.request.duration:s:histogram --metric 'http.server.active_requests:{request}:sum' \
  --metric tributary_http_requests::sum --metric tributary_downstream_request_duration:s:histogram \
  --metric tributary_db_pool_acquire_wait:s:histogram
if kill -0 "$ROTEL_PID" 2>/dev/null; then pass "rotel still running after the checks"; else fail "rotel exited during the run"; fi

if kill -0 "$GATEWAY_PID" 2>/dev/null; then
  pass "gateway still running after the checks"
else
  fail "gateway exited during the checks (its log is printed below)"
fi

summary
((FAILED == 0))
