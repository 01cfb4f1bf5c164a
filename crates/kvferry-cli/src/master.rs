//! `kvferry master`: the store's metadata master.

use crate::master_flags::{parse_timeout_ms, MAX_DURATION_MS};
use kvferry_store::master::{MasterConfig, Strategy};
use kvferry_store::server::MasterServer;
use kvferry_store::Master;
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
    /// HTTP port for /metrics, /health, /query_key, /get_all_segments (Mooncake:
    /// --metrics_port); 0 picks one, -1 disables.
    #[arg(
        long,
        default_value_t = 9003,
        allow_negative_numbers = true,
        value_parser = clap::value_parser!(i32).range(..=65535)
    )]
    pub metrics_port: i32,
    /// Address of the HTTP listener (Mooncake: --metrics_host; default: --host).
    #[arg(long)]
    pub metrics_host: Option<IpAddr>,
    /// With the cluster key (KVFERRY_AUTH_KEY_FILE): every route of the HTTP port needs a
    /// request signed with it (`X-Kvferry-Auth`), /health, /metrics, /role and /leader too.
    /// Without this flag those four stay open (probes and scrapers hold no key) and only the
    /// routes showing the store's contents need it (/query_key, /get_all_segments, /ha_status).
    #[arg(
        long,
        default_value_t = false,
        action = clap::ArgAction::Set,
        num_args = 0..=1,
        default_missing_value = "true"
    )]
    pub http_auth_all: bool,
    /// Read lease granted by get/exist, in milliseconds, or with a unit: 10s, 1m, 500ms
    /// (Mooncake: --default_kv_lease_ttl). Every duration of the master is at most 365 days.
    #[arg(long, default_value_t = 10_000, value_parser = parse_timeout_ms)]
    pub default_kv_lease_ttl: u64,
    /// Default soft-pin duration in milliseconds, or with a unit: 30m, 1h
    /// (Mooncake: --default_kv_soft_pin_ttl).
    #[arg(long, default_value_t = 30 * 60 * 1000, value_parser = parse_timeout_ms)]
    pub default_kv_soft_pin_ttl: u64,
    /// Whether eviction may take soft-pinned objects when nothing else is left.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub allow_evict_soft_pinned_objects: bool,
    /// Fraction of capacity freed per eviction round (0 to 1).
    #[arg(long, default_value_t = 0.05)]
    pub eviction_ratio: f64,
    /// Eviction starts above this fraction of capacity in use (0 to 1).
    #[arg(long, default_value_t = 0.90)]
    pub eviction_high_watermark_ratio: f64,
    /// Seconds without a ping after which a client's segments are dropped.
    #[arg(long, default_value_t = 10, value_parser = secs())]
    pub client_ttl: u64,
    /// `random` or `free_ratio_first` (Mooncake: --allocation_strategy).
    #[arg(long, default_value = "random")]
    pub allocation_strategy: String,
    /// Seconds after which an unfinished put may be replaced by a new one.
    #[arg(long, default_value_t = 30, value_parser = secs())]
    pub put_start_discard_timeout_sec: u64,
    /// Seconds after which the space of a replaced unfinished put is reused.
    #[arg(long, default_value_t = 600, value_parser = secs())]
    pub put_start_release_timeout_sec: u64,
    /// Milliseconds a put that finds space held only by reads in flight waits for them to end
    /// (meanwhile objects written within this window are not evicted) before failing with
    /// NO_AVAILABLE_HANDLE.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(..=MAX_DURATION_MS))]
    pub put_wait_for_reads_ms: u64,
    /// Offload (Mooncake's SSD offload): what the background eviction takes goes to the disk
    /// of the client whose segment holds it (a client set up with an offload directory),
    /// instead of being dropped; a get reads it back through that client.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub enable_offload: bool,
    /// The most objects one client's disk has been given to persist and not reported; more
    /// are evicted as without a disk.
    #[arg(long, default_value_t = 50_000, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    pub offloading_queue_limit: u64,
    /// Seconds a client has to report an object it was given to persist; past them the
    /// object is evicted as without a disk.
    #[arg(long, default_value_t = 30, value_parser = secs())]
    pub offload_timeout_sec: u64,
    /// Replica copy/move tasks (Mooncake's task manager): the most finished tasks kept for
    /// `query_task` (the oldest are forgotten).
    #[arg(long, default_value_t = 10_000)]
    pub max_total_finished_tasks: u32,
    /// The most tasks waiting for their client; more are refused (-1401).
    #[arg(long, default_value_t = 10_000)]
    pub max_total_pending_tasks: u32,
    /// The most tasks running at once; the others wait.
    #[arg(long, default_value_t = 10_000)]
    pub max_total_processing_tasks: u32,
    /// Seconds a task may wait for its client before it fails (0: no limit).
    #[arg(long, default_value_t = 300, value_parser = secs())]
    pub pending_task_timeout_sec: u64,
    /// Seconds a task may run at its client before it fails (0: no limit).
    #[arg(long, default_value_t = 300, value_parser = secs())]
    pub processing_task_timeout_sec: u64,
    /// How often a client tries a copy again that found no room.
    #[arg(long, default_value_t = 10)]
    pub max_retry_attempts: u32,
    /// Read these settings from a JSON file (keys as the flags, with underscores); flags given
    /// on the command line win.
    #[arg(long)]
    pub config: Option<std::path::PathBuf>,
    /// Seconds between summary lines in the log (0: none).
    #[arg(long, default_value_t = 10)]
    pub summary_interval: u32,
    /// Also serve the transfer engines' HTTP metadata (`http://host:port/metadata`, the
    /// contract of `kvferry metadata-server`), so one process is the whole control plane.
    #[arg(
        long,
        default_value_t = false,
        action = clap::ArgAction::Set,
        num_args = 0..=1,
        default_missing_value = "true"
    )]
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
    /// When a client stops pinging and its segments are dropped, also remove their
    /// transfer-engine entries (`mooncake/ram/<segment>`, `mooncake/rpc_meta/<segment>`) from
    /// the metadata service: the embedded one (--enable-http-metadata-server), else the one
    /// $KVFERRY_METADATA_SERVER, $MOONCAKE_TE_META_DATA_SERVER or the `metadata_server` of
    /// $MOONCAKE_CONFIG_PATH names (http, etcd or redis). Entries whose engine still answers,
    /// or whose name another client mounted since, are kept.
    #[arg(
        long,
        default_value_t = false,
        action = clap::ArgAction::Set,
        num_args = 0..=1,
        default_missing_value = "true"
    )]
    pub enable_metadata_cleanup_on_timeout: bool,
    /// High availability: campaign for leadership through etcd (needs --ha-backend-connstring);
    /// standbys refuse requests and take over when the leader's lease ends, with every object
    /// (the leader replicates each change before it answers: --ha-replication).
    #[arg(
        long,
        default_value_t = false,
        action = clap::ArgAction::Set,
        num_args = 0..=1,
        default_missing_value = "true"
    )]
    pub enable_ha: bool,
    /// etcd endpoints for HA: `etcd://h1:2379;h2:2379` (the scheme optional, `;` or `,`
    /// between endpoints).
    #[arg(long)]
    pub ha_backend_connstring: Option<String>,
    /// Mooncake's older spelling of --ha-backend-connstring (used when that is not given).
    #[arg(long)]
    pub etcd_endpoints: Option<String>,
    /// HA namespace: the leader key is `mooncake-store/<cluster_id>/master_view` (default:
    /// $MC_STORE_CLUSTER_ID, else mooncake_cluster). With KVFERRY_AUTH_KEY_FILE, with or
    /// without HA, clients dial this cluster (their KVFERRY_STORE_CLUSTER_ID /
    /// MC_STORE_CLUSTER_ID, else mooncake_cluster) and others are refused.
    #[arg(long)]
    pub cluster_id: Option<String>,
    /// TTL of the leader's etcd lease (whole seconds, at least 1 s): a standby takes over
    /// within about this long after the leader died; the leader refuses requests once 2/3 of
    /// it passed without a renewal. Mooncake's is 5 s, fixed.
    #[arg(long, default_value_t = 5000, value_parser = parse_timeout_ms)]
    pub ha_lease_ttl: u64,
    /// HA journal: write a snapshot (and drop the log it covers) once the log since the last
    /// snapshot is larger than this and than that snapshot (e.g. 8M, 64M).
    #[arg(long, default_value = "8M", value_parser = crate::sys::parse_size)]
    pub ha_snapshot_bytes: u64,
    /// HA: how the leader makes a change durable before it answers. `standbys`: the
    /// standbys that are in sync acknowledge it in memory (microseconds; the in-sync set is
    /// kept in etcd, and only one of its members may lead next), and the etcd journal is
    /// written only while no standby is in sync. `etcd`: every change is a transaction in the
    /// etcd journal (about a millisecond; any master can lead next).
    #[arg(long, value_enum, default_value_t = HaReplication::Standbys)]
    pub ha_replication: HaReplication,
    /// HA with standbys: the entries streamed to the in-sync standbys since the etcd journal
    /// was last whole are kept in memory up to this many bytes, so that when the in-sync set
    /// empties (its last standby died or fell behind) the leader writes them to the journal
    /// instead of its whole state, and changing requests wait for that alone. While standbys
    /// are in sync and more than this was streamed since, a snapshot is written in the
    /// background (at most every --ha-rebase-base-every), and the entries after it are kept
    /// instead. 0: none kept (every rebase writes the whole state).
    #[arg(long, default_value = "64M", value_parser = crate::sys::parse_size)]
    pub ha_rebase_tail_bytes: u64,
    /// HA with standbys: a standby keeps up to this many bytes of the entries it received
    /// since where the leader says its etcd journal is whole (when its in-sync set became
    /// non-empty, and at each background snapshot), so that when it takes over it writes
    /// those to the etcd journal instead of its whole state (2 s less per million objects).
    /// Past this many, what it kept is dropped and nothing is kept until the leader's next
    /// background snapshot (see --ha-rebase-tail-bytes: keep this at least as large). 0:
    /// none kept (every takeover writes the whole state).
    #[arg(long, default_value = "64M", value_parser = crate::sys::parse_size)]
    pub ha_standby_tail_bytes: u64,
    /// HA with standbys: the least time between two of those background snapshots.
    #[arg(long, default_value_t = 60_000, value_parser = parse_timeout_ms)]
    pub ha_rebase_base_every: u64,
    /// HA with standbys: each segment keeps a pool of up to this many bytes of free space
    /// (at most 1/64 of the segment) that the journal names as granted before any put is
    /// placed there; a put placed in a pool whose grant the standbys acknowledged is answered
    /// without waiting for its own change's acknowledgement (one round trip to the standbys
    /// per put instead of two). After a takeover the new leader keeps what the last grants
    /// named and no object it knows uses out of use for --put_start_release_timeout_sec. Only
    /// while every linked standby is of this version or later. 0: no pools.
    #[arg(long, default_value = "64M", value_parser = crate::sys::parse_size)]
    pub ha_grant_bytes: u64,
    /// The RPC address clients should use, written into the leader key (`ip` or `ip:port`;
    /// default: --host and the RPC port). Needed when --host is 0.0.0.0 or ::.
    #[arg(long)]
    pub advertise_address: Option<String>,
}

