//! Mixed fleets: kvferry engines and stock Mooncake engines (the PyPI wheel, driven by
//! `tests/interop/mooncake_peer.py --metadata`) share one metadata service and move data both
//! ways over TCP, WRITE and READ, bytes verified with the other side's own checksum. Services:
//! `kvferry metadata-server`, Mooncake's `mooncake_http_metadata_server`, and a real etcd;
//! and Mooncake 0.3.14 engines with kvferry engines on a `kvferry metadata-server` that holds
//! a token (`MC_METADATA_HTTP_TOKEN`), which both sides send.

#[path = "../../kvferry/tests/metadata_services/mod.rs"]
mod metadata_services;

use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest};
use metadata_services::mooncake_peer::{self, pattern, sha, MooncakeTarget};
use metadata_services::Service;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

fn config(url: &str, name: &str, token: Option<&str>) -> Config {
    Config {
        local_hostname: name.into(),
        metadata_server: url.into(),
        advertise_address: Some("127.0.0.1".into()),
        transfer_timeout: Duration::from_secs(15),
        metadata_http_token: token.map(str::to_string),
        ..Config::default()
    }
}

fn engine(url: &str, name: &str, token: Option<&str>) -> TransferEngine {
    TransferEngine::new(config(url, name, token)).unwrap_or_else(|e| panic!("{name} on {url}: {e}"))
}

/// The environment of a Mooncake process that holds `token`.
fn token_env(token: Option<&str>) -> Vec<(&str, &str)> {
    token
        .map(|t| vec![("MC_METADATA_HTTP_TOKEN", t)])
        .unwrap_or_default()
}

/// A Mooncake target registered under `name` in the service at `url`.
fn mc_target(
    py: &str,
    url: &str,
    name: &str,
    size: usize,
    seed: usize,
    token: Option<&str>,
) -> MooncakeTarget {
    let t = MooncakeTarget::start(
        py,
        &["--metadata", url, "--name", name],
        &token_env(token),
        size,
        seed,
    );
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
    token: Option<&str>,
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
    mooncake_peer::run(py, &args, &token_env(token))
}

/// Both directions through one metadata service.
fn mixed_fleet(py: &str, url: &str, tag: &str, token: Option<&str>) {
    let size = 4 << 20;
    // Mooncake target, kvferry initiator: open by name through the service, WRITE, READ.
    let mc_name = format!("mc-target-{tag}");
    let mut t = mc_target(py, url, &mc_name, size, 3, token);
    let kvf = engine(url, &format!("kvf-initiator-{tag}"), token);
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
    let target = engine(url, &kvf_name, token);
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
        token,
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
        token,
    );
    assert_eq!(r["ok"], true, "{tag}: Mooncake READ from kvferry: {r}");
    assert_eq!(r["sha256"], sha(&mem), "{tag}: Mooncake read our bytes");
}

fn kvferry_server() -> (Child, u16) {
    kvferry_server_with(None)
}

/// `kvferry metadata-server` on a free port, holding `token` (MC_METADATA_HTTP_TOKEN).
fn kvferry_server_with(token: Option<&str>) -> (Child, u16) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvferry"));
    cmd.args(["metadata-server", "--port", "0"])
        .env_remove("MC_METADATA_HTTP_TOKEN")
        .env_remove("KVFERRY_METADATA_HTTP_TOKEN");
    if let Some(t) = token {
        cmd.env("MC_METADATA_HTTP_TOKEN", t);
    }
    let mut child = cmd.stdout(Stdio::piped()).spawn().unwrap();
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
    mixed_fleet(
        &py,
        &format!("http://127.0.0.1:{port}/metadata"),
        "kvfhttp",
        None,
    );
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
    mixed_fleet(&py, &svc.url(), "mchttp", None);
}

#[test]
fn mooncake_and_kvferry_through_etcd() {
    let Some(py) = mooncake_peer::python() else {
        return;
    };
    let Some(svc) = Service::etcd() else { return };
    mixed_fleet(&py, &svc.url(), "etcd", None);
}

/// Mooncake 0.3.14 engines and kvferry engines sharing one token on one `kvferry
/// metadata-server` that holds it: both ways, WRITE and READ, bytes verified. With another
/// token (or none) either side is refused at start: the server answers 401, kvferry's error
/// says which variable to set, and 0.3.14's `initialize` fails.
#[test]
fn mooncake_0_3_14_and_kvferry_share_a_metadata_token() {
    let Some(py) = mooncake_peer::python_0_3_14() else {
        return;
    };
    let token = "kvferry-test-token-0123456789abcdef";
    let (mut child, port) = kvferry_server_with(Some(token));
    let url = format!("http://127.0.0.1:{port}/metadata");
    let result = std::panic::catch_unwind(|| {
        mixed_fleet(&py, &url, "token314", Some(token));
        // kvferry with another token, or none: refused, and told what to set.
        for (bad, says) in [
            (Some("not-the-token"), "refused this engine's token"),
            (None, "requires a token"),
        ] {
            let e = TransferEngine::new(config(&url, "kvf-bad-token", bad))
                .err()
                .unwrap_or_else(|| panic!("a kvferry engine with token {bad:?} must be refused"))
                .to_string();
            assert!(
                e.contains("401") && e.contains(says) && e.contains("MC_METADATA_HTTP_TOKEN"),
                "{bad:?}: {e}"
            );
        }
        // Mooncake 0.3.14 with another token: its initialize fails.
        let out = Command::new(&py)
            .arg(mooncake_peer::script())
            .args([
                "target",
                "--size",
                "4096",
                "--metadata",
                &url,
                "--name",
                "mc-bad-token",
            ])
            .env("MC_METADATA_HTTP_TOKEN", "not-the-token")
            .env("MC_FORCE_TCP", "1")
            .stdin(Stdio::null())
            .output()
            .expect("run mooncake_peer.py");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("initialize failed") && err.contains("http=401"),
            "Mooncake 0.3.14 with another token: {err}"
        );
    });
    let _ = child.kill();
    let _ = child.wait();
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
}
