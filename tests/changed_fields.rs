//! `events.changed_fields` and `events.before` end to end: the real sweep
//! against the simulator over loopback HTTP, a sled store in a temp dir that
//! is reopened as a restarted daemon would, and a real sink (the file sink;
//! the in-memory test sink where a sink must fail on purpose).

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::sweeps::SweeperBuilder;
use serde_json::value::RawValue;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use voucher_cdc::hash::decode_field_list;
use voucher_cdc::simulator::Simulator;
use voucher_cdc::sinks::file::{FileSink, FileSinkConfig};
use voucher_cdc::sinks::testing::{FaultMode, RejectTarget, TestSink};
use voucher_cdc::sinks::{Sink, SinkError};
use voucher_cdc::state::{SledStore, StateStore};
use voucher_cdc::stream::{Resource, StreamKey};
use voucher_cdc::sweep::{SweepKind, SweepSettings};

const V: Resource = Resource::Vouchers;
const STREAM: StreamKey = StreamKey {
    tenant: 1,
    resource: V,
};

/// One published event: its attributes, and its `data` exactly as encoded.
#[derive(Debug, Clone)]
struct Published {
    doc: Value,
    data: String,
}

impl Published {
    fn parse(line: &[u8]) -> Published {
        common::schema::assert_valid_event(line);
        #[derive(serde::Deserialize)]
        struct Data<'a> {
            #[serde(borrow)]
            data: &'a RawValue,
        }
        let data: Data<'_> = serde_json::from_slice(line).unwrap();
        Published {
            doc: serde_json::from_slice(line).unwrap(),
            data: data.data.get().to_string(),
        }
    }

    fn subject(&self) -> i64 {
        self.doc["subject"].as_str().unwrap().parse().unwrap()
    }

    fn op(&self) -> &str {
        self.doc["op"].as_str().unwrap_or("")
    }

    fn changed_fields(&self) -> Option<Vec<String>> {
        let text = self.doc.get("changedfields")?.as_str().unwrap();
        Some(decode_field_list(text).expect("a well-formed field list"))
    }

    fn before(&self) -> Option<&str> {
        self.doc.get("before").map(|b| b.as_str().unwrap())
    }
}

/// The top-level keys whose values differ between two record bodies
/// (`updated_at`, the default ignored key, left out): the test's own oracle.
fn differing_keys(before: &str, after: &str) -> Vec<String> {
    let before: BTreeMap<String, Value> = serde_json::from_str(before).unwrap();
    let after: BTreeMap<String, Value> = serde_json::from_str(after).unwrap();
    let keys: BTreeSet<&String> = before.keys().chain(after.keys()).collect();
    keys.into_iter()
        .filter(|k| *k != "updated_at" && before.get(*k) != after.get(*k))
        .cloned()
        .collect()
}

struct Bridge {
    sim: Simulator,
    dir: tempfile::TempDir,
    store: Arc<dyn StateStore>,
    events_path: PathBuf,
    read: usize,
    settings: SweepSettings,
}

impl Bridge {
    async fn new(vouchers: usize, changed_fields: bool, before: bool) -> Bridge {
        let sim = common::spawn_catalog(1, vouchers, 2).await;
        let dir = tempfile::tempdir().unwrap();
        let store = open_store(dir.path());
        let events_path = dir.path().join("events.jsonl");
        let settings = SweepSettings {
            changed_fields,
            before,
            ..SweepSettings::default()
        };
        Bridge {
            sim,
            dir,
            store,
            events_path,
            read: 0,
            settings,
        }
    }

    /// Runs one sweep into the file sink; returns the events it appended.
    async fn sweep(&mut self, kind: SweepKind) -> Vec<Published> {
        let sink = FileSink::open(&FileSinkConfig {
            path: self.events_path.clone(),
        })
        .unwrap();
        self.sweep_into(Arc::new(sink), kind)
            .await
            .expect("sweep succeeds");
        let text = std::fs::read(&self.events_path).unwrap_or_default();
        let new: Vec<Published> = text[self.read..]
            .split(|b| *b == b'\n')
            .filter(|line| !line.is_empty())
            .map(Published::parse)
            .collect();
        self.read = text.len();
        new
    }

    async fn sweep_into(
        &self,
        sink: Arc<dyn Sink>,
        kind: SweepKind,
    ) -> Result<(), voucher_cdc::sweep::SweepError> {
        SweeperBuilder::new(&self.sim, STREAM)
            .with_store(self.store.clone())
            .with_sink(sink)
            .configure(|s| {
                s.changed_fields = self.settings.changed_fields;
                s.before = self.settings.before;
            })
            .build()
            .run(kind, &CancellationToken::new())
            .await
            .map(drop)
    }

