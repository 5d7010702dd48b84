//! Content hashes: the 128-bit blake3 digest every hash the bridge publishes
//! is, and the content hash of a record — blake3 over the canonical form of
//! its JSON (`canonical.rs`, specified in docs/state.md), so that
//! representation noise never looks like a change. Pure functions, no I/O.

mod canonical;
mod fields;
mod print;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use canonical::{escape_key, with_canonical, with_canonical_at};
pub(crate) use canonical::{plain_run_end, RecordHead, ValueSpan};
pub use fields::{
    changed_fields, content_hash_with_fields, decode_field_list, encode_field_list, FieldHash,
    FieldHashes,
};
pub use print::{PrintKey, RawPrint, PRINT_SECRET_LEN};

/// The first 16 bytes of a blake3 digest: the 128-bit form of every hash the
/// bridge publishes (content hashes, event ids, replay data hashes).
pub fn truncated(digest: &blake3::Hash) -> [u8; 16] {
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest.as_bytes()[..16]);
    bytes
}

/// The 32 lowercase hex digits of a 128-bit hash: written straight into the
/// string's bytes (two of every event's attributes are such digits, and
/// `hex::encode` builds them a `char` at a time).
pub fn hex128(bytes: &[u8; 16]) -> String {
    Hex128::of(bytes).as_str().to_owned()
}

/// The 32 hex digits of a 128-bit hash held on the stack: an event writes
/// its hashes into its id's input and its payload and keeps no copy, so
/// they need no allocation of their own.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Hex128([u8; 32]);

impl Hex128 {
    /// The digits of `bytes`.
    pub fn of(bytes: &[u8; 16]) -> Self {
        Hex128(hex_digits(bytes))
    }

    /// The digits as text.
    pub fn as_str(&self) -> &str {
        // Hex digits are ASCII; the fallback cannot be reached.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl fmt::Debug for Hex128 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The 32 lowercase hex digits of a 128-bit hash, as ASCII bytes.
fn hex_digits(bytes: &[u8; 16]) -> [u8; 32] {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = [0u8; 32];
    for (pair, byte) in out.chunks_exact_mut(2).zip(bytes) {
        pair[0] = DIGITS[usize::from(byte >> 4)];
        pair[1] = DIGITS[usize::from(byte & 0xf)];
    }
    out
}

/// A 128-bit content hash of a record's canonical JSON.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContentHash(pub [u8; 16]);

impl ContentHash {
    /// The 32 lowercase hex digits of the hash.
    pub fn to_hex(&self) -> String {
        hex128(&self.0)
    }

    /// The 32 lowercase hex digits of the hash, held on the stack.
    pub fn digits(&self) -> Hex128 {
        Hex128::of(&self.0)
    }

    /// Parses 32 hex digits.
    pub fn from_hex(text: &str) -> Result<ContentHash, HashError> {
        let mut bytes = [0u8; 16];
        hex::decode_to_slice(text, &mut bytes).map_err(|e| HashError::InvalidHash {
            text: text.chars().take(40).collect(),
            reason: e.to_string(),
        })?;
        Ok(ContentHash(bytes))
    }
}

impl fmt::Display for ContentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let digits = hex_digits(&self.0);
        // Hex digits are ASCII: this never fails.
        f.write_str(std::str::from_utf8(&digits).map_err(|_| fmt::Error)?)
    }
}

impl fmt::Debug for ContentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ContentHash({self})")
    }
}

impl FromStr for ContentHash {
    type Err = HashError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ContentHash::from_hex(s)
    }
}

impl Serialize for ContentHash {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ContentHash {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        ContentHash::from_hex(&text).map_err(serde::de::Error::custom)
    }
}

/// Why a record could not be hashed, or a hash could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HashError {
    /// The record is not valid JSON.
    #[error("invalid json at byte {offset}: {reason}")]
    InvalidJson {
        /// Byte offset of the problem in the record text.
        offset: usize,
        /// What was wrong there.
        reason: &'static str,
    },
    /// A content hash in text form is not 32 hex digits.
    #[error("invalid content hash `{text}`: {reason}")]
    InvalidHash {
        /// The offending text (truncated).
        text: String,
        /// What was wrong with it.
        reason: String,
    },
}

/// Object keys left out of the content hash at any depth (`poll.ignore_keys`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IgnoreKeys {
    /// Canonical escaped bytes of each key, without quotes.
    keys: Vec<Vec<u8>>,
}

