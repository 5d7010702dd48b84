//! What the operator writes, and what the daemon runs with. The file (see
//! [`load`]) is read into [`RawConfig`], the shape of the file with its
//! documented defaults; each section then checks itself and yields its typed
//! settings, so a [`Config`] holds a parsed `Url`, a `SocketAddr`, resolved
//! tokens and one chosen sink, and nothing downstream parses or checks them
//! again. Every problem is reported at once, one line each naming its key.

mod load;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use url::Url;

use crate::hash::IgnoreKeys;
pub use crate::planner::Strategy;
use crate::schema::SchemaBase;
use crate::secret;
use crate::shard::{Shard, ShardConfig};
use crate::sinks::config::RawSinkConfig;
use crate::stream::{Resource, StreamKey, TenantId};
use crate::sweep::SweepSettings;
use crate::telemetry::LogFormat;
use crate::upstream::body_budget::DEFAULT_BODY_BUDGET_BYTES;
use crate::upstream::client::ClientOptions;
use crate::upstream::pagination::MAX_LISTING_PAGES;
use crate::upstream::tls::TrustRoots;

pub use self::load::{
    from_toml_str, is_config_env_key, key_path, load, load_from, ENV_PREFIX, SECTIONS,
};
pub use crate::secret::Secret;
pub use crate::sinks::config::{OnRecordError, SinkBackendConfig, SinkConfig, SinkKind};

/// The configuration the daemon runs with: every section checked, every
/// value parsed. Built only by [`RawConfig::check`] (through [`load`]).
#[derive(Debug, Clone)]
pub struct Config {
    /// The External Voucher API to poll.
    pub upstream: UpstreamConfig,
    /// The tenants to stream; at least one, each listed once.
    pub tenants: Vec<TenantConfig>,
    /// Sweep timing and change detection.
    pub poll: PollConfig,
    /// What events carry beyond the change itself.
    pub events: EventsConfig,
    /// Where the state store lives.
    pub state: StateConfig,
    /// Where events go.
    pub sink: SinkConfig,
    /// The admin HTTP API (health, metrics, status, replay).
    pub admin: AdminConfig,
    /// Logging.
    pub log: LogConfig,
    /// Tenant sharding across several daemons.
    pub shard: ShardConfig,
    /// The file as loaded, defaults filled in: what `check-config` prints.
    as_loaded: RawConfig,
}

/// The whole configuration file as written, with its documented defaults.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// `[upstream]`.
    #[serde(default)]
    pub upstream: RawUpstreamConfig,
    /// `[[tenants]]`.
    #[serde(default)]
    pub tenants: Vec<TenantConfig>,
    /// `[poll]`.
    #[serde(default)]
    pub poll: PollConfig,
    /// `[events]`.
    #[serde(default)]
    pub events: EventsConfig,
    /// `[state]`.
    #[serde(default)]
    pub state: StateConfig,
    /// `[sink]`.
    #[serde(default)]
    pub sink: RawSinkConfig,
    /// `[admin]`.
    #[serde(default)]
    pub admin: RawAdminConfig,
    /// `[log]`.
    #[serde(default)]
    pub log: LogConfig,
    /// `[shard]`.
    #[serde(default)]
    pub shard: ShardConfig,
}

/// `[upstream]` as written: the API and its credentials.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstreamConfig {
    /// Base URL including `/api/external/v1`. Required.
    #[serde(default)]
    pub base_url: Option<String>,
    /// Bearer token (or use `token_file`, or env `VOUCHER_CDC_UPSTREAM__TOKEN`).
    #[serde(default)]
    pub token: Option<Secret>,
    /// File holding the bearer token (trailing whitespace ignored).
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// PEM file of CA certificates trusted for an `https` base URL, besides the public roots.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// Request budget per token per minute, shared by every stream using it.
    #[serde(default = "default_requests_per_minute")]
    pub requests_per_minute: u32,
    /// The window the upstream counts `requests_per_minute` in: a minute for
    /// the External Voucher API; another only for an API that counts another
    /// window.
    #[serde(default = "default_rate_window", with = "humantime_serde")]
    pub rate_window: Duration,
    /// Timeout of one HTTP request.
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// Attempts per request before a retriable failure is reported.
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// Longest `Retry-After` honoured after a 429.
    #[serde(default = "default_retry_after_max", with = "humantime_serde")]
    pub retry_after_max: Duration,
    /// MiB of listing bodies the process holds in memory at once, across
    /// every tenant and token (`upstream::body_budget`).
    #[serde(default = "default_body_budget_mib")]
    pub body_budget_mib: u64,
}

