//! The upstream client against the in-process simulator over loopback HTTP:
//! pagination, retries, typed errors, tolerant reading, budget sharing.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use chrono::{SubsecRound, Utc};
use futures::StreamExt;
use voucher_cdc::simulator::{Fault, Permission, RequestLogEntry, Simulator};
use voucher_cdc::stream::Resource;
use voucher_cdc::upstream::client::{ClientOptions, RedeemRequest, SecretToken, UpstreamClient};
use voucher_cdc::upstream::error::UpstreamError;
use voucher_cdc::upstream::page::{ListQuery, Page, Record};
use voucher_cdc::upstream::ratelimit::RateBudget;

/// Options for tests: the simulator's base URL, quick backoff.
fn options(sim: &Simulator) -> ClientOptions {
    ClientOptions {
        base_url: sim.base_url().parse().unwrap(),
        timeout: Duration::from_secs(10),
        backoff_initial: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
        ..ClientOptions::default()
    }
}

/// A client with its own unlimited budget.
fn client_with(opts: ClientOptions, token: &str) -> UpstreamClient {
    UpstreamClient::new(opts, SecretToken::new(token), Arc::new(RateBudget::new(0))).unwrap()
}

/// A client for the simulator's all-powerful token.
fn client(sim: &Simulator) -> UpstreamClient {
    client_with(options(sim), sim.token())
}

/// A simulator with the rate limit off.
async fn simulator(tenants: u64, vouchers: usize, categories: usize) -> Simulator {
    common::spawn_catalog(tenants, vouchers, categories).await
}

/// Every page of a listing, panicking on an error.
async fn all_pages(client: &UpstreamClient, resource: Resource, q: ListQuery) -> Vec<Page> {
    client
        .list_pages(1, resource, q)
        .map(|page| page.unwrap())
        .collect()
        .await
}

/// Requests whose path ends with `suffix`.
fn requests_to(sim: &Simulator, suffix: &str) -> Vec<RequestLogEntry> {
    sim.request_log()
        .into_iter()
        .filter(|entry| entry.path.ends_with(suffix))
        .collect()
}

/// The decoded value of `name` in a raw query string.
fn query_param(query: Option<&str>, name: &str) -> Option<String> {
    url::form_urlencoded::parse(query.unwrap_or("").as_bytes())
        .find(|(key, _)| key == name)
        .map(|(_, value)| value.into_owned())
}

/// Time between two logged requests.
fn gap(earlier: &RequestLogEntry, later: &RequestLogEntry) -> Duration {
    later.at.duration_since(earlier.at)
}

/// Makes the simulator answer its next request with `status` (no `Retry-After`).
fn fail_next(sim: &Simulator, status: u16) {
    sim.push_fault(Fault::Status {
        status,
        retry_after: None,
    });
}

/// Answers one voucher list request with 429 and `retry_after`; returns how long the client waited before retrying.
async fn wait_after_429(
    sim: &Simulator,
    client: &UpstreamClient,
    retry_after: Option<String>,
) -> Duration {
    sim.clear_request_log();
    sim.push_fault(Fault::Status {
        status: 429,
        retry_after,
    });
    client
        .list_page(1, Resource::Vouchers, &ListQuery::default())
        .await
        .unwrap();
    let log = requests_to(sim, "/catalog/vouchers");
    assert_eq!(log.iter().map(|e| e.status).collect::<Vec<_>>(), [429, 200]);
    gap(&log[0], &log[1])
}

#[tokio::test]
async fn pagination_over_1234_records_is_exact_byte_for_byte_and_costs_ceil_n_over_50_requests() {
    let sim = simulator(1, 1234, 5).await;
    let client = client(&sim);
    let q = ListQuery {
        include_relations: true,
        ..ListQuery::default()
    };
    let pages = all_pages(&client, Resource::Vouchers, q).await;

    let records: Vec<&Record> = pages.iter().flat_map(|p| &p.records).collect();
    assert_eq!(records.len(), 1234);
    let ids: HashSet<i64> = records.iter().map(|r| r.id).collect();
    assert_eq!(ids.len(), 1234, "a record was listed twice");
    let mut expected = sim.record_ids(1, Resource::Vouchers);
    let mut listed: Vec<i64> = ids.into_iter().collect();
    expected.sort();
    listed.sort();
    assert_eq!(listed, expected);
    for record in &records {
        let exact = sim
            .record_json(1, Resource::Vouchers, record.id, true)
            .unwrap();
        assert_eq!(record.raw.get(), exact, "record {} was altered", record.id);
    }
    assert!(pages.iter().all(|p| p.skipped == 0));
    assert!(pages.last().unwrap().next_cursor.is_none());

    let log = requests_to(&sim, "/tenants/1/catalog/vouchers");
    assert_eq!(
        log.len(),
        25,
        "1234 records must cost ceil(1234/50) = 25 requests"
    );
    assert_eq!(query_param(log[0].query.as_deref(), "cursor"), None);
    for (i, entry) in log.iter().enumerate() {
        assert_eq!(
            query_param(entry.query.as_deref(), "include").as_deref(),
            Some("categories,variants")
        );
        if i > 0 {
            assert_eq!(
                query_param(entry.query.as_deref(), "cursor"),
                pages[i - 1].next_cursor,
                "cursor of request {i} is not the previous next_cursor"
            );
        }
    }
}

