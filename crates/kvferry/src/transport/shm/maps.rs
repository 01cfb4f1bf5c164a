//! A peer's shareable buffers mapped here: identity checks, the per-peer cache, liveness.

use super::attach::ShmPeer;
use super::cma::*;
use super::{MapInfo, FIELD};
use crate::sys::mem::Mapping;
use crate::wire::descriptor::SegmentDesc;
use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A peer's shareable buffer mapped into this process: its data and, after it, its header
/// page (see [`crate::hostbuf`]).
pub(super) struct PeerMap {
    pub(super) info: MapInfo,
    pub(super) ptr: *mut u8,
    /// The whole mapping `ptr` starts (data rounded up to pages, plus the header page),
    /// unmapped as this value drops.
    map: Mapping,
    /// The process that mapped it.
    pub(super) home: u32,
    /// One bit per [`CHUNK`] of the data: its page tables were filled here, or are being
    /// filled ahead ([`PeerMap::prefault`]).
    pub(super) faulted: Box<[AtomicU64]>,
    /// One bit per [`CHUNK`]: a copy touched it.
    pub(super) touched: Box<[AtomicU64]>,
}

/// Page tables of a peer's buffer mapped here are filled a chunk at a time, the first time a
/// copy of at least [`PREFAULT_MIN`] bytes touches the chunk; smaller copies take the page
/// faults of the pages they touch. Copies that move forward through the buffer (a copy whose
/// first chunk follows one an earlier copy touched: a store filling fresh space, a stream of
/// KV blocks) have the next [`AHEAD`] chunks filled ahead of them by a helper thread, so the
/// stream does not pay the faults itself (where a core is free). Either way the cost (time
/// and page tables: 8 bytes per 4 KiB page) is proportional to what this process touches
/// (plus at most [`AHEAD`] chunks per stream), plus what the helper fills in the background
/// (buffers their owner allocated whole, within the engine's budget: see [`filler`]), never
/// to the peer's whole buffer, however large its segment.
pub(super) const CHUNK: usize = 2 << 20;
pub(super) const PREFAULT_MIN: u64 = 256 << 10;
/// Chunks filled ahead of a forward-moving stream of copies (16 MiB).
pub(super) const AHEAD: usize = 8;

/// Chunk `c`'s bit in a chunk bitmap: whether it is set (false past the end).
fn is_set(map: &[AtomicU64], c: usize) -> bool {
    map.get(c / 64)
        .is_some_and(|w| w.load(Ordering::Relaxed) & (1u64 << (c % 64)) != 0)
}

/// Sets chunk `c`'s bit; whether this call set it (false if it was set, or past the end).
/// Reads first: on the copy path the bit is nearly always set already, and a plain load
/// leaves the cache line shared between the copying threads.
fn claim(map: &[AtomicU64], c: usize) -> bool {
    let b = 1u64 << (c % 64);
    map.get(c / 64).is_some_and(|w| {
        w.load(Ordering::Relaxed) & b == 0 && w.fetch_or(b, Ordering::Relaxed) & b == 0
    })
}

/// Clears chunk `c`'s bit.
fn unclaim(map: &[AtomicU64], c: usize) {
    if let Some(w) = map.get(c / 64) {
        w.fetch_and(!(1u64 << (c % 64)), Ordering::Relaxed);
    }
}

/// Two helper threads per process fill page tables off the copies' path, each started on
/// first use and fed through a bounded queue:
/// - `kvf-shm-ahead` fills **ahead** of forward-moving copies: the chunks asked for, at once
///   (a full queue refuses the request: the copies then fill those chunks themselves);
/// - `kvf-shm-fill` fills, in the **background**, buffers mapped here whose owner allocated
///   every page (store segments): from [`BACKGROUND_AFTER`] after they were mapped, [`SLICE`]
///   chunks at a time, then idle [`IDLE_FACTOR`] times as long as the slice took (at most a
///   quarter of a core), up to a budget of bytes per engine ([`Budget`],
///   `Config::shm_background_fill`; a departed buffer's bytes return to it), skipping chunks
///   a copy already filled. It runs as `SCHED_IDLE`: the kernel gives it only CPU nothing
///   else wants, so it never slows the copies or the application (at normal priority, even
///   1/32 of a core cost the 2-vCPU VM's engine bench 13% on the point it overlapped,
///   BENCHMARKS "Background fill"). So a first copy into a range of a peer's segment does
///   not fault page by page, while the page tables stay bounded by the budget (8 bytes per
///   4 KiB page) whatever the peers' segments add up to.
///
/// Both hold a mapping only while advising it (upgrading a `Weak`), so they never keep a
/// departed peer's memory mapped, and skip buffers their owner freed.
pub(super) mod filler {
    use super::{claim, PeerMap, CHUNK};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
    use std::sync::{Arc, Mutex, Weak};
    use std::time::{Duration, Instant};

