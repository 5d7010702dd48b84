//! What a store knows of a stream that was empty when this process first
//! touched it: which ids it may hold since.
//!
//! A first sync lists ids in change order, so each page's ids lie all over
//! the stream's id range, and asking the store about them reads a bucket at
//! random for each: with a million records, most of those reads miss sled's
//! cache and go to the log file. Yet in a first sync nearly every id is new,
//! and only this process wrote the stream. [`FreshStream`] keeps a filter of
//! the ids this process committed to such a stream: an id it says was never
//! committed is absent from the store, and neither its read nor its commit
//! needs the stored bucket (the commit stages the record's slot alone, and
//! the store merges slots into their buckets in key order when it writes the
//! group). The filter may answer "maybe" for an id never committed (a false
//! positive costs the read the store would have made anyway); it never says
//! "absent" for a committed id.
//!
//! The filter is dropped when it stops paying: once most looked-up ids turn
//! out to be known (the stream's first sync is over), or when it would
//! outgrow [`MAX_FILTER_BYTES`]. [`FreshRecords`] holds the records a store
//! stages alone. Pure logic, no I/O.

use super::codec;
use super::RecordState;

/// Ids a filter layer is sized for first; each later layer holds twice as many.
const FIRST_LAYER_IDS: usize = 4096;

/// False-positive rate of the first layer; each later layer's is
/// [`FP_RATE_RATIO`] of the one before, so the rate of the whole filter
/// stays below 2% (0.004 / (1 - 0.8)).
const FIRST_LAYER_FP_RATE: f64 = 0.004;

/// Each layer's false-positive rate against the one before it.
const FP_RATE_RATIO: f64 = 0.8;

/// A filter is dropped rather than grown past this (at about 4.2 million
/// ids: each layer doubles, and a filter takes 2 to 4 bytes an id, under 2
/// when its newest layer is nearly full).
pub(crate) const MAX_FILTER_BYTES: usize = 8 << 20;

