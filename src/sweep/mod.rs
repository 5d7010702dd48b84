//! One sweep of one stream: list the upstream pages, diff them against the
//! stored content hashes, publish the changes, and commit a page's hashes only
//! after the sink acknowledged every event of it.
//!
//! The invariant this module exists to keep: **a content hash is never
//! committed before the sink acknowledged its event.** A crash anywhere
//! therefore re-publishes (same event ids), and never loses a change:
//!
//! * a page's intents (every input of each event's id) are durable before
//!   its first event reaches the sink, and a listed record with a pending
//!   intent is compared with the intent, what downstream may have seen;
//! * deletes are journalled the same way, and each is confirmed by the
//!   single-record GET (404) before it is published;
//! * a listing always ends: a repeated cursor or a page count far beyond the
//!   records known (those its own pages committed included, up to
//!   `pagination::MAX_LISTING_PAGES`) fails the sweep without moving the watermark;
//! * a page commits only as an [`Acked`] batch, built from one delivery per
//!   event (the count checked), so the invariant holds by the types;
//! * the next pages are listed while a page is published (`read_ahead`),
//!   and the pages that arrived meanwhile, or arrive within the group's
//!   linger, are taken as one group: one intent batch, one publish, one
//!   commit, each as for a page.
//!
//! The stream state is the ledger's ([`StreamLedger`]): the sweep begins and
//! finishes through it and never saves the stream state itself. What a page
//! publishes is decided without I/O in `page`; publishing until every event
//! is acknowledged is `publish`.

mod page;
mod publish;
mod read_ahead;
mod versions;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

pub use crate::state::SweepKind;
pub use page::{dedupe, plan_page, Doomed, KnownRecords, PagePlan, PendingChange};
pub use read_ahead::{GROUP_LINGER, MAX_GROUP_PAGES, READ_AHEAD_BYTES};

use read_ahead::{PageGroup, ReadAhead};

use crate::config::OnRecordError;
use crate::crashpoint;
use crate::diff::SweepMode;
use crate::event::{self, Event, EventType, Op};
use crate::hash::{HashError, IgnoreKeys, PrintKey};
use crate::planner::history::ChangeHistory;
use crate::schema::SchemaBase;
use crate::sinks::Sink;
use crate::state::ledger::{FullRetry, SweepEnd};
use crate::state::{
    Acked, Delivery, IdSet, Intent, NotAcknowledged, StateError, StateStore, StreamLedger,
    SweepPlan,
};
use crate::stream::{Resource, StreamKey};
use crate::telemetry::metric;
use crate::upstream::client::UpstreamClient;
use crate::upstream::error::UpstreamError;
use crate::upstream::page::{Hashing, ListQuery, Page, Record};
use crate::upstream::pagination::{page_limit, PageLimit};
use crate::upstream::ratelimit::Lane;

/// Settings of a sweep, derived from `[poll]`.
#[derive(Debug, Clone)]
pub struct SweepSettings {
    /// Overlap subtracted from the watermark.
    pub lookback: Duration,
    /// Ask the API for relations.
    pub include_relations: bool,
    /// Keys left out of the content hash.
    pub ignore_keys: IgnoreKeys,
    /// Largest fraction of known records a full sweep may delete.
    pub max_delete_fraction: f64,
    /// First wait after a retriable sink failure; doubles up to `sink_backoff_max`.
    pub sink_backoff_initial: Duration,
    /// Longest wait between sink retries.
    pub sink_backoff_max: Duration,
    /// How long one publish call may take before it counts as a retriable failure.
    pub publish_timeout: Duration,
    /// Fewest pages a listing may take before it counts as endless (see [`page_limit`]).
    pub max_pages_floor: u64,
    /// First wait before a failed full sweep is tried again; doubles up to `full_retry_max`.
    pub full_retry_initial: Duration,
    /// Longest wait before a failed full sweep is tried again.
    pub full_retry_max: Duration,
    /// `sink.on_record_error`: what an event the sink can never accept does.
    pub on_record_error: OnRecordError,
    /// Where the events' `dataschema` points (`events.schema_base_url`).
    pub schema_base: SchemaBase,
    /// `events.changed_fields`: updates carry `changedfields`; field hashes are kept.
    pub changed_fields: bool,
    /// `events.before`: updates and deletes carry `before`; bodies are kept.
    pub before: bool,
    /// Bytes of listed records read ahead of the pages being published (see
    /// [`ReadAhead`]); at least one page is always read ahead.
    pub read_ahead_bytes: usize,
    /// The most consecutive pages, read ahead or arriving within
    /// `group_linger`, that one intent batch, publish and commit take
    /// together (1: page by page).
    pub max_group_pages: usize,
    /// How long a group waits after its first page for the listing's next
    /// pages to join it (zero: only those already read ahead).
    pub group_linger: Duration,
}

