//! Command definitions (clap) and their dispatch. Each command returns the
//! process exit code: 0 ok, 2 usage or config error, 1 runtime failure; every
//! error is printed as one `error: ...` line naming its cause.
//!
//! `status`, `replay`, `replays`, `cancel-replay`, `pause`, `resume`,
//! `sweep` and `recheck` open the state store directly when no daemon holds
//! it, and go through the daemon's admin API when one does (the store is
//! then locked); `state export|import|reset` need the store to themselves.
//! Each command only translates its arguments to a use case of
//! `crate::control` and prints the answer.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use clap::{Parser, Subcommand};

use crate::admin::{self, StatusReport};
use crate::config::{self, Config};
use crate::control::pause::PauseResponse;
use crate::control::replay::{ReplayPhase, ReplayResponse, ReplayStatus};
use crate::control::sweep::SweepResponse;
use crate::control::{self, ControlError, Runtime};
use crate::daemon::{self, Daemon};
use crate::scheduler::StepOutcome;
use crate::secret::Secret;
use crate::simulator::SimulateArgs;
use crate::state::{RequestedBy, SledStore, StateError, SweepKind};
use crate::stream::{Resource, StreamKey, TenantId};
use crate::sweep::Progress;
use crate::telemetry::{self, LogFormat};

/// Exit code for success.
pub const EXIT_OK: u8 = 0;
/// Exit code for a runtime failure.
pub const EXIT_FAILURE: u8 = 1;
/// Exit code for a usage or configuration error.
pub const EXIT_USAGE: u8 = 2;
/// Exit code of `status` when a stream is parked or its last sweep failed.
pub const EXIT_UNHEALTHY: u8 = 3;

/// How long `status` and `replay` wait to learn whether a daemon answers.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long `status` waits for the admin API.
const STATUS_TIMEOUT: Duration = Duration::from_secs(10);
/// How long `replay` waits for the admin API (a sweep in flight finishes its page first).
const REPLAY_TIMEOUT: Duration = Duration::from_secs(120);
/// Shortest gap between two plain progress lines of one stream.
const PLAIN_PROGRESS_EVERY: Duration = Duration::from_secs(2);

/// voucher-cdc: change-data-capture from the External Voucher API to Kafka / NATS JetStream.
#[derive(Debug, Parser)]
#[command(name = "voucher-cdc", version, about, propagate_version = true)]
pub struct Cli {
    /// The command to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The commands of DESIGN.md's CLI table.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the bridge daemon.
    Run {
        /// Config file (TOML); env `VOUCHER_CDC_*` overrides it.
        #[arg(long, short, env = "VOUCHER_CDC_CONFIG")]
        config: Option<PathBuf>,
        /// Sweep every stream once, then exit.
        #[arg(long)]
        once: bool,
    },
    /// Simulator + bridge in one process, events to stdout; Ctrl-C stops.
    Demo {
        /// Tenants the demo simulator serves.
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=100))]
        tenants: u64,
        /// Vouchers per tenant.
        #[arg(long, default_value_t = 60)]
        vouchers: usize,
        /// Categories per tenant.
        #[arg(long, default_value_t = 8)]
        categories: usize,
        /// Background changes per minute.
        #[arg(long, default_value_t = 30)]
        changes_per_minute: u32,
    },
    /// Serve the upstream API simulator alone.
    Simulate(SimulateArgs),
    /// Per stream: watermark, records known, last sweep, lag, last error.
    /// Exits 3 when a stream is parked or its last sweep failed.
    Status {
        /// Config file (TOML).
        #[arg(long, short, env = "VOUCHER_CDC_CONFIG")]
        config: Option<PathBuf>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Ask the daemon at this admin API URL (e.g. through `kubectl port-forward`).
        #[command(flatten)]
        remote: Remote,
    },
    /// Schedule a replay of a tenant.
    Replay {
        /// The streams to replay.
        #[command(flatten)]
        target: StreamArgs,
        /// Replay records updated since this time (RFC 3339, a date, or an age like 2h) instead of everything.
        #[arg(long)]
        since: Option<String>,
    },
    /// List the latest replay of every stream, with its progress.
    Replays {
        /// Config file (TOML).
        #[arg(long, short, env = "VOUCHER_CDC_CONFIG")]
        config: Option<PathBuf>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Ask the daemon at this admin API URL (e.g. through `kubectl port-forward`).
        #[command(flatten)]
        remote: Remote,
    },
    /// Cancel a pending replay: the stream goes back to its watermark from before it.
    CancelReplay {
        /// The replay id (as `replay` printed it, or `replays` lists it).
        id: String,
        /// Config file (TOML).
        #[arg(long, short, env = "VOUCHER_CDC_CONFIG")]
        config: Option<PathBuf>,
        /// Ask the daemon at this admin API URL (e.g. through `kubectl port-forward`).
        #[command(flatten)]
        remote: Remote,
    },
    /// Pause a tenant's streams (or one): no sweep, no upstream request until resumed; survives restarts.
    Pause {
        /// The streams to pause.
        #[command(flatten)]
        target: StreamArgs,
    },
    /// Resume paused streams: they go on from their watermark.
    Resume {
        /// The streams to resume.
        #[command(flatten)]
        target: StreamArgs,
    },
    /// Sweep a tenant's streams (or one) now instead of at the next interval (a daemon must run).
    Sweep {
        /// The streams to sweep.
        #[command(flatten)]
        target: StreamArgs,
        /// A full sweep (lists everything, finds deletes) instead of an incremental one.
        #[arg(long)]
        full: bool,
    },
    /// Recheck a tenant's parked streams (or one) now instead of at the next recheck interval.
    Recheck {
        /// The streams to recheck.
        #[command(flatten)]
        target: StreamArgs,
    },
    /// Export, import or forget stream state (the store must not be held by a daemon).
    State {
        /// What to do.
        #[command(subcommand)]
        command: StateCommand,
    },
    /// Validate and print the effective config, secrets redacted.
    CheckConfig {
        /// Config file (TOML).
        #[arg(long, short, env = "VOUCHER_CDC_CONFIG")]
        config: Option<PathBuf>,
        /// Also connect: one request per tenant with its token, and the sink;
        /// one line per result, exit code 1 when any fails.
        #[arg(long)]
        probe: bool,
    },
}

