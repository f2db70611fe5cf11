#!/usr/bin/env python3
"""Deterministic replay of the HorizontalPodAutoscaler in k8s/hpa.yaml against a synthetic traffic ramp.

What comes from the rendered manifests (so the simulation is of the HPA that would be applied):
  minReplicas, maxReplicas, the metric targets (Pods tributary_admission_utilization AverageValue and
  Resource cpu Utilization), the whole `behavior` (stabilisation windows, policies, selectPolicy), the
  admission limit (TRIBUTARY_ADMISSION__MAX_IN_FLIGHT) and the pod's CPU request and limit.

What is synthetic (flags; defaults are illustrative, NOT measurements; replace them with the numbers
from bench/run seed-baseline to replay a measured pod):
  --latency-ms          W, mean latency of a request at the gateway (Little's law: in-flight = rate x W)
  --cpu-ms-per-request  c, CPU time per request
  --ready-delay         seconds from a scale-up decision to the new pod being Ready
  the traffic profile   PROFILE below, with deterministic noise (--noise, --seed)

The controller logic follows kube-controller-manager's HPA (pkg/controller/podautoscaler):
  every --sync seconds, per metric: ratio = current / target; no change if |ratio - 1| <= tolerance
  (0.1), else desired = ceil(ratio x ready pods); take the largest over the metrics; stabilise (the
  lowest recommendation of the scale-up window, the highest of the scale-down window); limit the
  change by the policies, each relative to the replica count at the start of its period; clamp to
  [minReplicas, maxReplicas]. Metrics are averaged over a window (the adapter's avg_over_time[1m]
  for the custom metric, metrics-server's 30 s for CPU) and only over Ready pods.

A pod serves min(its share of traffic, admission limit / W, CPU limit / c); the rest is shed (503).

Prints one row per minute and exits 1 with --check if the HPA flaps: a scale event in the opposite
direction of the previous one within --flap-window seconds.

Usage: hpa-sim.py [--rendered FILE|-] [--check] [synthetic-parameter flags]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import manifests  # noqa: E402

# Synthetic traffic, requests/s: (start minute, end minute, rps at start, rps at end), linear in between.
PROFILE = [
    (0, 10, 1000, 1000),     # quiet baseline, the HPA sits at minReplicas
    (10, 20, 1000, 10000),   # ramp: +900 rps per minute for 10 minutes
    (20, 35, 10000, 10000),  # peak plateau with noise: the HPA must hold steady
    (35, 40, 10000, 3000),   # fall
    (40, 60, 3000, 3000),    # new plateau: scale-down must be gradual and not bounce
]
DEFAULT_UP = {"stabilizationWindowSeconds": 0, "selectPolicy": "Max",
              "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15},
                           {"type": "Pods", "value": 4, "periodSeconds": 15}]}
DEFAULT_DOWN = {"stabilizationWindowSeconds": 300, "selectPolicy": "Max",
                "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15}]}


def offered_rps(t: float, rng_blocks: dict[int, float], noise: float, rng: random.Random) -> float:
    minute = t / 60
    for start, end, a, b in PROFILE:
        if start <= minute < end:
            base = a + (b - a) * (minute - start) / (end - start)
            break
    else:
        base = PROFILE[-1][3]
    block = int(t // 30)  # noise changes every 30 s, like bursts of real traffic
    if block not in rng_blocks:
        rng_blocks[block] = rng.uniform(-noise, noise)
    return base * (1 + rng_blocks[block])


class Hpa:
    """The controller state that matters: recommendations and scale events with timestamps."""

    def __init__(self, hpa: dict, tolerance: float):
        spec = hpa["spec"]
        self.min = spec.get("minReplicas", 1)
        self.max = spec["maxReplicas"]
        self.tolerance = tolerance
        behavior = spec.get("behavior", {})
        self.up = {**DEFAULT_UP, **behavior.get("scaleUp", {})}
        self.down = {**DEFAULT_DOWN, **behavior.get("scaleDown", {})}
        self.recommendations: list[tuple[float, int]] = []
        self.up_events: list[tuple[float, int]] = []
        self.down_events: list[tuple[float, int]] = []
        self.targets = []
        for m in spec["metrics"]:
            if m["type"] == "Pods" and m["pods"]["target"]["type"] == "AverageValue":
                self.targets.append(("admission", manifests.parse_quantity(m["pods"]["target"]["averageValue"])))
            elif m["type"] == "Resource" and m["resource"]["name"] == "cpu":
                self.targets.append(("cpu", m["resource"]["target"]["averageUtilization"] / 100))
            else:
                raise SystemExit(f"hpa-sim: metric {m} is not modelled")

    def metric_replicas(self, current: int, ready: int, observed: dict[str, float]) -> int:
        desired = 0
        for name, target in self.targets:
            ratio = observed[name] / target
            want = current if abs(ratio - 1) <= self.tolerance else math.ceil(ratio * ready)
            desired = max(desired, want)
        return desired

    @staticmethod
    def _changed(events, now, period):
        return sum(n for ts, n in events if ts > now - period)

    def _limit(self, rules, current, now, up: bool) -> int:
        if rules.get("selectPolicy") == "Disabled":
            return current
        pick_least_change = rules.get("selectPolicy") == "Min"
        proposals = []
        for p in rules["policies"]:
            start = current - self._changed(self.up_events, now, p["periodSeconds"]) \
                + self._changed(self.down_events, now, p["periodSeconds"])
            if up:
                proposals.append(start + p["value"] if p["type"] == "Pods"
                                 else math.ceil(start * (1 + p["value"] / 100)))
            else:
                proposals.append(start - p["value"] if p["type"] == "Pods"
                                 else int(start * (1 - p["value"] / 100)))
        if up:
            return min(proposals) if pick_least_change else max(proposals)
        return max(proposals) if pick_least_change else min(proposals)

    def decide(self, now: float, current: int, desired: int) -> int:
        # Stabilisation (stabilizeRecommendationWithBehaviors).
        up_cut = now - self.up["stabilizationWindowSeconds"]
        down_cut = now - self.down["stabilizationWindowSeconds"]
        up_rec = down_rec = desired
        for ts, rec in self.recommendations:
            if ts > up_cut:
                up_rec = min(up_rec, rec)
            if ts > down_cut:
                down_rec = max(down_rec, rec)
        self.recommendations = [(ts, r) for ts, r in self.recommendations if ts > min(up_cut, down_cut)]
        self.recommendations.append((now, desired))
        stabilised = min(max(current, up_rec), down_rec)
        # Rate limits (convertDesiredReplicasWithBehaviorRate).
        if stabilised > current:
            ceiling = min(self.max, max(current, self._limit(self.up, current, now, up=True)))
            new = min(stabilised, ceiling)
        elif stabilised < current:
            floor = max(self.min, min(current, self._limit(self.down, current, now, up=False)))
            new = max(stabilised, floor)
        else:
            new = stabilised
        if new > current:
            self.up_events.append((now, new - current))
        elif new < current:
            self.down_events.append((now, current - new))
        return new


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rendered", help="kustomize output of k8s/ (file or '-'); default: render it")
    ap.add_argument("--latency-ms", type=float, default=100.0, help="W (synthetic default 100)")
    ap.add_argument("--cpu-ms-per-request", type=float, default=0.3, help="c (synthetic default 0.3)")
    ap.add_argument("--ready-delay", type=int, default=30, help="s from scale-up to Ready (default 30)")
    ap.add_argument("--sync", type=int, default=15, help="HPA sync period, s (default 15)")
    ap.add_argument("--tolerance", type=float, default=0.1, help="HPA tolerance (default 0.1)")
    ap.add_argument("--custom-window", type=int, default=60, help="custom metric window, s (default 60)")
    ap.add_argument("--cpu-window", type=int, default=30, help="CPU metric window, s (default 30)")
    ap.add_argument("--noise", type=float, default=0.1, help="traffic noise, +-fraction (default 0.1)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--minutes", type=int, default=60)
    ap.add_argument("--flap-window", type=int, default=300, help="s; see --check (default 300)")
    ap.add_argument("--check", action="store_true", help="exit 1 if the HPA flaps")
    args = ap.parse_args()

    docs = manifests.load(args.rendered)
    hpa_doc = manifests.one(docs, "HorizontalPodAutoscaler")
    dep = manifests.one(docs, "Deployment", hpa_doc["spec"]["scaleTargetRef"]["name"])
    env = manifests.container_env(dep, docs)
    limit = int(env["TRIBUTARY_ADMISSION__MAX_IN_FLIGHT"])
    resources = dep["spec"]["template"]["spec"]["containers"][0]["resources"]
    cpu_request = manifests.parse_quantity(resources["requests"]["cpu"])
    cpu_limit = manifests.parse_quantity(resources["limits"]["cpu"])
    hpa = Hpa(hpa_doc, args.tolerance)

    w = args.latency_ms / 1000
    c = args.cpu_ms_per_request / 1000
    pod_max_rps = min(limit / w, cpu_limit / c)  # what one Ready pod can serve before shedding
    rng, noise_blocks = random.Random(args.seed), {}

    replicas = hpa.min
    ready_at = [0.0] * replicas  # time each pod becomes Ready
    hist = {"admission": deque(), "cpu": deque()}  # (t, per-pod value) samples over Ready pods
    events: list[tuple[int, int, int]] = []  # (t, from, to)
    offered_total = shed_total = 0.0
    rows = []
    minute = {"offered": 0.0, "shed": 0.0, "adm": 0.0, "cpu": 0.0}
    obs = {"admission": 0.0, "cpu": 0.0}

    print(f"# HPA from manifests: min {hpa.min}, max {hpa.max}, targets "
          + ", ".join(f"{n} {t:g}" for n, t in hpa.targets)
          + f"; admission limit L={limit}, cpu request {cpu_request:g}, limit {cpu_limit:g}")
    print(f"# synthetic pod: W={args.latency_ms:g} ms, c={args.cpu_ms_per_request:g} ms CPU/request, "
          f"ready after {args.ready_delay} s -> one pod serves at most {pod_max_rps:.0f} rps")
    print(f"{'min':>4} {'offered':>8} {'replicas':>8} {'ready':>5} {'adm.util':>8} {'cpu':>5} "
          f"{'shed%':>6}  events")

    for t in range(args.minutes * 60):
        rps = offered_rps(t, noise_blocks, args.noise, rng)
        ready = max(1, sum(1 for r in ready_at if r <= t))
        per_pod = rps / ready
        served = min(per_pod, pod_max_rps)
        shed = (per_pod - served) * ready
        adm = min(1.0, served * w / limit)
        cpu = served * c / cpu_request
        for name, v in (("admission", adm), ("cpu", cpu)):
            hist[name].append((t, v))
            window = args.custom_window if name == "admission" else args.cpu_window
            while hist[name][0][0] <= t - window:
                hist[name].popleft()
        offered_total += rps
        shed_total += shed
        minute["offered"] += rps
        minute["shed"] += shed

        if t % args.sync == 0 and t > 0:
            obs = {n: sum(v for _, v in h) / len(h) for n, h in hist.items()}
            desired = hpa.metric_replicas(replicas, ready, obs)
            new = hpa.decide(t, replicas, desired)
            if new != replicas:
                events.append((t, replicas, new))
                if new > replicas:
                    ready_at += [t + args.ready_delay] * (new - replicas)
                else:
                    ready_at = sorted(ready_at)[: new]  # the controller removes the newest-ready first
                replicas = new

        if t % 60 == 59:
            m = t // 60
            evs = [f"{a}->{b}@{s % 60:02d}s" for s, a, b in events if s // 60 == m]
            rows.append(
                f"{m:>4} {minute['offered'] / 60:>8.0f} {replicas:>8} {ready:>5} {obs['admission']:>8.2f} "
                f"{obs['cpu'] * 100:>4.0f}% {100 * minute['shed'] / minute['offered']:>5.1f}%  {' '.join(evs)}"
                .rstrip()
            )
            minute = {"offered": 0.0, "shed": 0.0, "adm": 0.0, "cpu": 0.0}

    print("\n".join(rows))
    flaps = [
        (a, b) for a, b in zip(events, events[1:])
        if (a[2] - a[1]) * (b[2] - b[1]) < 0 and b[0] - a[0] < args.flap_window
    ]
    print(f"# {len(events)} scale events, peak {max([hpa.min] + [e[2] for e in events])} replicas, "
          f"{100 * shed_total / offered_total:.2f}% of requests shed, "
          f"{len(flaps)} direction reversals within {args.flap_window} s")
    if args.check and flaps:
        for a, b in flaps:
            print(f"FAIL flap: {a[1]}->{a[2]} at {a[0]} s then {b[1]}->{b[2]} at {b[0]} s", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
