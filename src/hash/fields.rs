//! Per-field hashes: which top-level keys of a record changed, without keeping
//! the record. `events.changed_fields` stores, per record, an 8-byte hash of
//! each top-level member's canonical value (read off the same canonical bytes
//! the content hash is computed over, so both agree on what "equal" means:
//! key order, number notation, escapes and ignored keys never count) and
//! compares the stored hashes with the new version's. docs/events.md
//! (`changedfields`) and docs/state.md specify it.

use super::canonical::with_canonical;
use super::{truncated, ContentHash, HashError, IgnoreKeys};

/// The hash of one top-level member's canonical value: the first 8 bytes of
/// its blake3 digest (a changed value goes unnoticed with probability 2^-64).
pub type FieldHash = [u8; 8];

/// A record's top-level keys, each once, in canonical byte order, with the
/// hash of each one's canonical value.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FieldHashes {
    /// (canonical escaped key bytes without quotes, value hash), sorted by key, keys unique.
    fields: Vec<(Vec<u8>, FieldHash)>,
}

impl FieldHashes {
    /// Builds the set from keys and hashes; None unless the keys are strictly
    /// increasing (sorted, each once) and as many as the hashes.
    pub fn from_parts(keys: Vec<Vec<u8>>, hashes: Vec<FieldHash>) -> Option<FieldHashes> {
        if keys.len() != hashes.len() || keys.windows(2).any(|w| w[0] >= w[1]) {
            return None;
        }
        Some(FieldHashes {
            fields: keys.into_iter().zip(hashes).collect(),
        })
    }

    /// The keys, as canonical escaped bytes, in order.
    pub fn keys(&self) -> impl Iterator<Item = &[u8]> {
        self.fields.iter().map(|(k, _)| k.as_slice())
    }

    /// The value hashes, in key order.
    pub fn hashes(&self) -> impl Iterator<Item = &FieldHash> {
        self.fields.iter().map(|(_, h)| h)
    }

    /// Number of top-level keys.
    pub fn len(&self) -> usize {
        self.fields.len()
    }

    /// True for a record with no (non-ignored) top-level key.
    pub fn is_empty(&self) -> bool {
        self.fields.is_empty()
    }

    /// Each key's name (unescaped) with its value hash, in key order.
    pub fn named(&self) -> impl Iterator<Item = (String, &FieldHash)> {
        self.fields.iter().map(|(k, h)| (key_name(k), h))
    }

    /// Builds the set from key names (unescaped) and hashes, in any order;
    /// None when a name repeats.
    pub fn from_named(named: impl IntoIterator<Item = (String, FieldHash)>) -> Option<FieldHashes> {
        let mut fields: Vec<(Vec<u8>, FieldHash)> = named
            .into_iter()
            .map(|(name, h)| (super::canonical::escape_key(&name), h))
            .collect();
        fields.sort();
        let (keys, hashes) = fields.into_iter().unzip();
        FieldHashes::from_parts(keys, hashes)
    }
}

/// The content hash of `raw` and, when it is a JSON object, the hashes of its
/// top-level members, both from one canonicalisation.
pub fn content_hash_with_fields(
    raw: &str,
    ignore: &IgnoreKeys,
) -> Result<(ContentHash, Option<FieldHashes>), HashError> {
    with_canonical(raw, ignore, |canonical| {
        (
            ContentHash(truncated(&blake3::hash(canonical))),
            top_level_fields(canonical),
        )
    })
}

/// The top-level keys whose value differs between `before` and `after`,
/// added and removed keys included, by name, sorted (byte order of the
/// UTF-8 names).
pub fn changed_fields(before: &FieldHashes, after: &FieldHashes) -> Vec<String> {
    let mut changed = Vec::new();
    let (mut b, mut a) = (
        before.fields.iter().peekable(),
        after.fields.iter().peekable(),
    );
    loop {
        match (b.peek(), a.peek()) {
            (None, None) => break,
            (Some((key, _)), None) => {
                changed.push(key_name(key));
                b.next();
            }
            (None, Some((key, _))) => {
                changed.push(key_name(key));
                a.next();
            }
            (Some((kb, hb)), Some((ka, ha))) => match kb.cmp(ka) {
                std::cmp::Ordering::Less => {
                    changed.push(key_name(kb));
                    b.next();
                }
                std::cmp::Ordering::Greater => {
                    changed.push(key_name(ka));
                    a.next();
                }
                std::cmp::Ordering::Equal => {
                    if hb != ha {
                        changed.push(key_name(kb));
                    }
                    b.next();
                    a.next();
                }
            },
        }
    }
    changed.sort();
    changed
}

