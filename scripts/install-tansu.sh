#!/usr/bin/env bash
# Installs the tansu Kafka-protocol broker used by the end-to-end Kafka test
# (tests/sink_kafka_tansu.rs) into the voucher-cdc cache, once.
#
# Cache root: $VCDC_CACHE_DIR, else ${XDG_CACHE_HOME:-$HOME/.cache}/voucher-cdc.
# Prints the path of the tansu binary on stdout (build output goes to stderr).
# The test finds it there, or wherever env TANSU_BIN points.
set -euo pipefail

version="0.6.0"
cache="${VCDC_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/voucher-cdc}"
root="$cache/tansu-$version"
binary="$root/bin/tansu"

if [[ -x "$binary" ]]; then
    echo "$binary"
    exit 0
fi

mkdir -p "$cache"
echo "installing tansu $version into $root (takes several minutes)" >&2
cargo install tansu --version "$version" --locked --features dynostore --root "$root" >&2

if [[ ! -x "$binary" ]]; then
    echo "install-tansu: cargo install finished but $binary is missing" >&2
    exit 1
fi
echo "$binary"
