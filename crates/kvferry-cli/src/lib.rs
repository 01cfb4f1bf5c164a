//! `kvferry`: the command-line front of the kvferry transfer engine, as a library.
//!
//! The `kvferry` binary (src/main.rs) and the Python extension (`kvferry._kvferry.cli_main`,
//! behind the wheel's `kvferry` console script and `python -m kvferry`) both call
//! [`main_with_args`], so a `pip install kvferry` carries every subcommand in the one native
//! library it already ships.
//!
//! - `kvferry bench`: two processes on 127.0.0.1 move data through the engine; prints
//!   throughput, latency and CPU cost beside the machine's ceilings (and Mooncake's, when its
//!   `transfer_engine_bench` is installed).
//! - `kvferry doctor`: what this host can do, and why not.
//! - `kvferry master`: the store's metadata master; `kvferry store-bench`: the store measured.
//! - `kvferry store-client`: Mooncake's `mooncake_client`, a process contributing a segment.
//! - `kvferry metadata-server`: Mooncake's HTTP metadata service, optionally durable;
//!   `kvferry metadata-bench`: it beside Mooncake's, and open_segment per backend.

mod bench;
pub mod doctor;
mod master;
mod master_flags;
mod master_http;
mod metadata_bench;
mod metadata_server;
mod mooncake;
mod peers;
mod store_bench;
mod store_client;
mod sys;

use clap::{CommandFactory, FromArgMatches, Subcommand};
use std::ffi::OsString;

#[derive(clap::Parser)]
#[command(
    name = "kvferry",
    version,
    about = "KV-cache transfer engine (Mooncake-compatible)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Measure transfers between a target and an initiator (two processes on 127.0.0.1 by default).
    Bench(bench::BenchArgs),
    /// Check what this host can do: addresses, ports, memlock, transports.
    Doctor(doctor::DoctorArgs),
    /// Run the store's master (metadata only: segments, objects, leases, eviction).
    #[command(
        after_help = "mooncake_master's spellings are accepted too: --rpc_port=50051, -rpc_port 50051, --rpc_address, \
--enable_http_metadata_server, every flag with underscores; Mooncake flags kvferry lacks are warned about or refused by name."
    )]
    Master(master::MasterArgs),
    /// Measure the store: a master and two clients on 127.0.0.1, every value checked.
    StoreBench(store_bench::StoreBenchArgs),
    /// Contribute memory to the store (Mooncake's mooncake_client): mount a segment at the
    /// master and serve it until SIGTERM/SIGINT, then unmount.
    #[command(
        after_help = "mooncake_client's spellings are accepted too: --master_server_address=127.0.0.1:50051, \
--global_segment_size=\"4 GB\", --metadata_server, --host, --protocol, --port (the dummy-client service), every flag with \
underscores; Mooncake flags kvferry lacks are warned about or refused by name."
    )]
    StoreClient(store_client::StoreClientArgs),
    /// Serve Mooncake's HTTP metadata contract (GET/PUT/DELETE /metadata?key=, /health).
    MetadataServer(metadata_server::ServerArgs),
    /// Measure the metadata server against Mooncake's, and open_segment for each backend.
    MetadataBench(metadata_bench::MetadataBenchArgs),
}

/// How this program starts another copy of itself (bench targets, the doctor's probe, the
/// store-bench pool): the binary's own path by default; the Python entry point sets
/// `[sys.executable, "-m", "kvferry"]`, since its executable is the Python interpreter.
static SELF_COMMAND: std::sync::OnceLock<Vec<OsString>> = std::sync::OnceLock::new();

/// A `Command` that runs this program (see [`SELF_COMMAND`]), ready for subcommand arguments.
pub(crate) fn self_command() -> Result<std::process::Command, String> {
    match SELF_COMMAND.get().and_then(|v| v.split_first()) {
        Some((prog, args)) => {
            let mut c = std::process::Command::new(prog);
            c.args(args);
            Ok(c)
        }
        None => {
            let exe = std::env::current_exe().map_err(|e| {
                format!("cannot find own executable to start a child copy of kvferry: {e}")
            })?;
            Ok(std::process::Command::new(exe))
        }
    }
}

/// Runs `kvferry` with `args` (`args[0]` is the program name, as in `std::env::args_os`) and
/// returns the exit status: 0 on success, 1 when the subcommand fails, 2 on a usage error.
/// `self_command`: how to start another copy of this program for subcommands that need one
/// (None: this executable); the first call in a process decides it.
///
/// Signals are left as the caller has them: the binary has the default handlers, so Ctrl-C
/// and SIGTERM end a `kvferry master` at once (as they end `mooncake_master`); an embedder must
/// do the same (Python's `kvferry.__main__` restores SIGINT's default before calling this).
pub fn main_with_args_as(args: Vec<OsString>, self_command: Option<Vec<OsString>>) -> i32 {
    if let Some(c) = self_command.filter(|c| !c.is_empty()) {
        let _ = SELF_COMMAND.set(c);
    }
    let filter = std::env::var("KVFERRY_LOG")
        .or_else(|_| std::env::var("MC_LOG_LEVEL"))
        .map(|s| s.to_lowercase())
        .unwrap_or_else(|_| "warn".into());
    // try_init: an embedding process (the Python extension) may have installed one already.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&filter)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let mut argv = args;
    if argv.is_empty() {
        argv.push("kvferry".into());
    }
    let gflags = match argv.get(1).and_then(|a| a.to_str()) {
        Some("master") => Some((&master_flags::MASTER, master::known_flags())),
        Some("store-client") => Some((&master_flags::STORE_CLIENT, store_client::known_flags())),
        _ => None,
    };
    if let Some((spec, known)) = gflags {
        // Mooncake's mooncake_master / mooncake_client spellings (gflags) next to kvferry's own.
        match master_flags::normalize_for(spec, &argv[2..], &known) {
            Ok(n) => {
                for w in &n.warnings {
                    eprintln!("{w}");
                }
                argv.truncate(2);
                argv.extend(n.args);
            }
            Err(e) => {
                eprintln!("kvferry {}: error: {e}", argv[1].to_string_lossy());
                return 2;
            }
        }
    }
    let parsed = Cli::command()
        .try_get_matches_from(argv)
        .and_then(|m| Cli::from_arg_matches(&m).map(|c| (m, c)));
    let (matches, cli) = match parsed {
        Ok(p) => p,
        Err(e) => {
            // --help and --version land here too (exit status 0), as clap's own exit() does.
            let _ = e.print();
            return e.exit_code();
        }
    };
    let r = match cli.cmd {
        Cmd::Bench(a) => bench::run(a),
        Cmd::Doctor(a) => doctor::run(a),
        Cmd::Master(a) => master::run(a, matches.subcommand_matches("master").unwrap_or(&matches)),
        Cmd::StoreBench(a) => store_bench::run(a),
        Cmd::StoreClient(a) => store_client::run(a),
        Cmd::MetadataServer(a) => metadata_server::run(a),
        Cmd::MetadataBench(a) => metadata_bench::run(a),
    };
    use std::io::Write;
    let _ = std::io::stdout().flush();
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("kvferry: error: {e}");
            1
        }
    }
}

/// [`main_with_args_as`] with this executable as the program's own command.
pub fn main_with_args(args: Vec<OsString>) -> i32 {
    main_with_args_as(args, None)
}
