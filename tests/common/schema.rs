//! Validates emitted events against the published event schema
//! (`schemas/cloudevent.schema.json`), so tests anywhere in the suite can
//! check that what the bridge sends is what docs/events.md promises.
//!
//! Include it with `#[path = "common/schema.rs"] mod schema;` (or `mod schema;`
//! from `tests/common/mod.rs`).

#![allow(dead_code)]

use std::sync::OnceLock;

use serde_json::Value;

/// The event schema document, as shipped in the repository.
pub const EVENT_SCHEMA_JSON: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/schemas/cloudevent.schema.json"
));

/// The parsed event schema.
pub fn event_schema() -> &'static Value {
    static SCHEMA: OnceLock<Value> = OnceLock::new();
    SCHEMA.get_or_init(|| serde_json::from_str(EVENT_SCHEMA_JSON).expect("schema is valid JSON"))
}

/// The compiled draft 2020-12 validator of the event schema.
pub fn event_validator() -> &'static jsonschema::Validator {
    static VALIDATOR: OnceLock<jsonschema::Validator> = OnceLock::new();
    VALIDATOR.get_or_init(|| {
        jsonschema::draft202012::new(event_schema()).expect("event schema compiles")
    })
}

/// Checks one event JSON document; the error lists every violation with its path.
pub fn validate_event_json(event: &Value) -> Result<(), String> {
    let problems: Vec<String> = event_validator()
        .iter_errors(event)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect();
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
}

/// Checks one event payload as a sink would publish it (bytes of JSON).
pub fn validate_event_payload(payload: &[u8]) -> Result<(), String> {
    let event: Value =
        serde_json::from_slice(payload).map_err(|e| format!("payload is not JSON: {e}"))?;
    validate_event_json(&event)
}

/// Panics with every violation and the payload when it does not match the schema.
pub fn assert_valid_event(payload: &[u8]) {
    if let Err(problems) = validate_event_payload(payload) {
        panic!(
            "event does not match schemas/cloudevent.schema.json: {problems}\nevent: {}",
            String::from_utf8_lossy(payload)
        );
    }
}
