//! Status: what every stream is doing, as `status` and `GET /v1/status`
//! show it, read from the stream states in the store (and, on a running
//! daemon, what the planners know of each stream).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::ControlError;
use crate::planner::{BudgetStatus, Planner, StreamPlanStatus};
use crate::state::{Pause, ReplayState, StateStore, StreamState};
use crate::stream::{Resource, StreamKey, TenantId};
use crate::telemetry;

/// One stream as `status` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamStatus {
    /// The tenant.
    pub tenant: TenantId,
    /// The resource.
    pub resource: Resource,
    /// Server time of the first page of the last completed sweep.
    pub watermark: Option<DateTime<Utc>>,
    /// Now minus the watermark, in seconds.
    pub lag_seconds: Option<f64>,
    /// Records whose hash the store knows, as of the last finished sweep.
    pub records_known: u64,
    /// Records committed in the store right now: grows page by page during a
    /// sweep (a long first sync shows its progress here).
    #[serde(default)]
    pub records_committed: u64,
    /// When the sweep that is running now started (None between sweeps).
    #[serde(default)]
    pub sweep_in_progress_since: Option<DateTime<Utc>>,
    /// When the last sweep started.
    pub last_sweep_started: Option<DateTime<Utc>>,
    /// When the last successful sweep finished.
    pub last_sweep_finished: Option<DateTime<Utc>>,
    /// Seconds since the last successful sweep.
    pub seconds_since_last_sweep: Option<f64>,
    /// When the last successful full sweep finished.
    pub last_full_sweep_finished: Option<DateTime<Utc>>,
    /// The last error, one line.
    pub last_error: Option<String>,
    /// When the last error happened.
    pub last_error_at: Option<DateTime<Utc>>,
    /// Why the stream is parked, None when it runs.
    pub parked: Option<String>,
    /// Set while an operator paused the stream (since when, by whom).
    #[serde(default)]
    pub paused: Option<Pause>,
    /// The current or last replay.
    pub replay: Option<ReplayState>,
    /// Records committed as dead-lettered (their event went out as a dead
    /// letter), in id order; each leaves the list when a later version of
    /// it is published (a content change or a replay) or it is deleted.
    #[serde(default)]
    pub dead_letters: Vec<DeadLetterStatus>,
    /// What the adaptive planner knows of the stream (`poll.strategy = "adaptive"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planner: Option<StreamPlanStatus>,
    /// How far the stream's periodic full sweep is behind `poll.full_resync_interval`
    /// (the budget did not allow it), in seconds; None when on time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub full_sweep_overdue_seconds: Option<f64>,
}

/// One dead-lettered record as `status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetterStatus {
    /// The record id.
    pub record_id: i64,
    /// Why the sink refused its event.
    pub reason: String,
    /// The broker limit the event exceeded, in bytes, when known.
    pub limit: Option<u64>,
    /// When it was dead-lettered.
    pub since: DateTime<Utc>,
}

impl StreamStatus {
    /// The status of `stream` from its stored state, as of `now`.
    pub fn from_state(stream: StreamKey, state: &StreamState, now: DateTime<Utc>) -> Self {
        Self {
            tenant: stream.tenant,
            resource: stream.resource,
            watermark: state.watermark,
            lag_seconds: state.watermark.map(|w| telemetry::seconds_between(w, now)),
            records_known: state.records_known,
            records_committed: state.records_known,
            sweep_in_progress_since: state.last_sweep_started.filter(|started| {
                state.last_sweep_finished.is_none_or(|f| f < *started)
                    && state.last_error_at.is_none_or(|e| e < *started)
            }),
            last_sweep_started: state.last_sweep_started,
            last_sweep_finished: state.last_sweep_finished,
            seconds_since_last_sweep: state
                .last_sweep_finished
                .map(|f| telemetry::seconds_between(f, now)),
            last_full_sweep_finished: state.last_full_sweep_finished,
            last_error: state.last_error.clone(),
            last_error_at: state.last_error_at,
            parked: state.parked.clone(),
            paused: state.paused,
            replay: state.replay.clone(),
            dead_letters: Vec::new(),
            planner: None,
            full_sweep_overdue_seconds: None,
        }
    }

    /// The stream key.
    pub fn key(&self) -> StreamKey {
        StreamKey::new(self.tenant, self.resource)
    }

    /// True when the stream needs an operator: parked, or its last sweep failed.
    pub fn needs_attention(&self) -> bool {
        self.parked.is_some() || self.last_error.is_some()
    }
}

