//! Keeps every stream sweeping: one task per stream, incremental sweeps at
//! most every `poll.interval` (on the stream's own jittered timer under
//! `poll.strategy = "uniform"`, or when the token's planner gives the stream
//! its turn under `"adaptive"`, see `crate::planner`), a full sweep when the
//! last one is older than `poll.full_resync_interval`, parking on 401/403/404
//! with a slower re-check, operator requests (replay, pause and resume, sweep
//! now, cancel a replay) that the stream's task applies as the stream's only
//! writer, and a bounded graceful stop. A paused stream is not swept at all:
//! it costs no upstream request until it is resumed.
//!
//! The loop (`StreamRunner::run`) is separated from its single step
//! ([`StreamRunner::run_once`]) so tests and `run --once` drive the step
//! directly; the timing decisions ([`due_kind`], [`next_delay`]) are pure.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::FutureExt;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn, Instrument};

use crate::config::PollConfig;
use crate::event::{heartbeat_event, StreamPulse};
use crate::planner::{Grant, Need, Planner, SweepFacts};
use crate::state::{ReplayState, RequestedBy, StateError, StreamState};
use crate::stream::StreamKey;
use crate::sweep::{SweepError, SweepKind, SweepReport, Sweeper};
use crate::telemetry;

/// Operator requests a stream task queues before callers wait.
const REQUEST_QUEUE: usize = 8;

/// When streams sweep, derived from `[poll]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Period of incremental sweeps.
    pub interval: Duration,
    /// Age of the last full sweep after which the next sweep is full.
    pub full_resync_interval: Duration,
    /// Period of re-checks of a parked stream.
    pub park_recheck_interval: Duration,
    /// Random spread of every wait, as a fraction of it.
    pub jitter: f64,
}

impl Timing {
    /// The timing `[poll]` asks for.
    pub fn from_poll(poll: &PollConfig) -> Self {
        Self {
            interval: poll.interval,
            full_resync_interval: poll.full_resync_interval,
            park_recheck_interval: poll.park_recheck_interval,
            jitter: poll.jitter,
        }
    }
}

