//! The NATS JetStream sink against a real `nats-server -js` that each test
//! starts on a free port with its own store: subjects, headers, bodies,
//! deduplication by `Nats-Msg-Id`, stream conflicts, and a server killed in
//! the middle of a batch.

#[path = "common/brokers.rs"]
#[allow(dead_code)]
mod brokers;
mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use async_nats::header::NATS_MESSAGE_ID;
use async_nats::jetstream::stream::{Config as StreamConfig, StorageType};
use voucher_cdc::event::{Event, Op};
use voucher_cdc::sinks::nats::{NatsSink, NatsSinkConfig, NatsSinkError};
use voucher_cdc::sinks::{Sink, SinkError};
use voucher_cdc::stream::{Resource, StreamKey};

use brokers::{
    retry_until_acked, sample_events, spawn_nats, update_with_version, NatsAckGate, NatsServer,
};

fn sink_config(server: &NatsServer) -> NatsSinkConfig {
    NatsSinkConfig {
        url: server.url(),
        publish_timeout: Duration::from_secs(1),
        connect_timeout: Duration::from_secs(5),
        ..NatsSinkConfig::default()
    }
}

async fn jetstream(server: &NatsServer) -> async_nats::jetstream::Context {
    let client = async_nats::connect(server.url()).await.unwrap();
    async_nats::jetstream::new(client)
}

async fn stream_message_count(server: &NatsServer, stream: &str) -> u64 {
    let js = jetstream(server).await;
    let mut stream = js.get_stream(stream).await.unwrap();
    stream.info().await.unwrap().state.messages
}

/// Every message of the stream as (subject, Nats-Msg-Id), in stream order.
async fn stored_messages(server: &NatsServer, stream: &str) -> Vec<(String, String)> {
    brokers::stored_messages(&server.url(), stream)
        .await
        .into_iter()
        .map(|m| (m.subject, m.msg_id))
        .collect()
}

fn ids(events: &[Event]) -> BTreeSet<String> {
    events.iter().map(|e| e.id.clone()).collect()
}

