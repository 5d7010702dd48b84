//! The engine's acceptance at the stated scale, through the real binary:
//! `run --once` syncs 3 tenants x (1,000 vouchers + 40 categories) into the
//! file sink with exactly one event per record, a second run emits nothing,
//! and after simulator mutations a third run emits exactly those changes.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::{read_events, run_cli, spawn_catalog, TestConfig};
use voucher_cdc::stream::Resource;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_once_syncs_everything_once_then_nothing_then_exactly_the_changes() {
    let sim = spawn_catalog(3, 1000, 40).await;
    let dir = tempfile::tempdir().unwrap();
    // A long full-resync interval: runs two and three are incremental.
    let config = TestConfig::for_simulator(&sim, dir.path(), &[1, 2, 3])
        .with_full_resync_interval(std::time::Duration::from_secs(3600))
        .write(&dir.path().join("voucher-cdc.toml"));
    let config = config.to_str().unwrap();
    let events_path = dir.path().join("events.jsonl");

    // Run 1: every record exactly once, as a snapshot.
    let (code, _, stderr) = run_cli(&["run", "--once", "--config", config]);
    assert_eq!(code, 0, "{stderr}");
    let first = read_events(&events_path);
    assert_eq!(first.len(), 3 * (1000 + 40));
    let mut per_record: BTreeMap<(u64, String, String), usize> = BTreeMap::new();
    for e in &first {
        assert_eq!(e["op"], "snapshot");
        let key = (
            e["tenant"].as_u64().unwrap(),
            e["type"].as_str().unwrap().to_string(),
            e["subject"].as_str().unwrap().to_string(),
        );
        *per_record.entry(key).or_default() += 1;
    }
    assert_eq!(per_record.len(), first.len(), "one event per record");
    for tenant in 1..=3 {
        for resource in Resource::ALL {
            let listed = first
                .iter()
                .filter(|e| {
                    e["tenant"] == tenant && e["type"] == format!("{}.updated", resource.singular())
                })
                .count();
            assert_eq!(listed, sim.record_ids(tenant, resource).len());
        }
    }

    // Run 2: nothing changed upstream, nothing emitted.
    let (code, _, stderr) = run_cli(&["run", "--once", "--config", config]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(read_events(&events_path).len(), first.len());

    // Run 3: exactly the mutations.
    let ids = sim.record_ids(2, Resource::Vouchers);
    let created = sim.create(1, Resource::Vouchers);
    sim.update(2, Resource::Vouchers, ids[10]);
    sim.update(2, Resource::Vouchers, ids[500]);
    sim.touch(2, Resource::Vouchers, ids[900]); // updated_at only: no event
    let category = sim.record_ids(3, Resource::Categories)[7];
    sim.update(3, Resource::Categories, category);
    let (code, _, stderr) = run_cli(&["run", "--once", "--config", config]);
    assert_eq!(code, 0, "{stderr}");
    let all = read_events(&events_path);
    let third: BTreeSet<(u64, String, String, String)> = all[first.len()..]
        .iter()
        .map(|e| {
            (
                e["tenant"].as_u64().unwrap(),
                e["type"].as_str().unwrap().to_string(),
                e["subject"].as_str().unwrap().to_string(),
                e["op"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let expected: BTreeSet<(u64, String, String, String)> = [
        (1, "voucher.updated", created, "create"),
        (2, "voucher.updated", ids[10], "update"),
        (2, "voucher.updated", ids[500], "update"),
        (3, "category.updated", category, "update"),
    ]
    .into_iter()
    .map(|(t, ty, id, op)| (t, ty.to_string(), id.to_string(), op.to_string()))
    .collect();
    assert_eq!(all.len() - first.len(), expected.len(), "{third:?}");
    assert_eq!(third, expected);
}
