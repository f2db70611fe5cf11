#!/usr/bin/env bash
# A local tributary stack without Docker, in the foreground: `make dev` (or scripts/dev.sh).
#
# Checks that Postgres answers, creates the database when it is missing, builds the binaries,
# starts the five downstream simulators, migrates and seeds, and runs the gateway with readable
# logs until Ctrl-C (or SIGTERM / SIGHUP), which stops everything it started. It prints one line
# with a hint when something it needs is missing.
#
# Settings (environment variables, or make variables: `make dev PORT=8081`):
#   DATABASE_URL  postgres://postgres@127.0.0.1:5432/tributary  the database (created if missing)
#   PORT          8080     the gateway's port, on 127.0.0.1
#   OPS_PORT      9090     its operations port (/metrics, /healthz, /readyz), on 127.0.0.1
#   SIM_PORT      9001     the simulators' first port; the five use SIM_PORT .. SIM_PORT+4
#   PROFILE       debug    or release (a slower first build, a faster gateway)
#   SEED_USERS    10000    users 1..N get five demo orders each (idempotent)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/tributary}
PORT=${PORT:-8080}
OPS_PORT=${OPS_PORT:-9090}
SIM_PORT=${SIM_PORT:-9001}
PROFILE=${PROFILE:-debug}
SEED_USERS=${SEED_USERS:-10000}

say() { printf 'dev: %s\n' "$*" >&2 || true; }
die() { say "$*"; exit 1; }

# ---- settings ----------------------------------------------------------------------------------
if ! [[ $PORT =~ ^[0-9]+$ ]] || ((PORT == 0 || PORT > 65535)); then
  die "PORT must be a port number (got '$PORT')"
fi
if ! [[ $OPS_PORT =~ ^[0-9]+$ ]] || ((OPS_PORT == 0 || OPS_PORT > 65535 || OPS_PORT == PORT)); then
  die "OPS_PORT must be a port number other than PORT (got '$OPS_PORT')"
fi
if ! [[ $SIM_PORT =~ ^[0-9]+$ ]] || ((SIM_PORT == 0 || SIM_PORT + 4 > 65535)); then
  die "SIM_PORT must be a port number with four more free after it (got '$SIM_PORT')"
fi
[[ $SEED_USERS =~ ^[0-9]+$ ]] || die "SEED_USERS must be a whole number (got '$SEED_USERS')"
case $PROFILE in
  debug) build_flags=() ;;
  release) build_flags=(--release) ;;
  *) die "PROFILE must be debug or release (got '$PROFILE')" ;;
