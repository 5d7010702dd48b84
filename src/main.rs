//! The `voucher-cdc` command line: parses arguments and hands over to the
//! library. Exit codes: 0 ok, 2 usage or config error, 1 runtime failure.

use std::process::ExitCode;

use clap::Parser;

use voucher_cdc::cli::{self, Cli};

fn main() -> ExitCode {
    tune_malloc();
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

/// Tunes glibc's malloc unless its environment variables say otherwise:
///
/// - two arenas (`MALLOC_ARENA_MAX`): glibc's default (eight per core) gives
///   sled's and tokio's threads arenas of their own, each keeping the space
///   its threads freed (about 3 MiB more max RSS on a first sync, session F).
///   One arena holds a few MiB less at three million records (40-48 MiB
///   against 48-53) but costs a JetStream sync 6-36% more CPU, the tokio
///   workers and the NATS client allocating under one lock (docs/performance.md,
///   sessions S, Z and AA);
/// - blocks of 128 KiB and more always mapped (`MALLOC_MMAP_THRESHOLD_`):
///   by default glibc raises that threshold to the size of every large block
///   it frees (up to 32 MiB), after which sled's 512 KiB log buffers, page
///   bodies and staged commits come and go on the heap, which keeps their
///   space: a million-record first sync peaked at 54-86 MiB instead of 44-66
///   (docs/performance.md, session O).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tune_malloc() {
    let settings = [
        ("MALLOC_ARENA_MAX", libc::M_ARENA_MAX, 2),
        ("MALLOC_MMAP_THRESHOLD_", libc::M_MMAP_THRESHOLD, 128 * 1024),
    ];
    for (variable, parameter, value) in settings {
        if std::env::var_os(variable).is_none() {
            // SAFETY: mallopt only sets an allocator parameter, and it runs
            // before any other thread exists.
            #[allow(unsafe_code)]
            unsafe {
                libc::mallopt(parameter, value);
            }
        }
    }
}

/// Other allocators keep their defaults.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_malloc() {}