/// The streams a steering command names, and where to find the state.
#[derive(Debug, Clone, clap::Args)]
pub struct StreamArgs {
    /// The tenant.
    #[arg(long)]
    pub tenant: TenantId,
    /// Only this resource (default: every resource of the tenant).
    #[arg(long)]
    pub resource: Option<Resource>,
    /// Config file (TOML).
    #[arg(long, short, env = "VOUCHER_CDC_CONFIG")]
    pub config: Option<PathBuf>,
    /// Ask the daemon at this admin API URL (e.g. through `kubectl port-forward`).
    #[command(flatten)]
    pub remote: Remote,
}

/// `state export|import|reset`.
#[derive(Debug, Subcommand)]
pub enum StateCommand {
    /// Write the state of the configured streams as versioned JSON lines to stdout.
    Export {
        /// Config file (TOML).
        #[arg(long, short, env = "VOUCHER_CDC_CONFIG")]
        config: Option<PathBuf>,
        /// Only this tenant.
        #[arg(long)]
        tenant: Option<TenantId>,
        /// Only this resource.
        #[arg(long)]
        resource: Option<Resource>,
    },
    /// Load an export (from FILE, or stdin with `-`) into the store.
    Import {
        /// The export file, `-` for stdin.
        file: PathBuf,
        /// Config file (TOML).
        #[arg(long, short, env = "VOUCHER_CDC_CONFIG")]
        config: Option<PathBuf>,
        /// Overwrite streams the store already holds.
        #[arg(long)]
        replace: bool,
    },
    /// Forget a tenant's streams (or one): the next sweep is a first sync.
    Reset {
        /// Config file (TOML).
        #[arg(long, short, env = "VOUCHER_CDC_CONFIG")]
        config: Option<PathBuf>,
        /// The tenant.
        #[arg(long)]
        tenant: TenantId,
        /// Only this resource.
        #[arg(long)]
        resource: Option<Resource>,
    },
}

/// `--admin-url` / `--admin-token` of `status` and `replay`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct Remote {
    /// Admin API of a running daemon, e.g. `http://127.0.0.1:9464` (skips the local store).
    #[arg(long, value_name = "URL")]
    pub admin_url: Option<String>,
    /// Bearer token of that admin API (default: `admin.token` of the config).
    #[arg(long, env = "VOUCHER_CDC_ADMIN__TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
}

/// A command's failure: its exit code and the lines to print.
#[derive(Debug)]
struct Failure {
    code: u8,
    lines: Vec<String>,
}

impl Failure {
    fn usage(line: impl Into<String>) -> Self {
        Self {
            code: EXIT_USAGE,
            lines: vec![line.into()],
        }
    }

    fn runtime(line: impl Into<String>) -> Self {
        Self {
            code: EXIT_FAILURE,
            lines: vec![line.into()],
        }
    }
}

/// Runs a parsed command line and returns its exit code.
pub async fn run(cli: Cli) -> u8 {
    let result = match cli.command {
        Command::CheckConfig { config, probe } => check_config(config.as_deref(), probe).await,
        Command::Run { config, once } => run_daemon(config.as_deref(), once).await,
        Command::Demo {
            tenants,
            vouchers,
            categories,
            changes_per_minute,
        } => {
            telemetry::init_logging(LogFormat::Pretty, "warn");
            let options = crate::demo::DemoOptions {
                tenants,
                vouchers,
                categories,
                changes_per_minute,
            };
            crate::demo::run(options, shutdown_signal())
                .await
                .map_err(|e| Failure::runtime(format!("{e:#}")))
        }
        Command::Simulate(args) => {
            telemetry::init_logging(LogFormat::Pretty, "info");
            crate::simulator::run(args, shutdown_signal())
                .await
                .map_err(|e| Failure::runtime(format!("{e:#}")))
        }
        Command::Status {
            config,
            json,
            remote,
        } => status(config.as_deref(), json, &remote).await,
        Command::Replay { target, since } => replay(&target, since.as_deref()).await,
        Command::Replays {
            config,
            json,
            remote,
        } => list_replays(config.as_deref(), json, &remote).await,
        Command::CancelReplay { id, config, remote } => {
            cancel_replay(config.as_deref(), &id, &remote).await
        }
        Command::Pause { target } => set_paused(&target, true).await,
        Command::Resume { target } => set_paused(&target, false).await,
        Command::Sweep { target, full } => {
            let kind = if full {
                SweepKind::Full
            } else {
                SweepKind::Incremental
            };
            sweep_now(&target, Some(kind)).await
        }
        Command::Recheck { target } => sweep_now(&target, None).await,
        Command::State { command } => state_command(command),
    };
    match result {
        Ok(()) => EXIT_OK,
        Err(failure) => {
            for line in &failure.lines {
                eprintln!("error: {line}");
            }
            failure.code
        }
    }
}

fn load_config(path: Option<&Path>) -> Result<Config, Failure> {
    config::load(path).map_err(|e| {
        let mut lines = e.problems;
        if path.is_none() {
            lines.insert(0, NO_CONFIG.to_string());
        }
        Failure {
            code: EXIT_USAGE,
            lines,
        }
    })
}

