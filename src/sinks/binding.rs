//! The CloudEvents protocol bindings' side of a message: which attributes
//! travel as headers, so consumers can route and filter without parsing the
//! body, and (Kafka's binary content mode) the body that is `data` alone.
//!
//! Both brokers read the attributes back out of the structured event the
//! encoder wrote (`crate::event`), so a header can never disagree with the
//! body it travels with.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::hash::plain_run_end;
use crate::json::{skip_ws, value_end, walk_object, Visited};

/// The attributes every message carries as headers, whatever the content
/// mode: enough to route (type, tenant, op), dedupe (id) and locate (source,
/// subject) an event. `op` is absent on replay frames and heartbeats.
pub const ROUTING_ATTRIBUTES: [&str; 7] = [
    "id",
    "type",
    "source",
    "subject",
    "specversion",
    "tenant",
    "op",
];

/// Attributes also carried as headers when an event has them:
/// `changedfields` (`events.changed_fields`), so a consumer can filter updates
/// by the fields they touched without parsing the body. (`before` is not: it
/// is a whole record; binary content mode carries it like every attribute.)
pub const OPTIONAL_ROUTING_ATTRIBUTES: [&str; 1] = ["changedfields"];

/// How a Kafka record carries an event (`sink.kafka.content_mode`), per the
/// CloudEvents Kafka protocol binding.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ContentMode {
    /// The value is the whole event JSON (`content-type:
    /// application/cloudevents+json`); the routing attributes are also `ce_` headers.
    #[default]
    Structured,
    /// The value is `data` alone (`content-type: application/json`); every
    /// other attribute is a `ce_` header.
    Binary,
}

/// The attributes of one structured event, borrowed from its payload.
#[derive(Debug)]
pub struct Attributes<'a> {
    fields: BTreeMap<String, &'a RawValue>,
}

impl<'a> Attributes<'a> {
    /// Reads the top-level attributes of a structured event (its `data` stays unparsed).
    pub fn parse(payload: &'a [u8]) -> Result<Self, serde_json::Error> {
        Ok(Self {
            fields: serde_json::from_slice(payload)?,
        })
    }

    /// The routing attributes of a structured event (see [`Self::routing`]),
    /// read from the attributes before `data` alone when the payload has
    /// them there, as `crate::event` writes every event: the record in
    /// `data` is not scanned again. Inside a JSON string a quote is always
    /// escaped, so the first `,"data":` is a key; should it be a nested one,
    /// the cut text is unbalanced, fails to parse, and the whole payload is read.
    pub fn routing_of(payload: &[u8]) -> Result<Vec<(&'static str, String)>, serde_json::Error> {
        if let Some(routing) = flat_routing(payload) {
            return Ok(routing);
        }
        const DATA_KEY: &[u8] = b",\"data\":";
        if let Some(at) = payload.windows(DATA_KEY.len()).position(|w| w == DATA_KEY) {
            let mut head = Vec::with_capacity(at + 1);
            head.extend_from_slice(&payload[..at]);
            head.push(b'}');
            if let Ok(attributes) = Attributes::parse(&head) {
                return Ok(attributes.routing());
            }
        }
        Ok(Attributes::parse(payload)?.routing())
    }

    /// One attribute as header text: a JSON string unquoted, anything else
    /// (the integer `tenant`) as its canonical JSON text.
    pub fn value(&self, name: &str) -> Option<String> {
        let raw = self.fields.get(name)?;
        match serde_json::from_str::<String>(raw.get()) {
            Ok(text) => Some(text),
            Err(_) => Some(raw.get().to_string()),
        }
    }

    /// The routing attributes (and optional routing attributes) the event
    /// has, as (attribute, value).
    pub fn routing(&self) -> Vec<(&'static str, String)> {
        ROUTING_ATTRIBUTES
            .iter()
            .chain(&OPTIONAL_ROUTING_ATTRIBUTES)
            .filter_map(|name| Some((*name, self.value(name)?)))
            .collect()
    }

    /// Every attribute but `data` and `datacontenttype` (which binary mode
    /// carries as the body and the `content-type` header), in name order.
    pub fn context(&self) -> Vec<(&str, String)> {
        self.fields
            .keys()
            .filter(|name| !matches!(name.as_str(), "data" | "datacontenttype"))
            .filter_map(|name| Some((name.as_str(), self.value(name)?)))
            .collect()
    }

    /// The event's `data`, exactly as encoded.
    pub fn data(&self) -> Option<&'a RawValue> {
        self.fields.get("data").copied()
    }
}

/// The routing attributes of a structured event read by one scan of its
/// attributes up to `data` (what `crate::event` writes: strings and numbers,
/// each key once), the record in `data` never looked at; values as
/// [`Attributes::value`] gives them. None for anything else (a nested
/// value, an escaped or repeated routing key, a value serde would not
/// read), which [`Attributes::routing_of`] then reads with serde.
fn flat_routing(payload: &[u8]) -> Option<Vec<(&'static str, String)>> {
    const NAMES: [&str; 8] = [
        ROUTING_ATTRIBUTES[0],
        ROUTING_ATTRIBUTES[1],
        ROUTING_ATTRIBUTES[2],
        ROUTING_ATTRIBUTES[3],
        ROUTING_ATTRIBUTES[4],
        ROUTING_ATTRIBUTES[5],
        ROUTING_ATTRIBUTES[6],
        OPTIONAL_ROUTING_ATTRIBUTES[0],
    ];
    let mut found: [Option<String>; 8] = Default::default();
    let start = skip_ws(payload, 0);
    walk_object(payload, start, |key, pos| {
        if key == b"data" {
            return Some(Visited::Stop);
        }
        let end = match payload.get(pos)? {
            b'{' | b'[' => return None,
            _ => value_end(payload, pos)?,
        };
        if let Some(slot) = NAMES.iter().position(|name| name.as_bytes() == key) {
            if found[slot].is_some() {
                return None;
            }
            let value = std::str::from_utf8(&payload[pos..end]).ok()?;
            let inner = value
                .strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .filter(|v| plain_run_end(v.as_bytes(), 0) == v.len());
            found[slot] = Some(match inner {
                // A string without escapes or control characters is its text.
                Some(text) => text.to_string(),
                None if value.starts_with('"') => serde_json::from_str::<String>(value).ok()?,
                None => value.to_string(),
            });
        }
        Some(Visited::Until(end))
    })?;
    Some(
        NAMES
            .iter()
            .zip(found)
            .filter_map(|(name, value)| Some((*name, value?)))
            .collect(),
    )
}

