#!/usr/bin/env bash
# Static checks of the deployment artefacts: Dockerfile, docker-compose.yml (and its collector
# variant docker-compose.otel.yml), k8s/ and deploy/.
#
#   bash .ci/check-deploy.sh          # from anywhere; BIN_DIR selects the gateway binary (target/debug)
#
# No Docker engine and no Kubernetes API server exist on CI machines, so every check here is a real
# validator run offline against the files (deploy/README.md lists what each one proves). Installs what
# it needs on a fresh machine, idempotently, and says so: Python validators into the virtualenv under
# the build directory (target/venv, by scripts/venv.sh), the npm validators into
# deploy/validate/node_modules (npm ci from the committed lockfile), docker-compose from Debian. Prints one line per check and `check-deploy: N passed, M failed`; exits 1 if any check
# failed. Negative checks ("... rejects ...") feed a deliberately broken copy to a validator and pass
# only if the validator fails on it, so a validator that silently accepts everything is caught.
#
# Not here: the compose-equivalent runtime smoke test (deploy/compose-native-smoke.sh, needs built
# binaries, Postgres and Prometheus) and the evaluation of the prometheus-adapter queries against a
# live Prometheus (done by the observability check).
set -euo pipefail

if [[ -z "${CHECK_DEPLOY_UNDER_TIMEOUT:-}" ]]; then
  exec timeout --signal=TERM --kill-after=30 "${CHECK_DEPLOY_TIMEOUT:-1800}" \
    env CHECK_DEPLOY_UNDER_TIMEOUT=1 bash "$0" "$@"
fi

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
WORK="$(mktemp -d /tmp/check-deploy.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
trap 'exit 143' TERM INT

VALIDATE="$REPO/deploy/validate"
BIN_DIR="${BIN_DIR:-$REPO/target/debug}"
K8S_VERSION=1.33
PASSED=0
FAILED=0

# ---- helpers -------------------------------------------------------------------------------------
# bounded CMD...: CMD (a program or one of the exported functions below) with a 10-minute cap.
bounded() {
  # shellcheck disable=SC2016 # "$@" is expanded by the inner bash, on purpose
  timeout 600 bash -c '"$@"' _ "$@"
}
# check NAME CMD...: runs CMD (bounded), one line of verdict; the output is shown only on failure.
check() {
  local name=$1; shift
  if bounded "$@" >"$WORK/out" 2>&1; then
    printf 'ok   %s\n' "$name"; PASSED=$((PASSED + 1))
  else
    printf 'FAIL %s\n' "$name"; FAILED=$((FAILED + 1))
    sed 's/^/     /' "$WORK/out" | tail -n 40
  fi
}
# rejects NAME CMD...: a negative check; passes only if CMD fails.
rejects() {
  local name=$1; shift
  if bounded "$@" >"$WORK/out" 2>&1; then
    printf 'FAIL %s (the validator accepted a broken input)\n' "$name"; FAILED=$((FAILED + 1))
    sed 's/^/     /' "$WORK/out" | tail -n 20
  else
    printf 'ok   %s\n' "$name"; PASSED=$((PASSED + 1))
  fi
}
setup_failed() { printf 'FAIL setup: %s\n' "$1"; printf 'check-deploy: %d passed, %d failed\n' "$PASSED" "$((FAILED + 1))"; exit 1; }

