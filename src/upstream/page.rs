//! A page of a listing as the bridge sees it: the query that asks for it,
//! and the decoding of a list body into records kept byte for byte (the
//! bridge reads only `id` and `updated_at`; every other field, known or not,
//! stays in the raw JSON). Shared by the client and the pagination loop, and
//! depends on neither.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use chrono::{DateTime, SecondsFormat, Utc};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::body_budget::BodyShare;
use crate::hash::{
    content_hash, content_hash_at, ContentHash, HashError, IgnoreKeys, PrintKey, RawPrint,
    RecordHead as CanonicalHead, ValueSpan,
};
use crate::json::{skip_ws, value_end, walk_object, Visited};
use crate::stream::Resource;

/// The text of one JSON value, byte for byte as the API sent it: a slice of
/// the response body it came in (no copy), or text checked when built.
/// Always valid UTF-8: the field stays private to this module, whose
/// constructors keep that promise, because [`RawJson::get`] relies on it.
/// Valid JSON too, except the record of a page decoded with
/// [`Hashing::defer`]: the sweep checks it (a canonical parse, or a raw
/// print equal to one made from bytes that passed one) before it is used.
#[derive(Clone, PartialEq, Eq)]
pub struct RawJson(Bytes);

impl RawJson {
    /// Checks that `json` is one JSON value (no whitespace around it) and keeps it.
    pub fn from_string(json: String) -> Result<RawJson, serde_json::Error> {
        Ok(RawJson::from(RawValue::from_string(json)?))
    }

    /// The JSON text.
    pub fn get(&self) -> &str {
        debug_assert!(std::str::from_utf8(&self.0).is_ok());
        // SAFETY: every constructor keeps valid UTF-8: a `String`, or a slice
        // of a body checked as UTF-8 whose ends are a JSON value's first and
        // one-past-last bytes (ASCII delimiters, so character boundaries).
        // Checking again on every read cost 2% of a first sync's instructions
        // (each event reads its record's text).
        #[allow(unsafe_code)]
        unsafe {
            std::str::from_utf8_unchecked(&self.0)
        }
    }

    /// The JSON text as bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl From<Box<RawValue>> for RawJson {
    fn from(raw: Box<RawValue>) -> RawJson {
        RawJson(Bytes::from(String::from(Box::<str>::from(raw))))
    }
}

impl fmt::Debug for RawJson {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RawJson").field(&self.get()).finish()
    }
}

/// One listed record: the exact JSON the API returned plus the few typed
/// fields the bridge needs. Unknown fields are kept in `raw`.
#[derive(Debug, Clone)]
pub struct Record {
    /// The record's integer `id`.
    pub id: i64,
    /// The record's `updated_at`, exactly as the API wrote it (None when null or absent).
    pub updated_at: Option<String>,
    /// The record exactly as returned, byte for byte.
    pub raw: RawJson,
    /// Its content hash, when the pass that read the page computed it.
    pub hashed: Option<Prehashed>,
    /// The raw print of `raw`, when the listing was read with a print key
    /// ([`Hashing::prints`]).
    pub print: Option<RawPrint>,
}

/// How a listing's records are hashed by the pass that reads their page.
#[derive(Debug, Clone)]
pub struct Hashing {
    /// `poll.ignore_keys`: the content hash leaves these out.
    pub ignore: Arc<IgnoreKeys>,
    /// The store's print key: every record gets its raw print.
    pub prints: Option<PrintKey>,
    /// Leave the content hash to the sweep, which computes it only for
    /// records whose print differs from the stored one (full sweeps, where
    /// almost every record is unchanged). Needs `prints`.
    pub defer: bool,
}

impl Hashing {
    /// Content hashes without `ignore`, computed as the page is read; no prints.
    pub fn eager(ignore: Arc<IgnoreKeys>) -> Hashing {
        Hashing {
            ignore,
            prints: None,
            defer: false,
        }
    }
}

/// A record's content hash computed while its page was read, and the keys
/// it was computed without.
#[derive(Debug, Clone)]
pub struct Prehashed {
    /// `poll.ignore_keys` of the listing.
    pub ignore: Arc<IgnoreKeys>,
    /// The content hash of `raw` without those keys.
    pub hash: ContentHash,
}

