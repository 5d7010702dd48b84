//! One planner per upstream token: it decides which stream polls next, so the
//! token's shared request budget goes where it lowers change-to-event latency
//! most (`poll.strategy = "adaptive"`, docs/planner.md).
//!
//! Every stream task asks the planner for its turn ([`Planner::turn`]) once
//! its floor (`poll.interval`, or a failure or park backoff) has passed, and
//! reports what its sweep found ([`Planner::finished`]). The planner grants
//! turns in *lanes*: a few poll lanes (incremental polls, first syncs and
//! replays) and one bulk lane (periodic full sweeps, whose pages the budget
//! limits to `poll.full_sweep_share` while polls wait). Within the poll lanes
//! the order is:
//!
//! 1. streams not polled for `poll.max_interval` (the staleness cap), most
//!    overdue first;
//! 2. first syncs and replays (their whole catalog is missing downstream), so
//!    a first sync of many streams finishes close to its floor;
//! 3. every other ready stream by its deadline, its last poll plus its
//!    target period, earliest first (work-conserving: a budget the targets
//!    leave unspent polls the next streams a little early).
//!
//! The target periods ([`targets`]) hold every stream to a tail target
//! (`poll.tail_guard` x the round a uniform schedule would take), the coldest
//! streams, whose changes are too few to move the p99, only to just under
//! the cap (so deadlines, not the cap's priority, order them); the
//! budget left polls the hottest streams at one hot period, the least that
//! catches half the changes within it (the median rule). Rates are learnt
//! from the changes the upstream announced since each stream's previous
//! listing, with a long memory, pooled per tenant and
//! shrunk toward the token's population of tenants (empirical Bayes); a
//! stream that turns hot is followed within a few polls. When the budget
//! covers every stream every `poll.interval`, every target is the floor:
//! the schedule is the uniform one.
//!
//! The core ([`PlannerCore`]) is pure and driven with explicit instants; the
//! async [`Planner`] around it wakes waiting streams.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex as StdMutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::stream::{Resource, StreamKey};

pub mod history;
pub mod targets;

use crate::telemetry::metric;
use crate::upstream::ratelimit::{BudgetState, RateBudget};
use history::Evidence;
use targets::{estimate_rates, target_periods, Demand, Limits, Observed, Population};

/// Rank of a stream past the staleness cap (first).
const TIER_OVERDUE: u8 = 3;
/// Rank of a first sync or replay (second).
const TIER_SNAPSHOT: u8 = 2;
/// Rank of a stream past its target period (third); earliest deadline first.
const TIER_DUE: u8 = 1;

/// Half-life of the long-memory rates the schedule is planned from: long
/// enough to tell a tenant that changes once an hour from one that never
/// does, short enough to follow a catalog's day.
const LONG_HALF_LIFE: Duration = Duration::from_secs(3600);

/// How often the schedule is planned again (rates, budget, streams).
const REPLAN_EVERY: Duration = Duration::from_secs(5);

/// A stream whose recent polls found at least this many changes, at more
/// than [`SURGE_FACTOR`] times its planned rate, has turned hot: it is
/// planned at its recent rate at once, before its long memory catches up.
const SURGE_CHANGES: f64 = 3.0;
/// See [`SURGE_CHANGES`].
const SURGE_FACTOR: f64 = 3.0;

/// Poll lanes of a limited budget: enough to keep the budget busy while one
/// poll waits for the network, few enough that the planner's order decides.
pub const POLL_LANES: usize = 3;

/// How much of a stream's short-memory rate survives each new observation:
/// a memory of about two or three polls.
const RATE_MEMORY: f64 = 0.5;

/// Weight of the neutral prior (one change per `max_interval`), as a
/// fraction of `poll.interval` of observation: real observations soon outweigh it.
const PRIOR_WEIGHT: f64 = 0.5;

/// How a token's streams share its budget (`poll.strategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// The budget-aware planner.
    #[default]
    Adaptive,
    /// Every stream on its own timer, every `poll.interval`; requests served first come, first served.
    Uniform,
}

impl Strategy {
    /// The name in config, status and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::Adaptive => "adaptive",
            Strategy::Uniform => "uniform",
        }
    }
}

/// What the planner needs from `[poll]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlannerSettings {
    /// `poll.interval`: the floor (the runner waits it before asking again).
    pub interval: Duration,
    /// `poll.max_interval`: the staleness cap.
    pub max_interval: Duration,
    /// Poll lanes; `usize::MAX` for an unlimited budget.
    pub poll_lanes: usize,
    /// `poll.full_resync_interval`, to tell when full sweeps fall behind.
    pub full_resync_interval: Duration,
    /// `poll.tail_guard`: the tail guard as a share of a uniform round (0: none).
    pub tail_guard: f64,
}

/// What a ready stream asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// A first sync or a replay: a snapshot listing.
    Snapshot,
    /// An incremental poll; `full_due` when its periodic full sweep is due too.
    Poll {
        /// The stream's full sweep is due (`poll.full_resync_interval`).
        full_due: bool,
    },
}

/// What the planner granted a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grant {
    /// Sweep now in a poll lane (incremental, or the snapshot sweep it needs).
    Poll,
    /// Run the periodic full sweep now, in the bulk lane.
    Full,
}

/// How a granted sweep ended, as the planner learns from it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SweepFacts {
    /// When the sweep started.
    pub started: Instant,
    /// The sweep completed (its listing is current as of `started`).
    pub completed: bool,
    /// Changes the upstream announced since the previous listing and the
    /// sweep published (creates and updates newer than the old watermark;
    /// not the lookback overlap, nor silent changes it caught).
    pub changed: u64,
    /// Upstream requests the sweep spent.
    pub requests: u64,
    /// What a first sync's `updated_at` values show of the stream's changes
    /// before it ([`history`]); None for every other sweep.
    pub history: Option<Evidence>,
}

/// The recent change rate of one stream (a memory of a few polls), with a
/// neutral prior: what tells that a stream has turned hot.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateEstimate {
    changes: f64,
    seconds: f64,
}

impl RateEstimate {
    fn new() -> Self {
        Self {
            changes: 0.0,
            seconds: 0.0,
        }
    }

    /// Adds `changes` seen over `window`; older observations fade.
    pub fn observe(&mut self, changes: u64, window: Duration) {
        self.changes = self.changes * RATE_MEMORY + changes as f64;
        self.seconds = self.seconds * RATE_MEMORY + window.as_secs_f64();
    }

    /// Changes per second, the neutral prior (one change per `max_interval`) blended in.
    pub fn per_second(&self, settings: &PlannerSettings) -> f64 {
        let prior_seconds = settings.interval.as_secs_f64().max(1.0) * PRIOR_WEIGHT;
        let prior_changes = prior_seconds / settings.max_interval.as_secs_f64().max(1.0);
        (self.changes + prior_changes) / (self.seconds + prior_seconds)
    }
}

/// A stream's change rate with a long memory (halved every
/// [`LONG_HALF_LIFE`]), what the schedule is planned from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LongRate {
    changes: f64,
    seconds: f64,
    at: Option<Instant>,
}

impl LongRate {
    fn new() -> Self {
        Self {
            changes: 0.0,
            seconds: 0.0,
            at: None,
        }
    }

    /// Adds `changes` seen over `seconds` of the stream, at `now`.
    fn observe(&mut self, changes: f64, seconds: f64, now: Instant) {
        let (decayed_changes, decayed_seconds) = self.decayed(now);
        self.changes = decayed_changes + changes;
        self.seconds = decayed_seconds + seconds;
        self.at = Some(now);
    }

    /// (changes, seconds) decayed to `now`.
    fn decayed(&self, now: Instant) -> (f64, f64) {
        let Some(at) = self.at else {
            return (0.0, 0.0);
        };
        let elapsed = now.saturating_duration_since(at).as_secs_f64();
        let decay = 0.5f64.powf(elapsed / LONG_HALF_LIFE.as_secs_f64());
        (self.changes * decay, self.seconds * decay)
    }
}

