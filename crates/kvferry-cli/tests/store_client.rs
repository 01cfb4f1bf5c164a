//! `kvferry store-client` (Mooncake's `mooncake_client`): a process that contributes a segment
//! to a `kvferry master` and serves it until SIGTERM, all on 127.0.0.1.

mod common;
use common::master_segments;
use kvferry_store::{Client, ClientConfig, ReplicateConfig, StoreError};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

struct Proc {
    child: Child,
    out: BufReader<ChildStdout>,
    line: String,
}

impl Proc {
    fn start(args: &[&str], tag: &str) -> Proc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvferry"))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn kvferry");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        out.read_line(&mut line).expect("first line");
        assert!(line.starts_with(tag), "{tag} expected, got {line:?}");
        Proc { child, out, line }
    }
    fn field(&self, key: &str) -> String {
        self.line
            .split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .expect("field")
            .to_string()
    }
    /// Sends `sig` to this process (only the one this test started) and waits up to 10 s.
    fn signal_and_wait(&mut self, sig: rustix::process::Signal) -> std::process::ExitStatus {
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32)
            .expect("a child pid is positive");
        rustix::process::kill_process(pid, sig).expect("signalling our own child");
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                return st;
            }
            assert!(
                Instant::now() < until,
                "the store-client did not exit within 10 s of signal {sig:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn master() -> Proc {
    Proc::start(
        &[
            "master",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--summary-interval",
            "0",
        ],
        "KVFERRY_MASTER",
    )
}

fn value(key: &str, len: usize) -> Vec<u8> {
    let seed = xxhash_rust::xxh3::xxh3_64(key.as_bytes());
    (0..len)
        .map(|i| (seed.rotate_left((i % 64) as u32) as u8) ^ (i as u8))
        .collect()
}

fn run_store_client(sig: rustix::process::Signal) {
    let m = master();
    let rpc = m.field("rpc=");
    let http = m.field("http=");
    // Mooncake's mooncake_client spellings (gflags), as its deployment scripts pass them.
    let master_flag = format!("--master_server_address={rpc}");
    let mut sc = Proc::start(
        &[
            "store-client",
            &master_flag,
            "--global_segment_size=32MB",
            "--metadata_server",
            "P2PHANDSHAKE",
            "-host=127.0.0.1",
            "--protocol=tcp",
            "--port=0",
        ],
        "KVFERRY_STORE_CLIENT",
    );
    let seg = sc.field("segment=");
    assert_eq!(sc.field("size="), (32u64 << 20).to_string());
    assert_eq!(sc.field("dummy="), "off");
    assert!(seg.starts_with("127.0.0.1:"), "{seg}");
    assert!(
        master_segments(&http).contains(&format!("\"{seg}\"")),
        "the master lists the store-client's segment"
    );

    // A client with no segment of its own: every value lands in the store-client's segment.
    let c = Client::setup(ClientConfig {
        global_segment_size: 0,
        local_buffer_size: 16 << 20,
        master_server_addr: rpc.clone(),
        transfer_timeout: Duration::from_secs(10),
        ..ClientConfig::default()
    })
    .expect("client setup");
    let keys: Vec<String> = (0..16).map(|i| format!("sc-{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        c.put(k, &value(k, 1000 + i * 40_000), &ReplicateConfig::default())
            .expect("put");
    }
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(c.get(k).expect("get"), value(k, 1000 + i * 40_000), "{k}");
    }
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    for d in c.batch_get_replica_desc(&refs) {
        let d = d.expect("replicas");
        assert!(
            !d.is_empty() && d.iter().all(|r| r.te_endpoint == seg),
            "{d:?}"
        );
    }

    let st = sc.signal_and_wait(sig);
    assert!(st.success(), "clean exit after signal {sig:?}: {st:?}");
    let mut rest = String::new();
    let _ = sc.out.read_to_string(&mut rest);
    assert!(
        rest.contains(&format!("KVFERRY_STORE_CLIENT unmounted segment={seg}")),
        "{rest:?}"
    );
    assert!(
        !master_segments(&http).contains(&format!("\"{seg}\"")),
        "unmounted: the master no longer lists it"
    );
    // Its objects went with it.
    assert!(matches!(
        c.get(&keys[0]),
        Err(StoreError::ObjectNotFound(_))
    ));
    c.close().expect("close");
}

#[test]
fn store_client_serves_its_segment_until_sigterm() {
    run_store_client(rustix::process::Signal::TERM);
}

#[test]
fn store_client_unmounts_on_sigint() {
    run_store_client(rustix::process::Signal::INT);
}

