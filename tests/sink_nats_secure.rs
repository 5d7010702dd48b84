//! The NATS sink against a nats-server that demands TLS or credentials:
//! TLS with a private CA the test generates, user/password, token, nkey, and
//! a `.creds` file against a server in operator mode (operator, account and
//! user JWTs the test signs with `nkeys`), each given the way platforms
//! deliver secrets (files). A wrong CA, password or creds file fails
//! start-up at once with one line naming the sink and the cause, instead of
//! retrying for `connect_timeout`.

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

/// Builds the sink expecting a failure at once (no retrying for
/// `connect_timeout`), in one line naming the servers and `cause`; returns it.
async fn refused_at_once(config: &NatsSinkConfig, cause: &str) -> String {
    let (error, took) = refused(config).await;
    assert!(error.starts_with("nats: cannot connect to "), "{error}");
    assert!(error.to_lowercase().contains(cause), "{error}");
    assert!(!error.contains('\n'), "{error}");
    assert!(
        took < Duration::from_secs(10),
        "retried for {took:?}: {error}"
    );
    error
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
    refused_at_once(&wrong_ca, "certificate").await;
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
    let error = refused_at_once(&wrong, "authorization").await;
    assert!(!error.contains("not-it"), "{error}");
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
    refused_at_once(&wrong, "authorization").await;
}

/// A NATS JWT (`base64url(header).base64url(claims).base64url(signature)`,
/// ed25519 by the issuer's nkey), as `nsc` writes them: `kind` is
/// `operator`, `account` or `user`; `nats` holds the kind's own claims.
fn nats_jwt(
    issuer: &nkeys::KeyPair,
    subject: &str,
    name: &str,
    kind: &str,
    mut nats: serde_json::Value,
) -> String {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    nats["type"] = kind.into();
    nats["version"] = 2.into();
    let claims = serde_json::json!({
        "jti": format!("{}{}", kind.to_uppercase(), subject),
        "iat": chrono::Utc::now().timestamp(),
        "iss": issuer.public_key(),
        "sub": subject,
        "name": name,
        "nats": nats,
    });
    let signed = format!(
        "{}.{}",
        b64.encode(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#),
        b64.encode(claims.to_string())
    );
    let signature = issuer.sign(signed.as_bytes()).unwrap();
    format!("{signed}.{}", b64.encode(signature))
}

/// A `.creds` file as `nsc generate creds` writes it: the user JWT and seed.
fn creds_file(dir: &Path, name: &str, user_jwt: &str, user: &nkeys::KeyPair) -> PathBuf {
    let text = format!(
        "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
         ************************* IMPORTANT *************************\n\
         NKEY Seed printed below can be used to sign and prove identity.\n\
         NKEYs are sensitive and should be treated as secrets.\n\n\
         -----BEGIN USER NKEY SEED-----\n{}\n------END USER NKEY SEED------\n\n\
         *************************************************************\n",
        user.seed().unwrap()
    );
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// An account JWT without limits; with `jetstream`, JetStream is allowed
/// too (unlimited, as `nsc edit account --js-disk-storage -1 ...`).
fn account_jwt(
    operator: &nkeys::KeyPair,
    account: &nkeys::KeyPair,
    name: &str,
    jetstream: bool,
) -> String {
    let mut unlimited = serde_json::json!({
        "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
        "wildcards": true, "conn": -1, "leaf": -1,
    });
    if jetstream {
        for limit in ["mem_storage", "disk_storage", "streams", "consumer"] {
            unlimited[limit] = (-1).into();
        }
    }
    nats_jwt(
        operator,
        &account.public_key(),
        name,
        "account",
        serde_json::json!({ "limits": unlimited, "default_permissions": { "pub": {}, "sub": {} } }),
    )
}

fn user_jwt(account: &nkeys::KeyPair, user: &nkeys::KeyPair) -> String {
    nats_jwt(
        account,
        &user.public_key(),
        "bridge",
        "user",
        serde_json::json!({ "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1 }),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_creds_file_connects_to_an_operator_mode_server_and_creds_of_an_unknown_account_are_one_line_at_once(
) {
    let dir = tempfile::tempdir().unwrap();
    let operator = nkeys::KeyPair::new_operator();
    let system = nkeys::KeyPair::new_account();
    let account = nkeys::KeyPair::new_account();
    let user = nkeys::KeyPair::new_user();
    // The server trusts the operator and knows the accounts it signed: the
    // system account (JetStream needs one) and the bridge's.
    let operator_jwt = nats_jwt(
        &operator,
        &operator.public_key(),
        "voucher-cdc-test",
        "operator",
        serde_json::json!({ "system_account": system.public_key() }),
    );
    let Some(server) = spawn_nats_with_config(&format!(
        "operator: {operator_jwt}\nsystem_account: {}\nresolver: MEMORY\n\
         resolver_preload: {{\n  {}: {}\n  {}: {}\n}}\n",
        system.public_key(),
        system.public_key(),
        account_jwt(&operator, &system, "SYS", false),
        account.public_key(),
        account_jwt(&operator, &account, "bridge-account", true)
    )) else {
        return;
    };
    let with_creds = |name: &str, jwt: &str, seed: &nkeys::KeyPair| NatsSinkConfig {
        credentials_file: Some(creds_file(dir.path(), name, jwt, seed)),
        ..config(&server)
    };
    publishes(&with_creds(
        "bridge.creds",
        &user_jwt(&account, &user),
        &user,
    ))
    .await;

    // A user of an account the server was never told about, signed by the same operator.
    let stranger_account = nkeys::KeyPair::new_account();
    let stranger = nkeys::KeyPair::new_user();
    let unknown = with_creds(
        "stranger.creds",
        &user_jwt(&stranger_account, &stranger),
        &stranger,
    );
    refused_at_once(&unknown, "authorization").await;

    // The right JWT with another user's seed cannot sign the server's nonce.
    let forged = with_creds("forged.creds", &user_jwt(&account, &user), &stranger);
    let error = refused_at_once(&forged, "authorization").await;
    assert!(!error.contains(&stranger.seed().unwrap()), "{error}");

    // Not a creds file at all: a config error naming the key.
    let garbage = NatsSinkConfig {
        credentials_file: Some(secret_file(dir.path(), "garbage.creds", "not a creds file")),
        ..config(&server)
    };
    let (error, _) = refused(&garbage).await;
    assert!(error.contains("sink.nats.credentials"), "{error}");
    assert!(!error.contains('\n'), "{error}");
}