/// Why a step failed, with its typed cause.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// The sweep failed (upstream, store, sink; see [`SweepError`]).
    #[error(transparent)]
    Sweep(#[from] SweepError),
    /// The stream's state could not be read before the sweep.
    #[error(transparent)]
    State(#[from] StateError),
    /// The sweep panicked (a bug); nothing of the page in flight was committed.
    #[error("sweep panicked: {0}")]
    Panicked(String),
}

/// What one step of a stream did.
#[derive(Debug, Clone)]
pub enum StepOutcome {
    /// The sweep completed.
    Swept(SweepReport),
    /// The upstream refused access (401/403/404); the stream is parked for this cause.
    Parked(Arc<SweepError>),
    /// The sweep failed for another reason; the next sweep tries again.
    Failed(Arc<StepError>),
    /// The sweep stopped early because it was cancelled (shutdown or an operator request).
    Interrupted,
    /// An operator paused the stream: nothing was swept.
    Paused,
}

impl StepOutcome {
    /// True when the sweep completed.
    pub fn is_ok(&self) -> bool {
        matches!(self, StepOutcome::Swept(_))
    }

    /// The failure as one line, None for a completed sweep.
    pub fn error(&self) -> Option<String> {
        match self {
            StepOutcome::Swept(_) => None,
            StepOutcome::Parked(reason) => Some(format!("parked: {reason}")),
            StepOutcome::Failed(error) => Some(error.to_string()),
            StepOutcome::Interrupted => Some("sweep interrupted by shutdown".to_string()),
            StepOutcome::Paused => Some("paused by an operator".to_string()),
        }
    }
}

/// Which sweep is due: full when the last full sweep finished longer than
/// `full_resync_interval` ago or never, incremental otherwise, and
/// incremental while a failed full sweep waits for its retry time (so a
/// failing full listing does not spend the budget on every poll). (A stream
/// that never synced or has a replay pending gets its snapshot sweep whatever
/// kind is asked; the sweep itself decides that.)
pub fn due_kind(
    state: &StreamState,
    now: DateTime<Utc>,
    full_resync_interval: Duration,
) -> SweepKind {
    if state.full_sweep_retry_at.is_some_and(|at| now < at) {
        return SweepKind::Incremental;
    }
    let Some(finished) = state.last_full_sweep_finished else {
        return SweepKind::Full;
    };
    let age = (now - finished).to_std().unwrap_or(Duration::ZERO);
    if age >= full_resync_interval {
        SweepKind::Full
    } else {
        SweepKind::Incremental
    }
}

/// The wait after the `failures`-th failed sweep in a row: the poll interval
/// doubled per failure, capped at `park_recheck_interval` (never below the
/// interval), spread by the jitter. A stream whose sweeps keep failing then
/// does not spend the shared budget on every interval.
pub fn failure_delay(failures: u32, timing: &Timing, unit: f64) -> Duration {
    let cap = timing.park_recheck_interval.max(timing.interval);
    let doublings = failures.saturating_sub(1).min(20);
    let base = timing.interval.saturating_mul(1 << doublings).min(cap);
    jittered(base, timing, unit)
}

/// The wait before a stream's next step. `unit` is a random number in
/// `[0, 1)` spreading the wait by `timing.jitter` either way. (The run loop
/// waits [`failure_delay`] instead after failed sweeps.)
pub fn next_delay(outcome: &StepOutcome, timing: &Timing, unit: f64) -> Duration {
    match outcome {
        StepOutcome::Swept(_) | StepOutcome::Failed(_) => jittered(timing.interval, timing, unit),
        StepOutcome::Parked(_) => jittered(timing.park_recheck_interval, timing, unit),
        StepOutcome::Interrupted => Duration::ZERO,
        // Not swept again until resumed; the run loop does not wait on a timer then.
        StepOutcome::Paused => jittered(timing.interval, timing, unit),
    }
}

fn jittered(base: Duration, timing: &Timing, unit: f64) -> Duration {
    let factor = 1.0 + timing.jitter.clamp(0.0, 1.0) * (2.0 * unit.clamp(0.0, 1.0) - 1.0);
    base.mul_f64(factor.max(0.0))
}

/// Why an operator request to a stream was not carried out.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The stream's task is gone (the daemon is stopping).
    #[error("stream {0} is not running (the daemon is shutting down)")]
    Stopped(StreamKey),
    /// The request does not fit the stream's state (one line saying why).
    #[error("{0}")]
    Refused(String),
    /// The state store failed.
    #[error("{0}")]
    State(#[from] StateError),
}

/// What an operator asks of a running stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Schedule a replay (`since`: only records updated since then).
    Replay {
        /// The replay's `--since`.
        since: Option<DateTime<Utc>>,
        /// Who asked.
        by: RequestedBy,
    },
    /// Cancel the pending replay with this id.
    CancelReplay {
        /// The replay id.
        id: String,
    },
    /// Stop sweeping until resumed (persisted).
    Pause {
        /// Who asked.
        by: RequestedBy,
    },
    /// Sweep again, from the watermark.
    Resume,
    /// Sweep now instead of at the next interval (`kind` None: whichever is
    /// due); with `only_parked`, only a parked stream (a recheck).
    SweepNow {
        /// The sweep to run; None: whichever is due.
        kind: Option<SweepKind>,
        /// Refuse unless the stream is parked.
        only_parked: bool,
    },
}

impl Action {
    /// True when a sweep in flight stops after its page for this action to
    /// apply (a replay, a pause or a cancel must not wait for a long sweep).
    fn interrupts(&self) -> bool {
        matches!(
            self,
            Action::Replay { .. } | Action::CancelReplay { .. } | Action::Pause { .. }
        )
    }
}

/// What a stream task answers to an [`Action`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The id of the replay scheduled.
    Replay(String),
    /// The replay cancelled, as it stood before the cancel.
    Cancelled(Box<ReplayState>),
    /// Pause or resume: true when the stream's state changed (false: it was so already).
    Changed(bool),
    /// The stream was woken to sweep now.
    Woken,
}

/// A request sent to a stream's task.
#[derive(Debug)]
struct Request {
    action: Action,
    reply: oneshot::Sender<Result<Answer, RequestError>>,
}

/// Talks to one running stream task; cheap to clone.
#[derive(Debug, Clone)]
pub struct StreamHandle {
    key: StreamKey,
    requests: mpsc::Sender<Request>,
}

