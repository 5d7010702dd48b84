//! Durable sync state: what the bridge knows about every stream and record.
//!
//! The sweep reads and writes state only through [`StateStore`], so the
//! crash-safety rules of DESIGN.md ("State and the sweep") live in one place:
//! intents are journalled before a publish, hashes are committed only after
//! the sink acknowledged, and every multi-record change is one atomic batch.
//! The production implementation is [`SledStore`]; docs/state.md describes
//! its on-disk layout.

mod acked;
mod codec;
mod fresh;
mod journal;
pub mod ledger;
mod marks;
mod sled_store;

use std::path::PathBuf;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::event::Op;
use crate::hash::{ContentHash, FieldHashes, RawPrint, PRINT_SECRET_LEN};
use crate::stream::StreamKey;

pub use acked::{Acked, DeleteCommit, Delivery, NotAcknowledged, PageCommit, Reprint};
pub use ledger::{StreamLedger, SweepKind, SweepPlan};
pub use sled_store::{SledStore, StreamDump, CACHE_CAPACITY, LAYOUT_MARKER, LAYOUT_VERSION};

/// A hash map keyed by record id, for the indexes on the per-record path: a
/// page's dedupe and known records, the store's span scans, the journal's
/// index of pending intents (a page's worth per page in flight, more only
/// after failed publishes, until the next full sweep). foldhash instead of
/// the standard SipHash, which cost about 140 instructions an id and about
/// 11 hashes a synced record. Each map draws its own random seed, so a set of
/// colliding ids cannot be chosen in advance (and ids come from the
/// authenticated upstream). Maps built once per full sweep keep the
/// standard hasher: their speed does not matter.
pub type IdMap<V> = std::collections::HashMap<i64, V, foldhash::fast::RandomState>;

/// A set of record ids, hashed as [`IdMap`] hashes them.
pub type IdSet = std::collections::HashSet<i64, foldhash::fast::RandomState>;

/// An empty [`IdMap`] with room for `capacity` ids.
pub fn id_map_with_capacity<V>(capacity: usize) -> IdMap<V> {
    IdMap::with_capacity_and_hasher(capacity, Default::default())
}

/// A scheduled or running replay of one stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplayState {
    /// Replay id carried by every event of the replay.
    pub id: String,
    /// `--since`: the watermark the replay restarts from (None = everything).
    pub since: Option<DateTime<Utc>>,
    /// When the replay was requested.
    pub requested_at: DateTime<Utc>,
    /// True until the replay sweep completed.
    pub pending: bool,
    /// Records emitted by the replay so far.
    pub records: u64,
    /// The epoch the replay's records are committed with, fixed when its
    /// first sweep starts: a replay resumed after a crash or shutdown skips
    /// the records it already emitted (same epoch, same hash) instead of
    /// emitting them again.
    #[serde(default)]
    pub epoch: Option<u64>,
    /// Who asked for the replay (None: a store written before this was recorded).
    #[serde(default)]
    pub requested_by: Option<RequestedBy>,
    /// The stream's watermark when the replay was scheduled: a cancelled
    /// replay puts it back, so the stream goes on from where it was.
    #[serde(default)]
    pub previous_watermark: Option<DateTime<Utc>>,
    /// When the replay was cancelled (it then is no longer pending).
    #[serde(default)]
    pub cancelled_at: Option<DateTime<Utc>>,
}

/// Who asked for an operator action: the CLI on the store, or the admin API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RequestedBy {
    /// The `voucher-cdc` command, writing the store directly.
    Cli,
    /// The daemon's admin API (the CLI goes through it while a daemon runs).
    Api,
}

impl RequestedBy {
    /// `cli` or `api`.
    pub fn as_str(self) -> &'static str {
        match self {
            RequestedBy::Cli => "cli",
            RequestedBy::Api => "api",
        }
    }
}

/// An operator's pause of a stream: it is not swept until resumed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pause {
    /// When the stream was paused.
    pub since: DateTime<Utc>,
    /// Who paused it.
    pub by: RequestedBy,
}

/// Per-stream state; `Default` means "never synced".
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct StreamState {
    /// Server time of the first page of the last completed sweep.
    pub watermark: Option<DateTime<Utc>>,
    /// The current or last replay.
    pub replay: Option<ReplayState>,
    /// Epoch of the latest full sweep (records seen by it carry this epoch).
    pub full_sweep_epoch: u64,
    /// When the last sweep started.
    pub last_sweep_started: Option<DateTime<Utc>>,
    /// When the last sweep finished successfully.
    pub last_sweep_finished: Option<DateTime<Utc>>,
    /// When the last full sweep finished successfully.
    pub last_full_sweep_finished: Option<DateTime<Utc>>,
    /// The last error the stream hit, one line.
    pub last_error: Option<String>,
    /// When `last_error` happened.
    pub last_error_at: Option<DateTime<Utc>>,
    /// Why the stream is parked (401/403/404), None when it runs.
    pub parked: Option<String>,
    /// Records whose hash the store knows.
    pub records_known: u64,
    /// Full sweeps (not replays) failed in a row since the last one that completed.
    pub full_sweep_failures: u32,
    /// After a failed full sweep: no full sweep before this time (incremental
    /// sweeps go on meanwhile), so a failing full listing does not spend the
    /// shared budget on every poll.
    pub full_sweep_retry_at: Option<DateTime<Utc>>,
    /// Set while an operator paused the stream: no sweep and no upstream
    /// request until it is resumed; survives restarts.
    pub paused: Option<Pause>,
}

