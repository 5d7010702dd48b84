//! The request budget of one upstream token, shared by every stream that uses
//! the token: requests are spaced evenly (no bursts) with a margin kept in
//! reserve, callers are served in arrival order within a lane so one long
//! listing cannot starve the others, full-sweep pages (the bulk lane) take at
//! most `poll.full_sweep_share` while polls wait, and a 429 on any stream
//! pauses them all until the upstream's window has passed.
//!
//! The rate is learnt: the upstream counts per token *and IP*, so replicas
//! behind one egress IP, or another tool on the same token, share the window
//! without knowing. A 429 lowers the paced rate multiplicatively (at most once
//! a window) and every quiet window raises it by a small step, as TCP's AIMD
//! does, so several daemons on one token converge to a fair split of the real
//! budget with few 429s.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use governor::clock::Clock;
use governor::middleware::NoOpMiddleware;
use governor::nanos::Nanos;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::secret::Secret;

/// The window the upstream counts requests in (`requests_per_minute`).
const MINUTE: Duration = Duration::from_secs(60);

/// Share of every window's budget held in reserve (at least one request).
///
/// The upstream counts requests in a fixed window that opens at the first
/// request it sees after the previous window ended. Paced at exactly
/// `window / requests`, a window-opening request that reached the upstream a
/// little late (network, a busy machine) shares its window with `requests`
/// punctually paced ones after it: one too many, a 429. Pacing
/// `requests - reserve` per window instead leaves room for a window-opening
/// request up to `reserve` spacings late (about 3 s of a 60 s window).
pub const PACING_MARGIN: f64 = 0.05;

/// Requests held in reserve per window for a budget of `requests`: 5%, at least one.
fn reserve(requests: u32) -> u32 {
    ((f64::from(requests) * PACING_MARGIN).ceil() as u32).max(1)
}

/// The spacing that paces `requests` per `window` with the margin: `window /
/// (requests - reserve)`; a budget of one request is spaced a margin beyond
/// the window. None when unlimited (0).
fn paced_spacing(requests: u32, window: Duration) -> Option<Duration> {
    let requests = NonZeroU32::new(requests)?.get();
    let reserve = reserve(requests);
    Some(if requests > reserve {
        window / (requests - reserve)
    } else {
        window.mul_f64(1.0 + PACING_MARGIN)
    })
}

/// A governor clock on tokio's time, so limiter waits follow tokio's (pausable) clock.
#[derive(Debug, Clone, Copy)]
pub struct TokioClock {
    /// The instant the clock counts from.
    origin: Instant,
}

impl TokioClock {
    /// A clock counting from now.
    fn new() -> Self {
        Self {
            origin: Instant::now(),
        }
    }
}

impl Clock for TokioClock {
    type Instant = Nanos;

    fn now(&self) -> Nanos {
        Nanos::from(Instant::now().saturating_duration_since(self.origin))
    }
}

/// The governor limiter type behind a budget.
type Limiter = RateLimiter<NotKeyed, InMemoryState, TokioClock, NoOpMiddleware<Nanos>>;

/// Which lane a request of the budget belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Lane {
    /// Incremental polls, first syncs, replays, single-record reads: served first.
    #[default]
    Poll,
    /// Pages of periodic full sweeps: limited to the bulk share while polls wait.
    Bulk,
}

/// Multiplicative decrease of the learnt rate after a 429 (at most once a window).
const DECREASE: f64 = 0.7;
/// Additive increase of the learnt rate per window without a 429, as a share
/// of the configured rate (at least one request): small, so replicas sharing
/// a token meet a 429 seldom once they have converged.
const INCREASE: f64 = 0.01;
/// How much of the lanes' grant counts survives each grant (a memory of about 20 grants).
const SHARE_MEMORY: f64 = 0.95;

