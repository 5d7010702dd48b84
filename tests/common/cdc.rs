//! What the crash tests (`crash_points`, `kill_nine`) share: the daemon
//! binary under test run as a real process, its config against the
//! in-process simulator and a real `nats-server -js`, reading the JetStream
//! stream back, and the end-state check behind "a crash causes duplicates,
//! never loss" (issue 12).
//!
//! Include with `#[path = "common/cdc.rs"] #[allow(dead_code)] mod cdc;`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use voucher_cdc::hash::{content_hash, IgnoreKeys};
use voucher_cdc::simulator::Simulator;
use voucher_cdc::sinks::nats::NatsSinkConfig;
use voucher_cdc::stream::Resource;
use voucher_cdc::telemetry::LogFormat;

use crate::common::TestConfig;

/// The JetStream stream the daemons publish to.
pub const STREAM: &str = "VOUCHER_CDC";

/// The daemon binary under test: `VCDC_RELEASE_BIN` when set (the kill-test
/// script points it at a `--release --features crash-points` build), else
/// the binary cargo built for this test run.
pub fn daemon_binary() -> PathBuf {
    match std::env::var_os("VCDC_RELEASE_BIN") {
        Some(path) => {
            let path = PathBuf::from(path);
            assert!(
                path.is_file(),
                "VCDC_RELEASE_BIN={} is not a file",
                path.display()
            );
            path
        }
        None => PathBuf::from(env!("CARGO_BIN_EXE_voucher-cdc")),
    }
}

/// The config of a crash-test daemon: `sim`'s `tenants` (each with its
/// resources), publishing to the JetStream stream [`STREAM`] at `nats_url`,
/// state under `dir`, sweeps every 100ms and a full sweep every hour, JSON logs.
pub fn nats_daemon_config(
    sim: &Simulator,
    nats_url: &str,
    dir: &Path,
    tenants: Vec<(u64, Vec<Resource>)>,
) -> TestConfig {
    let config = TestConfig::for_simulator(sim, dir, &[])
        .with_max_attempts(3)
        .with_poll_interval(Duration::from_millis(100))
        .with_full_resync_interval(Duration::from_secs(3600))
        .with_max_delete_fraction(0.9)
        .with_shutdown_timeout(Duration::from_secs(5))
        .with_nats_sink(NatsSinkConfig {
            url: nats_url.to_string(),
            stream: STREAM.to_string(),
            subject_prefix: "voucher_cdc".to_string(),
            duplicate_window: Duration::from_secs(600),
            publish_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(10),
            ..NatsSinkConfig::default()
        })
        .with_log(LogFormat::Json, "info");
    tenants
        .into_iter()
        .fold(config, |config, (tenant, resources)| {
            config.with_tenant(tenant, &resources)
        })
}

/// A daemon process, its output in files (no pipe can fill up and stall it).
pub struct DaemonProcess {
    /// The process.
    pub child: Child,
    stdout: PathBuf,
    stderr: PathBuf,
}

impl DaemonProcess {
    /// Starts `voucher-cdc run --config CONFIG [--once]`, with `crash_point`
    /// armed (`VCDC_CRASH_POINT`) when given; output goes to `LOGS.stdout/.stderr`.
    pub fn spawn(config: &Path, once: bool, crash_point: Option<&str>, logs: &Path) -> Self {
        Self::spawn_with_env(config, once, crash_point, &[], logs)
    }

