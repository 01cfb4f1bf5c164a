//! Page-aligned host memory owned by kvferry (managed buffers, store segments, benches).
//!
//! A buffer is **shareable** by default: backed by a sealed memfd mapped shared, so that a
//! same-host peer engine can map the same pages and copy with a plain `memcpy` (no system
//! call, no page pinning; see `crate::transport::shm`). Every live shareable buffer is
//! listed in a process-wide table that the engine consults when it publishes its descriptor;
//! [`shareable_region`] answers whether a registered range lies inside one. Where memfd is
//! unavailable the buffer is an ordinary anonymous mapping and peers reach it by
//! cross-memory attach instead.
//!
//! The memfd is sealed against shrinking and growing (a peer that mapped it can never fault
//! past its end), and dropping the buffer punches out its pages before closing it, so its
//! memory is returned at once even while a peer still has it mapped.
//!
//! **Identity.** A process that frees a buffer and allocates one of the same size usually
//! gets the same address and the same fd number back, so neither names a buffer. Each
//! shareable buffer has a random, non-zero 64-bit **generation**, written into the memfd's
//! name (`memfd:kvferry-buffer:<generation as 16 hex digits>`) and into a **header page**
//! stored in the memfd after the data (at `header_offset`): a magic, the generation and an
//! `alive` word. A peer that maps the buffer checks the inode, the name and the header
//! against what the owner published; dropping the buffer clears `alive` (before punching
//! out the pages), so a peer still holding a mapping of a freed buffer sees that it is dead
//! and never reports a copy into it as done (`crate::transport::shm` redoes such a copy by
//! cross-memory attach, which reaches whatever the address holds now, or fails).
//!
//! **fork().** The mappings are marked `MADV_DONTFORK`: a child process does not inherit
//! them. A buffer remembers the process that created it; dropped in any other process (the
//! child's copy of the value) it only closes its file descriptor: no hole punched into the
//! parent's memfd, no `alive` cleared, no `munmap` of a range that in the child is not this
//! buffer's, no change to the (child's copy of the) table.

use crate::sys::mem::{page_size, punch_hole, Mapping};
use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

/// How to allocate a [`HostBuffer`].
#[derive(Debug, Clone, Copy)]
pub struct HostOptions {
    /// Pre-fault every page now (slower to create, no faults later).
    pub populate: bool,
    /// Ask for transparent huge pages (`MADV_HUGEPAGE`, 2 MiB alignment) before the first
    /// touch. For shareable buffers this takes effect only where the host enables THP for
    /// shared memory (`/sys/kernel/mm/transparent_hugepage/shmem_enabled`).
    pub huge_pages: bool,
    /// Back the buffer with a memfd that same-host peers can map (falls back to anonymous
    /// memory when memfd is unavailable).
    pub shareable: bool,
}

impl Default for HostOptions {
    fn default() -> Self {
        HostOptions {
            populate: true,
            huge_pages: false,
            shareable: true,
        }
    }
}

/// A shareable buffer as listed in the process-wide table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedRegion {
    /// Start of the mapping in this process.
    pub addr: u64,
    pub len: u64,
    /// The memfd (owned by the [`HostBuffer`]; valid while the buffer lives).
    pub fd: RawFd,
    /// Every page was allocated at creation ([`HostOptions::populate`]).
    pub populated: bool,
    /// The memfd's inode number (`fstat`).
    pub ino: u64,
    /// The buffer's random generation (never 0; see the module docs).
    pub generation: u64,
    /// The process that created the buffer (entries inherited by a forked child are not
    /// its buffers and are ignored there).
    pub pid: u32,
}

static SHARED: RwLock<BTreeMap<u64, SharedRegion>> = RwLock::new(BTreeMap::new());

/// The shareable buffer of this process that contains `[addr, addr+len)`, if any.
pub fn shareable_region(addr: u64, len: u64) -> Option<SharedRegion> {
    let t = SHARED.read().unwrap_or_else(|e| e.into_inner());
    let (_, r) = t.range(..=addr).next_back()?;
    let end = addr.checked_add(len)?;
    (end <= r.addr + r.len && r.pid == std::process::id()).then_some(*r)
}

