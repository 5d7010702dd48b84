//! CloudEvents 1.0 envelopes for catalog changes, and their deterministic ids.
//!
//! An event id is a pure function of the change it describes, so a change that
//! is re-published after a crash carries the same id (brokers deduplicate it)
//! while any later change of the same record never does.

use bytes::Bytes;
use chrono::{DateTime, SecondsFormat, Utc};
use serde::Serialize;
use serde_json::value::RawValue;

use crate::hash::{truncated, ContentHash, Hex128};
use crate::schema::{DataSchema, SchemaBase, SchemaUri};
use crate::stream::{Resource, StreamKey, TenantId};

/// What kind of change an event reports (the `op` attribute).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// A record not known before, seen after the stream's first sync.
    Create,
    /// A known record whose content hash changed.
    Update,
    /// A record emitted by the first sync or by a replay.
    Snapshot,
    /// A record that a complete listing no longer contains.
    Delete,
}

impl Op {
    /// The lowercase name used in the `op` attribute and in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Create => "create",
            Op::Update => "update",
            Op::Snapshot => "snapshot",
            Op::Delete => "delete",
        }
    }
}

/// The CloudEvents `type` of an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventType {
    /// `voucher.updated` / `category.updated`.
    Updated(Resource),
    /// `voucher.deleted` / `category.deleted`.
    Deleted(Resource),
    /// `replay.started`.
    ReplayStarted,
    /// `replay.completed`.
    ReplayCompleted,
    /// `stream.heartbeat`: a quiet stream is still watched.
    Heartbeat,
    /// `replay.cancelled`: an operator cancelled the replay before it completed.
    ReplayCancelled,
    /// A dead letter standing in for an event the sink can never accept; its
    /// payload keeps the original `type`, this only routes it
    /// (`{prefix}.{tenant}.deadletter`, the Kafka dead-letter topic).
    DeadLetter,
}

impl EventType {
    /// The dotted type name, e.g. `voucher.updated`.
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Updated(Resource::Vouchers) => "voucher.updated",
            EventType::Updated(Resource::Categories) => "category.updated",
            EventType::Deleted(Resource::Vouchers) => "voucher.deleted",
            EventType::Deleted(Resource::Categories) => "category.deleted",
            EventType::ReplayStarted => "replay.started",
            EventType::ReplayCompleted => "replay.completed",
            EventType::Heartbeat => "stream.heartbeat",
            EventType::ReplayCancelled => "replay.cancelled",
            EventType::DeadLetter => "deadletter",
        }
    }
}

/// The inputs of a deterministic event id (DESIGN.md, "Event").
#[derive(Debug, Clone, Copy)]
pub struct EventIdParts<'a> {
    /// Tenant of the record.
    pub tenant: TenantId,
    /// Resource of the record.
    pub resource: Resource,
    /// Record id, or a marker such as `replay.started` for framing events.
    pub record_id: &'a str,
    /// How many deletes of this record id were seen before.
    pub generation: u32,
    /// The record's change sequence: which committed change of the record this is.
    pub seq: u64,
    /// The record's `updated_at` as the API returned it, if any.
    pub updated_at: Option<&'a str>,
    /// Hex content hash of the event's data.
    pub content_hash: &'a str,
    /// Hex content hash of the previous version, on update and delete.
    pub previous_hash: Option<&'a str>,
    /// Replay id, on events emitted by a replay.
    pub replay_id: Option<&'a str>,
}

/// Computes the 32-hex-digit event id: blake3 over the length-prefixed parts.
pub fn event_id(parts: &EventIdParts<'_>) -> String {
    let mut input = IdInput::new();
    id_input(parts, |bytes| input.push(bytes));
    crate::hash::hex128(&truncated(&input.finish()))
}

/// Hands the bytes of an event id's input to `push`, in order: a domain
/// tag, then each part as `0` when absent or `1`, its length (u64, little
/// endian) and its bytes.
fn id_input(parts: &EventIdParts<'_>, mut push: impl FnMut(&[u8])) {
    push(b"voucher-cdc/event-id/v2");
    let mut field = |bytes: Option<&[u8]>| match bytes {
        None => push(&[0]),
        Some(b) => {
            push(&[1]);
            push(&(b.len() as u64).to_le_bytes());
            push(b);
        }
    };
    field(Some(&parts.tenant.to_le_bytes()));
    field(Some(parts.resource.as_str().as_bytes()));
    field(Some(parts.record_id.as_bytes()));
    field(Some(&parts.generation.to_le_bytes()));
    field(Some(&parts.seq.to_le_bytes()));
    field(parts.updated_at.map(str::as_bytes));
    field(Some(parts.content_hash.as_bytes()));
    field(parts.previous_hash.map(str::as_bytes));
    field(parts.replay_id.map(str::as_bytes));
}

/// The input of an event id, laid out in a buffer on the stack and hashed at
/// once: the same digest as feeding the parts to a hasher one by one, without
/// a hasher update per part or an allocation per event. Parts that do not fit
/// (an `updated_at` hundreds of bytes long) go through a hasher, boxed so
/// that its 2 KB are not moved around with every id.
struct IdInput {
    buf: [u8; ID_INPUT_BUFFER],
    len: usize,
    hasher: Option<Box<blake3::Hasher>>,
}

