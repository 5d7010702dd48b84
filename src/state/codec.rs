//! Compact binary encodings of state keys and per-record values.
//!
//! Per-record values are written hundreds of thousands of times, so they use a
//! small hand-rolled format instead of serde_json (see docs/state.md):
//!
//! * key: `kind u8 | tenant u64 BE | resource tag u8 | n i64 BE with the sign bit flipped`
//!   (18 bytes; flipping the sign bit makes byte order equal numeric order),
//!   where `n` is the record id for a tombstone and the bucket `id >> 5` for records;
//! * record state: `flags u8 | hash [16] | updated_at i64 BE (only if flags bit 0) |
//!   seen_epoch varint | generation varint | seq varint (only if flags bit 1) |
//!   raw print u64 LE (only if flags bit 2, layout 4)`;
//!   a tombstone is the same head (bit 0 only) followed by `generation varint`;
//!   layout 1 never set bit 1, so its records read as change sequence 0;
//! * records are stored 32 ids to a bucket (`id >> 5`): the bucket value is
//!   `presence u32 BE` (bit `id & 31` set when that id is present) followed by
//!   the record states of the present ids in id order. Pages list neighbouring
//!   ids, so one sled entry serves many records: far fewer sled operations per
//!   page and far less per-entry overhead on disk than one entry per record;
//! * a dead-lettered record: key `b'd' | tenant | tag | id`, value the JSON
//!   of its reason, limit and since (rare, so JSON), written and cleared with
//!   the record's bucket (in the same batch, or an earlier one of the same
//!   staged group when the group needs several);
//! * the number of records of a stream: key `b'n' | tenant | tag`, value u64 BE,
//!   updated in the same batch as the buckets;
//! * intents are journalled per publish batch: key `b'j' | tenant | tag | seq u64 BE`,
//!   value `count varint | (id i64 BE | intent value)*`, an intent value being
//!   `flags u8 | hash [16] | updated_at (bit 0) | generation varint |
//!   seq varint (bit 1) | op u8 (bit 2) | previous hash [16] (bit 3) |
//!   replay id [16] (bit 4)`; layout 1 intents carry bit 0 at most;
//! * layout 3: a record's stored version (what `events.changed_fields` and
//!   `events.before` keep of its last committed version): key `b'v' | tenant |
//!   tag | id`, value `flags u8 | hash [16] | (bit 0) shape u64 BE | count
//!   varint | field hash [8] * count | (bit 1) lz4 block of the body with its
//!   u32 LE length first (the rest of the value)`; the shape, the sorted
//!   top-level keys the field hashes belong to, is stored once per stream:
//!   key `b's' | tenant | tag | shape id`, value `count varint | (len varint |
//!   canonical key bytes) * count`. Layout 1 and 2 stores have neither kind,
//!   and every layout 1 or 2 value reads as before.

use crate::event::Op;
use crate::hash::{ContentHash, FieldHash, RawPrint};
use crate::stream::{Resource, StreamKey};

use super::{Intent, RecordState, Tombstone};

/// Record ids per bucket (a power of two).
pub(crate) const BUCKET_SLOTS: usize = 32;
const BUCKET_SHIFT: u32 = BUCKET_SLOTS.trailing_zeros();

/// Kind byte of a committed record bucket key.
pub(crate) const KIND_RECORD: u8 = b'r';
/// Kind byte of an intent journal entry key (one per `write_intents` batch).
pub(crate) const KIND_JOURNAL: u8 = b'j';
/// Kind byte of a stream's record count (key = the 10-byte prefix, value u64 BE).
pub(crate) const KIND_COUNT: u8 = b'n';
/// Kind byte of a tombstone key.
pub(crate) const KIND_TOMBSTONE: u8 = b't';
/// Kind byte of a dead-letter mark (record id key, JSON [`super::DeadLetter`] value);
/// stores of layout 1 and 2 simply have none.
pub(crate) const KIND_DEAD_LETTER: u8 = b'd';

/// Kind byte of a record's stored version (layout 3): field hashes and/or body.
pub(crate) const KIND_VERSION: u8 = b'v';
/// Kind byte of a stream's field shape (layout 3): the keys field hashes belong to.
pub(crate) const KIND_SHAPE: u8 = b's';

