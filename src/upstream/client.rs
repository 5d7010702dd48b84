//! The typed HTTP client of the External Voucher API: one place that spends
//! the token's shared rate budget, retries what is worth retrying, maps every
//! status to a typed error, and keeps the bearer token out of every log line,
//! error message and Debug output.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use chrono::{DateTime, NaiveDateTime, Utc};
use reqwest::header::{HeaderMap, HeaderValue, ACCEPT, AUTHORIZATION, CONTENT_TYPE, RETRY_AFTER};
use reqwest::{Method, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use url::Url;

use super::body_budget::{BodyBudget, BodyShare, DEFAULT_BODY_BUDGET_BYTES};
use super::error::UpstreamError;
use super::page::{
    decode_page, decode_page_hashed, decode_record_in, DecodedPage, Hashing, ListQuery, Page,
    Record,
};
use super::ratelimit::{Lane, RateBudget};
use super::tls::{refused_certificate, TrustRoots};
use crate::stream::{Resource, TenantId};
use crate::telemetry::metric;

/// Longest upstream error text kept in an error message, in characters.
const MAX_MESSAGE_CHARS: usize = 300;

/// Shortest token that is scrubbed from upstream text.
const MIN_SCRUBBED_TOKEN_CHARS: usize = 8;

/// The upstream bearer token: the crate's one secret wrapper.
pub use crate::secret::Secret as SecretToken;

/// Connection, timeout and retry settings of the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientOptions {
    /// API base URL including the version prefix (`.../api/external/v1`).
    pub base_url: Url,
    /// Limit for one attempt: connect, send, and read the whole body.
    pub timeout: Duration,
    /// Attempts per request, the first one included (at least 1).
    pub max_attempts: u32,
    /// Backoff before the second attempt; doubles per attempt.
    pub backoff_initial: Duration,
    /// Longest backoff between two attempts.
    pub backoff_max: Duration,
    /// Longest wait honoured from a `Retry-After` header.
    pub retry_after_max: Duration,
    /// Wait after a 429 without a usable `Retry-After` (the upstream's counting window).
    pub rate_limit_window: Duration,
    /// CA certificates trusted besides the public roots (`upstream.ca_file`).
    pub ca: Option<TrustRoots>,
    /// Bytes of listing bodies held in memory at once across every stream
    /// of the client ([`BodyBudget`]; one for every client of a process
    /// built by `daemon::clients_with`).
    pub body_budget_bytes: usize,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            base_url: default_base_url(),
            timeout: Duration::from_secs(30),
            max_attempts: 6,
            backoff_initial: Duration::from_millis(500),
            backoff_max: Duration::from_secs(30),
            retry_after_max: Duration::from_secs(120),
            rate_limit_window: Duration::from_secs(60),
            ca: None,
            body_budget_bytes: DEFAULT_BODY_BUDGET_BYTES,
        }
    }
}

/// The default base URL: a simulator on the local machine.
fn default_base_url() -> Url {
    const LOCAL: &str = "http://127.0.0.1:8080/api/external/v1";
    match Url::parse(LOCAL) {
        Ok(url) => url,
        Err(e) => unreachable!("constant url {LOCAL} does not parse: {e}"),
    }
}

/// Body of `POST /tenants/{tenant}/redemptions`. The spec does not name the
/// amount field; it is assumed to be `amount` (major units), as the simulator reads it.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct RedeemRequest {
    /// Short-lived token from the (not shown) resolve operation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redemption_token: Option<String>,
    /// Purchased voucher id, the alternative to the token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub voucher_id: Option<i64>,
    /// Amount to redeem in major units (assumed name).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub amount: Option<f64>,
}

/// Async client for the shown endpoints of the External Voucher API; cheap to clone.
#[derive(Clone)]
pub struct UpstreamClient {
    /// Shared state of all clones.
    inner: Arc<Inner>,
    /// The budget lane this client's requests wait in.
    lane: Lane,
    /// How listed records are hashed as their page is read.
    hashing: Option<Hashing>,
}

/// What every clone of a client shares.
struct Inner {
    /// The HTTP connection pool.
    http: reqwest::Client,
    /// Settings.
    opts: ClientOptions,
    /// `Bearer <token>`, marked sensitive.
    authorization: HeaderValue,
    /// The token itself, only to scrub it from upstream-provided text.
    token: SecretToken,
    /// Non-secret token fingerprint for metrics and logs.
    token_id: String,
    /// The token's shared request budget.
    budget: Arc<RateBudget>,
    /// The listing bodies held in memory, across every stream.
    bodies: Arc<BodyBudget>,
}