fn default_requests_per_minute() -> u32 {
    120
}
/// Default of `upstream.rate_window`: the API's budget counts a minute.
pub const DEFAULT_RATE_WINDOW: Duration = Duration::from_secs(60);
fn default_rate_window() -> Duration {
    DEFAULT_RATE_WINDOW
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
/// Default of `upstream.body_budget_mib`: the client's built-in budget.
fn default_body_budget_mib() -> u64 {
    (DEFAULT_BODY_BUDGET_BYTES >> 20) as u64
}
/// Largest `upstream.body_budget_mib` accepted (16 GiB).
pub const MAX_BODY_BUDGET_MIB: u64 = 16 << 10;

impl Default for RawUpstreamConfig {
    fn default() -> Self {
        Self {
            base_url: None,
            token: None,
            token_file: None,
            ca_file: None,
            requests_per_minute: default_requests_per_minute(),
            rate_window: default_rate_window(),
            timeout: default_timeout(),
            max_attempts: default_max_attempts(),
            retry_after_max: default_retry_after_max(),
            body_budget_mib: default_body_budget_mib(),
        }
    }
}

/// `[upstream]` checked: the API's URL and the token every tenant without
/// its own uses, read from `token_file` when that is how it was given.
#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// Base URL, ending in `/api/external/v1`.
    pub base_url: Url,
    /// `upstream.token`, else the content of `upstream.token_file`; `None`
    /// only when every tenant has its own token.
    pub token: Option<Secret>,
    /// The certificates of `upstream.ca_file`, read at load.
    pub ca: Option<TrustRoots>,
    /// Request budget per token per minute, shared by every stream using it.
    pub requests_per_minute: u32,
    /// The window `requests_per_minute` is counted in (a minute).
    pub rate_window: Duration,
    /// Timeout of one HTTP request.
    pub timeout: Duration,
    /// Attempts per request before a retriable failure is reported.
    pub max_attempts: u32,
    /// Longest `Retry-After` honoured after a 429.
    pub retry_after_max: Duration,
    /// Bytes of listing bodies held in memory at once (`body_budget_mib`).
    pub body_budget_bytes: usize,
}