/// Length of a per-record key.
pub(crate) const RECORD_KEY_LEN: usize = 18;
/// Length of a per-stream key prefix (kind, tenant, tag).
pub(crate) const PREFIX_LEN: usize = 10;

const FLAG_UPDATED_AT: u8 = 1;
const FLAG_SEQ: u8 = 1 << 1;
const FLAG_OP: u8 = 1 << 2;
const FLAG_PREVIOUS: u8 = 1 << 3;
const FLAG_REPLAY: u8 = 1 << 4;
/// Record states only (layout 4): the record's raw print follows, 8 bytes LE.
const FLAG_PRINT: u8 = 1 << 2;
const RECORD_FLAGS: u8 = FLAG_UPDATED_AT | FLAG_SEQ | FLAG_PRINT;
const INTENT_FLAGS: u8 = FLAG_UPDATED_AT | FLAG_SEQ | FLAG_OP | FLAG_PREVIOUS | FLAG_REPLAY;

/// The 9-byte key of a stream in the `streams` tree.
pub(crate) fn stream_key(key: StreamKey) -> [u8; 9] {
    let mut out = [0u8; 9];
    out[..8].copy_from_slice(&key.tenant.to_be_bytes());
    out[8] = key.resource.tag();
    out
}

/// Decodes a `streams` tree key; None when it is malformed.
pub(crate) fn decode_stream_key(bytes: &[u8]) -> Option<StreamKey> {
    let bytes: &[u8; 9] = bytes.try_into().ok()?;
    let mut tenant = [0u8; 8];
    tenant.copy_from_slice(&bytes[..8]);
    let resource = Resource::ALL.into_iter().find(|r| r.tag() == bytes[8])?;
    Some(StreamKey::new(u64::from_be_bytes(tenant), resource))
}

/// The prefix shared by every key of one kind in one stream.
pub(crate) fn prefix(kind: u8, key: StreamKey) -> [u8; PREFIX_LEN] {
    let mut out = [0u8; PREFIX_LEN];
    out[0] = kind;
    out[1..9].copy_from_slice(&key.tenant.to_be_bytes());
    out[9] = key.resource.tag();
    out
}

/// The key of one record id of one kind in one stream.
pub(crate) fn record_key(kind: u8, key: StreamKey, id: i64) -> [u8; RECORD_KEY_LEN] {
    let mut out = [0u8; RECORD_KEY_LEN];
    out[..PREFIX_LEN].copy_from_slice(&prefix(kind, key));
    out[PREFIX_LEN..].copy_from_slice(&((id as u64) ^ (1 << 63)).to_be_bytes());
    out
}

/// The record id of a per-record key; None when the key is malformed.
pub(crate) fn key_id(key: &[u8]) -> Option<i64> {
    let tail: [u8; 8] = key.get(PREFIX_LEN..RECORD_KEY_LEN)?.try_into().ok()?;
    if key.len() != RECORD_KEY_LEN {
        return None;
    }
    Some((u64::from_be_bytes(tail) ^ (1 << 63)) as i64)
}

/// Appends the shared head: flags (bit 0 set from `updated_at`, `extra` or'ed in), hash, optional updated_at.
fn put_head(out: &mut Vec<u8>, hash: ContentHash, updated_at: Option<i64>, extra: u8) {
    out.push(
        extra
            | if updated_at.is_some() {
                FLAG_UPDATED_AT
            } else {
                0
            },
    );
    out.extend_from_slice(&hash.0);
    if let Some(t) = updated_at {
        out.extend_from_slice(&t.to_be_bytes());
    }
}

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// A cursor over an encoded value; every read fails cleanly on short input.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.bytes.split_first_chunk::<N>()?;
        self.bytes = rest;
        Some(*head)
    }

    /// Reads a head whose flags may only use the bits in `allowed`; returns the flags too.
    fn head(&mut self, allowed: u8) -> Option<(u8, ContentHash, Option<i64>)> {
        let [flags] = self.take::<1>()?;
        if flags & !allowed != 0 {
            return None;
        }
        let hash = ContentHash(self.take::<16>()?);
        let updated_at = if flags & FLAG_UPDATED_AT != 0 {
            Some(i64::from_be_bytes(self.take::<8>()?))
        } else {
            None
        };
        Some((flags, hash, updated_at))
    }

    fn varint(&mut self) -> Option<u64> {
        let mut value: u64 = 0;
        for shift in (0..64).step_by(7) {
            let [byte] = self.take::<1>()?;
            value |= u64::from(byte & 0x7f).checked_shl(shift)?;
            if byte & 0x80 == 0 {
                return Some(value);
            }
        }
        None
    }

    fn finish<T>(self, value: T) -> Option<T> {
        self.bytes.is_empty().then_some(value)
    }
}

