//! The real `voucher-cdc` binary: example configs, exit codes, a clean stop
//! on SIGTERM, no secret in trace-level logs, and `status` / `replay` both
//! through a running daemon's admin API and directly on the store.

mod common;

use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use voucher_cdc::admin::StatusReport;
use voucher_cdc::state::{SledStore, StateStore};
use voucher_cdc::stream::{Resource, StreamKey};

use common::{
    free_port, read_events, run_cli, spawn_cli, spawn_daemon, spawn_small_simulator, wait_until,
    TestConfig,
};
use voucher_cdc::telemetry::LogFormat;

const WAIT: Duration = Duration::from_secs(30);

fn write_config(dir: &Path, toml: &str) -> String {
    let path = dir.join("voucher-cdc.toml");
    std::fs::write(&path, toml).unwrap();
    path.display().to_string()
}

/// A valid config of tenant 1 against an upstream nobody serves.
fn offline_config(dir: &Path) -> TestConfig {
    TestConfig::new("http://127.0.0.1:9/api/external/v1", "t", dir, &[1])
}

#[test]
fn every_example_config_passes_check_config_with_its_secrets_redacted() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path().display().to_string())
        .filter(|p| p.ends_with(".toml"))
        .collect();
    names.sort();
    let expected: Vec<String> = ["file", "kafka", "nats", "stdout"]
        .iter()
        .map(|n| dir.join(format!("{n}.toml")).display().to_string())
        .collect();
    assert_eq!(names, expected);
    for path in &names {
        let (code, stdout, stderr) = run_cli(&["check-config", "--config", path]);
        assert_eq!(code, 0, "{path}: {stderr}");
        assert!(
            stdout.contains("[upstream]") && stdout.contains("[sink]"),
            "{stdout}"
        );
        assert!(stdout.contains("token = \"<redacted>\""), "{stdout}");
        assert!(
            !stdout.contains("sim-token"),
            "{path} leaks its token: {stdout}"
        );
    }
}

#[test]
fn usage_and_config_errors_exit_2_with_one_line_naming_the_cause() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.toml").display().to_string();
    let (code, _, stderr) = run_cli(&["run", "--config", &missing]);
    assert_eq!(code, 2);
    assert_eq!(
        stderr.trim(),
        format!("error: config file {missing}: not found")
    );

    let broken = write_config(
        dir.path(),
        "[upstream]\nbase_url = \"ftp://x\"\n[poll]\ninterval = \"0s\"\n",
    );
    let (code, _, stderr) = run_cli(&["check-config", "--config", &broken]);
    assert_eq!(code, 2);
    let lines: Vec<&str> = stderr.lines().collect();
    assert!(lines.len() >= 3, "{stderr}");
    assert!(lines.iter().all(|l| l.starts_with("error: ")), "{stderr}");
    assert!(
        stderr.contains("upstream.base_url: scheme `ftp` not supported"),
        "{stderr}"
    );
    assert!(
        stderr.contains("poll.interval: must be greater than 0s"),
        "{stderr}"
    );
    assert!(
        stderr.contains("tenants: at least one [[tenants]] entry is required"),
        "{stderr}"
    );

    let (code, _, stderr) = run_cli(&["sweep-everything"]);
    assert_eq!(code, 2, "{stderr}");

    let good = write_config(dir.path(), &offline_config(dir.path()).toml());
    let (code, _, stderr) = run_cli(&["replay", "--tenant", "7", "--config", &good]);
    assert_eq!(code, 2);
    assert_eq!(
        stderr.trim(),
        "error: tenant `7` is not streamed by this daemon: configured tenants are 1"
    );
    let (code, _, stderr) = run_cli(&[
        "replay", "--tenant", "1", "--since", "soon", "--config", &good,
    ]);
    assert_eq!(code, 2);
    assert!(
        stderr.starts_with("error: --since: `soon` is not a time"),
        "{stderr}"
    );
    let (code, _, stderr) = run_cli(&[
        "replay",
        "--tenant",
        "1",
        "--resource",
        "products",
        "--config",
        &good,
    ]);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("valid options are vouchers, categories"),
        "{stderr}"
    );
}

