//! No subcommand of `kvferry` panics on any value of any flag (issue 45): every numeric and
//! size flag, walked through 0, 1, its type's maximum (and one past it) and malformed values
//! (`-1`, `abc`, `1.5`, empty), ends in a clear error that names the flag, or runs: finishes,
//! or is still serving when it is stopped. Never a panic, an abort or exit status 101.
//!
//! Bounded in time: each run is killed (its process group, by its pid) 10 s after it started,
//! or 0.5 s after a server announced itself; the benches get small durations and sizes. Only
//! 127.0.0.1 is ever talked to (an etcd that does not exist at 127.0.0.1:1 for the HA flags).
//!
//! `every_numeric_flag_is_walked` reads each subcommand's `--help`: a flag taking a value is
//! either walked here or named as not numeric, so a new numeric flag cannot be left out.

use std::io::Read;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The longest a run may take before it is killed.
const LIMIT: Duration = Duration::from_secs(10);
/// How long a server that announced itself keeps running before it is stopped.
const SETTLE: Duration = Duration::from_millis(500);

const SUBCOMMANDS: &[&str] = &[
    "bench",
    "doctor",
    "master",
    "store-bench",
    "store-client",
    "metadata-server",
    "metadata-bench",
];

/// Flags that take a value that is not a number nor a size (names, addresses, paths, lists
/// of words, booleans), per subcommand.
const NOT_NUMERIC: &[(&str, &[&str])] = &[
    (
        "bench",
        &[
            "mode",
            "segment",
            "local-hostname",
            "ops",
            "json",
            "mooncake",
            "json-peers",
            "transport",
            "hugepages",
            "memory",
            "auth-protect",
            "workload",
            "directions",
            "mooncake-python",
        ],
    ),
    ("doctor", &["local-hostname", "metadata-server", "expect"]),
    (
        "master",
        &[
            "host",
            "metrics-host",
            "http-auth-all",
            "allow-evict-soft-pinned-objects",
            "allocation-strategy",
            "config",
            "enable-http-metadata-server",
            "enable-offload",
            "http-metadata-server-host",
            "http-metadata-server-data-dir",
            "enable-metadata-cleanup-on-timeout",
            "enable-ha",
            "ha-backend-connstring",
            "etcd-endpoints",
            "cluster-id",
            "ha-replication",
            "advertise-address",
        ],
    ),
    (
        "store-bench",
        &[
            "json",
            "mooncake-python",
            "malloc-trim",
            "ha",
            "ha-parts",
            "disk",
        ],
    ),
    (
        "store-client",
        &[
            "host",
            "metadata-server",
            "master-server-address",
            "protocol",
            "device-names",
            "enable-offload",
        ],
    ),
    ("metadata-server", &["host", "data-dir"]),
    ("metadata-bench", &["mooncake", "etcd", "redis"]),
];

/// What a flag's value is.
#[derive(Clone, Copy, Debug)]
enum Kind {
    /// An unsigned integer of this maximum.
    Uint(u64),
    /// `--metrics-port`: an i32, negative disables.
    I32,
    /// A number of seconds (or a ratio): f64.
    Float,
    /// A byte size (`4K`, `1MiB`, `1G`).
    Size,
    /// Milliseconds, or a number with ms, s, m or h.
    Millis,
    /// A size as Mooncake reads it (`4GB`, `"512 MB"`, `1.5G`).
    MooncakeSize,
    /// `CONNECTIONSxKEYS`.
    HaPoints,
}

