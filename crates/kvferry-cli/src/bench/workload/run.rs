//! The initiator's side of `--workload`: every (transport, preset, tokens, concurrency,
//! direction) point, timed per request, verified per request slot, beside the same bytes in
//! one descriptor per region and the ceilings.

use super::mooncake::{self, Planned};
use super::{hash, packed_request, preset, request, Desc, Pool, Preset, Side};
use crate::bench::{
    connect, engine_config, measure_ceilings, pct, spawn_target, stop_child, BenchArgs, Connected,
    Ctl,
};
use crate::sys::{self, human, Buffer};
use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest, TransportMode};
use serde::Serialize;
use std::io::Write;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

/// One measured point, as written by `--json`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct WorkloadPoint {
    pub(crate) bench: &'static str,
    pub(crate) engine: &'static str,
    pub(crate) preset: String,
    pub(crate) tokens: u64,
    pub(crate) concurrency: usize,
    /// `push` (the initiator writes into the target) or `pull` (reads from it).
    pub(crate) direction: String,
    pub(crate) transport: String,
    pub(crate) descriptors: usize,
    pub(crate) request_bytes: u64,
    pub(crate) requests: usize,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) gbps: f64,
    /// The same bytes in one descriptor per region, same concurrency.
    pub(crate) packed_gbps: f64,
    /// The ceiling of this transport measured in the same run (memcpy for shared memory,
    /// a loopback socket stream for TCP).
    pub(crate) ceiling_gbps: f64,
    /// Over shared memory: one thread's memcpy of the same descriptors between two buffers
    /// of this process (the memory system's cost of the scattered shape, no engine); else 0.
    pub(crate) scattered_memcpy_gbps: f64,
    pub(crate) descriptors_per_s: f64,
    /// Both processes' CPU time per request.
    pub(crate) cpu_ms_per_request: f64,
    /// A fresh engine's first request of this shape, its `open_segment` included (which
    /// opens the data path: TCP connections, shared-memory mappings), in ms; only on each
    /// transport's first point, else 0.
    pub(crate) first_ms: f64,
    /// Of `first_ms`, the `open_segment` call (the handshake and what it starts).
    pub(crate) open_ms: f64,
    /// A fresh engine's `register_memory` of `register_bytes` of host memory (a KV cache
    /// reserved but not yet touched), in ms; only on each transport's first point, else 0.
    pub(crate) register_ms: f64,
    pub(crate) register_bytes: u64,
    pub(crate) verified: bool,
}

/// The KV cache whose registration time is reported (issue 46: 16 GiB well under a second).
const REGISTER_PROBE: u64 = 16 << 30;

