//! A faithful in-process simulator of the External Voucher API.
//!
//! It exists so the bridge can be developed, tested and benchmarked without
//! the real service: `voucher-cdc simulate` serves it over HTTP, and tests
//! start it in-process with [`Simulator::start`], mutate its records, inject
//! faults and read its request log.

mod cursor;
mod data;
mod http;
mod journal;
mod listing;
pub mod model;
mod mutator;
mod query;
mod redeem;
mod state;
mod store;
mod tls;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{DateTime, Utc};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::stream::{Resource, TenantId};
use model::RedemptionVoucher;

pub use state::token_fingerprint;
pub use store::RecordValue;
pub use tls::TlsIdentity;

/// API path prefix every endpoint lives under.
pub const API_PREFIX: &str = "/api/external/v1";

/// Fixed page size of list operations.
pub const PAGE_SIZE: usize = 50;

fn parse_fraction(text: &str) -> Result<f64, String> {
    let rate: f64 = text
        .parse()
        .map_err(|_| format!("`{text}` is not a number; use a fraction between 0 and 1"))?;
    if (0.0..=1.0).contains(&rate) {
        Ok(rate)
    } else {
        Err(format!("`{text}` is outside 0..=1"))
    }
}

fn parse_skew(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(skew) if skew.is_finite() && (0.0..=10.0).contains(&skew) => Ok(skew),
        _ => Err(format!(
            "`{text}` is not a Zipf exponent between 0 and 10 (0 = uniform)"
        )),
    }
}

fn parse_rate_window(text: &str) -> Result<Duration, String> {
    match humantime::parse_duration(text) {
        Ok(window) if !window.is_zero() => Ok(window),
        Ok(_) => Err(format!("`{text}` is not a positive duration")),
        Err(e) => Err(format!("`{text}` is not a duration (e.g. 60s, 500ms): {e}")),
    }
}

fn parse_tenants(text: &str) -> Result<u64, String> {
    match text.parse::<u64>() {
        Ok(n) if (1..=10_000).contains(&n) => Ok(n),
        _ => Err(format!(
            "`{text}` is not a tenant count between 1 and 10000"
        )),
    }
}

/// A fault in how list operations page, in force until cleared: what an
/// upstream with a pagination bug looks like to the bridge, so tests can
/// check that a sweep always ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ListingFault {
    /// `next_cursor` goes first page → A → B → A → B … and is never null:
    /// a cursor cycle (each cursor is genuine and signed; the pages under
    /// A and B are the second and third pages of the listing).
    #[value(name = "cycle")]
    CursorCycle,
    /// `next_cursor` is never null: the listing pages normally to its real
    /// end, then every further page repeats the listing's first page under
    /// a fresh cursor never issued before, forever.
    #[value(name = "endless")]
    Endless,
}

/// A record padded to a minimum JSON size (`--oversize`), e.g. to exceed a
/// broker's maximum payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Oversize {
    /// The tenant.
    pub tenant: TenantId,
    /// The resource.
    pub resource: Resource,
    /// The record id.
    pub id: i64,
    /// Minimum length of the record's JSON in bytes.
    pub bytes: usize,
}

impl std::str::FromStr for Oversize {
    type Err = String;

    /// `TENANT:ID:BYTES` (a voucher) or `TENANT:RESOURCE:ID:BYTES`.
    fn from_str(text: &str) -> Result<Self, String> {
        let parts: Vec<&str> = text.split(':').collect();
        let (tenant, resource, id, bytes) = match parts.as_slice() {
            [tenant, id, bytes] => (*tenant, "vouchers", *id, *bytes),
            [tenant, resource, id, bytes] => (*tenant, *resource, *id, *bytes),
            _ => {
                return Err(format!(
                    "`{text}` is not TENANT:ID:BYTES or TENANT:RESOURCE:ID:BYTES (e.g. 1:7:2000000)"
                ))
            }
        };
        let tenant = tenant
            .parse()
            .map_err(|_| format!("`{tenant}` in `{text}` is not a tenant number"))?;
        let resource = resource.parse().map_err(|e| format!("{e} (in `{text}`)"))?;
        let id = id
            .parse()
            .map_err(|_| format!("`{id}` in `{text}` is not a record id"))?;
        let bytes = bytes
            .parse()
            .map_err(|_| format!("`{bytes}` in `{text}` is not a byte count"))?;
        Ok(Oversize {
            tenant,
            resource,
            id,
            bytes,
        })
    }
}

