//! The upstream API over HTTPS with a private CA: the simulator serves TLS
//! with a certificate the test's own CA signed, and the bridge trusts it only
//! through `upstream.ca_file`. A certificate from another CA, or an expired
//! one, is one line naming the upstream and the cause; the client does not
//! retry it and the stream parks instead of hammering the upstream.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use voucher_cdc::simulator::{Simulator, SimulatorOptions, TlsIdentity};
use voucher_cdc::stream::Resource;
use voucher_cdc::upstream::client::{ClientOptions, SecretToken, UpstreamClient};
use voucher_cdc::upstream::error::UpstreamError;
use voucher_cdc::upstream::page::ListQuery;
use voucher_cdc::upstream::ratelimit::RateBudget;
use voucher_cdc::upstream::tls::TrustRoots;

use common::pki::{expired_pki, pki, TestPki};
use common::{run_cli, spawn_daemon, spawn_simulator_with, wait_until, TestConfig};

const WAIT: Duration = Duration::from_secs(30);

/// A simulator of 2 tenants (20 vouchers, 5 categories) serving HTTPS with `server`'s certificate.
async fn tls_simulator(server: &TestPki) -> Simulator {
    spawn_simulator_with(SimulatorOptions {
        tenants: 2,
        vouchers: 20,
        categories: 5,
        rate_limit: 0,
        tls: Some(TlsIdentity::from_files(&server.cert, &server.key).unwrap()),
        ..SimulatorOptions::default()
    })
    .await
}

/// A client of `sim` trusting `ca`, with retries that would take seconds.
fn client_trusting(sim: &Simulator, ca: &Path) -> UpstreamClient {
    UpstreamClient::new(
        ClientOptions {
            base_url: sim.base_url().parse().unwrap(),
            max_attempts: 6,
            backoff_initial: Duration::from_secs(2),
            ca: Some(TrustRoots::from_pem_file(ca).unwrap()),
            ..ClientOptions::default()
        },
        SecretToken::new(sim.token()),
        Arc::new(RateBudget::new(0)),
    )
    .unwrap()
}

/// Lists tenant 1's vouchers expecting the certificate to be refused: the
/// error and how long it took.
async fn refused(client: &UpstreamClient) -> (UpstreamError, Duration) {
    let started = Instant::now();
    let result = client
        .list_page(1, Resource::Vouchers, &ListQuery::default())
        .await;
    match result {
        Ok(_) => panic!("the client must refuse the server certificate"),
        Err(e) => (e, started.elapsed()),
    }
}

