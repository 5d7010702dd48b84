#!/usr/bin/env bash
# The bridge's own cost of a sync (issue 20): CPU per record, max RSS and
# records/s of the release binary's `run --once` against `simulate
# --rate-limit 0`, into the file sink and into NATS JetStream.
#
#   bash scripts/bench-sync.sh [--tenants N] [--vouchers N] [--categories N]
#                              [--sinks file,jetstream,stdout] [--cases first,sweep,scaling]
#                              [--scale 10000,100000,1000000] [--repeat R] [--keep]
#                              [--bulk-import-share S]
#
# Cases (one markdown table row each, the median of --repeat runs by CPU):
#   first    a first sync of every stream, into each of --sinks (fresh state,
#            and for jetstream a fresh `nats-server -js` with its own store dir)
#   sweep    a full sweep of the unchanged streams just synced (file sink):
#            the second run sets poll.full_resync_interval = poll.interval = 1s
#   scaling  first syncs into the file sink of about each --scale records
#            (--tenants tenants, vouchers split evenly, no categories): max RSS
# Columns: sink, case, records, list requests (from the simulator's
# --request-log; "= ceil" when they equal the sum of ceil(n/50) over the
# streams), wall, user+sys CPU of the bridge alone, µs of CPU per record,
# records/s (wall), max RSS.
#
# --bulk-import-share S is the simulator's share of records dated at one
# bulk-import instant (default its own, 0.08): 1 lists each catalog in id
# order, as an API fed by one bulk import would, instead of change order.
#
# Defaults: 2 tenants x (50,000 vouchers + 100 categories), relations on,
# sinks file,jetstream, cases first,sweep, 3 repeats. Everything listens on
# 127.0.0.1 only; every process it starts is killed on exit.
# Needs: cargo, python3, /usr/bin/time (GNU), nats-server for jetstream.
# It builds the `dist` profile, what the Docker image ships (VCDC_BENCH_PROFILE
# picks another, e.g. release); CARGO_TARGET_DIR is honoured; VCDC_BENCH_BIN
# skips the build.
set -euo pipefail
cd "$(dirname "$0")/.."

TENANTS=2
VOUCHERS=50000
CATEGORIES=100
SINKS="file,jetstream"
CASES="first,sweep"
SCALE="10000,100000,1000000"
REPEAT=3
KEEP=0
BULK_SHARE=""
PROFILE="${VCDC_BENCH_PROFILE:-dist}"

usage() {
  sed -n '2,33p' "$0" | sed 's/^# \{0,1\}//'
}

while [ $# -gt 0 ]; do
  case "$1" in
    --tenants) TENANTS="${2:?--tenants needs a value}"; shift 2 ;;
    --vouchers) VOUCHERS="${2:?--vouchers needs a value}"; shift 2 ;;
    --categories) CATEGORIES="${2:?--categories needs a value}"; shift 2 ;;
    --sinks) SINKS="${2:?--sinks needs a value}"; shift 2 ;;
    --cases) CASES="${2:?--cases needs a value}"; shift 2 ;;
    --scale) SCALE="${2:?--scale needs a value}"; shift 2 ;;
    --repeat) REPEAT="${2:?--repeat needs a value}"; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --bulk-import-share) BULK_SHARE="${2:?--bulk-import-share needs a value}"; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "error: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done

for number in "$TENANTS" "$VOUCHERS" "$CATEGORIES" "$REPEAT"; do
  case "$number" in
    '' | *[!0-9]*) echo "error: '$number' is not a whole number" >&2; exit 2 ;;
  esac
done
if [ -n "$BULK_SHARE" ] && ! [[ "$BULK_SHARE" =~ ^(0(\.[0-9]*)?|\.[0-9]+|1(\.0*)?)$ ]]; then
  echo "error: --bulk-import-share: '$BULK_SHARE' is not a share between 0 and 1" >&2
  exit 2
