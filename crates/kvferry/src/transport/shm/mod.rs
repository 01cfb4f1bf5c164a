//! Same-host transport: cross-memory attach (`process_vm_readv` / `process_vm_writev`).
//!
//! When a peer runs on this host, the initiator moves bytes between its registered memory and
//! the peer's in one kernel copy, in its own thread: no socket, no thread on the target.
//! kvferry's registered memory is whatever the caller registered (not allocated by kvferry),
//! so the peer cannot map it; cross-memory attach reaches it anyway. See
//! `docs/ARCHITECTURE.md` ("Same-host transfers") for the measurements behind the choice.
//!
//! **Publishing.** Unless `KVFERRY_TRANSPORT=tcp`, an engine publishes in its descriptor an
//! extra field (Mooncake peers ignore it; kvferry's decoder keeps it in `extra`):
//!
//! ```json
//! "kvferry_shm": {"version": 1, "host_id": "<boot id>/pid:[<pid namespace inode>]", "pid": 4242,
//!                 "uid": 1000, "ctl_fd": 7, "ctl_addr": 140..., "ctl_len": 65536,
//!                 "cookie": "<32 hex digits>", "epoch": 0}
//! ```
//!
//! `ctl_*` name the engine's **control region**: a 64 KiB memfd mapped shared, holding a
//! magic, the random cookie, the **unregister epoch**, a `closed` flag, the engine's segment
//! name and one slot per initiator (owner and in-flight counter).
//!
//! **Selection** (per peer, cached per peer cookie). The initiator uses this transport only if
//! the peer publishes the field, its `host_id` equals ours (boot id *and* PID namespace, so
//! containers with the same hostname or PID numbers are not confused), `pidfd_open(pid)`
//! succeeds, `pidfd_getfd` hands over the peer's control memfd and it holds the published
//! cookie and the name of the segment we opened (so the pidfd names the process that serves
//! that segment: a descriptor cannot aim us at another engine's memory), and a
//! `process_vm_readv` of the region's header and a `process_vm_writev` into its probe word
//! really work (ptrace rules, seccomp and user namespaces are tested, not guessed). Any
//! failure is logged at debug level and the peer is served over TCP;
//! [`ShmTransport::select`] returns the reason (shown by `kvferry doctor` and
//! `TransferEngine::segment_transport`).
//!
//! **Bounds.** The kernel lets a process with ptrace rights read and write *all* of its
//! peer's memory, so the bounds are enforced here, by the initiator, before every system
//! call: the remote range must lie inside a buffer of the peer's published descriptor, and
//! the descriptor must be current (its `epoch` equals the live epoch in the peer's control
//! region). A peer that publishes no `kvferry_shm` field (`KVFERRY_TRANSPORT=tcp` there, or a
//! Mooncake engine) is never accessed this way. A process that can `process_vm_writev` into
//! its peer could already `ptrace` it: this transport adds no privilege, and the bounds guard
//! against bugs, not against a hostile process of the same user.
//!
//! **Unregistering while a peer copies.** Each initiator owns a slot in the target's control
//! region. Around every system call it increments its slot's in-flight counter, then reads
//! the epoch (both sequentially consistent); if the epoch is not the one of the descriptor
//! it checked the range against, it backs off, refreshes the descriptor and re-checks. The
//! target's `unregister` first removes the range (new descriptors lack it), then increments
//! the epoch, then waits until every slot's counter is zero. Either the initiator sees the
//! new epoch and does not copy, or the target sees the counter and waits: once
//! `unregister_memory` returns, no copy into or out of that range is in flight or will start
//! (the wait is bounded by `KVFERRY_TRANSFER_TIMEOUT`; a slot whose owner process died is
//! cleared). A copy is at most [`CHUNK`] bytes, so the wait is short.
//!
//! **Peer identity and exit.** The pidfd is polled after each cross-memory (PID-addressed)
//! system call, and before it unless the last "alive" answer is younger than 1 ms (a PID is
//! reused only after its process exited, was reaped and the PID counter wrapped). Such a copy
//! is reported COMPLETED only if the peer was alive after it, i.e. the PID still named the
//! verified process during the whole call. A copy into a mapped buffer addresses no PID (it
//! reaches the memfd itself, verified by identity, alive before and after): a 1 ms-fresh
//! answer stands there, which saves a system call per small request. A peer that exits fails
//! its requests (`FAILED`, "process exited"), never the survivor.
//!
//! **Mapped buffers.** A peer's buffers that kvferry allocated ([`crate::hostbuf`]) are
//! published in `maps` with their identity: the memfd's inode and the buffer's random
//! generation (a freed buffer's successor usually has the same fd number and address).
//! Before mapping one, the initiator checks that the fd it took with `pidfd_getfd` has that
//! inode, the name `memfd:kvferry-buffer:<generation>`, the exact size, the shrink seal, a
//! header page with that generation still marked alive, and is what the peer maps at the
//! published address (`/proc/<pid>/maps`). Mappings are cached per identity. Every mapped
//! copy checks `alive` before and after it; a buffer freed meanwhile makes the copy be
//! redone by cross-memory attach (which reaches whatever the address holds now, or fails):
//! a copy into a freed buffer's orphaned memfd is never reported COMPLETED.
//!
//! **GPU memory.** Registered GPU ranges are exported through CUDA IPC and listed under
//! `gpus`; an initiator opens them and copies with the CUDA driver under the same bounds,
//! epoch and in-flight protocol (`gpu.rs`), so `unregister` stays a barrier for them too.
//!
//! **Control region.** Its memfd is sealed (`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`); an
//! initiator refuses a region without the shrink seal, so a target cannot truncate the
//! region under the initiator's mapping (which would raise SIGBUS in the initiator).
//!
//! **fork().** Every shared mapping made here (control regions, peer buffers) is
//! `MADV_DONTFORK`, and every value remembers the process that made it: dropped (or shut
//! down) in a forked child it only closes its descriptors — no `closed` mark, no epoch bump,
//! no slot change, no `munmap` of a range that in the child is not ours.
//!
//! **Departed peers.** A reaper thread per transport (started with the first verified peer)
//! sleeps in `poll` on every verified peer's pidfd, waking at once when one exits, and every
//! [`REAP_INTERVAL`] otherwise; it drops the selection of a peer whose process exited or whose
//! engine shut down (its mappings, control region and pidfd go once no copy holds them) and
//! unmaps buffers a living peer freed. Per live verified peer: one pidfd, no thread.

