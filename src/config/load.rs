//! Reading the config: figment layering (built-in defaults < TOML file <
//! `VOUCHER_CDC_` env), and turning every figment error into one line that
//! names its key, where it came from (file or variable) and the valid
//! options, so `check-config` lists every problem at once.

use std::path::Path;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::Deserialize;

use super::{Config, ConfigError, RawConfig};

/// Prefix of configuration environment variables (`VOUCHER_CDC_UPSTREAM__TOKEN`).
pub const ENV_PREFIX: &str = "VOUCHER_CDC_";

/// The top-level tables of the config file. An environment variable is a
/// config key when its first `__` segment names one of them
/// (`VOUCHER_CDC_POLL__INTERVAL`); other `VOUCHER_CDC_*` variables without
/// `__` are left alone, since platforms inject them (Kubernetes service links
/// such as `VOUCHER_CDC_METRICS_PORT=tcp://...`).
pub const SECTIONS: &[&str] = &[
    "upstream", "tenants", "poll", "events", "state", "sink", "admin", "log", "shard",
];

/// Prefix of librdkafka properties given through the environment:
/// `VOUCHER_CDC_KAFKA_SASL_MECHANISM=PLAIN` sets `sink.kafka.properties."sasl.mechanism"`.
pub const KAFKA_ENV_PREFIX: &str = "VOUCHER_CDC_KAFKA_";

/// The librdkafka properties in `vars`: each `VOUCHER_CDC_KAFKA_<NAME>`
/// becomes property `<name>` lower-cased with every `_` turned into `.`
/// (no settable librdkafka property has an `_`). Kubernetes service-link
/// variables of a Service named `voucher-cdc-kafka` (`..._PORT`,
/// `..._PORT_<n>_TCP...`, `..._SERVICE_HOST`, `..._SERVICE_PORT...`) are
/// left out.
pub fn kafka_env_properties(
    vars: impl IntoIterator<Item = (String, String)>,
) -> std::collections::BTreeMap<String, String> {
    vars.into_iter()
        .filter_map(|(name, value)| {
            let rest = name.strip_prefix(KAFKA_ENV_PREFIX)?;
            let service_link = rest == "PORT"
                || rest.starts_with("PORT_")
                || rest.starts_with("SERVICE_HOST")
                || rest.starts_with("SERVICE_PORT");
            (!rest.is_empty() && !service_link && !rest.contains("__"))
                .then(|| (rest.to_ascii_lowercase().replace('_', "."), value))
        })
        .collect()
}

/// At most this many problems are collected before the loader gives up.
const MAX_PROBLEMS: usize = 64;

/// Loads the configuration: defaults, then the TOML file (if any), then env.
///
/// `file` is required to exist when given explicitly.
pub fn load(file: Option<&Path>) -> Result<Config, ConfigError> {
    let mut figment = Figment::new();
    if let Some(path) = file {
        check_toml_file(path)?;
        figment = figment.merge(Toml::file(path));
    }
    let mut problems = unknown_env_sections(std::env::vars_os().map(|(k, _)| k));
    let kafka = kafka_env_properties(std::env::vars());
    if !kafka.is_empty() {
        figment = figment.merge(Serialized::default("sink.kafka.properties", kafka));
    }
    let env = Env::prefixed(ENV_PREFIX)
        .filter(|key| is_config_env_key(key.as_str()))
        .split("__");
    match load_from(figment.merge(env)) {
        Ok(config) if problems.is_empty() => Ok(config),
        Ok(_) => Err(ConfigError { problems }),
        Err(e) => {
            problems.extend(e.problems);
            Err(ConfigError { problems })
        }
    }
}

/// True when `key` (a `VOUCHER_CDC_` variable without the prefix) names a
/// config key: its first `__` segment is a section of the config file.
pub fn is_config_env_key(key: &str) -> bool {
    let first = key.split("__").next().unwrap_or_default();
    SECTIONS.iter().any(|s| s.eq_ignore_ascii_case(first))
}

/// One problem per `VOUCHER_CDC_A__B` variable whose section `a` does not exist
/// (a typo); variables without `__` are not config keys and are ignored.
fn unknown_env_sections(names: impl Iterator<Item = std::ffi::OsString>) -> Vec<String> {
    let mut problems: Vec<String> = names
        .filter_map(|name| {
            let name = name.to_str()?.to_string();
            let key = name.get(ENV_PREFIX.len()..)?;
            let is_ours = name[..ENV_PREFIX.len()].eq_ignore_ascii_case(ENV_PREFIX);
            (is_ours && key.contains("__") && !is_config_env_key(key)).then(|| {
                let section = key.split("__").next().unwrap_or_default();
                format!(
                    "{name}: unknown config section `{}`: valid sections are {}",
                    section.to_ascii_lowercase(),
                    SECTIONS.join(", ")
                )
            })
        })
        .collect();
    problems.sort();
    problems
}

