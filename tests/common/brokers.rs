//! Real brokers for the sink tests and benches: a `nats-server -js` and a
//! tansu Kafka broker, each started on a free port with its own store, plus
//! a Kafka read-back helper and an event factory.
//!
//! Include with `#[path = "common/brokers.rs"] #[allow(dead_code)] mod brokers;`
//! beside `mod common;` (each includer uses a different part).

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use chrono::Utc;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{BorrowedMessage, Headers};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use serde_json::value::RawValue;
use voucher_cdc::event::{
    record_event, record_event_with, Event, Op, RecordChange, VersionAttributes,
};
use voucher_cdc::hash::ContentHash;
use voucher_cdc::schema::DEFAULT_SCHEMA_BASE;
use voucher_cdc::sinks::Sink;
use voucher_cdc::stream::StreamKey;

use crate::common::free_port;

/// Whether a missing tool must fail the test instead of skipping it: under
/// `scripts/test.sh` (env `VCDC_REQUIRE_BROKERS=1`, it installs every tool)
/// and in CI (env `CI` set to anything but `false`/`0`/empty).
pub fn tools_required() -> bool {
    let set = |name: &str| {
        std::env::var(name)
            .map(|v| !matches!(v.trim(), "" | "0" | "false"))
            .unwrap_or(false)
    };
    set("VCDC_REQUIRE_BROKERS") || set("CI")
}

/// Reports that a test cannot run because `message` (a missing tool): panics
/// when [`tools_required`], otherwise prints why and returns, so the caller
/// skips. The line goes to the process's stderr directly, past the test
/// harness's output capture, so a bare `cargo test` shows every skip.
pub fn skip_or_fail(test: &str, message: &str) {
    if tools_required() {
        panic!("{test}: {message} (VCDC_REQUIRE_BROKERS or CI is set: a missing tool fails)");
    }
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr().lock(),
        "SKIPPED {test}: {message} (set VCDC_REQUIRE_BROKERS=1 to fail instead)"
    );
}

/// Returns `Some(path)` when `path` exists; otherwise skips or fails (see [`skip_or_fail`]).
fn require_binary(what: &str, path: Option<PathBuf>, how_to_get: &str) -> Option<PathBuf> {
    match path {
        Some(p) if p.is_file() => Some(p),
        other => {
            let message = format!(
                "{what} not found (looked at {}): {how_to_get}",
                other
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|| "PATH".to_string())
            );
            let test = std::thread::current()
                .name()
                .unwrap_or("a test")
                .to_string();
            skip_or_fail(&test, &message);
            None
        }
    }
}

fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

fn wait_until_listening(port: u16, child: &mut Child, log: &Path, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            let log_text = std::fs::read_to_string(log).unwrap_or_default();
            panic!("{what} exited with {status} before listening on {port}:\n{log_text}");
        }
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let log_text = std::fs::read_to_string(log).unwrap_or_default();
    panic!("{what} did not listen on {port} within 20s:\n{log_text}");
}

fn log_file(path: &Path) -> (Stdio, Stdio) {
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap();
    (file.try_clone().unwrap().into(), file.into())
}

/// A `nats-server -js` process owned by a test: its own port and store dir.
pub struct NatsServer {
    binary: PathBuf,
    port: u16,
    store: tempfile::TempDir,
    child: Option<Child>,
    /// A server config file (`-c`), for limits such as `max_payload`.
    config: Option<PathBuf>,
}

/// Starts `nats-server -js` on a free port with a temporary store; `None` when
/// the binary is missing outside CI (env `NATS_SERVER_BIN` overrides the PATH lookup).
pub fn spawn_nats() -> Option<NatsServer> {
    spawn_nats_configured(None)
}

/// Like [`spawn_nats`], with the server's `max_payload` set to `bytes` (a
/// config file), so an ordinary record can be too large for it.
pub fn spawn_nats_with_max_payload(bytes: usize) -> Option<NatsServer> {
    spawn_nats_configured(Some(format!("max_payload: {bytes}\n")))
}

/// Like [`spawn_nats`], with `config` as the server's config file (TLS,
/// authorization); its relative paths are relative to the config file.
pub fn spawn_nats_with_config(config: &str) -> Option<NatsServer> {
    spawn_nats_configured(Some(config.to_string()))
}

