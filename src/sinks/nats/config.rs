//! `[sink.nats]`: how to reach NATS and which JetStream stream receives the
//! events, validated apart from any I/O so `check-config` can report every
//! mistake without a server.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{NatsSink, NatsSinkError};
use crate::secret::{value_or_file, SecretFileError};
pub use crate::secret::{Secret, REDACTED};

/// Upper bound of every `[sink.nats]` duration.
const MAX_DURATION: Duration = Duration::from_secs(7 * 86_400);

/// Configuration of the NATS JetStream sink (`[sink.nats]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsSinkConfig {
    /// Server URL, or several comma-separated URLs of one cluster.
    #[serde(default = "default_url")]
    pub url: String,
    /// JetStream stream that stores the events; created or updated at start.
    #[serde(default = "default_stream")]
    pub stream: String,
    /// First subject token; events go to `{subject_prefix}.{tenant}.{type}`.
    #[serde(default = "default_subject_prefix")]
    pub subject_prefix: String,
    /// Window in which the stream drops a message whose `Nats-Msg-Id` it already stored.
    #[serde(default = "default_duplicate_window", with = "humantime_serde")]
    pub duplicate_window: Duration,
    /// NATS user credentials (JWT + nkey seed, the content of a `.creds` file).
    #[serde(default)]
    pub credentials: Option<Secret>,
    /// NATS credentials file (`.creds`), instead of `credentials`.
    #[serde(default)]
    pub credentials_file: Option<PathBuf>,
    /// An nkey user seed (`SU...`).
    #[serde(default)]
    pub nkey_seed: Option<Secret>,
    /// File holding an nkey user seed, instead of `nkey_seed`.
    #[serde(default)]
    pub nkey_seed_file: Option<PathBuf>,
    /// User name for user/password authentication.
    #[serde(default)]
    pub user: Option<String>,
    /// Password for user/password authentication.
    #[serde(default)]
    pub password: Option<Secret>,
    /// File holding the password, instead of `password`.
    #[serde(default)]
    pub password_file: Option<PathBuf>,
    /// Token authentication.
    #[serde(default)]
    pub token: Option<Secret>,
    /// File holding the token, instead of `token`.
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// TLS settings.
    #[serde(default)]
    pub tls: NatsTlsConfig,
    /// Most publishes awaiting their PubAck at once (over all streams).
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: usize,
    /// How long one publish may wait to be sent and acknowledged before it counts as failed.
    #[serde(default = "default_publish_timeout", with = "humantime_serde")]
    pub publish_timeout: Duration,
    /// How long start-up keeps trying to reach a server before it gives up.
    #[serde(default = "default_connect_timeout", with = "humantime_serde")]
    pub connect_timeout: Duration,
}

/// TLS settings of the NATS connection (`[sink.nats.tls]`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsTlsConfig {
    /// PEM file with the CA certificates that sign the server certificate.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate, for mutual TLS (needs `key_file`).
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    /// PEM private key of `cert_file`.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// Refuse to talk to a server without TLS.
    #[serde(default = "default_tls_required")]
    pub required: bool,
}

fn default_url() -> String {
    "nats://127.0.0.1:4222".to_string()
}

fn default_stream() -> String {
    "VOUCHER_CDC".to_string()
}

fn default_subject_prefix() -> String {
    "voucher_cdc".to_string()
}

fn default_duplicate_window() -> Duration {
    Duration::from_secs(10 * 60)
}

fn default_max_in_flight() -> usize {
    1024
}

fn default_publish_timeout() -> Duration {
    Duration::from_secs(10)
}

fn default_connect_timeout() -> Duration {
    Duration::from_secs(30)
}

fn default_tls_required() -> bool {
    false
}

impl Default for NatsSinkConfig {
    fn default() -> Self {
        Self {
            url: default_url(),
            stream: default_stream(),
            subject_prefix: default_subject_prefix(),
            duplicate_window: default_duplicate_window(),
            credentials: None,
            credentials_file: None,
            nkey_seed: None,
            nkey_seed_file: None,
            user: None,
            password: None,
            password_file: None,
            token: None,
            token_file: None,
            tls: NatsTlsConfig::default(),
            max_in_flight: default_max_in_flight(),
            publish_timeout: default_publish_timeout(),
            connect_timeout: default_connect_timeout(),
        }
    }
}

/// A `[sink.nats]` value that cannot work, named by its key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("sink.nats.{key}: {reason}")]
pub struct NatsConfigError {
    /// The offending key below `sink.nats`.
    pub key: &'static str,
    /// Why the value is rejected.
    pub reason: String,
}

fn invalid(key: &'static str, reason: impl Into<String>) -> NatsConfigError {
    NatsConfigError {
        key,
        reason: reason.into(),
    }
}

impl NatsSinkConfig {
    /// Builds the sink: validates, connects, and creates or updates the stream.
    pub async fn build(&self) -> Result<NatsSink, NatsSinkError> {
        NatsSink::connect(self).await
    }

