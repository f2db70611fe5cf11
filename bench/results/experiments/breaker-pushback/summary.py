#!/usr/bin/env python3
"""Per-second timeline and recovery of fault.sh's runs.

    summary.py DIR   (reads DIR/*.json and DIR/*.metrics.txt)

Per run: full 200s and 503s per second of the measured window (by the second an answer
arrived), when the users simulator failed and was healthy again (from the metrics log), the
users circuit's state over time, full 200s per second before the fault (seconds 1-4) and in the
ten seconds after it ended, and how many seconds after it ended goodput first reached 80 % of
the level before it.
"""
import json
import re
import statistics
import sys
from pathlib import Path

root = Path(sys.argv[1])
rows = []
for path in sorted(root.glob("*.json")):
    run = json.loads(path.read_text())
    series = run["series"]
    full = [s["full"] for s in series]
    rejected = [s["rejected"] for s in series]
    log = (root / (path.stem + ".metrics.txt")).read_text()
    off = int(re.search(r"fault off at (\d+) ms", log).group(1)) / 1000
    on = int(re.search(r"fault on at (\d+) ms", log).group(1)) / 1000
    states = re.findall(r"^(\d+) ms users_circuit=(\S*)", log, re.M)
    open_s = [int(t) / 1000 for t, s in states if s == "2"]
    before = statistics.median(full[1:5])
    after_start = int(off) + 1
    after = full[after_start:after_start + 10]
    back = next((i for i, f in enumerate(full[after_start:]) if f >= 0.8 * before), None)
    name = path.stem
    print(f"{name}: fault {on:.1f}-{off:.1f} s; circuit open {min(open_s, default=0):.1f}-{max(open_s, default=0):.1f} s")
    print("  full/s:", " ".join(str(f) for f in full))
    print("  503/s: ", " ".join(str(r) for r in rejected))
    print(f"  before {before:.0f}/s; after: mean {statistics.mean(after):.0f}/s over 10 s; "
          f"back to 80 % {back if back is None else back + 1} s after; total 503 {sum(rejected)}")
    rows.append((name.split("-c")[0], statistics.mean(after), sum(rejected),
                 (back + 1) if back is not None else 99))
print()
for variant in sorted({r[0] for r in rows}):
    mine = [r for r in rows if r[0] == variant]
    print(f"{variant}: runs {len(mine)}; full/s in the 10 s after the fault, median "
          f"{statistics.median(r[1] for r in mine):.0f} (each {[round(r[1]) for r in mine]}); "
          f"seconds to 80 % {[r[3] for r in mine]}; 503s {[r[2] for r in mine]}")