impl From<&UpstreamConfig> for ClientOptions {
    fn from(upstream: &UpstreamConfig) -> Self {
        ClientOptions {
            base_url: upstream.base_url.clone(),
            timeout: upstream.timeout,
            max_attempts: upstream.max_attempts,
            retry_after_max: upstream.retry_after_max,
            ca: upstream.ca.clone(),
            body_budget_bytes: upstream.body_budget_bytes,
            ..ClientOptions::default()
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
    /// Per-tenant bearer token overriding `upstream.token`. After checking,
    /// the token in effect for this tenant's own credentials (from `token_file` too).
    #[serde(default)]
    pub token: Option<Secret>,
    /// File holding the tenant's bearer token (instead of `token`).
    #[serde(default)]
    pub token_file: Option<PathBuf>,
}

fn default_resources() -> Vec<Resource> {
    Resource::ALL.to_vec()
}

/// Default of `poll.interval`.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(30);
/// Default of `poll.full_resync_interval`.
pub const DEFAULT_FULL_RESYNC_INTERVAL: Duration = Duration::from_secs(3600);
/// Default of `poll.lookback`.
pub const DEFAULT_LOOKBACK: Duration = Duration::from_secs(60);
/// Default of `poll.include_relations`.
pub const DEFAULT_INCLUDE_RELATIONS: bool = true;
/// Default of `poll.ignore_keys`.
pub const DEFAULT_IGNORE_KEYS: [&str; 1] = ["updated_at"];
/// Default of `poll.max_delete_fraction`.
pub const DEFAULT_MAX_DELETE_FRACTION: f64 = 0.5;
/// Default of `poll.park_recheck_interval`.
pub const DEFAULT_PARK_RECHECK_INTERVAL: Duration = Duration::from_secs(300);
/// Default of `poll.jitter`.
pub const DEFAULT_JITTER: f64 = 0.1;
/// Default of `poll.shutdown_timeout`.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);
/// Default of `poll.max_interval`: the staleness cap of the adaptive planner.
pub const DEFAULT_MAX_INTERVAL: Duration = Duration::from_secs(300);
/// Default of `poll.full_sweep_share`.
pub const DEFAULT_FULL_SWEEP_SHARE: f64 = 0.25;
/// Default of `poll.tail_guard`: every stream but the cold tail is polled
/// at least once per 0.97 x the round a uniform schedule would take, so the
/// slowest changes wait less than under uniform polling (docs/planner.md).
pub const DEFAULT_TAIL_GUARD: f64 = 0.97;
/// Default of `poll.max_pages_floor`: the pages of 500,000 records.
pub const DEFAULT_MAX_PAGES_FLOOR: u64 = 10_000;

/// `[poll]`: when and how streams are swept. Its defaults are the
/// `DEFAULT_*` constants above, the one place they are written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PollConfig {
    /// Period of incremental sweeps per stream (the floor under the planner).
    #[serde(default = "default_interval", with = "humantime_serde")]
    pub interval: Duration,
    /// Period of full sweeps (deletions, changes without an updated_at bump).
    #[serde(default = "default_full_resync_interval", with = "humantime_serde")]
    pub full_resync_interval: Duration,
    /// Overlap subtracted from the watermark for late commits upstream.
    #[serde(default = "default_lookback", with = "humantime_serde")]
    pub lookback: Duration,
    /// Ask for relations (vouchers: categories,variants; categories: products).
    #[serde(default = "default_include_relations")]
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
    /// limit grows with the records known, those the listing commits
    /// included: twice their pages plus 100).
    #[serde(default = "default_max_pages_floor")]
    pub max_pages_floor: u64,
    /// Staleness cap: no stream waits longer between two polls (adaptive);
    /// a cap below `interval` is raised to it (see [`PollConfig::staleness_cap`]).
    #[serde(default = "default_max_interval", with = "humantime_serde")]
    pub max_interval: Duration,
    /// How streams share their token's budget: `adaptive` (the planner) or `uniform`.
    #[serde(default)]
    pub strategy: Strategy,
    /// Share of a contended budget that full-sweep pages may take (0 to 1).
    #[serde(default = "default_full_sweep_share")]
    pub full_sweep_share: f64,
    /// The planner's tail target, as a share of the round a uniform schedule
    /// would take: every stream but the coldest (whose changes are too few
    /// to move the p99) is polled at least that often, the hottest at the
    /// period that polls half the changes soonest (0 turns it off: the
    /// square-root law alone up to `max_interval`, the lowest mean).
    #[serde(default = "default_tail_guard")]
    pub tail_guard: f64,
}

fn default_interval() -> Duration {
    DEFAULT_POLL_INTERVAL
}
fn default_max_interval() -> Duration {
    DEFAULT_MAX_INTERVAL
}
fn default_full_sweep_share() -> f64 {
    DEFAULT_FULL_SWEEP_SHARE
}
fn default_tail_guard() -> f64 {
    DEFAULT_TAIL_GUARD
}
fn default_full_resync_interval() -> Duration {
    DEFAULT_FULL_RESYNC_INTERVAL
}
fn default_lookback() -> Duration {
    DEFAULT_LOOKBACK
}
fn default_include_relations() -> bool {
    DEFAULT_INCLUDE_RELATIONS
}
fn default_ignore_keys() -> Vec<String> {
    DEFAULT_IGNORE_KEYS.map(String::from).to_vec()
}
fn default_max_delete_fraction() -> f64 {
    DEFAULT_MAX_DELETE_FRACTION
}
fn default_park_recheck_interval() -> Duration {
    DEFAULT_PARK_RECHECK_INTERVAL
}
fn default_jitter() -> f64 {
    DEFAULT_JITTER
}
fn default_shutdown_timeout() -> Duration {
    DEFAULT_SHUTDOWN_TIMEOUT
}
fn default_max_pages_floor() -> u64 {
    DEFAULT_MAX_PAGES_FLOOR
}

impl Default for PollConfig {
    fn default() -> Self {
        Self {
            interval: default_interval(),
            max_interval: default_max_interval(),
            strategy: Strategy::default(),
            full_sweep_share: default_full_sweep_share(),
            tail_guard: default_tail_guard(),
            full_resync_interval: default_full_resync_interval(),
            lookback: default_lookback(),
            include_relations: default_include_relations(),
            ignore_keys: default_ignore_keys(),
            max_delete_fraction: default_max_delete_fraction(),
            park_recheck_interval: default_park_recheck_interval(),
            jitter: default_jitter(),
            shutdown_timeout: default_shutdown_timeout(),
            max_pages_floor: default_max_pages_floor(),
        }
    }
}

/// The sweep settings `[poll]` asks for; the sweep's own knobs (sink
/// backoff, publish timeout) and `sink.on_record_error` keep their defaults.
impl From<&PollConfig> for SweepSettings {
    fn from(poll: &PollConfig) -> Self {
        SweepSettings {
            lookback: poll.lookback,
            include_relations: poll.include_relations,
            ignore_keys: IgnoreKeys::new(&poll.ignore_keys),
            max_delete_fraction: poll.max_delete_fraction,
            max_pages_floor: poll.max_pages_floor,
            full_retry_initial: poll.interval,
            full_retry_max: poll.full_resync_interval,
            ..SweepSettings::default()
        }
    }
}

/// `[events]`: what events carry beyond the change itself (docs/events.md).
/// Every key is optional and off by default.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventsConfig {
    /// Absolute URL the events' `dataschema` starts with (the schema's file
    /// name follows); unset: this daemon's admin API, `http://{bound admin address}/v1/schemas/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema_base_url: Option<String>,
    /// Publish a `stream.heartbeat` when a stream produced no event for this long.
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    pub heartbeat_interval: Option<Duration>,
    /// Every `op: update` event carries `changedfields`, the top-level keys
    /// that changed (per-field hashes kept in the state).
    #[serde(default = "default_changed_fields")]
    pub changed_fields: bool,
    /// Update and delete events carry `before`, the previous version's JSON
    /// (kept compressed in the state).
    #[serde(default = "default_before")]
    pub before: bool,
}

