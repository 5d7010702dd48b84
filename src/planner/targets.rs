//! The planner's arithmetic, free of clocks and I/O: how often each stream
//! of a token should be polled so the token's budget buys the most freshness
//! without making the slowest changes wait longer than uniform polling would
//! (docs/planner.md, "The rule").
//!
//! Two steps:
//!
//! 1. [`estimate_rates`]: every stream's change rate, pooled per tenant (a
//!    tenant's resources change together) and shrunk toward the token's
//!    population of tenants by empirical Bayes: the population's law is
//!    estimated nonparametrically from every tenant's counts (the
//!    Kiefer-Wolfowitz maximum-likelihood mixture, by EM on a fixed grid of
//!    rates), and each tenant's rate is its posterior mean under that law. A
//!    tenant silent for ten minutes on a token where most tenants change
//!    every minute is then not taken for dead, nor one lucky change for hot.
//! 2. [`target_periods`]: the poll period of each stream. A tail target, a
//!    share of the round a uniform schedule would take, bounds every stream
//!    but the coldest, which go just under the cap ([`TAIL_CAP_SHARE`]) as
//!    long as the changes they carry would add at most [`TAIL_EXCESS`] of
//!    all changes above the tail target (the p99 keeps its margin); the
//!    budget left is spent on the median:
//!    the hottest streams at one hot period, the least that polls half the
//!    changes within it (bang-bang; docs/planner.md). Without a tail target
//!    (`poll.tail_guard = 0`) the square-root law (Cho and Garcia-Molina
//!    2003) spends it instead, the lowest mean.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::stream::{Resource, TenantId};

/// Share of all changes allowed to wait longer than the tail target: the
/// coldest streams held only to just under the cap carry at most this much
/// of the learnt changes times their chance to wait past the tail target.
/// Well under the 1% a p99 allows: a ten-minute window's p99 is its fourth
/// slowest change of ~355, the changes no poll can catch (a version deleted
/// before the next poll, 0.6% of the benchmark's) usually take two of those
/// four, and the cold tail's slow changes come as a Poisson count (at 0.3%,
/// 1.2 expected a window; run M had two, and a p99 of 230 s against 210 s).
pub const TAIL_EXCESS: f64 = 0.002;

/// Share of the budget's pace a schedule plans to spend (see
/// [`target_periods`]): the rest absorbs polls the budget delays. The
/// work-conserving lanes spend any slack early on the streams next due, the
/// bulk: with 3% planned slack the freshness benchmark polled its bulk every
/// 191-196 s for a 201 s target, slack the median rule's hot streams lacked.
pub const SPEND_SHARE: f64 = 0.99;

/// Share of the estimated changes the median rule polls within the hot period.
pub const MEDIAN_SHARE: f64 = 0.5;

/// Share of `poll.max_interval` the cold tail is planned at; the rest is
/// headroom. A cold stream planned at the cap itself is overdue the moment
/// it is due, and overdue streams go before every other: the cold tail, whose
/// polls the first sync had bunched together, then polled in bursts that held
/// everything else back (run L: no cold poll for 40 s, then 13 of 19 requests
/// in 10 s, every 300 s; the bulk waited up to 220 s for a 200 s target).
/// Planned a little under the cap, deadlines order the cold tail among the
/// rest and spread its bursts, and the cap's priority is left for overload.
pub const TAIL_CAP_SHARE: f64 = 0.95;

/// The grid of tenant rates (changes a second) the population's law lives
/// on: zero (a tenant that never changes) and a geometric ladder from one
/// change in 11.6 days to one a second.
fn rate_grid() -> Vec<f64> {
    const POINTS: usize = 48;
    std::iter::once(0.0)
        .chain((0..POINTS).map(|k| 1e-6 * 1e6f64.powf(k as f64 / (POINTS - 1) as f64)))
        .collect()
}

/// EM iterations per estimate; the law is warm-started from the last one.
const EM_ITERATIONS: usize = 40;

/// What the planner knows of one stream, as [`estimate_rates`] needs it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Observed {
    /// The stream's tenant.
    pub tenant: TenantId,
    /// The stream's resource.
    pub resource: Resource,
    /// Changes counted (decayed).
    pub changes: f64,
    /// Seconds observed (decayed alike).
    pub seconds: f64,
}

/// The population's law of tenant rates, kept between estimates.
#[derive(Debug, Clone, PartialEq)]
pub struct Population {
    grid: Vec<f64>,
    weights: Vec<f64>,
}

impl Default for Population {
    fn default() -> Self {
        let grid = rate_grid();
        let weights = vec![1.0 / grid.len() as f64; grid.len()];
        Self { grid, weights }
    }
}

impl Population {
    /// The mean tenant rate under the law (changes a second).
    pub fn mean(&self) -> f64 {
        self.grid
            .iter()
            .zip(&self.weights)
            .map(|(r, w)| r * w)
            .sum()
    }
}

