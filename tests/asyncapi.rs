//! `schemas/asyncapi.yaml` against the code: it parses as AsyncAPI 3, every
//! reference resolves (inside the document, or to a published schema file),
//! and its channel addresses are where the sinks really publish, computed
//! with the sinks' own subject and topic naming.

use std::collections::BTreeSet;

use chrono::Utc;
use serde_json::value::RawValue;
use serde_json::Value;
use voucher_cdc::event::{
    dead_letter_event, heartbeat_event, record_event, replay_event, Event, EventType, Op,
    RecordChange, StreamPulse,
};
use voucher_cdc::hash::ContentHash;
use voucher_cdc::schema::{DEFAULT_SCHEMA_BASE, SCHEMAS};
use voucher_cdc::sinks::kafka::KafkaSinkConfig;
use voucher_cdc::sinks::nats::{subject_for, NatsSinkConfig};
use voucher_cdc::stream::{Resource, StreamKey};

const ASYNCAPI: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/schemas/asyncapi.yaml"
));

fn document() -> Value {
    serde_yaml::from_str(ASYNCAPI).expect("asyncapi.yaml is YAML")
}

/// Every `$ref` in the document, with the JSON pointer of where it sits.
fn refs(value: &Value, at: String, out: &mut Vec<(String, String)>) {
    match value {
        Value::Object(map) => {
            for (key, child) in map {
                if key == "$ref" {
                    out.push((at.clone(), child.as_str().unwrap_or_default().to_string()));
                } else {
                    refs(child, format!("{at}/{key}"), out);
                }
            }
        }
        Value::Array(items) => {
            for (i, child) in items.iter().enumerate() {
                refs(child, format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
}

/// One event of every kind the bridge publishes, for streams of tenant 42.
fn every_kind_of_event() -> Vec<Event> {
    let data = RawValue::from_string(r#"{"id":9}"#.to_string()).unwrap();
    let mut events = Vec::new();
    for resource in Resource::ALL {
        let stream = StreamKey::new(42, resource);
        for op in [Op::Snapshot, Op::Delete] {
            events.push(record_event(&RecordChange {
                stream,
                record_id: 9,
                generation: 0,
                seq: 0,
                op,
                updated_at: None,
                content_hash: ContentHash([1; 16]),
                previous_hash: Some(ContentHash([2; 16])),
                replay: None,
                data: data.get(),
                detected_at: Utc::now(),
                schema_base: &DEFAULT_SCHEMA_BASE,
            }));
        }
        for completed in [false, true] {
            events.push(replay_event(
                stream,
                "0123456789abcdef0123456789abcdef",
                None,
                completed,
                0,
                Utc::now(),
                &DEFAULT_SCHEMA_BASE,
            ));
        }
    }
    for resource in Resource::ALL {
        events.push(heartbeat_event(
            StreamKey::new(42, resource),
            StreamPulse {
                watermark: None,
                last_sweep: None,
                last_event: None,
            },
            Utc::now(),
            &DEFAULT_SCHEMA_BASE,
        ));
    }
    let letter = dead_letter_event(&events[0], "too large", Some(1)).unwrap();
    events.push(letter);
    events
}

/// True when `address` (with `{parameter}` segments) matches `concrete`.
fn address_matches(address: &str, concrete: &str) -> bool {
    let template: Vec<&str> = address.split('.').collect();
    let parts: Vec<&str> = concrete.split('.').collect();
    template.len() == parts.len()
        && template
            .iter()
            .zip(&parts)
            .all(|(t, p)| (t.starts_with('{') && t.ends_with('}')) || t == p)
}

/// The names (event types) of the messages a channel carries.
fn message_names(doc: &Value, channel: &Value) -> BTreeSet<String> {
    channel["messages"]
        .as_object()
        .unwrap()
        .values()
        .map(|m| {
            let pointer = m["$ref"].as_str().unwrap().trim_start_matches('#');
            doc.pointer(pointer).unwrap()["name"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect()
}

/// The channels of `server` whose address matches `concrete`.
fn channels_for<'a>(doc: &'a Value, server: &str, concrete: &str) -> Vec<&'a Value> {
    doc["channels"]
        .as_object()
        .unwrap()
        .values()
        .filter(|c| c["servers"][0]["$ref"] == format!("#/servers/{server}"))
        .filter(|c| address_matches(c["address"].as_str().unwrap(), concrete))
        .collect()
}

#[test]
fn the_document_parses_as_asyncapi_3_and_every_reference_resolves() {
    let doc = document();
    assert_eq!(doc["asyncapi"], "3.0.0");
    let mut found = Vec::new();
    refs(&doc, String::new(), &mut found);
    assert!(found.len() > 40, "{} references", found.len());
    let published: BTreeSet<&str> = SCHEMAS.iter().map(|(name, _)| *name).collect();
    let mut files = BTreeSet::new();
    for (at, reference) in found {
        match reference.split_once('#') {
            Some(("", pointer)) => assert!(
                doc.pointer(pointer).is_some(),
                "{at}: {reference} points at nothing"
            ),
            _ => {
                let file = reference.split('#').next().unwrap_or_default();
                assert!(
                    published.contains(file),
                    "{at}: {reference} is not a published schema"
                );
                files.insert(file.to_string());
            }
        }
    }
    assert_eq!(
        files,
        BTreeSet::from([
            "cloudevent.schema.json".into(),
            "deadletter.schema.json".into()
        ])
    );
}

#[test]
fn every_subject_the_nats_sink_publishes_to_is_a_channel_carrying_that_event_type() {
    let doc = document();
    let prefix = NatsSinkConfig::default().subject_prefix;
    for event in every_kind_of_event() {
        let subject = subject_for(&prefix, &event);
        let channels = channels_for(&doc, "nats", &subject);
        assert_eq!(channels.len(), 1, "{subject}: {} channels", channels.len());
        let names = message_names(&doc, channels[0]);
        assert_eq!(
            names,
            BTreeSet::from([event.ty.as_str().to_string()]),
            "{subject}"
        );
    }
}

#[test]
fn every_topic_the_kafka_sink_publishes_to_is_a_channel_carrying_that_event_type() {
    let doc = document();
    let config = KafkaSinkConfig::new("127.0.0.1:9092");
    let template = config.validate().unwrap();
    for event in every_kind_of_event() {
        let topic = if event.ty == EventType::DeadLetter {
            config.dead_letter_topic.clone()
        } else {
            template.render(event.stream)
        };
        let channels = channels_for(&doc, "kafka", &topic);
        assert_eq!(channels.len(), 1, "{topic}: {} channels", channels.len());
        let names = message_names(&doc, channels[0]);
        assert!(
            names.contains(event.ty.as_str()),
            "{topic} lacks {}: {names:?}",
            event.ty.as_str()
        );
    }
}

#[test]
fn every_channel_is_read_by_an_operation() {
    let doc = document();
    let operated: BTreeSet<&str> = doc["operations"]
        .as_object()
        .unwrap()
        .values()
        .map(|o| o["channel"]["$ref"].as_str().unwrap())
        .collect();
    for name in doc["channels"].as_object().unwrap().keys() {
        assert!(
            operated.contains(format!("#/channels/{name}").as_str()),
            "{name}"
        );
    }
}
