//! `kvferry master` started with mooncake_master's gflags spellings serves clients; flags
//! kvferry does not implement are warned about or refused by name.

use kvferry_store::{Client, ClientConfig, ReplicateConfig};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

fn http(addr: &str, method: &str, path: &str, body: &[u8]) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the metadata server");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .expect("write");
    s.write_all(body).expect("write body");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let code = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, out)
}

#[test]
fn master_started_with_mooncake_flags_serves() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args([
            "master",
            "--rpc_port=0",
            "-rpc_address",
            "127.0.0.1",
            "--metrics_port=0",
            "--default_kv_lease_ttl=2s",
            "--default_kv_soft_pin_ttl",
            "30m",
            "--eviction_ratio=0.1",
            "--eviction_high_watermark_ratio",
            "0.9",
            "--client_ttl=5",
            "--allow_evict_soft_pinned_objects",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            "--http_metadata_server_port=0",
            "--rpc_thread_num=4",
            "-memory_allocator=offset",
            "--enable_oplog=true",
            "--enable_ha=false",
            "--enable_metric_reporting=false",
            // Mooncake's SSD offload line: the master's side works (clients without a disk
            // tier are served as before).
            "--enable_offload=true",
            "--offloading_queue_limit=1000",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvferry master");
    let mut line = String::new();
    let stdout = child.stdout.take().expect("stdout");
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("read the master's line");
    let result = std::panic::catch_unwind(|| {
        assert!(line.starts_with("KVFERRY_MASTER"), "{line:?}");
        let field = |k: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(k))
                .unwrap_or_default()
                .to_string()
        };
        let rpc = field("rpc=");
        assert!(
            rpc.starts_with("127.0.0.1:") && !rpc.ends_with(":0"),
            "--rpc_port=0 picked a port: {line}"
        );
        let meta = field("metadata=");
        let meta_addr = meta
            .trim_start_matches("http://")
            .trim_end_matches("/metadata")
            .to_string();
        assert!(
            meta.starts_with("http://127.0.0.1:"),
            "the embedded metadata server is on: {line}"
        );

        let c = Client::setup(ClientConfig {
            global_segment_size: 16 << 20,
            local_buffer_size: 16 << 20,
            master_server_addr: rpc.clone(),
            transfer_timeout: Duration::from_secs(10),
            ..ClientConfig::default()
        })
        .expect("a client mounts on the master");
        c.put("mooncake-flags", b"served", &ReplicateConfig::default())
            .expect("put");
        assert_eq!(c.get("mooncake-flags").expect("get"), b"served");
        let _ = c.close();

        assert_eq!(http(&meta_addr, "PUT", "/metadata?key=k", b"v").0, 200);
        let (code, body) = http(&meta_addr, "GET", "/metadata?key=k", b"");
        assert!(code == 200 && body.ends_with("\r\n\r\nv"), "{body}");
        let metrics = field("http=");
        assert_eq!(
            http(&metrics, "GET", "/health", b"").0,
            200,
            "the metrics port serves"
        );
    });
    let _ = child.kill();
    let _ = child.wait();
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    if let Err(p) = result {
        eprintln!("master stderr:\n{err}");
        std::panic::resume_unwind(p);
    }
    // (Mooncake's oplog replication is what kvferry's HA does anyway: a warning, not an error.)
    for name in [
        "--rpc_thread_num=4",
        "--memory_allocator=offset",
        "--enable_oplog=true",
    ] {
        assert_eq!(
            err.lines()
                .filter(|l| l.contains("warning") && l.contains(name))
                .count(),
            1,
            "one warning line for {name}: {err}"
        );
    }
}

