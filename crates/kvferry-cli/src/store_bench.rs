//! `kvferry store-bench`: a master and two clients on 127.0.0.1, every value checked.
//!
//! The bench process is a pure client (it contributes no memory); a second client process
//! contributes the only segment, so every put and get moves bytes client to client through
//! the transfer engine, as in a real pool. `--master-only` measures the master by itself.

use crate::sys::{human, parse_secs, parse_size, parse_size_nonzero};
use clap::builder::RangedU64ValueParser;
use kvferry::hostbuf::HostBuffer;
use kvferry_store::master::MasterConfig;
use kvferry_store::proto::{ReplicateConfig, Request, Segment};
use kvferry_store::Master;
use kvferry_store::{Client, ClientConfig};
use serde::Serialize;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod disk;
mod ha;

#[derive(clap::Args)]
pub struct StoreBenchArgs {
    /// Value sizes to sweep (each at most --segment-size).
    #[arg(long, default_value = "4K,64K,1M,16M", value_delimiter = ',', value_parser = parse_size_nonzero)]
    values: Vec<u64>,
    /// Keys per call for the batched points (1 is always measured too); 1 to 65536.
    #[arg(long, default_value_t = 32, value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_BATCH))]
    batch: usize,
    /// Seconds per point (at least one call).
    #[arg(long, default_value_t = 1.0, value_parser = parse_secs)]
    duration: f64,
    /// Memory the serving client contributes.
    #[arg(long, default_value = "3GiB", value_parser = parse_size_nonzero)]
    segment_size: u64,
    /// Write one JSON record per point (JSON Lines).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Measure the master alone: metadata ops/s and memory per object.
    #[arg(long)]
    master_only: bool,
    /// Objects created for the memory-per-object figure of --master-only.
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    objects: u64,
    /// Python with the stock Mooncake wheel, to run Mooncake Store side by side
    /// (default: $KVFERRY_MOONCAKE_PYTHON; `none` disables).
    #[arg(long)]
    mooncake_python: Option<String>,
    /// Seconds Mooncake's whole sweep may take before it is killed with its process group
    /// (the points it finished are kept, the rest reported as not finished).
    #[arg(long, default_value_t = 900.0, value_parser = parse_secs)]
    peer_timeout: f64,
    /// `off` (the default): both sides' processes keep the memory they free (glibc's
    /// M_TRIM_THRESHOLD 1 GiB, M_MMAP_THRESHOLD 64 MiB, set with mallopt here and through
    /// MALLOC_*_ variables for Mooncake's Python), so the bytes API's fresh values measure the
    /// store rather than how dear the host makes fresh pages (this project's VM hands freed
    /// pages back to its host and faults them in again at ~11 µs each). `on`: glibc's defaults.
    #[arg(long, value_enum, default_value_t = MallocTrim::Off)]
    malloc_trim: MallocTrim,
    /// Value sizes of the put/get/remove cycle points: each cycle is put_from, get_into
    /// (checked) and a forced remove of one key, against a serving segment of
    /// --cycle-segment-size, for at least one round of 4x the segment's size.
    #[arg(long, default_value = "64K,1M", value_delimiter = ',', value_parser = parse_size_nonzero)]
    cycle_values: Vec<u64>,
    /// Segment of the cycle points (a pool of its own, 4x smaller than a round's bytes).
    #[arg(long, default_value = "64MiB", value_parser = parse_size_nonzero)]
    cycle_segment_size: u64,
    /// Leave the cycle points out.
    #[arg(long)]
    no_cycle: bool,
    /// Layers of the multi-buffer points (vLLM/SGLang's shape: one value per block made of
    /// one region per layer, scattered in a registered KV cache); 0 leaves them out; at most
    /// 1024.
    #[arg(long, default_value_t = 8, value_parser = RangedU64ValueParser::<usize>::new().range(0..=MAX_LAYERS))]
    multi_layers: usize,
    /// Bytes of each layer's region in the multi-buffer points.
    #[arg(long, default_value = "64K", value_parser = parse_size)]
    multi_part: u64,
    /// Measure master high availability against this etcd (`host:port`): throughput with the
    /// journal on vs off, etcd bytes per million objects, failover time and objects lost.
    #[arg(long, value_name = "ETCD")]
    ha: Option<String>,
    /// With `--ha`: which parts to run (`rate`: metadata throughput, `store`: values stored
    /// through a whole store, `link`: how long reads and puts wait while a standby links to
    /// a leader of `--ha-link-objects` objects, `snapshot`: how long they wait while such a
    /// leader writes etcd snapshots, `rebase`: how long changing requests wait when such a
    /// leader's in-sync set empties (its standby killed), with the entries kept since the
    /// etcd journal's last position and without, `takeover`: how long a standby takes to lead
    /// when such a leader is killed, with the entries it received and without, `failover`:
    /// failover time and objects lost).
    #[arg(
        long,
        default_value = "rate,store,link,snapshot,rebase,takeover,failover",
        value_delimiter = ',',
        value_parser = ["rate", "store", "link", "snapshot", "rebase", "takeover", "failover"]
    )]
    ha_parts: Vec<String>,
    /// With `--ha`: the objects the `link`, `snapshot`, `rebase` and `takeover` parts'
    /// leaders hold.
    #[arg(long, default_value_t = 1_000_000)]
    ha_link_objects: u64,
    /// With `--ha`: every HA master's `--ha-rebase-tail-bytes` (the `rebase` part runs its
    /// leader with the default and with 0, whatever this is).
    #[arg(long, default_value = "64M", value_parser = crate::sys::parse_size)]
    ha_rebase_tail_bytes: u64,
    /// With `--ha`: every HA master's `--ha-standby-tail-bytes` (the `takeover` part runs its
    /// masters with 64M and with 0, whatever this is).
    #[arg(long, default_value = "64M", value_parser = crate::sys::parse_size)]
    ha_standby_tail_bytes: u64,
    /// With `--ha`: every HA master's `--ha-grant-bytes` (0: puts wait for both changes'
    /// acknowledgements, as before grants).
    #[arg(long, default_value = "64M", value_parser = crate::sys::parse_size)]
    ha_grant_bytes: u64,
    /// With `--ha`: the throughput points of the `rate` part, as CONNECTIONSxKEYS (keys per
    /// request), e.g. `4x32,16x128` (default: all six).
    #[arg(
        long,
        default_value = "1x1,4x1,4x32,16x32,64x32,16x128",
        value_delimiter = ',',
        value_parser = parse_ha_point
    )]
    ha_points: Vec<(usize, usize)>,
    /// With `--ha`: in the `rate` part, run the standby's mirror on this CPU alone and
    /// everything else of the bench (clients, every master) on the process's other CPUs, as
    /// a standby on a host of its own would (the masters compared then share the same CPUs
    /// with their clients; etcd, another process, is not pinned; the other parts run on
    /// every CPU, as without it).
    #[arg(long, value_name = "CPU")]
    ha_standby_cpu: Option<usize>,
    /// Internal: run as the serving client of a bench.
    #[arg(long, hide = true)]
    serve_segment: Option<String>,
    /// Measure the disk tier on this directory (on the device to measure): the multi-turn
    /// shape with and without it, and the device's sequential read beside it.
    #[arg(long, value_name = "DIR")]
    disk: Option<PathBuf>,
    /// With `--disk`: the memory pool (the working set is 3 times it).
    #[arg(long, default_value = "32MiB", value_parser = parse_size_nonzero)]
    disk_pool: u64,
    /// With `--disk`: each value's size.
    #[arg(long, default_value = "256K", value_parser = parse_size_nonzero)]
    disk_value: u64,
}

