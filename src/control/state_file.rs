//! State you can move and back up: `state export` writes what a store holds
//! per stream as versioned JSON lines, `state import` loads such a dump into
//! a store (refusing to overwrite a stream it holds unless told to replace),
//! and `state reset` forgets streams. With these, a tenant moving between
//! shards takes its state along (docs/deployment.md, "Resharding"), so it is
//! neither re-snapshotted nor does it lose a change.
//!
//! The dump: a header line `{"kind":"header","format":"voucher-cdc-state",
//! "version":1,...}`, then per stream a `stream` line (its lifecycle state:
//! watermark, epochs, replay, pause, errors) followed by its `record`,
//! `tombstone`, `intent`, `dead_letter` and `version` lines, in id order. docs/state.md
//! describes every field. These run on a store no daemon holds: the daemon
//! writes the store all the time, so a dump taken under it would not be one
//! moment's state.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::ControlError;
use crate::hash::{ContentHash, FieldHash, FieldHashes};
use crate::state::{
    DeadLetter, Intent, RecordState, SledStore, StateStore, StoredVersion, StreamDump, StreamState,
    Tombstone,
};
use crate::stream::{Resource, StreamKey, TenantId};

/// The `format` of the header line.
pub const FORMAT: &str = "voucher-cdc-state";
/// The dump format version this build writes. Version 2 added `version`
/// lines (stored versions, layout 3); version 1 dumps read as before.
pub const FORMAT_VERSION: u32 = 2;
/// The oldest dump format version this build reads.
const OLDEST_FORMAT_VERSION: u32 = 1;

/// One line of a dump.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
enum Line {
    /// The first line.
    Header {
        format: String,
        version: u32,
        exported_at: DateTime<Utc>,
        created_by: String,
        streams: u64,
    },
    /// A stream's lifecycle state; its other lines follow it.
    Stream {
        tenant: TenantId,
        resource: Resource,
        state: StreamState,
    },
    /// A committed record.
    Record {
        tenant: TenantId,
        resource: Resource,
        id: i64,
        state: RecordState,
    },
    /// What remains of a deleted record.
    Tombstone {
        tenant: TenantId,
        resource: Resource,
        id: i64,
        tombstone: Tombstone,
    },
    /// A journalled publish not yet committed.
    Intent {
        tenant: TenantId,
        resource: Resource,
        id: i64,
        intent: Intent,
    },
    /// A record committed as dead-lettered.
    DeadLetter {
        tenant: TenantId,
        resource: Resource,
        id: i64,
        dead_letter: DeadLetter,
    },
    /// A record's stored version (`events.changed_fields`, `events.before`).
    Version {
        tenant: TenantId,
        resource: Resource,
        id: i64,
        version: VersionLine,
    },
}

/// A stored version as a dump writes it: field hashes by key name (16 hex
/// digits each) and the body as text, independent of the store's encoding.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct VersionLine {
    hash: ContentHash,
    fields: Option<BTreeMap<String, String>>,
    body: Option<String>,
}

impl VersionLine {
    fn of(version: &StoredVersion) -> Self {
        Self {
            hash: version.hash,
            fields: version
                .fields
                .as_ref()
                .map(|f| f.named().map(|(name, h)| (name, hex::encode(h))).collect()),
            body: version.body.clone(),
        }
    }

    fn stored(self) -> Result<StoredVersion, String> {
        let fields = match self.fields {
            None => None,
            Some(named) => {
                let mut parsed = Vec::with_capacity(named.len());
                for (name, text) in named {
                    let mut hash: FieldHash = [0; 8];
                    hex::decode_to_slice(&text, &mut hash).map_err(|e| {
                        format!("field hash `{text}` of `{name}` is not 16 hex digits: {e}")
                    })?;
                    parsed.push((name, hash));
                }
                Some(
                    FieldHashes::from_named(parsed)
                        .ok_or("two field names with the same canonical form")?,
                )
            }
        };
        Ok(StoredVersion {
            hash: self.hash,
            fields,
            body: self.body,
        })
    }
}

/// What moved for one stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamCounts {
    /// The stream.
    pub stream: StreamKey,
    /// Committed records.
    pub records: u64,
    /// Tombstones.
    pub tombstones: u64,
    /// Pending intents.
    pub intents: u64,
}

impl StreamCounts {
    fn of(stream: StreamKey, dump: &StreamDump) -> Self {
        Self {
            stream,
            records: dump.records.len() as u64,
            tombstones: dump.tombstones.len() as u64,
            intents: dump.intents.len() as u64,
        }
    }
}

