//! `/metrics` of a running daemon parses as Prometheus text and its counters
//! agree with what happened: the events in the file and the simulator's
//! request log. Its own test binary: the metrics recorder is process-wide.

mod common;

use std::time::Duration;

use serde_json::Value;
use voucher_cdc::admin::StatusReport;
use voucher_cdc::stream::Resource;

use common::prometheus::{parse_prometheus, scrape, sum};
use common::{spawn_catalog, spawn_daemon, wait_until, TestConfig};

const WAIT: Duration = Duration::from_secs(30);

#[test]
fn the_prometheus_parser_rejects_what_prometheus_would_reject() {
    let good = "# HELP a_total A thing\n# TYPE a_total counter\na_total{x=\"1\",y=\"q\\\"\"} 3\nb 1.5e3\nc{} +Inf\n";
    let samples = parse_prometheus(good).unwrap();
    assert_eq!(samples.len(), 3);
    assert_eq!(samples[0].labels["y"], "q\"");
    assert_eq!(samples[1].value, 1500.0);
    for bad in [
        "a{x=1} 2",
        "a{x=\"1\" 2",
        "1a 2",
        "a two",
        "# TYPE a countr",
        "a 1 2 3",
    ] {
        assert!(parse_prometheus(bad).is_err(), "{bad}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_and_their_counters_match_the_events_and_the_requests() {
    let sim = spawn_catalog(2, 120, 5).await;
    let dir = tempfile::tempdir().unwrap();
    // One sweep per stream at start, then only what the test asks for.
    let config = TestConfig::for_simulator(&sim, dir.path(), &[1, 2])
        .with_poll_interval(Duration::from_secs(3600))
        .with_full_resync_interval(Duration::from_secs(3600));
    let mut daemon = spawn_daemon(&config).await;
    let admin = daemon.admin_url.clone();
    let client = reqwest::Client::new();

    wait_until("the initial snapshot reached the file", WAIT, || {
        daemon.events().len() == 2 * (120 + 5)
    })
    .await;
    sim.update(1, Resource::Vouchers, 3);
    sim.create(2, Resource::Categories);
    for tenant in [1, 2] {
        let response = client
            .post(format!("{admin}/v1/tenants/{tenant}/replay"))
            .json(&serde_json::json!({"since": "1h"}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 202);
    }
    let mut done = false;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while std::time::Instant::now() < deadline {
        let status: StatusReport = client
            .get(format!("{admin}/v1/status"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let replays_done = status
            .streams
            .iter()
            .all(|s| s.replay.as_ref().is_some_and(|r| !r.pending));
        let samples = scrape(&admin).await;
        if replays_done && sum(&samples, "voucher_cdc_sweeps_total", &[("outcome", "ok")]) == 8.0 {
            done = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(done, "the replays did not finish");

    let samples = scrape(&admin).await;
    let events: Vec<Value> = daemon.events();
    assert_eq!(
        sum(&samples, "voucher_cdc_events_published_total", &[]),
        events.len() as f64,
        "events_published_total must count every event in the file"
    );
    let snapshots = events.iter().filter(|e| e["op"] == "snapshot").count();
    assert_eq!(
        sum(
            &samples,
            "voucher_cdc_events_published_total",
            &[("op", "snapshot")]
        ),
        snapshots as f64
    );
    let tenant_1_vouchers = events
        .iter()
        .filter(|e| e["tenant"] == 1 && e["type"] == "voucher.updated")
        .count();
    assert_eq!(
        sum(
            &samples,
            "voucher_cdc_events_published_total",
            &[
                ("tenant", "1"),
                ("resource", "vouchers"),
                ("type", "voucher.updated")
            ]
        ),
        tenant_1_vouchers as f64
    );

    let list_requests = sim
        .request_log()
        .iter()
        .filter(|r| {
            r.method == "GET"
                && (r.path.ends_with("/catalog/vouchers")
                    || r.path.ends_with("/catalog/categories"))
        })
        .count();
    // Initial full sweeps: 3 voucher pages + 1 category page per tenant; each replay since 1h: 1 page.
    assert_eq!(list_requests, 2 * (3 + 1) + 4);
    assert_eq!(
        sum(&samples, "voucher_cdc_pages_total", &[]),
        list_requests as f64,
        "pages_total must count every list request"
    );
    assert_eq!(
        sum(
            &samples,
            "voucher_cdc_upstream_requests_total",
            &[("status", "200")]
        ),
        list_requests as f64
    );

    // Every page was dropped once its sweep ended: no body holds a share.
    assert!(samples
        .iter()
        .any(|s| s.name == "voucher_cdc_upstream_body_bytes_held"));
    assert_eq!(
        sum(&samples, "voucher_cdc_upstream_body_bytes_held", &[]),
        0.0
    );
    assert_eq!(
        sum(&samples, "voucher_cdc_upstream_body_budget_bytes", &[]),
        (8u64 << 20) as f64
    );

    let latency_count = sum(
        &samples,
        "voucher_cdc_publish_latency_seconds_count",
        &[("sink", "file")],
    );
    assert!(latency_count > 0.0);
    assert!(samples
        .iter()
        .any(|s| s.name == "voucher_cdc_publish_latency_seconds_bucket"
            && s.labels.get("le").map(String::as_str) == Some("+Inf")));

    for (tenant, resource, known) in [("1", "vouchers", 120.0), ("2", "categories", 6.0)] {
        let labels = [("tenant", tenant), ("resource", resource)];
        // The planner's view: a bound between the floor and the cap (here
        // both are the hour of `poll.interval`), and a rate learnt.
        assert_eq!(
            sum(&samples, "voucher_cdc_stream_poll_bound_seconds", &labels),
            3600.0
        );
        assert!(sum(&samples, "voucher_cdc_stream_change_rate", &labels) > 0.0);
        assert_eq!(sum(&samples, "voucher_cdc_records_known", &labels), known);
        assert_eq!(sum(&samples, "voucher_cdc_stream_parked", &labels), 0.0);
        let lag = samples
            .iter()
            .find(|s| {
                s.name == "voucher_cdc_stream_lag_seconds"
                    && s.labels.get("tenant").map(String::as_str) == Some(tenant)
                    && s.labels.get("resource").map(String::as_str) == Some(resource)
            })
            .expect("lag gauge per stream");
        assert!(lag.value >= 0.0 && lag.value < 60.0, "{lag:?}");
        let now = chrono::Utc::now().timestamp() as f64;
        let last_sweep = sum(
            &samples,
            "voucher_cdc_stream_last_sweep_timestamp_seconds",
            &labels,
        );
        assert!(
            (now - 60.0..=now + 1.0).contains(&last_sweep),
            "{last_sweep}"
        );
        let watermark = sum(
            &samples,
            "voucher_cdc_stream_watermark_timestamp_seconds",
            &labels,
        );
        assert!(
            (now - lag.value - watermark).abs() < 5.0,
            "the lag is derived from the watermark: {} vs {watermark}",
            lag.value
        );
    }
    assert_eq!(
        sum(
            &samples,
            "voucher_cdc_upstream_request_duration_seconds_count",
            &[("status", "200")]
        ),
        list_requests as f64,
        "one duration per request"
    );
    assert_eq!(
        sum(
            &samples,
            "voucher_cdc_upstream_request_duration_seconds_count",
            &[
                ("endpoint", "/tenants/{tenant}/catalog/vouchers"),
                ("status", "200")
            ]
        ),
        (2 * 3 + 2) as f64
    );
    daemon.stop().await;
}
