//! `kvferry doctor`: what this host can do, and why not.

use kvferry::ENV_VARS;
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
    /// Print one JSON object (the same checks, stable keys: version, host, memory, network,
    /// metadata, transports, problems, expect) instead of the screen.
    #[arg(long)]
    json: bool,
    /// Transports that must work here (comma-separated: tcp, shm, rdma, gpu): the exit
    /// status is 1, naming each one and why, when any of them cannot.
    #[arg(long, value_delimiter = ',', value_parser = ["tcp", "shm", "rdma", "gpu"])]
    expect: Vec<String>,
}

/// The checks as they run: lines for the screen (unless --json) and the problems found.
struct Report {
    human: bool,
    problems: Vec<Problem>,
}

#[derive(serde::Serialize, Clone)]
struct Problem {
    check: String,
    message: String,
    fix: String,
}

impl Report {
    fn say(&self, line: impl AsRef<str>) {
        if self.human {
            println!("{}", line.as_ref());
        }
    }
    fn ok(&self, what: &str, detail: impl AsRef<str>) {
        self.say(format!("  ok    {what}: {}", detail.as_ref()));
    }
    fn warn(&mut self, what: &str, detail: impl AsRef<str>, fix: impl AsRef<str>) {
        self.say(format!("  WARN  {what}: {}", detail.as_ref()));
        self.say(format!("        fix: {}", fix.as_ref()));
        self.problems.push(Problem {
            check: what.into(),
            message: detail.as_ref().into(),
            fix: fix.as_ref().into(),
        });
    }
    fn no(&self, what: &str, detail: impl AsRef<str>) {
        self.say(format!("  no    {what}: {}", detail.as_ref()));
    }
}

/// Whether one transport can carry transfers here, and why not.
#[derive(serde::Serialize, Clone, Default)]
struct Transport {
    available: bool,
    /// Why it is not available (null when it is).
    reason: Option<String>,
    /// What would make it available (null when it is, or when nothing can here).
    fix: Option<String>,
    #[serde(flatten)]
    extra: serde_json::Map<String, serde_json::Value>,
}

impl Transport {
    fn yes() -> Transport {
        Transport {
            available: true,
            ..Default::default()
        }
    }
    fn no(reason: impl Into<String>, fix: Option<&str>) -> Transport {
        Transport {
            available: false,
            reason: Some(reason.into()),
            fix: fix.map(str::to_string),
            ..Default::default()
        }
    }
    fn with(mut self, k: &str, v: serde_json::Value) -> Transport {
        self.extra.insert(k.into(), v);
        self
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
                        out.push((
                            name,
                            IpAddr::from(u32::from_be(sa.sin_addr.s_addr).to_be_bytes()),
                        ));
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

fn cap_ipc_lock() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("CapEff:"))
                .and_then(|l| u64::from_str_radix(l[7..].trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << 14) != 0)
}

fn cap_sys_ptrace() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("CapEff:"))
                .and_then(|l| u64::from_str_radix(l[7..].trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << 19) != 0)
}

