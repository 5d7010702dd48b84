//! The whole pipeline for one tenant: simulator -> sweep -> a real broker ->
//! a consumer, checking every record arrives exactly as the API returned it.
//! NATS: a `nats-server -js` the test starts (and kills mid-sweep); Kafka: a
//! tansu broker process.

mod common;

#[path = "common/brokers.rs"]
#[allow(dead_code)]
mod brokers;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::sweeps::SweeperBuilder;
use futures::StreamExt;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use voucher_cdc::simulator::Simulator;
use voucher_cdc::sinks::kafka::{KafkaSink, KafkaSinkConfig};
use voucher_cdc::sinks::nats::{NatsSink, NatsSinkConfig};
use voucher_cdc::sinks::Sink;
use voucher_cdc::state::SledStore;
use voucher_cdc::state::StateStore;
use voucher_cdc::stream::{Resource, StreamKey};
use voucher_cdc::sweep::{SweepKind, Sweeper};

const TENANT: u64 = 1;

/// A sink that counts the events its inner sink failed to acknowledge.
struct CountingFailures {
    inner: Arc<dyn Sink>,
    failed: Arc<AtomicUsize>,
}

#[async_trait::async_trait]
impl Sink for CountingFailures {
    fn name(&self) -> &str {
        self.inner.name()
    }

    async fn publish(&self, events: &[voucher_cdc::event::Event]) -> Vec<voucher_cdc::sinks::Ack> {
        let acks = self.inner.publish(events).await;
        let failed = acks.iter().filter(|a| a.is_err()).count();
        self.failed.fetch_add(failed, Ordering::SeqCst);
        acks
    }

    async fn health(&self) -> Result<(), voucher_cdc::sinks::SinkError> {
        self.inner.health().await
    }

    async fn flush(&self) -> Result<(), voucher_cdc::sinks::SinkError> {
        self.inner.flush().await
    }
}

fn sweeper(
    sim: &Simulator,
    store: Arc<dyn StateStore>,
    sink: Arc<dyn Sink>,
    resource: Resource,
) -> Sweeper {
    sweeper_builder(sim, store, sink, resource).build()
}

/// The builder of [`sweeper`], for a test that changes more settings.
fn sweeper_builder(
    sim: &Simulator,
    store: Arc<dyn StateStore>,
    sink: Arc<dyn Sink>,
    resource: Resource,
) -> SweeperBuilder {
    SweeperBuilder::new(sim, StreamKey::new(TENANT, resource))
        .with_store(store)
        .with_sink(sink)
        .configure(|settings| {
            settings.sink_backoff_initial = Duration::from_millis(50);
            settings.sink_backoff_max = Duration::from_millis(500);
        })
}

/// The bytes the API returns for every record of `resource`, by id.
fn api_bytes(sim: &Simulator, resource: Resource) -> BTreeMap<i64, String> {
    sim.record_ids(TENANT, resource)
        .into_iter()
        .map(|id| (id, sim.record_json(TENANT, resource, id, true).unwrap()))
        .collect()
}

/// Every record of `expected` arrived (at least once), each time with `data`
/// equal to the API's bytes, and no other record of `resource` did.
fn assert_every_record_arrived_verbatim(
    expected: &BTreeMap<i64, String>,
    resource: Resource,
    payloads: &[Vec<u8>],
) {
    let mut by_subject: BTreeMap<i64, Vec<&[u8]>> = BTreeMap::new();
    for p in payloads {
        let v: Value = serde_json::from_slice(p).unwrap();
        if v["type"] != format!("{}.updated", resource.singular()) {
            continue;
        }
        by_subject
            .entry(v["subject"].as_str().unwrap().parse().unwrap())
            .or_default()
            .push(p);
    }
    assert_eq!(
        by_subject.keys().copied().collect::<BTreeSet<_>>(),
        expected.keys().copied().collect::<BTreeSet<_>>()
    );
    for (id, payloads) in by_subject {
        let raw = &expected[&id];
        for p in payloads {
            let text = std::str::from_utf8(p).unwrap();
            assert!(
                text.contains(&format!("\"data\":{raw}")),
                "record {id} altered in transit"
            );
        }
    }
}

