//! What one page (or one chunk of deletes) publishes and commits, decided
//! without I/O.
//!
//! [`plan_page`] turns a listed page and what the store knows about its
//! records into the changes to publish: a record listed twice counts once,
//! as its last version; each record's content hash is compared with its
//! committed state, its pending intent and its tombstone
//! ([`crate::diff::plan_change`]). The effectful half (journal, publish,
//! await the acks, commit) is in the sweep; everything here is tested without
//! a store or a sink.

use chrono::{DateTime, Utc};
use serde_json::value::RawValue;

use super::SweepError;
use crate::diff::{plan_change, Change, Known};
use crate::event::{
    self, format_micros, updated_at_micros, Event, Op, RecordChange, VersionAttributes,
};
use crate::hash::{content_hash, ContentHash, IgnoreKeys};
use crate::planner::history::ChangeHistory;
use crate::schema::SchemaBase;
use crate::state::{
    id_map_with_capacity, IdMap, Intent, RecordState, Reprint, SweepPlan, Tombstone,
};
use crate::stream::StreamKey;
use crate::upstream::page::Record;

/// What the store knows about the records of one page.
#[derive(Debug, Clone, Default)]
pub struct KnownRecords {
    /// Committed state, by record id.
    pub committed: IdMap<RecordState>,
    /// Pending intents (what downstream may have seen beyond the committed hashes), by record id.
    pub intents: IdMap<Intent>,
    /// Tombstones of earlier incarnations, by record id.
    pub tombstones: IdMap<Tombstone>,
}

impl KnownRecords {
    fn known(&self, id: i64) -> Known {
        Known {
            committed: self.committed.get(&id).copied(),
            intent: self.intents.get(&id).copied(),
            tombstone: self.tombstones.get(&id).copied(),
        }
    }
}

/// The records of a page with each id once, as its last version, in the
/// order of those last versions.
pub fn dedupe(records: &[Record]) -> Vec<&Record> {
    let mut last_index: IdMap<usize> = id_map_with_capacity(records.len());
    for (i, r) in records.iter().enumerate() {
        last_index.insert(r.id, i);
    }
    records
        .iter()
        .enumerate()
        .filter(|(i, r)| last_index.get(&r.id) == Some(i))
        .map(|(_, r)| r)
        .collect()
}

/// A listed record whose change the page publishes.
#[derive(Debug, Clone)]
pub struct PendingChange<'a> {
    /// The record as listed.
    pub record: &'a Record,
    /// Its content hash.
    pub hash: ContentHash,
    /// The decision: op, previous hash, generation, sequence, replay.
    pub change: Change,
    /// Its `updated_at` in unix microseconds, when readable.
    pub updated_at_micros: Option<i64>,
}

impl PendingChange<'_> {
    /// The journal entry: every input of the event id, so a re-publish keeps it.
    pub fn intent(&self) -> Intent {
        Intent {
            hash: self.hash,
            updated_at: self.updated_at_micros,
            generation: self.change.generation,
            seq: self.change.seq,
            op: Some(self.change.op),
            previous: self.change.previous,
            replay: self.change.replay,
        }
    }

    /// The event downstream gets, with what it says about the previous version.
    pub fn event(
        &self,
        stream: StreamKey,
        detected_at: DateTime<Utc>,
        schema_base: &SchemaBase,
        version: VersionAttributes<'_>,
    ) -> Event {
        let change = RecordChange {
            stream,
            record_id: self.record.id,
            generation: self.change.generation,
            seq: self.change.seq,
            op: self.change.op,
            updated_at: self.record.updated_at.as_deref(),
            content_hash: self.hash,
            previous_hash: self.change.previous,
            replay: self.change.replay,
            data: self.record.raw.get(),
            detected_at,
            schema_base,
        };
        event::record_event_with(&change, version)
    }

    /// The committed state once the event is acknowledged.
    pub fn commit(&self, epoch: u64) -> (i64, RecordState) {
        (
            self.record.id,
            RecordState {
                hash: self.hash,
                updated_at: self.updated_at_micros,
                seen_epoch: epoch,
                generation: self.change.generation,
                seq: self.change.seq,
                print: self.record.print,
            },
        )
    }
}

/// What one page publishes, and what it only marks as seen.
#[derive(Debug, Clone, Default)]
pub struct PagePlan<'a> {
    /// Records to publish, in page order.
    pub changes: Vec<PendingChange<'a>>,
    /// Ids of records listed unchanged.
    pub unchanged: Vec<i64>,
    /// Unchanged records whose print differs from their committed state's
    /// (none stored, or one of older bytes): the print to store with it.
    pub reprints: Vec<(i64, Reprint)>,
}

