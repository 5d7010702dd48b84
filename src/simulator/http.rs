//! The simulator's HTTP side: a listener whose connections can be dropped on
//! demand, the axum router, the cross-cutting rules (faults, latency,
//! Accept, bearer tokens, rate limit, request log, common headers) and the
//! five endpoint handlers.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{ConnectInfo, DefaultBodyLimit, Path, RawQuery, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::{IncomingStream, Listener};
use axum::{Extension, Router};
use bytes::{BufMut, BytesMut};
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;

use super::cursor::query_fingerprint;
use super::journal;
use super::listing;
use super::model::{ts, MessageError, Single, ValidationError};
use super::query::{self, FieldErrors};
use super::redeem;
use super::state::{token_fingerprint, Grant, RateDecision, SimState};
use super::{Fault, Permission, RequestLogEntry, API_PREFIX, PAGE_SIZE};
use crate::stream::{Resource, TenantId};

type AppState = Arc<SimState>;

/// Marks a response that is never sent because its connection was dropped.
#[derive(Clone, Copy, Debug)]
struct Dropped;

/// Connection info: the peer address plus a switch that kills the connection.
#[derive(Clone, Debug)]
pub struct ConnInfo {
    /// Client address (rate limiting is per client IP).
    pub peer: SocketAddr,
    kill: Arc<AtomicBool>,
}

impl axum::extract::connect_info::Connected<IncomingStream<'_, SimListener>> for ConnInfo {
    fn connect_info(stream: IncomingStream<'_, SimListener>) -> Self {
        stream.remote_addr().clone()
    }
}

/// Longest TLS handshake the listener waits for before it takes the next connection.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// A TCP listener, TLS when given an acceptor, whose streams fail every
/// read and write once killed.
pub struct SimListener {
    inner: TcpListener,
    tls: Option<TlsAcceptor>,
}

/// A connection: plain, or TLS over the same killable stream.
pub type SimStream = Either<KillableStream, TlsStream<KillableStream>>;

impl Listener for SimListener {
    type Io = SimStream;
    type Addr = ConnInfo;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.inner.accept().await {
                Ok((stream, peer)) => {
                    // Nagle would add 40 ms to small responses; failure to set it is harmless.
                    let _ = stream.set_nodelay(true);
                    let kill = Arc::new(AtomicBool::new(false));
                    let io = KillableStream {
                        inner: stream,
                        kill: kill.clone(),
                    };
                    let Some(acceptor) = &self.tls else {
                        return (Either::Left(io), ConnInfo { peer, kill });
                    };
                    match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(io)).await {
                        Ok(Ok(tls)) => return (Either::Right(tls), ConnInfo { peer, kill }),
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "simulator tls handshake failed");
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "simulator tls handshake timed out");
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "simulator accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(ConnInfo {
            peer: self.inner.local_addr()?,
            kill: Arc::new(AtomicBool::new(false)),
        })
    }
}

/// A TCP stream that can be made to fail, so the server drops the connection
/// without writing a response.
pub struct KillableStream {
    inner: TcpStream,
    kill: Arc<AtomicBool>,
}

fn killed() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "connection dropped by fault injection",
    )
}