    /// Drops and reopens the store, as a restarted daemon would.
    fn restart(&mut self) {
        let placeholder: Arc<dyn StateStore> = Arc::new(SledStore::open_temporary().unwrap());
        drop(std::mem::replace(&mut self.store, placeholder));
        self.store = open_store(self.dir.path());
    }
}

/// Opens the store under `dir`, waiting while a handle just dropped still holds its lock.
fn open_store(dir: &Path) -> Arc<dyn StateStore> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match SledStore::open(&dir.join("state")) {
            Err(voucher_cdc::state::StateError::Locked { .. })
                if std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            opened => return Arc::new(opened.unwrap()),
        }
    }
}

fn by_subject(events: &[Published]) -> HashMap<i64, Published> {
    events.iter().map(|e| (e.subject(), e.clone())).collect()
}

#[tokio::test]
async fn updates_and_deletes_carry_the_changed_fields_and_the_previously_published_data_across_a_restart(
) {
    let mut bridge = Bridge::new(30, true, true).await;
    let first = bridge.sweep(SweepKind::Incremental).await;
    assert_eq!(first.len(), 30);
    for e in &first {
        assert_eq!(e.op(), "snapshot");
        assert_eq!(e.changed_fields(), None, "only updates carry changedfields");
        assert_eq!(e.before(), None, "a snapshot has no previous version");
    }
    let mut last: HashMap<i64, Published> = by_subject(&first);
    let ids = bridge.sim.record_ids(1, V);
    let (a, b, c) = (ids[0], ids[1], ids[2]);

    // An update of the simulator's own kind, and one that changes exactly
    // `description_html` (without an updated_at bump: the full sweep finds it).
    assert!(bridge.sim.update(1, V, a));
    assert!(bridge.sim.set_oversize(1, V, b, 3000));
    assert!(bridge.sim.touch(1, V, c));
    let second = by_subject(&bridge.sweep(SweepKind::Full).await);
    assert_eq!(
        second.keys().copied().collect::<BTreeSet<_>>(),
        [a, b].into()
    );
    for (id, e) in &second {
        assert_eq!(e.op(), "update");
        let previous = &last[id];
        // `before` is the previous event's `data`, byte for byte.
        assert_eq!(e.before(), Some(previous.data.as_str()), "record {id}");
        assert_eq!(
            e.changed_fields(),
            Some(differing_keys(&previous.data, &e.data)),
            "record {id}"
        );
        assert!(!e.changed_fields().unwrap().is_empty());
    }
    assert_eq!(
        second[&b].changed_fields(),
        Some(vec!["description_html".to_string()])
    );
    last.extend(second);

    // After a restart the state still holds what the next change is compared with.
    bridge.restart();
    assert!(bridge.sim.update(1, V, a));
    let third = bridge.sweep(SweepKind::Incremental).await;
    assert_eq!(third.len(), 1);
    let e = &third[0];
    assert_eq!(e.subject(), a);
    assert_eq!(e.before(), Some(last[&a].data.as_str()));
    assert_eq!(
        e.changed_fields(),
        Some(differing_keys(&last[&a].data, &e.data))
    );
    last.insert(a, e.clone());

    // A delete carries the last published version.
    bridge.restart();
    assert!(bridge.sim.delete(1, V, a));
    assert!(bridge.sim.delete(1, V, c));
    let deletes = by_subject(&bridge.sweep(SweepKind::Full).await);
    assert_eq!(deletes.len(), 2);
    for id in [a, c] {
        let e = &deletes[&id];
        assert_eq!(e.op(), "delete");
        assert_eq!(e.before(), Some(last[&id].data.as_str()), "record {id}");
        assert_eq!(e.changed_fields(), None, "deletes carry no changedfields");
        assert_eq!(e.doc["previoushash"], last[&id].doc["contenthash"]);
    }
    // The deleted records' versions went with them: re-created, they are creates.
    assert!(bridge
        .store
        .get_versions(STREAM, &[a, c])
        .unwrap()
        .iter()
        .all(Option::is_none));
}