impl PagePlan<'_> {
    /// How many of its changes are creates or updates of records whose
    /// `updated_at` is after `after` (the stream's previous watermark):
    /// changes the upstream announced since the last listing, not silent
    /// ones the lookback overlap caught (see `SweepReport::announced`).
    pub fn announced(&self, after: Option<DateTime<Utc>>) -> u64 {
        let Some(after) = after.map(|t| t.timestamp_micros()) else {
            return 0;
        };
        self.changes
            .iter()
            .filter(|c| matches!(c.change.op, Op::Create | Op::Update))
            .filter(|c| c.updated_at_micros.is_some_and(|at| at > after))
            .count() as u64
    }

    /// The change history its records' `updated_at` values show, listed at
    /// `listed_at` (what a first sync tells the planner; see
    /// [`ChangeHistory`]).
    pub fn history(&self, listed_at: DateTime<Utc>) -> ChangeHistory {
        let listed_at = listed_at.timestamp_micros();
        let mut history = ChangeHistory::default();
        for c in &self.changes {
            history.add(c.updated_at_micros, listed_at);
        }
        history
    }
}

/// Plans one page of a sweep run as `plan` says, against what the store knows.
pub fn plan_page<'a>(
    records: &'a [Record],
    known: &KnownRecords,
    plan: &SweepPlan,
    ignore: &IgnoreKeys,
) -> Result<PagePlan<'a>, SweepError> {
    let mut page = PagePlan::default();
    for record in dedupe(records) {
        let known = known.known(record.id);
        let hash = match printed_hash(record, known.committed.as_ref(), ignore) {
            Some(hash) => hash,
            None => record
                .content_hash(ignore)
                .map_err(|source| SweepError::Hash {
                    record_id: record.id,
                    source,
                })?,
        };
        match plan_change(&known, hash, plan.mode, plan.replay, plan.epoch) {
            None => {
                page.unchanged.push(record.id);
                if let Some(reprint) = reprint(record, hash, known.committed.as_ref()) {
                    page.reprints.push((record.id, reprint));
                }
            }
            Some(change) => page.changes.push(PendingChange {
                record,
                hash,
                change,
                updated_at_micros: record.updated_at.as_deref().and_then(updated_at_micros),
            }),
        }
    }
    Ok(page)
}

/// The content hash of a record its page left unhashed (a full sweep's
/// deferred decoding), without a parse: the committed one, when the
/// committed state was made from the same bytes (equal raw prints, made
/// under the same key: the store's secret and the same ignore keys). None
/// for a record hashed when its page was read: that hash is the record's
/// own, and a print is only ever trusted where nothing else was computed.
fn printed_hash(
    record: &Record,
    committed: Option<&RecordState>,
    ignore: &IgnoreKeys,
) -> Option<ContentHash> {
    if record.prehashed(ignore).is_some() {
        return None;
    }
    let committed = committed?;
    (record.print.is_some() && committed.print == record.print).then_some(committed.hash)
}

/// The print to store for an unchanged `record` whose content hash is
/// `hash`: its own, when the committed state has that hash and another print.
fn reprint(record: &Record, hash: ContentHash, committed: Option<&RecordState>) -> Option<Reprint> {
    let print = record.print?;
    let committed = committed?;
    (committed.hash == hash && committed.print != Some(print)).then_some(Reprint { hash, print })
}

/// A record a full sweep will delete, with the last version possibly published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Doomed {
    /// The record id.
    pub id: i64,
    generation: u32,
    last_hash: ContentHash,
    updated_at: Option<i64>,
    seq: u64,
    replay: Option<[u8; 16]>,
}

impl Doomed {
    /// The delete of a record that is `committed` (or only journalled), given
    /// its pending intent: a journalled delete is re-published exactly; an
    /// upsert intent is the last version downstream may have seen.
    pub fn new(
        id: i64,
        committed: Option<&RecordState>,
        intent: Option<&Intent>,
        replay: Option<[u8; 16]>,
    ) -> Self {
        let committed_seq = committed.map_or(0, |r| r.seq);
        match (intent, committed) {
            (Some(i), _) if i.is_delete() => Self {
                id,
                generation: i.generation,
                last_hash: i.hash,
                updated_at: i.updated_at,
                seq: i.seq,
                replay: i.replay,
            },
            (Some(i), _) => Self {
                id,
                generation: i.generation,
                last_hash: i.hash,
                updated_at: i.updated_at,
                seq: i.seq.max(committed_seq).saturating_add(1),
                replay,
            },
            (None, Some(r)) => Self {
                id,
                generation: r.generation,
                last_hash: r.hash,
                updated_at: r.updated_at,
                seq: r.seq.saturating_add(1),
                replay,
            },
            // Not reachable: a doomed record is committed or journalled.
            (None, None) => Self {
                id,
                generation: 0,
                last_hash: ContentHash([0; 16]),
                updated_at: None,
                seq: 1,
                replay,
            },
        }
    }

