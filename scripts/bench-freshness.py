#!/usr/bin/env python3
"""Monitor and analysis half of scripts/bench-freshness.sh (python3 stdlib only).

bench-freshness.sh starts one simulator and one bridge per strategy and then
runs this script, which follows every run directory while the bridges work:

  RUN/<strategy>/events.jsonl    the bridge's file sink (read line by line as it grows;
                                 a line's arrival time is when this script reads it)
  RUN/<strategy>/changes.jsonl   the simulator's --change-log
  RUN/<strategy>/requests.jsonl  the simulator's --request-log
  RUN/<strategy>/admin           the bridge's admin address (host:port)
  RUN/<strategy>/started         the bridge's start time (unix seconds)

It waits until every bridge finished its initial sync (every stream in
/v1/status has a finished full sweep), measures for --minutes, keeps reading
events for --drain seconds more (so a change made at the end of the window
still gets its chance), and prints one markdown table.
"""

import argparse
import bisect
import json
import math
import os
import re
import sys
import time
import urllib.request
from datetime import datetime

LIST_PATH = re.compile(r"/tenants/(\d+)/catalog/(vouchers|categories)$")
CONTENT_CHANGES = ("create", "update")
STATUS_EVERY = 2.0
TICK = 0.1
# The change log stamps a change just after the record's updated_at is set;
# an event carries that updated_at as its time.
EVENT_TIME_SLACK = 1.0


