//! `kvferry bench --auth-ab <rounds>`: what the cluster key costs, key off and on alternated in
//! one run.
//!
//! Each round runs every point once per setting (no key, then the key with each
//! `--auth-protect` asked; every other round in reverse order, so that a drift over the run
//! weighs on every setting alike), each against a target started for it and an initiator
//! engine made for it, both given the same `KVFERRY_AUTH_KEY_FILE` (a random key this run
//! writes to a 0600 file in a 0700 temporary folder, removed at the end) and
//! `KVFERRY_AUTH_PROTECT` (both removed for no key). After the points, the same target also
//! measures the connection's own costs: [`CONN_SAMPLES`] fresh engines each time `open_segment`
//! (the handshake port: a Noise handshake with the key) and their first 4 KiB write (a new data
//! connection: its handshake, then the write), then 4 KiB writes on the last one's established
//! connection. The report gives every round, the median of the rounds per setting, and the
//! ratios of each keyed setting to no key; `--json` holds the same as records.

use super::{
    check_args, human, measure_ceilings, run_mooncake, spawn_target, stop_child, sweep,
    write_peers, BenchArgs, Buffer, Ceilings, Point, Progress,
};
use kvferry::auth::Protect;
use kvferry::TransportMode;
use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest};
use serde::Serialize;
use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

/// Fresh engines per setting and round for the handshake and first-write figures.
const CONN_SAMPLES: usize = 20;
/// Bytes of each write of the connection figures.
const SMALL: u64 = 4096;
const KEY_VAR: &str = "KVFERRY_AUTH_KEY_FILE";
const PROTECT_VAR: &str = "KVFERRY_AUTH_PROTECT";

/// What one run of the points is given: no key, or the key with a `KVFERRY_AUTH_PROTECT`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Setting {
    Off,
    On(Protect),
}

impl Setting {
    fn name(self) -> &'static str {
        match self {
            Setting::Off => "none",
            Setting::On(p) => p.name(),
        }
    }

    /// The variables both sides get: set, or removed (`None`) so that a key in this shell's
    /// environment does not leak into the unkeyed runs.
    fn env(self, key: &Path) -> Vec<(&'static str, Option<OsString>)> {
        match self {
            Setting::Off => vec![(KEY_VAR, None), (PROTECT_VAR, None)],
            Setting::On(p) => vec![
                (KEY_VAR, Some(key.as_os_str().to_owned())),
                (PROTECT_VAR, Some(p.name().into())),
            ],
        }
    }
}

/// The initiator's configuration: this process's environment with `env` laid over it, read as
/// the target child reads its own.
fn config_with(a: &BenchArgs, env: &[(&'static str, Option<OsString>)]) -> Result<Config, String> {
    let get = |name: &str| match env.iter().find(|(n, _)| *n == name) {
        Some((_, v)) => v.as_ref().map(|v| v.to_string_lossy().into_owned()),
        None => std::env::var(name).ok(),
    };
    let mut c = Config::from_lookup(&get).map_err(|e| e.to_string())?;
    c.local_hostname = a.local_hostname.clone();
    Ok(c)
}

/// A random cluster key (32 bytes, hex) in a 0600 file in a 0700 folder of its own; the
/// folder is removed when this is dropped.
struct KeyDir {
    dir: PathBuf,
    file: PathBuf,
}

impl KeyDir {
    fn create() -> Result<KeyDir, String> {
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        let dir = std::env::temp_dir().join(format!(
            "kvferry-bench-key-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let kd = KeyDir {
            file: dir.join("cluster.key"),
            dir,
        };
        let key: [u8; 32] = rand::random();
        let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&kd.file)
            .and_then(|mut f| f.write_all(format!("{hex}\n").as_bytes()))
            .map_err(|e| format!("writing the key file {}: {e}", kd.file.display()))?;
        Ok(kd)
    }
}

impl Drop for KeyDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A target child, stopped when dropped (on errors too).
struct Target(Option<Child>);

impl Drop for Target {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            stop_child(c);
        }
    }
}

