//! One wrapper for every secret the bridge handles (upstream tokens, admin
//! token, broker passwords): it never shows in Debug, Display or serialized
//! output, so a secret cannot leak through a log line or `check-config`.

use std::fmt;

use serde::{Deserialize, Serialize, Serializer};

/// What a secret looks like wherever it is printed.
pub const REDACTED: &str = "<redacted>";

/// A secret string; [`Secret::expose`] is the only way to read it.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret value.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret itself; call only where it is handed to a protocol.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// A short non-secret identifier (first 8 hex digits of the blake3 hash) for logs and metrics.
    pub fn fingerprint(&self) -> String {
        let hash = blake3::hash(self.0.as_bytes());
        hex::encode(&hash.as_bytes()[..4])
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Self {
        Self(value)
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(REDACTED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_never_prints_and_never_serializes() {
        let s = Secret::new("hunter2-token");
        assert_eq!(format!("{s:?}"), REDACTED);
        assert_eq!(format!("{s}"), REDACTED);
        assert_eq!(serde_json::to_string(&s).unwrap(), "\"<redacted>\"");
        assert_eq!(s.expose(), "hunter2-token");
        let back: Secret = serde_json::from_str("\"abc\"").unwrap();
        assert_eq!(back.expose(), "abc");
    }

    #[test]
    fn fingerprints_are_stable_short_and_differ_between_secrets() {
        let a = Secret::new("token-a");
        assert_eq!(a.fingerprint(), Secret::new("token-a").fingerprint());
        assert_ne!(a.fingerprint(), Secret::new("token-b").fingerprint());
        assert_eq!(a.fingerprint().len(), 8);
        assert!(!a.fingerprint().contains("token"));
    }
}
