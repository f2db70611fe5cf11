#!/usr/bin/env bash
# shellcheck disable=SC2119 # the start functions take settings, none are given here
# User and system CPU, and context switches, per answer of each server, alternating, under the
# dashboard load (wrk, CONNS connections, 5 s warm-up then 15 s counted) on the lab's placement
# (server on core 0 with one worker, rig on core 1). Variants: `bare` (examples/bare_gateway.rs)
# and any NAME whose gateway binary is BIN_ROOT/bin-NAME/tributary (default BIN_ROOT=/tmp).
#   VARIANTS="bare shipped probe-off" CONNS=150 bench/results/experiments/cpu-time-split/split.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
# shellcheck source-path=SCRIPTDIR source=rig.sh
source results/experiments/cpu-time-split/rig.sh
sample() {
  python3 - "$1" <<'PY'
import glob, os, sys
pid = sys.argv[1]
tck = os.sysconf("SC_CLK_TCK")
f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
vol = inv = 0
for t in glob.glob(f"/proc/{pid}/task/*/status"):
    for line in open(t):
        if line.startswith("voluntary_ctxt_switches"):
            vol += int(line.split()[1])
        elif line.startswith("nonvoluntary_ctxt_switches"):
            inv += int(line.split()[1])
print(int(f[11]) / tck, int(f[12]) / tck, vol, inv)
PY
}
for rep in 1 2 3; do
  for v in "${variants[@]}"; do
    start_server "$v"
    dashboard_load 5 >/dev/null 2>&1
    before=$(sample "$GATEWAY_PID")
    dashboard_load 15 >"$LOG_DIR/wrk.out" 2>&1
    after=$(sample "$GATEWAY_PID")
    python3 - "$v" "$rep" "$before" "$after" "$LOG_DIR/wrk.out" <<'PY'
import json, re, sys
v, rep, a, b, out = sys.argv[1:6]
a, b = [list(map(float, x.split())) for x in (a, b)]
n = sum(json.loads(re.search(r"^WRK_JSON (.*)$", open(out).read(), re.M).group(1))["status"].values())
print(f"{v} rep {rep}: {n / 15:.0f} answers/s, user {1000 * (b[0] - a[0]) / n:.3f} ms, system "
      f"{1000 * (b[1] - a[1]) / n:.3f} ms, voluntary switches {(b[2] - a[2]) / n:.2f}, "
      f"involuntary {(b[3] - a[3]) / n:.3f} per answer")
PY
    bench_stop "$GATEWAY_PID"
  done
done
bench_stop_sims
