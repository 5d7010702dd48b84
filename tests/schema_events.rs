//! The published schemas in `schemas/` (documented in docs/events.md)
//! against events built by the real encoder in `voucher_cdc::event` (every
//! type and op must validate, envelopes and payloads with a broken attribute
//! must not), and against the simulator's own list responses, so the
//! simulator and the payload schemas both stay faithful to the API spec.

mod common;

use chrono::{TimeZone, Utc};
use serde_json::value::RawValue;
use serde_json::{json, Value};
use voucher_cdc::event::{
    heartbeat_event, record_event, replay_cancelled_event, replay_event, Event, Op, RecordChange,
    StreamPulse,
};
use voucher_cdc::hash::{content_hash, ContentHash, IgnoreKeys};
use voucher_cdc::schema::DEFAULT_SCHEMA_BASE;
use voucher_cdc::state::replay_id_bytes;
use voucher_cdc::stream::{Resource, StreamKey};

use common::schema::{
    assert_valid_event, event_schema, schema_named, validate_data, validate_event_json,
};
use voucher_cdc::schema::{DataSchema, SCHEMAS};

const VOUCHER: &str = r#"{"id":123,"slug":"spa-day","title":"Spa day for two","summary":null,"description_html":"<p>Relax</p>","currency":"GBP","price":120.0,"sale_price":null,"from_price":null,"from_sale_price":null,"monetary_value":null,"is_monetary":false,"allow_part_redeem":false,"validity_type":"months","validity_months":12,"redemption_info":null,"sort_order":1,"image_url":null,"image_urls":[],"category_refs":[{"id":7,"slug":"spa","title":"Spa","sort_order":1}],"variant_summaries":[],"updated_at":"2025-03-01T10:00:00Z","x_unknown_field":{"kept":true}}"#;
const CATEGORY: &str = r#"{"id":7,"slug":"spa","title":"Spa","sort_order":1,"updated_at":"2025-03-01T09:00:00Z","summary":"","description_html":"","image_url":"","products":[{"id":123,"slug":"spa-day","title":"Spa day for two","price":120.0,"sale_price":99.0,"sort_order":1}]}"#;

/// The content hash the sweep computes (canonical JSON, `updated_at` ignored).
fn hash_of(json: &str) -> ContentHash {
    content_hash(json, &IgnoreKeys::new(["updated_at"])).unwrap()
}

fn raw(json: &str) -> Box<RawValue> {
    RawValue::from_string(json.to_string()).unwrap()
}

fn record_id_of(data: &str) -> i64 {
    let value: Value = serde_json::from_str(data).unwrap();
    value["id"].as_i64().unwrap()
}

