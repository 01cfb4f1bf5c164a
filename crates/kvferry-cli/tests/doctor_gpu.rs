//! `kvferry doctor` and the CUDA driver, through the command: a mock `libcuda.so.1` (built
//! here with `cc` from crates/kvferry/tests/cuda_mock/mock_cuda.c) found on `LD_LIBRARY_PATH` the way the
//! real one is (`dlopen("libcuda.so.1")`), and a host without a driver.

mod common;
#[path = "../../kvferry/tests/cuda_mock/mod.rs"]
mod cuda_mock;

use common::kvferry;
use std::path::PathBuf;

/// A directory holding a mock `libcuda.so.1` built with `defines`.
fn mock_driver(name: &str, defines: &[&str]) -> PathBuf {
    cuda_mock::build(&format!("doctor-{name}"), defines)
}

/// `kvferry doctor --json [--expect E]` with `LD_LIBRARY_PATH=lib_dir`: (exit code, JSON, stderr).
fn doctor(
    lib_dir: &std::path::Path,
    expect: Option<&str>,
) -> (Option<i32>, serde_json::Value, String) {
    let mut cmd = kvferry();
    cmd.args(["doctor", "--json", "--local-hostname", "127.0.0.1"])
        .env("KVFERRY_LOG", "error")
        .env("LD_LIBRARY_PATH", lib_dir);
    if let Some(e) = expect {
        cmd.args(["--expect", e]);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let doc = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("doctor --json printed no JSON ({e}): {stdout}\n{stderr}"));
    (out.status.code(), doc, stderr)
}

