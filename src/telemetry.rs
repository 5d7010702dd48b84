//! Logging and metrics set-up, and the one list of metric names every module
//! records under, so dashboards and code never drift apart.

use std::io::IsTerminal;

use tracing_subscriber::{fmt, EnvFilter};

/// Metric names (Prometheus, all prefixed `voucher_cdc_`).
pub mod metric {
    /// Upstream HTTP requests by `tenant`, `resource`, `status` (HTTP code or `error`).
    pub const UPSTREAM_REQUESTS: &str = "voucher_cdc_upstream_requests_total";
    /// 429 responses received, by `token_id` (a non-secret token fingerprint).
    pub const UPSTREAM_RATE_LIMITED: &str = "voucher_cdc_upstream_rate_limited_total";
    /// Upstream retries by `tenant`, `resource`, `reason` (`429`, `5xx`, `timeout`, `connect`, `body`).
    pub const UPSTREAM_RETRIES: &str = "voucher_cdc_upstream_retries_total";
    /// Pages listed by `tenant`, `resource`.
    pub const PAGES: &str = "voucher_cdc_pages_total";
    /// Records listed by `tenant`, `resource`.
    pub const RECORDS_SEEN: &str = "voucher_cdc_records_seen_total";
    /// Records skipped for lack of a usable id, by `tenant`, `resource`.
    pub const RECORDS_SKIPPED: &str = "voucher_cdc_records_skipped_total";
    /// Events acknowledged by the sink, by `tenant`, `resource`, `type`, `op`.
    pub const EVENTS_PUBLISHED: &str = "voucher_cdc_events_published_total";
    /// Seconds from publishing a batch to its last ack, by `sink` (histogram).
    pub const PUBLISH_LATENCY: &str = "voucher_cdc_publish_latency_seconds";
    /// Events the sink failed to acknowledge, by `sink`, `kind` (`retriable`,
    /// `fatal`, `rejected`: this one event can never be accepted).
    pub const PUBLISH_FAILURES: &str = "voucher_cdc_publish_failures_total";
    /// Now minus the stream's watermark, by `tenant`, `resource`.
    pub const STREAM_LAG: &str = "voucher_cdc_stream_lag_seconds";
    /// Seconds since the stream's last successful sweep, by `tenant`, `resource`.
    pub const SECONDS_SINCE_LAST_SWEEP: &str = "voucher_cdc_seconds_since_last_sweep";
    /// Records whose hash the store knows, by `tenant`, `resource`.
    pub const RECORDS_KNOWN: &str = "voucher_cdc_records_known";
    /// 1 when the stream is parked after 401/403/404, by `tenant`, `resource`.
    pub const STREAM_PARKED: &str = "voucher_cdc_stream_parked";
    /// 1 while an operator paused the stream, by `tenant`, `resource`.
    pub const STREAM_PAUSED: &str = "voucher_cdc_stream_paused";
    /// 1 while the stream's last sweep failed (until one succeeds), by `tenant`, `resource`.
    pub const STREAM_FAILING: &str = "voucher_cdc_stream_failing";
    /// Sweeps by `tenant`, `resource`, `kind` (`incremental`, `full`, `replay`), `outcome` (`ok`, `error`).
    pub const SWEEPS: &str = "voucher_cdc_sweeps_total";
    /// Full sweeps that refused to delete more than `max_delete_fraction`, by `tenant`, `resource`.
    pub const DELETES_REFUSED: &str = "voucher_cdc_deletes_refused_total";
    /// Records missing from a full listing that the single-record GET still
    /// found (no delete published), by `tenant`, `resource`.
    pub const DELETES_RESCINDED: &str = "voucher_cdc_deletes_rescinded_total";
    /// Records whose `updated_at` is not RFC 3339 (the event's `time` is then
    /// the detection time), by `tenant`, `resource`.
    pub const UNREADABLE_UPDATED_AT: &str = "voucher_cdc_unreadable_updated_at_total";
    /// Publish batches still unacknowledged after 5 retriable failures (the
    /// error is then the stream's last error), by `tenant`, `resource`, `sink`.
    pub const SINK_STALLS: &str = "voucher_cdc_sink_stalls_total";
    /// Records whose event the sink refused and that went out as a dead letter
    /// instead (`sink.on_record_error = "dead_letter"`), by `tenant`,
    /// `resource`, `reason` (`too_large`, `rejected`).
    pub const DEAD_LETTERS: &str = "voucher_cdc_dead_letters_total";
    /// 1 when the sink's health check passes, by `sink`.
    pub const SINK_UP: &str = "voucher_cdc_sink_up";
    /// The planner's learnt change rate of a stream, changes per second, by `tenant`, `resource`.
    pub const STREAM_CHANGE_RATE: &str = "voucher_cdc_stream_change_rate";
    /// Smoothed time between two polls of a stream, by `tenant`, `resource`.
    pub const STREAM_POLL_PERIOD: &str = "voucher_cdc_stream_poll_period_seconds";
    /// When a stream's last poll started (unix seconds), by `tenant`, `resource`.
    pub const STREAM_LAST_POLL: &str = "voucher_cdc_stream_last_poll_timestamp_seconds";
    /// Requests per minute of a token's budget, by `token_id` and `kind`
    /// (`configured`, `learnt`: lowered by 429s, probed back up).
    pub const BUDGET_REQUESTS_PER_MINUTE: &str = "voucher_cdc_budget_requests_per_minute";
    /// Requests a token's budget granted in the last complete window, by `token_id`.
    pub const BUDGET_USED: &str = "voucher_cdc_budget_used_requests";
    /// Requests waiting for a token's budget, by `token_id` and `lane` (`poll`, `bulk`).
    pub const BUDGET_WAITING: &str = "voucher_cdc_budget_waiting_requests";
    /// Share of a token's recent grants that went to full sweeps, by `token_id`.
    pub const BUDGET_FULL_SWEEP_SHARE: &str = "voucher_cdc_budget_full_sweep_share";
}

