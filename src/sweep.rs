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
//!   records known fails the sweep without moving the watermark.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures::StreamExt;
use serde_json::value::RawValue;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::config::OnRecordError;
use crate::crashpoint;
use crate::diff::{plan_change, Change, Known, SweepMode};
use crate::event::{self, Event, Op, RecordChange};
use crate::hash::{content_hash, ContentHash, HashError, IgnoreKeys};
use crate::sinks::{Sink, SinkError};
use crate::state::{
    DeadLetter, Intent, RecordState, StateError, StateStore, StreamState, Tombstone,
};
use crate::stream::{Resource, StreamKey};
use crate::telemetry::metric;
use crate::upstream::client::UpstreamClient;
use crate::upstream::error::UpstreamError;
use crate::upstream::page::{ListQuery, Page, Record};
use crate::upstream::pagination::page_limit;

/// Which kind of sweep the scheduler asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepKind {
    /// `updated_since = watermark - lookback`; never deletes.
    Incremental,
    /// No `updated_since`; marks every record seen and deletes the unseen.
    Full,
}

impl SweepKind {
    /// The name used in metrics and status.
    pub fn as_str(self) -> &'static str {
        match self {
            SweepKind::Incremental => "incremental",
            SweepKind::Full => "full",
        }
    }
}

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
}