/// Room for a record event's id input: 23 bytes of domain, 9 bytes of
/// framing a part, the tenant, resource, record id, generation, sequence,
/// an `updated_at` of ordinary length and two 32-digit hashes take about 222
/// bytes, about 262 with a replay id, about 285 with the longest ordinary
/// values.
const ID_INPUT_BUFFER: usize = 320;

impl IdInput {
    fn new() -> Self {
        IdInput {
            buf: [0; ID_INPUT_BUFFER],
            len: 0,
            hasher: None,
        }
    }

    #[inline]
    fn push(&mut self, bytes: &[u8]) {
        let end = self.len + bytes.len();
        if end <= self.buf.len() {
            self.buf[self.len..end].copy_from_slice(bytes);
            self.len = end;
        } else {
            self.spill(bytes);
        }
    }

    /// Sends what the buffer holds to the hasher, then `bytes` too when they
    /// would not fit an empty buffer either.
    #[cold]
    fn spill(&mut self, bytes: &[u8]) {
        let hasher = self
            .hasher
            .get_or_insert_with(|| Box::new(blake3::Hasher::new()));
        hasher.update(&self.buf[..self.len]);
        self.len = 0;
        if bytes.len() > self.buf.len() {
            hasher.update(bytes);
        } else {
            self.buf[..bytes.len()].copy_from_slice(bytes);
            self.len = bytes.len();
        }
    }

    fn finish(self) -> blake3::Hash {
        let rest = &self.buf[..self.len];
        match self.hasher {
            None => blake3::hash(rest),
            Some(mut hasher) => hasher.update(rest).finalize(),
        }
    }
}

/// The structured-mode CloudEvents JSON document (field order as DESIGN.md),
/// written by [`CloudEvent::encode`].
#[derive(Debug)]
pub struct CloudEvent<'a> {
    /// Always `1.0`.
    pub specversion: &'static str,
    /// Deterministic id, see [`event_id`].
    pub id: &'a str,
    /// `/tenants/{tenant}/catalog/{resource}`.
    pub source: &'a str,
    /// Event type name.
    pub ty: &'static str,
    /// Record id (or the replay id for framing events).
    pub subject: &'a str,
    /// Record `updated_at`, else detection time (RFC 3339).
    pub time: &'a str,
    /// Always `application/json`.
    pub datacontenttype: &'static str,
    /// URI of the JSON Schema of `data` (not part of the id).
    pub dataschema: SchemaUri<'a>,
    /// `{tenant}:{singular resource}:{record id}`.
    pub partitionkey: &'a str,
    /// Tenant id.
    pub tenant: TenantId,
    /// Kind of change (absent on replay framing events).
    pub op: Option<Op>,
    /// Hex content hash of `data`.
    pub contenthash: &'a str,
    /// Hex content hash of the previous version, on update and delete.
    pub previoushash: Option<&'a str>,
    /// Replay id, on events emitted by a replay.
    pub replayid: Option<&'a str>,
    /// `events.changed_fields`, on updates: the top-level keys that changed,
    /// comma-separated (see [`crate::hash::encode_field_list`]). Not part of the id.
    pub changedfields: Option<&'a str>,
    /// `events.before`, on updates and deletes: the previous version's JSON
    /// text, exactly as its event's `data` carried it. Not part of the id.
    pub before: Option<&'a str>,
    /// The record exactly as the API returned it: valid JSON text, written
    /// as it is.
    pub data: &'a str,
}

/// An encoded event, ready for any sink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Deterministic event id (32 hex digits).
    pub id: String,
    /// The stream the event belongs to.
    pub stream: StreamKey,
    /// Event type.
    pub ty: EventType,
    /// Kind of change (None on replay framing events).
    pub op: Option<Op>,
    /// Partition key: `{tenant}:{voucher|category}:{id}`.
    pub partition_key: String,
    /// The serialized CloudEvent JSON.
    pub payload: Bytes,
}

impl Event {
    /// True for `*.deleted` events (Kafka follows them with a tombstone).
    pub fn is_delete(&self) -> bool {
        matches!(self.ty, EventType::Deleted(_))
    }
}

/// True when `t` is an RFC 3339 date-time (what CloudEvents' `time` requires).
pub fn is_rfc3339(t: &str) -> bool {
    DateTime::parse_from_rfc3339(t).is_ok()
}

/// A record's `updated_at` text as unix microseconds (the form state keeps);
/// None when it is not an RFC 3339 timestamp.
pub fn updated_at_micros(text: &str) -> Option<i64> {
    DateTime::parse_from_rfc3339(text)
        .ok()
        .map(|t| t.timestamp_micros())
}

/// Unix microseconds (as state keeps them) formatted the way events carry times.
pub fn format_micros(micros: i64) -> Option<String> {
    DateTime::<Utc>::from_timestamp_micros(micros).map(format_time)
}

/// Formats a timestamp the way events carry it (RFC 3339, UTC, `Z`).
pub fn format_time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// The partition key of a record: `{tenant}:{voucher|category}:{id}`.
pub fn partition_key(stream: StreamKey, record_id: &str) -> String {
    let mut key = String::with_capacity(record_id.len() + 32);
    key.push_str(crate::json::decimal(stream.tenant, &mut [0; 20]));
    key.push(':');
    key.push_str(stream.resource.singular());
    key.push(':');
    key.push_str(record_id);
    key
}

