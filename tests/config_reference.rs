//! docs/configuration.md is tested against the config structs: every key the
//! structs accept must be documented in its section's table, and every
//! documented key must exist. The accepted keys come from the structs
//! themselves: an unknown probe key makes `deny_unknown_fields` list them.

use std::collections::{BTreeMap, BTreeSet};

use figment::error::Kind;
use figment::providers::{Format, Toml};
use figment::Figment;
use voucher_cdc::config::RawConfig;

/// Every table of the config, as (TOML path, a document placing a probe key in it).
fn tables() -> Vec<(&'static str, String)> {
    let base = "[upstream]\nbase_url = \"http://x/api/external/v1\"\ntoken = \"t\"\n";
    vec![
        ("upstream", "[upstream]\n__probe = 1\n".to_string()),
        ("tenants", "[[tenants]]\nid = 1\n__probe = 1\n".to_string()),
        ("poll", "[poll]\n__probe = 1\n".to_string()),
        ("events", "[events]\n__probe = 1\n".to_string()),
        ("state", "[state]\n__probe = 1\n".to_string()),
        ("sink", "[sink]\n__probe = 1\n".to_string()),
        ("sink.nats", "[sink.nats]\n__probe = 1\n".to_string()),
        (
            "sink.nats.tls",
            "[sink.nats.tls]\n__probe = 1\n".to_string(),
        ),
        (
            "sink.kafka",
            "[sink.kafka]\nbrokers = \"b:9092\"\n__probe = 1\n".to_string(),
        ),
        (
            "sink.file",
            "[sink.file]\npath = \"x\"\n__probe = 1\n".to_string(),
        ),
        ("admin", "[admin]\n__probe = 1\n".to_string()),
        ("log", "[log]\n__probe = 1\n".to_string()),
        ("shard", "[shard]\n__probe = 1\n".to_string()),
        ("", format!("__probe = 1\n{base}")),
    ]
}

/// The keys the structs accept in the table the probe document targets.
fn accepted_keys(doc: &str) -> BTreeSet<String> {
    let err = Figment::new()
        .merge(Toml::string(doc))
        .extract::<RawConfig>()
        .expect_err("the probe key must be rejected");
    for e in err {
        if let Kind::UnknownField(found, expected) = &e.kind {
            if found == "__probe" {
                return expected.iter().map(|s| s.to_string()).collect();
            }
        }
    }
    panic!("no unknown-field error for the probe in:\n{doc}");
}

/// The keys documented per section: the first column of the table that
/// follows each `## [section]` / `### [section]` heading.
fn documented_keys() -> BTreeMap<String, BTreeSet<String>> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/configuration.md"
    ))
    .expect("docs/configuration.md exists");
    let mut sections: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        if let Some(heading) = line
            .strip_prefix("## ")
            .or_else(|| line.strip_prefix("### "))
        {
            current = heading
                .trim()
                .strip_prefix("`[")
                .and_then(|h| h.strip_suffix("]`"))
                .map(|h| h.trim_start_matches('[').trim_end_matches(']').to_string());
            continue;
        }
        let (Some(section), Some(row)) = (&current, line.strip_prefix("| `")) else {
            continue;
        };
        if let Some((key, _)) = row.split_once('`') {
            sections
                .entry(section.clone())
                .or_default()
                .insert(key.to_string());
        }
    }
    sections
}

#[test]
fn every_config_key_is_documented_and_every_documented_key_exists() {
    let documented = documented_keys();
    let mut problems = Vec::new();
    for (table, doc) in tables() {
        let accepted = accepted_keys(&doc);
        let name = if table.is_empty() { "top level" } else { table };
        if table.is_empty() {
            // Top-level keys are the sections themselves: each needs a heading.
            for key in &accepted {
                if !documented.contains_key(key.as_str()) {
                    problems.push(format!(
                        "section [{key}] has no heading in docs/configuration.md"
                    ));
                }
            }
            continue;
        }
        let docs = documented.get(table).cloned().unwrap_or_default();
        for key in accepted.difference(&docs) {
            problems.push(format!(
                "{table}.{key}: accepted by the config but missing from docs/configuration.md"
            ));
        }
        for key in docs.difference(&accepted) {
            problems.push(format!(
                "{table}.{key}: documented but not accepted by the config ({name})"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
