//! The sled implementation of [`StateStore`].
//!
//! Three trees: `meta` (layout version), `streams` (one small JSON document
//! per stream) and `catalog`, which holds records, intents and tombstones of
//! every stream under kind-prefixed binary keys. Keeping the three per-record
//! kinds in one tree lets every multi-kind change (commit a page, commit
//! deletes) be a single `apply_batch`, which sled applies atomically, without
//! the cost of cross-tree transactions. See docs/state.md.

use std::io;
use std::path::{Path, PathBuf};

use tempfile::TempDir;

use super::codec::{self, KIND_INTENT, KIND_RECORD, KIND_TOMBSTONE, RECORD_KEY_LEN};
use super::{Intent, RecordState, StateError, StateStore, StreamState, Tombstone};
use crate::stream::StreamKey;

/// The on-disk layout this build reads and writes.
pub const LAYOUT_VERSION: u32 = 1;

/// Meta key holding the layout version (u32 big-endian).
const META_LAYOUT_VERSION: &[u8] = b"layout_version";
/// Meta key holding the name and version of the build that created the store.
const META_CREATED_BY: &[u8] = b"created_by";

/// Sled's page cache; bounds memory whatever the catalog size.
const CACHE_CAPACITY: u64 = 64 * 1024 * 1024;
/// How often sled flushes in the background (a crash loses at most this much
/// committed state, which the invariant turns into duplicates, never loss).
const FLUSH_EVERY_MS: u64 = 500;

/// State store backed by a sled database directory.
pub struct SledStore {
    db: sled::Db,
    meta: sled::Tree,
    streams: sled::Tree,
    catalog: sled::Tree,
    path: PathBuf,
    /// Keeps a temporary store's directory alive; dropped after the db.
    _temp_dir: Option<TempDir>,
}

impl std::fmt::Debug for SledStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SledStore")
            .field("path", &self.path)
            .finish()
    }
}

impl SledStore {
    /// Opens (or creates) the store in directory `path`.
    pub fn open(path: &Path) -> Result<SledStore, StateError> {
        Self::open_with(path, None)
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
        Self::open_with(&path, Some(dir))
    }

    fn open_with(path: &Path, temp_dir: Option<TempDir>) -> Result<SledStore, StateError> {
        if path.is_file() {
            return Err(StateError::Io {
                path: path.to_path_buf(),
                source: io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "the path is a file, expected a directory",
                ),
            });
        }
        let db = sled::Config::new()
            .path(path)
            .cache_capacity(CACHE_CAPACITY)
            .flush_every_ms(Some(FLUSH_EVERY_MS))
            .open()
            .map_err(|e| map_sled_error(path, e))?;
        let tree = |name: &str| db.open_tree(name).map_err(|e| map_sled_error(path, e));
        let store = SledStore {
            meta: tree("meta")?,
            streams: tree("streams")?,
            catalog: tree("catalog")?,
            db,
            path: path.to_path_buf(),
            _temp_dir: temp_dir,
        };
        store.check_layout()?;
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

