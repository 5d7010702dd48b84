//! What the operator writes: the configuration structs, their documented
//! defaults, figment layering (defaults < TOML file < `VOUCHER_CDC_` env) and a
//! validation pass that reports every problem as one line naming its key.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::providers::{Env, Format, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

use crate::shard::{Shard, ShardConfig};
use crate::sinks::file::FileSinkConfig;
use crate::sinks::kafka::KafkaSinkConfig;
use crate::sinks::nats::NatsSinkConfig;
use crate::stream::{Resource, StreamKey, TenantId};
use crate::telemetry::LogFormat;

/// Prefix of configuration environment variables (`VOUCHER_CDC_UPSTREAM__TOKEN`).
pub const ENV_PREFIX: &str = "VOUCHER_CDC_";

pub use crate::secret::Secret;

/// The whole configuration file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The External Voucher API to poll.
    #[serde(default)]
    pub upstream: UpstreamConfig,
    /// The tenants to stream; at least one.
    #[serde(default)]
    pub tenants: Vec<TenantConfig>,
    /// Sweep timing and change detection.
    #[serde(default)]
    pub poll: PollConfig,
    /// Where the state store lives.
    #[serde(default)]
    pub state: StateConfig,
    /// Where events go.
    #[serde(default)]
    pub sink: SinkConfig,
    /// The admin HTTP API (health, metrics, status, replay).
    #[serde(default)]
    pub admin: AdminConfig,
    /// Logging.
    #[serde(default)]
    pub log: LogConfig,
    /// Tenant sharding across several daemons.
    #[serde(default)]
    pub shard: ShardConfig,
}

/// `[upstream]`: the API and its credentials.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    /// Base URL including `/api/external/v1`. Required.
    #[serde(default)]
    pub base_url: Option<String>,
    /// Bearer token (or use `token_file`, or env `VOUCHER_CDC_UPSTREAM__TOKEN`).
    #[serde(default)]
    pub token: Option<Secret>,
    /// File holding the bearer token (trailing whitespace ignored).
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// Request budget per token per minute, shared by every stream using it.
    #[serde(default = "default_requests_per_minute")]
    pub requests_per_minute: u32,
    /// Timeout of one HTTP request.
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// Attempts per request before a retriable failure is reported.
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// Longest `Retry-After` honoured after a 429.
    #[serde(default = "default_retry_after_max", with = "humantime_serde")]
    pub retry_after_max: Duration,
}

fn default_requests_per_minute() -> u32 {
    120
}
fn default_timeout() -> Duration {
    Duration::from_secs(30)
}
fn default_max_attempts() -> u32 {
    6
}
fn default_retry_after_max() -> Duration {
    Duration::from_secs(120)
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        Self {
            base_url: None,
            token: None,
            token_file: None,
            requests_per_minute: default_requests_per_minute(),
            timeout: default_timeout(),
            max_attempts: default_max_attempts(),
            retry_after_max: default_retry_after_max(),
        }
    }
}

/// `[[tenants]]`: one tenant to stream.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// Tenant id as used in the API path.
    pub id: TenantId,
    /// Resources to stream for this tenant.
    #[serde(default = "default_resources")]
    pub resources: Vec<Resource>,
    /// Per-tenant bearer token overriding `upstream.token`.
    #[serde(default)]
    pub token: Option<Secret>,
}

fn default_resources() -> Vec<Resource> {
    Resource::ALL.to_vec()
}

/// `[poll]`: when and how streams are swept.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PollConfig {
    /// Period of incremental sweeps per stream.
    #[serde(default = "default_interval", with = "humantime_serde")]
    pub interval: Duration,
    /// Period of full sweeps (deletions, changes without an updated_at bump).
    #[serde(default = "default_full_resync_interval", with = "humantime_serde")]
    pub full_resync_interval: Duration,
    /// Overlap subtracted from the watermark for late commits upstream.
    #[serde(default = "default_lookback", with = "humantime_serde")]
    pub lookback: Duration,
    /// Ask for relations (vouchers: categories,variants; categories: products).
    #[serde(default = "default_true")]
    pub include_relations: bool,
    /// Keys left out of the content hash, at any depth.
    #[serde(default = "default_ignore_keys")]
    pub ignore_keys: Vec<String>,
    /// A full sweep that would delete more than this fraction of known records refuses.
    #[serde(default = "default_max_delete_fraction")]
    pub max_delete_fraction: f64,
    /// How often a parked stream (401/403/404) is tried again.
    #[serde(default = "default_park_recheck_interval", with = "humantime_serde")]
    pub park_recheck_interval: Duration,
    /// Random spread of every wait, as a fraction of it (0.1 = plus or minus 10%).
    #[serde(default = "default_jitter")]
    pub jitter: f64,
    /// How long shutdown waits for the pages in flight to be acknowledged and committed.
    #[serde(default = "default_shutdown_timeout", with = "humantime_serde")]
    pub shutdown_timeout: Duration,
    /// Fewest pages one listing may take before it counts as endless (the
    /// limit grows with the records known: twice their pages plus 100).
    #[serde(default = "default_max_pages_floor")]
    pub max_pages_floor: u64,
}