/// The connection's own costs, one setting and round, one transport.
#[derive(Debug, Clone, Serialize)]
struct Conn {
    transport: String,
    /// Fresh engines timed.
    samples: usize,
    /// A fresh engine's `open_segment` of the target (its handshake port).
    handshake_p50_us: f64,
    handshake_max_us: f64,
    /// Its first 4 KiB write right after (a new data connection, then the write).
    first_write_p50_us: f64,
    first_write_max_us: f64,
    /// 4 KiB writes, one at a time, on an established connection.
    write_samples: usize,
    write_p50_us: f64,
    write_p99_us: f64,
}

/// One run of the points and connection costs: a setting in a round.
struct Run {
    setting: Setting,
    round: usize,
    /// Its place in the whole run (0 first).
    order: usize,
    points: Vec<Point>,
    used: Vec<String>,
    conns: Vec<Conn>,
}

#[derive(Serialize)]
struct PointRecord<'a> {
    record: &'static str,
    auth: &'static str,
    round: usize,
    order: usize,
    transport: &'a str,
    #[serde(flatten)]
    point: &'a Point,
}

#[derive(Serialize)]
struct PointMedian {
    /// Which point of the sweep (its place in every run's list).
    #[serde(skip)]
    index: usize,
    record: &'static str,
    auth: &'static str,
    transport: String,
    op: String,
    block_bytes: u64,
    batch: usize,
    rounds: usize,
    gbps: f64,
    batch_p50_us: f64,
    batch_p99_us: f64,
    single_p50_us: f64,
    initiator_cpu_s_per_gb: f64,
    target_cpu_s_per_gb: f64,
    verified: bool,
    gbps_vs_none: f64,
    cpu_s_per_gb_vs_none: f64,
    batch_p50_vs_none: f64,
    single_p50_vs_none: f64,
    gbps_vs_socket: Option<f64>,
    gbps_vs_mooncake: Option<f64>,
}

#[derive(Serialize)]
struct ConnRecord<'a> {
    record: &'static str,
    auth: &'static str,
    round: usize,
    order: usize,
    #[serde(flatten)]
    conn: &'a Conn,
}

#[derive(Serialize)]
struct ConnMedian {
    record: &'static str,
    auth: &'static str,
    transport: String,
    rounds: usize,
    handshake_p50_us: f64,
    first_write_p50_us: f64,
    write_p50_us: f64,
    write_p99_us: f64,
    handshake_vs_none: f64,
    first_write_vs_none: f64,
    write_p50_vs_none: f64,
    write_p99_vs_none: f64,
}

/// The median (the mean of the two middle values for an even count); 0 for none.
fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

fn ratio(x: f64, base: f64) -> f64 {
    if base > 0.0 {
        x / base
    } else {
        f64::NAN
    }
}

