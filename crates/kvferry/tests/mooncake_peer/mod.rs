//! The stock Mooncake side of interop tests: `tests/interop/mooncake_peer.py` run with the
//! Python named by `KVFERRY_MOONCAKE_PYTHON`, else the repository's `.venv/mooncake` (a venv
//! with `mooncake-transfer-engine-non-cuda`; `scripts/test` creates it). A missing peer fails
//! the test with the install command, unless `KVFERRY_SKIP_MOONCAKE=1` opts out explicitly:
//! then the test prints NOT RUN and returns.
//! Shared by `crates/kvferry/tests/interop_mooncake.rs` and
//! `crates/kvferry-cli/tests/metadata_interop.rs`.
#![allow(dead_code)]

use serde_json::Value;
use sha2::{Digest, Sha256};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// The interpreter with stock Mooncake; None (after saying NOT RUN) only when the caller opted
/// out with `KVFERRY_SKIP_MOONCAKE=1`. Panics, saying how to install it, when it is missing.
pub fn python() -> Option<String> {
    if let Ok(p) = std::env::var("KVFERRY_MOONCAKE_PYTHON") {
        if !p.is_empty() {
            return Some(p);
        }
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/mooncake/bin/python");
    if venv.is_file() {
        return Some(venv.to_string_lossy().into_owned());
    }
    if std::env::var("KVFERRY_SKIP_MOONCAKE").as_deref() == Ok("1") {
        eprintln!("NOT RUN (KVFERRY_SKIP_MOONCAKE=1): this test needs the stock Mooncake wheel");
        return None;
    }
    panic!(
        "the stock Mooncake peer is missing: set KVFERRY_MOONCAKE_PYTHON to a Python with mooncake-transfer-engine-non-cuda, \
         or create .venv/mooncake (python3 -m venv .venv/mooncake && .venv/mooncake/bin/pip install mooncake-transfer-engine-non-cuda; \
         scripts/test does), or set KVFERRY_SKIP_MOONCAKE=1 to leave the interop tests out"
    )
}

/// The interpreter with stock Mooncake 0.3.14 (`mooncake-transfer-engine-cuda13` with the
/// CUDA stand-ins: `scripts/mooncake-venv 0.3.14`): `KVFERRY_MOONCAKE314_PYTHON`, else the
/// repository's `.venv/mooncake314`. None (after saying NOT RUN) only with
/// `KVFERRY_SKIP_MOONCAKE=1`; panics, saying how to make it, when it is missing.
pub fn python_0_3_14() -> Option<String> {
    if std::env::var("KVFERRY_SKIP_MOONCAKE").as_deref() == Ok("1") {
        eprintln!("NOT RUN (KVFERRY_SKIP_MOONCAKE=1): this test needs stock Mooncake 0.3.14");
        return None;
    }
    if let Some(p) = std::env::var("KVFERRY_MOONCAKE314_PYTHON")
        .ok()
        .filter(|p| !p.is_empty())
    {
        assert!(
            std::path::Path::new(&p).is_file(),
            "KVFERRY_MOONCAKE314_PYTHON={p} is not a file: make it with scripts/mooncake-venv 0.3.14"
        );
        return Some(p);
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/mooncake314/bin/python");
    if venv.is_file() {
        return Some(venv.to_string_lossy().into_owned());
    }
    panic!(
        "stock Mooncake 0.3.14 is missing: make it with scripts/mooncake-venv 0.3.14 (scripts/test \
         does), or set KVFERRY_MOONCAKE314_PYTHON, or KVFERRY_SKIP_MOONCAKE=1 to leave the interop \
         tests out"
    )
}

pub fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/interop/mooncake_peer.py")
}

/// The peer script's pattern: byte i = (i*131 + seed*7 + (i >> 12)) & 0xff.
pub fn pattern(len: usize, seed: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 131 + seed * 7 + (i >> 12)) & 0xff) as u8)
        .collect()
}

pub fn sha(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// Runs the script once (`initiator`, `probe`) and returns its last JSON line.
pub fn run(py: &str, args: &[&str], env: &[(&str, &str)]) -> Value {
    let out = Command::new(py)
        .arg(script())
        .args(args)
        .envs(env.iter().copied())
        .stderr(Stdio::piped())
        .output()
        .expect("run mooncake_peer.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).unwrap_or_else(|e| {
        panic!(
            "mooncake_peer.py {args:?}: bad output {line:?} ({e}); stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// A Mooncake target process: a registered buffer filled with `pattern(size, seed)`,
/// answering `checksum`, `fill`, `notifies` commands; stopped on drop.
pub struct MooncakeTarget {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pub segment: String,
    pub addr: u64,
}

impl MooncakeTarget {
    /// `extra` adds script flags (e.g. `--metadata URL --name NAME`).
    pub fn start(
        py: &str,
        extra: &[&str],
        env: &[(&str, &str)],
        size: usize,
        seed: usize,
    ) -> MooncakeTarget {
        let mut child = Command::new(py)
            .arg(script())
            .args([
                "target",
                "--size",
                &size.to_string(),
                "--seed",
                &seed.to_string(),
            ])
            .args(extra)
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the Mooncake target");
        let stdin = child.stdin.take().expect("piped stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut line = String::new();
        stdout
            .read_line(&mut line)
            .expect("read the target's first line");
        let v: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("Mooncake target said {line:?}: {e}"));
        MooncakeTarget {
            segment: v["segment"].as_str().expect("segment").to_string(),
            addr: v["addr"].as_u64().expect("addr"),
            child,
            stdin,
            stdout,
        }
    }

    pub fn ask(&mut self, cmd: &str) -> Value {
        writeln!(self.stdin, "{cmd}").expect("write a command");
        self.stdin.flush().expect("flush");
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("read an answer");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{cmd}: {line:?}: {e}"))
    }
}

impl Drop for MooncakeTarget {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        // Mooncake's engine takes about a second to shut down; then stop it by pid.
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