/// The rate learnt from 429s (AIMD, as TCP): what the upstream really grants this budget.
#[derive(Debug, Clone, Copy)]
struct Learnt {
    /// Requests per window the budget paces at now (before the reserve).
    requests: u32,
    /// When `requests` last changed.
    changed_at: Instant,
    /// When the last 429 lowered it.
    lowered_at: Option<Instant>,
    /// When the last 429 came (lowering or not): no raise within a window of it.
    limited_at: Option<Instant>,
}

/// Grant counts, for the bulk share and the requests used per window.
#[derive(Debug, Clone, Copy)]
struct Grants {
    /// Decayed grants to polls.
    poll: f64,
    /// Decayed grants to bulk pages.
    bulk: f64,
    /// Start of the current counting window.
    window_start: Instant,
    /// Grants in the current window.
    current: u32,
    /// Grants in the previous window.
    previous: u32,
}

/// What a budget is doing, for status and metrics.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct BudgetState {
    /// Requests per window configured (0 = unlimited).
    pub configured: u32,
    /// Requests per window learnt from the upstream's 429s (paced with the reserve).
    pub learnt: u32,
    /// The window, in seconds.
    pub window_seconds: f64,
    /// Requests granted in the last complete window.
    pub used_last_window: u32,
    /// Poll requests waiting for their turn.
    pub waiting_poll: usize,
    /// Bulk (full-sweep) requests waiting for their turn.
    pub waiting_bulk: usize,
    /// Share of recent grants that went to full sweeps.
    pub bulk_share: f64,
    /// The most full sweeps may take while polls wait.
    pub bulk_share_limit: f64,
}

/// Counts a waiting request of one lane while it lives; when it goes (granted
/// or given up), waiting bulk requests look again.
struct Waiting<'a> {
    counter: &'a AtomicUsize,
    changed: &'a Notify,
}

impl<'a> Waiting<'a> {
    fn enter(counter: &'a AtomicUsize, changed: &'a Notify) -> Self {
        counter.fetch_add(1, Ordering::SeqCst);
        Self { counter, changed }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.counter.fetch_sub(1, Ordering::SeqCst);
        self.changed.notify_waiters();
    }
}

/// One token's request budget: at most `requests` per `window`, evenly spaced
/// with a reserve (see [`PACING_MARGIN`]), FIFO-fair within a lane, polls
/// before full sweeps beyond their share, and a rate lowered by 429s and
/// probed back up (learnt, see [`RateBudget::rate_limited`]).
pub struct RateBudget {
    /// None when the budget is unlimited; rebuilt when the learnt rate changes.
    limiter: StdMutex<Option<Arc<Limiter>>>,
    /// The clock the limiter reads, for turning its verdicts into waits.
    clock: TokioClock,
    /// Callers queue here; tokio's mutex hands the lock out in request order.
    queue: tokio::sync::Mutex<()>,
    /// No request may start before this instant (set after a 429).
    paused_until: StdMutex<Option<Instant>>,
    /// Requests allowed per window (0 = unlimited), as configured.
    requests: u32,
    /// The window `requests` applies to.
    window: Duration,
    /// The rate learnt from 429s.
    learnt: StdMutex<Learnt>,
    /// Grants so far, by lane.
    grants: StdMutex<Grants>,
    /// The most of the budget bulk pages may take while polls wait (0 to 1).
    bulk_share: StdMutex<f64>,
    /// Poll requests waiting.
    waiting_poll: AtomicUsize,
    /// Bulk requests waiting.
    waiting_bulk: AtomicUsize,
    /// Woken at every grant, so waiting bulk requests look again.
    granted: Notify,
}

impl std::fmt::Debug for RateBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateBudget")
            .field("requests", &self.requests)
            .field("window", &self.window)
            .finish_non_exhaustive()
    }
}