/// The same-host transport: settings that decide it, and a live probe against a child process.
fn shm(r: &mut Report, cfg: &Config) -> Transport {
    use kvferry::host::shm;
    use kvferry::TransportMode;
    if cfg.transport == TransportMode::Tcp {
        let why = "disabled by KVFERRY_TRANSPORT=tcp (this engine neither uses nor offers cross-memory attach)";
        r.no("shm", why);
        return Transport::no(why, Some("unset KVFERRY_TRANSPORT (or set it to auto)"));
    }
    let host_id = match shm::host_id() {
        Ok(h) => {
            r.say(format!("        same-host identity: {h}"));
            h.to_string()
        }
        Err(e) => {
            let why = format!("this host's identity is unknown ({e}); peers are reached over TCP");
            r.no("shm", &why);
            return Transport::no(why, Some("make /proc/sys/kernel/random/boot_id readable (or mount /proc) in this container"));
        }
    };
    let ptrace = cap_sys_ptrace();
    let scope = shm::ptrace_scope();
    match scope {
        None | Some(0) => {}
        Some(1) if !ptrace => r.warn(
            "ptrace scope",
            "kernel.yama.ptrace_scope=1: cross-memory attach works only towards descendant processes; separately started workers fall back to TCP",
            "sysctl -w kernel.yama.ptrace_scope=0, or grant CAP_SYS_PTRACE (docker run --cap-add SYS_PTRACE)",
        ),
        Some(n) if !ptrace => r.warn(
            "ptrace scope",
            format!("kernel.yama.ptrace_scope={n}: cross-memory attach needs CAP_SYS_PTRACE{}; peers fall back to TCP", if n >= 3 { " and is disabled at 3" } else { "" }),
            if n >= 3 { "kernel.yama.ptrace_scope=3 can only be lowered by a reboot; boot with it at 0 or 1 and grant CAP_SYS_PTRACE" } else { "sysctl -w kernel.yama.ptrace_scope=0, or grant CAP_SYS_PTRACE (docker run --cap-add SYS_PTRACE)" },
        ),
        Some(n) => r.say(format!("        kernel.yama.ptrace_scope={n}, CAP_SYS_PTRACE held")),
    }
    let info = |t: Transport| {
        t.with("host_id", host_id.clone().into())
            .with(
                "ptrace_scope",
                scope
                    .map(serde_json::Value::from)
                    .unwrap_or(serde_json::Value::Null),
            )
            .with("cap_sys_ptrace", ptrace.into())
    };
    match probe_child(cfg) {
        Ok((t, mapped)) if t.name == "shm" => {
            r.ok("shm", "cross-memory attach works (probed a child process: verified, one copy per request, no socket)");
            let mapped_ok = mapped.is_ok();
            match mapped {
                Ok(()) => r.ok("shm map", "memory kvferry allocates (managed buffers, store segments) is mapped by same-host peers and copied with memcpy"),
                Err(why) => r.no("shm map", format!("peers' kvferry-allocated memory is not mapped here ({why}); cross-memory attach carries it")),
            }
            info(Transport::yes()).with("mapped", mapped_ok.into())
        }
        Ok((t, _)) => {
            let why = t.why_not_shm.unwrap_or_default();
            if cfg.transport == TransportMode::Shm {
                r.warn(
                    "shm",
                    format!("not usable, and KVFERRY_TRANSPORT=shm makes requests fail: {why}"),
                    "fix the cause above, or set KVFERRY_TRANSPORT=auto to fall back to TCP",
                );
            } else {
                r.no(
                    "shm",
                    format!("not usable here, peers on this host use TCP: {why}"),
                );
            }
            info(Transport::no(why, Some("see the ptrace scope check; in containers, share the PID namespace and grant CAP_SYS_PTRACE")))
        }
        Err(e) => {
            if cfg.transport == TransportMode::Shm {
                r.warn(
                    "shm",
                    format!("not usable, and KVFERRY_TRANSPORT=shm makes requests fail: {e}"),
                    "fix the cause above, or set KVFERRY_TRANSPORT=auto to fall back to TCP",
                );
            } else {
                r.no("shm", format!("could not be probed: {e}"));
            }
            info(Transport::no(
                format!("could not be probed: {e}"),
                Some("run `kvferry doctor` with KVFERRY_LOG=debug for the probe's own error"),
            ))
        }
    }
}