    /// A copy with every secret replaced by `<redacted>`, for `check-config`.
    pub fn redacted(&self) -> Self {
        let hide = |s: &Option<Secret>| s.as_ref().map(|_| Secret::new(REDACTED));
        Self {
            credentials: hide(&self.credentials),
            nkey_seed: hide(&self.nkey_seed),
            password: hide(&self.password),
            token: hide(&self.token),
            ..self.clone()
        }
    }

    /// A copy with every secret file read into its value (`token_file` into
    /// `token`, and so on) and the file cleared, so the sink never reads a
    /// file again: an error names the key whose file is missing, empty, or
    /// set beside its value.
    pub fn with_secrets_read(&self) -> Result<Self, SecretFileError> {
        let read = |key: &str, value: &Option<Secret>, file: &Option<PathBuf>| {
            value_or_file(&format!("sink.nats.{key}"), value.as_ref(), file.as_deref())
        };
        Ok(Self {
            credentials: read("credentials", &self.credentials, &self.credentials_file)?,
            credentials_file: None,
            nkey_seed: read("nkey_seed", &self.nkey_seed, &self.nkey_seed_file)?,
            nkey_seed_file: None,
            password: read("password", &self.password, &self.password_file)?,
            password_file: None,
            token: read("token", &self.token, &self.token_file)?,
            token_file: None,
            ..self.clone()
        })
    }

    /// The server URLs, split at commas and trimmed.
    pub fn urls(&self) -> Vec<String> {
        self.url
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(str::to_string)
            .collect()
    }

    /// The subjects the stream listens on: `{subject_prefix}.>`.
    pub fn stream_subject(&self) -> String {
        format!("{}.>", self.subject_prefix)
    }

    /// Checks every value that can be checked without a server.
    pub fn validate(&self) -> Result<(), NatsConfigError> {
        let urls = self.urls();
        if urls.is_empty() {
            return Err(invalid("url", "no server URL given"));
        }
        for u in &urls {
            validate_url(u)?;
        }
        validate_stream_name(&self.stream)?;
        validate_subject_prefix(&self.subject_prefix)?;
        if self.duplicate_window.is_zero() {
            return Err(invalid(
                "duplicate_window",
                "must be longer than zero, or re-published events are stored twice",
            ));
        }
        self.validate_auth()?;
        if self.tls.cert_file.is_some() != self.tls.key_file.is_some() {
            return Err(invalid(
                "tls",
                "cert_file and key_file must be given together",
            ));
        }
        if self.max_in_flight == 0 {
            return Err(invalid("max_in_flight", "must be at least 1"));
        }
        if self.publish_timeout.is_zero() {
            return Err(invalid("publish_timeout", "must be longer than zero"));
        }
        if self.connect_timeout.is_zero() {
            return Err(invalid("connect_timeout", "must be longer than zero"));
        }
        // Longer values are mistakes, and would overflow deadline arithmetic.
        for (key, value) in [
            ("duplicate_window", self.duplicate_window),
            ("publish_timeout", self.publish_timeout),
            ("connect_timeout", self.connect_timeout),
        ] {
            if value > MAX_DURATION {
                return Err(invalid(
                    key,
                    format!(
                        "{} is too long: at most {}",
                        humantime::format_duration(value),
                        humantime::format_duration(MAX_DURATION)
                    ),
                ));
            }
        }
        Ok(())
    }

    fn validate_auth(&self) -> Result<(), NatsConfigError> {
        let password = self.password.is_some() || self.password_file.is_some();
        if password && self.user.is_none() {
            return Err(invalid("password", "given without `user`"));
        }
        if self.user.is_some() && !password {
            return Err(invalid("user", "given without `password`"));
        }
        let methods = [
            (
                "credentials_file",
                self.credentials.is_some() || self.credentials_file.is_some(),
            ),
            (
                "nkey_seed_file",
                self.nkey_seed.is_some() || self.nkey_seed_file.is_some(),
            ),
            ("user", self.user.is_some()),
            ("token", self.token.is_some() || self.token_file.is_some()),
        ];
        let chosen: Vec<&str> = methods
            .iter()
            .filter(|(_, set)| *set)
            .map(|(name, _)| *name)
            .collect();
        if chosen.len() > 1 {
            return Err(invalid(
                "credentials_file",
                format!(
                    "choose one authentication method, got {}: valid options are credentials_file (or credentials), nkey_seed_file (or nkey_seed), user + password, token",
                    chosen.join(", ")
                ),
            ));
        }
        Ok(())
    }
}

fn validate_url(raw: &str) -> Result<(), NatsConfigError> {
    // Bare `host:port` is accepted by the client; give it a scheme to parse it.
    let with_scheme = if raw.contains("://") {
        raw.to_string()
    } else {
        format!("nats://{raw}")
    };
    let parsed = url::Url::parse(&with_scheme)
        .map_err(|e| invalid("url", format!("`{raw}` is not a URL: {e}")))?;
    match parsed.scheme() {
        "nats" | "tls" => {}
        other => {
            return Err(invalid(
                "url",
                format!("`{raw}` has scheme `{other}`: valid options are nats, tls"),
            ))
        }
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(invalid("url", format!("`{raw}` has no host")));
    }
    Ok(())
}