impl Default for SweepSettings {
    fn default() -> Self {
        Self {
            lookback: Duration::from_secs(60),
            include_relations: true,
            ignore_keys: IgnoreKeys::new(["updated_at"]),
            max_delete_fraction: 0.5,
            sink_backoff_initial: Duration::from_millis(200),
            sink_backoff_max: Duration::from_secs(30),
            publish_timeout: Duration::from_secs(120),
            max_pages_floor: crate::config::DEFAULT_MAX_PAGES_FLOOR,
            full_retry_initial: Duration::from_secs(30),
            full_retry_max: Duration::from_secs(3600),
            on_record_error: OnRecordError::default(),
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

/// Everything one stream's sweeps need.
#[derive(Clone)]
pub struct Sweeper {
    /// The stream swept.
    pub stream: StreamKey,
    /// Upstream client (with the token's shared budget).
    pub client: UpstreamClient,
    /// State store.
    pub store: Arc<dyn StateStore>,
    /// Event sink.
    pub sink: Arc<dyn Sink>,
    /// Settings.
    pub settings: Arc<SweepSettings>,
    /// Optional progress callback.
    pub progress: Option<Progress>,
    /// Cancelled on shutdown: the sweep finishes the page in flight (acks
    /// awaited, hashes committed) and requests no further page.
    pub shutdown: CancellationToken,
}

/// The mode a sweep runs in, decided from the stream state.
#[derive(Debug, Clone)]
struct Plan {
    mode: SweepMode,
    full: bool,
    updated_since: Option<DateTime<Utc>>,
    replay_id: Option<String>,
    /// `replay_id` as the 16 bytes intents store.
    replay: Option<[u8; 16]>,
    epoch: u64,
}

impl Sweeper {
    /// Runs one sweep; records its outcome in the stream state either way.
    pub async fn run(&self, kind: SweepKind) -> Result<SweepReport, SweepError> {
        let started = Utc::now();
        let mut state = self.store.load_stream(self.stream)?;
        state.last_sweep_started = Some(started);
        let plan = self.plan(&state, kind);
        if plan.full || plan.replay_id.is_some() {
            state.full_sweep_epoch = state.full_sweep_epoch.max(plan.epoch);
        }
        if let Some(replay) = state.replay.as_mut().filter(|r| r.pending) {
            replay.epoch.get_or_insert(plan.epoch);
        }
        self.store.save_stream(self.stream, &state)?;
        let label = if plan.replay_id.is_some() {
            "replay"
        } else if plan.full {
            "full"
        } else {
            "incremental"
        };
        debug!(tenant = self.stream.tenant, resource = %self.stream.resource, kind = label, "sweep started");

        let mut report = SweepReport {
            kind: label,
            ..SweepReport::default()
        };
        let swept = self.sweep(&plan, &mut state, &mut report).await;
        let result = swept.map(|()| report.clone());
        let outcome = match &result {
            Ok(_) => "ok",
            Err(SweepError::Interrupted) => "interrupted",
            Err(_) => "error",
        };
        metrics::counter!(metric::SWEEPS, "tenant" => self.stream.tenant.to_string(),
            "resource" => self.stream.resource.as_str(), "kind" => label, "outcome" => outcome)
        .increment(1);

        // Reload: the sweep may have saved replay progress.
        let mut state = self.store.load_stream(self.stream)?;
        match &result {
            Ok(report) => {
                state.watermark = report.watermark;
                state.last_sweep_finished = Some(Utc::now());
                if plan.full {
                    state.last_full_sweep_finished = state.last_sweep_finished;
                }
                // A failing full sweep stays visible (status, stream_failing,
                // status exit code) until a full sweep succeeds, even while
                // incremental sweeps succeed in between.
                if plan.full || state.full_sweep_failures == 0 {
                    state.last_error = None;
                    state.last_error_at = None;
                }
                state.parked = None;
                state.records_known = report.records_known;
                if plan.full {
                    state.full_sweep_failures = 0;
                    state.full_sweep_retry_at = None;
                }
                info!(tenant = self.stream.tenant, resource = %self.stream.resource, kind = label,
                    pages = report.pages, records = report.records_seen, events = report.events(),
                    deleted = report.deleted, "sweep finished");
            }
            Err(SweepError::Interrupted) => {
                info!(tenant = self.stream.tenant, resource = %self.stream.resource, kind = label,
                    "sweep stopped early (shutdown or replay); the next run resumes from the same watermark");
            }
            Err(e) => {
                state.last_error = Some(e.to_string());
                state.last_error_at = Some(Utc::now());
                if plan.full && plan.replay_id.is_none() && state.watermark.is_some() {
                    // Incremental sweeps go on; the full listing waits its backoff.
                    state.full_sweep_failures = state.full_sweep_failures.saturating_add(1);
                    let wait = full_retry_delay(
                        state.full_sweep_failures,
                        self.settings.full_retry_initial,
                        self.settings.full_retry_max,
                    );
                    state.full_sweep_retry_at = chrono::Duration::from_std(wait)
                        .ok()
                        .and_then(|w| Utc::now().checked_add_signed(w));
                }
                warn!(tenant = self.stream.tenant, resource = %self.stream.resource, kind = label,
                    error = %e, "sweep failed");
            }
        }
        if result.is_err() {
            // A stopped replay resumes later and skips what it emitted: keep its count.
            if let Some(replay) = state
                .replay
                .as_mut()
                .filter(|r| r.pending && Some(&r.id) == plan.replay_id.as_ref())
            {
                replay.records = replay.records.saturating_add(report.snapshots);
            }
        }
        self.store.save_stream(self.stream, &state)?;
        self.store.flush()?;
        if let Err(e) = self.sink.flush().await {
            warn!(sink = self.sink.name(), error = %e, "sink flush failed");
        }
        result
    }

    fn plan(&self, state: &StreamState, kind: SweepKind) -> Plan {
        if let Some(replay) = state.replay.as_ref().filter(|r| r.pending) {
            return Plan {
                mode: SweepMode::Replay,
                full: replay.since.is_none(),
                updated_since: replay.since,
                replay_id: Some(replay.id.clone()),
                replay: crate::state::replay_id_bytes(&replay.id),
                // Fixed when the replay first ran, so a resumed replay knows what it emitted.
                epoch: replay
                    .epoch
                    .unwrap_or_else(|| state.full_sweep_epoch.saturating_add(1)),
            };
        }
        let Some(watermark) = state.watermark else {
            // First sync: a complete listing, emitted as snapshots.
            return Plan {
                mode: SweepMode::FirstSync,
                full: true,
                updated_since: None,
                replay_id: None,
                replay: None,
                epoch: state.full_sweep_epoch + 1,
            };
        };
        match kind {
            SweepKind::Full => Plan {
                mode: SweepMode::Normal,
                full: true,
                updated_since: None,
                replay_id: None,
                replay: None,
                epoch: state.full_sweep_epoch + 1,
            },
            SweepKind::Incremental => {
                let lookback = chrono::Duration::from_std(self.settings.lookback)
                    .unwrap_or_else(|_| chrono::Duration::zero());
                Plan {
                    mode: SweepMode::Normal,
                    full: false,
                    updated_since: watermark.checked_sub_signed(lookback),
                    replay_id: None,
                    replay: None,
                    epoch: state.full_sweep_epoch,
                }
            }
        }
    }

    /// The sweep proper; `report` holds what it did so far, also when it fails.
    async fn sweep(
        &self,
        plan: &Plan,
        state: &mut StreamState,
        report: &mut SweepReport,
    ) -> Result<(), SweepError> {
        let known_before = self.store.record_count(self.stream)?;
        if let Some(replay_id) = &plan.replay_id {
            self.publish_replay_frame(state, replay_id, false, 0)
                .await?;
        }

        let query = ListQuery {
            updated_since: plan.updated_since,
            cursor: None,
            include_relations: self.settings.include_relations,
        };
        let max_pages = page_limit(known_before, self.settings.max_pages_floor);
        let pages = self.client.list_pages_bounded(
            self.stream.tenant,
            self.stream.resource,
            query,
            max_pages,
        );
        futures::pin_mut!(pages);
        let mut first_server_time = None;
        while let Some(page) = pages.next().await {
            let page = page?;
            first_server_time.get_or_insert(page.server_time);
            report.pages += 1;
            report.records_seen += page.records.len() as u64;
            self.count_page(&page);
            self.process_page(plan, &page.records, report).await?;
            if let Some(progress) = &self.progress {
                progress(self.stream, report.records_seen, report.pages);
            }
            if page.next_cursor.is_some() && self.shutdown.is_cancelled() {
                return Err(SweepError::Interrupted);
            }
        }

        if plan.full {
            self.delete_unseen(plan, known_before, report).await?;
        }

        if let Some(replay_id) = &plan.replay_id {
            // Snapshots of earlier, interrupted runs of this replay count too.
            let earlier = state
                .replay
                .as_ref()
                .filter(|r| &r.id == replay_id)
                .map_or(0, |r| r.records);
            let total = earlier.saturating_add(report.snapshots);
            self.publish_replay_frame(state, replay_id, true, total)
                .await?;
            let mut fresh = self.store.load_stream(self.stream)?;
            if let Some(replay) = fresh.replay.as_mut().filter(|r| &r.id == replay_id) {
                replay.pending = false;
                replay.records = total;
            }
            self.store.save_stream(self.stream, &fresh)?;
            *state = fresh;
        }

        report.watermark = first_server_time;
        report.records_known = self.store.record_count(self.stream)?;
        Ok(())
    }

    fn count_page(&self, page: &Page) {
        let tenant = self.stream.tenant.to_string();
        let resource = self.stream.resource.as_str();
        metrics::counter!(metric::PAGES, "tenant" => tenant.clone(), "resource" => resource)
            .increment(1);
        metrics::counter!(metric::RECORDS_SEEN, "tenant" => tenant, "resource" => resource)
            .increment(page.records.len() as u64);
    }

    /// Publishes `replay.started` (or, with `completed`, `replay.completed`)
    /// and waits for its ack.
    async fn publish_replay_frame(
        &self,
        state: &StreamState,
        replay_id: &str,
        completed: bool,
        records: u64,
    ) -> Result<(), SweepError> {
        let since = state
            .replay
            .as_ref()
            .and_then(|r| r.since)
            .map(event::format_time);
        let frame = event::replay_event(
            self.stream,
            replay_id,
            since.as_deref(),
            completed,
            records,
            Utc::now(),
        );
        self.publish_all(std::slice::from_ref(&frame)).await?;
        self.count_event(&frame);
        Ok(())
    }

    /// Diffs one page, publishes its changes, and commits them after the acks.
    async fn process_page(
        &self,
        plan: &Plan,
        records: &[Record],
        report: &mut SweepReport,
    ) -> Result<(), SweepError> {
        if records.is_empty() {
            return Ok(());
        }
        // A record listed twice in one page counts once, as its last version.
        let mut last_index: HashMap<i64, usize> = HashMap::with_capacity(records.len());
        for (i, r) in records.iter().enumerate() {
            last_index.insert(r.id, i);
        }
        let records: Vec<&Record> = records
            .iter()
            .enumerate()
            .filter(|(i, r)| last_index.get(&r.id) == Some(i))
            .map(|(_, r)| r)
            .collect();

        let ids: Vec<i64> = records.iter().map(|r| r.id).collect();
        let committed = self.store.get_records(self.stream, &ids)?;
        let unknown_ids: Vec<i64> = ids
            .iter()
            .zip(&committed)
            .filter(|(_, k)| k.is_none())
            .map(|(id, _)| *id)
            .collect();
        let tombstones: HashMap<i64, Tombstone> = if unknown_ids.is_empty() {
            HashMap::new()
        } else {
            unknown_ids
                .iter()
                .copied()
                .zip(self.store.get_tombstones(self.stream, &unknown_ids)?)
                .filter_map(|(id, t)| t.map(|t| (id, t)))
                .collect()
        };
        // What downstream may have seen beyond the committed hashes.
        let intents: HashMap<i64, Intent> = self
            .store
            .pending_intents(self.stream)?
            .into_iter()
            .filter(|(id, _)| last_index.contains_key(id))
            .collect();

        let detected_at = Utc::now();
        let mut dead_letters: Vec<(i64, DeadLetter)> = Vec::new();
        let mut pending: Vec<PendingChange> = Vec::new();
        let mut seen_unchanged: Vec<i64> = Vec::new();
        for (record, committed) in records.iter().zip(&committed) {
            let hash =
                content_hash(record.raw.get(), &self.settings.ignore_keys).map_err(|source| {
                    SweepError::Hash {
                        record_id: record.id,
                        source,
                    }
                })?;
            let known = Known {
                committed: *committed,
                intent: intents.get(&record.id).copied(),
                tombstone: tombstones.get(&record.id).copied(),
            };
            match plan_change(&known, hash, plan.mode, plan.replay, plan.epoch) {
                None => seen_unchanged.push(record.id),
                Some(change) => pending.push(PendingChange {
                    record,
                    hash,
                    change,
                    updated_at_micros: parse_micros(record.updated_at.as_deref()),
                }),
            }
        }

        if !pending.is_empty() {
            let intents: Vec<(i64, Intent)> =
                pending.iter().map(|c| (c.record.id, c.intent())).collect();
            // Durable before the first event of the page reaches the sink.
            self.store.write_intents(self.stream, &intents)?;
            crashpoint::hit(crashpoint::names::AFTER_INTENTS);

            let events: Vec<Event> = pending
                .iter()
                .map(|c| c.event(self.stream, detected_at))
                .collect();
            let marks = self.publish_changes(&events).await?;
            crashpoint::hit(crashpoint::names::AFTER_PUBLISH);
            for ((c, e), mark) in pending.iter().zip(&events).zip(&marks) {
                if mark.is_some() {
                    report.dead_lettered += 1;
                } else {
                    report.count(c.change.op);
                    self.count_event(e);
                }
            }
            dead_letters = pending
                .iter()
                .zip(marks)
                .filter_map(|(c, mark)| mark.map(|m| (c.record.id, m)))
                .collect();
        }

        // Every event of the page is acknowledged: now, and only now, commit.
        let commits: Vec<(i64, RecordState)> = pending
            .iter()
            .map(|c| {
                (
                    c.record.id,
                    RecordState {
                        hash: c.hash,
                        updated_at: c.updated_at_micros,
                        seen_epoch: plan.epoch,
                        generation: c.change.generation,
                        seq: c.change.seq,
                    },
                )
            })
            .collect();
        let seen: &[i64] = if plan.full { &seen_unchanged } else { &[] };
        // A dead-lettered record commits too (its dead letter was acknowledged), marked.
        self.store.commit_page_with_dead_letters(
            self.stream,
            &commits,
            seen,
            plan.epoch,
            &dead_letters,
        )?;
        if !pending.is_empty() {
            crashpoint::hit(crashpoint::names::AFTER_COMMIT);
        }
        Ok(())
    }

    /// After a complete full listing: emits `*.deleted` for every record (and
    /// every possibly-published intent) the listing did not contain, each
    /// confirmed gone by the single-record GET first.
    async fn delete_unseen(
        &self,
        plan: &Plan,
        known_before: u64,
        report: &mut SweepReport,
    ) -> Result<(), SweepError> {
        let unseen = self.store.unseen_records(self.stream, plan.epoch)?;
        let intents: HashMap<i64, Intent> = self
            .store
            .pending_intents(self.stream)?
            .into_iter()
            .collect();

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
            let stored = self.store.get_records(self.stream, &orphans)?;
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
        let limit = self.settings.max_delete_fraction * (known_before.max(1) as f64);
        if plan.mode == SweepMode::Normal && (committed_unseen as f64) > limit {
            metrics::counter!(metric::DELETES_REFUSED, "tenant" => self.stream.tenant.to_string(),
                "resource" => self.stream.resource.as_str())
            .increment(1);
            return Err(SweepError::DeleteGuard {
                would_delete: committed_unseen,
                known: known_before,
                max_fraction: self.settings.max_delete_fraction,
            });
        }

        doomed.sort_by_key(|d| d.id);
        for chunk in doomed.chunks(DELETE_CHUNK) {
            let (gone, found) = self.confirm_gone(chunk).await?;
            if !found.is_empty() {
                // The listing skipped them: they are seen, and processed like a page.
                metrics::counter!(metric::DELETES_RESCINDED, "tenant" => self.stream.tenant.to_string(),
                    "resource" => self.stream.resource.as_str())
                .increment(found.len() as u64);
                info!(tenant = self.stream.tenant, resource = %self.stream.resource,
                    records = found.len(),
                    "records missing from the full listing still exist upstream; not deleted");
                self.process_page(plan, &found, report).await?;
            }
            if gone.is_empty() {
                continue;
            }
            let detected_at = Utc::now();
            let intents: Vec<(i64, Intent)> = gone.iter().map(|d| (d.id, d.intent())).collect();
            self.store.write_intents(self.stream, &intents)?;
            crashpoint::hit(crashpoint::names::AFTER_DELETE_INTENTS);
            let events: Vec<Event> = gone
                .iter()
                .map(|d| d.event(self.stream, detected_at, &self.settings.ignore_keys))
                .collect::<Result<_, _>>()?;
            let marks = self.publish_changes(&events).await?;
            crashpoint::hit(crashpoint::names::AFTER_DELETE_PUBLISH);
            for (e, mark) in events.iter().zip(&marks) {
                if mark.is_some() {
                    report.dead_lettered += 1;
                } else {
                    report.count(Op::Delete);
                    self.count_event(e);
                }
            }
            let tombstones: Vec<(i64, Tombstone)> = gone.iter().map(|d| d.tombstone()).collect();
            self.store.commit_deletes(self.stream, &tombstones)?;
            crashpoint::hit(crashpoint::names::AFTER_DELETE_COMMIT);
        }
        Ok(())
    }

    /// Asks the single-record GET about each record: 404 means gone; a record
    /// that answers is returned to be processed as listed.
    async fn confirm_gone<'d>(
        &self,
        doomed: &'d [Doomed],
    ) -> Result<(Vec<&'d Doomed>, Vec<Record>), SweepError> {
        let mut gone = Vec::with_capacity(doomed.len());
        let mut found = Vec::new();
        for d in doomed {
            let answer = match self.stream.resource {
                Resource::Vouchers => self.client.get_voucher(self.stream.tenant, d.id).await,
                Resource::Categories => self.client.get_category(self.stream.tenant, d.id).await,
            };
            match answer {
                Ok(record) if record.id == d.id => found.push(record),
                Ok(record) => {
                    warn!(tenant = self.stream.tenant, resource = %self.stream.resource,
                        asked = d.id, answered = record.id,
                        "the single-record GET answered with another id; the record is not deleted");
                }
                Err(e) if e.status() == Some(404) => gone.push(d),
                Err(e) => return Err(e.into()),
            }
        }
        Ok((gone, found))
    }

    /// Records a sink that keeps failing retriably as the stream's last error.
    fn record_sink_stall(&self, failed: usize, attempts: u32, error: Option<&str>) {
        metrics::counter!(metric::SINK_STALLS, "tenant" => self.stream.tenant.to_string(),
            "resource" => self.stream.resource.as_str(), "sink" => self.sink.name().to_string())
        .increment(1);
        let message = format!(
            "sink {} has not acknowledged {failed} event(s) after {attempts} attempts: {}; \
             still retrying, nothing committed meanwhile",
            self.sink.name(),
            error.unwrap_or("no error given")
        );
        let saved = self.store.load_stream(self.stream).and_then(|mut state| {
            state.last_error = Some(message);
            state.last_error_at = Some(Utc::now());
            self.store.save_stream(self.stream, &state)
        });
        if let Err(e) = saved {
            warn!(tenant = self.stream.tenant, resource = %self.stream.resource, error = %e,
                "cannot record the sink failure on the stream");
        }
    }

    fn count_event(&self, e: &Event) {
        metrics::counter!(metric::EVENTS_PUBLISHED,
            "tenant" => self.stream.tenant.to_string(),
            "resource" => self.stream.resource.as_str(),
            "type" => e.ty.as_str(),
            "op" => e.op.map_or("none", Op::as_str))
        .increment(1);
    }

    /// Publishes until every event is acknowledged. Retriable failures are
    /// retried (only the failed events) with capped exponential backoff; a
    /// fatal or rejected one fails the sweep. Nothing is committed in here.
    async fn publish_all(&self, events: &[Event]) -> Result<(), SweepError> {
        self.publish_acks(events, false).await.map(drop)
    }

    /// Publishes a page's record events. Under `sink.on_record_error =
    /// "dead_letter"` an event the sink can never accept is replaced by its
    /// dead letter, which must be acknowledged like any event; returns, per
    /// event, the dead-letter mark its record commits with (None: acknowledged).
    async fn publish_changes(
        &self,
        events: &[Event],
    ) -> Result<Vec<Option<DeadLetter>>, SweepError> {
        let tolerate = self.settings.on_record_error == OnRecordError::DeadLetter;
        let refused = self.publish_acks(events, tolerate).await?;
        let mut marks: Vec<Option<DeadLetter>> = vec![None; events.len()];
        let mut letters = Vec::new();
        let mut refusals = Vec::new();
        for (index, refusal) in refused.into_iter().enumerate() {
            let (Some(error), Some(event)) = (refusal, events.get(index)) else {
                continue;
            };
            let label = error.reason_label();
            if let SinkError::Rejected { reason, limit } = error {
                letters.push(event::dead_letter_event(event, &reason, limit)?);
                refusals.push((index, reason, limit, label));
            }
        }
        if letters.is_empty() {
            return Ok(marks);
        }
        // A dead letter the sink refuses too fails the sweep: nothing is committed.
        self.publish_all(&letters).await?;
        let since = Utc::now();
        for (index, reason, limit, label) in refusals {
            if let Some(event) = events.get(index) {
                warn!(tenant = self.stream.tenant, resource = %self.stream.resource,
                    sink = self.sink.name(), event_id = %event.id, error = %reason,
                    "sink refused the event for good; published a dead letter instead and moving on");
            }
            metrics::counter!(metric::DEAD_LETTERS, "tenant" => self.stream.tenant.to_string(),
                "resource" => self.stream.resource.as_str(), "reason" => label)
            .increment(1);
            marks[index] = Some(DeadLetter {
                since,
                reason,
                limit,
            });
        }
        Ok(marks)
    }

    /// Publishes until every event is acknowledged or, with `tolerate_refusals`,
    /// refused for good; returns per event the refusal (None: acknowledged).
    /// Retriable failures are retried (only the failed events) with capped
    /// exponential backoff; a fatal one, and a refusal unless tolerated, fails
    /// the sweep. Nothing is committed in here.
    async fn publish_acks(
        &self,
        events: &[Event],
        tolerate_refusals: bool,
    ) -> Result<Vec<Option<SinkError>>, SweepError> {
        let mut refused: Vec<Option<SinkError>> = vec![None; events.len()];
        let mut outstanding: Vec<usize> = (0..events.len()).collect();
        let mut backoff = self.settings.sink_backoff_initial;
        let mut attempt: u32 = 0;
        while !outstanding.is_empty() {
            let batch: Vec<Event> = outstanding
                .iter()
                .filter_map(|&i| events.get(i).cloned())
                .collect();
            let started = Instant::now();
            let acks = match tokio::time::timeout(
                self.settings.publish_timeout,
                self.sink.publish(&batch),
            )
            .await
            {
                Ok(acks) => acks,
                Err(_) => vec![
                    Err(SinkError::Retriable(format!(
                        "no acknowledgement within {}",
                        crate::telemetry::human_duration(self.settings.publish_timeout)
                    )));
                    batch.len()
                ],
            };
            crate::sinks::metrics::record_publish(self.sink.name(), started.elapsed(), &acks);
            let mut retry = Vec::new();
            let mut last_error = None;
            for (i, (&index, event)) in outstanding.iter().zip(&batch).enumerate() {
                match acks.get(i) {
                    Some(Ok(())) => {}
                    Some(Err(e @ SinkError::Rejected { .. })) if tolerate_refusals => {
                        refused[index] = Some(e.clone());
                    }
                    Some(Err(e @ (SinkError::Fatal(_) | SinkError::Rejected { .. }))) => {
                        return Err(SweepError::SinkRejected {
                            sink: self.sink.name().to_string(),
                            event_id: event.id.clone(),
                            message: e.to_string(),
                        });
                    }
                    Some(Err(e @ SinkError::Retriable(_))) => {
                        last_error = Some(e.to_string());
                        retry.push(index);
                    }
                    None => {
                        last_error = Some("sink returned fewer acks than events".to_string());
                        retry.push(index);
                    }
                }
            }
            if retry.is_empty() {
                return Ok(refused);
            }
            attempt += 1;
            warn!(tenant = self.stream.tenant, resource = %self.stream.resource,
                sink = self.sink.name(), failed = retry.len(), attempt,
                error = last_error.as_deref().unwrap_or(""),
                "sink did not acknowledge every event; retrying without committing");
            if attempt == SINK_ATTEMPTS_BEFORE_RECORDING {
                // Still retrying, but visible: status, /readyz reasons, metrics.
                self.record_sink_stall(retry.len(), attempt, last_error.as_deref());
            }
            let jitter = rand::random::<f64>() * 0.2 + 0.9;
            tokio::select! {
                _ = tokio::time::sleep(backoff.mul_f64(jitter)) => {}
                // Nothing of this batch is committed: stopping here loses nothing.
                _ = self.shutdown.cancelled() => return Err(SweepError::Interrupted),
            }
            backoff = (backoff * 2).min(self.settings.sink_backoff_max);
            outstanding = retry;
        }
        Ok(refused)
    }
}

/// Retriable sink failures of one batch after which the stream shows the error
/// (the sweep keeps retrying).
const SINK_ATTEMPTS_BEFORE_RECORDING: u32 = 5;

/// Deletes confirmed, published and committed together (one GET each first).
const DELETE_CHUNK: usize = 50;

/// A listed record whose change the page publishes.
struct PendingChange<'a> {
    record: &'a Record,
    hash: ContentHash,
    change: Change,
    updated_at_micros: Option<i64>,
}

impl PendingChange<'_> {
    /// The journal entry: every input of the event id, so a re-publish keeps it.
    fn intent(&self) -> Intent {
        Intent {
            hash: self.hash,
            updated_at: self.updated_at_micros,
            generation: self.change.generation,
            seq: self.change.seq,
            op: Some(self.change.op),
            previous: self.change.previous,
            replay: self.change.replay,
        }
    }

