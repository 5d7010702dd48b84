//! Wires a daemon together from a [`Config`]: the state store, one upstream
//! client per token with the token's shared rate budget, the sink, one
//! stream runner per owned stream, the scheduler, the admin API and the gauge
//! refresher; and takes them down in order on shutdown.
//!
//! A daemon is a lifecycle: [`Daemon::build`] opens and binds everything
//! (the admin port is known from then on), [`Daemon::run_until_stopped`]
//! runs until its shutdown future completes, and the teardown is one named
//! step. [`Daemon::spawn`] runs it on a task behind a [`DaemonHandle`], so
//! tests drive whole daemons in-process; `run --once` is [`run_once`].

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio::task::{JoinError, JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn, Instrument};

use crate::admin::{self, AdminState};
use crate::config::{Config, PollConfig, Strategy};
use crate::planner::{Planner, PlannerSettings, POLL_LANES};
use crate::scheduler::{Scheduler, StepOutcome, StopReport, StreamRunner, Timing};
use crate::secret::Secret;
use crate::shard::ShardError;
use crate::sinks::{Sink, SinkBuildError};
use crate::state::{SledStore, StateError, StateStore};
use crate::stream::{StreamKey, TenantId};
use crate::sweep::{Progress, SweepSettings, Sweeper};
use crate::upstream::body_budget::BodyBudget;
use crate::upstream::client::{ClientOptions, SecretToken, UpstreamClient};
use crate::upstream::error::UpstreamError;
use crate::upstream::ratelimit::{BudgetRegistry, RateBudget};

/// How often the per-stream gauges are refreshed from the store.
const GAUGE_REFRESH: Duration = Duration::from_secs(5);