use super::{Caps, Kinds, Mem, Needs, Peer, PeerDirectory, Piece, Prelude, Reach, Transport};
use crate::batch::{FailCause, FailKind};
use crate::wire::descriptor::SegmentDesc;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

mod attach;
mod cma;
mod copy;
mod ctl;
mod gpu;
mod maps;

pub(crate) use attach::ShmPeer;
pub use cma::ptrace_scope;
#[cfg(feature = "test-hooks")]
pub use cma::simulate_cma_denied;
pub(crate) use ctl::CTL_LEN;
#[cfg(feature = "test-hooks")]
pub use gpu::gpu_ipc_bytes;
pub(crate) use gpu::GpuExport;

use cma::*;
use copy::*;
use ctl::*;

/// The descriptor field this transport publishes.
pub(crate) const FIELD: &str = "kvferry_shm";
/// Version of the published field and of the control region layout.
pub(crate) const VERSION: u32 = 1;
/// Largest copy done by one system call and one in-flight window; larger requests are cut
/// into pieces of this size and spread over the worker threads.
pub(crate) const CHUNK: u64 = 1 << 20;
/// Pieces gathered into one system call (one `iovec` pair each).
const MAX_IOV: usize = 64;
/// A submission of at most this many bytes is copied in the caller's thread (no hand-off).
const INLINE_BYTES: u64 = 64 << 10;

/// Which data path carries requests to peers (`KVFERRY_TRANSPORT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportMode {
    /// Shared memory to peers on this host that allow it, TCP otherwise.
    #[default]
    Auto,
    /// TCP only; this engine also does not offer shared-memory access to peers.
    Tcp,
    /// Shared memory only: requests to peers it cannot reach fail with the reason.
    Shm,
    /// RDMA only (one-sided verbs): the engine fails to start when no NIC is usable, and
    /// requests to peers without RDMA fail with the reason; never a silent fallback.
    Rdma,
}

impl std::str::FromStr for TransportMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(TransportMode::Auto),
            "tcp" => Ok(TransportMode::Tcp),
            "shm" => Ok(TransportMode::Shm),
            "rdma" => Ok(TransportMode::Rdma),
            other => Err(format!(
                "{other:?} is not a transport; use auto, tcp, shm or rdma"
            )),
        }
    }
}

impl std::fmt::Display for TransportMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransportMode::Auto => "auto",
            TransportMode::Tcp => "tcp",
            TransportMode::Shm => "shm",
            TransportMode::Rdma => "rdma",
        })
    }
}

/// What a peer publishes under [`FIELD`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ShmInfo {
    pub version: u32,
    pub host_id: String,
    pub pid: i32,
    #[serde(default)]
    pub uid: u32,
    pub ctl_fd: i32,
    pub ctl_addr: u64,
    pub ctl_len: u64,
    pub cookie: String,
    pub epoch: u64,
    /// Registered memory that lies in buffers kvferry allocated (memfd): the peer may map
    /// these and copy with `memcpy`. Absent in descriptors of engines before this field.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub maps: Vec<MapInfo>,
    /// Registered GPU memory exported through CUDA IPC: a peer opens it and copies with the
    /// CUDA driver (see `gpu.rs`). Absent when there is none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<GpuExport>,
}

/// A shareable (memfd-backed) buffer of the publishing process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub(crate) struct MapInfo {
    /// The memfd's number in the publishing process (taken with `pidfd_getfd`).
    pub fd: i32,
    /// Where the publisher maps the memfd's byte 0, and its length.
    pub addr: u64,
    pub len: u64,
    /// The publisher allocated every page up front, so a peer may map them all at once.
    #[serde(default)]
    pub populated: bool,
    /// The buffer's identity, which never repeats (an address and an fd number do, once the
    /// publisher freed the buffer and allocated another): the memfd's inode number and the
    /// buffer's random generation (in the memfd's name and header page, see
    /// [`crate::hostbuf`]). Mappings are cached per identity. 0: unknown (not mapped).
    #[serde(default)]
    pub ino: u64,
    #[serde(default)]
    pub generation: u64,
}

/// Bytes copied by this process through mapped peer memory and by cross-memory attach.
static MAPPED_BYTES: AtomicU64 = AtomicU64::new(0);
static CMA_BYTES: AtomicU64 = AtomicU64::new(0);

/// Bytes this process has moved to or from same-host peers so far: `(mapped, cma)`.
/// Benchmarks read the difference over a run to report which path carried it.
pub fn bytes_moved() -> (u64, u64) {
    (
        MAPPED_BYTES.load(Ordering::Relaxed),
        CMA_BYTES.load(Ordering::Relaxed),
    )
}

/// The value published under [`FIELD`]: `info` (from [`ShmTransport::offer`]) plus the
/// shareable buffers that contain the published `buffers`.
pub(crate) fn publish(
    mut info: ShmInfo,
    buffers: &[crate::wire::descriptor::BufferDesc],
) -> Option<serde_json::Value> {
    for b in buffers {
        if let Some(r) = crate::hostbuf::shareable_region(b.addr, b.length) {
            let m = MapInfo {
                fd: r.fd,
                addr: r.addr,
                len: r.len,
                populated: r.populated,
                ino: r.ino,
                generation: r.generation,
            };
            if !info.maps.contains(&m) {
                info.maps.push(m);
            }
        }
    }
    serde_json::to_value(info).ok()
}