/// The `changedfields` attribute: the names joined by `,`, with `%`, `,` and
/// control characters in a name percent-encoded (`%25`, `%2C`, `%0A`, ...),
/// so splitting on `,` and percent-decoding each part gives the names back.
pub fn encode_field_list(names: &[String]) -> String {
    let mut out = String::with_capacity(names.iter().map(|n| n.len() + 1).sum());
    for (i, name) in names.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        for ch in name.chars() {
            if ch == '%' || ch == ',' || ch.is_control() {
                let mut buf = [0u8; 4];
                for byte in ch.encode_utf8(&mut buf).bytes() {
                    out.push_str(&format!("%{byte:02X}"));
                }
            } else {
                out.push(ch);
            }
        }
    }
    out
}

/// Reads a `changedfields` attribute back into names (what a consumer does);
/// None when a percent escape is malformed or decodes to invalid UTF-8.
pub fn decode_field_list(text: &str) -> Option<Vec<String>> {
    if text.is_empty() {
        return Some(Vec::new());
    }
    text.split(',')
        .map(|part| {
            let mut bytes = Vec::with_capacity(part.len());
            let mut rest = part.as_bytes();
            while let Some((&b, tail)) = rest.split_first() {
                if b == b'%' {
                    let hex = tail.get(..2)?;
                    let text = std::str::from_utf8(hex).ok()?;
                    bytes.push(u8::from_str_radix(text, 16).ok()?);
                    rest = &tail[2..];
                } else {
                    bytes.push(b);
                    rest = tail;
                }
            }
            String::from_utf8(bytes).ok()
        })
        .collect()
}

/// The name a canonical key stands for. Canonical keys are valid JSON string
/// contents; a lone surrogate escape (which has no UTF-8 form) is kept as its
/// escape text.
fn key_name(canonical_key: &[u8]) -> String {
    let mut quoted = Vec::with_capacity(canonical_key.len() + 2);
    quoted.push(b'"');
    quoted.extend_from_slice(canonical_key);
    quoted.push(b'"');
    serde_json::from_slice(&quoted)
        .unwrap_or_else(|_| String::from_utf8_lossy(canonical_key).into_owned())
}

/// Hashes the members of the top-level object of canonical JSON; None when
/// the value is not an object. Canonical JSON has no whitespace and sorted
/// keys, so members are found by a scan that only tracks strings and nesting;
/// duplicate keys (adjacent after sorting) are hashed together, in order.
fn top_level_fields(canonical: &[u8]) -> Option<FieldHashes> {
    let mut members: Vec<(&[u8], &[u8])> = Vec::new();
    let mut pos = 1;
    if canonical.first() != Some(&b'{') {
        return None;
    }
    if canonical.get(1) == Some(&b'}') {
        return Some(FieldHashes::default());
    }
    loop {
        if canonical.get(pos) != Some(&b'"') {
            return None;
        }
        let key_end = string_end(canonical, pos)?;
        let key = canonical.get(pos + 1..key_end)?;
        pos = key_end + 1;
        if canonical.get(pos) != Some(&b':') {
            return None;
        }
        pos += 1;
        let value_start = pos;
        let mut depth = 0usize;
        loop {
            match *canonical.get(pos)? {
                b'"' => pos = string_end(canonical, pos)?,
                b'{' | b'[' => depth += 1,
                b'}' | b']' if depth == 0 => break,
                b'}' | b']' => depth -= 1,
                b',' if depth == 0 => break,
                _ => {}
            }
            pos += 1;
        }
        members.push((key, canonical.get(value_start..pos)?));
        match canonical.get(pos)? {
            b',' => pos += 1,
            _ => break,
        }
    }
    let mut fields: Vec<(Vec<u8>, FieldHash)> = Vec::with_capacity(members.len());
    let mut i = 0;
    while i < members.len() {
        let key = members[i].0;
        let same = members[i..].iter().take_while(|(k, _)| *k == key).count();
        let digest = if same == 1 {
            blake3::hash(members[i].1)
        } else {
            let mut hasher = blake3::Hasher::new();
            for (n, (_, value)) in members[i..i + same].iter().enumerate() {
                if n > 0 {
                    hasher.update(b",");
                }
                hasher.update(value);
            }
            hasher.finalize()
        };
        let mut hash = [0u8; 8];
        hash.copy_from_slice(&digest.as_bytes()[..8]);
        fields.push((key.to_vec(), hash));
        i += same;
    }
    Some(FieldHashes { fields })
}

