//! The Kafka sink over TLS and SASL, for real: librdkafka (built with
//! OpenSSL) talks TLS to a rustls listener serving a certificate from a
//! private CA the test generates, authenticates with SASL PLAIN or SCRAM
//! against a server that checks the password, and its records land in a
//! tansu broker behind it and are read back (tests/common/kafka_proxy.rs:
//! tansu 0.6.0 can do neither TLS nor a checked SASL itself). A wrong CA or
//! password is one fatal line naming the cause, and nothing is committed.

mod common;

#[path = "common/brokers.rs"]
#[allow(dead_code)]
mod brokers;

#[path = "common/kafka_proxy.rs"]
mod kafka_proxy;

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::pki::{expired_pki, pki};
use common::sweeps::SweeperBuilder;
use tokio_util::sync::CancellationToken;
use voucher_cdc::event::Op;
use voucher_cdc::sinks::kafka::{KafkaSink, KafkaSinkConfig};
use voucher_cdc::sinks::{Sink, SinkError};
use voucher_cdc::state::{SledStore, StateStore};
use voucher_cdc::stream::{Resource, StreamKey};
use voucher_cdc::sweep::{SweepError, SweepKind};

use brokers::{consume_all_with, sample_events};
use kafka_proxy::{secure_tansu, Mechanism, SaslUser, SecureTansu};

const VOUCHERS: StreamKey = StreamKey {
    tenant: 1,
    resource: Resource::Vouchers,
};
const TOPIC: &str = "voucher_cdc.vouchers";
const PASSWORD: &str = "s3cret-passw0rd";

/// A sink config for `proxy` with these librdkafka properties.
fn config(proxy: &SecureTansu, properties: &[(&str, String)]) -> KafkaSinkConfig {
    KafkaSinkConfig {
        create_topics: true,
        topic_partitions: 1,
        message_timeout: Duration::from_secs(4),
        properties: properties
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect(),
        ..KafkaSinkConfig::new(proxy.bootstrap())
    }
}

fn tls(ca: &Path) -> Vec<(&'static str, String)> {
    vec![
        ("security.protocol", "ssl".to_string()),
        ("ssl.ca.location", ca.display().to_string()),
    ]
}

fn sasl_ssl(ca: &Path, mechanism: Mechanism, password: &str) -> Vec<(&'static str, String)> {
    vec![
        ("security.protocol", "sasl_ssl".to_string()),
        ("ssl.ca.location", ca.display().to_string()),
        ("sasl.mechanism", mechanism.name().to_string()),
        ("sasl.username", "bridge".to_string()),
        ("sasl.password", password.to_string()),
    ]
}

fn user(mechanism: Mechanism) -> SaslUser {
    SaslUser {
        mechanism,
        username: "bridge".to_string(),
        password: PASSWORD.to_string(),
    }
}

/// Publishes `count` events through a sink built from `config` and reads
/// them back through the same proxy with the same security settings.
async fn publishes_and_reads_back(proxy: &SecureTansu, config: &KafkaSinkConfig, count: usize) {
    let sink = KafkaSink::new(config, &[VOUCHERS])
        .await
        .unwrap_or_else(|e| panic!("{e}\ntansu log:\n{}", proxy.broker.log()));
    let events = sample_events(VOUCHERS, 1, count, Op::Snapshot, 256);
    let acks = sink.publish(&events).await;
    assert!(acks.iter().all(Result::is_ok), "{acks:?}");
    assert!(sink.health().await.is_ok());
    let secrets = config.with_secrets_read().unwrap();
    let properties: Vec<(&str, &str)> = secrets
        .properties
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let records = consume_all_with(
        &proxy.bootstrap(),
        &properties,
        &[TOPIC],
        1,
        count,
        Duration::from_secs(30),
    );
    assert_eq!(records.len(), count, "tansu log:\n{}", proxy.broker.log());
    for (record, event) in records.iter().zip(&events) {
        assert_eq!(record.payload.as_deref(), Some(&event.payload[..]));
    }
}

/// Publishes one event through a sink built from `config` and returns the
/// failure, which must be fatal, one line, and come within the message timeout.
async fn publish_refused(config: &KafkaSinkConfig) -> String {
    let sink = KafkaSink::new(
        &KafkaSinkConfig {
            create_topics: false,
            ..config.clone()
        },
        &[VOUCHERS],
    )
    .await
    .unwrap();
    let started = Instant::now();
    let acks = sink
        .publish(&sample_events(VOUCHERS, 900, 1, Op::Snapshot, 64))
        .await;
    let took = started.elapsed();
    let error = match &acks[..] {
        [Err(SinkError::Fatal(message))] => message.clone(),
        other => panic!("expected one fatal failure, got {other:?}"),
    };
    assert!(
        took < config.message_timeout + Duration::from_secs(5),
        "{took:?}"
    );
    assert!(!error.contains('\n'), "{error}");
    error
}

