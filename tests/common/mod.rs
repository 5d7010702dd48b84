//! Shared test helpers: each `spawn_*` starts a real dependency for a test.
#![allow(dead_code)]

use voucher_cdc::simulator::{Simulator, SimulatorOptions};

/// Starts an in-process simulator on a free loopback port with the rate limit off.
pub async fn spawn_simulator() -> Simulator {
    spawn_simulator_with(SimulatorOptions {
        rate_limit: 0,
        ..SimulatorOptions::default()
    })
    .await
}

/// Starts an in-process simulator with the given options (listen forced to a free loopback port).
pub async fn spawn_simulator_with(options: SimulatorOptions) -> Simulator {
    Simulator::start(SimulatorOptions {
        listen: "127.0.0.1:0".parse().unwrap(),
        ..options
    })
    .await
    .expect("simulator starts")
}

/// A reqwest client for the simulator that sends `Accept: application/json` and the bearer token.
pub fn simulator_client(token: &str) -> reqwest::Client {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(reqwest::header::ACCEPT, "application/json".parse().unwrap());
    headers.insert(
        reqwest::header::AUTHORIZATION,
        format!("Bearer {token}").parse().unwrap(),
    );
    reqwest::Client::builder()
        .default_headers(headers)
        .build()
        .unwrap()
}
