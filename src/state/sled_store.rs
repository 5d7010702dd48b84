//! The sled implementation of [`StateStore`].
//!
//! Three trees: `meta` (layout version), `streams` (one small JSON document
//! per stream) and `catalog`, which holds records, intents and tombstones of
//! every stream under kind-prefixed binary keys. Keeping the per-record kinds
//! in one tree lets a multi-kind change (commit deletes, a group of staged
//! page commits of up to 64 keys) be a single `apply_batch`, which sled
//! applies atomically, without the cost of cross-tree transactions; a larger
//! group is written as several batches, its journal removals in the last
//! (`write_staged`). See docs/state.md.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::codec::{
    self, Bucket, EncodedVersion, KIND_COUNT, KIND_DEAD_LETTER, KIND_JOURNAL, KIND_RECORD,
    KIND_SHAPE, KIND_TOMBSTONE, KIND_VERSION,
};
use super::fresh::{FreshOffset, FreshRecords, FreshStream};
use super::journal::{JournalPlan, StreamJournal};
use super::marks::{SeenMarks, MAX_MARKED_BUCKETS, MAX_REPRINTS};
use super::{
    Acked, DeadLetter, DeleteCommit, IdMap, IdSet, Intent, PageCommit, RecordState, Reprint,
    StateError, StateStore, StoredVersion, StreamState, Tombstone,
};
use crate::crashpoint;
use crate::hash::{FieldHashes, PRINT_SECRET_LEN};
use crate::stream::StreamKey;

/// The on-disk layout this build writes.
///
/// Layout 2 added the per-record change sequence and the full intent (op,
/// previous hash, replay id) as optional fields behind flag bits; layout 1
/// values are a subset of it, so a layout 1 store is upgraded in place on open.
/// Layout 3 added two kinds of entries, stored versions (`v`) and field
/// shapes (`s`), written only under `events.changed_fields` / `events.before`;
/// every other value is as in layout 2, so layout 1 and 2 stores are upgraded
/// in place too (their records simply have no stored version). An older build
/// refuses a layout 3 store: it would neither remove a deleted record's
/// version nor a forgotten stream's.
///
/// Layout 4 added a record's raw print (`hash/print.rs`) behind a new flag
/// bit of its state, and the store's print secret in `meta`; layout 1-3
/// records read as having no print, so those stores are upgraded in place
/// and their records gain prints as they change. An older build refuses a
/// layout 4 store: it would read a record with a print as malformed.
pub const LAYOUT_VERSION: u32 = 4;
/// The oldest layout this build reads (and upgrades to [`LAYOUT_VERSION`]).
const OLDEST_READABLE_LAYOUT: u32 = 1;

fn readable(version: u32) -> bool {
    (OLDEST_READABLE_LAYOUT..=LAYOUT_VERSION).contains(&version)
}

/// Meta key holding the layout version (u32 big-endian).
const META_LAYOUT_VERSION: &[u8] = b"layout_version";
/// Meta key holding the secret raw prints are keyed with (layout 4).
const META_PRINT_SECRET: &[u8] = b"print_secret";
/// Meta key holding the name and version of the build that created the store.
const META_CREATED_BY: &[u8] = b"created_by";

/// File beside sled's own files naming the layout, readable before sled opens.
pub const LAYOUT_MARKER: &str = "voucher-cdc-layout";

/// Sled's page cache when `state.cache_capacity_mib` is not set (approximate:
/// sled accounts serialized page sizes). A store of about 100,000 records
/// fits it (6 MiB since layout 4 made a record state 35 bytes instead of
/// 27: at 4 MiB such a store's full sweep read a third of its buckets back
/// from disk, 30-40% more CPU); beyond the cache, misses are served by the OS page cache,
/// and a page read back in many fragments is written back whole
/// (vendor/sled/PATCHES.md, item 5), so that a larger store costs full
/// sweeps little CPU for the memory it saves. See docs/state.md for the
/// figures.
pub const CACHE_CAPACITY: u64 = 6 * 1024 * 1024;
/// How often sled flushes in the background (a crash loses at most this much
/// committed state, which the invariant turns into duplicates, never loss).
const FLUSH_EVERY_MS: u64 = 500;

/// When a stream's staged page commits are written to sled (see
/// [`SledStore::stage`]). Each `apply_batch` costs a synced log write of its
/// own (sled 0.34 seals a log buffer holding only the batch manifest) on top
/// of the flush every page's intents need, and each bucket written costs sled
/// a tree insert whatever its size: a first sync lists ids in change order,
/// so a page touches ~47 of a 50,000-record stream's 32-id buckets and, with
/// commits written four pages at a time, each bucket was written ~30 times.
/// Staging a stream's commits for up to a second writes each bucket about
/// once per group. A crash loses at most the staged commits, whose intents are
/// durable: their events are published again with the same ids.
#[derive(Debug, Clone, Copy)]
struct StageLimits {
    /// Age of a stream's oldest staged commit that ends its group.
    age: Duration,
    /// Staged bytes (keys and values) of one stream that end its group.
    stream_bytes: usize,
    /// Staged bytes of every stream together that end the committing stream's
    /// group (a soft bound: the other streams' groups end at their own commits).
    total_bytes: usize,
    /// Keys per sled batch when a group is written. sled frees the node
    /// copies each insert leaves behind only once the batch's epoch guard is
    /// dropped: one batch of a whole group's ~1,500 buckets held ~10 MB of them.
    batch_keys: usize,
}

/// The limits a store opens with: a group ends at the first commit after it
/// is a second old (the order of sled's own 500 ms flush interval) or holds
/// 4 MiB for its stream (a 100,000-record stream's buckets are about 3 MB) or
/// 16 MiB for every stream; it is written 64 keys a batch.
const STAGE_LIMITS: StageLimits = StageLimits {
    age: Duration::from_secs(1),
    stream_bytes: 4 << 20,
    total_bytes: 16 << 20,
    batch_keys: 64,
};

/// The limits of a store whose every commit is synced before it returns
/// ([`crashpoint::durable_commits`]): a group ends at its first commit.
const SETTLE_AT_ONCE: StageLimits = StageLimits {
    age: Duration::ZERO,
    ..STAGE_LIMITS
};

/// One stream's staged page commits.
#[derive(Debug)]
struct Staged {
    /// Their writes, later pages' over earlier ones'.
    writes: Writes,
    /// The records committed to a stream that started empty ([`FreshStream`]),
    /// in commit order, the later of an id's twice: merged into their stored
    /// buckets when the group is written (sorted by bucket then), so that
    /// committing them reads no bucket for a new id. One compact list: a
    /// first sync's group puts one or two records in each bucket it touches,
    /// and a list per bucket cost 300 bytes each. A bucket is never both
    /// here and in `writes`: such a stream stages no bucket whole, a bucket
    /// loaded to be staged whole writes the group first, and a record of a
    /// bucket `writes` holds goes into its value.
    fresh: FreshRecords,
    /// The slots of each bucket that `fresh` holds records of (bit `slot`).
    fresh_buckets: IdMap<u32>,
    /// How many page commits they hold.
    pages: usize,
    /// Bytes of the keys and values of `writes`.
    bytes: usize,
    /// When the first of them was staged.
    since: Instant,
}

impl Staged {
    /// An empty group, starting now.
    fn new() -> Staged {
        Staged {
            writes: Writes::default(),
            fresh: FreshRecords::default(),
            fresh_buckets: IdMap::default(),
            pages: 0,
            bytes: 0,
            since: Instant::now(),
        }
    }

    /// Adds one page's writes, which win over the staged ones, and its
    /// records staged alone (`fresh`, later ones winning).
    /// Each bucket it starts to stage records alone for counts
    /// `bucket_bytes` more: what writing that bucket is expected to cost.
    fn add(
        &mut self,
        stream: StreamKey,
        later: Writes,
        fresh: Vec<(i64, RecordState)>,
        bucket_bytes: usize,
    ) -> Result<(), Undecodable> {
        // First what can fail, so that a failure stages nothing of the page:
        // records of a bucket staged whole (by this page or before) go into
        // its value.
        let mut into_whole: BTreeMap<[u8; codec::RECORD_KEY_LEN], Bucket> = BTreeMap::new();
        let mut alone = Vec::with_capacity(fresh.len());
        for (id, record) in fresh {
            let (number, slot) = codec::bucket_of(id);
            let k = codec::record_key(KIND_RECORD, stream, number);
            let whole = match into_whole.entry(k) {
                Entry::Occupied(entry) => Some(entry.into_mut()),
                Entry::Vacant(entry) => match later.get(&k).or_else(|| self.writes.get(&k)) {
                    Some(Some(bytes)) => {
                        Some(entry.insert(codec::decode_bucket(bytes).ok_or(Undecodable)?))
                    }
                    Some(None) => Some(entry.insert(Bucket::default())),
                    None => None,
                },
            };
            match whole {
                Some(bucket) => bucket.slots[slot] = Some(record),
                None => alone.push((id, number, slot, record)),
            }
        }
        for (k, v) in later.0 {
            self.put(k, v);
        }
        let mut value = Vec::new();
        for (k, bucket) in into_whole {
            codec::encode_bucket(&bucket, &mut value);
            self.put(k[..].into(), Some(value[..].into()));
        }
        for (id, number, slot, record) in alone {
            let slots = self.fresh_buckets.entry(number).or_insert_with(|| {
                self.bytes += FRESH_BUCKET_BYTES + bucket_bytes;
                0
            });
            *slots |= 1 << slot;
            let before = self.fresh.bytes();
            self.fresh.push(id, &record);
            self.bytes += self.fresh.bytes() - before;
        }
        self.pages += 1;
        Ok(())
    }

    /// The record of `id` staged alone, if it is (the latest, if twice).
    fn fresh_record(&self, id: i64) -> Result<Option<RecordState>, Undecodable> {
        let (number, slot) = codec::bucket_of(id);
        let slots = self.fresh_buckets.get(&number).copied().unwrap_or(0);
        if slots & (1 << slot) == 0 {
            return Ok(None);
        }
        let latest = self.fresh.ids().filter(|(_, fresh)| *fresh == id).last();
        match latest {
            Some((offset, _)) => Ok(Some(self.fresh.get(offset).ok_or(Undecodable)?.1)),
            None => Ok(None),
        }
    }

    /// Stages the write of `k`, over a staged one.
    fn put(&mut self, k: sled::IVec, v: Option<sled::IVec>) {
        let len = |v: &Option<sled::IVec>| v.as_ref().map_or(0, |v| v.len());
        let (key_len, new_len) = (k.len(), len(&v));
        match self.writes.0.insert(k, v) {
            Some(old) => self.bytes = self.bytes.saturating_sub(len(&old)),
            None => self.bytes += key_len,
        }
        self.bytes += new_len;
    }
}

/// A staged value that does not decode (the store names it as corrupt).
#[derive(Debug)]
struct Undecodable;

/// Staged bytes counted for each bucket with records staged alone (an entry
/// of `Staged::fresh_buckets`, with the hash table's slack), besides the
/// bucket's expected size (`FreshStream::bucket_bytes`): a group is bounded
/// by the buckets it will write, as when it staged them whole, since sled's
/// log buffers and node copies grow with the bytes one group writes.
const FRESH_BUCKET_BYTES: usize = 16;

/// Catalog writes applied together as one sled batch; a key's last write wins.
/// Keys and values are `IVec`s, as in a `sled::Batch`: the 18-byte keys are
/// stored inline, and building the batch clones no value bytes.
#[derive(Debug, Default)]
struct Writes(BTreeMap<sled::IVec, Option<sled::IVec>>);

impl Writes {
    fn insert(&mut self, key: impl AsRef<[u8]>, value: impl Into<sled::IVec>) {
        self.0.insert(key.as_ref().into(), Some(value.into()));
    }

    fn remove(&mut self, key: impl AsRef<[u8]>) {
        self.0.insert(key.as_ref().into(), None);
    }

    /// Removes the entry of `kind` of each of `ids` of stream `key`.
    fn remove_ids<'i>(&mut self, kind: u8, key: StreamKey, ids: impl IntoIterator<Item = &'i i64>) {
        for id in ids {
            self.remove(codec::record_key(kind, key, *id));
        }
    }

    /// The write of `key`: `Some(None)` when it is removed, None when untouched.
    fn get(&self, key: &[u8]) -> Option<Option<&sled::IVec>> {
        self.0.get(key).map(Option::as_ref)
    }

    /// These writes as one sled batch.
    fn to_batch(&self) -> sled::Batch {
        batch_of(&self.0)
    }
}

/// A sled batch of `writes` (cloning an `IVec` copies no bytes).
fn batch_of<'w>(
    writes: impl IntoIterator<Item = (&'w sled::IVec, &'w Option<sled::IVec>)>,
) -> sled::Batch {
    let mut batch = sled::Batch::default();
    add_to_batch(&mut batch, writes);
    batch
}

/// Adds `writes` to `batch`, over its writes of the same keys.
fn add_to_batch<'w>(
    batch: &mut sled::Batch,
    writes: impl IntoIterator<Item = (&'w sled::IVec, &'w Option<sled::IVec>)>,
) {
    for (k, v) in writes {
        match v {
            Some(v) => batch.insert(k.clone(), v.clone()),
            None => batch.remove(k.clone()),
        }
    }
}

/// One write of a staged group: a staged key's, or a bucket's records
/// staged alone (merged into the stored bucket when written).
enum StagedWrite<'w> {
    Write(&'w sled::IVec, &'w Option<sled::IVec>),
    Fresh([u8; codec::RECORD_KEY_LEN], &'w [(i64, FreshOffset)]),
}

impl StagedWrite<'_> {
    fn key(&self) -> &[u8] {
        match self {
            StagedWrite::Write(k, _) => k,
            StagedWrite::Fresh(k, _) => k,
        }
    }
}

/// `writes` (in key order) and the buckets of records staged alone (`by_bucket`:
/// their buckets and offsets, sorted) as one list in key order.
fn merge_fresh<'w>(
    stream: StreamKey,
    writes: Vec<(&'w sled::IVec, &'w Option<sled::IVec>)>,
    by_bucket: &'w [(i64, FreshOffset)],
) -> Vec<StagedWrite<'w>> {
    let same_bucket = |(a, _): &(i64, FreshOffset), (b, _): &(i64, FreshOffset)| a == b;
    // One write a bucket, not a record.
    let buckets = by_bucket.chunk_by(same_bucket).count();
    let mut out = Vec::with_capacity(writes.len() + buckets);
    let mut fresh = by_bucket
        .chunk_by(same_bucket)
        .map(|records| {
            let number = records[0].0;
            StagedWrite::Fresh(codec::record_key(KIND_RECORD, stream, number), records)
        })
        .peekable();
    for (k, v) in writes {
        while let Some(next) = fresh.next_if(|f| f.key() < &k[..]) {
            out.push(next);
        }
        out.push(StagedWrite::Write(k, v));
    }
    out.extend(fresh);
    out
}

/// State store backed by a sled database directory.
pub struct SledStore {
    db: sled::Db,
    meta: sled::Tree,
    streams: sled::Tree,
    catalog: sled::Tree,
    /// In-memory index of each stream's intent journal, loaded on first use.
    journals: Mutex<HashMap<StreamKey, Arc<Mutex<StreamJournal>>>>,
    /// Page commits of each stream not yet written to sled (see [`Self::stage`]).
    staged: Mutex<HashMap<StreamKey, Staged>>,
    /// Per stream touched since the store opened: the ids committed to it
    /// when it held no record then ([`FreshStream`]), None when it did or
    /// once the set was dropped.
    fresh: Mutex<HashMap<StreamKey, Option<FreshStream>>>,
    /// Per stream, the ids its sweeps saw unchanged and their epoch, not yet
    /// written into their buckets ([`SeenMarks`]): written by
    /// [`Self::settle`], never by a group's write. Locked after `staged`
    /// where both are held, and written only under the stream's journal lock.
    marks: Mutex<HashMap<StreamKey, SeenMarks>>,
    /// When staged commits are written (tests use smaller ones).
    limits: StageLimits,
    /// Every commit is synced before it returns (crash tests only: see
    /// [`crashpoint::durable_commits`]); its group then ends at once too
    /// ([`SETTLE_AT_ONCE`]).
    durable_commits: bool,
    /// Field shapes known to be stored, by stream and shape id (read or written).
    shapes: Mutex<HashMap<(StreamKey, u64), Shape>>,
    /// The secret raw prints are keyed with (meta `print_secret`, drawn at
    /// random the first time a build that keeps prints opens the store).
    print_secret: [u8; PRINT_SECRET_LEN],
    path: PathBuf,
    /// Keeps a temporary store's directory alive; dropped after the db.
    _temp_dir: Option<TempDir>,
}

impl Drop for SledStore {
    /// Writes the staged commits (a store dropped without `flush` keeps them)
    /// and the seen marks.
    fn drop(&mut self) {
        if let Err(e) = self.settle_all() {
            tracing::warn!(path = %self.path.display(), error = %e,
                "staged page commits not written at close; their intents are published again");
        }
    }
}

impl std::fmt::Debug for SledStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SledStore")
            .field("path", &self.path)
            .finish()
    }
}

impl SledStore {
    /// Opens (or creates) the store in directory `path`, with the default page cache.
    pub fn open(path: &Path) -> Result<SledStore, StateError> {
        Self::open_with(path, None, CACHE_CAPACITY)
    }

    /// Opens (or creates) the store in directory `path` with a page cache of
    /// `cache_bytes` (`state.cache_capacity_mib`): the memory the store's
    /// nodes may take before sled evicts them and reads them back on use.
    pub fn open_with_cache(path: &Path, cache_bytes: u64) -> Result<SledStore, StateError> {
        Self::open_with(path, None, cache_bytes)
    }

    /// Opens a fresh store in a temporary directory removed on drop (tests, `demo`).
    pub fn open_temporary() -> Result<SledStore, StateError> {
        let dir = tempfile::Builder::new()
            .prefix("voucher-cdc-state-")
            .tempdir()
            .map_err(|source| StateError::Io {
                path: std::env::temp_dir(),
                source,
            })?;
        let path = dir.path().join("state");
        Self::open_with(&path, Some(dir), CACHE_CAPACITY)
    }