impl Record {
    /// A record read from `raw`, not hashed yet.
    pub fn new(id: i64, updated_at: Option<String>, raw: RawJson) -> Record {
        Record {
            id,
            updated_at,
            raw,
            hashed: None,
            print: None,
        }
    }

    /// Its content hash without `ignore`: the one computed when its page
    /// was read when that left out the same keys, else computed now.
    pub fn content_hash(&self, ignore: &IgnoreKeys) -> Result<ContentHash, HashError> {
        match self.prehashed(ignore) {
            Some(hash) => Ok(hash),
            None => content_hash(self.raw.get(), ignore),
        }
    }

    /// The content hash without `ignore` computed when its page was read,
    /// if that pass left out the same keys.
    pub fn prehashed(&self, ignore: &IgnoreKeys) -> Option<ContentHash> {
        self.hashed
            .as_ref()
            .filter(|pre| *pre.ignore == *ignore)
            .map(|pre| pre.hash)
    }
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
    /// The body's share of the process's body budget, held while the page
    /// (whose records are slices of that body) lives.
    pub body: BodyShare,
}

impl Page {
    /// Bytes of its records as listed: about what the page holds in memory.
    pub fn record_bytes(&self) -> usize {
        self.records.iter().map(|r| r.raw.as_bytes().len()).sum()
    }
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
struct Envelope<'a> {
    /// The records, byte for byte, borrowed from the body.
    #[serde(borrow)]
    data: Vec<&'a RawValue>,
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

/// Decodes one list response body: envelope errors fail the page, a bad
/// record only skips itself. Records are slices of `body` (no copy).
pub fn decode_page(body: &Bytes) -> Result<DecodedPage, String> {
    let envelope: Envelope<'_> =
        serde_json::from_slice(body).map_err(|e| format!("body is not a list envelope: {e}"))?;
    let mut records = Vec::with_capacity(envelope.data.len());
    let mut skipped_records = Vec::new();
    for (position, raw) in envelope.data.into_iter().enumerate() {
        match decode_record_in(body, raw) {
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
            body: BodyShare::default(),
        },
        skipped_records,
    })
}

/// [`decode_page`], with every record's content hash (without `ignore`)
/// computed by the same pass that reads it: the canonical parser checks each
/// record, finds where it ends and its `id` and `updated_at`, so the body is
/// read once instead of three times (envelope, heads, hashes). A page with
/// anything unusual (a record skipped, an escaped or repeated top-level key, a
/// record the canonical form refuses, a repeated envelope key) is decoded by
/// [`decode_page`] instead, which words every error and skip as before; its
/// records are hashed later.
///
/// With [`Hashing::defer`], a plain page's records are only delimited (the
/// top-level members walked, their values skipped) and left unhashed: their
/// bytes are checked as JSON by the canonical parse the sweep runs when a
/// print differs, or were checked when the stored print was made from the
/// same bytes. Every record gets its raw print when [`Hashing::prints`] is set.
pub fn decode_page_hashed(body: &Bytes, hashing: &Hashing) -> Result<DecodedPage, String> {
    let deferred = if hashing.defer && hashing.prints.is_some() {
        decode_plain_page(body, &hashing.ignore, true)
    } else {
        None
    };
    let mut decoded = match deferred.or_else(|| decode_plain_page(body, &hashing.ignore, false)) {
        Some(page) => page,
        None => decode_page(body)?,
    };
    if let Some(key) = hashing.prints {
        for record in &mut decoded.page.records {
            record.print = Some(key.print(record.raw.as_bytes()));
        }
    }
    Ok(decoded)
}

