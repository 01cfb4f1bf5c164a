//! `Client::with_engine`: a store client on a transfer engine that is already running (Mooncake's
//! `setup(..., engine)`), against a `kvferry master` process on 127.0.0.1.

mod common;
use common::master_segments;
use kvferry::{Config, TransferEngine};
use kvferry_store::{Client, ClientConfig, ReplicateConfig, StoreError};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

struct Master(Child, String, String);

impl Drop for Master {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn master() -> Master {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args([
            "master",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--summary-interval",
            "0",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn kvferry master");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("first line");
    let rpc = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("rpc="))
        .expect("rpc=")
        .to_string();
    let http = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("http="))
        .expect("http=")
        .to_string();
    Master(child, rpc, http)
}

fn cfg(master: &str, host: &str) -> ClientConfig {
    ClientConfig {
        local_hostname: host.into(),
        global_segment_size: 8 << 20,
        local_buffer_size: 8 << 20,
        master_server_addr: master.into(),
        transfer_timeout: Duration::from_secs(10),
        ..ClientConfig::default()
    }
}

fn engine() -> Arc<TransferEngine> {
    Arc::new(
        TransferEngine::new(Config {
            local_hostname: "127.0.0.1".into(),
            ..Config::default()
        })
        .expect("engine"),
    )
}

#[test]
fn client_on_a_shared_engine_mounts_its_segment_and_leaves_it_running() {
    let m = master();
    let e = engine();
    let before = e.registered().len();
    let c = Client::with_engine(cfg(&m.1, "127.0.0.1"), Arc::clone(&e), None).expect("with_engine");
    assert_eq!(
        c.segment_name(),
        e.segment_name(),
        "the store's segment is the engine's"
    );
    assert_eq!(
        e.registered().len(),
        before + 2,
        "segment and staging buffer registered on the shared engine"
    );
    let v: Vec<u8> = (0..300_000u32).map(|i| (i * 31 % 251) as u8).collect();
    c.put("k", &v, &ReplicateConfig::default()).expect("put");
    assert_eq!(c.get("k").expect("get"), v);
    c.close().expect("close");
    drop(c);
    assert_eq!(
        e.registered().len(),
        before,
        "closing the store withdraws its buffers from the engine"
    );
    assert!(e.probe(e.segment_name()).is_ok(), "the engine still serves");
    // Names other than the engine's are refused, naming both.
    let other = format!("127.0.0.1:{}", e.rpc_port().wrapping_add(1));
    for bad in ["127.0.0.2", other.as_str()] {
        match Client::with_engine(cfg(&m.1, bad), Arc::clone(&e), None) {
            Err(StoreError::InvalidParams(msg)) => {
                assert!(msg.contains(bad) && msg.contains(e.segment_name()), "{msg}")
            }
            Err(other) => panic!("{bad}: unexpected error {other}"),
            Ok(_) => panic!("{bad}: accepted a name that is not the engine's"),
        }
    }
}

#[test]
fn closing_the_shared_engine_first_fails_calls_clearly() {
    let m = master();
    let e = engine();
    let closed = Arc::new(AtomicBool::new(false));
    let c = Client::with_engine(cfg(&m.1, ""), Arc::clone(&e), Some(Arc::clone(&closed)))
        .expect("with_engine");
    c.put("a", b"before", &ReplicateConfig::default())
        .expect("put");
    let seg = format!("\"{}\"", c.segment_name());
    assert!(master_segments(&m.2).contains(&seg), "mounted");
    closed.store(true, Ordering::Release);
    for r in [
        c.put("b", b"after", &ReplicateConfig::default())
            .map(|_| Vec::new()),
        c.get("a"),
    ] {
        match r {
            Err(StoreError::InvalidParams(msg)) => {
                assert!(msg.contains("shares was closed"), "{msg}")
            }
            other => panic!("expected the closed-engine error, got {other:?}"),
        }
    }
    // The master stops listing the segment within a ping interval or two, not at close().
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while master_segments(&m.2).contains(&seg) {
        assert!(
            std::time::Instant::now() < until,
            "the closed engine's segment is still listed after 5 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    c.close()
        .expect("close after the segment went: nothing left to unmount, no error");
}

#[test]
fn failed_setup_on_a_shared_engine_leaves_nothing_registered() {
    let e = engine();
    let before = e.registered().len();
    // No master at 127.0.0.1:1: the mount fails after the buffers were registered.
    match Client::with_engine(cfg("127.0.0.1:1", ""), Arc::clone(&e), None) {
        Err(StoreError::Rpc(msg)) => assert!(
            msg.contains("cannot reach the master at 127.0.0.1:1"),
            "{msg}"
        ),
        Err(other) => panic!("unexpected error {other}"),
        Ok(_) => panic!("setup without a master succeeded"),
    }
    assert_eq!(
        e.registered().len(),
        before,
        "the segment and staging buffers were withdrawn from the engine"
    );
}
