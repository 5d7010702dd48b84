//! `check-config --probe`: the config not only parses but works. One cheap
//! request per configured tenant proves its token, and the sink is reached
//! the way the daemon would reach it (NATS connect and stream lookup, Kafka
//! metadata, the file opened for appending), each result on its own line so
//! an operator sees every broken credential at once, before a rollout.

use std::time::{Duration, Instant};

use chrono::Utc;

use crate::config::{Config, SinkBackendConfig};
use crate::daemon::clients_with;
use crate::stream::StreamKey;
use crate::upstream::client::ClientOptions;
use crate::upstream::page::ListQuery;

/// Longest a probe of the sink may take (connect, lookup).
const SINK_TIMEOUT: Duration = Duration::from_secs(10);

/// What one probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeResult {
    /// What was probed: `upstream tenant 3`, `sink nats`.
    pub target: String,
    /// What worked, or why it failed, in one line.
    pub outcome: Result<String, String>,
}

impl std::fmt::Display for ProbeResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.outcome {
            Ok(detail) => write!(f, "ok    {}: {detail}", self.target),
            Err(reason) => write!(f, "FAIL  {}: {reason}", self.target),
        }
    }
}

/// Probes every configured tenant (whichever shard owns it) and the sink.
pub async fn probe(config: &Config) -> Vec<ProbeResult> {
    let mut results = probe_upstream(config).await;
    results.push(ProbeResult {
        target: format!("sink {}", config.sink.kind().as_str()),
        outcome: probe_sink(&config.sink.backend).await,
    });
    results
}

/// One list request per tenant, for its first resource, asking only for
/// records changed from now on (an empty page): one attempt, no retries,
/// spent from the token's rate budget like any other request.
async fn probe_upstream(config: &Config) -> Vec<ProbeResult> {
    let streams: Vec<StreamKey> = config
        .tenants
        .iter()
        .filter_map(|t| t.resources.first().map(|r| StreamKey::new(t.id, *r)))
        .collect();
    let options = ClientOptions {
        max_attempts: 1,
        ..ClientOptions::from(&config.upstream)
    };
    let clients = match clients_with(config, &streams, options) {
        Ok(clients) => clients,
        Err(e) => {
            return vec![ProbeResult {
                target: "upstream".to_string(),
                outcome: Err(e.to_string()),
            }]
        }
    };
    let query = ListQuery {
        updated_since: Some(Utc::now()),
        cursor: None,
        include_relations: false,
    };
    let mut results = Vec::with_capacity(streams.len());
    for key in streams {
        let target = format!("upstream tenant {}", key.tenant);
        let Some(client) = clients.get(&key) else {
            continue;
        };
        let started = Instant::now();
        let outcome = match client.list_page(key.tenant, key.resource, &query).await {
            Ok(_) => Ok(format!(
                "token {} accepted, {} listed in {}",
                client.token_id(),
                key.resource.as_str(),
                crate::telemetry::human_duration(started.elapsed())
            )),
            Err(e) => Err(e.to_string()),
        };
        results.push(ProbeResult { target, outcome });
    }
    results
}

/// Reaches the sink without publishing anything.
async fn probe_sink(backend: &SinkBackendConfig) -> Result<String, String> {
    let probing = async {
        match backend {
            SinkBackendConfig::Nats(nats) => crate::sinks::nats::probe(nats)
                .await
                .map_err(|e| e.to_string()),
            SinkBackendConfig::Kafka(kafka) => crate::sinks::kafka::probe(kafka, SINK_TIMEOUT)
                .await
                .map_err(|e| e.to_string()),
            SinkBackendConfig::File(file) => file.probe(),
            SinkBackendConfig::Stdout => Ok("standard output needs no connection".to_string()),
        }
    };
    match tokio::time::timeout(SINK_TIMEOUT, probing).await {
        Ok(outcome) => outcome,
        Err(_) => Err(format!(
            "no answer within {}",
            crate::telemetry::human_duration(SINK_TIMEOUT)
        )),
    }
}