    fn event(&self, stream: StreamKey, detected_at: DateTime<Utc>) -> Event {
        let replay_id = self.change.replay.map(hex::encode);
        event::record_event(&RecordChange {
            stream,
            record_id: &self.record.id.to_string(),
            generation: self.change.generation,
            seq: self.change.seq,
            op: self.change.op,
            updated_at: self.record.updated_at.as_deref(),
            content_hash: &self.hash.to_hex(),
            previous_hash: self.change.previous.map(|p| p.to_hex()).as_deref(),
            replay_id: replay_id.as_deref(),
            data: &self.record.raw,
            detected_at,
        })
    }
}

/// A record a full sweep will delete, with the last version possibly published.
#[derive(Debug, Clone, Copy)]
struct Doomed {
    id: i64,
    generation: u32,
    last_hash: ContentHash,
    updated_at: Option<i64>,
    seq: u64,
    replay: Option<[u8; 16]>,
}

impl Doomed {
    /// The delete of a record that is `committed` (or only journalled), given
    /// its pending intent: a journalled delete is re-published exactly; an
    /// upsert intent is the last version downstream may have seen.
    fn new(
        id: i64,
        committed: Option<&RecordState>,
        intent: Option<&Intent>,
        replay: Option<[u8; 16]>,
    ) -> Self {
        let committed_seq = committed.map_or(0, |r| r.seq);
        match (intent, committed) {
            (Some(i), _) if i.is_delete() => Self {
                id,
                generation: i.generation,
                last_hash: i.hash,
                updated_at: i.updated_at,
                seq: i.seq,
                replay: i.replay,
            },
            (Some(i), _) => Self {
                id,
                generation: i.generation,
                last_hash: i.hash,
                updated_at: i.updated_at,
                seq: i.seq.max(committed_seq).saturating_add(1),
                replay,
            },
            (None, Some(r)) => Self {
                id,
                generation: r.generation,
                last_hash: r.hash,
                updated_at: r.updated_at,
                seq: r.seq.saturating_add(1),
                replay,
            },
            // Not reachable: a doomed record is committed or journalled.
            (None, None) => Self {
                id,
                generation: 0,
                last_hash: ContentHash([0; 16]),
                updated_at: None,
                seq: 1,
                replay,
            },
        }
    }