    fn open_with(
        path: &Path,
        temp_dir: Option<TempDir>,
        cache_bytes: u64,
    ) -> Result<SledStore, StateError> {
        if path.is_file() {
            return Err(StateError::Io {
                path: path.to_path_buf(),
                source: io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "the path is a file, expected a directory",
                ),
            });
        }
        let marker = read_marker(path)?;
        let durable_commits = crashpoint::durable_commits();
        let db = sled::Config::new()
            .path(path)
            .cache_capacity(cache_bytes)
            .flush_every_ms(Some(FLUSH_EVERY_MS))
            .open()
            .map_err(|e| map_sled_error(path, e))?;
        let tree = |name: &str| db.open_tree(name).map_err(|e| map_sled_error(path, e));
        let mut store = SledStore {
            meta: tree("meta")?,
            streams: tree("streams")?,
            catalog: tree("catalog")?,
            db,
            journals: Mutex::new(HashMap::new()),
            staged: Mutex::new(HashMap::new()),
            fresh: Mutex::new(HashMap::new()),
            marks: Mutex::new(HashMap::new()),
            limits: if durable_commits {
                SETTLE_AT_ONCE
            } else {
                STAGE_LIMITS
            },
            durable_commits,
            shapes: Mutex::new(HashMap::new()),
            print_secret: [0; PRINT_SECRET_LEN],
            path: path.to_path_buf(),
            _temp_dir: temp_dir,
        };
        store.check_layout(marker.is_some())?;
        store.print_secret = store.load_print_secret()?;
        if durable_commits {
            tracing::warn!(path = %path.display(),
                "every commit is written and synced as it is made (VCDC_DURABLE_COMMITS, a crash-test mode)");
        }
        if marker.is_none() {
            write_marker(path)?;
        }
        Ok(store)
    }

    /// The store directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes the store occupies on disk, as sled accounts them.
    pub fn size_on_disk(&self) -> Result<u64, StateError> {
        self.db.size_on_disk().map_err(|e| self.err(e))
    }

    /// Checks the layout version in `meta`, or initialises a new store.
    ///
    /// sled treats a damaged log as a torn write and may open it as empty; the
    /// marker file tells a store that lost its contents from a new one.
    fn check_layout(&self, had_marker: bool) -> Result<(), StateError> {
        match self
            .meta
            .get(META_LAYOUT_VERSION)
            .map_err(|e| self.err(e))?
        {
            Some(bytes) => {
                let found = <[u8; 4]>::try_from(bytes.as_ref())
                    .map(u32::from_be_bytes)
                    .map_err(|_| self.corrupt("the layout version is not a 4-byte integer"))?;
                if !readable(found) {
                    return Err(StateError::UnsupportedVersion {
                        path: self.path.clone(),
                        found,
                        supported: LAYOUT_VERSION,
                    });
                }
                if found != LAYOUT_VERSION {
                    self.meta
                        .insert(META_LAYOUT_VERSION, &LAYOUT_VERSION.to_be_bytes())
                        .map_err(|e| self.err(e))?;
                    self.db.flush().map_err(|e| self.err(e))?;
                    write_marker(&self.path)?;
                    tracing::info!(path = %self.path.display(), from = found, to = LAYOUT_VERSION,
                        "state store layout upgraded in place");
                }
                Ok(())
            }
            None => {
                if had_marker {
                    return Err(self.corrupt(format!(
                        "the database lost its contents ({LAYOUT_MARKER} is present but the \
                         database holds no layout version)"
                    )));
                }
                let has_data = !self.streams.is_empty() || !self.catalog.is_empty();
                if has_data {
                    return Err(self.corrupt("it holds data but no layout version"));
                }
                self.meta
                    .insert(META_LAYOUT_VERSION, &LAYOUT_VERSION.to_be_bytes())
                    .map_err(|e| self.err(e))?;
                let created_by = concat!("voucher-cdc ", env!("CARGO_PKG_VERSION"));
                self.meta
                    .insert(META_CREATED_BY, created_by)
                    .map_err(|e| self.err(e))?;
                self.db.flush().map_err(|e| self.err(e))?;
                Ok(())
            }
        }
    }

    /// The store's print secret, drawn and written (durably) when it has none.
    /// A print made under another secret never matches, so a lost or
    /// unreadable secret costs full sweeps their shortcut, never a change.
    fn load_print_secret(&self) -> Result<[u8; PRINT_SECRET_LEN], StateError> {
        if let Some(bytes) = self.meta.get(META_PRINT_SECRET).map_err(|e| self.err(e))? {
            if let Ok(secret) = <[u8; PRINT_SECRET_LEN]>::try_from(bytes.as_ref()) {
                return Ok(secret);
            }
            tracing::warn!(path = %self.path.display(),
                "the state store's print secret is malformed; drawing a new one");
        }
        let secret: [u8; PRINT_SECRET_LEN] = rand::random();
        self.meta
            .insert(META_PRINT_SECRET, &secret)
            .map_err(|e| self.err(e))?;
        self.db.flush().map_err(|e| self.err(e))?;
        Ok(secret)
    }

    fn err(&self, e: sled::Error) -> StateError {
        map_sled_error(&self.path, e)
    }

    fn corrupt(&self, detail: impl Into<String>) -> StateError {
        StateError::Corrupt {
            path: self.path.clone(),
            detail: detail.into(),
        }
    }

    fn corrupt_value(&self, what: &str, key: &[u8]) -> StateError {
        self.corrupt(format!(
            "undecodable {what} value under key {}",
            hex::encode(key)
        ))
    }

    /// The stream's journal index, loading it from its entries on first use.
    fn journal(&self, key: StreamKey) -> Result<Arc<Mutex<StreamJournal>>, StateError> {
        let mut journals = lock(&self.journals);
        if let Some(journal) = journals.get(&key) {
            return Ok(journal.clone());
        }
        self.settle_group(key)?;
        let mut entries = Vec::new();
        for entry in self.catalog.scan_prefix(codec::prefix(KIND_JOURNAL, key)) {
            let (k, v) = entry.map_err(|e| self.err(e))?;
            let seq = codec::journal_seq(&k).ok_or_else(|| self.corrupt_value("journal", &k))?;
            let intents =
                codec::decode_journal(&v).ok_or_else(|| self.corrupt_value("journal", &k))?;
            entries.push((seq, intents));
        }
        let (journal, cleanup) = StreamJournal::load(entries);
        if !cleanup.changes.is_empty() {
            let mut batch = Writes::default();
            add_journal_plan(&mut batch, key, &cleanup);
            self.apply(batch)?;
        }
        let journal = Arc::new(Mutex::new(journal));
        journals.insert(key, journal.clone());
        Ok(journal)
    }

    fn apply(&self, writes: Writes) -> Result<(), StateError> {
        self.apply_batch(writes.to_batch())
    }

    /// Reads `k` of stream `stream` as every reader must see it: a staged
    /// commit's write first, else sled. A record bucket's value leaves out
    /// its records staged alone ([`Staged::fresh`]): [`Self::read_records`]
    /// looks for those first, and [`Self::load_bucket`] writes them before
    /// it reads.
    fn read(&self, stream: StreamKey, k: &[u8]) -> Result<Option<sled::IVec>, StateError> {
        if let Some(staged) = lock(&self.staged).get(&stream) {
            if let Some(value) = staged.writes.get(k) {
                return Ok(value.cloned());
            }
        }
        self.catalog.get(k).map_err(|e| self.err(e))
    }

    /// Writes everything of the stream not yet in sled: its staged commits,
    /// then its seen marks. Before any scan of the stream's entries, any
    /// write outside a page commit, `save_stream`, and at close. Never
    /// called with the stream's journal lock or the `journals` lock held (it
    /// takes both, to write the marks).
    fn settle(&self, stream: StreamKey) -> Result<(), StateError> {
        if !lock(&self.marks).contains_key(&stream) {
            return self.settle_group(stream);
        }
        let journal = self.journal(stream)?;
        let _writer = lock(&journal);
        self.write_marks(stream)
    }

    /// Writes the stream's seen marks into their buckets, in key order, a
    /// batch of `batch_keys` buckets at a time, after its staged commits (a
    /// staged bucket written later would lose them). The caller holds the
    /// stream's journal lock, as every page commit does: no commit stages
    /// and no mark changes meanwhile. The marks stay, and visible, until
    /// every batch is written; the lock on them is not held while sled writes.
    fn write_marks(&self, stream: StreamKey) -> Result<(), StateError> {
        self.settle_group(stream)?;
        // A copy, so that the lock is not held while sled writes: readers of
        // every stream take it. The marks stay meanwhile (reads overlay them
        // over buckets written or not), and nothing changes them: they
        // change only under the journal lock, which the caller holds.
        let Some((epoch, pending, reprints)) = lock(&self.marks)
            .get(&stream)
            .map(|marks| (marks.epoch(), marks.in_key_order(), marks.reprints()))
        else {
            return Ok(());
        };
        for chunk in pending.chunks(self.limits.batch_keys.max(1)) {
            let mut buckets = BTreeMap::new();
            for &(number, mask) in chunk {
                // Nothing is staged for the stream (settled above, and no
                // commit stages without the journal lock): this is sled's.
                let mut bucket = self.load_bucket(stream, number)?;
                if SeenMarks::apply(epoch, number, mask, &reprints, &mut bucket) {
                    buckets.insert(number, Box::new(bucket));
                }
            }
            if !buckets.is_empty() {
                let dirty: BTreeSet<i64> = buckets.keys().copied().collect();
                let mut batch = Writes::default();
                Self::write_buckets(&mut batch, stream, &buckets, &dirty);
                self.apply(batch)?;
            }
        }
        lock(&self.marks).remove(&stream);
        Ok(())
    }

    /// Writes the stream's staged commits to sled (nothing when none is
    /// staged), not its seen marks. They stay staged, and visible, when a
    /// write fails.
    fn settle_group(&self, stream: StreamKey) -> Result<(), StateError> {
        let mut staged = lock(&self.staged);
        if let Some(entry) = staged.get(&stream) {
            // Under the lock: a reader sees the writes staged or in sled, never neither.
            let bucket_bytes = self.write_staged(stream, entry)?;
            staged.remove(&stream);
            if let (Some(bytes), Some(Some(fresh))) =
                (bucket_bytes, lock(&self.fresh).get_mut(&stream))
            {
                fresh.bucket_bytes = bytes;
            }
        }
        Ok(())
    }

    /// Writes one stream's staged commits: as one batch when the writes other
    /// than the journal's and the count fit in `batch_keys`, else in batches
    /// of that many keys in key order (dead-letter marks, record buckets,
    /// shapes, tombstones, versions), each with the record count as of
    /// itself, the journal removals and the staged count in the last. A crash
    /// between two batches leaves some acknowledged hashes committed while
    /// every intent of the group is still journalled: those events are
    /// published again with their ids, and no intent is ever removed before
    /// its record's bucket is written. Records staged alone are merged into
    /// their stored buckets here, read in key order; returns the mean size of
    /// those buckets as written (None when there were none).
    fn write_staged(
        &self,
        stream: StreamKey,
        staged: &Staged,
    ) -> Result<Option<usize>, StateError> {
        let count_key = codec::prefix(KIND_COUNT, stream);
        let (last, body): (Vec<_>, Vec<_>) = staged
            .writes
            .0
            .iter()
            .partition(|(k, _)| k.first() == Some(&KIND_JOURNAL) || k[..] == count_key[..]);
        let by_bucket = staged.fresh.by_bucket();
        let body = merge_fresh(stream, body, &by_bucket);
        let (mut merged, mut merged_bytes) = (0usize, 0usize);
        let mut merge = |k: &[u8], records: &[(i64, FreshOffset)]| {
            let (before, after, value) = self.merged_bucket(k, &staged.fresh, records)?;
            merged += 1;
            merged_bytes += value.len();
            Ok::<_, StateError>((before, after, value))
        };
        if body.len() <= self.limits.batch_keys {
            let mut batch = staged.writes.to_batch();
            for item in &body {
                if let StagedWrite::Fresh(k, records) = item {
                    batch.insert(&k[..], merge(k, records)?.2);
                }
            }
            self.apply_batch(batch)?;
            return Ok(merged_bytes.checked_div(merged));
        }
        // The count as of each batch; none while the stream has no count
        // entry on disk (a crash then leaves it missing, and it is counted).
        let mut count = match self.catalog.get(count_key).map_err(|e| self.err(e))? {
            Some(bytes) => Some(self.decode_count(&count_key, &bytes)?),
            None => None,
        };
        let chunks: Vec<_> = body.chunks(self.limits.batch_keys).collect();
        for (number, chunk) in chunks.iter().enumerate() {
            let mut batch = sled::Batch::default();
            for item in chunk.iter() {
                let (before, after) = match item {
                    StagedWrite::Fresh(k, records) => {
                        let (before, after, value) = merge(k, records)?;
                        batch.insert(&k[..], value);
                        (before, after)
                    }
                    StagedWrite::Write(k, v) => {
                        add_to_batch(&mut batch, [(*k, *v)]);
                        if count.is_none() || k.first() != Some(&KIND_RECORD) {
                            continue;
                        }
                        let stored = self.catalog.get(k).map_err(|e| self.err(e))?;
                        (
                            self.bucket_len(k, stored.as_deref())?,
                            self.bucket_len(k, v.as_deref())?,
                        )
                    }
                };
                if let Some(count) = count.as_mut() {
                    *count = (*count + u64::from(after)).saturating_sub(u64::from(before));
                }
            }
            if let Some(count) = count {
                batch.insert(&count_key[..], &count.to_be_bytes()[..]);
            }
            if number + 1 == chunks.len() {
                // The journal removals go with the last buckets, never ahead
                // of any; the staged count wins over the computed one (equal).
                add_to_batch(&mut batch, last.iter().copied());
            }
            self.apply_batch(batch)?;
            if number == 0 && crashpoint::ENABLED {
                // The crash point stands for the worst moment: this batch on
                // disk, the rest not (builds without crash points skip this).
                self.db.flush().map_err(|e| self.err(e))?;
                crashpoint::hit(crashpoint::names::BETWEEN_SETTLE_BATCHES);
            }
        }
        Ok(merged_bytes.checked_div(merged))
    }

    /// The stored bucket of key `k` with the records of `fresh` at `offsets`
    /// set (in order): its records before and after, and its new value.
    fn merged_bucket(
        &self,
        k: &[u8],
        fresh: &FreshRecords,
        offsets: &[(i64, FreshOffset)],
    ) -> Result<(u32, u32, sled::IVec), StateError> {
        let mut bucket = match self.catalog.get(k).map_err(|e| self.err(e))? {
            Some(bytes) => codec::decode_bucket(&bytes)
                .ok_or_else(|| self.corrupt_value("record bucket", k))?,
            None => Bucket::default(),
        };
        let before = bucket.len();
        for (_, offset) in offsets {
            let (id, record) = fresh
                .get(*offset)
                .ok_or_else(|| self.corrupt_value("record staged alone", k))?;
            bucket.slots[codec::bucket_of(id).1] = Some(record);
        }
        let mut value = Vec::with_capacity(4 + 32 * 27);
        codec::encode_bucket(&bucket, &mut value);
        let len = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        Ok((len(before), len(bucket.len()), value.into()))
    }

    /// Applies one sled batch to the catalog (atomic after a crash).
    fn apply_batch(&self, batch: sled::Batch) -> Result<(), StateError> {
        self.catalog.apply_batch(batch).map_err(|e| self.err(e))
    }

    /// Syncs what was written when every commit must be durable before it
    /// returns ([`crashpoint::durable_commits`]); nothing otherwise.
    fn sync_if_durable(&self) -> Result<(), StateError> {
        if self.durable_commits {
            self.db.flush().map_err(|e| self.err(e))?;
        }
        Ok(())
    }

    /// [`Self::settle_group`] for every stream with staged commits.
    fn settle_groups(&self) -> Result<(), StateError> {
        let streams: Vec<StreamKey> = lock(&self.staged).keys().copied().collect();
        streams
            .into_iter()
            .try_for_each(|stream| self.settle_group(stream))
    }

    /// Every stream's staged commits, then every stream's seen marks
    /// ([`Self::settle`]).
    fn settle_all(&self) -> Result<(), StateError> {
        self.settle_groups()?;
        let marked: Vec<StreamKey> = lock(&self.marks).keys().copied().collect();
        marked
            .into_iter()
            .try_for_each(|stream| self.settle(stream))
    }

    /// Stages one page's commit: visible to every read at once, written to
    /// sled with the stream's next page commits once the group reaches one of
    /// the [`StageLimits`] (checked by [`Self::group_full`]), or before any
    /// other write or scan of the stream, or by `flush`. Every staged commit
    /// was built from its page's acknowledgements and written after its
    /// page's intents were made durable. `fresh` are records the stream
    /// never held, staged without their buckets ([`Staged::fresh`]).
    fn stage(
        &self,
        stream: StreamKey,
        writes: Writes,
        fresh: Vec<(i64, RecordState)>,
        bucket_bytes: usize,
    ) -> Result<(), StateError> {
        if writes.0.is_empty() && fresh.is_empty() {
            // A page without changes or seen marks: nothing to write.
            return Ok(());
        }
        let mut staged = lock(&self.staged);
        staged
            .entry(stream)
            .or_insert_with(Staged::new)
            .add(stream, writes, fresh, bucket_bytes)
            .map_err(|_| {
                self.corrupt(format!(
                    "a staged record bucket of stream {stream} does not decode"
                ))
            })
    }

    /// Whether each of `ids` is certainly absent from the stream (never
    /// committed to it since it was empty: [`FreshStream`]); None when the
    /// stream held records when this process first touched it, or its set
    /// was dropped. `lookups` counts them as reads of known records (which
    /// end the set once they mostly find records); `commit` adds them to
    /// the set, before their commit is staged (which ends it when it
    /// would grow too large). A set that ends has the stream's staged
    /// commits written, so that none stays staged alone once its commits
    /// stage whole buckets.
    fn absent_ids(
        &self,
        key: StreamKey,
        ids: &[i64],
        lookups: bool,
        commit: bool,
    ) -> Result<Option<Vec<bool>>, StateError> {
        let known = lock(&self.fresh).contains_key(&key);
        if !known {
            let empty = self.stored_count(key)? == 0;
            lock(&self.fresh)
                .entry(key)
                .or_insert_with(|| empty.then(FreshStream::new));
        }
        let mut fresh = lock(&self.fresh);
        let Some(Some(stream)) = fresh.get_mut(&key) else {
            return Ok(None);
        };
        let mut absent = Vec::with_capacity(ids.len());
        let mut keep = true;
        for &id in ids {
            let never_committed = if commit {
                // Refused when the set would grow too large: dropped below.
                let new = stream.committed(id);
                keep &= new.is_some();
                new.unwrap_or(false)
            } else {
                !stream.holds(id)
            };
            absent.push(never_committed);
            if lookups {
                keep &= stream.looked_up(!never_committed);
            }
        }
        if keep {
            return Ok(Some(absent));
        }
        tracing::debug!(stream = %key, "the set of ids committed since the stream was empty is dropped");
        fresh.insert(key, None);
        drop(fresh);
        self.settle_group(key)?;
        Ok(None)
    }

    /// The committed record of each of `ids` (None where `skip` is true,
    /// for ids known to be absent, and where there is none): staged alone,
    /// else in its bucket (staged whole or in sled), each bucket read once.
    /// One view of the staged commits for every id: a group written between
    /// two ids of a bucket would move a record staged alone into sled after
    /// its bucket was read here without it.
    fn read_records(
        &self,
        key: StreamKey,
        ids: &[i64],
        skip: &[bool],
    ) -> Result<Vec<Option<RecordState>>, StateError> {
        let mut stored: BTreeMap<i64, Option<sled::IVec>> = BTreeMap::new();
        let mut out = Vec::with_capacity(ids.len());
        let staged = lock(&self.staged);
        let staged = staged.get(&key);
        let marks = lock(&self.marks);
        let marks = marks.get(&key);
        let seen = |id: i64, record: RecordState| match marks {
            Some(marks) => marks.overlay(id, record),
            None => record,
        };
        for (&id, &skip) in ids.iter().zip(skip) {
            if skip {
                out.push(None);
                continue;
            }
            let (bucket, slot) = codec::bucket_of(id);
            let k = codec::record_key(KIND_RECORD, key, bucket);
            if let Some(staged) = staged {
                let alone = staged
                    .fresh_record(id)
                    .map_err(|_| self.corrupt_value("record staged alone", &k))?;
                if let Some(record) = alone {
                    out.push(Some(seen(id, record)));
                    continue;
                }
            }
            let bytes = match stored.entry(bucket) {
                Entry::Occupied(entry) => entry.into_mut(),
                Entry::Vacant(entry) => entry.insert(match staged.and_then(|s| s.writes.get(&k)) {
                    Some(value) => value.cloned(),
                    None => self.catalog.get(k).map_err(|e| self.err(e))?,
                }),
            };
            out.push(match bytes {
                None => None,
                Some(bytes) => codec::bucket_slot(bytes, slot)
                    .ok_or_else(|| self.corrupt_value("record bucket", &k))?
                    .map(|record| seen(id, record)),
            });
        }
        Ok(out)
    }

    /// Marks the `seen` ids not `committed` as seen by a sweep of `epoch`
    /// (the ones held get it as their `seen_epoch`), in memory, and clears
    /// the marks of `committed` ids (a commit's record carries its own
    /// `seen_epoch`, which a later write of an earlier mark must not replace).
    /// `reprints` (of `seen` ids) ride with their marks. True when the marks
    /// must be written once the page is staged: past [`MAX_MARKED_BUCKETS`]
    /// or [`MAX_REPRINTS`], or when every commit must be durable. The
    /// caller holds the stream's journal lock and has written any marks of
    /// another epoch.
    fn mark_seen(
        &self,
        key: StreamKey,
        seen: &[i64],
        reprints: &[(i64, Reprint)],
        committed: &IdSet,
        epoch: u64,
    ) -> bool {
        let mut seen = seen.iter().filter(|id| !committed.contains(id)).peekable();
        let mut marks = lock(&self.marks);
        if let Some(stream_marks) = marks.get_mut(&key) {
            committed.iter().for_each(|id| stream_marks.unmark(*id));
        }
        if seen.peek().is_some() {
            let stream_marks = marks.entry(key).or_insert_with(|| SeenMarks::new(epoch));
            seen.for_each(|id| stream_marks.mark(*id));
            for (id, reprint) in reprints.iter().filter(|(id, _)| !committed.contains(id)) {
                stream_marks.mark_reprinted(*id, *reprint);
            }
        }
        marks.get(&key).is_some_and(|stream_marks| {
            stream_marks.buckets() > 0
                && (self.durable_commits
                    || stream_marks.buckets() >= MAX_MARKED_BUCKETS
                    || stream_marks.reprint_count() >= MAX_REPRINTS)
        })
    }

    /// Forgets what is known of the stream's ids (its records were replaced
    /// or removed other than by commits): checked again on next use.
    fn forget_fresh(&self, key: StreamKey) {
        lock(&self.fresh).remove(&key);
    }

    /// True when the stream's staged commits have reached one of the limits:
    /// their age, their bytes, or the bytes staged for every stream together.
    fn group_full(&self, stream: StreamKey) -> bool {
        let staged = lock(&self.staged);
        let Some(entry) = staged.get(&stream) else {
            return false;
        };
        entry.since.elapsed() >= self.limits.age
            || entry.bytes >= self.limits.stream_bytes
            || staged.values().map(|s| s.bytes).sum::<usize>() >= self.limits.total_bytes
    }

    /// True when the stream has a staged commit that writes one of `plan`'s keys.
    fn staged_touches(&self, stream: StreamKey, plan: &JournalPlan) -> bool {
        lock(&self.staged).get(&stream).is_some_and(|staged| {
            plan.changes.keys().any(|seq| {
                staged
                    .writes
                    .get(&codec::journal_key(stream, *seq))
                    .is_some()
            })
        })
    }

    /// Pages whose commits are staged for the stream.
    fn staged_pages(&self, stream: StreamKey) -> usize {
        lock(&self.staged)
            .get(&stream)
            .map_or(0, |staged| staged.pages)
    }

    /// The decoded entry of `kind` of each id (None where absent), in the
    /// order of `ids`: by one scan over their span when it is sparse, else
    /// by [`Self::get_each`].
    fn get_many<T>(
        &self,
        kind: u8,
        key: StreamKey,
        ids: &[i64],
        what: &str,
        decode: fn(&[u8]) -> Option<T>,
    ) -> Result<Vec<Option<T>>, StateError> {
        match self.entries_in_span(kind, key, ids)? {
            Some(found) => ids
                .iter()
                .map(|&id| self.decode_entry(kind, key, id, found.get(&id), what, decode))
                .collect(),
            None => self.get_each(kind, key, ids, what, decode),
        }
    }

    /// [`Self::get_many`] by one lookup per id: for entries that are dense
    /// when present at all, where a span scan would only give up.
    fn get_each<T>(
        &self,
        kind: u8,
        key: StreamKey,
        ids: &[i64],
        what: &str,
        decode: fn(&[u8]) -> Option<T>,
    ) -> Result<Vec<Option<T>>, StateError> {
        ids.iter()
            .map(|&id| {
                let value = self.read(key, &codec::record_key(kind, key, id))?;
                self.decode_entry(kind, key, id, value.as_ref(), what, decode)
            })
            .collect()
    }

    /// `value`, the entry of `kind` of `id`, decoded (None when absent); a
    /// value `decode` refuses is reported under its key.
    fn decode_entry<T>(
        &self,
        kind: u8,
        key: StreamKey,
        id: i64,
        value: Option<&sled::IVec>,
        what: &str,
        decode: fn(&[u8]) -> Option<T>,
    ) -> Result<Option<T>, StateError> {
        let Some(value) = value else {
            return Ok(None);
        };
        decode(value)
            .map(Some)
            .ok_or_else(|| self.corrupt_value(what, &codec::record_key(kind, key, id)))
    }

    /// The entries of `kind` the stream holds for `ids` (a staged write over
    /// sled's), found by one range scan over the ids' span instead of one
    /// lookup per id; None when the span holds more than [`span_scan_limit`]
    /// entries, and the caller looks each id up.
    ///
    /// Tombstones, dead-letter marks and stored versions are rare: a page's
    /// span usually holds none of them, and a scan finding that costs one
    /// tree descent where a lookup (or a removal, which sled applies as a
    /// lookup) per id costs fifty.
    fn entries_in_span(
        &self,
        kind: u8,
        key: StreamKey,
        ids: &[i64],
    ) -> Result<Option<IdMap<sled::IVec>>, StateError> {
        let (Some(&low), Some(&high)) = (ids.iter().min(), ids.iter().max()) else {
            return Ok(Some(IdMap::default()));
        };
        let limit = span_scan_limit(ids.len());
        let span = codec::record_key(kind, key, low)..=codec::record_key(kind, key, high);
        // The staged writes first: if a settle moves them into sled between
        // the two reads, they are read twice (the staged copy wins), never
        // missed. (A commit staged meanwhile would be: a stream has one
        // writer, its sweep, which is the caller.)
        let mut staged: Vec<(i64, Option<sled::IVec>)> = Vec::new();
        if let Some(entry) = lock(&self.staged).get(&key) {
            let from: &[u8] = &span.start()[..];
            let to: &[u8] = &span.end()[..];
            for (k, v) in entry.writes.0.range::<[u8], _>((
                std::ops::Bound::Included(from),
                std::ops::Bound::Included(to),
            )) {
                let id = codec::key_id(k).ok_or_else(|| self.corrupt_value("staged entry", k))?;
                staged.push((id, v.clone()));
            }
        }
        if staged.len() > limit {
            return Ok(None);
        }
        let wanted: IdSet = ids.iter().copied().collect();
        let mut found = IdMap::default();
        for (scanned, entry) in self.catalog.range(span).enumerate() {
            if scanned >= limit {
                return Ok(None);
            }
            let (k, v) = entry.map_err(|e| self.err(e))?;
            let id = codec::key_id(&k).ok_or_else(|| self.corrupt_value("catalog entry", &k))?;
            if wanted.contains(&id) {
                found.insert(id, v);
            }
        }
        for (id, write) in staged {
            match write {
                Some(v) if wanted.contains(&id) => {
                    found.insert(id, v);
                }
                Some(_) => {}
                None => {
                    found.remove(&id);
                }
            }
        }
        Ok(Some(found))
    }

    /// Adds to `batch` the removal of the entries of `kind` that `ids` hold,
    /// or of all of theirs when their span holds too many entries to tell by
    /// one scan (removing an absent key writes nothing to sled's log, but
    /// costs `apply_batch` a tree lookup, three per record before). Writes
    /// added to `batch` after this win over these removals.
    fn remove_held(
        &self,
        batch: &mut Writes,
        kind: u8,
        key: StreamKey,
        ids: &[i64],
    ) -> Result<(), StateError> {
        match self.entries_in_span(kind, key, ids)? {
            Some(found) => batch.remove_ids(kind, key, found.keys()),
            None => batch.remove_ids(kind, key, ids),
        }
        Ok(())
    }

    /// Adds the write of each dead-letter mark of `letters` to `batch`.
    fn add_dead_letters(
        &self,
        batch: &mut Writes,
        key: StreamKey,
        letters: &[(i64, DeadLetter)],
    ) -> Result<(), StateError> {
        for (id, letter) in letters {
            let value = serde_json::to_vec(letter)
                .map_err(|e| self.corrupt(format!("cannot encode a dead letter: {e}")))?;
            batch.insert(&codec::record_key(KIND_DEAD_LETTER, key, *id)[..], value);
        }
        Ok(())
    }

    /// Loads the bucket `bucket` of a stream (empty when absent), to stage
    /// it whole. Records staged alone are written with their group first (a
    /// bucket staged whole must hold them): a stream stages them only while
    /// its set lives, and the group is written when the set is
    /// dropped, so this happens only when the set is dropped between a
    /// commit's lookups and its staging.
    fn load_bucket(&self, key: StreamKey, bucket: i64) -> Result<Bucket, StateError> {
        let k = codec::record_key(KIND_RECORD, key, bucket);
        let staged_alone = lock(&self.staged)
            .get(&key)
            .is_some_and(|staged| staged.fresh_buckets.contains_key(&bucket));
        if staged_alone {
            self.settle_group(key)?;
        }
        match self.read(key, &k)? {
            None => Ok(Bucket::default()),
            Some(v) => {
                codec::decode_bucket(&v).ok_or_else(|| self.corrupt_value("record bucket", &k))
            }
        }
    }

    /// The bucket holding `id`, loaded into `buckets` on first use, and the id's slot.
    fn bucket_for<'b>(
        &self,
        buckets: &'b mut BTreeMap<i64, Box<Bucket>>,
        key: StreamKey,
        id: i64,
    ) -> Result<(&'b mut Bucket, usize), StateError> {
        let (bucket, slot) = codec::bucket_of(id);
        let loaded = match buckets.entry(bucket) {
            Entry::Occupied(entry) => entry.into_mut(),
            // Boxed: a bucket is 2 KiB, and the map moves its values as it grows.
            Entry::Vacant(entry) => entry.insert(Box::new(self.load_bucket(key, bucket)?)),
        };
        Ok((loaded, slot))
    }

    /// The stream's record count, kept beside its buckets and updated in the
    /// same batches; counted from the buckets when the entry is missing.
    fn stored_count(&self, key: StreamKey) -> Result<u64, StateError> {
        let count_key = codec::prefix(KIND_COUNT, key);
        if let Some(bytes) = self.read(key, &count_key)? {
            return self.decode_count(&count_key, &bytes);
        }
        // Seen marks count no record: they stay (a page commit calls this
        // with the journal lock held).
        self.settle_group(key)?;
        let mut count = 0u64;
        for entry in self.catalog.scan_prefix(codec::prefix(KIND_RECORD, key)) {
            let (k, v) = entry.map_err(|e| self.err(e))?;
            count += u64::from(self.bucket_len(&k, Some(&v))?);
        }
        Ok(count)
    }

    /// The value of the record count entry `count_key`.
    fn decode_count(&self, count_key: &[u8], bytes: &[u8]) -> Result<u64, StateError> {
        let bytes: [u8; 8] = bytes
            .try_into()
            .map_err(|_| self.corrupt_value("record count", count_key))?;
        Ok(u64::from_be_bytes(bytes))
    }

    /// Records in the encoded bucket `value` of key `k` (0 when absent).
    fn bucket_len(&self, k: &[u8], value: Option<&[u8]>) -> Result<u32, StateError> {
        value.map_or(Ok(0), |v| {
            codec::bucket_len(v).ok_or_else(|| self.corrupt_value("record bucket", k))
        })
    }

    /// Adds the stream's new record count to `batch` (read by [`Self::stored_count`]).
    fn write_count(batch: &mut Writes, key: StreamKey, count: u64) {
        batch.insert(
            &codec::prefix(KIND_COUNT, key)[..],
            &count.to_be_bytes()[..],
        );
    }

    /// Adds the write (or removal, when empty) of each `dirty` bucket to `batch`.
    fn write_buckets(
        batch: &mut Writes,
        key: StreamKey,
        buckets: &BTreeMap<i64, Box<Bucket>>,
        dirty: &BTreeSet<i64>,
    ) {
        let mut value = Vec::with_capacity(4 + 32 * 27);
        for (number, bucket) in buckets.iter().filter(|(n, _)| dirty.contains(n)) {
            let k = codec::record_key(KIND_RECORD, key, *number);
            if bucket.len() == 0 {
                batch.remove(&k[..]);
            } else {
                codec::encode_bucket(bucket, &mut value);
                batch.insert(&k[..], &value[..]);
            }
        }
    }
}

