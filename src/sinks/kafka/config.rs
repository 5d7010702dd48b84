//! `[sink.kafka]`: brokers, topic naming and librdkafka properties, validated
//! apart from any I/O; the topic template is parsed once here so a typo in a
//! placeholder is a config error at start, not a strange topic name later.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use crate::sinks::binding::ContentMode;

use super::{KafkaSink, KafkaSinkError};
use crate::secret::{value_or_named_file, Secret, SecretFileError};
use crate::stream::StreamKey;

/// What a secret property value looks like in `Debug` output and in [`KafkaSinkConfig::redacted`].
pub const REDACTED: &str = "<redacted>";

/// Placeholders a topic template may use.
pub const PLACEHOLDERS: [&str; 2] = ["{resource}", "{tenant}"];

/// librdkafka properties voucher-cdc sets itself, with the config key that
/// controls each. Every alias librdkafka's CONFIGURATION.md lists for one of
/// them is here too: with both set, which one wins is up to librdkafka.
const MANAGED_PROPERTIES: [(&str, &str); 7] = [
    ("bootstrap.servers", "sink.kafka.brokers"),
    ("metadata.broker.list", "sink.kafka.brokers"),
    (
        "enable.idempotence",
        "nothing: the producer is always idempotent",
    ),
    (
        "acks",
        "nothing: the producer always waits for all in-sync replicas",
    ),
    (
        "request.required.acks",
        "nothing: the producer always waits for all in-sync replicas",
    ),
    ("message.timeout.ms", "sink.kafka.message_timeout"),
    ("delivery.timeout.ms", "sink.kafka.message_timeout"),
];

/// Configuration of the Kafka sink (`[sink.kafka]`).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaSinkConfig {
    /// Bootstrap brokers, comma-separated `host:port` (required).
    pub brokers: String,
    /// Topic name per stream; `{resource}` and `{tenant}` are replaced.
    #[serde(default = "default_topic_template")]
    pub topic_template: String,
    /// Send a null-value record with the same key after every delete, for compacted topics.
    #[serde(default = "default_tombstones")]
    pub tombstones: bool,
    /// Create the topics of the configured streams at start through the admin API.
    #[serde(default = "default_create_topics")]
    pub create_topics: bool,
    /// Partition count of topics created by `create_topics`.
    #[serde(default = "default_topic_partitions")]
    pub topic_partitions: i32,
    /// Replication factor of topics created by `create_topics`.
    #[serde(default = "default_topic_replication_factor")]
    pub topic_replication_factor: i32,
    /// How long librdkafka may try to deliver one message before it counts as failed.
    #[serde(default = "default_message_timeout", with = "humantime_serde")]
    pub message_timeout: Duration,
    /// Topic of dead letters (events the broker can never accept), under
    /// `sink.on_record_error = "dead_letter"`.
    #[serde(default = "default_dead_letter_topic")]
    pub dead_letter_topic: String,
    /// Extra librdkafka properties (SASL, SSL, tuning), passed as given.
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
    /// librdkafka properties whose value is the content of a file
    /// (`"sasl.password" = "/run/secrets/kafka-password"`); a property is
    /// given here or in `properties`, not both.
    #[serde(default)]
    pub property_files: BTreeMap<String, PathBuf>,
    /// `structured` (the value is the event JSON) or `binary` (the value is
    /// `data`, every attribute a `ce_` header), per the CloudEvents Kafka binding.
    #[serde(default)]
    pub content_mode: ContentMode,
}

/// librdkafka's default `message.max.bytes`.
pub const DEFAULT_MESSAGE_MAX_BYTES: u64 = 1_000_000;

fn default_dead_letter_topic() -> String {
    "voucher_cdc.deadletter".to_string()
}

fn default_topic_template() -> String {
    "voucher_cdc.{resource}".to_string()
}

fn default_tombstones() -> bool {
    true
}

fn default_create_topics() -> bool {
    false
}

fn default_topic_partitions() -> i32 {
    3
}

fn default_topic_replication_factor() -> i32 {
    1
}

fn default_message_timeout() -> Duration {
    Duration::from_secs(30)
}