/// A flag in whole seconds, at most 365 days ([`MAX_DURATION_MS`]).
fn secs() -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(..=MAX_DURATION_MS / 1000)
}

/// `--ha-replication`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum HaReplication {
    Etcd,
    Standbys,
}

impl From<HaReplication> for kvferry_store::ha::Replication {
    fn from(r: HaReplication) -> Self {
        match r {
            HaReplication::Etcd => kvferry_store::ha::Replication::Etcd,
            HaReplication::Standbys => kvferry_store::ha::Replication::Standbys,
        }
    }
}

impl MasterArgs {
    pub fn master_config(&self) -> Result<MasterConfig, String> {
        let strategy = match self.allocation_strategy.as_str() {
            "random" => Strategy::Random,
            "free_ratio_first" => Strategy::FreeRatioFirst,
            s => {
                return Err(format!(
                    "--allocation-strategy {s:?}: use random or free_ratio_first"
                ))
            }
        };
        for (flag, v) in [
            ("--eviction-ratio", self.eviction_ratio),
            (
                "--eviction-high-watermark-ratio",
                self.eviction_high_watermark_ratio,
            ),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(format!("{flag} {v}: must be from 0 to 1"));
            }
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
            offload_timeout: match self.enable_offload {
                true => Duration::from_secs(self.offload_timeout_sec.max(1)),
                false => Duration::ZERO,
            },
            offloading_queue_limit: self.offloading_queue_limit as usize,
            tasks: kvferry_store::master::tasks::TaskLimits {
                max_finished: self.max_total_finished_tasks as usize,
                max_pending: self.max_total_pending_tasks as usize,
                max_processing: self.max_total_processing_tasks as usize,
                pending_timeout_ms: self.pending_task_timeout_sec * 1000,
                processing_timeout_ms: self.processing_task_timeout_sec * 1000,
                max_retry: self.max_retry_attempts,
            },
        })
    }
}