#[tokio::test]
async fn a_listing_of_a_multiple_of_50_never_requests_an_empty_page_after_the_last() {
    let sim = simulator(1, 1000, 100).await;
    let client = client(&sim);
    let vouchers = all_pages(&client, Resource::Vouchers, ListQuery::default()).await;
    assert_eq!(
        vouchers.iter().map(|p| p.records.len()).sum::<usize>(),
        1000
    );
    assert_eq!(requests_to(&sim, "/catalog/vouchers").len(), 20);

    let q = ListQuery {
        include_relations: true,
        ..ListQuery::default()
    };
    let categories = all_pages(&client, Resource::Categories, q).await;
    assert_eq!(
        categories.iter().map(|p| p.records.len()).sum::<usize>(),
        100
    );
    let log = requests_to(&sim, "/catalog/categories");
    assert_eq!(log.len(), 2);
    assert_eq!(
        query_param(log[1].query.as_deref(), "include").as_deref(),
        Some("products")
    );
}

#[tokio::test]
async fn an_empty_listing_costs_exactly_one_request() {
    let sim = simulator(1, 0, 0).await;
    let pages = all_pages(&client(&sim), Resource::Vouchers, ListQuery::default()).await;
    assert_eq!(pages.len(), 1);
    assert!(pages[0].records.is_empty());
    assert_eq!(requests_to(&sim, "/catalog/vouchers").len(), 1);
}

#[tokio::test]
async fn updated_since_is_sent_on_every_page_and_filters_the_listing() {
    let sim = simulator(1, 300, 5).await;
    // The simulator keeps microseconds.
    let since = (Utc::now() + chrono::Duration::days(1)).trunc_subsecs(6);
    sim.set_clock(Some(since));
    let changed: Vec<i64> = sim.record_ids(1, Resource::Vouchers)[..120].to_vec();
    for id in &changed {
        assert!(sim.update(1, Resource::Vouchers, *id));
    }
    let q = ListQuery {
        updated_since: Some(since),
        ..ListQuery::default()
    };
    let pages = all_pages(&client(&sim), Resource::Vouchers, q).await;
    let mut listed: Vec<i64> = pages
        .iter()
        .flat_map(|p| &p.records)
        .map(|r| r.id)
        .collect();
    listed.sort();
    assert_eq!(listed, changed);
    assert_eq!(pages[0].server_time, since);
    let log = requests_to(&sim, "/catalog/vouchers");
    assert_eq!(log.len(), 3);
    for entry in &log {
        let sent = query_param(entry.query.as_deref(), "updated_since").unwrap();
        assert_eq!(sent.parse::<chrono::DateTime<Utc>>().unwrap(), since);
    }
}

#[tokio::test]
async fn get_voucher_and_get_category_return_one_record_as_the_api_wrote_it() {
    let sim = simulator(1, 10, 4).await;
    let client = client(&sim);
    let voucher_id = sim.record_ids(1, Resource::Vouchers)[3];
    let voucher = client.get_voucher(1, voucher_id).await.unwrap();
    assert_eq!(voucher.id, voucher_id);
    let listed: serde_json::Value = serde_json::from_str(
        &sim.record_json(1, Resource::Vouchers, voucher_id, true)
            .unwrap(),
    )
    .unwrap();
    let got: serde_json::Value = serde_json::from_str(voucher.raw.get()).unwrap();
    assert_eq!(got, listed);
    assert_eq!(voucher.updated_at.as_deref(), listed["updated_at"].as_str());

    let category_id = sim.record_ids(1, Resource::Categories)[0];
    let category = client.get_category(1, category_id).await.unwrap();
    assert_eq!(category.id, category_id);
    assert!(category.raw.get().contains("\"products\""));
}

#[tokio::test]
async fn retry_after_in_seconds_or_as_an_http_date_is_waited_out_before_the_retry() {
    let sim = simulator(1, 10, 1).await;
    let client = client(&sim);
    // Upper bounds are loose (a loaded machine) but far below the 60 s window.
    let waited = wait_after_429(&sim, &client, Some("2".into())).await;
    assert!(waited >= Duration::from_secs(2), "retried after {waited:?}");
    assert!(waited < Duration::from_secs(15), "retried after {waited:?}");

    let at = Utc::now() + chrono::Duration::seconds(3);
    let date = at.format("%a, %d %b %Y %H:%M:%S GMT").to_string();
    let waited = wait_after_429(&sim, &client, Some(date)).await;
    // The date has whole seconds, so the wait is between 2 and 3 seconds.
    assert!(
        waited >= Duration::from_millis(1900),
        "retried after {waited:?}"
    );
    assert!(waited < Duration::from_secs(15), "retried after {waited:?}");
}