def parse_time(text):
    """RFC 3339 with 'Z' and up to microseconds -> unix seconds (float)."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class Tail:
    """Complete lines appended to a file since the last read."""

    def __init__(self, path):
        self.path = path
        self.offset = 0
        self.partial = b""

    def lines(self):
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
        except FileNotFoundError:
            return []
        self.offset += len(chunk)
        data = self.partial + chunk
        *complete, self.partial = data.split(b"\n")
        return [line for line in complete if line.strip()]


class Run:
    """One strategy: its files, what was read so far and its initial sync."""

    def __init__(self, root, strategy):
        self.strategy = strategy
        self.dir = os.path.join(root, strategy)
        with open(os.path.join(self.dir, "admin"), encoding="utf-8") as handle:
            self.admin = handle.read().strip()
        with open(os.path.join(self.dir, "started"), encoding="utf-8") as handle:
            self.started = float(handle.read().strip())
        self.events_tail = Tail(os.path.join(self.dir, "events.jsonl"))
        self.changes_tail = Tail(os.path.join(self.dir, "changes.jsonl"))
        self.requests_tail = Tail(os.path.join(self.dir, "requests.jsonl"))
        # (tenant, resource, id) -> [(arrival, event time, op)], events read after the window opened.
        self.events = {}
        self.events_total = 0
        self.bad_lines = 0
        self.changes = []  # (at, tenant, resource, id, change)
        self.requests = []  # (at, path, status)
        self.sync_done = None
        self.streams = None
        self.status_error = None

    def read(self, now, keep_events_after):
        for line in self.events_tail.lines():
            self.events_total += 1
            try:
                event = json.loads(line)
                tenant = int(event["tenant"])
                resource = event["source"].rsplit("/", 1)[-1]
                key = (tenant, resource, int(event["subject"]))
                op = event.get("op", "")
                event_time = parse_time(event["time"]) if event.get("time") else now
            except (ValueError, KeyError, TypeError, AttributeError):
                self.bad_lines += 1
                continue
            if keep_events_after is not None and now >= keep_events_after:
                self.events.setdefault(key, []).append((now, event_time, op))
        for line in self.changes_tail.lines():
            try:
                change = json.loads(line)
                self.changes.append(
                    (
                        parse_time(change["at"]),
                        int(change["tenant"]),
                        change["resource"],
                        int(change["id"]),
                        change["change"],
                    )
                )
            except (ValueError, KeyError, TypeError):
                self.bad_lines += 1
        for line in self.requests_tail.lines():
            try:
                request = json.loads(line)
                self.requests.append(
                    (parse_time(request["at"]), request["path"], int(request["status"]))
                )
            except (ValueError, KeyError, TypeError):
                self.bad_lines += 1

    def save_status(self, name):
        """Keeps /v1/status as RUN/<strategy>/<name>.json (the planner's view, for --keep)."""
        try:
            with urllib.request.urlopen(f"http://{self.admin}/v1/status", timeout=5) as response:
                body = response.read()
        except OSError as error:
            print(f"[{self.strategy}] status not saved: {error}", file=sys.stderr, flush=True)
            return
        with open(os.path.join(self.dir, f"{name}.json"), "wb") as handle:
            handle.write(body)

    def check_sync(self, now):
        """Asks /v1/status whether every stream finished a full sweep."""
        try:
            with urllib.request.urlopen(f"http://{self.admin}/v1/status", timeout=5) as response:
                report = json.load(response)
        except (OSError, ValueError) as error:
            self.status_error = str(error)
            return
        streams = report.get("streams", [])
        self.streams = len(streams)
        if streams and all(s.get("last_full_sweep_finished") for s in streams):
            self.sync_done = now


# The change skew makes a few tenants hot: latency is also shown per tier.
TIERS = (("tenants 1-10", 10), ("tenants 11+", None))


def tier(tenant):
    for name, last in TIERS:
        if last is None or tenant <= last:
            return name
    return TIERS[-1][0]


def percentile(sorted_values, fraction):
    """Nearest-rank percentile; math.inf entries stand for undelivered changes."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return sorted_values[rank - 1]


def seconds(value):
    if value is None:
        return "n/a"
    if math.isinf(value):
        return "undelivered"
    return f"{value:.1f} s"


def analyse(run, window_start, window_end, drain_end):
    result = {"strategy": run.strategy}
    # Initial sync.
    if run.sync_done is not None:
        result["sync_seconds"] = run.sync_done - run.started
        during = [r for r in run.requests if r[0] <= run.sync_done]
    else:
        result["sync_seconds"] = None
        during = [r for r in run.requests if r[0] <= window_start]
    result["sync_list_requests"] = sum(
        1 for r in during if LIST_PATH.search(r[1]) and r[2] == 200
    )
    result["sync_requests"] = len(during)
    result["sync_429"] = sum(1 for r in during if r[2] == 429)

    # Successful list requests of each stream, to split a latency into the
    # wait for the stream's next poll and the service delay after it.
    polls = {}
    for at, path, status in run.requests:
        match = LIST_PATH.search(path)
        if match and status == 200:
            polls.setdefault((int(match.group(1)), match.group(2)), []).append(at)
    for times in polls.values():
        times.sort()

    # Change-to-event latency.
    latencies = []
    poll_waits, service = [], []
    by_tier = {name: [] for name, _ in TIERS}
    no_event_kinds = {"silent_update": [0, 0], "touch": [0, 0], "delete": [0, 0]}
    # The slowest changes, with the poll gap they fell in: what decides the p99.
    slowest = []
    for at, tenant, resource, record, change in run.changes:
        if not window_start <= at <= window_end:
            continue
        candidates = run.events.get((tenant, resource, record), [])
        arrival = next(
            (
                arrived
                for arrived, event_time, op in candidates
                if arrived >= at and event_time >= at - EVENT_TIME_SLACK and op != "snapshot"
            ),
            None,
        )
        wait = gap = None
        if change in CONTENT_CHANGES and arrival is not None:
            times = polls.get((tenant, resource), [])
            first = bisect.bisect_left(times, at)
            if first < len(times) and times[first] <= arrival:
                wait = times[first] - at
                poll_waits.append(wait)
                service.append(arrival - times[first])
                if first > 0:
                    gap = times[first] - times[first - 1]
        if change in CONTENT_CHANGES:
            latency = math.inf if arrival is None else arrival - at
            latencies.append(latency)
            by_tier[tier(tenant)].append(latency)
            slowest.append((latency, tenant, resource, wait, gap))
        elif change in no_event_kinds:
            no_event_kinds[change][0] += 1
            if arrival is not None:
                no_event_kinds[change][1] += 1
    latencies.sort()
    result["changes"] = len(latencies)
    result["undelivered"] = sum(1 for x in latencies if math.isinf(x))
    for name, fraction in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0)):
        result[name] = percentile(latencies, fraction)
    result["no_event"] = no_event_kinds
    slowest.sort(key=lambda s: s[0], reverse=True)
    result["p99_rank_from_top"] = len(latencies) - max(1, math.ceil(0.99 * len(latencies))) + 1
    result["slowest"] = slowest[: result["p99_rank_from_top"] + 5]
    poll_waits.sort()
    service.sort()
    result["poll_wait"] = [percentile(poll_waits, f) for f in (0.5, 0.99)]
    result["service_delay"] = [percentile(service, f) for f in (0.5, 0.99, 1.0)]
    result["tiers"] = {}
    for name, values in by_tier.items():
        values.sort()
        result["tiers"][name] = (len(values), percentile(values, 0.5), percentile(values, 0.9))

    # Requests in the window.
    minutes = (window_end - window_start) / 60.0
    in_window = [r for r in run.requests if window_start <= r[0] <= window_end]
    result["requests_per_minute"] = len(in_window) / minutes if minutes > 0 else 0.0
    result["429"] = sum(1 for r in in_window if r[2] == 429)

    # Longest gap between two polls (successful list requests) of one stream.
    longest, longest_stream, unpolled, polled = 0.0, None, 0, 0
    for stream, all_times in polls.items():
        times = [t for t in all_times if t <= window_end]
        if not times:
            continue
        polled += 1
        in_window_polls = 0
        for earlier, later in zip(times, times[1:]):
            if later >= window_start:
                in_window_polls += 1
                if later - earlier > longest:
                    longest, longest_stream = later - earlier, stream
        # A stream still waiting at the end of the window counts with its open gap.
        if window_end - times[-1] > longest:
            longest, longest_stream = window_end - times[-1], stream
        if in_window_polls == 0:
            unpolled += 1
    result["longest_gap"] = longest
    result["longest_gap_stream"] = longest_stream
    result["unpolled_streams"] = unpolled
    result["streams_polled"] = polled
    result["events_total"] = run.events_total
    result["bad_lines"] = run.bad_lines
    result["drain"] = drain_end - window_end
    return result


def table(results, minutes):
    header = [
        "strategy",
        "initial sync",
        "sync list requests (429s)",
        f"content changes in {minutes:g} min",
        "p50",
        "p90",
        "p99",
        "max",
        "undelivered",
        "requests/min",
        "429s",
        "longest poll gap",
    ]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        gap = f"{r['longest_gap']:.0f} s"
        if r["longest_gap_stream"]:
            tenant, resource = r["longest_gap_stream"]
            gap += f" ({tenant}/{resource})"
        rows.append(
            "| "
            + " | ".join(
                [
                    r["strategy"],
                    seconds(r["sync_seconds"]) if r["sync_seconds"] is not None else "not finished",
                    f"{r['sync_list_requests']} ({r['sync_429']})",
                    str(r["changes"]),
                    seconds(r["p50"]),
                    seconds(r["p90"]),
                    seconds(r["p99"]),
                    seconds(r["max"]),
                    str(r["undelivered"]),
                    f"{r['requests_per_minute']:.1f}",
                    str(r["429"]),
                    gap,
                ]
            )
            + " |"
        )
    return "\n".join(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--strategies", required=True, help="comma-separated")
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--drain", type=float, default=360.0)
    parser.add_argument(
        "--warmup",
        type=float,
        default=0.0,
        help="seconds between the end of the slower initial sync and the window (rates are learnt meanwhile)",
    )
    parser.add_argument("--sync-timeout", type=float, default=900.0)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    runs = [Run(args.run_dir, s) for s in args.strategies.split(",") if s]
    window_start = window_end = drain_end = None
    next_status = 0.0
    first_start = min(r.started for r in runs)
    last_progress = 0.0
    snapshots = []  # (when, name): the planner's view at the window's start, middle and end
    while True:
        now = time.time()
        for run in runs:
            run.read(now, window_start)
        while snapshots and now >= snapshots[0][0]:
            _, name = snapshots.pop(0)
            for run in runs:
                run.save_status(name)
        if window_start is None:
            if now >= next_status:
                next_status = now + STATUS_EVERY
                for run in runs:
                    if run.sync_done is None:
                        run.check_sync(now)
                        if run.sync_done is not None:
                            print(
                                f"[{run.strategy}] initial sync finished after "
                                f"{run.sync_done - run.started:.0f} s",
                                file=sys.stderr,
                                flush=True,
                            )
            timed_out = now - first_start > args.sync_timeout
            if all(r.sync_done is not None for r in runs) or timed_out:
                if timed_out:
                    print("initial sync timeout: measuring anyway", file=sys.stderr, flush=True)
                window_start = now + args.warmup
                window_end = window_start + args.minutes * 60.0
                drain_end = window_end + args.drain
                snapshots = [
                    (window_start, "status-window-start"),
                    ((window_start + window_end) / 2.0, "status-window-middle"),
                    (window_end, "status-window-end"),
                ]
                print(
                    f"warming up for {args.warmup:.0f} s, measuring for {args.minutes:g} min,"
                    f" then {args.drain:.0f} s of drain",
                    file=sys.stderr,
                    flush=True,
                )
            elif now - last_progress >= 30.0:
                last_progress = now
                for run in runs:
                    state = "done" if run.sync_done else f"{run.events_total} events so far"
                    if run.status_error and not run.sync_done:
                        state += f" (status: {run.status_error})"
                    print(f"[{run.strategy}] initial sync: {state}", file=sys.stderr, flush=True)
        elif now >= drain_end:
            break
        elif now - last_progress >= 60.0:
            last_progress = now
            if now < window_start:
                print(f"warming up: {window_start - now:.0f} s left", file=sys.stderr, flush=True)
            else:
                left = max(0.0, window_end - now)
                print(f"measuring: {left:.0f} s of the window left", file=sys.stderr, flush=True)
        time.sleep(TICK)

    results = [analyse(r, window_start, window_end, drain_end) for r in runs]
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2, default=str)
    print(table(results, args.minutes))
    print()
    for r in results:
        kinds = ", ".join(
            f"{kind} {seen} ({evented} followed by an event on that record)" for kind, (seen, evented) in r["no_event"].items()
        )
        print(
            f"- {r['strategy']}: {r['sync_requests']} requests during the initial sync; "
            f"{r['streams_polled']} streams polled, {r['unpolled_streams']} not polled in the window; "
            f"changes not counted (no event expected before a full sweep): {kinds}; "
            f"{r['events_total']} events read"
            + (f"; {r['bad_lines']} unreadable lines" if r["bad_lines"] else "")
        )
        tiers = "; ".join(
            f"{name}: {count} changes, p50 {seconds(p50)}, p90 {seconds(p90)}"
            for name, (count, p50, p90) in r["tiers"].items()
        )
        print(f"  - {r['strategy']} by tier: {tiers}")
        wait, delay = r["poll_wait"], r["service_delay"]
        print(
            f"  - {r['strategy']}, delivered changes split at the stream's first poll after the change:"
            f" wait for that poll p50 {seconds(wait[0])}, p99 {seconds(wait[1])};"
            f" service delay after it (response, sink, this reader) p50 {seconds(delay[0])},"
            f" p99 {seconds(delay[1])}, max {seconds(delay[2])}"
        )
        slow = ", ".join(
            f"{tenant}/{resource} {seconds(latency)}"
            + (f" (poll gap {gap:.0f} s)" if gap is not None else "")
            for latency, tenant, resource, _wait, gap in r["slowest"]
        )
        print(
            f"  - {r['strategy']}, slowest changes (the p99 is number {r['p99_rank_from_top']}): {slow}"
        )


if __name__ == "__main__":
    main()
