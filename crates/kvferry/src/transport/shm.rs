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
//! **Peer identity and exit.** The pidfd is polled after each system call, and before it
//! unless the last "alive" answer is younger than 1 ms (a PID is reused only after its
//! process exited, was reaped and the PID counter wrapped). A copy is reported COMPLETED only
//! if the peer was alive after it, i.e. the PID still named the verified process during the
//! whole call. A peer that exits fails its requests (`FAILED`, "process exited"), never the
//! survivor.
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

use super::{Peer, Piece, Transport};
use crate::batch::{FailCause, FailKind};
use crate::wire::descriptor::SegmentDesc;
use crate::wire::tcp::Opcode;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The descriptor field this transport publishes.
pub const FIELD: &str = "kvferry_shm";
/// Version of the published field and of the control region layout.
pub const VERSION: u32 = 1;
/// Size of the control region.
pub const CTL_LEN: usize = 64 << 10;
/// Largest copy done by one system call and one in-flight window; larger requests are cut
/// into pieces of this size and spread over the worker threads.
pub const CHUNK: u64 = 1 << 20;
/// Pieces gathered into one system call (one `iovec` pair each).
const MAX_IOV: usize = 64;
/// A submission of at most this many bytes is copied in the caller's thread (no hand-off).
const INLINE_BYTES: u64 = 64 << 10;

const CTL_MAGIC: u64 = u64::from_le_bytes(*b"KVFCTL01");
const OFF_MAGIC: usize = 0;
const OFF_COOKIE: usize = 8;
const OFF_EPOCH: usize = 24;
const OFF_CLOSED: usize = 32;
const OFF_PROBE: usize = 40;
const OFF_HWM: usize = 48;
/// The owner's segment name: a length word, then up to [`NAME_MAX`] bytes.
const OFF_NAME: usize = 64;
const NAME_MAX: usize = 248;
const SLOT_BASE: usize = 320;
const SLOT_SIZE: usize = 64;
const N_SLOTS: usize = (CTL_LEN - SLOT_BASE) / SLOT_SIZE;

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
}

impl std::str::FromStr for TransportMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(TransportMode::Auto),
            "tcp" => Ok(TransportMode::Tcp),
            "shm" => Ok(TransportMode::Shm),
            other => Err(format!("{other:?} is not a transport; use auto, tcp or shm")),
        }
    }
}

impl std::fmt::Display for TransportMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransportMode::Auto => "auto",
            TransportMode::Tcp => "tcp",
            TransportMode::Shm => "shm",
        })
    }
}

/// What a peer publishes under [`FIELD`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmInfo {
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
}

/// A shareable (memfd-backed) buffer of the publishing process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MapInfo {
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
    (MAPPED_BYTES.load(Ordering::Relaxed), CMA_BYTES.load(Ordering::Relaxed))
}

/// The value published under [`FIELD`]: `info` (from [`ShmTransport::offer`]) plus the
/// shareable buffers that contain the published `buffers`.
pub fn publish(mut info: ShmInfo, buffers: &[crate::wire::descriptor::BufferDesc]) -> Option<serde_json::Value> {
    for b in buffers {
        if let Some(r) = crate::hostbuf::shareable_region(b.addr, b.length) {
            let m = MapInfo { fd: r.fd, addr: r.addr, len: r.len, populated: r.populated, ino: r.ino, generation: r.generation };
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
    pub fn of(desc: &SegmentDesc) -> Option<Result<ShmInfo, String>> {
        desc.extra
            .get(FIELD)
            .map(|v| serde_json::from_value::<ShmInfo>(v.clone()).map_err(|e| format!("its {FIELD} field is malformed ({e})")))
    }
}

/// This host's identity as far as cross-memory attach is concerned: the boot id (differs
/// between hosts and VMs, and across reboots) and the PID namespace (PIDs mean the same
/// process only inside one).
pub fn host_id() -> Result<String, String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map_err(|e| format!("cannot read /proc/sys/kernel/random/boot_id: {e}"))?;
    let ns = std::fs::read_link("/proc/self/ns/pid").map_err(|e| format!("cannot read /proc/self/ns/pid: {e}"))?;
    Ok(format!("{}/{}", boot.trim(), ns.display()))
}

/// `kernel.yama.ptrace_scope`, if Yama is present.
pub fn ptrace_scope() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").ok().and_then(|s| s.trim().parse().ok())
}

/// Explains a refusal by the kernel's ptrace access rules.
fn not_permitted(pid: i32, what: &str, e: &io::Error) -> String {
    let yama = match ptrace_scope() {
        Some(1) => "; kernel.yama.ptrace_scope=1 allows it only towards descendant processes: set it to 0 (sysctl kernel.yama.ptrace_scope=0) or give the initiator CAP_SYS_PTRACE",
        Some(2) => "; kernel.yama.ptrace_scope=2 allows it only with CAP_SYS_PTRACE",
        Some(3) => "; kernel.yama.ptrace_scope=3 forbids it entirely",
        _ => "",
    };
    format!(
        "{what} process {pid} is not permitted ({e}): cross-memory attach needs the same user and a dumpable peer, or CAP_SYS_PTRACE; a container's seccomp profile may also block it{yama}"
    )
}

// ------------------------------------------------------------------------------------------
// System calls
// ------------------------------------------------------------------------------------------

fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    let pid = rustix::process::Pid::from_raw(pid).ok_or_else(|| io::Error::from_raw_os_error(libc::ESRCH))?;
    Ok(rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())?)
}

fn pidfd_getfd(pidfd: &OwnedFd, fd: i32) -> io::Result<OwnedFd> {
    Ok(rustix::process::pidfd_getfd(pidfd, fd, rustix::process::PidfdGetfdFlags::empty())?)
}

/// Whether the process behind `pidfd` has exited (the pidfd polls readable then).
fn exited(pidfd: &OwnedFd) -> bool {
    use rustix::event::{PollFd, PollFlags};
    let mut p = [PollFd::new(pidfd, PollFlags::IN)];
    match rustix::event::poll(&mut p, Some(&rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 })) {
        Ok(0) => false,
        Ok(_) => !p[0].revents().is_empty(),
        Err(_) => true,
    }
}

/// Whether this process is a child forked from the one that created a value (`home`): it
/// then holds copies of the creator's descriptors but none of its shared mappings (they
/// are `MADV_DONTFORK`), and must not act on the creator's behalf (no `closed` mark, no
/// slot changes, no `munmap` of ranges that in the child are not ours).
fn foreign(home: u32) -> bool {
    std::process::id() != home
}

/// Marks a mapping not to be inherited by child processes.
fn dontfork(ptr: *mut u8, len: usize) {
    // SAFETY: advising our own mapping; no memory is touched.
    if unsafe { libc::madvise(ptr as *mut libc::c_void, len, libc::MADV_DONTFORK) } != 0 {
        tracing::debug!("madvise(MADV_DONTFORK) failed: {}", io::Error::last_os_error());
    }
}

