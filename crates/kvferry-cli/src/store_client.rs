//! `kvferry store-client`: Mooncake's `mooncake_client` (real client) as a process. It
//! connects to a master, contributes `--global_segment_size` bytes as a segment (mounted at
//! the master; peers write and read it through this process's transfer engine), prints what
//! it mounted, and stays up until SIGTERM or SIGINT, then unmounts and exits 0.
//!
//! Mooncake's dummy-client service (`--port`: local processes calling `setup_dummy` and
//! sharing memory with this process) is not provided; local processes call `setup()` with
//! `global_segment_size=0` against the same master instead.

use crate::sys::human;
use kvferry_store::{Client, ClientConfig};
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args, Clone)]
pub struct StoreClientArgs {
    /// This host's address as peers reach it, `host` or `host:port` (Mooncake: --host; a bare
    /// host gets a port appended in central metadata mode, as Mooncake does).
    #[arg(long, visible_alias = "local-hostname", default_value = "127.0.0.1")]
    pub host: String,
    /// Transfer-engine metadata: `P2PHANDSHAKE`, or a metadata server URL such as
    /// `http://127.0.0.1:8080/metadata` (Mooncake: --metadata_server).
    #[arg(long, default_value = "P2PHANDSHAKE")]
    pub metadata_server: String,
    /// The master, `host:port` (Mooncake: --master_server_address).
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub master_server_address: String,
    /// Memory contributed to the pool: bytes, or with a unit as Mooncake reads it (4GB,
    /// "512 MB", 1.5G, 2TB; binary multiples).
    #[arg(long, default_value = "4 GB")]
    pub global_segment_size: String,
    /// Staging memory for this process's own bytes API (a size like --global-segment-size); 0,
    /// the default, is enough to serve.
    #[arg(long, default_value = "0")]
    pub local_buffer_size: String,
    /// `tcp` (`rdma` is accepted; data moves over TCP).
    #[arg(long, default_value = "tcp")]
    pub protocol: String,
    /// Device names (Mooncake: --device_names); unused by the TCP transport.
    #[arg(long, default_value = "")]
    pub device_names: String,
}

/// kvferry's long flag names (and their aliases) for the gflags rewriting.
pub fn known_flags() -> Vec<String> {
    #[derive(clap::Parser)]
    struct Wrap {
        #[command(flatten)]
        a: StoreClientArgs,
    }
    use clap::CommandFactory;
    let mut out = Vec::new();
    for a in Wrap::command().get_arguments() {
        out.extend(a.get_long().map(str::to_string));
        out.extend(a.get_all_aliases().unwrap_or_default().into_iter().map(str::to_string));
    }
    out
}

/// Sets the returned value to the number of the signal (SIGTERM or SIGINT) that asks this
/// process to stop (0: none yet).
fn install_handlers() -> Result<Arc<AtomicUsize>, String> {
    let stop = Arc::new(AtomicUsize::new(0));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register_usize(sig, Arc::clone(&stop), sig as usize)
            .map_err(|e| format!("cannot install the handler of signal {sig}: {e}"))?;
    }
    Ok(stop)
}

/// A size as Mooncake's `string_to_byte_size` reads it: a decimal number, optionally followed
/// by B, K/KB, M/MB, G/GB or T/TB (binary multiples, any case; KiB, MiB, GiB, TiB too).
fn parse_mooncake_size(v: &str) -> Result<u64, String> {
    let t = v.trim();
    let end = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let num: f64 = t[..end].parse().map_err(|_| format!("{v:?} is not a size (examples: 4GB, \"512 MB\", 1.5G, 1048576)"))?;
    let mult: f64 = match t[end..].trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1.0,
        "K" | "KB" | "KIB" => 1024.0,
        "M" | "MB" | "MIB" => 1024.0 * 1024.0,
        "G" | "GB" | "GIB" => 1024.0 * 1024.0 * 1024.0,
        "T" | "TB" | "TIB" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        u => return Err(format!("{v:?}: unknown unit {u:?} (use B, KB, MB, GB or TB)")),
    };
    let bytes = num * mult;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("{v:?} is too large"));
    }
    Ok(bytes as u64)
}

fn size(flag: &str, v: &str) -> Result<u64, String> {
    parse_mooncake_size(v).map_err(|e| format!("--{flag}: {e}"))
}

pub fn run(a: StoreClientArgs) -> Result<(), String> {
    let global = size("global_segment_size", &a.global_segment_size)?;
    let local = size("local_buffer_size", &a.local_buffer_size)?;
    if global == 0 {
        return Err("--global_segment_size is 0: a store-client contributes memory; pass a size (e.g. 4GB). A process that only reads and writes calls setup() with global_segment_size=0 itself".into());
    }
    // Before setup: a signal that arrives while mounting is acted on once mounted.
    let stop = install_handlers()?;
    let cfg = ClientConfig {
        local_hostname: a.host.clone(),
        metadata_server: a.metadata_server.clone(),
        global_segment_size: global,
        local_buffer_size: local,
        protocol: a.protocol.clone(),
        device_name: a.device_names.clone(),
        master_server_addr: a.master_server_address.clone(),
        ..ClientConfig::default()
    };
    let c = Client::setup(cfg).map_err(|e| format!("setting up the store client (master {}): {e}", a.master_server_address))?;
    println!("KVFERRY_STORE_CLIENT segment={} size={} master={} metadata={}", c.segment_name(), global, a.master_server_address, a.metadata_server);
    let _ = std::io::stdout().flush();
    eprintln!(
        "kvferry store-client: mounted segment {} ({}) at master {}; serving until SIGTERM or SIGINT",
        c.segment_name(),
        human(global),
        a.master_server_address
    );
    while stop.load(Ordering::SeqCst) == 0 {
        std::thread::sleep(Duration::from_millis(50));
    }
    let sig = stop.load(Ordering::SeqCst);
    let name = c.segment_name().to_string();
    c.close().map_err(|e| format!("unmounting segment {name} at master {} (signal {sig}): {e}", a.master_server_address))?;
    drop(c);
    println!("KVFERRY_STORE_CLIENT unmounted segment={name} signal={sig}");
    let _ = std::io::stdout().flush();
    eprintln!("kvferry store-client: signal {sig}: unmounted segment {name}; exiting");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_mooncake_size as p;

    #[test]
    fn sizes_as_mooncake_reads_them() {
        assert_eq!(p("4 GB"), Ok(4 << 30));
        assert_eq!(p("1.5 GB"), Ok(3 << 29));
        assert_eq!(p("16mb"), Ok(16 << 20));
        assert_eq!(p("512M"), Ok(512 << 20));
        assert_eq!(p("2T"), Ok(2 << 40));
        assert_eq!(p("1GiB"), Ok(1 << 30));
        assert_eq!(p("1048576"), Ok(1 << 20));
        assert_eq!(p(" 0 "), Ok(0));
        for bad in ["", "GB", "-1", "4 XB", "1e3", "99999999999T"] {
            assert!(p(bad).is_err(), "{bad:?}");
        }
    }
}
