//! Mooncake's `mooncake_master` spellings for `kvferry master` (gflags: `--rpc_port=50051`,
//! `--rpc_port 50051`, `-rpc_port=50051`, bare `--enable_http_metadata_server`,
//! `--noallow_evict_soft_pinned_objects`), rewritten to kvferry's own flags before clap sees
//! them; the same for `kvferry store-client` and `mooncake_client`'s flags ([`STORE_CLIENT`]).
//!
//! Every flag of Mooncake's `master.cpp` is either translated to a kvferry flag, accepted and
//! ignored with one warning line naming it (tuning or optional features whose absence does not
//! change what a client sees), or rejected with an error naming it (it asks for a feature
//! kvferry does not have: `--enable_snapshot=true`, `--enable_offload=true`, ...). The HA flags
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
    "http-auth-all",
];

/// Mooncake names that are not kvferry's kebab-case spelling of the same name.
const RENAMES: &[(&str, &str)] = &[
    ("rpc_port", "port"),
    ("rpc_address", "host"),
    ("config_path", "config"),
    // The key of Mooncake's master.json (conf/master.json) for --client_ttl.
    ("client_live_ttl_sec", "client-ttl"),
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
const NO_TIERS: &str = "kvferry has no disk, NVMe-oF or CXL tier";
const NO_TASKS: &str = "kvferry's master has no replica copy/move tasks";
const NO_EVENTS: &str = "kvferry's master publishes no KV events";
const THREADS: &str = "kvferry's master serves each RPC connection on its own thread";

/// Mooncake's master flags that kvferry does not implement (mooncake-store/src/master.cpp).
const MOONCAKE_ONLY: &[(&str, Kind, Action)] = &[
    ("max_threads", Kind::Value, Action::Ignore(THREADS)),
    ("rpc_thread_num", Kind::Value, Action::Ignore(THREADS)),
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
    (
        "memory_allocator",
        Kind::Value,
        Action::Ignore("kvferry's master uses its own best-fit allocator"),
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
    (
        "enable_offload",
        Kind::Bool,
        Action::RejectIf(truthy, NO_TIERS),
    ),
    ("offload_on_evict", Kind::Bool, Action::Ignore(NO_TIERS)),
    ("offload_force_evict", Kind::Bool, Action::Ignore(NO_TIERS)),
    (
        "offloading_queue_limit",
        Kind::Value,
        Action::Ignore(NO_TIERS),
    ),
    ("offload_cap_ratio", Kind::Value, Action::Ignore(NO_TIERS)),
    ("promotion_on_hit", Kind::Bool, Action::Ignore(NO_TIERS)),
    (
        "promotion_admission_threshold",
        Kind::Value,
        Action::Ignore(NO_TIERS),
    ),
    (
        "promotion_queue_limit",
        Kind::Value,
        Action::Ignore(NO_TIERS),
    ),
    (
        "promotion_max_per_heartbeat",
        Kind::Value,
        Action::Ignore(NO_TIERS),
    ),
    ("enable_disk_eviction", Kind::Bool, Action::Ignore(NO_TIERS)),
    ("quota_bytes", Kind::Value, Action::Ignore(NO_TIERS)),
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
        Action::RejectIf(truthy, "kvferry's master has one tenant"),
    ),
    (
        "tenant_quota_connector_type",
        Kind::Value,
        Action::Ignore("kvferry's master has one tenant"),
    ),
    (
        "tenant_quota_connector_uri",
        Kind::Value,
        Action::Ignore("kvferry's master has one tenant"),
    ),
    (
        "max_total_finished_tasks",
        Kind::Value,
        Action::Ignore(NO_TASKS),
    ),
    (
        "max_total_pending_tasks",
        Kind::Value,
        Action::Ignore(NO_TASKS),
    ),
    (
        "max_total_processing_tasks",
        Kind::Value,
        Action::Ignore(NO_TASKS),
    ),
    (
        "pending_task_timeout_sec",
        Kind::Value,
        Action::Ignore(NO_TASKS),
    ),
    (
        "processing_task_timeout_sec",
        Kind::Value,
        Action::Ignore(NO_TASKS),
    ),
    ("max_retry_attempts", Kind::Value, Action::Ignore(NO_TASKS)),
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
    bools: &[],
    renames: &[],
    only: &[
        ("threads", Kind::Value, Action::Ignore(DUMMY_THREADS)),
        (
            "tenant_id",
            Kind::Value,
            Action::RejectIf(not_default, "kvferry's store has one tenant (pass default)"),
        ),
        (
            "enable_offload",
            Kind::Bool,
            Action::RejectIf(truthy, NO_TIERS),
        ),
        (
            "start_offload_rpc_server",
            Kind::Bool,
            Action::Ignore(NO_TIERS),
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
                (None, Kind::Value) => match args.get(i).and_then(|a| a.to_str()) {
                    Some(a) => {
                        i += 1;
                        a.to_string()
                    }
                    None => return Err(format!("--{underscored} needs a value")),
                },
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
    match action {
        Action::RejectIf(pred, why) if pred(value) => Err(format!(
            "{flag}={value} (a {mooncake} flag) is not supported: {why}; remove it"
        )),
        Action::RejectIf(_, why) | Action::Ignore(why) => {
            warnings.push(format!(
                "{tool}: warning: ignoring the {mooncake} flag {flag}={value} ({why})"
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
mod tests {
    use super::*;

    fn known() -> Vec<String> {
        [
            "host",
            "port",
            "metrics-port",
            "metrics-host",
            "default-kv-lease-ttl",
            "eviction-ratio",
            "config",
            "client-ttl",
            "summary-interval",
            "allow-evict-soft-pinned-objects",
            "enable-http-metadata-server",
            "http-metadata-server-port",
            "enable-ha",
            "ha-backend-connstring",
            "etcd-endpoints",
            "cluster-id",
            "enable-metadata-cleanup-on-timeout",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }

    fn norm(a: &[&str]) -> Result<(Vec<String>, Vec<String>), String> {
        let args: Vec<OsString> = a.iter().map(OsString::from).collect();
        normalize(&args, &known()).map(|n| {
            (
                n.args
                    .into_iter()
                    .map(|s| s.into_string().unwrap_or_default())
                    .collect(),
                n.warnings,
            )
        })
    }

    #[test]
    fn gflags_spellings_become_kvferry_flags() {
        let (a, w) = norm(&[
            "--rpc_port=50051",
            "-rpc_address",
            "127.0.0.1",
            "--metrics_port",
            "-1",
            "--eviction_ratio=0.2",
            "--host=::1",
        ])
        .unwrap();
        assert_eq!(
            a,
            [
                "--port=50051",
                "--host",
                "127.0.0.1",
                "--metrics-port",
                "-1",
                "--eviction-ratio=0.2",
                "--host=::1"
            ]
        );
        assert!(w.is_empty());
        let (a, _) = norm(&[
            "--rpc_port",
            "0",
            "-port=7",
            "--client_live_ttl_sec=3",
            "--config_path",
            "/x.json",
        ])
        .unwrap();
        assert_eq!(
            a,
            [
                "--port",
                "0",
                "--port=7",
                "--client-ttl=3",
                "--config",
                "/x.json"
            ]
        );
    }

    #[test]
    fn booleans_follow_gflags() {
        let (a, _) = norm(&[
            "--enable_http_metadata_server",
            "--http_metadata_server_port",
            "0",
        ])
        .unwrap();
        assert_eq!(
            a,
            [
                "--enable-http-metadata-server=true",
                "--http-metadata-server-port",
                "0"
            ]
        );
        let (a, _) = norm(&[
            "--noallow_evict_soft_pinned_objects",
            "--enable-http-metadata-server=1",
        ])
        .unwrap();
        assert_eq!(
            a,
            [
                "--allow-evict-soft-pinned-objects=false",
                "--enable-http-metadata-server=true"
            ]
        );
        let (a, _) = norm(&["--allow-evict-soft-pinned-objects", "false", "-h"]).unwrap();
        assert_eq!(a, ["--allow-evict-soft-pinned-objects=false", "-h"]);
        assert!(norm(&["--enable_http_metadata_server=maybe"])
            .unwrap_err()
            .contains("--enable_http_metadata_server"));
        let (a, w) = norm(&["--enable_metric_reporting=false"]).unwrap();
        assert_eq!(a, ["--summary-interval=0"]);
        assert!(w.is_empty());
        assert!(norm(&["--enable_metric_reporting"]).unwrap().0.is_empty());
        assert_eq!(
            norm(&["--noenable_metric_reporting"]).unwrap().0,
            ["--summary-interval=0"]
        );
        let (a, w) = norm(&["--enable_metadata_cleanup_on_timeout", "--client_ttl", "3"]).unwrap();
        assert_eq!(
            (a.as_slice(), w.len()),
            (
                &[
                    "--enable-metadata-cleanup-on-timeout=true".to_string(),
                    "--client-ttl".into(),
                    "3".into()
                ][..],
                0
            ),
            "a bare boolean takes no value"
        );
        assert_eq!(
            norm(&["--noenable_metadata_cleanup_on_timeout"]).unwrap().0,
            ["--enable-metadata-cleanup-on-timeout=false"]
        );
    }

    #[test]
    fn mooncake_ha_flags_are_kvferry_flags() {
        let (a, w) = norm(&[
            "--enable_ha",
            "--ha_backend_connstring",
            "etcd://127.0.0.1:2379;127.0.0.1:2380",
            "--cluster_id=c1",
            "--etcd_endpoints=127.0.0.1:2379",
        ])
        .unwrap();
        assert_eq!(
            a,
            [
                "--enable-ha=true",
                "--ha-backend-connstring",
                "etcd://127.0.0.1:2379;127.0.0.1:2380",
                "--cluster-id=c1",
                "--etcd-endpoints=127.0.0.1:2379"
            ]
        );
        assert!(w.is_empty());
        assert_eq!(
            norm(&["--enable_ha=false"]).unwrap().0,
            ["--enable-ha=false"]
        );
        assert_eq!(norm(&["--noenable_ha"]).unwrap().0, ["--enable-ha=false"]);
        assert_eq!(
            norm(&["--enable-ha", "true"]).unwrap().0,
            ["--enable-ha=true"]
        );
    }

    #[test]
    fn mooncake_only_flags_warn_or_fail_by_name() {
        let (a, w) = norm(&[
            "--rpc_thread_num",
            "8",
            "--memory_allocator=offset",
            "--enable_oplog=false",
            "--noenable_oplog",
            "--ha_backend_type=etcd",
            "--port",
            "1",
        ])
        .unwrap();
        assert_eq!(a, ["--port", "1"]);
        assert_eq!(w.len(), 5);
        assert!(
            w[0].contains("--rpc_thread_num=8")
                && w[1].contains("--memory_allocator=offset")
                && w[2].contains("--enable_oplog=false")
        );
        // Mooncake's oplog replication is what --enable_ha does anyway: a warning, not an error.
        let (a, w) = norm(&["--enable_oplog", "--enable_ha"]).unwrap();
        assert_eq!((a, w.len()), (vec!["--enable-ha=true".to_string()], 1));
        assert!(
            w[0].contains("--enable_oplog") && w[0].contains("replicates every change"),
            "{w:?}"
        );
        for bad in [
            &["--enable_snapshot"][..],
            &["--enable_snapshot=true"],
            &["-enable_offload=1"],
            &["--dynamic_replication_mode", "enforce"],
            &["--rpc_interface=eth0"],
            &["--ha_backend_type=redis"],
        ] {
            let e = norm(bad).unwrap_err();
            let name = bad[0]
                .trim_start_matches('-')
                .split('=')
                .next()
                .unwrap_or_default();
            assert!(
                e.contains(name) && e.contains("not supported"),
                "{bad:?}: {e}"
            );
        }
        assert_eq!(
            norm(&["--dynamic_replication_mode=off"]).unwrap().1.len(),
            1
        );
        // Unknown everywhere: left for clap, with two dashes.
        assert_eq!(norm(&["-bogus_flag=1"]).unwrap().0, ["--bogus_flag=1"]);
    }

    #[test]
    fn store_client_takes_mooncake_clients_flags() {
        let known: Vec<String> = [
            "host",
            "local-hostname",
            "metadata-server",
            "master-server-address",
            "global-segment-size",
            "local-buffer-size",
            "protocol",
            "device-names",
            "port",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let n = |a: &[&str]| {
            let args: Vec<OsString> = a.iter().map(OsString::from).collect();
            normalize_for(&STORE_CLIENT, &args, &known).map(|n| {
                (
                    n.args
                        .into_iter()
                        .map(|s| s.into_string().unwrap_or_default())
                        .collect::<Vec<_>>(),
                    n.warnings,
                )
            })
        };
        let (a, w) = n(&[
            "--master_server_address=127.0.0.1:50051",
            "-global_segment_size",
            "4 GB",
            "--local_hostname=10.0.0.1",
            "--port=50052",
            "--threads",
            "4",
            "--tenant_id=default",
        ])
        .unwrap();
        assert_eq!(
            a,
            [
                "--master-server-address=127.0.0.1:50051",
                "--global-segment-size",
                "4 GB",
                "--local-hostname=10.0.0.1",
                "--port=50052"
            ]
        );
        assert_eq!(w.len(), 2);
        assert!(
            w.iter()
                .all(|l| l.starts_with("kvferry store-client: warning:")
                    && l.contains("mooncake_client flag")),
            "{w:?}"
        );
        // The master's renames and flags do not apply here.
        assert_eq!(n(&["--rpc_port=1"]).unwrap().0, ["--rpc_port=1"]);
        assert_eq!(
            n(&["--enable_metric_reporting=false"]).unwrap().0,
            ["--enable_metric_reporting=false"]
        );
        for bad in [
            &["--enable_offload"][..],
            &["--enable_http_server=true"],
            &["--tenant_id", "team-a"],
        ] {
            let e = n(bad).unwrap_err();
            assert!(
                e.contains("mooncake_client flag") && e.contains("not supported"),
                "{bad:?}: {e}"
            );
        }
    }

    #[test]
    fn durations_take_mooncake_units() {
        assert_eq!(parse_duration_ms("5000"), Ok(5000));
        assert_eq!(parse_duration_ms("5s"), Ok(5000));
        assert_eq!(parse_duration_ms(" 2 m "), Ok(120_000));
        assert_eq!(parse_duration_ms("1h"), Ok(3_600_000));
        assert_eq!(parse_duration_ms("7ms"), Ok(7));
        assert_eq!(parse_timeout_ms("8760h"), Ok(MAX_DURATION_MS));
        assert!(
            parse_timeout_ms("8761h").is_err() && parse_timeout_ms("18446744073709551615").is_err()
        );
        assert!(
            parse_duration_ms("5d").is_err()
                && parse_duration_ms("s").is_err()
                && parse_duration_ms("-1").is_err()
        );
    }
}