fn default_interval() -> Duration {
    Duration::from_secs(30)
}
fn default_full_resync_interval() -> Duration {
    Duration::from_secs(3600)
}
fn default_lookback() -> Duration {
    Duration::from_secs(60)
}
fn default_true() -> bool {
    true
}
fn default_ignore_keys() -> Vec<String> {
    vec!["updated_at".to_string()]
}
fn default_max_delete_fraction() -> f64 {
    0.5
}
fn default_park_recheck_interval() -> Duration {
    Duration::from_secs(300)
}
fn default_jitter() -> f64 {
    0.1
}
fn default_shutdown_timeout() -> Duration {
    Duration::from_secs(30)
}
fn default_max_pages_floor() -> u64 {
    DEFAULT_MAX_PAGES_FLOOR
}

/// Default of `poll.max_pages_floor`: a listing of 500,000 records.
pub const DEFAULT_MAX_PAGES_FLOOR: u64 = 10_000;

impl Default for PollConfig {
    fn default() -> Self {
        Self {
            interval: default_interval(),
            full_resync_interval: default_full_resync_interval(),
            lookback: default_lookback(),
            include_relations: true,
            ignore_keys: default_ignore_keys(),
            max_delete_fraction: default_max_delete_fraction(),
            park_recheck_interval: default_park_recheck_interval(),
            jitter: default_jitter(),
            shutdown_timeout: default_shutdown_timeout(),
            max_pages_floor: default_max_pages_floor(),
        }
    }
}

/// `[state]`: the sled store.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateConfig {
    /// Directory of the sled store.
    #[serde(default = "default_state_path")]
    pub path: PathBuf,
}

fn default_state_path() -> PathBuf {
    PathBuf::from("./data/state")
}

impl Default for StateConfig {
    fn default() -> Self {
        Self {
            path: default_state_path(),
        }
    }
}

/// Which sink publishes events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SinkKind {
    /// NATS JetStream (`[sink.nats]`).
    #[default]
    Nats,
    /// Kafka (`[sink.kafka]`).
    Kafka,
    /// One JSON event per line on stdout.
    Stdout,
    /// One JSON event per line appended to a file (`[sink.file]`).
    File,
}

impl SinkKind {
    /// The name written in config.
    pub fn as_str(self) -> &'static str {
        match self {
            SinkKind::Nats => "nats",
            SinkKind::Kafka => "kafka",
            SinkKind::Stdout => "stdout",
            SinkKind::File => "file",
        }
    }
}

/// `[sink]`: the kind and each backend's settings.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SinkConfig {
    /// Which backend: nats | kafka | stdout | file.
    #[serde(default)]
    pub kind: SinkKind,
    /// NATS JetStream settings.
    #[serde(default)]
    pub nats: Option<NatsSinkConfig>,
    /// Kafka settings.
    #[serde(default)]
    pub kafka: Option<KafkaSinkConfig>,
    /// File sink settings.
    #[serde(default)]
    pub file: Option<FileSinkConfig>,
    /// What an event the sink can never accept does: `dead_letter` or `fail`.
    #[serde(default)]
    pub on_record_error: OnRecordError,
}

/// `sink.on_record_error`: what happens to an event the sink can never
/// accept (too large for the broker, refused for that message alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnRecordError {
    /// Publish a dead letter in its place, commit the record as dead-lettered, go on.
    #[default]
    DeadLetter,
    /// Fail the sweep (the stream retries with backoff and does not move on).
    Fail,
}

/// `[admin]`: the admin HTTP API.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// Listen address; `off` is not supported, use a loopback address to keep it private.
    #[serde(default = "default_admin_listen")]
    pub listen: String,
    /// Bearer token for the admin API; required when `listen` is not loopback.
    #[serde(default)]
    pub token: Option<Secret>,
}

fn default_admin_listen() -> String {
    "127.0.0.1:9464".to_string()
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            listen: default_admin_listen(),
            token: None,
        }
    }
}

/// `[log]`: logging.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// pretty | json.
    #[serde(default)]
    pub format: LogFormat,
    /// A tracing filter: `info`, `debug`, `voucher_cdc=debug,info`, ...
    #[serde(default = "default_log_level")]
    pub level: String,
}