/// Checks that `path` exists and is valid TOML; a syntax error is one line
/// with its line and column.
fn check_toml_file(path: &Path) -> Result<(), ConfigError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(ConfigError::one(format!(
                "config file {}: not found",
                path.display()
            )))
        }
        Err(e) => {
            return Err(ConfigError::one(format!(
                "config file {}: cannot read it: {e}",
                path.display()
            )))
        }
    };
    text.parse::<toml::Table>()
        .map(|_| ())
        .map_err(|e| ConfigError::one(toml_syntax_problem(&path.display().to_string(), &text, &e)))
}

/// `config file F: invalid TOML at line L, column C: message`, one line.
fn toml_syntax_problem(origin: &str, text: &str, e: &toml::de::Error) -> String {
    let message = one_line(e.message());
    match e.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
            format!("config file {origin}: invalid TOML at line {line}, column {column}: {message}")
        }
        None => format!("config file {origin}: invalid TOML: {message}"),
    }
}

/// Joins a multi-line message into one line.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Extracts and checks a config from any figment (tests use inline TOML).
///
/// Every problem is reported: a key that does not deserialize is reported and
/// left out, and extraction is tried again, up to a limit; the checks of
/// [`RawConfig::check`] then run on what remains.
pub fn load_from(figment: Figment) -> Result<Config, ConfigError> {
    let mut value = figment.find_value("").map_err(|e| ConfigError {
        problems: e.into_iter().map(|e| one_line(&e.to_string())).collect(),
    })?;
    let mut problems: Vec<String> = Vec::new();
    let mut reported: Vec<String> = Vec::new();
    while problems.len() < MAX_PROBLEMS {
        let errors = match RawConfig::deserialize(&value) {
            Ok(raw) => {
                return match raw.check() {
                    Ok(config) if problems.is_empty() => Ok(config),
                    Ok(_) => Err(ConfigError { problems }),
                    Err(e) => {
                        // A key reported above fell back to its default: no second line for it.
                        problems.extend(e.problems.into_iter().filter(|p| {
                            let key = p.split(':').next().unwrap_or_default();
                            !reported
                                .iter()
                                .any(|r| same_or_nested(r, key) || same_or_nested(key, r))
                        }));
                        Err(ConfigError { problems })
                    }
                };
            }
            Err(errors) => errors,
        };
        let mut progressed = false;
        for e in errors {
            let (key, problem) = render_problem(&figment, &value, &e);
            problems.push(problem);
            reported.push(key);
            progressed |= remove_key(&mut value, &e.path);
        }
        if !progressed {
            break;
        }
    }
    Err(ConfigError { problems })
}

/// True when key path `inner` is `outer` or lies inside it (`tenants[0].id` in `tenants`).
fn same_or_nested(inner: &str, outer: &str) -> bool {
    inner
        .strip_prefix(outer)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '[']))
}

/// Parses and checks a TOML document with no env layer (tests, examples).
pub fn from_toml_str(toml: &str) -> Result<Config, ConfigError> {
    if let Err(e) = toml.parse::<toml::Table>() {
        return Err(ConfigError::one(toml_syntax_problem("<inline>", toml, &e)));
    }
    load_from(Figment::new().merge(Toml::string(toml)))
}

/// A key path in the one notation used everywhere: `tenants[1].resources[0]`.
pub fn key_path<S: AsRef<str>>(segments: &[S]) -> String {
    let mut out = String::new();
    for segment in segments {
        let segment = segment.as_ref();
        if !segment.is_empty() && segment.bytes().all(|b| b.is_ascii_digit()) {
            out.push_str(&format!("[{segment}]"));
        } else {
            if !out.is_empty() {
                out.push('.');
            }
            out.push_str(segment);
        }
    }
    out
}

/// The value at `path` in a figment value tree.
fn value_at<'v>(
    value: &'v figment::value::Value,
    path: &[String],
) -> Option<&'v figment::value::Value> {
    use figment::value::Value;
    path.iter().try_fold(value, |v, segment| match v {
        Value::Dict(_, dict) => dict.get(segment),
        Value::Array(_, items) => items.get(segment.parse::<usize>().ok()?),
        _ => None,
    })
}

