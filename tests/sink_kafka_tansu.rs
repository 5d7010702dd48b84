//! The Kafka sink end to end against a real Kafka-protocol broker process
//! (tansu 0.6.0, memory storage, started on a free port): topics created by
//! `create_topics`, idempotent produce, keys, headers and tombstones read back.
//!
//! The binary comes from env `TANSU_BIN`, else from `scripts/install-tansu.sh`'s
//! cache path; when it is missing the test is skipped with a message, unless
//! env `VCDC_REQUIRE_BROKERS` (set by scripts/test.sh) or `CI` is set, then it fails.

#[path = "common/brokers.rs"]
#[allow(dead_code)]
mod brokers;
mod common;

use std::time::Duration;

use voucher_cdc::event::Op;
use voucher_cdc::sinks::binding::ROUTING_ATTRIBUTES;
use voucher_cdc::sinks::kafka::{KafkaSink, KafkaSinkConfig};
use voucher_cdc::sinks::Sink;
use voucher_cdc::stream::{Resource, StreamKey};

use brokers::{consume_all, sample_events, spawn_tansu};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_reach_a_real_broker_on_created_topics_with_keys_headers_and_tombstones() {
    let Some(broker) = spawn_tansu() else { return };
    let vouchers = StreamKey::new(42, Resource::Vouchers);
    let categories = StreamKey::new(42, Resource::Categories);
    let config = KafkaSinkConfig {
        create_topics: true,
        message_timeout: Duration::from_secs(10),
        ..KafkaSinkConfig::new(broker.bootstrap())
    };
    let sink = KafkaSink::new(&config, &[vouchers, categories])
        .await
        .unwrap_or_else(|e| panic!("{e}\ntansu log:\n{}", broker.log()));
    // Creating them again at the next start is fine.
    KafkaSink::new(&config, &[vouchers, categories])
        .await
        .unwrap();

    let mut events = sample_events(vouchers, 1, 40, Op::Snapshot, 1024);
    events.extend(sample_events(vouchers, 1, 2, Op::Delete, 0));
    events.extend(sample_events(categories, 5, 10, Op::Update, 300));
    let acks = sink.publish(&events).await;
    assert!(
        acks.iter().all(Result::is_ok),
        "{:?}\ntansu log:\n{}",
        acks.iter().find(|a| a.is_err()),
        broker.log()
    );
    sink.flush().await.unwrap();
    assert!(sink.health().await.is_ok());

    let expected = events.len() + 2;
    let records = consume_all(
        &broker.bootstrap(),
        &["voucher_cdc.vouchers", "voucher_cdc.categories"],
        config.topic_partitions,
        expected,
        Duration::from_secs(30),
    );
    assert_eq!(records.len(), expected, "tansu log:\n{}", broker.log());
    for event in &events {
        let matching: Vec<_> = records
            .iter()
            .filter(|r| r.payload.as_deref() == Some(&event.payload[..]))
            .collect();
        assert_eq!(
            matching.len(),
            1,
            "event {} read back {} times",
            event.id,
            matching.len()
        );
        let record = matching[0];
        assert_eq!(
            record.topic,
            format!("voucher_cdc.{}", event.stream.resource)
        );
        assert_eq!(record.key.as_deref(), Some(event.partition_key.as_bytes()));
        // Structured mode: the content type, and the routing attributes as
        // `ce_` headers equal to the event's own (the CloudEvents Kafka binding).
        let doc: serde_json::Value = serde_json::from_slice(&event.payload).unwrap();
        let mut headers = vec![(
            "content-type".to_string(),
            b"application/cloudevents+json".to_vec(),
        )];
        for name in ROUTING_ATTRIBUTES {
            let value = match &doc[name] {
                serde_json::Value::String(text) => text.clone(),
                other => other.to_string(),
            };
            headers.push((format!("ce_{name}"), value.into_bytes()));
        }
        assert_eq!(record.headers, headers, "event {}", event.id);
    }
    let tombstones: Vec<_> = records.iter().filter(|r| r.payload.is_none()).collect();
    assert_eq!(tombstones.len(), 2);
    for tombstone in tombstones {
        let key = tombstone.key.as_deref().unwrap();
        assert!(key == b"42:voucher:1" || key == b"42:voucher:2");
    }
}
