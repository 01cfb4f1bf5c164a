//! `kvferry metadata-bench`: the metadata service side by side.
//!
//! 1. GET throughput and latency of `kvferry metadata-server` and of Mooncake's Python
//!    `mooncake_http_metadata_server`, both started here on 127.0.0.1 in the same run and
//!    loaded by the same client: `--clients` keep-alive connections (by default each on a
//!    thread of its own; `--client-threads` fewer, polled) GETting a segment descriptor in a
//!    closed loop for `--duration` seconds, `--pipeline` requests in flight per connection.
//!    Server and client CPU per GET are reported, since both share the machine.
//! 2. The cost of `open_segment` on a cache miss for each backend: the `rpc_meta` and `ram`
//!    reads plus descriptor decoding that a central-mode open does, against the two HTTP
//!    servers and the etcd / Redis given with `--etcd` / `--redis` (`scripts/services`
//!    starts them), with P2PHANDSHAKE's handshake fetch as the reference.

use crate::peers::Peer;
use kvferry::metadata::{connect, Directory, Keys, StoreOptions};
use kvferry::{Config, TransferEngine};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct MetadataBenchArgs {
    /// Keep-alive connections loading each server (1 to 4096, the connections a
    /// `kvferry metadata-server` serves by default).
    #[arg(long, default_value_t = 4, value_parser = range(1, 4096))]
    clients: usize,
    /// Threads driving those connections: each polls its share, a thread with one connection
    /// blocks on it (the default, as many threads as connections); 1 to 4096.
    #[arg(long, default_value_t = 4, value_parser = range(1, 4096))]
    client_threads: usize,
    /// Seconds of load per server.
    #[arg(long, default_value_t = 3.0, value_parser = crate::sys::parse_secs)]
    duration: f64,
    /// Buffers in the descriptor that is fetched (its size grows ~80 bytes per buffer); at
    /// most 100000.
    #[arg(long, default_value_t = 16, value_parser = range(0, 100_000))]
    buffers: usize,
    /// Mooncake's `mooncake_http_metadata_server` (default: next to $KVFERRY_MOONCAKE_PYTHON,
    /// else on PATH); `none` skips it.
    #[arg(long)]
    mooncake: Option<String>,
    /// etcd to measure open_segment against (e.g. etcd://127.0.0.1:2379).
    #[arg(long)]
    etcd: Option<String>,
    /// Redis to measure open_segment against (e.g. redis://127.0.0.1:6379).
    #[arg(long)]
    redis: Option<String>,
    /// GETs each client keeps in flight on its connection (HTTP/1.1 pipelining; 1 = one at a
    /// time, as Mooncake's libcurl client does); at most 1024.
    #[arg(long, default_value_t = 1, value_parser = range(1, 1024))]
    pipeline: usize,
    /// Worker threads of `kvferry metadata-server` (Mooncake's Python server runs one event
    /// loop); its --threads: 0 is one per CPU, at most 1024.
    #[arg(long, default_value_t = 0, value_parser = range(0, crate::metadata_server::MAX_THREADS as u64))]
    server_threads: usize,
    /// open_segment look-ups per backend (1 to 1000000).
    #[arg(long, default_value_t = 2000, value_parser = range(1, 1_000_000))]
    opens: usize,
}

/// A count flag from `min` to `max` (clap names the flag and the range when it is not).
fn range(min: u64, max: u64) -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::<usize>::new().range(min..=max)
}

/// A server process in a process group of its own (killed with it when dropped, or when this
/// bench is stopped: `crate::peers`).
struct Server {
    peer: Peer,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.peer.stop(Duration::ZERO);
    }
}

fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| e.to_string())
}

fn wait_http(port: u16) -> bool {
    let until = Instant::now() + Duration::from_secs(20);
    while Instant::now() < until {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// CPU seconds (user + system) a process has used so far.
fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the command: state is field 3; utime and stime are fields 14 and 15.
    let ticks: f64 = [11, 12]
        .iter()
        .filter_map(|&i| f.get(i).and_then(|v| v.parse::<f64>().ok()))
        .sum();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    if hz > 0.0 {
        ticks / hz
    } else {
        0.0
    }
}

/// CPU seconds (user + system) this process has used so far (the load client's threads).
fn own_cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return 0.0;
    }
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

