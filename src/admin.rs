//! The admin HTTP API of a running daemon: liveness and readiness probes,
//! Prometheus metrics, per-stream status, and the operator's steering (replay
//! and cancel, pause and resume, sweep now and recheck), so operators and the
//! CLI can work while the daemon holds the state store. The handlers only
//! translate HTTP to the use cases of `crate::control` and back; the routes
//! are described by `schemas/admin-openapi.json`, served at `/v1/openapi.json`.
//!
//! Every `/v1` endpoint requires `Authorization: Bearer <admin.token>` when a
//! token is configured; errors are JSON `{"message": ...}` (422 adds
//! `errors: {field: [..]}`), like the upstream API's MessageError.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use chrono::{DateTime, Utc};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use crate::control::replay::{ReplayResponse, ScheduledReplay};
use crate::control::{self, ControlError, Runtime};
use crate::planner::{BudgetStatus, Planner, StreamPlanStatus};
use crate::scheduler::StreamHandle;
use crate::secret::Secret;
use crate::sinks::Sink;
use crate::state::{Pause, ReplayState, RequestedBy, StateStore, StreamState};
use crate::stream::{Resource, StreamKey, TenantId};
use crate::telemetry::{self, metric};
use crate::upstream::ratelimit::RateBudget;

/// How long `/readyz` waits for the sink's health check.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(3);

/// One stream as `status` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamStatus {
    /// The tenant.
    pub tenant: TenantId,
    /// The resource.
    pub resource: Resource,
    /// Server time of the first page of the last completed sweep.
    pub watermark: Option<DateTime<Utc>>,
    /// Now minus the watermark, in seconds.
    pub lag_seconds: Option<f64>,
    /// Records whose hash the store knows, as of the last finished sweep.
    pub records_known: u64,
    /// Records committed in the store right now: grows page by page during a
    /// sweep (a long first sync shows its progress here).
    #[serde(default)]
    pub records_committed: u64,
    /// When the sweep that is running now started (None between sweeps).
    #[serde(default)]
    pub sweep_in_progress_since: Option<DateTime<Utc>>,
    /// When the last sweep started.
    pub last_sweep_started: Option<DateTime<Utc>>,
    /// When the last successful sweep finished.
    pub last_sweep_finished: Option<DateTime<Utc>>,
    /// Seconds since the last successful sweep.
    pub seconds_since_last_sweep: Option<f64>,
    /// When the last successful full sweep finished.
    pub last_full_sweep_finished: Option<DateTime<Utc>>,
    /// The last error, one line.
    pub last_error: Option<String>,
    /// When the last error happened.
    pub last_error_at: Option<DateTime<Utc>>,
    /// Why the stream is parked, None when it runs.
    pub parked: Option<String>,
    /// Set while an operator paused the stream (since when, by whom).
    #[serde(default)]
    pub paused: Option<Pause>,
    /// The current or last replay.
    pub replay: Option<ReplayState>,
    /// Records committed as dead-lettered (their event went out as a dead
    /// letter), in id order; each leaves the list when a later version of
    /// it is published (a content change or a replay) or it is deleted.
    #[serde(default)]
    pub dead_letters: Vec<DeadLetterStatus>,
    /// What the adaptive planner knows of the stream (`poll.strategy = "adaptive"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planner: Option<StreamPlanStatus>,
    /// How far the stream's periodic full sweep is behind `poll.full_resync_interval`
    /// (the budget did not allow it), in seconds; None when on time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub full_sweep_overdue_seconds: Option<f64>,
}

/// One dead-lettered record as `status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetterStatus {
    /// The record id.
    pub record_id: i64,
    /// Why the sink refused its event.
    pub reason: String,
    /// The broker limit the event exceeded, in bytes, when known.
    pub limit: Option<u64>,
    /// When it was dead-lettered.
    pub since: DateTime<Utc>,
}

