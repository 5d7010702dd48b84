//! Publishing a batch until the sink acknowledged every event.
//!
//! Retriable failures are retried (only the failed events) with capped
//! exponential backoff; a fatal one fails the sweep. Under
//! `sink.on_record_error = "dead_letter"` an event the sink can never accept
//! is replaced by its dead letter, which must be acknowledged like any event.
//! What comes back is one [`Delivery`] per event: the evidence
//! [`crate::state::Acked`] requires before anything is committed. Nothing is
//! committed in here.

use std::time::Instant;

use chrono::Utc;
use tracing::warn;

use super::{SweepError, SweepRun};
use crate::config::OnRecordError;
use crate::crashpoint;
use crate::event::{self, Event};
use crate::sinks::SinkError;
use crate::state::{DeadLetter, Delivery};
use crate::telemetry::metric;

/// Retriable sink failures of one batch after which the stream shows the error
/// (the sweep keeps retrying).
const SINK_ATTEMPTS_BEFORE_RECORDING: u32 = 5;

impl SweepRun<'_> {
    /// Publishes frames (no dead letters) until every one is acknowledged.
    pub(super) async fn publish_all(&self, events: &[Event]) -> Result<(), SweepError> {
        self.publish_acks(events, false).await.map(drop)
    }

    /// Publishes a batch of record events; returns one delivery per event.
    pub(super) async fn publish_changes(
        &self,
        events: &[Event],
    ) -> Result<Vec<Delivery>, SweepError> {
        let tolerate = self.sweeper.settings.on_record_error == OnRecordError::DeadLetter;
        self.crash_point(crashpoint::names::BEFORE_PUBLISH);
        let refused = self.publish_acks(events, tolerate).await?;
        let mut deliveries: Vec<Delivery> = vec![Delivery::Acknowledged; events.len()];
        let mut letters = Vec::new();
        let mut refusals = Vec::new();
        for (index, refusal) in refused.into_iter().enumerate() {
            let (Some(error), Some(event)) = (refusal, events.get(index)) else {
                continue;
            };
            let label = error.reason_label();
            if let SinkError::Rejected { reason, limit } = error {
                letters.push(event::dead_letter_event(event, &reason, limit)?);
                refusals.push((index, reason, limit, label));
            }
        }
        if letters.is_empty() {
            return Ok(deliveries);
        }
        // A dead letter the sink refuses too fails the sweep: nothing is committed.
        self.publish_all(&letters).await?;
        let since = Utc::now();
        let stream = self.sweeper.stream;
        for (index, reason, limit, label) in refusals {
            if let Some(event) = events.get(index) {
                warn!(tenant = stream.tenant, resource = %stream.resource,
                    sink = self.sweeper.sink.name(), event_id = %event.id, error = %reason,
                    "sink refused the event for good; published a dead letter instead and moving on");
            }
            metrics::counter!(metric::DEAD_LETTERS, "tenant" => stream.tenant.to_string(),
                "resource" => stream.resource.as_str(), "reason" => label)
            .increment(1);
            if let Some(delivery) = deliveries.get_mut(index) {
                *delivery = Delivery::DeadLettered(DeadLetter {
                    since,
                    reason,
                    limit,
                });
            }
        }
        Ok(deliveries)
    }

    /// Publishes until every event is acknowledged or, with `tolerate_refusals`,
    /// refused for good; returns per event the refusal (None: acknowledged).
    /// A fatal failure, and a refusal unless tolerated, fails the sweep; a
    /// cancel while waiting to retry interrupts it (nothing of the batch is
    /// committed, so stopping there loses nothing).
    async fn publish_acks(
        &self,
        events: &[Event],
        tolerate_refusals: bool,
    ) -> Result<Vec<Option<SinkError>>, SweepError> {
        let sweeper = self.sweeper;
        let settings = &sweeper.settings;
        let mut refused: Vec<Option<SinkError>> = vec![None; events.len()];
        let mut outstanding: Vec<usize> = (0..events.len()).collect();
        let mut backoff = settings.sink_backoff_initial;
        let mut attempt: u32 = 0;
        let mut retried: Vec<Event>;
        while !outstanding.is_empty() {
            // The first attempt publishes the batch as it is; a retry only
            // the events still outstanding.
            let batch: &[Event] = if outstanding.len() == events.len() {
                events
            } else {
                retried = outstanding
                    .iter()
                    .filter_map(|&i| events.get(i).cloned())
                    .collect();
                &retried
            };
            let started = Instant::now();
            let acks =
                match tokio::time::timeout(settings.publish_timeout, sweeper.sink.publish(batch))
                    .await
                {
                    Ok(acks) => acks,
                    Err(_) => vec![
                        Err(SinkError::Retriable(format!(
                            "no acknowledgement within {}",
                            crate::telemetry::human_duration(settings.publish_timeout)
                        )));
                        batch.len()
                    ],
                };
            crate::sinks::metrics::record_publish(sweeper.sink.name(), started.elapsed(), &acks);
            let mut retry = Vec::new();
            let mut last_error = None;
            for (i, (&index, event)) in outstanding.iter().zip(batch).enumerate() {
                match acks.get(i) {
                    Some(Ok(())) => {}
                    Some(Err(e @ SinkError::Rejected { .. })) if tolerate_refusals => {
                        refused[index] = Some(e.clone());
                    }
                    Some(Err(e @ (SinkError::Fatal(_) | SinkError::Rejected { .. }))) => {
                        return Err(SweepError::SinkRejected {
                            sink: sweeper.sink.name().to_string(),
                            event_id: event.id.clone(),
                            message: e.to_string(),
                        });
                    }
                    Some(Err(e @ SinkError::Retriable(_))) => {
                        last_error = Some(e.to_string());
                        retry.push(index);
                    }
                    None => {
                        last_error = Some("sink returned fewer acks than events".to_string());
                        retry.push(index);
                    }
                }
            }
            if retry.is_empty() {
                return Ok(refused);
            }
            attempt += 1;
            let stream = sweeper.stream;
            warn!(tenant = stream.tenant, resource = %stream.resource,
                sink = sweeper.sink.name(), failed = retry.len(), attempt,
                error = last_error.as_deref().unwrap_or(""),
                "sink did not acknowledge every event; retrying without committing");
            if attempt == SINK_ATTEMPTS_BEFORE_RECORDING {
                // Still retrying, but visible: status, /readyz reasons, metrics.
                self.record_sink_stall(retry.len(), attempt, last_error.as_deref());
            }
            let jitter = rand::random::<f64>() * 0.2 + 0.9;
            tokio::select! {
                _ = tokio::time::sleep(backoff.mul_f64(jitter)) => {}
                // Nothing of this batch is committed: stopping here loses nothing.
                _ = self.cancel.cancelled() => return Err(SweepError::Interrupted),
            }
            backoff = (backoff * 2).min(settings.sink_backoff_max);
            outstanding = retry;
        }
        Ok(refused)
    }

    /// Records a sink that keeps failing retriably as the stream's last error.
    fn record_sink_stall(&self, failed: usize, attempts: u32, error: Option<&str>) {
        let sweeper = self.sweeper;
        let stream = sweeper.stream;
        metrics::counter!(metric::SINK_STALLS, "tenant" => stream.tenant.to_string(),
            "resource" => stream.resource.as_str(), "sink" => sweeper.sink.name().to_string())
        .increment(1);
        let message = format!(
            "sink {} has not acknowledged {failed} event(s) after {attempts} attempts: {}; \
             still retrying, nothing committed meanwhile",
            sweeper.sink.name(),
            error.unwrap_or("no error given")
        );
        if let Err(e) = sweeper.ledger().record_error(&message, Utc::now()) {
            warn!(tenant = stream.tenant, resource = %stream.resource, error = %e,
                "cannot record the sink failure on the stream");
        }
    }
}