/// True for librdkafka properties whose values must not be shown.
pub fn is_secret_property(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    [
        "password",
        "secret",
        "jaas.config",
        "oauthbearer.config",
        "key.pem",
        "token",
    ]
    .iter()
    .any(|needle| key.contains(needle))
}

struct RedactedProperties<'a>(&'a BTreeMap<String, String>);

impl fmt::Debug for RedactedProperties<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.0.iter().map(|(k, v)| {
                let shown = if is_secret_property(k) {
                    REDACTED
                } else {
                    v.as_str()
                };
                (k, shown)
            }))
            .finish()
    }
}

impl fmt::Debug for KafkaSinkConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaSinkConfig")
            .field("brokers", &self.brokers)
            .field("topic_template", &self.topic_template)
            .field("tombstones", &self.tombstones)
            .field("create_topics", &self.create_topics)
            .field("topic_partitions", &self.topic_partitions)
            .field("topic_replication_factor", &self.topic_replication_factor)
            .field("message_timeout", &self.message_timeout)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .field("properties", &RedactedProperties(&self.properties))
            .field("property_files", &self.property_files)
            .field("content_mode", &self.content_mode)
            .finish()
    }
}

/// A `[sink.kafka]` value that cannot work, named by its key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("sink.kafka.{key}: {reason}")]
pub struct KafkaConfigError {
    /// The offending key below `sink.kafka`.
    pub key: String,
    /// Why the value is rejected.
    pub reason: String,
}

fn invalid(key: impl Into<String>, reason: impl Into<String>) -> KafkaConfigError {
    KafkaConfigError {
        key: key.into(),
        reason: reason.into(),
    }
}

impl KafkaSinkConfig {
    /// The defaults with the given bootstrap brokers.
    pub fn new(brokers: impl Into<String>) -> Self {
        Self {
            brokers: brokers.into(),
            topic_template: default_topic_template(),
            tombstones: default_tombstones(),
            create_topics: default_create_topics(),
            topic_partitions: default_topic_partitions(),
            topic_replication_factor: default_topic_replication_factor(),
            message_timeout: default_message_timeout(),
            dead_letter_topic: default_dead_letter_topic(),
            properties: BTreeMap::new(),
            property_files: BTreeMap::new(),
            content_mode: ContentMode::default(),
        }
    }

    /// A copy with every `property_files` entry read into `properties` (the
    /// file's content without its trailing newline) and the map cleared; an
    /// error names the property whose file is missing or empty, or that is
    /// also set in `properties`.
    pub fn with_secrets_read(&self) -> Result<Self, SecretFileError> {
        let mut properties = self.properties.clone();
        for (property, path) in &self.property_files {
            let given = properties.get(property).map(|v| Secret::new(v.clone()));
            let value = value_or_named_file(
                &format!("sink.kafka.properties.\"{property}\""),
                &format!("sink.kafka.property_files.\"{property}\""),
                given.as_ref(),
                Some(path),
            )?;
            if let Some(value) = value {
                properties.insert(property.clone(), value.expose().to_string());
            }
        }
        Ok(Self {
            properties,
            property_files: BTreeMap::new(),
            ..self.clone()
        })
    }

    /// Builds the sink: validates, creates the producer and, with
    /// `create_topics`, the missing topics of `topics_for`.
    pub async fn build(&self, topics_for: &[StreamKey]) -> Result<KafkaSink, KafkaSinkError> {
        KafkaSink::new(self, topics_for).await
    }

    /// A copy with secret property values replaced by `<redacted>`, for `check-config`.
    pub fn redacted(&self) -> Self {
        let properties = self
            .properties
            .iter()
            .map(|(k, v)| {
                let value = if is_secret_property(k) {
                    REDACTED.to_string()
                } else {
                    v.clone()
                };
                (k.clone(), value)
            })
            .collect();
        Self {
            properties,
            ..self.clone()
        }
    }

    /// The producer's `message.max.bytes` (librdkafka's default when not set
    /// or unreadable): the largest event the sink tries to send.
    pub fn message_max_bytes(&self) -> u64 {
        self.properties
            .get("message.max.bytes")
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(DEFAULT_MESSAGE_MAX_BYTES)
    }

