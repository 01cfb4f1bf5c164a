//! `kvferry bench --workload`: model-shaped KV requests end to end, both sides on this host.

mod common;
#[path = "../../kvferry/tests/mooncake_peer/mod.rs"]
mod mooncake_peer;

use common::kvferry;

/// Runs `kvferry bench --workload` with `args` (tiny points, no ceilings) and its records in a
/// `--json` file; fails on a failed run. Its stdout and the records.
fn workload(args: &[&str]) -> (String, Vec<serde_json::Value>) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("points.jsonl");
    let out = kvferry()
        .args(["bench", "--duration", "0.05", "--no-ceilings"])
        .args(args)
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let recs = std::fs::read_to_string(&json)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (stdout, recs)
}

/// Every preset over TCP and shared memory, push and pull, one and two concurrent requests:
/// each point verified by the target's hash of its side of each request, with the
/// descriptors and bytes its model gives, and a point that does not fit the pool skipped
/// with the reason.
#[test]
fn bench_workload_moves_verified_model_shaped_requests() {
    let (stdout, recs) = workload(&[
        "--workload",
        "llama3-70b-tp8,qwen3-8b,deepseek-v4",
        "--tokens",
        "64,512",
        "--concurrency",
        "1,2",
        "--transport",
        "tcp,shm",
        "--max-memory",
        "48M",
        "--mooncake-python",
        "none",
    ]);
    // (preset, tokens) → (descriptors, bytes) of one request.
    let shape = |preset: &str, tokens: u64| match preset {
        // 80 layers × K/V × 16-token blocks of 4 KiB.
        "llama3-70b-tp8" => (160 * tokens / 16, 160 * tokens / 16 * 4096),
        // 36 layers × K/V × 16-token blocks of 32 KiB.
        "qwen3-8b" => (72 * tokens / 16, 72 * tokens / 16 * 32768),
        // CollectiveX's dsv4: three groups of 256-token blocks (1 123 200, 259 200 and
        // 53 568 B packed) and the 128-token window's 64-token blocks (2 283 840 B).
        "deepseek-v4" => {
            let window = tokens.min(128).div_ceil(64);
            (
                3 * tokens.div_ceil(256) + window,
                tokens.div_ceil(256) * (1_123_200 + 259_200 + 53_568) + window * 2_283_840,
            )
        }
        other => panic!("unknown preset {other}"),
    };
    for r in &recs {
        assert_eq!(r["verified"], true, "{r}");
        let (descs, bytes) = shape(r["preset"].as_str().unwrap(), r["tokens"].as_u64().unwrap());
        assert_eq!(r["descriptors"].as_u64(), Some(descs), "{r}");
        assert_eq!(r["request_bytes"].as_u64(), Some(bytes), "{r}");
        assert!(r["gbps"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["packed_gbps"].as_f64().unwrap() > 0.0, "{r}");
        // A ceiling, so not measured with --no-ceilings (run::tests checks the copy itself).
        assert_eq!(r["scattered_memcpy_gbps"].as_f64(), Some(0.0), "{r}");
        assert!(r["p99_ms"].as_f64() >= r["p50_ms"].as_f64(), "{r}");
        assert!(r["requests"].as_u64().unwrap() >= r["concurrency"].as_u64().unwrap());
    }
    // Qwen3-8B at 512 tokens is 75.5 MB a request: not one fits the 48 MiB pool.
    assert!(
        stdout.contains("qwen3-8b") && stdout.contains("skipped: 1 request(s) of 512 tokens"),
        "{stdout}"
    );
    let ran = |preset: &str, transport: &str, dir: &str| {
        recs.iter()
            .any(|r| r["preset"] == preset && r["transport"] == transport && r["direction"] == dir)
    };
    for preset in ["llama3-70b-tp8", "qwen3-8b", "deepseek-v4"] {
        for transport in ["tcp", "shm"] {
            for dir in ["push", "pull"] {
                assert!(
                    ran(preset, transport, dir),
                    "{preset} {transport} {dir}: {stdout}"
                );
            }
        }
    }
    // The first point of each transport says what a fresh engine's first request took.
    assert_eq!(
        recs.iter()
            .filter(|r| r["first_ms"].as_f64().unwrap() > 0.0)
            .count(),
        2,
        "{stdout}"
    );
    // ... and what registering a 16 GiB KV cache took in a fresh engine (a figure, not a bound).
    let reg: Vec<f64> = recs
        .iter()
        .filter(|r| r["register_bytes"].as_u64().unwrap() > 0)
        .map(|r| {
            assert_eq!(r["register_bytes"].as_u64().unwrap(), 16 << 30, "{r}");
            r["register_ms"].as_f64().unwrap()
        })
        .collect();
    assert_eq!(reg.len(), 2, "{stdout}");
    assert!(reg.iter().all(|&ms| ms > 0.0), "{reg:?}");
}

/// An unknown preset or direction is refused naming what exists, before anything starts.
#[test]
fn bench_workload_refuses_an_unknown_preset_or_direction() {
    let out = kvferry()
        .args(["bench", "--workload", "gpt-9", "--no-ceilings"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("no such preset") && err.contains("llama3-70b-tp8"),
        "{err}"
    );
    let out = kvferry()
        .args([
            "bench",
            "--workload",
            "qwen3-8b",
            "--directions",
            "sideways",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("push and/or pull"), "{err}");
}

/// `--mooncake-python`: stock Mooncake moves the very requests kvferry moved (the same
/// descriptors, two Mooncake engines over TCP, its users' calls), each verified, and the report
/// sets them side by side.
#[test]
fn bench_workload_runs_stock_mooncake_on_the_same_requests() {
    let Some(py) = mooncake_peer::python() else {
        return;
    };
    let (stdout, recs) = workload(&[
        "--workload",
        "llama3-70b-tp8,deepseek-v4",
        "--tokens",
        "64,512",
        "--concurrency",
        "1,2",
        "--transport",
        "tcp",
        "--max-memory",
        "64M",
        "--mooncake-python",
        &py,
    ]);
    let (ours, theirs): (Vec<_>, Vec<_>) = recs.iter().partition(|r| r["engine"] == "kvferry");
    assert!(!ours.is_empty());
    assert_eq!(
        ours.len(),
        theirs.len(),
        "Mooncake ran every point: {stdout}"
    );
    for o in &ours {
        let m = theirs
            .iter()
            .find(|m| {
                ["preset", "tokens", "concurrency", "direction"]
                    .iter()
                    .all(|k| m[*k] == o[*k])
            })
            .unwrap_or_else(|| panic!("no Mooncake point for {o}"));
        assert_eq!(m["verified"], true, "{m}");
        assert_eq!(m["descriptors"], o["descriptors"], "{m} vs {o}");
        assert_eq!(m["request_bytes"], o["request_bytes"], "{m} vs {o}");
        assert!(m["gbps"].as_f64().unwrap() > 0.0, "{m}");
    }
    assert!(stdout.contains("kvf/MC"), "{stdout}");
}
