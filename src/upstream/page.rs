//! A page of a listing as the bridge sees it: the query that asks for it,
//! and the decoding of a list body into records kept byte for byte (the
//! bridge reads only `id` and `updated_at`; every other field, known or not,
//! stays in the raw JSON). Shared by the client and the pagination loop, and
//! depends on neither.

use std::fmt;

use chrono::{DateTime, SecondsFormat, Utc};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::stream::Resource;

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

/// Finds the top-level `id` and `updated_at` of a record the envelope
/// already validated as JSON, without a second full parse: one pass that
/// only tracks strings and nesting. None when the record is not the plain
/// case (a key with an escape, `id` or `updated_at` twice, anything that does
/// not look like an object): the caller then asks serde.
fn scan_head(text: &str) -> Option<RecordHead<'_>> {
    let bytes = text.as_bytes();
    let mut pos = skip_ws(bytes, 0);
    if bytes.get(pos) != Some(&b'{') {
        return None;
    }
    pos = skip_ws(bytes, pos + 1);
    let mut head = RecordHead {
        id: None,
        updated_at: None,
    };
    if bytes.get(pos) == Some(&b'}') {
        return Some(head);
    }
    loop {
        if bytes.get(pos) != Some(&b'"') {
            return None;
        }
        let key_end = string_end(bytes, pos)?;
        let key = &bytes[pos + 1..key_end - 1];
        if key.contains(&b'\\') {
            return None;
        }
        pos = skip_ws(bytes, key_end);
        if bytes.get(pos) != Some(&b':') {
            return None;
        }
        let value_start = skip_ws(bytes, pos + 1);
        let value_end = value_end(bytes, value_start)?;
        let slot = match key {
            b"id" => Some(&mut head.id),
            b"updated_at" => Some(&mut head.updated_at),
            _ => None,
        };
        if let Some(slot) = slot {
            if slot.is_some() {
                return None;
            }
            let value =
                serde_json::from_str::<&RawValue>(text.get(value_start..value_end)?).ok()?;
            *slot = Some(value);
        }
        pos = skip_ws(bytes, value_end);
        match bytes.get(pos) {
            Some(b',') => pos = skip_ws(bytes, pos + 1),
            Some(b'}') => return Some(head),
            _ => return None,
        }
    }
}

fn skip_ws(bytes: &[u8], mut pos: usize) -> usize {
    while let Some(b' ' | b'\n' | b'\r' | b'\t') = bytes.get(pos) {
        pos += 1;
    }
    pos
}

/// The end (one past the closing quote) of the string opening at `start`.
fn string_end(bytes: &[u8], start: usize) -> Option<usize> {
    let mut pos = start + 1;
    loop {
        // Eight bytes at a time up to the next quote, backslash (or control
        // character, which valid JSON strings do not hold).
        pos = crate::hash::plain_run_end(bytes, pos);
        match bytes.get(pos)? {
            b'"' => return Some(pos + 1),
            b'\\' => pos += 2,
            _ => pos += 1,
        }
    }
}

/// The end of the (valid) JSON value starting at `start`.
fn value_end(bytes: &[u8], start: usize) -> Option<usize> {
    match bytes.get(start)? {
        b'"' => string_end(bytes, start),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut pos = start;
            loop {
                match bytes.get(pos)? {
                    b'"' => {
                        pos = string_end(bytes, pos)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(pos + 1);
                        }
                    }
                    _ => {}
                }
                pos += 1;
            }
        }
        _ => {
            let mut pos = start;
            while let Some(b) = bytes.get(pos) {
                if matches!(b, b',' | b'}' | b']' | b' ' | b'\n' | b'\r' | b'\t') {
                    break;
                }
                pos += 1;
            }
            Some(pos)
        }
    }
}

/// Reads `id` and `updated_at` from a raw record and keeps the record as it is.
pub fn decode_record(raw: Box<RawValue>) -> Result<Record, SkipReason> {
    if !raw.get().starts_with('{') {
        return Err(SkipReason::NotAnObject);
    }
    let head = match scan_head(raw.get()) {
        Some(head) => head,
        // Anything unusual (escaped keys, a repeated field) takes serde's
        // path, which also words the reason.
        None => {
            serde_json::from_str(raw.get()).map_err(|e| SkipReason::Unreadable(e.to_string()))?
        }
    };
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
    fn the_one_pass_head_scan_reads_what_serde_reads_or_leaves_the_record_to_serde() {
        let serde_head = |text: &str| {
            serde_json::from_str::<RecordHead<'_>>(text).ok().map(|h| {
                (
                    h.id.map(|v| v.get().to_string()),
                    h.updated_at.map(|v| v.get().to_string()),
                )
            })
        };
        for text in [
            r#"{"id":1,"updated_at":"2024-01-01T00:00:00Z"}"#,
            r#"{ "title" : "a \"quoted\" } ]", "nested": {"id": 9, "x": [1, {"updated_at": 2}]}, "id" : -3 }"#,
            r#"{"updated_at":null,"id":null}"#,
            r#"{"id":{"a":[1,2,{"b":"}"}]},"updated_at":17}"#,
            r#"{"id":12345678901234567890,"list":["\\",""],"updated_at":"x"}"#,
            r#"{}"#,
            r#"{"other":true}"#,
            r#"{"id":1.5e3, "t":false}"#,
        ] {
            let scanned = scan_head(text).map(|h| {
                (
                    h.id.map(|v| v.get().to_string()),
                    h.updated_at.map(|v| v.get().to_string()),
                )
            });
            // serde reads a null field as absent; the scan keeps the literal null,
            // which the caller reads as absent too.
            let scanned = scanned.map(|(id, at)| {
                let not_null = |v: Option<String>| v.filter(|v| v != "null");
                (not_null(id), not_null(at))
            });
            assert_eq!(scanned, serde_head(text), "{text}");
        }
        // A repeated field or an escaped key is left to serde.
        assert!(scan_head(r#"{"id":4,"id":5}"#).is_none());
        assert!(scan_head(r#"{"updated_at":"a","updated_at":"b","id":1}"#).is_none());
        assert!(scan_head(r#"{"i\u0064":4}"#).is_none());
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
