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
    /// Derived, for dashboards without `time()`: now (at the scrape) minus
    /// the stream's watermark, by `tenant`, `resource`; the same as
    /// `time() - voucher_cdc_stream_watermark_timestamp_seconds`.
    pub const STREAM_LAG: &str = "voucher_cdc_stream_lag_seconds";
    /// The stream's watermark (newest `updated_at` committed, unix seconds), by `tenant`, `resource`.
    pub const STREAM_WATERMARK: &str = "voucher_cdc_stream_watermark_timestamp_seconds";
    /// When the stream's last successful sweep finished (unix seconds), by `tenant`, `resource`.
    pub const STREAM_LAST_SWEEP: &str = "voucher_cdc_stream_last_sweep_timestamp_seconds";
    /// Always 1, labelled with what was built: `version`, `target`, `profile`.
    pub const BUILD_INFO: &str = "voucher_cdc_build_info";
    /// Seconds one upstream HTTP attempt took until its whole body was read,
    /// by `endpoint` (route template) and `status` (HTTP code or `error`) (histogram).
    pub const UPSTREAM_REQUEST_DURATION: &str = "voucher_cdc_upstream_request_duration_seconds";
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
    /// The longest the planner lets a stream go unpolled now (the tail guard,
    /// or `poll.max_interval` for a quiet stream), by `tenant`, `resource`.
    pub const STREAM_POLL_BOUND: &str = "voucher_cdc_stream_poll_bound_seconds";
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
    /// Gauge: bytes of listing bodies holding a share of the body budget.
    pub const UPSTREAM_BODY_BYTES_HELD: &str = "voucher_cdc_upstream_body_bytes_held";
    /// Gauge: the size of the body budget those shares come from.
    pub const UPSTREAM_BODY_BUDGET_BYTES: &str = "voucher_cdc_upstream_body_budget_bytes";
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

/// Buckets of the upstream request duration histogram, in seconds.
const UPSTREAM_DURATION_BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
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
            let mut builder = metrics_exporter_prometheus::PrometheusBuilder::new();
            for (name, buckets) in [
                (metric::PUBLISH_LATENCY, &PUBLISH_LATENCY_BUCKETS),
                (metric::UPSTREAM_REQUEST_DURATION, &UPSTREAM_DURATION_BUCKETS),
            ] {
                let matcher = metrics_exporter_prometheus::Matcher::Full(name.to_string());
                builder = match builder.set_buckets_for_metric(matcher, buckets) {
                    Ok(b) => b,
                    Err(e) => {
                        tracing::warn!(error = %e, metric = name, "histogram buckets rejected; using summaries");
                        metrics_exporter_prometheus::PrometheusBuilder::new()
                    }
                };
            }
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            if let Err(e) = metrics::set_global_recorder(recorder) {
                tracing::warn!(error = %e, "another metrics recorder is installed; /metrics stays empty");
            }
            describe_metrics();
            metrics::gauge!(
                metric::BUILD_INFO,
                "version" => env!("CARGO_PKG_VERSION"),
                "target" => format!("{}-{}", std::env::consts::ARCH, std::env::consts::OS),
                "profile" => if cfg!(debug_assertions) { "debug" } else { "release" }
            )
            .set(1.0);
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
        "Derived: now minus the stream's watermark (time() - stream_watermark_timestamp_seconds)"
    );
    describe_gauge!(
        metric::STREAM_WATERMARK,
        Unit::Seconds,
        "The stream's watermark, unix seconds"
    );
    describe_gauge!(
        metric::STREAM_LAST_SWEEP,
        Unit::Seconds,
        "When the stream's last successful sweep finished, unix seconds"
    );
    describe_gauge!(
        metric::BUILD_INFO,
        "Always 1, labelled with the version and target that was built"
    );
    describe_histogram!(
        metric::UPSTREAM_REQUEST_DURATION,
        Unit::Seconds,
        "Seconds one upstream HTTP attempt took, by endpoint and status"
    );
    describe_counter!(
        metric::SINK_STALLS,
        "Publish batches still unacknowledged after 5 retriable failures"
    );
    describe_counter!(
        metric::DEAD_LETTERS,
        "Records whose event the sink refused, published as dead letters"
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

/// Sets the per-stream gauges (watermark and last sweep timestamps, the
/// derived lag, records known, parked, failing) from the stream's stored
/// state as of `now`.
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
        metrics::gauge!(metric::STREAM_WATERMARK, &labels).set(unix_seconds(watermark));
        metrics::gauge!(metric::STREAM_LAG, &labels).set(seconds_between(watermark, now));
    }
    if let Some(finished) = state.last_sweep_finished {
        metrics::gauge!(metric::STREAM_LAST_SWEEP, &labels).set(unix_seconds(finished));
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

/// Exports every failure counter a daemon's streams, tokens and sink can
/// increment at zero, and `sink_up` at 0 until the sink reports itself up,
/// so an alert on `increase(...)` or `sink_up == 0` works from the first
/// scrape, not only after the first failure. Label sets match the ones the
/// counters are incremented under.
pub fn export_zero_series<'a>(
    sink: &str,
    streams: &[crate::stream::StreamKey],
    token_ids: impl IntoIterator<Item = &'a str>,
) {
    for kind in ["retriable", "fatal", "rejected"] {
        metrics::counter!(metric::PUBLISH_FAILURES, "sink" => sink.to_string(), "kind" => kind)
            .increment(0);
    }
    for token_id in token_ids {
        metrics::counter!(metric::UPSTREAM_RATE_LIMITED, "token_id" => token_id.to_string())
            .increment(0);
    }
    for stream in streams {
        let tenant = stream.tenant.to_string();
        let resource = stream.resource.as_str();
        for reason in ["429", "5xx", "timeout", "connect", "body"] {
            metrics::counter!(metric::UPSTREAM_RETRIES, "tenant" => tenant.clone(),
                "resource" => resource, "reason" => reason)
            .increment(0);
        }
        for kind in ["incremental", "full"] {
            metrics::counter!(metric::SWEEPS, "tenant" => tenant.clone(),
                "resource" => resource, "kind" => kind, "outcome" => "error")
            .increment(0);
        }
        metrics::counter!(metric::SINK_STALLS, "tenant" => tenant.clone(),
            "resource" => resource, "sink" => sink.to_string())
        .increment(0);
        for reason in ["too_large", "rejected"] {
            metrics::counter!(metric::DEAD_LETTERS, "tenant" => tenant.clone(),
                "resource" => resource, "reason" => reason)
            .increment(0);
        }
        metrics::counter!(metric::DELETES_REFUSED, "tenant" => tenant.clone(), "resource" => resource)
            .increment(0);
    }
}

