# shellcheck shell=bash
# shellcheck disable=SC2119 # the start functions take settings, none are given here
# What split.sh and profile.sh share, sourced by both from the bench directory: a temporary
# output directory (removed on exit), the lab's database and simulators, and the servers and
# load they run. Variants: `bare` (examples/bare_gateway.rs) and any NAME whose gateway binary is
# BIN_ROOT/bin-NAME/tributary (default BIN_ROOT=/tmp).
# shellcheck source-path=SCRIPTDIR source=../../../lib/common.sh
source lib/common.sh
BENCH_OUT="$(mktemp -d "${TMPDIR:-/tmp}/bench-split.XXXXXX")"
BENCH_TMP_OUT="$BENCH_OUT"
trap 'rm -rf "$BENCH_TMP_OUT"' EXIT
bench_init split
bench_db_prepare
bench_start_sims 100ms
conns=${CONNS:-150}
# shellcheck disable=SC2034 # read by the scripts that source this file
read -r -a variants <<<"${VARIANTS:-bare shipped}"

# start_server VARIANT: the server on the lab's core, its pid in GATEWAY_PID.
start_server() {
  case $1 in
    bare) bench_start_bare ;;
    *) BIN_DIR="${BIN_ROOT:-/tmp}/bin-$1" bench_start_gateway ;;
  esac
}

# dashboard_load SECONDS: wrk on the load generator's core, its report on stdout.
dashboard_load() {
  WRK_PATH_TEMPLATE='/api/v1/dashboard/{id}' WRK_ID_MAX="$BENCH_USERS" taskset -c "$LOADGEN_CPUS" \
    wrk -t1 -c"$conns" -d"$1"s -s "$BENCH_DIR/lib/wrk_report.lua" \
    "http://127.0.0.1:$GATEWAY_PORT/api/v1/dashboard/1"
}
