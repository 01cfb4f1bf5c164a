//! `kvferry master`: the store's metadata master.

use kvferry_store::master::{Master, MasterConfig, Strategy};
use kvferry_store::server::MasterServer;
use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args, Clone)]
pub struct MasterArgs {
    /// Address the RPC and HTTP listeners bind (Mooncake: --rpc_address).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// RPC port (Mooncake: --rpc_port); 0 picks a free one (printed).
    #[arg(long, default_value_t = 50051)]
    pub port: u16,
    /// HTTP port for /metrics, /health, /query_key, /get_all_segments (Mooncake: --metrics_port); 0 picks one, -1 disables.
    #[arg(long, default_value_t = 9003, allow_negative_numbers = true)]
    pub metrics_port: i32,
    /// Read lease granted by get/exist, in milliseconds (Mooncake: --default_kv_lease_ttl).
    #[arg(long, default_value_t = 10_000)]
    pub default_kv_lease_ttl: u64,
    /// Default soft-pin duration in milliseconds (Mooncake: --default_kv_soft_pin_ttl).
    #[arg(long, default_value_t = 30 * 60 * 1000)]
    pub default_kv_soft_pin_ttl: u64,
    /// Whether eviction may take soft-pinned objects when nothing else is left.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub allow_evict_soft_pinned_objects: bool,
    /// Fraction of capacity freed per eviction round.
    #[arg(long, default_value_t = 0.05)]
    pub eviction_ratio: f64,
    /// Eviction starts above this fraction of capacity in use.
    #[arg(long, default_value_t = 0.90)]
    pub eviction_high_watermark_ratio: f64,
    /// Seconds without a ping after which a client's segments are dropped.
    #[arg(long, default_value_t = 10)]
    pub client_ttl: u64,
    /// `random` or `free_ratio_first`.
    #[arg(long, default_value = "random")]
    pub allocation_strategy: String,
    /// Seconds after which an unfinished put may be replaced by a new one.
    #[arg(long, default_value_t = 30)]
    pub put_start_discard_timeout_sec: u64,
    /// Seconds after which the space of a replaced unfinished put is reused.
    #[arg(long, default_value_t = 600)]
    pub put_start_release_timeout_sec: u64,
    /// Milliseconds a put that finds space held only by reads in flight waits for them to end
    /// (meanwhile objects written within this window are not evicted) before failing with
    /// NO_AVAILABLE_HANDLE.
    #[arg(long, default_value_t = 1000)]
    pub put_wait_for_reads_ms: u64,
    /// Read these settings from a JSON file (keys as the flags, with underscores); flags given
    /// on the command line win.
    #[arg(long)]
    pub config: Option<std::path::PathBuf>,
    /// Seconds between summary lines in the log (0: none).
    #[arg(long, default_value_t = 10)]
    pub summary_interval: u32,
    /// Also serve the transfer engines' HTTP metadata (`http://host:port/metadata`, the
    /// contract of `kvferry metadata-server`), so one process is the whole control plane.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub enable_http_metadata_server: bool,
    /// Address of the embedded metadata server (default: --host).
    #[arg(long)]
    pub http_metadata_server_host: Option<IpAddr>,
    /// Port of the embedded metadata server; 0 picks a free one (printed).
    #[arg(long, default_value_t = 8080)]
    pub http_metadata_server_port: u16,
    /// Keep the embedded metadata durable in this directory (survives a master restart).
    #[arg(long)]
    pub http_metadata_server_data_dir: Option<std::path::PathBuf>,
}

impl MasterArgs {
    pub fn master_config(&self) -> Result<MasterConfig, String> {
        let strategy = match self.allocation_strategy.as_str() {
            "random" => Strategy::Random,
            "free_ratio_first" => Strategy::FreeRatioFirst,
            s => return Err(format!("--allocation-strategy {s:?}: use random or free_ratio_first")),
        };
        if !(0.0..=1.0).contains(&self.eviction_high_watermark_ratio) || !(0.0..=1.0).contains(&self.eviction_ratio) {
            return Err("eviction ratios must be between 0 and 1".into());
        }
        if self.default_kv_lease_ttl == 0 {
            return Err("--default-kv-lease-ttl must be at least 1 ms".into());
        }
        Ok(MasterConfig {
            lease_ttl: Duration::from_millis(self.default_kv_lease_ttl),
            client_ttl: Duration::from_secs(self.client_ttl.max(1)),
            default_soft_pin_ttl: Duration::from_millis(self.default_kv_soft_pin_ttl),
            allow_evict_soft_pinned: self.allow_evict_soft_pinned_objects,
            eviction_high_watermark: self.eviction_high_watermark_ratio,
            eviction_ratio: self.eviction_ratio,
            put_start_discard_timeout: Duration::from_secs(self.put_start_discard_timeout_sec),
            put_start_release_timeout: Duration::from_secs(self.put_start_release_timeout_sec),
            strategy,
            put_wait_for_reads: Duration::from_millis(self.put_wait_for_reads_ms),
        })
    }
}