/// The values a flag of `kind` is walked through: (value, must it be refused?).
fn values(kind: Kind) -> Vec<(String, bool)> {
    let v = |s: &str, refused: bool| (s.to_string(), refused);
    let malformed = [v("-1", true), v("abc", true), v("", true)];
    let mut out = match kind {
        Kind::Uint(max) => vec![
            v("0", false),
            v("1", false),
            (max.to_string(), false),
            ((u128::from(max) + 1).to_string(), true),
            v("1.5", true),
        ],
        Kind::I32 => {
            return vec![
                v("0", false),
                v("1", false),
                v("-1", false),
                (i32::MAX.to_string(), false),
                (i32::MIN.to_string(), false),
                ((i64::from(i32::MAX) + 1).to_string(), true),
                v("abc", true),
                v("1.5", true),
                v("", true),
            ]
        }
        Kind::Float => vec![
            v("0", false),
            v("1", false),
            v("1.5", false),
            (format!("{:e}", f64::MAX), false),
            v("inf", false),
            v("NaN", false),
            v("1e-300", false),
        ],
        Kind::Size => vec![
            v("0", false),
            v("1", false),
            (u64::MAX.to_string(), false),
            v("16EiB", false),
            ((u128::from(u64::MAX) + 1).to_string(), true),
            v("1.5", true),
        ],
        Kind::Millis => vec![
            v("0", false),
            v("1", false),
            (u64::MAX.to_string(), false),
            (format!("{}h", u64::MAX), false),
            v("1.5", true),
        ],
        Kind::MooncakeSize => vec![
            v("0", false),
            v("1", false),
            v("1.5", false),
            (u64::MAX.to_string(), false),
            v("16EiB", false),
            v("1e400", true),
        ],
        Kind::HaPoints => {
            return vec![
                v("1x1", false),
                v("0x0", true),
                (format!("{m}x{m}", m = u64::MAX), true),
                v("1.5x1", true),
                v("abc", true),
                v("", true),
            ]
        }
    };
    out.extend(malformed);
    out
}

/// Mooncake's names walked here, and the kvferry flag each stands for.
const MOONCAKE_NAMES: &[(&str, &str)] = &[
    ("rpc_port", "port"),
    ("client_live_ttl_sec", "client-ttl"),
    ("default_kv_lease_ttl", "default-kv-lease-ttl"),
    ("global_segment_size", "global-segment-size"),
];

/// The kvferry flag `flag` is (itself, or the one a Mooncake name stands for).
fn kvferry_name(flag: &str) -> &str {
    MOONCAKE_NAMES
        .iter()
        .find(|(m, _)| *m == flag)
        .map_or(flag, |(_, k)| k)
}

/// One flag walked: on `sub`, with `base` before it (the flag replaces a value of its own
/// there). `env_error`: a failure that has nothing to do with the flag's value (the etcd
/// that is not there), accepted for the values that need not be refused.
struct Case {
    sub: &'static str,
    flag: &'static str,
    kind: Kind,
    base: Vec<String>,
    env_error: Option<&'static str>,
}

