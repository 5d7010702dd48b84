//! Kafka TLS and SASL as far as they can be checked for real today. This
//! build links librdkafka without OpenSSL (rdkafka features: `tokio` only),
//! so only SASL PLAIN over plaintext is available; asking for TLS or SCRAM
//! must fail at start with one line naming the property and the missing
//! build option, not at the first publish. No test broker here can verify
//! credentials or serve TLS (tansu 0.6.0: see docs/sinks.md, "Kafka
//! security: what is tested"), so a connecting TLS/SASL test is not written.

use std::time::{Duration, Instant};

use voucher_cdc::sinks::kafka::{KafkaSink, KafkaSinkConfig};
use voucher_cdc::stream::{Resource, StreamKey};

/// Builds a sink with `properties` (no broker is contacted before the
/// client exists) and returns its one-line error and how long it took.
async fn refused(properties: &[(&str, &str)]) -> (String, Duration) {
    let config = KafkaSinkConfig {
        properties: properties
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        // Nothing listens on the discard port: a client that got this far would time out.
        message_timeout: Duration::from_secs(5),
        ..KafkaSinkConfig::new("127.0.0.1:9")
    };
    let started = Instant::now();
    match KafkaSink::new(&config, &[StreamKey::new(1, Resource::Vouchers)]).await {
        Ok(_) => panic!("a build without openssl must refuse {properties:?}"),
        Err(e) => (e.to_string(), started.elapsed()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_is_refused_at_start_naming_the_property_because_this_build_has_no_openssl() {
    for protocol in ["ssl", "sasl_ssl"] {
        let (error, took) = refused(&[("security.protocol", protocol)]).await;
        assert!(
            error.starts_with("kafka (brokers `127.0.0.1:9`): cannot create the client: "),
            "{error}"
        );
        assert!(
            error.contains("sink.kafka.properties.\"security.protocol\"")
                && error.contains("OpenSSL not available at build time"),
            "{error}"
        );
        assert!(!error.contains('\n'), "{error}");
        assert!(took < Duration::from_secs(1), "{took:?}: {error}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scram_is_refused_at_start_because_this_build_offers_only_sasl_plain() {
    for mechanism in ["SCRAM-SHA-256", "SCRAM-SHA-512"] {
        let (error, took) = refused(&[
            ("security.protocol", "sasl_plaintext"),
            ("sasl.mechanism", mechanism),
            ("sasl.username", "bridge"),
            ("sasl.password", "s3cret-password"),
        ])
        .await;
        assert!(
            error.contains(&format!("No provider for SASL mechanism {mechanism}"))
                && error.contains("Current build options: PLAIN"),
            "{error}"
        );
        assert!(!error.contains("s3cret-password"), "{error}");
        assert!(!error.contains('\n'), "{error}");
        assert!(took < Duration::from_secs(1), "{took:?}: {error}");
    }
}
