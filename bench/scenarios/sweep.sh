#!/usr/bin/env bash
# sweep: concurrency 100 -> 10,000 against the dashboard (downstreams fixed at 100 ms), with the
# admission limiter on (default: 2,000 in flight, 100 ms queue) and off.
# shellcheck source-path=SCRIPTDIR source=../lib/common.sh
source "$(dirname "$0")/../lib/common.sh"
bench_init sweep

read -r -a levels <<<"$(bench_pick "100 250 500 1000 2000 5000 10000" "4 16")"
duration=${BENCH_DURATION:-$(bench_pick 15 3)}
warmup=$(bench_pick 3 1)

# Where the sweep must stop: every connection is a file descriptor in wrk and in the gateway, and
# the gateway holds up to five more towards the simulators (one simulator per downstream, each
# with its own range of ephemeral ports).
nofile=$(ulimit -n)
read -r port_lo port_hi </proc/sys/net/ipv4/ip_local_port_range
ports=$((port_hi - port_lo + 1))
bench_log "fd limit $nofile, ephemeral ports per destination $ports"

bench_db_prepare
bench_start_sims 100ms
for limiter in on off; do
  enabled=$([[ $limiter == on ]] && echo true || echo false)
  for conns in "${levels[@]}"; do
    need_fds=$((conns * 6 + 1000))
    if ((need_fds > nofile || conns > ports)); then
      bench_log "stopping at $conns connections: needs ~$need_fds fds (limit $nofile) and $conns ports ($ports)"
      break
    fi
    limit=$((conns * 10))
    basis="Little's law: connections ÷ 100 ms downstream"
    bench_start_gateway "TRIBUTARY_ADMISSION__ENABLED=$enabled"
    bench_gateway_run "limiter-$limiter" "$conns" 1 "$duration" "$warmup" "$limit" "$basis" \
      --meta "fd_limit=$nofile" --meta "ephemeral_ports=$ports"
    bench_stop "$GATEWAY_PID"
  done
done
bench_stop_sims
bench_report "sweep: dashboard, concurrency 100 to 10,000, admission limiter on vs off (gateway on one core)"