fn strs(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// Every case; `master_port`: the RPC port of a master for `store-client`.
fn cases(master_port: u16) -> Vec<Case> {
    const USIZE: Kind = Kind::Uint(usize::MAX as u64);
    const U64: Kind = Kind::Uint(u64::MAX);
    const U32: Kind = Kind::Uint(u32::MAX as u64);
    const U16: Kind = Kind::Uint(u16::MAX as u64);
    let mut out = Vec::new();
    let mut add = |sub, base: &[&str], env_error, flags: &[(&'static str, Kind)]| {
        for &(flag, kind) in flags {
            out.push(Case {
                sub,
                flag,
                kind,
                base: strs(base),
                env_error,
            });
        }
    };
    // Small and short: one 4 KiB point over TCP, 1 MiB buffers, no ceilings nor Mooncake.
    let bench = [
        "--buffer-size=1M",
        "--blocks=4K",
        "--ops=write",
        "--batch=1",
        "--threads=1",
        "--duration=0.05",
        "--no-ceilings",
        "--mooncake=none",
        "--transport=tcp",
        "--hugepages=off",
    ];
    add(
        "bench",
        &bench,
        None,
        &[
            ("buffer-size", Kind::Size),
            ("blocks", Kind::Size),
            ("batch", USIZE),
            ("duration", Kind::Float),
            ("threads", USIZE),
            ("peer-timeout", Kind::Float),
            ("auth-ab", USIZE),
        ],
    );
    // `--workload`: one 16-token Llama request pushed over TCP, 4 MiB pools.
    add(
        "bench",
        &[
            "--workload=llama3-70b-tp8",
            "--tokens=16",
            "--concurrency=1",
            "--directions=push",
            "--duration=0.05",
            "--no-ceilings",
            "--transport=tcp",
            "--hugepages=off",
            "--max-memory=4M",
            "--mooncake-python=none",
        ],
        None,
        &[
            ("tokens", Kind::Size),
            ("concurrency", USIZE),
            ("chunk", USIZE),
            ("max-memory", Kind::Size),
        ],
    );
    let master = ["--port=0", "--metrics-port=0"];
    add(
        "master",
        &master,
        None,
        &[
            ("port", U16),
            ("rpc_port", U16),
            ("metrics-port", Kind::I32),
            ("default-kv-lease-ttl", Kind::Millis),
            ("default_kv_lease_ttl", Kind::Millis),
            ("default-kv-soft-pin-ttl", Kind::Millis),
            ("eviction-ratio", Kind::Float),
            ("eviction-high-watermark-ratio", Kind::Float),
            ("client-ttl", U64),
            ("client_live_ttl_sec", U64),
            ("put-start-discard-timeout-sec", U64),
            ("put-start-release-timeout-sec", U64),
            ("put-wait-for-reads-ms", U64),
            ("summary-interval", U32),
            ("offloading-queue-limit", U64),
            ("offload-timeout-sec", U64),
            ("max-total-finished-tasks", U32),
            ("max-total-pending-tasks", U32),
            ("max-total-processing-tasks", U32),
            ("pending-task-timeout-sec", U64),
            ("processing-task-timeout-sec", U64),
            ("max-retry-attempts", U32),
        ],
    );
    add(
        "master",
        &[
            "--port=0",
            "--metrics-port=-1",
            "--enable-http-metadata-server",
        ],
        None,
        &[("http-metadata-server-port", U16)],
    );
    // HA against an etcd that is not there: the values are checked before it is dialed.
    add(
        "master",
        &[
            "--port=0",
            "--metrics-port=-1",
            "--enable-ha",
            "--ha-backend-connstring=etcd://127.0.0.1:1",
        ],
        Some("127.0.0.1:1"),
        &[
            ("ha-lease-ttl", Kind::Millis),
            ("ha-snapshot-bytes", Kind::Size),
            ("ha-rebase-tail-bytes", Kind::Size),
            ("ha-standby-tail-bytes", Kind::Size),
            ("ha-rebase-base-every", Kind::Millis),
            ("ha-grant-bytes", Kind::Size),
        ],
    );
    let store_bench = [
        "--values=4K",
        "--batch=1",
        "--duration=0.05",
        "--segment-size=16M",
        "--no-cycle",
        "--multi-layers=0",
        "--mooncake-python=none",
    ];
    add(
        "store-bench",
        &store_bench,
        None,
        &[
            ("values", Kind::Size),
            ("batch", USIZE),
            ("duration", Kind::Float),
            ("segment-size", Kind::Size),
            ("peer-timeout", Kind::Float),
            // Parsed here, used only with --disk (whose runs are too long to walk).
            ("disk-pool", Kind::Size),
            ("disk-value", Kind::Size),
        ],
    );
    add(
        "store-bench",
        &[
            "--values=4K",
            "--batch=1",
            "--duration=0.05",
            "--segment-size=16M",
            "--cycle-values=4K",
            "--cycle-segment-size=1M",
            "--multi-layers=0",
            "--mooncake-python=none",
        ],
        None,
        &[
            ("cycle-values", Kind::Size),
            ("cycle-segment-size", Kind::Size),
        ],
    );
    add(
        "store-bench",
        &[
            "--values=4K",
            "--batch=1",
            "--duration=0.05",
            "--segment-size=16M",
            "--no-cycle",
            "--multi-layers=1",
            "--multi-part=4K",
            "--mooncake-python=none",
        ],
        None,
        &[("multi-layers", USIZE), ("multi-part", Kind::Size)],
    );
    add(
        "store-bench",
        &[
            "--master-only",
            "--duration=0.05",
            "--objects=1000",
            "--mooncake-python=none",
        ],
        None,
        &[("objects", U64)],
    );
    add(
        "store-bench",
        &[
            "--ha=127.0.0.1:1",
            "--duration=0.05",
            "--mooncake-python=none",
        ],
        Some("127.0.0.1:1"),
        &[
            ("ha-link-objects", U64),
            ("ha-rebase-tail-bytes", Kind::Size),
            ("ha-standby-tail-bytes", Kind::Size),
            ("ha-grant-bytes", Kind::Size),
            ("ha-points", Kind::HaPoints),
            ("ha-standby-cpu", USIZE),
        ],
    );
    let at = format!("--master-server-address=127.0.0.1:{master_port}");
    add(
        "store-client",
        &[at.as_str(), "--port=0", "--global-segment-size=16M"],
        None,
        &[
            ("global-segment-size", Kind::MooncakeSize),
            ("global_segment_size", Kind::MooncakeSize),
            ("local-buffer-size", Kind::MooncakeSize),
            ("port", U16),
        ],
    );
    add(
        "metadata-server",
        &["--port=0"],
        None,
        &[
            ("port", U16),
            ("max-body-bytes", U64),
            ("max-keys", U64),
            ("max-total-bytes", U64),
            ("request-timeout", Kind::Float),
            ("max-connections", USIZE),
            ("threads", USIZE),
        ],
    );
    add(
        "metadata-bench",
        &[
            "--mooncake=none",
            "--duration=0.1",
            "--opens=10",
            "--clients=1",
            "--client-threads=1",
        ],
        None,
        &[
            ("clients", USIZE),
            ("client-threads", USIZE),
            ("duration", Kind::Float),
            ("buffers", USIZE),
            ("pipeline", USIZE),
            ("server-threads", USIZE),
            ("opens", USIZE),
        ],
    );
    out
}

/// How a run ended.
struct Run {
    /// None: still running when it was stopped (a server that announced itself, or past
    /// [`LIMIT`]).
    status: Option<ExitStatus>,
    stdout: String,
    stderr: String,
    secs: f64,
}

/// The line a server prints once it serves.
fn announced(out: &str, err: &str) -> bool {
    out.contains("KVFERRY_MASTER ")
        || out.contains("KVFERRY_STORE_CLIENT ")
        || err.contains("kvferry metadata-server listening on")
}

fn kill_group(pid: u32) {
    // The run's own process group (it leads it): itself and every child it started.
    if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process_group(p, rustix::process::Signal::KILL);
    }
}

/// Runs `kvferry args` in a process group of its own, stopped as [`Run`] says.
fn run(args: &[String]) -> Run {
    let started = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .env_remove("KVFERRY_AUTH_KEY_FILE")
        .env_remove("KVFERRY_METADATA_SERVER")
        .env_remove("MOONCAKE_TE_META_DATA_SERVER")
        .env_remove("MOONCAKE_CONFIG_PATH")
        .env_remove("KVFERRY_MOONCAKE_BENCH")
        .env_remove("KVFERRY_MOONCAKE_PYTHON")
        .env("KVFERRY_LOG", "warn")
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvferry");
    let pid = child.id();
    // Each reader says when it read something and when its pipe closed (the process and
    // whatever it started are gone): the loop below wakes on those events, not on a timer.
    let (tx, rx) = std::sync::mpsc::channel::<bool>();
    let pipe = |mut r: Box<dyn Read + Send>| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let b = Arc::clone(&buf);
        let tx = tx.clone();
        let t = std::thread::spawn(move || {
            let mut chunk = [0u8; 4096];
            while let Ok(n) = r.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                b.lock()
                    .expect("pipe buffer")
                    .extend_from_slice(&chunk[..n]);
                let _ = tx.send(false);
            }
            let _ = tx.send(true);
        });
        (buf, t)
    };
    let (out, out_t) = pipe(Box::new(child.stdout.take().expect("stdout")));
    let (err, err_t) = pipe(Box::new(child.stderr.take().expect("stderr")));
    let text =
        |b: &Arc<Mutex<Vec<u8>>>| String::from_utf8_lossy(&b.lock().expect("pipe")).into_owned();
    let mut ready_at: Option<Instant> = None;
    let mut closed = 0;
    let status = loop {
        if closed == 2 {
            // Both pipes closed: it exited (or closed them on its way out).
            break Some(child.wait().expect("wait"));
        }
        let now = Instant::now();
        if ready_at.is_none() && announced(&text(&out), &text(&err)) {
            ready_at = Some(now);
        }
        let until = ready_at.map_or(started + LIMIT, |r| (r + SETTLE).min(started + LIMIT));
        match rx.recv_timeout(until.saturating_duration_since(now)) {
            Ok(eof) => closed += usize::from(eof),
            Err(_) => {
                // Past its bound (a server that announced itself, or the limit): killed; a
                // panic meanwhile would have closed its pipes first.
                if let Some(st) = child.try_wait().expect("try_wait") {
                    break Some(st);
                }
                kill_group(pid);
                let _ = child.wait();
                break None;
            }
        }
    };
    // Children it left (it exited first) go with its group; then the pipes close.
    kill_group(pid);
    let _ = out_t.join();
    let _ = err_t.join();
    Run {
        status,
        stdout: text(&out),
        stderr: text(&err),
        secs: started.elapsed().as_secs_f64(),
    }
}

