//! The simulator's HTTP API, exercised from a real client over loopback.

mod common;

use std::collections::BTreeSet;

use common::{list_all, simulator_client, spawn_simulator};
use serde_json::Value;
use voucher_cdc::simulator::model::{CatalogCategory, CatalogVoucher, Collection};
use voucher_cdc::stream::Resource;

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

/// GETs `path` (relative to the base URL) and returns status, headers and the JSON body.
async fn fetch(
    client: &reqwest::Client,
    sim: &voucher_cdc::simulator::Simulator,
    path: &str,
) -> (u16, reqwest::header::HeaderMap, Value) {
    let response = client
        .get(format!("{}{path}", sim.base_url()))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let text = response.text().await.unwrap();
    let body =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}"));
    (status, headers, body)
}

fn assert_message_error(body: &Value, needle: &str) {
    let object = body.as_object().expect("error body is an object");
    assert!(
        object["message"].as_str().unwrap().contains(needle),
        "{body}"
    );
    assert_eq!(object.len(), 1, "MessageError has only message: {body}");
}

fn assert_validation_error(body: &Value, field: &str, needle: &str) {
    let errors = body["errors"]
        .as_object()
        .unwrap_or_else(|| panic!("no errors object: {body}"));
    let messages = errors[field]
        .as_array()
        .unwrap_or_else(|| panic!("no `{field}` errors: {body}"));
    assert!(
        messages
            .iter()
            .any(|m| m.as_str().unwrap().contains(needle)),
        "{body}"
    );
    assert!(body["message"].as_str().is_some());
}

