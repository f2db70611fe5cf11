#!/usr/bin/env python3
"""Aggregate the run JSONs of one scenario into a markdown report and a plot.

    report.py scenario DIR --title T [--about FILE] [--command CMD]
        reads DIR/runs/*.json, writes DIR/report.md, DIR/plot.png and DIR/summary.json
    report.py summary RESULTS_DIR
        gathers every RESULTS_DIR/*/summary.json into RESULTS_DIR/SUMMARY.md

Runs are grouped by (variant, x); every figure in a table is the median over the group's
repetitions, with the min-max range where it matters. Nothing here measures anything: it only
reads what bench/lib/measure.py recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from pathlib import Path


def ensure_matplotlib():
    try:
        import matplotlib
    except ImportError:
        sys.exit("report.py: matplotlib is missing; bench/run installs it into target/venv "
                 "(or run: scripts/venv.sh bench/requirements.txt)")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def revision(machine):
    """The commit the binaries were built from, marked when the work tree had changes."""
    rev = machine.get("git_revision")
    return f"{rev} with uncommitted changes" if machine.get("git_dirty") else f"{rev}"


def kernel(machine):
    """The kernel release, with its transparent huge page mode when the run recorded it
    (machine.json since 2026-12-07): a process's page faults cost its own core, and the mode
    decides how large each one is."""
    thp = machine.get("transparent_hugepage")
    return f"kernel {machine.get('kernel')}" + (f" (transparent huge pages: {thp})" if thp else "")


def dig(data, *path, default=None):
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return default
        data = data[key]
    return data


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value, digits=1):
    if isinstance(value, str):
        return value
    return "–" if value is None else f"{value:,.{digits}f}"


def fmt_range(values, digits=0):
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    mid = fmt(median(values), digits)
    if len(values) == 1:
        return mid
    return f"{mid} ({fmt(min(values), digits)}–{fmt(max(values), digits)})"


def pct(value):
    return "–" if value is None else f"{value * 100:.0f}%"


def load_runs(directory: Path) -> list[dict]:
    runs = [json.loads(p.read_text()) for p in sorted((directory / "runs").glob("*.json"))]
    if not runs:
        raise SystemExit(f"no run JSON under {directory / 'runs'}")
    return runs


def group_runs(runs: list[dict]) -> list[tuple[str, float, list[dict]]]:
    order: list[tuple[str, float]] = []
    groups: dict[tuple[str, float], list[dict]] = {}
    for run in runs:
        key = (run["variant"], run["x"]["value"])
        if key not in groups:
            order.append(key)
            groups[key] = []
        groups[key].append(run)
    variants = list(dict.fromkeys(k[0] for k in order))
    order.sort(key=lambda k: (variants.index(k[0]), k[1]))
    return [(v, x, groups[(v, x)]) for v, x in order]


def limiting_resource(run: dict) -> str:
    """A reading of the run's CPU accounting: which resource, if any, capped it."""
    efficiency = run.get("efficiency") or 0
    server = run["server"]["name"]
    procs = run.get("processes", {})
    server_util = dig(procs, server, "cpu_util", default=0) or 0
    cores = run.get("cores_busy", {})
    core0, core1 = cores.get("cpu0", 0), cores.get("cpu1", 0)
    others = ", ".join(
        f"{name} {info['cpu_util']:.2f}" for name, info in procs.items() if name != server and info.get("cpu_util")
    )
    if efficiency >= 0.95:
        return f"none: at {efficiency:.0%} of the limit"
    if server_util >= 0.9 or core0 >= 0.95:
        return f"{server} CPU ({server_util:.2f} core; core 0 {core0:.0%} busy)"
    if core1 >= 0.9:
        return f"core 1 ({core1:.0%} busy: {others})"
    return f"no core saturated (core 0 {core0:.0%}, core 1 {core1:.0%}): waiting, see latency and metrics"