    /// Checks every value that can be checked without a broker; returns the parsed template.
    pub fn validate(&self) -> Result<TopicTemplate, KafkaConfigError> {
        if self.brokers.split(',').all(|b| b.trim().is_empty()) {
            return Err(invalid("brokers", "no broker address given"));
        }
        let template = TopicTemplate::parse(&self.topic_template)?;
        if self.dead_letter_topic.trim().is_empty() {
            return Err(invalid("dead_letter_topic", "must not be empty"));
        }
        if self.topic_partitions < 1 {
            return Err(invalid("topic_partitions", "must be at least 1"));
        }
        if self.topic_replication_factor < 1 {
            return Err(invalid("topic_replication_factor", "must be at least 1"));
        }
        if self.message_timeout.is_zero() {
            return Err(invalid("message_timeout", "must be longer than zero"));
        }
        if i32::try_from(self.message_timeout.as_millis()).is_err() {
            return Err(invalid("message_timeout", "must be shorter than 24 days"));
        }
        for key in self.properties.keys().chain(self.property_files.keys()) {
            let name = key.trim().to_ascii_lowercase();
            if let Some((_, controlled_by)) = MANAGED_PROPERTIES.iter().find(|(p, _)| *p == name) {
                return Err(invalid(
                    format!("properties.\"{key}\""),
                    format!("is set by voucher-cdc; use {controlled_by}"),
                ));
            }
        }
        Ok(template)
    }
}

/// One piece of a parsed topic template.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Resource,
    Tenant,
}

/// A parsed `topic_template`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicTemplate {
    segments: Vec<Segment>,
}

impl TopicTemplate {
    /// Parses a template; unknown placeholders and characters Kafka forbids are errors.
    pub fn parse(template: &str) -> Result<Self, KafkaConfigError> {
        let key = "topic_template";
        let mut segments = Vec::new();
        let mut rest = template;
        while !rest.is_empty() {
            let Some(open) = rest.find('{') else {
                segments.push(Segment::Literal(rest.to_string()));
                break;
            };
            if open > 0 {
                segments.push(Segment::Literal(rest[..open].to_string()));
            }
            let Some(close) = rest[open..].find('}') else {
                return Err(invalid(
                    key,
                    format!("`{template}` has a `{{` without a closing `}}`"),
                ));
            };
            let placeholder = &rest[open..open + close + 1];
            segments.push(match placeholder {
                "{resource}" => Segment::Resource,
                "{tenant}" => Segment::Tenant,
                other => {
                    return Err(invalid(
                        key,
                        format!(
                            "unknown placeholder `{other}`: valid placeholders are {}",
                            PLACEHOLDERS.join(", ")
                        ),
                    ))
                }
            });
            rest = &rest[open + close + 1..];
        }
        for segment in &segments {
            if let Segment::Literal(text) = segment {
                if let Some(c) = text
                    .chars()
                    .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
                {
                    return Err(invalid(
                        key,
                        format!("`{template}` contains `{c}`: topic names may only contain a-z, A-Z, 0-9, `.`, `_` and `-`"),
                    ));
                }
            }
        }
        if segments.is_empty() {
            return Err(invalid(key, "must not be empty"));
        }
        Ok(Self { segments })
    }