/// The hint when no config file was named and the environment alone is not a config.
const NO_CONFIG: &str = "no config file given: pass --config FILE or set VOUCHER_CDC_CONFIG=FILE";

/// Like [`load_config`], for commands that only read a config: without a file,
/// one line saying how to name it instead of every missing key.
fn load_config_for_reading(path: Option<&Path>) -> Result<Config, Failure> {
    match path {
        Some(path) => load_config(Some(path)),
        None => config::load(None).map_err(|_| {
            Failure::usage(format!(
                "{NO_CONFIG} (or --admin-url URL to ask a running daemon)"
            ))
        }),
    }
}

async fn check_config(path: Option<&Path>, probe: bool) -> Result<(), Failure> {
    let cfg = load_config(path)?;
    print!("{}", cfg.redacted_toml());
    if !probe {
        return Ok(());
    }
    println!();
    let results = crate::probe::probe(&cfg).await;
    for result in &results {
        println!("# probe {result}");
    }
    let failed = results.iter().filter(|r| r.outcome.is_err()).count();
    if failed > 0 {
        return Err(Failure::runtime(format!(
            "probe: {} of {} failed",
            failed,
            results.len()
        )));
    }
    Ok(())
}

fn daemon_failure(e: daemon::DaemonError) -> Failure {
    Failure {
        code: if e.is_config() {
            EXIT_USAGE
        } else {
            EXIT_FAILURE
        },
        lines: vec![e.to_string()],
    }
}

async fn run_daemon(path: Option<&Path>, once: bool) -> Result<(), Failure> {
    let cfg = load_config(path)?;
    telemetry::init_logging(cfg.log.format, &cfg.log.level);
    if once {
        return run_once(&cfg).await;
    }
    let daemon = Daemon::build(&cfg).await.map_err(daemon_failure)?;
    daemon
        .run_until_stopped(shutdown_signal())
        .await
        .map_err(daemon_failure)
}

async fn run_once(cfg: &Config) -> Result<(), Failure> {
    let streams = daemon::owned_streams(cfg).map_err(daemon_failure)?;
    let reporter = OnceProgress::new(&streams, std::io::stderr().is_terminal());
    let outcomes = daemon::run_once(cfg, Some(reporter.callback()), shutdown_signal())
        .await
        .map_err(daemon_failure)?;
    let lines = reporter.finish(&outcomes);
    if lines.is_empty() {
        Ok(())
    } else {
        Err(Failure {
            code: EXIT_FAILURE,
            lines,
        })
    }
}

/// Progress of `run --once`: one indicatif bar per stream on a TTY, plain
/// lines (at most one per stream every two seconds) otherwise; both on stderr.
struct OnceProgress {
    multi: Option<indicatif::MultiProgress>,
    bars: HashMap<StreamKey, indicatif::ProgressBar>,
    last_line: Mutex<HashMap<StreamKey, Instant>>,
}