/// What the planner knows of one stream (see [`PlannerCore::streams`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StreamPlan {
    /// The stream is waiting for its turn (since when it may go).
    pub ready_at: Option<Instant>,
    /// What it asks for.
    pub need: Option<Need>,
    /// The turn it holds, while its sweep runs.
    pub running: Option<Grant>,
    /// Start of the last completed sweep (the listing is current as of then).
    pub last_poll: Option<Instant>,
    /// Learnt change rate.
    pub rate: RateEstimate,
    /// Requests one incremental poll costs (learnt, at least 1).
    pub cost: f64,
    /// Smoothed time between two polls.
    pub period: Option<Duration>,
    /// Start of the last periodic full sweep it completed under this planner.
    pub last_full: Option<Instant>,
    /// Its change rate with a long memory, what the schedule is planned from.
    pub long: LongRate,
    /// The rate it was last planned with (changes a second).
    pub planned_rate: f64,
    /// Its target poll period, as last planned.
    pub target: Option<Duration>,
    /// It is in the cold tail, held only to the staleness cap.
    pub tail: bool,
}

impl StreamPlan {
    fn new() -> Self {
        Self {
            ready_at: None,
            need: None,
            running: None,
            last_poll: None,
            rate: RateEstimate::new(),
            cost: 1.0,
            period: None,
            last_full: None,
            long: LongRate::new(),
            planned_rate: 0.0,
            target: None,
            tail: false,
        }
    }
}

/// The pure planner: which ready stream gets the next turn.
#[derive(Debug, Clone)]
pub struct PlannerCore {
    settings: PlannerSettings,
    streams: BTreeMap<StreamKey, StreamPlan>,
    /// Grants made but not yet picked up by their stream, by stream.
    granted: BTreeMap<StreamKey, Grant>,
    /// Requests a second the budget paces (learnt); None when unlimited.
    paced_per_second: Option<f64>,
    /// The law of the token's tenant rates, refitted at every plan.
    population: Population,
    /// The bound every stream but the cold tail is held to, as last planned.
    tail_target: Option<Duration>,
    /// When the schedule was last planned.
    planned_at: Option<Instant>,
}

impl PlannerCore {
    /// A planner with no stream yet.
    pub fn new(settings: PlannerSettings) -> Self {
        Self {
            settings,
            streams: BTreeMap::new(),
            granted: BTreeMap::new(),
            paced_per_second: None,
            population: Population::default(),
            tail_target: None,
            planned_at: None,
        }
    }

    /// The budget now paces `per_second` requests a second (None: unlimited).
    pub fn set_paced_rate(&mut self, per_second: Option<f64>) {
        let per_second = per_second.filter(|r| r.is_finite() && *r > 0.0);
        if per_second != self.paced_per_second {
            self.paced_per_second = per_second;
            self.planned_at = None;
        }
    }

    /// Plans every stream's target period again (docs/planner.md, "The
    /// rule"): rates from the long-memory counts pooled per tenant under the
    /// population's law, a recent surge taken at once; then the periods that
    /// spend the budget with the tail held to `poll.tail_guard` x a uniform round.
    pub fn plan(&mut self, now: Instant) {
        let keys: Vec<StreamKey> = self.streams.keys().copied().collect();
        let observed: Vec<Observed> = keys
            .iter()
            .map(|k| {
                let (changes, seconds) = self.streams[k].long.decayed(now);
                Observed {
                    tenant: k.tenant,
                    resource: k.resource,
                    changes,
                    seconds,
                }
            })
            .collect();
        let pooled = estimate_rates(&observed, &mut self.population);
        let demands: Vec<Demand> = keys
            .iter()
            .zip(&pooled)
            .map(|(k, pooled)| {
                let plan = &self.streams[k];
                let recent = plan.rate.per_second(&self.settings);
                let surging = plan.rate.changes >= SURGE_CHANGES && recent > SURGE_FACTOR * pooled;
                Demand {
                    rate: if surging { recent } else { *pooled },
                    cost: plan.cost,
                    tie: tie_break(*k),
                }
            })
            .collect();
        let targets = target_periods(
            &demands,
            self.paced_per_second,
            Limits {
                floor: self.settings.interval,
                cap: self.settings.max_interval,
                tail_share: self.settings.tail_guard,
            },
        );
        for (i, k) in keys.iter().enumerate() {
            if let Some(plan) = self.streams.get_mut(k) {
                plan.planned_rate = demands[i].rate;
                plan.target = Some(targets.periods[i]);
                plan.tail = targets.tail[i];
            }
        }
        self.tail_target = targets.tail_target;
        self.planned_at = Some(now);
    }

    /// Plans again when the last plan is older than [`REPLAN_EVERY`] (or there is none).
    fn plan_if_stale(&mut self, now: Instant) {
        let stale = self
            .planned_at
            .is_none_or(|at| now.saturating_duration_since(at) >= REPLAN_EVERY);
        if stale {
            self.plan(now);
        }
    }

    /// The bound every stream but the cold tail is held to (`poll.tail_guard`
    /// x the round a uniform schedule would take, or what the budget allows),
    /// as last planned; None when the budget covers every stream at the floor.
    pub fn tail_target(&self) -> Option<Duration> {
        self.tail_target
    }

    /// The stream is in the cold tail: among the coldest streams, whose
    /// changes together are few enough to be held only to the staleness cap.
    pub fn is_quiet(&self, key: StreamKey) -> bool {
        self.streams.get(&key).is_some_and(|p| p.tail)
    }

    /// The period `key` is planned to be polled at: its target (the floor
    /// before the first plan), never above the staleness cap.
    pub fn poll_bound(&self, key: StreamKey) -> Duration {
        self.bound_of(self.streams.get(&key))
    }

    /// The target of a stream's plan (the floor before the first plan), at most the cap.
    fn bound_of(&self, plan: Option<&StreamPlan>) -> Duration {
        plan.and_then(|p| p.target)
            .unwrap_or(self.settings.interval)
            .min(self.settings.max_interval)
    }

    /// The change rate `key` is planned with (changes a second).
    pub fn planned_rate(&self, key: StreamKey) -> f64 {
        self.streams.get(&key).map_or(0.0, |p| p.planned_rate)
    }

    /// The settings it plans with.
    pub fn settings(&self) -> PlannerSettings {
        self.settings
    }

    /// Every stream it knows, in key order.
    pub fn streams(&self) -> impl Iterator<Item = (StreamKey, &StreamPlan)> {
        self.streams.iter().map(|(k, p)| (*k, p))
    }

    /// The plan of one stream.
    pub fn stream(&self, key: StreamKey) -> Option<&StreamPlan> {
        self.streams.get(&key)
    }

    /// `key` is ready from `ready_at` on and asks for `need`.
    pub fn ask(&mut self, key: StreamKey, need: Need, ready_at: Instant) {
        if !self.streams.contains_key(&key) {
            // A stream the plan does not know yet: plan again at the next grant.
            self.planned_at = None;
        }
        let plan = self.streams.entry(key).or_insert_with(StreamPlan::new);
        plan.ready_at = Some(ready_at);
        plan.need = Some(need);
    }

    /// `key` no longer waits (its task stopped waiting); a grant it did not take is returned.
    pub fn withdraw(&mut self, key: StreamKey) {
        if let Some(plan) = self.streams.get_mut(&key) {
            plan.ready_at = None;
            plan.need = None;
            if self.granted.remove(&key).is_some() {
                plan.running = None;
            }
        }
    }

    /// Takes the grant made to `key`, if any: its sweep starts now.
    pub fn take_grant(&mut self, key: StreamKey) -> Option<Grant> {
        self.granted.remove(&key)
    }

    /// The sweep of `key` ended.
    pub fn finished(&mut self, key: StreamKey, grant: Grant, facts: SweepFacts) {
        let Some(plan) = self.streams.get_mut(&key) else {
            return;
        };
        plan.running = None;
        if !facts.completed {
            return;
        }
        if let Some(previous) = plan.last_poll {
            let window = facts.started.saturating_duration_since(previous);
            // A snapshot (first sync, replay) emits everything: it says nothing of the rate.
            if plan.need != Some(Need::Snapshot) {
                plan.rate.observe(facts.changed, window);
                plan.long
                    .observe(facts.changed as f64, window.as_secs_f64(), facts.started);
            }
            plan.period = Some(match plan.period {
                Some(p) => p.mul_f64(0.7) + window.mul_f64(0.3),
                None => window,
            });
        }
        // A first sync's listing: the `updated_at` values of its records are
        // the stream's change history before the bridge started.
        if let Some(history) = facts.history {
            plan.long
                .observe(history.changes, history.seconds, facts.started);
        }
        if grant == Grant::Full {
            plan.last_full = Some(facts.started);
        }
        if grant == Grant::Poll && plan.need != Some(Need::Snapshot) {
            let requests = facts.requests.max(1) as f64;
            plan.cost = plan.cost * 0.7 + requests * 0.3;
        }
        plan.last_poll = Some(facts.started);
    }