/// One incremental sweep of the vouchers of `sim` into `store` through `sink`.
async fn sweep(
    sim: &voucher_cdc::simulator::Simulator,
    store: &Arc<dyn StateStore>,
    sink: Arc<dyn Sink>,
) -> Result<voucher_cdc::sweep::SweepReport, SweepError> {
    SweeperBuilder::new(sim, VOUCHERS)
        .with_store(store.clone())
        .with_sink(sink)
        .build()
        .run(SweepKind::Incremental, &CancellationToken::new())
        .await
}

/// `line` starts with `prefix`, names the refused certificate and the
/// property to check, and is one line.
fn names_the_refused_certificate(line: &str, prefix: &str) {
    assert!(
        line.starts_with(prefix)
            && line.contains("certificate verify failed")
            && line.contains("ssl.ca.location"),
        "{line}"
    );
    assert!(!line.contains('\n'), "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_private_ca_file_publishes_through_a_real_tls_session_and_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let server = pki(dir.path(), "kafka");
    let Some(proxy) = secure_tansu(&server.cert, &server.key, None).await else {
        return;
    };
    publishes_and_reads_back(&proxy, &config(&proxy, &tls(&server.ca)), 20).await;
    assert!(proxy.stats.tls_sessions.load(Ordering::SeqCst) >= 1);
    assert_eq!(proxy.stats.tls_failures.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_is_one_fatal_line_naming_the_certificate_and_the_sweep_commits_nothing() {
    let sim = common::spawn_catalog(1, 12, 1).await;
    let dir = tempfile::tempdir().unwrap();
    let server = pki(dir.path(), "kafka");
    let other = pki(dir.path(), "other");
    let Some(proxy) = secure_tansu(&server.cert, &server.key, None).await else {
        return;
    };
    let good = config(&proxy, &tls(&server.ca));
    let bad = config(&proxy, &tls(&other.ca));

    // At start, creating the topics fails on the certificate, in one line.
    let error = KafkaSink::new(&bad, &[VOUCHERS])
        .await
        .unwrap_err()
        .to_string();
    names_the_refused_certificate(
        &error,
        &format!(
            "kafka (brokers `{}`): cannot create topic",
            proxy.bootstrap()
        ),
    );

    // A sweep through a sink with the wrong CA fails on the first batch and
    // commits nothing; the same sweep with the right CA then delivers all.
    let good_sink: Arc<dyn Sink> = Arc::new(KafkaSink::new(&good, &[VOUCHERS]).await.unwrap());
    let bad_sink: Arc<dyn Sink> = Arc::new(
        KafkaSink::new(
            &KafkaSinkConfig {
                create_topics: false,
                ..bad.clone()
            },
            &[VOUCHERS],
        )
        .await
        .unwrap(),
    );
    let store: Arc<dyn StateStore> = Arc::new(SledStore::open(&dir.path().join("state")).unwrap());
    // Bounded: a sink that called this retriable would retry for ever.
    let failed = tokio::time::timeout(Duration::from_secs(60), sweep(&sim, &store, bad_sink))
        .await
        .expect("a refused certificate fails the sweep instead of retrying for ever")
        .unwrap_err();
    let message = match &failed {
        SweepError::SinkRejected { message, .. } => message.clone(),
        other => panic!("expected the sink's fatal failure, got {other}"),
    };
    names_the_refused_certificate(
        &message,
        &format!(
            "kafka: delivery to topic `{TOPIC}` (brokers `{}`) failed:",
            proxy.bootstrap()
        ),
    );
    assert_eq!(store.load_stream(VOUCHERS).unwrap().watermark, None);
    assert_eq!(store.record_count(VOUCHERS).unwrap(), 0);
    assert!(proxy.stats.tls_failures.load(Ordering::SeqCst) >= 1);

    let report = sweep(&sim, &store, good_sink).await.unwrap();
    let known = store.record_count(VOUCHERS).unwrap();
    assert_eq!(known, 12);
    assert_eq!(report.snapshots, known);
    assert!(store.load_stream(VOUCHERS).unwrap().watermark.is_some());
    let records = consume_all_with(
        &proxy.bootstrap(),
        &[
            ("security.protocol", "ssl"),
            ("ssl.ca.location", &server.ca.display().to_string()),
        ],
        &[TOPIC],
        1,
        known as usize,
        Duration::from_secs(30),
    );
    // Every record once: nothing went out through the refused connection.
    assert_eq!(records.len() as u64, known);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_broker_certificate_is_one_fatal_line_and_the_probe_names_it_too() {
    let dir = tempfile::tempdir().unwrap();
    let expired = expired_pki(dir.path(), "kafka");
    let Some(proxy) = secure_tansu(&expired.cert, &expired.key, None).await else {
        return;
    };
    let config = config(&proxy, &tls(&expired.ca));
    let error = publish_refused(&config).await;
    names_the_refused_certificate(
        &error,
        &format!(
            "kafka: delivery to topic `{TOPIC}` (brokers `{}`) failed:",
            proxy.bootstrap()
        ),
    );
    // `check-config --probe` connects the same way and says the same.
    let probe = voucher_cdc::sinks::kafka::probe(&config, Duration::from_secs(3))
        .await
        .unwrap_err()
        .to_string();
    names_the_refused_certificate(
        &probe,
        &format!(
            "kafka (brokers `{}`): metadata request failed:",
            proxy.bootstrap()
        ),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sasl_plain_over_tls_with_the_password_from_a_file_publishes_and_a_wrong_password_is_one_fatal_line(
) {
    let dir = tempfile::tempdir().unwrap();
    let server = pki(dir.path(), "kafka");
    let Some(proxy) = secure_tansu(&server.cert, &server.key, Some(user(Mechanism::Plain))).await
    else {
        return;
    };
    // The password only in a file, as platforms mount secrets.
    let password_file = dir.path().join("kafka-password");
    std::fs::write(&password_file, format!("{PASSWORD}\n")).unwrap();
    let mut good = config(&proxy, &sasl_ssl(&server.ca, Mechanism::Plain, PASSWORD));
    good.properties.remove("sasl.password");
    good.property_files
        .insert("sasl.password".to_string(), password_file.clone());
    publishes_and_reads_back(&proxy, &good, 5).await;
    assert!(proxy.stats.authenticated.load(Ordering::SeqCst) >= 1);
    assert_eq!(proxy.stats.refused.load(Ordering::SeqCst), 0);
    // check-config shows the file, never the password.
    let shown = format!("{:?}", good.with_secrets_read().unwrap().redacted());
    assert!(!shown.contains(PASSWORD), "{shown}");

    std::fs::write(&password_file, "not-the-password\n").unwrap();
    let error = publish_refused(&good).await;
    assert!(
        error.contains(
            "SASL authentication error: Authentication failed: Invalid username or password"
        ) && error.contains("sasl.password"),
        "{error}"
    );
    assert!(!error.contains("not-the-password"), "{error}");
    assert!(proxy.stats.refused.load(Ordering::SeqCst) >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sasl_scram_sha_256_and_512_authenticate_with_a_checked_password_and_a_wrong_one_is_refused(
) {
    for mechanism in [Mechanism::ScramSha256, Mechanism::ScramSha512] {
        let dir = tempfile::tempdir().unwrap();
        let server = pki(dir.path(), "kafka");
        let Some(proxy) = secure_tansu(&server.cert, &server.key, Some(user(mechanism))).await
        else {
            return;
        };
        let good = config(&proxy, &sasl_ssl(&server.ca, mechanism, PASSWORD));
        publishes_and_reads_back(&proxy, &good, 3).await;
        assert!(proxy.stats.authenticated.load(Ordering::SeqCst) >= 1);

        let wrong = config(&proxy, &sasl_ssl(&server.ca, mechanism, "hunter2-wrong"));
        let error = publish_refused(&wrong).await;
        assert!(
            error.contains(&format!(
                "invalid credentials with SASL mechanism {}",
                mechanism.name()
            )),
            "{error}"
        );
        assert!(!error.contains("hunter2-wrong"), "{error}");
        assert!(proxy.stats.refused.load(Ordering::SeqCst) >= 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gssapi_is_refused_at_start_because_this_build_has_no_libsasl2() {
    let config = KafkaSinkConfig {
        properties: [
            ("security.protocol", "sasl_ssl"),
            ("sasl.mechanism", "GSSAPI"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect(),
        ..KafkaSinkConfig::new("127.0.0.1:9")
    };
    let started = Instant::now();
    let error = KafkaSink::new(&config, &[VOUCHERS])
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.starts_with("kafka (brokers `127.0.0.1:9`): cannot create the client: ")
            && error.contains("No provider for SASL mechanism GSSAPI"),
        "{error}"
    );
    assert!(!error.contains('\n'), "{error}");
    assert!(started.elapsed() < Duration::from_secs(1));
}