#[tokio::test]
async fn a_429_without_retry_after_waits_one_window_and_a_huge_one_is_capped() {
    let sim = simulator(1, 10, 1).await;
    let opts = ClientOptions {
        rate_limit_window: Duration::from_millis(1500),
        retry_after_max: Duration::from_secs(1),
        ..options(&sim)
    };
    let uncapped = client_with(
        ClientOptions {
            retry_after_max: Duration::from_secs(120),
            ..opts.clone()
        },
        sim.token(),
    );
    let waited = wait_after_429(&sim, &uncapped, None).await;
    assert!(
        waited >= Duration::from_millis(1500),
        "retried after {waited:?}"
    );
    assert!(waited < Duration::from_secs(15), "retried after {waited:?}");

    let capped = client_with(opts, sim.token());
    let waited = wait_after_429(&sim, &capped, Some("3600".into())).await;
    assert!(waited >= Duration::from_secs(1), "retried after {waited:?}");
    assert!(waited < Duration::from_secs(15), "retried after {waited:?}");
}

#[tokio::test]
async fn a_429_holds_back_every_stream_that_shares_the_token() {
    let sim = simulator(1, 10, 3).await;
    let budget = Arc::new(RateBudget::new(0));
    let token = || SecretToken::new(sim.token());
    let vouchers = UpstreamClient::new(options(&sim), token(), budget.clone()).unwrap();
    let categories = UpstreamClient::new(options(&sim), token(), budget).unwrap();
    sim.push_fault(Fault::Status {
        status: 429,
        retry_after: Some("2".into()),
    });
    vouchers
        .list_page(1, Resource::Vouchers, &ListQuery::default())
        .await
        .unwrap();
    categories
        .list_page(1, Resource::Categories, &ListQuery::default())
        .await
        .unwrap();
    let limited = &requests_to(&sim, "/catalog/vouchers")[0];
    let other = &requests_to(&sim, "/catalog/categories")[0];
    assert_eq!(limited.status, 429);
    assert!(
        gap(limited, other) >= Duration::from_secs(2),
        "the other stream went ahead after {:?}",
        gap(limited, other)
    );
}

#[tokio::test]
async fn a_storm_of_5xx_is_survived_with_growing_backoff() {
    let sim = simulator(1, 10, 1).await;
    for status in [500, 502, 503, 504, 500] {
        fail_next(&sim, status);
    }
    let opts = ClientOptions {
        backoff_initial: Duration::from_millis(100),
        backoff_max: Duration::from_millis(400),
        ..options(&sim)
    };
    let page = client_with(opts, sim.token())
        .list_page(1, Resource::Vouchers, &ListQuery::default())
        .await
        .unwrap();
    assert_eq!(page.records.len(), 10);
    let log = requests_to(&sim, "/catalog/vouchers");
    let statuses: Vec<u16> = log.iter().map(|e| e.status).collect();
    assert_eq!(statuses, [500, 502, 503, 504, 500, 200]);
    // Backoff before attempt n+1 is at least half of min(100ms * 2^(n-1), 400ms).
    for (i, floor_ms) in [50, 100, 200, 200, 200].into_iter().enumerate() {
        let waited = gap(&log[i], &log[i + 1]);
        assert!(
            waited >= Duration::from_millis(floor_ms),
            "attempt {} came {waited:?} after the previous",
            i + 2
        );
    }
}

#[tokio::test]
async fn a_listing_completes_exactly_while_a_third_of_all_requests_fail() {
    let sim = simulator(1, 500, 1).await;
    sim.set_fail_rate(0.33);
    let opts = ClientOptions {
        max_attempts: 20,
        backoff_initial: Duration::from_millis(1),
        backoff_max: Duration::from_millis(5),
        ..options(&sim)
    };
    let client = client_with(opts, sim.token());
    let pages = all_pages(&client, Resource::Vouchers, ListQuery::default()).await;
    let mut listed: Vec<i64> = pages
        .iter()
        .flat_map(|p| &p.records)
        .map(|r| r.id)
        .collect();
    listed.sort();
    assert_eq!(listed, sim.record_ids(1, Resource::Vouchers));
    let log = requests_to(&sim, "/catalog/vouchers");
    assert_eq!(log.iter().filter(|e| e.status == 200).count(), 10);
}

