//! One builder for the config of every test daemon, in-process or a real
//! process: the defaults tests share (fast sweeps, file sink and state in the
//! test's directory, admin API on a free port), changed through typed
//! `with_*` methods, rendered as the TOML the binary reads or loaded as a
//! [`Config`] through the real loader.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use toml::{Table, Value};
use voucher_cdc::config::{Config, EventsConfig, LogConfig, PollConfig};
use voucher_cdc::simulator::Simulator;
use voucher_cdc::sinks::nats::NatsSinkConfig;
use voucher_cdc::stream::Resource;
use voucher_cdc::telemetry::LogFormat;

/// Where a test daemon publishes.
#[derive(Debug, Clone)]
enum TestSinkConfig {
    /// JSON lines appended to this file.
    File(PathBuf),
    /// A NATS JetStream stream.
    Nats(Box<NatsSinkConfig>),
}

/// The config of a test daemon (see the module docs).
#[derive(Debug, Clone)]
pub struct TestConfig {
    base_url: String,
    token: String,
    /// `upstream.ca_file`.
    ca_file: Option<PathBuf>,
    max_attempts: u32,
    /// `upstream.requests_per_minute` and `upstream.rate_window`.
    budget: (u32, Duration),
    /// `(tenant, resources)`; `None` streams every resource.
    tenants: Vec<(u64, Option<Vec<Resource>>)>,
    poll: PollConfig,
    events: EventsConfig,
    state_path: PathBuf,
    sink: TestSinkConfig,
    admin_listen: SocketAddr,
    admin_token: Option<String>,
    log: Option<LogConfig>,
}

impl TestConfig {
    /// Tenants `tenants` of the API at `base_url` with `token`; file sink
    /// and state in `dir`, admin API on a free loopback port, sweeps every
    /// 200ms and a full sweep every 2s, two attempts per request.
    pub fn new(base_url: &str, token: &str, dir: &Path, tenants: &[u64]) -> Self {
        TestConfig {
            base_url: base_url.to_string(),
            token: token.to_string(),
            ca_file: None,
            max_attempts: 2,
            budget: (60_000, Duration::from_secs(60)),
            tenants: tenants.iter().map(|t| (*t, None)).collect(),
            poll: PollConfig {
                interval: Duration::from_millis(200),
                full_resync_interval: Duration::from_secs(2),
                lookback: Duration::from_secs(1),
                park_recheck_interval: Duration::from_secs(1),
                shutdown_timeout: Duration::from_secs(10),
                ..PollConfig::default()
            },
            events: EventsConfig::default(),
            state_path: dir.join("state"),
            sink: TestSinkConfig::File(dir.join("events.jsonl")),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            admin_token: None,
            log: None,
        }
    }

    /// [`TestConfig::new`] against `sim` with its all-powerful token.
    pub fn for_simulator(sim: &Simulator, dir: &Path, tenants: &[u64]) -> Self {
        Self::new(&sim.base_url(), sim.token(), dir, tenants)
    }

    /// Trusts the CA certificates in the PEM file `path` (`upstream.ca_file`).
    pub fn with_ca_file(mut self, path: &Path) -> Self {
        self.ca_file = Some(path.to_path_buf());
        self
    }

    /// Another tenant, streaming only `resources`.
    pub fn with_tenant(mut self, tenant: u64, resources: &[Resource]) -> Self {
        self.tenants.push((tenant, Some(resources.to_vec())));
        self
    }

    /// `upstream.max_attempts`.
    pub fn with_max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// `upstream.requests_per_minute` = `requests`, counted per `window` (`upstream.rate_window`).
    pub fn with_budget(mut self, requests: u32, window: Duration) -> Self {
        self.budget = (requests, window);
        self
    }

    /// `poll.interval`.
    pub fn with_poll_interval(mut self, interval: Duration) -> Self {
        self.poll.interval = interval;
        self
    }

    /// `poll.full_resync_interval`.
    pub fn with_full_resync_interval(mut self, interval: Duration) -> Self {
        self.poll.full_resync_interval = interval;
        self
    }

    /// `poll.park_recheck_interval`.
    pub fn with_park_recheck_interval(mut self, interval: Duration) -> Self {
        self.poll.park_recheck_interval = interval;
        self
    }

    /// `poll.strategy`.
    pub fn with_strategy(mut self, strategy: voucher_cdc::planner::Strategy) -> Self {
        self.poll.strategy = strategy;
        self
    }

    /// Every sweep due as a full sweep (both intervals 10ms).
    pub fn with_every_sweep_full(self) -> Self {
        self.with_poll_interval(Duration::from_millis(10))
            .with_full_resync_interval(Duration::from_millis(10))
    }