impl OnceProgress {
    fn new(streams: &[StreamKey], tty: bool) -> Arc<Self> {
        let mut bars = HashMap::new();
        let multi = tty.then(|| {
            let multi =
                indicatif::MultiProgress::with_draw_target(indicatif::ProgressDrawTarget::stderr());
            let style = indicatif::ProgressStyle::with_template("{spinner} {prefix:<16} {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner());
            for key in streams {
                let bar = multi.add(indicatif::ProgressBar::new_spinner());
                bar.set_style(style.clone());
                bar.set_prefix(key.to_string());
                bar.set_message("waiting for the rate budget");
                bar.enable_steady_tick(Duration::from_millis(120));
                bars.insert(*key, bar);
            }
            telemetry::set_progress(Some(multi.clone()));
            multi
        });
        Arc::new(Self {
            multi,
            bars,
            last_line: Mutex::new(HashMap::new()),
        })
    }

    fn callback(self: &Arc<Self>) -> Progress {
        let this = Arc::clone(self);
        Arc::new(move |key, records, pages| this.update(key, records, pages))
    }

    fn update(&self, key: StreamKey, records: u64, pages: u64) {
        let text = format!("{}, {}", plural(pages, "page"), plural(records, "record"));
        if let Some(bar) = self.bars.get(&key) {
            bar.set_message(text);
            return;
        }
        let mut last = self.last_line.lock().unwrap_or_else(|p| p.into_inner());
        let due = last
            .get(&key)
            .is_none_or(|at| at.elapsed() >= PLAIN_PROGRESS_EVERY);
        if due {
            last.insert(key, Instant::now());
            eprintln!("{key}: {text}");
        }
    }

    /// Shows each stream's result; returns the error lines of failed streams.
    fn finish(&self, outcomes: &[(StreamKey, StepOutcome)]) -> Vec<String> {
        let mut errors = Vec::new();
        for (key, outcome) in outcomes {
            let text = match outcome {
                StepOutcome::Swept(r) => format!(
                    "done: {} sweep, {}, {}, {}",
                    r.kind,
                    plural(r.pages, "page"),
                    plural(r.records_seen, "record"),
                    plural(r.events(), "event")
                ),
                StepOutcome::Paused => "paused: not swept (resume it first)".to_string(),
                StepOutcome::Parked(reason) => {
                    errors.push(format!(
                        "stream {key} parked: {reason} (run --once does not recheck it; fix the access and run again, a daemon rechecks every poll.park_recheck_interval)"
                    ));
                    format!("parked: {reason}")
                }
                other => {
                    let error = other.error().unwrap_or_default();
                    errors.push(format!("stream {key}: {error}"));
                    format!("failed: {error}")
                }
            };
            match self.bars.get(key) {
                Some(bar) => bar.finish_with_message(text),
                None => eprintln!("{key}: {text}"),
            }
        }
        if self.multi.is_some() {
            telemetry::set_progress(None);
        }
        errors
    }
}

/// How `status` and `replay` reach the state.
// One per command run: the store's size (its in-memory indexes) costs nothing here.
#[allow(clippy::large_enum_variant)]
enum Access {
    /// The store, opened directly (no daemon holds it).
    Store(SledStore, PathBuf),
    /// A daemon's admin API (it holds the store, or `--admin-url` named it).
    Admin(AdminClient),
}

impl Access {
    /// One line naming what was read: the store path, or the daemon that answered.
    fn describe(&self) -> String {
        match self {
            Access::Store(_, path) => format!(
                "read from: state store {} (no daemon holds it)",
                path.display()
            ),
            Access::Admin(client) => match &client.state_path {
                Some(path) => format!(
                    "read from: daemon at {} (it holds the state store {})",
                    client.base,
                    path.display()
                ),
                None => format!("read from: daemon at {}", client.base),
            },
        }
    }
}

/// `path` made absolute against the current directory, for messages.
fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// Finds the state: `--admin-url` when given; else the store at `state.path`,
/// or the daemon holding it; without a store, a daemon answering at
/// `admin.listen`; else one line saying neither was found.
async fn access(cfg: Option<&Config>, remote: &Remote) -> Result<Access, Failure> {
    let token = remote
        .admin_token
        .clone()
        .map(Secret::new)
        .or_else(|| cfg.and_then(|c| c.admin.token.clone()));
    if let Some(url) = &remote.admin_url {
        return Ok(Access::Admin(AdminClient::new(url, token, None)?));
    }
    let Some(cfg) = cfg else {
        return Err(Failure::usage(format!(
            "{NO_CONFIG} (or --admin-url URL to ask a running daemon)"
        )));
    };
    let path = absolute(&cfg.state.path);
    if path.exists() {
        return match SledStore::open_with_cache(&path, cfg.state.cache_bytes()) {
            Ok(store) => Ok(Access::Store(store, path)),
            Err(StateError::Locked { .. }) => Ok(Access::Admin(AdminClient::new(
                &listen_url(cfg),
                token,
                Some(path),
            )?)),
            Err(e) => Err(Failure::runtime(e.to_string())),
        };
    }
    let url = listen_url(cfg);
    let client = AdminClient::new(&url, token, None)?;
    if client.answers().await {
        return Ok(Access::Admin(client));
    }
    Err(Failure::runtime(format!(
        "no state store at {} and no daemon answered at {url}: run where the daemon keeps its state (a relative state.path is read from the current directory) or pass --admin-url",
        path.display()
    )))
}

/// `http://ADDR` of the configured `admin.listen`, reachable from this machine.
fn listen_url(cfg: &Config) -> String {
    format!("http://{}", admin::connect_address(cfg.admin.listen))
}

/// A client of a running daemon's admin API.
struct AdminClient {
    base: String,
    token: Option<Secret>,
    http: reqwest::Client,
    /// The local store the daemon holds, when that is how it was found.
    state_path: Option<PathBuf>,
}

impl AdminClient {
    fn new(url: &str, token: Option<Secret>, state_path: Option<PathBuf>) -> Result<Self, Failure> {
        let parsed = url::Url::parse(url)
            .ok()
            .filter(|u| u.scheme() == "http" || u.scheme() == "https");
        if parsed.is_none() {
            return Err(Failure::usage(format!(
                "--admin-url: `{url}` is not a URL like http://127.0.0.1:9464"
            )));
        }
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(3))
            .build()
            .map_err(|e| Failure::runtime(format!("cannot build the http client: {e}")))?;
        Ok(Self {
            base: url.trim_end_matches('/').to_string(),
            token,
            http,
            state_path,
        })
    }

    /// True when something answers `/healthz` like a daemon.
    async fn answers(&self) -> bool {
        let request = self
            .http
            .get(format!("{}/healthz", self.base))
            .timeout(PROBE_TIMEOUT);
        matches!(request.send().await, Ok(r) if r.status().is_success())
    }

    fn request(&self, builder: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        let builder = builder.header("x-requested-by", "cli");
        match &self.token {
            Some(token) => builder.bearer_auth(token.expose()),
            None => builder,
        }
    }

    async fn send<T: serde::de::DeserializeOwned>(
        &self,
        builder: reqwest::RequestBuilder,
        what: &str,
    ) -> Result<T, Failure> {
        let response = self.request(builder).send().await.map_err(|e| {
            let reason = if e.is_timeout() {
                "did not answer in time".to_string()
            } else if e.is_connect() {
                "cannot connect".to_string()
            } else {
                e.without_url().to_string()
            };
            Failure::runtime(match &self.state_path {
                Some(path) => format!(
                    "state store {} is held by a running daemon, but its admin api at {} failed for {what}: {reason} (check admin.listen)",
                    path.display(),
                    self.base
                ),
                None => format!("admin api at {} failed for {what}: {reason}", self.base),
            })
        })?;
        let status = response.status();
        let body = response.bytes().await.map_err(|e| {
            Failure::runtime(format!(
                "admin api at {}: reading the answer to {what} failed: {}",
                self.base,
                e.without_url()
            ))
        })?;
        if !status.is_success() {
            let message = serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v.get("message").and_then(|m| m.as_str()).map(String::from))
                .unwrap_or_else(|| String::from_utf8_lossy(&body).chars().take(200).collect());
            return Err(Failure::runtime(format!(
                "admin api at {} answered {} to {what}: {message}",
                self.base,
                status.as_u16()
            )));
        }
        serde_json::from_slice(&body).map_err(|e| {
            Failure::runtime(format!(
                "admin api at {} sent an unreadable answer to {what}: {e}",
                self.base
            ))
        })
    }

    async fn status(&self) -> Result<StatusReport, Failure> {
        let builder = self
            .http
            .get(format!("{}/v1/status", self.base))
            .timeout(STATUS_TIMEOUT);
        self.send(builder, "GET /v1/status").await
    }

    async fn get<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T, Failure> {
        let builder = self
            .http
            .get(format!("{}{path}", self.base))
            .timeout(STATUS_TIMEOUT);
        self.send(builder, &format!("GET {path}")).await
    }

    async fn post<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        body: serde_json::Value,
    ) -> Result<T, Failure> {
        let builder = self
            .http
            .post(format!("{}{path}", self.base))
            .timeout(REPLAY_TIMEOUT)
            .json(&body);
        self.send(builder, &format!("POST {path}")).await
    }
}