impl ShmInfo {
    /// The cookie and epoch a descriptor publishes, without decoding the rest (hot path).
    fn cookie_epoch(desc: &SegmentDesc) -> Option<(&str, u64)> {
        let v = desc.extra.get(FIELD)?;
        Some((v.get("cookie")?.as_str()?, v.get("epoch")?.as_u64()?))
    }

    /// The field of a descriptor: `None` when absent, an error when malformed.
    pub(crate) fn of(desc: &SegmentDesc) -> Option<Result<ShmInfo, String>> {
        desc.extra.get(FIELD).map(|v| {
            serde_json::from_value::<ShmInfo>(v.clone())
                .map_err(|e| format!("its {FIELD} field is malformed ({e})"))
        })
    }
}

/// This host's identity as far as cross-memory attach is concerned: the boot id (differs
/// between hosts and VMs, and across reboots) and the PID namespace (PIDs mean the same
/// process only inside one).
pub fn host_id() -> Result<String, String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map_err(|e| format!("cannot read /proc/sys/kernel/random/boot_id: {e}"))?;
    let ns = std::fs::read_link("/proc/self/ns/pid")
        .map_err(|e| format!("cannot read /proc/self/ns/pid: {e}"))?;
    Ok(format!("{}/{}", boot.trim(), ns.display()))
}

// ------------------------------------------------------------------------------------------
// The transport
// ------------------------------------------------------------------------------------------

pub(crate) struct ShmOptions {
    /// This engine's segment name, written into its control region.
    pub name: String,
    pub mode: TransportMode,
    /// Worker threads for queued copies (0: the number of CPUs, at most 4).
    pub threads: usize,
    /// Bytes of peers' fully allocated buffers (store segments) whose page tables are filled
    /// in the background, per engine (0: none; `maps.rs` `filler`).
    pub background_fill: u64,
}

enum Selection {
    Yes(Arc<ShmPeer>),
    No(String),
    /// It was `Yes`, but the peer departed (found by the reaper): its mappings and pidfd
    /// are released; the next use re-reads the descriptor once (a new engine may serve it).
    Gone(String),
}

/// A selection and the peer cookie it was made for.
type Cached = (Option<String>, Arc<Selection>);

struct Shared {
    queue: Mutex<Queue>,
    cv: Condvar,
    /// The engine: re-reads a peer's descriptor when its epoch moved.
    dir: Arc<dyn PeerDirectory>,
    /// Per peer id: the cookie the selection was made for, and the selection.
    peers: Mutex<HashMap<u64, Cached>>,
    /// The reaper thread runs (started with the first verified peer).
    reaper: AtomicBool,
    /// Wakes the reaper: a new peer to watch, or shutdown.
    wake: Option<OwnedFd>,
    shut: AtomicBool,
}

/// How long after a verified same-host peer departs this engine still holds its resources
/// (its buffers mapped here, its control region, its pidfd, the selection) at most, plus
/// the few milliseconds the release takes. A process exit is seen at once (the reaper
/// sleeps in `poll` on every peer's pidfd); an engine shut down in a living process,
/// buffers the peer freed and GPU memory it unregistered (opened here through CUDA IPC,
/// closed then: `gpu.rs` `Opens`) are found by a check this often. A peer found gone by a
/// request earlier is released then.
pub const REAP_INTERVAL: Duration = Duration::from_millis(500);

impl Shared {
    fn wake_reaper(&self) {
        if let Some(w) = &self.wake {
            let _ = rustix::io::write(w, &1u64.to_ne_bytes());
        }
    }

    /// Forgets departed peers (their resources go once no copy holds them) and unmaps
    /// buffers that living peers freed. Returns the number of peers released.
    fn reap(&self) -> usize {
        let live: Vec<(u64, Option<String>, Arc<ShmPeer>)> = self
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter_map(|(id, (c, sel))| match &**sel {
                Selection::Yes(p) => Some((*id, c.clone(), Arc::clone(p))),
                _ => None,
            })
            .collect();
        let mut released = 0;
        for (id, cookie, p) in live {
            if !p.departed() {
                p.release_maps(false);
                // Its GPU memory opened here under an older unregister epoch is closed.
                p.gpu.close_before(p.ctl.epoch().load(Ordering::SeqCst));
                continue;
            }
            p.release_maps(true);
            let why = format!("the engine in process {} is gone", p.pid);
            let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
            let current = peers.get(&id).is_some_and(|(c, sel)| match &**sel {
                Selection::Yes(q) => *c == cookie && Arc::ptr_eq(q, &p),
                _ => false,
            });
            if current {
                peers.insert(id, (cookie, Arc::new(Selection::Gone(why))));
                released += 1;
            }
        }
        released
    }
}

