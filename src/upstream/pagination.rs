//! Listing: decoding a page without losing a byte of any record, and
//! following `next_cursor` untouched until the API says there is no more, so
//! a sync of N records costs exactly ceil(N/50) list requests.

use std::fmt;

use chrono::{DateTime, SecondsFormat, Utc};
use futures::Stream;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::client::UpstreamClient;
use super::error::UpstreamError;
use super::{Page, Record};
use crate::stream::{Resource, TenantId};
use crate::telemetry::metric;

/// Query of one listing; the same query (with the cursor advanced) is sent for every page.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListQuery {
    /// Only records updated at or after this instant.
    pub updated_since: Option<DateTime<Utc>>,
    /// Opaque cursor from the previous page's `next_cursor`.
    pub cursor: Option<String>,
    /// Ask for relations: vouchers `categories,variants`, categories `products`.
    pub include_relations: bool,
}

impl ListQuery {
    /// The `include` value for `resource` when relations are requested.
    pub fn include_value(resource: Resource) -> &'static str {
        match resource {
            Resource::Vouchers => "categories,variants",
            Resource::Categories => "products",
        }
    }

    /// The query pairs to send for `resource`, in a stable order.
    pub fn pairs(&self, resource: Resource) -> Vec<(&'static str, String)> {
        let mut pairs = Vec::new();
        if let Some(since) = self.updated_since {
            pairs.push((
                "updated_since",
                since.to_rfc3339_opts(SecondsFormat::AutoSi, true),
            ));
        }
        if let Some(cursor) = &self.cursor {
            pairs.push(("cursor", cursor.clone()));
        }
        if self.include_relations {
            pairs.push(("include", Self::include_value(resource).to_owned()));
        }
        pairs
    }
}

/// Why a listed record was skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SkipReason {
    /// The record is not a JSON object.
    NotAnObject,
    /// The record is an object serde cannot read the id from (e.g. a duplicate `id` key).
    Unreadable(String),
    /// The record has no `id` (or it is null).
    MissingId,
    /// The `id` is not an integer that fits in i64; holds an excerpt of the value.
    BadId(String),
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SkipReason::NotAnObject => f.write_str("is not a json object"),
            SkipReason::Unreadable(cause) => write!(f, "cannot be read: {cause}"),
            SkipReason::MissingId => f.write_str("has no id"),
            SkipReason::BadId(value) => write!(f, "has an id that is not an integer: {value}"),
        }
    }
}

/// A record left out of a page: its 0-based position in `data` and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedRecord {
    /// Index in the page's `data` array.
    pub position: usize,
    /// What was wrong with it.
    pub reason: SkipReason,
}

/// A decoded page and the records left out of it.
#[derive(Debug, Clone)]
pub struct DecodedPage {
    /// The page (its `skipped` is `skipped_records.len()`).
    pub page: Page,
    /// Every record left out, for reporting.
    pub skipped_records: Vec<SkippedRecord>,
}

/// The list envelope; `data` items stay raw so no record is ever re-encoded.
#[derive(Deserialize)]
struct Envelope {
    /// The records, byte for byte.
    data: Vec<Box<RawValue>>,
    /// Required key; null on the last page.
    #[serde(deserialize_with = "Option::deserialize")]
    next_cursor: Option<String>,
    /// Required.
    server_time: DateTime<Utc>,
}

/// The two fields the bridge reads from a record, borrowed from the raw JSON.
#[derive(Deserialize)]
struct RecordHead<'a> {
    /// Raw `id`, checked separately so a bad id skips the record, not the page.
    #[serde(borrow, default)]
    id: Option<&'a RawValue>,
    /// Raw `updated_at`; a non-string value is read as absent.
    #[serde(borrow, default)]
    updated_at: Option<&'a RawValue>,
}

