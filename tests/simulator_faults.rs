//! The simulator's fault modes for "never lose a change" (issue 12): listing
//! faults whose `next_cursor` never ends a listing (a cycle, an endless
//! listing), oversize records, and snapshots that put back an earlier
//! version of a record (reverts, re-creation with identical content).

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{free_port, simulator_client, spawn_catalog, spawn_cli};
use serde_json::Value;
use voucher_cdc::simulator::model::Collection;
use voucher_cdc::simulator::{ListingFault, Simulator};
use voucher_cdc::stream::Resource;

/// One list page: (ids, next_cursor).
async fn page(
    client: &reqwest::Client,
    base: &str,
    path: &str,
    query: &str,
    cursor: Option<&str>,
) -> (Vec<i64>, Option<String>) {
    let mut url = format!("{base}{path}?{query}");
    if let Some(c) = cursor {
        url.push_str(&format!("&cursor={c}"));
    }
    let response = client.get(&url).send().await.unwrap();
    assert_eq!(response.status(), 200, "{url}");
    let page: Collection<Value> = response.json().await.unwrap();
    let ids = page
        .data
        .iter()
        .map(|r| r["id"].as_i64().expect("every record has an integer id"))
        .collect();
    (ids, page.next_cursor)
}

/// Follows `next_cursor` for at most `max_pages`; returns the pages as
/// (ids, next_cursor) and whether the listing ended (a null cursor).
async fn walk(
    client: &reqwest::Client,
    base: &str,
    path: &str,
    query: &str,
    max_pages: usize,
) -> (Vec<(Vec<i64>, Option<String>)>, bool) {
    let mut pages = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..max_pages {
        let (ids, next) = page(client, base, path, query, cursor.as_deref()).await;
        pages.push((ids, next.clone()));
        match next {
            Some(next) => cursor = Some(next),
            None => return (pages, true),
        }
    }
    (pages, false)
}

const VOUCHERS: &str = "/tenants/1/catalog/vouchers";

#[tokio::test]
async fn a_cursor_cycle_leads_from_the_first_page_to_a_then_b_then_back_to_a_forever() {
    let sim = spawn_catalog(1, 200, 5).await;
    let client = simulator_client(sim.token());
    sim.set_listing_fault(Some(ListingFault::CursorCycle));

    for query in ["", "include=categories,variants"] {
        let (pages, ended) = walk(&client, &sim.base_url(), VOUCHERS, query, 7).await;
        assert!(!ended, "a cycle never ends ({query}): {pages:?}");
        let cursors: Vec<String> = pages.iter().map(|(_, c)| c.clone().unwrap()).collect();
        let (a, b) = (&cursors[0], &cursors[1]);
        assert_ne!(a, b, "A and B differ");
        for (i, cursor) in cursors.iter().enumerate() {
            let expected = if i % 2 == 0 { a } else { b };
            assert_eq!(
                cursor,
                expected,
                "page {} ({query}) must point to {}",
                i + 1,
                if i % 2 == 0 { "A" } else { "B" }
            );
        }
        // The pages under A and B are the real second and third pages.
        let ids = sim.record_ids(1, Resource::Vouchers);
        assert_eq!(pages[0].0.len(), 50);
        assert_eq!(pages[1].0.len(), 50);
        assert_eq!(pages[2].0.len(), 50);
        let first_three: BTreeSet<i64> = pages[..3].iter().flat_map(|(p, _)| p.clone()).collect();
        assert_eq!(
            first_three.len(),
            150,
            "three distinct pages before the cycle repeats"
        );
        assert!(first_three.iter().all(|id| ids.contains(id)));
        assert_eq!(pages[3].0, pages[1].0, "page A again");
    }

    sim.set_listing_fault(None);
    let (pages, ended) = walk(&client, &sim.base_url(), VOUCHERS, "", 10).await;
    assert!(ended, "cleared: the listing ends");
    assert_eq!(pages.len(), 4, "200 records, 4 pages");
}

