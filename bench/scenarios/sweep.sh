#!/usr/bin/env bash
# sweep: concurrency 100 -> 10,000 against the dashboard (downstreams fixed at 100 ms), with the
# admission as shipped (the adaptive limit), off, and a static limit sized to one core (330).
#
#   BENCH_SWEEP_LEVELS="100 500 2000 10000"   the connection levels (default 100 250 500 1000 2000 5000 10000)
#   BENCH_SWEEP_LIMITERS="on"                 the variants (default on off sized)
#   BENCH_SWEEP_SIZED=413                     the static limit of `sized` (default 330)
# shellcheck source-path=SCRIPTDIR source=../lib/common.sh
source "$(dirname "$0")/../lib/common.sh"
bench_init sweep

read -r -a levels <<<"${BENCH_SWEEP_LEVELS:-$(bench_pick "100 250 500 1000 2000 5000 10000" "4 16")}"
duration=${BENCH_DURATION:-$(bench_pick 15 3)}
warmup=$(bench_pick 3 1)

# Where the sweep must stop: every connection is a file descriptor in wrk and in the gateway,
# and the gateway holds connections towards the simulators too: at most one per call in flight,
# and calls in flight per downstream are capped by its bulkhead (downstreams.*.max_concurrency,
# 1,024 by default), so at most 5 x 1,024. One simulator per downstream gives each its own range
# of ephemeral ports. `ulimit -n` is raised as far as the hard limit allows.
nofile=$(ulimit -n)
bulkhead=1024
read -r port_lo port_hi </proc/sys/net/ipv4/ip_local_port_range
ports=$((port_hi - port_lo + 1))
bench_log "fd limit $nofile, ephemeral ports per destination $ports"

[[ "${BENCH_KEEP_RUNS:-0}" == 1 ]] || rm -f "$OUT_DIR/stopped.jsonl"
bench_db_prepare
bench_start_sims 100ms
# on: the shipped admission (no settings: the adaptive limit since 2026-12-01; until then a static
# 2,000 in flight with a 100 ms queue); off: none; sized: a static limit, by default the 330 that
# `tributary capacity --target-rps 2200 --latency-ms 100` recommends for what one core sustained
# on the lab's first VM (about 2,200 req/s at 100 ms: 220 in flight, x 1.5 headroom).
read -r -a limiters <<<"${BENCH_SWEEP_LIMITERS:-on off sized}"
for limiter in "${limiters[@]}"; do
  case "$limiter" in
    on) settings=() ;;
    off) settings=("TRIBUTARY_ADMISSION__ENABLED=false") ;;
    sized) settings=("TRIBUTARY_ADMISSION__MODE=static" "TRIBUTARY_ADMISSION__MAX_IN_FLIGHT=${BENCH_SWEEP_SIZED:-330}") ;;
    *) bench_log "unknown limiter variant $limiter"; exit 2 ;;
  esac
  for conns in "${levels[@]}"; do
    outbound=$((conns < bulkhead ? conns : bulkhead))
    need_fds=$((conns + 5 * outbound + 500))
    if ((need_fds > nofile || conns > ports)); then
      bench_log "stopping before $conns connections: the gateway would need ~$need_fds file descriptors (limit $nofile) and wrk $conns ports ($ports)"
      echo "{\"stopped_before\": $conns, \"limiter\": \"$limiter\", \"gateway_fds_needed\": $need_fds, \"fd_limit\": $nofile, \"ephemeral_ports\": $ports}" \
        >>"$OUT_DIR/stopped.jsonl"
      break
    fi
    limit=$((conns * 10))
    basis="Little's law: connections ÷ 100 ms downstream"
    GATEWAY_SETTINGS=("${settings[@]}")
    bench_gateway_point "limiter-$limiter" "$conns" 1 "$duration" "$warmup" "$limit" "$basis" \
      --meta "fd_limit=$nofile" --meta "ephemeral_ports=$ports"
  done
done
bench_stop_sims
bench_report "sweep: dashboard, concurrency 100 to 10,000, admission limiter as shipped, off, and sized to the core (gateway on one core)"