    /// A buffer is filled in the background from this long after it was mapped.
    const BACKGROUND_AFTER: Duration = Duration::from_secs(2);
    /// After each slice the helper idles this many times as long as the slice took.
    const IDLE_FACTOR: u32 = 3;
    /// Chunks filled in one background slice (16 MiB: ~1.3 ms on the 2-vCPU VM).
    const SLICE: usize = 8;
    /// How often buffers waiting for budget, or filled, are checked for departure.
    const RECHECK: Duration = Duration::from_secs(1);

    /// An engine's bytes of peers' buffers to fill in the background, and how many are.
    #[derive(Debug)]
    pub(in crate::transport::shm) struct Budget {
        limit: u64,
        used: AtomicU64,
    }

    impl Budget {
        /// `None` for a limit of 0 (no background filling).
        pub(in crate::transport::shm) fn new(limit: u64) -> Option<Arc<Budget>> {
            (limit > 0).then(|| {
                Arc::new(Budget {
                    limit,
                    used: AtomicU64::new(0),
                })
            })
        }

        /// Takes a chunk's bytes if they fit (the engine's other buffers may take them
        /// between [`Budget::fits`] and this).
        fn take(&self) -> bool {
            self.used
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                    (u + CHUNK as u64 <= self.limit).then_some(u + CHUNK as u64)
                })
                .is_ok()
        }

        fn fits(&self) -> bool {
            self.used.load(Ordering::Relaxed) + CHUNK as u64 <= self.limit
        }

        fn give_back(&self, bytes: u64) {
            self.used.fetch_sub(bytes, Ordering::Relaxed);
        }
    }

    type AheadJob = (Weak<PeerMap>, Vec<usize>);
    /// A buffer to fill, its length in chunks, and the budget of the engine that mapped it.
    type BackgroundJob = (Weak<PeerMap>, usize, Arc<Budget>);
    type Queue<J> = Mutex<Option<(u32, SyncSender<J>)>>;

    /// The two threads' queues, each with the process that started its thread (a forked
    /// child starts its own).
    static AHEAD: Queue<AheadJob> = Mutex::new(None);
    static BACKGROUND: Queue<BackgroundJob> = Mutex::new(None);

    /// Queues `job` for the thread behind `q`, started (as `name`, running `run`) on first use.
    /// Never waits for the queue's lock: a `fork()` child whose parent held it at the fork
    /// would wait forever, and anywhere else the job is only help (refused, the copies fill
    /// the chunks themselves).
    fn send<J: Send + 'static>(
        q: &Queue<J>,
        name: &str,
        run: fn(Receiver<J>),
        job: J,
    ) -> Result<(), J> {
        let mut q = match q.try_lock() {
            Ok(q) => q,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return Err(job),
        };
        let me = std::process::id();
        if q.as_ref().is_none_or(|(pid, _)| *pid != me) {
            let (tx, rx) = sync_channel::<J>(256);
            if let Err(e) = std::thread::Builder::new()
                .name(name.into())
                .spawn(move || run(rx))
            {
                tracing::debug!("no thread to fill peer mappings off the copies' path ({e})");
                return Err(job);
            }
            *q = Some((me, tx));
        }
        let Some((_, tx)) = q.as_ref() else {
            return Err(job);
        };
        tx.try_send(job).map_err(|e| match e {
            TrySendError::Full(j) | TrySendError::Disconnected(j) => j,
        })
    }

    /// Asks for `chunks` of `m` to be filled now; gives them back when that cannot be queued.
    pub(super) fn ahead(m: Weak<PeerMap>, chunks: Vec<usize>) -> Result<(), Vec<usize>> {
        send(&AHEAD, "kvf-shm-ahead", run_ahead, (m, chunks)).map_err(|(_, c)| c)
    }

    /// Has `m` (a buffer its owner allocated whole) filled in the background, within
    /// `budget`. Not queued (the queue is full): it is filled by the copies.
    pub(super) fn background(m: &Arc<PeerMap>, budget: &Arc<Budget>) {
        let chunks = (m.info.len as usize).div_ceil(CHUNK);
        let _ = send(
            &BACKGROUND,
            "kvf-shm-fill",
            run_background,
            (Arc::downgrade(m), chunks, Arc::clone(budget)),
        );
    }

    struct Candidate {
        map: Weak<PeerMap>,
        /// Its length in chunks.
        chunks: usize,
        budget: Arc<Budget>,
        from: Instant,
        /// The next chunk to look at (`chunks`: all done).
        next: usize,
        /// Bytes this thread filled in it (returned to the budget when it goes).
        filled: u64,
        /// Time spent filling it.
        busy: Duration,
    }

    fn run_ahead(rx: Receiver<AheadJob>) {
        while let Ok((weak, chunks)) = rx.recv() {
            for c in chunks {
                let Some(m) = weak.upgrade() else { break };
                if !m.alive() {
                    break;
                }
                m.fill(c);
            }
        }
    }

    fn run_background(rx: Receiver<BackgroundJob>) {
        // The kernel runs this thread only on a core nothing else wants (SCHED_IDLE): the
        // fill never takes CPU from the copies, the application or its peers. Lowering one's
        // own policy needs no privilege.
        if let Err(e) = crate::sys::proc::sched_idle() {
            tracing::debug!(
                "the background fill runs at normal priority: sched_setscheduler(SCHED_IDLE): {e}"
            );
        }
        let mut list: Vec<Candidate> = Vec::new();
        let mut due = Instant::now();
        loop {
            let job = if list.is_empty() {
                match rx.recv() {
                    Ok(j) => Some(j),
                    Err(_) => return,
                }
            } else {
                match rx.recv_timeout(due.saturating_duration_since(Instant::now())) {
                    Ok(j) => Some(j),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            };
            match job {
                Some((map, chunks, budget)) => {
                    list.push(Candidate {
                        map,
                        chunks,
                        budget,
                        from: Instant::now() + BACKGROUND_AFTER,
                        next: 0,
                        filled: 0,
                        busy: Duration::ZERO,
                    });
                }
                None => due = slice(&mut list),
            }
        }
    }

    /// One background slice; returns when the next is due.
    fn slice(list: &mut Vec<Candidate>) -> Instant {
        // Buffers unmapped or freed meanwhile leave, and their bytes return to the budget.
        list.retain(|c| {
            let keep = c.map.upgrade().is_some_and(|m| m.alive());
            if !keep {
                c.budget.give_back(c.filled);
            }
            keep
        });
        let now = Instant::now();
        let Some(c) = list
            .iter_mut()
            .find(|c| c.from <= now && c.next < c.chunks && c.budget.fits())
        else {
            let first = list
                .iter()
                .filter(|c| c.next < c.chunks)
                .map(|c| c.from)
                .min();
            return first
                .filter(|&f| f > now)
                .unwrap_or(now + RECHECK)
                .min(now + RECHECK);
        };
        let Some(m) = c.map.upgrade() else { return now };
        let mut n = 0;
        while n < SLICE && c.next < c.chunks {
            if claim(&m.faulted, c.next) {
                if !c.budget.take() {
                    super::unclaim(&m.faulted, c.next);
                    break;
                }
                m.fill(c.next);
                c.filled += CHUNK as u64;
                n += 1;
            }
            c.next += 1;
        }
        let took = now.elapsed();
        c.busy += took;
        if c.next >= c.chunks {
            tracing::debug!(
                bytes = c.filled,
                busy_ms = c.busy.as_millis() as u64,
                "filled a peer's buffer in the background"
            );
        }
        Instant::now() + took * IDLE_FACTOR
    }
}