    /// The topic of a stream.
    pub fn render(&self, stream: StreamKey) -> String {
        let mut topic = String::new();
        for segment in &self.segments {
            match segment {
                Segment::Literal(text) => topic.push_str(text),
                Segment::Resource => topic.push_str(stream.resource.as_str()),
                Segment::Tenant => topic.push_str(&stream.tenant.to_string()),
            }
        }
        topic
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::Resource;

    fn parse(toml_text: &str) -> Result<KafkaSinkConfig, toml::de::Error> {
        toml::from_str(toml_text)
    }

    #[test]
    fn only_brokers_is_required_and_the_rest_has_documented_defaults() {
        let config = parse(r#"brokers = "127.0.0.1:9092""#).unwrap();
        assert_eq!(config, KafkaSinkConfig::new("127.0.0.1:9092"));
        assert_eq!(config.topic_template, "voucher_cdc.{resource}");
        assert!(config.tombstones);
        assert!(!config.create_topics);
        assert_eq!(config.topic_partitions, 3);
        assert_eq!(config.topic_replication_factor, 1);
        assert_eq!(config.message_timeout, Duration::from_secs(30));
        config.validate().unwrap();

        let err = parse("tombstones = false").unwrap_err().to_string();
        assert!(err.contains("missing field `brokers`"), "{err}");
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let err = parse("brokers = \"b:9092\"\ntopic = \"x\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown field `topic`"), "{err}");
    }

    #[test]
    fn templates_render_resource_and_tenant() {
        let stream = StreamKey::new(42, Resource::Categories);
        let default = TopicTemplate::parse("voucher_cdc.{resource}").unwrap();
        assert_eq!(default.render(stream), "voucher_cdc.categories");
        let per_tenant = TopicTemplate::parse("cdc-{tenant}.{resource}.v1").unwrap();
        assert_eq!(per_tenant.render(stream), "cdc-42.categories.v1");
        let bare = TopicTemplate::parse("{tenant}").unwrap();
        assert_eq!(bare.render(stream), "42");
    }

    #[test]
    fn an_unknown_placeholder_is_an_error_listing_the_valid_ones() {
        let err = TopicTemplate::parse("cdc.{resources}")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "sink.kafka.topic_template: unknown placeholder `{resources}`: valid placeholders are {resource}, {tenant}"
        );
        assert!(TopicTemplate::parse("cdc.{tenant").is_err());
        assert!(TopicTemplate::parse("cdc/{tenant}").is_err());
        assert!(TopicTemplate::parse("").is_err());
    }

    #[test]
    fn secret_properties_never_show_in_debug_output_and_are_redacted_for_check_config() {
        let config = parse(
            r#"brokers = "b:9092"
[properties]
"security.protocol" = "SASL_SSL"
"sasl.username" = "bridge"
"sasl.password" = "hunter2"
"ssl.key.password" = "k3y"
"#,
        )
        .unwrap();
        let debug = format!("{config:?}");
        assert!(
            !debug.contains("hunter2") && !debug.contains("k3y"),
            "{debug}"
        );
        assert!(
            debug.contains("SASL_SSL") && debug.contains("bridge"),
            "{debug}"
        );
        let redacted = config.redacted();
        assert_eq!(redacted.properties["sasl.password"], REDACTED);
        assert_eq!(redacted.properties["ssl.key.password"], REDACTED);
        assert_eq!(redacted.properties["sasl.username"], "bridge");
        assert_eq!(config.properties["sasl.password"], "hunter2");
    }

    #[test]
    fn properties_voucher_cdc_manages_are_refused_with_the_key_to_use() {
        let mut config = KafkaSinkConfig::new("b:9092");
        config
            .properties
            .insert("enable.idempotence".to_string(), "false".to_string());
        let err = config.validate().unwrap_err().to_string();
        assert!(
            err.starts_with("sink.kafka.properties.\"enable.idempotence\""),
            "{err}"
        );

        let mut config = KafkaSinkConfig::new("b:9092");
        config
            .properties
            .insert("message.timeout.ms".to_string(), "5".to_string());
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("sink.kafka.message_timeout"), "{err}");
    }

    #[test]
    fn every_librdkafka_alias_of_a_managed_property_is_refused_too() {
        for (alias, controlled_by) in [
            ("request.required.acks", "all in-sync replicas"),
            ("delivery.timeout.ms", "sink.kafka.message_timeout"),
            ("metadata.broker.list", "sink.kafka.brokers"),
            ("bootstrap.servers", "sink.kafka.brokers"),
            (" Acks", "all in-sync replicas"),
        ] {
            let mut config = KafkaSinkConfig::new("b:9092");
            config.properties.insert(alias.to_string(), "1".to_string());
            let err = config.validate().unwrap_err().to_string();
            assert!(
                err.starts_with(&format!("sink.kafka.properties.\"{alias}\"")),
                "{err}"
            );
            assert!(err.contains(controlled_by), "{alias}: {err}");
        }
    }

    #[test]
    fn invalid_values_are_named_by_key() {
        let mut config = KafkaSinkConfig::new(" , ");
        assert!(config
            .validate()
            .unwrap_err()
            .to_string()
            .starts_with("sink.kafka.brokers"));
        config.brokers = "b:9092".to_string();
        config.topic_partitions = 0;
        assert!(config
            .validate()
            .unwrap_err()
            .to_string()
            .starts_with("sink.kafka.topic_partitions"));
    }
}