impl StreamStatus {
    /// The status of `stream` from its stored state, as of `now`.
    pub fn from_state(stream: StreamKey, state: &StreamState, now: DateTime<Utc>) -> Self {
        Self {
            tenant: stream.tenant,
            resource: stream.resource,
            watermark: state.watermark,
            lag_seconds: state.watermark.map(|w| telemetry::seconds_between(w, now)),
            records_known: state.records_known,
            records_committed: state.records_known,
            sweep_in_progress_since: state.last_sweep_started.filter(|started| {
                state.last_sweep_finished.is_none_or(|f| f < *started)
                    && state.last_error_at.is_none_or(|e| e < *started)
            }),
            last_sweep_started: state.last_sweep_started,
            last_sweep_finished: state.last_sweep_finished,
            seconds_since_last_sweep: state
                .last_sweep_finished
                .map(|f| telemetry::seconds_between(f, now)),
            last_full_sweep_finished: state.last_full_sweep_finished,
            last_error: state.last_error.clone(),
            last_error_at: state.last_error_at,
            parked: state.parked.clone(),
            paused: state.paused,
            replay: state.replay.clone(),
            dead_letters: Vec::new(),
            planner: None,
            full_sweep_overdue_seconds: None,
        }
    }

    /// The stream key.
    pub fn key(&self) -> StreamKey {
        StreamKey::new(self.tenant, self.resource)
    }

    /// True when the stream needs an operator: parked, or its last sweep failed.
    pub fn needs_attention(&self) -> bool {
        self.parked.is_some() || self.last_error.is_some()
    }
}

/// The sink as `status` shows it (only known to a running daemon).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SinkStatus {
    /// The sink's name.
    pub name: String,
    /// True when its health check passes.
    pub healthy: bool,
    /// The health check's error, if any.
    pub error: Option<String>,
}

/// `GET /v1/status` and `status --json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// Every stream of this daemon, in key order.
    pub streams: Vec<StreamStatus>,
    /// The sink, when a running daemon answered.
    pub sink: Option<SinkStatus>,
    /// Each token's budget and planner, when a running daemon answered.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub budgets: Vec<BudgetStatus>,
}

/// Reads the status of `streams` from a store, with the live record count of
/// each (pages commit one by one, so it moves during a sweep).
pub fn status_from_store(
    store: &dyn StateStore,
    streams: &[StreamKey],
    now: DateTime<Utc>,
) -> Result<Vec<StreamStatus>, crate::state::StateError> {
    let mut keys = streams.to_vec();
    keys.sort();
    keys.iter()
        .map(|key| {
            let state = store.load_stream(*key)?;
            let mut status = StreamStatus::from_state(*key, &state, now);
            status.records_committed = store.record_count(*key)?;
            status.dead_letters = store
                .dead_letters(*key)?
                .into_iter()
                .map(|(record_id, letter)| DeadLetterStatus {
                    record_id,
                    reason: letter.reason,
                    limit: letter.limit,
                    since: letter.since,
                })
                .collect();
            Ok(status)
        })
        .collect()
}

/// Parses `--since` / the `since` field: RFC 3339 (`2024-05-01T12:00:00Z`), a
/// date (`2024-05-01`, midnight UTC) or an age (`2h`, `30m`: that long before `now`).
pub fn parse_since(text: &str, now: DateTime<Utc>) -> Result<DateTime<Utc>, String> {
    let text = text.trim();
    let parsed = if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        t.with_timezone(&Utc)
    } else if let Ok(d) = chrono::NaiveDate::parse_from_str(text, "%Y-%m-%d") {
        d.and_time(chrono::NaiveTime::MIN).and_utc()
    } else if let Ok(age) = humantime::parse_duration(text) {
        let age =
            chrono::Duration::from_std(age).map_err(|_| format!("`{text}` is too long ago"))?;
        now.checked_sub_signed(age)
            .ok_or_else(|| format!("`{text}` is too long ago"))?
    } else {
        return Err(format!(
            "`{text}` is not a time: use RFC 3339 (2024-05-01T12:00:00Z), a date (2024-05-01) or an age (2h)"
        ));
    };
    if parsed > now {
        return Err(format!("`{text}` is in the future"));
    }
    Ok(parsed)
}

/// What the admin endpoints work with.
pub struct AdminState {
    /// Streams of this daemon, in key order.
    pub streams: Vec<StreamKey>,
    /// The state store (read-only here; replays go through the stream tasks).
    pub store: Arc<dyn StateStore>,
    /// The sink, for readiness.
    pub sink: Arc<dyn Sink>,
    /// The running stream tasks.
    pub handles: HashMap<StreamKey, StreamHandle>,
    /// Bearer token required on `/v1` endpoints.
    pub token: Option<Secret>,
    /// Renders `/metrics`.
    pub metrics: PrometheusHandle,
    /// One planner per token (`poll.strategy = "adaptive"`; empty under `uniform`).
    pub planners: Vec<Planner>,
    /// Every token's budget, with the token's fingerprint.
    pub budgets: Vec<(String, Arc<RateBudget>)>,
}

