//! Configuration: layering, every broken config's one-line message, and the
//! exit code 2 of `check-config` on a broken file.

mod common;

use std::net::SocketAddr;

use voucher_cdc::config::{from_toml_str, SinkKind};
use voucher_cdc::stream::{Resource, StreamKey};

const MINIMAL: &str = r#"
[upstream]
base_url = "http://127.0.0.1:8080/api/external/v1"
token = "s3cret-token"

[[tenants]]
id = 42
"#;

/// Writes `toml` to a temp file and runs `check-config --config` on it with
/// `env` added: (exit code, stdout, stderr, the file's path).
fn check_config(toml: &str, env: &[(&str, &str)]) -> (Option<i32>, String, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    std::fs::write(&path, toml).unwrap();
    let out = common::cli()
        .args(["check-config", "--config"])
        .arg(&path)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        path.display().to_string(),
    )
}

#[test]
fn a_minimal_config_gets_every_documented_default() {
    let cfg = from_toml_str(MINIMAL).unwrap();
    assert_eq!(cfg.upstream.requests_per_minute, 120);
    assert_eq!(cfg.upstream.timeout.as_secs(), 30);
    assert_eq!(cfg.upstream.body_budget_bytes, 8 << 20);
    assert_eq!(cfg.poll.interval.as_secs(), 30);
    assert_eq!(cfg.poll.full_resync_interval.as_secs(), 3600);
    assert_eq!(cfg.poll.lookback.as_secs(), 60);
    assert!(cfg.poll.include_relations);
    assert_eq!(cfg.poll.ignore_keys, vec!["updated_at".to_string()]);
    assert_eq!(cfg.poll.max_delete_fraction, 0.5);
    assert_eq!(cfg.state.path.to_str(), Some("./data/state"));
    assert_eq!(cfg.state.cache_capacity_mib, 6);
    assert_eq!(cfg.state.cache_bytes(), 6 << 20);
    assert_eq!(cfg.sink.kind(), SinkKind::Nats);
    assert_eq!(
        cfg.admin.listen,
        "127.0.0.1:9464".parse::<SocketAddr>().unwrap()
    );
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
            "no store cache",
            base("[state]\ncache_capacity_mib = 0\n"),
            "state.cache_capacity_mib: must be between 1 and 65536, got 0",
        ),
        (
            "a store cache beyond 64 GiB",
            base("[state]\ncache_capacity_mib = 65537\n"),
            "state.cache_capacity_mib: must be between 1 and 65536, got 65537",
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
            "tenants[0].resources[0]: unknown value `products`: valid options are vouchers, categories",
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
            "empty token",
            MINIMAL.replace("s3cret-token", ""),
            "upstream.token: is empty",
        ),
        (
            "base url without the api path",
            MINIMAL.replace("/api/external/v1", ""),
            "upstream.base_url: `http://127.0.0.1:8080` does not end in /api/external/v1",
        ),
        (
            "a duration without its unit",
            base("[poll]\ninterval = \"30\"\n"),
            "poll.interval: expected a duration, found string \"30\": add a unit, e.g. \"30s\"",
        ),
        (
            "a lookback that would overflow the watermark arithmetic",
            base("[poll]\nlookback = \"200000years\"\n"),
            "poll.lookback: ",
        ),
        (
            "a huge retry_after_max",
            MINIMAL.replace("[upstream]\n", "[upstream]\nretry_after_max = \"100years\"\n"),
            "upstream.retry_after_max: 100years is too long: at most 1day",
        ),
        (
            "an empty body budget",
            MINIMAL.replace("[upstream]\n", "[upstream]\nbody_budget_mib = 0\n"),
            "upstream.body_budget_mib: must be between 1 and 16384, got 0",
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
fn a_config_with_many_mistakes_lists_every_one_in_one_round() {
    let toml = r#"
[upstream]
base_url = "http://x/api/external/v1"
token = "t"
timeout = 30
requests_per_minute = "many"

[[tenants]]
id = 1
resources = ["products"]

[poll]
intervall = "30s"
jitter = "abc"
max_delete_fraction = 2.0

[sink]
kind = "redis"

[log]
format = "xml"
"#;
    let problems = from_toml_str(toml).unwrap_err().problems;
    for expected in [
        "upstream.timeout: expected a duration, found ",
        "upstream.requests_per_minute: expected a whole number (0 or more), found string \"many\"",
        "tenants[0].resources[0]: unknown value `products`",
        "poll.intervall: unknown key `intervall`",
        "poll.jitter: expected a number, found string \"abc\"",
        "poll.max_delete_fraction: must be between 0 and 1, got 2",
        "sink.kind: unknown value `redis`",
        "log.format: unknown value `xml`",
    ] {
        assert!(
            problems.iter().any(|p| p.starts_with(expected)),
            "no line starting with {expected:?} in {problems:#?}"
        );
    }
    assert_eq!(problems.len(), 8, "{problems:#?}");
    assert!(
        problems
            .iter()
            .any(|p| p.starts_with("upstream.timeout")
                && p.contains("`30`: add a unit, e.g. \"30s\"")),
        "{problems:#?}"
    );
}

#[test]
fn a_toml_syntax_error_is_one_line_with_its_line_and_column() {
    let broken = "[upstream]\nbase_url = \"http://x/api/external/v1\ntoken = \"t\"\n";
    let (code, _, stderr, path) = check_config(broken, &[]);
    assert_eq!(code, Some(2));
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with(&format!(
            "error: config file {path}: invalid TOML at line 2, column "
        )),
        "{stderr}"
    );
}