/// A field shape's keys (canonical key bytes, sorted).
type Shape = Arc<Vec<Vec<u8>>>;

/// Shapes a batch writes, added to the known shapes once it is applied.
type NewShapes = Vec<((StreamKey, u64), Shape)>;

impl SledStore {
    /// The keys of shape `shape` of a stream: from memory, else its entry;
    /// None when the store does not hold it.
    fn shape(&self, key: StreamKey, shape: u64) -> Result<Option<Shape>, StateError> {
        if let Some(keys) = lock(&self.shapes).get(&(key, shape)) {
            return Ok(Some(keys.clone()));
        }
        let k = codec::record_key(KIND_SHAPE, key, shape as i64);
        let Some(bytes) = self.read(key, &k)? else {
            return Ok(None);
        };
        let keys = Arc::new(
            codec::decode_shape(&bytes).ok_or_else(|| self.corrupt_value("field shape", &k))?,
        );
        lock(&self.shapes).insert((key, shape), keys.clone());
        Ok(Some(keys))
    }

    /// A stored version with its shape resolved. Field hashes whose shape is
    /// missing or does not fit are dropped (the version then has none): a
    /// consumer gets no `changedfields` rather than a wrong one.
    fn resolve_version(
        &self,
        key: StreamKey,
        id: i64,
        encoded: EncodedVersion,
    ) -> Result<StoredVersion, StateError> {
        let fields = match encoded.fields {
            None => None,
            Some((shape, hashes)) => {
                let keys = self.shape(key, shape)?;
                let fields = keys.and_then(|keys| FieldHashes::from_parts(keys.to_vec(), hashes));
                if fields.is_none() {
                    tracing::warn!(tenant = key.tenant, resource = %key.resource, record = id,
                        shape = %format!("{shape:016x}"),
                        "the field shape of a stored version is missing or does not fit; its changed fields are unknown");
                }
                fields
            }
        };
        Ok(StoredVersion {
            hash: encoded.hash,
            fields,
            body: encoded.body,
        })
    }

    /// Adds the write of `id`'s stored version to `batch`, and of its shape
    /// when neither the store (unless `batch` replaces the stream whole) nor
    /// `new_shapes` holds it yet (then recorded in `new_shapes`).
    fn add_version(
        &self,
        batch: &mut Writes,
        key: StreamKey,
        (id, version): (i64, &StoredVersion),
        replacing: bool,
        new_shapes: &mut NewShapes,
    ) -> Result<(), StateError> {
        let fields = match &version.fields {
            None => None,
            Some(fields) => {
                let (shape, encoded) = codec::encode_shape(fields.keys());
                let known = new_shapes.iter().any(|(k, _)| *k == (key, shape))
                    || (!replacing && self.shape(key, shape)?.is_some());
                if !known {
                    batch.insert(
                        &codec::record_key(KIND_SHAPE, key, shape as i64)[..],
                        encoded,
                    );
                    let keys = fields.keys().map(<[u8]>::to_vec).collect();
                    new_shapes.push(((key, shape), Arc::new(keys)));
                }
                Some((shape, fields.hashes().copied().collect()))
            }
        };
        let mut value = Vec::new();
        codec::encode_version(
            &EncodedVersion {
                hash: version.hash,
                fields,
                body: version.body.clone(),
            },
            &mut value,
        );
        batch.insert(&codec::record_key(KIND_VERSION, key, id)[..], value);
        Ok(())
    }

    /// Remembers the shapes an applied batch wrote.
    fn learn_shapes(&self, new_shapes: NewShapes) {
        if !new_shapes.is_empty() {
            lock(&self.shapes).extend(new_shapes);
        }
    }

    /// Forgets the shapes of a stream whose entries were removed or replaced.
    fn forget_shapes(&self, key: StreamKey) {
        lock(&self.shapes).retain(|(stream, _), _| *stream != key);
    }
}

impl StateStore for SledStore {
    fn print_secret(&self) -> Option<[u8; PRINT_SECRET_LEN]> {
        Some(self.print_secret)
    }

    fn load_stream(&self, key: StreamKey) -> Result<StreamState, StateError> {
        match self
            .streams
            .get(codec::stream_key(key))
            .map_err(|e| self.err(e))?
        {
            None => Ok(StreamState::default()),
            Some(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| self.corrupt(format!("undecodable state of stream {key}: {e}"))),
        }
    }

