//! Configuration: layering, every broken config's one-line message, and the
//! exit code 2 of `check-config` on a broken file.

mod common;

use voucher_cdc::config::{from_toml_str, SinkKind};
use voucher_cdc::stream::{Resource, StreamKey};

const MINIMAL: &str = r#"
[upstream]
base_url = "http://127.0.0.1:8080/api/external/v1"
token = "s3cret-token"

[[tenants]]
id = 42
"#;

#[test]
fn a_minimal_config_gets_every_documented_default() {
    let cfg = from_toml_str(MINIMAL).unwrap();
    assert_eq!(cfg.upstream.requests_per_minute, 120);
    assert_eq!(cfg.upstream.timeout.as_secs(), 30);
    assert_eq!(cfg.poll.interval.as_secs(), 30);
    assert_eq!(cfg.poll.full_resync_interval.as_secs(), 3600);
    assert_eq!(cfg.poll.lookback.as_secs(), 60);
    assert!(cfg.poll.include_relations);
    assert_eq!(cfg.poll.ignore_keys, vec!["updated_at".to_string()]);
    assert_eq!(cfg.poll.max_delete_fraction, 0.5);
    assert_eq!(cfg.state.path.to_str(), Some("./data/state"));
    assert_eq!(cfg.sink.kind, SinkKind::Nats);
    assert_eq!(cfg.admin.listen, "127.0.0.1:9464");
    assert_eq!(
        cfg.all_streams(),
        vec![
            StreamKey::new(42, Resource::Vouchers),
            StreamKey::new(42, Resource::Categories)
        ]
    );
}

/// (what is wrong, the TOML after MINIMAL's tenant, the expected line).
fn broken_configs() -> Vec<(&'static str, String, &'static str)> {
    let base = |extra: &str| format!("{MINIMAL}\n{extra}");
    vec![
        (
            "kafka without brokers",
            base("[sink]\nkind = \"kafka\"\n"),
            "sink.kafka.brokers: required when sink.kind = \"kafka\"",
        ),
        (
            "unknown sink kind",
            base("[sink]\nkind = \"redis\"\n"),
            "sink.kind: unknown value `redis`: valid options are nats, kafka, stdout, file",
        ),
        (
            "unknown key",
            base("[poll]\nintervall = \"30s\"\n"),
            "poll.intervall: unknown key `intervall`: valid keys are interval, full_resync_interval, lookback, include_relations, ignore_keys, max_delete_fraction",
        ),
        (
            "bad duration",
            base("[poll]\ninterval = \"soon\"\n"),
            "poll.interval:",
        ),
        (
            "delete fraction out of range",
            base("[poll]\nmax_delete_fraction = 1.5\n"),
            "poll.max_delete_fraction: must be between 0 and 1, got 1.5",
        ),
        (
            "full resync shorter than the interval",
            base("[poll]\ninterval = \"10m\"\nfull_resync_interval = \"1m\"\n"),
            "poll.full_resync_interval: must be at least poll.interval",
        ),
        (
            "public admin without token",
            base("[admin]\nlisten = \"0.0.0.0:9464\"\n"),
            "admin.token: required when admin.listen (0.0.0.0:9464) is not a loopback address",
        ),
        (
            "admin listen not an address",
            base("[admin]\nlisten = \"localhost\"\n"),
            "admin.listen: `localhost` is not an address like 127.0.0.1:9464",
        ),
        (
            "unknown resource",
            "[upstream]\nbase_url = \"http://x/api/external/v1\"\ntoken = \"t\"\n[[tenants]]\nid = 1\nresources = [\"products\"]\n".to_string(),
            "tenants.0.resources.0: unknown value `products`: valid options are vouchers, categories",
        ),
        (
            "no tenants",
            "[upstream]\nbase_url = \"http://x/api/external/v1\"\ntoken = \"t\"\n".to_string(),
            "tenants: at least one [[tenants]] entry is required",
        ),
        (
            "duplicate tenant",
            base("[[tenants]]\nid = 42\n"),
            "tenants[1].id: tenant 42 is listed twice",
        ),
        (
            "no token anywhere",
            "[upstream]\nbase_url = \"http://x/api/external/v1\"\n[[tenants]]\nid = 1\n".to_string(),
            "upstream.token: required (or upstream.token_file, or env VOUCHER_CDC_UPSTREAM__TOKEN)",
        ),
        (
            "token file missing",
            "[upstream]\nbase_url = \"http://x/api/external/v1\"\ntoken_file = \"/nonexistent/token\"\n[[tenants]]\nid = 1\n".to_string(),
            "upstream.token_file: cannot read /nonexistent/token",
        ),
        (
            "base url not http",
            "[upstream]\nbase_url = \"ftp://x/api\"\ntoken = \"t\"\n[[tenants]]\nid = 1\n".to_string(),
            "upstream.base_url: scheme `ftp` not supported: valid options are http, https",
        ),
        (
            "missing base url",
            "[upstream]\ntoken = \"t\"\n[[tenants]]\nid = 1\n".to_string(),
            "upstream.base_url: required",
        ),
        (
            "bad log level",
            base("[log]\nlevel = \"loud=[\"\n"),
            "log.level: `loud=[` is not a valid filter",
        ),
        (
            "zero rate",
            "[upstream]\nbase_url = \"http://x/api/external/v1\"\ntoken = \"t\"\nrequests_per_minute = 0\n[[tenants]]\nid = 1\n".to_string(),
            "upstream.requests_per_minute: must be at least 1",
        ),
    ]
}

