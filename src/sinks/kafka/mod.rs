//! The Kafka sink: an idempotent librdkafka producer (`acks=all`) that sends
//! each event to the topic of its stream, keyed by `partitionkey`, followed by
//! a null-value tombstone after every delete when `tombstones = true`.
//!
//! An event counts as acknowledged only when every record it produced (the
//! event, and its tombstone) was delivered. A full local queue is
//! backpressure: the enqueue waits and tries again. Nothing is ever dropped
//! with messages queued: `flush()` and `Drop` both wait for the queue.

pub mod classify;
pub mod config;
pub mod context;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::config::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;

pub use self::classify::Failure;
pub use self::config::{KafkaConfigError, KafkaSinkConfig, TopicTemplate};
use self::context::{BrokerErrors, SinkContext};
use crate::event::{Event, EventType};
use crate::sinks::binding::{kafka_header, Attributes, ContentMode};
use crate::sinks::metrics::record_sink_up;
use crate::sinks::{Ack, Sink, SinkError};
use crate::stream::StreamKey;

/// The sink name used in logs and metrics.
const SINK: &str = "kafka";

/// The `content-type` header every event record carries.
pub const CONTENT_TYPE: &str = "application/cloudevents+json";

/// Bytes the record headers and librdkafka's framing add to a message, for the size check.
const HEADER_OVERHEAD: usize = 128;

/// How long one metadata request of the health check may take.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the Kafka sink could not start.
#[derive(Debug, thiserror::Error)]
pub enum KafkaSinkError {
    /// A `[sink.kafka]` value is invalid.
    #[error(transparent)]
    Config(#[from] KafkaConfigError),
    /// A file of `sink.kafka.property_files` cannot be used.
    #[error(transparent)]
    Secret(#[from] crate::secret::SecretFileError),
    /// librdkafka refused the client configuration.
    #[error("kafka (brokers `{brokers}`): cannot create the client: {reason}")]
    Client {
        /// The configured brokers.
        brokers: String,
        /// What librdkafka said.
        reason: String,
    },
    /// The brokers did not answer a metadata request (`check-config --probe`).
    #[error("kafka (brokers `{brokers}`): metadata request failed: {reason}")]
    Metadata {
        /// The configured brokers.
        brokers: String,
        /// What librdkafka said, and the connection error behind it.
        reason: String,
    },
    /// `create_topics` could not create a topic.
    #[error("kafka (brokers `{brokers}`): cannot create topic `{topic}`: {reason}")]
    CreateTopic {
        /// The configured brokers.
        brokers: String,
        /// The topic that failed.
        topic: String,
        /// What the broker said.
        reason: String,
    },
}

/// The records queued for one event, and the error that stopped queueing, if any.
struct Queued {
    deliveries: Vec<DeliveryFuture>,
    error: Option<SinkError>,
    topic: String,
}

/// Publishes events to Kafka topics.
pub struct KafkaSink {
    /// The current producer; replaced when librdkafka reports a fatal error.
    producer: std::sync::RwLock<FutureProducer<SinkContext>>,
    /// Settings a replacement producer is created from.
    client_config: ClientConfig,
    /// The context of every client, recording connection errors into `errors`.
    context: SinkContext,
    /// The latest connection error (TLS, SASL, transport) since the last delivery.
    errors: Arc<BrokerErrors>,
    template: TopicTemplate,
    tombstones: bool,
    message_timeout: Duration,
    brokers: String,
    /// Topic of dead letters ([`EventType::DeadLetter`] events).
    dead_letter_topic: String,
    /// The producer's `message.max.bytes`: larger events are rejected before sending.
    message_max_bytes: u64,
    /// `sink.kafka.content_mode`.
    content_mode: ContentMode,
}

impl std::fmt::Debug for KafkaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSink")
            .field("brokers", &self.brokers)
            .field("template", &self.template)
            .field("tombstones", &self.tombstones)
            .finish_non_exhaustive()
    }
}

