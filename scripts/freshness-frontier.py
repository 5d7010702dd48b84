#!/usr/bin/env python3
"""What the budget allows: the freshness frontier of the benchmark's workload (python3 stdlib only).

An offline model of scripts/bench-freshness.sh (issue 17). It answers: on the
benchmark's workload and budget, what is the lowest change-to-event latency
median any poll schedule can reach while its p99 stays at uniform polling's,
and the lowest p99 while its median is half of uniform's? Together: can the
issue's two targets be met at once?

The workload (src/simulator/mutator.rs, `--changes-per-minute 60
--change-skew 1.1 --idle-tenants 0.2 --seed 17`): one change a second; the
tenant is Zipf(1.1) over tenants 1..160 (161..200 never change); vouchers with
probability 0.8, else categories; the kind from a roll (create 15 %, update
45 %, silent update 5 %, touch 20 %, delete 15 %), except that a table below
90 % of its starting size (100 vouchers, 5 categories) always gets a create.
The benchmark counts creates and updates (bench-freshness.py,
CONTENT_CHANGES) on the resource they happened to; silent category
re-renders (store.rs `refresh_categories`) are not in the change log and
count for nothing. A counted change whose record is deleted before the next
poll never gets an event: it counts as undelivered (an infinite latency).

The model: stream i (tenant x resource) gets counted changes as a Poisson
process of rate lambda_i and deletes of any one of its records at rate
delta_i; it is polled every T_i seconds exactly (floor <= T_i <= cap), each
poll costing one request (an incremental poll of this catalog is one page);
the budget is B requests a second, sum 1/T_i <= B. A change waits U(0, T_i)
for the next poll, then a service delay d (the response, the sink, the
benchmark's reader). So for stream i

    P(L > x) = 1 - (1 - exp(-delta_i m)) / (delta_i T_i),  m = min(T_i, max(0, x - d))

(the first term: delivered after x or never), and the latency distribution
of all counted changes is the mix weighted by lambda_i.

The frontier: for quantile targets (x50, x99) each stream's P(L > x) is a
convex, decreasing function of its poll rate u_i = 1/T_i and the budget is
linear in u, so the least budget that meets both targets is a convex
program. Its Lagrangian separates by stream,

    min over u_i of  u_i + mu50 w_i P_i(L > x50) + mu99 w_i P_i(L > x99),

solved per stream over a grid of periods that holds every breakpoint (the
floor, x50 - d, x99 - d, the cap). The multipliers come from nested
bisection (the smallest mu50 meeting the p50 target for a given mu99, the
smallest mu99 meeting the p99 target); the schedule found bounds the least
budget from above, the dual value from below. The lowest p50 is the
smallest x50 whose schedule fits in B (bisection on x50; "ruled out at" is
where the dual bound excludes every schedule), and likewise the lowest p99
under a p50 target.

Oracle rates give the frontier of a planner that knows every stream's true
rate. A planner has to learn them: the "best learner" rows give it each
stream's Poisson count of counted changes over a history of S seconds and
the posterior mean of its rate under the true population of its resource's
rates as the prior (it knows the Zipf law and the idle share, not which
stream is which), and solve the same frontier on those estimates; the
schedule it picks for the p50 target is then scored on the true rates.

  python3 scripts/freshness-frontier.py [--change-log FILE [--log-window 570,1170]] [--budget 1.8833,2]
      [--delay 0.2] [--floor 30] [--cap 300] [--learn 600,1200,3600,14400] [--draws 3]
      [--delete-scale 1]

With --change-log (a simulator's --change-log, same workload flags) it
compares the log's resource shares, counted shares and tenant shares with
the model's, and replays uniform polling on the log's real change sequence
to check the undelivered term. Pure Python: about a minute with --learn ""
(true rates only), tens of minutes with every learner row.
"""

import argparse
import importlib.util
import json
import math
import os
import sys
from datetime import datetime

