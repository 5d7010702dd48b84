//! Shared test helpers: each `spawn_*` starts a real dependency for a test;
//! [`TestConfig`] is the one config builder and [`free_port`] the one port picker.
#![allow(dead_code)]

pub mod pki;
pub mod prometheus;
pub mod schema;
pub mod sweeps;
mod test_config;

use std::path::Path;

use voucher_cdc::simulator::{Simulator, SimulatorOptions};

pub use self::test_config::TestConfig;

/// Starts an in-process simulator on a free loopback port with the rate limit off.
pub async fn spawn_simulator() -> Simulator {
    spawn_simulator_with(SimulatorOptions {
        rate_limit: 0,
        ..SimulatorOptions::default()
    })
    .await
}

/// Starts an in-process simulator with the given options (listen forced to a free loopback port).
pub async fn spawn_simulator_with(options: SimulatorOptions) -> Simulator {
    Simulator::start(SimulatorOptions {
        listen: "127.0.0.1:0".parse().unwrap(),
        ..options
    })
    .await
    .expect("simulator starts")
}

/// A simulator with `tenants` tenants of 20 vouchers and 5 categories, rate limit off.
pub async fn spawn_small_simulator(tenants: u64) -> Simulator {
    spawn_catalog(tenants, 20, 5).await
}

/// A simulator of `tenants` tenants with `vouchers` and `categories` each, rate limit off.
pub async fn spawn_catalog(tenants: u64, vouchers: usize, categories: usize) -> Simulator {
    spawn_simulator_with(SimulatorOptions {
        tenants,
        vouchers,
        categories,
        rate_limit: 0,
        ..SimulatorOptions::default()
    })
    .await
}

/// The bridge's upstream client for `sim`, with its all-powerful token and no rate budget.
pub fn bridge_client(sim: &Simulator) -> voucher_cdc::upstream::client::UpstreamClient {
    use voucher_cdc::upstream::client::{ClientOptions, SecretToken, UpstreamClient};
    UpstreamClient::new(
        ClientOptions {
            base_url: sim.base_url().parse().unwrap(),
            ..ClientOptions::default()
        },
        SecretToken::new(sim.token()),
        std::sync::Arc::new(voucher_cdc::upstream::ratelimit::RateBudget::new(0)),
    )
    .unwrap()
}

/// A reqwest client for the simulator that sends `Accept: application/json` and the bearer token.
pub fn simulator_client(token: &str) -> reqwest::Client {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(reqwest::header::ACCEPT, "application/json".parse().unwrap());
    headers.insert(
        reqwest::header::AUTHORIZATION,
        format!("Bearer {token}").parse().unwrap(),
    );
    reqwest::Client::builder()
        .default_headers(headers)
        .build()
        .unwrap()
}

/// A daemon started in-process by [`spawn_daemon`], with its files.
pub struct TestDaemon {
    /// The running daemon (None once stopped).
    pub handle: Option<voucher_cdc::daemon::DaemonHandle>,
    /// `http://127.0.0.1:PORT` of its admin API.
    pub admin_url: String,
    /// The JSON-lines file the file sink appends to.
    pub events_path: std::path::PathBuf,
    /// The config it runs with.
    pub config: voucher_cdc::config::Config,
}

impl TestDaemon {
    /// Stops the daemon (as SIGTERM would) and waits until it released the store.
    pub async fn stop(&mut self) {
        if let Some(handle) = self.handle.take() {
            handle.stop().await.expect("daemon stops cleanly");
        }
    }

    /// `GET /v1/status` of its admin API, parsed.
    pub async fn status(&self) -> serde_json::Value {
        let url = format!("{}/v1/status", self.admin_url);
        let response = reqwest::get(&url).await.expect("admin API answers");
        response.json().await.expect("status is JSON")
    }

    /// Every event written so far, parsed.
    pub fn events(&self) -> Vec<serde_json::Value> {
        read_events(&self.events_path)
    }
}

