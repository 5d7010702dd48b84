//! The dangerous moments of a sweep, reached on purpose (issue 12): for each
//! named crash point (src/crashpoint.rs) the real daemon binary runs against
//! the in-process simulator and a real `nats-server -js` with the point
//! armed and aborts there, as abruptly as `kill -9`. Upstream then changes
//! the records of the interrupted page (some deleted, some reverted to the
//! version before, one re-created with identical content after an
//! interrupted delete), the binary restarts without the point, converges
//! with a full sweep, and the events stored in JetStream must end exactly
//! as upstream is: nothing lost, every chain of hashes intact, one change
//! per event id. Each of the sweep's points fires with every commit the
//! store accepted already synced to disk (src/crashpoint.rs), so a commit made before its
//! events were acknowledged is a loss these tests see.
//!
//! Random kills find these windows rarely; a crash point finds them every
//! time. `VCDC_RELEASE_BIN` runs the release-profile binary instead of the
//! test build (scripts/kill-test.sh sets it).
#![cfg(feature = "crash-points")]

#[path = "common/brokers.rs"]
#[allow(dead_code)]
mod brokers;
#[path = "common/cdc.rs"]
#[allow(dead_code)]
mod cdc;
mod common;

use std::path::Path;
use std::time::Duration;

use cdc::{
    check_end_state, jetstream, nats_daemon_config, read_stream, signal_of, tail, upstream_hashes,
    DaemonProcess,
};
use voucher_cdc::crashpoint::names;
use voucher_cdc::simulator::{RecordValue, Simulator};
use voucher_cdc::stream::Resource;

const TENANT: u64 = 1;
const VOUCHERS: Resource = Resource::Vouchers;
const SIGABRT: i32 = 6;
const RUN_TIMEOUT: Duration = Duration::from_secs(90);

/// One scenario's world: simulator, NATS, state directory and configs.
struct World {
    sim: Simulator,
    nats: brokers::NatsServer,
    dir: tempfile::TempDir,
    /// Incremental sweeps (a full sweep only on first sync).
    incremental: std::path::PathBuf,
    /// Every sweep full.
    full: std::path::PathBuf,
    point: &'static str,
    /// The point fires the `hit`-th time it is reached.
    hit: u64,
}

impl World {
    async fn start(point: &'static str) -> Option<World> {
        World::with_vouchers(point, 80).await
    }

    async fn with_vouchers(point: &'static str, vouchers: usize) -> Option<World> {
        let nats = brokers::spawn_nats()?;
        let sim = common::spawn_catalog(1, vouchers, 4).await;
        let dir = tempfile::tempdir().unwrap();
        let config = nats_daemon_config(
            &sim,
            &nats.url(),
            dir.path(),
            vec![(TENANT, vec![VOUCHERS])],
        );
        let incremental = config.write(&dir.path().join("incremental.toml"));
        let full = config
            .with_every_sweep_full()
            .write(&dir.path().join("full.toml"));
        Some(World {
            sim,
            nats,
            dir,
            incremental,
            full,
            point,
            hit: 1,
        })
    }

    /// The point fires the `hit`-th time it is reached instead of the first.
    fn firing_at_hit(self, hit: u64) -> World {
        World { hit, ..self }
    }

    fn logs(&self, name: &str) -> std::path::PathBuf {
        self.dir.path().join(name)
    }

    /// `run --once` without a crash point; must exit 0.
    fn run_clean(&self, config: &Path, step: &str) {
        let mut daemon = DaemonProcess::spawn(config, true, None, &self.logs(step));
        let status = daemon.wait(RUN_TIMEOUT);
        assert!(
            status.success(),
            "[{}] {step}: `run --once` failed with {status}; stderr tail:\n{}",
            self.point,
            tail(&daemon.stderr(), 30)
        );
    }

    /// `run --once` with the crash point armed; must abort there.
    fn run_until_crash(&self, config: &Path) {
        let armed = format!("{}@{}", self.point, self.hit);
        let mut daemon = DaemonProcess::spawn(config, true, Some(&armed), &self.logs("crash"));
        let status = daemon.wait(RUN_TIMEOUT);
        let stderr = daemon.stderr();
        let line = format!(
            "voucher-cdc: crash point {} reached (hit {}); aborting",
            self.point, self.hit
        );
        assert!(
            stderr.contains(&line),
            "[{}] the crash point was never reached (exit {status}; is {} built with --features crash-points?); stderr tail:\n{}",
            self.point,
            cdc::daemon_binary().display(),
            tail(&stderr, 30)
        );
        assert_eq!(
            signal_of(&status),
            Some(SIGABRT),
            "[{}] the daemon should have aborted (SIGABRT), got {status}",
            self.point
        );
    }

    fn snapshot(&self, id: i64) -> RecordValue {
        self.sim
            .snapshot(TENANT, VOUCHERS, id)
            .expect("record exists")
    }

