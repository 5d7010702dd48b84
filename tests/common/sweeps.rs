//! One way for tests to build a [`Sweeper`]: the simulator's client, the
//! store and sink the test owns, and the settings it changes, each with a
//! `with_*` method (quickwit's `SourceRuntimeBuilder` style), instead of a
//! struct literal in every test file.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use voucher_cdc::simulator::Simulator;
use voucher_cdc::sinks::Sink;
use voucher_cdc::state::{SledStore, StateStore};
use voucher_cdc::stream::StreamKey;
use voucher_cdc::sweep::{Progress, SweepSettings, Sweeper};
use voucher_cdc::upstream::client::UpstreamClient;

use super::bridge_client;

/// Builds a [`Sweeper`] for a test.
pub struct SweeperBuilder {
    stream: StreamKey,
    client: UpstreamClient,
    store: Option<Arc<dyn StateStore>>,
    sink: Option<Arc<dyn Sink>>,
    settings: SweepSettings,
    progress: Option<Progress>,
}

impl SweeperBuilder {
    /// Sweeps `stream` of `sim` with the default settings but a fast sink
    /// backoff (5 ms doubling to 20 ms), into a temporary store and a fresh
    /// test sink unless the test gives its own.
    pub fn new(sim: &Simulator, stream: StreamKey) -> Self {
        Self::with_client(bridge_client(sim), stream)
    }

    /// Like [`SweeperBuilder::new`], through a client the test built.
    pub fn with_client(client: UpstreamClient, stream: StreamKey) -> Self {
        Self {
            stream,
            client,
            store: None,
            sink: None,
            settings: SweepSettings {
                sink_backoff_initial: Duration::from_millis(5),
                sink_backoff_max: Duration::from_millis(20),
                ..SweepSettings::default()
            },
            progress: None,
        }
    }

    /// Commits to `store`.
    pub fn with_store(mut self, store: Arc<dyn StateStore>) -> Self {
        self.store = Some(store);
        self
    }

    /// Publishes to `sink`.
    pub fn with_sink(mut self, sink: Arc<dyn Sink>) -> Self {
        self.sink = Some(sink);
        self
    }

    /// Replaces the settings.
    pub fn with_settings(mut self, settings: SweepSettings) -> Self {
        self.settings = settings;
        self
    }

    /// Changes the settings in place.
    pub fn configure(mut self, change: impl FnOnce(&mut SweepSettings)) -> Self {
        change(&mut self.settings);
        self
    }

    /// Calls `progress` after each committed page.
    pub fn with_progress(mut self, progress: Progress) -> Self {
        self.progress = Some(progress);
        self
    }

    /// The sweeper.
    pub fn build(self) -> Sweeper {
        let store = self.store.unwrap_or_else(|| {
            Arc::new(SledStore::open_temporary().expect("a temporary sled store"))
        });
        let sink = self
            .sink
            .unwrap_or_else(|| Arc::new(voucher_cdc::sinks::testing::TestSink::new()));
        let sweeper = Sweeper::new(
            self.stream,
            self.client,
            store,
            sink,
            Arc::new(self.settings),
        );
        match self.progress {
            Some(progress) => sweeper.with_progress(progress),
            None => sweeper,
        }
    }
}