fn start_kvferry(threads: usize) -> Result<Server, String> {
    let mut peer = Peer::spawn(
        crate::self_command()?
            .args([
                "metadata-server",
                "--port",
                "0",
                "--threads",
                &threads.to_string(),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit()),
    )
    .map_err(|e| format!("starting kvferry metadata-server: {e}"))?;
    let mut line = String::new();
    if let Some(out) = peer.child.stdout.take() {
        let _ = BufReader::new(out).read_line(&mut line);
    }
    let port = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("port="))
        .and_then(|p| p.parse().ok());
    match port {
        Some(port) => Ok(Server { peer, port }),
        None => Err(format!(
            "kvferry metadata-server did not report its port: {line:?}"
        )), // (killed on drop)
    }
}

fn find_mooncake(arg: &Option<String>) -> Option<PathBuf> {
    match arg.as_deref() {
        Some("none") => None,
        Some(p) => Some(PathBuf::from(p)),
        None => {
            if let Ok(py) = std::env::var("KVFERRY_MOONCAKE_PYTHON") {
                let p = PathBuf::from(py).with_file_name("mooncake_http_metadata_server");
                if p.is_file() {
                    return Some(p);
                }
            }
            let path = std::env::var_os("PATH")?;
            std::env::split_paths(&path)
                .map(|d| d.join("mooncake_http_metadata_server"))
                .find(|p| p.is_file())
        }
    }
}

fn start_mooncake(bin: &PathBuf) -> Result<Server, String> {
    let port = free_port()?;
    let peer = Peer::spawn(
        Command::new(bin)
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--log-level",
                "WARNING",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    )
    .map_err(|e| format!("starting {}: {e}", bin.display()))?;
    let s = Server { peer, port };
    if !wait_http(port) {
        return Err(format!("{} did not listen on {port}", bin.display()));
    }
    // aiohttp accepts before its app is ready: wait for a real answer.
    let until = Instant::now() + Duration::from_secs(20);
    while Instant::now() < until {
        if let Ok(mut c) = Client::connect(port) {
            if c.get("/metadata?key=probe").is_ok() {
                return Ok(s);
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(format!("{} did not answer on {port}", bin.display()))
}

/// A minimal HTTP/1.1 keep-alive client, the same for every server measured.
struct Client {
    s: TcpStream,
    r: BufReader<TcpStream>,
}

impl Client {
    fn connect(port: u16) -> std::io::Result<Client> {
        let s = TcpStream::connect(("127.0.0.1", port))?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(Client {
            r: BufReader::new(s.try_clone()?),
            s,
        })
    }

    fn request(
        &mut self,
        method: &str,
        path: &str,
        body: &[u8],
    ) -> std::io::Result<(u16, Vec<u8>)> {
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        self.s.write_all(&[head.as_bytes(), body].concat())?;
        self.read_answer()
    }

    fn get(&mut self, path: &str) -> std::io::Result<(u16, Vec<u8>)> {
        self.request("GET", path, b"")
    }

    fn read_answer(&mut self) -> std::io::Result<(u16, Vec<u8>)> {
        let mut line = String::new();
        self.r.read_line(&mut line)?;
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("bad status line {line:?}")))?;
        let mut len = 0usize;
        loop {
            line.clear();
            self.r.read_line(&mut line)?;
            if line == "\r\n" || line.is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    len = v.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut b = vec![0u8; len];
        self.r.read_exact(&mut b)?;
        Ok((status, b))
    }
}

fn descriptor(name: &str, buffers: usize) -> Vec<u8> {
    let bufs: Vec<String> = (0..buffers)
        .map(|i| {
            format!(
                r#"{{"name":"cpu:0","addr":{},"length":1073741824}}"#,
                0x7f00_0000_0000u64 + (i as u64) * (1 << 30)
            )
        })
        .collect();
    format!(
        r#"{{"name":"{name}","protocol":"tcp","tcp_data_port":15001,"tcp_data_host":"127.0.0.1","tcp_proto_version":2,"timestamp":"2026-01-01 00:00:00","buffers":[{}]}}"#,
        bufs.join(",")
    )
    .into_bytes()
}

struct Load {
    rps: f64,
    /// Server CPU seconds per million GETs.
    cpu_per_m: f64,
    /// The load client's own CPU seconds per million GETs.
    client_cpu_per_m: f64,
    p50_us: f64,
    p99_us: f64,
    errors: u64,
}

fn percentile(sorted: &[u32], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    f64::from(sorted[i.min(sorted.len() - 1)]) / 10.0
}

/// `conns` keep-alive connections GET `path` in a closed loop for `secs`, `depth` at a time
/// per connection, driven by `threads` client threads (each polls its share of the
/// connections); latencies (of each pipelined group) in 0.1 us.
fn load(
    port: u16,
    pid: u32,
    path: &str,
    conns: usize,
    threads: usize,
    depth: usize,
    secs: f64,
) -> Result<Load, String> {
    let warm = Duration::from_millis(300);
    let run = Duration::from_secs_f64(secs);
    let start = Instant::now() + Duration::from_millis(100);
    let threads = threads.clamp(1, conns);
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let n = conns / threads + usize::from(t < conns % threads);
            let req = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                .repeat(depth)
                .into_bytes();
            std::thread::spawn(move || {
                drive(
                    port,
                    n,
                    &req,
                    depth,
                    start,
                    start + warm,
                    start + warm + run,
                )
            })
        })
        .collect();
    // Server CPU over the measured window only.
    std::thread::sleep((start + warm).saturating_duration_since(Instant::now()));
    let (cpu0, own0) = (cpu_seconds(pid), own_cpu_seconds());
    std::thread::sleep((start + warm + run).saturating_duration_since(Instant::now()));
    let (cpu, own) = (cpu_seconds(pid) - cpu0, own_cpu_seconds() - own0);
    let mut all = Vec::new();
    let mut total = 0;
    let mut errors = 0;
    for h in handles {
        let (l, n, e) = h
            .join()
            .map_err(|_| "a client thread panicked".to_string())??;
        all.extend(l);
        total += n;
        errors += e;
    }
    all.sort_unstable();
    let rps = total as f64 / secs;
    let per_m = |c: f64| {
        if total > 0 {
            c / total as f64 * 1e6
        } else {
            0.0
        }
    };
    Ok(Load {
        rps,
        cpu_per_m: per_m(cpu),
        client_cpu_per_m: per_m(own),
        p50_us: percentile(&all, 0.5),
        p99_us: percentile(&all, 0.99),
        errors,
    })
}

