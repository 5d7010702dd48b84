//! The upstream External Voucher API: wire model, HTTP client, pagination and
//! the shared rate budget.

pub mod client;
pub mod error;
pub mod model;
pub mod pagination;
pub mod ratelimit;

use chrono::{DateTime, Utc};
use serde_json::value::RawValue;

/// One listed record: the exact JSON the API returned plus the few typed
/// fields the bridge needs. Unknown fields are kept in `raw`.
#[derive(Debug, Clone)]
pub struct Record {
    /// The record's integer `id`.
    pub id: i64,
    /// The record's `updated_at`, exactly as the API wrote it (None when null or absent).
    pub updated_at: Option<String>,
    /// The record exactly as returned, byte for byte.
    pub raw: Box<RawValue>,
}

/// One page of a listing.
#[derive(Debug, Clone)]
pub struct Page {
    /// Records with a usable id, in API order.
    pub records: Vec<Record>,
    /// Cursor for the next page, handed back untouched; None on the last page.
    pub next_cursor: Option<String>,
    /// The server's clock when it produced the page.
    pub server_time: DateTime<Utc>,
    /// Records dropped because they had no usable integer id.
    pub skipped: usize,
}