TENANTS = 200
IDLE_SHARE = 0.2
SKEW = 1.1
CHANGES_PER_SECOND = 1.0
VOUCHER_SHARE = 0.8
INITIAL = {"vouchers": 100, "categories": 5}
# The roll of pick_change: create 0..=14, update 15..=59, silent 60..=64, touch 65..=84, delete 85..=99.
MIX = {"create": 0.15, "update": 0.45, "silent_update": 0.05, "touch": 0.20, "delete": 0.15}
COUNTED = ("create", "update")
# Bisection on the Lagrange multipliers (geometric, over this range).
MU_LOW, MU_HIGH, ITERATIONS = 1e-5, 1e5, 30
# Measured on the shared machine (README, "Freshness benchmark", run C/D, 10 minutes).
MEASURED = {
    "uniform": {"p50": 110.1, "p99": 209.2, "requests_per_minute": 113.0},
    "adaptive": {"p50": 34.1, "p99": 292.7, "requests_per_minute": 112.5},
}
# The window opens when the slower initial sync is done (uniform's, about 570 s).
WINDOW_START = 570.0
WINDOW = 600.0


def active_tenants():
    return TENANTS - round(TENANTS * IDLE_SHARE)


def zipf_weights():
    active = active_tenants()
    raw = [k ** -SKEW for k in range(1, active + 1)]
    total = sum(raw)
    return [w / total for w in raw] + [0.0] * (TENANTS - active)


def count_dynamics(initial, changes_before, changes_in_window):
    """Mean share of counted changes and mean per-record delete chance of one
    stream's changes that fall in the window, from the table-size Markov chain
    of pick_change (exact distribution over the record count)."""
    dist = {initial: 1.0}
    counted = deletes = weight = 0.0
    first = int(changes_before)
    last = max(first + 1, int(math.ceil(changes_before + changes_in_window)))
    for j in range(last):
        step_counted = step_delete = 0.0
        nxt = {}
        for n, p in dist.items():
            if n == 0 or n * 10 < initial * 9:
                step_counted += p
                nxt[n + 1] = nxt.get(n + 1, 0.0) + p
                continue
            step_counted += p * (MIX["create"] + MIX["update"])
            step_delete += p * MIX["delete"] / n
            nxt[n + 1] = nxt.get(n + 1, 0.0) + p * MIX["create"]
            nxt[n - 1] = nxt.get(n - 1, 0.0) + p * MIX["delete"]
            nxt[n] = nxt.get(n, 0.0) + p * (1 - MIX["create"] - MIX["delete"])
        if j >= first:
            counted += step_counted
            deletes += step_delete
            weight += 1.0
        dist = {n: p for n, p in nxt.items() if p > 1e-12}
    return counted / weight, deletes / weight


class Stream:
    __slots__ = ("tenant", "resource", "rate", "counted", "delete")

    def __init__(self, tenant, resource, rate, counted, delete):
        self.tenant = tenant
        self.resource = resource
        self.rate = rate  # all background changes a second
        self.counted = counted  # counted changes a second (lambda)
        self.delete = delete  # deletes a second of one given record (delta)


def workload():
    """Every stream of the benchmark with its rates, from the mutator's rules."""
    shares = {"vouchers": VOUCHER_SHARE, "categories": 1.0 - VOUCHER_SHARE}
    streams = []
    for tenant, weight in enumerate(zipf_weights(), start=1):
        for resource in ("vouchers", "categories"):
            rate = CHANGES_PER_SECOND * weight * shares[resource]
            if rate <= 0:
                streams.append(Stream(tenant, resource, 0.0, 0.0, 0.0))
                continue
            counted, delete = count_dynamics(
                INITIAL[resource], rate * WINDOW_START, rate * WINDOW
            )
            streams.append(Stream(tenant, resource, rate, rate * counted, rate * delete))
    return streams


# ---------------------------------------------------------------- the latency model


def tail_one(stream, period, x, delay):
    """P(latency > x) of one counted change of `stream` polled every `period`."""
    m = min(period, max(0.0, x - delay))
    if stream.delete <= 0.0:
        return 1.0 - m / period
    return 1.0 - (-math.expm1(-stream.delete * m)) / (stream.delete * period)


def tail(streams, periods, x, delays):
    """P(latency > x) over all counted changes (delays: [(d, probability)])."""
    total = sum(s.counted for s in streams)
    acc = 0.0
    for s, period in zip(streams, periods):
        if s.counted > 0:
            acc += s.counted * sum(p * tail_one(s, period, x, d) for d, p in delays)
    return acc / total