/// What the store knows about one committed record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordState {
    /// Content hash of the last acknowledged version.
    pub hash: ContentHash,
    /// The record's `updated_at` in unix microseconds, if it had one.
    pub updated_at: Option<i64>,
    /// Epoch of the last full sweep that listed the record.
    pub seen_epoch: u64,
    /// How many deletes of this record id were seen before.
    pub generation: u32,
    /// Change sequence of the last committed change (part of the event id:
    /// a record flipping A→B→A→B gets a new id for the second A→B).
    pub seq: u64,
    /// The raw print of the bytes `hash` was computed from, under the store's
    /// print key when they were listed (`hash/print.rs`); None when unknown.
    /// It belongs to this store's secret, so exports leave it out.
    #[serde(skip)]
    pub print: Option<RawPrint>,
}

/// A journalled publish: the change may have reached the sink, it is not committed yet.
///
/// It holds every input of the event's id, so a re-publish after a crash
/// carries exactly the id the first publish had.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Intent {
    /// Upserts: content hash of the version being published. Deletes: the
    /// hash of the record's last version (the delete's `previoushash`).
    pub hash: ContentHash,
    /// The record's `updated_at` in unix microseconds, if any.
    pub updated_at: Option<i64>,
    /// Delete generation of the version being published.
    pub generation: u32,
    /// The change sequence this change commits as.
    pub seq: u64,
    /// The event's `op`; `None` for intents journalled by layout 1, which did not record it.
    pub op: Option<Op>,
    /// The event's `previoushash` (upserts only).
    pub previous: Option<ContentHash>,
    /// The replay id the event was published under, as 16 bytes.
    pub replay: Option<[u8; 16]>,
}

impl Intent {
    /// True for a journalled `*.deleted`.
    pub fn is_delete(&self) -> bool {
        self.op == Some(Op::Delete)
    }
}

/// A replay id (32 hex digits) as the 16 bytes an intent stores; None when it is not 32 hex digits.
pub fn replay_id_bytes(replay_id: &str) -> Option<[u8; 16]> {
    let mut out = [0u8; 16];
    hex::decode_to_slice(replay_id, &mut out).ok()?;
    Some(out)
}

/// A record committed as dead-lettered: its event was refused by the sink and
/// a dead letter went out in its place. Cleared when a later version of the
/// record commits normally (a content change or a replay) or the record is deleted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetter {
    /// When the record was dead-lettered.
    pub since: DateTime<Utc>,
    /// The sink's reason, one line.
    pub reason: String,
    /// The broker limit the event exceeded, in bytes, when known.
    #[serde(default)]
    pub limit: Option<u64>,
}

/// What the store keeps of a record's last committed version beyond its
/// hash, when `events.changed_fields` or `events.before` ask for it: the
/// previous version an `update` is compared with and a `delete` carries.
/// Written only with the acknowledged commit of that version, so it always
/// describes something the sink acknowledged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredVersion {
    /// The content hash of the version described; an event uses the rest only
    /// when its `previoushash` is this hash.
    pub hash: ContentHash,
    /// The hashes of its top-level fields (`events.changed_fields`).
    pub fields: Option<FieldHashes>,
    /// Its JSON text exactly as published in `data` (`events.before`).
    pub body: Option<String>,
}

/// What remains of a deleted record: enough to give a re-created record a new event id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tombstone {
    /// Generation the next version of this id must carry (deletes seen so far).
    pub generation: u32,
    /// Content hash of the last version before the delete.
    pub last_hash: ContentHash,
    /// `updated_at` of the last version, unix microseconds.
    pub updated_at: Option<i64>,
}