/// Applies a JSON config file under the command-line flags.
fn merge_config_file(a: MasterArgs, matches: &clap::ArgMatches) -> Result<MasterArgs, String> {
    let Some(path) = &a.config else { return Ok(a) };
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| format!("{} is not valid JSON: {e}", path.display()))?;
    let obj = v
        .as_object()
        .ok_or_else(|| format!("{} must hold a JSON object", path.display()))?;
    // Keys as flags (kvferry's or Mooncake's master.json names), through the same
    // translation as the command line.
    let mut raw: Vec<std::ffi::OsString> = Vec::new();
    for (k, val) in obj {
        let s = match val {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        raw.push(format!("--{k}={s}").into());
    }
    let n = crate::master_flags::normalize(&raw, &known_flags())
        .map_err(|e| format!("{}: {e}", path.display()))?;
    for w in &n.warnings {
        eprintln!("{w} [{}]", path.display());
    }
    let mut args: Vec<std::ffi::OsString> = vec!["master".into()];
    args.extend(n.args);
    #[derive(clap::Parser)]
    struct Wrap {
        #[command(flatten)]
        m: MasterArgs,
    }
    use clap::Parser;
    let file = Wrap::try_parse_from(&args)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .m;
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
        host,
        port,
        metrics_port,
        metrics_host,
        http_auth_all,
        default_kv_lease_ttl,
        default_kv_soft_pin_ttl,
        allow_evict_soft_pinned_objects,
        eviction_ratio,
        eviction_high_watermark_ratio,
        client_ttl,
        allocation_strategy,
        put_start_discard_timeout_sec,
        put_start_release_timeout_sec,
        put_wait_for_reads_ms,
        enable_offload,
        offloading_queue_limit,
        offload_timeout_sec,
        max_total_finished_tasks,
        max_total_pending_tasks,
        max_total_processing_tasks,
        pending_task_timeout_sec,
        processing_task_timeout_sec,
        max_retry_attempts,
        summary_interval,
        enable_http_metadata_server,
        http_metadata_server_host,
        http_metadata_server_port,
        http_metadata_server_data_dir,
        enable_metadata_cleanup_on_timeout,
        enable_ha,
        ha_backend_connstring,
        etcd_endpoints,
        cluster_id,
        ha_lease_ttl,
        ha_snapshot_bytes,
        ha_replication,
        ha_rebase_tail_bytes,
        ha_standby_tail_bytes,
        ha_rebase_base_every,
        ha_grant_bytes,
        advertise_address
    );
    out.config = a.config.clone();
    Ok(out)
}

/// The HA settings, `None` without `--enable-ha` (Mooncake's rules: HA needs a connection
/// string, `--etcd_endpoints` stands in for `--ha_backend_connstring`; either without HA is
/// only warned about, by [`flag_warnings`]).
fn ha_config(
    a: &MasterArgs,
    rpc_port: u16,
    env_cluster_id: Option<&str>,
) -> Result<Option<kvferry_store::ha::HaConfig>, String> {
    let conn = ha_connstring(a);
    if !a.enable_ha {
        return Ok(None);
    }
    let Some(conn) = conn else {
        return Err(
            "--enable-ha needs --ha-backend-connstring etcd://host:2379[;host:2379...] (or \
            --etcd-endpoints)"
                .into(),
        );
    };
    if let Some((scheme, _)) = conn.split_once("://").filter(|(s, _)| *s != "etcd") {
        return Err(format!(
            "--ha-backend-connstring {conn:?}: only etcd is supported (etcd://host:port;...), not \
            {scheme}://"
        ));
    }
    let endpoints = kvferry::metadata::etcd::parse_endpoints(conn);
    if endpoints.is_empty() {
        return Err(format!(
            "--ha-backend-connstring {conn:?}: no etcd endpoint in it"
        ));
    }
    let ttl = Duration::from_millis(a.ha_lease_ttl);
    if ttl < Duration::from_secs(1) {
        return Err(format!(
            "--ha-lease-ttl {} ms: at least 1 s",
            a.ha_lease_ttl
        ));
    }
    let address = match a
        .advertise_address
        .as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        Some(s) => {
            let (h, p) = kvferry::split_host_port(s);
            let p = p.unwrap_or(rpc_port);
            if h.contains(':') {
                format!("[{h}]:{p}")
            } else {
                format!("{h}:{p}")
            }
        }
        None if a.host.is_unspecified() => {
            return Err(format!(
                "--enable-ha with --host {}: pass --advertise-address, the address clients reach \
                this master at",
                a.host
            ))
        }
        None => SocketAddr::new(a.host, rpc_port).to_string(),
    };
    Ok(Some(kvferry_store::ha::HaConfig {
        endpoints,
        cluster_id: kvferry_store::ha::resolve_cluster_id(a.cluster_id.as_deref(), env_cluster_id),
        address,
        lease_ttl: ttl,
        snapshot_bytes: a.ha_snapshot_bytes,
        replication: a.ha_replication.into(),
        rebase_tail_bytes: a.ha_rebase_tail_bytes,
        standby_tail_bytes: a.ha_standby_tail_bytes,
        rebase_base_every: Duration::from_millis(a.ha_rebase_base_every),
        grant_bytes: a.ha_grant_bytes,
    }))
}

