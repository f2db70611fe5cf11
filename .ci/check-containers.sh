#!/usr/bin/env bash
# `docker compose up` for real, with podman: build the image with the real Dockerfile, run the
# stack in containers, and check the path a user takes, from outside the containers.
#
#   bash .ci/check-containers.sh       # from anywhere; root; 8-36 min cold on 2 cores (deploy/README.md)
#
# No image registry is reachable from CI machines, so the base images are stand-ins made here
# from Debian packages (deploy/standins/; deploy/README.md, "The image and the stack in containers"):
#   localhost/tributary-ci/debian:bookworm-slim     debootstrap --variant=minbase bookworm
#   localhost/tributary-ci/rust:<version>-slim-bookworm   + gcc, the machine's Rust toolchain and CA bundle
#   localhost/tributary-ci/postgres:15              Debian's PostgreSQL with the official entrypoint's interface
#   localhost/tributary-ci/prometheus:2.42          Debian's Prometheus laid out like prom/prometheus
# Then:
#   1. tributary:dev from the Dockerfile (both stages, the cargo-chef dependency layer), the stand-ins
#      selected with --build-arg RUST_IMAGE/RUNTIME_IMAGE, GIT_REVISION = this commit; checked: user
#      10001, no toolchain and no sources in it, `tributary --version` names the revision; size shown.
#   2. docker-compose.yml + docker-compose.ci.yml (stand-in images; grafana and jaeger left out: no
#      Debian package) run by Debian's docker-compose 1.29 against `podman system service`, with
#      deploy/standins/healthcheck-timer.py running the health checks (podman schedules them with
#      systemd timers, and there is no systemd here). podman-compose 1.6 is not used: it skips
#      `condition: service_healthy` on podman < 4.6, and Debian 12 has 4.3.
#   3. checks from the host: the start-up order the conditions demand, migrate-seed exited 0 and
#      seeded the database (psql through the published port, with the compose credentials), the
#      gateway healthy, GET localhost:8080/api/v1/dashboard/1 200 with all six parts, Prometheus'
#      target up and the gateway's series queryable, SIGTERM drains under load with no 5xx
#      (deploy/drain-check.py), and `down -v` leaves no container, network or volume.
#
# Everything runs in a podman store of its own under a temporary directory (images, containers,
# volumes, network definitions), and the whole of it is removed at the end, with what podman keeps
# at fixed paths (run state, netavark's firewall chains) when this run created it. CHECK_CONTAINERS_STORE=DIR keeps the store in DIR instead, and then the
# stand-ins and the image's layers (the cargo-chef layer among them) are reused by the next run;
# CI does not set it. Prints one line per check and `check-containers: N passed, M failed`.
set -euo pipefail

if [[ -z "${CHECK_CONTAINERS_UNDER_TIMEOUT:-}" ]]; then
  exec timeout --signal=TERM --kill-after=60 "${CHECK_CONTAINERS_TIMEOUT:-3600}" \
    env CHECK_CONTAINERS_UNDER_TIMEOUT=1 bash "$0" "$@"
fi

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
started=$SECONDS
WORK="$(mktemp -d /tmp/check-containers.XXXXXX)"
STORE="${CHECK_CONTAINERS_STORE:-$WORK/store}"
PROJECT=tributary-ci
CI_PREFIX=localhost/tributary-ci
IMAGE=localhost/tributary:dev
REVISION="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
PASSED=0
FAILED=0
SERVICE_PID=""
TIMER_PID=""
STACK_UP=0
# Podman 4.3 keeps a few things at fixed paths whatever the store: netavark's and aardvark-dns'
# run state and the image library's blob-info cache. Those this run creates, it removes.
FIXED_PATHS=()
for p in /run/containers /var/lib/containers /etc/containers/networks; do
  [[ -e "$p" ]] || FIXED_PATHS+=("$p")
done
# netavark also leaves its firewall chains (empty once the networks are gone) and turns on IPv4
# forwarding: both are put back as they were when this run is the one that changed them.
NETAVARK_BEFORE="$(iptables-save 2>/dev/null | grep -c NETAVARK || true)"
IP_FORWARD_BEFORE="$(cat /proc/sys/net/ipv4/ip_forward 2>/dev/null || true)"

