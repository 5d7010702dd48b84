//! The one owner of a stream's lifecycle state ([`StreamState`]).
//!
//! Every change to a stream's watermark, epochs, replay, errors and parking
//! is one named transition here, each one load and one save: begin a sweep
//! (which also decides what the sweep does, its [`SweepPlan`]), finish it,
//! record an error, park, schedule a replay. The sweep itself never writes
//! the stream state; it returns what happened and [`StreamLedger::finish_sweep`]
//! applies it, so nothing can overwrite a transition with a stale copy.

use std::time::Duration;

use chrono::{DateTime, Utc};
use tracing::info;

use super::{
    replay_id_bytes, Pause, ReplayState, RequestedBy, StateError, StateStore, StreamState,
};
use crate::diff::SweepMode;
use crate::stream::StreamKey;

/// Which kind of sweep the scheduler asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepKind {
    /// `updated_since = watermark - lookback`; never deletes.
    Incremental,
    /// No `updated_since`; marks every record seen and deletes the unseen.
    Full,
}

impl SweepKind {
    /// The name used in metrics and status.
    pub fn as_str(self) -> &'static str {
        match self {
            SweepKind::Incremental => "incremental",
            SweepKind::Full => "full",
        }
    }
}

/// What one sweep does, decided from the stream state when it begins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SweepPlan {
    /// How listed records are compared (first sync, replay, normal).
    pub mode: SweepMode,
    /// A complete listing (deletes the unseen afterwards).
    pub full: bool,
    /// The `updated_since` of the listing.
    pub updated_since: Option<DateTime<Utc>>,
    /// The replay this sweep runs, when one is pending.
    pub replay_id: Option<String>,
    /// `replay_id` as the 16 bytes intents store.
    pub replay: Option<[u8; 16]>,
    /// The replay's `--since`, for its frames.
    pub replay_since: Option<DateTime<Utc>>,
    /// Snapshots earlier, interrupted runs of this replay emitted.
    pub replay_records_before: u64,
    /// The full-sweep epoch records seen by this sweep are marked with.
    pub epoch: u64,
    /// The stream's watermark before this sweep, when it has one and this
    /// is a normal sweep: a change whose `updated_at` is later was announced
    /// since the last listing (what the planner learns rates from).
    pub announced_after: Option<DateTime<Utc>>,
}

impl SweepPlan {
    /// `incremental`, `full` or `replay`: the name in metrics, logs and reports.
    pub fn label(&self) -> &'static str {
        if self.replay_id.is_some() {
            "replay"
        } else if self.full {
            "full"
        } else {
            "incremental"
        }
    }

    /// A full sweep that is neither a first sync nor a replay.
    fn is_periodic_full(&self) -> bool {
        self.full && self.mode == SweepMode::Normal
    }
}

/// Decides what a sweep of a stream in `state` does when `kind` is asked for.
/// A pending replay or a stream never synced gets its snapshot sweep whatever
/// the kind.
pub fn plan_sweep(state: &StreamState, kind: SweepKind, lookback: Duration) -> SweepPlan {
    if let Some(replay) = state.replay.as_ref().filter(|r| r.pending) {
        return SweepPlan {
            mode: SweepMode::Replay,
            full: replay.since.is_none(),
            updated_since: replay.since,
            replay_id: Some(replay.id.clone()),
            replay: replay_id_bytes(&replay.id),
            replay_since: replay.since,
            replay_records_before: replay.records,
            // Fixed when the replay first ran, so a resumed replay knows what it emitted.
            epoch: replay
                .epoch
                .unwrap_or_else(|| state.full_sweep_epoch.saturating_add(1)),
            announced_after: None,
        };
    }
    let complete = |mode| SweepPlan {
        mode,
        full: true,
        updated_since: None,
        replay_id: None,
        replay: None,
        replay_since: None,
        replay_records_before: 0,
        epoch: state.full_sweep_epoch.saturating_add(1),
        announced_after: state.watermark,
    };
    let Some(watermark) = state.watermark else {
        // First sync: a complete listing, emitted as snapshots.
        return complete(SweepMode::FirstSync);
    };
    match kind {
        SweepKind::Full => complete(SweepMode::Normal),
        SweepKind::Incremental => {
            let lookback =
                chrono::Duration::from_std(lookback).unwrap_or_else(|_| chrono::Duration::zero());
            SweepPlan {
                mode: SweepMode::Normal,
                full: false,
                updated_since: watermark.checked_sub_signed(lookback),
                replay_id: None,
                replay: None,
                replay_since: None,
                replay_records_before: 0,
                epoch: state.full_sweep_epoch,
                announced_after: Some(watermark),
            }
        }
    }
}

