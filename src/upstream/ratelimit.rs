//! The request budget of one upstream token, shared by every stream that uses
//! the token: requests are spaced evenly (no bursts) with a margin kept in
//! reserve, callers are served in arrival order so one long listing cannot
//! starve the others, and a 429 on any stream pauses them all until the
//! upstream's window has passed.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use governor::clock::Clock;
use governor::middleware::NoOpMiddleware;
use governor::nanos::Nanos;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
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

/// One token's request budget: at most `requests` per `window`, evenly spaced
/// with a reserve (see [`PACING_MARGIN`]), FIFO-fair.
pub struct RateBudget {
    /// None when the budget is unlimited.
    limiter: Option<Limiter>,
    /// The clock the limiter reads, for turning its verdicts into waits.
    clock: TokioClock,
    /// Callers queue here; tokio's mutex hands the lock out in request order.
    queue: tokio::sync::Mutex<()>,
    /// No request may start before this instant (set after a 429).
    paused_until: StdMutex<Option<Instant>>,
    /// Requests allowed per window (0 = unlimited).
    requests: u32,
    /// The window `requests` applies to.
    window: Duration,
}

impl std::fmt::Debug for RateBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateBudget")
            .field("requests", &self.requests)
            .field("window", &self.window)
            .finish_non_exhaustive()
    }
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
        let limiter = paced_spacing(requests, window)
            .and_then(Quota::with_period)
            .map(|quota| RateLimiter::new(quota, InMemoryState::default(), clock));
        Self {
            limiter,
            clock,
            queue: tokio::sync::Mutex::new(()),
            paused_until: StdMutex::new(None),
            requests,
            window,
        }
    }

    /// Requests allowed per window (0 = unlimited).
    pub fn requests(&self) -> u32 {
        self.requests
    }

    /// The window the budget counts in.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// The spacing between two requests (margin included), None when unlimited.
    pub fn spacing(&self) -> Option<Duration> {
        paced_spacing(self.requests, self.window)
    }

    /// Requests actually paced per window: `requests` less the reserve (0 = unlimited).
    pub fn paced_per_window(&self) -> u32 {
        match self.requests {
            0 => 0,
            n => n.saturating_sub(reserve(n)).max(1),
        }
    }

    /// Waits for this caller's turn: first in, first served, never closer than the spacing.
    ///
    /// Cancel-safe: dropping the future gives the place in the queue up.
    pub async fn acquire(&self) {
        let _turn = self.queue.lock().await;
        loop {
            if let Some(until) = self.pause_deadline() {
                if until > Instant::now() {
                    tokio::time::sleep_until(until).await;
                    continue;
                }
            }
            let Some(limiter) = &self.limiter else {
                return;
            };
            match limiter.check() {
                Ok(()) => return,
                Err(not_until) => {
                    tokio::time::sleep(not_until.wait_time_from(self.clock.now())).await;
                }
            }
        }
    }

    /// Holds every caller of this budget back for `wait` from now (after a 429); never shortens a pause.
    pub fn pause_for(&self, wait: Duration) {
        let until = Instant::now() + wait;
        let mut paused = self
            .paused_until
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if paused.is_none_or(|current| current < until) {
            *paused = Some(until);
        }
    }

    /// The instant before which no request may start, if a pause is set.
    fn pause_deadline(&self) -> Option<Instant> {
        *self
            .paused_until
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
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

    /// The budget of `token`, created with `requests_per_minute` on first use; the same token always gets the same budget.
    pub fn budget_for(&self, token: &Secret, requests_per_minute: u32) -> Arc<RateBudget> {
        let key = *blake3::hash(token.expose().as_bytes()).as_bytes();
        let mut budgets = self
            .budgets
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let budget = budgets
            .entry(key)
            .or_insert_with(|| Arc::new(RateBudget::new(requests_per_minute)));
        if budget.requests() != requests_per_minute {
            tracing::warn!(
                token_id = %token.fingerprint(),
                kept = budget.requests(),
                ignored = requests_per_minute,
                "token already has a rate budget; keeping its first requests_per_minute"
            );
        }
        Arc::clone(budget)
    }
}

#[cfg(test)]
mod tests {
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
        let a = registry.budget_for(&Secret::new("token-a"), 120);
        let again = registry.budget_for(&Secret::new("token-a"), 60);
        let b = registry.budget_for(&Secret::new("token-b"), 60);
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
