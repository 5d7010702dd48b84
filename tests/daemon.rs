//! The daemon end to end, in-process: the simulator over loopback HTTP, a
//! real sled store and the file sink in temp dirs, the admin API on a free
//! port. Metrics are process-wide, so every test here uses its own tenants.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio_util::sync::CancellationToken;
use voucher_cdc::admin::StatusReport;
use voucher_cdc::scheduler::{StepOutcome, StreamRunner, Timing};
use voucher_cdc::simulator::{Permission, Simulator};
use voucher_cdc::sinks::testing::{FaultMode, TestSink};
use voucher_cdc::stream::Resource;

use common::{spawn_daemon, spawn_daemon_with_sink, spawn_small_simulator, wait_until, TestConfig};

const V: Resource = Resource::Vouchers;
const C: Resource = Resource::Categories;
const WAIT: Duration = Duration::from_secs(30);

/// What a downstream consumer holds after applying every record event in order.
fn downstream(events: &[Value], tenants: &[u64]) -> BTreeMap<common::RecordKey, Value> {
    common::consumer_view(events, tenants)
}

/// What the simulator holds.
fn upstream(sim: &Simulator, tenants: &[u64]) -> BTreeMap<common::RecordKey, Value> {
    common::api_view(sim, tenants)
}

fn assert_ids_unique(events: &[Value]) {
    let mut seen = HashSet::new();
    for e in events {
        let id = e["id"].as_str().unwrap();
        assert!(
            seen.insert(id.to_string()),
            "event id {id} published twice: {e}"
        );
    }
}