/// Why the state store failed; every message is one line naming the path.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// Another process holds the store's lock.
    #[error(
        "state store {} is locked by another process (a voucher-cdc daemon probably runs on it; \
         `status` and `replay` go through its admin API, or stop it, or point state.path elsewhere)",
        path.display()
    )]
    Locked {
        /// The store directory.
        path: PathBuf,
    },
    /// The store was written by a layout this build cannot read.
    #[error(
        "state store {} was written by layout version {found}; this build reads version {supported} \
         (upgrade voucher-cdc or point state.path elsewhere)",
        path.display()
    )]
    UnsupportedVersion {
        /// The store directory.
        path: PathBuf,
        /// Layout version found in the store.
        found: u32,
        /// Layout version this build reads and writes.
        supported: u32,
    },
    /// The store's files or values are damaged.
    #[error(
        "state store {} is corrupt: {detail} (restore it from a backup, or move it away to resync \
         every stream as a snapshot)",
        path.display()
    )]
    Corrupt {
        /// The store directory.
        path: PathBuf,
        /// What was found damaged.
        detail: String,
    },
    /// The operating system refused access to the store's files.
    #[error(
        "state store {}: permission denied: {source} (run voucher-cdc as a user that may write \
         there, or point state.path elsewhere)",
        path.display()
    )]
    PermissionDenied {
        /// The store directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Any other I/O failure (disk full, path is a file, ...).
    #[error("state store {}: i/o error: {source}", path.display())]
    Io {
        /// The store directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The store backend reported an internal error or an unsupported use.
    #[error("state store {}: {detail}", path.display())]
    Backend {
        /// The store directory.
        path: PathBuf,
        /// The backend's message.
        detail: String,
    },
}

/// Durable state of every stream and record (one writer per stream at a time).
pub trait StateStore: Send + Sync + 'static {
    /// The stream's state; `StreamState::default()` when the stream was never synced.
    fn load_stream(&self, key: StreamKey) -> Result<StreamState, StateError>;
    /// Replaces the stream's state.
    fn save_stream(&self, key: StreamKey, state: &StreamState) -> Result<(), StateError>;
    /// Every stream with saved state, in key order.
    fn streams(&self) -> Result<Vec<(StreamKey, StreamState)>, StateError>;
    /// The committed state of each id, in the order of `ids`.
    fn get_records(
        &self,
        key: StreamKey,
        ids: &[i64],
    ) -> Result<Vec<Option<RecordState>>, StateError>;
    /// The tombstone of each id, in the order of `ids`.
    fn get_tombstones(
        &self,
        key: StreamKey,
        ids: &[i64],
    ) -> Result<Vec<Option<Tombstone>>, StateError>;
    /// Journals intents before a publish, as one atomic batch, and makes them
    /// durable (fsync) before returning: the caller publishes right after.
    fn write_intents(&self, key: StreamKey, intents: &[(i64, Intent)]) -> Result<(), StateError>;
    /// Intents not yet cleared by a commit or delete, in id order.
    fn pending_intents(&self, key: StreamKey) -> Result<Vec<(i64, Intent)>, StateError>;
    /// One atomic batch: upsert the page's acknowledged records, remove their
    /// intents and tombstones, mark its dead-lettered records (every other
    /// committed id loses a mark it had), replace their stored versions by the
    /// page's (a record committed without one keeps none), and set
    /// `seen_epoch = epoch` on the `seen` ids that exist (unchanged records
    /// seen by a full sweep). Every read sees it when this returns; it may
    /// reach the disk later (by the next `flush` or `save_stream` of the
    /// stream at the latest), after the intents of later pages. A store may
    /// keep the seen epochs apart from the batch and write them later (by
    /// the stream's next `save_stream` or `unseen_records`, or at close):
    /// they make no change durable.
    fn commit_page(&self, key: StreamKey, page: &Acked<PageCommit>) -> Result<(), StateError>;
    /// The stream's dead-lettered records, in id order.
    fn dead_letters(&self, key: StreamKey) -> Result<Vec<(i64, DeadLetter)>, StateError>;
    /// Records with `seen_epoch < epoch`, in id order.
    fn unseen_records(
        &self,
        key: StreamKey,
        epoch: u64,
    ) -> Result<Vec<(i64, RecordState)>, StateError>;
    /// Number of committed records of the stream.
    fn record_count(&self, key: StreamKey) -> Result<u64, StateError>;
    /// The stored version of each id (field hashes, body), in the order of
    /// `ids`; None where the store keeps none. Stores that keep no versions
    /// need not implement it.
    fn get_versions(
        &self,
        key: StreamKey,
        ids: &[i64],
    ) -> Result<Vec<Option<StoredVersion>>, StateError> {
        let _ = key;
        Ok(vec![None; ids.len()])
    }
    /// The secret the store's raw prints are keyed with ([`crate::hash::PrintKey`]);
    /// None when the store keeps no prints, and then every listed record is
    /// compared by its canonical parse.
    fn print_secret(&self) -> Option<[u8; PRINT_SECRET_LEN]> {
        None
    }
    /// One atomic batch: remove the acknowledged deletes' records, their
    /// dead-letter marks, stored versions and any intents for these ids,
    /// write the tombstones.
    fn commit_deletes(
        &self,
        key: StreamKey,
        deletes: &Acked<DeleteCommit>,
    ) -> Result<(), StateError>;
    /// Makes every write so far durable on disk (seen epochs aside: see `commit_page`).
    fn flush(&self) -> Result<(), StateError>;
}
