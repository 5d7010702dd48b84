//! The real binary with a real NATS sink: a config with `kind = "nats"`
//! pointing at a `nats-server -js` this test starts, `voucher-cdc run` on it,
//! events read back from the JetStream stream, and `/readyz` while the
//! server runs (200), after it is killed (503 naming the sink) and after it
//! is restarted on the same port (200), with changes made during the outage
//! and after it arriving, nothing lost, nothing stored twice.

mod common;

#[path = "common/brokers.rs"]
#[allow(dead_code)]
mod brokers;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde_json::Value;
use voucher_cdc::simulator::Simulator;
use voucher_cdc::sinks::nats::NatsSinkConfig;
use voucher_cdc::stream::Resource;

use common::{spawn_cli, spawn_small_simulator, CliProcess, TestConfig};

const TENANTS: [u64; 2] = [1, 2];
/// Generous: a busy 2-core machine, and a NATS client reconnecting with backoff.
const WAIT: Duration = Duration::from_secs(60);

/// Every message of the stream, in stream order: (Nats-Msg-Id, event); none
/// while the server is unreachable or the stream not yet created.
async fn stream_events(url: &str) -> Vec<(String, Value)> {
    let reachable = async {
        let client = async_nats::connect(url).await.ok()?;
        async_nats::jetstream::new(client)
            .get_stream("VOUCHER_CDC")
            .await
            .ok()
    };
    if reachable.await.is_none() {
        return Vec::new();
    }
    brokers::stored_messages(url, "VOUCHER_CDC")
        .await
        .into_iter()
        .map(|m| (m.msg_id, serde_json::from_slice(&m.payload).unwrap()))
        .collect()
}

/// What a consumer of the stream holds.
fn downstream(events: &[(String, Value)]) -> BTreeMap<common::RecordKey, Value> {
    common::consumer_view(events.iter().map(|(_, e)| e), &TENANTS)
}

/// What the simulator holds.
fn upstream(sim: &Simulator) -> BTreeMap<common::RecordKey, Value> {
    common::api_view(sim, &TENANTS)
}

/// Polls the stream until the consumer's view equals the simulator's.
async fn wait_in_sync(what: &str, url: &str, sim: &Simulator, daemon: &CliProcess) {
    let deadline = Instant::now() + WAIT;
    loop {
        let events = stream_events(url).await;
        if downstream(&events) == upstream(sim) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting until {what}: {} events in the stream; daemon log:\n{}",
            events.len(),
            daemon.stderr()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls `/readyz` until it answers `code`; returns its body.
async fn wait_ready(admin: &str, code: u16, daemon: &CliProcess) -> Value {
    let deadline = Instant::now() + WAIT;
    let mut last = None;
    loop {
        if let Ok(response) = reqwest::get(format!("{admin}/readyz")).await {
            let status = response.status().as_u16();
            let body: Value = response.json().await.unwrap_or(Value::Null);
            if status == code {
                return body;
            }
            last = Some((status, body));
        }
        assert!(
            Instant::now() < deadline,
            "/readyz never answered {code}; last {last:?}; daemon log:\n{}",
            daemon.stderr()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_streams_to_a_real_nats_server_and_readyz_follows_it_through_a_kill_and_restart()
{
    let Some(mut nats) = brokers::spawn_nats() else {
        return;
    };
    let sim = spawn_small_simulator(2).await;
    let dir = tempfile::tempdir().unwrap();
    let admin_port = common::free_port();
    let config = TestConfig::for_simulator(&sim, dir.path(), &TENANTS)
        .with_nats_sink(NatsSinkConfig {
            url: nats.url(),
            publish_timeout: Duration::from_secs(2),
            ..NatsSinkConfig::default()
        })
        .with_admin_port(admin_port)
        .write(&dir.path().join("voucher-cdc.toml"));
    let config = config.to_str().unwrap();
    let admin = format!("http://127.0.0.1:{admin_port}");

    let (code, out, err) = common::run_cli(&["check-config", "--config", config]);
    assert_eq!(code, 0, "{out}{err}");

    let mut daemon = spawn_cli(&["run", "--config", config]);
    wait_in_sync("the snapshot reached JetStream", &nats.url(), &sim, &daemon).await;
    let ready = wait_ready(&admin, 200, &daemon).await;
    assert_eq!(ready["reasons"], serde_json::json!([]), "{ready}");

    // The server dies: not ready, and the reason names the sink.
    nats.kill();
    let not_ready = wait_ready(&admin, 503, &daemon).await;
    let reasons: Vec<&str> = not_ready["reasons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap())
        .collect();
    assert!(
        reasons.iter().any(|r| r.starts_with("sink nats: ")),
        "{not_ready}"
    );

    // Changes while the sink is down ...
    sim.update(
        1,
        Resource::Vouchers,
        sim.record_ids(1, Resource::Vouchers)[0],
    );
    sim.delete(
        2,
        Resource::Vouchers,
        sim.record_ids(2, Resource::Vouchers)[1],
    );
    sim.create(2, Resource::Categories);
    sim.update_silently(
        1,
        Resource::Categories,
        sim.record_ids(1, Resource::Categories)[2],
    );

    // ... arrive once it is back on the same port, and it is ready again.
    nats.restart();
    wait_ready(&admin, 200, &daemon).await;
    wait_in_sync("the outage's changes arrived", &nats.url(), &sim, &daemon).await;

    // And changes after it flow as before.
    sim.create(1, Resource::Vouchers);
    sim.update(
        2,
        Resource::Categories,
        sim.record_ids(2, Resource::Categories)[0],
    );
    wait_in_sync(
        "changes after the restart arrived",
        &nats.url(),
        &sim,
        &daemon,
    )
    .await;

    // `status` asks the running daemon: every stream synced, no error left.
    let (code, out, err) = common::run_cli(&["status", "--config", config, "--json"]);
    assert_eq!(code, 0, "{out}{err}");
    let status: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(status["sink"]["healthy"], Value::Bool(true), "{status}");

    daemon.signal("TERM");
    assert_eq!(daemon.wait_for(WAIT), 0, "{}", daemon.stderr());

    // Nothing stored twice (a re-publish carries its id; the stream dedupes),
    // nothing lost (the final view equals the API), no snapshot after the first.
    let events = stream_events(&nats.url()).await;
    let ids: BTreeSet<&str> = events.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids.len(), events.len(), "an event id stored twice");
    assert!(events.iter().all(|(id, e)| e["id"] == id.as_str()));
    assert_eq!(downstream(&events), upstream(&sim));
    let snapshots = events.iter().filter(|(_, e)| e["op"] == "snapshot").count();
    assert_eq!(
        snapshots,
        TENANTS.len() * (20 + 5),
        "snapshots only at first sync"
    );
}
