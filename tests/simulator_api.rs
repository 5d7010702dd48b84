//! The simulator's HTTP API, exercised from a real client over loopback.

mod common;

use std::collections::BTreeSet;

use common::{simulator_client, spawn_simulator};
use serde_json::Value;
use voucher_cdc::stream::Resource;
use voucher_cdc::upstream::model::{CatalogCategory, CatalogVoucher, Collection};

async fn list_all(base: &str, client: &reqwest::Client, path: &str, query: &str) -> Vec<Value> {
    let mut out = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut url = format!("{base}{path}?{query}");
        if let Some(c) = &cursor {
            url.push_str(&format!("&cursor={c}"));
        }
        let response = client.get(&url).send().await.unwrap();
        assert_eq!(response.status(), 200, "{url}");
        let page: Collection<Value> = response.json().await.unwrap();
        assert!(page.data.len() <= 50);
        out.extend(page.data);
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => return out,
        }
    }
}

#[tokio::test]
async fn listing_vouchers_pages_through_every_record_once_in_updated_at_then_id_order() {
    let sim = spawn_simulator().await;
    let client = simulator_client(sim.token());
    let records = list_all(&sim.base_url(), &client, "/tenants/1/catalog/vouchers", "").await;
    let ids: Vec<i64> = records.iter().map(|r| r["id"].as_i64().unwrap()).collect();
    let unique: BTreeSet<i64> = ids.iter().copied().collect();
    assert_eq!(ids.len(), unique.len(), "no duplicates");
    assert_eq!(
        unique.into_iter().collect::<Vec<_>>(),
        sim.record_ids(1, Resource::Vouchers)
    );
    let keys: Vec<(Option<String>, i64)> = records
        .iter()
        .map(|r| {
            (
                r["updated_at"].as_str().map(str::to_string),
                r["id"].as_i64().unwrap(),
            )
        })
        .collect();
    let mut sorted = keys.clone();
    sorted.sort();
    assert_eq!(keys, sorted);
    assert!(keys[0].0.is_none(), "null updated_at sorts first");
    for record in &records {
        let _: CatalogVoucher = serde_json::from_value(record.clone()).unwrap();
        assert!(record.get("categories").is_none());
    }
    let first = &records[0];
    let id = first["id"].as_i64().unwrap();
    assert_eq!(
        serde_json::to_string(first).unwrap(),
        serde_json::to_string(
            &serde_json::from_str::<Value>(
                &sim.record_json(1, Resource::Vouchers, id, false).unwrap()
            )
            .unwrap()
        )
        .unwrap()
    );
    let categories = list_all(
        &sim.base_url(),
        &client,
        "/tenants/1/catalog/categories",
        "include=products",
    )
    .await;
    assert_eq!(categories.len(), 20);
    for c in categories {
        let c: CatalogCategory = serde_json::from_value(c).unwrap();
        assert!(c.products.is_some());
    }
    sim.shutdown().await;
}
