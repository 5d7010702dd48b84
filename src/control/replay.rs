//! Replays: schedule one for a tenant's streams, list them with their
//! progress, and cancel one (the stream goes back to its watermark from
//! before the replay, and a `replay.cancelled` frame closes what
//! `replay.started` opened).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::{ControlError, Runtime};
use crate::scheduler::{Action, Answer};
use crate::state::{RequestedBy, StateStore};
use crate::stream::{Resource, StreamKey, TenantId};

/// One scheduled replay.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduledReplay {
    /// The replayed resource.
    pub resource: Resource,
    /// The replay id every event of the replay carries.
    pub replay_id: String,
    /// Where the replay restarts from (None = everything).
    pub since: Option<DateTime<Utc>>,
}

/// `POST /v1/tenants/{tenant}/replay` answer (202) and what `replay` prints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplayResponse {
    /// The tenant.
    pub tenant: TenantId,
    /// One entry per replayed stream.
    pub replays: Vec<ScheduledReplay>,
}

/// Schedules a replay of each of `targets` (all of `tenant`); the streams
/// sweep it at once on a daemon, at the next start otherwise.
pub async fn schedule(
    runtime: Runtime<'_>,
    tenant: TenantId,
    targets: &[StreamKey],
    since: Option<DateTime<Utc>>,
    by: RequestedBy,
) -> Result<ReplayResponse, ControlError> {
    let mut replays = Vec::with_capacity(targets.len());
    for key in targets {
        let answer = runtime.act(*key, Action::Replay { since, by }).await?;
        let Answer::Replay(replay_id) = answer else {
            return Err(unexpected(*key, &answer));
        };
        replays.push(ScheduledReplay {
            resource: key.resource,
            replay_id,
            since,
        });
    }
    Ok(ReplayResponse { tenant, replays })
}

/// A stream task answered with the wrong kind of answer (a bug).
pub(super) fn unexpected(key: StreamKey, answer: &Answer) -> ControlError {
    ControlError::Refused(format!(
        "stream {key} gave an unexpected answer: {answer:?}"
    ))
}

/// Where a replay stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReplayPhase {
    /// Scheduled; its first sweep has not begun.
    Scheduled,
    /// Its sweeps began (it resumes after a stop) and it has not completed.
    Running,
    /// Completed: every record was emitted and `replay.completed` published.
    Completed,
    /// Cancelled by an operator.
    Cancelled,
}

/// One replay as `replays` and `GET /v1/replays` show it (each stream keeps its latest).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplayStatus {
    /// The tenant.
    pub tenant: TenantId,
    /// The resource.
    pub resource: Resource,
    /// The replay id.
    pub replay_id: String,
    /// Where it stands.
    pub phase: ReplayPhase,
    /// Its `--since` (None: everything).
    pub since: Option<DateTime<Utc>>,
    /// When it was requested.
    pub requested_at: DateTime<Utc>,
    /// Who asked: `cli` (on the store) or `api`; None for a replay recorded before this was kept.
    pub requested_by: Option<RequestedBy>,
    /// Snapshots it emitted so far: live, page by page, while it runs.
    pub records: u64,
    /// When it was cancelled.
    pub cancelled_at: Option<DateTime<Utc>>,
}

/// The latest replay of each of `streams`, in stream order.
pub fn list(
    store: &dyn StateStore,
    streams: &[StreamKey],
) -> Result<Vec<ReplayStatus>, ControlError> {
    let mut keys = streams.to_vec();
    keys.sort();
    let mut out = Vec::new();
    for key in keys {
        let Some(replay) = store.load_stream(key)?.replay else {
            continue;
        };
        let phase = if replay.cancelled_at.is_some() {
            ReplayPhase::Cancelled
        } else if !replay.pending {
            ReplayPhase::Completed
        } else if replay.epoch.is_some() {
            ReplayPhase::Running
        } else {
            ReplayPhase::Scheduled
        };
        let records = match replay.epoch.filter(|_| phase == ReplayPhase::Running) {
            // Every record a replay lists is emitted and committed with its
            // epoch, page by page: those are its snapshots so far, across runs.
            Some(epoch) => {
                let behind = store.unseen_records(key, epoch)?.len() as u64;
                let passed = store.record_count(key)?.saturating_sub(behind);
                passed.max(replay.records)
            }
            None => replay.records,
        };
        out.push(ReplayStatus {
            tenant: key.tenant,
            resource: key.resource,
            replay_id: replay.id,
            phase,
            since: replay.since,
            requested_at: replay.requested_at,
            requested_by: replay.requested_by,
            records,
            cancelled_at: replay.cancelled_at,
        });
    }
    Ok(out)
}

/// Cancels the pending replay `id` of whichever of `streams` runs it; returns it as cancelled.
pub async fn cancel(
    runtime: Runtime<'_>,
    store: &dyn StateStore,
    streams: &[StreamKey],
    id: &str,
) -> Result<ReplayStatus, ControlError> {
    let id = id.trim().to_ascii_lowercase();
    let replays = list(store, streams)?;
    let Some(found) = replays.iter().find(|r| r.replay_id == id) else {
        return Err(ControlError::NotFound(format!(
            "no replay {id} on this daemon's streams: `voucher-cdc replays` lists them"
        )));
    };
    if matches!(found.phase, ReplayPhase::Completed | ReplayPhase::Cancelled) {
        return Err(ControlError::Refused(format!(
            "replay {id} of stream {}/{} is {} already: only a pending replay can be cancelled",
            found.tenant,
            found.resource,
            serde_json::to_value(found.phase)
                .ok()
                .and_then(|v| v.as_str().map(String::from))
                .unwrap_or_default()
        )));
    }
    let key = StreamKey::new(found.tenant, found.resource);
    let answer = runtime
        .act(key, Action::CancelReplay { id: id.clone() })
        .await?;
    let Answer::Cancelled(_) = answer else {
        return Err(unexpected(key, &answer));
    };
    list(store, &[key])?
        .into_iter()
        .next()
        .ok_or_else(|| ControlError::NotFound(format!("replay {id} vanished from stream {key}")))
}
