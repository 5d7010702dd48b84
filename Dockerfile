# syntax=docker/dockerfile:1.7
#
# voucher-cdc container image.
#
#   docker build -t voucher-cdc:local .
#   docker run --rm -v "$PWD/config.toml:/etc/voucher-cdc/config.toml:ro" \
#     -v voucher-cdc-state:/var/lib/voucher-cdc voucher-cdc:local
#
# The builder compiles librdkafka from the source bundled in rdkafka-sys
# (./configure + make, no cmake) against the system OpenSSL (libssl-dev), for
# Kafka TLS and SASL SCRAM; TLS to the upstream API and NATS is rustls. The
# runtime image is debian:bookworm-slim with libssl3, ca-certificates and
# tini; the binary runs as an unprivileged user and keeps its state under the
# volume /var/lib/voucher-cdc. See docs/deployment.md.

ARG RUST_VERSION=1
ARG DEBIAN_RELEASE=bookworm

FROM rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS builder
# gcc, g++, make and perl come with the rust image; librdkafka's build also
# wants python3 (its Makefile reads the version with it), zlib headers and
# the OpenSSL headers (rdkafka feature `ssl`, found through pkg-config).
RUN apt-get update \
 && apt-get install -y --no-install-recommends make gcc g++ perl python3 zlib1g-dev libssl-dev pkg-config \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# Cache mounts keep the registry and the target directory between builds; the
# binary is copied out because the target mount is not part of the layer.
# Debug line tables stay in the binary (backtraces), compressed. The `dist`
# profile is `release` with whole-program LTO (Cargo.toml).
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/usr/local/cargo/git,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --profile dist --locked --bin voucher-cdc \
 && install -D -m 0755 target/dist/voucher-cdc /out/voucher-cdc \
 && objcopy --compress-debug-sections=zlib /out/voucher-cdc

FROM debian:${DEBIAN_RELEASE}-slim AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates libssl3 tini \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 voucher-cdc \
 && useradd --system --uid 10001 --gid voucher-cdc --home-dir /var/lib/voucher-cdc \
      --no-create-home --shell /usr/sbin/nologin voucher-cdc \
 && install -d -o voucher-cdc -g voucher-cdc -m 0750 /var/lib/voucher-cdc \
 && install -d -m 0755 /etc/voucher-cdc
COPY --from=builder /out/voucher-cdc /usr/local/bin/voucher-cdc
COPY deploy/docker/healthcheck.sh /usr/local/bin/voucher-cdc-healthcheck
COPY deploy/docker/config.toml /etc/voucher-cdc/config.toml

USER 10001:10001
WORKDIR /var/lib/voucher-cdc
VOLUME ["/var/lib/voucher-cdc"]
# Admin API: /healthz /readyz /metrics /v1/... The daemon binds it to loopback
# unless told otherwise: set VOUCHER_CDC_ADMIN__LISTEN=0.0.0.0:9464 together
# with VOUCHER_CDC_ADMIN__TOKEN to reach it from outside the container.
EXPOSE 9464
# The health check talks HTTP over bash's /dev/tcp: no curl in the image.
# HEALTHCHECK_URL is deliberately not VOUCHER_CDC_-prefixed (that prefix is config).
ENV HEALTHCHECK_URL=http://127.0.0.1:9464/healthz
# glibc's malloc is tuned by the binary itself (two arenas, large blocks
# mapped: src/main.rs); MALLOC_ARENA_MAX or MALLOC_MMAP_THRESHOLD_ set here
# would override it.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
  CMD ["voucher-cdc-healthcheck"]
# tini forwards SIGTERM to the daemon and reaps children.
ENTRYPOINT ["/usr/bin/tini", "--", "voucher-cdc"]
CMD ["run", "--config", "/etc/voucher-cdc/config.toml"]