/// Everything needed to build one record event.
#[derive(Debug, Clone, Copy)]
pub struct RecordChange<'a> {
    /// Stream of the record.
    pub stream: StreamKey,
    /// Record id.
    pub record_id: i64,
    /// Delete generation of the record id.
    pub generation: u32,
    /// Change sequence of the record (see [`EventIdParts::seq`]).
    pub seq: u64,
    /// Kind of change.
    pub op: Op,
    /// The record's `updated_at` string, if any.
    pub updated_at: Option<&'a str>,
    /// Content hash of `data`.
    pub content_hash: ContentHash,
    /// Content hash of the previous version.
    pub previous_hash: Option<ContentHash>,
    /// Replay id (16 bytes of the 32-hex id), when emitted by a replay.
    pub replay: Option<[u8; 16]>,
    /// The record as returned by the API (for deletes: `{"id":N}`): valid
    /// JSON text, written into the event as it is.
    pub data: &'a str,
    /// Detection time, used as `time` when the record has no `updated_at`.
    pub detected_at: DateTime<Utc>,
    /// Where `dataschema` points.
    pub schema_base: &'a SchemaBase,
}

/// What `events.changed_fields` and `events.before` add to a record event;
/// the default adds nothing. Neither is an input of the event id.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VersionAttributes<'a> {
    /// The `changedfields` attribute (updates).
    pub changed_fields: Option<&'a str>,
    /// The `before` attribute (updates and deletes).
    pub before: Option<&'a str>,
}

/// Builds the event for one record change.
pub fn record_event(change: &RecordChange<'_>) -> Event {
    record_event_with(change, VersionAttributes::default())
}

/// Builds the event for one record change, with the attributes of its previous version.
pub fn record_event_with(change: &RecordChange<'_>, version: VersionAttributes<'_>) -> Event {
    let (ty, schema) = if change.op == Op::Delete {
        (
            EventType::Deleted(change.stream.resource),
            DataSchema::Delete,
        )
    } else {
        let schema = match change.stream.resource {
            Resource::Vouchers => DataSchema::Voucher,
            Resource::Categories => DataSchema::Category,
        };
        (EventType::Updated(change.stream.resource), schema)
    };
    // The id's input, the hashes' digits, the record id and `source` are
    // written on the stack; `time` is borrowed when `updated_at` is RFC 3339
    // (else formatted). The event keeps the id, the partition key and the
    // payload.
    let (mut id_buf, mut source_buf) = ([0; 20], [0; SOURCE_MAX]);
    let record_id = crate::json::signed_decimal(change.record_id, &mut id_buf);
    let content_hash = change.content_hash.digits();
    let previous_hash = change.previous_hash.map(|h| h.digits());
    let replay_id = change.replay.map(|r| Hex128::of(&r));
    let id = event_id(&EventIdParts {
        tenant: change.stream.tenant,
        resource: change.stream.resource,
        record_id,
        generation: change.generation,
        seq: change.seq,
        updated_at: change.updated_at,
        content_hash: content_hash.as_str(),
        previous_hash: previous_hash.as_ref().map(Hex128::as_str),
        replay_id: replay_id.as_ref().map(Hex128::as_str),
    });
    let partition_key = partition_key(change.stream, record_id);
    let detected;
    let time = match change.updated_at.filter(|_| change.op != Op::Delete) {
        Some(t) if is_rfc3339(t) => t,
        unreadable => {
            if let Some(t) = unreadable {
                // `time` must be RFC 3339; `data` keeps the original value.
                tracing::debug!(tenant = change.stream.tenant, resource = %change.stream.resource,
                    record = change.record_id, updated_at = t,
                    "updated_at is not RFC 3339; the event's time is the detection time");
                metrics::counter!(crate::telemetry::metric::UNREADABLE_UPDATED_AT,
                    "tenant" => change.stream.tenant.to_string(),
                    "resource" => change.stream.resource.as_str())
                .increment(1);
            }
            detected = format_time(change.detected_at);
            &detected
        }
    };
    let doc = CloudEvent {
        specversion: "1.0",
        id: &id,
        source: source_in(change.stream, &mut source_buf),
        ty: ty.as_str(),
        subject: record_id,
        time,
        datacontenttype: "application/json",
        dataschema: change.schema_base.uri_parts(schema),
        partitionkey: &partition_key,
        tenant: change.stream.tenant,
        op: Some(change.op),
        contenthash: content_hash.as_str(),
        previoushash: previous_hash.as_ref().map(Hex128::as_str),
        replayid: replay_id.as_ref().map(Hex128::as_str),
        changedfields: version.changed_fields,
        before: version.before,
        data: change.data,
    };
    let payload = doc.encode();
    Event {
        id,
        stream: change.stream,
        ty,
        op: Some(change.op),
        partition_key,
        payload,
    }
}

/// Data of a `replay.started` / `replay.completed` / `replay.cancelled` event.
#[derive(Debug, Serialize)]
struct ReplayData<'a> {
    tenant: TenantId,
    resource: Resource,
    replayid: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    since: Option<&'a str>,
    records: u64,
}

