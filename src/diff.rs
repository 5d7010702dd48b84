//! The change decision, without I/O: whether a listed record must be
//! published, and as which kind of change, given its content hash
//! ([`crate::hash`]) and what the store knows about it.

use crate::event::Op;
use crate::hash::ContentHash;
use crate::state::{Intent, RecordState, Tombstone};

/// How the sweep that listed a record treats it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SweepMode {
    /// The stream's first sync: every new or changed record is a snapshot.
    FirstSync,
    /// A normal incremental or full sweep.
    Normal,
    /// A replay: every listed record is a snapshot, whatever its hash.
    Replay,
}

/// Whether a listed record must be published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// The stored hash matches: nothing to publish.
    Unchanged,
    /// Publish an event of this kind; `previous` is the stored hash, if any.
    Emit {
        /// The kind of change.
        op: Op,
        /// The hash known before this sweep.
        previous: Option<ContentHash>,
    },
}

/// Decides what to do with a listed record given the hash the store knows.
pub fn decide(known: Option<ContentHash>, new: ContentHash, mode: SweepMode) -> Decision {
    let unchanged = known == Some(new);
    match mode {
        SweepMode::Replay => Decision::Emit {
            op: Op::Snapshot,
            previous: known,
        },
        SweepMode::FirstSync if unchanged => Decision::Unchanged,
        SweepMode::FirstSync => Decision::Emit {
            op: Op::Snapshot,
            previous: known,
        },
        SweepMode::Normal => match known {
            None => Decision::Emit {
                op: Op::Create,
                previous: None,
            },
            Some(_) if unchanged => Decision::Unchanged,
            Some(previous) => Decision::Emit {
                op: Op::Update,
                previous: Some(previous),
            },
        },
    }
}

/// What the store knows about one listed record.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Known {
    /// The committed state (the last acknowledged and committed version).
    pub committed: Option<RecordState>,
    /// A pending intent: a change that may have reached the sink but was not committed.
    pub intent: Option<Intent>,
    /// The tombstone of an earlier incarnation of this id.
    pub tombstone: Option<Tombstone>,
}

/// A change to publish for a listed record: every input of its event id
/// besides the record itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    /// The event's `op`.
    pub op: Op,
    /// The event's `previoushash`: what downstream may have seen last.
    pub previous: Option<ContentHash>,
    /// Delete generation of the record id.
    pub generation: u32,
    /// The change sequence the change commits as.
    pub seq: u64,
    /// The replay id the event carries (16 bytes of the 32-hex id).
    pub replay: Option<[u8; 16]>,
}

