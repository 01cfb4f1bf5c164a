//! Mooncake's `mooncake_master` spellings for `kvferry master` (gflags: `--rpc_port=50051`,
//! `--rpc_port 50051`, `-rpc_port=50051`, bare `--enable_http_metadata_server`,
//! `--noallow_evict_soft_pinned_objects`), rewritten to kvferry's own flags before clap sees
//! them; the same for `kvferry store-client` and `mooncake_client`'s flags ([`STORE_CLIENT`]).
//!
//! Every flag of Mooncake's `master.cpp` is either translated to a kvferry flag, accepted and
//! ignored with one warning line naming it (tuning or optional features whose absence does not
//! change what a client sees), or rejected with an error naming it (it asks for a feature
//! kvferry does not have: `--enable_snapshot=true`, `--enable_cxl=true`, ...). The flags of
//! both Mooncake 0.3.13 and 0.3.14 are taken: those 0.3.14 removed still work as they did
//! (kvferry stands in for either release, and their names mean nothing else now), with a note
//! that 0.3.14 dropped them ([`REMOVED_IN_0_3_14`]). The HA flags
//! (`--enable_ha`, `--ha_backend_connstring`, `--etcd_endpoints`, `--cluster_id`) are kvferry
//! flags of the same names; `--ha_backend_type` must be `etcd`. Flags neither side
//! knows are left for clap, which rejects them by name.

use std::ffi::OsString;

/// kvferry's boolean flags (gflags lets a bare `--flag` mean true and `--noflag` false).
pub(crate) const KV_BOOLS: &[&str] = &[
    "allow-evict-soft-pinned-objects",
    "enable-http-metadata-server",
    "enable-ha",
    "enable-metadata-cleanup-on-timeout",
    "enable-offload",
    "http-auth-all",
];

/// Mooncake names that are not kvferry's kebab-case spelling of the same name.
const RENAMES: &[(&str, &str)] = &[
    ("rpc_port", "port"),
    ("rpc_address", "host"),
    ("config_path", "config"),
    // The key of Mooncake's master.json (conf/master.json) for --client_ttl.
    ("client_live_ttl_sec", "client-ttl"),
    // Mooncake 0.3.14's name for --client_ttl (which it keeps as a deprecated alias; when
    // both are given this one wins: see `normalize_for`).
    ("client_active_ttl_sec", "client-ttl"),
];

/// Mooncake flags whose value kvferry's flag takes in another unit: (Mooncake name, kvferry
/// flag, the conversion; its error names the range).
type Convert = fn(&str) -> Result<String, String>;
const CONVERTS: &[(&str, &str, Convert)] = &[
    // Mooncake 0.3.14: whole seconds, 2 to 60; kvferry's --ha-lease-ttl takes a duration.
    ("ha_leader_lease_ttl_sec", "ha-lease-ttl", lease_secs),
];

fn lease_secs(v: &str) -> Result<String, String> {
    match v.trim().parse::<i64>() {
        Ok(n @ 2..=60) => Ok(format!("{n}s")),
        _ => Err("expected whole seconds from 2 to 60 (mooncake_master's range)".into()),
    }
}

/// Flags of Mooncake 0.3.13's `mooncake_master` that 0.3.14 removed (its master refuses them
/// as unknown). kvferry keeps taking them as before, saying so.
pub(crate) const REMOVED_IN_0_3_14: &[&str] = &[
    "enable_snapshot",
    "enable_snapshot_restore",
    "snapshot_backup_dir",
    "snapshot_catalog_backend_connstring",
    "snapshot_catalog_backend_type",
    "snapshot_catalog_store_connstring",
    "snapshot_catalog_store_type",
    "snapshot_child_timeout_seconds",
    "snapshot_payload_backend_type",
    "snapshot_payload_store_type",
    "snapshot_retention_count",
    "mmap_arena_pool_size",
    "use_mmap_arena_allocator",
];

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Bool,
    Value,
}

