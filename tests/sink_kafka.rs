//! The Kafka sink against librdkafka's MockCluster: records read back with
//! their keys, headers and tombstones; injected produce errors and brokers
//! taken down, showing that every acknowledged event is there to consume and
//! every failed one is reported retriable and succeeds on retry.

#[path = "common/brokers.rs"]
#[allow(dead_code)]
mod brokers;
mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use voucher_cdc::event::{Event, Op};
use voucher_cdc::sinks::binding::{ContentMode, ROUTING_ATTRIBUTES};
use voucher_cdc::sinks::kafka::{KafkaSink, KafkaSinkConfig, KafkaSinkError};
use voucher_cdc::sinks::{Ack, Sink, SinkError};
use voucher_cdc::stream::{Resource, StreamKey};

use brokers::{consume_all, header_map, retry_until_acked, sample_events, Consumed};

const VOUCHERS: StreamKey = StreamKey {
    tenant: 42,
    resource: Resource::Vouchers,
};
const CATEGORIES: StreamKey = StreamKey {
    tenant: 42,
    resource: Resource::Categories,
};

/// The MockCluster has no CreateTopics API: its topics are made through the mock itself
/// (`create_topics` is exercised against tansu in `sink_kafka_tansu.rs`).
fn mock_cluster(
    brokers: i32,
    topics: &[&str],
) -> (MockCluster<'static, DefaultProducerContext>, String) {
    let cluster = MockCluster::new(brokers).unwrap();
    for topic in topics {
        cluster.create_topic(topic, 3, 1).unwrap();
    }
    let bootstrap = cluster.bootstrap_servers();
    (cluster, bootstrap)
}

fn sink_config(bootstrap: &str) -> KafkaSinkConfig {
    KafkaSinkConfig {
        message_timeout: Duration::from_secs(3),
        ..KafkaSinkConfig::new(bootstrap)
    }
}

fn all_ok(acks: &[Ack]) -> bool {
    acks.iter().all(Result::is_ok)
}

/// How often each event payload was read back (tombstones left out).
fn payload_counts(records: &[Consumed]) -> BTreeMap<Vec<u8>, usize> {
    let mut counts = BTreeMap::new();
    for record in records {
        if let Some(payload) = &record.payload {
            *counts.entry(payload.clone()).or_insert(0) += 1;
        }
    }
    counts
}

fn assert_each_read_back_once(events: &[Event], records: &[Consumed]) {
    let counts = payload_counts(records);
    for event in events {
        assert_eq!(
            counts.get(&event.payload[..]).copied(),
            Some(1),
            "event {} read back a wrong number of times",
            event.id
        );
    }
}