pub(super) fn run(a: &BenchArgs, rounds: usize) -> Result<(), String> {
    check_args(a)?;
    if rounds == 0 {
        return Err("--auth-ab needs at least 1 round".into());
    }
    let mut settings = vec![Setting::Off];
    for &p in &a.auth_protect {
        if !settings.contains(&Setting::On(p)) {
            settings.push(Setting::On(p));
        }
    }
    let key = KeyDir::create()?;
    let buf = Buffer::alloc(a.buffer_size as usize, a.hugepages, a.memory == "kvferry")
        .map_err(|e| format!("allocating {}: {e}", human(a.buffer_size)))?;
    let ceilings = if a.no_ceilings {
        None
    } else {
        Some(measure_ceilings(a.hugepages))
    };
    let per_run = a.transport.len() * a.ops.len() * a.blocks.len();
    let mut progress = Progress {
        n: 0,
        total: rounds * settings.len() * per_run,
        label: String::new(),
    };
    let mut runs = Vec::new();
    for round in 1..=rounds {
        let order: Vec<Setting> = if round % 2 == 0 {
            settings.iter().rev().copied().collect()
        } else {
            settings.clone()
        };
        for s in order {
            let env = s.env(&key.file);
            let (child, seg, line) = spawn_target(a, a.buffer_size, &env)?;
            let target = Target(Some(child));
            // The target says which setting it runs with: the variables reached it.
            let held = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix("auth="))
                .unwrap_or("?");
            if held != s.name() {
                return Err(format!("the target started for key setting {:?} runs with {held:?} (it announced {:?})", s.name(), line.trim()));
            }
            let base = config_with(a, &env)?;
            progress.label = format!("round {round}, key {}: ", s.name());
            let (points, used) = sweep(a, &seg, &buf, &base, &mut progress)?;
            let mut conns = Vec::new();
            for &mode in &a.transport {
                eprint!(
                    "\r\x1b[K[{}/{}] {}connection costs ({mode}) ...",
                    progress.n, progress.total, progress.label
                );
                let _ = std::io::stderr().flush();
                conns.push(conn_costs(a, &seg, &base, mode)?);
            }
            drop(target);
            runs.push(Run {
                setting: s,
                round,
                order: runs.len(),
                points,
                used,
                conns,
            });
        }
    }
    drop(key);
    eprintln!("\r\x1b[K");
    // Stock Mooncake has no key: its points are the unkeyed peer of every setting.
    let mooncake = run_mooncake(a)?;
    let medians = point_medians(&settings, &runs, ceilings.as_ref(), &mooncake);
    let conn_meds = conn_medians(&settings, &runs);
    super::print_header(a, ceilings.as_ref());
    print_points(a, &settings, &runs, &medians);
    print_conns(a, &runs, &conn_meds);
    mooncake.print();
    if let Some(path) = &a.json {
        let mut out = String::new();
        let mut line = |v: String| {
            out.push_str(&v);
            out.push('\n');
        };
        for r in &runs {
            for (p, t) in r.points.iter().zip(&r.used) {
                line(
                    serde_json::to_string(&PointRecord {
                        record: "auth_ab_point",
                        auth: r.setting.name(),
                        round: r.round,
                        order: r.order,
                        transport: t,
                        point: p,
                    })
                    .expect("serialisable"),
                );
            }
        }
        for m in &medians {
            line(serde_json::to_string(m).expect("serialisable"));
        }
        for r in &runs {
            for c in &r.conns {
                line(
                    serde_json::to_string(&ConnRecord {
                        record: "auth_ab_conn",
                        auth: r.setting.name(),
                        round: r.round,
                        order: r.order,
                        conn: c,
                    })
                    .expect("serialisable"),
                );
            }
        }
        for m in &conn_meds {
            line(serde_json::to_string(m).expect("serialisable"));
        }
        std::fs::write(path, out).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    if let Some(path) = &a.json_peers {
        let ours = medians.iter().map(|m| serde_json::json!({"engine": "kvferry", "auth": m.auth, "transport": m.transport, "op": m.op, "block_bytes": m.block_bytes, "gbps": m.gbps}));
        write_peers(path, ceilings.as_ref(), ours, &mooncake)?;
    }
    if runs.iter().any(|r| r.points.iter().any(|p| !p.verified)) {
        return Err("some points failed verification (see the tables)".into());
    }
    Ok(())
}

