#!/usr/bin/env python3
"""Checks the Postgres connection budget of the Kubernetes fleet and of the compose stack.

Kubernetes (from the kustomize-rendered manifests):

    pool x (HPA maxReplicas + Deployment maxSurge) <= postgres max_connections - reserve

  pool             TRIBUTARY_DATABASE__MAX_CONNECTIONS in the gateway container's environment
                   (the generated ConfigMap tributary-config)
  maxReplicas      the HPA whose scaleTargetRef is the Deployment
  maxSurge         the Deployment's rollingUpdate.maxSurge: during a rollout at maxReplicas the
                   surge pods hold their own pools (a percentage is resolved against maxReplicas,
                   rounded up, as the Deployment controller does)
  max_connections  Deployment annotation tributary/postgres-max-connections
  reserve          Deployment annotation tributary/postgres-reserved-connections
                   (superuser_reserved_connections, migrations, admin and monitoring sessions)

Compose (docker-compose.yml, with --compose):

    sum of pools of the services with a DATABASE_URL <= postgres max_connections - reserve

  max_connections  the `-c max_connections=N` in the postgres service's command
  reserve          the top-level extension field x-postgres-reserved-connections

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
ANN_MAX = "tributary/postgres-max-connections"
ANN_RESERVE = "tributary/postgres-reserved-connections"


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
        annotations = deployment["metadata"].get("annotations", {})
        missing = [a for a in (ANN_MAX, ANN_RESERVE) if a not in annotations]
        if missing:
            failures.append(f"k8s: Deployment/{ref['name']} lacks annotation(s) {', '.join(missing)}")
            continue
        env = manifests.container_env(deployment, docs)
        if POOL_KEY not in env:
            failures.append(f"k8s: {POOL_KEY} is not set for Deployment/{ref['name']} (set it explicitly)")
            continue
        pool = int(env[POOL_KEY])
        max_replicas = int(hpa["spec"]["maxReplicas"])
        surge = surge_pods(deployment, max_replicas)
        pg_max = int(annotations[ANN_MAX])
        reserve = int(annotations[ANN_RESERVE])
        need = pool * (max_replicas + surge)
        have = pg_max - reserve
        verdict, op = ("ok", "<=") if need <= have else ("FAIL", ">")
        print(
            f"{verdict}: k8s HPA/{hpa['metadata']['name']}: pool {pool} x (maxReplicas {max_replicas}"
            f" + maxSurge {surge}) = {need} {op} max_connections {pg_max} - reserve {reserve} = {have}"
        )
        if need > have:
            largest = have // pool - surge
            failures.append(
                f"k8s: {need} connections needed at maxReplicas, {have} available; with pool {pool} "
                f"maxReplicas can be at most {largest}, or lower the pool to {have // (max_replicas + surge)}"
            )
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
    if "x-postgres-reserved-connections" not in compose:
        return ["compose: top-level x-postgres-reserved-connections is missing"]
    pg_max, reserve = int(m.group(1)), int(compose["x-postgres-reserved-connections"])
    pools = {}
    for name, svc in services.items():
        env = svc.get("environment", {}) or {}
        if isinstance(env, list):
            env = dict(e.split("=", 1) for e in env)
        if "DATABASE_URL" in env:
            if POOL_KEY not in env:
                return [f"compose: service {name} has a DATABASE_URL but no explicit {POOL_KEY}"]
            replicas = int(svc.get("deploy", {}).get("replicas", 1))
            pools[name] = int(env[POOL_KEY]) * replicas
    need, have = sum(pools.values()), pg_max - reserve
    terms = " + ".join(f"{n} {p}" for n, p in pools.items())
    verdict, op = ("ok", "<=") if need <= have else ("FAIL", ">")
    print(f"{verdict}: compose: {terms} = {need} {op} max_connections {pg_max} - reserve {reserve} = {have}")
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