fn ha_connstring(a: &MasterArgs) -> Option<&str> {
    a.ha_backend_connstring
        .as_deref()
        .filter(|s| !s.trim().is_empty())
        .or(a.etcd_endpoints.as_deref().filter(|s| !s.trim().is_empty()))
}

/// What a combination of flags that works, but not as its user likely expects, is told.
fn flag_warnings(a: &MasterArgs) -> Vec<String> {
    let mut w = Vec::new();
    if !a.enable_ha && ha_connstring(a).is_some() {
        w.push("--ha-backend-connstring/--etcd-endpoints is set but --enable-ha is not; it is not used".into());
    }
    if a.enable_ha && a.enable_http_metadata_server {
        w.push(
            "--enable-http-metadata-server with --enable-ha: each master serves its own \
            transfer-engine metadata, which is not replicated; engines that register with this \
            one lose it (and their peers) when this master stops. Give the clients a metadata \
            service that outlives any master: metadata_server = \"etcd://...\" (the same etcd \
            works; KVFERRY_METADATA_SERVER for this master's cleanup) or a standalone `kvferry \
            metadata-server`"
                .into(),
        );
    }
    w
}

/// An address to connect to for a listener bound to `host` (an unspecified address: the
/// loopback of its family).
fn reachable(host: IpAddr) -> IpAddr {
    match host {
        IpAddr::V4(h) if h.is_unspecified() => IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
        IpAddr::V6(h) if h.is_unspecified() => IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
        h => h,
    }
}

/// Where `--enable-metadata-cleanup-on-timeout` removes entries.
#[derive(Debug, PartialEq)]
enum CleanupService {
    /// This connection string, found there (for the start-up line).
    At { conn: String, from: String },
    /// No service to clean, and why (the master warns and starts).
    None(String),
}

/// The metadata service whose entries `--enable-metadata-cleanup-on-timeout` removes
/// (Mooncake's order: the embedded server, else the cluster's as its clients are configured;
/// kvferry's own variable first). A service named but not understood is an error.
fn cleanup_service(
    embedded: Option<String>,
    var: &dyn Fn(&str) -> Option<String>,
) -> Result<CleanupService, String> {
    let mut found = embedded.map(|u| (u, "the embedded metadata server".to_string()));
    // As Mooncake, a variable that says P2PHANDSHAKE names no service: the next source is read.
    let mut p2p = None;
    for name in ["KVFERRY_METADATA_SERVER", "MOONCAKE_TE_META_DATA_SERVER"] {
        if found.is_none() {
            match var(name)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
            {
                Some(v) if v.eq_ignore_ascii_case("P2PHANDSHAKE") => {
                    p2p = p2p.or(Some(format!("${name} is {v}")))
                }
                v => found = v.map(|v| (v, format!("${name}"))),
            }
        }
    }
    if found.is_none() {
        if let Some(path) = var("MOONCAKE_CONFIG_PATH").filter(|p| !p.trim().is_empty()) {
            let text = std::fs::read_to_string(&path).map_err(|e| {
                format!(
                    "--enable-metadata-cleanup-on-timeout: reading $MOONCAKE_CONFIG_PATH \
                    ({path}): {e}"
                )
            })?;
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
                format!(
                    "--enable-metadata-cleanup-on-timeout: $MOONCAKE_CONFIG_PATH ({path}) is \
                    not valid JSON: {e}"
                )
            })?;
            found = v
                .get("metadata_server")
                .and_then(|m| m.as_str())
                .map(|m| (m.trim().to_string(), format!("metadata_server in {path}")));
        }
    }
    let no_entries = |what: String| {
        Ok(CleanupService::None(format!(
            "{what}: peers keep no entries in a metadata service"
        )))
    };
    let Some((conn, from)) = found else {
        return match p2p {
            Some(p2p) => no_entries(p2p),
            None => Ok(CleanupService::None(
                "no metadata service is known: start the master with \
                --enable-http-metadata-server, or set KVFERRY_METADATA_SERVER (or \
                MOONCAKE_TE_META_DATA_SERVER) to the one the clients use"
                    .into(),
            )),
        };
    };
    match kvferry::metadata::ConnString::parse(&conn) {
        Ok(kvferry::metadata::ConnString::P2p) => no_entries(format!("{from} is {conn}")),
        Ok(_) => Ok(CleanupService::At { conn, from }),
        Err(e) => Err(format!(
            "--enable-metadata-cleanup-on-timeout: {from} = {conn:?}: {e}"
        )),
    }
}

/// `kvferry master`'s arguments as clap sees them.
fn command() -> clap::Command {
    #[derive(clap::Parser)]
    struct Wrap {
        #[command(flatten)]
        m: MasterArgs,
    }
    use clap::CommandFactory;
    Wrap::command()
}

/// kvferry's long flag names for `kvferry master` (kebab-case, no dashes).
pub fn known_flags() -> Vec<String> {
    command()
        .get_arguments()
        .filter_map(|a| a.get_long().map(str::to_string))
        .collect()
}

