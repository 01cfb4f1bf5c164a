//! `kvferry store-bench --ha ETCD`: the figures of master high availability, in one run
//! against the etcd given (`host:port`): metadata throughput with the journal on vs a master
//! without HA (and what each object costs: CPU by role, context switches), values stored per
//! second through a whole store (64 KiB to 16 MiB values, one client and four at once) with
//! and without HA, the journal's etcd bytes per million objects, and failover time and objects
//! lost when the leader is SIGKILLed (two `kvferry master --enable-ha` processes and a serving
//! client, all on 127.0.0.1, in a cluster id of their own).

use super::{fill_value, value_ok, Proc, StoreBenchArgs};
use kvferry::hostbuf::HostBuffer;
use kvferry::metadata::etcd::EtcdClient;
use kvferry_store::client::{Client, ClientConfig};
use kvferry_store::ha::{self, HaConfig, Role};
use kvferry_store::master::MasterConfig;
use kvferry_store::proto::{PingStatus, ReplicateConfig, Request, Response, Segment};
use kvferry_store::server::MasterServer;
use kvferry_store::Master;
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One request and its answer on a master's RPC connection.
fn call(conn: &mut std::net::TcpStream, req: &Request) -> Option<Response> {
    let frame = kvferry_store::proto::encode(req).ok()?;
    conn.write_all(&frame).ok()?;
    let mut len = [0u8; 4];
    conn.read_exact(&mut len).ok()?;
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    conn.read_exact(&mut body).ok()?;
    kvferry_store::proto::decode(&body).ok()
}

/// Removes every object of the master at `addr` (between measurements, so that each starts
/// from an empty master whatever the previous one created).
fn clear(addr: &str) -> Result<(), String> {
    let mut conn = std::net::TcpStream::connect(addr).map_err(|e| format!("{addr}: {e}"))?;
    match call(&mut conn, &Request::RemoveAll { force: true }) {
        Some(Response::Count(_)) => Ok(()),
        r => Err(format!("removing the objects of {addr}: {r:?}")),
    }
}

/// One thread of this process: its name, nanoseconds on CPU so far
/// (`/proc/self/task/<tid>/schedstat`) and context switches so far (voluntary and not,
/// `/proc/self/task/<tid>/status`).
struct ThreadUse {
    name: String,
    ns: u64,
    switches: u64,
}

/// Every live thread of this process, by thread id.
fn threads_now() -> std::collections::HashMap<u64, ThreadUse> {
    let mut out = std::collections::HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for t in dir.flatten() {
        let Some(tid) = t.file_name().to_str().and_then(|n| n.parse::<u64>().ok()) else {
            continue;
        };
        let read = |f: &str| std::fs::read_to_string(t.path().join(f)).unwrap_or_default();
        let ns = read("schedstat")
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        let switches = read("status")
            .lines()
            .filter(|l| l.contains("ctxt_switches:"))
            .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum();
        out.insert(
            tid,
            ThreadUse {
                name: read("comm").trim().to_string(),
                ns,
                switches,
            },
        );
    }
    out
}

/// What one measurement cost this process, per object created: CPU (µs) by role (the master
/// measured: its request, journal and acknowledgement threads and whatever else of this
/// process ran, the idle masters' tickers; its standby's mirror; the bench's clients) and
/// context switches (every thread).
#[derive(Clone, Copy, Default)]
struct Cost {
    leader: f64,
    standby: f64,
    clients: f64,
    switches: f64,
}

/// The threads of the bench's clients (counted as clients, not as the master).
const CLIENT_THREAD: &str = "kvf-bench-put";

/// The use between two [`threads_now`], per object of `created` (a thread that did not exist
/// before started from nothing).
fn use_between(
    before: &std::collections::HashMap<u64, ThreadUse>,
    after: &std::collections::HashMap<u64, ThreadUse>,
    created: u64,
) -> Cost {
    let mut cpu = Cost::default();
    let per = created.max(1) as f64;
    for (tid, t) in after {
        let (ns0, sw0) = before.get(tid).map_or((0, 0), |b| (b.ns, b.switches));
        let us = t.ns.saturating_sub(ns0) as f64 / 1e3 / per;
        match t.name.as_str() {
            CLIENT_THREAD => cpu.clients += us,
            "kvf-ha-standby" | "kvf-ha-mirror" => cpu.standby += us,
            _ => cpu.leader += us,
        }
        cpu.switches += t.switches.saturating_sub(sw0) as f64 / per;
    }
    cpu
}

/// `--ha-standby-cpu`: the standby's mirror on one CPU of its own, the rest of this process
/// on the other CPUs it may use.
struct CpuSplit {
    standby_cpu: usize,
    rest_cpus: Vec<usize>,
    standby: rustix::thread::CpuSet,
    rest: rustix::thread::CpuSet,
    /// What the process may use (restored after the rate part: the other parts' processes
    /// inherit the CPUs of the thread that starts them).
    allowed: rustix::thread::CpuSet,
}

/// The threads of a standby's mirror (its listener, and one per leader's connection, which
/// inherits the listener's CPUs).
const MIRROR_THREADS: [&str; 2] = ["kvf-ha-mirror", "kvf-ha-standby"];

impl CpuSplit {
    fn new(cpu: usize) -> Result<CpuSplit, String> {
        use rustix::thread::{sched_getaffinity, CpuSet};
        let allowed = sched_getaffinity(None)
            .map_err(|e| format!("--ha-standby-cpu: reading this process's CPUs: {e}"))?;
        let cpus: Vec<usize> = (0..CpuSet::MAX_CPU)
            .filter(|&c| allowed.is_set(c))
            .collect();
        if !cpus.contains(&cpu) {
            return Err(format!("--ha-standby-cpu {cpu}: this process may run on CPUs {cpus:?} only; name one of them"));
        }
        if cpus.len() < 2 {
            return Err(format!("--ha-standby-cpu {cpu}: this process may run on CPU {cpu} alone, and the split needs two CPUs at least; leave --ha-standby-cpu out here, or run where two CPUs or more are allowed (taskset -c)"));
        }
        let (mut standby, mut rest) = (CpuSet::new(), CpuSet::new());
        standby.set(cpu);
        let rest_cpus: Vec<usize> = cpus.into_iter().filter(|&c| c != cpu).collect();
        for &c in &rest_cpus {
            rest.set(c);
        }
        Ok(CpuSplit {
            standby_cpu: cpu,
            rest_cpus,
            standby,
            rest,
            allowed,
        })
    }

    /// Pins every thread of this process now: a mirror's to the standby's CPU, the others to
    /// the rest. (A thread that ended meanwhile is skipped.)
    fn apply(&self) -> Result<(), String> {
        self.pin(|name| {
            if MIRROR_THREADS.contains(&name) {
                &self.standby
            } else {
                &self.rest
            }
        })
    }

    /// Lets every thread of this process run on every CPU it could before.
    fn undo(&self) -> Result<(), String> {
        self.pin(|_| &self.allowed)
    }