#[derive(Clone, Copy)]
enum Action {
    /// Accepted, has no effect here; one warning line with the reason.
    Ignore(&'static str),
    /// Rejected when the value asks for the feature (the predicate says so), else ignored.
    RejectIf(fn(&str) -> bool, &'static str),
}

fn truthy(v: &str) -> bool {
    !matches!(
        v.to_ascii_lowercase().as_str(),
        "false" | "0" | "no" | "n" | "f"
    )
}
fn not_off(v: &str) -> bool {
    !v.eq_ignore_ascii_case("off")
}
fn non_empty(v: &str) -> bool {
    !v.trim().is_empty()
}

const NO_HA: &str = "kvferry's master does not write its metadata to files or object stores; with \
                    --enable_ha it replicates every change itself (to in-sync standbys, or to \
                    its etcd journal with --ha-replication etcd, which also survives a restart \
                    of every master)";
const OPLOG: &str = "with --enable_ha kvferry's master replicates every change itself \
                    (--ha-replication standbys|etcd), so Mooncake's oplog settings do not apply";
fn not_etcd(v: &str) -> bool {
    !v.trim().eq_ignore_ascii_case("etcd")
}
const NO_TIERS: &str = "kvferry has no shared-storage, NVMe-oF or CXL tier (its disk tier \
                        is each client's own: --enable_offload)";
const ON_EVICT: &str = "with --enable_offload kvferry's master hands what it evicts, in the \
                        background or for a put that needs space at once, to the disk of the \
                        client holding it (Mooncake's --offload_on_evict=true); only a put's \
                        last try drops";
const NO_PROMOTION: &str = "kvferry's disk tier serves a hit from the disk and does not copy \
                            it back to memory";
const DISK_OWN: &str = "each client's disk tier evicts its least recently used records \
                        itself when its size limit is reached";
const NO_EVENTS: &str = "kvferry's master publishes no KV events";
const THREADS: &str = "kvferry's master serves each RPC connection on its own thread";
const NO_WEIGHTS: &str = "kvferry's master has no managed weight imports";
const ONE_TENANT: &str = "kvferry's master has one tenant";
const ALLOCATOR: &str = "kvferry's master uses its own best-fit allocator";

/// Mooncake's master flags that kvferry does not implement (mooncake-store/src/master.cpp).
const MOONCAKE_ONLY: &[(&str, Kind, Action)] = &[
    ("max_threads", Kind::Value, Action::Ignore(THREADS)),
    ("rpc_thread_num", Kind::Value, Action::Ignore(THREADS)),
    // 0.3.14: RPC handlers on worker threads apart from the I/O threads.
    (
        "handler_worker_thread_num",
        Kind::Value,
        Action::Ignore(THREADS),
    ),
    // 0.3.14: how long a client that stopped pinging stays SUSPECTED (its segments neither
    // read from nor placed on, but kept) before it is dropped.
    (
        "client_suspicion_ttl_sec",
        Kind::Value,
        Action::Ignore(
            "kvferry's master has no suspected phase: a client that stops pinging keeps its \
            segments until --client_active_ttl_sec (--client_ttl) has passed, then is dropped",
        ),
    ),
    (
        "rpc_conn_timeout_seconds",
        Kind::Value,
        Action::Ignore("kvferry keeps idle RPC connections until the client closes them"),
    ),
    (
        "rpc_enable_tcp_no_delay",
        Kind::Bool,
        Action::Ignore("kvferry always sets TCP_NODELAY"),
    ),
    (
        "rpc_interface",
        Kind::Value,
        Action::RejectIf(
            non_empty,
            "kvferry cannot resolve an interface name: pass its address with --rpc_address",
        ),
    ),
    (
        "max_kv_soft_pin_ttl",
        Kind::Value,
        Action::Ignore("kvferry does not cap request-level soft-pin TTLs"),
    ),
    ("memory_allocator", Kind::Value, Action::Ignore(ALLOCATOR)),
    (
        "use_mmap_arena_allocator",
        Kind::Bool,
        Action::Ignore(ALLOCATOR),
    ),
    (
        "mmap_arena_pool_size",
        Kind::Value,
        Action::Ignore(ALLOCATOR),
    ),
    (
        "pod_name",
        Kind::Value,
        Action::Ignore("no Kubernetes label routing"),
    ),
    (
        "pod_namespace",
        Kind::Value,
        Action::Ignore("no Kubernetes label routing"),
    ),
    (
        "ha_backend_type",
        Kind::Value,
        Action::RejectIf(
            not_etcd,
            "kvferry's master elects its leader through etcd only (--ha_backend_type=etcd)",
        ),
    ),
    ("root_fs_dir", Kind::Value, Action::Ignore(NO_HA)),
    (
        "global_file_segment_size",
        Kind::Value,
        Action::Ignore(NO_TIERS),
    ),
    ("enable_oplog", Kind::Bool, Action::Ignore(OPLOG)),
    ("oplog_poll_interval_ms", Kind::Value, Action::Ignore(OPLOG)),
    (
        "oplog_batch_max_entries",
        Kind::Value,
        Action::Ignore(OPLOG),
    ),
    (
        "batch_oplog_retry_timeout_sec",
        Kind::Value,
        Action::Ignore(OPLOG),
    ),
    // 0.3.14: standbys write snapshots of Mooncake's batch oplog.
    (
        "enable_oplog_snapshot",
        Kind::Bool,
        Action::Ignore(
            "with --enable_ha kvferry's master writes snapshots of its own journal, always \
            (when the log since the last one passes --ha-snapshot-bytes)",
        ),
    ),
    (
        "snapshot_chunk_object_count",
        Kind::Value,
        Action::Ignore(
            "kvferry's journal snapshots are written whole (--ha-snapshot-bytes sets when)",
        ),
    ),
    (
        "enable_snapshot",
        Kind::Bool,
        Action::RejectIf(truthy, NO_HA),
    ),
    (
        "enable_snapshot_restore",
        Kind::Bool,
        Action::RejectIf(truthy, NO_HA),
    ),
    ("snapshot_backup_dir", Kind::Value, Action::Ignore(NO_HA)),
    (
        "snapshot_interval_seconds",
        Kind::Value,
        Action::Ignore(NO_HA),
    ),
    (
        "snapshot_child_timeout_seconds",
        Kind::Value,
        Action::Ignore(NO_HA),
    ),
    (
        "snapshot_retention_count",
        Kind::Value,
        Action::Ignore(NO_HA),
    ),
    (
        "snapshot_object_store_type",
        Kind::Value,
        Action::Ignore(NO_HA),
    ),
    (
        "snapshot_payload_store_type",
        Kind::Value,
        Action::Ignore(NO_HA),
    ),
    (
        "snapshot_payload_backend_type",
        Kind::Value,
        Action::Ignore(NO_HA),
    ),
    (
        "snapshot_catalog_store_type",
        Kind::Value,
        Action::Ignore(NO_HA),
    ),
    (
        "snapshot_catalog_backend_type",
        Kind::Value,
        Action::Ignore(NO_HA),
    ),
    (
        "snapshot_catalog_store_connstring",
        Kind::Value,
        Action::Ignore(NO_HA),
    ),
    (
        "snapshot_catalog_backend_connstring",
        Kind::Value,
        Action::Ignore(NO_HA),
    ),
    // (--enable_offload and --offloading_queue_limit are kvferry flags of the same names.)
    ("offload_on_evict", Kind::Bool, Action::Ignore(ON_EVICT)),
    ("offload_force_evict", Kind::Bool, Action::Ignore(ON_EVICT)),
    ("offload_cap_ratio", Kind::Value, Action::Ignore(ON_EVICT)),
    ("promotion_on_hit", Kind::Bool, Action::Ignore(NO_PROMOTION)),
    (
        "promotion_admission_threshold",
        Kind::Value,
        Action::Ignore(NO_PROMOTION),
    ),
    (
        "promotion_queue_limit",
        Kind::Value,
        Action::Ignore(NO_PROMOTION),
    ),
    (
        "promotion_max_per_heartbeat",
        Kind::Value,
        Action::Ignore(NO_PROMOTION),
    ),
    ("enable_disk_eviction", Kind::Bool, Action::Ignore(DISK_OWN)),
    ("quota_bytes", Kind::Value, Action::Ignore(DISK_OWN)),
    ("nof_eviction_ratio", Kind::Value, Action::Ignore(NO_TIERS)),
    (
        "nof_eviction_high_watermark_ratio",
        Kind::Value,
        Action::Ignore(NO_TIERS),
    ),
    (
        "nof_heartbeat_interval_sec",
        Kind::Value,
        Action::Ignore(NO_TIERS),
    ),
    (
        "nof_heartbeat_probe_timeout_ms",
        Kind::Value,
        Action::Ignore(NO_TIERS),
    ),
    (
        "nof_heartbeat_failures_threshold",
        Kind::Value,
        Action::Ignore(NO_TIERS),
    ),
    ("enable_cxl", Kind::Bool, Action::RejectIf(truthy, NO_TIERS)),
    ("cxl_path", Kind::Value, Action::Ignore(NO_TIERS)),
    ("cxl_size", Kind::Value, Action::Ignore(NO_TIERS)),
    (
        "dynamic_replication_mode",
        Kind::Value,
        Action::RejectIf(
            not_off,
            "kvferry's master has no dynamic replication (only \"off\" is accepted)",
        ),
    ),
    (
        "dynamic_replication_heat_window_seconds",
        Kind::Value,
        Action::Ignore("no dynamic replication"),
    ),
    (
        "dynamic_replication_admission_qps_threshold",
        Kind::Value,
        Action::Ignore("no dynamic replication"),
    ),
    (
        "dynamic_replication_max_memory_replicas",
        Kind::Value,
        Action::Ignore("no dynamic replication"),
    ),
    (
        "enable_kv_events",
        Kind::Bool,
        Action::RejectIf(truthy, NO_EVENTS),
    ),
    (
        "kv_events_bind_endpoint",
        Kind::Value,
        Action::Ignore(NO_EVENTS),
    ),
    (
        "kv_events_model_name",
        Kind::Value,
        Action::Ignore(NO_EVENTS),
    ),
    (
        "kv_events_backend_id",
        Kind::Value,
        Action::Ignore(NO_EVENTS),
    ),
    (
        "kv_events_tenant_id",
        Kind::Value,
        Action::Ignore(NO_EVENTS),
    ),
    (
        "kv_events_additional_salt",
        Kind::Value,
        Action::Ignore(NO_EVENTS),
    ),
    (
        "kv_events_lora_name",
        Kind::Value,
        Action::Ignore(NO_EVENTS),
    ),
    (
        "kv_events_block_size",
        Kind::Value,
        Action::Ignore(NO_EVENTS),
    ),
    ("kv_events_dp_rank", Kind::Value, Action::Ignore(NO_EVENTS)),
    (
        "kv_events_emit_legacy_compat",
        Kind::Bool,
        Action::Ignore(NO_EVENTS),
    ),
    (
        "kv_events_emit_object_key",
        Kind::Bool,
        Action::Ignore(NO_EVENTS),
    ),
    (
        "kv_events_queue_capacity",
        Kind::Value,
        Action::Ignore(NO_EVENTS),
    ),
    (
        "enable_multi_tenants",
        Kind::Bool,
        Action::RejectIf(truthy, ONE_TENANT),
    ),
    (
        "tenant_quota_connector_type",
        Kind::Value,
        Action::Ignore(ONE_TENANT),
    ),
    (
        "tenant_quota_connector_uri",
        Kind::Value,
        Action::Ignore(ONE_TENANT),
    ),
    // 0.3.14: per-tenant eviction (only with --enable_multi_tenants, refused above).
    (
        "tenant_eviction_high_watermark_ratio",
        Kind::Value,
        Action::Ignore(ONE_TENANT),
    ),
    // 0.3.14: managed weight imports.
    (
        "weight_import_idle_timeout_ms",
        Kind::Value,
        Action::Ignore(NO_WEIGHTS),
    ),
    (
        "weight_management_oplog_capability_confirmed",
        Kind::Bool,
        Action::Ignore(NO_WEIGHTS),
    ),
];

/// Which Mooncake program's flags a kvferry command takes, and what becomes of each.
pub struct Spec {
    /// The kvferry command (`kvferry master`), for messages.
    tool: &'static str,
    /// The Mooncake program whose flags these are (`mooncake_master`), for messages.
    mooncake: &'static str,
    /// kvferry's boolean flags (kebab-case).
    bools: &'static [&'static str],
    /// Mooncake names that are not kvferry's kebab-case spelling of the same name.
    renames: &'static [(&'static str, &'static str)],
    /// Mooncake's flags kvferry does not implement.
    only: &'static [(&'static str, Kind, Action)],
    /// Mooncake flags whose value a kvferry flag takes converted.
    converts: &'static [(&'static str, &'static str, Convert)],
    /// Flags of an older Mooncake release that the newest one removed (named in messages).
    removed: &'static [&'static str],
    /// (canonical, deprecated alias): given both, Mooncake takes the canonical one's value,
    /// whatever their order; so does kvferry, dropping the alias with a warning.
    aliases: &'static [(&'static str, &'static str)],
    /// `--enable_metric_reporting[=false]` becomes `--summary-interval=0` (the master's).
    metric_reporting: bool,
}

