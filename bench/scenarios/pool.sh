#!/usr/bin/env bash
# pool: database pool size 2 -> 200 at a fixed load (the seed-baseline load): throughput, p99 and
# pool acquire waits from the gateway's /metrics; the knee against Little's law.
# shellcheck source-path=SCRIPTDIR source=../lib/common.sh
source "$(dirname "$0")/../lib/common.sh"
bench_init pool

read -r -a sizes <<<"$(bench_pick "1 2 3 4 8 16 64 200" "2 8")"
conns=$(bench_pick 500 8)
duration=${BENCH_DURATION:-$(bench_pick 15 3)}
warmup=$(bench_pick 3 1)
limit=$((conns * 10))
basis="Little's law: $conns connections ÷ 100 ms downstream = $limit req/s"
pg_max=$(psql "$PG_URL_BASE/postgres" -tAc 'show max_connections')

bench_db_prepare
bench_start_sims 100ms
for size in "${sizes[@]}"; do
  min=$((size < 2 ? size : 2))
  # The fleet-budget check would only warn; tell it the truth about this one replica anyway.
  GATEWAY_SETTINGS=("TRIBUTARY_DATABASE__MAX_CONNECTIONS=$size" "TRIBUTARY_DATABASE__MIN_CONNECTIONS=$min"
    "TRIBUTARY_DATABASE__MAX_REPLICAS=1" "TRIBUTARY_DATABASE__SERVER_MAX_CONNECTIONS=$pg_max")
  bench_gateway_point "pool" "$conns" 1 "$duration" "$warmup" "$limit" "$basis" \
    --x-name pool_size --x-value "$size" --meta "pool_size=$size" --meta "postgres_max_connections=$pg_max"
  if [[ $BENCH_POINT_OK == 1 ]]; then
    mv "$OUT_DIR/runs/pool-c${conns}-r1.json" "$OUT_DIR/runs/pool-size$(printf %03d "$size").json"
  fi
done
bench_stop_sims
bench_report "pool: database pool size 1 to 200 at 500 connections (gateway on one core)"