/// The `[poll]` defaults (one home: `crate::config`), and the sweep's own.
impl Default for SweepSettings {
    fn default() -> Self {
        use crate::config::{
            DEFAULT_BEFORE, DEFAULT_CHANGED_FIELDS, DEFAULT_FULL_RESYNC_INTERVAL,
            DEFAULT_IGNORE_KEYS, DEFAULT_INCLUDE_RELATIONS, DEFAULT_LOOKBACK,
            DEFAULT_MAX_DELETE_FRACTION, DEFAULT_MAX_PAGES_FLOOR, DEFAULT_POLL_INTERVAL,
        };
        Self {
            lookback: DEFAULT_LOOKBACK,
            include_relations: DEFAULT_INCLUDE_RELATIONS,
            ignore_keys: IgnoreKeys::new(DEFAULT_IGNORE_KEYS),
            max_delete_fraction: DEFAULT_MAX_DELETE_FRACTION,
            sink_backoff_initial: Duration::from_millis(200),
            sink_backoff_max: Duration::from_secs(30),
            publish_timeout: Duration::from_secs(120),
            max_pages_floor: DEFAULT_MAX_PAGES_FLOOR,
            // A failed full sweep is retried after a poll interval, doubling up to the resync interval.
            full_retry_initial: DEFAULT_POLL_INTERVAL,
            full_retry_max: DEFAULT_FULL_RESYNC_INTERVAL,
            on_record_error: OnRecordError::default(),
            schema_base: SchemaBase::default(),
            changed_fields: DEFAULT_CHANGED_FIELDS,
            before: DEFAULT_BEFORE,
            read_ahead_bytes: READ_AHEAD_BYTES,
            max_group_pages: MAX_GROUP_PAGES,
            group_linger: GROUP_LINGER,
        }
    }
}

/// Why a sweep failed. The watermark never moves on a failed sweep.
#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    /// The upstream API failed (after the client's own retries).
    #[error("{0}")]
    Upstream(#[from] UpstreamError),
    /// The state store failed.
    #[error("{0}")]
    State(#[from] StateError),
    /// The sink rejected an event permanently.
    #[error("sink {sink} rejected event {event_id}: {message}")]
    SinkRejected {
        /// Sink name.
        sink: String,
        /// The rejected event.
        event_id: String,
        /// The sink's reason.
        message: String,
    },
    /// A batch was about to be committed without an acknowledgement for every
    /// event (a bug caught by [`crate::state::Acked`]); nothing was committed.
    #[error("{0}")]
    NotAcknowledged(#[from] NotAcknowledged),
    /// A refused event could not be turned into its dead letter.
    #[error("{0}")]
    DeadLetter(#[from] event::DeadLetterError),
    /// A record's JSON could not be hashed.
    #[error("record {record_id}: {source}")]
    Hash {
        /// The record id.
        record_id: i64,
        /// What was wrong.
        source: HashError,
    },
    /// Shutdown was requested; the sweep stopped between two pages.
    #[error("sweep stopped early by shutdown or a replay request")]
    Interrupted,
    /// A full sweep would have deleted too much and refused.
    #[error(
        "full sweep refused to delete {would_delete} of {known} known records \
         (more than poll.max_delete_fraction = {max_fraction}); check the upstream: if the \
         deletions are real, raise poll.max_delete_fraction or run `voucher-cdc replay` for \
         the stream (a replay confirms each delete with the API and is not limited)"
    )]
    DeleteGuard {
        /// Records the sweep would have deleted.
        would_delete: u64,
        /// Records known before the sweep.
        known: u64,
        /// The configured limit.
        max_fraction: f64,
    },
}

impl SweepError {
    /// True when the upstream refused access (401/403/404): the stream should park.
    pub fn is_parking(&self) -> bool {
        matches!(self, SweepError::Upstream(e) if e.is_parking())
    }
}

/// What a sweep did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// `incremental`, `full` or `replay`.
    pub kind: &'static str,
    /// List requests answered.
    pub pages: u64,
    /// Records listed.
    pub records_seen: u64,
    /// Events acknowledged, by op.
    pub created: u64,
    /// Updates acknowledged.
    pub updated: u64,
    /// Snapshots acknowledged.
    pub snapshots: u64,
    /// Deletes acknowledged.
    pub deleted: u64,
    /// Events the sink refused that went out as dead letters instead.
    pub dead_lettered: u64,
    /// Creates and updates (acknowledged or dead-lettered) whose record's
    /// `updated_at` is after the stream's previous watermark: changes the
    /// upstream announced since the last listing, not silent ones the
    /// lookback overlap happened to catch. What the planner learns from.
    pub announced: u64,
    /// What a first sync's `updated_at` values show of the stream's changes
    /// before it (empty for every other sweep).
    pub history: ChangeHistory,
    /// The new watermark.
    pub watermark: Option<DateTime<Utc>>,
    /// Records known after the sweep.
    pub records_known: u64,
}