/// `events.changed_fields` unless set: off (no per-field hashes in the state).
pub const DEFAULT_CHANGED_FIELDS: bool = false;
/// `events.before` unless set: off (no record bodies in the state).
pub const DEFAULT_BEFORE: bool = false;

fn default_changed_fields() -> bool {
    DEFAULT_CHANGED_FIELDS
}

fn default_before() -> bool {
    DEFAULT_BEFORE
}

impl Default for EventsConfig {
    fn default() -> Self {
        Self {
            schema_base_url: None,
            heartbeat_interval: None,
            changed_fields: DEFAULT_CHANGED_FIELDS,
            before: DEFAULT_BEFORE,
        }
    }
}

/// Shortest `events.heartbeat_interval`.
pub const MIN_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);

impl EventsConfig {
    /// Every `[events]` rule: an absolute base URL, a heartbeat interval in range.
    fn check(&self, problems: &mut Problems) {
        if let Some(base) = &self.schema_base_url {
            match Url::parse(base) {
                Ok(url) if url.cannot_be_a_base() => problems.bad(
                    "events.schema_base_url",
                    format!("`{base}` cannot be a base for the schema file names"),
                ),
                Ok(_) => {}
                Err(e) => problems.bad(
                    "events.schema_base_url",
                    format!("`{base}` is not an absolute url: {e}"),
                ),
            }
        }
        if let Some(interval) = self.heartbeat_interval {
            if interval < MIN_HEARTBEAT_INTERVAL {
                problems.bad("events.heartbeat_interval", "must be at least 1s");
            }
            problems.at_most(
                "events.heartbeat_interval",
                interval,
                Duration::from_secs(30 * DAY),
            );
        }
    }

