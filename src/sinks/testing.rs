//! An in-memory sink with switchable faults, for tests of everything that
//! publishes (the sweep, the scheduler, the admin API).
//!
//! It is a normal public module so integration tests in `tests/` can use it.
//! `TestSink` is a cheap clonable handle: a test keeps one clone to inspect
//! what was acknowledged and to change the fault mode at runtime, while the
//! code under test owns another.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{TimeZone, Utc};
use serde_json::value::RawValue;

use super::{Ack, Sink, SinkError};
use crate::event::{record_event, Event, Op, RecordChange};
use crate::hash::ContentHash;
use crate::stream::StreamKey;

/// Which events a [`FaultMode::Reject`] refuses.
#[derive(Clone)]
pub enum RejectTarget {
    /// Every event with this id, on every attempt (a poison message).
    EventId(String),
    /// The n-th event (0-based) offered after the mode was set, once.
    Index(usize),
    /// Every event the predicate accepts.
    Matching(Arc<dyn Fn(&Event) -> bool + Send + Sync>),
}

impl std::fmt::Debug for RejectTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RejectTarget::EventId(id) => f.debug_tuple("EventId").field(id).finish(),
            RejectTarget::Index(n) => f.debug_tuple("Index").field(n).finish(),
            RejectTarget::Matching(_) => f.write_str("Matching(..)"),
        }
    }
}

/// How the test sink behaves from now on.
#[derive(Debug, Clone, Default)]
pub enum FaultMode {
    /// Acknowledge every event.
    #[default]
    Normal,
    /// Acknowledge the next `n` events, then fail every later one as retriable.
    FailAfter(usize),
    /// `publish` never returns (the caller is expected to time out and drop it).
    NeverAck,
    /// Wait this long, then acknowledge every event.
    SlowAck(Duration),
    /// Fail the targeted events with `error`; acknowledge the others.
    Reject {
        /// Which events to refuse.
        target: RejectTarget,
        /// The error they get (`Retriable` or `Fatal`).
        error: SinkError,
    },
    /// Every publish fails as retriable and `health` fails.
    Down,
    /// `publish` panics (a bug in a sink or the sweep): the caller must survive it.
    Panic,
}

impl FaultMode {
    /// Rejects every event with this id as fatal.
    pub fn reject_id_fatal(id: impl Into<String>) -> FaultMode {
        FaultMode::Reject {
            target: RejectTarget::EventId(id.into()),
            error: SinkError::Fatal("test sink: event rejected".into()),
        }
    }

    /// Rejects the n-th offered event (0-based) once, as retriable.
    pub fn reject_index_retriable(index: usize) -> FaultMode {
        FaultMode::Reject {
            target: RejectTarget::Index(index),
            error: SinkError::Retriable("test sink: event rejected".into()),
        }
    }
}

#[derive(Debug, Default)]
struct State {
    mode: FaultMode,
    /// Acks left before `FailAfter` starts failing.
    budget: usize,
    /// Events offered since the mode was set (for `RejectTarget::Index`).
    offered_since_mode: usize,
    /// Every acknowledged event, in order.
    acked: Vec<Event>,
}

#[derive(Debug, Default)]
struct Inner {
    state: Mutex<State>,
    publish_calls: AtomicUsize,
    offered: AtomicUsize,
    flush_calls: AtomicUsize,
}

/// In-memory sink that records acknowledged events and injects faults.
#[derive(Debug, Clone, Default)]
pub struct TestSink {
    inner: Arc<Inner>,
}

