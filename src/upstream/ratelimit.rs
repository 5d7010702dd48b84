//! The request budget of one upstream token, shared by every stream that uses
//! the token: requests are spaced evenly (no bursts), callers are served in
//! arrival order so one long listing cannot starve the others, and a 429 on
//! any stream pauses them all until the upstream's window has passed.

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

use super::client::SecretToken;

/// The window the upstream counts requests in (`requests_per_minute`).
const MINUTE: Duration = Duration::from_secs(60);

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

/// One token's request budget: at most `requests` per `window`, evenly spaced, FIFO-fair.
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

    /// A budget of `requests` evenly spaced over `window` (one every `window / requests`); 0 means unlimited.
    pub fn per_window(requests: u32, window: Duration) -> Self {
        let clock = TokioClock::new();
        let limiter = NonZeroU32::new(requests)
            .and_then(|n| Quota::with_period(window / n.get()))
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

    /// The spacing between two requests, None when unlimited.
    pub fn spacing(&self) -> Option<Duration> {
        NonZeroU32::new(self.requests).map(|n| self.window / n.get())
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
    pub fn budget_for(&self, token: &SecretToken, requests_per_minute: u32) -> Arc<RateBudget> {
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
        let start = Instant::now();
        let mut at = Vec::new();
        for _ in 0..5 {
            budget.acquire().await;
            at.push(start.elapsed());
        }
        let expected: Vec<Duration> = (0..5).map(|i| Duration::from_millis(500 * i)).collect();
        assert_eq!(at, expected);
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
        assert!(
            admitted.len() >= 300,
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
        let a = registry.budget_for(&SecretToken::new("token-a"), 120);
        let again = registry.budget_for(&SecretToken::new("token-a"), 60);
        let b = registry.budget_for(&SecretToken::new("token-b"), 60);
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
            Some(Duration::from_millis(500))
        );
    }
}