/// Builds the event for `op` on `data` in `resource`, as the sweep would.
fn change_event(resource: Resource, op: Op, data: &str, replay_id: Option<&str>) -> Event {
    let stream = StreamKey::new(42, resource);
    let record_id = record_id_of(data);
    let delete_data = format!(r#"{{"id":{record_id}}}"#);
    let (data, updated_at) = if op == Op::Delete {
        (delete_data.as_str(), None)
    } else {
        (data, Some("2025-03-01T10:00:00Z"))
    };
    let content_hash = hash_of(data);
    let previous_hash = hash_of(r#"{"id":0,"title":"the previous version"}"#);
    let previous = matches!(op, Op::Update | Op::Delete).then_some(previous_hash);
    let data = raw(data);
    record_event(&RecordChange {
        stream,
        record_id,
        generation: 0,
        seq: 0,
        op,
        updated_at,
        content_hash,
        previous_hash: previous,
        replay: replay_id.map(|id| replay_id_bytes(id).unwrap()),
        data: data.get(),
        detected_at: Utc.with_ymd_and_hms(2025, 3, 1, 10, 0, 5).unwrap(),
        schema_base: &DEFAULT_SCHEMA_BASE,
    })
}

/// Every record event the bridge can emit, for both resources.
fn all_record_events() -> Vec<Event> {
    let mut events = Vec::new();
    for (resource, data) in [
        (Resource::Vouchers, VOUCHER),
        (Resource::Categories, CATEGORY),
    ] {
        events.push(change_event(resource, Op::Create, data, None));
        events.push(change_event(resource, Op::Update, data, None));
        events.push(change_event(resource, Op::Snapshot, data, None));
        events.push(change_event(
            resource,
            Op::Snapshot,
            data,
            Some("0123456789abcdef0123456789abcdef"),
        ));
        events.push(change_event(resource, Op::Delete, data, None));
    }
    events
}

/// The replay framing events (started, completed, cancelled), with and without `--since`.
fn all_replay_events() -> Vec<Event> {
    let now = Utc.with_ymd_and_hms(2025, 3, 1, 11, 0, 0).unwrap();
    let mut events = Vec::new();
    for resource in Resource::ALL {
        let stream = StreamKey::new(42, resource);
        events.push(replay_event(
            stream,
            "0123456789abcdef0123456789abcdef",
            None,
            false,
            0,
            now,
            &DEFAULT_SCHEMA_BASE,
        ));
        events.push(replay_event(
            stream,
            "0123456789abcdef0123456789abcdef",
            None,
            true,
            1250,
            now,
            &DEFAULT_SCHEMA_BASE,
        ));
        let since = Some("2025-02-01T00:00:00Z");
        events.push(replay_event(
            stream,
            "r-01hq4",
            since,
            false,
            0,
            now,
            &DEFAULT_SCHEMA_BASE,
        ));
        events.push(replay_event(
            stream,
            "r-01hq4",
            since,
            true,
            3,
            now,
            &DEFAULT_SCHEMA_BASE,
        ));
        events.push(replay_cancelled_event(
            stream,
            "r-01hq4",
            since,
            2,
            now,
            &DEFAULT_SCHEMA_BASE,
        ));
    }
    events
}

fn as_json(event: &Event) -> Value {
    serde_json::from_slice(&event.payload).unwrap()
}

#[test]
fn the_schema_is_a_valid_draft_2020_12_schema() {
    jsonschema::meta::validate(event_schema()).unwrap();
    assert_eq!(
        event_schema()["$schema"],
        "https://json-schema.org/draft/2020-12/schema"
    );
}

#[test]
fn every_record_event_type_and_op_matches_the_schema() {
    let events = all_record_events();
    let types: Vec<&str> = events.iter().map(|e| e.ty.as_str()).collect();
    for ty in [
        "voucher.updated",
        "voucher.deleted",
        "category.updated",
        "category.deleted",
    ] {
        assert!(types.contains(&ty), "no {ty} event built");
    }
    for event in &events {
        assert_valid_event(&event.payload);
    }
}

#[test]
fn replay_started_completed_and_cancelled_events_match_the_schema() {
    let events = all_replay_events();
    assert!(events.iter().any(|e| e.ty.as_str() == "replay.started"));
    assert!(events.iter().any(|e| e.ty.as_str() == "replay.completed"));
    assert!(events.iter().any(|e| e.ty.as_str() == "replay.cancelled"));
    for event in &events {
        assert_valid_event(&event.payload);
        assert!(as_json(event).get("op").is_none());
    }
}

#[test]
fn update_and_delete_events_carry_the_previous_hash_and_snapshots_of_a_replay_its_id() {
    let update = as_json(&change_event(Resource::Vouchers, Op::Update, VOUCHER, None));
    assert_eq!(update["op"], "update");
    assert_eq!(
        update["previoushash"],
        hash_of(r#"{"id":0,"title":"the previous version"}"#).to_hex()
    );
    let delete = as_json(&change_event(Resource::Vouchers, Op::Delete, VOUCHER, None));
    assert_eq!(delete["type"], "voucher.deleted");
    assert_eq!(delete["data"], json!({"id": 123}));
    let replayed = as_json(&change_event(
        Resource::Categories,
        Op::Snapshot,
        CATEGORY,
        Some("0123456789abcdef0123456789abcdef"),
    ));
    assert_eq!(replayed["replayid"], "0123456789abcdef0123456789abcdef");
    assert_eq!(replayed["data"]["products"][0]["id"], 123);
}

/// Sets (`Some`) or removes (`None`) one attribute of a valid update event
/// and checks that the schema rejects it with a violation naming `expected`.
fn assert_rejected_with(attribute: &str, value: Option<Value>, expected: &str) {
    let mut event = as_json(&change_event(Resource::Vouchers, Op::Update, VOUCHER, None));
    let fields = event.as_object_mut().unwrap();
    match value {
        Some(value) => fields.insert(attribute.to_string(), value),
        None => fields.remove(attribute),
    };
    let problems = validate_event_json(&event).expect_err(&format!(
        "the schema accepted {attribute} = {:?}",
        event[attribute]
    ));
    assert!(
        problems.contains(expected),
        "violation does not name {expected}: {problems}"
    );
}

fn valid_id() -> String {
    as_json(&change_event(Resource::Vouchers, Op::Update, VOUCHER, None))["id"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn ids_of_the_wrong_length_or_case_are_rejected() {
    let id = valid_id();
    let uppercase = id.to_uppercase().replace(char::is_numeric, "A");
    for bad in [&id[..31], &format!("{id}0"), &uppercase, ""] {
        assert_rejected_with("id", Some(json!(bad)), "/id");
    }
    assert_rejected_with("id", Some(json!(12345)), "/id");
}

#[test]
fn unknown_types_and_ops_are_rejected() {
    assert_rejected_with("type", Some(json!("voucher.created")), "/type");
    assert_rejected_with("op", Some(json!("upsert")), "/op");
    // An upsert type with the delete op, and a delete type with an upsert op.
    assert_rejected_with("op", Some(json!("delete")), "/op");
    assert_rejected_with("type", Some(json!("voucher.deleted")), "/op");
}

#[test]
fn inconsistent_or_incomplete_envelopes_are_rejected() {
    let cases = [
        ("previoushash", None, "previoushash"),
        ("contenthash", Some(json!("abc123")), "/contenthash"),
        ("partitionkey", Some(json!("42:voucher")), "/partitionkey"),
        (
            "partitionkey",
            Some(json!("42:category:123")),
            "/partitionkey",
        ),
        (
            "source",
            Some(json!("/tenants/42/catalog/categories")),
            "/source",
        ),
        ("specversion", Some(json!("0.3")), "/specversion"),
        ("tenant", Some(json!("42")), "/tenant"),
        ("data", None, "data"),
        ("unexpected", Some(json!(1)), "unexpected"),
    ];
    for (attribute, value, expected) in cases {
        assert_rejected_with(attribute, value, expected);
    }
}

#[test]
fn replay_framing_events_with_an_op_are_rejected() {
    let now = Utc.with_ymd_and_hms(2025, 3, 1, 11, 0, 0).unwrap();
    let stream = StreamKey::new(42, Resource::Vouchers);
    let mut replay = as_json(&replay_event(
        stream,
        "r-1",
        None,
        false,
        0,
        now,
        &DEFAULT_SCHEMA_BASE,
    ));
    validate_event_json(&replay).unwrap();
    replay["op"] = json!("snapshot");
    let problems = validate_event_json(&replay).unwrap_err();
    assert!(problems.contains(r#""op""#), "{problems}");
}

#[test]
fn every_published_schema_is_a_valid_draft_2020_12_schema_whose_id_is_its_file_name() {
    let on_disk: Vec<String> = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/schemas"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".schema.json"))
        .collect();
    assert_eq!(on_disk.len(), SCHEMAS.len(), "every file is embedded");
    for name in on_disk {
        let schema = schema_named(&name);
        jsonschema::meta::validate(schema).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(schema["$id"], name.as_str());
        assert_eq!(
            schema["$schema"],
            "https://json-schema.org/draft/2020-12/schema"
        );
    }
}

#[test]
fn every_event_names_the_schema_of_its_data_in_dataschema() {
    let expected = |event: &Value| match event["type"].as_str().unwrap() {
        "voucher.updated" => "voucher.schema.json",
        "category.updated" => "category.schema.json",
        "voucher.deleted" | "category.deleted" => "delete.schema.json",
        _ => "replay.schema.json",
    };
    for event in all_record_events().iter().chain(&all_replay_events()) {
        let doc = as_json(event);
        let name = expected(&doc);
        assert_eq!(
            doc["dataschema"],
            format!("http://127.0.0.1:9464/v1/schemas/{name}"),
            "{doc}"
        );
    }
    // The envelope insists on the pairing: a voucher pointing at the category schema fails.
    let mut event = as_json(&change_event(Resource::Vouchers, Op::Update, VOUCHER, None));
    event["dataschema"] = json!("http://127.0.0.1:9464/v1/schemas/category.schema.json");
    let problems = validate_event_json(&event).unwrap_err();
    assert!(problems.contains("/dataschema"), "{problems}");
}

/// The voucher of [`VOUCHER`] with `change` applied, checked as event `data`.
fn voucher_problems(change: impl FnOnce(&mut serde_json::Map<String, Value>)) -> String {
    let mut event = as_json(&change_event(Resource::Vouchers, Op::Update, VOUCHER, None));
    change(event["data"].as_object_mut().unwrap());
    validate_event_json(&event).expect_err("the schema accepted a broken voucher")
}

#[test]
fn a_voucher_missing_a_required_key_or_with_a_wrong_type_or_null_is_rejected() {
    let problems = voucher_problems(|v| {
        v.remove("currency");
    });
    assert!(problems.contains("currency"), "{problems}");
    // `updated_at` is required even though it may be null.
    let problems = voucher_problems(|v| {
        v.remove("updated_at");
    });
    assert!(problems.contains("updated_at"), "{problems}");
    let problems = voucher_problems(|v| {
        v.insert("is_monetary".into(), json!(null));
    });
    assert!(problems.contains("/data/is_monetary"), "{problems}");
    let problems = voucher_problems(|v| {
        v.insert("price".into(), json!("25.00"));
    });
    assert!(problems.contains("/data/price"), "{problems}");
    let problems = voucher_problems(|v| {
        v.insert("category_refs".into(), json!([{"id": 7, "slug": "spa"}]));
    });
    assert!(problems.contains("/data/category_refs/0"), "{problems}");
}

#[test]
fn unknown_and_nullable_fields_of_a_voucher_are_accepted() {
    let mut event = as_json(&change_event(Resource::Vouchers, Op::Update, VOUCHER, None));
    let data = event["data"].as_object_mut().unwrap();
    data.insert("field_from_the_future".into(), json!({"x": 1}));
    data.insert("updated_at".into(), json!(null));
    data.insert("price".into(), json!(null));
    validate_event_json(&event).unwrap();
}

#[test]
fn a_category_needs_only_its_id_but_keeps_the_types_the_spec_gives() {
    validate_data(DataSchema::Category, &json!({"id": 7})).unwrap();
    validate_data(DataSchema::Category, &json!({"id": 7, "title": null})).unwrap();
    let problems = validate_data(DataSchema::Category, &json!({"title": "Spa"})).unwrap_err();
    assert!(problems.contains("id"), "{problems}");
    let problems = validate_data(
        DataSchema::Category,
        &json!({"id": 7, "products": [{"id": "x"}]}),
    )
    .unwrap_err();
    assert!(problems.contains("/products/0/id"), "{problems}");
}

#[tokio::test]
async fn the_simulators_list_responses_match_the_record_schemas() {
    let sim = common::spawn_catalog(2, 60, 12).await;
    let client = common::simulator_client(sim.token());
    // Some nulls and relations the mutator would otherwise reach only by chance.
    for id in sim.record_ids(1, Resource::Vouchers).into_iter().take(5) {
        sim.update(1, Resource::Vouchers, id);
    }
    let base = &sim.base_url();
    let mut checked = 0;
    for tenant in [1, 2] {
        for (path, schema, includes) in [
            (
                "catalog/vouchers",
                DataSchema::Voucher,
                ["", "include=categories,variants"],
            ),
            (
                "catalog/categories",
                DataSchema::Category,
                ["", "include=products"],
            ),
        ] {
            for include in includes {
                let path = format!("/tenants/{tenant}/{path}");
                let records = common::list_all(base, &client, &path, include).await;
                assert!(!records.is_empty(), "{path}?{include} lists nothing");
                for record in &records {
                    validate_data(schema, record).unwrap_or_else(|problems| {
                        panic!("{path}?{include}: {problems}\nrecord: {record}")
                    });
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(checked, 2 * 2 * (60 + 12));
}

#[test]
fn heartbeats_match_the_schema_with_and_without_a_watermark() {
    let now = Utc.with_ymd_and_hms(2025, 3, 1, 11, 0, 0).unwrap();
    let quiet = StreamPulse {
        watermark: Some(now - chrono::Duration::minutes(5)),
        last_sweep: Some(now - chrono::Duration::minutes(1)),
        last_event: Some(now - chrono::Duration::hours(2)),
    };
    let fresh = StreamPulse {
        watermark: None,
        last_sweep: None,
        last_event: None,
    };
    for (resource, pulse) in [(Resource::Vouchers, quiet), (Resource::Categories, fresh)] {
        let event = heartbeat_event(
            StreamKey::new(42, resource),
            pulse,
            now,
            &DEFAULT_SCHEMA_BASE,
        );
        assert_valid_event(&event.payload);
        let doc = as_json(&event);
        assert_eq!(doc["type"], "stream.heartbeat");
        assert!(doc["dataschema"]
            .as_str()
            .unwrap()
            .ends_with("/heartbeat.schema.json"));
    }
    let mut doc = as_json(&heartbeat_event(
        StreamKey::new(42, Resource::Vouchers),
        quiet,
        now,
        &DEFAULT_SCHEMA_BASE,
    ));
    assert_eq!(doc["data"]["watermark"], "2025-03-01T10:55:00.000000Z");
    doc["data"]["lastsweep"] = json!("yesterday");
    let problems = validate_event_json(&doc).unwrap_err();
    assert!(problems.contains("/data/lastsweep"), "{problems}");
}
