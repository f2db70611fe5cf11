#!/usr/bin/env bash
# What a new user's first hour costs, measured: the README's quick-start figures come from this.
#
#   scripts/first-hour.sh            (needs what the quick start needs: Rust, PostgreSQL, Redis)
#
# From two fresh clones of this repository's committed HEAD, each with an empty cargo home (so the
# crates are downloaded as on a new machine):
#   1. clone A: `make dev` until GET /api/v1/dashboard/1 answers 200 (clone → first 200); stop it;
#   2. clone B: `make test` (clone → green tests with the test command alone);
#   3. clone A: `cargo build --release --locked --bins` (the release binaries);
# with the size of target/ after each, and the machine, the date and the load average.
# Everything runs in a temporary directory that is removed at the end, with free ports and a
# database of its own (dropped at the end).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/first-hour.XXXXXX")"
db="tributary_first_hour_$(od -An -N4 -tx4 /dev/urandom | tr -d ' ')"
dev_pid=

cleanup() {
  if [[ -n $dev_pid ]] && kill -0 "$dev_pid" 2>/dev/null; then
    kill -TERM "$dev_pid" 2>/dev/null || true
    wait "$dev_pid" 2>/dev/null || true
  fi
  psql -X -q -h 127.0.0.1 -U postgres -d postgres -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

now() { date +%s; }
load() { cut -d' ' -f1-3 /proc/loadavg; }
size() { du -sh "$1" | cut -f1; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# Five consecutive free ports for the simulators.
free_range() {
  local base p
  for _ in $(seq 50); do
    base=$((20000 + RANDOM % 20000))
    for ((p = base; p < base + 5; p++)); do (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null && continue 2; done
    echo "$base"
    return
  done
  return 1
}

echo "machine: $(nproc) cores, $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -n1), $(awk '/MemTotal/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo), $(sed -n 's/^PRETTY_NAME="\(.*\)"$/\1/p' /etc/os-release), $(rustc --version)"
echo "date: $(date -u +%FT%TZ), load average $(load); revision $(git -C "$repo" rev-parse --short HEAD) (committed state only)"

# ---- 1. clone A: make dev -> first 200 ----------------------------------------------------------------
port=$(free_port)
sim_port=$(free_range)
start=$(now)
git clone -q "$repo" "$work/a"
(
  cd "$work/a"
  export CARGO_HOME="$work/cargo-home-a" PORT="$port" SIM_PORT="$sim_port"
  export DATABASE_URL="postgres://postgres@127.0.0.1:5432/$db"
  exec make dev
) >"$work/dev.log" 2>&1 &
dev_pid=$!
until [[ $(curl -s -o /dev/null -m 2 -w '%{http_code}' "http://127.0.0.1:$port/api/v1/dashboard/1") == 200 ]]; do
  kill -0 "$dev_pid" 2>/dev/null || { tail -n 30 "$work/dev.log"; echo "first-hour: make dev exited"; exit 1; }
  (($(now) - start < 5400)) || { echo "first-hour: no 200 within 90 min"; exit 1; }
  sleep 1
done
t_dev=$(($(now) - start))
kill -TERM "$dev_pid"
wait "$dev_pid" || true
dev_pid=
build_dev=$(grep -m1 -o 'Finished .dev. profile.* in .*' "$work/dev.log" | sed 's/.* in //')
echo "clone -> first 200 (make dev, then curl): ${t_dev} s, of which the build ${build_dev}; target/ $(size "$work/a/target"); load $(load)"

# ---- 2. clone B: make test -> green -------------------------------------------------------------------
start=$(now)
git clone -q "$repo" "$work/b"
if ! (cd "$work/b" && CARGO_HOME="$work/cargo-home-b" make test) >"$work/test.log" 2>&1; then
  tail -n 40 "$work/test.log"
  echo "first-hour: make test failed"
  exit 1
fi
t_test=$(($(now) - start))
build_test=$(grep -m1 -o 'Finished .test. profile.* in .*' "$work/test.log" | sed 's/.* in //')
tests=$(awk '/^test result: ok/ {n += $4} END {print n}' "$work/test.log")
echo "clone -> green tests (make test alone): ${t_test} s, of which the build ${build_test}; ${tests} tests; target/ $(size "$work/b/target"); load $(load)"
rm -rf "$work/b" "$work/cargo-home-b"

# ---- 3. clone A: release binaries -------------------------------------------------------------------------
start=$(now)
(cd "$work/a" && CARGO_HOME="$work/cargo-home-a" cargo build --release --locked --bins) >"$work/release.log" 2>&1 ||
  { tail -n 30 "$work/release.log"; echo "first-hour: release build failed"; exit 1; }
t_release=$(($(now) - start))
echo "release binaries (cargo build --release --locked --bins, after make dev): ${t_release} s; target/ $(size "$work/a/target") (release $(size "$work/a/target/release")); load $(load)"
echo "downloaded crates (one cargo home): $(size "$work/cargo-home-a")"