impl KafkaSink {
    /// Validates `config`, creates the producer and, with `create_topics`,
    /// creates the missing topics of `topics_for` through the admin API.
    pub async fn new(
        config: &KafkaSinkConfig,
        topics_for: &[StreamKey],
    ) -> Result<Self, KafkaSinkError> {
        let template = config.validate()?;
        let config = &config.with_secrets_read()?;
        let client_config = client_config(config);
        let errors = Arc::new(BrokerErrors::default());
        let context = SinkContext::new(errors.clone(), &config.brokers);
        let producer: FutureProducer<SinkContext> = client_config
            .create_with_context(context.clone())
            .map_err(|e| client_error(config, &e))?;
        if config.create_topics {
            let mut topics: BTreeSet<String> =
                topics_for.iter().map(|s| template.render(*s)).collect();
            topics.insert(config.dead_letter_topic.clone());
            create_topics(config, &client_config, &context, &topics).await?;
        }
        record_sink_up(SINK, true);
        Ok(Self {
            producer: std::sync::RwLock::new(producer),
            client_config,
            context,
            errors,
            template,
            tombstones: config.tombstones,
            message_timeout: config.message_timeout,
            brokers: config.brokers.clone(),
            dead_letter_topic: config.dead_letter_topic.clone(),
            message_max_bytes: config.message_max_bytes(),
            content_mode: config.content_mode,
        })
    }

    /// The current producer (a cheap handle).
    fn producer(&self) -> FutureProducer<SinkContext> {
        match self.producer.read() {
            Ok(guard) => guard.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// After a fatal error (an idempotent producer that lost its sequence,
    /// say) librdkafka refuses every further message: replace the producer.
    /// Events the old one never delivered were not acknowledged, so the
    /// sweep publishes them again, under the same ids.
    fn replace_producer_if_fatal(&self) {
        let current = self.producer();
        let Some((code, reason)) = current.client().fatal_error() else {
            return;
        };
        tracing::error!(sink = SINK, brokers = %self.brokers, error = %code, reason = %reason,
            "kafka producer hit a fatal error; replacing it");
        match self
            .client_config
            .create_with_context::<_, FutureProducer<SinkContext>>(self.context.clone())
        {
            Ok(fresh) => {
                let mut guard = match self.producer.write() {
                    Ok(guard) => guard,
                    Err(poisoned) => poisoned.into_inner(),
                };
                *guard = fresh;
            }
            Err(e) => tracing::error!(sink = SINK, brokers = %self.brokers, error = %e,
                "cannot create a replacement kafka producer; retrying at the next publish"),
        }
    }

    /// Triggers a librdkafka fatal error on the current producer, as a broker
    /// fencing it would. For fault-injection tests only.
    #[doc(hidden)]
    pub fn inject_fatal_error(&self, reason: &str) {
        let producer = self.producer();
        let Ok(reason) = std::ffi::CString::new(reason) else {
            return;
        };
        // SAFETY: the client pointer is valid while `producer` lives, and
        // librdkafka copies the reason string.
        unsafe {
            rdkafka::bindings::rd_kafka_test_fatal_error(
                producer.client().native_ptr(),
                rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER,
                reason.as_ptr(),
            );
        }
    }

    /// Queues one record, waiting while the local queue is full.
    async fn enqueue(
        &self,
        producer: &FutureProducer<SinkContext>,
        mut record: FutureRecord<'_, [u8], [u8]>,
    ) -> Result<DeliveryFuture, SinkError> {
        let deadline = Instant::now() + self.message_timeout;
        loop {
            match producer.send_result(record) {
                Ok(delivery) => return Ok(delivery),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), returned))
                    if Instant::now() < deadline =>
                {
                    record = returned;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((e, returned)) => return Err(self.failure(returned.topic, &e)),
            }
        }
    }