/// The one-pass decoding of [`decode_page_hashed`] (records delimited
/// without hashing when `defer`); None for anything unusual.
fn decode_plain_page(body: &Bytes, ignore: &Arc<IgnoreKeys>, defer: bool) -> Option<DecodedPage> {
    let text = std::str::from_utf8(body).ok()?;
    let bytes = text.as_bytes();
    let mut records = None;
    let mut next_cursor = None;
    let mut server_time = None;
    let start = skip_ws(bytes, 0);
    let end = walk_object(bytes, start, |key, pos| {
        let end = match key {
            b"data" if records.is_none() => {
                let (list, end) = decode_plain_records(body, text, pos, ignore, defer)?;
                records = Some(list);
                end
            }
            b"next_cursor" if next_cursor.is_none() => {
                let end = value_end(bytes, pos)?;
                let cursor = serde_json::from_str::<Option<String>>(text.get(pos..end)?);
                next_cursor = Some(cursor.ok()?);
                end
            }
            b"server_time" if server_time.is_none() => {
                let end = value_end(bytes, pos)?;
                let time = serde_json::from_str::<DateTime<Utc>>(text.get(pos..end)?);
                server_time = Some(time.ok()?);
                end
            }
            b"data" | b"next_cursor" | b"server_time" => return None,
            // Any other member: checked as JSON (serde would), then left.
            _ => content_hash_at(text, pos, &IgnoreKeys::none()).ok()?.1.end,
        };
        Some(Visited::Until(end))
    })?;
    if skip_ws(bytes, end) != bytes.len() {
        return None;
    }
    Some(DecodedPage {
        page: Page {
            records: records?,
            next_cursor: next_cursor?,
            server_time: server_time?,
            skipped: 0,
            body: BodyShare::default(),
        },
        skipped_records: Vec::new(),
    })
}

/// The records of the `data` array starting at `start`, each read and hashed
/// in one pass (only delimited when `defer`), and the end of the array; None
/// when any is unusual.
fn decode_plain_records(
    body: &Bytes,
    text: &str,
    start: usize,
    ignore: &Arc<IgnoreKeys>,
    defer: bool,
) -> Option<(Vec<Record>, usize)> {
    let bytes = text.as_bytes();
    if bytes.get(start) != Some(&b'[') {
        return None;
    }
    let mut records = Vec::new();
    let mut pos = skip_ws(bytes, start + 1);
    if bytes.get(pos) == Some(&b']') {
        return Some((records, pos + 1));
    }
    loop {
        if bytes.get(pos) != Some(&b'{') {
            return None;
        }
        let (hashed, head) = if defer {
            (None, delimit_record(bytes, pos)?)
        } else {
            let (hash, head) = content_hash_at(text, pos, ignore).ok()?;
            let hashed = Prehashed {
                ignore: ignore.clone(),
                hash,
            };
            (Some(hashed), head)
        };
        if !head.plain {
            return None;
        }
        let id = plain_id(text, head.id?)?;
        let updated_at = match head.updated_at {
            Some(at) => serde_json::from_str::<String>(text.get(at)?).ok(),
            None => None,
        };
        records.push(Record {
            id,
            updated_at,
            raw: RawJson(body.slice(pos..head.end)),
            hashed,
            print: None,
        });
        pos = skip_ws(bytes, head.end);
        match bytes.get(pos) {
            Some(b',') => pos = skip_ws(bytes, pos + 1),
            Some(b']') => return Some((records, pos + 1)),
            _ => return None,
        }
    }
}

/// Where the record object starting at `start` ends and its top-level `id`
/// and `updated_at` spans, found by walking its top-level members and
/// skipping their values without checking them; None when it is not an
/// object of plain members (an escaped key) or holds `id` or `updated_at`
/// twice. For valid JSON the spans and the end are the canonical parse's.
fn delimit_record(bytes: &[u8], start: usize) -> Option<CanonicalHead> {
    let mut id = None;
    let mut updated_at = None;
    let end = walk_object(bytes, start, |key, value_start| {
        let value_end = value_end(bytes, value_start)?;
        let slot = match key {
            b"id" => &mut id,
            b"updated_at" => &mut updated_at,
            _ => return Some(Visited::Until(value_end)),
        };
        if slot.is_some() {
            return None;
        }
        *slot = Some(value_start..value_end);
        Some(Visited::Until(value_end))
    })?;
    Some(CanonicalHead {
        end,
        id,
        updated_at,
        plain: true,
    })
}

/// A record's `id` when it is an integer that fits in i64 (else the record
/// is skipped, which [`decode_page`] words).
fn plain_id(text: &str, span: ValueSpan) -> Option<i64> {
    serde_json::from_str::<i64>(text.get(span)?).ok()
}