/// Releases departed peers within [`REAP_INTERVAL`] (see there). Holds the transport only
/// weakly: it ends when the transport shuts down or is dropped.
fn reaper(weak: std::sync::Weak<Shared>) {
    use rustix::event::{PollFd, PollFlags};
    let mut buf = [0u8; 8];
    loop {
        let Some(shared) = weak.upgrade() else { return };
        if shared.shut.load(Ordering::Acquire) {
            return;
        }
        shared.reap();
        let watched: Vec<Arc<ShmPeer>> = shared
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter_map(|(_, sel)| match &**sel {
                Selection::Yes(p) => Some(Arc::clone(p)),
                _ => None,
            })
            .collect();
        let Some(wake) = &shared.wake else { return };
        let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(watched.len() + 1);
        fds.push(PollFd::new(wake, PollFlags::IN));
        fds.extend(watched.iter().map(|p| PollFd::new(&p.pidfd, PollFlags::IN)));
        let tick = rustix::event::Timespec {
            tv_sec: REAP_INTERVAL.as_secs() as i64,
            tv_nsec: i64::from(REAP_INTERVAL.subsec_nanos()),
        };
        match rustix::event::poll(&mut fds, Some(&tick)) {
            Ok(_) => {
                if !fds[0].revents().is_empty() {
                    drop(fds);
                    let _ = rustix::io::read(wake, &mut buf);
                }
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => {
                drop(fds);
                tracing::debug!("reaper: poll failed ({e}); checking every {REAP_INTERVAL:?}");
                std::thread::sleep(REAP_INTERVAL);
            }
        }
        // Our references must not keep a departed peer's mappings alive.
        drop(watched);
        drop(shared);
    }
}

/// The same-host transport of one engine.
pub(crate) struct ShmTransport {
    mode: TransportMode,
    threads: usize,
    local: Option<LocalCtl>,
    host_id: Result<String, String>,
    owner: u64,
    shared: Arc<Shared>,
    shut: AtomicBool,
    /// The process that created the transport (see [`foreign`]).
    home: u32,
    /// CUDA IPC exports of the registered GPU ranges (offered to peers).
    exports: gpu::Exports,
    /// [`ShmOptions::background_fill`], shared by this engine's peers.
    background_fill: Option<Arc<maps::filler::Budget>>,
}

impl ShmTransport {
    /// In a `fork()` child's copy: lets go of the parent's control region and the reaper's
    /// wake-up descriptor, touching neither for the parent (see `crate::forked`). Peers'
    /// buffers and pidfds stay held until the child exits: freeing them would need the
    /// peer table's lock, which a thread of the parent may have held at the fork.
    fn release_fds(&self) {
        use std::os::fd::AsFd;
        if let Some(c) = &self.local {
            crate::forked::detach(c.fd.as_fd());
        }
        if let Some(w) = &self.shared.wake {
            crate::forked::detach(w.as_fd());
        }
    }

    pub(crate) fn new(opts: ShmOptions, dir: Arc<dyn PeerDirectory>) -> ShmTransport {
        let host_id = host_id();
        let (local, local_reason) = match (opts.mode, &host_id) {
            (TransportMode::Tcp, _) => (None, Some("KVFERRY_TRANSPORT=tcp".to_string())),
            (TransportMode::Rdma, _) => (None, Some("KVFERRY_TRANSPORT=rdma".to_string())),
            (_, Err(e)) => (None, Some(e.clone())),
            (_, Ok(_)) => match LocalCtl::create(&opts.name) {
                Ok(c) => (Some(c), None),
                Err(e) => (
                    None,
                    Some(format!("cannot create the control region (memfd): {e}")),
                ),
            },
        };
        if let Some(r) = &local_reason {
            tracing::debug!("not offering shared-memory access to peers: {r}");
        }
        let threads = if opts.threads == 0 {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(2)
                .min(4)
        } else {
            opts.threads
        };
        let pid = u64::from(std::process::id());
        let owner = (pid << 32) | u64::from(rand::random::<u32>() | 1);
        ShmTransport {
            mode: opts.mode,
            threads,
            background_fill: maps::filler::Budget::new(opts.background_fill),
            local,
            host_id,
            owner,
            shared: Arc::new(Shared {
                queue: Mutex::default(),
                cv: Condvar::new(),
                dir,
                peers: Mutex::default(),
                reaper: AtomicBool::new(false),
                wake: rustix::event::eventfd(
                    0,
                    rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
                )
                .ok(),
                shut: AtomicBool::new(false),
            }),
            shut: AtomicBool::new(false),
            home: std::process::id(),
            exports: gpu::Exports::default(),
        }
    }

    /// What this engine publishes under [`FIELD`], without `maps` (see [`publish`]). Read
    /// it *before* snapshotting the registered ranges: the epoch then never claims a newer
    /// state than the buffer list.
    pub(crate) fn offer(&self) -> Option<ShmInfo> {
        let c = self.local.as_ref()?;
        let host_id = self.host_id.as_ref().ok()?;
        let info = ShmInfo {
            version: VERSION,
            host_id: host_id.clone(),
            pid: rustix::process::getpid().as_raw_nonzero().get(),
            uid: rustix::process::getuid().as_raw(),
            ctl_fd: c.fd.as_raw_fd(),
            ctl_addr: c.map.ptr as u64,
            ctl_len: CTL_LEN as u64,
            cookie: c.map.cookie_hex(),
            epoch: c.map.epoch().load(Ordering::SeqCst),
            maps: Vec::new(),
            gpus: self.exports.list(),
        };
        Some(info)
    }

    /// Chooses this transport for `peer`, or says why not. Cached per peer and peer cookie.
    pub(crate) fn select(&self, peer: &Arc<Peer>) -> Result<Arc<ShmPeer>, String> {
        if self.mode == TransportMode::Tcp {
            return Err("KVFERRY_TRANSPORT=tcp".into());
        }
        if self.shut.load(Ordering::Acquire) {
            return Err("engine shut down".into());
        }
        let mut desc = peer.desc();
        let cookie_of = |d: &SegmentDesc| ShmInfo::cookie_epoch(d).map(|(c, _)| c.to_string());
        // Compared without allocating: this runs for every submission.
        let same_cookie = |c: &Option<String>, d: &SegmentDesc| {
            c.as_deref() == ShmInfo::cookie_epoch(d).map(|(c, _)| c)
        };
        let cached = self
            .shared
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&peer.id)
            .cloned();
        if let Some((c, sel)) = cached {
            if same_cookie(&c, &desc) {
                let gone = match &*sel {
                    Selection::Yes(p)
                        if !p.exited_lately() && p.ctl.closed().load(Ordering::Acquire) == 0 =>
                    {
                        return Ok(Arc::clone(p))
                    }
                    Selection::No(r) => return Err(r.clone()),
                    Selection::Yes(p) => {
                        p.release_maps(true);
                        format!("{}: the engine in process {} is gone", peer.name, p.pid)
                    }
                    Selection::Gone(r) => format!("{}: {r}", peer.name),
                };
                // The engine we verified is gone (process exited or engine dropped): a new
                // one may serve the segment now.
                let _ = self.shared.dir.refresh(peer);
                desc = peer.desc();
                if same_cookie(&c, &desc) {
                    // Forget it: its control region and any of its memory mapped here are
                    // released once no copy uses them.
                    self.shared
                        .peers
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(peer.id, (c, Arc::new(Selection::No(gone.clone()))));
                    return Err(gone);
                }
            }
        }
        let info = ShmInfo::of(&desc);
        let cookie = cookie_of(&desc);
        let sel = match self.choose(info, &peer.name) {
            Ok(p) => {
                tracing::debug!(segment = %peer.name, pid = p.pid, "using shared memory (cross-memory attach)");
                Selection::Yes(Arc::new(p))
            }
            Err(r) => {
                let r = format!("{}: {r}", peer.name);
                tracing::debug!("shared memory not used for {r}; using TCP");
                Selection::No(r)
            }
        };
        let sel = Arc::new(sel);
        self.shared
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(peer.id, (cookie, Arc::clone(&sel)));
        match &*sel {
            Selection::Yes(p) => {
                self.watch();
                Ok(Arc::clone(p))
            }
            Selection::No(r) | Selection::Gone(r) => Err(r.clone()),
        }
    }

    /// Makes the reaper watch the peers selected so far (starting it the first time).
    fn watch(&self) {
        if self.shared.wake.is_none() {
            return; // no eventfd: peers are released when a request finds them gone
        }
        if self.shared.reaper.swap(true, Ordering::AcqRel) {
            self.shared.wake_reaper();
            return;
        }
        let weak = Arc::downgrade(&self.shared);
        if let Err(e) = std::thread::Builder::new()
            .name("kvf-shm-reaper".into())
            .spawn(move || reaper(weak))
        {
            tracing::warn!("cannot start the thread that releases departed same-host peers ({e}); they are released when a request finds them gone");
            self.shared.reaper.store(false, Ordering::Release);
        }
    }

    fn choose(
        &self,
        info: Option<Result<ShmInfo, String>>,
        segment: &str,
    ) -> Result<ShmPeer, String> {
        let info = info.ok_or_else(|| {
            format!(
                "it publishes no {FIELD} field (a Mooncake engine, or KVFERRY_TRANSPORT=tcp there)"
            )
        })??;
        let ours = self
            .host_id
            .as_ref()
            .map_err(|e| format!("this host's identity is unknown ({e})"))?;
        if info.version != VERSION {
            return Err(format!(
                "it speaks {FIELD} version {}, this engine {VERSION}",
                info.version
            ));
        }
        if info.host_id != *ours {
            return Err(format!(
                "it runs on another host or in another PID namespace (host id {} vs ours {ours})",
                info.host_id
            ));
        }
        if info.ctl_len != CTL_LEN as u64 {
            return Err(format!(
                "its control region is {} bytes, expected {CTL_LEN}",
                info.ctl_len
            ));
        }
        ShmPeer::attach(&info, self.owner, segment, self.background_fill.clone())
    }

    /// Same-host GPU memory: takes the pieces whose remote range lies in GPU memory a
    /// verified peer exports through CUDA IPC (and that opens here), and copies them with the
    /// driver; hands the others back with the reason (the router stages them over TCP).
    fn take_gpu_ipc(
        &self,
        peer: &Arc<Peer>,
        pieces: Vec<Piece>,
        inline: bool,
    ) -> Result<(), (Vec<Piece>, String)> {
        if self.mode == TransportMode::Tcp || self.mode == TransportMode::Rdma {
            return Err((pieces, format!("KVFERRY_TRANSPORT={}", self.mode)));
        }
        let desc = peer.desc();
        if !desc.buffers.iter().any(|b| b.name.starts_with("cuda:"))
            || desc.extra.get(FIELD).and_then(|v| v.get("gpus")).is_none()
        {
            return Err((
                pieces,
                format!("{}: it exports no GPU memory through CUDA IPC", peer.name),
            ));
        }
        let shm = match self.select(peer) {
            Ok(s) => s,
            Err(e) => return Err((pieces, e)),
        };
        let (taken, rest) = gpu::split(&shm, &desc, pieces);
        let refused = |rest: Vec<Piece>| match rest.first() {
            None => Ok(()),
            Some(p) => {
                let why = format!("{}: its GPU memory at 0x{:x} is not exported through CUDA IPC, or its export does not open here", peer.name, p.remote);
                Err((rest, why))
            }
        };
        if taken.is_empty() {
            return refused(rest);
        }
        let job = Job {
            shm,
            peer: Arc::clone(peer),
            pieces: taken,
            gpu: true,
        };
        let mut q = self.shared.queue.lock().unwrap_or_else(|e| e.into_inner());
        if inline || q.shutdown || q.workers == 0 && self.threads == 0 {
            drop(q);
            run_job(&self.shared, job);
            return refused(rest);
        }
        q.jobs.push_back(job);
        if q.workers < self.threads {
            let shared = Arc::clone(&self.shared);
            match std::thread::Builder::new()
                .name("kvf-shm".into())
                .spawn(move || worker(shared))
            {
                Ok(_) => q.workers += 1,
                Err(e) => tracing::warn!("cannot start a shared-memory worker thread: {e}"),
            }
        }
        if q.workers == 0 {
            let jobs: Vec<Job> = q.jobs.drain(..).collect();
            drop(q);
            for j in jobs {
                run_job(&self.shared, j);
            }
            return refused(rest);
        }
        drop(q);
        self.shared.cv.notify_one();
        refused(rest)
    }

    /// Queues (or, when small, runs here) pieces for a verified peer.
    pub(crate) fn submit_to(
        &self,
        peer: &Arc<Peer>,
        shm: Arc<ShmPeer>,
        pieces: Vec<Piece>,
        inline: bool,
    ) {
        if self.shut.load(Ordering::Acquire) {
            for p in pieces {
                p.task.piece_failed(
                    FailKind::Failed,
                    FailCause::ShutDown.because("engine shut down"),
                );
            }
            return;
        }
        let total: u64 = pieces.iter().map(|p| p.len).sum();
        // Small, or one job's worth that the caller waits for anyway: copied here (a hand-off
        // to a worker and back costs two wake-ups).
        if total <= INLINE_BYTES || (inline && total <= CHUNK && pieces.len() <= MAX_IOV) {
            run_job(
                &self.shared,
                Job {
                    shm,
                    peer: Arc::clone(peer),
                    pieces,
                    gpu: false,
                },
            );
            return;
        }
        // Cut large pieces, then gather pieces into jobs of about CHUNK bytes.
        let mut jobs: Vec<Job> = Vec::new();
        let mut cur: Vec<Piece> = Vec::new();
        let mut cur_bytes = 0u64;
        let push = |p: Piece, jobs: &mut Vec<Job>, cur: &mut Vec<Piece>, cur_bytes: &mut u64| {
            if !cur.is_empty() && (*cur_bytes + p.len > CHUNK || cur.len() >= MAX_IOV) {
                jobs.push(Job {
                    shm: Arc::clone(&shm),
                    peer: Arc::clone(peer),
                    pieces: std::mem::take(cur),
                    gpu: false,
                });
                *cur_bytes = 0;
            }
            *cur_bytes += p.len;
            cur.push(p);
        };
        for p in pieces {
            if p.len <= CHUNK {
                push(p, &mut jobs, &mut cur, &mut cur_bytes);
                continue;
            }
            let count = p.len.div_ceil(CHUNK);
            p.task.split(count as u32);
            let mut off = 0;
            while off < p.len {
                let len = CHUNK.min(p.len - off);
                let part = Piece {
                    opcode: p.opcode,
                    local: p.local + off,
                    remote: p.remote + off,
                    len,
                    task: Arc::clone(&p.task),
                    guard: p.guard.clone(),
                };
                push(part, &mut jobs, &mut cur, &mut cur_bytes);
                off += len;
            }
        }
        if !cur.is_empty() {
            jobs.push(Job {
                shm: Arc::clone(&shm),
                peer: Arc::clone(peer),
                pieces: cur,
                gpu: false,
            });
        }
        let n = jobs.len();
        let mut q = self.shared.queue.lock().unwrap_or_else(|e| e.into_inner());
        if q.shutdown {
            drop(q);
            for j in jobs {
                for p in j.pieces {
                    p.task.piece_failed(
                        FailKind::Failed,
                        FailCause::ShutDown.because("engine shut down"),
                    );
                }
            }
            return;
        }
        q.jobs.extend(jobs);
        while q.workers < self.threads {
            let shared = Arc::clone(&self.shared);
            match std::thread::Builder::new()
                .name("kvf-shm".into())
                .spawn(move || worker(shared))
            {
                Ok(_) => q.workers += 1,
                Err(e) => {
                    tracing::warn!("cannot start a shared-memory worker thread: {e}");
                    break;
                }
            }
        }
        if q.workers == 0 {
            // No thread at all: copy here rather than never.
            let jobs: Vec<Job> = q.jobs.drain(..).collect();
            drop(q);
            for j in jobs {
                run_job(&self.shared, j);
            }
            return;
        }
        drop(q);
        if n == 1 {
            self.shared.cv.notify_one();
        } else {
            self.shared.cv.notify_all();
        }
    }
}