/// The routing attributes are `ce_` headers equal to the event's own attributes.
fn assert_routing_headers(record: &Consumed, event: &Event) {
    let headers = header_map(record);
    let doc: serde_json::Value = serde_json::from_slice(&event.payload).unwrap();
    let text = |name: &str| match &doc[name] {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    assert_eq!(ROUTING_ATTRIBUTES.len(), 7);
    for name in ROUTING_ATTRIBUTES {
        assert_eq!(headers[&format!("ce_{name}")], text(name), "ce_{name}");
    }
    assert_eq!(headers["ce_id"], event.id);
    assert_eq!(headers["ce_tenant"], "42");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_binary_content_mode_the_value_is_data_and_every_attribute_is_a_ce_header() {
    let (_cluster, bootstrap) = mock_cluster(1, &["voucher_cdc.vouchers"]);
    let config = KafkaSinkConfig {
        content_mode: ContentMode::Binary,
        ..sink_config(&bootstrap)
    };
    let sink = KafkaSink::new(&config, &[VOUCHERS]).await.unwrap();
    let mut events = sample_events(VOUCHERS, 1, 3, Op::Update, 300);
    events.extend(sample_events(VOUCHERS, 10, 1, Op::Delete, 0));
    let acks = sink.publish(&events).await;
    assert!(all_ok(&acks), "{acks:?}");
    sink.flush().await.unwrap();
    let records = consume_all(
        &bootstrap,
        &["voucher_cdc.vouchers"],
        3,
        events.len() + 1,
        Duration::from_secs(20),
    );
    for event in &events {
        let doc: serde_json::Value = serde_json::from_slice(&event.payload).unwrap();
        let record = records
            .iter()
            .find(|r| header_map(r).get("ce_id") == Some(&event.id))
            .unwrap_or_else(|| panic!("event {} not read back", event.id));
        let value: serde_json::Value =
            serde_json::from_slice(record.payload.as_deref().unwrap()).unwrap();
        assert_eq!(value, doc["data"], "the value is data alone");
        assert_eq!(record.key.as_deref(), Some(event.partition_key.as_bytes()));
        assert_routing_headers(record, event);
        let headers = header_map(record);
        assert_eq!(headers["content-type"], "application/json");
        // Every attribute but data and datacontenttype, and nothing else.
        let mut expected: Vec<String> = doc
            .as_object()
            .unwrap()
            .keys()
            .filter(|k| !matches!(k.as_str(), "data" | "datacontenttype"))
            .map(|k| format!("ce_{k}"))
            .collect();
        expected.push("content-type".to_string());
        expected.sort();
        assert_eq!(headers.keys().cloned().collect::<Vec<_>>(), expected);
        assert_eq!(
            headers["ce_dataschema"],
            doc["dataschema"].as_str().unwrap()
        );
        assert_eq!(
            headers["ce_contenthash"],
            doc["contenthash"].as_str().unwrap()
        );
    }
    // The delete is still followed by its tombstone.
    assert_eq!(records.iter().filter(|r| r.payload.is_none()).count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_are_keyed_by_partitionkey_with_a_content_type_header_and_deletes_are_followed_by_tombstones(
) {
    let (_cluster, bootstrap) =
        mock_cluster(3, &["voucher_cdc.vouchers", "voucher_cdc.categories"]);
    let sink = KafkaSink::new(&sink_config(&bootstrap), &[VOUCHERS, CATEGORIES])
        .await
        .unwrap();

    let mut events = sample_events(VOUCHERS, 1, 20, Op::Update, 500);
    events.extend(sample_events(VOUCHERS, 1, 3, Op::Delete, 0));
    events.extend(sample_events(CATEGORIES, 7, 5, Op::Create, 200));
    let acks = sink.publish(&events).await;
    assert!(all_ok(&acks), "{acks:?}");
    sink.flush().await.unwrap();

    let topics = ["voucher_cdc.vouchers", "voucher_cdc.categories"];
    let expected_records = events.len() + 3;
    let records = consume_all(
        &bootstrap,
        &topics,
        3,
        expected_records,
        Duration::from_secs(20),
    );
    assert_eq!(records.len(), expected_records);
    assert_each_read_back_once(&events, &records);

    for event in &events {
        let record = records
            .iter()
            .find(|r| r.payload.as_deref() == Some(&event.payload[..]))
            .unwrap();
        let topic = format!("voucher_cdc.{}", event.stream.resource);
        assert_eq!(record.topic, topic);
        assert_eq!(record.key.as_deref(), Some(event.partition_key.as_bytes()));
        assert_eq!(
            record.headers[0],
            (
                "content-type".to_string(),
                b"application/cloudevents+json".to_vec()
            )
        );
        assert_routing_headers(record, event);
        // A delete is followed at once, in the same partition, by a tombstone with its key.
        let next = records.iter().find(|r| {
            r.topic == record.topic && r.partition == record.partition && r.offset > record.offset
        });
        let tombstone_follows = next.is_some_and(|n| n.payload.is_none() && n.key == record.key);
        assert_eq!(tombstone_follows, event.is_delete(), "{}", event.id);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topics_follow_the_template_and_tombstones_can_be_switched_off() {
    let (_cluster, bootstrap) = mock_cluster(1, &["cdc-42.vouchers", "cdc-7.vouchers"]);
    let config = KafkaSinkConfig {
        topic_template: "cdc-{tenant}.{resource}".to_string(),
        tombstones: false,
        ..sink_config(&bootstrap)
    };
    let other_tenant = StreamKey::new(7, Resource::Vouchers);
    let sink = KafkaSink::new(&config, &[VOUCHERS, other_tenant])
        .await
        .unwrap();
    let mut events = sample_events(VOUCHERS, 1, 2, Op::Delete, 0);
    events.extend(sample_events(other_tenant, 1, 2, Op::Snapshot, 0));
    assert!(all_ok(&sink.publish(&events).await));

    let records = consume_all(
        &bootstrap,
        &["cdc-42.vouchers", "cdc-7.vouchers"],
        3,
        events.len(),
        Duration::from_secs(20),
    );
    assert_eq!(records.len(), events.len(), "no tombstones expected");
    assert!(records.iter().all(|r| r.payload.is_some()));
    assert_eq!(
        records
            .iter()
            .filter(|r| r.topic == "cdc-7.vouchers")
            .count(),
        2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_produce_errors_are_retried_by_the_producer_and_every_event_arrives_exactly_once()
{
    let (cluster, bootstrap) = mock_cluster(3, &["voucher_cdc.vouchers"]);
    let sink = KafkaSink::new(&sink_config(&bootstrap), &[VOUCHERS])
        .await
        .unwrap();
    // Warm up so the producer knows its leaders before the errors start.
    let warm_up = sample_events(VOUCHERS, 1, 1, Op::Snapshot, 0);
    assert!(all_ok(&sink.publish(&warm_up).await));

    cluster.request_errors(
        RDKafkaApiKey::Produce,
        &[
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_LEADER_NOT_AVAILABLE,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS_AFTER_APPEND,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
        ],
    );
    let events = sample_events(VOUCHERS, 100, 300, Op::Snapshot, 1024);
    let acks = sink.publish(&events).await;
    assert!(all_ok(&acks), "{:?}", acks.iter().find(|a| a.is_err()));

    let records = consume_all(
        &bootstrap,
        &["voucher_cdc.vouchers"],
        3,
        events.len() + 1,
        Duration::from_secs(20),
    );
    assert_eq!(
        records.len(),
        events.len() + 1,
        "lost or duplicated records"
    );
    assert_each_read_back_once(&events, &records);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_broker_down_publishes_fail_retriable_and_a_retry_after_recovery_loses_nothing()
{
    let (cluster, bootstrap) = mock_cluster(3, &["voucher_cdc.vouchers"]);
    let sink = KafkaSink::new(&sink_config(&bootstrap), &[VOUCHERS])
        .await
        .unwrap();
    let before = sample_events(VOUCHERS, 1, 50, Op::Snapshot, 1024);
    assert!(all_ok(&sink.publish(&before).await));

    for broker in 1..=3 {
        cluster.broker_down(broker).unwrap();
    }
    let during = sample_events(VOUCHERS, 1000, 50, Op::Update, 1024);
    let acks = sink.publish(&during).await;
    assert!(
        acks.iter().all(
            |a| matches!(a, Err(SinkError::Retriable(m)) if m.contains("voucher_cdc.vouchers"))
        ),
        "{:?}",
        acks.first()
    );
    assert!(sink.health().await.is_err());

    for broker in 1..=3 {
        cluster.broker_up(broker).unwrap();
    }
    // As the sweep does: retry what failed (each failure retriable) until acked.
    retry_until_acked(&sink, during.clone(), Duration::from_secs(60)).await;
    assert!(sink.health().await.is_ok());

    let mut acked = before.clone();
    acked.extend(during);
    let records = consume_all(
        &bootstrap,
        &["voucher_cdc.vouchers"],
        3,
        acked.len(),
        Duration::from_secs(20),
    );
    let counts = payload_counts(&records);
    for event in &acked {
        assert!(
            counts.contains_key(&event.payload[..]),
            "acked event {} lost",
            event.id
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn persistent_produce_errors_fail_as_retriable_and_the_retry_succeeds_once_they_clear() {
    let (cluster, bootstrap) = mock_cluster(1, &["voucher_cdc.vouchers"]);
    let config = KafkaSinkConfig {
        message_timeout: Duration::from_secs(2),
        ..sink_config(&bootstrap)
    };
    let sink = KafkaSink::new(&config, &[VOUCHERS]).await.unwrap();
    let warm_up = sample_events(VOUCHERS, 1, 1, Op::Snapshot, 0);
    assert!(all_ok(&sink.publish(&warm_up).await));

    cluster.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS; 500],
    );
    let events = sample_events(VOUCHERS, 10, 20, Op::Update, 1024);
    let acks = sink.publish(&events).await;
    assert!(
        acks.iter().all(|a| matches!(a, Err(e) if e.is_retriable())),
        "{acks:?}"
    );

    cluster.clear_request_errors(RDKafkaApiKey::Produce);
    retry_until_acked(&sink, events.clone(), Duration::from_secs(60)).await;
    let records = consume_all(
        &bootstrap,
        &["voucher_cdc.vouchers"],
        3,
        events.len() + 1,
        Duration::from_secs(20),
    );
    let counts = payload_counts(&records);
    for event in &events {
        assert!(
            counts.contains_key(&event.payload[..]),
            "event {} lost",
            event.id
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_larger_than_the_producer_allows_is_rejected_alone_and_the_rest_of_the_batch_is_delivered(
) {
    let (_cluster, bootstrap) = mock_cluster(1, &["voucher_cdc.vouchers"]);
    let mut config = sink_config(&bootstrap);
    config
        .properties
        .insert("message.max.bytes".to_string(), "4000".to_string());
    let sink = KafkaSink::new(&config, &[VOUCHERS]).await.unwrap();
    let mut events = sample_events(VOUCHERS, 1, 3, Op::Snapshot, 500);
    events.insert(
        1,
        sample_events(VOUCHERS, 99, 1, Op::Snapshot, 10_000).remove(0),
    );
    let acks = sink.publish(&events).await;
    assert!(
        acks[0].is_ok() && acks[2].is_ok() && acks[3].is_ok(),
        "{acks:?}"
    );
    let Err(SinkError::Rejected { reason, limit }) = &acks[1] else {
        panic!("expected a per-record rejection, got {:?}", acks[1]);
    };
    assert_eq!(*limit, Some(4000));
    assert!(reason.contains("message.max.bytes of 4000"), "{reason}");
    assert!(reason.contains("compression.type"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_goes_to_the_dead_letter_topic_keyed_by_partitionkey() {
    let (_cluster, bootstrap) = mock_cluster(1, &["voucher_cdc.vouchers", "dlq"]);
    let config = KafkaSinkConfig {
        dead_letter_topic: "dlq".to_string(),
        ..sink_config(&bootstrap)
    };
    let sink = KafkaSink::new(&config, &[VOUCHERS]).await.unwrap();
    let original = sample_events(VOUCHERS, 5, 1, Op::Update, 200).remove(0);
    let letter = voucher_cdc::event::dead_letter_event(&original, "too large", Some(1000)).unwrap();
    assert!(all_ok(&sink.publish(std::slice::from_ref(&letter)).await));
    let records = consume_all(
        &bootstrap,
        &["voucher_cdc.vouchers", "dlq"],
        3,
        1,
        Duration::from_secs(20),
    );
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].topic, "dlq");
    assert_eq!(
        records[0].key.as_deref(),
        Some(original.partition_key.as_bytes())
    );
    let value: serde_json::Value =
        serde_json::from_slice(records[0].payload.as_deref().unwrap()).unwrap();
    assert_eq!(value["id"], original.id.as_str());
    assert_eq!(value["deadletterlimit"], 1000);
    assert!(value.get("data").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configuration_errors_fail_at_construction_naming_the_property_or_key() {
    let mut config = KafkaSinkConfig::new("127.0.0.1:1");
    config
        .properties
        .insert("no.such.property".to_string(), "1".to_string());
    let err = KafkaSink::new(&config, &[]).await.unwrap_err();
    assert!(matches!(err, KafkaSinkError::Client { .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains("no.such.property"), "{text}");
    assert!(text.contains("127.0.0.1:1"), "{text}");

    let config = KafkaSinkConfig {
        topic_template: "cdc.{stream}".to_string(),
        ..KafkaSinkConfig::new("127.0.0.1:1")
    };
    let text = KafkaSink::new(&config, &[]).await.unwrap_err().to_string();
    assert!(
        text.contains("valid placeholders are {resource}, {tenant}"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_stopped_by_a_fatal_error_is_replaced_and_nothing_is_lost() {
    let (_cluster, bootstrap) = mock_cluster(1, &["voucher_cdc.vouchers"]);
    let sink = KafkaSink::new(&sink_config(&bootstrap), &[VOUCHERS])
        .await
        .unwrap();
    let before = sample_events(VOUCHERS, 1, 20, Op::Create, 200);
    assert!(all_ok(&sink.publish(&before).await));

    // librdkafka's own fault injection: the idempotent producer is now dead.
    sink.inject_fatal_error("injected by the test");
    let after = sample_events(VOUCHERS, 100, 20, Op::Update, 200);
    retry_until_acked(&sink, after.clone(), Duration::from_secs(20)).await;
    sink.flush().await.unwrap();

    let mut all = before.clone();
    all.extend(after);
    let records = tokio::task::spawn_blocking(move || {
        consume_all(
            &bootstrap,
            &["voucher_cdc.vouchers"],
            3,
            40,
            Duration::from_secs(20),
        )
    })
    .await
    .unwrap();
    assert_each_read_back_once(&all, &records);
}