/// Removes the key at `path` so the next extraction falls back to its
/// default; inside an array, the array's nearest table loses the whole array
/// (indices of later entries stay as the operator wrote them). False when
/// nothing could be removed.
fn remove_key(value: &mut figment::value::Value, path: &[String]) -> bool {
    use figment::value::Value;
    // The deepest table on the path, and the key under it to drop.
    let mut cut = None;
    let mut node = &*value;
    for (i, segment) in path.iter().enumerate() {
        match node {
            Value::Dict(_, dict) => {
                cut = Some(i);
                match dict.get(segment) {
                    Some(next) => node = next,
                    None => break,
                }
            }
            Value::Array(_, items) => {
                match segment.parse::<usize>().ok().and_then(|n| items.get(n)) {
                    Some(next) => node = next,
                    None => break,
                }
            }
            _ => break,
        }
    }
    let Some(cut) = cut else { return false };
    let mut node = value;
    for segment in &path[..cut] {
        node = match node {
            Value::Dict(_, dict) => match dict.get_mut(segment) {
                Some(next) => next,
                None => return false,
            },
            Value::Array(_, items) => {
                match segment.parse::<usize>().ok().and_then(|n| items.get_mut(n)) {
                    Some(next) => next,
                    None => return false,
                }
            }
            _ => return false,
        };
    }
    match node {
        Value::Dict(_, dict) => dict.remove(&path[cut]).is_some(),
        _ => false,
    }
}

/// One problem line for a figment error, and the key it names.
fn render_problem(
    figment: &Figment,
    value: &figment::value::Value,
    e: &figment::Error,
) -> (String, String) {
    use figment::error::Kind;
    let mut segments = e.path.clone();
    if let Kind::MissingField(field) = &e.kind {
        segments.push(field.to_string());
    }
    let key = key_path(&segments);
    let secret = segments
        .last()
        .is_some_and(|s| s.contains("token") || s.contains("password") || s.contains("secret"));
    let origin = value_at(value, &e.path)
        .and_then(|v| figment.get_metadata(v.tag()))
        .map(|m| {
            if m.name.contains("environment") {
                let var: Vec<String> = e.path.iter().map(|s| s.to_ascii_uppercase()).collect();
                format!(" (from env {ENV_PREFIX}{})", var.join("__"))
            } else {
                m.source
                    .as_ref()
                    .map(|s| format!(" (from {s})"))
                    .unwrap_or_default()
            }
        })
        .unwrap_or_default();
    let kind = describe(&e.kind, secret);
    let line = if key.is_empty() {
        format!("config{origin}: {kind}")
    } else {
        format!("{key}: {kind}{origin}")
    };
    (key, one_line(&line))
}

/// One readable phrase per figment error kind, listing the valid options; a
/// secret's value is never shown.
fn describe(kind: &figment::error::Kind, secret: bool) -> String {
    use figment::error::{Actual, Kind};
    let found = |actual: &Actual| {
        if secret {
            "a value of another type".to_string()
        } else {
            actual.to_string()
        }
    };
    let expected_text = |expected: &str| match expected {
        "f32" | "f64" => "a number".to_string(),
        "u8" | "u16" | "u32" | "u64" | "usize" => "a whole number (0 or more)".to_string(),
        "i8" | "i16" | "i32" | "i64" | "isize" => "a whole number".to_string(),
        other => other.to_string(),
    };
    match kind {
        Kind::UnknownVariant(found, expected) => format!(
            "unknown value `{found}`: valid options are {}",
            expected.join(", ")
        ),
        Kind::UnknownField(found, expected) => format!(
            "unknown key `{found}`: valid keys are {}",
            expected.join(", ")
        ),
        Kind::MissingField(_) => "required".to_string(),
        Kind::InvalidType(actual, expected) | Kind::InvalidValue(actual, expected) => {
            let mut text = format!(
                "expected {}, found {}",
                expected_text(expected),
                found(actual)
            );
            if expected == "a duration" {
                text.push_str(&duration_hint(actual));
            }
            text
        }
        other => other.to_string(),
    }
}