/// Starts `nats-server -js`, with `config` as its config file when given.
fn spawn_nats_configured(config: Option<String>) -> Option<NatsServer> {
    let configured = std::env::var_os("NATS_SERVER_BIN").map(PathBuf::from);
    let binary = require_binary(
        "nats-server",
        configured.or_else(|| on_path("nats-server")),
        "install it (apt-get install nats-server) or set NATS_SERVER_BIN",
    )?;
    let store = tempfile::tempdir().unwrap();
    let config = config.map(|text| {
        let path = store.path().join("nats-server.conf");
        std::fs::write(&path, text).unwrap();
        path
    });
    let mut server = NatsServer {
        binary,
        port: free_port(),
        store,
        child: None,
        config,
    };
    server.start();
    Some(server)
}

impl NatsServer {
    /// The client URL, e.g. `nats://127.0.0.1:41234`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The server's log (stdout and stderr of every run).
    pub fn log_path(&self) -> PathBuf {
        self.store.path().join("nats-server.log")
    }

    /// Kills the server at once (SIGKILL), keeping its store.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().ok();
            child.wait().ok();
        }
    }

    /// Starts the server again on the same port and store.
    pub fn restart(&mut self) {
        self.kill();
        self.start();
    }

    fn start(&mut self) {
        let log = self.log_path();
        let (stdout, stderr) = log_file(&log);
        let store = self.store.path().join("jetstream");
        let mut command = Command::new(&self.binary);
        if let Some(config) = &self.config {
            command.arg("-c").arg(config);
        }
        let mut child = command
            .args(["-js", "-a", "127.0.0.1", "-p"])
            .arg(self.port.to_string())
            .arg("-sd")
            .arg(&store)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .unwrap();
        wait_until_listening(self.port, &mut child, &log, "nats-server");
        self.child = Some(child);
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A message stored in a JetStream stream.
#[derive(Debug, Clone)]
pub struct StoredMessage {
    /// Its subject.
    pub subject: String,
    /// Its `Nats-Msg-Id` header ("" when absent).
    pub msg_id: String,
    /// Its body.
    pub payload: Vec<u8>,
}

/// Every message of `stream` on the server at `url`, in stream order.
pub async fn stored_messages(url: &str, stream: &str) -> Vec<StoredMessage> {
    use futures::StreamExt;
    let client = async_nats::connect(url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let stream = js.get_stream(stream).await.unwrap();
    let count = stream.cached_info().state.messages;
    let first = stream.cached_info().state.first_sequence;
    futures::stream::iter(first..first + count)
        .map(|seq| {
            let stream = &stream;
            async move {
                let message = stream.get_raw_message(seq).await.unwrap();
                let msg_id = message
                    .headers
                    .get(async_nats::header::NATS_MESSAGE_ID)
                    .map(|v| v.as_str().to_string())
                    .unwrap_or_default();
                StoredMessage {
                    subject: message.subject.to_string(),
                    msg_id,
                    payload: message.payload.to_vec(),
                }
            }
        })
        .buffered(64)
        .collect()
        .await
}

/// Where `scripts/install-tansu.sh` puts the tansu binary.
pub fn tansu_cache_path() -> PathBuf {
    let cache = std::env::var_os("VCDC_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME").map(|x| PathBuf::from(x).join("voucher-cdc"))
        })
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/voucher-cdc")))
        .unwrap_or_else(|| PathBuf::from("/root/.cache/voucher-cdc"));
    cache.join("tansu-0.6.0/bin/tansu")
}

/// A tansu broker (in-memory storage) owned by a test.
pub struct TansuBroker {
    port: u16,
    child: Child,
    dir: tempfile::TempDir,
}

/// Starts tansu on a free port with memory storage; `None` when the binary
/// is missing outside CI (env `TANSU_BIN`, else the install script's cache path).
pub fn spawn_tansu() -> Option<TansuBroker> {
    spawn_tansu_advertising(None)
}