#[tokio::test]
async fn a_5xx_storm_longer_than_the_attempts_surfaces_exhausted_with_the_last_status() {
    let sim = simulator(1, 10, 1).await;
    for _ in 0..6 {
        fail_next(&sim, 503);
    }
    let err = client(&sim)
        .list_page(1, Resource::Vouchers, &ListQuery::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, UpstreamError::Exhausted { attempts: 6, .. }),
        "{err:?}"
    );
    assert_eq!(err.status(), Some(503));
    assert!(err.is_retriable() && !err.is_parking());
    assert_eq!(
        err.to_string(),
        "upstream request to /tenants/1/catalog/vouchers failed after 6 attempts: \
         upstream returned 503 for /tenants/1/catalog/vouchers: injected fault: status 503"
    );
    assert_eq!(requests_to(&sim, "/catalog/vouchers").len(), 6);
}

#[tokio::test]
async fn malformed_and_truncated_bodies_are_retried_then_surfaced() {
    let sim = simulator(1, 80, 1).await;
    sim.push_fault(Fault::TruncatedBody);
    sim.push_fault(Fault::MalformedJson);
    let client = client(&sim);
    let page = client
        .list_page(1, Resource::Vouchers, &ListQuery::default())
        .await
        .unwrap();
    assert_eq!(page.records.len(), 50);
    assert_eq!(requests_to(&sim, "/catalog/vouchers").len(), 3);

    let opts = ClientOptions {
        max_attempts: 3,
        ..options(&sim)
    };
    let client = client_with(opts, sim.token());
    for fault in [Fault::TruncatedBody, Fault::MalformedJson] {
        for _ in 0..3 {
            sim.push_fault(fault.clone());
        }
        let err = client
            .list_page(1, Resource::Vouchers, &ListQuery::default())
            .await
            .unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(
                err,
                UpstreamError::Exhausted {
                    attempts: 3,
                    last_status: None,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(
            text.starts_with(
                "upstream request to /tenants/1/catalog/vouchers failed after 3 attempts: \
                 upstream sent an invalid response for /tenants/1/catalog/vouchers: \
                 body is not a list envelope: "
            ),
            "{text}"
        );
    }
}

#[tokio::test]
async fn dropped_connections_and_timeouts_are_retried_then_surfaced() {
    let sim = simulator(1, 10, 1).await;
    // A timeout a busy machine never hits by itself, faults far beyond it.
    let opts = ClientOptions {
        timeout: Duration::from_secs(3),
        max_attempts: 3,
        ..options(&sim)
    };
    let client = client_with(opts, sim.token());
    sim.push_fault(Fault::DropConnection);
    sim.push_fault(Fault::Delay(Duration::from_secs(60)));
    let page = client
        .list_page(1, Resource::Vouchers, &ListQuery::default())
        .await
        .unwrap();
    assert_eq!(page.records.len(), 10);

    for _ in 0..3 {
        sim.push_fault(Fault::Delay(Duration::from_secs(60)));
    }
    let err = client
        .list_page(1, Resource::Vouchers, &ListQuery::default())
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "upstream request to /tenants/1/catalog/vouchers failed after 3 attempts: \
         upstream request to /tenants/1/catalog/vouchers timed out after 3s"
    );

    for _ in 0..3 {
        sim.push_fault(Fault::DropConnection);
    }
    let err = client
        .list_page(1, Resource::Vouchers, &ListQuery::default())
        .await
        .unwrap_err();
    assert!(
        err.to_string().starts_with(
            "upstream request to /tenants/1/catalog/vouchers failed after 3 attempts: \
             upstream request to /tenants/1/catalog/vouchers failed: "
        ),
        "{err}"
    );
}

#[tokio::test]
async fn an_unreachable_upstream_is_a_transport_error_after_the_attempts() {
    let port = common::free_port();
    let opts = ClientOptions {
        base_url: format!("http://127.0.0.1:{port}/api/external/v1")
            .parse()
            .unwrap(),
        max_attempts: 2,
        backoff_initial: Duration::from_millis(1),
        ..ClientOptions::default()
    };
    let err = client_with(opts, "token-of-an-unreachable-upstream")
        .list_page(7, Resource::Categories, &ListQuery::default())
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with(
            "upstream request to /tenants/7/catalog/categories failed after 2 attempts: \
             upstream request to /tenants/7/catalog/categories failed: connecting failed: "
        ),
        "{text}"
    );
    assert!(!text.contains(&port.to_string()), "{text}");
}