/// The index of the closing quote of the string whose opening quote is at `start`.
fn string_end(bytes: &[u8], start: usize) -> Option<usize> {
    let mut i = start + 1;
    loop {
        match *bytes.get(i)? {
            b'"' => return Some(i),
            b'\\' => i += 2,
            _ => i += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::content_hash;

    fn ignore() -> IgnoreKeys {
        IgnoreKeys::new(["updated_at"])
    }

    fn fields(raw: &str) -> FieldHashes {
        let (hash, fields) = content_hash_with_fields(raw, &ignore()).unwrap();
        assert_eq!(
            hash,
            content_hash(raw, &ignore()).unwrap(),
            "same content hash"
        );
        fields.expect("an object")
    }

    fn changed(before: &str, after: &str) -> Vec<String> {
        changed_fields(&fields(before), &fields(after))
    }

    #[test]
    fn changed_added_and_removed_keys_are_listed_sorted_and_unchanged_ones_are_not() {
        assert_eq!(
            changed(
                r#"{"id":1,"title":"a","price":2,"gone":true,"same":[1,{"x":2}]}"#,
                r#"{"id":1,"title":"b","price":3,"new":null,"same":[1,{"x":2}]}"#
            ),
            vec!["gone", "new", "price", "title"]
        );
        assert!(changed(r#"{"a":1}"#, r#"{"a":1}"#).is_empty());
        assert_eq!(changed(r#"{}"#, r#"{"a":1}"#), vec!["a"]);
        assert_eq!(changed(r#"{"a":1}"#, r#"{}"#), vec!["a"]);
        // A key whose value became null is a change; so is null to absent.
        assert_eq!(changed(r#"{"a":1}"#, r#"{"a":null}"#), vec!["a"]);
        assert_eq!(changed(r#"{"a":null}"#, r#"{}"#), vec!["a"]);
    }

    #[test]
    fn ignored_keys_never_count_at_the_top_level_or_inside_a_value() {
        assert!(changed(
            r#"{"id":1,"updated_at":"2024-01-01T00:00:00Z"}"#,
            r#"{"id":1,"updated_at":"2025-01-01T00:00:00Z"}"#
        )
        .is_empty());
        assert!(changed(r#"{"id":1}"#, r#"{"id":1,"updated_at":null}"#).is_empty());
        assert!(changed(
            r#"{"refs":[{"id":3,"updated_at":"x"}]}"#,
            r#"{"refs":[{"updated_at":"y","id":3}]}"#
        )
        .is_empty());
        assert_eq!(
            changed(
                r#"{"refs":[{"id":3,"updated_at":"x"}],"updated_at":1}"#,
                r#"{"refs":[{"id":4,"updated_at":"x"}],"updated_at":2}"#
            ),
            vec!["refs"]
        );
        assert!(!fields(r#"{"updated_at":1,"a":2}"#)
            .keys()
            .any(|k| k == b"updated_at"));
    }

    #[test]
    fn representation_noise_is_not_a_change() {
        assert!(changed(
            r#"{"price":25.0,"title":"Spa \u0044ay","tags":["a","b"],"o":{"y":1,"x":2}}"#,
            "{ \"o\" : {\"x\":2,\"y\":1}, \"tags\":[\"a\",\"b\"], \"title\":\"Spa Day\", \"price\":2.5e1 }"
        )
        .is_empty());
        // But order inside an array is content.
        assert_eq!(
            changed(r#"{"tags":["a","b"]}"#, r#"{"tags":["b","a"]}"#),
            vec!["tags"]
        );
    }

    #[test]
    fn values_holding_structural_characters_in_strings_are_scanned_correctly() {
        let before = r#"{"a":"x,}]\"\\","b":{"c":"{[","d":[1,"]"]},"e":1}"#;
        let after = r#"{"a":"x,}]\"\\","b":{"c":"{[","d":[1,"]"]},"e":2}"#;
        assert_eq!(changed(before, after), vec!["e"]);
        let f = fields(before);
        assert_eq!(f.len(), 3);
        let names: Vec<String> = f.named().map(|(n, _)| n).collect();
        assert_eq!(names, vec!["a", "b", "e"]);
        // Each value hash is the hash of that member's canonical value alone.
        let mut out = Vec::new();
        crate::hash::canonical_json(r#"{"c":"{[","d":[1,"]"]}"#, &ignore(), &mut out).unwrap();
        let b_hash = f.named().find(|(n, _)| n == "b").map(|(_, h)| *h).unwrap();
        assert_eq!(b_hash[..], blake3::hash(&out).as_bytes()[..8]);
    }

    #[test]
    fn keys_with_escapes_are_named_unescaped_and_sorted_by_name() {
        let got = changed(
            r#"{"a\"b":1,"é":1,"line\nbreak":1,"z":1}"#,
            r#"{"a\"b":2,"\u00e9":2,"line\nbreak":2,"z":2}"#,
        );
        assert_eq!(got, vec!["a\"b", "line\nbreak", "z", "é"]);
    }

    #[test]
    fn duplicate_keys_are_one_field_whose_values_count_in_order() {
        let f = fields(r#"{"a":1,"a":2}"#);
        assert_eq!(f.len(), 1);
        assert_eq!(changed(r#"{"a":1,"a":2}"#, r#"{"a":2,"a":1}"#), vec!["a"]);
        assert!(changed(r#"{"a":1,"b":0,"a":2}"#, r#"{"b":0,"a":1,"a":2}"#).is_empty());
    }

    #[test]
    fn a_record_that_is_not_an_object_has_no_field_hashes() {
        for raw in ["[1,2]", "1", "\"x\"", "null"] {
            let (_, fields) = content_hash_with_fields(raw, &ignore()).unwrap();
            assert_eq!(fields, None, "{raw}");
        }
        assert_eq!(fields("{}"), FieldHashes::default());
        assert!(content_hash_with_fields("{", &ignore()).is_err());
    }

    #[test]
    fn the_field_list_percent_encodes_commas_percents_and_control_characters() {
        let names: Vec<String> = ["a,b", "100%", "line\nbreak", "price", "é"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let text = encode_field_list(&names);
        assert_eq!(text, "a%2Cb,100%25,line%0Abreak,price,é");
        assert_eq!(decode_field_list(&text), Some(names));
        assert_eq!(
            encode_field_list(&["price".into(), "title".into()]),
            "price,title"
        );
        assert_eq!(decode_field_list(""), Some(vec![]));
        assert_eq!(decode_field_list("a%2"), None);
        assert_eq!(decode_field_list("a%zz"), None);
    }

    #[test]
    fn field_hashes_rebuild_from_names_or_from_sorted_unique_parts_only() {
        let f = fields(r#"{"b":1,"a\"":2}"#);
        let named: Vec<(String, FieldHash)> = f.named().map(|(n, h)| (n, *h)).collect();
        assert_eq!(
            FieldHashes::from_named(named.into_iter().rev()),
            Some(f.clone())
        );
        let keys: Vec<Vec<u8>> = f.keys().map(<[u8]>::to_vec).collect();
        let hashes: Vec<FieldHash> = f.hashes().copied().collect();
        assert_eq!(
            FieldHashes::from_parts(keys.clone(), hashes.clone()),
            Some(f)
        );
        let mut reversed = keys.clone();
        reversed.reverse();
        assert_eq!(FieldHashes::from_parts(reversed, hashes.clone()), None);
        assert_eq!(FieldHashes::from_parts(keys, vec![]), None);
        assert_eq!(
            FieldHashes::from_named([("a".to_string(), [0; 8]), ("a".to_string(), [1; 8])]),
            None
        );
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;
        use serde_json::{Map, Value};

        fn value() -> impl Strategy<Value = Value> {
            let leaf = prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::Bool),
                (-3i64..3).prop_map(Value::from),
                "[a-c]{0,2}".prop_map(Value::from),
            ];
            leaf.prop_recursive(2, 8, 3, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..3).prop_map(Value::Array),
                    prop::collection::btree_map("[a-c]", inner, 0..3)
                        .prop_map(|m| Value::Object(m.into_iter().collect())),
                ]
            })
        }

        fn object() -> impl Strategy<Value = Map<String, Value>> {
            prop::collection::btree_map("[a-e]{1,2}", value(), 0..6)
                .prop_map(|m| m.into_iter().collect())
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]

            /// Whatever two objects are, the listed keys are exactly those
            /// whose values differ (absent counting as a value of its own),
            /// and `updated_at` never is one of them.
            #[test]
            fn the_listed_keys_are_exactly_the_keys_whose_values_differ(
                before in object(), after in object(), stamp in any::<(u8, u8)>()
            ) {
                let mut b = before.clone();
                let mut a = after.clone();
                b.insert("updated_at".into(), Value::from(stamp.0));
                a.insert("updated_at".into(), Value::from(stamp.1));
                let got = changed(&Value::Object(b).to_string(), &Value::Object(a).to_string());
                let mut keys: Vec<&String> = before.keys().chain(after.keys()).collect();
                keys.sort();
                keys.dedup();
                let expected: Vec<String> = keys
                    .into_iter()
                    .filter(|k| before.get(*k) != after.get(*k))
                    .cloned()
                    .collect();
                prop_assert_eq!(got, expected);
            }
        }
    }
}
