//! What a store knows of a stream that was empty when this process first
//! touched it: which ids it holds since.
//!
//! A first sync lists ids in change order, so each page's ids lie all over
//! the stream's id range, and asking the store about them reads a bucket at
//! random for each: with a million records, most of those reads miss sled's
//! cache and go to the log file. Yet in a first sync nearly every id is new,
//! and only this process wrote the stream. [`FreshStream`] keeps the set of
//! the ids this process committed to such a stream: an id it does not hold
//! is absent from the store, and neither its read nor its commit needs the
//! stored bucket (the commit stages the record's slot alone, and the store
//! merges slots into their buckets in key order when it writes the group).
//! The set is exact ([`CommittedIds`]: a bitmap for each run of 65,536 ids
//! it holds many of, a sorted list for one it holds few of), so its memory
//! follows how the ids spread rather than how many there are: the ids of a
//! catalog, handed out in sequence, take about a bit each, ids one in 100
//! about 3 bytes. Ids farther apart take more, up to 72 bytes each, so the
//! exact set turns into a Bloom filter of them ([`IdFilter`], 2 to 4 bytes
//! an id however they spread) once it takes half its cap at more than 5
//! bytes an id, or when it reaches its cap and the filter fits. A filter
//! may also hold a few ids never committed (under 2%): such an id is read
//! from its bucket, as a known one is. The set also holds ids whose commit
//! then failed (they are added before the commit is staged): a held id is
//! read, never assumed.
//!
//! The set is dropped when it stops paying: once most looked-up ids turn
//! out to be known (the stream's first sync is over), or when it would
//! outgrow [`MAX_SET_BYTES`]. [`FreshRecords`] holds the records a store
//! stages alone. Pure logic, no I/O.

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;

use super::codec;
use super::RecordState;

/// A set is dropped rather than grown past this: about 65 million ids of a
/// dense range; about 4.2 million once it is a filter (each of its layers
/// doubles, and it takes 2 to 4 bytes an id, under 2 when its newest layer
/// is nearly full). Ids one in 100 turn into a filter at the exact set's
/// cap, about 2.4 million of them.
pub(crate) const MAX_SET_BYTES: usize = 8 << 20;

/// Looked-up ids per window of [`FreshStream::looked_up`]: when more than
/// half of a window's ids are known, the set is no longer worth its memory
/// and lookups.
const WINDOW: u32 = 4096;

/// Ids of one chunk of a [`CommittedIds`]: 2^16 consecutive ids, the ones
/// sharing `id >> CHUNK_SHIFT`.
const CHUNK_SHIFT: u32 = 16;

/// Bytes of a chunk kept as a bitmap: a bit for each of its ids (8 KiB).
const BITMAP_BYTES: usize = (1 << CHUNK_SHIFT) / 8;

/// Ids a chunk holds as a sorted list at most: 2 bytes each, so past this
/// the bitmap is the smaller.
const LIST_MAX: usize = BITMAP_BYTES / 2;

/// Ids a chunk's list has room for when the chunk is created.
const FIRST_LIST_CAPACITY: usize = 4;

/// What a chunk costs besides its ids: its entry in the map and its list's
/// or bitmap's header (an estimate: about right for a chunk of one id, whose
/// list's allocation is malloc's smallest).
const CHUNK_OVERHEAD: usize = 64;

/// True when bit `bit` of a bitmap (a chunk's, or a filter layer's) is set.
fn bit_is_set(bits: &[u64], bit: usize) -> bool {
    bits[bit / 64] & (1 << (bit % 64)) != 0
}

/// Sets bit `bit` of a bitmap (a chunk's, or a filter layer's).
fn set_bit(bits: &mut [u64], bit: usize) {
    bits[bit / 64] |= 1 << (bit % 64);
}

/// The ids of one chunk, by their low 16 bits.
#[derive(Debug)]
enum Chunk {
    /// Sorted, at most [`LIST_MAX`].
    List(Vec<u16>),
    /// Bit `low` set for each id held.
    Bitmap(Box<[u64]>),
}

impl Chunk {
    fn contains(&self, low: u16) -> bool {
        match self {
            Chunk::List(ids) => ids.binary_search(&low).is_ok(),
            Chunk::Bitmap(bits) => bit_is_set(bits, usize::from(low)),
        }
    }

    /// Bytes the chunk takes besides [`CHUNK_OVERHEAD`].
    fn bytes(&self) -> usize {
        match self {
            Chunk::List(ids) => ids.capacity() * 2,
            Chunk::Bitmap(bits) => bits.len() * 8,
        }
    }

    /// Bytes that adding an id it does not hold adds to [`Self::bytes`].
    fn growth(&self) -> usize {
        match self {
            Chunk::List(ids) if ids.len() >= LIST_MAX => BITMAP_BYTES.saturating_sub(self.bytes()),
            Chunk::List(ids) if ids.len() == ids.capacity() => {
                (list_capacity_after(ids.capacity()) - ids.capacity()) * 2
            }
            Chunk::List(_) | Chunk::Bitmap(_) => 0,
        }
    }

    /// Adds an id it does not hold.
    fn add(&mut self, low: u16) {
        match self {
            Chunk::List(ids) if ids.len() >= LIST_MAX => {
                let mut bits = vec![0u64; BITMAP_BYTES / 8].into_boxed_slice();
                for &held in ids.iter().chain([&low]) {
                    set_bit(&mut bits, usize::from(held));
                }
                *self = Chunk::Bitmap(bits);
            }
            Chunk::List(ids) => {
                let at = ids.binary_search(&low).unwrap_or_else(|at| at);
                if ids.len() == ids.capacity() {
                    ids.reserve_exact(list_capacity_after(ids.capacity()) - ids.len());
                }
                ids.insert(at, low);
            }
            Chunk::Bitmap(bits) => set_bit(bits, usize::from(low)),
        }
    }
}

