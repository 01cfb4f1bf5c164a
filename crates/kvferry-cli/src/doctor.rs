//! `kvferry doctor`: what this host can do, and why not.

use kvferry::config::ENV_VARS;
use kvferry::{Config, TransferEngine};
use std::ffi::CStr;
use std::net::IpAddr;

#[derive(clap::Args)]
pub struct DoctorArgs {
    /// The address this host would advertise (default: the first non-loopback interface).
    #[arg(long)]
    local_hostname: Option<String>,
    /// Metadata service to check (default: KVFERRY_METADATA_SERVER).
    #[arg(long)]
    metadata_server: Option<String>,
}

struct Report {
    problems: usize,
}

impl Report {
    fn ok(&self, what: &str, detail: impl AsRef<str>) {
        println!("  ok    {what}: {}", detail.as_ref());
    }
    fn warn(&mut self, what: &str, detail: impl AsRef<str>) {
        println!("  WARN  {what}: {}", detail.as_ref());
        self.problems += 1;
    }
    fn no(&self, what: &str, detail: impl AsRef<str>) {
        println!("  no    {what}: {}", detail.as_ref());
    }
}

/// Interface addresses that are up (name, address).
pub fn interfaces() -> Vec<(String, IpAddr)> {
    let mut out = Vec::new();
    let mut ifa: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs allocates a list we walk read-only and free once.
    unsafe {
        if libc::getifaddrs(&mut ifa) != 0 {
            return out;
        }
        let mut p = ifa;
        while !p.is_null() {
            let i = &*p;
            let up = i.ifa_flags & (libc::IFF_UP as u32) != 0;
            if up && !i.ifa_addr.is_null() {
                let name = CStr::from_ptr(i.ifa_name).to_string_lossy().into_owned();
                match i32::from((*i.ifa_addr).sa_family) {
                    libc::AF_INET => {
                        let sa = &*(i.ifa_addr as *const libc::sockaddr_in);
                        out.push((name, IpAddr::from(u32::from_be(sa.sin_addr.s_addr).to_be_bytes())));
                    }
                    libc::AF_INET6 => {
                        let sa = &*(i.ifa_addr as *const libc::sockaddr_in6);
                        out.push((name, IpAddr::from(sa.sin6_addr.s6_addr)));
                    }
                    _ => {}
                }
            }
            p = i.ifa_next;
        }
        libc::freeifaddrs(ifa);
    }
    out
}

/// dlopen without keeping the handle; returns why not.
/// Loads a library at run time (never linked: a host may lack it).
fn load(lib: &str) -> Result<libloading::Library, String> {
    // SAFETY: loading a system library runs its initialisers; libibverbs and libcuda are
    // designed to be dlopen'ed.
    unsafe { libloading::Library::new(lib) }.map_err(|e| e.to_string())
}

fn rdma_devices() -> Result<Vec<String>, String> {
    let lib = load("libibverbs.so.1")?;
    type GetList = unsafe extern "C" fn(*mut libc::c_int) -> *mut *mut libc::c_void;
    type GetName = unsafe extern "C" fn(*mut libc::c_void) -> *const libc::c_char;
    type FreeList = unsafe extern "C" fn(*mut *mut libc::c_void);
    // SAFETY: symbols looked up by name from libibverbs, called with their documented signatures.
    unsafe {
        let missing = |e: libloading::Error| format!("libibverbs.so.1 lacks a symbol: {e}");
        let gl = lib.get::<GetList>(b"ibv_get_device_list").map_err(missing)?;
        let gn = lib.get::<GetName>(b"ibv_get_device_name").map_err(missing)?;
        let fl = lib.get::<FreeList>(b"ibv_free_device_list").map_err(missing)?;
        let mut n: libc::c_int = 0;
        let list = gl(&mut n);
        if list.is_null() {
            return Err(format!("ibv_get_device_list failed: {}", std::io::Error::last_os_error()));
        }
        let names = (0..n.max(0) as usize).map(|i| CStr::from_ptr(gn(*list.add(i))).to_string_lossy().into_owned()).collect();
        fl(list);
        Ok(names)
    }
}

