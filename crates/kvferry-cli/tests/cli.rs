//! The `kvferry` binary end to end: bench (both sides, and split by --mode), doctor.

mod common;
#[path = "../../kvferry/tests/cuda_mock/mod.rs"]
mod cuda_mock;

use common::{check_records, kvferry, BenchTarget};

#[test]
fn bench_runs_both_sides_and_verifies_every_point() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("points.jsonl");
    let out = kvferry()
        .args([
            "bench",
            "--buffer-size",
            "64M",
            "--blocks",
            "4K,1M",
            "--batch",
            "16",
            "--duration",
            "0.2",
            "--no-ceilings",
            "--mooncake",
            "none",
            "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for col in ["GB/s", "ops/s", "batch p50", "1-req p50", "verified"] {
        assert!(stdout.contains(col), "table has {col}: {stdout}");
    }
    check_records(&json, 4);
}

#[test]
fn bench_split_across_two_commands() {
    let mut target = BenchTarget::start(&["--buffer-size", "32M"]);
    let seg = target.segment.clone();
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("points.jsonl");
    let out = kvferry()
        .args([
            "bench",
            "--mode",
            "initiator",
            "--segment",
            &seg,
            "--buffer-size",
            "32M",
            "--blocks",
            "64K",
            "--ops",
            "read",
            "--batch",
            "8",
            "--duration",
            "0.2",
            "--no-ceilings",
            "--mooncake",
            "none",
            "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    target.kill();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    check_records(&json, 1);
}

/// `--auth-ab`: the points and connection costs run without the cluster key and with it, each
/// side given the same variables (a key file that does not exist and a protect setting that is
/// not one, left in this environment, reach neither), the key made for the run removed after.
#[test]
fn bench_auth_ab_measures_the_key_off_and_on() {
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let json = dir.path().join("ab.jsonl");
    let out = kvferry()
        .env("KVFERRY_AUTH_KEY_FILE", dir.path().join("no-such-key"))
        .env("KVFERRY_AUTH_PROTECT", "bogus")
        .env("TMPDIR", &tmp)
        .args([
            "bench",
            "--transport",
            "tcp",
            "--buffer-size",
            "16M",
            "--blocks",
            "64K",
            "--ops",
            "write",
            "--batch",
            "4",
            "--duration",
            "0.2",
            "--no-ceilings",
            "--mooncake",
            "none",
            "--auth-ab",
            "1",
            "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::read_dir(&tmp).unwrap().count(),
        0,
        "the key file and its folder are removed"
    );
    assert!(
        stdout.contains("cluster key A/B") && stdout.contains("connection costs"),
        "{stdout}"
    );
    // A round row and a median row per setting in both tables; the keyed median rows give ratios.
    for key in ["none", "headers"] {
        let rows: Vec<&str> = stdout
            .lines()
            .filter(|l| l.split_whitespace().next() == Some(key))
            .collect();
        assert_eq!(
            rows.len(),
            4,
            "{key}: a round and a median row in each table: {stdout}"
        );
        assert_eq!(
            rows.iter()
                .filter(|l| l.split_whitespace().nth(1) == Some("median"))
                .count(),
            2,
            "{stdout}"
        );
        if key == "headers" {
            assert!(
                rows.iter().all(|l| l.split_whitespace().any(|w| w
                    .strip_suffix('x')
                    .is_some_and(|n| n.parse::<f64>().is_ok_and(|v| v > 0.0)))),
                "keyed rows give ratios to no key: {stdout}"
            );
        }
    }
    let text = std::fs::read_to_string(&json).unwrap();
    let recs: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let of = |kind: &str| -> Vec<&serde_json::Value> {
        recs.iter().filter(|r| r["record"] == kind).collect()
    };
    let auths = |rs: &[&serde_json::Value]| -> Vec<String> {
        rs.iter()
            .map(|r| r["auth"].as_str().unwrap().to_string())
            .collect()
    };
    let pos = |r: &serde_json::Value, k: &str| {
        assert!(
            r[k].as_f64().is_some_and(|v| v > 0.0 && v.is_finite()),
            "{k} positive in {r}"
        )
    };
    assert_eq!(recs.len(), 8, "{text}");
    let points = of("auth_ab_point");
    assert_eq!(auths(&points), ["none", "headers"], "{text}");
    for r in &points {
        assert_eq!(
            (
                r["round"].as_u64(),
                r["op"].as_str(),
                r["block_bytes"].as_u64(),
                r["transport"].as_str()
            ),
            (Some(1), Some("write"), Some(65536), Some("tcp")),
            "{r}"
        );
        assert_eq!(r["verified"], true, "{r}");
        for k in [
            "gbps",
            "ops_per_s",
            "batch_p50_us",
            "batch_p99_us",
            "single_p50_us",
            "initiator_cpu_s_per_gb",
            "target_cpu_s_per_gb",
        ] {
            pos(r, k);
        }
    }
    let medians = of("auth_ab_median");
    assert_eq!(auths(&medians), ["none", "headers"], "{text}");
    for (m, p) in medians.iter().zip(&points) {
        assert_eq!(
            m["gbps"], p["gbps"],
            "one round: the median is that round's figure"
        );
        assert_eq!(m["verified"], true, "{m}");
        pos(m, "gbps_vs_none");
        pos(m, "cpu_s_per_gb_vs_none");
    }
    assert_eq!(medians[0]["gbps_vs_none"], 1.0);
    let ratio = points[1]["gbps"].as_f64().unwrap() / points[0]["gbps"].as_f64().unwrap();
    assert!(
        (medians[1]["gbps_vs_none"].as_f64().unwrap() - ratio).abs() < 1e-9,
        "{text}"
    );
    let conns = of("auth_ab_conn");
    assert_eq!(auths(&conns), ["none", "headers"], "{text}");
    for c in &conns {
        assert_eq!(c["samples"], 20, "{c}");
        assert!(c["write_samples"].as_u64().unwrap() >= 20, "{c}");
        for k in [
            "handshake_p50_us",
            "handshake_max_us",
            "first_write_p50_us",
            "first_write_max_us",
            "write_p50_us",
            "write_p99_us",
        ] {
            pos(c, k);
        }
        assert!(
            c["handshake_max_us"].as_f64() >= c["handshake_p50_us"].as_f64()
                && c["write_p99_us"].as_f64() >= c["write_p50_us"].as_f64(),
            "{c}"
        );
    }
    let conn_meds = of("auth_ab_conn_median");
    assert_eq!(auths(&conn_meds), ["none", "headers"], "{text}");
    for k in [
        "handshake_vs_none",
        "first_write_vs_none",
        "write_p50_vs_none",
        "write_p99_vs_none",
    ] {
        assert_eq!(conn_meds[0][k], 1.0, "{k}");
        pos(conn_meds[1], k);
    }
    // Without --auth-ab, --auth-protect is refused; with --mode, --auth-ab is.
    let out = kvferry()
        .args(["bench", "--auth-protect", "encrypt"])
        .output()
        .unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--auth-ab"));
    let out = kvferry()
        .args([
            "bench",
            "--mode",
            "initiator",
            "--segment",
            "127.0.0.1:1",
            "--auth-ab",
            "1",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--auth-ab"));
}

#[test]
fn bench_rejects_bad_arguments_clearly() {
    let out = kvferry()
        .args(["bench", "--mode", "initiator"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--segment"));
    let out = kvferry()
        .args(["bench", "--buffer-size", "lots"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let out = kvferry()
        .args([
            "bench",
            "--mode",
            "initiator",
            "--segment",
            "127.0.0.1:1",
            "--buffer-size",
            "1M",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("127.0.0.1:1"),
        "names the segment"
    );
    // A part of the HA bench that does not exist is refused before anything is reached.
    let out = kvferry()
        .args([
            "store-bench",
            "--ha",
            "127.0.0.1:1",
            "--ha-parts",
            "rate,nope",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("nope")
            && err.contains("rate, store, link, snapshot, rebase, takeover, failover"),
        "names the bad part and the good ones: {err}"
    );
    for bad in ["4", "0x32", "4x", "fourx32", "4x32x1"] {
        let out = kvferry()
            .args([
                "store-bench",
                "--ha",
                "127.0.0.1:1",
                "--ha-points",
                &format!("16x128,{bad}"),
            ])
            .output()
            .unwrap();
        assert!(!out.status.success(), "--ha-points {bad} is refused");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(bad) && err.contains("CONNECTIONSxKEYS"),
            "names the bad point and the form: {err}"
        );
    }
    // A CPU this process may not use is refused before etcd (nothing listens on port 1) is
    // tried.
    let out = kvferry()
        .args([
            "store-bench",
            "--ha",
            "127.0.0.1:1",
            "--ha-standby-cpu",
            "100000",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--ha-standby-cpu 100000") && err.contains("may run on CPU"),
        "names the CPU and the CPUs allowed: {err}"
    );
}

#[test]
fn doctor_reports_transports() {
    let out = kvferry()
        .args(["doctor", "--local-hostname", "127.0.0.1"])
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{s}");
    for want in [
        "tcp",
        "rdma",
        "gpu memory",
        "memlock",
        "listeners",
        "KVFERRY_TRANSFER_TIMEOUT",
    ] {
        assert!(s.contains(want), "doctor mentions {want}: {s}");
    }
    let out = kvferry()
        .args(["doctor", "--local-hostname", "203.0.113.9"])
        .env("KVFERRY_LOG", "error")
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("not an address of this host"), "{s}");
    assert!(
        s.contains("fix: pass an address listed above"),
        "each problem comes with its fix: {s}"
    );
}

/// `kvferry doctor --json [--expect ...]`: the JSON document, its exit status.
fn doctor_json(expect: Option<&str>) -> (std::process::ExitStatus, serde_json::Value, String) {
    let mut cmd = kvferry();
    cmd.args(["doctor", "--json", "--local-hostname", "127.0.0.1"])
        .env("KVFERRY_LOG", "error")
        .env_remove("KVFERRY_TRANSPORT");
    if let Some(e) = expect {
        cmd.args(["--expect", e]);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let doc: serde_json::Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("doctor --json printed no JSON ({e}): {stdout}\n{stderr}"));
    (out.status, doc, stderr)
}

#[test]
fn doctor_json_has_the_stable_keys() {
    let (status, d, stderr) = doctor_json(None);
    assert!(status.success(), "{stderr}");
    assert_eq!(d["version"], env!("CARGO_PKG_VERSION"));
    for k in [
        "version",
        "environment",
        "host",
        "network",
        "memory",
        "metadata",
        "transports",
        "problems",
        "expect",
        "ok",
    ] {
        assert!(d.get(k).is_some(), "key {k} missing: {d}");
    }
    assert!(
        d["host"]["cpus_online"].as_u64().is_some_and(|n| n >= 1),
        "{d}"
    );
    assert!(d["host"]["numa_nodes"].is_array());
    assert!(
        d["memory"]["memlock"]["unlimited"].is_boolean()
            && d["memory"]["memlock"]["cap_ipc_lock"].is_boolean(),
        "{d}"
    );
    assert!(d["memory"]["huge_pages"].get("total").is_some());
    assert_eq!(d["network"]["advertised"], "127.0.0.1");
    assert_eq!(d["network"]["listeners"]["ok"], true, "{d}");
    assert_eq!(d["metadata"]["mode"], "P2PHANDSHAKE");
    // 127.0.0.1 is loopback: a problem, with its fix.
    let problems = d["problems"].as_array().unwrap();
    let p = problems
        .iter()
        .find(|p| p["check"] == "advertised address")
        .unwrap_or_else(|| panic!("{d}"));
    assert!(
        p["message"].as_str().unwrap().contains("loopback")
            && !p["fix"].as_str().unwrap().is_empty(),
        "{p}"
    );
    for p in problems {
        assert!(
            p["fix"].as_str().is_some_and(|f| !f.is_empty()),
            "every problem has a fix: {p}"
        );
    }
    let t = &d["transports"];
    assert_eq!(t["tcp"]["available"], true, "{t}");
    for name in ["tcp", "shm", "rdma", "gpu"] {
        let available = t[name]["available"]
            .as_bool()
            .unwrap_or_else(|| panic!("{name}: {t}"));
        // Each missing transport says why; an available one has no reason.
        assert_eq!(t[name]["reason"].is_string(), !available, "{name}: {t}");
    }
    // The libraries are looked for at run time: the report says whether they loaded.
    assert!(
        t["rdma"]["libibverbs"].is_boolean() && t["gpu"]["libcuda"].is_boolean(),
        "{t}"
    );
    let cuda = std::path::Path::new("/usr/lib/x86_64-linux-gnu/libcuda.so.1").exists()
        || std::path::Path::new("/usr/lib64/libcuda.so.1").exists();
    if !cuda {
        assert_eq!(t["gpu"]["libcuda"], false, "{t}");
        assert!(
            t["gpu"]["reason"]
                .as_str()
                .unwrap()
                .contains("libcuda.so.1"),
            "{t}"
        );
    }
}

#[test]
fn doctor_expect_fails_naming_what_cannot_work() {
    let (status, d, stderr) = doctor_json(Some("tcp"));
    assert!(
        status.success(),
        "--expect tcp on a host that listens: {stderr}"
    );
    assert_eq!(d["ok"], true);
    assert_eq!(d["expect"]["unmet"], serde_json::json!([]));

    // gpu: needs a usable libcuda, which this (CI) host lacks, so it never works here.
    let (_, plain, _) = doctor_json(None);
    assert_eq!(plain["transports"]["gpu"]["available"], false);
    let (status, d, stderr) = doctor_json(Some("tcp,gpu"));
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert_eq!(d["ok"], false);
    let unmet = d["expect"]["unmet"].as_array().unwrap();
    assert_eq!(unmet.len(), 1, "{d}");
    assert!(unmet[0].as_str().unwrap().starts_with("gpu ("), "{d}");
    assert!(
        stderr.contains("gpu") && stderr.contains("cannot work here"),
        "{stderr}"
    );
    let p = d["problems"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["check"] == "expected transport gpu")
        .unwrap_or_else(|| panic!("{d}"));
    assert!(!p["fix"].as_str().unwrap().is_empty());

    // The same on the human screen, and an unknown transport is a usage error.
    let out = kvferry()
        .args(["doctor", "--local-hostname", "127.0.0.1", "--expect", "gpu"])
        .env("KVFERRY_LOG", "error")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let screen = String::from_utf8_lossy(&out.stdout);
    assert!(
        screen.contains("WARN  expected transport gpu") && screen.contains("fix: "),
        "{screen}"
    );
    let out = kvferry()
        .args(["doctor", "--expect", "carrier-pigeon"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("tcp, shm, rdma, gpu"));

    // KVFERRY_TRANSPORT=tcp switches shm off: --expect shm then fails, saying so.
    let out = kvferry()
        .args([
            "doctor",
            "--json",
            "--local-hostname",
            "127.0.0.1",
            "--expect",
            "shm",
        ])
        .env("KVFERRY_TRANSPORT", "tcp")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let d: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        d["transports"]["shm"]["reason"]
            .as_str()
            .unwrap()
            .contains("KVFERRY_TRANSPORT=tcp"),
        "{d}"
    );
}

#[test]
fn version_and_help_exit_zero() {
    let out = kvferry().arg("--version").output().unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("kvferry {}", env!("CARGO_PKG_VERSION"))
    );
    let out = kvferry().arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for sub in [
        "bench",
        "doctor",
        "master",
        "store-bench",
        "store-client",
        "metadata-server",
        "metadata-bench",
    ] {
        assert!(help.contains(sub), "{help}");
    }
    let out = kvferry().arg("no-such-command").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// docs/INSTALL.md's configuration table has a row for every variable of `kvferry::ENV_VARS`
/// (the one list, which `kvferry doctor` prints), with its Mooncake aliases.
#[test]
fn install_md_documents_every_variable() {
    let install = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/INSTALL.md"
    ))
    .unwrap();
    let rows: Vec<&str> = install.lines().filter(|l| l.starts_with("| `")).collect();
    for v in kvferry::ENV_VARS {
        let row = rows
            .iter()
            .find(|r| r.starts_with(&format!("| `{}` |", v.name)))
            .unwrap_or_else(|| panic!("docs/INSTALL.md's configuration table lacks {}", v.name));
        for a in v.aliases.iter().filter(|a| !a.contains("PRC")) {
            assert!(
                row.contains(&format!("`{a}`")),
                "docs/INSTALL.md lacks the alias {a} in the row of {}",
                v.name
            );
        }
    }
}

/// The environment variables a source file reads: `env::var("X")`, `env::var_os("X")`, a
/// lookup closure's `var("X")`, names iterated for one (`for n in ["X", "Y"]`), and Python's
/// `os.environ.get("X")`, `os.environ["X"]`, `os.environ.setdefault("X")`, `os.getenv("X")`.
fn variables_read(src: &str) -> Vec<String> {
    fn name_at(s: &str) -> Option<String> {
        let q = s.chars().next().filter(|c| *c == '"' || *c == '\'')?;
        let n: String = s[1..]
            .chars()
            .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        let named = n.starts_with(|c: char| c.is_ascii_uppercase());
        (named && s[1 + n.len()..].starts_with(q)).then_some(n)
    }
    let mut out = Vec::new();
    for pat in [
        "var(",
        "var_os(",
        "environ.get(",
        "environ[",
        "environ.setdefault(",
        "getenv(",
    ] {
        for (i, _) in src.match_indices(pat) {
            // `set_var(`, `env_var(`: not a read.
            if src[..i].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
                continue;
            }
            if let Some(n) = name_at(src[i + pat.len()..].trim_start()) {
                out.push(n);
            }
        }
    }
    for (i, _) in src.match_indices(" in [\"") {
        let list = &src[i + 5..];
        let list = &list[..list.find(']').unwrap_or(0)];
        // Only names shaped like variables (`GB` in a list of units is none).
        out.extend(
            list.split(',')
                .filter_map(|x| name_at(x.trim()))
                .filter(|n| n.contains('_')),
        );
    }
    out
}

/// Every environment variable the `kvferry` command and the Python binding read (its Rust
/// crate and the Python package) is in `kvferry::ENV_VARS`, as a name or an alias, and so in
/// docs/INSTALL.md's table (above); test-only variables (`KVFERRY_TEST_*`, `KVFERRY_SIM_*`,
/// `KVFERRY_SKIP_*`) are named in docs/INSTALL.md as test only; and the system's `PATH` is no
/// configuration.
#[test]
fn every_variable_the_cli_and_the_binding_read_is_in_the_table() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let install = std::fs::read_to_string(format!("{root}/docs/INSTALL.md")).unwrap();
    let test_only = &install[install
        .find("Test only (`KVFERRY_TEST_*`, `KVFERRY_SIM_*`, `KVFERRY_SKIP_*`")
        .expect("docs/INSTALL.md names the test-only variables")..];
    let mut found = std::collections::BTreeMap::<String, String>::new();
    let mut dirs: Vec<std::path::PathBuf> = [
        "crates/kvferry-cli/src",
        "crates/kvferry-python/src",
        "python",
    ]
    .iter()
    .map(|d| std::path::Path::new(root).join(d))
    .collect();
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p
                .extension()
                .is_some_and(|x| x == "rs" || x == "py" || x == "pth")
            {
                for n in variables_read(&std::fs::read_to_string(&p).unwrap()) {
                    found.entry(n).or_insert_with(|| p.display().to_string());
                }
            }
        }
    }
    // The scan itself: it finds reads of each kind, so it cannot go blind unnoticed.
    for known in [
        "KVFERRY_LOG",
        "KVFERRY_MOONCAKE_BENCH",
        "MOONCAKE_TE_META_DATA_SERVER",
        "MOONCAKE_CONFIG_PATH",
        "KVFERRY_BIN",
        "KVFERRY_MOONCAKE_SHIM",
        "KVFERRY_TEST_SLOW_DROP_MS",
    ] {
        assert!(
            found.contains_key(known),
            "the scan missed {known}: {found:?}"
        );
    }
    let table: Vec<&str> = kvferry::ENV_VARS
        .iter()
        .flat_map(|v| std::iter::once(v.name).chain(v.aliases.iter().copied()))
        .collect();
    for (n, file) in &found {
        if n == "PATH" {
            continue;
        }
        if ["KVFERRY_TEST_", "KVFERRY_SIM_", "KVFERRY_SKIP_"]
            .iter()
            .any(|p| n.starts_with(p))
        {
            assert!(
                test_only.contains(&format!("`{n}`")),
                "{file} reads the test-only {n}: name it in docs/INSTALL.md's \"Test only\" paragraph"
            );
            continue;
        }
        assert!(
            table.contains(&n.as_str()),
            "{file} reads {n}, which is not in kvferry::ENV_VARS (crates/kvferry/src/config.rs) \
            nor in docs/INSTALL.md's configuration table"
        );
    }
}

#[test]
fn target_process_killed_mid_transfer_fails_requests_within_the_deadline() {
    use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest};
    use std::time::{Duration, Instant};
    let mut target = BenchTarget::start(&["--buffer-size", "256M"]);
    let (seg_name, addr) = (target.segment.clone(), target.addr);
    let e = TransferEngine::new(Config {
        transfer_timeout: Duration::from_secs(4),
        ..Config::default()
    })
    .unwrap();
    let src = vec![9u8; 256 << 20];
    e.register_memory(src.as_ptr() as u64, src.len() as u64, "*")
        .unwrap();
    let seg = e.open_segment(&seg_name).unwrap();
    let reqs: Vec<_> = (0..64u64)
        .map(|i| TransferRequest {
            opcode: Opcode::Write,
            source: src.as_ptr() as u64 + (i << 22),
            target_id: seg,
            target_offset: addr + (i << 22),
            length: 4 << 20,
        })
        .collect();
    let b = e.allocate_batch(reqs.len()).unwrap();
    b.submit(&reqs).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    target.kill(); // SIGKILL, mid-transfer
    let start = Instant::now();
    let st = b.wait(Duration::from_secs(20));
    assert!(
        start.elapsed() < Duration::from_secs(6),
        "ended within the deadline, took {:?}",
        start.elapsed()
    );
    b.wait(Duration::from_secs(6));
    assert!(b.is_done(), "tasks still in flight after the deadline");
    assert!(
        matches!(
            st.status,
            TaskStatus::Failed | TaskStatus::Timeout | TaskStatus::Completed
        ),
        "{st:?}"
    );
    // A new request to the dead peer fails quickly with a reason.
    let st = e
        .transfer_sync(&reqs[..1], Duration::from_secs(10))
        .unwrap();
    assert_ne!(st.status, TaskStatus::Completed);
    assert!(st.reason.is_some());
}

/// With the tests' mock CUDA driver first in the library path (`kvferry/tests/cuda_mock`),
/// doctor reports GPU memory available, the driver version and the devices; with one that
/// lacks the memory entry points, unavailable and why.
#[test]
fn doctor_reports_gpu_memory_with_a_driver_and_why_not_without() {
    let run = |name: &str, defines: &[&str]| -> (std::process::ExitStatus, serde_json::Value) {
        let dir = cuda_mock::build(&format!("cli-{name}"), defines);
        let out = kvferry()
            .args([
                "doctor",
                "--json",
                "--local-hostname",
                "127.0.0.1",
                "--expect",
                "tcp,gpu",
            ])
            .env("KVFERRY_LOG", "error")
            .env("LD_LIBRARY_PATH", &dir)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        (
            out.status,
            serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("no JSON ({e}): {stdout}")),
        )
    };
    let (status, d) = run("ok", &["COUNT=2"]);
    let g = &d["transports"]["gpu"];
    assert!(status.success(), "{d}");
    assert_eq!(
        (g["available"].as_bool(), g["driver_version"].as_i64()),
        (Some(true), Some(12040)),
        "{d}"
    );
    assert_eq!(g["devices"].as_array().map(Vec::len), Some(2), "{d}");
    let (status, d) = run("nomem", &["NO_MEM"]);
    let g = &d["transports"]["gpu"];
    assert_eq!(status.code(), Some(1), "{d}");
    assert_eq!(g["available"], false, "{d}");
    assert!(
        g["reason"].as_str().is_some_and(|r| r.contains("too old")),
        "{d}"
    );
}

/// A stand-in for Mooncake's `transfer_engine_bench` whose target starts (and prints its
/// address, as Mooncake's does) and whose initiator never finishes; each process appends its
/// pid to `pids` and leaves a child of its own running (as the console script runs the binary).
fn hanging_mooncake(dir: &std::path::Path) -> (std::path::PathBuf, std::path::PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let pids = dir.join("pids");
    let bin = dir.join("transfer_engine_bench");
    let script = format!(
        "#!/bin/sh\nsleep 600 &\necho $! >> {p}\necho $$ >> {p}\ncase \"$*\" in *--mode=target*) echo \"I1201 transfer_engine_bench.cpp:1] listening on 127.0.0.1:12345\" >&2;; esac\nwait\n",
        p = pids.display()
    );
    std::fs::write(&bin, script).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    (bin, pids)
}

/// Whether `pid` runs (a zombie waiting to be reaped does not).
fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|st| st.rsplit(") ").next().is_some_and(|f| !f.starts_with('Z')))
}