/// The room a full list of `capacity` ids grows to: twice as much, up to
/// [`LIST_MAX`].
fn list_capacity_after(capacity: usize) -> usize {
    (capacity * 2).clamp(FIRST_LIST_CAPACITY, LIST_MAX)
}

/// An exact set of record ids, compressed as a roaring bitmap is: the ids
/// sharing their high bits (a chunk of 65,536) are a sorted list of their
/// low 16 bits while they are few (2 bytes an id), a bitmap of 8 KiB once
/// they are many.
#[derive(Debug, Default)]
pub(crate) struct CommittedIds {
    chunks: BTreeMap<i64, Chunk>,
    /// Ids held.
    len: usize,
    /// Bytes of the chunks, with their overhead ([`Self::bytes`]).
    bytes: usize,
    /// Set once a filter of its ids was tried and would not fit its cap
    /// ([`Committed`]): not tried again.
    filter_refused: bool,
}

/// The chunk of an id and its low 16 bits within it.
fn split_id(id: i64) -> (i64, u16) {
    (id >> CHUNK_SHIFT, (id & 0xffff) as u16)
}

impl CommittedIds {
    /// True when `id` was inserted.
    pub(crate) fn contains(&self, id: i64) -> bool {
        let (chunk, low) = split_id(id);
        self.chunks.get(&chunk).is_some_and(|c| c.contains(low))
    }

    /// Adds `id`: true when the set did not hold it before, false when it
    /// did, None (nothing added) when holding it would grow the set past
    /// `max_bytes`.
    pub(crate) fn insert(&mut self, id: i64, max_bytes: usize) -> Option<bool> {
        let (key, low) = split_id(id);
        match self.chunks.entry(key) {
            Entry::Occupied(entry) => {
                let chunk = entry.into_mut();
                if chunk.contains(low) {
                    return Some(false);
                }
                if self.bytes + chunk.growth() > max_bytes {
                    return None;
                }
                let before = chunk.bytes();
                chunk.add(low);
                self.bytes = self.bytes - before + chunk.bytes();
            }
            Entry::Vacant(entry) => {
                if self.bytes + CHUNK_OVERHEAD + FIRST_LIST_CAPACITY * 2 > max_bytes {
                    return None;
                }
                let mut list = Vec::with_capacity(FIRST_LIST_CAPACITY);
                list.push(low);
                self.bytes += CHUNK_OVERHEAD + entry.insert(Chunk::List(list)).bytes();
            }
        }
        self.len += 1;
        Some(true)
    }

    /// The ids it holds, in order.
    fn ids(&self) -> impl Iterator<Item = i64> + '_ {
        self.chunks.iter().flat_map(|(&chunk, ids)| {
            let lows: Box<dyn Iterator<Item = u16> + '_> = match ids {
                Chunk::List(lows) => Box::new(lows.iter().copied()),
                Chunk::Bitmap(bits) => {
                    Box::new((0..=u16::MAX).filter(|&low| bit_is_set(bits, usize::from(low))))
                }
            };
            lows.map(move |low| (chunk << CHUNK_SHIFT) | i64::from(low))
        })
    }

    /// Ids held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes it takes: its lists' and bitmaps' room, and an estimate of each
    /// chunk's overhead.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

/// Ids a filter layer is sized for first; each later layer holds twice as many.
const FIRST_LAYER_IDS: usize = 4096;

/// False-positive rate of the first layer; each later layer's is
/// [`FP_RATE_RATIO`] of the one before, so the rate of the whole filter
/// stays below 2% (0.004 / (1 - 0.8)).
const FIRST_LAYER_FP_RATE: f64 = 0.004;

/// Each layer's false-positive rate against the one before it.
const FP_RATE_RATIO: f64 = 0.8;

/// A growing Bloom filter of record ids: layers of doubling capacity and
/// falling false-positive rate, one added when the last is full.
#[derive(Debug)]
pub(crate) struct IdFilter {
    layers: Vec<Layer>,
    /// Ids inserted that no layer held before (the last layer's fill).
    inserted: usize,
}

/// One Bloom filter of a fixed capacity.
#[derive(Debug)]
struct Layer {
    bits: Vec<u64>,
    /// Probes per id.
    probes: u32,
    /// Ids this layer is sized for.
    capacity: usize,
    /// Ids inserted into it.
    len: usize,
}

impl Layer {
    /// A layer for `capacity` ids at false-positive rate `fp_rate`.
    fn new(capacity: usize, fp_rate: f64) -> Layer {
        let (words, probes) = Layer::size(capacity, fp_rate);
        Layer {
            bits: vec![0; words],
            probes,
            capacity,
            len: 0,
        }
    }

    /// The 64-bit words and probes a layer for `capacity` ids at `fp_rate` takes.
    fn size(capacity: usize, fp_rate: f64) -> (usize, u32) {
        let ln2 = std::f64::consts::LN_2;
        let bits_per_id = -fp_rate.ln() / (ln2 * ln2);
        let bits = ((capacity as f64 * bits_per_id).ceil() as usize).max(64);
        let probes = ((bits_per_id * ln2).round() as u32).clamp(1, 32);
        (bits.div_ceil(64), probes)
    }