/// Every stream's change rate (changes a second, in the order given): its
/// tenant's posterior mean under the population's law, split over the
/// tenant's streams by each resource's share of the token's changes.
/// `population` is refitted to the counts (and kept for the next call).
pub fn estimate_rates(streams: &[Observed], population: &mut Population) -> Vec<f64> {
    if streams.is_empty() {
        return Vec::new();
    }
    // Each resource's share of the token's changes (one pseudo-change each).
    let mut resources: BTreeMap<Resource, (f64, f64)> = BTreeMap::new();
    for s in streams {
        let (changes, seconds) = resources.entry(s.resource).or_default();
        *changes += s.changes;
        *seconds += s.seconds;
    }
    // A resource's rate per stream, relative to the others: its share of a tenant's changes.
    let per_stream: BTreeMap<Resource, f64> = resources
        .iter()
        .map(|(r, (changes, seconds))| (*r, (changes + 1.0) / seconds.max(1.0)))
        .collect();
    let total: f64 = per_stream.values().sum();
    let share = |resource: Resource| per_stream.get(&resource).map_or(0.0, |r| r / total);
    // Tenants: changes and exposure (seconds weighted by the resource's share).
    let mut tenants: BTreeMap<TenantId, (f64, f64)> = BTreeMap::new();
    for s in streams {
        let (n, exposure) = tenants.entry(s.tenant).or_default();
        *n += s.changes;
        *exposure += s.seconds * share(s.resource);
    }
    let counts: Vec<(f64, f64)> = tenants.values().copied().collect();
    let posterior: BTreeMap<TenantId, f64> = tenants
        .keys()
        .copied()
        .zip(posterior_means(&counts, population))
        .collect();
    streams
        .iter()
        .map(|s| {
            posterior
                .get(&s.tenant)
                .map_or(0.0, |rate| rate * share(s.resource))
        })
        .collect()
}

/// Refits `population` to the tenants' (changes, exposure) and returns each
/// tenant's posterior mean rate. Counts are decayed, so not integers: the
/// Poisson likelihood is taken with `lgamma`.
fn posterior_means(tenants: &[(f64, f64)], population: &mut Population) -> Vec<f64> {
    let grid = &population.grid;
    // Log-likelihood of each tenant's count at each grid rate.
    let likelihood: Vec<Vec<f64>> = tenants
        .iter()
        .map(|(n, exposure)| {
            let row: Vec<f64> = grid
                .iter()
                .map(|rate| {
                    let mean = rate * exposure;
                    if mean <= 0.0 {
                        if *n <= 1e-9 {
                            0.0
                        } else {
                            f64::NEG_INFINITY
                        }
                    } else {
                        n * mean.ln() - mean - ln_gamma(n + 1.0)
                    }
                })
                .collect();
            // Scaled by the row's best, so exp() stays in range.
            let top = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            row.iter().map(|l| (l - top).exp()).collect()
        })
        .collect();
    let mut weights = population.weights.clone();
    for _ in 0..EM_ITERATIONS {
        let mut next = vec![0.0; grid.len()];
        for row in &likelihood {
            let evidence: f64 = row.iter().zip(&weights).map(|(l, w)| l * w).sum();
            if evidence <= 0.0 {
                continue;
            }
            for (k, (l, w)) in row.iter().zip(&weights).enumerate() {
                next[k] += l * w / evidence;
            }
        }
        let sum: f64 = next.iter().sum();
        if sum <= 0.0 {
            break;
        }
        // A floor keeps every rate reachable when a tenant's behaviour changes.
        weights = next.iter().map(|w| (w / sum).max(1e-9)).collect();
    }
    population.weights = weights;
    likelihood
        .iter()
        .map(|row| {
            let evidence: f64 = row
                .iter()
                .zip(&population.weights)
                .map(|(l, w)| l * w)
                .sum();
            if evidence <= 0.0 {
                return population.mean();
            }
            row.iter()
                .zip(&population.weights)
                .zip(grid)
                .map(|((l, w), rate)| l * w * rate)
                .sum::<f64>()
                / evidence
        })
        .collect()
}