#[tokio::test]
async fn every_4xx_maps_to_its_typed_error_with_the_upstream_message_and_no_retry() {
    let sim = simulator(2, 10, 1).await;
    sim.add_token("categories-only", None, &[Permission::ViewCategories]);
    sim.add_token(
        "tenant-two-only",
        Some(vec![2]),
        &[Permission::ViewVouchers, Permission::RedeemVouchers],
    );
    let all = client(&sim);
    let first_page = ListQuery::default();

    let err = client_with(options(&sim), "not-a-token")
        .list_page(1, Resource::Vouchers, &first_page)
        .await
        .unwrap_err();
    assert_eq!(
        err,
        UpstreamError::Unauthorized {
            path: "/tenants/1/catalog/vouchers".into(),
            message: "unauthenticated: the bearer token is not valid".into()
        }
    );
    assert!(err.is_parking());

    let err = client_with(options(&sim), "categories-only")
        .list_page(1, Resource::Vouchers, &first_page)
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "upstream returned 403 for /tenants/1/catalog/vouchers: forbidden: the token lacks the view_vouchers permission"
    );
    assert!(matches!(err, UpstreamError::Forbidden { .. }) && err.is_parking());

    let err = client_with(options(&sim), "tenant-two-only")
        .list_page(1, Resource::Vouchers, &first_page)
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(403));

    let err = all
        .list_page(99, Resource::Vouchers, &first_page)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, UpstreamError::NotFound { path, message }
        if path == "/tenants/99/catalog/vouchers" && message.contains("tenant 99")),
        "{err:?}"
    );
    let err = all.get_voucher(1, 987_654_321).await.unwrap_err();
    assert!(
        matches!(err, UpstreamError::NotFound { .. }) && err.is_parking(),
        "{err:?}"
    );

    let err = all.redeem(1, &RedeemRequest::default()).await.unwrap_err();
    let UpstreamError::Validation {
        path,
        message,
        errors,
    } = &err
    else {
        panic!("expected a validation error, got {err:?}");
    };
    assert_eq!(path, "/tenants/1/redemptions");
    assert_eq!(message, "either redemption_token or voucher_id is required");
    assert_eq!(
        errors.get("voucher_id"),
        Some(&vec![
            "either redemption_token or voucher_id is required".to_string()
        ])
    );
    assert!(!err.is_parking() && !err.is_retriable());

    for status in [400, 409, 410] {
        fail_next(&sim, status);
        let err = all
            .list_page(1, Resource::Categories, &first_page)
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("upstream returned unexpected {status} for /tenants/1/catalog/categories: injected fault: status {status}")
        );
        assert!(!err.is_retriable());
    }

    // Not one of these requests was retried.
    let log = sim.request_log();
    assert_eq!(log.len(), 9, "{log:#?}");
    assert!(log.iter().all(|e| (400..500).contains(&e.status)));
}

#[tokio::test]
async fn a_record_without_an_id_is_skipped_and_counted_without_failing_its_page() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let metrics = recorder.handle();
    let _guard = metrics::set_default_local_recorder(&recorder);
    let sim = simulator(1, 60, 1).await;
    sim.push_fault(Fault::RecordWithoutId);
    sim.push_fault(Fault::RecordWithoutId);
    let pages = all_pages(&client(&sim), Resource::Vouchers, ListQuery::default()).await;
    assert_eq!(pages.len(), 2);
    assert_eq!(pages[0].records.len(), 50);
    assert_eq!(pages[0].skipped, 1);
    assert_eq!(pages[1].records.len(), 10);
    assert_eq!(pages[1].skipped, 1);
    let mut listed: Vec<i64> = pages
        .iter()
        .flat_map(|p| &p.records)
        .map(|r| r.id)
        .collect();
    listed.sort();
    assert_eq!(listed, sim.record_ids(1, Resource::Vouchers));

    let text = metrics.render();
    for line in [
        "voucher_cdc_records_skipped_total{tenant=\"1\",resource=\"vouchers\"} 2",
        "voucher_cdc_upstream_requests_total{tenant=\"1\",resource=\"vouchers\",status=\"200\"} 2",
    ] {
        assert!(text.contains(line), "missing `{line}` in\n{text}");
    }
}

#[tokio::test]
async fn retries_and_rate_limits_are_counted_under_the_shared_metric_names() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let metrics = recorder.handle();
    let _guard = metrics::set_default_local_recorder(&recorder);
    let sim = simulator(1, 10, 1).await;
    sim.push_fault(Fault::Status {
        status: 429,
        retry_after: Some("0".into()),
    });
    fail_next(&sim, 502);
    sim.push_fault(Fault::MalformedJson);
    let client = client(&sim);
    client
        .list_page(1, Resource::Vouchers, &ListQuery::default())
        .await
        .unwrap();
    let text = metrics.render();
    let token_id = SecretToken::new(sim.token()).fingerprint();
    for line in [
        format!("voucher_cdc_upstream_rate_limited_total{{token_id=\"{token_id}\"}} 1"),
        "voucher_cdc_upstream_retries_total{tenant=\"1\",resource=\"vouchers\",reason=\"429\"} 1"
            .into(),
        "voucher_cdc_upstream_retries_total{tenant=\"1\",resource=\"vouchers\",reason=\"5xx\"} 1"
            .into(),
        "voucher_cdc_upstream_retries_total{tenant=\"1\",resource=\"vouchers\",reason=\"body\"} 1"
            .into(),
        "voucher_cdc_upstream_requests_total{tenant=\"1\",resource=\"vouchers\",status=\"429\"} 1"
            .into(),
        "voucher_cdc_upstream_requests_total{tenant=\"1\",resource=\"vouchers\",status=\"200\"} 2"
            .into(),
    ] {
        assert!(text.contains(&line), "missing `{line}` in\n{text}");
    }
}

