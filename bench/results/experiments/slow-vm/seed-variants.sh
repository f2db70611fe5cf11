#!/usr/bin/env bash
# The seed-baseline rig (wrk, 500 connections, downstreams at 100 ms, gateway on core 0) with
# three admission settings side by side, 30 s each, two rounds: the shipped defaults, the
# adaptive limit blind to the database pool, and a static 2,000 permits (on one core: no limit).
# Run from the repository's root with BENCH_OUT set, so bench/results/seed-baseline is untouched:
#   BENCH_OUT=/tmp/sb bench/results/experiments/slow-vm/seed-variants.sh
set -euo pipefail
[[ -n "${BENCH_OUT:-}" ]] || { echo "set BENCH_OUT (a directory outside bench/results)" >&2; exit 2; }
# shellcheck source-path=SCRIPTDIR source=../../../lib/common.sh
source "$(dirname "$0")/../../../lib/common.sh"
bench_init seed-baseline
bench_db_prepare
bench_start_sims 100ms
for round in 1 2; do
  for v in default nopool static2000; do
    case $v in
      default) GATEWAY_SETTINGS=() ;;
      nopool) GATEWAY_SETTINGS=("TRIBUTARY_OVERLOAD__FOLLOW_DB_POOL=false") ;;
      static2000) GATEWAY_SETTINGS=("TRIBUTARY_ADMISSION__MODE=static" "TRIBUTARY_ADMISSION__MAX_IN_FLIGHT=2000") ;;
    esac
    bench_gateway_point "$v" 500 "$round" 30 5 5000 "Little's law: 500 connections ÷ 100 ms downstream = 5000 req/s"
  done
done
bench_stop_sims
bench_report "seed-baseline rig, three admission settings"
