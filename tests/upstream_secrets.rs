//! The bearer token never shows: every log line at trace level (ours, reqwest's,
//! hyper's), every error message and every Debug output is searched for it
//! while the client goes through success, retries and every failure it knows.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use voucher_cdc::simulator::{Fault, Permission, SimulatorOptions};
use voucher_cdc::stream::Resource;
use voucher_cdc::upstream::client::{ClientOptions, RedeemRequest, SecretToken, UpstreamClient};
use voucher_cdc::upstream::page::ListQuery;
use voucher_cdc::upstream::ratelimit::{BudgetRegistry, RateBudget};

use common::spawn_simulator_with;

/// The token the client uses; it must appear nowhere.
const SECRET: &str = "sk_live_7f3a9c2e-do-not-print-me";
/// A token the upstream rejects; it must appear nowhere either.
const WRONG_SECRET: &str = "sk_live_0000-rejected-token";
/// A token that may list categories only.
const NARROW_SECRET: &str = "sk_live_narrow-categories-only";

/// A `MakeWriter` collecting every formatted log line.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

#[tokio::test]
async fn the_bearer_token_never_appears_in_trace_logs_errors_or_debug_output() {
    let logs = Captured::default();
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(logs.clone())
        .with_ansi(false)
        .try_init()
        .unwrap();

    let sim = spawn_simulator_with(SimulatorOptions {
        tenants: 1,
        vouchers: 120,
        categories: 3,
        rate_limit: 0,
        token: SECRET.to_string(),
        ..SimulatorOptions::default()
    })
    .await;
    sim.add_token(NARROW_SECRET, None, &[Permission::ViewCategories]);
    let opts = ClientOptions {
        base_url: sim.base_url().parse().unwrap(),
        timeout: Duration::from_millis(300),
        max_attempts: 2,
        backoff_initial: Duration::from_millis(1),
        retry_after_max: Duration::from_millis(10),
        ..ClientOptions::default()
    };
    let registry = BudgetRegistry::new();
    let make = |token: &str| {
        let token = SecretToken::new(token);
        let budget = registry.budget_for(&token, 6000, std::time::Duration::from_secs(60));
        UpstreamClient::new(opts.clone(), token, budget).unwrap()
    };
    let client = make(SECRET);
    let mut seen = Vec::new();

    // Success across pages, with one record the client has to skip.
    sim.push_fault(Fault::RecordWithoutId);
    let pages: Vec<_> = client
        .list_pages(1, Resource::Vouchers, ListQuery::default())
        .collect()
        .await;
    assert_eq!(pages.len(), 3);
    for page in pages {
        seen.push(format!("{:?}", page.unwrap().next_cursor));
    }
    let id = sim.record_ids(1, Resource::Vouchers)[0];
    seen.push(format!("{:?}", client.get_voucher(1, id).await.unwrap()));

    // Retried failures: 429, 5xx, broken bodies, a dropped connection, a timeout.
    for fault in [
        Fault::Status {
            status: 429,
            retry_after: Some("0".into()),
        },
        Fault::Status {
            status: 503,
            retry_after: None,
        },
        Fault::MalformedJson,
        Fault::TruncatedBody,
        Fault::DropConnection,
        Fault::Delay(Duration::from_secs(1)),
    ] {
        sim.push_fault(fault.clone());
        sim.push_fault(fault);
        let err = client
            .list_page(1, Resource::Categories, &ListQuery::default())
            .await
            .unwrap_err();
        seen.push(err.to_string());
        seen.push(format!("{err:?}"));
    }

    // Final failures: 401, 403, 404, 422, and an unreachable upstream.
    let mut errors = vec![
        make(WRONG_SECRET)
            .list_page(1, Resource::Vouchers, &ListQuery::default())
            .await
            .unwrap_err(),
        make(NARROW_SECRET)
            .list_page(1, Resource::Vouchers, &ListQuery::default())
            .await
            .unwrap_err(),
        client.get_category(1, 424_242).await.unwrap_err(),
        client
            .redeem(1, &RedeemRequest::default())
            .await
            .unwrap_err(),
    ];
    let unreachable = UpstreamClient::new(
        ClientOptions {
            base_url: "http://127.0.0.1:9/api/external/v1".parse().unwrap(),
            ..opts.clone()
        },
        SecretToken::new(SECRET),
        Arc::new(RateBudget::new(0)),
    )
    .unwrap();
    errors.push(
        unreachable
            .list_page(1, Resource::Vouchers, &ListQuery::default())
            .await
            .unwrap_err(),
    );
    let statuses: Vec<Option<u16>> = errors.iter().map(|e| e.status()).collect();
    assert_eq!(statuses, [Some(401), Some(403), Some(404), Some(422), None]);
    for err in &errors {
        seen.push(err.to_string());
        seen.push(format!("{err:?}"));
    }

    // Debug of everything that holds the token.
    seen.push(format!("{client:?}"));
    seen.push(format!("{unreachable:?}"));
    seen.push(format!("{:?}", SecretToken::new(SECRET)));
    seen.push(format!("{}", SecretToken::new(SECRET)));
    seen.push(format!("{registry:?}"));
    seen.push(format!("{opts:?}"));
    let bad_token = UpstreamClient::new(
        opts.clone(),
        SecretToken::new(format!("{SECRET}\n")),
        Arc::new(RateBudget::new(0)),
    )
    .unwrap_err();
    seen.push(bad_token.to_string());

    let logs = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    // The capture really ran at trace level, through our events and the HTTP stack's.
    assert!(logs.contains("TRACE"), "no trace output captured");
    assert!(logs.contains("upstream response"), "no client debug output");
    assert!(logs.contains("retrying"), "no retry warnings");
    assert!(
        logs.contains("skipping a listed record without a usable integer id")
            && logs.contains("tenant=1")
            && logs.contains("position=50"),
        "the skipped record was not reported with tenant and position"
    );
    for secret in [SECRET, WRONG_SECRET, NARROW_SECRET] {
        // Neither the token nor a recognisable part of it.
        let probe = &secret[8..];
        assert!(!logs.contains(probe), "a token leaked into the logs");
        for text in &seen {
            assert!(!text.contains(probe), "a token leaked into: {text}");
        }
    }
}
