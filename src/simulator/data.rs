//! Deterministic, realistic sample data: catalog vouchers with variants and
//! category links, catalog categories, and purchased vouchers to redeem.
//! Everything is a pure function of the seed and the tenant.

use chrono::{DateTime, Duration, NaiveDate, TimeZone, Utc};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::model::{CatalogCategory, CatalogVoucher, CategoryRef, Variant};
use crate::stream::TenantId;

const EXPERIENCES: &[&str] = &[
    "Afternoon Tea",
    "Spa Day",
    "Hot Air Balloon Flight",
    "Wine Tasting",
    "Cookery Class",
    "Supercar Thrill",
    "Champagne Brunch",
    "Pottery Workshop",
    "Zip Line Adventure",
    "Tasting Menu",
    "Rally Driving",
    "Gin Masterclass",
    "Escape Room",
    "Helicopter Tour",
    "Yoga Retreat",
    "Theatre Break",
    "Sushi Making",
    "Falconry Experience",
    "Paddleboard Lesson",
    "Gift Card",
];
const QUALIFIERS: &[&str] = &[
    "for Two",
    "for One",
    "with Prosecco",
    "Deluxe",
    "Weekend",
    "Midweek",
    "Family",
    "Signature",
    "Luxury",
    "Classic",
];
const PLACES: &[&str] = &[
    "The Savoy",
    "Lake District",
    "Cotswolds",
    "Edinburgh",
    "Brighton",
    "Bath",
    "York",
    "Cardiff",
    "Manchester",
    "Bristol",
];
const CATEGORY_NAMES: &[&str] = &[
    "Dining",
    "Spa & Beauty",
    "Adventure",
    "Driving",
    "Short Breaks",
    "Classes & Workshops",
    "Gift Cards",
    "Food & Drink",
    "Days Out",
    "For Couples",
    "Flying",
    "Wellness",
];
const FIRST_NAMES: &[&str] = &[
    "Ada", "Ben", "Chloe", "Dev", "Emma", "Farah", "George", "Hana",
];
const LAST_NAMES: &[&str] = &[
    "Smith", "Jones", "Patel", "Nguyen", "Brown", "Kowalski", "Okafor",
];
const CURRENCIES: &[&str] = &["GBP", "EUR", "USD", "GBP", "AUD", "GBP", "CAD"];

/// Start of the generated history; generated `updated_at` values fall within
/// 400 days after it.
pub fn history_start() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2024, 1, 1, 0, 0, 0)
        .single()
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}

/// The main currency of a tenant.
pub fn tenant_currency(tenant: TenantId) -> &'static str {
    CURRENCIES[((tenant.saturating_sub(1)) % CURRENCIES.len() as u64) as usize]
}

/// A tenant's display name.
pub fn tenant_name(tenant: TenantId) -> String {
    let brands = [
        "Red Letter",
        "Golden Hour",
        "Blue Door",
        "Silver Birch",
        "Green Lane",
    ];
    format!(
        "{} Vouchers {}",
        brands[(tenant % brands.len() as u64) as usize],
        tenant
    )
}

/// A deterministic generator for one tenant.
pub fn tenant_rng(seed: u64, tenant: TenantId, stream: u64) -> StdRng {
    let mut bytes = [0u8; 32];
    let hash = blake3::hash(
        &[
            seed.to_le_bytes(),
            tenant.to_le_bytes(),
            stream.to_le_bytes(),
        ]
        .concat(),
    );
    bytes.copy_from_slice(hash.as_bytes());
    StdRng::from_seed(bytes)
}

fn pick<'a>(rng: &mut StdRng, items: &[&'a str]) -> &'a str {
    items[rng.random_range(0..items.len())]
}

/// Turns a title into a URL slug.
pub fn slugify(title: &str) -> String {
    let mut slug = String::with_capacity(title.len());
    for c in title.chars() {
        if c.is_ascii_alphanumeric() {
            slug.push(c.to_ascii_lowercase());
        } else if !slug.ends_with('-') {
            slug.push('-');
        }
    }
    slug.trim_matches('-').to_string()
}

/// A price in major units with two decimals, e.g. 24.99.
pub fn price(rng: &mut StdRng, low: u32, high: u32) -> f64 {
    let pounds = rng.random_range(low..=high);
    let pence = [0, 0, 50, 95, 99][rng.random_range(0..5)];
    f64::from(pounds * 100 + pence) / 100.0
}

/// A timestamp within the generated history.
pub fn historic_time(rng: &mut StdRng) -> DateTime<Utc> {
    history_start()
        + Duration::seconds(rng.random_range(0..400 * 86_400))
        + Duration::microseconds(rng.random_range(0..1_000_000))
}