impl SweepReport {
    /// Events acknowledged in total (record events only).
    pub fn events(&self) -> u64 {
        self.created + self.updated + self.snapshots + self.deleted
    }

    /// Events that can add a record to the store: creates, snapshots and
    /// dead letters (a dead-lettered record is committed too).
    fn additions(&self) -> u64 {
        self.created + self.snapshots + self.dead_lettered
    }

    fn count(&mut self, op: Op) {
        match op {
            Op::Create => self.created += 1,
            Op::Update => self.updated += 1,
            Op::Snapshot => self.snapshots += 1,
            Op::Delete => self.deleted += 1,
        }
    }
}

/// Progress callback: called after each committed page with (records so far, pages so far).
pub type Progress = Arc<dyn Fn(StreamKey, u64, u64) + Send + Sync>;

/// Everything one stream's sweeps need; built once per stream.
#[derive(Clone)]
pub struct Sweeper {
    stream: StreamKey,
    client: UpstreamClient,
    store: Arc<dyn StateStore>,
    sink: Arc<dyn Sink>,
    settings: Arc<SweepSettings>,
    progress: Option<Progress>,
}

impl Sweeper {
    /// A sweeper of `stream`, listing through `client` (with the token's
    /// shared budget), committing to `store` and publishing to `sink`.
    pub fn new(
        stream: StreamKey,
        client: UpstreamClient,
        store: Arc<dyn StateStore>,
        sink: Arc<dyn Sink>,
        settings: Arc<SweepSettings>,
    ) -> Self {
        Self {
            stream,
            client,
            store,
            sink,
            settings,
            progress: None,
        }
    }

    /// Calls `progress` after each committed page.
    pub fn with_progress(mut self, progress: Progress) -> Self {
        self.progress = Some(progress);
        self
    }

    /// The stream swept.
    pub fn stream(&self) -> StreamKey {
        self.stream
    }

    /// The state store.
    pub fn store(&self) -> &Arc<dyn StateStore> {
        &self.store
    }

    /// The settings it sweeps with.
    pub fn settings(&self) -> &SweepSettings {
        &self.settings
    }

    /// The event sink.
    pub fn sink(&self) -> &Arc<dyn Sink> {
        &self.sink
    }