/// Flags of `voucher-cdc simulate`.
#[derive(clap::Args, Debug, Clone)]
pub struct SimulateArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Number of tenants, numbered 1..=N.
    #[arg(long, default_value_t = 3, value_parser = parse_tenants)]
    pub tenants: u64,
    /// Catalog vouchers per tenant.
    #[arg(long, default_value_t = 200)]
    pub vouchers: usize,
    /// Catalog categories per tenant.
    #[arg(long, default_value_t = 20)]
    pub categories: usize,
    /// Background changes per minute over all tenants (0 = none).
    #[arg(long, default_value_t = 0)]
    pub changes_per_minute: u32,
    /// Zipf exponent of the tenant a background change lands on (0 = uniform; tenant 1 hottest).
    #[arg(long, default_value_t = 0.0, value_parser = parse_skew)]
    pub change_skew: f64,
    /// Share of tenants (the highest-numbered) that never change (0..=1).
    #[arg(long, default_value_t = 0.0, value_parser = parse_fraction)]
    pub idle_tenants: f64,
    /// Date the records' `updated_at` as if the background changes had run this long before
    /// the start (e.g. `6h`), so the catalog carries a live one's change history.
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    pub change_history: Duration,
    /// Share of the initial records dated at one bulk-import instant (0..=1). They list in
    /// id order among themselves, so 1 makes a first sync list a catalog in id order (after
    /// the few vouchers without `updated_at`), as an API fed by one bulk import would.
    #[arg(long, default_value_t = data::BULK_IMPORT_SHARE, value_parser = parse_fraction)]
    pub bulk_import_share: f64,
    /// Seed of the generated data and of the background changes.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Bearer token granting every permission on every tenant.
    #[arg(long, default_value = "sim-token")]
    pub token: String,
    /// Requests per minute per token and client IP (0 = unlimited).
    #[arg(long, default_value_t = 120)]
    pub rate_limit: u32,
    /// The window `--rate-limit` counts in (a fixed window per token and IP from its first request).
    #[arg(long, default_value = "60s", value_parser = parse_rate_window)]
    pub rate_window: Duration,
    /// Fraction of requests answered with an injected 5xx (0..=1).
    #[arg(long, default_value_t = 0.0, value_parser = parse_fraction)]
    pub fail_rate: f64,
    /// Delay added to every response (e.g. `50ms`).
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    pub latency: Duration,
    /// Pagination fault on every listing: `cycle` (next_cursor A→B→A…) or `endless` (never null).
    #[arg(long, value_enum)]
    pub listing_fault: Option<ListingFault>,
    /// Pad a record's description_html so its JSON is at least BYTES long:
    /// `TENANT:ID:BYTES` (a voucher) or `TENANT:RESOURCE:ID:BYTES`; repeatable.
    #[arg(long, value_name = "TENANT:ID:BYTES")]
    pub oversize: Vec<Oversize>,
    /// Append one JSON line per background change to this file.
    #[arg(long, value_name = "FILE")]
    pub change_log: Option<PathBuf>,
    /// Append one JSON line per API request to this file.
    #[arg(long, value_name = "FILE")]
    pub request_log: Option<PathBuf>,
    /// Serve HTTPS with this PEM certificate chain (leaf first); needs `--tls-key`.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of `--tls-cert`.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

