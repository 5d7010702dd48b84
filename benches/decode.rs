//! Page decoding speed: how many realistic 50-record list pages (relations
//! included) the client turns into records per second, in pages/s and MB/s.
//!
//! `pages_with_hashes` is what a sweep does: one pass that also computes
//! every record's content hash and raw print (`decode_page_hashed`);
//! `pages_delimited_and_printed` what a full sweep of a known stream does:
//! records delimited and printed, their hashes left to the records whose
//! print changed.
//!
//! Run: `cargo bench --bench decode`.

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use serde_json::{json, Value};
use std::sync::Arc;

use bytes::Bytes;
use voucher_cdc::hash::{IgnoreKeys, PrintKey};
use voucher_cdc::upstream::page::{decode_page, decode_page_hashed, Hashing};

/// Records per page, fixed by the API.
const PAGE_SIZE: usize = 50;

/// A category reference as listed in `category_refs` / `categories`.
fn category_ref(id: usize) -> Value {
    json!({"id": id, "slug": format!("category-{id}"), "title": format!("Category {id}"), "sort_order": id % 7})
}

/// A variant as listed in `variant_summaries` / `variants`.
fn variant(voucher: usize, n: usize) -> Value {
    json!({
        "id": voucher * 10 + n, "slug": format!("variant-{voucher}-{n}"),
        "title": format!("Voucher {voucher} option {n}"), "price": 25.0 + n as f64 * 10.0,
        "sale_price": if n == 0 { Value::Null } else { json!(20.0 + n as f64 * 10.0) },
        "currency": "GBP", "is_monetary": n == 0, "sort_order": n,
        "updated_at": "2024-05-01T12:34:56.000000Z"
    })
}

/// A catalog voucher with every documented field and both relations included.
fn voucher(id: usize) -> Value {
    let refs: Vec<Value> = (0..2).map(|n| category_ref(id % 40 + n)).collect();
    let variants: Vec<Value> = (0..3).map(|n| variant(id, n)).collect();
    json!({
        "id": id, "slug": format!("spa-day-for-two-{id}"), "title": format!("Spa day for two #{id}"),
        "summary": "A relaxing day in the spa with lunch and two treatments each.",
        "description_html": format!("<p>{}</p><ul><li>Full use of the pool, sauna and steam room</li><li>Two 25 minute treatments</li><li>Two course lunch</li></ul>", "Treat someone special to a day of calm. ".repeat(8)),
        "currency": "GBP", "price": 150.0, "sale_price": 129.5, "from_price": 99.0,
        "from_sale_price": Value::Null, "monetary_value": Value::Null, "is_monetary": false,
        "allow_part_redeem": false, "validity_type": "months", "validity_months": 12,
        "redemption_info": "Book by phone quoting the voucher reference.", "sort_order": id % 100,
        "image_url": format!("https://cdn.example.com/vouchers/{id}/main.jpg"),
        "image_urls": (0..3).map(|n| format!("https://cdn.example.com/vouchers/{id}/{n}.jpg")).collect::<Vec<_>>(),
        "category_refs": refs, "variant_summaries": variants, "categories": refs, "variants": variants,
        "updated_at": "2024-05-01T12:34:56.000000Z"
    })
}

/// One list response body of `PAGE_SIZE` vouchers, as the API sends it.
fn voucher_page() -> Vec<u8> {
    let data: Vec<Value> = (1..=PAGE_SIZE).map(voucher).collect();
    let body = json!({"data": data, "next_cursor": "eyJpZCI6NTAsIl9wb2ludHNUb05leHRJdGVtcyI6dHJ1ZX0", "server_time": "2024-05-01T12:35:00Z"});
    serde_json::to_vec(&body).expect("page encodes")
}

fn decode(c: &mut Criterion) {
    let body = Bytes::from(voucher_page());
    let ignore = Arc::new(IgnoreKeys::new(["updated_at"]));
    let eager = Hashing {
        ignore: ignore.clone(),
        prints: Some(PrintKey::new(b"bench-secret-000", &ignore)),
        defer: false,
    };
    let deferred = Hashing {
        defer: true,
        ..eager.clone()
    };
    assert_eq!(
        decode_page(&body).expect("page decodes").page.records.len(),
        PAGE_SIZE
    );
    let mut group = c.benchmark_group("decode_page");
    group.throughput(Throughput::Bytes(body.len() as u64));
    group.bench_function("vouchers_50_with_relations/bytes", |b| {
        b.iter(|| decode_page(black_box(&body)).expect("page decodes"))
    });
    group.throughput(Throughput::Elements(1));
    group.bench_function("vouchers_50_with_relations/pages", |b| {
        b.iter(|| decode_page(black_box(&body)).expect("page decodes"))
    });
    // What a sweep's listing does: one pass reads every record and its content hash.
    group.bench_function("vouchers_50_with_relations/pages_with_hashes", |b| {
        b.iter(|| decode_page_hashed(black_box(&body), &eager).expect("page decodes"))
    });
    // What a full sweep of a known stream does: records delimited and printed.
    group.bench_function(
        "vouchers_50_with_relations/pages_delimited_and_printed",
        |b| b.iter(|| decode_page_hashed(black_box(&body), &deferred).expect("page decodes")),
    );
    // Baseline: a full serde_json::Value tree per page, which the client avoids.
    group.throughput(Throughput::Bytes(body.len() as u64));
    group.bench_function("baseline_value_tree/bytes", |b| {
        b.iter(|| serde_json::from_slice::<Value>(black_box(&body)).expect("page parses"))
    });
    group.finish();
    eprintln!("page body: {} bytes, {} records", body.len(), PAGE_SIZE);
}

criterion_group!(benches, decode);
criterion_main!(benches);
