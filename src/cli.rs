//! Command definitions (clap) and their dispatch. Each command returns the
//! process exit code: 0 ok, 2 usage or config error, 1 runtime failure.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::simulator::SimulateArgs;
use crate::stream::{Resource, TenantId};

/// Exit code for success.
pub const EXIT_OK: u8 = 0;
/// Exit code for a runtime failure.
pub const EXIT_FAILURE: u8 = 1;
/// Exit code for a usage or configuration error.
pub const EXIT_USAGE: u8 = 2;

/// voucher-cdc: change-data-capture from the External Voucher API to Kafka / NATS JetStream.
#[derive(Debug, Parser)]
#[command(name = "voucher-cdc", version, about, propagate_version = true)]
pub struct Cli {
    /// The command to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The commands of DESIGN.md's CLI table.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the bridge daemon.
    Run {
        /// Config file (TOML); env `VOUCHER_CDC_*` overrides it.
        #[arg(long, short, env = "VOUCHER_CDC_CONFIG")]
        config: Option<PathBuf>,
        /// Sweep every stream once, then exit.
        #[arg(long)]
        once: bool,
    },
    /// Simulator + bridge in one process, events to stdout; Ctrl-C stops.
    Demo {
        /// Tenants the demo simulator serves.
        #[arg(long, default_value_t = 2)]
        tenants: u64,
        /// Vouchers per tenant.
        #[arg(long, default_value_t = 60)]
        vouchers: usize,
        /// Categories per tenant.
        #[arg(long, default_value_t = 8)]
        categories: usize,
        /// Background changes per minute.
        #[arg(long, default_value_t = 30)]
        changes_per_minute: u32,
    },
    /// Serve the upstream API simulator alone.
    Simulate(SimulateArgs),
    /// Per stream: watermark, records known, last sweep, lag, last error.
    Status {
        /// Config file (TOML).
        #[arg(long, short, env = "VOUCHER_CDC_CONFIG")]
        config: Option<PathBuf>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Schedule a replay of a tenant.
    Replay {
        /// The tenant to replay.
        #[arg(long)]
        tenant: TenantId,
        /// Only this resource (default: every resource of the tenant).
        #[arg(long)]
        resource: Option<Resource>,
        /// Replay records updated since this time (RFC 3339) instead of everything.
        #[arg(long)]
        since: Option<String>,
        /// Config file (TOML).
        #[arg(long, short, env = "VOUCHER_CDC_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Validate and print the effective config, secrets redacted.
    CheckConfig {
        /// Config file (TOML).
        #[arg(long, short, env = "VOUCHER_CDC_CONFIG")]
        config: Option<PathBuf>,
    },
}

/// Runs a parsed command line and returns its exit code.
pub async fn run(cli: Cli) -> u8 {
    match cli.command {
        Command::CheckConfig { config } => match crate::config::load(config.as_deref()) {
            Ok(cfg) => {
                print!("{}", cfg.redacted_toml());
                EXIT_OK
            }
            Err(e) => {
                for p in &e.problems {
                    eprintln!("error: {p}");
                }
                EXIT_USAGE
            }
        },
        Command::Simulate(args) => {
            crate::telemetry::init_logging(crate::telemetry::LogFormat::Pretty, "info");
            match crate::simulator::run(args, shutdown_signal()).await {
                Ok(()) => EXIT_OK,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    EXIT_FAILURE
                }
            }
        }
        _ => {
            eprintln!("error: this command is not available yet");
            EXIT_FAILURE
        }
    }
}

/// Completes on SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