fn owned_streams(cfg: &Config) -> Result<Vec<StreamKey>, Failure> {
    daemon::owned_streams(cfg).map_err(daemon_failure)
}

/// The config `status` / `replay` use: required unless `--admin-url` is given.
fn reading_config(path: Option<&Path>, remote: &Remote) -> Result<Option<Config>, Failure> {
    if remote.admin_url.is_some() && path.is_none() {
        return Ok(None);
    }
    let cfg = load_config_for_reading(path)?;
    telemetry::init_logging(cfg.log.format, "warn");
    Ok(Some(cfg))
}

async fn status(path: Option<&Path>, json: bool, remote: &Remote) -> Result<(), Failure> {
    let cfg = reading_config(path, remote)?;
    let now = Utc::now();
    let access = access(cfg.as_ref(), remote).await?;
    let report = match &access {
        Access::Store(store, _) => {
            let streams = match &cfg {
                Some(cfg) => owned_streams(cfg)?,
                None => Vec::new(),
            };
            let mut streams = control::status::status_from_store(store, &streams, now)
                .map_err(|e| Failure::runtime(e.to_string()))?;
            // Nobody holds the store: no sweep can be running now.
            for s in &mut streams {
                s.sweep_in_progress_since = None;
            }
            StatusReport {
                streams,
                sink: None,
                budgets: Vec::new(),
            }
        }
        Access::Admin(client) => client.status().await?,
    };
    if json {
        let text = serde_json::to_string_pretty(&report)
            .map_err(|e| Failure::runtime(format!("cannot render the status: {e}")))?;
        println!("{text}");
        eprintln!("{}", access.describe());
    } else {
        print!("{}", format_status(&report, now));
        println!("{}", access.describe());
    }
    let attention: Vec<String> = report
        .streams
        .iter()
        .filter(|s| s.needs_attention())
        .map(|s| s.key().to_string())
        .collect();
    if attention.is_empty() {
        Ok(())
    } else {
        Err(Failure {
            code: EXIT_UNHEALTHY,
            lines: vec![format!(
                "{} need attention (parked or last sweep failed): {}",
                plural(attention.len() as u64, "stream"),
                attention.join(", ")
            )],
        })
    }
}

/// A use case's failure as the CLI reports it: a bad argument or an unknown
/// tenant is a usage error (exit 2), anything else a runtime failure (exit 1).
fn control_failure(e: ControlError) -> Failure {
    match &e {
        ControlError::Invalid { field, problem } => Failure::usage(format!("--{field}: {problem}")),
        ControlError::UnknownTenant { .. } => Failure::usage(e.to_string()),
        _ => Failure::runtime(e.to_string()),
    }
}

/// The configured streams `target` names (None with `--admin-url` alone: the daemon resolves them).
fn named_streams(cfg: Option<&Config>, target: &StreamArgs) -> Result<Vec<StreamKey>, Failure> {
    let Some(cfg) = cfg else {
        return Ok(Vec::new());
    };
    control::resolve_targets(
        &owned_streams(cfg)?,
        &target.tenant.to_string(),
        target.resource.map(Resource::as_str),
    )
    .map_err(control_failure)
}

/// The request body naming `target`'s resource, plus `extra` fields.
fn target_body(target: &StreamArgs, extra: serde_json::Value) -> serde_json::Value {
    let mut body = serde_json::json!({ "resource": target.resource.map(Resource::as_str) });
    if let (Some(body), serde_json::Value::Object(extra)) = (body.as_object_mut(), extra) {
        body.extend(extra);
    }
    body
}

async fn replay(target: &StreamArgs, since: Option<&str>) -> Result<(), Failure> {
    let cfg = reading_config(target.config.as_deref(), &target.remote)?;
    let targets = named_streams(cfg.as_ref(), target)?;
    let since = since
        .map(|text| admin::parse_since(text, Utc::now()))
        .transpose()
        .map_err(|e| Failure::usage(format!("--since: {e}")))?;
    let tenant = target.tenant;
    let response: ReplayResponse = match access(cfg.as_ref(), &target.remote).await? {
        Access::Admin(client) => {
            let since = since.map(crate::event::format_time);
            let body = target_body(target, serde_json::json!({ "since": since }));
            client
                .post(&format!("/v1/tenants/{tenant}/replay"), body)
                .await?
        }
        Access::Store(store, _) => control::replay::schedule(
            Runtime::Store(&store),
            tenant,
            &targets,
            since,
            RequestedBy::Cli,
        )
        .await
        .map_err(control_failure)?,
    };
    for r in &response.replays {
        let from = r
            .since
            .map(|s| format!("records updated since {}", crate::event::format_time(s)))
            .unwrap_or_else(|| "every record".to_string());
        println!(
            "replay {} scheduled for tenant {} {}: {from}",
            r.replay_id, response.tenant, r.resource
        );
    }
    Ok(())
}

