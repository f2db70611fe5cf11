#!/usr/bin/env python3
"""Stand-in for the systemd timers that run podman's health checks, on machines without systemd.

    healthcheck-timer.py SOCKET PROJECT OUT_JSON DEADLINE_S

Podman (4.x) defines a container's health check but schedules it with a systemd timer; without
systemd, no check ever runs and every container stays "starting", so no compose implementation
can honour `condition: service_healthy`. This runs them instead, through the podman API service
at SOCKET (`podman system service`): every running container of the compose project PROJECT
(label com.docker.compose.project) that has a health check gets `GET .../healthcheck` at its own
`interval`. Podman itself executes the test, applies `start_period`, `timeout` and `retries`, and
sets the status that `inspect` (and so docker-compose) reads: only the scheduling is ours.

OUT_JSON records, per compose service, when the first check that passed began (RFC 3339, UTC):
no dependant may start before that moment, which is what the caller checks. Stops by itself
after DEADLINE_S.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import sys
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

API = "/v4.0.0/libpod"


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def get(sock: str, path: str, timeout: float = 10) -> object:
    conn = UnixConnection(sock, timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        return json.loads(body) if resp.status < 300 else None
    finally:
        conn.close()


def main() -> int:
    sock, project, out_path, deadline = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    end = time.monotonic() + deadline
    filters = urllib.parse.quote(json.dumps({"label": [f"com.docker.compose.project={project}"]}))
    checks: dict[str, tuple[str, float, float]] = {}  # id -> (service, interval s, timeout s)
    due: dict[str, float] = {}
    running: dict[str, tuple[datetime, object]] = {}
    first_healthy: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=8) as pool:
        while time.monotonic() < end:
            now = time.monotonic()
            try:
                listed = get(sock, f"{API}/containers/json?filters={filters}") or []
            except OSError:
                listed = []
            alive = set()
            for c in listed:
                cid = c["Id"]
                alive.add(cid)
                if cid not in checks:
                    info = get(sock, f"{API}/containers/{cid}/json") or {}
                    hc = (info.get("Config") or {}).get("Healthcheck") or {}
                    service = ((info.get("Config") or {}).get("Labels") or {}).get("com.docker.compose.service", cid[:12])
                    test = hc.get("Test") or []
                    if test and test[0] != "NONE":
                        checks[cid] = (service, (hc.get("Interval") or 30e9) / 1e9, (hc.get("Timeout") or 30e9) / 1e9)
                        due[cid] = now
                    else:
                        checks[cid] = (service, 0, 0)
            for cid, (service, interval, timeout) in checks.items():
                if not interval or cid not in alive or cid in running or due.get(cid, now) > now:
                    continue
                due[cid] = now + interval
                running[cid] = (datetime.now(timezone.utc), pool.submit(get, sock, f"{API}/containers/{cid}/healthcheck", timeout + 5))
            for cid, (began, fut) in list(running.items()):
                if not fut.done():
                    continue
                del running[cid]
                try:
                    result = fut.result()
                except OSError:
                    continue
                service = checks[cid][0]
                if result and result.get("Status") == "healthy" and service not in first_healthy:
                    first_healthy[service] = began.isoformat()
                    with open(out_path + ".tmp", "w") as f:
                        json.dump(first_healthy, f)
                    # Atomic replace, so a reader never sees half a file.
                    os.replace(out_path + ".tmp", out_path)
            time.sleep(0.25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
