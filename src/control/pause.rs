//! Pause and resume: a paused stream is not swept and costs no upstream
//! request until resumed; the pause is stored in the stream's state, so it
//! survives restarts, and resume goes on from the watermark.

use serde::{Deserialize, Serialize};

use super::replay::unexpected;
use super::{ControlError, Runtime};
use crate::scheduler::{Action, Answer};
use crate::state::RequestedBy;
use crate::stream::{Resource, StreamKey, TenantId};

/// One stream a pause or resume named.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PauseChange {
    /// The resource.
    pub resource: Resource,
    /// True when the stream is paused now.
    pub paused: bool,
    /// False when it was so already.
    pub changed: bool,
}

/// The answer of `pause` / `resume` (CLI and `POST /v1/tenants/{tenant}/pause|resume`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PauseResponse {
    /// The tenant.
    pub tenant: TenantId,
    /// One entry per stream named.
    pub streams: Vec<PauseChange>,
}

/// Pauses (`pause == true`) or resumes each of `targets` of `tenant`.
pub async fn set_paused(
    runtime: Runtime<'_>,
    tenant: TenantId,
    targets: &[StreamKey],
    pause: bool,
    by: RequestedBy,
) -> Result<PauseResponse, ControlError> {
    let mut streams = Vec::with_capacity(targets.len());
    for key in targets {
        let action = if pause {
            Action::Pause { by }
        } else {
            Action::Resume
        };
        let answer = runtime.act(*key, action).await?;
        let Answer::Changed(changed) = answer else {
            return Err(unexpected(*key, &answer));
        };
        streams.push(PauseChange {
            resource: key.resource,
            paused: pause,
            changed,
        });
    }
    Ok(PauseResponse { tenant, streams })
}