#[test]
fn master_refuses_mooncake_features_it_lacks_by_name() {
    for (args, name) in [
        (&["--enable_snapshot=true"][..], "--enable_snapshot"),
        (&["--enable_ha=true"], "--ha-backend-connstring"),
        (&["--ha_backend_type=redis"], "--ha_backend_type"),
        (&["-enable_cxl"], "--enable_cxl"),
        (&["--rpc_interface", "eth0"], "--rpc_interface"),
        (
            &["--dynamic_replication_mode=enforce"],
            "--dynamic_replication_mode",
        ),
        (&["--no_such_mooncake_flag=1"], "--no_such_mooncake_flag"),
        // Out of mooncake_master 0.3.14's range (2..60), which it refuses too.
        (
            &["--ha_leader_lease_ttl_sec=1"],
            "--ha_leader_lease_ttl_sec",
        ),
    ] {
        let child = Command::new(env!("CARGO_BIN_EXE_kvferry"))
            .args(["master", "--rpc_port=0", "--metrics_port=-1"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run kvferry master");
        // Bounded: a master that accepted the flag would serve forever.
        let pid = child.id();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(child.wait_with_output());
        });
        let out = match rx.recv_timeout(std::time::Duration::from_secs(20)) {
            Ok(out) => out.expect("wait for kvferry master"),
            Err(_) => {
                // SAFETY: a signal to the child this test started, by pid.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
                panic!("{args:?} must be refused, but the master started and kept running");
            }
        };
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} must be refused");
        assert!(
            err.contains(name),
            "{args:?}: the error names {name}: {err}"
        );
        assert!(out.stdout.is_empty(), "{args:?}: nothing served");
    }
}

/// A launch line of stock `mooncake_master` 0.3.14 (the nine flags it added, and the deprecated
/// --client_ttl beside its canonical name) starts `kvferry master` with only the binary
/// changed: a client mounts, puts and gets; one warning line per flag without effect here.
#[test]
fn master_takes_a_mooncake_0_3_14_launch_line() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args([
            "master",
            "--rpc_port=0",
            "--rpc_address=127.0.0.1",
            "--metrics_port=-1",
            "--client_ttl=3",
            "--client_active_ttl_sec=7",
            "--client_suspicion_ttl_sec=20",
            "--ha_leader_lease_ttl_sec=9",
            "--handler_worker_thread_num=4",
            "--enable_oplog_snapshot=false",
            "--snapshot_chunk_object_count=1000",
            "--tenant_eviction_high_watermark_ratio=0.8",
            "--weight_import_idle_timeout_ms=300000",
            "--weight_management_oplog_capability_confirmed=false",
            "--enable_http_metadata_server=false",
            "--enable_metric_reporting=false",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvferry master");
    let mut line = String::new();
    let stdout = child.stdout.take().expect("stdout");
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("read the master's line");
    let result = std::panic::catch_unwind(|| {
        assert!(line.starts_with("KVFERRY_MASTER"), "{line:?}");
        let rpc = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("rpc="))
            .unwrap_or_default()
            .to_string();
        let c = Client::setup(ClientConfig {
            global_segment_size: 16 << 20,
            local_buffer_size: 16 << 20,
            master_server_addr: rpc,
            transfer_timeout: Duration::from_secs(10),
            ..ClientConfig::default()
        })
        .expect("a client mounts on the master");
        c.put("mc-0.3.14", b"served", &ReplicateConfig::default())
            .expect("put");
        assert_eq!(c.get("mc-0.3.14").expect("get"), b"served");
        let _ = c.close();
    });
    let _ = child.kill();
    let _ = child.wait();
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    if let Err(p) = result {
        eprintln!("master stderr:\n{err}");
        std::panic::resume_unwind(p);
    }
    for name in [
        "--client_ttl=3 is not used",
        "--client_suspicion_ttl_sec=20",
        "--handler_worker_thread_num=4",
        "--enable_oplog_snapshot=false",
        "--snapshot_chunk_object_count=1000",
        "--tenant_eviction_high_watermark_ratio=0.8",
        "--weight_import_idle_timeout_ms=300000",
        "--weight_management_oplog_capability_confirmed=false",
    ] {
        assert_eq!(
            err.lines()
                .filter(|l| l.contains("warning") && l.contains(name))
                .count(),
            1,
            "one warning line for {name}: {err}"
        );
    }
    // Implemented, so not warned about.
    for name in ["--client_active_ttl_sec", "--ha_leader_lease_ttl_sec"] {
        assert!(
            !err.contains(&format!("flag {name}")),
            "{name} is not ignored: {err}"
        );
    }
}
