//! The published JSON Schemas of the events (`schemas/` in the repository),
//! embedded in the binary so the admin API serves exactly the files the
//! repository holds, and the `dataschema` URI every event carries.
//!
//! Each schema's `$id` is its file name, a relative reference: fetched from
//! the repository (`schemas/{name}`) or from the admin API
//! (`/v1/schemas/{name}`) it resolves to the address it was fetched from,
//! and the references between the files resolve beside it.

use std::borrow::Cow;

/// Every published schema: (file name, contents).
pub const SCHEMAS: &[(&str, &str)] = &[
    (
        CLOUDEVENT,
        include_str!("../schemas/cloudevent.schema.json"),
    ),
    (
        DEADLETTER,
        include_str!("../schemas/deadletter.schema.json"),
    ),
    (
        DataSchema::Voucher.file_name(),
        include_str!("../schemas/voucher.schema.json"),
    ),
    (
        DataSchema::Category.file_name(),
        include_str!("../schemas/category.schema.json"),
    ),
    (
        DataSchema::Delete.file_name(),
        include_str!("../schemas/delete.schema.json"),
    ),
    (
        DataSchema::Replay.file_name(),
        include_str!("../schemas/replay.schema.json"),
    ),
    (
        DataSchema::Heartbeat.file_name(),
        include_str!("../schemas/heartbeat.schema.json"),
    ),
];

/// File name of the envelope schema (every event but dead letters).
pub const CLOUDEVENT: &str = "cloudevent.schema.json";
/// File name of the dead-letter schema.
pub const DEADLETTER: &str = "deadletter.schema.json";

/// The contents of the published schema named `name`, if there is one.
pub fn schema(name: &str) -> Option<&'static str> {
    SCHEMAS
        .iter()
        .find(|(file, _)| *file == name)
        .map(|(_, text)| *text)
}

/// Which schema describes an event's `data`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DataSchema {
    /// A catalog voucher (`voucher.updated`).
    Voucher,
    /// A catalog category (`category.updated`).
    Category,
    /// `{"id": N}` of a `*.deleted` event.
    Delete,
    /// The data of `replay.started` / `replay.completed`.
    Replay,
    /// The data of `stream.heartbeat`.
    Heartbeat,
}

impl DataSchema {
    /// The schema's file name under `schemas/` (and `/v1/schemas/`).
    pub const fn file_name(self) -> &'static str {
        match self {
            DataSchema::Voucher => "voucher.schema.json",
            DataSchema::Category => "category.schema.json",
            DataSchema::Delete => "delete.schema.json",
            DataSchema::Replay => "replay.schema.json",
            DataSchema::Heartbeat => "heartbeat.schema.json",
        }
    }
}

/// Where consumers fetch the schemas: `dataschema` is this base followed by
/// the schema's file name (`events.schema_base_url`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaBase(Cow<'static, str>);

/// The base a daemon whose admin API listens on the default address serves.
pub const DEFAULT_SCHEMA_BASE_URL: &str = "http://127.0.0.1:9464/v1/schemas/";

/// [`DEFAULT_SCHEMA_BASE_URL`] as a [`SchemaBase`] (tests and benches borrow it).
pub static DEFAULT_SCHEMA_BASE: SchemaBase = SchemaBase(Cow::Borrowed(DEFAULT_SCHEMA_BASE_URL));

impl SchemaBase {
    /// A base URL; a missing trailing `/` is added so file names append.
    pub fn new(base: &str) -> Self {
        if base.ends_with('/') {
            Self(Cow::Owned(base.to_string()))
        } else {
            Self(Cow::Owned(format!("{base}/")))
        }
    }

    /// The base served by an admin API listening on `listen`.
    pub fn of_admin(listen: std::net::SocketAddr) -> Self {
        let reachable = crate::admin::connect_address(listen);
        Self::new(&format!("http://{reachable}/v1/schemas/"))
    }

    /// The base URL, ending in `/`.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The `dataschema` URI of `schema` as its two parts, for an event that
    /// writes them one after the other instead of joining them first.
    pub fn uri_parts(&self, schema: DataSchema) -> SchemaUri<'_> {
        SchemaUri {
            base: &self.0,
            file: schema.file_name(),
        }
    }
}

/// A `dataschema` URI: the base followed by the schema's file name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchemaUri<'a> {
    /// The base URL, ending in `/`.
    pub base: &'a str,
    /// The schema's file name.
    pub file: &'static str,
}

impl Default for SchemaBase {
    fn default() -> Self {
        DEFAULT_SCHEMA_BASE.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_schema_is_json_whose_id_is_its_file_name() {
        for (name, text) in SCHEMAS {
            let doc: serde_json::Value = serde_json::from_str(text).unwrap();
            assert_eq!(doc["$id"], *name, "{name}");
        }
    }

    #[test]
    fn a_base_without_a_trailing_slash_still_appends_the_file_name() {
        // The URI an event writes: the base, then the file name.
        let uri = |base: &SchemaBase, schema| {
            let SchemaUri { base, file } = base.uri_parts(schema);
            format!("{base}{file}")
        };
        let base = SchemaBase::new("https://cdc.example/v1/schemas");
        assert_eq!(
            uri(&base, DataSchema::Delete),
            "https://cdc.example/v1/schemas/delete.schema.json"
        );
        let admin = SchemaBase::of_admin("0.0.0.0:9464".parse().unwrap());
        assert_eq!(
            uri(&admin, DataSchema::Voucher),
            "http://127.0.0.1:9464/v1/schemas/voucher.schema.json"
        );
        assert_eq!(schema("nope.json"), None);
    }
}