/// An API error: status plus MessageError / ValidationError JSON.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
    errors: Option<BTreeMap<String, Vec<String>>>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            errors: None,
        }
    }

    fn invalid(field: &str, problem: String) -> Self {
        Self {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            message: format!("{field}: {problem}"),
            errors: Some(BTreeMap::from([(field.to_string(), vec![problem])])),
        }
    }
}

impl From<ControlError> for ApiError {
    fn from(e: ControlError) -> Self {
        let status = match &e {
            ControlError::Invalid { field, problem } => {
                return Self::invalid(field, problem.clone())
            }
            ControlError::UnknownTenant { .. } | ControlError::NotFound(_) => StatusCode::NOT_FOUND,
            ControlError::Refused(_) => StatusCode::CONFLICT,
            ControlError::Unreadable(_) => StatusCode::BAD_REQUEST,
            ControlError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ControlError::State(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        Self::new(status, e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = serde_json::json!({ "message": self.message });
        if let Some(errors) = self.errors {
            body["errors"] = serde_json::json!(errors);
        }
        let mut response = (self.status, Json(body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
        }
        response
    }
}

/// The admin router.
pub fn router(state: Arc<AdminState>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_endpoint))
        .route("/v1/status", get(status))
        .route("/v1/openapi.json", get(openapi))
        .route("/v1/replays", get(replays))
        .route("/v1/replays/{id}/cancel", post(cancel_replay))
        .route("/v1/tenants/{tenant}/replay", post(replay))
        .route("/v1/tenants/{tenant}/pause", post(steer::<PAUSE>))
        .route("/v1/tenants/{tenant}/resume", post(steer::<RESUME>))
        .route("/v1/tenants/{tenant}/sweep", post(steer::<SWEEP>))
        .route("/v1/tenants/{tenant}/recheck", post(steer::<RECHECK>))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// Serves the admin API on `listener` until `shutdown` is cancelled.
pub async fn serve(
    listener: TcpListener,
    state: Arc<AdminState>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

/// The address the CLI should connect to for a configured `admin.listen`:
/// an unspecified address (`0.0.0.0`) is reached over loopback.
pub fn connect_address(listen: SocketAddr) -> SocketAddr {
    if listen.ip().is_unspecified() {
        let loopback = match listen {
            SocketAddr::V4(_) => std::net::IpAddr::from([127, 0, 0, 1]),
            SocketAddr::V6(_) => std::net::IpAddr::from(std::net::Ipv6Addr::LOCALHOST),
        };
        SocketAddr::new(loopback, listen.port())
    } else {
        listen
    }
}

async fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "no such endpoint: valid ones are /healthz, /readyz, /metrics, GET /v1/status, GET /v1/replays, \
         POST /v1/replays/{id}/cancel, POST /v1/tenants/{tenant}/replay|pause|resume|sweep|recheck, \
         GET /v1/openapi.json",
    )
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    let posts = [
        "/replay", "/pause", "/resume", "/sweep", "/recheck", "/cancel",
    ];
    let allowed = if posts.iter().any(|p| uri.path().ends_with(p)) {
        "POST"
    } else {
        "GET"
    };
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{method} is not allowed on {}: use {allowed}", uri.path()),
    )
}

fn authorize(state: &AdminState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(expected) = &state.token else {
        return Ok(());
    };
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let Some(presented) = presented else {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "missing bearer token: send Authorization: Bearer <admin.token>",
        ));
    };
    // blake3 hashes compare in constant time.
    if blake3::hash(presented.as_bytes()) == blake3::hash(expected.expose().as_bytes()) {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid bearer token for the admin api",
        ))
    }
}

async fn healthz() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "status": "ok" }))
}

/// Runs the sink's health check (bounded) and records `sink_up`.
async fn sink_status(sink: &dyn Sink) -> SinkStatus {
    let result = match tokio::time::timeout(HEALTH_TIMEOUT, sink.health()).await {
        Ok(result) => result.map_err(|e| e.to_string()),
        Err(_) => Err(format!(
            "health check did not answer within {}",
            telemetry::human_duration(HEALTH_TIMEOUT)
        )),
    };
    let healthy = result.is_ok();
    metrics::gauge!(metric::SINK_UP, "sink" => sink.name().to_string()).set(if healthy {
        1.0
    } else {
        0.0
    });
    SinkStatus {
        name: sink.name().to_string(),
        healthy,
        error: result.err(),
    }
}