/// Starts `kvferry bench --mode target` as a child (its buffer is kvferry-allocated memory),
/// asks which transport reaches it and, over shared memory, writes 4 KiB into it: `Ok` in
/// the second place when that copy went through the mapping.
fn probe_child(cfg: &Config) -> Result<(kvferry::SegmentTransport, Result<(), String>), String> {
    use std::io::BufRead;
    let mut child = crate::self_command()?
        .args([
            "bench",
            "--mode",
            "target",
            "--exit-on-stdin-eof",
            "--local-hostname",
            "127.0.0.1",
            "--buffer-size",
            "4M",
            "--hugepages",
            "off",
        ])
        .env("KVFERRY_TRANSPORT", "auto")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("starting a probe target: {e}"))?;
    let result = (|| {
        let out = child
            .stdout
            .take()
            .ok_or("no output from the probe target")?;
        let mut line = String::new();
        std::io::BufReader::new(out)
            .read_line(&mut line)
            .map_err(|e| e.to_string())?;
        let seg = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("segment="))
            .ok_or("the probe target did not start")?;
        let e = TransferEngine::new(Config {
            local_hostname: "127.0.0.1".into(),
            transport: kvferry::TransportMode::Auto,
            ..cfg.clone()
        })
        .map_err(|e| e.to_string())?;
        let id = e.open_segment(seg).map_err(|e| e.to_string())?;
        let t = e.segment_transport(id).map_err(|e| e.to_string())?;
        if t.name != "shm" {
            return Ok((t, Err("not on shared memory".into())));
        }
        let remote = e
            .segment_descriptor(id)
            .map_err(|e| e.to_string())?
            .buffers
            .first()
            .map(|b| b.addr)
            .ok_or("the probe target has no buffer")?;
        let local = vec![0x5au8; 4096];
        e.register_memory(local.as_ptr() as u64, 4096, "cpu:0")
            .map_err(|e| e.to_string())?;
        let before = kvferry::host::shm::bytes_moved();
        let req = kvferry::TransferRequest {
            opcode: kvferry::Opcode::Write,
            source: local.as_ptr() as u64,
            target_id: id,
            target_offset: remote,
            length: 4096,
        };
        let st = e
            .transfer_sync(&[req], std::time::Duration::from_secs(5))
            .map_err(|e| e.to_string())?;
        let after = kvferry::host::shm::bytes_moved();
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

fn read(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

/// Counts the CPUs of a sysfs list such as `0-3,8-11`.
fn cpulist_len(list: &str) -> usize {
    list.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| match p.trim().split_once('-') {
            Some((a, b)) => match (a.parse::<usize>(), b.parse::<usize>()) {
                (Ok(a), Ok(b)) if b >= a => b - a + 1,
                _ => 0,
            },
            None => usize::from(p.trim().parse::<usize>().is_ok()),
        })
        .sum()
}

/// Host, CPU and NUMA facts.
fn host_info(r: &Report) -> serde_json::Value {
    let hostname = read("/proc/sys/kernel/hostname");
    let kernel = read("/proc/sys/kernel/osrelease");
    let model = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|c| {
        c.lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
    });
    let online = read("/sys/devices/system/cpu/online").map(|l| cpulist_len(&l));
    let usable = std::thread::available_parallelism().map(|n| n.get()).ok();
    let mut nodes = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/sys/devices/system/node") {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(id) = name
                .strip_prefix("node")
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let cpus =
                read(&format!("/sys/devices/system/node/{name}/cpulist")).unwrap_or_default();
            nodes.push(
                serde_json::json!({"node": id, "cpus": cpus, "cpu_count": cpulist_len(&cpus)}),
            );
        }
    }
    nodes.sort_by_key(|n| n["node"].as_u64());
    r.say(format!(
        "        host {} (Linux {}), {}",
        hostname.as_deref().unwrap_or("?"),
        kernel.as_deref().unwrap_or("?"),
        model.as_deref().unwrap_or("CPU model unknown")
    ));
    r.say(format!(
        "        CPUs: {} online, {} usable by this process; NUMA nodes: {}",
        online.map(|n| n.to_string()).unwrap_or("?".into()),
        usable.map(|n| n.to_string()).unwrap_or("?".into()),
        if nodes.is_empty() {
            "none listed (no /sys/devices/system/node)".to_string()
        } else {
            nodes
                .iter()
                .map(|n| format!("{} (CPUs {})", n["node"], n["cpus"].as_str().unwrap_or("")))
                .collect::<Vec<_>>()
                .join(", ")
        }
    ));
    serde_json::json!({
        "hostname": hostname, "kernel": kernel, "cpu_model": model,
        "cpus_online": online, "cpus_usable": usable, "numa_nodes": nodes,
    })
}