/// The streams of `store` that `tenant` (and `resource`) name; every stream without a tenant.
fn held_streams(
    store: &SledStore,
    tenant: Option<TenantId>,
    resource: Option<Resource>,
) -> Result<Vec<StreamKey>, ControlError> {
    let held: Vec<StreamKey> = store.streams()?.into_iter().map(|(k, _)| k).collect();
    let mut chosen: Vec<StreamKey> = held
        .iter()
        .copied()
        .filter(|k| tenant.is_none_or(|t| k.tenant == t))
        .filter(|k| resource.is_none_or(|r| k.resource == r))
        .collect();
    chosen.sort();
    if chosen.is_empty() && (tenant.is_some() || resource.is_some()) {
        let named = match (tenant, resource) {
            (Some(t), Some(r)) => format!("stream {t}/{r}"),
            (Some(t), None) => format!("stream of tenant {t}"),
            (None, Some(r)) => format!("{r} stream"),
            (None, None) => String::new(),
        };
        let holds: Vec<String> = held.iter().map(|k| k.to_string()).collect();
        return Err(ControlError::NotFound(format!(
            "state store {} holds no {named}: it holds {}",
            store.path().display(),
            if holds.is_empty() {
                "nothing".to_string()
            } else {
                holds.join(", ")
            }
        )));
    }
    Ok(chosen)
}

/// Writes the dump of the streams `tenant` / `resource` name (all without
/// them) to `out`; returns what it wrote per stream.
pub fn export(
    store: &SledStore,
    tenant: Option<TenantId>,
    resource: Option<Resource>,
    out: &mut dyn Write,
) -> Result<Vec<StreamCounts>, ControlError> {
    let streams = held_streams(store, tenant, resource)?;
    let mut write = |line: &Line| -> Result<(), ControlError> {
        serde_json::to_writer(&mut *out, line)
            .map_err(|e| ControlError::Unreadable(format!("cannot write the export: {e}")))?;
        out.write_all(b"\n")
            .map_err(|e| ControlError::Unreadable(format!("cannot write the export: {e}")))
    };
    write(&Line::Header {
        format: FORMAT.to_string(),
        version: FORMAT_VERSION,
        exported_at: Utc::now(),
        created_by: format!("voucher-cdc {}", env!("CARGO_PKG_VERSION")),
        streams: streams.len() as u64,
    })?;
    let mut counts = Vec::with_capacity(streams.len());
    for key in streams {
        let dump = store.dump_stream(key)?;
        let (tenant, resource) = (key.tenant, key.resource);
        write(&Line::Stream {
            tenant,
            resource,
            state: dump.state.clone(),
        })?;
        for (id, state) in &dump.records {
            let (id, state) = (*id, *state);
            write(&Line::Record {
                tenant,
                resource,
                id,
                state,
            })?;
        }
        for (id, tombstone) in &dump.tombstones {
            let (id, tombstone) = (*id, *tombstone);
            write(&Line::Tombstone {
                tenant,
                resource,
                id,
                tombstone,
            })?;
        }
        for (id, intent) in &dump.intents {
            let (id, intent) = (*id, *intent);
            write(&Line::Intent {
                tenant,
                resource,
                id,
                intent,
            })?;
        }
        for (id, dead_letter) in &dump.dead_letters {
            write(&Line::DeadLetter {
                tenant,
                resource,
                id: *id,
                dead_letter: dead_letter.clone(),
            })?;
        }
        for (id, version) in &dump.versions {
            write(&Line::Version {
                tenant,
                resource,
                id: *id,
                version: VersionLine::of(version),
            })?;
        }
        counts.push(StreamCounts::of(key, &dump));
    }
    out.flush()
        .map_err(|e| ControlError::Unreadable(format!("cannot write the export: {e}")))?;
    Ok(counts)
}