    /// The stream's lifecycle transitions.
    pub fn ledger(&self) -> StreamLedger<'_> {
        StreamLedger::new(self.store.as_ref(), self.stream)
    }

    /// Publishes the `replay.cancelled` frame closing `replay` (cancelled by
    /// an operator after its first sweep published `replay.started`), retrying
    /// like any frame for at most [`CANCEL_FRAME_TIMEOUT`].
    pub async fn publish_replay_cancelled(
        &self,
        replay: &crate::state::ReplayState,
    ) -> Result<(), SweepError> {
        let since = replay.since.map(event::format_time);
        let frame = event::replay_cancelled_event(
            self.stream,
            &replay.id,
            since.as_deref(),
            replay.records,
            Utc::now(),
            &self.settings.schema_base,
        );
        let plan = crate::state::ledger::plan_sweep(
            &crate::state::StreamState::default(),
            SweepKind::Incremental,
            self.settings.lookback,
        );
        let cancel = CancellationToken::new();
        let run = SweepRun {
            sweeper: self,
            client: self.client.clone(),
            plan: &plan,
            cancel: &cancel,
            report: SweepReport::default(),
        };
        let publish = run.publish_all(std::slice::from_ref(&frame));
        match tokio::time::timeout(CANCEL_FRAME_TIMEOUT, publish).await {
            Ok(result) => result?,
            Err(_) => return Err(SweepError::Interrupted),
        }
        run.count_event(&frame);
        Ok(())
    }

    /// Runs one sweep; records its outcome in the stream state either way.
    ///
    /// `cancel` stops the sweep between two pages: the page (or group of
    /// pages) in flight finishes (acks awaited, hashes committed), no further
    /// page is requested or taken into a group, and the sweep fails with
    /// [`SweepError::Interrupted`].
    pub async fn run(
        &self,
        kind: SweepKind,
        cancel: &CancellationToken,
    ) -> Result<SweepReport, SweepError> {
        let ledger = self.ledger();
        let plan = ledger.begin_sweep(kind, self.settings.lookback, Utc::now())?;
        let label = plan.label();
        debug!(tenant = self.stream.tenant, resource = %self.stream.resource, kind = label, "sweep started");

        // A periodic full sweep's pages wait in the budget's bulk lane, behind
        // polls beyond its share; first syncs and replays are polls.
        let lane = if plan.full && plan.mode == SweepMode::Normal {
            Lane::Bulk
        } else {
            Lane::Poll
        };
        // Listed records are hashed as their page is read (one pass), and
        // printed where the store keeps prints. A full sweep of a known
        // stream (or a replay of all of it) only delimits them there: most
        // are unchanged, and a print equal to the stored one gives the
        // content hash without a parse (`page::plan_page`).
        let hashing = Hashing {
            ignore: Arc::new(self.settings.ignore_keys.clone()),
            prints: self
                .store
                .print_secret()
                .map(|secret| PrintKey::new(&secret, &self.settings.ignore_keys)),
            defer: plan.full && plan.mode != SweepMode::FirstSync,
        };
        let mut run = SweepRun {
            sweeper: self,
            client: self.client.in_lane(lane).hashing(hashing),
            plan: &plan,
            cancel,
            report: SweepReport {
                kind: label,
                ..SweepReport::default()
            },
        };
        let swept = run.sweep().await;
        let report = run.report;
        let outcome = match &swept {
            Ok(()) => "ok",
            Err(SweepError::Interrupted) => "interrupted",
            Err(_) => "error",
        };
        metrics::counter!(metric::SWEEPS, "tenant" => self.stream.tenant.to_string(),
            "resource" => self.stream.resource.as_str(), "kind" => label, "outcome" => outcome)
        .increment(1);

        let replay_snapshots = report.snapshots;
        let end = match &swept {
            Ok(()) => {
                info!(tenant = self.stream.tenant, resource = %self.stream.resource, kind = label,
                    pages = report.pages, records = report.records_seen, events = report.events(),
                    deleted = report.deleted, "sweep finished");
                SweepEnd::Completed {
                    watermark: report.watermark,
                    records_known: report.records_known,
                    replay_snapshots,
                }
            }
            Err(SweepError::Interrupted) => {
                info!(tenant = self.stream.tenant, resource = %self.stream.resource, kind = label,
                    "sweep stopped early (shutdown or replay); the next run resumes from the same watermark");
                SweepEnd::Interrupted { replay_snapshots }
            }
            Err(e) => {
                warn!(tenant = self.stream.tenant, resource = %self.stream.resource, kind = label,
                    error = %e, "sweep failed");
                SweepEnd::Failed {
                    error: e.to_string(),
                    replay_snapshots,
                }
            }
        };
        let full_retry = FullRetry {
            initial: self.settings.full_retry_initial,
            max: self.settings.full_retry_max,
        };
        ledger.finish_sweep(&plan, &end, full_retry, Utc::now())?;
        if let Err(e) = self.sink.flush().await {
            warn!(sink = self.sink.name(), error = %e, "sink flush failed");
        }
        swept.map(|()| report)
    }
}

/// One run of a sweep: the plan it follows, its cancel, and what it did so far.
struct SweepRun<'a> {
    sweeper: &'a Sweeper,
    /// The sweeper's client, in the budget lane of this run.
    client: UpstreamClient,
    plan: &'a SweepPlan,
    cancel: &'a CancellationToken,
    report: SweepReport,
}