/// Waits until no peer has a copy into or out of our memory in flight. Never gives up
/// while the copying process lives: a copy is one bounded `memcpy` or system call after an
/// epoch check, so only a peer that is stopped (SIGSTOP, a debugger) mid-copy can hold this;
/// a warning names the wait every 5 s. Slots of dead processes are cleared.
fn drain_fully(c: &LocalCtl, what: &str) {
    let start = Instant::now();
    while !c.drain(Instant::now() + Duration::from_secs(5)) {
        tracing::warn!("{what}: a same-host peer's copy has been in flight for {:?} (is that process stopped?); waiting for it", start.elapsed());
    }
}

impl Transport for ShmTransport {
    fn name(&self) -> &'static str {
        "shm"
    }

    /// The peer is verified (by `pick`, which asked [`ShmTransport::select`]) and its
    /// shareable buffers are mapped here now, not by its first copy. Their page tables are
    /// still filled by the copies that touch them first (or in the background, see
    /// `maps::filler`).
    fn warm(&self, peer: &Arc<Peer>) {
        if let Ok(shm) = self.select(peer) {
            shm.maps_for(&peer.desc());
        }
    }

    /// Host to host memory of a verified same-host peer (cross-memory attach, or its mapped
    /// buffers), and host or GPU memory to the GPU memory it exports (CUDA IPC). Not GPU to
    /// host memory: that is staged (the CPU never touches device memory).
    fn caps(&self) -> Caps {
        Caps {
            kinds: Kinds::HOST.or(Kinds::remote(Mem::Gpu)),
            reach: Reach::SameHost,
            needs: Needs::SameHostField,
            stageable: true,
        }
    }

    /// The offer ([`ShmTransport::offer`]), read before the buffer list: the published epoch
    /// is then never newer than the list.
    fn before_describe(&self) -> Prelude {
        self.offer()
            .map(|info| Box::new(info) as Box<dyn std::any::Any + Send>)
    }

    fn describe(&self, desc: &mut SegmentDesc, prelude: Prelude) {
        let info = match prelude {
            Some(p) => p.downcast::<ShmInfo>().ok().map(|b| *b),
            None => self.offer(),
        };
        if let Some(v) = info.and_then(|info| publish(info, &desc.buffers)) {
            desc.extra.insert(FIELD.to_string(), v);
        }
    }

    /// GPU memory is exported through CUDA IPC for same-host peers (when this engine offers
    /// shared memory at all).
    fn on_register(&self, region: &crate::memory::Region) -> crate::Result<()> {
        if self.local.is_some() {
            self.exports.on_register(region);
        }
        Ok(())
    }

    /// Called after a range left the registry: no copy into or out of it may be in flight
    /// once this returns.
    fn on_unregister(&self, region: &crate::memory::Region) {
        self.exports.on_unregister(region);
        if self.shut.load(Ordering::Acquire) {
            // Shut down: peers were cut off (closed, epoch moved, copies drained) then.
            return;
        }
        let Some(c) = &self.local else { return };
        c.map.epoch().fetch_add(1, Ordering::SeqCst);
        drain_fully(c, &format!("unregister of 0x{:x}", region.addr));
    }

    fn reachable(&self, peer: &Arc<Peer>) -> Result<(), String> {
        self.select(peer).map(|_| ())
    }

    /// Pieces into the peer's GPU memory go by CUDA IPC when it exports that memory and the
    /// export opens here; the rest by cross-memory attach (or mapped buffers). Whatever
    /// cannot go is handed back with the reason.
    fn try_submit(
        &self,
        peer: &Arc<Peer>,
        pieces: Vec<Piece>,
        inline: bool,
    ) -> Result<(), (Vec<Piece>, String)> {
        // (Costs one atomic load when the peer publishes no GPU memory.)
        let (pieces, gpu) = if peer.has_gpu() {
            let desc = peer.desc();
            pieces
                .into_iter()
                .partition(|p| super::remote_mem(&desc, p.remote, p.len) == Mem::Host)
        } else {
            (pieces, Vec::new())
        };
        let mut back: Vec<Piece> = Vec::new();
        let mut why = None;
        if !gpu.is_empty() {
            if let Err((rest, e)) = self.take_gpu_ipc(peer, gpu, inline) {
                back = rest;
                why = Some(e);
            }
        }
        if !pieces.is_empty() {
            match self.select(peer) {
                Ok(shm) => self.submit_to(peer, shm, pieces, inline),
                Err(e) => {
                    back.extend(pieces);
                    why = Some(e);
                }
            }
        }
        match why {
            Some(e) if !back.is_empty() => Err((back, e)),
            _ => Ok(()),
        }
    }

    fn submit(&self, peer: &Arc<Peer>, pieces: Vec<Piece>, inline: bool) {
        if let Err((pieces, r)) = self.try_submit(peer, pieces, inline) {
            fail_all(pieces, FailKind::Failed, FailCause::PeerUnreachable, &r);
        }
    }

    fn release_inherited(&self) {
        self.release_fds();
    }

    fn shutdown(&self) {
        if foreign(self.home) {
            // A forked child's copy: the control region, the queue and the peers' slots are
            // the parent's (and its locks may have been held by threads the child lacks).
            self.shut.store(true, Ordering::Release);
            return;
        }
        if self.shut.swap(true, Ordering::AcqRel) {
            return;
        }
        // Peers must stop copying into our memory before the caller frees it.
        if let Some(c) = &self.local {
            c.map.closed().store(1, Ordering::SeqCst);
            c.map.epoch().fetch_add(1, Ordering::SeqCst);
            drain_fully(c, "shutdown");
        }
        let jobs: Vec<Job> = {
            let mut q = self.shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            q.shutdown = true;
            q.jobs.drain(..).collect()
        };
        self.shared.cv.notify_all();
        for j in jobs {
            fail_all(
                j.pieces,
                FailKind::Failed,
                FailCause::ShutDown,
                "engine shut down",
            );
        }
        self.shared
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.shared.shut.store(true, Ordering::Release);
        self.shared.wake_reaper();
    }
}