async fn set_paused(target: &StreamArgs, pause: bool) -> Result<(), Failure> {
    let cfg = reading_config(target.config.as_deref(), &target.remote)?;
    let targets = named_streams(cfg.as_ref(), target)?;
    let tenant = target.tenant;
    let verb = if pause { "pause" } else { "resume" };
    let access = access(cfg.as_ref(), &target.remote).await?;
    let response: PauseResponse = match &access {
        Access::Admin(client) => {
            let body = target_body(target, serde_json::json!({}));
            client
                .post(&format!("/v1/tenants/{tenant}/{verb}"), body)
                .await?
        }
        Access::Store(store, _) => control::pause::set_paused(
            Runtime::Store(store),
            tenant,
            &targets,
            pause,
            RequestedBy::Cli,
        )
        .await
        .map_err(control_failure)?,
    };
    for s in &response.streams {
        let state = if s.paused { "paused" } else { "resumed" };
        let note = if s.changed {
            ""
        } else if s.paused {
            " (it was paused already)"
        } else {
            " (it was not paused)"
        };
        println!("{tenant}/{} {state}{note}", s.resource);
    }
    println!(
        "{}",
        access.describe().replacen("read from", "written to", 1)
    );
    Ok(())
}

async fn sweep_now(target: &StreamArgs, kind: Option<SweepKind>) -> Result<(), Failure> {
    let cfg = reading_config(target.config.as_deref(), &target.remote)?;
    let targets = named_streams(cfg.as_ref(), target)?;
    let tenant = target.tenant;
    let response: SweepResponse = match access(cfg.as_ref(), &target.remote).await? {
        Access::Admin(client) => {
            let (path, body) = match kind {
                Some(kind) => (
                    "sweep",
                    target_body(target, serde_json::json!({ "kind": kind.as_str() })),
                ),
                None => ("recheck", target_body(target, serde_json::json!({}))),
            };
            client
                .post(&format!("/v1/tenants/{tenant}/{path}"), body)
                .await?
        }
        Access::Store(store, _) => control::sweep::sweep_now(
            Runtime::Store(&store),
            tenant,
            &targets,
            kind,
            kind.is_none(),
        )
        .await
        .map_err(control_failure)?,
    };
    for resource in &response.resources {
        println!(
            "{tenant}/{resource}: {} sweep started",
            if response.kind == "due" {
                "recheck"
            } else {
                response.kind.as_str()
            }
        );
    }
    Ok(())
}

async fn list_replays(path: Option<&Path>, json: bool, remote: &Remote) -> Result<(), Failure> {
    let cfg = reading_config(path, remote)?;
    let access = access(cfg.as_ref(), remote).await?;
    let replays: Vec<ReplayStatus> = match &access {
        Access::Admin(client) => client.get("/v1/replays").await?,
        Access::Store(store, _) => {
            let streams = match &cfg {
                Some(cfg) => owned_streams(cfg)?,
                None => Vec::new(),
            };
            control::replay::list(store, &streams).map_err(control_failure)?
        }
    };
    if json {
        let text = serde_json::to_string_pretty(&replays)
            .map_err(|e| Failure::runtime(format!("cannot render the replays: {e}")))?;
        println!("{text}");
        eprintln!("{}", access.describe());
    } else {
        print!("{}", format_replays(&replays, Utc::now()));
        println!("{}", access.describe());
    }
    Ok(())
}

/// The `replays` table.
pub fn format_replays(replays: &[ReplayStatus], now: DateTime<Utc>) -> String {
    let mut rows = vec![[
        "REPLAY".to_string(),
        "STREAM".to_string(),
        "PHASE".to_string(),
        "RECORDS".to_string(),
        "REQUESTED".to_string(),
        "BY".to_string(),
        "SINCE".to_string(),
    ]];
    for r in replays {
        let phase = match r.phase {
            ReplayPhase::Scheduled => "scheduled",
            ReplayPhase::Running => "running",
            ReplayPhase::Completed => "completed",
            ReplayPhase::Cancelled => "cancelled",
        };
        rows.push([
            r.replay_id.clone(),
            format!("{}/{}", r.tenant, r.resource),
            phase.to_string(),
            r.records.to_string(),
            format!(
                "{} ago",
                format_age(telemetry::seconds_between(r.requested_at, now))
            ),
            r.requested_by.map_or("-", RequestedBy::as_str).to_string(),
            r.since
                .map(crate::event::format_time)
                .unwrap_or_else(|| "everything".to_string()),
        ]);
    }
    format_table(&rows)
}

