//! `kvferry bench`: the main job, measured.
//!
//! With no `--mode`, starts a target as a child process on 127.0.0.1 and runs the initiator
//! here. Every point is verified: the target hashes its own memory on request (a Notify
//! message) and the initiator compares with its side. Ceilings (single-thread memcpy, a
//! plain loopback socket stream) and, when available, Mooncake's `transfer_engine_bench`
//! run in the same invocation so the report can give ratios.

use crate::sys::{self, human, parse_secs, parse_size_nonzero, Buffer};
use clap::builder::RangedU64ValueParser;
use kvferry::auth::Protect;
use kvferry::TransportMode;
use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest};
use serde::Serialize;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

mod auth_ab;
mod workload;

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    Target,
    Initiator,
}

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Run one side only (for two hosts); default: both, as two processes on 127.0.0.1.
    #[arg(long, value_enum)]
    mode: Option<Mode>,
    /// The target's segment name (`host:port`, printed by `--mode target`).
    #[arg(long)]
    segment: Option<String>,
    /// Address advertised by this side.
    #[arg(long, default_value = "127.0.0.1")]
    local_hostname: String,
    /// Registered memory on each side.
    #[arg(long, default_value = "1GiB", value_parser = parse_size_nonzero)]
    buffer_size: u64,
    /// Block sizes to sweep.
    #[arg(long, default_value = "4K,64K,1M,16M", value_delimiter = ',', value_parser = parse_size_nonzero)]
    blocks: Vec<u64>,
    /// Requests per batch (1 to 65536).
    #[arg(long, default_value_t = 128, value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_BATCH))]
    batch: usize,
    /// Operations to sweep.
    #[arg(long, default_value = "write,read", value_delimiter = ',')]
    ops: Vec<String>,
    /// Seconds of measurement per point (at least one batch each).
    #[arg(long, default_value_t = 2.0, value_parser = parse_secs)]
    duration: f64,
    /// Initiator threads, each with its own batches in flight (1 to 1024).
    #[arg(long, default_value_t = 2, value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_THREADS))]
    threads: usize,
    /// Write one JSON record per point to this file (JSON Lines).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Skip the memcpy and socket ceilings.
    #[arg(long)]
    no_ceilings: bool,
    /// Mooncake's transfer_engine_bench to run side by side (default: $KVFERRY_MOONCAKE_BENCH,
    /// else `transfer_engine_bench` on PATH if present). `none` disables.
    #[arg(long)]
    mooncake: Option<String>,
    /// Seconds a Mooncake run may take beyond its measurement (setup, connection) before it
    /// is killed with its process group and reported as not finished.
    #[arg(long, default_value_t = 60.0, value_parser = parse_secs)]
    peer_timeout: f64,
    /// Write ceilings and Mooncake's points to this file (JSON Lines).
    #[arg(long)]
    json_peers: Option<PathBuf>,
    /// Data paths to measure, in order: `auto` (shared memory when the target is on this host,
    /// else TCP), `tcp`, `shm`, `rdma` (one-sided verbs; both sides need a usable NIC); e.g.
    /// `--transport shm,tcp` puts both in one report. On a target: `tcp` offers no shared
    /// memory, `rdma` registers its buffer on every RDMA NIC (and fails without one).
    #[arg(long, default_value = "auto", value_delimiter = ',', value_parser = parse_transport)]
    transport: Vec<TransportMode>,
    /// Back the registered buffers (and the memcpy ceiling's) with transparent huge pages
    /// (`on`/`off`). Cross-memory copies pin every page: from 4 KiB pages they cost about
    /// twice the CPU (see docs/BENCHMARKS.md).
    #[arg(
        long,
        default_value = "on",
        action = clap::ArgAction::Set,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    hugepages: bool,
    /// What the registered buffers are (both sides): `kvferry` — allocated by kvferry
    /// (memfd-backed, as managed buffers and store segments are), which a same-host peer maps
    /// and copies with `memcpy`; `private` — plain anonymous memory (as a tensor or `malloc`
    /// gives), which a same-host peer reaches by cross-memory attach.
    #[arg(long, default_value = "kvferry", value_parser = ["kvferry", "private"])]
    memory: String,
    /// Measure what the cluster key costs: this many rounds, each running every point once
    /// without a key and once with one for each `--auth-protect` setting (ABBA: every other
    /// round in reverse order), a fresh target started for each with the same
    /// KVFERRY_AUTH_KEY_FILE and KVFERRY_AUTH_PROTECT as the initiator (a random key in a 0600
    /// file made here, removed after). Also measures, the same way, a fresh engine's
    /// `open_segment` (the handshake), its first 4 KiB write (a new data connection) and 4 KiB
    /// writes on an established one. Reports each round, the median per setting and the
    /// ratios to no key. Both sides on this host only (no `--mode`). 1 to 10000 rounds.
    #[arg(long, value_name = "ROUNDS", value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_ROUNDS))]
    auth_ab: Option<usize>,
    /// With `--auth-ab`: the KVFERRY_AUTH_PROTECT settings measured against no key
    /// (`headers`, `payload`, `encrypt`).
    #[arg(long, default_value = "headers", value_delimiter = ',', value_parser = parse_protect, requires = "auth_ab")]
    auth_protect: Vec<Protect>,
    /// Model-shaped KV requests instead of the block sweep: presets (`llama3-70b-tp8`,
    /// `qwen3-8b`, `deepseek-v4`), each request one rank's KV cache for a prompt, its
    /// blocks scattered on both sides; timed per request, verified, beside the same bytes in
    /// one descriptor per region and the ceiling. `--transport`, `--duration`, `--json` apply.
    #[arg(long, value_delimiter = ',', value_name = "PRESETS")]
    workload: Vec<String>,
    /// With `--workload`: prompt lengths in tokens (`1K` = 1024).
    #[arg(long, default_value = "1K,8K", value_delimiter = ',', value_parser = parse_size_nonzero)]
    tokens: Vec<u64>,
    /// With `--workload`: concurrent requests (each on a thread of its own), 1 to 1024.
    #[arg(long, default_value = "1,4", value_delimiter = ',', value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_THREADS))]
    concurrency: Vec<usize>,
    /// With `--workload`: `push` (write into the target), `pull` (read from it).
    #[arg(long, default_value = "push,pull", value_delimiter = ',')]
    directions: Vec<String>,
    /// With `--workload`: descriptors per call (Mooncake's users post 8192 at a time); 0: a
    /// request in one call.
    #[arg(long, default_value_t = 0, value_parser = RangedU64ValueParser::<usize>::new().range(0..=MAX_BATCH))]
    chunk: usize,
    /// With `--workload`: the most memory each side's KV pool takes; points that need more
    /// are skipped and say so.
    #[arg(long, default_value = "4GiB", value_parser = parse_size_nonzero)]
    max_memory: u64,
    /// With `--workload`: stock Mooncake moves the same requests in the same run, as its
    /// users call it (Python lists in calls of 8192 descriptors from a thread pool, TCP):
    /// a Python with `mooncake-transfer-engine-non-cuda` (default: $KVFERRY_MOONCAKE_PYTHON;
    /// `none` disables).
    #[arg(long, value_name = "PY")]
    mooncake_python: Option<String>,
    /// Internal: exit when stdin closes (set when the bench starts its own target).
    #[arg(long, hide = true)]
    exit_on_stdin_eof: bool,
}

