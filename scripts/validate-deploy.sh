#!/usr/bin/env bash
# Validates the packaging and deployment files without a container engine or
# a cluster: docker-compose.yml, deploy/** (YAML, TOML, JSON), schemas/*.json.
#
#   scripts/validate-deploy.sh
#
# Always: parses every YAML (multi-document), JSON and TOML file with python3
# (installs PyYAML with pip only when it is missing) and checks the files agree
# with each other (dashboard metric names exist in src/telemetry.rs, the
# StatefulSet's shard count equals its replicas, config sections are known).
# When the tools are installed: `docker compose config -q` (or docker-compose
# 1.x), `kubectl kustomize`, `kubernetes-validate --strict`, shellcheck.
# Exits non-zero on any failure.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

failures=0
pass() { echo "ok: $*"; }
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}
skip() { echo "skip: $*"; }

# --- docker compose -----------------------------------------------------------
compose=()
if docker compose version >/dev/null 2>&1; then
  compose=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
  compose=(docker-compose)
fi
if ((${#compose[@]})); then
  for profiles in "" "--profile kafka --profile tools"; do
    # shellcheck disable=SC2086 # the profile flags are meant to split
    if out=$("${compose[@]}" -f docker-compose.yml $profiles config -q 2>&1); then
      pass "${compose[*]} ${profiles:+$profiles }config -q"
    else
      fail "${compose[*]} ${profiles:+$profiles }config -q: $out"
    fi
  done
else
  skip "docker compose is not installed (the compose file is still parsed below)"
fi

# --- python: YAML, JSON, TOML and cross-file checks ---------------------------
if ! python3 -c 'import yaml' >/dev/null 2>&1; then
  echo "installing PyYAML for python3"
  python3 -m pip install --quiet PyYAML >/dev/null 2>&1 ||
    python3 -m pip install --quiet --user PyYAML >/dev/null 2>&1 ||
    fail "python3 has no PyYAML and pip could not install it"
fi

if ! python3 - <<'PY'; then
import json
import pathlib
import re
import sys
import tomllib

import yaml

failures = []


def fail(message):
    failures.append(message)
    print(f"FAIL: {message}", file=sys.stderr)


def ok(message):
    print(f"ok: {message}")


# Sections of the config file (DESIGN.md, plus [shard] from src/shard.rs).
CONFIG_SECTIONS = {"upstream", "tenants", "poll", "state", "sink", "admin", "log", "shard"}


def check_config(label, text):
    try:
        config = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        fail(f"{label}: not valid TOML: {e}")
        return None
    unknown = set(config) - CONFIG_SECTIONS
    if unknown:
        fail(f"{label}: unknown config sections {sorted(unknown)}; valid: {sorted(CONFIG_SECTIONS)}")
        return None
    ok(f"{label}: TOML config")
    return config


def check_env(label, env):
    for name in env:
        if not name.startswith("VOUCHER_CDC_"):
            continue
        section = name[len("VOUCHER_CDC_"):].split("__")[0].lower()
        if section not in CONFIG_SECTIONS:
            fail(f"{label}: {name} names unknown config section `{section}`")


yaml_files = sorted(pathlib.Path("deploy").rglob("*.yaml")) + sorted(pathlib.Path("deploy").rglob("*.yml"))
yaml_files.insert(0, pathlib.Path("docker-compose.yml"))
documents = {}
for path in yaml_files:
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except (OSError, yaml.YAMLError) as e:
        fail(f"{path}: {e}")
        continue
    if not docs:
        fail(f"{path}: no YAML document")
        continue
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict):
            fail(f"{path}: document {i + 1} is not a mapping")
    documents[path] = docs
    ok(f"{path}: {len(docs)} YAML document(s)")

# Kubernetes manifests: kind/apiVersion/name on every object, config inside.
k8s = {}
for path, docs in documents.items():
    if "kubernetes" not in path.parts or path.name == "kustomization.yaml":
        continue
    for doc in docs:
        if not all(doc.get(k) for k in ("apiVersion", "kind")) or not doc.get("metadata", {}).get("name"):
            fail(f"{path}: an object lacks apiVersion, kind or metadata.name")
            continue
        k8s[(doc["kind"], doc["metadata"]["name"])] = doc
kustomization = documents.get(pathlib.Path("deploy/kubernetes/kustomization.yaml"), [{}])[0]
for resource in kustomization.get("resources", []):
    if not (pathlib.Path("deploy/kubernetes") / resource).is_file():
        fail(f"deploy/kubernetes/kustomization.yaml: resource {resource} does not exist")

configmap = k8s.get(("ConfigMap", "voucher-cdc-config"))
statefulset = k8s.get(("StatefulSet", "voucher-cdc"))
if configmap is None or statefulset is None:
    fail("deploy/kubernetes: ConfigMap voucher-cdc-config or StatefulSet voucher-cdc is missing")
else:
    config = check_config("ConfigMap voucher-cdc-config config.toml", configmap["data"].get("config.toml", ""))
    container = statefulset["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    check_env("StatefulSet voucher-cdc", env)
    replicas = statefulset["spec"].get("replicas", 1)
    count = env.get("VOUCHER_CDC_SHARD__COUNT")
    if count is None and config is not None:
        count = config.get("shard", {}).get("count", 1)
    if str(count) != str(replicas):
        fail(f"StatefulSet voucher-cdc: shard count {count} differs from replicas {replicas}")
    else:
        ok(f"StatefulSet voucher-cdc: shard count equals replicas ({replicas})")
    if config is not None and config.get("shard", {}).get("index") != "hostname" and replicas != 1:
        fail("ConfigMap voucher-cdc-config: shard.index must be \"hostname\" with several replicas")
    claims = [c["metadata"]["name"] for c in statefulset["spec"].get("volumeClaimTemplates", [])]
    mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
    state_path = (config or {}).get("state", {}).get("path", "")
    if not any(state_path.startswith(mounts.get(c, "\0")) for c in claims):
        fail(f"StatefulSet voucher-cdc: state.path {state_path!r} is not on a volumeClaimTemplate mount")

# Service links would put VOUCHER_CDC_<SERVICE>_PORT=tcp://... into the config's env prefix.
if statefulset is not None:
    if statefulset["spec"]["template"]["spec"].get("enableServiceLinks") is not False:
        fail("StatefulSet voucher-cdc: set enableServiceLinks: false (service links inject VOUCHER_CDC_* variables)")
    else:
        ok("StatefulSet voucher-cdc: no service-link variables")

# PrometheusRule: every metric exists, and the alerts are the ones docs/operations.md describes.
metric_names = set(re.findall(r'"(voucher_cdc_[a-z0-9_]+)"', pathlib.Path("src/telemetry.rs").read_text()))
rule = k8s.get(("PrometheusRule", "voucher-cdc"))
if rule is None:
    fail("deploy/kubernetes: PrometheusRule voucher-cdc is missing")
elif "prometheusrule.yaml" not in kustomization.get("resources", []):
    fail("deploy/kubernetes/kustomization.yaml: prometheusrule.yaml is not a resource")
else:
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    for r in rules:
        if not r.get("alert") or not r.get("expr"):
            fail(f"PrometheusRule voucher-cdc: a rule lacks alert or expr: {r}")
            continue
        used = {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"voucher_cdc_[a-z0-9_]+", r["expr"])}
        missing = sorted(used - metric_names)
        if missing:
            fail(f"PrometheusRule voucher-cdc: alert {r['alert']} uses metrics not defined in src/telemetry.rs: {missing}")
    shipped = {r.get("alert") for r in rules}
    documented = set(re.findall(r"- alert: (\w+)", pathlib.Path("docs/operations.md").read_text()))
    if shipped != documented:
        fail(f"PrometheusRule voucher-cdc: alerts differ from docs/operations.md: only shipped {sorted(shipped - documented)}, only documented {sorted(documented - shipped)}")
    else:
        ok(f"PrometheusRule voucher-cdc: {len(rules)} alerts, as documented")

# docker compose: configs it mounts, environment it sets.
compose = documents.get(pathlib.Path("docker-compose.yml"), [{}])[0]
for name, service in compose.get("services", {}).items():
    environment = service.get("environment", {})
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    check_env(f"docker-compose.yml service {name}", environment)
    for volume in service.get("volumes", []):
        source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
        if source.startswith("./") and not pathlib.Path(source).exists():
            fail(f"docker-compose.yml service {name}: mounted file {source} does not exist")
for name, secret in compose.get("secrets", {}).items():
    if "file" in secret and not pathlib.Path(secret["file"]).is_file():
        fail(f"docker-compose.yml secret {name}: file {secret['file']} does not exist")
for path in sorted(pathlib.Path("deploy").rglob("*.toml")):
    check_config(str(path), path.read_text())

# JSON: dashboards and schemas.
metric_names = set(re.findall(r'"(voucher_cdc_[a-z0-9_]+)"', pathlib.Path("src/telemetry.rs").read_text()))
for path in sorted(pathlib.Path("deploy/grafana").glob("*.json")) + sorted(pathlib.Path("schemas").glob("*.json")):
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        fail(f"{path}: {e}")
        continue
    if path.parent.name == "grafana":
        exprs = [t.get("expr", "") for p in doc.get("panels", []) for t in p.get("targets", [])]
        if not exprs:
            fail(f"{path}: no panel queries")
        used = {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"voucher_cdc_[a-z0-9_]+", e)}
        missing = sorted(used - metric_names)
        if missing:
            fail(f"{path}: metrics not defined in src/telemetry.rs: {missing}")
        if not any(v.get("type") == "datasource" and v.get("query") == "prometheus"
                   for v in doc.get("templating", {}).get("list", [])):
            fail(f"{path}: no prometheus datasource variable")
        unused = sorted(metric_names - used)
        ok(f"{path}: dashboard, {len(exprs)} queries" + (f" (not charted: {unused})" if unused else ""))
    elif "openapi" in doc:
        # The admin API's description (tests/admin.rs checks it against the routes).
        if not str(doc["openapi"]).startswith("3.") or not doc.get("paths"):
            fail(f"{path}: not an OpenAPI 3 document with paths")
        ok(f"{path}: OpenAPI {doc['openapi']}")
    else:
        if doc.get("$schema") != "https://json-schema.org/draft/2020-12/schema":
            fail(f"{path}: $schema is not draft 2020-12")
        ok(f"{path}: JSON Schema")

sys.exit(1 if failures else 0)
PY
  fail "python checks (see above)"
fi

# --- Kubernetes ---------------------------------------------------------------
if command -v kubectl >/dev/null 2>&1; then
  if rendered=$(kubectl kustomize deploy/kubernetes 2>&1); then
    pass "kubectl kustomize deploy/kubernetes"
    if command -v kubernetes-validate >/dev/null 2>&1; then
      if out=$(kubernetes-validate --strict --quiet --no-warn <(printf '%s\n' "$rendered") 2>&1); then
        pass "kubernetes-validate --strict (ServiceMonitor and PrometheusRule have no schema there)"
      else
        fail "kubernetes-validate: $out"
      fi
    else
      skip "kubernetes-validate is not installed (pip install kubernetes-validate)"
    fi
  else
    fail "kubectl kustomize deploy/kubernetes: $rendered"
  fi
else
  skip "kubectl is not installed"
fi

# --- shell --------------------------------------------------------------------
for script in deploy/docker/healthcheck.sh scripts/validate-deploy.sh scripts/test.sh scripts/install-tansu.sh .ci/run; do
  if bash -n "$script"; then
    pass "bash -n $script"
  else
    fail "bash -n $script"
  fi
done
if command -v shellcheck >/dev/null 2>&1; then
  if out=$(shellcheck deploy/docker/healthcheck.sh scripts/validate-deploy.sh scripts/test.sh scripts/install-tansu.sh .ci/run 2>&1); then
    pass "shellcheck"
  else
    fail "shellcheck: $out"
  fi
fi

if ((failures)); then
  echo "validate-deploy: $failures check(s) failed" >&2
  exit 1
fi
echo "validate-deploy: all checks passed"
