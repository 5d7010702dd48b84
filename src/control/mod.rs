//! The operator's use cases, one module each: status, replay, pause and
//! resume, sweep now, and state export, import and reset. The CLI (`crate::cli`)
//! and the admin API (`crate::admin`) only translate arguments and HTTP into
//! these calls and their answers back, so a rule such as which streams a
//! `--tenant`/`--resource` pair names is written once, here.
//!
//! A use case reaches the streams through a [`Runtime`]: the stream tasks of
//! a running daemon (each task is its stream's only writer, so requests go
//! through it), or the state store opened directly when no daemon holds it.

pub mod pause;
pub mod replay;
pub mod state_file;
pub mod status;
pub mod sweep;

use std::collections::HashMap;

use crate::scheduler::{Action, Answer, RequestError, StreamHandle};
use crate::state::{StateError, StateStore, StreamLedger};
use crate::stream::{Resource, StreamKey, TenantId};

/// Why a use case was not carried out; every message is one line.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The tenant is not one this process streams.
    #[error(
        "tenant `{tenant}` is not streamed by this daemon: configured tenants are {configured}"
    )]
    UnknownTenant {
        /// The tenant as given.
        tenant: String,
        /// The configured tenants, comma-separated (`none` when there are none).
        configured: String,
    },
    /// A parameter's value is not acceptable.
    #[error("{field}: {problem}")]
    Invalid {
        /// The parameter (`resource`, `since`, `kind`, ...).
        field: String,
        /// What is wrong with it.
        problem: String,
    },
    /// The request does not fit the stream's state (paused, not parked, a replay not pending, ...).
    #[error("{0}")]
    Refused(String),
    /// The named thing (a replay id) does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The daemon is stopping; the stream's task is gone.
    #[error("{0}")]
    Unavailable(String),
    /// Input (a state export) cannot be read or output cannot be written.
    #[error("{0}")]
    Unreadable(String),
    /// The state store failed.
    #[error(transparent)]
    State(#[from] StateError),
}

impl ControlError {
    fn invalid(field: &str, problem: impl Into<String>) -> Self {
        ControlError::Invalid {
            field: field.to_string(),
            problem: problem.into(),
        }
    }
}

impl From<RequestError> for ControlError {
    fn from(e: RequestError) -> Self {
        match e {
            RequestError::Stopped(_) => ControlError::Unavailable(e.to_string()),
            RequestError::Refused(reason) => ControlError::Refused(reason),
            RequestError::State(e) => ControlError::State(e),
        }
    }
}

/// How a use case reaches the streams.
#[derive(Clone, Copy)]
pub enum Runtime<'a> {
    /// A running daemon's stream tasks (requests apply between two pages),
    /// and the store it holds (read-only here).
    Daemon(&'a HashMap<StreamKey, StreamHandle>, &'a dyn StateStore),
    /// The state store, opened directly: no daemon holds it.
    Store(&'a dyn StateStore),
}

impl Runtime<'_> {
    /// The state store, to read from.
    pub fn store(&self) -> &dyn StateStore {
        match self {
            Runtime::Daemon(_, store) | Runtime::Store(store) => *store,
        }
    }

    /// Carries out `action` on `key`: through the stream's task on a daemon,
    /// on the stream's ledger in the store otherwise.
    pub async fn act(&self, key: StreamKey, action: Action) -> Result<Answer, ControlError> {
        match self {
            Runtime::Daemon(handles, _) => {
                let handle = handles.get(&key).ok_or_else(|| {
                    ControlError::Unavailable(format!("stream {key} is not running"))
                })?;
                Ok(handle.request(action).await?)
            }
            Runtime::Store(store) => offline(*store, key, action),
        }
    }
}