impl Drop for ShmTransport {
    /// Shuts down (in the creating process only; a forked child's copy only closes its
    /// descriptors).
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::attach::*;
    use super::ctl::*;
    use super::*;

    #[test]
    fn mode_parses() {
        assert_eq!("AUTO".parse::<TransportMode>(), Ok(TransportMode::Auto));
        assert_eq!(" shm ".parse::<TransportMode>(), Ok(TransportMode::Shm));
        assert_eq!("RDMA".parse::<TransportMode>(), Ok(TransportMode::Rdma));
        assert!("verbs"
            .parse::<TransportMode>()
            .unwrap_err()
            .contains("auto, tcp, shm or rdma"));
    }

    #[test]
    fn host_id_names_boot_and_namespace() {
        let h = host_id().unwrap();
        assert!(h.contains("pid:["), "{h}");
        assert_eq!(h, host_id().unwrap());
    }

    #[test]
    fn endpoint_aliases() {
        assert!(same_endpoint("localhost:15001", "127.0.0.1:15001"));
        assert!(!same_endpoint("localhost:15001", "127.0.0.1:15002"));
        assert!(!same_endpoint("127.0.0.2:15001", "127.0.0.1:15001"));
        assert!(!same_endpoint("no-such-host.invalid:1", "127.0.0.1:1"));
        assert!(!same_endpoint("garbage", "127.0.0.1:1"));
    }