    /// The journal entry of the delete (its `hash` is the last version's).
    fn intent(&self) -> Intent {
        Intent {
            hash: self.last_hash,
            updated_at: self.updated_at,
            generation: self.generation,
            seq: self.seq,
            op: Some(Op::Delete),
            previous: None,
            replay: self.replay,
        }
    }

    /// The `*.deleted` event: `data` is `{"id":N}`, `previoushash` the last hash.
    fn event(
        &self,
        stream: StreamKey,
        detected_at: DateTime<Utc>,
        ignore: &IgnoreKeys,
    ) -> Result<Event, SweepError> {
        let data = delete_data(self.id);
        let hash = content_hash(data.get(), ignore).map_err(|source| SweepError::Hash {
            record_id: self.id,
            source,
        })?;
        let updated_at = self.updated_at.and_then(format_micros);
        let replay_id = self.replay.map(hex::encode);
        Ok(event::record_event(&RecordChange {
            stream,
            record_id: &self.id.to_string(),
            generation: self.generation,
            seq: self.seq,
            op: Op::Delete,
            updated_at: updated_at.as_deref(),
            content_hash: &hash.to_hex(),
            previous_hash: Some(&self.last_hash.to_hex()),
            replay_id: replay_id.as_deref(),
            data: &data,
            detected_at,
        }))
    }

