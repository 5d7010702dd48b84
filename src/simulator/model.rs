//! Serde types for every resource of the External Voucher API spec: the
//! simulator's wire model (the bridge reads records as raw JSON and needs none
//! of it).
//!
//! They exist so the simulator writes, and tests read, exactly the shapes the
//! spec's tables describe: a field marked "required" must be present, a field
//! whose type says "or null" may be null, and an optional field may be absent.
//! Unknown fields are accepted on reading (tolerant reader). Where the spec
//! leaves required-ness or nullability "not shown" (catalog category,
//! redemption result) every field except the ids is read as optional so a
//! client never breaks on a shape the spec did not promise.

use chrono::{DateTime, NaiveDate, Utc};
use serde::{Deserialize, Deserializer, Serialize};
use std::collections::BTreeMap;

/// Serde helpers for timestamps: written as RFC 3339 UTC with microseconds and
/// `Z`, read from any RFC 3339 date-time.
pub mod ts {
    use chrono::{DateTime, SecondsFormat, Utc};
    use serde::{Deserialize, Deserializer, Serializer};

    /// Formats a timestamp the way the simulator writes every date-time.
    pub fn format(at: &DateTime<Utc>) -> String {
        at.to_rfc3339_opts(SecondsFormat::Micros, true)
    }

    /// Serializes a required timestamp.
    pub fn serialize<S: Serializer>(at: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format(at))
    }

    /// Deserializes a required timestamp.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DateTime<Utc>, D::Error> {
        let text = String::deserialize(d)?;
        DateTime::parse_from_rfc3339(&text)
            .map(|at| at.with_timezone(&Utc))
            .map_err(|e| serde::de::Error::custom(format!("invalid date-time `{text}`: {e}")))
    }

    /// Serde helpers for a nullable timestamp.
    pub mod option {
        use super::*;

        /// Serializes a nullable timestamp (None as `null`).
        pub fn serialize<S: Serializer>(
            at: &Option<DateTime<Utc>>,
            s: S,
        ) -> Result<S::Ok, S::Error> {
            match at {
                Some(at) => s.serialize_str(&format(at)),
                None => s.serialize_none(),
            }
        }

        /// Deserializes a nullable timestamp.
        pub fn deserialize<'de, D: Deserializer<'de>>(
            d: D,
        ) -> Result<Option<DateTime<Utc>>, D::Error> {
            let text: Option<String> = Option::deserialize(d)?;
            text.map(|text| {
                DateTime::parse_from_rfc3339(&text)
                    .map(|at| at.with_timezone(&Utc))
                    .map_err(|e| {
                        serde::de::Error::custom(format!("invalid date-time `{text}`: {e}"))
                    })
            })
            .transpose()
        }
    }
}

/// Reads a field that must be present but may be null (serde would otherwise
/// treat a missing `Option` field as null).
fn required_nullable<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d)
}

/// Reads a field that may be absent but, when present, must not be null.
fn present_non_null<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    T::deserialize(d).map(Some)
}

/// A catalog voucher (also called product), as listed and fetched.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CatalogVoucher {
    /// Voucher id.
    pub id: i64,
    /// URL slug.
    pub slug: String,
    /// Display title.
    pub title: String,
    /// Short summary.
    #[serde(default)]
    pub summary: Option<String>,
    /// Long description as HTML.
    #[serde(default)]
    pub description_html: Option<String>,
    /// ISO 4217 currency code.
    pub currency: String,
    /// Price in major units.
    #[serde(default)]
    pub price: Option<f64>,
    /// Sale price in major units.
    #[serde(default)]
    pub sale_price: Option<f64>,
    /// Lowest variant price in major units.
    #[serde(default)]
    pub from_price: Option<f64>,
    /// Lowest variant sale price in major units.
    #[serde(default)]
    pub from_sale_price: Option<f64>,
    /// Face value of a monetary voucher in major units.
    #[serde(default)]
    pub monetary_value: Option<f64>,
    /// Whether the voucher carries a money balance.
    pub is_monetary: bool,
    /// Whether the voucher may be redeemed in parts.
    pub allow_part_redeem: bool,
    /// How validity is expressed; the key may be absent.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present_non_null"
    )]
    pub validity_type: Option<String>,
    /// Validity in months.
    #[serde(default)]
    pub validity_months: Option<i64>,
    /// Free-text redemption instructions.
    #[serde(default)]
    pub redemption_info: Option<String>,
    /// Display order.
    pub sort_order: i64,
    /// Main image.
    #[serde(default)]
    pub image_url: Option<String>,
    /// All images.
    pub image_urls: Vec<String>,
    /// Linked categories (always present).
    pub category_refs: Vec<CategoryRef>,
    /// Variants (always present).
    pub variant_summaries: Vec<Variant>,
    /// Linked categories, present when requested with `include=categories`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present_non_null"
    )]
    pub categories: Option<Vec<CategoryRef>>,
    /// Variants, present when requested with `include=variants`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present_non_null"
    )]
    pub variants: Option<Vec<Variant>>,
    /// Last change; the key is always present, the value may be null.
    #[serde(
        serialize_with = "ts::option::serialize",
        deserialize_with = "required_ts_option"
    )]
    pub updated_at: Option<DateTime<Utc>>,
}

