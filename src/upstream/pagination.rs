//! Listing: following `next_cursor` untouched until the API says there is no
//! more, so a sync of N records costs exactly ceil(N/50) list requests, and
//! making every listing end (a repeated cursor or a page count far beyond the
//! records known fails it).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use futures::Stream;

use super::client::UpstreamClient;
use super::error::UpstreamError;
use super::page::{ListQuery, Page};
use crate::stream::{Resource, TenantId};

impl UpstreamClient {
    /// Every page of a listing, following `next_cursor` untouched until it is null; ends after the first error.
    ///
    /// A cursor the listing already followed fails it (a cycle never ends).
    pub fn list_pages(
        &self,
        tenant: TenantId,
        resource: Resource,
        q: ListQuery,
    ) -> impl Stream<Item = Result<Page, UpstreamError>> + Send + 'static {
        self.list_pages_bounded(tenant, resource, q, PageLimit::new(u64::MAX))
    }

    /// Like [`list_pages`](Self::list_pages), failing the listing with
    /// [`UpstreamError::EndlessListing`] once it would request a page beyond
    /// `limit` (which the caller may raise while the listing runs).
    pub fn list_pages_bounded(
        &self,
        tenant: TenantId,
        resource: Resource,
        q: ListQuery,
        limit: PageLimit,
    ) -> impl Stream<Item = Result<Page, UpstreamError>> + Send + 'static {
        let client = self.clone();
        let guard = ListingGuard::new(limit);
        futures::stream::unfold(Some((q, guard)), move |next| {
            let client = client.clone();
            async move {
                let (query, mut guard) = next?;
                let page = match client.list_page(tenant, resource, &query).await {
                    Ok(page) => page,
                    Err(err) => return Some((Err(err), None)),
                };
                let following = match &page.next_cursor {
                    None => None,
                    Some(cursor) => match guard.follow(cursor) {
                        Ok(()) => Some((
                            ListQuery {
                                cursor: Some(cursor.clone()),
                                ..query
                            },
                            guard,
                        )),
                        Err(reason) => {
                            let err = UpstreamError::EndlessListing {
                                path: format!("/tenants/{tenant}/catalog/{resource}"),
                                pages: guard.pages(),
                                reason,
                            };
                            return Some((Err(err), None));
                        }
                    },
                };
                Some((Ok(page), following))
            }
        })
    }
}

/// Makes a listing end: remembers every cursor followed and counts pages.
///
/// A cursor is remembered as the 128-bit blake3 digest of its text, 16 bytes
/// in place instead of a heap copy of a string of any length: a first sync of
/// a million records follows 20,000 cursors, whose copies took 2 MB. Two
/// different cursors share a digest with odds of about 2^-128 per pair, far
/// below any failure of the machine the listing runs on.
#[derive(Debug, Clone)]
pub struct ListingGuard {
    followed: std::collections::HashSet<[u8; 16]>,
    pages: u64,
    limit: PageLimit,
}

impl ListingGuard {
    /// A guard for a listing of at most `limit` pages.
    pub fn new(limit: PageLimit) -> Self {
        Self {
            followed: std::collections::HashSet::new(),
            pages: 1,
            limit,
        }
    }

    /// Pages answered so far.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Accepts following `cursor` to the next page, or says why the listing must stop.
    pub fn follow(&mut self, cursor: &str) -> Result<(), String> {
        let max_pages = self.limit.get();
        if self.pages >= max_pages {
            return Err(format!(
                "the page limit of {max_pages} was reached (more pages than the records known \
                 explain; raise poll.max_pages_floor if records really move this much while \
                 listed)"
            ));
        }
        let digest = crate::hash::truncated(&blake3::hash(cursor.as_bytes()));
        if !self.followed.insert(digest) {
            return Err(format!(
                "next_cursor {:?} repeats a cursor this listing already followed (a cursor cycle)",
                cursor.chars().take(40).collect::<String>()
            ));
        }
        self.pages += 1;
        Ok(())
    }
}

/// The page limit of one listing, shared between the listing and its reader.
///
/// A listing starts with the limit of the records known before it
/// ([`page_limit`]); its reader raises the limit as the records it commits
/// grow that count. So a first sync of a catalog of any size ends by itself,
/// while a listing whose pages bring no record it did not already have (a
/// cycle under cursors that never repeat, or the same pages forever) still
/// meets a limit that stops moving.
#[derive(Debug, Clone)]
pub struct PageLimit(Arc<AtomicU64>);

