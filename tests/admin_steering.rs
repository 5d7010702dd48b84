//! Steering running streams through the admin API of an in-process daemon:
//! pause and resume (persisted across a restart, no upstream request while
//! paused), sweep now and recheck, replay list and cancel. The simulator runs
//! over loopback HTTP, the store is a real sled store, the sink the file sink.
//! Metrics are process-wide, so every test here uses its own tenants.

mod common;

use std::time::Duration;

use reqwest::{Client, StatusCode};
use serde_json::{json, Value};
use voucher_cdc::admin::StatusReport;
use voucher_cdc::planner::Strategy;
use voucher_cdc::simulator::{Permission, Simulator};
use voucher_cdc::stream::Resource;

use common::{spawn_daemon, spawn_small_simulator, wait_until, TestConfig};

const V: Resource = Resource::Vouchers;
const WAIT: Duration = Duration::from_secs(30);

async fn send(request: reqwest::RequestBuilder) -> (StatusCode, Value) {
    let response = request.send().await.unwrap();
    let status = response.status();
    let body = response.json().await.unwrap_or(Value::Null);
    (status, body)
}

async fn status(admin: &str) -> StatusReport {
    let (code, body) = send(Client::new().get(format!("{admin}/v1/status"))).await;
    assert_eq!(code, StatusCode::OK, "{body}");
    serde_json::from_value(body).unwrap()
}

/// Upstream requests for `tenant`'s catalog in the simulator's log.
fn requests_for(sim: &Simulator, tenant: u64) -> usize {
    let prefix = format!("/tenants/{tenant}/");
    sim.request_log()
        .iter()
        .filter(|r| r.path.contains(&prefix))
        .count()
}

/// Events of `tenant` about record `id` with `op`.
fn events_about(events: &[Value], tenant: u64, id: i64, op: &str) -> usize {
    events
        .iter()
        .filter(|e| {
            e["tenant"] == tenant
                && e["op"] == op
                && e["subject"].as_str() == Some(id.to_string().as_str())
        })
        .count()
}