/// Reads a whole dump: every stream it holds, in key order.
fn read_dump(input: &mut dyn BufRead) -> Result<BTreeMap<StreamKey, StreamDump>, ControlError> {
    let mut streams: BTreeMap<StreamKey, StreamDump> = BTreeMap::new();
    let mut header = false;
    for (index, line) in input.lines().enumerate() {
        let number = index + 1;
        let bad = |detail: String| ControlError::Unreadable(format!("line {number}: {detail}"));
        let line = line.map_err(|e| bad(format!("cannot read: {e}")))?;
        if line.trim().is_empty() {
            continue;
        }
        let parsed: Line = serde_json::from_str(&line)
            .map_err(|e| bad(format!("not a line of a voucher-cdc state export ({e})")))?;
        if !header {
            let Line::Header {
                format, version, ..
            } = &parsed
            else {
                return Err(bad(format!(
                    "the first line must be the {FORMAT} header: is this a `voucher-cdc state export`?"
                )));
            };
            if format != FORMAT {
                return Err(bad(format!("format `{format}` is not {FORMAT}")));
            }
            if !(OLDEST_FORMAT_VERSION..=FORMAT_VERSION).contains(version) {
                return Err(bad(format!(
                    "export format version {version}; this build reads versions {OLDEST_FORMAT_VERSION} to {FORMAT_VERSION} (use the voucher-cdc that wrote it, or a newer one)"
                )));
            }
            header = true;
            continue;
        }
        match parsed {
            Line::Header { .. } => return Err(bad("a second header".to_string())),
            Line::Stream {
                tenant,
                resource,
                state,
            } => {
                let key = StreamKey::new(tenant, resource);
                if streams.contains_key(&key) {
                    return Err(bad(format!("stream {key} appears twice")));
                }
                streams.insert(
                    key,
                    StreamDump {
                        state,
                        ..StreamDump::default()
                    },
                );
            }
            Line::Record {
                tenant,
                resource,
                id,
                state,
            } => dump_of(&mut streams, tenant, resource, number)?
                .records
                .push((id, state)),
            Line::Tombstone {
                tenant,
                resource,
                id,
                tombstone,
            } => dump_of(&mut streams, tenant, resource, number)?
                .tombstones
                .push((id, tombstone)),
            Line::Intent {
                tenant,
                resource,
                id,
                intent,
            } => dump_of(&mut streams, tenant, resource, number)?
                .intents
                .push((id, intent)),
            Line::DeadLetter {
                tenant,
                resource,
                id,
                dead_letter,
            } => dump_of(&mut streams, tenant, resource, number)?
                .dead_letters
                .push((id, dead_letter)),
            Line::Version {
                tenant,
                resource,
                id,
                version,
            } => {
                let version = version.stored().map_err(bad)?;
                dump_of(&mut streams, tenant, resource, number)?
                    .versions
                    .push((id, version));
            }
        }
    }
    if !header {
        return Err(ControlError::Unreadable(
            "the export is empty: no header line".to_string(),
        ));
    }
    Ok(streams)
}

/// The dump of `tenant`/`resource` read so far; an error naming line `number` when its
/// `stream` line did not come first.
fn dump_of(
    streams: &mut BTreeMap<StreamKey, StreamDump>,
    tenant: TenantId,
    resource: Resource,
    number: usize,
) -> Result<&mut StreamDump, ControlError> {
    let key = StreamKey::new(tenant, resource);
    streams.get_mut(&key).ok_or_else(|| {
        ControlError::Unreadable(format!(
            "line {number}: stream {key} has no `stream` line before it"
        ))
    })
}

/// Loads the dump `input` into `store`. Nothing is written when the store
/// already holds one of its streams, unless `replace` (then those streams
/// are replaced whole). Returns what it loaded per stream.
pub fn import(
    store: &SledStore,
    input: &mut dyn BufRead,
    replace: bool,
) -> Result<Vec<StreamCounts>, ControlError> {
    let streams = read_dump(input)?;
    if !replace {
        let mut held = Vec::new();
        for key in streams.keys() {
            if store.holds(*key)? {
                held.push(key.to_string());
            }
        }
        if !held.is_empty() {
            return Err(ControlError::Refused(format!(
                "state store {} already holds {}: nothing imported (pass --replace to overwrite them)",
                store.path().display(),
                held.join(", ")
            )));
        }
    }
    let mut counts = Vec::with_capacity(streams.len());
    for (key, dump) in &streams {
        store.restore_stream(*key, dump)?;
        counts.push(StreamCounts::of(*key, dump));
    }
    Ok(counts)
}

