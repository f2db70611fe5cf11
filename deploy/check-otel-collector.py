#!/usr/bin/env python3
"""Static checks of the compose stack's collector variant (docker-compose.otel.yml).

The collector image cannot be pulled on CI machines (no image registry) and has no Debian package,
so its own `otelcol validate` cannot run; this checks what such a run would reject and what only
the files together can tell. Input: the merged compose file (`docker-compose -f docker-compose.yml
-f docker-compose.otel.yml config`). Each check prints one `ok`/`FAIL` line.

  - the collector service runs a pinned image with the config file it mounts, which exists
  - the collector config: every component a pipeline names is defined under its kind, every
    defined component is used, every component's type is one the contrib distribution has (a
    short list: the types this config may use), there is a traces and a metrics pipeline, and
    memory_limiter comes first where it is used
  - the gateway sends OTLP to the collector: each of its OTLP endpoints (OTEL_EXPORTER_OTLP_* and
    the telemetry.otlp_* keys) names the collector on its OTLP/HTTP receiver's port, and the
    gateway depends on the collector
  - the trace exporter's endpoint is a compose service the collector depends on, on its OTLP
    port; the prometheus exporter's port is a target of the Prometheus config mounted in the
    merged file, scraped with honor_labels (so job/instance come from the resource)

Usage: check-otel-collector.py MERGED_COMPOSE [--collector-config FILE]
  --collector-config replaces the mounted config (the negative check feeds a broken copy).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from urllib.parse import urlsplit

import yaml

COLLECTOR = "otel-collector"
CONFIG_TARGET = "/etc/otelcol-contrib/config.yaml"
# Component types of otelcol-contrib that this config may name (type = the part before "/").
KNOWN = {
    "receivers": {"otlp", "prometheus", "hostmetrics"},
    "processors": {"batch", "memory_limiter", "resource", "attributes", "transform", "filter"},
    "exporters": {"otlp_grpc", "otlp_http", "otlp", "otlphttp", "prometheus", "prometheusremotewrite", "debug"},
    "extensions": {"health_check", "pprof", "zpages"},
    "connectors": {"spanmetrics", "count"},
}
# OTLP ports of the services the collector may export to.
OTLP_PORTS = {"jaeger": {4317, 4318}}

results: list[tuple[bool, str]] = []


def check(ok: bool, what: str) -> None:
    results.append((bool(ok), what))


def mounts(svc: dict) -> dict[str, Path]:
    """target -> source, for bind mounts (the merged file has absolute sources)."""
    out = {}
    for v in svc.get("volumes") or []:
        if isinstance(v, str):
            parts = v.split(":")
            if len(parts) >= 2 and parts[0].startswith(("/", ".")):
                out[parts[1]] = Path(parts[0])
        elif v.get("type") == "bind":
            out[v["target"]] = Path(v["source"])
    return out


def host_port(endpoint: str) -> tuple[str | None, int | None]:
    u = urlsplit(endpoint if "://" in endpoint else f"//{endpoint}")
    return u.hostname, u.port


def collector_config(cfg: dict) -> None:
    pipelines = (cfg.get("service") or {}).get("pipelines") or {}
    check(any(p.split("/")[0] == "traces" for p in pipelines), "collector: a traces pipeline")
    check(any(p.split("/")[0] == "metrics" for p in pipelines), "collector: a metrics pipeline")
    used: dict[str, set[str]] = {"receivers": set(), "processors": set(), "exporters": set()}
    for name, p in pipelines.items():
        for kind in ("receivers", "exporters"):
            check(bool(p.get(kind)), f"collector: pipeline {name} has {kind}")
        for kind in used:
            for comp in p.get(kind) or []:
                used[kind].add(comp)
                check(comp in (cfg.get(kind) or {}) or comp in (cfg.get("connectors") or {}),
                      f"collector: pipeline {name} names {kind[:-1]} {comp}, which is defined")
        procs = p.get("processors") or []
        if any(c.split("/")[0] == "memory_limiter" for c in procs):
            check(procs[0].split("/")[0] == "memory_limiter", f"collector: pipeline {name} runs memory_limiter first")
    for kind in ("receivers", "processors", "exporters", "extensions", "connectors"):
        for comp in cfg.get(kind) or {}:
            check(comp.split("/")[0] in KNOWN[kind], f"collector: {kind[:-1]} {comp} is a known component type")
            if kind in used:
                check(comp in used[kind], f"collector: {kind[:-1]} {comp} is used by a pipeline")
    for ext in (cfg.get("service") or {}).get("extensions") or []:
        check(ext in (cfg.get("extensions") or {}), f"collector: service extension {ext} is defined")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("compose", type=Path)
    ap.add_argument("--collector-config", type=Path)
    args = ap.parse_args()
    services = yaml.safe_load(args.compose.read_text())["services"]

    col = services.get(COLLECTOR)
    check(col is not None, f"compose: a service {COLLECTOR}")
    if col is None:
        return report()
    image = str(col.get("image", ""))
    tag = image.rpartition(":")[2] if ":" in image else ""
    check(image.startswith("otel/opentelemetry-collector-contrib:") and tag not in ("", "latest"),
          f"compose {COLLECTOR}: a pinned otelcol-contrib image ({image})")
    cmd = " ".join(col.get("command") or [])
    check(f"--config={CONFIG_TARGET}" in cmd, f"compose {COLLECTOR}: runs with --config={CONFIG_TARGET}")
    src = args.collector_config or mounts(col).get(CONFIG_TARGET)
    check(src is not None and src.exists(), f"compose {COLLECTOR}: mounts an existing config at {CONFIG_TARGET} ({src})")
    if src is None or not src.exists():
        return report()
    cfg = yaml.safe_load(src.read_text())
    check(isinstance(cfg, dict), f"collector: {src.name} parses as a YAML mapping")
    if not isinstance(cfg, dict):
        return report()
    collector_config(cfg)

    receivers = cfg.get("receivers") or {}
    exporters = cfg.get("exporters") or {}
    http = ((receivers.get("otlp") or {}).get("protocols") or {}).get("http") or {}
    http_port = host_port(str(http.get("endpoint", "")))[1]
    check(http_port is not None, f"collector: the otlp receiver speaks OTLP/HTTP (port {http_port})")

    gw = services["gateway"]
    env = {k: str(v) for k, v in (gw.get("environment") or {}).items()}
    endpoints = {k: v for k, v in env.items()
                 if k.startswith("OTEL_EXPORTER_OTLP") and k.endswith("ENDPOINT")
                 or k.startswith("TRIBUTARY_TELEMETRY__OTLP") and k.endswith("ENDPOINT")}
    check(bool(endpoints), "compose gateway: has an OTLP endpoint")
    for key, value in endpoints.items():
        host, port = host_port(value)
        check(host == COLLECTOR and port == http_port,
              f"compose gateway {key}={value} is the collector's OTLP/HTTP receiver ({COLLECTOR}:{http_port})")
    check(COLLECTOR in (gw.get("depends_on") or {}), f"compose gateway depends on {COLLECTOR}")

    col_deps = col.get("depends_on") or {}
    for name, exp in exporters.items():
        kind = name.split("/")[0]
        if kind in ("otlp_grpc", "otlp", "otlp_http", "otlphttp"):
            host, port = host_port(str(exp.get("endpoint", "")))
            check(host in services and host in col_deps and port in OTLP_PORTS.get(host, set()),
                  f"collector exporter {name} -> {host}:{port} is a service the collector depends on, on its OTLP port")
        if kind == "prometheus":
            port = host_port(str(exp.get("endpoint", "")))[1]
            prom_cfg = mounts(services.get("prometheus", {})).get("/etc/prometheus/prometheus.yml")
            jobs = yaml.safe_load(prom_cfg.read_text()).get("scrape_configs", []) if prom_cfg and prom_cfg.exists() else []
            scraping = [j for j in jobs for sc in j.get("static_configs", []) if f"{COLLECTOR}:{port}" in sc.get("targets", [])]
            check(bool(scraping), f"prometheus ({prom_cfg.name if prom_cfg else 'no config'}) scrapes the collector's prometheus exporter ({COLLECTOR}:{port})")
            check(all(j.get("honor_labels") is True for j in scraping) and bool(scraping),
                  "prometheus keeps the exporter's job and instance (honor_labels: true)")
    return report()


def report() -> int:
    for ok, what in results:
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
    failed = sum(1 for ok, _ in results if not ok)
    print(f"{len(results) - failed} collector checks hold, {failed} broken")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
