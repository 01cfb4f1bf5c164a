//! Interop with stock Mooncake (the PyPI wheel), both directions, on 127.0.0.1.
//!
//! The Mooncake side is `tests/interop/mooncake_peer.py`, run with the Python named by
//! `KVFERRY_MOONCAKE_PYTHON` (a venv with `mooncake-transfer-engine-non-cuda`; `scripts/test`
//! creates it). Without that variable these tests report that they did not run; with
//! `KVFERRY_REQUIRE_INTEROP=1` (set by `scripts/test`) a missing peer is a failure.

use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

fn python() -> Option<String> {
    match std::env::var("KVFERRY_MOONCAKE_PYTHON") {
        Ok(p) if !p.is_empty() => Some(p),
        _ => {
            assert!(
                std::env::var("KVFERRY_REQUIRE_INTEROP").is_err(),
                "KVFERRY_REQUIRE_INTEROP is set but KVFERRY_MOONCAKE_PYTHON is not: the Mooncake peer is missing"
            );
            eprintln!("NOT RUN: set KVFERRY_MOONCAKE_PYTHON to a Python with mooncake-transfer-engine-non-cuda (scripts/test does)");
            None
        }
    }
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/interop/mooncake_peer.py")
}

/// The peer script's pattern: byte i = (i*131 + seed*7 + (i >> 12)) & 0xff.
fn pattern(len: usize, seed: usize) -> Vec<u8> {
    (0..len).map(|i| ((i * 131 + seed * 7 + (i >> 12)) & 0xff) as u8).collect()
}

fn sha(b: &[u8]) -> String {
    Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect()
}

fn engine() -> TransferEngine {
    TransferEngine::new(Config { transfer_timeout: Duration::from_secs(10), ..Config::default() }).expect("engine")
}