impl StreamHandle {
    /// The stream this handle controls.
    pub fn key(&self) -> StreamKey {
        self.key
    }

    /// Has the stream's task carry out `action` between two pages (it is the
    /// stream's only writer) and returns its answer.
    ///
    /// A replay, a pause or a cancel stops a sweep in flight after its
    /// current page (acknowledged and committed), so it applies within one page.
    pub async fn request(&self, action: Action) -> Result<Answer, RequestError> {
        let (reply, answer) = oneshot::channel();
        self.requests
            .send(Request { action, reply })
            .await
            .map_err(|_| RequestError::Stopped(self.key))?;
        answer.await.map_err(|_| RequestError::Stopped(self.key))?
    }
}

/// When a stream task sweeps next: the floor of its next turn, and a sweep
/// kind an operator asked for.
#[derive(Debug, Clone, Copy)]
struct Pace {
    ready_at: tokio::time::Instant,
    forced: Option<SweepKind>,
}

impl Pace {
    /// Sweep now; a full sweep asked for wins over an incremental one.
    fn wake(&mut self, kind: Option<SweepKind>) {
        self.ready_at = tokio::time::Instant::now();
        self.forced = match (self.forced, kind) {
            (Some(SweepKind::Full), _) | (_, Some(SweepKind::Full)) => Some(SweepKind::Full),
            (forced, kind) => kind.or(forced),
        };
    }
}

/// One stream's sweeps: the single step and the loop around it.
#[derive(Clone)]
pub struct StreamRunner {
    sweeper: Sweeper,
    timing: Timing,
    /// The token's planner (`poll.strategy = "adaptive"`); None: the stream's own timer.
    planner: Option<Planner>,
    /// `events.heartbeat_interval`: a `stream.heartbeat` after this long without an event.
    heartbeat: Option<Duration>,
}

impl StreamRunner {
    /// A runner sweeping with `sweeper` on its own timer (`poll.strategy = "uniform"`).
    pub fn new(sweeper: Sweeper, timing: Timing) -> Self {
        Self {
            sweeper,
            timing,
            planner: None,
            heartbeat: None,
        }
    }

    /// Publishes a `stream.heartbeat` whenever the stream produced no event
    /// for `interval` (None: never).
    pub fn with_heartbeat(mut self, interval: Option<Duration>) -> Self {
        self.heartbeat = interval;
        self
    }

    /// Takes turns from the token's `planner` instead of its own timer.
    pub fn with_planner(mut self, planner: Planner) -> Self {
        self.planner = Some(planner);
        self
    }

    /// The stream this runner sweeps.
    pub fn key(&self) -> StreamKey {
        self.sweeper.stream()
    }

    /// The sweeper the runner uses (tests inspect its store and sink).
    pub fn sweeper(&self) -> &Sweeper {
        &self.sweeper
    }

    /// One step: sweeps once (full when due), parks the stream on 401/403/404,
    /// and refreshes the stream's gauges. `cancel` stops the sweep after the
    /// page in flight.
    ///
    /// A panic in the sweep (a bug) fails this step like any other failed
    /// sweep: it is logged, counted, and recorded as the stream's last error;
    /// nothing of the page in flight was committed.
    pub async fn run_once(&self, cancel: CancellationToken) -> StepOutcome {
        self.run_step(None, cancel).await
    }

    /// One step as [`StreamRunner::run_once`], sweeping as `kind` says (None: whichever is due).
    async fn run_step(&self, kind: Option<SweepKind>, cancel: CancellationToken) -> StepOutcome {
        let outcome = match AssertUnwindSafe(self.step(kind, cancel))
            .catch_unwind()
            .await
        {
            Ok(outcome) => outcome,
            Err(panic) => {
                let key = self.key();
                let error = StepError::Panicked(panic_reason(panic.as_ref()));
                let reason = error.to_string();
                error!(tenant = key.tenant, resource = %key.resource, error = %reason,
                    "sweep panicked; the stream goes on at the next interval");
                metrics::counter!(telemetry::metric::SWEEPS, "tenant" => key.tenant.to_string(),
                    "resource" => key.resource.as_str(), "kind" => "unknown", "outcome" => "panic")
                .increment(1);
                if let Err(e) = self.sweeper.ledger().record_error(&reason, Utc::now()) {
                    warn!(tenant = key.tenant, resource = %key.resource, error = %e, "cannot save the stream's last error");
                }
                StepOutcome::Failed(Arc::new(error))
            }
        };
        self.refresh_gauges();
        outcome
    }

