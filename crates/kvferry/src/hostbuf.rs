//! Page-aligned host memory owned by kvferry (managed buffers, store segments, benches).

use std::io;

/// An anonymous private mapping, zero-filled, unmapped on drop.
pub struct HostBuffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain memory owned by this value; callers coordinate concurrent access through
// the engine (transfers) or their own synchronisation.
unsafe impl Send for HostBuffer {}
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Maps `len` bytes; `populate` pre-faults the pages (slower to create, no faults later).
    pub fn new(len: usize, populate: bool) -> io::Result<HostBuffer> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "a buffer needs at least 1 byte"));
        }
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | if populate { libc::MAP_POPULATE } else { 0 };
        // SAFETY: anonymous mapping; the result is checked for MAP_FAILED.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0) };
        if p == libc::MAP_FAILED {
            return Err(io::Error::new(io::ErrorKind::OutOfMemory, format!("cannot map {len} bytes: {}", io::Error::last_os_error())));
        }
        Ok(HostBuffer { ptr: p as *mut u8, len })
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
        // SAFETY: we own the mapping.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}