impl SweepRun<'_> {
    /// The sweep proper; `report` holds what it did so far, also when it fails.
    async fn sweep(&mut self) -> Result<(), SweepError> {
        let sweeper = self.sweeper;
        let plan = self.plan;
        let stream = sweeper.stream;
        let known_before = sweeper.store.record_count(stream)?;
        if plan.replay_id.is_some() {
            self.publish_replay_frame(false, 0).await?;
        }

        let query = ListQuery {
            updated_since: plan.updated_since,
            cursor: None,
            include_relations: sweeper.settings.include_relations,
        };
        let floor = sweeper.settings.max_pages_floor;
        // Raised as the listing commits records not known before (see `PageLimit`).
        let limit = PageLimit::new(page_limit(known_before, floor));
        let pages =
            self.client
                .list_pages_bounded(stream.tenant, stream.resource, query, limit.clone());
        let settings = &sweeper.settings;
        let mut pages = ReadAhead::new(pages, settings.read_ahead_bytes, self.cancel.clone());
        let mut first_server_time = None;
        let mut last_server_time = None;
        // True once the page without a next cursor was processed: only then
        // did the listing end, rather than stop (cancelled).
        let mut listed_to_the_end = false;
        while let Some(read) = pages.next().await {
            // Every page that arrived meanwhile, or arrives within the
            // group's linger, joins the group: one intent batch, one publish
            // and one commit for all of them.
            let mut group = PageGroup::default();
            let mut failed = None;
            let mut next = Some(read);
            // Pages still being listed join until then (see `read_ahead`).
            let linger_until = tokio::time::Instant::now() + settings.group_linger;
            while let Some(read) = next.take() {
                let (page, budget) = read.split();
                let page = match page {
                    Ok(page) => page,
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                };
                first_server_time.get_or_insert(page.server_time);
                last_server_time = Some(page.server_time);
                self.report.pages += 1;
                self.report.records_seen += page.records.len() as u64;
                self.count_page(&page);
                group.take(page, budget);
                if group.pages < settings.max_group_pages && !self.cancel.is_cancelled() {
                    // After the listing's last page nothing is waited for.
                    next = if group.more {
                        pages.ready_by(linger_until).await
                    } else {
                        pages.ready()
                    };
                }
            }
            if let Some(listed_at) = group.listed_at {
                let additions = self.report.additions();
                self.process_page(&group.records, listed_at).await?;
                // An unchanged group asks the store nothing.
                if self.report.additions() > additions {
                    let known = sweeper.store.record_count(stream)?;
                    limit.raise_to(page_limit(known, floor));
                }
                if let Some(progress) = &sweeper.progress {
                    progress(stream, self.report.records_seen, self.report.pages);
                }
            }
            if let Some(e) = failed {
                return Err(e.into());
            }
            if group.listed_at.is_some() {
                listed_to_the_end = !group.more;
            }
            if group.more && self.cancel.is_cancelled() {
                return Err(SweepError::Interrupted);
            }
        }
        if !listed_to_the_end {
            // The listing stopped before its last page (cancelled while the
            // next page was being read): nothing after the pages seen may
            // count as listed (no watermark, no deletes, no replay end).
            return Err(SweepError::Interrupted);
        }

        if plan.full {
            // The GETs that confirm deletes carry no clock: the last listing's stands in.
            let listed_at = last_server_time.unwrap_or_else(Utc::now);
            self.delete_unseen(known_before, listed_at).await?;
        }

        if plan.replay_id.is_some() {
            // Snapshots of earlier, interrupted runs of this replay count too.
            let total = plan
                .replay_records_before
                .saturating_add(self.report.snapshots);
            self.publish_replay_frame(true, total).await?;
        }

        self.report.watermark = first_server_time;
        self.report.records_known = sweeper.store.record_count(stream)?;
        Ok(())
    }

    fn count_page(&self, page: &Page) {
        let stream = self.sweeper.stream;
        let tenant = stream.tenant.to_string();
        let resource = stream.resource.as_str();
        metrics::counter!(metric::PAGES, "tenant" => tenant.clone(), "resource" => resource)
            .increment(1);
        metrics::counter!(metric::RECORDS_SEEN, "tenant" => tenant, "resource" => resource)
            .increment(page.records.len() as u64);
    }

    /// Publishes `replay.started` (or, with `completed`, `replay.completed`)
    /// and waits for its ack.
    async fn publish_replay_frame(&self, completed: bool, records: u64) -> Result<(), SweepError> {
        let Some(replay_id) = self.plan.replay_id.as_deref() else {
            return Ok(());
        };
        let since = self.plan.replay_since.map(event::format_time);
        let frame = event::replay_event(
            self.sweeper.stream,
            replay_id,
            since.as_deref(),
            completed,
            records,
            Utc::now(),
            &self.sweeper.settings.schema_base,
        );
        self.publish_all(std::slice::from_ref(&frame)).await?;
        self.count_event(&frame);
        Ok(())
    }

    /// What the store knows about the records of a page: committed state,
    /// tombstones of the ids it does not hold, and pending intents.
    fn known_records(&self, records: &[Record]) -> Result<KnownRecords, SweepError> {
        let store = &self.sweeper.store;
        let stream = self.sweeper.stream;
        let ids: Vec<i64> = dedupe(records).iter().map(|r| r.id).collect();
        let mut known = KnownRecords::default();
        let mut unknown_ids = Vec::new();
        for (id, committed) in ids.iter().zip(store.get_records(stream, &ids)?) {
            match committed {
                Some(committed) => {
                    known.committed.insert(*id, committed);
                }
                None => unknown_ids.push(*id),
            }
        }
        if !unknown_ids.is_empty() {
            let tombstones = store.get_tombstones(stream, &unknown_ids)?;
            known.tombstones = unknown_ids
                .iter()
                .copied()
                .zip(tombstones)
                .filter_map(|(id, t)| t.map(|t| (id, t)))
                .collect();
        }
        let listed: IdSet = ids.into_iter().collect();
        known.intents = store
            .pending_intents(stream)?
            .into_iter()
            .filter(|(id, _)| listed.contains(id))
            .collect();
        Ok(known)
    }

    /// Diffs one page (or a group of consecutive pages, taken as one: see
    /// `read_ahead`), publishes its changes, and commits them once
    /// acknowledged. `listed_at` is the upstream's clock when it listed them
    /// (its `server_time`): the record dates a first sync learns from are the
    /// upstream's, so their ages are measured on its clock, not the bridge's.
    async fn process_page(
        &mut self,
        records: &[Record],
        listed_at: DateTime<Utc>,
    ) -> Result<(), SweepError> {
        if records.is_empty() {
            return Ok(());
        }
        let sweeper = self.sweeper;
        let stream = sweeper.stream;
        let known = self.known_records(records)?;
        let page = plan_page(records, &known, self.plan, &sweeper.settings.ignore_keys)?;
        let epoch = self.plan.epoch;
        let announced = page.announced(self.plan.announced_after);
        if self.plan.mode == SweepMode::FirstSync {
            self.report.history.merge(page.history(listed_at));
        }
        // Seen marks and the prints they carry: a full sweep's alone.
        let (seen, reprints) = if self.plan.full {
            (page.unchanged, page.reprints)
        } else {
            (Vec::new(), Vec::new())
        };
        let changed = !page.changes.is_empty();
        let acked = if changed {
            let versions = versions::page_versions(
                &sweeper.settings,
                sweeper.store.as_ref(),
                stream,
                &page.changes,
            )?;
            let intents: Vec<(i64, Intent)> = page
                .changes
                .iter()
                .map(|c| (c.record.id, c.intent()))
                .collect();
            // Durable before the first event of the page reaches the sink.
            sweeper.store.write_intents(stream, &intents)?;
            self.crash_point(crashpoint::names::AFTER_INTENTS);

            let detected_at = Utc::now();
            let ops: Vec<Op> = page.changes.iter().map(|c| c.change.op).collect();
            // Published in chunks of at most PUBLISH_CHUNK_BYTES of records,
            // each chunk's events dropped once acknowledged: a page of large
            // records (a category lists its vouchers) never has all its
            // events in memory at once beside the body.
            let mut deliveries = Vec::with_capacity(page.changes.len());
            for chunk in publish_chunks(&page.changes) {
                let events: Vec<Event> = page.changes[chunk.clone()]
                    .iter()
                    .zip(chunk.clone())
                    .map(|(c, i)| {
                        let schema_base = &sweeper.settings.schema_base;
                        c.event(stream, detected_at, schema_base, versions.attributes(i))
                    })
                    .collect();
                let acked = self.publish_changes(&events).await?;
                self.count_deliveries(&ops[chunk], &events, &acked);
                deliveries.extend(acked);
            }
            self.crash_point(crashpoint::names::AFTER_PUBLISH);
            self.report.announced += announced;
            let commits = page.changes.iter().map(|c| c.commit(epoch)).collect();
            Acked::page(commits, deliveries, seen, epoch)?
                .with_versions(versions.stored)
                .with_reprints(reprints)
        } else {
            Acked::seen_only(seen, epoch).with_reprints(reprints)
        };
        // Every event of the page is acknowledged: now, and only now, commit.
        sweeper.store.commit_page(stream, &acked)?;
        if changed {
            self.crash_point(crashpoint::names::AFTER_COMMIT);
        }
        Ok(())
    }

    /// Reaches crash point `name` at its worst moment: when it fires, every
    /// commit the store accepted so far is on disk (see [`crashpoint`]).
    fn crash_point(&self, name: &'static str) {
        crashpoint::hit_durable(name, || {
            self.sweeper.store.flush().map_err(|e| e.to_string())
        });
    }

    /// Counts acknowledged events by op, and dead letters. The metric is
    /// incremented once per (type, op) of the batch, not once per event.
    fn count_deliveries(&mut self, ops: &[Op], events: &[Event], deliveries: &[Delivery]) {
        let mut published: Vec<(EventType, Option<Op>, u64)> = Vec::new();
        for ((op, event), delivery) in ops.iter().zip(events).zip(deliveries) {
            match delivery {
                Delivery::DeadLettered(_) => self.report.dead_lettered += 1,
                Delivery::Acknowledged => {
                    self.report.count(*op);
                    match published
                        .iter_mut()
                        .find(|(ty, op, _)| *ty == event.ty && *op == event.op)
                    {
                        Some((_, _, n)) => *n += 1,
                        None => published.push((event.ty, event.op, 1)),
                    }
                }
            }
        }
        for (ty, op, n) in published {
            self.count_events(ty, op, n);
        }
    }

    /// After a complete full listing: emits `*.deleted` for every record (and
    /// every possibly-published intent) the listing did not contain, each
    /// confirmed gone by the single-record GET first. `listed_at` is the
    /// listing's `server_time`, the clock of the records a GET still finds.
    async fn delete_unseen(
        &mut self,
        known_before: u64,
        listed_at: DateTime<Utc>,
    ) -> Result<(), SweepError> {
        let sweeper = self.sweeper;
        let plan = self.plan;
        let stream = sweeper.stream;
        let unseen = sweeper.store.unseen_records(stream, plan.epoch)?;
        // Built once per full sweep over a whole stream: the standard hasher.
        let intents: HashMap<i64, Intent> =
            sweeper.store.pending_intents(stream)?.into_iter().collect();

        // A pending intent is the latest change possibly published.
        let mut doomed: Vec<Doomed> = unseen
            .iter()
            .map(|(id, r)| Doomed::new(*id, Some(r), intents.get(id), plan.replay))
            .collect();
        let committed_unseen = doomed.len() as u64;
        // Intents of records never committed: published perhaps, gone now.
        let unseen_ids: HashSet<i64> = unseen.iter().map(|(id, _)| *id).collect();
        let orphans: Vec<i64> = intents
            .keys()
            .copied()
            .filter(|id| !unseen_ids.contains(id))
            .collect();
        if !orphans.is_empty() {
            let stored = sweeper.store.get_records(stream, &orphans)?;
            for (id, stored) in orphans.iter().zip(stored) {
                if stored.is_none() {
                    doomed.push(Doomed::new(*id, None, intents.get(id), plan.replay));
                }
            }
        }
        if doomed.is_empty() {
            return Ok(());
        }
        // The guard protects against a broken listing before any request is
        // spent on confirmations. Orphan intents are not "known" records and
        // never count; a first sync has nothing to protect, and a replay is
        // what the guard's message advises (each delete is confirmed anyway).
        let max_fraction = sweeper.settings.max_delete_fraction;
        let limit = max_fraction * (known_before.max(1) as f64);
        if plan.mode == SweepMode::Normal && (committed_unseen as f64) > limit {
            metrics::counter!(metric::DELETES_REFUSED, "tenant" => stream.tenant.to_string(),
                "resource" => stream.resource.as_str())
            .increment(1);
            return Err(SweepError::DeleteGuard {
                would_delete: committed_unseen,
                known: known_before,
                max_fraction,
            });
        }

        doomed.sort_by_key(|d| d.id);
        for chunk in doomed.chunks(DELETE_CHUNK) {
            let (gone, found) = self.confirm_gone(chunk).await?;
            if !found.is_empty() {
                // The listing skipped them: they are seen, and processed like a page.
                metrics::counter!(metric::DELETES_RESCINDED, "tenant" => stream.tenant.to_string(),
                    "resource" => stream.resource.as_str())
                .increment(found.len() as u64);
                info!(tenant = stream.tenant, resource = %stream.resource,
                    records = found.len(),
                    "records missing from the full listing still exist upstream; not deleted");
                self.process_page(&found, listed_at).await?;
            }
            if gone.is_empty() {
                continue;
            }
            let detected_at = Utc::now();
            let intents: Vec<(i64, Intent)> = gone.iter().map(|d| (d.id, d.intent())).collect();
            let befores =
                versions::delete_befores(&sweeper.settings, sweeper.store.as_ref(), stream, &gone)?;
            sweeper.store.write_intents(stream, &intents)?;
            self.crash_point(crashpoint::names::AFTER_DELETE_INTENTS);
            let events: Vec<Event> = gone
                .iter()
                .zip(&befores)
                .map(|(d, before)| {
                    d.event(
                        stream,
                        detected_at,
                        &sweeper.settings.ignore_keys,
                        &sweeper.settings.schema_base,
                        before.as_deref(),
                    )
                })
                .collect::<Result<_, _>>()?;
            let deliveries = self.publish_changes(&events).await?;
            self.crash_point(crashpoint::names::AFTER_DELETE_PUBLISH);
            self.count_deliveries(&vec![Op::Delete; events.len()], &events, &deliveries);
            let tombstones = gone.iter().map(|d| d.tombstone()).collect();
            let acked = Acked::deletes(tombstones, &deliveries)?;
            sweeper.store.commit_deletes(stream, &acked)?;
            self.crash_point(crashpoint::names::AFTER_DELETE_COMMIT);
        }
        Ok(())
    }

    /// Asks the single-record GET about each record: 404 means gone; a record
    /// that answers is returned to be processed as listed.
    async fn confirm_gone<'d>(
        &self,
        doomed: &'d [Doomed],
    ) -> Result<(Vec<&'d Doomed>, Vec<Record>), SweepError> {
        let sweeper = self.sweeper;
        let stream = sweeper.stream;
        let mut gone = Vec::with_capacity(doomed.len());
        let mut found = Vec::new();
        for d in doomed {
            let answer = match stream.resource {
                Resource::Vouchers => self.client.get_voucher(stream.tenant, d.id).await,
                Resource::Categories => self.client.get_category(stream.tenant, d.id).await,
            };
            match answer {
                Ok(record) if record.id == d.id => found.push(record),
                Ok(record) => {
                    warn!(tenant = stream.tenant, resource = %stream.resource,
                        asked = d.id, answered = record.id,
                        "the single-record GET answered with another id; the record is not deleted");
                }
                Err(e) if e.status() == Some(404) => gone.push(d),
                Err(e) => return Err(e.into()),
            }
        }
        Ok((gone, found))
    }

    fn count_event(&self, e: &Event) {
        self.count_events(e.ty, e.op, 1);
    }

    fn count_events(&self, ty: EventType, op: Option<Op>, n: u64) {
        let stream = self.sweeper.stream;
        metrics::counter!(metric::EVENTS_PUBLISHED,
            "tenant" => stream.tenant.to_string(),
            "resource" => stream.resource.as_str(),
            "type" => ty.as_str(),
            "op" => op.map_or("none", Op::as_str))
        .increment(n);
    }
}

