//! Engine benchmarks: content hashing, the per-page diff + state commit path,
//! and (with `-- --footprint`) the state's size on disk and the process RSS
//! after syncing 10k / 100k / 300k records.
//!
//! ```text
//! cargo bench --bench engine                 # criterion: hash, event, page commit, scans
//! cargo bench --bench engine -- --footprint  # disk bytes per record and RSS
//! cargo bench --bench engine -- --footprint 1000000,3000000
//! cargo bench --bench engine -- --footprint 100000 --versions fields   # events.changed_fields
//! cargo bench --bench engine -- --footprint 100000 --versions both     # fields, before, both
//! cargo bench --bench engine -- --cpu        # records per CPU-second (shared machines)
//! cargo bench --bench engine -- --durability # wall-clock cost of the fsynced intents per page
//! ```

use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

use voucher_cdc::diff::{decide, Decision, SweepMode};
use voucher_cdc::hash::{content_hash, content_hash_with_fields, IgnoreKeys, RawPrint};
use voucher_cdc::state::{
    Acked, Delivery, Intent, PageCommit, RecordState, SledStore, StateStore, StoredVersion,
};
use voucher_cdc::stream::{Resource, StreamKey};

const STREAM: StreamKey = StreamKey {
    tenant: 42,
    resource: Resource::Vouchers,
};
/// `--versions fields|before|both`: what the commits store beside the hashes
/// (`events.changed_fields`, `events.before`); neither unless given.
static VERSIONS: OnceLock<(bool, bool)> = OnceLock::new();

/// The stored version of a committed record, as the sweep builds it under `--versions`.
fn stored_version(
    text: &str,
    hash: voucher_cdc::hash::ContentHash,
    ignore: &IgnoreKeys,
) -> Option<StoredVersion> {
    let (fields, before) = *VERSIONS.get().unwrap_or(&(false, false));
    if !fields && !before {
        return None;
    }
    let field_hashes = if fields {
        content_hash_with_fields(text, ignore)
            .expect("generated json is valid")
            .1
    } else {
        None
    };
    Some(StoredVersion {
        hash,
        fields: field_hashes,
        body: before.then(|| text.to_string()),
    })
}

/// The upstream page size (fixed by the API).
const PAGE: usize = 50;
/// Distinct record bodies generated; ids beyond reuse them with another id.
const BODIES: usize = 2_000;

/// A realistic catalog voucher as the list endpoint returns it with
/// `include=categories,variants` (about 1.5 KB).
fn voucher_json(id: i64, version: u32) -> String {
    let mut rng = StdRng::seed_from_u64(id as u64);
    let price = f64::from(rng.random_range(5..300u32)) + if version % 2 == 0 { 0.0 } else { 0.5 };
    let category = |n: u32| json!({"id": n, "slug": format!("category-{n}"), "title": format!("Category {n}"), "sort_order": n % 7});
    let variant = |n: u32, rng: &mut StdRng| {
        json!({
            "id": id * 10 + i64::from(n),
            "slug": format!("variant-{id}-{n}"),
            "title": format!("Option {n} for two people"),
            "price": price + f64::from(n) * 10.0,
            "sale_price": if rng.random_bool(0.3) { json!(price) } else { json!(null) },
            "currency": "GBP",
            "is_monetary": false,
            "sort_order": n,
            "updated_at": "2024-05-01T10:00:00.000000Z",
        })
    };
    let categories: Vec<_> = (0..rng.random_range(1..4u32))
        .map(|n| category(id as u32 % 40 + n))
        .collect();
    let variants: Vec<_> = (0..rng.random_range(1..4u32))
        .map(|n| variant(n, &mut rng))
        .collect();
    json!({
        "id": id,
        "slug": format!("spa-day-for-two-{id}"),
        "title": format!("Spa Day for Two with Afternoon Tea #{id}"),
        "summary": "A relaxing day at the spa with full access to the thermal suite, a 25 minute treatment and afternoon tea.",
        "description_html": "<p>Escape the everyday with a spa day for two.</p><ul><li>Thermal suite</li><li>25 minute treatment each</li><li>Afternoon tea</li></ul>",
        "currency": "GBP",
        "price": price,
        "sale_price": null,
        "from_price": price,
        "from_sale_price": null,
        "monetary_value": null,
        "is_monetary": false,
        "allow_part_redeem": false,
        "validity_type": "months",
        "validity_months": 12,
        "redemption_info": "Book directly with the venue quoting your voucher code.",
        "sort_order": id % 100,
        "image_url": format!("https://cdn.example.com/vouchers/{id}/main.jpg"),
        "image_urls": [format!("https://cdn.example.com/vouchers/{id}/1.jpg"), format!("https://cdn.example.com/vouchers/{id}/2.jpg")],
        "category_refs": categories,
        "variant_summaries": variants,
        "categories": categories,
        "variants": variants,
        "updated_at": "2024-05-01T10:00:00.000000Z",
    })
    .to_string()
}

