# syntax=docker/dockerfile:1
#
# tributary container image: the gateway (`tributary`) and the downstream simulator (`downstream-sim`)
# in one small runtime image.
#
#   docker build --build-arg GIT_REVISION="$(git rev-parse HEAD)" -t tributary:dev .
#
# Stages:
#   chef     Rust toolchain + cargo-chef (a crates.io package, built from source here).
#   planner  Reduces the workspace to a dependency "recipe" (Cargo.toml/Cargo.lock skeleton).
#   builder  Cooks (compiles) the dependencies from the recipe -- this layer is only rebuilt when
#            Cargo.toml/Cargo.lock/.cargo change -- then compiles the project's own sources.
#   loadgen  wrk from Debian, for the compose `bench` profile (built only when asked for by target).
#   runtime  debian:bookworm-slim with the two binaries, migrations/ and config/; no toolchain, no sources.
#
# No sqlx compile-time checked queries (`query!`, `query_as!`) are used, so the build needs no
# database and no SQLX_OFFLINE query data: queries are checked by the integration tests against a
# real Postgres. (`sqlx::migrate!` only embeds migrations/ from the build context into the binary.)

ARG RUST_IMAGE=rust:1.95-slim-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM ${RUST_IMAGE} AS chef
# cargo-chef is pinned so the dependency layer is reproducible.
RUN cargo install cargo-chef --version 0.1.78 --locked
WORKDIR /src

FROM chef AS planner
COPY . .
RUN cargo chef prepare --recipe-path recipe.json

FROM chef AS builder
# .cargo/config.toml sets `--cfg tokio_unstable` (tokio runtime metrics); it must be present for
# both the dependency build and the final build or tokio would be compiled twice with different cfgs.
COPY .cargo/ .cargo/
COPY --from=planner /src/recipe.json recipe.json
RUN cargo chef cook --release --locked --recipe-path recipe.json

# Everything below reruns on a source change; the dependency layer above stays cached.
COPY . .
# The revision is declared after `cook` so that a new commit does not invalidate the dependency layer.
# The gateway reads it at compile time with option_env!("TRIBUTARY_GIT_REVISION") and reports it in
# `tributary --version` and tributary_build_info{version,revision}.
ARG GIT_REVISION=unknown
ENV TRIBUTARY_GIT_REVISION=${GIT_REVISION}
RUN cargo build --release --locked --bin tributary --bin downstream-sim \
    && install -D -m 0755 target/release/tributary target/release/downstream-sim -t /out/

FROM ${RUNTIME_IMAGE} AS loadgen
# Debian point releases replace package versions, so pinning them would break rebuilds; the base
# image tag is what fixes the distribution.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends wrk \
    && rm -rf /var/lib/apt/lists/*
USER 65534:65534
ENTRYPOINT ["wrk"]

FROM ${RUNTIME_IMAGE} AS runtime
ARG GIT_REVISION=unknown
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="tributary" \
      org.opencontainers.image.description="Gateway-aggregation (BFF) service and its downstream simulator" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${GIT_REVISION}" \
      org.opencontainers.image.licenses="MIT OR Apache-2.0"

# ca-certificates: TLS to downstreams or a managed Postgres. Nothing else is installed: health checks
# use bash's /dev/tcp (see docker-compose.yml), and Kubernetes probes are httpGet.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 tributary \
    && useradd --system --uid 10001 --gid tributary --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin tributary

COPY --from=builder /out/tributary /out/downstream-sim /usr/local/bin/

# The gateway looks for config/default.toml relative to its working directory. The migrations are
# embedded in the binary; the copy in migrations/ is there so operators can read what will run.
WORKDIR /app
COPY --chown=root:root migrations/ ./migrations/
COPY --chown=root:root config/ ./config/

# Numeric user so Kubernetes' runAsNonRoot can verify it without resolving names.
USER 10001:10001
EXPOSE 8080 9000
ENV TRIBUTARY_SERVER__LISTEN=0.0.0.0:8080 \
    TRIBUTARY_TELEMETRY__LOG_FORMAT=json
# SIGTERM starts the gateway's bounded drain (server.drain_timeout, 20 s).
STOPSIGNAL SIGTERM
CMD ["tributary", "serve"]