/// One cross-memory copy of matching local and remote iovecs. Returns bytes moved.
fn cma(pid: i32, op: Opcode, local: &[libc::iovec], remote: &[libc::iovec]) -> io::Result<usize> {
    if FORCE_DENIED.load(Ordering::Relaxed) {
        return Err(io::Error::from_raw_os_error(libc::EPERM));
    }
    // SAFETY: the local iovecs lie in memory registered with this engine (guards held); the
    // kernel checks the remote ones against the peer's address space and never faults us.
    let n = unsafe {
        match op {
            Opcode::Write => libc::process_vm_writev(pid, local.as_ptr(), local.len() as _, remote.as_ptr(), remote.len() as _, 0),
            Opcode::Read => libc::process_vm_readv(pid, local.as_ptr(), local.len() as _, remote.as_ptr(), remote.len() as _, 0),
        }
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

static FORCE_DENIED: AtomicBool = AtomicBool::new(false);

/// Test hook: makes every cross-memory call of this process fail with EPERM, as under a
/// restrictive ptrace policy, so the TCP fallback can be exercised without one.
#[doc(hidden)]
pub fn simulate_cma_denied(on: bool) {
    FORCE_DENIED.store(on, Ordering::Relaxed);
}

// ------------------------------------------------------------------------------------------
// The control region
// ------------------------------------------------------------------------------------------

/// A shared mapping of a control region (ours or a peer's).
struct CtlMap {
    ptr: *mut u8,
    /// The process that mapped it.
    home: u32,
}

// SAFETY: the mapping is only accessed through atomics and immutable header bytes.
unsafe impl Send for CtlMap {}
unsafe impl Sync for CtlMap {}

impl CtlMap {
    fn map(fd: &OwnedFd) -> io::Result<CtlMap> {
        // SAFETY: shared mapping of a memfd at least CTL_LEN long (checked by callers).
        let p = unsafe { libc::mmap(std::ptr::null_mut(), CTL_LEN, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        dontfork(p as *mut u8, CTL_LEN);
        Ok(CtlMap { ptr: p as *mut u8, home: std::process::id() })
    }

    fn word(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off % 8 == 0 && off + 8 <= CTL_LEN);
        // SAFETY: in bounds, 8-aligned (the mapping is page-aligned), shared memory accessed
        // only atomically.
        unsafe { &*(self.ptr.add(off) as *const AtomicU64) }
    }

    fn header(&self) -> [u8; 24] {
        let mut h = [0u8; 24];
        h[..8].copy_from_slice(&self.word(OFF_MAGIC).load(Ordering::Acquire).to_le_bytes());
        h[8..16].copy_from_slice(&self.word(OFF_COOKIE).load(Ordering::Acquire).to_le_bytes());
        h[16..].copy_from_slice(&self.word(OFF_COOKIE + 8).load(Ordering::Acquire).to_le_bytes());
        h
    }

    fn cookie_hex(&self) -> String {
        self.header()[8..].iter().map(|b| format!("{b:02x}")).collect()
    }

    fn epoch(&self) -> &AtomicU64 {
        self.word(OFF_EPOCH)
    }
    fn closed(&self) -> &AtomicU64 {
        self.word(OFF_CLOSED)
    }
    fn owner(&self, slot: usize) -> &AtomicU64 {
        self.word(SLOT_BASE + slot * SLOT_SIZE)
    }
    fn active(&self, slot: usize) -> &AtomicU64 {
        self.word(SLOT_BASE + slot * SLOT_SIZE + 8)
    }
    /// The segment name its owner wrote (empty if none or malformed).
    fn name(&self) -> String {
        let len = (self.word(OFF_NAME).load(Ordering::Acquire) as usize).min(NAME_MAX);
        let mut bytes = vec![0u8; len];
        for (i, b) in bytes.iter_mut().enumerate() {
            // SAFETY: in bounds of the mapping; written once by the owner before publishing.
            *b = unsafe { std::ptr::read_volatile(self.ptr.add(OFF_NAME + 8 + i)) };
        }
        String::from_utf8(bytes).unwrap_or_default()
    }

    fn hwm(&self) -> usize {
        (self.word(OFF_HWM).load(Ordering::Acquire) as usize).min(N_SLOTS)
    }
}

impl Drop for CtlMap {
    fn drop(&mut self) {
        if foreign(self.home) {
            return; // a forked child does not have the mapping (MADV_DONTFORK)
        }
        // SAFETY: unmapping our own mapping; nothing refers to it any more.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, CTL_LEN) };
    }
}

/// The process id stored in a slot owner word.
fn owner_pid(owner: u64) -> i32 {
    (owner >> 32) as i32
}

/// Whether a process exists and has not exited (a zombie counts as exited).
fn pid_alive(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks existence and permission.
    let r = unsafe { libc::kill(pid, 0) };
    if r != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return false;
    }
    // State is the field after the parenthesised command name.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !matches!(s.rfind(')').and_then(|i| s[i + 1..].split_whitespace().next()), Some("Z") | Some("X")),
        Err(_) => true,
    }
}

/// This engine's own control region.
struct LocalCtl {
    map: CtlMap,
    fd: OwnedFd,
}

impl LocalCtl {
    fn create(name: &str) -> io::Result<LocalCtl> {
        use rustix::fs::{MemfdFlags, SealFlags};
        let fd = rustix::fs::memfd_create("kvferry-shm-ctl", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&fd, CTL_LEN as u64)?;
        // Peers map the region and read it without a system call: its size must never
        // change under them (a truncated mapping raises SIGBUS in the reader).
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        let map = CtlMap::map(&fd)?;
        let cookie: [u8; 16] = rand::random();
        map.word(OFF_COOKIE).store(u64::from_le_bytes(cookie[..8].try_into().unwrap_or_default()), Ordering::Release);
        map.word(OFF_COOKIE + 8).store(u64::from_le_bytes(cookie[8..].try_into().unwrap_or_default()), Ordering::Release);
        let name = &name.as_bytes()[..name.len().min(NAME_MAX)];
        // SAFETY: in bounds; nobody else has the region yet.
        unsafe { std::ptr::copy_nonoverlapping(name.as_ptr(), map.ptr.add(OFF_NAME + 8), name.len()) };
        map.word(OFF_NAME).store(name.len() as u64, Ordering::Release);
        map.word(OFF_MAGIC).store(CTL_MAGIC, Ordering::Release);
        Ok(LocalCtl { map, fd })
    }

    /// Waits until no initiator has a copy in flight, up to `until`. Slots of dead owners
    /// are cleared. Returns false if copies were still in flight at `until`.
    fn drain(&self, until: Instant) -> bool {
        let mut pause = Duration::from_micros(20);
        loop {
            let mut busy = false;
            for s in 0..self.map.hwm() {
                if self.map.active(s).load(Ordering::SeqCst) == 0 {
                    continue;
                }
                let owner = self.map.owner(s).load(Ordering::SeqCst);
                if owner == 0 || !pid_alive(owner_pid(owner)) {
                    // Its owner died mid-copy: the copy cannot continue.
                    self.map.active(s).store(0, Ordering::SeqCst);
                    let _ = self.map.owner(s).compare_exchange(owner, 0, Ordering::SeqCst, Ordering::SeqCst);
                    continue;
                }
                busy = true;
            }
            if !busy {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }
}

// ------------------------------------------------------------------------------------------
// A peer reached through cross-memory attach
// ------------------------------------------------------------------------------------------

/// Monotonic nanoseconds since the first call.
fn now_ns() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    BASE.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// How long a "still alive" check stands in for the check before the next copy. A PID can
/// only be reused after its process exited, was reaped and the PID counter wrapped.
const ALIVE_FOR_NS: u64 = 1_000_000;

/// A verified same-host peer process.
pub struct ShmPeer {
    pid: i32,
    pidfd: OwnedFd,
    /// When the pidfd last said "alive" ([`now_ns`]).
    alive_at: AtomicU64,
    ctl: CtlMap,
    slot: usize,
    owner: u64,
    cookie: String,
    /// The peer's shareable buffers mapped here, for the descriptor they were read from.
    maps: Mutex<MapCache>,
    /// The process that attached (see [`foreign`]).
    home: u32,
}

/// A peer's shareable buffer mapped into this process: its data and, after it, its header
/// page (see [`crate::hostbuf`]).
struct PeerMap {
    info: MapInfo,
    ptr: *mut u8,
    /// Length of the whole mapping (data rounded up to pages, plus the header page).
    map_len: usize,
    /// The process that mapped it.
    home: u32,
}

// SAFETY: a shared mapping owned by this value; bytes are copied in and out only under the
// same in-flight/epoch protocol as cross-memory copies.
unsafe impl Send for PeerMap {}
unsafe impl Sync for PeerMap {}

impl Drop for PeerMap {
    fn drop(&mut self) {
        if foreign(self.home) {
            return; // a forked child does not have the mapping (MADV_DONTFORK)
        }
        // SAFETY: our own mapping; no job holds this value any more.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.map_len) };
    }
}

impl PeerMap {
    fn header_word(&self, i: usize) -> &AtomicU64 {
        // SAFETY: the header page lies inside our mapping (checked in `ShmPeer::map`),
        // page-aligned; shared memory accessed only atomically.
        unsafe { &*(self.ptr.add(crate::hostbuf::header_offset(self.info.len) as usize) as *const AtomicU64).add(i) }
    }

    /// Whether the buffer is still the live one its owner published: a freed buffer's
    /// header says so before its pages are released (and its memory may be reused at the
    /// same address by a new buffer, which this mapping does not reach).
    fn alive(&self) -> bool {
        self.header_word(crate::hostbuf::HDR_ALIVE).load(Ordering::SeqCst) == 1
            && self.header_word(crate::hostbuf::HDR_GENERATION).load(Ordering::Relaxed) == self.info.generation
    }

    /// Where `[remote, remote+len)` of the peer lies in our mapping, if inside it.
    fn locate(&self, remote: u64, len: u64) -> Option<*mut u8> {
        let off = remote.checked_sub(self.info.addr)?;
        (off.checked_add(len)? <= self.info.len).then(|| self.ptr.wrapping_add(off as usize))
    }
}

/// Fills the page tables of a new mapping of a peer's buffer from a helper thread, so that
/// copies do not take a minor fault on the first touch of each 4 KiB page (~0.2 s per GiB,
/// paid once per peer buffer). Copies run meanwhile; the thread stops when the mapping is
/// released. Only for buffers whose owner allocated every page up front (`populated`): for
/// the others this would allocate memory the owner has not touched.
fn populate_in_background(m: &Arc<PeerMap>) {
    const STEP: usize = 32 << 20;
    let weak = Arc::downgrade(m);
    let spawned = std::thread::Builder::new().name("kvf-shm-populate".into()).spawn(move || {
        let mut off = 0usize;
        loop {
            // Holding the Arc keeps the range mapped while we advise it.
            let Some(m) = weak.upgrade() else { return };
            let len = m.info.len as usize;
            if off >= len {
                return;
            }
            let n = STEP.min(len - off);
            // SAFETY: a range inside our live mapping; MADV_POPULATE_WRITE (Linux 5.14) only
            // fills page tables (the shared pages already hold the peer's data).
            if unsafe { libc::madvise(m.ptr.add(off) as *mut libc::c_void, n, 23) } != 0 {
                return; // older kernel, or memory pressure: faults happen on demand instead
            }
            off += n;
        }
    });
    if let Err(e) = spawned {
        tracing::debug!("no thread to pre-fault a peer mapping ({e}); pages fault on first use");
    }
}

#[derive(Default)]
struct MapCache {
    /// The descriptor `maps` was computed for.
    desc: Option<Arc<SegmentDesc>>,
    maps: Arc<Vec<Arc<PeerMap>>>,
    /// Buffers that could not be mapped (copied by cross-memory attach instead), and why.
    refused: HashMap<MapInfo, String>,
}

/// Checks in `/proc/<pid>/maps` that `[addr, addr+len)` of the peer is the file
/// `(dev, ino)` mapped shared from its byte 0, so the fd we took is the memory it publishes.
fn verify_mapping(pid: i32, info: &MapInfo, dev: u64, ino: u64) -> Result<(), String> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).map_err(|e| format!("cannot read /proc/{pid}/maps: {e}"))?;
    let end = info.addr.checked_add(info.len).ok_or("the range overflows")?;
    let mut cursor = info.addr;
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms), Some(off), Some(dv), Some(inode)) = (f.next(), f.next(), f.next(), f.next(), f.next()) else { continue };
        let Some((a, b)) = range.split_once('-') else { continue };
        let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else { continue };
        if b <= cursor || a > cursor {
            continue;
        }
        let (Ok(off), Ok(inode)) = (u64::from_str_radix(off, 16), inode.parse::<u64>()) else { break };
        let mm = dv.split_once(':').and_then(|(x, y)| Some((u32::from_str_radix(x, 16).ok()?, u32::from_str_radix(y, 16).ok()?)));
        let same_dev = mm.is_some_and(|(x, y)| libc::makedev(x, y) == dev);
        if a < info.addr || !perms.ends_with('s') || inode != ino || !same_dev || off != a - info.addr {
            return Err(format!("[0x{:x}, +{}) of process {pid} is not the memory of the file descriptor it published (fd {})", info.addr, info.len, info.fd));
        }
        cursor = b;
        if cursor >= end {
            return Ok(());
        }
    }
    Err(format!("[0x{:x}, +{}) is not (wholly) mapped in process {pid}", info.addr, info.len))
}

