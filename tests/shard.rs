//! Properties of tenant sharding across replicas: exclusive ownership,
//! minimal movement when the replica count changes, balance, and a pinned
//! mapping (changing it would silently move tenants between pods on upgrade).

use voucher_cdc::shard::{
    ordinal_from_hostname, owner, Shard, ShardConfig, ShardError, ShardIndex,
};

/// Tenant ids as operators number them: sequential from 1.
const TENANTS: std::ops::RangeInclusive<u64> = 1..=10_000;
const TENANT_COUNT: f64 = 10_000.0;

/// Asserts that `observed` of the tenants is within 5 standard deviations of
/// the binomial expectation `TENANT_COUNT * p`.
///
/// The mapping is deterministic, so this never flakes; it fails when the
/// hash is badly mixed (e.g. sequential ids landing in runs on one shard).
fn assert_about(observed: u32, p: f64, what: &str) {
    let expected = TENANT_COUNT * p;
    let tolerance = 5.0 * (TENANT_COUNT * p * (1.0 - p)).sqrt();
    assert!(
        (f64::from(observed) - expected).abs() <= tolerance,
        "{what}: {observed} tenants, expected {expected:.0} +- {tolerance:.0}"
    );
}

#[test]
fn every_tenant_is_owned_by_exactly_one_shard_for_counts_one_to_sixteen() {
    for count in 1..=16u32 {
        let shards: Vec<Shard> = (0..count).map(|i| Shard::new(i, count).unwrap()).collect();
        for tenant in TENANTS {
            let owners: Vec<u32> = shards
                .iter()
                .filter(|s| s.owns(tenant))
                .map(|s| s.index())
                .collect();
            assert_eq!(
                owners,
                vec![owner(tenant, count)],
                "tenant {tenant} with {count} shards"
            );
        }
    }
}

#[test]
fn growing_by_one_shard_moves_only_tenants_to_the_new_shard_about_one_in_n_plus_one() {
    for n in 1..=15u32 {
        let mut moved = 0u32;
        for tenant in TENANTS {
            let before = owner(tenant, n);
            let after = owner(tenant, n + 1);
            if before != after {
                assert_eq!(
                    after, n,
                    "tenant {tenant} moved from {before} to {after}, not to the new shard {n}"
                );
                moved += 1;
            }
        }
        let what = format!("{n} -> {} shards moved", n + 1);
        assert_about(moved, 1.0 / f64::from(n + 1), &what);
    }
}

#[test]
fn shrinking_by_one_shard_moves_only_the_removed_shards_tenants() {
    for n in 1..=15u32 {
        let mut moved = 0u32;
        let mut on_removed = 0u32;
        for tenant in TENANTS {
            let before = owner(tenant, n + 1);
            let after = owner(tenant, n);
            if before == n {
                on_removed += 1;
                assert!(after < n, "tenant {tenant} still on removed shard {n}");
            } else {
                assert_eq!(
                    before, after,
                    "tenant {tenant} moved from surviving shard {before} to {after}"
                );
            }
            if before != after {
                moved += 1;
            }
        }
        assert_eq!(moved, on_removed);
        let what = format!("{} -> {n} shards moved", n + 1);
        assert_about(moved, 1.0 / f64::from(n + 1), &what);
    }
}

#[test]
fn tenants_are_spread_evenly_over_the_shards() {
    for count in 2..=16u32 {
        let mut load = vec![0u32; count as usize];
        for tenant in TENANTS {
            load[owner(tenant, count) as usize] += 1;
        }
        for (index, &tenants) in load.iter().enumerate() {
            let what = format!("shard {index}/{count} owns (load {load:?})");
            assert_about(tenants, 1.0 / f64::from(count), &what);
        }
    }
}

#[test]
fn the_tenant_to_shard_mapping_is_pinned_across_releases_and_platforms() {
    // Owners of tenants 1..=12 with 4 shards, and of a few large ids with 7.
    // If this fails, the mapping changed: every multi-replica deployment
    // would move tenants on upgrade and re-snapshot them.
    let small: Vec<u32> = (1..=12).map(|t| owner(t, 4)).collect();
    assert_eq!(small, PINNED_SMALL);
    let large: Vec<u32> = [u64::from(u32::MAX), 1 << 40, u64::MAX]
        .iter()
        .map(|&t| owner(t, 7))
        .collect();
    assert_eq!(large, PINNED_LARGE);
}

/// Computed independently with Python's `blake3` package and the paper's
/// floating-point jump hash, not by this crate.
const PINNED_SMALL: [u32; 12] = [3, 1, 2, 2, 2, 0, 3, 1, 0, 1, 2, 0];
/// Owners of `u32::MAX`, `2^40` and `u64::MAX` with 7 shards (same provenance).
const PINNED_LARGE: [u32; 3] = [5, 3, 0];

#[test]
fn hostname_ordinals_are_read_from_statefulset_pod_names() {
    assert_eq!(ordinal_from_hostname("voucher-cdc-3"), Ok(3));
    assert_eq!(ordinal_from_hostname("voucher-cdc-0"), Ok(0));
    assert_eq!(ordinal_from_hostname("bridge-12"), Ok(12));
    assert_eq!(
        ordinal_from_hostname("voucher-cdc-2.voucher-cdc.cdc.svc.cluster.local"),
        Ok(2)
    );
    for bad in [
        "host",
        "voucher-cdc-",
        "voucher-cdc-x1",
        "voucher-cdc-99999999999",
        "",
    ] {
        let err = ordinal_from_hostname(bad).unwrap_err();
        assert_eq!(
            err,
            ShardError::NoOrdinal {
                hostname: bad.to_string()
            }
        );
        assert!(
            err.to_string().contains(&format!("hostname `{bad}`")),
            "{err}"
        );
    }
}

#[test]
fn a_config_with_index_hostname_resolves_to_the_pods_ordinal() {
    let config = ShardConfig {
        count: 3,
        index: ShardIndex::Hostname,
    };
    let shard = config.resolve_with_hostname(Some("voucher-cdc-1")).unwrap();
    assert_eq!(shard, Shard::new(1, 3).unwrap());
    let err = config.resolve_with_hostname(Some("host")).unwrap_err();
    assert_eq!(
        err.to_string(),
        "shard.index = \"hostname\": hostname `host` has no trailing -<ordinal> (expected a StatefulSet pod name such as voucher-cdc-0)"
    );
}
