//! The NATS sink against a nats-server that demands TLS or credentials:
//! TLS with a private CA the test generates, user/password, token and nkey,
//! each given the way platforms deliver secrets (files). A wrong CA or
//! password fails start-up at once with one line naming the sink and the
//! cause, instead of retrying for `connect_timeout`.

mod common;

#[path = "common/brokers.rs"]
#[allow(dead_code)]
mod brokers;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use voucher_cdc::event::Op;
use voucher_cdc::sinks::nats::{NatsSinkConfig, NatsTlsConfig};
use voucher_cdc::sinks::Sink;
use voucher_cdc::stream::{Resource, StreamKey};

use brokers::{sample_events, spawn_nats_with_config, NatsServer};
use common::pki::pki;

fn secret_file(dir: &Path, name: &str, content: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, format!("{content}\n")).unwrap();
    path
}

fn config(server: &NatsServer) -> NatsSinkConfig {
    NatsSinkConfig {
        url: server.url(),
        connect_timeout: Duration::from_secs(20),
        ..NatsSinkConfig::default()
    }
}

/// Builds the sink and publishes one event through it.
async fn publishes(config: &NatsSinkConfig) {
    let sink = config
        .build()
        .await
        .unwrap_or_else(|e| panic!("the sink connects: {e}"));
    let events = sample_events(
        StreamKey::new(1, Resource::Vouchers),
        1,
        1,
        Op::Snapshot,
        64,
    );
    let acks = sink.publish(&events).await;
    assert!(acks.iter().all(Result::is_ok), "{acks:?}");
}

/// Builds the sink expecting a failure: its one line, and how long it took.
async fn refused(config: &NatsSinkConfig) -> (String, Duration) {
    let started = Instant::now();
    let error = match config.build().await {
        Ok(_) => panic!("the server must refuse this client"),
        Err(e) => e.to_string(),
    };
    (error, started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_private_ca_connects_and_a_wrong_ca_is_one_line_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let server_pki = pki(dir.path(), "server");
    let other = pki(dir.path(), "other");
    let Some(server) = spawn_nats_with_config(&format!(
        "tls {{\n  cert_file: {:?}\n  key_file: {:?}\n}}\n",
        server_pki.cert.display().to_string(),
        server_pki.key.display().to_string()
    )) else {
        return;
    };
    let good = NatsSinkConfig {
        tls: NatsTlsConfig {
            ca_file: Some(server_pki.ca.clone()),
            required: true,
            ..NatsTlsConfig::default()
        },
        ..config(&server)
    };
    publishes(&good).await;

    let wrong_ca = NatsSinkConfig {
        tls: NatsTlsConfig {
            ca_file: Some(other.ca.clone()),
            required: true,
            ..NatsTlsConfig::default()
        },
        ..config(&server)
    };
    let (error, took) = refused(&wrong_ca).await;
    assert!(error.starts_with("nats: cannot connect to "), "{error}");
    assert!(error.to_lowercase().contains("certificate"), "{error}");
    assert!(!error.contains('\n'), "{error}");
    assert!(
        took < Duration::from_secs(10),
        "retried for {took:?}: {error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_and_password_from_a_file_connects_and_a_wrong_password_is_one_line_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let Some(server) =
        spawn_nats_with_config("authorization {\n  user: bridge\n  password: \"pa55-w0rd\"\n}\n")
    else {
        return;
    };
    let good = NatsSinkConfig {
        user: Some("bridge".into()),
        password_file: Some(secret_file(dir.path(), "password", "pa55-w0rd")),
        ..config(&server)
    };
    publishes(&good).await;

    let wrong = NatsSinkConfig {
        password_file: Some(secret_file(dir.path(), "wrong", "not-it")),
        ..good
    };
    let (error, took) = refused(&wrong).await;
    assert!(error.starts_with("nats: cannot connect to "), "{error}");
    assert!(error.to_lowercase().contains("authorization"), "{error}");
    assert!(!error.contains("not-it"), "{error}");
    assert!(
        took < Duration::from_secs(10),
        "retried for {took:?}: {error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_from_a_file_connects_and_a_missing_one_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = spawn_nats_with_config("authorization {\n  token: \"s3cr3t-t0ken\"\n}\n")
    else {
        return;
    };
    let good = NatsSinkConfig {
        token_file: Some(secret_file(dir.path(), "token", "s3cr3t-t0ken")),
        ..config(&server)
    };
    publishes(&good).await;
    let (error, _) = refused(&config(&server)).await;
    assert!(error.to_lowercase().contains("authorization"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_nkey_seed_file_connects_and_another_users_seed_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let user = nkeys::KeyPair::new_user();
    let stranger = nkeys::KeyPair::new_user();
    let Some(server) = spawn_nats_with_config(&format!(
        "authorization {{\n  users: [ {{ nkey: {} }} ]\n}}\n",
        user.public_key()
    )) else {
        return;
    };
    let good = NatsSinkConfig {
        nkey_seed_file: Some(secret_file(dir.path(), "user.nk", &user.seed().unwrap())),
        ..config(&server)
    };
    publishes(&good).await;
    let wrong = NatsSinkConfig {
        nkey_seed_file: Some(secret_file(
            dir.path(),
            "stranger.nk",
            &stranger.seed().unwrap(),
        )),
        ..config(&server)
    };
    let (error, took) = refused(&wrong).await;
    assert!(error.to_lowercase().contains("authorization"), "{error}");
    assert!(
        took < Duration::from_secs(10),
        "retried for {took:?}: {error}"
    );
}
