//! The `voucher-cdc` command line: parses arguments and hands over to the
//! library. Exit codes: 0 ok, 2 usage or config error, 1 runtime failure.

use std::process::ExitCode;

use clap::Parser;

use voucher_cdc::cli::{self, Cli};

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            // clap prints help/version to stdout and errors to stderr itself.
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let code = runtime.block_on(cli::run(cli));
    ExitCode::from(code)
}