/// Finds the top-level `id` and `updated_at` of a record the envelope
/// already validated as JSON, without a second full parse: one pass that
/// only tracks strings and nesting. None when the record is not the plain
/// case (a key with an escape, `id` or `updated_at` twice, anything that does
/// not look like an object): the caller then asks serde.
fn scan_head(text: &str) -> Option<RecordHead<'_>> {
    let bytes = text.as_bytes();
    let head = delimit_record(bytes, skip_ws(bytes, 0))?;
    // Each field found must be one JSON value, as serde would read it.
    let raw = |span: Option<ValueSpan>| match span {
        None => Some(None),
        Some(span) => serde_json::from_str::<&RawValue>(text.get(span)?)
            .ok()
            .map(Some),
    };
    Some(RecordHead {
        id: raw(head.id)?,
        updated_at: raw(head.updated_at)?,
    })
}

/// Reads `id` and `updated_at` from `raw`, a record inside `body`, and keeps
/// the record as it is: a slice of `body`, not a copy.
pub fn decode_record_in(body: &Bytes, raw: &RawValue) -> Result<Record, SkipReason> {
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
    Ok(Record::new(id, updated_at, slice_of(body, raw)))
}

/// `raw`, borrowed from `body`, as a slice of `body` (a copy should it not
/// lie inside it).
fn slice_of(body: &Bytes, raw: &RawValue) -> RawJson {
    let text = raw.get();
    let offset = (text.as_ptr() as usize).wrapping_sub(body.as_ptr() as usize);
    match offset.checked_add(text.len()) {
        Some(end) if end <= body.len() && body.get(offset..end) == Some(text.as_bytes()) => {
            RawJson(body.slice(offset..end))
        }
        _ => RawJson(Bytes::copy_from_slice(text.as_bytes())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    /// What a decoding gives, comparable.
    type Summary = (
        Vec<(i64, Option<String>, String)>,
        Option<String>,
        DateTime<Utc>,
        Vec<SkippedRecord>,
    );

    fn summary(decoded: &DecodedPage) -> Summary {
        let records = decoded.page.records.iter();
        (
            records
                .map(|r| (r.id, r.updated_at.clone(), r.raw.get().to_string()))
                .collect(),
            decoded.page.next_cursor.clone(),
            decoded.page.server_time,
            decoded.skipped_records.clone(),
        )
    }

    /// Decodes `body` with serde's decoding and with the one pass that
    /// hashes too, checks that both give the same page (or error), and that
    /// each hash computed on the way is the record's content hash.
    fn decode(body: &'static [u8]) -> Result<DecodedPage, String> {
        let body = Bytes::from_static(body);
        let ignore = Arc::new(IgnoreKeys::new(["updated_at"]));
        let serde = decode_page(&body);
        let one_pass = decode_page_hashed(&body, &Hashing::eager(ignore.clone()));
        check_deferred(&body, &ignore, &serde);
        match (&serde, &one_pass) {
            (Ok(serde), Ok(one_pass)) => {
                assert_eq!(summary(serde), summary(one_pass));
                for record in &one_pass.page.records {
                    let Ok(expected) = content_hash(record.raw.get(), &ignore) else {
                        assert!(record.hashed.is_none());
                        continue;
                    };
                    if let Some(pre) = &record.hashed {
                        assert_eq!(pre.hash, expected, "{}", record.raw.get());
                    }
                    assert_eq!(record.content_hash(&ignore).unwrap(), expected);
                }
            }
            (Err(serde), Err(one_pass)) => assert_eq!(serde, one_pass),
            _ => panic!("decodings disagree: {serde:?} / {one_pass:?}"),
        }
        serde
    }

    const SECRET: [u8; crate::hash::PRINT_SECRET_LEN] = *b"page-test-secret";

    /// Decodes `body` with prints and deferred hashes, and checks it against
    /// serde's decoding `serde`: the same page when serde reads it and every
    /// record is valid; when serde refuses the body, a deferred page may be
    /// read, but then one of its records fails its canonical parse (which
    /// the sweep runs on every record whose print it does not know), so the
    /// sweep fails as it would have. Every record carries its print.
    fn check_deferred(body: &Bytes, ignore: &Arc<IgnoreKeys>, serde: &Result<DecodedPage, String>) {
        let key = PrintKey::new(&SECRET, ignore);
        let hashing = Hashing {
            ignore: ignore.clone(),
            prints: Some(key),
            defer: true,
        };
        let deferred = decode_page_hashed(body, &hashing);
        if let Ok(page) = &deferred {
            for record in &page.page.records {
                assert_eq!(record.print, Some(key.print(record.raw.as_bytes())));
            }
        }
        match (serde, &deferred) {
            (Ok(serde), Ok(deferred)) => {
                let all_valid = serde
                    .page
                    .records
                    .iter()
                    .all(|r| content_hash(r.raw.get(), ignore).is_ok());
                if all_valid {
                    assert_eq!(summary(serde), summary(deferred));
                }
            }
            (Err(_), Ok(deferred)) => assert!(
                deferred
                    .page
                    .records
                    .iter()
                    .any(|r| content_hash(r.raw.get(), ignore).is_err()),
                "a body serde refuses was read whole by the deferred decoding: {deferred:?}"
            ),
            (Err(serde), Err(deferred)) => assert_eq!(serde, deferred),
            (Ok(_), Err(deferred)) => panic!("the deferred decoding refused a page: {deferred}"),
        }
    }

    #[test]
    fn a_deferred_page_is_delimited_unhashed_and_printed() {
        let body = Bytes::from_static(
            br#"{"data":[{"title":"B","id":2,"updated_at":"2024-01-01T00:00:00Z","n":{"b":"}","a":[2]}},
            {"id":3,"s":"\"{"}],"next_cursor":null,"server_time":"2024-01-02T03:04:06Z"}"#,
        );
        let ignore = Arc::new(IgnoreKeys::new(["updated_at"]));
        let key = PrintKey::new(&SECRET, &ignore);
        let hashing = Hashing {
            ignore: ignore.clone(),
            prints: Some(key),
            defer: true,
        };
        let page = decode_page_hashed(&body, &hashing).unwrap().page;
        let ids: Vec<i64> = page.records.iter().map(|r| r.id).collect();
        assert_eq!(ids, [2, 3]);
        assert_eq!(page.records[1].raw.get(), r#"{"id":3,"s":"\"{"}"#);
        for record in &page.records {
            assert!(record.hashed.is_none(), "deferred: no content hash yet");
            assert_eq!(record.print, Some(key.print(record.raw.as_bytes())));
        }
        // Without `defer` the same page is hashed in the pass, and printed too.
        let eager = Hashing {
            defer: false,
            ..hashing
        };
        for record in &decode_page_hashed(&body, &eager).unwrap().page.records {
            let pre = record.hashed.as_ref().expect("hashed in the one pass");
            assert_eq!(pre.hash, content_hash(record.raw.get(), &ignore).unwrap());
            assert_eq!(record.print, Some(key.print(record.raw.as_bytes())));
        }
    }

    #[test]
    fn a_deferred_page_with_an_invalid_record_leaves_it_to_fail_its_parse() {
        let body = br#"{"data":[{"id":1,"x":tru},{"id":2}],"next_cursor":null,"server_time":"2024-01-02T03:04:06Z"}"#;
        assert!(
            decode(body).is_err(),
            "serde and the hashed decoding refuse it"
        );
        let ignore = Arc::new(IgnoreKeys::new(["updated_at"]));
        let hashing = Hashing {
            ignore: ignore.clone(),
            prints: Some(PrintKey::new(&SECRET, &ignore)),
            defer: true,
        };
        let page = decode_page_hashed(&Bytes::from_static(body), &hashing)
            .unwrap()
            .page;
        let ids: Vec<i64> = page.records.iter().map(|r| r.id).collect();
        assert_eq!(ids, [1, 2]);
        assert!(page.records[0].content_hash(&ignore).is_err());
        assert!(page.records[1].content_hash(&ignore).is_ok());
    }

    #[test]
    fn a_page_keeps_every_record_byte_for_byte_with_unknown_fields() {
        let body = br#"{"data":[{"id":1,"title":"A","future_field":{"x":[1,2.50]},"updated_at":"2024-01-02T03:04:05.000000Z"},
            {"updated_at":null,"id":2}],"next_cursor":"abc==","server_time":"2024-01-02T03:04:06Z","extra":true}"#;
        let decoded = decode(body).unwrap();
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
        let decoded = decode(body).unwrap();
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
        let page = decode(body).unwrap().page;
        assert_eq!(page.records[0].updated_at, None);
        assert_eq!(
            page.records[1].updated_at.as_deref(),
            Some("2024-01-01T00:00:00Z")
        );
    }

    #[test]
    fn a_plain_page_is_read_once_its_records_hashed_and_sliced_from_the_body() {
        let body = Bytes::from_static(
            br#" { "next_cursor" : "c1" , "meta":{"x":[1,{"y":"}"}]},
            "data" : [ {"title":"B","id":2,"updated_at":"2024-01-01T00:00:00Z","n":{"b":1,"a":2}} ,
            {"id":3} ] , "server_time":"2024-01-02T03:04:06Z" } "#,
        );
        let ignore = Arc::new(IgnoreKeys::new(["updated_at"]));
        let page = decode_page_hashed(&body, &Hashing::eager(ignore.clone()))
            .unwrap()
            .page;
        assert_eq!(page.records.len(), 2);
        for record in &page.records {
            let pre = record.hashed.as_ref().expect("hashed in the one pass");
            assert!(Arc::ptr_eq(&pre.ignore, &ignore));
            assert_eq!(pre.hash, content_hash(record.raw.get(), &ignore).unwrap());
            // A slice of the body, not a copy.
            let start = record.raw.as_bytes().as_ptr() as usize - body.as_ptr() as usize;
            assert!(start + record.raw.as_bytes().len() <= body.len());
        }
        assert_eq!(page.records[0].id, 2);
        assert_eq!(
            page.records[0].updated_at.as_deref(),
            Some("2024-01-01T00:00:00Z")
        );
        assert_eq!(page.records[1].raw.get(), r#"{"id":3}"#);
        assert_eq!(page.next_cursor.as_deref(), Some("c1"));
        // A hash computed without other keys is not reused.
        let other = IgnoreKeys::none();
        assert_eq!(
            page.records[0].content_hash(&other).unwrap(),
            content_hash(page.records[0].raw.get(), &other).unwrap()
        );
        assert_ne!(
            page.records[0].content_hash(&other).unwrap(),
            page.records[0].content_hash(&ignore).unwrap()
        );
    }

    #[test]
    fn pages_the_one_pass_leaves_to_serde_decode_as_serde_decodes_them() {
        for body in [
            // An escaped top-level key, a repeated id, a record that is no object.
            &br#"{"data":[{"i\u0064":1},{"id":2,"id":3},[1],{"id":4}],"next_cursor":null,"server_time":"2024-01-02T03:04:06Z"}"#[..],
            // A number the canonical form refuses (serde reads it): hashed later, and failing there.
            br#"{"data":[{"id":1,"x":1e99999999999999999999}],"next_cursor":null,"server_time":"2024-01-02T03:04:06Z"}"#,
            // An envelope key given twice, an escaped envelope key.
            br#"{"data":[],"data":[],"next_cursor":null,"server_time":"2024-01-02T03:04:06Z"}"#,
            br#"{"d\u0061ta":[{"id":1}],"data":[],"next_cursor":null,"server_time":"2024-01-02T03:04:06Z"}"#,
            // Broken records and members the one pass finds broken first.
            br#"{"data":[{"id":1,"x":01}],"next_cursor":null,"server_time":"2024-01-02T03:04:06Z"}"#,
            br#"{"meta":[1,],"data":[{"id":1}],"next_cursor":null,"server_time":"2024-01-02T03:04:06Z"}"#,
            br#"{"data":[{"id":1}],"next_cursor":null,"server_time":"2024-01-02T03:04:06Z"} x"#,
            br#"{"data":[{"id":1,"s":"\ud800"}],"next_cursor":7,"server_time":"2024-01-02T03:04:06Z"}"#,
            br#"{"data":[{"id":1,"s":"\ud800"}],"next_cursor":"a","server_time":"2024-01-02T03:04:06Z"}"#,
            b"{\"data\":[{\"id\":1,\"s\":\"\xff\"}],\"next_cursor\":null,\"server_time\":\"2024-01-02T03:04:06Z\"}",
        ] {
            // `decode` checks that both decodings agree.
            let _ = decode(body);
        }
        let lone = decode(br#"{"data":[{"id":1,"s":"\ud800"}],"next_cursor":"a","server_time":"2024-01-02T03:04:06Z"}"#);
        assert_eq!(lone.unwrap().page.records[0].id, 1);
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
            let err = decode(body).unwrap_err();
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