#[tokio::test]
async fn redeem_returns_the_result_and_is_retried_only_after_a_429() {
    let sim = simulator(1, 5, 1).await;
    let today = Utc::now().date_naive();
    let redeemable: Vec<i64> = sim
        .purchased_voucher_ids(1)
        .into_iter()
        .filter(|id| {
            let v = sim.purchased_voucher(1, *id).unwrap();
            v.void == Some(false)
                && v.status.as_deref() == Some("redeemable")
                && v.current_balance.unwrap_or(0.0) > 0.0
                && v.date_valid_end.is_some_and(|end| end > today)
        })
        .collect();
    assert!(
        redeemable.len() >= 2,
        "the simulator has too few redeemable vouchers"
    );
    let client = client(&sim);
    let by_token = RedeemRequest {
        redemption_token: sim.redemption_token(1, redeemable[0]),
        ..RedeemRequest::default()
    };

    fail_next(&sim, 503);
    let err = client.redeem(1, &by_token).await.unwrap_err();
    assert_eq!(
        err,
        UpstreamError::Server {
            status: 503,
            path: "/tenants/1/redemptions".into(),
            message: "injected fault: status 503".into()
        }
    );
    assert_eq!(
        requests_to(&sim, "/redemptions").len(),
        1,
        "a POST was retried after a 5xx"
    );

    sim.push_fault(Fault::Status {
        status: 429,
        retry_after: Some("1".into()),
    });
    let result = client.redeem(1, &by_token).await.unwrap();
    assert_eq!(result["status"], "redeemed");
    assert_eq!(result["voucher"]["id"], redeemable[0]);
    let log = requests_to(&sim, "/redemptions");
    assert_eq!(
        log.iter().map(|e| e.status).collect::<Vec<_>>(),
        [503, 429, 200]
    );
    assert!(gap(&log[1], &log[2]) >= Duration::from_secs(1));

    let by_id = RedeemRequest {
        voucher_id: Some(redeemable[1]),
        ..RedeemRequest::default()
    };
    let result = client.redeem(1, &by_id).await.unwrap();
    assert_eq!(result["voucher"]["id"], redeemable[1]);
}

