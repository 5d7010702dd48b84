//! Opaque, tamper-proof keyset cursors.
//!
//! A cursor carries the last listed position `(updated_at, id)` and a
//! fingerprint of the query it belongs to, signed with a keyed blake3 MAC
//! under a per-process secret. Any edit, truncation or reuse with another
//! query fails verification, which the API reports as a 422 on `cursor`.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;

/// Keyset position: `updated_at` in microseconds (None sorts first), then id.
pub type SortKey = (Option<i64>, i64);

const VERSION: u8 = 1;
const FINGERPRINT_LEN: usize = 16;
const MAC_LEN: usize = 16;
const PAYLOAD_LEN: usize = 1 + 1 + 8 + 8 + FINGERPRINT_LEN;

/// Why a cursor was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CursorError {
    /// Not base64url or not the right length.
    #[error("cursor is malformed; pass next_cursor back unmodified")]
    Malformed,
    /// The signature does not match: the cursor was edited or forged.
    #[error("cursor signature is invalid; pass next_cursor back unmodified")]
    BadSignature,
    /// The cursor was issued for another tenant, resource or query.
    #[error("cursor belongs to a different query; keep updated_since and include unchanged while paging")]
    WrongQuery,
}

/// Fingerprint of everything that defines a listing besides the cursor.
pub fn query_fingerprint(
    tenant: u64,
    resource: &str,
    updated_since: Option<i64>,
    include_mask: u8,
) -> [u8; FINGERPRINT_LEN] {
    let mut hasher = blake3::Hasher::new();
    hasher.update(&tenant.to_be_bytes());
    hasher.update(resource.as_bytes());
    match updated_since {
        Some(micros) => hasher.update(&[1]).update(&micros.to_be_bytes()),
        None => hasher.update(&[0]),
    };
    hasher.update(&[include_mask]);
    let mut out = [0u8; FINGERPRINT_LEN];
    out.copy_from_slice(&hasher.finalize().as_bytes()[..FINGERPRINT_LEN]);
    out
}

/// Signs and verifies cursors with one secret.
#[derive(Clone)]
pub struct CursorCodec {
    key: [u8; 32],
}

impl CursorCodec {
    /// A codec with the given secret.
    pub fn new(key: [u8; 32]) -> Self {
        Self { key }
    }

    fn mac(&self, payload: &[u8]) -> [u8; MAC_LEN] {
        let mut out = [0u8; MAC_LEN];
        out.copy_from_slice(&blake3::keyed_hash(&self.key, payload).as_bytes()[..MAC_LEN]);
        out
    }

    /// Encodes the position after which the next page starts.
    pub fn encode(&self, position: SortKey, fingerprint: [u8; FINGERPRINT_LEN]) -> String {
        let mut bytes = Vec::with_capacity(PAYLOAD_LEN + MAC_LEN);
        bytes.push(VERSION);
        bytes.push(u8::from(position.0.is_some()));
        bytes.extend_from_slice(&position.0.unwrap_or(0).to_be_bytes());
        bytes.extend_from_slice(&position.1.to_be_bytes());
        bytes.extend_from_slice(&fingerprint);
        let mac = self.mac(&bytes);
        bytes.extend_from_slice(&mac);
        URL_SAFE_NO_PAD.encode(bytes)
    }

    /// Verifies a cursor against the query it is used with and returns its position.
    pub fn decode(
        &self,
        cursor: &str,
        fingerprint: [u8; FINGERPRINT_LEN],
    ) -> Result<SortKey, CursorError> {
        let bytes = URL_SAFE_NO_PAD
            .decode(cursor.as_bytes())
            .map_err(|_| CursorError::Malformed)?;
        if bytes.len() != PAYLOAD_LEN + MAC_LEN {
            return Err(CursorError::Malformed);
        }
        let (payload, mac) = bytes.split_at(PAYLOAD_LEN);
        let expected = self.mac(payload);
        if !constant_time_eq(&expected, mac) {
            return Err(CursorError::BadSignature);
        }
        if payload[0] != VERSION || payload[1] > 1 {
            return Err(CursorError::Malformed);
        }
        if payload[18..] != fingerprint {
            return Err(CursorError::WrongQuery);
        }
        let micros = i64::from_be_bytes(
            payload[2..10]
                .try_into()
                .map_err(|_| CursorError::Malformed)?,
        );
        let id = i64::from_be_bytes(
            payload[10..18]
                .try_into()
                .map_err(|_| CursorError::Malformed)?,
        );
        Ok((if payload[1] == 1 { Some(micros) } else { None }, id))
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn codec() -> CursorCodec {
        CursorCodec::new([7u8; 32])
    }

    #[test]
    fn a_cursor_round_trips_its_position_for_the_same_query() {
        let fp = query_fingerprint(1, "vouchers", Some(5), 3);
        for position in [
            (None, 4),
            (Some(1_700_000_000_000_000), i64::MAX),
            (Some(-3), 0),
        ] {
            let cursor = codec().encode(position, fp);
            assert_eq!(codec().decode(&cursor, fp), Ok(position));
        }
    }

    #[test]
    fn every_single_character_edit_is_refused() {
        let fp = query_fingerprint(1, "vouchers", None, 0);
        let cursor = codec().encode((Some(42), 7), fp);
        let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        for i in 0..cursor.len() {
            let mut bytes = cursor.clone().into_bytes();
            let replacement = alphabet.iter().find(|c| **c != bytes[i]).copied().unwrap();
            bytes[i] = replacement;
            let edited = String::from_utf8(bytes).unwrap();
            assert!(codec().decode(&edited, fp).is_err(), "edit at {i} accepted");
        }
        assert_eq!(
            codec().decode(&cursor[..cursor.len() - 1], fp),
            Err(CursorError::Malformed)
        );
        assert_eq!(
            codec().decode("not base64!", fp),
            Err(CursorError::Malformed)
        );
    }

    #[test]
    fn a_cursor_from_another_secret_or_query_is_refused() {
        let fp = query_fingerprint(1, "vouchers", None, 0);
        let cursor = codec().encode((Some(42), 7), fp);
        let other = CursorCodec::new([8u8; 32]);
        assert_eq!(other.decode(&cursor, fp), Err(CursorError::BadSignature));
        for other_fp in [
            query_fingerprint(2, "vouchers", None, 0),
            query_fingerprint(1, "categories", None, 0),
            query_fingerprint(1, "vouchers", Some(0), 0),
            query_fingerprint(1, "vouchers", None, 1),
        ] {
            assert_eq!(
                codec().decode(&cursor, other_fp),
                Err(CursorError::WrongQuery)
            );
        }
    }
}