#[test]
fn a_runtime_failure_exits_1_with_one_line_naming_the_cause() {
    let dir = tempfile::tempdir().unwrap();
    let blocker = dir.path().join("not-a-dir");
    std::fs::write(&blocker, "x").unwrap();
    let toml = offline_config(dir.path()).with_state_path(&blocker).toml();
    let config = write_config(dir.path(), &toml);
    let (code, _, stderr) = run_cli(&["run", "--config", &config]);
    assert_eq!(code, 1, "{stderr}");
    let last = stderr.lines().last().unwrap();
    assert!(
        last.starts_with("error: state store ") && last.contains("not-a-dir"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_stops_cleanly_with_exit_0_on_sigterm_and_no_secret_reaches_trace_logs() {
    let sim = spawn_small_simulator(2).await;
    let upstream_token = "upstream-secret-7f3a9c";
    let admin_token = "admin-secret-41bd2e";
    sim.add_token(
        upstream_token,
        None,
        &voucher_cdc::simulator::Permission::ALL,
    );
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let toml = TestConfig::new(&sim.base_url(), upstream_token, dir.path(), &[1, 2])
        .with_log(LogFormat::Json, "trace")
        .with_admin_port(port)
        .with_admin_token(admin_token)
        .toml();
    let config = write_config(dir.path(), &toml);
    let mut daemon = spawn_cli(&["run", "--config", &config]);
    let events = dir.path().join("events.jsonl");
    wait_until("the binary synced both tenants", WAIT, || {
        read_events(&events).len() == 2 * (20 + 5)
    })
    .await;

    // Use the admin API with its token (status and a replay), through the CLI.
    let (code, stdout, stderr) = run_cli(&["status", "--config", &config, "--json"]);
    assert_eq!(code, 0, "{stderr}");
    let status: StatusReport = serde_json::from_str(&stdout).unwrap();
    assert_eq!(status.streams.len(), 4);
    let (code, _, stderr) = run_cli(&["replay", "--tenant", "2", "--config", &config]);
    assert_eq!(code, 0, "{stderr}");
    wait_until("the replay completed", WAIT, || {
        read_events(&events)
            .iter()
            .filter(|e| e["type"] == "replay.completed")
            .count()
            == 2
    })
    .await;
    let unauthorized = reqwest::get(format!("http://127.0.0.1:{port}/v1/status"))
        .await
        .unwrap();
    assert_eq!(unauthorized.status().as_u16(), 401);

    let started = std::time::Instant::now();
    daemon.signal("TERM");
    let code = daemon.wait_for(Duration::from_secs(20));
    let stderr = daemon.stderr();
    assert_eq!(code, 0, "{}", tail(&stderr));
    assert!(started.elapsed() < Duration::from_secs(15));

    let output = format!("{}{stderr}", daemon.stdout());
    for secret in [upstream_token, admin_token] {
        assert!(!output.contains(secret), "a log line contains {secret}");
    }
    // JSON lines, and every line of a stream task carries its tenant and resource.
    let lines: Vec<Value> = stderr
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(lines.len() > 100, "trace level logs a lot: {}", lines.len());
    let finished: Vec<&Value> = lines
        .iter()
        .filter(|l| l["message"] == "sweep finished")
        .collect();
    assert!(!finished.is_empty());
    for line in &finished {
        assert!(line["span"]["tenant"].is_u64(), "{line}");
        assert!(line["span"]["resource"].is_string(), "{line}");
    }
    assert!(lines.iter().any(|l| l["message"] == "daemon stopped"));
}

/// Runs `replay --tenant 1 --resource vouchers` on `config`; returns the replay id and stdout.
fn replay_vouchers_of_tenant_1(config: &str) -> (String, String) {
    let (code, stdout, stderr) = run_cli(&[
        "replay",
        "--tenant",
        "1",
        "--resource",
        "vouchers",
        "--config",
        config,
    ]);
    assert_eq!(code, 0, "{stderr}");
    let replay_id = stdout
        .strip_prefix("replay ")
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap()
        .to_string();
    (replay_id, stdout)
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_replay_go_through_the_admin_api_while_a_daemon_runs_and_to_the_store_otherwise()
{
    let sim = spawn_small_simulator(2).await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let test_config = TestConfig::for_simulator(&sim, dir.path(), &[1, 2])
        .with_admin_port(port)
        .with_admin_token("cli-admin-token");
    let config = write_config(dir.path(), &test_config.toml());
    let mut daemon = spawn_daemon(&test_config).await;
    wait_until("both tenants synced", WAIT, || {
        daemon.events().len() == 2 * (20 + 5)
    })
    .await;

    // Through the admin API: only a running daemon knows its sink.
    let (code, stdout, stderr) = run_cli(&["status", "--config", &config, "--json"]);
    assert_eq!(code, 0, "{stderr}");
    let status: StatusReport = serde_json::from_str(&stdout).unwrap();
    let sink = status.sink.expect("the daemon reports its sink");
    assert!(sink.name == "file" && sink.healthy);
    assert_eq!(status.streams.len(), 4);
    assert!(status.streams.iter().all(|s| s.watermark.is_some()));
    let (code, table, stderr) = run_cli(&["status", "--config", &config]);
    assert_eq!(code, 0, "{stderr}");
    assert!(table.starts_with("STREAM"), "{table}");
    assert!(table.contains("sink file: healthy"), "{table}");
    assert!(
        table.trim_end().ends_with(&format!(
            "read from: daemon at http://127.0.0.1:{port} (it holds the state store {})",
            dir.path().join("state").display()
        )),
        "{table}"
    );
    for stream in ["1/vouchers", "1/categories", "2/vouchers", "2/categories"] {
        assert!(
            table
                .lines()
                .any(|l| l.starts_with(stream) && l.ends_with("ok")),
            "{table}"
        );
    }
    let (replay_id, stdout) = replay_vouchers_of_tenant_1(&config);
    assert!(
        stdout
            .trim_end()
            .ends_with("scheduled for tenant 1 vouchers: every record"),
        "{stdout}"
    );
    wait_until("the replay went through", WAIT, || {
        daemon
            .events()
            .iter()
            .any(|e| e["type"] == "replay.completed" && e["replayid"] == replay_id.as_str())
    })
    .await;

    // Steering goes through the daemon too.
    let through = format!(
        "written to: daemon at http://127.0.0.1:{port} (it holds the state store {})",
        dir.path().join("state").display()
    );
    let (code, stdout, stderr) = run_cli(&["pause", "--tenant", "2", "--config", &config]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(
        stdout.lines().collect::<Vec<_>>(),
        ["2/vouchers paused", "2/categories paused", through.as_str()]
    );
    let (code, _, stderr) = run_cli(&["sweep", "--tenant", "2", "--config", &config]);
    assert_eq!(code, 1);
    assert!(
        stderr.trim().ends_with(
            "answered 409 to POST /v1/tenants/2/sweep: stream 2/vouchers is paused: resume it first"
        ),
        "{stderr}"
    );
    let (code, _, stderr) = run_cli(&["resume", "--tenant", "2", "--config", &config]);
    assert_eq!(code, 0, "{stderr}");
    let (code, stdout, stderr) = run_cli(&[
        "sweep",
        "--tenant",
        "2",
        "--resource",
        "categories",
        "--full",
        "--config",
        &config,
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout.trim(), "2/categories: full sweep started");

    // A wrong admin token is refused with the admin API's own message.
    let wrong = write_config(
        dir.path(),
        &test_config.clone().with_admin_token("wrong").toml(),
    );
    let (code, _, stderr) = run_cli(&["status", "--config", &wrong]);
    assert_eq!(code, 1);
    assert!(
        stderr.contains("answered 401 to GET /v1/status: invalid bearer token"),
        "{stderr}"
    );
    let config = write_config(dir.path(), &test_config.toml());

    daemon.stop().await;

    // Directly on the store.
    let (code, stdout, stderr) = run_cli(&["status", "--config", &config, "--json"]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(
        stderr.trim(),
        format!(
            "read from: state store {} (no daemon holds it)",
            dir.path().join("state").display()
        )
    );
    let direct: StatusReport = serde_json::from_str(&stdout).unwrap();
    assert!(direct.sink.is_none());
    assert_eq!(direct.streams.len(), 4);
    let vouchers_1 = direct
        .streams
        .iter()
        .find(|s| s.tenant == 1 && s.resource == Resource::Vouchers)
        .unwrap();
    assert_eq!(
        vouchers_1.replay.as_ref().map(|r| r.id.as_str()),
        Some(replay_id.as_str())
    );
    assert_eq!(vouchers_1.records_known, 20);

    let (code, stdout, stderr) = run_cli(&[
        "replay", "--tenant", "2", "--since", "2h", "--config", &config,
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout.lines().count(), 2, "{stdout}");
    assert!(
        stdout.lines().all(|l| l.contains("records updated since")),
        "{stdout}"
    );
    {
        let store = SledStore::open(&dir.path().join("state")).unwrap();
        for resource in [Resource::Vouchers, Resource::Categories] {
            let state = store.load_stream(StreamKey::new(2, resource)).unwrap();
            let replay = state.replay.expect("replay scheduled");
            assert!(replay.pending);
            let since = replay.since.expect("since kept");
            let age = chrono::Utc::now() - since;
            assert!((age.num_minutes() - 120).abs() <= 1, "{age}");
        }
    }

    // The next daemon runs the replays scheduled while it was down.
    let mut daemon = spawn_daemon(&test_config).await;
    wait_until("the offline replays ran", WAIT, || {
        daemon
            .events()
            .iter()
            .filter(|e| e["type"] == "replay.completed" && e["tenant"] == 2)
            .count()
            == 2
    })
    .await;
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_once_sweeps_every_stream_once_and_exits_1_naming_each_failed_stream() {
    let sim = spawn_small_simulator(3).await;
    sim.add_token(
        "not-tenant-3",
        Some(vec![1, 2]),
        &voucher_cdc::simulator::Permission::ALL,
    );
    let dir = tempfile::tempdir().unwrap();
    let toml = TestConfig::new(&sim.base_url(), "not-tenant-3", dir.path(), &[1, 2, 3]).toml();
    let config = write_config(dir.path(), &toml);
    let events = dir.path().join("events.jsonl");

    let (code, _, stderr) = run_cli(&["run", "--once", "--config", &config]);
    assert_eq!(code, 1, "{stderr}");
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("error: "))
        .collect();
    assert_eq!(errors.len(), 2, "{stderr}");
    assert!(
        errors[0].starts_with("error: stream 3/vouchers parked: upstream returned 40")
            && errors[0].contains("run --once does not recheck it"),
        "{stderr}"
    );
    assert!(
        errors[1].starts_with("error: stream 3/categories parked: upstream returned 40"),
        "{stderr}"
    );
    assert_eq!(read_events(&events).len(), 2 * (20 + 5));
    // Without a TTY: plain progress lines, and one result line per stream.
    assert!(
        stderr
            .lines()
            .any(|l| l == "1/vouchers: done: full sweep, 1 page, 20 records, 20 events"),
        "{stderr}"
    );

    let two_tenants = TestConfig::new(&sim.base_url(), "not-tenant-3", dir.path(), &[1, 2])
        .with_full_resync_interval(Duration::from_secs(3600));
    let config = write_config(dir.path(), &two_tenants.toml());
    let changed = sim.record_ids(2, Resource::Categories)[2];
    sim.update(2, Resource::Categories, changed);
    let (code, _, stderr) = run_cli(&["run", "--once", "--config", &config]);
    assert_eq!(code, 0, "{stderr}");
    let all = read_events(&events);
    assert_eq!(
        all.len(),
        2 * (20 + 5) + 1,
        "exactly the one change: {:?}",
        &all[50..]
    );
    assert_eq!(all[50]["op"], "update");
    assert_eq!(all[50]["subject"], changed.to_string());
    assert!(
        stderr
            .lines()
            .any(|l| l.starts_with("2/categories: done: incremental sweep")),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_shows_events_on_stdout_within_seconds_and_stops_with_exit_0_on_ctrl_c() {
    let mut demo = spawn_cli(&[
        "demo",
        "--tenants",
        "2",
        "--vouchers",
        "10",
        "--categories",
        "3",
    ]);
    wait_until(
        "the demo printed the snapshot of both tenants",
        WAIT,
        || demo.stdout().lines().count() >= 2 * (10 + 3),
    )
    .await;
    let banner = demo.stderr();
    assert!(banner.starts_with("voucher-cdc demo\n"), "{banner}");
    assert!(banner.contains("simulator  http://127.0.0.1:"), "{banner}");
    assert!(banner.contains("Ctrl-C stops."), "{banner}");
    let stdout = demo.stdout();
    // Only complete lines: the demo may be writing the next one right now.
    for line in stdout.split_inclusive('\n').filter(|l| l.ends_with('\n')) {
        let event: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        common::schema::assert_valid_event_json(&event);
    }
    demo.signal("INT");
    assert_eq!(
        demo.wait_for(Duration::from_secs(20)),
        0,
        "{}",
        demo.stderr()
    );
    assert!(demo.stderr().ends_with("voucher-cdc demo stopped\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_exits_3_for_a_parked_stream_and_reaches_a_daemon_by_admin_url_alone() {
    let sim = spawn_small_simulator(2).await;
    sim.add_token(
        "not-tenant-2",
        Some(vec![1]),
        &voucher_cdc::simulator::Permission::ALL,
    );
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = TestConfig::new(&sim.base_url(), "not-tenant-2", dir.path(), &[1, 2])
        .with_admin_port(port)
        .with_admin_token("cli-admin-token");
    let mut daemon = spawn_daemon(&config).await;
    wait_until("tenant 1 synced and tenant 2 parked", WAIT, || {
        daemon.events().len() == 20 + 5
            && run_cli(&[
                "status",
                "--admin-url",
                &format!("http://127.0.0.1:{port}"),
                "--admin-token",
                "cli-admin-token",
            ])
            .1
            .matches("parked")
            .count()
                >= 4
    })
    .await;

    // No --config: the admin API alone answers, through a port-forward say.
    let (code, table, stderr) = run_cli(&[
        "status",
        "--admin-url",
        &format!("http://127.0.0.1:{port}/"),
        "--admin-token",
        "cli-admin-token",
    ]);
    assert_eq!(code, 3, "{table}\n{stderr}");
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("2/vouchers") && l.ends_with("parked")),
        "{table}"
    );
    assert!(
        table
            .trim_end()
            .ends_with(&format!("read from: daemon at http://127.0.0.1:{port}")),
        "{table}"
    );
    assert_eq!(
        stderr.trim(),
        "error: 2 streams need attention (parked or last sweep failed): 2/vouchers, 2/categories"
    );
    let (code, stdout, _) = run_cli(&[
        "replay",
        "--tenant",
        "1",
        "--admin-url",
        &format!("http://127.0.0.1:{port}"),
        "--admin-token",
        "cli-admin-token",
    ]);
    assert_eq!(code, 0);
    assert_eq!(stdout.lines().count(), 2, "{stdout}");
    daemon.stop().await;
}

#[test]
fn status_and_replay_without_a_store_or_a_daemon_say_so_instead_of_showing_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let toml = offline_config(dir.path())
        .with_admin_port(free_port())
        .toml();
    let config = write_config(dir.path(), &toml);
    let state = dir.path().join("state");
    for args in [
        vec!["status", "--config", &config],
        vec!["replay", "--tenant", "1", "--config", &config],
    ] {
        let (code, stdout, stderr) = run_cli(&args);
        assert_eq!(code, 1, "{args:?}: {stdout}{stderr}");
        assert_eq!(stdout, "", "{args:?}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(
            stderr.starts_with(&format!(
                "error: no state store at {} and no daemon answered at http://127.0.0.1:",
                state.display()
            )),
            "{stderr}"
        );
        assert!(!state.exists(), "{args:?} created the store");
    }

    // Without --config: one line saying how to name it.
    let (code, _, stderr) = run_cli(&["status"]);
    assert_eq!(code, 2);
    assert_eq!(
        stderr.trim(),
        "error: no config file given: pass --config FILE or set VOUCHER_CDC_CONFIG=FILE (or --admin-url URL to ask a running daemon)"
    );
}

#[test]
fn demo_piped_into_head_exits_once_head_has_its_lines() {
    let mut shell = std::process::Command::new("bash")
        .args([
            "-c",
            &format!(
                "set -o pipefail; '{}' demo --vouchers 20 | head -n 3; echo \"demo exit ${{PIPESTATUS[0]}}\" >&2",
                env!("CARGO_BIN_EXE_voucher-cdc")
            ),
        ])
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while shell.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = shell.kill();
            panic!("`voucher-cdc demo | head -n 3` did not exit within 30s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = shell.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stdout.lines().count(), 3, "{stdout}");
    assert!(stderr.contains("demo exit 0"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_export_import_and_reset_move_a_tenant_between_stores_and_refuse_a_store_a_daemon_holds(
) {
    let sim = spawn_small_simulator(2).await;
    let dir = tempfile::tempdir().unwrap();
    let (old_dir, new_dir) = (dir.path().join("old"), dir.path().join("new"));
    std::fs::create_dir_all(&old_dir).unwrap();
    std::fs::create_dir_all(&new_dir).unwrap();
    let old_test_config = TestConfig::for_simulator(&sim, &old_dir, &[1, 2]);
    let old = write_config(&old_dir, &old_test_config.toml());
    let new_test_config = TestConfig::for_simulator(&sim, &new_dir, &[1]);
    let new = write_config(&new_dir, &new_test_config.toml());
    let (code, _, stderr) = run_cli(&["run", "--once", "--config", &old]);
    assert_eq!(code, 0, "{stderr}");

    let mut daemon = spawn_daemon(&old_test_config).await;
    let (code, stdout, stderr) = run_cli(&["state", "export", "--config", &old]);
    assert_eq!(code, 1, "{stderr}");
    assert_eq!(stdout, "");
    assert_eq!(
        stderr.trim(),
        format!(
            "error: state store {} is held by a running daemon: stop it first (state export, \
             import and reset need the store to themselves)",
            old_dir.join("state").display()
        )
    );
    daemon.stop().await;

    let (code, dump, stderr) = run_cli(&["state", "export", "--tenant", "1", "--config", &old]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(
        stderr.lines().collect::<Vec<_>>(),
        [
            "exported 1/vouchers: 20 records, 0 tombstones, 0 pending intents",
            "exported 1/categories: 5 records, 0 tombstones, 0 pending intents"
        ]
    );
    let header: Value = serde_json::from_str(dump.lines().next().unwrap()).unwrap();
    assert_eq!(header["format"], "voucher-cdc-state");
    assert_eq!(header["version"], 2);
    assert_eq!(dump.lines().count(), 1 + 2 + 25);
    let file = dir.path().join("tenant-1.jsonl");
    std::fs::write(&file, &dump).unwrap();
    let file = file.display().to_string();

    let (code, stdout, stderr) = run_cli(&["state", "import", &file, "--config", &new]);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.contains("imported 1/vouchers: 20 records, 0 tombstones, 0 pending intents"),
        "{stdout}"
    );
    let (code, _, stderr) = run_cli(&["state", "import", &file, "--config", &new]);
    assert_eq!(code, 1);
    assert_eq!(
        stderr.trim(),
        format!(
            "error: state store {} already holds 1/vouchers, 1/categories: nothing imported (pass \
             --replace to overwrite them)",
            new_dir.join("state").display()
        )
    );
    let (code, _, stderr) = run_cli(&["state", "import", &file, "--replace", "--config", &new]);
    assert_eq!(code, 0, "{stderr}");

    // The new owner goes on from the imported watermarks: nothing to emit.
    let (code, _, stderr) = run_cli(&["run", "--once", "--config", &new]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(
        read_events(&new_dir.join("events.jsonl")),
        Vec::<Value>::new()
    );

    // A pause written to the store directly: `run --once` does not sweep it.
    let (code, stdout, stderr) = run_cli(&["pause", "--tenant", "1", "--config", &new]);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.starts_with("1/vouchers paused\n1/categories paused\n"),
        "{stdout}"
    );
    let changed = sim.record_ids(1, Resource::Vouchers)[0];
    sim.update(1, Resource::Vouchers, changed);
    let (code, _, stderr) = run_cli(&["run", "--once", "--config", &new]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(read_events(&new_dir.join("events.jsonl")).len(), 0);
    let (code, table, _) = run_cli(&["status", "--config", &new]);
    assert_eq!(code, 0);
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("1/vouchers") && l.ends_with("paused")),
        "{table}"
    );
    assert!(table.contains("1/vouchers paused since"), "{table}");
    let (code, _, stderr) = run_cli(&["resume", "--tenant", "1", "--config", &new]);
    assert_eq!(code, 0, "{stderr}");
    let (code, _, stderr) = run_cli(&["run", "--once", "--config", &new]);
    assert_eq!(code, 0, "{stderr}");
    let events = read_events(&new_dir.join("events.jsonl"));
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["op"], "update");

    // A replay scheduled and cancelled on the store: the watermark comes back.
    let watermark = |path: &str| {
        let (_, json, _) = run_cli(&["status", "--json", "--config", path]);
        let report: StatusReport = serde_json::from_str(&json).unwrap();
        report
            .streams
            .iter()
            .find(|s| s.key() == StreamKey::new(1, Resource::Vouchers))
            .unwrap()
            .watermark
    };
    let before = watermark(&new);
    assert!(before.is_some());
    let (replay_id, _) = replay_vouchers_of_tenant_1(&new);
    assert_eq!(watermark(&new), None, "a replay without --since clears it");
    let (code, table, stderr) = run_cli(&["replays", "--config", &new]);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        table
            .lines()
            .any(|l| l.starts_with(&replay_id) && l.contains("scheduled") && l.contains(" cli ")),
        "{table}"
    );
    let (code, _, stderr) = run_cli(&["cancel-replay", &replay_id, "--config", &new]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(watermark(&new), before);
    let (code, _, stderr) = run_cli(&["cancel-replay", &replay_id, "--config", &new]);
    assert_eq!(code, 1);
    assert!(stderr.contains("is cancelled already"), "{stderr}");

    let (code, stdout, stderr) = run_cli(&["state", "reset", "--tenant", "1", "--config", &new]);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.contains("forgot 1/vouchers (20 records): its next sweep is a first sync"),
        "{stdout}"
    );
    let (code, _, stderr) = run_cli(&["state", "reset", "--tenant", "1", "--config", &new]);
    assert_eq!(code, 1);
    assert!(
        stderr.contains("holds no stream of tenant 1: it holds nothing"),
        "{stderr}"
    );
}