fn default_log_level() -> String {
    "info".to_string()
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: LogFormat::default(),
            level: default_log_level(),
        }
    }
}

/// A configuration that could not be loaded: every problem, one line each.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", problems.join("\n"))]
pub struct ConfigError {
    /// One line per problem, each naming its key.
    pub problems: Vec<String>,
}

impl ConfigError {
    fn one(problem: impl Into<String>) -> Self {
        Self {
            problems: vec![problem.into()],
        }
    }
}

/// The top-level tables of the config file. An environment variable is a
/// config key when its first `__` segment names one of them
/// (`VOUCHER_CDC_POLL__INTERVAL`); other `VOUCHER_CDC_*` variables without
/// `__` are left alone, since platforms inject them (Kubernetes service links
/// such as `VOUCHER_CDC_METRICS_PORT=tcp://...`).
pub const SECTIONS: &[&str] = &[
    "upstream", "tenants", "poll", "state", "sink", "admin", "log", "shard",
];

/// The path every `upstream.base_url` ends in.
const API_PATH: &str = "/api/external/v1";
/// Upper bound of `upstream.requests_per_minute`.
const MAX_REQUESTS_PER_MINUTE: u64 = 1_000_000;
/// Upper bound of `upstream.max_attempts`.
const MAX_ATTEMPTS: u64 = 100;

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

