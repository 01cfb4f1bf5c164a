//! `kvferry store-client` (Mooncake's `mooncake_client`): a process that contributes a segment
//! to a `kvferry master` and serves it until SIGTERM, all on 127.0.0.1.

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
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvferry")).args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().expect("spawn kvferry");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        out.read_line(&mut line).expect("first line");
        assert!(line.starts_with(tag), "{tag} expected, got {line:?}");
        Proc { child, out, line }
    }
    fn field(&self, key: &str) -> String {
        self.line.split_whitespace().find_map(|w| w.strip_prefix(key)).expect("field").to_string()
    }
    /// Sends `sig` to this process (only the one this test started) and waits up to 10 s.
    fn signal_and_wait(&mut self, sig: rustix::process::Signal) -> std::process::ExitStatus {
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32).expect("a child pid is positive");
        rustix::process::kill_process(pid, sig).expect("signalling our own child");
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                return st;
            }
            assert!(Instant::now() < until, "the store-client did not exit within 10 s of signal {sig:?}");
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
    Proc::start(&["master", "--port", "0", "--metrics-port", "0", "--summary-interval", "0"], "KVFERRY_MASTER")
}

fn segments(http: &str) -> String {
    let mut s = std::net::TcpStream::connect(http).expect("connect to the master's HTTP port");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    write!(s, "GET /get_all_segments HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").expect("request");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out.split_once("\r\n\r\n").map(|x| x.1.to_string()).unwrap_or_default()
}

fn value(key: &str, len: usize) -> Vec<u8> {
    let seed = xxhash_rust::xxh3::xxh3_64(key.as_bytes());
    (0..len).map(|i| (seed.rotate_left((i % 64) as u32) as u8) ^ (i as u8)).collect()
}

fn run_store_client(sig: rustix::process::Signal) {
    let m = master();
    let rpc = m.field("rpc=");
    let http = m.field("http=");
    // Mooncake's mooncake_client spellings (gflags), as its deployment scripts pass them.
    let master_flag = format!("--master_server_address={rpc}");
    let mut sc = Proc::start(
        &["store-client", &master_flag, "--global_segment_size=32MB", "--metadata_server", "P2PHANDSHAKE", "-host=127.0.0.1", "--protocol=tcp", "--port=50052"],
        "KVFERRY_STORE_CLIENT",
    );
    let seg = sc.field("segment=");
    assert_eq!(sc.field("size="), (32u64 << 20).to_string());
    assert!(seg.starts_with("127.0.0.1:"), "{seg}");
    assert!(segments(&http).contains(&format!("\"{seg}\"")), "the master lists the store-client's segment");

    // A client with no segment of its own: every value lands in the store-client's segment.
    let c = Client::setup(ClientConfig { global_segment_size: 0, local_buffer_size: 16 << 20, master_server_addr: rpc.clone(), transfer_timeout: Duration::from_secs(10), ..ClientConfig::default() })
        .expect("client setup");
    let keys: Vec<String> = (0..16).map(|i| format!("sc-{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        c.put(k, &value(k, 1000 + i * 40_000), &ReplicateConfig::default()).expect("put");
    }
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(c.get(k).expect("get"), value(k, 1000 + i * 40_000), "{k}");
    }
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    for d in c.batch_get_replica_desc(&refs) {
        let d = d.expect("replicas");
        assert!(!d.is_empty() && d.iter().all(|r| r.te_endpoint == seg), "{d:?}");
    }

    let st = sc.signal_and_wait(sig);
    assert!(st.success(), "clean exit after signal {sig:?}: {st:?}");
    let mut rest = String::new();
    let _ = sc.out.read_to_string(&mut rest);
    assert!(rest.contains(&format!("KVFERRY_STORE_CLIENT unmounted segment={seg}")), "{rest:?}");
    assert!(!segments(&http).contains(&format!("\"{seg}\"")), "unmounted: the master no longer lists it");
    // Its objects went with it.
    assert!(matches!(c.get(&keys[0]), Err(StoreError::ObjectNotFound(_))));
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
        let out = Command::new(env!("CARGO_BIN_EXE_kvferry")).args(args).stdin(Stdio::null()).output().expect("run kvferry");
        (out.status.code(), String::from_utf8_lossy(&out.stderr).to_string())
    };
    let (code, err) = run(&["store-client", "--enable_offload=true"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("--enable_offload=true") && err.contains("not supported"), "{err}");
    let (code, err) = run(&["store-client", "--global_segment_size=0", "--master_server_address=127.0.0.1:1"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("global_segment_size is 0"), "{err}");
    let (code, err) = run(&["store-client", "--global_segment_size=1MB", "--master_server_address=127.0.0.1:1"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("cannot reach the master at 127.0.0.1:1"), "{err}");
}
