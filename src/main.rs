#![forbid(unsafe_code)]
//! The binary: parse, set up logging, hand over to the library, exit with its code.

use clap::Parser;
use karpenter_teardown::{cli::Cli, commands, logging};

/// jemalloc instead of the system's malloc: see the dependency's comment in `Cargo.toml`.
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    logging::init(cli.log_format, &cli.log_level);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    let exit = runtime.block_on(commands::execute(cli));
    std::process::ExitCode::from(exit.code())
}