/// Like [`spawn_tansu`], but the broker tells clients (in its metadata) to
/// connect to `127.0.0.1:<advertised>` instead of its own port: a proxy in
/// front of it (TLS, SASL) then sees every connection.
pub fn spawn_tansu_advertising(advertised: Option<u16>) -> Option<TansuBroker> {
    let configured = std::env::var_os("TANSU_BIN").map(PathBuf::from);
    let binary = require_binary(
        "tansu",
        Some(configured.unwrap_or_else(tansu_cache_path)),
        "run scripts/install-tansu.sh or set TANSU_BIN",
    )?;
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("tansu.log");
    let (stdout, stderr) = log_file(&log);
    let url = format!("tcp://127.0.0.1:{port}");
    let advertised_url = format!("tcp://127.0.0.1:{}", advertised.unwrap_or(port));
    let mut child = Command::new(binary)
        .arg("broker")
        .args(["--cluster-id", "voucher-cdc-test"])
        .args(["--listener-url", &url])
        .args(["--advertised-listener-url", &advertised_url])
        .args(["--storage-engine", "memory://tansu/"])
        .env_remove("LISTENER_URL")
        .env_remove("ADVERTISED_LISTENER_URL")
        .env_remove("STORAGE_ENGINE")
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .unwrap();
    wait_until_listening(port, &mut child, &log, "tansu");
    Some(TansuBroker { port, child, dir })
}

impl TansuBroker {
    /// The bootstrap address, e.g. `127.0.0.1:41234`.
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The port the broker listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The broker's log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("tansu.log")).unwrap_or_default()
    }
}

impl Drop for TansuBroker {
    fn drop(&mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
    }
}

/// A record read back from Kafka.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Consumed {
    /// Topic it was read from.
    pub topic: String,
    /// Partition it was read from.
    pub partition: i32,
    /// Offset in the partition.
    pub offset: i64,
    /// Record key.
    pub key: Option<Vec<u8>>,
    /// Record value (`None` for a tombstone).
    pub payload: Option<Vec<u8>>,
    /// Headers as (name, value).
    pub headers: Vec<(String, Vec<u8>)>,
}

/// Reads every partition of `topics` from the beginning until `expected`
/// records arrived or `timeout` passed; returns them in partition order.
pub fn consume_all(
    bootstrap: &str,
    topics: &[&str],
    partitions: i32,
    expected: usize,
    timeout: Duration,
) -> Vec<Consumed> {
    consume_all_with(bootstrap, &[], topics, partitions, expected, timeout)
}

/// Like [`consume_all`], with extra librdkafka `properties` (TLS, SASL).
pub fn consume_all_with(
    bootstrap: &str,
    properties: &[(&str, &str)],
    topics: &[&str],
    partitions: i32,
    expected: usize,
    timeout: Duration,
) -> Vec<Consumed> {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "voucher-cdc-test-reader")
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest");
    for (key, value) in properties {
        config.set(*key, *value);
    }
    let consumer: BaseConsumer = config.create().unwrap();
    let mut assignment = TopicPartitionList::new();
    for topic in topics {
        for partition in 0..partitions {
            assignment
                .add_partition_offset(topic, partition, Offset::Beginning)
                .unwrap();
        }
    }
    consumer.assign(&assignment).unwrap();
    let deadline = Instant::now() + timeout;
    let mut records = Vec::new();
    while records.len() < expected && Instant::now() < deadline {
        let Some(result) = consumer.poll(Duration::from_millis(100)) else {
            continue;
        };
        if let Ok(message) = result {
            records.push(consumed(&message));
        }
    }
    // Anything beyond `expected` (duplicates) shows up within a short grace period.
    let grace = Instant::now() + Duration::from_millis(300);
    while Instant::now() < grace {
        if let Some(Ok(message)) = consumer.poll(Duration::from_millis(50)) {
            records.push(consumed(&message));
        }
    }
    records
        .sort_by(|a, b| (&a.topic, a.partition, a.offset).cmp(&(&b.topic, b.partition, b.offset)));
    records
}

