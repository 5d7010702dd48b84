//! Where events go: the `Sink` trait every backend implements, `[sink]` as
//! one choice of backend that builds its own sink ([`config`]), and the
//! classification of publish failures into retriable, fatal (sink-wide) and
//! rejected (this one event can never be accepted).
//!
//! A sink acknowledges each event on its own; the sweep commits a record's
//! content hash only after its event was acknowledged (DESIGN.md, invariant).

pub mod binding;
pub mod config;
pub mod file;
pub mod kafka;
pub mod metrics;
pub mod nats;
pub mod stdout;
pub mod testing;

use async_trait::async_trait;
use tokio_util::sync::CancellationToken;

pub use self::config::{SinkBackendConfig, SinkBuildError, SinkConfig, SinkKind};
use crate::event::Event;

/// Why an event (or the sink as a whole) failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SinkError {
    /// A transient failure (broker down, timeout, queue full for too long): retry later.
    #[error("{0}")]
    Retriable(String),
    /// A permanent, sink-wide failure (bad config, authorization): retrying will not help.
    #[error("{0}")]
    Fatal(String),
    /// This one event can never be accepted (too large for the broker, or
    /// refused for that message alone); other events are unaffected.
    #[error("{reason}")]
    Rejected {
        /// The broker's or the sink's reason, one line.
        reason: String,
        /// The broker limit the event exceeded, in bytes, when known.
        limit: Option<u64>,
    },
}

impl SinkError {
    /// True when the same publish may succeed later.
    pub fn is_retriable(&self) -> bool {
        matches!(self, SinkError::Retriable(_))
    }

    /// True when only this event failed and will fail again (see [`SinkError::Rejected`]).
    pub fn is_rejected(&self) -> bool {
        matches!(self, SinkError::Rejected { .. })
    }

    /// A short label of the reason for metrics: `too_large` or `rejected`.
    pub fn reason_label(&self) -> &'static str {
        match self {
            SinkError::Rejected { limit: Some(_), .. } => "too_large",
            SinkError::Rejected { .. } => "rejected",
            SinkError::Fatal(_) => "fatal",
            SinkError::Retriable(_) => "retriable",
        }
    }
}

/// The outcome of publishing one event: `Ok` means the sink acknowledged it durably.
pub type Ack = Result<(), SinkError>;

/// A destination for events.
#[async_trait]
pub trait Sink: Send + Sync {
    /// Short name used in logs, metrics and status (`nats`, `kafka`, `file`, ...).
    fn name(&self) -> &str;

    /// Publishes a batch and returns one ack result per event, in order.
    ///
    /// Implementations keep many events in flight but must await every
    /// acknowledgement before returning; an event whose result is `Ok` is durable.
    async fn publish(&self, events: &[Event]) -> Vec<Ack>;

    /// Checks that the sink can currently accept events.
    async fn health(&self) -> Result<(), SinkError> {
        Ok(())
    }

    /// Flushes buffered data; called at the end of a sweep and on shutdown.
    async fn flush(&self) -> Result<(), SinkError> {
        Ok(())
    }

    /// A token the sink cancels once it can never deliver again (stdout's
    /// reader went away); the daemon then stops. `None`: the sink never ends.
    fn ended(&self) -> Option<CancellationToken> {
        None
    }
}