/// memlock, huge pages.
fn memory_info(r: &mut Report) -> serde_json::Value {
    // `None` in a limit is RLIM_INFINITY; getrlimit(2) cannot fail for a valid resource.
    let lim = rustix::process::getrlimit(rustix::process::Resource::Memlock);
    let bytes = |v: Option<u64>| v.map_or(serde_json::Value::Null, serde_json::Value::from);
    let fmt =
        |v: Option<u64>| v.map_or_else(|| "unlimited".to_string(), |v| format!("{} KiB", v / 1024));
    let ipc = cap_ipc_lock();
    let unlimited = lim.current.is_none();
    if unlimited || ipc {
        r.ok(
            "memlock",
            format!(
                "limit {} (CAP_IPC_LOCK: {})",
                fmt(lim.current),
                if ipc { "yes" } else { "no" }
            ),
        );
    } else {
        r.warn(
            "memlock",
            format!("limit {} and no CAP_IPC_LOCK: RDMA registration of large buffers will fail (TCP and shm do not need it)", fmt(lim.current)),
            "raise it: `ulimit -l unlimited`, docker run --ulimit memlock=-1, or LimitMEMLOCK=infinity in a systemd unit; or grant CAP_IPC_LOCK",
        );
    }
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |k: &str| {
        meminfo
            .lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
    };
    let (total, free, size_kib) = (
        field("HugePages_Total:"),
        field("HugePages_Free:"),
        field("Hugepagesize:"),
    );
    let thp = read("/sys/kernel/mm/transparent_hugepage/enabled").map(|t| {
        t.split_whitespace()
            .find(|w| w.starts_with('['))
            .unwrap_or("?")
            .trim_matches(|c| c == '[' || c == ']')
            .to_string()
    });
    r.say(format!(
        "        huge pages: {} reserved, {} free, {} KiB each",
        total.map(|v| v.to_string()).unwrap_or("?".into()),
        free.map(|v| v.to_string()).unwrap_or("?".into()),
        size_kib.map(|v| v.to_string()).unwrap_or("?".into())
    ));
    if let Some(mode) = &thp {
        let note = match mode.as_str() {
            "always" => "registered memory gets huge pages where the kernel can",
            "madvise" => "huge pages only where the application asks (madvise MADV_HUGEPAGE); cross-memory copies from 4 KiB pages cost about twice the CPU (not copies into memory kvferry allocated, which peers map)",
            _ => "no huge pages; cross-memory copies from 4 KiB pages cost about twice the CPU (not copies into memory kvferry allocated, which peers map)",
        };
        r.say(format!("        transparent huge pages: {mode} ({note})"));
    }
    serde_json::json!({
        "memlock": {
            "soft_bytes": bytes(lim.current),
            "hard_bytes": bytes(lim.maximum),
            "unlimited": unlimited,
            "cap_ipc_lock": ipc,
        },
        "huge_pages": {"total": total, "free": free, "size_kib": size_kib, "transparent": thp},
    })
}

/// RDMA: `kvferry::host::rdma::probe` (libibverbs loaded at run time, NICs and GIDs from sysfs),
/// then each port: its state, the GID the transport would choose (`MC_GID_INDEX` honoured)
/// and the active MTU (`ibv_query_port`; no memory registered, no queue pair made).
fn rdma(r: &Report, cfg: &Config) -> Transport {
    let p = kvferry::host::rdma::probe();
    let nics = serde_json::to_value(&p.nics).unwrap_or_default();
    let devices = match &p.verbs {
        Ok(d) => serde_json::json!(d),
        Err(_) => serde_json::json!([]),
    };
    let mut ports = kvferry::host::rdma::port_reports(&p.nics, cfg.gid_index);
    if p.library {
        kvferry::host::rdma::query_mtus(&mut ports);
    }
    let t = match p.why_not() {
        Some(why) => {
            r.no("rdma", &why);
            let fix = if !p.library {
                "install rdma-core (Debian/Ubuntu: apt-get install libibverbs1 ibverbs-providers)"
            } else if p.verbs.as_ref().map_or(true, |d| d.is_empty()) {
                "load the NIC's RDMA driver (e.g. mlx5_ib) and ib_uverbs; in a container, pass /dev/infiniband through; to test without RDMA hardware, Soft-RoCE (modprobe rdma_rxe; rdma link add rxe0 type rxe netdev eth0)"
            } else {
                "bring a port up (ibv_devinfo, rdma link show)"
            };
            Transport::no(why, Some(fix))
        }
        None => match ports.iter().filter(|pt| pt.problem.is_none()).count() {
            0 => {
                let why = format!(
                    "no port the RDMA transport would use ({})",
                    ports
                        .iter()
                        .map(|pt| pt.line())
                        .collect::<Vec<_>>()
                        .join("; ")
                );
                r.no("rdma", &why);
                Transport::no(why, Some("see each port's problem below"))
            }
            usable => {
                r.ok("rdma", format!("{usable} usable port(s); used with KVFERRY_TRANSPORT=rdma, and by auto for requests to peers that publish RDMA devices"));
                Transport::yes()
            }
        },
    };
    for pt in &ports {
        r.say(format!("          {}", pt.line()));
    }
    t.with("libibverbs", p.library.into())
        .with("devices", devices)
        .with("nics", nics)
        .with("ports", serde_json::to_value(&ports).unwrap_or_default())
}

