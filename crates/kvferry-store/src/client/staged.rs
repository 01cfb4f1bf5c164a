//! Values in the client's local buffer ([`Staged`]): what the bytes API stages through and
//! what `get_buffers` hands out, the space they hold, and faulting in fresh memory for a
//! copy. Nothing here talks to the master or moves bytes between hosts.

use super::{Client, Inner};
use crate::error::{StoreError, StoreResult};
use std::sync::Arc;

/// Space in the client's local buffer (registered memory) holding one value: what the bytes
/// API stages through, and what [`Client::get_buffers`] hands out so a value can be used
/// where it landed, without a copy (Mooncake's `BufferHandle`). The space returns to the
/// local buffer when this is dropped; the local buffer itself stays mapped while any value
/// lives, even after the client closed.
pub struct Staged {
    inner: Arc<Inner>,
    block: Option<crate::master::alloc::Block>,
    pub(super) addr: u64,
    pub(super) len: usize,
}

impl Drop for Staged {
    fn drop(&mut self) {
        if let (Some(b), Some((_, space))) = (self.block.take(), &self.inner.staging) {
            space.lock().unwrap_or_else(|e| e.into_inner()).free(b);
        }
    }
}

impl std::fmt::Debug for Staged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Staged {{ addr: {:#x}, len: {} }}", self.addr, self.len)
    }
}

impl Staged {
    #[allow(clippy::mut_from_ref)] // the block is this value's alone (see below)
    pub(super) fn bytes(&self) -> &mut [u8] {
        // SAFETY: a block of the staging buffer owned by this value alone; the buffer lives
        // as long as `inner`.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }

    /// The value's bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.bytes()
    }

    /// The value's bytes, to change in place (they are this value's alone).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.bytes()
    }

    /// Where the bytes are (inside the client's registered local buffer).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A copy in a new `Vec`, its fresh memory faulted in first (`prefault_fresh`).
    pub fn to_vec(&self) -> Vec<u8> {
        let src = self.as_slice();
        let mut v: Vec<u8> = Vec::with_capacity(src.len());
        // SAFETY: the Vec's spare capacity is its own allocation, not yet initialized.
        unsafe { prefault_fresh(v.as_mut_ptr(), src.len()) };
        v.extend_from_slice(src);
        v
    }

    /// Copies the value into `dst` (its length), faulting `dst`'s pages in first when it is
    /// fresh memory the caller just allocated (`prefault_fresh`).
    pub fn copy_into_fresh(&self, dst: &mut [u8]) {
        let n = dst.len().min(self.len);
        // SAFETY: `dst` is borrowed mutably: its pages are ours to fault in.
        unsafe { prefault_fresh(dst.as_mut_ptr(), dst.len()) };
        dst[..n].copy_from_slice(&self.as_slice()[..n]);
    }
}

/// Faults in `[ptr, ptr + len)`, memory just allocated for a large copy, in one system call
/// instead of a page fault per 4 KiB page on first write (on a VM each costs more than
/// copying the page): `MADV_POPULATE_WRITE` for 256 KiB and more, after `MADV_HUGEPAGE` on
/// its 2 MiB-aligned interior for 4 MiB and more (where the host's transparent huge pages
/// allow it). Measured here: 32 x 1 MiB into fresh `Vec`s 28 -> 13 ms; 8 x 16 MiB 106 -> 27 ms
/// (the first huge-page allocation after boot can be slower: the kernel compacts memory).
/// Failures are ignored: the copy then faults the pages as before.
///
/// # Safety
/// The range must be memory the caller owns and may write (its contents may be changed only
/// as a first write of zeros would: pages not yet present become zero pages).
unsafe fn prefault_fresh(ptr: *mut u8, len: usize) {
    const PAGE: usize = 4096;
    const HUGE: usize = 2 << 20;
    if len < 256 << 10 {
        return;
    }
    let start = ptr as usize;
    if len >= 4 << 20 {
        let (a, e) = (
            (start + HUGE - 1) & !(HUGE - 1),
            (start + len) & !(HUGE - 1),
        );
        if e > a {
            // SAFETY: inside the caller's range (see above); advice only.
            let _ = unsafe {
                rustix::mm::madvise(
                    a as *mut std::ffi::c_void,
                    e - a,
                    rustix::mm::Advice::LinuxHugepage,
                )
            };
        }
    }
    let (a, e) = (
        (start + PAGE - 1) & !(PAGE - 1),
        (start + len) & !(PAGE - 1),
    );
    if e > a {
        // SAFETY: inside the caller's range; populating only faults pages in.
        let _ = unsafe {
            rustix::mm::madvise(
                a as *mut std::ffi::c_void,
                e - a,
                rustix::mm::Advice::LinuxPopulateWrite,
            )
        };
    }
}

impl Client {
    pub(super) fn stage(&self, len: usize) -> StoreResult<Staged> {
        let Some((buf, space)) = &self.inner.staging else {
            return Err(StoreError::InvalidParams("this client has no local buffer (local_buffer_size = 0); use put_from/get_into with registered memory".into()));
        };
        let block = space.lock().unwrap_or_else(|e| e.into_inner()).allocate(len as u64).ok_or_else(|| StoreError::InvalidParams(format!(
            "{len} bytes do not fit in the free part of the local buffer ({} bytes); raise local_buffer_size",
            buf.len()
        )))?;
        Ok(Staged {
            inner: Arc::clone(&self.inner),
            addr: block.addr,
            len,
            block: Some(block),
        })
    }
}