/// Looked-up ids per window of [`FreshStream::looked_up`]: when more than
/// half of a window's ids may be known, the filter is no longer worth its
/// memory and lookups.
const WINDOW: u32 = 4096;

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
        Layer::positions(hash, self.bits.len(), self.probes)
            .all(|bit| self.bits[bit / 64] & (1 << (bit % 64)) != 0)
    }

    fn insert(&mut self, hash: u64) {
        for bit in Layer::positions(hash, self.bits.len(), self.probes) {
            self.bits[bit / 64] |= 1 << (bit % 64);
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
        let hash = hash_id(id);
        self.layers.iter().any(|layer| layer.contains(hash))
    }

    /// Adds `id`: true when the filter did not hold it before, false when
    /// it may have (nothing added), None (nothing added) when holding it
    /// would grow the filter past `max_bytes`.
    pub(crate) fn insert(&mut self, id: i64, max_bytes: usize) -> Option<bool> {
        let hash = hash_id(id);
        if self.layers.iter().any(|layer| layer.contains(hash)) {
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
    pub(crate) fn bytes(&self) -> usize {
        self.layers.iter().map(Layer::bytes).sum()
    }
}

/// A stream that was empty when this process first touched it: the ids
/// committed to it since, and how often its lookups found an id it may hold.
#[derive(Debug)]
pub(crate) struct FreshStream {
    committed: IdFilter,
    /// Mean size of the buckets its last group of records staged alone
    /// wrote: what each bucket a group starts to stage records for counts.
    pub(crate) bucket_bytes: usize,
    /// Ids looked up in the current window, and how many the filter may hold.
    window_lookups: u32,
    window_known: u32,
}

impl FreshStream {
    /// A stream with no record.
    pub(crate) fn new() -> FreshStream {
        FreshStream {
            committed: IdFilter::new(),
            bucket_bytes: 0,
            window_lookups: 0,
            window_known: 0,
        }
    }

    /// False when `id` was never committed to the stream (it is absent).
    pub(crate) fn may_hold(&self, id: i64) -> bool {
        self.committed.may_contain(id)
    }

    /// Records that `id` is being committed to the stream: true when it was
    /// never committed before (it is absent), false when it may have been;
    /// None (nothing recorded) when the filter would grow past
    /// [`MAX_FILTER_BYTES`]: it must then be dropped before the commit.
    pub(crate) fn committed(&mut self, id: i64) -> Option<bool> {
        self.committed.insert(id, MAX_FILTER_BYTES)
    }

    /// Counts one lookup of an id the filter `known` may hold; false when the
    /// filter is no longer worth keeping: more than half of a window's ids
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

    /// Ids committed since the stream was empty (as the filter counts them).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.committed.len()
    }
}

/// Records staged alone for one stream, in commit order, compactly: each
/// its id (8 bytes), the length of its state and the state encoded as a
/// bucket holds it (about 38 bytes a record, where an `(i64, RecordState)`
/// takes 64).
#[derive(Debug, Default)]
pub(crate) struct FreshRecords {
    bytes: Vec<u8>,
    len: usize,
}

/// Where a record of a [`FreshRecords`] starts.
pub(crate) type FreshOffset = u32;

impl FreshRecords {
    /// Appends a record.
    pub(crate) fn push(&mut self, id: i64, record: &RecordState) {
        self.bytes.extend_from_slice(&id.to_le_bytes());
        let at = self.bytes.len();
        self.bytes.push(0);
        codec::append_record(&mut self.bytes, record);
        // A record state encodes in at most 1 + 16 + 8 + 3 * 10 bytes.
        self.bytes[at] = u8::try_from(self.bytes.len() - at - 1).unwrap_or(u8::MAX);
        self.len += 1;
    }

    /// The records' offsets and ids, in commit order (nothing decoded).
    pub(crate) fn ids(&self) -> impl Iterator<Item = (FreshOffset, i64)> + '_ {
        let mut at = 0usize;
        std::iter::from_fn(move || {
            let (id, _, next) = self.entry(at)?;
            let offset = FreshOffset::try_from(at).ok()?;
            at = next;
            Some((offset, id))
        })
    }

    /// The record at `offset` (None when it does not decode).
    pub(crate) fn get(&self, offset: FreshOffset) -> Option<(i64, RecordState)> {
        let (id, state, _) = self.entry(usize::try_from(offset).ok()?)?;
        Some((id, codec::decode_record(state)?))
    }

    /// The id, the encoded state and the next entry's offset of the entry at `at`.
    fn entry(&self, at: usize) -> Option<(i64, &[u8], usize)> {
        let id = i64::from_le_bytes(self.bytes.get(at..at + 8)?.try_into().ok()?);
        let len = usize::from(*self.bytes.get(at + 8)?);
        let state = self.bytes.get(at + 9..at + 9 + len)?;
        Some((id, state, at + 9 + len))
    }

    /// The offsets of the records sorted by their ids' buckets, each
    /// bucket's in commit order (16 bytes a record, while a group is written).
    pub(crate) fn by_bucket(&self) -> Vec<(i64, FreshOffset)> {
        let mut order: Vec<(i64, FreshOffset)> = self
            .ids()
            .map(|(offset, id)| (codec::bucket_of(id).0, offset))
            .collect();
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
        self.bytes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
    fn a_fresh_stream_is_dropped_once_most_ids_of_a_window_are_known() {
        let mut stream = FreshStream::new();
        for id in 0..10_000 {
            assert!(stream.committed(id).is_some());
        }
        assert_eq!(
            stream.len(),
            10_000 - count_already_held(&(0..10_000).collect::<Vec<_>>())
        );
        // A first sync: lookups of new ids keep it.
        for id in 10_000..10_000 + 3 * i64::from(WINDOW) {
            let known = stream.may_hold(id);
            assert!(stream.looked_up(known), "dropped at new id {id}");
        }
        // Later sweeps: lookups of known ids end it within one window.
        let dropped_at = (0..i64::from(WINDOW))
            .find(|&id| {
                let known = stream.may_hold(id);
                !stream.looked_up(known)
            })
            .expect("mostly known lookups drop the filter");
        assert!(dropped_at < i64::from(WINDOW));
    }

    #[test]
    fn a_stream_refuses_the_id_that_would_grow_its_filter_past_the_cap() {
        let mut stream = FreshStream::new();
        let refused = (0..5_000_000i64)
            .find(|&id| stream.committed(id).is_none())
            .expect("the cap is reached before 5 million ids");
        assert!(
            (4_000_000..4_300_000).contains(&refused),
            "refused at id {refused}"
        );
        assert!(stream.committed.bytes() <= MAX_FILTER_BYTES);
        assert!(!stream.may_hold(refused));
        // An id it holds is still accepted (nothing to grow).
        assert_eq!(stream.committed(0), Some(false));
    }

    #[test]
    fn a_window_of_half_known_ids_keeps_the_filter() {
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

    proptest! {
        #[test]
        fn every_committed_id_may_be_held(ids in proptest::collection::vec(any::<i64>(), 0..3000)) {
            let mut stream = FreshStream::new();
            let mut seen = std::collections::HashSet::new();
            for &id in &ids {
                let new = stream.committed(id);
                prop_assert!(new.is_some());
                // A repeated id is never called new.
                prop_assert!(seen.insert(id) || new == Some(false));
            }
            for &id in &ids {
                prop_assert!(stream.may_hold(id));
            }
        }
    }
}
