//! Secrets the way platforms deliver them: every secret from a file beside
//! its key (`token_file`, `password_file`, ...), exactly one of the pair,
//! the file's trailing newline dropped, and never shown by `check-config`.

mod common;

use std::path::Path;

use voucher_cdc::config::{from_toml_str, SinkBackendConfig};
use voucher_cdc::secret::Secret;

/// Writes `content` to `dir/name` and returns the path as a TOML string literal.
fn secret_file(dir: &Path, name: &str, content: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, content).unwrap();
    format!("{:?}", path.display().to_string())
}

/// A config with every secret of the NATS sink set through a file.
fn all_from_files(dir: &Path, nats_auth: &str) -> String {
    format!(
        r#"
[upstream]
base_url = "http://127.0.0.1:8080/api/external/v1"
token_file = {upstream}

[[tenants]]
id = 1
token_file = {tenant}

[[tenants]]
id = 2

[admin]
listen = "0.0.0.0:9464"
token_file = {admin}

[sink]
kind = "nats"
[sink.nats]
{nats_auth}
"#,
        upstream = secret_file(dir, "upstream", "upstream-secret\n"),
        tenant = secret_file(dir, "tenant", "tenant-secret\r\n"),
        admin = secret_file(dir, "admin", "admin-secret\n"),
    )
}

#[test]
fn every_secret_can_come_from_a_file_and_loses_only_its_trailing_newline() {
    let dir = tempfile::tempdir().unwrap();
    let password = secret_file(dir.path(), "password", "pass word \n");
    let cfg = from_toml_str(&all_from_files(
        dir.path(),
        &format!("user = \"bridge\"\npassword_file = {password}"),
    ))
    .unwrap();
    assert_eq!(cfg.token_for(1).map(Secret::expose), Some("tenant-secret"));
    assert_eq!(
        cfg.token_for(2).map(Secret::expose),
        Some("upstream-secret")
    );
    assert_eq!(
        cfg.admin.token.as_ref().map(Secret::expose),
        Some("admin-secret")
    );
    let SinkBackendConfig::Nats(nats) = &cfg.sink.backend else {
        panic!("nats sink expected");
    };
    assert_eq!(
        nats.password.as_ref().map(Secret::expose),
        Some("pass word ")
    );
    assert_eq!(nats.password_file, None, "the file is read once, at load");

    for (auth, expected) in [
        ("token", "nats-token"),
        ("nkey_seed", "SUAEXAMPLESEED"),
        ("credentials", "-----BEGIN NATS USER JWT-----"),
    ] {
        let file = secret_file(dir.path(), auth, &format!("{expected}\n"));
        let cfg = from_toml_str(&all_from_files(
            dir.path(),
            &format!("{auth}_file = {file}"),
        ))
        .unwrap();
        let SinkBackendConfig::Nats(nats) = &cfg.sink.backend else {
            panic!("nats sink expected");
        };
        let got = match auth {
            "token" => &nats.token,
            "nkey_seed" => &nats.nkey_seed,
            _ => &nats.credentials,
        };
        assert_eq!(got.as_ref().map(Secret::expose), Some(expected), "{auth}");
    }
}

#[test]
fn a_secret_given_both_inline_and_as_a_file_is_one_line_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = secret_file(dir.path(), "x", "from-file\n");
    let cases = [
        (
            format!("[upstream]\nbase_url = \"http://x/api/external/v1\"\ntoken = \"a\"\n[[tenants]]\nid = 1\ntoken = \"t\"\ntoken_file = {file}\n"),
            "tenants[0].token_file: set either tenants[0].token or tenants[0].token_file, not both",
        ),
        (
            format!("[upstream]\nbase_url = \"http://x/api/external/v1\"\ntoken = \"a\"\n[[tenants]]\nid = 1\n[admin]\ntoken = \"t\"\ntoken_file = {file}\n"),
            "admin.token_file: set either admin.token or admin.token_file, not both",
        ),
        (
            format!("[upstream]\nbase_url = \"http://x/api/external/v1\"\ntoken = \"a\"\n[[tenants]]\nid = 1\n[sink.nats]\nuser = \"u\"\npassword = \"p\"\npassword_file = {file}\n"),
            "sink.nats.password_file: set either sink.nats.password or sink.nats.password_file, not both",
        ),
        (
            format!("[upstream]\nbase_url = \"http://x/api/external/v1\"\ntoken = \"a\"\n[[tenants]]\nid = 1\n[sink.nats]\ntoken = \"p\"\ntoken_file = {file}\n"),
            "sink.nats.token_file: set either sink.nats.token or sink.nats.token_file, not both",
        ),
        (
            format!("[upstream]\nbase_url = \"http://x/api/external/v1\"\ntoken = \"a\"\n[[tenants]]\nid = 1\n[sink]\nkind = \"kafka\"\n[sink.kafka]\nbrokers = \"b:9092\"\nproperties = {{ \"sasl.password\" = \"p\" }}\nproperty_files = {{ \"sasl.password\" = {file} }}\n"),
            "sink.kafka.property_files.\"sasl.password\": set either sink.kafka.properties.\"sasl.password\" or sink.kafka.property_files.\"sasl.password\", not both",
        ),
    ];
    for (text, expected) in cases {
        let err = from_toml_str(&text).unwrap_err();
        assert_eq!(err.problems, vec![expected.to_string()], "{text}");
    }
}

#[test]
fn a_kafka_property_file_reaches_the_client_config() {
    let dir = tempfile::tempdir().unwrap();
    let file = secret_file(dir.path(), "kafka", "kafka-pass\n");
    let cfg = from_toml_str(&format!(
        "[upstream]\nbase_url = \"http://x/api/external/v1\"\ntoken = \"a\"\n[[tenants]]\nid = 1\n[sink]\nkind = \"kafka\"\n[sink.kafka]\nbrokers = \"b:9092\"\nproperty_files = {{ \"sasl.password\" = {file} }}\n"
    ))
    .unwrap();
    let SinkBackendConfig::Kafka(kafka) = &cfg.sink.backend else {
        panic!("kafka sink expected");
    };
    let client = voucher_cdc::sinks::kafka::client_config(kafka);
    assert_eq!(client.get("sasl.password"), Some("kafka-pass"));
    assert!(!format!("{kafka:?}").contains("kafka-pass"));
}

#[test]
fn check_config_shows_where_each_secret_comes_from_and_never_the_secret() {
    let dir = tempfile::tempdir().unwrap();
    let password = secret_file(dir.path(), "password", "nats-pass-value\n");
    let text = all_from_files(
        dir.path(),
        &format!("user = \"bridge\"\npassword_file = {password}"),
    );
    let path = dir.path().join("c.toml");
    std::fs::write(&path, text).unwrap();
    let out = common::cli()
        .args(["check-config", "--config"])
        .arg(&path)
        .env("VOUCHER_CDC_SINK__NATS__USER", "bridge")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    for secret in [
        "upstream-secret",
        "tenant-secret",
        "admin-secret",
        "nats-pass-value",
    ] {
        assert!(!stdout.contains(secret), "{secret} shown:\n{stdout}");
        assert!(!stderr.contains(secret), "{secret} logged:\n{stderr}");
    }
    assert!(stdout.contains("password_file = "), "{stdout}");
    assert!(stdout.contains("token_file = "), "{stdout}");
}