impl IgnoreKeys {
    /// Builds the set from key names as written in the config.
    pub fn new<I, S>(keys: I) -> IgnoreKeys
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut canonical: Vec<Vec<u8>> = keys
            .into_iter()
            .map(|key| escape_key(key.as_ref()))
            .collect();
        canonical.sort();
        canonical.dedup();
        IgnoreKeys { keys: canonical }
    }

    /// An empty set: every key counts.
    pub fn none() -> IgnoreKeys {
        IgnoreKeys { keys: Vec::new() }
    }

    /// True when no key is ignored.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The keys, escaped canonically and without quotes, sorted.
    fn canonical_keys(&self) -> impl Iterator<Item = &[u8]> {
        self.keys.iter().map(Vec::as_slice)
    }

    /// True when `canonical_key` (escaped canonically, without quotes) is ignored.
    #[inline]
    fn contains(&self, canonical_key: &[u8]) -> bool {
        !self.keys.is_empty() && self.keys.iter().any(|k| k.as_slice() == canonical_key)
    }
}

/// Computes the content hash of one record's raw JSON text.
pub fn content_hash(raw: &str, ignore: &IgnoreKeys) -> Result<ContentHash, HashError> {
    with_canonical(raw, ignore, |canonical| {
        ContentHash(truncated(&blake3::hash(canonical)))
    })
}

/// The content hash of the one JSON value starting at `start` in `input` (a
/// record inside a list page), and what the same pass found of it: where it
/// ends, its top-level `id` and `updated_at` (see [`RecordHead`]). The hash
/// is [`content_hash`] of the value's text.
pub(crate) fn content_hash_at(
    input: &str,
    start: usize,
    ignore: &IgnoreKeys,
) -> Result<(ContentHash, RecordHead), HashError> {
    with_canonical_at(input, start, ignore, |canonical| {
        ContentHash(truncated(&blake3::hash(canonical)))
    })
}

/// Writes the canonical form of `raw` into `out` (cleared first); exposed for
/// tests and debugging (`content_hash` is blake3 over exactly these bytes).
pub fn canonical_json(raw: &str, ignore: &IgnoreKeys, out: &mut Vec<u8>) -> Result<(), HashError> {
    with_canonical(raw, ignore, |canonical| {
        out.clear();
        out.extend_from_slice(canonical);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        #[test]
        fn hex128_writes_the_same_digits_as_the_hex_crate(bytes in proptest::prelude::any::<[u8; 16]>()) {
            proptest::prop_assert_eq!(hex128(&bytes), hex::encode(bytes));
            let digits = ContentHash(bytes).digits();
            proptest::prop_assert_eq!(digits.as_str(), hex::encode(bytes));
        }
    }

    #[test]
    fn content_hash_round_trips_through_hex_and_serde() {
        let h = content_hash(r#"{"id":1}"#, &IgnoreKeys::none()).unwrap();
        assert_eq!(h.to_hex().len(), 32);
        assert_eq!(h.to_string(), h.to_hex());
        assert_eq!(ContentHash::from_hex(&h.to_hex()).unwrap(), h);
        assert_eq!(h.to_hex().parse::<ContentHash>().unwrap(), h);
        let json = serde_json::to_string(&h).unwrap();
        assert_eq!(json, format!("\"{h}\""));
        assert_eq!(serde_json::from_str::<ContentHash>(&json).unwrap(), h);
        let err = ContentHash::from_hex("xyz").unwrap_err().to_string();
        assert!(err.starts_with("invalid content hash `xyz`: "), "{err}");
        assert!(serde_json::from_str::<ContentHash>("\"00\"").is_err());
    }

    #[test]
    fn an_ignore_set_is_empty_only_without_keys() {
        assert!(IgnoreKeys::none().is_empty());
        assert!(IgnoreKeys::new(Vec::<String>::new()).is_empty());
        assert!(!IgnoreKeys::new(["updated_at"]).is_empty());
    }

    #[test]
    fn truncated_keeps_the_first_sixteen_bytes_of_the_digest() {
        let digest = blake3::hash(b"voucher-cdc");
        assert_eq!(truncated(&digest)[..], digest.as_bytes()[..16]);
        assert_eq!(
            content_hash("[]", &IgnoreKeys::none()).unwrap(),
            ContentHash(truncated(&blake3::hash(b"[]")))
        );
    }

    #[test]
    fn zero_is_written_without_a_sign_whatever_sign_the_record_gave_it() {
        let mut out = Vec::new();
        canonical_json(
            r#"{"a":0,"b":-0,"c":[0,-1]}"#,
            &IgnoreKeys::new(["x"]),
            &mut out,
        )
        .unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            r#"{"a":0,"b":0,"c":[0,-1]}"#
        );
    }
}