/// What is wrong with `r` for `--flag=value` (None: nothing).
fn verdict(case: &Case, refused: bool, r: &Run) -> Option<String> {
    let all = format!("{}{}", r.stdout, r.stderr);
    for bad in ["panicked", "RUST_BACKTRACE", "stack backtrace"] {
        if all.contains(bad) {
            return Some(format!("panicked ({bad:?} in its output)"));
        }
    }
    let Some(st) = r.status else {
        return refused.then(|| "was not refused: it ran".to_string());
    };
    if let Some(sig) = st.signal() {
        return Some(format!("killed by signal {sig}"));
    }
    match st.code() {
        Some(0) if refused => Some("was not refused: it succeeded".into()),
        Some(0) => None,
        Some(101) => Some("exit status 101 (a panic)".into()),
        Some(_) => {
            let named = [case.flag, kvferry_name(case.flag)].iter().any(|f| {
                r.stderr.contains(&format!("--{}", f.replace('_', "-")))
                    || r.stderr.contains(&format!("--{}", f.replace('-', "_")))
            });
            let env = !refused && case.env_error.is_some_and(|e| r.stderr.contains(e));
            (!named && !env).then(|| format!("failed without naming --{}", case.flag))
        }
        None => Some("no exit status".into()),
    }
}

/// A master for the store-client cases, stopped (its group, by its pid) on drop.
struct Master {
    pid: u32,
    child: std::process::Child,
    port: u16,
}