/// Log output format (`log.format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable, coloured on a TTY.
    #[default]
    Pretty,
    /// One JSON object per line.
    Json,
}

/// Installs the global tracing subscriber; `RUST_LOG` overrides `level` when set.
///
/// Logs go to stderr so `demo` and the stdout sink keep stdout for events.
pub fn init_logging(format: LogFormat, level: &str) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = fmt()
        .with_env_filter(filter)
        .with_writer(ProgressAwareStderr::default)
        .with_target(false);
    let result = match format {
        LogFormat::Pretty => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    // A subscriber already installed (tests, embedding) is fine.
    drop(result);
}

/// The progress bars currently drawn on stderr (`run --once` on a TTY).
static PROGRESS: std::sync::RwLock<Option<indicatif::MultiProgress>> = std::sync::RwLock::new(None);

/// Registers (or, with None, removes) the progress bars log lines must not tear.
pub fn set_progress(progress: Option<indicatif::MultiProgress>) {
    let mut slot = PROGRESS.write().unwrap_or_else(|p| p.into_inner());
    *slot = progress;
}

/// stderr for log lines: while progress bars are drawn, each line is written
/// with the bars hidden, so the bars are redrawn below it intact.
#[derive(Debug, Default)]
pub struct ProgressAwareStderr;

impl std::io::Write for ProgressAwareStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.write_all(buf)?;
        Ok(buf.len())
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        let progress = PROGRESS.read().unwrap_or_else(|p| p.into_inner()).clone();
        match progress {
            Some(multi) => multi.suspend(|| std::io::stderr().write_all(buf)),
            None => std::io::stderr().write_all(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// Buckets of the publish latency histogram, in seconds.
const PUBLISH_LATENCY_BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

/// The process-wide Prometheus recorder, installed on first use.
///
/// `metrics` has one global recorder per process, so every daemon of a
/// process (tests start several) shares it; labels tell the streams apart.
/// When some other recorder was installed first, the handle renders an
/// empty registry and a warning says why.
pub fn prometheus() -> metrics_exporter_prometheus::PrometheusHandle {
    static HANDLE: std::sync::OnceLock<metrics_exporter_prometheus::PrometheusHandle> =
        std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let builder = metrics_exporter_prometheus::PrometheusBuilder::new();
            let builder = match builder.set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Full(metric::PUBLISH_LATENCY.to_string()),
                &PUBLISH_LATENCY_BUCKETS,
            ) {
                Ok(b) => b,
                Err(e) => {
                    tracing::warn!(error = %e, "publish latency buckets rejected; using summaries");
                    metrics_exporter_prometheus::PrometheusBuilder::new()
                }
            };
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            if let Err(e) = metrics::set_global_recorder(recorder) {
                tracing::warn!(error = %e, "another metrics recorder is installed; /metrics stays empty");
            }
            describe_metrics();
            handle
        })
        .clone()
}