    /// The journal entry of the delete (its `hash` is the last version's).
    pub fn intent(&self) -> Intent {
        Intent {
            hash: self.last_hash,
            updated_at: self.updated_at,
            generation: self.generation,
            seq: self.seq,
            op: Some(Op::Delete),
            previous: None,
            replay: self.replay,
        }
    }

    /// The content hash of the last version possibly published (the delete's `previoushash`).
    pub fn last_hash(&self) -> ContentHash {
        self.last_hash
    }

    /// The `*.deleted` event: `data` is `{"id":N}`, `previoushash` the last
    /// hash, `before` (`events.before`) that version's JSON when known.
    pub fn event(
        &self,
        stream: StreamKey,
        detected_at: DateTime<Utc>,
        ignore: &IgnoreKeys,
        schema_base: &SchemaBase,
        before: Option<&str>,
    ) -> Result<Event, SweepError> {
        let data = delete_data(self.id);
        let hash = content_hash(data.get(), ignore).map_err(|source| SweepError::Hash {
            record_id: self.id,
            source,
        })?;
        let updated_at = self.updated_at.and_then(format_micros);
        let version = VersionAttributes {
            changed_fields: None,
            before,
        };
        Ok(event::record_event_with(
            &RecordChange {
                stream,
                record_id: self.id,
                generation: self.generation,
                seq: self.seq,
                op: Op::Delete,
                updated_at: updated_at.as_deref(),
                content_hash: hash,
                previous_hash: Some(self.last_hash),
                replay: self.replay,
                data: data.get(),
                detected_at,
                schema_base,
            },
            version,
        ))
    }

    /// The tombstone: the next incarnation of this id starts a new generation.
    pub fn tombstone(&self) -> (i64, Tombstone) {
        (
            self.id,
            Tombstone {
                generation: self.generation.saturating_add(1),
                last_hash: self.last_hash,
                updated_at: self.updated_at,
            },
        )
    }
}

