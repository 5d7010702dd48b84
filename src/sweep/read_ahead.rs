//! Reading a listing's next pages while the sweep publishes the current ones.
//!
//! A sweep spends most of a page's time waiting: for the intents' fsync, for
//! the sink's acknowledgements. [`ReadAhead`] lists the following pages
//! meanwhile, in a task of its own, and hands them over in listing order; the
//! sweep then takes every page that has already arrived as one group
//! ([`PageGroup`]): one intent batch, one publish, one commit for all of them,
//! instead of an fsync pair per page. A group waits up to [`GROUP_LINGER`]
//! after its first page for the pages still to come (as Kafka's producers
//! linger for a batch): pages listed back to back, as a first sync or a
//! replay on a fast token lists them, then fill groups instead of leaving
//! each fsync pair to the one page that happened to be there. When pages
//! come slowly (a rate-limited token), a group is the one page that arrived,
//! published at most [`GROUP_LINGER`] later; the listing's last page never
//! waits.
//!
//! Memory stays bounded: the pages read ahead and not yet processed hold at
//! most [`ReadAhead::new`]'s byte budget of records, plus the one page being
//! read. A page as large as the budget takes all of it, and the page after it
//! is only requested once it is dropped: a listing of pages that large is
//! read page by page, holding one at a time.
//! Across streams, every page's body also holds a share of the process's
//! body budget (`upstream::body_budget`) until the page is dropped; a group
//! keeps its pages' shares, since its records are slices of their bodies.
//!
//! A group changes nothing the sweep promises: its intents are one durable
//! batch before its first event is published, and its hashes are committed
//! only once every event of it is acknowledged, exactly as for one page. A
//! crash re-publishes at most a group (up to [`MAX_GROUP_PAGES`] pages)
//! instead of a page, under the same event ids.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::{Stream, StreamExt};
use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::upstream::body_budget::BodyShare;
use crate::upstream::error::UpstreamError;
use crate::upstream::page::{Page, Record};

/// Bytes of listed records a sweep reads ahead of the pages it processes
/// (and so the most a group holds): ten pages of vouchers with relations.
pub const READ_AHEAD_BYTES: usize = 1024 * 1024;

/// The most pages one group takes (`SweepSettings::max_group_pages` default):
/// 400 records, one publish run of vouchers.
pub const MAX_GROUP_PAGES: usize = 8;

/// How long a group waits, after its first page, for the listing's next
/// pages (`SweepSettings::group_linger` default). Against an upstream that
/// answers a page in about 2 ms (the simulator on loopback), eight pages
/// arrive within it; one that takes tens of milliseconds a page fills groups
/// less; a rate-limited listing's next page (half a second away at 120
/// requests a minute) never arrives within it.
pub const GROUP_LINGER: Duration = Duration::from_millis(20);

/// The budget counts in units of this many bytes (a semaphore's permits).
const PERMIT_BYTES: usize = 1024;

/// One page read ahead, with its share of the byte budget.
pub struct ReadPage {
    page: Result<Page, UpstreamError>,
    budget: PageBudget,
}

impl ReadPage {
    /// The page (or why the listing failed: the last item then) and its share
    /// of the budget, released when dropped.
    pub fn split(self) -> (Result<Page, UpstreamError>, PageBudget) {
        (self.page, self.budget)
    }
}

