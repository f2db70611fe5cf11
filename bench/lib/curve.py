#!/usr/bin/env python3
"""Report of the overload-curve scenario: goodput against offered load, with the checks.

    curve.py DIR [--about FILE] [--command CMD]
        reads DIR/runs/*.json and DIR/calibration/capacity.json, writes DIR/report.md,
        DIR/plot.png and DIR/summary.json (rows in report.py's format, for SUMMARY.md)

Every figure comes from the run JSONs that bench/lib/measure.py wrote with --loadgen; nothing
here measures anything. Metric families a build does not export (breaker transitions, the
admission limit, shedding) are reported as "–" and the checks fall back as documented below.

Definitions:

* x = offered load ÷ capacity. Open loop: the scheduled rate ÷ capacity. Closed loop and
  Retry-After: connections ÷ W0 ÷ capacity (what the connections would ask for if every answer
  took the unloaded latency W0; Little's law). Capacity and W0 come from the calibration runs
  (or BENCH_CAPACITY_RPS / BENCH_CAPACITY_LATENCY_MS).
* goodput = full (non-degraded) 200s per second; peak = the larger of the capacity and the
  configuration's best goodput in any run.
* reference = the mean full-200 rate of the reference runs just before and after the point (the
  shipped defaults at the calibration's best load; DIR/reference/): the machine's capacity at that
  moment, which on a shared VM drifts by 10-40 % over a run. The goodput check is made against
  the peak and, in its own column, against the reference; an open-loop point is judged against
  the lesser of its reference and the rate the load generator really sent (`reachable`): a
  gateway cannot serve more than arrives, and at 1× the schedule is the calibration's capacity,
  which the machine may have outrun by the time the point runs (a closed loop's sent rate
  follows the gateway's own speed, so it is not a bound there).
* half-load p99 = the configuration's client-side p99 of full 200s at its open-loop 0.5× point;
  the server-side check sets the gateway's own p99 of 200s (its request histogram, interpolated
  within the bucket that holds it) beside the same at half load: what the gateway added, without
  the load generator's own delays on a busy core. Until 2026-12-07 the histogram had no bucket
  between 100 and 250 ms, and this check could not tell 105 ms from 240 ms.
* CPU per rejection is fitted per configuration: gateway CPU = a × other answers + b × rejections
  by least squares over its saturated points (the gateway using ≥ 80 % of its core, so a served
  request costs about the same at each; an unsaturated one costs more, its wake-ups not batched),
  when they are at least three and their rejection shares span at least 20 points; b ÷ a is the
  check, and each point shows b × its rejections ÷ its CPU, the share of the gateway's CPU its
  rejections took. A two-cost model over runs, not a measurement of the rejection path alone
  (bench/profile rejections is). Until 2026-12-05 it was one point's CPU minus its 200s at the
  least-rejecting point's cost per request, ÷ its rejections: at points with few rejections that
  divided noise by a small number (5.5× a request at 67 rejections a second), and the
  least-rejecting point was unsaturated, its requests dearer.
* breaker opened = tributary_downstream_circuit_transitions_total{to="open"} grew, when the
  family exists; otherwise a sampled tributary_downstream_circuit_state reached 2 (open) or an
  answer was short-circuited (downstream outcome circuit_open).
* readiness flaps = times /readyz (polled once a second; else tributary_admission_shedding, 1
  while readiness is false) turned from ready to not ready in the once-a-second samples.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402  (the lab's shared helpers: aggregate, dig, fmt, matplotlib)

dig, fmt, pct = report.dig, report.fmt, report.pct
SHAPES = ["closed", "open", "retry-after"]
SHAPE_TITLES = {"closed": "closed loop (retry at once)", "open": "open loop (fixed arrival rate)",
                "retry-after": "closed loop honouring Retry-After"}
CONFIGS = ["none", "reports", "capacity", "default"]


def series_changes(series: list[dict], key: str) -> tuple[int, float | None]:
    """(0→1 transitions, max) of a sampled 0/1 gauge; (0, None) when the family is absent."""
    values = [s[key] for s in series if key in s]
    if not values:
        return 0, None
    rises = sum(1 for a, b in zip(values, values[1:]) if a < 0.5 <= b)
    return rises + (1 if values[0] >= 0.5 else 0), max(values)


def point(run: dict, capacity: float, w0_ms: float) -> dict:
    cfg = run["config"]
    shape = cfg.get("shape", "closed")
    conns = cfg["connections"]
    rate = cfg.get("rate")
    if shape == "open":
        x, label = rate / capacity, f"{rate:,.0f}/s"
    else:
        x, label = conns / (w0_ms / 1000) / capacity, f"{conns:,} conn."
    lg = run["loadgen"]
    m = run.get("metrics") or {}
    series = m.get("gauge_series") or []
    http = m.get("http_server_request_duration_seconds") or {}
    transitions = m.get("tributary_downstream_circuit_transitions_total")
    if transitions is not None:
        opens = sum(v for k, v in transitions.items() if "to=open" in k)
        opens_basis = "transitions"
    else:
        sampled = max([s.get("circuits_open", 0) for s in series] or [0])
        opens = int(sampled)
        opens_basis = "sampled state"
    circuit_open_answers = sum(v for k, v in (m.get("tributary_downstream_requests_total") or {}).items()
                               if "outcome=circuit_open" in k)
    # Readiness as polled on /readyz; the shedding gauge where a run has no such samples.
    flaps, shedding_max = series_changes(series, "not_ready")
    if shedding_max is None:
        flaps, shedding_max = series_changes(series, "admission_shedding")
    limits = [s["admission_limit_dashboard"] for s in series if "admission_limit_dashboard" in s]
    rejected = lg["outcomes"]["503"] + lg["outcomes"]["429"]
    cpu_s = dig(run, "server", "cpu_s")
    return {
        "config": cfg.get("config", run["variant"]), "shape": shape, "x": x, "label": label,
        "connections": conns, "rate": rate, "duration_s": run["duration_s"],
        "sent_rps": run["offered"]["sent_rps"], "unsent": run["offered"]["unsent_late"],
        "goodput": run["goodput"]["full_rps"], "degraded_rps": lg["outcomes"]["degraded"] / run["duration_s"],
        "rejected_503": lg["outcomes"]["503"], "rejected_429": lg["outcomes"]["429"],
        "rejected_rps": rejected / run["duration_s"], "other": lg["outcomes"]["other"],
        "other_status": {k: v for k, v in lg["status"].items() if k not in ("200", "503", "429")},
        "answered": lg["answered"], "ok_200": lg["outcomes"]["full"] + lg["outcomes"]["degraded"],
        "rejected": rejected,
        "p50": dig(lg, "latency_ms", "full", "p50"), "p99": dig(lg, "latency_ms", "full", "p99"),
        "server_p99": dig(http, "200", "p99_ms"), "server_p99_bucket": dig(http, "200", "p99_bucket_ms"),
        "rej_p99": dig(lg, "latency_ms", "rejected", "p99"),
        "server_rej_p99": dig(http, "503", "p99_ms"), "server_rej_bucket": dig(http, "503", "p99_bucket_ms"),
        "server_rej_le_1ms": dig(http, "503", "fraction_le_1ms"), "server_rej_count": dig(http, "503", "count"),
        "cpu_s": cpu_s, "cpu_ms_per_answer": dig(run, "server", "cpu_s_per_1000_requests"),
        "rss_mb": dig(run, "server", "peak_rss_mb"),
        "socket_errors": run["errors"]["socket_total"], "socket": run["errors"]["socket"],
        "breaker_opens": opens, "breaker_basis": opens_basis, "circuit_open_answers": circuit_open_answers,
        "flaps": flaps, "shedding_max": shedding_max,
        "limit_min": min(limits) if limits else None, "limit_max": max(limits) if limits else None,
        "limit_series": [(s["t"], s["admission_limit_dashboard"]) for s in series if "admission_limit_dashboard" in s],
        "retry_after_missing": dig(lg, "retry_after", "missing"),
        "loadgen_cores": dig(run, "processes", "loadgen", "cpu_util"),
        # The gateway's CPU allowance in cores: its CFS quota (BENCH_GATEWAY_CPU_QUOTA), else 1.
        "cpu_allowance": cfg.get("gateway_cpu_quota") or 1.0,
        "disturbed": bool(dig(run, "conditions", "disturbed")),
        "started_at": run["started_at"],
    }


FIT_MIN_UTILISATION = 0.8  # the gateway's share of its allowance (core or quota) to be in the fit
FIT_MIN_POINTS = 3
FIT_MIN_SPAN = 0.2  # of the rejection share, between the fit's points


def rejection_fit(ps: list[dict]) -> dict | None:
    """CPU = a × other answers + b × rejections (ms), least squares over the saturated points."""
    import numpy as np

    sat = [p for p in ps if p["cpu_s"] and p["answered"]
           and p["cpu_s"] / p["duration_s"] >= FIT_MIN_UTILISATION * p["cpu_allowance"]]
    shares = [p["rejected"] / p["answered"] for p in sat]
    if len(sat) < FIT_MIN_POINTS or max(shares) - min(shares) < FIT_MIN_SPAN:
        return None
    x = np.array([[p["answered"] - p["rejected"], p["rejected"]] for p in sat], dtype=float)
    y = np.array([p["cpu_s"] * 1000 for p in sat])
    (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
    if a <= 0 or b < 0:
        return None
    residual = float(np.max(np.abs(x @ np.array([a, b]) - y) / y))
    return {"a_ms": float(a), "b_ms": float(b), "ratio": float(b / a), "points": len(sat),
            "max_residual": residual}


def add_estimates(points: list[dict], capacity: float) -> dict[str, dict]:
    """Per configuration: peak, half-load p99, the rejection fit; per point: the rejections' CPU share."""
    per_config = {}
    for config in dict.fromkeys(p["config"] for p in points):
        ps = [p for p in points if p["config"] == config]
        half = [p for p in ps if p["shape"] == "open" and abs(p["x"] - 0.5) < 0.26]
        fit = rejection_fit(ps)
        per_config[config] = {
            "peak": max([capacity] + [p["goodput"] for p in ps]),
            "half_p99": half[0]["p99"] if half else None,
            "half_server_p99": half[0]["server_p99"] if half else None,
            "half_server_bucket": half[0]["server_p99_bucket"] if half else None,
            "rejection_fit": fit,
        }
        for p in ps:
            if fit and p["rejected"] and p["cpu_s"]:
                p["rejection_cpu_share"] = fit["b_ms"] * p["rejected"] / (p["cpu_s"] * 1000)
    return per_config


