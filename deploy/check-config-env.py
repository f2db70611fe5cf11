#!/usr/bin/env python3
"""Runs `tributary check-config` with exactly the environment each deployment gives the gateway.

The gateway rejects unknown configuration keys and invalid values (durations, addresses, limits), so
this catches a misspelt TRIBUTARY_* variable or a bad value in the deployment files before any
cluster or container sees it:
  - k8s: the gateway container's effective environment from the rendered manifests (the generated
    ConfigMap), with the Secret's DATABASE_URL placeholder
  - compose: the environment of every service whose command runs `tributary`
Each runs in the repository root, where config/default.toml is found, as under the image's WORKDIR.

Usage: check-config-env.py BIN [--rendered FILE|-] [--compose docker-compose.yml]
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import manifests  # noqa: E402


def run(binary: str, label: str, env: dict[str, str]) -> bool:
    base = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    proc = subprocess.run(
        [binary, "check-config"], env={**base, **env}, cwd=manifests.REPO,
        capture_output=True, text=True, timeout=60,
    )
    if proc.returncode == 0:
        print(f"ok   {label}: accepted by tributary check-config ({len(env)} variables)")
        return True
    print(f"FAIL {label}: tributary check-config exited {proc.returncode}")
    for line in (proc.stderr or proc.stdout).strip().splitlines()[-5:]:
        print(f"     {line}")
    return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary")
    ap.add_argument("--rendered", help="kustomize output of k8s/ (file or '-'); default: render it")
    ap.add_argument("--compose", type=Path, default=manifests.REPO / "docker-compose.yml")
    args = ap.parse_args()
    ok = True

    docs = manifests.load(args.rendered)
    for dep in manifests.find(docs, "Deployment"):
        env = manifests.container_env(dep, docs)
        for key, value in list(env.items()):
            if value == "<secret>":  # the Secret is a placeholder; read its value from the manifest
                for secret in manifests.find(docs, "Secret"):
                    data = secret.get("stringData", {})
                    if key in data:
                        env[key] = str(data[key])
        ok &= run(args.binary, f"k8s Deployment/{dep['metadata']['name']}", env)

    compose = yaml.safe_load(args.compose.read_text())
    for name, svc in compose["services"].items():
        cmd = svc.get("command", [])
        words = shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]
        if "tributary" not in " ".join(words).split():
            continue
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        ok &= run(args.binary, f"compose service {name}", env)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
