//! The simulator's records for one tenant: typed values, their JSON in each
//! `include` form, and an ordered index by `(updated_at, id)` so a list page
//! is a range scan plus a copy.
//!
//! A record's forms are rendered on first request and kept (a client
//! usually asks for one form only, and a catalog of millions must fit in
//! memory). Any change stores a new [`Record`], so it drops the rendered
//! forms of that record only; a category's `products` depend on its
//! vouchers, so every voucher change that affects them stores the category
//! again.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use chrono::{DateTime, Utc};
use rand::rngs::StdRng;
use rand::Rng;

use super::cursor::SortKey;
use super::data::{self, Purchased};
use super::model::{CatalogCategory, CatalogVoucher, CategoryProduct};
use super::query;
use crate::stream::{Resource, TenantId};

/// Include forms a record can have: masks `0..FORMS` (vouchers use all four, categories two).
const FORMS: usize = 4;

/// One stored version of a record: its typed value and its JSON in each
/// include form, rendered at most once (the value never changes; a change
/// stores a new record).
#[derive(Debug)]
pub struct Record<T> {
    value: T,
    /// `forms[mask]` is the record with the relations of `mask` filled in, once rendered.
    forms: [OnceLock<Bytes>; FORMS],
}

impl<T> Record<T> {
    /// A record whose forms are rendered on first request.
    pub fn new(value: T) -> Self {
        Self {
            value,
            forms: Default::default(),
        }
    }

    /// The record's JSON in form `mask`, rendered by `render` on first request.
    pub fn form(&self, mask: u8, render: impl FnOnce(&T, u8) -> Bytes) -> Bytes {
        match self.forms.get(usize::from(mask)) {
            Some(slot) => slot.get_or_init(|| render(&self.value, mask)).clone(),
            None => render(&self.value, mask),
        }
    }
}

/// The sort key of a timestamp: microseconds since the epoch.
pub fn micros(at: Option<DateTime<Utc>>) -> Option<i64> {
    at.map(|at| at.timestamp_micros())
}

/// One resource's records of one tenant; the id map and the index share each
/// record, and a sorted list of their ids lets the mutator pick one at random
/// without collecting and sorting every id for each change.
#[derive(Debug)]
pub struct Table<T> {
    records: HashMap<i64, Arc<Record<T>>>,
    index: BTreeMap<SortKey, Arc<Record<T>>>,
    /// The keys of `records`, ascending (new ids are the largest, so a create
    /// appends).
    sorted_ids: Vec<i64>,
}

impl<T> Default for Table<T> {
    fn default() -> Self {
        Self {
            records: HashMap::new(),
            index: BTreeMap::new(),
            sorted_ids: Vec::new(),
        }
    }
}

/// Access to a record's `updated_at` for indexing.
pub trait Stamped {
    /// The record's `updated_at`.
    fn stamp(&self) -> Option<DateTime<Utc>>;
}

impl Stamped for CatalogVoucher {
    fn stamp(&self) -> Option<DateTime<Utc>> {
        self.updated_at
    }
}

impl Stamped for CatalogCategory {
    fn stamp(&self) -> Option<DateTime<Utc>> {
        self.updated_at
    }
}

impl<T: Stamped> Table<T> {
    fn key(id: i64, value: &T) -> SortKey {
        (micros(value.stamp()), id)
    }

    /// Stores a record, replacing an older version (and its rendered forms).
    pub fn put(&mut self, id: i64, record: Record<T>) {
        let record = Arc::new(record);
        match self.records.insert(id, Arc::clone(&record)) {
            Some(old) => {
                self.index.remove(&Self::key(id, &old.value));
            }
            None => {
                if let Err(at) = self.sorted_ids.binary_search(&id) {
                    self.sorted_ids.insert(at, id);
                }
            }
        }
        self.index.insert(Self::key(id, &record.value), record);
    }

    /// Removes a record; false when it did not exist.
    pub fn remove(&mut self, id: i64) -> bool {
        match self.records.remove(&id) {
            Some(old) => {
                self.index.remove(&Self::key(id, &old.value));
                if let Ok(at) = self.sorted_ids.binary_search(&id) {
                    self.sorted_ids.remove(at);
                }
                true
            }
            None => false,
        }
    }

    /// The typed value of a record.
    pub fn get(&self, id: i64) -> Option<&T> {
        self.records.get(&id).map(|record| &record.value)
    }

    /// The stored version of a record.
    pub fn record(&self, id: i64) -> Option<&Arc<Record<T>>> {
        self.records.get(&id)
    }

    /// The typed values of all records, in no particular order.
    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.records.values().map(|record| &record.value)
    }

    /// Ids of all records, ascending.
    pub fn ids(&self) -> Vec<i64> {
        self.sorted_ids.clone()
    }

    /// The id at `position` of the ascending ids; None past the last.
    pub fn nth_id(&self, position: usize) -> Option<i64> {
        self.sorted_ids.get(position).copied()
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Up to `limit` records after `after` (exclusive) and at or after `from`
    /// (inclusive), in `(updated_at, id)` order, as the bytes of form `mask`
    /// (rendered with `render` where not yet rendered); plus whether more
    /// follow. The last returned key is the next cursor.
    pub fn page(
        &self,
        from: Option<SortKey>,
        after: Option<SortKey>,
        limit: usize,
        mask: u8,
        render: impl Fn(&T, u8) -> Bytes,
    ) -> (Vec<(SortKey, Bytes)>, bool) {
        use std::ops::Bound;
        let lower = match (from, after) {
            (Some(from), Some(after)) if after >= from => Bound::Excluded(after),
            (Some(from), _) => Bound::Included(from),
            (None, Some(after)) => Bound::Excluded(after),
            (None, None) => Bound::Unbounded,
        };
        let mut out = Vec::with_capacity(limit);
        let mut range = self.index.range((lower, Bound::Unbounded));
        for (key, record) in range.by_ref().take(limit) {
            out.push((*key, record.form(mask, &render)));
        }
        let more = range.next().is_some();
        (out, more)
    }
}