/// `kvferry master` / `mooncake_master`.
pub const MASTER: Spec = Spec {
    tool: "kvferry master",
    mooncake: "mooncake_master",
    bools: KV_BOOLS,
    renames: RENAMES,
    only: MOONCAKE_ONLY,
    converts: CONVERTS,
    removed: REMOVED_IN_0_3_14,
    aliases: &[("client_active_ttl_sec", "client_ttl")],
    metric_reporting: true,
};

fn not_default(v: &str) -> bool {
    v != "default"
}

const DUMMY_THREADS: &str = "kvferry's store-client answers dummy clients' set-up from one \
                            thread; their requests go through their own transfer engine";

/// `kvferry store-client` / `mooncake_client` (mooncake-store/src/real_client_main.cpp).
pub const STORE_CLIENT: Spec = Spec {
    tool: "kvferry store-client",
    mooncake: "mooncake_client",
    bools: &["enable-offload"],
    renames: &[],
    converts: &[],
    removed: &[],
    aliases: &[],
    only: &[
        ("threads", Kind::Value, Action::Ignore(DUMMY_THREADS)),
        (
            "tenant_id",
            Kind::Value,
            Action::RejectIf(not_default, "kvferry's store has one tenant (pass default)"),
        ),
        // (--enable_offload is a kvferry flag of the same name.)
        (
            "start_offload_rpc_server",
            Kind::Bool,
            Action::Ignore(
                "kvferry serves disk reads on the transfer engine's handshake port whenever \
                 --enable_offload is on",
            ),
        ),
        (
            "enable_http_server",
            Kind::Bool,
            Action::RejectIf(truthy, "kvferry's store client has no HTTP server"),
        ),
        (
            "http_port",
            Kind::Value,
            Action::Ignore("kvferry's store client has no HTTP server"),
        ),
        (
            "log_dir",
            Kind::Value,
            Action::Ignore("kvferry logs to stderr (KVFERRY_LOG sets the level)"),
        ),
    ],
    metric_reporting: false,
};