/// How a sweep ended, as far as the stream state cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SweepEnd {
    /// The listing completed and every change was committed.
    Completed {
        /// Server time of the sweep's first page: the new watermark.
        watermark: Option<DateTime<Utc>>,
        /// Records the store knows after the sweep.
        records_known: u64,
        /// Snapshots this run of a replay emitted (0 for other sweeps).
        replay_snapshots: u64,
    },
    /// Shutdown or a replay request stopped the sweep between two pages.
    Interrupted {
        /// Snapshots this run of a replay emitted before it stopped.
        replay_snapshots: u64,
    },
    /// The sweep failed; the watermark stays.
    Failed {
        /// The error, one line.
        error: String,
        /// Snapshots this run of a replay emitted before it failed.
        replay_snapshots: u64,
    },
}

/// When a failed periodic full sweep is tried again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FullRetry {
    /// First wait; doubles per failure.
    pub initial: Duration,
    /// Longest wait.
    pub max: Duration,
}

impl FullRetry {
    /// The wait before the `failures`-th failed full sweep is tried again:
    /// `initial` doubled per failure, at most `max`.
    pub fn delay(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(20);
        self.initial
            .saturating_mul(1 << doublings)
            .min(self.max)
            .max(self.initial.min(self.max))
    }
}

/// One stream's lifecycle transitions over a store; cheap to build per use.
#[derive(Clone, Copy)]
pub struct StreamLedger<'s> {
    store: &'s dyn StateStore,
    key: StreamKey,
}

impl<'s> StreamLedger<'s> {
    /// The ledger of `key` in `store`.
    pub fn new(store: &'s dyn StateStore, key: StreamKey) -> Self {
        Self { store, key }
    }

    /// The stream's state as stored (read-only: status, gauges, scheduling).
    pub fn state(&self) -> Result<StreamState, StateError> {
        self.store.load_stream(self.key)
    }

    /// Begins a sweep: decides its plan, records the start time, advances the
    /// full-sweep epoch for a complete listing and fixes a replay's epoch the
    /// first time it runs.
    pub fn begin_sweep(
        &self,
        kind: SweepKind,
        lookback: Duration,
        now: DateTime<Utc>,
    ) -> Result<SweepPlan, StateError> {
        let mut state = self.store.load_stream(self.key)?;
        let plan = plan_sweep(&state, kind, lookback);
        state.last_sweep_started = Some(now);
        if plan.full || plan.replay_id.is_some() {
            state.full_sweep_epoch = state.full_sweep_epoch.max(plan.epoch);
        }
        if let Some(replay) = state.replay.as_mut().filter(|r| r.pending) {
            replay.epoch.get_or_insert(plan.epoch);
        }
        self.store.save_stream(self.key, &state)?;
        Ok(plan)
    }