    /// Queues an event (and its tombstone).
    async fn enqueue_event(&self, producer: &FutureProducer<SinkContext>, event: &Event) -> Queued {
        let topic = if event.ty == EventType::DeadLetter {
            self.dead_letter_topic.clone()
        } else {
            self.template.render(event.stream)
        };
        let record = match record_parts(event, self.content_mode) {
            Ok(record) => record,
            Err(reason) => {
                return Queued {
                    deliveries: Vec::new(),
                    error: Some(SinkError::Rejected {
                        reason: format!("kafka: event {} for topic `{topic}`: {reason}", event.id),
                        limit: None,
                    }),
                    topic,
                }
            }
        };
        // librdkafka refuses a message over message.max.bytes (key, value and
        // headers, before compression) anyway: say so without queueing it.
        let size = record.size(event);
        if size > self.message_max_bytes {
            return Queued {
                deliveries: Vec::new(),
                error: Some(SinkError::Rejected {
                    reason: format!(
                        "kafka: event {} for topic `{topic}` is {} bytes, more than the producer's \
                         message.max.bytes of {} (set compression.type, or raise message.max.bytes \
                         and the topic's max.message.bytes)",
                        event.id,
                        event.payload.len(),
                        self.message_max_bytes
                    ),
                    limit: Some(self.message_max_bytes),
                }),
                topic,
            };
        }
        let headers = record
            .headers
            .iter()
            .fold(OwnedHeaders::new(), |headers, (key, value)| {
                headers.insert(Header {
                    key: key.as_str(),
                    value: Some(value.as_str()),
                })
            });
        let record = FutureRecord::to(&topic)
            .key(event.partition_key.as_bytes())
            .payload(record.value)
            .headers(headers);
        let mut queued = Queued {
            deliveries: Vec::with_capacity(2),
            error: None,
            topic: topic.clone(),
        };
        match self.enqueue(producer, record).await {
            Ok(delivery) => queued.deliveries.push(delivery),
            Err(e) => {
                queued.error = Some(e);
                return queued;
            }
        }
        if self.tombstones && event.is_delete() {
            let tombstone = FutureRecord::to(&topic).key(event.partition_key.as_bytes());
            match self.enqueue(producer, tombstone).await {
                Ok(delivery) => queued.deliveries.push(delivery),
                Err(e) => queued.error = Some(e),
            }
        }
        queued
    }

    fn failure(&self, topic: &str, error: &KafkaError) -> SinkError {
        let Some(code) = error.rdkafka_error_code() else {
            return SinkError::Retriable(format!(
                "kafka: delivery to topic `{topic}` (brokers `{}`) failed: {error}",
                self.brokers
            ));
        };
        // A delivery that timed out or lost its broker names no cause; the
        // connection error librdkafka reported meanwhile does. A refused
        // certificate or password is for an operator to fix: fatal.
        let cause = Some(code)
            .filter(|code| classify::is_connection_symptom(*code))
            .and_then(|_| self.errors.latest());
        if let Some(cause) = cause {
            let message = format!(
                "kafka: delivery to topic `{topic}` (brokers `{}`) failed: {code}: {}",
                self.brokers,
                cause.describe()
            );
            return if cause.is_security() {
                SinkError::Fatal(message)
            } else {
                SinkError::Retriable(message)
            };
        }
        let hint = classify::hint(code)
            .map(|h| format!(" ({h})"))
            .unwrap_or_default();
        let message = format!(
            "kafka: delivery to topic `{topic}` (brokers `{}`) failed: {code}{hint}",
            self.brokers
        );
        match classify::classify(code) {
            Failure::Retriable => SinkError::Retriable(message),
            Failure::Rejected => SinkError::Rejected {
                reason: message,
                limit: None,
            },
            Failure::Fatal => SinkError::Fatal(message),
        }
    }

    /// Awaits every delivery of an event (none is dropped unawaited); the first failure wins.
    async fn await_queued(&self, queued: Queued) -> Ack {
        let mut outcome = match queued.error {
            Some(e) => Err(e),
            None => Ok(()),
        };
        for delivery in queued.deliveries {
            let failure = match delivery.await {
                Ok(Ok(_)) => {
                    self.errors.clear();
                    continue;
                }
                Ok(Err((e, _))) => self.failure(&queued.topic, &e),
                Err(_canceled) => SinkError::Retriable(format!(
                    "kafka: delivery to topic `{}` was cancelled (producer closed)",
                    queued.topic
                )),
            };
            if outcome.is_ok() {
                outcome = Err(failure);
            }
        }
        outcome
    }

    fn flush_blocking(
        producer: &FutureProducer<SinkContext>,
        timeout: Duration,
    ) -> Result<(), KafkaError> {
        if producer.in_flight_count() == 0 {
            return Ok(());
        }
        producer.flush(timeout)
    }
}

#[async_trait]
impl Sink for KafkaSink {
    fn name(&self) -> &str {
        SINK
    }

    async fn publish(&self, events: &[Event]) -> Vec<Ack> {
        self.replace_producer_if_fatal();
        let producer = self.producer();
        // Queue everything first so librdkafka batches; then await every delivery.
        let mut queued = Vec::with_capacity(events.len());
        for event in events {
            queued.push(self.enqueue_event(&producer, event).await);
        }
        let mut acks = Vec::with_capacity(events.len());
        for queued in queued {
            acks.push(self.await_queued(queued).await);
        }
        acks
    }