/// Options of an in-process simulator; see [`SimulateArgs`] for the meaning of shared fields.
#[derive(Debug, Clone)]
pub struct SimulatorOptions {
    /// Address to listen on (tests: `127.0.0.1:0`).
    pub listen: SocketAddr,
    /// Number of tenants, numbered 1..=N.
    pub tenants: u64,
    /// Catalog vouchers per tenant.
    pub vouchers: usize,
    /// Catalog categories per tenant.
    pub categories: usize,
    /// Background changes per minute over all tenants (0 = none).
    pub changes_per_minute: u32,
    /// Zipf exponent of the tenant a background change lands on (0 = uniform).
    pub change_skew: f64,
    /// Share of tenants (the highest-numbered) that never change.
    pub idle_tenants: f64,
    /// How long the background changes ran before the start (their `updated_at` history).
    pub change_history: Duration,
    /// Share of the initial records dated at one bulk-import instant (0..=1).
    pub bulk_import_share: f64,
    /// Seed of the generated data and background changes.
    pub seed: u64,
    /// Bearer token granting every permission on every tenant.
    pub token: String,
    /// Requests per minute per token and client IP (0 = unlimited).
    pub rate_limit: u32,
    /// The window the rate limit counts in (the flag is per minute: 60 s by default).
    pub rate_window: Duration,
    /// Fraction of requests answered with an injected 5xx.
    pub fail_rate: f64,
    /// Delay added to every response.
    pub latency: Duration,
    /// Whether 429 responses carry `Retry-After`.
    pub retry_after_header: bool,
    /// A listing fault on every stream from the start.
    pub listing_fault: Option<ListingFault>,
    /// Records padded to a minimum JSON size from the start.
    pub oversize: Vec<Oversize>,
    /// JSON-lines file receiving one line per background change.
    pub change_log: Option<PathBuf>,
    /// JSON-lines file receiving one line per API request.
    pub request_log: Option<PathBuf>,
    /// Serve HTTPS with this certificate and key instead of plain HTTP.
    pub tls: Option<TlsIdentity>,
}

impl Default for SimulatorOptions {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            tenants: 3,
            vouchers: 200,
            categories: 20,
            changes_per_minute: 0,
            change_skew: 0.0,
            idle_tenants: 0.0,
            change_history: Duration::ZERO,
            bulk_import_share: data::BULK_IMPORT_SHARE,
            seed: 42,
            token: "sim-token".to_string(),
            rate_limit: 120,
            rate_window: Duration::from_secs(60),
            fail_rate: 0.0,
            latency: Duration::ZERO,
            retry_after_header: true,
            listing_fault: None,
            oversize: Vec::new(),
            change_log: None,
            request_log: None,
            tls: None,
        }
    }
}

impl TryFrom<SimulateArgs> for SimulatorOptions {
    type Error = anyhow::Error;

    /// The options of the flags, reading `--tls-cert` and `--tls-key`.
    fn try_from(args: SimulateArgs) -> anyhow::Result<Self> {
        let tls = match (&args.tls_cert, &args.tls_key) {
            (Some(cert), Some(key)) => Some(TlsIdentity::from_files(cert, key)?),
            _ => None,
        };
        Ok(Self {
            listen: args.listen,
            tenants: args.tenants,
            vouchers: args.vouchers,
            categories: args.categories,
            changes_per_minute: args.changes_per_minute,
            change_skew: args.change_skew,
            idle_tenants: args.idle_tenants,
            change_history: args.change_history,
            bulk_import_share: args.bulk_import_share,
            seed: args.seed,
            token: args.token,
            rate_limit: args.rate_limit,
            rate_window: args.rate_window,
            fail_rate: args.fail_rate,
            latency: args.latency,
            retry_after_header: true,
            listing_fault: args.listing_fault,
            oversize: args.oversize,
            change_log: args.change_log,
            request_log: args.request_log,
            tls,
        })
    }
}

/// A permission a bearer token can hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Permission {
    /// `view_vouchers`: list and get catalog vouchers.
    ViewVouchers,
    /// `view_categories`: list and get catalog categories.
    ViewCategories,
    /// `redeem_vouchers`: POST redemptions.
    RedeemVouchers,
}

impl Permission {
    /// Every permission.
    pub const ALL: [Permission; 3] = [
        Permission::ViewVouchers,
        Permission::ViewCategories,
        Permission::RedeemVouchers,
    ];

    /// The permission's name in the spec.
    pub fn as_str(self) -> &'static str {
        match self {
            Permission::ViewVouchers => "view_vouchers",
            Permission::ViewCategories => "view_categories",
            Permission::RedeemVouchers => "redeem_vouchers",
        }
    }

    fn bit(self) -> u8 {
        match self {
            Permission::ViewVouchers => 1,
            Permission::ViewCategories => 2,
            Permission::RedeemVouchers => 4,
        }
    }
}