/// Reads a nullable timestamp whose key must be present.
fn required_ts_option<'de, D: Deserializer<'de>>(d: D) -> Result<Option<DateTime<Utc>>, D::Error> {
    ts::option::deserialize(d)
}

/// A category reference inside a voucher (`category_refs`, `categories`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CategoryRef {
    /// Category id.
    pub id: i64,
    /// Category slug.
    pub slug: String,
    /// Category title.
    pub title: String,
    /// Category display order.
    pub sort_order: i64,
}

/// A voucher variant (`variant_summaries`, `variants`); all nine keys required.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Variant {
    /// Variant id.
    pub id: i64,
    /// Variant slug.
    pub slug: String,
    /// Variant title.
    pub title: String,
    /// Price in major units.
    #[serde(deserialize_with = "required_nullable")]
    pub price: Option<f64>,
    /// Sale price in major units.
    #[serde(deserialize_with = "required_nullable")]
    pub sale_price: Option<f64>,
    /// ISO 4217 currency code.
    pub currency: String,
    /// Whether the variant carries a money balance.
    pub is_monetary: bool,
    /// Display order.
    pub sort_order: i64,
    /// Last change, may be null.
    #[serde(
        serialize_with = "ts::option::serialize",
        deserialize_with = "required_ts_option"
    )]
    pub updated_at: Option<DateTime<Utc>>,
}

/// A catalog category. The spec does not show required-ness or nullability,
/// so everything but `id` is read as optional; the simulator always writes
/// every key except `products` (written only with `include=products`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CatalogCategory {
    /// Category id.
    pub id: i64,
    /// URL slug.
    #[serde(default)]
    pub slug: Option<String>,
    /// Display title.
    #[serde(default)]
    pub title: Option<String>,
    /// Display order.
    #[serde(default)]
    pub sort_order: Option<i64>,
    /// Last change.
    #[serde(default, with = "ts::option")]
    pub updated_at: Option<DateTime<Utc>>,
    /// Short summary.
    #[serde(default)]
    pub summary: Option<String>,
    /// Long description as HTML.
    #[serde(default)]
    pub description_html: Option<String>,
    /// Main image.
    #[serde(default)]
    pub image_url: Option<String>,
    /// Vouchers in this category, present when requested with `include=products`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub products: Option<Vec<CategoryProduct>>,
}

/// A voucher listed inside a category (`products`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CategoryProduct {
    /// Voucher id.
    pub id: i64,
    /// Voucher slug.
    #[serde(default)]
    pub slug: Option<String>,
    /// Voucher title.
    #[serde(default)]
    pub title: Option<String>,
    /// Price in major units.
    #[serde(default)]
    pub price: Option<f64>,
    /// Sale price in major units.
    #[serde(default)]
    pub sale_price: Option<f64>,
    /// Display order.
    #[serde(default)]
    pub sort_order: Option<i64>,
}

/// The `data` of a successful redemption.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RedemptionResult {
    /// Outcome, `redeemed` on success.
    pub status: String,
    /// Why the outcome is what it is.
    #[serde(default)]
    pub reason_code: Option<String>,
    /// The redeemed voucher after the redemption.
    pub voucher: RedemptionVoucher,
    /// The tenant the redemption happened in.
    pub tenant: RedemptionTenant,
    /// When the redemption happened.
    #[serde(default, with = "ts::option")]
    pub redeemed_at: Option<DateTime<Utc>>,
    /// Who redeemed.
    #[serde(default)]
    pub actor: Option<Actor>,
}

