//! Throughput of the simulator's list endpoint over loopback: many concurrent
//! keep-alive clients cycle through every page of a 1,000-voucher tenant,
//! with the rate limit off. The figure to watch is elements (pages) per second.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use voucher_cdc::simulator::{Simulator, SimulatorOptions};

const CONCURRENCY: usize = 32;

fn client(token: &str) -> reqwest::Client {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert("accept", "application/json".parse().unwrap());
    headers.insert("authorization", format!("Bearer {token}").parse().unwrap());
    reqwest::Client::builder()
        .default_headers(headers)
        .pool_max_idle_per_host(CONCURRENCY)
        .build()
        .unwrap()
}

/// Every page URL of a listing, following next_cursor.
async fn page_urls(client: &reqwest::Client, first: String) -> Vec<String> {
    let mut urls = vec![first.clone()];
    let mut url = first.clone();
    loop {
        let body: serde_json::Value = client.get(&url).send().await.unwrap().json().await.unwrap();
        match body["next_cursor"].as_str() {
            Some(cursor) => {
                let sep = if first.contains('?') { '&' } else { '?' };
                url = format!("{first}{sep}cursor={cursor}");
                urls.push(url.clone());
            }
            None => return urls,
        }
    }
}

/// Fetches `total` pages with CONCURRENCY workers; returns the elapsed time.
async fn drive(client: &reqwest::Client, urls: &Arc<Vec<String>>, total: u64) -> Duration {
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let (client, urls, next) = (client.clone(), urls.clone(), next.clone());
            tokio::spawn(async move {
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n as u64 >= total {
                        return;
                    }
                    let response = client.get(&urls[n % urls.len()]).send().await.unwrap();
                    assert_eq!(response.status(), 200);
                    let body = response.bytes().await.unwrap();
                    assert!(body.len() > 1000);
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    started.elapsed()
}

fn list_pages(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let sim = runtime
        .block_on(Simulator::start(SimulatorOptions {
            tenants: 1,
            vouchers: 1000,
            categories: 40,
            rate_limit: 0,
            ..SimulatorOptions::default()
        }))
        .unwrap();
    let http = client(sim.token());
    let mut group = c.benchmark_group("simulator_list");
    group.throughput(Throughput::Elements(1));
    group.measurement_time(Duration::from_secs(10));
    for (name, query) in [
        ("vouchers_page", ""),
        ("vouchers_page_include_all", "?include=categories,variants"),
    ] {
        let first = format!("{}/tenants/1/catalog/vouchers{query}", sim.base_url());
        let urls = Arc::new(runtime.block_on(page_urls(&http, first)));
        group.bench_function(name, |b| {
            b.to_async(&runtime).iter_custom(|iters| {
                let (http, urls) = (http.clone(), urls.clone());
                async move { drive(&http, &urls, iters).await }
            })
        });
    }
    group.finish();
    runtime.block_on(sim.shutdown());
}

criterion_group!(benches, list_pages);
criterion_main!(benches);