/// GPU memory: `kvferry::host::gpu::probe` (libcuda.so.1 loaded at run time), whether the driver
/// has what staging GPU memory needs (`kvferry::host::gpu::cuda_ready`), and, where RDMA is usable, how
/// GPU memory would be registered on the NICs (`kvferry::host::gpu::direct`: DMA-BUF or
/// nvidia-peermem, and why not).
fn gpu(r: &mut Report, cfg: &Config, rdma_usable: bool) -> Transport {
    let p = kvferry::host::gpu::probe();
    let gpus = serde_json::to_value(&p.gpus).unwrap_or_default();
    // The driver API's version number: 12040 is CUDA 12.4.
    let version = p
        .driver_version
        .map(|v| format!("{}.{}", v / 1000, v % 1000 / 10));
    if let Some(v) = &version {
        r.say(format!(
            "        CUDA driver {v} (libcuda.so.1, loaded at run time)"
        ));
    }
    for g in &p.gpus {
        r.say(format!(
            "        gpu {}: {}, {} GiB, compute capability {}.{}, PCI {}",
            g.index,
            g.name,
            g.memory >> 30,
            g.compute_capability.0,
            g.compute_capability.1,
            g.pci_bus_id
        ));
    }
    let t = match &p.unavailable {
        Some(why) => {
            r.no("gpu memory", why);
            Transport::no(why.clone(), Some("install the NVIDIA driver; in a container, run with the NVIDIA container toolkit (--gpus all) so libcuda.so.1 is mounted"))
        }
        None => match kvferry::host::gpu::cuda_ready() {
            Ok(_) => {
                r.ok("gpu memory", format!("CUDA driver {} with {} GPU(s): GPU buffers register with \"*\" or \"cuda:N\" and move over RDMA where the NICs register them (below), else over TCP and same-host paths, staged through pinned host buffers", version.as_deref().unwrap_or("(version unknown)"), p.gpus.len()));
                Transport::yes()
            }
            Err(why) => {
                r.no("gpu memory", why);
                Transport::no(why, Some("update the NVIDIA driver (CUDA 11.4 or newer)"))
            }
        },
    };
    let direct = match (
        &p.unavailable,
        kvferry::host::gpu::cuda_ready(),
        rdma_usable,
    ) {
        (None, Ok(_), true) => {
            let verbs_dmabuf = kvferry::host::rdma::verbs_dmabuf();
            let rep = kvferry::host::gpu::report(cfg.gpu_rdma, 0, verbs_dmabuf);
            let fix = "load nvidia-peermem (modprobe nvidia_peermem), or use the NVIDIA open kernel modules with rdma-core 34+ and a NIC driver that imports dma-bufs (DMA-BUF)";
            // Whether each method really registers GPU memory here: 2 MiB of GPU 0 on the
            // first NIC, registered and deregistered.
            let tried = kvferry::host::gpu::try_gpu_registration(0, cfg.gpu_rdma);
            let mut works = Vec::new();
            let mut results = serde_json::Map::new();
            match &tried {
                Ok(list) => {
                    for (m, res) in list {
                        match res {
                            Ok(what) => {
                                works.push(*m);
                                r.say(format!("        {m}: works ({what})"));
                            }
                            Err(e) => r.say(format!("        {m}: refused: {e}")),
                        }
                        results.insert(
                            serde_json::to_value(m)
                                .ok()
                                .and_then(|v| v.as_str().map(str::to_string))
                                .unwrap_or_default(),
                            match res {
                                Ok(_) => serde_json::json!({"works": true}),
                                Err(e) => serde_json::json!({"works": false, "error": e}),
                            },
                        );
                    }
                }
                Err(e) => r.say(format!(
                    "        registering GPU memory on a NIC could not be tried: {e}"
                )),
            }
            if cfg.gpu_rdma == kvferry::GpuRdma::Auto {
                for why in [&rep.dmabuf_unavailable, &rep.peermem_unavailable]
                    .into_iter()
                    .flatten()
                {
                    r.say(format!("        not available: {why}"));
                }
            }
            match (&rep.unavailable, works.first()) {
                (None, Some(m)) => r.ok("gpu over rdma", format!("GPU memory registers on the NICs with {m} (KVFERRY_GPU_RDMA={}), so RDMA moves it without staging", rep.setting)),
                (Some(why), _) => r.warn("gpu over rdma", format!("{why}; GPU memory then goes over TCP, staged through host memory"), fix),
                (None, None) => r.warn("gpu over rdma", "no registration method worked on this host's NIC (see above); GPU memory then goes over TCP, staged through host memory", fix),
            }
            let mut v = serde_json::to_value(&rep).unwrap_or_default();
            if let Some(o) = v.as_object_mut() {
                o.insert("tried".into(), serde_json::Value::Object(results));
                o.insert(
                    "works".into(),
                    serde_json::to_value(&works).unwrap_or_default(),
                );
            }
            v
        }
        _ => {
            serde_json::json!({"unavailable": if rdma_usable { "GPU memory is not usable here" } else { "RDMA is not usable here" }})
        }
    };
    t.with("libcuda", p.driver_version.is_some().into())
        .with("driver_version", p.driver_version.into())
        .with("devices", gpus)
        .with("rdma", direct)
}