/// Everything the simulator holds for one tenant.
#[derive(Debug)]
pub struct TenantData {
    /// Tenant id.
    pub id: TenantId,
    /// Catalog vouchers (written only through `store_voucher` and
    /// `remove_voucher`, which keep `links` in step).
    vouchers: Table<CatalogVoucher>,
    /// Catalog categories.
    categories: Table<CatalogCategory>,
    /// The ids of the vouchers that link each category: rendering a
    /// category or following its change reads them instead of scanning
    /// every voucher of the tenant.
    links: HashMap<i64, BTreeSet<i64>>,
    /// Purchased vouchers by id (redemptions).
    pub purchased: BTreeMap<i64, Purchased>,
    /// Next catalog voucher id.
    pub next_voucher_id: i64,
    /// Next category id.
    pub next_category_id: i64,
    /// Next variant id.
    pub next_variant_id: i64,
    /// Content revision counter, makes every update a real change.
    pub revision: u64,
    /// Records padded to at least this many bytes of JSON (see [`TenantData::set_oversize`]).
    pub oversize: HashMap<(Resource, i64), usize>,
}

fn to_bytes<T: serde::Serialize>(value: &T) -> Bytes {
    // Serializing these plain structs to a Vec cannot fail (no maps with
    // non-string keys, no failing Serialize impls). The copy is exactly as
    // long as the JSON (the Vec grew by doubling), as it is kept for long.
    Bytes::copy_from_slice(&serde_json::to_vec(value).unwrap_or_default())
}

impl TenantData {
    /// Generates a tenant's initial data from the seed, a share `bulk_share`
    /// of its records dated at one bulk-import instant.
    pub fn generate(
        seed: u64,
        tenant: TenantId,
        vouchers: usize,
        categories: usize,
        bulk_share: f64,
    ) -> Self {
        let mut rng = data::tenant_rng(seed, tenant, 0);
        // Dates of another `bulk_share` than the default (`initial_updated_at`).
        let mut dates = data::tenant_rng(seed, tenant, 4);
        let bulk = data::historic_time(&mut rng);
        let mut category_values = Vec::with_capacity(categories);
        for i in 0..categories {
            let id = i as i64 + 1;
            let at = data::initial_updated_at(&mut rng, &mut dates, bulk, bulk_share, false);
            category_values.push(data::category(&mut rng, id, at));
        }
        let mut next_variant_id = 1;
        let mut voucher_values = Vec::with_capacity(vouchers);
        for i in 0..vouchers {
            let id = i as i64 + 1;
            let at = data::initial_updated_at(&mut rng, &mut dates, bulk, bulk_share, true);
            voucher_values.push(data::voucher(
                &mut rng,
                tenant,
                id,
                &category_values,
                &mut next_variant_id,
                at,
            ));
        }
        let purchased_count = (vouchers / 10).clamp(20, 200);
        let purchased = data::purchased(&mut rng, tenant, &voucher_values, purchased_count)
            .into_iter()
            .map(|p| (p.id, p))
            .collect();
        let mut tenant_data = TenantData {
            id: tenant,
            vouchers: Table::default(),
            categories: Table::default(),
            links: HashMap::new(),
            purchased,
            next_voucher_id: vouchers as i64 + 1,
            next_category_id: categories as i64 + 1,
            next_variant_id,
            revision: 0,
            oversize: HashMap::new(),
        };
        for value in voucher_values {
            tenant_data.store_voucher(value);
        }
        for value in category_values {
            tenant_data.store_category(value);
        }
        tenant_data
    }

    /// Renders a category, with `products` (the vouchers that link to it,
    /// ordered by sort_order then id) or without.
    fn render_category_form(&self, category: &CatalogCategory, with_products: bool) -> Bytes {
        let mut plain = CatalogCategory {
            products: None,
            ..category.clone()
        };
        if let Some(target) = self.oversize_target(Resource::Categories, category.id) {
            plain.description_html = padded(plain.description_html.as_deref(), target, |d| {
                to_bytes(&CatalogCategory {
                    description_html: d,
                    ..plain.clone()
                })
                .len()
            });
        }
        if !with_products {
            return to_bytes(&plain);
        }
        let mut products: Vec<CategoryProduct> = self
            .linked_vouchers(category.id)
            .map(|v| CategoryProduct {
                id: v.id,
                slug: Some(v.slug.clone()),
                title: Some(v.title.clone()),
                price: Some(v.price.or(v.from_price).or(v.monetary_value).unwrap_or(0.0)),
                sale_price: Some(
                    v.sale_price
                        .or(v.from_sale_price)
                        .or(v.price)
                        .or(v.from_price)
                        .or(v.monetary_value)
                        .unwrap_or(0.0),
                ),
                sort_order: Some(v.sort_order),
            })
            .collect();
        products.sort_by_key(|p| (p.sort_order, p.id));
        to_bytes(&CatalogCategory {
            products: Some(products),
            ..plain
        })
    }

    /// Stores a category, its forms rendered on first request. They depend
    /// on the vouchers that link it, and every change of those stores the
    /// category again (`refresh_categories`), so a form rendered later shows
    /// the vouchers as they were when it was stored, as rendering it now would.
    fn store_category(&mut self, category: CatalogCategory) {
        self.categories.put(category.id, Record::new(category));
    }

    /// Stores the given categories again after their products changed, so
    /// their forms render anew, without bumping their `updated_at` (derived
    /// data changes silently).
    pub fn refresh_categories(&mut self, ids: &[i64]) {
        for id in ids {
            if let Some(category) = self.categories.get(*id).cloned() {
                self.store_category(category);
            }
        }
    }