#[tokio::test]
async fn a_page_stream_ends_after_its_first_error() {
    let sim = simulator(1, 120, 1).await;
    let client = client(&sim);
    let mut pages = Box::pin(client.list_pages(1, Resource::Vouchers, ListQuery::default()));
    let first = pages.next().await.unwrap().unwrap();
    assert_eq!(first.records.len(), 50);
    fail_next(&sim, 403);
    let err = pages.next().await.unwrap().unwrap_err();
    assert_eq!(err.status(), Some(403));
    assert!(pages.next().await.is_none());
    assert_eq!(requests_to(&sim, "/catalog/vouchers").len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_paging_through_10000_records_does_not_starve_the_others() {
    let sim = simulator(2, 10_000, 150).await;
    // 3000 requests per minute: one every 20ms, shared by three streams.
    let budget = Arc::new(RateBudget::new(3000));
    let spacing = budget.spacing().unwrap();
    let started = std::time::Instant::now();
    let make = || {
        UpstreamClient::new(options(&sim), SecretToken::new(sim.token()), budget.clone()).unwrap()
    };
    let (big, small, gets) = (make(), make(), make());
    let big_listing = tokio::spawn(async move {
        let mut pages = 0;
        let mut stream = Box::pin(big.list_pages(1, Resource::Vouchers, ListQuery::default()));
        while let Some(page) = stream.next().await {
            page.unwrap();
            pages += 1;
        }
        pages
    });
    while requests_to(&sim, "/tenants/1/catalog/vouchers").len() < 5 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let small_listing = async {
        let mut stream = Box::pin(small.list_pages(2, Resource::Categories, ListQuery::default()));
        while let Some(page) = stream.next().await {
            page.unwrap();
        }
    };
    let voucher_ids = sim.record_ids(2, Resource::Vouchers);
    let single_gets = async {
        for id in &voucher_ids[..3] {
            gets.get_voucher(2, *id).await.unwrap();
        }
    };
    tokio::join!(small_listing, single_gets);
    let big_requests_so_far = requests_to(&sim, "/tenants/1/catalog/vouchers").len();
    assert_eq!(big_listing.await.unwrap(), 200);

    // Served in turn, the small streams finish after a handful of the big
    // stream's 200 requests; a budget that let the big listing run ahead
    // would serve them near its end. The bounds leave room for a busy
    // machine holding a small stream between two turns (exact FIFO order
    // is pinned with tokio's paused clock in src/upstream/ratelimit.rs).
    assert!(
        big_requests_so_far < 120,
        "the small streams finished only after {big_requests_so_far} of the big stream's 200 requests"
    );
    let log = sim.request_log();
    let small_positions: Vec<usize> = log
        .iter()
        .enumerate()
        .filter(|(_, e)| e.path.ends_with("/tenants/2/catalog/categories"))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(small_positions.len(), 3);
    for pair in small_positions.windows(2) {
        assert!(
            pair[1] - pair[0] <= 60,
            "{} other requests went between two turns of the small stream",
            pair[1] - pair[0] - 1
        );
    }
    // Paced by the one shared budget: each request is admitted at least one
    // spacing after the one before, so the last one reaches the server no
    // earlier than (n - 1) spacings after the test started, however late
    // any of them arrived (a lower bound that no scheduling delay can break).
    let last = log.last().unwrap().at.duration_since(started);
    assert!(
        last >= spacing * (log.len() as u32 - 1),
        "{} requests within {last:?}",
        log.len()
    );
}

#[tokio::test]
async fn a_next_cursor_that_repeats_the_cursor_sent_ends_the_stream_instead_of_looping() {
    // The simulator never does this, so a two-line upstream that always answers the same cursor stands in.
    let app = axum::Router::new().route(
        "/api/external/v1/tenants/1/catalog/vouchers",
        axum::routing::get(|| async {
            axum::Json(serde_json::json!({
                "data": [{"id": 1}], "next_cursor": "stuck", "server_time": "2024-01-01T00:00:00Z"
            }))
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let opts = ClientOptions {
        base_url: format!("http://{addr}/api/external/v1").parse().unwrap(),
        ..ClientOptions::default()
    };
    let results: Vec<Result<Page, UpstreamError>> = client_with(opts, "any-token")
        .list_pages(1, Resource::Vouchers, ListQuery::default())
        .collect()
        .await;
    assert_eq!(results.len(), 2);
    assert!(results[0].is_ok());
    assert_eq!(
        results[1].as_ref().unwrap_err().to_string(),
        "listing /tenants/1/catalog/vouchers does not end: next_cursor \"stuck\" repeats a \
         cursor this listing already followed (a cursor cycle) after 2 pages; the sweep stops \
         and the watermark does not move"
    );
}

/// Whether `future` finishes within `wait`.
async fn finishes_within<T>(
    wait: Duration,
    future: impl std::future::Future<Output = T>,
) -> Option<T> {
    tokio::time::timeout(wait, future).await.ok()
}

#[tokio::test]
async fn listing_bodies_beyond_the_clients_body_budget_are_read_only_once_held_pages_are_dropped() {
    let sim = simulator(2, 200, 20).await;
    // A budget of one unit: any page takes all of it.
    let client = client_with(
        ClientOptions {
            body_budget_bytes: 1,
            ..options(&sim)
        },
        sim.token(),
    );
    let query = ListQuery {
        include_relations: true,
        ..ListQuery::default()
    };
    let held = client
        .list_page(1, Resource::Categories, &query)
        .await
        .unwrap();
    assert_eq!(held.body.bytes(), 1024, "the whole budget");

    // Another tenant's page waits for it, its request answered but unread.
    let other = client.list_page(2, Resource::Categories, &query);
    tokio::pin!(other);
    assert!(
        finishes_within(Duration::from_millis(300), &mut other)
            .await
            .is_none(),
        "a second page was read while the first held the whole budget"
    );
    // Calls other than listings never wait: a holder may need them (a GET
    // confirming a delete) before it drops its page.
    let id = sim.record_ids(2, Resource::Categories)[0];
    let single = finishes_within(Duration::from_secs(5), client.get_category(2, id)).await;
    assert_eq!(single.expect("a single GET waited").unwrap().id, id);

    drop(held);
    let other = finishes_within(Duration::from_secs(5), &mut other)
        .await
        .expect("the page was not read once the budget was free")
        .unwrap();
    assert_eq!(other.records.len(), 20);
}

/// A listing page of `records` vouchers as the API writes it.
fn page_body(first_id: i64, records: i64) -> String {
    let filler = "x".repeat(1000);
    let data: Vec<String> = (first_id..first_id + records)
        .map(|id| format!(r#"{{"id":{id},"updated_at":"2026-01-01T00:00:00Z","name":"{filler}"}}"#))
        .collect();
    format!(
        r#"{{"data":[{}],"next_cursor":null,"server_time":"2026-01-01T00:00:00Z"}}"#,
        data.join(",")
    )
}

/// A one-shot HTTP server on loopback: it answers each of its connections'
/// one request with a page of 50 vouchers (`Connection: close`): tenant 1's
/// at once, tenant 2's headers and first half at once and its second half
/// `late` later, tenant 3's at once without a `Content-Length` (chunked).
async fn page_server(late: Duration) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buf = [0u8; 4096];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    let Ok(n @ 1..) = socket.read(&mut buf).await else {
                        return;
                    };
                    request.extend_from_slice(&buf[..n]);
                }
                let request = String::from_utf8_lossy(&request).into_owned();
                let tenant = (1..=3)
                    .find(|t| request.contains(&format!("/tenants/{t}/")))
                    .unwrap_or(1);
                let body = page_body(tenant * 100, 50);
                let head =
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n";
                if tenant == 3 {
                    let chunked = format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len());
                    let reply = format!("{head}transfer-encoding: chunked\r\n\r\n{chunked}");
                    let _ = socket.write_all(reply.as_bytes()).await;
                } else {
                    let head = format!("{head}content-length: {}\r\n\r\n", body.len());
                    let (first, second) = body.as_bytes().split_at(body.len() / 2);
                    let _ = socket.write_all(head.as_bytes()).await;
                    let _ = socket.write_all(first).await;
                    if tenant == 2 {
                        tokio::time::sleep(late).await;
                    }
                    let _ = socket.write_all(second).await;
                }
                let _ = socket.shutdown().await;
            });
        }
    });
    format!("http://{address}/api/external/v1")
}

