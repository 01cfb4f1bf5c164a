//! Page-aligned host memory owned by kvferry (managed buffers, store segments, benches).
//!
//! A buffer is **shareable** by default: backed by a sealed memfd mapped shared, so that a
//! same-host peer engine can map the same pages and copy with a plain `memcpy` (no system
//! call, no page pinning; see [`crate::transport::shm`]). Every live shareable buffer is
//! listed in a process-wide table that the engine consults when it publishes its descriptor;
//! [`shareable_region`] answers whether a registered range lies inside one. Where memfd is
//! unavailable the buffer is an ordinary anonymous mapping and peers reach it by
//! cross-memory attach instead.
//!
//! The memfd is sealed against shrinking (a peer that mapped it can never fault past its
//! end), and dropping the buffer punches out its pages before closing it, so its memory is
//! returned at once even while a peer still has it mapped.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
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
        HostOptions { populate: true, huge_pages: false, shareable: true }
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
}

static SHARED: RwLock<BTreeMap<u64, SharedRegion>> = RwLock::new(BTreeMap::new());

/// The shareable buffer of this process that contains `[addr, addr+len)`, if any.
pub fn shareable_region(addr: u64, len: u64) -> Option<SharedRegion> {
    let t = SHARED.read().unwrap_or_else(|e| e.into_inner());
    let (_, r) = t.range(..=addr).next_back()?;
    let end = addr.checked_add(len)?;
    (end <= r.addr + r.len).then_some(*r)
}

const HUGE: usize = 2 << 20;

/// A page-aligned mapping, zero-filled, unmapped on drop.
pub struct HostBuffer {
    ptr: *mut u8,
    len: usize,
    /// The whole reservation to unmap (larger than `len` when aligned for huge pages).
    map_base: *mut u8,
    map_len: usize,
    fd: Option<OwnedFd>,
}

// SAFETY: plain memory owned by this value; callers coordinate concurrent access through
// the engine (transfers) or their own synchronisation.
unsafe impl Send for HostBuffer {}
unsafe impl Sync for HostBuffer {}

fn memfd(len: usize) -> io::Result<OwnedFd> {
    // SAFETY: memfd_create with a valid C string; checked below.
    let fd = unsafe { libc::memfd_create(c"kvferry-buffer".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sizing and sealing our own memfd.
    unsafe {
        if libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) != 0 {
            return Err(io::Error::last_os_error());
        }
        if libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(fd)
}

impl HostBuffer {
    /// A shareable buffer of `len` bytes; `populate` pre-faults the pages.
    pub fn new(len: usize, populate: bool) -> io::Result<HostBuffer> {
        HostBuffer::with(len, HostOptions { populate, ..HostOptions::default() })
    }

    /// A buffer allocated as `opts` say.
    pub fn with(len: usize, opts: HostOptions) -> io::Result<HostBuffer> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "a buffer needs at least 1 byte"));
        }
        let fd = if opts.shareable {
            match memfd(len) {
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
        let map_len = if huge { len.checked_add(HUGE).ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "size too large"))? } else { len };
        let oom = |e: io::Error| io::Error::new(io::ErrorKind::OutOfMemory, format!("cannot map {len} bytes: {e}"));
        // The memfd's pages replace a reservation that is never touched: no commit charge.
        let reserve = if fd.is_some() { libc::MAP_NORESERVE } else { 0 };
        // SAFETY: a fresh reservation (or the whole mapping), checked for MAP_FAILED.
        let base = unsafe {
            libc::mmap(std::ptr::null_mut(), map_len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | reserve, -1, 0)
        };
        if base == libc::MAP_FAILED {
            return Err(oom(io::Error::last_os_error()));
        }
        let start = if huge { (base as usize).next_multiple_of(HUGE) } else { base as usize };
        let mut buf = HostBuffer { ptr: start as *mut u8, len, map_base: base as *mut u8, map_len, fd: None };
        if let Some(fd) = fd {
            // SAFETY: replaces part of our own reservation with the memfd mapping.
            let p = unsafe {
                libc::mmap(start as *mut libc::c_void, len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_FIXED, fd.as_raw_fd(), 0)
            };
            if p == libc::MAP_FAILED {
                return Err(oom(io::Error::last_os_error()));
            }
            buf.fd = Some(fd);
        }
        // SAFETY: advising and touching our own mapping.
        unsafe {
            if huge {
                libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
            }
            // MADV_POPULATE_WRITE (Linux 5.14); else touch every page.
            if opts.populate && libc::madvise(start as *mut libc::c_void, len, 23) != 0 {
                for off in (0..len).step_by(4096) {
                    std::ptr::write_volatile((start + off) as *mut u8, 0);
                }
            }
        }
        if let Some(fd) = &buf.fd {
            let r = SharedRegion { addr: start as u64, len: len as u64, fd: fd.as_raw_fd(), populated: opts.populate };
            SHARED.write().unwrap_or_else(|e| e.into_inner()).insert(r.addr, r);
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

    /// The bytes at `[off, off+len)`.
    ///
    /// # Panics
    /// If the range is outside the buffer (a programming error of the caller).
    pub fn slice(&self, off: usize, len: usize) -> &[u8] {
        assert!(off.checked_add(len).is_some_and(|e| e <= self.len), "range outside the buffer");
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
        assert!(off.checked_add(len).is_some_and(|e| e <= self.len), "range outside the buffer");
        // SAFETY: in bounds; exclusivity is the caller's contract (documented above).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if let Some(fd) = &self.fd {
            SHARED.write().unwrap_or_else(|e| e.into_inner()).remove(&(self.ptr as u64));
            // Return the pages now, even if a peer still maps the memfd.
            // SAFETY: punching a hole in our own memfd (allowed by its seals).
            unsafe { libc::fallocate(fd.as_raw_fd(), libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, 0, self.len as libc::off_t) };
        }
        // SAFETY: we own the reservation (the memfd mapping lies inside it).
        unsafe { libc::munmap(self.map_base as *mut libc::c_void, self.map_len) };
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
        assert!(shareable_region(b.addr() + (3 << 20) - 1, 2).is_none(), "range crossing the end");
        // SAFETY: F_GET_SEALS on the fd the table lists.
        let seals = unsafe { libc::fcntl(r.fd, libc::F_GET_SEALS) };
        assert_eq!(seals & libc::F_SEAL_SHRINK, libc::F_SEAL_SHRINK);
        let addr = b.addr();
        drop(b);
        assert!(shareable_region(addr, 1).is_none());
    }

    #[test]
    fn private_and_huge_buffers() {
        let p = HostBuffer::with(8192, HostOptions { shareable: false, ..HostOptions::default() }).unwrap();
        assert!(!p.is_shareable());
        assert!(shareable_region(p.addr(), 1).is_none());
        let h = HostBuffer::with(4 << 20, HostOptions { huge_pages: true, populate: false, shareable: false }).unwrap();
        assert_eq!(h.addr() % (2 << 20), 0);
        h.slice_mut((4 << 20) - 1, 1)[0] = 7;
        assert!(HostBuffer::new(0, false).is_err());
    }
}