    fn check_layout(&self) -> Result<(), StateError> {
        match self
            .meta
            .get(META_LAYOUT_VERSION)
            .map_err(|e| self.err(e))?
        {
            Some(bytes) => {
                let found = <[u8; 4]>::try_from(bytes.as_ref())
                    .map(u32::from_be_bytes)
                    .map_err(|_| self.corrupt("the layout version is not a 4-byte integer"))?;
                if found != LAYOUT_VERSION {
                    return Err(StateError::UnsupportedVersion {
                        path: self.path.clone(),
                        found,
                        supported: LAYOUT_VERSION,
                    });
                }
                Ok(())
            }
            None => {
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

    fn apply(&self, batch: sled::Batch) -> Result<(), StateError> {
        self.catalog.apply_batch(batch).map_err(|e| self.err(e))
    }

    /// Looks up one key per id and decodes each value present.
    fn get_many<T>(
        &self,
        kind: u8,
        key: StreamKey,
        ids: &[i64],
        what: &str,
        decode: fn(&[u8]) -> Option<T>,
    ) -> Result<Vec<Option<T>>, StateError> {
        ids.iter()
            .map(|&id| {
                let k = codec::record_key(kind, key, id);
                match self.catalog.get(k).map_err(|e| self.err(e))? {
                    None => Ok(None),
                    Some(v) => decode(&v)
                        .map(Some)
                        .ok_or_else(|| self.corrupt_value(what, &k)),
                }
            })
            .collect()
    }

    /// Decodes every entry of one kind in one stream, keeping those `keep` accepts.
    fn scan<T>(
        &self,
        kind: u8,
        key: StreamKey,
        what: &str,
        decode: fn(&[u8]) -> Option<T>,
        keep: impl Fn(&T) -> bool,
    ) -> Result<Vec<(i64, T)>, StateError> {
        let mut out = Vec::new();
        for entry in self.catalog.scan_prefix(codec::prefix(kind, key)) {
            let (k, v) = entry.map_err(|e| self.err(e))?;
            let id = codec::key_id(&k).ok_or_else(|| self.corrupt_value(what, &k))?;
            let value = decode(&v).ok_or_else(|| self.corrupt_value(what, &k))?;
            if keep(&value) {
                out.push((id, value));
            }
        }
        Ok(out)
    }
}

impl StateStore for SledStore {
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
        self.get_many(KIND_RECORD, key, ids, "record", codec::decode_record)
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
        let mut batch = sled::Batch::default();
        let mut value = Vec::with_capacity(32);
        for (id, intent) in intents {
            codec::encode_intent(intent, &mut value);
            batch.insert(&codec::record_key(KIND_INTENT, key, *id)[..], &value[..]);
        }
        self.apply(batch)
    }

    fn pending_intents(&self, key: StreamKey) -> Result<Vec<(i64, Intent)>, StateError> {
        self.scan(KIND_INTENT, key, "intent", codec::decode_intent, |_| true)
    }

    fn commit_page(
        &self,
        key: StreamKey,
        commits: &[(i64, RecordState)],
        seen: &[i64],
        epoch: u64,
    ) -> Result<(), StateError> {
        let mut batch = sled::Batch::default();
        let mut value = Vec::with_capacity(32);
        for (id, record) in commits {
            codec::encode_record(record, &mut value);
            batch.insert(&codec::record_key(KIND_RECORD, key, *id)[..], &value[..]);
            self.remove_if_present(&mut batch, codec::record_key(KIND_INTENT, key, *id))?;
            self.remove_if_present(&mut batch, codec::record_key(KIND_TOMBSTONE, key, *id))?;
        }
        let committed = |id: &i64| commits.iter().any(|(c, _)| c == id);
        for id in seen.iter().filter(|id| !committed(id)) {
            let k = codec::record_key(KIND_RECORD, key, *id);
            let Some(bytes) = self.catalog.get(k).map_err(|e| self.err(e))? else {
                continue;
            };
            let mut record =
                codec::decode_record(&bytes).ok_or_else(|| self.corrupt_value("record", &k))?;
            if record.seen_epoch == epoch {
                continue;
            }
            record.seen_epoch = epoch;
            codec::encode_record(&record, &mut value);
            batch.insert(&k[..], &value[..]);
        }
        self.apply(batch)
    }

    fn unseen_records(
        &self,
        key: StreamKey,
        epoch: u64,
    ) -> Result<Vec<(i64, RecordState)>, StateError> {
        self.scan(KIND_RECORD, key, "record", codec::decode_record, |r| {
            r.seen_epoch < epoch
        })
    }

    fn record_count(&self, key: StreamKey) -> Result<u64, StateError> {
        let mut count = 0u64;
        for entry in self.catalog.scan_prefix(codec::prefix(KIND_RECORD, key)) {
            entry.map_err(|e| self.err(e))?;
            count += 1;
        }
        Ok(count)
    }

    fn commit_deletes(
        &self,
        key: StreamKey,
        deletes: &[(i64, Tombstone)],
    ) -> Result<(), StateError> {
        if deletes.is_empty() {
            return Ok(());
        }
        let mut batch = sled::Batch::default();
        let mut value = Vec::with_capacity(32);
        for (id, tombstone) in deletes {
            batch.remove(&codec::record_key(KIND_RECORD, key, *id)[..]);
            self.remove_if_present(&mut batch, codec::record_key(KIND_INTENT, key, *id))?;
            codec::encode_tombstone(tombstone, &mut value);
            batch.insert(&codec::record_key(KIND_TOMBSTONE, key, *id)[..], &value[..]);
        }
        self.apply(batch)
    }

    fn flush(&self) -> Result<(), StateError> {
        self.db.flush().map_err(|e| self.err(e))?;
        Ok(())
    }
}

impl SledStore {
    /// Adds a removal to `batch` only when the key exists: removals of absent
    /// keys would still cost log space in sled.
    fn remove_if_present(
        &self,
        batch: &mut sled::Batch,
        k: [u8; RECORD_KEY_LEN],
    ) -> Result<(), StateError> {
        if self.catalog.contains_key(k).map_err(|e| self.err(e))? {
            batch.remove(&k[..]);
        }
        Ok(())
    }
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