    /// Finishes the sweep `plan` began, as it `end`ed, and makes the state durable.
    pub fn finish_sweep(
        &self,
        plan: &SweepPlan,
        end: &SweepEnd,
        full_retry: FullRetry,
        now: DateTime<Utc>,
    ) -> Result<(), StateError> {
        let mut state = self.store.load_stream(self.key)?;
        let replay_snapshots = match end {
            SweepEnd::Completed {
                replay_snapshots, ..
            }
            | SweepEnd::Interrupted { replay_snapshots }
            | SweepEnd::Failed {
                replay_snapshots, ..
            } => *replay_snapshots,
        };
        // A stopped replay resumes later and skips what it emitted: keep its count.
        if let Some(replay) = state
            .replay
            .as_mut()
            .filter(|r| r.pending && Some(&r.id) == plan.replay_id.as_ref())
        {
            replay.records = plan.replay_records_before.saturating_add(replay_snapshots);
            if matches!(end, SweepEnd::Completed { .. }) {
                replay.pending = false;
            }
        }
        match end {
            SweepEnd::Completed {
                watermark,
                records_known,
                ..
            } => {
                state.watermark = *watermark;
                state.last_sweep_finished = Some(now);
                if plan.full {
                    state.last_full_sweep_finished = Some(now);
                }
                // A failing full sweep stays visible (status, stream_failing,
                // status exit code) until a full sweep succeeds, even while
                // incremental sweeps succeed in between.
                if plan.full || state.full_sweep_failures == 0 {
                    state.last_error = None;
                    state.last_error_at = None;
                }
                state.parked = None;
                state.records_known = *records_known;
                if plan.full {
                    state.full_sweep_failures = 0;
                    state.full_sweep_retry_at = None;
                }
            }
            SweepEnd::Interrupted { .. } => {}
            SweepEnd::Failed { error, .. } => {
                state.last_error = Some(error.clone());
                state.last_error_at = Some(now);
                if plan.is_periodic_full() {
                    // Incremental sweeps go on; the full listing waits its backoff.
                    state.full_sweep_failures = state.full_sweep_failures.saturating_add(1);
                    let wait = full_retry.delay(state.full_sweep_failures);
                    state.full_sweep_retry_at = chrono::Duration::from_std(wait)
                        .ok()
                        .and_then(|w| now.checked_add_signed(w));
                }
            }
        }
        self.store.save_stream(self.key, &state)?;
        self.store.flush()
    }

    /// Records `error` as the stream's last error (the stream goes on).
    pub fn record_error(&self, error: &str, now: DateTime<Utc>) -> Result<(), StateError> {
        let mut state = self.store.load_stream(self.key)?;
        state.last_error = Some(error.to_string());
        state.last_error_at = Some(now);
        self.store.save_stream(self.key, &state)?;
        self.store.flush()
    }

    /// Parks the stream: the upstream refused access (401/403/404) for `reason`.
    pub fn park(&self, reason: &str) -> Result<(), StateError> {
        let mut state = self.store.load_stream(self.key)?;
        state.parked = Some(reason.to_string());
        self.store.save_stream(self.key, &state)?;
        self.store.flush()
    }

    /// Schedules a replay: a new replay id, the watermark cleared (or set to
    /// `since`). The stream's next sweep emits every record it lists as
    /// `op: snapshot`; other streams are untouched. Returns the replay id.
    pub fn schedule_replay(
        &self,
        since: Option<DateTime<Utc>>,
        by: RequestedBy,
        now: DateTime<Utc>,
    ) -> Result<String, StateError> {
        let mut state = self.store.load_stream(self.key)?;
        let id = new_replay_id();
        // A replay replacing a pending one goes back to where that one started.
        let previous_watermark = match state.replay.as_ref().filter(|r| r.pending) {
            Some(pending) => pending.previous_watermark,
            None => state.watermark,
        };
        state.replay = Some(ReplayState {
            id: id.clone(),
            since,
            requested_at: now,
            pending: true,
            records: 0,
            epoch: None,
            requested_by: Some(by),
            previous_watermark,
            cancelled_at: None,
        });
        state.watermark = since;
        self.store.save_stream(self.key, &state)?;
        self.store.flush()?;
        info!(tenant = self.key.tenant, resource = %self.key.resource, replay_id = %id, "replay scheduled");
        Ok(id)
    }

    /// Pauses the stream (no sweep until [`StreamLedger::resume`]); returns
    /// false when it was paused already (the first pause is kept).
    pub fn pause(&self, by: RequestedBy, now: DateTime<Utc>) -> Result<bool, StateError> {
        let mut state = self.store.load_stream(self.key)?;
        if state.paused.is_some() {
            return Ok(false);
        }
        state.paused = Some(Pause { since: now, by });
        self.store.save_stream(self.key, &state)?;
        self.store.flush()?;
        info!(tenant = self.key.tenant, resource = %self.key.resource, by = by.as_str(), "stream paused");
        Ok(true)
    }