/// One measured point, as written by `--json`.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    pub op: String,
    pub block_bytes: u64,
    pub batch: usize,
    pub gbps: f64,
    pub ops_per_s: f64,
    pub batch_p50_us: f64,
    pub batch_p99_us: f64,
    pub single_p50_us: f64,
    pub initiator_cpu_s_per_gb: f64,
    pub target_cpu_s_per_gb: f64,
    pub verified: bool,
}

const TAG: &str = "kvferry-bench";
/// The most requests in a batch (`--batch`), initiator threads (`--threads`) and `--auth-ab`
/// rounds: far beyond what a bench needs, and small enough that what is sized from them
/// (request vectors, threads, the count of points) is never out of range.
const MAX_BATCH: u64 = 65536;
const MAX_THREADS: u64 = 1024;
const MAX_ROUNDS: u64 = 10_000;

fn parse_transport(s: &str) -> Result<TransportMode, String> {
    s.parse()
}

fn parse_protect(s: &str) -> Result<Protect, String> {
    Protect::parse(s).ok_or_else(|| format!("{s:?} is not headers, payload or encrypt"))
}

pub fn run(a: BenchArgs) -> Result<(), String> {
    if let Some(rounds) = a.auth_ab {
        if a.mode.is_some() {
            return Err(
                "--auth-ab restarts the target for each setting: run it without --mode (both \
                sides on this host)"
                    .into(),
            );
        }
        return auth_ab::run(&a, rounds);
    }
    if !a.workload.is_empty() && a.mode != Some(Mode::Target) {
        let seg = match a.mode {
            Some(Mode::Initiator) => Some(a.segment.as_deref().ok_or(
                "--mode initiator needs --segment <host:port> (printed by --mode target)",
            )?),
            _ => None,
        };
        return workload::run(&a, seg);
    }
    match a.mode {
        Some(Mode::Target) => run_target(&a),
        Some(Mode::Initiator) => {
            let seg = a
                .segment
                .clone()
                .ok_or("--mode initiator needs --segment <host:port> (printed by --mode target)")?;
            run_initiator(&a, &seg, None)
        }
        None => {
            let (child, seg, _) = spawn_target(&a, a.buffer_size, &[])?;
            let r = run_initiator(&a, &seg, Some(child.id()));
            stop_child(child);
            r
        }
    }
}