pub fn run(a: MasterArgs, matches: &clap::ArgMatches) -> Result<(), String> {
    let a = merge_config_file(a, matches)?;
    let cfg = a.master_config()?;
    let listener = TcpListener::bind(SocketAddr::new(a.host, a.port)).map_err(|e| {
        format!(
            "cannot bind the master RPC port {}:{} (--port, --host): {e}",
            a.host, a.port
        )
    })?;
    let rpc_port = listener
        .local_addr()
        .map(|x| x.port())
        .map_err(|e| e.to_string())?;
    for w in flag_warnings(&a) {
        eprintln!("kvferry master: warning: {w}");
    }
    let env = kvferry::Config::from_env().map_err(|e| e.to_string())?;
    let mut master = Master::new(cfg);
    master.auth = kvferry::auth::ClusterKey::from_config(env.auth_key_file.as_deref())
        .map_err(|e| e.to_string())?;
    if a.http_auth_all && master.auth.is_none() {
        return Err(
            "--http-auth-all needs the cluster key: set KVFERRY_AUTH_KEY_FILE to the cluster's \
            key file (without a key every HTTP route is open)"
                .into(),
        );
    }
    master.cluster_id = kvferry_store::ha::resolve_cluster_id(
        a.cluster_id.as_deref(),
        env.store_cluster_id.as_deref(),
    );
    let master = Arc::new(master);
    let ha = ha_config(&a, rpc_port, env.store_cluster_id.as_deref())?;
    if let Some(h) = &ha {
        // Before the RPC port is served: the master refuses every request until it leads.
        kvferry_store::ha::start(h.clone(), Arc::clone(&master))?;
    }
    let spin = env.spin;
    let server = MasterServer::start_with_spin(
        Arc::clone(&master),
        listener,
        Duration::from_millis(200),
        a.summary_interval.saturating_mul(5),
        spin,
    )
    .map_err(|e| format!("starting the master: {e}"))?;
    let http_port = if a.metrics_port >= 0 {
        let http_host = a.metrics_host.unwrap_or(a.host);
        let l =
            TcpListener::bind(SocketAddr::new(http_host, a.metrics_port as u16)).map_err(|e| {
                format!(
                    "cannot bind the HTTP port {http_host}:{} (--metrics-port, --metrics-host): {e}",
                    a.metrics_port
                )
            })?;
        let port = l.local_addr().map(|x| x.port()).unwrap_or(0);
        let m = Arc::clone(&master);
        let auth = master
            .auth
            .clone()
            .map(|k| crate::master_http::HttpAuth::new(k, a.http_auth_all));
        std::thread::Builder::new()
            .name("kvf-master-http".into())
            .spawn(move || {
                if let Err(e) = crate::master_http::serve(l, m, auth) {
                    eprintln!("kvferry master: HTTP server stopped: {e}");
                }
            })
            .map_err(|e| e.to_string())?;
        Some(port)
    } else {
        None
    };
    let metadata = if a.enable_http_metadata_server {
        let host = a.http_metadata_server_host.unwrap_or(a.host);
        // Bound here, before its address is announced: a client that reads the address finds
        // it listening.
        let at = SocketAddr::new(host, a.http_metadata_server_port);
        let bound = TcpListener::bind(at).map_err(|e| {
            format!(
                "the embedded metadata server cannot listen on {at}: {e} (another server on \
                 that port? pick another with --http-metadata-server-port)"
            )
        })?;
        let port = bound.local_addr().map_err(|e| e.to_string())?.port();
        let args = crate::metadata_server::ServerArgs {
            host: host.to_string(),
            port,
            data_dir: a.http_metadata_server_data_dir.clone(),
            max_body_bytes: 64 << 20,
            max_keys: 0,
            max_total_bytes: 0,
            request_timeout: 10.0,
            max_connections: 4096,
            threads: 1,
            auth: master.auth.clone(),
            token: env.metadata_http_token.clone(),
        };
        std::thread::Builder::new()
            .name("kvf-master-metadata".into())
            .spawn(move || {
                if let Err(e) = crate::metadata_server::run_quiet(args, bound) {
                    eprintln!(
                        "kvferry master: the embedded metadata server \
                        (--http-metadata-server-host, --http-metadata-server-port) stopped: {e}"
                    );
                    std::process::exit(1);
                }
            })
            .map_err(|e| e.to_string())?;
        let shown = if host.is_ipv6() {
            format!("[{host}]")
        } else {
            host.to_string()
        };
        Some((
            format!("http://{shown}:{port}/metadata"),
            SocketAddr::new(reachable(host), port),
        ))
    } else {
        None
    };
    if a.enable_metadata_cleanup_on_timeout {
        let embedded = metadata
            .as_ref()
            .map(|(_, at)| format!("http://{at}/metadata"));
        match cleanup_service(embedded, &|k| std::env::var(k).ok())? {
            CleanupService::At { conn, from } => {
                let opts = kvferry::metadata::StoreOptions::from_config(&env);
                let c = conn.clone();
                let connect: kvferry_store::cleanup::Connect =
                    Box::new(move || match kvferry::metadata::connect(&c, &opts) {
                        Ok(Some(s)) => Ok(s),
                        Ok(None) => Err(format!("{c} is not a metadata service")),
                        Err(e) => Err(e.to_string()),
                    });
                let probe = kvferry_store::cleanup::handshake_probe(
                    env.handshake_connect_timeout.min(Duration::from_secs(1)),
                    env.handshake_max_len,
                );
                master.cleanup.start(
                    kvferry::metadata::Keys::new(env.metadata_cluster_id.as_deref()),
                    connect,
                    probe,
                )?;
                eprintln!(
                    "kvferry master: the metadata entries of clients that stop pinging are \
                    removed from {conn} ({from}), unless their engine still answers"
                );
            }
            CleanupService::None(why) => eprintln!(
                "kvferry master: warning: --enable-metadata-cleanup-on-timeout is set, but {why}; \
                nothing is removed"
            ),
        }
    }
    let metadata = metadata.map(|(url, _)| url);
    println!(
        "KVFERRY_MASTER rpc={}:{} http={} metadata={} ha={}",
        a.host,
        server.port(),
        http_port
            .map(|p| format!("{}:{p}", a.metrics_host.unwrap_or(a.host)))
            .unwrap_or_else(|| "off".into()),
        metadata.as_deref().unwrap_or("off"),
        ha.as_ref()
            .map(|h| kvferry_store::ha::master_view_key(&h.cluster_id))
            .unwrap_or_else(|| "off".into())
    );
    let _ = std::io::stdout().flush();
    eprintln!(
        "kvferry master listening on {}:{} (RPC){}",
        a.host,
        server.port(),
        http_port
            .map(|p| format!(", {}:{p} (HTTP)", a.metrics_host.unwrap_or(a.host)))
            .unwrap_or_default()
    );
    if master.auth.is_some() {
        eprintln!(
            "kvferry master: clients of cluster {:?} must prove the cluster key \
            (KVFERRY_AUTH_KEY_FILE) before any request; clients without it, or dialing another \
            cluster, are refused",
            master.cluster_id
        );
        let open = if a.http_auth_all {
            "every HTTP route needs"
        } else {
            "the HTTP routes showing the store's contents need"
        };
        eprintln!(
            "kvferry master: {open} a request signed with the cluster key (X-Kvferry-Auth){}",
            if metadata.is_some() {
                ", and so do the embedded metadata server's writes"
            } else {
                ""
            }
        );
    }
    if ha.is_some() {
        // Stopped by SIGTERM/SIGINT, an HA leader first leaves its whole state in etcd and
        // steps down, so stopping every master at once loses nothing.
        use signal_hook::consts::{SIGINT, SIGTERM};
        let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])
            .map_err(|e| format!("cannot handle SIGTERM/SIGINT: {e}"))?;
        if let Some(sig) = signals.forever().next() {
            let bound = Duration::from_secs(10);
            if kvferry_store::ha::hand_off(&master, bound) {
                eprintln!(
                    "kvferry master: stopping (signal {sig}); the state is in etcd and the \
                    leadership handed off"
                );
            } else {
                eprintln!(
                    "kvferry master: stopping (signal {sig}); the state could not be handed to \
                    etcd within {bound:?} (is etcd reachable? was a takeover of a large state \
                    still running? its log line says how long one takes; an in-sync standby \
                    holding the only copy first waits for a dead leader's key to expire, one \
                    lease TTL): a standby takes over when this master's lease ends, but if every \
                    in-sync standby stops too, what only they held is lost; stop the standbys \
                    after a new leader serves"
                );
            }
            std::process::exit(0);
        }
    }
    loop {
        std::thread::park();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    fn parse(argv: &[&str]) -> MasterArgs {
        #[derive(clap::Parser)]
        struct Wrap {
            #[command(flatten)]
            m: MasterArgs,
        }
        use clap::Parser;
        let raw: Vec<OsString> = argv.iter().map(OsString::from).collect();
        let n = crate::master_flags::normalize(&raw, &known_flags()).expect("normalize");
        let mut args: Vec<OsString> = vec!["master".into()];
        args.extend(n.args);
        match Wrap::try_parse_from(&args) {
            Ok(w) => w.m,
            Err(e) => panic!("{argv:?} -> {args:?}: {e}"),
        }
    }

    /// Mooncake's SSD-offload line turns offload on in the master's config; without it
    /// offload is off (a timeout of zero).
    #[test]
    fn enable_offload_turns_offload_on() {
        let a = parse(&[
            "--enable_offload=true",
            "--offloading_queue_limit=7",
            "--offload_timeout_sec=3",
            "--offload_on_evict",
        ]);
        let c = a.master_config().unwrap();
        assert_eq!(c.offload_timeout, Duration::from_secs(3));
        assert_eq!(c.offloading_queue_limit, 7);
        let c = parse(&["--offloading_queue_limit=7"])
            .master_config()
            .unwrap();
        assert_eq!(c.offload_timeout, Duration::ZERO);
    }

    /// Mooncake's task manager flags set the task table's bounds and timeouts.
    #[test]
    fn task_flags_set_the_task_table() {
        let c = parse(&[
            "--max_total_finished_tasks=5",
            "--max_total_pending_tasks=6",
            "--max_total_processing_tasks=7",
            "--pending_task_timeout_sec=8",
            "--processing_task_timeout_sec=0",
            "--max_retry_attempts=2",
        ])
        .master_config()
        .unwrap();
        let want = kvferry_store::master::tasks::TaskLimits {
            max_finished: 5,
            max_pending: 6,
            max_processing: 7,
            pending_timeout_ms: 8_000,
            processing_timeout_ms: 0,
            max_retry: 2,
        };
        assert_eq!(c.tasks, want);
        let d = parse(&[]).master_config().unwrap();
        assert_eq!(d.tasks, kvferry_store::master::tasks::TaskLimits::default());
    }

    #[test]
    fn mooncake_spellings_set_every_field() {
        let a = parse(&[
            "--rpc_port=0",
            "-rpc_address=127.0.0.2",
            "--metrics_port",
            "-1",
            "--metrics_host=127.0.0.3",
            "--default_kv_lease_ttl=5s",
            "--default_kv_soft_pin_ttl",
            "2m",
            "--eviction_ratio=0.2",
            "--eviction_high_watermark_ratio=0.8",
            "--client_ttl=3",
            "--noallow_evict_soft_pinned_objects",
            "--enable_http_metadata_server",
            "--http_metadata_server_port=0",
            "--http_metadata_server_host=127.0.0.4",
            "--http_metadata_server_data_dir=/tmp/kvf-md",
            "--allocation_strategy=free_ratio_first",
            "--put_start_discard_timeout_sec=5",
            "--put_start_release_timeout_sec=6",
            "--put_wait_for_reads_ms=7",
            "--enable_metric_reporting=false",
            "--enable_metadata_cleanup_on_timeout",
        ]);
        assert_eq!(
            (
                a.port,
                a.host.to_string(),
                a.metrics_port,
                a.metrics_host.map(|h| h.to_string())
            ),
            (0, "127.0.0.2".into(), -1, Some("127.0.0.3".into()))
        );
        assert_eq!(
            (
                a.default_kv_lease_ttl,
                a.default_kv_soft_pin_ttl,
                a.client_ttl
            ),
            (5000, 120_000, 3)
        );
        assert_eq!(
            (
                a.eviction_ratio,
                a.eviction_high_watermark_ratio,
                a.allow_evict_soft_pinned_objects
            ),
            (0.2, 0.8, false)
        );
        assert!(a.enable_http_metadata_server && a.enable_metadata_cleanup_on_timeout);
        assert_eq!(
            (
                a.http_metadata_server_port,
                a.http_metadata_server_host.map(|h| h.to_string())
            ),
            (0, Some("127.0.0.4".into()))
        );
        assert_eq!(
            a.http_metadata_server_data_dir.as_deref(),
            Some(std::path::Path::new("/tmp/kvf-md"))
        );
        assert_eq!(
            (
                a.allocation_strategy.as_str(),
                a.put_start_discard_timeout_sec,
                a.put_start_release_timeout_sec,
                a.put_wait_for_reads_ms
            ),
            ("free_ratio_first", 5, 6, 7)
        );
        assert_eq!(
            a.summary_interval, 0,
            "--enable_metric_reporting=false turns the summary line off"
        );
        assert!(a.master_config().is_ok());
        // kvferry's own spellings still work, including the space-separated boolean.
        let b = parse(&[
            "--port",
            "7",
            "--allow-evict-soft-pinned-objects",
            "false",
            "--enable-http-metadata-server",
            "--http-auth-all",
            "--default-kv-lease-ttl",
            "250",
        ]);
        assert_eq!(
            (
                b.port,
                b.allow_evict_soft_pinned_objects,
                b.enable_http_metadata_server,
                b.default_kv_lease_ttl
            ),
            (7, false, true, 250)
        );
        assert!(
            b.http_auth_all && !a.http_auth_all,
            "a bare --http-auth-all is true; off by default"
        );
    }

    /// gflags booleans (`--flag` bare, `--noflag`) must be known as such to the translation,
    /// or a bare one takes the next flag for its value.
    #[test]
    fn every_boolean_flag_is_translated_as_one() {
        let cmd = command();
        let bools: Vec<String> = cmd
            .get_arguments()
            .filter(|a| a.get_num_args() == Some((0..=1).into()))
            .filter_map(|a| a.get_long().map(str::to_string))
            .collect();
        assert!(bools.len() >= 3, "{bools:?}");
        for b in &bools {
            assert!(
                crate::master_flags::KV_BOOLS.contains(&b.as_str()),
                "--{b} is missing from master_flags::KV_BOOLS"
            );
        }
    }

    #[test]
    fn every_flag_has_an_underscore_spelling() {
        for k in known_flags() {
            let raw = vec![OsString::from(format!("--{}=1", k.replace('-', "_")))];
            let n = crate::master_flags::normalize(&raw, &known_flags()).expect("normalize");
            let got = n
                .args
                .first()
                .and_then(|s| s.to_str())
                .unwrap_or_default()
                .to_string();
            assert!(
                got.starts_with(&format!("--{k}=")),
                "--{} -> {got}",
                k.replace('-', "_")
            );
        }
    }

    #[test]
    fn config_file_takes_mooncake_master_json_keys() {
        let dir = std::env::temp_dir().join(format!("kvf-master-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp dir");
        let path = dir.join("master.json");
        std::fs::write(&path, r#"{"rpc_port": 50123, "rpc_address": "127.0.0.1", "rpc_thread_num": 16, "default_kv_lease_ttl": "2s", "client_live_ttl_sec": 9, "enable_ha": false, "eviction_ratio": 0.1}"#).expect("write");
        #[derive(clap::Parser)]
        struct Wrap {
            #[command(flatten)]
            m: MasterArgs,
        }
        use clap::{CommandFactory, FromArgMatches};
        let p = path.to_string_lossy().to_string();
        let matches = Wrap::command()
            .try_get_matches_from(["master", "--config", p.as_str(), "--eviction-ratio", "0.3"])
            .expect("matches");
        let a = Wrap::from_arg_matches(&matches).expect("args").m;
        let m = merge_config_file(a, &matches).expect("merge");
        assert_eq!(
            (
                m.port,
                m.default_kv_lease_ttl,
                m.client_ttl,
                m.eviction_ratio
            ),
            (50123, 2000, 9, 0.3)
        );
        std::fs::write(&path, r#"{"enable_snapshot": true}"#).expect("write");
        let matches = Wrap::command()
            .try_get_matches_from(["master", "--config", p.as_str()])
            .expect("matches");
        let a = Wrap::from_arg_matches(&matches).expect("args").m;
        let e = merge_config_file(a, &matches).err().unwrap_or_default();
        assert!(
            e.contains("--enable_snapshot") && e.contains("master.json"),
            "{e}"
        );
        // Mooncake's HA keys of master.json are kvferry's settings.
        std::fs::write(&path, r#"{"enable_ha": true, "ha_backend_connstring": "etcd://127.0.0.1:2379;127.0.0.1:2380", "cluster_id": "c9"}"#).expect("write");
        let matches = Wrap::command()
            .try_get_matches_from(["master", "--config", p.as_str()])
            .expect("matches");
        let a = Wrap::from_arg_matches(&matches).expect("args").m;
        let m = merge_config_file(a, &matches).expect("merge");
        assert!(m.enable_ha);
        assert_eq!(
            (m.ha_backend_connstring.as_deref(), m.cluster_id.as_deref()),
            (Some("etcd://127.0.0.1:2379;127.0.0.1:2380"), Some("c9"))
        );
        let h = ha_config(&m, 50051, Some("from-env"))
            .expect("ha config")
            .expect("ha on");
        assert_eq!(
            (
                h.endpoints.as_slice(),
                h.address.as_str(),
                h.cluster_id.as_str()
            ),
            (
                &["127.0.0.1:2379".to_string(), "127.0.0.1:2380".to_string()][..],
                "127.0.0.1:50051",
                "c9"
            )
        );
        let mut n = m.clone();
        n.cluster_id = None;
        assert_eq!(
            ha_config(&n, 1, Some("from-env"))
                .expect("ok")
                .expect("on")
                .cluster_id,
            "from-env",
            "MC_STORE_CLUSTER_ID when --cluster-id is not given"
        );
        assert_eq!(
            ha_config(&n, 1, None).expect("ok").expect("on").cluster_id,
            "mooncake_cluster",
            "Mooncake's default"
        );
        n.ha_backend_connstring = None;
        assert!(ha_config(&n, 1, None)
            .unwrap_err()
            .contains("--ha-backend-connstring"));
        n.etcd_endpoints = Some("10.0.0.1:2379;10.0.0.2:2379".into());
        assert_eq!(
            ha_config(&n, 1, None)
                .expect("ok")
                .expect("on")
                .endpoints
                .len(),
            2,
            "--etcd_endpoints stands in"
        );
        n.ha_backend_connstring = Some("redis://x:1".into());
        assert!(ha_config(&n, 1, None).unwrap_err().contains("only etcd"));
        // Combinations that work but not as meant are said once each.
        assert!(flag_warnings(&m).is_empty(), "{:?}", flag_warnings(&m));
        let mut w = m.clone();
        w.enable_http_metadata_server = true;
        assert!(
            matches!(
                flag_warnings(&w).as_slice(),
                [one] if one.contains("not replicated") && one.contains("KVFERRY_METADATA_SERVER")
            ),
            "{:?}",
            flag_warnings(&w)
        );
        w.enable_ha = false;
        assert!(
            matches!(flag_warnings(&w).as_slice(), [one] if one.contains("--enable-ha is not")),
            "{:?}",
            flag_warnings(&w)
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Mooncake's order: the embedded server, then the cluster's as its clients name it
    /// (kvferry's variable, Mooncake's, the `metadata_server` of Mooncake's config file).
    #[test]
    fn the_cleanup_finds_the_service_in_mooncakes_order_and_says_why_not() {
        let dir = std::env::temp_dir().join(format!("kvf-cleanup-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp dir");
        let cfg = dir.join("mooncake.json");
        std::fs::write(&cfg, r#"{"local_hostname": "a", "metadata_server": "redis://127.0.0.1:6379", "protocol": "tcp"}"#).expect("write");
        let cfg_s = cfg.to_string_lossy().to_string();
        let with = |vars: &[(&str, &str)]| {
            let vars: Vec<(String, String)> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            move |k: &str| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
        };
        let embedded = Some("http://127.0.0.1:8080/metadata".to_string());
        let all = with(&[
            ("KVFERRY_METADATA_SERVER", "etcd://127.0.0.1:2379"),
            (
                "MOONCAKE_TE_META_DATA_SERVER",
                "http://10.0.0.1:8080/metadata",
            ),
            ("MOONCAKE_CONFIG_PATH", &cfg_s),
        ]);
        let at = |conn: &str, from: &str| {
            Ok(CleanupService::At {
                conn: conn.into(),
                from: from.into(),
            })
        };
        let why = |r: Result<CleanupService, String>| match r {
            Ok(CleanupService::None(why)) => why,
            other => panic!("no service expected, got {other:?}"),
        };
        assert_eq!(
            cleanup_service(embedded.clone(), &all),
            at(
                &embedded.clone().unwrap_or_default(),
                "the embedded metadata server"
            )
        );
        assert_eq!(
            cleanup_service(None, &all),
            at("etcd://127.0.0.1:2379", "$KVFERRY_METADATA_SERVER")
        );
        let mc = with(&[
            (
                "MOONCAKE_TE_META_DATA_SERVER",
                "http://10.0.0.1:8080/metadata",
            ),
            ("MOONCAKE_CONFIG_PATH", &cfg_s),
        ]);
        assert_eq!(
            cleanup_service(None, &mc),
            at(
                "http://10.0.0.1:8080/metadata",
                "$MOONCAKE_TE_META_DATA_SERVER"
            )
        );
        let file = with(&[("MOONCAKE_CONFIG_PATH", &cfg_s)]);
        assert_eq!(
            cleanup_service(None, &file),
            at(
                "redis://127.0.0.1:6379",
                &format!("metadata_server in {cfg_s}")
            )
        );
        // No service, or peers that keep none: a reason, and the master starts.
        let w = why(cleanup_service(None, &with(&[])));
        assert!(
            w.contains("--enable-http-metadata-server") && w.contains("KVFERRY_METADATA_SERVER"),
            "{w}"
        );
        let w = why(cleanup_service(
            None,
            &with(&[("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE")]),
        ));
        assert!(
            w.contains("P2PHANDSHAKE") && w.contains("MOONCAKE_TE_META_DATA_SERVER"),
            "{w}"
        );
        let p2p_then_file = with(&[
            ("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
            ("MOONCAKE_CONFIG_PATH", &cfg_s),
        ]);
        assert_eq!(
            cleanup_service(None, &p2p_then_file),
            at(
                "redis://127.0.0.1:6379",
                &format!("metadata_server in {cfg_s}")
            ),
            "P2PHANDSHAKE in a variable: the next source, as Mooncake"
        );
        std::fs::write(&cfg, r#"{"metadata_server": "P2PHANDSHAKE"}"#).expect("write");
        assert!(why(cleanup_service(None, &file))
            .contains(&format!("metadata_server in {cfg_s} is P2PHANDSHAKE")));
        // A service named but not understood, or a config file that cannot be read: errors.
        let e = cleanup_service(None, &with(&[("KVFERRY_METADATA_SERVER", "ftp://x")]))
            .expect_err("bad scheme");
        assert!(
            e.contains("KVFERRY_METADATA_SERVER") && e.contains("ftp://x"),
            "{e}"
        );
        let e = cleanup_service(
            None,
            &with(&[("MOONCAKE_CONFIG_PATH", "/nonexistent/mooncake.json")]),
        )
        .expect_err("no file");
        assert!(e.contains("/nonexistent/mooncake.json"), "{e}");
        std::fs::write(&cfg, "{not json").expect("write");
        assert!(cleanup_service(None, &file)
            .expect_err("bad json")
            .contains("not valid JSON"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
