//! Validates emitted events against the published schemas (`schemas/`): the
//! envelope (`cloudevent.schema.json`), which refers to the schema of each
//! type's `data` (`voucher`, `category`, `delete`, `replay`, `heartbeat`), so
//! tests anywhere in the suite can check that what the bridge sends is what
//! docs/events.md promises, payload included.
//!
//! Include it with `#[path = "common/schema.rs"] mod schema;` (or `mod schema;`
//! from `tests/common/mod.rs`).

#![allow(dead_code)]

use std::sync::OnceLock;

use serde_json::Value;
use voucher_cdc::schema::{DataSchema, CLOUDEVENT, SCHEMAS};

/// The base URI the validator resolves the schemas' relative `$id`s against.
const BASE: &str = "json-schema:///";

/// The parsed schema named `name` (a file under `schemas/`).
pub fn schema_named(name: &str) -> &'static Value {
    static PARSED: OnceLock<Vec<(&'static str, Value)>> = OnceLock::new();
    let parsed = PARSED.get_or_init(|| {
        SCHEMAS
            .iter()
            .map(|(file, text)| (*file, serde_json::from_str(text).expect("schema is JSON")))
            .collect()
    });
    parsed
        .iter()
        .find(|(file, _)| *file == name)
        .map(|(_, doc)| doc)
        .unwrap_or_else(|| panic!("no schema named {name}"))
}

/// The parsed envelope schema.
pub fn event_schema() -> &'static Value {
    schema_named(CLOUDEVENT)
}

/// A draft 2020-12 validator of the schema named `name`, every other
/// published schema registered so its references resolve.
pub fn validator_for(name: &str) -> jsonschema::Validator {
    // `format` asserts (date-time, uri), not only annotates.
    let mut options = jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .should_validate_formats(true);
    for (file, _) in SCHEMAS {
        if *file != name {
            options = options.with_resource(
                format!("{BASE}{file}"),
                jsonschema::Resource::from_contents(schema_named(file).clone()),
            );
        }
    }
    options
        .build(schema_named(name))
        .unwrap_or_else(|e| panic!("{name} compiles: {e}"))
}

/// The compiled validator of the event envelope (and, through it, of `data`).
pub fn event_validator() -> &'static jsonschema::Validator {
    static VALIDATOR: OnceLock<jsonschema::Validator> = OnceLock::new();
    VALIDATOR.get_or_init(|| validator_for(CLOUDEVENT))
}

fn problems_of(validator: &jsonschema::Validator, doc: &Value) -> Result<(), String> {
    let problems: Vec<String> = validator
        .iter_errors(doc)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect();
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
}

/// Checks one event JSON document; the error lists every violation with its path.
pub fn validate_event_json(event: &Value) -> Result<(), String> {
    problems_of(event_validator(), event)
}

/// Checks one record as the API lists it against the schema of its `data`.
pub fn validate_data(schema: DataSchema, record: &Value) -> Result<(), String> {
    static VALIDATORS: OnceLock<Vec<(DataSchema, jsonschema::Validator)>> = OnceLock::new();
    let validators = VALIDATORS.get_or_init(|| {
        [
            DataSchema::Voucher,
            DataSchema::Category,
            DataSchema::Delete,
            DataSchema::Replay,
            DataSchema::Heartbeat,
        ]
        .into_iter()
        .map(|s| (s, validator_for(s.file_name())))
        .collect()
    });
    let (_, validator) = validators
        .iter()
        .find(|(s, _)| *s == schema)
        .expect("every data schema has a validator");
    problems_of(validator, record)
}

/// Checks one event payload as a sink would publish it (bytes of JSON).
pub fn validate_event_payload(payload: &[u8]) -> Result<(), String> {
    let event: Value =
        serde_json::from_slice(payload).map_err(|e| format!("payload is not JSON: {e}"))?;
    validate_event_json(&event)
}

/// Panics with every violation and the event when it does not match the schemas.
pub fn assert_valid_event_json(event: &Value) {
    if let Err(problems) = validate_event_json(event) {
        panic!("event does not match schemas/{CLOUDEVENT}: {problems}\nevent: {event}");
    }
}

/// Panics with every violation and the payload when it does not match the schemas.
pub fn assert_valid_event(payload: &[u8]) {
    if let Err(problems) = validate_event_payload(payload) {
        panic!(
            "event does not match schemas/{CLOUDEVENT}: {problems}\nevent: {}",
            String::from_utf8_lossy(payload)
        );
    }
}
