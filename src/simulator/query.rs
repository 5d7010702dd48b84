//! Strict parsing of list query strings into a typed query or a
//! field-by-field validation error, with no I/O.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use crate::stream::Resource;

/// Field name to messages, the `errors` object of a ValidationError.
pub type FieldErrors = BTreeMap<String, Vec<String>>;

/// A validated list query.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ListQuery {
    /// Lower bound (inclusive) on `updated_at`.
    pub updated_since: Option<DateTime<Utc>>,
    /// The opaque cursor, not yet verified.
    pub cursor: Option<String>,
    /// Bit set of requested relations (see [`include_options`]).
    pub include_mask: u8,
}

/// The `include` values a resource accepts; value `i` is bit `1 << i`.
pub fn include_options(resource: Resource) -> &'static [&'static str] {
    match resource {
        Resource::Vouchers => &["categories", "variants"],
        Resource::Categories => &["products"],
    }
}

/// Every include bit of a resource set.
pub fn full_include_mask(resource: Resource) -> u8 {
    (1u8 << include_options(resource).len()) - 1
}

fn push(errors: &mut FieldErrors, field: &str, message: String) {
    errors.entry(field.to_string()).or_default().push(message);
}

/// Decodes one `application/x-www-form-urlencoded` component strictly:
/// `+` is a space, `%` must be followed by two hex digits, the result must be UTF-8.
pub fn decode_component(raw: &str) -> Option<String> {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = bytes.get(i + 1..i + 3)?;
                let text = std::str::from_utf8(hex).ok()?;
                out.push(u8::from_str_radix(text, 16).ok()?);
                i += 2;
            }
            other => out.push(other),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

/// Splits a raw query string into decoded pairs, or the error body's fields.
pub fn parse_pairs(raw: Option<&str>) -> Result<Vec<(String, String)>, FieldErrors> {
    let mut errors = FieldErrors::new();
    let mut pairs = Vec::new();
    for part in raw.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (name, value) = part.split_once('=').unwrap_or((part, ""));
        match (decode_component(name), decode_component(value)) {
            (Some(name), Some(value)) => pairs.push((name, value)),
            _ => push(
                &mut errors,
                "query",
                format!("`{part}` is not valid percent-encoded UTF-8"),
            ),
        }
    }
    if errors.is_empty() {
        Ok(pairs)
    } else {
        Err(errors)
    }
}

/// Parses an RFC 3339 date-time; a space where `+` was meant (an unencoded
/// offset in a query string) is read as `+`.
pub fn parse_timestamp(text: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(text)
        .or_else(|_| DateTime::parse_from_rfc3339(&text.replace(' ', "+")))
        .ok()
        .map(|at| at.with_timezone(&Utc))
}

/// Validates the query string of a list operation.
pub fn parse_list_query(resource: Resource, raw: Option<&str>) -> Result<ListQuery, FieldErrors> {
    let pairs = parse_pairs(raw)?;
    let mut errors = FieldErrors::new();
    let mut query = ListQuery::default();
    let mut seen: Vec<&str> = Vec::new();
    let options = include_options(resource);
    for (name, value) in &pairs {
        if seen.contains(&name.as_str()) {
            push(
                &mut errors,
                name,
                format!("`{name}` may be given only once"),
            );
            continue;
        }
        seen.push(name);
        match name.as_str() {
            "updated_since" if value.is_empty() => {}
            "updated_since" => match parse_timestamp(value) {
                Some(at) => query.updated_since = Some(at),
                None => push(
                    &mut errors,
                    name,
                    format!(
                        "`{value}` is not an ISO-8601 date-time; use a form such as 2024-03-01T10:00:00Z"
                    ),
                ),
            },
            "cursor" if value.is_empty() => {}
            "cursor" => query.cursor = Some(value.clone()),
            "include" => {
                for item in value.split(',').map(str::trim).filter(|i| !i.is_empty()) {
                    match options.iter().position(|o| *o == item) {
                        Some(bit) => query.include_mask |= 1 << bit,
                        None => push(
                            &mut errors,
                            name,
                            format!(
                                "unknown include `{item}`; valid options are {}",
                                options.join(", ")
                            ),
                        ),
                    }
                }
            }
            _ => push(
                &mut errors,
                name,
                format!(
                    "unknown query parameter `{name}`; valid options are updated_since, cursor, include"
                ),
            ),
        }
    }
    if errors.is_empty() {
        Ok(query)
    } else {
        Err(errors)
    }
}

/// Validates that a get operation received no query parameters.
pub fn parse_no_query(raw: Option<&str>) -> Result<(), FieldErrors> {
    let pairs = parse_pairs(raw)?;
    let mut errors = FieldErrors::new();
    for (name, _) in pairs {
        push(
            &mut errors,
            &name,
            format!("unknown query parameter `{name}`; this operation takes none"),
        );
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_voucher_query_parses_into_its_parts() {
        let q = parse_list_query(
            Resource::Vouchers,
            Some("updated_since=2024-03-01T10%3A00%3A00%2B01%3A00&include=variants,categories&cursor=abc"),
        )
        .unwrap();
        assert_eq!(
            q.updated_since.unwrap().to_rfc3339(),
            "2024-03-01T09:00:00+00:00"
        );
        assert_eq!(q.include_mask, 3);
        assert_eq!(q.cursor.as_deref(), Some("abc"));
    }

    #[test]
    fn empty_values_mean_absent_and_an_unencoded_plus_offset_is_understood() {
        let q = parse_list_query(
            Resource::Categories,
            Some("updated_since=&cursor=&include="),
        )
        .unwrap();
        assert_eq!(q, ListQuery::default());
        let q = parse_list_query(
            Resource::Categories,
            Some("updated_since=2024-03-01T10:00:00+01:00"),
        )
        .unwrap();
        assert_eq!(
            q.updated_since.unwrap().to_rfc3339(),
            "2024-03-01T09:00:00+00:00"
        );
    }

    #[test]
    fn every_bad_part_is_reported_under_its_field() {
        let errors = parse_list_query(
            Resource::Categories,
            Some("updated_since=yesterday&include=products,variants&page=2"),
        )
        .unwrap_err();
        assert!(errors["updated_since"][0].contains("not an ISO-8601 date-time"));
        assert_eq!(
            errors["include"],
            vec!["unknown include `variants`; valid options are products"]
        );
        assert!(errors["page"][0].contains("valid options are updated_since, cursor, include"));
        let errors = parse_list_query(Resource::Vouchers, Some("cursor=a&cursor=b")).unwrap_err();
        assert!(errors["cursor"][0].contains("only once"));
        let errors = parse_list_query(Resource::Vouchers, Some("cursor=%zz")).unwrap_err();
        assert!(errors["query"][0].contains("percent-encoded"));
        let errors = parse_list_query(Resource::Vouchers, Some("cursor=%ff")).unwrap_err();
        assert!(errors.contains_key("query"));
    }

    #[test]
    fn get_operations_refuse_any_query_parameter() {
        assert_eq!(parse_no_query(None), Ok(()));
        assert_eq!(parse_no_query(Some("")), Ok(()));
        assert!(parse_no_query(Some("include=variants"))
            .unwrap_err()
            .contains_key("include"));
    }
}