    /// [`Self::spawn`] with extra environment variables set.
    pub fn spawn_with_env(
        config: &Path,
        once: bool,
        crash_point: Option<&str>,
        env: &[(&str, &str)],
        logs: &Path,
    ) -> Self {
        let stdout = logs.with_extension("stdout");
        let stderr = logs.with_extension("stderr");
        let mut command = Command::new(daemon_binary());
        command
            .arg("run")
            .arg("--config")
            .arg(config)
            .env_remove("RUST_LOG")
            .env_remove("VOUCHER_CDC_CONFIG")
            .env_remove(voucher_cdc::crashpoint::ENV)
            .env_remove(voucher_cdc::crashpoint::DURABLE_COMMITS_ENV)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&stdout).unwrap())
            .stderr(std::fs::File::create(&stderr).unwrap());
        if once {
            command.arg("--once");
        }
        if let Some(point) = crash_point {
            command.env(voucher_cdc::crashpoint::ENV, point);
        }
        let child = command.spawn().expect("the daemon binary starts");
        DaemonProcess {
            child,
            stdout,
            stderr,
        }
    }

    /// Waits for the exit; kills the process and panics after `timeout`.
    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "voucher-cdc did not exit within {timeout:?}; stderr tail:\n{}",
                    tail(&self.stderr(), 40)
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILL, as `kill -9` does, and reap.
    pub fn kill_nine(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether it still runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Everything written to stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Everything written to stdout so far.
    pub fn stdout(&self) -> String {
        std::fs::read_to_string(&self.stdout).unwrap_or_default()
    }
}

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The signal that ended a process, if one did.
pub fn signal_of(status: &ExitStatus) -> Option<i32> {
    use std::os::unix::process::ExitStatusExt;
    status.signal()
}

/// A record across upstream and the stream: (tenant, resource, id).
pub type RecordKey = (u64, String, String);

/// One message of the stream, parsed.
#[derive(Debug, Clone)]
pub struct StoredEvent {
    /// Stream sequence.
    pub seq: u64,
    /// The `Nats-Msg-Id` header.
    pub msg_id: String,
    /// The subject.
    pub subject: String,
    /// The event JSON.
    pub event: Value,
}

impl StoredEvent {
    /// The event `type`.
    pub fn ty(&self) -> &str {
        self.event["type"].as_str().unwrap_or("")
    }

    /// The event `op` (empty for replay frames).
    pub fn op(&self) -> &str {
        self.event["op"].as_str().unwrap_or("")
    }

    /// The event `id`.
    pub fn id(&self) -> &str {
        self.event["id"].as_str().unwrap_or("")
    }

    /// `contenthash`.
    pub fn hash(&self) -> &str {
        self.event["contenthash"].as_str().unwrap_or("")
    }

    /// `previoushash` (empty when absent).
    pub fn previous(&self) -> &str {
        self.event["previoushash"].as_str().unwrap_or("")
    }

    /// The record it is about; None for replay frames and dead letters.
    pub fn record(&self) -> Option<RecordKey> {
        let ty = self.ty();
        if !(ty.ends_with(".updated") || ty.ends_with(".deleted"))
            || ty.starts_with("replay.")
            || self.subject.ends_with(".deadletter")
        {
            return None;
        }
        let tenant = self.event["tenant"].as_u64()?;
        let source = self.event["source"].as_str()?;
        let resource = source.rsplit('/').next()?.to_string();
        let subject = self.event["subject"].as_str()?.to_string();
        Some((tenant, resource, subject))
    }

    /// What makes two events the same change (everything the id is derived
    /// from that the event shows, plus the type).
    pub fn change(&self) -> String {
        let e = &self.event;
        format!(
            "source={} subject={} type={} op={} contenthash={} previoushash={} replayid={}",
            e["source"],
            e["subject"],
            e["type"],
            e["op"],
            e["contenthash"],
            e["previoushash"],
            e["replayid"]
        )
    }

    /// A short description for assertion messages.
    pub fn short(&self) -> String {
        format!(
            "#{} {} {} hash={} prev={} id={}",
            self.seq,
            self.ty(),
            self.op(),
            short_hash(self.hash()),
            short_hash(self.previous()),
            short_hash(self.id()),
        )
    }
}

fn short_hash(h: &str) -> &str {
    if h.is_empty() {
        "-"
    } else {
        &h[..h.len().min(10)]
    }
}

/// A JetStream context on `url`.
pub async fn jetstream(url: &str) -> async_nats::jetstream::Context {
    let client = async_nats::connect(url)
        .await
        .expect("connect to nats-server");
    async_nats::jetstream::new(client)
}