impl ShmPeer {
    pub fn pid(&self) -> i32 {
        self.pid
    }

    fn exited(&self) -> bool {
        let gone = exited(&self.pidfd);
        if !gone {
            self.alive_at.store(now_ns(), Ordering::Relaxed);
        }
        gone
    }

    /// Like [`ShmPeer::exited`], but trusts an "alive" answer younger than [`ALIVE_FOR_NS`].
    fn exited_lately(&self) -> bool {
        if now_ns().saturating_sub(self.alive_at.load(Ordering::Relaxed)) < ALIVE_FOR_NS {
            return false;
        }
        self.exited()
    }

    /// Verifies a peer and claims a slot in its control region.
    fn attach(info: &ShmInfo, owner: u64, segment: &str) -> Result<ShmPeer, String> {
        let pid = info.pid;
        let pidfd = pidfd_open(pid).map_err(|e| match e.raw_os_error() {
            Some(libc::ESRCH) => format!("process {pid} does not exist (in this PID namespace)"),
            Some(libc::ENOSYS) => "the kernel lacks pidfd_open (Linux 5.3 or newer is needed)".to_string(),
            _ => format!("pidfd_open({pid}) failed: {e}"),
        })?;
        let memfd = pidfd_getfd(&pidfd, info.ctl_fd).map_err(|e| match e.raw_os_error() {
            Some(libc::EPERM) | Some(libc::EACCES) => not_permitted(pid, "taking a file descriptor of", &e),
            Some(libc::ENOSYS) => "the kernel lacks pidfd_getfd (Linux 5.6 or newer is needed)".to_string(),
            _ => format!("cannot take the control region (fd {}) of process {pid}: {e}; its descriptor may be stale", info.ctl_fd),
        })?;
        // SAFETY: fstat into a zeroed struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(memfd.as_raw_fd(), &mut st) } != 0 || (st.st_size as u64) < CTL_LEN as u64 {
            return Err(format!("fd {} of process {pid} is not a kvferry control region", info.ctl_fd));
        }
        // Unsealed, its owner could shrink it while we read it: SIGBUS here.
        match rustix::fs::fcntl_get_seals(&memfd) {
            Ok(s) if s.contains(rustix::fs::SealFlags::SHRINK) => {}
            _ => {
                return Err(format!(
                    "the control region (fd {}) of process {pid} is not sealed against shrinking (mapping it could crash this process); the peer runs an older kvferry or is not a kvferry engine",
                    info.ctl_fd
                ))
            }
        }
        let ctl = CtlMap::map(&memfd).map_err(|e| format!("cannot map the control region of process {pid}: {e}"))?;
        drop(memfd);
        let header = ctl.header();
        if u64::from_le_bytes(header[..8].try_into().unwrap_or_default()) != CTL_MAGIC || ctl.cookie_hex() != info.cookie {
            return Err(format!("process {pid} is not the engine that published this descriptor (cookie differs: the PID was reused or the descriptor is stale)"));
        }
        // The region is written only by its owner: it names the segment that process serves.
        // A descriptor that points at another engine's process (to make us write there) fails.
        let owner_name = ctl.name();
        if owner_name != segment.trim_start_matches('/') && !same_endpoint(&owner_name, segment.trim_start_matches('/')) {
            return Err(format!(
                "process {pid} serves segment {owner_name:?}, not {segment:?} (open the segment by the exact name the peer reports, or its descriptor points at another engine)"
            ));
        }
        // The copy itself must work, both ways: ptrace rules, seccomp, LSMs.
        let mut seen = [0u8; 24];
        let l = [libc::iovec { iov_base: seen.as_mut_ptr() as *mut libc::c_void, iov_len: seen.len() }];
        let r = [libc::iovec { iov_base: info.ctl_addr as *mut libc::c_void, iov_len: seen.len() }];
        match cma(pid, Opcode::Read, &l, &r) {
            Ok(24) if seen == header => {}
            Ok(_) => return Err(format!("process_vm_readv of process {pid} returned other bytes than its control region holds (stale descriptor?)")),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EPERM) | Some(libc::EACCES)) => {
                return Err(not_permitted(pid, "process_vm_readv of", &e))
            }
            Err(e) => return Err(format!("process_vm_readv of process {pid} failed: {e}")),
        }
        let token: u64 = rand::random::<u64>() | 1;
        let tb = token.to_le_bytes();
        let l = [libc::iovec { iov_base: tb.as_ptr() as *mut libc::c_void, iov_len: 8 }];
        let r = [libc::iovec { iov_base: (info.ctl_addr + OFF_PROBE as u64) as *mut libc::c_void, iov_len: 8 }];
        match cma(pid, Opcode::Write, &l, &r) {
            Ok(8) if ctl.word(OFF_PROBE).load(Ordering::SeqCst) == token => {}
            Ok(_) => return Err(format!("process_vm_writev into process {pid} did not land in its control region")),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EPERM) | Some(libc::EACCES)) => {
                return Err(not_permitted(pid, "process_vm_writev into", &e))
            }
            Err(e) => return Err(format!("process_vm_writev into process {pid} failed: {e}")),
        }
        if exited(&pidfd) {
            return Err(format!("process {pid} exited"));
        }
        let slot = claim_slot(&ctl, owner).ok_or_else(|| format!("all {N_SLOTS} initiator slots of process {pid} are taken"))?;
        Ok(ShmPeer {
            pid,
            pidfd,
            alive_at: AtomicU64::new(now_ns()),
            ctl,
            slot,
            owner,
            cookie: info.cookie.clone(),
            maps: Mutex::default(),
            home: std::process::id(),
        })
    }

    /// Whether the peer is gone: its process exited or its engine shut down.
    fn departed(&self) -> bool {
        exited(&self.pidfd) || self.ctl.closed().load(Ordering::Acquire) != 0
    }

    /// Unmaps the peer's buffers (once no copy uses them): all of them, or those their owner
    /// freed. Returns how many mappings were dropped from the cache.
    fn release_maps(&self, all: bool) -> usize {
        let mut c = self.maps.lock().unwrap_or_else(|e| e.into_inner());
        let keep: Vec<Arc<PeerMap>> = if all { Vec::new() } else { c.maps.iter().filter(|m| m.alive()).cloned().collect() };
        let dropped = c.maps.len() - keep.len();
        if dropped > 0 {
            let dead: Vec<MapInfo> = c.maps.iter().filter(|m| !m.alive()).map(|m| m.info).collect();
            for info in dead {
                c.refused.insert(info, "its owner freed it".into());
            }
            c.maps = Arc::new(keep);
        }
        if all {
            c.desc = None;
        }
        dropped
    }

    /// The peer's shareable buffers published in `desc`, mapped here (cached per descriptor;
    /// maps that left the descriptor are released once no copy uses them).
    fn maps_for(&self, desc: &Arc<SegmentDesc>) -> Arc<Vec<Arc<PeerMap>>> {
        let mut c = self.maps.lock().unwrap_or_else(|e| e.into_inner());
        if c.desc.as_ref().is_some_and(|d| Arc::ptr_eq(d, desc)) && c.maps.iter().all(|m| m.alive()) {
            return Arc::clone(&c.maps);
        }
        let listed: Vec<MapInfo> =
            desc.extra.get(FIELD).and_then(|v| v.get("maps")).and_then(|m| serde_json::from_value(m.clone()).ok()).unwrap_or_default();
        let mut maps = Vec::with_capacity(listed.len());
        for info in listed {
            // Keyed on the buffer's identity (inode, generation), not on its fd number and
            // address, which a new buffer of the same size gets again.
            if let Some(m) = c.maps.iter().find(|m| m.info == info) {
                if m.alive() {
                    maps.push(Arc::clone(m));
                } else {
                    c.refused.insert(info, "its owner freed it".into());
                }
                continue;
            }
            if c.refused.contains_key(&info) {
                continue;
            }
            match self.map(&info) {
                Ok(m) => {
                    let m = Arc::new(m);
                    if info.populated {
                        populate_in_background(&m);
                    }
                    maps.push(m);
                }
                Err(r) => {
                    tracing::debug!(pid = self.pid, "not mapping a peer buffer, copying by cross-memory attach: {r}");
                    c.refused.insert(info, r);
                }
            }
        }
        c.desc = Some(Arc::clone(desc));
        c.maps = Arc::new(maps);
        Arc::clone(&c.maps)
    }

    /// Takes a peer's memfd and maps it, after checking that it is the memory the peer maps
    /// at the published address and that it cannot shrink under us.
    fn map(&self, info: &MapInfo) -> Result<PeerMap, String> {
        let pid = self.pid;
        if info.len == 0 || info.len > isize::MAX as u64 || info.addr % 4096 != 0 {
            return Err(format!("published buffer [0x{:x}, +{}) is malformed", info.addr, info.len));
        }
        if info.generation == 0 || info.ino == 0 {
            return Err(format!("published buffer [0x{:x}, +{}) has no identity (an older kvferry)", info.addr, info.len));
        }
        let fd = pidfd_getfd(&self.pidfd, info.fd).map_err(|e| format!("cannot take fd {} of process {pid}: {e}", info.fd))?;
        let stale = |what: &str| {
            format!(
                "fd {} of process {pid} is not the buffer [0x{:x}, +{}) it published ({what}): it freed that buffer, or the descriptor is stale",
                info.fd, info.addr, info.len
            )
        };
        let map_len = crate::hostbuf::header_offset(info.len) + crate::hostbuf::HEADER_LEN;
        let st = rustix::fs::fstat(&fd).map_err(|e| format!("cannot fstat fd {} of process {pid}: {e}", info.fd))?;
        if (st.st_mode & libc::S_IFMT) != libc::S_IFREG || st.st_size as u64 != map_len {
            return Err(stale("not a memory file of the published size"));
        }
        if st.st_ino != info.ino {
            return Err(stale("another inode"));
        }
        let name = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).map_err(|e| format!("cannot read the name of fd {} of process {pid}: {e}", info.fd))?;
        let want = format!("/memfd:{}", crate::hostbuf::memfd_name(info.generation));
        let name = name.to_string_lossy();
        if name != want && !name.starts_with(&format!("{want} ")) {
            return Err(stale("another name, so another generation"));
        }
        match rustix::fs::fcntl_get_seals(&fd) {
            Ok(s) if s.contains(rustix::fs::SealFlags::SHRINK) => {}
            _ => return Err(format!("fd {} of process {pid} is not sealed against shrinking (mapping it could fault)", info.fd)),
        }
        verify_mapping(pid, info, st.st_dev, st.st_ino)?;
        if exited(&self.pidfd) {
            return Err(format!("process {pid} exited"));
        }
        // SAFETY: a shared mapping of a sealed memory file exactly `map_len` long.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), map_len as usize, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            return Err(format!("cannot map fd {} of process {pid}: {}", info.fd, io::Error::last_os_error()));
        }
        dontfork(p as *mut u8, map_len as usize);
        let m = PeerMap { info: *info, ptr: p as *mut u8, map_len: map_len as usize, home: std::process::id() };
        if m.header_word(crate::hostbuf::HDR_MAGIC).load(Ordering::Acquire) != crate::hostbuf::HEADER_MAGIC {
            return Err(stale("no buffer header"));
        }
        if !m.alive() {
            return Err(stale("its owner freed it"));
        }
        Ok(m)
    }
}