/// `CONNECTIONSxKEYS` of `--ha-points`: two whole numbers from 1 up.
fn parse_ha_point(s: &str) -> Result<(usize, usize), String> {
    let bad = || {
        format!("{s:?} is not CONNECTIONSxKEYS (e.g. 4x32: 4 connections, 32 keys per request; both at least 1)")
    };
    let (c, k) = s.trim().split_once(['x', 'X']).ok_or_else(bad)?;
    match (c.trim().parse::<usize>(), k.trim().parse::<usize>()) {
        (Ok(c @ 1..=4096), Ok(k @ 1..=65536)) => Ok((c, k)),
        _ => Err(bad()),
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct StorePoint {
    pub op: String,
    pub value_bytes: u64,
    pub batch: usize,
    pub gbps: f64,
    pub keys_per_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub verified: bool,
}

pub fn run(a: StoreBenchArgs) -> Result<(), String> {
    if let Some(master) = &a.serve_segment {
        return serve_segment(master, a.segment_size);
    }
    if a.master_only {
        return master_only(&a);
    }
    if let Some(etcd) = &a.ha {
        return ha::run(&a, etcd);
    }
    if let Some(dir) = &a.disk {
        return disk::run(&a, dir);
    }
    if a.batch == 0 {
        return Err("--batch must be at least 1".into());
    }
    if a.malloc_trim == MallocTrim::Off {
        // SAFETY: mallopt only changes this process's allocator thresholds.
        let ok = unsafe {
            libc::mallopt(libc::M_TRIM_THRESHOLD, KEEP_TRIM as libc::c_int) == 1
                && libc::mallopt(libc::M_MMAP_THRESHOLD, KEEP_MMAP as libc::c_int) == 1
        };
        if !ok {
            return Err(
                "--malloc-trim off: glibc refused the thresholds (mallopt); pass --malloc-trim on"
                    .into(),
            );
        }
    }
    check_sizes(&a)?;
    if !a.no_cycle {
        if let Some(v) = a
            .cycle_values
            .iter()
            .find(|&&v| v == 0 || v > a.cycle_segment_size / 4)
        {
            return Err(format!(
                "--cycle-values: {} must be non-zero and fit 4 times in --cycle-segment-size ({})",
                human(*v),
                human(a.cycle_segment_size)
            ));
        }
    }
    let mut points = {
        let pool = Pool::start(a.segment_size, "--segment-size")?;
        let mut p = run_client(&a, &pool.addr)?;
        if a.multi_layers > 0 && a.multi_part > 0 {
            p.extend(run_multi(&a, &pool.addr)?);
        }
        p
    };
    if !a.no_cycle && !a.cycle_values.is_empty() {
        let pool = Pool::start(a.cycle_segment_size, "--cycle-segment-size")?;
        points.extend(run_cycles(&a, &pool.addr)?);
    }
    let mooncake = run_mooncake(&a);
    print_table(&a, &points, &mooncake);
    if let Some(p) = &a.json {
        let text: String = points
            .iter()
            .map(|p| serde_json::to_string(p).expect("serialisable") + "\n")
            .collect();
        std::fs::write(p, text).map_err(|e| format!("writing {}: {e}", p.display()))?;
    }
    if points.iter().any(|p| !p.verified) {
        return Err("some values did not read back exactly (see the table)".into());
    }
    Ok(())
}

/// Sizes that cannot work, refused before any process starts, naming their flags.
fn check_sizes(a: &StoreBenchArgs) -> Result<(), String> {
    if let Some(&v) = a.values.iter().find(|&&v| v > a.segment_size) {
        return Err(format!(
            "--values {}: larger than --segment-size {}, the segment that holds them",
            human(v),
            human(a.segment_size)
        ));
    }
    let maxv = a.values.iter().copied().max().unwrap_or(0);
    if per_call(maxv, a.batch as u64).is_none() {
        return Err(format!(
            "--batch {} x --values {}: more memory than this process can map",
            a.batch,
            human(maxv)
        ));
    }
    if a.multi_layers > 0 && a.multi_part > 0 {
        let key = (a.multi_layers as u64)
            .checked_mul(a.multi_part)
            .filter(|&k| k <= a.segment_size)
            .ok_or_else(|| {
                format!(
                    "--multi-layers {} x --multi-part {}: a key larger than --segment-size {}",
                    a.multi_layers,
                    human(a.multi_part),
                    human(a.segment_size)
                )
            })?;
        if per_call(key, a.batch as u64).is_none() {
            return Err(format!(
                "--batch {} x --multi-layers {} x --multi-part {}: more memory than this process can map",
                a.batch,
                a.multi_layers,
                human(a.multi_part)
            ));
        }
    }
    Ok(())
}

/// The bytes of `n` values of `v` bytes, when that many can be mapped (a quarter of the
/// address space at most: room for the staging added to it).
fn per_call(v: u64, n: u64) -> Option<usize> {
    v.checked_mul(n)
        .filter(|&b| b <= isize::MAX as u64 / 4)
        .and_then(|b| usize::try_from(b).ok())
}

/// A master and a serving client contributing `segment_size` bytes (stopped on drop, the
/// serving client first).
struct Pool {
    _server: Proc,
    _master: Proc,
    pub(crate) addr: String,
}

impl Pool {
    /// `what`: where `segment_size` comes from, its flag (named when the serving client
    /// fails).
    fn start(segment_size: u64, what: &str) -> Result<Pool, String> {
        let master = Proc::spawn(
            crate::self_command()?.args([
                "master",
                "--port",
                "0",
                "--metrics-port",
                "-1",
                "--summary-interval",
                "0",
                "--default-kv-lease-ttl",
                "2000",
            ]),
            "KVFERRY_MASTER",
        )?;
        let addr = master.field("rpc=").ok_or("master printed no address")?;
        let server = Proc::spawn(
            crate::self_command()?.args([
                "store-bench",
                "--serve-segment",
                &addr,
                "--segment-size",
                &segment_size.to_string(),
            ]),
            "KVFERRY_STORE_SERVER",
        )
        .map_err(|e| {
            format!(
                "{what} {}: the client serving it did not start ({e})",
                human(segment_size)
            )
        })?;
        Ok(Pool {
            _server: server,
            _master: master,
            addr,
        })
    }
}

/// The put/get/remove cycle: one key at a time, put_from, get_into (every byte checked) and
/// `remove(force)`, for at least one round of 4x the serving segment's size and until
/// `duration` seconds of calls. Space must be reused all the time: a removed object's space is
/// reclaimed as soon as no read of it is in flight. GB/s counts the bytes put; keys/s the
/// cycles; latency is per cycle.
fn run_cycles(a: &StoreBenchArgs, master: &str) -> Result<Vec<StorePoint>, String> {
    let maxv = a.cycle_values.iter().copied().max().unwrap_or(0) as usize;
    let c = Client::setup(ClientConfig {
        global_segment_size: 0,
        local_buffer_size: 0,
        master_server_addr: master.to_string(),
        ..ClientConfig::default()
    })
    .map_err(|e| e.to_string())?;
    let src = HostBuffer::new(maxv, true).map_err(|e| e.to_string())?;
    let dst = HostBuffer::new(maxv, true).map_err(|e| e.to_string())?;
    c.register_buffer(src.addr(), src.len() as u64)
        .map_err(|e| e.to_string())?;
    c.register_buffer(dst.addr(), dst.len() as u64)
        .map_err(|e| e.to_string())?;
    let cfg = ReplicateConfig::default();
    let mut points = Vec::new();
    for &v in &a.cycle_values {
        eprint!(
            "\r\x1b[K[cycle] values of {} over a {} segment ...",
            human(v),
            human(a.cycle_segment_size)
        );
        let _ = std::io::stderr().flush();
        let vlen = v as usize;
        let round = usize::try_from(4 * u128::from(a.cycle_segment_size) / u128::from(v))
            .unwrap_or(usize::MAX);
        let (mut lat, mut busy, mut n, mut verified) = (
            Vec::with_capacity(round.min(1 << 20)),
            Duration::ZERO,
            0usize,
            true,
        );
        let start = Instant::now();
        let cap = (3.0 * a.duration).max(a.duration + 5.0);
        while n < round || (busy.as_secs_f64() < a.duration && start.elapsed().as_secs_f64() < cap)
        {
            let k = format!("cycle-{v}-{n}");
            fill_value(src.slice_mut(0, vlen), &k);
            let t0 = Instant::now();
            c.put_from(&k, src.addr(), v, &cfg).map_err(|e| {
                format!(
                    "cycle {n} ({} put so far): put_from {k}: {e}",
                    human(n as u64 * v)
                )
            })?;
            let got = c
                .get_into(&k, dst.addr(), v)
                .map_err(|e| format!("cycle {n}: get_into {k}: {e}"))?;
            c.remove(&k, true)
                .map_err(|e| format!("cycle {n}: remove {k}: {e}"))?;
            let dt = t0.elapsed();
            busy += dt;
            lat.push(dt.as_secs_f64() * 1e6);
            verified &= got == v && value_ok(dst.slice(0, vlen), &k);
            n += 1;
        }
        points.push(point("cycle", v, 1, n, busy, &mut lat, verified));
    }
    eprint!("\r\x1b[K");
    Ok(points)
}

/// Multi-buffer points: `batch` keys per call, each the concatenation of `multi_layers`
/// regions of `multi_part` bytes interleaved in one registered KV cache (block b's layer l at
/// `(l * batch + b) * part`: no two parts of a key adjacent), put with
/// `batch_put_from_parts` and read back, split the same way, into a second cache with
/// `batch_get_into_parts`, every byte checked. Rows `put_multi`/`get_multi`; the value size
/// shown is a whole key's (layers x part).
fn run_multi(a: &StoreBenchArgs, master: &str) -> Result<Vec<StorePoint>, String> {
    let (layers, part, batch) = (a.multi_layers, a.multi_part as usize, a.batch.max(1));
    // A key (layers x part) fits the segment, and a call's keys this process: check_sizes.
    let v = layers as u64 * a.multi_part;
    let cache =
        per_call(v, batch as u64).ok_or("--batch x --multi-layers x --multi-part: too large")?;
    let what = || {
        format!(
            "--batch {batch} x --multi-layers {layers} x --multi-part {}",
            human(a.multi_part)
        )
    };
    eprint!(
        "\r\x1b[K[multi] {batch} keys x {layers} layers x {} ...",
        human(part as u64)
    );
    let _ = std::io::stderr().flush();
    let c = Client::setup(ClientConfig {
        global_segment_size: 0,
        local_buffer_size: 0,
        master_server_addr: master.to_string(),
        ..ClientConfig::default()
    })
    .map_err(|e| e.to_string())?;
    let src = HostBuffer::new(cache, true).map_err(|e| format!("{}: {e}", what()))?;
    let dst = HostBuffer::new(cache, true).map_err(|e| format!("{}: {e}", what()))?;
    c.register_buffer(src.addr(), src.len() as u64)
        .map_err(|e| e.to_string())?;
    c.register_buffer(dst.addr(), dst.len() as u64)
        .map_err(|e| e.to_string())?;
    let at = |b: usize, l: usize| (l * batch + b) * part;
    let parts_of = |buf: &HostBuffer, b: usize| -> Vec<(u64, u64)> {
        (0..layers)
            .map(|l| (buf.addr() + at(b, l) as u64, part as u64))
            .collect()
    };
    let src_parts: Vec<Vec<(u64, u64)>> = (0..batch).map(|b| parts_of(&src, b)).collect();
    let dst_parts: Vec<Vec<(u64, u64)>> = (0..batch).map(|b| parts_of(&dst, b)).collect();
    let cfg = ReplicateConfig::default();
    let rounds_cap = (((a.segment_size / 8) / v.max(1)) as usize / batch).max(1);
    let mut whole = vec![0u8; layers * part];
    let (mut keys, mut lat, mut busy): (Vec<Vec<String>>, Vec<f64>, Duration) =
        (Vec::new(), Vec::new(), Duration::ZERO);
    let start = Instant::now();
    while keys.len() < rounds_cap && (keys.is_empty() || start.elapsed().as_secs_f64() < a.duration)
    {
        let r = keys.len();
        let ks: Vec<String> = (0..batch).map(|b| format!("multi-{r}-{b}")).collect();
        for (b, k) in ks.iter().enumerate() {
            fill_value(&mut whole, k);
            for l in 0..layers {
                src.slice_mut(at(b, l), part)
                    .copy_from_slice(&whole[l * part..(l + 1) * part]);
            }
        }
        let items: Vec<(&str, &[(u64, u64)])> = ks
            .iter()
            .zip(&src_parts)
            .map(|(k, p)| (k.as_str(), &p[..]))
            .collect();
        let t0 = Instant::now();
        let res = c.batch_put_from_parts(&items, &cfg, false);
        let dt = t0.elapsed();
        busy += dt;
        lat.push(dt.as_secs_f64() * 1e6);
        for (k, r) in ks.iter().zip(res) {
            r.map_err(|e| format!("put_multi {k}: {e}"))?;
        }
        keys.push(ks);
    }
    let nkeys = keys.iter().map(Vec::len).sum();
    let mut points = vec![point("put_multi", v, batch, nkeys, busy, &mut lat, true)];
    let mut verified = true;
    let (busy, mut lat, read) = read_rounds(a.duration, &keys, |ks| {
        let items: Vec<(&str, &[(u64, u64)])> = ks
            .iter()
            .zip(&dst_parts)
            .map(|(k, p)| (k.as_str(), &p[..]))
            .collect();
        let t0 = Instant::now();
        let res = c.batch_get_into_parts(&items);
        let dt = t0.elapsed();
        for (b, (k, r)) in ks.iter().zip(res).enumerate() {
            let got = r.map_err(|e| format!("get_multi {k}: {e}"))?;
            for l in 0..layers {
                whole[l * part..(l + 1) * part].copy_from_slice(dst.slice(at(b, l), part));
            }
            verified &= got == v && value_ok(&whole, k);
        }
        Ok(dt)
    })?;
    points.push(point("get_multi", v, batch, read, busy, &mut lat, verified));
    c.remove_all(true).map_err(|e| e.to_string())?;
    eprint!("\r\x1b[K");
    Ok(points)
}

/// `--malloc-trim`: whether the bench's processes give freed memory back to the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MallocTrim {
    /// glibc's defaults.
    On,
    /// Freed memory kept ([`KEEP_TRIM`], [`KEEP_MMAP`]).
    Off,
}

/// `--malloc-trim off`: glibc's trim and mmap thresholds, in this process and Mooncake's.
const KEEP_TRIM: u64 = 1 << 30;
/// The most keys per call (`--batch`) and layers (`--multi-layers`): far beyond a real
/// engine's, small enough that what is sized from them is never out of range.
const MAX_BATCH: u64 = 65536;
const MAX_LAYERS: u64 = 1024;
const KEEP_MMAP: u64 = 64 << 20;

/// A child process that prints one `TAG k=v ...` line when ready and exits when its stdin
/// closes (or is killed on drop).
struct Proc {
    child: Child,
    line: String,
}

impl Proc {
    fn spawn(cmd: &mut Command, tag: &str) -> Result<Proc, String> {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("starting {tag}: {e}"))?;
        let out = child.stdout.take().ok_or("no stdout")?;
        let mut line = String::new();
        let _ = BufReader::new(out).read_line(&mut line);
        if !line.starts_with(tag) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("{tag} did not start (printed {line:?})"));
        }
        Ok(Proc { child, line })
    }

    fn field(&self, key: &str) -> Option<String> {
        self.line
            .split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .map(str::to_string)
    }

    fn stop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