async fn synced(sim: &Simulator, config: &TestConfig, tenants: &[u64]) -> common::TestDaemon {
    let daemon = spawn_daemon(config).await;
    wait_until("the initial snapshot reached the file", WAIT, || {
        common::consumer_view(&daemon.events(), tenants) == common::api_view(sim, tenants)
    })
    .await;
    daemon
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_tenant_sends_no_upstream_request_stays_paused_across_a_restart_and_resumes_from_its_watermark(
) {
    let tenants = [11, 12];
    let sim = spawn_small_simulator(12).await;
    let dir = tempfile::tempdir().unwrap();
    let config = TestConfig::for_simulator(&sim, dir.path(), &tenants);
    let mut daemon = synced(&sim, &config, &tenants).await;
    let http = Client::new();

    let (code, body) = send(http.post(format!("{}/v1/tenants/11/pause", daemon.admin_url))).await;
    assert_eq!(code, StatusCode::OK, "{body}");
    assert_eq!(
        body,
        json!({"tenant": 11, "streams": [
            {"resource": "vouchers", "paused": true, "changed": true},
            {"resource": "categories", "paused": true, "changed": true}]})
    );
    // A sweep in flight when the pause came stops after its page; then silence.
    tokio::time::sleep(Duration::from_millis(300)).await;
    sim.clear_request_log();
    let changed = sim.record_ids(11, V)[0];
    sim.update(11, V, changed);
    let other = sim.record_ids(12, V)[0];
    sim.update(12, V, other);
    wait_until("tenant 12's update arrived", WAIT, || {
        events_about(&daemon.events(), 12, other, "update") == 1
    })
    .await;
    // Several poll intervals (200ms) pass for the unpaused tenant.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(requests_for(&sim, 11), 0, "a paused stream polled");
    assert!(requests_for(&sim, 12) > 2, "the other tenant kept polling");
    assert_eq!(events_about(&daemon.events(), 11, changed, "update"), 0);

    let report = status(&daemon.admin_url).await;
    for s in &report.streams {
        let pause = s.paused.as_ref().map(|p| p.by.as_str());
        assert_eq!(pause, (s.tenant == 11).then_some("api"), "{s:?}");
    }
    let metrics = http
        .get(format!("{}/metrics", daemon.admin_url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains(r#"voucher_cdc_stream_paused{tenant="11",resource="vouchers"} 1"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"voucher_cdc_stream_paused{tenant="12",resource="vouchers"} 0"#),
        "{metrics}"
    );
    let (code, body) = send(http.post(format!("{}/v1/tenants/11/sweep", daemon.admin_url))).await;
    assert_eq!(code, StatusCode::CONFLICT, "{body}");
    assert_eq!(
        body["message"],
        "stream 11/vouchers is paused: resume it first"
    );

    // The pause is stored: a restarted daemon keeps the tenant paused.
    daemon.stop().await;
    let mut daemon = spawn_daemon(&config).await;
    sim.clear_request_log();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        requests_for(&sim, 11),
        0,
        "the pause did not survive the restart"
    );
    assert!(status(&daemon.admin_url)
        .await
        .streams
        .iter()
        .filter(|s| s.tenant == 11)
        .all(|s| s.paused.is_some()));

    let before = daemon.events().len();
    let (code, body) = send(
        http.post(format!("{}/v1/tenants/11/resume", daemon.admin_url))
            .json(&json!({"resource": "vouchers"})),
    )
    .await;
    assert_eq!(code, StatusCode::OK, "{body}");
    assert_eq!(
        body["streams"],
        json!([{"resource": "vouchers", "paused": false, "changed": true}])
    );
    wait_until("the change made while paused arrived", WAIT, || {
        events_about(&daemon.events(), 11, changed, "update") == 1
    })
    .await;
    let after: Vec<Value> = daemon.events()[before..].to_vec();
    assert!(
        after.iter().all(|e| e["op"] != "snapshot"),
        "resume went on from the watermark, not a new snapshot"
    );
    let (_, body) = send(http.post(format!("{}/v1/tenants/11/resume", daemon.admin_url))).await;
    assert_eq!(
        body["streams"],
        json!([
            {"resource": "vouchers", "paused": false, "changed": false},
            {"resource": "categories", "paused": false, "changed": true}])
    );
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_now_under_the_adaptive_planner_asks_for_its_turn_at_once() {
    sweep_now_runs_an_incremental_or_full_sweep_at_once(13, Strategy::Adaptive).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_now_on_the_streams_own_timer_sweeps_at_once() {
    sweep_now_runs_an_incremental_or_full_sweep_at_once(15, Strategy::Uniform).await;
}

/// Sweep now wakes `tenant`'s streams (which would otherwise not sweep again
/// for an hour) for an incremental or a full sweep, under `strategy`; a
/// recheck is refused while no stream is parked.
async fn sweep_now_runs_an_incremental_or_full_sweep_at_once(tenant: u64, strategy: Strategy) {
    let tenants = [tenant];
    let sim = spawn_small_simulator(tenant).await;
    let dir = tempfile::tempdir().unwrap();
    // Nothing sweeps on its own after the first sync within the test.
    let config = TestConfig::for_simulator(&sim, dir.path(), &tenants)
        .with_strategy(strategy)
        .with_poll_interval(Duration::from_secs(3600))
        .with_full_resync_interval(Duration::from_secs(7200));
    let mut daemon = synced(&sim, &config, &tenants).await;
    let http = Client::new();
    let admin = daemon.admin_url.clone();

    let changed = sim.record_ids(tenant, V)[0];
    sim.update(tenant, V, changed);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(events_about(&daemon.events(), tenant, changed, "update"), 0);
    let (code, body) = send(
        http.post(format!("{admin}/v1/tenants/{tenant}/sweep"))
            .json(&json!({"resource": "vouchers"})),
    )
    .await;
    assert_eq!(code, StatusCode::ACCEPTED, "{body}");
    assert_eq!(
        body,
        json!({"tenant": tenant, "kind": "incremental", "resources": ["vouchers"]})
    );
    wait_until("the swept update arrived", WAIT, || {
        events_about(&daemon.events(), tenant, changed, "update") == 1
    })
    .await;

    // Only a full sweep sees a delete.
    let gone = sim.record_ids(tenant, V)[1];
    sim.delete(tenant, V, gone);
    let (code, body) = send(
        http.post(format!("{admin}/v1/tenants/{tenant}/sweep"))
            .query(&[("kind", "full"), ("resource", "vouchers")]),
    )
    .await;
    assert_eq!(code, StatusCode::ACCEPTED, "{body}");
    wait_until("the delete found by the full sweep arrived", WAIT, || {
        events_about(&daemon.events(), tenant, gone, "delete") == 1
    })
    .await;

    let (code, body) = send(
        http.post(format!("{admin}/v1/tenants/{tenant}/sweep"))
            .json(&json!({"kind": "everything"})),
    )
    .await;
    assert_eq!(code, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(
        body["errors"]["kind"],
        json!(["unknown sweep kind `everything`: valid options are incremental, full"])
    );
    let (code, body) = send(http.post(format!("{admin}/v1/tenants/{tenant}/recheck"))).await;
    assert_eq!(code, StatusCode::CONFLICT, "{body}");
    assert!(
        body["message"].as_str().unwrap().starts_with(&format!(
            "no parked stream to recheck among {tenant}/vouchers, {tenant}/categories"
        )),
        "{body}"
    );
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_is_listed_with_its_progress_and_a_cancel_closes_it_with_replay_cancelled() {
    let tenants = [14];
    let sim = common::spawn_catalog(14, 300, 5).await;
    let dir = tempfile::tempdir().unwrap();
    let port = common::free_port();
    let config = TestConfig::for_simulator(&sim, dir.path(), &tenants).with_admin_port(port);
    let config_path = config.write(&dir.path().join("voucher-cdc.toml"));
    let config_path = config_path.display().to_string();
    let mut daemon = synced(&sim, &config, &tenants).await;
    let http = Client::new();
    let admin = daemon.admin_url.clone();

    // Six pages at 300ms each: the replay runs long enough to be cancelled.
    sim.set_latency(Duration::from_millis(300));
    let (code, stdout, stderr) = common::run_cli(&[
        "replay",
        "--tenant",
        "14",
        "--resource",
        "vouchers",
        "--config",
        &config_path,
    ]);
    assert_eq!(code, 0, "{stderr}");
    let replay_id = stdout.split_whitespace().nth(1).unwrap().to_string();
    wait_until("the replay started", WAIT, || {
        daemon
            .events()
            .iter()
            .any(|e| e["type"] == "replay.started" && e["replayid"] == replay_id.as_str())
    })
    .await;

    // Progress shows page by page while the replay runs.
    let deadline = std::time::Instant::now() + WAIT;
    let body = loop {
        let (code, body) = send(http.get(format!("{admin}/v1/replays"))).await;
        assert_eq!(code, StatusCode::OK, "{body}");
        if body[0]["records"].as_u64().unwrap_or(0) >= 50 {
            break body;
        }
        assert!(std::time::Instant::now() < deadline, "no progress: {body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(body.as_array().unwrap().len(), 1, "{body}");
    assert_eq!(body[0]["replay_id"], replay_id.as_str());
    assert_eq!(body[0]["phase"], "running");
    assert_eq!(
        body[0]["requested_by"], "cli",
        "the CLI marks what it asks the API"
    );
    assert!(body[0]["requested_at"].is_string());
    let (code, table, stderr) = common::run_cli(&["replays", "--config", &config_path]);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        table.lines().any(|l| l.starts_with(&replay_id)
            && l.contains("14/vouchers")
            && l.contains("running")
            && l.contains(" cli ")),
        "{table}"
    );

    let (code, stdout, stderr) =
        common::run_cli(&["cancel-replay", &replay_id, "--config", &config_path]);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.starts_with(&format!(
            "replay {replay_id} of 14/vouchers cancelled after "
        )),
        "{stdout}"
    );
    wait_until("replay.cancelled closed the replay", WAIT, || {
        daemon
            .events()
            .iter()
            .any(|e| e["type"] == "replay.cancelled" && e["replayid"] == replay_id.as_str())
    })
    .await;
    sim.set_latency(Duration::ZERO);
    // The stream goes on from its watermark from before the replay: an
    // update arrives as an update, and the replay never completes.
    let changed = sim.record_ids(14, V)[7];
    sim.update(14, V, changed);
    wait_until("the update after the cancel arrived", WAIT, || {
        events_about(&daemon.events(), 14, changed, "update") == 1
    })
    .await;
    let events = daemon.events();
    let cancelled_at = events
        .iter()
        .position(|e| e["type"] == "replay.cancelled")
        .unwrap();
    let frame = &events[cancelled_at];
    let emitted = events
        .iter()
        .filter(|e| e["op"] == "snapshot" && e["replayid"] == replay_id.as_str())
        .count();
    assert!(
        emitted < 300,
        "the replay stopped early: {emitted} snapshots"
    );
    assert!(
        events[cancelled_at..]
            .iter()
            .all(|e| e["replayid"] != replay_id.as_str() || e["type"] == "replay.cancelled"),
        "nothing of the replay after its cancel"
    );
    assert_eq!(frame["data"]["tenant"], 14);
    assert!(events.iter().all(|e| e["type"] != "replay.completed"));

    let (code, body) = send(http.get(format!("{admin}/v1/replays"))).await;
    assert_eq!(code, StatusCode::OK);
    assert_eq!(body[0]["phase"], "cancelled", "{body}");
    assert!(body[0]["cancelled_at"].is_string());
    let (code, body) = send(http.post(format!("{admin}/v1/replays/{replay_id}/cancel"))).await;
    assert_eq!(code, StatusCode::CONFLICT, "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .ends_with("is cancelled already: only a pending replay can be cancelled"),
        "{body}"
    );
    let (code, body) = send(http.post(format!("{admin}/v1/replays/0123/cancel"))).await;
    assert_eq!(code, StatusCode::NOT_FOUND, "{body}");
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recheck_tries_a_parked_stream_now_instead_of_after_the_recheck_interval() {
    let tenants = [16, 17];
    let sim = spawn_small_simulator(17).await;
    sim.add_token("only-16", Some(vec![16]), &Permission::ALL);
    let dir = tempfile::tempdir().unwrap();
    let config = TestConfig::new(&sim.base_url(), "only-16", dir.path(), &tenants)
        .with_park_recheck_interval(Duration::from_secs(3600));
    let mut daemon = spawn_daemon(&config).await;
    let admin = daemon.admin_url.clone();
    let http = Client::new();
    wait_until("tenant 17 parked", WAIT, || {
        std::fs::read_to_string(&daemon.events_path).is_ok_and(|t| !t.is_empty())
    })
    .await;
    let deadline = std::time::Instant::now() + WAIT;
    while !status(&admin)
        .await
        .streams
        .iter()
        .filter(|s| s.tenant == 17)
        .all(|s| s.parked.is_some())
    {
        assert!(
            std::time::Instant::now() < deadline,
            "tenant 17 never parked"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Access fixed upstream; without a recheck the daemon would wait an hour.
    sim.add_token("only-16", Some(vec![16, 17]), &Permission::ALL);
    let (code, body) = send(
        http.post(format!("{admin}/v1/tenants/17/recheck"))
            .json(&json!({"resource": "categories"})),
    )
    .await;
    assert_eq!(code, StatusCode::ACCEPTED, "{body}");
    assert_eq!(
        body,
        json!({"tenant": 17, "kind": "due", "resources": ["categories"]})
    );
    wait_until("the rechecked stream synced", WAIT, || {
        daemon
            .events()
            .iter()
            .filter(|e| e["tenant"] == 17 && e["op"] == "snapshot")
            .count()
            == 5
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let report = status(&admin).await;
    let parked: Vec<String> = report
        .streams
        .iter()
        .filter(|s| s.parked.is_some())
        .map(|s| s.key().to_string())
        .collect();
    assert_eq!(
        parked,
        ["17/vouchers"],
        "only the rechecked stream unparked"
    );
    daemon.stop().await;
}