    /// The bit positions of an id's hash (double hashing) in a layer of
    /// `words` words probed `probes` times.
    fn positions(hash: u64, words: usize, probes: u32) -> impl Iterator<Item = usize> {
        let len = (words * 64) as u64;
        let (h1, h2) = (hash, hash.rotate_left(32) | 1);
        (0..u64::from(probes)).map(move |i| (h1.wrapping_add(i.wrapping_mul(h2)) % len) as usize)
    }

    fn contains(&self, hash: u64) -> bool {
        Layer::positions(hash, self.bits.len(), self.probes).all(|bit| bit_is_set(&self.bits, bit))
    }

    fn insert(&mut self, hash: u64) {
        for bit in Layer::positions(hash, self.bits.len(), self.probes) {
            set_bit(&mut self.bits, bit);
        }
        self.len += 1;
    }

    fn bytes(&self) -> usize {
        self.bits.len() * 8
    }
}

/// An id's 64-bit hash (splitmix64's finaliser: every input bit moves every
/// output bit, so neighbouring ids land far apart).
fn hash_id(id: i64) -> u64 {
    let mut z = (id as u64).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl IdFilter {
    /// An empty filter.
    pub(crate) fn new() -> IdFilter {
        IdFilter {
            layers: vec![Layer::new(FIRST_LAYER_IDS, FIRST_LAYER_FP_RATE)],
            inserted: 0,
        }
    }

    /// False when `id` was never inserted; true when it was, and for a few
    /// ids that were not (under 2%).
    pub(crate) fn may_contain(&self, id: i64) -> bool {
        self.holds_hash(hash_id(id))
    }

    /// True when a layer holds an id of hash `hash`.
    fn holds_hash(&self, hash: u64) -> bool {
        self.layers.iter().any(|layer| layer.contains(hash))
    }

    /// Adds `id`: true when the filter did not hold it before, false when
    /// it may have (nothing added), None (nothing added) when holding it
    /// would grow the filter past `max_bytes`.
    pub(crate) fn insert(&mut self, id: i64, max_bytes: usize) -> Option<bool> {
        let hash = hash_id(id);
        if self.holds_hash(hash) {
            return Some(false);
        }
        if let Some((capacity, fp_rate)) = self.next_layer() {
            if self.bytes() + Layer::size(capacity, fp_rate).0 * 8 > max_bytes {
                return None;
            }
            self.layers.push(Layer::new(capacity, fp_rate));
        }
        if let Some(layer) = self.layers.last_mut() {
            layer.insert(hash);
        }
        self.inserted += 1;
        Some(true)
    }

    /// The capacity and false-positive rate of the layer the next new id
    /// needs, when the last layer is full.
    fn next_layer(&self) -> Option<(usize, f64)> {
        let full = self
            .layers
            .last()
            .is_none_or(|layer| layer.len >= layer.capacity);
        if !full {
            return None;
        }
        let depth = self.layers.len();
        let capacity = FIRST_LAYER_IDS << depth.min(40);
        let depth_exponent = i32::try_from(depth).unwrap_or(i32::MAX);
        Some((
            capacity,
            FIRST_LAYER_FP_RATE * FP_RATE_RATIO.powi(depth_exponent),
        ))
    }

    /// Ids inserted (those the filter already seemed to hold not counted).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.inserted
    }

    /// Bytes of its bit arrays.
    fn bytes(&self) -> usize {
        self.layers.iter().map(Layer::bytes).sum()
    }
}

/// The ids committed to a fresh stream: exact while they lie close enough
/// together for [`CommittedIds`] to be small, a Bloom filter once they do
/// not (which may also hold a few ids never committed, under 2%).
#[derive(Debug)]
enum Committed {
    Exact(CommittedIds),
    Filter(IdFilter),
}

/// An exact set turns into a filter once it takes half its cap (the
/// filter is built beside it) and more than this many bytes an id (ids
/// far apart, or about one in 1,000 or sparser, depending on how full their
/// chunks' lists are), where a filter takes 2 to 4 bytes an id however they
/// spread. Not earlier: a first sync commits ids in change order, scattered
/// over their range, so an exact set of dense ids costs several bytes an
/// id while it is small and about a bit once full.
const FILTER_FROM_BYTES_PER_ID: usize = 5;

impl Committed {
    fn holds(&self, id: i64) -> bool {
        match self {
            Committed::Exact(set) => set.contains(id),
            Committed::Filter(filter) => filter.may_contain(id),
        }
    }

    /// Adds `id` as [`CommittedIds::insert`] does. An exact set that has
    /// grown large for its ids then turns into a filter of them, and one
    /// that reached `max_bytes` turns into a filter of them and `id` when
    /// that fits (else None, as at the cap).
    fn insert(&mut self, id: i64, max_bytes: usize) -> Option<bool> {
        let set = match self {
            Committed::Filter(filter) => return filter.insert(id, max_bytes),
            Committed::Exact(set) => set,
        };
        let Some(added) = set.insert(id, max_bytes) else {
            // Not held (the set answers that before its cap): new if it fits.
            return self.turn_into_filter(Some(id), max_bytes).then_some(true);
        };
        if set.bytes >= max_bytes / 2 && set.bytes > FILTER_FROM_BYTES_PER_ID * set.len {
            self.turn_into_filter(None, max_bytes);
        }
        Some(added)
    }