#[tokio::test]
async fn a_cursor_cycle_also_cycles_a_listing_with_one_page_or_none() {
    let sim = spawn_catalog(1, 10, 5).await;
    let client = simulator_client(sim.token());
    sim.set_listing_fault(Some(ListingFault::CursorCycle));
    for query in ["", "updated_since=2099-01-01T00:00:00Z"] {
        let (pages, ended) = walk(&client, &sim.base_url(), VOUCHERS, query, 5).await;
        assert!(!ended, "{query}: {pages:?}");
        let cursors: Vec<String> = pages.iter().map(|(_, c)| c.clone().unwrap()).collect();
        assert_ne!(cursors[0], cursors[1], "{query}");
        assert_eq!(cursors[0], cursors[2], "{query}: B leads back to A");
        assert_eq!(cursors[1], cursors[3], "{query}");
    }
}

#[tokio::test]
async fn an_endless_listing_pages_to_the_real_end_then_repeats_the_first_page_under_fresh_cursors()
{
    let sim = spawn_catalog(1, 120, 5).await;
    let client = simulator_client(sim.token());
    sim.set_listing_fault(Some(ListingFault::Endless));

    let (pages, ended) = walk(&client, &sim.base_url(), VOUCHERS, "", 12).await;
    assert!(!ended, "an endless listing never ends");
    let cursors: BTreeSet<String> = pages.iter().map(|(_, c)| c.clone().unwrap()).collect();
    assert_eq!(cursors.len(), pages.len(), "no cursor is issued twice");
    let real: BTreeSet<i64> = pages[..3].iter().flat_map(|(p, _)| p.clone()).collect();
    assert_eq!(
        real.into_iter().collect::<Vec<_>>(),
        sim.record_ids(1, Resource::Vouchers),
        "the first three pages are the real listing"
    );
    for (i, (ids, _)) in pages.iter().enumerate().skip(3) {
        assert_eq!(ids, &pages[0].0, "page {} repeats the first page", i + 1);
    }

    // An incremental listing with nothing new is endless too (empty pages).
    let (pages, ended) = walk(
        &client,
        &sim.base_url(),
        VOUCHERS,
        "updated_since=2099-01-01T00:00:00Z",
        5,
    )
    .await;
    assert!(!ended);
    assert!(pages.iter().all(|(ids, _)| ids.is_empty()), "{pages:?}");
    let cursors: BTreeSet<String> = pages.iter().map(|(_, c)| c.clone().unwrap()).collect();
    assert_eq!(cursors.len(), 5);
}

#[tokio::test]
async fn a_listing_fault_of_one_stream_leaves_every_other_stream_alone() {
    let sim = spawn_catalog(2, 60, 5).await;
    let client = simulator_client(sim.token());
    sim.set_listing_fault_for(1, Resource::Vouchers, Some(ListingFault::Endless));
    let base = sim.base_url();
    assert!(!walk(&client, &base, VOUCHERS, "", 6).await.1);
    for path in [
        "/tenants/1/catalog/categories",
        "/tenants/2/catalog/vouchers",
    ] {
        assert!(walk(&client, &base, path, "", 6).await.1, "{path} ends");
    }
    // A stream's own fault wins over the global one; clearing it leaves the global one.
    sim.set_listing_fault(Some(ListingFault::CursorCycle));
    let (pages, _) = walk(&client, &base, VOUCHERS, "", 6).await;
    let cursors: BTreeSet<String> = pages.iter().map(|(_, c)| c.clone().unwrap()).collect();
    assert_eq!(cursors.len(), 6, "tenant 1 vouchers stay endless");
    sim.set_listing_fault_for(1, Resource::Vouchers, None);
    let (pages, _) = walk(&client, &base, VOUCHERS, "", 6).await;
    assert_eq!(pages[0].1, pages[2].1, "now the global cycle");
    sim.set_listing_fault(None);
    assert!(walk(&client, &base, VOUCHERS, "", 6).await.1);
}

