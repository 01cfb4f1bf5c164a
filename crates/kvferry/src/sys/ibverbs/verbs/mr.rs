//! Protection domains and registered memory: [`Pd`] and [`Mr`].

use super::*;

pub(super) struct PdInner {
    pub(super) ctx: Arc<CtxInner>,
    pub(super) pd: *mut c_void,
}

// SAFETY: see CtxInner.
unsafe impl Send for PdInner {}
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: allocated in `alloc_pd`; MRs and QPs hold an Arc of this, so none is left.
        let rc = unsafe { (self.ctx.verbs.f.dealloc_pd)(self.pd) };
        if rc != 0 {
            tracing::warn!("ibv_dealloc_pd on {} failed: {}", self.ctx.name, errno(rc));
        }
    }
}

/// A protection domain.
#[derive(Clone)]
pub struct Pd {
    pub(super) inner: Arc<PdInner>,
}

/// `IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ`: what memory
/// registered for transfers allows (as Mooncake registers it).
pub(crate) const ACCESS_ALL: c_int =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

impl Pd {
    /// Registers `[addr, addr+len)` with local write, remote write and remote read access.
    ///
    /// # Safety
    /// The range must be memory of this process that stays mapped until the returned [`Mr`]
    /// is dropped, and the caller must accept that this NIC (and any peer holding the rkey)
    /// reads and writes it meanwhile: no Rust reference to it may assume it unchanging.
    pub unsafe fn reg_mr(&self, addr: *mut u8, len: usize) -> Result<Mr, VerbsError> {
        let ctx = &self.inner.ctx;
        // SAFETY: a live PD; the range is the caller's promise.
        let mr = unsafe { (ctx.verbs.f.reg_mr)(self.inner.pd, addr.cast(), len, ACCESS_ALL) };
        if mr.is_null() {
            return Err(ctx.err(
                "ibv_reg_mr",
                last_error(),
                &format!("registering {len} bytes at {addr:p}"),
            ));
        }
        // SAFETY: a valid ibv_mr returned by the library; its keys never change.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(Mr {
            pd: Arc::clone(&self.inner),
            mr,
            addr: addr as usize,
            len,
            lkey,
            rkey,
        })
    }

    /// Registers `[offset, offset+len)` of the dma-buf `fd` (GPU memory exported by the CUDA
    /// driver), reachable at `iova` (the address work requests use: the GPU memory's own
    /// virtual address), with [`ACCESS_ALL`]. The NIC keeps its own reference to the
    /// dma-buf: `fd` may be closed once this returns.
    pub fn reg_dmabuf_mr(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
    ) -> Result<Mr, VerbsError> {
        let ctx = &self.inner.ctx;
        let Some(f) = ctx.verbs.reg_dmabuf_mr else {
            return Err(ctx.err(
                "ibv_reg_dmabuf_mr",
                io::Error::from_raw_os_error(libc::ENOSYS),
                "libibverbs has no ibv_reg_dmabuf_mr (rdma-core 34 or newer has it)",
            ));
        };
        use std::os::fd::AsRawFd;
        // SAFETY: a live PD and an open dma-buf descriptor; the kernel checks the range
        // against the dma-buf and pins it through the exporter (no CPU mapping is made).
        let mr = unsafe { f(self.inner.pd, offset, len, iova, fd.as_raw_fd(), ACCESS_ALL) };
        if mr.is_null() {
            return Err(ctx.err(
                "ibv_reg_dmabuf_mr",
                last_error(),
                &format!(
                    "registering {len} bytes of GPU memory (dma-buf offset {offset}) at 0x{iova:x}"
                ),
            ));
        }
        // SAFETY: a valid ibv_mr returned by the library; its keys never change.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(Mr {
            pd: Arc::clone(&self.inner),
            mr,
            addr: iova as usize,
            len,
            lkey,
            rkey,
        })
    }

    /// An RC queue pair whose sends and receives complete on `cq`, with room for `max_send_wr`
    /// outstanding send work requests (at least 2: Soft-RoCE misbehaves with a send queue of 1).
    pub fn create_qp(&self, cq: &Cq, max_send_wr: u32) -> Result<Qp, VerbsError> {
        let ctx = &self.inner.ctx;
        let max_send_wr = max_send_wr.max(2);
        let mut init = ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: cq.inner.cq,
            recv_cq: cq.inner.cq,
            srq: std::ptr::null_mut(),
            cap: ibv_qp_cap {
                max_send_wr,
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: a live PD and CQ (the QP keeps both alive); `init` is a valid attribute block.
        let qp = unsafe { (ctx.verbs.f.create_qp)(self.inner.pd, &mut init) };
        if qp.is_null() {
            return Err(ctx.err(
                "ibv_create_qp",
                last_error(),
                &format!("RC QP with {max_send_wr} send WRs"),
            ));
        }
        // SAFETY: a valid ibv_qp; its number never changes.
        let qp_num = unsafe { (*qp).qp_num };
        Ok(Qp {
            pd: Arc::clone(&self.inner),
            _cq: Arc::clone(&cq.inner),
            qp,
            qp_num,
            max_send_wr,
        })
    }
}

/// Registered memory. Dropping it deregisters (errors logged); [`Mr::dereg`] reports them.
pub struct Mr {
    pub(super) pd: Arc<PdInner>,
    pub(super) mr: *mut ibv_mr,
    pub(super) addr: usize,
    pub(super) len: usize,
    pub(super) lkey: u32,
    pub(super) rkey: u32,
}

// SAFETY: see CtxInner; the MR's fields are read-only after registration.
unsafe impl Send for Mr {}
unsafe impl Sync for Mr {}

impl Mr {
    pub fn addr(&self) -> usize {
        self.addr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn lkey(&self) -> u32 {
        self.lkey
    }
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// Deregisters, reporting a failure. The caller must have waited for every work request
    /// that touches the range (a request still in flight would fail with a protection error).
    pub fn dereg(mut self) -> Result<(), VerbsError> {
        let mr = std::mem::replace(&mut self.mr, std::ptr::null_mut());
        // SAFETY: registered in `reg_mr`, deregistered once (Drop sees null).
        let rc = unsafe { (self.pd.ctx.verbs.f.dereg_mr)(mr) };
        if rc != 0 {
            return Err(self.pd.ctx.err(
                "ibv_dereg_mr",
                errno(rc),
                "the memory region could not be deregistered",
            ));
        }
        Ok(())
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        if self.mr.is_null() {
            return;
        }
        // SAFETY: registered in `reg_mr`, deregistered once.
        let rc = unsafe { (self.pd.ctx.verbs.f.dereg_mr)(self.mr) };
        if rc != 0 {
            tracing::warn!("ibv_dereg_mr on {} failed: {}", self.pd.ctx.name, errno(rc));
        }
    }
}