    /// Turns an exact set into a filter of its ids and `extra`, unless that
    /// was refused before or would not fit `max_bytes` (a filter takes at
    /// least about 2 bytes an id: a set of more ids is not tried); true when
    /// it turned.
    fn turn_into_filter(&mut self, extra: Option<i64>, max_bytes: usize) -> bool {
        let Committed::Exact(set) = self else {
            return false;
        };
        if set.filter_refused || set.len.saturating_mul(2) > max_bytes {
            set.filter_refused = true;
            return false;
        }
        let mut filter = IdFilter::new();
        if set
            .ids()
            .chain(extra)
            .all(|id| filter.insert(id, max_bytes).is_some())
        {
            *self = Committed::Filter(filter);
            return true;
        }
        set.filter_refused = true;
        false
    }

    #[cfg(test)]
    fn is_exact(&self) -> bool {
        matches!(self, Committed::Exact(_))
    }
}

/// A stream that was empty when this process first touched it: the ids
/// committed to it since, and how often its lookups found an id it holds.
#[derive(Debug)]
pub(crate) struct FreshStream {
    committed: Committed,
    /// Mean size of the buckets its last group of records staged alone
    /// wrote: what each bucket a group starts to stage records for counts.
    pub(crate) bucket_bytes: usize,
    /// Ids looked up in the current window, and how many of them it holds.
    window_lookups: u32,
    window_known: u32,
}

impl FreshStream {
    /// A stream with no record.
    pub(crate) fn new() -> FreshStream {
        FreshStream {
            committed: Committed::Exact(CommittedIds::default()),
            bucket_bytes: 0,
            window_lookups: 0,
            window_known: 0,
        }
    }

    /// False when `id` was never committed to the stream (it is absent);
    /// true when it was, and, once the ids turned out too far apart for
    /// the exact set, for a few ids that were not (under 2%).
    pub(crate) fn holds(&self, id: i64) -> bool {
        self.committed.holds(id)
    }

    /// Records that `id` is being committed to the stream: true when it was
    /// never committed before (it is absent), false when it was (or, for a
    /// filter, may have been: nothing is then added); None
    /// (nothing recorded) when the set would grow past [`MAX_SET_BYTES`]:
    /// it must then be dropped before the commit.
    pub(crate) fn committed(&mut self, id: i64) -> Option<bool> {
        self.committed.insert(id, MAX_SET_BYTES)
    }

    /// Counts one lookup of an id, `known` when the set holds it; false when
    /// the set is no longer worth keeping: more than half of a window's ids
    /// were known (the stream's first sync is over).
    pub(crate) fn looked_up(&mut self, known: bool) -> bool {
        self.window_lookups += 1;
        self.window_known += u32::from(known);
        if self.window_lookups >= WINDOW {
            let mostly_known = self.window_known > self.window_lookups / 2;
            self.window_lookups = 0;
            self.window_known = 0;
            if mostly_known {
                return false;
            }
        }
        true
    }

    /// Ids committed since the stream was empty (while the set is exact).
    #[cfg(test)]
    pub(crate) fn len(&self) -> Option<usize> {
        match &self.committed {
            Committed::Exact(set) => Some(set.len()),
            Committed::Filter(_) => None,
        }
    }
}

/// Records staged alone for one stream, in commit order, compactly: each
/// its id (8 bytes), the length of its state and the state encoded as a
/// bucket holds it (about 38 bytes a record, where an `(i64, RecordState)`
/// takes 64).
///
/// The entries sit in chunks of [`FRESH_CHUNK`] bytes, never across two: a
/// first sync's group grows to megabytes a stream, and one vector doubling
/// to hold it held up to twice its bytes and copied them at every doubling,
/// each copy leaving the old block to the allocator in the middle of the heap.
/// The first chunk starts at [`FIRST_CHUNK`] bytes and doubles up to a
/// whole one, so a group of one page costs a few KB, as before.
#[derive(Debug, Default)]
pub(crate) struct FreshRecords {
    chunks: Vec<Vec<u8>>,
    len: usize,
    bytes: usize,
}

/// Bytes of one chunk of a [`FreshRecords`] (below the 128 KiB mmap
/// threshold `main` sets, so a freed chunk goes back to the heap for the
/// next group).
pub(crate) const FRESH_CHUNK: usize = 64 << 10;

/// Bytes the first chunk of a [`FreshRecords`] starts with.
const FIRST_CHUNK: usize = 4 << 10;

/// The longest entry: an id, a length byte and at most 255 bytes of state.
const MAX_ENTRY: usize = 8 + 1 + u8::MAX as usize;

/// Where a record of a [`FreshRecords`] starts: its chunk times
/// [`FRESH_CHUNK`] plus its place in the chunk.
pub(crate) type FreshOffset = u32;

impl FreshRecords {
    /// Appends a record.
    pub(crate) fn push(&mut self, id: i64, record: &RecordState) {
        let room = self
            .chunks
            .last()
            .is_some_and(|chunk| FRESH_CHUNK - chunk.len() >= MAX_ENTRY);
        if !room {
            self.chunks.push(Vec::new());
        }
        let first = self.chunks.len() == 1;
        let Some(chunk) = self.chunks.last_mut() else {
            return;
        };
        if chunk.capacity() - chunk.len() < MAX_ENTRY {
            // The first chunk starts small and doubles (a group of one page
            // holds a few KB, and every stream in a first sync holds a
            // group); later ones are whole from the start.
            let grown = if first {
                (chunk.capacity() * 2).clamp(FIRST_CHUNK, FRESH_CHUNK)
            } else {
                FRESH_CHUNK
            };
            chunk.reserve_exact(grown - chunk.len());
        }
        let start = chunk.len();
        chunk.extend_from_slice(&id.to_le_bytes());
        let at = chunk.len();
        chunk.push(0);
        codec::append_record(chunk, record);
        // A record state encodes in at most 1 + 16 + 8 + 3 * 10 + 8 bytes.
        chunk[at] = u8::try_from(chunk.len() - at - 1).unwrap_or(u8::MAX);
        self.bytes += chunk.len() - start;
        self.len += 1;
    }