/// Applies a JSON config file under the command-line flags.
fn merge_config_file(a: MasterArgs, matches: &clap::ArgMatches) -> Result<MasterArgs, String> {
    let Some(path) = &a.config else { return Ok(a) };
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{} is not valid JSON: {e}", path.display()))?;
    let obj = v.as_object().ok_or_else(|| format!("{} must hold a JSON object", path.display()))?;
    let mut args: Vec<String> = vec!["master".into()];
    for (k, val) in obj {
        let flag = k.replace('_', "-");
        let from_cli = matches.value_source(&k.replace('-', "_")).is_some_and(|s| s == clap::parser::ValueSource::CommandLine);
        if from_cli {
            continue;
        }
        let s = match val {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        args.push(format!("--{flag}={s}"));
    }
    #[derive(clap::Parser)]
    struct Wrap {
        #[command(flatten)]
        m: MasterArgs,
    }
    use clap::Parser;
    let file = Wrap::try_parse_from(&args).map_err(|e| format!("{}: {e}", path.display()))?.m;
    // Command-line flags win: rebuild from the file, then overwrite what the CLI set.
    let mut out = file;
    macro_rules! keep_cli {
        ($($f:ident),*) => {$(
            if matches.value_source(stringify!($f)) == Some(clap::parser::ValueSource::CommandLine) {
                out.$f = a.$f.clone();
            }
        )*};
    }
    keep_cli!(
        host, port, metrics_port, default_kv_lease_ttl, default_kv_soft_pin_ttl, allow_evict_soft_pinned_objects, eviction_ratio, eviction_high_watermark_ratio, client_ttl,
        allocation_strategy, put_start_discard_timeout_sec, put_start_release_timeout_sec, put_wait_for_reads_ms, summary_interval, enable_http_metadata_server, http_metadata_server_host,
        http_metadata_server_port, http_metadata_server_data_dir
    );
    out.config = a.config.clone();
    Ok(out)
}

pub fn run(a: MasterArgs, matches: &clap::ArgMatches) -> Result<(), String> {
    let a = merge_config_file(a, matches)?;
    let cfg = a.master_config()?;
    let listener = TcpListener::bind(SocketAddr::new(a.host, a.port)).map_err(|e| format!("cannot bind the master RPC port {}:{}: {e}", a.host, a.port))?;
    let master = Arc::new(Master::new(cfg));
    let spin = kvferry::Config::from_env().map_err(|e| e.to_string())?.spin;
    let server = MasterServer::start_with_spin(Arc::clone(&master), listener, Duration::from_millis(200), a.summary_interval.saturating_mul(5), spin)
        .map_err(|e| format!("starting the master: {e}"))?;
    let http_port = if a.metrics_port >= 0 {
        let l = TcpListener::bind(SocketAddr::new(a.host, a.metrics_port as u16)).map_err(|e| format!("cannot bind the HTTP port {}:{}: {e}", a.host, a.metrics_port))?;
        let port = l.local_addr().map(|x| x.port()).unwrap_or(0);
        let m = Arc::clone(&master);
        std::thread::Builder::new().name("kvf-master-http".into()).spawn(move || {
            if let Err(e) = crate::master_http::serve(l, m) {
                eprintln!("kvferry master: HTTP server stopped: {e}");
            }
        }).map_err(|e| e.to_string())?;
        Some(port)
    } else {
        None
    };
    let metadata = if a.enable_http_metadata_server {
        let host = a.http_metadata_server_host.unwrap_or(a.host);
        let mut port = a.http_metadata_server_port;
        if port == 0 {
            // Find a free port to announce (the server binds it right after).
            port = TcpListener::bind(SocketAddr::new(host, 0)).and_then(|l| l.local_addr()).map(|x| x.port()).map_err(|e| e.to_string())?;
        }
        let args = crate::metadata_server::ServerArgs {
            host: host.to_string(),
            port,
            data_dir: a.http_metadata_server_data_dir.clone(),
            max_body_bytes: 64 << 20,
            request_timeout: 10.0,
            max_connections: 4096,
            threads: 1,
        };
        std::thread::Builder::new().name("kvf-master-metadata".into()).spawn(move || {
            if let Err(e) = crate::metadata_server::run_quiet(args) {
                eprintln!("kvferry master: metadata server stopped: {e}");
                std::process::exit(1);
            }
        }).map_err(|e| e.to_string())?;
        let shown = if host.is_ipv6() { format!("[{host}]") } else { host.to_string() };
        Some(format!("http://{shown}:{port}/metadata"))
    } else {
        None
    };
    println!(
        "KVFERRY_MASTER rpc={}:{} http={} metadata={}",
        a.host,
        server.port(),
        http_port.map(|p| format!("{}:{p}", a.host)).unwrap_or_else(|| "off".into()),
        metadata.as_deref().unwrap_or("off")
    );
    let _ = std::io::stdout().flush();
    eprintln!("kvferry master listening on {}:{} (RPC){}", a.host, server.port(), http_port.map(|p| format!(", {}:{p} (HTTP)", a.host)).unwrap_or_default());
    loop {
        std::thread::park();
    }
}
