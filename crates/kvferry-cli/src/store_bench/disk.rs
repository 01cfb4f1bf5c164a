//! `kvferry store-bench --disk DIR`: the store with a disk tier in the multi-turn shape
//! (Mooncake's SSD-offload benchmark, scaled down): a conversation's turns are put one after
//! the other into a memory pool a third of their total size, and each round reads back the
//! values of earlier turns (the two before it and two older ones). Run twice in this
//! process, against an in-process master on 127.0.0.1: memory only (what eviction takes is
//! gone), and with the pool's client keeping what the master evicts on `DIR`. Reported: the
//! hit rate of each, get p50/p99 from memory and from disk, the throughput of batched gets
//! of records out of the page cache, and beside it the device's sequential read measured in
//! the same run with a plain `O_DIRECT` read loop. Every value read is checked.

use super::{fill_value, pct, value_ok, StoreBenchArgs};
use crate::sys::human;
use kvferry::hostbuf::HostBuffer;
use kvferry_store::master::MasterConfig;
use kvferry_store::server::MasterServer;
use kvferry_store::{Client, ClientConfig, Master, Replica, ReplicateConfig};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Values per turn.
const PER_TURN: usize = 8;
/// Keys per batched get of the throughput phase.
const BATCH: usize = 16;
/// Bytes of the sequential read's file.
const SEQ_FILE: u64 = 256 << 20;
/// Bytes per `O_DIRECT` read.
const SEQ_CHUNK: usize = 1 << 20;

/// The bench's records' directory under `--disk`, removed when dropped.
struct Records(std::path::PathBuf);

impl Records {
    fn create(dir: &Path) -> Result<Records, String> {
        let p = dir.join(format!("kvferry-disk-bench-{}", std::process::id()));
        std::fs::create_dir(&p).map_err(|e| format!("--disk: creating {}: {e}", p.display()))?;
        Ok(Records(p))
    }
}

impl Drop for Records {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What one run of the multi-turn shape saw.
#[derive(Default)]
struct Turns {
    gets: usize,
    hits: usize,
    wrong: usize,
    put_failed: usize,
    /// Get latencies (µs) of values found in memory, on disk.
    memory_us: Vec<f64>,
    disk_us: Vec<f64>,
    secs: f64,
}

fn key(turn: usize, i: usize) -> String {
    format!("conv0-turn{turn:04}-{i}")
}

/// An in-process master (offload on with `disk`) with one client contributing `pool` bytes
/// (its disk tier on `disk`), and a reader without a segment.
struct Pool {
    _server: MasterServer,
    _owner: Client,
    reader: Client,
}

impl Pool {
    fn start(pool: u64, disk: Option<&Path>) -> Result<Pool, String> {
        let m = Arc::new(Master::new(MasterConfig {
            offload_timeout: match disk {
                Some(_) => Duration::from_secs(30),
                None => Duration::ZERO,
            },
            ..MasterConfig::default()
        }));
        let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        let addr = l.local_addr().map_err(|e| e.to_string())?.to_string();
        let server = MasterServer::start(m, l, Duration::from_millis(10), 0)
            .map_err(|e| format!("starting the master: {e}"))?;
        let owner = Client::setup(ClientConfig {
            master_server_addr: addr.clone(),
            global_segment_size: pool,
            local_buffer_size: 0,
            ssd_offload_path: disk.map(Path::to_path_buf),
            offload_interval: Duration::from_millis(5),
            ..ClientConfig::default()
        })
        .map_err(|e| format!("the pool's client (--disk {disk:?}): {e}"))?;
        let reader = Client::setup(ClientConfig {
            master_server_addr: addr,
            global_segment_size: 0,
            local_buffer_size: 64 << 20,
            ..ClientConfig::default()
        })
        .map_err(|e| format!("the reader: {e}"))?;
        Ok(Pool {
            _server: server,
            _owner: owner,
            reader,
        })
    }
}

/// Where `key` is now (for the latency split): `Some(true)` on a disk only.
fn on_disk(c: &Client, key: &str) -> Option<bool> {
    match c.batch_get_replicas(&[key]).pop()? {
        Ok(v) => Some(v.iter().all(|r| matches!(r, Replica::LocalDisk(_)))),
        Err(_) => None,
    }
}

/// The multi-turn shape on `p`: `turns` turns of [`PER_TURN`] values of `value` bytes.
fn multi_turn(p: &Pool, turns: usize, value: u64, seed: u64) -> Result<Turns, String> {
    let mut out = Turns::default();
    let mut src = vec![0u8; value as usize];
    let buf = HostBuffer::new(value as usize, true).map_err(|e| e.to_string())?;
    p.reader
        .register_buffer(buf.addr(), value)
        .map_err(|e| e.to_string())?;
    let mut rng = seed | 1;
    let mut next = |n: usize| {
        // xorshift: the same older turns every run.
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n as u64) as usize
    };
    let t0 = Instant::now();
    for t in 0..turns {
        for i in 0..PER_TURN {
            let k = key(t, i);
            fill_value(&mut src, &k);
            if p.reader.put(&k, &src, &ReplicateConfig::default()).is_err() {
                out.put_failed += 1;
            }
        }
        let mut earlier: Vec<usize> = [t.checked_sub(1), t.checked_sub(2)]
            .into_iter()
            .flatten()
            .collect();
        if t > 2 {
            earlier.push(next(t - 2));
            earlier.push(next(t - 2));
        }
        for e in earlier {
            for i in 0..PER_TURN {
                let k = key(e, i);
                let disk = on_disk(&p.reader, &k);
                let g = Instant::now();
                let r = p.reader.get_into(&k, buf.addr(), value);
                let us = g.elapsed().as_secs_f64() * 1e6;
                out.gets += 1;
                if r.is_ok() {
                    if value_ok(buf.slice(0, value as usize), &k) {
                        out.hits += 1;
                        match disk {
                            Some(true) => out.disk_us.push(us),
                            _ => out.memory_us.push(us),
                        }
                    } else {
                        out.wrong += 1;
                    }
                }
            }
        }
    }
    out.secs = t0.elapsed().as_secs_f64();
    let _ = p.reader.unregister_buffer(buf.addr());
    Ok(out)
}

