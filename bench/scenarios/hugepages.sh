#!/usr/bin/env bash
# hugepages: the seed-baseline load with mimalloc's transparent huge pages as shipped (mimalloc
# madvises its arenas MADV_HUGEPAGE, so on a kernel with THP in `madvise` mode they are backed
# by 2 MiB pages) against MIMALLOC_ALLOW_THP=0 (4 KiB pages only), at 100 and 500 connections:
# what huge pages cost in resident memory and buy in CPU. Repetitions alternate the variants.
#
#   BENCH_HUGEPAGES_CONNECTIONS="500"   the connection levels (default 100 500; quick: 8)
# shellcheck source-path=SCRIPTDIR source=../lib/common.sh
source "$(dirname "$0")/../lib/common.sh"
bench_init hugepages

variants=(thp no-thp)
export BENCH_BASELINE_VARIANT=thp
read -r -a conn_levels <<<"${BENCH_HUGEPAGES_CONNECTIONS:-$(bench_pick "100 500" 8)}"
reps=${BENCH_REPS:-$(bench_pick 5 1)}
duration=${BENCH_DURATION:-$(bench_pick 15 3)}
warmup=$(bench_pick 3 1)

bench_log "kernel THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null || echo unknown)"
bench_db_prepare
bench_start_sims 100ms
for conns in "${conn_levels[@]}"; do
  limit=$((conns * 10))
  basis="Little's law: $conns connections ÷ 100 ms downstream = $limit req/s"
  for rep in $(seq 1 "$reps"); do
    for variant in "${variants[@]}"; do
      GATEWAY_SETTINGS=()
      [[ $variant == no-thp ]] && GATEWAY_SETTINGS=(MIMALLOC_ALLOW_THP=0)
      bench_gateway_point "$variant" "$conns" "$rep" "$duration" "$warmup" "$limit" "$basis"
    done
  done
done
bench_stop_sims
bench_report "hugepages: mimalloc with and without transparent huge pages (one core)"
