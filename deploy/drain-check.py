#!/usr/bin/env python3
"""Load during a gateway stop: SIGTERM must drain, never answer 5xx and never drop a request it had.

    drain-check.py --url http://127.0.0.1:8080 --logs "docker compose logs --no-color gateway" \\
        -- docker compose stop gateway

Closed-loop load (WORKERS threads, one new connection per request, `Connection: close`) on
GET /api/v1/dashboard/{random user} for WARMUP seconds, then the stop command (which sends the
container's STOPSIGNAL, SIGTERM, and waits for it to exit) while the load goes on, until the
stop command returns. The moment the gateway received the signal is read from its own log
(the JSON line "SIGTERM received"), on the same clock as the client's timestamps (one kernel).

Passes when
  - no response at all was a 5xx;
  - before the signal the gateway answered (nothing refused or dropped);
  - at least one request was in flight across the signal, and every such request was answered;
  - no request written more than GUARD before the signal went unanswered.
A request written within GUARD of the signal and then reset may never have left the kernel's
accept queue (closing a listener resets what is still queued): those are counted and shown, not
failed, as are connections refused once the listener is closed, which is what stop accepting
means. Standard library only; every wait is bounded. Exit status 0 on pass, 1 on failure.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import random
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import urlsplit


@dataclass
class Outcome:
    started: float  # wall clock, seconds
    sent: float | None  # the request was written
    done: float
    status: int | None  # None: no response
    error: str | None


def worker(host: str, port: int, users: int, seed: int, stop: threading.Event, out: list) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        path = f"/api/v1/dashboard/{rng.randint(1, users)}"
        conn = http.client.HTTPConnection(host, port, timeout=10)
        started, sent = time.time(), None
        try:
            conn.connect()
            conn.request("GET", path, headers={"Connection": "close"})
            sent = time.time()
            resp = conn.getresponse()
            resp.read()
            out.append(Outcome(started, sent, time.time(), resp.status, None))
        except (OSError, http.client.HTTPException) as e:
            out.append(Outcome(started, sent, time.time(), None, type(e).__name__))
            if sent is None:
                time.sleep(0.01)  # refused: the listener is gone; do not spin
        finally:
            conn.close()


def signal_time(logs_cmd: str) -> float | None:
    """Wall-clock time of the gateway's "SIGTERM received" log line, from its JSON logs."""
    text = subprocess.run(
        shlex.split(logs_cmd), capture_output=True, text=True, timeout=60, check=False
    )
    for line in (text.stdout + text.stderr).splitlines():
        start = line.find("{")
        if start < 0 or "SIGTERM received" not in line:
            continue
        try:
            rec = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        message = rec.get("message") or rec.get("fields", {}).get("message")
        if message == "SIGTERM received" and "timestamp" in rec:
            return datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--logs", required=True, help="command that prints the gateway's logs")
    ap.add_argument("--users", type=int, default=10_000, help="seeded users to spread requests over")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of load before the stop")
    ap.add_argument("--guard-ms", type=float, default=20.0)
    ap.add_argument("--stop-timeout", type=float, default=90.0)
    ap.add_argument("stop", nargs=argparse.REMAINDER, help="-- the stop command")
    args = ap.parse_args()
    stop_cmd = args.stop[1:] if args.stop[:1] == ["--"] else args.stop
    if not stop_cmd:
        ap.error("a stop command is required after --")
    u = urlsplit(args.url)

    outcomes: list[Outcome] = []
    done = threading.Event()
    threads = [
        threading.Thread(target=worker, args=(u.hostname, u.port or 80, args.users, i, done, outcomes), daemon=True)
        for i in range(args.workers)
    ]
    for t in threads:
        t.start()
    time.sleep(args.warmup)
    stop_started = time.time()
    try:
        stopped = subprocess.run(stop_cmd, timeout=args.stop_timeout, capture_output=True, text=True, check=False)
        stop_rc = stopped.returncode
        stop_output = (stopped.stdout + stopped.stderr).strip()
    except subprocess.TimeoutExpired:
        stop_rc, stop_output = None, f"still running after {args.stop_timeout:.0f}s"
    stop_took = time.time() - stop_started
    done.set()
    for t in threads:
        t.join(timeout=15)

    t_sig = signal_time(args.logs)
    failures: list[str] = []
    if stop_rc != 0:
        failures.append(f"stop command {shlex.join(stop_cmd)} exited {stop_rc}: {stop_output[-300:]}")
    if t_sig is None:
        failures.append('no "SIGTERM received" line in the gateway log: the signal did not reach it')
        t_sig = stop_started
    guard = args.guard_ms / 1000

    statuses = collections.Counter(o.status for o in outcomes if o.status is not None)
    server_errors = [o for o in outcomes if o.status is not None and o.status >= 500]
    before = [o for o in outcomes if o.done < t_sig]
    before_failed = [o for o in before if o.status is None]
    in_flight = [o for o in outcomes if o.sent is not None and o.sent < t_sig < o.done]
    in_flight_unanswered = [o for o in in_flight if o.status is None and o.sent < t_sig - guard]
    near_signal_reset = [o for o in in_flight if o.status is None and o.sent >= t_sig - guard]
    refused_after = [o for o in outcomes if o.sent is None and o.done >= t_sig]
    drain_s = max((o.done for o in in_flight if o.status is not None), default=t_sig) - t_sig

    if server_errors:
        failures.append(f"{len(server_errors)} responses were 5xx: {dict(collections.Counter(o.status for o in server_errors))}")
    if len(before) < args.workers:
        failures.append(f"only {len(before)} requests completed before the signal: the load did not run")
    if before_failed:
        failures.append(f"{len(before_failed)} requests failed before the signal ({before_failed[0].error})")
    if not [o for o in in_flight if o.status is not None]:
        failures.append("no request was in flight across the signal: the drain was not exercised")
    if in_flight_unanswered:
        failures.append(
            f"{len(in_flight_unanswered)} requests written more than {args.guard_ms:.0f} ms before the "
            f"signal got no response ({in_flight_unanswered[0].error}): in-flight requests were dropped"
        )

    print(json.dumps({
        "requests": len(outcomes),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "before_signal": len(before),
        "in_flight_at_signal": len(in_flight),
        "in_flight_answered": sum(1 for o in in_flight if o.status is not None),
        "last_in_flight_answered_after_s": round(drain_s, 3),
        "reset_within_guard": len(near_signal_reset),
        "refused_after_signal": len(refused_after),
        "stop_command_s": round(stop_took, 2),
        "signal_after_stop_command_s": round(t_sig - stop_started, 3),
    }))
    for f in failures:
        print(f"drain-check: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