/// The NATS header of an attribute (`ce-id`, `ce-type`, ...): the `ce-`
/// prefix of the CloudEvents NATS binding, before the attribute name.
pub fn nats_header(attribute: &str) -> String {
    format!("ce-{attribute}")
}

/// The Kafka header of an attribute (`ce_id`, `ce_type`, ...), per the
/// CloudEvents Kafka binding.
pub fn kafka_header(attribute: &str) -> String {
    format!("ce_{attribute}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::{Resource, StreamKey};

    #[test]
    fn routing_attributes_are_read_from_the_event_and_op_only_when_it_has_one() {
        let event = crate::sinks::testing::sample_event(StreamKey::new(42, Resource::Vouchers), 7);
        let attributes = Attributes::parse(&event.payload).unwrap();
        let routing: BTreeMap<_, _> = attributes.routing().into_iter().collect();
        assert_eq!(routing["id"], event.id);
        assert_eq!(routing["type"], "voucher.updated");
        assert_eq!(routing["source"], "/tenants/42/catalog/vouchers");
        assert_eq!(routing["subject"], "7");
        assert_eq!(routing["specversion"], "1.0");
        assert_eq!(routing["tenant"], "42");
        assert_eq!(routing["op"], "create");
        assert!(!routing.contains_key("changedfields"));
        let frame = br#"{"id":"x","type":"replay.started","tenant":1,"data":{}}"#;
        let attributes = Attributes::parse(frame).unwrap();
        assert!(attributes.routing().iter().all(|(name, _)| *name != "op"));
    }

    #[test]
    fn changed_fields_travel_as_a_routing_header_and_before_only_in_the_binary_context() {
        let update = br#"{"id":"x","type":"voucher.updated","tenant":1,"op":"update","changedfields":"price,title","before":"{\"id\":1}","data":{"id":1}}"#;
        let attributes = Attributes::parse(update).unwrap();
        let routing: BTreeMap<_, _> = attributes.routing().into_iter().collect();
        assert_eq!(routing["changedfields"], "price,title");
        assert!(!routing.contains_key("before"));
        let context: BTreeMap<_, _> = attributes.context().into_iter().collect();
        assert_eq!(context["before"], r#"{"id":1}"#);
        assert_eq!(context["changedfields"], "price,title");
    }

    #[test]
    fn the_context_is_every_attribute_but_data_and_its_content_type() {
        let payload = br#"{"specversion":"1.0","id":"a","datacontenttype":"application/json","tenant":3,"data":{"id":1,"x":"y"}}"#;
        let attributes = Attributes::parse(payload).unwrap();
        assert_eq!(
            attributes.context(),
            vec![
                ("id", "a".to_string()),
                ("specversion", "1.0".to_string()),
                ("tenant", "3".to_string())
            ]
        );
        assert_eq!(attributes.data().unwrap().get(), r#"{"id":1,"x":"y"}"#);
        assert_eq!(nats_header("type"), "ce-type");
        assert_eq!(kafka_header("type"), "ce_type");
    }

    #[test]
    fn routing_read_before_data_is_what_the_whole_event_gives() {
        for payload in [
            r#"{"specversion":"1.0","id":"ab","source":"/tenants/1/catalog/vouchers","type":"voucher.updated","subject":"7","tenant":1,"op":"create","data":{"id":7,"data":{"op":"x"}}}"#,
            // A string holding the key text, escaped, and a nested `data` before the top-level one.
            r#"{"id":"a,\"data\":","meta":{"x":1,"data":{"type":"nested"}},"type":"t","tenant":2,"data":{}}"#,
            // No data at all (a dead letter).
            r#"{"id":"dl","type":"deadletter","op":"update","tenant":3}"#,
            // Escaped routing values, `before` (a record as a string) and `changedfields`.
            r#"{ "id" : "a\u0062" , "subject":"x\"y","tenant":4,"op":null,"before":"{\"id\":1,\"data\":2}","changedfields":"price,title","data":{"id":1}}"#,
            // A repeated routing key: serde keeps the last.
            r#"{"id":"first","id":"second","type":"t","data":{}}"#,
            r#"{}"#,
        ] {
            let whole = Attributes::parse(payload.as_bytes()).unwrap().routing();
            assert_eq!(
                Attributes::routing_of(payload.as_bytes()).unwrap(),
                whole,
                "{payload}"
            );
        }
        assert!(Attributes::routing_of(b"{\"id\":").is_err());
        // What the encoder writes is read by the scan alone.
        let event = crate::sinks::testing::sample_event(StreamKey::new(42, Resource::Vouchers), 7);
        let scanned = flat_routing(&event.payload).expect("a flat head");
        assert_eq!(
            scanned,
            Attributes::parse(&event.payload).unwrap().routing()
        );
        assert!(flat_routing(br#"{"id":"a","meta":{"x":1},"data":{}}"#).is_none());
    }
}
