//! `[sink]`: which backend receives the events. The file keeps the layout
//! DESIGN.md fixes (`kind = "nats"` beside one table per backend, which serde
//! cannot express as a tagged enum), so it is read into [`RawSinkConfig`] and
//! checked once into a [`SinkConfig`]: one `kind`-tagged choice whose variant
//! builds its own sink. Nothing downstream looks at `kind` again.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::file::FileSinkConfig;
use super::kafka::{KafkaConfigError, KafkaSinkConfig, KafkaSinkError};
use super::nats::config::NatsConfigError;
use super::nats::{NatsSinkConfig, NatsSinkError};
use super::stdout::StdoutSink;
use super::{Sink, SinkError};
use crate::secret::SecretFileError;
use crate::stream::StreamKey;

/// Which sink publishes events (`sink.kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SinkKind {
    /// NATS JetStream (`[sink.nats]`).
    #[default]
    Nats,
    /// Kafka (`[sink.kafka]`).
    Kafka,
    /// One JSON event per line on stdout.
    Stdout,
    /// One JSON event per line appended to a file (`[sink.file]`).
    File,
}

impl SinkKind {
    /// The name written in config.
    pub fn as_str(self) -> &'static str {
        match self {
            SinkKind::Nats => "nats",
            SinkKind::Kafka => "kafka",
            SinkKind::Stdout => "stdout",
            SinkKind::File => "file",
        }
    }
}

/// `sink.on_record_error`: what happens to an event the sink can never
/// accept (too large for the broker, refused for that message alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnRecordError {
    /// Publish a dead letter in its place, commit the record as dead-lettered, go on.
    #[default]
    DeadLetter,
    /// Fail the sweep (the stream retries with backoff and does not move on).
    Fail,
}

/// `[sink]` as written: the kind and each backend's table. A table of a
/// backend `kind` does not pick must still be well-formed, and is kept so
/// `check-config` shows it, but is not checked further.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSinkConfig {
    /// Which backend: nats | kafka | stdout | file.
    #[serde(default)]
    pub kind: SinkKind,
    /// NATS JetStream settings.
    #[serde(default)]
    pub nats: Option<NatsSinkConfig>,
    /// Kafka settings.
    #[serde(default)]
    pub kafka: Option<KafkaSinkConfig>,
    /// File sink settings.
    #[serde(default)]
    pub file: Option<FileSinkConfig>,
    /// What an event the sink can never accept does: `dead_letter` or `fail`.
    #[serde(default)]
    pub on_record_error: OnRecordError,
}

/// A `[sink]` that cannot work, as one line naming its key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SinkConfigError {
    /// `kind = "kafka"` without a `[sink.kafka]` table (Kafka has no default brokers).
    #[error("sink.kafka.brokers: required when sink.kind = \"kafka\"")]
    KafkaBrokersRequired,
    /// A `[sink.nats]` value is invalid.
    #[error(transparent)]
    Nats(#[from] NatsConfigError),
    /// A `[sink.kafka]` value is invalid.
    #[error(transparent)]
    Kafka(#[from] KafkaConfigError),
    /// A secret file of the sink cannot be used.
    #[error(transparent)]
    Secret(#[from] SecretFileError),
}

impl RawSinkConfig {
    /// The backend `kind` picks, with its settings checked (a missing NATS
    /// or file table means that backend's defaults).
    pub fn check(&self) -> Result<SinkConfig, SinkConfigError> {
        let backend = match self.kind {
            SinkKind::Nats => {
                let nats = self.nats.clone().unwrap_or_default();
                nats.validate()?;
                SinkBackendConfig::Nats(nats.with_secrets_read()?)
            }
            SinkKind::Kafka => {
                let kafka = self
                    .kafka
                    .clone()
                    .ok_or(SinkConfigError::KafkaBrokersRequired)?;
                kafka.validate()?;
                SinkBackendConfig::Kafka(kafka.with_secrets_read()?)
            }
            SinkKind::Stdout => SinkBackendConfig::Stdout,
            SinkKind::File => SinkBackendConfig::File(self.file.clone().unwrap_or_default()),
        };
        Ok(SinkConfig {
            backend,
            on_record_error: self.on_record_error,
        })
    }

    /// A copy for `check-config`: the chosen backend's defaults shown (where
    /// does the file sink write?), every secret redacted.
    pub fn redacted(&self) -> Self {
        let mut copy = self.clone();
        match copy.kind {
            SinkKind::Nats => {
                copy.nats.get_or_insert_with(NatsSinkConfig::default);
            }
            SinkKind::File => {
                copy.file.get_or_insert_with(FileSinkConfig::default);
            }
            SinkKind::Kafka | SinkKind::Stdout => {}
        }
        copy.nats = copy.nats.map(|n| n.redacted());
        copy.kafka = copy.kafka.map(|k| k.redacted());
        copy
    }
}

/// `[sink]` as the daemon uses it: the chosen backend and the record-error policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SinkConfig {
    /// The backend `sink.kind` picks, with its settings.
    pub backend: SinkBackendConfig,
    /// What an event the sink can never accept does.
    pub on_record_error: OnRecordError,
}

/// One backend and its settings; each variant builds its own sink.
#[derive(Debug, Clone, PartialEq, Eq)]
// Built once at start and cloned rarely: a box would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum SinkBackendConfig {
    /// NATS JetStream.
    Nats(NatsSinkConfig),
    /// Kafka.
    Kafka(KafkaSinkConfig),
    /// Standard output.
    Stdout,
    /// A JSON-lines file.
    File(FileSinkConfig),
}