impl fmt::Debug for UpstreamClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamClient")
            .field("base_url", &self.inner.opts.base_url.as_str())
            .field("token", &self.inner.token)
            .field("token_id", &self.inner.token_id)
            .field("budget", &self.inner.budget)
            .finish_non_exhaustive()
    }
}

/// Whether a failed attempt may be repeated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RetryPolicy {
    /// GET: retry 429, 5xx, timeouts, transport errors and broken bodies.
    Idempotent,
    /// POST: retry only 429 (the request was refused before it acted).
    RateLimitOnly,
}

/// One logical request (retried as a unit).
struct Call {
    /// Tenant label for metrics and logs.
    tenant: TenantId,
    /// Resource label for metrics and logs (`vouchers`, `categories`, `redemptions`).
    resource: &'static str,
    /// HTTP method.
    method: Method,
    /// Full URL with query.
    url: Url,
    /// Path below the base URL, for messages.
    path: String,
    /// Route template for the duration metric (`/tenants/{tenant}/catalog/vouchers`).
    endpoint: &'static str,
    /// JSON body, if any.
    body: Option<Bytes>,
    /// What may be retried.
    policy: RetryPolicy,
    /// A listing page: its body takes a share of the [`BodyBudget`] before
    /// it is read.
    holds_body: bool,
}

/// How one attempt failed.
enum Failure {
    /// Do not retry.
    Final(UpstreamError),
    /// 429: wait this long, then retry.
    RateLimited(UpstreamError, Duration),
    /// Worth another attempt after a backoff; the label is the retry `reason`.
    Retriable(UpstreamError, &'static str),
}

impl UpstreamClient {
    /// Builds a client that spends `budget` (share one budget per token, see
    /// `BudgetRegistry`), with a body budget of its own
    /// (`opts.body_budget_bytes`).
    pub fn new(
        opts: ClientOptions,
        token: SecretToken,
        budget: Arc<RateBudget>,
    ) -> Result<Self, UpstreamError> {
        let bodies = Arc::new(BodyBudget::new(opts.body_budget_bytes));
        Self::with_body_budget(opts, token, budget, bodies)
    }

    /// [`Self::new`], holding its listing bodies within `bodies`: the
    /// clients of one process (one per token) share one.
    pub fn with_body_budget(
        opts: ClientOptions,
        token: SecretToken,
        budget: Arc<RateBudget>,
        bodies: Arc<BodyBudget>,
    ) -> Result<Self, UpstreamError> {
        match opts.base_url.scheme() {
            "http" | "https" => {}
            other => {
                return Err(UpstreamError::Config(format!(
                    "base_url scheme `{other}` is not supported: valid options are http, https"
                )))
            }
        }
        if opts.base_url.cannot_be_a_base() || opts.base_url.host_str().is_none() {
            return Err(UpstreamError::Config(
                "base_url must be an absolute http(s) url with a host".into(),
            ));
        }
        if !opts.base_url.username().is_empty() || opts.base_url.password().is_some() {
            return Err(UpstreamError::Config(
                "base_url must not carry credentials; the bearer token goes in upstream.token"
                    .into(),
            ));
        }
        if opts.base_url.query().is_some() || opts.base_url.fragment().is_some() {
            return Err(UpstreamError::Config(
                "base_url must not carry a query or fragment".into(),
            ));
        }
        if opts.timeout.is_zero() {
            return Err(UpstreamError::Config(
                "timeout must be greater than 0".into(),
            ));
        }
        if token.expose().trim().is_empty() {
            return Err(UpstreamError::Config("the upstream token is empty".into()));
        }
        let mut authorization = HeaderValue::from_str(&format!("Bearer {}", token.expose()))
            .map_err(|_| {
                UpstreamError::Config(
                    "the upstream token contains characters not allowed in an http header".into(),
                )
            })?;
        authorization.set_sensitive(true);
        let mut default_headers = HeaderMap::new();
        default_headers.insert(ACCEPT, HeaderValue::from_static("application/json"));
        let mut builder = reqwest::Client::builder().use_rustls_tls();
        for der in opts.ca.iter().flat_map(|ca| &ca.certificates) {
            let certificate = reqwest::Certificate::from_der(der).map_err(|e| {
                UpstreamError::Config(format!(
                    "a certificate of upstream.ca_file is unusable: {e}"
                ))
            })?;
            builder = builder.add_root_certificate(certificate);
        }
        // No client-wide timeout: `send_once` applies `opts.timeout` to the
        // request and its body, not to a wait for the body budget between.
        let http = builder
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("voucher-cdc/", env!("CARGO_PKG_VERSION")))
            .default_headers(default_headers)
            .build()
            .map_err(|e| UpstreamError::Config(format!("building the http client failed: {e}")))?;
        let token_id = token.fingerprint();
        Ok(Self {
            inner: Arc::new(Inner {
                http,
                opts,
                authorization,
                token,
                token_id,
                budget,
                bodies,
            }),
            lane: Lane::default(),
            hashing: None,
        })
    }