fi
[ "$TENANTS" -ge 1 ] || { echo "error: --tenants must be at least 1" >&2; exit 2; }
[ "$REPEAT" -ge 1 ] || { echo "error: --repeat must be at least 1" >&2; exit 2; }
IFS=',' read -r -a sink_list <<<"$SINKS"
IFS=',' read -r -a case_list <<<"$CASES"
IFS=',' read -r -a scale_list <<<"$SCALE"
for sink in "${sink_list[@]}"; do
  case "$sink" in
    file | jetstream | stdout) ;;
    *) echo "error: unknown sink '$sink' (file, jetstream, stdout)" >&2; exit 2 ;;
  esac
done
for name in "${case_list[@]}"; do
  case "$name" in
    first | sweep | scaling) ;;
    *) echo "error: unknown case '$name' (first, sweep, scaling)" >&2; exit 2 ;;
  esac
done
for number in "${scale_list[@]}"; do
  case "$number" in
    '' | *[!0-9]*) echo "error: --scale: '$number' is not a whole number" >&2; exit 2 ;;
  esac
done

needs=(python3)
[ -n "${VCDC_BENCH_BIN:-}" ] || needs+=(cargo)
for sink in "${sink_list[@]}"; do
  [ "$sink" = jetstream ] && needs+=(nats-server)
done
for tool in "${needs[@]}"; do
  command -v "$tool" >/dev/null || { echo "error: $tool not found" >&2; exit 1; }
done
[ -x /usr/bin/time ] || { echo "error: /usr/bin/time not found (apt-get install time)" >&2; exit 1; }

if [ -n "${VCDC_BENCH_BIN:-}" ]; then
  BIN="$VCDC_BENCH_BIN"
else
  # The profile the Docker image ships (Cargo.toml: release with fat LTO).
  echo "==> cargo build --profile $PROFILE --bin voucher-cdc" >&2
  cargo build --profile "$PROFILE" --bin voucher-cdc >&2
  BIN="${CARGO_TARGET_DIR:-target}/$PROFILE/voucher-cdc"
fi

RUN_DIR="$(mktemp -d -t voucher-cdc-bench-sync.XXXXXX)"
# shellcheck source=scripts/bench-common.sh
. scripts/bench-common.sh
install_cleanup

# Waits until something accepts TCP connections on 127.0.0.1:PORT (the
# simulator listens only once its catalog is built: up to a minute for a
# million records on a loaded machine).
wait_port() {
  local port="$1" pid="$2" what="$3"
  for _ in $(seq 1 3000); do
    if python3 -c "import socket,sys; socket.create_connection(('127.0.0.1', $port), 0.2)" 2>/dev/null; then
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || { echo "error: $what exited at start" >&2; return 1; }
    sleep 0.1
  done
  echo "error: $what does not listen after 300 s" >&2
  return 1
}

stop_pid() {
  local pid="$1"
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -9 "$pid" 2>/dev/null || true
}

SIM_PID=""
SIM_URL=""
SIM_LOG=""
# Starts a simulator for TENANTS x (VOUCHERS + CATEGORIES), no background changes.
start_simulator() {
  local tenants="$1" vouchers="$2" categories="$3" dir="$4" port
  port="$(free_port)"
  SIM_LOG="$dir/requests.jsonl"
  : >"$SIM_LOG"
  "$BIN" simulate --listen "127.0.0.1:$port" --tenants "$tenants" --vouchers "$vouchers" \
    --categories "$categories" --rate-limit 0 --changes-per-minute 0 --seed 20 \
    ${BULK_SHARE:+--bulk-import-share "$BULK_SHARE"} \
    --request-log "$SIM_LOG" >"$dir/simulator.log" 2>&1 &
  SIM_PID="$!"
  pids+=("$SIM_PID")
  wait_port "$port" "$SIM_PID" "the simulator"
  SIM_URL="http://127.0.0.1:$port/api/external/v1"
}

NATS_PID=""
NATS_URL=""
start_nats() {
  local dir="$1" port
  port="$(free_port)"
  mkdir -p "$dir/jetstream"
  nats-server -js -a 127.0.0.1 -p "$port" -sd "$dir/jetstream" >"$dir/nats.log" 2>&1 &
  NATS_PID="$!"
  pids+=("$NATS_PID")
  wait_port "$port" "$NATS_PID" "nats-server"
  NATS_URL="nats://127.0.0.1:$port"
}