    async fn step(&self, kind: Option<SweepKind>, cancel: CancellationToken) -> StepOutcome {
        let key = self.key();
        let ledger = self.sweeper.ledger();
        let state = match ledger.state() {
            Ok(state) => state,
            Err(e) => {
                warn!(tenant = key.tenant, resource = %key.resource, error = %e, "cannot read the stream state");
                return StepOutcome::Failed(Arc::new(e.into()));
            }
        };
        if state.paused.is_some() {
            return StepOutcome::Paused;
        }
        let was_parked = state.parked.is_some();
        let kind =
            kind.unwrap_or_else(|| due_kind(&state, Utc::now(), self.timing.full_resync_interval));
        let outcome = match self.sweeper.run(kind, &cancel).await {
            Ok(report) => {
                if was_parked {
                    info!(tenant = key.tenant, resource = %key.resource, "stream unparked: the upstream answers again");
                }
                StepOutcome::Swept(report)
            }
            Err(SweepError::Interrupted) => StepOutcome::Interrupted,
            Err(e) if e.is_parking() => {
                let reason = e.to_string();
                if let Err(e) = ledger.park(&reason) {
                    warn!(tenant = key.tenant, resource = %key.resource, error = %e, "cannot save the parked state");
                }
                warn!(tenant = key.tenant, resource = %key.resource, error = %reason,
                    recheck_in = %telemetry::human_duration(self.timing.park_recheck_interval),
                    "stream parked; the other streams go on (a running daemon rechecks it after \
                     recheck_in; `run --once` does not recheck and exits 1)");
                StepOutcome::Parked(Arc::new(e))
            }
            Err(e) => StepOutcome::Failed(Arc::new(e.into())),
        };
        outcome
    }

    /// Sets the stream's gauges from its stored state.
    pub fn refresh_gauges(&self) {
        telemetry::refresh_stream_gauges(self.sweeper.store().as_ref(), &[self.key()]);
    }

    /// True while an operator paused the stream (a store error reads as
    /// not paused: the step then reports it).
    fn is_paused(&self) -> bool {
        self.sweeper
            .ledger()
            .state()
            .is_ok_and(|state| state.paused.is_some())
    }

    /// Carries out an operator request between two sweeps (the task is the
    /// stream's only writer), answers it, and wakes the stream when it asks for a sweep.
    async fn apply(&self, request: Request, pace: &mut Pace) {
        let key = self.key();
        let (result, wake) = self.act(request.action).await;
        if let Err(e) = &result {
            warn!(tenant = key.tenant, resource = %key.resource, error = %e, "operator request not carried out");
        }
        if let Some(kind) = wake {
            pace.wake(kind);
        }
        // The requester may have gone away; the action is applied either way.
        let _ = request.reply.send(result);
        self.refresh_gauges();
    }