    fn save_stream(&self, key: StreamKey, state: &StreamState) -> Result<(), StateError> {
        let bytes = serde_json::to_vec(state).map_err(|e| StateError::Backend {
            path: self.path.clone(),
            detail: format!("cannot encode state of stream {key}: {e}"),
        })?;
        // Never a watermark in the log before the commits it covers.
        self.settle(key)?;
        self.streams
            .insert(codec::stream_key(key), bytes)
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    fn streams(&self) -> Result<Vec<(StreamKey, StreamState)>, StateError> {
        let mut out = Vec::new();
        for entry in self.streams.iter() {
            let (k, v) = entry.map_err(|e| self.err(e))?;
            let key = codec::decode_stream_key(&k)
                .ok_or_else(|| self.corrupt(format!("malformed stream key {}", hex::encode(&k))))?;
            let state = serde_json::from_slice(&v)
                .map_err(|e| self.corrupt(format!("undecodable state of stream {key}: {e}")))?;
            out.push((key, state));
        }
        Ok(out)
    }

    fn get_records(
        &self,
        key: StreamKey,
        ids: &[i64],
    ) -> Result<Vec<Option<RecordState>>, StateError> {
        // None read for ids never committed to a stream that started empty.
        let absent = self
            .absent_ids(key, ids, true, false)?
            .unwrap_or_else(|| vec![false; ids.len()]);
        self.read_records(key, ids, &absent)
    }

    fn get_versions(
        &self,
        key: StreamKey,
        ids: &[i64],
    ) -> Result<Vec<Option<StoredVersion>>, StateError> {
        // Stored versions exist for every record once `events.changed_fields`
        // or `events.before` is on, and are only read then: dense, so no scan.
        let encoded = self.get_each(
            KIND_VERSION,
            key,
            ids,
            "stored version",
            codec::decode_version,
        )?;
        ids.iter()
            .zip(encoded)
            .map(|(id, v)| v.map(|v| self.resolve_version(key, *id, v)).transpose())
            .collect()
    }

    fn get_tombstones(
        &self,
        key: StreamKey,
        ids: &[i64],
    ) -> Result<Vec<Option<Tombstone>>, StateError> {
        self.get_many(
            KIND_TOMBSTONE,
            key,
            ids,
            "tombstone",
            codec::decode_tombstone,
        )
    }

    fn write_intents(&self, key: StreamKey, intents: &[(i64, Intent)]) -> Result<(), StateError> {
        if intents.is_empty() {
            return Ok(());
        }
        let journal = self.journal(key)?;
        let mut journal = lock(&journal);
        let (plan, _seq) = journal.plan_append(intents);
        if self.staged_touches(key, &plan) {
            // It rewrites an entry a staged commit rewrites: after it, in the log.
            self.settle_group(key)?;
        }
        match single_entry(&plan) {
            // The common case, a page whose ids no older entry holds: one
            // insert, atomic by itself. An `apply_batch` would roll sled's
            // log buffer twice (two more log writes, each synced by sled's
            // I/O threads) for nothing.
            Some((seq, entry)) => {
                let mut value = Vec::new();
                codec::encode_journal(entry, &mut value);
                self.catalog
                    .insert(codec::journal_key(key, seq), value)
                    .map_err(|e| self.err(e))?;
            }
            None => {
                let mut batch = Writes::default();
                add_journal_plan(&mut batch, key, &plan);
                self.apply(batch)?;
            }
        }
        journal.apply(&plan);
        // The events of these intents may reach the sink the moment this
        // returns: the journal must survive a kill -9 from then on. Staged
        // commits stay staged: they are already safe to lose.
        self.db.flush().map_err(|e| self.err(e))?;
        if self.staged_pages(key) > 0 {
            crashpoint::hit(crashpoint::names::INTENTS_BEFORE_STAGED_COMMIT);
        }
        Ok(())
    }

    fn flush(&self) -> Result<(), StateError> {
        // Seen marks stay in memory: they make no change durable (see
        // `state/marks.rs`), and a flush at the end of any stream's sweep
        // would otherwise rewrite every other stream's marked buckets.
        self.settle_groups()?;
        self.db.flush().map_err(|e| self.err(e))?;
        Ok(())
    }

    fn pending_intents(&self, key: StreamKey) -> Result<Vec<(i64, Intent)>, StateError> {
        let journal = self.journal(key)?;
        let pending = lock(&journal).pending();
        Ok(pending)
    }

    fn dead_letters(&self, key: StreamKey) -> Result<Vec<(i64, DeadLetter)>, StateError> {
        self.settle(key)?;
        let mut out = Vec::new();
        for entry in self
            .catalog
            .scan_prefix(codec::prefix(KIND_DEAD_LETTER, key))
        {
            let (k, v) = entry.map_err(|e| self.err(e))?;
            let id = codec::key_id(&k).ok_or_else(|| self.corrupt_value("dead letter", &k))?;
            let letter: DeadLetter =
                serde_json::from_slice(&v).map_err(|_| self.corrupt_value("dead letter", &k))?;
            out.push((id, letter));
        }
        Ok(out)
    }

    fn commit_page(&self, key: StreamKey, page: &Acked<PageCommit>) -> Result<(), StateError> {
        let PageCommit {
            records: commits,
            dead_letters,
            seen,
            epoch,
            versions,
            reprints,
        } = page.batch();
        let epoch = *epoch;
        let journal = self.journal(key)?;
        let mut journal = lock(&journal);
        if lock(&self.marks)
            .get(&key)
            .is_some_and(|m| m.epoch() != epoch)
        {
            // Marks of another epoch first, so that records read as they
            // would had every mark been written at its commit.
            self.write_marks(key)?;
        }
        let plan = journal.plan_removal(commits.iter().map(|(id, _)| *id));
        let mut batch = Writes::default();
        add_journal_plan(&mut batch, key, &plan);
        let mut buckets = BTreeMap::new();
        let mut dirty = BTreeSet::new();
        let mut added = 0u64;
        // A committed record keeps no tombstone and no dead-letter mark (one
        // of this page is written below, over the removal), and no stored
        // version unless this page stores one (written below too): an older
        // one would describe another version.
        let ids: Vec<i64> = commits.iter().map(|(id, _)| *id).collect();
        self.remove_held(&mut batch, KIND_TOMBSTONE, key, &ids)?;
        self.remove_held(&mut batch, KIND_DEAD_LETTER, key, &ids)?;
        if versions.is_empty() {
            self.remove_held(&mut batch, KIND_VERSION, key, &ids)?;
        } else {
            // A page that stores versions comes from a stream that keeps one
            // for every record: dense, remove each (what a scan falls back to).
            batch.remove_ids(KIND_VERSION, key, &ids);
        }
        self.add_dead_letters(&mut batch, key, dead_letters)?;
        let mut new_shapes = NewShapes::new();
        for (id, version) in versions {
            self.add_version(&mut batch, key, (*id, version), false, &mut new_shapes)?;
        }
        let committed: IdSet = ids.iter().copied().collect();
        let mut fresh = Vec::new();
        let mut write_marks = false;
        if let Some(absent) = self.absent_ids(key, &ids, false, true)? {
            // A stream that started empty: every record is staged alone, and
            // only ids its set holds are looked up (a bucket read each).
            let seen_absent = self
                .absent_ids(key, seen, false, false)?
                .unwrap_or_else(|| vec![false; seen.len()]);
            let held = self.read_records(key, &ids, &absent)?;
            let mut counted = IdSet::default();
            for ((id, record), held) in commits.iter().zip(held) {
                if held.is_none() && counted.insert(*id) {
                    added += 1;
                }
                fresh.push((*id, *record));
            }
            let skip: Vec<bool> = seen
                .iter()
                .zip(seen_absent)
                .map(|(id, absent)| absent || committed.contains(id))
                .collect();
            let reprints: IdMap<Reprint> = reprints.iter().copied().collect();
            for (id, record) in seen.iter().zip(self.read_records(key, seen, &skip)?) {
                let Some(mut record) = record else {
                    continue;
                };
                let reprinted = reprints
                    .get(id)
                    .is_some_and(|reprint| reprint.apply(&mut record));
                if reprinted || record.seen_epoch != epoch {
                    record.seen_epoch = epoch;
                    fresh.push((*id, record));
                }
            }
        } else {
            for (id, record) in commits {
                let (bucket, slot) = self.bucket_for(&mut buckets, key, *id)?;
                if bucket.slots[slot].replace(*record).is_none() {
                    added += 1;
                }
                dirty.insert(codec::bucket_of(*id).0);
            }
            write_marks = self.mark_seen(key, seen, reprints, &committed, epoch);
        }
        Self::write_buckets(&mut batch, key, &buckets, &dirty);
        if added > 0 {
            let count = self.stored_count(key)?.saturating_add(added);
            Self::write_count(&mut batch, key, count);
        }
        let bucket_bytes = lock(&self.fresh)
            .get(&key)
            .and_then(Option::as_ref)
            .map_or(0, |fresh| fresh.bucket_bytes);
        self.stage(key, batch, fresh, bucket_bytes)?;
        journal.apply(&plan);
        self.learn_shapes(new_shapes);
        if write_marks {
            // After the page is staged: its buckets, loaded without the
            // marks, are written first (a later group would write over them).
            self.write_marks(key)?;
        }
        if self.group_full(key) {
            self.settle_group(key)?;
        }
        self.sync_if_durable()
    }

    fn unseen_records(
        &self,
        key: StreamKey,
        epoch: u64,
    ) -> Result<Vec<(i64, RecordState)>, StateError> {
        self.scan_records(key, |r| r.seen_epoch < epoch)
    }

    fn record_count(&self, key: StreamKey) -> Result<u64, StateError> {
        self.stored_count(key)
    }

    fn commit_deletes(
        &self,
        key: StreamKey,
        deletes: &Acked<DeleteCommit>,
    ) -> Result<(), StateError> {
        let deletes = &deletes.batch().tombstones;
        if deletes.is_empty() {
            return Ok(());
        }
        self.settle(key)?;
        let journal = self.journal(key)?;
        let mut journal = lock(&journal);
        let plan = journal.plan_removal(deletes.iter().map(|(id, _)| *id));
        let mut batch = Writes::default();
        add_journal_plan(&mut batch, key, &plan);
        let mut buckets = BTreeMap::new();
        let mut dirty = BTreeSet::new();
        let mut value = Vec::with_capacity(32);
        let mut removed = 0u64;
        let ids: Vec<i64> = deletes.iter().map(|(id, _)| *id).collect();
        self.remove_held(&mut batch, KIND_DEAD_LETTER, key, &ids)?;
        self.remove_held(&mut batch, KIND_VERSION, key, &ids)?;
        for (id, tombstone) in deletes {
            let (bucket, slot) = self.bucket_for(&mut buckets, key, *id)?;
            if bucket.slots[slot].take().is_some() {
                dirty.insert(codec::bucket_of(*id).0);
                removed += 1;
            }
            codec::encode_tombstone(tombstone, &mut value);
            batch.insert(&codec::record_key(KIND_TOMBSTONE, key, *id)[..], &value[..]);
        }
        Self::write_buckets(&mut batch, key, &buckets, &dirty);
        if removed > 0 {
            let count = self.stored_count(key)?.saturating_sub(removed);
            Self::write_count(&mut batch, key, count);
        }
        self.apply(batch)?;
        journal.apply(&plan);
        self.sync_if_durable()
    }
}

/// Everything a store holds for one stream: what `state export` writes and
/// `state import` loads (see `crate::control::state_file`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StreamDump {
    /// The stream's lifecycle state (watermark, epochs, replay, pause, ...).
    pub state: StreamState,
    /// Committed records, in id order.
    pub records: Vec<(i64, RecordState)>,
    /// Tombstones of deleted ids, in id order.
    pub tombstones: Vec<(i64, Tombstone)>,
    /// Journalled intents not yet committed, in id order.
    pub intents: Vec<(i64, Intent)>,
    /// Dead-letter marks, in id order.
    pub dead_letters: Vec<(i64, DeadLetter)>,
    /// Stored versions (`events.changed_fields`, `events.before`), in id order.
    pub versions: Vec<(i64, StoredVersion)>,
}

impl SledStore {
    /// True when the store holds anything of `key` (state, records, tombstones, intents).
    pub fn holds(&self, key: StreamKey) -> Result<bool, StateError> {
        self.settle(key)?;
        if self
            .streams
            .contains_key(codec::stream_key(key))
            .map_err(|e| self.err(e))?
        {
            return Ok(true);
        }
        for kind in STREAM_KINDS {
            if let Some(entry) = self.catalog.scan_prefix(codec::prefix(kind, key)).next() {
                entry.map_err(|e| self.err(e))?;
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Everything the store holds for `key`.
    pub fn dump_stream(&self, key: StreamKey) -> Result<StreamDump, StateError> {
        let records = self.scan_records(key, |_| true)?;
        let mut tombstones = Vec::new();
        for entry in self.catalog.scan_prefix(codec::prefix(KIND_TOMBSTONE, key)) {
            let (k, v) = entry.map_err(|e| self.err(e))?;
            let id = codec::key_id(&k).ok_or_else(|| self.corrupt_value("tombstone", &k))?;
            let tombstone =
                codec::decode_tombstone(&v).ok_or_else(|| self.corrupt_value("tombstone", &k))?;
            tombstones.push((id, tombstone));
        }
        let mut versions = Vec::new();
        for entry in self.catalog.scan_prefix(codec::prefix(KIND_VERSION, key)) {
            let (k, v) = entry.map_err(|e| self.err(e))?;
            let id = codec::key_id(&k).ok_or_else(|| self.corrupt_value("stored version", &k))?;
            let encoded = codec::decode_version(&v)
                .ok_or_else(|| self.corrupt_value("stored version", &k))?;
            versions.push((id, self.resolve_version(key, id, encoded)?));
        }
        Ok(StreamDump {
            state: self.load_stream(key)?,
            records,
            tombstones,
            intents: self.pending_intents(key)?,
            dead_letters: self.dead_letters(key)?,
            versions,
        })
    }

    /// Forgets everything of `key`; returns the records it held.
    pub fn forget_stream(&self, key: StreamKey) -> Result<u64, StateError> {
        self.settle(key)?;
        let held = self.stored_count(key)?;
        let mut batch = Writes::default();
        self.remove_stream_entries(&mut batch, key)?;
        let mut journals = lock(&self.journals);
        self.apply(batch)?;
        journals.remove(&key);
        drop(journals);
        self.forget_shapes(key);
        self.forget_fresh(key);
        self.streams
            .remove(codec::stream_key(key))
            .map_err(|e| self.err(e))?;
        self.flush()?;
        Ok(held)
    }

    /// Replaces whatever the store holds of `key` with `dump`: one atomic
    /// batch for records, tombstones, intents and dead-letter marks, then the
    /// stream state, then a flush.
    pub fn restore_stream(&self, key: StreamKey, dump: &StreamDump) -> Result<(), StateError> {
        self.settle(key)?;
        let mut batch = Writes::default();
        self.remove_stream_entries(&mut batch, key)?;
        let mut buckets: BTreeMap<i64, Box<Bucket>> = BTreeMap::new();
        for (id, record) in &dump.records {
            let (bucket, slot) = codec::bucket_of(*id);
            buckets.entry(bucket).or_default().slots[slot] = Some(*record);
        }
        let dirty: BTreeSet<i64> = buckets.keys().copied().collect();
        Self::write_buckets(&mut batch, key, &buckets, &dirty);
        let count = buckets.values().map(|b| b.len() as u64).sum();
        Self::write_count(&mut batch, key, count);
        let mut value = Vec::with_capacity(32);
        for (id, tombstone) in &dump.tombstones {
            codec::encode_tombstone(tombstone, &mut value);
            batch.insert(&codec::record_key(KIND_TOMBSTONE, key, *id)[..], &value[..]);
        }
        self.add_dead_letters(&mut batch, key, &dump.dead_letters)?;
        if !dump.intents.is_empty() {
            let mut value = Vec::new();
            codec::encode_journal(&dump.intents, &mut value);
            batch.insert(&codec::journal_key(key, 0)[..], value);
        }
        // The stream's entries go, shapes included: write its versions' shapes again.
        self.forget_shapes(key);
        let mut new_shapes = NewShapes::new();
        for (id, version) in &dump.versions {
            self.add_version(&mut batch, key, (*id, version), true, &mut new_shapes)?;
        }
        let mut journals = lock(&self.journals);
        self.apply(batch)?;
        self.forget_fresh(key);
        self.learn_shapes(new_shapes);
        // Loaded again from the entries just written on first use.
        journals.remove(&key);
        drop(journals);
        self.save_stream(key, &dump.state)?;
        self.flush()
    }

    /// The stream's committed records that `keep` accepts, in id order.
    fn scan_records(
        &self,
        key: StreamKey,
        keep: impl Fn(&RecordState) -> bool,
    ) -> Result<Vec<(i64, RecordState)>, StateError> {
        self.settle(key)?;
        let mut out = Vec::new();
        for entry in self.catalog.scan_prefix(codec::prefix(KIND_RECORD, key)) {
            let (k, v) = entry.map_err(|e| self.err(e))?;
            let number =
                codec::key_id(&k).ok_or_else(|| self.corrupt_value("record bucket", &k))?;
            let bucket =
                codec::decode_bucket(&v).ok_or_else(|| self.corrupt_value("record bucket", &k))?;
            for (slot, record) in bucket.slots.iter().enumerate() {
                if let Some(record) = record.filter(&keep) {
                    out.push((codec::id_in_bucket(number, slot), record));
                }
            }
        }
        Ok(out)
    }

    /// Adds the removal of every catalog entry of `key` to `batch`.
    fn remove_stream_entries(&self, batch: &mut Writes, key: StreamKey) -> Result<(), StateError> {
        self.settle(key)?;
        for kind in STREAM_KINDS {
            for entry in self.catalog.scan_prefix(codec::prefix(kind, key)) {
                let (k, _) = entry.map_err(|e| self.err(e))?;
                batch.remove(k);
            }
        }
        Ok(())
    }
}

/// Entries a span scan reads before it gives up and the ids are looked up
/// one by one: past twice the ids, the span is dense with entries of other
/// ids and the lookups are the cheaper way.
fn span_scan_limit(ids: usize) -> usize {
    2 * ids + 8
}

/// Every kind of catalog entry a stream has.
const STREAM_KINDS: [u8; 7] = [
    KIND_RECORD,
    KIND_JOURNAL,
    KIND_COUNT,
    KIND_TOMBSTONE,
    KIND_DEAD_LETTER,
    KIND_VERSION,
    KIND_SHAPE,
];

/// The plan's only change when it writes exactly one non-empty entry.
fn single_entry(plan: &JournalPlan) -> Option<(u64, &[(i64, Intent)])> {
    let mut changes = plan.changes.iter();
    match (changes.next(), changes.next()) {
        (Some((seq, Some(entry))), None) if !entry.is_empty() => Some((*seq, entry)),
        _ => None,
    }
}

/// Adds the journal entry writes and removals of `plan` to `batch`.
fn add_journal_plan(batch: &mut Writes, key: StreamKey, plan: &JournalPlan) {
    let mut value = Vec::new();
    for (seq, contents) in &plan.changes {
        let k = codec::journal_key(key, *seq);
        match contents {
            Some(intents) if !intents.is_empty() => {
                codec::encode_journal(intents, &mut value);
                batch.insert(&k[..], &value[..]);
            }
            _ => batch.remove(&k[..]),
        }
    }
}

/// Locks a mutex; a panic elsewhere never leaves these indexes half-updated
/// (plans are applied only after their batch succeeded, without panicking).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Reads the layout marker: None when absent, an error when unknown or unreadable.
fn read_marker(path: &Path) -> Result<Option<u32>, StateError> {
    let text = match std::fs::read_to_string(path.join(LAYOUT_MARKER)) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.kind() == io::ErrorKind::NotADirectory => {
            return Err(StateError::Io {
                path: path.to_path_buf(),
                source: io::Error::new(
                    e.kind(),
                    "a path component is a file, expected a directory",
                ),
            })
        }
        Err(e) => return Err(map_io_error(path.to_path_buf(), e)),
    };
    let found = text
        .trim()
        .strip_prefix("layout_version = ")
        .and_then(|v| v.parse::<u32>().ok())
        .ok_or_else(|| StateError::Corrupt {
            path: path.to_path_buf(),
            detail: format!("{LAYOUT_MARKER} does not hold `layout_version = N`"),
        })?;
    if !readable(found) {
        return Err(StateError::UnsupportedVersion {
            path: path.to_path_buf(),
            found,
            supported: LAYOUT_VERSION,
        });
    }
    Ok(Some(found))
}

/// Writes the layout marker durably.
fn write_marker(path: &Path) -> Result<(), StateError> {
    use std::io::Write;
    let write = || -> io::Result<()> {
        let tmp = path.join(format!("{LAYOUT_MARKER}.tmp"));
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(format!("layout_version = {LAYOUT_VERSION}\n").as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&tmp, path.join(LAYOUT_MARKER))?;
        std::fs::File::open(path)?.sync_all()
    };
    write().map_err(|e| map_io_error(path.to_path_buf(), e))
}

/// Maps a sled error to one clear line naming the path and what to do.
pub(crate) fn map_sled_error(path: &Path, e: sled::Error) -> StateError {
    let path = path.to_path_buf();
    match e {
        sled::Error::Io(source) => map_io_error(path, source),
        sled::Error::Corruption { at, .. } => StateError::Corrupt {
            path,
            detail: match at {
                Some(at) => format!("damaged data at {at:?}"),
                None => "damaged data".to_string(),
            },
        },
        sled::Error::Unsupported(detail) => StateError::Backend {
            path,
            detail: format!("unsupported use of the store: {detail}"),
        },
        sled::Error::ReportableBug(detail) => StateError::Backend {
            path,
            detail: format!("internal storage error: {detail}"),
        },
        sled::Error::CollectionNotFound(name) => StateError::Corrupt {
            path,
            detail: format!("tree {:?} is missing", String::from_utf8_lossy(&name)),
        },
    }
}

/// Maps an I/O error seen while opening or using the store.
fn map_io_error(path: PathBuf, source: io::Error) -> StateError {
    let message = source.to_string();
    if source.kind() == io::ErrorKind::WouldBlock || message.contains("could not acquire lock") {
        return StateError::Locked { path };
    }
    match source.kind() {
        io::ErrorKind::PermissionDenied => StateError::PermissionDenied { path, source },
        io::ErrorKind::UnexpectedEof | io::ErrorKind::InvalidData => StateError::Corrupt {
            path,
            detail: message,
        },
        _ => StateError::Io { path, source },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::ContentHash;
    use crate::state::{Delivery, ReplayState};
    use crate::stream::Resource;
    use chrono::TimeZone;

    const VOUCHERS: StreamKey = StreamKey {
        tenant: 42,
        resource: Resource::Vouchers,
    };
    const CATEGORIES: StreamKey = StreamKey {
        tenant: 42,
        resource: Resource::Categories,
    };
    const OTHER_TENANT: StreamKey = StreamKey {
        tenant: 7,
        resource: Resource::Vouchers,
    };

    fn h(byte: u8) -> ContentHash {
        ContentHash([byte; 16])
    }

    /// Commits as the sweep does once every event of the batch is acknowledged.
    impl SledStore {
        fn commit_records(
            &self,
            key: StreamKey,
            commits: &[(i64, RecordState)],
            seen: &[i64],
            epoch: u64,
        ) -> Result<(), StateError> {
            let acks = vec![Delivery::Acknowledged; commits.len()];
            let page = Acked::page(commits.to_vec(), acks, seen.to_vec(), epoch).unwrap();
            self.commit_page(key, &page)
        }

        fn delete_records(
            &self,
            key: StreamKey,
            deletes: &[(i64, Tombstone)],
        ) -> Result<(), StateError> {
            let acks = vec![Delivery::Acknowledged; deletes.len()];
            self.commit_deletes(key, &Acked::deletes(deletes.to_vec(), &acks).unwrap())
        }
    }

    fn record(byte: u8, seen_epoch: u64) -> RecordState {
        RecordState {
            hash: h(byte),
            updated_at: Some(1_700_000_000_000_000 + i64::from(byte)),
            seen_epoch,
            generation: 0,
            seq: u64::from(byte),
            print: None,
        }
    }

    fn intent(byte: u8) -> Intent {
        Intent {
            hash: h(byte),
            updated_at: None,
            generation: 1,
            seq: 2,
            op: Some(crate::event::Op::Update),
            previous: Some(h(byte.wrapping_add(1))),
            replay: Some([byte; 16]),
        }
    }

    fn letter(byte: u8) -> DeadLetter {
        DeadLetter {
            since: chrono::Utc
                .timestamp_opt(1_700_000_000 + i64::from(byte), 0)
                .unwrap(),
            reason: format!("event {byte} exceeds the broker's limit"),
            limit: Some(u64::from(byte)),
        }
    }

    fn tombstone(byte: u8, generation: u32) -> Tombstone {
        Tombstone {
            generation,
            last_hash: h(byte),
            updated_at: Some(5),
        }
    }

    fn open(dir: &tempfile::TempDir) -> SledStore {
        reopen(&dir.path().join("state")).unwrap()
    }

    /// Opens the store at `path`, waiting (up to 10 s) while a handle this
    /// test just dropped still holds its lock: sled's background threads let
    /// go of the file a moment after the drop, later on a loaded machine.
    fn reopen(path: &Path) -> Result<SledStore, StateError> {
        reopen_with_cache(path, CACHE_CAPACITY)
    }

    /// [`reopen`] with a page cache of `cache_bytes`.
    fn reopen_with_cache(path: &Path, cache_bytes: u64) -> Result<SledStore, StateError> {
        until_unlocked(|| SledStore::open_with_cache(path, cache_bytes))
    }

    /// Calls `open` until it does not fail with [`StateError::Locked`], for
    /// up to 10 s: sled lets go of a dropped database's lock a moment later.
    fn until_unlocked<T>(mut open: impl FnMut() -> Result<T, StateError>) -> Result<T, StateError> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            match open() {
                Err(StateError::Locked { .. }) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                opened => return opened,
            }
        }
    }

    #[test]
    fn a_new_store_knows_no_stream_and_no_record() {
        let store = SledStore::open_temporary().unwrap();
        assert_eq!(store.load_stream(VOUCHERS).unwrap(), StreamState::default());
        assert!(store.streams().unwrap().is_empty());
        assert_eq!(
            store.get_records(VOUCHERS, &[1, 2]).unwrap(),
            vec![None, None]
        );
        assert_eq!(store.get_tombstones(VOUCHERS, &[1]).unwrap(), vec![None]);
        assert!(store.pending_intents(VOUCHERS).unwrap().is_empty());
        assert!(store.unseen_records(VOUCHERS, 5).unwrap().is_empty());
        assert_eq!(store.record_count(VOUCHERS).unwrap(), 0);
    }

    #[test]
    fn stream_state_round_trips_and_streams_lists_every_saved_stream_in_key_order() {
        let store = SledStore::open_temporary().unwrap();
        let at = chrono::Utc.with_ymd_and_hms(2024, 5, 1, 10, 0, 0).unwrap();
        let state = StreamState {
            watermark: Some(at),
            replay: Some(ReplayState {
                id: "r1".into(),
                since: None,
                requested_at: at,
                pending: true,
                records: 3,
                epoch: Some(5),
                requested_by: Some(crate::state::RequestedBy::Api),
                previous_watermark: None,
                cancelled_at: None,
            }),
            full_sweep_epoch: 4,
            last_error: Some("upstream 503".into()),
            parked: Some("403 forbidden".into()),
            records_known: 10,
            ..StreamState::default()
        };
        store.save_stream(VOUCHERS, &state).unwrap();
        store
            .save_stream(OTHER_TENANT, &StreamState::default())
            .unwrap();
        store
            .save_stream(CATEGORIES, &StreamState::default())
            .unwrap();
        assert_eq!(store.load_stream(VOUCHERS).unwrap(), state);
        let keys: Vec<StreamKey> = store
            .streams()
            .unwrap()
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(keys, vec![OTHER_TENANT, CATEGORIES, VOUCHERS]);
    }

    #[test]
    fn commit_page_upserts_records_and_clears_their_intents_and_tombstones() {
        let store = SledStore::open_temporary().unwrap();
        store
            .write_intents(VOUCHERS, &[(1, intent(1)), (2, intent(2)), (3, intent(3))])
            .unwrap();
        store
            .delete_records(VOUCHERS, &[(2, tombstone(9, 1))])
            .unwrap();
        // The delete cleared the intent of record 2.
        assert_eq!(
            store.pending_intents(VOUCHERS).unwrap(),
            vec![(1, intent(1)), (3, intent(3))]
        );
        store
            .commit_records(VOUCHERS, &[(1, record(1, 0)), (2, record(2, 0))], &[], 0)
            .unwrap();
        assert_eq!(
            store.get_records(VOUCHERS, &[2, 3, 1]).unwrap(),
            vec![Some(record(2, 0)), None, Some(record(1, 0))]
        );
        assert_eq!(
            store.pending_intents(VOUCHERS).unwrap(),
            vec![(3, intent(3))]
        );
        assert_eq!(store.get_tombstones(VOUCHERS, &[2]).unwrap(), vec![None]);
        // Upsert replaces.
        store
            .commit_records(VOUCHERS, &[(1, record(7, 0))], &[], 0)
            .unwrap();
        assert_eq!(
            store.get_records(VOUCHERS, &[1]).unwrap(),
            vec![Some(record(7, 0))]
        );
        assert_eq!(store.record_count(VOUCHERS).unwrap(), 2);
    }

    #[test]
    fn a_version_staged_by_one_page_goes_with_the_next_commit_of_its_id_that_stores_none() {
        let store = SledStore::open_temporary().unwrap();
        let kept = version(h(1), r#"{"id":9,"a":1}"#);
        store
            .commit_versions(VOUCHERS, &[(9, record(1, 1))], &[(9, kept)])
            .unwrap();
        store
            .commit_records(VOUCHERS, &[(9, record(2, 1))], &[], 1)
            .unwrap();
        assert_eq!(store.staged_pages(VOUCHERS), 2);
        assert_eq!(store.get_versions(VOUCHERS, &[9]).unwrap(), vec![None]);
        store.flush().unwrap();
        assert_eq!(store.get_versions(VOUCHERS, &[9]).unwrap(), vec![None]);
    }

    #[test]
    fn reads_of_many_ids_answer_every_id_in_order_repeats_included() {
        let store = SledStore::open_temporary().unwrap();
        store
            .delete_records(VOUCHERS, &[(5, tombstone(5, 1)), (-3, tombstone(3, 1))])
            .unwrap();
        assert_eq!(
            store.get_tombstones(VOUCHERS, &[5, -3, 5, 7, -3]).unwrap(),
            vec![
                Some(tombstone(5, 1)),
                Some(tombstone(3, 1)),
                Some(tombstone(5, 1)),
                None,
                Some(tombstone(3, 1))
            ]
        );
        assert_eq!(store.get_tombstones(VOUCHERS, &[]).unwrap(), Vec::new());
    }

    #[test]
    fn a_commit_clears_its_ids_tombstones_and_marks_however_many_others_lie_between_them() {
        let store = SledStore::open_temporary().unwrap();
        let dense: Vec<(i64, Tombstone)> = (0..100).map(|id| (id, tombstone(1, 1))).collect();
        store.delete_records(VOUCHERS, &dense).unwrap();
        // Two ids whose span holds 100 tombstones (past the scan's limit),
        // then two whose span holds only theirs.
        store
            .commit_records(VOUCHERS, &[(0, record(1, 0)), (99, record(2, 0))], &[], 0)
            .unwrap();
        store
            .commit_records(VOUCHERS, &[(40, record(3, 0)), (41, record(4, 0))], &[], 0)
            .unwrap();
        let all: Vec<i64> = (0..100).collect();
        let left: Vec<i64> = all
            .iter()
            .zip(store.get_tombstones(VOUCHERS, &all).unwrap())
            .filter_map(|(id, t)| t.map(|_| *id))
            .collect();
        let expected: Vec<i64> = (1..99).filter(|id| *id != 40 && *id != 41).collect();
        assert_eq!(left, expected);

        // A dead-letter mark staged by one page commit goes with the next
        // commit of its id, before either reaches sled.
        store.flush().unwrap();
        let acks = vec![Delivery::DeadLettered(letter(5))];
        let page = Acked::page(vec![(500, record(5, 0))], acks, Vec::new(), 0).unwrap();
        store.commit_page(VOUCHERS, &page).unwrap();
        let mark = codec::record_key(KIND_DEAD_LETTER, VOUCHERS, 500);
        assert!(store.read(VOUCHERS, &mark).unwrap().is_some());
        store
            .commit_records(VOUCHERS, &[(500, record(6, 0))], &[], 0)
            .unwrap();
        assert_eq!(store.staged_pages(VOUCHERS), 2);
        assert_eq!(store.dead_letters(VOUCHERS).unwrap(), Vec::new());
    }

    #[test]
    fn a_page_of_new_intents_written_in_one_insert_is_cleared_by_its_commit_across_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = open(&dir);
            // No older entry holds these ids: the single-insert path.
            store
                .write_intents(VOUCHERS, &[(1, intent(1)), (2, intent(2))])
                .unwrap();
            store
                .commit_records(VOUCHERS, &[(1, record(1, 0))], &[], 0)
                .unwrap();
            store.write_intents(VOUCHERS, &[(5, intent(5))]).unwrap();
            store.flush().unwrap();
        }
        let store = open(&dir);
        assert_eq!(
            store.pending_intents(VOUCHERS).unwrap(),
            vec![(2, intent(2)), (5, intent(5))]
        );
    }