pub fn run(a: DoctorArgs) -> Result<(), String> {
    let mut r = Report {
        human: !a.json,
        problems: Vec::new(),
    };
    r.say(format!(
        "kvferry doctor (kvferry {})",
        env!("CARGO_PKG_VERSION")
    ));

    r.say("\nconfiguration (environment):");
    let cfg = match Config::from_env() {
        Ok(c) => {
            r.ok("environment", "all variables parse");
            c
        }
        Err(e) => {
            r.warn("environment", e.to_string(), "correct or unset the variable named (see the table below and docs/INSTALL.md's configuration section)");
            Config::default()
        }
    };
    let mut env = serde_json::Map::new();
    for v in ENV_VARS {
        let set = std::iter::once(v.name)
            .chain(v.aliases.iter().copied())
            .find_map(|n| std::env::var(n).ok().map(|val| (n, val)))
            // Secrets are not shown, only that they are set and how long they are.
            .map(|(n, val)| {
                if v.name.ends_with("_TOKEN") || v.name.ends_with("_PASSWORD") {
                    (n, format!("(set, {} bytes, not shown)", val.trim().len()))
                } else {
                    (n, val)
                }
            });
        if let Some((n, val)) = &set {
            env.insert((*n).to_string(), val.clone().into());
        }
        r.say(format!(
            "        {:<34} {}",
            v.name,
            set.map(|(n, val)| format!("{n}={val}"))
                .unwrap_or_else(|| format!("(default: {})", v.default))
        ));
    }
    // The cluster key: read as the store's clients and master will (its keys never shown).
    match kvferry::auth::ClusterKey::from_config(cfg.auth_key_file.as_deref()) {
        Ok(Some(k)) => r.ok(
            "cluster key",
            format!(
                "{k:?} in {} ({}): engines (handshake and TCP data ports, which protect {}: KVFERRY_AUTH_PROTECT), store clients and masters run the key's Noise handshake and seal every frame; the master's state routes and metadata-server writes need signed requests; stock Mooncake peers are refused",
                cfg.auth_key_file.as_deref().unwrap_or(std::path::Path::new("")).display(),
                kvferry::auth::NOISE,
                cfg.auth_protect.name()
            ),
        ),
        Ok(None) => r.ok("cluster key", "none (KVFERRY_AUTH_KEY_FILE unset): engines and the store accept any peer, as Mooncake"),
        Err(e) => r.warn("cluster key", e.to_string(), "fix the file or unset KVFERRY_AUTH_KEY_FILE: an engine, store client or master would not start with it"),
    }

    r.say("\nhost:");
    let host_json = host_info(&r);

    r.say("\naddresses:");
    let ifs = interfaces();
    for (name, ip) in &ifs {
        r.say(format!("        {name:<10} {ip}"));
    }
    let host = a.local_hostname.clone().unwrap_or_else(|| {
        ifs.iter()
            .find(|(_, ip)| ip.is_ipv4() && !ip.is_loopback())
            .map(|(_, ip)| ip.to_string())
            .unwrap_or_else(|| "127.0.0.1".into())
    });
    let pick = "pass an address listed above as --local-hostname (KVFERRY_LOCAL_HOSTNAME / the engine's local_hostname)";
    let resolved = kvferry::resolve_advertised(kvferry::split_host_port(&host).0);
    let mut advertised_ok = false;
    match &resolved {
        Ok(ip) if ifs.iter().any(|(_, i)| i == ip) => {
            if ip.is_loopback() {
                r.warn(
                    "advertised address",
                    format!("{host} is loopback: peers on other hosts cannot reach it"),
                    pick,
                );
            } else {
                advertised_ok = true;
                r.ok(
                    "advertised address",
                    format!("{host} ({ip}) is an address of this host"),
                );
            }
        }
        Ok(ip) => r.warn(
            "advertised address",
            format!("{host} resolves to {ip}, which is not an address of this host"),
            pick,
        ),
        Err(e) => r.warn("advertised address", e.to_string(), pick),
    }

    r.say("\nports:");
    let span = u32::from(cfg.max_port.saturating_sub(cfg.min_port)) + 1;
    let listeners = match TransferEngine::new(Config {
        local_hostname: host.clone(),
        ..cfg.clone()
    }) {
        Ok(e) => {
            r.ok(
                "listeners",
                format!(
                    "bound handshake port {} and data port {} in {}-{} ({span} ports) on {}",
                    e.rpc_port(),
                    e.data_port(),
                    cfg.min_port,
                    cfg.max_port,
                    cfg.bind_address
                        .map(|a| a.to_string())
                        .unwrap_or(host.clone())
                ),
            );
            Ok((e.rpc_port(), e.data_port()))
        }
        Err(e) => {
            r.warn("listeners", e.to_string(), "free ports in the range, widen it (KVFERRY_MIN_PORT / KVFERRY_MAX_PORT, Mooncake's MC_MIN_RPC_PORT / MC_MAX_RPC_PORT) or correct KVFERRY_BIND_ADDRESS");
            Err(e.to_string())
        }
    };
    let network = serde_json::json!({
        "advertised": host,
        "advertised_ip": resolved.as_ref().ok().map(|ip| ip.to_string()),
        "advertised_is_local": advertised_ok,
        "interfaces": ifs.iter().map(|(n, ip)| serde_json::json!({"name": n, "address": ip.to_string()})).collect::<Vec<_>>(),
        "port_range": [cfg.min_port, cfg.max_port],
        "bind_address": cfg.bind_address.map(|a| a.to_string()),
        "listeners": match &listeners {
            Ok((rpc, data)) => serde_json::json!({"ok": true, "rpc_port": rpc, "data_port": data}),
            Err(e) => serde_json::json!({"ok": false, "error": e}),
        },
    });

    r.say("\nmemory:");
    let memory = memory_info(&mut r);

    r.say("\nmetadata service:");
    let meta = a
        .metadata_server
        .clone()
        .unwrap_or_else(|| cfg.metadata_server.clone());
    let metadata = check_metadata(&mut r, &meta, &cfg);

    r.say("\ntransports:");
    let tcp = match &listeners {
        Ok(_) => {
            r.ok(
                "tcp",
                "available (Mooncake TCP protocol v2, v1 for old peers)",
            );
            Transport::yes()
        }
        Err(e) => {
            r.no("tcp", format!("the engine cannot listen: {e}"));
            Transport::no(
                format!("the engine cannot listen: {e}"),
                Some("see the listeners check"),
            )
        }
    };
    r.ok(
        "local",
        "transfers to this engine's own segment are a memcpy",
    );
    let shm = shm(&mut r, &cfg);
    let rdma = rdma(&r, &cfg);
    let gpu = gpu(&mut r, &cfg, rdma.available);
    let transports = [("tcp", tcp), ("shm", shm), ("rdma", rdma), ("gpu", gpu)];

    let mut unmet = Vec::new();
    for want in &a.expect {
        if let Some((name, t)) = transports.iter().find(|(n, _)| n == want) {
            if !t.available {
                let why = t.reason.clone().unwrap_or_default();
                unmet.push(format!("{name} ({why})"));
                let fix = t.fix.clone().unwrap_or_else(|| format!("no setting makes {name} work with this kvferry version; drop it from --expect"));
                r.warn(
                    &format!("expected transport {name}"),
                    format!("--expect {name}, but it cannot work here: {why}"),
                    fix,
                );
            }
        }
    }

    if a.json {
        let doc = serde_json::json!({
            "version": env!("CARGO_PKG_VERSION"),
            "environment": env,
            "host": host_json,
            "network": network,
            "memory": memory,
            "metadata": metadata,
            "transports": transports.iter().map(|(n, t)| (n.to_string(), serde_json::to_value(t).unwrap_or(serde_json::Value::Null))).collect::<serde_json::Map<_, _>>(),
            "problems": r.problems,
            "expect": {"requested": a.expect, "unmet": unmet},
            "ok": unmet.is_empty(),
        });
        let text = serde_json::to_string_pretty(&doc)
            .map_err(|e| format!("encoding the report as JSON: {e}"))?;
        println!("{text}");
    } else {
        r.say(format!(
            "\n{}",
            if r.problems.is_empty() {
                "no problems found".to_string()
            } else {
                format!("{} problem(s), each with its fix above", r.problems.len())
            }
        ));
    }
    if unmet.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "doctor: expected transport(s) cannot work here: {}",
            unmet.join("; ")
        ))
    }
}