/// What `normalize` made of the arguments.
pub struct Normalized {
    pub args: Vec<OsString>,
    /// One line per Mooncake flag accepted without effect.
    pub warnings: Vec<String>,
}

fn is_bool_literal(s: &str) -> bool {
    matches!(
        s.to_ascii_lowercase().as_str(),
        "true" | "false" | "1" | "0" | "yes" | "no"
    )
}

fn bool_value(flag: &str, v: &str) -> Result<&'static str, String> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "y" | "t" => Ok("true"),
        "false" | "0" | "no" | "n" | "f" => Ok("false"),
        _ => Err(format!("{flag}={v:?}: expected true or false")),
    }
}

/// Rewrites the arguments that follow `kvferry master` (not including it). `known` holds
/// kvferry's long flag names (kebab-case, without dashes).
pub fn normalize(args: &[OsString], known: &[String]) -> Result<Normalized, String> {
    normalize_for(&MASTER, args, known)
}

/// Like [`normalize`] for the command `spec` describes.
pub fn normalize_for(
    spec: &Spec,
    args: &[OsString],
    known: &[String],
) -> Result<Normalized, String> {
    let is_known = |n: &str| known.iter().any(|k| k == n);
    let mut out = Vec::with_capacity(args.len());
    let mut warnings = Vec::new();
    // The deprecated aliases whose canonical flag is also given: dropped (Mooncake's rule).
    let overridden: Vec<(&str, &str)> = spec
        .aliases
        .iter()
        .copied()
        .filter(|(canonical, _)| {
            args.iter()
                .any(|a| flag_name(a).as_deref() == Some(canonical))
        })
        .collect();
    let mut i = 0;
    while i < args.len() {
        let raw = &args[i];
        i += 1;
        let Some(tok) = raw.to_str() else {
            out.push(raw.clone());
            continue;
        };
        if tok == "--" {
            out.extend(args[i - 1..].iter().cloned());
            break;
        }
        // A flag: one or two dashes, then a letter (so "-1" stays a value); "-h" stays clap's.
        let body = tok.strip_prefix("--").or_else(|| tok.strip_prefix('-'));
        let Some(body) = body.filter(|b| {
            (tok.starts_with("--") || tok.len() != 2)
                && b.starts_with(|c: char| c.is_ascii_alphabetic())
        }) else {
            out.push(raw.clone());
            continue;
        };
        let (name, value) = match body.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (body, None),
        };
        let underscored = name.replace('-', "_");
        if let Some(&(canonical, alias)) =
            overridden.iter().find(|(_, alias)| *alias == underscored)
        {
            let v = match value {
                Some(v) => v,
                None => take_value(args, &mut i, &underscored)?,
            };
            warnings.push(format!(
                "{}: warning: --{alias}={v} is not used: --{canonical} is given too, and \
                --{alias} is its deprecated alias",
                spec.tool
            ));
            continue;
        }
        if let Some(&(_, k, convert)) = spec.converts.iter().find(|(m, _, _)| *m == underscored) {
            let v = match value {
                Some(v) => v,
                None => take_value(args, &mut i, &underscored)?,
            };
            let c = convert(&v).map_err(|e| format!("--{underscored}={v}: {e}"))?;
            out.push(format!("--{k}={c}").into());
            continue;
        }
        // The kvferry flag this is, if any.
        let target = spec
            .renames
            .iter()
            .find(|(m, _)| *m == underscored)
            .map(|(_, k)| k.to_string())
            .or_else(|| Some(underscored.replace('_', "-")).filter(|k| is_known(k)));
        // gflags' --noflag for booleans.
        let negated = underscored
            .strip_prefix("no")
            .map(str::to_string)
            .filter(|n| {
                spec.bools.contains(&n.replace('_', "-").as_str())
                    || bool_mooncake(spec, n)
                    || (spec.metric_reporting && n == "enable_metric_reporting")
            });
        if let (None, Some(n)) = (&target, &negated) {
            if value.is_some() {
                return Err(format!("{tok}: --no{n} takes no value"));
            }
            let flag = format!("--{n}");
            if let Some(k) = Some(n.replace('_', "-")).filter(|k| spec.bools.contains(&k.as_str()))
            {
                out.push(format!("--{k}=false").into());
            } else if spec.metric_reporting && n == "enable_metric_reporting" {
                out.push("--summary-interval=0".into());
            } else {
                mooncake_only(spec, n, "false", &flag, &mut warnings)?;
            }
            continue;
        }
        if let Some(k) = target {
            if spec.bools.contains(&k.as_str()) {
                // gflags: a bare boolean is true and takes no separate value; kvferry's own
                // `--flag false` form keeps working.
                let v = match value {
                    Some(v) => bool_value(&format!("--{name}"), &v)?.to_string(),
                    None => match args
                        .get(i)
                        .and_then(|a| a.to_str())
                        .filter(|a| is_bool_literal(a))
                    {
                        Some(a) => {
                            i += 1;
                            bool_value(&format!("--{name}"), a)?.to_string()
                        }
                        None => "true".to_string(),
                    },
                };
                out.push(format!("--{k}={v}").into());
            } else {
                match value {
                    Some(v) => out.push(format!("--{k}={v}").into()),
                    None => {
                        out.push(format!("--{k}").into());
                        // Its value, verbatim (it may start with '-', e.g. --metrics_port -1).
                        if let Some(v) = args.get(i) {
                            out.push(v.clone());
                            i += 1;
                        }
                    }
                }
            }
            continue;
        }
        if spec.metric_reporting && underscored == "enable_metric_reporting" {
            // kvferry's equivalent: the periodic summary line (--summary-interval, default on).
            let v = match value {
                Some(v) => bool_value("--enable_metric_reporting", &v)?,
                None => "true",
            };
            if v == "false" {
                out.push("--summary-interval=0".into());
            }
            continue;
        }
        if let Some(&(_, kind, _)) = spec.only.iter().find(|(m, _, _)| *m == underscored) {
            let v = match (value, kind) {
                (Some(v), _) => v,
                (None, Kind::Bool) => "true".to_string(),
                (None, Kind::Value) => take_value(args, &mut i, &underscored)?,
            };
            mooncake_only(
                spec,
                &underscored,
                &v,
                &format!("--{underscored}"),
                &mut warnings,
            )?;
            continue;
        }
        // Unknown to both: clap rejects it by the name given (with two dashes, so that a
        // single-dash spelling is not read as a cluster of short flags).
        out.push(format!("--{body}").into());
    }
    Ok(Normalized {
        args: out,
        warnings,
    })
}