#[tokio::test]
async fn include_fills_relations_on_lists_and_gets_always_carry_them() {
    let sim = spawn_simulator().await;
    let client = simulator_client(sim.token());
    let (_, _, page) = fetch(
        &client,
        &sim,
        "/tenants/2/catalog/vouchers?include=categories,variants",
    )
    .await;
    let mut saw_categories = false;
    for record in page["data"].as_array().unwrap() {
        assert_eq!(record["categories"], record["category_refs"]);
        assert_eq!(record["variants"], record["variant_summaries"]);
        saw_categories |= !record["categories"].as_array().unwrap().is_empty();
        let id = record["id"].as_i64().unwrap();
        let expected: Value =
            serde_json::from_str(&sim.record_json(2, Resource::Vouchers, id, true).unwrap())
                .unwrap();
        assert_eq!(record, &expected);
    }
    assert!(saw_categories);
    let (_, _, page) = fetch(
        &client,
        &sim,
        "/tenants/2/catalog/vouchers?include=variants",
    )
    .await;
    let record = &page["data"][0];
    assert!(record.get("categories").is_none() && record.get("variants").is_some());

    let id = sim.record_ids(2, Resource::Vouchers)[3];
    let (status, _, one) = fetch(&client, &sim, &format!("/tenants/2/catalog/vouchers/{id}")).await;
    assert_eq!(status, 200);
    assert!(one["data"]["categories"].is_array() && one["data"]["variants"].is_array());
    let _: CatalogVoucher = serde_json::from_value(one["data"].clone()).unwrap();

    let (_, _, plain) = fetch(&client, &sim, "/tenants/2/catalog/categories").await;
    assert!(plain["data"][0].get("products").is_none());
    let cid = sim.record_ids(2, Resource::Categories)[0];
    let (status, _, one) = fetch(
        &client,
        &sim,
        &format!("/tenants/2/catalog/categories/{cid}"),
    )
    .await;
    assert_eq!(status, 200);
    let products = one["data"]["products"].as_array().unwrap();
    for product in products {
        let pid = product["id"].as_i64().unwrap();
        let voucher: Value =
            serde_json::from_str(&sim.record_json(2, Resource::Vouchers, pid, false).unwrap())
                .unwrap();
        assert!(voucher["category_refs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["id"] == cid));
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn updated_since_is_inclusive_and_leaves_out_null_updated_at() {
    let sim = spawn_simulator().await;
    let client = simulator_client(sim.token());
    let all = list_all(&sim.base_url(), &client, "/tenants/1/catalog/vouchers", "").await;
    let nulls = all.iter().filter(|r| r["updated_at"].is_null()).count();
    assert!(
        nulls > 0 && nulls < all.len() / 10,
        "a few percent null: {nulls}"
    );
    let pivot = all[all.len() / 2]["updated_at"]
        .as_str()
        .unwrap()
        .to_string();
    let expected: BTreeSet<i64> = all
        .iter()
        .filter(|r| {
            r["updated_at"]
                .as_str()
                .is_some_and(|t| t >= pivot.as_str())
        })
        .map(|r| r["id"].as_i64().unwrap())
        .collect();
    let query = format!("updated_since={}", pivot.replace(':', "%3A"));
    let since = list_all(
        &sim.base_url(),
        &client,
        "/tenants/1/catalog/vouchers",
        &query,
    )
    .await;
    let got: BTreeSet<i64> = since.iter().map(|r| r["id"].as_i64().unwrap()).collect();
    assert_eq!(got, expected);
    assert!(
        since.iter().any(|r| r["updated_at"] == pivot.as_str()),
        "the pivot itself is included"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn every_page_carries_server_time_from_the_simulator_clock() {
    let sim = spawn_simulator().await;
    let client = simulator_client(sim.token());
    let before = chrono::Utc::now() - chrono::Duration::seconds(1);
    let (_, _, page) = fetch(&client, &sim, "/tenants/1/catalog/vouchers").await;
    let first: Collection<Value> = serde_json::from_value(page.clone()).unwrap();
    assert!(first.server_time >= before);
    let text = page["server_time"].as_str().unwrap();
    assert!(
        text.ends_with('Z') && text.len() == "2024-01-01T00:00:00.000000Z".len(),
        "{text}"
    );
    let frozen: chrono::DateTime<chrono::Utc> = "2030-05-06T07:08:09.123456Z".parse().unwrap();
    sim.set_clock(Some(frozen));
    let cursor = first.next_cursor.unwrap();
    let (_, _, page) = fetch(
        &client,
        &sim,
        &format!("/tenants/1/catalog/vouchers?cursor={cursor}"),
    )
    .await;
    assert_eq!(page["server_time"], "2030-05-06T07:08:09.123456Z");
    let id = sim.create(1, Resource::Vouchers);
    let record: Value =
        serde_json::from_str(&sim.record_json(1, Resource::Vouchers, id, false).unwrap()).unwrap();
    assert_eq!(record["updated_at"], "2030-05-06T07:08:09.123456Z");
    sim.shutdown().await;
}

#[tokio::test]
async fn forged_edited_or_reused_cursors_are_refused_with_422_on_cursor() {
    let sim = spawn_simulator().await;
    let client = simulator_client(sim.token());
    let (_, _, page) = fetch(
        &client,
        &sim,
        "/tenants/1/catalog/vouchers?include=variants",
    )
    .await;
    let cursor = page["next_cursor"].as_str().unwrap().to_string();
    let mut edited = cursor.clone().into_bytes();
    edited[5] = if edited[5] == b'A' { b'B' } else { b'A' };
    let edited = String::from_utf8(edited).unwrap();
    for (query, needle) in [
        (format!("include=variants&cursor={edited}"), "signature"),
        (
            "include=variants&cursor=bm90LWEtY3Vyc29y".to_string(),
            "malformed",
        ),
        ("include=variants&cursor=%2F%2F%2F".to_string(), "malformed"),
        (format!("cursor={cursor}"), "different query"),
        (
            format!("include=variants&updated_since=2024-01-01T00:00:00Z&cursor={cursor}"),
            "different query",
        ),
    ] {
        let (status, _, body) = fetch(
            &client,
            &sim,
            &format!("/tenants/1/catalog/vouchers?{query}"),
        )
        .await;
        assert_eq!(status, 422, "{query}");
        assert_validation_error(&body, "cursor", needle);
    }
    let (status, _, body) = fetch(
        &client,
        &sim,
        &format!("/tenants/2/catalog/vouchers?include=variants&cursor={cursor}"),
    )
    .await;
    assert_eq!(status, 422);
    assert_validation_error(&body, "cursor", "different query");
    let (status, _, _) = fetch(
        &client,
        &sim,
        &format!("/tenants/1/catalog/vouchers?include=variants&cursor={cursor}"),
    )
    .await;
    assert_eq!(status, 200, "the untouched cursor still works");
    sim.shutdown().await;
}

#[tokio::test]
async fn malformed_queries_get_422_with_errors_by_field() {
    let sim = spawn_simulator().await;
    let client = simulator_client(sim.token());
    let cases = [
        (
            "/tenants/1/catalog/vouchers?updated_since=yesterday",
            "updated_since",
            "ISO-8601",
        ),
        (
            "/tenants/1/catalog/vouchers?updated_since=2024-13-45T00:00:00Z",
            "updated_since",
            "ISO-8601",
        ),
        (
            "/tenants/1/catalog/vouchers?include=products",
            "include",
            "valid options are categories, variants",
        ),
        (
            "/tenants/1/catalog/categories?include=variants",
            "include",
            "valid options are products",
        ),
        (
            "/tenants/1/catalog/vouchers?page=2",
            "page",
            "unknown query parameter",
        ),
        (
            "/tenants/1/catalog/vouchers?cursor=a&cursor=b",
            "cursor",
            "only once",
        ),
        (
            "/tenants/1/catalog/vouchers?include=%E0%80",
            "query",
            "percent-encoded",
        ),
        (
            "/tenants/1/catalog/vouchers?include=%Z1",
            "query",
            "percent-encoded",
        ),
        (
            "/tenants/1/catalog/vouchers/1?include=variants",
            "include",
            "takes none",
        ),
    ];
    for (path, field, needle) in cases {
        let (status, _, body) = fetch(&client, &sim, path).await;
        assert_eq!(status, 422, "{path}");
        assert_validation_error(&body, field, needle);
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn tokens_are_checked_for_presence_validity_tenant_scope_and_permission() {
    let sim = spawn_simulator().await;
    use voucher_cdc::simulator::Permission;
    sim.add_token(
        "tenant-1-vouchers",
        Some(vec![1]),
        &[Permission::ViewVouchers],
    );
    let anonymous = reqwest::Client::new();
    let base = sim.base_url();
    let response = anonymous
        .get(format!("{base}/tenants/1/catalog/vouchers"))
        .header("accept", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    assert_message_error(&response.json().await.unwrap(), "Authorization: Bearer");
    let response = anonymous
        .get(format!("{base}/tenants/1/catalog/vouchers"))
        .header("accept", "application/json")
        .header("authorization", format!("Basic {}", sim.token()))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    let (status, _, body) = fetch(
        &simulator_client("nope"),
        &sim,
        "/tenants/1/catalog/vouchers",
    )
    .await;
    assert_eq!(status, 401);
    assert_message_error(&body, "not valid");

    let scoped = simulator_client("tenant-1-vouchers");
    assert_eq!(
        fetch(&scoped, &sim, "/tenants/1/catalog/vouchers").await.0,
        200
    );
    let (status, _, body) = fetch(&scoped, &sim, "/tenants/2/catalog/vouchers").await;
    assert_eq!(status, 403);
    assert_message_error(&body, "no access to tenant 2");
    let (status, _, body) = fetch(&scoped, &sim, "/tenants/99/catalog/vouchers").await;
    assert_eq!(
        status, 403,
        "a tenant outside the scope is 403 even when unknown"
    );
    assert_message_error(&body, "tenant 99");
    let (status, _, body) = fetch(&scoped, &sim, "/tenants/1/catalog/categories").await;
    assert_eq!(status, 403);
    assert_message_error(&body, "view_categories");
    let response = scoped
        .post(format!("{base}/tenants/1/redemptions"))
        .header("content-type", "application/json")
        .body(r#"{"voucher_id": 5001}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 403);
    assert_message_error(&response.json().await.unwrap(), "redeem_vouchers");
    sim.shutdown().await;
}

#[tokio::test]
async fn unknown_tenants_records_and_paths_are_404_message_errors() {
    let sim = spawn_simulator().await;
    let client = simulator_client(sim.token());
    let max = sim
        .record_ids(1, Resource::Vouchers)
        .last()
        .copied()
        .unwrap();
    let cases = [
        ("/tenants/4/catalog/vouchers", "tenant 4 not found"),
        ("/tenants/0/catalog/categories", "tenant 0 not found"),
        ("/tenants/abc/catalog/vouchers", "tenant `abc` not found"),
        ("/tenants/-1/catalog/vouchers", "not found"),
        (
            "/tenants/99999999999999999999999/catalog/vouchers",
            "not found",
        ),
        ("/tenants/1/catalog/vouchers/abc", "voucher `abc` not found"),
        (
            "/tenants/1/catalog/categories/999999",
            "category `999999` not found",
        ),
        ("/tenants/1/catalog/vouchers/", "no endpoint"),
        ("/tenants/1/catalog/products", "no endpoint"),
        ("/tenants/1", "no endpoint"),
    ];
    for (path, needle) in cases {
        let (status, _, body) = fetch(&client, &sim, path).await;
        assert_eq!(status, 404, "{path}");
        assert_message_error(&body, needle);
    }
    let (status, _, body) = fetch(
        &client,
        &sim,
        &format!("/tenants/1/catalog/vouchers/{}", max + 1),
    )
    .await;
    assert_eq!(status, 404);
    assert_message_error(&body, "not found in tenant 1");
    let response = client
        .get(format!("http://{}/", sim.addr()))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
    assert_message_error(&response.json().await.unwrap(), "no endpoint");
    let response = client
        .delete(format!("{}/tenants/1/catalog/vouchers", sim.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 405);
    assert_message_error(&response.json().await.unwrap(), "not allowed");
    sim.shutdown().await;
}

#[tokio::test]
async fn successes_carry_request_id_and_no_store_cache_control() {
    let sim = spawn_simulator().await;
    let client = simulator_client(sim.token());
    let mut ids = BTreeSet::new();
    for path in [
        "/tenants/1/catalog/vouchers",
        "/tenants/1/catalog/categories",
        "/tenants/1/catalog/vouchers/1",
    ] {
        let (status, headers, _) = fetch(&client, &sim, path).await;
        assert_eq!(status, 200);
        assert_eq!(headers["cache-control"], "private, no-store");
        assert_eq!(headers["content-type"], "application/json");
        ids.insert(headers["x-request-id"].to_str().unwrap().to_string());
    }
    assert_eq!(ids.len(), 3, "request ids are unique");
    sim.shutdown().await;
}

#[tokio::test]
async fn an_accept_other_than_application_json_is_refused_with_a_clear_body() {
    let sim = spawn_simulator().await;
    let url = format!("{}/tenants/1/catalog/vouchers", sim.base_url());
    let client = reqwest::Client::new();
    for accept in [
        None,
        Some("text/html"),
        Some("*/*"),
        Some("application/xml"),
    ] {
        let mut request = client.get(&url).bearer_auth(sim.token());
        if let Some(accept) = accept {
            request = request.header("accept", accept);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 406, "{accept:?}");
        assert_message_error(&response.json().await.unwrap(), "Accept: application/json");
    }
    for accept in [
        "application/json; charset=utf-8",
        "text/html, application/json;q=0.9",
        "Application/JSON",
    ] {
        let response = client
            .get(&url)
            .bearer_auth(sim.token())
            .header("accept", accept)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{accept}");
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn the_request_log_records_every_request_with_a_token_fingerprint_only() {
    let sim = spawn_simulator().await;
    let client = simulator_client(sim.token());
    fetch(
        &client,
        &sim,
        "/tenants/1/catalog/vouchers?include=variants",
    )
    .await;
    fetch(&client, &sim, "/tenants/9/catalog/vouchers").await;
    let log = sim.request_log();
    assert_eq!(log.len(), 2);
    assert_eq!(log[0].method, "GET");
    assert_eq!(log[0].path, "/api/external/v1/tenants/1/catalog/vouchers");
    assert_eq!(log[0].query.as_deref(), Some("include=variants"));
    assert_eq!((log[0].status, log[1].status), (200, 404));
    let fingerprint = log[0].token_fingerprint.clone().unwrap();
    assert_eq!(
        fingerprint,
        voucher_cdc::simulator::token_fingerprint(sim.token())
    );
    assert!(!fingerprint.contains(sim.token()));
    assert!(log[0].at <= log[1].at);
    sim.clear_request_log();
    assert!(sim.request_log().is_empty());
    sim.shutdown().await;
}

fn client_from(token: &str, local: &str) -> reqwest::Client {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert("accept", "application/json".parse().unwrap());
    headers.insert("authorization", format!("Bearer {token}").parse().unwrap());
    reqwest::Client::builder()
        .default_headers(headers)
        .local_address(Some(local.parse().unwrap()))
        .build()
        .unwrap()
}

#[tokio::test]
async fn the_rate_limit_is_a_per_minute_budget_per_token_and_client_ip() {
    use voucher_cdc::simulator::{Permission, SimulatorOptions};
    let sim = common::spawn_simulator_with(SimulatorOptions {
        rate_limit: 3,
        ..SimulatorOptions::default()
    })
    .await;
    sim.add_token("second", None, &Permission::ALL);
    let path = "/tenants/1/catalog/categories";
    let first = client_from(sim.token(), "127.0.0.1");
    for _ in 0..3 {
        assert_eq!(fetch(&first, &sim, path).await.0, 200);
    }
    let (status, headers, body) = fetch(&first, &sim, path).await;
    assert_eq!(status, 429);
    assert_message_error(&body, "3 per minute");
    let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    // Another token from the same IP and the same token from another IP have their own budgets.
    assert_eq!(
        fetch(&client_from("second", "127.0.0.1"), &sim, path)
            .await
            .0,
        200
    );
    assert_eq!(
        fetch(&client_from(sim.token(), "127.0.0.2"), &sim, path)
            .await
            .0,
        200
    );
    // 401s are not charged to anyone.
    assert_eq!(
        fetch(&client_from("unknown", "127.0.0.1"), &sim, path)
            .await
            .0,
        401
    );
    sim.set_rate_limit(0);
    assert_eq!(
        fetch(&first, &sim, path).await.0,
        200,
        "0 turns the limit off"
    );
    sim.shutdown().await;

    let sim = common::spawn_simulator_with(SimulatorOptions {
        rate_limit: 1,
        retry_after_header: false,
        ..SimulatorOptions::default()
    })
    .await;
    let client = simulator_client(sim.token());
    assert_eq!(fetch(&client, &sim, path).await.0, 200);
    let (status, headers, _) = fetch(&client, &sim, path).await;
    assert_eq!(status, 429);
    assert!(headers.get("retry-after").is_none());
    sim.shutdown().await;
}

fn parse(json: &str) -> Value {
    serde_json::from_str(json).unwrap()
}

fn without_updated_at(mut value: Value) -> Value {
    value.as_object_mut().unwrap().remove("updated_at");
    value
}

#[tokio::test]
async fn mutations_change_content_and_updated_at_exactly_as_named() {
    let sim = spawn_simulator().await;
    let t0: chrono::DateTime<chrono::Utc> = "2031-01-01T00:00:00Z".parse().unwrap();
    sim.set_clock(Some(t0));
    for resource in Resource::ALL {
        let id = sim.record_ids(1, resource)[1];
        let json = |sim: &voucher_cdc::simulator::Simulator| {
            parse(&sim.record_json(1, resource, id, false).unwrap())
        };
        let before = json(&sim);

        assert!(sim.update(1, resource, id));
        let updated = json(&sim);
        assert_eq!(updated["updated_at"], "2031-01-01T00:00:00.000000Z");
        assert_ne!(
            without_updated_at(updated.clone()),
            without_updated_at(before.clone())
        );

        assert!(sim.update_silently(1, resource, id));
        let silent = json(&sim);
        assert_eq!(silent["updated_at"], updated["updated_at"]);
        assert_ne!(
            without_updated_at(silent.clone()),
            without_updated_at(updated.clone())
        );

        sim.set_clock(Some(t0 + chrono::Duration::seconds(5)));
        assert!(sim.touch(1, resource, id));
        let touched = json(&sim);
        assert_eq!(touched["updated_at"], "2031-01-01T00:00:05.000000Z");
        assert_eq!(
            without_updated_at(touched.clone()),
            without_updated_at(silent)
        );

        assert!(sim.set_updated_at(1, resource, id, None));
        assert!(json(&sim)["updated_at"].is_null());
        sim.set_clock(Some(t0));

        let created = sim.create(1, resource);
        assert!(sim.record_ids(1, resource).contains(&created));
        assert!(sim.delete(1, resource, created));
        assert!(!sim.delete(1, resource, created));
        assert!(!sim.update(1, resource, created));
        assert!(!sim.touch(1, resource, created));
        assert!(sim.record_json(1, resource, created, false).is_none());
    }
    assert!(!sim.update(42, Resource::Vouchers, 1), "unknown tenant");
    sim.shutdown().await;
}

#[tokio::test]
async fn listed_bytes_follow_mutations_and_deleted_records_disappear() {
    let sim = spawn_simulator().await;
    let client = simulator_client(sim.token());
    let ids = sim.record_ids(3, Resource::Vouchers);
    let (deleted, updated) = (ids[0], ids[1]);
    assert!(sim.delete(3, Resource::Vouchers, deleted));
    assert!(sim.update(3, Resource::Vouchers, updated));
    let all = list_all(&sim.base_url(), &client, "/tenants/3/catalog/vouchers", "").await;
    assert!(all.iter().all(|r| r["id"] != deleted));
    let last = all.last().unwrap();
    assert_eq!(last["id"], updated, "the freshest update sorts last");
    assert_eq!(
        last,
        &parse(
            &sim.record_json(3, Resource::Vouchers, updated, false)
                .unwrap()
        )
    );
    let (status, _, _) = fetch(
        &client,
        &sim,
        &format!("/tenants/3/catalog/vouchers/{deleted}"),
    )
    .await;
    assert_eq!(status, 404);
    sim.shutdown().await;
}

#[tokio::test]
async fn deleting_a_category_unlinks_it_from_vouchers_without_bumping_them() {
    let sim = spawn_simulator().await;
    let client = simulator_client(sim.token());
    let (_, _, category) = fetch(&client, &sim, "/tenants/1/catalog/categories/1").await;
    let products = category["data"]["products"].as_array().unwrap().clone();
    assert!(!products.is_empty());
    let voucher_id = products[0]["id"].as_i64().unwrap();
    let before = parse(
        &sim.record_json(1, Resource::Vouchers, voucher_id, false)
            .unwrap(),
    );
    assert!(sim.delete(1, Resource::Categories, 1));
    let after = parse(
        &sim.record_json(1, Resource::Vouchers, voucher_id, false)
            .unwrap(),
    );
    assert_eq!(before["updated_at"], after["updated_at"]);
    assert!(after["category_refs"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["id"] != 1));
    sim.shutdown().await;
}

#[tokio::test]
async fn ties_on_updated_at_are_ordered_by_id_and_paged_without_loss() {
    let sim = spawn_simulator().await;
    let client = simulator_client(sim.token());
    let tie: chrono::DateTime<chrono::Utc> = "2032-02-02T02:02:02.020202Z".parse().unwrap();
    let ids = sim.record_ids(1, Resource::Vouchers);
    for id in &ids[..120] {
        sim.set_updated_at(1, Resource::Vouchers, *id, Some(tie));
    }
    let got = list_all(
        &sim.base_url(),
        &client,
        "/tenants/1/catalog/vouchers",
        "updated_since=2032-02-02T02:02:02.020202Z",
    )
    .await;
    let got: Vec<i64> = got.iter().map(|r| r["id"].as_i64().unwrap()).collect();
    assert_eq!(got, ids[..120].to_vec());
    sim.shutdown().await;
}

#[tokio::test]
async fn pushed_faults_are_consumed_in_order_by_the_next_matching_request() {
    use voucher_cdc::simulator::Fault;
    let sim = spawn_simulator().await;
    let client = simulator_client(sim.token());
    let url = format!("{}/tenants/1/catalog/vouchers", sim.base_url());
    sim.push_fault(Fault::Status {
        status: 503,
        retry_after: Some("7".into()),
    });
    sim.push_fault(Fault::Status {
        status: 429,
        retry_after: None,
    });
    let response = client.get(&url).send().await.unwrap();
    assert_eq!(response.status(), 503);
    assert_eq!(response.headers()["retry-after"], "7");
    assert_message_error(&response.json().await.unwrap(), "injected");
    let response = client.get(&url).send().await.unwrap();
    assert_eq!(response.status(), 429);
    assert!(response.headers().get("retry-after").is_none());
    assert_eq!(client.get(&url).send().await.unwrap().status(), 200);

    sim.push_fault(Fault::TruncatedBody);
    let response = client.get(&url).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    assert!(text.starts_with("{\"data\":[") && serde_json::from_str::<Value>(&text).is_err());

    sim.push_fault(Fault::MalformedJson);
    let text = client.get(&url).send().await.unwrap().text().await.unwrap();
    assert!(serde_json::from_str::<Value>(&text).is_err());

    // RecordWithoutId waits for a list page; a get before it leaves it queued.
    sim.push_fault(Fault::RecordWithoutId);
    sim.push_fault(Fault::RecordWithoutId);
    assert_eq!(
        client
            .get(format!("{url}/1"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let page: Value = client.get(&url).send().await.unwrap().json().await.unwrap();
    let data = page["data"].as_array().unwrap();
    assert_eq!(data.len(), 51);
    assert!(data[50].get("id").is_none());
    let page: Value = client.get(&url).send().await.unwrap().json().await.unwrap();
    assert!(page["data"][50]["id"].is_string());
    let page: Value = client.get(&url).send().await.unwrap().json().await.unwrap();
    assert_eq!(page["data"].as_array().unwrap().len(), 50);

    sim.push_fault(Fault::Delay(std::time::Duration::from_millis(300)));
    let started = std::time::Instant::now();
    assert_eq!(client.get(&url).send().await.unwrap().status(), 200);
    assert!(started.elapsed() >= std::time::Duration::from_millis(300));

    sim.push_fault(Fault::DropConnection);
    let error = client.get(&url).send().await.unwrap_err();
    assert!(!error.is_status(), "{error}");
    assert_eq!(
        client.get(&url).send().await.unwrap().status(),
        200,
        "the next connection works"
    );
    let log = sim.request_log();
    assert!(
        log.iter().any(|e| e.status == 0),
        "the dropped request is logged with status 0"
    );
    sim.push_fault(Fault::Status {
        status: 101,
        retry_after: None,
    });
    assert_eq!(
        client.get(&url).send().await.unwrap().status(),
        500,
        "a 1xx fault becomes 500"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn fail_rate_and_latency_apply_to_every_request_until_changed() {
    let sim = spawn_simulator().await;
    let client = simulator_client(sim.token());
    sim.set_fail_rate(1.0);
    for _ in 0..10 {
        let (status, _, body) = fetch(&client, &sim, "/tenants/1/catalog/categories").await;
        assert!((500..600).contains(&status));
        assert_message_error(&body, "injected failure");
    }
    sim.set_fail_rate(0.0);
    sim.set_latency(std::time::Duration::from_millis(250));
    let started = std::time::Instant::now();
    assert_eq!(
        fetch(&client, &sim, "/tenants/1/catalog/categories")
            .await
            .0,
        200
    );
    assert!(started.elapsed() >= std::time::Duration::from_millis(250));
    sim.shutdown().await;
}

#[tokio::test]
async fn the_background_mutator_creates_updates_touches_and_deletes() {
    use voucher_cdc::simulator::SimulatorOptions;
    let sim = common::spawn_simulator_with(SimulatorOptions {
        rate_limit: 0,
        tenants: 1,
        vouchers: 60,
        categories: 5,
        changes_per_minute: 60_000,
        ..SimulatorOptions::default()
    })
    .await;
    let client = simulator_client(sim.token());
    let start = sim.now();
    let before: BTreeSet<i64> = sim.record_ids(1, Resource::Vouchers).into_iter().collect();
    let query = format!(
        "updated_since={}",
        start.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
    );
    // 1,000 changes a second: each kind shows up within milliseconds, but a
    // busy machine may hold the mutator back, so poll instead of sleeping.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let (mut created, mut deleted, mut bumped) = (false, false, false);
    while !(created && deleted && bumped) {
        assert!(
            std::time::Instant::now() < deadline,
            "within 30s: records created {created}, deleted {deleted}, existing ones bumped {bumped}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let after: BTreeSet<i64> = sim.record_ids(1, Resource::Vouchers).into_iter().collect();
        created |= after.difference(&before).count() > 0;
        deleted |= before.difference(&after).count() > 0;
        let changed = list_all(
            &sim.base_url(),
            &client,
            "/tenants/1/catalog/vouchers",
            &query,
        )
        .await;
        bumped |= changed
            .iter()
            .any(|r| before.contains(&r["id"].as_i64().unwrap()));
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn data_is_deterministic_from_the_seed_and_realistic() {
    use voucher_cdc::simulator::SimulatorOptions;
    let a = spawn_simulator().await;
    let b = spawn_simulator().await;
    let c = common::spawn_simulator_with(SimulatorOptions {
        seed: 7,
        ..SimulatorOptions::default()
    })
    .await;
    let ids = a.record_ids(2, Resource::Vouchers);
    assert_eq!(ids, b.record_ids(2, Resource::Vouchers));
    let mut differs = false;
    let mut currencies = BTreeSet::new();
    let (mut null_prices, mut part_redeem, mut decimals_ok) = (0, 0, true);
    for id in ids {
        let json = a.record_json(2, Resource::Vouchers, id, true).unwrap();
        assert_eq!(
            Some(&json),
            b.record_json(2, Resource::Vouchers, id, true).as_ref()
        );
        differs |= Some(&json) != c.record_json(2, Resource::Vouchers, id, true).as_ref();
        let voucher: CatalogVoucher = serde_json::from_str(&json).unwrap();
        currencies.insert(voucher.currency.clone());
        null_prices += usize::from(voucher.price.is_none());
        part_redeem += usize::from(voucher.allow_part_redeem);
        for p in [voucher.price, voucher.sale_price, voucher.from_price]
            .into_iter()
            .flatten()
        {
            decimals_ok &= ((p * 100.0).round() - p * 100.0).abs() < 1e-6 && p > 0.0;
        }
    }
    assert!(differs, "another seed gives other data");
    assert!(
        currencies.len() >= 2 && currencies.contains("EUR"),
        "{currencies:?}"
    );
    assert!(null_prices > 0 && part_redeem > 0 && decimals_ok);
    for sim in [a, b, c] {
        sim.shutdown().await;
    }
}

async fn redeem(
    client: &reqwest::Client,
    sim: &voucher_cdc::simulator::Simulator,
    tenant: u64,
    body: Value,
) -> (u16, Value) {
    let response = client
        .post(format!("{}/tenants/{tenant}/redemptions", sim.base_url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

#[tokio::test]
async fn redemptions_honour_balances_part_redeem_and_voucher_state() {
    use voucher_cdc::simulator::model::{RedemptionResult, Single};
    let sim = spawn_simulator().await;
    let client = simulator_client(sim.token());
    // Fixed states: 5001 monetary part, 5002 monetary full-only, 5003 experience,
    // 5004 void, 5005 expired, 5006 already redeemed.
    let part = sim.purchased_voucher(1, 5001).unwrap();
    assert_eq!(part.allow_part_redeem, Some(true));
    let balance = part.current_balance.unwrap();

    let (status, body) = redeem(
        &client,
        &sim,
        1,
        serde_json::json!({"voucher_id": 5001, "amount": 10.5}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let result: Single<RedemptionResult> = serde_json::from_value(body).unwrap();
    assert_eq!(result.data.status, "redeemed");
    assert_eq!(result.data.voucher.current_balance, Some(balance - 10.5));
    assert_eq!(
        result.data.voucher.redemption_status.as_deref(),
        Some("part_redeemed")
    );
    assert_eq!(result.data.tenant.id, 1);

    let (status, body) = redeem(
        &client,
        &sim,
        1,
        serde_json::json!({"voucher_id": 5001, "amount": 1000}),
    )
    .await;
    assert_eq!(status, 422);
    assert_validation_error(&body, "amount", "insufficient balance");

    let token = sim.redemption_token(1, 5001).unwrap();
    let (status, body) = redeem(
        &client,
        &sim,
        1,
        serde_json::json!({"redemption_token": token}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"]["voucher"]["current_balance"], 0.0);
    assert_eq!(body["data"]["reason_code"], "full_redemption");

    let (status, body) = redeem(
        &client,
        &sim,
        1,
        serde_json::json!({"voucher_id": 5002, "amount": 1}),
    )
    .await;
    assert_eq!(status, 422);
    assert_validation_error(&body, "amount", "part redemption is not allowed");
    let (status, _) = redeem(&client, &sim, 1, serde_json::json!({"voucher_id": 5002})).await;
    assert_eq!(status, 200);

    let (status, _) = redeem(&client, &sim, 1, serde_json::json!({"voucher_id": 5003})).await;
    assert_eq!(status, 200, "an experience voucher is redeemed whole");

    for (id, needle) in [
        (5004, "void"),
        (5005, "expired"),
        (5006, "already fully redeemed"),
        (5001, "already fully redeemed"),
    ] {
        let (status, body) = redeem(&client, &sim, 1, serde_json::json!({"voucher_id": id})).await;
        assert_eq!(status, 422, "{id}");
        assert_validation_error(&body, "voucher_id", needle);
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn bad_redeem_requests_get_the_spec_status_and_body() {
    let sim = spawn_simulator().await;
    let client = simulator_client(sim.token());
    let other_tenant_token = sim.redemption_token(2, 5001).unwrap();
    let cases = [
        (
            serde_json::json!({}),
            "voucher_id",
            "either redemption_token or voucher_id",
        ),
        (
            serde_json::json!({"voucher_id": "5001"}),
            "voucher_id",
            "positive integer",
        ),
        (
            serde_json::json!({"voucher_id": 5001, "amount": "ten"}),
            "amount",
            "number",
        ),
        (
            serde_json::json!({"voucher_id": 5001, "amount": 0}),
            "amount",
            "positive",
        ),
        (
            serde_json::json!({"voucher_id": 5001, "amount": 1.234}),
            "amount",
            "2 decimals",
        ),
        (
            serde_json::json!({"voucher_id": 5001, "colour": "red"}),
            "colour",
            "unknown field",
        ),
        (
            serde_json::json!({"redemption_token": "rt_5001_deadbeef"}),
            "redemption_token",
            "invalid or expired",
        ),
        (
            serde_json::json!({"redemption_token": other_tenant_token}),
            "redemption_token",
            "invalid or expired",
        ),
        (
            serde_json::json!({"redemption_token": sim.redemption_token(1, 5001).unwrap(), "voucher_id": 5002}),
            "voucher_id",
            "does not match",
        ),
        (serde_json::json!([1, 2]), "body", "JSON object"),
    ];
    for (body, field, needle) in cases {
        let (status, response) = redeem(&client, &sim, 1, body.clone()).await;
        assert_eq!(status, 422, "{body}");
        assert_validation_error(&response, field, needle);
    }
    let (status, body) = redeem(&client, &sim, 1, serde_json::json!({"voucher_id": 999999})).await;
    assert_eq!(status, 404);
    assert_message_error(&body, "voucher 999999 not found");

    let url = format!("{}/tenants/1/redemptions", sim.base_url());
    let response = client
        .post(&url)
        .header("content-type", "application/json")
        .body("{\"voucher_id\":")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 422);
    assert_validation_error(&response.json().await.unwrap(), "body", "not valid JSON");
    let response = client
        .post(&url)
        .body("voucher_id=5001")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 415);
    assert_message_error(
        &response.json().await.unwrap(),
        "Content-Type: application/json",
    );
    let response = client
        .post(&url)
        .header("content-type", "application/json")
        .body(vec![b' '; 100 * 1024])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 413);
    assert_message_error(&response.json().await.unwrap(), "body");
    sim.shutdown().await;
}

#[tokio::test]
async fn no_malformed_request_produces_a_500_or_a_non_json_body() {
    let sim = spawn_simulator().await;
    let client = simulator_client(sim.token());
    let base = format!("http://{}", sim.addr());
    let paths = [
        "/api/external/v1/tenants/1/catalog/vouchers?%",
        "/api/external/v1/tenants/1/catalog/vouchers?&&&=&=",
        "/api/external/v1/tenants/1/catalog/vouchers?updated_since=%00",
        "/api/external/v1/tenants/1/catalog/vouchers?cursor=%FF%FE",
        "/api/external/v1/tenants/1/catalog/vouchers?include=,,,",
        "/api/external/v1/tenants/1/catalog/vouchers?updated_since=99999-01-01T00:00:00Z",
        "/api/external/v1/tenants/1/catalog/vouchers?updated_since=-0001-01-01T00:00:00Z",
        "/api/external/v1/tenants/%FF/catalog/vouchers",
        "/api/external/v1/tenants/1/catalog/vouchers/%C0",
        "/api/external/v1/tenants/1/catalog/vouchers/9223372036854775808",
        "/api/external/v1/tenants/18446744073709551615/catalog/vouchers",
        "/api/external/v1/tenants//catalog/vouchers",
        "/api/external/v1//tenants/1/catalog/vouchers",
        "/api/external/v1/tenants/1/catalog/vouchers/1/extra",
        "/api/external/v1/%2e%2e/etc/passwd",
        "/api/external/v1",
        "/favicon.ico",
    ];
    for path in paths {
        for method in [
            reqwest::Method::GET,
            reqwest::Method::POST,
            reqwest::Method::PUT,
            reqwest::Method::HEAD,
        ] {
            let response = client
                .request(method.clone(), format!("{base}{path}"))
                .header("content-type", "application/json")
                .body("{}")
                .send()
                .await
                .unwrap();
            let status = response.status().as_u16();
            assert!(status < 500, "{method} {path} gave {status}");
            if method != reqwest::Method::HEAD && status != 200 {
                let text = response.text().await.unwrap();
                let body: Value = serde_json::from_str(&text)
                    .unwrap_or_else(|_| panic!("{method} {path}: {text}"));
                assert!(body["message"].is_string(), "{method} {path}: {text}");
            }
        }
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn run_serves_until_its_shutdown_future_completes() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: voucher_cdc::simulator::SimulateArgs,
    }
    let port = common::free_port();
    let cli = Cli::try_parse_from([
        "simulate",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--tenants",
        "2",
        "--vouchers",
        "30",
        "--categories",
        "4",
        "--changes-per-minute",
        "0",
        "--seed",
        "9",
        "--token",
        "t0k",
        "--rate-limit",
        "0",
        "--fail-rate",
        "0",
        "--latency",
        "1ms",
    ])
    .unwrap();
    assert_eq!(cli.args.latency, std::time::Duration::from_millis(1));
    assert!(Cli::try_parse_from(["simulate", "--fail-rate", "1.5"]).is_err());
    assert!(Cli::try_parse_from(["simulate", "--tenants", "0"]).is_err());
    assert!(Cli::try_parse_from(["simulate", "--latency", "soon"]).is_err());
    let defaults = Cli::try_parse_from(["simulate"]).unwrap().args;
    assert_eq!(defaults.listen.to_string(), "127.0.0.1:8080");
    assert_eq!(
        (
            defaults.tenants,
            defaults.vouchers,
            defaults.categories,
            defaults.rate_limit
        ),
        (3, 200, 20, 120)
    );
    assert_eq!((defaults.seed, defaults.token.as_str()), (42, "sim-token"));

    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(voucher_cdc::simulator::run(cli.args, async move {
        let _ = stopped.await;
    }));
    let client = simulator_client("t0k");
    let url = format!("http://127.0.0.1:{port}/api/external/v1/tenants/2/catalog/vouchers");
    let mut status = 0;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while std::time::Instant::now() < deadline {
        if let Ok(response) = client.get(&url).send().await {
            status = response.status().as_u16();
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(status, 200);
    assert_eq!(
        fetch_status(
            &client,
            &format!("http://127.0.0.1:{port}/api/external/v1/tenants/3/catalog/vouchers")
        )
        .await,
        404
    );
    stop.send(()).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(10), server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

async fn fetch_status(client: &reqwest::Client, url: &str) -> u16 {
    client.get(url).send().await.unwrap().status().as_u16()
}