/// Drops `dir`'s files from the page cache (`POSIX_FADV_DONTNEED`; they were flushed when
/// written, so the kernel lets them go), so the next reads come from the device.
fn drop_cached(dir: &Path) -> usize {
    let mut n = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if let Ok(f) = std::fs::File::open(&p) {
                let _ = f.sync_data();
                if rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed).is_ok() {
                    n += 1;
                }
            }
        }
    }
    n
}

/// The device's sequential read: a file of [`SEQ_FILE`] bytes written and flushed in `dir`,
/// dropped from the cache, read back with `O_DIRECT` in [`SEQ_CHUNK`] reads. GB/s.
fn sequential_read(dir: &Path) -> Result<f64, String> {
    use std::io::Write;
    let path = dir.join("kvferry-seqread.bin");
    let err = |e: std::io::Error| format!("{}: {e}", path.display());
    {
        let mut f = std::fs::File::create(&path).map_err(err)?;
        let block = vec![0x5au8; SEQ_CHUNK];
        for _ in 0..SEQ_FILE / SEQ_CHUNK as u64 {
            f.write_all(&block).map_err(err)?;
        }
        f.sync_all().map_err(err)?;
        rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed)
            .map_err(|e| err(e.into()))?;
    }
    let f = rustix::fs::open(
        &path,
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECT | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| {
        format!(
            "{}: O_DIRECT open: {e} (a filesystem without O_DIRECT, e.g. tmpfs?)",
            path.display()
        )
    })?;
    // (Page-aligned, as O_DIRECT needs.)
    let buf = HostBuffer::new(SEQ_CHUNK, true).map_err(|e| e.to_string())?;
    let dst = buf.slice_mut(0, SEQ_CHUNK);
    let t = Instant::now();
    let mut off = 0u64;
    while off < SEQ_FILE {
        let n = rustix::io::pread(&f, &mut *dst, off).map_err(|e| err(e.into()))?;
        if n == 0 {
            break;
        }
        off += n as u64;
    }
    let secs = t.elapsed().as_secs_f64();
    let _ = std::fs::remove_file(&path);
    Ok(off as f64 / secs / 1e9)
}

/// Batched gets of `keys` (all on the disk, out of the page cache): GB/s, and whether every
/// value read back exactly.
fn disk_throughput(p: &Pool, keys: &[String], value: u64) -> Result<(f64, bool), String> {
    let buf = HostBuffer::new(BATCH * value as usize, true).map_err(|e| e.to_string())?;
    p.reader
        .register_buffer(buf.addr(), buf.len() as u64)
        .map_err(|e| e.to_string())?;
    let mut ok = true;
    let mut bytes = 0u64;
    let t = Instant::now();
    for chunk in keys.chunks(BATCH) {
        let items: Vec<(&str, u64, u64)> = chunk
            .iter()
            .enumerate()
            .map(|(i, k)| (k.as_str(), buf.addr() + i as u64 * value, value))
            .collect();
        for (i, r) in p.reader.batch_get_into(&items).into_iter().enumerate() {
            match r {
                Ok(n) => {
                    bytes += n;
                    let at = i * value as usize;
                    ok &= value_ok(buf.slice(at, n as usize), &chunk[i]);
                }
                Err(_) => ok = false,
            }
        }
    }
    let secs = t.elapsed().as_secs_f64();
    let _ = p.reader.unregister_buffer(buf.addr());
    Ok((bytes as f64 / secs / 1e9, ok))
}