/// A fault consumed by the next matching request, in FIFO order.
#[derive(Debug, Clone, PartialEq)]
pub enum Fault {
    /// Answer with this status and a MessageError body (and `Retry-After` when given).
    Status {
        /// HTTP status code.
        status: u16,
        /// `Retry-After` header value.
        retry_after: Option<String>,
    },
    /// A 200 whose JSON body is cut in the middle (matches the next successful response).
    TruncatedBody,
    /// A 200 whose body is not JSON (matches the next successful response).
    MalformedJson,
    /// Wait this long before handling the request.
    Delay(Duration),
    /// The next list page carries one extra record whose id is missing (odd
    /// uses) or a string (even uses).
    RecordWithoutId,
    /// Close the connection without answering.
    DropConnection,
}

/// One request the simulator answered.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestLogEntry {
    /// When the request arrived.
    pub at: Instant,
    /// HTTP method.
    pub method: String,
    /// Request path.
    pub path: String,
    /// Raw query string.
    pub query: Option<String>,
    /// Response status; 0 when the connection was dropped without an answer.
    pub status: u16,
    /// Non-secret fingerprint of the bearer token ([`token_fingerprint`]), never the token.
    pub token_fingerprint: Option<String>,
}

/// Connections the simulator's listener queues before accepting them.
const LISTEN_BACKLOG: u32 = 1024;

/// A TCP socket bound to `addr` (with address reuse, as
/// `TcpListener::bind` sets it), not yet listening.
fn bind_socket(addr: SocketAddr) -> std::io::Result<tokio::net::TcpSocket> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    #[cfg(unix)]
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    Ok(socket)
}

/// A running simulator; dropping it without [`Simulator::shutdown`] stops it too.
pub struct Simulator {
    state: Arc<state::SimState>,
    addr: SocketAddr,
    /// Whether the listener speaks TLS (`https` base URL).
    tls: bool,
    token: String,
    cancel: CancellationToken,
    server: Option<JoinHandle<()>>,
    mutator: Option<JoinHandle<()>>,
}

impl Simulator {
    /// Generates the data, binds the listener and serves (plus the background
    /// mutator when `changes_per_minute > 0`).
    pub async fn start(opts: SimulatorOptions) -> anyhow::Result<Simulator> {
        if !(0.0..=1.0).contains(&opts.fail_rate) {
            anyhow::bail!("fail rate {} is outside 0..=1", opts.fail_rate);
        }
        if opts.tenants == 0 {
            anyhow::bail!("at least one tenant is required");
        }
        if !(0.0..=1.0).contains(&opts.idle_tenants) {
            anyhow::bail!("idle tenant share {} is outside 0..=1", opts.idle_tenants);
        }
        if !(0.0..=1.0).contains(&opts.bulk_import_share) {
            anyhow::bail!(
                "bulk import share {} is outside 0..=1",
                opts.bulk_import_share
            );
        }
        if !(opts.change_skew.is_finite() && opts.change_skew >= 0.0) {
            anyhow::bail!(
                "change skew {} is not a finite exponent >= 0",
                opts.change_skew
            );
        }
        if opts.rate_window.is_zero() {
            anyhow::bail!("the rate window must be longer than zero");
        }
        let open = |path: &Option<PathBuf>| path.as_deref().map(journal::Journal::open).transpose();
        let change_log = open(&opts.change_log)?;
        let request_log = open(&opts.request_log)?;
        let acceptor = opts.tls.as_ref().map(TlsIdentity::acceptor).transpose()?;
        // Bound now, so a taken address fails at once, but listening only
        // once the catalog is built: until then a client is refused (and
        // retries) instead of connecting and waiting, for half a minute with
        // a million records, for an answer its timeout may not allow. (Two
        // simulators started at once on one port may both bind, with address
        // reuse; the second then fails when it listens, after its build.)
        let socket = bind_socket(opts.listen)
            .with_context(|| format!("binding simulator listener on {}", opts.listen))?;
        let addr = socket
            .local_addr()
            .context("reading simulator listen address")?;
        let mut state = state::SimState::new(&opts);
        state.request_journal = request_log;
        let picker = mutator::TenantPicker::new(opts.tenants, opts.change_skew, opts.idle_tenants);
        let backdated = mutator::backdate(
            &state,
            &picker,
            opts.changes_per_minute,
            opts.change_history,
            opts.seed,
            state.clock.now(),
        );
        if backdated > 0 {
            tracing::info!(
                changes = backdated,
                history = %humantime::format_duration(opts.change_history),
                "simulator catalog dated with a change history"
            );
        }
        let state = Arc::new(state);
        let listener = socket
            .listen(LISTEN_BACKLOG)
            .with_context(|| format!("listening as the simulator on {addr}"))?;
        let cancel = CancellationToken::new();
        let tls = acceptor.is_some();
        let server = tokio::spawn(http::serve(
            listener,
            acceptor,
            state.clone(),
            cancel.clone(),
        ));
        let mutator = (opts.changes_per_minute > 0).then(|| {
            let plan = mutator::MutatorPlan {
                per_minute: opts.changes_per_minute,
                seed: opts.seed,
                picker,
                change_log,
            };
            tokio::spawn(mutator::run(state.clone(), plan, cancel.clone()))
        });
        Ok(Simulator {
            state,
            addr,
            tls,
            token: opts.token,
            cancel,
            server: Some(server),
            mutator,
        })
    }