# Writes the bridge config of one run into DIR/config.toml.
write_config() {
  local dir="$1" sink="$2" tenants="$3" interval="$4" tenant
  {
    printf '[upstream]\nbase_url = "%s"\ntoken = "sim-token"\nrequests_per_minute = 1000000\n\n' "$SIM_URL"
    # The default poll.max_pages_floor: a first sync's page limit grows with
    # the records it commits, whatever the size of the stream.
    printf '[poll]\ninterval = "%s"\nfull_resync_interval = "%s"\n\n' "$interval" "$interval"
    printf '[state]\npath = "%s/state"\n\n' "$dir"
    case "$sink" in
      file) printf '[sink]\nkind = "file"\n\n[sink.file]\npath = "%s/events.jsonl"\n\n' "$dir" ;;
      stdout) printf '[sink]\nkind = "stdout"\n\n' ;;
      jetstream) printf '[sink]\nkind = "nats"\n\n[sink.nats]\nurl = "%s"\n\n' "$NATS_URL" ;;
    esac
    printf '[admin]\nlisten = "127.0.0.1:%s"\n\n[log]\nformat = "json"\nlevel = "warn"\n' "$(free_port)"
    for tenant in $(seq 1 "$tenants"); do
      printf '\n[[tenants]]\nid = %s\n' "$tenant"
    done
  } >"$dir/config.toml"
}

# Runs `run --once` under /usr/bin/time -v; prints "requests wall user sys rss_kib".
timed_run() {
  local dir="$1" before after
  before="$(wc -l <"$SIM_LOG")"
  if ! /usr/bin/time -v -o "$dir/time.txt" "$BIN" run --once --config "$dir/config.toml" \
    >/dev/null 2>"$dir/bridge.log"; then
    echo "error: run --once failed ($dir/bridge.log):" >&2
    tail -n 5 "$dir/bridge.log" >&2
    return 1
  fi
  after="$(wc -l <"$SIM_LOG")"
  python3 - "$dir/time.txt" "$SIM_LOG" "$before" "$after" <<'PY'
import json, sys
time_file, log, before, after = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
fields = {}
for line in open(time_file, encoding="utf-8"):
    key, _, value = line.strip().rpartition(": ")
    fields[key] = value
def seconds(text):
    parts = [float(p) for p in text.split(":")]
    total = 0.0
    for p in parts:
        total = total * 60 + p
    return total
lists = 0
with open(log, encoding="utf-8") as f:
    for number, line in enumerate(f):
        if before <= number < after:
            path = json.loads(line)["path"]
            if path.endswith("/vouchers") or path.endswith("/categories"):
                lists += 1
print(lists, seconds(fields["Elapsed (wall clock) time (h:mm:ss or m:ss)"]),
      fields["User time (seconds)"], fields["System time (seconds)"],
      fields["Maximum resident set size (kbytes)"])
PY
}