    async fn health(&self) -> Result<(), SinkError> {
        let producer = self.producer();
        let outcome = tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(None, HEALTH_TIMEOUT)
                .map(drop)
        })
        .await;
        let result = match outcome {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(SinkError::Retriable(format!(
                "kafka: brokers `{}` unreachable: {e}{}",
                self.brokers,
                cause_suffix(&self.errors)
            ))),
            Err(e) => Err(SinkError::Retriable(format!(
                "kafka: health check did not finish: {e}"
            ))),
        };
        record_sink_up(SINK, result.is_ok());
        result
    }

    async fn flush(&self) -> Result<(), SinkError> {
        let producer = self.producer();
        let timeout = self.message_timeout;
        let outcome =
            tokio::task::spawn_blocking(move || Self::flush_blocking(&producer, timeout)).await;
        match outcome {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(SinkError::Retriable(format!(
                "kafka: flush to brokers `{}` failed: {e}",
                self.brokers
            ))),
            Err(e) => Err(SinkError::Retriable(format!(
                "kafka: flush did not finish: {e}"
            ))),
        }
    }
}

impl Drop for KafkaSink {
    fn drop(&mut self) {
        // librdkafka purges queued messages when the producer is destroyed:
        // wait for them first (only a cancelled publish can leave any).
        if let Err(e) = Self::flush_blocking(&self.producer(), self.message_timeout) {
            tracing::warn!(sink = SINK, error = %e, "kafka producer dropped with undelivered messages");
        }
    }
}

/// `check-config --probe`: creates a client from the config and fetches the
/// cluster's metadata (brokers and topics), producing nothing.
pub async fn probe(config: &KafkaSinkConfig, timeout: Duration) -> Result<String, KafkaSinkError> {
    config.validate()?;
    let config = config.with_secrets_read()?;
    let errors = Arc::new(BrokerErrors::default());
    let client: rdkafka::producer::BaseProducer<SinkContext> = client_config(&config)
        .create_with_context(SinkContext::new(errors.clone(), &config.brokers))
        .map_err(|e| client_error(&config, &e))?;
    let brokers = config.brokers.clone();
    let errors_seen = errors.clone();
    let metadata = tokio::task::spawn_blocking(move || {
        let metadata = client
            .client()
            .fetch_metadata(None, timeout)
            .map(|m| (m.brokers().len(), m.topics().len()));
        // A base producer runs its callbacks (the error callback that
        // records the cause) only when polled; the error may be queued
        // just after the request failed.
        if metadata.is_err() {
            let until = Instant::now() + Duration::from_secs(1);
            while errors_seen.latest().is_none() && Instant::now() < until {
                client.poll(Duration::from_millis(50));
            }
        }
        metadata
    })
    .await;
    match metadata {
        Ok(Ok((broker_count, topics))) => Ok(format!(
            "metadata from `{brokers}`: {broker_count} broker(s), {topics} topic(s)"
        )),
        Ok(Err(e)) => Err(KafkaSinkError::Metadata {
            brokers,
            reason: format!("{e}{}", cause_suffix(&errors)),
        }),
        Err(e) => Err(KafkaSinkError::Metadata {
            brokers,
            reason: format!("did not finish: {e}"),
        }),
    }
}

/// The librdkafka configuration: ours first, then the operator's extra
/// properties (read `property_files` first, see [`KafkaSinkConfig::with_secrets_read`]).
pub fn client_config(config: &KafkaSinkConfig) -> ClientConfig {
    let mut client = ClientConfig::new();
    client
        .set("bootstrap.servers", &config.brokers)
        .set("client.id", "voucher-cdc")
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set(
            "message.timeout.ms",
            config.message_timeout.as_millis().to_string(),
        );
    for (key, value) in &config.properties {
        client.set(key, value);
    }
    client
}

/// `: <the latest connection error>`, or nothing when none was reported.
fn cause_suffix(errors: &BrokerErrors) -> String {
    errors
        .latest()
        .map(|cause| format!(": {}", cause.describe()))
        .unwrap_or_default()
}

