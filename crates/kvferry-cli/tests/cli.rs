//! The `kvferry` binary end to end: bench (both sides, and split by --mode), doctor.

mod common;

use common::{check_records, kvferry, BenchTarget};

#[test]
fn bench_runs_both_sides_and_verifies_every_point() {
    let dir = std::env::temp_dir().join(format!("kvferry-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("points.jsonl");
    let out = kvferry()
        .args(["bench", "--buffer-size", "64M", "--blocks", "4K,1M", "--batch", "16", "--duration", "0.2", "--no-ceilings", "--mooncake", "none", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for col in ["GB/s", "ops/s", "batch p50", "1-req p50", "verified"] {
        assert!(stdout.contains(col), "table has {col}: {stdout}");
    }
    check_records(&json, 4);
}

#[test]
fn bench_split_across_two_commands() {
    let mut target = BenchTarget::start(&["--buffer-size", "32M"]);
    let seg = target.segment.clone();
    let json = std::env::temp_dir().join(format!("kvferry-cli-split-{}.jsonl", std::process::id()));
    let out = kvferry()
        .args(["bench", "--mode", "initiator", "--segment", &seg, "--buffer-size", "32M", "--blocks", "64K", "--ops", "read", "--batch", "8", "--duration", "0.2", "--no-ceilings", "--mooncake", "none", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    target.kill();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    check_records(&json, 1);
}

#[test]
fn bench_rejects_bad_arguments_clearly() {
    let out = kvferry().args(["bench", "--mode", "initiator"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--segment"));
    let out = kvferry().args(["bench", "--buffer-size", "lots"]).output().unwrap();
    assert!(!out.status.success());
    let out = kvferry().args(["bench", "--mode", "initiator", "--segment", "127.0.0.1:1", "--buffer-size", "1M"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("127.0.0.1:1"), "names the segment");
}

#[test]
fn doctor_reports_transports() {
    let out = kvferry().args(["doctor", "--local-hostname", "127.0.0.1"]).output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{s}");
    for want in ["tcp", "rdma", "gpu memory", "memlock", "listeners", "KVFERRY_TRANSFER_TIMEOUT"] {
        assert!(s.contains(want), "doctor mentions {want}: {s}");
    }
    let out = kvferry().args(["doctor", "--local-hostname", "203.0.113.9"]).env("KVFERRY_LOG", "error").output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("not an address of this host"), "{s}");
}

#[test]
fn readme_documents_every_variable() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    for v in kvferry::config::ENV_VARS {
        assert!(readme.contains(&format!("`{}`", v.name)), "README's configuration table lacks {}", v.name);
        for a in v.aliases.iter().filter(|a| !a.contains("PRC")) {
            assert!(readme.contains(&format!("`{a}`")), "README lacks the alias {a} of {}", v.name);
        }
    }
}

#[test]
fn target_process_killed_mid_transfer_fails_requests_within_the_deadline() {
    use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest};
    use std::time::{Duration, Instant};
    let mut target = BenchTarget::start(&["--buffer-size", "256M"]);
    let (seg_name, addr) = (target.segment.clone(), target.addr);
    let e = TransferEngine::new(Config { transfer_timeout: Duration::from_secs(4), ..Config::default() }).unwrap();
    let src = vec![9u8; 256 << 20];
    e.register_memory(src.as_ptr() as u64, src.len() as u64, "*").unwrap();
    let seg = e.open_segment(&seg_name).unwrap();
    let reqs: Vec<_> = (0..64u64)
        .map(|i| TransferRequest { opcode: Opcode::Write, source: src.as_ptr() as u64 + (i << 22), target_id: seg, target_offset: addr + (i << 22), length: 4 << 20 })
        .collect();
    let b = e.allocate_batch(reqs.len()).unwrap();
    e.submit(b, &reqs).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    target.kill(); // SIGKILL, mid-transfer
    let start = Instant::now();
    let st = e.wait_batch(b, Duration::from_secs(20)).unwrap();
    assert!(start.elapsed() < Duration::from_secs(6), "ended within the deadline, took {:?}", start.elapsed());
    let until = Instant::now() + Duration::from_secs(6);
    while e.free_batch(b).is_err() {
        assert!(Instant::now() < until, "tasks still in flight after the deadline");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(matches!(st.status, TaskStatus::Failed | TaskStatus::Timeout | TaskStatus::Completed), "{st:?}");
    // A new request to the dead peer fails quickly with a reason.
    let st = e.transfer_sync(&reqs[..1], Duration::from_secs(10)).unwrap();
    assert_ne!(st.status, TaskStatus::Completed);
    assert!(st.reason.is_some());
}