/// Decodes one list response body: envelope errors fail the page, a bad record only skips itself.
pub fn decode_page(body: &[u8]) -> Result<DecodedPage, String> {
    let envelope: Envelope =
        serde_json::from_slice(body).map_err(|e| format!("body is not a list envelope: {e}"))?;
    let mut records = Vec::with_capacity(envelope.data.len());
    let mut skipped_records = Vec::new();
    for (position, raw) in envelope.data.into_iter().enumerate() {
        match decode_record(raw) {
            Ok(record) => records.push(record),
            Err(reason) => skipped_records.push(SkippedRecord { position, reason }),
        }
    }
    Ok(DecodedPage {
        page: Page {
            records,
            next_cursor: envelope.next_cursor,
            server_time: envelope.server_time,
            skipped: skipped_records.len(),
        },
        skipped_records,
    })
}

/// Reads `id` and `updated_at` from a raw record and keeps the record as it is.
pub fn decode_record(raw: Box<RawValue>) -> Result<Record, SkipReason> {
    if !raw.get().starts_with('{') {
        return Err(SkipReason::NotAnObject);
    }
    let head: RecordHead<'_> =
        serde_json::from_str(raw.get()).map_err(|e| SkipReason::Unreadable(e.to_string()))?;
    let id_raw = head.id.ok_or(SkipReason::MissingId)?;
    let id = serde_json::from_str::<i64>(id_raw.get()).map_err(|_| {
        if id_raw.get() == "null" {
            SkipReason::MissingId
        } else {
            SkipReason::BadId(id_raw.get().chars().take(40).collect())
        }
    })?;
    let updated_at = head
        .updated_at
        .and_then(|value| serde_json::from_str::<String>(value.get()).ok());
    Ok(Record {
        id,
        updated_at,
        raw,
    })
}

impl UpstreamClient {
    /// One list request (with its retries): `GET /tenants/{tenant}/catalog/{resource}` with `q`.
    pub async fn list_page(
        &self,
        tenant: TenantId,
        resource: Resource,
        q: &ListQuery,
    ) -> Result<Page, UpstreamError> {
        let tenant_segment = tenant.to_string();
        let (mut url, path) =
            self.endpoint(&["tenants", &tenant_segment, "catalog", resource.as_str()]);
        let pairs = q.pairs(resource);
        if !pairs.is_empty() {
            url.query_pairs_mut().extend_pairs(pairs);
        }
        let call = self.get_call(tenant, resource.as_str(), url, path);
        let DecodedPage {
            page,
            skipped_records,
        } = self.execute(&call, decode_page).await?;
        for skipped in &skipped_records {
            tracing::warn!(
                tenant,
                resource = resource.as_str(),
                position = skipped.position,
                cursor = q.cursor.as_deref().unwrap_or(""),
                reason = %skipped.reason,
                "skipping a listed record without a usable integer id"
            );
        }
        // Pages and records seen are counted by the sweep; skips only the client can see.
        if !skipped_records.is_empty() {
            metrics::counter!(
                metric::RECORDS_SKIPPED,
                "tenant" => tenant.to_string(),
                "resource" => resource.as_str()
            )
            .increment(skipped_records.len() as u64);
        }
        Ok(page)
    }

    /// Every page of a listing, following `next_cursor` untouched until it is null; ends after the first error.
    ///
    /// A cursor the listing already followed fails it (a cycle never ends).
    pub fn list_pages(
        &self,
        tenant: TenantId,
        resource: Resource,
        q: ListQuery,
    ) -> impl Stream<Item = Result<Page, UpstreamError>> + Send + 'static {
        self.list_pages_bounded(tenant, resource, q, u64::MAX)
    }

    /// Like [`list_pages`](Self::list_pages), failing the listing with
    /// [`UpstreamError::EndlessListing`] once it would request page `max_pages + 1`.
    pub fn list_pages_bounded(
        &self,
        tenant: TenantId,
        resource: Resource,
        q: ListQuery,
        max_pages: u64,
    ) -> impl Stream<Item = Result<Page, UpstreamError>> + Send + 'static {
        let client = self.clone();
        let guard = ListingGuard::new(max_pages);
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
#[derive(Debug, Clone)]
pub struct ListingGuard {
    followed: std::collections::HashSet<String>,
    pages: u64,
    max_pages: u64,
}