/// The `data` of a delete event: just the record id.
fn delete_data(id: i64) -> Box<RawValue> {
    RawValue::from_string(format!("{{\"id\":{id}}}")).unwrap_or_else(|_| RawValue::NULL.to_owned())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::diff::SweepMode;
    use crate::state::ledger::plan_sweep;
    use crate::state::{StreamState, SweepKind};
    use crate::upstream::page::RawJson;

    fn record(id: i64, title: &str) -> Record {
        let raw = format!(r#"{{"id":{id},"title":"{title}","updated_at":"2026-01-01T00:00:00Z"}}"#);
        Record::new(
            id,
            Some("2026-01-01T00:00:00Z".into()),
            RawJson::from_string(raw).unwrap(),
        )
    }

    fn ignore() -> IgnoreKeys {
        IgnoreKeys::new(["updated_at"])
    }

    fn synced() -> SweepPlan {
        let state = StreamState {
            watermark: DateTime::from_timestamp(1_700_000_000, 0),
            full_sweep_epoch: 2,
            ..StreamState::default()
        };
        plan_sweep(&state, SweepKind::Incremental, Duration::from_secs(60))
    }

    fn committed(r: &Record, seq: u64) -> RecordState {
        RecordState {
            hash: content_hash(r.raw.get(), &ignore()).unwrap(),
            updated_at: r.updated_at.as_deref().and_then(updated_at_micros),
            seen_epoch: 2,
            generation: 0,
            seq,
            print: None,
        }
    }

    /// `r` with its raw print under a test store's key.
    fn printed(r: Record) -> Record {
        let key = crate::hash::PrintKey::new(b"page-plan-secret", &ignore());
        Record {
            print: Some(key.print(r.raw.as_bytes())),
            ..r
        }
    }

    #[test]
    fn a_record_printed_as_its_committed_state_takes_that_hash_and_any_other_is_parsed() {
        // 4 was hashed when its page was read (incremental sweeps do): its
        // own hash counts, whatever its print.
        let hashed = |r: Record| {
            let hash = content_hash(r.raw.get(), &ignore()).unwrap();
            let ignore = std::sync::Arc::new(ignore());
            let hashed = Some(crate::upstream::page::Prehashed { ignore, hash });
            Record { hashed, ..r }
        };
        let listed = [
            printed(record(1, "a")),
            printed(record(2, "b")),
            record(3, "c"),
            hashed(printed(record(4, "d"))),
        ];
        // Each committed state claims a hash no parse of its record gives:
        // only a record that skipped the parse is planned as unchanged.
        let stale = ContentHash([0xee; 16]);
        let mut known = KnownRecords::default();
        for r in &listed {
            let state = RecordState {
                hash: stale,
                ..committed(r, 1)
            };
            known.committed.insert(r.id, state);
        }
        // 1 was committed from these very bytes; 2 from other bytes (the
        // print of "B"); 3 has no print.
        let one = known.committed.get_mut(&1).unwrap();
        one.print = listed[0].print;
        let other = printed(record(2, "B"));
        known.committed.get_mut(&2).unwrap().print = other.print;
        known.committed.get_mut(&4).unwrap().print = listed[3].print;
        let page = plan_page(&listed, &known, &synced(), &ignore()).unwrap();
        assert_eq!(page.unchanged, vec![1]);
        assert!(page.reprints.is_empty(), "1 already has its print");
        let changed: Vec<(i64, ContentHash)> =
            page.changes.iter().map(|c| (c.record.id, c.hash)).collect();
        let parsed = |r: &Record| content_hash(r.raw.get(), &ignore()).unwrap();
        assert_eq!(
            changed,
            vec![
                (2, parsed(&listed[1])),
                (3, parsed(&listed[2])),
                (4, parsed(&listed[3]))
            ]
        );
        // A change commits the print of the bytes its hash was computed from.
        assert_eq!(page.changes[0].commit(3).1.print, listed[1].print);
        assert_eq!(page.changes[1].commit(3).1.print, None);
    }

    #[test]
    fn an_unchanged_record_printed_otherwise_than_its_committed_state_is_reprinted() {
        // 1: committed without a print; 2: with the print of other bytes of
        // the same content (a touch moved its updated_at, which the hash
        // ignores); 3: with its own print; 4: without a print of its own.
        let touched = |id: i64| {
            let at = "2027-02-02T00:00:00Z";
            let raw = format!(r#"{{"id":{id},"title":"b","updated_at":"{at}"}}"#);
            Record::new(id, Some(at.into()), RawJson::from_string(raw).unwrap())
        };
        let listed = [
            printed(record(1, "a")),
            printed(touched(2)),
            printed(record(3, "c")),
            record(4, "d"),
        ];
        let mut known = KnownRecords::default();
        for r in &listed {
            known.committed.insert(r.id, committed(r, 1));
        }
        known.committed.get_mut(&2).unwrap().print = printed(record(2, "b")).print;
        known.committed.get_mut(&3).unwrap().print = listed[2].print;
        let page = plan_page(&listed, &known, &synced(), &ignore()).unwrap();
        assert!(page.changes.is_empty());
        let parsed = |r: &Record| content_hash(r.raw.get(), &ignore()).unwrap();
        let expected: Vec<(i64, Reprint)> = listed[..2]
            .iter()
            .map(|r| {
                let reprint = Reprint {
                    hash: parsed(r),
                    print: r.print.unwrap(),
                };
                (r.id, reprint)
            })
            .collect();
        assert_eq!(page.reprints, expected);
    }

    #[test]
    fn only_creates_and_updates_newer_than_the_previous_watermark_count_as_announced() {
        let old = |id: i64, title: &str| {
            let at = "2023-01-01T00:00:00Z";
            let raw = format!(r#"{{"id":{id},"title":"{title}","updated_at":"{at}"}}"#);
            Record::new(id, Some(at.into()), RawJson::from_string(raw).unwrap())
        };
        let before = vec![record(1, "a"), old(2, "b"), record(3, "c")];
        let mut known = KnownRecords::default();
        for r in &before {
            known.committed.insert(r.id, committed(r, 1));
        }
        // 1 updated and newer than the watermark; 2 changed silently (an
        // old updated_at); 3 unchanged; 4 created and newer.
        let now = vec![record(1, "A"), old(2, "B"), record(3, "c"), record(4, "d")];
        let plan = synced();
        assert!(plan.announced_after.is_some());
        let page = plan_page(&now, &known, &plan, &ignore()).unwrap();
        assert_eq!(page.changes.len(), 3);
        assert_eq!(page.announced(plan.announced_after), 2);
        let first_sync = plan_sweep(
            &StreamState::default(),
            SweepKind::Incremental,
            Duration::ZERO,
        );
        assert_eq!(first_sync.announced_after, None);
        assert_eq!(page.announced(first_sync.announced_after), 0);
    }

    #[test]
    fn a_record_listed_twice_in_a_page_counts_once_as_its_last_version() {
        let records = vec![record(1, "a"), record(2, "b"), record(1, "c")];
        let ids: Vec<i64> = dedupe(&records).iter().map(|r| r.id).collect();
        assert_eq!(ids, vec![2, 1]);
        let page = plan_page(&records, &KnownRecords::default(), &synced(), &ignore()).unwrap();
        assert_eq!(page.changes.len(), 2);
        let last = &page.changes[1];
        assert_eq!(last.record.id, 1);
        assert!(last.record.raw.get().contains("\"c\""));
        assert_eq!(last.change.op, Op::Create);
    }

    #[test]
    fn unchanged_records_are_only_marked_seen_and_changed_ones_update_with_the_next_sequence() {
        let before = vec![record(1, "a"), record(2, "b")];
        let mut known = KnownRecords::default();
        for r in &before {
            known.committed.insert(r.id, committed(r, 3));
        }
        let now = vec![record(1, "a"), record(2, "B")];
        let page = plan_page(&now, &known, &synced(), &ignore()).unwrap();
        assert_eq!(page.unchanged, vec![1]);
        assert!(page.reprints.is_empty(), "records listed without a print");
        assert_eq!(page.changes.len(), 1);
        let change = &page.changes[0];
        assert_eq!(change.change.op, Op::Update);
        assert_eq!(change.change.seq, 4);
        assert_eq!(change.change.previous, Some(committed(&before[1], 3).hash));
        let (id, state) = change.commit(2);
        assert_eq!(id, 2);
        assert_eq!(state.seq, 4);
        assert_eq!(state.hash, change.hash);
        assert_eq!(change.intent().hash, change.hash);
        assert_eq!(change.intent().op, Some(Op::Update));
    }

    #[test]
    fn a_record_with_a_tombstone_comes_back_as_a_create_of_the_next_generation() {
        let r = record(5, "x");
        let mut known = KnownRecords::default();
        known.tombstones.insert(
            5,
            Tombstone {
                generation: 2,
                last_hash: ContentHash([9; 16]),
                updated_at: None,
            },
        );
        let page = plan_page(std::slice::from_ref(&r), &known, &synced(), &ignore()).unwrap();
        assert_eq!(page.changes[0].change.op, Op::Create);
        assert_eq!(page.changes[0].change.generation, 2);
    }

    #[test]
    fn a_first_sync_emits_snapshots() {
        let plan = plan_sweep(
            &StreamState::default(),
            SweepKind::Incremental,
            Duration::ZERO,
        );
        assert_eq!(plan.mode, SweepMode::FirstSync);
        let records = vec![record(1, "a")];
        let page = plan_page(&records, &KnownRecords::default(), &plan, &ignore()).unwrap();
        assert_eq!(page.changes[0].change.op, Op::Snapshot);
    }

    #[test]
    fn a_record_that_cannot_be_hashed_names_its_id() {
        let bad = Record::new(
            7,
            None,
            RawJson::from_string(format!("{}{}", "[".repeat(200), "]".repeat(200))).unwrap(),
        );
        let err = plan_page(
            std::slice::from_ref(&bad),
            &KnownRecords::default(),
            &synced(),
            &ignore(),
        )
        .unwrap_err();
        assert!(err.to_string().starts_with("record 7:"), "{err}");
    }

    #[test]
    fn a_doomed_record_deletes_its_last_possibly_published_version() {
        let r = record(3, "a");
        let committed = committed(&r, 4);
        let upsert = Intent {
            hash: ContentHash([7; 16]),
            updated_at: None,
            generation: 1,
            seq: 6,
            op: Some(Op::Update),
            previous: Some(committed.hash),
            replay: None,
        };
        let from_intent = Doomed::new(3, Some(&committed), Some(&upsert), None);
        assert_eq!(from_intent.intent().hash, upsert.hash);
        assert_eq!(from_intent.intent().seq, 7);
        assert_eq!(from_intent.tombstone().1.generation, 2);
        let from_commit = Doomed::new(3, Some(&committed), None, None);
        assert_eq!(from_commit.intent().hash, committed.hash);
        assert_eq!(from_commit.intent().seq, 5);
        // A journalled delete is re-published exactly as it was.
        let journalled = from_commit.intent();
        let again = Doomed::new(3, Some(&committed), Some(&journalled), Some([1; 16]));
        assert_eq!(again, from_commit);
    }
}