/// Whether two `host:port` segment names reach the same listener: same port, and the hosts
/// resolve to a common address (`localhost:1500` and `127.0.0.1:1500`). Only one process
/// listens on an address and port, so a process whose control region names one of them
/// serves the segment opened by the other.
fn same_endpoint(a: &str, b: &str) -> bool {
    use std::net::ToSocketAddrs;
    let resolve = |n: &str| -> Vec<std::net::SocketAddr> { n.to_socket_addrs().map(|i| i.collect()).unwrap_or_default() };
    let (ra, rb) = (resolve(a), resolve(b));
    ra.iter().any(|x| rb.contains(x))
}

fn claim_slot(ctl: &CtlMap, owner: u64) -> Option<usize> {
    for s in 0..N_SLOTS {
        let cur = ctl.owner(s).load(Ordering::SeqCst);
        let free = cur == 0 || (cur != owner && !pid_alive(owner_pid(cur)) && ctl.active(s).load(Ordering::SeqCst) == 0);
        if free && ctl.owner(s).compare_exchange(cur, owner, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            ctl.active(s).store(0, Ordering::SeqCst);
            ctl.word(OFF_HWM).fetch_max(s as u64 + 1, Ordering::SeqCst);
            return Some(s);
        }
    }
    None
}

impl Drop for ShmPeer {
    fn drop(&mut self) {
        if foreign(self.home) {
            return; // a forked child: the slot is the parent's, the mapping is not here
        }
        let _ = self.ctl.owner(self.slot).compare_exchange(self.owner, 0, Ordering::SeqCst, Ordering::SeqCst);
    }
}

