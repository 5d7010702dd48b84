#!/usr/bin/env bash
# Freshness under a shared budget (issue 17): how stale do events get when
# 200 tenants share one token's 120 requests a minute?
#
# For every strategy it starts its own simulator (so each has its own budget)
# and its own bridge, both at the same time, waits for the initial syncs,
# measures for MINUTES and prints one markdown table: initial sync time and
# list requests, change-to-event latency p50/p90/p99/max over content changes,
# requests per minute, 429s and the longest gap between two polls of a stream.
#
#   bash scripts/bench-freshness.sh [--minutes M] [--strategies uniform,adaptive]
#                                   [--drain S] [--tenants N] [--keep]
#                                   [--warmup S]         (seconds between the syncs and the window)
#                                   [--max-interval D]   (adaptive's poll.max_interval, default 5m)
#                                   [--tail-guard G]     (adaptive's poll.tail_guard, default: the build's)
#                                   [--history D]        (the simulators' --change-history, default 6h;
#                                                         0s: records keep their generated dates, years old)
#
# Everything listens on 127.0.0.1 only; every process it starts is killed on
# exit; the whole run is bounded (initial sync timeout + window + drain).
# Needs: cargo, python3, curl. CARGO_TARGET_DIR is honoured.
set -euo pipefail
cd "$(dirname "$0")/.."

MINUTES=8
WARMUP=0
STRATEGIES="uniform,adaptive"
# Longer than poll.max_interval (5m), so no change is cut off by the end of the run.
DRAIN=360
TENANTS=200
VOUCHERS=100
CATEGORIES=5
SYNC_TIMEOUT=900
KEEP=0
MAX_INTERVAL=5m
TAIL_GUARD=""
# The catalog's past: the simulators date records as if the same change
# stream had run this long before the bridge started.
HISTORY=6h

usage() {
  sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'
}

while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) MINUTES="${2:?--minutes needs a value}"; shift 2 ;;
    --strategies) STRATEGIES="${2:?--strategies needs a value}"; shift 2 ;;
    --drain) DRAIN="${2:?--drain needs a value}"; shift 2 ;;
    --warmup) WARMUP="${2:?--warmup needs a value}"; shift 2 ;;
    --tenants) TENANTS="${2:?--tenants needs a value}"; shift 2 ;;
    --sync-timeout) SYNC_TIMEOUT="${2:?--sync-timeout needs a value}"; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --max-interval) MAX_INTERVAL="${2:?--max-interval needs a value}"; shift 2 ;;
    --tail-guard) TAIL_GUARD="${2:?--tail-guard needs a value}"; shift 2 ;;
    --history) HISTORY="${2:?--history needs a value}"; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "error: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done

for number in "$MINUTES" "$WARMUP" "$DRAIN" "$TENANTS" "$SYNC_TIMEOUT" ${TAIL_GUARD:+"$TAIL_GUARD"}; do
  case "$number" in
    '' | *[!0-9.]*) echo "error: '$number' is not a number" >&2; exit 2 ;;
  esac
done
IFS=',' read -r -a strategy_list <<<"$STRATEGIES"
if [ "${#strategy_list[@]}" -eq 0 ]; then
  echo "error: --strategies needs at least one of uniform, adaptive" >&2
  exit 2
fi
for strategy in "${strategy_list[@]}"; do
  case "$strategy" in
    uniform | adaptive) ;;
    *) echo "error: unknown strategy '$strategy' (uniform, adaptive)" >&2; exit 2 ;;
  esac
done

for tool in cargo python3 curl; do
  command -v "$tool" >/dev/null || { echo "error: $tool not found" >&2; exit 1; }
done

echo "==> cargo build --release --bin voucher-cdc" >&2
cargo build --release --bin voucher-cdc >&2
BIN="${CARGO_TARGET_DIR:-target}/release/voucher-cdc"

RUN_DIR="$(mktemp -d -t voucher-cdc-bench.XXXXXX)"
# Bounded: a bridge gets its shutdown_timeout (30 s) and a little more, then SIGKILL.
STOP_WAIT=350
# shellcheck source=scripts/bench-common.sh
. scripts/bench-common.sh
install_cleanup

# Waits until URL answers (the simulator listens only once its catalog is
# built, which can take minutes for a large one on a loaded machine).
wait_listening() {
  local url="$1" pid="$2" what="$3"
  for _ in $(seq 1 1500); do
    if curl -s -o /dev/null "$url"; then
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || { echo "error: $what exited at start" >&2; return 1; }
    sleep 0.2
  done
  echo "error: $what does not listen after 300 s" >&2
  return 1
}