fn engine_config(a: &BenchArgs) -> Result<Config, String> {
    let mut c = Config::from_env().map_err(|e| e.to_string())?;
    c.local_hostname = a.local_hostname.clone();
    Ok(c)
}

// ------------------------------------------------------------------------------------------
// Target
// ------------------------------------------------------------------------------------------

/// The target's transport: `rdma` when RDMA is among those measured (its descriptor then
/// carries RDMA keys; TCP still reaches it), else `tcp` when only TCP is, else `auto`.
fn target_mode(asked: &[TransportMode]) -> TransportMode {
    if asked.contains(&TransportMode::Rdma) {
        TransportMode::Rdma
    } else if asked.iter().all(|t| *t == TransportMode::Tcp) {
        TransportMode::Tcp
    } else {
        TransportMode::Auto
    }
}

fn run_target(a: &BenchArgs) -> Result<(), String> {
    let mode = target_mode(&a.transport);
    let engine = TransferEngine::new(Config {
        transport: mode,
        ..engine_config(a)?
    })
    .map_err(|e| e.to_string())?;
    let buf = Buffer::alloc(a.buffer_size as usize, a.hugepages, a.memory == "kvferry")
        .map_err(|e| format!("--buffer-size {}: allocating it: {e}", human(a.buffer_size)))?;
    buf.fill(0, buf.len(), 0x5eed);
    engine
        .register_memory(buf.addr(), buf.len() as u64, "cpu:0")
        .map_err(|e| e.to_string())?;
    // auth=: the cluster key setting this side runs with (`--auth-ab` checks it is the one it gave).
    let auth = if engine.config().auth_key_file.is_some() {
        engine.config().auth_protect.name()
    } else {
        "none"
    };
    println!(
        "KVFERRY_BENCH_TARGET segment={} addr={} size={} auth={auth}",
        engine.segment_name(),
        buf.addr(),
        buf.len()
    );
    let _ = std::io::stdout().flush();
    if a.exit_on_stdin_eof {
        std::thread::spawn(|| {
            let mut sink = Vec::new();
            let _ = std::io::stdin().read_to_end(&mut sink);
            std::process::exit(0);
        });
    } else {
        eprintln!(
            "target ready: run `kvferry bench --mode initiator --segment {}` on the other host",
            engine.segment_name()
        );
    }
    loop {
        for n in engine.wait_notifies(Duration::from_secs(1)) {
            let f: Vec<&str> = n.msg.split_whitespace().collect();
            if f.first() != Some(&TAG) {
                continue;
            }
            let reply = match f.get(1..) {
                Some(["checksum", token, off, len]) => {
                    let (off, len) = (
                        off.parse::<usize>().unwrap_or(usize::MAX),
                        len.parse::<usize>().unwrap_or(usize::MAX),
                    );
                    if off.checked_add(len).is_some_and(|e| e <= buf.len()) {
                        format!(
                            "{TAG} checksum-result {token} {:016x}",
                            xxhash_rust::xxh3::xxh3_64(buf.slice(off, len))
                        )
                    } else {
                        format!("{TAG} checksum-result {token} out-of-range")
                    }
                }
                Some(["wl-checksum", token, args @ ..]) => {
                    let h = workload::target_checksum(&buf, args);
                    format!("{TAG} wl-checksum-result {token} {h}")
                }
                Some(["cpu", token]) => {
                    format!("{TAG} cpu-result {token} {}", sys::self_cpu().as_secs_f64())
                }
                Some(["quit"]) => return Ok(()),
                _ => continue,
            };
            if let Err(e) = engine.send_notify(&n.name, &reply) {
                eprintln!("target: cannot answer {}: {e}", n.name);
            }
        }
    }
}