    /// The records' offsets and ids, in commit order (nothing decoded).
    pub(crate) fn ids(&self) -> impl Iterator<Item = (FreshOffset, i64)> + '_ {
        self.chunks.iter().enumerate().flat_map(|(number, chunk)| {
            let mut at = 0usize;
            std::iter::from_fn(move || {
                let (id, _, next) = entry(chunk, at)?;
                let offset = FreshOffset::try_from(number * FRESH_CHUNK + at).ok()?;
                at = next;
                Some((offset, id))
            })
        })
    }

    /// The record at `offset` (None when it does not decode).
    pub(crate) fn get(&self, offset: FreshOffset) -> Option<(i64, RecordState)> {
        let offset = usize::try_from(offset).ok()?;
        let chunk = self.chunks.get(offset / FRESH_CHUNK)?;
        let (id, state, _) = entry(chunk, offset % FRESH_CHUNK)?;
        Some((id, codec::decode_record(state)?))
    }

    /// The offsets of the records sorted by their ids' buckets, each
    /// bucket's in commit order (16 bytes a record, while a group is written).
    pub(crate) fn by_bucket(&self) -> Vec<(i64, FreshOffset)> {
        let mut order: Vec<(i64, FreshOffset)> = Vec::with_capacity(self.len);
        order.extend(
            self.ids()
                .map(|(offset, id)| (codec::bucket_of(id).0, offset)),
        );
        order.sort_unstable();
        order
    }

    /// Records held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes of the records.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