    /// The effect of `action`, and the sweep it wakes the stream for (None: no wake).
    async fn act(
        &self,
        action: Action,
    ) -> (Result<Answer, RequestError>, Option<Option<SweepKind>>) {
        let key = self.key();
        let ledger = self.sweeper.ledger();
        let now = Utc::now();
        match action {
            Action::Replay { since, by } => match ledger.schedule_replay(since, by, now) {
                Ok(id) => (Ok(Answer::Replay(id)), Some(None)),
                Err(e) => (Err(e.into()), None),
            },
            Action::Pause { by } => (
                ledger
                    .pause(by, now)
                    .map(Answer::Changed)
                    .map_err(Into::into),
                None,
            ),
            Action::Resume => match ledger.resume() {
                Ok(changed) => (Ok(Answer::Changed(changed)), changed.then_some(None)),
                Err(e) => (Err(e.into()), None),
            },
            Action::SweepNow { kind, only_parked } => {
                let state = match ledger.state() {
                    Ok(state) => state,
                    Err(e) => return (Err(e.into()), None),
                };
                if state.paused.is_some() {
                    let refusal = format!("stream {key} is paused: resume it first");
                    return (Err(RequestError::Refused(refusal)), None);
                }
                if only_parked && state.parked.is_none() {
                    let refusal = format!(
                        "stream {key} is not parked: nothing to recheck (sweep it instead)"
                    );
                    return (Err(RequestError::Refused(refusal)), None);
                }
                (Ok(Answer::Woken), Some(kind))
            }
            Action::CancelReplay { id } => match ledger.cancel_replay(&id, now) {
                Ok(Some(replay)) => {
                    if replay.epoch.is_some() {
                        // Its first sweep began and published `replay.started`: close it.
                        if let Err(e) = self.sweeper.publish_replay_cancelled(&replay).await {
                            warn!(tenant = key.tenant, resource = %key.resource, replay_id = %id, error = %e,
                                "cannot publish replay.cancelled; the replay is cancelled all the same");
                        }
                    }
                    (Ok(Answer::Cancelled(Box::new(replay))), None)
                }
                Ok(None) => {
                    let refusal = format!("replay {id} is not pending on stream {key}");
                    (Err(RequestError::Refused(refusal)), None)
                }
                Err(e) => (Err(e.into()), None),
            },
        }
    }

    /// Waits for the floor `pace.ready_at`, then for the planner's turn when there is one.
    async fn next_turn(&self, pace: Pace) -> Turn {
        let ready_at = pace.ready_at;
        let Some(planner) = &self.planner else {
            tokio::time::sleep_until(ready_at).await;
            return Turn::due();
        };
        let need = match self.sweeper.ledger().state() {
            Ok(state)
                if state.watermark.is_none()
                    || state.replay.as_ref().is_some_and(|r| r.pending) =>
            {
                Need::Snapshot
            }
            Ok(state) => Need::Poll {
                full_due: pace.forced == Some(SweepKind::Full)
                    || due_kind(&state, Utc::now(), self.timing.full_resync_interval)
                        == SweepKind::Full,
            },
            // The step reports the store's error; the planner needs no precision here.
            Err(_) => Need::Poll { full_due: false },
        };
        let grant = planner.turn(self.key(), need, ready_at).await;
        Turn {
            kind: Some(match grant {
                Grant::Full => SweepKind::Full,
                Grant::Poll => SweepKind::Incremental,
            }),
            grant: Some(grant),
            started: tokio::time::Instant::now(),
        }
    }

    /// Publishes the stream's `stream.heartbeat` (its watermark, last sweep
    /// and `last_event`) and waits for the ack, at most the publish timeout.
    /// Returns whether the sink acknowledged it; a failure is logged and the
    /// next heartbeat comes an interval later (no retry storm).
    pub async fn publish_heartbeat(&self, last_event: Option<DateTime<Utc>>) -> bool {
        let key = self.key();
        let state = self.sweeper.ledger().state().unwrap_or_else(|e| {
            warn!(tenant = key.tenant, resource = %key.resource, error = %e,
                "cannot read the stream state; the heartbeat reports no watermark");
            StreamState::default()
        });
        let pulse = StreamPulse {
            watermark: state.watermark,
            last_sweep: state.last_sweep_finished,
            last_event,
        };
        let settings = self.sweeper.settings();
        let event = heartbeat_event(key, pulse, Utc::now(), &settings.schema_base);
        let published = tokio::time::timeout(
            settings.publish_timeout,
            self.sweeper.sink().publish(std::slice::from_ref(&event)),
        )
        .await;
        let failure = match published {
            Ok(acks) => match acks.into_iter().next() {
                Some(Ok(())) => None,
                Some(Err(e)) => Some(e.to_string()),
                None => Some("the sink returned no ack".to_string()),
            },
            Err(_) => Some(format!(
                "no ack within {}",
                telemetry::human_duration(settings.publish_timeout)
            )),
        };
        match failure {
            None => {
                metrics::counter!(telemetry::metric::EVENTS_PUBLISHED,
                    "tenant" => key.tenant.to_string(), "resource" => key.resource.as_str(),
                    "type" => event.ty.as_str(), "op" => "none")
                .increment(1);
                true
            }
            Some(error) => {
                warn!(tenant = key.tenant, resource = %key.resource, error = %error,
                    "heartbeat not published; the next one is due an interval later");
                false
            }
        }
    }

