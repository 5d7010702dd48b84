//! Listing faults: list pages whose `next_cursor` never ends the listing.
//!
//! A bridge that follows `next_cursor` blindly sweeps forever when the
//! upstream has a pagination bug, burning the shared request budget of every
//! other stream. These faults reproduce the two shapes of that bug with
//! genuine, signed cursors, so the bridge cannot tell them from real ones:
//!
//! - [`ListingFault::CursorCycle`]: first page → A, page A → B, page B → A, …
//!   where A is the real cursor after the first page and B the real cursor
//!   after page A; any cursor other than A leads back to A.
//! - [`ListingFault::Endless`]: real pages up to the real end, then, instead
//!   of `null`, a cursor to a "tail" position `(i64::MAX µs, n)` that no
//!   record has; a tail page repeats the listing's first page and points to
//!   tail `n + 1`, so no cursor is ever issued twice in one listing.

use bytes::Bytes;

use super::cursor::{CursorCodec, SortKey};
use super::store::TenantData;
use super::{ListingFault, PAGE_SIZE};
use crate::stream::Resource;

/// `updated_at` (µs) of the Endless fault's tail positions; no record has it.
const TAIL: i64 = i64::MAX;

/// Everything a faulty page depends on besides the data.
pub struct FaultyQuery<'a> {
    /// The fault in force.
    pub fault: ListingFault,
    /// The resource listed.
    pub resource: Resource,
    /// Lower bound from `updated_since`, as a keyset position.
    pub from: Option<SortKey>,
    /// The verified cursor's position, None on the first page.
    pub after: Option<SortKey>,
    /// The cursor as sent, None on the first page.
    pub cursor: Option<&'a str>,
    /// Include bit mask.
    pub include_mask: u8,
    /// The query fingerprint cursors are bound to.
    pub fingerprint: [u8; 16],
}

/// One page under a listing fault: its records and a `next_cursor` that is never None.
pub fn page(data: &TenantData, codec: &CursorCodec, q: &FaultyQuery<'_>) -> (Vec<Bytes>, String) {
    let page_after = |after: Option<SortKey>| -> Vec<(SortKey, Bytes)> {
        data.page(q.resource, q.from, after, PAGE_SIZE, q.include_mask)
            .0
    };
    let encode = |key: SortKey| codec.encode(key, q.fingerprint);
    let bytes =
        |rows: Vec<(SortKey, Bytes)>| -> Vec<Bytes> { rows.into_iter().map(|(_, b)| b).collect() };
    match q.fault {
        ListingFault::CursorCycle => {
            let first = page_after(None);
            // Where cursor A points: after the first page (or the very start when it is empty).
            let anchor = first.last().map_or((None, i64::MIN), |(key, _)| *key);
            let cursor_a = encode(anchor);
            match q.cursor {
                None => (bytes(first), cursor_a),
                Some(cursor) if cursor == cursor_a => {
                    let rows = page_after(Some(anchor));
                    // B points after page A; on an empty page A, just past the anchor.
                    let b = rows.last().map_or(
                        (anchor.0, anchor.1.checked_add(1).unwrap_or(i64::MIN)),
                        |(key, _)| *key,
                    );
                    (bytes(rows), encode(b))
                }
                Some(_) => (bytes(page_after(q.after)), cursor_a),
            }
        }
        ListingFault::Endless => match q.after {
            Some((Some(TAIL), n)) => (
                bytes(page_after(None)),
                encode((Some(TAIL), n.saturating_add(1))),
            ),
            after => {
                let (rows, more) = data.page(q.resource, q.from, after, PAGE_SIZE, q.include_mask);
                let next = match (more, rows.last()) {
                    (true, Some((key, _))) => encode(*key),
                    _ => encode((Some(TAIL), 0)),
                };
                (bytes(rows), next)
            }
        },
    }
}