/// `action` applied to the store directly (no daemon: no sweep can run now).
fn offline(store: &dyn StateStore, key: StreamKey, action: Action) -> Result<Answer, ControlError> {
    let ledger = StreamLedger::new(store, key);
    let now = chrono::Utc::now();
    match action {
        Action::Replay { since, by } => Ok(Answer::Replay(ledger.schedule_replay(since, by, now)?)),
        Action::Pause { by } => Ok(Answer::Changed(ledger.pause(by, now)?)),
        Action::Resume => Ok(Answer::Changed(ledger.resume()?)),
        Action::SweepNow { .. } => Err(ControlError::Refused(
            "no daemon holds the state store, so nothing sweeps: start one, or `voucher-cdc run --once` sweeps every stream now".to_string(),
        )),
        Action::CancelReplay { id } => {
            let state = ledger.state()?;
            if state
                .replay
                .as_ref()
                .is_some_and(|r| r.pending && r.id == id && r.epoch.is_some())
            {
                // Its `replay.started` went out; only a daemon has the sink to close it.
                return Err(ControlError::Refused(format!(
                    "replay {id} of stream {key} has started: cancel it while a daemon runs, so its replay.cancelled frame reaches the sink"
                )));
            }
            match ledger.cancel_replay(&id, now)? {
                Some(replay) => Ok(Answer::Cancelled(Box::new(replay))),
                None => Err(ControlError::NotFound(format!(
                    "replay {id} is not pending on stream {key}"
                ))),
            }
        }
    }
}

/// The streams a `tenant` (and `resource`) names among `streams`: every
/// resource of the tenant, or the one named. The one place that rule lives.
pub fn resolve_targets(
    streams: &[StreamKey],
    tenant: &str,
    resource: Option<&str>,
) -> Result<Vec<StreamKey>, ControlError> {
    let unknown = || {
        let mut tenants: Vec<TenantId> = streams.iter().map(|k| k.tenant).collect();
        tenants.sort_unstable();
        tenants.dedup();
        ControlError::UnknownTenant {
            tenant: tenant.to_string(),
            configured: if tenants.is_empty() {
                "none".to_string()
            } else {
                tenants
                    .iter()
                    .map(|t| t.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        }
    };
    let tenant_id: TenantId = tenant.trim().parse().map_err(|_| unknown())?;
    let tenant_streams: Vec<StreamKey> = streams
        .iter()
        .copied()
        .filter(|k| k.tenant == tenant_id)
        .collect();
    if tenant_streams.is_empty() {
        return Err(unknown());
    }
    let Some(name) = resource else {
        return Ok(tenant_streams);
    };
    let resource: Resource = name.parse().map_err(|e: crate::stream::UnknownResource| {
        ControlError::invalid("resource", e.to_string())
    })?;
    let key = StreamKey::new(tenant_id, resource);
    if tenant_streams.contains(&key) {
        return Ok(vec![key]);
    }
    let streamed: Vec<&str> = tenant_streams.iter().map(|k| k.resource.as_str()).collect();
    Err(ControlError::invalid(
        "resource",
        format!(
            "tenant {tenant_id} does not stream {resource}: configured resources are {}",
            streamed.join(", ")
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_names_all_its_streams_and_a_resource_one_of_them() {
        let streams = [
            StreamKey::new(1, Resource::Vouchers),
            StreamKey::new(1, Resource::Categories),
            StreamKey::new(2, Resource::Vouchers),
        ];
        assert_eq!(resolve_targets(&streams, "1", None).unwrap().len(), 2);
        assert_eq!(
            resolve_targets(&streams, "2", Some("vouchers")).unwrap(),
            vec![StreamKey::new(2, Resource::Vouchers)]
        );
        assert_eq!(
            resolve_targets(&streams, "9", None)
                .unwrap_err()
                .to_string(),
            "tenant `9` is not streamed by this daemon: configured tenants are 1, 2"
        );
        assert_eq!(
            resolve_targets(&streams, "2", Some("categories"))
                .unwrap_err()
                .to_string(),
            "resource: tenant 2 does not stream categories: configured resources are vouchers"
        );
    }
}