/// Record bodies, two versions each so that alternating them is always a change.
fn bodies() -> Vec<[String; 2]> {
    (0..BODIES as i64)
        .map(|id| [voucher_json(id, 0), voucher_json(id, 1)])
        .collect()
}

/// What one page writes: intents of the changed records, and the commit of
/// the changed records and the unchanged ids seen.
struct PagePlan {
    intents: Vec<(i64, Intent)>,
    acked: Acked<PageCommit>,
    emitted: usize,
}

/// The pure part of a page: hash, read known state, decide.
fn plan_page(
    store: &SledStore,
    ignore: &IgnoreKeys,
    ids: &[i64],
    texts: &[&str],
    mode: SweepMode,
    epoch: u64,
) -> PagePlan {
    let hashes: Vec<_> = texts
        .iter()
        .map(|t| content_hash(t, ignore).expect("generated json is valid"))
        .collect();
    let known = store.get_records(STREAM, ids).expect("get_records");
    let mut intents = Vec::new();
    let mut commits = Vec::new();
    let mut versions = Vec::new();
    let mut seen = Vec::new();
    for (((id, hash), known), text) in ids.iter().zip(&hashes).zip(&known).zip(texts) {
        match decide(known.map(|k| k.hash), *hash, mode) {
            Decision::Unchanged => seen.push(*id),
            Decision::Emit { .. } => {
                versions.extend(stored_version(text, *hash, ignore).map(|v| (*id, v)));
                let updated_at = Some(1_714_557_600_000_000);
                let generation = known.map_or(0, |k| k.generation);
                intents.push((
                    *id,
                    Intent {
                        hash: *hash,
                        updated_at,
                        generation,
                        seq: 1,
                        op: Some(voucher_cdc::event::Op::Update),
                        previous: known.map(|k| k.hash),
                        replay: None,
                    },
                ));
                commits.push((
                    *id,
                    RecordState {
                        hash: *hash,
                        updated_at,
                        seen_epoch: epoch,
                        generation,
                        seq: 1,
                        print: Some(RawPrint(*id as u64)),
                    },
                ));
            }
        }
    }
    let emitted = commits.len();
    let acks = vec![Delivery::Acknowledged; emitted];
    PagePlan {
        intents,
        // The sweep commits only once every event is acknowledged; here the
        // publish is left out, so every event counts as acknowledged.
        acked: Acked::page(commits, acks, seen, epoch)
            .expect("one ack per change")
            .with_versions(versions),
        emitted,
    }
}

/// What the sweep does with one page: plan it, journal the intents
/// (publish would happen here), commit hashes and seen epochs.
/// Returns how many records were emitted.
fn sweep_page(
    store: &SledStore,
    ignore: &IgnoreKeys,
    ids: &[i64],
    texts: &[&str],
    mode: SweepMode,
    epoch: u64,
) -> usize {
    let plan = plan_page(store, ignore, ids, texts, mode, epoch);
    store
        .write_intents(STREAM, &plan.intents)
        .expect("write_intents");
    store.commit_page(STREAM, &plan.acked).expect("commit_page");
    plan.emitted
}