    /// The budget its listing bodies are held within.
    pub fn body_budget(&self) -> &Arc<BodyBudget> {
        &self.inner.bodies
    }

    /// The options the client was built with.
    pub fn options(&self) -> &ClientOptions {
        &self.inner.opts
    }

    /// The same client, its requests waiting in `lane` of the budget.
    pub fn in_lane(&self, lane: Lane) -> Self {
        Self {
            lane,
            ..self.clone()
        }
    }

    /// The same client, hashing (or printing) every listed record as
    /// `hashing` says in the pass that reads its page (see [`decode_page_hashed`]).
    pub fn hashing(&self, hashing: Hashing) -> Self {
        Self {
            hashing: Some(hashing),
            ..self.clone()
        }
    }

    /// The rate budget this client spends.
    pub fn budget(&self) -> &Arc<RateBudget> {
        &self.inner.budget
    }

    /// The non-secret fingerprint of the client's token.
    pub fn token_id(&self) -> &str {
        &self.inner.token_id
    }

    /// `GET /tenants/{tenant}/catalog/vouchers/{id}`: one catalog voucher.
    pub async fn get_voucher(&self, tenant: TenantId, id: i64) -> Result<Record, UpstreamError> {
        self.get_one(tenant, "vouchers", id).await
    }

    /// `GET /tenants/{tenant}/catalog/categories/{id}`: one catalog category.
    pub async fn get_category(&self, tenant: TenantId, id: i64) -> Result<Record, UpstreamError> {
        self.get_one(tenant, "categories", id).await
    }

    /// One list request (with its retries): `GET /tenants/{tenant}/catalog/{resource}` with `q`.
    pub async fn list_page(
        &self,
        tenant: TenantId,
        resource: Resource,
        q: &ListQuery,
    ) -> Result<Page, UpstreamError> {
        let tenant_segment = tenant.to_string();
        let (mut url, path) =
            self.endpoint(&["tenants", &tenant_segment, "catalog", resource.as_str()]);
        let pairs = q.pairs(resource);
        if !pairs.is_empty() {
            url.query_pairs_mut().extend_pairs(pairs);
        }
        let endpoint = match resource {
            Resource::Vouchers => "/tenants/{tenant}/catalog/vouchers",
            Resource::Categories => "/tenants/{tenant}/catalog/categories",
        };
        let call = Call {
            holds_body: true,
            ..self.get_call(tenant, resource.as_str(), endpoint, url, path)
        };
        let (
            DecodedPage {
                mut page,
                skipped_records,
            },
            share,
        ) = match &self.hashing {
            Some(hashing) => {
                self.execute_holding(&call, |body| decode_page_hashed(body, hashing))
                    .await?
            }
            None => self.execute_holding(&call, decode_page).await?,
        };
        page.body = share;
        for skipped in &skipped_records {
            tracing::warn!(
                tenant,
                resource = resource.as_str(),
                position = skipped.position,
                cursor = q.cursor.as_deref().unwrap_or(""),
                reason = %skipped.reason,
                "skipping a listed record without a usable integer id"
            );
        }
        // Pages and records seen are counted by the sweep; skips only the client can see.
        if !skipped_records.is_empty() {
            metrics::counter!(
                metric::RECORDS_SKIPPED,
                "tenant" => tenant.to_string(),
                "resource" => resource.as_str()
            )
            .increment(skipped_records.len() as u64);
        }
        Ok(page)
    }

    /// `POST /tenants/{tenant}/redemptions`: the redemption result (`data`); retried only on 429.
    pub async fn redeem(
        &self,
        tenant: TenantId,
        req: &RedeemRequest,
    ) -> Result<serde_json::Value, UpstreamError> {
        let body = serde_json::to_vec(req).map_err(|e| {
            UpstreamError::Config(format!("encoding the redeem request failed: {e}"))
        })?;
        let tenant_segment = tenant.to_string();
        let (url, path) = self.endpoint(&["tenants", &tenant_segment, "redemptions"]);
        let call = Call {
            tenant,
            resource: "redemptions",
            method: Method::POST,
            url,
            path,
            endpoint: "/tenants/{tenant}/redemptions",
            body: Some(Bytes::from(body)),
            policy: RetryPolicy::RateLimitOnly,
            holds_body: false,
        };
        self.execute(&call, |body| {
            #[derive(Deserialize)]
            struct Envelope {
                data: serde_json::Value,
            }
            serde_json::from_slice::<Envelope>(body)
                .map(|envelope| envelope.data)
                .map_err(|e| format!("body is not a redemption envelope: {e}"))
        })
        .await
    }

