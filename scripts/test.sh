#!/usr/bin/env bash
# The whole test suite, on a fresh machine: installs what is missing (system
# packages, nats-server, the tansu broker), then runs fmt, clippy, the tests
# and the deployment checks. Caches live outside the clone (see CACHE below).
set -euo pipefail
cd "$(dirname "$0")/.."

# Not VOUCHER_CDC_*: that prefix belongs to the config (unknown keys are errors).
CACHE="${VCDC_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/voucher-cdc}"
export VCDC_CACHE_DIR="$CACHE"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$CACHE/target}"
mkdir -p "$CACHE"

log() { printf '==> %s\n' "$*"; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# System packages: a C toolchain and OpenSSL headers for librdkafka's bundled build, nats-server
# for the NATS tests, python3 for the deployment checks.
missing=()
command -v cc >/dev/null || missing+=(build-essential)
command -v make >/dev/null || missing+=(make)
command -v perl >/dev/null || missing+=(perl)
command -v python3 >/dev/null || missing+=(python3)
command -v nats-server >/dev/null || missing+=(nats-server)
command -v pkg-config >/dev/null || missing+=(pkg-config)
# librdkafka links the system OpenSSL (rdkafka feature `ssl`: Kafka TLS, SCRAM).
pkg-config --exists openssl 2>/dev/null || missing+=(libssl-dev)
# `docker compose config` validates the compose file; Debian ships the
# standalone docker-compose when the compose plugin is absent.
if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null; then
  missing+=(docker-compose)
fi
# Manifest checks: kubectl renders the kustomization, shellcheck the scripts.
command -v kubectl >/dev/null || missing+=(kubectl)
command -v shellcheck >/dev/null || missing+=(shellcheck)
# PyYAML: tests/deploy_kubernetes.rs reads the rendered manifests with it.
python3 -c 'import yaml' >/dev/null 2>&1 || missing+=(python3-yaml)
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing system packages: ${missing[*]}"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${missing[@]}"
fi

if ! command -v cargo >/dev/null; then
  echo "error: cargo not found; install Rust stable (rustup) first" >&2
  exit 1
fi

# kubernetes-validate (PyPI, pinned) validates the rendered manifests offline.
KV="$CACHE/venv-kubernetes-validate-1.37.0"
if [ ! -x "$KV/bin/kubernetes-validate" ]; then
  log "installing kubernetes-validate 1.37.0 into $KV"
  rm -rf "$KV"
  python3 -m venv "$KV"
  "$KV/bin/pip" install -q kubernetes-validate==1.37.0
fi
export PATH="$PATH:$KV/bin"

log "tansu broker (cached in $CACHE)"
TANSU_BIN="$(bash scripts/install-tansu.sh | tail -n 1)"
export TANSU_BIN

# Every tool the tests need is installed above, so under this script a test
# that cannot find one fails instead of skipping (tests/common/brokers.rs).
# Only a bare `cargo test` may skip, and it prints why.
export VCDC_REQUIRE_BROKERS=1

log "cargo fmt --check"
cargo fmt --all -- --check

# crash-points compiles the named crash points the durability tests arm.
log "cargo clippy --all-targets --features crash-points -- -D warnings"
cargo clippy --all-targets --locked --features crash-points -- -D warnings

# The crash tests (tests/crash_points.rs, tests/kill_nine.rs) abort and kill
# the release-profile binary, as production would run it.
log "cargo build --release --features crash-points (the binary the crash tests kill)"
cargo build --release --locked --features crash-points --bin voucher-cdc
export VCDC_RELEASE_BIN="$CARGO_TARGET_DIR/release/voucher-cdc"

log "cargo test --features crash-points"
cargo test --locked --no-fail-fast --features crash-points --lib --bins --tests

log "deployment files (compose, kubernetes, dashboard, schema)"
bash scripts/validate-deploy.sh

log "all checks passed"