impl Master {
    fn start() -> Master {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvferry"))
            .args(["master", "--port=0", "--metrics-port=-1"])
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn kvferry master");
        let pid = child.id();
        let mut line = String::new();
        let mut out = std::io::BufReader::new(child.stdout.take().expect("stdout"));
        std::io::BufRead::read_line(&mut out, &mut line).expect("the master's first line");
        let port = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("rpc="))
            .and_then(|a| a.rsplit_once(':'))
            .and_then(|(_, p)| p.parse().ok())
            .unwrap_or_else(|| panic!("no rpc= in the master's line {line:?}"));
        Master { pid, child, port }
    }
}

impl Drop for Master {
    fn drop(&mut self) {
        kill_group(self.pid);
        let _ = self.child.wait();
    }
}

#[test]
fn no_flag_value_panics() {
    let master = Master::start();
    let cases = cases(master.port);
    let mut jobs = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        for (mut value, refused) in values(case.kind) {
            // A port flag walks 2 rather than 1: the tests bind and listen there (as root, a
            // privileged port binds), and other test binaries running beside this one take
            // 127.0.0.1:1 as the address where nothing listens.
            if case.flag.ends_with("port") && value == "1" {
                value = "2".into();
            }
            jobs.push((i, value, refused));
        }
    }
    // Taken from the end: the slow kinds (benches) first, the quick refusals last.
    jobs.reverse();
    let total = jobs.len();
    let jobs = Mutex::new(jobs);
    let failures = Mutex::new(Vec::new());
    let slowest = Mutex::new((0.0f64, String::new()));
    // Most runs wait (a server's settle time, a bench's duration) rather than compute: 12 at
    // once take about 21 s on 2 vCPUs, against 51 s for 4 (562 runs).
    let workers = std::env::var("KVFERRY_FLAG_JOBS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12usize);
    let started = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..workers.max(1) {
            s.spawn(|| loop {
                let Some((i, value, refused)) = jobs.lock().expect("jobs").pop() else {
                    return;
                };
                let case = &cases[i];
                let own = format!("--{}=", kvferry_name(case.flag));
                let mut args = vec![case.sub.to_string()];
                args.extend(case.base.iter().filter(|b| !b.starts_with(&own)).cloned());
                args.push(format!("--{}={value}", case.flag));
                let r = run(&args);
                let shown = format!("kvferry {}", args.join(" "));
                {
                    let mut s = slowest.lock().expect("slowest");
                    if r.secs > s.0 {
                        *s = (r.secs, shown.clone());
                    }
                }
                if let Some(why) = verdict(case, refused, &r) {
                    let tail: Vec<&str> = r.stderr.lines().rev().take(6).collect();
                    let tail: Vec<&str> = tail.into_iter().rev().collect();
                    failures.lock().expect("failures").push((
                        i,
                        format!(
                            "{shown}\n  {why}; exit {:?}; stderr:\n    {}",
                            r.status,
                            tail.join("\n    ")
                        ),
                    ));
                }
            });
        }
    });
    drop(master);
    let (secs, cmd) = slowest.into_inner().expect("slowest");
    eprintln!(
        "flags_no_panic: {total} runs in {:.1} s; the slowest {secs:.1} s: {cmd}",
        started.elapsed().as_secs_f64()
    );
    let mut failures = failures.into_inner().expect("failures");
    failures.sort();
    assert!(
        failures.is_empty(),
        "{} flag values handled badly:\n{}",
        failures.len(),
        failures
            .iter()
            .map(|(_, f)| f.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The long flags of `kvferry sub` that take a value, from its `--help`.
fn flags_with_values(sub: &str) -> Vec<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args([sub, "--help"])
        .output()
        .expect("kvferry --help");
    assert!(out.status.success(), "kvferry {sub} --help failed");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let l = l.strip_prefix("-h, ").unwrap_or(l);
            let rest = l.strip_prefix("--")?;
            let (name, after) = rest.split_once(' ')?;
            (after.starts_with('<') || after.starts_with("[<")).then(|| name.to_string())
        })
        .collect()
}

