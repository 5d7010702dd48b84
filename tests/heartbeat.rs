//! `events.heartbeat_interval` in an in-process daemon against the
//! simulator, events read back from the file sink (and validated against the
//! published schemas there): a quiet stream emits `stream.heartbeat` events
//! an interval apart, a busy one emits none.

mod common;

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use voucher_cdc::config::EventsConfig;
use voucher_cdc::stream::Resource;

use common::{spawn_daemon, spawn_small_simulator, wait_until, TestConfig};

fn config(
    sim: &voucher_cdc::simulator::Simulator,
    dir: &std::path::Path,
    every: Duration,
) -> TestConfig {
    TestConfig::for_simulator(sim, dir, &[])
        .with_tenant(1, &[Resource::Vouchers])
        .with_events(EventsConfig {
            heartbeat_interval: Some(every),
            ..EventsConfig::default()
        })
}

fn heartbeats(events: &[Value]) -> Vec<Value> {
    events
        .iter()
        .filter(|e| e["type"] == "stream.heartbeat")
        .cloned()
        .collect()
}

fn time_of(value: &Value) -> DateTime<Utc> {
    value.as_str().unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_stream_emits_heartbeats_an_interval_apart_with_its_watermark_and_last_sweep() {
    let sim = spawn_small_simulator(1).await;
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = spawn_daemon(&config(&sim, dir.path(), Duration::from_secs(1))).await;
    wait_until("two heartbeats", Duration::from_secs(30), || {
        heartbeats(&daemon.events()).len() >= 2
    })
    .await;
    daemon.stop().await;
    let events = daemon.events();
    let snapshots = events.iter().filter(|e| e["op"] == "snapshot").count();
    assert_eq!(snapshots, 20, "the first sync comes first, in full");
    let beats = heartbeats(&events);
    for beat in &beats {
        assert_eq!(beat["source"], "/tenants/1/catalog/vouchers");
        assert_eq!(beat["subject"], "vouchers");
        assert_eq!(beat["partitionkey"], "1:voucher:heartbeat");
        assert!(beat.get("op").is_none());
        let data = &beat["data"];
        assert_eq!(
            (data["tenant"].as_u64(), data["resource"].as_str()),
            (Some(1), Some("vouchers"))
        );
        // The stream swept and published before it went quiet.
        let (watermark, last_sweep) = (time_of(&data["watermark"]), time_of(&data["lastsweep"]));
        assert!(watermark <= time_of(&beat["time"]));
        assert!(last_sweep <= time_of(&beat["time"]));
        assert!(time_of(&data["lastevent"]) < time_of(&beat["time"]));
    }
    // An interval apart (the timer starts after the previous heartbeat's ack).
    let gap = time_of(&beats[1]["time"]) - time_of(&beats[0]["time"]);
    assert!(gap >= chrono::Duration::milliseconds(990), "{gap}");
    // The second reports the first as the stream's last event.
    assert!(time_of(&beats[1]["data"]["lastevent"]) >= time_of(&beats[0]["time"]));
    assert_ne!(beats[0]["id"], beats[1]["id"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_stream_emits_no_heartbeat_until_it_goes_quiet() {
    let sim = spawn_small_simulator(1).await;
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = spawn_daemon(&config(&sim, dir.path(), Duration::from_secs(3))).await;
    wait_until("the first sync", Duration::from_secs(30), || {
        daemon.events().len() >= 20
    })
    .await;
    // A change every 150 ms for 7 s: an update event at every 200 ms sweep.
    let ids = sim.record_ids(1, Resource::Vouchers);
    let busy_until = std::time::Instant::now() + Duration::from_secs(7);
    let mut i = 0;
    while std::time::Instant::now() < busy_until {
        sim.update(1, Resource::Vouchers, ids[i % ids.len()]);
        i += 1;
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let events = daemon.events();
    let updates = events.iter().filter(|e| e["op"] == "update").count();
    assert!(updates >= 10, "the stream was busy: {updates} updates");
    assert_eq!(heartbeats(&events), Vec::<Value>::new());
    // Quiet from now on: the heartbeat comes.
    wait_until("a heartbeat once quiet", Duration::from_secs(30), || {
        !heartbeats(&daemon.events()).is_empty()
    })
    .await;
    daemon.stop().await;
}