/// A purchased voucher as shown in a redemption result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RedemptionVoucher {
    /// Purchased voucher id.
    pub id: i64,
    /// Printed reference code.
    #[serde(default)]
    pub reference: Option<String>,
    /// Balance left, major units.
    #[serde(default)]
    pub current_balance: Option<f64>,
    /// Balance at purchase, major units.
    #[serde(default)]
    pub initial_balance: Option<f64>,
    /// ISO 4217 currency code.
    #[serde(default)]
    pub currency: Option<String>,
    /// Whether the voucher carries a money balance.
    #[serde(default)]
    pub is_monetary: Option<bool>,
    /// Whether the voucher may be redeemed in parts.
    #[serde(default)]
    pub allow_part_redeem: Option<bool>,
    /// Voucher state, e.g. `redeemable`.
    #[serde(default)]
    pub status: Option<String>,
    /// Why the voucher is in its state, e.g. `void`.
    #[serde(default)]
    pub reason_code: Option<String>,
    /// Title of the catalog voucher it was bought as.
    #[serde(default)]
    pub product_title: Option<String>,
    /// Who receives it.
    #[serde(default)]
    pub recipient_name: Option<String>,
    /// Who bought it.
    #[serde(default)]
    pub customer_name: Option<String>,
    /// Redemption progress.
    #[serde(default)]
    pub redemption_status: Option<String>,
    /// Whether the voucher was voided.
    #[serde(default)]
    pub void: Option<bool>,
    /// First valid day.
    #[serde(default)]
    pub date_valid_start: Option<NaiveDate>,
    /// Last valid day.
    #[serde(default)]
    pub date_valid_end: Option<NaiveDate>,
}

/// The tenant object of a redemption result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RedemptionTenant {
    /// Tenant id.
    pub id: i64,
    /// Tenant name.
    #[serde(default)]
    pub name: Option<String>,
    /// Tenant type.
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    /// Source tenant id.
    #[serde(default)]
    pub source_tenant_id: Option<i64>,
    /// Source tenant name.
    #[serde(default)]
    pub source_tenant_name: Option<String>,
    /// Source tenant type.
    #[serde(default)]
    pub source_tenant_type: Option<String>,
}

/// Who performed a redemption.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Actor {
    /// Actor id.
    pub id: i64,
    /// Actor name.
    pub name: String,
}

/// The collection envelope of list responses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Collection<T> {
    /// The listed records.
    pub data: Vec<T>,
    /// Cursor for the next page; the key is always present.
    #[serde(deserialize_with = "required_nullable")]
    pub next_cursor: Option<String>,
    /// The server's clock when it produced the page.
    #[serde(with = "ts")]
    pub server_time: DateTime<Utc>,
}

/// The envelope of single-record responses (`{"data": ...}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Single<T> {
    /// The record.
    pub data: T,
}

/// Error body with a message only (401, 403, 404, 429).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageError {
    /// Human-readable cause.
    pub message: String,
}

