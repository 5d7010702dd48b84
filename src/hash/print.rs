//! Raw prints: a keyed 64-bit fingerprint of a record's exact bytes, kept
//! beside its content hash so that a full sweep can recognise a record it
//! has hashed before without parsing it again.
//!
//! A full sweep lists every record of a stream, and almost all of them are
//! unchanged; the canonical parse and the blake3 digest of each were two
//! fifths of its CPU. A print is xxh3 over the bytes as the API wrote them
//! (no parse, ten times blake3's speed): when it equals the print stored
//! with the committed state, the bytes are the ones that state's content
//! hash was computed from, so the content hash is that hash, and only
//! records whose bytes differ are parsed. A print is a memo of a pure
//! function, never a content hash: it is never published, and a record is
//! only ever compared by content hash.
//!
//! The key ([`PrintKey`]) mixes a random secret of the state store with
//! everything the content hash depends on besides the bytes (the canonical
//! form's version and `poll.ignore_keys`): a print made under other ignore
//! keys never matches. Two records nobody chose to collide share a print
//! with probability 2^-64; seeded xxh3 is not a MAC, so a print is trusted
//! only for a record its page left unhashed, in a full sweep (an edit moves
//! `updated_at`, and incremental sweeps hash what they list in the read
//! pass). See docs/state.md, "Raw prints". Pure functions, no I/O.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::IgnoreKeys;

/// Bumped whenever the canonical form's bytes change (docs/state.md), so that
/// prints stored by an older build stop matching.
const CANONICAL_VERSION: u8 = 1;

/// Length of a store's print secret.
pub const PRINT_SECRET_LEN: usize = 16;

/// The fingerprint of a record's exact bytes under one [`PrintKey`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawPrint(pub u64);

/// The key prints of one store and one hashing configuration are made with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrintKey(u64);

impl PrintKey {
    /// The key of a store whose secret is `secret`, for content hashes
    /// computed without `ignore`.
    pub fn new(secret: &[u8; PRINT_SECRET_LEN], ignore: &IgnoreKeys) -> PrintKey {
        let mut hasher = blake3::Hasher::new_derive_key("voucher-cdc 2026-11 raw print key");
        hasher.update(secret);
        hasher.update(&[CANONICAL_VERSION]);
        for key in ignore.canonical_keys() {
            // Length-prefixed, so that no two sets feed the same bytes.
            hasher.update(&(key.len() as u64).to_le_bytes());
            hasher.update(key);
        }
        let mut seed = [0u8; 8];
        seed.copy_from_slice(&hasher.finalize().as_bytes()[..8]);
        PrintKey(u64::from_le_bytes(seed))
    }

    /// The print of `raw`, a record's bytes exactly as listed.
    #[inline]
    pub fn print(&self, raw: &[u8]) -> RawPrint {
        RawPrint(xxh3_64_with_seed(raw, self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: [u8; PRINT_SECRET_LEN] = *b"0123456789abcdef";

    #[test]
    fn the_same_bytes_under_the_same_key_print_the_same() {
        let key = PrintKey::new(&SECRET, &IgnoreKeys::new(["updated_at"]));
        let again = PrintKey::new(&SECRET, &IgnoreKeys::new(["updated_at"]));
        assert_eq!(key, again);
        assert_eq!(key.print(br#"{"id":1}"#), again.print(br#"{"id":1}"#));
        assert_ne!(key.print(br#"{"id":1}"#), key.print(br#"{"id":2}"#));
        assert_ne!(key.print(br#"{"id":1}"#), key.print(br#"{"id": 1}"#));
    }

    #[test]
    fn other_ignore_keys_or_another_secret_give_another_key() {
        let base = PrintKey::new(&SECRET, &IgnoreKeys::new(["updated_at"]));
        assert_ne!(base, PrintKey::new(&SECRET, &IgnoreKeys::none()));
        assert_ne!(
            base,
            PrintKey::new(&SECRET, &IgnoreKeys::new(["updated_at", "etag"]))
        );
        assert_ne!(
            base,
            PrintKey::new(b"fedcba9876543210", &IgnoreKeys::new(["updated_at"]))
        );
        // Keys are length-prefixed: ["ab"] and ["a", "b"] differ.
        assert_ne!(
            PrintKey::new(&SECRET, &IgnoreKeys::new(["ab"])),
            PrintKey::new(&SECRET, &IgnoreKeys::new(["a", "b"]))
        );
        // The order keys are written in does not matter (the set is sorted).
        assert_eq!(
            PrintKey::new(&SECRET, &IgnoreKeys::new(["a", "b"])),
            PrintKey::new(&SECRET, &IgnoreKeys::new(["b", "a"]))
        );
    }
}