/// A client of `page_server` at `base_url`, one attempt per request.
fn page_server_client(
    base_url: &str,
    body_budget_bytes: usize,
    timeout: Duration,
) -> UpstreamClient {
    client_with(
        ClientOptions {
            base_url: base_url.parse().unwrap(),
            body_budget_bytes,
            timeout,
            max_attempts: 1,
            ..ClientOptions::default()
        },
        "test-token",
    )
}

#[tokio::test]
async fn a_body_takes_its_content_length_of_the_budget_and_one_without_takes_all_of_it() {
    let base_url = page_server(Duration::ZERO).await;
    let client = page_server_client(&base_url, 4 << 20, Duration::from_secs(10));
    let query = ListQuery::default();
    let sized = client
        .list_page(1, Resource::Vouchers, &query)
        .await
        .unwrap();
    assert_eq!(
        sized.body.bytes(),
        page_body(100, 50).len().div_ceil(1024) * 1024
    );
    drop(sized);
    let chunked = client
        .list_page(3, Resource::Vouchers, &query)
        .await
        .unwrap();
    assert_eq!(chunked.records[0].id, 300);
    assert_eq!(
        chunked.body.bytes(),
        4 << 20,
        "an unknown length is read alone"
    );
}

#[tokio::test]
async fn a_body_waits_one_timeout_for_the_budget_then_is_read_without_the_wait_counted() {
    // Tenant 1's page holds the whole budget and is never dropped. Tenant
    // 2's body waits one timeout (0.5 s) for a share, then is read anyway;
    // its second half arrives 0.7 s after its headers: in time, as long as
    // the wait is not counted in the timeout.
    let base_url = page_server(Duration::from_millis(700)).await;
    let client = page_server_client(&base_url, 1, Duration::from_millis(500));
    let held = client
        .list_page(1, Resource::Vouchers, &ListQuery::default())
        .await
        .unwrap();
    let page = client
        .list_page(2, Resource::Vouchers, &ListQuery::default())
        .await
        .expect("the wait counted as a timeout");
    assert_eq!(page.records.len(), 50);
    assert_eq!(page.records[0].id, 200);
    assert_eq!(
        page.body.bytes(),
        0,
        "read beyond the budget, without a share"
    );
    assert_eq!(held.body.bytes(), 1024);
}

#[test]
fn tenants_with_tokens_of_their_own_hold_their_listing_bodies_within_one_budget() {
    let config = voucher_cdc::config::from_toml_str(
        r#"
[upstream]
base_url = "http://127.0.0.1:8080/api/external/v1"
token = "shared-token"

[[tenants]]
id = 1

[[tenants]]
id = 2
token = "tenant-two-token"
"#,
    )
    .unwrap();
    let streams: Vec<_> = [1, 2]
        .into_iter()
        .map(|tenant| voucher_cdc::stream::StreamKey::new(tenant, Resource::Categories))
        .collect();
    let clients =
        voucher_cdc::daemon::clients_with(&config, &streams, ClientOptions::default()).unwrap();
    let (one, two) = (&clients[&streams[0]], &clients[&streams[1]]);
    assert!(
        !Arc::ptr_eq(one.budget(), two.budget()),
        "two tokens, two request budgets"
    );
    assert!(Arc::ptr_eq(one.body_budget(), two.body_budget()));
}