async fn get(sim: &Simulator, client: &reqwest::Client, path: &str) -> (u16, String) {
    let response = client
        .get(format!("{}{path}", sim.base_url()))
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.text().await.unwrap())
}

#[tokio::test]
async fn an_oversize_record_is_listed_and_served_at_least_that_large_through_later_changes() {
    let sim = spawn_catalog(1, 60, 5).await;
    let client = simulator_client(sim.token());
    let before = sim.record_json(1, Resource::Vouchers, 7, false).unwrap();
    let before_category = sim.record_json(1, Resource::Categories, 2, false).unwrap();
    let before_at = parse(&before)["updated_at"].clone();

    assert!(sim.set_oversize(1, Resource::Vouchers, 7, 100_000));
    assert!(sim.set_oversize(1, Resource::Categories, 2, 30_000));
    assert!(
        !sim.set_oversize(1, Resource::Vouchers, 999, 10),
        "unknown record"
    );

    // The plain form is padded to just over the minimum; the include forms carry relations on top.
    let check = |what: &str, json: &str, min: usize| {
        assert!(json.len() >= min, "{what}: {} bytes < {min}", json.len());
        parse(json)
    };
    let plain_voucher = sim.record_json(1, Resource::Vouchers, 7, false).unwrap();
    assert!(
        plain_voucher.len() < 100_000 + 200,
        "padded far beyond: {}",
        plain_voucher.len()
    );
    for include in [false, true] {
        let voucher = check(
            "voucher",
            &sim.record_json(1, Resource::Vouchers, 7, include).unwrap(),
            100_000,
        );
        assert_eq!(
            voucher["updated_at"], before_at,
            "padding does not bump updated_at"
        );
        let original = parse(&before)["description_html"]
            .as_str()
            .unwrap_or("")
            .to_string();
        assert!(voucher["description_html"]
            .as_str()
            .unwrap()
            .starts_with(&original));
        check(
            "category",
            &sim.record_json(1, Resource::Categories, 2, include)
                .unwrap(),
            30_000,
        );
    }
    // Listed (in its page, as the exact bytes) and served by GET.
    let listed = common::raw_listing(
        &client,
        &sim.base_url(),
        VOUCHERS,
        "include=categories,variants",
    )
    .await;
    let exact = sim.record_json(1, Resource::Vouchers, 7, true).unwrap();
    assert!(
        listed.iter().any(|body| body.contains(&exact)),
        "record 7 is listed with its padding"
    );
    let (status, body) = get(&sim, &client, "/tenants/1/catalog/vouchers/7").await;
    assert_eq!(status, 200);
    assert!(body.len() > 100_000);
    let (status, body) = get(&sim, &client, "/tenants/1/catalog/categories/2").await;
    assert_eq!(status, 200);
    assert!(body.len() > 30_000);

    // Later changes keep it oversize.
    assert!(sim.update(1, Resource::Vouchers, 7));
    assert!(sim.update_silently(1, Resource::Categories, 2));
    check(
        "updated voucher",
        &sim.record_json(1, Resource::Vouchers, 7, false).unwrap(),
        100_000,
    );
    check(
        "updated category",
        &sim.record_json(1, Resource::Categories, 2, false).unwrap(),
        30_000,
    );

    // 0 removes the padding.
    sim.set_oversize(1, Resource::Categories, 2, 0);
    let category = sim.record_json(1, Resource::Categories, 2, false).unwrap();
    assert!(category.len() < 2_000);
    assert_eq!(
        parse(&category)["description_html"],
        parse(&before_category)["description_html"]
    );
}

fn parse(json: &str) -> Value {
    serde_json::from_str(json).unwrap()
}