/// Starts the target child; `env`: variables set (`Some`) or removed (`None`) for it, the
/// rest inherited. Returns it, its segment name and the line it announced itself with.
fn spawn_target(
    a: &BenchArgs,
    buffer_size: u64,
    env: &[(&str, Option<std::ffi::OsString>)],
) -> Result<(Child, String, String), String> {
    let mode = match target_mode(&a.transport) {
        TransportMode::Rdma => "rdma",
        _ => "auto",
    };
    let mut cmd = crate::self_command()?;
    cmd.args([
        "bench",
        "--mode",
        "target",
        "--exit-on-stdin-eof",
        "--local-hostname",
        &a.local_hostname,
        "--buffer-size",
        &buffer_size.to_string(),
        "--transport",
        mode,
        "--hugepages",
        if a.hugepages { "on" } else { "off" },
        "--memory",
        &a.memory,
    ]);
    for (name, v) in env {
        match v {
            Some(v) => cmd.env(name, v),
            None => cmd.env_remove(name),
        };
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting the target process: {e}"))?;
    let out = child.stdout.take().ok_or("no stdout from target")?;
    let mut line = String::new();
    BufReader::new(out)
        .read_line(&mut line)
        .map_err(|e| format!("reading the target's address: {e}"))?;
    let seg = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("segment="))
        .map(str::to_string)
        .ok_or_else(|| {
            let _ = child.kill();
            format!("target did not start (printed {line:?}); run `kvferry doctor`")
        })?;
    Ok((child, seg, line))
}

fn stop_child(mut child: Child) {
    drop(child.stdin.take()); // the target exits when its stdin closes
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

// ------------------------------------------------------------------------------------------
// Initiator
// ------------------------------------------------------------------------------------------

struct Ctl<'a> {
    engine: &'a TransferEngine,
    target: String,
    token: AtomicU64,
}

impl Ctl<'_> {
    /// Asks the target something over Notify and waits for the answer.
    fn ask(&self, cmd: &str, args: &str) -> Result<String, String> {
        let token = self.token.fetch_add(1, Ordering::Relaxed).to_string();
        self.engine
            .send_notify(&self.target, &format!("{TAG} {cmd} {token} {args}"))
            .map_err(|e| e.to_string())?;
        let until = Instant::now() + Duration::from_secs(60);
        while Instant::now() < until {
            for n in self.engine.wait_notifies(Duration::from_millis(500)) {
                let f: Vec<&str> = n.msg.split_whitespace().collect();
                if f.len() == 4 && f[0] == TAG && f[1] == format!("{cmd}-result") && f[2] == token {
                    return Ok(f[3].to_string());
                }
            }
        }
        Err(format!("the target did not answer `{cmd}` within 60 s"))
    }

    fn cpu(&self) -> Result<f64, String> {
        self.ask("cpu", "")?
            .parse()
            .map_err(|e| format!("bad cpu answer: {e}"))
    }

    fn checksum(&self, off: usize, len: usize) -> Result<String, String> {
        self.ask("checksum", &format!("{off} {len}"))
    }
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn check_args(a: &BenchArgs) -> Result<(), String> {
    if a.batch == 0 || a.threads == 0 {
        return Err("--batch and --threads must be at least 1".into());
    }
    for op in &a.ops {
        if op != "write" && op != "read" {
            return Err(format!("unknown op {op:?}: use write and/or read"));
        }
    }
    Ok(())
}

/// An engine of `mode` made from `base`, `buf` registered, `target` opened.
struct Connected {
    engine: TransferEngine,
    seg: u64,
    via: kvferry::SegmentTransport,
    /// The target's largest registered buffer.
    remote: kvferry::BufferDesc,
}

fn connect(
    mode: TransportMode,
    base: &Config,
    buf: &Buffer,
    target: &str,
) -> Result<Connected, String> {
    let engine = TransferEngine::new(Config {
        transport: mode,
        ..base.clone()
    })
    .map_err(|e| e.to_string())?;
    engine
        .register_memory(buf.addr(), buf.len() as u64, "cpu:0")
        .map_err(|e| e.to_string())?;
    let seg = engine.open_segment(target).map_err(|e| e.to_string())?;
    let via = engine
        .segment_transport(seg)
        .map_err(|e| format!("--transport {mode}: {e}"))?;
    let desc = engine.segment_descriptor(seg).map_err(|e| e.to_string())?;
    let remote = desc
        .buffers
        .into_iter()
        .max_by_key(|b| b.length)
        .ok_or_else(|| format!("segment {target} has no registered buffer"))?;
    Ok(Connected {
        engine,
        seg,
        via,
        remote,
    })
}

