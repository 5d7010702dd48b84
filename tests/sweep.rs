//! The sweep against the in-process simulator over loopback HTTP, a real sled
//! store in a temp dir, and the in-memory test sink with its fault modes.

mod common;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use common::sweeps::SweeperBuilder;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use voucher_cdc::hash::{content_hash, IgnoreKeys};
use voucher_cdc::simulator::Simulator;
use voucher_cdc::sinks::testing::{FaultMode, TestSink};
use voucher_cdc::sinks::Sink;
use voucher_cdc::state::SledStore;
use voucher_cdc::state::StreamLedger;
use voucher_cdc::state::{
    Acked, DeadLetter, DeleteCommit, Intent, PageCommit, RecordState, StateError, StateStore,
    StreamState, Tombstone,
};
use voucher_cdc::stream::{Resource, StreamKey};
use voucher_cdc::sweep::{SweepError, SweepKind, SweepReport, SweepSettings, Sweeper};
use voucher_cdc::upstream::client::UpstreamClient;

const V: Resource = Resource::Vouchers;
const C: Resource = Resource::Categories;

struct Harness {
    sim: Arc<Simulator>,
    dir: tempfile::TempDir,
    store: Arc<dyn StateStore>,
    sink: TestSink,
    client: UpstreamClient,
    settings: SweepSettings,
}

async fn spawn_harness(tenants: u64, vouchers: usize, categories: usize) -> Harness {
    let sim = Arc::new(common::spawn_catalog(tenants, vouchers, categories).await);
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn StateStore> = Arc::new(SledStore::open(&state_path(dir.path())).unwrap());
    let client = common::bridge_client(&sim);
    let settings = SweepSettings {
        sink_backoff_initial: Duration::from_millis(5),
        sink_backoff_max: Duration::from_millis(20),
        ..SweepSettings::default()
    };
    Harness {
        sim,
        dir,
        store,
        sink: TestSink::new(),
        client,
        settings,
    }
}

fn state_path(dir: &Path) -> PathBuf {
    dir.join("state")
}

impl Harness {
    fn sweeper(&self, stream: StreamKey) -> Sweeper {
        self.sweeper_with(stream, self.store.clone())
    }

    fn sweeper_with(&self, stream: StreamKey, store: Arc<dyn StateStore>) -> Sweeper {
        self.builder(stream).with_store(store).build()
    }

    /// A builder with the harness's client, store, sink and settings.
    fn builder(&self, stream: StreamKey) -> SweeperBuilder {
        SweeperBuilder::with_client(self.client.clone(), stream)
            .with_store(self.store.clone())
            .with_sink(Arc::new(self.sink.clone()) as Arc<dyn Sink>)
            .with_settings(self.settings.clone())
    }

    /// A sweeper of `stream` whose listings may take `floor` pages before
    /// the records known count (`poll.max_pages_floor`).
    fn sweeper_with_floor(&self, stream: StreamKey, floor: u64) -> Sweeper {
        let mut settings = self.settings.clone();
        settings.max_pages_floor = floor;
        self.builder(stream).with_settings(settings).build()
    }

    async fn sweep(&self, tenant: u64, resource: Resource, kind: SweepKind) -> Vec<Value> {
        self.sink.take();
        self.sweeper(StreamKey::new(tenant, resource))
            .run(kind, &CancellationToken::new())
            .await
            .expect("sweep succeeds");
        self.sink.take().iter().map(json).collect()
    }

    /// An incremental sweep of `stream` the test drives and then drops, as
    /// a process killed in the middle of it.
    fn droppable_sweep(
        &self,
        stream: StreamKey,
    ) -> std::pin::Pin<Box<impl std::future::Future<Output = Result<SweepReport, SweepError>>>>
    {
        let sweeper = self.sweeper(stream);
        Box::pin(async move {
            sweeper
                .run(SweepKind::Incremental, &CancellationToken::new())
                .await
        })
    }

    /// Drops and reopens the sled store, as a restarted process would.
    fn reopen(&mut self) {
        let path = state_path(self.dir.path());
        let placeholder: Arc<dyn StateStore> = Arc::new(SledStore::open_temporary().unwrap());
        let old = std::mem::replace(&mut self.store, placeholder);
        drop(old);
        self.store = Arc::new(SledStore::open(&path).unwrap());
    }

    fn hash_of(&self, tenant: u64, resource: Resource, id: i64) -> String {
        let raw = self.sim.record_json(tenant, resource, id, true).unwrap();
        content_hash(&raw, &IgnoreKeys::new(["updated_at"]))
            .unwrap()
            .to_hex()
    }
}

/// Every event a test looks at is first validated against the published
/// JSON Schema: real emitted events of every type and op.
fn json(e: &voucher_cdc::event::Event) -> Value {
    common::schema::assert_valid_event(&e.payload);
    serde_json::from_slice(&e.payload).unwrap()
}

/// True when the event is about record `id` (`subject` is the id as a string).
/// Refuses every event of record `id`, as a fatal error (a poison record).
fn reject_record_fatally(id: i64) -> FaultMode {
    let suffix = format!(":{id}");
    FaultMode::Reject {
        target: voucher_cdc::sinks::testing::RejectTarget::Matching(Arc::new(move |e| {
            e.partition_key.ends_with(&suffix)
        })),
        error: voucher_cdc::sinks::SinkError::Fatal("rejected".into()),
    }
}

fn subject_is(event: &Value, id: i64) -> bool {
    event["subject"].as_str() == Some(id.to_string().as_str())
}

fn subjects(events: &[Value]) -> Vec<i64> {
    let mut ids: Vec<i64> = events
        .iter()
        .map(|e| e["subject"].as_str().unwrap().parse().unwrap())
        .collect();
    ids.sort();
    ids
}

#[tokio::test]
async fn initial_sync_emits_every_record_exactly_once_as_snapshot_with_the_api_bytes() {
    let h = spawn_harness(1, 120, 7).await;
    for resource in [V, C] {
        let stream = StreamKey::new(1, resource);
        h.sink.take();
        let report = h
            .sweeper(stream)
            .run(SweepKind::Incremental, &CancellationToken::new())
            .await
            .unwrap();
        let events = h.sink.take();
        let mut expected = h.sim.record_ids(1, resource);
        expected.sort();
        let values: Vec<Value> = events.iter().map(json).collect();
        assert_eq!(subjects(&values), expected, "one event per record");
        assert_eq!(report.snapshots as usize, expected.len());
        for (e, v) in events.iter().zip(&values) {
            assert_eq!(v["op"], "snapshot");
            assert_eq!(v["specversion"], "1.0");
            assert_eq!(v["tenant"], 1);
            assert_eq!(
                v["type"],
                if resource == V {
                    "voucher.updated"
                } else {
                    "category.updated"
                }
            );
            let id: i64 = v["subject"].as_str().unwrap().parse().unwrap();
            // `data` is byte-for-byte the record the API returned.
            let raw = h.sim.record_json(1, resource, id, true).unwrap();
            let payload = std::str::from_utf8(&e.payload).unwrap();
            assert!(
                payload.contains(&format!("\"data\":{raw}")),
                "data of {id} is not the API's bytes"
            );
            assert_eq!(v["contenthash"], h.hash_of(1, resource, id));
            assert!(v.get("previoushash").is_none());
            assert_eq!(v["id"].as_str().unwrap().len(), 32);
            assert_eq!(v["partitionkey"], format!("1:{}:{id}", resource.singular()));
        }
        let state = h.store.load_stream(stream).unwrap();
        assert!(state.watermark.is_some());
        assert_eq!(state.records_known as usize, expected.len());
    }
}

#[tokio::test]
async fn a_second_sweep_with_no_upstream_change_emits_nothing() {
    let h = spawn_harness(1, 80, 3).await;
    assert_eq!(h.sweep(1, V, SweepKind::Incremental).await.len(), 80);
    assert!(h.sweep(1, V, SweepKind::Incremental).await.is_empty());
    assert!(h.sweep(1, V, SweepKind::Full).await.is_empty());
}

