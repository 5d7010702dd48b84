//! A full minute of real requests against the simulator's own 120/min limit:
//! three streams share one token's budget and the simulator's request log
//! shows no minute with more than 120 requests, no 429, and a fair split.
//! (Real time on purpose: the simulator stamps its log and counts its window
//! with `std::time::Instant`, so tokio's paused clock cannot speed it up.)

mod common;

use std::time::Duration;

use futures::StreamExt;
use voucher_cdc::simulator::SimulatorOptions;
use voucher_cdc::stream::Resource;
use voucher_cdc::upstream::client::{ClientOptions, SecretToken, UpstreamClient};
use voucher_cdc::upstream::pagination::ListQuery;
use voucher_cdc::upstream::ratelimit::BudgetRegistry;

use common::spawn_simulator_with;

/// The upstream's documented budget.
const PER_MINUTE: usize = 120;
/// The window the budget applies to.
const MINUTE: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_minute_of_requests_from_three_streams_never_exceeds_the_budget() {
    let sim = spawn_simulator_with(SimulatorOptions {
        tenants: 3,
        vouchers: 400,
        categories: 5,
        rate_limit: PER_MINUTE as u32,
        retry_after_header: true,
        ..SimulatorOptions::default()
    })
    .await;
    let registry = BudgetRegistry::new();
    let opts = ClientOptions {
        base_url: sim.base_url().parse().unwrap(),
        ..ClientOptions::default()
    };
    let mut streams = Vec::new();
    for tenant in 1..=3u64 {
        // Each stream builds its own client; the registry gives them one budget.
        let token = SecretToken::new(sim.token());
        let budget = registry.budget_for(&token, PER_MINUTE as u32);
        let client = UpstreamClient::new(opts.clone(), token, budget).unwrap();
        streams.push(tokio::spawn(async move {
            loop {
                let mut pages =
                    Box::pin(client.list_pages(tenant, Resource::Vouchers, ListQuery::default()));
                while let Some(page) = pages.next().await {
                    page.unwrap();
                }
            }
        }));
    }
    let started = std::time::Instant::now();
    tokio::time::sleep(MINUTE + Duration::from_secs(6)).await;
    for stream in &streams {
        stream.abort();
    }
    let elapsed = started.elapsed();

    let log = sim.request_log();
    let limited = log.iter().filter(|e| e.status == 429).count();
    assert_eq!(limited, 0, "the simulator refused {limited} requests");
    // More than a minute's worth was asked for and sent: the budget was used, not merely respected.
    let most = (elapsed.as_millis() / 500) as usize + 1;
    assert!(
        (PER_MINUTE + 1..=most).contains(&log.len()),
        "{} requests in {elapsed:?}",
        log.len()
    );
    for (i, first) in log.iter().enumerate() {
        let in_minute = log[i..]
            .iter()
            .take_while(|e| e.at.duration_since(first.at) < MINUTE)
            .count();
        assert!(
            in_minute <= PER_MINUTE,
            "{in_minute} requests within one minute from request {i}"
        );
    }
    let closest = log
        .windows(2)
        .map(|pair| pair[1].at.duration_since(pair[0].at))
        .min()
        .unwrap();
    // Spaced evenly at 500 ms; the slack is arrival jitter on a busy machine, not a burst.
    assert!(
        closest >= Duration::from_millis(250),
        "two requests only {closest:?} apart"
    );
    for tenant in 1..=3 {
        let prefix = format!("/tenants/{tenant}/");
        let own = log.iter().filter(|e| e.path.contains(&prefix)).count();
        assert!(
            own * 4 >= log.len(),
            "tenant {tenant} got {own} of {} requests",
            log.len()
        );
    }
}