    fn pin<'a>(
        &'a self,
        set_of: impl Fn(&str) -> &'a rustix::thread::CpuSet,
    ) -> Result<(), String> {
        let dir = std::fs::read_dir("/proc/self/task")
            .map_err(|e| format!("--ha-standby-cpu: listing this process's threads: {e}"))?;
        for t in dir.flatten() {
            let Some(tid) = t
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<i32>().ok())
                .and_then(rustix::process::Pid::from_raw)
            else {
                continue;
            };
            let name = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
            let set = set_of(name.trim());
            match rustix::thread::sched_setaffinity(Some(tid), set) {
                Ok(()) | Err(rustix::io::Errno::SRCH) => {}
                Err(e) => {
                    return Err(format!(
                        "--ha-standby-cpu: pinning thread {} ({}): {e}",
                        tid.as_raw_nonzero(),
                        name.trim()
                    ))
                }
            }
        }
        Ok(())
    }
}

/// The client id of [`put_rate`]'s first thread (each thread is the next one).
const FIRST_CLIENT: u64 = 1000;

/// PutStart + PutEnd pairs over RPC from `threads` connections, `per_req` keys per request:
/// objects created per second of the load (from the start until every connection's last
/// request was answered), what that cost per object ([`Cost`]), and what `at_end` returned
/// (called then, before the tidying, for the caller's own figures). Every connection stays
/// open until the threads' use is read (a master's request thread ends with its connection,
/// and an ended thread can no longer be read). With `tidy`, the master is left as it was
/// found, after the load and untimed (with HA the removal is replicated, a commit of every
/// object created): its objects removed, then the clients' segments unmounted (a client
/// left to expire would have its segments dropped by the master's ticker in the middle of a
/// later measurement, a walk over every object per segment).
fn put_rate<T>(
    addr: &str,
    threads: usize,
    per_req: usize,
    dur: Duration,
    tag: &str,
    tidy: bool,
    at_end: impl FnOnce() -> T,
) -> (f64, Cost, T) {
    let start = Instant::now();
    let before = threads_now();
    // (threads done, CPU read): every client thread holds its connection until then.
    let gate = (
        std::sync::Mutex::new((0usize, false)),
        std::sync::Condvar::new(),
    );
    let lock = || gate.0.lock().unwrap_or_else(|e| e.into_inner());
    let (created, after, took, ended) = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let (gate, lock) = (&gate, &lock);
                std::thread::Builder::new().name(CLIENT_THREAD.into()).spawn_scoped(s, move || -> u64 {
                    let client = FIRST_CLIENT + t as u64;
                    let mut conn = std::net::TcpStream::connect(addr).ok();
                    let n = conn.as_mut().map_or(0, |conn| {
                        let _ = conn.set_nodelay(true);
                        let mut call = |req: &Request| call(conn, req);
                        let seg = Segment { id: client, name: format!("bench-{client}"), te_endpoint: format!("127.0.0.1:{client}"), base: client << 44, size: 1 << 42 };
                        if !matches!(call(&Request::MountSegment { client, segment: seg }), Some(Response::Ok)) {
                            return 0;
                        }
                        let mut n = 0u64;
                        let cfg = ReplicateConfig::default();
                        // Pings as a real client does (once a second, well inside the
                        // master's client TTL): a measurement longer than the TTL would
                        // otherwise see the master drop this client's segments midway.
                        let mut pinged = Instant::now();
                        while start.elapsed() < dur {
                            if pinged.elapsed() >= Duration::from_secs(1) {
                                match call(&Request::Ping { client }) {
                                    Some(Response::Ping(PingStatus::Ok)) => {}
                                    r => {
                                        tracing::warn!("store-bench: client {client}'s ping was answered {r:?} (None: the connection failed); this client stops, the rate counts what it created");
                                        return n;
                                    }
                                }
                                pinged = Instant::now();
                            }
                            let keys: Vec<String> = (0..per_req).map(|i| format!("{tag}-{t}-{}", n + i as u64)).collect();
                            // (Each key is put once: its number names its put.)
                            let put = |i: usize| n + i as u64 + 1;
                            let starts = Request::Batch(keys.iter().enumerate().map(|(i, k)| Request::PutStart { client, key: k.clone(), size: 4096, config: cfg.clone(), upsert: false, put: put(i) }).collect());
                            let ends = Request::Batch(keys.iter().enumerate().map(|(i, k)| Request::PutEnd { client, key: k.clone(), put: put(i) }).collect());
                            match (call(&starts), call(&ends)) {
                                (Some(Response::Batch(a)), Some(Response::Batch(b))) if a.iter().all(|r| matches!(r, Response::Replicas(_))) && b.iter().all(|r| *r == Response::Ok) => n += per_req as u64,
                                (a, b) => {
                                    let first_bad = |r: Option<Response>| match r {
                                        Some(Response::Batch(rs)) => rs.into_iter().find(|r| !matches!(r, Response::Replicas(_) | Response::Ok)).map(|r| format!("{r:?}")),
                                        None => Some("no answer (the connection failed)".into()),
                                        Some(r) => Some(format!("{r:?}")),
                                    };
                                    tracing::warn!("store-bench: client {client}'s puts failed ({}); this client stops, the rate counts what it created", first_bad(a).or(first_bad(b)).unwrap_or_default());
                                    return n;
                                }
                            }
                        }
                        n
                    });
                    let mut g = lock();
                    g.0 += 1;
                    gate.1.notify_all();
                    while !g.1 {
                        g = gate.1.wait(g).unwrap_or_else(|e| e.into_inner());
                    }
                    drop(g);
                    if let Some(conn) = conn.as_mut().filter(|_| tidy) {
                        let _ = call(conn, &Request::UnmountSegment { client, segment: client });
                    }
                    n
                })
            })
            .collect();
        let running = hs.iter().filter(|h| h.is_ok()).count();
        let mut g = lock();
        while g.0 < running {
            g = gate.1.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        // The measurement ends here: the tidying below is not timed.
        let (after, took) = (threads_now(), start.elapsed());
        let ended = at_end();
        if tidy {
            if let Err(e) = clear(addr) {
                tracing::warn!("store-bench: {e}");
            }
        }
        g.1 = true;
        gate.1.notify_all();
        drop(g);
        (
            hs.into_iter()
                .flatten()
                .map(|h| h.join().unwrap_or(0))
                .sum::<u64>(),
            after,
            took,
            ended,
        )
    });
    (
        created as f64 / took.as_secs_f64(),
        use_between(&before, &after, created),
        ended,
    )
}

