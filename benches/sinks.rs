//! Throughput of the broker sinks: 1 KB events published and acknowledged,
//! in batches of 1000 per `publish` call, to a JetStream stream with file
//! storage (its own `nats-server -js`) and to rdkafka's MockCluster.
//!
//! Targets: at least 20,000 events/s to NATS, 50,000 events/s to the MockCluster.
//! Run: `cargo bench --bench sinks` (criterion prints `thrpt` in elements/s).

#[path = "../tests/common/brokers.rs"]
#[allow(dead_code)]
mod brokers;
#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use rdkafka::mocking::MockCluster;
use voucher_cdc::event::{Event, Op};
use voucher_cdc::sinks::kafka::{KafkaSink, KafkaSinkConfig};
use voucher_cdc::sinks::nats::{NatsSink, NatsSinkConfig};
use voucher_cdc::sinks::Sink;
use voucher_cdc::stream::{Resource, StreamKey};

const BATCH: usize = 1000;
const EVENT_BYTES: usize = 1024;

/// A batch of distinct events (fresh ids, so the broker stores every one).
fn batch(template: &Event, next_id: &AtomicU64) -> Vec<Event> {
    (0..BATCH)
        .map(|_| {
            let n = next_id.fetch_add(1, Ordering::Relaxed);
            Event {
                id: format!("{n:032x}"),
                partition_key: format!("42:voucher:{n}"),
                ..template.clone()
            }
        })
        .collect()
}

fn assert_all_acked(acks: &[voucher_cdc::sinks::Ack]) {
    if let Some(Err(e)) = acks.iter().find(|a| a.is_err()) {
        panic!("publish failed during the benchmark: {e}");
    }
}

fn sinks(c: &mut Criterion) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let stream = StreamKey::new(42, Resource::Vouchers);
    let template = brokers::sample_event(stream, 1, Op::Update, EVENT_BYTES);
    let next_id = AtomicU64::new(1);

    let mut group = c.benchmark_group("sinks");
    group
        .throughput(Throughput::Elements(BATCH as u64))
        .sample_size(20)
        .measurement_time(Duration::from_secs(10));

    if let Some(server) = brokers::spawn_nats() {
        let config = NatsSinkConfig {
            url: server.url(),
            ..NatsSinkConfig::default()
        };
        let sink = runtime.block_on(NatsSink::connect(&config)).unwrap();
        group.bench_function("nats_jetstream_file_1kb_x1000", |b| {
            b.to_async(&runtime).iter_batched(
                || batch(&template, &next_id),
                |events| {
                    let sink = &sink;
                    async move { assert_all_acked(&sink.publish(&events).await) }
                },
                BatchSize::PerIteration,
            )
        });
    }

    let cluster = MockCluster::new(1).unwrap();
    cluster.create_topic("voucher_cdc.vouchers", 3, 1).unwrap();
    let config = KafkaSinkConfig::new(cluster.bootstrap_servers());
    let sink = runtime
        .block_on(KafkaSink::new(&config, &[stream]))
        .unwrap();
    group.bench_function("kafka_mockcluster_1kb_x1000", |b| {
        b.to_async(&runtime).iter_batched(
            || batch(&template, &next_id),
            |events| {
                let sink = &sink;
                async move { assert_all_acked(&sink.publish(&events).await) }
            },
            BatchSize::PerIteration,
        )
    });
    group.finish();
}

criterion_group!(benches, sinks);
criterion_main!(benches);
