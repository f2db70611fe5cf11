#!/usr/bin/env python3
"""Medians over repeated short runs of `overload-curve`, one table row per configuration and point.

The overload curve runs each point once; on a shared VM one point's goodput moves by ±20 %, so an
experiment that compares configurations runs the scenario several times (one BENCH_OUT per round;
within a round the configurations take turns at each point, in an order that rotates from point
to point) and reads the medians:

    for i in 1 2 3; do BENCH_OUT=/tmp/exp-$i BENCH_CONFIGS="default static-270" \\
      BENCH_CLOSED="1000 10000" BENCH_OPEN="5" BENCH_RETRY=" " \\
      BENCH_CAPACITY_RPS=1400 BENCH_CAPACITY_LATENCY_MS=104 bench/run overload-curve; done
    bench/lib/rounds.py /tmp/exp-1 /tmp/exp-2 /tmp/exp-3

Per row: full-200 req/s (median, then every round's), the mean admission limit over the run, the
p99 of full 200s (client-side), the mean server-side latency of 200s and the two waits inside it
(for a permit, for a database connection), 503s per second, the adaptive limit's
cuts by cause (`tributary_admission_limit_decreases_total`, summed over the rounds; `–` for a
static limit; in builds that undo core cuts that did not shorten the queue, how many were
undone) and how many rounds the measurement flagged as disturbed. A second table gives the
resources: the gateway's share of its core, each core's busy figure (which one ran out), and the
local Postgres's CPU per full 200 with where it ran.

`--by-dir` labels each row with its directory's name too (without a trailing `-N`), for an
experiment that varies what the configuration names cannot: the build (`BIN_DIR`) or the rig
(`BENCH_PG_CPUS`), e.g. `bench/lib/rounds.py --by-dir /tmp/old-{1,2,3} /tmp/new-{1,2,3}`.
"""

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def row_of(path: Path) -> tuple[str, dict]:
    d = json.loads(path.read_text())
    m = d["metrics"]
    limits = [g["admission_limit_dashboard"] for g in m.get("gauge_series", []) if g.get("admission_limit_dashboard")]
    cuts = m.get("tributary_admission_limit_decreases_total", {})
    by_cause = defaultdict(int)
    for labels, n in cuts.items():
        cause = dict(kv.split("=", 1) for kv in labels.split(","))["cause"]
        by_cause[cause] += n
    undone = m.get("tributary_admission_limit_cuts_undone_total")
    if undone is not None:
        by_cause["undone"] = sum(undone.values())
    pool = m.get("tributary_db_pool_acquire_wait_seconds", {}).get("all", {})
    admission = m.get("tributary_admission_wait_seconds", {}).get("all", {})
    served = m.get("http_server_request_duration_seconds", {}).get("200", {})
    return path.stem.rsplit("-r", 1)[0], {
        "goodput": d["goodput"]["full_rps"],
        "limit": sum(limits) / len(limits) if limits else None,
        "p99": d["latency_ms"].get("p99"),
        "rejected_per_s": d["goodput"]["rejected_503"] / d["duration_s"],
        "pool_wait_ms": pool.get("mean_ms"),
        "admission_wait_ms": admission.get("mean_ms"),
        "server_200_ms": served.get("mean_ms"),
        "cuts": dict(by_cause) if "tributary_admission_limit_decreases_total" in m else None,
        "disturbed": bool(d["conditions"]["disturbed"]),
        "gateway_core": d["processes"]["gateway"]["cpu_util"],
        "core0": d["cores_busy"].get("cpu0"),
        "core1": d["cores_busy"].get("cpu1"),
        "pg_us_per_full": d["processes"]["postgres"]["cpu_s"] * 1e6 / d["goodput"]["full_requests"]
        if d["goodput"]["full_requests"]
        else None,
        "pg_cpus": d["config"].get("postgres_cpus") or "unpinned",
    }


def fmt(x, pattern="{:,.0f}"):
    return "–" if x is None else pattern.format(x)


def main(dirs: list[str], by_dir: bool) -> None:
    rows = defaultdict(list)
    for d in dirs:
        label = re.sub(r"-\d+$", "", Path(d).name) + " " if by_dir else ""
        for path in sorted(Path(d, "overload-curve", "runs").glob("*.json")):
            name, row = row_of(path)
            rows[label + name].append(row)
    print("| configuration and point | full 200/s median | each round | mean limit | p99 ms | server 200 mean ms | admission wait ms | pool wait ms | 503/s | cuts core / db_pool / both | disturbed |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for name in sorted(rows):
        rs = rows[name]
        med = lambda k: statistics.median([r[k] for r in rs]) if all(r[k] is not None for r in rs) else None  # noqa: E731
        cuts = "–"
        if all(r["cuts"] is not None for r in rs):
            total = defaultdict(int)
            for r in rs:
                for k, v in r["cuts"].items():
                    total[k] += v
            cuts = " / ".join(str(total.get(k, 0)) for k in ("core", "db_pool", "both"))
            if "undone" in total:
                cuts += f" ({total['undone']} undone)"
        print(f"| {name} | **{fmt(med('goodput'))}** | {', '.join(fmt(r['goodput']) for r in rs)} | {fmt(med('limit'))} "
              f"| {fmt(med('p99'))} | {fmt(med('server_200_ms'))} | {fmt(med('admission_wait_ms'), '{:.1f}')} "
              f"| {fmt(med('pool_wait_ms'), '{:.1f}')} | {fmt(med('rejected_per_s'))} | {cuts} "
              f"| {sum(r['disturbed'] for r in rs)} of {len(rs)} |")
    print()
    print("| configuration and point | gateway's share of core 0 | core 0 busy | core 1 busy | Postgres µs per full 200 | Postgres on |")
    print("|---|---:|---:|---:|---:|---|")
    for name in sorted(rows):
        rs = rows[name]
        med = lambda k: statistics.median([r[k] for r in rs]) if all(r[k] is not None for r in rs) else None  # noqa: E731
        print(f"| {name} | {fmt(med('gateway_core'), '{:.2f}')} | {fmt(med('core0'), '{:.0%}')} | {fmt(med('core1'), '{:.0%}')} "
              f"| {fmt(med('pg_us_per_full'))} | {', '.join(sorted({r['pg_cpus'] for r in rs}))} |")


if __name__ == "__main__":
    args = sys.argv[1:]
    by_dir = "--by-dir" in args
    args = [a for a in args if a != "--by-dir"]
    if not args:
        sys.exit("usage: bench/lib/rounds.py [--by-dir] BENCH_OUT_DIR...")
    main(args, by_dir)