/// One connection of [`drive`].
struct Conn {
    s: TcpStream,
    buf: Vec<u8>,
    /// Answers still expected for the group in flight.
    pending: usize,
    sent: Instant,
}

/// Parses one complete answer at the start of `buf`: (its length, status).
fn parse_answer(buf: &[u8]) -> Option<Result<(usize, u16), String>> {
    let head_end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head =
        std::str::from_utf8(&buf[..head_end]).map_err(|_| "answer head is not UTF-8".to_string());
    let head = match head {
        Ok(h) => h,
        Err(e) => return Some(Err(e)),
    };
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok());
    let Some(status) = status else {
        return Some(Err(format!(
            "bad status line in {:?}",
            &head[..head.len().min(80)]
        )));
    };
    let len = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    (buf.len() >= head_end + len).then_some(Ok((head_end + len, status)))
}

/// A closed loop over `n` connections in this thread: each sends `req` (`depth` GETs), and
/// sends it again as soon as all `depth` answers are in; `poll(2)` waits for whichever
/// connection answers (a thread with one connection just blocks in `read`). Returns the
/// latencies of the groups started in [measure_from, end), how many GETs they held, and how
/// many answers were not 200.
fn drive(
    port: u16,
    n: usize,
    req: &[u8],
    depth: usize,
    start: Instant,
    measure_from: Instant,
    end: Instant,
) -> Result<(Vec<u32>, u64, u64), String> {
    use std::os::fd::AsRawFd;
    let blocking = n == 1;
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        let s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
        s.set_nodelay(true).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(|e| e.to_string())?;
        s.set_nonblocking(!blocking).map_err(|e| e.to_string())?;
        conns.push(Conn {
            s,
            buf: Vec::with_capacity(64 << 10),
            pending: 0,
            sent: start,
        });
    }
    let mut fds: Vec<libc::pollfd> = conns
        .iter()
        .map(|c| libc::pollfd {
            fd: c.s.as_raw_fd(),
            events: libc::POLLIN,
            revents: if blocking { libc::POLLIN } else { 0 },
        })
        .collect();
    let send = |c: &mut Conn| -> Result<(), String> {
        let mut off = 0;
        while off < req.len() {
            match c.s.write(&req[off..]) {
                Ok(k) => off += k,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => return Err(format!("sending GET: {e}")),
            }
        }
        c.pending = depth;
        c.sent = Instant::now();
        Ok(())
    };
    let (mut lat, mut done, mut errors) = (Vec::with_capacity(1 << 20), 0u64, 0u64);
    while Instant::now() < start {
        std::thread::yield_now();
    }
    for c in &mut conns {
        send(c)?;
    }
    let mut chunk = vec![0u8; 64 << 10];
    while Instant::now() < end {
        if !blocking {
            // SAFETY: `fds` is a valid array of `fds.len()` pollfd structs.
            let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 1000) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(format!("poll: {e}"));
            }
        }
        for (c, fd) in conns.iter_mut().zip(fds.iter_mut()) {
            if fd.revents == 0 {
                continue;
            }
            if !blocking {
                fd.revents = 0;
            }
            // One read per readiness: poll reports the connection again while data remains.
            match c.s.read(&mut chunk) {
                Ok(0) => return Err("the server closed the connection".into()),
                Ok(k) => c.buf.extend_from_slice(&chunk[..k]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                    ) =>
                {
                    continue
                }
                Err(e) => return Err(format!("reading the answer: {e}")),
            }
            while let Some(a) = parse_answer(&c.buf) {
                let (len, status) = a?;
                c.buf.drain(..len);
                errors += u64::from(status != 200);
                c.pending = c.pending.saturating_sub(1);
            }
            if c.pending == 0 {
                let now = Instant::now();
                if c.sent >= measure_from {
                    lat.push(((now - c.sent).as_nanos() / 100).min(u128::from(u32::MAX)) as u32);
                    done += depth as u64;
                }
                if now < end {
                    send(c)?;
                }
            }
        }
    }
    Ok((lat, done, errors))
}