def quantile(streams, periods, q, delays):
    """The q-quantile of latency (math.inf when more than 1-q is never delivered)."""
    lo, hi = 0.0, max(periods) + max(d for d, _ in delays) + 1.0
    if tail(streams, periods, hi, delays) > 1.0 - q:
        return math.inf
    for _ in range(60):
        mid = (lo + hi) / 2
        if tail(streams, periods, mid, delays) > 1.0 - q:
            lo = mid
        else:
            hi = mid
    return hi


def mean_latency(streams, periods, delays):
    total = sum(s.counted for s in streams)
    mean_delay = sum(d * p for d, p in delays)
    return sum(s.counted * (t / 2 + mean_delay) for s, t in zip(streams, periods)) / total


def undelivered(streams, periods):
    total = sum(s.counted for s in streams)
    return sum(s.counted * tail_one(s, t, math.inf, 0.0) for s, t in zip(streams, periods)) / total


# ---------------------------------------------------------------- policies


def uniform_periods(streams, budget, floor):
    return [max(floor, len(streams) / budget)] * len(streams)


def square_root_periods(streams, budget, floor, cap, rates=None):
    """The square-root law T_i = sqrt(theta / lambda_i), clamped, spending the budget."""
    rates = rates or [s.counted for s in streams]

    def periods(theta):
        return [
            cap if r <= 0 else min(cap, max(floor, math.sqrt(theta / r))) for r in rates
        ]

    lo, hi = 1e-12, 1e12
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if sum(1 / t for t in periods(mid)) > budget:
            lo = mid
        else:
            hi = mid
    return periods(hi)


def grid(floor, cap, points):
    """Candidate periods: a geometric ladder plus every breakpoint."""
    ladder = [floor * (cap / floor) ** (i / 23) for i in range(24)]
    return sorted(set(ladder + [p for p in points if floor <= p <= cap]))