APT_UPDATED=0
apt_install() { # PACKAGE...: installs what is missing, running apt-get update at most once
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  ((${#missing[@]} == 0)) && return 0
  export DEBIAN_FRONTEND=noninteractive
  echo "installing ${missing[*]} with apt-get"
  if ((APT_UPDATED == 0)); then timeout 300 apt-get update -qq >/dev/null; APT_UPDATED=1; fi
  timeout 600 apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# ---- setup (idempotent) ----------------------------------------------------------------------------
command -v python3 >/dev/null || setup_failed "python3 missing"
VENV="$(timeout 1000 "$REPO/scripts/venv.sh" "$VALIDATE/requirements.txt")" \
  || setup_failed "scripts/venv.sh deploy/validate/requirements.txt"
export PATH="$VENV/bin:$PATH"
export KUBECTL="$VENV/bin/kubectl"   # deploy/manifests.py renders with this one
command -v node >/dev/null && command -v npm >/dev/null || apt_install nodejs npm || setup_failed "node/npm"
[[ -d "$VALIDATE/node_modules" ]] || echo "installing the CRD validators with npm ci in deploy/validate"
(cd "$VALIDATE" && timeout 600 npm ci --no-audit --no-fund --loglevel=error >/dev/null 2>"$WORK/npm.err") \
  || { cat "$WORK/npm.err"; setup_failed "npm ci in deploy/validate"; }
command -v docker-compose >/dev/null || apt_install docker-compose || setup_failed "apt-get install docker-compose"
PY="$VENV/bin/python"
export WORK PY KUBECTL K8S_VERSION

# ---- Dockerfile and shell ------------------------------------------------------------------------------
check "hadolint Dockerfile" hadolint Dockerfile
check "hadolint deploy/standins/*.Containerfile (the CI stand-in images)" hadolint deploy/standins/*.Containerfile
check "shellcheck deploy/*.sh deploy/standins/*.sh .ci/check-deploy.sh .ci/check-containers.sh" \
  shellcheck deploy/compose-native-smoke.sh deploy/standins/postgres-entrypoint.sh .ci/check-deploy.sh \
  .ci/check-containers.sh

# ---- compose ---------------------------------------------------------------------------------------------
check "compose: docker-compose.yml against the compose-spec schema (check-jsonschema)" \
  check-jsonschema --builtin-schema vendor.compose-spec docker-compose.yml
check "compose: docker-compose.yml accepted by docker-compose $(docker-compose version --short 2>/dev/null) config -q" \
  docker-compose -f docker-compose.yml --profile bench config -q
check "compose: docker-compose.yml with the CI override docker-compose.ci.yml accepted by docker-compose config -q" \
  docker-compose -f docker-compose.yml -f docker-compose.ci.yml config -q
# The collector variant: an override file, checked on its own against the schema and merged with
# the base file by compose itself; the merge is what the checks below read.
check "compose: docker-compose.otel.yml (the collector variant) against the compose-spec schema" \
  check-jsonschema --builtin-schema vendor.compose-spec docker-compose.otel.yml
compose_otel() { docker-compose -f docker-compose.yml -f docker-compose.otel.yml config >"$WORK/compose-otel.yml"; }
export -f compose_otel
check "compose: docker-compose.yml with docker-compose.otel.yml accepted by docker-compose config" compose_otel
check "collector variant: pinned image, pipelines name defined components, ports agree with the gateway and Prometheus (deploy/check-otel-collector.py)" \
  "$PY" deploy/check-otel-collector.py "$WORK/compose-otel.yml"
sed 's/exporters: \[prometheus\]/exporters: [prometheusremotewrite]/' deploy/otel-collector.yaml >"$WORK/otel-collector-bad.yaml"
rejects "collector variant: the checker rejects a pipeline naming an undefined exporter" \
  "$PY" deploy/check-otel-collector.py "$WORK/compose-otel.yml" --collector-config "$WORK/otel-collector-bad.yaml"
sed 's/condition: service_completed_successfully/condition: service_completed/' docker-compose.yml >"$WORK/compose-bad.yml"
rejects "compose: the schema check rejects an unknown depends_on condition" \
  check-jsonschema --builtin-schema vendor.compose-spec "$WORK/compose-bad.yml"

# ---- Kubernetes: render ------------------------------------------------------------------------------------
render() { "$KUBECTL" kustomize "$1" >"$2"; }
export -f render
check "k8s: kubectl kustomize k8s/ renders ($("$KUBECTL" version --client 2>/dev/null | head -n1))" \
  render k8s/ "$WORK/k8s.yaml"
check "k8s: kubectl kustomize k8s/prometheus-adapter/ renders" \
  render k8s/prometheus-adapter/ "$WORK/adapter.yaml"

# Splits the rendered streams: built-in kinds go to kubernetes-validate, monitoring.coreos.com kinds to
# the CRD validator; a kind that neither knows fails here rather than being skipped.
split_manifests() {
  "$PY" - "$WORK" "$WORK/k8s.yaml" "$WORK/adapter.yaml" <<'PY'
import sys
from pathlib import Path
import yaml
work = Path(sys.argv[1])
(work / "native").mkdir(exist_ok=True)
(work / "crd").mkdir(exist_ok=True)
n = c = 0
for src in sys.argv[2:]:
    for doc in yaml.safe_load_all(Path(src).read_text()):
        if not doc:
            continue
        group = doc["apiVersion"].split("/")[0] if "/" in doc["apiVersion"] else ""
        name = f"{doc['kind']}-{doc['metadata']['name']}.yaml"
        if group == "monitoring.coreos.com":
            (work / "crd" / name).write_text(yaml.safe_dump(doc)); c += 1
        elif "." in group and not group.endswith(".k8s.io"):
            sys.exit(f"{doc['apiVersion']} {doc['kind']}: no validator for this API group")
        else:
            (work / "native" / name).write_text(yaml.safe_dump(doc)); n += 1
print(f"{n} built-in resources, {c} monitoring.coreos.com resources")
sys.exit(0 if n >= 8 and c >= 1 else f"too few resources rendered ({n} built-in, {c} CRD)")
PY
}
export -f split_manifests
check "k8s: every rendered resource has a validator" split_manifests

# kubernetes-validate only warns (rc 0) about kinds it has no schema for; such a warning fails here.
kubernetes_validate_strict() {
  kubernetes-validate -k "$K8S_VERSION" --strict "$@" >"$WORK/kv.out" 2>&1 || { cat "$WORK/kv.out"; return 1; }
  cat "$WORK/kv.out"
  ! grep -q -E "^(WARN|ERROR)" "$WORK/kv.out"
}
export -f kubernetes_validate_strict
check "k8s: every built-in resource valid for Kubernetes $K8S_VERSION (kubernetes-validate --strict)" \
  kubernetes_validate_strict "$WORK"/native/*.yaml
sed 's/readinessProbe:/readinesProbe:/' "$WORK/native/Deployment-tributary.yaml" >"$WORK/deployment-bad.yaml"
rejects "k8s: kubernetes-validate --strict rejects a misspelt Deployment field" \
  kubernetes_validate_strict "$WORK/deployment-bad.yaml"

# The grey-release example (a canary Deployment of a downstream, its Service and the gateway's routing
# file) is not in the kustomization: the same validator on it, and its routing file through the
# gateway's own check-config.
check "k8s: examples/ valid for Kubernetes $K8S_VERSION (kubernetes-validate --strict)" \
  kubernetes_validate_strict k8s/examples/*.yaml
example_routing_valid() {
  "$PY" - "$WORK/routing.toml" k8s/examples/grey-release.yaml <<'PY'
import sys, yaml
out, manifest = sys.argv[1], sys.argv[2]
maps = [d for d in yaml.safe_load_all(open(manifest)) if d and d.get("kind") == "ConfigMap"]
open(out, "w").write(maps[0]["data"]["routing.toml"])
PY
  env -i "$1" --config "$WORK/routing.toml" check-config >/dev/null
}
export -f example_routing_valid
check "k8s: the example's routing file is accepted by tributary check-config" \
  example_routing_valid "$BIN_DIR/tributary"

# ---- Kubernetes: custom resources ------------------------------------------------------------------------------
check "k8s: ServiceMonitor valid against the prometheus-operator CRD schema and types (kubernetes-models, tsc)" \
  node "$VALIDATE/validate-crds.mjs" --min 1 "$WORK/k8s.yaml"
"$PY" - "$WORK/crd" "$WORK/servicemonitor-bad.yaml" <<'PY'
import sys
from pathlib import Path
import yaml
doc = yaml.safe_load(next(Path(sys.argv[1]).glob("ServiceMonitor-*.yaml")).read_text())
del doc["spec"]["selector"]                                              # required field missing
doc["spec"]["endpoints"][0]["intervall"] = doc["spec"]["endpoints"][0].pop("interval")  # unknown field
Path(sys.argv[2]).write_text(yaml.safe_dump(doc))
PY
rejects "k8s: the CRD validator rejects a ServiceMonitor without selector and with a misspelt field" \
  node "$VALIDATE/validate-crds.mjs" --min 1 "$WORK/servicemonitor-bad.yaml"

# ---- numbers that must agree ----------------------------------------------------------------------------------
check "invariants: grace period, probes, security context, selectors, HPA metrics vs adapter rules, compose wiring" \
  "$PY" deploy/check-invariants.py --quiet --rendered "$WORK/k8s.yaml" --compose docker-compose.yml
check "pool budget: pool x (maxReplicas + maxSurge) <= server_max_connections - reserved (k8s and compose)" \
  "$PY" deploy/check-pool-budget.py --rendered "$WORK/k8s.yaml" --compose docker-compose.yml
sed -E 's/^(  maxReplicas: )[0-9]+/\150/' "$WORK/k8s.yaml" >"$WORK/k8s-over-budget.yaml"
rejects "pool budget: the checker rejects maxReplicas 50" \
  "$PY" deploy/check-pool-budget.py --rendered "$WORK/k8s-over-budget.yaml"

# ---- HPA behaviour ----------------------------------------------------------------------------------------------
hpa_sim_check() { "$PY" deploy/hpa-sim.py --rendered "$WORK/k8s.yaml" --check >"$WORK/hpa-sim.out"; }
export -f hpa_sim_check
check "hpa-sim: the rendered HPA replays the synthetic ramp without flapping" hpa_sim_check
readme_matches_sim() {
  sed -n '/<!-- hpa-sim:begin -->/,/<!-- hpa-sim:end -->/p' k8s/README.md | sed '1,2d;$d' | sed '$d' >"$WORK/readme-table"
  [[ -s "$WORK/readme-table" ]] || { echo "no hpa-sim block in k8s/README.md"; return 1; }
  diff -u "$WORK/readme-table" "$WORK/hpa-sim.out"
}
export -f readme_matches_sim
check "hpa-sim: the table in k8s/README.md is the current output" readme_matches_sim
"$PY" - "$WORK/k8s.yaml" "$WORK/k8s-flappy.yaml" <<'PY'
import sys
import yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
for d in docs:
    if d["kind"] == "HorizontalPodAutoscaler":
        d["spec"]["behavior"] = {
            "scaleUp": {"stabilizationWindowSeconds": 0},
            "scaleDown": {"stabilizationWindowSeconds": 0,
                          "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15}]},
        }
open(sys.argv[2], "w").write(yaml.safe_dump_all(docs))
PY
rejects "hpa-sim: --check rejects an HPA without stabilisation windows" \
  "$PY" deploy/hpa-sim.py --rendered "$WORK/k8s-flappy.yaml" --check

# ---- the gateway's own configuration loader --------------------------------------------------------------------------
if [[ ! -x "$BIN_DIR/tributary" && -z "${CHECK_DEPLOY_NO_BUILD:-}" ]]; then
  timeout 1500 cargo build --locked --bin tributary >"$WORK/build.log" 2>&1 || tail -n 20 "$WORK/build.log"
  BIN_DIR="$REPO/target/debug"
fi
check "config: k8s ConfigMap and compose environments accepted by tributary check-config" \
  "$PY" deploy/check-config-env.py "$BIN_DIR/tributary" --rendered "$WORK/k8s.yaml" --compose docker-compose.yml
check "config: the collector variant's gateway environment (docker-compose.otel.yml merged) accepted by tributary check-config" \
  "$PY" deploy/check-config-env.py "$BIN_DIR/tributary" --rendered "$WORK/k8s.yaml" --compose "$WORK/compose-otel.yml"
sed 's/TRIBUTARY_ADMISSION__MAX_WAIT:/TRIBUTARY_ADMISSION__MAXWAIT:/' "$WORK/k8s.yaml" >"$WORK/k8s-bad-key.yaml"
rejects "config: tributary check-config rejects a misspelt TRIBUTARY_* key" \
  "$PY" deploy/check-config-env.py "$BIN_DIR/tributary" --rendered "$WORK/k8s-bad-key.yaml" --compose docker-compose.yml

printf 'check-deploy: %d passed, %d failed\n' "$PASSED" "$FAILED"
((FAILED == 0))