/// Builds a `replay.started` (`completed == false`) or `replay.completed` event.
///
/// Ids are deterministic in (stream, replay id, kind): a replay restarted after
/// a crash re-announces itself with the same id.
pub fn replay_event(
    stream: StreamKey,
    replay_id: &str,
    since: Option<&str>,
    completed: bool,
    records: u64,
    now: DateTime<Utc>,
    schema_base: &SchemaBase,
) -> Event {
    let ty = if completed {
        EventType::ReplayCompleted
    } else {
        EventType::ReplayStarted
    };
    replay_frame(stream, ty, replay_id, since, records, now, schema_base)
}

/// Builds the `replay.cancelled` event closing what `replay.started` opened;
/// `records` are the snapshots the replay emitted before it was cancelled.
pub fn replay_cancelled_event(
    stream: StreamKey,
    replay_id: &str,
    since: Option<&str>,
    records: u64,
    now: DateTime<Utc>,
    schema_base: &SchemaBase,
) -> Event {
    replay_frame(
        stream,
        EventType::ReplayCancelled,
        replay_id,
        since,
        records,
        now,
        schema_base,
    )
}

/// A replay frame of type `ty`.
fn replay_frame(
    stream: StreamKey,
    ty: EventType,
    replay_id: &str,
    since: Option<&str>,
    records: u64,
    now: DateTime<Utc>,
    schema_base: &SchemaBase,
) -> Event {
    let data = ReplayData {
        tenant: stream.tenant,
        resource: stream.resource,
        replayid: replay_id,
        since,
        records,
    };
    stream_event(
        &StreamFrame {
            stream,
            ty,
            subject: replay_id,
            key_suffix: "replay",
            time: format_time(now),
            schema: DataSchema::Replay,
            replay_id: Some(replay_id),
            // The completed count is part of the data but not of the identity: a
            // replay completes once, whatever count a retried attempt reports.
            identity: FrameIdentity::ReplayOnly,
        },
        &data,
        schema_base,
    )
}

/// What a stream-level event's id is derived from, besides its stream and type.
#[derive(Debug, Clone, Copy)]
enum FrameIdentity {
    /// The replay id alone (a replay frame is announced once per replay).
    ReplayOnly,
    /// The time and the data (every heartbeat is new).
    TimeAndData,
}

/// A stream-level event (replay frame, heartbeat): no record, no `op`.
struct StreamFrame<'a> {
    stream: StreamKey,
    ty: EventType,
    subject: &'a str,
    /// Last part of the partition key: `{tenant}:{voucher|category}:{key_suffix}`.
    key_suffix: &'static str,
    time: String,
    schema: DataSchema,
    replay_id: Option<&'a str>,
    identity: FrameIdentity,
}

/// Builds a stream-level event carrying `data`.
fn stream_event(frame: &StreamFrame<'_>, data: &impl Serialize, schema_base: &SchemaBase) -> Event {
    let stream = frame.stream;
    let data_json = serde_json::to_string(data).unwrap_or_else(|_| "{}".to_string());
    let data_raw = RawValue::from_string(data_json).unwrap_or_else(|_| empty_object());
    let content_hash = crate::hash::hex128(&truncated(&blake3::hash(data_raw.get().as_bytes())));
    let (updated_at, identity_hash) = match frame.identity {
        FrameIdentity::ReplayOnly => (None, ""),
        FrameIdentity::TimeAndData => (Some(frame.time.as_str()), content_hash.as_str()),
    };
    let id = event_id(&EventIdParts {
        tenant: stream.tenant,
        resource: stream.resource,
        record_id: frame.ty.as_str(),
        generation: 0,
        seq: 0,
        updated_at,
        content_hash: identity_hash,
        previous_hash: None,
        replay_id: frame.replay_id,
    });
    let partition_key = format!(
        "{}:{}:{}",
        stream.tenant,
        stream.resource.singular(),
        frame.key_suffix
    );
    let mut source_buf = [0; SOURCE_MAX];
    let doc = CloudEvent {
        specversion: "1.0",
        id: &id,
        source: source_in(stream, &mut source_buf),
        ty: frame.ty.as_str(),
        subject: frame.subject,
        time: &frame.time,
        datacontenttype: "application/json",
        dataschema: schema_base.uri_parts(frame.schema),
        partitionkey: &partition_key,
        tenant: stream.tenant,
        op: None,
        contenthash: &content_hash,
        previoushash: None,
        replayid: frame.replay_id,
        changedfields: None,
        before: None,
        data: data_raw.get(),
    };
    Event {
        payload: doc.encode(),
        id,
        stream,
        ty: frame.ty,
        op: None,
        partition_key,
    }
}

/// Data of a `stream.heartbeat` event.
#[derive(Debug, Serialize)]
struct HeartbeatData {
    tenant: TenantId,
    resource: Resource,
    watermark: Option<String>,
    lastsweep: Option<String>,
    lastevent: Option<String>,
}

/// What a heartbeat reports about its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamPulse {
    /// The stream's watermark, if it has one.
    pub watermark: Option<DateTime<Utc>>,
    /// When its last successful sweep finished.
    pub last_sweep: Option<DateTime<Utc>>,
    /// When this process last published one of its events.
    pub last_event: Option<DateTime<Utc>>,
}