/// The chunk bitmap of a buffer of `len` bytes.
pub(super) fn chunk_bits(len: u64) -> Box<[AtomicU64]> {
    (0..(len as usize).div_ceil(CHUNK).div_ceil(64))
        .map(|_| AtomicU64::new(0))
        .collect()
}

// SAFETY: a shared mapping owned by this value; bytes are copied in and out only under the
// same in-flight/epoch protocol as cross-memory copies.
unsafe impl Send for PeerMap {}
unsafe impl Sync for PeerMap {}

impl Drop for PeerMap {
    fn drop(&mut self) {
        if foreign(self.home) {
            self.map.disown(); // a forked child does not have the mapping (MADV_DONTFORK)
        }
        // Else the mapping is unmapped as `map` drops: no job holds this value any more.
    }
}

impl PeerMap {
    pub(super) fn header_word(&self, i: usize) -> &AtomicU64 {
        // SAFETY: the header page lies inside our mapping (checked in `ShmPeer::map`),
        // page-aligned; shared memory accessed only atomically.
        unsafe {
            &*(self
                .ptr
                .add(crate::hostbuf::header_offset(self.info.len) as usize)
                as *const AtomicU64)
                .add(i)
        }
    }

    /// Whether the buffer is still the live one its owner published: a freed buffer's
    /// header says so before its pages are released (and its memory may be reused at the
    /// same address by a new buffer, which this mapping does not reach).
    pub(super) fn alive(&self) -> bool {
        self.header_word(crate::hostbuf::HDR_ALIVE)
            .load(Ordering::SeqCst)
            == 1
            && self
                .header_word(crate::hostbuf::HDR_GENERATION)
                .load(Ordering::Relaxed)
                == self.info.generation
    }