    /// Where `dataschema` points: `schema_base_url`, else the admin API on `admin_addr`.
    pub fn schema_base(&self, admin_addr: SocketAddr) -> SchemaBase {
        match &self.schema_base_url {
            Some(base) => SchemaBase::new(base),
            None => SchemaBase::of_admin(admin_addr),
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
    /// MiB of store nodes kept in memory (sled's page cache); the rest is read
    /// back from disk when used. Bounds most of the memory that grows with
    /// the number of records known.
    #[serde(default = "default_cache_capacity_mib")]
    pub cache_capacity_mib: u64,
}

fn default_state_path() -> PathBuf {
    PathBuf::from("./data/state")
}

/// Default of `state.cache_capacity_mib`: the store's built-in cache.
fn default_cache_capacity_mib() -> u64 {
    crate::state::CACHE_CAPACITY >> 20
}

/// Largest `state.cache_capacity_mib` accepted (64 GiB).
const MAX_CACHE_CAPACITY_MIB: u64 = 65_536;

impl StateConfig {
    /// `cache_capacity_mib` in bytes.
    pub fn cache_bytes(&self) -> u64 {
        self.cache_capacity_mib << 20
    }
}

impl Default for StateConfig {
    fn default() -> Self {
        Self {
            path: default_state_path(),
            cache_capacity_mib: default_cache_capacity_mib(),
        }
    }
}

/// `[admin]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAdminConfig {
    /// Listen address; `off` is not supported, use a loopback address to keep it private.
    #[serde(default = "default_admin_listen")]
    pub listen: String,
    /// Bearer token for the admin API; required when `listen` is not loopback.
    #[serde(default)]
    pub token: Option<Secret>,
    /// File holding the admin token (instead of `token`).
    #[serde(default)]
    pub token_file: Option<PathBuf>,
}

fn default_admin_listen() -> String {
    "127.0.0.1:9464".to_string()
}

impl Default for RawAdminConfig {
    fn default() -> Self {
        Self {
            listen: default_admin_listen(),
            token: None,
            token_file: None,
        }
    }
}

/// `[admin]` checked: a listen address, and a token wherever it is not loopback.
#[derive(Debug, Clone)]
pub struct AdminConfig {
    /// The address the admin API listens on (port 0: any free port).
    pub listen: SocketAddr,
    /// Bearer token for the `/v1` endpoints; always set when `listen` is not loopback.
    pub token: Option<Secret>,
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

/// The path every `upstream.base_url` ends in.
const API_PATH: &str = "/api/external/v1";
/// Upper bound of `upstream.requests_per_minute`.
const MAX_REQUESTS_PER_MINUTE: u64 = 1_000_000;
/// Upper bound of `upstream.max_attempts`.
const MAX_ATTEMPTS: u64 = 100;
/// Seconds in a day, for the upper bounds of durations.
const DAY: u64 = 86_400;

/// The problems the section checks find, one line each naming its key.
#[derive(Debug, Default)]
struct Problems(Vec<String>);

impl Problems {
    /// `key: what`.
    fn bad(&mut self, key: &str, what: impl std::fmt::Display) {
        self.0.push(format!("{key}: {what}"));
    }

    /// An error whose text already names its key.
    fn add(&mut self, error: impl std::fmt::Display) {
        self.0.push(error.to_string());
    }

    /// Durations longer than `max` are mistakes and would overflow time
    /// arithmetic (a watermark minus `lookback`).
    fn at_most(&mut self, key: &str, value: Duration, max: Duration) {
        if value > max {
            self.bad(
                key,
                format!(
                    "{} is too long: at most {}",
                    humantime::format_duration(value),
                    humantime::format_duration(max)
                ),
            );
        }
    }

    /// Counts larger than `max` are mistakes.
    fn at_most_count(&mut self, key: &str, value: u64, max: u64) {
        if value > max {
            self.bad(key, format!("{value} is too large: at most {max}"));
        }
    }
}

impl RawConfig {
    /// Checks every section (each reports its own problems) and returns the
    /// typed config, or every problem at once.
    pub fn check(self) -> Result<Config, ConfigError> {
        let mut problems = Problems::default();
        let upstream = self.upstream.check(&self.tenants, &mut problems);
        let tenants = check_tenants(&self.tenants, &mut problems);
        self.poll.check(&mut problems);
        self.events.check(&mut problems);
        self.state.check(&mut problems);
        let sink = self.sink.check().map_err(|e| problems.add(e)).ok();
        let admin = self.admin.check(&mut problems);
        self.log.check(&mut problems);
        if let Err(e) = self.shard.validate() {
            problems.add(e);
        }
        match (upstream, sink, admin) {
            (Some(upstream), Some(sink), Some(admin)) if problems.0.is_empty() => Ok(Config {
                upstream,
                tenants,
                poll: self.poll.clone(),
                events: self.events.clone(),
                state: self.state.clone(),
                sink,
                admin,
                log: self.log.clone(),
                shard: self.shard,
                as_loaded: self,
            }),
            _ => Err(ConfigError {
                problems: problems.0,
            }),
        }
    }
}

impl RawUpstreamConfig {
    /// The checked section; `None` when `base_url` is missing or unusable.
    fn check(&self, tenants: &[TenantConfig], problems: &mut Problems) -> Option<UpstreamConfig> {
        let base_url = self.check_base_url(problems);
        let token = self.resolve_token(tenants, problems);
        let ca = self.ca_file.as_deref().and_then(|path| {
            TrustRoots::from_pem_file(path)
                .map_err(|e| problems.bad("upstream.ca_file", e))
                .ok()
        });
        if self.requests_per_minute == 0 {
            problems.bad("upstream.requests_per_minute", "must be at least 1");
        }
        if self.timeout.is_zero() {
            problems.bad("upstream.timeout", "must be greater than 0s");
        }
        if self.rate_window < Duration::from_secs(1) {
            problems.bad("upstream.rate_window", "must be at least 1s");
        }
        problems.at_most(
            "upstream.rate_window",
            self.rate_window,
            Duration::from_secs(3600),
        );
        if self.max_attempts == 0 {
            problems.bad("upstream.max_attempts", "must be at least 1");
        }
        problems.at_most("upstream.timeout", self.timeout, Duration::from_secs(3600));
        problems.at_most(
            "upstream.retry_after_max",
            self.retry_after_max,
            Duration::from_secs(DAY),
        );
        problems.at_most_count(
            "upstream.requests_per_minute",
            u64::from(self.requests_per_minute),
            MAX_REQUESTS_PER_MINUTE,
        );
        problems.at_most_count(
            "upstream.max_attempts",
            u64::from(self.max_attempts),
            MAX_ATTEMPTS,
        );
        if !(1..=MAX_BODY_BUDGET_MIB).contains(&self.body_budget_mib) {
            problems.bad(
                "upstream.body_budget_mib",
                format!(
                    "must be between 1 and {MAX_BODY_BUDGET_MIB}, got {}",
                    self.body_budget_mib
                ),
            );
        }
        Some(UpstreamConfig {
            base_url: base_url?,
            token,
            ca,
            requests_per_minute: self.requests_per_minute,
            rate_window: self.rate_window,
            timeout: self.timeout,
            max_attempts: self.max_attempts,
            retry_after_max: self.retry_after_max,
            body_budget_bytes: usize::try_from(self.body_budget_mib.min(MAX_BODY_BUDGET_MIB) << 20)
                .unwrap_or(usize::MAX),
        })
    }