class Frontier:
    """Least budget for quantile targets (x50, x99) by Lagrangian duality."""

    def __init__(self, streams, floor, cap, delays):
        self.streams = streams
        self.active = [s for s in streams if s.counted > 0]
        self.idle = len(streams) - len(self.active)
        self.floor, self.cap, self.delays = floor, cap, delays
        self.total = sum(s.counted for s in self.active)

    def tables(self, x50, x99):
        ds = [d for d, _ in self.delays]
        cands = grid(self.floor, self.cap, [x50 - d for d in ds] + [x99 - d for d in ds])
        rows = []
        for s in self.active:
            w = s.counted / self.total
            rows.append(
                [
                    (
                        1.0 / t,
                        w * sum(p * tail_one(s, t, x50, d) for d, p in self.delays),
                        w * sum(p * tail_one(s, t, x99, d) for d, p in self.delays),
                        t,
                    )
                    for t in cands
                ]
            )
        return rows

    @staticmethod
    def argmin(rows, mu50, mu99):
        cost = t50 = t99 = 0.0
        picks = []
        for row in rows:
            best, best_value = None, math.inf
            for c in row:
                value = c[0] + mu50 * c[1] + mu99 * c[2]
                if value < best_value:
                    best, best_value = c, value
            cost += best[0]
            t50 += best[1]
            t99 += best[2]
            picks.append(best)
        return cost, t50, t99, picks

    @staticmethod
    def repair(rows, mu50, mu99, need50, need99):
        """The cheapest schedule the multipliers point at, ties split.

        Streams alike (the learner's estimates tie by the hundred) change
        their period at the same multiplier, so the argmin on either side of
        it over- or undershoots the targets by a whole group. Start from the
        argmin just below the multipliers and move streams one by one to
        their choice just above, best target gain per request first, until
        both targets hold."""
        step = 1.0 + 1e-6
        low = Frontier.argmin(rows, mu50 / step, mu99 / step)
        high = Frontier.argmin(rows, mu50 * step, mu99 * step)
        cost, t50, t99 = low[0], low[1], low[2]
        picks = list(low[3])
        moves = []
        for i, (a, b) in enumerate(zip(low[3], high[3])):
            if a is b:
                continue
            gain = mu50 * (a[1] - b[1]) + mu99 * (a[2] - b[2])
            spend = b[0] - a[0]
            moves.append((-(gain / spend) if spend > 0 else -math.inf, i, b))
        moves.sort(key=lambda m: (m[0], m[1]))
        for _, i, b in moves:
            if t50 <= need50 and t99 <= need99:
                break
            a = picks[i]
            cost += b[0] - a[0]
            t50 += b[1] - a[1]
            t99 += b[2] - a[2]
            picks[i] = b
        return cost, t50, t99, picks

    def least_budget(self, x50, x99, q50=0.5, q99=0.99):
        """(lower bound, upper bound, periods of the upper bound) of the budget
        the targets P(L > x50) <= 1-q50 and P(L > x99) <= 1-q99 need."""
        rows = self.tables(x50, x99)
        need50, need99 = 1.0 - q50, 1.0 - q99
        idle_cost = self.idle / self.cap

        def inner(mu99):
            # Smallest mu50 meeting the p50 target at this mu99.
            res = self.argmin(rows, 0.0, mu99)
            if res[1] <= need50:
                return 0.0, res
            lo, hi = MU_LOW, MU_HIGH
            res_hi = self.argmin(rows, hi, mu99)
            if res_hi[1] > need50:
                return None, res_hi
            for _ in range(ITERATIONS):
                mid = math.sqrt(lo * hi)
                res_mid = self.argmin(rows, mid, mu99)
                if res_mid[1] <= need50:
                    hi, res_hi = mid, res_mid
                else:
                    lo = mid
            return hi, res_hi

        def dual(mu50, mu99):
            res = self.argmin(rows, mu50, mu99)
            return res[0] + mu50 * (res[1] - need50) + mu99 * (res[2] - need99)

        mu50, res = inner(0.0)
        if mu50 is not None and res[2] <= need99:
            best = (0.0, mu50, res)
        else:
            lo, hi = MU_LOW, MU_HIGH
            mu50_hi, res_hi = inner(hi)
            if mu50_hi is None or res_hi[2] > need99:
                return math.inf, math.inf, None  # not reachable within the floor
            for _ in range(ITERATIONS):
                mid = math.sqrt(lo * hi)
                mu50_mid, res_mid = inner(mid)
                if mu50_mid is not None and res_mid[2] <= need99:
                    hi, mu50_hi, res_hi = mid, mu50_mid, res_mid
                else:
                    lo = mid
            best = (hi, mu50_hi, res_hi)
        mu99, mu50, res = best
        lower = dual(mu50, mu99)
        fixed = self.repair(rows, mu50, mu99, need50, need99)
        if fixed[1] <= need50 + 1e-12 and fixed[2] <= need99 + 1e-12 and fixed[0] < res[0]:
            res = fixed
        periods = iter(c[3] for c in res[3])
        full = [next(periods) if s.counted > 0 else self.cap for s in self.streams]
        return lower + idle_cost, res[0] + idle_cost, full

    def min_p50(self, budget, x99, q99=0.99):
        """Lowest p50 with P(L > x99) <= 1-q99 within `budget`: (p50 bound, periods)."""
        return self._bisect(budget, lambda x: self.least_budget(x, x99, q99=q99), x99)

    def min_p99(self, budget, x50):
        """Lowest p99 with p50 <= x50 within `budget`."""
        return self._bisect(budget, lambda x: self.least_budget(x50, x), self.cap * 2)

    def _bisect(self, budget, need, hi):
        """Smallest target whose schedule fits in `budget`: (certified bound, reached, result).

        Bisection on the schedule found (an upper bound on the budget the
        target needs); the dual value at the last target that did not fit
        says whether it is ruled out for every schedule (the certified
        lower bound; None when the dual does not rule it out)."""
        lo = self.floor * 0.5 + min(d for d, _ in self.delays)
        found = need(hi)
        if found[1] > budget:
            return None, math.inf, None
        lo_result = need(lo)
        if lo_result[1] <= budget:
            return lo, lo, lo_result
        for _ in range(13):
            mid = (lo + hi) / 2
            res = need(mid)
            if res[1] <= budget:
                hi, found = mid, res
            else:
                lo, lo_result = mid, res
        # The dual bound is a little weaker than the schedule found (a
        # stream's period jumps between candidates): step down until it
        # rules a target out for every schedule.
        certified = None
        for step in (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0):
            x = lo - step
            if x <= 0:
                break
            if x == lo and lo_result[0] > budget or need(x)[0] > budget:
                certified = x
                break
        return certified, hi, found