/// Values stored per second by `clients` clients at once (each its own `Client`, as the TP
/// ranks of one server are), each calling `batch_upsert_from` with `batch` keys of `value`
/// bytes (its own keys again and again: space is reused), through the master at `master`
/// (`host:port` or `etcd://...`); each client's last batch is read back and checked.
fn store_rate(
    master: &str,
    value: u64,
    batch: usize,
    clients: usize,
    dur: Duration,
) -> Result<f64, String> {
    // Every client is set up before the clock starts (a barrier every thread reaches, set up or
    // not), so setup is not measured.
    let ready = std::sync::Barrier::new(clients + 1);
    let start = std::sync::OnceLock::new();
    // Per client: values stored, and when its last call ended (its read-back and close are
    // not measured).
    let one = |id: usize| -> Result<(u64, Duration), String> {
        let setup = || -> Result<_, String> {
            let c = Client::setup(ClientConfig {
                global_segment_size: 0,
                local_buffer_size: 0,
                master_server_addr: master.to_string(),
                ..ClientConfig::default()
            })
            .map_err(|e| e.to_string())?;
            let len = value as usize * batch;
            let src = HostBuffer::new(len, true).map_err(|e| e.to_string())?;
            let dst = HostBuffer::new(value as usize, true).map_err(|e| e.to_string())?;
            c.register_buffer(src.addr(), len as u64)
                .map_err(|e| e.to_string())?;
            c.register_buffer(dst.addr(), value)
                .map_err(|e| e.to_string())?;
            let keys: Vec<String> = (0..batch)
                .map(|i| format!("rate-{value}-{id}-{i}"))
                .collect();
            for (i, k) in keys.iter().enumerate() {
                fill_value(src.slice_mut(i * value as usize, value as usize), k);
            }
            Ok((c, src, dst, keys))
        };
        let prepared = setup();
        ready.wait();
        let (c, src, dst, keys) = prepared?;
        let t: Instant = *start.get_or_init(Instant::now);
        let items: Vec<(&str, u64, u64)> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| (k.as_str(), src.addr() + i as u64 * value, value))
            .collect();
        let cfg = ReplicateConfig::default();
        let mut n = 0u64;
        while t.elapsed() < dur || n == 0 {
            if let Some(Err(e)) = c
                .batch_upsert_from(&items, &cfg)
                .into_iter()
                .find(|r| r.is_err())
            {
                return Err(format!("batch_upsert_from: {e}"));
            }
            n += batch as u64;
        }
        let took = t.elapsed();
        let last = &keys[batch - 1];
        let got = c
            .get_into(last, dst.addr(), value)
            .map_err(|e| e.to_string())?;
        if got != value || !value_ok(dst.slice(0, value as usize), last) {
            return Err(format!("{last} did not read back exactly"));
        }
        let _ = c.close();
        Ok((n, took))
    };
    let (total, took) = std::thread::scope(|s| -> Result<(u64, Duration), String> {
        let hs: Vec<_> = (0..clients)
            .map(|id| {
                let one = &one;
                s.spawn(move || one(id))
            })
            .collect();
        ready.wait();
        start.get_or_init(Instant::now);
        let (mut total, mut took, mut first_err) = (0, Duration::ZERO, None);
        for h in hs {
            match h.join() {
                Ok(Ok((n, t))) => (total, took) = (total + n, took.max(t)),
                Ok(Err(e)) => first_err = first_err.or(Some(e)),
                Err(_) => first_err = first_err.or(Some("a client thread panicked".to_string())),
            }
        }
        first_err.map_or(Ok((total, took)), Err)
    })?;
    Ok(total as f64 / took.as_secs_f64().max(1e-9))
}

fn journal_bytes(etcd: &EtcdClient, cluster: &str) -> Result<(u64, usize), String> {
    let p = ha::journal::prefix(cluster);
    let kvs = etcd
        .range(&p, &format!("{}~", p.trim_end_matches('/')), 256)
        .map_err(|e| e.to_string())?;
    Ok((
        kvs.iter()
            .map(|(k, kv)| (k.len() + kv.value.len()) as u64)
            .sum(),
        kvs.len(),
    ))
}

/// Reads of `key`, back to back on one connection to `addr`, until `stop`: how long each
/// request (`GetReplicaList`, then `ReleaseReads`) waited for its answer. Pings for `clients`
/// every second, untimed (clients that filled the master and ping no more: the master must
/// not drop them and their objects meanwhile).
fn read_waits(
    addr: &str,
    stop: &std::sync::atomic::AtomicBool,
    key: &str,
    clients: std::ops::Range<u64>,
) -> Result<Vec<f64>, String> {
    let mut conn = std::net::TcpStream::connect(addr).map_err(|e| format!("{addr}: {e}"))?;
    let _ = conn.set_nodelay(true);
    let get = Request::GetReplicaList { key: key.into() };
    let (mut waits, mut pinged) = (Vec::new(), Instant::now());
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        if pinged.elapsed() >= Duration::from_secs(1) {
            for client in clients.clone() {
                let _ = call(&mut conn, &Request::Ping { client });
            }
            pinged = Instant::now();
        }
        let t = Instant::now();
        // (Each read ended as a client ends it, its lease released: that request's wait
        // counts too, as the lock may be taken while it waits.)
        match call(&mut conn, &get) {
            Some(Response::ReplicaList(l)) => {
                waits.push(t.elapsed().as_secs_f64() * 1e3);
                let t = Instant::now();
                match call(
                    &mut conn,
                    &Request::ReleaseReads {
                        ids: vec![l.read_id],
                    },
                ) {
                    Some(Response::Ok) => waits.push(t.elapsed().as_secs_f64() * 1e3),
                    r => return Err(format!("a read's release was answered {r:?}")),
                }
            }
            r => return Err(format!("a read of {key} was answered {r:?}")),
        }
        if waits.len() > 10_000_000 {
            break;
        }
    }
    Ok(waits)
}

/// Puts of new keys (one key per request, `PutStart` then `PutEnd`), back to back on one
/// connection to `addr` as client `client` (its segment mounted first), until `stop`: how
/// long each request waited.
fn put_waits(
    addr: &str,
    stop: &std::sync::atomic::AtomicBool,
    client: u64,
) -> Result<Vec<f64>, String> {
    let mut conn = std::net::TcpStream::connect(addr).map_err(|e| format!("{addr}: {e}"))?;
    let _ = conn.set_nodelay(true);
    let seg = Segment {
        id: client,
        name: format!("bench-{client}"),
        te_endpoint: format!("127.0.0.1:{client}"),
        base: client << 44,
        size: 1 << 40,
    };
    match call(&mut conn, &Request::MountSegment { client, segment: seg }) {
        Some(Response::Ok) => {}
        r => return Err(format!("the measuring writer (client {client}) could not mount its segment on the leader at {addr}: answered {r:?} (None: the connection failed)")),
    }
    let (mut waits, mut pinged, mut n) = (Vec::new(), Instant::now(), 0u64);
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        if pinged.elapsed() >= Duration::from_secs(1) {
            let _ = call(&mut conn, &Request::Ping { client });
            pinged = Instant::now();
        }
        n += 1;
        let key = format!("waitput-{client}-{n}");
        let t = Instant::now();
        match call(
            &mut conn,
            &Request::PutStart {
                client,
                key: key.clone(),
                size: 4096,
                config: ReplicateConfig::default(),
                upsert: false,
                put: n,
            },
        ) {
            Some(Response::Replicas(_)) => waits.push(t.elapsed().as_secs_f64() * 1e3),
            r => return Err(format!("a put was answered {r:?}")),
        }
        let t = Instant::now();
        match call(
            &mut conn,
            &Request::PutEnd {
                client,
                key,
                put: n,
            },
        ) {
            Some(Response::Ok) => waits.push(t.elapsed().as_secs_f64() * 1e3),
            r => return Err(format!("a put's end was answered {r:?}")),
        }
    }
    Ok(waits)
}