/// Ready means the process can do its work: the store answers and the sink
/// is reachable. Parked and failing streams are listed (`streams`) but do not
/// fail readiness: one tenant that lost access must not keep the pod out of
/// rollouts and node drains; `status`, metrics and alerts report them.
async fn readyz(State(state): State<Arc<AdminState>>) -> Response {
    let mut reasons = Vec::new();
    let mut streams = Vec::new();
    let sink = sink_status(state.sink.as_ref()).await;
    if let Some(error) = &sink.error {
        reasons.push(format!("sink {}: {error}", sink.name));
    }
    for key in &state.streams {
        match state.store.load_stream(*key) {
            Ok(s) => {
                if let Some(reason) = s.parked {
                    streams.push(format!("stream {key} parked: {reason}"));
                } else if let Some(error) = s.last_error {
                    streams.push(format!("stream {key} last sweep failed: {error}"));
                }
            }
            Err(e) => reasons.push(format!("state store: stream {key}: {e}")),
        }
    }
    let ready = reasons.is_empty();
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = serde_json::json!({ "ready": ready, "reasons": reasons, "streams": streams });
    (code, Json(body)).into_response()
}

async fn metrics_endpoint(State(state): State<Arc<AdminState>>) -> Response {
    telemetry::refresh_stream_gauges(state.store.as_ref(), &state.streams);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

async fn status(
    State(state): State<Arc<AdminState>>,
    headers: HeaderMap,
) -> Result<Json<StatusReport>, ApiError> {
    authorize(&state, &headers)?;
    let now = Utc::now();
    let mut streams = status_from_store(state.store.as_ref(), &state.streams, now)
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    for planner in &state.planners {
        let planned = planner.streams();
        for status in streams.iter_mut().filter(|s| planned.contains(&s.key())) {
            let key = status.key();
            status.planner = planner.stream_status(key);
            // Late beyond a poll interval, and not because it fails or is parked.
            let settings = planner.settings();
            let slack = settings.full_resync_interval + settings.interval;
            let healthy = status.parked.is_none() && status.last_error.is_none();
            status.full_sweep_overdue_seconds = status
                .last_full_sweep_finished
                .filter(|_| healthy)
                .and_then(|at| chrono::Duration::from_std(slack).ok().map(|s| at + s))
                .map(|due| (now - due).num_milliseconds() as f64 / 1000.0)
                .filter(|late| *late > 0.0);
        }
    }
    let sink = sink_status(state.sink.as_ref()).await;
    Ok(Json(StatusReport {
        streams,
        sink: Some(sink),
        budgets: state
            .budgets
            .iter()
            .map(|(token_id, budget)| BudgetStatus::of(token_id, budget))
            .collect(),
    }))
}

/// The parameters of a tenant endpoint, from its JSON body and its query string.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantParams {
    resource: Option<String>,
    since: Option<String>,
    kind: Option<String>,
}

/// Reads the JSON body (optional) and the query string of a tenant endpoint
/// whose `what` request accepts the fields `allowed`.
fn tenant_params(
    query: Option<String>,
    body: &Bytes,
    what: &str,
    allowed: &[&str],
) -> Result<TenantParams, ApiError> {
    let example = allowed
        .iter()
        .map(|f| match *f {
            "since" => "\"since\": \"2024-05-01T00:00:00Z\"".to_string(),
            "kind" => "\"kind\": \"full\"".to_string(),
            other => format!("\"{other}\": \"vouchers\""),
        })
        .collect::<Vec<_>>()
        .join(", ");
    let mut params = if body.iter().all(u8::is_ascii_whitespace) {
        TenantParams::default()
    } else {
        let bad = |e: String| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                format!(
                    "request body is not a {what} request ({e}): send {{{example}}}, all optional"
                ),
            )
        };
        let fields: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(body).map_err(|e| bad(e.to_string()))?;
        if let Some(unknown) = fields.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(bad(format!("unknown field `{unknown}`")));
        }
        serde_json::from_value(serde_json::Value::Object(fields)).map_err(|e| bad(e.to_string()))?
    };
    for (key, value) in url::form_urlencoded::parse(query.as_deref().unwrap_or("").as_bytes()) {
        let slot = match key.as_ref() {
            "resource" => &mut params.resource,
            "since" => &mut params.since,
            "kind" => &mut params.kind,
            _ => &mut None,
        };
        if !allowed.contains(&key.as_ref()) {
            return Err(ApiError::invalid(
                &key,
                format!(
                    "unknown parameter `{key}`: valid options are {}",
                    allowed.join(", ")
                ),
            ));
        }
        *slot = Some(value.into_owned());
    }
    Ok(params)
}

