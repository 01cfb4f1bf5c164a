//! `kvferry`: the command-line front of the kvferry transfer engine.
//!
//! - `kvferry bench`: two processes on 127.0.0.1 move data through the engine; prints
//!   throughput, latency and CPU cost beside the machine's ceilings (and Mooncake's, when its
//!   `transfer_engine_bench` is installed).
//! - `kvferry doctor`: what this host can do, and why not.

mod bench;
mod doctor;
mod mooncake;
mod sys;

use clap::{Parser, Subcommand};

#[derive(Parser)]
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
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Bench(a) => bench::run(a),
        Cmd::Doctor(a) => doctor::run(a),
    };
    if let Err(e) = r {
        eprintln!("kvferry: error: {e}");
        std::process::exit(1);
    }
}