/// Request count, p50, p99 and the longest of `w` (milliseconds).
fn wait_summary(mut w: Vec<f64>) -> String {
    w.sort_by(f64::total_cmp);
    let at = |q: f64| {
        w.get(((w.len() as f64 * q) as usize).min(w.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0.0)
    };
    format!(
        "{} requests, p50 {:.3} ms, p99 {:.3} ms, longest {:.1} ms",
        w.len(),
        at(0.5),
        at(0.99),
        w.last().copied().unwrap_or(0.0)
    )
}

/// The clients that fill a master ([`fill`]), and ping no more afterwards.
const FILL_CLIENTS: std::ops::Range<u64> = FIRST_CLIENT..FIRST_CLIENT + 16;

/// Puts objects into the master `m` serving `addr` (16 connections x 128 keys, keys
/// `{tag}{round}-...`) until it holds `target`: how many it holds then.
fn fill(m: &Master, addr: &str, target: usize, tag: &str) -> Result<usize, String> {
    fill_counted(&|| m.lock().summary().keys, addr, target, tag)
}

/// [`fill`] of a master that `keys` counts the objects of.
fn fill_counted(
    keys: &dyn Fn() -> usize,
    addr: &str,
    target: usize,
    tag: &str,
) -> Result<usize, String> {
    let mut round = 0;
    while keys() < target {
        let _ = put_rate(
            addr,
            FILL_CLIENTS.count(),
            128,
            Duration::from_secs(1),
            &format!("{tag}{round}"),
            false,
            || (),
        );
        round += 1;
        if round > 600 {
            return Err(format!(
                "the leader holds {} objects after {round} s of puts, {target} asked",
                keys()
            ));
        }
    }
    Ok(keys())
}

pub(super) fn run(a: &StoreBenchArgs, etcd_addr: &str) -> Result<(), String> {
    // (Checked before anything is reached.)
    let pinning = a.ha_standby_cpu.map(CpuSplit::new).transpose()?;
    let endpoints = kvferry::metadata::etcd::parse_endpoints(etcd_addr);
    let etcd = EtcdClient::connect(&endpoints, Duration::from_secs(2))
        .map_err(|e| format!("--ha {etcd_addr}: {e}"))?;
    let dur = Duration::from_secs_f64(a.duration.max(0.5));
    let rate_cluster = format!("kvferry-bench-{}-rate", std::process::id());
    let cluster = format!("kvferry-bench-{}-failover", std::process::id());
    println!("store-bench --ha: etcd {etcd_addr}, cluster ids {rate_cluster} and {cluster}, {:.1} s per point", dur.as_secs_f64());
    // The failover part's client finds its cluster through the environment, as every client
    // does; set before any thread of this run exists.
    std::env::set_var("MC_STORE_CLUSTER_ID", &cluster);
    let part = |p: &str| a.ha_parts.iter().any(|x| x == p);

    // 1. Throughput: the same put load against a master without HA, a leader that journals
    //    to etcd, and a leader with an in-sync standby (both masters in this process).
    let mut rates = Vec::new();
    // Per HA point: etcd transactions (or standby acknowledgements) per second, changes each,
    // ms each.
    let mut commits: Vec<Vec<(f64, f64, f64)>> = vec![Vec::new(), Vec::new()];
    // Per mode and point: CPU per object by role (the better round's).
    let mut cpus: Vec<Vec<Cost>> = Vec::new();
    let serve = || -> Result<(Arc<Master>, MasterServer, String), String> {
        let m = Arc::new(Master::new(MasterConfig::default()));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        let port = listener.local_addr().map_err(|e| e.to_string())?.port();
        let server = MasterServer::start(Arc::clone(&m), listener, Duration::from_millis(200), 0)
            .map_err(|e| e.to_string())?;
        Ok((m, server, format!("127.0.0.1:{port}")))
    };
    let wait_for = |what: &str, ok: &dyn Fn() -> bool| -> Result<(), String> {
        let until = Instant::now() + Duration::from_secs(15);
        while !ok() {
            if Instant::now() > until {
                return Err(format!("{what} within 15 s"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    };
    if part("rate") {
        if let Some(p) = &pinning {
            // Before any master starts: the threads it spawns inherit the CPUs of their
            // parent.
            p.apply()?;
            println!("CPUs: the standby's mirror on CPU {} alone, everything else of this process on {:?}", p.standby_cpu, p.rest_cpus);
        }
        // The three masters are up at once and each point is measured on them in turn,
        // twice, the better round kept (this VM's rates drift by tens of percent within
        // minutes; interleaving keeps the ratios fair).
        let modes = [
            None,
            Some(ha::Replication::Etcd),
            Some(ha::Replication::Standbys),
        ];
        let mut masters = Vec::new();
        for mode in modes {
            let (m, server, addr) = serve()?;
            let mut standby = None;
            if let Some(replication) = mode {
                let cluster = format!("{rate_cluster}-{replication:?}").to_lowercase();
                let cfg = |address: &str| HaConfig {
                    endpoints: endpoints.clone(),
                    cluster_id: cluster.clone(),
                    address: address.to_string(),
                    lease_ttl: Duration::from_secs(5),
                    snapshot_bytes: ha::journal::SNAPSHOT_MIN,
                    replication,
                    rebase_tail_bytes: a.ha_rebase_tail_bytes,
                    standby_tail_bytes: a.ha_standby_tail_bytes,
                    rebase_base_every: ha::journal::BASE_EVERY,
                    grant_bytes: a.ha_grant_bytes,
                };
                ha::start(cfg(&addr), Arc::clone(&m))?;
                wait_for("the in-process HA master did not lead", &|| {
                    m.gate.role() == Role::Leader
                })?;
                if replication == ha::Replication::Standbys {
                    let (sm, sserver, saddr) = serve()?;
                    ha::start(cfg(&saddr), Arc::clone(&sm))?;
                    wait_for("the in-process standby did not get in sync", &|| {
                        m.journal.insync() == [saddr.clone()]
                    })?;
                    standby = Some((sm, sserver));
                }
            }
            masters.push((mode, m, server, addr, standby));
            rates.push(Vec::new());
            cpus.push(Vec::new());
        }
        for &(threads, per_req) in &a.ha_points {
            let mut best = [(0f64, (0f64, 0f64, 0f64), Cost::default()); 3];
            for round in 0..2 {
                for (i, (mode, m, _, addr, _)) in masters.iter().enumerate() {
                    clear(addr)?;
                    if let Some(p) = &pinning {
                        // (Again: a connection the standby accepted since has a new thread.)
                        p.apply()?;
                    }
                    let (s0, t0) = (m.journal.stats(), Instant::now());
                    // The journal's figures when the load ends, before the tidying (a
                    // removal of every object, in pieces that would count as entries).
                    let (rate, cpu, (s1, secs)) = put_rate(
                        addr,
                        threads,
                        per_req,
                        dur,
                        &format!("{mode:?}-{threads}-{per_req}-{round}"),
                        true,
                        || (m.journal.stats(), t0.elapsed().as_secs_f64()),
                    );
                    let (n, us) = match mode {
                        Some(ha::Replication::Etcd) => {
                            (s1.entries - s0.entries, s1.write_us - s0.write_us)
                        }
                        Some(ha::Replication::Standbys) => (
                            s1.streamed - s0.streamed,
                            s1.stream_wait_us - s0.stream_wait_us,
                        ),
                        None => (0, 0),
                    };
                    if rate > best[i].0 {
                        best[i] = (
                            rate,
                            (
                                n as f64 / secs,
                                (s1.changes - s0.changes) as f64 / n.max(1) as f64,
                                us as f64 / n.max(1) as f64 / 1e3,
                            ),
                            cpu,
                        );
                    }
                }
            }
            for (i, (rate, commit, cpu)) in best.into_iter().enumerate() {
                rates[i].push(rate);
                cpus[i].push(cpu);
                if i > 0 {
                    commits[i - 1].push(commit);
                }
            }
        }
        for (mode, m, server, _, standby) in masters {
            if mode == Some(ha::Replication::Standbys) && m.journal.insync().is_empty() {
                return Err("the standby left the in-sync set during the measurement".into());
            }
            drop(server);
            drop(standby);
        }
        // etcd's share: a fresh leader journaling to etcd, filled by one measurement's load.
        {
            let (m, server, addr) = serve()?;
            let cluster = format!("{rate_cluster}-bytes");
            let cfg = HaConfig {
                endpoints: endpoints.clone(),
                cluster_id: cluster.clone(),
                address: addr.clone(),
                lease_ttl: Duration::from_secs(5),
                snapshot_bytes: ha::journal::SNAPSHOT_MIN,
                replication: ha::Replication::Etcd,
                rebase_tail_bytes: a.ha_rebase_tail_bytes,
                standby_tail_bytes: a.ha_standby_tail_bytes,
                rebase_base_every: ha::journal::BASE_EVERY,
                grant_bytes: a.ha_grant_bytes,
            };
            ha::start(cfg, Arc::clone(&m))?;
            wait_for("the in-process HA master did not lead", &|| {
                m.gate.role() == Role::Leader
            })?;
            let _ = put_rate(&addr, 16, 32, dur, "bytes", false, || ());
            let keys = m.lock().summary().keys as u64;
            let (bytes, n) = journal_bytes(&etcd, &cluster)?;
            let st = m.journal.stats();
            println!(
                "journal in etcd after {keys} objects: {bytes} bytes in {n} keys ({} snapshots, lag {}) = {:.1} MB per million objects",
                st.snapshots,
                st.lag,
                bytes as f64 * 1e6 / keys.max(1) as f64 / 1e6
            );
            // What a new leader of this cluster would do before serving: read and rebuild.
            let t = Instant::now();
            let loaded = ha::journal::load(&etcd, &cluster)?;
            let read = t.elapsed();
            let (rebuilt, report) = loaded.image.into_state(1, 0, 10_000);
            println!(
                "a new leader loads it in {:.2} s (etcd read and decode {:.2} s, rebuild {:.2} s): {} objects, {} dropped",
                t.elapsed().as_secs_f64(),
                read.as_secs_f64(),
                (t.elapsed() - read).as_secs_f64(),
                report.objects,
                report.dropped_replicas + report.dropped_objects
            );
            drop(rebuilt);
            drop(server);
        }
        println!(
            "{:<34} {:>10} {:>11} {:>7} {:>11} {:>7}",
            "objects created/s (PutStart+PutEnd)",
            "no HA",
            "HA etcd",
            "ratio",
            "HA standby",
            "ratio"
        );
        for (i, (threads, per_req)) in a.ha_points.iter().enumerate() {
            let (off, journal, standby) = (rates[0][i], rates[1][i], rates[2][i]);
            println!(
                "{:<34} {:>10.0} {:>11.0} {:>7.2} {:>11.0} {:>7.2}",
                format!("{threads} connection(s), {per_req} key(s)/request"),
                off,
                journal,
                journal / off.max(1e-9),
                standby,
                standby / off.max(1e-9)
            );
        }
        // Where the time goes (this VM's two vCPUs run the clients, the master and its standby
        // at once): CPU per object by role, and context switches per object (every thread of
        // this process). With the standby and the clients on hosts of their own, the leader's
        // CPU per object bounds its rate: the "leader" ratio is the throughput ratio to expect
        // there (an estimate for the CPU-bound points, not a measurement; etcd's own CPU is not
        // counted).
        println!(
            "{:<34} {:>16} {:>16} {:>22} {:>7}",
            "per object: µs CPU, switches",
            "no HA: master",
            "HA etcd: leader",
            "HA standby: leader",
            "leader"
        );
        println!(
            "{:<34} {:>16} {:>16} {:>22} {:>7}",
            "  (µs CPU of the clients)", "", "", "+mirror", "ratio"
        );
        for (i, (threads, per_req)) in a.ha_points.iter().enumerate() {
            let (off, journal, standby) = (cpus[0][i], cpus[1][i], cpus[2][i]);
            println!(
                "{:<34} {:>16} {:>16} {:>22} {:>7.2}",
                format!("{threads} connection(s), {per_req} key(s)/request"),
                format!("{:.2}, {:.2}", off.leader, off.switches),
                format!("{:.2}, {:.2}", journal.leader, journal.switches),
                format!(
                    "{:.2}+{:.2}, {:.2}",
                    standby.leader, standby.standby, standby.switches
                ),
                off.leader / standby.leader.max(1e-9)
            );
            println!(
                "{:<34} {:>16} {:>16} {:>22}",
                "",
                format!("({:.2})", off.clients),
                format!("({:.2})", journal.clients),
                format!("({:.2})", standby.clients)
            );
        }
        // Why: each request that changes state waits for an etcd transaction, or for the in-sync
        // standby's acknowledgement (group commit either way).
        for (idx, what) in [(0, "etcd transactions"), (1, "standby acknowledgements")] {
            println!(
                "{:<34} {:>14} {:>14} {:>7}",
                format!("HA {what}"),
                "per second",
                "changes each",
                "ms each"
            );
            for ((threads, per_req), (rate, changes, ms)) in a.ha_points.iter().zip(&commits[idx]) {
                println!(
                    "{:<34} {:>14.0} {:>14.1} {:>7.3}",
                    format!("{threads} connection(s), {per_req} key(s)/request"),
                    rate,
                    changes,
                    ms
                );
            }
        }
    }

    if let Some(p) = &pinning {
        p.undo()?;
    }

    // 2. Stored values per second through a whole store (client, master(s), serving client
    //    in their own processes, data moving): a master without HA, a pair that journals to
    //    etcd, a pair with an in-sync standby, all up at once; each point is measured on the
    //    three in turn, twice, and the better of the two rounds kept (this VM's rates drift by
    //    tens of percent between runs; interleaving keeps the ratios fair).
    //    Up to KV-cache page sizes (a 64-token page of a 70B model's KV is ~20 MiB): the
    //    commits' cost per call is fixed, so it weighs less as the values grow.
    //    With several clients at once (the TP ranks of one server each run one), commits are
    //    shared by their calls (group commit).
    let store_points = [
        (64u64 << 10, 32usize, 1usize),
        (1 << 20, 32, 1),
        (4 << 20, 32, 1),
        (16 << 20, 8, 1),
        (1 << 20, 32, 4),
        (4 << 20, 8, 4),
    ];
    let etcd_url = format!("etcd://{}", endpoints.join(";"));
    let tail_bytes = a.ha_rebase_tail_bytes.to_string();
    let standby_tail_bytes = a.ha_standby_tail_bytes.to_string();
    // (`tail_bytes`: the leader's and the standby's tails.)
    let start_master_tail = |replication: &str, cluster: &str, tail_bytes: (&str, &str)| {
        Proc::spawn(
            crate::self_command()?
                .args([
                    "master",
                    "--port",
                    "0",
                    "--metrics-port",
                    "0",
                    "--summary-interval",
                    "0",
                    "--enable-ha",
                    "--ha-backend-connstring",
                    &etcd_url,
                    "--cluster-id",
                    cluster,
                    "--ha-lease-ttl",
                    "2s",
                    "--ha-replication",
                    replication,
                    "--default-kv-lease-ttl",
                    "2s",
                ])
                .args([
                    "--ha-rebase-tail-bytes",
                    tail_bytes.0,
                    "--ha-standby-tail-bytes",
                    tail_bytes.1,
                ])
                .env_remove("MC_STORE_CLUSTER_ID"),
            "KVFERRY_MASTER",
        )
    };
    let start_master = |replication: &str, cluster: &str| {
        start_master_tail(replication, cluster, (&tail_bytes, &standby_tail_bytes))
    };
    // With KVFERRY_AUTH_KEY_FILE set here the masters started hold the key: /ha_status answers
    // only a request signed with it.
    let key = kvferry::Config::from_env().ok().and_then(|c| {
        kvferry::auth::ClusterKey::from_config(c.auth_key_file.as_deref())
            .ok()
            .flatten()
    });
    let http = |p: &Proc, path: &str| -> String {
        let http = p.field("http=").unwrap_or_default();
        let Ok(mut s) = std::net::TcpStream::connect(&http) else {
            return String::new();
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
        let auth = key
            .as_ref()
            .map(|k| {
                format!(
                    "{}: {}\r\n",
                    kvferry::auth_http::HEADER,
                    kvferry::auth_http::sign_now(k, "GET", path, b"")
                )
            })
            .unwrap_or_default();
        let _ = write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n{auth}\r\n");
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out.rsplit("\r\n\r\n")
            .next()
            .unwrap_or("")
            .trim()
            .to_string()
    };
    let role = |p: &Proc| http(p, "/role");
    let insync = |p: &Proc| {
        serde_json::from_str::<serde_json::Value>(&http(p, "/ha_status"))
            .ok()
            .and_then(|v| v["insync"].as_array().map(|a| !a.is_empty()))
            .unwrap_or(false)
    };
    if part("store") {
        let pool = super::Pool::start(512 << 20, "the `store` part's segment")?;
        // An HA pair of `replication` in a cluster of its own, its leader's RPC address (the
        // clients and the serving client use it directly: what is measured is the leader's
        // cost, not finding it), and the pair's serving client.
        let pair = |replication: &str| -> Result<(Vec<Proc>, Proc, String), String> {
            let c = format!("{cluster}-store-{replication}");
            let ms = vec![
                start_master(replication, &c)?,
                start_master(replication, &c)?,
            ];
            wait_for("no leader among the pair", &|| {
                ms.iter().any(|m| role(m) == "leader")
            })?;
            if replication == "standbys" {
                wait_for("the pair's standby did not get in sync", &|| {
                    ms.iter().any(|m| role(m) == "leader" && insync(m))
                })?;
            }
            let leader = ms
                .iter()
                .find(|m| role(m) == "leader")
                .and_then(|m| m.field("rpc="))
                .ok_or("the leader's address")?;
            let server = Proc::spawn(
                crate::self_command()?.args([
                    "store-bench",
                    "--serve-segment",
                    &leader,
                    "--segment-size",
                    "512M",
                ]),
                "KVFERRY_STORE_SERVER",
            )?;
            Ok((ms, server, leader))
        };
        let (journal_pair, journal_server, journal_leader) = pair("etcd")?;
        let (sync_pair, sync_server, sync_leader) = pair("standbys")?;
        println!(
            "{:<34} {:>10} {:>11} {:>7} {:>11} {:>7}",
            "values stored/s (batch_upsert_from)",
            "no HA",
            "HA etcd",
            "ratio",
            "HA standby",
            "ratio"
        );
        for &(v, b, n) in &store_points {
            let mut best = [0f64; 3];
            for _round in 0..2 {
                for (i, addr) in [&pool.addr, &journal_leader, &sync_leader]
                    .into_iter()
                    .enumerate()
                {
                    best[i] = best[i].max(store_rate(addr, v, b, n, dur)?);
                }
            }
            let [off, journal, standby] = best;
            println!(
                "{:<34} {:>10.0} {:>11.0} {:>7.2} {:>11.0} {:>7.2}",
                format!("{n} client(s), {} x {b} per call", crate::sys::human(v)),
                off,
                journal,
                journal / off.max(1e-9),
                standby,
                standby / off.max(1e-9)
            );
        }
        if !sync_pair.iter().any(|m| role(m) == "leader" && insync(m)) {
            return Err(
                "the standby left the in-sync set during the whole-store measurement".into(),
            );
        }
        drop((journal_pair, journal_server, sync_pair, sync_server));
    }

    // 3. A standby linking to a leader of many objects (started after it, or restarted): the
    //    leader takes an image of its whole state for it, in pieces under short holds of the
    //    state's lock; how long one client's reads and another's puts waited meanwhile,
    //    against before.
    if part("link") {
        let (m, server, addr) = serve()?;
        let link_cluster = format!("{rate_cluster}-link");
        let cfg = |address: &str| HaConfig {
            endpoints: endpoints.clone(),
            cluster_id: link_cluster.clone(),
            address: address.to_string(),
            lease_ttl: Duration::from_secs(5),
            snapshot_bytes: ha::journal::SNAPSHOT_MIN,
            replication: ha::Replication::Standbys,
            rebase_tail_bytes: a.ha_rebase_tail_bytes,
            standby_tail_bytes: a.ha_standby_tail_bytes,
            rebase_base_every: ha::journal::BASE_EVERY,
            grant_bytes: a.ha_grant_bytes,
        };
        ha::start(cfg(&addr), Arc::clone(&m))?;
        wait_for("the in-process HA master did not lead", &|| {
            m.gate.role() == Role::Leader
        })?;
        let objects = fill(&m, &addr, a.ha_link_objects as usize, "link")?;
        let stop = std::sync::atomic::AtomicBool::new(false);
        let reads = |stop: &std::sync::atomic::AtomicBool| {
            read_waits(&addr, stop, "link0-0-0", FILL_CLIENTS)
        };
        let (before, puts_before) = std::thread::scope(|s| {
            let (h, w) = (
                s.spawn(|| reads(&stop)),
                s.spawn(|| put_waits(&addr, &stop, 77_001)),
            );
            std::thread::sleep(Duration::from_secs(1));
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            let r = h.join().map_err(|_| "the reader panicked".to_string())?;
            let w = w.join().map_err(|_| "the writer panicked".to_string())?;
            Ok::<_, String>((r?, w?))
        })?;
        stop.store(false, std::sync::atomic::Ordering::Relaxed);
        let (during, puts_during, took, standby) = std::thread::scope(|s| -> Result<_, String> {
            let (h, w) = (
                s.spawn(|| reads(&stop)),
                s.spawn(|| put_waits(&addr, &stop, 77_002)),
            );
            let t = Instant::now();
            let linked = (|| -> Result<_, String> {
                let (sm, sserver, saddr) = serve()?;
                ha::start(cfg(&saddr), Arc::clone(&sm))?;
                let until = Instant::now() + Duration::from_secs(120);
                while m.journal.insync() != [saddr.clone()] {
                    if Instant::now() > until {
                        return Err(format!("the standby was not in sync 120 s after it started (leader of {objects} objects)"));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Ok((sm, sserver))
            })();
            let took = t.elapsed();
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            let during = h.join().map_err(|_| "the reader panicked".to_string())??;
            let puts_during = w.join().map_err(|_| "the writer panicked".to_string())??;
            Ok((during, puts_during, took, linked?))
        })?;
        // The standby holds what the leader holds (the load stopped): every entry committed
        // while its image was taken reached it after the image, none twice.
        let (leader_keys, mirrored) = {
            let until = Instant::now() + Duration::from_secs(15);
            loop {
                let keys = m.lock().summary().keys;
                let mirror = standby.0.ha_status().mirror.unwrap_or_default();
                if (mirror.objects == keys && mirror.pending_changes == 0) || Instant::now() > until
                {
                    break (keys, mirror.objects);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        };
        if mirrored != leader_keys {
            return Err(format!("after the link the standby's mirror holds {mirrored} objects, the leader {leader_keys}"));
        }
        println!("a standby linking to a leader of {objects} objects: in sync {:.2} s after it started; its mirror then held the leader's {leader_keys} objects", took.as_secs_f64());
        println!(
            "  one client's reads before (requests): {}",
            wait_summary(before)
        );
        println!(
            "  the same reads meanwhile (requests):  {}",
            wait_summary(during)
        );
        println!(
            "  another client's puts before (requests): {}",
            wait_summary(puts_before)
        );
        println!(
            "  the same puts meanwhile (requests):      {}",
            wait_summary(puts_during)
        );
        drop(standby);
        drop(server);
    }

    // 4. An etcd snapshot of a leader of `--ha-link-objects` objects (the etcd journal alone,
    //    as with no standby in sync), written while the fill's load goes on: how long one
    //    client's reads and another's puts waited meanwhile.
    if part("snapshot") {
        let (m, server, addr) = serve()?;
        let cfg = HaConfig {
            endpoints: endpoints.clone(),
            cluster_id: format!("{rate_cluster}-snapshot"),
            address: addr.clone(),
            lease_ttl: Duration::from_secs(5),
            snapshot_bytes: ha::journal::SNAPSHOT_MIN,
            replication: ha::Replication::Etcd,
            rebase_tail_bytes: a.ha_rebase_tail_bytes,
            standby_tail_bytes: a.ha_standby_tail_bytes,
            rebase_base_every: ha::journal::BASE_EVERY,
            grant_bytes: a.ha_grant_bytes,
        };
        ha::start(cfg, Arc::clone(&m))?;
        wait_for("the in-process HA master did not lead", &|| {
            m.gate.role() == Role::Leader
        })?;
        let objects = fill(&m, &addr, a.ha_link_objects as usize, "snap")?;
        let before = m.journal.stats().snapshots;
        let stop = std::sync::atomic::AtomicBool::new(false);
        let (reads, puts, took) = std::thread::scope(|s| -> Result<_, String> {
            let (h, w) = (
                s.spawn(|| read_waits(&addr, &stop, "snap0-0-0", FILL_CLIENTS)),
                s.spawn(|| put_waits(&addr, &stop, 77_003)),
            );
            let load = s.spawn(|| {
                let mut round = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = put_rate(
                        &addr,
                        FILL_CLIENTS.count(),
                        128,
                        Duration::from_millis(250),
                        &format!("snapload{round}"),
                        false,
                        || (),
                    );
                    round += 1;
                }
            });
            let t = Instant::now();
            let until = t + Duration::from_secs(120);
            // A snapshot begun and written in full after the load started (one in progress
            // then counts only if it ends later: the next one is waited for too).
            while m.journal.stats().snapshots < before + 2 && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            let took = t.elapsed();
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            let _ = load.join();
            let reads = h.join().map_err(|_| "the reader panicked".to_string())??;
            let puts = w.join().map_err(|_| "the writer panicked".to_string())??;
            if m.journal.stats().snapshots < before + 2 {
                return Err(format!(
                    "the snapshot part's leader wrote {} snapshots in 120 s of puts",
                    m.journal.stats().snapshots - before
                ));
            }
            Ok((reads, puts, took))
        })?;
        let st = m.journal.stats();
        println!("etcd snapshots of a leader of {objects} objects and more ({} bytes the last, its chunks and head encoded and written in {:.2} s), two written under a put load (16 connections x 128 keys) in {:.2} s", st.snapshot_bytes, st.snapshot_write_ms as f64 / 1e3, took.as_secs_f64());
        println!(
            "  one client's reads meanwhile (requests): {}",
            wait_summary(reads)
        );
        println!(
            "  another client's puts meanwhile (requests): {}",
            wait_summary(puts)
        );
        drop(server);
    }

    // 5. The in-sync set emptied under load (its one standby, a master process, killed) at
    //    a leader of `--ha-link-objects` objects: how long changing requests waited while the
    //    leader made the etcd journal whole again, from the entries it kept since the
    //    journal's last position (the tail), and from its whole state (the tail off).
    if part("rebase") {
        for (label, tail) in [
            (
                "the entries kept since the etcd journal's last position",
                ha::journal::TAIL_DEFAULT,
            ),
            ("the whole state (--ha-rebase-tail-bytes 0)", 0),
        ] {
            let (m, server, addr) = serve()?;
            let cluster = format!("{rate_cluster}-rebase{tail}");
            let cfg = HaConfig {
                endpoints: endpoints.clone(),
                cluster_id: cluster.clone(),
                address: addr.clone(),
                lease_ttl: Duration::from_secs(5),
                snapshot_bytes: ha::journal::SNAPSHOT_MIN,
                replication: ha::Replication::Standbys,
                rebase_tail_bytes: tail,
                standby_tail_bytes: a.ha_standby_tail_bytes,
                rebase_base_every: ha::journal::BASE_EVERY,
                grant_bytes: a.ha_grant_bytes,
            };
            ha::start(cfg, Arc::clone(&m))?;
            wait_for("the in-process HA master did not lead", &|| {
                m.gate.role() == Role::Leader
            })?;
            let objects = fill(&m, &addr, a.ha_link_objects as usize, &format!("rb{tail}-"))?;
            let mut standby = start_master("standbys", &cluster)?;
            let until = Instant::now() + Duration::from_secs(120);
            while m.journal.insync().is_empty() {
                if Instant::now() > until {
                    return Err(format!("the standby was not in sync 120 s after it started (leader of {objects} objects)"));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            let stop = std::sync::atomic::AtomicBool::new(false);
            let (puts, at_kill, emptied) = std::thread::scope(|s| -> Result<_, String> {
                let w = s.spawn(|| put_waits(&addr, &stop, 77_004));
                // Puts of the fill's connections, 8 keys each, meanwhile (the fill's clients,
                // which ping again: their objects stay).
                let load = s.spawn(|| {
                    let mut round = 0;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let _ = put_rate(
                            &addr,
                            FILL_CLIENTS.count(),
                            8,
                            Duration::from_millis(250),
                            &format!("rbload{tail}-{round}"),
                            false,
                            || (),
                        );
                        round += 1;
                    }
                });
                std::thread::sleep(Duration::from_secs(1));
                let at_kill = m.journal.stats();
                let killed = Instant::now();
                standby.stop();
                while !m.journal.insync().is_empty() && killed.elapsed() < Duration::from_secs(60) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                let emptied = killed.elapsed();
                std::thread::sleep(Duration::from_secs(1));
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                let _ = load.join();
                let puts = w.join().map_err(|_| "the writer panicked".to_string())??;
                Ok((puts, at_kill, emptied))
            })?;
            let st = m.journal.stats();
            if !m.journal.insync().is_empty() {
                return Err(format!("the leader of the rebase part still names an in-sync set 60 s after its standby was killed: {:?}", m.journal.insync()));
            }
            println!(
                "the in-sync set emptied at a leader of {objects} objects under {} x 8 puts, writing {label}: the set empty {:.2} s after the kill; changing requests held {} ms, {} entries written from a tail of {} bytes ({})",
                FILL_CLIENTS.count(),
                emptied.as_secs_f64(),
                st.rebase_ms,
                st.rebase_tail_entries,
                at_kill.tail_bytes,
                if at_kill.tail_whole { "whole" } else { "none kept" }
            );
            println!(
                "  another client's puts meanwhile (requests): {}",
                wait_summary(puts)
            );
            drop(server);
        }
    }

    // 6. A standby that takes over a leader of `--ha-link-objects` objects: the leader (a
    //    master process, alone, so the etcd journal holds the fill) filled, a second one in
    //    sync, a second of puts streamed to it, the leader killed. How long until the standby
    //    leads, and how long of that it spent making the etcd journal whole: from the entries
    //    it received since the journal's last position (its tail), and from its whole state
    //    (the tail off).
    if part("takeover") {
        let keys_of = |p: &Proc| -> usize {
            http(p, "/metrics")
                .lines()
                .find_map(|l| l.strip_prefix("kvferry_master_keys "))
                .and_then(|v| v.trim().parse::<f64>().ok())
                .map_or(0, |v| v as usize)
        };
        for (label, tail) in [
            (
                "the entries it received since the etcd journal's last position",
                ha::journal::TAIL_DEFAULT,
            ),
            ("its whole state (--ha-standby-tail-bytes 0)", 0),
        ] {
            let c = format!("{cluster}-takeover{tail}");
            let tail_s = tail.to_string();
            let mut leader = start_master_tail("standbys", &c, (&tail_s, &tail_s))?;
            wait_for("the takeover part's first master did not lead", &|| {
                role(&leader) == "leader"
            })?;
            let addr = leader.field("rpc=").ok_or("the leader's address")?;
            let objects = fill_counted(
                &|| keys_of(&leader),
                &addr,
                a.ha_link_objects as usize,
                &format!("to{tail}-"),
            )?;
            let standby = start_master_tail("standbys", &c, (&tail_s, &tail_s))?;
            let until = Instant::now() + Duration::from_secs(120);
            while !insync(&leader) {
                if Instant::now() > until {
                    return Err(format!("the standby was not in sync 120 s after it started (leader of {objects} objects)"));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = put_rate(
                &addr,
                FILL_CLIENTS.count(),
                8,
                Duration::from_secs(1),
                &format!("toload{tail}-"),
                false,
                || (),
            );
            let killed = Instant::now();
            leader.stop();
            while role(&standby) != "leader" {
                if killed.elapsed() > Duration::from_secs(120) {
                    return Err("the standby did not lead within 120 s of the kill".into());
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            let led = killed.elapsed();
            let st = serde_json::from_str::<serde_json::Value>(&http(&standby, "/ha_status"))
                .map_err(|e| format!("/ha_status: {e}"))?;
            let j = &st["journal"];
            println!(
                "a standby took over a leader of {objects} objects (SIGKILL, lease TTL 2 s), writing {label}: it led {:.2} s after the kill, {} ms of it writing to etcd ({} entries from its tail)",
                led.as_secs_f64(),
                j["rebase_ms"],
                j["rebase_tail_entries"]
            );
            drop(standby);
            for p in [ha::journal::prefix(&c), ha::sync::prefix(&c)] {
                let _ = etcd.delete_range(&p, &format!("{}~", p.trim_end_matches('/')));
            }
        }
    }

    // 7. Failover: two master processes, a serving client, objects put, the leader killed
    //    once the other master is in sync (the failover is from its mirror).
    let mut lost = 0;
    if part("failover") {
        let mut ms = [
            start_master("standbys", &cluster)?,
            start_master("standbys", &cluster)?,
        ];
        let server = Proc::spawn(
            crate::self_command()?.args([
                "store-bench",
                "--serve-segment",
                &etcd_url,
                "--segment-size",
                "512M",
            ]),
            "KVFERRY_STORE_SERVER",
        )?;
        wait_for("no leader among the two masters", &|| {
            ms.iter().any(|m| role(m) == "leader")
        })?;
        let c = Client::setup(ClientConfig {
            global_segment_size: 0,
            local_buffer_size: 64 << 20,
            master_server_addr: etcd_url.clone(),
            ..ClientConfig::default()
        })
        .map_err(|e| e.to_string())?;
        let value = 16u64 << 10;
        let buf = HostBuffer::new(value as usize, true).map_err(|e| e.to_string())?;
        c.register_buffer(buf.addr(), value)
            .map_err(|e| e.to_string())?;
        let mut stored: Vec<String> = Vec::new();
        let mut times = Vec::new();
        let rounds = 3;
        for round in 0..rounds {
            for i in 0..500 {
                let key = format!("fo-{round}-{i}");
                fill_value(buf.slice_mut(0, value as usize), &key);
                if c.put_from(&key, buf.addr(), value, &ReplicateConfig::default())
                    .is_ok()
                {
                    stored.push(key);
                }
            }
            let l = (0..2)
                .find(|&i| role(&ms[i]) == "leader")
                .ok_or("no leader among the two masters")?;
            // Killed once the other master is in sync: the failover is from its mirror.
            wait_for("the restarted master did not get in sync", &|| {
                insync(&ms[l])
            })?;
            let killed = Instant::now();
            ms[l].stop();
            let probe = format!("probe-{round}");
            fill_value(buf.slice_mut(0, value as usize), &probe);
            loop {
                if c.put_from(&probe, buf.addr(), value, &ReplicateConfig::default())
                    .is_ok()
                {
                    break;
                }
                if killed.elapsed() > Duration::from_secs(30) {
                    return Err(format!(
                        "round {round}: no put succeeded within 30 s of the kill"
                    ));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            times.push(killed.elapsed());
            ms[l] = start_master("standbys", &cluster)?;
        }
        for k in &stored {
            let ok = c.get_into(k, buf.addr(), value).is_ok_and(|n| n == value)
                && value_ok(buf.slice(0, value as usize), k);
            lost += usize::from(!ok);
        }
        times.sort();
        println!(
            "failover (SIGKILL of the leader -> first successful put, lease TTL 2 s, the other master in sync): {} over {rounds} kills (median {:.2} s, worst {:.2} s); objects lost: {lost} of {}",
            times.iter().map(|t| format!("{:.2} s", t.as_secs_f64())).collect::<Vec<_>>().join(", "),
            times[times.len() / 2].as_secs_f64(),
            times.last().map_or(0.0, Duration::as_secs_f64),
            stored.len()
        );
        let _ = c.close();
        drop(server);
        drop(ms);
    }
    // Leave nothing of this run in etcd (the in-process leaders of the rate part still renew
    // their leases until the process exits; their keys go with the leases).
    for c in [
        format!("{rate_cluster}-etcd"),
        format!("{rate_cluster}-standbys"),
        format!("{rate_cluster}-bytes"),
        format!("{cluster}-store-etcd"),
        format!("{cluster}-store-standbys"),
        cluster.clone(),
    ] {
        for p in [ha::journal::prefix(&c), ha::sync::prefix(&c)] {
            let _ = etcd.delete_range(&p, &format!("{}~", p.trim_end_matches('/')));
        }
    }
    if lost > 0 {
        return Err(format!("{lost} objects were lost across the failovers"));
    }
    Ok(())
}
