//! The background mutator behind `--changes-per-minute`: creates, updates,
//! deletes and touches records at a steady pace, deterministic from the seed.

use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use tokio_util::sync::CancellationToken;

use super::data;
use super::state::SimState;
use crate::stream::Resource;

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

/// Applies one random change; returns what it did.
pub fn mutate_once(
    state: &SimState,
    initial: &[(Resource, usize)],
    seed_stream: &mut rand::rngs::StdRng,
) -> Change {
    let tenant = seed_stream.random_range(1..=state.tenant_count());
    let resource = if seed_stream.random_bool(0.8) {
        Resource::Vouchers
    } else {
        Resource::Categories
    };
    let start = initial
        .iter()
        .find(|(r, _)| *r == resource)
        .map_or(0, |(_, n)| *n);
    let ids = state.record_ids(tenant, resource);
    let change = pick_change(seed_stream.random_range(0..100), ids.len(), start);
    let id = (!ids.is_empty()).then(|| ids[seed_stream.random_range(0..ids.len())]);
    match (change, id) {
        (Change::Create, _) | (_, None) => {
            state.create(tenant, resource);
            return Change::Create;
        }
        (Change::Update, Some(id)) => state.update(tenant, resource, id, true),
        (Change::SilentUpdate, Some(id)) => state.update(tenant, resource, id, false),
        (Change::Touch, Some(id)) => {
            let at = state.clock.mutation_time();
            state.set_updated_at(tenant, resource, id, Some(at))
        }
        (Change::Delete, Some(id)) => state.delete(tenant, resource, id),
    };
    change
}

/// Runs until cancelled, `per_minute` changes a minute.
pub async fn run(state: Arc<SimState>, per_minute: u32, seed: u64, cancel: CancellationToken) {
    let period = Duration::from_secs_f64(60.0 / f64::from(per_minute.max(1)));
    let mut ticker = tokio::time::interval(period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut rng = data::tenant_rng(seed, 0, 2);
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
    ticker.tick().await;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = ticker.tick() => {
                let change = mutate_once(&state, &initial, &mut rng);
                tracing::debug!(?change, "simulator background change");
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
}