    /// The vouchers that link category `id`, in id order.
    fn linked_vouchers(&self, id: i64) -> impl Iterator<Item = &CatalogVoucher> {
        self.links
            .get(&id)
            .into_iter()
            .flatten()
            .filter_map(|voucher| self.vouchers.get(*voucher))
    }

    /// Stores a voucher as it is, moving its links from the categories it
    /// linked before to the ones it links now (no category is re-rendered).
    fn store_voucher(&mut self, value: CatalogVoucher) {
        self.unlink(value.id);
        for category in &value.category_refs {
            self.links.entry(category.id).or_default().insert(value.id);
        }
        self.vouchers.put(value.id, Record::new(value));
    }

    /// Removes a voucher and its links; false when it did not exist.
    fn remove_voucher(&mut self, id: i64) -> bool {
        self.unlink(id);
        self.vouchers.remove(id)
    }

    /// Drops the links of the stored voucher `id`.
    fn unlink(&mut self, id: i64) {
        let Some(old) = self.vouchers.get(id) else {
            return;
        };
        for category in &old.category_refs {
            if let Some(linked) = self.links.get_mut(&category.id) {
                linked.remove(&id);
                if linked.is_empty() {
                    self.links.remove(&category.id);
                }
            }
        }
    }

    /// Stores a voucher and refreshes the categories it links to now or did before.
    pub fn put_voucher(&mut self, value: CatalogVoucher) {
        let mut touched: Vec<i64> = value.category_refs.iter().map(|r| r.id).collect();
        if let Some(old) = self.vouchers.get(value.id) {
            touched.extend(old.category_refs.iter().map(|r| r.id));
        }
        self.store_voucher(value);
        touched.sort_unstable();
        touched.dedup();
        self.refresh_categories(&touched);
    }

    /// Stores a category and refreshes the category references of vouchers linking to it.
    pub fn put_category(&mut self, value: CatalogCategory) {
        let reference = data::category_ref(&value);
        self.store_category(value);
        let linked: Vec<CatalogVoucher> = self
            .linked_vouchers(reference.id)
            .filter(|v| {
                v.category_refs
                    .iter()
                    .any(|r| r.id == reference.id && *r != reference)
            })
            .cloned()
            .collect();
        for mut voucher in linked {
            for r in voucher
                .category_refs
                .iter_mut()
                .filter(|r| r.id == reference.id)
            {
                *r = reference.clone();
            }
            self.store_voucher(voucher);
        }
    }

    /// Deletes a record and the links to it; false when it did not exist.
    pub fn delete(&mut self, resource: Resource, id: i64) -> bool {
        match resource {
            Resource::Vouchers => {
                let refs: Vec<i64> = match self.vouchers.get(id) {
                    Some(v) => v.category_refs.iter().map(|r| r.id).collect(),
                    None => return false,
                };
                self.remove_voucher(id);
                self.refresh_categories(&refs);
                true
            }
            Resource::Categories => {
                if !self.categories.remove(id) {
                    return false;
                }
                let linked: Vec<CatalogVoucher> = self.linked_vouchers(id).cloned().collect();
                for mut voucher in linked {
                    voucher.category_refs.retain(|r| r.id != id);
                    self.store_voucher(voucher);
                }
                true
            }
        }
    }

    /// Creates a new record stamped `at`; returns its id.
    pub fn create(&mut self, rng: &mut StdRng, resource: Resource, at: DateTime<Utc>) -> i64 {
        match resource {
            Resource::Vouchers => {
                let id = self.next_voucher_id;
                self.next_voucher_id += 1;
                // In id order: the table's map iterates in a per-process
                // order, and the links must follow from the seed alone.
                let mut categories: Vec<CatalogCategory> =
                    self.categories.values().cloned().collect();
                categories.sort_unstable_by_key(|category| category.id);
                let mut next_variant_id = self.next_variant_id;
                let value = data::voucher(
                    rng,
                    self.id,
                    id,
                    &categories,
                    &mut next_variant_id,
                    Some(at),
                );
                self.next_variant_id = next_variant_id;
                self.put_voucher(value);
                id
            }
            Resource::Categories => {
                let id = self.next_category_id;
                self.next_category_id += 1;
                let value = data::category(rng, id, Some(at));
                self.put_category(value);
                id
            }
        }
    }

    /// Changes a record's content; with `at` its `updated_at` becomes `at`,
    /// without it the change is silent. False when the record does not exist.
    pub fn update(
        &mut self,
        rng: &mut StdRng,
        resource: Resource,
        id: i64,
        at: Option<DateTime<Utc>>,
    ) -> bool {
        self.revision += 1;
        let revision = self.revision;
        match resource {
            Resource::Vouchers => {
                let Some(old) = self.vouchers.get(id).cloned() else {
                    return false;
                };
                let mut value = old.clone();
                change_voucher(rng, &mut value, revision);
                if let Some(at) = at {
                    value.updated_at = Some(at);
                }
                self.put_voucher(value);
                true
            }
            Resource::Categories => {
                let Some(old) = self.categories.get(id).cloned() else {
                    return false;
                };
                let mut value = old;
                match rng.random_range(0..3) {
                    0 => value.sort_order = Some(value.sort_order.unwrap_or(0) + 1),
                    1 => {
                        value.image_url = Some(format!(
                            "https://img.vouchers.example/categories/{id}-r{revision}.jpg"
                        ))
                    }
                    _ => {}
                }
                value.summary = Some(format!(
                    "{} (revision {revision})",
                    value
                        .summary
                        .as_deref()
                        .unwrap_or("Our favourites")
                        .split(" (revision")
                        .next()
                        .unwrap_or("")
                ));
                if let Some(at) = at {
                    value.updated_at = Some(at);
                }
                self.put_category(value);
                true
            }
        }
    }