    /// The stream's loop until `shutdown`: sweep, wait (or wake for an
    /// operator's request, or publish a heartbeat while quiet), repeat; while
    /// paused, only wait for requests (and heartbeats).
    async fn run(self, mut requests: mpsc::Receiver<Request>, shutdown: CancellationToken) {
        let mut pace = Pace {
            ready_at: tokio::time::Instant::now(),
            forced: None,
        };
        let mut failures: u32 = 0;
        // Since when the stream published nothing, and when it last did.
        let mut quiet_since = tokio::time::Instant::now();
        let mut last_event: Option<DateTime<Utc>> = None;
        loop {
            let paused = self.is_paused();
            let heartbeat_due = async {
                match self.heartbeat {
                    Some(interval) => tokio::time::sleep_until(quiet_since + interval).await,
                    None => std::future::pending().await,
                }
            };
            let turn = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return,
                Some(request) = requests.recv() => {
                    self.apply(request, &mut pace).await;
                    while let Ok(request) = requests.try_recv() {
                        self.apply(request, &mut pace).await;
                    }
                    // A wake under the planner asks for its turn at once.
                    continue;
                }
                _ = heartbeat_due => {
                    // The turn is asked for again with the same pace: the
                    // heartbeat does not move it.
                    if self.publish_heartbeat(last_event).await {
                        last_event = Some(Utc::now());
                    }
                    quiet_since = tokio::time::Instant::now();
                    continue;
                }
                turn = self.next_turn(pace), if !paused => turn,
            };
            let kind = pace.forced.take().or(turn.kind);

            let step_cancel = shutdown.child_token();
            // A panic in a sweep (a bug) fails that step only (see `run_once`).
            let step = self.run_step(kind, step_cancel.clone());
            tokio::pin!(step);
            let mut waiting: Vec<Request> = Vec::new();
            let outcome = loop {
                tokio::select! {
                    outcome = &mut step => break outcome,
                    Some(request) = requests.recv() => {
                        if request.action.interrupts() && !step_cancel.is_cancelled() {
                            info!(tenant = self.key().tenant, resource = %self.key().resource,
                                action = ?request.action,
                                "operator request: stopping the current sweep after its page in flight");
                            step_cancel.cancel();
                        }
                        waiting.push(request);
                    }
                }
            };
            if let (Some(planner), Some(grant)) = (&self.planner, turn.grant) {
                planner.finished(self.key(), grant, turn.facts(&outcome));
            }
            if matches!(&outcome, StepOutcome::Swept(report) if report.events() > 0) {
                quiet_since = tokio::time::Instant::now();
                last_event = Some(Utc::now());
            }
            let delay = if let StepOutcome::Failed(error) = &outcome {
                failures = failures.saturating_add(1);
                let delay = failure_delay(failures, &self.timing, rand::random::<f64>());
                warn!(tenant = self.key().tenant, resource = %self.key().resource, error = %error,
                    failures, retry_in = %telemetry::human_duration(delay),
                    "sweep failed; trying again after a backoff");
                delay
            } else {
                if outcome.is_ok() {
                    failures = 0;
                }
                let delay = next_delay(&outcome, &self.timing, rand::random::<f64>());
                if self.planner.is_some() && outcome.is_ok() {
                    // Under the planner `poll.interval` is a floor: never jittered below it.
                    delay.max(self.timing.interval)
                } else {
                    delay
                }
            };
            pace.ready_at = tokio::time::Instant::now() + delay;
            for request in waiting {
                self.apply(request, &mut pace).await;
            }
            if shutdown.is_cancelled() {
                return;
            }
        }
    }
}

/// A stream's turn to sweep.
#[derive(Debug, Clone, Copy)]
struct Turn {
    /// The sweep to run; None: whichever is due.
    kind: Option<SweepKind>,
    /// The planner's grant, when a planner gave the turn.
    grant: Option<Grant>,
    /// When the turn began.
    started: tokio::time::Instant,
}

impl Turn {
    /// A turn of the stream's own timer: whichever sweep is due.
    fn due() -> Self {
        Self {
            kind: None,
            grant: None,
            started: tokio::time::Instant::now(),
        }
    }