    /// `base_url` parsed: http or https, ending in [`API_PATH`].
    fn check_base_url(&self, problems: &mut Problems) -> Option<Url> {
        const KEY: &str = "upstream.base_url";
        let Some(raw) = &self.base_url else {
            problems.bad(KEY, "required");
            return None;
        };
        let url = match Url::parse(raw) {
            Ok(url) => url,
            Err(e) => {
                problems.bad(KEY, format!("not a valid URL ({e}): `{raw}`"));
                return None;
            }
        };
        if url.scheme() != "http" && url.scheme() != "https" {
            problems.bad(
                KEY,
                format!(
                    "scheme `{}` not supported: valid options are http, https",
                    url.scheme()
                ),
            );
            return None;
        }
        if !url.path().trim_end_matches('/').ends_with(API_PATH) {
            problems.bad(
                KEY,
                format!(
                    "`{raw}` does not end in {API_PATH}, where the External Voucher API lives: did you mean `{}{API_PATH}`?",
                    raw.trim_end_matches('/')
                ),
            );
            return None;
        }
        Some(url)
    }

    /// `token`, else the content of `token_file`; a problem when both are
    /// given, when neither is and a tenant has no token of its own, or when
    /// the token is empty.
    fn resolve_token(&self, tenants: &[TenantConfig], problems: &mut Problems) -> Option<Secret> {
        let every_tenant_has_a_token = !tenants.is_empty()
            && tenants
                .iter()
                .all(|t| t.token.is_some() || t.token_file.is_some());
        if self.token.is_none() && self.token_file.is_none() && !every_tenant_has_a_token {
            problems.bad(
                "upstream.token",
                "required (or upstream.token_file, or env VOUCHER_CDC_UPSTREAM__TOKEN)",
            );
        }
        if self.token.as_ref().is_some_and(is_blank) {
            problems.bad(
                "upstream.token",
                "is empty: set the API token, or remove the key",
            );
        }
        secret::value_or_file(
            "upstream.token",
            self.token.as_ref(),
            self.token_file.as_deref(),
        )
        .map_err(|e| problems.add(e))
        .ok()
        .flatten()
    }
}

/// `[[tenants]]`: at least one, each listed once, each with at least one
/// resource and no resource twice, no empty token. Returns the tenants with
/// each `token_file` read into `token` (and the file cleared).
fn check_tenants(tenants: &[TenantConfig], problems: &mut Problems) -> Vec<TenantConfig> {
    let mut resolved = Vec::with_capacity(tenants.len());
    for (i, t) in tenants.iter().enumerate() {
        let key = format!("tenants[{i}].token");
        if t.token.as_ref().is_some_and(is_blank) {
            problems.bad(&key, "is empty: set the API token, or remove the key");
        }
        let token = secret::value_or_file(&key, t.token.as_ref(), t.token_file.as_deref())
            .map_err(|e| problems.add(e))
            .ok()
            .flatten();
        resolved.push(TenantConfig {
            token,
            token_file: None,
            ..t.clone()
        });
    }
    if tenants.is_empty() {
        problems.bad("tenants", "at least one [[tenants]] entry is required");
    }
    let mut seen = BTreeSet::new();
    for (i, t) in tenants.iter().enumerate() {
        if !seen.insert(t.id) {
            problems.bad(
                &format!("tenants[{i}].id"),
                format!("tenant {} is listed twice", t.id),
            );
        }
        if t.resources.is_empty() {
            problems.bad(
                &format!("tenants[{i}].resources"),
                "must name at least one of vouchers, categories",
            );
        }
        let distinct: BTreeSet<_> = t.resources.iter().collect();
        if distinct.len() != t.resources.len() {
            problems.bad(&format!("tenants[{i}].resources"), "lists a resource twice");
        }
    }
    resolved
}

impl PollConfig {
    /// The staleness cap the planner keeps: `max_interval`, at least `interval`.
    pub fn staleness_cap(&self) -> Duration {
        self.max_interval.max(self.interval)
    }