/// A fresh category with the given id.
pub fn category(rng: &mut StdRng, id: i64, updated_at: Option<DateTime<Utc>>) -> CatalogCategory {
    let name = CATEGORY_NAMES[(id as usize).wrapping_sub(1) % CATEGORY_NAMES.len()];
    let title = if (id as usize) <= CATEGORY_NAMES.len() {
        name.to_string()
    } else {
        format!("{name} {}", pick(rng, PLACES))
    };
    CatalogCategory {
        id,
        slug: Some(format!("{}-{id}", slugify(&title))),
        summary: Some(format!(
            "Our favourite {} experiences.",
            title.to_lowercase()
        )),
        description_html: Some(format!(
            "<p>Hand-picked {} vouchers, delivered instantly.</p>",
            title.to_lowercase()
        )),
        image_url: Some(format!("https://img.vouchers.example/categories/{id}.jpg")),
        title: Some(title),
        sort_order: Some(rng.random_range(0..100)),
        updated_at,
        products: None,
    }
}

/// A category reference for a category.
pub fn category_ref(category: &CatalogCategory) -> CategoryRef {
    CategoryRef {
        id: category.id,
        slug: category.slug.clone().unwrap_or_default(),
        title: category.title.clone().unwrap_or_default(),
        sort_order: category.sort_order.unwrap_or_default(),
    }
}

/// A fresh catalog voucher; `next_variant_id` hands out variant ids.
pub fn voucher(
    rng: &mut StdRng,
    tenant: TenantId,
    id: i64,
    categories: &[CatalogCategory],
    next_variant_id: &mut i64,
    updated_at: Option<DateTime<Utc>>,
) -> CatalogVoucher {
    let experience = pick(rng, EXPERIENCES);
    let is_monetary = experience == "Gift Card" || rng.random_bool(0.15);
    let title = if is_monetary {
        format!("{} Gift Card", pick(rng, PLACES))
    } else {
        format!(
            "{experience} {} in {}",
            pick(rng, QUALIFIERS),
            pick(rng, PLACES)
        )
    };
    let currency = if rng.random_bool(0.1) {
        pick(rng, CURRENCIES)
    } else {
        tenant_currency(tenant)
    };
    let variant_count = if is_monetary {
        rng.random_range(2..=4)
    } else {
        rng.random_range(0..=3)
    };
    let mut variants = Vec::with_capacity(variant_count);
    for v in 0..variant_count {
        let vid = *next_variant_id;
        *next_variant_id += 1;
        let (vtitle, vprice, vsale) = if is_monetary {
            let value = [10.0, 25.0, 50.0, 75.0, 100.0, 150.0][(v + rng.random_range(0..2)) % 6];
            (format!("{currency} {value:.0}"), Some(value), None)
        } else {
            let p = price(rng, 20, 400);
            let sale = rng
                .random_bool(0.25)
                .then(|| (p * 0.8 * 100.0).round() / 100.0);
            (format!("Option {}", v + 1), Some(p), sale)
        };
        variants.push(Variant {
            id: vid,
            slug: slugify(&vtitle),
            title: vtitle,
            price: vprice,
            sale_price: vsale,
            currency: currency.to_string(),
            is_monetary,
            sort_order: v as i64,
            updated_at: if rng.random_bool(0.1) {
                None
            } else {
                updated_at
            },
        });
    }
    let min = |f: fn(&Variant) -> Option<f64>| {
        variants
            .iter()
            .filter_map(f)
            .fold(None, |acc: Option<f64>, p| {
                Some(acc.map_or(p, |a| a.min(p)))
            })
    };
    let from_price = min(|v| v.price);
    let from_sale_price = min(|v| v.sale_price);
    let (price_value, sale_price, monetary_value) = if is_monetary {
        (None, None, from_price.or(Some(50.0)))
    } else if variants.is_empty() {
        let p = price(rng, 15, 600);
        let sale = rng
            .random_bool(0.3)
            .then(|| (p * 0.85 * 100.0).round() / 100.0);
        (Some(p), sale, None)
    } else {
        (None, None, None)
    };
    let link_count = if categories.is_empty() {
        0
    } else {
        rng.random_range(0..=3.min(categories.len()))
    };
    let mut refs: Vec<CategoryRef> = Vec::with_capacity(link_count);
    for _ in 0..link_count {
        let category = &categories[rng.random_range(0..categories.len())];
        if !refs.iter().any(|r| r.id == category.id) {
            refs.push(category_ref(category));
        }
    }
    let validity_type = match rng.random_range(0..10) {
        0 => None,
        1 | 2 => Some("fixed_date".to_string()),
        _ => Some("months".to_string()),
    };
    let validity_months = (validity_type.as_deref() == Some("months"))
        .then(|| [6, 9, 12, 18, 24][rng.random_range(0..5)]);
    let image_count = rng.random_range(0..=3);
    let image_urls: Vec<String> = (0..image_count)
        .map(|i| format!("https://img.vouchers.example/{tenant}/{id}/{i}.jpg"))
        .collect();
    CatalogVoucher {
        id,
        slug: format!("{}-{id}", slugify(&title)),
        summary: rng.random_bool(0.8).then(|| {
            format!(
                "A memorable {} to give or to keep.",
                experience.to_lowercase()
            )
        }),
        description_html: rng.random_bool(0.85).then(|| {
            format!(
                "<p>{title}.</p><ul><li>Valid for {} months</li><li>Instant e-voucher</li></ul>",
                validity_months.unwrap_or(12)
            )
        }),
        currency: currency.to_string(),
        price: price_value,
        sale_price,
        from_price,
        from_sale_price,
        monetary_value,
        is_monetary,
        allow_part_redeem: is_monetary && rng.random_bool(0.7),
        validity_type,
        validity_months,
        redemption_info: rng.random_bool(0.6).then(|| {
            "Book online at least 48 hours in advance quoting your voucher code.".to_string()
        }),
        sort_order: rng.random_range(0..1000),
        image_url: image_urls.first().cloned(),
        image_urls,
        category_refs: refs,
        variant_summaries: variants,
        categories: None,
        variants: None,
        updated_at,
        title,
    }
}

