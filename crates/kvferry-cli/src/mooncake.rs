//! Mooncake's `transfer_engine_bench`, run side by side with kvferry's bench on the same
//! machine, in the same invocation, with the same block size, batch size, thread count and
//! duration, so the report can state ratios rather than remembered numbers.

use crate::peers::{self, Peer};
use crate::sys;
use serde::Serialize;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

#[derive(Debug, Clone, Serialize)]
pub struct McPoint {
    pub engine: &'static str,
    /// `tcp` or `rdma`.
    pub protocol: &'static str,
    pub op: String,
    pub block_bytes: u64,
    pub batch: usize,
    pub threads: usize,
    pub gbps: f64,
    pub initiator_cpu_s_per_gb: f64,
    pub target_cpu_s_per_gb: f64,
}

#[derive(Default)]
pub struct SideBySide {
    points: Vec<McPoint>,
    /// Why points are missing (not run, failed, killed), one line each.
    notes: Vec<String>,
}

impl SideBySide {
    pub fn points(&self) -> &[McPoint] {
        &self.points
    }

    /// Mooncake's throughput at a point, over `protocol` (`tcp` or `rdma`).
    pub fn gbps(&self, protocol: &str, op: &str, block: u64) -> Option<f64> {
        self.points
            .iter()
            .find(|p| p.protocol == protocol && p.op == op && p.block_bytes == block)
            .map(|p| p.gbps)
            .filter(|g| *g > 0.0)
    }

    pub fn print(&self) {
        if !self.points.is_empty() {
            println!("\nMooncake transfer_engine_bench (same machine, same run):");
            println!(
                "{:<6} {:>8} {:>9} {:>8} {:>9} {:>9}",
                "op", "block", "transport", "GB/s", "init cpu", "tgt cpu"
            );
            for p in &self.points {
                println!(
                    "{:<6} {:>8} {:>9} {:>8.3} {:>9.3} {:>9.3}",
                    p.op,
                    sys::human(p.block_bytes),
                    p.protocol,
                    p.gbps,
                    p.initiator_cpu_s_per_gb,
                    p.target_cpu_s_per_gb
                );
            }
        }
        for n in &self.notes {
            println!("\nmooncake: {n}");
        }
    }
}

fn find_binary(arg: Option<&str>) -> Result<String, String> {
    let choice = arg
        .map(str::to_string)
        .or_else(|| std::env::var("KVFERRY_MOONCAKE_BENCH").ok());
    match choice.as_deref() {
        Some("none") => Err("not run (disabled)".into()),
        Some(p) => Ok(p.to_string()),
        None => {
            let path = std::env::var_os("PATH").unwrap_or_default();
            std::env::split_paths(&path)
                .map(|d| d.join("transfer_engine_bench"))
                .find(|p| p.is_file())
                .map(|p| p.display().to_string())
                .ok_or_else(|| "not run: transfer_engine_bench not found; `pip install mooncake-transfer-engine-non-cuda` (needs libibverbs1) and pass --mooncake PATH or set KVFERRY_MOONCAKE_BENCH".into())
        }
    }
}

struct Target {
    peer: Peer,
    segment: String,
}

