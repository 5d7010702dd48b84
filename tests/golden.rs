//! Golden vectors for what must never change by accident: event ids (what
//! brokers and consumers deduplicate by) and content hashes (what decides
//! whether a record changed). A change to any value here breaks deduplication
//! or re-emits whole catalogs across an upgrade: if it is deliberate, change
//! the vector and write it in the README's upgrade notes.

use chrono::{TimeZone, Utc};
use serde_json::value::RawValue;
use voucher_cdc::event::{event_id, record_event, replay_event, EventIdParts, Op, RecordChange};
use voucher_cdc::hash::{content_hash, IgnoreKeys};
use voucher_cdc::schema::DEFAULT_SCHEMA_BASE;
use voucher_cdc::stream::{Resource, StreamKey};

fn parts(seq: u64) -> EventIdParts<'static> {
    EventIdParts {
        tenant: 42,
        resource: Resource::Vouchers,
        record_id: "123",
        generation: 0,
        seq,
        updated_at: Some("2024-05-01T10:00:00.000000Z"),
        content_hash: "00112233445566778899aabbccddeeff",
        previous_hash: None,
        replay_id: None,
    }
}

#[test]
fn event_ids_of_records_are_pinned() {
    let vectors: [(EventIdParts<'static>, &str); 6] = [
        (parts(0), "c451373cad594b3c5f3bb067ffc55554"),
        (parts(1), "110cdaee86e27ea5113440b8180b06ac"),
        (
            EventIdParts {
                previous_hash: Some("ffeeddccbbaa99887766554433221100"),
                ..parts(2)
            },
            "a12c04ee7de56239083d5def07b63616",
        ),
        (
            EventIdParts {
                generation: 1,
                ..parts(0)
            },
            "35da6e22f8a4d5b12df3155ff13aaa1c",
        ),
        (
            EventIdParts {
                replay_id: Some("0123456789abcdef0123456789abcdef"),
                ..parts(0)
            },
            "9ea72138680ed0310de29e60179d312e",
        ),
        (
            EventIdParts {
                resource: Resource::Categories,
                updated_at: None,
                ..parts(0)
            },
            "1372f5a57129dc5049e57c014b284fed",
        ),
    ];
    for (i, (parts, expected)) in vectors.iter().enumerate() {
        assert_eq!(event_id(parts), *expected, "vector {i}: {parts:?}");
    }
}

#[test]
fn the_change_sequence_alone_changes_the_id() {
    assert_ne!(event_id(&parts(3)), event_id(&parts(4)));
}

/// A change of voucher 123 of tenant 42 (generation 0, sequence 0, previous
/// hash `0011…eeff`) carrying `data`.
fn record_123(op: Op, data: &RawValue) -> RecordChange<'_> {
    RecordChange {
        stream: StreamKey::new(42, Resource::Vouchers),
        record_id: 123,
        generation: 0,
        seq: 0,
        op,
        updated_at: Some("2024-05-01T10:00:00.000000Z"),
        content_hash: content_hash(data.get(), &IgnoreKeys::new(["updated_at"])).unwrap(),
        previous_hash: Some("00112233445566778899aabbccddeeff".parse().unwrap()),
        replay: None,
        data: data.get(),
        detected_at: Utc.with_ymd_and_hms(2024, 5, 2, 0, 0, 0).unwrap(),
        schema_base: &DEFAULT_SCHEMA_BASE,
    }
}

