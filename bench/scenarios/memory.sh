#!/usr/bin/env bash
# memory: the seed-baseline load with the gateway as shipped (`thp`: mimalloc madvises its
# arenas MADV_HUGEPAGE, so on a kernel with THP in `madvise` mode they are backed by 2 MiB
# pages), with MIMALLOC_ALLOW_THP=0 (`no-thp`: 4 KiB pages only), and with that and HTTP/2 to
# the downstreams (`no-thp-h2`: http_client.http2_prior_knowledge, one connection per host), at
# 100, 500 and 2,000 connections: what the two memory levers save in resident memory and cost in
# CPU.
# Repetitions alternate the variants.
#
#   BENCH_MEMORY_CONNECTIONS="500"   the connection levels (default 100 500 2000; quick: 8)
# shellcheck source-path=SCRIPTDIR source=../lib/common.sh
source "$(dirname "$0")/../lib/common.sh"
bench_init memory

variants=(thp no-thp no-thp-h2)
export BENCH_BASELINE_VARIANT=thp
read -r -a conn_levels <<<"${BENCH_MEMORY_CONNECTIONS:-$(bench_pick "100 500 2000" 8)}"
reps=${BENCH_REPS:-$(bench_pick 4 1)}
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
      [[ $variant == no-thp* ]] && GATEWAY_SETTINGS+=(MIMALLOC_ALLOW_THP=0)
      [[ $variant == *-h2 ]] && GATEWAY_SETTINGS+=(TRIBUTARY_HTTP_CLIENT__HTTP2_PRIOR_KNOWLEDGE=true)
      bench_gateway_point "$variant" "$conns" "$rep" "$duration" "$warmup" "$limit" "$basis"
    done
  done
done
bench_stop_sims
bench_report "memory: mimalloc with and without transparent huge pages, and HTTP/2 to the downstreams (one core)"