/// Builds the `stream.heartbeat` event of `stream` at `now` (events.heartbeat_interval).
///
/// Its id is deterministic in (stream, `now`): two heartbeats never share one.
pub fn heartbeat_event(
    stream: StreamKey,
    pulse: StreamPulse,
    now: DateTime<Utc>,
    schema_base: &SchemaBase,
) -> Event {
    let data = HeartbeatData {
        tenant: stream.tenant,
        resource: stream.resource,
        watermark: pulse.watermark.map(format_time),
        lastsweep: pulse.last_sweep.map(format_time),
        lastevent: pulse.last_event.map(format_time),
    };
    stream_event(
        &StreamFrame {
            stream,
            ty: EventType::Heartbeat,
            subject: stream.resource.as_str(),
            key_suffix: "heartbeat",
            time: format_time(now),
            schema: DataSchema::Heartbeat,
            replay_id: None,
            identity: FrameIdentity::TimeAndData,
        },
        &data,
        schema_base,
    )
}

/// The attributes of a record event a dead letter copies (everything but `data`).
#[derive(Debug, serde::Deserialize)]
struct Head {
    id: String,
    source: String,
    #[serde(rename = "type")]
    ty: String,
    subject: String,
    time: String,
    partitionkey: String,
    tenant: TenantId,
    op: Option<Op>,
    contenthash: String,
    previoushash: Option<String>,
    replayid: Option<String>,
}

/// The dead-letter envelope: a record event's attributes without its `data`,
/// a `dataref` to fetch the record, and why the sink refused it.
#[derive(Debug, Serialize)]
struct DeadLetterDoc<'a> {
    specversion: &'static str,
    id: &'a str,
    source: &'a str,
    #[serde(rename = "type")]
    ty: &'a str,
    subject: &'a str,
    time: &'a str,
    partitionkey: &'a str,
    tenant: TenantId,
    #[serde(skip_serializing_if = "Option::is_none")]
    op: Option<Op>,
    contenthash: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    previoushash: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    replayid: Option<&'a str>,
    dataref: String,
    deadletterreason: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    deadletterlimit: Option<u64>,
}

/// The single-record API path a dead letter's `dataref` names:
/// `/tenants/{tenant}/catalog/{resource}/{id}`.
pub fn record_path(stream: StreamKey, record_id: &str) -> String {
    let mut path = source_in(stream, &mut [0; SOURCE_MAX]).to_owned();
    path.push('/');
    path.push_str(record_id);
    path
}

/// Why a dead letter could not be built from an event.
#[derive(Debug, thiserror::Error)]
#[error("event {event_id} cannot be turned into a dead letter: {source}")]
pub struct DeadLetterError {
    /// The event.
    pub event_id: String,
    /// Why its payload could not be read.
    pub source: serde_json::Error,
}

/// Builds the dead letter that stands in for `event`, which the sink refused
/// with `reason` (and, when known, the broker `limit` in bytes): same `id`,
/// `type`, `subject`, `tenant`, `op` and hashes, no `data`, a `dataref`
/// naming the record's single-record API path.
pub fn dead_letter_event(
    event: &Event,
    reason: &str,
    limit: Option<u64>,
) -> Result<Event, DeadLetterError> {
    let head: Head = serde_json::from_slice(&event.payload).map_err(|source| DeadLetterError {
        event_id: event.id.clone(),
        source,
    })?;
    let doc = DeadLetterDoc {
        specversion: "1.0",
        id: &head.id,
        source: &head.source,
        ty: &head.ty,
        subject: &head.subject,
        time: &head.time,
        partitionkey: &head.partitionkey,
        tenant: head.tenant,
        op: head.op,
        contenthash: &head.contenthash,
        previoushash: head.previoushash.as_deref(),
        replayid: head.replayid.as_deref(),
        dataref: record_path(event.stream, &head.subject),
        deadletterreason: reason,
        deadletterlimit: limit,
    };
    Ok(Event {
        id: event.id.clone(),
        stream: event.stream,
        ty: EventType::DeadLetter,
        op: event.op,
        partition_key: event.partition_key.clone(),
        payload: Bytes::from(serde_json::to_vec(&doc).unwrap_or_default()),
    })
}

/// The longest `source`: `/tenants/` (9), a tenant of 20 digits,
/// `/catalog/` (9) and `categories` (10); a test holds every resource to it.
const SOURCE_MAX: usize = 48;

/// `/tenants/{tenant}/catalog/{resource}`, written into `buf`.
fn source_in(stream: StreamKey, buf: &mut [u8; SOURCE_MAX]) -> &str {
    let mut len = 0;
    for part in [
        "/tenants/",
        crate::json::decimal(stream.tenant, &mut [0; 20]),
        "/catalog/",
        stream.resource.as_str(),
    ] {
        buf[len..len + part.len()].copy_from_slice(part.as_bytes());
        len += part.len();
    }
    // Every part is text; the fallback cannot be reached.
    std::str::from_utf8(&buf[..len]).unwrap_or_default()
}

fn empty_object() -> Box<RawValue> {
    // `{}` is valid JSON, so this cannot fail; fall back to `null` regardless.
    RawValue::from_string("{}".to_string()).unwrap_or_else(|_| RawValue::NULL.to_owned())
}

/// Room for the attributes around `data` (about 500 bytes with a long
/// `dataschema`), so the payload is written into one allocation.
const ENVELOPE_RESERVE: usize = 768;