/// Record bytes whose events a page publishes at a time (see [`publish_chunks`]).
const PUBLISH_CHUNK_BYTES: usize = 1 << 20;

/// The changes of a page split into runs of about [`PUBLISH_CHUNK_BYTES`] of
/// records (at least one change each), in page order: a page of 50 vouchers
/// (80 KB) is one run, a page of 50 categories listing their vouchers (6 MB)
/// about six.
fn publish_chunks(changes: &[PendingChange<'_>]) -> Vec<std::ops::Range<usize>> {
    let mut chunks = Vec::new();
    let mut start = 0;
    let mut bytes = 0;
    for (i, change) in changes.iter().enumerate() {
        let size = change.record.raw.as_bytes().len();
        if i > start && bytes + size > PUBLISH_CHUNK_BYTES {
            chunks.push(start..i);
            start = i;
            bytes = 0;
        }
        bytes += size;
    }
    if start < changes.len() {
        chunks.push(start..changes.len());
    }
    chunks
}

/// How long a `replay.cancelled` frame is retried before the cancel gives up on it.
pub const CANCEL_FRAME_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Deletes confirmed, published and committed together (one GET each first).
const DELETE_CHUNK: usize = 50;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::diff::Change;
    use crate::hash::ContentHash;
    use crate::upstream::page::RawJson;

    #[test]
    fn a_page_publishes_in_runs_of_about_a_mebibyte_of_records_in_page_order() {
        let record = |id: i64, size: usize| {
            let raw = format!(r#"{{"id":{id},"x":"{}"}}"#, "a".repeat(size));
            Record::new(id, None, RawJson::from_string(raw).unwrap())
        };
        let change = |record| PendingChange {
            record,
            hash: ContentHash([0; 16]),
            change: Change {
                op: Op::Snapshot,
                previous: None,
                generation: 0,
                seq: 1,
                replay: None,
            },
            updated_at_micros: None,
        };
        let small: Vec<Record> = (0..50).map(|id| record(id, 1_600)).collect();
        let changes: Vec<PendingChange<'_>> = small.iter().map(change).collect();
        assert_eq!(publish_chunks(&changes), vec![0..50]);
        let large: Vec<Record> = (0..50).map(|id| record(id, 114_000)).collect();
        let changes: Vec<PendingChange<'_>> = large.iter().map(change).collect();
        let chunks = publish_chunks(&changes);
        assert_eq!(chunks.len(), 6);
        assert_eq!(chunks[0], 0..9);
        assert_eq!(chunks.last(), Some(&(45..50)));
        let covered: Vec<usize> = chunks.into_iter().flatten().collect();
        assert_eq!(covered, (0..50).collect::<Vec<_>>());
        // A record larger than a chunk is a chunk of its own.
        let huge: Vec<Record> = vec![record(1, 10), record(2, 3 << 20), record(3, 10)];
        let changes: Vec<PendingChange<'_>> = huge.iter().map(change).collect();
        assert_eq!(publish_chunks(&changes), vec![0..1, 1..2, 2..3]);
        assert!(publish_chunks(&[]).is_empty());
    }
}
