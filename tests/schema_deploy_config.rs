//! The config files shipped for containers (deploy/docker, deploy/compose,
//! the Kubernetes ConfigMap) load through the daemon's real config loader,
//! with the environment each deployment adds, so a renamed or removed config
//! key breaks this test instead of a user's `docker compose up`.

use std::path::{Path, PathBuf};

use figment::providers::{Format, Toml};
use figment::Figment;
use voucher_cdc::config::{load_from, Config, SinkKind};
use voucher_cdc::shard::Shard;

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo(path)).unwrap()
}

/// The demo token file stands in for secrets mounted at run time.
fn token_file_override() -> String {
    let token_file = repo("deploy/compose/secrets/upstream-token");
    format!(
        "[upstream]\ntoken_file = {:?}\n",
        token_file.display().to_string()
    )
}

/// Loads `file_toml`, then `overrides` (what the deployment sets through
/// `VOUCHER_CDC_*` variables and mounts), like `load` does with file + env.
fn load(file_toml: &str, overrides: &[&str]) -> Config {
    let mut figment = Figment::new().merge(Toml::string(file_toml));
    for layer in overrides {
        figment = figment.merge(Toml::string(layer));
    }
    load_from(figment).unwrap_or_else(|e| panic!("config rejected: {:?}", e.problems))
}

/// The `config.toml` block of the Kubernetes ConfigMap (a YAML literal block).
fn configmap_config_toml() -> String {
    let yaml = read("deploy/kubernetes/configmap.yaml");
    let mut lines = yaml.lines().skip_while(|l| l.trim() != "config.toml: |");
    assert!(
        lines.next().is_some(),
        "configmap.yaml has no config.toml block"
    );
    lines
        .take_while(|l| l.is_empty() || l.starts_with("    "))
        .map(|l| l.strip_prefix("    ").unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The `env` values the StatefulSet sets, as `VOUCHER_CDC_SHARD__COUNT` -> `2`.
fn statefulset_env(name: &str) -> String {
    let yaml = read("deploy/kubernetes/statefulset.yaml");
    let mut lines = yaml
        .lines()
        .skip_while(|l| l.trim() != format!("- name: {name}"));
    lines.next().expect("variable is set in statefulset.yaml");
    let value = lines.next().unwrap().trim();
    value
        .strip_prefix("value: ")
        .unwrap()
        .trim_matches('"')
        .to_string()
}

const COMPOSE_ADMIN_ENV: &str =
    "[admin]\nlisten = \"0.0.0.0:9464\"\ntoken = \"demo-admin-token\"\n";

#[test]
fn the_compose_config_loads_for_the_nats_bridge_with_its_environment() {
    let config = load(
        &read("deploy/compose/voucher-cdc.toml"),
        &[&token_file_override(), COMPOSE_ADMIN_ENV],
    );
    assert_eq!(config.sink.kind(), SinkKind::Nats);
    assert_eq!(config.tenants.len(), 3);
    assert_eq!(
        config.state.path,
        PathBuf::from("/var/lib/voucher-cdc/state")
    );
    assert_eq!(config.token_for(1).unwrap().expose(), "demo-token");
    assert_eq!(config.all_streams().len(), 5);
}

#[test]
fn the_compose_config_loads_for_the_kafka_bridge_with_its_environment() {
    let config = load(
        &read("deploy/compose/voucher-cdc.toml"),
        &[
            &token_file_override(),
            COMPOSE_ADMIN_ENV,
            "[sink]\nkind = \"kafka\"\n",
        ],
    );
    assert_eq!(config.sink.kind(), SinkKind::Kafka);
}

#[test]
fn the_compose_bridge_needs_its_admin_token_on_a_public_listener() {
    let figment = Figment::new()
        .merge(Toml::string(&read("deploy/compose/voucher-cdc.toml")))
        .merge(Toml::string(&token_file_override()))
        .merge(Toml::string("[admin]\nlisten = \"0.0.0.0:9464\"\n"));
    let problems = load_from(figment).unwrap_err().problems;
    assert!(
        problems.iter().any(|p| p.starts_with("admin.token")),
        "{problems:?}"
    );
}

#[test]
fn the_image_default_config_only_needs_the_upstream_and_tenants() {
    let config = load(
        &read("deploy/docker/config.toml"),
        &[
            &token_file_override(),
            "[upstream]\nbase_url = \"https://vouchers.example.com/api/external/v1\"\n[[tenants]]\nid = 1\n",
        ],
    );
    assert_eq!(
        config.state.path,
        PathBuf::from("/var/lib/voucher-cdc/state")
    );
}

#[test]
fn the_kubernetes_config_loads_and_each_pod_resolves_its_shard_from_its_name() {
    let count = statefulset_env("VOUCHER_CDC_SHARD__COUNT");
    let admin_token = "[admin]\ntoken = \"from-the-secret\"\n".to_string();
    let config = load(
        &configmap_config_toml(),
        &[
            &token_file_override(),
            &admin_token,
            &format!("[shard]\ncount = {count}\n"),
        ],
    );
    let count: u32 = count.parse().unwrap();
    let mut owned = 0;
    for ordinal in 0..count {
        let shard = config
            .shard
            .resolve_with_hostname(Some(&format!("voucher-cdc-{ordinal}")))
            .unwrap();
        assert_eq!(shard, Shard::new(ordinal, count).unwrap());
        owned += config.streams(&shard).len();
    }
    assert_eq!(owned, config.all_streams().len());
    let beyond = format!("voucher-cdc-{count}");
    assert!(config.shard.resolve_with_hostname(Some(&beyond)).is_err());
}

/// Every `voucher_cdc_*` name in `text` (histogram suffixes dropped).
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    text.match_indices("voucher_cdc_")
        .map(|(at, _)| {
            let name: String = text[at..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .map(str::to_string)
                .unwrap_or(name)
        })
        .collect()
}

/// The `- alert: Name` entries of a text.
fn alert_names(text: &str) -> std::collections::BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .map(|n| n.trim().to_string())
        .collect()
}

#[test]
fn the_prometheus_rule_ships_the_documented_alerts_on_metrics_that_exist() {
    let rule = read("deploy/kubernetes/prometheusrule.yaml");
    assert!(
        read("deploy/kubernetes/kustomization.yaml").contains("- prometheusrule.yaml"),
        "the kustomization must apply the PrometheusRule"
    );
    let exprs: String = rule
        .lines()
        .filter(|l| l.trim().starts_with("expr:"))
        .collect::<Vec<_>>()
        .join("\n");
    let defined = metric_names(&read("src/telemetry.rs"));
    let used = metric_names(&exprs);
    assert!(!used.is_empty());
    let unknown: Vec<_> = used.difference(&defined).collect();
    assert!(
        unknown.is_empty(),
        "alerts use unknown metrics: {unknown:?}"
    );
    assert_eq!(
        alert_names(&rule),
        alert_names(&read("docs/operations.md")),
        "prometheusrule.yaml and docs/operations.md list different alerts"
    );
    assert!(alert_names(&rule).contains("VoucherCdcStreamParked"));
    assert!(alert_names(&rule).contains("VoucherCdcStreamFailing"));
}
