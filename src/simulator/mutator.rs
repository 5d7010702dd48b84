//! The background mutator behind `--changes-per-minute`: creates, updates,
//! deletes and touches records at a steady pace, deterministic from the seed,
//! on tenants picked uniformly or by a Zipf law (`--change-skew`), leaving
//! the idle share (`--idle-tenants`) untouched, and journals every change
//! (`--change-log`).

use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use tokio_util::sync::CancellationToken;

use super::data;
use super::journal::{self, Journal};
use super::state::SimState;
use crate::stream::{Resource, TenantId};

/// One background change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// A new record.
    Create,
    /// A content change with an `updated_at` bump.
    Update,
    /// A content change without an `updated_at` bump.
    SilentUpdate,
    /// An `updated_at` bump only.
    Touch,
    /// A deletion.
    Delete,
}

impl Change {
    /// The change's name in the change log.
    pub fn as_str(self) -> &'static str {
        match self {
            Change::Create => "create",
            Change::Update => "update",
            Change::SilentUpdate => "silent_update",
            Change::Touch => "touch",
            Change::Delete => "delete",
        }
    }
}

/// Which tenant a background change lands on: tenant `k` of the active
/// tenants `1..=active` with weight `1 / k^skew` (skew 0 = uniform); the
/// highest-numbered `idle` tenants are never picked.
#[derive(Debug, Clone)]
pub struct TenantPicker {
    active: u64,
    /// Cumulative weights of tenants 1..=active; empty when skew is 0.
    cumulative: Vec<f64>,
}

impl TenantPicker {
    /// A picker over `tenants` tenants with Zipf exponent `skew` and `idle_share` of them idle
    /// (rounded to the nearest tenant).
    pub fn new(tenants: u64, skew: f64, idle_share: f64) -> TenantPicker {
        let idle_share = if idle_share.is_nan() {
            0.0
        } else {
            idle_share.clamp(0.0, 1.0)
        };
        // Bounded: tenants <= 10,000 and the share is in 0..=1.
        let idle = (tenants as f64 * idle_share).round() as u64;
        let active = tenants.saturating_sub(idle);
        let cumulative = if skew > 0.0 && skew.is_finite() {
            (1..=active)
                .scan(0.0, |total, k| {
                    *total += (k as f64).powf(-skew);
                    Some(*total)
                })
                .collect()
        } else {
            Vec::new()
        };
        TenantPicker { active, cumulative }
    }

    /// Tenants that change at all (`1..=active`).
    pub fn active(&self) -> u64 {
        self.active
    }

    /// Picks a tenant; None when every tenant is idle.
    pub fn pick(&self, rng: &mut rand::rngs::StdRng) -> Option<TenantId> {
        if self.active == 0 {
            return None;
        }
        let Some(total) = self.cumulative.last() else {
            // Uniform: the same draw as before skew existed, so seeded runs repeat.
            return Some(rng.random_range(1..=self.active));
        };
        let target = rng.random::<f64>() * total;
        let index = self.cumulative.partition_point(|c| *c <= target);
        Some((index as u64 + 1).min(self.active))
    }
}

/// One change the mutator applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppliedChange {
    /// The tenant.
    pub tenant: TenantId,
    /// The resource.
    pub resource: Resource,
    /// The record (the new one for a create).
    pub id: i64,
    /// What was done.
    pub change: Change,
}

/// Picks a change from a roll in 0..100; keeps the record count near its
/// start by creating when below 90 % and deleting less when low.
pub fn pick_change(roll: u32, count: usize, initial: usize) -> Change {
    if count == 0 || count * 10 < initial * 9 {
        return Change::Create;
    }
    match roll {
        0..=14 => Change::Create,
        15..=59 => Change::Update,
        60..=64 => Change::SilentUpdate,
        65..=84 => Change::Touch,
        _ => Change::Delete,
    }
}

/// The stream a background change lands on: a tenant from `picker`, then
/// vouchers 80 times in 100, categories otherwise; None when no tenant may change.
fn pick_stream(
    picker: &TenantPicker,
    rng: &mut rand::rngs::StdRng,
) -> Option<(TenantId, Resource)> {
    let tenant = picker.pick(rng)?;
    let resource = if rng.random_bool(0.8) {
        Resource::Vouchers
    } else {
        Resource::Categories
    };
    Some((tenant, resource))
}

