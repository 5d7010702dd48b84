//! `/metrics` of a daemon scraped right after start: build info, process
//! figures, and every failure counter already there at zero. Its own test
//! binary: the metrics recorder is process-wide, and another daemon's
//! counters would mix in.

mod common;

use std::time::Duration;

use common::prometheus::{scrape, sum, Sample};
use common::{spawn_catalog, spawn_daemon, TestConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn right_after_start_metrics_show_build_info_process_figures_and_every_failure_counter_at_zero(
) {
    let sim = spawn_catalog(2, 3, 1).await;
    let dir = tempfile::tempdir().unwrap();
    let config = TestConfig::for_simulator(&sim, dir.path(), &[1, 2])
        .with_poll_interval(Duration::from_secs(3600))
        .with_full_resync_interval(Duration::from_secs(3600));
    let mut daemon = spawn_daemon(&config).await;
    let samples = scrape(&daemon.admin_url).await;

    let build = samples
        .iter()
        .find(|s| s.name == "voucher_cdc_build_info")
        .expect("build_info");
    assert_eq!(build.value, 1.0);
    assert_eq!(build.labels["version"], env!("CARGO_PKG_VERSION"));

    for name in [
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
    ] {
        let value = sum(&samples, name, &[]);
        assert!(value > 0.0, "{name} = {value}");
    }
    assert!(sum(&samples, "process_resident_memory_bytes", &[]) > 1_000_000.0);

    assert_eq!(
        sum(&samples, "voucher_cdc_sink_up", &[("sink", "file")]),
        1.0
    );
    for kind in ["retriable", "fatal", "rejected"] {
        let present = samples.iter().any(|s| {
            s.name == "voucher_cdc_publish_failures_total"
                && s.labels.get("sink").map(String::as_str) == Some("file")
                && s.labels.get("kind").map(String::as_str) == Some(kind)
        });
        assert!(present, "publish_failures_total{{kind={kind}}} missing");
    }
    for tenant in ["1", "2"] {
        for (name, extra) in [
            ("voucher_cdc_upstream_retries_total", ("reason", "429")),
            ("voucher_cdc_upstream_retries_total", ("reason", "5xx")),
            ("voucher_cdc_sweeps_total", ("outcome", "error")),
            ("voucher_cdc_sink_stalls_total", ("sink", "file")),
            ("voucher_cdc_dead_letters_total", ("reason", "too_large")),
            (
                "voucher_cdc_deletes_refused_total",
                ("resource", "vouchers"),
            ),
        ] {
            let series: Vec<&Sample> = samples
                .iter()
                .filter(|s| {
                    s.name == name
                        && s.labels.get("tenant").map(String::as_str) == Some(tenant)
                        && s.labels.get(extra.0).map(String::as_str) == Some(extra.1)
                })
                .collect();
            assert!(
                !series.is_empty(),
                "{name}{{tenant={tenant}, {extra:?}}} missing"
            );
            assert!(series.iter().all(|s| s.value == 0.0), "{series:?}");
        }
    }
    assert!(samples
        .iter()
        .any(|s| s.name == "voucher_cdc_upstream_rate_limited_total" && s.value == 0.0));
    daemon.stop().await;
}