fn serve_segment(master: &str, size: u64) -> Result<(), String> {
    let c = Client::setup(ClientConfig {
        global_segment_size: size,
        local_buffer_size: 0,
        master_server_addr: master.to_string(),
        ..ClientConfig::default()
    })
    .map_err(|e| e.to_string())?;
    println!("KVFERRY_STORE_SERVER segment={}", c.segment_name());
    let _ = std::io::stdout().flush();
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    Ok(())
}

/// The bytes of value `key`: a pattern seeded by the key, so any mix-up shows.
fn fill_value(dst: &mut [u8], key: &str) {
    let seed = xxhash_rust::xxh3::xxh3_64(key.as_bytes());
    for (i, c) in dst.chunks_mut(8).enumerate() {
        let w = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed;
        c.copy_from_slice(&w.to_le_bytes()[..c.len()]);
    }
}

fn value_ok(got: &[u8], key: &str) -> bool {
    let mut want = vec![0u8; got.len()];
    fill_value(&mut want, key);
    want == got
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn run_client(a: &StoreBenchArgs, master: &str) -> Result<Vec<StorePoint>, String> {
    let maxv = a.values.iter().copied().max().unwrap_or(0);
    let slots = a.batch.max(1);
    // A call's values, twice (put from, get into) and once more staged: checked in check_sizes.
    let bytes = per_call(maxv, slots as u64).ok_or("--batch x --values: too large")?;
    let what = || format!("--batch {slots} x --values {}", human(maxv));
    let c = Client::setup(ClientConfig {
        global_segment_size: 0,
        local_buffer_size: bytes as u64 + (1 << 20),
        master_server_addr: master.to_string(),
        ..ClientConfig::default()
    })
    .map_err(|e| format!("{}: {e}", what()))?;
    let src = HostBuffer::new(bytes, true).map_err(|e| format!("{}: {e}", what()))?;
    let dst = HostBuffer::new(bytes, true).map_err(|e| format!("{}: {e}", what()))?;
    c.register_buffer(src.addr(), src.len() as u64)
        .map_err(|e| e.to_string())?;
    c.register_buffer(dst.addr(), dst.len() as u64)
        .map_err(|e| e.to_string())?;
    let cfg = ReplicateConfig::default();
    let mut points = Vec::new();
    // The first second after setup (the serving segment fresh, nothing mapped yet), to be
    // compared with the same loop once everything ran ("steady", measured last).
    points.push(first_or_steady(&c, &src, &dst, "first_1s", &cfg)?);
    let total = a.values.len() * 2;
    let mut n = 0;
    for &v in &a.values {
        for batch in [1usize, a.batch] {
            n += 1;
            eprint!("\r\x1b[K[{n}/{total}] values of {} x {batch} ...", human(v));
            let _ = std::io::stderr().flush();
            // Removed objects keep their space until their read leases end (no torn reads; the
            // bench's masters grant 2 s leases, long enough for a 512 MiB batch), so each phase stays under 1/8 of the
            // serving segment (at least one call): the pool never nears its eviction mark.
            let max_keys = ((a.segment_size / 8) / v.max(1)) as usize;
            let rounds_cap = (max_keys / batch).max(1);
            let vlen = v as usize;
            // put_from: zero-copy from registered memory.
            let mut keys: Vec<Vec<String>> = Vec::new();
            let mut lat = Vec::new();
            let start = Instant::now();
            let mut busy = Duration::ZERO;
            while keys.len() < rounds_cap
                && (keys.is_empty() || start.elapsed().as_secs_f64() < a.duration)
            {
                let r = keys.len();
                let ks: Vec<String> = (0..batch)
                    .map(|i| format!("kv-{v}-{batch}-{r}-{i}"))
                    .collect();
                for (i, k) in ks.iter().enumerate() {
                    fill_value(src.slice_mut(i * vlen, vlen), k);
                }
                let items: Vec<(&str, u64, u64)> = ks
                    .iter()
                    .enumerate()
                    .map(|(i, k)| (k.as_str(), src.addr() + (i * vlen) as u64, v))
                    .collect();
                let t0 = Instant::now();
                let res = if batch == 1 {
                    vec![c.put_from(items[0].0, items[0].1, v, &cfg)]
                } else {
                    c.batch_put_from(&items, &cfg)
                };
                let dt = t0.elapsed();
                busy += dt;
                lat.push(dt.as_secs_f64() * 1e6);
                for (k, r) in ks.iter().zip(res) {
                    r.map_err(|e| format!("put_from {k}: {e}"))?;
                }
                keys.push(ks);
            }
            let nkeys = keys.iter().map(Vec::len).sum();
            points.push(point("put_from", v, batch, nkeys, busy, &mut lat, true));
            // get_into: read every key back, check every byte.
            let mut verified = true;
            let (busy, mut lat, read) = read_rounds(a.duration, &keys, |ks| {
                let items: Vec<(&str, u64, u64)> = ks
                    .iter()
                    .enumerate()
                    .map(|(i, k)| (k.as_str(), dst.addr() + (i * vlen) as u64, v))
                    .collect();
                let t0 = Instant::now();
                let res = if batch == 1 {
                    vec![c.get_into(items[0].0, items[0].1, v)]
                } else {
                    c.batch_get_into(&items)
                };
                let dt = t0.elapsed();
                for (i, (k, r)) in ks.iter().zip(res).enumerate() {
                    let got = r.map_err(|e| format!("get_into {k}: {e}"))?;
                    verified &= got == v && value_ok(dst.slice(i * vlen, vlen), k);
                }
                Ok(dt)
            })?;
            points.push(point("get_into", v, batch, read, busy, &mut lat, verified));
            c.remove_all(true).map_err(|e| e.to_string())?;
            // put / get: the bytes API (copies through the local buffer).
            let mut lat = Vec::new();
            let mut busy = Duration::ZERO;
            let mut values: Vec<Vec<u8>> = (0..batch).map(|_| vec![0u8; vlen]).collect();
            for ks in &keys {
                for (val, k) in values.iter_mut().zip(ks) {
                    fill_value(val, k);
                }
                let items: Vec<(&str, &[u8])> = ks
                    .iter()
                    .zip(&values)
                    .map(|(k, val)| (k.as_str(), val.as_slice()))
                    .collect();
                let t0 = Instant::now();
                let res = c.put_batch(&items, &cfg, false);
                let dt = t0.elapsed();
                busy += dt;
                lat.push(dt.as_secs_f64() * 1e6);
                for (k, r) in ks.iter().zip(res) {
                    r.map_err(|e| format!("put {k}: {e}"))?;
                }
            }
            points.push(point("put", v, batch, nkeys, busy, &mut lat, true));
            // Freed before the reads, as the Mooncake side (`del vals`) does: the values `get`
            // returns may then reuse that memory instead of faulting fresh pages in.
            drop(values);
            let mut verified = true;
            let (busy, mut lat, read) = read_rounds(a.duration, &keys, |ks| {
                let refs: Vec<&str> = ks.iter().map(String::as_str).collect();
                let t0 = Instant::now();
                let res = c.get_batch(&refs);
                let dt = t0.elapsed();
                for (k, r) in ks.iter().zip(res) {
                    let val = r.map_err(|e| format!("get {k}: {e}"))?;
                    verified &= val.len() == vlen && value_ok(&val, k);
                }
                Ok(dt)
            })?;
            points.push(point("get", v, batch, read, busy, &mut lat, verified));
            c.remove_all(true).map_err(|e| e.to_string())?;
        }
    }
    points.push(first_or_steady(&c, &src, &dst, "steady_1s", &cfg)?);
    eprint!("\r\x1b[K");
    Ok(points)
}

/// One second of 1 MiB put_from + get_into (checked) + forced remove, one key at a time,
/// over fresh keys: run right after setup (`first_1s`) and after the sweep (`steady_1s`),
/// the two rows show whether the first second after setup runs at the steady rate.
fn first_or_steady(
    c: &Client,
    src: &HostBuffer,
    dst: &HostBuffer,
    op: &str,
    cfg: &ReplicateConfig,
) -> Result<StorePoint, String> {
    const V: usize = 1 << 20;
    if src.len() < V {
        return Ok(point(op, V as u64, 1, 0, Duration::ZERO, &mut [], true));
    }
    let (mut lat, mut busy, mut n, mut verified) = (Vec::new(), Duration::ZERO, 0usize, true);
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(1) {
        let k = format!("{op}-{n}");
        fill_value(src.slice_mut(0, V), &k);
        let t0 = Instant::now();
        c.put_from(&k, src.addr(), V as u64, cfg)
            .map_err(|e| format!("{op}: put_from {k}: {e}"))?;
        let got = c
            .get_into(&k, dst.addr(), V as u64)
            .map_err(|e| format!("{op}: get_into {k}: {e}"))?;
        c.remove(&k, true)
            .map_err(|e| format!("{op}: remove {k}: {e}"))?;
        let dt = t0.elapsed();
        busy += dt;
        lat.push(dt.as_secs_f64() * 1e6);
        verified &= got == V as u64 && value_ok(dst.slice(0, V), &k);
        n += 1;
    }
    Ok(point(op, V as u64, 1, n, busy, &mut lat, verified))
}

/// A read phase, as `tests/interop/mooncake_store_bench.py` runs Mooncake's: every round of
/// keys at least once, then cycling through them until `duration` seconds of calls (wall time
/// capped at max(3 x duration, duration + 5 s)). `one` makes one call, checks it and returns
/// the call's own duration. Returns (time in calls, per-call µs, keys read).
fn read_rounds(
    duration: f64,
    keys: &[Vec<String>],
    mut one: impl FnMut(&[String]) -> Result<Duration, String>,
) -> Result<(Duration, Vec<f64>, usize), String> {
    let (mut busy, mut lat, mut n, mut read) = (Duration::ZERO, Vec::new(), 0usize, 0usize);
    let start = Instant::now();
    let cap = (3.0 * duration).max(duration + 5.0);
    while !keys.is_empty()
        && (n < keys.len()
            || (busy.as_secs_f64() < duration && start.elapsed().as_secs_f64() < cap))
    {
        let ks = &keys[n % keys.len()];
        let dt = one(ks)?;
        busy += dt;
        lat.push(dt.as_secs_f64() * 1e6);
        n += 1;
        read += ks.len();
    }
    Ok((busy, lat, read))
}

fn point(
    op: &str,
    v: u64,
    batch: usize,
    nkeys: usize,
    busy: Duration,
    lat: &mut [f64],
    verified: bool,
) -> StorePoint {
    let nkeys = nkeys as f64;
    let secs = busy.as_secs_f64().max(1e-9);
    StorePoint {
        op: op.into(),
        value_bytes: v,
        batch,
        gbps: nkeys * v as f64 / secs / 1e9,
        keys_per_s: nkeys / secs,
        p50_us: pct(lat, 0.5),
        p99_us: pct(lat, 0.99),
        verified,
    }
}

/// Mooncake Store measured by `tests/interop/mooncake_store_bench.py` in the same run.
struct MooncakeStore {
    points: Vec<serde_json::Value>,
    note: Option<String>,
}

impl MooncakeStore {
    fn find(&self, p: &StorePoint) -> Option<&serde_json::Value> {
        self.points.iter().find(|m| {
            m["op"] == p.op.as_str() && m["value_bytes"] == p.value_bytes && m["batch"] == p.batch
        })
    }
}

fn run_mooncake(a: &StoreBenchArgs) -> MooncakeStore {
    let py = a
        .mooncake_python
        .clone()
        .or_else(|| std::env::var("KVFERRY_MOONCAKE_PYTHON").ok());
    let py = match py.as_deref() {
        None => {
            return MooncakeStore {
                points: Vec::new(),
                note: Some(
                    "not run: pass --mooncake-python PY (a Python with \
                    mooncake-transfer-engine-non-cuda) or set KVFERRY_MOONCAKE_PYTHON"
                        .into(),
                ),
            }
        }
        Some("none") => {
            return MooncakeStore {
                points: Vec::new(),
                note: Some("not run (disabled)".into()),
            }
        }
        Some(p) => p.to_string(),
    };
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/interop/mooncake_store_bench.py");
    if !script.is_file() {
        return MooncakeStore {
            points: Vec::new(),
            note: Some(format!(
                "not run: {} is missing (run from a source checkout)",
                script.display()
            )),
        };
    }
    eprint!("\r\x1b[K[mooncake store] running the same sweep ...");
    let values: Vec<String> = a.values.iter().map(u64::to_string).collect();
    let cycle: Vec<String> = if a.no_cycle {
        Vec::new()
    } else {
        a.cycle_values.iter().map(u64::to_string).collect()
    };
    let bound = Duration::from_secs_f64(a.peer_timeout.max(0.0));
    let out = crate::peers::output_within(
        Command::new(&py)
            .envs(if a.malloc_trim == MallocTrim::Off {
                vec![
                    ("MALLOC_TRIM_THRESHOLD_", KEEP_TRIM.to_string()),
                    ("MALLOC_MMAP_THRESHOLD_", KEEP_MMAP.to_string()),
                ]
            } else {
                vec![]
            })
            .arg(&script)
            .args([
                "--values",
                &values.join(","),
                "--batch",
                &a.batch.to_string(),
                "--duration",
                &a.duration.to_string(),
            ])
            .args([
                "--cycle-values",
                &cycle.join(","),
                "--cycle-segment-size",
                &a.cycle_segment_size.to_string(),
            ])
            .args([
                "--multi-layers",
                &a.multi_layers.to_string(),
                "--multi-part",
                &a.multi_part.to_string(),
            ])
            .args([
                "--segment-size",
                &a.segment_size.to_string(),
                "--lease-ms",
                "2000",
            ]),
        bound,
    );
    eprint!("\r\x1b[K");
    match out {
        Err(e) => MooncakeStore {
            points: Vec::new(),
            note: Some(format!("not run: {py}: {e}")),
        },
        Ok(o) => {
            let points: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter_map(|l| serde_json::from_str(l).ok())
                .collect();
            let mut note = points
                .iter()
                .find_map(|p| p["error"].as_str().map(|e| format!("Mooncake failed: {e}")));
            if o.timed_out() {
                note = Some(format!(
                    "Mooncake's sweep did not finish within {bound:?} and was killed \
                    (--peer-timeout sets the bound); the points it finished are shown"
                ));
            }
            MooncakeStore {
                points: points
                    .into_iter()
                    .filter(|p| p.get("gbps").is_some())
                    .collect(),
                note,
            }
        }
    }
}

fn print_table(a: &StoreBenchArgs, points: &[StorePoint], mc: &MooncakeStore) {
    let transport = match std::env::var("KVFERRY_TRANSPORT").ok().as_deref() {
        Some("tcp") => "TCP (KVFERRY_TRANSPORT=tcp)".to_string(),
        Some("shm") => "shared memory (KVFERRY_TRANSPORT=shm)".to_string(),
        _ => "the engine's choice: shared memory between processes on one host, else TCP; \
             KVFERRY_TRANSPORT=tcp forces TCP"
            .to_string(),
    };
    println!(
        "kvferry store-bench: master + 2 clients on 127.0.0.1, values move client to client over \
        {transport}; {} serving segment",
        human(a.segment_size)
    );
    println!("latency is per call (a batched call moves {} keys); /mc = kvferry / Mooncake Store in this run", a.batch);
    println!(
        "malloc: {}",
        if a.malloc_trim == MallocTrim::Off {
            "freed memory kept in both sides' processes (glibc M_TRIM_THRESHOLD 1 GiB, \
            M_MMAP_THRESHOLD 64 MiB; --malloc-trim on: glibc's defaults)"
        } else {
            "glibc's defaults in both sides' processes (freed memory may go back to the kernel: \
            fresh values then fault pages in)"
        }
    );
    if !a.no_cycle {
        println!(
            "cycle = put_from + get_into (checked) + remove(force) of one key, on a pool of its \
            own with a {} segment, at least {}x its size put per point (GB/s: bytes put; latency \
            per cycle)",
            human(a.cycle_segment_size),
            4
        );
    }
    if a.multi_layers > 0 {
        println!(
            "put_multi/get_multi = {} keys per call, each {} regions of {} scattered in a \
            registered KV cache (value = the whole key)",
            a.batch,
            a.multi_layers,
            human(a.multi_part)
        );
    }
    println!();
    println!(
        "{:<9} {:>8} {:>6} {:>8} {:>11} {:>10} {:>10} {:>8} {:>9} {:>9} {:>9}",
        "op",
        "value",
        "batch",
        "GB/s",
        "keys/s",
        "p50 (us)",
        "p99 (us)",
        "verified",
        "mc GB/s",
        "mc p50",
        "/mc"
    );
    for p in points {
        let m = mc.find(p);
        let f = |k: &str| m.and_then(|m| m[k].as_f64());
        println!(
            "{:<9} {:>8} {:>6} {:>8.3} {:>11.0} {:>10.1} {:>10.1} {:>8} {:>9} {:>9} {:>9}",
            p.op,
            human(p.value_bytes),
            p.batch,
            p.gbps,
            p.keys_per_s,
            p.p50_us,
            p.p99_us,
            if p.verified { "yes" } else { "NO" },
            f("gbps")
                .map(|g| format!("{g:.3}"))
                .unwrap_or_else(|| "-".into()),
            f("p50_us")
                .map(|g| format!("{g:.1}"))
                .unwrap_or_else(|| "-".into()),
            f("gbps")
                .filter(|g| *g > 0.0)
                .map(|g| format!("{:.2}x", p.gbps / g))
                .unwrap_or_else(|| "-".into()),
        );
    }
    if let Some(n) = &mc.note {
        println!("\nmooncake: {n}");
    }
}

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|x| x.parse::<u64>().ok())
        })
        // SAFETY: sysconf has no preconditions.
        .map(|pages| pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as u64)
        .unwrap_or(0)
}