# ---------------------------------------------------------------- the change log


def read_change_log(path):
    changes = []
    try:
        handle = open(path, encoding="utf-8")
    except OSError as error:
        raise SystemExit(f"error: cannot read the change log {path}: {error.strerror}")
    with handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                c = json.loads(line)
                at = datetime.fromisoformat(c["at"].replace("Z", "+00:00")).timestamp()
                changes.append((at, int(c["tenant"]), c["resource"], int(c["id"]), c["change"]))
            except (ValueError, KeyError, TypeError) as error:
                raise SystemExit(f"error: {path}: unreadable change-log line ({error})")
    if not changes:
        raise SystemExit(f"error: {path}: no changes")
    return changes


def compare_log(changes, streams):
    """Prints the log's workload next to the model's."""
    span = changes[-1][0] - changes[0][0]
    n = len(changes)
    print(f"change log: {n} changes over {span:.0f} s ({60 * n / max(span, 1):.1f}/min)")
    by_resource = {}
    for _, tenant, resource, _, kind in changes:
        by_resource.setdefault(resource, {}).setdefault(kind, 0)
        by_resource[resource][kind] += 1
    print("| resource | share of changes (model) | counted share (model) | kinds |")
    print("|---|---|---|---|")
    for resource in ("vouchers", "categories"):
        kinds = by_resource.get(resource, {})
        total = sum(kinds.values())
        counted = sum(kinds.get(k, 0) for k in COUNTED)
        model_rate = sum(s.rate for s in streams if s.resource == resource)
        model_counted = sum(s.counted for s in streams if s.resource == resource) / model_rate
        kinds_text = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
        print(
            f"| {resource} | {total / n:.3f} ({model_rate:.3f}) | "
            f"{counted / max(total, 1):.3f} ({model_counted:.3f}) | {kinds_text} |"
        )
    tenants = {}
    for _, tenant, _, _, _ in changes:
        tenants[tenant] = tenants.get(tenant, 0) + 1
    weights = zipf_weights()
    top = [(1, 1), (2, 2), (3, 5), (6, 10), (11, 40), (41, 160), (161, 200)]
    cells = []
    for a, b in top:
        seen = sum(tenants.get(t, 0) for t in range(a, b + 1)) / n
        model = sum(weights[a - 1 : b])
        cells.append(f"tenants {a}-{b}: {seen:.3f} ({model:.3f})")
    print("tenant shares, measured (Zipf model): " + "; ".join(cells))


# ---------------------------------------------------------------- learnt rates


def learnt_streams(streams, seconds, rng):
    """What the best learner could know after watching every stream for
    `seconds`: the Poisson count of counted changes of each stream, pooled
    per tenant (a tenant's streams change in fixed proportion on this
    workload, so their summed count is what there is to know), turned into
    the posterior mean of the tenant's rate under the *true* population of
    tenant rates as the prior (an oracle prior: it knows the Zipf law and the
    idle share, only not which tenant is which) and split over its streams in
    their true proportion. Tenants with the same count are indistinguishable
    to it. Deletes scale with the estimate."""
    tenants = {}
    for s in streams:
        tenants.setdefault(s.tenant, []).append(s)
    population = [sum(x.counted for x in xs) for xs in tenants.values()]
    posterior = {}

    def mean(n):
        # sum_j l_j^(n+1) e^(-l_j t) / sum_j l_j^n e^(-l_j t), in logs; idle tenants have l = 0.
        if n not in posterior:
            logs = []
            for lam in population:
                if lam <= 0:
                    if n == 0:
                        logs.append((0.0, -math.inf))
                    continue
                base = n * math.log(lam) - lam * seconds
                logs.append((base, base + math.log(lam)))
            top = max(l for l, _ in logs)
            num = sum(math.exp(h - top) for _, h in logs if h > -math.inf)
            den = sum(math.exp(l - top) for l, _ in logs)
            posterior[n] = num / den
        return posterior[n]

    # Each resource's share of a tenant's counted changes and deletes (the same for every tenant but
    # for the table-size dynamics, which the learner is granted).
    share = {}
    for xs in tenants.values():
        total = sum(x.counted for x in xs)
        if total > 0:
            for x in xs:
                share.setdefault(x.resource, (x.counted / total, x.delete / x.counted))
    result = []
    for xs in tenants.values():
        estimate = mean(sum(poisson(rng, x.counted * seconds) for x in xs))
        for x in xs:
            part, ratio = share[x.resource]
            result.append(Stream(x.tenant, x.resource, x.rate, estimate * part, estimate * part * ratio))
    return result


