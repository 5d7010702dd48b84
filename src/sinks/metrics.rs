//! Publish metrics recorded the same way for every sink, so dashboards can
//! compare sinks: batch latency, failures by kind, and whether the sink is up.
//! The sweep records each publish call (it sees every sink, and its own
//! timeouts); sinks record only their health.

use std::time::Duration;

use crate::sinks::Ack;
use crate::telemetry::metric;

/// Records the latency of one publish call (until its last ack) and its
/// failed events by kind.
pub fn record_publish(sink: &str, elapsed: Duration, acks: &[Ack]) {
    metrics::histogram!(metric::PUBLISH_LATENCY, "sink" => sink.to_string())
        .record(elapsed.as_secs_f64());
    let retriable = acks
        .iter()
        .filter(|a| matches!(a, Err(e) if e.is_retriable()))
        .count() as u64;
    let fatal = acks
        .iter()
        .filter(|a| matches!(a, Err(e) if !e.is_retriable() && !e.is_rejected()))
        .count() as u64;
    let rejected = acks
        .iter()
        .filter(|a| matches!(a, Err(e) if e.is_rejected()))
        .count() as u64;
    if rejected > 0 {
        metrics::counter!(metric::PUBLISH_FAILURES, "sink" => sink.to_string(), "kind" => "rejected")
            .increment(rejected);
    }
    if retriable > 0 {
        metrics::counter!(metric::PUBLISH_FAILURES, "sink" => sink.to_string(), "kind" => "retriable")
            .increment(retriable);
    }
    if fatal > 0 {
        metrics::counter!(metric::PUBLISH_FAILURES, "sink" => sink.to_string(), "kind" => "fatal")
            .increment(fatal);
    }
}

/// Sets the `sink_up` gauge of `sink`.
pub fn record_sink_up(sink: &str, up: bool) {
    metrics::gauge!(metric::SINK_UP, "sink" => sink.to_string()).set(if up { 1.0 } else { 0.0 });
}