/// The bucket of a record id and the id's slot in it.
pub(crate) fn bucket_of(id: i64) -> (i64, usize) {
    (
        id >> BUCKET_SHIFT,
        (id & (BUCKET_SLOTS as i64 - 1)) as usize,
    )
}

/// The record id in `slot` of `bucket`.
pub(crate) fn id_in_bucket(bucket: i64, slot: usize) -> i64 {
    (bucket << BUCKET_SHIFT) | slot as i64
}

/// The committed records of 32 neighbouring ids.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Bucket {
    /// Slot `id & 31` holds the record with that id, if committed.
    pub(crate) slots: [Option<RecordState>; BUCKET_SLOTS],
}

impl Bucket {
    /// Number of records present.
    pub(crate) fn len(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }
}

fn put_record(out: &mut Vec<u8>, state: &RecordState) {
    let mut extra = if state.seq != 0 { FLAG_SEQ } else { 0 };
    if state.print.is_some() {
        extra |= FLAG_PRINT;
    }
    put_head(out, state.hash, state.updated_at, extra);
    put_varint(out, state.seen_epoch);
    put_varint(out, u64::from(state.generation));
    if state.seq != 0 {
        put_varint(out, state.seq);
    }
    if let Some(print) = state.print {
        out.extend_from_slice(&print.0.to_le_bytes());
    }
}

/// Appends one record state, encoded as a bucket holds it.
pub(crate) fn append_record(out: &mut Vec<u8>, state: &RecordState) {
    put_record(out, state);
}

/// Decodes one record state written by [`append_record`]; None when the
/// bytes are malformed or hold more than it.
pub(crate) fn decode_record(bytes: &[u8]) -> Option<RecordState> {
    let mut r = Reader { bytes };
    let state = read_record(&mut r)?;
    r.finish(state)
}

/// Encodes a bucket.
pub(crate) fn encode_bucket(bucket: &Bucket, out: &mut Vec<u8>) {
    out.clear();
    let presence = bucket
        .slots
        .iter()
        .enumerate()
        .filter(|(_, s)| s.is_some())
        .fold(0u32, |bits, (slot, _)| bits | (1 << slot));
    out.extend_from_slice(&presence.to_be_bytes());
    for state in bucket.slots.iter().flatten() {
        put_record(out, state);
    }
}

/// Number of records in an encoded bucket, without decoding them.
pub(crate) fn bucket_len(bytes: &[u8]) -> Option<u32> {
    let presence: [u8; 4] = bytes.get(..4)?.try_into().ok()?;
    Some(u32::from_be_bytes(presence).count_ones())
}

/// Decodes a bucket; None when the bytes are malformed.
pub(crate) fn decode_bucket(bytes: &[u8]) -> Option<Bucket> {
    let mut r = Reader { bytes };
    let presence = u32::from_be_bytes(r.take::<4>()?);
    let mut bucket = Bucket::default();
    for (slot, cell) in bucket.slots.iter_mut().enumerate() {
        if presence & (1 << slot) != 0 {
            *cell = Some(read_record(&mut r)?);
        }
    }
    r.finish(bucket)
}

/// The record in slot `slot` of an encoded bucket (None inside when the slot
/// is empty), decoding only the records before it; None when those bytes are
/// malformed. Reads of a page's known records take one record from each of
/// up to fifty buckets: decoding whole buckets cost five times as much.
pub(crate) fn bucket_slot(bytes: &[u8], slot: usize) -> Option<Option<RecordState>> {
    let mut r = Reader { bytes };
    let presence = u32::from_be_bytes(r.take::<4>()?);
    let bit = 1u32.checked_shl(u32::try_from(slot).ok()?)?;
    if presence & bit == 0 {
        return Some(None);
    }
    for _ in 0..(presence & (bit - 1)).count_ones() {
        read_record(&mut r)?;
    }
    read_record(&mut r).map(Some)
}