/// The name of a flag argument, with underscores (`--client-ttl=3`, `-client_ttl`:
/// `client_ttl`).
fn flag_name(a: &OsString) -> Option<String> {
    let t = a.to_str()?;
    let body = t.strip_prefix("--").or_else(|| t.strip_prefix('-'))?;
    Some(body.split('=').next().unwrap_or(body).replace('-', "_"))
}

/// The value in the argument after a flag given without `=`.
fn take_value(args: &[OsString], i: &mut usize, name: &str) -> Result<String, String> {
    match args.get(*i).and_then(|a| a.to_str()) {
        Some(a) => {
            *i += 1;
            Ok(a.to_string())
        }
        None => Err(format!("--{name} needs a value")),
    }
}

fn bool_mooncake(spec: &Spec, n: &str) -> bool {
    spec.only
        .iter()
        .any(|(m, k, _)| *m == n && *k == Kind::Bool)
}

fn mooncake_only(
    spec: &Spec,
    name: &str,
    value: &str,
    flag: &str,
    warnings: &mut Vec<String>,
) -> Result<(), String> {
    let Some(&(_, _, action)) = spec.only.iter().find(|(m, _, _)| *m == name) else {
        return Err(format!("{flag}: unknown flag"));
    };
    let (tool, mooncake) = (spec.tool, spec.mooncake);
    let removed = if spec.removed.contains(&name) {
        "; Mooncake 0.3.14 removed it"
    } else {
        ""
    };
    match action {
        Action::RejectIf(pred, why) if pred(value) => Err(format!(
            "{flag}={value} (a {mooncake} flag) is not supported: {why}{removed}; remove it"
        )),
        Action::RejectIf(_, why) | Action::Ignore(why) => {
            warnings.push(format!(
                "{tool}: warning: ignoring the {mooncake} flag {flag}={value} ({why}{removed})"
            ));
            Ok(())
        }
    }
}