impl ListingGuard {
    /// A guard for a listing of at most `max_pages` pages.
    pub fn new(max_pages: u64) -> Self {
        Self {
            followed: std::collections::HashSet::new(),
            pages: 1,
            max_pages,
        }
    }

    /// Pages answered so far.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Accepts following `cursor` to the next page, or says why the listing must stop.
    pub fn follow(&mut self, cursor: &str) -> Result<(), String> {
        if self.pages >= self.max_pages {
            return Err(format!(
                "the page limit of {} was reached (more pages than the records known explain; \
                 raise poll.max_pages_floor if the catalog really is this large)",
                self.max_pages
            ));
        }
        if !self.followed.insert(cursor.to_string()) {
            return Err(format!(
                "next_cursor {:?} repeats a cursor this listing already followed (a cursor cycle)",
                cursor.chars().take(40).collect::<String>()
            ));
        }
        self.pages += 1;
        Ok(())
    }
}

/// The page limit of one listing: `floor`, or more when the records known need more pages.
///
/// A listing of `known` records takes `ceil(known / 50)` pages; records
/// updated while the listing runs can move and be listed twice, so the limit
/// allows twice that plus a margin before it calls a listing endless.
pub fn page_limit(known: u64, floor: u64) -> u64 {
    let needed = known.div_ceil(PAGE_SIZE);
    floor.max(needed.saturating_mul(2).saturating_add(100))
}