    /// Sets a record's `updated_at` only; false when it does not exist.
    pub fn set_updated_at(
        &mut self,
        resource: Resource,
        id: i64,
        at: Option<DateTime<Utc>>,
    ) -> bool {
        match resource {
            Resource::Vouchers => {
                let Some(mut value) = self.vouchers.get(id).cloned() else {
                    return false;
                };
                value.updated_at = at;
                self.store_voucher(value);
                true
            }
            Resource::Categories => {
                let Some(mut value) = self.categories.get(id).cloned() else {
                    return false;
                };
                value.updated_at = at;
                self.store_category(value);
                true
            }
        }
    }

    /// Ids of a resource's records.
    pub fn ids(&self, resource: Resource) -> Vec<i64> {
        match resource {
            Resource::Vouchers => self.vouchers.ids(),
            Resource::Categories => self.categories.ids(),
        }
    }

    /// The id at `position` of a resource's ascending ids; None past the last.
    pub fn nth_id(&self, resource: Resource, position: usize) -> Option<i64> {
        match resource {
            Resource::Vouchers => self.vouchers.nth_id(position),
            Resource::Categories => self.categories.nth_id(position),
        }
    }

    /// Number of records of a resource.
    pub fn len(&self, resource: Resource) -> usize {
        match resource {
            Resource::Vouchers => self.vouchers.len(),
            Resource::Categories => self.categories.len(),
        }
    }

    /// One record's JSON in include form `mask` (rendered now when it was
    /// not yet); None when the record does not exist or the resource has no
    /// such form.
    pub fn form(&self, resource: Resource, id: i64, mask: u8) -> Option<Bytes> {
        if mask > query::full_include_mask(resource) {
            return None;
        }
        Some(match resource {
            Resource::Vouchers => self
                .vouchers
                .record(id)?
                .form(mask, |v, mask| self.voucher_form(v, mask)),
            Resource::Categories => self
                .categories
                .record(id)?
                .form(mask, |c, mask| self.category_form(c, mask)),
        })
    }

    /// One page of a resource (see [`Table::page`]); a mask the resource
    /// has no form for lists the plain form.
    pub fn page(
        &self,
        resource: Resource,
        from: Option<SortKey>,
        after: Option<SortKey>,
        limit: usize,
        mask: u8,
    ) -> (Vec<(SortKey, Bytes)>, bool) {
        let mask = if mask > query::full_include_mask(resource) {
            0
        } else {
            mask
        };
        match resource {
            Resource::Vouchers => self.vouchers.page(from, after, limit, mask, |v, mask| {
                self.voucher_form(v, mask)
            }),
            Resource::Categories => self.categories.page(from, after, limit, mask, |c, mask| {
                self.category_form(c, mask)
            }),
        }
    }

    /// A category's form `mask` (bit 0: with `products`), rendered from the
    /// vouchers that link it now.
    fn category_form(&self, category: &CatalogCategory, mask: u8) -> Bytes {
        self.render_category_form(category, mask & 1 != 0)
    }
}

/// Filler of oversize records: plain ASCII, nothing JSON must escape.
const FILLER: &str = "Oversize padding for sink payload limits. ";

/// `description` padded so that `len_with` (the JSON length of the record
/// carrying the returned description) is at least `target`; the padding is a
/// pure function of the unpadded record, so re-rendering never changes it.
fn padded(
    description: Option<&str>,
    target: usize,
    len_with: impl Fn(Option<String>) -> usize,
) -> Option<String> {
    let base = description.unwrap_or("").to_string();
    let mut candidate = description.map(str::to_string);
    let mut filler_len = 0usize;
    // Each round adds the shortfall; two rounds suffice (null -> string costs 2 bytes at most).
    for _ in 0..4 {
        let len = len_with(candidate.clone());
        if len >= target {
            break;
        }
        filler_len += target - len;
        let filler: String = FILLER.chars().cycle().take(filler_len).collect();
        candidate = Some(format!("{base}{filler}"));
    }
    candidate
}

impl TenantData {
    /// The oversize target of a record, when one is set.
    fn oversize_target(&self, resource: Resource, id: i64) -> Option<usize> {
        self.oversize.get(&(resource, id)).copied()
    }

    /// Renders a voucher in form `mask` (bit 0 categories, bit 1 variants),
    /// padded when it is oversize.
    pub fn voucher_form(&self, voucher: &CatalogVoucher, mask: u8) -> Bytes {
        match self.oversize_target(Resource::Vouchers, voucher.id) {
            None => render_voucher_form(voucher, mask),
            Some(target) => {
                let plain = |description: Option<String>| {
                    to_bytes(&CatalogVoucher {
                        description_html: description,
                        categories: None,
                        variants: None,
                        ..voucher.clone()
                    })
                    .len()
                };
                let value = CatalogVoucher {
                    description_html: padded(voucher.description_html.as_deref(), target, plain),
                    ..voucher.clone()
                };
                render_voucher_form(&value, mask)
            }
        }
    }

    /// Pads a record's `description_html` so that its JSON (in every include
    /// form) is at least `bytes` long, now and after later changes; 0 removes
    /// the padding. False when the record does not exist.
    pub fn set_oversize(&mut self, resource: Resource, id: i64, bytes: usize) -> bool {
        if bytes == 0 {
            self.oversize.remove(&(resource, id));
        } else {
            self.oversize.insert((resource, id), bytes);
        }
        match resource {
            Resource::Vouchers => {
                let Some(value) = self.vouchers.get(id).cloned() else {
                    return false;
                };
                self.store_voucher(value);
                true
            }
            Resource::Categories => {
                let Some(value) = self.categories.get(id).cloned() else {
                    return false;
                };
                self.store_category(value);
                true
            }
        }
    }

    /// A copy of a record's typed value, for [`TenantData::restore`].
    pub fn snapshot(&self, resource: Resource, id: i64) -> Option<RecordValue> {
        match resource {
            Resource::Vouchers => self
                .vouchers
                .get(id)
                .cloned()
                .map(|v| RecordValue::Voucher(Box::new(v))),
            Resource::Categories => self
                .categories
                .get(id)
                .cloned()
                .map(|c| RecordValue::Category(Box::new(c))),
        }
    }