/// Asserts `error` is a refused certificate: one line, the upstream named, not retried, parking.
fn assert_refused(error: &UpstreamError, took: Duration, sim: &Simulator, cause: &str) {
    let text = error.to_string();
    assert!(matches!(error, UpstreamError::Tls { .. }), "{error:?}");
    assert!(
        text.starts_with(&format!("upstream https://{}: tls: ", sim.addr())),
        "{text}"
    );
    assert!(text.contains(cause), "{text}");
    assert!(!text.contains('\n'), "{text}");
    assert!(!error.is_retriable() && error.is_parking(), "{error:?}");
    // The first backoff is 2s: a retried error would take at least that.
    assert!(
        took < Duration::from_secs(2),
        "retried for {took:?}: {text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_streams_an_https_upstream_whose_private_ca_is_in_ca_file() {
    let dir = tempfile::tempdir().unwrap();
    let server = pki(dir.path(), "upstream");
    let sim = tls_simulator(&server).await;
    assert!(sim.base_url().starts_with("https://"), "{}", sim.base_url());
    let config = TestConfig::for_simulator(&sim, dir.path(), &[1]).with_ca_file(&server.ca);
    let mut daemon = spawn_daemon(&config).await;
    wait_until("every record of tenant 1 published", WAIT, || {
        daemon.events().len() == 20 + 5
    })
    .await;
    let status = daemon.status().await;
    let streams = status["streams"].as_array().unwrap();
    assert!(streams.iter().all(|s| s["parked"].is_null()), "{status:#}");
    daemon.stop().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_from_another_ca_is_one_line_at_once_and_parks_every_stream() {
    let dir = tempfile::tempdir().unwrap();
    let server = pki(dir.path(), "upstream");
    let other = pki(dir.path(), "other");
    let sim = tls_simulator(&server).await;

    let (error, took) = refused(&client_trusting(&sim, &other.ca)).await;
    assert_refused(
        &error,
        took,
        &sim,
        "tls: invalid peer certificate: UnknownIssuer for /tenants/1/catalog/vouchers",
    );
    assert!(
        error.to_string().contains(&format!(
            "not signed by a CA in upstream.ca_file {}",
            other.ca.display()
        )),
        "{error}"
    );
    // The handshake fails before any request reaches the API.
    assert!(sim.request_log().is_empty());

    let config = TestConfig::for_simulator(&sim, dir.path(), &[1]).with_ca_file(&other.ca);
    let mut daemon = spawn_daemon(&config).await;
    let mut parked = Vec::new();
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline && parked.len() < 2 {
        let status = daemon.status().await;
        parked = status["streams"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|s| s["parked"].as_str().map(str::to_owned))
            .collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(parked.len(), 2, "both streams park: {parked:?}");
    assert!(
        parked
            .iter()
            .all(|why| why.contains("tls: invalid peer certificate: UnknownIssuer")),
        "{parked:?}"
    );
    assert!(daemon.events().is_empty());
    daemon.stop().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_server_certificate_is_one_line_and_run_once_exits_1_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let server = expired_pki(dir.path(), "expired");
    let sim = tls_simulator(&server).await;

    let (error, took) = refused(&client_trusting(&sim, &server.ca)).await;
    assert_refused(
        &error,
        took,
        &sim,
        "tls: invalid peer certificate: certificate expired",
    );
    assert!(
        error.to_string().contains("has expired: renew it"),
        "{error}"
    );

    let config = TestConfig::for_simulator(&sim, dir.path(), &[1])
        .with_ca_file(&server.ca)
        .write(&dir.path().join("config.toml"));
    let config = config.display().to_string();
    let (code, _, stderr) =
        tokio::task::spawn_blocking(move || run_cli(&["run", "--once", "--config", &config]))
            .await
            .unwrap();
    assert_eq!(code, 1, "{stderr}");
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("error: "))
        .collect();
    assert!(!errors.is_empty(), "{stderr}");
    assert!(
        errors.iter().all(|l| l.contains(&format!(
            "parked: upstream https://{}: tls: invalid peer certificate: certificate expired",
            sim.addr()
        ))),
        "{stderr}"
    );
    sim.shutdown().await;
}

/// `check-config` on a config whose `upstream.ca_file` is `ca_file`: (exit code, stderr).
fn check_config_with_ca_file(dir: &Path, ca_file: &Path) -> (i32, String) {
    let config = TestConfig::new("https://127.0.0.1:8443/api/external/v1", "token", dir, &[1])
        .with_ca_file(ca_file)
        .write(&dir.join("config.toml"));
    let (code, _, stderr) = run_cli(&["check-config", "--config", &config.display().to_string()]);
    (code, stderr)
}

#[test]
fn check_config_refuses_a_missing_or_non_pem_ca_file_with_one_line_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.pem");
    let (code, stderr) = check_config_with_ca_file(dir.path(), &missing);
    assert_eq!(code, 2, "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains(&format!(
            "upstream.ca_file: cannot read {}: no such file",
            missing.display()
        )),
        "{stderr}"
    );

    let not_pem = dir.path().join("ca.pem");
    std::fs::write(&not_pem, "this is not a certificate\n").unwrap();
    let (code, stderr) = check_config_with_ca_file(dir.path(), &not_pem);
    assert_eq!(code, 2, "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains(&format!(
            "upstream.ca_file: {} holds no PEM certificate",
            not_pem.display()
        )),
        "{stderr}"
    );

    let server = pki(dir.path(), "good");
    let (code, stderr) = check_config_with_ca_file(dir.path(), &server.ca);
    assert_eq!(code, 0, "{stderr}");
}

/// `check-config --probe` of `config` off the async runtime: (exit code, the upstream probe line).
async fn probe_upstream(dir: &Path, config: TestConfig) -> (i32, String) {
    let path = config.write(&dir.join("probe.toml")).display().to_string();
    let (code, stdout, stderr) = tokio::task::spawn_blocking(move || {
        run_cli(&["check-config", "--config", &path, "--probe"])
    })
    .await
    .unwrap();
    let line = stdout
        .lines()
        .find(|l| l.starts_with("# probe ") && l.contains("upstream tenant 1"))
        .unwrap_or_else(|| panic!("no upstream probe line:\n{stdout}\n{stderr}"))
        .to_string();
    (code, line)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_config_probe_trusts_ca_file_and_names_a_refused_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let server = pki(dir.path(), "upstream");
    let other = pki(dir.path(), "other");
    let sim = tls_simulator(&server).await;

    let trusting = TestConfig::for_simulator(&sim, dir.path(), &[1]).with_ca_file(&server.ca);
    let (code, line) = probe_upstream(dir.path(), trusting).await;
    assert_eq!(code, 0, "{line}");
    assert!(
        line.starts_with("# probe ok    upstream tenant 1: "),
        "{line}"
    );

    let wrong = TestConfig::for_simulator(&sim, dir.path(), &[1]).with_ca_file(&other.ca);
    let (code, line) = probe_upstream(dir.path(), wrong).await;
    assert_ne!(code, 0, "{line}");
    assert!(
        line.starts_with(&format!(
            "# probe FAIL  upstream tenant 1: upstream https://{}: tls: invalid peer certificate: UnknownIssuer",
            sim.addr()
        )),
        "{line}"
    );
    sim.shutdown().await;
}