/// Handshakes and first writes of fresh engines, then 4 KiB writes on an established
/// connection, against `target` over `mode`.
fn conn_costs(
    a: &BenchArgs,
    target: &str,
    base: &Config,
    mode: TransportMode,
) -> Result<Conn, String> {
    let small = Buffer::alloc(64 << 10, false, a.memory == "kvferry")
        .map_err(|e| format!("allocating 64 KiB: {e}"))?;
    small.fill(0, small.len(), 0x4b1d);
    let us = |t: Instant| t.elapsed().as_secs_f64() * 1e6;
    let write = |engine: &TransferEngine, seg: u64, remote: u64| -> Result<(), String> {
        let req = [TransferRequest {
            opcode: Opcode::Write,
            source: small.addr(),
            target_id: seg,
            target_offset: remote,
            length: SMALL,
        }];
        let st = engine
            .transfer_sync(&req, Duration::from_secs(60))
            .map_err(|e| e.to_string())?;
        if st.status != TaskStatus::Completed {
            return Err(format!(
                "4 KiB write ended {:?}: {}",
                st.status,
                st.reason.unwrap_or_default()
            ));
        }
        Ok(())
    };
    let (mut hs, mut first) = (Vec::new(), Vec::new());
    let mut last = None;
    let mut via = String::new();
    for _ in 0..CONN_SAMPLES {
        // The previous engine is gone (its connections closed) before the next starts.
        drop(last.take());
        let engine = TransferEngine::new(Config {
            transport: mode,
            ..base.clone()
        })
        .map_err(|e| e.to_string())?;
        engine
            .register_memory(small.addr(), small.len() as u64, "cpu:0")
            .map_err(|e| e.to_string())?;
        let t = Instant::now();
        let seg = engine.open_segment(target).map_err(|e| e.to_string())?;
        hs.push(us(t));
        let desc = engine.segment_descriptor(seg).map_err(|e| e.to_string())?;
        let remote = desc
            .buffers
            .iter()
            .max_by_key(|b| b.length)
            .ok_or_else(|| format!("segment {target} has no registered buffer"))?
            .addr;
        via = engine
            .segment_transport(seg)
            .map_err(|e| format!("--transport {mode}: {e}"))?
            .name
            .to_string();
        let t = Instant::now();
        write(&engine, seg, remote)?;
        first.push(us(t));
        last = Some((engine, seg, remote));
    }
    let (engine, seg, remote) = last.ok_or("no engine was started")?;
    for _ in 0..20 {
        write(&engine, seg, remote)?;
    }
    let mut lats = Vec::new();
    let dur = Duration::from_secs_f64(a.duration.max(0.1));
    let start = Instant::now();
    while lats.len() < 100_000 && (lats.len() < 20 || start.elapsed() < dur) {
        let t = Instant::now();
        write(&engine, seg, remote)?;
        lats.push(us(t));
    }
    drop(engine);
    let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    Ok(Conn {
        transport: via,
        samples: hs.len(),
        handshake_max_us: max(&hs),
        handshake_p50_us: median(hs),
        first_write_max_us: max(&first),
        first_write_p50_us: median(first),
        write_samples: lats.len(),
        write_p50_us: super::pct(&mut lats, 0.5),
        write_p99_us: super::pct(&mut lats, 0.99),
    })
}

/// Per point and setting: the median of its rounds, and its ratios to no key's medians.
fn point_medians(
    settings: &[Setting],
    runs: &[Run],
    c: Option<&Ceilings>,
    mc: &crate::mooncake::SideBySide,
) -> Vec<PointMedian> {
    let mut out: Vec<PointMedian> = Vec::new();
    let n = runs.first().map_or(0, |r| r.points.len());
    for i in 0..n {
        let mut none: Option<(f64, f64, f64, f64)> = None;
        for &s in settings {
            let mine: Vec<&Run> = runs.iter().filter(|r| r.setting == s).collect();
            let Some(first) = mine.first() else { continue };
            let col =
                |f: &dyn Fn(&Point) -> f64| median(mine.iter().map(|r| f(&r.points[i])).collect());
            let p = &first.points[i];
            let gbps = col(&|p| p.gbps);
            let cpu = col(&|p| p.initiator_cpu_s_per_gb + p.target_cpu_s_per_gb);
            let b50 = col(&|p| p.batch_p50_us);
            let s50 = col(&|p| p.single_p50_us);
            let base = *none.get_or_insert((gbps, cpu, b50, s50));
            let transport = first.used[i].clone();
            let proto = if transport == "rdma" { "rdma" } else { "tcp" };
            out.push(PointMedian {
                index: i,
                record: "auth_ab_median",
                auth: s.name(),
                op: p.op.clone(),
                block_bytes: p.block_bytes,
                batch: p.batch,
                rounds: mine.len(),
                gbps,
                batch_p50_us: b50,
                batch_p99_us: col(&|p| p.batch_p99_us),
                single_p50_us: s50,
                initiator_cpu_s_per_gb: col(&|p| p.initiator_cpu_s_per_gb),
                target_cpu_s_per_gb: col(&|p| p.target_cpu_s_per_gb),
                verified: mine.iter().all(|r| r.points[i].verified),
                gbps_vs_none: ratio(gbps, base.0),
                cpu_s_per_gb_vs_none: ratio(cpu, base.1),
                batch_p50_vs_none: ratio(b50, base.2),
                single_p50_vs_none: ratio(s50, base.3),
                gbps_vs_socket: c.map(|c| ratio(gbps, c.socket_gbps)),
                gbps_vs_mooncake: mc.gbps(proto, &p.op, p.block_bytes).map(|m| ratio(gbps, m)),
                transport,
            });
        }
    }
    out
}