/// The standard process metrics of the Prometheus client libraries
/// (`process_cpu_seconds_total`, `process_resident_memory_bytes`,
/// `process_virtual_memory_bytes`, `process_open_fds`, `process_max_fds`,
/// `process_start_time_seconds`) in the text format, read from `/proc/self`
/// at each scrape; empty where there is no `/proc` (not Linux).
pub fn process_metrics() -> String {
    let mut out = String::new();
    let Some(sample) = ProcessSample::read() else {
        return out;
    };
    let mut put = |name: &str, kind: &str, help: &str, value: Option<f64>| {
        if let Some(value) = value {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"
            ));
        }
    };
    put(
        "process_cpu_seconds_total",
        "counter",
        "Total user and system CPU time spent in seconds.",
        Some(sample.cpu_seconds),
    );
    put(
        "process_resident_memory_bytes",
        "gauge",
        "Resident memory size in bytes.",
        sample.resident_bytes.map(|b| b as f64),
    );
    put(
        "process_virtual_memory_bytes",
        "gauge",
        "Virtual memory size in bytes.",
        Some(sample.virtual_bytes as f64),
    );
    put(
        "process_open_fds",
        "gauge",
        "Number of open file descriptors.",
        sample.open_fds.map(|n| n as f64),
    );
    put(
        "process_max_fds",
        "gauge",
        "Maximum number of open file descriptors.",
        sample.max_fds.map(|n| n as f64),
    );
    put(
        "process_start_time_seconds",
        "gauge",
        "Start time of the process since unix epoch in seconds.",
        sample.start_time_seconds,
    );
    out
}

/// One reading of `/proc/self`.
#[derive(Debug, Clone, PartialEq)]
struct ProcessSample {
    cpu_seconds: f64,
    virtual_bytes: u64,
    resident_bytes: Option<u64>,
    open_fds: Option<u64>,
    max_fds: Option<u64>,
    start_time_seconds: Option<f64>,
}