/// `ln Γ(x)` for x > 0 (Lanczos, g = 7): enough for likelihood ratios.
fn ln_gamma(x: f64) -> f64 {
    const G: f64 = 7.0;
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut a = C[0];
    let t = x + G + 0.5;
    for (i, c) in C.iter().enumerate().skip(1) {
        a += c / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

/// What [`target_periods`] needs of one stream.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Demand {
    /// Estimated changes a second.
    pub rate: f64,
    /// Requests a poll costs (at least 1).
    pub cost: f64,
    /// Breaks ties between streams of equal rate (a hash of the key, so no
    /// tenant is always first among equals).
    pub tie: u64,
}

/// The schedule [`target_periods`] found.
#[derive(Debug, Clone, PartialEq)]
pub struct Targets {
    /// Each stream's target poll period, in the order given.
    pub periods: Vec<Duration>,
    /// The stream is in the cold tail: its period is above the tail target.
    pub tail: Vec<bool>,
    /// The bound every other stream is held to (None: the budget covers the floor).
    pub tail_target: Option<Duration>,
}

/// The limits [`target_periods`] plans within.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// `poll.interval`: no period below it.
    pub floor: Duration,
    /// `poll.max_interval`: no period above it.
    pub cap: Duration,
    /// `poll.tail_guard`: the tail target as a share of a uniform round (0:
    /// none, the cold tail's period just under the cap).
    pub tail_share: f64,
}

/// Target poll periods for streams sharing `budget` requests a second (None:
/// unlimited). With a budget that covers every stream at the floor, every
/// period is the floor (the uniform schedule).
pub fn target_periods(demands: &[Demand], budget: Option<f64>, limits: Limits) -> Targets {
    // A rate that is not a finite positive number is taken as no change.
    let clean: Vec<Demand> = demands
        .iter()
        .map(|d| Demand {
            rate: if d.rate.is_finite() && d.rate > 0.0 {
                d.rate
            } else {
                0.0
            },
            ..*d
        })
        .collect();
    let demands = &clean[..];
    let floor = limits.floor.as_secs_f64().max(1e-3);
    let cap = limits.cap.as_secs_f64().max(floor);
    // The cold tail's period: under the cap by the headroom.
    let tail_period = (cap * TAIL_CAP_SHARE).max(floor);
    let n = demands.len();
    let costs: Vec<f64> = demands.iter().map(|d| d.cost.max(1.0)).collect();
    let at_floor = |tail_target| Targets {
        periods: vec![Duration::from_secs_f64(floor); n],
        tail: vec![false; n],
        tail_target,
    };
    let Some(budget) = budget.filter(|b| b.is_finite() && *b > 0.0) else {
        return at_floor(None);
    };
    let round = costs.iter().sum::<f64>() / budget;
    if round <= floor {
        return at_floor(None);
    }
    // What the schedule may spend: a little under the pace, so the polls
    // the budget delays now and then do not push every deadline later.
    let budget = budget * SPEND_SHARE;
    let total_rate: f64 = demands.iter().map(|d| d.rate).sum();
    // Coldest first (rate per request), ties by the hash.
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| {
        let (da, db) = (&demands[a], &demands[b]);
        (da.rate / costs[a])
            .total_cmp(&(db.rate / costs[b]))
            .then(da.tie.cmp(&db.tie))
            .then(a.cmp(&b))
    });
    // The cold tail for a tail target x: the coldest streams whose changes
    // would add at most TAIL_EXCESS above x at the tail's period.
    let tail_for = |x: f64| {
        let mut tail = vec![false; n];
        let beyond = 1.0 - x / tail_period;
        if beyond <= 0.0 {
            // The tail target is the tail's period: there is nothing to hold apart.
            return tail;
        }
        let mut excess = 0.0;
        for &i in &order {
            let share = if total_rate > 0.0 {
                demands[i].rate / total_rate
            } else {
                0.0
            };
            if excess + share * beyond > TAIL_EXCESS {
                break;
            }
            excess += share * beyond;
            tail[i] = true;
        }
        tail
    };
    let spend = |x: f64, tail: &[bool]| -> f64 {
        (0..n)
            .map(|i| costs[i] / if tail[i] { tail_period } else { x })
            .sum()
    };
    let wanted = if limits.tail_share > 0.0 {
        (round * limits.tail_share).clamp(floor, tail_period)
    } else {
        tail_period
    };
    // The tail target: the wanted one, or the least the budget allows.
    let mut target = wanted;
    if spend(target, &tail_for(target)) > budget {
        let (mut lo, mut hi) = (target, cap);
        for _ in 0..40 {
            let mid = (lo + hi) / 2.0;
            if spend(mid, &tail_for(mid)) > budget {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        target = hi;
    }
    let mut tail = tail_for(target);
    let base: Vec<f64> = (0..n)
        .map(|i| if tail[i] { tail_period } else { target })
        .collect();
    let spread = Spread {
        demands,
        costs: &costs,
        base: &base,
        floor,
        budget,
        total_rate,
    };
    let periods = if limits.tail_share > 0.0 {
        // Streams that change, hottest first (rate per request), ties by the hash.
        let hottest: Vec<usize> = order
            .iter()
            .rev()
            .copied()
            .filter(|&i| demands[i].rate > 0.0)
            .collect();
        spread.median_rule(&hottest, target)
    } else {
        spread.square_root_law()
    };
    // A cold stream the budget had room for is in the tail only while its
    // period is still above the tail target.
    for (quiet, period) in tail.iter_mut().zip(&periods) {
        *quiet = *quiet && *period > target;
    }
    Targets {
        periods: periods.into_iter().map(Duration::from_secs_f64).collect(),
        tail,
        tail_target: Some(Duration::from_secs_f64(target)),
    }
}

/// The budget left above the base schedule (every stream at the tail target,
/// the cold tail just under the cap), and the two ways to spend it.
struct Spread<'a> {
    demands: &'a [Demand],
    costs: &'a [f64],
    /// Each stream's period before the spread (seconds).
    base: &'a [f64],
    /// `poll.interval` (seconds).
    floor: f64,
    /// Requests a second the schedule may spend.
    budget: f64,
    /// The streams' estimated changes a second, all together.
    total_rate: f64,
}

