//! `kvferry store-client`: Mooncake's `mooncake_client` (real client) as a process. It
//! connects to a master, contributes `--global_segment_size` bytes as a segment (mounted at
//! the master; peers write and read it through this process's transfer engine), prints what
//! it mounted, and stays up until SIGTERM or SIGINT, then unmounts and exits 0.
//!
//! `--port` (Mooncake's, default 50052) is the dummy-client service: a process on this host
//! that calls `setup_dummy(mem_pool_size, local_buffer_size, "127.0.0.1:50052")` learns here
//! which master, metadata service and protocol this process uses, and joins the same pool as
//! a client that contributes no memory (its values land in this process's segment and the
//! pool's others). Unlike Mooncake's dummy clients it then moves bytes with its own transfer
//! engine (same-host shared memory or TCP) rather than through this process, so a dummy
//! client costs this process nothing per request. The service's protocol (kvferry's own: a
//! stock Mooncake dummy client cannot use it, nor a kvferry one a `mooncake_client`): the
//! client sends the line `KVFERRY-DUMMY 1`, the answer is one JSON line
//! ([`DummyInfo`]) and the connection closes; anything else is answered
//! `{"error": ...}`. It listens on 127.0.0.1 (and on `--host` when that is another IP
//! address), answers each connection from a short-lived thread (at most
//! [`MAX_DUMMY_CONNS`] at once) and gives a silent client [`DUMMY_IO_TIMEOUT`].

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
    /// `tcp`, or `rdma`: RDMA only (an RDMA segment descriptor; fails, saying why, on a host
    /// without a usable RDMA NIC).
    #[arg(long, default_value = "tcp")]
    pub protocol: String,
    /// Device names (Mooncake: --device_names): the RDMA NICs to use, comma-separated (empty:
    /// every NIC with an active port).
    #[arg(long, default_value = "")]
    pub device_names: String,
    /// Port of the dummy-client service on 127.0.0.1 (Mooncake's real-client port;
    /// `setup_dummy(..., server_address="127.0.0.1:<port>")` connects here); 0 turns it off.
    #[arg(long, default_value_t = 50052)]
    pub port: u16,
    /// A disk tier (Mooncake's --enable_offload): with a master run with --enable_offload,
    /// what it evicts from this segment is kept on this host's disk, in
    /// MOONCAKE_OFFLOAD_FILE_STORAGE_PATH (size limit MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES),
    /// and gets read it back through this process.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub enable_offload: bool,
}

/// What a dummy client learns from the service: the pool to join and how.
#[derive(serde::Serialize, serde::Deserialize, Debug, Clone, PartialEq)]
pub struct DummyInfo {
    pub version: u32,
    pub master_server_address: String,
    pub metadata_server: String,
    pub protocol: String,
    /// The host dummy clients use as their `local_hostname` (this process's `--host`
    /// without a port: they are on the same host).
    pub host: String,
    /// This process's segment (for `ReplicateConfig.preferred_segment`).
    pub segment: String,
}

/// The request line of the dummy-client service.
pub const DUMMY_HELLO: &str = "KVFERRY-DUMMY 1";
/// Connections the dummy-client service answers at once; more are closed unanswered.
pub const MAX_DUMMY_CONNS: usize = 32;
/// How long the service waits for a client's request line (and to send the answer).
pub const DUMMY_IO_TIMEOUT: Duration = Duration::from_secs(2);

/// The answer to one request line (sans-IO: the service only moves these bytes).
pub fn dummy_answer(request: &[u8], info: &DummyInfo) -> String {
    let line = String::from_utf8_lossy(request);
    let line = line.trim_end_matches(['\r', '\n']);
    let body = if line == DUMMY_HELLO {
        serde_json::to_string(info).unwrap_or_else(|e| {
            serde_json::json!({ "error": format!("cannot encode the answer: {e}") }).to_string()
        })
    } else {
        let shown: String = line.chars().take(40).collect();
        serde_json::json!({ "error": format!("not a kvferry dummy-client request ({shown:?}); send {DUMMY_HELLO:?} (kvferry's setup_dummy does)") }).to_string()
    };
    body + "\n"
}