    /// Puts a snapshot back: the record gets exactly that content again (and
    /// `updated_at`, unless `at` replaces it), re-created when it was deleted.
    pub fn restore(&mut self, value: &RecordValue, at: Option<DateTime<Utc>>) {
        match value {
            RecordValue::Voucher(voucher) => {
                let mut voucher = CatalogVoucher::clone(voucher);
                if at.is_some() {
                    voucher.updated_at = at;
                }
                self.next_voucher_id = self.next_voucher_id.max(voucher.id.saturating_add(1));
                self.put_voucher(voucher);
            }
            RecordValue::Category(category) => {
                let mut category = CatalogCategory::clone(category);
                if at.is_some() {
                    category.updated_at = at;
                }
                self.next_category_id = self.next_category_id.max(category.id.saturating_add(1));
                self.put_category(category);
            }
        }
    }
}

/// A record's typed value (the simulator's source of truth for its JSON).
#[derive(Debug, Clone, PartialEq)]
pub enum RecordValue {
    /// A catalog voucher.
    Voucher(Box<CatalogVoucher>),
    /// A catalog category.
    Category(Box<CatalogCategory>),
}

impl RecordValue {
    /// The resource the record belongs to.
    pub fn resource(&self) -> Resource {
        match self {
            RecordValue::Voucher(_) => Resource::Vouchers,
            RecordValue::Category(_) => Resource::Categories,
        }
    }

    /// The record id.
    pub fn id(&self) -> i64 {
        match self {
            RecordValue::Voucher(v) => v.id,
            RecordValue::Category(c) => c.id,
        }
    }
}

/// Room for a voucher's JSON in any form, so rendering one grows no buffer.
const RENDER_CAPACITY: usize = 4096;

/// Renders a voucher in form `mask` (bit 0 categories, bit 1 variants), unpadded.
///
/// A form is the plain JSON with `"categories"` and `"variants"` spliced in
/// before `"updated_at"`, the last key, where serde writes them; their values
/// are copies of `category_refs` and `variant_summaries`, the two keys just
/// before. Inside a JSON string a quote is always escaped (`\"`), so
/// `,"updated_at":` and the other two keys can only match where serde
/// wrote a key, and `updated_at` is the struct's last field: the last match
/// of each is the top-level key. So a form costs one serialization of the value, without a
/// copy of it, as it is rendered on a list request (the test
/// `spliced_forms_equal_serialized_forms` checks the bytes).
fn render_voucher_form(voucher: &CatalogVoucher, mask: u8) -> Bytes {
    const REFS: &[u8] = b",\"category_refs\":";
    const VARIANTS: &[u8] = b",\"variant_summaries\":";
    const UPDATED_AT: &[u8] = b",\"updated_at\":";
    if voucher.categories.is_some() || voucher.variants.is_some() {
        return serialize_voucher_form(voucher, mask);
    }
    let mut plain = Vec::with_capacity(RENDER_CAPACITY);
    if serde_json::to_writer(&mut plain, voucher).is_err() {
        return serialize_voucher_form(voucher, mask);
    }
    if mask == 0 {
        return Bytes::copy_from_slice(&plain);
    }
    let last = |end: usize, key: &[u8]| {
        plain[..end]
            .windows(key.len())
            .rposition(|window| window == key)
    };
    let keys = last(plain.len(), UPDATED_AT).and_then(|at| {
        let variants = last(at, VARIANTS)?;
        Some((last(variants, REFS)?, variants, at))
    });
    let Some((refs, variants, at)) = keys else {
        return serialize_voucher_form(voucher, mask);
    };
    let mut parts: Vec<&[u8]> = vec![&plain[..at]];
    if mask & 1 != 0 {
        parts.extend([b",\"categories\":", &plain[refs + REFS.len()..variants]]);
    }
    if mask & 2 != 0 {
        parts.extend([b",\"variants\":", &plain[variants + VARIANTS.len()..at]]);
    }
    parts.push(&plain[at..]);
    let mut out = Vec::with_capacity(parts.iter().map(|part| part.len()).sum());
    for part in parts {
        out.extend_from_slice(part);
    }
    Bytes::from(out)
}

/// Renders a voucher in form `mask` by serializing a copy with the
/// relations of `mask` set (what [`render_voucher_form`] splices).
fn serialize_voucher_form(voucher: &CatalogVoucher, mask: u8) -> Bytes {
    let form = CatalogVoucher {
        categories: (mask & 1 != 0).then(|| voucher.category_refs.clone()),
        variants: (mask & 2 != 0).then(|| voucher.variant_summaries.clone()),
        ..voucher.clone()
    };
    to_bytes(&form)
}

