//! One wrapper for every secret the bridge handles (upstream tokens, admin
//! token, broker passwords): it never shows in Debug, Display or serialized
//! output, so a secret cannot leak through a log line or `check-config`.
//! Also the one rule for a secret given as a file (`token_file` beside
//! `token`), the way container platforms mount them.

use std::fmt;
use std::path::Path;

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

/// Why a `key` / `key_file` pair does not yield a secret; the text names the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretFileError {
    /// Both the value and its file are set.
    #[error("{file_key}: set either {key} or {file_key}, not both")]
    Both {
        /// The full key of the value (`sink.nats.password`).
        key: String,
        /// The full key of its file (`sink.nats.password_file`).
        file_key: String,
    },
    /// The file cannot be read.
    #[error("{file_key}: cannot read {path}: {reason}")]
    Unreadable {
        /// The full key of the file.
        file_key: String,
        /// The file as configured.
        path: String,
        /// The I/O error.
        reason: String,
    },
    /// The file holds nothing but whitespace.
    #[error("{file_key}: {path} is empty")]
    Empty {
        /// The full key of the file.
        file_key: String,
        /// The file as configured.
        path: String,
    },
}

/// The secret of a `key` / `key_file` pair: the value, else the file's
/// content without its trailing newline; `None` when neither is set.
/// Setting both is an error, and so is an empty or unreadable file.
pub fn value_or_file(
    key: &str,
    value: Option<&Secret>,
    file: Option<&Path>,
) -> Result<Option<Secret>, SecretFileError> {
    value_or_named_file(key, &format!("{key}_file"), value, file)
}

/// [`value_or_file`] where the file's key is not `{key}_file`
/// (`sink.kafka.property_files."sasl.password"`).
pub fn value_or_named_file(
    key: &str,
    file_key: &str,
    value: Option<&Secret>,
    file: Option<&Path>,
) -> Result<Option<Secret>, SecretFileError> {
    match (value, file) {
        (Some(_), Some(_)) => Err(SecretFileError::Both {
            key: key.to_string(),
            file_key: file_key.to_string(),
        }),
        (Some(value), None) => Ok(Some(value.clone())),
        (None, Some(path)) => read_secret_file(file_key, path).map(Some),
        (None, None) => Ok(None),
    }
}

/// The secret in `path` (for the error, the value of `file_key`): its content
/// with the trailing line break removed (`\n` or `\r\n`, as editors and
/// `echo` leave it); other whitespace is part of the secret.
pub fn read_secret_file(file_key: &str, path: &Path) -> Result<Secret, SecretFileError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| SecretFileError::Unreadable {
        file_key: file_key.to_string(),
        path: shown.clone(),
        reason: e.to_string(),
    })?;
    if text.trim().is_empty() {
        return Err(SecretFileError::Empty {
            file_key: file_key.to_string(),
            path: shown,
        });
    }
    let value = text
        .strip_suffix('\n')
        .map(|t| t.strip_suffix('\r').unwrap_or(t))
        .unwrap_or(&text);
    Ok(Secret::new(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_file_loses_its_trailing_newline_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("password");
        for (content, expected) in [
            ("pw\n", "pw"),
            ("pw\r\n", "pw"),
            ("pw", "pw"),
            (" pw \n", " pw "),
            ("pw\n\n", "pw\n"),
        ] {
            std::fs::write(&path, content).unwrap();
            let secret = value_or_file("sink.nats.password", None, Some(&path))
                .unwrap()
                .unwrap();
            assert_eq!(secret.expose(), expected, "{content:?}");
        }
    }

    #[test]
    fn exactly_one_of_a_value_and_its_file_may_be_set() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "from-file\n").unwrap();
        let value = Secret::new("inline");
        let both = value_or_file("admin.token", Some(&value), Some(&path)).unwrap_err();
        assert_eq!(
            both.to_string(),
            "admin.token_file: set either admin.token or admin.token_file, not both"
        );
        let inline = value_or_file("admin.token", Some(&value), None).unwrap();
        assert_eq!(
            inline.map(|s| s.expose().to_string()),
            Some("inline".into())
        );
        assert_eq!(value_or_file("admin.token", None, None).unwrap(), None);
        std::fs::write(&path, "\n").unwrap();
        let empty = value_or_file("admin.token", None, Some(&path)).unwrap_err();
        assert!(
            empty.to_string().starts_with("admin.token_file: "),
            "{empty}"
        );
        assert!(empty.to_string().ends_with("is empty"), "{empty}");
        let missing = value_or_file("admin.token", None, Some(&dir.path().join("nope")));
        let missing = missing.unwrap_err().to_string();
        assert!(
            missing.starts_with("admin.token_file: cannot read "),
            "{missing}"
        );
    }

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