#[test]
fn doctor_reports_the_driver_and_its_gpus() {
    let dir = mock_driver("ok", &["INIT_RESULT=0", "COUNT=2", "NO_MEM"]);
    let (code, d, stderr) = doctor(&dir, None);
    assert_eq!(code, Some(0), "{stderr}");
    let g = &d["transports"]["gpu"];
    assert_eq!(g["libcuda"], true, "{g}");
    assert_eq!(g["driver_version"], 12040, "{g}");
    let devices = g["devices"].as_array().unwrap_or_else(|| panic!("{g}"));
    assert_eq!(devices.len(), 2, "{g}");
    assert_eq!(devices[1]["name"], "Mock H200 #1");
    assert_eq!(devices[1]["pci_bus_id"], "0000:18:00.0");
    assert_eq!(devices[0]["memory"], 141u64 << 30);
    assert_eq!(devices[0]["compute_capability"], serde_json::json!([9, 0]));
    // A driver and GPUs, but this mock only answers the probe (no context or memory entry
    // points, as a driver older than CUDA 11.4): GPU memory is not available, and it says
    // which entry point is missing and what to do. (tests/cli.rs checks a mock with them.)
    assert_eq!(g["available"], false, "{g}");
    let reason = g["reason"].as_str().unwrap();
    assert!(
        reason.contains("cuDevicePrimaryCtxRetain") && reason.contains("driver is too old"),
        "{reason}"
    );
    assert!(
        g["fix"]
            .as_str()
            .unwrap()
            .contains("update the NVIDIA driver"),
        "{g}"
    );

    // --expect gpu: exit status 1, naming gpu and why, with the fix.
    let (code, d, stderr) = doctor(&dir, Some("gpu"));
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("gpu (libcuda.so.1 has no symbol cuDevicePrimaryCtxRetain"),
        "{stderr}"
    );
    let p = d["problems"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["check"] == "expected transport gpu")
        .unwrap_or_else(|| panic!("{d}"));
    assert!(
        p["fix"]
            .as_str()
            .unwrap()
            .contains("update the NVIDIA driver"),
        "{p}"
    );

    // The screen a person reads lists the driver and each GPU.
    let out = kvferry()
        .args(["doctor", "--local-hostname", "127.0.0.1"])
        .env("KVFERRY_LOG", "error")
        .env("LD_LIBRARY_PATH", &dir)
        .output()
        .unwrap();
    let screen = String::from_utf8_lossy(&out.stdout);
    assert!(
        screen.contains("CUDA driver 12.4 (libcuda.so.1, loaded at run time)"),
        "{screen}"
    );
    assert!(
        screen.contains("gpu 1: Mock H200 #1, 141 GiB, compute capability 9.0, PCI 0000:18:00.0"),
        "{screen}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn doctor_says_why_a_driver_cannot_be_used_and_the_fix() {
    // cuInit fails: CUDA_ERROR_NO_DEVICE (no GPU visible) and a stub library first on the path.
    for (name, init, want) in [
        ("nodev", "INIT_RESULT=100", "CUDA_VISIBLE_DEVICES"),
        (
            "stub",
            "INIT_RESULT=34",
            "remove the stubs directory from LD_LIBRARY_PATH",
        ),
    ] {
        let dir = mock_driver(name, &[init, "COUNT=0"]);
        let (code, d, stderr) = doctor(&dir, Some("tcp,gpu"));
        assert_eq!(code, Some(1), "{stderr}");
        let g = &d["transports"]["gpu"];
        assert_eq!(g["available"], false);
        assert!(g["reason"].as_str().unwrap().contains(want), "{name}: {g}");
        assert!(
            g["fix"].as_str().is_some_and(|f| f.contains("NVIDIA")),
            "{g}"
        );
        assert!(stderr.contains("gpu (cuInit failed"), "{stderr}");
        assert_eq!(
            d["expect"]["unmet"].as_array().unwrap().len(),
            1,
            "tcp works: {d}"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
    // A driver listing no GPU.
    let dir = mock_driver("zero", &["INIT_RESULT=0", "COUNT=0"]);
    let (_, d, _) = doctor(&dir, None);
    assert!(
        d["transports"]["gpu"]["reason"]
            .as_str()
            .unwrap()
            .contains("lists no GPU"),
        "{d}"
    );
    assert_eq!(d["transports"]["gpu"]["driver_version"], 12040);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn doctor_without_a_driver_says_absent_why_and_the_fix() {
    let empty_dir = tempfile::tempdir().unwrap();
    let empty = empty_dir.path().to_path_buf();
    if kvferry::host::gpu::probe().driver_version.is_some() {
        // A GPU host: its driver is found whatever LD_LIBRARY_PATH says; it is reported.
        let (_, d, _) = doctor(&empty, None);
        assert_eq!(d["transports"]["gpu"]["libcuda"], true, "{d}");
        eprintln!(
            "this host has a CUDA driver: the no-driver report is checked on hosts without one"
        );
        return;
    }
    let (code, d, stderr) = doctor(&empty, None);
    assert_eq!(code, Some(0), "gpu not expected: {stderr}");
    let g = &d["transports"]["gpu"];
    assert_eq!(
        (g["available"].as_bool(), g["libcuda"].as_bool()),
        (Some(false), Some(false)),
        "{g}"
    );
    assert!(
        g["driver_version"].is_null() && g["devices"] == serde_json::json!([]),
        "{g}"
    );
    let reason = g["reason"].as_str().unwrap();
    assert!(
        reason.contains("libcuda.so.1 cannot be loaded")
            && reason.contains("no NVIDIA driver on this host"),
        "{reason}"
    );
    assert!(
        g["fix"]
            .as_str()
            .unwrap()
            .contains("install the NVIDIA driver"),
        "{g}"
    );

    let (code, d, stderr) = doctor(&empty, Some("gpu"));
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr
            .contains("expected transport(s) cannot work here: gpu (libcuda.so.1 cannot be loaded"),
        "{stderr}"
    );
    assert_eq!(d["ok"], false);
    let p = d["problems"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["check"] == "expected transport gpu")
        .unwrap_or_else(|| panic!("{d}"));
    assert!(
        p["fix"]
            .as_str()
            .unwrap()
            .contains("NVIDIA container toolkit"),
        "{p}"
    );
    let _ = std::fs::remove_dir_all(empty);
}
