//! Mixed fleets: kvferry engines and stock Mooncake engines (the PyPI wheel, driven by
//! `tests/interop/mooncake_peer.py --metadata`) share one metadata service and move data both
//! ways over TCP, WRITE and READ, bytes verified with the other side's own checksum. Services:
//! `kvferry metadata-server`, Mooncake's `mooncake_http_metadata_server`, and a real etcd.

#[path = "../../kvferry/tests/metadata_services/mod.rs"]
mod metadata_services;

use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest};
use metadata_services::mooncake_peer::{self, pattern, sha, MooncakeTarget};
use metadata_services::Service;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

fn engine(url: &str, name: &str) -> TransferEngine {
    let cfg = Config {
        local_hostname: name.into(),
        metadata_server: url.into(),
        advertise_address: Some("127.0.0.1".into()),
        transfer_timeout: Duration::from_secs(15),
        ..Config::default()
    };
    TransferEngine::new(cfg).unwrap_or_else(|e| panic!("{name} on {url}: {e}"))
}

/// A Mooncake target registered under `name` in the service at `url`.
fn mc_target(py: &str, url: &str, name: &str, size: usize, seed: usize) -> MooncakeTarget {
    let t = MooncakeTarget::start(py, &["--metadata", url, "--name", name], &[], size, seed);
    assert_eq!(
        t.segment, name,
        "Mooncake's central-mode segment name is its local_hostname"
    );
    t
}

#[allow(clippy::too_many_arguments)]
fn mc_initiator(
    py: &str,
    url: &str,
    name: &str,
    segment: &str,
    addr: u64,
    size: usize,
    op: &str,
    seed: usize,
) -> Value {
    let (addr, size, seed) = (addr.to_string(), size.to_string(), seed.to_string());
    let args = [
        "initiator",
        "--segment",
        segment,
        "--remote-addr",
        &addr,
        "--size",
        &size,
        "--op",
        op,
        "--block",
        "65536",
        "--batch",
        "16",
        "--seed",
        &seed,
        "--metadata",
        url,
        "--name",
        name,
    ];
    mooncake_peer::run(py, &args, &[])
}

/// Both directions through one metadata service.
fn mixed_fleet(py: &str, url: &str, tag: &str) {
    let size = 4 << 20;
    // Mooncake target, kvferry initiator: open by name through the service, WRITE, READ.
    let mc_name = format!("mc-target-{tag}");
    let mut t = mc_target(py, url, &mc_name, size, 3);
    let kvf = engine(url, &format!("kvf-initiator-{tag}"));
    let src = pattern(size, 5);
    let mut dst = vec![0u8; size];
    kvf.register_memory(src.as_ptr() as u64, size as u64, "cpu:0")
        .unwrap();
    kvf.register_memory(dst.as_mut_ptr() as u64, size as u64, "cpu:0")
        .unwrap();
    let id = kvf
        .open_segment(&mc_name)
        .unwrap_or_else(|e| panic!("{tag}: kvferry opens Mooncake's segment by name: {e}"));
    let w = TransferRequest {
        opcode: Opcode::Write,
        source: src.as_ptr() as u64,
        target_id: id,
        target_offset: t.addr,
        length: size as u64,
    };
    assert_eq!(
        kvf.transfer_sync(&[w], Duration::from_secs(15))
            .unwrap()
            .status,
        TaskStatus::Completed,
        "{tag}: kvferry WRITE to Mooncake"
    );
    assert_eq!(
        t.ask(&format!("checksum 0 {size}"))["sha256"],
        sha(&src),
        "{tag}: bytes landed in Mooncake's memory"
    );
    t.ask(&format!("fill 0 {size} 9"));
    let r = TransferRequest {
        opcode: Opcode::Read,
        source: dst.as_mut_ptr() as u64,
        target_id: id,
        target_offset: t.addr,
        length: size as u64,
    };
    assert_eq!(
        kvf.transfer_sync(&[r], Duration::from_secs(15))
            .unwrap()
            .status,
        TaskStatus::Completed,
        "{tag}: kvferry READ from Mooncake"
    );
    assert!(
        dst == pattern(size, 9),
        "{tag}: kvferry read Mooncake's bytes"
    );
    drop(t);

    // kvferry target, Mooncake initiator: Mooncake finds our segment in the same service.
    let kvf_name = format!("kvf-target-{tag}");
    let target = engine(url, &kvf_name);
    let mem = vec![0u8; size];
    target
        .register_memory(mem.as_ptr() as u64, size as u64, "cpu:0")
        .unwrap();
    let r = mc_initiator(
        py,
        url,
        &format!("mc-initiator-{tag}"),
        &kvf_name,
        mem.as_ptr() as u64,
        size,
        "write",
        4,
    );
    assert_eq!(r["ok"], true, "{tag}: Mooncake WRITE to kvferry: {r}");
    assert!(
        mem == pattern(size, 4),
        "{tag}: bytes written by Mooncake landed"
    );
    let r = mc_initiator(
        py,
        url,
        &format!("mc-reader-{tag}"),
        &kvf_name,
        mem.as_ptr() as u64,
        size,
        "read",
        0,
    );
    assert_eq!(r["ok"], true, "{tag}: Mooncake READ from kvferry: {r}");
    assert_eq!(r["sha256"], sha(&mem), "{tag}: Mooncake read our bytes");
}

fn kvferry_server() -> (Child, u16) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["metadata-server", "--port", "0"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("port="))
        .and_then(|p| p.parse().ok())
        .unwrap();
    (child, port)
}

#[test]
fn mooncake_and_kvferry_through_kvferry_metadata_server() {
    let Some(py) = mooncake_peer::python() else {
        return;
    };
    let (mut child, port) = kvferry_server();
    mixed_fleet(&py, &format!("http://127.0.0.1:{port}/metadata"), "kvfhttp");
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn mooncake_and_kvferry_through_mooncake_metadata_server() {
    let Some(py) = mooncake_peer::python() else {
        return;
    };
    let Some(svc) = Service::mooncake_http() else {
        return;
    };
    mixed_fleet(&py, &svc.url(), "mchttp");
}

#[test]
fn mooncake_and_kvferry_through_etcd() {
    let Some(py) = mooncake_peer::python() else {
        return;
    };
    let Some(svc) = Service::etcd() else { return };
    mixed_fleet(&py, &svc.url(), "etcd");
}