def load_references(directory: Path) -> list[tuple[str, float]]:
    """(start, full 200/s) of the reference runs: the shipped defaults at the calibration's best load,
    measured before each point and after the last (overload-curve.sh, `reference/`)."""
    refs = [json.loads(p.read_text()) for p in (directory / "reference").glob("*.json")]
    return sorted((r["started_at"], r["goodput"]["full_rps"]) for r in refs)


def attach_references(points: list[dict], refs: list[tuple[str, float]]) -> None:
    """Each point's reference: the mean of the reference runs just before and just after it; and
    what it is judged against (`reachable`): for an open loop, not more than was sent."""
    for p in points:
        before = [v for t, v in refs if t <= p["started_at"]][-1:]
        after = [v for t, v in refs if t > p["started_at"]][:1]
        near = before + after
        p["reference"] = sum(near) / len(near) if near else None
        p["reachable"] = reachable(p)


def reachable(p: dict) -> float | None:
    """The goodput a point could have had: its reference, or for an open loop the rate sent when
    that is less (the schedule below the machine's capacity at that moment)."""
    if p["reference"] is None:
        return None
    if p["shape"] == "open" and p["sent_rps"]:
        return min(p["reference"], p["sent_rps"])
    return p["reference"]


def verdict(values: list[bool | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "n/a"
    return "pass" if all(known) else "**FAIL**"


def checks(points: list[dict], per_config: dict) -> list[dict]:
    rows = []
    for config, est in per_config.items():
        for shape in SHAPES:
            ps = [p for p in points if p["config"] == config and p["shape"] == shape]
            if not ps:
                continue
            over = [p for p in ps if p["x"] >= 0.99 and (shape != "open" or p["x"] <= 20.01)]
            worst_goodput = min([p["goodput"] / est["peak"] for p in over], default=None)
            p99_ratio = [p["p99"] / est["half_p99"] for p in over if p["p99"] and est["half_p99"]]
            server_ratio = [p["server_p99"] / est["half_server_p99"] for p in over
                            if p["server_p99"] and est["half_server_p99"]]
            rej = [p for p in ps if (p["server_rej_count"] or 0) >= 100]
            fit = est["rejection_fit"]
            rows.append({
                "config": config, "shape": shape,
                "goodput": (verdict([p["goodput"] >= 0.9 * est["peak"] for p in over]),
                            f"min {pct(worst_goodput)} of peak {est['peak']:,.0f}" if worst_goodput is not None else "–"),
                "goodput_ref": (verdict([p["goodput"] >= 0.9 * p["reachable"] if p["reachable"] else None for p in over]),
                                f"min {pct(min(worst_ref))} of the references beside it"
                                if (worst_ref := [p["goodput"] / p["reachable"] for p in over if p["reachable"]])
                                else "no reference runs" if over else "–"),
                "p99": (verdict([r <= 2 for r in p99_ratio]),
                        f"max {max(p99_ratio):.1f}× (half load {fmt(est['half_p99'])} ms)" if p99_ratio else "–"),
                "p99_server": (("n/a", f"the half-load p99 is somewhere in {coarse[0]:g}–{coarse[1]:g} ms "
                                       "(a run before the histogram's 150–300 ms buckets)")
                               if (coarse := est["half_server_bucket"]) and coarse[1] and coarse[1] > 2 * coarse[0]
                               else (verdict([r <= 2 for r in server_ratio]),
                                     f"max {max(server_ratio):.1f}× (half load {fmt(est['half_server_p99'])} ms)"
                                     if server_ratio else "–")),
                "rejection_fast": (verdict([(p["server_rej_le_1ms"] or 0) >= 0.99 for p in rej]),
                                   f"min {pct(min(p['server_rej_le_1ms'] or 0 for p in rej))} ≤ 1 ms" if rej else "no rejections"),
                "rejection_cpu": (verdict([fit["ratio"] <= 0.1] if fit else []),
                                  f"{fit['ratio']:.0%} of a request: {fit['b_ms'] * 1000:.0f} µs against "
                                  f"{fit['a_ms'] * 1000:.0f} µs (fit over the configuration's {fit['points']} "
                                  f"saturated points, worst residual {fit['max_residual']:.0%})"
                                  if fit else "– (too few saturated points to fit)"),
                "breakers": (verdict([p["breaker_opens"] == 0 and p["circuit_open_answers"] == 0 for p in ps]),
                             f"{sum(p['breaker_opens'] for p in ps)} opens ({ps[0]['breaker_basis']}), "
                             f"{sum(p['circuit_open_answers'] for p in ps):,} short-circuited calls"),
                "readiness": (verdict([p["flaps"] == 0 if p["shedding_max"] is not None else None for p in ps]),
                              f"{sum(p['flaps'] for p in ps)} turns to unready"
                              if any(p["shedding_max"] is not None for p in ps) else "gauge absent"),
                "sockets": (verdict([p["socket_errors"] == 0 for p in ps]), f"{sum(p['socket_errors'] for p in ps):,}"),
            })
    return rows


CHECK_COLUMNS = [
    ("goodput", "goodput ≥ 90 % of peak, 1×–20×"),
    ("goodput_ref", "the same, against the peak measured beside each point (drift; an open loop: or its sent rate, if less)"),
    ("p99", "p99 of successes ≤ 2× half-load p99"),
    ("p99_server", "the same, server-side (200s, interpolated in their histogram bucket)"),
    ("rejection_fast", "server p99 of 503s < 1 ms"), ("rejection_cpu", "CPU per rejection ≤ 10 % (fit)"),
    ("breakers", "no breaker opened"), ("readiness", "no readiness flap"), ("sockets", "no socket errors"),
]


def allowance(run: dict) -> str:
    quota = run["config"].get("gateway_cpu_quota")
    if not quota:
        return "the whole core"
    return (f"held to {quota:g} of the core by a CFS quota ({quota * 100_000:,.0f} µs per 100 ms period, "
            "`BENCH_GATEWAY_CPU_QUOTA`)")


def markdown(points, per_config, check_rows, runs, calib, about, command) -> str:
    first = runs[0]
    machine = first.get("machine") or {}
    dates = sorted(r["started_at"] for r in runs)
    disturbed = sum(1 for p in points if p["disturbed"])
    # The scenario's description brings its own heading.
    out = [] if about.startswith("# ") else ["# overload-curve: goodput against offered load", ""]
    if about:
        out += [about.strip(), ""]
    out += [
        f"- **Command:** `{command or first.get('command') or '?'}`",
        f"- **Machine:** {machine.get('nproc')} cores ({machine.get('cpu_model')}), {machine.get('mem_total_gib')} GiB, "
        f"{report.kernel(machine)}, {machine.get('os')}; {machine.get('rustc')}; Postgres {machine.get('postgres')}; "
        f"revision {report.revision(machine)}",
        f"- **Date:** {dates[0]} to {dates[-1]} (UTC); {len(runs)} runs of {first['config']['duration_s']:g} s after "
        f"{first['config']['warmup_s']:g} s of warm-up; runs flagged disturbed: {disturbed}",
        f"- **Placement:** the gateway on core 0 with one worker, {allowance(first)}; load generator, simulators "
        f"and the local Postgres ({first['config'].get('postgres_cpus') or 'unpinned'}) on core "
        f"{first['config'].get('loadgen_cpus')}",
        f"- **Capacity:** {calib['capacity_rps']:,.0f} full-200 req/s ({calib['basis']}); unloaded latency "
        f"W0 = {calib['w0_ms']:.1f} ms; `{calib['capacity_command']}` recommends "
        f"`max_in_flight = {calib['capacity_admission_limit']}` (the `capacity` configuration)",
        "",
        "## Checks (the targets; measured, never asserted)",
        "",
        "| configuration | shape | " + " | ".join(c[1] for c in CHECK_COLUMNS) + " |",
        "|" + "---|" * (2 + len(CHECK_COLUMNS)),
    ]
    for row in check_rows:
        out.append(f"| {row['config']} | {row['shape']} | "
                   + " | ".join(f"{row[k][0]}: {row[k][1]}" for k, _ in CHECK_COLUMNS) + " |")
    rss_10k = [p for p in points if p["connections"] >= 10_000 and p["shape"] == "closed"]
    if rss_10k:
        out += ["", "Peak RSS at 10,000 connections: "
                + ", ".join(f"{p['config']} {fmt(p['rss_mb'])} MB" for p in rss_10k) + "."]
    out += ["", "## Every point", "",
            "| configuration | shape | load | × capacity | sent/s | unsent (late) | **full 200/s** | of peak | "
            "reference full 200/s | of reference (open loop: or of sent/s, if less) | "
            "degraded/s | 503+429/s | other statuses | full 200 p50 / p99 ms (client) | 200 p99 ms (server) | rejection p99 ms "
            "(client) | 503 p99 bucket ms (server) | 503s ≤ 1 ms | CPU ms/answer | CPU to rejections (fit) | "
            "peak RSS MB | socket errors | breaker opens | short-circuited calls | unready turns | admission limit "
            "(dashboard) min–max | loadgen cores |",
            "|" + "---|" * 27]
    for p in points:
        est = per_config[p["config"]]
        bucket = p["server_rej_bucket"]
        out.append("| " + " | ".join([
            p["config"], p["shape"], p["label"], f"{p['x']:.2g}", fmt(p["sent_rps"], 0), f"{p['unsent']:,}",
            f"**{fmt(p['goodput'], 0)}**", pct(p["goodput"] / est["peak"]), fmt(p["reference"], 0),
            pct(p["goodput"] / p["reachable"]) if p["reachable"] else "–", fmt(p["degraded_rps"], 0),
            fmt(p["rejected_rps"], 0), ", ".join(f"{k}: {v:,}" for k, v in p["other_status"].items()) or "0",
            f"{fmt(p['p50'])} / {fmt(p['p99'])}", fmt(p["server_p99"]), fmt(p["rej_p99"], 2),
            "–" if not bucket else (f"> {bucket[0]:g}" if bucket[1] is None else f"{bucket[0]:g}–{bucket[1]:g}"),
            pct(p["server_rej_le_1ms"]), fmt(p["cpu_ms_per_answer"], 3), pct(p.get("rejection_cpu_share")),
            fmt(p["rss_mb"]), ", ".join(f"{k} {v}" for k, v in p["socket"].items() if v) or "0",
            str(p["breaker_opens"]), f"{p['circuit_open_answers']:,}",
            "–" if p["shedding_max"] is None else str(p["flaps"]),
            "–" if p["limit_min"] is None else f"{p['limit_min']:g}–{p['limit_max']:g}",
            fmt(p["loadgen_cores"], 2),
        ]) + (" (disturbed)" if p["disturbed"] else "") + " |")
    out += ["", "`sent/s` is the load the generator really offered (below the schedule when its core ran out or "
            "every connection was busy at the cap: `unsent`); `loadgen cores` is its CPU. Server-side figures come "
            "from the gateway's `/metrics` (request histogram, bucket-accurate; its 200s include degraded ones). "
            "CPU per answer counts every answer, rejections included.", "",
            "![plot](plot.png)", "", "One JSON per run is in `runs/` (loadgen command and output, per-process CPU, "
            "RSS samples, metric deltas, gauges once a second); the calibration runs are in `calibration/`, the "
            "reference runs (the shipped defaults at the calibration's best load, before each point and after the "
            "last) in `reference/`: a point's reference is the mean of the two beside it.", ""]
    return "\n".join(out)


def log_y_if_positive(ax) -> None:
    """Log scale on y, when the axis has anything positive to show (matplotlib refuses otherwise)."""
    import numpy as np

    for line in ax.get_lines():
        values = np.asarray(line.get_ydata(), dtype=float)
        if np.any(values[np.isfinite(values)] > 0):
            ax.set_yscale("log")
            return


def plot(points, per_config, calib, path: Path) -> None:
    plt = report.ensure_matplotlib()
    configs = [c for c in CONFIGS if any(p["config"] == c for p in points)]
    configs += [c for c in dict.fromkeys(p["config"] for p in points) if c not in configs]
    colors = {c: f"C{i}" for i, c in enumerate(configs)}
    fig, axes = plt.subplots(4, 3, figsize=(16, 17), squeeze=False)
    quota = points[0]["cpu_allowance"] if points else 1.0
    where = "one core" if quota == 1.0 else f"{quota:g} of a core (CFS quota)"
    fig.suptitle(f"overload-curve: capacity {calib['capacity_rps']:,.0f} full-200 req/s, W0 {calib['w0_ms']:.0f} ms "
                 f"(gateway on {where}, downstreams 100 ms)", fontsize=11)
    for col, shape in enumerate(SHAPES):
        for config in configs:
            ps = sorted((p for p in points if p["config"] == config and p["shape"] == shape), key=lambda p: p["x"])
            if not ps:
                continue
            x, c = [p["x"] for p in ps], colors[config]
            axes[0][col].plot(x, [p["goodput"] for p in ps], marker="o", color=c, label=config)
            axes[1][col].plot(x, [p["p99"] for p in ps], marker="o", color=c, label=f"{config} client")
            axes[1][col].plot(x, [p["server_p99"] for p in ps], marker=".", linestyle="--", color=c, label=f"{config} server")
            axes[2][col].plot(x, [p["rej_p99"] for p in ps], marker="o", color=c, label=f"{config} client")
            axes[2][col].plot(x, [p["server_rej_p99"] for p in ps], marker=".", linestyle="--", color=c, label=f"{config} server")
            heaviest = ps[-1]
            if heaviest["limit_series"]:
                t, v = zip(*heaviest["limit_series"])
                axes[3][col].plot(t, v, color=c, label=f"{config} at {heaviest['label']}")
        axes[0][col].axhline(calib["capacity_rps"], color="grey", linestyle=":", label="capacity")
        axes[0][col].axhline(0.9 * calib["capacity_rps"], color="grey", linestyle="--", alpha=0.5, label="90 % of capacity")
        axes[0][col].set_title(f"full 200/s: {SHAPE_TITLES[shape]}", fontsize=9)
        axes[1][col].set_title("p99 of full 200s, ms (solid client, dashed server)", fontsize=9)
        axes[2][col].set_title("p99 of rejections, ms (solid client, dashed server)", fontsize=9)
        axes[3][col].set_title("admission limit (dashboard) during the heaviest point", fontsize=9)
        axes[3][col].set_xlabel("s into the measured window")
        log_y_if_positive(axes[3][col])
        for row in range(3):
            ax = axes[row][col]
            ax.set_xscale("log")
            ax.set_xlabel("offered load ÷ capacity")
            if row:
                log_y_if_positive(ax)
        axes[0][col].set_ylim(bottom=0)
    for ax in axes.flat:
        ax.grid(True, alpha=0.3, which="both")
        if ax.has_data():
            ax.legend(fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--about")
    ap.add_argument("--command", default="")
    args = ap.parse_args()
    runs = report.load_runs(args.dir)
    calib = json.loads((args.dir / "calibration" / "capacity.json").read_text())
    points = [point(r, calib["capacity_rps"], calib["w0_ms"]) for r in runs]
    refs = load_references(args.dir)
    attach_references(points, refs)
    order = {c: i for i, c in enumerate(CONFIGS)}
    points.sort(key=lambda p: (order.get(p["config"], 99), SHAPES.index(p["shape"]), p["x"]))
    per_config = add_estimates(points, calib["capacity_rps"])
    check_rows = checks(points, per_config)
    about = Path(args.about).read_text() if args.about and Path(args.about).exists() else ""
    (args.dir / "report.md").write_text(markdown(points, per_config, check_rows, runs, calib, about, args.command))
    plot(points, per_config, calib, args.dir / "plot.png")
    # report.py's row format, so `report.py summary` can list the scenario; ok_rps is the goodput.
    rows = []
    for run in runs:
        shape = run["config"].get("shape", "closed")
        row = report.aggregate(f"{run['variant']} {shape}", run["x"]["value"], [run])
        row["ok_rps"] = run["goodput"]["full_rps"]
        rows.append(row)
    summary = {"scenario": runs[0]["scenario"], "title": "overload-curve", "command": args.command,
               "date": sorted(r["started_at"] for r in runs)[-1], "calibration": calib, "references": refs,
               "checks": check_rows,
               "points": [{k: v for k, v in p.items() if k != "limit_series"} for p in points], "rows": rows}
    (args.dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.dir / 'report.md'} and {args.dir / 'plot.png'}")


if __name__ == "__main__":
    main()
