//! `kvferry bench --transport` and the shared-memory part of `kvferry doctor`.

mod common;

use common::{check_records, kvferry, BenchTarget};

#[test]
fn bench_reports_both_transports_in_one_run_with_unchanged_json() {
    let dir = tempfile::tempdir().unwrap();
    let (json, peers) = (
        dir.path().join("points.jsonl"),
        dir.path().join("peers.jsonl"),
    );
    let out = kvferry()
        .args([
            "bench",
            "--transport",
            "shm,tcp",
            "--buffer-size",
            "64M",
            "--blocks",
            "4K,1M",
            "--batch",
            "16",
            "--duration",
            "0.2",
            "--mooncake",
            "none",
            "--json",
        ])
        .arg(&json)
        .arg("--json-peers")
        .arg(&peers)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("transport") && stdout.contains("/memcpy"),
        "{stdout}"
    );
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("write") || l.starts_with("read"))
        .collect();
    assert_eq!(rows.len(), 8, "{stdout}");
    // kvferry-allocated memory (the default): the initiator maps the target's buffer.
    assert_eq!(
        rows.iter()
            .filter(|l| l.split_whitespace().nth(3) == Some("shm:map"))
            .count(),
        4,
        "{stdout}"
    );
    assert_eq!(
        rows.iter()
            .filter(|l| l.split_whitespace().nth(3) == Some("tcp"))
            .count(),
        4,
        "{stdout}"
    );
    // --json keeps exactly its keys, one record per row, in table order.
    check_records(&json, 8);
    // The transport of each point is in the separate --json-peers output.
    let peers = std::fs::read_to_string(&peers).unwrap();
    let via: Vec<String> = peers
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["engine"] == "kvferry")
        .map(|v| v["transport"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        via,
        ["shm:map", "shm:map", "shm:map", "shm:map", "tcp", "tcp", "tcp", "tcp"]
    );

    // Memory kvferry did not allocate: cross-memory attach carries it.
    let out = kvferry()
        .args([
            "bench",
            "--transport",
            "shm",
            "--memory",
            "private",
            "--buffer-size",
            "32M",
            "--blocks",
            "64K",
            "--batch",
            "8",
            "--duration",
            "0.1",
            "--mooncake",
            "none",
            "--no-ceilings",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("write") || l.starts_with("read"))
        .collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    assert!(
        rows.iter()
            .all(|l| l.split_whitespace().nth(3) == Some("shm:cma") && l.contains(" yes ")),
        "{stdout}"
    );
}

#[test]
fn bench_forcing_shm_against_a_tcp_only_target_says_why() {
    let mut target = BenchTarget::start(&["--buffer-size", "16M", "--transport", "tcp"]);
    let seg = target.segment.clone();
    let out = kvferry()
        .args([
            "bench",
            "--mode",
            "initiator",
            "--segment",
            &seg,
            "--transport",
            "shm",
            "--buffer-size",
            "16M",
            "--blocks",
            "64K",
            "--duration",
            "0.1",
            "--no-ceilings",
            "--mooncake",
            "none",
        ])
        .output()
        .unwrap();
    let auto = kvferry()
        .args([
            "bench",
            "--mode",
            "initiator",
            "--segment",
            &seg,
            "--buffer-size",
            "16M",
            "--blocks",
            "64K",
            "--ops",
            "write",
            "--batch",
            "4",
            "--duration",
            "0.1",
            "--no-ceilings",
            "--mooncake",
            "none",
        ])
        .output()
        .unwrap();
    target.kill();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("KVFERRY_TRANSPORT=shm") && err.contains("publishes no kvferry_shm"),
        "{err}"
    );
    // auto falls back to TCP and says why on stderr.
    assert!(
        auto.status.success(),
        "{}",
        String::from_utf8_lossy(&auto.stderr)
    );
    assert!(String::from_utf8_lossy(&auto.stderr).contains("auto chose tcp"));
    assert!(String::from_utf8_lossy(&auto.stdout)
        .lines()
        .any(|l| l.starts_with("write") && l.split_whitespace().nth(3) == Some("tcp")));
}

#[test]
fn doctor_has_a_shared_memory_section() {
    let out = kvferry()
        .args(["doctor", "--local-hostname", "127.0.0.1"])
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{s}");
    assert!(
        s.contains("same-host identity") && s.contains("KVFERRY_TRANSPORT"),
        "{s}"
    );
    assert!(s.lines().any(|l| l.contains("shm:")), "{s}");
    // Same user, no restrictions here: both copy paths are probed and work.
    assert!(
        s.lines()
            .any(|l| l.trim_start().starts_with("ok")
                && l.contains("shm: cross-memory attach works")),
        "{s}"
    );
    assert!(
        s.lines()
            .any(|l| l.trim_start().starts_with("ok") && l.contains("shm map:")),
        "{s}"
    );
    let out = kvferry()
        .args(["doctor", "--local-hostname", "127.0.0.1"])
        .env("KVFERRY_TRANSPORT", "tcp")
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("shm: disabled by KVFERRY_TRANSPORT=tcp"), "{s}");
}
