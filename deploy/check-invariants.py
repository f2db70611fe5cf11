#!/usr/bin/env python3
"""Cross-file invariants of the deployment artefacts that no schema can see.

Schemas (kubernetes-validate, the compose spec) say each file is well-formed; this says the files
agree with each other and with the gateway's contract. Each invariant prints one `ok`/`FAIL` line.

Kubernetes (kustomize-rendered k8s/ plus k8s/prometheus-adapter/config.yaml and the Dockerfile):
  - terminationGracePeriodSeconds > preStop sleep + server.drain_timeout
  - readiness probe on /readyz, liveness on /healthz, on a declared container port
  - restricted security context; requests and limits on every container; the pod's runAsUser is the
    Dockerfile's final numeric USER
  - Service, PDB and ServiceMonitor select the Deployment's pods / the Service, by existing port names
  - PDB never allows all of minReplicas to be disrupted at once
  - every custom metric of the HPA is served by a prometheus-adapter rule (name.as), and every
    series those rules read is a metric the gateway exports (listed below)
  - the HPA does not fight a fixed spec.replicas, and has a scale-down stabilisation window
Docker: the files the build needs (Cargo manifests, .cargo/config.toml, every target path of
  Cargo.toml, migrations/, config/, each COPY source) exist and are not excluded by .dockerignore
Compose (docker-compose.yml plus the Prometheus and Grafana files it mounts):
  - every bind-mount source exists in the repository
  - the gateway's downstream/OTLP URLs and Prometheus' scrape targets name compose services on the
    ports those services listen on; prometheus rule_files resolve to mounted files
  - the Grafana dashboard provider reads the folder grafana/dashboards is mounted at, and the
    datasource URL names the prometheus service
  - the gateway waits for migrate-seed to complete and for each service it calls

Usage: check-invariants.py [--rendered FILE|-] [--compose docker-compose.yml] [--quiet]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from urllib.parse import urlsplit

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import manifests  # noqa: E402

REPO = manifests.REPO

# Metric names the adapter rules may read: the gateway's /metrics (contract, "Metrics").
GATEWAY_METRICS = {
    "http_server_request_duration_seconds", "tributary_http_requests_total", "http_server_active_requests",
    "tributary_admission_permits_in_use", "tributary_admission_limit", "tributary_admission_wait_seconds",
    "tributary_admission_rejections_total", "tributary_admission_shedding",
    "tributary_downstream_requests_total", "tributary_downstream_in_flight",
    "tributary_db_pool_connections", "tributary_db_pool_max_connections", "tributary_db_pool_waiters",
    "process_cpu_seconds_total", "process_resident_memory_bytes",
}
DEFAULT_DRAIN_TIMEOUT = "20s"  # server.drain_timeout default

results: list[tuple[bool, str]] = []


def check(ok: bool, what: str) -> None:
    results.append((bool(ok), what))


def k8s(docs: list[dict]) -> None:
    dep = manifests.one(docs, "Deployment", "tributary")
    pod = dep["spec"]["template"]["spec"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    ctr = pod["containers"][0]
    env = manifests.container_env(dep, docs)

    # Graceful termination: the kubelet SIGKILLs when the grace period runs out.
    grace = pod.get("terminationGracePeriodSeconds", 30)
    pre = ctr.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre:
        pre_s = pre["sleep"]["seconds"]
    elif "exec" in pre and pre["exec"]["command"][:1] == ["sleep"]:
        pre_s = float(pre["exec"]["command"][1])
    else:
        pre_s = None
    drain = manifests.parse_duration(env.get("TRIBUTARY_SERVER__DRAIN_TIMEOUT", DEFAULT_DRAIN_TIMEOUT))
    check(pre_s is not None and pre_s > 0, f"preStop delay present ({pre_s} s)")
    check(
        pre_s is not None and grace > pre_s + drain,
        f"terminationGracePeriodSeconds {grace} > preStop {pre_s} + drain_timeout {drain:g}",
    )

    # Probes.
    port_names = {p.get("name") for p in ctr.get("ports", [])} | {p["containerPort"] for p in ctr.get("ports", [])}
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = ctr.get(probe, {}).get("httpGet", {})
        check(
            get.get("path") == path and get.get("port") in port_names,
            f"{probe} is httpGet {path} on a declared port (found {get.get('path')} on {get.get('port')})",
        )
    listen_port = int(env.get("TRIBUTARY_SERVER__LISTEN", "0.0.0.0:8080").rsplit(":", 1)[1])
    check(
        listen_port in {p["containerPort"] for p in ctr.get("ports", [])},
        f"server.listen port {listen_port} is a containerPort",
    )
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        port = ctr.get(probe, {}).get("httpGet", {}).get("port")
        numbers = {p.get("name"): p["containerPort"] for p in ctr.get("ports", [])}
        if port is not None:
            check(numbers.get(port, port) == listen_port,
                  f"{probe} probes the API's port {listen_port}, not the operations port")
    ops_port = int(env.get("TRIBUTARY_SERVER__OPS_LISTEN", "0.0.0.0:9090").rsplit(":", 1)[1])
    ops_names = {p.get("name") for p in ctr.get("ports", []) if p["containerPort"] == ops_port}
    check(ops_names != set(), f"server.ops_listen port {ops_port} is a containerPort")

    # Security context (the namespace enforces the restricted Pod Security Standard).
    psc, csc = pod.get("securityContext", {}), ctr.get("securityContext", {})
    check(psc.get("runAsNonRoot") or csc.get("runAsNonRoot"), "runAsNonRoot")
    check(csc.get("readOnlyRootFilesystem") is True, "readOnlyRootFilesystem")
    check(csc.get("allowPrivilegeEscalation") is False, "allowPrivilegeEscalation false")
    check(csc.get("capabilities", {}).get("drop") == ["ALL"], "capabilities drop ALL")
    check(
        (csc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type") == "RuntimeDefault",
        "seccompProfile RuntimeDefault",
    )
    users = re.findall(r"^USER\s+(\S+)", (REPO / "Dockerfile").read_text(), re.M)
    image_uid = users[-1].split(":")[0] if users else None
    run_as = csc.get("runAsUser", psc.get("runAsUser"))
    check(str(run_as) == image_uid, f"pod runAsUser {run_as} is the image's USER {image_uid}")
    for c in pod["containers"]:
        res = c.get("resources", {})
        check(
            {"cpu", "memory"} <= set(res.get("requests", {})) and {"cpu", "memory"} <= set(res.get("limits", {})),
            f"container {c['name']} has cpu/memory requests and limits",
        )

    # Selection by labels and ports.
    def selects(selector: dict, labels: dict) -> bool:
        return bool(selector) and all(labels.get(k) == v for k, v in selector.items())

    svc = manifests.one(docs, "Service", "tributary")
    check(selects(svc["spec"]["selector"], pod_labels), "Service selects the Deployment's pods")
    for p in svc["spec"]["ports"]:
        check(p.get("targetPort") in port_names, f"Service port {p.get('name')} targets a container port")
    pdb = manifests.one(docs, "PodDisruptionBudget")
    check(selects(pdb["spec"]["selector"]["matchLabels"], pod_labels), "PDB selects the Deployment's pods")
    for sm in manifests.find(docs, "ServiceMonitor"):
        check(selects(sm["spec"]["selector"]["matchLabels"], svc["metadata"].get("labels", {})),
              f"ServiceMonitor/{sm['metadata']['name']} selects the Service")
        ops_svc_ports = {p.get("name") for p in svc["spec"]["ports"]
                         if p.get("targetPort") in ops_names | {ops_port}}
        for ep in sm["spec"]["endpoints"]:
            check(ep.get("port") in ops_svc_ports and ep.get("path", "/metrics") == "/metrics",
                  f"ServiceMonitor endpoint scrapes /metrics on the Service port of server.ops_listen "
                  f"(found {ep.get('port')})")

    # HPA.
    hpa = manifests.one(docs, "HorizontalPodAutoscaler")
    ref = hpa["spec"]["scaleTargetRef"]
    check(ref["kind"] == "Deployment" and ref["name"] == dep["metadata"]["name"], "HPA targets the Deployment")
    check("replicas" not in dep["spec"], "Deployment leaves spec.replicas to the HPA")
    min_r = hpa["spec"].get("minReplicas", 1)
    max_unavail = pdb["spec"].get("maxUnavailable")
    if max_unavail is not None:
        check(isinstance(max_unavail, int) and min_r - max_unavail >= 1,
              f"PDB maxUnavailable {max_unavail} leaves >= 1 of minReplicas {min_r} serving")
    else:
        check(pdb["spec"].get("minAvailable", 0) >= 1, "PDB minAvailable >= 1")
    down = hpa["spec"].get("behavior", {}).get("scaleDown", {})
    check(down.get("stabilizationWindowSeconds", 300) >= 60,
          f"HPA scale-down stabilisation window {down.get('stabilizationWindowSeconds', 300)} s >= 60 s")

    adapter = yaml.safe_load((REPO / "k8s/prometheus-adapter/config.yaml").read_text())
    served = {r["name"]["as"]: r for r in adapter["rules"] if "name" in r and "as" in r["name"]}
    for m in hpa["spec"]["metrics"]:
        if m["type"] in ("Pods", "Object", "External"):
            name = m[m["type"].lower()]["metric"]["name"]
            check(name in served, f"HPA metric {name} is served by a prometheus-adapter rule")
    for rule in adapter["rules"]:
        used = set(re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\{", rule["seriesQuery"] + " " + rule["metricsQuery"]))
        unknown = used - GATEWAY_METRICS
        check(not unknown, f"adapter rule {rule['name']['as']} reads gateway metrics only"
              + (f" (unknown: {', '.join(sorted(unknown))})" if unknown else ""))
        check("<<.LabelMatchers>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"],
              f"adapter rule {rule['name']['as']} is scoped by <<.LabelMatchers>> and grouped by <<.GroupBy>>")
    check("TRIBUTARY_ADMISSION__MAX_IN_FLIGHT" in env,
          "admission limit (the utilisation metric's denominator) is set explicitly")


def docker_context() -> None:
    """What the Dockerfile's build needs is in the build context (not excluded by .dockerignore)."""
    patterns = [
        line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def excluded(rel: str) -> bool:
        parts = rel.split("/")
        for pat in patterns:
            pat = pat.rstrip("/")
            if pat.startswith("**/"):
                if pat[3:] in parts:
                    return True
            elif rel == pat or rel.startswith(pat + "/"):
                return True
        return False

    cargo = (REPO / "Cargo.toml").read_text()
    needed = ["Cargo.toml", "Cargo.lock", ".cargo/config.toml", "migrations", "config/default.toml"]
    needed += re.findall(r'^path\s*=\s*"([^"]+)"', cargo, re.M)  # lib, bin, test, example targets
    dockerfile = (REPO / "Dockerfile").read_text()
    for src in re.findall(r"^COPY\s+(?!--from)(?:--\S+\s+)*(\S+)\s", dockerfile, re.M):
        if src != ".":
            needed.append(src.rstrip("/"))
    for rel in dict.fromkeys(needed):
        check((REPO / rel).exists() and not excluded(rel),
              f"docker build context contains {rel} (exists, not excluded by .dockerignore)")


def compose(path: Path) -> None:
    base = path.absolute().parent
    spec = yaml.safe_load(path.read_text())
    services = spec["services"]

    def mounts(svc: dict) -> list[tuple[Path, str]]:
        out = []
        for v in svc.get("volumes", []):
            src, _, rest = str(v).partition(":") if isinstance(v, str) else (v.get("source", ""), "", v.get("target", ""))
            if src.startswith((".", "/")):
                out.append((Path(os.path.normpath(base / src)), rest.split(":")[0]))
        return out

    for name, svc in services.items():
        for src, _ in mounts(svc):
            check(src.exists(), f"compose {name}: bind mount {src.relative_to(base)} exists")

    def ops_port(name: str) -> int | None:
        env = services.get(name, {}).get("environment", {}) or {}
        if "TRIBUTARY_SERVER__LISTEN" not in env:
            return None
        return int(str(env.get("TRIBUTARY_SERVER__OPS_LISTEN", "0.0.0.0:9090")).rsplit(":", 1)[1])

    def listen_port(name: str) -> int | None:
        env = services.get(name, {}).get("environment", {}) or {}
        for key in ("TRIBUTARY_SERVER__LISTEN", "SIM_LISTEN"):
            if key in env:
                return int(str(env[key]).rsplit(":", 1)[1])
        known = {"postgres": 5432, "prometheus": 9090, "grafana": 3000, "jaeger": 4318}
        return known.get(name)

    gw = services["gateway"]
    gw_env = gw["environment"]
    deps = gw.get("depends_on", {})
    check(deps.get("migrate-seed", {}).get("condition") == "service_completed_successfully",
          "compose gateway waits for migrate-seed to complete")
    for key, value in gw_env.items():
        if key.endswith("__BASE_URL") or (key.startswith("TRIBUTARY_TELEMETRY__OTLP_") and key.endswith("_ENDPOINT")) or key == "DATABASE_URL":
            u = urlsplit(str(value))
            host, port = u.hostname, u.port
            ok = host in services and port == listen_port(host) and host in deps
            check(ok, f"compose gateway {key} -> {host}:{port} is a service it depends on, on its port")

    prom = services["prometheus"]
    prom_mounts = {target: src for src, target in mounts(prom)}
    cfg_src = prom_mounts.get("/etc/prometheus/prometheus.yml")
    check(cfg_src is not None, "compose prometheus mounts prometheus.yml at /etc/prometheus/prometheus.yml")
    if cfg_src is not None and cfg_src.exists():
        cfg = yaml.safe_load(cfg_src.read_text())
        for rf in cfg.get("rule_files", []):
            target = str(Path("/etc/prometheus") / rf)
            check(target in prom_mounts, f"prometheus rule_files {rf} resolves to a mounted file ({target})")
        targets = [t for sc in cfg.get("scrape_configs", []) for st in sc.get("static_configs", []) for t in st["targets"]]
        check(f"gateway:{ops_port('gateway')}" in targets,
              "prometheus scrapes gateway on its operations port (server.ops_listen)")
        for t in targets:
            host, _, port = t.rpartition(":")
            if host not in ("localhost", "127.0.0.1"):
                check(host in services and int(port) in {listen_port(host), ops_port(host)},
                      f"prometheus target {t} is a compose service on its port")

    graf = services["grafana"]
    graf_mounts = {src: target for src, target in mounts(graf)}
    prov = graf_mounts.get(base / "grafana/provisioning")
    dash_target = graf_mounts.get(base / "grafana/dashboards")
    check(prov == "/etc/grafana/provisioning", "compose grafana mounts grafana/provisioning at /etc/grafana/provisioning")
    for f in sorted((base / "grafana/provisioning/dashboards").glob("*.y*ml")):
        for p in yaml.safe_load(f.read_text()).get("providers", []):
            check(p.get("options", {}).get("path") == dash_target,
                  f"grafana provider {p.get('name')} reads {p.get('options', {}).get('path')}, "
                  f"where grafana/dashboards is mounted ({dash_target})")
    for f in sorted((base / "grafana/provisioning/datasources").glob("*.y*ml")):
        for ds in yaml.safe_load(f.read_text()).get("datasources", []):
            u = urlsplit(ds.get("url", ""))
            check(u.hostname in services and u.port == listen_port(u.hostname),
                  f"grafana datasource {ds.get('name')} URL {ds.get('url')} is a compose service")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rendered", help="kustomize output of k8s/ (file or '-'); default: render it")
    ap.add_argument("--compose", type=Path, default=REPO / "docker-compose.yml")
    ap.add_argument("--quiet", action="store_true", help="print only the broken invariants and the count")
    args = ap.parse_args()
    k8s(manifests.load(args.rendered))
    docker_context()
    compose(args.compose)
    for ok, what in results:
        if not (ok and args.quiet):
            print(f"{'ok  ' if ok else 'FAIL'} {what}")
    failed = sum(1 for ok, _ in results if not ok)
    print(f"{len(results) - failed} invariants hold, {failed} broken")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