/// The bodies of one page of ids, in `version` (0 or 1).
fn page_texts<'b>(bodies: &'b [[String; 2]], ids: &[i64], version: usize) -> Vec<&'b str> {
    ids.iter()
        .map(|&id| bodies[id as usize % BODIES][version].as_str())
        .collect()
}

/// Syncs ids `0..n` (first sync), page by page.
fn initial_sync(store: &SledStore, bodies: &[[String; 2]], n: usize) {
    let ignore = IgnoreKeys::new(["updated_at"]);
    let ids: Vec<i64> = (0..n as i64).collect();
    for page in ids.chunks(PAGE) {
        let texts = page_texts(bodies, page, 0);
        sweep_page(store, &ignore, page, &texts, SweepMode::FirstSync, 1);
    }
}

fn bench_hash(c: &mut Criterion, bodies: &[[String; 2]]) {
    let ignore = IgnoreKeys::new(["updated_at"]);
    let total: usize = bodies.iter().map(|b| b[0].len()).sum();
    let mut group = c.benchmark_group("content_hash");
    group.throughput(Throughput::Bytes((total / bodies.len()) as u64));
    let mut i = 0;
    group.bench_function("voucher_record", |b| {
        b.iter(|| {
            i = (i + 1) % bodies.len();
            content_hash(&bodies[i][0], &ignore).expect("valid")
        })
    });
    group.finish();
}

/// Building one record's event (id, envelope, payload) around its listed
/// bytes: a snapshot, and an update carrying a previous hash.
fn bench_event(c: &mut Criterion, bodies: &[[String; 2]]) {
    use voucher_cdc::event::{record_event, Op, RecordChange};
    let ignore = IgnoreKeys::new(["updated_at"]);
    let hashes: Vec<_> = bodies
        .iter()
        .map(|b| content_hash(&b[0], &ignore).expect("valid"))
        .collect();
    let detected_at = chrono::Utc::now();
    let mut group = c.benchmark_group("record_event");
    group.throughput(Throughput::Elements(1));
    for (name, op) in [("snapshot", Op::Snapshot), ("update", Op::Update)] {
        let mut i = 0;
        group.bench_function(name, |b| {
            b.iter(|| {
                i = (i + 1) % bodies.len();
                record_event(&RecordChange {
                    stream: STREAM,
                    record_id: 1_000_000 + i as i64,
                    generation: 0,
                    seq: 1,
                    op,
                    updated_at: Some("2026-11-26T10:00:00.123456Z"),
                    content_hash: hashes[i],
                    previous_hash: (op == Op::Update).then(|| hashes[(i + 1) % hashes.len()]),
                    replay: None,
                    data: &bodies[i][0],
                    detected_at,
                    schema_base: &voucher_cdc::schema::DEFAULT_SCHEMA_BASE,
                })
            })
        });
    }
    group.finish();
}

