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
    /// Events the sink failed to acknowledge, by `sink`, `kind` (`retriable`, `fatal`).
    pub const PUBLISH_FAILURES: &str = "voucher_cdc_publish_failures_total";
    /// Now minus the stream's watermark, by `tenant`, `resource`.
    pub const STREAM_LAG: &str = "voucher_cdc_stream_lag_seconds";
    /// Seconds since the stream's last successful sweep, by `tenant`, `resource`.
    pub const SECONDS_SINCE_LAST_SWEEP: &str = "voucher_cdc_seconds_since_last_sweep";
    /// Records whose hash the store knows, by `tenant`, `resource`.
    pub const RECORDS_KNOWN: &str = "voucher_cdc_records_known";
    /// 1 when the stream is parked after 401/403/404, by `tenant`, `resource`.
    pub const STREAM_PARKED: &str = "voucher_cdc_stream_parked";
    /// Sweeps by `tenant`, `resource`, `kind` (`incremental`, `full`, `replay`), `outcome` (`ok`, `error`).
    pub const SWEEPS: &str = "voucher_cdc_sweeps_total";
    /// Full sweeps that refused to delete more than `max_delete_fraction`, by `tenant`, `resource`.
    pub const DELETES_REFUSED: &str = "voucher_cdc_deletes_refused_total";
    /// 1 when the sink's health check passes, by `sink`.
    pub const SINK_UP: &str = "voucher_cdc_sink_up";
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
        .with_writer(std::io::stderr)
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