/// Reads one request line (at most 256 bytes, within [`DUMMY_IO_TIMEOUT`]) and answers it.
fn serve_dummy_conn(mut s: std::net::TcpStream, info: &DummyInfo) {
    use std::io::Read;
    let _ = s.set_read_timeout(Some(DUMMY_IO_TIMEOUT));
    let _ = s.set_write_timeout(Some(DUMMY_IO_TIMEOUT));
    let deadline = std::time::Instant::now() + DUMMY_IO_TIMEOUT;
    let mut buf = Vec::with_capacity(64);
    let mut chunk = [0u8; 256];
    // Until a newline, EOF, 256 bytes or the deadline (checked after every read: a client
    // trickling bytes cannot hold the thread longer).
    while !buf.contains(&b'\n') && buf.len() < 256 && std::time::Instant::now() < deadline {
        match s.read(&mut chunk[..256 - buf.len()]) {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let end = buf.iter().position(|&b| b == b'\n').unwrap_or(buf.len());
    let _ = s.write_all(dummy_answer(&buf[..end], info).as_bytes());
}

/// Starts the dummy-client service on `addrs` (`port` each); the listeners live as long as
/// the process. Errors name the port and the flag.
fn start_dummy_service(
    addrs: &[std::net::IpAddr],
    port: u16,
    info: DummyInfo,
) -> Result<(), String> {
    let info = Arc::new(info);
    for ip in addrs {
        let l = std::net::TcpListener::bind((*ip, port)).map_err(|e| {
            format!("cannot listen on {ip}:{port} for dummy clients: {e} (another store-client on this host? pass another --port, or --port 0 to serve none)")
        })?;
        let info = Arc::clone(&info);
        let live = Arc::new(AtomicUsize::new(0));
        std::thread::Builder::new()
            .name("kvf-dummy-svc".into())
            .spawn(move || {
                for conn in l.incoming() {
                    let Ok(conn) = conn else {
                        // EMFILE and the like: back off instead of spinning.
                        std::thread::sleep(Duration::from_millis(50));
                        continue;
                    };
                    if live.fetch_add(1, Ordering::AcqRel) >= MAX_DUMMY_CONNS {
                        live.fetch_sub(1, Ordering::AcqRel);
                        continue; // dropped: closed unanswered
                    }
                    let (info, live) = (Arc::clone(&info), Arc::clone(&live));
                    let spawned = std::thread::Builder::new()
                        .name("kvf-dummy-conn".into())
                        .spawn(move || {
                            serve_dummy_conn(conn, &info);
                            live.fetch_sub(1, Ordering::AcqRel);
                        });
                    if spawned.is_err() {
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            })
            .map_err(|e| format!("cannot start the dummy-client service thread: {e}"))?;
    }
    Ok(())
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
        out.extend(
            a.get_all_aliases()
                .unwrap_or_default()
                .into_iter()
                .map(str::to_string),
        );
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
    let end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let num: f64 = t[..end]
        .parse()
        .map_err(|_| format!("{v:?} is not a size (examples: 4GB, \"512 MB\", 1.5G, 1048576)"))?;
    let mult: f64 = match t[end..].trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1.0,
        "K" | "KB" | "KIB" => 1024.0,
        "M" | "MB" | "MIB" => 1024.0 * 1024.0,
        "G" | "GB" | "GIB" => 1024.0 * 1024.0 * 1024.0,
        "T" | "TB" | "TIB" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        u => {
            return Err(format!(
                "{v:?}: unknown unit {u:?} (use B, KB, MB, GB or TB)"
            ))
        }
    };
    let bytes = num * mult;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("{v:?} is too large"));
    }
    Ok(bytes as u64)
}

/// `host` of `host`, `host:port` or `[v6]:port`.
fn host_part(h: &str) -> &str {
    if let Some(rest) = h.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match h.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') && port.parse::<u16>().is_ok() => host,
        _ => h,
    }
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
    let mut cfg = cfg;
    if a.enable_offload {
        cfg.enable_ssd_offload("", &|k| std::env::var(k).ok())
            .map_err(|e| format!("--enable_offload: {e}"))?;
    }
    let c = Client::setup(cfg).map_err(|e| {
        format!(
            "setting up the store client (master {}): {e}",
            a.master_server_address
        )
    })?;
    if a.port != 0 {
        // Dummy clients are on this host: 127.0.0.1, and --host's address when it is another IP.
        let host = host_part(&a.host);
        let mut ips = vec![std::net::IpAddr::from([127, 0, 0, 1])];
        if let Ok(ip) = host.parse::<std::net::IpAddr>() {
            if !ip.is_loopback() && !ip.is_unspecified() {
                ips.push(ip);
            }
        }
        let info = DummyInfo {
            version: 1,
            master_server_address: a.master_server_address.clone(),
            metadata_server: a.metadata_server.clone(),
            protocol: a.protocol.clone(),
            host: if host.is_empty() || host == "0.0.0.0" {
                "127.0.0.1".into()
            } else {
                host.to_string()
            },
            segment: c.segment_name().to_string(),
        };
        if let Err(e) = start_dummy_service(&ips, a.port, info) {
            let _ = c.close();
            return Err(e);
        }
        eprintln!("kvferry store-client: dummy clients: setup_dummy(..., server_address=\"127.0.0.1:{}\")", a.port);
    }
    let dummy = if a.port == 0 {
        "off".to_string()
    } else {
        format!("127.0.0.1:{}", a.port)
    };
    println!(
        "KVFERRY_STORE_CLIENT segment={} size={} master={} metadata={} dummy={dummy}",
        c.segment_name(),
        global,
        a.master_server_address,
        a.metadata_server
    );
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
    c.close().map_err(|e| {
        format!(
            "unmounting segment {name} at master {} (signal {sig}): {e}",
            a.master_server_address
        )
    })?;
    drop(c);
    println!("KVFERRY_STORE_CLIENT unmounted segment={name} signal={sig}");
    let _ = std::io::stdout().flush();
    eprintln!("kvferry store-client: signal {sig}: unmounted segment {name}; exiting");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_mooncake_size as p;
    use super::*;

    fn info() -> DummyInfo {
        DummyInfo {
            version: 1,
            master_server_address: "127.0.0.1:50051".into(),
            metadata_server: "P2PHANDSHAKE".into(),
            protocol: "tcp".into(),
            host: "127.0.0.1".into(),
            segment: "127.0.0.1:4242".into(),
        }
    }

    #[test]
    fn the_dummy_service_answers_its_request_line_and_nothing_else() {
        let ok = dummy_answer(DUMMY_HELLO.as_bytes(), &info());
        assert!(ok.ends_with('\n'));
        let back: DummyInfo = serde_json::from_str(ok.trim_end()).unwrap();
        assert_eq!(back, info());
        assert_eq!(dummy_answer(b"KVFERRY-DUMMY 1\r", &info()), ok);
        for bad in [
            &b""[..],
            b"KVFERRY-DUMMY 2",
            b"\x00\x01coro_rpc",
            &[0xff; 300],
        ] {
            let a = dummy_answer(bad, &info());
            let v: serde_json::Value = serde_json::from_str(a.trim_end()).unwrap();
            assert!(
                v["error"].as_str().unwrap().contains("KVFERRY-DUMMY 1"),
                "{a}"
            );
        }
    }

    #[test]
    fn host_part_strips_a_port() {
        assert_eq!(host_part("10.0.0.1:1234"), "10.0.0.1");
        assert_eq!(host_part("10.0.0.1"), "10.0.0.1");
        assert_eq!(host_part("[::1]:80"), "::1");
        assert_eq!(host_part("::1"), "::1");
        assert_eq!(host_part("node-3"), "node-3");
    }

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