/// Starts a daemon in-process on `config` (admin port 0 is fine).
pub async fn spawn_daemon(config: &TestConfig) -> TestDaemon {
    spawn_daemon_with_sink(config, None).await
}

/// Like [`spawn_daemon`], publishing to `sink` instead of the configured one.
pub async fn spawn_daemon_with_sink(
    config: &TestConfig,
    sink: Option<std::sync::Arc<dyn voucher_cdc::sinks::Sink>>,
) -> TestDaemon {
    use voucher_cdc::daemon::Daemon;
    let events_path = config
        .events_path()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let config = config.config();
    // A store another handle of this test process just dropped may still be
    // locked for a moment while sled's background threads let go of it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let daemon = loop {
        let built = match &sink {
            Some(sink) => Daemon::build_with_sink(&config, sink.clone()).await,
            None => Daemon::build(&config).await,
        };
        match built {
            Err(voucher_cdc::daemon::DaemonError::State(
                voucher_cdc::state::StateError::Locked { .. },
            )) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            built => break built.expect("daemon starts"),
        }
    };
    let admin_url = daemon.admin_url();
    TestDaemon {
        handle: Some(daemon.spawn(std::future::pending::<()>())),
        admin_url,
        events_path,
        config,
    }
}

/// The raw bodies of every page of a fault-free listing of `path` (each
/// answered 200), following `next_cursor` to the end.
pub async fn raw_listing(
    client: &reqwest::Client,
    base: &str,
    path: &str,
    query: &str,
) -> Vec<String> {
    let mut bodies = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut url = format!("{base}{path}?{query}");
        if let Some(c) = &cursor {
            url.push_str(&format!("&cursor={c}"));
        }
        let response = client.get(&url).send().await.unwrap();
        assert_eq!(response.status(), 200, "{url}");
        let body = response.text().await.unwrap();
        let page: voucher_cdc::simulator::model::Collection<serde_json::Value> =
            serde_json::from_str(&body).unwrap();
        bodies.push(body);
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => return bodies,
        }
    }
}

/// Every record of a fault-free listing of `path`, in listing order (pages of at most 50).
pub async fn list_all(
    base: &str,
    client: &reqwest::Client,
    path: &str,
    query: &str,
) -> Vec<serde_json::Value> {
    let mut records = Vec::new();
    for body in raw_listing(client, base, path, query).await {
        let page: voucher_cdc::simulator::model::Collection<serde_json::Value> =
            serde_json::from_str(&body).unwrap();
        assert!(page.data.len() <= 50);
        records.extend(page.data);
    }
    records
}

/// A free loopback port: bound to port 0, then released (for a port that
/// must be written into a config or a command line before anything binds it).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The events of a JSON-lines file (none when it does not exist yet), each
/// checked against the published schemas (envelope and `data`) on the way:
/// every test that reads the file or stdout sink checks the contract too.
pub fn read_events(path: &std::path::Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    parse_events(&text)
}

/// The events of JSON-lines text (the file or stdout sink's output), each
/// checked against the published schemas. Only newline-terminated lines
/// count: a test polling the file while the sink appends can read the start
/// of a line still being written, which the next read sees whole (an event
/// that never gets its newline is missing, and fails the comparison with
/// upstream).
pub fn parse_events(text: &str) -> Vec<serde_json::Value> {
    let complete = text.rfind('\n').map_or("", |end| &text[..=end]);
    complete
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let event = serde_json::from_str(l).expect("every line is one JSON event");
            schema::assert_valid_event_json(&event);
            event
        })
        .collect()
}