/// Rows as left-aligned columns two spaces apart.
fn format_table<const N: usize>(rows: &[[String; N]]) -> String {
    let widths: Vec<usize> = (0..N)
        .map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

async fn cancel_replay(path: Option<&Path>, id: &str, remote: &Remote) -> Result<(), Failure> {
    let cfg = reading_config(path, remote)?;
    let cancelled: ReplayStatus = match access(cfg.as_ref(), remote).await? {
        Access::Admin(client) => {
            client
                .post(&format!("/v1/replays/{id}/cancel"), serde_json::json!({}))
                .await?
        }
        Access::Store(store, _) => {
            let streams = match &cfg {
                Some(cfg) => owned_streams(cfg)?,
                None => Vec::new(),
            };
            control::replay::cancel(Runtime::Store(&store), &store, &streams, id)
                .await
                .map_err(control_failure)?
        }
    };
    println!(
        "replay {} of {}/{} cancelled after {}: the stream goes on from its watermark before the replay",
        cancelled.replay_id,
        cancelled.tenant,
        cancelled.resource,
        plural(cancelled.records, "record")
    );
    Ok(())
}

/// Opens the store at `state.path` of the config for `state` commands,
/// which need it to themselves; `create` for an import into a new store.
fn exclusive_store(path: Option<&Path>, create: bool) -> Result<SledStore, Failure> {
    let cfg = load_config_for_reading(path)?;
    telemetry::init_logging(cfg.log.format, "warn");
    let path = absolute(&cfg.state.path);
    if !create && !path.exists() {
        return Err(Failure::runtime(format!(
            "no state store at {} (a relative state.path is read from the current directory)",
            path.display()
        )));
    }
    SledStore::open_with_cache(&path, cfg.state.cache_bytes()).map_err(|e| match e {
        StateError::Locked { path } => Failure::runtime(format!(
            "state store {} is held by a running daemon: stop it first (state export, import and reset need the store to themselves)",
            path.display()
        )),
        e => Failure::runtime(e.to_string()),
    })
}

/// `exported 1/vouchers: 20 records, 0 tombstones, 0 pending intents`.
fn moved(verb: &str, c: &control::state_file::StreamCounts) -> String {
    format!(
        "{verb} {}: {}, {}, {}",
        c.stream,
        plural(c.records, "record"),
        plural(c.tombstones, "tombstone"),
        plural(c.intents, "pending intent")
    )
}

fn state_command(command: StateCommand) -> Result<(), Failure> {
    match command {
        StateCommand::Export {
            config,
            tenant,
            resource,
        } => {
            let store = exclusive_store(config.as_deref(), false)?;
            let stdout = std::io::stdout();
            let mut out = std::io::BufWriter::new(stdout.lock());
            let counts = control::state_file::export(&store, tenant, resource, &mut out)
                .map_err(control_failure)?;
            for c in counts {
                eprintln!("{}", moved("exported", &c));
            }
            Ok(())
        }
        StateCommand::Import {
            file,
            config,
            replace,
        } => {
            let mut input: Box<dyn std::io::BufRead> = if file.as_os_str() == "-" {
                Box::new(std::io::BufReader::new(std::io::stdin()))
            } else {
                let opened = std::fs::File::open(&file).map_err(|e| {
                    Failure::runtime(format!("cannot open {}: {e}", file.display()))
                })?;
                Box::new(std::io::BufReader::new(opened))
            };
            let store = exclusive_store(config.as_deref(), true)?;
            let counts = control::state_file::import(&store, &mut input, replace)
                .map_err(control_failure)?;
            for c in counts {
                println!("{}", moved("imported", &c));
            }
            Ok(())
        }
        StateCommand::Reset {
            config,
            tenant,
            resource,
        } => {
            let store = exclusive_store(config.as_deref(), false)?;
            for (key, records) in
                control::state_file::reset(&store, tenant, resource).map_err(control_failure)?
            {
                println!(
                    "forgot {key} ({}): its next sweep is a first sync",
                    plural(records, "record")
                );
            }
            Ok(())
        }
    }
}

/// `1 page`, `2 pages`, `3 categories`: a count with its noun.
pub fn plural(count: u64, noun: &str) -> String {
    if count == 1 {
        return format!("1 {noun}");
    }
    match noun.strip_suffix('y') {
        Some(stem) if !stem.ends_with(['a', 'e', 'o', 'u']) => format!("{count} {stem}ies"),
        _ => format!("{count} {noun}s"),
    }
}

/// A short age: `42s`, `3m 5s`, `2h 10m`, `3d 4h`.
pub fn format_age(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m {}s", s / 60, s % 60),
        3600..=86_399 => format!("{}h {}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d {}h", s / 86_400, (s % 86_400) / 3600),
    }
}