log() { printf '%s\n' "$*"; }
pass() { log "ok   $*"; PASSED=$((PASSED + 1)); }
fail() { log "FAIL $*"; FAILED=$((FAILED + 1)); }
note() { log "     $*"; }
phase() { log ""; log "--- $* (t+$((SECONDS - started))s)"; }
summary() { log "check-containers: $PASSED passed, $FAILED failed"; }
fatal() { fail "$*"; summary; exit 1; }
# check NAME CMD...: one verdict line; the command's output is shown only when it fails.
check() {
  local name=$1; shift
  if "$@" >"$WORK/out" 2>&1; then pass "$name"; else fail "$name"; sed 's/^/     /' "$WORK/out" | tail -n 30; fi
}

COMPOSE=(docker-compose -p "$PROJECT" -f "$WORK/compose.ci.yml")

cleanup() {
  local rc=$?
  set +e
  if ((STACK_UP)); then
    if ((rc != 0 || FAILED != 0)); then
      for svc in postgres migrate-seed gateway prometheus; do
        log "---- last lines of $svc"
        timeout 30 "${COMPOSE[@]}" logs --no-color --tail=25 "$svc" 2>&1 | tail -n 25
      done
    fi
    timeout 120 "${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1
  fi
  [[ -n "$TIMER_PID" ]] && kill "$TIMER_PID" 2>/dev/null
  [[ -n "$SERVICE_PID" ]] && kill "$SERVICE_PID" 2>/dev/null && wait "$SERVICE_PID" 2>/dev/null
  if [[ -z "${CHECK_CONTAINERS_STORE:-}" && -d "$STORE" ]]; then
    # The store is this run's alone: remove all of it (images included).
    timeout 300 podman system reset --force >/dev/null 2>&1
  else
    timeout 120 podman rm -af -t 5 >/dev/null 2>&1
    timeout 60 podman volume prune -f >/dev/null 2>&1
  fi
  # Overlay mounts left by an interrupted podman would make rm fail; nothing else is mounted there.
  grep -o " $WORK/[^ ]*" /proc/mounts 2>/dev/null | sort -r | xargs -r -n1 umount -l 2>/dev/null
  rm -rf "$WORK"
  ((${#FIXED_PATHS[@]})) && rm -rf "${FIXED_PATHS[@]}"
  if [[ "$NETAVARK_BEFORE" == 0 ]]; then
    local table rule chain
    for table in nat filter; do
      iptables -t "$table" -S 2>/dev/null | grep -E '^-A (PREROUTING|INPUT|FORWARD|OUTPUT|POSTROUTING) .*-j NETAVARK' \
        | sed 's/^-A/-D/' | while read -r rule; do eval iptables -t "$table" "$rule"; done
      for chain in $(iptables -t "$table" -S 2>/dev/null | awk '$1 == "-N" && $2 ~ /^NETAVARK/ {print $2}'); do
        iptables -t "$table" -F "$chain"
      done
      for chain in $(iptables -t "$table" -S 2>/dev/null | awk '$1 == "-N" && $2 ~ /^NETAVARK/ {print $2}'); do
        iptables -t "$table" -X "$chain"
      done
    done
  fi
  if [[ -n "$IP_FORWARD_BEFORE" && "$(cat /proc/sys/net/ipv4/ip_forward)" != "$IP_FORWARD_BEFORE" ]]; then
    echo "$IP_FORWARD_BEFORE" >/proc/sys/net/ipv4/ip_forward
  fi
}
trap cleanup EXIT
trap 'exit 143' TERM INT

# ---- tools (installed when missing; announced) ----------------------------------------------------
phase "tools"
need=()
for p in podman runc catatonit netavark aardvark-dns debootstrap docker-compose; do
  dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
command -v curl >/dev/null || need+=(curl)
command -v psql >/dev/null || need+=(postgresql-client)
if ((${#need[@]})); then
  log "installing with apt-get: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # Another apt on the machine holds the lock for a while at most: wait for it.
  timeout 600 apt-get -o DPkg::Lock::Timeout=300 update -qq >/dev/null
  timeout 900 apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "${need[@]}" \
    >"$WORK/apt.log" 2>&1 \
    || { tail -n 20 "$WORK/apt.log"; fatal "apt-get install ${need[*]}"; }
fi
((EUID == 0)) || fatal "needs root (podman with runc and cgroupfs, as CI runs)"
{ command -v cargo && command -v rustc; } >/dev/null || fatal "cargo and rustc (the toolchain to copy) are missing"

# podman's configuration for this run: runc (crun refuses this machine's hybrid cgroups), cgroupfs
# (no systemd), podman's default ulimits cleared (the machine's hard limits are below them), and
# every path -- storage, run state, network definitions -- inside STORE.
mkdir -p "$STORE"/{graph,run,tmp,networks}
cat >"$WORK/containers.conf" <<EOF
[containers]
default_ulimits = []
init_path = "/usr/bin/catatonit"
log_driver = "k8s-file"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
tmp_dir = "$STORE/tmp"

[network]
network_backend = "netavark"
network_config_dir = "$STORE/networks"
EOF
cat >"$WORK/storage.conf" <<EOF
[storage]
driver = "overlay"
graphroot = "$STORE/graph"
runroot = "$STORE/run"
EOF
export CONTAINERS_CONF="$WORK/containers.conf" CONTAINERS_STORAGE_CONF="$WORK/storage.conf"
pass "podman $(podman version --format '{{.Client.Version}}') with runc $(runc --version | awk 'NR==1{print $3}'), docker-compose $(docker-compose version --short), store $STORE"

image_exists() { podman image exists "$1"; }
image_mb() { podman image inspect --format '{{.Size}}' "$1" | awk '{printf "%.0f", $1 / 1e6}'; }

# ---- stand-in base images -------------------------------------------------------------------------
phase "stand-in base images"
t_base=$SECONDS
DEBIAN_IMAGE="$CI_PREFIX/debian:bookworm-slim"
RUST_VERSION="$(rustc --version | awk '{print $2}')"
RUST_IMAGE="$CI_PREFIX/rust:${RUST_VERSION%.*}-slim-bookworm"
POSTGRES_IMAGE="$CI_PREFIX/postgres:15"
PROMETHEUS_IMAGE="$CI_PREFIX/prometheus:2.42"

if image_exists "$DEBIAN_IMAGE"; then
  pass "$DEBIAN_IMAGE (in the store, $(image_mb "$DEBIAN_IMAGE") MB)"
else
  # The machine's own Debian mirror and suites (bookworm, -updates, -security), as the official
  # image has them; docs, man pages and locales excluded and apt's cache cleaned, as in -slim.
  mirror="$(awk '$1 == "URIs:" {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)"
  mirror="${mirror:-http://deb.debian.org/debian}"
  rootfs="$WORK/rootfs"
  t=$SECONDS
  timeout 900 debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -n 20 "$WORK/debootstrap.log"; fatal "debootstrap bookworm from $mirror"; }
  if [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
    cp /etc/apt/sources.list.d/debian.sources "$rootfs/etc/apt/sources.list.d/debian.sources"
    rm -f "$rootfs/etc/apt/sources.list"
  fi
  cat >"$rootfs/etc/dpkg/dpkg.cfg.d/slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
EOF
  cat >"$rootfs/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
Acquire::Languages "none";
EOF
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/man/* \
    "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/*
  find "$rootfs/usr/share/doc" -mindepth 2 ! -name copyright -delete 2>/dev/null || true
  tar --numeric-owner -C "$rootfs" -cf - . \
    | podman import --change 'CMD ["bash"]' - "$DEBIAN_IMAGE" >"$WORK/import.log" 2>&1 \
    || fatal "podman import $DEBIAN_IMAGE"
  rm -rf "$rootfs"
  pass "$DEBIAN_IMAGE from debootstrap ($mirror; $(image_mb "$DEBIAN_IMAGE") MB, $((SECONDS - t)) s)"
fi

# build_standin IMAGE CONTAINERFILE [podman build options]: builds a stand-in from deploy/standins/.
build_standin() {
  local image=$1 file=$2; shift 2
  if image_exists "$image"; then pass "$image (in the store)"; return 0; fi
  local t=$SECONDS
  if timeout 1200 podman build --pull=never --build-arg BASE="$DEBIAN_IMAGE" "$@" \
    -f "deploy/standins/$file" -t "$image" deploy/standins >"$WORK/build-$file.log" 2>&1; then
    pass "$image from deploy/standins/$file ($(image_mb "$image") MB, $((SECONDS - t)) s)"
  else
    tail -n 30 "$WORK/build-$file.log"; fatal "podman build $image"
  fi
}
build_standin "$RUST_IMAGE" rust.Containerfile \
  -v "$(rustc --print sysroot):/mnt/toolchain:ro" -v /etc/ssl/certs/ca-certificates.crt:/mnt/ca-certificates.crt:ro
check "$RUST_IMAGE runs the machine's cargo ($(cargo --version | awk '{print $2}'))" \
  bash -c "podman run --rm '$RUST_IMAGE' cargo --version | grep -qF '$(cargo --version | awk '{print $2}')'"
build_standin "$POSTGRES_IMAGE" postgres.Containerfile
build_standin "$PROMETHEUS_IMAGE" prometheus.Containerfile
t_base=$((SECONDS - t_base))

# ---- the project's image --------------------------------------------------------------------------
phase "tributary image from the Dockerfile"
t_image=$SECONDS
timeout 2700 podman build --pull=never \
  --build-arg RUST_IMAGE="$RUST_IMAGE" --build-arg RUNTIME_IMAGE="$DEBIAN_IMAGE" \
  --build-arg GIT_REVISION="$REVISION" -t "$IMAGE" . >"$WORK/build-image.log" 2>&1 \
  || { tail -n 40 "$WORK/build-image.log"; fatal "podman build -t $IMAGE . (Dockerfile)"; }
t_image=$((SECONDS - t_image))
cook_cached=no
grep -A1 -E 'STEP [0-9/]+: RUN cargo chef cook' "$WORK/build-image.log" | grep -q -- '--> Using cache' && cook_cached=yes
pass "$IMAGE built from the Dockerfile in ${t_image}s (cargo-chef dependency layer from cache: $cook_cached)"
check "the build ran cargo chef prepare, cargo chef cook, then cargo build --release" \
  bash -c "grep -q 'RUN cargo chef prepare' '$WORK/build-image.log' && grep -q 'RUN cargo chef cook --release' '$WORK/build-image.log' \
    && grep -q 'RUN cargo build --release' '$WORK/build-image.log'"

check "image user is 10001:10001" \
  bash -c "[[ \$(podman image inspect --format '{{.Config.User}}' '$IMAGE') == 10001:10001 ]]"
check "a container of the image runs as uid 10001, gid 10001" \
  bash -c "[[ \$(podman run --rm '$IMAGE' id -u):\$(podman run --rm '$IMAGE' id -g) == 10001:10001 ]]"
# The image's file system, read from the host: binaries, config and migrations are there; no
# toolchain, no compiler, no Rust sources or manifests, no build tree.
image_contents() {
  local root rc=0
  root="$(podman image mount "$IMAGE")"
  for f in usr/local/bin/tributary usr/local/bin/downstream-sim app/config/default.toml app/migrations; do
    [[ -e "$root/$f" ]] || { echo "missing /$f"; rc=1; }
  done
  for f in usr/local/cargo usr/local/rustup usr/local/rust src app/src app/target app/Cargo.toml app/Cargo.lock; do
    [[ ! -e "$root/$f" ]] || { echo "present: /$f"; rc=1; }
  done
  for tool in cargo rustc rustup gcc cc ld; do
    for dir in usr/local/bin usr/bin bin usr/local/sbin usr/sbin; do
      [[ ! -e "$root/$dir/$tool" ]] || { echo "present: /$dir/$tool"; rc=1; }
    done
  done
  local sources
  sources="$(find "$root" -xdev \( -name '*.rs' -o -name Cargo.toml -o -name recipe.json \) -print -quit)"
  [[ -z "$sources" ]] || { echo "present: ${sources#"$root"}"; rc=1; }
  podman image unmount "$IMAGE" >/dev/null
  return $rc
}
check "image holds the two binaries, config/ and migrations/, and no toolchain, compiler or sources" image_contents
version_line="$(podman run --rm "$IMAGE" tributary --version 2>&1 || true)"
expected_version="tributary $(awk -F'"' '/^version = /{print $2; exit}' Cargo.toml) (revision $REVISION)"
if [[ "$version_line" == "$expected_version" ]]; then
  pass "tributary --version in the image: $version_line"
else
  fail "tributary --version in the image: '$version_line', expected '$expected_version'"
fi
check "image label org.opencontainers.image.revision = $REVISION" \
  bash -c "[[ \$(podman image inspect --format '{{index .Labels \"org.opencontainers.image.revision\"}}' '$IMAGE') == '$REVISION' ]]"
image_size=$(image_mb "$IMAGE")
base_size=$(image_mb "$DEBIAN_IMAGE")
pass "image size: $image_size MB ($((image_size - base_size)) MB on top of the $base_size MB Debian stand-in)"

# ---- the stack --------------------------------------------------------------------------------------
phase "the compose stack"
t_stack=$SECONDS
# The effective file: docker-compose.yml with docker-compose.ci.yml on top, resolved by compose
# itself; then the services with the `not-in-ci` profile left out with everything naming them.
docker-compose -p "$PROJECT" -f docker-compose.yml -f docker-compose.ci.yml config >"$WORK/compose.merged.yml" \
  || fatal "docker-compose config (docker-compose.yml + docker-compose.ci.yml)"
python3 - "$WORK/compose.merged.yml" "$WORK/compose.ci.yml" <<'PY' || fatal "leaving out the not-in-ci services"
import sys
from urllib.parse import urlsplit
import yaml
spec = yaml.safe_load(open(sys.argv[1]))
services = spec["services"]
out = sorted(n for n, s in services.items() if "not-in-ci" in (s.get("profiles") or []))
for name in out:
    del services[name]
print(f"     left out (no Debian package, so no stand-in): {', '.join(out)}")
for name, svc in services.items():
    deps = svc.get("depends_on") or {}
    for dep in [d for d in deps if d in out]:
        del deps[dep]
        print(f"     {name}: no longer waits for {dep}")
    env = svc.get("environment") or {}
    for key in [k for k, v in env.items() if urlsplit(str(v)).hostname in out]:
        print(f"     {name}: {key}={env.pop(key)} dropped")
yaml.safe_dump(spec, open(sys.argv[2], "w"), sort_keys=False)
PY

for port in 8080 19090 9090 15432; do
  if ss -Hltn "sport = :$port" | grep -q .; then fatal "port $port is taken on this machine; the stack publishes it"; fi
done

podman system service --time=0 "unix://$WORK/podman.sock" >"$WORK/podman-service.log" 2>&1 &
SERVICE_PID=$!
export DOCKER_HOST="unix://$WORK/podman.sock"
for _ in $(seq 1 100); do
  curl -sf --unix-socket "$WORK/podman.sock" http://d/_ping >/dev/null 2>&1 && break
  sleep 0.2
done
curl -sf --unix-socket "$WORK/podman.sock" http://d/_ping >/dev/null || fatal "podman system service did not answer"
python3 deploy/standins/healthcheck-timer.py "$WORK/podman.sock" "$PROJECT" "$WORK/healthy.json" 900 \
  >"$WORK/healthcheck-timer.log" 2>&1 &
TIMER_PID=$!

STACK_UP=1
t=$SECONDS
if timeout 600 "${COMPOSE[@]}" up -d --no-build >"$WORK/up.log" 2>&1; then
  pass "docker-compose up -d: every service started, each after its dependencies' conditions ($((SECONDS - t)) s)"
else
  sed 's/^/     /' "$WORK/up.log" | tail -n 30; fatal "docker-compose up -d"
fi

ctr() { printf '%s_%s_1' "$PROJECT" "$1"; }
wait_for() { # NAME SECONDS CMD...: polls CMD every second until it succeeds or time runs out
  local name=$1 limit=$2; shift 2
  local deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then fail "$name (not within ${limit}s)"; return 1; fi
    sleep 1
  done
  pass "$name"
}
health_is() { [[ "$(podman inspect --format '{{.State.Health.Status}}' "$(ctr "$1")")" == "$2" ]]; }

wait_for "gateway container healthy (/readyz 200 through its health check)" 120 health_is gateway healthy
# The order the conditions demand, from the containers' own timestamps and the first passing
# health check of each dependency.
start_order() {
  python3 - "$WORK/healthy.json" "$PROJECT" <<'PY'
import json, re, subprocess, sys
from datetime import datetime
healthy = {k: datetime.fromisoformat(v) for k, v in json.load(open(sys.argv[1])).items()}
def t(v):
    # RFC 3339 with nanoseconds (podman); Python takes at most microseconds.
    m = re.fullmatch(r"(.+T\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", v)
    return datetime.fromisoformat(m[1] + (m[2] or "")[:7] + ("+00:00" if m[3] == "Z" else m[3]))
def state(service):
    out = subprocess.run(["podman", "inspect", f"{sys.argv[2]}_{service}_1"], capture_output=True, text=True, check=True)
    s = json.loads(out.stdout)[0]["State"]
    return t(s["StartedAt"]), t(s["FinishedAt"]) if s["Status"] == "exited" else None
sims = ["users", "carts", "recommendations", "promotions", "notifications"]
mig_start, mig_end = state("migrate-seed")
gw_start, _ = state("gateway")
ok = True
def need(cond, what):
    global ok
    print(("ok   " if cond else "FAIL ") + what)
    ok &= bool(cond)
need("postgres" in healthy and mig_start >= healthy["postgres"], "migrate-seed started after postgres was healthy")
need(mig_end is not None and gw_start >= mig_end, "gateway started after migrate-seed had exited")
for s in sims:
    need(s in healthy and gw_start >= healthy[s], f"gateway started after {s} was healthy")
sys.exit(0 if ok else 1)
PY
}
check "start-up order: postgres healthy -> migrate-seed exited -> gateway; the five simulators healthy -> gateway" start_order
check "migrate-seed exited with status 0" \
  bash -c "[[ \$(podman inspect --format '{{.State.Status}} {{.State.ExitCode}}' '$(ctr migrate-seed)') == 'exited 0' ]]"
seeded() {
  local users
  users="$(PGPASSWORD=tributary psql -X -At -h 127.0.0.1 -p 15432 -U tributary -d tributary \
    -c 'SELECT count(DISTINCT user_id) FROM orders')"
  echo "users with orders: $users"
  [[ "$users" == 10000 ]]
}
check "database seeded: 10000 users with orders (psql on 127.0.0.1:15432 as tributary/tributary)" seeded

dashboard() {
  curl -s -m 10 -o "$WORK/dashboard.json" -w '%{http_code}\n' http://localhost:8080/api/v1/dashboard/1 >"$WORK/code"
  python3 - "$WORK/dashboard.json" "$(cat "$WORK/code")" <<'PY'
import json, sys
code = sys.argv[2]
body = json.load(open(sys.argv[1]))
parts = {"profile": "users", "cart": "carts", "recommendations": "recommendations",
         "promotions": "promotions", "notifications": "notifications"}
missing = [k for k, svc in parts.items() if not isinstance(body.get(k), dict) or body[k].get("service") != svc]
orders = body.get("recent_orders")
problems = []
if code != "200": problems.append(f"status {code}")
if missing: problems.append(f"parts missing: {missing}")
if not isinstance(orders, list) or len(orders) != 5: problems.append(f"recent_orders: {orders!r:.80}")
if body.get("degraded") != []: problems.append(f"degraded: {body.get('degraded')}")
print("; ".join(problems) or "ok", json.dumps(body)[:300])
sys.exit(1 if problems else 0)
PY
}
check "curl localhost:8080/api/v1/dashboard/1: 200, profile, cart, recommendations, promotions, notifications, 5 recent orders, nothing degraded" dashboard

prom_has() { # QUERY: at least one sample, every value > 0
  curl -s -m 5 --get http://localhost:9090/api/v1/query --data-urlencode "query=$1" \
    | python3 -c 'import json,sys; r=json.load(sys.stdin); v=[float(s["value"][1]) for s in r["data"]["result"]] if r.get("status")=="success" else []; sys.exit(0 if v and min(v)>0 else 1)'
}
wait_for "prometheus (stand-in) ready on localhost:9090" 60 curl -sf -m 2 http://localhost:9090/-/ready
wait_for "prometheus: up{job=\"tributary\"} == 1 (scraping gateway:9090 in the compose network)" 60 \
  prom_has 'up{job="tributary"} == 1'
wait_for "prometheus: tributary_build_info{revision=\"$REVISION\"} (the scraped gateway is this image)" 30 \
  prom_has "tributary_build_info{job=\"tributary\",revision=\"$REVISION\"}"
wait_for "prometheus: sum(tributary_http_requests_total{job=\"tributary\"}) > 0 (the requests above)" 30 \
  prom_has 'sum(tributary_http_requests_total{job="tributary"})'
check "prometheus loaded the mounted alerts.yml (rule groups present)" \
  bash -c "curl -s -m 5 http://localhost:9090/api/v1/rules | python3 -c 'import json,sys; sys.exit(0 if json.load(sys.stdin)[\"data\"][\"groups\"] else 1)'"

# SIGTERM under load: `docker-compose stop gateway` sends the image's STOPSIGNAL and waits up to
# the service's stop_grace_period (30 s) for the drain.
if python3 deploy/drain-check.py --url http://127.0.0.1:8080 \
  --logs "podman logs $(ctr gateway)" -- "${COMPOSE[@]}" stop gateway \
  >"$WORK/drain.json" 2>"$WORK/drain.err"; then
  pass "SIGTERM to the gateway under load: in-flight requests answered, no 5xx"
else
  fail "SIGTERM to the gateway under load"; sed 's/^/     /' "$WORK/drain.err"
fi
note "drain: $(cat "$WORK/drain.json")"
check "gateway exited 0 after 'all connections drained'" \
  bash -c "[[ \$(podman inspect --format '{{.State.Status}} {{.State.ExitCode}}' '$(ctr gateway)') == 'exited 0' ]] \
    && podman logs '$(ctr gateway)' 2>&1 | grep -q 'all connections drained'"

# The drain check must be able to fail: a second gateway on the compose network, the compose
# environment with server.drain_timeout = 0 (exit at the signal), the same load and the same stop.
python3 - "$WORK/compose.ci.yml" >"$WORK/gateway.env" <<'PY'
import sys
import yaml
env = yaml.safe_load(open(sys.argv[1]))["services"]["gateway"]["environment"]
for key, value in env.items():
    print(f"{key}={value}")
print("TRIBUTARY_SERVER__DRAIN_TIMEOUT=0s")
PY
nodrain="${PROJECT}_nodrain"
if podman run -d --name "$nodrain" --network "${PROJECT}_default" -p 127.0.0.1::8080 --init \
  --env-file "$WORK/gateway.env" "$IMAGE" tributary serve >/dev/null 2>"$WORK/nodrain.err"; then
  nodrain_port="$(podman port "$nodrain" 8080 | head -n1 | awk -F: '{print $NF}')"
  if wait_for "gateway with drain_timeout 0s ready on 127.0.0.1:$nodrain_port" 60 \
    curl -sf -m 2 "http://127.0.0.1:$nodrain_port/readyz"; then
    python3 deploy/drain-check.py --url "http://127.0.0.1:$nodrain_port" --logs "podman logs $nodrain" \
      -- podman stop -t 30 "$nodrain" >"$WORK/nodrain.json" 2>"$WORK/nodrain.err" && nodrain_rc=0 || nodrain_rc=$?
    if ((nodrain_rc == 1)) && grep -q "in-flight requests were dropped" "$WORK/nodrain.err"; then
      pass "drain-check rejects a gateway that does not drain ($(grep -o '[0-9]* requests written .*dropped' "$WORK/nodrain.err"))"
    else
      fail "drain-check did not reject a gateway with drain_timeout 0s (exit $nodrain_rc)"
      sed 's/^/     /' "$WORK/nodrain.json" "$WORK/nodrain.err"
    fi
  fi
else
  fail "podman run a second gateway"; sed 's/^/     /' "$WORK/nodrain.err"
fi
podman rm -f -t 5 "$nodrain" >/dev/null 2>&1 || true

network_if="$(podman network inspect --format '{{.NetworkInterface}}' "${PROJECT}_default" 2>/dev/null || true)"
t=$SECONDS
if timeout 180 "${COMPOSE[@]}" down -v >"$WORK/down.log" 2>&1; then
  STACK_UP=0
  pass "docker-compose down -v ($((SECONDS - t)) s)"
else
  sed 's/^/     /' "$WORK/down.log" | tail -n 20; fail "docker-compose down -v"
fi
leftovers() {
  local rc=0 c n v
  c="$(podman ps -a --format '{{.Names}}')"; [[ -z "$c" ]] || { echo "containers: $c"; rc=1; }
  n="$(podman network ls --format '{{.Name}}' | grep -vx podman || true)"; [[ -z "$n" ]] || { echo "networks: $n"; rc=1; }
  v="$(podman volume ls --format '{{.Name}}')"; [[ -z "$v" ]] || { echo "volumes: $v"; rc=1; }
  if [[ -n "$network_if" ]] && ip link show "$network_if" >/dev/null 2>&1; then echo "bridge $network_if still up"; rc=1; fi
  return $rc
}
check "nothing left: podman ps -a, network ls (only podman's default), volume ls empty; bridge ${network_if:-?} gone" leftovers
t_stack=$((SECONDS - t_stack))

kill "$TIMER_PID" 2>/dev/null || true
TIMER_PID=""
log ""
log "timings: stand-in images ${t_base}s, image build ${t_image}s, stack ${t_stack}s, total $((SECONDS - started))s (before clean-up)"
summary
((FAILED == 0))
