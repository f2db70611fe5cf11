#!/usr/bin/env bash
# "Compose equivalent" smoke test: the processes of docker-compose.yml, started natively.
#
# No Docker engine runs on CI machines, so this starts what `docker compose up` would start, with the
# same commands, the same config files and the environment read from docker-compose.yml itself, with
# only the addresses rewritten (compose service names -> 127.0.0.1, container ports -> free ports):
#   - the five simulator services (downstream-sim, their SIM_* environment)
#   - migrate-seed against a fresh database tributary_compose_smoke_<random> on the local Postgres
#     (127.0.0.1:5432, user postgres, trust auth), with --users 100 instead of 10000 for speed
#   - the gateway (tributary serve, its TRIBUTARY_* environment, working directory = repo root so
#     config/default.toml and migrations/ resolve as they do under the image's WORKDIR)
#   - Prometheus with prometheus/prometheus.yml, targets rewritten to the local ports, scrape and
#     evaluation intervals shortened to 1 s, rule_files pointing at the repository's files
# Jaeger and Grafana are not started: the gateway's OTLP endpoint variable is dropped (export off),
# and Grafana's provisioning is checked statically by the observability checks.
#
# Then checks: every simulator answers /healthz, the gateway becomes ready (/readyz 200),
# GET /api/v1/dashboard/1 answers 200 with a JSON body, Prometheus reports the gateway's scrape
# job up == 1, the gateway's own request counter arrives in Prometheus, and the prometheus-adapter
# rules' queries return samples for the gateway.
#
# Usage: BIN_DIR=target/debug deploy/compose-native-smoke.sh   (BIN_DIR defaults to target/debug)
# Every wait has a deadline and the whole run is capped (SMOKE_TIMEOUT, default 300 s). Everything
# started here is stopped by PID on exit, and the database is dropped.
set -euo pipefail

if [[ -z "${SMOKE_UNDER_TIMEOUT:-}" ]]; then
  exec timeout --signal=TERM --kill-after=30 "${SMOKE_TIMEOUT:-300}" \
    env SMOKE_UNDER_TIMEOUT=1 bash "$0" "$@"
fi

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
BIN_DIR="$(cd "${BIN_DIR:-target/debug}" 2>/dev/null && pwd)" || {
  echo "FAIL BIN_DIR ${BIN_DIR:-target/debug} does not exist (build first: cargo build)"; exit 1; }
COMPOSE_FILE="${COMPOSE_FILE:-$REPO/docker-compose.yml}"
DB_NAME=tributary_compose_smoke_$(od -An -N4 -tx4 /dev/urandom | tr -d ' ')
PG=(psql -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p 5432 -U postgres)
WORK="$(mktemp -d /tmp/compose-smoke.XXXXXX)"
PIDS=()
FAILED=0

log() { printf '%s\n' "$*"; }
pass() { log "ok   $*"; }
fail() { log "FAIL $*"; FAILED=1; }

