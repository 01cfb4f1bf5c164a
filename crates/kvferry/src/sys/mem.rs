//! Memory mappings and advice, through rustix: [`Mapping`] owns a range this process mapped
//! and unmaps it on drop; advice is asked for by name (`MADV_DONTFORK`, `MADV_HUGEPAGE`,
//! `MADV_POPULATE_*`), only the kinds that never change what the memory holds, so asking is
//! safe; [`punch_hole`] returns a memory file's pages; [`page_size`] is the kernel's.
//!
//! A `Mapping` hands out raw pointers only: reading or writing through them is the caller's
//! `unsafe`, with the caller's reason why the range is live.

use rustix::mm::{Advice, MapFlags, ProtFlags};
use std::io;
use std::os::fd::AsFd;

/// The kernel's page size.
#[inline]
pub(crate) fn page_size() -> usize {
    rustix::param::page_size()
}

/// A read-write mapping this process made: `[as_ptr(), +len())`, unmapped on drop (unless
/// [`Mapping::disown`]ed).
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a range of this process's address space, not memory this value reads or writes:
// every access goes through the raw pointers it hands out, under the caller's own reasoning.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    /// A shared read-write mapping of `len` bytes of `fd` from `offset`, where the kernel
    /// chooses.
    pub(crate) fn shared(fd: impl AsFd, len: usize, offset: u64) -> io::Result<Mapping> {
        // SAFETY: no address hint, so the kernel picks a free range and no existing mapping
        // is replaced; nothing is read or written here.
        let p = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                offset,
            )
        }?;
        Ok(Mapping { ptr: p.cast(), len })
    }

    /// `len` bytes of private zeroed memory, read-write; with `noreserve`, no commit charge
    /// (for a reservation whose pages [`Mapping::share_at`] replaces before they are used).
    pub(crate) fn anonymous(len: usize, noreserve: bool) -> io::Result<Mapping> {
        let mut flags = MapFlags::PRIVATE;
        if noreserve {
            flags |= MapFlags::NORESERVE;
        }
        // SAFETY: no address hint: a fresh range, no existing mapping replaced.
        let p = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                flags,
            )
        }?;
        Ok(Mapping { ptr: p.cast(), len })
    }

    /// Replaces `[off, +len)` of this mapping by a shared read-write mapping of `fd` from its
    /// start (`MAP_FIXED`).
    pub(crate) fn share_at(&mut self, off: usize, len: usize, fd: impl AsFd) -> io::Result<()> {
        let at = self.range(off, len)?;
        // SAFETY: the range lies inside this mapping, which this value owns; it is replaced
        // by memory of the same protection, so any pointer into it stays valid, and no other
        // mapping is touched.
        unsafe {
            rustix::mm::mmap(
                at.cast(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED | MapFlags::FIXED,
                fd,
                0,
            )
        }?;
        Ok(())
    }

    /// The mapping's first byte.
    #[inline]
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// `as_ptr() + off` if `[off, +len)` lies inside the mapping.
    fn range(&self, off: usize, len: usize) -> io::Result<*mut u8> {
        if off.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("[{off}, +{len}) is outside a mapping of {} bytes", self.len),
            ));
        }
        Ok(self.ptr.wrapping_add(off))
    }

    /// Advises `[off, +len)` of the mapping.
    fn advise(&self, off: usize, len: usize, advice: Advice) -> io::Result<()> {
        let at = self.range(off, len)?;
        // SAFETY: a range of this mapping; the advice (one of this module's named kinds)
        // changes how the kernel backs or inherits the pages, never what they hold.
        unsafe { rustix::mm::madvise(at.cast(), len, advice) }?;
        Ok(())
    }

    /// `MADV_DONTFORK` on the whole mapping: a child process does not inherit it.
    pub(crate) fn dontfork(&self) -> io::Result<()> {
        self.advise(0, self.len, Advice::LinuxDontFork)
    }

    /// `MADV_HUGEPAGE` on `[off, +len)`: transparent huge pages wanted.
    pub(crate) fn hugepage(&self, off: usize, len: usize) -> io::Result<()> {
        self.advise(off, len, Advice::LinuxHugepage)
    }

    /// `MADV_POPULATE_WRITE` on `[off, +len)` (Linux 5.14): faults the pages in, writable.
    pub(crate) fn populate_write(&self, off: usize, len: usize) -> io::Result<()> {
        self.advise(off, len, Advice::LinuxPopulateWrite)
    }

    /// `MADV_POPULATE_READ` on `[off, +len)` (Linux 5.14): fills the page tables (for a
    /// shared mapping, fault-around maps the pages writable too).
    pub(crate) fn populate_read(&self, off: usize, len: usize) -> io::Result<()> {
        self.advise(off, len, Advice::LinuxPopulateRead)
    }

    /// Lets go of the range without unmapping it: for the copy a forked child holds of a
    /// value whose mapping it did not inherit (`MADV_DONTFORK`), where the range is not
    /// this process's to unmap.
    pub(crate) fn disown(&mut self) {
        self.len = 0;
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        // SAFETY: this value's own mapping (or a disowned one, skipped above); whoever holds
        // a pointer into it dropped this value, which outlives their accesses by contract.
        if let Err(e) = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) } {
            tracing::debug!("munmap of [{:p}, +{}): {e}", self.ptr, self.len);
        }
    }
}

/// Returns the pages of `[offset, +len)` of the memory file `fd` to the kernel, its size kept
/// (`fallocate(PUNCH_HOLE | KEEP_SIZE)`): a later read there sees zeroes.
pub(crate) fn punch_hole(fd: impl AsFd, offset: u64, len: u64) -> io::Result<()> {
    use rustix::fs::FallocateFlags;
    rustix::fs::fallocate(
        fd,
        FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
        offset,
        len,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_mapping_sees_its_file_and_advice_outside_it_is_refused() {
        let fd =
            rustix::fs::memfd_create("kvferry-sys-mem", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let page = page_size();
        assert!(page >= 4096 && page.is_power_of_two(), "page size {page}");
        rustix::fs::ftruncate(&fd, 2 * page as u64).unwrap();
        rustix::io::pwrite(&fd, b"kv", page as u64).unwrap();
        let m = Mapping::shared(&fd, page, page as u64).unwrap();
        // SAFETY: inside the live mapping, read only.
        assert_eq!(unsafe { std::slice::from_raw_parts(m.as_ptr(), 2) }, b"kv");
        m.dontfork().unwrap();
        m.populate_read(0, page).unwrap_or(()); // older kernels lack it
        assert!(m.hugepage(page, 1).is_err());
        assert!(m.populate_write(1, usize::MAX).is_err());
        punch_hole(&fd, page as u64, page as u64).unwrap();
        // SAFETY: as above.
        assert_eq!(unsafe { std::slice::from_raw_parts(m.as_ptr(), 2) }, [0, 0]);
    }

    #[test]
    fn share_at_replaces_part_of_a_reservation() {
        let page = page_size();
        let fd =
            rustix::fs::memfd_create("kvferry-sys-mem", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, page as u64).unwrap();
        rustix::io::pwrite(&fd, b"x", 0).unwrap();
        let mut r = Mapping::anonymous(3 * page, true).unwrap();
        r.share_at(page, page, &fd).unwrap();
        assert!(r.share_at(3 * page, page, &fd).is_err());
        // SAFETY: inside the live reservation.
        unsafe {
            assert_eq!(*r.as_ptr(), 0);
            assert_eq!(*r.as_ptr().add(page), b'x');
        }
    }
}