/// The record state at `r`'s position in a bucket.
fn read_record(r: &mut Reader<'_>) -> Option<RecordState> {
    let (flags, hash, updated_at) = r.head(RECORD_FLAGS)?;
    let seen_epoch = r.varint()?;
    let generation = u32::try_from(r.varint()?).ok()?;
    let seq = if flags & FLAG_SEQ != 0 {
        r.varint()?
    } else {
        0
    };
    let print = if flags & FLAG_PRINT != 0 {
        Some(RawPrint(u64::from_le_bytes(r.take::<8>()?)))
    } else {
        None
    };
    Some(RecordState {
        hash,
        updated_at,
        seen_epoch,
        generation,
        seq,
        print,
    })
}

/// The key of a journal entry: like a record key, with the entry's sequence number as id.
pub(crate) fn journal_key(key: StreamKey, seq: u64) -> [u8; RECORD_KEY_LEN] {
    let mut out = [0u8; RECORD_KEY_LEN];
    out[..PREFIX_LEN].copy_from_slice(&prefix(KIND_JOURNAL, key));
    out[PREFIX_LEN..].copy_from_slice(&seq.to_be_bytes());
    out
}

/// The sequence number of a journal entry key; None when the key is malformed.
pub(crate) fn journal_seq(key: &[u8]) -> Option<u64> {
    let tail: [u8; 8] = key.get(PREFIX_LEN..)?.try_into().ok()?;
    Some(u64::from_be_bytes(tail))
}

/// Encodes a journal entry: the intents of one publish batch.
pub(crate) fn encode_journal(intents: &[(i64, Intent)], out: &mut Vec<u8>) {
    out.clear();
    put_varint(out, intents.len() as u64);
    for (id, intent) in intents {
        out.extend_from_slice(&id.to_be_bytes());
        let mut extra = 0;
        if intent.seq != 0 {
            extra |= FLAG_SEQ;
        }
        if intent.op.is_some() {
            extra |= FLAG_OP;
        }
        if intent.previous.is_some() {
            extra |= FLAG_PREVIOUS;
        }
        if intent.replay.is_some() {
            extra |= FLAG_REPLAY;
        }
        put_head(out, intent.hash, intent.updated_at, extra);
        put_varint(out, u64::from(intent.generation));
        if intent.seq != 0 {
            put_varint(out, intent.seq);
        }
        if let Some(op) = intent.op {
            out.push(op_tag(op));
        }
        if let Some(previous) = intent.previous {
            out.extend_from_slice(&previous.0);
        }
        if let Some(replay) = intent.replay {
            out.extend_from_slice(&replay);
        }
    }
}

fn op_tag(op: Op) -> u8 {
    match op {
        Op::Create => b'c',
        Op::Update => b'u',
        Op::Snapshot => b's',
        Op::Delete => b'd',
    }
}

fn op_from_tag(tag: u8) -> Option<Op> {
    Some(match tag {
        b'c' => Op::Create,
        b'u' => Op::Update,
        b's' => Op::Snapshot,
        b'd' => Op::Delete,
        _ => return None,
    })
}

/// Decodes a journal entry; None when the bytes are malformed.
pub(crate) fn decode_journal(bytes: &[u8]) -> Option<Vec<(i64, Intent)>> {
    let mut r = Reader { bytes };
    let count = usize::try_from(r.varint()?).ok()?;
    // Each intent takes at least 26 bytes: never trust a count beyond that.
    let mut intents = Vec::with_capacity(count.min(bytes.len() / 26));
    for _ in 0..count {
        let id = i64::from_be_bytes(r.take::<8>()?);
        let (flags, hash, updated_at) = r.head(INTENT_FLAGS)?;
        let generation = u32::try_from(r.varint()?).ok()?;
        let seq = if flags & FLAG_SEQ != 0 {
            r.varint()?
        } else {
            0
        };
        let op = if flags & FLAG_OP != 0 {
            let [tag] = r.take::<1>()?;
            Some(op_from_tag(tag)?)
        } else {
            None
        };
        let previous = if flags & FLAG_PREVIOUS != 0 {
            Some(ContentHash(r.take::<16>()?))
        } else {
            None
        };
        let replay = if flags & FLAG_REPLAY != 0 {
            Some(r.take::<16>()?)
        } else {
            None
        };
        intents.push((
            id,
            Intent {
                hash,
                updated_at,
                generation,
                seq,
                op,
                previous,
                replay,
            },
        ));
    }
    r.finish(intents)
}

