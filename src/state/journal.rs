//! The intent journal of one stream, as held in memory beside its sled entries.
//!
//! Journalling one sled entry per publish batch (instead of one key per
//! record) turns the per-record cost of an intent from an insert plus a
//! remove into a share of one insert and one remove per page, which is most
//! of the commit path's write volume. The in-memory index tells a commit which
//! entries hold the ids it clears; it only ever holds pending intents, so it
//! is as small as the pages in flight. Every change is planned first, written
//! as part of one sled batch, and applied to memory only after the batch
//! succeeded.

use std::collections::BTreeMap;

use super::{id_map_with_capacity, IdMap, IdSet, Intent};

/// Pending intents of one stream, by journal entry.
#[derive(Debug, Default)]
pub(crate) struct StreamJournal {
    /// Entry sequence number to the intents it still holds.
    entries: BTreeMap<u64, Vec<(i64, Intent)>>,
    /// Record id to the entry holding its (newest) intent.
    by_id: IdMap<u64>,
    /// Lowest sequence number never used: an entry removed by a commit that
    /// is staged, not yet written, must not be written again under its number.
    unused_seq: u64,
}

/// Entries to rewrite (`Some`) or remove (`None`), plus an optional new entry.
#[derive(Debug, Default)]
pub(crate) struct JournalPlan {
    /// Entry sequence number to its new contents; None (or empty) removes it.
    pub(crate) changes: BTreeMap<u64, Option<Vec<(i64, Intent)>>>,
}

impl StreamJournal {
    /// Rebuilds the index from the entries found on disk, in sequence order.
    ///
    /// Batches keep every id in at most one entry; should an id appear in
    /// several anyway, the newest entry wins and the older ones are scheduled
    /// for rewriting (returned as a plan to apply with the next batch).
    pub(crate) fn load(entries: Vec<(u64, Vec<(i64, Intent)>)>) -> (StreamJournal, JournalPlan) {
        let mut journal = StreamJournal::default();
        let mut plan = JournalPlan::default();
        for (seq, intents) in entries {
            let stale: Vec<i64> = intents
                .iter()
                .map(|(id, _)| *id)
                .filter(|id| journal.by_id.contains_key(id))
                .collect();
            if !stale.is_empty() {
                let cleanup = journal.plan_removal(stale.iter().copied());
                journal.apply(&cleanup);
                plan.changes.extend(cleanup.changes);
            }
            for (id, _) in &intents {
                journal.by_id.insert(*id, seq);
            }
            journal.entries.insert(seq, intents);
            journal.unused_seq = journal.unused_seq.max(seq.saturating_add(1));
        }
        (journal, plan)
    }

    /// Sequence number for the next entry.
    pub(crate) fn next_seq(&self) -> u64 {
        self.entries
            .last_key_value()
            .map_or(0, |(seq, _)| seq.saturating_add(1))
            .max(self.unused_seq)
    }

    /// Every pending intent, by id.
    pub(crate) fn pending(&self) -> Vec<(i64, Intent)> {
        let mut out: Vec<(i64, Intent)> = self.entries.values().flatten().copied().collect();
        out.sort_by_key(|(id, _)| *id);
        out
    }

    /// Plans taking `ids` out of the entries that hold them.
    ///
    /// Each entry touched is filtered once against the ids leaving it, so a
    /// commit of a group's records costs its size, not its size squared.
    pub(crate) fn plan_removal(&self, ids: impl Iterator<Item = i64>) -> JournalPlan {
        let mut leaving: BTreeMap<u64, IdSet> = BTreeMap::new();
        for id in ids {
            if let Some(&seq) = self.by_id.get(&id) {
                leaving.entry(seq).or_default().insert(id);
            }
        }
        let changes = leaving
            .into_iter()
            .map(|(seq, gone)| {
                let kept = self.entries.get(&seq).map(|intents| {
                    intents
                        .iter()
                        .filter(|(id, _)| !gone.contains(id))
                        .copied()
                        .collect::<Vec<_>>()
                });
                (seq, kept.filter(|kept| !kept.is_empty()))
            })
            .collect();
        JournalPlan { changes }
    }

    /// Plans a new entry for `intents` (last intent per id wins), taking those
    /// ids out of older entries. Returns the plan and the new entry's sequence.
    pub(crate) fn plan_append(&self, intents: &[(i64, Intent)]) -> (JournalPlan, u64) {
        let mut position: IdMap<usize> = id_map_with_capacity(intents.len());
        let mut entry: Vec<(i64, Intent)> = Vec::with_capacity(intents.len());
        for &(id, intent) in intents {
            match position.get(&id) {
                Some(&i) => entry[i] = (id, intent),
                None => {
                    position.insert(id, entry.len());
                    entry.push((id, intent));
                }
            }
        }
        let seq = self.next_seq();
        let mut plan = self.plan_removal(entry.iter().map(|(id, _)| *id));
        plan.changes.insert(seq, Some(entry));
        (plan, seq)
    }