impl CloudEvent<'_> {
    /// The event JSON: the attributes in field order, absent optional ones
    /// left out, strings escaped as serde_json escapes them, and `data`
    /// written around the record's bytes as they are (never parsed or
    /// re-serialised). One allocation, sized up front.
    pub fn encode(&self) -> Bytes {
        let extra = self.before.map_or(0, |b| b.len() + b.len() / 8);
        let mut out = Vec::with_capacity(self.data.len() + extra + ENVELOPE_RESERVE);
        out.extend_from_slice(b"{\"specversion\":");
        json_str(&mut out, self.specversion);
        attribute(&mut out, "id", Some(self.id));
        attribute(&mut out, "source", Some(self.source));
        attribute(&mut out, "type", Some(self.ty));
        attribute(&mut out, "subject", Some(self.subject));
        attribute(&mut out, "time", Some(self.time));
        attribute(&mut out, "datacontenttype", Some(self.datacontenttype));
        out.extend_from_slice(b",\"dataschema\":");
        json_str_joined(&mut out, [self.dataschema.base, self.dataschema.file]);
        attribute(&mut out, "partitionkey", Some(self.partitionkey));
        out.extend_from_slice(b",\"tenant\":");
        out.extend_from_slice(crate::json::decimal(self.tenant, &mut [0; 20]).as_bytes());
        attribute(&mut out, "op", self.op.map(Op::as_str));
        attribute(&mut out, "contenthash", Some(self.contenthash));
        attribute(&mut out, "previoushash", self.previoushash);
        attribute(&mut out, "replayid", self.replayid);
        attribute(&mut out, "changedfields", self.changedfields);
        attribute(&mut out, "before", self.before);
        out.extend_from_slice(b",\"data\":");
        out.extend_from_slice(self.data.as_bytes());
        out.push(b'}');
        Bytes::from(out)
    }
}

/// `,"name":"value"` when there is a value.
fn attribute(out: &mut Vec<u8>, name: &str, value: Option<&str>) {
    if let Some(value) = value {
        out.extend_from_slice(b",\"");
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b"\":");
        json_str(out, value);
    }
}

/// The JSON string of the parts joined, written without joining them when
/// none needs escaping (escaping is per character, so the result is the same).
fn json_str_joined(out: &mut Vec<u8>, parts: [&str; 2]) {
    if parts.iter().all(|part| needs_no_escape(part)) {
        out.push(b'"');
        for part in parts {
            out.extend_from_slice(part.as_bytes());
        }
        out.push(b'"');
    } else {
        json_str(out, &parts.concat());
    }
}

/// True when `text` holds no `"`, `\\` or control character: its JSON string
/// is the text between quotes.
fn needs_no_escape(text: &str) -> bool {
    crate::hash::plain_run_end(text.as_bytes(), 0) == text.len()
}

