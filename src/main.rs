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
    // Everything is flushed by now (state store, sink, stdout). Exit without
    // tearing the runtime down: worker threads running their thread-local
    // destructors during teardown can abort the process (seen as a rare
    // "thread local panicked on drop" from sled's epoch GC after SIGTERM),
    // which would turn a clean stop into a crash exit code.
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    std::process::exit(i32::from(code))
}
