//! The admin HTTP API of a running daemon: liveness and readiness probes,
//! Prometheus metrics, per-stream status, and the operator's steering (replay
//! and cancel, pause and resume, sweep now and recheck), so operators and the
//! CLI can work while the daemon holds the state store. The handlers only
//! translate HTTP to the use cases of `crate::control` and back; the routes
//! are described by `schemas/admin-openapi.json`, served at `/v1/openapi.json`.
//!
//! Every `/v1` endpoint but the published schemas (`/v1/schemas/{name}`)
//! requires `Authorization: Bearer <admin.token>` when a token is configured; errors are JSON `{"message": ...}` (422 adds
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
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use crate::control::replay::{ReplayResponse, ScheduledReplay};
pub use crate::control::status::{
    status_from_store, DeadLetterStatus, SinkStatus, StatusReport, StreamStatus,
};
use crate::control::{self, status, ControlError, Runtime};
use crate::planner::{BudgetStatus, Planner};
use crate::scheduler::StreamHandle;
use crate::secret::Secret;
use crate::sinks::Sink;
use crate::state::{RequestedBy, StateStore};
use crate::stream::StreamKey;
use crate::telemetry::{self, metric};
use crate::upstream::ratelimit::RateBudget;

/// How long `/readyz` waits for the sink's health check.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(3);

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
        .route("/v1/schemas/{name}", get(schema_document))
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
         GET /v1/openapi.json, GET /v1/schemas/{name}",
    )
}

/// A published JSON Schema (`schemas/{name}` of the repository), without a
/// token: events point consumers here through `dataschema`, and the schemas
/// hold nothing secret.
async fn schema_document(Path(name): Path<String>) -> Result<Response, ApiError> {
    match crate::schema::schema(&name) {
        Some(text) => {
            Ok(([(header::CONTENT_TYPE, "application/schema+json")], text).into_response())
        }
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "no schema named `{name}`: valid ones are {}",
                crate::schema::SCHEMAS
                    .iter()
                    .map(|(file, _)| *file)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )),
    }
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
        state.metrics.render() + &telemetry::process_metrics(),
    )
        .into_response()
}

async fn status(
    State(state): State<Arc<AdminState>>,
    headers: HeaderMap,
) -> Result<Json<StatusReport>, ApiError> {
    authorize(&state, &headers)?;
    let now = Utc::now();
    let mut streams = status::from_store(state.store.as_ref(), &state.streams, now)?;
    status::add_plans(&mut streams, &state.planners, now);
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
