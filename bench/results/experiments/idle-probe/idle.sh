#!/usr/bin/env bash
# idle.sh BIN (e.g. target/release/tributary; a database tributary_idle_probe on the local Postgres): starts the gateway on core 0, waits 8 s, then reads its CPU ticks and context
# switches (all threads) over 30 s of no load.
bin="$1"
DATABASE_URL=postgres://postgres@127.0.0.1:5432/tributary_idle_probe TRIBUTARY_SERVER__LISTEN=127.0.0.1:18080 \
  TRIBUTARY_SERVER__OPS_LISTEN=127.0.0.1:19090 taskset -c 0 "$bin" >/dev/null 2>&1 &
pid=$!
sleep 8
ticks() { awk '{print $14+$15}' "/proc/$pid/stat"; }
switches() { cat /proc/"$pid"/task/*/status | awk '/ctxt_switches/ {s+=$2} END {print s}'; }
a=$(ticks); c=$(switches); sleep 30; b=$(ticks); d=$(switches)
kill "$pid"; wait "$pid" 2>/dev/null
echo "$(basename "$(dirname "$bin")") idle 30 s: $((b - a)) CPU ticks of $(getconf CLK_TCK) a second ($(( (b - a) * 100 / 30 / $(getconf CLK_TCK) )).$(( (b - a) * 1000 / 30 / $(getconf CLK_TCK) % 10 )) % of a core), $(( (d - c) / 30 )) context switches a second"
