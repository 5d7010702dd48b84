//! Real requests across a real window boundary of the simulator's own
//! 120/min limiter: three streams share one token's budget, the first window
//! is opened by a request the simulator holds back 1 s (a late window opener,
//! the case the pacing margin is for), and the simulator refuses nothing.
//!
//! Real time on purpose: the simulator counts its window with
//! `std::time::Instant`, so tokio's paused clock cannot speed it up, and its
//! window is a fixed 60 s. Nothing here asserts on how fast the machine is:
//! the test ends when the simulator has logged a request well into the second
//! window, and checks only what the limiter decided and what its log holds.
//! The exact pacing is tested in virtual time in `src/upstream/ratelimit.rs`.

mod common;

use std::time::Duration;

use futures::StreamExt;
use voucher_cdc::simulator::SimulatorOptions;
use voucher_cdc::stream::Resource;
use voucher_cdc::upstream::client::{ClientOptions, SecretToken, UpstreamClient};
use voucher_cdc::upstream::page::ListQuery;
use voucher_cdc::upstream::ratelimit::BudgetRegistry;

use common::spawn_simulator_with;

/// The upstream's documented budget.
const PER_MINUTE: usize = 120;
/// The window the budget applies to.
const MINUTE: Duration = Duration::from_secs(60);
/// How late the simulator answers (and counts) the window-opening requests.
const LATE_OPENER: Duration = Duration::from_secs(1);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_streams_across_a_window_boundary_with_a_late_window_opener_are_never_refused() {
    let sim = spawn_simulator_with(SimulatorOptions {
        tenants: 3,
        vouchers: 400,
        categories: 5,
        rate_limit: PER_MINUTE as u32,
        retry_after_header: true,
        // Applied before the rate check: the first requests are counted 1 s
        // after they were sent, so the first window opens 1 s late.
        latency: LATE_OPENER,
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
        let budget = registry.budget_for(&token, PER_MINUTE as u32, Duration::from_secs(60));
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
    // Once the first request is through, the others arrive at once.
    wait_for_log("the first request was answered", &sim, |log| {
        !log.is_empty()
    })
    .await;
    sim.set_latency(Duration::ZERO);
    // Well into the second window (it opens at the first request counted 60 s
    // after the first window opened).
    wait_for_log("a request 65 s after the first", &sim, |log| {
        log.iter()
            .any(|e| e.at.duration_since(log[0].at) >= MINUTE + Duration::from_secs(5))
    })
    .await;
    for stream in &streams {
        stream.abort();
    }

    let mut log = sim.request_log();
    log.sort_by_key(|e| e.at);
    let limited = log.iter().filter(|e| e.status == 429).count();
    assert_eq!(limited, 0, "the simulator refused {limited} requests");
    // More than a window's worth was sent: the window boundary was crossed
    // with the budget in use, not merely respected.
    assert!(log.len() > PER_MINUTE, "{} requests", log.len());
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

/// Polls the simulator's request log until `done` holds (at most 5 minutes:
/// generous, the condition normally holds after about 66 s).
async fn wait_for_log(
    what: &str,
    sim: &voucher_cdc::simulator::Simulator,
    done: impl Fn(&[voucher_cdc::simulator::RequestLogEntry]) -> bool,
) {
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    loop {
        let mut log = sim.request_log();
        log.sort_by_key(|e| e.at);
        if done(&log) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting until {what}: {} requests logged",
            log.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
