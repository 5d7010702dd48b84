//! Sweep now (incremental or full) and recheck a parked stream now, instead
//! of waiting for the next interval: the stream's task is woken (under the
//! adaptive planner it asks for its turn at once). Only a running daemon
//! sweeps; a paused stream is refused (resume it first).

use serde::{Deserialize, Serialize};

use super::replay::unexpected;
use super::{ControlError, Runtime};
use crate::scheduler::{Action, Answer};
use crate::state::SweepKind;
use crate::stream::{Resource, StreamKey, TenantId};

/// The answer of `sweep` / `recheck` (CLI and `POST /v1/tenants/{tenant}/sweep|recheck`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SweepResponse {
    /// The tenant.
    pub tenant: TenantId,
    /// `incremental`, `full`, or `due` (whichever is due; a recheck).
    pub kind: String,
    /// The streams woken.
    pub resources: Vec<Resource>,
}

/// Parses the `kind` parameter: `incremental` or `full`.
pub fn parse_kind(text: &str) -> Result<SweepKind, ControlError> {
    match text.trim() {
        "incremental" => Ok(SweepKind::Incremental),
        "full" => Ok(SweepKind::Full),
        other => Err(ControlError::invalid(
            "kind",
            format!("unknown sweep kind `{other}`: valid options are incremental, full"),
        )),
    }
}

/// Wakes each of `targets` to sweep now as `kind` (None: whichever is due).
/// With `recheck`, only the parked ones among them are woken (refused when
/// none is). Refused, before any stream is woken, when one of them is paused.
pub async fn sweep_now(
    runtime: Runtime<'_>,
    tenant: TenantId,
    targets: &[StreamKey],
    kind: Option<SweepKind>,
    recheck: bool,
) -> Result<SweepResponse, ControlError> {
    let mut woken = Vec::with_capacity(targets.len());
    for key in targets {
        let state = runtime.store().load_stream(*key)?;
        if state.paused.is_some() {
            return Err(ControlError::Refused(format!(
                "stream {key} is paused: resume it first"
            )));
        }
        if !recheck || state.parked.is_some() {
            woken.push(*key);
        }
    }
    if woken.is_empty() {
        let named: Vec<String> = targets.iter().map(|k| k.to_string()).collect();
        return Err(ControlError::Refused(format!(
            "no parked stream to recheck among {}: sweep them instead",
            named.join(", ")
        )));
    }
    let mut resources = Vec::with_capacity(woken.len());
    for key in &woken {
        let action = Action::SweepNow {
            kind,
            only_parked: recheck,
        };
        let answer = runtime.act(*key, action).await?;
        if answer != Answer::Woken {
            return Err(unexpected(*key, &answer));
        }
        resources.push(key.resource);
    }
    Ok(SweepResponse {
        tenant,
        kind: kind.map_or("due", SweepKind::as_str).to_string(),
        resources,
    })
}
