//! Creating or updating the JetStream stream at start, so events always land
//! in a file-backed stream that listens on `{subject_prefix}.>` and
//! deduplicates by `Nats-Msg-Id` over `duplicate_window`.
//!
//! What to change is decided by [`plan_stream`], a pure function of the
//! stream's current config; settings an operator tuned (limits, replicas,
//! retention) are kept.

use async_nats::jetstream::context::{CreateStreamErrorKind, GetStreamErrorKind};
use async_nats::jetstream::stream::{Config, StorageType};
use async_nats::jetstream::Context;
use async_nats::jetstream::ErrorCode;

use super::config::NatsSinkConfig;
use super::NatsSinkError;

/// What start-up must do to the stream.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamPlan {
    /// The stream does not exist: create it with this config.
    Create(Config),
    /// The stream exists but lacks our subject or duplicate window: update it to this config.
    Update(Config),
    /// The stream already fits.
    Keep,
}

/// Decides how to bring the stream in line with `config`, or why it cannot be used.
pub fn plan_stream(
    existing: Option<&Config>,
    config: &NatsSinkConfig,
) -> Result<StreamPlan, String> {
    let subject = config.stream_subject();
    let Some(current) = existing else {
        return Ok(StreamPlan::Create(Config {
            name: config.stream.clone(),
            subjects: vec![subject],
            storage: StorageType::File,
            duplicate_window: config.duplicate_window,
            description: Some("voucher-cdc catalog change events".to_string()),
            ..Default::default()
        }));
    };
    if current.storage != StorageType::File {
        return Err(format!(
            "stream `{}` uses memory storage but voucher-cdc needs file storage (the storage type cannot be changed): delete the stream or set sink.nats.stream to another name",
            current.name
        ));
    }
    if current.mirror.is_some() {
        return Err(format!(
            "stream `{}` is a mirror and does not accept publishes: set sink.nats.stream to another name",
            current.name
        ));
    }
    if current.sealed {
        return Err(format!(
            "stream `{}` is sealed and does not accept publishes",
            current.name
        ));
    }
    let mut wanted = current.clone();
    if !wanted.subjects.contains(&subject) {
        wanted.subjects.push(subject);
    }
    wanted.duplicate_window = config.duplicate_window;
    if wanted == *current {
        return Ok(StreamPlan::Keep);
    }
    Ok(StreamPlan::Update(wanted))
}

/// Creates the stream or updates its config; a conflict is reported with its cause.
pub(super) async fn ensure_stream(
    js: &Context,
    config: &NatsSinkConfig,
) -> Result<(), NatsSinkError> {
    let stream_error = |reason: String| NatsSinkError::Stream {
        stream: config.stream.clone(),
        reason,
    };
    let existing = match js.get_stream(&config.stream).await {
        Ok(stream) => Some(stream.cached_info().config.clone()),
        Err(e) => match e.kind() {
            GetStreamErrorKind::JetStream(js_error)
                if js_error.error_code() == ErrorCode::STREAM_NOT_FOUND =>
            {
                None
            }
            _ => return Err(stream_error(format!("cannot read the stream: {e}"))),
        },
    };
    match plan_stream(existing.as_ref(), config).map_err(&stream_error)? {
        StreamPlan::Keep => {
            tracing::debug!(stream = %config.stream, "nats stream config already fits");
            Ok(())
        }
        StreamPlan::Create(wanted) => match js.create_stream(wanted).await {
            Ok(_) => {
                tracing::info!(stream = %config.stream, subject = %config.stream_subject(), "created nats stream");
                Ok(())
            }
            Err(e) => Err(stream_error(
                explain_conflict(js, config, e.kind(), &e.to_string()).await,
            )),
        },
        StreamPlan::Update(wanted) => match js.update_stream(&wanted).await {
            Ok(_) => {
                tracing::info!(stream = %config.stream, subjects = ?wanted.subjects, "updated nats stream config");
                Ok(())
            }
            Err(e) => Err(stream_error(
                explain_conflict(js, config, e.kind(), &e.to_string()).await,
            )),
        },
    }
}

/// Turns a create/update failure into a sentence, naming the overlapping stream when there is one.
async fn explain_conflict(
    js: &Context,
    config: &NatsSinkConfig,
    kind: CreateStreamErrorKind,
    message: &str,
) -> String {
    let subject = config.stream_subject();
    match kind {
        CreateStreamErrorKind::JetStream(e)
            if e.error_code() == ErrorCode::STREAM_SUBJECT_OVERLAP =>
        {
            let owners = match stream_listening_on(js, &subject, &config.stream).await {
                Some(name) => format!("stream `{name}`"),
                None => "another stream".to_string(),
            };
            format!(
                "subjects `{subject}` overlap {owners}: change sink.nats.subject_prefix or remove the subject from the other stream"
            )
        }
        CreateStreamErrorKind::JetStreamUnavailable => {
            "jetstream is not enabled on the server (start nats-server with -js)".to_string()
        }
        _ => format!("cannot create or update the stream: {message}"),
    }
}

async fn stream_listening_on(js: &Context, subject: &str, own: &str) -> Option<String> {
    match js.stream_by_subject(subject).await {
        Ok(name) if name != own => Some(name),
        Ok(_) => None,
        Err(e) => {
            tracing::debug!(error = %e, "cannot look up the nats stream by subject");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn sink_config() -> NatsSinkConfig {
        NatsSinkConfig::default()
    }

    #[test]
    fn a_missing_stream_is_created_with_file_storage_our_subjects_and_window() {
        let StreamPlan::Create(created) = plan_stream(None, &sink_config()).unwrap() else {
            panic!("expected a create plan");
        };
        assert_eq!(created.name, "VOUCHER_CDC");
        assert_eq!(created.subjects, vec!["voucher_cdc.>".to_string()]);
        assert_eq!(created.storage, StorageType::File);
        assert_eq!(created.duplicate_window, Duration::from_secs(600));
    }

    #[test]
    fn a_fitting_stream_is_kept_and_operator_settings_survive_an_update() {
        let config = sink_config();
        let StreamPlan::Create(current) = plan_stream(None, &config).unwrap() else {
            panic!("expected a create plan");
        };
        assert_eq!(plan_stream(Some(&current), &config), Ok(StreamPlan::Keep));

        let tuned = Config {
            max_age: Duration::from_secs(86_400),
            subjects: vec!["other.>".to_string()],
            duplicate_window: Duration::from_secs(60),
            ..current
        };
        let StreamPlan::Update(updated) = plan_stream(Some(&tuned), &config).unwrap() else {
            panic!("expected an update plan");
        };
        assert_eq!(updated.max_age, Duration::from_secs(86_400));
        assert_eq!(
            updated.subjects,
            vec!["other.>".to_string(), "voucher_cdc.>".to_string()]
        );
        assert_eq!(updated.duplicate_window, Duration::from_secs(600));
    }

    #[test]
    fn a_memory_stream_or_a_mirror_is_a_conflict_that_says_what_to_do() {
        let config = sink_config();
        let memory = Config {
            name: "VOUCHER_CDC".to_string(),
            storage: StorageType::Memory,
            ..Default::default()
        };
        let err = plan_stream(Some(&memory), &config).unwrap_err();
        assert!(err.contains("memory storage"), "{err}");
        assert!(err.contains("sink.nats.stream"), "{err}");

        let mirror = Config {
            name: "VOUCHER_CDC".to_string(),
            mirror: Some(Default::default()),
            ..Default::default()
        };
        assert!(plan_stream(Some(&mirror), &config)
            .unwrap_err()
            .contains("mirror"));
    }
}