    /// `poll.shutdown_timeout`.
    pub fn with_shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.poll.shutdown_timeout = timeout;
        self
    }

    /// `poll.max_delete_fraction`.
    pub fn with_max_delete_fraction(mut self, fraction: f64) -> Self {
        self.poll.max_delete_fraction = fraction;
        self
    }

    /// `[events]`.
    pub fn with_events(mut self, events: EventsConfig) -> Self {
        self.events = events;
        self
    }

    /// `state.path`.
    pub fn with_state_path(mut self, path: impl Into<PathBuf>) -> Self {
        self.state_path = path.into();
        self
    }

    /// The NATS sink with `nats` instead of the file sink.
    pub fn with_nats_sink(mut self, nats: NatsSinkConfig) -> Self {
        self.sink = TestSinkConfig::Nats(Box::new(nats));
        self
    }

    /// `admin.listen` on this loopback port.
    pub fn with_admin_port(mut self, port: u16) -> Self {
        self.admin_listen = SocketAddr::from(([127, 0, 0, 1], port));
        self
    }

    /// `admin.token`.
    pub fn with_admin_token(mut self, token: &str) -> Self {
        self.admin_token = Some(token.to_string());
        self
    }

    /// `[log]`.
    pub fn with_log(mut self, format: LogFormat, level: &str) -> Self {
        self.log = Some(LogConfig {
            format,
            level: level.to_string(),
        });
        self
    }

    /// The file the file sink appends to (`None` for another sink).
    pub fn events_path(&self) -> Option<&Path> {
        match &self.sink {
            TestSinkConfig::File(path) => Some(path),
            TestSinkConfig::Nats(_) => None,
        }
    }

    /// The TOML text.
    pub fn toml(&self) -> String {
        let mut upstream = Table::new();
        upstream.insert("base_url".into(), self.base_url.clone().into());
        upstream.insert("token".into(), self.token.clone().into());
        if let Some(ca_file) = &self.ca_file {
            upstream.insert("ca_file".into(), ca_file.display().to_string().into());
        }
        upstream.insert(
            "requests_per_minute".into(),
            i64::from(self.budget.0).into(),
        );
        upstream.insert(
            "rate_window".into(),
            humantime::format_duration(self.budget.1).to_string().into(),
        );
        upstream.insert("max_attempts".into(), i64::from(self.max_attempts).into());
        let tenants = self
            .tenants
            .iter()
            .map(|(id, resources)| {
                let mut tenant = Table::new();
                tenant.insert("id".into(), (*id as i64).into());
                if let Some(resources) = resources {
                    let names = resources.iter().map(|r| Value::from(r.as_str())).collect();
                    tenant.insert("resources".into(), Value::Array(names));
                }
                Value::Table(tenant)
            })
            .collect();
        let mut sink = Table::new();
        match &self.sink {
            TestSinkConfig::File(path) => {
                sink.insert("kind".into(), "file".into());
                let mut file = Table::new();
                file.insert("path".into(), path.display().to_string().into());
                sink.insert("file".into(), file.into());
            }
            TestSinkConfig::Nats(nats) => {
                sink.insert("kind".into(), "nats".into());
                sink.insert("nats".into(), typed_value(nats.as_ref()));
            }
        }
        let mut admin = Table::new();
        admin.insert("listen".into(), self.admin_listen.to_string().into());
        if let Some(token) = &self.admin_token {
            admin.insert("token".into(), token.clone().into());
        }
        let mut state = Table::new();
        state.insert("path".into(), self.state_path.display().to_string().into());

        let mut doc = Table::new();
        doc.insert("upstream".into(), upstream.into());
        doc.insert("tenants".into(), Value::Array(tenants));
        doc.insert("poll".into(), typed_value(&self.poll));
        doc.insert("events".into(), typed_value(&self.events));
        doc.insert("state".into(), state.into());
        doc.insert("sink".into(), sink.into());
        doc.insert("admin".into(), admin.into());
        if let Some(log) = &self.log {
            doc.insert("log".into(), typed_value(log));
        }
        toml::to_string(&doc).expect("a test config renders as TOML")
    }

    /// The config, through the real loader.
    pub fn config(&self) -> Config {
        voucher_cdc::config::from_toml_str(&self.toml()).expect("test config is valid")
    }

    /// Writes the TOML to `path` and returns it.
    pub fn write(&self, path: &Path) -> PathBuf {
        std::fs::write(path, self.toml()).unwrap();
        path.to_path_buf()
    }
}

/// A library config section as a TOML value, through its own serde shape.
fn typed_value(section: &impl serde::Serialize) -> Value {
    Value::try_from(section).expect("a config section renders as TOML")
}
