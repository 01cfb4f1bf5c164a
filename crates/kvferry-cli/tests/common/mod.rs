//! Helpers shared by the `kvferry` binary's tests: the binary, its `--json` record format, and
//! a `kvferry bench --mode target` child.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

pub fn kvferry() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvferry"))
}

/// The fields of one `kvferry bench --json` record, exactly.
pub const KEYS: [&str; 11] = [
    "op",
    "block_bytes",
    "batch",
    "gbps",
    "ops_per_s",
    "batch_p50_us",
    "batch_p99_us",
    "single_p50_us",
    "initiator_cpu_s_per_gb",
    "target_cpu_s_per_gb",
    "verified",
];

/// Reads a `--json` file: `expect` records, each with exactly [`KEYS`], verified, non-zero.
pub fn check_records(path: &std::path::Path, expect: usize) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap();
    let recs: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(recs.len(), expect, "{text}");
    for r in &recs {
        let obj = r.as_object().unwrap();
        assert_eq!(obj.len(), KEYS.len(), "exactly the documented fields: {r}");
        for k in KEYS {
            assert!(obj.contains_key(k), "missing {k} in {r}");
        }
        assert_eq!(r["verified"], true, "{r}");
        assert!(r["gbps"].as_f64().unwrap() > 0.0);
        assert!(r["single_p50_us"].as_f64().unwrap() > 0.0);
    }
    recs
}

/// A `kvferry bench --mode target` child; killed (by its pid) and reaped on drop.
pub struct BenchTarget {
    pub child: Child,
    pub segment: String,
    /// Address of its registered buffer.
    pub addr: u64,
}

impl BenchTarget {
    /// Starts a target with `args` after `bench --mode target` and reads its announcement.
    pub fn start(args: &[&str]) -> BenchTarget {
        let mut child = kvferry()
            .args(["bench", "--mode", "target"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let field = |k: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(k))
                .map(str::to_string)
        };
        let (Some(segment), Some(addr)) = (
            field("segment="),
            field("addr=").and_then(|a| a.parse().ok()),
        ) else {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the bench target did not announce itself: {line:?}");
        };
        BenchTarget {
            child,
            segment,
            addr,
        }
    }

    /// SIGKILL now (e.g. mid-transfer) and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for BenchTarget {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The body of the master's `GET /get_all_segments` at `http` (`host:port`).
pub fn master_segments(http: &str) -> String {
    master_segments_signed(http, None)
}

/// [`master_segments`] of a master holding the cluster key: the request signed with `key`
/// (`X-Kvferry-Auth`), as the route needs then.
#[allow(dead_code)]
pub fn master_segments_keyed(http: &str, key: &std::path::Path) -> String {
    master_segments_signed(
        http,
        Some(&kvferry::auth::ClusterKey::load(key).expect("the key file")),
    )
}

fn master_segments_signed(http: &str, key: Option<&kvferry::auth::ClusterKey>) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(http).expect("connect to the master's HTTP port");
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .expect("timeout");
    let auth = key
        .map(|k| {
            format!(
                "{}: {}\r\n",
                kvferry::auth_http::HEADER,
                kvferry::auth_http::sign_now(k, "GET", "/get_all_segments", b"")
            )
        })
        .unwrap_or_default();
    write!(
        s,
        "GET /get_all_segments HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n"
    )
    .expect("request");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out.split_once("\r\n\r\n")
        .map(|x| x.1.to_string())
        .unwrap_or_default()
}

/// Sends SIGSTOP to `pid` (a process this test started, by its pid) and returns once every
/// one of its threads has stopped. `kill` returns before that: one thread takes the signal
/// and stops the others as it handles it, so on a loaded host another thread may still run
/// for a while (a paused standby acknowledged an entry sent after the `kill` in CI).
pub fn pause(pid: u32) {
    use rustix::process::{kill_process, Pid, Signal};
    let p = i32::try_from(pid)
        .ok()
        .and_then(Pid::from_raw)
        .unwrap_or_else(|| panic!("{pid} is not a process id"));
    kill_process(p, Signal::STOP).unwrap_or_else(|e| panic!("kill({pid}, SIGSTOP): {e}"));
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !all_threads_stopped(pid) {
        assert!(
            std::time::Instant::now() < until,
            "process {pid} did not stop within 10 s of SIGSTOP"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Whether every thread of `pid` is stopped (or gone), as `/proc/PID/task/*/stat` says.
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks
        .flatten()
        .all(|t| match std::fs::read_to_string(t.path().join("stat")) {
            // The state follows the command name, which is in parentheses and may hold any byte.
            Ok(stat) => stat.rsplit_once(')').is_some_and(|(_, rest)| {
                matches!(
                    rest.trim_start().chars().next(),
                    Some('T' | 't' | 'Z' | 'X')
                )
            }),
            Err(_) => true, // (the thread exited meanwhile)
        })
}
