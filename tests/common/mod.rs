//! Shared test helpers: each `spawn_*` starts a real dependency for a test.
#![allow(dead_code)]

use voucher_cdc::simulator::{Simulator, SimulatorOptions};

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

    /// Every event written so far, parsed.
    pub fn events(&self) -> Vec<serde_json::Value> {
        read_events(&self.events_path)
    }
}

/// The `[poll]` body of test daemons: sweeps every 200ms, a full sweep every 2s.
pub const FAST_POLL: &str = r#"interval = "200ms"
full_resync_interval = "2s"
lookback = "1s"
park_recheck_interval = "1s"
shutdown_timeout = "10s"
"#;

/// The TOML of a test daemon: file sink and state in `dir`, admin on
/// `admin_listen`, `poll` as the `[poll]` table's body (e.g. [`FAST_POLL`]);
/// `extra` is appended (more tables such as `[log]` or `[[tenants]]`).
pub fn daemon_toml(
    base_url: &str,
    token: &str,
    dir: &std::path::Path,
    tenants: &[u64],
    admin_listen: &str,
    poll: &str,
    extra: &str,
) -> String {
    let mut toml = format!(
        r#"
[upstream]
base_url = "{base_url}"
token = "{token}"
requests_per_minute = 60000
max_attempts = 2

[poll]
{poll}
[state]
path = "{state}"

[sink]
kind = "file"

[sink.file]
path = "{events}"

[admin]
listen = "{admin_listen}"
"#,
        state = dir.join("state").display(),
        events = dir.join("events.jsonl").display(),
    );
    for t in tenants {
        toml.push_str(&format!("\n[[tenants]]\nid = {t}\n"));
    }
    toml.push_str(extra);
    toml
}

/// Starts a daemon in-process on `toml` (admin port 0 is fine) and waits until its admin API answers.
pub async fn spawn_daemon(toml: &str) -> TestDaemon {
    let config = voucher_cdc::config::from_toml_str(toml).expect("test config is valid");
    let events_path = config
        .sink
        .file
        .as_ref()
        .map(|f| f.path.clone())
        .unwrap_or_default();
    let handle = voucher_cdc::daemon::Daemon::start(config.clone(), std::future::pending::<()>())
        .await
        .expect("daemon starts");
    let admin_url = handle.admin_url();
    TestDaemon {
        handle: Some(handle),
        admin_url,
        events_path,
        config,
    }
}

/// The events of a JSON-lines file (none when it does not exist yet).
pub fn read_events(path: &std::path::Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("every line is one JSON event"))
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

/// A free loopback port (bound and released; fine for tests that must write it into a config).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