fn cuda_devices() -> Result<i32, String> {
    let lib = load("libcuda.so.1")?;
    type Init = unsafe extern "C" fn(u32) -> i32;
    type Count = unsafe extern "C" fn(*mut i32) -> i32;
    // SAFETY: CUDA driver API entry points with their documented signatures.
    unsafe {
        let missing = |e: libloading::Error| format!("libcuda.so.1 lacks a symbol: {e}");
        let init = lib.get::<Init>(b"cuInit").map_err(missing)?;
        let count = lib.get::<Count>(b"cuDeviceGetCount").map_err(missing)?;
        let r = init(0);
        if r != 0 {
            return Err(format!("cuInit failed with CUDA error {r}"));
        }
        let mut n = 0;
        let r = count(&mut n);
        if r != 0 {
            return Err(format!("cuDeviceGetCount failed with CUDA error {r}"));
        }
        Ok(n)
    }
}

fn cap_ipc_lock() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("CapEff:")).and_then(|l| u64::from_str_radix(l[7..].trim(), 16).ok()))
        .is_some_and(|caps| caps & (1 << 14) != 0)
}

fn cap_sys_ptrace() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("CapEff:")).and_then(|l| u64::from_str_radix(l[7..].trim(), 16).ok()))
        .is_some_and(|caps| caps & (1 << 19) != 0)
}

/// The same-host transport: settings that decide it, and a live probe against a child process.
fn shm(r: &mut Report, cfg: &Config) {
    use kvferry::config::TransportMode;
    use kvferry::transport::shm;
    if cfg.transport == TransportMode::Tcp {
        r.no("shm", "disabled by KVFERRY_TRANSPORT=tcp (this engine neither uses nor offers cross-memory attach)");
        return;
    }
    match shm::host_id() {
        Ok(h) => println!("        same-host identity: {h}"),
        Err(e) => {
            r.no("shm", format!("this host's identity is unknown ({e}); peers are reached over TCP"));
            return;
        }
    }
    let ptrace = cap_sys_ptrace();
    match shm::ptrace_scope() {
        None | Some(0) => {}
        Some(1) if !ptrace => r.warn(
            "ptrace scope",
            "kernel.yama.ptrace_scope=1: cross-memory attach works only towards descendant processes; separately started workers fall back to TCP (set sysctl kernel.yama.ptrace_scope=0 or grant CAP_SYS_PTRACE)",
        ),
        Some(n) if !ptrace => r.warn("ptrace scope", format!("kernel.yama.ptrace_scope={n}: cross-memory attach needs CAP_SYS_PTRACE{}; peers fall back to TCP", if n >= 3 { " and is disabled at 3" } else { "" })),
        Some(n) => println!("        kernel.yama.ptrace_scope={n}, CAP_SYS_PTRACE held"),
    }
    if let Ok(t) = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled") {
        let mode = t.split_whitespace().find(|w| w.starts_with('[')).unwrap_or("?").trim_matches(|c| c == '[' || c == ']').to_string();
        let note = match mode.as_str() {
            "always" => "registered memory gets huge pages where the kernel can",
            "madvise" => "huge pages only where the application asks (madvise MADV_HUGEPAGE); cross-memory copies from 4 KiB pages cost about twice the CPU (not copies into memory kvferry allocated, which peers map)",
            _ => "no huge pages; cross-memory copies from 4 KiB pages cost about twice the CPU (not copies into memory kvferry allocated, which peers map)",
        };
        println!("        transparent huge pages: {mode} ({note})");
    }
    match probe_child(cfg) {
        Ok((t, mapped)) if t.name == "shm" => {
            r.ok("shm", "cross-memory attach works (probed a child process: verified, one copy per request, no socket)");
            match mapped {
                Ok(()) => r.ok("shm map", "memory kvferry allocates (managed buffers, store segments) is mapped by same-host peers and copied with memcpy"),
                Err(why) => r.no("shm map", format!("peers' kvferry-allocated memory is not mapped here ({why}); cross-memory attach carries it")),
            }
        }
        Ok((t, _)) => {
            let why = t.why_not_shm.unwrap_or_default();
            if cfg.transport == TransportMode::Shm {
                r.warn("shm", format!("not usable, and KVFERRY_TRANSPORT=shm makes requests fail: {why}"));
            } else {
                r.no("shm", format!("not usable here, peers on this host use TCP: {why}"));
            }
        }
        Err(e) if cfg.transport == TransportMode::Shm => r.warn("shm", format!("not usable, and KVFERRY_TRANSPORT=shm makes requests fail: {e}")),
        Err(e) => r.no("shm", format!("could not be probed: {e}")),
    }
}