def poisson(rng, mean):
    if mean <= 0:
        return 0
    if mean > 50:
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, prod = math.exp(-mean), 0, rng.random()
    while prod > limit:
        k += 1
        prod *= rng.random()
    return k


# ---------------------------------------------------------------- the change log, replayed


def replay_undelivered(changes, streams, periods, draws, rng):
    """Share of the log's counted changes whose record is deleted before the
    next poll, with every stream polled every `periods[i]` from a random
    phase (averaged over `draws` phases): the model's undelivered term,
    checked on the real change sequence."""
    index = {(s.tenant, s.resource): i for i, s in enumerate(streams)}
    deletes = {}
    for at, tenant, resource, record, kind in changes:
        if kind == "delete":
            deletes.setdefault((tenant, resource, record), []).append(at)
    counted = [c for c in changes if c[4] in COUNTED]
    lost = 0
    for _ in range(draws):
        phase = [rng.random() * t for t in periods]
        for at, tenant, resource, record, _ in counted:
            i = index[(tenant, resource)]
            t = periods[i]
            poll = phase[i] + math.ceil((at - phase[i]) / t) * t
            if any(at < d <= poll for d in deletes.get((tenant, resource, record), ())):
                lost += 1
    return lost / (draws * max(1, len(counted))), len(counted)


# ---------------------------------------------------------------- report