#[test]
fn store_client_refuses_what_it_cannot_do() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
            .args(args)
            .env_remove("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH")
            .stdin(Stdio::null())
            .output()
            .expect("run kvferry");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    // Mooncake's --enable_offload takes its directory from MOONCAKE_OFFLOAD_FILE_STORAGE_PATH.
    let (code, err) = run(&["store-client", "--enable_offload=true"]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("--enable_offload") && err.contains("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH"),
        "{err}"
    );
    let (code, err) = run(&[
        "store-client",
        "--global_segment_size=0",
        "--master_server_address=127.0.0.1:1",
    ]);
    assert_eq!(code, Some(1));
    assert!(err.contains("global_segment_size is 0"), "{err}");
    let (code, err) = run(&[
        "store-client",
        "--global_segment_size=1MB",
        "--master_server_address=127.0.0.1:1",
    ]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("cannot reach the master at 127.0.0.1:1"),
        "{err}"
    );
}

/// A port nothing listens on right now (bound and released: good enough on 127.0.0.1).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// Asks the dummy-client service at `addr` with `request`; the answer line as JSON.
fn ask(addr: &str, request: &[u8]) -> serde_json::Value {
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the dummy-client service");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    s.write_all(request).expect("request");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("answer, then EOF");
    serde_json::from_str(out.trim_end()).unwrap_or_else(|e| panic!("{out:?}: {e}"))
}

#[test]
fn dummy_clients_learn_the_pool_from_the_service_and_join_it() {
    let m = master();
    let rpc = m.field("rpc=");
    let port = free_port();
    let sc = Proc::start(
        &[
            "store-client",
            &format!("--master_server_address={rpc}"),
            "--global_segment_size=32MB",
            "--host=127.0.0.1",
            &format!("--port={port}"),
        ],
        "KVFERRY_STORE_CLIENT",
    );
    let seg = sc.field("segment=");
    let addr = format!("127.0.0.1:{port}");
    assert_eq!(sc.field("dummy="), addr);
    // A client that connects and says nothing does not hold the service up...
    let silent = std::net::TcpStream::connect(&addr).expect("connect");
    let t0 = Instant::now();
    let info = ask(&addr, b"KVFERRY-DUMMY 1\n");
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "answered while another client stalls: {:?}",
        t0.elapsed()
    );
    assert_eq!(info["master_server_address"], rpc.as_str());
    assert_eq!(info["metadata_server"], "P2PHANDSHAKE");
    assert_eq!(info["protocol"], "tcp");
    assert_eq!(info["host"], "127.0.0.1");
    assert_eq!(info["segment"], seg.as_str());
    // ...and is closed after the I/O timeout.
    let mut silent = silent;
    silent
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut junk = String::new();
    let t1 = Instant::now();
    let _ = silent.read_to_string(&mut junk);
    assert!(
        t1.elapsed() < Duration::from_secs(4),
        "a silent client is dropped after 2 s, not {:?}",
        t1.elapsed()
    );
    assert!(junk.contains("error"), "{junk:?}");
    // Anything else (a stock Mooncake dummy client's RPC bytes, say) gets an error, not the pool.
    let bad = ask(&addr, b"\x00\x01\x02 not the hello\n");
    assert!(
        bad["error"]
            .as_str()
            .unwrap_or_default()
            .contains("KVFERRY-DUMMY 1"),
        "{bad}"
    );
    // What setup_dummy does with the answer: a client with no segment of its own, same pool.
    let c = Client::setup(ClientConfig {
        local_hostname: info["host"].as_str().unwrap_or_default().to_string(),
        metadata_server: info["metadata_server"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        protocol: info["protocol"].as_str().unwrap_or_default().to_string(),
        master_server_addr: info["master_server_address"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        global_segment_size: 0,
        local_buffer_size: 8 << 20,
        transfer_timeout: Duration::from_secs(10),
        ..ClientConfig::default()
    })
    .expect("dummy client setup");
    c.put(
        "dummy-k",
        &value("dummy-k", 300_000),
        &ReplicateConfig::default(),
    )
    .expect("put");
    assert_eq!(c.get("dummy-k").expect("get"), value("dummy-k", 300_000));
    let d = c
        .batch_get_replica_desc(&["dummy-k"])
        .pop()
        .expect("one")
        .expect("replicas");
    assert!(
        d.iter().all(|r| r.te_endpoint == seg),
        "the value lives in the store-client's segment: {d:?}"
    );
    c.close().expect("close");
    // Another store-client cannot take the same service port: it says which flag to change.
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args([
            "store-client",
            &format!("--master_server_address={rpc}"),
            "--global_segment_size=1MB",
            &format!("--port={port}"),
        ])
        .stdin(Stdio::null())
        .output()
        .expect("run kvferry");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("127.0.0.1:{port}")) && err.contains("--port"),
        "{err}"
    );
}