impl AsyncRead for KillableStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.kill.load(Ordering::Relaxed) {
            return Poll::Ready(Err(killed()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for KillableStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.kill.load(Ordering::Relaxed) {
            return Poll::Ready(Err(killed()));
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.kill.load(Ordering::Relaxed) {
            return Poll::Ready(Err(killed()));
        }
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// Serves the API, over TLS when given an acceptor, until `cancel` fires.
pub async fn serve(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    state: AppState,
    cancel: CancellationToken,
) {
    let app = router(state);
    let result = axum::serve(
        SimListener {
            inner: listener,
            tls,
        },
        app.into_make_service_with_connect_info::<ConnInfo>(),
    )
    .with_graceful_shutdown(async move { cancel.cancelled().await })
    .await;
    if let Err(e) = result {
        tracing::error!(error = %e, "simulator server stopped");
    }
}

/// The full router: API routes behind the guard, a JSON 404/405 for the rest,
/// and the observer around everything.
pub fn router(state: AppState) -> Router {
    let api = Router::new()
        .route(
            "/tenants/{tenant}/catalog/vouchers",
            get(list_handler).layer(Extension(Resource::Vouchers)),
        )
        .route(
            "/tenants/{tenant}/catalog/vouchers/{id}",
            get(get_handler).layer(Extension(Resource::Vouchers)),
        )
        .route(
            "/tenants/{tenant}/catalog/categories",
            get(list_handler).layer(Extension(Resource::Categories)),
        )
        .route(
            "/tenants/{tenant}/catalog/categories/{id}",
            get(get_handler).layer(Extension(Resource::Categories)),
        )
        .route("/tenants/{tenant}/redemptions", post(redeem_voucher))
        .route_layer(middleware::from_fn_with_state(state.clone(), guard));
    Router::new()
        .nest(API_PREFIX, api)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(64 * 1024))
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        .with_state(state)
}

fn json_bytes(status: StatusCode, body: Bytes) -> Response {
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

fn json<T: Serialize>(status: StatusCode, value: &T) -> Response {
    match serde_json::to_vec(value) {
        Ok(body) => json_bytes(status, Bytes::from(body)),
        Err(e) => message(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("response encoding failed: {e}"),
        ),
    }
}

/// A MessageError response.
fn message(status: StatusCode, text: impl Into<String>) -> Response {
    json(
        status,
        &MessageError {
            message: text.into(),
        },
    )
}

/// A 422 ValidationError response; the message is the first error, Laravel style.
fn validation(errors: FieldErrors) -> Response {
    let total: usize = errors.values().map(Vec::len).sum();
    let first = errors
        .values()
        .flatten()
        .next()
        .cloned()
        .unwrap_or_else(|| "the given data was invalid".to_string());
    let text = match total {
        0 | 1 => first,
        2 => format!("{first} (and 1 more error)"),
        n => format!("{first} (and {} more errors)", n - 1),
    };
    json(
        StatusCode::UNPROCESSABLE_ENTITY,
        &ValidationError {
            message: text,
            errors,
        },
    )
}

/// A failed API request, answered as a MessageError or a ValidationError.
#[derive(Debug, thiserror::Error)]
enum ApiError {
    /// A MessageError with this status.
    #[error("{1}")]
    Message(StatusCode, String),
    /// A 422 ValidationError.
    #[error("request validation failed")]
    Validation(FieldErrors),
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            ApiError::Message(status, text) => message(status, text),
            ApiError::Validation(errors) => validation(errors),
        }
    }
}

/// A MessageError failure.
fn fail(status: StatusCode, text: impl Into<String>) -> ApiError {
    ApiError::Message(status, text.into())
}

/// A ValidationError failure on one field.
fn invalid(field: &str, text: String) -> ApiError {
    let mut errors = FieldErrors::new();
    errors.insert(field.to_string(), vec![text]);
    ApiError::Validation(errors)
}

async fn not_found(method: Method, uri: axum::http::Uri) -> Response {
    message(
        StatusCode::NOT_FOUND,
        format!(
            "no endpoint {method} {}; endpoints live under {API_PREFIX}/tenants/{{tenant}}/catalog/{{vouchers|categories}} and {API_PREFIX}/tenants/{{tenant}}/redemptions",
            uri.path()
        ),
    )
}

async fn method_not_allowed(method: Method, uri: axum::http::Uri) -> Response {
    message(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("method {method} is not allowed on {}", uri.path()),
    )
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

fn accepts_json(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|range| {
            range
                .split(';')
                .next()
                .is_some_and(|media| media.trim().eq_ignore_ascii_case("application/json"))
        })
}

/// Records every request and sets the common headers; applies body faults.
async fn observe(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let at = Instant::now();
    let arrived = chrono::Utc::now();
    let method = request.method().to_string();
    let path = request.uri().path().to_string();
    let query = request.uri().query().map(str::to_string);
    let fingerprint = bearer(request.headers()).map(token_fingerprint);
    let mut response = next.run(request).await;
    if response.status() == StatusCode::OK && state.has_faults() {
        if let Some(fault) =
            state.take_fault(|f| matches!(f, Fault::TruncatedBody | Fault::MalformedJson))
        {
            response = mangle(response, fault).await;
        }
    }
    let headers = response.headers_mut();
    if let Ok(id) = HeaderValue::from_str(&state.request_id()) {
        headers.insert("x-request-id", id);
    }
    headers.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("private, no-store"),
    );
    let status = if response.extensions().get::<Dropped>().is_some() {
        0
    } else {
        response.status().as_u16()
    };
    if let Some(journal) = &state.request_journal {
        journal.append(&serde_json::json!({
            "at": journal::timestamp(arrived),
            "path": path,
            "status": status,
        }));
    }
    state.log_request(RequestLogEntry {
        at,
        method,
        path,
        query,
        status,
        token_fingerprint: fingerprint,
    });
    response
}

/// The rate window in the 429 message: "minute" for the default 60 s.
fn window_name(window: Duration) -> String {
    if window == Duration::from_secs(60) {
        "minute".to_string()
    } else {
        humantime::format_duration(window).to_string()
    }
}

async fn mangle(response: Response, fault: Fault) -> Response {
    let (parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let new_body = match fault {
        Fault::TruncatedBody => bytes.slice(..bytes.len() / 2),
        _ => Bytes::from_static(b"{\"data\": [<html>502 Bad Gateway</html>"),
    };
    let mut response = Response::from_parts(parts, Body::from(new_body));
    response.headers_mut().remove(header::CONTENT_LENGTH);
    response
}

/// Injected faults, latency and failures, then Accept, bearer token and rate limit.
async fn guard(
    State(state): State<AppState>,
    ConnectInfo(conn): ConnectInfo<ConnInfo>,
    mut request: Request,
    next: Next,
) -> Response {
    if state.has_faults() {
        let fault = state.take_fault(|f| {
            matches!(
                f,
                Fault::Status { .. } | Fault::Delay(_) | Fault::DropConnection
            )
        });
        match fault {
            Some(Fault::Status {
                status,
                retry_after,
            }) => {
                // A 1xx cannot end an exchange and an invalid code cannot be sent: both become 500.
                let code = StatusCode::from_u16(status)
                    .ok()
                    .filter(|code| code.as_u16() >= 200)
                    .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                let mut response = message(code, format!("injected fault: status {status}"));
                if let Some(value) = retry_after.and_then(|v| HeaderValue::from_str(&v).ok()) {
                    response.headers_mut().insert(header::RETRY_AFTER, value);
                }
                return response;
            }
            Some(Fault::Delay(delay)) => tokio::time::sleep(delay).await,
            Some(Fault::DropConnection) => {
                conn.kill.store(true, Ordering::Relaxed);
                let mut response = StatusCode::INTERNAL_SERVER_ERROR.into_response();
                response.extensions_mut().insert(Dropped);
                return response;
            }
            _ => {}
        }
    }
    let latency = state.settings.latency();
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    let fail_rate = state.settings.fail_rate();
    if fail_rate > 0.0 && rand::random::<f64>() < fail_rate {
        let statuses = [
            StatusCode::INTERNAL_SERVER_ERROR,
            StatusCode::BAD_GATEWAY,
            StatusCode::SERVICE_UNAVAILABLE,
        ];
        let status = statuses[rand::random_range(0..statuses.len())];
        return message(status, format!("injected failure ({status})"));
    }
    if !accepts_json(request.headers()) {
        let got = request
            .headers()
            .get(header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("nothing");
        return message(
            StatusCode::NOT_ACCEPTABLE,
            format!("this API only produces application/json; send `Accept: application/json` (got `{got}`)"),
        );
    }
    let Some(token) = bearer(request.headers()) else {
        return message(
            StatusCode::UNAUTHORIZED,
            "unauthenticated: send `Authorization: Bearer <token>`",
        );
    };
    let Some(grant) = state.grant(token) else {
        return message(
            StatusCode::UNAUTHORIZED,
            "unauthenticated: the bearer token is not valid",
        );
    };
    if let RateDecision::Limited(reset) = state.charge(&grant.fingerprint, conn.peer.ip()) {
        let seconds = reset.as_secs() + u64::from(reset.subsec_nanos() > 0);
        let seconds = seconds.max(1);
        let mut response = message(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "too many requests: the limit is {} per {} per token and IP; retry after {seconds} s",
                state.settings.rate_limit(),
                window_name(state.settings.rate_window)
            ),
        );
        if state.settings.retry_after_header {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        return response;
    }
    request.extensions_mut().insert(grant);
    next.run(request).await
}

/// Checks permission, tenant syntax, tenant scope and tenant existence.
fn authorize(
    state: &SimState,
    grant: &Grant,
    permission: Permission,
    tenant: &str,
) -> Result<TenantId, ApiError> {
    if grant.permissions & permission_bit(permission) == 0 {
        return Err(fail(
            StatusCode::FORBIDDEN,
            format!(
                "forbidden: the token lacks the {} permission",
                permission.as_str()
            ),
        ));
    }
    let Ok(tenant_id) = tenant.parse::<TenantId>() else {
        return Err(fail(
            StatusCode::NOT_FOUND,
            format!("tenant `{tenant}` not found"),
        ));
    };
    if let Some(scope) = &grant.tenants {
        if !scope.contains(&tenant_id) {
            return Err(fail(
                StatusCode::FORBIDDEN,
                format!("forbidden: the token has no access to tenant {tenant_id}"),
            ));
        }
    }
    if state.tenant(tenant_id).is_none() {
        return Err(fail(
            StatusCode::NOT_FOUND,
            format!("tenant {tenant_id} not found"),
        ));
    }
    Ok(tenant_id)
}

fn permission_bit(permission: Permission) -> u8 {
    match permission {
        Permission::ViewVouchers => 1,
        Permission::ViewCategories => 2,
        Permission::RedeemVouchers => 4,
    }
}

fn resource_permission(resource: Resource) -> Permission {
    match resource {
        Resource::Vouchers => Permission::ViewVouchers,
        Resource::Categories => Permission::ViewCategories,
    }
}

async fn list_handler(
    State(state): State<AppState>,
    Extension(grant): Extension<Grant>,
    Extension(resource): Extension<Resource>,
    path: Result<Path<String>, PathRejection>,
    RawQuery(query): RawQuery,
) -> Response {
    list(&state, &grant, resource, path, query).unwrap_or_else(IntoResponse::into_response)
}

fn path_not_found(rejection: PathRejection) -> ApiError {
    fail(StatusCode::NOT_FOUND, format!("not found: {rejection}"))
}

fn list(
    state: &SimState,
    grant: &Grant,
    resource: Resource,
    path: Result<Path<String>, PathRejection>,
    raw_query: Option<String>,
) -> Result<Response, ApiError> {
    let Path(tenant) = path.map_err(path_not_found)?;
    let tenant = authorize(state, grant, resource_permission(resource), &tenant)?;
    let query =
        query::parse_list_query(resource, raw_query.as_deref()).map_err(ApiError::Validation)?;
    let since = query.updated_since.map(|at| at.timestamp_micros());
    let fingerprint = query_fingerprint(tenant, resource.as_str(), since, query.include_mask);
    let after = match &query.cursor {
        Some(cursor) => Some(
            state
                .cursors
                .decode(cursor, fingerprint)
                .map_err(|e| invalid("cursor", e.to_string()))?,
        ),
        None => None,
    };
    let server_time = state.clock.now();
    let from = since.map(|micros| (Some(micros), i64::MIN));
    let listing_fault = state.listing_fault(tenant, resource);
    let (mut records, next_cursor): (Vec<Bytes>, Option<String>) = {
        let data = state
            .read_tenant(tenant)
            .ok_or_else(|| fail(StatusCode::NOT_FOUND, format!("tenant {tenant} not found")))?;
        match listing_fault {
            Some(fault) => {
                let faulty = listing::FaultyQuery {
                    fault,
                    resource,
                    from,
                    after,
                    cursor: query.cursor.as_deref(),
                    include_mask: query.include_mask,
                    fingerprint,
                };
                let (records, next) = listing::page(&data, &state.cursors, &faulty);
                (records, Some(next))
            }
            None => {
                let (rows, more) = data.page(resource, from, after, PAGE_SIZE, query.include_mask);
                let next_cursor = match (more, rows.last()) {
                    (true, Some((key, _))) => Some(state.cursors.encode(*key, fingerprint)),
                    _ => None,
                };
                (
                    rows.into_iter().map(|(_, bytes)| bytes).collect(),
                    next_cursor,
                )
            }
        }
    };
    if state.has_faults()
        && state
            .take_fault(|f| matches!(f, Fault::RecordWithoutId))
            .is_some()
    {
        records.push(record_without_id(
            state.next_record_without_id_use(),
            records.first(),
        ));
    }
    let size: usize = records.iter().map(Bytes::len).sum::<usize>() + records.len() + 160;
    let mut body = BytesMut::with_capacity(size);
    body.put_slice(b"{\"data\":[");
    for (i, record) in records.iter().enumerate() {
        if i > 0 {
            body.put_u8(b',');
        }
        body.put_slice(record);
    }
    body.put_slice(b"],\"next_cursor\":");
    match next_cursor {
        Some(cursor) => {
            body.put_u8(b'"');
            body.put_slice(cursor.as_bytes());
            body.put_u8(b'"');
        }
        None => body.put_slice(b"null"),
    }
    body.put_slice(b",\"server_time\":\"");
    body.put_slice(ts::format(&server_time).as_bytes());
    body.put_slice(b"\"}");
    Ok(json_bytes(StatusCode::OK, body.freeze()))
}

/// An extra record for the RecordWithoutId fault: a copy of `template` (or a
/// minimal record) whose `id` is missing on odd uses and a string on even ones.
fn record_without_id(use_number: u64, template: Option<&Bytes>) -> Bytes {
    let mut value: serde_json::Value = template
        .and_then(|bytes| serde_json::from_slice(bytes).ok())
        .unwrap_or_else(
            || serde_json::json!({"slug": "ghost", "title": "Ghost", "updated_at": null}),
        );
    if let Some(object) = value.as_object_mut() {
        if use_number % 2 == 1 {
            object.remove("id");
        } else {
            object.insert(
                "id".to_string(),
                serde_json::Value::String(format!("x-{use_number}")),
            );
        }
    }
    Bytes::from(serde_json::to_vec(&value).unwrap_or_default())
}

async fn get_handler(
    State(state): State<AppState>,
    Extension(grant): Extension<Grant>,
    Extension(resource): Extension<Resource>,
    path: Result<Path<(String, String)>, PathRejection>,
    RawQuery(query): RawQuery,
) -> Response {
    get_one(&state, &grant, resource, path, query).unwrap_or_else(IntoResponse::into_response)
}

fn get_one(
    state: &SimState,
    grant: &Grant,
    resource: Resource,
    path: Result<Path<(String, String)>, PathRejection>,
    raw_query: Option<String>,
) -> Result<Response, ApiError> {
    let Path((tenant, id)) = path.map_err(path_not_found)?;
    let tenant = authorize(state, grant, resource_permission(resource), &tenant)?;
    query::parse_no_query(raw_query.as_deref()).map_err(ApiError::Validation)?;
    let not_found = || {
        fail(
            StatusCode::NOT_FOUND,
            format!(
                "{} `{id}` not found in tenant {tenant}",
                resource.singular()
            ),
        )
    };
    let record_id: i64 = id.parse().map_err(|_| not_found())?;
    let full = query::full_include_mask(resource);
    let record = state
        .read_tenant(tenant)
        .and_then(|data| data.form(resource, record_id, full))
        .ok_or_else(not_found)?;
    let mut body = BytesMut::with_capacity(record.len() + 10);
    body.put_slice(b"{\"data\":");
    body.put_slice(&record);
    body.put_u8(b'}');
    Ok(json_bytes(StatusCode::OK, body.freeze()))
}

async fn redeem_voucher(
    State(state): State<AppState>,
    Extension(grant): Extension<Grant>,
    path: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    redeem_inner(&state, &grant, path, &headers, body).unwrap_or_else(IntoResponse::into_response)
}

fn redeem_inner(
    state: &SimState,
    grant: &Grant,
    path: Result<Path<String>, PathRejection>,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let Path(tenant) = path.map_err(path_not_found)?;
    let tenant = authorize(state, grant, Permission::RedeemVouchers, &tenant)?;
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let media = content_type.split(';').next().unwrap_or("").trim();
    if !media.eq_ignore_ascii_case("application/json") {
        return Err(fail(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!("send the body as `Content-Type: application/json` (got `{content_type}`)"),
        ));
    }
    let body = body.map_err(|e| fail(e.status(), format!("request body refused: {e}")))?;
    let request = redeem::parse_body(&body).map_err(ApiError::Validation)?;
    let token_id = match &request.redemption_token {
        Some(token) => Some(parse_redemption_token(state, tenant, token).ok_or_else(|| {
            invalid(
                "redemption_token",
                "redemption token is invalid or expired".to_string(),
            )
        })?),
        None => None,
    };
    let id = match (token_id, request.voucher_id) {
        (Some(a), Some(b)) if a != b => {
            return Err(invalid(
                "voucher_id",
                format!("voucher_id {b} does not match the voucher of the redemption token"),
            ))
        }
        (Some(id), _) | (None, Some(id)) => id,
        (None, None) => {
            return Err(invalid(
                "voucher_id",
                "either redemption_token or voucher_id is required".to_string(),
            ))
        }
    };
    let now = state.clock.now();
    let mut data = state
        .write_tenant(tenant)
        .ok_or_else(|| fail(StatusCode::NOT_FOUND, format!("tenant {tenant} not found")))?;
    let purchased = data.purchased.get_mut(&id).ok_or_else(|| {
        fail(
            StatusCode::NOT_FOUND,
            format!("voucher {id} not found in tenant {tenant}"),
        )
    })?;
    match redeem::redeem(purchased, &request, tenant, now) {
        Ok(result) => Ok(json(StatusCode::OK, &Single { data: result })),
        Err(refusal) => Err(invalid(refusal.field, refusal.message)),
    }
}

/// The purchased voucher id a redemption token stands for, when the token is genuine.
fn parse_redemption_token(state: &SimState, tenant: TenantId, token: &str) -> Option<i64> {
    let rest = token.strip_prefix("rt_")?;
    let (id, _) = rest.split_once('_')?;
    let id: i64 = id.parse().ok()?;
    (state.token_for(tenant, id) == token).then_some(id)
}
