//! Publish metrics every sink records the same way, so dashboards can compare
//! sinks: batch latency, failures by kind, and whether the sink is up.

use std::time::Instant;

use crate::sinks::Ack;
use crate::telemetry::metric;

/// Records the latency of one published batch and its failed events by kind,
/// and logs the first failure of a batch that had any.
pub fn record_publish(sink: &'static str, started: Instant, acks: &[Ack]) {
    metrics::histogram!(metric::PUBLISH_LATENCY, "sink" => sink)
        .record(started.elapsed().as_secs_f64());
    let (mut retriable, mut fatal) = (0u64, 0u64);
    let mut first_error = None;
    for ack in acks {
        let Err(e) = ack else { continue };
        first_error.get_or_insert(e);
        if e.is_retriable() {
            retriable += 1;
        } else {
            fatal += 1;
        }
    }
    if let Some(e) = first_error {
        let failed = retriable + fatal;
        tracing::warn!(sink, failed, total = acks.len(), error = %e, "publish failed");
    }
    if retriable > 0 {
        metrics::counter!(metric::PUBLISH_FAILURES, "sink" => sink, "kind" => "retriable")
            .increment(retriable);
    }
    if fatal > 0 {
        metrics::counter!(metric::PUBLISH_FAILURES, "sink" => sink, "kind" => "fatal")
            .increment(fatal);
    }
}

/// Sets the `sink_up` gauge of `sink`.
pub fn record_sink_up(sink: &'static str, up: bool) {
    metrics::gauge!(metric::SINK_UP, "sink" => sink).set(if up { 1.0 } else { 0.0 });
}