/// Where the progress line stands: points done, points in all, and what to prefix them with.
struct Progress {
    n: usize,
    total: usize,
    label: String,
}

/// Every point (each transport asked, op and block size, in that order) against `target`,
/// one engine made from `base` per transport; each with the transport that carried it.
fn sweep(
    a: &BenchArgs,
    target: &str,
    buf: &Buffer,
    base: &Config,
    progress: &mut Progress,
) -> Result<(Vec<Point>, Vec<String>), String> {
    let mut points = Vec::new();
    let mut used = Vec::new();
    for &mode in &a.transport {
        // One engine per transport choice, so each starts from a clean state.
        let Connected {
            engine,
            seg,
            via,
            remote: rbuf,
        } = connect(mode, base, buf, target)?;
        if let (TransportMode::Auto, Some(why)) = (mode, &via.why_not_shm) {
            eprintln!("\r\x1b[Kauto chose {}: {why}", via.name);
        }
        let usable = (buf.len() as u64).min(rbuf.length);
        let ctl = Ctl {
            engine: &engine,
            target: target.to_string(),
            token: AtomicU64::new(1),
        };
        for op in &a.ops {
            for &block in &a.blocks {
                progress.n += 1;
                eprint!(
                    "\r\x1b[K[{}/{}] {}{} {op} {} x {} ...",
                    progress.n,
                    progress.total,
                    progress.label,
                    via.name,
                    human(block),
                    a.batch
                );
                let _ = std::io::stderr().flush();
                let before = kvferry::host::shm::bytes_moved();
                let p = run_point(
                    a,
                    &engine,
                    &ctl,
                    buf,
                    seg,
                    rbuf.addr,
                    usable,
                    op,
                    block,
                    progress.n as u64,
                )?;
                points.push(p);
                used.push(path_label(
                    via.name,
                    before,
                    kvferry::host::shm::bytes_moved(),
                ));
            }
        }
    }
    Ok((points, used))
}