#[test]
fn a_delete_event_and_replay_frames_have_pinned_ids() {
    let stream = StreamKey::new(42, Resource::Vouchers);
    let data = RawValue::from_string(r#"{"id":123}"#.to_string()).unwrap();
    let delete = record_event(&RecordChange {
        generation: 2,
        seq: 7,
        ..record_123(Op::Delete, &data)
    });
    assert_eq!(delete.id, "46be4dd44e4957431709576ea859ac30");
    let now = Utc.with_ymd_and_hms(2024, 5, 2, 0, 0, 0).unwrap();
    let replay = "0123456789abcdef0123456789abcdef";
    let started = replay_event(stream, replay, None, false, 0, now, &DEFAULT_SCHEMA_BASE);
    let completed = replay_event(stream, replay, None, true, 55, now, &DEFAULT_SCHEMA_BASE);
    assert_eq!(started.id, "57018a1327b9fec2ef15a552f5191b51");
    assert_eq!(completed.id, "f7420749e6c51ea5a84ee7bcb31dfc38");
    // The completed count is data, not identity.
    assert_eq!(
        replay_event(stream, replay, None, true, 56, now, &DEFAULT_SCHEMA_BASE).id,
        completed.id
    );
}

#[test]
fn content_hashes_of_tricky_records_are_pinned() {
    let ignore = IgnoreKeys::new(["updated_at"]);
    let vectors = [
        (
            r#"{"id":1,"title":"Spa day","price":25.00}"#,
            "d07c7d384b13c9c2f29b9ade7d13d92c",
        ),
        (
            r#"{"price":25,"title":"Spa day","id":1}"#,
            "d07c7d384b13c9c2f29b9ade7d13d92c",
        ),
        (
            r#"{"id":2,"big":9007199254740993,"bigger":123456789012345678901234567890}"#,
            "ec8073fe5ed75bf81b973b52f49df9e2",
        ),
        (
            r#"{"id":3,"small":1e-07,"same":0.0000001}"#,
            "bf572c8b95ee4c91f4c7e65c0fe11a9a",
        ),
        (
            r#"{"id":4,"title":"Caf\u00e9 \ud83c\udf70 \"quoted\" \\ / \/"}"#,
            "4159ea98361951ee6f1e0dad569cc41d",
        ),
        (
            r#"{"id":4,"title":"Café 🍰 \"quoted\" \\ / /"}"#,
            "4159ea98361951ee6f1e0dad569cc41d",
        ),
        (
            r#"{"id":5,"updated_at":"2024-01-01T00:00:00Z","variants":[{"id":9,"updated_at":"x","price":1.5}],"meta":{"updated_at":null,"k":[]}}"#,
            "0fc683b54fd54b1e5cf5623ee3269893",
        ),
        (
            r#"{"id":5,"variants":[{"price":15e-1,"id":9}],"meta":{"k":[]},"updated_at":"2030-01-01T00:00:00Z"}"#,
            "0fc683b54fd54b1e5cf5623ee3269893",
        ),
    ];
    for (raw, expected) in vectors {
        assert_eq!(
            content_hash(raw, &ignore).unwrap().to_hex(),
            expected,
            "{raw}"
        );
    }
}

#[test]
fn with_changed_fields_and_before_off_a_record_events_bytes_are_pinned() {
    let data = RawValue::from_string(
        r#"{"id":123,"price":25.0,"updated_at":"2024-05-01T10:00:00.000000Z"}"#.to_string(),
    )
    .unwrap();
    let update = record_event(&RecordChange {
        seq: 3,
        ..record_123(Op::Update, &data)
    });
    assert_eq!(
        String::from_utf8(update.payload.to_vec()).unwrap(),
        concat!(
            r#"{"specversion":"1.0","id":"0129855973176b7ca4b76422234ef7b3","#,
            r#""source":"/tenants/42/catalog/vouchers","type":"voucher.updated","subject":"123","#,
            r#""time":"2024-05-01T10:00:00.000000Z","datacontenttype":"application/json","#,
            r#""dataschema":"http://127.0.0.1:9464/v1/schemas/voucher.schema.json","#,
            r#""partitionkey":"42:voucher:123","tenant":42,"op":"update","#,
            r#""contenthash":"92d6f33f3f2924161046e1589d1a5861","previoushash":"00112233445566778899aabbccddeeff","#,
            r#""data":{"id":123,"price":25.0,"updated_at":"2024-05-01T10:00:00.000000Z"}}"#,
        )
    );
}
