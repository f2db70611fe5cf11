#!/usr/bin/env python3
"""Report of the caching-spike scenario: goodput and downstream calls over a load spike.

    spike.py DIR [--about FILE] [--command CMD]
        reads DIR/runs/*.json, writes DIR/report.md, DIR/plot.png and DIR/summary.json (rows in
        report.py's format, for SUMMARY.md)

Each run is one closed loop from examples/loadgen.rs that steps from its base connections to
`spike.to` connections `spike.at_s` seconds into the measured window, for `spike.for_s` seconds,
and back. The window is cut into three phases at those times: before, spike, after. Per phase:

* goodput = full (non-degraded) 200s per second, from the loadgen's per-second series (by the
  second an answer arrived);
* downstream calls per second, per downstream, from the simulators' counters sampled once a
  second (measure.py --sim-stats with --gauge-series): the difference of the cumulative
  counts from the sample one second into the phase to the sample at its end, over the time
  between them. The two clocks start within milliseconds of each other (when the loadgen prints
  LOADGEN_MEASURING); the first second of each phase is left out of the calls (the step's own
  connects and the first misses fall there) but not out of the goodput (whole seconds).

"flat" is calls/s during the spike ÷ calls/s before it: 1.0 means the spike did not reach the
downstream at all. Nothing here measures anything: it only reads what measure.py recorded.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402  (the lab's shared helpers: aggregate, dig, fmt, matplotlib)

dig, fmt, median = report.dig, report.fmt, report.median
PHASES = ("before", "spike", "after")


def phase_bounds(run: dict) -> dict[str, tuple[float, float]]:
    spike = dig(run, "loadgen", "spike") or {}
    at, length = spike.get("at_s", 0.0), spike.get("for_s", 0.0)
    end = run["duration_s"]
    return {"before": (0.0, at), "spike": (at, at + length), "after": (at + length, end)}


def goodput(run: dict, lo: float, hi: float) -> dict[str, float | None]:
    """Mean per-second outcomes over the whole seconds in [lo, hi)."""
    series = dig(run, "loadgen", "series", default=[])
    seconds = [s for i, s in enumerate(series) if lo <= i and i + 1 <= hi + 1e-9]
    if not seconds:
        return {"full": None, "degraded": None, "rejected": None, "errors": None, "open_max": None}
    n = len(seconds)
    return {
        "full": sum(s["full"] for s in seconds) / n,
        "degraded": sum(s["degraded"] for s in seconds) / n,
        "rejected": sum(s["rejected"] for s in seconds) / n,
        "errors": sum(s["errors"] + s["other"] for s in seconds) / n,
        "open_max": max(s["open_max"] for s in seconds),
    }


def call_rates(run: dict, lo: float, hi: float) -> dict[str, float | None]:
    """Calls per second per downstream from the sample one second into [lo, hi) to the last
    sample in it (samples are taken on a 1 s schedule, a few milliseconds late)."""
    samples = run.get("downstream_calls_series") or []
    names = list((run.get("downstream_calls") or {}).keys())
    start = [s for s in samples if s["t"] <= lo + 1.5]
    inside = [s for s in samples if s["t"] <= hi + 0.5]
    if not start or not inside or inside[-1]["t"] - start[-1]["t"] < 0.5:
        return {n: None for n in names}
    a, b = start[-1], inside[-1]
    dt = b["t"] - a["t"]
    return {n: (b[n] - a[n]) / dt if a.get(n) is not None and b.get(n) is not None else None for n in names}


def phases(run: dict) -> dict[str, dict]:
    result = {}
    for name, (lo, hi) in phase_bounds(run).items():
        rates = call_rates(run, lo, hi)
        known = [v for v in rates.values() if v is not None]
        result[name] = {**goodput(run, lo, hi), "calls": rates, "calls_all": sum(known) if known else None}
    return result


def aggregate(variant: str, runs: list[dict]) -> dict:
    clean = [r for r in runs if not dig(r, "conditions", "disturbed")] or runs
    per_run = [phases(r) for r in clean]
    names = list(dict.fromkeys(n for r in clean for n in (r.get("downstream_calls") or {})))
    table = {}
    for phase in PHASES:
        rows = [p[phase] for p in per_run]
        table[phase] = {
            **{k: median([r[k] for r in rows]) for k in ("full", "degraded", "rejected", "errors", "open_max", "calls_all")},
            "calls": {n: median([r["calls"].get(n) for r in rows]) for n in names},
        }
    counts = [report.cache_counts(r) for r in clean]
    cached = list(dict.fromkeys(n for c in counts for n in c))
    return {
        "variant": variant,
        "runs": len(clean),
        "runs_recorded": len(runs),
        "phases": table,
        "downstreams": names,
        "hit_ratio": {n: median([report.hit_ratio(c.get(n)) for c in counts]) for n in cached},
        "cpu_ms_per_request": median([dig(r, "server", "cpu_s_per_1000_requests") for r in clean]),
        "peak_rss_mb": median([dig(r, "server", "peak_rss_mb") for r in clean]),
        "full_p99_ms": median([dig(r, "latency_ms", "p99") for r in clean]),
        "breaker_opens": median([sum(v for k, v in dig(r, "metrics", "tributary_downstream_circuit_transitions_total",
                                                        default={}).items() if "to=open" in k) for r in clean]),
    }


def ratio(a, b):
    return None if a is None or not b else a / b


def markdown(rows: list[dict], runs: list[dict], about: str, command: str) -> str:
    first = runs[0]
    machine = first.get("machine") or {}
    spike = dig(first, "loadgen", "spike") or {}
    base = first["config"]["connections"]
    dates = sorted(r["started_at"] for r in runs)
    disturbed = sum(1 for r in runs if dig(r, "conditions", "disturbed"))
    out = ["# caching-spike: goodput and downstream calls over a load spike, without and with the cache", ""]
    if about:
        out += [about.strip(), ""]
    out += [
        f"- **Command:** `{command or first.get('command') or '?'}`",
        f"- **Machine:** {machine.get('nproc')} cores ({machine.get('cpu_model')}), {report.kernel(machine)}, "
        f"{machine.get('os')}; {machine.get('rustc')}; Postgres {machine.get('postgres')}; revision {report.revision(machine)}",
        f"- **Date:** {dates[0]} to {dates[-1]} (UTC); {len(runs)} runs, {disturbed} flagged disturbed",
        f"- **Load:** closed loop, {base} connections, {spike.get('to')} from {spike.get('at_s'):g} s to "
        f"{spike.get('at_s', 0) + spike.get('for_s', 0):g} s of a {first['duration_s']:.0f} s window "
        f"(after {first['config'].get('warmup_s'):g} s of warm-up at {base}); user ids Zipf, s = "
        f"{first['config'].get('zipf_s', '?')}",
        "- Figures are medians over repetitions (the undisturbed ones when there are any); rates are per second.",
        "",
        "## Per phase",
        "",
    ]
    names = rows[0]["downstreams"] if rows else []
    header = ["variant", "phase", "connections (max open)", "full 200/s", "degraded/s", "503+429/s",
              "other status + socket errors/s"]
    header += [f"{n} calls/s" for n in names] + ["all calls/s", "calls per full 200"]
    out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        for phase in PHASES:
            p = r["phases"][phase]
            cells = [r["variant"], phase, fmt(p["open_max"], 0), fmt(p["full"], 0), fmt(p["degraded"], 0),
                     fmt(p["rejected"], 0), fmt(p["errors"], 1)]
            cells += [fmt(p["calls"].get(n), 0) for n in names]
            cells += [fmt(p["calls_all"], 0), fmt(ratio(p["calls_all"], p["full"]), 2)]
            out.append("| " + " | ".join(cells) + " |")
    out += ["", "## Over the spike", "",
            "`flat` = calls/s during the spike ÷ calls/s before it (1.0: the spike never reached that downstream); "
            "goodput kept = full 200/s during the spike ÷ before it. Hit ratio over the whole window "
            "(hits ÷ lookups, `tributary_cache_*`).", ""]
    header = ["variant", "goodput kept", "all calls flat"] + [f"{n} flat" for n in names]
    cached = list(dict.fromkeys(n for r in rows for n in r["hit_ratio"]))
    header += [f"{n} hit ratio" for n in cached]
    header += ["full-200 p99 ms (window)", "server CPU ms/req", "peak RSS MB", "breakers opened"]
    out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        b, s = r["phases"]["before"], r["phases"]["spike"]
        cells = [r["variant"], fmt(ratio(s["full"], b["full"]), 2), fmt(ratio(s["calls_all"], b["calls_all"]), 2)]
        cells += [fmt(ratio(s["calls"].get(n), b["calls"].get(n)), 2) for n in names]
        cells += ["–" if r["hit_ratio"].get(n) is None else f"{r['hit_ratio'][n]:.1%}" for n in cached]
        cells += [fmt(r["full_p99_ms"], 1), fmt(r["cpu_ms_per_request"], 3), fmt(r["peak_rss_mb"], 1),
                  fmt(r["breaker_opens"], 0)]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "![plot](plot.png)", "", "One JSON per run is in `runs/` (the loadgen's per-second series under "
            "`loadgen.series`, the simulators' cumulative counts under `downstream_calls_series`).", ""]
    return "\n".join(out)


def plot(runs: list[dict], path: Path) -> None:
    plt = report.ensure_matplotlib()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    # The services that have a cache in any run: their calls are drawn dashed, in both variants.
    cached = sorted({n for run in runs for n in report.cache_counts(run)})
    colours = {}
    for run in runs:
        variant = run["variant"]
        colour = colours.setdefault(variant, f"C{len(colours)}")
        label = f"{variant} r{run['repetition']}"
        series = dig(run, "loadgen", "series", default=[])
        axes[0].plot([i + 0.5 for i in range(len(series))], [s["full"] for s in series], color=colour,
                     alpha=0.8, label=label)
        samples = run.get("downstream_calls_series") or []
        names = list((run.get("downstream_calls") or {}).keys())
        t, rate, rate_cached = [], [], []
        for a, b in zip(samples, samples[1:]):
            dt = b["t"] - a["t"]
            if dt > 0 and all(a.get(n) is not None and b.get(n) is not None for n in names):
                t.append((a["t"] + b["t"]) / 2)
                rate.append(sum(b[n] - a[n] for n in names) / dt)
                rate_cached.append(sum(b[n] - a[n] for n in names if n in cached) / dt)
        axes[1].plot(t, rate, color=colour, alpha=0.8, label=f"{label}: all five")
        if cached:
            axes[1].plot(t, rate_cached, color=colour, alpha=0.8, linestyle="--",
                         label=f"{label}: {', '.join(cached)}")
    first = runs[0]
    spike = dig(first, "loadgen", "spike") or {}
    for ax in axes:
        if spike:
            ax.axvspan(spike["at_s"], spike["at_s"] + spike["for_s"], color="grey", alpha=0.15,
                       label=f"spike: {spike['to']} connections")
        ax.set_xlabel("seconds into the measured window")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_title("goodput: full (non-degraded) 200s per second", fontsize=9)
    axes[0].set_ylabel("per second")
    axes[1].set_title("downstream calls per second (dashed: the services the cached variant caches)", fontsize=9)
    machine = first.get("machine") or {}
    fig.suptitle(f"caching-spike: {first['config']['connections']} → {spike.get('to')} connections; "
                 f"{machine.get('nproc')} cores {machine.get('cpu_model')}, {first['started_at'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--about")
    ap.add_argument("--command", default="")
    args = ap.parse_args()
    runs = report.load_runs(args.dir)
    variants = list(dict.fromkeys(r["variant"] for r in runs))
    rows = [aggregate(v, [r for r in runs if r["variant"] == v]) for v in variants]
    about = Path(args.about).read_text() if args.about and Path(args.about).exists() else ""
    (args.dir / "report.md").write_text(markdown(rows, runs, about, args.command))
    plot(runs, args.dir / "plot.png")
    # report.py's row format, so `report.py summary` can list the scenario; ok_rps is the
    # goodput over the whole window.
    summary_rows = []
    for v in variants:
        group = [r for r in runs if r["variant"] == v]
        row = report.aggregate(v, group[0]["x"]["value"], group)
        row["ok_rps"] = median([dig(r, "goodput", "full_rps") for r in group])
        summary_rows.append(row)
    summary = {"scenario": runs[0]["scenario"], "title": "caching-spike", "command": args.command,
               "date": sorted(r["started_at"] for r in runs)[-1], "phases": rows, "rows": summary_rows}
    (args.dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.dir / 'report.md'} and {args.dir / 'plot.png'}")


if __name__ == "__main__":
    main()