fn run_initiator(a: &BenchArgs, target: &str, target_pid: Option<u32>) -> Result<(), String> {
    check_args(a)?;
    let buf = Buffer::alloc(a.buffer_size as usize, a.hugepages, a.memory == "kvferry")
        .map_err(|e| format!("--buffer-size {}: allocating it: {e}", human(a.buffer_size)))?;
    let _ = target_pid;
    let ceilings = if a.no_ceilings {
        None
    } else {
        Some(measure_ceilings(a.hugepages))
    };
    let total = a.transport.len() * a.ops.len() * a.blocks.len();
    let mut progress = Progress {
        n: 0,
        total,
        label: String::new(),
    };
    let (points, used) = sweep(a, target, &buf, &engine_config(a)?, &mut progress)?;
    eprintln!("\r\x1b[K");
    let mooncake = run_mooncake(a)?;
    print_report(a, &points, &used, ceilings.as_ref(), &mooncake);
    if let Some(path) = &a.json {
        let mut out = String::new();
        for p in &points {
            out.push_str(&serde_json::to_string(p).expect("serialisable"));
            out.push('\n');
        }
        std::fs::write(path, out).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    if let Some(path) = &a.json_peers {
        let ours = points.iter().zip(&used).map(|(p, t)| {
            serde_json::json!({
                "engine": "kvferry",
                "transport": t,
                "op": p.op,
                "block_bytes": p.block_bytes,
                "gbps": p.gbps,
            })
        });
        write_peers(path, ceilings.as_ref(), ours, &mooncake)?;
    }
    if points.iter().any(|p| !p.verified) {
        return Err("some points failed verification (see the table)".into());
    }
    Ok(())
}

/// Mooncake over the same kind of path, side by side: RDMA on the same NICs for kvferry's RDMA
/// points, TCP for the others (Mooncake has no shared-memory path between processes).
fn run_mooncake(a: &BenchArgs) -> Result<crate::mooncake::SideBySide, String> {
    let mut protos = Vec::new();
    if a.transport.iter().any(|m| *m != TransportMode::Rdma) {
        protos.push(crate::mooncake::Proto::Tcp);
    }
    if a.transport.contains(&TransportMode::Rdma) {
        let devices = engine_config(a)?.rdma_devices.unwrap_or_else(|| {
            kvferry::host::rdma::probe()
                .nics
                .iter()
                .filter(|n| n.ports.iter().any(|p| p.active))
                .map(|n| n.name.clone())
                .collect()
        });
        protos.push(crate::mooncake::Proto::Rdma(devices));
    }
    Ok(crate::mooncake::run_side_by_side(
        a.mooncake.as_deref(),
        &protos,
        &a.local_hostname,
        a.buffer_size,
        &a.ops,
        &a.blocks,
        a.batch,
        a.threads,
        a.duration,
        Duration::from_secs_f64(a.peer_timeout.max(0.0)),
    ))
}

/// Whether transparent huge pages can back shared memory (memfd) when advised.
/// `--json-peers`: the ceilings, kvferry's records (`ours`) and Mooncake's points, one JSON
/// object a line.
fn write_peers(
    path: &std::path::Path,
    ceilings: Option<&Ceilings>,
    ours: impl Iterator<Item = serde_json::Value>,
    mooncake: &crate::mooncake::SideBySide,
) -> Result<(), String> {
    let mut out = String::new();
    if let Some(c) = ceilings {
        let ceiling = serde_json::json!({
            "engine": "ceiling",
            "memcpy_gbps": c.memcpy_gbps,
            "socket_gbps": c.socket_gbps,
        });
        out.push_str(&ceiling.to_string());
        out.push('\n');
    }
    for v in ours {
        out.push_str(&v.to_string());
        out.push('\n');
    }
    for m in mooncake.points() {
        out.push_str(&serde_json::to_string(m).expect("serialisable"));
        out.push('\n');
    }
    std::fs::write(path, out).map_err(|e| format!("writing {}: {e}", path.display()))
}

fn shmem_thp() -> bool {
    let s = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
        .unwrap_or_default();
    ["[always]", "[within_size]", "[advise]", "[force]"]
        .iter()
        .any(|m| s.contains(m))
}

/// The transport column: for shared memory, which copy path carried the point's bytes
/// (`shm:map` — the peer's memory mapped here, `shm:cma` — cross-memory attach).
fn path_label(via: &str, before: (u64, u64), after: (u64, u64)) -> String {
    if via != "shm" {
        return via.to_string();
    }
    match (after.0 > before.0, after.1 > before.1) {
        (true, false) => "shm:map".into(),
        (false, true) => "shm:cma".into(),
        _ => "shm:mix".into(),
    }
}

#[allow(clippy::too_many_arguments)]
fn run_point(
    a: &BenchArgs,
    engine: &TransferEngine,
    ctl: &Ctl<'_>,
    buf: &Buffer,
    seg: u64,
    remote_base: u64,
    usable: u64,
    op: &str,
    block: u64,
    seed: u64,
) -> Result<Point, String> {
    let opcode = if op == "write" {
        Opcode::Write
    } else {
        Opcode::Read
    };
    let region = (usable / a.threads as u64) / block * block;
    if region == 0 {
        return Err(format!(
            "--buffer-size: {} (the smaller side's) is too small for --threads {} of --blocks {}: \
            at least one block per thread",
            human(usable),
            a.threads,
            human(block)
        ));
    }
    // Each thread walks its region batch after batch, so data comes from memory, not from
    // a cache that a repeated batch would keep warm (the memcpy ceiling is out of cache too).
    let span = region.min(a.batch as u64 * block);
    for t in 0..a.threads as u64 {
        let off = (t * region) as usize;
        match opcode {
            Opcode::Write => buf.fill(off, region as usize, seed.wrapping_mul(0x1234_5678_9abc)),
            Opcode::Read => buf.slice_mut(off, region as usize).fill(0),
        }
    }
    let make_reqs = |t: u64, k: u64, reqs: &mut Vec<TransferRequest>| {
        reqs.clear();
        let base = k.wrapping_mul(span) % region;
        reqs.extend((0..a.batch as u64).map(|i| {
            let off = t * region + (base + i * block) % region;
            TransferRequest {
                opcode,
                source: buf.addr() + off,
                target_id: seg,
                target_offset: remote_base + off,
                length: block,
            }
        }));
    };
    let tgt_cpu0 = ctl.cpu()?;
    let cpu0 = sys::self_cpu();
    let start = Instant::now();
    let dur = Duration::from_secs_f64(a.duration.max(0.01));
    let results: Vec<Result<Vec<f64>, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..a.threads as u64)
            .map(|t| {
                let make_reqs = &make_reqs;
                s.spawn(move || -> Result<Vec<f64>, String> {
                    let mut lats = Vec::new();
                    let mut reqs = Vec::with_capacity(a.batch);
                    while lats.is_empty() || start.elapsed() < dur {
                        make_reqs(t, lats.len() as u64, &mut reqs);
                        let t0 = Instant::now();
                        let b = engine
                            .allocate_batch(reqs.len())
                            .map_err(|e| e.to_string())?;
                        b.submit(&reqs).map_err(|e| e.to_string())?;
                        let st = b.wait(Duration::from_secs(120));
                        lats.push(t0.elapsed().as_secs_f64() * 1e6);
                        if st.status != TaskStatus::Completed {
                            return Err(format!(
                                "{op} batch ended {:?}: {}",
                                st.status,
                                st.reason.unwrap_or_default()
                            ));
                        }
                    }
                    Ok(lats)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("bench thread panicked".into()))
            })
            .collect()
    });
    let elapsed = start.elapsed().as_secs_f64();
    let cpu = (sys::self_cpu() - cpu0).as_secs_f64();
    let tgt_cpu = ctl.cpu()? - tgt_cpu0;
    let mut lats = Vec::new();
    // How much of each thread's region its batches covered (what can be verified).
    let mut covered = Vec::new();
    for r in results {
        let l = r?;
        covered.push((l.len() as u64).saturating_mul(span).min(region));
        lats.extend(l);
    }
    let batches = lats.len() as f64;
    let bytes = batches * a.batch as f64 * block as f64;
    let gb = bytes / 1e9;
    // Verify: the target hashes its memory; compare with ours.
    let mut verified = true;
    for (t, &len) in covered.iter().enumerate() {
        let off = (t as u64 * region) as usize;
        let mine = format!(
            "{:016x}",
            xxhash_rust::xxh3::xxh3_64(buf.slice(off, len as usize))
        );
        let theirs = ctl.checksum(off, len as usize)?;
        if mine != theirs {
            verified = false;
        }
    }
    // Single-request latency.
    let one = [TransferRequest {
        opcode,
        source: buf.addr(),
        target_id: seg,
        target_offset: remote_base,
        length: block,
    }];
    let mut single = Vec::new();
    let t_single = Instant::now();
    while single.len() < 1000 && (single.len() < 5 || t_single.elapsed() < Duration::from_secs(1)) {
        let t0 = Instant::now();
        let st = engine
            .transfer_sync(&one, Duration::from_secs(60))
            .map_err(|e| e.to_string())?;
        single.push(t0.elapsed().as_secs_f64() * 1e6);
        if st.status != TaskStatus::Completed {
            return Err(format!(
                "single {op} ended {:?}: {}",
                st.status,
                st.reason.unwrap_or_default()
            ));
        }
    }
    Ok(Point {
        op: op.to_string(),
        block_bytes: block,
        batch: a.batch,
        gbps: gb / elapsed,
        ops_per_s: batches * a.batch as f64 / elapsed,
        batch_p50_us: pct(&mut lats.clone(), 0.5),
        batch_p99_us: pct(&mut lats, 0.99),
        single_p50_us: pct(&mut single, 0.5),
        initiator_cpu_s_per_gb: cpu / gb,
        target_cpu_s_per_gb: tgt_cpu / gb,
        verified,
    })
}

