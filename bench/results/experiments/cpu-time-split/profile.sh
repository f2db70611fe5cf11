#!/usr/bin/env bash
# shellcheck disable=SC2119 # the start functions take settings, none are given here
# A sampled profile (perf, cpu-clock: this VM has no hardware counters) of each server under the
# dashboard load (wrk, CONNS connections, 25 s, sampled for 15 s from the 5th), one after the
# other, and the difference per symbol in µs per answer. Variants as in split.sh.
#   VARIANTS="bare 46f72b3" CONNS=150 bench/results/experiments/cpu-time-split/profile.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
# shellcheck source-path=SCRIPTDIR source=rig.sh
source results/experiments/cpu-time-split/rig.sh
for v in "${variants[@]}"; do
  start_server "$v"
  dashboard_load 25 >"$LOG_DIR/wrk-$v.out" 2>&1 &
  wrk_pid=$!
  sleep 5
  perf record -e cpu-clock -F 1999 -p "$GATEWAY_PID" -o "$LOG_DIR/$v.data" -- sleep 15 >/dev/null 2>&1
  wait "$wrk_pid"
  bench_stop "$GATEWAY_PID"
  perf report -i "$LOG_DIR/$v.data" --no-children --sort sym -q --stdio -F overhead,sample,sym \
    >"$LOG_DIR/$v.sym" 2>/dev/null
done
bench_stop_sims
# µs per answer by symbol: samples / 1999 Hz over the answers wrk counted in the 25 s, × 15/25.
python3 - "$LOG_DIR" "${variants[@]}" <<'PY'
import json, re, sys
log, names = sys.argv[1], sys.argv[2:]
per = {}
for v in names:
    wrk = open(f"{log}/wrk-{v}.out").read()
    answers = sum(json.loads(re.search(r"^WRK_JSON (.*)$", wrk, re.M).group(1))["status"].values()) * 15 / 25
    costs = {}
    for line in open(f"{log}/{v}.sym"):
        m = re.match(r"\s*[\d.]+%\s+(\d+)\s+\[.\]\s+(.*)$", line)
        if m:
            name = m.group(2).strip()[:110]
            costs[name] = costs.get(name, 0) + int(m.group(1)) * 1e6 / 1999 / answers
    per[v] = costs
    print(f"{v}: {sum(costs.values()):.1f} µs sampled per answer")
if len(names) == 2:
    a, b = per[names[0]], per[names[1]]
    rows = sorted(((b.get(k, 0) - a.get(k, 0), k) for k in set(a) | set(b)), reverse=True)
    print(f"largest differences, µs per answer, {names[1]} - {names[0]}:")
    for d, k in rows[:25]:
        print(f"{d:8.2f}  {b.get(k, 0):7.2f}  {a.get(k, 0):7.2f}  {k}")
PY