    /// One `GET .../catalog/{resource}/{id}` returning `{"data": record}`.
    async fn get_one(
        &self,
        tenant: TenantId,
        resource: &'static str,
        id: i64,
    ) -> Result<Record, UpstreamError> {
        let tenant_segment = tenant.to_string();
        let id_segment = id.to_string();
        let (url, path) =
            self.endpoint(&["tenants", &tenant_segment, "catalog", resource, &id_segment]);
        let endpoint = match resource {
            "vouchers" => "/tenants/{tenant}/catalog/vouchers/{id}",
            _ => "/tenants/{tenant}/catalog/categories/{id}",
        };
        let call = self.get_call(tenant, resource, endpoint, url, path);
        self.execute(&call, |body| {
            #[derive(Deserialize)]
            struct Envelope<'a> {
                #[serde(borrow)]
                data: &'a RawValue,
            }
            let envelope: Envelope<'_> = serde_json::from_slice(body)
                .map_err(|e| format!("body is not a single-record envelope: {e}"))?;
            decode_record_in(body, envelope.data).map_err(|skip| format!("the record {skip}"))
        })
        .await
    }

    /// A retried GET of `url`.
    fn get_call(
        &self,
        tenant: TenantId,
        resource: &'static str,
        endpoint: &'static str,
        url: Url,
        path: String,
    ) -> Call {
        Call {
            tenant,
            resource,
            method: Method::GET,
            url,
            path,
            endpoint,
            body: None,
            policy: RetryPolicy::Idempotent,
            holds_body: false,
        }
    }

    /// The URL of `segments` below the base URL, and its path for messages (`/tenants/3/catalog/vouchers`).
    fn endpoint(&self, segments: &[&str]) -> (Url, String) {
        let mut url = self.inner.opts.base_url.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(segments);
        }
        (url, format!("/{}", segments.join("/")))
    }

    /// Runs `call` until it succeeds, fails for good, or uses up its attempts; `decode` turns a 2xx body into the result.
    async fn execute<T>(
        &self,
        call: &Call,
        decode: impl Fn(&Bytes) -> Result<T, String>,
    ) -> Result<T, UpstreamError> {
        let (value, _share) = self.execute_holding(call, decode).await?;
        Ok(value)
    }

    /// [`Self::execute`], with the body's share of the [`BodyBudget`] (a
    /// listing page's; none for other calls).
    async fn execute_holding<T>(
        &self,
        call: &Call,
        decode: impl Fn(&Bytes) -> Result<T, String>,
    ) -> Result<(T, BodyShare), UpstreamError> {
        let opts = &self.inner.opts;
        let max_attempts = opts.max_attempts.max(1);
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            self.inner.budget.acquire_in(self.lane).await;
            let failure = match self.send_once(call).await {
                Ok((body, share)) => match decode(&body) {
                    Ok(value) => return Ok((value, share)),
                    Err(reason) => {
                        let err = UpstreamError::InvalidResponse {
                            path: call.path.clone(),
                            reason,
                        };
                        Failure::Retriable(err, "body")
                    }
                },
                Err(failure) => failure,
            };
            let (err, reason, wait) = match failure {
                Failure::Final(err) => return Err(err),
                Failure::Retriable(err, _) if call.policy == RetryPolicy::RateLimitOnly => {
                    return Err(err)
                }
                Failure::RateLimited(err, wait) => {
                    metrics::counter!(metric::UPSTREAM_RATE_LIMITED, "token_id" => self.inner.token_id.clone())
                        .increment(1);
                    // Every stream on this token waits, not just this one, and
                    // the budget learns that the upstream grants it less.
                    self.inner.budget.pause_for(wait);
                    self.inner.budget.rate_limited();
                    (err, "429", Duration::ZERO)
                }
                Failure::Retriable(err, reason) => {
                    let wait = backoff_delay(
                        attempt,
                        opts.backoff_initial,
                        opts.backoff_max,
                        rand::random::<f64>(),
                    );
                    (err, reason, wait)
                }
            };
            if attempt >= max_attempts {
                tracing::warn!(
                    tenant = call.tenant,
                    resource = call.resource,
                    path = %call.path,
                    attempts = attempt,
                    error = %err,
                    "upstream request failed; giving up"
                );
                return Err(UpstreamError::Exhausted {
                    path: call.path.clone(),
                    attempts: attempt,
                    last_status: err.status(),
                    last: err.to_string(),
                });
            }
            metrics::counter!(
                metric::UPSTREAM_RETRIES,
                "tenant" => call.tenant.to_string(),
                "resource" => call.resource,
                "reason" => reason
            )
            .increment(1);
            tracing::warn!(
                tenant = call.tenant,
                resource = call.resource,
                path = %call.path,
                attempt,
                reason,
                backoff = %crate::telemetry::human_duration(wait),
                error = %err,
                "upstream request failed; retrying"
            );
            if !wait.is_zero() {
                tokio::time::sleep(wait).await;
            }
        }
    }

    /// One attempt: send, read the whole body, classify the status. The
    /// attempt's `timeout` covers the request and the body, not the wait of
    /// a listing page's body for its share of the [`BodyBudget`] between them.
    async fn send_once(&self, call: &Call) -> Result<(Bytes, BodyShare), Failure> {
        let mut request = self
            .inner
            .http
            .request(call.method.clone(), call.url.clone())
            .header(AUTHORIZATION, self.inner.authorization.clone());
        if let Some(body) = &call.body {
            request = request
                .header(CONTENT_TYPE, "application/json")
                .body(body.clone());
        }
        let timeout = self.inner.opts.timeout;
        let started = std::time::Instant::now();
        let sent = match tokio::time::timeout(timeout, request.send()).await {
            Ok(sent) => sent.map_err(|e| self.transport_failure(call, &e)),
            Err(_elapsed) => Err(self.timeout_failure(call)),
        };
        let response = match sent {
            Ok(response) => response,
            Err(failure) => {
                self.count_request(call, "error");
                observe_duration(call, "error", started);
                return Err(failure);
            }
        };
        let status = response.status();
        self.count_request(call, status.as_str());
        tracing::debug!(
            tenant = call.tenant,
            resource = call.resource,
            method = %call.method,
            path = %call.path,
            status = status.as_u16(),
            "upstream response"
        );
        let retry_after = response
            .headers()
            .get(RETRY_AFTER)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        let (share, started) = if call.holds_body && status.is_success() {
            let waiting = std::time::Instant::now();
            let share = self.share_for(call, response.content_length()).await;
            // The wait is not the upstream's time: neither timed nor observed.
            (share, started + waiting.elapsed())
        } else {
            (BodyShare::default(), started)
        };
        let left = timeout.saturating_sub(started.elapsed());
        let body = match tokio::time::timeout(left, read_body(response)).await {
            Ok(body) => body.map_err(|e| self.transport_failure(call, &e)),
            Err(_elapsed) => Err(self.timeout_failure(call)),
        };
        observe_duration(
            call,
            if body.is_ok() {
                status.as_str()
            } else {
                "error"
            },
            started,
        );
        if status.is_success() {
            return body.map(|body| (body, share));
        }
        // An unreadable error body still leaves the status to act on.
        let body = body.unwrap_or_default();
        Err(self.status_failure(call, status, &body, retry_after.as_deref()))
    }

    /// Counts one attempt under `upstream_requests_total`.
    fn count_request(&self, call: &Call, status: &str) {
        metrics::counter!(
            metric::UPSTREAM_REQUESTS,
            "tenant" => call.tenant.to_string(),
            "resource" => call.resource,
            "status" => status.to_owned()
        )
        .increment(1);
    }

    /// Maps a non-success status to a typed error and whether to retry it.
    fn status_failure(
        &self,
        call: &Call,
        status: StatusCode,
        body: &[u8],
        retry_after: Option<&str>,
    ) -> Failure {
        let ErrorBody { message, errors } = parse_error_body(status, body);
        let message = self.scrub(&message);
        let path = call.path.clone();
        match status.as_u16() {
            401 => Failure::Final(UpstreamError::Unauthorized { path, message }),
            403 => Failure::Final(UpstreamError::Forbidden { path, message }),
            404 => Failure::Final(UpstreamError::NotFound { path, message }),
            422 => {
                let errors = errors
                    .into_iter()
                    .map(|(field, messages)| {
                        let messages = messages.iter().map(|m| self.scrub(m)).collect();
                        (self.scrub(&field), messages)
                    })
                    .collect();
                Failure::Final(UpstreamError::Validation {
                    path,
                    message,
                    errors,
                })
            }
            429 => {
                let opts = &self.inner.opts;
                let wait = retry_after
                    .and_then(|value| parse_retry_after(value, Utc::now()))
                    .unwrap_or(opts.rate_limit_window)
                    .min(opts.retry_after_max);
                Failure::RateLimited(
                    UpstreamError::RateLimited {
                        path,
                        message,
                        retry_after: wait,
                    },
                    wait,
                )
            }
            code @ (500..=599 | 408) => Failure::Retriable(
                UpstreamError::Server {
                    status: code,
                    path,
                    message,
                },
                "5xx",
            ),
            code => Failure::Final(UpstreamError::UnexpectedStatus {
                status: code,
                path,
                message,
            }),
        }
    }

    /// Maps a reqwest error (no URL, no headers in the text) to a failure:
    /// retriable, except a refused TLS certificate.
    fn transport_failure(&self, call: &Call, err: &reqwest::Error) -> Failure {
        let path = call.path.clone();
        if let Some(refused) = refused_certificate(err, self.inner.opts.ca.as_ref()) {
            return Failure::Final(UpstreamError::Tls {
                origin: self.inner.opts.base_url.origin().ascii_serialization(),
                path,
                reason: refused.reason,
                hint: refused.hint,
            });
        }
        if err.is_timeout() {
            return self.timeout_failure(call);
        }
        let root = root_cause(err);
        if err.is_body() || err.is_decode() {
            let reason = format!("the body could not be read: {root}");
            return Failure::Retriable(UpstreamError::InvalidResponse { path, reason }, "body");
        }
        let what = if err.is_connect() {
            "connecting failed"
        } else {
            "sending the request failed"
        };
        let reason = format!("{what}: {root}");
        Failure::Retriable(UpstreamError::Transport { path, reason }, "connect")
    }

    /// A listing body's share of the [`BodyBudget`]: sized by its
    /// `Content-Length`, the whole budget when it has none (read alone). It
    /// waits at most one `timeout`, then the body is read without a share:
    /// a response left unread longer may be cut by the upstream, and the
    /// shares are held up only by other streams' publishing (a stalled sink).
    async fn share_for(&self, call: &Call, content_length: Option<u64>) -> BodyShare {
        let bytes = content_length.unwrap_or(u64::MAX);
        let timeout = self.inner.opts.timeout;
        match tokio::time::timeout(timeout, self.inner.bodies.hold(bytes)).await {
            Ok(share) => share,
            Err(_elapsed) => {
                tracing::warn!(
                    tenant = call.tenant,
                    resource = call.resource,
                    path = %call.path,
                    content_length = ?content_length,
                    held_bytes = self.inner.bodies.held_bytes(),
                    waited = %crate::telemetry::human_duration(timeout),
                    "reading a listing body beyond the body budget: no share came in time"
                );
                BodyShare::default()
            }
        }
    }

    /// An attempt that outlived `timeout`: retriable.
    fn timeout_failure(&self, call: &Call) -> Failure {
        let (path, after) = (call.path.clone(), self.inner.opts.timeout);
        Failure::Retriable(UpstreamError::Timeout { path, after }, "timeout")
    }

    /// Removes the token from upstream-provided text, in case the upstream echoes it
    /// (tokens shorter than `MIN_SCRUBBED_TOKEN_CHARS` would mangle ordinary words).
    fn scrub(&self, text: &str) -> String {
        let token = self.inner.token.expose();
        if token.len() < MIN_SCRUBBED_TOKEN_CHARS || !text.contains(token) {
            return text.to_owned();
        }
        text.replace(token, "***")
    }
}