    /// What the planner learns from the step's `outcome`.
    fn facts(&self, outcome: &StepOutcome) -> SweepFacts {
        match outcome {
            StepOutcome::Swept(report) => SweepFacts {
                started: self.started,
                completed: true,
                changed: report.announced,
                requests: report.pages,
                history: report.history.evidence(),
            },
            _ => SweepFacts {
                started: self.started,
                completed: false,
                changed: 0,
                requests: 0,
                history: None,
            },
        }
    }
}

/// The message of a caught panic, when it carried one.
fn panic_reason(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string())
}

/// What a stop found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StopReport {
    /// Stream tasks that finished within the bound.
    pub finished: usize,
    /// Stream tasks aborted after the bound.
    pub aborted: usize,
}

/// The running stream tasks.
pub struct Scheduler {
    tasks: Vec<(StreamKey, JoinHandle<()>)>,
    handles: HashMap<StreamKey, StreamHandle>,
    shutdown: CancellationToken,
}

impl Scheduler {
    /// Spawns one task per runner, each in a `stream` span carrying its tenant and resource.
    pub fn start(runners: Vec<StreamRunner>, shutdown: CancellationToken) -> Self {
        let mut tasks = Vec::with_capacity(runners.len());
        let mut handles = HashMap::with_capacity(runners.len());
        for runner in runners {
            let key = runner.key();
            let (tx, rx) = mpsc::channel(REQUEST_QUEUE);
            handles.insert(key, StreamHandle { key, requests: tx });
            let span = tracing::info_span!("stream", tenant = key.tenant, resource = %key.resource);
            let task = tokio::spawn(runner.run(rx, shutdown.clone()).instrument(span));
            tasks.push((key, task));
        }
        Self {
            tasks,
            handles,
            shutdown,
        }
    }

    /// A handle per running stream.
    pub fn handles(&self) -> HashMap<StreamKey, StreamHandle> {
        self.handles.clone()
    }

    /// Cancels every stream (no new page; the page in flight is acknowledged
    /// and committed), waits up to `grace` for the tasks, then aborts the rest.
    ///
    /// Aborting loses nothing: an unfinished page was never committed, so the
    /// next run lists it again.
    pub async fn stop(self, grace: Duration) -> StopReport {
        self.shutdown.cancel();
        drop(self.handles);
        let deadline = tokio::time::Instant::now() + grace;
        let mut report = StopReport::default();
        for (key, mut task) in self.tasks {
            match tokio::time::timeout_at(deadline, &mut task).await {
                Ok(Ok(())) => report.finished += 1,
                Ok(Err(e)) => {
                    warn!(tenant = key.tenant, resource = %key.resource, error = %e, "stream task ended abnormally");
                    report.finished += 1;
                }
                Err(_) => {
                    warn!(tenant = key.tenant, resource = %key.resource,
                        grace = %telemetry::human_duration(grace),
                        "stream did not stop in time; aborting it (its uncommitted page is listed again next run)");
                    task.abort();
                    let _ = task.await;
                    report.aborted += 1;
                }
            }
        }
        report
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn forbidden() -> SweepError {
        SweepError::Upstream(crate::upstream::error::UpstreamError::Forbidden {
            path: "/tenants/1/catalog/vouchers".into(),
            message: "no".into(),
        })
    }

    fn timing() -> Timing {
        Timing {
            interval: Duration::from_secs(30),
            full_resync_interval: Duration::from_secs(3600),
            park_recheck_interval: Duration::from_secs(300),
            jitter: 0.1,
        }
    }

    fn at(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000 + secs, 0).unwrap()
    }

    #[test]
    fn a_stream_without_a_finished_full_sweep_gets_a_full_sweep() {
        let state = StreamState::default();
        assert_eq!(
            due_kind(&state, at(0), Duration::from_secs(3600)),
            SweepKind::Full
        );
    }

    #[test]
    fn a_full_sweep_is_due_once_the_last_one_is_older_than_the_resync_interval() {
        let state = StreamState {
            last_full_sweep_finished: Some(at(0)),
            ..StreamState::default()
        };
        let hour = Duration::from_secs(3600);
        assert_eq!(due_kind(&state, at(3599), hour), SweepKind::Incremental);
        assert_eq!(due_kind(&state, at(3600), hour), SweepKind::Full);
        // A clock that went backwards does not force a full sweep.
        assert_eq!(due_kind(&state, at(-10), hour), SweepKind::Incremental);
    }