/// Extracts and validates a config from any figment (tests use inline TOML).
///
/// Every problem is reported: a key that does not deserialize is reported and
/// left out, and extraction is tried again, up to a limit; the rules of
/// [`Config::validate`] then run on what remains.
pub fn load_from(figment: Figment) -> Result<Config, ConfigError> {
    let mut value = figment.find_value("").map_err(|e| ConfigError {
        problems: e.into_iter().map(|e| one_line(&e.to_string())).collect(),
    })?;
    let mut problems: Vec<String> = Vec::new();
    let mut reported: Vec<String> = Vec::new();
    while problems.len() < MAX_PROBLEMS {
        let errors = match Config::deserialize(&value) {
            Ok(config) => {
                if let Err(e) = config.validate() {
                    // A key reported above fell back to its default: no second line for it.
                    problems.extend(e.problems.into_iter().filter(|p| {
                        let key = p.split(':').next().unwrap_or_default();
                        !reported
                            .iter()
                            .any(|r| same_or_nested(r, key) || same_or_nested(key, r))
                    }));
                }
                return if problems.is_empty() {
                    Ok(config)
                } else {
                    Err(ConfigError { problems })
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

/// Parses and validates a TOML document with no env layer (tests, examples).
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

impl Config {
    /// Checks every cross-field rule; lists all problems at once.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        let mut bad = |key: &str, what: String| problems.push(format!("{key}: {what}"));

        match &self.upstream.base_url {
            None => bad("upstream.base_url", "required".into()),
            Some(raw) => match url::Url::parse(raw) {
                Ok(u)
                    if (u.scheme() == "http" || u.scheme() == "https")
                        && !u.path().trim_end_matches('/').ends_with(API_PATH) =>
                {
                    bad(
                        "upstream.base_url",
                        format!(
                            "`{raw}` does not end in {API_PATH}, where the External Voucher API lives: did you mean `{}{API_PATH}`?",
                            raw.trim_end_matches('/')
                        ),
                    )
                }
                Ok(u) if u.scheme() == "http" || u.scheme() == "https" => {}
                Ok(u) => bad(
                    "upstream.base_url",
                    format!(
                        "scheme `{}` not supported: valid options are http, https",
                        u.scheme()
                    ),
                ),
                Err(e) => bad(
                    "upstream.base_url",
                    format!("not a valid URL ({e}): `{raw}`"),
                ),
            },
        }
        let all_tenants_have_tokens =
            !self.tenants.is_empty() && self.tenants.iter().all(|t| t.token.is_some());
        match (&self.upstream.token, &self.upstream.token_file) {
            (Some(_), Some(_)) => bad(
                "upstream.token_file",
                "set either upstream.token or upstream.token_file, not both".into(),
            ),
            (None, None) if !all_tenants_have_tokens => bad(
                "upstream.token",
                "required (or upstream.token_file, or env VOUCHER_CDC_UPSTREAM__TOKEN)".into(),
            ),
            (None, Some(path)) => {
                if let Err(e) = read_token_file(path) {
                    bad("upstream.token_file", e);
                }
            }
            _ => {}
        }
        if self.upstream.token.as_ref().is_some_and(is_blank) {
            bad(
                "upstream.token",
                "is empty: set the API token, or remove the key".into(),
            );
        }
        for (i, t) in self.tenants.iter().enumerate() {
            if t.token.as_ref().is_some_and(is_blank) {
                bad(
                    &format!("tenants[{i}].token"),
                    "is empty: set the API token, or remove the key".into(),
                );
            }
        }
        if self.upstream.requests_per_minute == 0 {
            bad("upstream.requests_per_minute", "must be at least 1".into());
        }
        if self.upstream.timeout.is_zero() {
            bad("upstream.timeout", "must be greater than 0s".into());
        }
        if self.upstream.max_attempts == 0 {
            bad("upstream.max_attempts", "must be at least 1".into());
        }

        if self.tenants.is_empty() {
            bad(
                "tenants",
                "at least one [[tenants]] entry is required".into(),
            );
        }
        let mut seen = BTreeSet::new();
        for (i, t) in self.tenants.iter().enumerate() {
            if !seen.insert(t.id) {
                bad(
                    &format!("tenants[{i}].id"),
                    format!("tenant {} is listed twice", t.id),
                );
            }
            if t.resources.is_empty() {
                bad(
                    &format!("tenants[{i}].resources"),
                    "must name at least one of vouchers, categories".into(),
                );
            }
            let distinct: BTreeSet<_> = t.resources.iter().collect();
            if distinct.len() != t.resources.len() {
                bad(
                    &format!("tenants[{i}].resources"),
                    "lists a resource twice".into(),
                );
            }
        }

        if self.poll.interval.is_zero() {
            bad("poll.interval", "must be greater than 0s".into());
        }
        if self.poll.full_resync_interval < self.poll.interval {
            bad(
                "poll.full_resync_interval",
                "must be at least poll.interval".into(),
            );
        }
        if !(0.0..=1.0).contains(&self.poll.max_delete_fraction) {
            bad(
                "poll.max_delete_fraction",
                format!(
                    "must be between 0 and 1, got {}",
                    self.poll.max_delete_fraction
                ),
            );
        }
        if self.poll.ignore_keys.iter().any(|k| k == "id") {
            bad("poll.ignore_keys", "must not contain `id`".into());
        }
        if self.poll.park_recheck_interval.is_zero() {
            bad(
                "poll.park_recheck_interval",
                "must be greater than 0s".into(),
            );
        }
        if !(0.0..=0.5).contains(&self.poll.jitter) {
            bad(
                "poll.jitter",
                format!("must be between 0 and 0.5, got {}", self.poll.jitter),
            );
        }
        if self.poll.shutdown_timeout.is_zero() {
            bad("poll.shutdown_timeout", "must be greater than 0s".into());
        }
        if !(1..=10_000_000).contains(&self.poll.max_pages_floor) {
            bad(
                "poll.max_pages_floor",
                format!(
                    "must be between 1 and 10000000, got {}",
                    self.poll.max_pages_floor
                ),
            );
        }

        for (key, value, max) in self.duration_limits() {
            if value > max {
                bad(
                    key,
                    format!(
                        "{} is too long: at most {}",
                        humantime::format_duration(value),
                        humantime::format_duration(max)
                    ),
                );
            }
        }
        for (key, value, max) in [
            (
                "upstream.requests_per_minute",
                u64::from(self.upstream.requests_per_minute),
                MAX_REQUESTS_PER_MINUTE,
            ),
            (
                "upstream.max_attempts",
                u64::from(self.upstream.max_attempts),
                MAX_ATTEMPTS,
            ),
        ] {
            if value > max {
                bad(key, format!("{value} is too large: at most {max}"));
            }
        }

        if self.state.path.as_os_str().is_empty() {
            bad("state.path", "must not be empty".into());
        }

        match self.sink.kind {
            SinkKind::Kafka => match &self.sink.kafka {
                None => bad(
                    "sink.kafka.brokers",
                    "required when sink.kind = \"kafka\"".into(),
                ),
                Some(k) => {
                    if let Err(e) = k.validate() {
                        problems.push(e.to_string());
                    }
                }
            },
            SinkKind::Nats => {
                if let Some(n) = &self.sink.nats {
                    if let Err(e) = n.validate() {
                        problems.push(e.to_string());
                    }
                }
            }
            SinkKind::File | SinkKind::Stdout => {}
        }

        let mut bad = |key: &str, what: String| problems.push(format!("{key}: {what}"));
        if self.admin.token.as_ref().is_some_and(is_blank) {
            bad(
                "admin.token",
                "is empty: set a token, or remove the key".into(),
            );
        }
        match self.admin.listen.parse::<SocketAddr>() {
            Err(_) => bad(
                "admin.listen",
                format!(
                    "`{}` is not an address like 127.0.0.1:9464",
                    self.admin.listen
                ),
            ),
            Ok(addr) if !addr.ip().is_loopback() && self.admin.token.is_none() => bad(
                "admin.token",
                format!("required when admin.listen ({addr}) is not a loopback address"),
            ),
            Ok(_) => {}
        }
        if let Err(e) = tracing_subscriber::EnvFilter::try_new(&self.log.level) {
            bad(
                "log.level",
                format!("`{}` is not a valid filter: {e}", self.log.level),
            );
        }
        if let Err(e) = self.shard.validate() {
            problems.push(e.to_string());
        }

        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError { problems })
        }
    }

    /// Every duration key with its upper bound: longer values are mistakes
    /// and would overflow time arithmetic (a watermark minus `lookback`).
    fn duration_limits(&self) -> [(&'static str, Duration, Duration); 7] {
        const DAY: u64 = 86_400;
        let days = |n: u64| Duration::from_secs(n * DAY);
        [
            (
                "upstream.timeout",
                self.upstream.timeout,
                Duration::from_secs(3600),
            ),
            (
                "upstream.retry_after_max",
                self.upstream.retry_after_max,
                days(1),
            ),
            ("poll.interval", self.poll.interval, days(30)),
            (
                "poll.full_resync_interval",
                self.poll.full_resync_interval,
                days(365),
            ),
            ("poll.lookback", self.poll.lookback, days(30)),
            (
                "poll.park_recheck_interval",
                self.poll.park_recheck_interval,
                days(30),
            ),
            (
                "poll.shutdown_timeout",
                self.poll.shutdown_timeout,
                Duration::from_secs(3600),
            ),
        ]
    }

    /// Every configured stream, whichever shard owns it.
    pub fn all_streams(&self) -> Vec<StreamKey> {
        self.streams(&Shard::single())
    }

    /// The streams a daemon running as `shard` owns.
    pub fn streams(&self, shard: &Shard) -> Vec<StreamKey> {
        self.tenants
            .iter()
            .filter(|t| shard.owns(t.id))
            .flat_map(|t| t.resources.iter().map(|r| StreamKey::new(t.id, *r)))
            .collect()
    }

    /// The bearer token a tenant uses: its own, else `upstream.token`, else `token_file`.
    pub fn token_for(&self, tenant: TenantId) -> Result<Secret, ConfigError> {
        if let Some(t) = self.tenants.iter().find(|t| t.id == tenant) {
            if let Some(token) = &t.token {
                return Ok(token.clone());
            }
        }
        if let Some(token) = &self.upstream.token {
            return Ok(token.clone());
        }
        match &self.upstream.token_file {
            Some(path) => read_token_file(path)
                .map(Secret::new)
                .map_err(|e| ConfigError::one(format!("upstream.token_file: {e}"))),
            None => Err(ConfigError::one(
                "upstream.token: required (or upstream.token_file)",
            )),
        }
    }

    /// The effective config as TOML, every secret redacted.
    pub fn redacted_toml(&self) -> String {
        let mut copy = self.clone();
        // The chosen backend's defaults matter (where does the file sink write?): show them.
        match copy.sink.kind {
            SinkKind::Nats => {
                copy.sink.nats.get_or_insert_with(NatsSinkConfig::default);
            }
            SinkKind::File => {
                copy.sink.file.get_or_insert_with(FileSinkConfig::default);
            }
            SinkKind::Kafka | SinkKind::Stdout => {}
        }
        copy.sink.nats = copy.sink.nats.map(|n| n.redacted());
        copy.sink.kafka = copy.sink.kafka.map(|k| k.redacted());
        match toml::to_string_pretty(&copy) {
            Ok(s) => s,
            Err(e) => format!("# could not render the config: {e}\n"),
        }
    }
}

/// True for a secret that is empty or only whitespace.
fn is_blank(secret: &Secret) -> bool {
    secret.expose().trim().is_empty()
}

fn read_token_file(path: &Path) -> Result<String, String> {
    match std::fs::read_to_string(path) {
        Ok(s) if s.trim().is_empty() => Err(format!("{} is empty", path.display())),
        Ok(s) => Ok(s.trim().to_string()),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_are_the_top_level_keys_of_the_config() {
        let err = Figment::new()
            .merge(Toml::string("__probe = 1\n"))
            .extract::<Config>()
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
            vec!["VOUCHER_CDC_POL__INTERVAL: unknown config section `pol`: valid sections are upstream, tenants, poll, state, sink, admin, log, shard"]
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
