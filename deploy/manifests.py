"""Shared helpers for the deploy/ checkers: load kustomize-rendered manifests and read typed values
(durations, quantities, a container's effective environment) out of them.

Imported by check-pool-budget.py, check-k8s-invariants.py and hpa-sim.py; not a command itself.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def render(kustomize_dir: Path) -> str:
    """`kubectl kustomize DIR` (the binary can be overridden with $KUBECTL)."""
    kubectl = os.environ.get("KUBECTL", "kubectl")
    out = subprocess.run(
        [kubectl, "kustomize", str(kustomize_dir)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.stdout


def load(rendered: str | None, kustomize_dir: Path | None = None) -> list[dict]:
    """Documents of a rendered manifest stream: from a file, '-' for stdin, or by rendering."""
    if rendered == "-":
        text = sys.stdin.read()
    elif rendered:
        text = Path(rendered).read_text()
    else:
        text = render(kustomize_dir or REPO / "k8s")
    return [d for d in yaml.safe_load_all(text) if d]


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [
        d
        for d in docs
        if d.get("kind") == kind and (name is None or d.get("metadata", {}).get("name") == name)
    ]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = find(docs, kind, name)
    if len(found) != 1:
        what = f"{kind}/{name}" if name else kind
        raise SystemExit(f"expected exactly one {what} in the rendered manifests, found {len(found)}")
    return found[0]


def container_env(deployment: dict, docs: list[dict], container: int = 0) -> dict[str, str]:
    """The environment a container of `deployment` starts with, as far as ConfigMaps decide it:
    envFrom configMapRef first, then `env` (literal values and configMapKeyRef) on top, which is
    Kubernetes' precedence. Secret-backed variables are reported as '<secret>'."""
    spec = deployment["spec"]["template"]["spec"]["containers"][container]
    env: dict[str, str] = {}

    def configmap(name: str) -> dict[str, str]:
        return {k: str(v) for k, v in one(docs, "ConfigMap", name).get("data", {}).items()}

    for source in spec.get("envFrom", []):
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            env.update({prefix + k: v for k, v in configmap(source["configMapRef"]["name"]).items()})
        elif "secretRef" in source:
            for d in find(docs, "Secret", source["secretRef"]["name"]):
                keys = list(d.get("data", {})) + list(d.get("stringData", {}))
                env.update({prefix + k: "<secret>" for k in keys})
    for var in spec.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
        elif "configMapKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["configMapKeyRef"]
            env[var["name"]] = configmap(ref["name"])[ref["key"]]
        else:
            env[var["name"]] = "<secret>" if "secretKeyRef" in var.get("valueFrom", {}) else "<field>"
    return env


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")


def parse_duration(text: str) -> float:
    """'20s', '100ms', '1m30s' -> seconds (the humantime subset used in config/default.toml)."""
    text = text.strip()
    pos, total = 0, 0.0
    for m in _DURATION.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise ValueError(f"not a duration: {text!r}")
    return total


_QUANTITY = re.compile(r"^([+-]?\d+(?:\.\d+)?)(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")
_SUFFIX = {
    None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
}


def parse_quantity(value: str | int | float) -> float:
    """Kubernetes resource quantity ('600m', '1', '512Mi') -> float."""
    m = _QUANTITY.match(str(value).strip())
    if not m:
        raise ValueError(f"not a quantity: {value!r}")
    return float(m.group(1)) * _SUFFIX[m.group(2)]
