//! A bound on the listing bodies the process holds in memory, across every
//! stream and token (`daemon::clients_with` gives all its clients one).
//!
//! Each sweep reads its listing ahead within a budget of its own
//! (`sweep::read_ahead`), but every stream has one: a page of 50 categories
//! with their products is about 5.7 MB, and two tenants' category sweeps
//! starting together held two such bodies, their records and their events at
//! once, the peak of a whole 100,000-record sync. A listing page now takes
//! a share of this budget, sized by its `Content-Length`, before its body is
//! read (the body waits in the socket meanwhile), and keeps it until the
//! page is dropped: its records are slices of that body. A body larger than
//! the whole budget, or of unknown length, takes all of it, so it is read
//! alone. The client waits at most one request timeout for a share, then
//! reads the body without one (`UpstreamClient::share_for`).
//!
//! Only listing pages take shares. A request that a holder of a share may
//! make before it drops its page (a GET confirming a delete, a redemption)
//! never waits here, so holders always make progress and release.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::telemetry::metric;

/// Bytes of listing bodies the process holds at once when not configured
/// otherwise (`upstream.body_budget_mib`): one page of categories with
/// their products and the voucher pages the other streams read ahead
/// meanwhile.
pub const DEFAULT_BODY_BUDGET_BYTES: usize = 8 << 20;

/// The budget counts in units of this many bytes (a semaphore's permits).
const UNIT_BYTES: usize = 1024;

/// The process's budget of listing bodies held in memory.
#[derive(Debug)]
pub struct BodyBudget {
    permits: Arc<Semaphore>,
    units: u32,
}

impl BodyBudget {
    /// A budget of `bytes` (at least one unit).
    pub fn new(bytes: usize) -> BodyBudget {
        let units = (bytes / UNIT_BYTES).clamp(1, Semaphore::MAX_PERMITS.min(u32::MAX as usize));
        let budget = BodyBudget {
            permits: Arc::new(Semaphore::new(units)),
            units: units as u32,
        };
        metrics::gauge!(metric::UPSTREAM_BODY_BUDGET_BYTES).set(budget.size_bytes() as f64);
        budget
    }

    /// Waits for a share of `bytes` (the whole budget if larger, one unit if
    /// smaller), held until the returned share and its clones are dropped.
    pub async fn hold(&self, bytes: u64) -> BodyShare {
        let wanted = self.units_for(bytes);
        // Closed never: the budget does not close its semaphore.
        match self.permits.clone().acquire_many_owned(wanted).await {
            Ok(permit) => {
                let held = Held {
                    permit,
                    units: self.units,
                };
                held.report(0);
                BodyShare(Some(Arc::new(held)))
            }
            Err(_) => BodyShare::default(),
        }
    }

    /// The budget's size in bytes.
    pub fn size_bytes(&self) -> usize {
        self.units as usize * UNIT_BYTES
    }

    /// Bytes held by shares now.
    pub fn held_bytes(&self) -> usize {
        held_bytes(self.units, &self.permits)
    }

    /// Units a body of `bytes` takes.
    fn units_for(&self, bytes: u64) -> u32 {
        let units = bytes.div_ceil(UNIT_BYTES as u64);
        units.clamp(1, u64::from(self.units)) as u32
    }
}

/// Bytes held in a budget of `units` whose semaphore is `permits`.
fn held_bytes(units: u32, permits: &Semaphore) -> usize {
    (units as usize).saturating_sub(permits.available_permits()) * UNIT_BYTES
}

/// A share's permits, reporting the bytes held when taken and released.
#[derive(Debug)]
struct Held {
    permit: OwnedSemaphorePermit,
    units: u32,
}

impl Held {
    /// Bytes this share holds.
    fn bytes(&self) -> usize {
        self.permit.num_permits() * UNIT_BYTES
    }

    /// Sets the held-bytes gauge, `leaving` bytes about to be released.
    fn report(&self, leaving: usize) {
        let held = held_bytes(self.units, self.permit.semaphore()).saturating_sub(leaving);
        metrics::gauge!(metric::UPSTREAM_BODY_BYTES_HELD).set(held as f64);
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.report(self.bytes());
    }
}

/// A page's share of the [`BodyBudget`]: released when the last
/// clone is dropped. The default holds nothing.
#[derive(Debug, Clone, Default)]
pub struct BodyShare(Option<Arc<Held>>);

impl BodyShare {
    /// Bytes this share holds (0 for the default).
    pub fn bytes(&self) -> usize {
        self.0.as_ref().map_or(0, |held| held.bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Whether `share` arrives within 50 ms (the holds it waits on are
    /// released by the test itself, never by time).
    async fn arrives(share: impl std::future::Future<Output = BodyShare>) -> Option<BodyShare> {
        tokio::time::timeout(Duration::from_millis(50), share)
            .await
            .ok()
    }

    #[tokio::test]
    async fn a_share_is_sized_by_the_body_in_whole_units_and_held_until_every_clone_is_dropped() {
        let budget = BodyBudget::new(10 * UNIT_BYTES);
        let share = budget.hold(2 * UNIT_BYTES as u64 + 1).await;
        assert_eq!(share.bytes(), 3 * UNIT_BYTES);
        assert_eq!(budget.held_bytes(), 3 * UNIT_BYTES);
        let clone = share.clone();
        drop(share);
        assert_eq!(budget.held_bytes(), 3 * UNIT_BYTES);
        drop(clone);
        assert_eq!(budget.held_bytes(), 0);
        // An empty body still takes one unit (the client asks for the whole
        // budget when it does not know the length).
        assert_eq!(budget.hold(0).await.bytes(), UNIT_BYTES);
    }

    #[tokio::test]
    async fn a_body_waits_while_the_others_leave_too_little_and_goes_once_one_is_dropped() {
        let budget = BodyBudget::new(10 * UNIT_BYTES);
        let first = budget.hold(6 * UNIT_BYTES as u64).await;
        let second = budget.hold(6 * UNIT_BYTES as u64);
        tokio::pin!(second);
        assert!(
            arrives(&mut second).await.is_none(),
            "6 of 10 held, 6 more granted"
        );
        drop(first);
        let second = arrives(&mut second)
            .await
            .expect("granted once the first is dropped");
        assert_eq!(budget.held_bytes(), 6 * UNIT_BYTES);
        drop(second);
    }

    #[tokio::test]
    async fn a_body_larger_than_the_budget_takes_all_of_it_and_waits_for_every_other() {
        let budget = BodyBudget::new(10 * UNIT_BYTES);
        let small = budget.hold(1).await;
        let huge = budget.hold(100 * UNIT_BYTES as u64);
        tokio::pin!(huge);
        assert!(arrives(&mut huge).await.is_none(), "one unit still held");
        drop(small);
        let huge = arrives(&mut huge)
            .await
            .expect("alone, it gets the whole budget");
        assert_eq!(huge.bytes(), 10 * UNIT_BYTES);
        assert!(
            arrives(budget.hold(1)).await.is_none(),
            "nothing left beside it"
        );
    }

    #[test]
    fn a_budget_has_at_least_one_unit() {
        let budget = BodyBudget::new(0);
        assert_eq!(budget.units, 1);
        assert_eq!(budget.units_for(u64::MAX), 1);
    }
}