const HUGE: usize = 2 << 20;
const PAGE: u64 = 4096;

/// Size of the header page stored after a shareable buffer's data in its memfd.
pub(crate) const HEADER_LEN: u64 = PAGE;
/// First word of the header page.
pub(crate) const HEADER_MAGIC: u64 = u64::from_le_bytes(*b"KVFBUF01");
/// Word indices in the header page: magic, generation, alive (1 while the buffer lives).
pub(crate) const HDR_MAGIC: usize = 0;
pub(crate) const HDR_GENERATION: usize = 1;
pub(crate) const HDR_ALIVE: usize = 2;

/// Where the header page of a shareable buffer of `len` bytes lies in its memfd (the data
/// rounded up to whole pages); the memfd is `header_offset(len) + HEADER_LEN` bytes long.
pub(crate) fn header_offset(len: u64) -> u64 {
    len.div_ceil(PAGE) * PAGE
}

/// The memfd name of a buffer of this generation, as `/proc/<pid>/fd/<n>` shows it after
/// the `/memfd:` prefix.
pub(crate) fn memfd_name(generation: u64) -> String {
    format!("kvferry-buffer:{generation:016x}")
}

/// A page-aligned mapping, zero-filled, unmapped on drop.
pub struct HostBuffer {
    ptr: *mut u8,
    len: usize,
    /// The whole reservation (larger than `len` when aligned for huge pages); the memfd's
    /// mapping lies inside it.
    map: Mapping,
    fd: Option<OwnedFd>,
    /// The header page, mapped shared (shareable buffers only).
    header: Option<Mapping>,
    generation: u64,
    /// The process that created the buffer: only it may punch, mark or unmap.
    pid: u32,
    /// The mappings are `MADV_DONTFORK`: a forked child has none of them.
    dontfork: bool,
}

// SAFETY: plain memory owned by this value; callers coordinate concurrent access through
// the engine (transfers) or their own synchronisation.
unsafe impl Send for HostBuffer {}
unsafe impl Sync for HostBuffer {}

fn memfd(len: usize, generation: u64) -> io::Result<OwnedFd> {
    use rustix::fs::{MemfdFlags, SealFlags};
    let fd = rustix::fs::memfd_create(
        memfd_name(generation),
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )?;
    let size = header_offset(len as u64)
        .checked_add(HEADER_LEN)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "size too large"))?;
    rustix::fs::ftruncate(&fd, size)?;
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
    Ok(fd)
}

impl HostBuffer {
    /// A shareable buffer of `len` bytes; `populate` pre-faults the pages.
    pub fn new(len: usize, populate: bool) -> io::Result<HostBuffer> {
        HostBuffer::with(
            len,
            HostOptions {
                populate,
                ..HostOptions::default()
            },
        )
    }