/// A page's share of the read-ahead budget, released on drop.
pub struct PageBudget(#[allow(dead_code)] OwnedSemaphorePermit);

/// The pages of one listing, read by a task of their own ahead of the sweep.
/// Dropping it stops the listing (a request in flight is abandoned).
pub struct ReadAhead {
    pages: mpsc::UnboundedReceiver<ReadPage>,
    /// The byte budget the listing takes its pages' shares from.
    budget: Arc<Semaphore>,
    /// Signalled when the listing waits for the budget before handing its
    /// next page over: no page comes until the caller drops some.
    budget_full: Arc<Notify>,
    /// Stops the listing, and any wait for its next page.
    cancel: CancellationToken,
    task: JoinHandle<()>,
    /// The task was awaited (its pages are all handed over).
    ended: bool,
}

impl ReadAhead {
    /// Starts listing `pages` ahead of the caller, holding at most
    /// `budget_bytes` of records it has read and the caller has not dropped.
    /// Once `cancel` fires no further page is requested.
    pub fn new<S>(pages: S, budget_bytes: usize, cancel: CancellationToken) -> ReadAhead
    where
        S: Stream<Item = Result<Page, UpstreamError>> + Send + 'static,
    {
        let permits = (budget_bytes / PERMIT_BYTES).clamp(1, u32::MAX as usize);
        let budget = Arc::new(Semaphore::new(permits));
        let (tx, rx) = mpsc::unbounded_channel();
        let budget_full = Arc::new(Notify::new());
        let (budget_held, budget_full_held, cancel_held) =
            (budget.clone(), budget_full.clone(), cancel.clone());
        let listing = async move {
            let (budget, budget_full, cancel) = (budget_held, budget_full_held, cancel_held);
            futures::pin_mut!(pages);
            let mut first = true;
            loop {
                if !first && cancel.is_cancelled() {
                    return;
                }
                first = false;
                let Some(page) = pages.next().await else {
                    return;
                };
                let failed = page.is_err();
                let bytes = page.as_ref().map(Page::record_bytes).unwrap_or(0);
                let wanted = (bytes / PERMIT_BYTES).clamp(1, permits);
                if budget.available_permits() < wanted {
                    budget_full.notify_waiters();
                }
                // Closed never: the semaphore lives as long as this task.
                let Ok(share) = budget.clone().acquire_many_owned(wanted as u32).await else {
                    return;
                };
                let read = ReadPage {
                    page,
                    budget: PageBudget(share),
                };
                if tx.send(read).is_err() || failed {
                    return;
                }
                if wanted == permits {
                    // A page as large as the budget (a page of categories with
                    // their products is megabytes): its successor is likely as
                    // large, so it is listed only once this one is dropped, and
                    // such a listing goes page by page, as without read-ahead.
                    budget_full.notify_waiters();
                    if budget.acquire_many(permits as u32).await.is_err() {
                        return;
                    }
                }
            }
        };
        // In the sweep's span: the client's logs keep their tenant and resource.
        let task = tokio::spawn(listing.in_current_span());
        ReadAhead {
            pages: rx,
            budget,
            budget_full,
            cancel,
            task,
            ended: false,
        }
    }

    /// The next page, waiting for it; None once no further page comes: the
    /// listing ended, failed (its error was the last item) or was cancelled.
    /// The caller tells these apart by the last page's `next_cursor`. A panic
    /// of the listing (a bug in the client or the decoder) goes on here, in
    /// the sweep, as it would without read-ahead.
    pub async fn next(&mut self) -> Option<ReadPage> {
        if let Some(page) = self.pages.recv().await {
            return Some(page);
        }
        if !self.ended {
            self.ended = true;
            if let Err(e) = (&mut self.task).await {
                if e.is_panic() {
                    std::panic::resume_unwind(e.into_panic());
                }
            }
        }
        None
    }

    /// The next page if it has arrived already.
    pub fn ready(&mut self) -> Option<ReadPage> {
        self.pages.try_recv().ok()
    }

    /// The next page if it arrives by `deadline`; None if it does not, or if
    /// the listing ended (which [`Self::next`] then reports, a panic included).
    /// Stops waiting once the listing is cancelled, or once it waits for
    /// budget the pages handed over hold: the next page cannot come before
    /// some of them are dropped.
    pub async fn ready_by(&mut self, deadline: Instant) -> Option<ReadPage> {
        let budget_full = self.budget_full.clone();
        let budget_full = budget_full.notified();
        tokio::pin!(budget_full);
        // Listening before the check: a listing that blocks after it still wakes us.
        budget_full.as_mut().enable();
        // A listing waiting for budget holds every permit left (tokio's
        // semaphore hands them to the waiter as they come).
        if self.budget.available_permits() == 0 || self.cancel.is_cancelled() {
            return self.ready();
        }
        tokio::select! {
            biased;
            page = self.pages.recv() => page,
            () = self.cancel.cancelled() => None,
            () = &mut budget_full => self.ready(),
            () = tokio::time::sleep_until(deadline) => None,
        }
    }
}

impl Drop for ReadAhead {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Consecutive pages of a listing processed as one: their records in listing
/// order (a record listed twice counts as its last version, as within a page).
#[derive(Default)]
pub struct PageGroup {
    /// The records of every page, in listing order.
    pub records: Vec<Record>,
    /// Pages taken.
    pub pages: usize,
    /// `server_time` of the group's first page: the clock its records are dated on.
    pub listed_at: Option<DateTime<Utc>>,
    /// True when the last page taken has a next page.
    pub more: bool,
    budget: Vec<PageBudget>,
    /// The pages' shares of the process's body budget: their records are
    /// slices of those bodies.
    bodies: Vec<BodyShare>,
}

impl PageGroup {
    /// Adds `page`'s records after those already taken; its share of the
    /// budget and its body's share of the client's are released with the
    /// group.
    pub fn take(&mut self, page: Page, budget: PageBudget) {
        self.pages += 1;
        self.bodies.push(page.body);
        self.listed_at.get_or_insert(page.server_time);
        self.more = page.next_cursor.is_some();
        if self.records.is_empty() {
            self.records = page.records;
        } else {
            self.records.extend(page.records);
        }
        self.budget.push(budget);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use crate::upstream::body_budget::BodyBudget;
    use crate::upstream::page::RawJson;

    /// A page of `records` records of about `bytes` bytes each; the last has no next cursor.
    fn page(first_id: i64, records: usize, bytes: usize, last: bool) -> Page {
        let filler = "x".repeat(bytes.saturating_sub(40));
        Page {
            records: (0..records as i64)
                .map(|i| {
                    let id = first_id + i;
                    let raw = RawJson::from_string(format!(r#"{{"id":{id},"f":"{filler}"}}"#))
                        .expect("valid json");
                    Record::new(id, None, raw)
                })
                .collect(),
            next_cursor: (!last).then(|| format!("after-{first_id}")),
            server_time: DateTime::from_timestamp(1_700_000_000 + first_id, 0).expect("time"),
            skipped: 0,
            body: Default::default(),
        }
    }

    /// A listing of `count` pages of 10 records of 1 KiB, counting the pages pulled.
    fn listing(
        count: usize,
        pulled: Arc<AtomicUsize>,
    ) -> impl Stream<Item = Result<Page, UpstreamError>> + Send + 'static {
        futures::stream::iter(0..count).map(move |i| {
            pulled.fetch_add(1, Ordering::SeqCst);
            Ok(page(i as i64 * 10, 10, 1024, i + 1 == count))
        })
    }

    fn ids(records: &[Record]) -> Vec<i64> {
        records.iter().map(|r| r.id).collect()
    }

    /// Lets the read-ahead task run until it blocks.
    async fn settle() {
        for _ in 0..50 {
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    #[tokio::test]
    async fn pages_arrive_in_listing_order_and_the_listing_ends() {
        let pulled = Arc::new(AtomicUsize::new(0));
        let mut pages = ReadAhead::new(listing(5, pulled), 1 << 20, CancellationToken::new());
        let mut seen = Vec::new();
        while let Some(read) = pages.next().await {
            let (page, _budget) = read.split();
            seen.extend(ids(&page.expect("page").records));
        }
        assert_eq!(seen, (0..50).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn an_upstream_error_is_the_last_item_and_nothing_is_listed_after_it() {
        let pulled = Arc::new(AtomicUsize::new(0));
        let counter = pulled.clone();
        let failing = futures::stream::iter(0..10).map(move |i| {
            counter.fetch_add(1, Ordering::SeqCst);
            if i == 2 {
                Err(UpstreamError::Timeout {
                    path: "/tenants/1/catalog/vouchers".into(),
                    after: Duration::from_secs(30),
                })
            } else {
                Ok(page(i * 10, 10, 100, false))
            }
        });
        let mut pages = ReadAhead::new(failing, 1 << 20, CancellationToken::new());
        let mut items = Vec::new();
        while let Some(read) = pages.next().await {
            items.push(read.split().0.is_ok());
        }
        assert_eq!(items, vec![true, true, false]);
        assert_eq!(
            pulled.load(Ordering::SeqCst),
            3,
            "no page is listed after a failure"
        );
    }

    #[tokio::test]
    async fn pages_read_ahead_and_not_dropped_stay_within_the_byte_budget() {
        let pulled = Arc::new(AtomicUsize::new(0));
        // Pages of about 10 KiB, a budget of 30 KiB: three pages held, a fourth being read.
        let mut pages = ReadAhead::new(
            listing(20, pulled.clone()),
            30 * 1024,
            CancellationToken::new(),
        );
        settle().await;
        let ahead = pulled.load(Ordering::SeqCst);
        assert!(
            (3..=4).contains(&ahead),
            "{ahead} pages listed ahead for a 3-page budget"
        );
        // Holding pages keeps their budget taken; dropping them lets the listing go on.
        let held: Vec<ReadPage> = std::iter::from_fn(|| pages.ready()).collect();
        assert_eq!(held.len(), 3);
        settle().await;
        assert_eq!(
            pulled.load(Ordering::SeqCst),
            ahead,
            "held pages still count"
        );
        drop(held);
        settle().await;
        assert!(pulled.load(Ordering::SeqCst) >= ahead + 3);
    }

    #[tokio::test]
    async fn pages_larger_than_the_budget_are_listed_one_at_a_time() {
        let pulled = Arc::new(AtomicUsize::new(0));
        let mut pages = ReadAhead::new(listing(5, pulled.clone()), 2048, CancellationToken::new());
        settle().await;
        assert_eq!(
            pulled.load(Ordering::SeqCst),
            1,
            "nothing listed past a large page"
        );
        let mut count = 0;
        while let Some(read) = pages.next().await {
            let (page, budget) = read.split();
            assert!(page.is_ok());
            count += 1;
            settle().await;
            assert_eq!(
                pulled.load(Ordering::SeqCst),
                count,
                "the next large page is listed only once this one is dropped"
            );
            drop(budget);
        }
        assert_eq!(count, 5);
    }

    #[tokio::test]
    async fn once_cancelled_no_further_page_is_requested() {
        let pulled = Arc::new(AtomicUsize::new(0));
        let cancel = CancellationToken::new();
        // A budget of one page: the task waits for the first page to be dropped.
        let mut pages = ReadAhead::new(listing(10, pulled.clone()), 10 * 1024, cancel.clone());
        let first = pages.next().await.expect("first page");
        cancel.cancel();
        drop(first);
        let mut rest = 0;
        while pages.next().await.is_some() {
            rest += 1;
        }
        assert!(rest <= 1, "{rest} pages after the cancel");
        assert!(pulled.load(Ordering::SeqCst) <= 3);
    }

    #[tokio::test]
    async fn dropping_the_read_ahead_stops_the_listing() {
        let pulled = Arc::new(AtomicUsize::new(0));
        let pages = ReadAhead::new(
            listing(1000, pulled.clone()),
            10 * 1024,
            CancellationToken::new(),
        );
        settle().await;
        drop(pages);
        let at_drop = pulled.load(Ordering::SeqCst);
        settle().await;
        assert_eq!(pulled.load(Ordering::SeqCst), at_drop);
        assert!(at_drop < 1000);
    }

    /// A listing whose second page panics (a bug in the decoder).
    fn panicking_listing() -> impl Stream<Item = Result<Page, UpstreamError>> + Send + 'static {
        futures::stream::iter(0..3).map(|i| {
            if i == 1 {
                panic!("decoder bug");
            }
            Ok(page(i * 10, 10, 100, false))
        })
    }

    #[tokio::test]
    #[should_panic(expected = "decoder bug")]
    async fn a_panic_while_listing_goes_on_in_the_sweep_instead_of_ending_the_listing() {
        let mut pages = ReadAhead::new(panicking_listing(), 1 << 20, CancellationToken::new());
        while pages.next().await.is_some() {}
    }

    /// A listing of `count` pages of `records` records of 1 KiB, each listed
    /// `gap` after the one before.
    fn slow_listing(
        count: usize,
        records: usize,
        gap: Duration,
    ) -> impl Stream<Item = Result<Page, UpstreamError>> + Send + 'static {
        futures::stream::iter(0..count).then(move |i| async move {
            tokio::time::sleep(gap).await;
            Ok(page((i * records) as i64, records, 1024, i + 1 == count))
        })
    }

    #[tokio::test(start_paused = true)]
    async fn a_page_listed_by_the_deadline_is_taken_and_one_listed_after_it_is_not() {
        let gap = Duration::from_millis(30);
        let mut pages = ReadAhead::new(slow_listing(3, 10, gap), 1 << 20, CancellationToken::new());
        let started = Instant::now();
        let first = pages.next().await.expect("first page");
        assert_eq!(ids(&first.split().0.expect("page").records)[0], 0);
        // The second page is listed 30 ms after the first: a deadline 50 ms
        // away takes it, one 10 ms away does not (and loses nothing).
        assert!(pages.ready_by(Instant::now() + gap / 3).await.is_none());
        let second = pages.ready_by(started + gap * 2 + gap / 2).await;
        assert_eq!(
            ids(&second
                .expect("second page")
                .split()
                .0
                .expect("page")
                .records)[0],
            10
        );
        let third = pages.ready_by(Instant::now() + gap * 2).await;
        assert_eq!(
            ids(&third.expect("third page").split().0.expect("page").records)[0],
            20
        );
        // The listing ended: no wait, and `next` reports the end.
        let asked = Instant::now();
        assert!(pages.ready_by(asked + gap * 100).await.is_none());
        assert_eq!(Instant::now(), asked, "waited after the listing ended");
        assert!(pages.next().await.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn no_wait_for_a_page_the_budget_has_no_room_for_while_the_pages_taken_hold_it() {
        // Pages of 10 KiB of records (9 permits of 1 KiB) under a 10 KiB
        // budget: the listing waits for the budget, holding the permit left,
        // until the page taken is dropped.
        let listing = futures::stream::iter(0..2).map(|i| Ok(page(i * 10, 10, 1024, i == 1)));
        let mut pages = ReadAhead::new(listing, 10 * 1024, CancellationToken::new());
        let first = pages.next().await.expect("first page");
        let asked = Instant::now();
        assert!(pages
            .ready_by(asked + Duration::from_secs(3600))
            .await
            .is_none());
        assert_eq!(
            Instant::now(),
            asked,
            "waited for a page that could not come"
        );
        drop(first);
        assert!(pages.next().await.is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_ends_when_the_listing_starts_waiting_for_budget_the_pages_taken_hold() {
        // Pages of 5 KiB (4 permits) under a 10 KiB budget, 30 ms apart: the
        // second fits beside the first, the third does not (2 permits left,
        // so the wait for it starts).
        let listing = slow_listing(3, 5, Duration::from_millis(30));
        let mut pages = ReadAhead::new(listing, 10 * 1024, CancellationToken::new());
        let first = pages.next().await.expect("first page");
        let far = Instant::now() + Duration::from_secs(3600);
        let second = pages.ready_by(far).await.expect("the second page fits");
        let asked = Instant::now();
        assert!(pages.ready_by(far).await.is_none());
        assert_eq!(
            Instant::now() - asked,
            Duration::from_millis(30),
            "the wait ends when the third page is listed and finds no budget"
        );
        drop((first, second));
        assert!(
            pages.next().await.is_some(),
            "listed once the budget is back"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancel_ends_a_wait_for_the_next_page() {
        let cancel = CancellationToken::new();
        let mut pages = ReadAhead::new(
            slow_listing(3, 10, Duration::from_secs(60)),
            1 << 20,
            cancel.clone(),
        );
        assert!(pages.next().await.is_some());
        let asked = Instant::now();
        let canceller = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            cancel.cancel();
        });
        assert!(pages
            .ready_by(asked + Duration::from_secs(30))
            .await
            .is_none());
        assert_eq!(Instant::now() - asked, Duration::from_millis(5));
        canceller.await.expect("canceller");
    }

    #[tokio::test]
    #[should_panic(expected = "decoder bug")]
    async fn a_panic_while_listing_a_page_waited_for_still_goes_on_in_the_sweep() {
        let mut pages = ReadAhead::new(panicking_listing(), 1 << 20, CancellationToken::new());
        assert!(pages.next().await.is_some());
        let deadline = Instant::now() + Duration::from_secs(5);
        assert!(pages.ready_by(deadline).await.is_none());
        while pages.next().await.is_some() {}
    }

    #[test]
    fn a_group_keeps_its_pages_records_in_listing_order_dated_by_its_first_page() {
        let semaphore = Arc::new(Semaphore::new(10));
        let permit = || PageBudget(semaphore.clone().try_acquire_owned().expect("permit"));
        let mut group = PageGroup::default();
        let first = page(0, 3, 100, false);
        let first_time = first.server_time;
        group.take(first, permit());
        assert!(group.more);
        group.take(page(3, 2, 100, true), permit());
        assert_eq!(ids(&group.records), vec![0, 1, 2, 3, 4]);
        assert_eq!(group.pages, 2);
        assert_eq!(group.listed_at, Some(first_time));
        assert!(!group.more, "the last page taken has no next page");
        assert_eq!(semaphore.available_permits(), 8);
        drop(group);
        assert_eq!(
            semaphore.available_permits(),
            10,
            "a group releases its pages' budget"
        );
    }

    #[tokio::test]
    async fn a_group_holds_its_pages_body_shares_until_it_is_dropped() {
        // The records are slices of their page's body: the body's share of
        // the client's budget must outlive the page the records left.
        let bodies = BodyBudget::new(64 << 10);
        let semaphore = Arc::new(Semaphore::new(10));
        let permit = || PageBudget(semaphore.clone().try_acquire_owned().expect("permit"));
        let mut group = PageGroup::default();
        for first_id in [0, 3] {
            let mut listed = page(first_id, 3, 100, first_id == 3);
            listed.body = bodies.hold(4 << 10).await;
            group.take(listed, permit());
        }
        assert_eq!(bodies.held_bytes(), 8 << 10);
        drop(group);
        assert_eq!(
            bodies.held_bytes(),
            0,
            "a group releases its bodies' shares"
        );
    }
}