/// Messages the stream holds now (0 while it does not exist yet).
pub async fn stream_len(js: &async_nats::jetstream::Context) -> u64 {
    match js.get_stream(STREAM).await {
        Ok(mut stream) => stream
            .info()
            .await
            .map(|i| i.state.last_sequence)
            .unwrap_or(0),
        Err(_) => 0,
    }
}

/// The stream's messages with sequence in `from..=to`, in order.
pub async fn read_range(
    js: &async_nats::jetstream::Context,
    from: u64,
    to: u64,
) -> Vec<StoredEvent> {
    use async_nats::header::NATS_MESSAGE_ID;
    use futures::StreamExt;
    if from > to {
        return Vec::new();
    }
    let Ok(stream) = js.get_stream(STREAM).await else {
        return Vec::new();
    };
    futures::stream::iter(from..=to)
        .map(|seq| {
            let stream = &stream;
            async move {
                let message = stream
                    .get_raw_message(seq)
                    .await
                    .unwrap_or_else(|e| panic!("reading stream message {seq}: {e}"));
                let msg_id = message
                    .headers
                    .get(NATS_MESSAGE_ID)
                    .map(|v| v.as_str().to_string())
                    .unwrap_or_default();
                let event: Value = serde_json::from_slice(&message.payload)
                    .unwrap_or_else(|e| panic!("stream message {seq} is not JSON: {e}"));
                if !message.subject.ends_with(".deadletter") {
                    crate::common::schema::assert_valid_event_json(&event);
                }
                StoredEvent {
                    seq,
                    msg_id,
                    subject: message.subject.to_string(),
                    event,
                }
            }
        })
        .buffered(64)
        .collect()
        .await
}

/// Every message the stream holds, in order.
pub async fn read_stream(js: &async_nats::jetstream::Context) -> Vec<StoredEvent> {
    let last = stream_len(js).await;
    read_range(js, 1, last).await
}

/// The content hash the bridge computes for a record's listed JSON.
pub fn hash_of(raw: &str) -> String {
    content_hash(raw, &IgnoreKeys::new(["updated_at"]))
        .expect("upstream records hash")
        .to_hex()
}

/// The content hash of every record upstream now, as the bridge lists it
/// (with relations), for the given streams.
pub fn upstream_hashes(
    sim: &Simulator,
    streams: &[(u64, Resource)],
) -> BTreeMap<RecordKey, String> {
    let mut out = BTreeMap::new();
    for (tenant, resource) in streams {
        for id in sim.record_ids(*tenant, *resource) {
            if let Some(raw) = sim.record_json(*tenant, *resource, id, true) {
                out.insert(
                    (*tenant, resource.as_str().to_string(), id.to_string()),
                    hash_of(&raw),
                );
            }
        }
    }
    out
}

/// What the end-state check found.
#[derive(Debug, Default)]
pub struct Verdict {
    /// Records checked (upstream now plus every record with an event).
    pub records: usize,
    /// Record events stored (duplicates included).
    pub events: usize,
    /// Records whose last event does not match upstream.
    pub losses: Vec<String>,
    /// Update/delete events whose previoushash is not the previous event's contenthash.
    pub chain_breaks: Vec<String>,
    /// Event ids carried by two different changes.
    pub id_conflicts: Vec<String>,
    /// Update/delete events whose previoushash names a version that never
    /// reached the stream (a possibly-published intent); allowed, reported.
    pub unseen_previous: Vec<String>,
}

impl Verdict {
    /// True when nothing was lost, every chain holds and ids are unambiguous.
    pub fn clean(&self) -> bool {
        self.losses.is_empty() && self.chain_breaks.is_empty() && self.id_conflicts.is_empty()
    }

    /// Every problem, one per line.
    pub fn report(&self) -> String {
        let mut out = String::new();
        for (what, list) in [
            ("LOST", &self.losses),
            ("CHAIN", &self.chain_breaks),
            ("ID", &self.id_conflicts),
        ] {
            for line in list {
                let _ = writeln!(out, "{what}: {line}");
            }
        }
        for line in &self.unseen_previous {
            let _ = writeln!(
                out,
                "note (allowed): previoushash names a version never in the stream: {line}"
            );
        }
        out
    }
}

