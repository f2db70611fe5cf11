# Common tasks. GNU make only runs the commands: each target is one line you can also type yourself.
#
#   make dev                       the local stack in the foreground (scripts/dev.sh; Ctrl-C stops it)
#   make dev PORT=8081 SIM_PORT=19001 PROFILE=release
#   make test                      the test suite against the local Postgres and Redis
#   make lint                      rustfmt check and clippy, as CI runs them
#   make fmt                       format the code
#   make openapi                   regenerate openapi.json from the code (a test fails when it is stale)
#   make check-api                 schemathesis against a live gateway (.ci/check-api.sh)
#   make ci                        the whole CI (.ci/run): installs what is missing, runs every check
#   make bench SCENARIO=sweep      one benchmark scenario (release build; needs a quiet machine)
#   make bench-micro               the hot path's micro-benchmarks (benches/hot_path; about a minute)

# The test suite creates and drops its own databases on this server.
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/postgres
SCENARIO ?=

.PHONY: help dev test lint fmt openapi check-api ci bench bench-micro

help:
	@sed -n '3,12s/^# \{0,1\}//p' Makefile

dev:
	@bash scripts/dev.sh

test:
	DATABASE_URL=$(TEST_DATABASE_URL) cargo test --locked --all-targets

lint:
	cargo fmt --all -- --check
	cargo clippy --all-targets --locked -- -D warnings -D clippy::await_holding_lock
	cargo clippy --all-targets --locked --no-default-features -- -D warnings

fmt:
	cargo fmt --all

openapi:
	cargo run --locked --quiet --bin tributary -- openapi > openapi.json.new && mv openapi.json.new openapi.json

check-api:
	cargo build --locked --bins
	bash .ci/check-api.sh

ci:
	@bash .ci/run

bench:
	@test -n "$(SCENARIO)" || { echo "make bench: name a scenario, e.g. make bench SCENARIO=seed-baseline"; bench/run list; exit 2; }
	cargo build --release --locked --bins --examples
	bench/run $(SCENARIO)

bench-micro:
	cargo bench --locked --bench hot_path