/// The `status` table plus one detail line per parked, failing or replaying stream.
pub fn format_status(report: &StatusReport, now: DateTime<Utc>) -> String {
    let ago = |t: Option<DateTime<Utc>>| match t {
        Some(t) => format!("{} ago", format_age(telemetry::seconds_between(t, now))),
        None => "never".to_string(),
    };
    let mut rows = vec![[
        "STREAM".to_string(),
        "WATERMARK".to_string(),
        "LAG".to_string(),
        "RECORDS".to_string(),
        "LAST SWEEP".to_string(),
        "LAST FULL SWEEP".to_string(),
        "STATE".to_string(),
    ]];
    let mut details = Vec::new();
    for s in &report.streams {
        let key = s.key();
        let state = if s.paused.is_some() {
            "paused"
        } else if s.parked.is_some() {
            "parked"
        } else if s.sweep_in_progress_since.is_some() && s.watermark.is_none() {
            "syncing"
        } else if s.replay.as_ref().is_some_and(|r| r.pending) {
            "replaying"
        } else if s.last_error.is_some() {
            "error"
        } else if s.watermark.is_none() {
            "never synced"
        } else {
            "ok"
        };
        rows.push([
            key.to_string(),
            s.watermark
                .map(crate::event::format_time)
                .unwrap_or_else(|| "-".to_string()),
            s.lag_seconds.map(format_age).unwrap_or_else(|| "-".into()),
            s.records_known.max(s.records_committed).to_string(),
            ago(s.last_sweep_finished),
            ago(s.last_full_sweep_finished),
            state.to_string(),
        ]);
        if let Some(pause) = &s.paused {
            details.push(format!(
                "{key} paused since {} ({}) by {}: not swept until resumed",
                crate::event::format_time(pause.since),
                ago(Some(pause.since)),
                pause.by.as_str()
            ));
        }
        if let Some(reason) = &s.parked {
            details.push(format!("{key} parked: {reason}"));
        } else if let Some(error) = &s.last_error {
            details.push(format!(
                "{key} last error ({}): {error}",
                ago(s.last_error_at)
            ));
        }
        if let Some(since) = s.sweep_in_progress_since {
            details.push(format!(
                "{key} sweep in progress since {} ({}), {} committed so far",
                crate::event::format_time(since),
                ago(Some(since)),
                plural(s.records_committed, "record")
            ));
        }
        if let Some(r) = s.replay.as_ref().filter(|r| r.pending) {
            details.push(format!(
                "{key} replay {} pending since {}",
                r.id,
                ago(Some(r.requested_at))
            ));
        }
        for d in &s.dead_letters {
            details.push(format!(
                "{key} record {} dead-lettered since {} ({}): {}",
                d.record_id,
                crate::event::format_time(d.since),
                ago(Some(d.since)),
                d.reason
            ));
        }
    }
    let mut out = format_table(&rows);
    if let Some(sink) = &report.sink {
        match &sink.error {
            None => out.push_str(&format!("sink {}: healthy\n", sink.name)),
            Some(e) => out.push_str(&format!("sink {}: unhealthy: {e}\n", sink.name)),
        }
    }
    for b in &report.budgets {
        out.push_str(&format!(
            "budget of token {}: {:.0} of {:.0} requests/min (learnt from 429s), {} used last window, \
             waiting {} poll + {} full-sweep, full sweeps {:.0}% of recent requests (limit {:.0}%)\n",
            b.token_id,
            b.learnt_per_minute,
            b.configured_per_minute,
            b.used_last_window,
            b.waiting_poll,
            b.waiting_bulk,
            b.full_sweep_share * 100.0,
            b.full_sweep_share_limit * 100.0
        ));
    }
    for s in &report.streams {
        if let Some(late) = s.full_sweep_overdue_seconds {
            details.push(format!(
                "{} full sweep overdue by {} (the budget's full-sweep share does not fit poll.full_resync_interval)",
                s.key(),
                format_age(late)
            ));
        }
    }
    for line in details {
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// Completes on SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admin::StreamStatus;

    #[test]
    fn counts_agree_with_their_noun() {
        assert_eq!(plural(1, "tenant"), "1 tenant");
        assert_eq!(plural(2, "page"), "2 pages");
        assert_eq!(plural(0, "record"), "0 records");
        assert_eq!(plural(3, "category"), "3 categories");
        assert_eq!(plural(1, "category"), "1 category");
    }

    #[test]
    fn the_status_table_shows_a_first_sync_in_progress_with_its_records_so_far() {
        let now = Utc::now();
        let started = now - chrono::Duration::seconds(95);
        let state = crate::state::StreamState {
            last_sweep_started: Some(started),
            ..Default::default()
        };
        let mut syncing =
            StreamStatus::from_state(StreamKey::new(1, Resource::Vouchers), &state, now);
        syncing.records_committed = 340;
        let report = StatusReport {
            streams: vec![syncing],
            sink: None,
            budgets: Vec::new(),
        };
        let text = format_status(&report, now);
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[1].contains(" 340 ") && lines[1].ends_with("syncing"),
            "{text}"
        );
        assert_eq!(
            lines[2],
            format!(
                "1/vouchers sweep in progress since {} (1m 35s ago), 340 records committed so far",
                crate::event::format_time(started)
            )
        );
    }

    #[test]
    fn the_status_table_shows_each_tokens_budget_and_late_full_sweeps() {
        let now = Utc::now();
        let mut late = StreamStatus::from_state(
            StreamKey::new(3, Resource::Categories),
            &Default::default(),
            now,
        );
        late.full_sweep_overdue_seconds = Some(125.0);
        let report = StatusReport {
            streams: vec![late],
            sink: None,
            budgets: vec![crate::planner::BudgetStatus {
                token_id: "1a2b3c4d".into(),
                configured_per_minute: 120.0,
                learnt_per_minute: 84.0,
                used_last_window: 80,
                waiting_poll: 3,
                waiting_bulk: 1,
                full_sweep_share: 0.12,
                full_sweep_share_limit: 0.25,
            }],
        };
        let text = format_status(&report, now);
        assert!(
            text.contains(
                "budget of token 1a2b3c4d: 84 of 120 requests/min (learnt from 429s), 80 used last \
                 window, waiting 3 poll + 1 full-sweep, full sweeps 12% of recent requests (limit 25%)"
            ),
            "{text}"
        );
        assert!(
            text.contains("3/categories full sweep overdue by 2m 5s"),
            "{text}"
        );
    }

    #[test]
    fn ages_are_short_and_readable() {
        assert_eq!(format_age(4.4), "4s");
        assert_eq!(format_age(125.0), "2m 5s");
        assert_eq!(format_age(7_500.0), "2h 5m");
        assert_eq!(format_age(200_000.0), "2d 7h");
        assert_eq!(format_age(-3.0), "0s");
    }

    #[test]
    fn the_status_table_names_every_stream_and_explains_parked_ones() {
        let now = Utc::now();
        let parked = crate::state::StreamState {
            parked: Some("upstream returned 403 for /tenants/2/catalog/vouchers: no access".into()),
            ..Default::default()
        };
        let report = StatusReport {
            streams: vec![
                StreamStatus::from_state(
                    StreamKey::new(1, Resource::Vouchers),
                    &Default::default(),
                    now,
                ),
                StreamStatus::from_state(StreamKey::new(2, Resource::Vouchers), &parked, now),
            ],
            sink: None,
            budgets: Vec::new(),
        };
        let text = format_status(&report, now);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("STREAM"));
        assert!(lines[1].starts_with("1/vouchers") && lines[1].ends_with("never synced"));
        assert!(lines[2].starts_with("2/vouchers") && lines[2].ends_with("parked"));
        assert!(lines[3].contains("2/vouchers parked: upstream returned 403"));
    }
}