// ------------------------------------------------------------------------------------------
// Ceilings
// ------------------------------------------------------------------------------------------

pub struct Ceilings {
    pub memcpy_gbps: f64,
    pub socket_gbps: f64,
}

fn measure_ceilings(huge: bool) -> Ceilings {
    eprint!("\r\x1b[K[ceilings] memcpy and loopback socket ...");
    let _ = std::io::stderr().flush();
    Ceilings {
        memcpy_gbps: memcpy_gbps(huge),
        socket_gbps: socket_gbps(),
    }
}

/// Best of several single-thread copies of 256 MiB.
fn memcpy_gbps(huge: bool) -> f64 {
    let n = 256 << 20;
    let (Ok(a), Ok(b)) = (Buffer::alloc(n, huge, false), Buffer::alloc(n, huge, false)) else {
        return 0.0;
    };
    a.fill(0, n, 1);
    let mut best = 0.0f64;
    for _ in 0..5 {
        let t = Instant::now();
        b.slice_mut(0, n).copy_from_slice(a.slice(0, n));
        best = best.max(n as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    std::hint::black_box(b.slice(0, 64));
    best
}

/// One plain TCP stream over loopback: a sender thread writes 1 MiB chunks, a receiver reads.
fn socket_gbps() -> f64 {
    let Ok(l) = std::net::TcpListener::bind("127.0.0.1:0") else {
        return 0.0;
    };
    let Ok(addr) = l.local_addr() else { return 0.0 };
    let total: usize = 2 << 30;
    let rx = std::thread::spawn(move || -> f64 {
        let Ok((mut s, _)) = l.accept() else {
            return 0.0;
        };
        let mut b = vec![0u8; 1 << 20];
        let mut got = 0;
        let t = Instant::now();
        while got < total {
            match s.read(&mut b) {
                Ok(0) | Err(_) => break,
                Ok(n) => got += n,
            }
        }
        got as f64 / t.elapsed().as_secs_f64() / 1e9
    });
    if let Ok(mut s) = std::net::TcpStream::connect(addr) {
        let _ = s.set_nodelay(true);
        let chunk = vec![7u8; 1 << 20];
        let mut sent = 0;
        while sent < total {
            if s.write_all(&chunk).is_err() {
                break;
            }
            sent += chunk.len();
        }
    }
    rx.join().unwrap_or(0.0)
}

// ------------------------------------------------------------------------------------------
// Report
// ------------------------------------------------------------------------------------------

fn print_report(
    a: &BenchArgs,
    points: &[Point],
    used: &[String],
    c: Option<&Ceilings>,
    mc: &crate::mooncake::SideBySide,
) {
    print_header(a, c);
    println!(
        "{:<6} {:>8} {:>9} {:>8} {:>11} {:>10} {:>10} {:>10} {:>9} {:>9} {:>8} {:>8} {:>9} {:>8}",
        "op",
        "block",
        "transport",
        "GB/s",
        "ops/s",
        "batch p50",
        "batch p99",
        "1-req p50",
        "init cpu",
        "tgt cpu",
        "verified",
        "/memcpy",
        "/socket",
        "/mooncake"
    );
    println!(
        "{:<6} {:>8} {:>9} {:>8} {:>11} {:>10} {:>10} {:>10} {:>9} {:>9} {:>8} {:>8} {:>9} {:>8}",
        "", "", "", "", "", "(us)", "(us)", "(us)", "(s/GB)", "(s/GB)", "", "", "", ""
    );
    for (p, via) in points.iter().zip(used) {
        let vs_memcpy = c
            .map(|c| format!("{:.2}x", p.gbps / c.memcpy_gbps))
            .unwrap_or_else(|| "-".into());
        let vs_socket = c
            .map(|c| format!("{:.2}x", p.gbps / c.socket_gbps))
            .unwrap_or_else(|| "-".into());
        let proto = if via == "rdma" { "rdma" } else { "tcp" };
        let vs_mc = mc
            .gbps(proto, &p.op, p.block_bytes)
            .map(|m| format!("{:.2}x", p.gbps / m))
            .unwrap_or_else(|| "-".into());
        println!(
            "{:<6} {:>8} {:>9} {:>8.3} {:>11.0} {:>10.0} {:>10.0} {:>10.1} {:>9.3} {:>9.3} {:>8} {:>8} {:>9} {:>8}",
            p.op,
            human(p.block_bytes),
            via,
            p.gbps,
            p.ops_per_s,
            p.batch_p50_us,
            p.batch_p99_us,
            p.single_p50_us,
            p.initiator_cpu_s_per_gb,
            p.target_cpu_s_per_gb,
            if p.verified { "yes" } else { "NO" },
            vs_memcpy,
            vs_socket,
            vs_mc
        );
    }
    mc.print();
}

/// The report's first lines: what was measured, and the ceilings.
fn print_header(a: &BenchArgs, c: Option<&Ceilings>) {
    let asked: Vec<String> = a.transport.iter().map(|t| t.to_string()).collect();
    println!(
        "kvferry bench: --transport {} on {}, {} registered per side ({} memory; pages: {}), \
        batch {}, {} initiator thread(s), {:.1} s per point",
        asked.join(","),
        a.local_hostname,
        human(a.buffer_size),
        a.memory,
        match (a.hugepages, a.memory.as_str()) {
            (false, _) => "4 KiB",
            (true, "kvferry") if !shmem_thp() =>
                "4 KiB: this host gives shared memory no transparent huge pages",
            _ => "huge",
        },
        a.batch,
        a.threads,
        a.duration
    );
    if let Some(c) = c {
        println!(
            "ceilings: single-thread memcpy {:.2} GB/s, loopback socket stream {:.2} GB/s",
            c.memcpy_gbps, c.socket_gbps
        );
    }
    println!();
}