    #[test]
    fn control_region_layout() {
        const { assert!(N_SLOTS >= 1000) };
        let c = LocalCtl::create("127.0.0.1:15000").unwrap();
        assert_eq!(c.map.name(), "127.0.0.1:15000");
        assert_eq!(c.map.header()[..8], CTL_MAGIC.to_le_bytes());
        assert_eq!(c.map.cookie_hex().len(), 32);
        // A slot owned by a dead process with a copy "in flight" does not block a drain.
        c.map
            .owner(3)
            .store((i32::MAX as u64) << 32 | 1, Ordering::SeqCst);
        c.map.active(3).store(1, Ordering::SeqCst);
        c.map.word(OFF_HWM).store(4, Ordering::SeqCst);
        assert!(c.drain(Instant::now() + Duration::from_secs(2)));
        assert_eq!(c.map.owner(3).load(Ordering::SeqCst), 0);
        // A live owner with a copy in flight does, until the deadline.
        let owner = (u64::from(std::process::id()) << 32) | 7;
        assert_eq!(claim_slot(&c.map, owner), Some(0));
        c.map.active(0).store(1, Ordering::SeqCst);
        let t = Instant::now();
        assert!(!c.drain(Instant::now() + Duration::from_millis(50)));
        assert!(t.elapsed() >= Duration::from_millis(50));
        // The owner died mid-copy and its pid went to another process (here: this one,
        // started at another time than the slot says): the copy cannot continue either.
        assert_ne!(
            c.map.started(0).load(Ordering::SeqCst),
            0,
            "the claim recorded when its owner started"
        );
        c.map.started(0).store(
            c.map.started(0).load(Ordering::SeqCst) + 1,
            Ordering::SeqCst,
        );
        assert!(
            c.drain(Instant::now() + Duration::from_secs(2)),
            "a reused pid does not hold a drain"
        );
        assert_eq!(c.map.owner(0).load(Ordering::SeqCst), 0);
    }
    #[test]
    fn control_region_is_sealed_and_an_unsealed_one_is_refused() {
        let name = "127.0.0.1:15077";
        let c = LocalCtl::create(name).unwrap();
        // Its owner (or anyone with the fd) cannot shrink or grow it under a peer's mapping.
        assert!(rustix::fs::ftruncate(&c.fd, 0).is_err());
        assert!(rustix::fs::ftruncate(&c.fd, 2 * CTL_LEN as u64).is_err());
        let info_of = |fd: &OwnedFd, map: &CtlMap| ShmInfo {
            version: VERSION,
            host_id: host_id().unwrap(),
            pid: std::process::id() as i32,
            uid: 0,
            ctl_fd: fd.as_raw_fd(),
            ctl_addr: map.ptr as u64,
            ctl_len: CTL_LEN as u64,
            cookie: map.cookie_hex(),
            epoch: 0,
            maps: Vec::new(),
            gpus: Vec::new(),
        };
        let owner = (u64::from(std::process::id()) << 32) | 99;
        ShmPeer::attach(&info_of(&c.fd, &c.map), owner, name, None)
            .expect("the sealed region is accepted");
        // A region that is a valid kvferry control region in every other respect, but
        // unsealed: its owner could truncate it and crash us with SIGBUS. Refused.
        let fd =
            rustix::fs::memfd_create("kvferry-shm-ctl", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, CTL_LEN as u64).unwrap();
        let map = CtlMap::map(&fd).unwrap();
        for off in [OFF_COOKIE, OFF_COOKIE + 8] {
            map.word(off).store(rand::random(), Ordering::SeqCst);
        }
        // SAFETY: in bounds of the fresh mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(name.as_ptr(), map.ptr.add(OFF_NAME + 8), name.len())
        };
        map.word(OFF_NAME)
            .store(name.len() as u64, Ordering::SeqCst);
        map.word(OFF_MAGIC).store(CTL_MAGIC, Ordering::SeqCst);
        let e = ShmPeer::attach(&info_of(&fd, &map), owner, name, None)
            .err()
            .expect("an unsealed control region is refused");
        assert!(e.contains("not sealed"), "{e}");
    }

    #[test]
    fn a_forked_child_dropping_the_transport_leaves_the_parents_region_alone() {
        let name = "127.0.0.1:15078";
        let t = ShmTransport::new(
            ShmOptions {
                name: name.into(),
                mode: TransportMode::Auto,
                threads: 1,
                background_fill: 0,
            },
            Arc::new(crate::transport::Detached),
        );
        let info = t.offer().unwrap();
        let owner = (u64::from(std::process::id()) << 32) | 5;
        let peer = ShmPeer::attach(&info, owner, name, None).unwrap();
        let slot = peer.slot;
        let c = t.local.as_ref().unwrap();
        let epoch = c.map.epoch().load(Ordering::SeqCst);
        // SAFETY: the child only drops values (closing descriptors) and exits.
        let Some(pid) = (unsafe { crate::sys::proc::fork() }) else {
            t.shutdown();
            drop(t);
            drop(peer);
            crate::sys::proc::exit_now(0)
        };
        let status = crate::sys::proc::wait_child(pid);
        assert_eq!(status, Some(0), "the child crashed");
        assert_eq!(
            c.map.closed().load(Ordering::SeqCst),
            0,
            "the child marked the parent's region closed"
        );
        assert_eq!(
            c.map.epoch().load(Ordering::SeqCst),
            epoch,
            "the child moved the parent's epoch"
        );
        assert_eq!(
            c.map.owner(slot).load(Ordering::SeqCst),
            owner,
            "the child released the parent's slot"
        );
        // The parent's transport still works: a new initiator attaches.
        ShmPeer::attach(&t.offer().unwrap(), owner + 2, name, None)
            .expect("the parent still serves");
        drop(peer);
        assert_eq!(
            c.map.owner(slot).load(Ordering::SeqCst),
            0,
            "the parent's own drop releases the slot"
        );
        t.shutdown();
        assert_eq!(c.map.closed().load(Ordering::SeqCst), 1);
    }
}