/// Encodes a tombstone.
pub(crate) fn encode_tombstone(tombstone: &Tombstone, out: &mut Vec<u8>) {
    out.clear();
    put_head(out, tombstone.last_hash, tombstone.updated_at, 0);
    put_varint(out, u64::from(tombstone.generation));
}

/// Decodes a tombstone; None when the bytes are malformed.
pub(crate) fn decode_tombstone(bytes: &[u8]) -> Option<Tombstone> {
    let mut r = Reader { bytes };
    let (_, last_hash, updated_at) = r.head(FLAG_UPDATED_AT)?;
    let generation = u32::try_from(r.varint()?).ok()?;
    r.finish(Tombstone {
        generation,
        last_hash,
        updated_at,
    })
}

const VERSION_FIELDS: u8 = 1;
const VERSION_BODY: u8 = 1 << 1;
/// Largest body a stored version decompresses to: a corrupt length can never
/// make a read allocate gigabytes.
const MAX_BODY: usize = 256 << 20;

/// The id and encoding of a shape: the sorted canonical keys field hashes belong to.
pub(crate) fn encode_shape<'k>(keys: impl Iterator<Item = &'k [u8]>) -> (u64, Vec<u8>) {
    let keys: Vec<&[u8]> = keys.collect();
    let mut out = Vec::with_capacity(1 + keys.iter().map(|k| k.len() + 1).sum::<usize>());
    put_varint(&mut out, keys.len() as u64);
    for key in keys {
        put_varint(&mut out, key.len() as u64);
        out.extend_from_slice(key);
    }
    let mut hasher = blake3::Hasher::new();
    hasher.update(b"voucher-cdc/shape/v1");
    hasher.update(&out);
    let mut id = [0u8; 8];
    id.copy_from_slice(&hasher.finalize().as_bytes()[..8]);
    (u64::from_be_bytes(id), out)
}

/// Decodes a shape's keys; None when the bytes are malformed.
pub(crate) fn decode_shape(bytes: &[u8]) -> Option<Vec<Vec<u8>>> {
    let mut r = Reader { bytes };
    let count = usize::try_from(r.varint()?).ok()?;
    let mut keys = Vec::with_capacity(count.min(bytes.len()));
    for _ in 0..count {
        let len = usize::try_from(r.varint()?).ok()?;
        let (key, rest) = r.bytes.split_at_checked(len)?;
        keys.push(key.to_vec());
        r.bytes = rest;
    }
    r.finish(keys)
}

/// A stored version as encoded: field hashes refer to a shape by id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EncodedVersion {
    /// The content hash of the version described.
    pub(crate) hash: ContentHash,
    /// Shape id and the field hashes in the shape's key order.
    pub(crate) fields: Option<(u64, Vec<FieldHash>)>,
    /// The body's JSON text.
    pub(crate) body: Option<String>,
}

/// Encodes a stored version (the body lz4-compressed).
pub(crate) fn encode_version(version: &EncodedVersion, out: &mut Vec<u8>) {
    out.clear();
    let mut flags = 0;
    if version.fields.is_some() {
        flags |= VERSION_FIELDS;
    }
    if version.body.is_some() {
        flags |= VERSION_BODY;
    }
    out.push(flags);
    out.extend_from_slice(&version.hash.0);
    if let Some((shape, hashes)) = &version.fields {
        out.extend_from_slice(&shape.to_be_bytes());
        put_varint(out, hashes.len() as u64);
        for h in hashes {
            out.extend_from_slice(h);
        }
    }
    if let Some(body) = &version.body {
        out.extend_from_slice(&lz4_flex::compress_prepend_size(body.as_bytes()));
    }
}