/// Registers the HELP text of every metric with the installed recorder.
fn describe_metrics() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        metric::UPSTREAM_REQUESTS,
        "Upstream HTTP requests by tenant, resource and status"
    );
    describe_counter!(
        metric::UPSTREAM_RATE_LIMITED,
        "429 responses received, by token fingerprint"
    );
    describe_counter!(
        metric::UPSTREAM_RETRIES,
        "Upstream retries by tenant, resource and reason"
    );
    describe_counter!(metric::PAGES, "Pages listed by tenant and resource");
    describe_counter!(
        metric::RECORDS_SEEN,
        "Records listed by tenant and resource"
    );
    describe_counter!(
        metric::RECORDS_SKIPPED,
        "Listed records skipped for lack of a usable id"
    );
    describe_counter!(
        metric::EVENTS_PUBLISHED,
        "Events acknowledged by the sink, by tenant, resource, type and op"
    );
    describe_histogram!(
        metric::PUBLISH_LATENCY,
        Unit::Seconds,
        "Seconds from publishing a batch to its last acknowledgement"
    );
    describe_counter!(
        metric::PUBLISH_FAILURES,
        "Events the sink failed to acknowledge, by kind"
    );
    describe_gauge!(
        metric::STREAM_LAG,
        Unit::Seconds,
        "Now minus the stream's watermark"
    );
    describe_gauge!(
        metric::SECONDS_SINCE_LAST_SWEEP,
        Unit::Seconds,
        "Seconds since the stream's last successful sweep"
    );
    describe_gauge!(metric::RECORDS_KNOWN, "Records whose hash the store knows");
    describe_gauge!(
        metric::STREAM_PARKED,
        "1 when the stream is parked after 401/403/404"
    );
    describe_counter!(metric::SWEEPS, "Sweeps by kind and outcome");
    describe_counter!(
        metric::DELETES_REFUSED,
        "Full sweeps that refused to delete more than poll.max_delete_fraction"
    );
    describe_gauge!(metric::SINK_UP, "1 when the sink's health check passes");
}

/// Sets the per-stream gauges (lag, seconds since the last sweep, records
/// known, parked) from the stream's stored state as of `now`.
pub fn record_stream_gauges(
    stream: crate::stream::StreamKey,
    state: &crate::state::StreamState,
    now: chrono::DateTime<chrono::Utc>,
) {
    let labels = [
        ("tenant", stream.tenant.to_string()),
        ("resource", stream.resource.as_str().to_string()),
    ];
    if let Some(watermark) = state.watermark {
        metrics::gauge!(metric::STREAM_LAG, &labels).set(seconds_between(watermark, now));
    }
    if let Some(finished) = state.last_sweep_finished {
        metrics::gauge!(metric::SECONDS_SINCE_LAST_SWEEP, &labels)
            .set(seconds_between(finished, now));
    }
    metrics::gauge!(metric::RECORDS_KNOWN, &labels).set(state.records_known as f64);
    metrics::gauge!(metric::STREAM_PARKED, &labels).set(if state.parked.is_some() {
        1.0
    } else {
        0.0
    });
    metrics::gauge!(metric::STREAM_PAUSED, &labels).set(if state.paused.is_some() {
        1.0
    } else {
        0.0
    });
    metrics::gauge!(metric::STREAM_FAILING, &labels).set(if state.last_error.is_some() {
        1.0
    } else {
        0.0
    });
}

/// Sets the gauges of `streams` from their state in `store` (a stream whose
/// state cannot be read keeps its last values).
pub fn refresh_stream_gauges(
    store: &dyn crate::state::StateStore,
    streams: &[crate::stream::StreamKey],
) {
    let now = chrono::Utc::now();
    for key in streams {
        if let Ok(state) = store.load_stream(*key) {
            record_stream_gauges(*key, &state, now);
        }
    }
}

/// A duration as people write it, rounded to what matters: `346ms`, `2.5s`,
/// `5m`, `1h 30m` (not `346ms 754us 417ns`).
pub fn human_duration(d: std::time::Duration) -> String {
    let ms = d.as_millis();
    if ms < 1_000 {
        return format!("{ms}ms");
    }
    if ms < 10_000 {
        let tenths = (ms + 50) / 100;
        return if tenths % 10 == 0 {
            format!("{}s", tenths / 10)
        } else {
            format!("{}.{}s", tenths / 10, tenths % 10)
        };
    }
    let secs = std::time::Duration::from_secs(d.as_secs() + u64::from(d.subsec_millis() >= 500));
    humantime::format_duration(secs).to_string()
}

/// Seconds from `earlier` to `later`, never negative (clocks may disagree).
pub fn seconds_between(
    earlier: chrono::DateTime<chrono::Utc>,
    later: chrono::DateTime<chrono::Utc>,
) -> f64 {
    ((later - earlier).num_milliseconds() as f64 / 1000.0).max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn durations_are_logged_the_way_people_write_them() {
        assert_eq!(human_duration(Duration::from_nanos(346_754_417)), "346ms");
        assert_eq!(human_duration(Duration::from_millis(2_540)), "2.5s");
        assert_eq!(human_duration(Duration::from_millis(3_000)), "3s");
        assert_eq!(human_duration(Duration::from_millis(300_400)), "5m");
        assert_eq!(human_duration(Duration::from_secs(5_400)), "1h 30m");
    }
}
