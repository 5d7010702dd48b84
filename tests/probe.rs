//! `check-config --probe` through the real binary: one request per tenant
//! against the simulator, the sink reached (a nats-server the test starts,
//! or the file), one line per result and exit code 1 when any fails.

mod common;

#[path = "common/brokers.rs"]
#[allow(dead_code)]
mod brokers;

use std::path::Path;

use voucher_cdc::sinks::nats::NatsSinkConfig;

use brokers::spawn_nats;
use common::{run_cli, spawn_small_simulator, TestConfig};

/// Runs `check-config --probe` on `toml` off the async runtime (the
/// simulator serves on it): (exit code, stdout, stderr).
async fn probe(dir: &Path, toml: String) -> (i32, String, String) {
    let path = dir.join("probe.toml");
    std::fs::write(&path, toml).unwrap();
    tokio::task::spawn_blocking(move || {
        run_cli(&[
            "check-config",
            "--probe",
            "--config",
            path.to_str().unwrap(),
        ])
    })
    .await
    .unwrap()
}

/// The probe lines of a `check-config --probe` output.
fn probe_lines(stdout: &str) -> Vec<&str> {
    stdout
        .lines()
        .filter(|l| l.starts_with("# probe "))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_working_config_probes_every_tenant_once_and_the_nats_stream() {
    let Some(nats) = spawn_nats() else { return };
    let sim = spawn_small_simulator(2).await;
    let dir = tempfile::tempdir().unwrap();
    let config =
        TestConfig::for_simulator(&sim, dir.path(), &[1, 2]).with_nats_sink(NatsSinkConfig {
            url: nats.url(),
            ..NatsSinkConfig::default()
        });
    sim.clear_request_log();
    let (code, stdout, stderr) = probe(dir.path(), config.toml()).await;
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    let lines = probe_lines(&stdout);
    assert_eq!(lines.len(), 3, "{stdout}");
    assert!(
        lines[0].starts_with("# probe ok    upstream tenant 1: token "),
        "{stdout}"
    );
    assert!(
        lines[1].starts_with("# probe ok    upstream tenant 2: token "),
        "{stdout}"
    );
    assert!(
        lines[2].starts_with("# probe ok    sink nats: connected to 127.0.0.1:"),
        "{stdout}"
    );
    assert!(
        lines[2].contains("stream `VOUCHER_CDC` does not exist yet"),
        "{stdout}"
    );
    let requests = sim.request_log();
    assert_eq!(requests.len(), 2, "one request per tenant: {requests:?}");
    assert!(requests.iter().all(|r| r.method == "GET"), "{requests:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_and_an_unreachable_sink_each_fail_on_their_own_line() {
    let sim = spawn_small_simulator(2).await;
    let dir = tempfile::tempdir().unwrap();
    let closed_port = common::free_port();
    let config =
        TestConfig::for_simulator(&sim, dir.path(), &[1, 2]).with_nats_sink(NatsSinkConfig {
            url: format!("nats://127.0.0.1:{closed_port}"),
            ..NatsSinkConfig::default()
        });
    // Tenant 2 gets a token of its own that the simulator does not know.
    let mut doc: toml::Table = config.toml().parse().unwrap();
    let tenants = doc["tenants"].as_array_mut().unwrap();
    tenants[1]
        .as_table_mut()
        .unwrap()
        .insert("token".into(), "not-a-valid-token".into());
    let (code, stdout, stderr) = probe(dir.path(), toml::to_string(&doc).unwrap()).await;
    assert_eq!(code, 1, "{stdout}\n{stderr}");
    let lines = probe_lines(&stdout);
    assert_eq!(lines.len(), 3, "{stdout}");
    assert!(
        lines[0].starts_with("# probe ok    upstream tenant 1: "),
        "{stdout}"
    );
    assert!(
        lines[1].starts_with("# probe FAIL  upstream tenant 2: upstream returned 401"),
        "{stdout}"
    );
    assert!(
        lines[2].starts_with(&format!(
            "# probe FAIL  sink nats: nats: cannot connect to nats://127.0.0.1:{closed_port}"
        )),
        "{stdout}"
    );
    assert!(!stdout.contains("not-a-valid-token"), "{stdout}");
    assert!(stderr.contains("probe: 2 of 3 failed"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_file_sink_probe_leaves_no_file_behind_and_fails_on_an_unwritable_path() {
    let sim = spawn_small_simulator(1).await;
    let dir = tempfile::tempdir().unwrap();
    let config = TestConfig::for_simulator(&sim, dir.path(), &[1]);
    let events = config.events_path().unwrap().to_path_buf();
    let (code, stdout, stderr) = probe(dir.path(), config.toml()).await;
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(stdout.contains("# probe ok    sink file: "), "{stdout}");
    assert!(!events.exists(), "the probe created {}", events.display());

    let blocker = dir.path().join("not-a-dir");
    std::fs::write(&blocker, "").unwrap();
    let mut doc: toml::Table = config.toml().parse().unwrap();
    doc["sink"]["file"].as_table_mut().unwrap().insert(
        "path".into(),
        blocker.join("events.jsonl").display().to_string().into(),
    );
    let (code, stdout, _) = probe(dir.path(), toml::to_string(&doc).unwrap()).await;
    assert_eq!(code, 1, "{stdout}");
    assert!(stdout.contains("# probe FAIL  sink file: "), "{stdout}");
}
