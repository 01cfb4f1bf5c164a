//! Values in the client's local buffer ([`Staged`]): what the bytes API stages through and
//! what `get_buffers` hands out, and the space they hold. Nothing here talks to the master or
//! moves bytes between hosts.

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

    /// A copy in a new `Vec` (see [`copy_out`](super::copy_out): its fresh pages faulted
    /// in first, a large value copied by several threads).
    pub fn to_vec(&self) -> Vec<u8> {
        super::copy_out::to_vecs(&[self.as_slice()])
            .pop()
            .unwrap_or_default()
    }

    /// Copies the value into `dst` (its length), faulting `dst`'s pages in first when it is
    /// fresh memory the caller just allocated (see [`copy_out`](super::copy_out)).
    pub fn copy_into_fresh(&self, dst: &mut [u8]) {
        super::copy_out::copy_fresh(vec![super::copy_out::FreshCopy::new(self.as_slice(), dst)]);
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