fn bench_pages(c: &mut Criterion, bodies: &[[String; 2]]) {
    const KNOWN: usize = 100_000;
    let store = SledStore::open_temporary().expect("temporary store");
    initial_sync(&store, bodies, KNOWN);
    let ignore = IgnoreKeys::new(["updated_at"]);
    let mut group = c.benchmark_group("sweep_page");
    group.throughput(Throughput::Elements(PAGE as u64));
    group.measurement_time(Duration::from_secs(10));

    // Every record of the page changed: hash, get, decide, intents, commit.
    let mut round = 0usize;
    group.bench_function(BenchmarkId::new("changed", KNOWN), |b| {
        b.iter(|| {
            round += 1;
            let first = (round * PAGE) % KNOWN;
            let version = ((round * PAGE / KNOWN) % 2) ^ 1;
            let ids: Vec<i64> = (first..first + PAGE).map(|i| i as i64).collect();
            let texts: Vec<&str> = ids
                .iter()
                .map(|&id| bodies[id as usize % BODIES][version].as_str())
                .collect();
            sweep_page(&store, &ignore, &ids, &texts, SweepMode::Normal, 1)
        })
    });

    // A full sweep over unchanged records: hash, get, decide, seen-epoch update.
    let fresh = SledStore::open_temporary().expect("temporary store");
    initial_sync(&fresh, bodies, KNOWN);
    let mut round = 0usize;
    group.bench_function(BenchmarkId::new("unchanged_full_sweep", KNOWN), |b| {
        b.iter(|| {
            round += 1;
            let first = (round * PAGE) % KNOWN;
            let epoch = 2 + (round * PAGE / KNOWN) as u64;
            let ids: Vec<i64> = (first..first + PAGE).map(|i| i as i64).collect();
            let texts: Vec<&str> = ids
                .iter()
                .map(|&id| bodies[id as usize % BODIES][0].as_str())
                .collect();
            sweep_page(&fresh, &ignore, &ids, &texts, SweepMode::Normal, epoch)
        })
    });
    group.finish();

    let mut group = c.benchmark_group("state_scan");
    group.throughput(Throughput::Elements(KNOWN as u64));
    group.bench_function(BenchmarkId::new("record_count", KNOWN), |b| {
        b.iter(|| fresh.record_count(STREAM).expect("count"))
    });
    group.bench_function(BenchmarkId::new("unseen_records_none", KNOWN), |b| {
        b.iter(|| fresh.unseen_records(STREAM, 0).expect("unseen").len())
    });
    group.finish();
}

/// Sum of the apparent sizes and of the allocated blocks of every file under `dir`.
fn dir_size(dir: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let mut apparent = 0;
    let mut allocated = 0;
    for entry in std::fs::read_dir(dir).expect("read_dir").flatten() {
        let meta = entry.metadata().expect("metadata");
        if meta.is_dir() {
            let (a, b) = dir_size(&entry.path());
            apparent += a;
            allocated += b;
        } else {
            apparent += meta.len();
            allocated += meta.blocks() * 512;
        }
    }
    (apparent, allocated)
}

/// Current and peak resident set size in KiB, from /proc/self/status.
fn rss_kib() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// One footprint measurement in a fresh process: sync `n` records, run one
/// full sweep over them, reopen the store and count, reporting disk and RSS
/// after each step.
fn footprint_child(n: usize) {
    let bodies = bodies();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("state");
    let store = SledStore::open(&path).expect("open");
    let started = Instant::now();
    initial_sync(&store, &bodies, n);
    store.flush().expect("flush");
    let sync_rate = n as f64 / started.elapsed().as_secs_f64();
    let (_, disk_synced) = dir_size(&path);
    let (rss_synced, _) = rss_kib();

    // One full sweep: every record unchanged, seen epoch bumped.
    let ignore = IgnoreKeys::new(["updated_at"]);
    let ids: Vec<i64> = (0..n as i64).collect();
    let started = Instant::now();
    for page in ids.chunks(PAGE) {
        let texts = page_texts(&bodies, page, 0);
        sweep_page(&store, &ignore, page, &texts, SweepMode::Normal, 2);
    }
    store.flush().expect("flush");
    let sweep_rate = n as f64 / started.elapsed().as_secs_f64();
    let (_, disk_swept) = dir_size(&path);
    let (rss_swept, peak_swept) = rss_kib();
    drop(store);

    let store = SledStore::open(&path).expect("reopen");
    assert_eq!(store.record_count(STREAM).expect("count"), n as u64);
    let (rss_reopened, peak) = rss_kib();
    drop(store);
    let mib = |kib: u64| kib as f64 / 1024.0;
    println!(
        "{n:>9} | {sync_rate:>9.0} | {sweep_rate:>9.0} | {:>10.1} | {:>10.1} | {:>9.1} | {:>9.1} | {:>9.1} | {:>9.1} | {:>9.1}",
        disk_synced as f64 / n as f64,
        disk_swept as f64 / n as f64,
        mib(rss_synced),
        mib(rss_swept),
        mib(peak_swept),
        mib(rss_reopened),
        mib(peak),
    );
}