/// Polls `check` every 50ms until it returns true; panics naming `what` after `timeout`.
pub async fn wait_until(what: &str, timeout: std::time::Duration, mut check: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + timeout;
    while !check() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting until {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// The built `voucher-cdc` binary.
pub fn cli() -> std::process::Command {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_voucher-cdc"));
    command
        .env_remove("RUST_LOG")
        .env_remove("VOUCHER_CDC_CONFIG");
    command
}

/// Runs the binary to completion (at most 60s); returns (exit code, stdout, stderr).
pub fn run_cli(args: &[&str]) -> (i32, String, String) {
    let mut child = spawn_cli(args);
    let code = child.wait_for(std::time::Duration::from_secs(60));
    (code, child.stdout(), child.stderr())
}

/// A running binary whose output goes to temp files (no pipe can fill up).
pub struct CliProcess {
    /// The process.
    pub child: std::process::Child,
    out: std::fs::File,
    err: std::fs::File,
}

impl CliProcess {
    /// Waits for the exit code; kills the process and panics after `timeout`.
    pub fn wait_for(&mut self, timeout: std::time::Duration) -> i32 {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code().unwrap_or(-1);
            }
            if std::time::Instant::now() > deadline {
                self.child.kill().unwrap();
                panic!(
                    "voucher-cdc did not exit within {timeout:?}; stderr:\n{}",
                    self.stderr()
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// Sends a signal by name (`TERM`, `INT`) with the `kill` command.
    pub fn signal(&self, name: &str) {
        let status = std::process::Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(status.success(), "kill -{name} failed");
    }

    /// Everything written to stdout so far.
    pub fn stdout(&self) -> String {
        read_all(&self.out)
    }

    /// Everything written to stderr so far.
    pub fn stderr(&self) -> String {
        read_all(&self.err)
    }
}

impl Drop for CliProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn read_all(file: &std::fs::File) -> String {
    use std::io::{Read, Seek};
    let mut file = file.try_clone().unwrap();
    file.seek(std::io::SeekFrom::Start(0)).unwrap();
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).unwrap();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Starts the binary with `args`, stdout and stderr going to temp files.
pub fn spawn_cli(args: &[&str]) -> CliProcess {
    let out = tempfile::tempfile().unwrap();
    let err = tempfile::tempfile().unwrap();
    let child = cli()
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(err.try_clone().unwrap())
        .spawn()
        .expect("binary starts");
    CliProcess { child, out, err }
}

/// A record as a consumer keys it: (tenant, resource, record id).
pub type RecordKey = (u64, String, i64);

/// What the simulator holds for `tenants`: every record's JSON, as the API returns it.
pub fn api_view(
    sim: &Simulator,
    tenants: &[u64],
) -> std::collections::BTreeMap<RecordKey, serde_json::Value> {
    use voucher_cdc::stream::Resource;
    let mut view = std::collections::BTreeMap::new();
    for &tenant in tenants {
        for resource in Resource::ALL {
            for id in sim.record_ids(tenant, resource) {
                let json = sim.record_json(tenant, resource, id, true).unwrap();
                view.insert(
                    (tenant, resource.as_str().to_string(), id),
                    serde_json::from_str(&json).unwrap(),
                );
            }
        }
    }
    view
}

/// What a consumer holds for `tenants` after applying `events` in order
/// (replay frames skipped, a delete removes the record).
pub fn consumer_view<'a>(
    events: impl IntoIterator<Item = &'a serde_json::Value>,
    tenants: &[u64],
) -> std::collections::BTreeMap<RecordKey, serde_json::Value> {
    let mut view = std::collections::BTreeMap::new();
    for e in events {
        let ty = e["type"].as_str().unwrap();
        if ty.starts_with("replay.") || ty.starts_with("stream.") {
            continue;
        }
        let tenant = e["tenant"].as_u64().unwrap();
        if !tenants.contains(&tenant) {
            continue;
        }
        let resource = e["source"].as_str().unwrap().rsplit('/').next().unwrap();
        let key = (
            tenant,
            resource.to_string(),
            e["subject"].as_str().unwrap().parse().unwrap(),
        );
        if e["op"] == "delete" {
            view.remove(&key);
        } else {
            view.insert(key, e["data"].clone());
        }
    }
    view
}