impl TestSink {
    /// A sink in `FaultMode::Normal`.
    pub fn new() -> TestSink {
        TestSink::default()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A test that panicked while holding the lock already failed.
        self.inner
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Switches the fault mode; counters of the previous mode reset.
    pub fn set_mode(&self, mode: FaultMode) {
        let mut state = self.state();
        state.budget = match mode {
            FaultMode::FailAfter(n) => n,
            _ => 0,
        };
        state.offered_since_mode = 0;
        state.mode = mode;
    }

    /// The current fault mode.
    pub fn mode(&self) -> FaultMode {
        self.state().mode.clone()
    }

    /// Every acknowledged event so far, in order.
    pub fn events(&self) -> Vec<Event> {
        self.state().acked.clone()
    }

    /// Removes and returns the acknowledged events.
    pub fn take(&self) -> Vec<Event> {
        std::mem::take(&mut self.state().acked)
    }

    /// How many times `publish` was called (including calls that never returned).
    pub fn publish_calls(&self) -> usize {
        self.inner.publish_calls.load(Ordering::SeqCst)
    }

    /// How many events were offered to `publish` in total, acknowledged or not.
    pub fn offered(&self) -> usize {
        self.inner.offered.load(Ordering::SeqCst)
    }

    /// How many times `flush` was called.
    pub fn flush_calls(&self) -> usize {
        self.inner.flush_calls.load(Ordering::SeqCst)
    }

    /// Decides every event of a batch under the current mode and records the acks.
    fn settle(&self, events: &[Event]) -> Vec<Ack> {
        let mut state = self.state();
        let mut acks = Vec::with_capacity(events.len());
        for event in events {
            let index = state.offered_since_mode;
            state.offered_since_mode += 1;
            let outcome = match &state.mode {
                FaultMode::Down => Err(SinkError::Retriable("test sink is down".into())),
                // Switched to while this batch was in flight: never an ack.
                FaultMode::Panic => Err(SinkError::Retriable("test sink: panic mode".into())),
                FaultMode::FailAfter(n) if state.budget == 0 => Err(SinkError::Retriable(format!(
                    "test sink: failing after {n} acknowledged events"
                ))),
                FaultMode::FailAfter(_) => {
                    state.budget -= 1;
                    Ok(())
                }
                FaultMode::Reject { target, error } => {
                    let hit = match target {
                        RejectTarget::EventId(id) => *id == event.id,
                        RejectTarget::Index(n) => *n == index,
                        RejectTarget::Matching(predicate) => predicate(event),
                    };
                    if hit {
                        Err(error.clone())
                    } else {
                        Ok(())
                    }
                }
                FaultMode::Normal | FaultMode::NeverAck | FaultMode::SlowAck(_) => Ok(()),
            };
            if outcome.is_ok() {
                state.acked.push(event.clone());
            }
            acks.push(outcome);
        }
        acks
    }
}

#[async_trait]
impl Sink for TestSink {
    fn name(&self) -> &str {
        "test"
    }

    async fn publish(&self, events: &[Event]) -> Vec<Ack> {
        self.inner.publish_calls.fetch_add(1, Ordering::SeqCst);
        self.inner.offered.fetch_add(events.len(), Ordering::SeqCst);
        let mode = self.mode();
        match mode {
            FaultMode::NeverAck => std::future::pending::<()>().await,
            FaultMode::SlowAck(delay) => tokio::time::sleep(delay).await,
            FaultMode::Panic => panic!("test sink: injected panic in publish"),
            _ => {}
        }
        self.settle(events)
    }

    async fn health(&self) -> Result<(), SinkError> {
        match self.mode() {
            FaultMode::Down => Err(SinkError::Retriable("test sink is down".into())),
            _ => Ok(()),
        }
    }