/// Reachable, writable, latency: a GET, a PUT and a DELETE of a probe key.
fn check_metadata(r: &mut Report, conn: &str, cfg: &Config) -> serde_json::Value {
    use std::time::Instant;
    let fix = "start the metadata service or correct its address (--metadata-server / KVFERRY_METADATA_SERVER / the engine's metadata_server); P2PHANDSHAKE needs none";
    let store = match kvferry::metadata::connect(
        conn,
        &kvferry::metadata::StoreOptions::from_config(cfg),
    ) {
        Ok(None) => {
            r.ok(
                "mode",
                "P2PHANDSHAKE: no metadata service; segments are named host:rpc_port",
            );
            return serde_json::json!({"configured": conn, "mode": "P2PHANDSHAKE", "reachable": null, "writable": null, "error": null});
        }
        Ok(Some(s)) => s,
        Err(e) => {
            r.warn("metadata service", e.to_string(), fix);
            return serde_json::json!({"configured": conn, "mode": "service", "reachable": false, "writable": null, "error": e.to_string()});
        }
    };
    let backend = store.backend().to_string();
    let location = store.location().to_string();
    let key = format!("mooncake/kvferry-doctor/{}", std::process::id());
    let t = Instant::now();
    let get_ms = match store.get(&key) {
        Ok(_) => {
            let ms = t.elapsed().as_secs_f64() * 1e3;
            r.ok(
                "reachable",
                format!("{backend} at {location} answered a GET in {ms:.2} ms"),
            );
            ms
        }
        Err(e) => {
            r.warn("reachable", e.to_string(), fix);
            store.close();
            return serde_json::json!({"configured": conn, "mode": "service", "backend": backend, "location": location, "reachable": false, "writable": null, "error": e.to_string()});
        }
    };
    let t = Instant::now();
    let put = store.put(&key, b"{}");
    let put_ms = t.elapsed().as_secs_f64() * 1e3;
    let wfix = "the service answers but does not keep what is written: check its permissions/ACLs and free space";
    let mut error = None;
    let writable = match put.and_then(|_| store.get(&key)) {
        Ok(Some(v)) if v == b"{}" => {
            r.ok("writable", format!("PUT in {put_ms:.2} ms, read back"));
            true
        }
        Ok(other) => {
            let m = format!("PUT accepted but GET returned {other:?}");
            r.warn("writable", &m, wfix);
            error = Some(m);
            false
        }
        Err(e) => {
            r.warn("writable", e.to_string(), wfix);
            error = Some(e.to_string());
            false
        }
    };
    if let Err(e) = store.remove(&key) {
        r.warn(
            "writable",
            format!("DELETE of the probe key failed: {e}"),
            wfix,
        );
    }
    store.close();
    serde_json::json!({"configured": conn, "mode": "service", "backend": backend, "location": location, "reachable": true, "get_ms": get_ms, "writable": writable, "put_ms": put_ms, "error": error})
}

#[cfg(test)]
mod tests {
    use super::cpulist_len;

    #[test]
    fn cpu_lists() {
        assert_eq!(cpulist_len("0-3,8-11"), 8);
        assert_eq!(cpulist_len("0"), 1);
        assert_eq!(cpulist_len("0-1\n"), 2);
        assert_eq!(cpulist_len(""), 0);
        assert_eq!(cpulist_len("3-1,x"), 0, "malformed ranges count nothing");
    }
}
