#!/usr/bin/env bash
# allocator: the seed-baseline load on the gateway as shipped (mimalloc, transparent huge pages
# allowed), with MIMALLOC_ALLOW_THP=0, with that and MIMALLOC_PURGE_DELAY=0 (freed pages go back
# to the kernel at once instead of after mimalloc's 1 s delay), and on a build with glibc's
# malloc (the `system-allocator` feature, built into target/heap-profile): what the allocator
# holds beyond the heap the gateway uses, and what each choice costs in CPU. Each over HTTP/1.1
# to the downstreams and, as `*-h2`, over HTTP/2 (http_client.http2_prior_knowledge).
# Repetitions alternate the variants.
#
#   BENCH_ALLOCATOR_CONNECTIONS="500"   the connection levels (default 500; quick: 8)
# shellcheck source-path=SCRIPTDIR source=../lib/common.sh
source "$(dirname "$0")/../lib/common.sh"
bench_init allocator

variants=(mimalloc mimalloc-no-thp mimalloc-purge-now glibc mimalloc-h2 mimalloc-no-thp-h2 mimalloc-purge-now-h2 glibc-h2)
export BENCH_BASELINE_VARIANT=mimalloc
read -r -a conn_levels <<<"${BENCH_ALLOCATOR_CONNECTIONS:-$(bench_pick "500" 8)}"
reps=${BENCH_REPS:-$(bench_pick 3 1)}
duration=${BENCH_DURATION:-$(bench_pick 15 3)}
warmup=$(bench_pick 3 1)

shipped_bins="$BIN_DIR"
glibc_bins="$(bench_build_system_allocator)"

bench_db_prepare
bench_start_sims 100ms
for conns in "${conn_levels[@]}"; do
  limit=$((conns * 10))
  basis="Little's law: $conns connections ÷ 100 ms downstream = $limit req/s"
  for rep in $(seq 1 "$reps"); do
    for variant in "${variants[@]}"; do
      GATEWAY_SETTINGS=()
      BIN_DIR="$shipped_bins"
      case "${variant%-h2}" in
        mimalloc-no-thp) GATEWAY_SETTINGS+=(MIMALLOC_ALLOW_THP=0) ;;
        mimalloc-purge-now) GATEWAY_SETTINGS+=(MIMALLOC_ALLOW_THP=0 MIMALLOC_PURGE_DELAY=0) ;;
        glibc) BIN_DIR="$glibc_bins" ;;
      esac
      [[ $variant == *-h2 ]] && GATEWAY_SETTINGS+=(TRIBUTARY_HTTP_CLIENT__HTTP2_PRIOR_KNOWLEDGE=true)
      bench_gateway_point "$variant" "$conns" "$rep" "$duration" "$warmup" "$limit" "$basis"
    done
  done
done
BIN_DIR="$shipped_bins"
bench_stop_sims
bench_report "allocator: mimalloc as shipped, without huge pages, purging at once, and glibc's malloc, over HTTP/1.1 and HTTP/2 (one core)"