fn footprint(sizes: &[usize]) {
    println!("  records | sync r/s  | sweep r/s | disk B/rec | disk B/rec | RSS MiB   | RSS MiB   | peak MiB  | RSS MiB   | peak MiB");
    println!("          | (wall)    | (wall)    | synced     | swept      | synced    | swept     | so far    | reopened  | at end");
    let exe = std::env::current_exe().expect("current_exe");
    for n in sizes {
        let (fields, before) = *VERSIONS.get().unwrap_or(&(false, false));
        let versions = match (fields, before) {
            (false, false) => "none",
            (true, false) => "fields",
            (false, true) => "before",
            (true, true) => "both",
        };
        let status = std::process::Command::new(&exe)
            .args(["--footprint-child", &n.to_string(), "--versions", versions])
            .status()
            .expect("spawn footprint child");
        assert!(status.success(), "footprint child for {n} failed");
    }
}

/// CPU time consumed so far by every thread of this process, from /proc.
fn process_cpu_time() -> Duration {
    let mut total = 0u64;
    if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
        for task in tasks.flatten() {
            let stat = std::fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
            total += stat
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    Duration::from_nanos(total)
}

/// Hashes and syncs with timing by CPU time (the machine may be shared):
/// records per CPU-second of the whole process, sled's threads included.
fn cpu_rates(n: usize) {
    let bodies = bodies();
    let ignore = IgnoreKeys::new(["updated_at"]);
    let cpu = process_cpu_time();
    let wall = Instant::now();
    let mut hashed = 0usize;
    while hashed < n {
        for body in &bodies {
            std::hint::black_box(content_hash(&body[0], &ignore).expect("valid"));
        }
        hashed += bodies.len();
    }
    let hash_cpu = (process_cpu_time() - cpu).as_secs_f64();
    let avg_len = bodies.iter().map(|b| b[0].len()).sum::<usize>() / bodies.len();
    println!(
        "content_hash: {:.2} us/record CPU ({:.0} records/s, {:.0} MiB/s, avg record {avg_len} B; wall {:.2} s)",
        hash_cpu * 1e6 / hashed as f64,
        hashed as f64 / hash_cpu,
        (hashed * avg_len) as f64 / hash_cpu / (1024.0 * 1024.0),
        wall.elapsed().as_secs_f64()
    );

    // Context: the same records through plain blake3 and serde_json.
    let cpu = process_cpu_time();
    for body in &bodies {
        std::hint::black_box(blake3::hash(body[0].as_bytes()));
    }
    let blake3_cpu = (process_cpu_time() - cpu).as_secs_f64();
    let cpu = process_cpu_time();
    for body in &bodies {
        std::hint::black_box(serde_json::from_str::<serde_json::Value>(&body[0]).expect("valid"));
    }
    let serde_cpu = (process_cpu_time() - cpu).as_secs_f64();
    println!(
        "context: blake3 alone {:.2} us/record, serde_json::Value parse {:.2} us/record",
        blake3_cpu * 1e6 / bodies.len() as f64,
        serde_cpu * 1e6 / bodies.len() as f64
    );

    let store = SledStore::open_temporary().expect("temporary store");
    let cpu = process_cpu_time();
    let wall = Instant::now();
    initial_sync(&store, &bodies, n);
    store.flush().expect("flush");
    let sync_cpu = (process_cpu_time() - cpu).as_secs_f64();
    println!(
        "first sync of {n}: {:.0} records per CPU-second (hash + get + decide + intents + commit; wall {:.2} s)",
        n as f64 / sync_cpu,
        wall.elapsed().as_secs_f64()
    );
    let ids: Vec<i64> = (0..n as i64).collect();
    for (label, version, epoch) in [("changed", 1usize, 1u64), ("unchanged full sweep", 1, 2)] {
        let cpu = process_cpu_time();
        let wall = Instant::now();
        for page in ids.chunks(PAGE) {
            let texts = page_texts(&bodies, page, version);
            sweep_page(&store, &ignore, page, &texts, SweepMode::Normal, epoch);
        }
        store.flush().expect("flush");
        let secs = (process_cpu_time() - cpu).as_secs_f64();
        println!(
            "{label} sweep of {n}: {:.0} records per CPU-second (wall {:.2} s)",
            n as f64 / secs,
            wall.elapsed().as_secs_f64()
        );
    }
}

/// Wall-clock latency of the durable steps of a first sync of `n` records:
/// `write_intents` (which fsyncs before returning, so no event can reach the
/// sink before its intent is on disk) and `commit_page` (flushed by sled
/// later), per page of 50.
fn durability(n: usize) {
    let bodies = bodies();
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SledStore::open(&dir.path().join("state")).expect("open");
    let ignore = IgnoreKeys::new(["updated_at"]);
    let ids: Vec<i64> = (0..n as i64).collect();
    let mut intents_us = Vec::new();
    let mut commit_us = Vec::new();
    let started = Instant::now();
    for page in ids.chunks(PAGE) {
        let texts = page_texts(&bodies, page, 0);
        let plan = plan_page(&store, &ignore, page, &texts, SweepMode::FirstSync, 1);
        let t = Instant::now();
        store
            .write_intents(STREAM, &plan.intents)
            .expect("write_intents");
        intents_us.push(t.elapsed().as_micros() as u64);
        let t = Instant::now();
        store.commit_page(STREAM, &plan.acked).expect("commit_page");
        commit_us.push(t.elapsed().as_micros() as u64);
    }
    let wall = started.elapsed().as_secs_f64();
    let summary = |name: &str, v: &mut Vec<u64>| {
        v.sort_unstable();
        let mean = v.iter().sum::<u64>() as f64 / v.len().max(1) as f64;
        let pct = |p: f64| v[((v.len() as f64 - 1.0) * p) as usize];
        println!(
            "{name:<28} mean {mean:>8.0} µs  p50 {:>6} µs  p99 {:>6} µs  max {:>6} µs",
            pct(0.5),
            pct(0.99),
            v.last().copied().unwrap_or(0)
        );
    };
    println!(
        "durability: {n} records, {} pages of {PAGE}",
        n.div_ceil(PAGE)
    );
    summary("write_intents (fsync)", &mut intents_us);
    summary("commit_page (no fsync)", &mut commit_us);
    println!(
        "pages/s {:.0}, records/s {:.0} (hashing, intents and commits only)",
        (n.div_ceil(PAGE)) as f64 / wall,
        n as f64 / wall
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(pos) = args.iter().position(|a| a == "--versions") {
        let mode = match args.get(pos + 1).map(String::as_str) {
            Some("none") => (false, false),
            Some("fields") => (true, false),
            Some("before") => (false, true),
            Some("both") => (true, true),
            other => panic!("--versions none|fields|before|both, not {other:?}"),
        };
        VERSIONS.get_or_init(|| mode);
    }
    if args.iter().any(|a| a == "--durability") {
        durability(20_000);
        return;
    }
    if args.iter().any(|a| a == "--cpu") {
        cpu_rates(100_000);
        return;
    }
    if let Some(pos) = args.iter().position(|a| a == "--footprint-child") {
        let n = args
            .get(pos + 1)
            .and_then(|v| v.parse().ok())
            .expect("--footprint-child N");
        footprint_child(n);
        return;
    }
    if let Some(pos) = args.iter().position(|a| a == "--footprint") {
        // Optional comma-separated sizes, e.g. `--footprint 1000000,3000000`.
        let sizes: Vec<usize> = args
            .get(pos + 1)
            .map(|list| list.split(',').filter_map(|n| n.parse().ok()).collect())
            .filter(|sizes: &Vec<usize>| !sizes.is_empty())
            .unwrap_or_else(|| vec![10_000, 100_000, 300_000]);
        footprint(&sizes);
        return;
    }
    let bodies = bodies();
    let mut c = Criterion::default().configure_from_args();
    bench_hash(&mut c, &bodies);
    bench_event(&mut c, &bodies);
    bench_pages(&mut c, &bodies);
    c.final_summary();
}