/// The `Nats-Msg-Id` of every message the stream holds.
async fn stored_ids(server: &NatsServer, stream: &str) -> BTreeSet<String> {
    stored_messages(server, stream)
        .await
        .into_iter()
        .map(|(_, id)| id)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_land_on_tenant_and_type_subjects_with_msg_id_content_type_ce_headers_and_the_event_body(
) {
    let Some(server) = spawn_nats() else { return };
    let sink = NatsSink::connect(&sink_config(&server)).await.unwrap();

    let mut events = sample_events(
        StreamKey::new(42, Resource::Vouchers),
        1,
        3,
        Op::Update,
        300,
    );
    events.extend(sample_events(
        StreamKey::new(7, Resource::Categories),
        9,
        2,
        Op::Delete,
        0,
    ));
    // An update with `changedfields` (after `data` in the body) and `before`.
    events.push(update_with_version(
        StreamKey::new(42, Resource::Vouchers),
        70,
    ));
    let acks = sink.publish(&events).await;
    assert!(acks.iter().all(Result::is_ok), "{acks:?}");

    // What the stream stored is what consumers read: fetch every message back.
    let js = jetstream(&server).await;
    let stored = js.get_stream("VOUCHER_CDC").await.unwrap();
    let mut received = Vec::new();
    for seq in 1..=events.len() as u64 {
        received.push(stored.get_raw_message(seq).await.unwrap());
    }
    assert!(
        stored
            .get_raw_message(events.len() as u64 + 1)
            .await
            .is_err(),
        "one message per event"
    );
    received.sort_by_key(|m| m.headers.get(NATS_MESSAGE_ID).unwrap().as_str().to_string());
    let mut expected: Vec<&Event> = events.iter().collect();
    expected.sort_by_key(|e| e.id.clone());
    for (message, event) in received.iter().zip(expected) {
        let headers = &message.headers;
        assert_eq!(headers.get(NATS_MESSAGE_ID).unwrap().as_str(), event.id);
        assert_eq!(
            headers.get("Content-Type").unwrap().as_str(),
            "application/cloudevents+json"
        );
        assert_eq!(message.payload, event.payload);
        // The routing attributes as `ce-` headers (CloudEvents NATS binding).
        let doc: serde_json::Value = serde_json::from_slice(&event.payload).unwrap();
        for name in ["id", "type", "source", "subject", "specversion", "op"] {
            assert_eq!(
                headers
                    .get(format!("ce-{name}").as_str())
                    .map(|v| v.as_str()),
                doc[name].as_str(),
                "ce-{name}"
            );
        }
        let tenant = event.stream.tenant.to_string();
        assert_eq!(
            headers.get("ce-tenant").map(|v| v.as_str()),
            Some(tenant.as_str())
        );
        assert_eq!(
            headers.get("ce-changedfields").map(|v| v.as_str()),
            doc["changedfields"].as_str(),
            "ce-changedfields of {}",
            event.id
        );
        let subject = message.subject.as_str();
        if event.stream.tenant == 42 {
            assert_eq!(subject, "voucher_cdc.42.voucher.updated");
        } else {
            assert_eq!(subject, "voucher_cdc.7.category.deleted");
        }
    }

    // Read back from the stream itself: all stored, file storage, our window.
    let stored = stored_messages(&server, "VOUCHER_CDC").await;
    assert_eq!(stored.len(), events.len());
    assert_eq!(
        stored
            .iter()
            .map(|(_, id)| id.clone())
            .collect::<BTreeSet<_>>(),
        ids(&events)
    );
    let js = jetstream(&server).await;
    let info = js.get_stream("VOUCHER_CDC").await.unwrap();
    let config = &info.cached_info().config;
    assert_eq!(config.subjects, vec!["voucher_cdc.>".to_string()]);
    assert_eq!(config.storage, StorageType::File);
    assert_eq!(config.duplicate_window, Duration::from_secs(600));
    assert!(sink.health().await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn republishing_the_same_events_is_acked_and_deduplicated_by_msg_id() {
    let Some(server) = spawn_nats() else { return };
    let sink = NatsSink::connect(&sink_config(&server)).await.unwrap();
    let events = sample_events(
        StreamKey::new(1, Resource::Vouchers),
        1,
        50,
        Op::Snapshot,
        200,
    );

    assert!(sink.publish(&events).await.iter().all(Result::is_ok));
    assert_eq!(stream_message_count(&server, "VOUCHER_CDC").await, 50);

    // A crash-and-retry re-publishes the same ids: acked (duplicate), not stored again.
    let again = sink.publish(&events).await;
    assert!(again.iter().all(Result::is_ok), "{again:?}");
    assert_eq!(stream_message_count(&server, "VOUCHER_CDC").await, 50);

    let later = sample_events(
        StreamKey::new(1, Resource::Vouchers),
        51,
        5,
        Op::Create,
        200,
    );
    assert!(sink.publish(&later).await.iter().all(Result::is_ok));
    assert_eq!(stream_message_count(&server, "VOUCHER_CDC").await, 55);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_stream_is_updated_in_place_keeping_operator_limits() {
    let Some(server) = spawn_nats() else { return };
    let js = jetstream(&server).await;
    js.create_stream(StreamConfig {
        name: "VOUCHER_CDC".to_string(),
        subjects: vec!["legacy.>".to_string()],
        max_age: Duration::from_secs(3600),
        duplicate_window: Duration::from_secs(30),
        ..Default::default()
    })
    .await
    .unwrap();

    let sink = NatsSink::connect(&sink_config(&server)).await.unwrap();
    let info = js.get_stream("VOUCHER_CDC").await.unwrap();
    let config = &info.cached_info().config;
    assert_eq!(
        config.subjects,
        vec!["legacy.>".to_string(), "voucher_cdc.>".to_string()]
    );
    assert_eq!(config.max_age, Duration::from_secs(3600));
    assert_eq!(config.duplicate_window, Duration::from_secs(600));
    let events = sample_events(StreamKey::new(3, Resource::Vouchers), 1, 3, Op::Create, 0);
    assert!(sink.publish(&events).await.iter().all(Result::is_ok));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicting_streams_are_reported_with_the_cause() {
    let Some(server) = spawn_nats() else { return };
    let js = jetstream(&server).await;
    js.create_stream(StreamConfig {
        name: "OTHER".to_string(),
        subjects: vec!["voucher_cdc.>".to_string()],
        ..Default::default()
    })
    .await
    .unwrap();
    let err = NatsSink::connect(&sink_config(&server)).await.unwrap_err();
    assert!(matches!(err, NatsSinkError::Stream { .. }), "{err}");
    let text = err.to_string();
    assert!(text.starts_with("nats stream `VOUCHER_CDC`:"), "{text}");
    assert!(text.contains("overlap"), "{text}");
    assert!(text.contains("OTHER"), "{text}");

    js.create_stream(StreamConfig {
        name: "IN_MEMORY".to_string(),
        subjects: vec!["mem.>".to_string()],
        storage: StorageType::Memory,
        ..Default::default()
    })
    .await
    .unwrap();
    let config = NatsSinkConfig {
        stream: "IN_MEMORY".to_string(),
        subject_prefix: "mem".to_string(),
        ..sink_config(&server)
    };
    let text = NatsSink::connect(&config).await.unwrap_err().to_string();
    assert!(text.contains("memory storage"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starting_without_a_reachable_server_fails_clearly_after_connect_timeout() {
    let config = NatsSinkConfig {
        url: format!("nats://127.0.0.1:{}", common::free_port()),
        connect_timeout: Duration::from_secs(1),
        ..NatsSinkConfig::default()
    };
    let started = std::time::Instant::now();
    let err = NatsSink::connect(&config).await.unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(10));
    let text = err.to_string();
    assert!(
        text.starts_with(&format!("nats: cannot connect to {}", config.url)),
        "{text}"
    );
    assert!(text.contains("connect_timeout"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_batch_fails_publishes_as_retriable_and_a_retry_after_restart_loses_nothing(
) {
    let Some(mut server) = spawn_nats() else {
        return;
    };
    // The sink talks to the server through a relay that holds the server's
    // replies after an exact number of PubAcks: the kill lands mid-batch by
    // construction, not by how fast this machine happens to be.
    let gate = NatsAckGate::start(&server).await;
    let sink = std::sync::Arc::new(
        NatsSink::connect(&NatsSinkConfig {
            url: gate.url(),
            ..sink_config(&server)
        })
        .await
        .unwrap(),
    );
    let stream = StreamKey::new(5, Resource::Vouchers);
    let batch = sample_events(stream, 1, 20_000, Op::Snapshot, 1024);

    // Publish a large batch; after 500 acks reached the sink, nothing more
    // does, and the server is killed.
    const ACKS_BEFORE_KILL: usize = 500;
    gate.hold_after(ACKS_BEFORE_KILL);
    let publishing = {
        let sink = sink.clone();
        let batch = batch.clone();
        tokio::spawn(async move { sink.publish(&batch).await })
    };
    gate.held(Duration::from_secs(60)).await;
    server.kill();
    let acks = publishing.await.unwrap();
    let acked = acks.iter().filter(|a| a.is_ok()).count();
    let failed: Vec<&SinkError> = acks.iter().filter_map(|a| a.as_ref().err()).collect();
    eprintln!("killed mid-batch: {acked} acked, {} failed", failed.len());
    // No event is acked without its PubAck: at most the 500 let through.
    assert!(
        (1..=ACKS_BEFORE_KILL).contains(&acked),
        "acked {acked} with {ACKS_BEFORE_KILL} PubAcks delivered"
    );
    assert_eq!(acked + failed.len(), batch.len());
    assert!(failed.iter().all(|e| e.is_retriable()), "{:?}", failed[0]);

    // While the server is down every publish fails as retriable.
    let while_down = sample_events(stream, 30_001, 10, Op::Create, 1024);
    let down_acks = sink.publish(&while_down).await;
    assert!(
        down_acks
            .iter()
            .all(|a| matches!(a, Err(SinkError::Retriable(_)))),
        "{down_acks:?}"
    );
    assert!(sink.health().await.is_err());

    // Back on the same port and store: retry what failed until it is acked.
    server.restart();
    let pending: Vec<Event> = batch
        .iter()
        .zip(&acks)
        .filter(|(_, a)| a.is_err())
        .map(|(e, _)| e.clone())
        .chain(while_down.iter().cloned())
        .collect();
    let attempts = retry_until_acked(sink.as_ref(), pending, Duration::from_secs(60)).await;
    eprintln!("acked after restart in {attempts} attempt(s)");

    // Nothing lost, nothing stored twice.
    let stored = stored_messages(&server, "VOUCHER_CDC").await;
    let mut expected = ids(&batch);
    expected.extend(ids(&while_down));
    let stored_ids: BTreeSet<String> = stored.iter().map(|(_, id)| id.clone()).collect();
    let lost = expected.difference(&stored_ids).count();
    let foreign = stored_ids.difference(&expected).count();
    assert_eq!((lost, foreign), (0, 0), "events lost / not ours");
    assert_eq!(stored.len(), expected.len(), "some events are stored twice");
    assert!(sink.health().await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_deleted_at_run_time_is_created_again_and_the_retry_lands() {
    let Some(server) = spawn_nats() else { return };
    let config = sink_config(&server);
    let sink = NatsSink::connect(&config).await.unwrap();
    let events = sample_events(StreamKey::new(7, Resource::Vouchers), 1, 3, Op::Update, 64);

    jetstream(&server)
        .await
        .delete_stream(&config.stream)
        .await
        .unwrap();
    let acks = sink.publish(&events).await;
    assert!(
        acks.iter()
            .all(|a| matches!(a, Err(SinkError::Retriable(m)) if m.contains("no stream listens"))),
        "{acks:?}"
    );

    // The sink created the stream again: the sweep's retry is acknowledged.
    let attempts = retry_until_acked(&sink, events.clone(), Duration::from_secs(10)).await;
    assert_eq!(attempts, 1, "the first retry must land");
    assert_eq!(stored_ids(&server, &config.stream).await, ids(&events));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_larger_than_the_streams_max_msg_size_is_rejected_alone_and_the_rest_land() {
    let Some(server) = spawn_nats() else { return };
    let js = jetstream(&server).await;
    // An operator's limit on the stream (kept when the sink updates it), far
    // below the server's max_payload: only JetStream can refuse these.
    js.create_stream(StreamConfig {
        name: "VOUCHER_CDC".to_string(),
        subjects: vec!["voucher_cdc.>".to_string()],
        max_message_size: 6_000,
        ..Default::default()
    })
    .await
    .unwrap();
    // Not a test of timeouts: a slow machine's late PubAck must not fail it.
    let sink = NatsSink::connect(&NatsSinkConfig {
        publish_timeout: Duration::from_secs(30),
        ..sink_config(&server)
    })
    .await
    .unwrap();
    let stream = StreamKey::new(4, Resource::Vouchers);
    let mut events = sample_events(stream, 1, 5, Op::Update, 512);
    let large = sample_events(stream, 100, 1, Op::Update, 20_000);
    events.insert(2, large[0].clone());

    let acks = sink.publish(&events).await;
    for (index, ack) in acks.iter().enumerate() {
        if index == 2 {
            assert!(
                matches!(ack, Err(SinkError::Rejected { reason, .. }) if reason.contains("10054")),
                "{ack:?}"
            );
        } else {
            assert!(ack.is_ok(), "event {index}: {ack:?}");
        }
    }
    let mut expected = ids(&events);
    expected.remove(&large[0].id);
    let stored = stored_ids(&server, "VOUCHER_CDC").await;
    assert_eq!(stored, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_whose_ack_never_comes_fails_as_retriable_after_publish_timeout_and_only_acked_events_are_ok(
) {
    let Some(server) = spawn_nats() else { return };
    let gate = NatsAckGate::start(&server).await;
    let sink = NatsSink::connect(&NatsSinkConfig {
        url: gate.url(),
        ..sink_config(&server)
    })
    .await
    .unwrap();
    let events = sample_events(
        StreamKey::new(6, Resource::Vouchers),
        1,
        200,
        Op::Create,
        256,
    );

    // The server stores every event, but only 37 PubAcks reach the sink.
    gate.hold_after(37);
    let started = std::time::Instant::now();
    let acks = sink.publish(&events).await;
    let waited = started.elapsed();
    let acked: Vec<usize> = (0..acks.len()).filter(|&i| acks[i].is_ok()).collect();
    assert_eq!(
        acked.len(),
        37,
        "only events whose PubAck arrived are acked"
    );
    assert!(
        acks.iter().all(|a| match a {
            Ok(()) => true,
            Err(SinkError::Retriable(m)) =>
                m.contains("no ack for `voucher_cdc.6.voucher.updated` within 1s"),
            Err(_) => false,
        }),
        "{:?}",
        acks.iter().find(|a| a.is_err())
    );
    assert!(
        waited >= Duration::from_secs(1) && waited < Duration::from_secs(30),
        "the unanswered publishes fail after publish_timeout, not earlier or never: {waited:?}"
    );
    assert_eq!(stream_message_count(&server, "VOUCHER_CDC").await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_sharing_a_small_in_flight_limit_all_land_without_waiting_on_each_other()
{
    let Some(server) = spawn_nats() else { return };
    let sink = std::sync::Arc::new(
        NatsSink::connect(&NatsSinkConfig {
            max_in_flight: 4,
            publish_timeout: Duration::from_secs(30),
            ..sink_config(&server)
        })
        .await
        .unwrap(),
    );
    // Three batches at once, each needing more permits than the sink has:
    // a batch holding permits must free them by reading its own acks rather
    // than wait for the others'.
    let batches: Vec<Vec<Event>> = (0..3)
        .map(|tenant| {
            sample_events(
                StreamKey::new(10 + tenant, Resource::Vouchers),
                1,
                300,
                Op::Create,
                128,
            )
        })
        .collect();
    let publishing: Vec<_> = batches
        .iter()
        .cloned()
        .map(|batch| {
            let sink = sink.clone();
            tokio::spawn(async move { sink.publish(&batch).await })
        })
        .collect();
    let all = futures::future::join_all(publishing);
    let results = tokio::time::timeout(Duration::from_secs(60), all)
        .await
        .expect("batches sharing max_in_flight must not wait on each other");
    for result in results {
        let acks = result.unwrap();
        assert!(
            acks.iter().all(Result::is_ok),
            "{:?}",
            acks.iter().find(|a| a.is_err())
        );
    }
    let expected: BTreeSet<String> = batches.iter().flat_map(|b| ids(b)).collect();
    let stored = stored_ids(&server, "VOUCHER_CDC").await;
    assert_eq!(stored, expected);
}