    /// The tombstone: the next incarnation of this id starts a new generation.
    fn tombstone(&self) -> (i64, Tombstone) {
        (
            self.id,
            Tombstone {
                generation: self.generation.saturating_add(1),
                last_hash: self.last_hash,
                updated_at: self.updated_at,
            },
        )
    }
}

/// The wait before the `failures`-th failed full sweep is tried again:
/// `initial` doubled per failure, at most `max`.
pub fn full_retry_delay(failures: u32, initial: Duration, max: Duration) -> Duration {
    let doublings = failures.saturating_sub(1).min(20);
    initial
        .saturating_mul(1 << doublings)
        .min(max)
        .max(initial.min(max))
}

/// The `data` of a delete event: just the record id.
fn delete_data(id: i64) -> Box<RawValue> {
    RawValue::from_string(format!("{{\"id\":{id}}}")).unwrap_or_else(|_| RawValue::NULL.to_owned())
}

/// Parses an API timestamp into unix microseconds (None when absent or unreadable).
pub fn parse_micros(updated_at: Option<&str>) -> Option<i64> {
    updated_at
        .and_then(|s| DateTime::parse_from_rfc3339(s).ok())
        .map(|t| t.with_timezone(&Utc).timestamp_micros())
}

/// Formats unix microseconds the way events carry times.
pub fn format_micros(micros: i64) -> Option<String> {
    DateTime::<Utc>::from_timestamp_micros(micros).map(event::format_time)
}

/// Schedules a replay of one stream: a new replay id, the watermark cleared
/// (or set to `since`). The stream's next sweep emits every record it lists
/// as `op: snapshot`; other streams are untouched. Returns the replay id.
pub fn schedule_replay(
    store: &dyn StateStore,
    stream: StreamKey,
    since: Option<DateTime<Utc>>,
) -> Result<String, StateError> {
    let mut state = store.load_stream(stream)?;
    let id = new_replay_id();
    state.replay = Some(crate::state::ReplayState {
        id: id.clone(),
        since,
        requested_at: Utc::now(),
        pending: true,
        records: 0,
        epoch: None,
    });
    state.watermark = since;
    store.save_stream(stream, &state)?;
    store.flush()?;
    info!(tenant = stream.tenant, resource = %stream.resource, replay_id = %id, "replay scheduled");
    Ok(id)
}

fn new_replay_id() -> String {
    let bytes: [u8; 16] = rand::random();
    hex::encode(bytes)
}