/// Applies one realistic content change to a voucher; the summary always
/// carries the revision so the content is guaranteed to differ.
fn change_voucher(rng: &mut StdRng, value: &mut CatalogVoucher, revision: u64) {
    match rng.random_range(0..4) {
        0 if value.price.is_some() => {
            let p = data::price(rng, 15, 600);
            value.price = Some(p);
            value.sale_price = rng
                .random_bool(0.3)
                .then(|| (p * 0.85 * 100.0).round() / 100.0);
        }
        1 => value.sort_order = rng.random_range(0..1000),
        2 => {
            if let Some(first) = value.variant_summaries.first_mut() {
                first.sale_price = match first.sale_price {
                    Some(_) => None,
                    None => first.price.map(|p| (p * 0.9 * 100.0).round() / 100.0),
                };
            }
        }
        _ => value.redemption_info = Some(format!("Book online; offer code R{revision}.")),
    }
    let base = value
        .summary
        .as_deref()
        .unwrap_or("A memorable experience.")
        .split(" (revision")
        .next()
        .unwrap_or("")
        .to_string();
    value.summary = Some(format!("{base} (revision {revision})"));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ids of every voucher of `tenant`, in listing order.
    fn listed_ids(tenant: &TenantData) -> Vec<i64> {
        let (page, more) = tenant.page(Resource::Vouchers, None, None, 10_000, 0);
        assert!(!more);
        page.iter().map(|(key, _)| key.1).collect()
    }

    /// A record with nothing but a date, for the table's own tests.
    struct Dated(Option<DateTime<Utc>>);

    impl Stamped for Dated {
        fn stamp(&self) -> Option<DateTime<Utc>> {
            self.0
        }
    }

    #[test]
    fn a_tables_sorted_ids_follow_every_put_and_remove_in_any_id_order() {
        use rand::SeedableRng;
        let mut table: Table<Dated> = Table::default();
        let mut rng = StdRng::seed_from_u64(7);
        let at = Utc::now();
        for step in 0..2_000 {
            // Ids from a small range, so that puts replace, add below the
            // largest id (as a snapshot restore does) and removes miss.
            let id = rng.random_range(-20..200);
            if rng.random_range(0..3) == 0 {
                table.remove(id);
            } else {
                table.put(id, Record::new(Dated(Some(at))));
            }
            let mut keys: Vec<i64> = table.records.keys().copied().collect();
            keys.sort_unstable();
            assert_eq!(table.ids(), keys, "step {step}");
            for (position, id) in keys.iter().enumerate() {
                assert_eq!(table.nth_id(position), Some(*id), "step {step}");
            }
            assert_eq!(table.nth_id(keys.len()), None, "step {step}");
            assert_eq!(table.index.len(), keys.len(), "step {step}");
        }
        assert!(table.len() > 100);
    }

    #[test]
    fn the_category_links_follow_every_change_as_a_scan_of_the_vouchers_would() {
        use rand::SeedableRng;
        let mut tenant = TenantData::generate(20, 1, 200, 8, 0.0);
        let mut rng = StdRng::seed_from_u64(3);
        let at = Utc::now();
        let pick = |rng: &mut StdRng, ids: Vec<i64>| ids[rng.random_range(0..ids.len())];
        for step in 0..600 {
            let vouchers = tenant.vouchers.ids();
            let categories = tenant.categories.ids();
            match step % 6 {
                0 => {
                    tenant.create(&mut rng, Resource::Vouchers, at);
                }
                1 => {
                    let id = pick(&mut rng, vouchers);
                    assert!(tenant.update(&mut rng, Resource::Vouchers, id, Some(at)));
                }
                2 if !categories.is_empty() => {
                    let id = pick(&mut rng, categories);
                    assert!(tenant.update(&mut rng, Resource::Categories, id, Some(at)));
                }
                3 => {
                    assert!(tenant.delete(Resource::Vouchers, pick(&mut rng, vouchers)));
                }
                4 if step % 60 == 4 && categories.len() > 2 => {
                    assert!(tenant.delete(Resource::Categories, pick(&mut rng, categories)));
                }
                _ => {
                    tenant.create(&mut rng, Resource::Categories, at);
                }
            }
            for category in tenant.categories.ids() {
                let mut scanned: Vec<i64> = tenant
                    .vouchers
                    .values()
                    .filter(|v| v.category_refs.iter().any(|r| r.id == category))
                    .map(|v| v.id)
                    .collect();
                scanned.sort_unstable();
                let linked: Vec<i64> = tenant.linked_vouchers(category).map(|v| v.id).collect();
                assert_eq!(linked, scanned, "step {step}, category {category}");
            }
            assert!(
                tenant
                    .links
                    .keys()
                    .all(|id| tenant.categories.get(*id).is_some()),
                "step {step}: links to a deleted category"
            );
        }
        assert!(tenant.links.values().any(|linked| linked.len() > 1));
    }

    #[test]
    fn vouchers_created_from_the_same_seed_link_the_same_categories() {
        use rand::SeedableRng;
        let created = || {
            let mut tenant = TenantData::generate(20, 1, 10, 40, 0.0);
            let mut rng = StdRng::seed_from_u64(7);
            let at = Utc::now();
            (0..30)
                .map(|_| {
                    let id = tenant.create(&mut rng, Resource::Vouchers, at);
                    let voucher = tenant.vouchers.get(id).expect("created");
                    voucher
                        .category_refs
                        .iter()
                        .map(|c| c.id)
                        .collect::<Vec<_>>()
                })
                .collect::<Vec<_>>()
        };
        let first = created();
        assert!(
            first.iter().any(|links| !links.is_empty()),
            "no voucher links a category"
        );
        assert_eq!(first, created());
    }

    #[test]
    fn a_catalog_from_one_bulk_import_lists_in_id_order_after_the_vouchers_without_a_date() {
        let tenant = TenantData::generate(20, 1, 2_000, 5, 1.0);
        let ids = listed_ids(&tenant);
        assert_eq!(ids.len(), 2_000);
        let undated: Vec<i64> = ids
            .iter()
            .copied()
            .filter(|id| {
                tenant
                    .vouchers
                    .get(*id)
                    .is_some_and(|v| v.updated_at.is_none())
            })
            .collect();
        assert!(
            !undated.is_empty() && undated.len() < 200,
            "{} undated",
            undated.len()
        );
        let dated = &ids[undated.len()..];
        assert!(undated.is_sorted() && dated.is_sorted());
        assert_eq!(undated, ids[..undated.len()]);
    }

    /// The content hash of each form the API serves a record in, with
    /// `updated_at` ignored at any depth, as the bridge's default
    /// `poll.ignore_keys` ignores it.
    fn undated(tenant: &TenantData, resource: Resource, id: i64) -> Vec<crate::hash::ContentHash> {
        let ignore = crate::hash::IgnoreKeys::new(["updated_at"]);
        (0..=query::full_include_mask(resource))
            .map(|mask| {
                let Some(form) = tenant.form(resource, id, mask) else {
                    panic!("{resource:?} {id} not generated");
                };
                let text = std::str::from_utf8(&form).expect("a rendered record is utf-8");
                crate::hash::content_hash(text, &ignore).expect("a rendered record is json")
            })
            .collect()
    }

    /// Every record's served bytes in every form (through the cache) against
    /// a fresh render of its current value, and the listing order against
    /// `(updated_at, id)` of the current values.
    fn assert_served_as_rendered_now(tenant: &TenantData) {
        for resource in [Resource::Vouchers, Resource::Categories] {
            for mask in 0..=query::full_include_mask(resource) {
                let (page, more) = tenant.page(resource, None, None, 100_000, mask);
                assert!(!more);
                let mut expected: Vec<SortKey> = Vec::new();
                for id in tenant.ids(resource) {
                    let (key, fresh) = match resource {
                        Resource::Vouchers => {
                            let Some(v) = tenant.vouchers.get(id) else {
                                panic!("voucher {id} listed by ids");
                            };
                            ((micros(v.updated_at), id), tenant.voucher_form(v, mask))
                        }
                        Resource::Categories => {
                            let Some(c) = tenant.categories.get(id) else {
                                panic!("category {id} listed by ids");
                            };
                            let fresh = tenant.render_category_form(c, mask & 1 != 0);
                            ((micros(c.updated_at), id), fresh)
                        }
                    };
                    expected.push(key);
                    assert_eq!(
                        tenant.form(resource, id, mask),
                        Some(fresh),
                        "{resource:?} {id} form {mask}"
                    );
                }
                expected.sort_unstable();
                let listed: Vec<SortKey> = page.iter().map(|(key, _)| *key).collect();
                assert_eq!(listed, expected, "{resource:?} form {mask}");
                for (key, bytes) in &page {
                    assert_eq!(tenant.form(resource, key.1, mask).as_ref(), Some(bytes));
                }
            }
        }
    }

    #[test]
    fn spliced_forms_equal_serialized_forms() {
        let tenant = TenantData::generate(21, 2, 3_000, 12, data::BULK_IMPORT_SHARE);
        let (mut refs, mut variants) = (0, 0);
        for voucher in tenant.vouchers.values() {
            refs += usize::from(!voucher.category_refs.is_empty());
            variants += usize::from(!voucher.variant_summaries.is_empty());
            for mask in 0..4 {
                assert_eq!(
                    render_voucher_form(voucher, mask),
                    serialize_voucher_form(voucher, mask),
                    "voucher {} form {mask}",
                    voucher.id
                );
            }
            // A value that carries the relations itself takes the serializing path.
            let with_relations = CatalogVoucher {
                categories: Some(Vec::new()),
                ..voucher.clone()
            };
            assert_eq!(
                render_voucher_form(&with_relations, 2),
                serialize_voucher_form(&with_relations, 2)
            );
        }
        assert!(refs > 1_000 && variants > 1_000, "{refs} {variants}");
        // Text that looks like the key inside strings does not move the splice.
        let Some(voucher) = tenant
            .vouchers
            .values()
            .find(|v| !v.category_refs.is_empty() && !v.variant_summaries.is_empty())
        else {
            panic!("no voucher with both relations");
        };
        let mut variant_summaries = voucher.variant_summaries.clone();
        if let Some(variant) = variant_summaries.first_mut() {
            variant.title = r#"a","variant_summaries":[],"updated_at":1"#.to_string();
        }
        let tricky = CatalogVoucher {
            summary: Some(r#"x","updated_at":null,"\"#.to_string()),
            description_html: Some(r#",\"updated_at\":,"category_refs":[]"#.to_string()),
            redemption_info: Some(r#"","variant_summaries":"#.to_string()),
            variant_summaries,
            ..voucher.clone()
        };
        for mask in 0..4 {
            assert_eq!(
                render_voucher_form(&tricky, mask),
                serialize_voucher_form(&tricky, mask)
            );
        }
    }

    #[test]
    fn a_record_form_is_rendered_on_first_request_only() {
        let tenant = TenantData::generate(20, 1, 200, 5, data::BULK_IMPORT_SHARE);
        let rendered = |id: i64| -> Vec<bool> {
            let Some(record) = tenant.vouchers.record(id) else {
                panic!("voucher {id} not generated");
            };
            record.forms.iter().map(|f| f.get().is_some()).collect()
        };
        assert!((1..=200).all(|id| rendered(id) == [false; FORMS]));
        let (page, _) = tenant.page(Resource::Vouchers, None, None, 50, 3);
        let first = page[0].0 .1;
        assert_eq!(rendered(first), [false, false, false, true]);
        let again = tenant.form(Resource::Vouchers, first, 3);
        assert_eq!(again.as_ref(), Some(&page[0].1));
        assert_eq!(rendered(first), [false, false, false, true]);
        // Categories too, though their products depend on the vouchers: any
        // change of a linked voucher stores the category again.
        let category_forms = |id: i64| -> Vec<bool> {
            let Some(category) = tenant.categories.record(id) else {
                panic!("category {id} not generated");
            };
            category.forms.iter().map(|f| f.get().is_some()).collect()
        };
        assert_eq!(category_forms(1), [false; FORMS]);
        let products = tenant.form(Resource::Categories, 1, 1);
        assert_eq!(category_forms(1), [false, true, false, false]);
        assert_eq!(tenant.form(Resource::Categories, 1, 1), products);
    }

    /// One change to a tenant, in a test's list of changes.
    type Step = dyn Fn(&mut TenantData, &mut StdRng);

    #[test]
    fn a_change_drops_the_rendered_forms_of_what_it_changed() {
        use rand::SeedableRng;
        let mut tenant = TenantData::generate(20, 1, 300, 8, data::BULK_IMPORT_SHARE);
        let mut rng = StdRng::seed_from_u64(7);
        fn at(s: i64) -> Option<DateTime<Utc>> {
            DateTime::<Utc>::from_timestamp(1_800_000_000 + s, 0)
        }
        assert!(tenant.set_oversize(Resource::Vouchers, 5, 3_000));
        assert!(tenant.set_oversize(Resource::Categories, 2, 9_000));
        assert!(!tenant.set_oversize(Resource::Vouchers, 301, 4_000));
        // Every form rendered once before anything changes.
        assert_served_as_rendered_now(&tenant);
        for mask in 0..4 {
            let form = tenant.form(Resource::Vouchers, 5, mask);
            assert!(form.is_some_and(|f| (3_000..3_200).contains(&f.len())));
        }
        let snapshot = tenant.snapshot(Resource::Vouchers, 9);
        let Some(snapshot) = snapshot else {
            panic!("voucher 9 not generated");
        };
        let linked = tenant
            .vouchers
            .values()
            .find(|v| !v.category_refs.is_empty())
            .map(|v| (v.id, v.category_refs[0].id));
        let Some((linked_voucher, linked_category)) = linked else {
            panic!("no voucher links a category");
        };
        let steps: Vec<Box<Step>> = vec![
            Box::new(|t, rng| assert!(t.update(rng, Resource::Vouchers, 9, at(1)))),
            Box::new(|t, rng| assert!(t.update(rng, Resource::Vouchers, 5, None))),
            Box::new(move |t, rng| {
                assert!(t.update(rng, Resource::Vouchers, linked_voucher, at(2)))
            }),
            Box::new(|t, _| assert!(t.set_updated_at(Resource::Vouchers, 12, at(3)))),
            Box::new(|t, _| assert!(t.set_updated_at(Resource::Vouchers, 13, None))),
            Box::new(|t, _| assert!(t.set_oversize(Resource::Vouchers, 5, 0))),
            Box::new(|t, _| assert!(t.set_oversize(Resource::Vouchers, 6, 2_500))),
            Box::new(move |t, rng| {
                assert!(t.update(rng, Resource::Categories, linked_category, at(4)))
            }),
            Box::new(|t, _| assert!(t.delete(Resource::Vouchers, 9))),
            Box::new(move |t, _| assert!(t.delete(Resource::Categories, linked_category))),
            Box::new(move |t, _| t.restore(&snapshot, None)),
            Box::new(|t, rng| {
                assert_eq!(
                    t.create(rng, Resource::Vouchers, at(5).unwrap_or_default()),
                    301
                )
            }),
            Box::new(|t, rng| {
                assert_eq!(
                    t.create(rng, Resource::Categories, at(6).unwrap_or_default()),
                    9
                )
            }),
        ];
        for (i, step) in steps.iter().enumerate() {
            step(&mut tenant, &mut rng);
            assert_served_as_rendered_now(&tenant);
            if i == 0 {
                let Some(Some(updated)) = tenant.vouchers.get(9).map(|v| v.updated_at) else {
                    panic!("voucher 9 lost its updated_at");
                };
                assert_eq!(Some(updated), at(1));
            }
        }
        let padded = tenant.form(Resource::Vouchers, 301, 0);
        assert!(padded.is_some_and(|f| (4_000..4_200).contains(&f.len())));
        let restored = tenant.snapshot(Resource::Vouchers, 9);
        assert!(restored.is_some_and(|r| r.id() == 9));
    }

    #[test]
    fn another_bulk_import_share_changes_only_the_dates_of_the_records() {
        let default = TenantData::generate(20, 1, 500, 5, data::BULK_IMPORT_SHARE);
        for share in [0.0, 0.5, 1.0] {
            let other = TenantData::generate(20, 1, 500, 5, share);
            assert_eq!(default.vouchers.ids(), other.vouchers.ids());
            let mut redated = 0;
            for id in default.vouchers.ids() {
                let (a, b) = (default.vouchers.get(id), other.vouchers.get(id));
                let (Some(a), Some(b)) = (a, b) else {
                    panic!("voucher {id} not generated");
                };
                assert_eq!(
                    a.updated_at.is_none(),
                    b.updated_at.is_none(),
                    "voucher {id}"
                );
                redated += usize::from(a.updated_at != b.updated_at);
                assert_eq!(
                    undated(&default, Resource::Vouchers, id),
                    undated(&other, Resource::Vouchers, id),
                    "voucher {id} at share {share}"
                );
            }
            assert!(redated > 100, "{redated} of 500 redated at share {share}");
            assert_eq!(default.categories.ids(), other.categories.ids());
            for id in default.categories.ids() {
                assert_eq!(
                    undated(&default, Resource::Categories, id),
                    undated(&other, Resource::Categories, id),
                    "category {id} at share {share}"
                );
            }
        }
    }

    #[test]
    fn the_default_share_dates_a_few_records_at_the_bulk_instant_and_lists_in_change_order() {
        let tenant = TenantData::generate(20, 1, 2_000, 5, data::BULK_IMPORT_SHARE);
        let ids = listed_ids(&tenant);
        let in_order = ids.windows(2).filter(|pair| pair[0] < pair[1]).count();
        assert!(
            in_order < 1_400,
            "{in_order} of 1,999 neighbours in id order"
        );
        let mut dates: HashMap<Option<DateTime<Utc>>, usize> = HashMap::new();
        for id in &ids {
            let voucher = tenant.vouchers.get(*id).expect("listed");
            *dates.entry(voucher.updated_at).or_default() += 1;
        }
        let bulk = dates
            .iter()
            .filter(|(at, _)| at.is_some())
            .map(|(_, n)| *n)
            .max();
        assert!(bulk.is_some_and(|n| (80..=250).contains(&n)), "{bulk:?}");
    }
}
