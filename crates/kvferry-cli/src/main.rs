//! `kvferry`: the command-line front of the kvferry transfer engine.
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
mod doctor;
mod master;
mod master_flags;
mod master_http;
mod metadata_bench;
mod metadata_server;
mod mooncake;
mod store_bench;
mod store_client;
mod sys;

use clap::{CommandFactory, FromArgMatches, Subcommand};

#[derive(clap::Parser)]
#[command(name = "kvferry", version, about = "KV-cache transfer engine (Mooncake-compatible)")]
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
    #[command(after_help = "mooncake_master's spellings are accepted too: --rpc_port=50051, -rpc_port 50051, --rpc_address, \
--enable_http_metadata_server, every flag with underscores; Mooncake flags kvferry lacks are warned about or refused by name.")]
    Master(master::MasterArgs),
    /// Measure the store: a master and two clients on 127.0.0.1, every value checked.
    StoreBench(store_bench::StoreBenchArgs),
    /// Contribute memory to the store (Mooncake's mooncake_client): mount a segment at the
    /// master and serve it until SIGTERM/SIGINT, then unmount.
    #[command(after_help = "mooncake_client's spellings are accepted too: --master_server_address=127.0.0.1:50051, \
--global_segment_size=\"4 GB\", --metadata_server, --host, --protocol, every flag with underscores; Mooncake flags kvferry lacks \
(--port, --threads: the dummy-client service) are warned about or refused by name.")]
    StoreClient(store_client::StoreClientArgs),
    /// Serve Mooncake's HTTP metadata contract (GET/PUT/DELETE /metadata?key=, /health).
    MetadataServer(metadata_server::ServerArgs),
    /// Measure the metadata server against Mooncake's, and open_segment for each backend.
    MetadataBench(metadata_bench::MetadataBenchArgs),
}

fn main() {
    let filter = std::env::var("KVFERRY_LOG")
        .or_else(|_| std::env::var("MC_LOG_LEVEL"))
        .map(|s| s.to_lowercase())
        .unwrap_or_else(|_| "warn".into());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&filter).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")))
        .with_writer(std::io::stderr)
        .init();
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
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
                std::process::exit(2);
            }
        }
    }
    let matches = Cli::command().get_matches_from(argv);
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => e.exit(),
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
    if let Err(e) = r {
        eprintln!("kvferry: error: {e}");
        std::process::exit(1);
    }
}