fn stats(mut v: Vec<u32>) -> (f64, f64) {
    v.sort_unstable();
    (percentile(&v, 0.5), percentile(&v, 0.99))
}

/// open_segment's cache-miss path against one backend: rpc_meta + ram reads and decoding.
fn open_latency(url: &str, n: usize) -> Result<(f64, f64), String> {
    let cfg = Config {
        local_hostname: "bench-target".into(),
        metadata_server: url.into(),
        advertise_address: Some("127.0.0.1".into()),
        ..Config::default()
    };
    let target = TransferEngine::new(cfg).map_err(|e| e.to_string())?;
    let mem = vec![0u8; 1 << 20];
    target
        .register_memory(mem.as_ptr() as u64, mem.len() as u64, "cpu:0")
        .map_err(|e| e.to_string())?;
    let store = connect(url, &StoreOptions::default())
        .map_err(|e| e.to_string())?
        .ok_or("P2PHANDSHAKE has no store")?;
    let dir = Directory::new(store, Keys::new(None));
    let mut lat = Vec::with_capacity(n);
    for i in 0..n + n / 10 {
        let t = Instant::now();
        let _meta = dir
            .fetch_rpc_meta("bench-target")
            .map_err(|e| e.to_string())?;
        let d = dir
            .fetch_segment("bench-target")
            .map_err(|e| e.to_string())?;
        if d.buffers.is_empty() {
            return Err("the published descriptor lost its buffer".into());
        }
        if i >= n / 10 {
            lat.push((t.elapsed().as_nanos() / 100).min(u128::from(u32::MAX)) as u32);
        }
    }
    Ok(stats(lat))
}

/// P2PHANDSHAKE reference: a Metadata handshake with the target.
fn p2p_latency(n: usize) -> Result<(f64, f64), String> {
    let target = TransferEngine::new(Config::default()).map_err(|e| e.to_string())?;
    let me = TransferEngine::new(Config::default()).map_err(|e| e.to_string())?;
    let body = me.local_descriptor().encode();
    let mut lat = Vec::with_capacity(n);
    for i in 0..n + n / 10 {
        let t = Instant::now();
        let f = kvferry::handshake::request(
            "127.0.0.1",
            target.rpc_port(),
            kvferry::handshake::MsgType::Metadata,
            &body,
            Duration::from_secs(5),
            Duration::from_secs(5),
            1 << 20,
            None,
        )
        .map_err(|e| e.to_string())?;
        kvferry::SegmentDesc::decode(&f.body).map_err(|e| e.to_string())?;
        if i >= n / 10 {
            lat.push((t.elapsed().as_nanos() / 100).min(u128::from(u32::MAX)) as u32);
        }
    }
    Ok(stats(lat))
}