/// Mooncake's duration flags: milliseconds, or a number with `ms`, `s`, `m` or `h`.
pub fn parse_duration_ms(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    if end == 0 {
        return Err(format!(
            "{s:?}: expected milliseconds, or a number followed by ms, s, m or h"
        ));
    }
    let n: u64 = t[..end]
        .parse()
        .map_err(|_| format!("{s:?}: number too large"))?;
    let mult = match t[end..].trim().to_ascii_lowercase().as_str() {
        "" | "ms" => 1,
        "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        u => return Err(format!("{s:?}: unknown unit {u:?} (use ms, s, m or h)")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?}: too large"))
}

/// The longest duration a master flag takes: 365 days (a lease, TTL or timeout of a year
/// already means never; deadlines the master computes from it in milliseconds stay far from
/// overflowing).
pub const MAX_DURATION_MS: u64 = 365 * 24 * 3600 * 1000;

/// [`parse_duration_ms`] of a duration of at most [`MAX_DURATION_MS`].
pub fn parse_timeout_ms(s: &str) -> Result<u64, String> {
    let ms = parse_duration_ms(s)?;
    if ms > MAX_DURATION_MS {
        return Err(format!(
            "{s:?}: at most 365 days ({MAX_DURATION_MS} ms, 8760h)"
        ));
    }
    Ok(ms)
}

#[cfg(test)]
mod tests;
