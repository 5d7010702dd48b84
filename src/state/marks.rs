//! The seen marks of a sweep, held in memory until their buckets are written.
//!
//! A full sweep marks every record it lists with its epoch, so that once the
//! listing completed, the records it did not list are the ones whose
//! `seen_epoch` is older. Written as it goes, a mark costs its record's
//! bucket a read, a decode, an encode and a rewrite on every page that lists
//! one of the bucket's ids: a page's 50 ids fall in ~47 buckets, so an
//! unchanged million-record stream's full sweep rewrote each of its buckets
//! about 30 times, and those rewrites were a third of its CPU. [`SeenMarks`]
//! keeps one bit per marked slot instead (a few bytes per bucket), and the
//! store writes them into their buckets once, in key order, before anything
//! reads the stream's records in bulk (the sweep's question "which records
//! were not seen", an export), when the stream's state is saved and at
//! close. A read of single records sees them at once ([`SeenMarks::overlay`]).
//!
//! Losing marks in a crash loses no change: a mark holds no hash and
//! journals no event, and the sweep that made them had not yet asked which
//! records it did not see (after a crash, a new full sweep with a new epoch
//! lists every record again). Pure logic, no I/O.

use super::codec::{self, Bucket, BUCKET_SLOTS};
use super::{IdMap, RecordState, Reprint};

/// Marked buckets of one stream beyond which the store writes the marks (at
/// 32 ids a bucket, about 4 million records; the map takes about 20 bytes a
/// bucket, so under 3 MiB).
pub(crate) const MAX_MARKED_BUCKETS: usize = 1 << 17;

/// Reprints of one stream beyond which the store writes the marks (about
/// 40 bytes each, so under 3 MiB): after an upgrade from a layout without
/// prints, a full sweep reprints every record it lists.
pub(crate) const MAX_REPRINTS: usize = 1 << 16;

/// The ids of one stream seen by sweeps of one epoch, not yet written.
#[derive(Debug)]
pub(crate) struct SeenMarks {
    epoch: u64,
    /// Bucket number to the mask of its marked slots (bit `slot`).
    slots: IdMap<u32>,
    /// Marked ids whose listed bytes print otherwise than their held record.
    reprints: IdMap<Reprint>,
}

impl SeenMarks {
    /// No marks yet, for sweeps of `epoch`.
    pub(crate) fn new(epoch: u64) -> Self {
        Self {
            epoch,
            slots: IdMap::default(),
            reprints: IdMap::default(),
        }
    }

    /// The epoch a marked record's `seen_epoch` becomes.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Marks `id` as seen (it takes effect only where a record with that id is held).
    pub(crate) fn mark(&mut self, id: i64) {
        let (bucket, slot) = codec::bucket_of(id);
        *self.slots.entry(bucket).or_default() |= 1 << slot;
    }

    /// Marks `id` as seen, and to be given `reprint`'s print if its held
    /// record still has `reprint`'s hash when the mark is written.
    pub(crate) fn mark_reprinted(&mut self, id: i64, reprint: Reprint) {
        self.mark(id);
        self.reprints.insert(id, reprint);
    }

    /// Reprints held.
    pub(crate) fn reprint_count(&self) -> usize {
        self.reprints.len()
    }

    /// The reprints held, by id (a copy, for a write that does not hold the marks).
    pub(crate) fn reprints(&self) -> IdMap<Reprint> {
        self.reprints.clone()
    }

    /// Clears the mark of `id`, if any.
    pub(crate) fn unmark(&mut self, id: i64) {
        self.reprints.remove(&id);
        let (bucket, slot) = codec::bucket_of(id);
        if let Some(mask) = self.slots.get_mut(&bucket) {
            *mask &= !(1 << slot);
            if *mask == 0 {
                self.slots.remove(&bucket);
            }
        }
    }

    /// Buckets with a marked slot.
    pub(crate) fn buckets(&self) -> usize {
        self.slots.len()
    }

    /// True when `id` is marked.
    pub(crate) fn is_marked(&self, id: i64) -> bool {
        let (bucket, slot) = codec::bucket_of(id);
        self.slots
            .get(&bucket)
            .is_some_and(|mask| mask & (1 << slot) != 0)
    }

    /// `record`, the held record of `id`, with the epoch it has once the
    /// marks are written (not the print of a reprint: a read without it only
    /// costs the next full sweep a parse of that record).
    pub(crate) fn overlay(&self, id: i64, record: RecordState) -> RecordState {
        if self.is_marked(id) {
            RecordState {
                seen_epoch: self.epoch,
                ..record
            }
        } else {
            record
        }
    }

    /// Marked buckets with their slot masks, in key order (the order a store
    /// writes them in, so that neighbouring buckets share sled's tree nodes).
    pub(crate) fn in_key_order(&self) -> Vec<(i64, u32)> {
        let mut out: Vec<(i64, u32)> = self.slots.iter().map(|(b, m)| (*b, *m)).collect();
        out.sort_unstable_by_key(|(bucket, _)| *bucket);
        out
    }

