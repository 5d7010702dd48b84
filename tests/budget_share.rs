//! Two daemons on one token behind one IP share the upstream's window without
//! knowing: each paces its own configured budget, so together they ask for
//! twice what the upstream grants. The learnt budget (multiplicative decrease
//! on a 429, additive increase per quiet window) must bring them to a fair
//! split of the real budget with few 429s.
//!
//! Two real daemons (each a whole `Daemon`: its own config, store, planner
//! and budget) poll disjoint tenants with the same token as fast as their
//! budgets let them. The simulator's real limiter counts a 1 s window
//! (`rate_window`) and the daemons are told so (`upstream.rate_window`), so
//! the test sees 40 windows in 40 s. Real time on purpose (the simulator's
//! limiter reads `std::time::Instant`); the bounds leave room for a busy
//! machine, and the exact AIMD steps are tested in virtual time in
//! `src/upstream/ratelimit.rs`.

mod common;

use std::time::{Duration, Instant};

use voucher_cdc::simulator::SimulatorOptions;

use common::{spawn_daemon, spawn_simulator_with, TestConfig};

/// What the upstream grants per window (for the token and IP both daemons share).
const LIMIT: u32 = 30;
/// The upstream's window, and each daemon's `upstream.rate_window`.
const WINDOW: Duration = Duration::from_secs(1);
/// Windows the daemons run for; the second half is "after convergence".
const WINDOWS: u32 = 40;
/// Tenants per daemon: daemon 0 streams tenants 1-6, daemon 1 tenants 7-12.
const TENANTS_EACH: u64 = 6;

/// The tenant a request was for (`/tenants/{tenant}/...`).
fn tenant_of(path: &str) -> Option<u64> {
    let rest = path.split("/tenants/").nth(1)?;
    rest.split('/').next()?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_daemons_on_one_token_converge_to_a_fair_split_of_the_real_budget_with_few_429s() {
    let sim = spawn_simulator_with(SimulatorOptions {
        tenants: 2 * TENANTS_EACH,
        vouchers: 10,
        categories: 1,
        rate_limit: LIMIT,
        rate_window: WINDOW,
        retry_after_header: true,
        ..SimulatorOptions::default()
    })
    .await;
    let start = Instant::now();
    let mut daemons = Vec::new();
    let mut dirs = Vec::new();
    for daemon in 0..2u64 {
        let dir = tempfile::tempdir().unwrap();
        let tenants: Vec<u64> = (1..=TENANTS_EACH)
            .map(|t| daemon * TENANTS_EACH + t)
            .collect();
        // Each daemon configures the whole budget: it cannot know about the other.
        let config = TestConfig::for_simulator(&sim, dir.path(), &tenants)
            .with_budget(LIMIT, WINDOW)
            .with_poll_interval(Duration::from_millis(50))
            .with_full_resync_interval(Duration::from_secs(3600))
            .with_max_attempts(100);
        daemons.push(spawn_daemon(&config).await);
        dirs.push(dir);
    }
    let run_for = WINDOW * WINDOWS;
    tokio::time::sleep(run_for.saturating_sub(start.elapsed())).await;
    let mut learnt = Vec::new();
    for daemon in &daemons {
        let status = daemon.status().await;
        let per_minute = status["budgets"][0]["learnt_per_minute"]
            .as_f64()
            .unwrap_or_else(|| panic!("no learnt budget in {status}"));
        learnt.push((per_minute * WINDOW.as_secs_f64() / 60.0).round() as u32);
    }
    for daemon in &mut daemons {
        daemon.stop().await;
    }

    let half = run_for / 2;
    let log = sim.request_log();
    let in_second_half = |at: Instant| {
        let at = at.saturating_duration_since(start);
        at >= half && at < run_for
    };
    let refused = |from: Duration, to: Duration| {
        log.iter()
            .filter(|r| r.status == 429)
            .map(|r| r.at.saturating_duration_since(start))
            .filter(|at| *at >= from && *at < to)
            .count()
    };
    let (early, late) = (refused(Duration::ZERO, half), refused(half, run_for));
    let per_daemon: Vec<usize> = (0..2u64)
        .map(|d| {
            log.iter()
                .filter(|r| r.status == 200 && in_second_half(r.at))
                .filter_map(|r| tenant_of(&r.path))
                .filter(|t| (t - 1) / TENANTS_EACH == d)
                .count()
        })
        .collect();
    let summary = format!(
        "429s first half {early}, second half {late}; answered in the second half \
         {per_daemon:?} by daemon; learnt {learnt:?} of {LIMIT} each"
    );
    eprintln!("{summary}");

    // Both configured the whole budget and learnt to ask for about half of it.
    assert!(learnt.iter().all(|l| *l < LIMIT), "{summary}");
    let together: u32 = learnt.iter().sum();
    assert!(
        (LIMIT * 6 / 10..=LIMIT * 13 / 10).contains(&together),
        "{summary}"
    );
    // After convergence a 429 is rare: at most one every two windows.
    let windows = (WINDOWS / 2) as usize;
    assert!(late * 2 <= windows, "{summary}");
    // Neither starves: each gets at least a third of what the upstream answered.
    let total: usize = per_daemon.iter().sum();
    assert!(per_daemon.iter().all(|n| n * 3 >= total), "{summary}");
    // And together they still use most of the real budget.
    assert!(total * 2 >= windows * LIMIT as usize, "{summary}");
}