impl Target {
    fn start(bin: &str, proto: &Proto, host: &str, buffer: u64) -> Result<Target, String> {
        // Its own process group: the console script runs the real binary as a child, and
        // stopping the group stops both.
        let mut peer = Peer::spawn(
            Command::new(bin)
                .envs(proto.env())
                .args([
                    "--mode=target",
                    "--metadata_server=P2PHANDSHAKE",
                    &format!("--local_server_name={host}"),
                    &format!("--buffer_size={buffer}"),
                ])
                .args(proto.args())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped()),
        )
        .map_err(|e| format!("cannot start {bin}: {e}"))?;
        let err = peer.child.stderr.take().ok_or("no stderr")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if !sent {
                    if let Some(i) = line.find("listening on ") {
                        let seg = line[i + "listening on ".len()..]
                            .split_whitespace()
                            .next()
                            .unwrap_or("")
                            .to_string();
                        let _ = tx.send(seg);
                        sent = true;
                    }
                }
            }
        });
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(segment) if !segment.is_empty() => Ok(Target { peer, segment }),
            _ => Err("Mooncake target did not print its address within 30 s".into()), // (its group is killed on drop)
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn run_point(
    bin: &str,
    proto: &Proto,
    t: &Target,
    host: &str,
    buffer: u64,
    op: &str,
    block: u64,
    batch: usize,
    threads: usize,
    duration: u64,
    bound: Duration,
) -> Result<McPoint, String> {
    let tgt0 = sys::tree_cpu(t.peer.id());
    let kids0 = sys::children_cpu();
    let mut cmd = Command::new(bin);
    cmd.envs(proto.env()).args(proto.args()).args([
        "--mode=initiator",
        "--metadata_server=P2PHANDSHAKE",
        &format!("--local_server_name={host}"),
        &format!("--segment_id={}", t.segment),
        &format!("--operation={op}"),
        &format!("--buffer_size={buffer}"),
        &format!("--threads={threads}"),
        &format!("--batch_size={batch}"),
        &format!("--block_size={block}"),
        &format!("--duration={duration}"),
    ]);
    let bound = Duration::from_secs(duration) + bound;
    let out =
        peers::output_within(&mut cmd, bound).map_err(|e| format!("cannot run {bin}: {e}"))?;
    let init_cpu = (sys::children_cpu() - kids0).as_secs_f64();
    let tgt_cpu = sys::tree_cpu(t.peer.id())
        .saturating_sub(tgt0)
        .as_secs_f64();
    let err = String::from_utf8_lossy(&out.stderr);
    let line = err.lines().find(|l| l.contains("Test completed")).ok_or_else(|| {
        let tail: Vec<&str> = err.lines().rev().take(3).collect();
        match out.status {
            None => format!("Mooncake {op} {} x {batch} did not finish within {bound:?} (killed; --peer-timeout sets the bound): {}", sys::human(block), tail.join(" | ")),
            Some(s) => format!("Mooncake {op} {} x {batch} printed no result (exit {:?}): {}", sys::human(block), s.code(), tail.join(" | ")),
        }
    })?;
    // "Test completed: duration 3.00, batch count 2194, throughput 0.77 GB/s"
    let num_after = |key: &str| -> Option<f64> {
        line.split(key)
            .nth(1)?
            .trim()
            .split([',', ' '])
            .next()?
            .parse()
            .ok()
    };
    let secs = num_after("duration").ok_or("no duration in Mooncake's result")?;
    let batches = num_after("batch count").ok_or("no batch count in Mooncake's result")?;
    // Recompute from counts rather than trusting the rounded throughput.
    let gb = batches * batch as f64 * block as f64 / 1e9;
    Ok(McPoint {
        engine: "mooncake",
        protocol: proto.name(),
        op: op.to_string(),
        block_bytes: block,
        batch,
        threads,
        gbps: gb / secs,
        initiator_cpu_s_per_gb: init_cpu / gb,
        target_cpu_s_per_gb: tgt_cpu / gb,
    })
}

/// Which of Mooncake's transports a side-by-side run uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Proto {
    /// `--protocol=tcp` (and `MC_FORCE_TCP=1`).
    Tcp,
    /// `--protocol=rdma --device_name=<these, comma-separated>`.
    Rdma(Vec<String>),
}

impl Proto {
    fn name(&self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Rdma(_) => "rdma",
        }
    }
    fn env(&self) -> Vec<(&'static str, &'static str)> {
        match self {
            Proto::Tcp => vec![("MC_FORCE_TCP", "1")],
            Proto::Rdma(_) => vec![],
        }
    }
    fn args(&self) -> Vec<String> {
        match self {
            Proto::Tcp => vec!["--protocol=tcp".into()],
            Proto::Rdma(devices) => vec![
                "--protocol=rdma".into(),
                format!("--device_name={}", devices.join(",")),
            ],
        }
    }
}

/// Runs Mooncake's bench over each of `protos` (a target, then one initiator run per point).
#[allow(clippy::too_many_arguments)]
pub fn run_side_by_side(
    path: Option<&str>,
    protos: &[Proto],
    host: &str,
    buffer: u64,
    ops: &[String],
    blocks: &[u64],
    batch: usize,
    threads: usize,
    duration: f64,
    bound: Duration,
) -> SideBySide {
    let bin = match find_binary(path) {
        Ok(b) => b,
        Err(note) => {
            return SideBySide {
                points: Vec::new(),
                notes: vec![note],
            }
        }
    };
    // Mooncake's initiator addresses k * block for k < threads * batch: size both sides for that.
    let need = blocks
        .iter()
        .map(|b| b * (threads * batch) as u64)
        .max()
        .unwrap_or(0)
        .max(buffer);
    let mut out = SideBySide::default();
    for proto in protos {
        let t = match Target::start(&bin, proto, host, need) {
            Ok(t) => t,
            Err(e) => {
                out.notes.push(format!(
                    "{} ({}): {e}",
                    proto.name(),
                    proto.args().join(" ")
                ));
                continue;
            }
        };
        let secs = duration.ceil().max(1.0) as u64;
        for op in ops {
            for &block in blocks {
                eprint!(
                    "\r\x1b[K[mooncake {}] {op} {} x {batch} ...",
                    proto.name(),
                    sys::human(block)
                );
                match run_point(
                    &bin, proto, &t, host, need, op, block, batch, threads, secs, bound,
                ) {
                    Ok(p) => out.points.push(p),
                    Err(e) => out.notes.push(e),
                }
            }
        }
    }
    eprint!("\r\x1b[K");
    out
}