/// Decodes a stored version; None when the bytes are malformed.
pub(crate) fn decode_version(bytes: &[u8]) -> Option<EncodedVersion> {
    let mut r = Reader { bytes };
    let [flags] = r.take::<1>()?;
    if flags & !(VERSION_FIELDS | VERSION_BODY) != 0 {
        return None;
    }
    let hash = ContentHash(r.take::<16>()?);
    let fields = if flags & VERSION_FIELDS != 0 {
        let shape = u64::from_be_bytes(r.take::<8>()?);
        let count = usize::try_from(r.varint()?).ok()?;
        let mut hashes = Vec::with_capacity(count.min(r.bytes.len() / 8));
        for _ in 0..count {
            hashes.push(r.take::<8>()?);
        }
        Some((shape, hashes))
    } else {
        None
    };
    let body = if flags & VERSION_BODY != 0 {
        let len = u32::from_le_bytes(*r.bytes.first_chunk::<4>()?) as usize;
        if len > MAX_BODY {
            return None;
        }
        let text = lz4_flex::decompress_size_prepended(r.bytes).ok()?;
        r.bytes = &[];
        Some(String::from_utf8(text).ok()?)
    } else {
        None
    };
    r.finish(EncodedVersion { hash, fields, body })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hash(byte: u8) -> ContentHash {
        ContentHash([byte; 16])
    }

    #[test]
    fn record_keys_sort_in_numeric_id_order_including_negative_ids() {
        let stream = StreamKey::new(7, Resource::Vouchers);
        let ids = [i64::MIN, -5, -1, 0, 1, 42, i64::MAX];
        let keys: Vec<_> = ids
            .iter()
            .map(|&id| record_key(KIND_RECORD, stream, id))
            .collect();
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(keys, sorted);
        for (id, key) in ids.iter().zip(&keys) {
            assert_eq!(key_id(key), Some(*id));
            assert!(key.starts_with(&prefix(KIND_RECORD, stream)));
        }
    }

    #[test]
    fn journal_keys_sort_by_sequence_and_round_trip() {
        let stream = StreamKey::new(7, Resource::Categories);
        let keys: Vec<_> = [0u64, 1, 255, 256, u64::MAX]
            .iter()
            .map(|&seq| journal_key(stream, seq))
            .collect();
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(keys, sorted);
        assert_eq!(journal_seq(&keys[3]), Some(256));
        assert!(keys[0].starts_with(&prefix(KIND_JOURNAL, stream)));
        assert_eq!(decode_journal(&[]), None);
        assert_eq!(decode_journal(&[0]), Some(Vec::new()));
    }

    #[test]
    fn stream_keys_round_trip_and_unknown_tags_are_rejected() {
        for resource in Resource::ALL {
            let key = StreamKey::new(u64::MAX - 3, resource);
            assert_eq!(decode_stream_key(&stream_key(key)), Some(key));
        }
        let mut bad = stream_key(StreamKey::new(1, Resource::Vouchers));
        bad[8] = b'x';
        assert_eq!(decode_stream_key(&bad), None);
        assert_eq!(decode_stream_key(&bad[..5]), None);
    }

    fn full_bucket() -> Bucket {
        let mut bucket = Bucket::default();
        for (slot, cell) in bucket.slots.iter_mut().enumerate() {
            *cell = Some(RecordState {
                hash: hash(slot as u8),
                updated_at: Some(1_700_000_000_000_000),
                seen_epoch: 12,
                generation: 0,
                seq: 0,
                print: Some(RawPrint(slot as u64 * 0x9e37_79b9)),
            });
        }
        bucket
    }

    /// Golden bytes: a change here makes existing stores unreadable (or read
    /// wrongly). A deliberate change bumps the layout and is written in the
    /// README's upgrade notes.
    #[test]
    fn the_encodings_of_a_record_an_intent_and_a_tombstone_are_pinned() {
        let mut bucket = Bucket::default();
        bucket.slots[1] = Some(RecordState {
            hash: hash(0xab),
            updated_at: Some(0x0102_0304_0506_0708),
            seen_epoch: 300,
            generation: 2,
            seq: 5,
            print: None,
        });
        bucket.slots[2] = Some(RecordState {
            hash: hash(0xcd),
            updated_at: None,
            seen_epoch: 1,
            generation: 0,
            seq: 0,
            print: None,
        });
        // Layout 4: a raw print behind flag bit 2, after the sequence.
        bucket.slots[4] = Some(RecordState {
            hash: hash(0xef),
            updated_at: None,
            seen_epoch: 1,
            generation: 0,
            seq: 3,
            print: Some(RawPrint(0x0102_0304_0506_0708)),
        });
        let mut out = Vec::new();
        encode_bucket(&bucket, &mut out);
        assert_eq!(
            hex::encode(&out),
            concat!(
                "00000016",
                "03",
                "abababababababababababababababab",
                "0102030405060708",
                "ac02",
                "02",
                "05",
                "00",
                "cdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcd",
                "01",
                "00",
                "06",
                "efefefefefefefefefefefefefefefef",
                "01",
                "00",
                "03",
                "0807060504030201",
            )
        );
        let intent = Intent {
            hash: hash(0x11),
            updated_at: None,
            generation: 1,
            seq: 2,
            op: Some(Op::Update),
            previous: Some(hash(0x22)),
            replay: Some([0x33; 16]),
        };
        encode_journal(&[(-1, intent)], &mut out);
        assert_eq!(
            hex::encode(&out),
            concat!(
                "01",
                "ffffffffffffffff",
                "1e",
                "11111111111111111111111111111111",
                "01",
                "02",
                "75",
                "22222222222222222222222222222222",
                "33333333333333333333333333333333",
            )
        );
        encode_tombstone(
            &Tombstone {
                generation: 3,
                last_hash: hash(0x44),
                updated_at: Some(1),
            },
            &mut out,
        );
        assert_eq!(
            hex::encode(&out),
            "0144444444444444444444444444444444000000000000000103"
        );
    }

    #[test]
    fn a_typical_record_takes_35_bytes_in_its_bucket() {
        let mut out = Vec::new();
        encode_bucket(&full_bucket(), &mut out);
        assert_eq!(out.len(), 4 + 32 * 35);
        assert_eq!(bucket_len(&out), Some(32));
    }

    #[test]
    fn ids_map_to_buckets_and_back_including_negative_ids() {
        for id in [i64::MIN, -33, -32, -1, 0, 1, 31, 32, 12345, i64::MAX] {
            let (bucket, slot) = bucket_of(id);
            assert!(slot < BUCKET_SLOTS);
            assert_eq!(id_in_bucket(bucket, slot), id);
        }
        assert_eq!(bucket_of(-1), (-1, 31));
        assert_eq!(bucket_of(32), (1, 0));
    }

    #[test]
    fn truncated_or_padded_buckets_do_not_decode() {
        let mut bucket = Bucket::default();
        bucket.slots[3] = Some(RecordState {
            hash: hash(9),
            updated_at: None,
            seen_epoch: 300,
            generation: 2,
            seq: 7,
            print: Some(RawPrint(7)),
        });
        let mut out = Vec::new();
        encode_bucket(&bucket, &mut out);
        assert_eq!(decode_bucket(&out), Some(bucket));
        for len in 0..out.len() {
            assert_eq!(decode_bucket(&out[..len]), None, "prefix of {len} bytes");
            assert_eq!(bucket_slot(&out[..len], 3), None, "prefix of {len} bytes");
        }
        let mut padded = out.clone();
        padded.push(0);
        assert_eq!(decode_bucket(&padded), None);
        let mut bad_flags = out.clone();
        bad_flags[4] = 0x80;
        assert_eq!(decode_bucket(&bad_flags), None);
        // Bit 2 belongs to intents only.
        bad_flags[4] = FLAG_OP;
        assert_eq!(decode_bucket(&bad_flags), None);
    }

    /// Golden bytes of layout 3's stored version and shape (see the test above).
    #[test]
    fn the_encodings_of_a_stored_version_and_a_shape_are_pinned() {
        let (id, shape) = encode_shape([b"id".as_slice(), b"title".as_slice()].into_iter());
        assert_eq!(hex::encode(&shape), "02026964057469746c65");
        assert_eq!(
            decode_shape(&shape),
            Some(vec![b"id".to_vec(), b"title".to_vec()])
        );
        assert_eq!(id, 0xba2b_e965_1883_9502, "{id:#x}");
        let fields_only = EncodedVersion {
            hash: hash(0x11),
            fields: Some((0x0102_0304_0506_0708, vec![[0xaa; 8], [0xbb; 8]])),
            body: None,
        };
        let mut out = Vec::new();
        encode_version(&fields_only, &mut out);
        assert_eq!(
            hex::encode(&out),
            concat!(
                "01",
                "11111111111111111111111111111111",
                "0102030405060708",
                "02",
                "aaaaaaaaaaaaaaaa",
                "bbbbbbbbbbbbbbbb",
            )
        );
        assert_eq!(decode_version(&out), Some(fields_only));
        // The body: flags bit 1, then an lz4 block with its length (u32 LE) first.
        let body = r#"{"id":7,"title":"spa day","title2":"spa day"}"#;
        let both = EncodedVersion {
            hash: hash(0x22),
            fields: Some((9, vec![[1; 8]])),
            body: Some(body.to_string()),
        };
        encode_version(&both, &mut out);
        assert_eq!(out[0], 0b11);
        let body_at = 1 + 16 + 8 + 1 + 8;
        assert_eq!(out[body_at..body_at + 4], (body.len() as u32).to_le_bytes());
        assert_eq!(
            lz4_flex::decompress_size_prepended(&out[body_at..]).unwrap(),
            body.as_bytes()
        );
        assert_eq!(decode_version(&out), Some(both));
    }

    #[test]
    fn malformed_stored_versions_and_shapes_do_not_decode() {
        let version = EncodedVersion {
            hash: hash(3),
            fields: Some((1, vec![[5; 8]; 3])),
            body: Some("{\"a\":[1,2,3]}".to_string()),
        };
        let mut out = Vec::new();
        encode_version(&version, &mut out);
        assert_eq!(decode_version(&out), Some(version));
        for len in 0..out.len() {
            assert_eq!(decode_version(&out[..len]), None, "prefix of {len} bytes");
        }
        let mut bad = out.clone();
        bad[0] = 0b100;
        assert_eq!(decode_version(&bad), None);
        // A length beyond any body never allocates it.
        let mut huge = vec![VERSION_BODY];
        huge.extend_from_slice(&[0; 16]);
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        huge.push(0);
        assert_eq!(decode_version(&huge), None);
        let (_, shape) = encode_shape([b"a".as_slice()].into_iter());
        for len in 0..shape.len() {
            assert_eq!(decode_shape(&shape[..len]), None);
        }
        assert_eq!(decode_shape(&[5, 1]), None);
    }

    proptest! {
        #[test]
        fn every_value_round_trips(
            h in any::<[u8; 16]>(),
            updated_at in any::<Option<i64>>(),
            seen_epoch in any::<u64>(),
            generation in any::<u32>(),
            seq in any::<u64>(),
            print in any::<Option<u64>>(),
            op in proptest::option::of(proptest::sample::select(vec![Op::Create, Op::Update, Op::Snapshot, Op::Delete])),
            previous in any::<Option<[u8; 16]>>(),
            replay in any::<Option<[u8; 16]>>(),
        ) {
            let mut out = Vec::new();
            let record = RecordState { hash: ContentHash(h), updated_at, seen_epoch, generation, seq, print: print.map(RawPrint) };
            let mut bucket = full_bucket();
            bucket.slots[(seen_epoch % 32) as usize] = None;
            bucket.slots[(generation % 32) as usize] = Some(record);
            encode_bucket(&bucket, &mut out);
            for slot in 0..BUCKET_SLOTS {
                prop_assert_eq!(bucket_slot(&out, slot), Some(bucket.slots[slot]));
            }
            prop_assert_eq!(bucket_slot(&out, BUCKET_SLOTS), None);
            prop_assert_eq!(decode_bucket(&out), Some(bucket));
            let intent = Intent {
                hash: ContentHash(h), updated_at, generation, seq, op,
                previous: previous.map(ContentHash), replay,
            };
            let entry = vec![(seen_epoch as i64, intent), (-1, intent)];
            encode_journal(&entry, &mut out);
            prop_assert_eq!(decode_journal(&out), Some(entry));
            for len in 0..out.len() {
                prop_assert_eq!(decode_journal(&out[..len]), None);
            }
            let tombstone = Tombstone { generation, last_hash: ContentHash(h), updated_at };
            encode_tombstone(&tombstone, &mut out);
            prop_assert_eq!(decode_tombstone(&out), Some(tombstone));
        }
    }
}