    /// Checks that the crash came while the full sweep deleted `doomed`:
    /// `updated`'s change went out before it, and the deletes went out only
    /// when the point lies after their publish.
    async fn assert_crashed_among_the_deletes(&self, doomed: &[i64], updated: i64) {
        let js = jetstream(&self.nats.url()).await;
        let events = read_stream(&js).await;
        let about = |id: i64, op: &str| {
            events.iter().any(|e| {
                e.op() == op
                    && e.record()
                        .is_some_and(|(_, _, subject)| subject == id.to_string())
            })
        };
        assert!(
            about(updated, "update"),
            "[{}@{}] the crash came before record {updated}'s update was published",
            self.point,
            self.hit
        );
        let deletes_out = matches!(
            self.point,
            names::AFTER_DELETE_PUBLISH | names::AFTER_DELETE_COMMIT
        );
        for id in doomed {
            assert_eq!(
                about(*id, "delete"),
                deletes_out,
                "[{}@{}] record {id}'s delete should {}have been published at the crash",
                self.point,
                self.hit,
                if deletes_out { "" } else { "not " }
            );
        }
    }

    /// Reads the stream back and checks the end state against upstream.
    async fn assert_converged(&self, story: &str) {
        let js = jetstream(&self.nats.url()).await;
        let events = read_stream(&js).await;
        let upstream = upstream_hashes(&self.sim, &[(TENANT, VOUCHERS)]);
        let verdict = check_end_state(&events, &upstream);
        assert!(
            verdict.clean(),
            "crash point {}: after the restart the stream does not match upstream \
             ({} records, {} events; {story}):\n{}",
            self.point,
            verdict.records,
            verdict.events,
            verdict.report()
        );
    }
}

/// A crash inside an incremental sweep's page. The page holds updates of
/// records 2..=8 and two creates; after the crash upstream deletes records
/// 2, 3 and the first created one, reverts 4 and 5 to their version before
/// the page (updated_at included) and 6 with a fresh updated_at, leaves 7,
/// 8 and the second created one; a full sweep then converges.
async fn page_scenario(point: &'static str) {
    let Some(world) = World::start(point).await else {
        return;
    };
    let sim = &world.sim;
    world.run_clean(&world.incremental, "first-sync");

    let updated: Vec<i64> = (2..=8).collect();
    let before: Vec<RecordValue> = updated.iter().map(|id| world.snapshot(*id)).collect();
    for id in &updated {
        assert!(sim.update(TENANT, VOUCHERS, *id));
    }
    let created = [sim.create(TENANT, VOUCHERS), sim.create(TENANT, VOUCHERS)];

    world.run_until_crash(&world.incremental);

    for id in [2, 3, created[0]] {
        assert!(sim.delete(TENANT, VOUCHERS, id));
    }
    assert!(sim.restore(TENANT, &before[2], false)); // record 4
    assert!(sim.restore(TENANT, &before[3], false)); // record 5
    assert!(sim.restore(TENANT, &before[4], true)); // record 6, updated_at bumped

    world.run_clean(&world.full, "restart");
    world
        .assert_converged(&format!(
            "interrupted page: updates of 2..=8, creates {created:?}; then deleted 2, 3, {}, \
             reverted 4, 5 (exact) and 6 (bumped)",
            created[0]
        ))
        .await;
}

/// A crash inside a full sweep's deletes. Records 10, 11 and 12 are deleted
/// upstream and a full sweep starts deleting them; after the crash 10 comes
/// back with identical content (updated_at included), 11 with identical
/// content and a fresh updated_at, 12 stays deleted; a full sweep converges.
async fn delete_scenario(point: &'static str) {
    let Some(world) = World::start(point).await else {
        return;
    };
    delete_story(world).await;
}

/// [`delete_scenario`] in a world already started.
async fn delete_story(world: World) {
    let sim = &world.sim;
    world.run_clean(&world.incremental, "first-sync");

    let doomed = [10, 11, 12];
    let before: Vec<RecordValue> = doomed.iter().map(|id| world.snapshot(*id)).collect();
    for id in doomed {
        assert!(sim.delete(TENANT, VOUCHERS, id));
    }
    // A change in the same sweep, so its pages commit before the deletes.
    assert!(sim.update(TENANT, VOUCHERS, 20));

    world.run_until_crash(&world.full);
    world.assert_crashed_among_the_deletes(&doomed, 20).await;

    assert!(sim.restore(TENANT, &before[0], false)); // record 10, exact
    assert!(sim.restore(TENANT, &before[1], true)); // record 11, updated_at bumped

    world.run_clean(&world.full, "restart");
    world
        .assert_converged(
            "interrupted deletes of 10, 11, 12 (20 updated in the same sweep); \
             then 10 re-created identical (same updated_at), 11 identical (new updated_at), 12 gone",
        )
        .await;
}