#[test]
fn every_numeric_flag_is_walked() {
    let walked = cases(1);
    let mut missing = Vec::new();
    for sub in SUBCOMMANDS {
        let not_numeric = NOT_NUMERIC
            .iter()
            .find(|(s, _)| s == sub)
            .map(|(_, f)| *f)
            .unwrap_or_default();
        let flags = flags_with_values(sub);
        assert!(
            !flags.is_empty() || *sub == "doctor",
            "no flags read from kvferry {sub} --help"
        );
        for f in flags {
            let is_walked = walked.iter().any(|c| c.sub == *sub && c.flag == f);
            if !is_walked && !not_numeric.contains(&f.as_str()) {
                missing.push(format!("kvferry {sub} --{f}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "flags neither walked by no_flag_value_panics nor listed in NOT_NUMERIC: {missing:?}"
    );
    let subs: Vec<&str> = SUBCOMMANDS.to_vec();
    let help = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .arg("--help")
        .output()
        .expect("kvferry --help");
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    for line in help
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
    {
        let Some(name) = line.split_whitespace().next() else {
            break;
        };
        if name == "help" || line.starts_with(|c: char| !c.is_whitespace()) {
            break;
        }
        assert!(
            subs.contains(&name),
            "subcommand {name} is not walked: add it to SUBCOMMANDS"
        );
    }
}