# Runs one case REPEAT times and prints its markdown row (median by CPU).
# The setup function prepares DIR for a run (fresh state, sink) and echoes nothing.
ROWS=()
run_case() {
  local label="$1" sink="$2" records="$3" expected="$4" setup="$5" i dir out results=()
  for i in $(seq 1 "$REPEAT"); do
    dir="$RUN_DIR/$label-$sink-$records-$i"
    mkdir -p "$dir"
    "$setup" "$dir" "$sink"
    out="$(timed_run "$dir")" || exit 1
    results+=("$out")
    if [ -n "$NATS_PID" ]; then
      stop_pid "$NATS_PID"
      NATS_PID=""
    fi
    echo "    run $i: lists wall user sys rss_kib = $out" >&2
    # The events and the state are not needed once measured (GBs at 1M records).
    [ "$KEEP" -eq 1 ] || rm -rf "$dir/events.jsonl" "$dir/state" "$dir/jetstream"
  done
  local row
  row="$(printf '%s\n' "${results[@]}" | python3 -c '
import statistics, sys
sink, label, records, expected = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
runs = []
for line in sys.stdin:
    lists, wall, user, system, rss = line.split()
    runs.append((float(user) + float(system), int(lists), float(wall), float(user), float(system), int(rss)))
runs.sort()
cpu, lists, wall, user, system, rss = runs[len(runs) // 2]
spread = ""
if len(runs) > 1:
    spread = " ({:.2f}-{:.2f})".format(runs[0][0] / records * 1e6, runs[-1][0] / records * 1e6)
req = "{} = ceil".format(lists) if lists == expected else "{} (ceil: {})".format(lists, expected)
print("| {} | {} | {:,} | {} | {:.2f} s | {:.2f} s ({:.2f} + {:.2f}) | **{:.1f}**{} | {:,.0f} | {:.1f} MiB |".format(
    sink, label, records, req, wall, cpu, user, system, cpu / records * 1e6, spread,
    records / wall if wall > 0 else 0, rss / 1024))
' "$sink" "$label" "$records" "$expected")"
  ROWS+=("$row")
  echo "$row" >&2
}

# sum over streams of max(1, ceil(n/50))
expected_lists() {
  local tenants="$1" vouchers="$2" categories="$3"
  python3 -c "
import math
per = lambda n: max(1, math.ceil(n / 50))
print($tenants * (per($vouchers) + per($categories)))"
}

setup_first() {
  local dir="$1" sink="$2"
  if [ "$sink" = jetstream ]; then
    start_nats "$dir"
  fi
  write_config "$dir" "$sink" "$CUR_TENANTS" "1h"
}

setup_sweep() {
  local dir="$1" sink="$2"
  write_config "$dir" "$sink" "$CUR_TENANTS" "1s"
  # A first sync (untimed), then the timed run finds every full sweep due.
  "$BIN" run --once --config "$dir/config.toml" >/dev/null 2>"$dir/first-sync.log" || {
    echo "error: the first sync before the sweep failed ($dir/first-sync.log)" >&2
    return 1
  }
  sleep 1.2
}

echo "==> run dir $RUN_DIR; $REPEAT run(s) per case, median by CPU" >&2
has_case() {
  local want="$1" name
  for name in "${case_list[@]}"; do
    [ "$name" = "$want" ] && return 0
  done
  return 1
}

if has_case first || has_case sweep; then
  CUR_TENANTS="$TENANTS"
  records=$((TENANTS * (VOUCHERS + CATEGORIES)))
  expected="$(expected_lists "$TENANTS" "$VOUCHERS" "$CATEGORIES")"
  echo "==> simulator: $TENANTS tenants x ($VOUCHERS vouchers + $CATEGORIES categories)${BULK_SHARE:+, bulk import share $BULK_SHARE}" >&2
  start_simulator "$TENANTS" "$VOUCHERS" "$CATEGORIES" "$RUN_DIR"
  if has_case first; then
    for sink in "${sink_list[@]}"; do
      echo "==> first sync, $sink" >&2
      run_case "first sync" "$sink" "$records" "$expected" setup_first
    done
  fi
  if has_case sweep; then
    echo "==> full sweep of the unchanged streams, file" >&2
    run_case "full sweep, unchanged" file "$records" "$expected" setup_sweep
  fi
  stop_pid "$SIM_PID"
fi

if has_case scaling; then
  CUR_TENANTS="$TENANTS"
  for total in "${scale_list[@]}"; do
    per=$(((total + TENANTS - 1) / TENANTS))
    records=$((per * TENANTS))
    expected="$(expected_lists "$TENANTS" "$per" 0)"
    dir="$RUN_DIR/scale-$total"
    mkdir -p "$dir"
    echo "==> scaling: simulator $TENANTS tenants x $per vouchers" >&2
    start_simulator "$TENANTS" "$per" 0 "$dir"
    run_case "first sync (scaling)" file "$records" "$expected" setup_first
    stop_pid "$SIM_PID"
  done
fi

echo
echo "| sink | case | records | list requests | wall | CPU user+sys | µs CPU/record (min-max) | records/s | max RSS |"
echo "|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"