    /// Sets `epoch` (a [`SeenMarks::epoch`]) on the records of bucket
    /// `number`'s slots in `mask` (one of [`SeenMarks::in_key_order`]), and
    /// the print of each of their `reprints` whose hash the record still has
    /// (a print made from bytes of another hash would be a lie); true when
    /// one of them changed (else the bucket need not be written).
    pub(crate) fn apply(
        epoch: u64,
        number: i64,
        mask: u32,
        reprints: &IdMap<Reprint>,
        bucket: &mut Bucket,
    ) -> bool {
        let mut changed = false;
        for slot in 0..BUCKET_SLOTS {
            if mask & (1 << slot) == 0 {
                continue;
            }
            if let Some(record) = bucket.slots[slot].as_mut() {
                if record.seen_epoch != epoch {
                    record.seen_epoch = epoch;
                    changed = true;
                }
                let reprint = reprints.get(&codec::id_in_bucket(number, slot));
                changed |= reprint.is_some_and(|reprint| reprint.apply(record));
            }
        }
        changed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::{ContentHash, RawPrint};

    fn record(byte: u8, seen_epoch: u64) -> RecordState {
        RecordState {
            hash: ContentHash([byte; 16]),
            updated_at: None,
            seen_epoch,
            generation: 0,
            seq: 1,
            print: None,
        }
    }

    #[test]
    fn a_marked_id_reads_with_the_epoch_and_an_unmarked_one_as_held() {
        let mut marks = SeenMarks::new(7);
        marks.mark(33);
        marks.mark(-1);
        assert_eq!(marks.overlay(33, record(1, 2)), record(1, 7));
        assert_eq!(marks.overlay(-1, record(1, 9)), record(1, 7));
        assert_eq!(marks.overlay(34, record(1, 2)), record(1, 2));
        assert_eq!(marks.overlay(1, record(1, 2)), record(1, 2));
        assert!(marks.is_marked(33) && marks.is_marked(-1) && !marks.is_marked(32));
        marks.unmark(33);
        marks.unmark(32);
        assert_eq!(marks.overlay(33, record(1, 2)), record(1, 2));
        assert_eq!(marks.buckets(), 1, "a bucket without marks is dropped");
    }

    #[test]
    fn a_reprint_sets_its_print_only_on_a_record_that_still_has_its_hash() {
        let mut marks = SeenMarks::new(5);
        let print = |n| Some(RawPrint(n));
        // Bucket 1 holds ids 32..64.
        for (id, byte) in [(33, 1), (34, 9), (36, 4), (37, 5)] {
            marks.mark_reprinted(
                id,
                Reprint {
                    hash: ContentHash([byte; 16]),
                    print: RawPrint(id as u64),
                },
            );
        }
        marks.unmark(37);
        assert_eq!(marks.reprint_count(), 3);
        let mut bucket = Bucket::default();
        bucket.slots[1] = Some(record(1, 5));
        bucket.slots[2] = Some(record(2, 5));
        bucket.slots[4] = Some(record(4, 5));
        bucket.slots[5] = Some(record(5, 5));
        let (number, mask) = marks.in_key_order()[0];
        assert_eq!(number, 1);
        assert!(SeenMarks::apply(
            5,
            number,
            mask,
            &marks.reprints(),
            &mut bucket
        ));
        let prints: Vec<_> = bucket.slots[1..6]
            .iter()
            .map(|r| r.and_then(|r| r.print))
            .collect();
        // 33 has the reprint's hash; 34 another (its content changed since);
        // 36 has it; 37 was unmarked; 35 holds nothing.
        assert_eq!(prints, vec![print(33), None, None, print(36), None]);
        assert!(
            !SeenMarks::apply(5, number, mask, &marks.reprints(), &mut bucket),
            "written twice, nothing changes"
        );
    }

    #[test]
    fn marks_come_out_by_bucket_in_key_order_with_one_bit_per_slot() {
        let mut marks = SeenMarks::new(1);
        for id in [100, -33, 0, 31, 96, -1, 100] {
            marks.mark(id);
        }
        // Buckets of 32 ids: -33 in bucket -2, -1 in -1, 0 and 31 in 0, 96 and 100 in 3.
        assert_eq!(
            marks.in_key_order(),
            vec![
                (-2, 1 << 31),
                (-1, 1 << 31),
                (0, 1 | 1 << 31),
                (3, 1 | 1 << 4)
            ]
        );
        assert_eq!(marks.buckets(), 4);
    }

    #[test]
    fn applying_sets_the_epoch_only_on_held_marked_records_and_says_whether_it_changed() {
        let mut marks = SeenMarks::new(5);
        marks.mark(1);
        marks.mark(2);
        marks.mark(3);
        let mut bucket = Bucket::default();
        bucket.slots[1] = Some(record(1, 4));
        bucket.slots[2] = Some(record(2, 5));
        bucket.slots[4] = Some(record(4, 1));
        let mask = marks.in_key_order()[0].1;
        let none = IdMap::default();
        assert!(SeenMarks::apply(marks.epoch(), 0, mask, &none, &mut bucket));
        assert_eq!(bucket.slots[1], Some(record(1, 5)));
        assert_eq!(bucket.slots[2], Some(record(2, 5)));
        assert_eq!(bucket.slots[3], None, "a mark creates no record");
        assert_eq!(
            bucket.slots[4],
            Some(record(4, 1)),
            "an unmarked record keeps its epoch"
        );
        assert!(
            !SeenMarks::apply(marks.epoch(), 0, mask, &none, &mut bucket),
            "written twice, nothing changes"
        );
    }
}