    /// The intents as a reopened store would load them from what sled holds
    /// now, staged commits left out (what a kill -9 would leave).
    fn intents_on_disk(store: &SledStore, key: StreamKey) -> Vec<(i64, Intent)> {
        let entries = store
            .catalog
            .scan_prefix(codec::prefix(KIND_JOURNAL, key))
            .map(|e| {
                let (k, v) = e.unwrap();
                let seq = codec::journal_seq(&k).unwrap();
                (seq, codec::decode_journal(&v).unwrap())
            })
            .collect();
        StreamJournal::load(entries).0.pending()
    }

    /// A temporary store whose staged commits are written by `limits`.
    fn store_with(limits: StageLimits) -> SledStore {
        let mut store = SledStore::open_temporary().unwrap();
        store.limits = limits;
        store
    }

    /// Limits no test reaches: groups end only on a flush or another settle.
    const NEVER: StageLimits = StageLimits {
        age: Duration::from_secs(3600),
        stream_bytes: usize::MAX,
        total_bytes: usize::MAX,
        batch_keys: 64,
    };

    /// Journals and commits one record per page, ids 40 apart (one bucket each).
    fn commit_pages(store: &SledStore, key: StreamKey, pages: std::ops::Range<i64>) {
        for page in pages {
            let id = page * 40;
            store.write_intents(key, &[(id, intent(1))]).unwrap();
            store
                .commit_records(key, &[(id, record(1, 0))], &[], 0)
                .unwrap();
        }
    }

    #[test]
    fn page_commits_are_read_at_once_and_stay_staged_until_their_group_ends_or_a_flush() {
        let store = store_with(NEVER);
        for page in 0..6i64 {
            commit_pages(&store, VOUCHERS, page..page + 1);
            let id = page * 40;
            assert_eq!(
                store.get_records(VOUCHERS, &[id]).unwrap(),
                vec![Some(record(1, 0))]
            );
            assert!(store.pending_intents(VOUCHERS).unwrap().is_empty());
            assert_eq!(store.record_count(VOUCHERS).unwrap(), page as u64 + 1);
            assert_eq!(store.staged_pages(VOUCHERS), page as usize + 1);
            // Until written, a crash would find the intents of every staged page.
            let on_disk: Vec<i64> = intents_on_disk(&store, VOUCHERS)
                .iter()
                .map(|(id, _)| *id)
                .collect();
            assert_eq!(on_disk, (0..=page).map(|p| p * 40).collect::<Vec<_>>());
        }
        store.flush().unwrap();
        assert_eq!(store.staged_pages(VOUCHERS), 0);
        assert!(intents_on_disk(&store, VOUCHERS).is_empty());
    }

    #[test]
    fn a_group_ends_at_the_first_commit_that_finds_it_old_or_too_large_for_its_stream_or_for_all() {
        let written = |store: &SledStore, key| store.staged_pages(key) == 0;
        // Age: a group older than the limit is written by its next commit.
        let store = store_with(StageLimits {
            age: Duration::from_millis(50),
            ..NEVER
        });
        commit_pages(&store, VOUCHERS, 0..1);
        assert!(!written(&store, VOUCHERS));
        std::thread::sleep(Duration::from_millis(60));
        commit_pages(&store, VOUCHERS, 1..2);
        assert!(written(&store, VOUCHERS));
        assert!(intents_on_disk(&store, VOUCHERS).is_empty());

        // The bytes one page stages: a bucket, a journal removal and the count.
        let store = store_with(NEVER);
        commit_pages(&store, VOUCHERS, 0..1);
        let one = lock(&store.staged)[&VOUCHERS].bytes;
        assert!(one > 40, "{one}");

        // One stream's bytes.
        let store = store_with(StageLimits {
            stream_bytes: one + 1,
            ..NEVER
        });
        commit_pages(&store, VOUCHERS, 0..1);
        assert!(!written(&store, VOUCHERS));
        commit_pages(&store, VOUCHERS, 1..2);
        assert!(written(&store, VOUCHERS));

        // Every stream's bytes together: the committing stream's group ends.
        let categories = StreamKey::new(1, crate::stream::Resource::Categories);
        let store = store_with(StageLimits {
            total_bytes: 2 * one + 1,
            ..NEVER
        });
        commit_pages(&store, VOUCHERS, 0..1);
        commit_pages(&store, categories, 0..1);
        assert!(!written(&store, VOUCHERS) && !written(&store, categories));
        commit_pages(&store, categories, 1..2);
        assert!(written(&store, categories));
        assert!(!written(&store, VOUCHERS));
    }

    /// Journals and commits three pages of 50 records, each record in a
    /// bucket of its own (buckets 0..150), without writing them; their ids.
    fn stage_three_wide_pages(store: &SledStore, key: StreamKey) -> Vec<i64> {
        let mut ids = Vec::new();
        for page in 0..3i64 {
            let page_ids: Vec<i64> = (0..50).map(|n| (n * 3 + page) * 32 + page).collect();
            let intents: Vec<_> = page_ids.iter().map(|&id| (id, intent(2))).collect();
            store.write_intents(key, &intents).unwrap();
            let commits: Vec<_> = page_ids.iter().map(|&id| (id, record(2, 0))).collect();
            store.commit_records(key, &commits, &[], 0).unwrap();
            ids.extend(page_ids);
        }
        ids
    }

    /// What a settle of `key` writes, in order: the record counts it writes,
    /// the position of its last bucket write and of its first journal write.
    fn watch_settle(store: &SledStore, key: StreamKey) -> (Vec<u64>, Option<usize>, Option<usize>) {
        let mut events = store.catalog.watch_prefix(Vec::new());
        store.settle(key).unwrap();
        let (mut counts, mut last_bucket, mut first_journal) = (Vec::new(), None, None);
        let mut n = 0;
        while let Ok(event) = events.next_timeout(Duration::from_millis(200)) {
            match (event.key()[0], &event) {
                (KIND_COUNT, sled::Event::Insert { value, .. }) => {
                    counts.push(u64::from_be_bytes(value[..].try_into().unwrap()))
                }
                (KIND_RECORD, _) => last_bucket = Some(n),
                (KIND_JOURNAL, _) => {
                    first_journal.get_or_insert(n);
                }
                _ => {}
            }
            n += 1;
        }
        (counts, last_bucket, first_journal)
    }

    /// Makes the store treat `key` as a stream that held records when first
    /// touched: its commits read and stage whole buckets.
    fn without_fresh_path(store: &SledStore, key: StreamKey) {
        lock(&store.fresh).insert(key, None);
    }

    #[test]
    fn a_group_too_large_for_one_batch_is_written_buckets_first_each_batch_with_its_count_journal_last(
    ) {
        // Records staged with their buckets, and staged alone (new to a stream that started empty).
        for whole in [true, false] {
            a_group_too_large_for_one_batch_is_written_in_order(whole);
        }
    }

    fn a_group_too_large_for_one_batch_is_written_in_order(whole: bool) {
        let store = store_with(NEVER);
        if whole {
            without_fresh_path(&store, VOUCHERS);
        }
        // On disk first: the count entry, and a record in each of buckets
        // 0..10, which the group then adds a second record to.
        let first: Vec<_> = (0..10).map(|b| (b * 32 + 31, record(1, 0))).collect();
        store.commit_records(VOUCHERS, &first, &[], 0).unwrap();
        store.flush().unwrap();
        let ids = stage_three_wide_pages(&store, VOUCHERS);
        let (alone, staged_whole) = staged_buckets(&store, VOUCHERS);
        let staged = if whole { staged_whole } else { alone };
        assert_eq!(staged, (0..150).collect::<Vec<i64>>(), "whole: {whole}");
        let (counts, last_bucket, first_journal) = watch_settle(&store, VOUCHERS);
        // Batches of 64 buckets, the last with the journal removals (which
        // sled applies in key order, so ahead of the buckets in that batch).
        assert!(
            first_journal.unwrap() > 2 * NEVER.batch_keys,
            "an intent was removed before the buckets of earlier batches were written"
        );
        assert!(last_bucket.unwrap() > first_journal.unwrap());
        // Each batch writes the count as of itself: 10 + 64, + 64, + 22.
        assert_eq!(counts, vec![74, 138, 160]);
        assert!(intents_on_disk(&store, VOUCHERS).is_empty());
        assert!(store
            .get_records(VOUCHERS, &ids)
            .unwrap()
            .iter()
            .all(|r| *r == Some(record(2, 0))));
        // The count entry agrees with the buckets (the scan it stands for).
        store
            .catalog
            .remove(codec::prefix(KIND_COUNT, VOUCHERS))
            .unwrap();
        assert_eq!(store.record_count(VOUCHERS).unwrap(), 160);
    }

    #[test]
    fn a_stream_without_a_count_on_disk_gets_none_until_the_last_batch_of_its_group() {
        let store = store_with(NEVER);
        stage_three_wide_pages(&store, VOUCHERS);
        let (counts, _, _) = watch_settle(&store, VOUCHERS);
        assert_eq!(counts, vec![150]);
        assert_eq!(store.record_count(VOUCHERS).unwrap(), 150);
    }

    #[test]
    fn staged_bytes_count_each_key_once_and_its_latest_value() {
        let write = |pairs: &[(&[u8], Option<&[u8]>)]| {
            let mut writes = Writes::default();
            for (k, v) in pairs {
                match v {
                    Some(v) => writes.insert(k, *v),
                    None => writes.remove(k),
                }
            }
            writes
        };
        let mut staged = Staged::new();
        let mut add = |writes: Writes, fresh: &[i64]| {
            let fresh = fresh.iter().map(|&id| (id, record(1, 0))).collect();
            staged.add(VOUCHERS, writes, fresh, 0).unwrap();
            staged.bytes
        };
        assert_eq!(
            add(write(&[(b"key-a", Some(&[0; 30])), (b"key-b", None)]), &[]),
            5 + 30 + 5
        );
        assert_eq!(
            add(
                write(&[(b"key-a", Some(&[0; 10])), (b"key-c", Some(&[0; 4]))]),
                &[]
            ),
            5 + 10 + 5 + 5 + 4
        );
        let whole = 5 + 5 + 7 + 5 + 4;
        assert_eq!(
            add(write(&[(b"key-a", None), (b"key-b", Some(&[0; 7]))]), &[]),
            whole
        );
        // Records staged alone: each its bytes, each bucket once more.
        let mut alone = FreshRecords::default();
        for id in [1, 2, 40] {
            alone.push(id, &record(1, 0));
        }
        assert_eq!(
            add(Writes::default(), &[1, 2, 40]),
            whole + alone.bytes() + 2 * FRESH_BUCKET_BYTES
        );
        assert_eq!(staged.pages, 4);
    }

