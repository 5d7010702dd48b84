//! Issue 14: a record the sink can never accept does not stop its stream. It
//! goes out as a dead letter (same id and attributes, no `data`, a `dataref`),
//! is committed as dead-lettered and shown in `status` and metrics, the sweep
//! completes and the watermark moves; a later change that fits is an ordinary
//! `update`, and a replay tries it again. With `on_record_error = "fail"` the
//! sweep fails as before.

mod common;

#[path = "common/brokers.rs"]
#[allow(dead_code)]
mod brokers;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use common::sweeps::SweeperBuilder;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use voucher_cdc::admin::status_from_store;
use voucher_cdc::config::OnRecordError;
use voucher_cdc::event::{Event, EventType};
use voucher_cdc::simulator::Simulator;
use voucher_cdc::sinks::testing::{FaultMode, RejectTarget, TestSink};
use voucher_cdc::sinks::{Sink, SinkError};
use voucher_cdc::state::StreamLedger;
use voucher_cdc::state::{SledStore, StateStore};
use voucher_cdc::stream::{Resource, StreamKey};
use voucher_cdc::sweep::{SweepError, SweepKind, Sweeper};

const TENANT: u64 = 1;
const VOUCHERS: StreamKey = StreamKey {
    tenant: TENANT,
    resource: Resource::Vouchers,
};

/// The process-wide Prometheus recorder, installed once per test binary.
fn metrics() -> &'static metrics_exporter_prometheus::PrometheusHandle {
    static HANDLE: OnceLock<metrics_exporter_prometheus::PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .install_recorder()
            .unwrap()
    })
}

fn sweeper(
    sim: &Simulator,
    store: Arc<dyn StateStore>,
    sink: Arc<dyn Sink>,
    policy: OnRecordError,
) -> Sweeper {
    SweeperBuilder::new(sim, VOUCHERS)
        .with_store(store)
        .with_sink(sink)
        .configure(|settings| settings.on_record_error = policy)
        .build()
}

/// A test sink that refuses record `victim`'s events (not its dead letter) as too large.
fn refusing(victim: i64) -> TestSink {
    let sink = TestSink::new();
    let suffix = format!(":{victim}");
    sink.set_mode(FaultMode::Reject {
        target: RejectTarget::Matching(Arc::new(move |e: &Event| {
            e.ty != EventType::DeadLetter && e.partition_key.ends_with(&suffix)
        })),
        error: SinkError::Rejected {
            reason: "test sink: event is 3000000 bytes, more than the limit of 1048576".into(),
            limit: Some(1_048_576),
        },
    });
    sink
}

/// A simulator with `vouchers` vouchers, a fresh store, and a sweeper whose
/// test sink refuses the events of the record at `victim_index`.
struct Harness {
    sim: Simulator,
    _dir: tempfile::TempDir,
    store: Arc<dyn StateStore>,
    sink: TestSink,
    sweeper: Sweeper,
    victim: i64,
}

async fn harness(vouchers: usize, victim_index: usize, policy: OnRecordError) -> Harness {
    let sim = common::spawn_catalog(1, vouchers, 1).await;
    let victim = sim.record_ids(TENANT, Resource::Vouchers)[victim_index];
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn StateStore> = Arc::new(SledStore::open(&dir.path().join("state")).unwrap());
    let sink = refusing(victim);
    let sweeper = sweeper(&sim, store.clone(), Arc::new(sink.clone()), policy);
    Harness {
        sim,
        _dir: dir,
        store,
        sink,
        sweeper,
        victim,
    }
}

fn json(e: &Event) -> Value {
    serde_json::from_slice(&e.payload).unwrap()
}

fn for_record(events: &[Event], id: i64) -> Vec<Value> {
    events
        .iter()
        .map(json)
        .filter(|v| v["subject"].as_str().and_then(|s| s.parse::<i64>().ok()) == Some(id))
        .collect()
}

