//! `voucher-cdc demo`: the simulator, a background mutator and the bridge in
//! one process, events to stdout and state in a temporary directory, so a
//! fresh machine shows change events within seconds and needs no service.

use std::future::Future;
use std::io::Write;
use std::path::Path;

use anyhow::Context;

use crate::config::{self, Config};
use crate::daemon::Daemon;
use crate::simulator::{Simulator, SimulatorOptions};

/// The token the demo simulator grants and the demo bridge uses.
const DEMO_TOKEN: &str = "demo-token";

/// What the demo simulates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DemoOptions {
    /// Tenants, numbered 1..=N.
    pub tenants: u64,
    /// Catalog vouchers per tenant.
    pub vouchers: usize,
    /// Catalog categories per tenant.
    pub categories: usize,
    /// Background changes per minute over all tenants.
    pub changes_per_minute: u32,
}

impl Default for DemoOptions {
    fn default() -> Self {
        Self {
            tenants: 2,
            vouchers: 60,
            categories: 8,
            changes_per_minute: 30,
        }
    }
}

/// The bridge config of the demo: every simulator tenant, stdout sink, a 2s
/// poll and a 30s full resync, admin API on a free loopback port.
pub fn demo_config(base_url: &str, tenants: u64, state_dir: &Path) -> Result<Config, String> {
    let mut toml = format!(
        r#"
[upstream]
base_url = "{base_url}"
token = "{DEMO_TOKEN}"
requests_per_minute = 6000

[poll]
interval = "2s"
full_resync_interval = "30s"
lookback = "5s"
shutdown_timeout = "5s"

[state]
path = {state}

[sink]
kind = "stdout"

[admin]
listen = "127.0.0.1:0"
"#,
        state = toml_string(&state_dir.join("state").display().to_string()),
    );
    for tenant in 1..=tenants {
        toml.push_str(&format!("\n[[tenants]]\nid = {tenant}\n"));
    }
    config::from_toml_str(&toml).map_err(|e| e.to_string())
}

/// A TOML basic string holding `text`.
fn toml_string(text: &str) -> String {
    toml::Value::String(text.to_string()).to_string()
}

/// The banner the demo prints on stderr.
pub fn banner(options: &DemoOptions, simulator_url: &str, daemon: &Daemon) -> String {
    let admin = daemon.admin_url();
    format!(
        "voucher-cdc demo\n\
         \x20 simulator  {simulator_url}\n\
         \x20            {}, {} and {} each, ~{} changes/min\n\
         \x20 bridge     polls every 2s, full resync every 30s, state in a temporary directory\n\
         \x20 events     stdout, one CloudEvent JSON per line (logs and this banner go to stderr)\n\
         \x20 admin      {admin}/metrics  {admin}/v1/status  {admin}/readyz\n\
         \x20 Ctrl-C stops.\n",
        crate::cli::plural(options.tenants, "tenant"),
        crate::cli::plural(options.vouchers as u64, "voucher"),
        crate::cli::plural(options.categories as u64, "category"),
        options.changes_per_minute,
    )
}

/// Runs the demo until `shutdown` completes.
pub async fn run(
    options: DemoOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let simulator = Simulator::start(SimulatorOptions {
        listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        tenants: options.tenants,
        vouchers: options.vouchers,
        categories: options.categories,
        changes_per_minute: options.changes_per_minute,
        token: DEMO_TOKEN.to_string(),
        rate_limit: 0,
        ..SimulatorOptions::default()
    })
    .await
    .context("starting the demo simulator")?;
    let state_dir = tempfile::Builder::new()
        .prefix("voucher-cdc-demo-")
        .tempdir()
        .context("creating the demo state directory")?;
    let config = demo_config(&simulator.base_url(), options.tenants, state_dir.path())
        .map_err(|e| anyhow::anyhow!("demo config: {e}"))?;
    let daemon = Daemon::build(&config)
        .await
        .context("starting the demo bridge")?;
    let _ =
        std::io::stderr().write_all(banner(&options, &simulator.base_url(), &daemon).as_bytes());
    let result = daemon.run_until_stopped(shutdown).await;
    simulator.shutdown().await;
    drop(state_dir);
    result.context("demo bridge")?;
    let _ = std::io::stderr().write_all(b"voucher-cdc demo stopped\n");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_demo_config_is_valid_and_streams_every_tenant_to_stdout() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = demo_config("http://127.0.0.1:1/api/external/v1", 2, dir.path()).unwrap();
        assert_eq!(cfg.sink.kind(), crate::config::SinkKind::Stdout);
        assert_eq!(cfg.all_streams().len(), 4);
        assert_eq!(cfg.poll.interval.as_secs(), 2);
        assert!(cfg.state.path.starts_with(dir.path()));
    }
}