/// A stream's record count and one of its ids drawn from `rng` (no draw and
/// None when it has none). Two reads: a test's or a snapshot restore's write
/// between them can make the position past the last id, which reads as None
/// (a create, as for an empty table), never as an error.
fn random_record(
    state: &SimState,
    tenant: TenantId,
    resource: Resource,
    rng: &mut rand::rngs::StdRng,
) -> (usize, Option<i64>) {
    let count = state.record_count(tenant, resource);
    let id = (count > 0)
        .then(|| state.nth_record_id(tenant, resource, rng.random_range(0..count)))
        .flatten();
    (count, id)
}

/// Applies one random change on a tenant from `picker`; returns what it
/// did, None when no tenant may change or the change did not apply.
pub fn mutate_once(
    state: &SimState,
    initial: &[(Resource, usize)],
    picker: &TenantPicker,
    seed_stream: &mut rand::rngs::StdRng,
) -> Option<AppliedChange> {
    let (tenant, resource) = pick_stream(picker, seed_stream)?;
    let start = initial
        .iter()
        .find(|(r, _)| *r == resource)
        .map_or(0, |(_, n)| *n);
    let roll = seed_stream.random_range(0..100);
    let (count, id) = random_record(state, tenant, resource, seed_stream);
    let change = pick_change(roll, count, start);
    let applied = |id, change| AppliedChange {
        tenant,
        resource,
        id,
        change,
    };
    let (id, done) = match (change, id) {
        (Change::Create, _) | (_, None) => {
            let id = state.create(tenant, resource)?;
            return Some(applied(id, Change::Create));
        }
        (Change::Update, Some(id)) => (id, state.update(tenant, resource, id, true)),
        (Change::SilentUpdate, Some(id)) => (id, state.update(tenant, resource, id, false)),
        (Change::Touch, Some(id)) => {
            let at = state.clock.mutation_time();
            (id, state.set_updated_at(tenant, resource, id, Some(at)))
        }
        (Change::Delete, Some(id)) => (id, state.delete(tenant, resource, id)),
    };
    done.then(|| applied(id, change))
}

/// Gives the catalog the change history of `history` of background changes
/// before `now`, as if the mutator had run that long before the simulator
/// started (`--change-history`): at `per_minute`, on the tenants `picker`
/// picks, each change that would bump `updated_at` (a create, an update or a
/// touch: 80 rolls of 100) sets a random record's `updated_at` to the
/// change's time. Records are neither added nor removed, so the catalog keeps
/// its size; only its last-change times become those of a live catalog.
/// Deterministic from `seed` (its own random stream: the live changes that
/// follow are the same with or without a history). Returns the changes applied.
pub fn backdate(
    state: &SimState,
    picker: &TenantPicker,
    per_minute: u32,
    history: Duration,
    seed: u64,
    now: chrono::DateTime<chrono::Utc>,
) -> u64 {
    if per_minute == 0 || history.is_zero() || picker.active() == 0 {
        return 0;
    }
    let mut rng = data::tenant_rng(seed, 0, 3);
    let period = 60.0 / f64::from(per_minute);
    let count = (history.as_secs_f64() / period).floor() as u64;
    let start =
        now - chrono::Duration::microseconds(history.as_micros().min(i64::MAX as u128) as i64);
    let mut applied = 0;
    for i in 0..count {
        let Some((tenant, resource)) = pick_stream(picker, &mut rng) else {
            break;
        };
        let roll = rng.random_range(0..100);
        let (records, Some(id)) = random_record(state, tenant, resource, &mut rng) else {
            continue;
        };
        let bumps = matches!(
            pick_change(roll, records, records),
            Change::Create | Change::Update | Change::Touch
        );
        if !bumps {
            continue;
        }
        let at = start + chrono::Duration::microseconds((i as f64 * period * 1e6) as i64);
        if state.set_updated_at(tenant, resource, id, Some(at)) {
            applied += 1;
        }
    }
    applied
}