def bucket(runs: list[dict], family: str, group: str) -> str | None:
    """The histogram bucket holding the p99, e.g. "100–250" (ms): the median run's bucket."""
    found = [dig(r, "metrics", family, group, "p99_bucket_ms") for r in runs]
    found = [b for b in found if b]
    if not found:
        return None
    lo, hi = sorted(found, key=lambda b: (b[1] is None, b[1] or 0, b[0]))[len(found) // 2]
    if hi is None:
        return f"> {lo:g}"
    return f"{lo:g}–{hi:g}"


def little_pool(run: dict) -> float | None:
    """Little's law for the pool: λ × W, with λ the run's rate of recent_orders queries and W
    the time a connection is held, taken as the query's mean duration (the gateway sends the
    statement_timeout and the query in one round trip and times it after the acquire)."""
    query = dig(run, "metrics", "tributary_db_query_duration_seconds", "recent_orders")
    if not query:
        return None
    rate = query["count"] / run["duration_s"]
    return round(rate * query["mean_ms"] / 1000, 2)


CACHE_COUNTERS = {"hits": "tributary_cache_hits_total", "misses": "tributary_cache_misses_total",
                  "coalesced": "tributary_cache_coalesced_total", "stale": "tributary_cache_stale_served_total"}


def cache_counts(run: dict) -> dict[str, dict[str, int]]:
    """Per downstream with any cache lookup in the window: hits, misses, coalesced, stale."""
    result: dict[str, dict[str, int]] = {}
    for kind, family in CACHE_COUNTERS.items():
        for labels, value in dig(run, "metrics", family, default={}).items():
            downstream = dict(kv.split("=", 1) for kv in labels.split(",") if "=" in kv).get("downstream", labels)
            result.setdefault(downstream, {k: 0 for k in CACHE_COUNTERS})[kind] += value
    return result


def hit_ratio(counts: dict[str, int] | None) -> float | None:
    """hits / lookups (a lookup is a hit, a miss that started a call, or a wait for another's call)."""
    if not counts:
        return None
    lookups = counts["hits"] + counts["misses"] + counts["coalesced"]
    return counts["hits"] / lookups if lookups else None


def calls_aggregate(runs: list[dict]) -> dict | None:
    """Medians of downstream calls per request (the simulators' counters) and of the cache hit
    ratio per downstream (the gateway's counters), when the runs recorded them."""
    if not any(r.get("downstream_calls") for r in runs):
        return None
    names = list(dict.fromkeys(n for r in runs for n in (r.get("downstream_calls") or {})))
    per_request = {n: median([dig(r, "downstream_calls", n, "per_request") for r in runs]) for n in names}
    totals = [sum(c["per_request"] for c in r["downstream_calls"].values() if c and c["per_request"] is not None)
              for r in runs if r.get("downstream_calls")]
    counts = [cache_counts(r) for r in runs]
    cached = list(dict.fromkeys(n for c in counts for n in c))
    return {
        "per_request": per_request,
        "total_per_request": median(totals),
        "hit_ratio": {n: median([hit_ratio(c.get(n)) for c in counts]) for n in cached},
        "coalesced_share": {n: median([c[n]["coalesced"] / max(c[n]["hits"] + c[n]["misses"] + c[n]["coalesced"], 1)
                                       for c in counts if n in c]) for n in cached},
        "stale_served": {n: median([c[n]["stale"] for c in counts if n in c]) for n in cached},
    }


def aggregate(variant: str, x: float, all_runs: list[dict]) -> dict:
    # Runs during which other processes on this shared machine used noticeable CPU are kept and
    # flagged; the medians use the undisturbed ones when there are any.
    clean = [r for r in all_runs if not dig(r, "conditions", "disturbed")]
    runs = clean or all_runs

    def med(*path):
        return median([dig(r, *path) for r in runs])

    first = runs[0]
    non_2xx: dict[str, int] = {}
    socket: dict[str, int] = {}
    for run in runs:
        for status, count in run["errors"]["non_2xx_by_status"].items():
            non_2xx[status] = non_2xx.get(status, 0) + count
        for kind, count in run["errors"]["socket"].items():
            if count:
                socket[kind] = socket.get(kind, 0) + count
    server = first["server"]["name"]
    process_names = list(dict.fromkeys(name for r in runs for name in r.get("processes", {})))
    row = {
        "variant": variant,
        "x_name": first["x"]["name"],
        "x": x,
        "runs": len(runs),
        "runs_recorded": len(all_runs),
        "runs_disturbed": len(all_runs) - len(clean),
        "other_cpu_cores": median([dig(r, "processes", "other", "cpu_util") for r in runs]),
        "connections": first["config"]["connections"],
        "duration_s": first["config"]["duration_s"],
        "ok_rps": med("ok_rps"),
        "ok_rps_all": [r["ok_rps"] for r in runs],
        "rps": med("rps"),
        "limit_rps": first["limit"]["rps"],
        "limit_basis": first["limit"]["basis"],
        "efficiency": med("efficiency"),
        "latency_ms": {k: med("latency_ms", k) for k in ("p50", "p90", "p99", "p99.9", "max")},
        "p99_all": [dig(r, "latency_ms", "p99") for r in runs],
        "requests_total": sum(r["requests"] for r in runs),
        "non_2xx_total": non_2xx,
        "socket_errors_total": socket,
        "server_cpu_ms_per_request": med("server", "cpu_s_per_1000_requests"),
        "peak_rss_mb": med("server", "peak_rss_mb"),
        "rss_before_load_mb": med("server", "rss_before_load_mb"),
        "rss_growth_per_connection_kib": med("server", "rss_growth_per_connection_kib"),
        "server_per_request": {k: med("server", "per_request", k)
                               for k in ("user_ms", "system_ms", "voluntary_switches", "involuntary_switches")},
        "process_cpu_util": {name: med("processes", name, "cpu_util") for name in process_names},
        "cores_busy": {core: med("cores_busy", core) for core in sorted(first.get("cores_busy", {}))},
        "limiting_resource": limiting_resource(sorted(runs, key=lambda r: r["ok_rps"])[len(runs) // 2]),
        "config": first["config"],
    }
    calls = calls_aggregate(runs)
    if calls:
        row["downstream_calls"] = calls
    if any("probe" in r for r in runs):
        row["probe_latency_ms"] = {k: median([dig(r, "probe", "latency_ms", k) for r in runs]) for k in ("p50", "p99", "p99.9")}
        row["probe_ok_rps"] = median([dig(r, "probe", "ok_rps") for r in runs])
    if any(dig(r, "metrics", "scraped") for r in runs):
        m = "metrics"
        row["gateway_metrics"] = {
            "pool_wait_mean_ms": med(m, "tributary_db_pool_acquire_wait_seconds", "all", "mean_ms"),
            "pool_wait_p99_ms": bucket(runs, "tributary_db_pool_acquire_wait_seconds", "all"),
            "pool_waits": med(m, "tributary_db_pool_acquire_wait_seconds", "all", "count"),
            "pool_timeouts": median([sum(dig(r, m, "tributary_db_pool_acquire_timeouts_total", default={}).values()) for r in runs]),
            "db_query_p99_ms": bucket(runs, "tributary_db_query_duration_seconds", "recent_orders"),
            "server_2xx_p99_ms": bucket(runs, "http_server_request_duration_seconds", "200"),
            "server_503_count": med(m, "http_server_request_duration_seconds", "503", "count"),
            "server_503_p99_ms": bucket(runs, "http_server_request_duration_seconds", "503"),
            "server_503_le_1ms": med(m, "http_server_request_duration_seconds", "503", "fraction_le_1ms"),
            "admission_rejections": median([sum(dig(r, m, "tributary_admission_rejections_total", default={}).values()) for r in runs]),
            "gateway_overhead_p99_ms": bucket(runs, "tributary_fanout_gateway_overhead_seconds", "all"),
            "long_polls": median([sum(dig(r, m, "tributary_runtime_long_polls_total", default={}).values()) for r in runs]),
            "scheduling_lag_p99_ms": bucket(runs, "tributary_runtime_scheduling_lag_seconds", "all"),
            "admitted_over_1s": med(m, "http_server_request_duration_seconds", "200", "count_gt_1s"),
            "degraded_recent_orders": median([sum(v for k, v in dig(r, m, "tributary_fanout_degraded_total", default={}).items()
                                               if "part=recent_orders" in k) for r in runs]),
            "degraded_parts": median([sum(dig(r, m, "tributary_fanout_degraded_total", default={}).values()) for r in runs]),
            "pool_in_use_mean": med(m, "gauges_sampled", "pool_in_use", "mean"),
            "pool_waiters_mean": med(m, "gauges_sampled", "pool_waiters", "mean"),
            "active_requests_mean": med(m, "gauges_sampled", "active_requests", "mean"),
            "little_pool": median([little_pool(r) for r in runs]),
        }
    if any(dig(r, "non_2xx_latency_inferred") for r in runs):
        row["rejection_latency_ms"] = {
            k: median([dig(r, "non_2xx_latency_inferred", f"{k}_ms") for r in runs]) for k in ("p50", "p99", "p99.9")
        }
        row["rejection_latency_separable"] = all(dig(r, "non_2xx_latency_inferred", "separable") for r in runs)
    return row


def markdown(rows: list[dict], runs: list[dict], title: str, about: str, command: str) -> str:
    first = runs[0]
    machine = first.get("machine") or {}
    x_name = rows[0]["x_name"]
    out = [f"# {title}", ""]
    if about:
        out += [about.strip(), ""]
    dates = sorted(r["started_at"] for r in runs)
    loads = [r["conditions"]["load_average_before"][0] for r in runs]
    builds = sum(1 for r in runs if r["conditions"]["concurrent_builds"])
    disturbed = sum(1 for r in runs if dig(r, "conditions", "disturbed"))
    out += [
        f"- **Command:** `{command or first.get('command') or '?'}`",
        f"- **Machine:** {machine.get('nproc')} cores ({machine.get('cpu_model')}), {machine.get('mem_total_gib')} GiB, "
        f"{kernel(machine)}, {machine.get('os')}; {machine.get('rustc')}; {machine.get('wrk')}; "
        f"Postgres {machine.get('postgres')}; revision {revision(machine)}",
        f"- **Date:** {dates[0]} to {dates[-1]} (UTC); {len(runs)} runs; 1-min load average before a run: "
        f"median {statistics.median(loads):.2f}, max {max(loads):.2f}; runs that overlapped a compiler: {builds}; "
        f"runs flagged disturbed (other processes above the quiet threshold after the allowed retries): {disturbed}",
        f"- **Placement:** server under test on core 0 (`taskset -c 0`, one tokio worker); wrk on core "
        f"{first['config'].get('loadgen_cpus')}; the local Postgres on "
        f"{first['config'].get('postgres_cpus') or 'any core (unpinned: runs before 2026-12-04)'}; "
        f"other processes as listed in the resources table",
        f"- Figures are medians over repetitions (range in brackets), over the undisturbed repetitions when a "
        f"group has any. Efficiency = successful req/s ÷ limit. Latency is client-side (wrk, closed loop).",
        f"- The machine is shared with other work: before each run the lab waits for idle cores (and no compiler), "
        f"and a run in which processes outside the experiment used more than the quiet threshold of CPU is "
        f"repeated, then kept and flagged; the `other cores` column is that outside CPU.",
        "",
        "## Throughput and latency",
        "",
    ]
    has_probe = any("probe_latency_ms" in r for r in rows)
    has_rejections = any("rejection_latency_ms" in r for r in rows)
    header = ["variant", x_name, "runs × s", "ok req/s", "limit req/s", "efficiency", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "non-2xx", "socket errors"]
    if has_probe:
        header += ["probe p50 ms", "probe p99 ms", "probe p99.9 ms"]
    if has_rejections:
        header += ["non-2xx p50 ms (client)", "non-2xx p99 ms (client)", "non-2xx p99.9 ms (client)"]
    out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lat = r["latency_ms"]
        cells = [
            r["variant"], fmt(r["x"], 0),
            f"{r['runs']} × {r['duration_s']:g}" + (f" ({r['runs_disturbed']} disturbed)" if r["runs_disturbed"] else ""), fmt_range(r["ok_rps_all"]), fmt(r["limit_rps"], 0),
            pct(r["efficiency"]), fmt(lat["p50"], 1), fmt(lat["p90"], 1), fmt_range(r["p99_all"], 1), fmt(lat["p99.9"], 1),
            ", ".join(f"{k}: {v:,}" for k, v in r["non_2xx_total"].items()) or "0",
            ", ".join(f"{k}: {v:,}" for k, v in r["socket_errors_total"].items()) or "0",
        ]
        if has_probe:
            p = r.get("probe_latency_ms", {})
            cells += [fmt(p.get("p50"), 2), fmt(p.get("p99"), 2), fmt(p.get("p99.9"), 2)]
        if has_rejections:
            q = r.get("rejection_latency_ms", {})
            cells += [fmt(q.get("p50"), 2), fmt(q.get("p99"), 2), fmt(q.get("p99.9"), 2)]
        out.append("| " + " | ".join(cells) + " |")
    if has_rejections:
        out += ["", "Client-side latency of the non-2xx answers is read off wrk's distribution as its fastest "
                "share (the share of non-2xx answers); it is shown only when every non-2xx answer was faster than "
                "every 2xx one (checked per run), and is `–` otherwise."]
    bases = list(dict.fromkeys(r["limit_basis"] for r in rows))
    out += ["", "Limit: " + "; ".join(bases) + ".", "", "## Resources", ""]
    procs = list(dict.fromkeys(name for r in rows for name in r["process_cpu_util"]))
    # Runs recorded before the lab read the server's RSS ahead of the load have no growth column.
    growth = any(r.get("rss_growth_per_connection_kib") is not None for r in rows)
    header = ["variant", x_name, "server CPU ms/req (= s per 1,000 req)", "peak RSS MB"]
    header += ["RSS before load MB", "RSS growth per connection KiB"] if growth else []
    header += ["core 0 busy", "core 1 busy"]
    header += [f"{p} cores" for p in procs] + ["limiting resource"]
    out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [r["variant"], fmt(r["x"], 0), fmt(r["server_cpu_ms_per_request"], 3), fmt(r["peak_rss_mb"], 1)]
        if growth:
            cells += [fmt(r.get("rss_before_load_mb"), 1), fmt(r.get("rss_growth_per_connection_kib"), 1)]
        cells += [pct(r["cores_busy"].get("cpu0")), pct(r["cores_busy"].get("cpu1"))]
        cells += [fmt(r["process_cpu_util"].get(p), 2) for p in procs] + [r["limiting_resource"]]
        out.append("| " + " | ".join(cells) + " |")
    # Runs recorded before the lab split the server's CPU have no such table.
    if any(dig(r, "server_per_request", "user_ms") is not None for r in rows):
        out += ["", "The server's CPU per request split into user and system time, and its context switches per "
                "request summed over its threads (voluntary: a thread waited; involuntary: it was preempted on its "
                "core, also by the server's own other threads):", "",
                "| variant | " + x_name + " | user ms/req | system ms/req | voluntary switches/req | involuntary switches/req |",
                "|---|---|---|---|---|---|"]
        for r in rows:
            split = r.get("server_per_request") or {}
            out.append("| " + " | ".join([r["variant"], fmt(r["x"], 0), fmt(split.get("user_ms"), 3),
                                          fmt(split.get("system_ms"), 3), fmt(split.get("voluntary_switches"), 2),
                                          fmt(split.get("involuntary_switches"), 3)]) + " |")
    out += calls_table(rows, x_name)
    if any("gateway_metrics" in r for r in rows):
        out += ["", "## Gateway metrics (deltas of /metrics over the measured window)", ""]
        keys = [
            ("pool_wait_mean_ms", "pool acquire wait mean ms", 3), ("pool_wait_p99_ms", "pool acquire wait p99 bucket ms", 2),
            ("pool_timeouts", "pool acquire timeouts", 0), ("db_query_p99_ms", "recent_orders query p99 bucket ms", 2),
            ("server_2xx_p99_ms", "server-side 200 p99 bucket ms", 1), ("server_503_count", "503s", 0),
            ("server_503_p99_ms", "server-side 503 p99 bucket ms", 2), ("server_503_le_1ms", "503s answered ≤ 1 ms", None),
            ("admission_rejections", "admission rejections", 0), ("gateway_overhead_p99_ms", "fan-out overhead p99 bucket ms", 2),
            ("long_polls", "long polls", 0), ("scheduling_lag_p99_ms", "scheduling lag p99 bucket ms", 2),
            ("admitted_over_1s", "200s slower than 1 s", 0), ("degraded_recent_orders", "recent_orders degraded", 0),
            ("degraded_parts", "parts degraded", 0), ("active_requests_mean", "in flight (mean)", 0),
            ("pool_in_use_mean", "pool in use (mean, L)", 2), ("little_pool", "λ·W (Little)", 2),
            ("pool_waiters_mean", "pool waiters (mean)", 1),
        ]
        present = [k for k in keys if any(dig(r, "gateway_metrics", k[0]) is not None for r in rows)]
        header = ["variant", x_name] + [k[1] for k in present]
        out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for r in rows:
            cells = [r["variant"], fmt(r["x"], 0)]
            for key, _, digits in present:
                value = dig(r, "gateway_metrics", key)
                cells.append(pct(value) if digits is None else fmt(value, digits))
            out.append("| " + " | ".join(cells) + " |")
        out += ["", "Server-side p99s are given as the histogram bucket that holds them (e.g. `100–250` ms): "
                "that is all a Prometheus histogram knows. \"≤ 1 ms\" uses the request histogram's 1 ms bucket; "
                "λ·W is Little's law for the pool: recent_orders queries per second × their mean duration; "
                "in-flight and pool-in-use means are sampled from /metrics once a second."]
    out += baseline_comparison(rows, runs)
    out += ["", "![plot](plot.png)", "", "One JSON per run is in `runs/` (wrk command, per-process CPU, core "
            "busy fractions, RSS samples, metric deltas).", ""]
    return "\n".join(out)


def calls_table(rows: list[dict], x_name: str) -> list[str]:
    """Downstream calls per request and cache hit ratios, when the runs counted calls."""
    if not any("downstream_calls" in r for r in rows):
        return []
    names = list(dict.fromkeys(n for r in rows for n in dig(r, "downstream_calls", "per_request", default={})))
    cached = list(dict.fromkeys(n for r in rows for n in dig(r, "downstream_calls", "hit_ratio", default={})))
    header = ["variant", x_name] + [f"{n} calls/req" for n in names] + ["all calls/req"]
    header += [f"{n} hit ratio (coalesced)" for n in cached]
    out = ["", "## Downstream calls and cache", "",
           "Calls per request are the simulators' own counts (`/_sim/stats`, before and after the window) ÷ the "
           "requests answered in it; 1.00 is one call per dashboard, what no cache does. Hit ratio = hits ÷ lookups "
           "from the gateway's `tributary_cache_*` counters (a lookup is a hit, a miss that made the call, or a "
           "wait for a call another request made: the coalesced share in brackets); `–`: no cache on that service.",
           "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        c = r.get("downstream_calls") or {}
        cells = [r["variant"], fmt(r["x"], 0)]
        cells += [fmt(dig(c, "per_request", n), 3) for n in names] + [fmt(c.get("total_per_request"), 3)]
        for n in cached:
            ratio = dig(c, "hit_ratio", n)
            cells.append("–" if ratio is None else f"{ratio:.1%} ({dig(c, 'coalesced_share', n):.1%})")
        out.append("| " + " | ".join(cells) + " |")
    return out


def baseline_comparison(rows: list[dict], runs: list[dict]) -> list[str]:
    """Each variant against the `uninstrumented` baseline at the same x, when there is one: the ratio
    of the medians, and the median of the per-repetition ratios (repetitions alternate the variants,
    so repetition i of each was measured minutes apart: pairing them cancels slow drift).
    BENCH_BASELINE_VARIANT names another baseline (a scenario run with a subset of its variants)."""
    base_name = os.environ.get("BENCH_BASELINE_VARIANT") or "uninstrumented"
    if not any(r["variant"] == base_name for r in rows):
        return []
    def cpu(run):
        return dig(run, "server", "cpu_s_per_1000_requests")
    clean = [r for r in runs if not dig(r, "conditions", "disturbed")]
    by_key = {(r["variant"], r["x"]["value"], r["repetition"]): r for r in clean}
    out = ["", f"## Against the `{base_name}` baseline", "",
           "Ratios of each variant to the baseline at the same concurrency: of the medians, and (in brackets) "
           "the median of the per-repetition ratios with their range. Throughput below 1 and CPU above 1 are the "
           "cost of what the variant turns on.", "",
           "| variant | concurrency | ok req/s ratio | server CPU per request ratio | repetitions paired |",
           "|---|---|---|---|---|"]
    for r in rows:
        if r["variant"] == base_name:
            continue
        base = next((b for b in rows if b["variant"] == base_name and b["x"] == r["x"]), None)
        if not base or not base["ok_rps"] or not base["server_cpu_ms_per_request"]:
            continue
        pairs = [(by_key[(r["variant"], r["x"], rep)], by_key[(base_name, r["x"], rep)])
                 for (v, x, rep) in by_key if v == r["variant"] and x == r["x"] and (base_name, x, rep) in by_key]
        tput = [a["ok_rps"] / b["ok_rps"] for a, b in pairs if b["ok_rps"]]
        cpus = [cpu(a) / cpu(b) for a, b in pairs if cpu(a) and cpu(b)]
        def cell(med_ratio, paired):
            text = f"{med_ratio:.3f}"
            if paired:
                text += f" ({median(paired):.3f}; {min(paired):.3f}–{max(paired):.3f})"
            return text
        out.append("| " + " | ".join([
            r["variant"], fmt(r["x"], 0),
            cell(r["ok_rps"] / base["ok_rps"], tput),
            cell((r["server_cpu_ms_per_request"] or 0) / base["server_cpu_ms_per_request"], cpus),
            str(len(pairs)),
        ]) + " |")
    return out


def plot(rows: list[dict], path: Path, title: str, runs: list[dict]) -> None:
    plt = ensure_matplotlib()
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    xs = sorted({r["x"] for r in rows})
    has_probe = any("probe_latency_ms" in r for r in rows)
    panels = 3 if has_probe else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2))
    machine = runs[0].get("machine") or {}
    fig.suptitle(f"{title}\n{machine.get('nproc')} cores {machine.get('cpu_model')}, {runs[0]['started_at'][:10]}; "
                 f"medians of repetitions", fontsize=9)
    x_name = rows[0]["x_name"]
    if len(xs) > 1:
        for variant in variants:
            vr = [r for r in rows if r["variant"] == variant]
            x = [r["x"] for r in vr]
            line, = axes[0].plot(x, [r["ok_rps"] for r in vr], marker="o", label=f"{variant}: successful")
            if any(r["rps"] and r["rps"] > 1.05 * (r["ok_rps"] or 0) for r in vr):
                axes[0].plot(x, [r["rps"] for r in vr], marker=".", linestyle="--", color=line.get_color(),
                             alpha=0.7, label=f"{variant}: all answers (incl. errors)")
            axes[0].plot(x, [r["limit_rps"] for r in vr], linestyle=":", color=line.get_color(), alpha=0.6)
            axes[1].plot(x, [r["latency_ms"]["p99"] for r in vr], marker="o", color=line.get_color(), label=f"{variant} p99")
            axes[1].plot(x, [r["latency_ms"]["p50"] for r in vr], marker=".", linestyle="--", color=line.get_color(), label=f"{variant} p50")
            if has_probe:
                axes[2].plot(x, [dig(r, "probe_latency_ms", "p99") for r in vr], marker="o", color=line.get_color(), label=f"{variant}")
        for ax in axes:
            if max(xs) / max(min(xs), 1e-9) >= 10:
                ax.set_xscale("log")
            ax.set_xlabel(x_name)
        limits = [r["limit_rps"] for r in rows if r["limit_rps"]]
        measured = [r["ok_rps"] for r in rows if r["ok_rps"]]
        if limits and measured and max(limits) / max(min(measured), 1) >= 20:
            axes[0].set_yscale("log")
        axes[0].set_title("successful req/s (dotted: Little's-law limit)", fontsize=9)
    else:
        import numpy as np

        idx = np.arange(len(rows))
        labels = [r["variant"] for r in rows]
        axes[0].bar(idx, [r["ok_rps"] for r in rows], color="tab:blue", label="measured")
        axes[0].scatter(idx, [r["limit_rps"] for r in rows], marker="_", s=600, color="black", label="limit", zorder=3)
        axes[0].set_xticks(idx, labels, rotation=20)
        axes[0].set_title(f"successful req/s vs limit ({x_name} {xs[0]:g})", fontsize=9)
        width = 0.27
        for i, key in enumerate(("p50", "p99", "p99.9")):
            axes[1].bar(idx + (i - 1) * width, [r["latency_ms"][key] or 0 for r in rows], width, label=key)
        axes[1].set_xticks(idx, labels, rotation=20)
        if has_probe:
            for i, key in enumerate(("p50", "p99", "p99.9")):
                axes[2].bar(idx + (i - 1) * width, [dig(r, "probe_latency_ms", key) or 0 for r in rows], width, label=key)
            axes[2].set_xticks(idx, labels, rotation=20)
    axes[1].set_yscale("log")
    axes[1].set_ylabel("ms")
    axes[1].set_title("client latency of all answers, errors included (log scale)", fontsize=9)
    if has_probe:
        axes[2].set_yscale("log")
        axes[2].set_ylabel("ms")
        axes[2].set_title("light probe latency during the load (log)", fontsize=9)
    for ax in axes:
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_counts(instructions: str, syscalls: str) -> dict:
    """The figures of `bench/profile instructions` and `bench/profile syscalls` from their output."""
    def number(text):
        return float(text.replace(",", ""))

    counts: dict = {}
    m = re.search(r"--- instructions \(served\): (\d+) answers in (\d+) s under callgrind, ([\d,]+) instructions, ([\d,]+) per answer",
                  instructions)
    if m:
        counts["instructions"] = {"answers": int(m.group(1)), "window_s": int(m.group(2)),
                                  "per_answer": number(m.group(4))}
        m = re.search(r"in the server's service future: ([\d,]+) per answer", instructions)
        if m:
            counts["instructions"]["service_future_per_answer"] = number(m.group(1))
        m = re.search(r"idle, no load: ([\d,]+) instructions a second; per answer less that: ([\d,]+)", instructions)
        if m:
            counts["instructions"]["idle_per_second"] = number(m.group(1))
            counts["instructions"]["per_answer_less_idle"] = number(m.group(2))
    allocs = {fn: number(n) for n, fn in re.findall(r"^ *[\d,]+ calls +([\d,.]+) per answer +(\S+)$", instructions, re.M)}
    if allocs:
        counts["allocations_per_answer"] = allocs.get("mi_malloc_aligned", 0) + allocs.get("mi_zalloc_aligned", 0)
        counts["reallocations_per_answer"] = allocs.get("mi_realloc_aligned", 0)
    m = re.search(r"--- syscalls \(served\): (\d+) answers in (\d+) s \(perf trace attached\), ([\d,]+) system calls, ([\d.]+) per answer",
                  syscalls)
    if m:
        counts["syscalls"] = {"answers": int(m.group(1)), "window_s": int(m.group(2)), "per_answer": number(m.group(4)),
                              "by_call": {name: number(per) for name, _, per in
                                          re.findall(r"^(\w+) +([\d,]+) +([\d.]+) per answer$", syscalls, re.M)}}
    return counts


def counts_section(counts: dict) -> list[str]:
    out = ["", "## Counts per answer", "",
           "Counts, not times: the VM's speed of the minute does not move them, so two builds or two machines "
           "compare. `bench/profile instructions` (callgrind: 30 s of 4 connections after a warm-up; the whole "
           "process, so the time-driven threads, slowed ~50× under valgrind, are over-weighted) and "
           "`bench/profile syscalls` (perf trace: 10 s of this scenario's load), run after the measured "
           "repetitions on the same binaries.", "",
           "| instructions per answer | in the server's service future | allocations per answer | reallocations | system calls per answer | of which |",
           "|---:|---:|---:|---:|---:|---|"]
    sys_ = counts.get("syscalls") or {}
    top = ", ".join(f"{name} {per:.2f}" for name, per in list(sys_.get("by_call", {}).items())[:4])
    ins = counts.get("instructions") or {}
    out.append("| " + " | ".join([fmt(ins.get("per_answer"), 0), fmt(ins.get("service_future_per_answer"), 0),
                                   fmt(counts.get("allocations_per_answer"), 1), fmt(counts.get("reallocations_per_answer"), 1),
                                   fmt(sys_.get("per_answer"), 2), top or "–"]) + " |")
    # Runs counted before the idle window was added have no such figures.
    if "per_answer_less_idle" in ins:
        out += ["", f"With no load at all the gateway runs {fmt(ins['idle_per_second'], 0)} instructions a second on its own "
                f"(the overload probe every 2 ms, timers, parking), counted over an idle window as long as the loaded one. "
                f"Under callgrind that weighs ~100× more per answer than at the lab's rates; per answer less that: "
                f"**{fmt(ins['per_answer_less_idle'], 0)}**."]
    return out


def counts_json(args) -> None:
    print(json.dumps(parse_counts(Path(args.instructions).read_text(), Path(args.syscalls).read_text()), indent=2))


def scenario(args) -> None:
    directory = Path(args.dir)
    runs = load_runs(directory)
    rows = [aggregate(v, x, rs) for v, x, rs in group_runs(runs)]
    about = Path(args.about).read_text() if args.about and Path(args.about).exists() else ""
    report = markdown(rows, runs, args.title, about, args.command)
    # A scenario that counted (seed-baseline) leaves counts.json beside its runs.
    counted = json.loads((directory / "counts.json").read_text()) if (directory / "counts.json").exists() else None
    if counted:
        report = report.rstrip("\n") + "\n" + "\n".join(counts_section(counted)) + "\n"
    (directory / "report.md").write_text(report)
    plot(rows, directory / "plot.png", args.title, runs)
    summary = {"scenario": runs[0]["scenario"], "title": args.title, "command": args.command,
               "date": sorted(r["started_at"] for r in runs)[-1], "rows": rows}
    (directory / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {directory / 'report.md'} and {directory / 'plot.png'}")


def summary_table(args) -> None:
    results = Path(args.results)
    out = ["# Benchmark results: headline table", "",
           "Generated by `bench/lib/report.py summary` from each scenario's `summary.json`; "
           "medians over repetitions. Each scenario's `report.md` has the full tables, the machine and the command.", ""]
    order = ["seed-baseline", "sweep", "overload", "overload-curve", "cpu", "mixed", "pinning", "pool", "instrumentation",
             "caching", "caching-spike"]
    found = sorted(results.glob("*/summary.json"), key=lambda p: order.index(p.parent.name) if p.parent.name in order else 99)
    header = ["scenario", "variant", "x", "runs used (disturbed)", "ok req/s", "limit", "efficiency", "p50 ms", "p99 ms", "p99.9 ms",
              "probe p99 ms", "server CPU ms/req", "peak RSS MB", "downstream calls/req", "errors", "limiting resource"]
    out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for path in found:
        data = json.loads(path.read_text())
        for r in data["rows"]:
            errors = {**r["non_2xx_total"], **r["socket_errors_total"]}
            out.append("| " + " | ".join([
                f"[{data['scenario']}]({path.parent.name}/report.md)", r["variant"], f"{r['x_name']} {r['x']:g}",
                f"{r['runs']} ({r.get('runs_disturbed', 0)})",
                fmt(r["ok_rps"], 0), fmt(r["limit_rps"], 0), pct(r["efficiency"]), fmt(r["latency_ms"]["p50"], 1),
                fmt(r["latency_ms"]["p99"], 1), fmt(r["latency_ms"]["p99.9"], 1),
                fmt(dig(r, "probe_latency_ms", "p99"), 2), fmt(r["server_cpu_ms_per_request"], 3), fmt(r["peak_rss_mb"], 1),
                fmt(dig(r, "downstream_calls", "total_per_request"), 2),
                ", ".join(f"{k}: {v:,}" for k, v in errors.items()) or "0", r["limiting_resource"],
            ]) + " |")
    out.append("")
    (results / "SUMMARY.md").write_text("\n".join(out))
    print(f"wrote {results / 'SUMMARY.md'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("scenario")
    s.add_argument("dir")
    s.add_argument("--title", required=True)
    s.add_argument("--about")
    s.add_argument("--command", default="")
    s.set_defaults(func=scenario)
    c = sub.add_parser("counts", help="the figures of bench/profile instructions and syscalls, as JSON")
    c.add_argument("instructions")
    c.add_argument("syscalls")
    c.set_defaults(func=counts_json)
    t = sub.add_parser("summary")
    t.add_argument("results")
    t.set_defaults(func=summary_table)
    args = ap.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