// ------------------------------------------------------------------------------------------
// The transport
// ------------------------------------------------------------------------------------------

/// Re-fetches a peer's descriptor (installed by the engine).
pub type Refresh = Box<dyn Fn(&Arc<Peer>) -> Result<(), String> + Send + Sync>;

pub struct ShmOptions {
    /// This engine's segment name, written into its control region.
    pub name: String,
    pub mode: TransportMode,
    /// Worker threads for queued copies (0: the number of CPUs, at most 4).
    pub threads: usize,
    /// How long `unregister` and shutdown wait for copies in flight.
    pub drain: Duration,
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

struct Job {
    shm: Arc<ShmPeer>,
    peer: Arc<Peer>,
    pieces: Vec<Piece>,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    shutdown: bool,
    workers: usize,
}

struct Shared {
    queue: Mutex<Queue>,
    cv: Condvar,
    refresh: OnceLock<Refresh>,
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
/// sleeps in `poll` on every peer's pidfd); an engine shut down in a living process and
/// buffers the peer freed are found by a check this often. A peer found gone by a request
/// earlier is released then.
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
        let tick = rustix::event::Timespec { tv_sec: REAP_INTERVAL.as_secs() as i64, tv_nsec: i64::from(REAP_INTERVAL.subsec_nanos()) };
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
pub struct ShmTransport {
    mode: TransportMode,
    threads: usize,
    drain: Duration,
    local: Option<LocalCtl>,
    /// Why this engine does not offer shared-memory access (when it does not).
    local_reason: Option<String>,
    host_id: Result<String, String>,
    owner: u64,
    shared: Arc<Shared>,
    shut: AtomicBool,
    /// The process that created the transport (see [`foreign`]).
    home: u32,
}

impl ShmTransport {
    pub fn new(opts: ShmOptions) -> ShmTransport {
        let host_id = host_id();
        let (local, local_reason) = match (opts.mode, &host_id) {
            (TransportMode::Tcp, _) => (None, Some("KVFERRY_TRANSPORT=tcp".to_string())),
            (_, Err(e)) => (None, Some(e.clone())),
            (_, Ok(_)) => match LocalCtl::create(&opts.name) {
                Ok(c) => (Some(c), None),
                Err(e) => (None, Some(format!("cannot create the control region (memfd): {e}"))),
            },
        };
        if let Some(r) = &local_reason {
            tracing::debug!("not offering shared-memory access to peers: {r}");
        }
        let threads = if opts.threads == 0 {
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).min(4)
        } else {
            opts.threads
        };
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() } as u64;
        let owner = (pid << 32) | u64::from(rand::random::<u32>() | 1);
        ShmTransport {
            mode: opts.mode,
            threads,
            drain: opts.drain,
            local,
            local_reason,
            host_id,
            owner,
            shared: Arc::new(Shared {
                queue: Mutex::default(),
                cv: Condvar::new(),
                refresh: OnceLock::new(),
                peers: Mutex::default(),
                reaper: AtomicBool::new(false),
                wake: rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK).ok(),
                shut: AtomicBool::new(false),
            }),
            shut: AtomicBool::new(false),
            home: std::process::id(),
        }
    }

    /// Installs the descriptor refresh used when a peer's epoch moved.
    pub fn set_refresh(&self, f: Refresh) {
        let _ = self.shared.refresh.set(f);
    }

    pub fn mode(&self) -> TransportMode {
        self.mode
    }

    /// Why peers cannot reach this engine through shared memory, if they cannot.
    pub fn local_unavailable(&self) -> Option<&str> {
        self.local_reason.as_deref()
    }

    /// What this engine publishes under [`FIELD`], without `maps` (see [`publish`]). Read
    /// it *before* snapshotting the registered ranges: the epoch then never claims a newer
    /// state than the buffer list.
    pub fn offer(&self) -> Option<ShmInfo> {
        let c = self.local.as_ref()?;
        let host_id = self.host_id.as_ref().ok()?;
        let info = ShmInfo {
            version: VERSION,
            host_id: host_id.clone(),
            // SAFETY: getpid/getuid have no preconditions.
            pid: unsafe { libc::getpid() },
            uid: unsafe { libc::getuid() },
            ctl_fd: c.fd.as_raw_fd(),
            ctl_addr: c.map.ptr as u64,
            ctl_len: CTL_LEN as u64,
            cookie: c.map.cookie_hex(),
            epoch: c.map.epoch().load(Ordering::SeqCst),
            maps: Vec::new(),
        };
        Some(info)
    }

    /// Chooses this transport for `peer`, or says why not. Cached per peer and peer cookie.
    pub fn select(&self, peer: &Arc<Peer>) -> Result<Arc<ShmPeer>, String> {
        if self.mode == TransportMode::Tcp {
            return Err("KVFERRY_TRANSPORT=tcp".into());
        }
        if self.shut.load(Ordering::Acquire) {
            return Err("engine shut down".into());
        }
        let mut desc = peer.desc();
        let cookie_of = |d: &SegmentDesc| ShmInfo::cookie_epoch(d).map(|(c, _)| c.to_string());
        let cached = self.shared.peers.lock().unwrap_or_else(|e| e.into_inner()).get(&peer.id).cloned();
        if let Some((c, sel)) = cached {
            if c == cookie_of(&desc) {
                let gone = match &*sel {
                    Selection::Yes(p) if !p.exited_lately() && p.ctl.closed().load(Ordering::Acquire) == 0 => return Ok(Arc::clone(p)),
                    Selection::No(r) => return Err(r.clone()),
                    Selection::Yes(p) => {
                        p.release_maps(true);
                        format!("{}: the engine in process {} is gone", peer.name, p.pid)
                    }
                    Selection::Gone(r) => format!("{}: {r}", peer.name),
                };
                // The engine we verified is gone (process exited or engine dropped): a new
                // one may serve the segment now.
                if let Some(f) = self.shared.refresh.get() {
                    let _ = f(peer);
                }
                desc = peer.desc();
                if c == cookie_of(&desc) {
                    // Forget it: its control region and any of its memory mapped here are
                    // released once no copy uses them.
                    self.shared.peers.lock().unwrap_or_else(|e| e.into_inner()).insert(peer.id, (c, Arc::new(Selection::No(gone.clone()))));
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
        self.shared.peers.lock().unwrap_or_else(|e| e.into_inner()).insert(peer.id, (cookie, Arc::clone(&sel)));
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
        if let Err(e) = std::thread::Builder::new().name("kvf-shm-reaper".into()).spawn(move || reaper(weak)) {
            tracing::warn!("cannot start the thread that releases departed same-host peers ({e}); they are released when a request finds them gone");
            self.shared.reaper.store(false, Ordering::Release);
        }
    }

    /// Releases departed peers now (what the reaper does every [`REAP_INTERVAL`]); returns
    /// how many were released.
    pub fn reap(&self) -> usize {
        self.shared.reap()
    }

    fn choose(&self, info: Option<Result<ShmInfo, String>>, segment: &str) -> Result<ShmPeer, String> {
        let info = info.ok_or_else(|| format!("it publishes no {FIELD} field (a Mooncake engine, or KVFERRY_TRANSPORT=tcp there)"))??;
        let ours = self.host_id.as_ref().map_err(|e| format!("this host's identity is unknown ({e})"))?;
        if info.version != VERSION {
            return Err(format!("it speaks {FIELD} version {}, this engine {VERSION}", info.version));
        }
        if info.host_id != *ours {
            return Err(format!("it runs on another host or in another PID namespace (host id {} vs ours {ours})", info.host_id));
        }
        if info.ctl_len != CTL_LEN as u64 {
            return Err(format!("its control region is {} bytes, expected {CTL_LEN}", info.ctl_len));
        }
        ShmPeer::attach(&info, self.owner, segment)
    }

    /// Queues (or, when small, runs here) pieces for a verified peer.
    pub fn submit_to(&self, peer: &Arc<Peer>, shm: Arc<ShmPeer>, pieces: Vec<Piece>, inline: bool) {
        if self.shut.load(Ordering::Acquire) {
            for p in pieces {
                p.task.piece_failed(FailKind::Failed, FailCause::ShutDown.because("engine shut down"));
            }
            return;
        }
        let total: u64 = pieces.iter().map(|p| p.len).sum();
        if total <= INLINE_BYTES || (inline && pieces.len() == 1 && total <= CHUNK) {
            run_job(&self.shared, Job { shm, peer: Arc::clone(peer), pieces });
            return;
        }
        // Cut large pieces, then gather pieces into jobs of about CHUNK bytes.
        let mut jobs: Vec<Job> = Vec::new();
        let mut cur: Vec<Piece> = Vec::new();
        let mut cur_bytes = 0u64;
        let push = |p: Piece, jobs: &mut Vec<Job>, cur: &mut Vec<Piece>, cur_bytes: &mut u64| {
            if !cur.is_empty() && (*cur_bytes + p.len > CHUNK || cur.len() >= MAX_IOV) {
                jobs.push(Job { shm: Arc::clone(&shm), peer: Arc::clone(peer), pieces: std::mem::take(cur) });
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
                let part = Piece { opcode: p.opcode, local: p.local + off, remote: p.remote + off, len, task: Arc::clone(&p.task), guard: p.guard.clone() };
                push(part, &mut jobs, &mut cur, &mut cur_bytes);
                off += len;
            }
        }
        if !cur.is_empty() {
            jobs.push(Job { shm: Arc::clone(&shm), peer: Arc::clone(peer), pieces: cur });
        }
        let n = jobs.len();
        let mut q = self.shared.queue.lock().unwrap_or_else(|e| e.into_inner());
        if q.shutdown {
            drop(q);
            for j in jobs {
                for p in j.pieces {
                    p.task.piece_failed(FailKind::Failed, FailCause::ShutDown.because("engine shut down"));
                }
            }
            return;
        }
        q.jobs.extend(jobs);
        while q.workers < self.threads {
            let shared = Arc::clone(&self.shared);
            match std::thread::Builder::new().name("kvf-shm".into()).spawn(move || worker(shared)) {
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

fn worker(shared: Arc<Shared>) {
    loop {
        let job = {
            let mut q = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if let Some(j) = q.jobs.pop_front() {
                    break j;
                }
                if q.shutdown {
                    q.workers = q.workers.saturating_sub(1);
                    return;
                }
                q = shared.cv.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        run_job(&shared, job);
    }
}

fn fail_all(pieces: Vec<Piece>, kind: FailKind, cause: FailCause, reason: &str) {
    for p in pieces {
        p.task.piece_failed(kind, cause.because(reason));
    }
}

fn errno_reason(peer: &str, pid: i32, p: &Piece, e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::ESRCH) => format!("{peer}: process {pid} exited"),
        Some(libc::EFAULT) => format!(
            "{peer}: [0x{:x}, +{}) is not mapped in process {pid} (it freed or unmapped memory it still has registered?)",
            p.remote, p.len
        ),
        Some(libc::EPERM) | Some(libc::EACCES) => not_permitted(pid, "access to", e),
        _ => format!("{peer}: cross-memory copy of [0x{:x}, +{}) failed: {e}", p.remote, p.len),
    }
}

/// Copies the pieces of one job: check bounds and epoch, copy, check the peer still lives.
fn run_job(shared: &Shared, job: Job) {
    let Job { shm, peer, mut pieces } = job;
    let now = Instant::now();
    pieces.retain(|p| {
        if now >= p.task.deadline() {
            p.task.piece_failed(FailKind::Timeout, format!("{}: the request waited past its deadline before it could be copied", peer.name));
            false
        } else {
            p.task.set_pending();
            true
        }
    });
    let mut refreshed = 0;
    while !pieces.is_empty() {
        if shm.exited_lately() {
            return fail_all(pieces, FailKind::Failed, FailCause::PeerLost, &format!("{}: process {} exited", peer.name, shm.pid));
        }
        let desc = peer.desc();
        let desc_epoch = match ShmInfo::cookie_epoch(&desc) {
            Some((c, e)) if c == shm.cookie => e,
            _ => return fail_all(pieces, FailKind::Failed, FailCause::PeerLost, &format!("{}: the peer restarted or stopped offering shared memory during the transfer", peer.name)),
        };
        // Bounds: only ranges inside the peer's published buffers.
        pieces.retain(|p| {
            if desc.find_buffer(p.remote, p.len).is_some() {
                true
            } else {
                let e = crate::Error::RemoteNotRegistered { segment: peer.name.clone(), addr: p.remote, len: p.len };
                p.task.piece_failed(FailKind::Failed, &e);
                false
            }
        });
        if pieces.is_empty() {
            return;
        }
        let maps = shm.maps_for(&desc);
        let mapped: Vec<Option<(&PeerMap, *mut u8)>> =
            pieces.iter().map(|p| maps.iter().find_map(|m| m.locate(p.remote, p.len).map(|at| (&**m, at)))).collect();
        let active = shm.ctl.active(shm.slot);
        active.fetch_add(1, Ordering::SeqCst);
        let epoch = shm.ctl.epoch().load(Ordering::SeqCst);
        if epoch != desc_epoch {
            active.fetch_sub(1, Ordering::SeqCst);
            if shm.ctl.closed().load(Ordering::SeqCst) != 0 {
                return fail_all(pieces, FailKind::Failed, FailCause::PeerLost, &format!("{}: the peer engine shut down", peer.name));
            }
            refreshed += 1;
            let r = match (refreshed, shared.refresh.get()) {
                (1..=3, Some(f)) => f(&peer),
                (1..=3, None) => Err("no way to refresh its descriptor".to_string()),
                _ => Err("it keeps unregistering memory".to_string()),
            };
            if let Err(e) = r {
                return fail_all(pieces, FailKind::Failed, FailCause::PeerLost, &format!("{}: its registrations changed and its descriptor cannot be re-read: {e}", peer.name));
            }
            continue;
        }
        let results = copy_all(shm.pid, &pieces, &mapped);
        drop(maps);
        active.fetch_sub(1, Ordering::SeqCst);
        // The PID named the verified process throughout only if it is still alive now.
        let gone = shm.exited();
        for (p, r) in pieces.into_iter().zip(results) {
            match r {
                _ if gone => p.task.piece_failed(FailKind::Failed, FailCause::PeerLost.because(format!("{}: process {} exited during the transfer", peer.name, shm.pid))),
                Ok(()) => {
                    let len = p.len;
                    p.task.piece_done(len);
                }
                Err(e) => {
                    let reason = errno_reason(&peer.name, shm.pid, &p, &e);
                    let cause = match e.raw_os_error() {
                        Some(libc::ESRCH) => FailCause::PeerLost,
                        Some(libc::EFAULT) => FailCause::RemoteNotRegistered,
                        _ => FailCause::Other,
                    };
                    p.task.piece_failed(FailKind::Failed, cause.because(reason));
                }
            }
        }
        return;
    }
}

/// Copies every piece: into or out of the peer's memory mapped here where `mapped` has the
/// address, else by cross-memory attach (runs of the same opcode share one system call).
/// One result per piece.
///
/// A mapped copy counts only if the buffer was alive (not freed by its owner) before and
/// after it; otherwise it is redone by cross-memory attach, which reaches whatever the
/// address holds now (a new buffer there) or fails: never "done" into an orphaned memfd.
fn copy_all(pid: i32, pieces: &[Piece], mapped: &[Option<(&PeerMap, *mut u8)>]) -> Vec<io::Result<()>> {
    let mut out: Vec<io::Result<()>> = Vec::with_capacity(pieces.len());
    let mut mapped: Vec<Option<(&PeerMap, *mut u8)>> = mapped.iter().map(|m| m.filter(|(m, _)| m.alive())).collect();
    let mut i = 0;
    while i < pieces.len() {
        if let Some((m, at)) = mapped[i] {
            let p = &pieces[i];
            // SAFETY: `p.local` lies in memory registered with this engine (its guard is
            // held); `at` lies inside a live shared mapping of the peer's sealed memfd
            // (`PeerMap::locate`), so neither side can fault; the ranges are in different
            // mappings, so they do not overlap.
            unsafe {
                match p.opcode {
                    Opcode::Write => std::ptr::copy_nonoverlapping(p.local as *const u8, at, p.len as usize),
                    Opcode::Read => std::ptr::copy_nonoverlapping(at as *const u8, p.local as *mut u8, p.len as usize),
                }
            }
            // The copy's stores come before the check (the owner clears `alive` before it
            // punches the pages out): alive now means it landed in the live buffer.
            std::sync::atomic::fence(Ordering::SeqCst);
            if !m.alive() {
                mapped[i] = None;
                continue; // redo by cross-memory attach
            }
            MAPPED_BYTES.fetch_add(p.len, Ordering::Relaxed);
            out.push(Ok(()));
            i += 1;
            continue;
        }
        let op = pieces[i].opcode;
        let mut j = i;
        while j < pieces.len() && j - i < MAX_IOV && pieces[j].opcode == op && mapped[j].is_none() {
            j += 1;
        }
        let run = &pieces[i..j];
        let local: Vec<libc::iovec> = run.iter().map(|p| libc::iovec { iov_base: p.local as *mut libc::c_void, iov_len: p.len as usize }).collect();
        let remote: Vec<libc::iovec> = run.iter().map(|p| libc::iovec { iov_base: p.remote as *mut libc::c_void, iov_len: p.len as usize }).collect();
        let total: usize = local.iter().map(|v| v.iov_len).sum();
        match cma(pid, op, &local, &remote) {
            Ok(n) if n == total => {
                CMA_BYTES.fetch_add(n as u64, Ordering::Relaxed);
                out.extend(run.iter().map(|_| Ok(())))
            }
            first => {
                // Partial or failed: the kernel stops at an iovec boundary. Keep the complete
                // prefix and redo the rest one by one to learn each outcome.
                let mut done = first.unwrap_or_default();
                for k in 0..run.len() {
                    let len = local[k].iov_len;
                    if done >= len {
                        done -= len;
                        out.push(Ok(()));
                        continue;
                    }
                    done = 0;
                    out.push(match cma(pid, op, &local[k..=k], &remote[k..=k]) {
                        Ok(n) if n == len => Ok(()),
                        Ok(n) => Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("copied {n} of {len} bytes"))),
                        Err(e) => Err(e),
                    });
                }
            }
        }
        i = j;
    }
    out
}

impl Transport for ShmTransport {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn describe(&self, desc: &mut SegmentDesc) {
        if let Some(v) = self.offer().and_then(|info| publish(info, &desc.buffers)) {
            desc.extra.insert(FIELD.to_string(), v);
        }
    }

    /// Called after a range left the registry: no copy into or out of it may be in flight
    /// once this returns.
    fn on_unregister(&self, region: &crate::memory::Region) {
        let Some(c) = &self.local else { return };
        c.map.epoch().fetch_add(1, Ordering::SeqCst);
        if !c.drain(Instant::now() + self.drain) {
            tracing::warn!(addr = region.addr, "unregister: a peer's shared-memory copy is still in flight after {:?}; range removed anyway", self.drain);
        }
    }

    fn reachable(&self, peer: &Peer) -> Result<(), String> {
        match self.shared.peers.lock().unwrap_or_else(|e| e.into_inner()).get(&peer.id) {
            Some((_, sel)) => match &**sel {
                Selection::Yes(_) => Ok(()),
                Selection::No(r) | Selection::Gone(r) => Err(r.clone()),
            },
            None => Err("not selected yet".into()),
        }
    }

    fn submit(&self, peer: &Arc<Peer>, pieces: Vec<Piece>) {
        match self.select(peer) {
            Ok(shm) => self.submit_to(peer, shm, pieces, false),
            Err(r) => fail_all(pieces, FailKind::Failed, FailCause::PeerUnreachable, &r),
        }
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
            if !c.drain(Instant::now() + self.drain.min(Duration::from_secs(5))) {
                tracing::warn!("shutdown: a peer's shared-memory copy is still in flight");
            }
        }
        let jobs: Vec<Job> = {
            let mut q = self.shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            q.shutdown = true;
            q.jobs.drain(..).collect()
        };
        self.shared.cv.notify_all();
        for j in jobs {
            fail_all(j.pieces, FailKind::Failed, FailCause::ShutDown, "engine shut down");
        }
        self.shared.peers.lock().unwrap_or_else(|e| e.into_inner()).clear();
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
    use super::*;

    #[test]
    fn mode_parses() {
        assert_eq!("AUTO".parse::<TransportMode>(), Ok(TransportMode::Auto));
        assert_eq!(" shm ".parse::<TransportMode>(), Ok(TransportMode::Shm));
        assert!("rdma".parse::<TransportMode>().unwrap_err().contains("auto, tcp or shm"));
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
        c.map.owner(3).store((i32::MAX as u64) << 32 | 1, Ordering::SeqCst);
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
    }
    /// Waits up to 10 s for a forked child; kills it (by pid) and fails if it hangs.
    fn wait_child(pid: i32) -> i32 {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let mut status = 0;
            // SAFETY: waiting for our own child.
            let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if r == pid {
                return status;
            }
            if Instant::now() > until {
                // SAFETY: our own child.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, &mut status, 0);
                }
                panic!("forked child {pid} did not exit within 10 s");
            }
            std::thread::sleep(Duration::from_millis(2));
        }
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
        };
        let owner = (u64::from(std::process::id()) << 32) | 99;
        ShmPeer::attach(&info_of(&c.fd, &c.map), owner, name).expect("the sealed region is accepted");
        // A region that is a valid kvferry control region in every other respect, but
        // unsealed: its owner could truncate it and crash us with SIGBUS. Refused.
        let fd = rustix::fs::memfd_create("kvferry-shm-ctl", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, CTL_LEN as u64).unwrap();
        let map = CtlMap::map(&fd).unwrap();
        for off in [OFF_COOKIE, OFF_COOKIE + 8] {
            map.word(off).store(rand::random(), Ordering::SeqCst);
        }
        // SAFETY: in bounds of the fresh mapping.
        unsafe { std::ptr::copy_nonoverlapping(name.as_ptr(), map.ptr.add(OFF_NAME + 8), name.len()) };
        map.word(OFF_NAME).store(name.len() as u64, Ordering::SeqCst);
        map.word(OFF_MAGIC).store(CTL_MAGIC, Ordering::SeqCst);
        let e = ShmPeer::attach(&info_of(&fd, &map), owner, name).err().expect("an unsealed control region is refused");
        assert!(e.contains("not sealed"), "{e}");
    }

    #[test]
    fn a_forked_child_dropping_the_transport_leaves_the_parents_region_alone() {
        let name = "127.0.0.1:15078";
        let t = ShmTransport::new(ShmOptions { name: name.into(), mode: TransportMode::Auto, threads: 1, drain: Duration::from_secs(1) });
        let info = t.offer().unwrap();
        let owner = (u64::from(std::process::id()) << 32) | 5;
        let peer = ShmPeer::attach(&info, owner, name).unwrap();
        let slot = peer.slot;
        let c = t.local.as_ref().unwrap();
        let epoch = c.map.epoch().load(Ordering::SeqCst);
        // SAFETY: the child only drops values (closing descriptors) and calls _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            t.shutdown();
            drop(t);
            drop(peer);
            // SAFETY: ends the child without running the parent's exit handlers.
            unsafe { libc::_exit(0) }
        }
        let status = wait_child(pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child crashed: status {status:#x}");
        assert_eq!(c.map.closed().load(Ordering::SeqCst), 0, "the child marked the parent's region closed");
        assert_eq!(c.map.epoch().load(Ordering::SeqCst), epoch, "the child moved the parent's epoch");
        assert_eq!(c.map.owner(slot).load(Ordering::SeqCst), owner, "the child released the parent's slot");
        // The parent's transport still works: a new initiator attaches.
        ShmPeer::attach(&t.offer().unwrap(), owner + 2, name).expect("the parent still serves");
        drop(peer);
        assert_eq!(c.map.owner(slot).load(Ordering::SeqCst), 0, "the parent's own drop releases the slot");
        t.shutdown();
        assert_eq!(c.map.closed().load(Ordering::SeqCst), 1);
    }
}

