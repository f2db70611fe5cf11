#!/usr/bin/env python3
"""Print a JSON description of this machine for the run files: cores, CPU model, memory,
kernel, tool versions, git revision and the date. Usage: machine.py > machine.json"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
from pathlib import Path


def first(command: list[str]) -> str | None:
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else None


def cpu_model() -> str | None:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return None


def mem_total_gib() -> float | None:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 1024 / 1024, 1)
    return None


def transparent_huge_pages() -> str | None:
    """The kernel's THP mode, the bracketed word of `enabled` (always, madvise or never): with
    `madvise` a process gets huge pages where its allocator asks for them (mimalloc does, and
    tributary turns that off; see src/allocator.rs)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else text.strip()


def main() -> None:
    repo = Path(__file__).resolve().parents[2]
    print(json.dumps({
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model(),
        "mem_total_gib": mem_total_gib(),
        "kernel": platform.release(),
        "os": first(["sh", "-c", ". /etc/os-release && echo $PRETTY_NAME"]),
        "rustc": first(["rustc", "--version"]),
        "wrk": first(["sh", "-c", "wrk -v 2>&1 | head -1"]),
        "postgres": first(["psql", "-h", "127.0.0.1", "-U", "postgres", "-tAc", "show server_version"]),
        "git_revision": first(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"]),
        "git_dirty": bool(first(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"])),
        "fd_limit": first(["sh", "-c", "ulimit -n"]),
        "ephemeral_ports": Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split(),
        "transparent_hugepage": transparent_huge_pages(),
    }, indent=2))


if __name__ == "__main__":
    main()