cleanup() {
  local rc=$?
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  # The gateway drains for up to server.drain_timeout (20 s); nothing is in flight here.
  local deadline=$((SECONDS + 25))
  for pid in "${PIDS[@]}"; do
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
  done
  timeout 20 "${PG[@]}" -d postgres -c "DROP DATABASE IF EXISTS $DB_NAME WITH (FORCE)" 2>/dev/null || true
  if ((rc != 0 || FAILED != 0)); then
    for f in "$WORK"/*.log; do
      [[ -e "$f" ]] || continue
      log "---- last lines of $(basename "$f")"
      tail -n 25 "$f" || true
    done
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 143' TERM INT

# wait_for NAME SECONDS COMMAND...: polls COMMAND every 0.25 s until it succeeds or time runs out.
wait_for() {
  local name=$1 limit=$2; shift 2
  local deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then fail "$name (not within ${limit}s)"; return 1; fi
    sleep 0.25
  done
  pass "$name"
}

http_status_is() { # URL CODE
  [[ "$(curl -s -o /dev/null -m 2 -w '%{http_code}' "$1")" == "$2" ]]
}

# ---- prerequisites --------------------------------------------------------------------------------
for bin in tributary downstream-sim; do
  [[ -x "$BIN_DIR/$bin" ]] || { fail "$BIN_DIR/$bin missing (cargo build first)"; exit 1; }
done
command -v curl >/dev/null || { fail "curl missing"; exit 1; }
command -v psql >/dev/null || { fail "psql missing"; exit 1; }
if ! command -v prometheus >/dev/null; then
  log "installing prometheus with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  timeout 300 apt-get install -y -qq prometheus >/dev/null 2>&1 \
    || { timeout 300 apt-get update -qq && timeout 300 apt-get install -y -qq prometheus >/dev/null; }
fi
# PyYAML from the virtualenv under the build directory (scripts/venv.sh), not the system Python.
VENV="$(timeout 1000 "$REPO/scripts/venv.sh" "$REPO/deploy/validate/requirements.txt")" \
  || { fail "scripts/venv.sh deploy/validate/requirements.txt"; exit 1; }
export PATH="$VENV/bin:$PATH"
timeout 10 pg_isready -h 127.0.0.1 -p 5432 -q || { fail "Postgres on 127.0.0.1:5432 is not accepting connections"; exit 1; }

# ---- plan: environments from docker-compose.yml, addresses rewritten ----------------------------
python3 - "$COMPOSE_FILE" "$WORK" "$DB_NAME" "$REPO" <<'PY'
import json, re, shlex, socket, sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import yaml

compose_file, work, db_name, repo = sys.argv[1], Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
compose = yaml.safe_load(Path(compose_file).read_text())
services = compose["services"]

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def command_of(svc):
    cmd = svc.get("command", [])
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]

# Which services run which binary, and the port each listens on inside its container.
sims = [n for n, s in services.items() if command_of(s)[:1] == ["downstream-sim"]]
gateway = next(n for n, s in services.items() if command_of(s)[:2] == ["tributary", "serve"])
migrate = next(n for n, s in services.items() if "tributary migrate" in " ".join(command_of(s)))
def container_port(name, key):
    return int(str(services[name]["environment"][key]).rsplit(":", 1)[1])
local = {}  # (service, container port) -> local port
for n in sims:
    local[(n, container_port(n, "SIM_LISTEN"))] = free_port()
local[(gateway, container_port(gateway, "TRIBUTARY_SERVER__LISTEN"))] = free_port()
local[(gateway, container_port(gateway, "TRIBUTARY_SERVER__OPS_LISTEN"))] = free_port()
local[("postgres", 5432)] = 5432
not_started = {n for n in services if n not in sims and n not in (gateway, migrate, "postgres")}

def rewrite(name, key, value):
    value = str(value)
    if key in ("SIM_LISTEN", "TRIBUTARY_SERVER__LISTEN", "TRIBUTARY_SERVER__OPS_LISTEN"):
        return f"127.0.0.1:{local[(name, int(value.rsplit(':', 1)[1]))]}"
    if key == "DATABASE_URL":
        return f"postgres://postgres@127.0.0.1:5432/{db_name}"
    u = urlsplit(value)
    if u.scheme in ("http", "https") and u.hostname in services:
        if u.hostname in not_started:
            return None  # e.g. the OTLP endpoint: that collector is not part of the native run
        return urlunsplit((u.scheme, f"127.0.0.1:{local[(u.hostname, u.port)]}", u.path, u.query, u.fragment))
    return value

plan = {"sims": {}, "dropped": []}
def env_file(name, out):
    lines = []
    for key, value in (services[name].get("environment") or {}).items():
        new = rewrite(name, key, value)
        if new is None:
            plan["dropped"].append(f"{name}.{key}={value}")
            continue
        lines.append(f"export {key}={shlex.quote(new)}")
    (work / out).write_text("\n".join(lines) + "\n")

for n in sims:
    env_file(n, f"env.{n}.sh")
    plan["sims"][n] = local[(n, container_port(n, "SIM_LISTEN"))]
env_file(gateway, "env.gateway.sh")
env_file(migrate, "env.migrate.sh")
gw_port = local[(gateway, container_port(gateway, "TRIBUTARY_SERVER__LISTEN"))]
plan["gateway_port"] = gw_port

# Prometheus: the repository's config with compose addresses replaced by local ones.
prom = services["prometheus"]
cfg_src = next(v.split(":")[0] for v in prom["volumes"] if str(v).split(":")[1] == "/etc/prometheus/prometheus.yml")
cfg_path = (Path(compose_file).parent / cfg_src).resolve()
cfg = yaml.safe_load(cfg_path.read_text())
prom_port = free_port()
plan["prometheus_port"] = prom_port
cfg.setdefault("global", {}).update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
cfg["rule_files"] = [str((cfg_path.parent / rf).resolve()) for rf in cfg.get("rule_files", [])]
gateway_job = None
for sc in cfg.get("scrape_configs", []):
    sc.pop("scrape_interval", None); sc.pop("scrape_timeout", None)
    for st in sc.get("static_configs", []):
        new_targets = []
        for t in st["targets"]:
            host, _, port = t.rpartition(":")
            if host in ("localhost", "127.0.0.1") and int(port) == 9090:
                new_targets.append(f"127.0.0.1:{prom_port}")
            elif (host, int(port)) in local:
                new_targets.append(f"127.0.0.1:{local[(host, int(port))]}")
                if host == gateway:
                    gateway_job = sc["job_name"]
            else:
                plan["dropped"].append(f"prometheus target {t}")
        st["targets"] = new_targets
if gateway_job is None:
    sys.exit("prometheus.yml has no scrape target for the gateway service")
plan["gateway_job"] = gateway_job
(work / "prometheus.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))
(work / "plan.json").write_text(json.dumps(plan))
(work / "plan.sh").write_text(
    f"GW_PORT={gw_port}\nPROM_PORT={prom_port}\nGATEWAY_JOB={shlex.quote(gateway_job)}\n"
    f"SIMS=({' '.join(f'{n}:{p}' for n, p in plan['sims'].items())})\n"
)
print("plan: gateway 127.0.0.1:%d, prometheus 127.0.0.1:%d, %s" % (
    gw_port, prom_port, ", ".join(f"{n} :{p}" for n, p in plan["sims"].items())))
for d in plan["dropped"]:
    print(f"plan: not started natively, dropped: {d}")
PY
# shellcheck source=/dev/null
source "$WORK/plan.sh"

# run_with_env ENVFILE LOG CMD...: the command with exactly the compose environment of its service
# (inherited TRIBUTARY_*/SIM_*/DATABASE_URL variables removed first), in the background.
run_with_env() {
  local envfile=$1 logfile=$2; shift 2
  (
    while read -r var; do unset "$var"; done < <(compgen -e | grep -E '^(TRIBUTARY_|SIM_|DATABASE_URL$)' || true)
    # shellcheck source=/dev/null
    source "$envfile"
    exec "$@"
  ) >"$logfile" 2>&1 &
  PIDS+=($!)
}