/// User and system CPU time of the whole process from `getrusage`, to the
/// microsecond: `/proc/self/stat` counts 10 ms ticks, so a process that has
/// just started reads 0 there. None when the call fails.
fn rusage_cpu_seconds() -> Option<f64> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one `rusage` through the pointer it is given,
    // which points at one; the value was zeroed, so it is initialised either way.
    #[allow(unsafe_code)]
    let usage = unsafe {
        if libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) != 0 {
            return None;
        }
        usage.assume_init()
    };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Some(seconds(usage.ru_utime) + seconds(usage.ru_stime))
}

/// Clock ticks per second of `/proc/*/stat` times: USER_HZ, fixed at 100 by
/// the Linux ABI (Prometheus' procfs library assumes the same).
const USER_HZ: f64 = 100.0;

impl ProcessSample {
    /// Reads `/proc/self`; `None` without a readable `/proc/self/stat`.
    fn read() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
        let boot = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let mut sample = Self::parse(&stat, &status, &limits, &boot)?;
        if let Some(cpu_seconds) = rusage_cpu_seconds() {
            sample.cpu_seconds = cpu_seconds;
        }
        sample.open_fds = std::fs::read_dir("/proc/self/fd")
            .ok()
            .map(|entries| entries.count() as u64);
        Some(sample)
    }

    /// The sample in the texts of `/proc/self/stat`, `/proc/self/status`,
    /// `/proc/self/limits` and `/proc/stat` (open fds are counted apart).
    fn parse(stat: &str, status: &str, limits: &str, boot: &str) -> Option<Self> {
        // The command name in parentheses may hold spaces: fields start after the last `)`.
        let fields: Vec<&str> = stat
            .get(stat.rfind(')')? + 1..)?
            .split_whitespace()
            .collect();
        // fields[0] is field 3 of proc(5): utime is 14, stime 15, starttime 22, vsize 23.
        let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<u64>().ok());
        let cpu_seconds = (field(14)? + field(15)?) as f64 / USER_HZ;
        let virtual_bytes = field(23)?;
        let resident_bytes = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .map(|kib| kib * 1024);
        let max_fds = limits
            .lines()
            .find_map(|l| l.strip_prefix("Max open files"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok());
        let boot_time = boot
            .lines()
            .find_map(|l| l.strip_prefix("btime "))
            .and_then(|v| v.trim().parse::<u64>().ok());
        let start_time_seconds = boot_time
            .zip(field(22))
            .map(|(boot, ticks)| boot as f64 + ticks as f64 / USER_HZ);
        Some(Self {
            cpu_seconds,
            virtual_bytes,
            resident_bytes,
            open_fds: None,
            max_fds,
            start_time_seconds,
        })
    }
}

/// A time as unix seconds with milliseconds.
fn unix_seconds(at: chrono::DateTime<chrono::Utc>) -> f64 {
    at.timestamp_millis() as f64 / 1000.0
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
    fn process_figures_are_read_from_the_proc_texts() {
        let stat = "4242 (voucher cdc) S 1 4242 4242 0 -1 4194560 900 0 0 0 250 50 0 0 20 0 9 0 1000 123456789 2500 18446744073709551615";
        let status = "Name:\tvoucher-cdc\nVmRSS:\t   10240 kB\nThreads:\t9\n";
        let limits = "Limit                     Soft Limit           Hard Limit           Units\nMax open files            1024                 524288               files\n";
        let boot = "cpu  1 2 3\nbtime 1700000000\n";
        let sample = ProcessSample::parse(stat, status, limits, boot).unwrap();
        assert_eq!(sample.cpu_seconds, 3.0);
        assert_eq!(sample.virtual_bytes, 123_456_789);
        assert_eq!(sample.resident_bytes, Some(10 * 1024 * 1024));
        assert_eq!(sample.max_fds, Some(1024));
        assert_eq!(sample.start_time_seconds, Some(1_700_000_010.0));
        assert_eq!(ProcessSample::parse("garbage", "", "", ""), None);
    }

    #[test]
    fn durations_are_logged_the_way_people_write_them() {
        assert_eq!(human_duration(Duration::from_nanos(346_754_417)), "346ms");
        assert_eq!(human_duration(Duration::from_millis(2_540)), "2.5s");
        assert_eq!(human_duration(Duration::from_millis(3_000)), "3s");
        assert_eq!(human_duration(Duration::from_millis(300_400)), "5m");
        assert_eq!(human_duration(Duration::from_secs(5_400)), "1h 30m");
    }
}