fn validate_stream_name(name: &str) -> Result<(), NatsConfigError> {
    if name.is_empty() {
        return Err(invalid("stream", "must not be empty"));
    }
    if let Some(c) = name
        .chars()
        .find(|c| c.is_whitespace() || matches!(c, '.' | '*' | '>' | '/' | '\\'))
    {
        return Err(invalid(
            "stream",
            format!("`{name}` contains `{c}`, which stream names may not contain"),
        ));
    }
    Ok(())
}

fn validate_subject_prefix(prefix: &str) -> Result<(), NatsConfigError> {
    if prefix.is_empty() {
        return Err(invalid("subject_prefix", "must not be empty"));
    }
    for token in prefix.split('.') {
        if token.is_empty() {
            return Err(invalid(
                "subject_prefix",
                format!("`{prefix}` has an empty subject token"),
            ));
        }
        if let Some(c) = token
            .chars()
            .find(|c| c.is_whitespace() || matches!(c, '*' | '>'))
        {
            return Err(invalid(
                "subject_prefix",
                format!("`{prefix}` contains `{c}`, which subjects may not contain"),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(toml_text: &str) -> Result<NatsSinkConfig, toml::de::Error> {
        toml::from_str(toml_text)
    }

    #[test]
    fn an_empty_table_gives_the_documented_defaults() {
        let config = parse("").unwrap();
        assert_eq!(config, NatsSinkConfig::default());
        assert_eq!(config.urls(), vec!["nats://127.0.0.1:4222"]);
        assert_eq!(config.stream, "VOUCHER_CDC");
        assert_eq!(config.stream_subject(), "voucher_cdc.>");
        assert_eq!(config.duplicate_window, Duration::from_secs(600));
        assert_eq!(config.publish_timeout, Duration::from_secs(10));
        config.validate().unwrap();
    }

    #[test]
    fn several_comma_separated_urls_are_split_and_trimmed() {
        let config = parse(r#"url = "nats://a:4222, nats://b:4222 ,c:4222""#).unwrap();
        assert_eq!(
            config.urls(),
            vec!["nats://a:4222", "nats://b:4222", "c:4222"]
        );
        config.validate().unwrap();
    }

    #[test]
    fn an_absurd_timeout_is_a_config_error_not_an_overflow() {
        let config = parse(r#"connect_timeout = "100000years""#).unwrap();
        let err = config.validate().unwrap_err().to_string();
        assert!(
            err.starts_with("sink.nats.connect_timeout: 100000years is too long: at most 7days"),
            "{err}"
        );
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let err = parse(r#"subjects = "x""#).unwrap_err().to_string();
        assert!(err.contains("unknown field `subjects`"), "{err}");
    }

    #[test]
    fn durations_are_humantime() {
        let config = parse(
            r#"duplicate_window = "2m"
publish_timeout = "1500ms""#,
        )
        .unwrap();
        assert_eq!(config.duplicate_window, Duration::from_secs(120));
        assert_eq!(config.publish_timeout, Duration::from_millis(1500));
    }

    #[test]
    fn secrets_never_show_in_debug_output_and_are_redacted_for_check_config() {
        let config = parse(
            r#"user = "bridge"
password = "hunter2""#,
        )
        .unwrap();
        assert_eq!(config.password.as_ref().unwrap().expose(), "hunter2");
        let debug = format!("{config:?}");
        assert!(!debug.contains("hunter2"), "{debug}");
        let redacted = config.redacted();
        assert_eq!(redacted.password.unwrap().expose(), REDACTED);
        assert_eq!(redacted.user.as_deref(), Some("bridge"));
        let token = parse(r#"token = "s3cr3t""#).unwrap();
        assert!(!format!("{token:?}").contains("s3cr3t"));
        assert_eq!(token.redacted().token.unwrap().expose(), REDACTED);
    }

    #[test]
    fn invalid_values_are_named_by_key() {
        let cases = [
            (r#"url = "http://x:4222""#, "sink.nats.url"),
            (r#"url = " , ""#, "sink.nats.url"),
            (r#"stream = "a.b""#, "sink.nats.stream"),
            (r#"subject_prefix = "a..b""#, "sink.nats.subject_prefix"),
            (r#"subject_prefix = "a.>""#, "sink.nats.subject_prefix"),
            (r#"duplicate_window = "0s""#, "sink.nats.duplicate_window"),
            (r#"password = "p""#, "sink.nats.password"),
            (r#"max_in_flight = 0"#, "sink.nats.max_in_flight"),
            ("[tls]\ncert_file = \"c.pem\"", "sink.nats.tls"),
        ];
        for (text, key) in cases {
            let err = parse(text).unwrap().validate().unwrap_err().to_string();
            assert!(err.starts_with(key), "{text}: {err}");
        }
    }

    #[test]
    fn two_authentication_methods_are_rejected_with_the_valid_options() {
        let err = parse(
            r#"token = "t"
nkey_seed_file = "seed.nk""#,
        )
        .unwrap()
        .validate()
        .unwrap_err()
        .to_string();
        assert!(err.contains("nkey_seed_file, token"), "{err}");
        assert!(err.contains("valid options are"), "{err}");
    }
}