/// `--workload`: starts a target sized for the largest point (unless `--mode initiator`),
/// runs every point, prints the report and writes the records.
pub(crate) fn run(a: &BenchArgs, segment: Option<&str>) -> Result<(), String> {
    let presets: Vec<&Preset> = a
        .workload
        .iter()
        .map(|n| preset(n))
        .collect::<Result<_, _>>()?;
    for d in &a.directions {
        if d != "push" && d != "pull" {
            return Err(format!("--directions {d:?}: use push and/or pull"));
        }
    }
    let max_c = a.concurrency.iter().copied().max().unwrap_or(1) as u64;
    let max_t = a.tokens.iter().copied().max().unwrap_or(1);
    // Each side's pool: room for the largest point of the largest preset with a quarter
    // more blocks than it takes (so the permutation scatters), within --max-memory.
    let want = presets
        .iter()
        .map(|p| {
            let blocks = p.blocks_for(max_t).saturating_mul(max_c);
            p.row_bytes()
                .saturating_mul(blocks.div_ceil(4))
                .saturating_mul(5)
        })
        .max()
        .unwrap_or(0);
    let bytes = want.min(a.max_memory).max(1 << 20);
    let buf = Buffer::alloc(bytes as usize, a.hugepages, a.memory == "kvferry")
        .map_err(|e| format!("the KV pool of {}: allocating it: {e}", human(bytes)))?;
    let (child, target) = match segment {
        Some(s) => (None, s.to_string()),
        None => {
            let (c, s, _) = spawn_target(a, bytes, &[])?;
            (Some(c), s)
        }
    };
    let r = run_points(a, &presets, &buf, &target);
    if let Some(c) = child {
        stop_child(c);
    }
    drop(buf); // Mooncake's two pools take its place
    let (points, planned) = r?;
    let py = a
        .mooncake_python
        .clone()
        .or_else(|| std::env::var("KVFERRY_MOONCAKE_PYTHON").ok());
    let mc = match py.as_deref() {
        None => mooncake::Outcome {
            points: Vec::new(),
            note: Some(
                "not run: pass --mooncake-python PY (a Python with \
                 mooncake-transfer-engine-non-cuda) or set KVFERRY_MOONCAKE_PYTHON"
                    .into(),
            ),
        },
        Some("none") => mooncake::Outcome {
            points: Vec::new(),
            note: Some("not run (disabled)".into()),
        },
        Some(py) => {
            // Each point: its duration twice (requests, verification) and setup.
            let bound = Duration::from_secs_f64(
                a.peer_timeout.max(0.0) + planned.len() as f64 * (2.0 * a.duration + 20.0),
            );
            mooncake::run(py, &planned, bytes, a.duration, a.chunk, bound)
        }
    };
    print_mooncake(&points, &mc);
    if let Some(path) = &a.json {
        let mut out = String::new();
        for p in &points {
            out.push_str(&serde_json::to_string(p).expect("serialisable"));
            out.push('\n');
        }
        for m in &mc.points {
            out.push_str(&m.to_string());
            out.push('\n');
        }
        std::fs::write(path, out).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    if mc.points.iter().any(|m| m["verified"] != true) {
        return Err("Mooncake's requests were not all verified (see the table)".into());
    }
    if points.iter().any(|p| !p.verified) {
        return Err("some requests were not verified (see the table)".into());
    }
    Ok(())
}

fn run_points(
    a: &BenchArgs,
    presets: &[&'static Preset],
    buf: &Buffer,
    target: &str,
) -> Result<(Vec<WorkloadPoint>, Vec<Planned>), String> {
    let ceilings = (!a.no_ceilings).then(|| measure_ceilings(a.hugepages));
    eprint!("\r\x1b[K");
    println!(
        "kvferry bench --workload: {} per side ({} memory), {:.1} s per point, {}",
        human(buf.len() as u64),
        a.memory,
        a.duration,
        if a.chunk == 0 {
            "each request in one call".to_string()
        } else {
            format!("each request in calls of {} descriptors", a.chunk)
        }
    );
    for p in presets {
        println!("  {}: {}", p.name, p.about);
    }
    if let Some(c) = &ceilings {
        println!(
            "ceilings: single-thread memcpy {:.2} GB/s, loopback socket stream {:.2} GB/s",
            c.memcpy_gbps, c.socket_gbps
        );
    }
    println!(
        "\n{:<16} {:>7} {:>3} {:>4} {:>9} {:>7} {:>8} {:>9} {:>9} {:>7} {:>7} {:>6} {:>7} {:>7} {:>8} {:>6}",
        "preset", "tokens", "C", "dir", "transport", "descs", "MB/req", "p50 ms", "p99 ms",
        "GB/s", "packed", "/pack", "/ceil", "Mdesc/s", "cpu ms", "ok"
    );
    let base = engine_config(a)?;
    // The destination of the scattered-memcpy reference: a second pool in this process.
    let mirror = if a.no_ceilings {
        None
    } else {
        Some(
            Buffer::alloc(buf.len(), a.hugepages, false)
                .map_err(|e| format!("the memcpy reference's buffer: {e}"))?,
        )
    };
    let mut points = Vec::new();
    let mut planned = Vec::new();
    let mut seed = 1u64;
    for &mode in &a.transport {
        let Connected {
            engine,
            seg,
            via,
            remote,
        } = connect(mode, &base, buf, target)?;
        let via = via.name;
        let bytes = (buf.len() as u64).min(remote.length);
        let ctl = Ctl {
            engine: &engine,
            target: target.to_string(),
            token: AtomicU64::new(1),
        };
        let ceiling = ceilings.as_ref().map_or(0.0, |c| match via {
            "shm" | "local" => c.memcpy_gbps,
            _ => c.socket_gbps,
        });
        let mut first_done = false;
        for p in presets {
            let pool = Pool::fitting(p, bytes);
            for &tokens in &a.tokens {
                for &c in &a.concurrency {
                    for dir in &a.directions {
                        seed += 1;
                        let Some(slots) = (0..c as u64)
                            .map(|s| request(p, &pool, tokens, s, seed))
                            .collect::<Option<Vec<_>>>()
                        else {
                            println!(
                                "{:<16} {:>7} {:>3} {:>4} {:>9}  skipped: {} request(s) of {} tokens \
                                 need more than the {} pool (--max-memory)",
                                p.name, tokens, c, dir, via, c, tokens, human(bytes)
                            );
                            continue;
                        };
                        let pt = Point {
                            engine: &engine,
                            ctl: &ctl,
                            buf,
                            seg,
                            remote: remote.addr,
                            opcode: if dir == "push" {
                                Opcode::Write
                            } else {
                                Opcode::Read
                            },
                            chunk: a.chunk,
                        };
                        let ((first_ms, open_ms), register_ms) = if first_done {
                            ((0.0, 0.0), 0.0)
                        } else {
                            first_done = true;
                            (
                                first_request(
                                    a,
                                    &base,
                                    mode,
                                    target,
                                    buf,
                                    remote.addr,
                                    &slots[0],
                                    pt.opcode,
                                )?,
                                register_time(&base, mode)?,
                            )
                        };
                        eprint!("\r\x1b[K[{}] {} {tokens} x{c} {dir} ...", via, p.name);
                        let _ = std::io::stderr().flush();
                        let r = pt.measure(p, &pool, tokens, seed, &slots, a.duration)?;
                        let packed: Vec<Vec<Desc>> = (0..c as u64)
                            .map(|s| packed_request(p, &pool, tokens, s).unwrap_or_default())
                            .collect();
                        let packed_gbps = pt.throughput(&packed, a.duration)?;
                        let scattered_memcpy_gbps = match (&mirror, via) {
                            (Some(m), "shm" | "local") => {
                                scattered_memcpy(buf, m, &slots[0], a.duration)
                            }
                            _ => 0.0,
                        };
                        eprint!("\r\x1b[K");
                        let descs = slots[0].len();
                        let request_bytes: u64 = slots[0].iter().map(|d| d.len).sum();
                        let wp = WorkloadPoint {
                            bench: "workload",
                            engine: "kvferry",
                            preset: p.name.to_string(),
                            tokens,
                            concurrency: c,
                            direction: dir.clone(),
                            transport: via.to_string(),
                            descriptors: descs,
                            request_bytes,
                            requests: r.lat_ms.len(),
                            p50_ms: pct(&mut r.lat_ms.clone(), 0.5),
                            p99_ms: pct(&mut r.lat_ms.clone(), 0.99),
                            gbps: r.gbps,
                            packed_gbps,
                            ceiling_gbps: ceiling,
                            scattered_memcpy_gbps,
                            descriptors_per_s: r.lat_ms.len() as f64 * descs as f64 / r.secs,
                            cpu_ms_per_request: r.cpu_s * 1e3 / r.lat_ms.len().max(1) as f64,
                            first_ms,
                            open_ms,
                            register_ms,
                            register_bytes: if register_ms > 0.0 { REGISTER_PROBE } else { 0 },
                            verified: r.verified,
                        };
                        print_point(&wp);
                        points.push(wp);
                        if mode == a.transport[0] {
                            planned.push(Planned {
                                preset: p,
                                tokens,
                                concurrency: c,
                                direction: dir.clone(),
                                seed,
                                pool_blocks: pool.blocks,
                            });
                        }
                    }
                }
            }
        }
    }
    Ok((points, planned))
}

/// Mooncake's points beside kvferry's TCP ones.
fn print_mooncake(points: &[WorkloadPoint], mc: &mooncake::Outcome) {
    println!("\nStock Mooncake (Python lists, calls of 8192 descriptors on 8 threads, TCP):");
    if let Some(n) = &mc.note {
        println!("  {n}");
    }
    if mc.points.is_empty() {
        return;
    }
    println!(
        "{:<16} {:>7} {:>3} {:>4} {:>9} {:>9} {:>8} {:>11} {:>11} {:>8} {:>4}",
        "preset",
        "tokens",
        "C",
        "dir",
        "MC GB/s",
        "MC p50",
        "kvf tcp",
        "kvf tcp p50",
        "kvf/MC",
        "p50 /",
        "ok"
    );
    for m in &mc.points {
        let ours = points.iter().find(|p| {
            p.transport == "tcp"
                && m["preset"] == p.preset.as_str()
                && m["tokens"] == p.tokens
                && m["concurrency"] == p.concurrency
                && m["direction"] == p.direction.as_str()
        });
        let g = m["gbps"].as_f64().unwrap_or(0.0);
        let p50 = m["p50_ms"].as_f64().unwrap_or(0.0);
        let (kg, kp, r, rp) = match ours {
            Some(o) if g > 0.0 && o.p50_ms > 0.0 => (
                format!("{:.2}", o.gbps),
                format!("{:.2}", o.p50_ms),
                format!("{:.1}x", o.gbps / g),
                format!("{:.1}x", p50 / o.p50_ms),
            ),
            _ => ("-".into(), "-".into(), "-".into(), "-".into()),
        };
        println!(
            "{:<16} {:>7} {:>3} {:>4} {:>9.3} {:>9.1} {:>8} {:>11} {:>11} {:>8} {:>4}",
            m["preset"].as_str().unwrap_or("?"),
            m["tokens"].to_string(),
            m["concurrency"].to_string(),
            m["direction"].as_str().unwrap_or("?"),
            g,
            p50,
            kg,
            kp,
            r,
            rp,
            if m["verified"] == true { "yes" } else { "NO" }
        );
    }
}

fn print_point(p: &WorkloadPoint) {
    let ratio = |x: f64, y: f64| {
        if y > 0.0 {
            format!("{:.2}", x / y)
        } else {
            "-".into()
        }
    };
    println!(
        "{:<16} {:>7} {:>3} {:>4} {:>9} {:>7} {:>8.1} {:>9.2} {:>9.2} {:>7.2} {:>7.2} {:>6} {:>7} {:>7.2} {:>8.2} {:>6}",
        p.preset,
        p.tokens,
        p.concurrency,
        p.direction,
        p.transport,
        p.descriptors,
        p.request_bytes as f64 / 1e6,
        p.p50_ms,
        p.p99_ms,
        p.gbps,
        p.packed_gbps,
        ratio(p.gbps, p.packed_gbps),
        ratio(p.gbps, p.ceiling_gbps),
        p.descriptors_per_s / 1e6,
        p.cpu_ms_per_request,
        if p.verified { "yes" } else { "NO" }
    );
    if p.scattered_memcpy_gbps > 0.0 {
        println!(
            "  memcpy of the same descriptors, one thread, no engine: {:.2} GB/s (this point at {} of it)",
            p.scattered_memcpy_gbps,
            ratio(p.gbps, p.scattered_memcpy_gbps)
        );
    }
    if p.register_ms > 0.0 {
        println!(
            "  registering a {} KV cache (reserved, untouched) in a fresh engine: {:.3} ms",
            human(p.register_bytes),
            p.register_ms
        );
    }
    if p.first_ms > 0.0 {
        println!(
            "  first request to a new peer (fresh engine, open_segment included): {:.2} ms ({} x the warm p50), of which open_segment {:.2} ms",
            p.first_ms,
            ratio(p.first_ms, p.p50_ms),
            p.open_ms
        );
    }
}

/// What a point moves requests with.
struct Point<'a> {
    engine: &'a TransferEngine,
    ctl: &'a Ctl<'a>,
    buf: &'a Buffer,
    seg: u64,
    remote: u64,
    opcode: Opcode,
    /// Descriptors per call; 0: the whole request in one.
    chunk: usize,
}

struct Measured {
    lat_ms: Vec<f64>,
    secs: f64,
    gbps: f64,
    cpu_s: f64,
    verified: bool,
}

fn requests(d: &[Desc], opcode: Opcode, base: u64, seg: u64, remote: u64) -> Vec<TransferRequest> {
    d.iter()
        .map(|d| TransferRequest {
            opcode,
            source: base + d.local,
            target_id: seg,
            target_offset: remote + d.remote,
            length: d.len,
        })
        .collect()
}

impl Point<'_> {
    /// One request: its descriptors in calls of `chunk` (or one), in this thread.
    fn one(&self, reqs: &[TransferRequest]) -> Result<(), String> {
        let per = if self.chunk == 0 {
            reqs.len().max(1)
        } else {
            self.chunk
        };
        for part in reqs.chunks(per) {
            let st = self
                .engine
                .transfer_sync(part, Duration::from_secs(120))
                .map_err(|e| e.to_string())?;
            if st.status != TaskStatus::Completed {
                return Err(format!(
                    "a request ended {:?}: {}",
                    st.status,
                    st.reason.unwrap_or_default()
                ));
            }
        }
        Ok(())
    }

    /// `slots.len()` threads, each moving its slot's request back to back for `secs` (at
    /// least once): every request's time.
    fn timed(&self, slots: &[Vec<Desc>], secs: f64) -> Result<(Vec<f64>, f64), String> {
        let start = Instant::now();
        let dur = Duration::from_secs_f64(secs.max(0.01));
        let results: Vec<Result<Vec<f64>, String>> = std::thread::scope(|s| {
            let hs: Vec<_> = slots
                .iter()
                .map(|d| {
                    let reqs = requests(d, self.opcode, self.buf.addr(), self.seg, self.remote);
                    s.spawn(move || {
                        let mut lat = Vec::new();
                        while lat.is_empty() || start.elapsed() < dur {
                            let t0 = Instant::now();
                            self.one(&reqs)?;
                            lat.push(t0.elapsed().as_secs_f64() * 1e3);
                        }
                        Ok(lat)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("a request thread panicked".into()))
                })
                .collect()
        });
        let elapsed = start.elapsed().as_secs_f64();
        let mut lat = Vec::new();
        for r in results {
            lat.extend(r?);
        }
        Ok((lat, elapsed))
    }

    /// GB/s of `slots` moved concurrently for `secs`.
    fn throughput(&self, slots: &[Vec<Desc>], secs: f64) -> Result<f64, String> {
        let (lat, elapsed) = self.timed(slots, secs)?;
        let per: u64 = slots.first().map_or(0, |d| d.iter().map(|d| d.len).sum());
        Ok(lat.len() as f64 * per as f64 / elapsed / 1e9)
    }

    /// The point: the source filled (a pattern of `seed`) and the destination cleared, the
    /// requests timed, then each slot's destination checked against its source.
    fn measure(
        &self,
        p: &Preset,
        pool: &Pool,
        tokens: u64,
        seed: u64,
        slots: &[Vec<Desc>],
        secs: f64,
    ) -> Result<Measured, String> {
        if self.opcode == Opcode::Write {
            for d in slots.iter().flatten() {
                self.buf.fill(d.local as usize, d.len as usize, seed);
            }
        } else {
            for d in slots.iter().flatten() {
                self.buf.slice_mut(d.local as usize, d.len as usize).fill(0);
            }
        }
        let tgt0 = self.ctl.cpu()?;
        let cpu0 = sys::self_cpu();
        let (lat_ms, elapsed) = self.timed(slots, secs)?;
        let cpu_s = (sys::self_cpu() - cpu0).as_secs_f64() + (self.ctl.cpu()? - tgt0);
        let per: u64 = slots[0].iter().map(|d| d.len).sum();
        let mut verified = true;
        for (slot, d) in slots.iter().enumerate() {
            let mine = hash(self.buf, d, Side::Initiator).map(|h| format!("{h:016x}"));
            let theirs = self.ctl.ask(
                "wl-checksum",
                &format!("{} {tokens} {} {seed} {slot}", p.name, pool.blocks),
            )?;
            verified &= mine.as_deref() == Some(theirs.as_str());
        }
        Ok(Measured {
            gbps: lat_ms.len() as f64 * per as f64 / elapsed / 1e9,
            secs: elapsed,
            lat_ms,
            cpu_s,
            verified,
        })
    }
}

/// GB/s of one thread copying `d`'s pieces from `src` (initiator offsets) to `dst` (target
/// offsets) for `secs` (at least once): what the scattered shape costs the memory system.
fn scattered_memcpy(src: &Buffer, dst: &Buffer, d: &[Desc], secs: f64) -> f64 {
    let bytes: u64 = d.iter().map(|d| d.len).sum();
    let in_range = |off: u64, len: u64| off.checked_add(len).is_some_and(|e| e <= src.len() as u64);
    if !d
        .iter()
        .all(|d| in_range(d.local, d.len) && in_range(d.remote, d.len))
    {
        return 0.0;
    }
    let start = Instant::now();
    let mut rounds = 0u64;
    while rounds == 0 || start.elapsed().as_secs_f64() < secs {
        for x in d {
            dst.slice_mut(x.remote as usize, x.len as usize)
                .copy_from_slice(src.slice(x.local as usize, x.len as usize));
        }
        rounds += 1;
    }
    (rounds * bytes) as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// A fresh engine's `register_memory` of a `REGISTER_PROBE`-byte KV cache, in ms: anonymous
/// memory reserved and not touched (registration must not depend on the pages being there;
/// what the first access costs is `first_ms`'s). Not over RDMA, where registering pins every
/// page: 16 GiB would have to be memory this host can spare (0 then).
fn register_time(base: &Config, mode: TransportMode) -> Result<f64, String> {
    if mode == TransportMode::Rdma {
        return Ok(0.0);
    }
    let kv = Buffer::reserve(REGISTER_PROBE as usize).map_err(|e| {
        format!(
            "reserving {} to time its registration: {e}",
            human(REGISTER_PROBE)
        )
    })?;
    let engine = TransferEngine::new(Config {
        transport: mode,
        ..base.clone()
    })
    .map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    engine
        .register_memory(kv.addr(), REGISTER_PROBE, "cpu:0")
        .map_err(|e| format!("registering {}: {e}", human(REGISTER_PROBE)))?;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    engine
        .unregister_memory(kv.addr())
        .map_err(|e| e.to_string())?;
    Ok(ms.max(1e-6))
}

/// A fresh engine's first request of `d`, its `open_segment` included, in ms, and the
/// `open_segment` alone. The segment is opened right before the request, so what opening
/// starts in the background (TCP connections) is still counted where the request waits for it.
#[allow(clippy::too_many_arguments)]
fn first_request(
    a: &BenchArgs,
    base: &Config,
    mode: TransportMode,
    target: &str,
    buf: &Buffer,
    remote: u64,
    d: &[Desc],
    opcode: Opcode,
) -> Result<(f64, f64), String> {
    let engine = TransferEngine::new(Config {
        transport: mode,
        ..base.clone()
    })
    .map_err(|e| e.to_string())?;
    engine
        .register_memory(buf.addr(), buf.len() as u64, "cpu:0")
        .map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let seg = engine.open_segment(target).map_err(|e| e.to_string())?;
    let open_ms = t0.elapsed().as_secs_f64() * 1e3;
    let reqs = requests(d, opcode, buf.addr(), seg, remote);
    let ctl = Ctl {
        engine: &engine,
        target: target.to_string(),
        token: AtomicU64::new(1),
    };
    let pt = Point {
        engine: &engine,
        ctl: &ctl,
        buf,
        seg,
        remote,
        opcode,
        chunk: a.chunk,
    };
    pt.one(&reqs)?;
    Ok((t0.elapsed().as_secs_f64() * 1e3, open_ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The memcpy reference copies each piece from its initiator offset to its target offset,
    /// and refuses pieces outside the buffers rather than touching them.
    #[test]
    fn the_scattered_memcpy_reference_copies_every_piece_where_the_request_would() {
        let p = super::super::preset("qwen3-8b").unwrap();
        let pool = Pool::new(p, 8);
        let len = (p.row_bytes() * 8) as usize;
        let (src, dst) = (
            Buffer::alloc(len, false, false).unwrap(),
            Buffer::alloc(len, false, false).unwrap(),
        );
        src.fill(0, len, 3);
        let d = request(p, &pool, 40, 1, 5).unwrap();
        assert!(scattered_memcpy(&src, &dst, &d, 0.0) > 0.0);
        assert_eq!(
            hash(&src, &d, Side::Initiator),
            hash(&dst, &d, Side::Target)
        );
        let outside = [Desc {
            local: len as u64 - 1,
            remote: 0,
            len: 2,
        }];
        assert_eq!(scattered_memcpy(&src, &dst, &outside, 0.0), 0.0);
    }
}
