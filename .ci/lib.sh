# shellcheck shell=bash
# What the system checks (.ci/check-api.sh, .ci/check-observability.sh) share: the time bound,
# the repository root and binaries, the local Postgres, a database of their own, and stopping
# what they started. Sourced, not executed; each helper is prefixed `ci_`.

# ci_bound NAME DEFAULT ARGS... : re-run the calling script under timeout(1), which sends TERM
# (then KILL 15 s later) when ${NAME}_TIMEOUT seconds (default DEFAULT) run out; the script's
# TERM trap then stops everything it started. ${NAME}_BOUNDED marks the bounded run.
ci_bound() {
  local name=$1 default=$2
  shift 2
  local limit=${name}_TIMEOUT bounded=${name}_BOUNDED
  printf -v "$limit" '%s' "${!limit:-$default}"
  if [[ -z ${!bounded:-} ]]; then
    export "$bounded=1"
    exec timeout -k 15 "${!limit}" bash "$0" "$@"
  fi
}

# ci_prelude DB_PREFIX : cd to the repository root and set ROOT, BIN_DIR (absolute; default
# target/debug), the PG* variables (exported, for psql), DB_NAME (DB_PREFIX_<random>, created by
# the caller, which sets DB_CREATED=1 then) and PIDS (what ci_stop_all stops).
ci_prelude() {
  cd "$(dirname "$0")/.." || exit
  ROOT=$PWD
  BIN_DIR=${BIN_DIR:-target/debug}
  case $BIN_DIR in /*) ;; *) BIN_DIR=$ROOT/$BIN_DIR ;; esac
  PGHOST=${PGHOST:-127.0.0.1}
  PGPORT=${PGPORT:-5432}
  PGUSER=${PGUSER:-postgres}
  export PGHOST PGPORT PGUSER
  DB_NAME=$1_$(od -An -N4 -tx4 /dev/urandom | tr -d ' ')
  DB_CREATED=0
  PIDS=()
}

# ci_stop_all : stop every process in PIDS, newest first (traffic before the gateway, the gateway
# before its downstreams), bounded: a process that ignores TERM for 5 s is killed.
ci_stop_all() {
  local i
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
    kill -TERM "${PIDS[i]}" 2>/dev/null || :
  done
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
    for _ in $(seq 50); do kill -0 "${PIDS[i]}" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "${PIDS[i]}" 2>/dev/null || :
  done
}

# ci_drop_db MESSAGE_PREFIX : drop DB_NAME when this run created it (bounded to 20 s).
ci_drop_db() {
  if ((DB_CREATED)); then
    timeout 20 psql -q -d postgres -c "DROP DATABASE IF EXISTS $DB_NAME WITH (FORCE)" >/dev/null 2>&1 ||
      echo "${1}could not drop database $DB_NAME"
  fi
}