/// The id, the encoded state and the next entry's place of the entry at
/// `at` of one chunk.
fn entry(chunk: &[u8], at: usize) -> Option<(i64, &[u8], usize)> {
    let id = i64::from_le_bytes(chunk.get(at..at + 8)?.try_into().ok()?);
    let len = usize::from(*chunk.get(at + 8)?);
    let state = chunk.get(at + 9..at + 9 + len)?;
    Some((id, state, at + 9 + len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Inserts `ids` into a set without a cap, checking each answer
    /// against a `HashSet`, then every membership.
    fn check_against_a_hash_set(ids: impl IntoIterator<Item = i64>) -> CommittedIds {
        let mut set = CommittedIds::default();
        let mut model = std::collections::HashSet::new();
        for id in ids {
            assert_eq!(
                set.insert(id, usize::MAX),
                Some(model.insert(id)),
                "id {id}"
            );
        }
        assert_eq!(set.len(), model.len());
        for &id in &model {
            assert!(set.contains(id), "id {id} inserted, not held");
            for other in [id.wrapping_sub(1), id.wrapping_add(1), id ^ 0x1_0000] {
                assert_eq!(set.contains(other), model.contains(&other), "id {other}");
            }
        }
        set
    }

    #[test]
    fn a_set_holds_exactly_the_ids_inserted_across_lists_turned_into_bitmaps() {
        // Dense runs (lists that become bitmaps), sparse ids, negatives and
        // both ends of the range, in a scattered order.
        let dense = (0..20_000i64).map(|i| (i * 7_919) % 20_000);
        let sparse = (0..3_000i64).map(|i| i * 104_729 - 150_000_000);
        let ends = [i64::MIN, i64::MIN + 1, -1, 0, i64::MAX - 1, i64::MAX];
        let set = check_against_a_hash_set(dense.chain(sparse).chain(ends).chain(0..10));
        let bitmaps = set
            .chunks
            .values()
            .filter(|c| matches!(c, Chunk::Bitmap(_)))
            .count();
        assert_eq!(bitmaps, 1, "20,000 ids of one chunk are a bitmap");
        assert!(!set.contains(20_000) && !set.contains(-20_001));
    }

    #[test]
    fn a_chunk_becomes_a_bitmap_at_the_id_after_its_list_is_full() {
        let mut set = CommittedIds::default();
        for id in 0..LIST_MAX as i64 {
            assert_eq!(set.insert(id * 3, usize::MAX), Some(true));
        }
        assert!(matches!(set.chunks.get(&0), Some(Chunk::List(_))));
        assert_eq!(set.bytes(), LIST_MAX * 2 + CHUNK_OVERHEAD);
        assert_eq!(set.insert(1, usize::MAX), Some(true));
        assert!(matches!(set.chunks.get(&0), Some(Chunk::Bitmap(_))));
        assert_eq!(set.bytes(), BITMAP_BYTES + CHUNK_OVERHEAD);
        assert!((0..LIST_MAX as i64).all(|id| set.contains(id * 3)) && set.contains(1));
        assert!(!set.contains(2) && !set.contains(4));
    }

    #[test]
    fn half_a_million_ids_handed_out_in_sequence_take_about_a_bit_each() {
        let mut set = CommittedIds::default();
        // In change order: scattered over the range, as a first sync lists them.
        for i in 0..500_000i64 {
            set.insert((i * 7_919) % 500_000 + 1, usize::MAX);
        }
        assert_eq!(set.len(), 500_000);
        let per_id = set.bytes() as f64 / 500_000.0;
        assert!(per_id < 0.15, "{per_id} bytes an id");
        // Ids one in 20: lists of 3,277 ids a chunk, 2 bytes each and room to grow.
        let mut sparse = CommittedIds::default();
        for i in 0..200_000i64 {
            sparse.insert(i * 20, usize::MAX);
        }
        let per_id = sparse.bytes() as f64 / 200_000.0;
        assert!((2.0..2.6).contains(&per_id), "{per_id} bytes an id");
    }

    #[test]
    fn an_empty_set_holds_nothing() {
        let set = CommittedIds::default();
        assert!((-1000..1000).all(|id| !set.contains(id)));
        assert!(!set.contains(i64::MIN) && !set.contains(i64::MAX));
        assert_eq!(set.bytes(), 0);
    }

    #[test]
    fn a_fresh_stream_is_dropped_once_most_ids_of_a_window_are_known() {
        let mut stream = FreshStream::new();
        for id in 0..10_000 {
            assert_eq!(stream.committed(id), Some(true));
        }
        assert_eq!(stream.len(), Some(10_000));
        assert!(stream.committed.is_exact());
        // A first sync: lookups of new ids keep it.
        for id in 10_000..10_000 + 3 * i64::from(WINDOW) {
            let known = stream.holds(id);
            assert!(!known, "id {id} was never committed");
            assert!(stream.looked_up(known), "dropped at new id {id}");
        }
        // Later sweeps: lookups of known ids end it within one window.
        let dropped_at = (0..i64::from(WINDOW))
            .find(|&id| {
                let known = stream.holds(id);
                !stream.looked_up(known)
            })
            .expect("mostly known lookups drop the set");
        assert!(dropped_at < i64::from(WINDOW));
    }

    #[test]
    fn a_filter_never_calls_an_inserted_id_absent_across_every_layer_it_grows() {
        let mut filter = IdFilter::new();
        let ids: Vec<i64> = (0..200_000i64).map(|i| i * 7919 - 1_000_000).collect();
        for &id in &ids {
            filter.insert(id, usize::MAX);
        }
        assert!(filter.layers.len() >= 5, "{} layers", filter.layers.len());
        let missed = ids.iter().filter(|&&id| !filter.may_contain(id)).count();
        assert_eq!(missed, 0);
        assert_eq!(filter.len(), ids.len() - count_already_held(&ids));
    }

    /// Ids the filter took for already inserted when they came (its own false positives).
    fn count_already_held(ids: &[i64]) -> usize {
        let mut filter = IdFilter::new();
        let mut held = 0;
        for &id in ids {
            if filter.insert(id, usize::MAX) == Some(false) {
                held += 1;
            }
        }
        held
    }

    #[test]
    fn a_filter_of_half_a_million_ids_calls_under_two_percent_of_other_ids_present_in_under_two_bytes_an_id(
    ) {
        let mut filter = IdFilter::new();
        for id in 0..500_000i64 {
            filter.insert(id, usize::MAX);
        }
        let others = 200_000;
        let false_positives = (1_000_000..1_000_000 + others)
            .filter(|&id| filter.may_contain(id))
            .count();
        let rate = false_positives as f64 / others as f64;
        assert!(rate < 0.02, "false-positive rate {rate}");
        assert!(rate > 0.0, "a Bloom filter that never errs is too large");
        let per_id = filter.bytes() as f64 / 500_000.0;
        assert!(per_id < 2.0, "{per_id} bytes an id");
    }

    #[test]
    fn an_empty_filter_holds_nothing() {
        let filter = IdFilter::new();
        assert!((-1000..1000).all(|id| !filter.may_contain(id)));
        assert!(!filter.may_contain(i64::MIN) && !filter.may_contain(i64::MAX));
    }

    #[test]
    fn exact_ids_refuse_the_id_that_would_grow_them_past_the_cap() {
        let mut set = CommittedIds::default();
        // One id a chunk: each takes a chunk of its own.
        let per_id = CHUNK_OVERHEAD + FIRST_LIST_CAPACITY * 2;
        let refused = (0..1_000_000i64)
            .map(|i| i << CHUNK_SHIFT)
            .find(|&id| set.insert(id, MAX_SET_BYTES).is_none())
            .expect("the cap is reached before a million chunks");
        assert_eq!(refused >> CHUNK_SHIFT, (MAX_SET_BYTES / per_id) as i64);
        assert!(set.bytes() <= MAX_SET_BYTES);
        assert!(!set.contains(refused));
        // An id it holds is still accepted (nothing to grow), and so is a new
        // id in a chunk with room.
        assert_eq!(set.insert(0, MAX_SET_BYTES), Some(false));
        assert_eq!(set.insert(1, MAX_SET_BYTES), Some(true));
    }

    /// Inserts `ids` into an exact set that turns into a filter under
    /// `cap`, checking the answers; returns it and after how many ids it
    /// turned (None when it stayed exact).
    fn insert_all(ids: &[i64], cap: usize) -> (Committed, Option<usize>) {
        let mut committed = Committed::Exact(CommittedIds::default());
        let mut turned = None;
        for (n, &id) in ids.iter().enumerate() {
            let exact = committed.is_exact();
            let new = committed.insert(id, cap);
            // A filter may take a new id for one it holds (nothing added).
            assert!(
                new == Some(true) || (!exact && new == Some(false)),
                "id {id}"
            );
            if exact && !committed.is_exact() {
                turned = Some(n + 1);
            }
        }
        assert!(
            ids.iter().all(|&id| committed.holds(id)),
            "an id inserted is not held"
        );
        (committed, turned)
    }

    /// `n` ids `stride` apart, in the scattered order of a first sync.
    fn scattered(n: i64, stride: i64) -> Vec<i64> {
        (0..n)
            .map(|i| (i * 7_919) % n * stride - 1_000_000)
            .collect()
    }

    #[test]
    fn ids_far_apart_turn_the_set_into_a_filter_at_half_its_cap_holding_every_one() {
        let cap = 256 << 10;
        // 72 bytes an id: half the cap at 1,821 ids.
        let far: Vec<i64> = (0..5_000i64).map(|i| i * 70_001 - 700_000_000).collect();
        let (committed, turned) = insert_all(&far, cap);
        assert_eq!(turned, Some((cap / 2).div_ceil(72)));
        let Committed::Filter(filter) = &committed else {
            unreachable!("it turned")
        };
        assert!(filter.bytes() < 4 * far.len(), "{} bytes", filter.bytes());
        let false_positives = (0..20_000i64)
            .filter(|i| committed.holds(i * 70_001 + 1))
            .count();
        assert!(false_positives < 400, "{false_positives} false positives");
        // Ids one in 5,000, scattered: about 7 bytes each, a filter too.
        let (_, turned) = insert_all(&scattered(100_000, 5_000), cap);
        assert!(turned.is_some());
    }

    #[test]
    fn a_set_turning_into_a_filter_keeps_the_ids_of_its_bitmaps_and_lists() {
        // Chunk 0 a bitmap, chunk -1 a list, then ids far apart until it turns.
        let mut ids: Vec<i64> = (0..10_000).collect();
        ids.extend((1..500).map(|i| -3 * i));
        ids.extend((1..3_000i64).map(|i| i << CHUNK_SHIFT));
        let (committed, turned) = insert_all(&ids, 256 << 10);
        assert!(turned.is_some_and(|n| n > 10_499));
        assert!(!committed.is_exact());
    }

    #[test]
    fn dense_or_one_in_a_hundred_ids_in_change_order_keep_the_set_exact() {
        // A range of 32 chunks in change order: several bytes an id while
        // few are in, a bit each once all are (32 bitmaps: 264,192 bytes).
        let (committed, turned) = insert_all(&scattered(2_000_000, 1), 512 << 10);
        assert_eq!(turned, None);
        let Committed::Exact(set) = &committed else {
            unreachable!("checked above")
        };
        assert!(set.bytes() < 2_000_000 / 7, "{} bytes", set.bytes());
        assert!(!committed.holds(-1_000_001) && !committed.holds(1_000_000));
        // The start of a first sync of 30 million ids: about 11 bytes an id
        // at the 4,096th, far from half the cap.
        let start: Vec<i64> = scattered(30_000_000, 1).into_iter().take(20_000).collect();
        assert_eq!(insert_all(&start, MAX_SET_BYTES).1, None);
        // About 3.2 bytes an id, past half the cap.
        let (committed, turned) = insert_all(&scattered(60_000, 100), 256 << 10);
        assert_eq!(turned, None);
        let Committed::Exact(set) = &committed else {
            unreachable!("checked above")
        };
        assert!(set.bytes() > 128 << 10, "{} bytes", set.bytes());
    }

    #[test]
    fn a_set_at_its_cap_turns_into_a_filter_when_one_of_its_ids_fits() {
        // One in 100: about 3.2 bytes an id, under the switch at half the
        // cap, so the exact set reaches its cap (about 20,000 ids at 64 KiB).
        let cap = 64 << 10;
        let ids = scattered(40_000, 100);
        let mut committed = Committed::Exact(CommittedIds::default());
        let mut held = 0;
        while held < ids.len() && committed.insert(ids[held], cap).is_some() {
            held += 1;
        }
        assert!(!committed.is_exact(), "exact at {held} ids");
        assert!(held > 25_000, "refused at {held} ids, the exact cap");
        assert!(ids[..held].iter().all(|&id| committed.holds(id)));
    }

    #[test]
    fn a_dense_set_at_its_cap_stays_exact_and_refuses_without_building_a_filter() {
        // One bitmap fits, a second chunk does not, and 65,536 ids would
        // not fit a filter.
        let cap = BITMAP_BYTES + CHUNK_OVERHEAD + 50;
        let mut committed = Committed::Exact(CommittedIds::default());
        assert!((0..65_536i64).all(|id| committed.insert(id, cap) == Some(true)));
        assert_eq!(committed.insert(65_536, cap), None);
        assert_eq!(committed.insert(65_537, cap), None);
        let Committed::Exact(set) = &committed else {
            panic!("a dense set turned into a filter")
        };
        assert!(set.filter_refused);
        assert!(!committed.holds(65_536) && committed.holds(65_535));
    }

    #[test]
    fn a_stream_refuses_the_id_that_would_grow_its_filter_past_the_cap() {
        let mut stream = FreshStream::new();
        // Ids far apart: a filter, which reaches the cap at about 4.2 million.
        let refused = (0..5_000_000i64)
            .map(|i| i << CHUNK_SHIFT)
            .find(|&id| stream.committed(id).is_none())
            .expect("the cap is reached before 5 million ids");
        assert!(
            (4_000_000..4_300_000).contains(&(refused >> CHUNK_SHIFT)),
            "refused at id {refused}"
        );
        let Committed::Filter(filter) = &stream.committed else {
            panic!("ids far apart keep an exact set")
        };
        assert!(filter.bytes() <= MAX_SET_BYTES);
        // An id it holds is still accepted (nothing to grow).
        assert_eq!(stream.committed(0), Some(false));
    }

    #[test]
    fn a_window_of_half_known_ids_keeps_the_set() {
        let mut stream = FreshStream::new();
        for i in 0..3 * WINDOW {
            assert!(stream.looked_up(i % 2 == 0));
        }
    }

    fn state(n: u64) -> RecordState {
        RecordState {
            hash: crate::hash::ContentHash([n as u8; 16]),
            updated_at: (n % 3 != 0).then_some(1_700_000_000_000_000 + n as i64),
            seen_epoch: n % 5,
            generation: (n % 4) as u32,
            seq: n * 1_000_003,
            print: None,
        }
    }

    #[test]
    fn staged_records_read_back_in_commit_order_by_offset_and_sorted_by_bucket() {
        let mut records = FreshRecords::default();
        let ids = [70i64, 3, -5, 64, 1, i64::MIN, i64::MAX, 65];
        for (n, id) in ids.iter().enumerate() {
            records.push(*id, &state(n as u64));
        }
        assert_eq!(records.len(), ids.len());
        let read: Vec<(i64, RecordState)> = records
            .ids()
            .map(|(offset, _)| records.get(offset).unwrap())
            .collect();
        let pushed: Vec<(i64, RecordState)> = ids
            .iter()
            .enumerate()
            .map(|(n, id)| (*id, state(n as u64)))
            .collect();
        assert_eq!(read, pushed);
        assert!(
            records.bytes() < ids.len() * 45,
            "{} bytes",
            records.bytes()
        );
        let sorted: Vec<i64> = records
            .by_bucket()
            .iter()
            .map(|(_, offset)| records.get(*offset).unwrap().0)
            .collect();
        // Buckets of 32 ids: MIN, -5, (3, 1), (70, 64, 65), MAX; commit order within one.
        assert_eq!(sorted, vec![i64::MIN, -5, 3, 1, 70, 64, 65, i64::MAX]);
        assert!(records
            .ids()
            .all(|(offset, id)| records.get(offset).map(|(got, _)| got) == Some(id)));
        assert_eq!(records.get(u32::MAX), None);
    }

    #[test]
    fn staged_records_of_many_chunks_read_back_whole_and_no_chunk_outgrows_its_size() {
        let mut records = FreshRecords::default();
        let count = 3 * FRESH_CHUNK / 40 + 17;
        let id_of = |n: usize| (n as i64 * 7_919) % 1_000_003 - 400_000;
        for n in 0..count {
            records.push(id_of(n), &state(n as u64));
        }
        assert!(records.chunks.len() >= 3, "{} chunks", records.chunks.len());
        assert!(records
            .chunks
            .iter()
            .all(|chunk| chunk.len() <= FRESH_CHUNK && chunk.capacity() == FRESH_CHUNK));
        // A group of one page holds a small first chunk.
        let mut page = FreshRecords::default();
        for n in 0..50 {
            page.push(id_of(n), &state(n as u64));
        }
        assert_eq!(page.chunks.len(), 1);
        assert!(
            page.chunks[0].capacity() <= FIRST_CHUNK,
            "{}",
            page.chunks[0].capacity()
        );
        let used: usize = records.chunks.iter().map(Vec::len).sum();
        assert_eq!(records.bytes(), used);
        let read: Vec<(i64, RecordState)> = records
            .ids()
            .map(|(offset, _)| records.get(offset).unwrap())
            .collect();
        assert_eq!(read.len(), count);
        assert!(read
            .iter()
            .enumerate()
            .all(|(n, got)| *got == (id_of(n), state(n as u64))));
        let buckets: Vec<i64> = records.by_bucket().iter().map(|(b, _)| *b).collect();
        assert_eq!(buckets.len(), count);
        assert!(buckets.windows(2).all(|w| w[0] <= w[1]));
        // An offset past a chunk's last entry, or in a chunk not held, is none.
        let last = records.chunks[0].len();
        assert_eq!(records.get(last as u32), None);
        assert_eq!(
            records.get((records.chunks.len() * FRESH_CHUNK) as u32),
            None
        );
    }

    proptest! {
        #[test]
        fn a_set_answers_as_a_hash_set_does(
            // Some ids anywhere, some in a few chunks, most in one (whose
            // list then turns into a bitmap).
            ids in proptest::collection::vec(
                prop_oneof![1 => any::<i64>(), 1 => -70_000..70_000i64, 3 => 0..9_000i64],
                0..12_000,
            ),
            probes in proptest::collection::vec(any::<i64>(), 0..200),
        ) {
            let mut set = CommittedIds::default();
            let mut model = std::collections::HashSet::new();
            for &id in &ids {
                prop_assert_eq!(set.insert(id, usize::MAX), Some(model.insert(id)));
            }
            for &id in ids.iter().chain(&probes) {
                prop_assert_eq!(set.contains(id), model.contains(&id));
            }
            prop_assert_eq!(set.len(), model.len());
        }

        #[test]
        fn a_capped_set_never_grows_past_its_cap_and_holds_what_it_accepted(
            // Most ids in one chunk, so that its list turns into a bitmap
            // under the cap, the rest over a few.
            ids in proptest::collection::vec(
                prop_oneof![1 => -300_000..300_000i64, 3 => 0..9_000i64],
                0..8000,
            ),
            cap in 0usize..24_000,
        ) {
            let mut set = CommittedIds::default();
            let mut accepted = std::collections::HashSet::new();
            for &id in &ids {
                match set.insert(id, cap) {
                    Some(new) => prop_assert_eq!(new, accepted.insert(id)),
                    None => prop_assert!(!accepted.contains(&id)),
                }
                prop_assert!(set.bytes() <= cap, "{} bytes, cap {}", set.bytes(), cap);
            }
            for &id in &ids {
                prop_assert_eq!(set.contains(id), accepted.contains(&id));
            }
        }
    }
}