/// Starts `kvferry bench --mode target` as a child (its buffer is kvferry-allocated memory),
/// asks which transport reaches it and, over shared memory, writes 4 KiB into it: `Ok` in
/// the second place when that copy went through the mapping.
fn probe_child(cfg: &Config) -> Result<(kvferry::SegmentTransport, Result<(), String>), String> {
    use std::io::BufRead;
    let mut child = crate::self_command()?
        .args(["bench", "--mode", "target", "--exit-on-stdin-eof", "--local-hostname", "127.0.0.1", "--buffer-size", "4M", "--hugepages", "off"])
        .env("KVFERRY_TRANSPORT", "auto")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("starting a probe target: {e}"))?;
    let result = (|| {
        let out = child.stdout.take().ok_or("no output from the probe target")?;
        let mut line = String::new();
        std::io::BufReader::new(out).read_line(&mut line).map_err(|e| e.to_string())?;
        let seg = line.split_whitespace().find_map(|w| w.strip_prefix("segment=")).ok_or("the probe target did not start")?;
        let e = TransferEngine::new(Config { local_hostname: "127.0.0.1".into(), transport: kvferry::config::TransportMode::Auto, ..cfg.clone() }).map_err(|e| e.to_string())?;
        let id = e.open_segment(seg).map_err(|e| e.to_string())?;
        let t = e.segment_transport(id).map_err(|e| e.to_string())?;
        if t.name != "shm" {
            return Ok((t, Err("not on shared memory".into())));
        }
        let remote = e.segment_descriptor(id).map_err(|e| e.to_string())?.buffers.first().map(|b| b.addr).ok_or("the probe target has no buffer")?;
        let local = vec![0x5au8; 4096];
        e.register_memory(local.as_ptr() as u64, 4096, "cpu:0").map_err(|e| e.to_string())?;
        let before = kvferry::transport::shm::bytes_moved();
        let req = kvferry::TransferRequest { opcode: kvferry::Opcode::Write, source: local.as_ptr() as u64, target_id: id, target_offset: remote, length: 4096 };
        let st = e.transfer_sync(&[req], std::time::Duration::from_secs(5)).map_err(|e| e.to_string())?;
        let after = kvferry::transport::shm::bytes_moved();
        let mapped = match st.status {
            kvferry::TaskStatus::Completed if after.0 > before.0 => Ok(()),
            kvferry::TaskStatus::Completed => Err("the copy went by cross-memory attach; run with RUST_LOG=kvferry=debug for the reason".into()),
            _ => Err(format!("a 4 KiB write failed: {}", st.reason.unwrap_or_default())),
        };
        let _ = e.unregister_memory(local.as_ptr() as u64);
        Ok((t, mapped))
    })();
    drop(child.stdin.take()); // it exits when its stdin closes
    let until = std::time::Instant::now() + std::time::Duration::from_secs(3);
    while std::time::Instant::now() < until && matches!(child.try_wait(), Ok(None)) {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
    result
}