impl PageLimit {
    /// A limit of `max_pages` pages.
    pub fn new(max_pages: u64) -> Self {
        Self(Arc::new(AtomicU64::new(max_pages)))
    }

    /// The pages a listing may take now.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    /// Raises the limit to `max_pages`, at most [`MAX_LISTING_PAGES`]; a
    /// lower value leaves it as it is.
    pub fn raise_to(&self, max_pages: u64) {
        self.0
            .fetch_max(max_pages.min(MAX_LISTING_PAGES), Ordering::Relaxed);
    }
}

/// The page limit of a listing: `floor`, or more when the records known need more pages.
///
/// A listing of `known` records takes `ceil(known / 50)` pages; records
/// updated while the listing runs can move and be listed twice, so the limit
/// allows twice that plus a margin before it calls a listing endless.
pub fn page_limit(known: u64, floor: u64) -> u64 {
    let needed = known.div_ceil(PAGE_SIZE);
    floor.max(needed.saturating_mul(2).saturating_add(100))
}

/// Most pages a listing's limit is ever raised to (500,000,000 records; the
/// largest `poll.max_pages_floor` accepted): a listing whose every page
/// brings new records still ends.
pub const MAX_LISTING_PAGES: u64 = 10_000_000;

/// Records per list page (fixed by the API).
pub const PAGE_SIZE: u64 = 50;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listing_guard_stops_at_any_repeated_cursor_and_at_the_page_limit() {
        let mut guard = ListingGuard::new(PageLimit::new(10));
        assert_eq!(guard.follow("a"), Ok(()));
        assert_eq!(guard.follow("b"), Ok(()));
        let err = guard.follow("a").unwrap_err();
        assert!(err.contains("cursor cycle"), "{err}");
        assert_eq!(guard.pages(), 3);

        let mut guard = ListingGuard::new(PageLimit::new(3));
        assert_eq!(guard.follow("1"), Ok(()));
        assert_eq!(guard.follow("2"), Ok(()));
        let err = guard.follow("3").unwrap_err();
        assert!(err.contains("page limit of 3"), "{err}");
        assert_eq!(guard.pages(), 3);
    }

    #[test]
    fn a_raised_limit_lets_the_listing_go_on_and_a_lower_one_never_shrinks_it() {
        let limit = PageLimit::new(2);
        let mut guard = ListingGuard::new(limit.clone());
        assert_eq!(guard.follow("1"), Ok(()));
        assert!(guard.follow("2").unwrap_err().contains("page limit of 2"));
        limit.raise_to(4);
        limit.raise_to(1);
        assert_eq!(limit.get(), 4);
        assert_eq!(guard.follow("2"), Ok(()));
        assert_eq!(guard.follow("3"), Ok(()));
        assert!(guard.follow("4").unwrap_err().contains("page limit of 4"));
        assert_eq!(guard.pages(), 4);
        limit.raise_to(u64::MAX);
        assert_eq!(limit.get(), MAX_LISTING_PAGES);
    }

    #[test]
    fn long_cursors_that_differ_only_in_their_last_byte_are_told_apart_and_each_repeat_is_caught() {
        let base = "c".repeat(4096);
        let (first, second) = (format!("{base}1"), format!("{base}2"));
        let mut guard = ListingGuard::new(PageLimit::new(100));
        assert_eq!(guard.follow(&first), Ok(()));
        assert_eq!(guard.follow(&second), Ok(()));
        assert!(guard.follow(&second).unwrap_err().contains("cursor cycle"));
        assert!(guard.follow(&first).unwrap_err().contains("cursor cycle"));
    }

    #[test]
    fn the_page_limit_is_the_floor_or_twice_the_pages_of_the_records_known() {
        assert_eq!(page_limit(0, 1000), 1000);
        assert_eq!(page_limit(1_000_000, 1000), 40_100);
        assert_eq!(page_limit(51, 0), 104);
        assert!(page_limit(u64::MAX, 5) > u64::MAX / 50, "no overflow");
    }
}
