//! The shipped Kubernetes manifests start: the kustomization is rendered with
//! `kubectl kustomize`, the environment kubelet would give the StatefulSet's
//! pod is synthesised (service-link variables for every Service, the
//! container's own env with secret references resolved, its ConfigMap and
//! Secret mounts written to a temp dir with their paths rewritten), and the
//! container's own command line runs as `check-config` with it: exit 0.

#[path = "common/brokers.rs"]
#[allow(dead_code)]
mod brokers;
mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use base64::Engine;
use serde_json::Value;

/// The rendered kustomization as JSON objects, or None when kubectl or
/// PyYAML is missing outside scripts/test.sh (which installs both, and under
/// which a missing one fails the test).
fn rendered_objects() -> Option<Vec<Value>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes");
    let rendered = match Command::new("kubectl").arg("kustomize").arg(&dir).output() {
        Ok(out) if out.status.success() => out.stdout,
        Ok(out) => panic!(
            "kubectl kustomize failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => {
            brokers::skip_or_fail(
                "deploy_kubernetes",
                &format!("kubectl cannot run ({e}); scripts/test.sh installs it"),
            );
            return None;
        }
    };
    let python = Command::new("python3")
        .args([
            "-c",
            "import json, sys, yaml; json.dump([d for d in yaml.safe_load_all(sys.stdin) if d], sys.stdout)",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut python = match python {
        Ok(child) => child,
        Err(e) => {
            brokers::skip_or_fail("deploy_kubernetes", &format!("python3 cannot run ({e})"));
            return None;
        }
    };
    std::io::Write::write_all(&mut python.stdin.take().unwrap(), &rendered).unwrap();
    let out = python.wait_with_output().unwrap();
    if !out.status.success() {
        brokers::skip_or_fail(
            "deploy_kubernetes",
            &format!(
                "python3 with PyYAML is needed to read the manifests \
                 (scripts/test.sh installs python3-yaml): {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        );
        return None;
    }
    Some(serde_json::from_slice(&out.stdout).unwrap())
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("{kind} {name} is not in the kustomization"))
}

/// A Secret's or ConfigMap's entries, decoded.
fn entries(object: &Value) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for (key, value) in object["data"].as_object().into_iter().flatten() {
        let text = value.as_str().unwrap();
        let text = if object["kind"] == "Secret" {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(text)
                .unwrap();
            String::from_utf8(bytes).unwrap()
        } else {
            text.to_string()
        };
        out.insert(key.clone(), text);
    }
    for (key, value) in object["stringData"].as_object().into_iter().flatten() {
        out.insert(key.clone(), value.as_str().unwrap().to_string());
    }
    out
}

/// The variables kubelet injects for a Service (docker-links style), as if
/// `enableServiceLinks` were on: other Services of the namespace, or an overlay
/// that drops the flag, inject them all the same.
fn service_links(service: &Value, ip: &str) -> Vec<(String, String)> {
    let name = service["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_ascii_uppercase()
        .replace('-', "_");
    let mut vars = vec![(format!("{name}_SERVICE_HOST"), ip.to_string())];
    let ports = service["spec"]["ports"].as_array().unwrap();
    for (i, port) in ports.iter().enumerate() {
        let number = port["port"].as_u64().unwrap();
        let proto = port["protocol"].as_str().unwrap_or("TCP").to_string();
        let lower = proto.to_ascii_lowercase();
        if i == 0 {
            vars.push((format!("{name}_SERVICE_PORT"), number.to_string()));
            vars.push((format!("{name}_PORT"), format!("{lower}://{ip}:{number}")));
        }
        if let Some(port_name) = port["name"].as_str() {
            let port_name = port_name.to_ascii_uppercase().replace('-', "_");
            vars.push((
                format!("{name}_SERVICE_PORT_{port_name}"),
                number.to_string(),
            ));
        }
        let prefix = format!("{name}_PORT_{number}_{proto}");
        vars.push((prefix.clone(), format!("{lower}://{ip}:{number}")));
        vars.push((format!("{prefix}_PROTO"), lower));
        vars.push((format!("{prefix}_PORT"), number.to_string()));
        vars.push((format!("{prefix}_ADDR"), ip.to_string()));
    }
    vars
}

/// `text` with every mount path moved under the temp dir, in one pass (a
/// rewritten path under `/tmp` must not be rewritten again by the `/tmp` mount).
fn rewrite(text: &str, mounts: &[(String, PathBuf)]) -> String {
    let marked = mounts
        .iter()
        .enumerate()
        .fold(text.to_string(), |text, (i, (from, _))| {
            text.replace(from.as_str(), &format!("\u{0}{i}\u{0}"))
        });
    mounts
        .iter()
        .enumerate()
        .fold(marked, |text, (i, (_, to))| {
            text.replace(&format!("\u{0}{i}\u{0}"), &to.display().to_string())
        })
}

#[test]
fn the_statefulset_pod_passes_check_config_with_the_environment_kubelet_gives_it() {
    let Some(objects) = rendered_objects() else {
        return;
    };
    let statefulset = find(&objects, "StatefulSet", "voucher-cdc");
    let pod = &statefulset["spec"]["template"]["spec"];
    assert_eq!(
        pod["enableServiceLinks"],
        Value::Bool(false),
        "the pod must not get service-link variables"
    );
    let container = &pod["containers"][0];
    let root = tempfile::tempdir().unwrap();

    // Mounts: ConfigMap and Secret files written under the temp dir, other volumes as empty dirs.
    let mut mounts: Vec<(String, PathBuf)> = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let path = m["mountPath"].as_str().unwrap().to_string();
            let local = root.path().join(path.trim_start_matches('/'));
            (path, local)
        })
        .collect();
    // Longest first, so a nested mount is not rewritten through its parent.
    mounts.sort_by_key(|(path, _)| std::cmp::Reverse(path.len()));
    for mount in container["volumeMounts"].as_array().unwrap() {
        let local = root
            .path()
            .join(mount["mountPath"].as_str().unwrap().trim_start_matches('/'));
        std::fs::create_dir_all(&local).unwrap();
        let volume = pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == mount["name"]);
        let source = match volume {
            Some(v) if v["configMap"].is_object() => Some((
                find(
                    &objects,
                    "ConfigMap",
                    v["configMap"]["name"].as_str().unwrap(),
                ),
                &v["configMap"]["items"],
            )),
            Some(v) if v["secret"].is_object() => Some((
                find(
                    &objects,
                    "Secret",
                    v["secret"]["secretName"].as_str().unwrap(),
                ),
                &v["secret"]["items"],
            )),
            _ => None,
        };
        let Some((object, items)) = source else {
            continue;
        };
        let data = entries(object);
        let files: Vec<(String, String)> = match items.as_array() {
            Some(items) => items
                .iter()
                .map(|i| {
                    let key = i["key"].as_str().unwrap();
                    (i["path"].as_str().unwrap().to_string(), data[key].clone())
                })
                .collect(),
            None => data.into_iter().collect(),
        };
        for (path, content) in files {
            std::fs::write(local.join(path), rewrite(&content, &mounts)).unwrap();
        }
    }

    // Environment: what kubelet sets for every pod, service links, the container's env.
    let mut env: Vec<(String, String)> = vec![
        ("HOSTNAME".into(), "voucher-cdc-0".into()),
        ("KUBERNETES_SERVICE_HOST".into(), "10.96.0.1".into()),
        ("KUBERNETES_SERVICE_PORT".into(), "443".into()),
        ("KUBERNETES_PORT".into(), "tcp://10.96.0.1:443".into()),
    ];
    for (i, service) in objects
        .iter()
        .filter(|o| o["kind"] == "Service")
        .enumerate()
    {
        env.extend(service_links(service, &format!("10.96.1.{}", i + 10)));
    }
    assert!(
        env.iter().any(|(k, _)| k == "VOUCHER_CDC_METRICS_PORT"),
        "the metrics Service's links are synthesised: {env:?}"
    );
    for var in container["env"].as_array().into_iter().flatten() {
        let name = var["name"].as_str().unwrap().to_string();
        let value = if let Some(value) = var["value"].as_str() {
            value.to_string()
        } else if let Some(reference) = var["valueFrom"]["secretKeyRef"].as_object() {
            let secret = find(&objects, "Secret", reference["name"].as_str().unwrap());
            entries(secret)[reference["key"].as_str().unwrap()].clone()
        } else if let Some(reference) = var["valueFrom"]["configMapKeyRef"].as_object() {
            let map = find(&objects, "ConfigMap", reference["name"].as_str().unwrap());
            entries(map)[reference["key"].as_str().unwrap()].clone()
        } else if var["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name" {
            "voucher-cdc-0".to_string()
        } else {
            panic!("env {name}: a source this test does not know: {var}");
        };
        env.push((name, rewrite(&value, &mounts)));
    }

    // The container's own command line, as check-config.
    let args: Vec<String> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| rewrite(a.as_str().unwrap(), &mounts))
        .collect();
    assert_eq!(args[0], "run", "{args:?}");
    let out = common::cli()
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .arg("check-config")
        .args(&args[1..])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "check-config in the pod's environment failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(!printed.contains("replace-with-a-random-admin-token"));
    assert!(printed.contains("count = 2"), "{printed}");
}