/// `: add a unit, e.g. "30s"` for a bare number where a duration is expected.
fn duration_hint(actual: &figment::error::Actual) -> String {
    use figment::error::Actual;
    let number = match actual {
        Actual::Unsigned(n) => Some(n.to_string()),
        Actual::Signed(n) => Some(n.to_string()),
        Actual::Float(n) => Some(n.to_string()),
        Actual::Str(s) if s.trim().parse::<f64>().is_ok() => Some(s.trim().to_string()),
        _ => None,
    };
    match number {
        Some(n) => format!(": add a unit, e.g. \"{n}s\" (s, m, h, d)"),
        None => ": write a duration like \"30s\", \"5m\" or \"1h\"".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kafka_properties_map_from_the_environment_without_service_links() {
        let vars = [
            ("VOUCHER_CDC_KAFKA_SASL_MECHANISM", "PLAIN"),
            ("VOUCHER_CDC_KAFKA_SSL_CA_LOCATION", "/ca.pem"),
            ("VOUCHER_CDC_KAFKA_PORT", "tcp://10.0.0.1:9092"),
            ("VOUCHER_CDC_KAFKA_PORT_9092_TCP_ADDR", "10.0.0.1"),
            ("VOUCHER_CDC_KAFKA_SERVICE_HOST", "10.0.0.1"),
            ("VOUCHER_CDC_KAFKA_SERVICE_PORT_KAFKA", "9092"),
            ("VOUCHER_CDC_SINK__KAFKA__BROKERS", "b:9092"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let properties = kafka_env_properties(vars);
        assert_eq!(
            properties.into_iter().collect::<Vec<_>>(),
            vec![
                ("sasl.mechanism".to_string(), "PLAIN".to_string()),
                ("ssl.ca.location".to_string(), "/ca.pem".to_string()),
            ]
        );
    }

    #[test]
    // figment::Jail's closure must return figment's (large) error type.
    #[allow(clippy::result_large_err)]
    fn sasl_settings_given_only_through_the_environment_reach_the_kafka_client_config() {
        figment::Jail::expect_with(|jail| {
            jail.clear_env();
            for (name, value) in [
                ("VOUCHER_CDC_UPSTREAM__BASE_URL", "http://x/api/external/v1"),
                ("VOUCHER_CDC_UPSTREAM__TOKEN", "t"),
                ("VOUCHER_CDC_TENANTS", "[{id=1}]"),
                ("VOUCHER_CDC_SINK__KIND", "kafka"),
                ("VOUCHER_CDC_SINK__KAFKA__BROKERS", "127.0.0.1:9092"),
                ("VOUCHER_CDC_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT"),
                ("VOUCHER_CDC_KAFKA_SASL_MECHANISM", "PLAIN"),
                ("VOUCHER_CDC_KAFKA_SASL_USERNAME", "bridge"),
                ("VOUCHER_CDC_KAFKA_SASL_PASSWORD", "env-secret"),
            ] {
                jail.set_env(name, value);
            }
            let config = load(None).map_err(|e| e.to_string())?;
            let crate::config::SinkBackendConfig::Kafka(kafka) = &config.sink.backend else {
                return Err("not the kafka sink".into());
            };
            let client = crate::sinks::kafka::client_config(kafka);
            assert_eq!(client.get("security.protocol"), Some("SASL_PLAINTEXT"));
            assert_eq!(client.get("sasl.mechanism"), Some("PLAIN"));
            assert_eq!(client.get("sasl.username"), Some("bridge"));
            assert_eq!(client.get("sasl.password"), Some("env-secret"));
            assert!(!config.redacted_toml().contains("env-secret"));
            Ok(())
        });
    }

    #[test]
    fn sections_are_the_top_level_keys_of_the_config() {
        let err = Figment::new()
            .merge(Toml::string("__probe = 1\n"))
            .extract::<RawConfig>()
            .unwrap_err();
        let expected = err
            .into_iter()
            .find_map(|e| match e.kind {
                figment::error::Kind::UnknownField(_, expected) => Some(expected),
                _ => None,
            })
            .unwrap();
        assert_eq!(expected.to_vec(), SECTIONS.to_vec());
    }

    #[test]
    fn only_variables_naming_a_section_are_config_keys() {
        assert!(is_config_env_key("POLL__INTERVAL"));
        assert!(is_config_env_key("poll__intervall"));
        assert!(is_config_env_key("SINK__NATS__URL"));
        for injected in [
            "METRICS_PORT",
            "METRICS_SERVICE_HOST",
            "METRICS_PORT_9464_TCP_ADDR",
            "SERVICE_PORT_ADMIN",
            "PORT",
            "CONFIG",
            "POLL_SERVICE_HOST",
        ] {
            assert!(!is_config_env_key(injected), "{injected}");
        }
        let problems = unknown_env_sections(
            [
                "VOUCHER_CDC_POL__INTERVAL",
                "VOUCHER_CDC_METRICS_PORT",
                "VOUCHER_CDC_POLL__INTERVALL",
                "OTHER_A__B",
            ]
            .into_iter()
            .map(std::ffi::OsString::from),
        );
        assert_eq!(
            problems,
            vec!["VOUCHER_CDC_POL__INTERVAL: unknown config section `pol`: valid sections are upstream, tenants, poll, events, state, sink, admin, log, shard"]
        );
    }

    #[test]
    fn key_paths_use_one_notation() {
        assert_eq!(
            key_path(&["tenants", "1", "resources", "0"]),
            "tenants[1].resources[0]"
        );
        assert_eq!(key_path(&["poll", "interval"]), "poll.interval");
        assert_eq!(key_path::<&str>(&[]), "");
    }

    #[test]
    fn a_toml_syntax_error_names_its_line_and_column() {
        let err = from_toml_str("[poll]\ninterval = \"30s\"\njitter = = 1\n").unwrap_err();
        assert_eq!(err.problems.len(), 1, "{err}");
        assert!(
            err.problems[0]
                .starts_with("config file <inline>: invalid TOML at line 3, column 10: "),
            "{err}"
        );
    }
}
