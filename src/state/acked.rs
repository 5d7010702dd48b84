//! The acknowledgement as a value: the store commits only what the sink acknowledged.
//!
//! The core invariant ("a content hash is never committed before the sink
//! acknowledged its event") is held by the types, not by the order of
//! statements: [`StateStore::commit_page`](super::StateStore::commit_page) and
//! [`StateStore::commit_deletes`](super::StateStore::commit_deletes) take an
//! [`Acked`] batch, and an [`Acked`] batch can only be built from one
//! [`Delivery`] per change, the count checked. The checkpoint travels with
//! the batch it covers, as in quickwit's sources and vector's finalizers.

use super::{DeadLetter, RecordState, StoredVersion, Tombstone};
use crate::hash::{ContentHash, RawPrint};

/// The sink's final answer for one published event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivery {
    /// The sink acknowledged the event.
    Acknowledged,
    /// The sink refused the event for good and acknowledged its dead letter
    /// instead; the record commits marked as dead-lettered.
    DeadLettered(DeadLetter),
}

/// Why a batch cannot be committed: not every change has its acknowledgement.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{deliveries} acknowledgement(s) for {changes} change(s); a batch commits only when every event is acknowledged")]
pub struct NotAcknowledged {
    /// Changes in the batch.
    pub changes: usize,
    /// Acknowledgements given.
    pub deliveries: usize,
}

/// A batch whose every event the sink acknowledged; the only thing the store commits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acked<T> {
    batch: T,
}

impl<T> Acked<T> {
    /// What the batch commits.
    pub fn batch(&self) -> &T {
        &self.batch
    }
}

/// One page's commit: the changed records, their dead-letter marks, and the
/// unchanged records a full sweep saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PageCommit {
    /// The acknowledged versions, upserted (their intents and tombstones cleared).
    pub records: Vec<(i64, RecordState)>,
    /// The subset of `records` committed as dead-lettered; every other
    /// committed id loses a mark it had.
    pub dead_letters: Vec<(i64, DeadLetter)>,
    /// Unchanged records a full sweep listed: their `seen_epoch` becomes `epoch`.
    pub seen: Vec<i64>,
    /// The epoch `seen` records are marked with.
    pub epoch: u64,
    /// The stored versions of committed records (`events.changed_fields`,
    /// `events.before`), each describing the version its record commits.
    pub versions: Vec<(i64, StoredVersion)>,
    /// Unchanged records `seen` whose listed bytes print otherwise than their
    /// committed state (it has no print, or one of older bytes, such as
    /// before a touch that only moved `updated_at`): the print to keep.
    pub reprints: Vec<(i64, Reprint)>,
}

/// A print to keep for a record, made from listed bytes whose content hash
/// is `hash`: kept only if the record's committed hash is still `hash`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reprint {
    /// The content hash of the bytes printed.
    pub hash: ContentHash,
    /// Their raw print.
    pub print: RawPrint,
}

impl Reprint {
    /// Gives `record` the print if it has the hash; true when that changed it.
    pub fn apply(&self, record: &mut RecordState) -> bool {
        if record.hash != self.hash || record.print == Some(self.print) {
            return false;
        }
        record.print = Some(self.print);
        true
    }
}

/// One chunk of deletes: the tombstones of the records removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeleteCommit {
    /// Removed records, with what the next incarnation of each id needs.
    pub tombstones: Vec<(i64, Tombstone)>,
}

/// Checks that there is exactly one delivery per change.
fn check(changes: usize, deliveries: usize) -> Result<(), NotAcknowledged> {
    if changes == deliveries {
        Ok(())
    } else {
        Err(NotAcknowledged {
            changes,
            deliveries,
        })
    }
}

impl Acked<PageCommit> {
    /// A page whose `changes` were each delivered as `deliveries` says (same
    /// order, one each), plus the unchanged records `seen` by a full sweep.
    pub fn page(
        changes: Vec<(i64, RecordState)>,
        deliveries: Vec<Delivery>,
        seen: Vec<i64>,
        epoch: u64,
    ) -> Result<Self, NotAcknowledged> {
        check(changes.len(), deliveries.len())?;
        let dead_letters = changes
            .iter()
            .zip(deliveries)
            .filter_map(|((id, _), delivery)| match delivery {
                Delivery::Acknowledged => None,
                Delivery::DeadLettered(letter) => Some((*id, letter)),
            })
            .collect();
        Ok(Self {
            batch: PageCommit {
                records: changes,
                dead_letters,
                seen,
                epoch,
                versions: Vec::new(),
                reprints: Vec::new(),
            },
        })
    }