# Writes a bridge config: all tenants on one token, file sink, state in DIR.
write_config() {
  local dir="$1" base_url="$2" admin="$3" strategy="$4" with_planner_keys="$5" tenant
  {
    printf '[upstream]\nbase_url = "%s"\ntoken = "sim-token"\nrequests_per_minute = 120\n\n' "$base_url"
    printf '[poll]\ninterval = "30s"\n'
    if [ "$with_planner_keys" -eq 1 ]; then
      printf 'max_interval = "%s"\nstrategy = "%s"\n' "$MAX_INTERVAL" "$strategy"
      if [ -n "$TAIL_GUARD" ]; then
        printf 'tail_guard = %s\n' "$TAIL_GUARD"
      fi
    fi
    printf '\n[state]\npath = "%s/state"\n\n' "$dir"
    printf '[sink]\nkind = "file"\n\n[sink.file]\npath = "%s/events.jsonl"\n\n' "$dir"
    printf '[admin]\nlisten = "%s"\n\n[log]\nformat = "pretty"\nlevel = "info"\n' "$admin"
    for tenant in $(seq 1 "$TENANTS"); do
      printf '\n[[tenants]]\nid = %s\n' "$tenant"
    done
  } >"$dir/config.toml"
}

for strategy in "${strategy_list[@]}"; do
  dir="$RUN_DIR/$strategy"
  mkdir -p "$dir"
  sim_port="$(free_port)"
  "$BIN" simulate --listen "127.0.0.1:$sim_port" --tenants "$TENANTS" \
    --vouchers "$VOUCHERS" --categories "$CATEGORIES" --rate-limit 120 \
    --changes-per-minute 60 --change-skew 1.1 --idle-tenants 0.2 --seed 17 \
    --change-history "$HISTORY" --change-log "$dir/changes.jsonl" --request-log "$dir/requests.jsonl" \
    >"$dir/simulator.log" 2>&1 &
  pids+=("$!")
  # An unknown path answers 404 before the rate limit: no budget spent.
  wait_listening "http://127.0.0.1:$sim_port/ready-probe" "$!" "the $strategy simulator"

  base_url="http://127.0.0.1:$sim_port/api/external/v1"
  admin="127.0.0.1:$(free_port)"
  write_config "$dir" "$base_url" "$admin" "$strategy" 1
  if ! "$BIN" check-config --config "$dir/config.toml" >"$dir/check-config.log" 2>&1; then
    if [ "$strategy" != "uniform" ]; then
      echo "error: this build does not accept poll.strategy = \"$strategy\":" >&2
      cat "$dir/check-config.log" >&2
      echo "(run with --strategies uniform until the planner is wired in)" >&2
      exit 1
    fi
    # Before the planner existed, uniform was the only behaviour and had no key.
    write_config "$dir" "$base_url" "$admin" "$strategy" 0
    "$BIN" check-config --config "$dir/config.toml" >"$dir/check-config.log" 2>&1 || {
      cat "$dir/check-config.log" >&2
      exit 1
    }
    echo "note: poll.strategy/max_interval unknown to this build; uniform runs with the defaults" >&2
  fi
done

# The bridges start together, after both simulators are up.
for strategy in "${strategy_list[@]}"; do
  dir="$RUN_DIR/$strategy"
  date +%s.%N >"$dir/started"
  "$BIN" run --config "$dir/config.toml" >"$dir/bridge.log" 2>&1 &
  pids+=("$!")
  sed -n 's/^listen = "\(.*\)"$/\1/p' "$dir/config.toml" >"$dir/admin"
done

echo "==> $TENANTS tenants x ($VOUCHERS vouchers + $CATEGORIES categories), 120 requests/min per token;" \
  "strategies: $STRATEGIES; window $MINUTES min + ${DRAIN}s drain (run dir $RUN_DIR)" >&2
# Bounded: the monitor ends after the sync timeout + window + drain at most.
limit="$(python3 -c "print(int($SYNC_TIMEOUT + $WARMUP + $MINUTES * 60 + $DRAIN + 120))")"
timeout "$limit" python3 scripts/bench-freshness.py --run-dir "$RUN_DIR" \
  --strategies "$STRATEGIES" --minutes "$MINUTES" --warmup "$WARMUP" --drain "$DRAIN" \
  --sync-timeout "$SYNC_TIMEOUT" --json "$RUN_DIR/results.json"