    /// Applies a plan whose batch was written.
    pub(crate) fn apply(&mut self, plan: &JournalPlan) {
        for (seq, contents) in &plan.changes {
            if let Some(old) = self.entries.remove(seq) {
                for (id, _) in old {
                    if self.by_id.get(&id) == Some(seq) {
                        self.by_id.remove(&id);
                    }
                }
            }
            if let Some(intents) = contents {
                for (id, _) in intents {
                    self.by_id.insert(*id, *seq);
                }
                self.entries.insert(*seq, intents.clone());
            }
            self.unused_seq = self.unused_seq.max(seq.saturating_add(1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::ContentHash;

    fn intent(byte: u8) -> Intent {
        Intent {
            hash: ContentHash([byte; 16]),
            updated_at: None,
            generation: 0,
            seq: u64::from(byte),
            op: Some(crate::event::Op::Update),
            previous: None,
            replay: None,
        }
    }

    #[test]
    fn appending_moves_ids_out_of_older_entries_and_removing_the_last_id_drops_the_entry() {
        let mut journal = StreamJournal::default();
        let (plan, first) = journal.plan_append(&[(1, intent(1)), (2, intent(2)), (1, intent(3))]);
        journal.apply(&plan);
        assert_eq!(first, 0);
        assert_eq!(journal.pending(), vec![(1, intent(3)), (2, intent(2))]);

        let (plan, second) = journal.plan_append(&[(2, intent(4))]);
        assert_eq!(second, 1);
        assert_eq!(plan.changes.get(&0), Some(&Some(vec![(1, intent(3))])));
        journal.apply(&plan);
        assert_eq!(journal.pending(), vec![(1, intent(3)), (2, intent(4))]);

        let plan = journal.plan_removal([1, 99].into_iter());
        assert_eq!(plan.changes.len(), 1);
        assert_eq!(plan.changes.get(&0), Some(&None));
        journal.apply(&plan);
        assert_eq!(journal.pending(), vec![(2, intent(4))]);
        assert_eq!(journal.next_seq(), 2);
    }

    #[test]
    fn a_removed_id_is_forgotten_so_removing_it_again_plans_nothing() {
        let mut journal = StreamJournal::default();
        let (plan, _) = journal.plan_append(&[(1, intent(1)), (2, intent(2))]);
        journal.apply(&plan);
        let plan = journal.plan_removal([1].into_iter());
        assert_eq!(plan.changes.get(&0), Some(&Some(vec![(2, intent(2))])));
        journal.apply(&plan);
        assert!(journal.plan_removal([1].into_iter()).changes.is_empty());
        let plan = journal.plan_removal([2].into_iter());
        assert_eq!(plan.changes.get(&0), Some(&None));
        journal.apply(&plan);
        assert!(journal.plan_removal([1, 2].into_iter()).changes.is_empty());
        assert!(journal.pending().is_empty());
    }

    #[test]
    fn a_sequence_number_is_never_used_twice_even_after_its_entry_is_removed() {
        let mut journal = StreamJournal::default();
        let (plan, first) = journal.plan_append(&[(1, intent(1))]);
        journal.apply(&plan);
        journal.apply(&journal.plan_removal([1].into_iter()));
        assert!(journal.pending().is_empty());
        let (_, second) = journal.plan_append(&[(2, intent(2))]);
        assert_eq!((first, second), (0, 1));
    }

    #[test]
    fn loading_duplicated_ids_keeps_the_newest_and_plans_the_cleanup() {
        let (journal, plan) = StreamJournal::load(vec![
            (3, vec![(1, intent(1)), (2, intent(2))]),
            (5, vec![(1, intent(9))]),
        ]);
        assert_eq!(journal.pending(), vec![(1, intent(9)), (2, intent(2))]);
        assert_eq!(plan.changes.get(&3), Some(&Some(vec![(2, intent(2))])));
        assert_eq!(journal.next_seq(), 6);
    }

    /// One step of the model test: append intents (never none: the store
    /// journals nothing for a page without changes), or remove ids.
    #[derive(Debug, Clone)]
    enum Step {
        Append(Vec<(i64, u8)>),
        Remove(Vec<i64>),
    }

    fn step_strategy() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            proptest::collection::vec((0i64..40, any::<u8>()), 1..30).prop_map(Step::Append),
            proptest::collection::vec(0i64..40, 0..30).prop_map(Step::Remove),
        ]
    }

    proptest::proptest! {
        #[test]
        fn the_journal_holds_the_last_intent_of_every_id_appended_and_not_removed(
            steps in proptest::collection::vec(step_strategy(), 1..40)
        ) {
            let mut journal = StreamJournal::default();
            let mut model: BTreeMap<i64, Intent> = BTreeMap::new();
            for step in steps {
                match step {
                    Step::Append(batch) => {
                        let intents: Vec<(i64, Intent)> =
                            batch.iter().map(|&(id, b)| (id, intent(b))).collect();
                        let (plan, _) = journal.plan_append(&intents);
                        journal.apply(&plan);
                        model.extend(intents);
                    }
                    Step::Remove(ids) => {
                        let plan = journal.plan_removal(ids.iter().copied());
                        journal.apply(&plan);
                        for id in ids {
                            model.remove(&id);
                        }
                    }
                }
                let expected: Vec<(i64, Intent)> = model.iter().map(|(id, i)| (*id, *i)).collect();
                proptest::prop_assert_eq!(journal.pending(), expected);
                // No empty entry is kept, and an id is in one entry only.
                proptest::prop_assert!(journal.entries.values().all(|e| !e.is_empty()));
                let held: usize = journal.entries.values().map(Vec::len).sum();
                proptest::prop_assert_eq!(held, model.len());
            }
        }
    }
}