    #[test]
    fn a_crash_with_a_staged_commit_leaves_its_intents_and_a_later_pages_intent_for_the_same_id_wins(
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        {
            let store = open(&dir);
            store
                .write_intents(VOUCHERS, &[(1, intent(1)), (2, intent(2))])
                .unwrap();
            store
                .commit_records(VOUCHERS, &[(1, record(1, 0)), (2, record(2, 0))], &[], 0)
                .unwrap();
            // Record 1 again in the next page, planned against the staged commit.
            store.write_intents(VOUCHERS, &[(1, intent(11))]).unwrap();
            assert_eq!(
                intents_on_disk(&store, VOUCHERS),
                vec![(1, intent(11)), (2, intent(2))]
            );
            // A new entry number: the staged removal of the first entry cannot
            // delete the second page's intents once written.
            store.flush().unwrap();
            assert_eq!(intents_on_disk(&store, VOUCHERS), vec![(1, intent(11))]);
            store.write_intents(VOUCHERS, &[(3, intent(3))]).unwrap();
            store
                .commit_records(VOUCHERS, &[(3, record(3, 0))], &[], 0)
                .unwrap();
            // Dropped without a flush: the staged commit is written at close.
        }
        let store = reopen(&path).unwrap();
        assert_eq!(
            store.pending_intents(VOUCHERS).unwrap(),
            vec![(1, intent(11))]
        );
        assert_eq!(
            store.get_records(VOUCHERS, &[2, 3]).unwrap(),
            vec![Some(record(2, 0)), Some(record(3, 0))]
        );
    }