impl Spread<'_> {
    /// Requests a second `periods` spend.
    fn spend(&self, periods: &[f64]) -> f64 {
        periods.iter().zip(self.costs).map(|(t, c)| c / t).sum()
    }

    /// Changes a second polled within `x` of happening (a change waits
    /// `U(0, period)` for its stream's next poll).
    fn caught_within(&self, x: f64, periods: &[f64]) -> f64 {
        periods
            .iter()
            .zip(self.demands)
            .map(|(period, d)| d.rate * (x / period).min(1.0))
            .sum()
    }

    /// The median rule: streams in `hottest` order brought down to one hot
    /// period `x`, the least at which the budget polls [`MEDIAN_SHARE`] of
    /// the changes within `x` (at most `target`). A change polled within `x`
    /// counts the same for the median however early, so spending on a stream
    /// buys `rate x` per request-rate, linear in its poll rate: the optimum is
    /// bang-bang, hottest first, the rest left at their base.
    fn median_rule(&self, hottest: &[usize], target: f64) -> Vec<f64> {
        let total = self.total_rate;
        let left = self.budget - self.spend(self.base);
        if total <= 0.0 || left <= 0.0 {
            return self.base.to_vec();
        }
        let enough =
            |x: f64| self.caught_within(x, &self.hot_at(x, hottest, left)) >= MEDIAN_SHARE * total;
        let x = if enough(self.floor) {
            self.floor
        } else {
            let (mut lo, mut hi) = (self.floor, target.max(self.floor));
            for _ in 0..50 {
                let mid = (lo + hi) / 2.0;
                if enough(mid) {
                    hi = mid;
                } else {
                    lo = mid;
                }
            }
            hi
        };
        self.hot_at(x, hottest, left)
    }

    /// The bang-bang schedule for a hot period `x`: the streams of `hottest`,
    /// in that order, brought from their base period down to `x` while `left`
    /// (requests a second above the base) pays for them; the first it cannot
    /// pay for in full gets what is left (a period between).
    fn hot_at(&self, x: f64, hottest: &[usize], mut left: f64) -> Vec<f64> {
        let mut periods = self.base.to_vec();
        for &i in hottest {
            if self.base[i] <= x {
                continue;
            }
            let cost = self.costs[i];
            let extra = cost * (1.0 / x - 1.0 / self.base[i]);
            if extra <= left {
                periods[i] = x;
                left -= extra;
            } else {
                periods[i] = cost / (cost / self.base[i] + left);
                break;
            }
        }
        periods
    }

    /// The square-root law (Cho and Garcia-Molina 2003), the lowest mean
    /// latency: `T = sqrt(θ cost / rate)` between the floor and each stream's
    /// base, `θ` found so that the schedule spends the budget.
    fn square_root_law(&self) -> Vec<f64> {
        let periods_at = |theta: f64| -> Vec<f64> {
            self.demands
                .iter()
                .zip(self.costs)
                .zip(self.base)
                .map(|((d, cost), base)| {
                    if d.rate <= 0.0 {
                        *base
                    } else {
                        (theta * cost / d.rate)
                            .sqrt()
                            .clamp(self.floor.min(*base), *base)
                    }
                })
                .collect()
        };
        let (mut lo, mut hi) = (1e-12f64, 1e12f64);
        for _ in 0..100 {
            let mid = (lo * hi).sqrt();
            if self.spend(&periods_at(mid)) > self.budget {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        periods_at(hi)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cold tail's period under the tests' 300 s cap (seconds).
    const TAIL_PERIOD: f64 = 300.0 * TAIL_CAP_SHARE;

    fn limits(tail_share: f64) -> Limits {
        Limits {
            floor: Duration::from_secs(30),
            cap: Duration::from_secs(300),
            tail_share,
        }
    }

    fn demand(rate: f64, tie: u64) -> Demand {
        Demand {
            rate,
            cost: 1.0,
            tie,
        }
    }

    fn spent(targets: &Targets) -> f64 {
        targets.periods.iter().map(|t| 1.0 / t.as_secs_f64()).sum()
    }

    #[test]
    fn ln_gamma_matches_factorials() {
        for (x, f) in [(1.0, 1.0f64), (2.0, 1.0), (5.0, 24.0), (11.0, 3_628_800.0)] {
            assert!((ln_gamma(x) - f.ln()).abs() < 1e-9, "x = {x}");
        }
        assert!((ln_gamma(0.5) - std::f64::consts::PI.sqrt().ln()).abs() < 1e-9);
    }

    #[test]
    fn an_ample_budget_puts_every_stream_at_the_floor() {
        let demands: Vec<Demand> = (0..10).map(|i| demand(i as f64 / 100.0, i)).collect();
        let targets = target_periods(&demands, Some(1.0), limits(0.9));
        assert!(targets
            .periods
            .iter()
            .all(|t| *t == Duration::from_secs(30)));
        assert_eq!(targets.tail_target, None);
        let unlimited = target_periods(&demands, None, limits(0.9));
        assert!(unlimited
            .periods
            .iter()
            .all(|t| *t == Duration::from_secs(30)));
    }

    /// 400 streams on 113 requests a minute, Zipf-skewed: the benchmark's shape.
    fn skewed() -> Vec<Demand> {
        (0..400u64)
            .map(|i| {
                let tenant = i / 2 + 1;
                let rate = if tenant > 160 {
                    0.0
                } else {
                    0.6 * (tenant as f64).powf(-1.1) / 4.6 * if i % 2 == 0 { 0.8 } else { 0.2 }
                };
                demand(rate, i.wrapping_mul(2_654_435_761) % 1_000_003)
            })
            .collect()
    }

    #[test]
    fn the_schedule_spends_the_budget_and_keeps_every_bound() {
        let budget = 113.0 / 60.0;
        let demands = skewed();
        let targets = target_periods(&demands, Some(budget), limits(0.95));
        let plannable = budget * SPEND_SHARE;
        assert!(
            spent(&targets) <= plannable * 1.0001,
            "spent {}",
            spent(&targets)
        );
        assert!(
            spent(&targets) >= plannable * 0.99,
            "spent {}",
            spent(&targets)
        );
        let tail_target = targets.tail_target.unwrap();
        let round = 400.0 / budget;
        assert!((tail_target.as_secs_f64() - 0.95 * round).abs() < 0.5);
        for (i, t) in targets.periods.iter().enumerate() {
            assert!(*t >= Duration::from_secs(30) && *t <= Duration::from_secs(300));
            if !targets.tail[i] {
                assert!(*t <= tail_target, "stream {i} at {t:?}");
            }
        }
        // The hottest stream polls at the floor-side, the idle ones at the tail's period.
        assert!(
            targets.periods[0] < Duration::from_secs(60),
            "{:?}",
            targets.periods[0]
        );
        assert!(targets.tail[399] && targets.periods[399] == Duration::from_secs_f64(TAIL_PERIOD));
    }

    #[test]
    fn the_cold_tail_carries_at_most_the_allowed_excess_of_the_changes() {
        let budget = 113.0 / 60.0;
        let demands = skewed();
        let targets = target_periods(&demands, Some(budget), limits(0.9));
        let total: f64 = demands.iter().map(|d| d.rate).sum();
        let tail_target = targets.tail_target.unwrap().as_secs_f64();
        let excess: f64 = demands
            .iter()
            .zip(&targets.tail)
            .filter(|(_, t)| **t)
            .map(|(d, _)| d.rate / total * (1.0 - tail_target / TAIL_PERIOD))
            .sum();
        assert!(excess <= TAIL_EXCESS + 1e-12, "excess {excess}");
        assert!(targets.tail.iter().filter(|t| **t).count() >= 80);
    }

    /// The latency below which `share` of the changes reach a poll, for
    /// changes waiting `U(0, period)` (bisection, independent of the rule).
    fn quantile(periods: &[f64], demands: &[Demand], share: f64) -> f64 {
        let total: f64 = demands.iter().map(|d| d.rate).sum();
        let within = |x: f64| -> f64 {
            periods
                .iter()
                .zip(demands)
                .map(|(t, d)| d.rate * (x / t).min(1.0))
                .sum::<f64>()
                / total
        };
        let (mut lo, mut hi) = (0.0, 1e4);
        for _ in 0..80 {
            let mid = (lo + hi) / 2.0;
            if within(mid) >= share {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        hi
    }

    fn secs_of(targets: &Targets) -> Vec<f64> {
        targets.periods.iter().map(Duration::as_secs_f64).collect()
    }

    /// The square-root law over the same streams, tail and tail target: the
    /// rule an earlier release spent the budget above the tail target by.
    fn square_root_law(demands: &[Demand], targets: &Targets, budget: f64) -> Vec<f64> {
        let target = targets.tail_target.unwrap().as_secs_f64();
        let periods_at = |theta: f64| -> Vec<f64> {
            demands
                .iter()
                .zip(&targets.tail)
                .map(|(d, tail)| {
                    if *tail {
                        TAIL_PERIOD
                    } else if d.rate <= 0.0 {
                        target
                    } else {
                        (theta / d.rate).sqrt().clamp(30.0, target)
                    }
                })
                .collect()
        };
        let (mut lo, mut hi) = (1e-12f64, 1e12f64);
        for _ in 0..100 {
            let mid = (lo * hi).sqrt();
            if periods_at(mid).iter().map(|t| 1.0 / t).sum::<f64>() > budget {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        periods_at(hi)
    }

    #[test]
    fn the_median_rule_polls_the_hottest_streams_at_one_period_and_catches_half_the_changes_within_it(
    ) {
        let budget = 113.0 / 60.0;
        let demands = skewed();
        let targets = target_periods(&demands, Some(budget), limits(0.95));
        let periods = secs_of(&targets);
        let tail_target = targets.tail_target.unwrap().as_secs_f64();
        let hot = periods.iter().copied().fold(f64::INFINITY, f64::min);
        assert!(hot > 30.0 && hot < tail_target / 2.0, "hot period {hot}");
        // Half the changes are polled within the hot period, not much more.
        let median = quantile(&periods, &demands, MEDIAN_SHARE);
        assert!((median - hot).abs() < 0.05, "median {median} vs {hot}");
        // Bang-bang: every stream is at the hot period, at its base (the
        // tail target or the tail's period) or is the one stream between; the hot ones
        // are the hottest.
        let between: Vec<usize> = (0..400)
            .filter(|&i| {
                let t = periods[i];
                (t - hot).abs() > 1e-6
                    && (t - tail_target).abs() > 1e-6
                    && (t - TAIL_PERIOD).abs() > 1e-6
            })
            .collect();
        assert!(between.len() <= 1, "{between:?}");
        let coldest_hot = (0..400)
            .filter(|&i| (periods[i] - hot).abs() < 1e-6)
            .map(|i| demands[i].rate)
            .fold(f64::INFINITY, f64::min);
        let hottest_rest = (0..400)
            .filter(|&i| (periods[i] - hot).abs() > 1e-6)
            .map(|i| demands[i].rate)
            .fold(0.0, f64::max);
        assert!(
            coldest_hot >= hottest_rest,
            "{coldest_hot} < {hottest_rest}"
        );
        assert!(spent(&targets) <= budget * SPEND_SHARE * 1.0001);
    }

    #[test]
    fn the_median_rule_gives_a_lower_median_than_the_square_root_law_on_the_same_budget_and_tail() {
        let budget = 113.0 / 60.0;
        let demands = skewed();
        let targets = target_periods(&demands, Some(budget), limits(0.95));
        let rule = secs_of(&targets);
        let law = square_root_law(&demands, &targets, budget * SPEND_SHARE);
        let spend = |p: &[f64]| p.iter().map(|t| 1.0 / t).sum::<f64>();
        assert!(
            spend(&rule) <= spend(&law) * 1.001,
            "{} vs {}",
            spend(&rule),
            spend(&law)
        );
        let (rule_p50, law_p50) = (
            quantile(&rule, &demands, 0.5),
            quantile(&law, &demands, 0.5),
        );
        assert!(
            rule_p50 < law_p50 * 0.95,
            "median {rule_p50} vs the law's {law_p50}"
        );
        // The tail is the tail target's either way.
        let (rule_p99, law_p99) = (
            quantile(&rule, &demands, 0.99),
            quantile(&law, &demands, 0.99),
        );
        assert!(
            rule_p99 <= targets.tail_target.unwrap().as_secs_f64(),
            "{rule_p99}"
        );
        assert!((rule_p99 - law_p99).abs() < 5.0, "{rule_p99} vs {law_p99}");
    }

    #[test]
    fn without_a_tail_share_the_square_root_law_reaches_the_tail_period_under_the_cap() {
        let budget = 113.0 / 60.0;
        let targets = target_periods(&skewed(), Some(budget), limits(0.0));
        assert_eq!(
            targets.tail_target,
            Some(Duration::from_secs_f64(TAIL_PERIOD))
        );
        // Period ratios follow sqrt(rate ratio) where neither bound binds.
        let demands = skewed();
        let (a, b) = (20, 40);
        let expected = (demands[a].rate / demands[b].rate).sqrt();
        let got = targets.periods[b].as_secs_f64() / targets.periods[a].as_secs_f64();
        assert!(
            (got - expected).abs() / expected < 0.01,
            "{got} vs {expected}"
        );
    }

    /// Requests a second the targets spend, poll costs included.
    fn spent_with_costs(targets: &Targets, demands: &[Demand]) -> f64 {
        targets
            .periods
            .iter()
            .zip(demands)
            .map(|(t, d)| d.cost / t.as_secs_f64())
            .sum()
    }

    #[test]
    fn the_cold_tail_flag_marks_exactly_the_streams_the_spread_leaves_above_the_tail_target() {
        let demands: Vec<Demand> = (0..100u64)
            .map(|i| demand(((i + 1) as f64).powf(-1.1), i))
            .collect();
        // 98% of what polls every stream at the floor.
        let budget = 0.98 * 100.0 / 30.0;
        let targets = target_periods(&demands, Some(budget), limits(0.95));
        let tail_target = targets.tail_target.unwrap();
        assert!(spent(&targets) <= budget * SPEND_SHARE * 1.0001);
        assert!(targets.periods[0] <= tail_target);
        for (i, (t, quiet)) in targets.periods.iter().zip(&targets.tail).enumerate() {
            assert!(*t >= Duration::from_secs(30) && *t <= Duration::from_secs(300));
            assert_eq!(*quiet, *t > tail_target, "stream {i} at {t:?}");
        }
        // One stream with most of the changes and a loose tail target: half
        // the changes are polled within the floor, and the budget left brings
        // the next hottest streams to the floor too.
        let demands: Vec<Demand> = (0..100u64)
            .map(|i| demand(if i == 0 { 1.0 } else { 0.01 }, i))
            .collect();
        let targets = target_periods(&demands, Some(0.5), limits(1.5));
        assert!(spent(&targets) <= 0.5 * SPEND_SHARE * 1.0001);
        let periods = secs_of(&targets);
        assert_eq!(periods[0], 30.0);
        assert!(quantile(&periods, &demands, MEDIAN_SHARE) <= 30.0 + 1e-6);
        let at_floor = periods.iter().filter(|t| **t <= 30.0 + 1e-9).count();
        assert!(at_floor > 3, "{at_floor} streams at the floor");
        for (t, quiet) in targets.periods.iter().zip(&targets.tail) {
            assert_eq!(*quiet, *t > targets.tail_target.unwrap());
        }
        // One hot stream and nine nearly idle ones in the cold tail: the
        // budget left brings cold streams down from the tail's period, seven to the
        // floor and one part of the way; only those still above the tail
        // target are flagged.
        let demands: Vec<Demand> = (0..10u64)
            .map(|i| demand(if i == 0 { 1.0 } else { 1e-4 }, i))
            .collect();
        let targets = target_periods(&demands, Some(0.3), limits(0.95));
        let tail_target = targets.tail_target.unwrap();
        let floor = Duration::from_secs(30);
        assert_eq!(targets.periods.iter().filter(|t| **t == floor).count(), 8);
        let between: Vec<&Duration> = targets
            .periods
            .iter()
            .filter(|t| **t > tail_target && t.as_secs_f64() < TAIL_PERIOD)
            .collect();
        assert_eq!(between.len(), 1, "{:?}", targets.periods);
        for (t, quiet) in targets.periods.iter().zip(&targets.tail) {
            assert_eq!(*quiet, *t > tail_target, "{t:?}");
        }
        assert_eq!(targets.tail.iter().filter(|q| **q).count(), 2);
    }

    #[test]
    fn the_median_rule_ranks_streams_by_rate_per_request_and_pays_each_polls_cost() {
        // Pairs of equal rate; the hottest pair's second stream costs three
        // requests a poll (a stream of three pages).
        let demands: Vec<Demand> = (0..200u64)
            .map(|i| Demand {
                rate: 0.5 * ((i / 2 + 1) as f64).powf(-1.1) / 4.0,
                cost: if i == 1 { 3.0 } else { 1.0 },
                tie: i,
            })
            .collect();
        let budget = 0.8;
        let targets = target_periods(&demands, Some(budget), limits(1.5));
        let spent = spent_with_costs(&targets, &demands);
        assert!(spent <= budget * SPEND_SHARE * 1.0001, "spent {spent}");
        assert!(spent >= budget * SPEND_SHARE * 0.99, "spent {spent}");
        let periods = secs_of(&targets);
        let hot = periods.iter().copied().fold(f64::INFINITY, f64::min);
        assert!(hot > 30.0, "hot period {hot}");
        let median = quantile(&periods, &demands, MEDIAN_SHARE);
        assert!((median - hot).abs() < 0.05, "median {median} vs {hot}");
        // Every stream at the hot period has at least the rate per request of
        // every stream above it (the dear twin, 0.042 a request, ranks after
        // the second pair's 0.058 and before the third's 0.038).
        let per_request = |i: usize| demands[i].rate / demands[i].cost;
        let at_hot: Vec<usize> = (0..200).filter(|&i| periods[i] - hot < 1e-6).collect();
        let above: Vec<usize> = (0..200).filter(|&i| periods[i] - hot >= 1e-6).collect();
        for &i in &at_hot {
            for &j in &above {
                assert!(
                    per_request(i) >= per_request(j),
                    "{i} at {hot}, {j} at {}",
                    periods[j]
                );
            }
        }
        assert!(
            at_hot.contains(&1) && at_hot.contains(&2) && at_hot.contains(&3),
            "{at_hot:?}"
        );
    }

    #[test]
    fn streams_without_a_usable_rate_stay_within_the_bounds_and_the_budget() {
        for rate in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let demands: Vec<Demand> = (0..50u64).map(|i| demand(rate, i)).collect();
            let targets = target_periods(&demands, Some(0.5), limits(0.95));
            assert!(spent(&targets) <= 0.5 * SPEND_SHARE * 1.0001, "rate {rate}");
            assert!(
                targets
                    .periods
                    .iter()
                    .all(|t| *t >= Duration::from_secs(30) && *t <= Duration::from_secs(300)),
                "rate {rate}: {:?}",
                targets.periods
            );
        }
        // One usable rate among unusable ones is the one polled fastest.
        let mut demands: Vec<Demand> = (0..50u64).map(|i| demand(f64::NAN, i)).collect();
        demands[7].rate = 0.01;
        let targets = target_periods(&demands, Some(0.5), limits(0.95));
        let fastest = targets.periods.iter().min().unwrap();
        assert_eq!(targets.periods[7], *fastest);
        assert!(targets.periods.iter().filter(|t| *t == fastest).count() == 1);
    }

    #[test]
    fn a_budget_too_small_for_the_tail_target_raises_it_to_what_fits() {
        let demands: Vec<Demand> = (0..100).map(|i| demand(0.01, i)).collect();
        // 100 equal streams, 0.4 requests a second: a 250 s round, no cold tail to speak of.
        let targets = target_periods(&demands, Some(0.4), limits(0.5));
        assert!(spent(&targets) <= 0.4 * SPEND_SHARE * 1.0001);
        let tail_target = targets.tail_target.unwrap().as_secs_f64();
        assert!(
            tail_target > 125.0 && tail_target <= 250.0 / SPEND_SHARE + 0.5,
            "{tail_target}"
        );
    }

    fn observed(tenant: TenantId, resource: Resource, changes: f64, seconds: f64) -> Observed {
        Observed {
            tenant,
            resource,
            changes,
            seconds,
        }
    }

    #[test]
    fn rates_are_pooled_per_tenant_and_split_by_the_resources_share() {
        let mut population = Population::default();
        let mut streams = Vec::new();
        for tenant in 1..=50u64 {
            let n = if tenant <= 10 { 40.0 } else { 4.0 };
            streams.push(observed(tenant, Resource::Vouchers, n * 0.8, 1000.0));
            streams.push(observed(tenant, Resource::Categories, n * 0.2, 1000.0));
        }
        let rates = estimate_rates(&streams, &mut population);
        // Hot tenants: about 40 changes in 1000 s, 80% on vouchers.
        let hot = rates[0] + rates[1];
        assert!((hot - 0.04).abs() < 0.006, "hot tenant {hot}");
        assert!((rates[0] / hot - 0.8).abs() < 0.02);
        let cold = rates[40] + rates[41];
        assert!((cold - 0.004).abs() < 0.0015, "cold tenant {cold}");
    }

    #[test]
    fn a_silent_tenant_among_busy_ones_is_not_taken_for_dead_and_one_change_is_not_taken_for_hot() {
        let mut population = Population::default();
        let mut streams = Vec::new();
        // 99 tenants at about 6 changes in 600 s; tenant 100 silent; tenant 101 one change.
        for tenant in 1..=99u64 {
            streams.push(observed(
                tenant,
                Resource::Vouchers,
                5.0 + (tenant % 3) as f64,
                600.0,
            ));
        }
        streams.push(observed(100, Resource::Vouchers, 0.0, 600.0));
        streams.push(observed(101, Resource::Vouchers, 1.0, 600.0));
        let rates = estimate_rates(&streams, &mut population);
        let busy = 6.0 / 600.0;
        assert!(rates[99] > busy * 0.3, "silent tenant {}", rates[99]);
        assert!(
            rates[100] > busy * 0.3 && rates[100] < busy,
            "one change {}",
            rates[100]
        );
        // Where silence is the norm, a silent tenant is estimated near zero.
        let mut quiet_population = Population::default();
        let quiet: Vec<Observed> = (1..=100u64)
            .map(|t| {
                observed(
                    t,
                    Resource::Vouchers,
                    if t == 1 { 30.0 } else { 0.0 },
                    3600.0,
                )
            })
            .collect();
        let rates = estimate_rates(&quiet, &mut quiet_population);
        assert!(
            rates[5] < 1.0 / 36_000.0,
            "silent among silent {}",
            rates[5]
        );
        assert!(rates[0] > 25.0 / 3600.0, "the one busy tenant {}", rates[0]);
    }
}