# ---- database, migrations, seed ---------------------------------------------------------------------
timeout 30 "${PG[@]}" -d postgres -c "DROP DATABASE IF EXISTS $DB_NAME WITH (FORCE)" -c "CREATE DATABASE $DB_NAME"
pass "fresh database $DB_NAME"
one_shot() { # NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  if (
    while read -r var; do unset "$var"; done < <(compgen -e | grep -E '^(TRIBUTARY_|SIM_|DATABASE_URL$)' || true)
    # shellcheck source=/dev/null
    source "$WORK/env.migrate.sh"
    exec timeout "$limit" "$@"
  ) >>"$WORK/migrate-seed.log" 2>&1; then pass "$name"; else fail "$name"; exit 1; fi
}
one_shot "tributary migrate" 120 "$BIN_DIR/tributary" migrate
one_shot "tributary seed --users 100 --orders-per-user 5" 120 \
  "$BIN_DIR/tributary" seed --users 100 --orders-per-user 5

# ---- simulators, gateway -----------------------------------------------------------------------------
for entry in "${SIMS[@]}"; do
  name=${entry%%:*}
  run_with_env "$WORK/env.$name.sh" "$WORK/sim-$name.log" "$BIN_DIR/downstream-sim"
done
for entry in "${SIMS[@]}"; do
  name=${entry%%:*} port=${entry##*:}
  wait_for "simulator $name /healthz 200" 30 http_status_is "http://127.0.0.1:$port/healthz" 200 || exit 1
done
run_with_env "$WORK/env.gateway.sh" "$WORK/gateway.log" "$BIN_DIR/tributary" serve
wait_for "gateway /healthz 200" 30 http_status_is "http://127.0.0.1:$GW_PORT/healthz" 200 || exit 1
wait_for "gateway /readyz 200" 60 http_status_is "http://127.0.0.1:$GW_PORT/readyz" 200 || exit 1

# ---- Prometheus --------------------------------------------------------------------------------------
run_with_env /dev/null "$WORK/prometheus.log" prometheus \
  --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/tsdb" \
  --web.listen-address="127.0.0.1:$PROM_PORT"
wait_for "prometheus ready" 60 http_status_is "http://127.0.0.1:$PROM_PORT/-/ready" 200 || exit 1

# ---- the checks ----------------------------------------------------------------------------------------
code=$(curl -s -m 5 -o "$WORK/dashboard.json" -w '%{http_code}' "http://127.0.0.1:$GW_PORT/api/v1/dashboard/1" || true)
if [[ "$code" == 200 ]] && python3 -c 'import json,sys; json.load(open(sys.argv[1]))' "$WORK/dashboard.json" 2>/dev/null; then
  pass "GET /api/v1/dashboard/1 -> 200 with a JSON body"
else
  fail "GET /api/v1/dashboard/1 -> $code"
  head -c 500 "$WORK/dashboard.json" 2>/dev/null || true; echo
fi

# prom_query_true QUERY: succeeds when the instant query returns at least one sample with value > 0.
prom_query_true() {
  curl -s -m 2 --get "http://127.0.0.1:$PROM_PORT/api/v1/query" --data-urlencode "query=$1" \
    | python3 -c 'import json,sys; r=json.load(sys.stdin); sys.exit(0 if r.get("status")=="success" and any(float(s["value"][1])>0 for s in r["data"]["result"]) else 1)'
}
wait_for "prometheus: up{job=\"$GATEWAY_JOB\"} == 1" 30 prom_query_true "up{job=\"$GATEWAY_JOB\"} == 1" || true
wait_for "prometheus: gateway request counter scraped" 30 \
  prom_query_true "sum(tributary_http_requests_total{job=\"$GATEWAY_JOB\"})" || true

# prometheus-adapter rules (k8s/prometheus-adapter/config.yaml, rules[].metricsQuery), evaluated the
# way the adapter would for this gateway: <<.LabelMatchers>> selects the scrape job (natively there
# are no namespace/pod labels) and <<.GroupBy>> is `instance`. Each must return a finite sample; the
# utilisation must lie in [0, 1].
python3 - "$REPO/k8s/prometheus-adapter/config.yaml" "$GATEWAY_JOB" >"$WORK/adapter-queries.tsv" <<'PY'
import sys
import yaml
for rule in yaml.safe_load(open(sys.argv[1]))["rules"]:
    q = rule["metricsQuery"].replace("<<.LabelMatchers>>", f'job="{sys.argv[2]}"').replace("<<.GroupBy>>", "instance")
    lo, hi = ("0", "1") if rule["name"]["as"].endswith("_utilization") else ("-inf", "inf")
    print(rule["name"]["as"], lo, hi, " ".join(q.split()), sep="\t")
PY
prom_sample_within() { # QUERY LOW HIGH: at least one sample, every sample finite and within [LOW, HIGH]
  curl -s -m 2 --get "http://127.0.0.1:$PROM_PORT/api/v1/query" --data-urlencode "query=$1" \
    | python3 -c 'import json,math,sys
r = json.load(sys.stdin); lo, hi = float(sys.argv[1]), float(sys.argv[2])
vals = [float(s["value"][1]) for s in r.get("data", {}).get("result", [])] if r.get("status") == "success" else []
sys.exit(0 if vals and all(math.isfinite(v) and lo <= v <= hi for v in vals) else 1)' "$2" "$3"
}
while IFS=$'\t' read -r metric lo hi query; do
  wait_for "prometheus-adapter rule $metric returns samples in [$lo, $hi]" 20 \
    prom_sample_within "$query" "$lo" "$hi" || true
done <"$WORK/adapter-queries.tsv"

if ((FAILED)); then log "compose-native smoke: FAILED"; exit 1; fi
log "compose-native smoke: all checks passed"