fn lock<T>(mutex: &StdMutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl RateBudget {
    /// A budget of `requests_per_minute` evenly spaced requests; 0 means unlimited.
    pub fn new(requests_per_minute: u32) -> Self {
        Self::per_window(requests_per_minute, MINUTE)
    }

    /// A budget of `requests` per `window`, evenly spaced with the margin (one
    /// every `window / (requests - reserve)`, see [`PACING_MARGIN`]); 0 means unlimited.
    pub fn per_window(requests: u32, window: Duration) -> Self {
        let clock = TokioClock::new();
        let now = Instant::now();
        Self {
            limiter: StdMutex::new(Self::limiter(requests, window, clock)),
            clock,
            queue: tokio::sync::Mutex::new(()),
            paused_until: StdMutex::new(None),
            requests,
            window,
            learnt: StdMutex::new(Learnt {
                requests,
                changed_at: now,
                lowered_at: None,
                limited_at: None,
            }),
            grants: StdMutex::new(Grants {
                poll: 0.0,
                bulk: 0.0,
                window_start: now,
                current: 0,
                previous: 0,
            }),
            bulk_share: StdMutex::new(1.0),
            waiting_poll: AtomicUsize::new(0),
            waiting_bulk: AtomicUsize::new(0),
            granted: Notify::new(),
        }
    }

    fn limiter(requests: u32, window: Duration, clock: TokioClock) -> Option<Arc<Limiter>> {
        paced_spacing(requests, window)
            .and_then(Quota::with_period)
            .map(|quota| Arc::new(RateLimiter::new(quota, InMemoryState::default(), clock)))
    }

    /// Replaces the limiter after the learnt rate changed. The new limiter's
    /// first cell is spent at once: a request just granted by the old one
    /// must not be followed back-to-back by one the new one lets through.
    fn repace(&self, requests: u32) {
        let limiter = Self::limiter(requests, self.window, self.clock);
        if let Some(limiter) = &limiter {
            let _ = limiter.check();
        }
        *lock(&self.limiter) = limiter;
    }

    /// Limits full-sweep pages to `share` (0 to 1) of the budget while polls wait.
    pub fn set_bulk_share(&self, share: f64) {
        *lock(&self.bulk_share) = share.clamp(0.0, 1.0);
    }

    /// Requests allowed per window (0 = unlimited), as configured.
    pub fn requests(&self) -> u32 {
        self.requests
    }

    /// Requests per window the budget paces at now: the configured rate, lowered by 429s.
    pub fn learnt_requests(&self) -> u32 {
        lock(&self.learnt).requests
    }

    /// The window the budget counts in.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// The spacing between two requests (margin included), None when unlimited.
    pub fn spacing(&self) -> Option<Duration> {
        paced_spacing(self.learnt_requests(), self.window)
    }

    /// Requests actually paced per window: the learnt rate less the reserve (0 = unlimited).
    pub fn paced_per_window(&self) -> u32 {
        match self.learnt_requests() {
            0 => 0,
            n => n.saturating_sub(reserve(n)).max(1),
        }
    }

    /// Waits for this caller's turn in the poll lane (see [`RateBudget::acquire_in`]).
    pub async fn acquire(&self) {
        self.acquire_in(Lane::Poll).await;
    }

    /// Waits for this caller's turn: first in, first served within a lane,
    /// never closer than the spacing. A bulk request waits while polls wait
    /// and full sweeps already had their share of recent grants.
    ///
    /// Cancel-safe: dropping the future gives the place in the queue up.
    pub async fn acquire_in(&self, lane: Lane) {
        let _waiting = Waiting::enter(
            match lane {
                Lane::Poll => &self.waiting_poll,
                Lane::Bulk => &self.waiting_bulk,
            },
            &self.granted,
        );
        if lane == Lane::Bulk {
            loop {
                let granted = self.granted.notified();
                tokio::pin!(granted);
                granted.as_mut().enable();
                if self.bulk_may_go() {
                    break;
                }
                granted.await;
            }
        }
        let _turn = self.queue.lock().await;
        loop {
            if let Some(until) = self.pause_deadline() {
                if until > Instant::now() {
                    tokio::time::sleep_until(until).await;
                    continue;
                }
            }
            let limiter = lock(&self.limiter).clone();
            let Some(limiter) = limiter else {
                break;
            };
            match limiter.check() {
                Ok(()) => break,
                Err(not_until) => {
                    tokio::time::sleep(not_until.wait_time_from(self.clock.now())).await;
                }
            }
        }
        self.granted_to(lane);
    }

    /// True when a bulk request may queue: no poll waits, or bulk is under its share.
    fn bulk_may_go(&self) -> bool {
        if self.waiting_poll.load(Ordering::SeqCst) == 0 {
            return true;
        }
        let share = *lock(&self.bulk_share);
        if share >= 1.0 {
            return true;
        }
        let grants = lock(&self.grants);
        let total = grants.poll + grants.bulk;
        total <= 0.0 || grants.bulk / total < share
    }

    /// Counts a grant and probes the learnt rate back up when it is due.
    fn granted_to(&self, lane: Lane) {
        let now = Instant::now();
        {
            let mut grants = lock(&self.grants);
            grants.poll *= SHARE_MEMORY;
            grants.bulk *= SHARE_MEMORY;
            match lane {
                Lane::Poll => grants.poll += 1.0,
                Lane::Bulk => grants.bulk += 1.0,
            }
            let elapsed = now.saturating_duration_since(grants.window_start);
            if elapsed >= self.window {
                grants.previous = if elapsed >= self.window * 2 {
                    0
                } else {
                    grants.current
                };
                grants.current = 0;
                grants.window_start = now;
            }
            grants.current = grants.current.saturating_add(1);
        }
        self.probe_up(now);
        self.granted.notify_waiters();
    }

    /// Additive increase: a window without a 429 raises the learnt rate a step, up to the configured rate.
    fn probe_up(&self, now: Instant) {
        if self.requests == 0 {
            return;
        }
        let raised = {
            let mut learnt = lock(&self.learnt);
            let quiet = learnt
                .limited_at
                .is_none_or(|at| now.saturating_duration_since(at) >= self.window);
            if learnt.requests >= self.requests
                || !quiet
                || now.saturating_duration_since(learnt.changed_at) < self.window
            {
                return;
            }
            let step = ((f64::from(self.requests) * INCREASE).floor() as u32).max(1);
            learnt.requests = learnt.requests.saturating_add(step).min(self.requests);
            learnt.changed_at = now;
            learnt.requests
        };
        self.repace(raised);
        tracing::debug!(
            requests = raised,
            "no 429 for a window: learnt budget raised"
        );
    }

    /// A 429: the upstream grants less than the budget paces (another replica
    /// or tool on the same token and IP). Multiplicative decrease of the
    /// learnt rate, at most once a window; it is probed back up by
    /// 1% of the configured rate a window while no 429 comes.
    pub fn rate_limited(&self) {
        if self.requests == 0 {
            return;
        }
        let now = Instant::now();
        let lowered = {
            let mut learnt = lock(&self.learnt);
            learnt.limited_at = Some(now);
            if learnt
                .lowered_at
                .is_some_and(|at| now.saturating_duration_since(at) < self.window)
            {
                return;
            }
            let lowered = ((f64::from(learnt.requests) * DECREASE).floor() as u32).max(1);
            learnt.requests = lowered;
            learnt.changed_at = now;
            learnt.lowered_at = Some(now);
            lowered
        };
        self.repace(lowered);
        tracing::info!(
            requests = lowered,
            configured = self.requests,
            "429 from the upstream: learnt budget lowered (another client shares the token?)"
        );
    }

    /// What the budget is doing now.
    pub fn observable_state(&self) -> BudgetState {
        let grants = *lock(&self.grants);
        let total = grants.poll + grants.bulk;
        BudgetState {
            configured: self.requests,
            learnt: self.learnt_requests(),
            window_seconds: self.window.as_secs_f64(),
            used_last_window: grants.previous,
            waiting_poll: self.waiting_poll.load(Ordering::SeqCst),
            waiting_bulk: self.waiting_bulk.load(Ordering::SeqCst),
            bulk_share: if total > 0.0 {
                grants.bulk / total
            } else {
                0.0
            },
            bulk_share_limit: *lock(&self.bulk_share),
        }
    }

    /// Holds every caller of this budget back for `wait` from now (after a 429); never shortens a pause.
    pub fn pause_for(&self, wait: Duration) {
        let until = Instant::now() + wait;
        let mut paused = lock(&self.paused_until);
        if paused.is_none_or(|current| current < until) {
            *paused = Some(until);
        }
    }

    /// The instant before which no request may start, if a pause is set.
    fn pause_deadline(&self) -> Option<Instant> {
        *lock(&self.paused_until)
    }
}

/// Hands out one budget per token so every stream using a token shares it.
///
/// Budgets are keyed by a hash of the token; the registry never holds the token itself.
#[derive(Debug, Default)]
pub struct BudgetRegistry {
    /// Token hash to its budget.
    budgets: StdMutex<HashMap<[u8; 32], Arc<RateBudget>>>,
}

impl BudgetRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// The budget of `token`, created with `requests` per `window` on first use; the same token always gets the same budget.
    pub fn budget_for(&self, token: &Secret, requests: u32, window: Duration) -> Arc<RateBudget> {
        let key = *blake3::hash(token.expose().as_bytes()).as_bytes();
        let mut budgets = self
            .budgets
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let budget = budgets
            .entry(key)
            .or_insert_with(|| Arc::new(RateBudget::per_window(requests, window)));
        if budget.requests() != requests {
            tracing::warn!(
                token_id = %token.fingerprint(),
                kept = budget.requests(),
                ignored = requests,
                "token already has a rate budget; keeping its first requests_per_minute"
            );
        }
        Arc::clone(budget)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    #[tokio::test(start_paused = true)]
    async fn a_429_lowers_the_learnt_rate_once_a_window_and_quiet_windows_raise_it_back() {
        let budget = RateBudget::new(120);
        assert_eq!(budget.learnt_requests(), 120);
        budget.rate_limited();
        assert_eq!(budget.learnt_requests(), 84, "120 x 0.7");
        budget.rate_limited();
        assert_eq!(
            budget.learnt_requests(),
            84,
            "at most one decrease a window"
        );
        let slower = budget.spacing().unwrap();
        assert_eq!(slower, MINUTE / (84 - 5));
        // Quiet windows: each raises the rate by one request (1% of 120, at least 1).
        for minute in 1..=3 {
            tokio::time::advance(MINUTE).await;
            budget.acquire().await;
            assert_eq!(budget.learnt_requests(), 84 + minute);
        }
        // Another 429 a window after the last one lowers it again.
        budget.rate_limited();
        assert_eq!(budget.learnt_requests(), 60, "87 x 0.7");
        assert_eq!(budget.observable_state().learnt, 60);
        assert_eq!(budget.observable_state().configured, 120);
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_learnt_rate_never_lets_two_requests_through_back_to_back() {
        let budget = RateBudget::new(120);
        budget.acquire().await;
        let granted = Instant::now();
        budget.rate_limited();
        budget.acquire().await;
        assert!(
            granted.elapsed() >= budget.spacing().unwrap(),
            "the request after a rate change waited {:?}",
            granted.elapsed()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_window_with_429s_is_not_quiet_even_when_they_no_longer_lower_the_rate() {
        let budget = RateBudget::new(120);
        budget.rate_limited();
        assert_eq!(budget.learnt_requests(), 84);
        // 429s keep coming every 40 s: none lowers again within its window,
        // but none of the windows is quiet either.
        for _ in 0..5 {
            tokio::time::advance(Duration::from_secs(40)).await;
            budget.rate_limited();
            budget.acquire().await;
        }
        assert!(
            budget.learnt_requests() <= 84,
            "{}",
            budget.learnt_requests()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_bulk_request_goes_as_soon_as_the_last_waiting_poll_gives_up() {
        let budget = Arc::new(RateBudget::new(120));
        budget.set_bulk_share(0.25);
        // Bulk has had every recent grant, so it waits while a poll waits.
        for _ in 0..10 {
            budget.acquire_in(Lane::Bulk).await;
        }
        let poll = {
            let budget = budget.clone();
            tokio::spawn(async move {
                budget.acquire_in(Lane::Poll).await;
                std::future::pending::<()>().await;
            })
        };
        tokio::task::yield_now().await;
        let bulk = {
            let budget = budget.clone();
            tokio::spawn(async move { budget.acquire_in(Lane::Bulk).await })
        };
        tokio::task::yield_now().await;
        poll.abort();
        tokio::time::timeout(Duration::from_secs(5), bulk)
            .await
            .expect("the bulk request was woken")
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn the_learnt_rate_never_exceeds_the_configured_one() {
        let budget = RateBudget::new(10);
        for _ in 0..5 {
            tokio::time::advance(MINUTE).await;
            budget.acquire().await;
        }
        assert_eq!(budget.learnt_requests(), 10);
        for _ in 0..20 {
            budget.rate_limited();
            tokio::time::advance(MINUTE).await;
        }
        assert_eq!(
            budget.learnt_requests(),
            1,
            "never below one request a window"
        );
    }

    /// Runs `bulk` and `polls` requesters against one budget until `grants`
    /// grants were made; returns the lanes in grant order.
    async fn grant_order(budget: Arc<RateBudget>, polls: usize, grants: usize) -> Vec<Lane> {
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for lane in std::iter::once(Lane::Bulk).chain(std::iter::repeat_n(Lane::Poll, polls)) {
            let budget = budget.clone();
            let order = order.clone();
            tasks.push(tokio::spawn(async move {
                loop {
                    budget.acquire_in(lane).await;
                    let mut order = order.lock().unwrap();
                    if order.len() >= grants {
                        return;
                    }
                    order.push(lane);
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        let order = order.lock().unwrap().clone();
        order
    }

    #[tokio::test(start_paused = true)]
    async fn full_sweep_pages_take_their_share_while_polls_wait_and_everything_otherwise() {
        let budget = Arc::new(RateBudget::new(120));
        budget.set_bulk_share(0.25);
        let order = grant_order(budget.clone(), 2, 400).await;
        let bulk = order[100..].iter().filter(|l| **l == Lane::Bulk).count();
        let share = bulk as f64 / 300.0;
        assert!(
            (0.2..=0.3).contains(&share),
            "bulk got {share} of the contended budget"
        );
        // Alone, the bulk lane gets every grant.
        let alone = grant_order(budget, 0, 50).await;
        assert!(alone.iter().all(|l| *l == Lane::Bulk));
    }

    #[tokio::test(start_paused = true)]
    async fn a_poll_waits_at_most_a_few_slots_behind_a_running_full_sweep() {
        let budget = Arc::new(RateBudget::new(120));
        budget.set_bulk_share(0.25);
        let spacing = budget.spacing().unwrap();
        let bulk = {
            let budget = budget.clone();
            tokio::spawn(async move {
                loop {
                    budget.acquire_in(Lane::Bulk).await;
                }
            })
        };
        // The full sweep has the budget to itself for a while.
        tokio::time::sleep(spacing * 30).await;
        let asked = Instant::now();
        budget.acquire_in(Lane::Poll).await;
        let waited = asked.elapsed();
        bulk.abort();
        assert!(
            waited <= spacing * 2,
            "a poll waited {waited:?} ({spacing:?} per slot)"
        );
    }

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn requests_are_spaced_evenly_without_an_initial_burst() {
        let budget = RateBudget::new(120);
        let spacing = budget.spacing().unwrap();
        let start = Instant::now();
        let mut at = Vec::new();
        for _ in 0..5 {
            budget.acquire().await;
            at.push(start.elapsed());
        }
        assert_eq!(at[0], Duration::ZERO, "the first request waits for nothing");
        for pair in at.windows(2) {
            let gap = pair[1] - pair[0];
            // tokio's timer ticks in whole milliseconds.
            assert!(
                gap >= spacing && gap <= spacing + Duration::from_millis(1),
                "{at:?}"
            );
        }
    }

    /// The simulator's limiter (src/simulator/state.rs `charge`): a fixed
    /// window that opens at the first request arriving after the previous
    /// one ended, at most `limit` requests in it. Returns how many arrivals
    /// (sorted) it refuses.
    fn refused_by_a_window_that_opens_at_its_first_request(
        arrivals: &[Duration],
        limit: u32,
        window: Duration,
    ) -> usize {
        let mut opened: Option<(Duration, u32)> = None;
        let mut refused = 0;
        for &at in arrivals {
            let (start, count) = match opened {
                Some((start, count)) if at - start < window => (start, count),
                _ => (at, 0),
            };
            if count >= limit {
                refused += 1;
                opened = Some((start, count));
            } else {
                opened = Some((start, count + 1));
            }
        }
        refused
    }

    /// Arrivals of requests admitted at `admitted` when the one that opens each
    /// window (on time) reaches the upstream `late` after its admission and every
    /// other one at once: the worst case for a window that opens at a request.
    fn with_late_window_openers(
        admitted: &[Duration],
        window: Duration,
        late: Duration,
    ) -> Vec<Duration> {
        let mut opened_at: Option<Duration> = None;
        let mut arrivals: Vec<Duration> = admitted
            .iter()
            .map(|&at| {
                if opened_at.is_none_or(|start| at.saturating_sub(start) >= window) {
                    opened_at = Some(at + late);
                    at + late
                } else {
                    at
                }
            })
            .collect();
        arrivals.sort();
        arrivals
    }

    /// Admission times of `count` back-to-back requests on `budget`, in virtual time.
    async fn admissions(budget: &RateBudget, count: usize) -> Vec<Duration> {
        let start = Instant::now();
        let mut at = Vec::with_capacity(count);
        for _ in 0..count {
            budget.acquire().await;
            at.push(start.elapsed());
        }
        at
    }

    #[tokio::test(start_paused = true)]
    async fn window_opening_requests_arriving_late_never_push_a_window_over_the_budget() {
        let window = Duration::from_secs(60);
        for requests in [1, 2, 3, 20, 120, 600] {
            let budget = RateBudget::per_window(requests, window);
            let spacing = budget.spacing().unwrap();
            // Five windows' worth, every window opened by a request up to the margin late.
            let count = 5 * budget.paced_per_window() as usize + 1;
            let admitted = admissions(&budget, count).await;
            for late_ms in [0, 1, 250, 499, 500, 501, 1_000, 2_000, 2_900] {
                let late = Duration::from_millis(late_ms);
                let arrivals = with_late_window_openers(&admitted, window, late);
                let refused = refused_by_a_window_that_opens_at_its_first_request(
                    &arrivals, requests, window,
                );
                assert_eq!(
                    refused, 0,
                    "{requests}/min, spacing {spacing:?}, window openers {late:?} late: {refused} refused"
                );
            }
            // The budget is used: five windows' worth takes five windows (plus
            // tokio's whole-millisecond timer rounding, up to 1ms a request).
            let rounding = Duration::from_millis(count as u64);
            assert!(
                *admitted.last().unwrap() <= window * 5 + spacing + rounding,
                "{requests}/min: {count} requests took {:?}",
                admitted.last().unwrap()
            );
        }
    }

    #[test]
    fn pacing_at_exactly_the_budget_would_be_refused_when_a_window_opener_is_late() {
        // What the margin prevents, on the same model: 120 requests spaced at
        // exactly 500ms, the window opener 600ms late, puts 121 in one window.
        let window = Duration::from_secs(60);
        let admitted: Vec<Duration> = (0..600).map(|i| Duration::from_millis(500 * i)).collect();
        let arrivals = with_late_window_openers(&admitted, window, Duration::from_millis(600));
        assert!(refused_by_a_window_that_opens_at_its_first_request(&arrivals, 120, window) > 0);
    }

    #[test]
    fn the_margin_is_five_percent_of_the_budget_and_at_least_one_request() {
        let spacing = |n| RateBudget::new(n).spacing().unwrap();
        assert_eq!(RateBudget::new(120).paced_per_window(), 114);
        assert_eq!(spacing(120), Duration::from_secs(60) / 114);
        assert_eq!(RateBudget::new(20).paced_per_window(), 19);
        assert_eq!(spacing(20), Duration::from_secs(60) / 19);
        assert_eq!(RateBudget::new(2).paced_per_window(), 1);
        assert_eq!(spacing(2), Duration::from_secs(60));
        // One request per window: one per window and a margin.
        assert_eq!(spacing(1), Duration::from_secs(63));
        assert_eq!(RateBudget::new(6000).paced_per_window(), 5700);
        assert_eq!(RateBudget::new(0).paced_per_window(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_minute_never_admits_more_than_the_budget() {
        let budget = Arc::new(RateBudget::new(120));
        let start = Instant::now();
        let admitted = Arc::new(StdMutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for _ in 0..4 {
            let budget = Arc::clone(&budget);
            let admitted = Arc::clone(&admitted);
            tasks.push(tokio::spawn(async move {
                while start.elapsed() < Duration::from_secs(150) {
                    budget.acquire().await;
                    admitted.lock().unwrap().push(start.elapsed());
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        let admitted = admitted.lock().unwrap().clone();
        for (i, first) in admitted.iter().enumerate() {
            let in_window = admitted[i..]
                .iter()
                .take_while(|t| **t < *first + MINUTE)
                .count();
            assert!(in_window <= 120, "{in_window} requests within a minute");
        }
        // 150 s at 114 paced per minute (120 less the margin): 286 admissions.
        assert!(
            admitted.len() >= 285,
            "budget was not used: {}",
            admitted.len()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn callers_are_served_in_turn_so_a_busy_one_cannot_starve_another() {
        let budget = Arc::new(RateBudget::new(600));
        // Line every caller up before the first turn is handed out.
        budget.pause_for(Duration::from_secs(1));
        let order = Arc::new(StdMutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for caller in 0..3u8 {
            let budget = Arc::clone(&budget);
            let order = Arc::clone(&order);
            tasks.push(tokio::spawn(async move {
                for _ in 0..10 {
                    budget.acquire().await;
                    order.lock().unwrap().push(caller);
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        let order = order.lock().unwrap().clone();
        // Every round of three turns holds each caller once.
        for round in order.chunks(3) {
            let mut sorted = round.to_vec();
            sorted.sort();
            assert_eq!(sorted, vec![0, 1, 2], "order {order:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_pause_holds_every_caller_and_is_never_shortened() {
        let budget = RateBudget::new(0);
        let start = Instant::now();
        budget.pause_for(Duration::from_secs(10));
        budget.pause_for(Duration::from_secs(3));
        budget.acquire().await;
        assert_eq!(start.elapsed(), Duration::from_secs(10));
        budget.acquire().await;
        assert_eq!(start.elapsed(), Duration::from_secs(10));
    }

    #[test]
    fn the_same_token_gets_the_same_budget_and_another_token_its_own() {
        let registry = BudgetRegistry::new();
        let a = registry.budget_for(&Secret::new("token-a"), 120, MINUTE);
        let again = registry.budget_for(&Secret::new("token-a"), 60, MINUTE);
        let b = registry.budget_for(&Secret::new("token-b"), 60, MINUTE);
        assert!(Arc::ptr_eq(&a, &again));
        assert!(!Arc::ptr_eq(&a, &b));
        assert_eq!(again.requests(), 120);
        assert_eq!(b.requests(), 60);
    }

    #[test]
    fn zero_requests_per_minute_is_unlimited() {
        let budget = RateBudget::new(0);
        assert_eq!(budget.spacing(), None);
        assert_eq!(
            RateBudget::new(120).spacing(),
            Some(Duration::from_secs(60) / 114)
        );
    }
}