    /// Before a copy of `len` bytes at `at` (inside our mapping): fills the page tables of
    /// the chunks it touches that no earlier copy filled, in one call per chunk
    /// (`MADV_POPULATE_READ`, Linux 5.14; on older kernels pages fault one by one), so a
    /// large copy does not take a fault per 4 KiB page (small copies skip it); and when the
    /// copy continues a forward stream, asks the helper thread to fill the next [`AHEAD`]
    /// chunks (only in buffers whose owner allocated every page: elsewhere that would
    /// allocate memory the owner never touched).
    pub(super) fn prefault(self: &Arc<Self>, at: *mut u8, len: u64) {
        if len == 0 {
            return;
        }
        let off = at as usize - self.ptr as usize;
        let (first, last) = (off / CHUNK, (off + len as usize - 1) / CHUNK);
        // Sequential: the chunk before this copy's first one was touched by an earlier copy.
        let stream = first > 0 && is_set(&self.touched, first - 1);
        for c in first..=last {
            claim(&self.touched, c);
        }
        if len >= PREFAULT_MIN {
            for c in (first..=last).filter(|&c| claim(&self.faulted, c)) {
                self.fill(c);
            }
        }
        if stream && self.info.populated {
            let chunks = (self.info.len as usize).div_ceil(CHUNK);
            // Empty (no allocation) once the stream's chunks are all claimed.
            let ahead: Vec<usize> = (first..=(last + AHEAD).min(chunks - 1))
                .filter(|&c| claim(&self.faulted, c))
                .collect();
            if !ahead.is_empty() {
                if let Err(back) = filler::ahead(Arc::downgrade(self), ahead) {
                    // No helper: those chunks are filled by the copies that reach them.
                    for c in back {
                        unclaim(&self.faulted, c);
                    }
                }
            }
        }
    }

    /// Fills the page tables of chunk `c`.
    fn fill(&self, c: usize) {
        let data = self.info.len as usize;
        let start = c * CHUNK;
        if start >= data {
            return;
        }
        // Populating only fills page tables of the shared pages. A failure (older kernel,
        // memory pressure) only means the pages fault one by one.
        //
        // A read fault of a shared mapping maps up to 16 neighbouring pages at once (fault
        // around) and, shared memory keeping no dirty accounting, maps them writable: filling
        // 512 MiB this way takes 36-43 ms on the 2-vCPU VM against 99-127 ms with
        // POPULATE_WRITE (a fault per page) and 157-187 ms of faults in the copy itself, and the copy after it runs
        // at full speed either way (`examples/shm_populate.rs`).
        let _ = self.map.populate_read(start, CHUNK.min(data - start));
    }