    #[test]
    fn a_failed_full_sweep_waits_for_its_retry_time_while_incremental_sweeps_go_on() {
        let state = StreamState {
            last_full_sweep_finished: Some(at(0)),
            full_sweep_failures: 2,
            full_sweep_retry_at: Some(at(5000)),
            ..StreamState::default()
        };
        let hour = Duration::from_secs(3600);
        assert_eq!(due_kind(&state, at(4999), hour), SweepKind::Incremental);
        assert_eq!(due_kind(&state, at(5000), hour), SweepKind::Full);
        let never_full = StreamState {
            full_sweep_retry_at: Some(at(60)),
            ..StreamState::default()
        };
        assert_eq!(due_kind(&never_full, at(0), hour), SweepKind::Incremental);
        assert_eq!(due_kind(&never_full, at(60), hour), SweepKind::Full);
    }

    #[test]
    fn waits_are_spread_by_the_jitter_either_way() {
        let t = timing();
        let ok = StepOutcome::Swept(SweepReport::default());
        assert_eq!(next_delay(&ok, &t, 0.0), Duration::from_secs(27));
        assert_eq!(next_delay(&ok, &t, 0.5), Duration::from_secs(30));
        let top = next_delay(&ok, &t, 0.999_999);
        assert!(top > Duration::from_millis(32_999) && top <= Duration::from_secs(33));
    }

    #[test]
    fn a_parked_stream_waits_the_recheck_interval_and_a_failed_one_the_poll_interval() {
        let t = Timing {
            jitter: 0.0,
            ..timing()
        };
        assert_eq!(
            next_delay(&StepOutcome::Parked(Arc::new(forbidden())), &t, 0.3),
            Duration::from_secs(300)
        );
        assert_eq!(
            next_delay(
                &StepOutcome::Failed(Arc::new(StepError::Panicked("503".into()))),
                &t,
                0.3
            ),
            Duration::from_secs(30)
        );
        assert_eq!(
            next_delay(&StepOutcome::Interrupted, &t, 0.3),
            Duration::ZERO
        );
    }

    #[test]
    fn a_stream_whose_sweeps_keep_failing_backs_off_exponentially_up_to_the_recheck_interval() {
        let t = Timing {
            jitter: 0.0,
            ..timing()
        };
        assert_eq!(failure_delay(1, &t, 0.3), Duration::from_secs(30));
        assert_eq!(failure_delay(2, &t, 0.3), Duration::from_secs(60));
        assert_eq!(failure_delay(3, &t, 0.3), Duration::from_secs(120));
        assert_eq!(failure_delay(4, &t, 0.3), Duration::from_secs(240));
        assert_eq!(failure_delay(5, &t, 0.3), Duration::from_secs(300));
        assert_eq!(failure_delay(u32::MAX, &t, 0.3), Duration::from_secs(300));
    }

    #[test]
    fn a_wake_is_due_now_and_a_full_sweep_asked_for_wins_over_an_incremental_one() {
        let later = tokio::time::Instant::now() + Duration::from_secs(60);
        let mut pace = Pace {
            ready_at: later,
            forced: None,
        };
        pace.wake(None);
        assert!(pace.ready_at < later);
        assert_eq!(pace.forced, None, "whichever is due");
        pace.wake(Some(SweepKind::Incremental));
        assert_eq!(pace.forced, Some(SweepKind::Incremental));
        pace.wake(Some(SweepKind::Full));
        pace.wake(Some(SweepKind::Incremental));
        pace.wake(None);
        assert_eq!(pace.forced, Some(SweepKind::Full));
    }

    #[test]
    fn only_a_completed_sweep_counts_as_ok() {
        assert!(StepOutcome::Swept(SweepReport::default()).is_ok());
        assert_eq!(
            StepOutcome::Parked(Arc::new(forbidden())).error(),
            Some("parked: upstream returned 403 for /tenants/1/catalog/vouchers: no".to_string())
        );
        assert!(!StepOutcome::Interrupted.is_ok());
    }
}