/// Checks the stream's end state against upstream:
/// - for every record, its last event matches upstream: an existing record's
///   last event is `*.updated` with the current content hash, a deleted
///   record's (one that has events) is `*.deleted`;
/// - per record, every update/delete's `previoushash` is the `contenthash` of
///   the record's previous event (a create or snapshot may start a chain), or
///   names a version that never reached the stream at all: a pending intent
///   counts as possibly published (DESIGN.md), so a revert after a crash
///   before the publish, or the delete of a create that never went out,
///   refers to it. It never names an older version the stream superseded
///   (that is a change computed against stale state: downstream diverged);
/// - two stored events with the same id are the same change.
///
/// Events are deduplicated by id (first occurrence kept) before the per-record
/// checks, as a consumer that deduplicates by id sees them.
pub fn check_end_state(events: &[StoredEvent], upstream: &BTreeMap<RecordKey, String>) -> Verdict {
    let mut verdict = Verdict::default();
    let mut first_by_id: HashMap<&str, &StoredEvent> = HashMap::new();
    let mut per_record: BTreeMap<RecordKey, Vec<&StoredEvent>> = BTreeMap::new();
    for event in events {
        let Some(record) = event.record() else {
            continue;
        };
        verdict.events += 1;
        if event.msg_id != event.id() {
            verdict.id_conflicts.push(format!(
                "{}: Nats-Msg-Id {} differs from the event id",
                event.short(),
                event.msg_id
            ));
        }
        match first_by_id.get(event.id()) {
            Some(first) => {
                if first.change() != event.change() {
                    verdict.id_conflicts.push(format!(
                        "id {} carries two different changes: {} [{}] and {} [{}]",
                        event.id(),
                        first.short(),
                        first.change(),
                        event.short(),
                        event.change()
                    ));
                }
            }
            None => {
                first_by_id.insert(event.id(), event);
                per_record.entry(record).or_default().push(event);
            }
        }
    }
    let keys: BTreeSet<&RecordKey> = upstream.keys().chain(per_record.keys()).collect();
    verdict.records = keys.len();
    for key in keys {
        let history = per_record.get(key).map(Vec::as_slice).unwrap_or(&[]);
        let name = format!("tenant {} {} {}", key.0, key.1, key.2);
        let seen = || {
            if history.is_empty() {
                "no events".to_string()
            } else {
                history
                    .iter()
                    .map(|e| e.short())
                    .collect::<Vec<_>>()
                    .join(" | ")
            }
        };
        match (upstream.get(key), history.last()) {
            (Some(hash), Some(last)) if last.ty().ends_with(".updated") && last.hash() == hash.as_str() => {}
            (Some(hash), _) => verdict.losses.push(format!(
                "{name} exists upstream with content {} but its last event does not say so; events: {}",
                short_hash(hash),
                seen()
            )),
            (None, Some(last)) if !last.ty().ends_with(".deleted") => verdict.losses.push(format!(
                "{name} is deleted upstream but its last event is not *.deleted; events: {}",
                seen()
            )),
            (None, _) => {}
        }
        for (i, event) in history.iter().enumerate() {
            let op = event.op();
            if op != "update" && op != "delete" {
                continue;
            }
            let previous = i.checked_sub(1).map(|p| history[p]);
            if previous.is_some_and(|p| p.hash() == event.previous()) {
                continue;
            }
            // A version this record's stream already superseded: downstream held a
            // newer one, so the change was computed against stale state.
            let stale = history[..i].iter().any(|e| e.hash() == event.previous());
            if stale {
                verdict.chain_breaks.push(match previous {
                    Some(previous) => format!(
                        "{name}: {} follows {} (previoushash should be {}, names an older version); events: {}",
                        event.short(),
                        previous.short(),
                        short_hash(previous.hash()),
                        seen()
                    ),
                    None => format!("{name}: {} has no previous event; events: {}", event.short(), seen()),
                });
            } else {
                // A version that never reached the stream: a pending intent whose event
                // may have been published (the bridge cannot know it was not).
                verdict
                    .unseen_previous
                    .push(format!("{name}: {}", event.short()));
            }
        }
    }
    verdict
}
