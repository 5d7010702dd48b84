//! The Kafka sink end to end against a real Kafka-protocol broker process
//! (tansu 0.6.0, memory storage, started on a free port): topics created by
//! `create_topics`, idempotent produce, keys, headers and tombstones read back,
//! in structured and in binary content mode.
//!
//! The binary comes from env `TANSU_BIN`, else from `scripts/install-tansu.sh`'s
//! cache path; when it is missing the test is skipped with a message, unless
//! env `VCDC_REQUIRE_BROKERS` (set by scripts/test.sh) or `CI` is set, then it fails.

#[path = "common/brokers.rs"]
#[allow(dead_code)]
mod brokers;
mod common;

use std::time::Duration;

use voucher_cdc::event::{Event, Op};
use voucher_cdc::sinks::binding::{ContentMode, ROUTING_ATTRIBUTES};
use voucher_cdc::sinks::kafka::{KafkaSink, KafkaSinkConfig};
use voucher_cdc::sinks::Sink;
use voucher_cdc::stream::{Resource, StreamKey};

use brokers::{
    consume_all, header_map, read_back_once, sample_events, spawn_tansu, update_with_version,
};

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
    publish_all(&sink, &events, &broker).await;
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
        let record = read_back_once(&records, event, |r| {
            r.payload.as_deref() == Some(&event.payload[..])
        });
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

/// Publishes `events`, expecting every one acked, and flushes.
async fn publish_all(sink: &KafkaSink, events: &[Event], broker: &brokers::TansuBroker) {
    let acks = sink.publish(events).await;
    assert!(
        acks.iter().all(Result::is_ok),
        "{:?}\ntansu log:\n{}",
        acks.iter().find(|a| a.is_err()),
        broker.log()
    );
    sink.flush().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_binary_content_mode_a_real_broker_returns_data_as_the_value_and_every_attribute_as_a_ce_header(
) {
    let Some(broker) = spawn_tansu() else { return };
    let vouchers = StreamKey::new(42, Resource::Vouchers);
    let config = KafkaSinkConfig {
        create_topics: true,
        content_mode: ContentMode::Binary,
        message_timeout: Duration::from_secs(10),
        ..KafkaSinkConfig::new(broker.bootstrap())
    };
    let sink = KafkaSink::new(&config, &[vouchers])
        .await
        .unwrap_or_else(|e| panic!("{e}\ntansu log:\n{}", broker.log()));
    let mut events = vec![
        update_with_version(vouchers, 7),
        update_with_version(vouchers, 8),
    ];
    events.extend(sample_events(vouchers, 20, 3, Op::Snapshot, 400));
    events.extend(sample_events(vouchers, 30, 1, Op::Delete, 0));
    publish_all(&sink, &events, &broker).await;

    let expected = events.len() + 1;
    let records = consume_all(
        &broker.bootstrap(),
        &["voucher_cdc.vouchers"],
        config.topic_partitions,
        expected,
        Duration::from_secs(30),
    );
    assert_eq!(records.len(), expected, "tansu log:\n{}", broker.log());
    for event in &events {
        let doc: serde_json::Value = serde_json::from_slice(&event.payload).unwrap();
        let record = read_back_once(&records, event, |r| {
            header_map(r).get("ce_id") == Some(&event.id)
        });
        assert_eq!(record.key.as_deref(), Some(event.partition_key.as_bytes()));
        let value: serde_json::Value =
            serde_json::from_slice(record.payload.as_deref().unwrap()).unwrap();
        assert_eq!(value, doc["data"], "the value is data alone");
        let headers = header_map(record);
        assert_eq!(headers["content-type"], "application/json");
        // Every attribute but data and datacontenttype is a header with the
        // attribute's value, and there is no other header.
        let attributes = doc.as_object().unwrap();
        let mut expected_names: Vec<String> = attributes
            .keys()
            .filter(|k| !matches!(k.as_str(), "data" | "datacontenttype"))
            .map(|k| format!("ce_{k}"))
            .collect();
        expected_names.push("content-type".to_string());
        expected_names.sort();
        assert_eq!(headers.keys().cloned().collect::<Vec<_>>(), expected_names);
        for (name, value) in attributes {
            if matches!(name.as_str(), "data" | "datacontenttype") {
                continue;
            }
            let text = match value {
                serde_json::Value::String(text) => text.clone(),
                other => other.to_string(),
            };
            assert_eq!(
                headers[&format!("ce_{name}")],
                text,
                "ce_{name} of {}",
                event.id
            );
        }
    }
    // The version attributes crossed the broker intact.
    let updated: Vec<_> = records
        .iter()
        .filter(|r| r.headers.iter().any(|(n, _)| n == "ce_changedfields"))
        .collect();
    assert_eq!(updated.len(), 2);
    for record in updated {
        let headers = header_map(record);
        assert_eq!(headers["ce_changedfields"], "price,title");
        let before: serde_json::Value = serde_json::from_str(&headers["ce_before"]).unwrap();
        assert_eq!(before["title"], "old");
    }
    // The delete is still followed by its tombstone.
    assert_eq!(records.iter().filter(|r| r.payload.is_none()).count(), 1);
}