fn all_gone(pids: &std::path::Path) -> Result<(), Vec<i32>> {
    let ps: Vec<i32> = std::fs::read_to_string(pids)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    assert!(ps.len() >= 2, "the stand-in started (pids {ps:?})");
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let left: Vec<i32> = ps.iter().copied().filter(|&p| running(p)).collect();
        if left.is_empty() {
            return Ok(());
        }
        if std::time::Instant::now() > until {
            // Ours, by pid: do not leave them to the next test.
            for p in left
                .iter()
                .filter_map(|&p| rustix::process::Pid::from_raw(p))
            {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
            }
            return Err(left);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// A Mooncake run that never ends does not hang the bench: it is killed with everything it
/// started after `--peer-timeout`, and the report says so.
#[test]
fn bench_bounds_a_mooncake_run_that_never_finishes() {
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let (bin, pids) = hanging_mooncake(dir.path());
    let start = Instant::now();
    let out_file = dir.path().join("out");
    let mut child = kvferry()
        .args([
            "bench",
            "--buffer-size",
            "16M",
            "--blocks",
            "64K",
            "--ops",
            "write",
            "--batch",
            "4",
            "--duration",
            "0.2",
            "--no-ceilings",
            "--transport",
            "tcp",
            "--peer-timeout",
            "1",
            "--mooncake",
        ])
        .arg(&bin)
        .stdout(std::fs::File::create(&out_file).unwrap())
        .spawn()
        .unwrap();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            let _ = all_gone(&pids);
            panic!("the bench still ran after 60 s (its Mooncake run is bounded by 1 s beyond 1 s of measurement)");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = std::fs::read_to_string(&out_file).unwrap();
    assert!(status.success(), "{stdout}");
    assert!(
        stdout.contains("did not finish within"),
        "the report names the killed run: {stdout}"
    );
    assert_eq!(
        all_gone(&pids),
        Ok(()),
        "every process of the stand-in is gone"
    );
}

/// A bench stopped by SIGTERM while a Mooncake run is in progress kills the Mooncake processes
/// (in process groups of their own, the signal does not reach them) and exits with 128 + 15.
#[test]
fn a_stopped_bench_leaves_no_mooncake_process_behind() {
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let (bin, pids) = hanging_mooncake(dir.path());
    let mut child = kvferry()
        .args([
            "bench",
            "--buffer-size",
            "16M",
            "--blocks",
            "64K",
            "--ops",
            "write",
            "--batch",
            "4",
            "--duration",
            "0.2",
            "--no-ceilings",
            "--transport",
            "tcp",
            "--peer-timeout",
            "600",
            "--mooncake",
        ])
        .arg(&bin)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Both the stand-in's target and its initiator run (two lines each).
    let until = Instant::now() + Duration::from_secs(60);
    while std::fs::read_to_string(&pids)
        .unwrap_or_default()
        .lines()
        .count()
        < 4
    {
        assert!(
            Instant::now() < until,
            "the bench did not start the stand-in's initiator within 60 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&child),
        rustix::process::Signal::TERM,
    )
    .expect("SIGTERM to the bench this test started");
    let until = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > until {
            let _ = child.kill();
            panic!("the bench did not exit within 10 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(143), "{status:?}");
    assert_eq!(
        all_gone(&pids),
        Ok(()),
        "every process of the stand-in is gone"
    );
}