#[tokio::test]
async fn a_record_the_sink_refuses_goes_out_as_a_dead_letter_and_the_stream_completes_and_moves_on()
{
    let metrics = metrics();
    let Harness {
        sim,
        _dir,
        store,
        sink,
        sweeper,
        victim,
    } = harness(40, 7, OnRecordError::DeadLetter).await;
    let ids = sim.record_ids(TENANT, Resource::Vouchers);
    let other = ids[20];
    let report = sweeper
        .run(SweepKind::Incremental, &CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(report.dead_lettered, 1);
    assert_eq!(report.snapshots as usize, ids.len() - 1);
    let state = store.load_stream(VOUCHERS).unwrap();
    assert!(state.watermark.is_some(), "the first sync completed");
    assert_eq!(state.last_error, None);

    // Every other record arrived as a snapshot; the victim only as a dead letter.
    let acked = sink.events();
    let letters: Vec<&Event> = acked
        .iter()
        .filter(|e| e.ty == EventType::DeadLetter)
        .collect();
    assert_eq!(letters.len(), 1);
    let letter = json(letters[0]);
    assert_eq!(letters[0].id, letter["id"].as_str().unwrap());
    assert_eq!(letter["type"], "voucher.updated");
    assert_eq!(letter["subject"], victim.to_string());
    assert_eq!(letter["tenant"], TENANT);
    assert_eq!(letter["op"], "snapshot");
    assert_eq!(letter["contenthash"].as_str().unwrap().len(), 32);
    assert!(letter.get("data").is_none(), "{letter}");
    assert_eq!(
        letter["dataref"],
        format!("/tenants/{TENANT}/catalog/vouchers/{victim}")
    );
    assert!(letter["deadletterreason"]
        .as_str()
        .unwrap()
        .contains("more than the limit"));
    assert_eq!(letter["deadletterlimit"], 1_048_576);
    for id in ids.iter().filter(|id| **id != victim) {
        let events = for_record(&acked, *id);
        assert_eq!(events.len(), 1, "record {id}");
        assert_eq!(events[0]["op"], "snapshot");
    }

    // status and metrics show it.
    let status = status_from_store(store.as_ref(), &[VOUCHERS], chrono::Utc::now()).unwrap();
    assert_eq!(status[0].dead_letters.len(), 1);
    assert_eq!(status[0].dead_letters[0].record_id, victim);
    assert!(status[0].dead_letters[0].reason.contains("3000000 bytes"));
    let text = metrics.render();
    assert!(
        text.lines()
            .any(|l| l.starts_with("voucher_cdc_dead_letters_total")
                && l.contains(&format!("tenant=\"{TENANT}\""))
                && l.contains("resource=\"vouchers\"")
                && l.contains("reason=\"too_large\"")),
        "{text}"
    );

    // Later changes: incremental (updated_since), ordinary updates; the
    // victim's new version fits and its previoushash is the dead-lettered hash.
    sink.set_mode(FaultMode::Normal);
    sink.take();
    sim.clear_request_log();
    assert!(sim.update(TENANT, Resource::Vouchers, other));
    assert!(sim.update(TENANT, Resource::Vouchers, victim));
    let report = sweeper
        .run(SweepKind::Incremental, &CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(report.dead_lettered, 0);
    let lists: Vec<_> = sim
        .request_log()
        .into_iter()
        .filter(|r| r.path.ends_with("/vouchers"))
        .collect();
    assert!(!lists.is_empty());
    assert!(
        lists
            .iter()
            .all(|r| r.query.as_deref().unwrap_or("").contains("updated_since")),
        "{lists:?}"
    );
    let acked = sink.events();
    let other_events = for_record(&acked, other);
    assert_eq!(other_events.len(), 1);
    assert_eq!(other_events[0]["op"], "update");
    let victim_events = for_record(&acked, victim);
    assert_eq!(victim_events.len(), 1, "{victim_events:?}");
    assert_eq!(victim_events[0]["op"], "update");
    assert_eq!(victim_events[0]["previoushash"], letter["contenthash"]);
    assert!(victim_events[0].get("data").is_some());
    let status = status_from_store(store.as_ref(), &[VOUCHERS], chrono::Utc::now()).unwrap();
    assert!(status[0].dead_letters.is_empty(), "{:?}", status[0]);
}

#[tokio::test]
async fn a_replay_tries_a_dead_lettered_record_again_and_clears_its_mark() {
    let Harness {
        sim: _sim,
        _dir,
        store,
        sink,
        sweeper,
        victim,
    } = harness(10, 2, OnRecordError::DeadLetter).await;
    sweeper
        .run(SweepKind::Incremental, &CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(store.dead_letters(VOUCHERS).unwrap().len(), 1);

    sink.set_mode(FaultMode::Normal);
    sink.take();
    StreamLedger::new(store.as_ref(), VOUCHERS)
        .schedule_replay(
            None,
            voucher_cdc::state::RequestedBy::Cli,
            chrono::Utc::now(),
        )
        .unwrap();
    sweeper
        .run(SweepKind::Incremental, &CancellationToken::new())
        .await
        .unwrap();
    let events = for_record(&sink.events(), victim);
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["op"], "snapshot");
    assert!(events[0]["replayid"].is_string());
    assert!(store.dead_letters(VOUCHERS).unwrap().is_empty());
}

#[tokio::test]
async fn with_on_record_error_fail_a_refused_record_fails_the_sweep_as_before() {
    let Harness {
        sim: _sim,
        _dir,
        store,
        sink,
        sweeper,
        victim: _,
    } = harness(10, 2, OnRecordError::Fail).await;
    let err = sweeper
        .run(SweepKind::Incremental, &CancellationToken::new())
        .await
        .unwrap_err();
    assert!(matches!(err, SweepError::SinkRejected { .. }), "{err}");
    let state = store.load_stream(VOUCHERS).unwrap();
    assert_eq!(state.watermark, None);
    assert!(state.last_error.unwrap().contains("more than the limit"));
    assert!(sink.events().iter().all(|e| e.ty != EventType::DeadLetter));
    assert!(store.dead_letters(VOUCHERS).unwrap().is_empty());
}

#[tokio::test]
async fn a_sink_wide_fatal_error_still_fails_the_sweep_under_dead_letter() {
    let sim = common::spawn_catalog(1, 10, 1).await;
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn StateStore> = Arc::new(SledStore::open(&dir.path().join("state")).unwrap());
    let sink = TestSink::new();
    sink.set_mode(FaultMode::Reject {
        target: RejectTarget::Index(3),
        error: SinkError::Fatal("test sink: not authorized".into()),
    });
    let sweeper = sweeper(
        &sim,
        store.clone(),
        Arc::new(sink.clone()),
        OnRecordError::DeadLetter,
    );
    let err = sweeper
        .run(SweepKind::Incremental, &CancellationToken::new())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not authorized"), "{err}");
    assert_eq!(store.load_stream(VOUCHERS).unwrap().watermark, None);
    assert!(sink.events().iter().all(|e| e.ty != EventType::DeadLetter));
}

/// Every message of the NATS stream, by sequence: (subject, payload JSON).
async fn stored_messages(url: &str) -> Vec<(String, Value)> {
    let client = async_nats::connect(url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let mut stream = js.get_stream("VOUCHER_CDC").await.unwrap();
    let count = stream.info().await.unwrap().state.messages;
    let mut out = Vec::new();
    for sequence in 1..=count {
        let message = stream.get_raw_message(sequence).await.unwrap();
        out.push((
            message.subject.to_string(),
            serde_json::from_slice(&message.payload).unwrap(),
        ));
    }
    out
}

/// The snapshot events of `sim`'s vouchers from a dry run into a test sink,
/// largest first, with the two largest payload sizes: a broker limit between
/// them makes exactly one event too large.
async fn event_sizes(
    sim: &Simulator,
    size: impl Fn(&voucher_cdc::event::Event) -> usize,
) -> (Vec<(usize, Value)>, usize, usize) {
    let dry = TestSink::new();
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn StateStore> = Arc::new(SledStore::open(&dir.path().join("state")).unwrap());
    sweeper(sim, store, Arc::new(dry.clone()), OnRecordError::DeadLetter)
        .run(SweepKind::Incremental, &CancellationToken::new())
        .await
        .unwrap();
    let mut sized: Vec<(usize, Value)> = dry.events().iter().map(|e| (size(e), json(e))).collect();
    sized.sort_by_key(|(len, _)| std::cmp::Reverse(*len));
    let (largest, second) = (sized[0].0, sized[1].0);
    assert!(
        largest > second + 4,
        "the two largest events are {largest} and {second} bytes"
    );
    (sized, largest, second)
}

#[tokio::test]
async fn a_record_larger_than_the_nats_servers_max_payload_goes_to_the_deadletter_subject_and_the_stream_moves_on(
) {
    let sim = common::spawn_catalog(1, 30, 1).await;
    // Sized as the sink counts them: payload, id and headers.
    let (sized, largest, second) = event_sizes(&sim, |e| {
        voucher_cdc::sinks::nats::message_size(e, &voucher_cdc::sinks::nats::routing_headers(e))
    })
    .await;
    let victim: i64 = sized[0].1["subject"].as_str().unwrap().parse().unwrap();
    let max_payload = (largest + second) / 2;

    let Some(nats) = brokers::spawn_nats_with_max_payload(max_payload) else {
        return;
    };
    let (_dir, store, sink) = brokers::store_and_nats_sink(&nats.url()).await;
    let report = sweeper(&sim, store.clone(), sink, OnRecordError::DeadLetter)
        .run(SweepKind::Incremental, &CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(report.dead_lettered, 1);
    assert_eq!(report.snapshots as usize, sized.len() - 1);
    assert!(store.load_stream(VOUCHERS).unwrap().watermark.is_some());

    let messages = stored_messages(&nats.url()).await;
    assert_eq!(messages.len(), sized.len());
    let letters: Vec<&(String, Value)> = messages
        .iter()
        .filter(|(subject, _)| subject == &format!("voucher_cdc.{TENANT}.deadletter"))
        .collect();
    assert_eq!(
        letters.len(),
        1,
        "{:?}",
        messages.iter().map(|m| &m.0).collect::<Vec<_>>()
    );
    let letter = &letters[0].1;
    assert_eq!(letter["subject"], victim.to_string());
    assert_eq!(letter["type"], "voucher.updated");
    assert_eq!(letter["op"], "snapshot");
    assert_eq!(
        letter["id"], sized[0].1["id"],
        "the dead letter keeps the event id"
    );
    assert_eq!(letter["contenthash"], sized[0].1["contenthash"]);
    assert!(letter.get("data").is_none());
    assert_eq!(letter["deadletterlimit"], max_payload);
    assert!(letter["deadletterreason"]
        .as_str()
        .unwrap()
        .contains("max_payload"));
    let status = status_from_store(store.as_ref(), &[VOUCHERS], chrono::Utc::now()).unwrap();
    assert_eq!(status[0].dead_letters.len(), 1);
    assert_eq!(status[0].dead_letters[0].record_id, victim);
}

#[tokio::test]
async fn a_dead_letter_matches_its_published_schema() {
    let schema: Value = serde_json::from_str(include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/schemas/deadletter.schema.json"
    )))
    .unwrap();
    let validator = jsonschema::draft202012::new(&schema).unwrap();
    let Harness {
        sim: _sim,
        _dir,
        sink,
        sweeper,
        store: _store,
        victim: _,
    } = harness(5, 1, OnRecordError::DeadLetter).await;
    sweeper
        .run(SweepKind::Incremental, &CancellationToken::new())
        .await
        .unwrap();
    let letters: Vec<Value> = sink
        .events()
        .iter()
        .filter(|e| e.ty == EventType::DeadLetter)
        .map(json)
        .collect();
    assert_eq!(letters.len(), 1);
    let problems: Vec<String> = validator
        .iter_errors(&letters[0])
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect();
    assert!(problems.is_empty(), "{problems:?}\n{}", letters[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_larger_than_kafkas_message_max_bytes_goes_to_the_dead_letter_topic_and_the_stream_moves_on(
) {
    let sim = common::spawn_catalog(1, 30, 1).await;
    // Sized as the sink counts them: value, key and headers.
    let (sized, largest, second) = event_sizes(&sim, |e| {
        let record = voucher_cdc::sinks::kafka::record_parts(e, Default::default()).unwrap();
        record.size(e) as usize
    })
    .await;
    let victim = sized[0].1["subject"].as_str().unwrap().to_string();
    let cluster = rdkafka::mocking::MockCluster::new(1).unwrap();
    for topic in ["voucher_cdc.vouchers", "voucher_cdc.deadletter"] {
        cluster.create_topic(topic, 3, 1).unwrap();
    }
    let bootstrap = cluster.bootstrap_servers();
    // Every event but the largest fits.
    let limit = second;
    assert!(largest > limit, "{largest} and {second} bytes");
    let mut config = voucher_cdc::sinks::kafka::KafkaSinkConfig {
        message_timeout: Duration::from_secs(3),
        ..voucher_cdc::sinks::kafka::KafkaSinkConfig::new(&bootstrap)
    };
    config
        .properties
        .insert("message.max.bytes".to_string(), limit.to_string());
    let sink = voucher_cdc::sinks::kafka::KafkaSink::new(&config, &[VOUCHERS])
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn StateStore> = Arc::new(SledStore::open(&dir.path().join("state")).unwrap());
    let report = sweeper(
        &sim,
        store.clone(),
        Arc::new(sink),
        OnRecordError::DeadLetter,
    )
    .run(SweepKind::Incremental, &CancellationToken::new())
    .await
    .unwrap();
    assert_eq!(report.dead_lettered, 1);
    assert_eq!(report.snapshots as usize, sized.len() - 1);
    assert!(store.load_stream(VOUCHERS).unwrap().watermark.is_some());

    let records = brokers::consume_all(
        &bootstrap,
        &["voucher_cdc.vouchers", "voucher_cdc.deadletter"],
        3,
        sized.len(),
        Duration::from_secs(20),
    );
    assert_eq!(records.len(), sized.len());
    let letters: Vec<Value> = records
        .iter()
        .filter(|r| r.topic == "voucher_cdc.deadletter")
        .map(|r| serde_json::from_slice(r.payload.as_deref().unwrap()).unwrap())
        .collect();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0]["subject"], victim);
    assert_eq!(letters[0]["id"], sized[0].1["id"]);
    assert_eq!(letters[0]["deadletterlimit"], limit);
    assert!(letters[0]["deadletterreason"]
        .as_str()
        .unwrap()
        .contains("message.max.bytes"));
    assert!(letters[0].get("data").is_none());
    let events: Vec<Value> = records
        .iter()
        .filter(|r| r.topic == "voucher_cdc.vouchers")
        .map(|r| serde_json::from_slice(r.payload.as_deref().unwrap()).unwrap())
        .collect();
    assert!(events
        .iter()
        .all(|e| e["op"] == "snapshot" && e["subject"] != victim));
}

#[tokio::test]
async fn a_2_mb_record_against_a_nats_server_with_default_limits_is_dead_lettered_and_a_later_fitting_version_is_an_update(
) {
    let sim = common::spawn_catalog(1, 30, 1).await;
    let victim = sim.record_ids(TENANT, Resource::Vouchers)[7];
    assert!(sim.set_oversize(TENANT, Resource::Vouchers, victim, 2_100_000));
    let Some(nats) = brokers::spawn_nats() else {
        return;
    };
    let (_dir, store, sink) = brokers::store_and_nats_sink(&nats.url()).await;
    let sweeper = sweeper(&sim, store.clone(), sink, OnRecordError::DeadLetter);
    let report = sweeper
        .run(SweepKind::Incremental, &CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(report.dead_lettered, 1);
    assert_eq!(report.snapshots, 29);
    assert!(store.load_stream(VOUCHERS).unwrap().watermark.is_some());
    let messages = stored_messages(&nats.url()).await;
    let letter = messages
        .iter()
        .find(|(subject, _)| subject == &format!("voucher_cdc.{TENANT}.deadletter"))
        .map(|(_, body)| body.clone())
        .expect("the dead letter is in the stream");
    assert_eq!(letter["subject"], victim.to_string());
    assert_eq!(
        letter["deadletterlimit"],
        1024 * 1024,
        "NATS's default max_payload"
    );
    assert_eq!(
        letter["dataref"],
        format!("/tenants/{TENANT}/catalog/vouchers/{victim}")
    );

    // The record shrinks again: an ordinary update against the dead-lettered hash.
    assert!(sim.set_oversize(TENANT, Resource::Vouchers, victim, 0));
    sim.update(TENANT, Resource::Vouchers, victim);
    sweeper
        .run(SweepKind::Incremental, &CancellationToken::new())
        .await
        .unwrap();
    let messages = stored_messages(&nats.url()).await;
    let (subject, update) = messages.last().unwrap();
    assert_eq!(subject, &format!("voucher_cdc.{TENANT}.voucher.updated"));
    assert_eq!(update["subject"], victim.to_string());
    assert_eq!(update["op"], "update");
    assert_eq!(update["previoushash"], letter["contenthash"]);
    let status = status_from_store(store.as_ref(), &[VOUCHERS], chrono::Utc::now()).unwrap();
    assert!(status[0].dead_letters.is_empty(), "the mark is cleared");
}