/// Records per list page (fixed by the API).
pub const PAGE_SIZE: u64 = 50;

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn a_page_keeps_every_record_byte_for_byte_with_unknown_fields() {
        let body = br#"{"data":[{"id":1,"title":"A","future_field":{"x":[1,2.50]},"updated_at":"2024-01-02T03:04:05.000000Z"},
            {"updated_at":null,"id":2}],"next_cursor":"abc==","server_time":"2024-01-02T03:04:06Z","extra":true}"#;
        let decoded = decode_page(body).unwrap();
        let page = decoded.page;
        assert_eq!(page.records.len(), 2);
        assert_eq!(
            page.records[0].raw.get(),
            r#"{"id":1,"title":"A","future_field":{"x":[1,2.50]},"updated_at":"2024-01-02T03:04:05.000000Z"}"#
        );
        assert_eq!(
            page.records[0].updated_at.as_deref(),
            Some("2024-01-02T03:04:05.000000Z")
        );
        assert_eq!(page.records[1].id, 2);
        assert_eq!(page.records[1].updated_at, None);
        assert_eq!(page.next_cursor.as_deref(), Some("abc=="));
        assert_eq!(
            page.server_time,
            Utc.with_ymd_and_hms(2024, 1, 2, 3, 4, 6).unwrap()
        );
        assert_eq!(page.skipped, 0);
    }

    #[test]
    fn records_without_a_usable_id_are_skipped_with_their_position() {
        let body = br#"{"data":[{"id":1},{"title":"no id"},{"id":"7"},{"id":1.5},{"id":null},42,{"id":99999999999999999999},{"id":-3},{"id":4,"id":5}],
            "next_cursor":null,"server_time":"2024-01-02T03:04:06+00:00"}"#;
        let decoded = decode_page(body).unwrap();
        let ids: Vec<i64> = decoded.page.records.iter().map(|r| r.id).collect();
        assert_eq!(ids, vec![1, -3]);
        assert_eq!(decoded.page.skipped, 7);
        let reasons: Vec<(usize, SkipReason)> = decoded
            .skipped_records
            .into_iter()
            .map(|s| (s.position, s.reason))
            .collect();
        assert_eq!(
            reasons,
            vec![
                (1, SkipReason::MissingId),
                (2, SkipReason::BadId("\"7\"".into())),
                (3, SkipReason::BadId("1.5".into())),
                (4, SkipReason::MissingId),
                (5, SkipReason::NotAnObject),
                (6, SkipReason::BadId("99999999999999999999".into())),
                (
                    8,
                    SkipReason::Unreadable("duplicate field `id` at line 1 column 12".into())
                ),
            ]
        );
    }

    #[test]
    fn a_non_string_updated_at_is_read_as_absent_and_escapes_are_decoded() {
        let body = br#"{"data":[{"id":1,"updated_at":17},{"id":2,"updated_at":"2024-01-01T00:00:00\u005A"}],
            "next_cursor":null,"server_time":"2024-01-02T03:04:06Z"}"#;
        let page = decode_page(body).unwrap().page;
        assert_eq!(page.records[0].updated_at, None);
        assert_eq!(
            page.records[1].updated_at.as_deref(),
            Some("2024-01-01T00:00:00Z")
        );
    }

    #[test]
    fn a_broken_envelope_fails_the_page_with_the_cause() {
        for (body, cause) in [
            (&br#"{"data":[],"next_cursor":null}"#[..], "server_time"),
            (
                br#"{"data":[],"server_time":"2024-01-02T03:04:06Z"}"#,
                "next_cursor",
            ),
            (
                br#"{"next_cursor":null,"server_time":"2024-01-02T03:04:06Z"}"#,
                "data",
            ),
            (
                br#"{"data":{},"next_cursor":null,"server_time":"2024-01-02T03:04:06Z"}"#,
                "expected a sequence",
            ),
            (
                br#"{"data":[],"next_cursor":null,"server_time":"yesterday"}"#,
                "input contains invalid characters",
            ),
            (br#"{"data":[{"id":1},{"id":2"#, "EOF"),
            (b"<html>", "expected value"),
        ] {
            let err = decode_page(body).unwrap_err();
            assert!(err.starts_with("body is not a list envelope: "), "{err}");
            assert!(err.contains(cause), "{err} lacks {cause}");
        }
    }

    #[test]
    fn a_listing_guard_stops_at_any_repeated_cursor_and_at_the_page_limit() {
        let mut guard = ListingGuard::new(10);
        assert_eq!(guard.follow("a"), Ok(()));
        assert_eq!(guard.follow("b"), Ok(()));
        let err = guard.follow("a").unwrap_err();
        assert!(err.contains("cursor cycle"), "{err}");
        assert_eq!(guard.pages(), 3);

        let mut guard = ListingGuard::new(3);
        assert_eq!(guard.follow("1"), Ok(()));
        assert_eq!(guard.follow("2"), Ok(()));
        let err = guard.follow("3").unwrap_err();
        assert!(err.contains("page limit of 3"), "{err}");
        assert_eq!(guard.pages(), 3);
    }

    #[test]
    fn the_page_limit_is_the_floor_or_twice_the_pages_of_the_records_known() {
        assert_eq!(page_limit(0, 1000), 1000);
        assert_eq!(page_limit(1_000_000, 1000), 40_100);
        assert_eq!(page_limit(51, 0), 104);
        assert!(page_limit(u64::MAX, 5) > u64::MAX / 50, "no overflow");
    }

    #[test]
    fn query_pairs_carry_since_cursor_and_the_resource_include() {
        let q = ListQuery {
            updated_since: Some(Utc.with_ymd_and_hms(2024, 5, 1, 12, 0, 0).unwrap()),
            cursor: Some("a+b/c=".into()),
            include_relations: true,
        };
        assert_eq!(
            q.pairs(Resource::Vouchers),
            vec![
                ("updated_since", "2024-05-01T12:00:00Z".to_string()),
                ("cursor", "a+b/c=".to_string()),
                ("include", "categories,variants".to_string()),
            ]
        );
        assert_eq!(
            ListQuery {
                include_relations: true,
                ..ListQuery::default()
            }
            .pairs(Resource::Categories),
            vec![("include", "products".to_string())]
        );
        assert!(ListQuery::default().pairs(Resource::Vouchers).is_empty());
    }
}
