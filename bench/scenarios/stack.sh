#!/usr/bin/env bash
# stack: the seed-baseline load on tributary as shipped, on tributary with
# `http_client.transport = "hyper"`, and on the bare stack it is built on
# (examples/bare_gateway.rs: axum, reqwest and sqlx serving the same dashboard with none of
# tributary's features), side by side on one core, at 250 connections (below saturation: CPU
# per request) and 500 (the seed-baseline load: throughput). Repetitions alternate the
# variants; the report's ratios are each variant's over the bare stack's, repetition by
# repetition, so that the VM's speed of the day cancels out.
#
#   BENCH_STACK_CONNECTIONS="250"   the connection levels (default 250 500; quick: 8)
#   BENCH_STACK_VARIANTS="bare shipped"   (default bare shipped hyper; also bare-thp)
#
# The bare stack runs with MIMALLOC_ALLOW_THP=0: the same page policy as tributary, which turns
# transparent huge pages off for itself (src/allocator.rs), so that the ratio is the code's and
# not the kernel's page zeroing; `bare-thp` is the bare stack with mimalloc's own default.
# shellcheck source-path=SCRIPTDIR source=../lib/common.sh
source "$(dirname "$0")/../lib/common.sh"
bench_init stack

read -r -a variants <<<"${BENCH_STACK_VARIANTS:-bare shipped hyper}"
export BENCH_BASELINE_VARIANT=bare
read -r -a conn_levels <<<"${BENCH_STACK_CONNECTIONS:-$(bench_pick "250 500" 8)}"
reps=${BENCH_REPS:-$(bench_pick 3 1)}
duration=${BENCH_DURATION:-$(bench_pick 15 3)}
warmup=$(bench_pick 3 1)

bench_db_prepare
# Built before the first point, so that the build is not inside a measured run's start-up wait.
bench_example_bin bare_gateway >/dev/null
bench_start_sims 100ms
for conns in "${conn_levels[@]}"; do
  limit=$((conns * 10))
  basis="Little's law: $conns connections ÷ 100 ms downstream = $limit req/s"
  for rep in $(seq 1 "$reps"); do
    for variant in "${variants[@]}"; do
      GATEWAY_STARTER=bench_start_gateway
      case "$variant" in
        bare) GATEWAY_STARTER=bench_start_bare; GATEWAY_SETTINGS=("MIMALLOC_ALLOW_THP=0") ;;
        bare-thp) GATEWAY_STARTER=bench_start_bare; GATEWAY_SETTINGS=() ;;
        shipped) GATEWAY_SETTINGS=() ;;
        hyper) GATEWAY_SETTINGS=("TRIBUTARY_HTTP_CLIENT__TRANSPORT=hyper") ;;
        *) bench_log "unknown variant '$variant' (bare, bare-thp, shipped or hyper)"; exit 2 ;;
      esac
      bench_gateway_point "$variant" "$conns" "$rep" "$duration" "$warmup" "$limit" "$basis"
    done
  done
done
bench_stop_sims
bench_report "stack: tributary beside the bare axum + reqwest + sqlx stack it is built on (one core)"