    /// Resumes a paused stream: its next sweep lists from its watermark.
    /// Returns false when it was not paused.
    pub fn resume(&self) -> Result<bool, StateError> {
        let mut state = self.store.load_stream(self.key)?;
        if state.paused.take().is_none() {
            return Ok(false);
        }
        self.store.save_stream(self.key, &state)?;
        self.store.flush()?;
        info!(tenant = self.key.tenant, resource = %self.key.resource, "stream resumed");
        Ok(true)
    }

    /// Cancels the pending replay `id`: the watermark goes back to where it
    /// was before the replay, and the replay is no longer pending. Returns the
    /// cancelled replay as it stood, or None when `id` is not the stream's
    /// pending replay.
    pub fn cancel_replay(
        &self,
        id: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<ReplayState>, StateError> {
        let mut state = self.store.load_stream(self.key)?;
        let Some(replay) = state.replay.as_mut().filter(|r| r.pending && r.id == id) else {
            return Ok(None);
        };
        let before = replay.clone();
        replay.pending = false;
        replay.cancelled_at = Some(now);
        state.watermark = before.previous_watermark;
        self.store.save_stream(self.key, &state)?;
        self.store.flush()?;
        info!(tenant = self.key.tenant, resource = %self.key.resource, replay_id = %id, "replay cancelled");
        Ok(Some(before))
    }
}

fn new_replay_id() -> String {
    let bytes: [u8; 16] = rand::random();
    hex::encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000 + secs, 0).unwrap()
    }

    #[test]
    fn a_stream_never_synced_plans_a_first_sync_whatever_the_kind() {
        let state = StreamState::default();
        for kind in [SweepKind::Incremental, SweepKind::Full] {
            let plan = plan_sweep(&state, kind, Duration::from_secs(60));
            assert_eq!(plan.mode, SweepMode::FirstSync);
            assert!(plan.full);
            assert_eq!(plan.updated_since, None);
            assert_eq!(plan.epoch, 1);
            assert_eq!(plan.label(), "full");
        }
    }

    #[test]
    fn an_incremental_sweep_lists_from_the_watermark_minus_the_lookback() {
        let state = StreamState {
            watermark: Some(at(100)),
            full_sweep_epoch: 4,
            ..StreamState::default()
        };
        let plan = plan_sweep(&state, SweepKind::Incremental, Duration::from_secs(60));
        assert_eq!(plan.mode, SweepMode::Normal);
        assert!(!plan.full);
        assert_eq!(plan.updated_since, Some(at(40)));
        assert_eq!(plan.epoch, 4);
        assert_eq!(plan.label(), "incremental");
        let full = plan_sweep(&state, SweepKind::Full, Duration::from_secs(60));
        assert!(full.full);
        assert_eq!(full.updated_since, None);
        assert_eq!(full.epoch, 5);
    }

    #[test]
    fn a_pending_replay_keeps_the_epoch_it_first_ran_with() {
        let replay = ReplayState {
            id: "00112233445566778899aabbccddeeff".into(),
            since: Some(at(10)),
            requested_at: at(0),
            pending: true,
            records: 7,
            epoch: Some(3),
            requested_by: None,
            previous_watermark: None,
            cancelled_at: None,
        };
        let state = StreamState {
            watermark: Some(at(10)),
            full_sweep_epoch: 9,
            replay: Some(replay),
            ..StreamState::default()
        };
        let plan = plan_sweep(&state, SweepKind::Full, Duration::from_secs(60));
        assert_eq!(plan.mode, SweepMode::Replay);
        assert!(!plan.full, "a replay --since lists incrementally");
        assert_eq!(plan.updated_since, Some(at(10)));
        assert_eq!(plan.epoch, 3);
        assert_eq!(plan.replay_records_before, 7);
        assert_eq!(plan.replay.map(hex::encode), plan.replay_id);
        assert_eq!(plan.label(), "replay");
    }

    #[test]
    fn full_retry_doubles_per_failure_up_to_its_cap() {
        let retry = FullRetry {
            initial: Duration::from_secs(30),
            max: Duration::from_secs(100),
        };
        assert_eq!(retry.delay(1), Duration::from_secs(30));
        assert_eq!(retry.delay(2), Duration::from_secs(60));
        assert_eq!(retry.delay(3), Duration::from_secs(100));
        assert_eq!(retry.delay(u32::MAX), Duration::from_secs(100));
    }
}