fn master_only(a: &StoreBenchArgs) -> Result<(), String> {
    use kvferry_store::server::{handle, MasterServer};
    use std::sync::Arc;
    // 1. Memory per object: the master never touches data, so a huge virtual segment costs nothing.
    let m = Master::new(MasterConfig::default());
    let seg = Segment {
        id: 1,
        name: "seg".into(),
        te_endpoint: "127.0.0.1:1".into(),
        base: 1 << 40,
        size: 1 << 40,
    };
    handle(
        &m,
        Request::MountSegment {
            client: 1,
            segment: seg,
        },
    );
    let before = rss_bytes();
    let cfg = ReplicateConfig::default();
    let t = Instant::now();
    for i in 0..a.objects {
        let key = format!("object-{i:012}");
        handle(
            &m,
            Request::PutStart {
                client: 1,
                key: key.clone(),
                size: 4096,
                config: cfg.clone(),
                upsert: false,
                put: 1,
            },
        );
        handle(
            &m,
            Request::PutEnd {
                client: 1,
                key,
                put: 1,
            },
        );
    }
    let fill = t.elapsed().as_secs_f64();
    let per_obj = (rss_bytes().saturating_sub(before)) as f64 / a.objects as f64;
    println!(
        "master memory: {} objects (keys of 19 bytes) take {:.0} bytes each (RSS growth); created \
        at {:.0} puts/s in-process",
        a.objects,
        per_obj,
        a.objects as f64 / fill
    );
    // 2. Throughput over RPC: connections from several threads, 32 ops per request.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let m = Arc::new(m);
    let server = MasterServer::start(Arc::clone(&m), listener, Duration::from_millis(200), 0)
        .map_err(|e| e.to_string())?;
    let addr = format!("127.0.0.1:{}", server.port());
    for (threads, per_req) in [(4usize, 1usize), (4, 32)] {
        let dur = Duration::from_secs_f64(a.duration.max(0.2));
        let start = Instant::now();
        let ops: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads)
                .map(|t| {
                    let addr = addr.clone();
                    s.spawn(move || -> u64 {
                        let Ok(mut conn) = std::net::TcpStream::connect(&addr) else {
                            return 0;
                        };
                        let _ = conn.set_nodelay(true);
                        let mut n = 0u64;
                        let mut i = t as u64;
                        while start.elapsed() < dur {
                            let reqs: Vec<Request> = (0..per_req)
                                .map(|_| {
                                    i += 1;
                                    Request::ExistKey {
                                        key: format!("object-{:012}", i % a.objects.max(1)),
                                    }
                                })
                                .collect();
                            let req = if per_req == 1 {
                                reqs.into_iter().next().expect("one")
                            } else {
                                Request::Batch(reqs)
                            };
                            let Ok(frame) = kvferry_store::proto::encode(&req) else {
                                return n;
                            };
                            if conn.write_all(&frame).is_err() {
                                return n;
                            }
                            let mut len = [0u8; 4];
                            if conn.read_exact(&mut len).is_err() {
                                return n;
                            }
                            let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
                            if conn.read_exact(&mut body).is_err() {
                                return n;
                            }
                            n += per_req as u64;
                        }
                        n
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0)).sum()
        });
        let secs = start.elapsed().as_secs_f64();
        println!(
            "master RPC: {:.0} metadata ops/s ({threads} connections, {per_req} op(s) per \
            request, ExistKey on {} objects)",
            ops as f64 / secs,
            a.objects
        );
    }
    drop(server);
    Ok(())
}