    /// A buffer allocated as `opts` say.
    pub fn with(len: usize, opts: HostOptions) -> io::Result<HostBuffer> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a buffer needs at least 1 byte",
            ));
        }
        if len > isize::MAX as usize - HUGE - PAGE as usize {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{len} bytes is larger than a mapping can be"),
            ));
        }
        let generation = rand::random::<u64>() | 1;
        let fd = if opts.shareable {
            match memfd(len, generation) {
                Ok(fd) => Some(fd),
                Err(e) => {
                    tracing::debug!("memfd unavailable ({e}); allocating anonymous memory, which same-host peers reach by cross-memory attach");
                    None
                }
            }
        } else {
            None
        };
        let huge = opts.huge_pages && len >= HUGE;
        // Reserve with slack so that the buffer can start on a 2 MiB boundary.
        let map_len = if huge { len + HUGE } else { len };
        let oom = |e: io::Error| {
            io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!("cannot map {len} bytes: {e}"),
            )
        };
        // The memfd's pages replace a reservation that is never touched: no commit charge.
        let map = Mapping::anonymous(map_len, fd.is_some()).map_err(oom)?;
        let base = map.as_ptr() as usize;
        let start = if huge {
            base.next_multiple_of(HUGE)
        } else {
            base
        };
        let mut buf = HostBuffer {
            ptr: start as *mut u8,
            len,
            map,
            fd: None,
            header: None,
            generation,
            pid: std::process::id(),
            dontfork: false,
        };
        let mut ino = 0;
        if let Some(fd) = fd {
            buf.map.share_at(start - base, len, &fd).map_err(oom)?;
            let header = Mapping::shared(&fd, HEADER_LEN as usize, header_offset(len as u64))
                .map_err(oom)?;
            let h = header.as_ptr() as *mut AtomicU64;
            ino = rustix::fs::fstat(&fd).map_err(io::Error::from)?.st_ino;
            // SAFETY: the header page is mapped, page-aligned, only accessed atomically.
            unsafe {
                (*h.add(HDR_GENERATION)).store(generation, Ordering::Release);
                (*h.add(HDR_MAGIC)).store(HEADER_MAGIC, Ordering::Release);
                (*h.add(HDR_ALIVE)).store(1, Ordering::SeqCst);
            }
            // A forked child must not share (and then punch, or keep alive) these pages.
            buf.dontfork = buf.map.dontfork().is_ok() && header.dontfork().is_ok();
            buf.header = Some(header);
            buf.fd = Some(fd);
        }
        if huge {
            let _ = buf.map.hugepage(start - base, len);
        }
        // MADV_POPULATE_WRITE (Linux 5.14); else touch every page.
        if opts.populate && buf.map.populate_write(start - base, len).is_err() {
            for off in (0..len).step_by(page_size()) {
                // SAFETY: inside the buffer, which nothing else refers to yet.
                unsafe { std::ptr::write_volatile((start + off) as *mut u8, 0) };
            }
        }
        if let Some(fd) = &buf.fd {
            let r = SharedRegion {
                addr: start as u64,
                len: len as u64,
                fd: fd.as_raw_fd(),
                populated: opts.populate,
                ino,
                generation,
                pid: buf.pid,
            };
            SHARED
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .insert(r.addr, r);
        }
        Ok(buf)
    }

    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether same-host peers can map this buffer (memfd-backed).
    pub fn is_shareable(&self) -> bool {
        self.fd.is_some()
    }

    /// The buffer's generation (see the module docs); 0 for a buffer that is not shareable.
    pub fn generation(&self) -> u64 {
        if self.fd.is_some() {
            self.generation
        } else {
            0
        }
    }

    /// The bytes at `[off, off+len)`.
    ///
    /// # Panics
    /// If the range is outside the buffer (a programming error of the caller).
    pub fn slice(&self, off: usize, len: usize) -> &[u8] {
        assert!(
            off.checked_add(len).is_some_and(|e| e <= self.len),
            "range outside the buffer"
        );
        // SAFETY: in bounds of our mapping.
        unsafe { std::slice::from_raw_parts(self.ptr.add(off), len) }
    }

    /// Mutable view of `[off, off+len)`. The caller must not let two views overlap or race
    /// with a transfer into the same range.
    ///
    /// # Panics
    /// If the range is outside the buffer.
    #[allow(clippy::mut_from_ref)]
    pub fn slice_mut(&self, off: usize, len: usize) -> &mut [u8] {
        assert!(
            off.checked_add(len).is_some_and(|e| e <= self.len),
            "range outside the buffer"
        );
        // SAFETY: in bounds; exclusivity is the caller's contract (documented above).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            // The copy of a forked child: only the file descriptor is ours (closed by its
            // own drop). Without MADV_DONTFORK the child has mappings of its own, unmapped
            // as the fields drop; with it, it has none.
            if self.dontfork {
                self.map.disown();
                if let Some(h) = &mut self.header {
                    h.disown();
                }
            }
            return;
        }
        if let Some(fd) = &self.fd {
            SHARED
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&(self.ptr as u64));
            if let Some(h) = self.header.take() {
                // Peers that still map the memfd see it is dead before its pages go.
                // SAFETY: our header mapping, accessed atomically; unmapped just after.
                unsafe {
                    (*(h.as_ptr() as *mut AtomicU64).add(HDR_ALIVE)).store(0, Ordering::SeqCst)
                };
                drop(h);
            }
            // Return the pages now, even if a peer still maps the memfd (its seals allow it).
            if let Err(e) = punch_hole(fd, 0, self.len as u64) {
                tracing::debug!("returning the pages of a {}-byte buffer: {e}", self.len);
            }
        }
        // The reservation (the memfd mapping lies inside it) is unmapped as `map` drops.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shareable_buffers_are_listed_while_alive() {
        let b = HostBuffer::new(3 << 20, true).unwrap();
        assert!(b.is_shareable());
        assert_eq!(b.addr() % 4096, 0);
        b.slice_mut(10, 3).copy_from_slice(b"abc");
        assert_eq!(b.slice(10, 3), b"abc");
        let r = shareable_region(b.addr() + 4096, 4096).unwrap();
        assert_eq!((r.addr, r.len), (b.addr(), 3 << 20));
        assert!(
            shareable_region(b.addr() + (3 << 20) - 1, 2).is_none(),
            "range crossing the end"
        );
        // SAFETY: the fd the table lists, open while `b` lives.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(r.fd) };
        let seals = rustix::fs::fcntl_get_seals(fd).unwrap();
        assert!(seals.contains(rustix::fs::SealFlags::SHRINK), "{seals:?}");
        let addr = b.addr();
        drop(b);
        assert!(shareable_region(addr, 1).is_none());
    }

    #[test]
    fn a_buffer_names_its_generation_and_marks_itself_dead_when_dropped() {
        let b = HostBuffer::new(10_000, false).unwrap();
        let r = shareable_region(b.addr(), 1).unwrap();
        assert_ne!(r.generation, 0);
        assert_eq!(r.generation, b.generation());
        let link = std::fs::read_link(format!("/proc/self/fd/{}", r.fd)).unwrap();
        assert!(
            link.to_string_lossy()
                .starts_with(&format!("/memfd:{}", memfd_name(r.generation))),
            "{link:?}"
        );
        // A second handle on the same memfd outlives the buffer, as a peer's would.
        let other = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/self/fd/{}", r.fd))
            .unwrap();
        let st = rustix::fs::fstat(&other).unwrap();
        assert_eq!(
            (st.st_ino, st.st_size as u64),
            (r.ino, header_offset(10_000) + HEADER_LEN)
        );
        let word = |i: usize| {
            let mut w = [0u8; 8];
            rustix::io::pread(&other, &mut w, header_offset(10_000) + 8 * i as u64).unwrap();
            u64::from_le_bytes(w)
        };
        assert_eq!(
            (word(HDR_MAGIC), word(HDR_GENERATION), word(HDR_ALIVE)),
            (HEADER_MAGIC, r.generation, 1)
        );
        b.slice_mut(0, 4).copy_from_slice(b"data");
        let c = HostBuffer::new(10_000, false).unwrap();
        assert_ne!(c.generation(), b.generation(), "generations do not repeat");
        drop(b);
        assert_eq!(word(HDR_ALIVE), 0, "a dropped buffer is marked dead");
        let mut d = [1u8; 4];
        rustix::io::pread(&other, &mut d, 0).unwrap();
        assert_eq!(d, [0; 4], "its pages were punched out");
        // The seals forbid shrinking the file under a peer's mapping.
        assert!(rustix::fs::ftruncate(&other, 0).is_err());
    }

    #[test]
    fn private_and_huge_buffers() {
        let p = HostBuffer::with(
            8192,
            HostOptions {
                shareable: false,
                ..HostOptions::default()
            },
        )
        .unwrap();
        assert!(!p.is_shareable());
        assert!(shareable_region(p.addr(), 1).is_none());
        let h = HostBuffer::with(
            4 << 20,
            HostOptions {
                huge_pages: true,
                populate: false,
                shareable: false,
            },
        )
        .unwrap();
        assert_eq!(h.addr() % (2 << 20), 0);
        h.slice_mut((4 << 20) - 1, 1)[0] = 7;
        assert!(HostBuffer::new(0, false).is_err());
    }
}
