#!/usr/bin/env bash
# The 50-kill variant of tests/kill_nine.rs (issue 12, "never lose a change"):
# builds the release binary with crash points once, then runs the kill -9
# test against it with KILLS rounds (default 50) and prints one result line.
#   bash scripts/kill-test.sh [KILLS]
# Env: VCDC_KILL_SEED (the schedule's seed; default fixed), NATS_SERVER_BIN,
# CARGO_TARGET_DIR (default the shared cache, as scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

KILLS="${1:-${KILLS:-50}}"
case "$KILLS" in
  '' | *[!0-9]*) echo "error: KILLS must be a number of kills, got '$KILLS'" >&2; exit 2 ;;
esac

CACHE="${VCDC_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/voucher-cdc}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$CACHE/target}"

if ! command -v nats-server >/dev/null && [ -z "${NATS_SERVER_BIN:-}" ]; then
  echo "error: nats-server not found; apt-get install nats-server or set NATS_SERVER_BIN" >&2
  exit 1
fi

echo "==> cargo build --release --features crash-points" >&2
cargo build --release --locked --features crash-points --bin voucher-cdc >&2
export VCDC_RELEASE_BIN="$CARGO_TARGET_DIR/release/voucher-cdc"
export KILLS
# A missing nats-server must fail, not skip.
export CI="${CI:-1}"

log="$(mktemp -t voucher-cdc-kill-test.XXXXXX)"
trap 'rm -f "$log"' EXIT
echo "==> cargo test --release --features crash-points --test kill_nine (KILLS=$KILLS)" >&2
set +e
cargo test --release --locked --features crash-points --test kill_nine -- --nocapture >"$log" 2>&1
status=$?
set -e

result="$(grep -o 'kill-nine result: .*' "$log" | tail -n 1 || true)"
if [ "$status" -ne 0 ]; then
  # The failure names every lost record and the seed; show it.
  grep -E '^(LOST|CHAIN|ID):|panicked|seed' "$log" | cut -c1-400 | head -n 60 >&2 || tail -n 60 "$log" >&2
fi
if [ -z "$result" ]; then
  echo "kill-test: FAILED before a result (exit $status); see the output above" >&2
  exit 1
fi
if [ "$status" -eq 0 ]; then
  echo "kill-test: PASS ${result#kill-nine result: }"
  exit 0
fi
echo "kill-test: FAIL ${result#kill-nine result: }"
exit 1