esac
# postgres://[user[:password]@]host[:port]/database[?params]: the server part, the database, the rest.
[[ $DATABASE_URL =~ ^(postgres(ql)?://([^/?]*))/([A-Za-z0-9_]+)(\?.*)?$ ]] ||
  die "DATABASE_URL must look like postgres://USER@HOST:PORT/DATABASE, the database name letters, digits and _ (got '$(sed -E 's#//[^/@]*@#//…@#' <<<"$DATABASE_URL")')"
server_url=${BASH_REMATCH[1]}
where=${BASH_REMATCH[3]##*@} # host:port, without credentials
database=${BASH_REMATCH[4]}
params=${BASH_REMATCH[5]}
admin_url="$server_url/postgres$params"

# ---- prerequisites -------------------------------------------------------------------------------
command -v cargo >/dev/null || die "cargo not found: install Rust 1.94 or newer (https://rustup.rs)"
command -v psql >/dev/null || die "psql not found: install the PostgreSQL client (apt-get install postgresql-client)"
command -v curl >/dev/null || die "curl not found: apt-get install curl"

# Some process already listening on 127.0.0.1:PORT?
port_taken() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
port_taken "$PORT" && die "port $PORT is in use (see: ss -ltnp 'sport = :$PORT'); choose another: make dev PORT=$((PORT + 1))"
port_taken "$OPS_PORT" && die "port $OPS_PORT (the operations port) is in use (see: ss -ltnp 'sport = :$OPS_PORT'); choose another: make dev OPS_PORT=$((OPS_PORT + 1))"
for ((p = SIM_PORT; p < SIM_PORT + 5; p++)); do
  port_taken "$p" && die "port $p (a simulator's) is in use (see: ss -ltnp 'sport = :$p'); choose other ports: make dev SIM_PORT=$((SIM_PORT + 100))"
done

clusters=(/etc/postgresql/*)
[[ -d ${clusters[0]} ]] && cluster=${clusters[0]##*/} || cluster=15
if ! out=$(PGCONNECT_TIMEOUT=5 psql -X -Atq "$admin_url" -c 'SELECT 1' 2>&1); then
  first=$(printf '%s\n' "$out" | sed -E 's/^psql: error: //; s/^connection to server at [^:]*: //' | head -n1)
  case $out in
    *"Connection refused"* | *"timeout expired"* | *"could not translate host name"* | *"No such file or directory"*)
      die "Postgres at $where is not reachable ($first): start it (e.g. pg_ctlcluster $cluster main start) or point DATABASE_URL at yours" ;;
    *)
      die "Postgres at $where refused the connection ($first): check the user and password in DATABASE_URL" ;;
  esac
fi
exists=$(psql -X -Atq "$admin_url" -c "SELECT 1 FROM pg_database WHERE datname = '$database'")
if [[ $exists != 1 ]]; then
  say "creating database $database on $where"
  psql -X -q -v ON_ERROR_STOP=1 "$admin_url" -c "CREATE DATABASE \"$database\"" >/dev/null
fi

# ---- build -------------------------------------------------------------------------------------------
say "building ($PROFILE; the first build takes minutes, later ones seconds)"
cargo build --locked --bins "${build_flags[@]}"
bin=target/$PROFILE

# ---- the stack, stopped together ----------------------------------------------------------------------
pids=()
stopping=0
# shellcheck disable=SC2329 # run by the EXIT trap
stop() {
  ((stopping)) && return
  stopping=1
  ((${#pids[@]})) || return 0
  say "stopping (gateway drain, then the simulators)"
  local i pid deadline=$((SECONDS + 25))
  # Newest first: the gateway drains before its downstreams go away.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    pid=${pids[i]}
    kill -TERM "$pid" 2>/dev/null || continue
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  say "stopped"
}
trap stop EXIT
# Stopping on request is success: the stack stopped as asked (a failure to stop says so above).
trap 'exit 0' INT TERM HUP
# A closed terminal or pipe must not kill this script before it has stopped its children.
trap '' PIPE

export DATABASE_URL
export TRIBUTARY_TELEMETRY__LOG_FORMAT=pretty
export TRIBUTARY_SERVER__LISTEN=127.0.0.1:$PORT
export TRIBUTARY_SERVER__OPS_LISTEN=127.0.0.1:$OPS_PORT

# The five downstream services, with the latencies of docker-compose.yml.
services=(users carts recommendations promotions notifications)
latencies=("15ms 5ms" "20ms 10ms" "40ms 20ms" "25ms 10ms" "10ms 5ms")
for i in "${!services[@]}"; do
  read -r latency jitter <<<"${latencies[i]}"
  port=$((SIM_PORT + i))
  "$bin/downstream-sim" --listen "127.0.0.1:$port" --latency "$latency" --latency-jitter "$jitter" &
  pids+=("$!")
  export "TRIBUTARY_DOWNSTREAMS__${services[i]^^}__BASE_URL=http://127.0.0.1:$port"
done

# wait_ok URL PID SECONDS: until URL answers 200, while PID lives.
wait_ok() {
  local deadline=$((SECONDS + $3))
  until [[ $(curl -s -o /dev/null -m 2 -w '%{http_code}' "$1") == 200 ]]; do
    kill -0 "$2" 2>/dev/null || return 1
    ((SECONDS < deadline)) || return 1
    sleep 0.2
  done
}
for i in "${!services[@]}"; do
  wait_ok "http://127.0.0.1:$((SIM_PORT + i))/healthz" "${pids[i]}" 30 ||
    die "the ${services[i]} simulator did not start on port $((SIM_PORT + i)) (its error is above)"
done

say "migrating and seeding $SEED_USERS users into $database"
"$bin/tributary" seed --users "$SEED_USERS" --orders-per-user 5

"$bin/tributary" serve &
gateway=$!
pids+=("$gateway")
if ! wait_ok "http://127.0.0.1:$PORT/readyz" "$gateway" 60; then
  kill -0 "$gateway" 2>/dev/null && die "the gateway did not become ready within 60 s (its log is above)"
  wait "$gateway" || die "the gateway exited with status $? (its log is above)"
  die "the gateway exited"
fi
say "ready: curl -s http://127.0.0.1:$PORT/api/v1/dashboard/1   (metrics: http://127.0.0.1:$OPS_PORT/metrics; Ctrl-C stops everything)"

# In the foreground until the gateway ends or a signal arrives (the traps above stop the rest).
status=0
wait "$gateway" || status=$?
((stopping)) || say "the gateway exited with status $status"
exit "$status"