#[test]
fn every_broken_config_is_reported_as_one_line_naming_its_key() {
    for (what, toml, expected) in broken_configs() {
        let err = match from_toml_str(&toml) {
            Ok(_) => panic!("{what}: accepted"),
            Err(e) => e,
        };
        assert!(
            err.problems
                .iter()
                .any(|p| p.starts_with(expected) || p.contains(expected)),
            "{what}: expected a line containing {expected:?}, got {:?}",
            err.problems
        );
        for p in &err.problems {
            assert!(!p.contains('\n'), "{what}: multi-line problem {p:?}");
        }
    }
}

#[test]
fn all_problems_are_listed_at_once() {
    let toml = "[upstream]\nrequests_per_minute = 0\n[poll]\nmax_delete_fraction = 2.0\n";
    let err = from_toml_str(toml).unwrap_err();
    let text = err.to_string();
    for key in [
        "upstream.base_url",
        "upstream.token",
        "upstream.requests_per_minute",
        "tenants",
        "poll.max_delete_fraction",
    ] {
        assert!(text.contains(key), "{key} missing from:\n{text}");
    }
}

#[test]
#[allow(clippy::result_large_err)] // figment's Jail closure returns figment::Error
fn env_overrides_the_file_with_double_underscore_nesting() {
    use figment::providers::{Env, Format, Toml};
    use figment::Figment;
    figment::Jail::expect_with(|jail| {
        jail.set_env("VOUCHER_CDC_POLL__INTERVAL", "5s");
        jail.set_env("VOUCHER_CDC_UPSTREAM__TOKEN", "from-env");
        let cfg = voucher_cdc::config::load_from(
            Figment::new()
                .merge(Toml::string(MINIMAL))
                .merge(Env::prefixed("VOUCHER_CDC_").split("__")),
        )
        .map_err(|e| e.to_string())?;
        assert_eq!(cfg.poll.interval.as_secs(), 5);
        assert_eq!(cfg.token_for(42).unwrap().expose(), "from-env");
        Ok(())
    });
}

#[test]
fn check_config_prints_the_effective_config_with_secrets_redacted() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    std::fs::write(&path, MINIMAL).unwrap();
    let out = common::cli()
        .args(["check-config", "--config"])
        .arg(&path)
        .env_remove("VOUCHER_CDC_UPSTREAM__TOKEN")
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("requests_per_minute = 120"), "{stdout}");
    assert!(stdout.contains("<redacted>"));
    assert!(!stdout.contains("s3cret-token"));
}

#[test]
fn the_config_file_can_be_named_by_env_without_being_read_as_a_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    std::fs::write(&path, MINIMAL).unwrap();
    let out = common::cli()
        .arg("check-config")
        .env("VOUCHER_CDC_CONFIG", &path)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn check_config_exits_2_with_one_line_per_problem() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    std::fs::write(
        &path,
        format!("{MINIMAL}\n[sink]\nkind = \"kafka\"\n[poll]\nmax_delete_fraction = 3.0\n"),
    )
    .unwrap();
    let out = common::cli()
        .args(["check-config", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 2, "{stderr}");
    assert!(lines
        .iter()
        .any(|l| l.contains("sink.kafka.brokers: required")));
    assert!(lines.iter().any(|l| l.contains("poll.max_delete_fraction")));
}

#[test]
fn a_missing_config_file_is_a_usage_error() {
    let out = common::cli()
        .args(["check-config", "--config", "/nonexistent/voucher-cdc.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "error: config file /nonexistent/voucher-cdc.toml: not found"
    );
}