/// Decides what to publish for a listed record whose content hash is `hash`.
///
/// * A pending intent is what downstream may have seen: the record is
///   compared with it, not only with the committed hash. A listed version
///   equal to the intent's is re-published exactly as journalled (same event
///   id); any other version is published with the intent's hash as
///   `previoushash` (so a revert to the committed content is not missed).
/// * A pending delete means downstream may have seen the record go: the listed
///   record is a new incarnation (next generation, `create`).
/// * The change sequence grows by one for every change of content, so a
///   record flipping A→B→A→B gets a new id for the second A→B, while a replay
///   snapshot of unchanged content keeps the sequence.
/// * A replay skips records it already emitted (committed with the replay's
///   `epoch` and the same hash) when it resumes after a crash or shutdown.
pub fn plan_change(
    known: &Known,
    hash: ContentHash,
    mode: SweepMode,
    replay: Option<[u8; 16]>,
    epoch: u64,
) -> Option<Change> {
    let committed_seq = known.committed.map_or(0, |c| c.seq);
    let (baseline, base_seq, generation) = match known.intent {
        Some(intent) if intent.is_delete() => {
            let op = if mode == SweepMode::Normal {
                Op::Create
            } else {
                Op::Snapshot
            };
            return Some(Change {
                op,
                previous: None,
                generation: intent.generation.saturating_add(1),
                seq: intent.seq.max(committed_seq).saturating_add(1),
                replay,
            });
        }
        Some(intent)
            if intent.hash == hash && (mode != SweepMode::Replay || intent.replay == replay) =>
        {
            let op = intent.op.unwrap_or(match (mode, known.committed) {
                (SweepMode::Normal, Some(_)) => Op::Update,
                (SweepMode::Normal, None) => Op::Create,
                _ => Op::Snapshot,
            });
            let previous = if intent.op.is_some() {
                intent.previous
            } else {
                known.committed.map(|c| c.hash)
            };
            return Some(Change {
                op,
                previous,
                generation: intent.generation,
                seq: intent.seq,
                replay: intent.replay,
            });
        }
        Some(intent) => (
            Some(intent.hash),
            intent.seq.max(committed_seq),
            intent.generation,
        ),
        None => match known.committed {
            Some(c) => {
                if mode == SweepMode::Replay && c.seen_epoch == epoch && c.hash == hash {
                    // Emitted by this replay before it was interrupted.
                    return None;
                }
                (Some(c.hash), c.seq, c.generation)
            }
            None => (None, 0, known.tombstone.map_or(0, |t| t.generation)),
        },
    };
    match decide(baseline, hash, mode) {
        Decision::Unchanged => None,
        Decision::Emit { op, previous } => Some(Change {
            op,
            previous,
            generation,
            seq: if baseline == Some(hash) {
                base_seq
            } else {
                base_seq.saturating_add(1)
            },
            replay,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decide_follows_the_sweep_mode_table() {
        let a = ContentHash([1; 16]);
        let b = ContentHash([2; 16]);
        use Decision::*;
        use SweepMode::*;
        let emit = |op, previous| Emit { op, previous };
        let cases = [
            (FirstSync, None, emit(Op::Snapshot, None)),
            (FirstSync, Some(a), Unchanged),
            (FirstSync, Some(b), emit(Op::Snapshot, Some(b))),
            (Normal, None, emit(Op::Create, None)),
            (Normal, Some(a), Unchanged),
            (Normal, Some(b), emit(Op::Update, Some(b))),
            (Replay, None, emit(Op::Snapshot, None)),
            (Replay, Some(a), emit(Op::Snapshot, Some(a))),
            (Replay, Some(b), emit(Op::Snapshot, Some(b))),
        ];
        for (mode, known, expected) in cases {
            assert_eq!(decide(known, a, mode), expected, "{mode:?} known={known:?}");
        }
    }

    fn committed(h: ContentHash, seq: u64, seen_epoch: u64) -> RecordState {
        RecordState {
            hash: h,
            updated_at: None,
            seen_epoch,
            generation: 3,
            seq,
            print: None,
        }
    }

    fn upsert_intent(h: ContentHash, op: Op, previous: Option<ContentHash>, seq: u64) -> Intent {
        Intent {
            hash: h,
            updated_at: None,
            generation: 3,
            seq,
            op: Some(op),
            previous,
            replay: None,
        }
    }

    #[test]
    fn without_an_intent_the_change_sequence_grows_only_when_the_content_changes() {
        let (a, b) = (ContentHash([1; 16]), ContentHash([2; 16]));
        let known = Known {
            committed: Some(committed(a, 4, 1)),
            ..Known::default()
        };
        assert_eq!(plan_change(&known, a, SweepMode::Normal, None, 1), None);
        let change = plan_change(&known, b, SweepMode::Normal, None, 1).unwrap();
        assert_eq!(
            (change.op, change.previous, change.seq, change.generation),
            (Op::Update, Some(a), 5, 3)
        );
        // A replay snapshot of unchanged content keeps the sequence (same id if re-emitted).
        let replay = Some([9; 16]);
        let change = plan_change(&known, a, SweepMode::Replay, replay, 2).unwrap();
        assert_eq!(
            (change.op, change.previous, change.seq, change.replay),
            (Op::Snapshot, Some(a), 4, replay)
        );
        // ...and a resumed replay skips what it already emitted (committed with its epoch).
        let emitted = Known {
            committed: Some(committed(a, 4, 2)),
            ..Known::default()
        };
        assert_eq!(plan_change(&emitted, a, SweepMode::Replay, replay, 2), None);
        assert!(plan_change(&emitted, b, SweepMode::Replay, replay, 2).is_some());
        // A new record after a delete starts the tombstone's generation.
        let reborn = Known {
            tombstone: Some(Tombstone {
                generation: 7,
                last_hash: a,
                updated_at: None,
            }),
            ..Known::default()
        };
        let change = plan_change(&reborn, a, SweepMode::Normal, None, 1).unwrap();
        assert_eq!(
            (change.op, change.previous, change.generation, change.seq),
            (Op::Create, None, 7, 1)
        );
    }

    #[test]
    fn a_flip_flop_without_an_updated_at_bump_gets_a_new_sequence_for_every_change() {
        let (a, b) = (ContentHash([1; 16]), ContentHash([2; 16]));
        let mut state = committed(a, 0, 1);
        let mut seen = std::collections::HashSet::new();
        for (next, expected_previous) in [(b, a), (a, b), (b, a), (a, b)] {
            let known = Known {
                committed: Some(state),
                ..Known::default()
            };
            let change = plan_change(&known, next, SweepMode::Normal, None, 1).unwrap();
            assert_eq!(change.previous, Some(expected_previous));
            assert!(
                seen.insert((next, change.previous, change.seq)),
                "an id repeats"
            );
            state = committed(next, change.seq, 1);
        }
        assert_eq!(state.seq, 4);
    }

    #[test]
    fn a_pending_intent_is_what_downstream_may_have_seen() {
        let (a, b, c) = (
            ContentHash([1; 16]),
            ContentHash([2; 16]),
            ContentHash([3; 16]),
        );
        let intent = upsert_intent(b, Op::Update, Some(a), 5);
        let known = Known {
            committed: Some(committed(a, 4, 1)),
            intent: Some(intent),
            tombstone: None,
        };
        // The journalled version listed again: re-published exactly as journalled.
        let same = plan_change(&known, b, SweepMode::Normal, None, 1).unwrap();
        assert_eq!(
            same,
            Change {
                op: Op::Update,
                previous: Some(a),
                generation: 3,
                seq: 5,
                replay: None
            }
        );
        // Reverted to the committed content: an update away from the intent's version.
        let revert = plan_change(&known, a, SweepMode::Normal, None, 1).unwrap();
        assert_eq!(
            revert,
            Change {
                op: Op::Update,
                previous: Some(b),
                generation: 3,
                seq: 6,
                replay: None
            }
        );
        // A third version: previous is the intent's, never the committed one.
        let third = plan_change(&known, c, SweepMode::Normal, None, 1).unwrap();
        assert_eq!((third.previous, third.seq), (Some(b), 6));
        // A replay does not re-publish another replay's (or no replay's) change.
        let replay = Some([9; 16]);
        let snap = plan_change(&known, b, SweepMode::Replay, replay, 2).unwrap();
        assert_eq!(
            (snap.op, snap.previous, snap.seq, snap.replay),
            (Op::Snapshot, Some(b), 5, replay)
        );
    }

    #[test]
    fn a_pending_delete_makes_a_listed_record_a_new_incarnation() {
        let a = ContentHash([1; 16]);
        let delete = Intent {
            op: Some(Op::Delete),
            ..upsert_intent(a, Op::Delete, None, 9)
        };
        let known = Known {
            committed: Some(committed(a, 8, 1)),
            intent: Some(delete),
            tombstone: None,
        };
        for (mode, op) in [
            (SweepMode::Normal, Op::Create),
            (SweepMode::FirstSync, Op::Snapshot),
            (SweepMode::Replay, Op::Snapshot),
        ] {
            let change = plan_change(&known, a, mode, None, 1).unwrap();
            assert_eq!(
                (change.op, change.previous, change.generation, change.seq),
                (op, None, 4, 10)
            );
        }
    }

    #[test]
    fn an_intent_from_layout_1_is_published_again_against_the_committed_hash() {
        let (a, b) = (ContentHash([1; 16]), ContentHash([2; 16]));
        let old = Intent {
            op: None,
            previous: None,
            ..upsert_intent(b, Op::Update, None, 0)
        };
        let known = Known {
            committed: Some(committed(a, 0, 1)),
            intent: Some(old),
            tombstone: None,
        };
        let change = plan_change(&known, b, SweepMode::Normal, None, 1).unwrap();
        assert_eq!((change.op, change.previous), (Op::Update, Some(a)));
        let orphan = Known {
            intent: Some(old),
            ..Known::default()
        };
        let change = plan_change(&orphan, b, SweepMode::FirstSync, None, 1).unwrap();
        assert_eq!((change.op, change.previous), (Op::Snapshot, None));
    }
}
