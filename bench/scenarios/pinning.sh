#!/usr/bin/env bash
# pinning: a cache update under a std Mutex with blocking work vs tokio Mutex vs moka get_with.
# shellcheck source-path=SCRIPTDIR source=../lib/common.sh
source "$(dirname "$0")/../lib/common.sh"
bench_init pinning
bench_calibrate_server

conns=$(bench_pick 16 4)
reps=${BENCH_REPS:-$(bench_pick 3 1)}
duration=${BENCH_DURATION:-$(bench_pick 10 3)}
warmup=$(bench_pick 2 1)
# Every request runs the 5 ms loader (fresh key), and the loader is I/O, not CPU.
limit=$((conns * 200))
basis="Little's law: $conns connections ÷ 5 ms loader = $limit req/s"

for rep in $(seq 1 "$reps"); do
  for mode in mutex async-mutex moka; do
    bench_server_run "$mode" "/pinning/$mode" "$conns" "$rep" "$limit" "$basis" "$duration" "$warmup"
  done
done
bench_report "pinning: cache update under std::sync::Mutex with blocking I/O vs tokio Mutex vs moka get_with (one core)"