/// A JSON string, escaped exactly as serde_json escapes it (`"`, `\\` and
/// control characters; nothing else).
fn json_str(out: &mut Vec<u8>, text: &str) {
    if needs_no_escape(text) {
        out.push(b'"');
        out.extend_from_slice(text.as_bytes());
        out.push(b'"');
    } else if serde_json::to_writer(&mut *out, text).is_err() {
        // Writing a string into a Vec cannot fail.
        out.extend_from_slice(b"\"\"");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_written_as_to_string_writes_them() {
        for n in [0u64, 7, 10, 99, 100, 4_096, u64::from(u32::MAX), u64::MAX] {
            assert_eq!(crate::json::decimal(n, &mut [0; 20]), n.to_string());
        }
        for id in [0i64, 1, -1, 42, -9_000, i64::MAX, i64::MIN] {
            assert_eq!(
                crate::json::signed_decimal(id, &mut [0; 20]),
                id.to_string()
            );
        }
        let stream = StreamKey::new(18_446_744_073_709_551_615, Resource::Categories);
        assert_eq!(
            partition_key(stream, "-5"),
            "18446744073709551615:category:-5"
        );
        assert_eq!(
            source_in(stream, &mut [0; SOURCE_MAX]),
            "/tenants/18446744073709551615/catalog/categories"
        );
        assert_eq!(
            record_path(stream, "-5"),
            "/tenants/18446744073709551615/catalog/categories/-5"
        );
    }

    #[test]
    fn the_longest_source_of_every_resource_fits_its_buffer() {
        for resource in Resource::ALL {
            let longest = "/tenants/".len() + 20 + "/catalog/".len() + resource.as_str().len();
            assert!(longest <= SOURCE_MAX, "{resource}");
        }
    }

    #[test]
    fn the_hand_written_envelope_writes_every_attribute_in_order_escaped_as_serde_json_does() {
        let data = r#"{"id":1,"t":"a\"b\u00e9"}"#;
        let before = "{\"id\":1,\"t\":\"tab\there \\ \u{1} \u{7f} é 🎉\"}";
        for full in [false, true] {
            let doc = CloudEvent {
                specversion: "1.0",
                id: "0123456789abcdef0123456789abcdef",
                source: "/tenants/7/catalog/vouchers",
                ty: "voucher.updated",
                subject: "9\"\n",
                time: "2024-05-01T10:00:00Z",
                datacontenttype: "application/json",
                dataschema: SchemaUri {
                    // A base that needs escaping on the second round.
                    base: if full {
                        "https://example.com/s\"\\\n/"
                    } else {
                        "https://example.com/s/"
                    },
                    file: "voucher.schema.json",
                },
                partitionkey: "7:voucher:9",
                tenant: 7,
                op: full.then_some(Op::Update),
                contenthash: "ffeeddccbbaa99887766554433221100",
                previoushash: full.then_some("00112233445566778899aabbccddeeff"),
                replayid: full.then_some("aa"),
                changedfields: full.then_some("price,title"),
                before: full.then_some(before),
                data,
            };
            let payload = String::from_utf8(doc.encode().to_vec()).unwrap();
            // Strings escaped exactly as serde_json escapes them; `data` as it is.
            let escaped = |text: &str| serde_json::to_string(text).unwrap();
            assert!(payload.contains(&format!(r#","subject":{},"#, escaped(doc.subject))));
            assert!(payload.ends_with(&format!(r#","data":{data}}}"#)));
            if full {
                assert!(payload.contains(&format!(r#","before":{},"#, escaped(before))));
            }
            // Every attribute, in field order, reads back as written.
            let bytes = payload.as_bytes();
            let mut names = Vec::new();
            let end = crate::json::walk_object(bytes, 0, |key, pos| {
                names.push(String::from_utf8(key.to_vec()).ok()?);
                Some(crate::json::Visited::Until(crate::json::value_end(
                    bytes, pos,
                )?))
            });
            assert_eq!(end, Some(bytes.len()));
            let mut expected = vec![
                "specversion",
                "id",
                "source",
                "type",
                "subject",
                "time",
                "datacontenttype",
                "dataschema",
                "partitionkey",
                "tenant",
            ];
            if full {
                expected.extend(["op", "contenthash", "previoushash", "replayid"]);
                expected.extend(["changedfields", "before", "data"]);
            } else {
                expected.extend(["contenthash", "data"]);
            }
            assert_eq!(names, expected);
            let value: serde_json::Value = serde_json::from_str(&payload).unwrap();
            assert_eq!(value["subject"], doc.subject);
            let schema = format!("{}{}", doc.dataschema.base, doc.dataschema.file);
            assert_eq!(value["dataschema"], schema);
            assert!(payload.contains(&format!(r#","dataschema":{},"#, escaped(&schema))));
            assert_eq!(value["tenant"], 7);
            if full {
                assert_eq!(value["before"], before);
                assert_eq!(value["op"], "update");
            }
        }
    }

    /// The id of `parts` with its input laid out in a `Vec` and hashed at once.
    fn reference_event_id(parts: &EventIdParts<'_>) -> String {
        let mut input = Vec::new();
        id_input(parts, |bytes| input.extend_from_slice(bytes));
        hex::encode(truncated(&blake3::hash(&input)))
    }

    #[test]
    fn an_id_whose_parts_overflow_the_stack_buffer_is_the_same_digest() {
        // Around the buffer's size and far beyond it, in the middle of the
        // input and at its end.
        for long in [0, 1, 100, 200, 250, 300, 319, 320, 321, 640, 5_000] {
            let text = "x".repeat(long);
            for (record_id, updated_at, replay_id) in [
                ("1", Some(text.as_str()), None),
                (text.as_str(), None, Some("r")),
                ("-7", None, Some(text.as_str())),
            ] {
                let parts = EventIdParts {
                    tenant: 7,
                    resource: Resource::Vouchers,
                    record_id,
                    generation: 2,
                    seq: 9,
                    updated_at,
                    content_hash: "ffeeddccbbaa99887766554433221100",
                    previous_hash: Some("00112233445566778899aabbccddeeff"),
                    replay_id,
                };
                assert_eq!(event_id(&parts), reference_event_id(&parts), "{long}");
            }
        }
    }

    #[test]
    fn updated_at_text_converts_to_unix_microseconds() {
        assert_eq!(updated_at_micros("1970-01-01T00:00:01Z"), Some(1_000_000));
        assert_eq!(
            updated_at_micros("2024-05-01T10:00:00.123456+02:00"),
            Some(1_714_550_400_123_456)
        );
        assert_eq!(updated_at_micros("yesterday"), None);
        let micros = updated_at_micros("2026-01-01T00:00:00.5Z").unwrap();
        assert_eq!(
            format_micros(micros).as_deref(),
            Some("2026-01-01T00:00:00.500000Z")
        );
        assert_eq!(updated_at_micros(""), None);
    }

    fn change(op: Op, data: &RawValue) -> RecordChange<'_> {
        RecordChange {
            stream: StreamKey::new(7, Resource::Vouchers),
            record_id: 9,
            generation: 0,
            seq: 1,
            op,
            updated_at: Some("2024-05-01T10:00:00Z"),
            content_hash: ContentHash([3; 16]),
            previous_hash: None,
            replay: None,
            data: data.get(),
            detected_at: DateTime::from_timestamp(1_714_600_000, 0).unwrap_or_default(),
            schema_base: &crate::schema::DEFAULT_SCHEMA_BASE,
        }
    }

    #[test]
    fn only_a_deleted_record_event_is_a_delete() {
        let data = RawValue::from_string(r#"{"id":9}"#.to_string()).unwrap();
        let delete = record_event(&change(Op::Delete, &data));
        assert!(delete.is_delete());
        assert_eq!(delete.ty.as_str(), "voucher.deleted");
        for op in [Op::Create, Op::Update, Op::Snapshot] {
            let event = record_event(&change(op, &data));
            assert!(!event.is_delete(), "{op:?}");
            assert_eq!(event.ty.as_str(), "voucher.updated");
        }
        let started = replay_event(
            StreamKey::new(7, Resource::Vouchers),
            "0123456789abcdef0123456789abcdef",
            None,
            false,
            0,
            Utc::now(),
            &crate::schema::DEFAULT_SCHEMA_BASE,
        );
        assert!(!started.is_delete());
    }

    fn event_time(event: &Event) -> String {
        let doc: serde_json::Value = serde_json::from_slice(&event.payload).unwrap();
        doc["time"].as_str().unwrap_or_default().to_string()
    }

    #[test]
    fn an_unreadable_updated_at_is_counted_and_the_event_takes_the_detection_time() {
        let data = RawValue::from_string(r#"{"id":9}"#.to_string()).unwrap();
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let (unreadable, deleted) = metrics::with_local_recorder(&recorder, || {
            let unreadable = record_event(&RecordChange {
                updated_at: Some("yesterday"),
                ..change(Op::Update, &data)
            });
            // A delete never reads `updated_at`, so it is not counted.
            let deleted = record_event(&RecordChange {
                updated_at: Some("yesterday"),
                ..change(Op::Delete, &data)
            });
            (unreadable, deleted)
        });
        assert_eq!(event_time(&unreadable), "2024-05-01T21:46:40.000000Z");
        assert_eq!(event_time(&deleted), "2024-05-01T21:46:40.000000Z");
        let rendered = handle.render();
        let line = rendered
            .lines()
            .find(|l| l.starts_with(crate::telemetry::metric::UNREADABLE_UPDATED_AT))
            .unwrap_or_default();
        assert!(line.ends_with(" 1"), "{rendered}");
        // A readable one is the event's time as written.
        let readable = record_event(&change(Op::Update, &data));
        assert_eq!(event_time(&readable), "2024-05-01T10:00:00Z");
    }

    #[test]
    fn a_record_event_carries_every_cloudevents_attribute() {
        let data = RawValue::from_string(r#"{"id":9}"#.to_string()).unwrap();
        let event = record_event(&RecordChange {
            previous_hash: Some(ContentHash([4; 16])),
            ..change(Op::Update, &data)
        });
        assert_eq!(event.partition_key, "7:voucher:9");
        assert_eq!(event.op, Some(Op::Update));
        assert_eq!(event.stream, StreamKey::new(7, Resource::Vouchers));
        let doc: serde_json::Value = serde_json::from_slice(&event.payload).unwrap();
        assert_eq!(
            doc,
            serde_json::json!({
                "specversion": "1.0",
                "id": event.id,
                "source": "/tenants/7/catalog/vouchers",
                "type": "voucher.updated",
                "subject": "9",
                "time": "2024-05-01T10:00:00Z",
                "datacontenttype": "application/json",
                "dataschema": "http://127.0.0.1:9464/v1/schemas/voucher.schema.json",
                "partitionkey": "7:voucher:9",
                "tenant": 7,
                "op": "update",
                "contenthash": "03030303030303030303030303030303",
                "previoushash": "04040404040404040404040404040404",
                "data": {"id": 9},
            })
        );
    }

    #[test]
    fn the_version_attributes_change_neither_the_id_nor_any_other_byte_of_the_event() {
        let data = RawValue::from_string(r#"{"id":9,"price":2}"#.to_string()).unwrap();
        let change = RecordChange {
            previous_hash: Some(ContentHash([4; 16])),
            ..change(Op::Update, &data)
        };
        let plain = record_event(&change);
        assert_eq!(
            record_event_with(&change, VersionAttributes::default()),
            plain,
            "no attributes: exactly the event without them"
        );
        let with = record_event_with(
            &change,
            VersionAttributes {
                changed_fields: Some("price"),
                before: Some(r#"{"id":9,"price":1}"#),
            },
        );
        assert_eq!(with.id, plain.id, "not part of the id");
        let mut doc: serde_json::Value = serde_json::from_slice(&with.payload).unwrap();
        assert_eq!(doc["changedfields"], "price");
        assert_eq!(doc["before"], r#"{"id":9,"price":1}"#);
        let object = doc.as_object_mut().unwrap();
        object.remove("changedfields");
        object.remove("before");
        let without: serde_json::Value = serde_json::from_slice(&plain.payload).unwrap();
        assert_eq!(doc, without);
        // Both sit before `data`, which stays last.
        let text = String::from_utf8(with.payload.to_vec()).unwrap();
        assert!(text.contains(r#""changedfields":"price","before":"{\"id\":9,\"price\":1}","data":{"id":9,"price":2}}"#), "{text}");
    }

    #[test]
    fn a_records_path_is_its_single_record_api_path() {
        let stream = StreamKey::new(42, Resource::Vouchers);
        assert_eq!(
            record_path(stream, "123"),
            "/tenants/42/catalog/vouchers/123"
        );
        let stream = StreamKey::new(7, Resource::Categories);
        assert_eq!(record_path(stream, "5"), "/tenants/7/catalog/categories/5");
    }
}