/// A crash in a first sync of 450 records (nine pages, in id order) once a
/// second group's intents are durable while the first group's commit is
/// still staged: every event of the first group is acknowledged and none of
/// its hashes is on disk. (A group takes at most eight pages, so nine pages
/// make two groups however the pages arrive.) Upstream then deletes records 3
/// and 4 of the first page; a full sweep converges: their intents survived,
/// so their snapshots are followed by deletes (without them the snapshots
/// would dangle), and the first group is published again with the same ids.
async fn staged_commit_scenario(point: &'static str) {
    let pages = voucher_cdc::sweep::MAX_GROUP_PAGES + 1;
    let Some(world) = World::with_vouchers(point, pages * 50).await else {
        return;
    };
    world.run_until_crash(&world.incremental);
    for id in [3, 4] {
        assert!(world.sim.delete(TENANT, VOUCHERS, id));
    }
    world.run_clean(&world.full, "restart");
    world
        .assert_converged(
            "first sync interrupted with its first group acknowledged and its commit staged; \
             then 3 and 4 (page 1) deleted",
        )
        .await;
}

/// A crash while a group of staged commits too large for one sled batch is
/// written: 188 records of a 6,000-record catalog, each in its own 32-id
/// bucket, change in one incremental sweep (four pages), and the daemon dies
/// once the first batch of buckets is in the log, before the journal
/// removals. Upstream then deletes two of them and reverts three: the first
/// (exactly, in the batch that was written), the second (with a fresh
/// updated_at) and the last (exactly: its bucket was not written, so only its
/// intent knows that its new version went out); a full sweep converges.
async fn settle_batches_scenario(point: &'static str) {
    let Some(world) = World::with_vouchers(point, 6_000).await else {
        return;
    };
    let sim = &world.sim;
    world.run_clean(&world.incremental, "first-sync");

    let changed: Vec<i64> = (1..=6_000).step_by(32).collect();
    let last = changed[changed.len() - 1];
    let before: Vec<RecordValue> = [changed[0], changed[1], last]
        .iter()
        .map(|id| world.snapshot(*id))
        .collect();
    for id in &changed {
        assert!(sim.update(TENANT, VOUCHERS, *id));
    }

    world.run_until_crash(&world.incremental);

    for id in [changed[10], changed[100]] {
        assert!(sim.delete(TENANT, VOUCHERS, id));
    }
    assert!(sim.restore(TENANT, &before[0], false));
    assert!(sim.restore(TENANT, &before[1], true));
    assert!(sim.restore(TENANT, &before[2], false));

    world.run_clean(&world.full, "restart");
    world
        .assert_converged(&format!(
            "{} records changed in one sweep, interrupted between settle batches; then \
             deleted {}, {}, reverted {} and {last} (exact) and {} (bumped)",
            changed.len(),
            changed[10],
            changed[100],
            changed[0],
            changed[1]
        ))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_intents_are_written_loses_no_change() {
    page_scenario(names::AFTER_INTENTS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_as_a_pages_events_go_to_the_sink_loses_no_change() {
    page_scenario(names::BEFORE_PUBLISH).await;
}

/// The full sweep publishes the page with record 20's update first (hit 1),
/// then the deletes (hit 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_as_deletes_go_to_the_sink_loses_no_delete() {
    let Some(world) = World::start(names::BEFORE_PUBLISH).await else {
        return;
    };
    delete_story(world.firing_at_hit(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_acks_before_the_commit_loses_no_change() {
    page_scenario(names::AFTER_PUBLISH).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_right_after_the_commit_loses_no_change() {
    page_scenario(names::AFTER_COMMIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_delete_intents_are_written_loses_no_delete() {
    delete_scenario(names::AFTER_DELETE_INTENTS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_delete_acks_before_the_commit_loses_no_change() {
    delete_scenario(names::AFTER_DELETE_PUBLISH).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_right_after_the_delete_commit_loses_no_change() {
    delete_scenario(names::AFTER_DELETE_COMMIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_while_a_page_commit_is_staged_behind_the_next_pages_intents_loses_no_change() {
    staged_commit_scenario(names::INTENTS_BEFORE_STAGED_COMMIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_the_batches_of_a_large_staged_group_loses_no_change() {
    settle_batches_scenario(names::BETWEEN_SETTLE_BATCHES).await;
}

#[test]
fn every_crash_point_has_a_scenario() {
    let covered = [
        names::AFTER_INTENTS,
        names::BEFORE_PUBLISH,
        names::AFTER_PUBLISH,
        names::AFTER_COMMIT,
        names::INTENTS_BEFORE_STAGED_COMMIT,
        names::BETWEEN_SETTLE_BATCHES,
        names::AFTER_DELETE_INTENTS,
        names::AFTER_DELETE_PUBLISH,
        names::AFTER_DELETE_COMMIT,
    ];
    for name in names::ALL {
        assert!(
            covered.contains(&name),
            "crash point {name} has no scenario in tests/crash_points.rs"
        );
    }
}