/// Per transport and setting: the median of the rounds' connection figures, and their ratios
/// to no key's.
fn conn_medians(settings: &[Setting], runs: &[Run]) -> Vec<ConnMedian> {
    let mut out = Vec::new();
    let n = runs.first().map_or(0, |r| r.conns.len());
    for i in 0..n {
        let mut none: Option<[f64; 4]> = None;
        for &s in settings {
            let mine: Vec<&Run> = runs.iter().filter(|r| r.setting == s).collect();
            let Some(first) = mine.first() else { continue };
            let col =
                |f: &dyn Fn(&Conn) -> f64| median(mine.iter().map(|r| f(&r.conns[i])).collect());
            let v = [
                col(&|c| c.handshake_p50_us),
                col(&|c| c.first_write_p50_us),
                col(&|c| c.write_p50_us),
                col(&|c| c.write_p99_us),
            ];
            let base = *none.get_or_insert(v);
            out.push(ConnMedian {
                record: "auth_ab_conn_median",
                auth: s.name(),
                transport: first.conns[i].transport.clone(),
                rounds: mine.len(),
                handshake_p50_us: v[0],
                first_write_p50_us: v[1],
                write_p50_us: v[2],
                write_p99_us: v[3],
                handshake_vs_none: ratio(v[0], base[0]),
                first_write_vs_none: ratio(v[1], base[1]),
                write_p50_vs_none: ratio(v[2], base[2]),
                write_p99_vs_none: ratio(v[3], base[3]),
            });
        }
    }
    out
}

fn x(r: f64) -> String {
    if r.is_finite() {
        format!("{r:.2}x")
    } else {
        "-".into()
    }
}

fn print_points(a: &BenchArgs, settings: &[Setting], runs: &[Run], medians: &[PointMedian]) {
    let rounds = runs.iter().map(|r| r.round).max().unwrap_or(0);
    println!(
        "cluster key A/B: {rounds} round(s), each running every point once per setting ({}; every other round in reverse order), a target started for each; ratios: keyed / no key (per round: that round's; median rows: the medians')",
        settings.iter().map(|s| s.name()).collect::<Vec<_>>().join(", ")
    );
    let n = runs.first().map_or(0, |r| r.points.len());
    for i in 0..n {
        let p0 = &runs[0].points[i];
        println!();
        println!("{} {} x {}", p0.op, human(p0.block_bytes), a.batch);
        println!(
            "{:<8} {:>6} {:>9} {:>8} {:>10} {:>10} {:>10} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} {:>9}",
            "key", "round", "transport", "GB/s", "batch p50", "batch p99", "1-req p50", "init cpu", "tgt cpu", "verified", "GB/s", "cpu/GB", "/socket", "/mooncake"
        );
        println!("{:<8} {:>6} {:>9} {:>8} {:>10} {:>10} {:>10} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} {:>9}", "", "", "", "", "(us)", "(us)", "(us)", "(s/GB)", "(s/GB)", "", "vs none", "vs none", "", "");
        let mut sorted: Vec<&Run> = runs.iter().collect();
        sorted.sort_by_key(|r| (r.round, r.order));
        for r in sorted {
            let p = &r.points[i];
            let none = runs
                .iter()
                .find(|o| o.round == r.round && o.setting == Setting::Off)
                .map(|o| &o.points[i]);
            let (vs_gbps, vs_cpu) = match none {
                Some(b) if r.setting != Setting::Off => (
                    x(ratio(p.gbps, b.gbps)),
                    x(ratio(
                        p.initiator_cpu_s_per_gb + p.target_cpu_s_per_gb,
                        b.initiator_cpu_s_per_gb + b.target_cpu_s_per_gb,
                    )),
                ),
                _ => (String::new(), String::new()),
            };
            println!(
                "{:<8} {:>6} {:>9} {:>8.3} {:>10.0} {:>10.0} {:>10.1} {:>9.3} {:>9.3} {:>8} {:>8} {:>8} {:>8} {:>9}",
                r.setting.name(),
                r.round,
                r.used[i],
                p.gbps,
                p.batch_p50_us,
                p.batch_p99_us,
                p.single_p50_us,
                p.initiator_cpu_s_per_gb,
                p.target_cpu_s_per_gb,
                if p.verified { "yes" } else { "NO" },
                vs_gbps,
                vs_cpu,
                "",
                ""
            );
        }
        for m in medians.iter().filter(|m| m.index == i) {
            let keyed = m.auth != "none";
            println!(
                "{:<8} {:>6} {:>9} {:>8.3} {:>10.0} {:>10.0} {:>10.1} {:>9.3} {:>9.3} {:>8} {:>8} {:>8} {:>8} {:>9}",
                m.auth,
                "median",
                m.transport,
                m.gbps,
                m.batch_p50_us,
                m.batch_p99_us,
                m.single_p50_us,
                m.initiator_cpu_s_per_gb,
                m.target_cpu_s_per_gb,
                if m.verified { "yes" } else { "NO" },
                if keyed { x(m.gbps_vs_none) } else { String::new() },
                if keyed { x(m.cpu_s_per_gb_vs_none) } else { String::new() },
                m.gbps_vs_socket.map(x).unwrap_or_else(|| "-".into()),
                m.gbps_vs_mooncake.map(x).unwrap_or_else(|| "-".into())
            );
        }
    }
}