    /// Where `[remote, remote+len)` of the peer lies in our mapping, if inside it.
    pub(super) fn locate(&self, remote: u64, len: u64) -> Option<*mut u8> {
        let off = remote.checked_sub(self.info.addr)?;
        (off.checked_add(len)? <= self.info.len).then(|| self.ptr.wrapping_add(off as usize))
    }
}

#[derive(Default)]
pub(super) struct MapCache {
    /// The descriptor `maps` was computed for.
    pub(super) desc: Option<Arc<SegmentDesc>>,
    pub(super) maps: Arc<Vec<Arc<PeerMap>>>,
    /// Buffers that could not be mapped (copied by cross-memory attach instead), and why.
    pub(super) refused: HashMap<MapInfo, String>,
}

/// Checks in `/proc/<pid>/maps` that `[addr, addr+len)` of the peer is the file
/// `(dev, ino)` mapped shared from its byte 0, so the fd we took is the memory it publishes.
pub(super) fn verify_mapping(pid: i32, info: &MapInfo, dev: u64, ino: u64) -> Result<(), String> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map_err(|e| format!("cannot read /proc/{pid}/maps: {e}"))?;
    let end = info
        .addr
        .checked_add(info.len)
        .ok_or("the range overflows")?;
    let mut cursor = info.addr;
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms), Some(off), Some(dv), Some(inode)) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            continue;
        };
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
            continue;
        };
        if b <= cursor || a > cursor {
            continue;
        }
        let (Ok(off), Ok(inode)) = (u64::from_str_radix(off, 16), inode.parse::<u64>()) else {
            break;
        };
        let mm = dv.split_once(':').and_then(|(x, y)| {
            Some((
                u32::from_str_radix(x, 16).ok()?,
                u32::from_str_radix(y, 16).ok()?,
            ))
        });
        let same_dev = mm.is_some_and(|(x, y)| rustix::fs::makedev(x, y) == dev);
        if a < info.addr
            || !perms.ends_with('s')
            || inode != ino
            || !same_dev
            || off != a - info.addr
        {
            return Err(format!("[0x{:x}, +{}) of process {pid} is not the memory of the file descriptor it published (fd {})", info.addr, info.len, info.fd));
        }
        cursor = b;
        if cursor >= end {
            return Ok(());
        }
    }
    Err(format!(
        "[0x{:x}, +{}) is not (wholly) mapped in process {pid}",
        info.addr, info.len
    ))
}

impl ShmPeer {
    /// Unmaps the peer's buffers (once no copy uses them): all of them, or those their owner
    /// freed. Returns how many mappings were dropped from the cache.
    pub(super) fn release_maps(&self, all: bool) -> usize {
        let mut c = self.maps.lock().unwrap_or_else(|e| e.into_inner());
        let keep: Vec<Arc<PeerMap>> = if all {
            Vec::new()
        } else {
            c.maps.iter().filter(|m| m.alive()).cloned().collect()
        };
        let dropped = c.maps.len() - keep.len();
        if dropped > 0 {
            let dead: Vec<MapInfo> = c
                .maps
                .iter()
                .filter(|m| !m.alive())
                .map(|m| m.info)
                .collect();
            for info in dead {
                c.refused.insert(info, "its owner freed it".into());
            }
            c.maps = Arc::new(keep);
        }
        if all {
            c.desc = None;
            // Its GPU memory opened here is closed too (once no copy holds it).
            self.gpu.clear();
        }
        dropped
    }