async fn get_json(url: &str) -> (u16, Value) {
    let response = reqwest::get(url).await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

/// Waits until every stream of the daemon at `admin` finished a full sweep
/// after `since` (per `/v1/status`); called twice in a row, at least one
/// whole full sweep of every stream ran between the calls.
async fn wait_for_full_sweeps_after(admin: &str, since: chrono::DateTime<chrono::Utc>) {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let (_, status) = get_json(&format!("{admin}/v1/status")).await;
        let status: StatusReport = serde_json::from_value(status).unwrap();
        let behind: Vec<String> = status
            .streams
            .iter()
            .filter(|s| s.last_full_sweep_finished.is_none_or(|f| f <= since))
            .map(|s| format!("{}/{}", s.tenant, s.resource.as_str()))
            .collect();
        if behind.is_empty() {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no full sweep after {since} within {WAIT:?} for {behind:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A simulator with `sim_tenants` tenants and a daemon streaming `tenants`,
/// after the initial snapshot arrived; with `token` = (token, its tenants) the
/// daemon uses that scoped token instead and nothing is awaited.
async fn start_synced(
    sim_tenants: u64,
    tenants: &[u64],
    scoped: Option<(&str, Vec<u64>)>,
) -> (Simulator, tempfile::TempDir, TestConfig, common::TestDaemon) {
    let sim = spawn_small_simulator(sim_tenants).await;
    let token = scoped.map(|(token, scope)| {
        sim.add_token(token, Some(scope), &Permission::ALL);
        token
    });
    let dir = tempfile::tempdir().unwrap();
    let config = TestConfig::new(
        &sim.base_url(),
        token.unwrap_or(sim.token()),
        dir.path(),
        tenants,
    );
    let daemon = spawn_daemon(&config).await;
    if token.is_none() {
        wait_until("the initial snapshot reached the file", WAIT, || {
            downstream(&daemon.events(), tenants) == upstream(&sim, tenants)
        })
        .await;
    }
    (sim, dir, config, daemon)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_flow_and_a_restart_on_the_same_state_continues_without_duplicates_or_loss() {
    let tenants = [1, 2];
    let (sim, _dir, config, mut daemon) = start_synced(2, &tenants, None).await;
    let snapshots = daemon.events();
    assert_eq!(snapshots.len(), 2 * (20 + 5));
    assert!(snapshots.iter().all(|e| e["op"] == "snapshot"));

    let updated = sim.record_ids(1, V)[3];
    sim.update(1, V, updated);
    let created = sim.create(2, C);
    let deleted = sim.record_ids(1, V)[7];
    sim.delete(1, V, deleted);
    let silently = sim.record_ids(2, V)[1];
    sim.update_silently(2, V, silently);
    wait_until(
        "updates, a create, a delete and a silent change arrived",
        WAIT,
        || downstream(&daemon.events(), &tenants) == upstream(&sim, &tenants),
    )
    .await;
    // Categories embed their products, so a voucher change may update a category too.
    let changes = daemon.events()[snapshots.len()..].to_vec();
    let has = |tenant: u64, resource: &str, id: i64, op: &str| {
        changes.iter().any(|e| {
            e["tenant"] == tenant
                && e["source"].as_str().unwrap().ends_with(resource)
                && e["subject"].as_str() == Some(id.to_string().as_str())
                && e["op"] == op
        })
    };
    assert!(has(1, "vouchers", updated, "update"), "{changes:?}");
    assert!(has(2, "categories", created, "create"), "{changes:?}");
    assert!(has(1, "vouchers", deleted, "delete"), "{changes:?}");
    assert!(has(2, "vouchers", silently, "update"), "{changes:?}");

    daemon.stop().await;
    let before_restart = daemon.events().len();

    // Changes while the bridge is down are picked up after the restart.
    sim.update(2, C, sim.record_ids(2, C)[0]);
    sim.delete(2, V, sim.record_ids(2, V)[2]);
    let mut daemon = spawn_daemon(&config).await;
    wait_until(
        "changes made while stopped arrived after the restart",
        WAIT,
        || downstream(&daemon.events(), &tenants) == upstream(&sim, &tenants),
    )
    .await;
    sim.create(1, V);
    sim.update(1, C, sim.record_ids(1, C)[4]);
    wait_until("changes after the restart arrived", WAIT, || {
        downstream(&daemon.events(), &tenants) == upstream(&sim, &tenants)
    })
    .await;
    // At least one more whole full sweep (and the incremental ones around it)
    // of every stream over unchanged data, seen in the status, not guessed by a sleep.
    for _ in 0..2 {
        wait_for_full_sweeps_after(&daemon.admin_url, chrono::Utc::now()).await;
    }
    daemon.stop().await;

    let events = daemon.events();
    assert_ids_unique(&events);
    assert!(events[before_restart..]
        .iter()
        .all(|e| e["op"] != "snapshot"));
    assert_eq!(downstream(&events, &tenants), upstream(&sim, &tenants));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_through_the_admin_api_re_emits_one_tenant_while_the_others_keep_streaming() {
    let tenants = [5, 6];
    let (sim, _dir, _config, mut daemon) = start_synced(6, &tenants, None).await;
    let initial = daemon.events().len();

    let response = reqwest::Client::new()
        .post(format!("{}/v1/tenants/5/replay", daemon.admin_url))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 202);
    let body: Value = response.json().await.unwrap();
    let replays = body["replays"].as_array().unwrap();
    assert_eq!(replays.len(), 2, "{body}");
    let replay_ids: HashSet<String> = replays
        .iter()
        .map(|r| r["replay_id"].as_str().unwrap().to_string())
        .collect();
    let changed = sim.record_ids(6, V)[0];
    sim.update(6, V, changed);

    wait_until(
        "both replays completed and tenant 6's update arrived",
        WAIT,
        || {
            let events = daemon.events();
            let completed = events
                .iter()
                .filter(|e| e["type"] == "replay.completed")
                .count();
            completed == 2 && downstream(&events, &tenants) == upstream(&sim, &tenants)
        },
    )
    .await;
    let events = daemon.events();
    let after = &events[initial..];
    let replayed: Vec<&Value> = after.iter().filter(|e| e["replayid"].is_string()).collect();
    assert!(replayed
        .iter()
        .all(|e| e["tenant"] == 5 && replay_ids.contains(e["replayid"].as_str().unwrap())));
    let snapshots = replayed.iter().filter(|e| e["op"] == "snapshot").count();
    assert_eq!(snapshots, 20 + 5);
    assert!(after.iter().any(|e| e["tenant"] == 6
        && e["op"] == "update"
        && e["subject"].as_str() == Some(&changed.to_string())));

    let (code, status) = get_json(&format!("{}/v1/status", daemon.admin_url)).await;
    assert_eq!(code, 200);
    let status: StatusReport = serde_json::from_value(status).unwrap();
    for s in status.streams.iter().filter(|s| s.tenant == 5) {
        let replay = s.replay.as_ref().expect("replay recorded");
        assert!(!replay.pending);
        assert!(replay_ids.contains(&replay.id));
    }
    assert!(status
        .streams
        .iter()
        .filter(|s| s.tenant == 6)
        .all(|s| s.replay.is_none()));
    daemon.stop().await;
    assert_ids_unique(&daemon.events());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_refused_access_is_parked_and_visible_while_the_others_go_on_then_recovers() {
    let tenants = [3, 4];
    let (sim, _dir, _config, mut daemon) =
        start_synced(4, &tenants, Some(("tenant-3-only", vec![3]))).await;
    let admin = daemon.admin_url.clone();

    wait_until("tenant 3 synced while tenant 4 is refused", WAIT, || {
        downstream(&daemon.events(), &[3]) == upstream(&sim, &[3])
    })
    .await;
    let mut parked = Vec::new();
    let deadline = std::time::Instant::now() + WAIT;
    while std::time::Instant::now() < deadline {
        let (_, status) = get_json(&format!("{admin}/v1/status")).await;
        let status: StatusReport = serde_json::from_value(status).unwrap();
        parked = status
            .streams
            .iter()
            .filter(|s| s.parked.is_some())
            .map(|s| (s.tenant, s.resource, s.parked.clone().unwrap()))
            .collect();
        if parked.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(parked.len(), 2, "{parked:?}");
    assert!(parked.iter().all(|(t, _, _)| *t == 4));
    assert!(
        parked
            .iter()
            .all(|(_, _, why)| why.contains("/tenants/4/catalog")),
        "{parked:?}"
    );

    // A parked stream is reported, but the process can work: still ready,
    // so one tenant without access does not stall rollouts and node drains.
    let (code, ready) = get_json(&format!("{admin}/readyz")).await;
    assert_eq!(code, 200, "{ready}");
    assert_eq!(ready["reasons"], serde_json::json!([]), "{ready}");
    let streams = ready["streams"].as_array().unwrap();
    assert!(
        streams.iter().any(|r| r
            .as_str()
            .unwrap()
            .starts_with("stream 4/vouchers parked: upstream returned")),
        "{ready}"
    );
    let metrics = reqwest::get(format!("{admin}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let parked_lines: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("voucher_cdc_stream_parked{") && l.contains("tenant=\"4\""))
        .collect();
    assert_eq!(parked_lines.len(), 2, "{metrics}");
    assert!(
        parked_lines.iter().all(|l| l.ends_with(" 1")),
        "{parked_lines:?}"
    );

    // Tenant 3 keeps streaming meanwhile.
    let id = sim.record_ids(3, C)[1];
    sim.update(3, C, id);
    wait_until("tenant 3's update arrived", WAIT, || {
        downstream(&daemon.events(), &[3]) == upstream(&sim, &[3])
    })
    .await;

    // Access granted: the re-check unparks tenant 4, which snapshots.
    sim.add_token("tenant-3-only", None, &Permission::ALL);
    wait_until("tenant 4 unparked and synced", WAIT, || {
        downstream(&daemon.events(), &tenants) == upstream(&sim, &tenants)
    })
    .await;
    let mut ready_code = 0;
    let deadline = std::time::Instant::now() + WAIT;
    while std::time::Instant::now() < deadline {
        ready_code = get_json(&format!("{admin}/readyz")).await.0;
        if ready_code == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(ready_code, 200);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_is_bounded_when_the_sink_never_acknowledges_and_loses_nothing() {
    let sim = spawn_small_simulator(8).await;
    let dir = tempfile::tempdir().unwrap();
    let config = TestConfig::for_simulator(&sim, dir.path(), &[7])
        .with_shutdown_timeout(Duration::from_secs(1));
    let stuck = TestSink::new();
    stuck.set_mode(FaultMode::NeverAck);
    let mut daemon = spawn_daemon_with_sink(&config, Some(Arc::new(stuck.clone()))).await;
    wait_until("both streams are publishing", WAIT, || {
        stuck.publish_calls() >= 2
    })
    .await;

    let started = std::time::Instant::now();
    daemon.stop().await;
    let took = started.elapsed();
    // Bounded by shutdown_timeout (1s), not by the sink that never acks; the
    // loose bound leaves a busy machine room to close the store.
    assert!(took < Duration::from_secs(15), "stop took {took:?}");
    assert!(stuck.events().is_empty());

    // Nothing was acknowledged, so nothing was committed: the next run snapshots everything.
    let mut daemon = spawn_daemon(&config).await;
    wait_until("the snapshot arrived after the aborted run", WAIT, || {
        downstream(&daemon.events(), &[7]) == upstream(&sim, &[7])
    })
    .await;
    daemon.stop().await;
    assert!(daemon.events().iter().all(|e| e["op"] == "snapshot"));
    assert_ids_unique(&daemon.events());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_a_sweep_fails_that_step_and_the_stream_goes_on() {
    let sim = spawn_small_simulator(9).await;
    let dir = tempfile::tempdir().unwrap();
    let config = TestConfig::for_simulator(&sim, dir.path(), &[9]);
    let sink = TestSink::new();
    sink.set_mode(FaultMode::Panic);
    let mut daemon = spawn_daemon_with_sink(&config, Some(Arc::new(sink.clone()))).await;
    wait_until("both streams hit the panic more than once", WAIT, || {
        sink.publish_calls() >= 4
    })
    .await;
    assert!(sink.events().is_empty());
    // The bug is gone: the same stream tasks sync everything.
    sink.set_mode(FaultMode::Normal);
    wait_until("tenant 9 synced after the panics", WAIT, || {
        sink.events().len() == 25
    })
    .await;
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_failing_its_health_check_makes_readyz_answer_503_naming_it() {
    let sim = spawn_small_simulator(8).await;
    let dir = tempfile::tempdir().unwrap();
    let config = TestConfig::for_simulator(&sim, dir.path(), &[8]);
    let sink = TestSink::new();
    let mut daemon = spawn_daemon_with_sink(&config, Some(Arc::new(sink.clone()))).await;
    wait_until("tenant 8 synced", WAIT, || sink.events().len() == 25).await;
    let (code, body) = get_json(&format!("{}/readyz", daemon.admin_url)).await;
    assert_eq!(code, 200, "{body}");

    sink.set_mode(FaultMode::Down);
    let (code, body) = get_json(&format!("{}/readyz", daemon.admin_url)).await;
    assert_eq!(code, 503);
    assert_eq!(
        body["reasons"],
        serde_json::json!(["sink test: test sink is down"])
    );
    let (_, status) = get_json(&format!("{}/v1/status", daemon.admin_url)).await;
    assert_eq!(status["sink"]["healthy"], false);

    sink.set_mode(FaultMode::Normal);
    daemon.stop().await;
}

fn runner_for(
    sim: &Simulator,
    token: &str,
    stream: voucher_cdc::stream::StreamKey,
    store: Arc<dyn voucher_cdc::state::StateStore>,
    sink: &TestSink,
    full_resync_interval: Duration,
) -> StreamRunner {
    use voucher_cdc::upstream::client::{ClientOptions, SecretToken, UpstreamClient};
    use voucher_cdc::upstream::ratelimit::RateBudget;
    let client = UpstreamClient::new(
        ClientOptions {
            base_url: sim.base_url().parse().unwrap(),
            max_attempts: 1,
            ..ClientOptions::default()
        },
        SecretToken::new(token),
        Arc::new(RateBudget::new(0)),
    )
    .unwrap();
    let sweeper = common::sweeps::SweeperBuilder::with_client(client, stream)
        .with_store(store)
        .with_sink(Arc::new(sink.clone()))
        .with_settings(voucher_cdc::sweep::SweepSettings::default())
        .build();
    StreamRunner::new(
        sweeper,
        Timing {
            interval: Duration::from_secs(1),
            full_resync_interval,
            park_recheck_interval: Duration::from_secs(300),
            jitter: 0.1,
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scheduler_step_sweeps_full_when_due_and_parks_then_unparks_a_refused_stream() {
    use voucher_cdc::stream::StreamKey;
    let sim = spawn_small_simulator(10).await;
    sim.add_token("only-9", Some(vec![9]), &Permission::ALL);
    let store: Arc<dyn voucher_cdc::state::StateStore> =
        Arc::new(voucher_cdc::state::SledStore::open_temporary().unwrap());
    let sink = TestSink::new();
    let hour = Duration::from_secs(3600);
    let nine = StreamKey::new(9, V);

    let runner = runner_for(&sim, "only-9", nine, store.clone(), &sink, hour);
    let StepOutcome::Swept(first) = runner.run_once(CancellationToken::new()).await else {
        panic!("the first sync sweeps")
    };
    assert_eq!((first.kind, first.snapshots), ("full", 20));
    let StepOutcome::Swept(second) = runner.run_once(CancellationToken::new()).await else {
        panic!("the second step sweeps")
    };
    assert_eq!((second.kind, second.events()), ("incremental", 0));
    let always_full = runner_for(&sim, "only-9", nine, store.clone(), &sink, Duration::ZERO);
    let StepOutcome::Swept(third) = always_full.run_once(CancellationToken::new()).await else {
        panic!("the full step sweeps")
    };
    assert_eq!((third.kind, third.events()), ("full", 0));

    let ten = StreamKey::new(10, V);
    let refused = runner_for(&sim, "only-9", ten, store.clone(), &sink, hour);
    let outcome = refused.run_once(CancellationToken::new()).await;
    let StepOutcome::Parked(cause) = &outcome else {
        panic!("a refused stream parks: {outcome:?}")
    };
    assert!(cause.is_parking(), "the typed cause is kept: {cause:?}");
    let reason = cause.to_string();
    assert!(reason.starts_with("upstream returned 40"), "{reason}");
    let state = store.load_stream(ten).unwrap();
    assert_eq!(state.parked.as_deref(), Some(reason.as_str()));
    assert_eq!(state.last_error.as_deref(), Some(reason.as_str()));

    sim.add_token("only-9", None, &Permission::ALL);
    assert!(refused.run_once(CancellationToken::new()).await.is_ok());
    let state = store.load_stream(ten).unwrap();
    assert_eq!((state.parked, state.last_error), (None, None));
    assert_eq!(state.records_known, 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_the_adaptive_planner_status_shows_each_streams_plan_and_the_tokens_budget() {
    let tenants = [1, 2];
    let (_sim, _dir, config, daemon) = start_synced(2, &tenants, None).await;
    let admin = daemon.admin_url.clone();
    // The first turns are over once every stream has reported its sweep.
    let deadline = std::time::Instant::now() + WAIT;
    let status = loop {
        let (_, status) = get_json(&format!("{admin}/v1/status")).await;
        // A stream's plan shows up with its first turn; its last poll once
        // that turn's sweep reported back.
        let planned = status["streams"].as_array().is_some_and(|s| {
            s.len() == 4
                && s.iter()
                    .all(|s| s["planner"]["seconds_since_last_poll"].is_number())
        });
        if planned {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no plan for every stream: {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for stream in status["streams"].as_array().unwrap() {
        let plan = &stream["planner"];
        assert!(
            ["resting", "waiting", "polling", "full_sweep"]
                .contains(&plan["turn"].as_str().unwrap()),
            "{plan}"
        );
        assert!(
            plan["change_rate_per_minute"].as_f64().unwrap() > 0.0,
            "{plan}"
        );
        assert!(plan["seconds_since_last_poll"].as_f64().is_some(), "{plan}");
        let bound = plan["poll_bound_seconds"].as_f64().unwrap();
        let max_interval = config.config().poll.max_interval.as_secs_f64();
        assert!(bound > 0.0 && bound <= max_interval, "{plan}");
        assert_eq!(
            plan["quiet"].as_bool(),
            Some(false),
            "nothing learnt yet: {plan}"
        );
    }
    let budgets = status["budgets"].as_array().expect("one budget per token");
    assert_eq!(budgets.len(), 1, "{status}");
    let budget = &budgets[0];
    let configured = f64::from(config.config().upstream.requests_per_minute);
    assert_eq!(budget["configured_per_minute"].as_f64(), Some(configured));
    assert_eq!(
        budget["learnt_per_minute"].as_f64(),
        Some(configured),
        "no 429 seen"
    );
    assert_eq!(budget["full_sweep_share_limit"].as_f64(), Some(0.25));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_sync_of_a_live_catalog_tells_the_planner_its_hot_tenants_from_its_idle_ones_before_any_poll(
) {
    // Six hours of skewed changes before the start: tenant 1 changes most,
    // tenant 4 about 4.6 times less, tenant 5 never.
    let sim = common::spawn_simulator_with(voucher_cdc::simulator::SimulatorOptions {
        tenants: 5,
        vouchers: 20,
        categories: 5,
        rate_limit: 0,
        changes_per_minute: 60,
        change_skew: 1.1,
        idle_tenants: 0.2,
        change_history: Duration::from_secs(6 * 3600),
        seed: 17,
        ..Default::default()
    })
    .await;
    let tenants = [1, 2, 3, 4, 5];
    let dir = tempfile::tempdir().unwrap();
    // No poll after the first sync within the test: what the planner knows
    // of the rates comes from the first sync's listings alone.
    let config = TestConfig::for_simulator(&sim, dir.path(), &tenants)
        .with_strategy(voucher_cdc::planner::Strategy::Adaptive)
        .with_poll_interval(Duration::from_secs(600))
        .with_full_resync_interval(Duration::from_secs(3600));
    let daemon = spawn_daemon(&config).await;
    let rate = |status: &Value, tenant: u64| {
        status["streams"].as_array().and_then(|streams| {
            streams
                .iter()
                .find(|s| s["tenant"] == tenant && s["resource"] == "vouchers")
                .and_then(|s| s["planner"]["change_rate_per_minute"].as_f64())
        })
    };
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let (_, status) = get_json(&format!("{}/v1/status", daemon.admin_url)).await;
        let synced = status["streams"].as_array().is_some_and(|s| {
            s.len() == 10
                && s.iter()
                    .all(|s| s["planner"]["seconds_since_last_poll"].is_number())
        });
        if let (true, Some(hot), Some(cold), Some(idle)) =
            (synced, rate(&status, 1), rate(&status, 4), rate(&status, 5))
        {
            if hot > 2.0 * cold && cold > 10.0 * idle {
                break;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the planner's rates do not tell tenant 1 > tenant 4 > idle tenant 5: {status}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