    fn running(&self, grant: Grant) -> usize {
        self.streams
            .values()
            .filter(|p| p.running == Some(grant))
            .count()
    }

    /// The poll-lane rank of a ready stream: a higher tier first, then a
    /// higher score. Past the cap, the most overdue first; then snapshots;
    /// then every other stream by its deadline (last poll + target period),
    /// earliest first, whether or not it has passed (the lanes are
    /// work-conserving: a budget the targets leave unspent polls the
    /// streams next due a little early).
    fn rank(&self, plan: &StreamPlan, now: Instant) -> (u8, f64) {
        let cap = self.settings.max_interval;
        match (plan.need, plan.last_poll) {
            (Some(Need::Snapshot), _) | (_, None) => (TIER_SNAPSHOT, 0.0),
            (_, Some(last)) => {
                let age = now.saturating_duration_since(last);
                if age >= cap {
                    return (TIER_OVERDUE, age.as_secs_f64());
                }
                let target = self.bound_of(Some(plan));
                let late = age.as_secs_f64() - target.as_secs_f64();
                (if late >= 0.0 { TIER_DUE } else { 0 }, late)
            }
        }
    }

    /// Grants every turn the lanes allow at `now`; returns the streams granted.
    ///
    /// `budget_idle`: no request waits for the token's budget, so the lanes,
    /// not the budget, would limit polling; one more poll lane opens (again
    /// at every grant while it stays idle), so an ample budget polls every
    /// ready stream as the uniform strategy would.
    pub fn grant(&mut self, now: Instant, budget_idle: bool) -> Vec<(StreamKey, Grant)> {
        let mut granted = Vec::new();
        let ready = |p: &StreamPlan| p.running.is_none() && p.ready_at.is_some_and(|at| at <= now);
        // The bulk lane: the stream whose full sweep (under this planner) is oldest.
        if self.running(Grant::Full) == 0 {
            let oldest = self
                .streams
                .iter()
                .filter(|(_, p)| ready(p) && p.need == Some(Need::Poll { full_due: true }))
                .min_by_key(|(k, p)| (p.last_full, p.last_poll, **k))
                .map(|(k, _)| *k);
            if let Some(key) = oldest {
                granted.push((key, Grant::Full));
                self.start(key, Grant::Full);
            }
        }
        // The poll lanes, best rank first.
        let running = self.running(Grant::Poll);
        let lanes = if budget_idle {
            self.settings.poll_lanes.max(running.saturating_add(1))
        } else {
            self.settings.poll_lanes
        };
        if !self.streams.values().any(ready) {
            return granted;
        }
        self.plan_if_stale(now);
        let mut candidates: Vec<(StreamKey, (u8, f64), Option<Instant>)> = self
            .streams
            .iter()
            .filter(|(_, p)| ready(p))
            .map(|(k, p)| (*k, self.rank(p, now), p.last_poll))
            .collect();
        candidates.sort_by(|a, b| {
            b.1 .0
                .cmp(&a.1 .0)
                .then(b.1 .1.total_cmp(&a.1 .1))
                .then(a.2.cmp(&b.2))
                .then(a.0.cmp(&b.0))
        });
        let mut in_lanes = running;
        for (key, (tier, _), _) in candidates {
            // Streams past the staleness cap get as many lanes again beyond
            // the limit: long first syncs or replays holding every lane then
            // keep at most half the budget from them, and the cap holds.
            let limit = if tier == TIER_OVERDUE {
                lanes.saturating_mul(2)
            } else {
                lanes
            };
            if in_lanes >= limit {
                continue;
            }
            granted.push((key, Grant::Poll));
            self.start(key, Grant::Poll);
            in_lanes += 1;
        }
        granted
    }

    fn start(&mut self, key: StreamKey, grant: Grant) {
        if let Some(plan) = self.streams.get_mut(&key) {
            plan.running = Some(grant);
            plan.ready_at = None;
            self.granted.insert(key, grant);
        }
    }

    /// When `key`, waiting and not granted, should ask the planner again
    /// by itself: when its floor passes, or when it passes the staleness cap
    /// (overdue streams may use more lanes). Between those, only a grant (a
    /// finished sweep, a withdrawn ask) can change its turn.
    pub fn wake_at(&self, key: StreamKey, now: Instant) -> Option<Instant> {
        let plan = self.streams.get(&key)?;
        if plan.running.is_some() {
            return None;
        }
        let ready = plan.ready_at.filter(|at| *at > now);
        let overdue = plan
            .last_poll
            .map(|last| last + self.settings.max_interval)
            .filter(|at| *at > now);
        ready.or(overdue)
    }
}

/// A stable hash of a stream key, to break ties between streams of equal
/// rate without favouring low tenant ids.
fn tie_break(key: StreamKey) -> u64 {
    let resource = match key.resource {
        Resource::Vouchers => 0u64,
        Resource::Categories => 1,
    };
    // SplitMix64's finaliser.
    let mut z = key.tenant.wrapping_mul(2).wrapping_add(resource);
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The async planner shared by the streams of one token.
#[derive(Debug, Clone)]
pub struct Planner {
    core: Arc<StdMutex<PlannerCore>>,
    /// One waker per stream: a grant wakes only the stream it went to.
    wakers: Arc<StdMutex<BTreeMap<StreamKey, Arc<Notify>>>>,
    /// The token's budget the planner spends.
    budget: Arc<RateBudget>,
    /// The token's fingerprint, for metrics.
    token_id: String,
}

/// Withdraws a stream's ask if its `turn` future is dropped before it got its turn.
struct AskGuard<'a> {
    planner: &'a Planner,
    key: StreamKey,
    armed: bool,
}

impl Drop for AskGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            let mut core = self.planner.lock();
            core.withdraw(self.key);
            self.planner.grant_and_wake(&mut core);
        }
    }
}

impl Planner {
    /// The planner of the token whose budget is `budget` (`token_id` its fingerprint).
    pub fn new(settings: PlannerSettings, budget: Arc<RateBudget>, token_id: String) -> Self {
        Self {
            core: Arc::new(StdMutex::new(PlannerCore::new(settings))),
            wakers: Arc::default(),
            budget,
            token_id,
        }
    }

    /// The settings it plans with.
    pub fn settings(&self) -> PlannerSettings {
        self.lock().settings()
    }

    /// Sets the stream's and the token's gauges.
    fn record_gauges(&self, key: StreamKey) {
        let (plan, rate, bound) = {
            let core = self.lock();
            (
                core.stream(key).copied(),
                core.planned_rate(key),
                core.poll_bound(key),
            )
        };
        if let Some(plan) = plan {
            let labels = [
                ("tenant", key.tenant.to_string()),
                ("resource", key.resource.as_str().to_string()),
            ];
            metrics::gauge!(metric::STREAM_CHANGE_RATE, &labels).set(rate);
            metrics::gauge!(metric::STREAM_POLL_BOUND, &labels).set(bound.as_secs_f64());
            if let Some(period) = plan.period {
                metrics::gauge!(metric::STREAM_POLL_PERIOD, &labels).set(period.as_secs_f64());
            }
            if let Some(last) = plan.last_poll {
                let ago = Instant::now().saturating_duration_since(last);
                let at = std::time::SystemTime::now()
                    .checked_sub(ago)
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map_or(0.0, |d| d.as_secs_f64());
                metrics::gauge!(metric::STREAM_LAST_POLL, &labels).set(at);
            }
        }
        record_budget_gauges(&self.budget, &self.token_id);
    }

    fn lock(&self) -> MutexGuard<'_, PlannerCore> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A copy of the core, for status and metrics.
    pub fn snapshot(&self) -> PlannerCore {
        self.lock().clone()
    }

