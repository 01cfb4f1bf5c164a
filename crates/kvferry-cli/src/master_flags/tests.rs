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
        "enable-offload",
        "offloading-queue-limit",
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
    // Mooncake's SSD offload line: --enable_offload and --offloading_queue_limit are kvferry's
    // flags; offload at eviction is what kvferry does (a warning names the flag).
    let (a, w) = norm(&[
        "-enable_offload=1",
        "--offloading_queue_limit",
        "100",
        "--offload_on_evict=true",
    ])
    .unwrap();
    assert_eq!(
        a,
        ["--enable-offload=true", "--offloading-queue-limit", "100"],
        "{w:?}"
    );
    assert!(
        w.len() == 1 && w[0].contains("--offload_on_evict") && w[0].contains("evicts"),
        "{w:?}"
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
        &["-enable_cxl=1"],
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
    // Mooncake's offload flag is the store-client's own (its disk tier).
    assert_eq!(n(&["--enable_offload"]).unwrap().0, ["--enable_offload"]);
    for bad in [
        &["--enable_http_server=true"][..],
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

/// A launch line of Mooncake 0.3.14's `mooncake_master` (its stock binary starts with it):
/// the nine flags 0.3.14 added, each translated or warned about.
#[test]
fn mooncake_0_3_14_launch_line() {
    let (a, w) = norm(&[
        "--rpc_port=50051",
        "--client_active_ttl_sec=7",
        "--client_suspicion_ttl_sec=20",
        "--ha_leader_lease_ttl_sec",
        "9",
        "--handler_worker_thread_num=4",
        "--enable_oplog_snapshot=false",
        "--snapshot_chunk_object_count=1000",
        "--tenant_eviction_high_watermark_ratio=0.8",
        "--weight_import_idle_timeout_ms=300000",
        "--weight_management_oplog_capability_confirmed",
    ])
    .unwrap();
    // Implemented: the client TTL and the HA lease TTL (seconds, into kvferry's duration).
    assert_eq!(
        a,
        ["--port=50051", "--client-ttl=7", "--ha-lease-ttl=9s"],
        "{w:?}"
    );
    // The other seven: one warning line each, naming the flag, its value and why.
    let expect = [
        ("--client_suspicion_ttl_sec=20", "no suspected phase"),
        ("--handler_worker_thread_num=4", "its own thread"),
        (
            "--enable_oplog_snapshot=false",
            "snapshots of its own journal",
        ),
        ("--snapshot_chunk_object_count=1000", "--ha-snapshot-bytes"),
        ("--tenant_eviction_high_watermark_ratio=0.8", "one tenant"),
        ("--weight_import_idle_timeout_ms=300000", "weight imports"),
        (
            "--weight_management_oplog_capability_confirmed=true",
            "weight imports",
        ),
    ];
    assert_eq!(w.len(), expect.len(), "{w:?}");
    for (line, (flag, why)) in w.iter().zip(expect) {
        assert!(
            line.starts_with("kvferry master: warning: ignoring the mooncake_master flag")
                && line.contains(flag)
                && line.contains(why),
            "{line:?} should name {flag} and say {why:?}"
        );
    }
}

#[test]
fn client_ttl_is_the_deprecated_alias_of_client_active_ttl_sec() {
    // Alone, either is the client TTL.
    assert_eq!(norm(&["--client_ttl=3"]).unwrap().0, ["--client-ttl=3"]);
    assert_eq!(
        norm(&["--client_active_ttl_sec", "4"]).unwrap().0,
        ["--client-ttl", "4"]
    );
    // Both: the canonical one wins whatever the order (Mooncake 0.3.14's rule), with a
    // warning that the alias is not used.
    for line in [
        &["--client_ttl=3", "--client_active_ttl_sec=7"][..],
        &["--client_active_ttl_sec=7", "--client_ttl", "3"],
        &["--client-ttl=3", "-client_active_ttl_sec=7"],
    ] {
        let (a, w) = norm(line).unwrap();
        assert_eq!(a, ["--client-ttl=7"], "{line:?}");
        assert!(
            w.len() == 1
                && w[0].contains("--client_ttl=3 is not used")
                && w[0].contains("deprecated"),
            "{line:?}: {w:?}"
        );
    }
}

#[test]
fn ha_leader_lease_ttl_sec_takes_mooncakes_range() {
    for (v, want) in [("2", "--ha-lease-ttl=2s"), ("60", "--ha-lease-ttl=60s")] {
        assert_eq!(
            norm(&[&format!("--ha_leader_lease_ttl_sec={v}")])
                .unwrap()
                .0,
            [want]
        );
    }
    for bad in ["1", "61", "0", "-5", "5s", ""] {
        let e = norm(&[&format!("--ha_leader_lease_ttl_sec={bad}")]).unwrap_err();
        assert!(
            e.contains("--ha_leader_lease_ttl_sec") && e.contains("2 to 60"),
            "{bad:?}: {e}"
        );
    }
    assert!(norm(&["--ha_leader_lease_ttl_sec"])
        .unwrap_err()
        .contains("needs a value"));
}

/// Mooncake 0.3.14 refuses the 13 flags it removed; kvferry keeps taking them as it did
/// (a 0.3.13 launch line still starts kvferry), saying that 0.3.14 removed them.
#[test]
fn flags_removed_in_0_3_14_still_work_and_say_so() {
    assert_eq!(REMOVED_IN_0_3_14.len(), 13);
    for name in REMOVED_IN_0_3_14 {
        assert!(
            MOONCAKE_ONLY.iter().any(|(m, _, _)| m == name),
            "{name} is handled"
        );
    }
    let (a, w) = norm(&[
        "--enable_snapshot=false",
        "--snapshot_backup_dir=/x",
        "--use_mmap_arena_allocator",
        "--mmap_arena_pool_size",
        "8589934592",
        "--rpc_thread_num=2",
    ])
    .unwrap();
    assert!(a.is_empty(), "{a:?}");
    assert_eq!(w.len(), 5);
    assert!(
        w[..4]
            .iter()
            .all(|l| l.contains("Mooncake 0.3.14 removed it"))
            && !w[4].contains("removed"),
        "{w:?}"
    );
    let e = norm(&["--enable_snapshot"]).unwrap_err();
    assert!(
        e.contains("not supported") && e.contains("Mooncake 0.3.14 removed it"),
        "{e}"
    );
}

/// What the 0.3.14 flags kvferry implements set in the master's own settings.
#[test]
fn mooncake_0_3_14_flags_take_effect() {
    #[derive(clap::Parser)]
    struct Wrap {
        #[command(flatten)]
        m: crate::master::MasterArgs,
    }
    use clap::Parser;
    let parse = |line: &[&str]| {
        let raw: Vec<OsString> = line.iter().map(OsString::from).collect();
        let n = normalize(&raw, &crate::master::known_flags()).expect("normalize");
        let mut args: Vec<OsString> = vec!["master".into()];
        args.extend(n.args);
        Wrap::try_parse_from(&args).expect("parse").m
    };
    let a = parse(&[
        "--client_ttl=3",
        "--client_active_ttl_sec=7",
        "--client_suspicion_ttl_sec=20",
        "--ha_leader_lease_ttl_sec=9",
        "--enable_oplog_snapshot",
    ]);
    assert_eq!((a.client_ttl, a.ha_lease_ttl), (7, 9000));
    let cfg = a.master_config().expect("config");
    assert_eq!(cfg.client_ttl, std::time::Duration::from_secs(7));
    // Mooncake's defaults where they are not given: 10 s and 5 s, as kvferry's.
    let d = parse(&[]);
    assert_eq!((d.client_ttl, d.ha_lease_ttl), (10, 5000));
}