#[tokio::test]
async fn each_option_alone_adds_only_its_own_attribute() {
    for (changed_fields, before) in [(true, false), (false, true)] {
        let mut bridge = Bridge::new(8, changed_fields, before).await;
        let first = by_subject(&bridge.sweep(SweepKind::Incremental).await);
        let id = bridge.sim.record_ids(1, V)[3];
        assert!(bridge.sim.update(1, V, id));
        let events = bridge.sweep(SweepKind::Incremental).await;
        assert_eq!(events.len(), 1);
        let e = &events[0];
        assert_eq!(e.changed_fields().is_some(), changed_fields, "{e:?}");
        assert_eq!(e.before().is_some(), before, "{e:?}");
        if before {
            assert_eq!(e.before(), Some(first[&id].data.as_str()));
        }
    }
}

#[tokio::test]
async fn with_both_options_off_no_event_carries_them_and_the_state_keeps_no_version() {
    let mut bridge = Bridge::new(10, false, false).await;
    bridge.sweep(SweepKind::Incremental).await;
    let ids = bridge.sim.record_ids(1, V);
    assert!(bridge.sim.update(1, V, ids[1]));
    bridge.sim.delete(1, V, ids[2]);
    let events = bridge.sweep(SweepKind::Full).await;
    assert_eq!(events.len(), 2);
    for e in &events {
        assert!(e.doc.get("changedfields").is_none() && e.doc.get("before").is_none());
    }
    assert!(bridge
        .store
        .get_versions(STREAM, &ids)
        .unwrap()
        .iter()
        .all(Option::is_none));
}

#[tokio::test]
async fn records_committed_before_the_option_was_on_get_no_changed_fields_until_their_next_change()
{
    let mut bridge = Bridge::new(6, false, false).await;
    bridge.sweep(SweepKind::Incremental).await;
    bridge.settings.changed_fields = true;
    bridge.settings.before = true;
    bridge.restart();
    let id = bridge.sim.record_ids(1, V)[0];
    assert!(bridge.sim.update(1, V, id));
    let events = bridge.sweep(SweepKind::Incremental).await;
    assert_eq!(events.len(), 1);
    // Unknown previous fields: the attributes are left out, not guessed.
    assert_eq!(events[0].changed_fields(), None);
    assert_eq!(events[0].before(), None);
    assert!(bridge.sim.update(1, V, id));
    let events = bridge.sweep(SweepKind::Incremental).await;
    assert!(events[0].changed_fields().is_some());
    assert!(events[0].before().is_some());
}

#[tokio::test]
async fn a_change_published_but_not_committed_is_published_again_with_the_same_id_and_attributes() {
    let mut bridge = Bridge::new(12, true, true).await;
    let sink = TestSink::new();
    bridge
        .sweep_into(Arc::new(sink.clone()), SweepKind::Incremental)
        .await
        .unwrap();
    sink.take();
    let ids = bridge.sim.record_ids(1, V);
    for id in &ids[..3] {
        assert!(bridge.sim.update(1, V, *id));
    }
    // The sink refuses the page's second event for good and takes the others:
    // the sweep fails with two events out and nothing committed.
    sink.set_mode(FaultMode::Reject {
        target: RejectTarget::Index(1),
        error: SinkError::Fatal("test sink: refused".into()),
    });
    assert!(bridge
        .sweep_into(Arc::new(sink.clone()), SweepKind::Incremental)
        .await
        .is_err());
    let out: Vec<Published> = sink
        .take()
        .iter()
        .map(|e| Published::parse(&e.payload))
        .collect();
    assert_eq!(out.len(), 2, "two events reached the sink");
    for e in &out {
        assert!(
            e.changed_fields().is_some() && e.before().is_some(),
            "{e:?}"
        );
    }

    // Restarted, the bridge publishes the page again.
    bridge.restart();
    sink.set_mode(FaultMode::Normal);
    bridge
        .sweep_into(Arc::new(sink.clone()), SweepKind::Incremental)
        .await
        .unwrap();
    let again: Vec<Published> = sink
        .take()
        .iter()
        .map(|e| Published::parse(&e.payload))
        .collect();
    assert_eq!(again.len(), 3);
    for first in &out {
        let same = again
            .iter()
            .find(|e| e.subject() == first.subject())
            .expect("the published change again");
        assert_eq!(
            same.doc, first.doc,
            "same id, same changedfields, same before"
        );
    }
    // Committed now: nothing more, and the next change compares with these versions.
    bridge
        .sweep_into(Arc::new(sink.clone()), SweepKind::Incremental)
        .await
        .unwrap();
    assert!(sink.take().is_empty());
}