#[test]
fn platform_injected_variables_are_ignored_and_a_typo_in_a_config_variable_is_named() {
    // What kubelet injects for Services named voucher-cdc and voucher-cdc-metrics.
    let (code, _, stderr, _) = check_config(
        MINIMAL,
        &[
            ("VOUCHER_CDC_METRICS_PORT", "tcp://10.0.0.1:9464"),
            ("VOUCHER_CDC_METRICS_SERVICE_HOST", "10.0.0.1"),
            ("VOUCHER_CDC_METRICS_PORT_9464_TCP_ADDR", "10.0.0.1"),
            ("VOUCHER_CDC_SERVICE_PORT_ADMIN", "9464"),
            ("VOUCHER_CDC_PORT", "tcp://10.0.0.2:9464"),
        ],
    );
    assert_eq!(code, Some(0), "{stderr}");

    let (code, _, stderr, _) = check_config(MINIMAL, &[("VOUCHER_CDC_POLL__INTERVALL", "5s")]);
    assert_eq!(code, Some(2));
    assert!(
        stderr.contains("poll.intervall: unknown key `intervall`")
            && stderr.contains("VOUCHER_CDC_POLL__INTERVALL"),
        "{stderr}"
    );
    let (code, _, stderr, _) = check_config(MINIMAL, &[("VOUCHER_CDC_POLL__JITTER", "abc")]);
    assert_eq!(code, Some(2));
    assert_eq!(
        stderr.trim(),
        "error: poll.jitter: expected a number, found string \"abc\" (from env VOUCHER_CDC_POLL__JITTER)"
    );
    let (code, _, stderr, _) = check_config(MINIMAL, &[("VOUCHER_CDC_POL__INTERVAL", "5s")]);
    assert_eq!(code, Some(2));
    assert!(
        stderr.starts_with("error: VOUCHER_CDC_POL__INTERVAL: unknown config section `pol`"),
        "{stderr}"
    );
}

#[test]
fn check_config_prints_the_defaults_that_matter() {
    let (code, stdout, stderr, _) =
        check_config(&format!("{MINIMAL}\n[sink]\nkind = \"file\"\n"), &[]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stdout.contains("[sink.file]") && stdout.contains("path = \"./data/events.jsonl\""),
        "{stdout}"
    );
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
    let (code, _, stderr, _) = check_config(
        &format!("{MINIMAL}\n[sink]\nkind = \"kafka\"\n[poll]\nmax_delete_fraction = 3.0\n"),
        &[],
    );
    assert_eq!(code, Some(2));
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

#[test]
fn the_body_budget_in_mib_reaches_every_upstream_client() {
    let cfg = from_toml_str(&MINIMAL.replace("[upstream]\n", "[upstream]\nbody_budget_mib = 3\n"))
        .unwrap();
    let options = voucher_cdc::upstream::client::ClientOptions::from(&cfg.upstream);
    assert_eq!(options.body_budget_bytes, 3 << 20);
    let streams = cfg.all_streams();
    let clients = voucher_cdc::daemon::clients_with(&cfg, &streams, options).unwrap();
    let client = clients.values().next().unwrap();
    assert_eq!(client.body_budget().held_bytes(), 0);
    assert_eq!(client.body_budget().size_bytes(), 3 << 20);
}