    /// Adds the reprints of the page's unchanged records (see [`PageCommit::reprints`]).
    pub fn with_reprints(mut self, reprints: Vec<(i64, Reprint)>) -> Self {
        self.batch.reprints = reprints;
        self
    }

    /// Adds the stored versions of the page's records; a version that does
    /// not describe the version its record commits (another id or hash) is
    /// left out, so a stored version is always one the sink acknowledged.
    pub fn with_versions(mut self, versions: Vec<(i64, StoredVersion)>) -> Self {
        let committed: super::IdMap<ContentHash> = self
            .batch
            .records
            .iter()
            .map(|(id, r)| (*id, r.hash))
            .collect();
        self.batch.versions = versions
            .into_iter()
            .filter(|(id, v)| committed.get(id) == Some(&v.hash))
            .collect();
        self
    }

    /// A page with no change: only the `seen` marks of a full sweep.
    pub fn seen_only(seen: Vec<i64>, epoch: u64) -> Self {
        Self {
            batch: PageCommit {
                seen,
                epoch,
                ..PageCommit::default()
            },
        }
    }
}

impl Acked<DeleteCommit> {
    /// Deletes whose `*.deleted` events were each delivered (same order, one each).
    pub fn deletes(
        tombstones: Vec<(i64, Tombstone)>,
        deliveries: &[Delivery],
    ) -> Result<Self, NotAcknowledged> {
        check(tombstones.len(), deliveries.len())?;
        Ok(Self {
            batch: DeleteCommit { tombstones },
        })
    }
}

#[cfg(test)]
mod tests {
    use chrono::DateTime;

    use super::*;

    fn record(n: u8) -> RecordState {
        RecordState {
            hash: ContentHash([n; 16]),
            updated_at: None,
            seen_epoch: 1,
            generation: 0,
            seq: 1,
            print: None,
        }
    }

    fn letter() -> DeadLetter {
        DeadLetter {
            since: DateTime::from_timestamp(1_700_000_000, 0).unwrap(),
            reason: "too large".into(),
            limit: Some(1024),
        }
    }

    #[test]
    fn a_page_with_an_acknowledgement_per_change_commits_with_its_dead_letter_marks() {
        let acked = Acked::page(
            vec![(1, record(1)), (2, record(2)), (3, record(3))],
            vec![
                Delivery::Acknowledged,
                Delivery::DeadLettered(letter()),
                Delivery::Acknowledged,
            ],
            vec![7, 8],
            4,
        )
        .unwrap();
        let page = acked.batch();
        assert_eq!(page.records.len(), 3);
        assert_eq!(page.dead_letters, vec![(2, letter())]);
        assert_eq!(page.seen, vec![7, 8]);
        assert_eq!(page.epoch, 4);
    }

    #[test]
    fn a_page_missing_an_acknowledgement_cannot_be_committed() {
        let err = Acked::page(
            vec![(1, record(1)), (2, record(2))],
            vec![Delivery::Acknowledged],
            vec![],
            0,
        )
        .unwrap_err();
        assert_eq!(
            err,
            NotAcknowledged {
                changes: 2,
                deliveries: 1
            }
        );
        assert!(err
            .to_string()
            .contains("1 acknowledgement(s) for 2 change(s)"));
    }

    #[test]
    fn more_acknowledgements_than_changes_is_refused_too() {
        assert!(Acked::page(vec![], vec![Delivery::Acknowledged], vec![], 0).is_err());
        let tombstone = Tombstone {
            generation: 1,
            last_hash: ContentHash([1; 16]),
            updated_at: None,
        };
        assert!(Acked::deletes(vec![(1, tombstone)], &[]).is_err());
        assert!(Acked::deletes(vec![(1, tombstone)], &[Delivery::Acknowledged]).is_ok());
    }
}