#[tokio::test]
async fn creates_updates_and_touches_give_exactly_the_right_events() {
    let h = spawn_harness(1, 60, 3).await;
    let first = h.sweep(1, V, SweepKind::Incremental).await;
    let hash_before: HashMap<String, String> = first
        .iter()
        .map(|e| {
            (
                e["subject"].as_str().unwrap().to_string(),
                e["contenthash"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let ids = h.sim.record_ids(1, V);
    let created = h.sim.create(1, V);
    assert!(h.sim.update(1, V, ids[3]));
    assert!(h.sim.touch(1, V, ids[7]));

    let events = h.sweep(1, V, SweepKind::Incremental).await;
    assert_eq!(subjects(&events), {
        let mut v = vec![created, ids[3]];
        v.sort();
        v
    });
    for e in &events {
        let id: i64 = e["subject"].as_str().unwrap().parse().unwrap();
        if id == created {
            assert_eq!(e["op"], "create");
            assert!(e.get("previoushash").is_none());
        } else {
            assert_eq!(e["op"], "update");
            assert_eq!(e["previoushash"], hash_before[&id.to_string()].as_str());
            assert_eq!(e["contenthash"], h.hash_of(1, V, id));
            assert_ne!(e["contenthash"], e["previoushash"]);
        }
    }
    // Nothing further once committed.
    assert!(h.sweep(1, V, SweepKind::Incremental).await.is_empty());
}

#[tokio::test]
async fn deletes_are_emitted_by_the_full_sweep_only_with_the_last_hash() {
    let h = spawn_harness(1, 60, 3).await;
    let first = h.sweep(1, V, SweepKind::Incremental).await;
    let ids = h.sim.record_ids(1, V);
    let gone = ids[10];
    let last_hash = first.iter().find(|e| subject_is(e, gone)).unwrap()["contenthash"].clone();
    assert!(h.sim.delete(1, V, gone));

    assert!(h.sweep(1, V, SweepKind::Incremental).await.is_empty());
    let events = h.sweep(1, V, SweepKind::Full).await;
    assert_eq!(events.len(), 1);
    let e = &events[0];
    assert_eq!(e["type"], "voucher.deleted");
    assert_eq!(e["op"], "delete");
    assert_eq!(e["subject"], gone.to_string());
    assert_eq!(e["previoushash"], last_hash);
    assert_eq!(e["data"], serde_json::json!({ "id": gone }));
    // Deleted once: the next full sweep is quiet.
    assert!(h.sweep(1, V, SweepKind::Full).await.is_empty());
    assert_eq!(
        h.store
            .load_stream(StreamKey::new(1, V))
            .unwrap()
            .records_known,
        59
    );
}

#[tokio::test]
async fn a_full_sweep_refuses_to_delete_more_than_the_configured_fraction() {
    let h = spawn_harness(1, 40, 3).await;
    let stream = StreamKey::new(1, V);
    h.sweep(1, V, SweepKind::Incremental).await;
    let watermark = h.store.load_stream(stream).unwrap().watermark;
    for id in h.sim.record_ids(1, V).into_iter().take(30) {
        h.sim.delete(1, V, id);
    }
    h.sink.take();
    let err = h
        .sweeper(stream)
        .run(SweepKind::Full, &CancellationToken::new())
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            SweepError::DeleteGuard {
                would_delete: 30,
                known: 40,
                ..
            }
        ),
        "{err}"
    );
    assert!(h.sink.take().is_empty(), "no delete was published");
    let state = h.store.load_stream(stream).unwrap();
    assert!(state
        .last_error
        .unwrap()
        .contains("refused to delete 30 of 40"));
    assert_eq!(
        state.watermark, watermark,
        "a failed sweep never moves the watermark"
    );
    assert_eq!(h.store.record_count(stream).unwrap(), 40);
}

#[tokio::test]
async fn records_sharing_a_timestamp_across_page_boundaries_are_all_seen() {
    let h = spawn_harness(1, 130, 2).await;
    h.sweep(1, V, SweepKind::Incremental).await;
    let tie: DateTime<Utc> = Utc::now() + chrono::Duration::seconds(5);
    let ids = h.sim.record_ids(1, V);
    for id in ids.iter().take(120) {
        h.sim.update(1, V, *id);
        h.sim.set_updated_at(1, V, *id, Some(tie));
    }
    let events = h.sweep(1, V, SweepKind::Incremental).await;
    let mut expected: Vec<i64> = ids.iter().take(120).copied().collect();
    expected.sort();
    assert_eq!(subjects(&events), expected);
    assert!(events.iter().all(|e| e["op"] == "update"));
}

#[tokio::test]
async fn a_late_commit_inside_the_lookback_is_caught_and_one_outside_waits_for_the_full_sweep() {
    let mut h = spawn_harness(1, 50, 2).await;
    h.settings.lookback = Duration::from_secs(60);
    let stream = StreamKey::new(1, V);
    h.sweep(1, V, SweepKind::Incremental).await;
    let watermark = h.store.load_stream(stream).unwrap().watermark.unwrap();
    let ids = h.sim.record_ids(1, V);
    // Committed upstream after our sweep, but stamped before its server_time.
    h.sim.update(1, V, ids[1]);
    h.sim.set_updated_at(
        1,
        V,
        ids[1],
        Some(watermark - chrono::Duration::seconds(30)),
    );
    h.sim.update(1, V, ids[2]);
    h.sim.set_updated_at(
        1,
        V,
        ids[2],
        Some(watermark - chrono::Duration::seconds(600)),
    );

    let events = h.sweep(1, V, SweepKind::Incremental).await;
    assert_eq!(subjects(&events), vec![ids[1]]);
    let events = h.sweep(1, V, SweepKind::Full).await;
    assert_eq!(subjects(&events), vec![ids[2]]);
    assert_eq!(events[0]["op"], "update");
}

#[tokio::test]
async fn a_record_updated_while_the_sweep_pages_ends_with_its_latest_version_committed() {
    let h = spawn_harness(1, 150, 2).await;
    let stream = StreamKey::new(1, V);
    h.sweep(1, V, SweepKind::Incremental).await;
    let ids = h.sim.record_ids(1, V);
    // Touch everything so the incremental sweep pages through 150 records.
    for id in &ids {
        h.sim.touch(1, V, *id);
    }
    let target = ids[0];
    let sim = h.sim.clone();
    let calls = Arc::new(AtomicUsize::new(0));
    let sweeper = {
        let sim = sim.clone();
        let calls = calls.clone();
        h.builder(stream)
            // No page is listed before the one before it is processed (a
            // budget smaller than a page): the update made after the first
            // page is in a page listed after it.
            .configure(|settings| settings.read_ahead_bytes = 0)
            .with_progress(Arc::new(move |_, _, _| {
                if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                    sim.update(1, V, target);
                }
            }))
            .build()
    };
    h.sink.take();
    sweeper
        .run(SweepKind::Incremental, &CancellationToken::new())
        .await
        .unwrap();
    let events: Vec<Value> = h.sink.take().iter().map(json).collect();
    assert!(events
        .iter()
        .any(|e| subject_is(e, target) && e["contenthash"] == h.hash_of(1, V, target)));
    let rec = h.store.get_records(stream, &[target]).unwrap()[0].unwrap();
    assert_eq!(rec.hash.to_hex(), h.hash_of(1, V, target));
}

#[tokio::test]
async fn replay_re_emits_every_record_of_one_stream_and_nothing_of_the_others() {
    let h = spawn_harness(2, 70, 5).await;
    let streams = [
        StreamKey::new(1, V),
        StreamKey::new(1, C),
        StreamKey::new(2, V),
        StreamKey::new(2, C),
    ];
    for s in streams {
        h.sweep(s.tenant, s.resource, SweepKind::Incremental).await;
    }
    let replay_id = StreamLedger::new(h.store.as_ref(), StreamKey::new(2, V))
        .schedule_replay(None, voucher_cdc::state::RequestedBy::Cli, Utc::now())
        .unwrap();
    for s in streams {
        let events = h.sweep(s.tenant, s.resource, SweepKind::Incremental).await;
        if s != StreamKey::new(2, V) {
            assert!(events.is_empty(), "{s} must be untouched by the replay");
            continue;
        }
        assert_eq!(events.first().unwrap()["type"], "replay.started");
        assert_eq!(events.last().unwrap()["type"], "replay.completed");
        assert_eq!(events.last().unwrap()["data"]["records"], 70);
        let records = &events[1..events.len() - 1];
        let mut expected = h.sim.record_ids(2, V);
        expected.sort();
        assert_eq!(subjects(records), expected);
        assert!(records
            .iter()
            .all(|e| e["op"] == "snapshot" && e["replayid"] == replay_id.as_str()));
    }
    let state = h.store.load_stream(StreamKey::new(2, V)).unwrap();
    assert!(!state.replay.unwrap().pending);
    // The replay is done: the next sweep is quiet again.
    assert!(h.sweep(2, V, SweepKind::Incremental).await.is_empty());
}

#[tokio::test]
async fn a_retriable_sink_outage_is_waited_out_without_committing() {
    let h = spawn_harness(1, 60, 2).await;
    let stream = StreamKey::new(1, V);
    h.sink.set_mode(FaultMode::Down);
    let sweeper = h.sweeper(stream);
    let task = tokio::spawn(async move {
        sweeper
            .run(SweepKind::Incremental, &CancellationToken::new())
            .await
    });
    // The outage is really hit: the sink is called (and fails) several times.
    let sink = h.sink.clone();
    common::wait_until(
        "three failed publish calls",
        Duration::from_secs(30),
        || sink.publish_calls() >= 3,
    )
    .await;
    assert!(
        h.sink.events().is_empty(),
        "nothing acknowledged while down"
    );
    assert_eq!(
        h.store.record_count(stream).unwrap(),
        0,
        "nothing committed while down"
    );
    assert!(h.store.load_stream(stream).unwrap().watermark.is_none());
    h.sink.set_mode(FaultMode::Normal);
    let report = task.await.unwrap().unwrap();
    assert_eq!(report.snapshots, 60);
    assert_eq!(h.store.record_count(stream).unwrap(), 60);
}

/// A store that runs `hook` with the method's name before every call: a crash
/// (the hook's error) or an upstream change injected between two steps.
struct HookedStore {
    inner: Arc<dyn StateStore>,
    hook: Box<dyn Fn(&'static str) -> Result<(), StateError> + Send + Sync>,
}

/// The calls that change the store.
const MUTATING: [&str; 4] = [
    "save_stream",
    "write_intents",
    "commit_page",
    "commit_deletes",
];

/// A store that fails its `fail_at`-th mutating call (a crash between two
/// steps), counting the mutating calls in `calls`.
fn crashing_store(
    inner: Arc<dyn StateStore>,
    fail_at: usize,
    calls: Arc<AtomicUsize>,
) -> Arc<dyn StateStore> {
    Arc::new(HookedStore {
        inner,
        hook: Box::new(move |what| {
            if !MUTATING.contains(&what) {
                return Ok(());
            }
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            if n == fail_at {
                return Err(StateError::Io {
                    path: PathBuf::from("crash"),
                    source: std::io::Error::other(format!("injected crash before {what}")),
                });
            }
            Ok(())
        }),
    })
}

impl StateStore for HookedStore {
    fn print_secret(&self) -> Option<[u8; voucher_cdc::hash::PRINT_SECRET_LEN]> {
        self.inner.print_secret()
    }
    fn load_stream(&self, key: StreamKey) -> Result<StreamState, StateError> {
        (self.hook)("load_stream")?;
        self.inner.load_stream(key)
    }
    fn save_stream(&self, key: StreamKey, state: &StreamState) -> Result<(), StateError> {
        (self.hook)("save_stream")?;
        self.inner.save_stream(key, state)
    }
    fn streams(&self) -> Result<Vec<(StreamKey, StreamState)>, StateError> {
        (self.hook)("streams")?;
        self.inner.streams()
    }
    fn get_records(
        &self,
        key: StreamKey,
        ids: &[i64],
    ) -> Result<Vec<Option<RecordState>>, StateError> {
        (self.hook)("get_records")?;
        self.inner.get_records(key, ids)
    }
    fn get_tombstones(
        &self,
        key: StreamKey,
        ids: &[i64],
    ) -> Result<Vec<Option<Tombstone>>, StateError> {
        (self.hook)("get_tombstones")?;
        self.inner.get_tombstones(key, ids)
    }
    fn write_intents(&self, key: StreamKey, intents: &[(i64, Intent)]) -> Result<(), StateError> {
        (self.hook)("write_intents")?;
        self.inner.write_intents(key, intents)
    }
    fn pending_intents(&self, key: StreamKey) -> Result<Vec<(i64, Intent)>, StateError> {
        (self.hook)("pending_intents")?;
        self.inner.pending_intents(key)
    }
    fn commit_page(&self, key: StreamKey, page: &Acked<PageCommit>) -> Result<(), StateError> {
        (self.hook)("commit_page")?;
        self.inner.commit_page(key, page)
    }
    fn dead_letters(&self, key: StreamKey) -> Result<Vec<(i64, DeadLetter)>, StateError> {
        (self.hook)("dead_letters")?;
        self.inner.dead_letters(key)
    }
    fn unseen_records(
        &self,
        key: StreamKey,
        epoch: u64,
    ) -> Result<Vec<(i64, RecordState)>, StateError> {
        (self.hook)("unseen_records")?;
        self.inner.unseen_records(key, epoch)
    }
    fn record_count(&self, key: StreamKey) -> Result<u64, StateError> {
        (self.hook)("record_count")?;
        self.inner.record_count(key)
    }
    fn commit_deletes(
        &self,
        key: StreamKey,
        deletes: &Acked<DeleteCommit>,
    ) -> Result<(), StateError> {
        (self.hook)("commit_deletes")?;
        self.inner.commit_deletes(key, deletes)
    }
    fn flush(&self) -> Result<(), StateError> {
        (self.hook)("flush")?;
        self.inner.flush()
    }
}

/// Asserts the no-loss invariant: every record's current version is in the
/// store AND was acknowledged by the sink; every deleted record got a delete.
fn assert_nothing_lost(h: &Harness, stream: StreamKey, acked: &[Value], deleted: &[i64]) {
    let acked_hashes: HashSet<(String, String)> = acked
        .iter()
        .map(|e| {
            (
                e["subject"].as_str().unwrap().to_string(),
                e["contenthash"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    for id in h.sim.record_ids(stream.tenant, stream.resource) {
        let hash = h.hash_of(stream.tenant, stream.resource, id);
        assert!(
            acked_hashes.contains(&(id.to_string(), hash.clone())),
            "record {id}: current version never acknowledged by the sink"
        );
        let stored = h.store.get_records(stream, &[id]).unwrap()[0];
        assert_eq!(
            stored.map(|r| r.hash.to_hex()),
            Some(hash),
            "record {id}: store"
        );
    }
    for id in deleted {
        assert!(
            acked
                .iter()
                .any(|e| subject_is(e, *id) && e["op"] == "delete"),
            "record {id}: delete never acknowledged"
        );
        assert!(h.store.get_records(stream, &[*id]).unwrap()[0].is_none());
    }
}

/// Same id, same change, both ways: an id acknowledged twice always names the
/// same change (type, subject, op, content and previous hash), and a change
/// acknowledged twice (a re-publish after a crash) always carries exactly the
/// id it had the first time. Random ids fail the second half.
fn assert_duplicates_share_ids(acked: &[Value]) {
    let change = |e: &Value| {
        (
            e["type"].clone(),
            e["subject"].clone(),
            e["op"].clone(),
            e["contenthash"].clone(),
            e.get("previoushash").cloned().unwrap_or(Value::Null),
        )
    };
    let mut by_id: HashMap<String, _> = HashMap::new();
    let mut by_change: HashMap<_, String> = HashMap::new();
    for e in acked {
        let id = e["id"].as_str().unwrap().to_string();
        if let Some(prev) = by_id.insert(id.clone(), change(e)) {
            assert_eq!(prev, change(e), "one id, two different changes");
        }
        if let Some(prev) = by_change.insert(change(e), id.clone()) {
            assert_eq!(prev, id, "one change re-published under a new id: {e}");
        }
    }
}

/// Drives `run` (a sweep the test will drop) until `check` holds, looking
/// every 50 ms; the sweep must not finish first.
async fn sweep_until<R: std::fmt::Debug>(
    run: &mut (impl std::future::Future<Output = R> + Unpin),
    what: &str,
    check: impl FnMut() -> bool,
) {
    tokio::select! {
        finished = run => panic!("the sweep finished before {what}: {finished:?}"),
        _ = common::wait_until(what, Duration::from_secs(60), check) => {}
    }
}

/// After a sweep was dropped with `acked` events acknowledged: nothing
/// beyond them is committed; a restart (the store reopened, the sink
/// healthy) publishes and commits everything, re-publishing under the same
/// ids. Returns every acknowledged event.
async fn recover_after_drop(h: &mut Harness, stream: StreamKey, acked: usize) -> Vec<Value> {
    let mut events: Vec<Value> = h.sink.take().iter().map(json).collect();
    assert_eq!(events.len(), acked, "acknowledged before the drop");
    // Never a hash without an ack.
    let committed = h.store.record_count(stream).unwrap() as usize;
    assert!(committed <= acked, "{committed} committed, {acked} acked");

    h.sink.set_mode(FaultMode::Normal);
    h.reopen();
    events.extend(
        h.sweep(stream.tenant, stream.resource, SweepKind::Incremental)
            .await,
    );
    let quiet = h
        .sweep(stream.tenant, stream.resource, SweepKind::Incremental)
        .await;
    assert!(quiet.is_empty(), "the recovery sweep committed everything");
    assert_nothing_lost(h, stream, &events, &[]);
    assert_duplicates_share_ids(&events);
    events
}

/// The upstream changes of the crash test: a create, an update, a silent
/// update and a delete on top of a synced 120-record stream.
async fn crash_test_setup() -> (Harness, Vec<Value>, Vec<i64>) {
    let mut h = spawn_harness(1, 120, 2).await;
    // Page by page: every run must make the reference run's store calls,
    // whichever pages happen to arrive together.
    h.settings.max_group_pages = 1;
    let acked = h.sweep(1, V, SweepKind::Incremental).await;
    let ids = h.sim.record_ids(1, V);
    h.sim.create(1, V);
    h.sim.update(1, V, ids[5]);
    h.sim.update_silently(1, V, ids[70]);
    h.sim.delete(1, V, ids[9]);
    (h, acked, vec![ids[9]])
}

#[tokio::test]
async fn a_crash_at_every_store_step_never_loses_a_change_and_republishes_with_the_same_ids() {
    // Reference run: how many mutating store calls this full sweep makes.
    let (h, _, _) = crash_test_setup().await;
    let calls = Arc::new(AtomicUsize::new(0));
    let counting = crashing_store(h.store.clone(), usize::MAX, calls.clone());
    h.sweeper_with(StreamKey::new(1, V), counting.clone())
        .run(SweepKind::Full, &CancellationToken::new())
        .await
        .expect("the reference sweep succeeds");
    let steps = calls.load(Ordering::SeqCst);
    assert!(
        steps >= 6,
        "intents, commit, delete intents, delete commit, saves: {steps}"
    );

    for fail_at in 1..=steps {
        let (mut h, mut acked, deleted) = crash_test_setup().await;
        let stream = StreamKey::new(1, V);
        let crashing = crashing_store(h.store.clone(), fail_at, Arc::default());
        h.sink.take();
        let crashed = h
            .sweeper_with(stream, crashing)
            .run(SweepKind::Full, &CancellationToken::new())
            .await;
        assert!(
            crashed.is_err(),
            "step {fail_at} of {steps} was not crashed"
        );
        acked.extend(h.sink.take().iter().map(json));
        h.reopen();
        acked.extend(h.sweep(1, V, SweepKind::Full).await);
        // Whatever the first run did, the second one completes the job.
        let rerun: Vec<Value> = h.sweep(1, V, SweepKind::Full).await;
        acked.extend(rerun);
        assert_nothing_lost(&h, stream, &acked, &deleted);
        assert_duplicates_share_ids(&acked);
    }
}

#[tokio::test]
async fn dropping_the_sweep_at_every_publish_never_loses_a_change() {
    for ack_before_hang in [0usize, 1, 30, 49, 50, 51, 99, 119] {
        let mut h = spawn_harness(1, 120, 2).await;
        let stream = StreamKey::new(1, V);
        h.sink.set_mode(FaultMode::FailAfter(ack_before_hang));
        // The sink keeps failing, the sweep keeps retrying: the process dies
        // once the failure was really hit (an explicit point, not a timer).
        let mut run = h.droppable_sweep(stream);
        let sink = h.sink.clone();
        sweep_until(&mut run, "the sink failed an event", || {
            sink.offered() > ack_before_hang
        })
        .await;
        drop(run);
        let acked = recover_after_drop(&mut h, stream, ack_before_hang).await;
        // The re-published first page carries the same ids as the first attempt.
        let mut seen = HashMap::new();
        for e in &acked {
            let subject = e["subject"].as_str().unwrap().to_string();
            let id = e["id"].as_str().unwrap().to_string();
            if let Some(prev) = seen.insert(subject.clone(), id.clone()) {
                assert_eq!(prev, id, "record {subject} re-published under a new id");
            }
        }
    }
}

#[tokio::test]
async fn a_published_create_whose_commit_was_lost_is_deleted_when_the_record_vanishes() {
    let mut h = spawn_harness(1, 20, 2).await;
    let stream = StreamKey::new(1, V);
    h.sweep(1, V, SweepKind::Incremental).await;
    let created = h.sim.create(1, V);
    // Crash after the ack but before the commit: write_intents is call 2, commit_page call 3.
    let crashing = crashing_store(h.store.clone(), 3, Arc::default());
    h.sink.take();
    assert!(h
        .sweeper_with(stream, crashing)
        .run(SweepKind::Incremental, &CancellationToken::new())
        .await
        .is_err());
    let acked: Vec<Value> = h.sink.take().iter().map(json).collect();
    assert_eq!(
        subjects(&acked),
        vec![created],
        "the create reached the sink"
    );
    h.reopen();
    assert_eq!(h.store.pending_intents(stream).unwrap().len(), 1);
    // The record disappears upstream before we ever commit it.
    h.sim.delete(1, V, created);
    let events = h.sweep(1, V, SweepKind::Full).await;
    assert_eq!(subjects(&events), vec![created]);
    assert_eq!(events[0]["op"], "delete");
    assert_eq!(events[0]["previoushash"], acked[0]["contenthash"]);
    assert!(h.store.pending_intents(stream).unwrap().is_empty());
}

#[tokio::test]
async fn a_replay_interrupted_between_pages_resumes_without_re_emitting_under_new_ids() {
    let h = spawn_harness(1, 160, 2).await;
    let stream = StreamKey::new(1, V);
    h.sweep(1, V, SweepKind::Incremental).await;
    let ids = h.sim.record_ids(1, V);
    // Changed before the replay: their snapshots carry a new hash and sequence.
    h.sim.update_silently(1, V, ids[3]);
    h.sim.update_silently(1, V, ids[120]);
    let replay_id = StreamLedger::new(h.store.as_ref(), stream)
        .schedule_replay(None, voucher_cdc::state::RequestedBy::Cli, Utc::now())
        .unwrap();

    // Shutdown arrives while the first page is in flight: the page commits, the sweep stops.
    h.sink.take();
    let sweeper = h.sweeper(stream);
    let shutdown = CancellationToken::new();
    shutdown.cancel();
    let err = sweeper
        .run(SweepKind::Incremental, &shutdown)
        .await
        .unwrap_err();
    assert!(matches!(err, SweepError::Interrupted), "{err}");
    let first: Vec<Value> = h.sink.take().iter().map(json).collect();
    assert_eq!(first[0]["type"], "replay.started");
    let first_records: Vec<&Value> = first.iter().filter(|e| e["op"] == "snapshot").collect();
    assert_eq!(
        first_records.len(),
        50,
        "one page of snapshots before the stop"
    );

    let resumed = h.sweep(1, V, SweepKind::Incremental).await;
    // The frame is re-announced with its id; no record of the first page comes again.
    assert_eq!(resumed[0]["id"], first[0]["id"]);
    let first_subjects: HashSet<&str> = first_records
        .iter()
        .map(|e| e["subject"].as_str().unwrap())
        .collect();
    let again: Vec<&Value> = resumed
        .iter()
        .filter(|e| {
            e["op"] == "snapshot" && first_subjects.contains(e["subject"].as_str().unwrap())
        })
        .collect();
    assert!(again.is_empty(), "re-emitted after the resume: {again:?}");
    let snapshots = resumed.iter().filter(|e| e["op"] == "snapshot").count();
    assert_eq!(snapshots + first_records.len(), 160);
    assert!(resumed
        .iter()
        .filter(|e| e["op"] == "snapshot")
        .all(|e| e["replayid"] == replay_id.as_str()));
    assert_eq!(resumed.last().unwrap()["type"], "replay.completed");
    assert_eq!(
        resumed.last().unwrap()["data"]["records"],
        160,
        "the count includes the snapshots before the stop"
    );
    let replay = h.store.load_stream(stream).unwrap().replay.unwrap();
    assert!(!replay.pending);
    assert_eq!(replay.records, 160);
}

#[tokio::test]
async fn a_replay_that_finds_most_records_gone_deletes_them_once_confirmed_and_does_not_loop() {
    let h = spawn_harness(1, 40, 2).await;
    let stream = StreamKey::new(1, V);
    h.sweep(1, V, SweepKind::Incremental).await;
    let gone: Vec<i64> = h.sim.record_ids(1, V).into_iter().take(30).collect();
    for id in &gone {
        h.sim.delete(1, V, *id);
    }
    // A normal full sweep refuses (the guard), and says how to go on.
    let err = h
        .sweeper(stream)
        .run(SweepKind::Full, &CancellationToken::new())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("voucher-cdc replay"), "{err}");
    let state = h.store.load_stream(stream).unwrap();
    assert_eq!(state.full_sweep_failures, 1);
    assert!(
        state.full_sweep_retry_at.is_some(),
        "the full sweep backs off"
    );
    // Incremental sweeps go on, and the refusal stays visible meanwhile.
    h.sweep(1, V, SweepKind::Incremental).await;
    let state = h.store.load_stream(stream).unwrap();
    assert!(
        state
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("refused to delete")),
        "{state:?}"
    );

    // The advice works: the replay confirms each delete and completes.
    h.sim.clear_request_log();
    StreamLedger::new(h.store.as_ref(), stream)
        .schedule_replay(None, voucher_cdc::state::RequestedBy::Cli, Utc::now())
        .unwrap();
    let events = h.sweep(1, V, SweepKind::Incremental).await;
    let deletes: Vec<i64> = subjects(
        &events
            .iter()
            .filter(|e| e["op"] == "delete")
            .cloned()
            .collect::<Vec<_>>(),
    );
    let mut expected = gone.clone();
    expected.sort();
    assert_eq!(deletes, expected);
    let gets = h
        .sim
        .request_log()
        .iter()
        .filter(|r| {
            r.path
                .rsplit('/')
                .next()
                .is_some_and(|last| last.parse::<i64>().is_ok())
        })
        .filter(|r| r.status == 404)
        .count();
    assert_eq!(gets, 30, "one confirming GET per delete");
    assert_eq!(events.last().unwrap()["type"], "replay.completed");
    assert!(!h.store.load_stream(stream).unwrap().replay.unwrap().pending);
    assert_eq!(h.store.record_count(stream).unwrap(), 10);
    // Nothing pending: the next sweeps are quiet.
    assert!(h.sweep(1, V, SweepKind::Incremental).await.is_empty());
    assert!(h.sweep(1, V, SweepKind::Full).await.is_empty());
}

#[tokio::test]
async fn an_orphan_intent_in_a_store_that_knows_no_record_is_deleted_not_refused() {
    let h = spawn_harness(1, 5, 0).await;
    let stream = StreamKey::new(1, C);
    assert!(h.sweep(1, C, SweepKind::Incremental).await.is_empty());
    assert!(h.store.load_stream(stream).unwrap().watermark.is_some());
    // A create that was published, never committed, and is gone upstream.
    let published = voucher_cdc::hash::ContentHash([7; 16]);
    h.store
        .write_intents(
            stream,
            &[(
                4242,
                Intent {
                    hash: published,
                    updated_at: None,
                    generation: 0,
                    seq: 1,
                    op: Some(voucher_cdc::event::Op::Create),
                    previous: None,
                    replay: None,
                },
            )],
        )
        .unwrap();
    let events = h.sweep(1, C, SweepKind::Full).await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["op"], "delete");
    assert_eq!(events[0]["subject"], "4242");
    assert_eq!(events[0]["previoushash"], published.to_hex());
    assert!(h.store.pending_intents(stream).unwrap().is_empty());
    assert!(h.sweep(1, C, SweepKind::Full).await.is_empty());
}

#[tokio::test]
async fn a_record_deleted_and_listed_again_gets_a_new_generation_and_a_new_id() {
    let h = spawn_harness(1, 10, 0).await;
    let stream = StreamKey::new(1, V);
    let first = h.sweep(1, V, SweepKind::Incremental).await;
    let id = h.sim.record_ids(1, V)[4];
    let snapshot = first.iter().find(|e| subject_is(e, id)).unwrap().clone();
    // A delete whose commit never happened: the delete intent alone is on disk.
    let committed = h.store.get_records(stream, &[id]).unwrap()[0].unwrap();
    h.store
        .write_intents(
            stream,
            &[(
                id,
                Intent {
                    hash: committed.hash,
                    updated_at: committed.updated_at,
                    generation: committed.generation,
                    seq: committed.seq + 1,
                    op: Some(voucher_cdc::event::Op::Delete),
                    previous: None,
                    replay: None,
                },
            )],
        )
        .unwrap();
    // The record is listed again with identical content: downstream may have
    // seen the delete, so it is re-created, under an id never used before.
    h.sim.update(1, V, id);
    let events = h.sweep(1, V, SweepKind::Incremental).await;
    let again = events.iter().find(|e| subject_is(e, id)).unwrap();
    assert_eq!(again["op"], "create");
    assert!(again.get("previoushash").is_none());
    assert_ne!(again["id"], snapshot["id"]);
    let stored = h.store.get_records(stream, &[id]).unwrap()[0].unwrap();
    assert_eq!(stored.generation, committed.generation + 1);
    assert!(h.store.pending_intents(stream).unwrap().is_empty());
}

/// The cancel window of the read-ahead: the sweep checked for a cancel after
/// its page and found none, the cancel comes, and the listing task, woken by
/// the page's release, sees it before asking for the next page. The listing
/// then ends without its last page: the sweep must not take it as complete
/// (no watermark, no deletes of the records it never listed).
#[tokio::test]
async fn a_sweep_cancelled_after_its_check_but_before_the_next_page_is_asked_for_is_interrupted() {
    let h = spawn_harness(1, 160, 2).await;
    let stream = StreamKey::new(1, V);
    h.sweep(1, V, SweepKind::Incremental).await;
    let before = h.store.load_stream(stream).unwrap();
    let cancel = CancellationToken::new();
    let first_page = Arc::new(tokio::sync::Notify::new());
    // On this single-threaded runtime the canceller, woken by the first
    // page's progress (before the sweep's check), runs when the sweep waits
    // for the next page: ahead of the listing task, which the page's release
    // wakes after the check.
    let canceller = {
        let (cancel, first_page) = (cancel.clone(), first_page.clone());
        tokio::spawn(async move {
            first_page.notified().await;
            cancel.cancel();
        })
    };
    let sweeper = {
        let first_page = first_page.clone();
        h.builder(stream)
            // Every page waits for the one before it to be released.
            .configure(|settings| settings.read_ahead_bytes = 0)
            .with_progress(Arc::new(move |_, _, pages| {
                if pages == 1 {
                    first_page.notify_one();
                }
            }))
            .build()
    };
    h.sink.take();
    h.sim.clear_request_log();
    let err = sweeper.run(SweepKind::Full, &cancel).await.unwrap_err();
    canceller.await.unwrap();
    assert!(matches!(err, SweepError::Interrupted), "{err}");
    let listed = h
        .sim
        .request_log()
        .iter()
        .filter(|e| e.path.ends_with("/catalog/vouchers"))
        .count();
    assert_eq!(listed, 1, "the listing asked for a page after the cancel");
    assert!(
        h.sink.take().is_empty(),
        "an unchanged first page publishes nothing, and nothing is deleted"
    );
    let after = h.store.load_stream(stream).unwrap();
    assert_eq!(after.watermark, before.watermark, "the watermark moved");
    assert_eq!(
        after.last_full_sweep_finished, before.last_full_sweep_finished,
        "the full sweep counted as done"
    );
    assert_eq!(h.store.record_count(stream).unwrap(), 160);
}

#[tokio::test]
async fn a_cursor_cycle_or_an_endless_listing_fails_the_sweep_and_keeps_the_watermark() {
    use voucher_cdc::simulator::ListingFault;
    for fault in [ListingFault::CursorCycle, ListingFault::Endless] {
        let h = spawn_harness(1, 120, 2).await;
        let stream = StreamKey::new(1, V);
        h.sweep(1, V, SweepKind::Incremental).await;
        let watermark = h.store.load_stream(stream).unwrap().watermark;
        h.sim.set_listing_fault(Some(fault));
        let sweeper = h.sweeper_with_floor(stream, 20);
        h.sim.clear_request_log();
        let cancel = CancellationToken::new();
        let err = tokio::time::timeout(
            Duration::from_secs(60),
            sweeper.run(SweepKind::Full, &cancel),
        )
        .await
        .expect("the sweep ends")
        .unwrap_err();
        let message = err.to_string();
        assert!(
            message.contains("/tenants/1/catalog/vouchers does not end")
                && message.contains("pages"),
            "{fault:?}: {message}"
        );
        let pages = h.sim.request_log().len();
        assert!(pages <= 120, "{fault:?}: {pages} requests before giving up");
        let state = h.store.load_stream(stream).unwrap();
        assert_eq!(state.watermark, watermark, "{fault:?}: the watermark moved");
        assert!(state.last_error.unwrap().contains("does not end"));
    }
}

#[tokio::test]
async fn a_first_sync_of_more_pages_than_the_floor_ends_by_itself_as_its_records_raise_the_limit() {
    // 6,000 records take 120 pages. A first sync knows none, so its limit
    // starts at max(floor, 2 x 0 + 100) = 100 pages and must grow with the
    // records each page commits.
    let h = spawn_harness(1, 6_000, 0).await;
    let stream = StreamKey::new(1, V);
    let sweeper = h.sweeper_with_floor(stream, 1);
    h.sim.clear_request_log();
    let report = sweeper
        .run(SweepKind::Incremental, &CancellationToken::new())
        .await
        .expect("the first sync ends without an endless-listing error");
    assert_eq!(report.records_seen, 6_000);
    assert_eq!(
        h.sim.request_log().len(),
        120,
        "exactly ceil(6000/50) list requests"
    );
    assert_eq!(h.store.record_count(stream).unwrap(), 6_000);
    let state = h.store.load_stream(stream).unwrap();
    assert!(state.watermark.is_some() && state.last_error.is_none());
}

#[tokio::test]
async fn an_endless_first_sync_stops_where_the_records_it_committed_set_the_limit() {
    // The real 120 pages, then page one again under fresh cursors forever:
    // the repeats add no record, so the limit stops at 2 x 120 + 100.
    use voucher_cdc::simulator::ListingFault;
    let h = spawn_harness(1, 6_000, 0).await;
    let stream = StreamKey::new(1, V);
    h.sim.set_listing_fault(Some(ListingFault::Endless));
    let sweeper = h.sweeper_with_floor(stream, 1);
    h.sim.clear_request_log();
    let err = tokio::time::timeout(
        Duration::from_secs(60),
        sweeper.run(SweepKind::Incremental, &CancellationToken::new()),
    )
    .await
    .expect("the sweep ends")
    .unwrap_err();
    assert!(err.to_string().contains("page limit of 340"), "{err}");
    assert_eq!(h.sim.request_log().len(), 340);
    assert_eq!(h.store.record_count(stream).unwrap(), 6_000);
    assert!(h.store.load_stream(stream).unwrap().watermark.is_none());
}

#[tokio::test]
async fn a_revert_after_an_unacknowledged_page_is_published_against_the_version_downstream_saw() {
    let mut h = spawn_harness(1, 30, 0).await;
    let stream = StreamKey::new(1, V);
    h.sweep(1, V, SweepKind::Incremental).await;
    let ids = h.sim.record_ids(1, V);
    let (reverting, poison) = (ids[3], ids[4]);
    let before = h.sim.snapshot(1, V, reverting).unwrap();
    let committed_hash = h.hash_of(1, V, reverting);
    h.sim.update(1, V, reverting);
    h.sim.update(1, V, poison);
    // The poison event is rejected: the page's other events were acked, nothing commits.
    h.sink.set_mode(reject_record_fatally(poison));
    h.sink.take();
    assert!(h
        .sweeper(stream)
        .run(SweepKind::Incremental, &CancellationToken::new())
        .await
        .is_err());
    let seen: Vec<Value> = h.sink.take().iter().map(json).collect();
    let published = seen
        .iter()
        .find(|e| subject_is(e, reverting))
        .unwrap()
        .clone();
    assert_eq!(published["previoushash"], committed_hash.as_str());
    h.sink.set_mode(FaultMode::Normal);
    h.reopen();

    // Upstream reverts to the committed content: downstream holds the update.
    assert!(h.sim.restore(1, &before, true));
    let events = h.sweep(1, V, SweepKind::Incremental).await;
    let revert = events
        .iter()
        .find(|e| subject_is(e, reverting))
        .expect("the revert is published");
    assert_eq!(revert["op"], "update");
    assert_eq!(revert["contenthash"], committed_hash.as_str());
    assert_eq!(revert["previoushash"], published["contenthash"]);
    assert_ne!(revert["id"], published["id"]);
    assert!(h.store.pending_intents(stream).unwrap().is_empty());
    assert!(h.sweep(1, V, SweepKind::Full).await.is_empty());
}

#[tokio::test]
async fn content_flipping_back_and_forth_without_an_updated_at_bump_gets_a_new_id_every_time() {
    let h = spawn_harness(1, 10, 0).await;
    h.sweep(1, V, SweepKind::Incremental).await;
    let id = h.sim.record_ids(1, V)[2];
    let a = h.sim.snapshot(1, V, id).unwrap();
    h.sim.update_silently(1, V, id);
    let b = h.sim.snapshot(1, V, id).unwrap();
    let mut ids = HashSet::new();
    let mut hashes = Vec::new();
    for version in [&b, &a, &b, &a] {
        assert!(h.sim.restore(1, version, false));
        let events = h.sweep(1, V, SweepKind::Full).await;
        assert_eq!(events.len(), 1, "every flip is published: {events:?}");
        assert_eq!(events[0]["op"], "update");
        assert!(
            ids.insert(events[0]["id"].as_str().unwrap().to_string()),
            "a flip reused an earlier id: {}",
            events[0]
        );
        hashes.push(events[0]["contenthash"].clone());
    }
    assert_eq!(hashes[0], hashes[2]);
    assert_eq!(hashes[1], hashes[3]);
}

#[tokio::test]
async fn a_record_missing_from_the_listing_but_found_by_its_get_is_not_deleted() {
    let h = spawn_harness(1, 10, 0).await;
    let stream = StreamKey::new(1, V);
    h.sweep(1, V, SweepKind::Incremental).await;
    let ids = h.sim.record_ids(1, V);
    let (skipped, gone) = (ids[1], ids[6]);
    let snapshot = h.sim.snapshot(1, V, skipped).unwrap();
    h.sim.delete(1, V, skipped);
    h.sim.delete(1, V, gone);
    // Restored upstream right before the sweep looks for unseen records: the
    // listing missed it, the confirming GET finds it.
    let sim = h.sim.clone();
    let store: Arc<dyn StateStore> = Arc::new(HookedStore {
        inner: h.store.clone(),
        hook: Box::new(move |what| {
            if what == "unseen_records" {
                assert!(sim.restore(1, &snapshot, false));
            }
            Ok(())
        }),
    });
    h.sink.take();
    h.sweeper_with(stream, store)
        .run(SweepKind::Full, &CancellationToken::new())
        .await
        .unwrap();
    let events: Vec<Value> = h.sink.take().iter().map(json).collect();
    assert_eq!(subjects(&events), vec![gone], "{events:?}");
    assert_eq!(events[0]["op"], "delete");
    assert!(h.store.get_records(stream, &[skipped]).unwrap()[0].is_some());
    // The GET's answer counted as seen: the next full sweep does not try again.
    assert!(h.sweep(1, V, SweepKind::Full).await.is_empty());
}

#[tokio::test]
async fn a_delete_whose_commit_was_lost_and_whose_record_comes_back_identical_is_re_created() {
    let mut h = spawn_harness(1, 10, 0).await;
    let stream = StreamKey::new(1, V);
    let first = h.sweep(1, V, SweepKind::Incremental).await;
    let id = h.sim.record_ids(1, V)[5];
    let snapshot = h.sim.snapshot(1, V, id).unwrap();
    h.sim.delete(1, V, id);
    // The delete is acked; its commit is lost. Mutating calls: save_stream,
    // commit_page (seen epochs), write_intents (the delete), commit_deletes.
    let crashing = crashing_store(h.store.clone(), 4, Arc::default());
    h.sink.take();
    assert!(h
        .sweeper_with(stream, crashing)
        .run(SweepKind::Full, &CancellationToken::new())
        .await
        .is_err());
    let deleted: Vec<Value> = h.sink.take().iter().map(json).collect();
    assert_eq!(subjects(&deleted), vec![id]);
    assert_eq!(deleted[0]["op"], "delete");
    h.reopen();
    assert!(
        h.store.get_records(stream, &[id]).unwrap()[0].is_some(),
        "the delete commit was lost"
    );

    // The record comes back exactly as it was, same updated_at.
    assert!(h.sim.restore(1, &snapshot, false));
    let events = h.sweep(1, V, SweepKind::Full).await;
    assert_eq!(subjects(&events), vec![id], "{events:?}");
    assert_eq!(events[0]["op"], "create");
    let original = first.iter().find(|e| subject_is(e, id)).unwrap();
    assert_eq!(events[0]["contenthash"], original["contenthash"]);
    assert_ne!(events[0]["id"], original["id"]);
    assert!(h.store.pending_intents(stream).unwrap().is_empty());
    assert!(h.sweep(1, V, SweepKind::Full).await.is_empty());
}

#[tokio::test]
async fn the_delete_guard_allows_exactly_the_configured_fraction_and_refuses_one_more() {
    for (deleted, refused) in [(20usize, false), (21, true)] {
        let h = spawn_harness(1, 40, 0).await;
        let stream = StreamKey::new(1, V);
        h.sweep(1, V, SweepKind::Incremental).await;
        for id in h.sim.record_ids(1, V).into_iter().take(deleted) {
            h.sim.delete(1, V, id);
        }
        h.sink.take();
        let result = h
            .sweeper(stream)
            .run(SweepKind::Full, &CancellationToken::new())
            .await;
        let events: Vec<Value> = h.sink.take().iter().map(json).collect();
        if refused {
            assert!(
                matches!(
                    result,
                    Err(SweepError::DeleteGuard {
                        would_delete: 21,
                        known: 40,
                        ..
                    })
                ),
                "{result:?}"
            );
            assert!(events.is_empty());
        } else {
            result.expect("exactly half may go");
            assert_eq!(events.iter().filter(|e| e["op"] == "delete").count(), 20);
        }
    }
}

#[tokio::test]
async fn a_first_sync_resumed_after_most_of_its_records_vanished_deletes_them_unguarded() {
    let h = spawn_harness(1, 120, 0).await;
    let stream = StreamKey::new(1, V);
    // The first sync stops after its first page (shutdown).
    let sweeper = h.sweeper(stream);
    let shutdown = CancellationToken::new();
    shutdown.cancel();
    h.sink.take();
    assert!(matches!(
        sweeper.run(SweepKind::Incremental, &shutdown).await,
        Err(SweepError::Interrupted)
    ));
    let first_page: Vec<Value> = h.sink.take().iter().map(json).collect();
    assert_eq!(h.store.record_count(stream).unwrap(), 50);
    assert!(h.store.load_stream(stream).unwrap().watermark.is_none());
    // 45 of the 50 committed records go before the first sync resumes.
    let gone: Vec<i64> = subjects(&first_page).into_iter().take(45).collect();
    for id in &gone {
        h.sim.delete(1, V, *id);
    }
    let events = h.sweep(1, V, SweepKind::Incremental).await;
    let deletes = events.iter().filter(|e| e["op"] == "delete").count();
    assert_eq!(deletes, 45, "the first sync is not guarded");
    assert!(events
        .iter()
        .filter(|e| e["op"] != "delete")
        .all(|e| e["op"] == "snapshot"));
    assert_eq!(h.store.record_count(stream).unwrap(), 75);
    assert!(h.store.load_stream(stream).unwrap().watermark.is_some());
}

#[tokio::test]
async fn a_fatal_sink_error_in_a_later_publish_run_of_a_page_commits_nothing_of_the_page() {
    let mut h = spawn_harness(1, 12, 0).await;
    let stream = StreamKey::new(1, V);
    let ids = h.sim.record_ids(1, V);
    // 300 KB records: a page's events go out in several ~1 MiB publish runs.
    for id in &ids {
        assert!(h.sim.set_oversize(1, V, *id, 300_000));
    }
    h.sweep(1, V, SweepKind::Incremental).await;
    let committed: Vec<String> = ids.iter().map(|id| h.hash_of(1, V, *id)).collect();
    let watermark = h.store.load_stream(stream).unwrap().watermark;
    for id in &ids {
        h.sim.update(1, V, *id);
    }
    // The page's last record is rejected: every run before its run was acked.
    h.sink.set_mode(reject_record_fatally(ids[ids.len() - 1]));
    h.sink.take();
    let calls = h.sink.publish_calls();
    assert!(h
        .sweeper(stream)
        .run(SweepKind::Incremental, &CancellationToken::new())
        .await
        .is_err());
    assert!(
        h.sink.publish_calls() - calls >= 3,
        "the page went out in {} publish calls",
        h.sink.publish_calls() - calls
    );
    let first_try: Vec<Value> = h.sink.take().iter().map(json).collect();
    assert!(first_try.len() >= 6, "{} events acked", first_try.len());
    // Nothing of the page is committed, though most of it was acknowledged.
    for (id, hash) in ids.iter().zip(&committed) {
        let stored = h.store.get_records(stream, &[*id]).unwrap()[0].unwrap();
        assert_eq!(&stored.hash.to_hex(), hash, "record {id} committed early");
    }
    assert_eq!(h.store.load_stream(stream).unwrap().watermark, watermark);
    assert!(!h.store.pending_intents(stream).unwrap().is_empty());

    // After a restart with the sink healthy, every change is published
    // (those acked before under the same ids) and then committed.
    h.sink.set_mode(FaultMode::Normal);
    h.reopen();
    let second_try = h.sweep(1, V, SweepKind::Incremental).await;
    let acked: Vec<Value> = first_try.iter().chain(&second_try).cloned().collect();
    assert_duplicates_share_ids(&acked);
    assert_nothing_lost(&h, stream, &acked, &[]);
    assert!(h.store.pending_intents(stream).unwrap().is_empty());
    assert!(h.sweep(1, V, SweepKind::Full).await.is_empty());
}

#[tokio::test]
async fn a_first_syncs_change_history_is_measured_on_the_upstreams_clock_not_the_bridges() {
    let h = spawn_harness(1, 10, 0).await;
    let stream = StreamKey::new(1, V);
    // The upstream's clock is three days behind the bridge's: by the
    // bridge's clock every record changed long before the history window.
    let upstream_now = Utc::now() - chrono::Duration::days(3);
    h.sim.set_clock(Some(upstream_now));
    let ids = h.sim.record_ids(1, V);
    for id in &ids[..4] {
        h.sim.update(1, V, *id);
    }
    let report = h
        .sweeper(stream)
        .run(SweepKind::Incremental, &CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(report.history.records, 10);
    // Four records changed just now on the upstream's clock.
    assert_eq!(report.history.recent, 4, "{:?}", report.history);
    let evidence = report.history.evidence().unwrap();
    assert_eq!(evidence.changes, 4.0);
    // The six untouched records are older than the window: 6 x 6 h of
    // exposure over 10 records, the four fresh ones add about nothing.
    let expected = 6.0 * 6.0 * 3600.0 / 10.0;
    assert!(
        (evidence.seconds - expected).abs() < 60.0,
        "{} s of exposure, expected {expected}",
        evidence.seconds
    );
}

/// A first sync of ten pages (500 vouchers) into a sink that takes
/// `ack_delay` to acknowledge, in groups of at most `group_pages` pages:
/// every record is published once and committed; returns how many publishes
/// it took.
async fn ten_page_sync_publishes(group_pages: usize, ack_delay: Duration) -> usize {
    let mut h = spawn_harness(1, 500, 0).await;
    h.settings.max_group_pages = group_pages;
    let stream = StreamKey::new(1, V);
    h.sink.set_mode(FaultMode::SlowAck(ack_delay));
    let report = h
        .sweeper(stream)
        .run(SweepKind::Incremental, &CancellationToken::new())
        .await
        .expect("sweep succeeds");
    let events: Vec<Value> = h.sink.take().iter().map(json).collect();
    assert_eq!(report.pages, 10);
    let mut expected = h.sim.record_ids(1, V);
    expected.sort();
    assert_eq!(subjects(&events), expected, "one event per record");
    assert_eq!(h.store.record_count(stream).unwrap(), 500);
    let publishes = h.sink.publish_calls();
    assert!(h.sweep(1, V, SweepKind::Incremental).await.is_empty());
    publishes
}

/// While a page's publish waits 400 ms for its acks, the next pages are
/// listed; those that arrived are journalled, published and committed
/// together: fewer publishes than pages.
#[tokio::test]
async fn pages_read_ahead_while_a_page_is_published_are_published_and_committed_as_one_group() {
    let publishes = ten_page_sync_publishes(
        voucher_cdc::sweep::MAX_GROUP_PAGES,
        Duration::from_millis(400),
    )
    .await;
    assert!(
        (2..10).contains(&publishes),
        "{publishes} publishes for 10 pages: no group formed"
    );
}

/// A sink that acknowledges at once leaves no time for pages to arrive
/// meanwhile: the group's linger is what still gathers the pages listed back
/// to back into groups of the most pages a group takes (8 + 2), each one
/// intent batch, one publish and one commit.
#[tokio::test]
async fn pages_listed_back_to_back_fill_groups_within_the_linger_when_the_sink_acks_at_once() {
    let mut h = spawn_harness(1, 500, 0).await;
    // Generous, so that a slow debug build still lists eight pages within it.
    h.settings.group_linger = Duration::from_secs(10);
    let stream = StreamKey::new(1, V);
    let report = h
        .sweeper(stream)
        .run(SweepKind::Incremental, &CancellationToken::new())
        .await
        .expect("sweep succeeds");
    assert_eq!(report.pages, 10);
    let events = h.sink.take();
    assert_eq!(events.len(), 500, "one event per record");
    assert_eq!(h.store.record_count(stream).unwrap(), 500);
    assert_eq!(
        h.sink.publish_calls(),
        2,
        "10 pages in groups of {} pages",
        voucher_cdc::sweep::MAX_GROUP_PAGES
    );
}

/// A one-page listing is published as soon as it is read, whatever the
/// linger: no wait follows the listing's last page.
#[tokio::test]
async fn the_last_page_of_a_listing_is_published_without_lingering() {
    let mut h = spawn_harness(1, 20, 0).await;
    h.settings.group_linger = Duration::from_secs(3600);
    let stream = StreamKey::new(1, V);
    let sweeper = h.sweeper(stream);
    let cancel = CancellationToken::new();
    let run = sweeper.run(SweepKind::Incremental, &cancel);
    let report = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the sweep lingered after the last page")
        .expect("sweep succeeds");
    assert_eq!(report.pages, 1);
    assert_eq!(h.sink.take().len(), 20);
}

/// With groups of one page every page is published on its own: the setting
/// is what groups pages, not the sink.
#[tokio::test]
async fn with_groups_of_one_page_every_page_is_published_on_its_own() {
    assert_eq!(
        ten_page_sync_publishes(1, Duration::from_millis(50)).await,
        10
    );
}

/// A sweep dropped while a group of pages is being published (the process
/// dies): nothing of the group is committed, and the next sweep publishes
/// every record of it again under the ids it had, and commits it.
#[tokio::test]
async fn a_sweep_dropped_while_a_group_is_published_loses_nothing_and_keeps_the_ids() {
    let mut h = spawn_harness(1, 500, 0).await;
    let stream = StreamKey::new(1, V);
    // Every publish takes 2 s: the pages listed during the first group's
    // publish make the next group.
    h.sink.set_mode(FaultMode::SlowAck(Duration::from_secs(2)));
    let mut run = h.droppable_sweep(stream);
    let sink = h.sink.clone();
    sweep_until(&mut run, "the first publish started", || {
        sink.publish_calls() >= 1
    })
    .await;
    let first = h.sink.offered();
    let sink = h.sink.clone();
    sweep_until(&mut run, "the second publish started", || {
        sink.publish_calls() >= 2
    })
    .await;
    // The group's acks, still 2 s away, become failures; its retries fail too.
    h.sink.set_mode(FaultMode::FailAfter(0));
    let group = h.sink.offered() - first;
    assert!(
        group > 50,
        "the second publish took {group} events: one page, no group"
    );
    let sink = h.sink.clone();
    sweep_until(&mut run, "the group was retried", || {
        sink.publish_calls() >= 3
    })
    .await;
    drop(run);
    recover_after_drop(&mut h, stream, first).await;
}

#[tokio::test]
async fn a_full_sweep_stores_the_print_of_a_touched_record_and_keeps_it_while_it_is_unchanged() {
    let h = spawn_harness(1, 10, 0).await;
    let stream = StreamKey::new(1, V);
    h.sweep(1, V, SweepKind::Incremental).await;
    let id = h.sim.record_ids(1, V)[3];
    let print = |h: &Harness| {
        h.store.get_records(stream, &[id]).unwrap()[0]
            .unwrap()
            .print
    };
    let first = print(&h);
    assert!(first.is_some(), "a committed change stores its print");
    // A touch moves only `updated_at`, which the content hash ignores: no
    // event, and the stored print is now of older bytes.
    h.sim.touch(1, V, id);
    assert!(h.sweep(1, V, SweepKind::Incremental).await.is_empty());
    assert_eq!(
        print(&h),
        first,
        "an incremental sweep keeps prints as they are"
    );
    assert!(h.sweep(1, V, SweepKind::Full).await.is_empty());
    h.store.flush().unwrap();
    let reprinted = print(&h);
    assert!(
        reprinted.is_some() && reprinted != first,
        "the full sweep reprinted it"
    );
    assert!(h.sweep(1, V, SweepKind::Full).await.is_empty());
    h.store.flush().unwrap();
    assert_eq!(print(&h), reprinted);
    // Its content changing later is still published.
    h.sim.update_silently(1, V, id);
    let events = h.sweep(1, V, SweepKind::Full).await;
    assert_eq!(subjects(&events), vec![id]);
}
