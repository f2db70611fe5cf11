#!/usr/bin/env python3
"""Run one measured load test with wrk and write one run JSON (bench/run calls this).

What a run records, and where each number comes from:

* throughput, latency percentiles (p50/p90/p99/p99.9), responses per status and socket errors:
  wrk's Lua ``done()`` hook (bench/lib/wrk_report.lua);
* CPU seconds of every process of interest (the server under test, the simulator, Postgres
  summed over its backends, wrk itself): utime+stime from /proc/PID/stat before and after, and
  wrk's own rusage; CPU seconds per 1,000 requests of the server;
* peak RSS of the server: VmHWM from /proc/PID/status (peak since the process started, which
  bench/run does fresh for each run), plus VmRSS sampled every 0.5 s;
* busy fraction of each core from /proc/stat, so a saturated core is visible;
* selected Prometheus metrics scraped before and after the run (deltas), when --metrics-url is
  given;
* downstream calls, when ``--sim-stats NAME=URL`` names a simulator's ``/_sim/stats`` (one per
  downstream; the count of service NAME is read, before and after): calls per request of the
  main load, the ground truth for what a cache saves (with ``--gauge-series``, also sampled once
  a second as a time series of cumulative counts);
* the scenario's physical limit (Little's law, passed in by the scenario) and
  efficiency = successful req/s / limit.

With ``--loadgen BIN`` the load comes from ``examples/loadgen.rs`` instead of wrk (the
overload-curve and caching-spike scenarios): ``--shape closed|open|retry-after`` (``--rate`` for
open; open loop uses ``--connections`` as its connection cap; ``--loadgen-arg`` passes anything
else, such as a spike). Its JSON is folded in under ``loadgen`` and
``goodput`` (full, non-degraded 200s), and ``latency_ms`` is then the latency of the full 200s;
The loadgen warms up in-process (same connections) and the snapshots start when it prints
``LOADGEN_MEASURING``. ``--gauge-series`` also keeps the once-a-second gauge samples (admission limit, shedding,
circuit states) as a time series.

An optional probe (``--probe-url``) runs a second, small wrk at the same time against a light
endpoint: its latency shows whether the server's workers stay responsive under the main load.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import promtext

HERE = Path(__file__).resolve().parent
LUA = HERE / "wrk_report.lua"
CLK_TCK = os.sysconf("SC_CLK_TCK")
# Seconds between a wrk warm-up and the measured run (see measure_once).
SETTLE_S = 1.0


def proc_cpu_seconds(pid: int) -> float | None:
    """utime+stime of a whole process (all its threads), in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # After the ")" the fields start at state (field 3); utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_cpu_split(pid: int) -> dict | None:
    """A process's user and system CPU seconds, and its context switches summed over its
    threads: voluntary (it waited) and involuntary (preempted on its core)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        switches = {"voluntary": 0, "involuntary": 0}
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                for line in (task / "status").read_text().splitlines():
                    if line.startswith("voluntary_ctxt_switches:"):
                        switches["voluntary"] += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches:"):
                        switches["involuntary"] += int(line.split()[1])
            except OSError:
                continue  # a thread that ended meanwhile
    except OSError:
        return None
    return {"user_s": int(fields[11]) / CLK_TCK, "system_s": int(fields[12]) / CLK_TCK, **switches}


def procs_cpu_seconds(pids: list[int]) -> float | None:
    values = [proc_cpu_seconds(pid) for pid in pids]
    return None if any(v is None for v in values) else sum(values)


def proc_status_kib(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def pids_by_comm(comm: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == comm:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def comm_cpu_seconds(comm: str) -> dict[int, float]:
    result = {}
    for pid in pids_by_comm(comm):
        seconds = proc_cpu_seconds(pid)
        if seconds is not None:
            result[pid] = seconds
    return result


def core_times() -> dict[str, tuple[int, int]]:
    """(busy, total) jiffies per core from /proc/stat."""
    result = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if re.match(r"cpu\d+ ", line):
            name, *values = line.split()
            numbers = [int(v) for v in values]
            idle = numbers[3] + numbers[4]  # idle + iowait
            total = sum(numbers[:8])  # up to steal; guest time is already in user
            result[name] = (total - idle, total)
    return result


def scrape(url: str | None) -> str | None:
    if not url:
        return None
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()
    except OSError:
        return None


def sim_calls(url: str, service: str) -> int | None:
    """Calls the simulator at URL (its /_sim/stats) has seen for SERVICE since it started."""
    text = scrape(url)
    try:
        return int(json.loads(text)[service]["requests"]) if text else None
    except (ValueError, KeyError, TypeError):
        return None


def load_average() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def busy_builds() -> list[str]:
    """Compilers running: the heaviest disturbance on this machine. (A test binary that runs
    shows up in the "other" CPU instead.)"""
    out = subprocess.run(
        ["pgrep", "-af", r"rustc --crate-name|/rustc .*--crate-name"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return [line[:120] for line in out.splitlines() if line.strip()]


class Wrk:
    """One wrk process pinned to the load-generator core, its output in a temp file."""

    def __init__(self, url: str, connections: int, duration: float, threads: int, timeout: str,
                 cpus: str | None, env: dict[str, str]):
        # In the run's log directory (removed when the run ends), so a run that dies leaves nothing.
        self.out = tempfile.NamedTemporaryFile(prefix="wrk-", suffix=".out", delete=False,
                                               dir=os.environ.get("BENCH_LOG_DIR") or None)
        self.command = [
            "wrk", f"-t{min(threads, connections)}", f"-c{connections}", f"-d{duration:g}s",
            "--latency", f"--timeout={timeout}", "-s", str(LUA), url,
        ]
        if cpus:
            self.command = ["taskset", "-c", cpus, *self.command]
        self.process = subprocess.Popen(
            self.command, stdout=self.out, stderr=subprocess.STDOUT, env={**os.environ, **env}
        )
        self.rusage = None
        self.returncode = None

    def wait(self) -> dict:
        _, status, rusage = os.wait4(self.process.pid, 0)
        self.process.returncode = self.returncode = os.waitstatus_to_exitcode(status)
        self.rusage = rusage
        self.out.close()
        text = Path(self.out.name).read_text()
        os.unlink(self.out.name)
        match = re.search(r"^WRK_JSON (.*)$", text, re.MULTILINE)
        if not match:
            raise SystemExit(f"wrk produced no WRK_JSON line (rc={self.returncode}):\n{text}")
        return json.loads(match.group(1))

    @property
    def cpu_seconds(self) -> float:
        return self.rusage.ru_utime + self.rusage.ru_stime


class Loadgen:
    """examples/loadgen pinned to the load-generator core; same interface as Wrk."""

    def __init__(self, binary: str, url: str, shape: str, connections: int, rate: float | None,
                 duration: float, warmup: float, timeout: str, cpus: str | None, env: dict[str, str],
                 extra: list[str]):
        self.json = tempfile.NamedTemporaryFile(prefix="loadgen-", suffix=".json", delete=False,
                                                dir=os.environ.get("BENCH_LOG_DIR") or None)
        self.json.close()
        parts = urllib.parse.urlsplit(url)
        if shape == "open":
            load = ["--rate", f"{rate:g}", "--max-connections", str(connections)]
        else:
            load = [f"--{shape}", str(connections)]
        self.command = [
            binary, "--target", f"{parts.scheme}://{parts.netloc}", *load, "--duration", f"{duration:g}",
            "--warmup", f"{warmup:g}",
            "--timeout", str(float(timeout.rstrip("s"))), "--json", self.json.name,
            "--path-template", env.get("WRK_PATH_TEMPLATE", parts.path or "/"),
            "--id-max", env.get("WRK_ID_MAX", "1"),
            # The same Zipf exponent as wrk_report.lua's, so both generators draw users alike.
            *(["--zipf", env["WRK_ZIPF_S"]] if env.get("WRK_ZIPF_S") else []),
            *extra,
        ]
        if cpus:
            self.command = ["taskset", "-c", cpus, *self.command]
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.rusage = None
        self.output: list[str] = []
        self.cpu_at_start = 0.0

    def wait_measuring(self) -> None:
        """Block until the warm-up is over (the loadgen prints LOADGEN_MEASURING): the caller's
        snapshots then cover the measured window only, on connections the warm-up opened."""
        for line in self.process.stdout:
            if line.strip() == "LOADGEN_MEASURING":
                self.cpu_at_start = proc_cpu_seconds(self.process.pid) or 0.0
                return
            self.output.append(line)
        self.wait()  # it ended without measuring: wait() reports why

    def wait(self) -> dict:
        self.output += self.process.stdout.readlines()
        _, status, rusage = os.wait4(self.process.pid, 0)
        self.process.returncode = os.waitstatus_to_exitcode(status)
        self.rusage = rusage
        text = "".join(self.output)
        try:
            raw = json.loads(Path(self.json.name).read_text())
        except (OSError, ValueError):
            raise SystemExit(f"loadgen wrote no JSON (rc={self.process.returncode}):\n{text}") from None
        finally:
            Path(self.json.name).unlink(missing_ok=True)
        return raw

    @property
    def cpu_seconds(self) -> float:
        """CPU of the measured window (the warm-up's is subtracted)."""
        return self.rusage.ru_utime + self.rusage.ru_stime - self.cpu_at_start


def summarise_loadgen(raw: dict) -> dict:
    """The loadgen JSON in the run schema's terms, plus goodput and the offered load."""
    duration = raw["duration_s"]
    statuses = {k: v for k, v in sorted(raw["status"].items(), key=lambda kv: int(kv[0]))}
    ok = sum(v for k, v in statuses.items() if 200 <= int(k) < 300)
    full = raw["outcomes"]["full"]
    socket_errors = {k: raw["errors"].get(k, 0) for k in ("connect", "read", "write", "timeout")}
    latency = raw["latency_ms"]["full"]
    return {
        "duration_s": round(duration, 3),
        "requests": raw["answered"],
        "ok_requests": ok,
        "rps": round(raw["answered"] / duration, 1),
        "ok_rps": round(ok / duration, 1),
        "latency_ms": {k: latency.get(k) for k in ("p50", "p75", "p90", "p99", "p99.9", "p99.99", "mean", "max")},
        "latency_basis": "full (non-degraded) 200s only, from each request's send time (open loop: its scheduled time)",
        "errors": {
            "non_2xx_by_status": {k: v for k, v in statuses.items() if not 200 <= int(k) < 300},
            "socket": socket_errors,
            "socket_total": sum(socket_errors.values()),
        },
        "status_counts": statuses,
        "goodput": {
            "full_requests": full,
            "full_rps": round(full / duration, 1),
            "degraded_requests": raw["outcomes"]["degraded"],
            "rejected_503": raw["outcomes"]["503"],
            "rejected_429": raw["outcomes"]["429"],
            "other_status": raw["outcomes"]["other"],
        },
        "offered": {
            "shape": raw["mode"],
            "connections": raw.get("connections"),
            "rate": raw.get("rate"),
            "sent": raw["sent"],
            "sent_rps": round(raw["sent"] / duration, 1),
            "unsent_late": raw["unsent_late"],
            "in_flight_at_end": raw["in_flight_at_end"],
        },
        "loadgen": raw,
    }


def summarise_wrk(raw: dict) -> dict:
    duration = raw["duration_us"] / 1e6
    statuses = {str(k): v for k, v in sorted(raw["status"].items(), key=lambda kv: int(kv[0]))}
    ok = sum(v for k, v in statuses.items() if 200 <= int(k) < 300)
    requests = raw["requests"]
    pct = raw["latency_us"]["percentiles"]

    def ms(value):
        return None if value is None else round(value / 1000.0, 3)

    socket_errors = {k: raw["errors"][k] for k in ("connect", "read", "write", "timeout")}
    fast = raw.get("fast_share_us") or {}
    rejections = None
    # The client-side latency of non-2xx answers can be read off wrk's distribution only when
    # they are all faster than the successes: the slowest of them (the share-th percentile) is
    # well under the fastest success (the percentile just above). Otherwise: not separable.
    if fast and fast.get("99.9") is not None and fast.get("next") is not None:
        separable = fast["99.9"] * 5 < fast["next"]
        rejections = {
            "separable": separable,
            "share": round(fast["share"] / 100, 4),
            "p50_ms": ms(fast["50"]) if separable else None,
            "p99_ms": ms(fast["99"]) if separable else None,
            "p99.9_ms": ms(fast["99.9"]) if separable else None,
            "method": "fastest share of wrk's latency distribution, valid when every non-2xx is faster than every 2xx",
        }
    return {
        "duration_s": round(duration, 3),
        "requests": requests,
        "ok_requests": ok,
        "rps": round(requests / duration, 1),
        "ok_rps": round(ok / duration, 1),
        "latency_ms": {
            "p50": ms(pct["50"]),
            "p75": ms(pct["75"]),
            "p90": ms(pct["90"]),
            "p99": ms(pct["99"]),
            "p99.9": ms(pct["99.9"]),
            "p99.99": ms(pct["99.99"]),
            "mean": ms(raw["latency_us"]["mean"]),
            "max": ms(raw["latency_us"]["max"]),
        },
        "errors": {
            "non_2xx_by_status": {k: v for k, v in statuses.items() if not 200 <= int(k) < 300},
            "socket": socket_errors,
            "socket_total": sum(socket_errors.values()),
        },
        "status_counts": statuses,
        "non_2xx_latency_inferred": rejections,
    }


def parse_kv(items: list[str]) -> dict[str, str]:
    result = {}
    for item in items or []:
        key, _, value = item.partition("=")
        result[key] = value
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--variant", default="default")
    ap.add_argument("--x-name", default="concurrency", help="what the scenario varies (plot x axis)")
    ap.add_argument("--x-value", type=float, help="default: --connections")
    ap.add_argument("--repetition", type=int, default=1)
    ap.add_argument("--url", required=True)
    ap.add_argument("--connections", type=int, required=True)
    ap.add_argument("--duration", type=float, required=True, help="seconds")
    ap.add_argument("--warmup", type=float, default=0.0, help="seconds of unrecorded load first")
    ap.add_argument("--threads", type=int, default=1, help="wrk threads")
    ap.add_argument("--timeout", default="10s", help="wrk --timeout (slower responses count as timeouts)")
    ap.add_argument("--loadgen-cpus", default="1", help="taskset list for wrk; '' to leave unpinned")
    ap.add_argument("--wrk-env", action="append", help="KEY=VALUE for the wrk script")
    ap.add_argument("--loadgen", help="examples/loadgen binary: use it instead of wrk")
    ap.add_argument("--shape", choices=["closed", "open", "retry-after"], default="closed", help="loadgen's load shape")
    ap.add_argument("--rate", type=float, help="open loop: requests per second")
    ap.add_argument("--gauge-series", action="store_true", help="keep the once-a-second gauge samples")
    ap.add_argument("--loadgen-arg", action="append", default=[],
                    help="one more argument for the loadgen (e.g. --loadgen-arg=--spike-to=5000)")
    ap.add_argument("--probe-url")
    ap.add_argument("--probe-connections", type=int, default=4)
    ap.add_argument("--probe-delay-ms", type=int, default=10, help="pause between a probe connection's requests")
    ap.add_argument("--server-pid", type=int, required=True, help="the process under test")
    ap.add_argument("--server-name", default="server")
    ap.add_argument("--proc", action="append", help="NAME=PID[,PID...] of other processes to account (summed)")
    ap.add_argument("--proc-comm", action="append", help="NAME=COMM: sum every process with that comm")
    ap.add_argument("--metrics-url")
    ap.add_argument("--sim-stats", action="append", help="NAME=URL: a simulator's /_sim/stats; its calls of service NAME are counted")
    ap.add_argument("--info-url", help="a JSON endpoint describing the server (bench_server's /info)")
    ap.add_argument("--limit-rps", type=float, required=True, help="the scenario's physical limit")
    ap.add_argument("--limit-basis", required=True, help="how the limit was computed")
    ap.add_argument("--meta", action="append", help="KEY=VALUE recorded under config")
    ap.add_argument("--machine", type=Path, help="machine JSON written by bench/lib/machine.py")
    ap.add_argument("--command", default=os.environ.get("BENCH_COMMAND", ""))
    ap.add_argument("--quiet-threshold", type=float, default=float(os.environ.get("BENCH_QUIET_THRESHOLD", 0.25)),
                    help="cores of CPU used by processes outside the run above which a run counts as disturbed")
    ap.add_argument("--quiet-wait", type=float, default=float(os.environ.get("BENCH_QUIET_WAIT", 90)),
                    help="seconds to wait for a quiet machine before each attempt")
    ap.add_argument("--attempts", type=int, default=int(os.environ.get("BENCH_ATTEMPTS", 2)),
                    help="a disturbed run is repeated up to this many attempts in all")
    args = ap.parse_args()

    history = []
    for attempt in range(1, args.attempts + 1):
        waited, idle_other = wait_quiet(args.quiet_threshold, args.quiet_wait)
        run, line = measure_once(args)
        other = run["processes"]["other"]["cpu_util"]
        builds = run["conditions"]["concurrent_builds"]
        disturbed = other > args.quiet_threshold or bool(builds)
        history.append({"attempt": attempt, "waited_for_quiet_s": waited, "other_cores_before": idle_other,
                        "other_cores_during": other, "builds": len(builds), "disturbed": disturbed})
        if not disturbed:
            break
        print(f"  attempt {attempt} disturbed (other processes {other:.2f} cores, {len(builds)} build processes)"
              + ("; retrying" if attempt < args.attempts else "; keeping it, flagged"), flush=True)
    run["conditions"]["attempts"] = history
    run["conditions"]["disturbed"] = history[-1]["disturbed"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(run, indent=2) + "\n")
    print(line + ("  [DISTURBED]" if run["conditions"]["disturbed"] else ""), flush=True)


def wait_quiet(threshold: float, max_wait: float) -> tuple[float, float]:
    """Wait until the machine's cores are nearly idle (our own servers idle between runs) and no
    cargo or rustc runs. Returns (seconds waited, busy cores in the last 2 s window)."""
    if max_wait <= 0:
        return 0.0, 0.0  # gating off (the smoke run)
    start = time.monotonic()
    while True:
        before = core_times()
        time.sleep(2)
        after = core_times()
        busy = sum((after[c][0] - before[c][0]) / max(after[c][1] - before[c][1], 1) for c in after)
        waited = time.monotonic() - start
        if (busy < threshold and not busy_builds()) or waited > max_wait:
            return round(waited, 1), round(busy, 3)
        time.sleep(3)


def measure_once(args) -> tuple[dict, str]:
    wrk_env = parse_kv(args.wrk_env)
    cpus = args.loadgen_cpus or None
    # The server's resident memory before any load (a fresh server: its pools and caches as
    # they start): peak minus this, per connection, is the growth each connection costs.
    rss_before_load = proc_status_kib(args.server_pid, "VmRSS")
    loadgen = None
    if args.loadgen:
        # The loadgen warms up in-process, on the connections it then measures with.
        loadgen = Loadgen(args.loadgen, args.url, args.shape, args.connections, args.rate, args.duration,
                          args.warmup, args.timeout, cpus, wrk_env, args.loadgen_arg)
        loadgen.wait_measuring()
    elif args.warmup > 0:
        Wrk(args.url, args.connections, args.warmup, args.threads, args.timeout, cpus, wrk_env).wait()
        # wrk ends its warm-up by closing every connection with a request in flight, and those
        # requests hold the server's permits, pooled connections and downstream calls until it
        # notices; the measured run waits until they are gone (a dashboard takes ~100 ms) rather
        # than opening its connections on top of them. (On 2026-12-06 the pause made no
        # measurable difference to `stack`: the 503s at the start of its windows are the adaptive
        # limit's ramp from a fresh start, experiments/limit-headroom.)
        time.sleep(SETTLE_S)

    procs = {args.server_name: [args.server_pid],
             **{k: [int(p) for p in v.split(",") if p] for k, v in parse_kv(args.proc).items()}}
    comms = parse_kv(args.proc_comm)
    load_before = load_average()
    builds = busy_builds()
    info = scrape(args.info_url)
    sims = parse_kv(args.sim_stats)
    calls_before = {name: sim_calls(url, name) for name, url in sims.items()}
    metrics_before = scrape(args.metrics_url)
    cpu_before = {name: procs_cpu_seconds(pids) for name, pids in procs.items()}
    split_before = proc_cpu_split(args.server_pid)
    comm_before = {name: comm_cpu_seconds(comm) for name, comm in comms.items()}
    cores_before = core_times()
    started = dt.datetime.now(dt.timezone.utc)
    t0 = time.monotonic()

    main_wrk = loadgen or Wrk(args.url, args.connections, args.duration, args.threads, args.timeout, cpus, wrk_env)
    probe = None
    if args.probe_url:
        probe = Wrk(args.probe_url, args.probe_connections, args.duration, 1, args.timeout, cpus,
                    {"WRK_DELAY_MS": str(args.probe_delay_ms)})

    rss_samples: list[tuple[float, int]] = []
    stop = threading.Event()

    gauge_samples: list[dict] = []
    call_samples: list[dict] = []

    def readyz_status(url: str) -> int | None:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status
        except urllib.error.HTTPError as e:
            return e.code
        except (OSError, ValueError):
            return None

    def sample() -> None:
        tick = 0
        while not stop.is_set():
            rss = proc_status_kib(args.server_pid, "VmRSS")
            if rss is not None:
                rss_samples.append((round(time.monotonic() - t0, 2), rss))
            # Gauges once a second (a scrape costs the server a little CPU): the time averages
            # are the L of Little's law (busy pool connections, requests in flight).
            if args.metrics_url and tick % 2 == 1:
                values = promtext.sample_gauges(scrape(args.metrics_url))
                # Readiness as the load balancer sees it, beside the gauges.
                ready = readyz_status(args.metrics_url.rsplit("/", 1)[0] + "/readyz")
                if ready is not None:
                    values["not_ready"] = 0.0 if ready == 200 else 1.0
                if values:
                    gauge_samples.append({"t": round(time.monotonic() - t0, 2), **values})
            tick += 1
            stop.wait(0.5)

    def sample_calls() -> None:
        # A thread of its own, on a fixed 1 s schedule: the gateway's scrapes above slow down
        # when it is overloaded, the simulators' counters must not.
        tick = 0
        while not stop.wait(max(0.0, t0 + tick - time.monotonic())):
            counts = {name: sim_calls(url, name) for name, url in sims.items()}
            call_samples.append({"t": round(time.monotonic() - t0, 2), **counts})
            tick += 1

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    call_sampler = threading.Thread(target=sample_calls, daemon=True)
    if sims and args.gauge_series:
        call_sampler.start()
    main_raw = main_wrk.wait()
    probe_raw = probe.wait() if probe else None
    stop.set()
    sampler.join()
    if call_sampler.is_alive():
        call_sampler.join()
    wall = time.monotonic() - t0

    cores_after = core_times()
    cpu_after = {name: procs_cpu_seconds(pids) for name, pids in procs.items()}
    split_after = proc_cpu_split(args.server_pid)
    comm_after = {name: comm_cpu_seconds(comm) for name, comm in comms.items()}
    metrics_after = scrape(args.metrics_url)
    calls_after = {name: sim_calls(url, name) for name, url in sims.items()}
    if sims and args.gauge_series:
        # The series' last sample is the end of the window, whatever the 1 s schedule left out.
        call_samples.append({"t": round(time.monotonic() - t0, 2), **calls_after})
    peak_rss_kib = proc_status_kib(args.server_pid, "VmHWM")
    builds = sorted(set(builds) | set(busy_builds()))

    result = summarise_loadgen(main_raw) if args.loadgen else summarise_wrk(main_raw)
    processes = {}
    for name in procs:
        if cpu_before[name] is not None and cpu_after[name] is not None:
            seconds = cpu_after[name] - cpu_before[name]
            processes[name] = {"pids": procs[name], "cpu_s": round(seconds, 3), "cpu_util": round(seconds / wall, 3)}
    for name in comms:
        before, after = comm_before[name], comm_after[name]
        seconds = sum(after[pid] - before.get(pid, 0.0) for pid in after)
        processes[name] = {"processes": len(after), "cpu_s": round(seconds, 3), "cpu_util": round(seconds / wall, 3)}
    wrk_seconds = main_wrk.cpu_seconds + (probe.cpu_seconds if probe else 0.0)
    processes["loadgen" if args.loadgen else "wrk"] = {"cpu_s": round(wrk_seconds, 3), "cpu_util": round(wrk_seconds / wall, 3)}

    cores = {}
    for name, (busy, total) in cores_after.items():
        busy0, total0 = cores_before.get(name, (0, 0))
        cores[name] = round((busy - busy0) / max(total - total0, 1), 3)
    # CPU that none of the accounted processes used: other work on the machine (and the kernel's
    # softirq time for the loopback traffic). A quiet machine keeps this small.
    accounted = sum(p["cpu_s"] for p in processes.values())
    processes["other"] = {"cpu_s": round(sum(cores.values()) * wall - accounted, 3),
                          "cpu_util": round(sum(cores.values()) - accounted / wall, 3)}

    server_cpu = processes.get(args.server_name, {}).get("cpu_s")
    # Per request of the main load; a probe's light requests (if any) add a little CPU on top.
    requests = result["requests"]
    limit = args.limit_rps
    run = {
        "schema": 1,
        "scenario": args.scenario,
        "variant": args.variant,
        "x": {"name": args.x_name, "value": args.x_value if args.x_value is not None else args.connections},
        "repetition": args.repetition,
        "started_at": started.isoformat(timespec="seconds"),
        "command": args.command,
        "wrk_command": shlex.join(main_wrk.command),
        "probe_command": shlex.join(probe.command) if probe else None,
        "machine": json.loads(args.machine.read_text()) if args.machine else None,
        "conditions": {"load_average_before": load_before, "concurrent_builds": builds},
        "config": {
            "url": args.url,
            "connections": args.connections,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "wrk_threads": args.threads,
            "wrk_timeout": args.timeout,
            "loadgen_cpus": cpus,
            # Where the local Postgres ran (bench_pin_postgres): "cores N", or "unpinned".
            "postgres_cpus": os.environ.get("BENCH_PG_PLACEMENT"),
            # The gateway's CFS quota in cores (BENCH_GATEWAY_CPU_QUOTA), or None for its whole core.
            "gateway_cpu_quota": float(os.environ["BENCH_GATEWAY_CPU_QUOTA"])
            if os.environ.get("BENCH_GATEWAY_CPU_QUOTA") else None,
            **({"shape": args.shape, "rate": args.rate} if args.loadgen else {}),
            **parse_kv(args.meta),
        },
        **result,
        "server_info": json.loads(info) if info else None,
        "limit": {"rps": limit, "basis": args.limit_basis},
        # Successful req/s over the limit; for loadgen runs the full (non-degraded) 200s only.
        "efficiency": round(result.get("goodput", {}).get("full_rps", result["ok_rps"]) / limit, 3) if limit else None,
        "server": {
            "name": args.server_name,
            "cpu_s": server_cpu,
            # CPU seconds per 1,000 requests is numerically CPU milliseconds per request.
            "cpu_s_per_1000_requests": round(server_cpu / requests * 1000, 4) if server_cpu and requests else None,
            "peak_rss_mb": round(peak_rss_kib / 1024, 1) if peak_rss_kib else None,
            "rss_before_load_mb": round(rss_before_load / 1024, 1) if rss_before_load else None,
            "rss_growth_per_connection_kib": (
                round((peak_rss_kib - rss_before_load) / args.connections, 1)
                if peak_rss_kib and rss_before_load and args.connections else None),
            "rss_samples_kib": rss_samples,
            # Per request: user and system CPU milliseconds, and context switches (voluntary:
            # a thread waited; involuntary: preempted on its core, by its own threads too).
            "per_request": {
                "user_ms": round((split_after["user_s"] - split_before["user_s"]) / requests * 1000, 4),
                "system_ms": round((split_after["system_s"] - split_before["system_s"]) / requests * 1000, 4),
                "voluntary_switches": round((split_after["voluntary"] - split_before["voluntary"]) / requests, 3),
                "involuntary_switches": round((split_after["involuntary"] - split_before["involuntary"]) / requests, 3),
            } if split_before and split_after and requests else None,
        },
        "processes": processes,
        "cores_busy": cores,
        "wall_s": round(wall, 2),
    }
    if probe_raw:
        run["probe"] = {"url": args.probe_url, "connections": args.probe_connections,
                        "delay_ms": args.probe_delay_ms, **summarise_wrk(probe_raw)}
    if sims:
        # Per request of the main load (answered in the window), whatever its status.
        run["downstream_calls"] = {
            name: {"calls": calls_after[name] - calls_before[name],
                   "per_request": round((calls_after[name] - calls_before[name]) / requests, 4) if requests else None}
            if calls_before[name] is not None and calls_after[name] is not None else None
            for name in sims
        }
        if args.gauge_series:
            run["downstream_calls_series"] = call_samples
    if metrics_before is not None or metrics_after is not None:
        run["metrics"] = promtext.run_metrics(metrics_before, metrics_after)
        run["metrics"]["gauges_sampled"] = promtext.summarise_gauges(gauge_samples)
        if args.gauge_series:
            run["metrics"]["gauge_series"] = gauge_samples

    lat = result["latency_ms"]
    line = (
        f"{args.scenario}/{args.variant} {args.x_name}={run['x']['value']:g} rep {args.repetition}: "
        f"{result['ok_rps']:.0f} ok req/s (limit {limit:.0f}, eff {run['efficiency']}), "
        f"p50 {lat['p50']} p99 {lat['p99']} p99.9 {lat['p99.9']} ms, "
        f"non-2xx {sum(result['errors']['non_2xx_by_status'].values())}, socket {result['errors']['socket_total']}, "
        f"server CPU {run['server']['cpu_s_per_1000_requests']} s/1k req, peak RSS {run['server']['peak_rss_mb']} MB"
    )
    if args.loadgen:
        g, o = result["goodput"], result["offered"]
        line += (f"; full 200 {g['full_rps']:.0f}/s, degraded {g['degraded_requests']}, 503 {g['rejected_503']}, "
                 f"sent {o['sent_rps']:.0f}/s, unsent {o['unsent_late']}")
    if probe_raw:
        line += f"; probe p99 {run['probe']['latency_ms']['p99']} ms"
    if sims:
        line += "; calls/req " + " ".join(
            f"{name} {c['per_request']}" for name, c in run["downstream_calls"].items() if c)
    line += f"; other processes {processes['other']['cpu_util']:.2f} cores"
    return run, line


if __name__ == "__main__":
    sys.exit(main())