    /// Waits for `key`'s turn: ready from `ready_at`, asking for `need`.
    ///
    /// Cancel-safe: dropping the future withdraws the ask (and gives back a
    /// turn granted but not taken).
    pub async fn turn(&self, key: StreamKey, need: Need, ready_at: Instant) -> Grant {
        let waker = self.waker(key);
        self.lock().ask(key, need, ready_at);
        let mut guard = AskGuard {
            planner: self,
            key,
            armed: true,
        };
        loop {
            let wake_at = {
                let mut core = self.lock();
                // Granting here also opens the next lane of an idle budget
                // for the next ready stream, which this wakes in turn.
                self.grant_and_wake(&mut core);
                if let Some(grant) = core.take_grant(key) {
                    guard.armed = false;
                    return grant;
                }
                core.wake_at(key, Instant::now())
            };
            // A grant made by another task leaves a permit: none is lost
            // between releasing the lock and waiting.
            match wake_at {
                Some(at) => {
                    tokio::select! {
                        _ = waker.notified() => {}
                        _ = tokio::time::sleep_until(at) => {}
                    }
                }
                None => waker.notified().await,
            }
        }
    }

    /// `key`'s sweep (granted as `grant`) ended with `facts`; frees its lane
    /// and grants it to whoever goes next.
    pub fn finished(&self, key: StreamKey, grant: Grant, facts: SweepFacts) {
        {
            let mut core = self.lock();
            core.finished(key, grant, facts);
            self.grant_and_wake(&mut core);
        }
        self.record_gauges(key);
    }

    /// The waker of `key`'s task.
    fn waker(&self, key: StreamKey) -> Arc<Notify> {
        let mut wakers = self.wakers.lock().unwrap_or_else(|p| p.into_inner());
        wakers.entry(key).or_default().clone()
    }

    /// Grants every turn the lanes allow now and wakes the streams granted.
    fn grant_and_wake(&self, core: &mut PlannerCore) {
        let state = self.budget.observable_state();
        core.set_paced_rate(paced_per_second(&self.budget, &state));
        let budget_idle = state.waiting_poll == 0;
        let granted = core.grant(Instant::now(), budget_idle);
        if granted.is_empty() {
            return;
        }
        let wakers = self.wakers.lock().unwrap_or_else(|p| p.into_inner());
        for (key, _) in granted {
            if let Some(waker) = wakers.get(&key) {
                waker.notify_one();
            }
        }
    }
}

/// Requests a second `budget` delivers (None when unlimited), from its `state`: its paced
/// rate, or what the last complete window really granted when that was less
/// (a loaded upstream or the lanes' round trips keep it below the pace; a
/// round computed from the pace would promise a guard no schedule can keep).
fn paced_per_second(budget: &RateBudget, state: &BudgetState) -> Option<f64> {
    let window = budget.window().as_secs_f64().max(1e-9);
    let paced = match budget.paced_per_window() {
        0 => return None,
        n => f64::from(n) / window,
    };
    let used = f64::from(state.used_last_window) / window;
    Some(if used > 0.0 { paced.min(used) } else { paced })
}

/// What the planner knows of one stream, as `status` shows it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StreamPlanStatus {
    /// Learnt change rate, changes per minute.
    pub change_rate_per_minute: f64,
    /// Smoothed time between two polls, in seconds.
    pub poll_period_seconds: Option<f64>,
    /// Seconds since the last poll started.
    pub seconds_since_last_poll: Option<f64>,
    /// `waiting` (ready, waiting for a lane), `resting` (before its floor), `polling` or `full_sweep`.
    pub turn: String,
    /// Seconds until its floor has passed, while resting.
    pub next_poll_in_seconds: Option<f64>,
    /// Its target poll period as last planned (at most `poll.max_interval`).
    pub poll_bound_seconds: f64,
    /// It is in the cold tail: held only to `poll.max_interval`.
    pub quiet: bool,
}

/// A token's budget and planner, as `status` shows them.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BudgetStatus {
    /// The token's fingerprint.
    pub token_id: String,
    /// Requests per minute configured.
    pub configured_per_minute: f64,
    /// Requests per minute learnt from 429s (what the budget paces at).
    pub learnt_per_minute: f64,
    /// Requests granted in the last complete window.
    pub used_last_window: u32,
    /// Poll requests waiting for the budget.
    pub waiting_poll: usize,
    /// Full-sweep requests waiting for the budget.
    pub waiting_bulk: usize,
    /// Share of recent grants spent on full sweeps.
    pub full_sweep_share: f64,
    /// `poll.full_sweep_share`.
    pub full_sweep_share_limit: f64,
}

impl BudgetStatus {
    /// The status of the budget of the token `token_id`.
    pub fn of(token_id: &str, budget: &RateBudget) -> Self {
        let state = budget.observable_state();
        let per_minute =
            |requests: u32| f64::from(requests) * 60.0 / state.window_seconds.max(1e-9);
        Self {
            token_id: token_id.to_string(),
            configured_per_minute: per_minute(state.configured),
            learnt_per_minute: per_minute(state.learnt),
            used_last_window: state.used_last_window,
            waiting_poll: state.waiting_poll,
            waiting_bulk: state.waiting_bulk,
            full_sweep_share: state.bulk_share,
            full_sweep_share_limit: state.bulk_share_limit,
        }
    }
}

impl Planner {
    /// The plan of `key` as status shows it, None when the planner does not know it yet.
    pub fn stream_status(&self, key: StreamKey) -> Option<StreamPlanStatus> {
        let now = Instant::now();
        let mut core = self.lock();
        // What it learnt since the last grant shows within `REPLAN_EVERY`,
        // even while every stream rests.
        core.plan_if_stale(now);
        let plan = core.stream(key)?;
        let (turn, next) = match (plan.running, plan.ready_at) {
            (Some(Grant::Full), _) => ("full_sweep", None),
            (Some(Grant::Poll), _) => ("polling", None),
            (None, Some(at)) if at > now => ("resting", Some(at.duration_since(now))),
            (None, Some(_)) => ("waiting", None),
            (None, None) => ("resting", None),
        };
        Some(StreamPlanStatus {
            change_rate_per_minute: core.planned_rate(key) * 60.0,
            poll_period_seconds: plan.period.map(|p| p.as_secs_f64()),
            seconds_since_last_poll: plan
                .last_poll
                .map(|at| now.saturating_duration_since(at).as_secs_f64()),
            turn: turn.to_string(),
            next_poll_in_seconds: next.map(|d| d.as_secs_f64()),
            poll_bound_seconds: core.poll_bound(key).as_secs_f64(),
            quiet: core.is_quiet(key),
        })
    }

    /// The streams it plans, in key order.
    pub fn streams(&self) -> Vec<StreamKey> {
        self.lock().streams().map(|(k, _)| k).collect()
    }
}

