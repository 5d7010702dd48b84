//! The resharding procedure of docs/deployment.md, run for real: a tenant's
//! state is exported from its old owner's store and imported into the new
//! owner's, whose next sweeps against the simulator emit exactly the changes
//! made upstream in between, and nothing for the records that did not change.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use common::sweeps::SweeperBuilder;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use voucher_cdc::control::state_file;
use voucher_cdc::simulator::Simulator;
use voucher_cdc::sinks::testing::TestSink;
use voucher_cdc::state::{SledStore, StateStore};
use voucher_cdc::stream::{Resource, StreamKey};
use voucher_cdc::sweep::SweepKind;

const V: Resource = Resource::Vouchers;
const C: Resource = Resource::Categories;

/// Sweeps every resource of `tenant` into `store`, publishing to `sink`, as `kinds` in turn.
async fn sweep(
    sim: &Simulator,
    store: &Arc<SledStore>,
    sink: &Arc<TestSink>,
    tenant: u64,
    kinds: &[SweepKind],
) {
    for resource in Resource::ALL {
        let sweeper = SweeperBuilder::new(sim, StreamKey::new(tenant, resource))
            .with_store(store.clone())
            .with_sink(sink.clone())
            .build();
        for kind in kinds {
            sweeper
                .run(*kind, &CancellationToken::new())
                .await
                .expect("sweep succeeds");
        }
    }
}

/// (type, op, subject) of each event, sorted.
fn changes(sink: &TestSink) -> Vec<(String, String, String)> {
    let mut out: Vec<(String, String, String)> = sink
        .events()
        .iter()
        .map(|e| {
            let doc: Value = serde_json::from_slice(&e.payload).unwrap();
            (
                doc["type"].as_str().unwrap_or_default().to_string(),
                doc["op"].as_str().unwrap_or_default().to_string(),
                doc["subject"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    out.sort();
    out
}

/// The (type, op, subject) a consumer needs to go from `before` to `after`, sorted.
fn upstream_changes(
    before: &BTreeMap<common::RecordKey, Value>,
    after: &BTreeMap<common::RecordKey, Value>,
) -> Vec<(String, String, String)> {
    let singular = |resource: &str| resource.trim_end_matches('s').replace("ie", "y");
    let mut out = Vec::new();
    for key in before.keys().chain(after.keys()).collect::<BTreeSet<_>>() {
        let (_, resource, id) = key;
        let (ty, op) = match (before.get(key), after.get(key)) {
            (Some(_), None) => ("deleted", "delete"),
            (None, Some(_)) => ("updated", "create"),
            (Some(b), Some(a)) if a != b => ("updated", "update"),
            _ => continue,
        };
        out.push((
            format!("{}.{ty}", singular(resource)),
            op.to_string(),
            id.to_string(),
        ));
    }
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_moved_to_a_new_owner_emits_exactly_the_changes_made_meanwhile_and_nothing_else() {
    let sim = common::spawn_small_simulator(2).await;
    let old_dir = tempfile::tempdir().unwrap();
    let new_dir = tempfile::tempdir().unwrap();
    let old_owner = Arc::new(SledStore::open(&old_dir.path().join("state")).unwrap());
    let old_sink = Arc::new(TestSink::new());
    for tenant in [1, 2] {
        sweep(&sim, &old_owner, &old_sink, tenant, &[SweepKind::Full]).await;
    }
    assert_eq!(old_sink.events().len(), 2 * (20 + 5), "both tenants synced");

    // The scale change: tenant 1 moves. Its old owner is stopped; export it.
    let mut dump = Vec::new();
    let exported = state_file::export(&old_owner, Some(1), None, &mut dump).unwrap();
    assert_eq!(exported.len(), 2);

    // Upstream moves on while the tenant is between owners (a delete of a
    // category also changes the records that refer to it).
    let before = common::api_view(&sim, &[1]);
    let updated = sim.record_ids(1, V)[3];
    assert!(sim.update(1, V, updated));
    let created = sim.create(1, V);
    let deleted = sim.record_ids(1, C)[2];
    assert!(sim.delete(1, C, deleted));

    let new_owner = Arc::new(SledStore::open(&new_dir.path().join("state")).unwrap());
    let imported = state_file::import(&new_owner, &mut dump.as_slice(), false).unwrap();
    assert_eq!(imported, exported);
    assert!(!new_owner.holds(StreamKey::new(2, V)).unwrap());

    // The new owner's next sweeps: an incremental poll, then a full sweep (deletes).
    let new_sink = Arc::new(TestSink::new());
    sweep(
        &sim,
        &new_owner,
        &new_sink,
        1,
        &[SweepKind::Incremental, SweepKind::Full],
    )
    .await;
    let expected = upstream_changes(&before, &common::api_view(&sim, &[1]));
    for change in [
        ("category.deleted", "delete", deleted),
        ("voucher.updated", "create", created),
        ("voucher.updated", "update", updated),
    ] {
        let change = (
            change.0.to_string(),
            change.1.to_string(),
            change.2.to_string(),
        );
        assert!(expected.contains(&change), "{change:?} in {expected:?}");
    }
    assert_eq!(changes(&new_sink), expected);
    assert_eq!(
        new_owner.record_count(StreamKey::new(1, V)).unwrap(),
        21,
        "the new owner knows every voucher"
    );

    // Without the move, the new owner would have re-snapshotted the tenant.
    let fresh = Arc::new(SledStore::open_temporary().unwrap());
    let fresh_sink = Arc::new(TestSink::new());
    sweep(&sim, &fresh, &fresh_sink, 1, &[SweepKind::Incremental]).await;
    assert_eq!(
        changes(&fresh_sink)
            .iter()
            .filter(|(_, op, _)| op == "snapshot")
            .count(),
        21 + 4
    );
}