async fn read_stream(
    url: &str,
    stream: &str,
    expected: usize,
) -> Vec<(String, Option<String>, Vec<u8>)> {
    let client = async_nats::connect(url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let stream = js.get_stream(stream).await.unwrap();
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            deliver_policy: async_nats::jetstream::consumer::DeliverPolicy::All,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut messages = consumer
        .fetch()
        .max_messages(expected + 10)
        .expires(Duration::from_secs(2))
        .messages()
        .await
        .unwrap();
    let mut out = Vec::new();
    while let Some(Ok(m)) = messages.next().await {
        let msg_id = m
            .headers
            .as_ref()
            .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
            .map(|v| v.as_str().to_string());
        out.push((m.subject.to_string(), msg_id, m.payload.to_vec()));
    }
    out
}

#[tokio::test]
async fn every_record_reaches_nats_jetstream_exactly_as_the_api_returned_it() {
    let Some(nats) = brokers::spawn_nats() else {
        return;
    };
    let sim = common::spawn_catalog(1, 130, 12).await;
    let (_dir, store, sink) = brokers::store_and_nats_sink(&nats.url()).await;
    for resource in Resource::ALL {
        let report = sweeper(&sim, store.clone(), sink.clone(), resource)
            .run(SweepKind::Incremental, &CancellationToken::new())
            .await
            .unwrap();
        assert_eq!(
            report.snapshots as usize,
            sim.record_ids(TENANT, resource).len()
        );
    }
    let messages = read_stream(&nats.url(), "VOUCHER_CDC", 142).await;
    assert_eq!(messages.len(), 142);
    for (subject, msg_id, payload) in &messages {
        let v: Value = serde_json::from_slice(payload).unwrap();
        assert_eq!(
            subject,
            &format!("voucher_cdc.{TENANT}.{}", v["type"].as_str().unwrap())
        );
        assert_eq!(msg_id.as_deref(), v["id"].as_str());
    }
    let payloads: Vec<Vec<u8>> = messages.into_iter().map(|m| m.2).collect();
    assert_every_record_arrived_verbatim(
        &api_bytes(&sim, Resource::Vouchers),
        Resource::Vouchers,
        &payloads,
    );
    assert_every_record_arrived_verbatim(
        &api_bytes(&sim, Resource::Categories),
        Resource::Categories,
        &payloads,
    );
}

#[tokio::test]
async fn a_nats_server_killed_mid_sweep_and_restarted_loses_nothing() {
    let Some(nats) = brokers::spawn_nats() else {
        return;
    };
    let nats = Arc::new(Mutex::new(nats));
    let url = nats.lock().unwrap().url();
    let sim = common::spawn_catalog(1, 400, 1).await;
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn StateStore> = Arc::new(SledStore::open(&dir.path().join("state")).unwrap());
    let sink: Arc<dyn Sink> = Arc::new(
        NatsSink::connect(&NatsSinkConfig {
            url: url.clone(),
            publish_timeout: Duration::from_secs(2),
            ..NatsSinkConfig::default()
        })
        .await
        .unwrap(),
    );
    let failed = Arc::new(AtomicUsize::new(0));
    let sink: Arc<dyn Sink> = Arc::new(CountingFailures {
        inner: sink,
        failed: failed.clone(),
    });
    // Page by page: a group could take the second page with the rest.
    let sweeper = sweeper_builder(&sim, store.clone(), sink, Resource::Vouchers)
        .configure(|settings| settings.max_group_pages = 1)
        .build();
    // After the second committed page, the server dies; it comes back once the
    // sweep's publishes have failed against it (the outage was hit, for sure).
    let killed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sweeper = {
        let nats = nats.clone();
        let killed = killed.clone();
        let failed = failed.clone();
        sweeper.with_progress(Arc::new(move |_, _, pages| {
            if pages == 2 && !killed.swap(true, Ordering::SeqCst) {
                nats.lock().unwrap().kill();
                let nats = nats.clone();
                let failed = failed.clone();
                std::thread::spawn(move || {
                    let deadline = std::time::Instant::now() + Duration::from_secs(60);
                    while failed.load(Ordering::SeqCst) == 0 && std::time::Instant::now() < deadline
                    {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    nats.lock().unwrap().restart();
                });
            }
        }))
    };
    let report = tokio::time::timeout(
        Duration::from_secs(60),
        sweeper.run(SweepKind::Incremental, &CancellationToken::new()),
    )
    .await
    .expect("the sweep completes once the server is back")
    .unwrap();
    assert!(killed.load(Ordering::SeqCst));
    assert!(
        failed.load(Ordering::SeqCst) > 0,
        "no publish failed while the server was down"
    );
    assert_eq!(report.snapshots, 400);
    assert_eq!(
        store
            .record_count(StreamKey::new(TENANT, Resource::Vouchers))
            .unwrap(),
        400
    );
    let messages = read_stream(&url, "VOUCHER_CDC", 400).await;
    let ids: BTreeSet<String> = messages.iter().filter_map(|m| m.1.clone()).collect();
    assert_eq!(
        ids.len(),
        messages.len(),
        "Msg-Id dedupe kept every id once"
    );
    let payloads: Vec<Vec<u8>> = messages.into_iter().map(|m| m.2).collect();
    assert_every_record_arrived_verbatim(
        &api_bytes(&sim, Resource::Vouchers),
        Resource::Vouchers,
        &payloads,
    );
}

#[tokio::test]
async fn every_record_reaches_a_real_kafka_broker_exactly_as_the_api_returned_it() {
    let Some(tansu) = brokers::spawn_tansu() else {
        return;
    };
    let sim = common::spawn_catalog(1, 120, 9).await;
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn StateStore> = Arc::new(SledStore::open(&dir.path().join("state")).unwrap());
    let streams = [
        StreamKey::new(TENANT, Resource::Vouchers),
        StreamKey::new(TENANT, Resource::Categories),
    ];
    let config = KafkaSinkConfig {
        create_topics: true,
        topic_partitions: 1,
        ..KafkaSinkConfig::new(tansu.bootstrap())
    };
    let sink: Arc<dyn Sink> = Arc::new(KafkaSink::new(&config, &streams).await.unwrap());
    for resource in Resource::ALL {
        sweeper(&sim, store.clone(), sink.clone(), resource)
            .run(SweepKind::Incremental, &CancellationToken::new())
            .await
            .unwrap();
    }
    let vouchers = api_bytes(&sim, Resource::Vouchers);
    let categories = api_bytes(&sim, Resource::Categories);
    // One delete, to see the tombstone after it.
    let gone = sim.record_ids(TENANT, Resource::Vouchers)[0];
    sim.delete(TENANT, Resource::Vouchers, gone);
    sweeper(&sim, store.clone(), sink.clone(), Resource::Vouchers)
        .run(SweepKind::Full, &CancellationToken::new())
        .await
        .unwrap();
    sink.flush().await.unwrap();

    let bootstrap = tansu.bootstrap();
    let records = tokio::task::spawn_blocking(move || {
        brokers::consume_all(
            &bootstrap,
            &["voucher_cdc.vouchers", "voucher_cdc.categories"],
            1,
            120 + 9 + 2,
            Duration::from_secs(30),
        )
    })
    .await
    .unwrap();
    let payloads: Vec<Vec<u8>> = records.iter().filter_map(|r| r.payload.clone()).collect();
    for r in records.iter().filter(|r| r.payload.is_some()) {
        let v: Value = serde_json::from_slice(r.payload.as_ref().unwrap()).unwrap();
        assert_eq!(
            r.key.as_deref(),
            v["partitionkey"].as_str().map(str::as_bytes)
        );
        assert!(r
            .headers
            .iter()
            .any(|(k, val)| k == "content-type" && val == b"application/cloudevents+json"));
    }
    let tombstones: Vec<_> = records.iter().filter(|r| r.payload.is_none()).collect();
    assert_eq!(tombstones.len(), 1);
    assert_eq!(
        tombstones[0].key.as_deref(),
        Some(format!("{TENANT}:voucher:{gone}").as_bytes())
    );
    assert_every_record_arrived_verbatim(&vouchers, Resource::Vouchers, &payloads);
    assert_every_record_arrived_verbatim(&categories, Resource::Categories, &payloads);
}