/// Runs the Mooncake initiator against our segment; returns its JSON result.
fn mooncake_initiator(py: &str, env: &[(&str, &str)], segment: &str, addr: u64, size: usize, op: &str, block: usize, batch: usize, seed: usize) -> Value {
    let out = Command::new(py)
        .arg(script())
        .args(["initiator", "--segment", segment, "--remote-addr", &addr.to_string(), "--size", &size.to_string(), "--op", op])
        .args(["--block", &block.to_string(), "--batch", &batch.to_string(), "--seed", &seed.to_string()])
        .envs(env.iter().copied())
        .stderr(Stdio::piped())
        .output()
        .expect("run the Mooncake initiator");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).unwrap_or_else(|e| panic!("bad output {line:?} ({e}); stderr: {}", String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn mooncake_initiator_to_kvferry_target() {
    let Some(py) = python() else { return };
    let size = 16 << 20;
    let e = engine();
    let mem = vec![0u8; size];
    e.register_memory(mem.as_ptr() as u64, size as u64, "cpu:0").unwrap();
    let addr = mem.as_ptr() as u64;
    for (env, label) in [(vec![], "v2"), (vec![("MC_TCP_PROTO", "1")], "v1")] {
        for (block, batch, seed) in [(4096usize, 128usize, 1usize), (65536, 32, 2), (1 << 20, 4, 3), (16 << 20, 1, 4)] {
            let r = mooncake_initiator(&py, &env, e.segment_name(), addr, size, "write", block, batch, seed);
            assert_eq!(r["ok"], true, "{label} write block {block}: {r}");
            assert!(mem == pattern(size, seed), "{label}: bytes written by Mooncake (block {block}) landed exactly");
            let r = mooncake_initiator(&py, &env, e.segment_name(), addr, size, "read", block, batch, 0);
            assert_eq!(r["ok"], true, "{label} read block {block}: {r}");
            assert_eq!(r["sha256"], sha(&mem), "{label}: Mooncake read back our bytes (block {block})");
        }
    }
    // Out-of-range address: Mooncake's call fails, our memory is untouched.
    let before = sha(&mem);
    let r = mooncake_initiator(&py, &[], e.segment_name(), addr + size as u64 - 4096, 8192, "write", 8192, 1, 9);
    assert_eq!(r["ok"], false, "{r}");
    assert_eq!(sha(&mem), before);
    // The engine still serves: a good write after the rejection.
    let r = mooncake_initiator(&py, &[], e.segment_name(), addr, 4096, "write", 4096, 1, 5);
    assert_eq!(r["ok"], true, "{r}");
    // Probe from Mooncake.
    let out = Command::new(&py).arg(script()).args(["probe", "--segment", e.segment_name()]).output().unwrap();
    assert!(out.status.success(), "Mooncake probe of kvferry: {}", String::from_utf8_lossy(&out.stdout));
}

struct MooncakeTarget {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    segment: String,
    addr: u64,
}

impl MooncakeTarget {
    fn start(py: &str, env: &[(&str, &str)], size: usize, seed: usize) -> MooncakeTarget {
        let mut child = Command::new(py)
            .arg(script())
            .args(["target", "--size", &size.to_string(), "--seed", &seed.to_string()])
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the Mooncake target");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("target said {line:?}: {e}"));
        MooncakeTarget { segment: v["segment"].as_str().unwrap().to_string(), addr: v["addr"].as_u64().unwrap(), child, stdin, stdout }
    }

    fn ask(&mut self, cmd: &str) -> Value {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap()
    }
}

impl Drop for MooncakeTarget {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.child.wait();
    }
}

fn run(e: &TransferEngine, op: Opcode, local: &[u8], seg: u64, remote: u64, block: usize, batch: usize) -> kvferry::TransferStatus {
    let reqs: Vec<_> = (0..local.len() / block)
        .map(|i| TransferRequest { opcode: op, source: local.as_ptr() as u64 + (i * block) as u64, target_id: seg, target_offset: remote + (i * block) as u64, length: block as u64 })
        .collect();
    let mut last = None;
    for chunk in reqs.chunks(batch) {
        let st = e.transfer_sync(chunk, Duration::from_secs(30)).unwrap();
        if st.status != TaskStatus::Completed {
            return st;
        }
        last = Some(st);
    }
    last.unwrap()
}

#[test]
fn kvferry_initiator_to_mooncake_target() {
    let Some(py) = python() else { return };
    let size = 16 << 20;
    for (env, proto) in [(vec![], 2u32), (vec![], 1u32)] {
        let mut t = MooncakeTarget::start(&py, &env, size, 3);
        let e = TransferEngine::new(Config { tcp_proto: proto, ..Config::default() }).unwrap();
        let local = vec![0u8; size];
        e.register_memory(local.as_ptr() as u64, size as u64, "cpu:0").unwrap();
        let seg = e.open_segment(&t.segment).unwrap();
        let desc = e.segment_descriptor(seg).unwrap();
        assert_eq!(desc.tcp_version(), 2, "Mooncake advertises v2");
        for (block, batch) in [(4096usize, 128usize), (65536, 64), (1 << 20, 8), (16 << 20, 1)] {
            // READ Mooncake's pattern.
            let mut local_mut = local.clone();
            local_mut.fill(0);
            e.register_memory(local_mut.as_ptr() as u64, size as u64, "cpu:0").unwrap();
            let st = run(&e, Opcode::Read, &local_mut, seg, t.addr, block, batch);
            assert_eq!(st.status, TaskStatus::Completed, "v{proto} read block {block}: {st:?}");
            assert!(local_mut == pattern(size, 3), "v{proto}: read bytes match Mooncake's memory (block {block})");
            e.unregister_memory(local_mut.as_ptr() as u64).unwrap();
        }
        for (block, batch, seed) in [(4096usize, 128usize, 11usize), (65536, 64, 12), (1 << 20, 8, 13), (16 << 20, 1, 14)] {
            let src = pattern(size, seed);
            e.register_memory(src.as_ptr() as u64, size as u64, "cpu:0").unwrap();
            let st = run(&e, Opcode::Write, &src, seg, t.addr, block, batch);
            assert_eq!(st.status, TaskStatus::Completed, "v{proto} write block {block}: {st:?}");
            let theirs = t.ask(&format!("checksum 0 {size}"));
            assert_eq!(theirs["sha256"], sha(&src), "v{proto}: Mooncake's memory holds our bytes (block {block})");
            e.unregister_memory(src.as_ptr() as u64).unwrap();
        }
        // A bad address fails that task and leaves Mooncake's memory unchanged.
        let before = t.ask(&format!("checksum 0 {size}"));
        let st = e
            .transfer_sync(&[TransferRequest { opcode: Opcode::Write, source: local.as_ptr() as u64, target_id: seg, target_offset: t.addr + size as u64 - 10, length: 4096 }], Duration::from_secs(10))
            .unwrap();
        assert_eq!(st.status, TaskStatus::Failed);
        assert_eq!(t.ask(&format!("checksum 0 {size}")), before);
        // Notify and probe towards Mooncake.
        e.send_notify(&t.segment, "from-kvferry").unwrap();
        let n = t.ask("notifies");
        assert_eq!(n["notifies"][0][1], "from-kvferry", "{n}");
        assert_eq!(n["notifies"][0][0], e.segment_name());
        e.probe(&t.segment).unwrap();
        drop(e);
        let _ = &mut t;
    }
}