    /// Every `[poll]` rule: periods above zero and bounded, fractions in range.
    fn check(&self, problems: &mut Problems) {
        if self.interval.is_zero() {
            problems.bad("poll.interval", "must be greater than 0s");
        }
        if !(self.tail_guard == 0.0 || (0.5..=2.0).contains(&self.tail_guard)) {
            problems.bad(
                "poll.tail_guard",
                format!(
                    "must be 0 (off) or between 0.5 and 2, got {}",
                    self.tail_guard
                ),
            );
        }
        if !(self.full_sweep_share > 0.0 && self.full_sweep_share <= 1.0) {
            problems.bad(
                "poll.full_sweep_share",
                format!(
                    "must be greater than 0 and at most 1, got {}",
                    self.full_sweep_share
                ),
            );
        }
        if self.full_resync_interval < self.interval {
            problems.bad(
                "poll.full_resync_interval",
                "must be at least poll.interval",
            );
        }
        if !(0.0..=1.0).contains(&self.max_delete_fraction) {
            problems.bad(
                "poll.max_delete_fraction",
                format!("must be between 0 and 1, got {}", self.max_delete_fraction),
            );
        }
        if self.ignore_keys.iter().any(|k| k == "id") {
            problems.bad("poll.ignore_keys", "must not contain `id`");
        }
        if self.park_recheck_interval.is_zero() {
            problems.bad("poll.park_recheck_interval", "must be greater than 0s");
        }
        if !(0.0..=0.5).contains(&self.jitter) {
            problems.bad(
                "poll.jitter",
                format!("must be between 0 and 0.5, got {}", self.jitter),
            );
        }
        if self.shutdown_timeout.is_zero() {
            problems.bad("poll.shutdown_timeout", "must be greater than 0s");
        }
        if !(1..=MAX_LISTING_PAGES).contains(&self.max_pages_floor) {
            problems.bad(
                "poll.max_pages_floor",
                format!(
                    "must be between 1 and {MAX_LISTING_PAGES}, got {}",
                    self.max_pages_floor
                ),
            );
        }
        let days = |n: u64| Duration::from_secs(n * DAY);
        problems.at_most("poll.interval", self.interval, days(30));
        problems.at_most(
            "poll.full_resync_interval",
            self.full_resync_interval,
            days(365),
        );
        problems.at_most("poll.lookback", self.lookback, days(30));
        problems.at_most("poll.max_interval", self.max_interval, days(30));
        problems.at_most(
            "poll.park_recheck_interval",
            self.park_recheck_interval,
            days(30),
        );
        problems.at_most(
            "poll.shutdown_timeout",
            self.shutdown_timeout,
            Duration::from_secs(3600),
        );
    }
}

impl StateConfig {
    /// `[state]`: a path is given and the cache size is in range.
    fn check(&self, problems: &mut Problems) {
        if self.path.as_os_str().is_empty() {
            problems.bad("state.path", "must not be empty");
        }
        if !(1..=MAX_CACHE_CAPACITY_MIB).contains(&self.cache_capacity_mib) {
            problems.bad(
                "state.cache_capacity_mib",
                format!(
                    "must be between 1 and {MAX_CACHE_CAPACITY_MIB}, got {}",
                    self.cache_capacity_mib
                ),
            );
        }
    }
}

impl RawAdminConfig {
    /// The checked section; `None` when `listen` is not an address.
    fn check(&self, problems: &mut Problems) -> Option<AdminConfig> {
        if self.token.as_ref().is_some_and(is_blank) {
            problems.bad("admin.token", "is empty: set a token, or remove the key");
        }
        let token = secret::value_or_file(
            "admin.token",
            self.token.as_ref(),
            self.token_file.as_deref(),
        )
        .map_err(|e| problems.add(e))
        .ok()
        .flatten();
        let Ok(listen) = self.listen.parse::<SocketAddr>() else {
            problems.bad(
                "admin.listen",
                format!("`{}` is not an address like 127.0.0.1:9464", self.listen),
            );
            return None;
        };
        if !listen.ip().is_loopback() && self.token.is_none() && self.token_file.is_none() {
            problems.bad(
                "admin.token",
                format!("required when admin.listen ({listen}) is not a loopback address"),
            );
        }
        Some(AdminConfig { listen, token })
    }
}

impl LogConfig {
    /// `[log]`: the level is a valid tracing filter.
    fn check(&self, problems: &mut Problems) {
        if let Err(e) = tracing_subscriber::EnvFilter::try_new(&self.level) {
            problems.bad(
                "log.level",
                format!("`{}` is not a valid filter: {e}", self.level),
            );
        }
    }
}

impl Config {
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