/// Sets a token budget's gauges (`token_id` its fingerprint).
pub fn record_budget_gauges(budget: &RateBudget, token_id: &str) {
    let status = BudgetStatus::of(token_id, budget);
    let token = status.token_id;
    metrics::gauge!(metric::BUDGET_REQUESTS_PER_MINUTE, "token_id" => token.clone(), "kind" => "configured")
        .set(status.configured_per_minute);
    metrics::gauge!(metric::BUDGET_REQUESTS_PER_MINUTE, "token_id" => token.clone(), "kind" => "learnt")
        .set(status.learnt_per_minute);
    metrics::gauge!(metric::BUDGET_USED, "token_id" => token.clone())
        .set(f64::from(status.used_last_window));
    metrics::gauge!(metric::BUDGET_WAITING, "token_id" => token.clone(), "lane" => "poll")
        .set(status.waiting_poll as f64);
    metrics::gauge!(metric::BUDGET_WAITING, "token_id" => token.clone(), "lane" => "bulk")
        .set(status.waiting_bulk as f64);
    metrics::gauge!(metric::BUDGET_FULL_SWEEP_SHARE, "token_id" => token)
        .set(status.full_sweep_share);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::TenantId;

    /// The default tail target share (`poll.tail_guard`).
    const TAIL_SHARE: f64 = crate::config::DEFAULT_TAIL_GUARD;
    /// Requests a second a budget of 60 a minute really grants (the reserve
    /// taken), as the tests' schedules are planned with.
    const PACED_60: f64 = 57.0 / 60.0;

    fn key(tenant: u64) -> StreamKey {
        StreamKey::new(tenant, Resource::Vouchers)
    }

    fn settings(lanes: usize) -> PlannerSettings {
        PlannerSettings {
            interval: Duration::from_secs(30),
            max_interval: Duration::from_secs(300),
            poll_lanes: lanes,
            full_resync_interval: Duration::from_secs(3600),
            tail_guard: TAIL_SHARE,
        }
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    /// Polls every stream once so each has a last poll at `at`.
    fn warm(core: &mut PlannerCore, keys: &[StreamKey], at: Instant) {
        poll_round(core, keys, at, |_| 0);
    }

    fn facts(started: Instant, changed: u64) -> SweepFacts {
        SweepFacts {
            started,
            completed: true,
            changed,
            requests: 1,
            history: None,
        }
    }

    #[test]
    fn the_rate_estimate_starts_neutral_and_follows_a_stream_that_turns_hot_within_a_few_polls() {
        let settings = settings(1);
        let mut rate = RateEstimate::new();
        let neutral = rate.per_second(&settings);
        assert!((neutral - 1.0 / 300.0).abs() < 1e-9, "{neutral}");
        for _ in 0..3 {
            rate.observe(30, secs(30));
        }
        let hot = rate.per_second(&settings);
        assert!(hot > 0.7 && hot <= 1.0, "1 change/s learnt as {hot}");
        for _ in 0..4 {
            rate.observe(0, secs(30));
        }
        let quiet = rate.per_second(&settings);
        assert!(quiet < 0.1, "quiet again after 4 polls: {quiet}");
    }

    #[test]
    fn a_ready_stream_is_granted_at_once_when_a_lane_is_free() {
        let t0 = Instant::now();
        let mut core = PlannerCore::new(settings(usize::MAX));
        let keys: Vec<_> = (1..=5).map(key).collect();
        for &k in &keys {
            core.ask(k, Need::Poll { full_due: false }, t0);
        }
        let granted = core.grant(t0, false);
        assert_eq!(granted.len(), 5, "ample lanes: every ready stream goes now");
        assert!(granted.iter().all(|(_, g)| *g == Grant::Poll));
    }

    #[test]
    fn a_stream_is_not_granted_before_it_is_ready() {
        let t0 = Instant::now();
        let mut core = PlannerCore::new(settings(3));
        core.ask(key(1), Need::Poll { full_due: false }, t0 + secs(30));
        assert!(core.grant(t0, false).is_empty());
        assert_eq!(core.wake_at(key(1), t0), Some(t0 + secs(30)));
        assert_eq!(
            core.grant(t0 + secs(30), false),
            vec![(key(1), Grant::Poll)]
        );
    }

    #[test]
    fn the_lanes_bound_what_runs_at_once_and_a_finished_sweep_frees_its_lane() {
        let t0 = Instant::now();
        let mut core = PlannerCore::new(settings(2));
        for t in 1..=4 {
            core.ask(key(t), Need::Poll { full_due: false }, t0);
        }
        let first = core.grant(t0, false);
        assert_eq!(first.len(), 2);
        assert!(core.grant(t0, false).is_empty(), "both lanes busy");
        let waiting = (1..=4)
            .map(key)
            .find(|k| first.iter().all(|(g, _)| g != k))
            .unwrap();
        assert_eq!(
            core.wake_at(waiting, t0),
            None,
            "never polled, ready: only a grant changes its turn"
        );
        let (k, g) = first[0];
        core.take_grant(k);
        core.finished(k, g, facts(t0, 0));
        assert_eq!(core.grant(t0, false).len(), 1);
    }

    #[test]
    fn a_hot_stream_is_polled_before_quiet_ones_of_the_same_age() {
        let t0 = Instant::now();
        let mut core = PlannerCore::new(settings(1));
        // Four streams on three requests a minute: an 80 s uniform round.
        core.set_paced_rate(Some(0.05));
        let keys: Vec<_> = (1..=4).map(key).collect();
        warm(&mut core, &keys, t0);
        // Stream 3 turned out hot over a few polls; the others quiet.
        for round in 1..=3 {
            let at = t0 + secs(60 * round);
            for &k in &keys {
                core.ask(k, Need::Poll { full_due: false }, at);
                core.grant(at, false);
                core.take_grant(k);
                core.finished(k, Grant::Poll, facts(at, if k == key(3) { 60 } else { 0 }));
            }
        }
        let at = t0 + secs(240);
        for &k in &keys {
            core.ask(k, Need::Poll { full_due: false }, at);
        }
        assert_eq!(
            core.grant(at + secs(40), false),
            vec![(key(3), Grant::Poll)]
        );
    }

    #[test]
    fn a_stream_past_the_staleness_cap_goes_before_any_hot_stream() {
        let t0 = Instant::now();
        let mut core = PlannerCore::new(settings(1));
        warm(&mut core, &[key(1)], t0);
        warm(&mut core, &[key(2)], t0 + secs(200));
        // key(2) is very hot.
        for i in 0..3 {
            let at = t0 + secs(210 + 10 * i);
            core.ask(key(2), Need::Poll { full_due: false }, at);
            core.grant(at, false);
            core.take_grant(key(2));
            core.finished(key(2), Grant::Poll, facts(at, 100));
        }
        let at = t0 + secs(301);
        core.ask(key(1), Need::Poll { full_due: false }, at);
        core.ask(key(2), Need::Poll { full_due: false }, at);
        assert_eq!(
            core.grant(at, false),
            vec![(key(1), Grant::Poll)],
            "past max_interval beats any index"
        );
    }

    #[test]
    fn first_syncs_go_before_polls_of_streams_that_already_synced() {
        let t0 = Instant::now();
        let mut core = PlannerCore::new(settings(1));
        warm(&mut core, &[key(1)], t0);
        let at = t0 + secs(60);
        core.ask(key(1), Need::Poll { full_due: false }, at);
        core.ask(key(2), Need::Snapshot, at);
        assert_eq!(core.grant(at, false), vec![(key(2), Grant::Poll)]);
    }

    #[test]
    fn a_due_full_sweep_takes_the_bulk_lane_beside_the_poll_lanes() {
        let t0 = Instant::now();
        let mut core = PlannerCore::new(settings(1));
        warm(&mut core, &[key(1), key(2), key(3)], t0);
        let at = t0 + secs(60);
        core.ask(key(1), Need::Poll { full_due: true }, at);
        core.ask(key(2), Need::Poll { full_due: true }, at);
        core.ask(key(3), Need::Poll { full_due: false }, at);
        let granted = core.grant(at, false);
        assert_eq!(granted.len(), 2);
        assert_eq!(
            granted[0],
            (key(1), Grant::Full),
            "one full sweep at a time"
        );
        assert_eq!(granted[1].1, Grant::Poll);
        assert_ne!(granted[1].0, key(1));
    }

    #[test]
    fn a_withdrawn_grant_frees_its_lane() {
        let t0 = Instant::now();
        let mut core = PlannerCore::new(settings(1));
        core.ask(key(1), Need::Poll { full_due: false }, t0);
        core.ask(key(2), Need::Poll { full_due: false }, t0);
        assert_eq!(core.grant(t0, false), vec![(key(1), Grant::Poll)]);
        assert!(core.grant(t0, false).is_empty(), "the lane is taken");
        // Stream 1's task stopped waiting before it took its turn.
        core.withdraw(key(1));
        assert_eq!(core.take_grant(key(1)), None);
        assert_eq!(core.grant(t0, false), vec![(key(2), Grant::Poll)]);
    }

    /// The square-root law: with one lane, streams whose rates differ by 16×
    /// settle at poll periods about 4× apart.
    #[test]
    fn poll_periods_settle_near_the_square_root_law() {
        let t0 = Instant::now();
        let mut core = PlannerCore::new(PlannerSettings {
            interval: Duration::ZERO,
            max_interval: secs(3600),
            poll_lanes: 1,
            full_resync_interval: secs(7200),
            tail_guard: 0.0,
        });
        // One request a second: what the one lane's one-second polls spend.
        core.set_paced_rate(Some(1.0));
        let hot = key(1);
        let cool = key(2);
        let rate = |k: StreamKey| if k == hot { 1.6 } else { 0.1 };
        let mut last: BTreeMap<StreamKey, Instant> = BTreeMap::new();
        let mut polls: BTreeMap<StreamKey, u32> = BTreeMap::new();
        let mut now = t0;
        for &k in &[hot, cool] {
            core.ask(k, Need::Poll { full_due: false }, now);
        }
        // Each poll takes one second (one request slot).
        for _ in 0..4000 {
            let granted = core.grant(now, false);
            for (k, g) in granted {
                core.take_grant(k);
                let since = now.saturating_duration_since(*last.get(&k).unwrap_or(&t0));
                let changed = (rate(k) * since.as_secs_f64()).round() as u64;
                now += secs(1);
                core.finished(k, g, facts(now - secs(1), changed));
                last.insert(k, now - secs(1));
                *polls.entry(k).or_default() += 1;
                core.ask(k, Need::Poll { full_due: false }, now);
            }
        }
        let ratio = f64::from(polls[&hot]) / f64::from(polls[&cool]);
        assert!(
            (3.0..=5.5).contains(&ratio),
            "sqrt(16) = 4 expected, got {ratio} ({polls:?})"
        );
    }

    /// Streams as tasks against the async planner on tokio's paused clock:
    /// each asks for its turn once its floor has passed, "polls" (one
    /// request of `budget`, then `poll_time`), and finds
    /// `changes(key, at, since_last_poll)` changes.
    async fn simulate(
        settings: PlannerSettings,
        budget: RateBudget,
        streams: Vec<StreamKey>,
        poll_time: Duration,
        run_for: Duration,
        changes: impl Fn(StreamKey, Duration, Duration) -> u64 + Send + Sync + 'static,
    ) -> BTreeMap<StreamKey, Vec<Duration>> {
        let streams = streams.into_iter().map(|k| (k, Duration::ZERO)).collect();
        simulate_from(settings, budget, streams, poll_time, run_for, changes).await
    }

    /// [`simulate`] with each stream's first ask after its own delay.
    async fn simulate_from(
        settings: PlannerSettings,
        budget: RateBudget,
        streams: Vec<(StreamKey, Duration)>,
        poll_time: Duration,
        run_for: Duration,
        changes: impl Fn(StreamKey, Duration, Duration) -> u64 + Send + Sync + 'static,
    ) -> BTreeMap<StreamKey, Vec<Duration>> {
        let budget = Arc::new(budget);
        let planner = Planner::new(settings, budget.clone(), "t".into());
        let start = Instant::now();
        let changes = Arc::new(changes);
        let polls = Arc::new(StdMutex::new(BTreeMap::<StreamKey, Vec<Duration>>::new()));
        let mut tasks = Vec::new();
        for (key, delay) in streams {
            let planner = planner.clone();
            let polls = polls.clone();
            let changes = changes.clone();
            let budget = budget.clone();
            tasks.push(tokio::spawn(async move {
                let mut ready_at = start + delay;
                let mut last = start;
                loop {
                    let grant = planner
                        .turn(key, Need::Poll { full_due: false }, ready_at)
                        .await;
                    let started = Instant::now();
                    if started.duration_since(start) >= run_for {
                        let stopped = SweepFacts {
                            started,
                            completed: false,
                            changed: 0,
                            requests: 0,
                            history: None,
                        };
                        planner.finished(key, grant, stopped);
                        return;
                    }
                    budget.acquire().await;
                    tokio::time::sleep(poll_time).await;
                    let found = changes(key, started.duration_since(start), started - last);
                    polls
                        .lock()
                        .unwrap()
                        .entry(key)
                        .or_default()
                        .push(started.duration_since(start));
                    last = started;
                    planner.finished(
                        key,
                        grant,
                        SweepFacts {
                            started,
                            completed: true,
                            changed: found,
                            requests: 1,
                            history: None,
                        },
                    );
                    ready_at = Instant::now() + settings.interval;
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        let polls = polls.lock().unwrap().clone();
        polls
    }

    fn gaps(polls: &[Duration]) -> Vec<Duration> {
        polls.windows(2).map(|w| w[1] - w[0]).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn with_budget_to_spare_every_stream_polls_every_interval_as_uniform_would() {
        // The daemon's lanes for a limited budget, and a budget of 6,000 a
        // minute that 10 streams every 30 s never fill.
        let settings = PlannerSettings {
            interval: secs(30),
            max_interval: secs(300),
            poll_lanes: POLL_LANES,
            full_resync_interval: secs(3600),
            tail_guard: TAIL_SHARE,
        };
        let polls = simulate(
            settings,
            RateBudget::new(6_000),
            (1..=10).map(key).collect(),
            Duration::from_millis(500),
            secs(600),
            |_, _, _| 0,
        )
        .await;
        for (key, at) in &polls {
            assert!(at.len() >= 19, "{key}: {at:?}");
            for gap in gaps(at) {
                // The floor, the poll, and at most a few budget slots (10 ms each).
                let (low, high) = (Duration::from_millis(30_500), Duration::from_millis(30_600));
                assert!(gap >= low && gap <= high, "{key}: {gap:?}");
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn under_contention_the_floor_and_the_cap_hold_and_a_stream_that_turns_hot_is_followed() {
        let settings = PlannerSettings {
            interval: secs(5),
            max_interval: secs(60),
            poll_lanes: POLL_LANES,
            full_resync_interval: secs(3600),
            tail_guard: TAIL_SHARE,
        };
        // 40 streams every 5 s ask for 8 polls a second; the budget grants
        // about one (60 a minute less the reserve: one every 1.05 s). Stream 7
        // turns hot at 600 s (2 changes/s).
        let budget = RateBudget::new(60);
        let slot = budget.spacing().unwrap();
        let hot_key = StreamKey::new(7, Resource::Vouchers);
        let polls = simulate(
            settings,
            budget,
            (1..=40).map(key).collect(),
            Duration::ZERO,
            secs(1200),
            move |k, at, since| {
                if k == hot_key && at >= secs(600) {
                    since.as_secs() * 2
                } else {
                    0
                }
            },
        )
        .await;
        // Past the cap a stream waits at most for the overdue lanes' requests ahead of it.
        let bound = secs(60) + slot * (2 * POLL_LANES as u32 + 1);
        for (key, at) in &polls {
            for gap in gaps(at) {
                assert!(
                    gap >= secs(5),
                    "{key}: polled again after {gap:?}, under the floor"
                );
                assert!(
                    gap <= bound,
                    "{key}: waited {gap:?}, over the cap and the requests ahead"
                );
            }
        }
        let hot = &polls[&hot_key];
        let before: Vec<_> = hot.iter().filter(|t| **t < secs(600)).copied().collect();
        let after: Vec<_> = hot.iter().filter(|t| **t >= secs(600)).copied().collect();
        // Quiet, it waits far longer than its floor; three polls after turning
        // hot it is polled near its floor (plus the requests ahead of it).
        let mut quiet = gaps(&before);
        quiet.sort();
        assert!(quiet[quiet.len() / 2] >= secs(30), "{before:?}");
        let settled = &gaps(&after)[3..];
        assert!(
            settled.iter().all(|g| *g <= secs(5) + slot * 4),
            "not followed within a few polls: {after:?}"
        );
    }

    /// Polls every stream of `keys` at `at`, each finding `changed(key)`
    /// changes, one after the other in the lane order.
    fn poll_round(
        core: &mut PlannerCore,
        keys: &[StreamKey],
        at: Instant,
        changed: impl Fn(StreamKey) -> u64,
    ) {
        for &k in keys {
            core.ask(k, Need::Poll { full_due: false }, at);
        }
        loop {
            let granted = core.grant(at, false);
            if granted.is_empty() {
                break;
            }
            for (k, g) in granted {
                core.take_grant(k);
                core.finished(k, g, facts(at, changed(k)));
            }
        }
    }

    /// 20 tenants, vouchers and categories: vouchers of tenant t change at
    /// 0.5/t a second, categories never. 57 requests a minute paced.
    fn skewed_core() -> (PlannerCore, Vec<StreamKey>, Instant) {
        let t0 = Instant::now();
        let mut core = PlannerCore::new(PlannerSettings {
            interval: secs(5),
            max_interval: secs(120),
            ..settings(POLL_LANES)
        });
        core.set_paced_rate(Some(PACED_60));
        let mut keys: Vec<_> = (1..=20).map(key).collect();
        keys.extend((1..=20).map(|t| StreamKey::new(t, Resource::Categories)));
        warm(&mut core, &keys, t0);
        for round in 1..=30u64 {
            poll_round(&mut core, &keys, t0 + secs(60 * round), |k| {
                if k.resource == Resource::Categories {
                    0
                } else {
                    (30.0 / k.tenant as f64).round() as u64
                }
            });
        }
        (core, keys, t0 + secs(1800))
    }

    #[test]
    fn the_plan_polls_hot_streams_fastest_holds_the_rest_to_the_tail_target_and_the_idle_just_under_the_cap(
    ) {
        let (mut core, keys, at) = skewed_core();
        core.plan(at);
        // 40 streams at 57 a minute: a uniform round of 42.1 s.
        let round = 40.0 / PACED_60;
        let tail_target = core.tail_target().unwrap();
        assert!(
            (tail_target.as_secs_f64() - TAIL_SHARE * round).abs() < 0.5,
            "{tail_target:?}"
        );
        let bound = |t: u64, r| core.poll_bound(StreamKey::new(t, r));
        assert!(
            bound(1, Resource::Vouchers) < bound(4, Resource::Vouchers),
            "the hottest stream polls most often"
        );
        assert!(bound(1, Resource::Vouchers) < tail_target / 2);
        for t in 1..=20 {
            assert!(
                core.is_quiet(StreamKey::new(t, Resource::Categories)),
                "categories never change"
            );
            assert_eq!(
                bound(t, Resource::Categories),
                secs(120).mul_f64(targets::TAIL_CAP_SHARE),
                "planned under the cap, so deadlines order them among the rest"
            );
        }
        assert!(!core.is_quiet(key(1)) && !core.is_quiet(key(10)));
        for t in 1..=10 {
            assert!(bound(t, Resource::Vouchers) <= tail_target, "tenant {t}");
        }
        // The schedule spends the budget, no more.
        let spent: f64 = keys
            .iter()
            .map(|k| 1.0 / core.poll_bound(*k).as_secs_f64())
            .sum();
        let plannable = PACED_60 * targets::SPEND_SHARE;
        assert!(spent <= plannable * 1.001, "{spent}");
        assert!(spent >= plannable * 0.98, "{spent}");
    }

    #[test]
    fn ready_streams_are_polled_earliest_deadline_first() {
        let (mut core, keys, at) = skewed_core();
        core.plan(at);
        // The hottest stream planned above its floor (the hottest may be at
        // the floor, where it is not ready before its deadline anyway).
        let floor = core.settings.interval;
        let hot = keys
            .iter()
            .copied()
            .filter(|k| core.poll_bound(*k) > floor + Duration::from_millis(500))
            .min_by_key(|k| core.poll_bound(*k))
            .unwrap();
        let cold = keys
            .iter()
            .copied()
            .filter(|k| core.poll_bound(*k) < core.settings.max_interval)
            .max_by_key(|k| core.poll_bound(*k))
            .unwrap();
        // Both last polled at `at`; the hot one's deadline comes first.
        assert!(core.poll_bound(hot) < core.poll_bound(cold));
        poll_round(&mut core, &[hot, cold], at, |_| 0);
        let later = at + core.poll_bound(cold);
        core.ask(cold, Need::Poll { full_due: false }, at + secs(5));
        core.ask(hot, Need::Poll { full_due: false }, at + secs(5));
        let mut core1 = core.clone();
        core1.settings.poll_lanes = 1;
        assert_eq!(
            core1.grant(later, false),
            vec![(hot, Grant::Poll)],
            "more overdue"
        );
        let mut core2 = core.clone();
        core2.settings.poll_lanes = 1;
        let soon = at + core.poll_bound(hot) - Duration::from_millis(200);
        assert_eq!(
            core2.grant(soon, false),
            vec![(hot, Grant::Poll)],
            "the lanes are work-conserving: the next deadline goes even before it passes"
        );
    }

    #[test]
    fn a_budget_that_covers_the_floor_plans_every_stream_at_the_floor() {
        let t0 = Instant::now();
        let mut core = PlannerCore::new(settings(3));
        core.set_paced_rate(Some(100.0));
        warm(&mut core, &[key(1), key(2)], t0);
        core.plan(t0);
        assert_eq!(core.tail_target(), None);
        assert_eq!(core.poll_bound(key(1)), secs(30));
        core.set_paced_rate(None);
        core.plan(t0);
        assert_eq!(core.poll_bound(key(2)), secs(30), "unlimited");
    }

    #[test]
    fn a_tail_guard_of_zero_leaves_the_square_root_law_up_to_just_under_the_cap() {
        let (mut core, _, at) = skewed_core();
        core.settings.tail_guard = 0.0;
        core.plan(at);
        assert_eq!(
            core.tail_target(),
            Some(secs(120).mul_f64(targets::TAIL_CAP_SHARE))
        );
        assert!(
            core.streams().all(|(k, _)| !core.is_quiet(k)),
            "no cold tail"
        );
        // Tenant 4 changes 4 times as often as tenant 16: polled twice as often.
        let ratio = core.poll_bound(key(16)).as_secs_f64() / core.poll_bound(key(4)).as_secs_f64();
        assert!((ratio - 2.0).abs() < 0.1, "{ratio}");
        assert!(core.poll_bound(StreamKey::new(3, Resource::Categories)) >= secs(110));
    }

    #[test]
    fn only_announced_changes_count_and_a_silent_tenant_is_planned_from_the_population() {
        let (mut core, _, at) = skewed_core();
        core.plan(at);
        // Tenant 20's vouchers: about 1.5 changes a minute.
        let rate = core.planned_rate(key(20));
        assert!((rate - 0.025).abs() < 0.01, "{rate}");
        // Tenant 21 is new and silent for 10 minutes.
        let quiet = key(21);
        warm(&mut core, &[quiet], at);
        poll_round(&mut core, &[quiet], at + secs(600), |_| 0);
        core.plan(at + secs(600));
        let rate = core.planned_rate(quiet);
        assert!(rate > 0.0 && rate < 0.025, "{rate}");
    }

    /// First syncs of 20 tenants whose listings show tenants 1-4 changed
    /// minutes ago and the rest untouched for hours: `history` gives each
    /// snapshot's evidence (None: the listing showed nothing).
    fn first_synced(history: impl Fn(TenantId) -> Option<Evidence>) -> (PlannerCore, Instant) {
        let t0 = Instant::now();
        let mut core = PlannerCore::new(PlannerSettings {
            interval: secs(5),
            max_interval: secs(300),
            ..settings(POLL_LANES)
        });
        core.set_paced_rate(Some(20.0 / 60.0));
        for t in 1..=20 {
            for k in [key(t), StreamKey::new(t, Resource::Categories)] {
                core.ask(k, Need::Snapshot, t0);
                let granted = core.grant(t0, false);
                assert_eq!(granted, vec![(k, Grant::Poll)]);
                core.take_grant(k);
                let facts = SweepFacts {
                    history: history(t),
                    ..facts(t0, 0)
                };
                core.finished(k, Grant::Poll, facts);
            }
        }
        (core, t0 + secs(10))
    }

    #[test]
    fn a_first_syncs_history_tells_hot_streams_from_idle_ones_before_any_poll() {
        let hours = |h: f64| h * 3600.0;
        let (mut core, at) = first_synced(|t| {
            Some(if t <= 4 {
                // Every record changed within the last 10 minutes.
                Evidence {
                    changes: 100.0,
                    seconds: 300.0 * t as f64,
                }
            } else {
                Evidence {
                    changes: 0.0,
                    seconds: hours(6.0),
                }
            })
        });
        core.plan(at);
        let hot = core.planned_rate(key(1));
        let idle = core.planned_rate(key(20));
        assert!(hot > 0.05, "tenant 1 learnt as hot at once: {hot}");
        assert!(idle < hot / 1000.0, "tenant 20 learnt as idle: {idle}");
        assert!(core.is_quiet(key(20)) && !core.is_quiet(key(1)));
        assert!(
            core.poll_bound(key(1)) * 3 < core.poll_bound(key(20)),
            "{:?} vs {:?}",
            core.poll_bound(key(1)),
            core.poll_bound(key(20))
        );

        // Without a history every tenant starts alike.
        let (mut core, at) = first_synced(|_| None);
        core.plan(at);
        assert_eq!(core.planned_rate(key(1)), core.planned_rate(key(20)));
        assert_eq!(core.poll_bound(key(1)), core.poll_bound(key(20)));
    }

    /// The tail target of `streams` one-request streams on a budget of 60 a minute.
    fn tail_target_at_60(streams: f64) -> Duration {
        Duration::from_secs_f64(streams / PACED_60 * TAIL_SHARE)
    }

    /// A contended token's planner: a 5 s floor, a 120 s cap.
    fn contended() -> PlannerSettings {
        PlannerSettings {
            interval: secs(5),
            max_interval: secs(120),
            poll_lanes: POLL_LANES,
            full_resync_interval: secs(3600),
            tail_guard: TAIL_SHARE,
        }
    }

    /// Skewed changes for [`simulate`]: tenant t's vouchers change 0.5 / t
    /// times a second, at every multiple of the period (exact counts, no
    /// noise); categories never change.
    fn skewed_vouchers(key: StreamKey, at: Duration, since: Duration) -> u64 {
        if key.resource == Resource::Categories {
            return 0;
        }
        let rate = 0.5 / key.tenant as f64;
        let before = (at.as_secs_f64() - since.as_secs_f64()) * rate;
        ((at.as_secs_f64() * rate).floor() - before.floor()) as u64
    }

    /// The gaps between polls once the schedule settled (after 900 s).
    fn settled(at: &[Duration]) -> Vec<Duration> {
        at.windows(2)
            .filter(|w| w[0] >= secs(900))
            .map(|w| w[1] - w[0])
            .collect()
    }

    /// Streams with skewed rates against the async planner on tokio's
    /// paused clock: every stream that changes is polled within the tail
    /// target (plus the requests ahead of it), the idle ones within the cap,
    /// and the budget they leave goes to the hot streams.
    #[tokio::test(start_paused = true)]
    async fn with_skewed_rates_every_stream_that_changes_is_polled_within_the_tail_target() {
        let budget = RateBudget::new(60);
        let slot = budget.spacing().unwrap();
        // 40 streams at 57 requests a minute paced: a round of 42.1 s.
        let tail_target = tail_target_at_60(40.0);
        let mut keys: Vec<_> = (1..=20).map(key).collect();
        keys.extend((1..=20).map(|t| StreamKey::new(t, Resource::Categories)));
        let polls = simulate(
            contended(),
            budget,
            keys,
            Duration::ZERO,
            secs(2400),
            skewed_vouchers,
        )
        .await;
        // The round is computed from what the budget really granted in its
        // last window (a request or two under the pace), and a stream past
        // its deadline waits for those ahead of it.
        let bound = tail_target + slot * 6;
        let mut category_gaps = Vec::new();
        for (key, at) in &polls {
            let gaps = settled(at);
            assert!(!gaps.is_empty(), "{key}: {at:?}");
            match key.resource {
                Resource::Vouchers => {
                    let worst = gaps.iter().max().copied().unwrap_or_default();
                    assert!(
                        worst <= bound,
                        "{key}: waited {worst:?}, over the tail target {bound:?}"
                    );
                }
                Resource::Categories => category_gaps.extend(gaps),
            }
        }
        category_gaps.sort();
        let median = category_gaps[category_gaps.len() / 2];
        assert!(
            median > tail_target * 2 && *category_gaps.last().unwrap() <= secs(120) + slot * 7,
            "idle streams are held to the cap, not the tail target: median {median:?}"
        );
        let mut hot = settled(&polls[&key(1)]);
        hot.sort();
        assert!(
            hot[hot.len() / 2] < tail_target / 2,
            "the budget idle streams leave goes to the hot one: {hot:?}"
        );
    }

    /// paused clock: idle streams whose first polls came together (a first
    /// sync) are planned under the cap, so deadlines spread them among the
    /// rest; at the cap itself they went first as overdue, all together,
    /// and held every other stream back for as long as they took.
    #[tokio::test(start_paused = true)]
    async fn idle_streams_synced_together_do_not_hold_back_the_streams_that_change() {
        let budget = RateBudget::new(60);
        let slot = budget.spacing().unwrap();
        // 30 idle streams first polled in the first 30 s, together; 30 that
        // change start once they are done. 60 streams at 57 requests a
        // minute paced: a round of 63.2 s.
        let tail_target = tail_target_at_60(60.0);
        let mut streams: Vec<_> = (1..=30)
            .map(|t| (StreamKey::new(t, Resource::Categories), Duration::ZERO))
            .collect();
        streams.extend((1..=30).map(|t| (key(t), secs(35))));
        let polls = simulate_from(
            contended(),
            budget,
            streams,
            Duration::ZERO,
            secs(2400),
            skewed_vouchers,
        )
        .await;
        // A request ahead of them now and then; at the cap, the idle
        // streams' bursts made them wait six.
        let bound = tail_target + slot * 3;
        for (key, at) in polls
            .iter()
            .filter(|(k, _)| k.resource == Resource::Vouchers)
        {
            let worst = settled(at).into_iter().max().unwrap_or_default();
            assert!(
                worst <= bound,
                "{key}: waited {worst:?}, over the tail target {bound:?}"
            );
        }
        for (key, at) in polls
            .iter()
            .filter(|(k, _)| k.resource == Resource::Categories)
        {
            let worst = gaps(at).into_iter().max().unwrap_or_default();
            assert!(worst <= secs(120) + slot * 7, "{key}: {worst:?}");
        }
    }

    #[test]
    fn streams_past_the_cap_get_lanes_even_while_replays_hold_every_lane() {
        let t0 = Instant::now();
        let mut core = PlannerCore::new(settings(2));
        warm(&mut core, &[key(1), key(2), key(3)], t0);
        // Two long replays take both lanes.
        core.ask(key(8), Need::Snapshot, t0);
        core.ask(key(9), Need::Snapshot, t0);
        assert_eq!(core.grant(t0, false).len(), 2);
        let late = t0 + secs(301);
        for k in [key(1), key(2), key(3)] {
            core.ask(k, Need::Poll { full_due: false }, late);
        }
        let granted = core.grant(late, false);
        assert_eq!(
            granted.len(),
            2,
            "as many lanes again for overdue streams: {granted:?}"
        );
        assert!(granted
            .iter()
            .all(|(k, g)| *g == Grant::Poll && *k != key(8)));
    }

    #[test]
    fn an_idle_budget_opens_one_more_lane_at_every_grant() {
        let t0 = Instant::now();
        let mut core = PlannerCore::new(settings(1));
        for t in 1..=3 {
            core.ask(key(t), Need::Poll { full_due: false }, t0);
        }
        assert_eq!(core.grant(t0, false).len(), 1);
        assert!(
            core.grant(t0, false).is_empty(),
            "a busy budget: the lane limit holds"
        );
        assert_eq!(
            core.grant(t0, true).len(),
            1,
            "an idle budget: one more lane"
        );
        assert_eq!(core.grant(t0, true).len(), 1);
        assert!(core.grant(t0, true).is_empty(), "nobody else is ready");
    }

    #[test]
    fn the_bulk_lane_goes_to_the_oldest_full_sweep_not_the_oldest_poll() {
        let t0 = Instant::now();
        let mut core = PlannerCore::new(settings(3));
        warm(&mut core, &[key(1), key(2)], t0);
        // Stream 2 ran a full sweep at t0; stream 1 never did, but polled since.
        core.ask(key(2), Need::Poll { full_due: true }, t0);
        assert_eq!(core.grant(t0, false), vec![(key(2), Grant::Full)]);
        core.take_grant(key(2));
        core.finished(key(2), Grant::Full, facts(t0, 0));
        let later = t0 + secs(100);
        core.ask(key(1), Need::Poll { full_due: false }, later);
        core.grant(later, false);
        core.take_grant(key(1));
        core.finished(key(1), Grant::Poll, facts(later, 0));
        let at = t0 + secs(200);
        core.ask(key(1), Need::Poll { full_due: true }, at);
        core.ask(key(2), Need::Poll { full_due: true }, at);
        let granted = core.grant(at, false);
        assert_eq!(granted[0], (key(1), Grant::Full), "{granted:?}");
    }
}
