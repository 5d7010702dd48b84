//! Property: whatever records are mutated while a client pages through a
//! listing, every record that existed throughout is listed, and no record
//! whose `updated_at` is at or after `updated_since` is missing.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;
use serde_json::Value;
use voucher_cdc::simulator::Simulator;
use voucher_cdc::stream::Resource;

#[derive(Debug, Clone)]
enum Op {
    Create,
    Update(usize),
    UpdateSilently(usize),
    Touch(usize),
    Delete(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        Just(Op::Create),
        any::<usize>().prop_map(Op::Update),
        any::<usize>().prop_map(Op::UpdateSilently),
        any::<usize>().prop_map(Op::Touch),
        any::<usize>().prop_map(Op::Delete),
    ]
}

/// Applies an op; returns (id bumped, id deleted).
fn apply(sim: &Simulator, resource: Resource, op: &Op) -> (Option<i64>, Option<i64>) {
    let ids = sim.record_ids(1, resource);
    let pick = |i: usize| ids[i % ids.len()];
    match op {
        Op::Create => (Some(sim.create(1, resource)), None),
        Op::Update(i) if !ids.is_empty() => {
            sim.update(1, resource, pick(*i));
            (Some(pick(*i)), None)
        }
        Op::UpdateSilently(i) if !ids.is_empty() => {
            sim.update_silently(1, resource, pick(*i));
            (None, None)
        }
        Op::Touch(i) if !ids.is_empty() => {
            sim.touch(1, resource, pick(*i));
            (Some(pick(*i)), None)
        }
        Op::Delete(i) if !ids.is_empty() => {
            sim.delete(1, resource, pick(*i));
            (None, Some(pick(*i)))
        }
        _ => (None, None),
    }
}

fn updated_at(sim: &Simulator, resource: Resource, id: i64) -> Option<String> {
    let json: Value = serde_json::from_str(&sim.record_json(1, resource, id, false)?).ok()?;
    json["updated_at"].as_str().map(str::to_string)
}

async fn check(
    resource: Resource,
    ops: Vec<(usize, Op)>,
    since_pick: Option<usize>,
    include: bool,
) -> Result<(), TestCaseError> {
    let sim = common::spawn_catalog(1, 170, 130).await;
    let client = common::simulator_client(sim.token());
    let initial = sim.record_ids(1, resource);
    let mut stamps: Vec<String> = initial
        .iter()
        .filter_map(|id| updated_at(&sim, resource, *id))
        .collect();
    stamps.sort();
    let since = since_pick.map(|i| stamps[i % stamps.len()].clone());

    let mut query = Vec::new();
    if let Some(since) = &since {
        query.push(format!("updated_since={}", since.replace(':', "%3A")));
    }
    if include {
        query.push(format!(
            "include={}",
            if resource == Resource::Vouchers {
                "categories,variants"
            } else {
                "products"
            }
        ));
    }
    let base = format!("{}/tenants/1/catalog/{}", sim.base_url(), resource.as_str());

    let mut by_page: BTreeMap<usize, Vec<Op>> = BTreeMap::new();
    for (page, op) in ops {
        by_page.entry(page % 6).or_default().push(op);
    }
    let (mut bumped, mut deleted) = (BTreeSet::new(), BTreeSet::new());
    let mut listed: Vec<Value> = Vec::new();
    let mut cursor: Option<String> = None;
    for page in 0.. {
        if page > 0 {
            for op in by_page.get(&page).into_iter().flatten() {
                let (b, d) = apply(&sim, resource, op);
                bumped.extend(b);
                deleted.extend(d);
            }
        }
        let mut parts = query.clone();
        if let Some(c) = &cursor {
            parts.push(format!("cursor={c}"));
        }
        let url = format!("{base}?{}", parts.join("&"));
        let response = client.get(&url).send().await.unwrap();
        prop_assert_eq!(response.status().as_u16(), 200);
        let body: Value = response.json().await.unwrap();
        let data = body["data"].as_array().unwrap();
        prop_assert!(data.len() <= 50);
        let keys: Vec<(Option<&str>, i64)> = data
            .iter()
            .map(|r| (r["updated_at"].as_str(), r["id"].as_i64().unwrap()))
            .collect();
        prop_assert!(keys.windows(2).all(|w| w[0] <= w[1]), "page is ordered");
        listed.extend(data.iter().cloned());
        match body["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => break,
        }
    }

    let listed_ids: Vec<i64> = listed.iter().map(|r| r["id"].as_i64().unwrap()).collect();
    let unique: BTreeSet<i64> = listed_ids.iter().copied().collect();
    for id in &unique {
        let count = listed_ids.iter().filter(|x| *x == id).count();
        prop_assert!(
            count == 1 || bumped.contains(id),
            "{id} listed {count} times without a bump"
        );
    }
    for record in &listed {
        if let Some(since) = &since {
            let at = record["updated_at"].as_str();
            prop_assert!(
                at.is_some_and(|at| at >= since.as_str()),
                "{record} is before {since}"
            );
        }
    }
    for id in initial.iter().filter(|id| !deleted.contains(id)) {
        let wanted = match &since {
            None => true,
            Some(since) => updated_at(&sim, resource, *id).is_some_and(|at| at >= *since),
        };
        if wanted {
            prop_assert!(
                unique.contains(id),
                "record {} existed throughout but was not listed",
                id
            );
        }
    }
    sim.shutdown().await;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn records_that_exist_throughout_a_paged_listing_are_never_missed(
        vouchers in any::<bool>(),
        ops in prop::collection::vec((1usize..6, op()), 0..60),
        since_pick in prop::option::of(any::<usize>()),
        include in any::<bool>(),
    ) {
        let resource = if vouchers { Resource::Vouchers } else { Resource::Categories };
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(check(resource, ops, since_pick, include))?;
    }
}