/// Forgets the streams of `tenant` (or its `resource`) the store holds: the
/// next sweep of each is a first sync. Returns each with the records it held.
pub fn reset(
    store: &SledStore,
    tenant: TenantId,
    resource: Option<Resource>,
) -> Result<Vec<(StreamKey, u64)>, ControlError> {
    let streams = held_streams(store, Some(tenant), resource)?;
    let mut forgotten = Vec::with_capacity(streams.len());
    for key in streams {
        forgotten.push((key, store.forget_stream(key)?));
    }
    Ok(forgotten)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::ContentHash;
    use crate::state::{Acked, Delivery};

    fn record(byte: u8) -> RecordState {
        RecordState {
            hash: ContentHash([byte; 16]),
            updated_at: Some(1_700_000_000_000_000),
            seen_epoch: 3,
            generation: 1,
            seq: 2,
            print: None,
        }
    }

    #[test]
    fn an_export_imported_into_another_store_holds_exactly_what_the_first_held() {
        let a = SledStore::open_temporary().unwrap();
        let key = StreamKey::new(4, Resource::Vouchers);
        let other = StreamKey::new(5, Resource::Vouchers);
        let page: Vec<(i64, RecordState)> = vec![(-3, record(1)), (7, record(2)), (40, record(3))];
        let acks = vec![Delivery::Acknowledged; page.len()];
        let body = r#"{"id":7,"a\"b":[1,2],"t":"x"}"#;
        let (_, fields) =
            crate::hash::content_hash_with_fields(body, &crate::hash::IgnoreKeys::none()).unwrap();
        let version = StoredVersion {
            hash: record(2).hash,
            fields,
            body: Some(body.to_string()),
        };
        let acked = Acked::page(page, acks, vec![], 3)
            .unwrap()
            .with_versions(vec![(7, version.clone())]);
        a.commit_page(key, &acked).unwrap();
        let intent = Intent {
            hash: ContentHash([9; 16]),
            updated_at: None,
            generation: 0,
            seq: 4,
            op: Some(crate::event::Op::Update),
            previous: Some(ContentHash([2; 16])),
            replay: Some([7; 16]),
        };
        a.write_intents(key, &[(7, intent)]).unwrap();
        let state = StreamState {
            watermark: Some(Utc::now()),
            full_sweep_epoch: 3,
            records_known: 3,
            ..StreamState::default()
        };
        a.save_stream(key, &state).unwrap();
        a.save_stream(other, &StreamState::default()).unwrap();

        let mut dump = Vec::new();
        let counts = export(&a, Some(4), None, &mut dump).unwrap();
        assert_eq!(counts.len(), 1, "only tenant 4");
        let text = String::from_utf8(dump.clone()).unwrap();
        assert!(text.starts_with(r#"{"kind":"header","format":"voucher-cdc-state","version":2"#));

        let b = SledStore::open_temporary().unwrap();
        import(&b, &mut dump.as_slice(), false).unwrap();
        assert_eq!(b.dump_stream(key).unwrap(), a.dump_stream(key).unwrap());
        assert_eq!(b.record_count(key).unwrap(), 3);
        assert_eq!(b.pending_intents(key).unwrap(), vec![(7, intent)]);
        assert_eq!(b.get_versions(key, &[7]).unwrap(), vec![Some(version)]);
        assert!(text.contains(r#"{"kind":"version","tenant":4,"resource":"vouchers","id":7,"#));
        assert!(!b.holds(other).unwrap());

        let refused = import(&b, &mut dump.as_slice(), false).unwrap_err();
        assert!(
            refused
                .to_string()
                .contains("already holds 4/vouchers: nothing imported"),
            "{refused}"
        );
        import(&b, &mut dump.as_slice(), true).unwrap();
        assert_eq!(b.dump_stream(key).unwrap(), a.dump_stream(key).unwrap());

        assert_eq!(reset(&b, 4, None).unwrap(), vec![(key, 3)]);
        assert!(!b.holds(key).unwrap());
        assert_eq!(b.pending_intents(key).unwrap(), vec![]);
    }

    #[test]
    fn a_dump_of_another_format_or_version_or_with_an_orphan_line_is_refused_naming_the_line() {
        let b = SledStore::open_temporary().unwrap();
        let cases = [
            ("{\"a\":1}\n", "line 1: not a line of a voucher-cdc state export"),
            (
                "{\"kind\":\"header\",\"format\":\"voucher-cdc-state\",\"version\":3,\"exported_at\":\"2024-05-01T00:00:00Z\",\"created_by\":\"x\",\"streams\":0}\n",
                "line 1: export format version 3; this build reads versions 1 to 2",
            ),
            (
                "{\"kind\":\"header\",\"format\":\"voucher-cdc-state\",\"version\":1,\"exported_at\":\"2024-05-01T00:00:00Z\",\"created_by\":\"x\",\"streams\":1}\n\
                 {\"kind\":\"tombstone\",\"tenant\":1,\"resource\":\"vouchers\",\"id\":1,\"tombstone\":{\"generation\":1,\"last_hash\":\"00000000000000000000000000000000\",\"updated_at\":null}}\n",
                "line 2: stream 1/vouchers has no `stream` line before it",
            ),
            ("", "the export is empty"),
        ];
        for (text, expected) in cases {
            let err = import(&b, &mut text.as_bytes(), false).unwrap_err();
            assert!(err.to_string().starts_with(expected), "{err}");
        }
    }
}