fn print_conns(a: &BenchArgs, runs: &[Run], medians: &[ConnMedian]) {
    println!();
    println!(
        "connection costs: a fresh engine's open_segment of the target (handshake) and its first {} write (a new data connection), {CONN_SAMPLES} engines per row; then {} writes one at a time on its established connection for {:.1} s",
        human(SMALL),
        human(SMALL),
        a.duration.max(0.1)
    );
    println!(
        "{:<8} {:>6} {:>9} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8}",
        "key",
        "round",
        "transport",
        "handshake",
        "handshake",
        "1st write",
        "1st write",
        "write",
        "write",
        "hs",
        "1st",
        "write",
        "write"
    );
    println!(
        "{:<8} {:>6} {:>9} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8}",
        "",
        "",
        "",
        "p50 (us)",
        "max (us)",
        "p50 (us)",
        "max (us)",
        "p50 (us)",
        "p99 (us)",
        "vs none",
        "vs none",
        "p50 vs",
        "p99 vs"
    );
    let mut sorted: Vec<&Run> = runs.iter().collect();
    sorted.sort_by_key(|r| (r.round, r.order));
    for r in sorted {
        for (i, c) in r.conns.iter().enumerate() {
            let none = runs
                .iter()
                .find(|o| o.round == r.round && o.setting == Setting::Off)
                .map(|o| &o.conns[i]);
            let vs = |f: fn(&Conn) -> f64| match none {
                Some(b) if r.setting != Setting::Off => x(ratio(f(c), f(b))),
                _ => String::new(),
            };
            println!(
                "{:<8} {:>6} {:>9} {:>10.0} {:>10.0} {:>10.0} {:>10.0} {:>9.1} {:>9.1} {:>8} {:>8} {:>8} {:>8}",
                r.setting.name(),
                r.round,
                c.transport,
                c.handshake_p50_us,
                c.handshake_max_us,
                c.first_write_p50_us,
                c.first_write_max_us,
                c.write_p50_us,
                c.write_p99_us,
                vs(|c| c.handshake_p50_us),
                vs(|c| c.first_write_p50_us),
                vs(|c| c.write_p50_us),
                vs(|c| c.write_p99_us)
            );
        }
    }
    for m in medians {
        let keyed = m.auth != "none";
        let v = |r: f64| if keyed { x(r) } else { String::new() };
        println!(
            "{:<8} {:>6} {:>9} {:>10.0} {:>10} {:>10.0} {:>10} {:>9.1} {:>9.1} {:>8} {:>8} {:>8} {:>8}",
            m.auth,
            "median",
            m.transport,
            m.handshake_p50_us,
            "",
            m.first_write_p50_us,
            "",
            m.write_p50_us,
            m.write_p99_us,
            v(m.handshake_vs_none),
            v(m.first_write_vs_none),
            v(m.write_p50_vs_none),
            v(m.write_p99_vs_none)
        );
    }
}