/// Who sent a request: the CLI marks its requests with `X-Requested-By: cli`.
fn requested_by(headers: &HeaderMap) -> RequestedBy {
    let cli = headers
        .get("x-requested-by")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("cli"));
    if cli {
        RequestedBy::Cli
    } else {
        RequestedBy::Api
    }
}

impl AdminState {
    /// The daemon's stream tasks, for the use cases.
    fn runtime(&self) -> Runtime<'_> {
        Runtime::Daemon(&self.handles, self.store.as_ref())
    }

    /// The streams `tenant` (and the `resource` parameter) name.
    fn targets(&self, tenant: &str, params: &TenantParams) -> Result<Vec<StreamKey>, ApiError> {
        Ok(control::resolve_targets(
            &self.streams,
            tenant,
            params.resource.as_deref(),
        )?)
    }
}

async fn replay(
    State(state): State<Arc<AdminState>>,
    Path(tenant): Path<String>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Bytes,
) -> Result<(StatusCode, Json<ReplayResponse>), ApiError> {
    authorize(&state, &headers)?;
    let params = tenant_params(query, &body, "replay", &["resource", "since"])?;
    let targets = state.targets(&tenant, &params)?;
    let since = match params.since.as_deref() {
        None => None,
        Some(text) => {
            Some(parse_since(text, Utc::now()).map_err(|e| ApiError::invalid("since", e))?)
        }
    };
    let tenant = targets[0].tenant;
    let response = control::replay::schedule(
        state.runtime(),
        tenant,
        &targets,
        since,
        requested_by(&headers),
    )
    .await?;
    Ok((StatusCode::ACCEPTED, Json(response)))
}

async fn replays(
    State(state): State<Arc<AdminState>>,
    headers: HeaderMap,
) -> Result<Json<Vec<control::replay::ReplayStatus>>, ApiError> {
    authorize(&state, &headers)?;
    Ok(Json(control::replay::list(
        state.store.as_ref(),
        &state.streams,
    )?))
}