    /// Base URL including the version prefix, e.g. `http://127.0.0.1:PORT/api/external/v1`
    /// (`https` when serving TLS).
    pub fn base_url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}{API_PREFIX}", self.addr)
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The all-powerful token of the options.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// Adds (or replaces) a token scoped to `tenants` (None = all) and `permissions`.
    pub fn add_token(
        &self,
        token: &str,
        tenants: Option<Vec<TenantId>>,
        permissions: &[Permission],
    ) {
        let bits = permissions.iter().fold(0u8, |acc, p| acc | p.bit());
        self.state.add_token(token, tenants, bits);
    }

    /// Creates a record stamped with the simulator clock; returns its id.
    pub fn create(&self, tenant: TenantId, resource: Resource) -> i64 {
        self.state.create(tenant, resource).unwrap_or(-1)
    }

    /// Changes a record's content and bumps its `updated_at`.
    pub fn update(&self, tenant: TenantId, resource: Resource, id: i64) -> bool {
        self.state.update(tenant, resource, id, true)
    }

    /// Changes a record's content without bumping `updated_at`.
    pub fn update_silently(&self, tenant: TenantId, resource: Resource, id: i64) -> bool {
        self.state.update(tenant, resource, id, false)
    }

    /// Bumps a record's `updated_at` without changing its content.
    pub fn touch(&self, tenant: TenantId, resource: Resource, id: i64) -> bool {
        let at = self.state.clock.mutation_time();
        self.state.set_updated_at(tenant, resource, id, Some(at))
    }

    /// Sets a record's `updated_at` to exactly `at` (ties, late commits, nulls).
    pub fn set_updated_at(
        &self,
        tenant: TenantId,
        resource: Resource,
        id: i64,
        at: Option<DateTime<Utc>>,
    ) -> bool {
        self.state.set_updated_at(tenant, resource, id, at)
    }

    /// Deletes a record.
    pub fn delete(&self, tenant: TenantId, resource: Resource, id: i64) -> bool {
        self.state.delete(tenant, resource, id)
    }

    /// Ids of a resource's records, ascending.
    pub fn record_ids(&self, tenant: TenantId, resource: Resource) -> Vec<i64> {
        self.state.record_ids(tenant, resource)
    }

    /// The exact bytes the list endpoint returns for a record, without
    /// relations or with all of them (`include=categories,variants` / `include=products`).
    pub fn record_json(
        &self,
        tenant: TenantId,
        resource: Resource,
        id: i64,
        include_relations: bool,
    ) -> Option<String> {
        let mask = if include_relations {
            query::full_include_mask(resource)
        } else {
            0
        };
        self.state.record_json(tenant, resource, id, mask)
    }

    /// Sets (Some) or clears (None) a listing fault on every stream; a
    /// stream's own fault ([`Simulator::set_listing_fault_for`]) wins.
    pub fn set_listing_fault(&self, fault: Option<ListingFault>) {
        self.state.set_listing_fault(None, fault);
    }

    /// Sets or clears the listing fault of one stream only.
    pub fn set_listing_fault_for(
        &self,
        tenant: TenantId,
        resource: Resource,
        fault: Option<ListingFault>,
    ) {
        self.state
            .set_listing_fault(Some((tenant, resource)), fault);
    }

    /// Pads a record's `description_html` so its JSON (listed and fetched,
    /// with or without relations) is at least `bytes` long, and keeps it so
    /// through later changes; 0 removes the padding. False when the record
    /// does not exist. The padding does not bump `updated_at`.
    pub fn set_oversize(
        &self,
        tenant: TenantId,
        resource: Resource,
        id: i64,
        bytes: usize,
    ) -> bool {
        self.state.set_oversize(tenant, resource, id, bytes)
    }

    /// A copy of a record's current version, to put back later with [`Simulator::restore`].
    pub fn snapshot(&self, tenant: TenantId, resource: Resource, id: i64) -> Option<RecordValue> {
        self.state.snapshot(tenant, resource, id)
    }

    /// Puts a [`Simulator::snapshot`] back: the record's content becomes
    /// exactly the snapshot's again (a revert), or the record is re-created
    /// with it when it was deleted since. Its `updated_at` is the snapshot's
    /// too, or a fresh mutation time with `bump`. False for an unknown tenant.
    pub fn restore(&self, tenant: TenantId, snapshot: &RecordValue, bump: bool) -> bool {
        self.state.restore(tenant, snapshot, bump)
    }

    /// Freezes the simulator clock at `now`, or returns it to real time with None.
    pub fn set_clock(&self, now: Option<DateTime<Utc>>) {
        self.state.clock.set(now);
    }

    /// The simulator clock's current time.
    pub fn now(&self) -> DateTime<Utc> {
        self.state.clock.now()
    }

    /// Queues a fault for the next matching request.
    pub fn push_fault(&self, fault: Fault) {
        self.state.push_fault(fault);
    }

    /// Sets the fraction of requests answered with an injected 5xx.
    pub fn set_fail_rate(&self, f: f64) {
        self.state.settings.set_fail_rate(f);
    }

    /// Sets the delay added to every response.
    pub fn set_latency(&self, d: Duration) {
        self.state.settings.set_latency(d);
    }

    /// Sets the per-minute budget per token and client IP (0 = unlimited).
    pub fn set_rate_limit(&self, per_minute: u32) {
        self.state.settings.set_rate_limit(per_minute);
    }

    /// Every request answered so far (bounded to the most recent 100,000).
    pub fn request_log(&self) -> Vec<RequestLogEntry> {
        self.state.request_log()
    }

    /// Forgets the request log.
    pub fn clear_request_log(&self) {
        self.state.clear_request_log();
    }

    /// The `redemption_token` the (not shown) resolve operation would return for a purchased voucher.
    pub fn redemption_token(&self, tenant: TenantId, purchased_id: i64) -> Option<String> {
        self.state.redemption_token(tenant, purchased_id)
    }

    /// Ids of a tenant's purchased vouchers (the redeemable side).
    pub fn purchased_voucher_ids(&self, tenant: TenantId) -> Vec<i64> {
        self.state.purchased_ids(tenant)
    }

    /// A purchased voucher as a redemption result would show it.
    pub fn purchased_voucher(
        &self,
        tenant: TenantId,
        purchased_id: i64,
    ) -> Option<RedemptionVoucher> {
        self.state.purchased_voucher(tenant, purchased_id)
    }

    /// Stops the server and the mutator and waits for them.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        for task in [self.server.take(), self.mutator.take()]
            .into_iter()
            .flatten()
        {
            let abort = task.abort_handle();
            if tokio::time::timeout(Duration::from_secs(5), task)
                .await
                .is_err()
            {
                abort.abort();
            }
        }
    }
}

impl Drop for Simulator {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Runs `voucher-cdc simulate` until `shutdown` completes.
pub async fn run(
    args: SimulateArgs,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let opts = SimulatorOptions::try_from(args)?;
    let (tenants, vouchers, categories) = (opts.tenants, opts.vouchers, opts.categories);
    let (rate_limit, rate_window, changes) =
        (opts.rate_limit, opts.rate_window, opts.changes_per_minute);
    let (change_skew, idle_tenants) = (opts.change_skew, opts.idle_tenants);
    let listing_fault = opts.listing_fault;
    let oversize = opts.oversize.len();
    let simulator = Simulator::start(opts).await?;
    tracing::info!(
        base_url = %simulator.base_url(),
        token = %simulator.token(),
        tenants,
        vouchers,
        categories,
        rate_limit,
        rate_window = %humantime::format_duration(rate_window),
        changes_per_minute = changes,
        change_skew,
        idle_tenants,
        ?listing_fault,
        oversize_records = oversize,
        "simulator serving the External Voucher API"
    );
    shutdown.await;
    tracing::info!("simulator shutting down");
    simulator.shutdown().await;
    Ok(())
}
