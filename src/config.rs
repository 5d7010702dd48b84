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

/// Loads the configuration: defaults, then the TOML file (if any), then env.
///
/// `file` is required to exist when given explicitly.
pub fn load(file: Option<&Path>) -> Result<Config, ConfigError> {
    let mut figment = Figment::new();
    if let Some(path) = file {
        if !path.exists() {
            return Err(ConfigError::one(format!(
                "config file {}: not found",
                path.display()
            )));
        }
        figment = figment.merge(Toml::file(path));
    }
    // `VOUCHER_CDC_CONFIG` names the file itself (the `--config` flag), not a key.
    let env = Env::prefixed(ENV_PREFIX).ignore(&["config"]).split("__");
    load_from(figment.merge(env))
}

/// Extracts and validates a config from any figment (tests use inline TOML).
pub fn load_from(figment: Figment) -> Result<Config, ConfigError> {
    let config: Config = figment.extract().map_err(figment_problems)?;
    config.validate()?;
    Ok(config)
}

/// Parses and validates a TOML document with no env layer (tests, examples).
pub fn from_toml_str(toml: &str) -> Result<Config, ConfigError> {
    load_from(Figment::new().merge(Toml::string(toml)))
}

fn figment_problems(err: figment::Error) -> ConfigError {
    let problems = err
        .into_iter()
        .map(|e| {
            let key = e.path.join(".");
            let origin = e
                .metadata
                .as_ref()
                .and_then(|m| m.source.as_ref())
                .map(|s| format!(" (from {s})"))
                .unwrap_or_default();
            let kind = describe(&e.kind);
            if key.is_empty() {
                format!("config{origin}: {kind}")
            } else {
                format!("{key}: {kind}{origin}")
            }
        })
        .collect();
    ConfigError { problems }
}

/// One readable phrase per figment error kind, listing the valid options.
fn describe(kind: &figment::error::Kind) -> String {
    use figment::error::Kind;
    match kind {
        Kind::UnknownVariant(found, expected) => format!(
            "unknown value `{found}`: valid options are {}",
            expected.join(", ")
        ),
        Kind::UnknownField(found, expected) => format!(
            "unknown key `{found}`: valid keys are {}",
            expected.join(", ")
        ),
        Kind::MissingField(field) => format!("`{field}` is required"),
        Kind::InvalidType(actual, expected) => format!("expected {expected}, found {actual}"),
        Kind::InvalidValue(actual, expected) => format!("expected {expected}, found {actual}"),
        other => other.to_string(),
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
        copy.sink.nats = copy.sink.nats.map(|n| n.redacted());
        copy.sink.kafka = copy.sink.kafka.map(|k| k.redacted());
        match toml::to_string_pretty(&copy) {
            Ok(s) => s,
            Err(e) => format!("# could not render the config: {e}\n"),
        }
    }
}

fn read_token_file(path: &Path) -> Result<String, String> {
    match std::fs::read_to_string(path) {
        Ok(s) if s.trim().is_empty() => Err(format!("{} is empty", path.display())),
        Ok(s) => Ok(s.trim().to_string()),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}