/// How long the admin server may take to close its connections at shutdown.
const ADMIN_STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a daemon could not start or stopped abnormally; one line each, the
/// typed cause kept as the error's source.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// This replica's shard cannot be resolved (exit code 2).
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// A stream's tenant has no token (exit code 2).
    #[error("upstream.token: required (or upstream.token_file)")]
    MissingToken {
        /// The tenant without a token.
        tenant: TenantId,
    },
    /// The upstream client cannot be built from `[upstream]` (exit code 2).
    #[error("upstream: {0}")]
    Upstream(#[source] UpstreamError),
    /// The state store failed.
    #[error(transparent)]
    State(#[from] StateError),
    /// The sink could not start.
    #[error(transparent)]
    Sink(#[from] SinkBuildError),
    /// The daemon's own task failed (a bug: it panicked).
    #[error("daemon task failed: {0}")]
    Task(#[from] JoinError),
    /// The admin API could not listen or failed.
    #[error("admin api on {listen}: {failure}")]
    Admin {
        /// The configured listen address.
        listen: SocketAddr,
        /// What went wrong.
        #[source]
        failure: AdminFailure,
    },
}

impl DaemonError {
    /// True for configuration problems (exit code 2 rather than 1).
    pub fn is_config(&self) -> bool {
        matches!(
            self,
            DaemonError::Shard(_) | DaemonError::MissingToken { .. } | DaemonError::Upstream(_)
        )
    }
}

/// How the admin API failed.
#[derive(Debug, thiserror::Error)]
pub enum AdminFailure {
    /// Its address cannot be bound.
    #[error("cannot listen: {0}")]
    Listen(#[source] std::io::Error),
    /// The bound socket has no local address.
    #[error("{0}")]
    LocalAddress(#[source] std::io::Error),
    /// The server returned while the daemon ran.
    #[error("stopped unexpectedly")]
    StoppedUnexpectedly,
    /// The server failed while the daemon ran.
    #[error("{0}")]
    Serve(#[source] std::io::Error),
    /// The server's task panicked.
    #[error("task failed: {0}")]
    Task(#[source] JoinError),
}

impl AdminFailure {
    /// Why the admin server's task ended while the daemon ran.
    fn from_served(served: Result<std::io::Result<()>, JoinError>) -> Self {
        match served {
            Ok(Ok(())) => AdminFailure::StoppedUnexpectedly,
            Ok(Err(e)) => AdminFailure::Serve(e),
            Err(e) => AdminFailure::Task(e),
        }
    }
}

/// The sweep settings `[poll]` and `sink.on_record_error` ask for; events
/// name schemas served by an admin API on `admin_addr` unless
/// `events.schema_base_url` is set.
pub fn sweep_settings(config: &Config, admin_addr: SocketAddr) -> SweepSettings {
    SweepSettings {
        on_record_error: config.sink.on_record_error,
        schema_base: config.events.schema_base(admin_addr),
        changed_fields: config.events.changed_fields,
        before: config.events.before,
        ..SweepSettings::from(&config.poll)
    }
}

/// One upstream client per distinct token, each spending its token's shared budget.
fn clients_for(
    config: &Config,
    streams: &[StreamKey],
) -> Result<HashMap<StreamKey, UpstreamClient>, DaemonError> {
    clients_with(config, streams, ClientOptions::from(&config.upstream))
}

/// One upstream client per stream with `options`, one per distinct token
/// (streams sharing a token share its client and its rate budget).
pub fn clients_with(
    config: &Config,
    streams: &[StreamKey],
    options: ClientOptions,
) -> Result<HashMap<StreamKey, UpstreamClient>, DaemonError> {
    let budgets = BudgetRegistry::new();
    // One body budget for the process: tenants with tokens of their own
    // list into the same memory.
    let bodies = Arc::new(BodyBudget::new(options.body_budget_bytes));
    let mut by_token: HashMap<[u8; 32], UpstreamClient> = HashMap::new();
    let mut clients = HashMap::with_capacity(streams.len());
    for key in streams {
        let secret = config
            .token_for(key.tenant)
            .ok_or(DaemonError::MissingToken { tenant: key.tenant })?;
        let token = SecretToken::new(secret.expose());
        let id = *blake3::hash(token.expose().as_bytes()).as_bytes();
        let client = match by_token.get(&id) {
            Some(client) => client.clone(),
            None => {
                let budget = budgets.budget_for(
                    &token,
                    config.upstream.requests_per_minute,
                    config.upstream.rate_window,
                );
                let client = UpstreamClient::with_body_budget(
                    options.clone(),
                    token,
                    budget,
                    bodies.clone(),
                )
                .map_err(DaemonError::Upstream)?;
                by_token.insert(id, client.clone());
                client
            }
        };
        clients.insert(*key, client);
    }
    Ok(clients)
}

/// The streams this process owns (its shard's tenants), in key order.
pub fn owned_streams(config: &Config) -> Result<Vec<StreamKey>, DaemonError> {
    let shard = config.shard.resolve()?;
    let mut streams = config.streams(&shard);
    streams.sort();
    Ok(streams)
}

/// Each token's budget once, with the token's fingerprint, in fingerprint order.
fn token_budgets(clients: &HashMap<StreamKey, UpstreamClient>) -> Vec<(String, Arc<RateBudget>)> {
    let mut budgets: Vec<(String, Arc<RateBudget>)> = Vec::new();
    for client in clients.values() {
        if !budgets.iter().any(|(_, b)| Arc::ptr_eq(b, client.budget())) {
            budgets.push((client.token_id().to_string(), client.budget().clone()));
        }
    }
    budgets.sort_by(|a, b| a.0.cmp(&b.0));
    budgets
}

/// One planner per token budget under `poll.strategy = "adaptive"`.
struct Planners {
    poll: PollConfig,
    /// By budget (the pointer identifies a token's one budget).
    by_budget: HashMap<*const RateBudget, Planner>,
}

impl Planners {
    fn new(poll: &PollConfig) -> Self {
        Self {
            poll: poll.clone(),
            by_budget: HashMap::new(),
        }
    }

    /// Every planner made, one per token.
    fn into_planners(self) -> Vec<Planner> {
        self.by_budget.into_values().collect()
    }

    /// The planner of `client`'s token (None under `uniform`).
    fn for_client(&mut self, client: &UpstreamClient) -> Option<Planner> {
        if self.poll.strategy == Strategy::Uniform {
            return None;
        }
        let budget = client.budget();
        let poll = &self.poll;
        let planner = self
            .by_budget
            .entry(Arc::as_ptr(budget))
            .or_insert_with(|| {
                budget.set_bulk_share(poll.full_sweep_share);
                let settings = PlannerSettings {
                    interval: poll.interval,
                    max_interval: poll.staleness_cap(),
                    poll_lanes: if budget.requests() == 0 {
                        usize::MAX
                    } else {
                        POLL_LANES
                    },
                    full_resync_interval: poll.full_resync_interval,
                    tail_guard: poll.tail_guard,
                };
                Planner::new(settings, budget.clone(), client.token_id().to_string())
            });
        Some(planner.clone())
    }
}

/// Everything a daemon or `run --once` sweeps with.
pub struct Components {
    /// The streams this process owns, in key order.
    pub streams: Vec<StreamKey>,
    /// The state store.
    pub store: Arc<dyn StateStore>,
    /// The sink.
    pub sink: Arc<dyn Sink>,
    /// One runner per stream, in key order.
    pub runners: Vec<StreamRunner>,
    /// Cancelled when the sink can never deliver again (stdout closed): stop.
    pub sink_ended: CancellationToken,
    /// One planner per token (`poll.strategy = "adaptive"`).
    pub planners: Vec<Planner>,
    /// Every token's budget, with the token's fingerprint.
    pub budgets: Vec<(String, Arc<RateBudget>)>,
}

/// The first half of [`Components`]: the owned streams, their clients and
/// the store, opened before the admin API binds (so that a config error or
/// a store another process holds is what a start reports first).
pub struct Opened {
    streams: Vec<StreamKey>,
    clients: HashMap<StreamKey, UpstreamClient>,
    store: Arc<dyn StateStore>,
}

impl Opened {
    /// Finds the owned streams, builds their clients and opens the store.
    pub fn open(config: &Config) -> Result<Self, DaemonError> {
        let streams = owned_streams(config)?;
        if streams.is_empty() {
            warn!("this shard owns none of the configured tenants; nothing to sweep");
        }
        let clients = clients_for(config, &streams)?;
        let store: Arc<dyn StateStore> = Arc::new(SledStore::open_with_cache(
            &config.state.path,
            config.state.cache_bytes(),
        )?);
        Ok(Self {
            streams,
            clients,
            store,
        })
    }

    /// Builds the sink (unless `sink` is given) and one runner per owned
    /// stream, whose events name the schemas of an admin API on
    /// `admin_addr` (the bound address: a configured port 0 never reaches
    /// `dataschema`).
    pub async fn finish(
        self,
        config: &Config,
        admin_addr: SocketAddr,
        sink: Option<Arc<dyn Sink>>,
        progress: Option<Progress>,
    ) -> Result<Components, DaemonError> {
        let Opened {
            streams,
            clients,
            store,
        } = self;
        let sink = match sink {
            Some(sink) => sink,
            None => {
                crate::sinks::metrics::record_sink_up(config.sink.kind().as_str(), false);
                config.sink.build(&streams).await?
            }
        };
        let budgets = token_budgets(&clients);
        crate::telemetry::export_zero_series(
            sink.name(),
            &streams,
            budgets.iter().map(|(id, _)| id.as_str()),
        );
        crate::sinks::metrics::record_sink_up(sink.name(), sink.health().await.is_ok());
        let sink_ended = sink.ended().unwrap_or_default();
        let settings = Arc::new(sweep_settings(config, admin_addr));
        let timing = Timing::from_poll(&config.poll);
        let mut planners = Planners::new(&config.poll);
        let runners = streams
            .iter()
            .filter_map(|key| {
                let client = clients.get(key)?.clone();
                let planner = planners.for_client(&client);
                let sweeper =
                    Sweeper::new(*key, client, store.clone(), sink.clone(), settings.clone());
                let sweeper = match &progress {
                    Some(progress) => sweeper.with_progress(progress.clone()),
                    None => sweeper,
                };
                let runner = StreamRunner::new(sweeper, timing)
                    .with_heartbeat(config.events.heartbeat_interval);
                Some(match planner {
                    Some(planner) => runner.with_planner(planner),
                    None => runner,
                })
            })
            .collect();
        Ok(Components {
            streams,
            store,
            sink,
            runners,
            sink_ended,
            planners: planners.into_planners(),
            budgets,
        })
    }
}

impl Components {
    /// Makes the store durable and flushes the sink; logs what fails.
    pub async fn flush(&self) {
        if let Err(e) = self.store.flush() {
            warn!(error = %e, "state store flush failed");
        }
        if let Err(e) = self.sink.flush().await {
            warn!(sink = self.sink.name(), error = %e, "sink flush failed");
        }
    }
}

/// A daemon built and bound, not yet running.
pub struct Daemon {
    components: Components,
    listener: TcpListener,
    /// `admin.listen` as configured (port 0 stays 0), for error messages.
    admin_listen: SocketAddr,
    admin_addr: SocketAddr,
    admin_token: Option<Secret>,
    metrics: PrometheusHandle,
    /// `poll.shutdown_timeout`: how long the streams may take to stop.
    grace: Duration,
    state_path: PathBuf,
}

impl Daemon {
    /// Builds the daemon `config` asks for: store, clients, sink and stream
    /// runners, and the admin listener bound (see [`Daemon::admin_addr`]).
    pub async fn build(config: &Config) -> Result<Self, DaemonError> {
        Self::assemble(config, None).await
    }

    /// Like [`Daemon::build`], with a ready-made sink instead of `[sink]` (tests).
    pub async fn build_with_sink(
        config: &Config,
        sink: Arc<dyn Sink>,
    ) -> Result<Self, DaemonError> {
        Self::assemble(config, Some(sink)).await
    }

    async fn assemble(config: &Config, sink: Option<Arc<dyn Sink>>) -> Result<Self, DaemonError> {
        let metrics = crate::telemetry::prometheus();
        let opened = Opened::open(config)?;
        // Bound before the runners: the events' `dataschema` names the real port.
        let listen = config.admin.listen;
        let admin_failed = |failure| DaemonError::Admin { listen, failure };
        let listener = TcpListener::bind(listen)
            .await
            .map_err(|e| admin_failed(AdminFailure::Listen(e)))?;
        let admin_addr = listener
            .local_addr()
            .map_err(|e| admin_failed(AdminFailure::LocalAddress(e)))?;
        let components = opened.finish(config, admin_addr, sink, None).await?;
        Ok(Self {
            components,
            listener,
            admin_listen: listen,
            admin_addr,
            admin_token: config.admin.token.clone(),
            metrics,
            grace: config.poll.shutdown_timeout,
            state_path: config.state.path.clone(),
        })
    }

    /// The address the admin API listens on (the real port when configured with port 0).
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// `http://ADDR` of the admin API, reachable from this machine.
    pub fn admin_url(&self) -> String {
        admin_url(self.admin_addr)
    }

    /// The streams this daemon sweeps.
    pub fn streams(&self) -> &[StreamKey] {
        &self.components.streams
    }

    /// Runs the streams, the admin API and the gauge refresher until
    /// `shutdown` completes (or the sink ends, or the admin API fails), then
    /// tears everything down in order.
    pub async fn run_until_stopped(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), DaemonError> {
        let Daemon {
            mut components,
            listener,
            admin_listen,
            admin_addr,
            admin_token,
            metrics,
            grace,
            state_path,
        } = self;
        let runners = std::mem::take(&mut components.runners);
        let scheduler = Scheduler::start(runners, CancellationToken::new());
        let admin_state = Arc::new(AdminState {
            streams: components.streams.clone(),
            store: components.store.clone(),
            sink: components.sink.clone(),
            handles: scheduler.handles(),
            token: admin_token,
            metrics: metrics.clone(),
            planners: components.planners.clone(),
            budgets: components.budgets.clone(),
        });
        let admin_stop = CancellationToken::new();
        let admin_task = tokio::spawn(
            admin::serve(listener, admin_state, admin_stop.clone())
                .instrument(tracing::info_span!("admin")),
        );
        let gauges = tokio::spawn(refresh_gauges_every(
            GAUGE_REFRESH,
            components.store.clone(),
            components.streams.clone(),
            components.budgets.clone(),
            metrics,
        ));
        info!(admin = %admin_addr, streams = components.streams.len(),
            sink = components.sink.name(), state = %state_path.display(), "daemon started");

        let mut running = Running {
            components,
            scheduler,
            admin_task,
            admin_stop,
            gauges,
        };
        let sink_ended = running.components.sink_ended.clone();
        let result = tokio::select! {
            _ = shutdown => {
                info!("shutdown requested");
                Ok(())
            }
            _ = sink_ended.cancelled() => {
                info!(sink = running.components.sink.name(),
                    "the sink's reader went away (standard output closed); stopping");
                Ok(())
            }
            served = &mut running.admin_task => {
                let failure = AdminFailure::from_served(served);
                warn!(error = %failure, "admin api failed; shutting down");
                Err(DaemonError::Admin { listen: admin_listen, failure })
            }
        };
        let report = running.tear_down(grace).await;
        info!(
            finished = report.finished,
            aborted = report.aborted,
            "daemon stopped"
        );
        result
    }

    /// Runs the daemon on a task until `shutdown` completes or
    /// [`DaemonHandle::shutdown`] is called.
    pub fn spawn(self, shutdown: impl Future<Output = ()> + Send + 'static) -> DaemonHandle {
        let stop = CancellationToken::new();
        let stop_requested = stop.clone();
        let admin_addr = self.admin_addr;
        let streams = self.streams().to_vec();
        let task = tokio::spawn(self.run_until_stopped(async move {
            tokio::select! {
                _ = shutdown => {}
                _ = stop_requested.cancelled() => {}
            }
        }));
        DaemonHandle {
            admin_addr,
            streams,
            stop,
            task,
        }
    }
}

/// `http://ADDR` of an admin API listening on `addr`, reachable from this machine.
fn admin_url(addr: SocketAddr) -> String {
    format!("http://{}", admin::connect_address(addr))
}

/// What a running daemon consists of, for its teardown.
struct Running {
    components: Components,
    scheduler: Scheduler,
    admin_task: JoinHandle<std::io::Result<()>>,
    admin_stop: CancellationToken,
    gauges: JoinHandle<()>,
}

impl Running {
    /// Stops the streams (pages in flight finish within `grace`), the gauge
    /// refresher, flushes the store and the sink, then closes the admin API.
    async fn tear_down(mut self, grace: Duration) -> StopReport {
        info!(grace = %crate::telemetry::human_duration(grace),
            "stopping streams: pages in flight finish, nothing new is requested");
        let report = self.scheduler.stop(grace).await;
        self.gauges.abort();
        let _ = self.gauges.await;
        self.components.flush().await;
        self.admin_stop.cancel();
        if !self.admin_task.is_finished() {
            let abort = self.admin_task.abort_handle();
            if tokio::time::timeout(ADMIN_STOP_TIMEOUT, &mut self.admin_task)
                .await
                .is_err()
            {
                abort.abort();
                let _ = self.admin_task.await;
            }
        }
        report
    }
}

/// A daemon running on a task (see [`Daemon::spawn`]).
pub struct DaemonHandle {
    admin_addr: SocketAddr,
    streams: Vec<StreamKey>,
    stop: CancellationToken,
    task: JoinHandle<Result<(), DaemonError>>,
}

impl DaemonHandle {
    /// The address the admin API listens on (the real port when configured with port 0).
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// `http://ADDR` of the admin API, reachable from this machine.
    pub fn admin_url(&self) -> String {
        admin_url(self.admin_addr)
    }

    /// The streams this daemon sweeps.
    pub fn streams(&self) -> &[StreamKey] {
        &self.streams
    }

    /// Asks the daemon to stop (as SIGTERM would); [`DaemonHandle::wait`] for it.
    pub fn shutdown(&self) {
        self.stop.cancel();
    }

    /// Waits until the daemon stopped: streams done, store and sink flushed, admin closed.
    pub async fn wait(self) -> Result<(), DaemonError> {
        self.task.await?
    }

    /// Stops the daemon and waits for it.
    pub async fn stop(self) -> Result<(), DaemonError> {
        self.shutdown();
        self.wait().await
    }
}

/// Refreshes every stream's gauges (and the recorder's upkeep) every `period`.
async fn refresh_gauges_every(
    period: Duration,
    store: Arc<dyn StateStore>,
    streams: Vec<StreamKey>,
    budgets: Vec<(String, Arc<RateBudget>)>,
    metrics: PrometheusHandle,
) {
    let mut ticker = tokio::time::interval(period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        crate::telemetry::refresh_stream_gauges(store.as_ref(), &streams);
        for (token_id, budget) in &budgets {
            crate::planner::record_budget_gauges(budget, token_id);
        }
        metrics.run_upkeep();
    }
}

/// `run --once`: sweeps every owned stream once, concurrently (full where due
/// or never synced), and returns each stream's outcome in key order.
/// `shutdown` interrupts the sweeps after their pages in flight.
pub async fn run_once(
    config: &Config,
    progress: Option<Progress>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<Vec<(StreamKey, StepOutcome)>, DaemonError> {
    crate::telemetry::prometheus();
    // No admin API runs: `dataschema` names the one the daemon would serve.
    let components = Opened::open(config)?
        .finish(config, config.admin.listen, None, progress)
        .await?;
    let cancel = CancellationToken::new();
    let mut tasks = JoinSet::new();
    for runner in &components.runners {
        let runner = runner.clone();
        let token = cancel.clone();
        let key = runner.key();
        let span = tracing::info_span!("stream", tenant = key.tenant, resource = %key.resource);
        tasks.spawn(async move { (key, runner.run_once(token).await) }.instrument(span));
    }
    let mut outcomes = Vec::with_capacity(components.runners.len());
    tokio::pin!(shutdown);
    let mut interrupted = false;
    let sink_ended = components.sink_ended.clone();
    loop {
        tokio::select! {
            _ = &mut shutdown, if !interrupted => {
                info!("shutdown requested: sweeps stop after their pages in flight");
                interrupted = true;
                cancel.cancel();
            }
            _ = sink_ended.cancelled(), if !interrupted => {
                info!("the sink's reader went away (standard output closed); stopping");
                interrupted = true;
                cancel.cancel();
            }
            next = tasks.join_next() => match next {
                None => break,
                Some(Ok(outcome)) => outcomes.push(outcome),
                Some(Err(e)) => warn!(error = %e, "stream task failed"),
            }
        }
    }
    components.flush().await;
    outcomes.sort_by_key(|(key, _)| *key);
    Ok(outcomes)
}