    async fn flush(&self) -> Result<(), SinkError> {
        self.inner.flush_calls.fetch_add(1, Ordering::SeqCst);
        match self.mode() {
            FaultMode::Down => Err(SinkError::Retriable("test sink is down".into())),
            _ => Ok(()),
        }
    }
}

/// A realistic `voucher.updated` event for record `id` of `stream` (tests of sinks).
pub fn sample_event(stream: StreamKey, id: i64) -> Event {
    let data =
        format!(r#"{{"id":{id},"slug":"voucher-{id}","title":"Voucher {id}","price":25.0}}"#);
    // The text above is valid JSON for every i64; fall back to `null` regardless.
    let data = RawValue::from_string(data).unwrap_or_else(|_| RawValue::NULL.to_owned());
    let mut hash = [0u8; 16];
    hash.copy_from_slice(&blake3::hash(data.get().as_bytes()).as_bytes()[..16]);
    record_event(&RecordChange {
        stream,
        record_id: id,
        generation: 0,
        seq: 0,
        op: Op::Create,
        updated_at: Some("2024-05-01T10:00:00Z"),
        content_hash: ContentHash(hash),
        previous_hash: None,
        replay: None,
        data: data.get(),
        detected_at: Utc
            .timestamp_opt(1_714_557_600, 0)
            .single()
            .unwrap_or_default(),
        schema_base: &crate::schema::DEFAULT_SCHEMA_BASE,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::Resource;

    const STREAM: StreamKey = StreamKey {
        tenant: 42,
        resource: Resource::Vouchers,
    };

    fn batch(ids: std::ops::Range<i64>) -> Vec<Event> {
        ids.map(|id| sample_event(STREAM, id)).collect()
    }

    fn ids(events: &[Event]) -> Vec<String> {
        events.iter().map(|e| e.id.clone()).collect()
    }

    #[tokio::test]
    async fn normal_mode_acknowledges_and_records_every_event_for_every_handle() {
        let sink = TestSink::new();
        let handle = sink.clone();
        let events = batch(0..3);
        assert_eq!(sink.publish(&events).await, vec![Ok(()); 3]);
        assert_eq!(ids(&handle.events()), ids(&events));
        assert_eq!(handle.publish_calls(), 1);
        assert_eq!(handle.offered(), 3);
        assert_eq!(ids(&handle.take()), ids(&events));
        assert!(handle.events().is_empty());
        sink.health().await.unwrap();
        sink.flush().await.unwrap();
        assert_eq!(handle.flush_calls(), 1);
    }

    #[tokio::test]
    async fn fail_after_acknowledges_n_events_then_fails_every_later_one() {
        let sink = TestSink::new();
        sink.set_mode(FaultMode::FailAfter(3));
        let acks = sink.publish(&batch(0..2)).await;
        assert_eq!(acks, vec![Ok(()), Ok(())]);
        let acks = sink.publish(&batch(2..5)).await;
        assert!(acks[0].is_ok());
        assert!(acks[1..]
            .iter()
            .all(|a| a.as_ref().unwrap_err().is_retriable()));
        assert!(sink.publish(&batch(5..6)).await[0].is_err());
        assert_eq!(sink.events().len(), 3);
        sink.set_mode(FaultMode::Normal);
        assert!(sink.publish(&batch(6..7)).await[0].is_ok());
    }

    #[tokio::test]
    async fn never_ack_never_returns_and_acknowledges_nothing() {
        let sink = TestSink::new();
        sink.set_mode(FaultMode::NeverAck);
        let events = batch(0..2);
        let outcome = tokio::time::timeout(Duration::from_millis(50), sink.publish(&events)).await;
        assert!(outcome.is_err(), "publish returned in NeverAck mode");
        assert_eq!(sink.publish_calls(), 1);
        assert!(sink.events().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn slow_ack_waits_before_acknowledging() {
        let sink = TestSink::new();
        sink.set_mode(FaultMode::SlowAck(Duration::from_secs(5)));
        let started = tokio::time::Instant::now();
        assert_eq!(sink.publish(&batch(0..1)).await, vec![Ok(())]);
        assert!(started.elapsed() >= Duration::from_secs(5));
        assert_eq!(sink.events().len(), 1);
    }

    #[tokio::test]
    async fn reject_refuses_only_the_targeted_events() {
        let sink = TestSink::new();
        let events = batch(0..4);
        sink.set_mode(FaultMode::reject_id_fatal(events[1].id.clone()));
        let acks = sink.publish(&events).await;
        assert!(acks[0].is_ok() && acks[2].is_ok() && acks[3].is_ok());
        assert_eq!(
            acks[1],
            Err(SinkError::Fatal("test sink: event rejected".into()))
        );
        // A poison event is refused on every attempt.
        assert!(sink.publish(&events[1..2]).await[0].is_err());

        sink.set_mode(FaultMode::reject_index_retriable(2));
        let acks = sink.publish(&events[..3]).await;
        assert!(acks[2].as_ref().unwrap_err().is_retriable());
        // The index counts offered events, so the retry goes through.
        assert!(sink.publish(&events[2..3]).await[0].is_ok());

        sink.set_mode(FaultMode::Reject {
            target: RejectTarget::Matching(Arc::new(|e: &Event| e.partition_key.ends_with(":3"))),
            error: SinkError::Retriable("nope".into()),
        });
        let acks = sink.publish(&events).await;
        assert_eq!(acks.iter().filter(|a| a.is_err()).count(), 1);
        assert!(acks[3].is_err());
    }

    #[tokio::test]
    async fn down_fails_every_publish_and_the_health_check() {
        let sink = TestSink::new();
        sink.set_mode(FaultMode::Down);
        let acks = sink.publish(&batch(0..2)).await;
        assert!(acks.iter().all(|a| a.as_ref().unwrap_err().is_retriable()));
        assert!(sink.health().await.is_err());
        assert!(sink.flush().await.is_err());
        assert!(sink.events().is_empty());
        sink.set_mode(FaultMode::Normal);
        sink.health().await.unwrap();
    }

    #[test]
    fn sample_events_are_valid_cloudevents_with_distinct_ids() {
        let a = sample_event(STREAM, 1);
        let b = sample_event(STREAM, 2);
        assert_ne!(a.id, b.id);
        let doc: serde_json::Value = serde_json::from_slice(&a.payload).unwrap();
        assert_eq!(doc["type"], "voucher.updated");
        assert_eq!(doc["data"]["id"], 1);
    }
}