pub fn run(a: DoctorArgs) -> Result<(), String> {
    let mut r = Report { problems: 0 };
    println!("kvferry doctor (kvferry {})", env!("CARGO_PKG_VERSION"));

    println!("\nconfiguration (environment):");
    let cfg = match Config::from_env() {
        Ok(c) => {
            r.ok("environment", "all variables parse");
            c
        }
        Err(e) => {
            r.warn("environment", e.to_string());
            Config::default()
        }
    };
    for v in ENV_VARS {
        let set = std::iter::once(v.name).chain(v.aliases.iter().copied()).find_map(|n| std::env::var(n).ok().map(|val| format!("{n}={val}")));
        println!("        {:<34} {}", v.name, set.unwrap_or_else(|| format!("(default: {})", v.default)));
    }

    println!("\naddresses:");
    let ifs = interfaces();
    for (name, ip) in &ifs {
        println!("        {name:<10} {ip}");
    }
    let host = a.local_hostname.clone().unwrap_or_else(|| {
        ifs.iter().find(|(_, ip)| ip.is_ipv4() && !ip.is_loopback()).map(|(_, ip)| ip.to_string()).unwrap_or_else(|| "127.0.0.1".into())
    });
    match kvferry::resolve_advertised(kvferry::config::split_host_port(&host).0) {
        Ok(ip) if ifs.iter().any(|(_, i)| *i == ip) => {
            if ip.is_loopback() {
                r.warn("advertised address", format!("{host} is loopback: peers on other hosts cannot reach it"));
            } else {
                r.ok("advertised address", format!("{host} ({ip}) is an address of this host"));
            }
        }
        Ok(ip) => r.warn("advertised address", format!("{host} resolves to {ip}, which is not an address of this host; pass one listed above as local_hostname")),
        Err(e) => r.warn("advertised address", e.to_string()),
    }

    println!("\nports:");
    let span = u32::from(cfg.max_port.saturating_sub(cfg.min_port)) + 1;
    match TransferEngine::new(Config { local_hostname: host.clone(), ..cfg.clone() }) {
        Ok(e) => r.ok(
            "listeners",
            format!("bound handshake port {} and data port {} in {}-{} ({span} ports) on {}", e.rpc_port(), e.data_port(), cfg.min_port, cfg.max_port, cfg.bind_address.map(|a| a.to_string()).unwrap_or(host.clone())),
        ),
        Err(e) => r.warn("listeners", e.to_string()),
    }

    println!("\nmemory:");
    // SAFETY: getrlimit fills the struct.
    let mut lim: libc::rlimit = unsafe { std::mem::zeroed() };
    unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) };
    let fmt = |v: libc::rlim_t| if v == libc::RLIM_INFINITY { "unlimited".to_string() } else { format!("{} KiB", v / 1024) };
    let ipc = cap_ipc_lock();
    if lim.rlim_cur == libc::RLIM_INFINITY || ipc {
        r.ok("memlock", format!("limit {} (CAP_IPC_LOCK: {})", fmt(lim.rlim_cur), if ipc { "yes" } else { "no" }));
    } else {
        r.warn("memlock", format!("limit {} and no CAP_IPC_LOCK: RDMA registration of large buffers will fail; raise `ulimit -l` (e.g. unlimited) or run with CAP_IPC_LOCK. TCP does not need it.", fmt(lim.rlim_cur)));
    }

    println!("\nmetadata service:");
    let meta = a.metadata_server.clone().unwrap_or_else(|| cfg.metadata_server.clone());
    check_metadata(&mut r, &meta, &cfg);

    println!("\ntransports:");
    r.ok("tcp", "available (Mooncake TCP protocol v2, v1 for old peers)");
    r.ok("local", "transfers to this engine's own segment are a memcpy");
    shm(&mut r, &cfg);
    match rdma_devices() {
        Ok(d) if d.is_empty() => r.no("rdma", "libibverbs.so.1 loads but lists no RDMA device (no NIC, or its kernel driver is not loaded)"),
        Ok(d) => r.no("rdma", format!("devices {} found, but this kvferry version has no RDMA transport yet; TCP is used", d.join(", "))),
        Err(e) => r.no("rdma", format!("libibverbs.so.1 not loadable ({e}); install rdma-core/libibverbs1 if this host has RDMA NICs")),
    }
    match cuda_devices() {
        Ok(n) => r.no("gpu memory", format!("CUDA driver found with {n} device(s), but this kvferry version moves host memory only")),
        Err(e) => r.no("gpu memory", format!("CUDA driver libcuda.so.1 not usable ({e})")),
    }
    println!("\n{}", if r.problems == 0 { "no problems found".to_string() } else { format!("{} warning(s)", r.problems) });
    Ok(())
}

/// Reachable, writable, latency: a GET, a PUT and a DELETE of a probe key.
fn check_metadata(r: &mut Report, conn: &str, cfg: &Config) {
    use std::time::Instant;
    let store = match kvferry::metadata::connect(conn, &kvferry::metadata::StoreOptions::from_config(cfg)) {
        Ok(None) => return r.ok("mode", "P2PHANDSHAKE: no metadata service; segments are named host:rpc_port"),
        Ok(Some(s)) => s,
        Err(e) => return r.warn("metadata service", e.to_string()),
    };
    let key = format!("mooncake/kvferry-doctor/{}", std::process::id());
    let t = Instant::now();
    match store.get(&key) {
        Ok(_) => r.ok("reachable", format!("{} at {} answered a GET in {:.2} ms", store.backend(), store.location(), t.elapsed().as_secs_f64() * 1e3)),
        Err(e) => return r.warn("reachable", e.to_string()),
    }
    let t = Instant::now();
    let put = store.put(&key, b"{}");
    let put_ms = t.elapsed().as_secs_f64() * 1e3;
    match put.and_then(|_| store.get(&key)) {
        Ok(Some(v)) if v == b"{}" => r.ok("writable", format!("PUT in {put_ms:.2} ms, read back")),
        Ok(other) => r.warn("writable", format!("PUT accepted but GET returned {other:?}")),
        Err(e) => r.warn("writable", e.to_string()),
    }
    if let Err(e) = store.remove(&key) {
        r.warn("writable", format!("DELETE of the probe key failed: {e}"));
    }
    store.close();
}