    /// The peer's shareable buffers published in `desc`, mapped here (cached per descriptor;
    /// maps that left the descriptor are released once no copy uses them).
    pub(super) fn maps_for(&self, desc: &Arc<SegmentDesc>) -> Arc<Vec<Arc<PeerMap>>> {
        let mut c = self.maps.lock().unwrap_or_else(|e| e.into_inner());
        if c.desc.as_ref().is_some_and(|d| Arc::ptr_eq(d, desc)) && c.maps.iter().all(|m| m.alive())
        {
            return Arc::clone(&c.maps);
        }
        let listed: Vec<MapInfo> = desc
            .extra
            .get(FIELD)
            .and_then(|v| v.get("maps"))
            .and_then(|m| serde_json::from_value(m.clone()).ok())
            .unwrap_or_default();
        let mut maps = Vec::with_capacity(listed.len());
        // Refusals of buffers the descriptor no longer lists are forgotten: the table stays
        // as small as the peer's buffer list.
        c.refused.retain(|k, _| listed.contains(k));
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
                    if let Some(b) = self.background_fill.as_ref().filter(|_| m.info.populated) {
                        filler::background(&m, b);
                    }
                    maps.push(m);
                }
                Err(r) => {
                    tracing::debug!(
                        pid = self.pid,
                        "not mapping a peer buffer, copying by cross-memory attach: {r}"
                    );
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
    pub(super) fn map(&self, info: &MapInfo) -> Result<PeerMap, String> {
        let pid = self.pid;
        if info.len == 0 || info.len > isize::MAX as u64 || info.addr % 4096 != 0 {
            return Err(format!(
                "published buffer [0x{:x}, +{}) is malformed",
                info.addr, info.len
            ));
        }
        if info.generation == 0 || info.ino == 0 {
            return Err(format!(
                "published buffer [0x{:x}, +{}) has no identity (an older kvferry)",
                info.addr, info.len
            ));
        }
        let fd = pidfd_getfd(&self.pidfd, info.fd)
            .map_err(|e| format!("cannot take fd {} of process {pid}: {e}", info.fd))?;
        let stale = |what: &str| {
            format!(
                "fd {} of process {pid} is not the buffer [0x{:x}, +{}) it published ({what}): it freed that buffer, or the descriptor is stale",
                info.fd, info.addr, info.len
            )
        };
        let map_len = crate::hostbuf::header_offset(info.len) + crate::hostbuf::HEADER_LEN;
        let st = rustix::fs::fstat(&fd)
            .map_err(|e| format!("cannot fstat fd {} of process {pid}: {e}", info.fd))?;
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile
            || st.st_size as u64 != map_len
        {
            return Err(stale("not a memory file of the published size"));
        }
        if st.st_ino != info.ino {
            return Err(stale("another inode"));
        }
        let name =
            std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).map_err(|e| {
                format!(
                    "cannot read the name of fd {} of process {pid}: {e}",
                    info.fd
                )
            })?;
        let want = format!("/memfd:{}", crate::hostbuf::memfd_name(info.generation));
        let name = name.to_string_lossy();
        if name != want && !name.starts_with(&format!("{want} ")) {
            return Err(stale("another name, so another generation"));
        }
        match rustix::fs::fcntl_get_seals(&fd) {
            Ok(s) if s.contains(rustix::fs::SealFlags::SHRINK) => {}
            _ => {
                return Err(format!(
                "fd {} of process {pid} is not sealed against shrinking (mapping it could fault)",
                info.fd
            ))
            }
        }
        verify_mapping(pid, info, st.st_dev, st.st_ino)?;
        if exited(&self.pidfd) {
            return Err(format!("process {pid} exited"));
        }
        // A sealed memory file exactly `map_len` long: it cannot shrink under the mapping.
        let map = Mapping::shared(&fd, map_len as usize, 0)
            .map_err(|e| format!("cannot map fd {} of process {pid}: {e}", info.fd))?;
        if let Err(e) = map.dontfork() {
            tracing::debug!("madvise(MADV_DONTFORK) failed: {e}");
        }
        let m = PeerMap {
            info: *info,
            ptr: map.as_ptr(),
            map,
            home: std::process::id(),
            faulted: chunk_bits(info.len),
            touched: chunk_bits(info.len),
        };
        if m.header_word(crate::hostbuf::HDR_MAGIC)
            .load(Ordering::Acquire)
            != crate::hostbuf::HEADER_MAGIC
        {
            return Err(stale("no buffer header"));
        }
        if !m.alive() {
            return Err(stale("its owner freed it"));
        }
        Ok(m)
    }
}
