#!/usr/bin/env bash
# transport: the seed-baseline load with the downstream calls going through reqwest (the
# shipped default) against hyper-util's client without reqwest's layers
# (`http_client.transport = "hyper"`), at 250 connections (below saturation: CPU per request)
# and 500 (the seed-baseline load: throughput); each also over HTTP/2 with prior knowledge
# (`http_client.http2_prior_knowledge = true`, the `-h2` variants: a few multiplexed
# connections instead of one per call in flight). Repetitions alternate the variants.
#
#   BENCH_TRANSPORT_CONNECTIONS="250"   the connection levels (default 250 500; quick: 8)
# shellcheck source-path=SCRIPTDIR source=../lib/common.sh
source "$(dirname "$0")/../lib/common.sh"
bench_init transport

variants=(reqwest hyper reqwest-h2 hyper-h2)
# The report's ratios: each variant ÷ reqwest, repetition by repetition.
export BENCH_BASELINE_VARIANT=reqwest
read -r -a conn_levels <<<"${BENCH_TRANSPORT_CONNECTIONS:-$(bench_pick "250 500" 8)}"
reps=${BENCH_REPS:-$(bench_pick 5 1)}
duration=${BENCH_DURATION:-$(bench_pick 15 3)}
warmup=$(bench_pick 3 1)

bench_db_prepare
bench_start_sims 100ms
for conns in "${conn_levels[@]}"; do
  limit=$((conns * 10))
  basis="Little's law: $conns connections ÷ 100 ms downstream = $limit req/s"
  for rep in $(seq 1 "$reps"); do
    for variant in "${variants[@]}"; do
      http2=false
      [[ $variant == *-h2 ]] && http2=true
      GATEWAY_SETTINGS=("TRIBUTARY_HTTP_CLIENT__TRANSPORT=${variant%-h2}"
        "TRIBUTARY_HTTP_CLIENT__HTTP2_PRIOR_KNOWLEDGE=$http2")
      bench_gateway_point "$variant" "$conns" "$rep" "$duration" "$warmup" "$limit" "$basis"
    done
  done
done
bench_stop_sims
bench_report "transport: the downstream calls through reqwest and through hyper-util's client, over HTTP/1.1 and HTTP/2 (one core)"