pub fn run(a: MetadataBenchArgs) -> Result<(), String> {
    if a.clients == 0 || a.duration.is_nan() || a.duration <= 0.0 {
        return Err("--clients and --duration must be positive".into());
    }
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    println!(
        "kvferry metadata-bench: {} connections on {} client threads x {:.1} s of GET per server, \
        descriptor of {} buffers, {cpus} CPUs",
        a.clients,
        a.client_threads.clamp(1, a.clients),
        a.duration,
        a.buffers
    );
    let key = "mooncake/ram/bench-seg";
    let path = format!("/metadata?key={}", kvferry::metadata::url_encode(key));
    let value = descriptor("bench-seg", a.buffers);
    let mut servers: Vec<(&str, Server)> =
        vec![("kvferry metadata-server", start_kvferry(a.server_threads)?)];
    match find_mooncake(&a.mooncake) {
        Some(bin) => servers.push(("mooncake_http_metadata_server", start_mooncake(&bin)?)),
        None => println!(
            "(Mooncake's mooncake_http_metadata_server not found: set KVFERRY_MOONCAKE_PYTHON or \
            --mooncake PATH)"
        ),
    }
    println!(
        "\nGET {key} ({} bytes), keep-alive, closed loop, {} in flight per connection:",
        value.len(),
        a.pipeline
    );
    println!(
        "  {:<32} {:>10} {:>10} {:>10} {:>14} {:>14} {:>7}",
        "server", "GET/s", "p50 us", "p99 us", "CPU s/M GETs", "client CPU", "errors"
    );
    let mut results = Vec::new();
    for (label, s) in &servers {
        let mut c = Client::connect(s.port).map_err(|e| format!("{label}: {e}"))?;
        let (st, _) = c
            .request("PUT", &path, &value)
            .map_err(|e| format!("{label}: PUT: {e}"))?;
        if st != 200 {
            return Err(format!("{label}: PUT answered {st}"));
        }
        let l = load(
            s.port,
            s.peer.id(),
            &path,
            a.clients,
            a.client_threads,
            a.pipeline.max(1),
            a.duration,
        )
        .map_err(|e| format!("{label}: {e}"))?;
        println!(
            "  {label:<32} {:>10.0} {:>10.1} {:>10.1} {:>14.1} {:>14.1} {:>7}",
            l.rps, l.p50_us, l.p99_us, l.cpu_per_m, l.client_cpu_per_m, l.errors
        );
        results.push(l);
    }
    if results.len() == 2 {
        println!(
            "  kvferry / mooncake: {:.1}x GET/s, p50 {:.1}x lower, p99 {:.1}x lower, {:.1}x less server CPU per GET",
            results[0].rps / results[1].rps,
            results[1].p50_us / results[0].p50_us,
            results[1].p99_us / results[0].p99_us,
            results[1].cpu_per_m / results[0].cpu_per_m
        );
    }

    println!(
        "\nopen_segment on a cache miss (rpc_meta + ram reads, descriptor decoded), {} look-ups:",
        a.opens
    );
    println!("  {:<40} {:>10} {:>10}", "backend", "p50 us", "p99 us");
    let mut backends: Vec<(String, String)> = servers
        .iter()
        .map(|(l, s)| {
            (
                format!("http ({l})"),
                format!("http://127.0.0.1:{}/metadata", s.port),
            )
        })
        .collect();
    if let Some(u) = &a.etcd {
        backends.push(("etcd".into(), u.clone()));
    }
    if let Some(u) = &a.redis {
        backends.push(("redis".into(), u.clone()));
    }
    for (label, url) in backends {
        match open_latency(&url, a.opens) {
            Ok((p50, p99)) => println!("  {label:<40} {p50:>10.1} {p99:>10.1}"),
            Err(e) => println!("  {label:<40} failed: {e}"),
        }
    }
    match p2p_latency(a.opens) {
        Ok((p50, p99)) => println!(
            "  {:<40} {p50:>10.1} {p99:>10.1}",
            "P2PHANDSHAKE (handshake Metadata fetch)"
        ),
        Err(e) => println!("  P2PHANDSHAKE failed: {e}"),
    }
    Ok(())
}