/// The sink as `status` shows it (only known to a running daemon).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SinkStatus {
    /// The sink's name.
    pub name: String,
    /// True when its health check passes.
    pub healthy: bool,
    /// The health check's error, if any.
    pub error: Option<String>,
}

/// `GET /v1/status` and `status --json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// Every stream of this daemon, in key order.
    pub streams: Vec<StreamStatus>,
    /// The sink, when a running daemon answered.
    pub sink: Option<SinkStatus>,
    /// Each token's budget and planner, when a running daemon answered.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub budgets: Vec<BudgetStatus>,
}

/// Reads the status of `streams` from a store, with the live record count of
/// each (pages commit one by one, so it moves during a sweep).
pub fn status_from_store(
    store: &dyn StateStore,
    streams: &[StreamKey],
    now: DateTime<Utc>,
) -> Result<Vec<StreamStatus>, crate::state::StateError> {
    let mut keys = streams.to_vec();
    keys.sort();
    keys.iter()
        .map(|key| {
            let state = store.load_stream(*key)?;
            let mut status = StreamStatus::from_state(*key, &state, now);
            status.records_committed = store.record_count(*key)?;
            status.dead_letters = store
                .dead_letters(*key)?
                .into_iter()
                .map(|(record_id, letter)| DeadLetterStatus {
                    record_id,
                    reason: letter.reason,
                    limit: letter.limit,
                    since: letter.since,
                })
                .collect();
            Ok(status)
        })
        .collect()
}

/// The status of `streams` from the store, for a use case.
pub fn from_store(
    store: &dyn StateStore,
    streams: &[StreamKey],
    now: DateTime<Utc>,
) -> Result<Vec<StreamStatus>, ControlError> {
    Ok(status_from_store(store, streams, now)?)
}

/// Adds what each token's planner knows of the streams it plans, and how
/// late a stream's full sweep is beyond a poll interval (when it neither
/// fails nor is parked).
pub fn add_plans(streams: &mut [StreamStatus], planners: &[Planner], now: DateTime<Utc>) {
    for planner in planners {
        let planned = planner.streams();
        for status in streams.iter_mut().filter(|s| planned.contains(&s.key())) {
            let key = status.key();
            status.planner = planner.stream_status(key);
            let settings = planner.settings();
            let slack = settings.full_resync_interval + settings.interval;
            let healthy = status.parked.is_none() && status.last_error.is_none();
            status.full_sweep_overdue_seconds = status
                .last_full_sweep_finished
                .filter(|_| healthy)
                .and_then(|at| chrono::Duration::from_std(slack).ok().map(|s| at + s))
                .map(|due| (now - due).num_milliseconds() as f64 / 1000.0)
                .filter(|late| *late > 0.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2024-05-01T12:00:00Z.
    fn now() -> DateTime<Utc> {
        DateTime::from_timestamp(1_714_564_800, 0).unwrap()
    }

    #[test]
    fn status_during_a_first_sync_shows_the_records_committed_so_far_and_since_when() {
        use crate::hash::ContentHash;
        use crate::state::{RecordState, SledStore};
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(&dir.path().join("state")).unwrap();
        let key = StreamKey::new(1, Resource::Vouchers);
        let started = now() - chrono::Duration::minutes(3);
        let state = StreamState {
            last_sweep_started: Some(started),
            ..Default::default()
        };
        store.save_stream(key, &state).unwrap();
        let page: Vec<(i64, RecordState)> = (1..=3u8)
            .map(|n| {
                let record = RecordState {
                    hash: ContentHash([n; 16]),
                    updated_at: None,
                    seen_epoch: 0,
                    generation: 0,
                    seq: 0,
                    print: None,
                };
                (i64::from(n), record)
            })
            .collect();
        let acks = vec![crate::state::Delivery::Acknowledged; page.len()];
        let page = crate::state::Acked::page(page, acks, vec![], 0).unwrap();
        store.commit_page(key, &page).unwrap();

        let status = status_from_store(&store, &[key], now()).unwrap();
        assert_eq!(status[0].records_known, 0, "the sweep has not finished");
        assert_eq!(status[0].records_committed, 3);
        assert_eq!(status[0].sweep_in_progress_since, Some(started));

        let finished = StreamState {
            last_sweep_finished: Some(now()),
            ..state
        };
        let status = StreamStatus::from_state(key, &finished, now());
        assert_eq!(status.sweep_in_progress_since, None);
    }
}