pub(super) fn run(a: &StoreBenchArgs, dir: &Path) -> Result<(), String> {
    if !dir.is_dir() {
        return Err(format!(
            "--disk {}: not a directory; create it on the device to measure",
            dir.display()
        ));
    }
    let (pool, value) = (a.disk_pool, a.disk_value);
    if value == 0 || value > pool / 8 {
        return Err(format!(
            "--disk-value {} must be non-zero and fit 8 times in --disk-pool {}",
            human(value),
            human(pool)
        ));
    }
    let turn = PER_TURN as u64 * value;
    let turns = (3 * pool).div_ceil(turn) as usize;
    let seed = 0x006b_7666_6572_7279;
    let memory_only = {
        let p = Pool::start(pool, None)?;
        multi_turn(&p, turns, value, seed)?
    };
    let records = Records::create(dir)?;
    let p = Pool::start(pool, Some(&records.0))?;
    let mut with_disk = multi_turn(&p, turns, value, seed)?;
    let disk_keys: Vec<String> = (0..turns)
        .flat_map(|t| (0..PER_TURN).map(move |i| key(t, i)))
        .filter(|k| on_disk(&p.reader, k) == Some(true))
        .collect();
    drop_cached(&records.0);
    let (gbps, verified) = disk_throughput(&p, &disk_keys, value)?;
    let seq = sequential_read(dir)?;
    drop(p);
    let rate = |t: &Turns| t.hits as f64 / t.gets.max(1) as f64;
    let mem_p50 = pct(&mut with_disk.memory_us, 0.5);
    let mem_p99 = pct(&mut with_disk.memory_us, 0.99);
    let disk_p50 = pct(&mut with_disk.disk_us, 0.5);
    let disk_p99 = pct(&mut with_disk.disk_us, 0.99);
    println!(
        "multi-turn: {turns} turns of {PER_TURN} x {} (working set {}, memory pool {}), {} gets",
        human(value),
        human(turns as u64 * turn),
        human(pool),
        with_disk.gets
    );
    println!(
        "  hit rate: memory only {:.1}%, with the disk tier {:.1}% ({} from memory, {} from disk; {} wrong, {} puts failed; {:.1} s)",
        100.0 * rate(&memory_only),
        100.0 * rate(&with_disk),
        with_disk.memory_us.len(),
        with_disk.disk_us.len(),
        with_disk.wrong + memory_only.wrong,
        with_disk.put_failed,
        with_disk.secs
    );
    println!("  get p50/p99: from memory {mem_p50:.0}/{mem_p99:.0} µs, from disk {disk_p50:.0}/{disk_p99:.0} µs");
    println!(
        "  disk gets ({} records out of the page cache, batches of {BATCH}): {gbps:.2} GB/s; device sequential read (O_DIRECT, {} reads): {seq:.2} GB/s; ratio {:.2}",
        disk_keys.len(),
        human(SEQ_CHUNK as u64),
        gbps / seq
    );
    if let Some(path) = &a.json {
        let rec = |op: &str, extra: serde_json::Value| {
            let mut v = serde_json::json!({ "op": op, "value_bytes": value, "pool_bytes": pool, "turns": turns });
            if let (Some(o), serde_json::Value::Object(e)) = (v.as_object_mut(), extra) {
                o.extend(e);
            }
            serde_json::to_string(&v).expect("serialisable") + "\n"
        };
        let text = [
            rec("multi_turn", serde_json::json!({ "batch": 1, "gets": with_disk.gets, "hit_rate": rate(&with_disk), "hit_rate_memory_only": rate(&memory_only), "verified": with_disk.wrong + memory_only.wrong == 0 })),
            rec("disk_get_memory", serde_json::json!({ "batch": 1, "p50_us": mem_p50, "p99_us": mem_p99, "keys": with_disk.memory_us.len(), "verified": true })),
            rec("disk_get_disk", serde_json::json!({ "batch": 1, "p50_us": disk_p50, "p99_us": disk_p99, "keys": with_disk.disk_us.len(), "verified": true })),
            rec("disk_get_throughput", serde_json::json!({ "batch": BATCH, "gbps": gbps, "keys": disk_keys.len(), "device_seq_read_gbps": seq, "ratio": gbps / seq, "verified": verified })),
        ]
        .concat();
        std::fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    if with_disk.wrong + memory_only.wrong > 0 || !verified {
        return Err("some values did not read back exactly".into());
    }
    Ok(())
}