fn consumed(message: &BorrowedMessage<'_>) -> Consumed {
    let headers = message
        .headers()
        .map(|h| {
            h.iter()
                .map(|header| {
                    (
                        header.key.to_string(),
                        header.value.unwrap_or_default().to_vec(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    Consumed {
        topic: message.topic().to_string(),
        partition: message.partition(),
        offset: message.offset(),
        key: message.key().map(<[u8]>::to_vec),
        payload: message.payload().map(<[u8]>::to_vec),
        headers,
    }
}

/// Publishes `events` again and again, as the sweep does, until every one is
/// acked; each failure on the way must be retriable. Returns the attempts made.
pub async fn retry_until_acked(
    sink: &dyn Sink,
    mut pending: Vec<Event>,
    within: Duration,
) -> usize {
    let deadline = Instant::now() + within;
    let mut attempts = 0;
    while !pending.is_empty() {
        assert!(
            Instant::now() < deadline,
            "{} events never acked",
            pending.len()
        );
        attempts += 1;
        let acks = sink.publish(&pending).await;
        assert_eq!(acks.len(), pending.len(), "one ack per event");
        if let Some(Err(fatal)) = acks
            .iter()
            .find(|a| matches!(a, Err(e) if !e.is_retriable()))
        {
            panic!("a retry failed fatally: {fatal}");
        }
        pending = pending
            .into_iter()
            .zip(acks)
            .filter(|(_, ack)| ack.is_err())
            .map(|(event, _)| event)
            .collect();
        if !pending.is_empty() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    attempts
}

/// A record's headers as text, by name (each name once).
pub fn header_map(record: &Consumed) -> BTreeMap<String, String> {
    let mut map = BTreeMap::new();
    for (name, value) in &record.headers {
        let value = String::from_utf8(value.clone()).unwrap();
        assert!(map.insert(name.clone(), value).is_none(), "{name} twice");
    }
    map
}

/// The one record of `records` that `is_event` picks for `event`; fails when
/// there is none or more than one.
pub fn read_back_once<'a>(
    records: &'a [Consumed],
    event: &Event,
    is_event: impl Fn(&Consumed) -> bool,
) -> &'a Consumed {
    let matching: Vec<_> = records.iter().filter(|r| is_event(r)).collect();
    assert_eq!(
        matching.len(),
        1,
        "event {} read back {} times",
        event.id,
        matching.len()
    );
    matching[0]
}

/// `count` events of `stream` for record ids `first_id..`, each payload about
/// `payload_bytes` long (at least the envelope's size).
pub fn sample_events(
    stream: StreamKey,
    first_id: u64,
    count: usize,
    op: Op,
    payload_bytes: usize,
) -> Vec<Event> {
    (0..count as u64)
        .map(|i| sample_event(stream, first_id + i, op, payload_bytes))
        .collect()
}

/// One event of `stream` for record `id` with a payload of about `payload_bytes`.
pub fn sample_event(stream: StreamKey, id: u64, op: Op, payload_bytes: usize) -> Event {
    let build = |filler: &str| {
        let data = format!(r#"{{"id":{id},"name":"voucher {id}","filler":"{filler}"}}"#);
        let raw = RawValue::from_string(data.clone()).unwrap();
        let mut hash = [0u8; 16];
        hash.copy_from_slice(&blake3::hash(data.as_bytes()).as_bytes()[..16]);
        let previous = (op != Op::Snapshot && op != Op::Create).then_some(ContentHash([0; 16]));
        record_event(&RecordChange {
            stream,
            record_id: i64::try_from(id).unwrap(),
            generation: 0,
            seq: 0,
            op,
            updated_at: Some("2024-05-01T10:00:00Z"),
            content_hash: ContentHash(hash),
            previous_hash: previous,
            replay: None,
            data: raw.get(),
            detected_at: Utc::now(),
            schema_base: &DEFAULT_SCHEMA_BASE,
        })
    };
    let bare = build("");
    let missing = payload_bytes.saturating_sub(bare.payload.len());
    if missing == 0 {
        return bare;
    }
    build(&"x".repeat(missing))
}

/// An update of record `id` with `changedfields` and `before`, as
/// `events.changed_fields` and `events.before` publish it.
pub fn update_with_version(stream: StreamKey, id: i64) -> Event {
    let data =
        RawValue::from_string(format!(r#"{{"id":{id},"title":"new","price":12.5}}"#)).unwrap();
    let before = format!(r#"{{"id":{id},"title":"old","price":10}}"#);
    record_event_with(
        &RecordChange {
            stream,
            record_id: id,
            generation: 0,
            seq: 3,
            op: Op::Update,
            updated_at: Some("2024-05-01T10:00:00Z"),
            content_hash: ContentHash([7; 16]),
            previous_hash: Some(ContentHash([6; 16])),
            replay: None,
            data: data.get(),
            detected_at: Utc::now(),
            schema_base: &DEFAULT_SCHEMA_BASE,
        },
        VersionAttributes {
            changed_fields: Some("price,title"),
            before: Some(&before),
        },
    )
}

/// A TCP relay between a NATS client and a `nats-server` that can hold the
/// server's replies at an exact point: after `n` more `MSG`/`HMSG` frames
/// (JetStream PubAcks) reached the client, it forwards nothing more to it on
/// that connection. A test kills the server at that point to make a kill land
/// mid-batch with certainty: at most `n` acks were received, every event
/// after them is unacknowledged, however busy the machine is.
///
/// Later connections (reconnects) are relayed without holding; while the
/// server is down a connection is accepted and closed at once.
pub struct NatsAckGate {
    port: u16,
    state: std::sync::Arc<GateState>,
    accept: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct GateState {
    /// Frames still to pass before holding, when armed.
    armed: std::sync::Mutex<Option<usize>>,
    /// Set once a connection holds.
    held: tokio::sync::Notify,
    held_flag: std::sync::atomic::AtomicBool,
}

impl NatsAckGate {
    /// Relays a free port to `server`.
    pub async fn start(server: &NatsServer) -> Self {
        let upstream = server.port;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = std::sync::Arc::new(GateState::default());
        let accept = {
            let state = state.clone();
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                    else {
                        continue; // the server is down: drop the client's connection
                    };
                    // The connection that is open when armed is the one that holds.
                    tokio::spawn(relay(client, server, state.clone()));
                }
            })
        };
        Self {
            port,
            state,
            accept,
        }
    }

    /// The client URL of the relay.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// From now on, let `n` more `MSG`/`HMSG` frames through to the client, then hold.
    pub fn hold_after(&self, n: usize) {
        *self.state.armed.lock().unwrap() = Some(n);
    }

    /// Waits (at most `timeout`) until a connection holds; panics otherwise.
    pub async fn held(&self, timeout: Duration) {
        let notified = self.state.held.notified();
        if self
            .state
            .held_flag
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            return;
        }
        tokio::time::timeout(timeout, notified)
            .await
            .unwrap_or_else(|_| panic!("the relay did not hold within {timeout:?}"));
    }
}

impl Drop for NatsAckGate {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn relay(
    client: tokio::net::TcpStream,
    server: tokio::net::TcpStream,
    state: std::sync::Arc<GateState>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upward = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
        let _ = server_write.shutdown().await;
    });
    let mut pending: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    let mut holding = false;
    loop {
        let read = match server_read.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if holding {
            continue; // swallowed: the client never sees it
        }
        pending.extend_from_slice(&chunk[..read]);
        let mut forward = 0;
        while let Some((len, is_msg)) = next_frame(&pending[forward..]) {
            if is_msg {
                let mut armed = state.armed.lock().unwrap();
                if let Some(left) = armed.as_mut() {
                    if *left == 0 {
                        *armed = None;
                        holding = true;
                        break;
                    }
                    *left -= 1;
                }
            }
            forward += len;
        }
        if client_write.write_all(&pending[..forward]).await.is_err() {
            break;
        }
        pending.drain(..forward);
        if holding {
            pending.clear();
            state
                .held_flag
                .store(true, std::sync::atomic::Ordering::SeqCst);
            state.held.notify_waiters();
        }
    }
    // The server went away (or the client did): close the client's side too.
    let _ = client_write.shutdown().await;
    upward.abort();
}

/// The length of the first complete server-to-client protocol frame in
/// `buf`, and whether it is a message (`MSG`/`HMSG`); None when incomplete.
fn next_frame(buf: &[u8]) -> Option<(usize, bool)> {
    let line_end = buf.windows(2).position(|w| w == b"\r\n")?;
    let line = std::str::from_utf8(&buf[..line_end]).ok()?;
    let is_msg = line.starts_with("MSG ") || line.starts_with("HMSG ");
    if !is_msg {
        return Some((line_end + 2, false));
    }
    // MSG <subject> <sid> [reply] <#bytes>; HMSG ... <#header bytes> <#total bytes>.
    let payload: usize = line.rsplit(' ').next()?.parse().ok()?;
    let len = line_end + 2 + payload + 2;
    (buf.len() >= len).then_some((len, true))
}

/// A sled store in a fresh temp dir and a NATS sink connected to `url` with
/// the default sink settings: what a sweep against a real server needs.
pub async fn store_and_nats_sink(
    url: &str,
) -> (
    tempfile::TempDir,
    std::sync::Arc<dyn voucher_cdc::state::StateStore>,
    std::sync::Arc<dyn Sink>,
) {
    let dir = tempfile::tempdir().unwrap();
    let store = voucher_cdc::state::SledStore::open(&dir.path().join("state")).unwrap();
    let sink =
        voucher_cdc::sinks::nats::NatsSink::connect(&voucher_cdc::sinks::nats::NatsSinkConfig {
            url: url.to_string(),
            ..voucher_cdc::sinks::nats::NatsSinkConfig::default()
        })
        .await
        .unwrap();
    (dir, std::sync::Arc::new(store), std::sync::Arc::new(sink))
}