/// The innermost error of a reqwest error's source chain, as text.
fn root_cause(err: &reqwest::Error) -> String {
    let mut cause: &dyn std::error::Error = err;
    while let Some(source) = cause.source() {
        cause = source;
    }
    one_line(&cause.to_string())
}

/// Most bytes a `Content-Length` makes [`read_body`] allocate before any arrived.
const MAX_PREALLOCATED_BODY: u64 = 64 << 20;

/// The whole body, in one buffer sized by `Content-Length` as the chunks
/// arrive (each chunk freed once copied). `Response::bytes` gathers every
/// chunk first and copies them into one buffer at the end: twice the body in
/// memory at once, 11 MB for a page of 50 categories with their products.
async fn read_body(mut response: reqwest::Response) -> Result<Bytes, reqwest::Error> {
    let expected = response.content_length().unwrap_or(0);
    let mut body = bytes::BytesMut::with_capacity(expected.min(MAX_PREALLOCATED_BODY) as usize);
    while let Some(chunk) = response.chunk().await? {
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

/// The parts of an upstream error body.
struct ErrorBody {
    /// `message`, or a body excerpt, or the status reason.
    message: String,
    /// `errors` of a validation body.
    errors: BTreeMap<String, Vec<String>>,
}

/// Reads `message` and `errors` from an error body, tolerating anything.
fn parse_error_body(status: StatusCode, body: &[u8]) -> ErrorBody {
    #[derive(Deserialize)]
    struct Wire {
        #[serde(default)]
        message: Option<serde_json::Value>,
        #[serde(default)]
        errors: Option<serde_json::Value>,
    }
    let fallback = || {
        let text = String::from_utf8_lossy(body);
        let text = one_line(&text);
        if text.is_empty() {
            status
                .canonical_reason()
                .unwrap_or("no message")
                .to_lowercase()
        } else {
            text
        }
    };
    let Ok(wire) = serde_json::from_slice::<Wire>(body) else {
        return ErrorBody {
            message: fallback(),
            errors: BTreeMap::new(),
        };
    };
    let message = match wire.message {
        Some(serde_json::Value::String(text)) if !text.trim().is_empty() => one_line(&text),
        Some(serde_json::Value::Null) | None => fallback(),
        Some(other) => one_line(&other.to_string()),
    };
    let errors = match wire.errors {
        Some(serde_json::Value::Object(fields)) => fields
            .into_iter()
            .map(|(field, messages)| (field, value_strings(messages)))
            .collect(),
        _ => BTreeMap::new(),
    };
    ErrorBody { message, errors }
}

/// A JSON value as a list of one-line strings (arrays item by item).
fn value_strings(value: serde_json::Value) -> Vec<String> {
    match value {
        serde_json::Value::Array(items) => items.into_iter().flat_map(value_strings).collect(),
        serde_json::Value::String(text) => vec![one_line(&text)],
        serde_json::Value::Null => Vec::new(),
        other => vec![one_line(&other.to_string())],
    }
}

/// Collapses whitespace to single spaces and cuts at `MAX_MESSAGE_CHARS` characters.
fn one_line(text: &str) -> String {
    let mut out = String::new();
    for (i, word) in text.split_whitespace().enumerate() {
        if i > 0 {
            out.push(' ');
        }
        out.push_str(word);
    }
    if out.chars().count() > MAX_MESSAGE_CHARS {
        out = out.chars().take(MAX_MESSAGE_CHARS).collect();
        out.push('…');
    }
    out
}

/// Records how long one attempt took under the request duration histogram.
fn observe_duration(call: &Call, status: &str, started: std::time::Instant) {
    metrics::histogram!(
        metric::UPSTREAM_REQUEST_DURATION,
        "endpoint" => call.endpoint,
        "status" => status.to_owned()
    )
    .record(started.elapsed().as_secs_f64());
}

/// The wait a `Retry-After` value asks for: delay-seconds or an HTTP date (a past date is zero).
pub fn parse_retry_after(value: &str, now: DateTime<Utc>) -> Option<Duration> {
    let value = value.trim();
    if value.is_empty() {
        return None;
    }
    if value.bytes().all(|b| b.is_ascii_digit()) {
        return Some(Duration::from_secs(
            value.parse::<u64>().unwrap_or(u64::MAX),
        ));
    }
    if let Ok(seconds) = value.parse::<f64>() {
        // Not RFC 9110, but some servers send fractions; a negative or NaN value is unusable.
        return (seconds.is_finite() && seconds >= 0.0)
            .then(|| Duration::try_from_secs_f64(seconds).unwrap_or(Duration::MAX));
    }
    let at = parse_http_date(value)?;
    Some((at - now).to_std().unwrap_or(Duration::ZERO))
}

/// Parses the three HTTP-date forms of RFC 9110 (IMF-fixdate, RFC 850, asctime).
fn parse_http_date(value: &str) -> Option<DateTime<Utc>> {
    if let Ok(at) = DateTime::parse_from_rfc2822(value) {
        return Some(at.with_timezone(&Utc));
    }
    ["%A, %d-%b-%y %H:%M:%S GMT", "%a %b %e %H:%M:%S %Y"]
        .iter()
        .find_map(|format| NaiveDateTime::parse_from_str(value, format).ok())
        .map(|naive| naive.and_utc())
}

/// Backoff before attempt `attempt + 1`: `initial * 2^(attempt-1)` capped at `max`, jittered into its upper half by `unit` in [0, 1).
pub fn backoff_delay(attempt: u32, initial: Duration, max: Duration, unit: f64) -> Duration {
    let exponent = attempt.saturating_sub(1).min(31);
    let base = initial.saturating_mul(1u32 << exponent).min(max);
    let unit = if unit.is_finite() {
        unit.clamp(0.0, 1.0)
    } else {
        0.0
    };
    base / 2 + base.mul_f64(unit / 2.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn client(token: &str) -> UpstreamClient {
        UpstreamClient::new(
            ClientOptions::default(),
            SecretToken::new(token),
            Arc::new(RateBudget::new(0)),
        )
        .unwrap()
    }

    #[test]
    fn secret_token_prints_as_stars_everywhere() {
        let token = SecretToken::new("s3cr3t-value");
        assert_eq!(format!("{token:?}"), crate::secret::REDACTED);
        assert_eq!(format!("{token}"), crate::secret::REDACTED);
        assert_eq!(token.expose(), "s3cr3t-value");
        assert_eq!(token.fingerprint().len(), 8);
        let debug = format!("{:?}", client("s3cr3t-value"));
        assert!(!debug.contains("s3cr3t"), "{debug}");
    }

    #[test]
    fn retry_after_accepts_seconds_and_every_http_date_form() {
        let now = Utc.with_ymd_and_hms(1994, 11, 6, 8, 49, 0).unwrap();
        assert_eq!(parse_retry_after("7", now), Some(Duration::from_secs(7)));
        assert_eq!(parse_retry_after(" 0 ", now), Some(Duration::ZERO));
        assert_eq!(
            parse_retry_after("1.5", now),
            Some(Duration::from_millis(1500))
        );
        for date in [
            "Sun, 06 Nov 1994 08:49:37 GMT",
            "Sunday, 06-Nov-94 08:49:37 GMT",
            "Sun Nov  6 08:49:37 1994",
        ] {
            assert_eq!(
                parse_retry_after(date, now),
                Some(Duration::from_secs(37)),
                "{date}"
            );
        }
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("-3", now), None);
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(parse_retry_after("", now), None);
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_and_jitters_within_the_upper_half() {
        let initial = Duration::from_millis(500);
        let max = Duration::from_secs(30);
        assert_eq!(
            backoff_delay(1, initial, max, 1.0),
            Duration::from_millis(500)
        );
        assert_eq!(
            backoff_delay(1, initial, max, 0.0),
            Duration::from_millis(250)
        );
        assert_eq!(backoff_delay(3, initial, max, 1.0), Duration::from_secs(2));
        assert_eq!(backoff_delay(10, initial, max, 1.0), max);
        assert_eq!(
            backoff_delay(u32::MAX, initial, max, 0.5),
            Duration::from_millis(22_500)
        );
        assert_eq!(
            backoff_delay(2, initial, max, f64::NAN),
            Duration::from_millis(500)
        );
    }

    #[test]
    fn error_bodies_yield_message_and_field_errors_whatever_their_shape() {
        let body = br#"{"message":"The given data was invalid.","errors":{"voucher_id":["must be an integer"],"amount":"required"}}"#;
        let parsed = parse_error_body(StatusCode::UNPROCESSABLE_ENTITY, body);
        assert_eq!(parsed.message, "The given data was invalid.");
        assert_eq!(parsed.errors["voucher_id"], vec!["must be an integer"]);
        assert_eq!(parsed.errors["amount"], vec!["required"]);

        let html = parse_error_body(StatusCode::BAD_GATEWAY, b"<html>\n bad\tgateway </html>");
        assert_eq!(html.message, "<html> bad gateway </html>");
        let empty = parse_error_body(StatusCode::FORBIDDEN, b"");
        assert_eq!(empty.message, "forbidden");
        let long = "x".repeat(1000);
        let cut = parse_error_body(StatusCode::NOT_FOUND, long.as_bytes());
        assert_eq!(cut.message.chars().count(), MAX_MESSAGE_CHARS + 1);
    }

    #[test]
    fn endpoint_keeps_the_base_path_and_reports_the_relative_one() {
        let c = client("t");
        let (url, path) = c.endpoint(&["tenants", "3", "catalog", "vouchers"]);
        assert_eq!(
            url.as_str(),
            "http://127.0.0.1:8080/api/external/v1/tenants/3/catalog/vouchers"
        );
        assert_eq!(path, "/tenants/3/catalog/vouchers");
    }

    #[test]
    fn bad_options_and_tokens_are_refused_with_the_cause() {
        let budget = Arc::new(RateBudget::new(0));
        let opts = ClientOptions {
            base_url: Url::parse("ftp://example.com/api").unwrap(),
            ..ClientOptions::default()
        };
        let err = UpstreamClient::new(opts, SecretToken::new("t"), budget.clone()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid upstream client configuration: base_url scheme `ftp` is not supported: valid options are http, https"
        );
        let err = UpstreamClient::new(
            ClientOptions::default(),
            SecretToken::new("bad\ntoken"),
            budget.clone(),
        )
        .unwrap_err();
        assert!(!err.to_string().contains("bad"), "{err}");
        let with_credentials = ClientOptions {
            base_url: Url::parse("https://user:pw@example.com/api").unwrap(),
            ..ClientOptions::default()
        };
        let err = UpstreamClient::new(with_credentials, SecretToken::new("t"), budget.clone())
            .unwrap_err();
        assert!(!err.to_string().contains("pw"), "{err}");
        let err = UpstreamClient::new(ClientOptions::default(), SecretToken::new(" "), budget)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid upstream client configuration: the upstream token is empty"
        );
    }

    #[test]
    fn upstream_text_that_echoes_the_token_is_scrubbed() {
        let c = client("tok-12345");
        assert_eq!(c.scrub("bad token tok-12345 given"), "bad token *** given");
        assert_eq!(client("t").scrub("text"), "text");
    }
}