/// Why a sink could not start; each variant keeps its backend's error.
#[derive(Debug, thiserror::Error)]
pub enum SinkBuildError {
    /// The NATS sink could not connect or set up its stream.
    #[error(transparent)]
    Nats(#[from] NatsSinkError),
    /// The Kafka sink could not create its client or topics.
    #[error(transparent)]
    Kafka(#[from] KafkaSinkError),
    /// The file sink could not open its file.
    #[error(transparent)]
    File(SinkError),
}

impl SinkConfig {
    /// The configured `sink.kind`.
    pub fn kind(&self) -> SinkKind {
        self.backend.kind()
    }

    /// Builds the configured sink; `streams` are the streams it will carry
    /// (Kafka creates their topics with `create_topics`).
    pub async fn build(&self, streams: &[StreamKey]) -> Result<Arc<dyn Sink>, SinkBuildError> {
        self.backend.build(streams).await
    }
}

impl SinkBackendConfig {
    /// The `sink.kind` that picks this backend.
    pub fn kind(&self) -> SinkKind {
        match self {
            SinkBackendConfig::Nats(_) => SinkKind::Nats,
            SinkBackendConfig::Kafka(_) => SinkKind::Kafka,
            SinkBackendConfig::Stdout => SinkKind::Stdout,
            SinkBackendConfig::File(_) => SinkKind::File,
        }
    }

    /// Builds this backend's sink.
    pub async fn build(&self, streams: &[StreamKey]) -> Result<Arc<dyn Sink>, SinkBuildError> {
        let sink: Arc<dyn Sink> = match self {
            SinkBackendConfig::Nats(nats) => Arc::new(nats.build().await?),
            SinkBackendConfig::Kafka(kafka) => Arc::new(kafka.build(streams).await?),
            SinkBackendConfig::Stdout => Arc::new(StdoutSink::new()),
            SinkBackendConfig::File(file) => Arc::new(file.build().map_err(SinkBuildError::File)?),
        };
        Ok(sink)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(kind: SinkKind) -> RawSinkConfig {
        RawSinkConfig {
            kind,
            ..RawSinkConfig::default()
        }
    }

    #[test]
    fn the_kind_picks_one_backend_and_missing_tables_mean_its_defaults() {
        let nats = raw(SinkKind::Nats).check().unwrap();
        assert_eq!(
            nats.backend,
            SinkBackendConfig::Nats(NatsSinkConfig::default())
        );
        let file = raw(SinkKind::File).check().unwrap();
        assert_eq!(
            file.backend,
            SinkBackendConfig::File(FileSinkConfig::default())
        );
        assert_eq!(
            raw(SinkKind::Stdout).check().unwrap().kind(),
            SinkKind::Stdout
        );
    }

    #[test]
    fn kafka_needs_its_table_and_only_the_chosen_backend_is_checked() {
        assert_eq!(
            raw(SinkKind::Kafka).check().unwrap_err().to_string(),
            "sink.kafka.brokers: required when sink.kind = \"kafka\""
        );
        let unused_bad_kafka = RawSinkConfig {
            kafka: Some(KafkaSinkConfig::new("")),
            ..raw(SinkKind::Stdout)
        };
        assert!(unused_bad_kafka.check().is_ok());
        let bad_kafka = RawSinkConfig {
            kind: SinkKind::Kafka,
            ..unused_bad_kafka
        };
        assert!(matches!(bad_kafka.check(), Err(SinkConfigError::Kafka(_))));
    }
}