def _bench_module():
    """scripts/bench-freshness.py, whose formatting this report shares."""
    sys.dont_write_bytecode = True  # no __pycache__ beside the scripts
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench-freshness.py")
    spec = importlib.util.spec_from_file_location("bench_freshness", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# "12.3 s", "undelivered" (a quantile that falls on changes never delivered) or "n/a".
fmt = _bench_module().seconds


def reach(x):
    """A frontier value: infinite when no schedule meets the other target."""
    return "out of reach" if x is not None and math.isinf(x) else fmt(x)


def describe(streams, periods, floor, cap):
    """How a schedule spreads the streams (and the counted changes) over periods."""
    names = ("at the floor", "under 100 s", "100 s to under the cap", "at the cap")
    buckets = {k: 0 for k in names}
    counted = {k: 0.0 for k in names}
    total = sum(s.counted for s in streams)
    for s, t in zip(streams, periods):
        if t <= floor + 0.5:
            k = names[0]
        elif t < 100:
            k = names[1]
        elif t >= cap - 0.5:
            k = names[3]
        else:
            k = names[2]
        buckets[k] += 1
        counted[k] += s.counted / total
    return ", ".join(f"{k} {buckets[k]} ({100 * counted[k]:.1f}%)" for k in names)


def evaluate(streams, periods, delays):
    return (
        quantile(streams, periods, 0.5, delays),
        quantile(streams, periods, 0.99, delays),
        undelivered(streams, periods),
        sum(1 / t for t in periods),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--change-log", help="a simulator --change-log (same workload flags) to check the model against")
    parser.add_argument(
        "--log-window",
        help="FROM,TO seconds after the log's first change: replay only the changes in between"
        " (the benchmark measures from about 570 s to 1170 s)",
    )
    parser.add_argument(
        "--budget",
        default=f"{MEASURED['uniform']['requests_per_minute'] / 60:.4f},2",
        help="requests a second, comma-separated (default: what the benchmark got, 113/min, and the nominal 120/min)",
    )
    parser.add_argument(
        "--delay", type=float, default=0.2, help="service delay d (s; measured p99 0.1-0.2 s, bench-freshness.py)"
    )
    parser.add_argument("--floor", type=float, default=30.0, help="poll.interval (s)")
    parser.add_argument("--cap", type=float, default=300.0, help="poll.max_interval (s)")
    parser.add_argument(
        "--learn",
        default="600,1200,3600,14400",
        help="seconds of history for the learnt-rate rows, comma-separated ('' for none)",
    )
    parser.add_argument("--draws", type=int, default=3, help="random histories per learnt-rate row")
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument(
        "--delete-scale",
        type=float,
        default=1.0,
        help="scales the delete rates (0: no change is lost to a delete; the change-log replay prints"
        " the scale that matches the log)",
    )
    args = parser.parse_args()
    try:
        budgets = [float(b) for b in args.budget.split(",")]
        learn = [float(x) for x in args.learn.split(",") if x.strip()]
    except ValueError:
        raise SystemExit("error: --budget and --learn take comma-separated numbers")
    if args.floor <= 0 or args.cap < args.floor or any(b <= 0 for b in budgets):
        raise SystemExit("error: need 0 < floor <= cap and positive budgets")
    import random

    rng = random.Random(args.seed)
    delays = [(args.delay, 1.0)]
    target50 = MEASURED["uniform"]["p50"] / 2
    target99 = MEASURED["uniform"]["p99"]

    streams = workload()
    if args.delete_scale != 1.0:
        if not 0.0 <= args.delete_scale <= 10.0:
            raise SystemExit("error: --delete-scale must be between 0 and 10")
        streams = [Stream(s.tenant, s.resource, s.rate, s.counted, s.delete * args.delete_scale) for s in streams]
    active = sum(1 for s in streams if s.counted > 0)
    print(
        f"workload: {len(streams)} streams, {active} with counted changes, "
        f"{60 * sum(s.counted for s in streams):.1f} counted changes/min (creates and updates, "
        f"of {60 * sum(s.rate for s in streams):.0f} changes/min)"
    )
    hottest = sorted(streams, key=lambda s: -s.counted)[:4]
    print("hottest streams: " + ", ".join(f"{s.tenant}/{s.resource} {60 * s.counted:.2f}/min" for s in hottest))
    if args.change_log:
        changes = read_change_log(args.change_log)
        compare_log(changes, streams)
        if args.log_window:
            try:
                start, end = (float(x) for x in args.log_window.split(","))
            except ValueError:
                raise SystemExit("error: --log-window takes FROM,TO in seconds")
            first = changes[0][0]
            # Deletes after the window still decide whether a change in it was delivered.
            changes = [c for c in changes if c[0] - first >= start]
            print(f"replaying the {sum(1 for c in changes if start <= c[0] - first <= end)} changes from {start:.0f} s to {end:.0f} s")
            changes = [c for c in changes if c[4] == "delete" or c[0] - first <= end]
        budget = budgets[0]
        uni = uniform_periods(streams, budget, args.floor)
        seen, n = replay_undelivered(changes, streams, uni, 20, rng)
        print(
            f"uniform polling every {uni[0]:.1f} s, replayed on the log's {n} counted changes: "
            f"{100 * seen:.2f}% deleted before the next poll (model: {100 * undelivered(streams, uni):.2f}%;"
            f" --delete-scale {seen / max(1e-12, undelivered(workload(), uni)):.2f} matches the log)"
        )
    print()
    print(f"targets (README, measured): p50 <= {target50:.2f} s (half of uniform's), p99 <= {target99:.1f} s (uniform's)")
    print(
        "measured: uniform p50 {p50} / p99 {p99} at {requests_per_minute}/min; ".format(**MEASURED["uniform"])
        + "adaptive default p50 {p50} / p99 {p99} at {requests_per_minute}/min".format(**MEASURED["adaptive"])
    )
    print()
    table = []
    for budget in budgets:
        uni = uniform_periods(streams, budget, args.floor)
        sq = square_root_periods(streams, budget, args.floor, args.cap)
        u, q = evaluate(streams, uni, delays), evaluate(streams, sq, delays)
        print(f"B = {60 * budget:.0f}/min, d = {args.delay:g} s")
        print(f"  uniform (round {uni[0]:.1f} s): p50 {fmt(u[0])}, p99 {fmt(u[1])}, undelivered {100 * u[2]:.2f}%")
        print(f"  square-root law: p50 {fmt(q[0])}, p99 {fmt(q[1])}, undelivered {100 * q[2]:.2f}%")
        frontier = Frontier(streams, args.floor, args.cap, delays)
        cert50, best50, found50 = frontier.min_p50(budget, target99)
        cert99, best99, found99 = frontier.min_p99(budget, target50)
        row = {"budget": budget, "uniform": u, "sqrt": q, "p50": best50, "p99": best99}
        for label, cert, best, found in (
            (f"min p50 with p99 <= {target99:.1f}", cert50, best50, found50),
            (f"min p99 with p50 <= {target50:.2f}", cert99, best99, found99),
        ):
            print(f"  oracle rates, {label}: {reach(best)} (ruled out at {fmt(cert)})")
            if found and found[2]:
                e = evaluate(streams, found[2], delays)
                print(f"    that schedule: p50 {fmt(e[0])}, p99 {fmt(e[1])}, undelivered {100 * e[2]:.2f}%, {60 * e[3]:.1f} req/min; {describe(streams, found[2], args.floor, args.cap)}")
        for seconds in learn:
            results = []
            for _ in range(args.draws):
                known = learnt_streams(streams, seconds, rng)
                f = Frontier(known, args.floor, args.cap, delays)
                # The learner's own frontier (what its estimates promise, and
                # where its dual rules a target out), and what the schedules it
                # picks really give on the true rates.
                cert50, expect50, aim50 = f.min_p50(budget, target99)
                cert99, expect99, aim99 = f.min_p99(budget, target50)
                true50 = evaluate(streams, aim50[2], delays)[:2] if aim50 and aim50[2] else (math.inf, math.inf)
                true99 = evaluate(streams, aim99[2], delays)[:2] if aim99 and aim99[2] else (math.inf, math.inf)
                law = square_root_periods(streams, budget, args.floor, args.cap, [k.counted for k in known])
                results.append(
                    (expect50, cert50 or 0.0) + true50 + (expect99, cert99 or 0.0) + true99 + evaluate(streams, law, delays)[:2]
                )
            spans = [(min(r[i] for r in results), max(r[i] for r in results)) for i in range(10)]
            row[f"learnt {seconds:.0f}"] = spans

            def span(i, show=fmt):
                lo, hi = spans[i]
                return show(lo) if lo == hi else f"{show(lo)}..{show(hi)}"

            print(
                f"  best learner after {seconds:.0f} s ({len(results)} histories):"
                f" with p99 <= {target99:.1f} it expects min p50 {span(0, reach)} (ruled out below {span(1)}),"
                f" and that schedule really gives p50 {span(2)}, p99 {span(3)};"
                f" with p50 <= {target50:.2f} it expects min p99 {span(4, reach)} (ruled out below {span(5)}),"
                f" and that schedule really gives p50 {span(6)}, p99 {span(7)};"
                f" the square-root law on its estimates gives p50 {span(8)}, p99 {span(9)}"
            )
        table.append(row)
        print(flush=True)

    print("| budget | uniform p50 / p99 | square-root law p50 / p99 | oracle: min p50 with p99 <= %.1f | oracle: min p99 with p50 <= %.2f |" % (target99, target50)
          + "".join(f" best learner after {s:.0f} s, schedule for p99 <= {target99:.1f}: true p50 / p99 |" for s in learn))
    print("|---|---|---|---|---|" + "---|" * len(learn))
    for r in table:
        cells = [
            f"{60 * r['budget']:.0f}/min",
            f"{fmt(r['uniform'][0])} / {fmt(r['uniform'][1])}",
            f"{fmt(r['sqrt'][0])} / {fmt(r['sqrt'][1])}",
            reach(r["p50"]),
            reach(r["p99"]),
        ]
        for s in learn:
            v = r.get(f"learnt {s:.0f}")
            cells.append(f"{fmt(v[2][0])}-{fmt(v[2][1])} / {fmt(v[3][0])}-{fmt(v[3][1])}" if v else "n/a")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