async fn cancel_replay(
    State(state): State<Arc<AdminState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Json<control::replay::ReplayStatus>, ApiError> {
    authorize(&state, &headers)?;
    let cancelled =
        control::replay::cancel(state.runtime(), state.store.as_ref(), &state.streams, &id).await?;
    Ok(Json(cancelled))
}

/// `POST /v1/tenants/{tenant}/pause`.
const PAUSE: u8 = 0;
/// `POST /v1/tenants/{tenant}/resume`.
const RESUME: u8 = 1;
/// `POST /v1/tenants/{tenant}/sweep`.
const SWEEP: u8 = 2;
/// `POST /v1/tenants/{tenant}/recheck`.
const RECHECK: u8 = 3;

/// The steering endpoints of a tenant, one per `ACTION`: pause and resume
/// (200), sweep now and recheck (202, the sweep runs after the answer).
async fn steer<const ACTION: u8>(
    State(state): State<Arc<AdminState>>,
    Path(tenant): Path<String>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let (what, allowed): (&str, &[&str]) = match ACTION {
        PAUSE => ("pause", &["resource"]),
        RESUME => ("resume", &["resource"]),
        SWEEP => ("sweep", &["resource", "kind"]),
        _ => ("recheck", &["resource"]),
    };
    let params = tenant_params(query, &body, what, allowed)?;
    let targets = state.targets(&tenant, &params)?;
    let tenant = targets[0].tenant;
    let runtime = state.runtime();
    if matches!(ACTION, PAUSE | RESUME) {
        let pause = ACTION == PAUSE;
        let by = requested_by(&headers);
        let response = control::pause::set_paused(runtime, tenant, &targets, pause, by).await?;
        return Ok(Json(response).into_response());
    }
    let recheck = ACTION == RECHECK;
    let kind = match params.kind.as_deref() {
        Some(text) => Some(control::sweep::parse_kind(text)?),
        None if recheck => None,
        None => Some(crate::state::SweepKind::Incremental),
    };
    let response = control::sweep::sweep_now(runtime, tenant, &targets, kind, recheck).await?;
    Ok((StatusCode::ACCEPTED, Json(response)).into_response())
}

/// The OpenAPI 3 description of this API (`schemas/admin-openapi.json`).
pub const OPENAPI: &str = include_str!("../schemas/admin-openapi.json");

async fn openapi(
    State(state): State<Arc<AdminState>>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    Ok(([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2024-05-01T12:00:00Z")
            .unwrap()
            .with_timezone(&Utc)
    }

    #[test]
    fn status_during_a_first_sync_shows_the_records_committed_so_far_and_since_when() {
        use crate::hash::ContentHash;
        use crate::state::{RecordState, SledStore};
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(&dir.path().join("state")).unwrap();
        let key = StreamKey::new(1, Resource::Vouchers);
        let started = now() - chrono::Duration::minutes(3);
        let state = StreamState {
            last_sweep_started: Some(started),
            ..Default::default()
        };
        store.save_stream(key, &state).unwrap();
        let page: Vec<(i64, RecordState)> = (1..=3u8)
            .map(|n| {
                let record = RecordState {
                    hash: ContentHash([n; 16]),
                    updated_at: None,
                    seen_epoch: 0,
                    generation: 0,
                    seq: 0,
                };
                (i64::from(n), record)
            })
            .collect();
        let acks = vec![crate::state::Delivery::Acknowledged; page.len()];
        let page = crate::state::Acked::page(page, acks, vec![], 0).unwrap();
        store.commit_page(key, &page).unwrap();

        let status = status_from_store(&store, &[key], now()).unwrap();
        assert_eq!(status[0].records_known, 0, "the sweep has not finished");
        assert_eq!(status[0].records_committed, 3);
        assert_eq!(status[0].sweep_in_progress_since, Some(started));

        let finished = StreamState {
            last_sweep_finished: Some(now()),
            ..state
        };
        let status = StreamStatus::from_state(key, &finished, now());
        assert_eq!(status.sweep_in_progress_since, None);
    }

    #[test]
    fn since_accepts_rfc3339_dates_and_ages() {
        assert_eq!(
            parse_since("2024-04-30T10:00:00+02:00", now()).unwrap(),
            DateTime::parse_from_rfc3339("2024-04-30T08:00:00Z").unwrap()
        );
        assert_eq!(
            parse_since("2024-04-30", now()).unwrap(),
            DateTime::parse_from_rfc3339("2024-04-30T00:00:00Z").unwrap()
        );
        assert_eq!(
            parse_since("2h", now()).unwrap(),
            DateTime::parse_from_rfc3339("2024-05-01T10:00:00Z").unwrap()
        );
    }

    #[test]
    fn since_in_the_future_or_unreadable_is_refused_with_the_accepted_forms() {
        assert_eq!(
            parse_since("2030-01-01", now()).unwrap_err(),
            "`2030-01-01` is in the future"
        );
        let err = parse_since("yesterday", now()).unwrap_err();
        assert!(err.contains("RFC 3339"), "{err}");
    }

    #[test]
    fn an_unspecified_listen_address_is_reached_over_loopback() {
        assert_eq!(
            connect_address("0.0.0.0:9464".parse().unwrap()),
            "127.0.0.1:9464".parse::<SocketAddr>().unwrap()
        );
        assert_eq!(
            connect_address("10.1.2.3:9464".parse().unwrap()),
            "10.1.2.3:9464".parse::<SocketAddr>().unwrap()
        );
    }

    #[test]
    fn a_tenant_request_reads_the_body_and_the_query_and_refuses_unknown_fields() {
        let allowed = ["resource", "since"];
        let r = tenant_params(
            Some("since=2h".into()),
            &Bytes::from_static(b"{\"resource\":\"vouchers\"}"),
            "replay",
            &allowed,
        )
        .unwrap();
        assert_eq!(r.resource.as_deref(), Some("vouchers"));
        assert_eq!(r.since.as_deref(), Some("2h"));
        let err = tenant_params(
            None,
            &Bytes::from_static(b"{\"resourse\":1}"),
            "replay",
            &allowed,
        )
        .unwrap_err();
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        let err = tenant_params(
            None,
            &Bytes::from_static(b"{\"kind\":\"full\"}"),
            "replay",
            &allowed,
        )
        .unwrap_err();
        assert_eq!(
            err.status,
            StatusCode::BAD_REQUEST,
            "kind is not a replay field"
        );
        let err =
            tenant_params(Some("tenant=3".into()), &Bytes::new(), "replay", &allowed).unwrap_err();
        assert_eq!(err.status, StatusCode::UNPROCESSABLE_ENTITY);
    }
}
