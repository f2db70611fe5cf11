#!/usr/bin/env python3
"""Checks the Postgres connection budget of the Kubernetes fleet and of the compose stack.

The numbers are the gateway's own configuration keys (the ones its start-up check reads), so there is
one source of truth per deployment:

    pool x pods <= server_max_connections - reserved_connections

Kubernetes (from the kustomize-rendered manifests; the gateway container's effective environment,
i.e. the generated ConfigMap tributary-config):
  pool                    TRIBUTARY_DATABASE__MAX_CONNECTIONS
  pods                    HPA maxReplicas + Deployment rollingUpdate.maxSurge (during a rollout at
                          maxReplicas the surge pods hold pools too; a percentage is resolved against
                          maxReplicas and rounded up, as the Deployment controller does)
  server_max_connections  TRIBUTARY_DATABASE__SERVER_MAX_CONNECTIONS (the Postgres max_connections)
  reserved_connections    TRIBUTARY_DATABASE__RESERVED_CONNECTIONS (superuser_reserved_connections,
                          migrations, admin and monitoring sessions)
  and TRIBUTARY_DATABASE__MAX_REPLICAS >= pods, so the gateway's own start-up check covers the fleet.

Compose (docker-compose.yml, with --compose):
  the postgres service's `-c max_connections=N` equals the gateway's SERVER_MAX_CONNECTIONS, and the
  pools of every service with a DATABASE_URL fit in N - RESERVED_CONNECTIONS.

Usage: check-pool-budget.py [--rendered FILE|-] [--compose docker-compose.yml]
Without --rendered it renders k8s/ with `kubectl kustomize`. Exits 1 when an inequality fails or a
number is missing (a budget nobody declared is not a budget).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import manifests  # noqa: E402

POOL_KEY = "TRIBUTARY_DATABASE__MAX_CONNECTIONS"
SERVER_MAX_KEY = "TRIBUTARY_DATABASE__SERVER_MAX_CONNECTIONS"
RESERVED_KEY = "TRIBUTARY_DATABASE__RESERVED_CONNECTIONS"
MAX_REPLICAS_KEY = "TRIBUTARY_DATABASE__MAX_REPLICAS"


def surge_pods(deployment: dict, replicas: int) -> int:
    strategy = deployment["spec"].get("strategy", {})
    if strategy.get("type", "RollingUpdate") != "RollingUpdate":
        return 0  # Recreate: old pods are gone before new ones start
    surge = strategy.get("rollingUpdate", {}).get("maxSurge", "25%")  # Kubernetes' default
    if isinstance(surge, str) and surge.endswith("%"):
        return math.ceil(replicas * int(surge[:-1]) / 100)
    return int(surge)


def check_kubernetes(docs: list[dict]) -> list[str]:
    failures = []
    hpas = manifests.find(docs, "HorizontalPodAutoscaler")
    if not hpas:
        return ["k8s: no HorizontalPodAutoscaler in the rendered manifests"]
    for hpa in hpas:
        ref = hpa["spec"]["scaleTargetRef"]
        deployment = manifests.one(docs, ref["kind"], ref["name"])
        env = manifests.container_env(deployment, docs)
        missing = [k for k in (POOL_KEY, SERVER_MAX_KEY, RESERVED_KEY, MAX_REPLICAS_KEY) if k not in env]
        if missing:
            failures.append(f"k8s: Deployment/{ref['name']} does not set {', '.join(missing)} (set them explicitly)")
            continue
        pool, pg_max = int(env[POOL_KEY]), int(env[SERVER_MAX_KEY])
        reserve, declared = int(env[RESERVED_KEY]), int(env[MAX_REPLICAS_KEY])
        max_replicas = int(hpa["spec"]["maxReplicas"])
        surge = surge_pods(deployment, max_replicas)
        pods = max_replicas + surge
        need, have = pool * pods, pg_max - reserve
        verdict, op = ("ok", "<=") if need <= have else ("FAIL", ">")
        print(
            f"{verdict}: k8s HPA/{hpa['metadata']['name']}: pool {pool} x (maxReplicas {max_replicas}"
            f" + maxSurge {surge}) = {need} {op} server_max_connections {pg_max} - reserved {reserve} = {have}"
        )
        if need > have:
            failures.append(
                f"k8s: {need} connections needed at maxReplicas, {have} available; with pool {pool} "
                f"maxReplicas can be at most {have // pool - surge}, or lower the pool to {have // pods}"
            )
        verdict, op = ("ok", ">=") if declared >= pods else ("FAIL", "<")
        print(f"{verdict}: k8s {MAX_REPLICAS_KEY} {declared} {op} maxReplicas + maxSurge = {pods}"
              " (the gateway's start-up check covers the whole fleet)")
        if declared < pods:
            failures.append(f"k8s: {MAX_REPLICAS_KEY} is {declared}, the fleet can have {pods} pods")
    return failures


def check_compose(path: Path) -> list[str]:
    compose = yaml.safe_load(path.read_text())
    services = compose.get("services", {})
    postgres = [s for s in services.values() if str(s.get("image", "")).startswith("postgres")]
    if len(postgres) != 1:
        return [f"compose: expected one postgres service, found {len(postgres)}"]
    command = postgres[0].get("command", "")
    command = " ".join(command) if isinstance(command, list) else str(command)
    m = re.search(r"max_connections=(\d+)", command)
    if not m:
        return ["compose: the postgres service does not set max_connections explicitly"]
    pg_max = int(m.group(1))
    failures, pools, reserves = [], {}, set()
    for name, svc in services.items():
        env = svc.get("environment", {}) or {}
        if isinstance(env, list):
            env = dict(e.split("=", 1) for e in env)
        if "DATABASE_URL" not in env:
            continue
        missing = [k for k in (POOL_KEY, SERVER_MAX_KEY, RESERVED_KEY) if k not in env]
        if missing:
            failures.append(f"compose: service {name} has a DATABASE_URL but does not set {', '.join(missing)}")
            continue
        if int(env[SERVER_MAX_KEY]) != pg_max:
            failures.append(f"compose: service {name} has {SERVER_MAX_KEY}={env[SERVER_MAX_KEY]}, "
                            f"but postgres runs with max_connections={pg_max}")
        reserves.add(int(env[RESERVED_KEY]))
        pools[name] = int(env[POOL_KEY]) * int(svc.get("deploy", {}).get("replicas", 1))
    if failures or not pools:
        return failures or ["compose: no service with a DATABASE_URL"]
    reserve = max(reserves)
    need, have = sum(pools.values()), pg_max - reserve
    terms = " + ".join(f"{n} {p}" for n, p in pools.items())
    verdict, op = ("ok", "<=") if need <= have else ("FAIL", ">")
    print(f"{verdict}: compose: {terms} = {need} {op} max_connections {pg_max} - reserved {reserve} = {have}")
    return [] if need <= have else [f"compose: pools need {need} connections, {have} available"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rendered", help="kustomize output (file or '-'); default: render k8s/")
    ap.add_argument("--compose", type=Path, help="also check this docker-compose.yml")
    args = ap.parse_args()
    failures = check_kubernetes(manifests.load(args.rendered))
    if args.compose:
        failures += check_compose(args.compose)
    for f in failures:
        print(f"error: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