fn client_error(config: &KafkaSinkConfig, error: &KafkaError) -> KafkaSinkError {
    let reason = match error {
        KafkaError::ClientConfig(_, description, key, _value) => {
            format!("invalid property sink.kafka.properties.\"{key}\": {description}")
        }
        other => other.to_string(),
    };
    KafkaSinkError::Client {
        brokers: config.brokers.clone(),
        reason,
    }
}

/// Creates the topics; ones that already exist are fine.
async fn create_topics(
    config: &KafkaSinkConfig,
    client_config: &ClientConfig,
    context: &SinkContext,
    topics: &BTreeSet<String>,
) -> Result<(), KafkaSinkError> {
    if topics.is_empty() {
        return Ok(());
    }
    let admin: AdminClient<SinkContext> = client_config
        .create_with_context(context.clone())
        .map_err(|e| client_error(config, &e))?;
    let new_topics: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|t| {
            NewTopic::new(
                t,
                config.topic_partitions,
                TopicReplication::Fixed(config.topic_replication_factor),
            )
        })
        .collect();
    let options = AdminOptions::new()
        .request_timeout(Some(config.message_timeout))
        .operation_timeout(Some(config.message_timeout));
    let first_topic = topics.iter().next().cloned().unwrap_or_default();
    let results = admin
        .create_topics(&new_topics, &options)
        .await
        .map_err(|e| KafkaSinkError::CreateTopic {
            brokers: config.brokers.clone(),
            topic: first_topic,
            reason: format!("{e}{}", cause_suffix(context.errors())),
        })?;
    for result in results {
        match result {
            Ok(topic) => tracing::info!(sink = SINK, topic = %topic, "created kafka topic"),
            Err((topic, RDKafkaErrorCode::TopicAlreadyExists)) => {
                tracing::debug!(sink = SINK, topic = %topic, "kafka topic exists")
            }
            Err((topic, code)) => {
                return Err(KafkaSinkError::CreateTopic {
                    brokers: config.brokers.clone(),
                    topic,
                    reason: format!("{code}{}", cause_suffix(context.errors())),
                })
            }
        }
    }
    Ok(())
}
/// A Kafka record's value and headers for one event.
#[derive(Debug, PartialEq, Eq)]
pub struct RecordParts<'a> {
    /// `content-type` and the `ce_` attribute headers, in order.
    pub headers: Vec<(String, String)>,
    /// The record value: the event JSON (structured) or its `data` (binary).
    pub value: &'a [u8],
}

impl RecordParts<'_> {
    /// The bytes the sink counts for the record of `event` against
    /// `message.max.bytes`: value, key, header names and values, and framing.
    pub fn size(&self, event: &Event) -> u64 {
        let headers: usize = self.headers.iter().map(|(k, v)| k.len() + v.len()).sum();
        (self.value.len() + headers + event.partition_key.len() + HEADER_OVERHEAD) as u64
    }
}

/// How `event` goes into a record in `mode` (CloudEvents Kafka binding):
/// structured, the event JSON with `content-type: application/cloudevents+json`
/// and the routing attributes as `ce_` headers; binary, `data` alone with
/// `content-type` = `datacontenttype` and every other attribute as a `ce_`
/// header. A dead letter has no `data` and is structured in either mode.
pub fn record_parts(event: &Event, mode: ContentMode) -> Result<RecordParts<'_>, String> {
    let attributes = Attributes::parse(&event.payload)
        .map_err(|e| format!("payload is not a structured cloudevent: {e}"))?;
    let data = attributes.data();
    match (mode, data) {
        (ContentMode::Binary, Some(data)) if event.ty != EventType::DeadLetter => {
            let content_type = attributes
                .value("datacontenttype")
                .unwrap_or_else(|| "application/json".to_string());
            let headers = std::iter::once(("content-type".to_string(), content_type))
                .chain(
                    attributes
                        .context()
                        .into_iter()
                        .map(|(name, value)| (kafka_header(name), value)),
                )
                .collect();
            // `data` borrows from the payload: its bytes are a slice of it.
            Ok(RecordParts {
                headers,
                value: data.get().as_bytes(),
            })
        }
        _ => {
            let headers = std::iter::once(("content-type".to_string(), CONTENT_TYPE.to_string()))
                .chain(
                    attributes
                        .routing()
                        .into_iter()
                        .map(|(name, value)| (kafka_header(name), value)),
                )
                .collect();
            Ok(RecordParts {
                headers,
                value: &event.payload[..],
            })
        }
    }
}
