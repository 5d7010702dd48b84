//! Shared simulator state: the clock, tenants' records, bearer tokens,
//! runtime settings, queued faults, the rate-limit windows and the request log.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use rand::rngs::StdRng;

use super::cursor::CursorCodec;
use super::data;
use super::journal::Journal;
use super::model::RedemptionVoucher;
use super::store::{RecordValue, TenantData};
use super::{Fault, ListingFault, RequestLogEntry, SimulatorOptions};
use crate::stream::{Resource, TenantId};

const LOG_CAPACITY: usize = 100_000;
const NOT_FROZEN: i64 = i64::MIN;

/// A non-secret fingerprint of a bearer token: 16 hex chars of its blake3 hash.
pub fn token_fingerprint(token: &str) -> String {
    hex::encode(&blake3::hash(token.as_bytes()).as_bytes()[..8])
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn read<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn write<T>(m: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The simulator clock: real time truncated to microseconds, or frozen.
#[derive(Debug)]
pub struct Clock {
    frozen: AtomicI64,
    last_issued: AtomicI64,
}

fn from_micros(micros: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(micros).unwrap_or(DateTime::<Utc>::MIN_UTC)
}

impl Clock {
    fn new() -> Self {
        Self {
            frozen: AtomicI64::new(NOT_FROZEN),
            last_issued: AtomicI64::new(0),
        }
    }

    /// Freezes the clock at `now` or returns it to real time.
    pub fn set(&self, now: Option<DateTime<Utc>>) {
        let value = now.map_or(NOT_FROZEN, |at| at.timestamp_micros());
        self.frozen.store(value, Ordering::SeqCst);
    }

    /// The current time (frozen value when frozen).
    pub fn now(&self) -> DateTime<Utc> {
        match self.frozen.load(Ordering::SeqCst) {
            NOT_FROZEN => from_micros(Utc::now().timestamp_micros()),
            frozen => from_micros(frozen),
        }
    }

    /// The `updated_at` of a mutation: the frozen time when frozen, otherwise
    /// real time made strictly increasing so no two mutations tie and a
    /// mutated record always sorts after every page already served.
    pub fn mutation_time(&self) -> DateTime<Utc> {
        let frozen = self.frozen.load(Ordering::SeqCst);
        if frozen != NOT_FROZEN {
            return from_micros(frozen);
        }
        let now = Utc::now().timestamp_micros();
        let mut last = self.last_issued.load(Ordering::SeqCst);
        loop {
            let next = now.max(last + 1);
            match self
                .last_issued
                .compare_exchange(last, next, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return from_micros(next),
                Err(current) => last = current,
            }
        }
    }
}

/// What a bearer token may do.
#[derive(Debug, Clone)]
pub struct Grant {
    /// Tenants in scope; None = all.
    pub tenants: Option<HashSet<TenantId>>,
    /// Permission bits.
    pub permissions: u8,
    /// Fingerprint for the log and the rate limiter.
    pub fingerprint: String,
}

/// Settings tests change at run time.
#[derive(Debug)]
pub struct Settings {
    fail_rate_bits: AtomicU64,
    latency_nanos: AtomicU64,
    rate_limit: AtomicU32,
    /// The window the rate limit counts in.
    pub rate_window: Duration,
    /// Whether 429 responses carry `Retry-After`.
    pub retry_after_header: bool,
}

impl Settings {
    /// Fraction of requests answered with an injected 5xx.
    pub fn fail_rate(&self) -> f64 {
        f64::from_bits(self.fail_rate_bits.load(Ordering::Relaxed))
    }

    /// Sets the injected failure fraction, clamped to 0..=1.
    pub fn set_fail_rate(&self, f: f64) {
        let f = if f.is_nan() { 0.0 } else { f.clamp(0.0, 1.0) };
        self.fail_rate_bits.store(f.to_bits(), Ordering::Relaxed);
    }

    /// Delay added to every response.
    pub fn latency(&self) -> Duration {
        Duration::from_nanos(self.latency_nanos.load(Ordering::Relaxed))
    }

    /// Sets the delay added to every response.
    pub fn set_latency(&self, d: Duration) {
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.latency_nanos.store(nanos, Ordering::Relaxed);
    }

    /// Requests per minute per token and IP; 0 = unlimited.
    pub fn rate_limit(&self) -> u32 {
        self.rate_limit.load(Ordering::Relaxed)
    }

    /// Sets the per-minute budget.
    pub fn set_rate_limit(&self, per_minute: u32) {
        self.rate_limit.store(per_minute, Ordering::Relaxed);
    }
}

/// Outcome of charging one request to a rate-limit window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateDecision {
    /// Within budget.
    Allowed,
    /// Over budget; the window resets after this long.
    Limited(Duration),
}

/// Everything the server and the handle share.
pub struct SimState {
    /// The simulator clock.
    pub clock: Clock,
    /// Runtime settings.
    pub settings: Settings,
    /// Cursor signing.
    pub cursors: CursorCodec,
    tenants: Vec<RwLock<TenantData>>,
    tokens: RwLock<HashMap<String, Grant>>,
    faults: Mutex<VecDeque<Fault>>,
    /// Listing faults by stream; the `None` key applies to every stream.
    listing_faults: RwLock<HashMap<Option<(TenantId, Resource)>, ListingFault>>,
    log: Mutex<VecDeque<RequestLogEntry>>,
    /// Where every request is also journaled (`--request-log`), if anywhere.
    pub request_journal: Option<Journal>,
    windows: Mutex<HashMap<(String, IpAddr), (Instant, u32)>>,
    rng: Mutex<StdRng>,
    redemption_key: [u8; 32],
    request_counter: AtomicU64,
    request_prefix: u32,
    record_without_id_uses: AtomicU64,
}

impl SimState {
    /// Generates every tenant's data and the default token.
    pub fn new(opts: &SimulatorOptions) -> Self {
        let tenants = (1..=opts.tenants)
            .map(|t| {
                RwLock::new(TenantData::generate(
                    opts.seed,
                    t,
                    opts.vouchers,
                    opts.categories,
                    opts.bulk_import_share,
                ))
            })
            .collect();
        let settings = Settings {
            fail_rate_bits: AtomicU64::new(0),
            latency_nanos: AtomicU64::new(0),
            rate_limit: AtomicU32::new(opts.rate_limit),
            rate_window: opts.rate_window,
            retry_after_header: opts.retry_after_header,
        };
        settings.set_fail_rate(opts.fail_rate);
        settings.set_latency(opts.latency);
        let secret: [u8; 32] = rand::random();
        let state = SimState {
            clock: Clock::new(),
            settings,
            cursors: CursorCodec::new(secret),
            tenants,
            tokens: RwLock::new(HashMap::new()),
            faults: Mutex::new(VecDeque::new()),
            listing_faults: RwLock::new(HashMap::new()),
            log: Mutex::new(VecDeque::new()),
            request_journal: None,
            windows: Mutex::new(HashMap::new()),
            rng: Mutex::new(data::tenant_rng(opts.seed, 0, 1)),
            redemption_key: blake3::derive_key(
                "voucher-cdc simulator redemption tokens",
                &opts.seed.to_le_bytes(),
            ),
            request_counter: AtomicU64::new(0),
            request_prefix: rand::random(),
            record_without_id_uses: AtomicU64::new(0),
        };
        state.add_token(&opts.token, None, 0b111);
        if let Some(fault) = opts.listing_fault {
            state.set_listing_fault(None, Some(fault));
        }
        for oversize in &opts.oversize {
            state.set_oversize(
                oversize.tenant,
                oversize.resource,
                oversize.id,
                oversize.bytes,
            );
        }
        state
    }

    /// Sets or clears the listing fault of one stream, or (scope None) of every stream.
    pub fn set_listing_fault(
        &self,
        scope: Option<(TenantId, Resource)>,
        fault: Option<ListingFault>,
    ) {
        let mut faults = write(&self.listing_faults);
        match fault {
            Some(fault) => faults.insert(scope, fault),
            None => faults.remove(&scope),
        };
    }

    /// The listing fault in force for a stream: its own, else the global one.
    pub fn listing_fault(&self, tenant: TenantId, resource: Resource) -> Option<ListingFault> {
        let faults = read(&self.listing_faults);
        if faults.is_empty() {
            return None;
        }
        faults
            .get(&Some((tenant, resource)))
            .or_else(|| faults.get(&None))
            .copied()
    }

    /// Pads a record to at least `bytes` of JSON (0 removes the padding); false when unknown.
    pub fn set_oversize(
        &self,
        tenant: TenantId,
        resource: Resource,
        id: i64,
        bytes: usize,
    ) -> bool {
        self.tenant(tenant)
            .is_some_and(|data| write(data).set_oversize(resource, id, bytes))
    }

    /// A copy of a record's typed value.
    pub fn snapshot(&self, tenant: TenantId, resource: Resource, id: i64) -> Option<RecordValue> {
        read(self.tenant(tenant)?).snapshot(resource, id)
    }

    /// Puts a snapshot back (re-creating the record when deleted); with
    /// `bump` its `updated_at` becomes a fresh mutation time.
    pub fn restore(&self, tenant: TenantId, value: &RecordValue, bump: bool) -> bool {
        let Some(data) = self.tenant(tenant) else {
            return false;
        };
        let mut data = write(data);
        let at = bump.then(|| self.clock.mutation_time());
        data.restore(value, at);
        true
    }

    /// A tenant's data, None when unknown.
    pub fn tenant(&self, tenant: TenantId) -> Option<&RwLock<TenantData>> {
        let index = usize::try_from(tenant.checked_sub(1)?).ok()?;
        self.tenants.get(index)
    }

    /// Adds or replaces a token.
    pub fn add_token(&self, token: &str, tenants: Option<Vec<TenantId>>, permissions: u8) {
        let grant = Grant {
            tenants: tenants.map(|t| t.into_iter().collect()),
            permissions,
            fingerprint: token_fingerprint(token),
        };
        write(&self.tokens).insert(token.to_string(), grant);
    }

    /// The grant of a token.
    pub fn grant(&self, token: &str) -> Option<Grant> {
        read(&self.tokens).get(token).cloned()
    }

    /// Charges a request to the (token, ip) window open now (windows last
    /// `rate_window` and open at their first request).
    pub fn charge(&self, fingerprint: &str, ip: IpAddr) -> RateDecision {
        let limit = self.settings.rate_limit();
        if limit == 0 {
            return RateDecision::Allowed;
        }
        let now = Instant::now();
        let window = self.settings.rate_window;
        let mut windows = lock(&self.windows);
        let entry = windows
            .entry((fingerprint.to_string(), ip))
            .or_insert((now, 0));
        if now.duration_since(entry.0) >= window {
            *entry = (now, 0);
        }
        if entry.1 >= limit {
            return RateDecision::Limited(window.saturating_sub(now.duration_since(entry.0)));
        }
        entry.1 += 1;
        RateDecision::Allowed
    }

    /// A fresh `X-Request-Id`.
    pub fn request_id(&self) -> String {
        let n = self.request_counter.fetch_add(1, Ordering::Relaxed);
        format!("sim-{:08x}-{n:012x}", self.request_prefix)
    }

    /// Queues a fault.
    pub fn push_fault(&self, fault: Fault) {
        lock(&self.faults).push_back(fault);
    }

    /// Pops the front fault when `matches` accepts it.
    pub fn take_fault(&self, matches: impl Fn(&Fault) -> bool) -> Option<Fault> {
        let mut faults = lock(&self.faults);
        if faults.front().is_some_and(matches) {
            faults.pop_front()
        } else {
            None
        }
    }

    /// Whether any fault is queued (a cheap check on the hot path).
    pub fn has_faults(&self) -> bool {
        !lock(&self.faults).is_empty()
    }

    /// Counts one use of the RecordWithoutId fault; returns the use number (1-based).
    pub fn next_record_without_id_use(&self) -> u64 {
        self.record_without_id_uses.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Appends to the bounded request log.
    pub fn log_request(&self, entry: RequestLogEntry) {
        let mut log = lock(&self.log);
        if log.len() >= LOG_CAPACITY {
            log.pop_front();
        }
        log.push_back(entry);
    }

    /// A copy of the request log.
    pub fn request_log(&self) -> Vec<RequestLogEntry> {
        lock(&self.log).iter().cloned().collect()
    }

    /// Empties the request log.
    pub fn clear_request_log(&self) {
        lock(&self.log).clear();
    }

    /// Creates a record; None for an unknown tenant.
    pub fn create(&self, tenant: TenantId, resource: Resource) -> Option<i64> {
        let data = self.tenant(tenant)?;
        let mut rng = lock(&self.rng);
        let mut data = write(data);
        let at = self.clock.mutation_time();
        Some(data.create(&mut rng, resource, at))
    }

    /// Updates a record, bumping `updated_at` when `bump`.
    pub fn update(&self, tenant: TenantId, resource: Resource, id: i64, bump: bool) -> bool {
        let Some(data) = self.tenant(tenant) else {
            return false;
        };
        let mut rng = lock(&self.rng);
        let mut data = write(data);
        let at = bump.then(|| self.clock.mutation_time());
        data.update(&mut rng, resource, id, at)
    }

    /// Sets a record's `updated_at`.
    pub fn set_updated_at(
        &self,
        tenant: TenantId,
        resource: Resource,
        id: i64,
        at: Option<DateTime<Utc>>,
    ) -> bool {
        self.tenant(tenant)
            .is_some_and(|data| write(data).set_updated_at(resource, id, at))
    }

    /// Deletes a record.
    pub fn delete(&self, tenant: TenantId, resource: Resource, id: i64) -> bool {
        self.tenant(tenant)
            .is_some_and(|data| write(data).delete(resource, id))
    }

    /// Ids of a resource's records.
    pub fn record_ids(&self, tenant: TenantId, resource: Resource) -> Vec<i64> {
        self.tenant(tenant)
            .map(|data| read(data).ids(resource))
            .unwrap_or_default()
    }

    /// The id at `position` of a resource's ascending ids; None past the last
    /// (or for an unknown tenant).
    pub fn nth_record_id(
        &self,
        tenant: TenantId,
        resource: Resource,
        position: usize,
    ) -> Option<i64> {
        read(self.tenant(tenant)?).nth_id(resource, position)
    }

    /// Number of records of a resource.
    pub fn record_count(&self, tenant: TenantId, resource: Resource) -> usize {
        self.tenant(tenant)
            .map(|data| read(data).len(resource))
            .unwrap_or_default()
    }

    /// A record's bytes in include form `mask`.
    pub fn record_json(
        &self,
        tenant: TenantId,
        resource: Resource,
        id: i64,
        mask: u8,
    ) -> Option<String> {
        let bytes = read(self.tenant(tenant)?).form(resource, id, mask)?;
        String::from_utf8(bytes.to_vec()).ok()
    }

    /// Read access to a tenant's data.
    pub fn read_tenant(&self, tenant: TenantId) -> Option<RwLockReadGuard<'_, TenantData>> {
        self.tenant(tenant).map(read)
    }

    /// Write access to a tenant's data.
    pub fn write_tenant(&self, tenant: TenantId) -> Option<RwLockWriteGuard<'_, TenantData>> {
        self.tenant(tenant).map(write)
    }

    /// The redemption token of a purchased voucher (deterministic from the seed).
    pub fn redemption_token(&self, tenant: TenantId, purchased_id: i64) -> Option<String> {
        let exists = self
            .read_tenant(tenant)?
            .purchased
            .contains_key(&purchased_id);
        exists.then(|| self.token_for(tenant, purchased_id))
    }

    /// The token string for (tenant, purchased id), whether or not it exists.
    pub fn token_for(&self, tenant: TenantId, purchased_id: i64) -> String {
        let mut input = tenant.to_be_bytes().to_vec();
        input.extend_from_slice(&purchased_id.to_be_bytes());
        let mac = blake3::keyed_hash(&self.redemption_key, &input);
        format!("rt_{purchased_id}_{}", hex::encode(&mac.as_bytes()[..12]))
    }

    /// Ids of a tenant's purchased vouchers.
    pub fn purchased_ids(&self, tenant: TenantId) -> Vec<i64> {
        self.read_tenant(tenant)
            .map(|data| data.purchased.keys().copied().collect())
            .unwrap_or_default()
    }

    /// A purchased voucher in its redemption-result shape.
    pub fn purchased_voucher(&self, tenant: TenantId, id: i64) -> Option<RedemptionVoucher> {
        let data = self.read_tenant(tenant)?;
        let purchased = data.purchased.get(&id)?;
        Some(super::redeem::voucher_view(
            purchased,
            self.clock.now().date_naive(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutation_times_strictly_increase_unless_the_clock_is_frozen() {
        let clock = Clock::new();
        let mut last = clock.mutation_time();
        for _ in 0..10_000 {
            let next = clock.mutation_time();
            assert!(next > last);
            last = next;
        }
        let frozen = from_micros(1_900_000_000_000_000);
        clock.set(Some(frozen));
        assert_eq!(clock.mutation_time(), frozen);
        assert_eq!(clock.mutation_time(), frozen);
        assert_eq!(clock.now(), frozen);
        clock.set(None);
        assert!(clock.now() < frozen);
    }

    #[test]
    fn the_rate_window_allows_the_budget_then_reports_the_time_to_reset() {
        let state = SimState::new(&SimulatorOptions {
            tenants: 1,
            vouchers: 1,
            categories: 1,
            rate_limit: 2,
            ..SimulatorOptions::default()
        });
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        assert_eq!(state.charge("a", ip), RateDecision::Allowed);
        assert_eq!(state.charge("a", ip), RateDecision::Allowed);
        match state.charge("a", ip) {
            RateDecision::Limited(reset) => assert!(reset <= Duration::from_secs(60)),
            other => panic!("expected a limit, got {other:?}"),
        }
        assert_eq!(state.charge("b", ip), RateDecision::Allowed);
        state.settings.set_rate_limit(0);
        assert_eq!(state.charge("a", ip), RateDecision::Allowed);
    }

    #[test]
    fn the_rate_window_option_sets_how_long_a_window_counts() {
        let window = Duration::from_millis(300);
        let state = SimState::new(&SimulatorOptions {
            tenants: 1,
            vouchers: 1,
            categories: 1,
            rate_limit: 2,
            rate_window: window,
            ..SimulatorOptions::default()
        });
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let opened = Instant::now();
        assert_eq!(state.charge("a", ip), RateDecision::Allowed);
        assert_eq!(state.charge("a", ip), RateDecision::Allowed);
        match state.charge("a", ip) {
            RateDecision::Limited(reset) => assert!(reset <= window, "reset in {reset:?}"),
            other => panic!("expected a limit, got {other:?}"),
        }
        std::thread::sleep(window.saturating_sub(opened.elapsed()) + Duration::from_millis(20));
        assert_eq!(
            state.charge("a", ip),
            RateDecision::Allowed,
            "a new window opened"
        );
        assert_eq!(state.charge("a", ip), RateDecision::Allowed);
        assert!(matches!(state.charge("a", ip), RateDecision::Limited(_)));
    }
}
