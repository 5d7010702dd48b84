//! The admin API of an in-process daemon over loopback HTTP: the bearer
//! token on `/v1`, open probes and metrics, and replay requests validated
//! with JSON errors naming the field, and the OpenAPI description checked
//! against the routes the router serves.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use reqwest::{Client, StatusCode};
use serde_json::{json, Value};

use common::{spawn_daemon, spawn_small_simulator, wait_until, TestConfig};
use voucher_cdc::stream::Resource;

const TOKEN: &str = "admin-test-token";

async fn send(request: reqwest::RequestBuilder) -> (StatusCode, Value) {
    let response = request.send().await.unwrap();
    let status = response.status();
    let text = response.text().await.unwrap();
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_endpoints_require_the_admin_token_while_probes_and_metrics_stay_open() {
    let sim = spawn_small_simulator(1).await;
    let dir = tempfile::tempdir().unwrap();
    let config = TestConfig::for_simulator(&sim, dir.path(), &[1]).with_admin_token(TOKEN);
    let mut daemon = spawn_daemon(&config).await;
    let admin = daemon.admin_url.clone();
    let http = Client::new();
    wait_until("tenant 1 synced", Duration::from_secs(30), || {
        daemon.events().len() == 25
    })
    .await;

    let (code, body) = send(http.get(format!("{admin}/healthz"))).await;
    assert_eq!((code, body), (StatusCode::OK, json!({"status": "ok"})));
    let (code, body) = send(http.get(format!("{admin}/readyz"))).await;
    assert_eq!(
        (code, body),
        (
            StatusCode::OK,
            json!({"ready": true, "reasons": [], "streams": []})
        )
    );
    let (code, _) = send(http.get(format!("{admin}/metrics"))).await;
    assert_eq!(code, StatusCode::OK);

    let response = http.get(format!("{admin}/v1/status")).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(response.headers()["www-authenticate"], "Bearer");
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        body["message"],
        "missing bearer token: send Authorization: Bearer <admin.token>"
    );
    let (code, body) = send(http.get(format!("{admin}/v1/status")).bearer_auth("nope")).await;
    assert_eq!(code, StatusCode::UNAUTHORIZED);
    assert_eq!(body["message"], "invalid bearer token for the admin api");
    let (code, body) = send(
        http.post(format!("{admin}/v1/tenants/1/replay"))
            .bearer_auth("nope"),
    )
    .await;
    assert_eq!(code, StatusCode::UNAUTHORIZED, "{body}");

    let (code, body) = send(http.get(format!("{admin}/v1/status")).bearer_auth(TOKEN)).await;
    assert_eq!(code, StatusCode::OK);
    let streams = body["streams"].as_array().unwrap();
    assert_eq!(streams.len(), 2);
    assert!(
        streams.iter().all(|s| s["replay"].is_null()),
        "a refused replay left a trace: {body}"
    );
    assert!(streams
        .iter()
        .all(|s| s["records_known"].as_u64().unwrap() > 0));
    assert_eq!(body["sink"]["name"], "file");
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_requests_are_validated_with_json_errors_naming_the_field() {
    let sim = spawn_small_simulator(2).await;
    let dir = tempfile::tempdir().unwrap();
    let config =
        TestConfig::for_simulator(&sim, dir.path(), &[1]).with_tenant(2, &[Resource::Vouchers]);
    let mut daemon = spawn_daemon(&config).await;
    let admin = daemon.admin_url.clone();
    let http = Client::new();
    let replay = |tenant: &str| http.post(format!("{admin}/v1/tenants/{tenant}/replay"));

    for tenant in ["99", "abc"] {
        let (code, body) = send(replay(tenant)).await;
        assert_eq!(code, StatusCode::NOT_FOUND);
        assert_eq!(
            body,
            json!({"message": format!("tenant `{tenant}` is not streamed by this daemon: configured tenants are 1, 2")})
        );
    }
    let (code, body) = send(replay("1").json(&json!({"resource": "products"}))).await;
    assert_eq!(code, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        body["errors"]["resource"],
        json!(["unknown resource `products`: valid options are vouchers, categories"])
    );
    let (code, body) = send(replay("2").json(&json!({"resource": "categories"}))).await;
    assert_eq!(code, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        body["message"],
        "resource: tenant 2 does not stream categories: configured resources are vouchers"
    );
    let (code, body) = send(replay("1").json(&json!({"since": "last week"}))).await;
    assert_eq!(code, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        body["errors"]["since"][0]
            .as_str()
            .unwrap()
            .contains("RFC 3339"),
        "{body}"
    );
    let (code, body) = send(replay("1").query(&[("since", "2999-01-01")])).await;
    assert_eq!(code, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        body["errors"]["since"],
        json!(["`2999-01-01` is in the future"])
    );
    let (code, body) = send(replay("1").query(&[("tenant", "2")])).await;
    assert_eq!(code, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    let (code, body) = send(replay("1").body("{not json")).await;
    assert_eq!(code, StatusCode::BAD_REQUEST);
    assert!(body["message"]
        .as_str()
        .unwrap()
        .starts_with("request body is not a replay request"));

    let (code, body) = send(replay("1").query(&[("resource", "vouchers"), ("since", "1h")])).await;
    assert_eq!(code, StatusCode::ACCEPTED, "{body}");
    assert_eq!(body["tenant"], 1);
    let replays = body["replays"].as_array().unwrap();
    assert_eq!(replays.len(), 1);
    assert_eq!(replays[0]["resource"], "vouchers");
    assert_eq!(replays[0]["replay_id"].as_str().unwrap().len(), 32);
    assert!(replays[0]["since"].is_string());

    let (code, body) = send(http.get(format!("{admin}/v1/tenants/1/replay"))).await;
    assert_eq!(code, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(
        body,
        json!({"message": "GET is not allowed on /v1/tenants/1/replay: use POST"})
    );
    let (code, body) = send(http.delete(format!("{admin}/v1/status"))).await;
    assert_eq!(code, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(
        body,
        json!({"message": "DELETE is not allowed on /v1/status: use GET"})
    );
    let (code, body) = send(http.get(format!("{admin}/v2/everything"))).await;
    assert_eq!(code, StatusCode::NOT_FOUND);
    assert!(body["message"]
        .as_str()
        .unwrap()
        .starts_with("no such endpoint"));
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_events_dataschema_resolves_to_the_published_schema_without_a_token() {
    let sim = spawn_small_simulator(1).await;
    let dir = tempfile::tempdir().unwrap();
    // Port 0: `dataschema` names the port the admin API really got.
    let config = TestConfig::for_simulator(&sim, dir.path(), &[1]).with_admin_token(TOKEN);
    let mut daemon = spawn_daemon(&config).await;
    let admin = daemon.admin_url.clone();
    wait_until("tenant 1 synced", Duration::from_secs(30), || {
        daemon.events().len() == 25
    })
    .await;
    let http = Client::new();
    let mut resolved = std::collections::BTreeSet::new();
    for event in daemon.events() {
        let uri = event["dataschema"].as_str().unwrap().to_string();
        assert!(uri.starts_with(&format!("{admin}/v1/schemas/")), "{uri}");
        if !resolved.insert(uri.clone()) {
            continue;
        }
        let response = http.get(&uri).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "{uri}");
        assert_eq!(
            response.headers()["content-type"],
            "application/schema+json"
        );
        let name = uri.rsplit('/').next().unwrap();
        let on_disk =
            std::fs::read_to_string(format!("{}/schemas/{name}", env!("CARGO_MANIFEST_DIR")))
                .unwrap();
        assert_eq!(response.text().await.unwrap(), on_disk, "{uri}");
    }
    assert_eq!(resolved.len(), 2, "vouchers and categories: {resolved:?}");
    let (code, body) = send(http.get(format!("{admin}/v1/schemas/nope.json"))).await;
    assert_eq!(code, StatusCode::NOT_FOUND);
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .starts_with("no schema named `nope.json`: valid ones are cloudevent.schema.json"),
        "{body}"
    );
    daemon.stop().await;
}

/// The (method, path) of every `.route(...)` the admin router is built with,
/// read from its source: adding a route without describing it fails the test.
fn routes_in_the_router_source() -> BTreeSet<(String, String)> {
    let source = include_str!("../src/admin.rs");
    let start = source.find("pub fn router(").expect("the router function");
    let router = &source[start..start + source[start..].find("\n}\n").unwrap()];
    let mut routes = BTreeSet::new();
    for call in router.split(".route(\"").skip(1) {
        let (path, rest) = call.split_once('"').unwrap();
        let handlers = &rest[..rest.find('\n').unwrap_or(rest.len())];
        for method in ["get", "post", "put", "patch", "delete"] {
            if handlers.contains(&format!("{method}(")) {
                routes.insert((method.to_string(), path.to_string()));
            }
        }
    }
    routes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_description_names_exactly_the_routes_the_admin_api_serves() {
    let sim = spawn_small_simulator(1).await;
    let dir = tempfile::tempdir().unwrap();
    let config = TestConfig::for_simulator(&sim, dir.path(), &[1]).with_admin_token("doc-token");
    let mut daemon = spawn_daemon(&config).await;
    let admin = daemon.admin_url.clone();
    let http = Client::new();

    let (code, _) = send(http.get(format!("{admin}/v1/openapi.json"))).await;
    assert_eq!(code, StatusCode::UNAUTHORIZED);
    let (code, doc) = send(
        http.get(format!("{admin}/v1/openapi.json"))
            .bearer_auth("doc-token"),
    )
    .await;
    assert_eq!(code, StatusCode::OK);
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."), "{doc}");
    let described: BTreeSet<(String, String)> = doc["paths"]
        .as_object()
        .unwrap()
        .iter()
        .flat_map(|(path, ops)| {
            ops.as_object()
                .unwrap()
                .keys()
                .map(move |method| (method.clone(), path.clone()))
        })
        .collect();
    let served = routes_in_the_router_source();
    assert_eq!(served.len(), 13, "{served:?}");
    assert_eq!(described, served, "described vs. routed");

    // Each described operation reaches a handler, not the fallbacks.
    for (method, path) in &described {
        let url = format!(
            "{admin}{}",
            path.replace("{tenant}", "1")
                .replace("{id}", "00000000000000000000000000000000")
        );
        let request = match method.as_str() {
            "get" => http.get(&url),
            "post" => http.post(&url),
            other => panic!("no client call for {other}"),
        };
        let response = request.bearer_auth("doc-token").send().await.unwrap();
        let status = response.status();
        let body = response.text().await.unwrap();
        assert_ne!(
            status,
            StatusCode::METHOD_NOT_ALLOWED,
            "{method} {path}: {body}"
        );
        assert!(
            !body.contains("no such endpoint"),
            "{method} {path} is described but not served: {body}"
        );
    }
    daemon.stop().await;
}