    /// The bearer token a tenant uses: its own, else the upstream one
    /// (`upstream.token` or `token_file`). `None` only for a tenant that is
    /// not configured while every configured one has its own.
    pub fn token_for(&self, tenant: TenantId) -> Option<&Secret> {
        self.tenants
            .iter()
            .find(|t| t.id == tenant)
            .and_then(|t| t.token.as_ref())
            .or(self.upstream.token.as_ref())
    }

    /// The effective config as TOML (the file as loaded, every default
    /// filled in, the chosen sink's defaults shown), every secret redacted.
    pub fn redacted_toml(&self) -> String {
        let shown = RawConfig {
            sink: self.as_loaded.sink.redacted(),
            ..self.as_loaded.clone()
        };
        match toml::to_string_pretty(&shown) {
            Ok(s) => s,
            Err(e) => format!("# could not render the config: {e}\n"),
        }
    }
}

/// True for a secret that is empty or only whitespace.
fn is_blank(secret: &Secret) -> bool {
    secret.expose().trim().is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(toml_text: &str) -> RawConfig {
        figment::Figment::new()
            .merge(<figment::providers::Toml as figment::providers::Format>::string(toml_text))
            .extract()
            .unwrap()
    }

    const MINIMAL: &str =
        "[upstream]\nbase_url = \"http://x/api/external/v1\"\ntoken = \"t\"\n[[tenants]]\nid = 1\n";

    #[test]
    fn checking_yields_typed_settings() {
        let config = raw(&format!("{MINIMAL}[admin]\nlisten = \"127.0.0.1:0\"\n"))
            .check()
            .unwrap();
        assert_eq!(
            config.upstream.base_url.as_str(),
            "http://x/api/external/v1"
        );
        assert_eq!(config.admin.listen, SocketAddr::from(([127, 0, 0, 1], 0)));
        assert_eq!(config.token_for(1).map(Secret::expose), Some("t"));
        assert_eq!(config.sink.kind(), SinkKind::Nats);
    }

    #[test]
    fn a_token_file_is_read_once_at_load() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "from-file\n").unwrap();
        let text = MINIMAL.replace(
            "token = \"t\"",
            &format!("token_file = {:?}", path.display().to_string()),
        );
        let config = raw(&text).check().unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(config.token_for(1).map(Secret::expose), Some("from-file"));
    }

    #[test]
    fn poll_defaults_are_the_named_constants_and_reach_the_sweep() {
        let poll = PollConfig::default();
        assert_eq!(poll.lookback, DEFAULT_LOOKBACK);
        assert_eq!(poll.ignore_keys, DEFAULT_IGNORE_KEYS.to_vec());
        assert_eq!(poll.max_delete_fraction, DEFAULT_MAX_DELETE_FRACTION);
        let custom = PollConfig {
            lookback: Duration::from_secs(5),
            max_pages_floor: 7,
            ..poll
        };
        let settings = SweepSettings::from(&custom);
        assert_eq!(settings.lookback, Duration::from_secs(5));
        assert_eq!(settings.max_pages_floor, 7);
        assert_eq!(settings.full_retry_initial, DEFAULT_POLL_INTERVAL);
        assert_eq!(settings.full_retry_max, DEFAULT_FULL_RESYNC_INTERVAL);
    }
}