#[tokio::test]
async fn a_restored_snapshot_brings_back_the_exact_bytes_of_the_earlier_version() {
    let sim = spawn_catalog(1, 30, 5).await;
    let forms = |id: i64| {
        (
            sim.record_json(1, Resource::Vouchers, id, false),
            sim.record_json(1, Resource::Vouchers, id, true),
        )
    };
    let original = forms(3);
    let snapshot = sim.snapshot(1, Resource::Vouchers, 3).unwrap();
    assert!(sim.update(1, Resource::Vouchers, 3));
    assert!(sim.update_silently(1, Resource::Vouchers, 3));
    assert_ne!(forms(3), original);

    // A revert: the exact bytes, updated_at included.
    assert!(sim.restore(1, &snapshot, false));
    assert_eq!(forms(3), original);

    // A re-creation with identical content after a delete.
    assert!(sim.delete(1, Resource::Vouchers, 3));
    assert!(sim.record_json(1, Resource::Vouchers, 3, false).is_none());
    assert!(sim.restore(1, &snapshot, false));
    assert_eq!(forms(3), original);
    assert!(sim.record_ids(1, Resource::Vouchers).contains(&3));

    // With a bump only updated_at differs.
    assert!(sim.restore(1, &snapshot, true));
    let strip = |json: Option<String>| {
        let mut v = parse(&json.unwrap());
        let at = v["updated_at"].take();
        (v, at)
    };
    let (bumped, bumped_at) = strip(forms(3).0);
    let (earlier, earlier_at) = strip(original.0.clone());
    assert_eq!(bumped, earlier);
    assert_ne!(bumped_at, earlier_at);

    // Categories too, and a new record never reuses a restored id.
    let category = sim.snapshot(1, Resource::Categories, 4).unwrap();
    let category_before = sim.record_json(1, Resource::Categories, 4, false);
    sim.update(1, Resource::Categories, 4);
    sim.restore(1, &category, false);
    assert_eq!(
        sim.record_json(1, Resource::Categories, 4, false),
        category_before
    );
    let created = sim.create(1, Resource::Vouchers);
    assert!(created > 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulate_takes_listing_fault_and_oversize_flags() {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut process = spawn_cli(&[
        "simulate",
        "--listen",
        &listen,
        "--tenants",
        "1",
        "--vouchers",
        "60",
        "--rate-limit",
        "0",
        "--listing-fault",
        "endless",
        "--oversize",
        "1:3:5000",
        "--oversize",
        "1:categories:2:7000",
    ]);
    let base = format!("http://{listen}/api/external/v1");
    let client = simulator_client("sim-token");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        if client
            .get(format!("{base}{VOUCHERS}/3"))
            .send()
            .await
            .is_ok()
        {
            break;
        }
        assert!(
            process.child.try_wait().unwrap().is_none(),
            "simulate exited: {}",
            process.stderr()
        );
        assert!(
            std::time::Instant::now() < deadline,
            "simulate never listened"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (pages, ended) = walk(&client, &base, VOUCHERS, "", 5).await;
    assert!(!ended, "--listing-fault endless: {pages:?}");
    let body = client
        .get(format!("{base}{VOUCHERS}/3"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(body.len() >= 5000, "{}", body.len());
    let body = client
        .get(format!("{base}/tenants/1/catalog/categories/2"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(body.len() >= 7000, "{}", body.len());
    process.signal("TERM");
    assert_eq!(process.wait_for(Duration::from_secs(10)), 0);

    for bad in [
        vec!["simulate", "--listing-fault", "sometimes"],
        vec!["simulate", "--oversize", "1:3"],
        vec!["simulate", "--oversize", "1:widgets:3:100"],
    ] {
        let (code, _, stderr) = common::run_cli(&bad);
        assert_eq!(code, 2, "{bad:?}: {stderr}");
        assert!(
            stderr.contains("--listing-fault") || stderr.contains("--oversize"),
            "{stderr}"
        );
    }
}