    #[test]
    fn a_partly_committed_intent_batch_keeps_the_rest_pending_across_reopens() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = open(&dir);
            store
                .write_intents(VOUCHERS, &[(1, intent(1)), (2, intent(2)), (3, intent(3))])
                .unwrap();
            // Record 3 is journalled again by a later batch: only the newest counts.
            store
                .write_intents(VOUCHERS, &[(3, intent(33)), (4, intent(4))])
                .unwrap();
            store.write_intents(CATEGORIES, &[(1, intent(9))]).unwrap();
            store
                .commit_records(VOUCHERS, &[(1, record(1, 0))], &[], 0)
                .unwrap();
            store
                .delete_records(VOUCHERS, &[(4, tombstone(4, 1))])
                .unwrap();
            assert_eq!(
                store.pending_intents(VOUCHERS).unwrap(),
                vec![(2, intent(2)), (3, intent(33))]
            );
            store.flush().unwrap();
        }
        let store = open(&dir);
        assert_eq!(
            store.pending_intents(VOUCHERS).unwrap(),
            vec![(2, intent(2)), (3, intent(33))]
        );
        assert_eq!(
            store.pending_intents(CATEGORIES).unwrap(),
            vec![(1, intent(9))]
        );
        store
            .commit_records(VOUCHERS, &[(2, record(2, 0)), (3, record(3, 0))], &[], 0)
            .unwrap();
        assert!(store.pending_intents(VOUCHERS).unwrap().is_empty());
        // No journal entry is left behind once every intent was cleared.
        let entries = store
            .raw()
            .scan_prefix(codec::prefix(KIND_JOURNAL, VOUCHERS))
            .count();
        assert_eq!(entries, 0);
    }

    #[test]
    fn seen_ids_get_the_epoch_only_when_they_exist_and_commits_win_over_seen() {
        let store = SledStore::open_temporary().unwrap();
        store
            .commit_records(
                VOUCHERS,
                &[(1, record(1, 1)), (2, record(2, 1)), (3, record(3, 1))],
                &[],
                1,
            )
            .unwrap();
        store
            .commit_records(VOUCHERS, &[(3, record(33, 2))], &[1, 3, 99], 2)
            .unwrap();
        assert_eq!(
            store.get_records(VOUCHERS, &[1, 2, 3, 99]).unwrap(),
            vec![
                Some(record(1, 2)),
                Some(record(2, 1)),
                Some(record(33, 2)),
                None
            ]
        );
        assert_eq!(
            store.unseen_records(VOUCHERS, 2).unwrap(),
            vec![(2, record(2, 1))]
        );
        assert!(store.unseen_records(VOUCHERS, 1).unwrap().is_empty());
        assert_eq!(store.record_count(VOUCHERS).unwrap(), 3);
    }

    /// A store whose stream `key` held `records` (epoch 1) when this process
    /// first touched it, so that its commits take the path of such streams.
    fn store_holding(records: &[i64]) -> SledStore {
        let store = store_with(NEVER);
        let commits: Vec<_> = records
            .iter()
            .map(|id| (*id, record(*id as u8, 1)))
            .collect();
        store.commit_records(VOUCHERS, &commits, &[], 1).unwrap();
        store.settle(VOUCHERS).unwrap();
        store.forget_fresh(VOUCHERS);
        store
    }

    /// The `seen_epoch` of each of `ids` as sled holds it (what a reopen reads).
    fn written_epochs(store: &SledStore, ids: &[i64]) -> Vec<Option<u64>> {
        ids.iter()
            .map(|id| {
                let (bucket, slot) = codec::bucket_of(*id);
                let k = codec::record_key(KIND_RECORD, VOUCHERS, bucket);
                let value = store.catalog.get(k).unwrap()?;
                codec::bucket_slot(&value, slot)
                    .unwrap()
                    .map(|r| r.seen_epoch)
            })
            .collect()
    }

    #[test]
    fn seen_marks_read_at_once_and_reach_their_buckets_before_the_unseen_records_are_listed() {
        let store = store_holding(&[1, 2, 3, 40]);
        store.commit_records(VOUCHERS, &[], &[1, 3, 99], 2).unwrap();
        store.commit_records(VOUCHERS, &[], &[40], 2).unwrap();
        assert_eq!(
            store.get_records(VOUCHERS, &[1, 2, 3, 40, 99]).unwrap(),
            vec![
                Some(record(1, 2)),
                Some(record(2, 1)),
                Some(record(3, 2)),
                Some(record(40, 2)),
                None
            ]
        );
        assert_eq!(
            written_epochs(&store, &[1, 2, 3, 40]),
            vec![Some(1); 4],
            "held in memory: no bucket rewritten per page"
        );
        assert_eq!(
            store.unseen_records(VOUCHERS, 2).unwrap(),
            vec![(2, record(2, 1))]
        );
        assert_eq!(
            written_epochs(&store, &[1, 2, 3, 40, 99]),
            vec![Some(2), Some(1), Some(2), Some(2), None]
        );
        assert_eq!(
            store.record_count(VOUCHERS).unwrap(),
            4,
            "a mark creates no record"
        );
    }

    /// Each of `ids` as sled holds it, after the stream's marks are written.
    fn settled(store: &SledStore, ids: &[i64]) -> Vec<Option<RecordState>> {
        store.settle(VOUCHERS).unwrap();
        store.get_records(VOUCHERS, ids).unwrap()
    }

    #[test]
    fn a_reprint_is_kept_only_by_a_record_that_still_has_its_hash_on_either_write_path() {
        use crate::hash::RawPrint;
        let reprint = |id: i64, byte: u8| {
            let reprint = Reprint {
                hash: h(byte),
                print: RawPrint(id as u64 * 1000),
            };
            (id, reprint)
        };
        // 1 and 2 reprinted with their own hash, 3 with a hash it does not
        // have (its content changed since the print was made).
        let reprints = vec![reprint(1, 1), reprint(2, 2), reprint(3, 0x33)];
        let seen_page = |epoch| {
            Acked::page(Vec::new(), Vec::new(), vec![1, 2, 3], epoch)
                .unwrap()
                .with_reprints(reprints.clone())
        };
        let expected = |epoch| {
            let printed = |id: u8| RecordState {
                print: Some(RawPrint(u64::from(id) * 1000)),
                ..record(id, epoch)
            };
            vec![Some(printed(1)), Some(printed(2)), Some(record(3, epoch))]
        };
        // A stream that held records when the process first touched it:
        // the reprints ride with the seen marks.
        let store = store_holding(&[1, 2, 3]);
        store.commit_page(VOUCHERS, &seen_page(2)).unwrap();
        assert_eq!(settled(&store, &[1, 2, 3]), expected(2));
        // A stream that started empty in this process: they are staged.
        let store = store_with(NEVER);
        let commits: Vec<_> = (1..=3).map(|id| (id, record(id as u8, 1))).collect();
        store.commit_records(VOUCHERS, &commits, &[], 1).unwrap();
        store.commit_page(VOUCHERS, &seen_page(2)).unwrap();
        assert_eq!(settled(&store, &[1, 2, 3]), expected(2));
    }

    #[test]
    fn seen_marks_of_an_older_epoch_are_written_before_a_commit_of_a_new_one() {
        let store = store_holding(&[1, 2]);
        store.commit_records(VOUCHERS, &[], &[1], 2).unwrap();
        store.commit_records(VOUCHERS, &[], &[2], 3).unwrap();
        assert_eq!(written_epochs(&store, &[1, 2]), vec![Some(2), Some(1)]);
        assert_eq!(
            store.get_records(VOUCHERS, &[1, 2]).unwrap(),
            vec![Some(record(1, 2)), Some(record(2, 3))]
        );
        // Epochs need not grow: the marks of 3 are written before those of 1.
        store.commit_records(VOUCHERS, &[], &[1, 2], 1).unwrap();
        assert_eq!(written_epochs(&store, &[1, 2]), vec![Some(2), Some(3)]);
        assert_eq!(
            store.get_records(VOUCHERS, &[1, 2]).unwrap(),
            vec![Some(record(1, 1)), Some(record(2, 1))]
        );
    }

    #[test]
    fn a_seen_mark_neither_survives_its_records_delete_nor_overrides_a_later_commit() {
        let store = store_holding(&[1, 2]);
        store.commit_records(VOUCHERS, &[], &[1, 2], 2).unwrap();
        store
            .delete_records(VOUCHERS, &[(1, tombstone(1, 1))])
            .unwrap();
        // A commit's record keeps the epoch it carries, whatever was marked.
        store
            .commit_records(VOUCHERS, &[(2, record(22, 7))], &[], 2)
            .unwrap();
        assert_eq!(
            store.get_records(VOUCHERS, &[1, 2]).unwrap(),
            vec![None, Some(record(22, 7))]
        );
        store.settle(VOUCHERS).unwrap();
        assert_eq!(written_epochs(&store, &[1, 2]), vec![None, Some(7)]);
        assert_eq!(store.record_count(VOUCHERS).unwrap(), 1);
    }

    #[test]
    fn seen_marks_are_written_when_the_stream_is_saved_and_at_close_not_by_a_flush() {
        for save in [true, false] {
            let dir = tempfile::tempdir().unwrap();
            {
                let store = open(&dir);
                store
                    .commit_records(VOUCHERS, &[(1, record(1, 1)), (2, record(2, 1))], &[], 1)
                    .unwrap();
                store.settle(VOUCHERS).unwrap();
                store.forget_fresh(VOUCHERS);
                store.commit_records(VOUCHERS, &[], &[2], 2).unwrap();
                store.flush().unwrap();
                assert_eq!(written_epochs(&store, &[2]), vec![Some(1)]);
                if save {
                    store
                        .save_stream(VOUCHERS, &StreamState::default())
                        .unwrap();
                    assert_eq!(written_epochs(&store, &[2]), vec![Some(2)]);
                }
            }
            let store = open(&dir);
            assert_eq!(
                store.unseen_records(VOUCHERS, 2).unwrap(),
                vec![(1, record(1, 1))],
                "saved: {save}"
            );
        }
    }

    #[test]
    fn seen_marks_are_written_at_once_past_their_bound_after_the_page_that_crosses_it() {
        let store = store_holding(&[0, 32, 33]);
        let ids: Vec<i64> = (1..MAX_MARKED_BUCKETS as i64).map(|b| b * 32).collect();
        store.commit_records(VOUCHERS, &[], &ids, 2).unwrap();
        assert_eq!(
            lock(&store.marks)[&VOUCHERS].buckets(),
            MAX_MARKED_BUCKETS - 1
        );
        // This page stages bucket 1 (33) as it read it, without 32's mark.
        store
            .commit_records(VOUCHERS, &[(33, record(33, 2))], &[0], 2)
            .unwrap();
        assert!(lock(&store.marks).is_empty());
        store.flush().unwrap();
        assert_eq!(written_epochs(&store, &[0, 32, 33]), vec![Some(2); 3]);
    }

    #[test]
    fn seen_marks_are_written_with_every_commit_when_commits_must_be_durable() {
        let mut store = store_holding(&[1, 2]);
        store.durable_commits = true;
        store.limits = SETTLE_AT_ONCE;
        // 1 changed and 2 unchanged, in one bucket: the page's staged bucket
        // must not take 2's mark back.
        store
            .commit_records(VOUCHERS, &[(1, record(11, 2))], &[2], 2)
            .unwrap();
        assert!(lock(&store.marks).is_empty());
        assert_eq!(written_epochs(&store, &[1, 2]), vec![Some(2), Some(2)]);
        assert!(store.unseen_records(VOUCHERS, 2).unwrap().is_empty());
    }

    #[test]
    fn commit_deletes_removes_records_and_intents_and_writes_tombstones() {
        let store = SledStore::open_temporary().unwrap();
        store
            .commit_records(VOUCHERS, &[(1, record(1, 0)), (-2, record(2, 0))], &[], 0)
            .unwrap();
        store.write_intents(VOUCHERS, &[(1, intent(5))]).unwrap();
        store
            .delete_records(VOUCHERS, &[(1, tombstone(1, 1)), (-2, tombstone(2, 3))])
            .unwrap();
        assert_eq!(
            store.get_records(VOUCHERS, &[1, -2]).unwrap(),
            vec![None, None]
        );
        assert!(store.pending_intents(VOUCHERS).unwrap().is_empty());
        assert_eq!(
            store.get_tombstones(VOUCHERS, &[-2, 1, 3]).unwrap(),
            vec![Some(tombstone(2, 3)), Some(tombstone(1, 1)), None]
        );
        assert_eq!(store.record_count(VOUCHERS).unwrap(), 0);
        // Re-creating the record clears its tombstone.
        store
            .commit_records(VOUCHERS, &[(1, record(1, 0))], &[], 0)
            .unwrap();
        assert_eq!(store.get_tombstones(VOUCHERS, &[1]).unwrap(), vec![None]);
    }

    #[test]
    fn records_on_both_sides_of_a_bucket_boundary_are_independent() {
        let store = SledStore::open_temporary().unwrap();
        let ids = [-33, -32, -1, 0, 31, 32, 33, 64];
        let commits: Vec<_> = ids.iter().map(|&id| (id, record(id as u8, 0))).collect();
        store.commit_records(VOUCHERS, &commits, &[], 0).unwrap();
        store
            .delete_records(
                VOUCHERS,
                &[
                    (32, tombstone(1, 1)),
                    (33, tombstone(1, 1)),
                    (-1, tombstone(1, 1)),
                ],
            )
            .unwrap();
        let expected: Vec<_> = ids
            .iter()
            .map(|&id| (![32, 33, -1].contains(&id)).then(|| record(id as u8, 0)))
            .collect();
        assert_eq!(store.get_records(VOUCHERS, &ids).unwrap(), expected);
        assert_eq!(store.record_count(VOUCHERS).unwrap(), 5);
        // Without its count entry the store counts the buckets instead.
        store
            .raw()
            .remove(codec::prefix(KIND_COUNT, VOUCHERS))
            .unwrap();
        assert_eq!(store.record_count(VOUCHERS).unwrap(), 5);
        // The bucket of 32..63 is empty now and takes no entry.
        let buckets = store
            .raw()
            .scan_prefix(codec::prefix(KIND_RECORD, VOUCHERS))
            .count();
        assert_eq!(buckets, 4);
    }

    #[test]
    fn streams_never_see_each_others_records() {
        let store = SledStore::open_temporary().unwrap();
        store
            .commit_records(VOUCHERS, &[(1, record(1, 0))], &[], 0)
            .unwrap();
        store.write_intents(CATEGORIES, &[(1, intent(2))]).unwrap();
        store
            .delete_records(OTHER_TENANT, &[(1, tombstone(3, 1))])
            .unwrap();
        assert_eq!(store.get_records(CATEGORIES, &[1]).unwrap(), vec![None]);
        assert_eq!(store.get_records(OTHER_TENANT, &[1]).unwrap(), vec![None]);
        assert!(store.pending_intents(VOUCHERS).unwrap().is_empty());
        assert_eq!(store.get_tombstones(VOUCHERS, &[1]).unwrap(), vec![None]);
        assert_eq!(store.record_count(VOUCHERS).unwrap(), 1);
        assert_eq!(store.record_count(CATEGORIES).unwrap(), 0);
        assert_eq!(store.unseen_records(VOUCHERS, 1).unwrap().len(), 1);
        assert!(store.unseen_records(OTHER_TENANT, 1).unwrap().is_empty());
    }

    #[test]
    fn listings_come_back_in_numeric_id_order() {
        let store = SledStore::open_temporary().unwrap();
        let ids = [300, -5, 0, 2, i64::MIN, i64::MAX, 17];
        let commits: Vec<_> = ids.iter().map(|&id| (id, record(1, 0))).collect();
        store.commit_records(VOUCHERS, &commits, &[], 0).unwrap();
        let intents: Vec<_> = ids.iter().map(|&id| (id, intent(1))).collect();
        store.write_intents(VOUCHERS, &intents).unwrap();
        let mut sorted = ids.to_vec();
        sorted.sort();
        let listed: Vec<i64> = store
            .unseen_records(VOUCHERS, 1)
            .unwrap()
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        assert_eq!(listed, sorted);
        let pending: Vec<i64> = store
            .pending_intents(VOUCHERS)
            .unwrap()
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        assert_eq!(pending, sorted);
    }

    #[test]
    fn everything_written_survives_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let state = StreamState {
            full_sweep_epoch: 3,
            ..StreamState::default()
        };
        {
            let store = open(&dir);
            store.save_stream(VOUCHERS, &state).unwrap();
            store
                .commit_records(VOUCHERS, &[(1, record(1, 3))], &[], 3)
                .unwrap();
            store.write_intents(VOUCHERS, &[(2, intent(2))]).unwrap();
            store
                .delete_records(VOUCHERS, &[(3, tombstone(3, 1))])
                .unwrap();
            store.flush().unwrap();
        }
        let store = open(&dir);
        assert_eq!(store.load_stream(VOUCHERS).unwrap(), state);
        assert_eq!(store.record_count(VOUCHERS).unwrap(), 1);
        assert_eq!(
            store.get_records(VOUCHERS, &[1]).unwrap(),
            vec![Some(record(1, 3))]
        );
        assert_eq!(
            store.pending_intents(VOUCHERS).unwrap(),
            vec![(2, intent(2))]
        );
        assert_eq!(
            store.get_tombstones(VOUCHERS, &[3]).unwrap(),
            vec![Some(tombstone(3, 1))]
        );
    }

    /// One step of the model-based test.
    #[derive(Debug, Clone)]
    enum Op {
        Intents(Vec<(i64, u8)>),
        /// Records (id, hash byte, how it was delivered), seen ids, epoch.
        Commit(Vec<(i64, u8, Landing)>, Vec<i64>, u64),
        Delete(Vec<(i64, u8)>),
    }

    /// How a committed record's event landed, and what the commit keeps of it.
    #[derive(Debug, Clone, Copy)]
    enum Landing {
        Acknowledged,
        DeadLettered,
        WithVersion,
    }

    fn op_strategy() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        let id = -70i64..70;
        let pairs = proptest::collection::vec((id.clone(), any::<u8>()), 0..12);
        let landing = prop_oneof![
            3 => Just(Landing::Acknowledged),
            1 => Just(Landing::DeadLettered),
            1 => Just(Landing::WithVersion),
        ];
        let commits = proptest::collection::vec((id.clone(), any::<u8>(), landing), 0..12);
        prop_oneof![
            pairs.clone().prop_map(Op::Intents),
            (commits, proptest::collection::vec(id, 0..12), 0u64..4)
                .prop_map(|(c, s, e)| Op::Commit(c, s, e)),
            pairs.prop_map(Op::Delete),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

        #[test]
        fn the_store_behaves_like_a_map_of_records_intents_tombstones_dead_letters_and_versions(
            ops in proptest::collection::vec((op_strategy(), proptest::prelude::any::<bool>()), 1..25),
            held_before in proptest::prelude::any::<bool>(),
        ) {
            use std::collections::BTreeMap;
            // Groups end only on a settle, and are written two keys a batch:
            // every kind of entry is split from its bucket somewhere.
            let store = store_with(StageLimits { batch_keys: 2, ..NEVER });
            let mut records: BTreeMap<i64, RecordState> = BTreeMap::new();
            let mut intents: BTreeMap<i64, Intent> = BTreeMap::new();
            let mut tombstones: BTreeMap<i64, Tombstone> = BTreeMap::new();
            let mut letters: BTreeMap<i64, DeadLetter> = BTreeMap::new();
            let mut versions: BTreeMap<i64, StoredVersion> = BTreeMap::new();
            if held_before {
                // A stream that held a record when the process first touched
                // it: its commits read buckets, and its seen marks wait in memory.
                store.commit_records(VOUCHERS, &[(1000, record(0, 0))], &[], 0).unwrap();
                store.settle(VOUCHERS).unwrap();
                store.forget_fresh(VOUCHERS);
                records.insert(1000, record(0, 0));
            }
            let steps = ops.len();
            for (step, (op, check)) in ops.into_iter().enumerate() {
                match op {
                    Op::Intents(list) => {
                        let list: Vec<_> = list.into_iter().map(|(id, b)| (id, intent(b))).collect();
                        store.write_intents(VOUCHERS, &list).unwrap();
                        intents.extend(list);
                    }
                    Op::Commit(list, seen, epoch) => {
                        let mut commits = Vec::new();
                        let mut deliveries = Vec::new();
                        let mut stored = Vec::new();
                        // A page lists an id once (the sweep dedupes it): the last listing.
                        let last: BTreeMap<i64, (u8, Landing)> =
                            list.into_iter().map(|(id, b, landing)| (id, (b, landing))).collect();
                        for (id, (b, landing)) in last {
                            let r = record(b, epoch);
                            commits.push((id, r));
                            deliveries.push(match landing {
                                Landing::DeadLettered => Delivery::DeadLettered(letter(b)),
                                _ => Delivery::Acknowledged,
                            });
                            if let Landing::WithVersion = landing {
                                stored.push((id, version(r.hash, &format!("{{\"id\":{id},\"b\":{b}}}"))));
                            }
                        }
                        let page = Acked::page(commits.clone(), deliveries.clone(), seen.clone(), epoch)
                            .unwrap()
                            .with_versions(stored.clone());
                        store.commit_page(VOUCHERS, &page).unwrap();
                        for id in &seen {
                            if let Some(r) = records.get_mut(id) {
                                r.seen_epoch = epoch;
                            }
                        }
                        for ((id, r), delivery) in commits.iter().zip(deliveries) {
                            records.insert(*id, *r);
                            intents.remove(id);
                            tombstones.remove(id);
                            versions.remove(id);
                            match delivery {
                                Delivery::DeadLettered(l) => letters.insert(*id, l),
                                Delivery::Acknowledged => letters.remove(id),
                            };
                        }
                        versions.extend(stored);
                    }
                    Op::Delete(list) => {
                        let list: Vec<_> = list.into_iter().map(|(id, b)| (id, tombstone(b, 1))).collect();
                        store.delete_records(VOUCHERS, &list).unwrap();
                        for (id, t) in &list {
                            records.remove(id);
                            intents.remove(id);
                            tombstones.insert(*id, *t);
                            letters.remove(id);
                            versions.remove(id);
                        }
                    }
                }
                if !check && step + 1 < steps {
                    // Unread, the next commits stage over this one's.
                    continue;
                }
                let ids: Vec<i64> = (-70..70).collect();
                let expected: Vec<_> = ids.iter().map(|id| versions.get(id).cloned()).collect();
                proptest::prop_assert_eq!(store.get_versions(VOUCHERS, &ids).unwrap(), expected);
                let expected: Vec<_> = ids.iter().map(|id| records.get(id).copied()).collect();
                proptest::prop_assert_eq!(store.get_records(VOUCHERS, &ids).unwrap(), expected);
                let expected: Vec<_> = ids.iter().map(|id| tombstones.get(id).copied()).collect();
                proptest::prop_assert_eq!(store.get_tombstones(VOUCHERS, &ids).unwrap(), expected);
                proptest::prop_assert_eq!(store.record_count(VOUCHERS).unwrap(), records.len() as u64);
                let pending: Vec<_> = intents.iter().map(|(id, i)| (*id, *i)).collect();
                proptest::prop_assert_eq!(store.pending_intents(VOUCHERS).unwrap(), pending);
                if step + 1 < steps {
                    // The reads below settle the staged commits first: only
                    // after the last step, so commits stage across steps.
                    continue;
                }
                let held: Vec<_> = letters.iter().map(|(id, l)| (*id, l.clone())).collect();
                proptest::prop_assert_eq!(store.dead_letters(VOUCHERS).unwrap(), held);
                let unseen: Vec<_> = records.iter().filter(|(_, r)| r.seen_epoch < 2).map(|(id, r)| (*id, *r)).collect();
                proptest::prop_assert_eq!(store.unseen_records(VOUCHERS, 2).unwrap(), unseen);
            }
        }
    }

    /// Environment variable that turns `child_process_commits_pages_until_killed` on.
    const CHILD_STORE_ENV: &str = "VOUCHER_CDC_TEST_CHILD_STORE";
    const CHILD_PAGE: i64 = 200;

    /// Helper process for the two tests below: commits whole pages of
    /// `CHILD_PAGE` records, each page with its own hash, until killed.
    #[test]
    #[ignore = "helper process, started by the crash and lock tests"]
    fn child_process_commits_pages_until_killed() {
        let Ok(path) = std::env::var(CHILD_STORE_ENV) else {
            return;
        };
        let store = SledStore::open(Path::new(&path)).unwrap();
        let ids: Vec<i64> = (0..CHILD_PAGE).collect();
        for round in 0u64.. {
            let commits: Vec<_> = ids
                .iter()
                .map(|&id| (id, record((round % 251) as u8, round)))
                .collect();
            store
                .commit_records(VOUCHERS, &commits, &[], round)
                .unwrap();
            if round == 10 {
                // Pages 0..=10 are on disk before the parent is told: it never
                // has to guess whether a background flush ran before its kill.
                StateStore::flush(&store).unwrap();
                std::fs::write(Path::new(&path).join("child-ready"), b"").unwrap();
            }
        }
    }

    fn spawn_child_writer(path: &Path) -> std::process::Child {
        spawn_child(
            "state::sled_store::tests::child_process_commits_pages_until_killed",
            CHILD_STORE_ENV,
            path,
        )
    }

    /// Starts the ignored helper test `name` in a process of its own with
    /// `env` set to `path`, and returns once it has written `child-ready`
    /// there.
    fn spawn_child(name: &str, env: &str, path: &Path) -> std::process::Child {
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--ignored", "--test-threads=1"])
            .env(env, path)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        wait_for_file(
            &path.join("child-ready"),
            &format!("{name} never got ready"),
        );
        child
    }

    fn wait_for_file(file: &Path, failure: &str) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !file.exists() {
            assert!(std::time::Instant::now() < deadline, "{failure}");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    #[test]
    fn a_store_held_by_another_process_is_reported_as_locked_and_a_kill_loses_no_half_page() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        // Returns once the child flushed its first pages and is still writing.
        let mut child = spawn_child_writer(&path);
        let err = SledStore::open(&path).unwrap_err();
        assert!(matches!(err, StateError::Locked { .. }), "{err:?}");
        child.kill().unwrap();
        child.wait().unwrap();

        let store = reopen(&path).unwrap();
        let ids: Vec<i64> = (0..CHILD_PAGE).collect();
        let records = store.get_records(VOUCHERS, &ids).unwrap();
        let epochs: std::collections::BTreeSet<u64> = records
            .iter()
            .map(|r| r.expect("every record of page 0 was flushed").seen_epoch)
            .collect();
        assert_eq!(
            epochs.len(),
            1,
            "records from different pages after a kill: {epochs:?}"
        );
    }

    #[test]
    fn a_layout_1_store_is_upgraded_in_place_and_its_records_read_as_sequence_0() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        {
            let store = reopen(&path).unwrap();
            // A layout 1 bucket: one record (flags 1, hash, updated_at, epoch 3, generation 2)
            // and a layout 1 journal entry (one intent without op, previous or replay).
            let mut bucket = vec![0, 0, 0, 0b10];
            bucket.push(1);
            bucket.extend_from_slice(&[0xab; 16]);
            bucket.extend_from_slice(&5i64.to_be_bytes());
            bucket.extend_from_slice(&[3, 2]);
            store
                .raw()
                .insert(&codec::record_key(KIND_RECORD, VOUCHERS, 0)[..], bucket)
                .unwrap();
            let mut entry = vec![1];
            entry.extend_from_slice(&9i64.to_be_bytes());
            entry.push(0);
            entry.extend_from_slice(&[0xcd; 16]);
            entry.push(4);
            store
                .raw()
                .insert(&codec::journal_key(VOUCHERS, 0)[..], entry)
                .unwrap();
            store
                .meta
                .insert(META_LAYOUT_VERSION, &1u32.to_be_bytes())
                .unwrap();
            store.flush().unwrap();
            std::fs::write(path.join(LAYOUT_MARKER), "layout_version = 1\n").unwrap();
        }
        let store = reopen(&path).unwrap();
        let record = store.get_records(VOUCHERS, &[1]).unwrap()[0].unwrap();
        assert_eq!(
            record,
            RecordState {
                hash: ContentHash([0xab; 16]),
                updated_at: Some(5),
                seen_epoch: 3,
                generation: 2,
                seq: 0,
                print: None,
            }
        );
        let intents = store.pending_intents(VOUCHERS).unwrap();
        assert_eq!(
            intents,
            vec![(
                9,
                Intent {
                    hash: ContentHash([0xcd; 16]),
                    updated_at: None,
                    generation: 4,
                    seq: 0,
                    op: None,
                    previous: None,
                    replay: None,
                }
            )]
        );
        assert_eq!(
            std::fs::read_to_string(path.join(LAYOUT_MARKER)).unwrap(),
            "layout_version = 4\n"
        );
        assert_eq!(store.get_versions(VOUCHERS, &[1]).unwrap(), vec![None]);
        drop(store);
        assert!(reopen(&path).is_ok(), "reopens as layout 4");
    }

    #[test]
    fn a_layout_2_store_is_upgraded_in_place_its_records_have_no_stored_version_until_they_change()
    {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        {
            let store = reopen(&path).unwrap();
            store
                .commit_records(VOUCHERS, &[(1, record(1, 3))], &[], 3)
                .unwrap();
            store
                .meta
                .insert(META_LAYOUT_VERSION, &2u32.to_be_bytes())
                .unwrap();
            store.flush().unwrap();
            std::fs::write(path.join(LAYOUT_MARKER), "layout_version = 2\n").unwrap();
        }
        let store = reopen(&path).unwrap();
        assert_eq!(
            std::fs::read_to_string(path.join(LAYOUT_MARKER)).unwrap(),
            "layout_version = 4\n"
        );
        assert_eq!(
            store.get_records(VOUCHERS, &[1]).unwrap()[0],
            Some(record(1, 3))
        );
        assert_eq!(store.get_versions(VOUCHERS, &[1]).unwrap(), vec![None]);
        let next = record(2, 3);
        store
            .commit_versions(
                VOUCHERS,
                &[(1, next)],
                &[(1, version(next.hash, r#"{"a":1}"#))],
            )
            .unwrap();
        assert_eq!(
            store.get_versions(VOUCHERS, &[1]).unwrap(),
            vec![Some(version(next.hash, r#"{"a":1}"#))]
        );
    }

    /// A stored version of `body` with both field hashes and body, as the sweep builds it.
    fn version(hash: ContentHash, body: &str) -> StoredVersion {
        let ignore = crate::hash::IgnoreKeys::new(["updated_at"]);
        let (_, fields) = crate::hash::content_hash_with_fields(body, &ignore).unwrap();
        StoredVersion {
            hash,
            fields,
            body: Some(body.to_string()),
        }
    }

    impl SledStore {
        fn commit_versions(
            &self,
            key: StreamKey,
            commits: &[(i64, RecordState)],
            versions: &[(i64, StoredVersion)],
        ) -> Result<(), StateError> {
            let acks = vec![Delivery::Acknowledged; commits.len()];
            let page = Acked::page(commits.to_vec(), acks, vec![], 1)
                .unwrap()
                .with_versions(versions.to_vec());
            self.commit_page(key, &page)
        }

        /// The catalog tree as sled holds it, staged commits written first.
        fn raw(&self) -> &sled::Tree {
            self.settle_all().unwrap();
            &self.catalog
        }

        fn catalog_kinds(&self) -> Vec<u8> {
            let mut kinds: Vec<u8> = self.raw().iter().map(|e| e.unwrap().0[0]).collect();
            kinds.dedup();
            kinds
        }
    }

    #[test]
    fn stored_versions_commit_with_their_record_survive_a_reopen_and_go_with_a_delete() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        let (a, b) = (record(1, 1), record(2, 1));
        {
            let store = reopen(&path).unwrap();
            store
                .commit_versions(
                    VOUCHERS,
                    &[(1, a), (2, b)],
                    &[
                        (1, version(a.hash, r#"{"id":1,"t":"x"}"#)),
                        (2, version(b.hash, r#"{"id":2,"t":"y"}"#)),
                        // Describes neither what record 3 commits (nothing) nor
                        // what record 1 commits: left out.
                        (3, version(h(9), "{}")),
                        (1, version(h(9), "{}")),
                    ],
                )
                .unwrap();
            // One shape for both records: their keys are the same.
            let shapes = store
                .raw()
                .scan_prefix(codec::prefix(KIND_SHAPE, VOUCHERS))
                .count();
            assert_eq!(shapes, 1);
        }
        let store = reopen(&path).unwrap();
        let got = store.get_versions(VOUCHERS, &[1, 2, 3]).unwrap();
        assert_eq!(
            got,
            vec![
                Some(version(a.hash, r#"{"id":1,"t":"x"}"#)),
                Some(version(b.hash, r#"{"id":2,"t":"y"}"#)),
                None
            ]
        );
        assert_eq!(store.get_versions(OTHER_TENANT, &[1]).unwrap(), vec![None]);
        // A record committed again without a version keeps none.
        store
            .commit_records(VOUCHERS, &[(2, record(3, 1))], &[], 1)
            .unwrap();
        assert_eq!(store.get_versions(VOUCHERS, &[2]).unwrap(), vec![None]);
        store
            .delete_records(VOUCHERS, &[(1, tombstone(1, 1))])
            .unwrap();
        assert_eq!(store.get_versions(VOUCHERS, &[1]).unwrap(), vec![None]);
        assert!(store
            .raw()
            .scan_prefix(codec::prefix(KIND_VERSION, VOUCHERS))
            .next()
            .is_none());
        // Forgetting the stream takes its shapes too.
        store.forget_stream(VOUCHERS).unwrap();
        assert!(!store.holds(VOUCHERS).unwrap());
        assert!(!store.catalog_kinds().contains(&KIND_SHAPE));
    }

    #[test]
    fn a_version_whose_shape_is_missing_has_unknown_fields_but_keeps_its_body() {
        let store = SledStore::open_temporary().unwrap();
        let a = record(1, 1);
        store
            .commit_versions(VOUCHERS, &[(1, a)], &[(1, version(a.hash, r#"{"k":1}"#))])
            .unwrap();
        for entry in store.raw().scan_prefix(codec::prefix(KIND_SHAPE, VOUCHERS)) {
            store.raw().remove(entry.unwrap().0).unwrap();
        }
        store.forget_shapes(VOUCHERS);
        let got = store.get_versions(VOUCHERS, &[1]).unwrap()[0]
            .clone()
            .unwrap();
        assert_eq!(got.fields, None);
        assert_eq!(got.body.as_deref(), Some(r#"{"k":1}"#));
    }

    #[test]
    fn without_versions_a_store_holds_exactly_the_entries_of_layout_2() {
        let store = SledStore::open_temporary().unwrap();
        store
            .commit_records(VOUCHERS, &[(1, record(1, 1)), (40, record(2, 1))], &[], 1)
            .unwrap();
        store.write_intents(VOUCHERS, &[(5, intent(5))]).unwrap();
        store
            .delete_records(VOUCHERS, &[(40, tombstone(2, 1))])
            .unwrap();
        let kinds = store.catalog_kinds();
        assert_eq!(
            kinds,
            vec![KIND_JOURNAL, KIND_COUNT, KIND_RECORD, KIND_TOMBSTONE]
        );
        // And the record bucket's bytes are layout 2's (pinned in the codec tests).
        let bucket = store
            .raw()
            .get(codec::record_key(KIND_RECORD, VOUCHERS, 0))
            .unwrap()
            .unwrap();
        let mut expected = Bucket::default();
        expected.slots[1] = Some(record(1, 1));
        let mut bytes = Vec::new();
        codec::encode_bucket(&expected, &mut bytes);
        assert_eq!(bucket.as_ref(), bytes.as_slice());
    }

    #[test]
    fn a_store_written_by_another_layout_version_refuses_to_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        {
            let store = reopen(&path).unwrap();
            store
                .meta
                .insert(META_LAYOUT_VERSION, &7u32.to_be_bytes())
                .unwrap();
            store.flush().unwrap();
        }
        let err = reopen(&path).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "state store {} was written by layout version 7; this build reads version 4 \
                 (upgrade voucher-cdc or point state.path elsewhere)",
                path.display()
            )
        );
        // A marker naming an unknown layout is refused before sled even opens.
        std::fs::write(path.join(LAYOUT_MARKER), "layout_version = 9\n").unwrap();
        let err = reopen(&path).unwrap_err();
        assert!(
            matches!(err, StateError::UnsupportedVersion { found: 9, .. }),
            "{err}"
        );
    }

    #[test]
    fn a_store_held_by_another_handle_is_reported_as_locked() {
        let dir = tempfile::tempdir().unwrap();
        let _held = open(&dir);
        let err = SledStore::open(&dir.path().join("state")).unwrap_err();
        assert!(matches!(err, StateError::Locked { .. }), "{err:?}");
        let message = err.to_string();
        assert!(
            message.contains("is locked by another process"),
            "{message}"
        );
        assert!(message.contains("admin API"), "{message}");
        assert!(!message.contains('\n'));
    }

    #[test]
    fn garbage_in_the_directory_is_reported_as_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        std::fs::create_dir_all(&path).unwrap();
        std::fs::write(path.join("db"), vec![0xAB; 4096]).unwrap();
        std::fs::write(path.join("conf"), vec![0x17; 64]).unwrap();
        let err = reopen(&path).unwrap_err();
        assert!(matches!(err, StateError::Corrupt { .. }), "{err:?}");
        assert!(err
            .to_string()
            .starts_with(&format!("state store {} is corrupt: ", path.display())));
    }

    #[test]
    fn a_store_whose_log_was_overwritten_is_not_mistaken_for_a_new_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        {
            let store = reopen(&path).unwrap();
            store
                .commit_records(VOUCHERS, &[(1, record(1, 0))], &[], 0)
                .unwrap();
            store.flush().unwrap();
        }
        let db = path.join("db");
        let garbage: Vec<u8> = std::fs::read(&db)
            .unwrap()
            .iter()
            .map(|b| b ^ 0x5a)
            .collect();
        std::fs::write(&db, garbage).unwrap();
        let err = reopen(&path).unwrap_err();
        assert!(matches!(err, StateError::Corrupt { .. }), "{err:?}");
        assert!(err.to_string().contains("lost its contents"), "{err}");
    }

    #[test]
    fn an_undecodable_value_is_reported_with_its_key() {
        let store = SledStore::open_temporary().unwrap();
        let key = codec::record_key(KIND_RECORD, VOUCHERS, codec::bucket_of(5).0);
        store.raw().insert(key, &b"xx"[..]).unwrap();
        let err = store.get_records(VOUCHERS, &[5]).unwrap_err().to_string();
        assert!(
            err.contains(&format!(
                "undecodable record bucket value under key {}",
                hex::encode(key)
            )),
            "{err}"
        );
        assert!(store.unseen_records(VOUCHERS, 1).is_err());
        store
            .streams
            .insert(codec::stream_key(VOUCHERS), &b"{not json"[..])
            .unwrap();
        let err = store.load_stream(VOUCHERS).unwrap_err().to_string();
        assert!(
            err.contains("undecodable state of stream 42/vouchers"),
            "{err}"
        );
    }

    #[test]
    fn a_path_that_is_a_file_gives_one_clear_line() {
        let file = tempfile::NamedTempFile::new().unwrap();
        let err = SledStore::open(file.path()).unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "state store {}: i/o error: the path is a file, expected a directory",
                file.path().display()
            )
        );
    }

    #[test]
    fn io_errors_map_to_the_variant_that_says_what_to_do() {
        let path = Path::new("/var/lib/voucher-cdc");
        let denied = map_sled_error(
            path,
            sled::Error::Io(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "Permission denied (os error 13)",
            )),
        );
        assert_eq!(
            denied.to_string(),
            "state store /var/lib/voucher-cdc: permission denied: Permission denied (os error 13) \
             (run voucher-cdc as a user that may write there, or point state.path elsewhere)"
        );
        let would_block = map_sled_error(path, sled::Error::Io(io::ErrorKind::WouldBlock.into()));
        assert!(matches!(would_block, StateError::Locked { .. }));
        let bug = map_sled_error(path, sled::Error::ReportableBug("oops".into()));
        assert_eq!(
            bug.to_string(),
            "state store /var/lib/voucher-cdc: internal storage error: oops"
        );
    }

    /// The record `a_store_larger_than_its_cache...` commits for `id`.
    fn numbered(id: i64) -> RecordState {
        RecordState {
            hash: ContentHash([(id % 251) as u8; 16]),
            updated_at: Some(1_700_000_000_000_000 + id),
            seen_epoch: (id % 7) as u64,
            generation: (id % 3) as u32,
            seq: id as u64 + 1,
            print: None,
        }
    }

    /// The buckets of `key` whose records are staged alone, and those staged whole.
    fn staged_buckets(store: &SledStore, key: StreamKey) -> (Vec<i64>, Vec<i64>) {
        let staged = lock(&store.staged);
        let Some(entry) = staged.get(&key) else {
            return (Vec::new(), Vec::new());
        };
        let whole = entry
            .writes
            .0
            .keys()
            .filter(|k| k.first() == Some(&KIND_RECORD))
            .filter_map(|k| codec::key_id(k))
            .collect();
        let mut fresh: Vec<i64> = entry.fresh_buckets.keys().copied().collect();
        fresh.sort_unstable();
        (fresh, whole)
    }

    /// Journals and commits `ids` as one page, each as `numbered(id)` with `seq` added.
    fn commit_numbered(store: &SledStore, key: StreamKey, ids: &[i64], seq: u64) {
        let intents: Vec<_> = ids.iter().map(|&id| (id, intent(1))).collect();
        store.write_intents(key, &intents).unwrap();
        let commits: Vec<_> = ids
            .iter()
            .map(|&id| {
                let mut r = numbered(id);
                r.seq += seq;
                (id, r)
            })
            .collect();
        store.commit_records(key, &commits, &[], 0).unwrap();
    }

    /// Each of `ids` read back as `numbered(id)` with `seq` added, and the count.
    fn assert_numbered(store: &SledStore, key: StreamKey, ids: &[(i64, u64)], count: u64) {
        let only: Vec<i64> = ids.iter().map(|(id, _)| *id).collect();
        let read = store.get_records(key, &only).unwrap();
        for ((id, seq), got) in ids.iter().zip(read) {
            let mut want = numbered(*id);
            want.seq += seq;
            assert_eq!(got, Some(want), "record {id}");
        }
        assert_eq!(store.record_count(key).unwrap(), count);
    }

    #[test]
    fn records_new_to_a_stream_that_started_empty_are_staged_without_their_buckets_and_read_back_everywhere(
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        let mut store = reopen(&path).unwrap();
        store.limits = NEVER;
        // Two pages of ids spread over six buckets, none read or staged whole.
        let first: Vec<i64> = (0..12).map(|n| n * 17).collect();
        let second: Vec<i64> = (0..12).map(|n| n * 17 + 5).collect();
        commit_numbered(&store, VOUCHERS, &first, 0);
        commit_numbered(&store, VOUCHERS, &second, 0);
        let (fresh, whole) = staged_buckets(&store, VOUCHERS);
        assert_eq!(fresh, (0..=6).collect::<Vec<i64>>());
        assert!(whole.is_empty(), "{whole:?}");
        assert_eq!(store.record_count(VOUCHERS).unwrap(), 24);
        assert_eq!(
            store.get_records(VOUCHERS, &[1, 2, 1000]).unwrap(),
            vec![None, None, None]
        );
        // A known id is looked up (staged alone here) and staged alone again.
        commit_numbered(&store, VOUCHERS, &[17, 300], 100);
        let (fresh, whole) = staged_buckets(&store, VOUCHERS);
        assert_eq!((fresh, whole), (vec![0, 1, 2, 3, 4, 5, 6, 9], vec![]));
        let mut expected: Vec<(i64, u64)> =
            first.iter().chain(&second).map(|&id| (id, 0)).collect();
        expected.retain(|(id, _)| *id != 17);
        expected.extend([(17, 100), (300, 100)]);
        assert_numbered(&store, VOUCHERS, &expected, 25);
        // The same after the group is written and the store reopened.
        drop(store);
        let store = reopen(&path).unwrap();
        assert_numbered(&store, VOUCHERS, &expected, 25);
        assert!(store.pending_intents(VOUCHERS).unwrap().is_empty());
        let mut dumped: Vec<i64> = store
            .dump_stream(VOUCHERS)
            .unwrap()
            .records
            .iter()
            .map(|(id, _)| *id)
            .collect();
        dumped.sort_unstable();
        let mut ids: Vec<i64> = expected.iter().map(|(id, _)| *id).collect();
        ids.sort_unstable();
        assert_eq!(dumped, ids);
    }

    #[test]
    fn a_stream_holding_records_when_the_store_opens_reads_the_bucket_of_every_commit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        {
            let store = reopen(&path).unwrap();
            commit_numbered(&store, VOUCHERS, &[1, 2, 3], 0);
        }
        let mut store = reopen(&path).unwrap();
        store.limits = NEVER;
        commit_numbered(&store, VOUCHERS, &[4, 40], 0);
        assert_eq!(staged_buckets(&store, VOUCHERS), (vec![], vec![0, 1]));
        assert_numbered(
            &store,
            VOUCHERS,
            &[(1, 0), (2, 0), (3, 0), (4, 0), (40, 0)],
            5,
        );
        // Another stream, empty, stages its records alone.
        commit_numbered(&store, CATEGORIES, &[4, 40], 0);
        assert_eq!(staged_buckets(&store, CATEGORIES), (vec![0, 1], vec![]));
    }

    #[test]
    fn a_record_staged_alone_in_a_bucket_staged_whole_goes_into_the_staged_value() {
        let mut staged = Staged::new();
        let mut whole = Bucket::default();
        whole.slots[1] = Some(numbered(1));
        let mut value = Vec::new();
        codec::encode_bucket(&whole, &mut value);
        let mut writes = Writes::default();
        writes.insert(codec::record_key(KIND_RECORD, VOUCHERS, 0), value);
        staged
            .add(
                VOUCHERS,
                writes,
                vec![(2, numbered(2)), (33, numbered(33))],
                0,
            )
            .unwrap();
        let k = codec::record_key(KIND_RECORD, VOUCHERS, 0);
        let merged = codec::decode_bucket(staged.writes.get(&k).unwrap().unwrap()).unwrap();
        assert_eq!(merged.slots[1], Some(numbered(1)));
        assert_eq!(merged.slots[2], Some(numbered(2)));
        assert_eq!(
            staged.fresh_buckets.keys().copied().collect::<Vec<_>>(),
            vec![1]
        );
        assert_eq!(staged.fresh_record(33).unwrap(), Some(numbered(33)));
        assert_eq!(staged.fresh_record(2).unwrap(), None);
    }

    #[test]
    fn a_page_whose_record_meets_an_undecodable_staged_bucket_stages_nothing() {
        let mut staged = Staged::new();
        let mut corrupt = Writes::default();
        corrupt.insert(codec::record_key(KIND_RECORD, VOUCHERS, 0), vec![0xff; 3]);
        staged.add(VOUCHERS, corrupt, Vec::new(), 0).unwrap();
        let (bytes, keys) = (staged.bytes, staged.writes.0.len());
        let mut page = Writes::default();
        page.remove(codec::journal_key(VOUCHERS, 7));
        let fresh = vec![(40, numbered(40)), (2, numbered(2))];
        assert!(staged.add(VOUCHERS, page, fresh, 0).is_err());
        assert_eq!(
            (staged.bytes, staged.writes.0.len(), staged.pages),
            (bytes, keys, 1)
        );
        assert!(staged.fresh_buckets.is_empty());
    }

    #[test]
    fn a_stream_whose_reads_mostly_find_records_drops_its_id_set_and_writes_what_it_staged_alone() {
        let store = store_with(NEVER);
        let ids: Vec<i64> = (0..100).collect();
        commit_numbered(&store, VOUCHERS, &ids, 0);
        assert_eq!(staged_buckets(&store, VOUCHERS).0, vec![0, 1, 2, 3]);
        // A later sweep: reads of known records, 4,096 and more.
        for _ in 0..41 {
            let read = store.get_records(VOUCHERS, &ids).unwrap();
            assert!(read.iter().all(Option::is_some));
        }
        assert_eq!(staged_buckets(&store, VOUCHERS), (vec![], vec![]));
        assert!(matches!(lock(&store.fresh).get(&VOUCHERS), Some(None)));
        // Its commits now read and stage whole buckets.
        commit_numbered(&store, VOUCHERS, &[5, 100], 3);
        assert_eq!(staged_buckets(&store, VOUCHERS), (vec![], vec![0, 3]));
        let mut expected: Vec<(i64, u64)> = ids.iter().map(|&id| (id, 0)).collect();
        expected[5].1 = 3;
        expected.push((100, 3));
        assert_numbered(&store, VOUCHERS, &expected, 101);
    }

    #[test]
    fn a_stream_restored_or_forgotten_after_commits_counts_and_keeps_the_records_it_then_holds() {
        let store = store_with(NEVER);
        commit_numbered(&store, VOUCHERS, &[1], 0);
        let dump = StreamDump {
            records: [1, 2, 3].iter().map(|&id| (id, numbered(id))).collect(),
            ..StreamDump::default()
        };
        store.restore_stream(VOUCHERS, &dump).unwrap();
        // 2 was never committed here, but the restored stream holds it.
        commit_numbered(&store, VOUCHERS, &[2, 4], 9);
        assert_numbered(&store, VOUCHERS, &[(1, 0), (2, 9), (3, 0), (4, 9)], 4);
        assert_eq!(store.forget_stream(VOUCHERS).unwrap(), 4);
        commit_numbered(&store, VOUCHERS, &[3], 0);
        assert_numbered(&store, VOUCHERS, &[(3, 0)], 1);
        assert_eq!(
            store.get_records(VOUCHERS, &[1, 2, 4]).unwrap(),
            vec![None, None, None]
        );
    }

    /// Records of a store built by [`build_store_larger_than_its_cache`].
    const LARGE_STORE_RECORDS: i64 = 20_000;
    /// A cache smaller than one leaf in each of sled's cache shards
    /// (vendor/sled/PATCHES.md, item 3): most reads pull pages back from the
    /// log file, fragment by fragment.
    const SMALL_CACHE: u64 = 64 << 10;

    /// Commits [`LARGE_STORE_RECORDS`] numbered records (625 buckets, 40-80
    /// leaves) at `path` through a cache of `cache` bytes, in groups of 16
    /// KiB and in an order that revisits each bucket from many pages so that
    /// leaves carry several fragments, and flushes them. Through
    /// [`SMALL_CACHE`] the commits' own reads page leaves in (and rewrite
    /// the ones in many fragments whole); through the default cache they
    /// page nothing in.
    fn build_store_larger_than_its_cache(path: &Path, cache: u64) {
        let order: Vec<i64> = (0..LARGE_STORE_RECORDS)
            .map(|n| (n * 7_919) % LARGE_STORE_RECORDS)
            .collect();
        let mut store = reopen_with_cache(path, cache).unwrap();
        store.limits = StageLimits {
            stream_bytes: 16 << 10,
            ..STAGE_LIMITS
        };
        for page in order.chunks(50) {
            let intents: Vec<_> = page.iter().map(|&id| (id, intent(1))).collect();
            store.write_intents(VOUCHERS, &intents).unwrap();
            let commits: Vec<_> = page.iter().map(|&id| (id, numbered(id))).collect();
            store.commit_records(VOUCHERS, &commits, &[], 0).unwrap();
        }
        store.flush().unwrap();
    }

    /// Reads every record of such a store and checks it, 50 ids at a time, in
    /// id order or `scattered` (as a sweep's listing is).
    fn check_large_store(store: &SledStore, scattered: bool, when: &str) {
        let ids: Vec<i64> = (0..LARGE_STORE_RECORDS)
            .map(|n| {
                if scattered {
                    (n * 4_099) % LARGE_STORE_RECORDS
                } else {
                    n
                }
            })
            .collect();
        for ids in ids.chunks(50) {
            let read = store.get_records(VOUCHERS, ids).unwrap();
            for (id, record) in ids.iter().zip(read) {
                assert!(
                    record == Some(numbered(*id)),
                    "record {id} read back {when}: {record:?}"
                );
            }
        }
        assert_eq!(
            store.record_count(VOUCHERS).unwrap(),
            LARGE_STORE_RECORDS as u64
        );
    }

    #[test]
    fn a_store_larger_than_its_cache_reads_back_every_record_from_disk_and_after_a_reopen() {
        // Reads through the small cache pull pages back from the log file and
        // rewrite those with many fragments whole (vendor/sled/PATCHES.md,
        // item 5); the second pass reads the rewritten pages, and the reopen
        // reads every message again, through sled's recovery.
        for built_through in [SMALL_CACHE, CACHE_CAPACITY] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("state");
            build_store_larger_than_its_cache(&path, built_through);
            {
                let store = reopen_with_cache(&path, SMALL_CACHE).unwrap();
                check_large_store(&store, true, "through a small cache");
                check_large_store(&store, false, "once its pages were rewritten whole");
            }
            let store = reopen_with_cache(&path, SMALL_CACHE).unwrap();
            check_large_store(&store, true, "after the reopen");
            assert!(store.pending_intents(VOUCHERS).unwrap().is_empty());
        }
    }

    /// Environment variable that turns `child_process_reads_a_large_store_until_killed` on.
    const CHILD_READER_ENV: &str = "VOUCHER_CDC_TEST_CHILD_READER";

    /// Bytes this process has handed to write syscalls (`wchar` in
    /// /proc/self/io).
    fn bytes_written() -> u64 {
        let io = std::fs::read_to_string("/proc/self/io").unwrap();
        io.lines()
            .find_map(|line| line.strip_prefix("wchar: "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap()
    }

    /// Helper process for the two tests below: opens a store built by
    /// [`build_store_larger_than_its_cache`], with [`SMALL_CACHE`], tells the
    /// parent (`child-ready`), reads every record in a sweep's scattered
    /// order and flushes, writes the bytes it wrote meanwhile into
    /// `child-writes`, and reads on until killed. Its first pass pages leaves
    /// in and rewrites those in many fragments whole.
    #[test]
    #[ignore = "helper process, started by the rewrite tests"]
    fn child_process_reads_a_large_store_until_killed() {
        let Ok(path) = std::env::var(CHILD_READER_ENV) else {
            return;
        };
        let path = Path::new(&path);
        let store = SledStore::open_with_cache(path, SMALL_CACHE).unwrap();
        std::fs::write(path.join("child-ready"), b"").unwrap();
        let before = bytes_written();
        check_large_store(&store, true, "in the child");
        StateStore::flush(&store).unwrap();
        let written = bytes_written() - before;
        std::fs::write(path.join("child-writes"), written.to_string()).unwrap();
        loop {
            check_large_store(&store, true, "in the child");
        }
    }

    /// Starts the reader helper on the store at `path`.
    fn spawn_child_reader(path: &Path) -> std::process::Child {
        spawn_child(
            "state::sled_store::tests::child_process_reads_a_large_store_until_killed",
            CHILD_READER_ENV,
            path,
        )
    }

    /// Kills a helper process, which must not have ended on its own (a
    /// failed check of its reads).
    fn kill_child(mut child: std::process::Child) {
        use std::os::unix::process::ExitStatusExt;
        child.kill().unwrap();
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(9), "child reader: {status}");
    }

    #[test]
    fn reads_through_a_small_cache_write_back_the_pages_they_pull_in_many_fragments() {
        // Counted in a process of its own: other tests write files too.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        build_store_larger_than_its_cache(&path, CACHE_CAPACITY);
        let child = spawn_child_reader(&path);
        wait_for_file(
            &path.join("child-writes"),
            "child reader never finished a pass",
        );
        kill_child(child);
        let written: u64 = std::fs::read_to_string(path.join("child-writes"))
            .unwrap()
            .parse()
            .unwrap();
        // Without the rewrite (vendor/sled/PATCHES.md, item 5) a pass of
        // reads and a flush write nothing of the store.
        assert!(
            written >= 64 << 10,
            "a pass of reads over a store in many fragments wrote {written} bytes"
        );
    }

    #[test]
    fn a_kill_while_reads_rewrite_pages_whole_loses_no_record() {
        // The child's first pass rewrites the store's fragmented leaves
        // within a few milliseconds of opening it (4-25 ms in a debug build):
        // the kills land in it, or just after it.
        let mut rng = rand::rng();
        for round in 0..6 {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("state");
            build_store_larger_than_its_cache(&path, CACHE_CAPACITY);
            let child = spawn_child_reader(&path);
            let delay = rand::Rng::random_range(&mut rng, 0..25);
            std::thread::sleep(std::time::Duration::from_millis(delay));
            kill_child(child);
            let store = reopen_with_cache(&path, SMALL_CACHE).unwrap();
            check_large_store(
                &store,
                false,
                &format!("after a kill {delay} ms into the reads (round {round})"),
            );
        }
    }

    /// Writes `threads` x `values` values of 32 KiB (under sled's blob
    /// threshold, so they go through the log) into a sled database at
    /// `path` as fast as it takes them, and flushes: about 100 full log
    /// segments of 512 KiB.
    fn fill_log_segments(db: &sled::Db, threads: u8, values: u16) {
        std::thread::scope(|scope| {
            for thread in 0..threads {
                scope.spawn(move || {
                    for n in 0..values {
                        let key = [&[thread][..], &n.to_be_bytes()[..]].concat();
                        db.insert(key, segment_filler(thread, n)).unwrap();
                    }
                });
            }
        });
        db.flush().unwrap();
    }

    /// Opens the sled database at `path` once the last one there let go of
    /// its lock (sled's flusher thread ends a moment after a drop).
    fn reopen_sled(path: &Path) -> sled::Db {
        until_unlocked(|| {
            sled::Config::new()
                .path(path)
                .open()
                .map_err(|e| map_sled_error(path, e))
        })
        .unwrap()
    }

    /// The value `fill_log_segments` writes for `thread` and `n`.
    fn segment_filler(thread: u8, n: u16) -> Vec<u8> {
        let seed = u64::from(thread) << 16 | u64::from(n);
        let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
        let mut value = vec![0u8; 32 << 10];
        rand::RngCore::fill_bytes(&mut rng, &mut value);
        value
    }

    #[test]
    fn writes_faster_than_the_disk_keep_at_most_two_full_log_segments_waiting_for_it() {
        // Each full 512 KiB segment is written and synced on sled's thread
        // pool; writers that fill segments faster than that used to leave
        // dozens of them in memory (vendor/sled/PATCHES.md, item 6).
        let dir = tempfile::tempdir().unwrap();
        let (threads, values) = (4u8, 400u16);
        {
            let db = sled::Config::new().path(dir.path()).open().unwrap();
            fill_log_segments(&db, threads, values);
            // Each wait given up (a segment's write took over a second: a
            // loaded disk) lets one more through.
            let (peak, gave_up) = (
                db.peak_full_segment_writes(),
                db.full_segment_wait_timeouts(),
            );
            assert!(
                (1..=2 + gave_up).contains(&peak),
                "{peak} full log segments were waiting for the disk at once ({gave_up} waits given up)"
            );
        }
        // Nothing written while writers waited is lost or out of place.
        let db = reopen_sled(dir.path());
        assert_eq!(db.len(), usize::from(threads) * usize::from(values));
        for thread in 0..threads {
            for n in (0..values).step_by(97) {
                let key = [&[thread][..], &n.to_be_bytes()[..]].concat();
                let value = db.get(&key).unwrap();
                assert_eq!(value.as_deref(), Some(&segment_filler(thread, n)[..]));
            }
        }
    }
}