/// How the background mutator runs.
#[derive(Debug)]
pub struct MutatorPlan {
    /// Changes per minute over all tenants.
    pub per_minute: u32,
    /// Seed of the change sequence.
    pub seed: u64,
    /// Which tenants change, how often.
    pub picker: TenantPicker,
    /// Where every applied change is journaled, if anywhere.
    pub change_log: Option<Journal>,
}

/// The change-log line of one applied change, stamped with the wall clock.
fn change_log_line(change: &AppliedChange) -> serde_json::Value {
    serde_json::json!({
        "at": journal::timestamp(chrono::Utc::now()),
        "tenant": change.tenant,
        "resource": change.resource.as_str(),
        "id": change.id,
        "change": change.change.as_str(),
    })
}

/// Runs until cancelled, `plan.per_minute` changes a minute.
pub async fn run(state: Arc<SimState>, plan: MutatorPlan, cancel: CancellationToken) {
    let period = Duration::from_secs_f64(60.0 / f64::from(plan.per_minute.max(1)));
    let mut ticker = tokio::time::interval(period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut rng = data::tenant_rng(plan.seed, 0, 2);
    let initial = [
        (
            Resource::Vouchers,
            state.record_count(1, Resource::Vouchers),
        ),
        (
            Resource::Categories,
            state.record_count(1, Resource::Categories),
        ),
    ];
    if plan.picker.active() == 0 {
        tracing::warn!("every tenant is idle: the simulator makes no background changes");
    }
    ticker.tick().await;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = ticker.tick() => {
                let applied = mutate_once(&state, &initial, &plan.picker, &mut rng);
                tracing::debug!(?applied, "simulator background change");
                if let (Some(applied), Some(log)) = (applied, &plan.change_log) {
                    log.append(&change_log_line(&applied));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mix_covers_every_change_and_refills_a_shrunk_table() {
        let picks: Vec<Change> = (0..100).map(|roll| pick_change(roll, 100, 100)).collect();
        for change in [
            Change::Create,
            Change::Update,
            Change::SilentUpdate,
            Change::Touch,
            Change::Delete,
        ] {
            assert!(picks.contains(&change), "{change:?} never picked");
        }
        assert_eq!(pick_change(99, 80, 100), Change::Create);
        assert_eq!(pick_change(99, 0, 0), Change::Create);
    }

    fn pick_counts(picker: &TenantPicker, tenants: u64, draws: usize, seed: u64) -> Vec<usize> {
        let mut rng = data::tenant_rng(seed, 0, 2);
        let mut counts = vec![0usize; tenants as usize + 1];
        for _ in 0..draws {
            let tenant = picker.pick(&mut rng).expect("an active tenant");
            counts[tenant as usize] += 1;
        }
        counts
    }

    #[test]
    fn the_zipf_pick_follows_one_over_k_to_the_skew() {
        let picker = TenantPicker::new(100, 1.1, 0.0);
        let draws = 200_000;
        let counts = pick_counts(&picker, 100, draws, 7);
        assert_eq!(counts[0], 0, "tenant 0 does not exist");
        let harmonic: f64 = (1..=100).map(|k| (k as f64).powf(-1.1)).sum();
        for k in [1usize, 2, 5, 10, 50] {
            let expected = draws as f64 * (k as f64).powf(-1.1) / harmonic;
            let seen = counts[k] as f64;
            assert!(
                (seen - expected).abs() < 0.1 * expected + 60.0,
                "tenant {k}: {seen} picks, expected about {expected:.0}"
            );
        }
        // Hottest first, and strongly skewed: tenant 1 alone beats tenants 51..=100 together.
        assert!(counts[1] > counts[2] && counts[2] > counts[10] && counts[10] > counts[100]);
        assert!(counts[1] > counts[51..].iter().sum::<usize>());
    }

    #[test]
    fn skew_zero_is_uniform_and_the_same_draw_as_before() {
        let picker = TenantPicker::new(10, 0.0, 0.0);
        let counts = pick_counts(&picker, 10, 100_000, 3);
        for (tenant, count) in counts.iter().enumerate().skip(1) {
            assert!((9_000..11_000).contains(count), "tenant {tenant}: {count}");
        }
        let mut old = data::tenant_rng(3, 0, 2);
        let mut new = data::tenant_rng(3, 0, 2);
        for _ in 0..100 {
            assert_eq!(Some(old.random_range(1..=10u64)), picker.pick(&mut new));
        }
    }

    #[test]
    fn idle_tenants_are_never_picked() {
        for skew in [0.0, 1.1] {
            let picker = TenantPicker::new(200, skew, 0.2);
            assert_eq!(picker.active(), 160);
            let counts = pick_counts(&picker, 200, 50_000, 11);
            assert_eq!(counts[161..].iter().sum::<usize>(), 0, "skew {skew}");
            assert!(counts[160] > 0 || skew > 0.0);
        }
        let all_idle = TenantPicker::new(5, 1.0, 1.0);
        assert_eq!(all_idle.pick(&mut data::tenant_rng(1, 0, 2)), None);
    }

    #[test]
    fn a_change_history_dates_the_hot_tenants_records_recently_and_leaves_the_idle_ones_old() {
        let opts = crate::simulator::SimulatorOptions {
            tenants: 10,
            vouchers: 50,
            categories: 5,
            ..Default::default()
        };
        let state = SimState::new(&opts);
        let picker = TenantPicker::new(10, 1.1, 0.2);
        let now = chrono::Utc::now();
        let history = Duration::from_secs(6 * 3600);
        let applied = backdate(&state, &picker, 60, history, 42, now);
        // 6 hours at 60 a minute, 80% of them bump `updated_at`.
        assert!((15_000..=19_600).contains(&applied), "{applied}");
        let ages = |tenant| -> Vec<f64> {
            updated_ats(&state, tenant)
                .into_iter()
                .flatten()
                .map(|at| (now - at).num_milliseconds() as f64 / 1000.0)
                .collect()
        };
        let recent = |tenant| ages(tenant).iter().filter(|a| **a < 6.0 * 3600.0).count();
        let mean_age = |tenant| {
            let ages = ages(tenant);
            ages.iter().sum::<f64>() / ages.len() as f64
        };
        assert!(
            mean_age(1) < 600.0,
            "tenant 1's records changed minutes ago: {}",
            mean_age(1)
        );
        assert!(recent(1) >= 48, "{}", recent(1));
        // Tenant 8 changes 8^1.1 = 9.8 times less often than tenant 1.
        assert!(
            mean_age(8) > 4.0 * mean_age(1),
            "{} vs {}",
            mean_age(8),
            mean_age(1)
        );
        assert_eq!(recent(9), 0, "idle");
        assert_eq!(recent(10), 0, "idle");
        assert!(
            ages(1).iter().all(|a| *a > 0.0),
            "every backdated change is before now"
        );
        assert_eq!(
            state.record_count(1, Resource::Vouchers),
            50,
            "no record added or removed"
        );
        // Deterministic: the same seed, the same history.
        let again = SimState::new(&opts);
        assert_eq!(backdate(&again, &picker, 60, history, 42, now), applied);
        assert_eq!(updated_ats(&again, 3), updated_ats(&state, 3));
    }

    /// The `updated_at` of every voucher of `tenant`, by id.
    fn updated_ats(
        state: &SimState,
        tenant: TenantId,
    ) -> Vec<Option<chrono::DateTime<chrono::Utc>>> {
        state
            .record_ids(tenant, Resource::Vouchers)
            .into_iter()
            .map(|id| match state.snapshot(tenant, Resource::Vouchers, id) {
                Some(crate::simulator::store::RecordValue::Voucher(v)) => v.updated_at,
                _ => None,
            })
            .collect()
    }

    #[test]
    fn the_pick_is_deterministic_from_the_seed() {
        let picker = TenantPicker::new(200, 1.1, 0.2);
        let draw = |seed| {
            let mut rng = data::tenant_rng(seed, 0, 2);
            (0..500).map(|_| picker.pick(&mut rng)).collect::<Vec<_>>()
        };
        assert_eq!(draw(42), draw(42));
        assert_ne!(draw(42), draw(43));
    }
}