/// Share of the initial records dated at one bulk-import instant when
/// `--bulk-import-share` is not given.
pub const BULK_IMPORT_SHARE: f64 = 0.08;

/// A generated `updated_at` for an initial record: a few percent null, a
/// share `bulk_share` (of the rest) dated at one bulk-import instant (ties,
/// listed in id order among themselves), the rest spread over history.
/// `rng` draws exactly as with the default share whatever `bulk_share` is, so
/// the records generated after this one are the same; another share than
/// the default dates the record with draws from `dates` instead.
pub fn initial_updated_at(
    rng: &mut StdRng,
    dates: &mut StdRng,
    bulk: DateTime<Utc>,
    bulk_share: f64,
    nullable: bool,
) -> Option<DateTime<Utc>> {
    if nullable && rng.random_bool(0.03) {
        return None;
    }
    let default_date = if rng.random_bool(BULK_IMPORT_SHARE) {
        bulk
    } else {
        historic_time(rng)
    };
    if bulk_share == BULK_IMPORT_SHARE {
        return Some(default_date);
    }
    if dates.random_bool(bulk_share) {
        return Some(bulk);
    }
    Some(historic_time(dates))
}

/// A purchased voucher that can be redeemed (the Sales area, not listed).
#[derive(Debug, Clone, PartialEq)]
pub struct Purchased {
    /// Purchased voucher id.
    pub id: i64,
    /// Printed reference.
    pub reference: String,
    /// Balance left in major units.
    pub current_balance: f64,
    /// Balance at purchase in major units.
    pub initial_balance: f64,
    /// Currency code.
    pub currency: String,
    /// Money voucher or experience.
    pub is_monetary: bool,
    /// Part redemption allowed.
    pub allow_part_redeem: bool,
    /// Voided by the merchant.
    pub void: bool,
    /// Fully redeemed already.
    pub redeemed: bool,
    /// Title of the catalog voucher.
    pub product_title: String,
    /// Recipient.
    pub recipient_name: String,
    /// Buyer.
    pub customer_name: String,
    /// First valid day.
    pub date_valid_start: NaiveDate,
    /// Last valid day.
    pub date_valid_end: NaiveDate,
}

/// Generates a tenant's purchased vouchers from its catalog: the first few
/// cover every state (redeemable monetary part/full, experience, void,
/// expired, already redeemed), the rest are mostly redeemable.
pub fn purchased(
    rng: &mut StdRng,
    tenant: TenantId,
    catalog: &[CatalogVoucher],
    count: usize,
) -> Vec<Purchased> {
    let start = NaiveDate::from_ymd_opt(2024, 6, 1).unwrap_or_default();
    let far = NaiveDate::from_ymd_opt(2035, 12, 31).unwrap_or_default();
    let expired_end = NaiveDate::from_ymd_opt(2024, 12, 31).unwrap_or_default();
    (0..count)
        .map(|i| {
            let id = 5001 + i as i64;
            let product =
                (!catalog.is_empty()).then(|| &catalog[rng.random_range(0..catalog.len())]);
            let kind = if i < 7 { i } else { rng.random_range(0..14) };
            let is_monetary = matches!(kind, 0 | 1) || (kind >= 7 && rng.random_bool(0.5));
            let allow_part_redeem = kind == 0 || (kind >= 7 && is_monetary && rng.random_bool(0.7));
            let initial = if is_monetary {
                [25.0, 50.0, 100.0][rng.random_range(0..3)]
            } else {
                1.0
            };
            let redeemed = kind == 5;
            let name =
                |rng: &mut StdRng| format!("{} {}", pick(rng, FIRST_NAMES), pick(rng, LAST_NAMES));
            Purchased {
                id,
                reference: format!(
                    "T{tenant}-{:06X}",
                    (id as u64).wrapping_mul(2_654_435_761) & 0xFF_FFFF
                ),
                current_balance: if redeemed { 0.0 } else { initial },
                initial_balance: initial,
                currency: tenant_currency(tenant).to_string(),
                is_monetary,
                allow_part_redeem,
                void: kind == 3,
                redeemed,
                product_title: product
                    .map(|p| p.title.clone())
                    .unwrap_or_else(|| "Gift Card".to_string()),
                recipient_name: name(rng),
                customer_name: name(rng),
                date_valid_start: start,
                date_valid_end: if kind == 4 { expired_end } else { far },
            }
        })
        .collect()
}