/// Error body of a failed validation (422).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ValidationError {
    /// Human-readable summary.
    pub message: String,
    /// Messages by offending field.
    pub errors: BTreeMap<String, Vec<String>>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::de::DeserializeOwned;
    use serde_json::{json, Value};

    /// How the spec's table describes one field.
    #[derive(Clone, Copy)]
    struct Rule {
        required: bool,
        nullable: bool,
    }

    const REQ: Rule = Rule {
        required: true,
        nullable: false,
    };
    const REQ_NULL: Rule = Rule {
        required: true,
        nullable: true,
    };
    const OPT_NULL: Rule = Rule {
        required: false,
        nullable: true,
    };
    const OPT: Rule = Rule {
        required: false,
        nullable: false,
    };

    /// Checks a type against a table: dropping a required key or nulling a
    /// non-nullable one must fail, everything else must parse; the full
    /// sample must round-trip with the same key set.
    fn check_table<T: DeserializeOwned + Serialize>(sample: Value, table: &[(&str, Rule)]) {
        let object = sample.as_object().unwrap();
        let mut sample_keys: Vec<&String> = object.keys().collect();
        sample_keys.sort();
        let mut table_keys: Vec<&str> = table.iter().map(|(k, _)| *k).collect();
        table_keys.sort();
        assert_eq!(sample_keys, table_keys, "sample covers exactly the table");

        let parsed: T = serde_json::from_value(sample.clone()).unwrap();
        let written = serde_json::to_value(&parsed).unwrap();
        assert_eq!(written, sample, "round trip keeps names and values");

        for (key, rule) in table {
            let mut without = sample.clone();
            without.as_object_mut().unwrap().remove(*key);
            let result = serde_json::from_value::<T>(without);
            assert_eq!(
                result.is_ok(),
                !rule.required,
                "dropping `{key}` should {}",
                if rule.required { "fail" } else { "parse" }
            );
            let mut nulled = sample.clone();
            nulled[*key] = Value::Null;
            let result = serde_json::from_value::<T>(nulled);
            assert_eq!(
                result.is_ok(),
                rule.nullable,
                "null `{key}` should {}",
                if rule.nullable { "parse" } else { "fail" }
            );
        }

        let mut extra = sample.clone();
        extra["field_from_the_future"] = json!({"x": 1});
        assert!(
            serde_json::from_value::<T>(extra).is_ok(),
            "unknown fields are tolerated"
        );
    }

    fn category_ref() -> Value {
        json!({"id": 7, "slug": "spa-days", "title": "Spa Days", "sort_order": 2})
    }

    fn variant() -> Value {
        json!({"id": 9001, "slug": "for-two", "title": "For Two", "price": 99.5,
               "sale_price": null, "currency": "GBP", "is_monetary": false,
               "sort_order": 1, "updated_at": "2024-03-01T10:00:00.123456Z"})
    }

    #[test]
    fn catalog_voucher_fields_match_the_spec_table() {
        let sample = json!({
            "id": 101, "slug": "afternoon-tea-101", "title": "Afternoon Tea",
            "summary": null, "description_html": "<p>Tea</p>", "currency": "GBP",
            "price": 25.0, "sale_price": null, "from_price": 25.0, "from_sale_price": null,
            "monetary_value": null, "is_monetary": false, "allow_part_redeem": false,
            "validity_type": "months", "validity_months": 12, "redemption_info": null,
            "sort_order": 3, "image_url": null, "image_urls": [],
            "category_refs": [category_ref()], "variant_summaries": [variant()],
            "categories": [category_ref()], "variants": [variant()],
            "updated_at": "2024-03-01T10:00:00.000000Z"
        });
        check_table::<CatalogVoucher>(
            sample,
            &[
                ("id", REQ),
                ("slug", REQ),
                ("title", REQ),
                ("summary", OPT_NULL),
                ("description_html", OPT_NULL),
                ("currency", REQ),
                ("price", OPT_NULL),
                ("sale_price", OPT_NULL),
                ("from_price", OPT_NULL),
                ("from_sale_price", OPT_NULL),
                ("monetary_value", OPT_NULL),
                ("is_monetary", REQ),
                ("allow_part_redeem", REQ),
                ("validity_type", OPT),
                ("validity_months", OPT_NULL),
                ("redemption_info", OPT_NULL),
                ("sort_order", REQ),
                ("image_url", OPT_NULL),
                ("image_urls", REQ),
                ("category_refs", REQ),
                ("variant_summaries", REQ),
                ("categories", OPT),
                ("variants", OPT),
                ("updated_at", REQ_NULL),
            ],
        );
    }

    #[test]
    fn category_reference_requires_all_four_keys() {
        check_table::<CategoryRef>(
            category_ref(),
            &[
                ("id", REQ),
                ("slug", REQ),
                ("title", REQ),
                ("sort_order", REQ),
            ],
        );
    }

    #[test]
    fn variant_requires_all_nine_keys_and_allows_the_stated_nulls() {
        check_table::<Variant>(
            variant(),
            &[
                ("id", REQ),
                ("slug", REQ),
                ("title", REQ),
                ("price", REQ_NULL),
                ("sale_price", REQ_NULL),
                ("currency", REQ),
                ("is_monetary", REQ),
                ("sort_order", REQ),
                ("updated_at", REQ_NULL),
            ],
        );
    }

    #[test]
    fn catalog_category_reads_every_unshown_field_as_optional() {
        let product = json!({"id": 101, "slug": "tea", "title": "Tea", "price": 25.0,
                             "sale_price": 20.0, "sort_order": 1});
        let sample = json!({
            "id": 7, "slug": "spa-days", "title": "Spa Days", "sort_order": 2,
            "updated_at": "2024-03-01T10:00:00.000001Z", "summary": "Relax",
            "description_html": "<p>Relax</p>", "image_url": "https://img.example/7.jpg",
            "products": [product.clone()]
        });
        check_table::<CatalogCategory>(
            sample,
            &[
                ("id", REQ),
                ("slug", OPT_NULL),
                ("title", OPT_NULL),
                ("sort_order", OPT_NULL),
                ("updated_at", OPT_NULL),
                ("summary", OPT_NULL),
                ("description_html", OPT_NULL),
                ("image_url", OPT_NULL),
                ("products", OPT_NULL),
            ],
        );
        check_table::<CategoryProduct>(
            product,
            &[
                ("id", REQ),
                ("slug", OPT_NULL),
                ("title", OPT_NULL),
                ("price", OPT_NULL),
                ("sale_price", OPT_NULL),
                ("sort_order", OPT_NULL),
            ],
        );
    }

    #[test]
    fn redemption_result_and_its_objects_use_the_spec_field_names() {
        let voucher = json!({
            "id": 5001, "reference": "GBX-5001", "current_balance": 15.0,
            "initial_balance": 50.0, "currency": "GBP", "is_monetary": true,
            "allow_part_redeem": true, "status": "redeemable", "reason_code": "none",
            "product_title": "Gift Card", "recipient_name": "Ada", "customer_name": "Bob",
            "redemption_status": "part_redeemed", "void": false,
            "date_valid_start": "2024-01-01", "date_valid_end": "2025-01-01"
        });
        let tenant = json!({"id": 1, "name": "Tenant 1", "type": "merchant",
                            "source_tenant_id": 1, "source_tenant_name": "Tenant 1",
                            "source_tenant_type": "merchant"});
        let result = json!({"status": "redeemed", "reason_code": "part_redemption",
                            "voucher": voucher.clone(), "tenant": tenant.clone(),
                            "redeemed_at": "2024-03-01T10:00:00.000000Z",
                            "actor": {"id": 1, "name": "API"}});
        check_table::<RedemptionResult>(
            result,
            &[
                ("status", REQ),
                ("reason_code", OPT_NULL),
                ("voucher", REQ),
                ("tenant", REQ),
                ("redeemed_at", OPT_NULL),
                ("actor", OPT_NULL),
            ],
        );
        let voucher_table: Vec<(&str, Rule)> = voucher
            .as_object()
            .unwrap()
            .keys()
            .map(|k| (k.as_str(), if k == "id" { REQ } else { OPT_NULL }))
            .collect();
        check_table::<RedemptionVoucher>(voucher.clone(), &voucher_table);
        let tenant_table: Vec<(&str, Rule)> = tenant
            .as_object()
            .unwrap()
            .keys()
            .map(|k| (k.as_str(), if k == "id" { REQ } else { OPT_NULL }))
            .collect();
        check_table::<RedemptionTenant>(tenant.clone(), &tenant_table);
    }

    #[test]
    fn collection_envelope_requires_data_next_cursor_and_server_time() {
        let sample = json!({"data": [category_ref()], "next_cursor": null,
                            "server_time": "2024-03-01T10:00:00.000000Z"});
        check_table::<Collection<CategoryRef>>(
            sample,
            &[
                ("data", REQ),
                ("next_cursor", REQ_NULL),
                ("server_time", REQ),
            ],
        );
    }

    #[test]
    fn error_bodies_require_message_and_validation_errors_by_field() {
        check_table::<MessageError>(json!({"message": "unauthenticated"}), &[("message", REQ)]);
        check_table::<ValidationError>(
            json!({"message": "invalid", "errors": {"cursor": ["bad"]}}),
            &[("message", REQ), ("errors", REQ)],
        );
    }

    #[test]
    fn timestamps_are_written_with_microseconds_and_z() {
        let at = DateTime::parse_from_rfc3339("2024-03-01T10:00:00+02:00")
            .unwrap()
            .with_timezone(&Utc);
        assert_eq!(ts::format(&at), "2024-03-01T08:00:00.000000Z");
    }
}
