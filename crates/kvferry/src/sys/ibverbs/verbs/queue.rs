//! Completion queues (with their channels) and RC queue pairs: [`Cq`], [`Wc`], [`Qp`].

use super::*;

pub(super) struct ChanInner {
    pub(super) ctx: Arc<CtxInner>,
    pub(super) ch: *mut ibv_comp_channel,
}

impl Drop for ChanInner {
    fn drop(&mut self) {
        // SAFETY: created in `create_cq`; its CQ is destroyed before (CqInner's fields drop
        // after CqInner::drop).
        let rc = unsafe { (self.ctx.verbs.f.destroy_comp_channel)(self.ch) };
        if rc != 0 {
            tracing::warn!(
                "ibv_destroy_comp_channel on {} failed: {}",
                self.ctx.name,
                errno(rc)
            );
        }
    }
}

pub(super) struct CqInner {
    pub(super) ctx: Arc<CtxInner>,
    pub(super) cq: *mut ibv_cq,
    pub(super) chan: ChanInner,
    /// Held by the one thread that arms the CQ and waits on its channel.
    pub(super) armed: Mutex<()>,
}

// SAFETY: see CtxInner.
unsafe impl Send for CqInner {}
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: created in `create_cq`; QPs hold an Arc of this, so none is left; every
        // event taken from the channel was acknowledged at once (`wait`).
        let rc = unsafe { (self.ctx.verbs.f.destroy_cq)(self.cq) };
        if rc != 0 {
            tracing::warn!("ibv_destroy_cq on {} failed: {}", self.ctx.name, errno(rc));
        }
    }
}

/// One work completion.
#[derive(Debug, Clone, Copy, Default)]
pub struct Wc {
    pub wr_id: u64,
    pub qp_num: u32,
    pub byte_len: u32,
    /// `enum ibv_wc_status` (0: success); see [`Wc::result`].
    pub(super) status: u32,
    pub(super) opcode: u32,
    pub(super) vendor_err: u32,
}

impl Wc {
    pub fn ok(&self) -> bool {
        self.status == 0
    }
    /// `IBV_WC_RDMA_WRITE` (1) or `IBV_WC_RDMA_READ` (2) for the operations posted here.
    pub fn opcode(&self) -> u32 {
        self.opcode
    }
    /// The completion as a result: `Err` names the status and what it means.
    pub fn result(&self, device: &str) -> Result<(), WcError> {
        if self.ok() {
            return Ok(());
        }
        let (name, meaning) = wc_status(self.status);
        Err(WcError {
            device: device.into(),
            wr_id: self.wr_id,
            qp_num: self.qp_num,
            status: self.status,
            name,
            meaning,
            vendor_err: self.vendor_err,
        })
    }
}

/// A completion queue with its completion channel.
#[derive(Clone)]
pub struct Cq {
    pub(super) inner: Arc<CqInner>,
}

/// How long [`Cq::wait`] polls before arming the channel and sleeping.
pub(crate) const SPIN: Duration = Duration::from_micros(50);

impl Cq {
    pub fn device(&self) -> &str {
        &self.inner.ctx.name
    }

    /// Takes up to `out.len()` completions without waiting; returns how many.
    pub fn poll(&self, out: &mut [Wc]) -> Result<usize, VerbsError> {
        let mut raw = [ibv_wc::default(); 32];
        let n = out.len().min(raw.len());
        if n == 0 {
            return Ok(0);
        }
        let cq = self.inner.cq;
        // SAFETY: a live CQ whose context's ops table is the provider's; `raw` has room for `n`.
        let rc = unsafe {
            let Some(poll) = (*(*cq).context).ops.poll_cq else {
                return Err(self.inner.ctx.err(
                    "ibv_poll_cq",
                    io::Error::from(io::ErrorKind::Unsupported),
                    "the provider has no poll_cq",
                ));
            };
            poll(cq, n as c_int, raw.as_mut_ptr())
        };
        if rc < 0 {
            return Err(self.inner.ctx.err(
                "ibv_poll_cq",
                errno(rc),
                "the completion queue is broken (overrun?)",
            ));
        }
        let got = rc as usize;
        for (o, w) in out.iter_mut().zip(&raw[..got]) {
            *o = Wc {
                wr_id: w.wr_id,
                qp_num: w.qp_num,
                byte_len: w.byte_len,
                status: w.status,
                opcode: w.opcode,
                vendor_err: w.vendor_err,
            };
        }
        Ok(got)
    }

    /// Waits until at least one completion is there and takes up to `out.len()`; polls for
    /// [`SPIN`], then sleeps on the completion channel. `Err(Timeout)` at `deadline`.
    pub fn wait(&self, out: &mut [Wc], deadline: Instant) -> Result<usize, VerbsError> {
        let start = Instant::now();
        let spin_end = start + SPIN;
        loop {
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(VerbsError::Timeout {
                    device: self.inner.ctx.name.clone(),
                    waited: now - start,
                });
            }
            if now < spin_end {
                std::hint::spin_loop();
                continue;
            }
            let _one = self.inner.armed.lock().unwrap_or_else(|e| e.into_inner());
            self.arm()?;
            // A completion that arrived before arming raises no event: look once more.
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            if self.sleep(deadline)? {
                self.take_event()?;
            }
        }
    }

    fn arm(&self) -> Result<(), VerbsError> {
        let cq = self.inner.cq;
        // SAFETY: a live CQ; ops table as in `poll`.
        let rc = unsafe {
            let Some(notify) = (*(*cq).context).ops.req_notify_cq else {
                return Err(self.inner.ctx.err(
                    "ibv_req_notify_cq",
                    io::Error::from(io::ErrorKind::Unsupported),
                    "the provider has no req_notify_cq",
                ));
            };
            notify(cq, 0)
        };
        if rc != 0 {
            return Err(self.inner.ctx.err("ibv_req_notify_cq", errno(rc), ""));
        }
        Ok(())
    }

    /// Sleeps until the channel has an event (true) or `deadline` passes (false).
    fn sleep(&self, deadline: Instant) -> Result<bool, VerbsError> {
        use rustix::event::{PollFd, PollFlags, Timespec};
        // SAFETY: the channel's fd lives as long as the channel, which outlives this call.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw((*self.inner.chan.ch).fd) };
        let left = deadline.saturating_duration_since(Instant::now());
        let ts = Timespec {
            tv_sec: left.as_secs() as i64,
            tv_nsec: i64::from(left.subsec_nanos()),
        };
        let mut fds = [PollFd::new(&fd, PollFlags::IN)];
        match rustix::event::poll(&mut fds, Some(&ts)) {
            Ok(n) => Ok(n > 0),
            Err(rustix::io::Errno::INTR) => Ok(false),
            Err(e) => Err(self.inner.ctx.err("poll(completion channel)", e.into(), "")),
        }
    }

    /// Takes the channel's event (there is one: `sleep` said so) and acknowledges it at once,
    /// so that destroying the CQ never waits for unacknowledged events.
    fn take_event(&self) -> Result<(), VerbsError> {
        let f = &self.inner.ctx.verbs.f;
        let mut cq: *mut ibv_cq = std::ptr::null_mut();
        let mut ctx: *mut c_void = std::ptr::null_mut();
        // SAFETY: a live channel with a pending event (read does not block); out-pointers valid.
        let rc = unsafe { (f.get_cq_event)(self.inner.chan.ch, &mut cq, &mut ctx) };
        if rc != 0 {
            return Err(self.inner.ctx.err("ibv_get_cq_event", last_error(), ""));
        }
        // SAFETY: the event's CQ is ours (one CQ per channel); one event acknowledged.
        unsafe { (f.ack_cq_events)(cq, 1) };
        Ok(())
    }
}

/// What a peer's QP is, for connecting to it (from its `Connection` message).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteQp {
    pub qp_num: u32,
    pub lid: u16,
    /// All zero: no GRH (InfiniBand within a subnet).
    pub gid: [u8; 16],
}

/// How to connect: the local port and GID index, and the path MTU (`enum ibv_mtu`, the
/// smaller of both ports' active MTU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Path {
    pub port: u8,
    pub sgid_index: u8,
    pub mtu: u32,
    /// Transport retries before `IBV_WC_RETRY_EXC_ERR` (0-7; [`RETRY_CNT`] as Mooncake). Soft-RoCE
    /// treats 7 as "retry forever", so a request towards a vanished QP stalls there until its
    /// deadline instead of failing.
    pub retry_cnt: u8,
}

/// RDMA WRITE or READ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Write,
    Read,
}

/// One one-sided work request: `len` bytes at `offset` of `local` to/from `remote_addr` under
/// `rkey` on the peer.
#[derive(Clone, Copy)]
pub struct Wr<'a> {
    pub wr_id: u64,
    pub op: Op,
    pub local: &'a Mr,
    pub offset: usize,
    pub len: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    /// Ask for a completion (unsignaled requests complete silently when a later signaled one
    /// on the same QP does).
    pub signaled: bool,
}

/// An RC queue pair.
pub struct Qp {
    pub(super) pd: Arc<PdInner>,
    /// Keeps the CQ alive while the QP lives (destroyed after it).
    pub(super) _cq: Arc<CqInner>,
    pub(super) qp: *mut ibv_qp,
    pub(super) qp_num: u32,
    pub(super) max_send_wr: u32,
}

// SAFETY: see CtxInner; posting is thread-safe in every provider.
unsafe impl Send for Qp {}
unsafe impl Sync for Qp {}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created in `create_qp`, destroyed once; its PD and CQ outlive it (Arcs).
        let rc = unsafe { (self.pd.ctx.verbs.f.destroy_qp)(self.qp) };
        if rc != 0 {
            tracing::warn!(
                "ibv_destroy_qp on {} failed: {}",
                self.pd.ctx.name,
                errno(rc)
            );
        }
    }
}

/// RC attributes as Mooncake sets them: responder and initiator depth 16, minimum RNR timer
/// 12 (0.64 ms), local ACK timeout 14 (4.096 µs × 2^14 ≈ 67 ms), 7 retries (the default of
/// [`Path::retry_cnt`]).
pub(super) const MAX_RD_ATOMIC: u8 = 16;
pub(super) const MIN_RNR_TIMER: u8 = 12;
pub(super) const TIMEOUT: u8 = 14;
pub const RETRY_CNT: u8 = 7;
pub(super) const RNR_RETRY: u8 = 7;

impl Qp {
    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }
    pub fn max_send_wr(&self) -> u32 {
        self.max_send_wr
    }
    pub fn device(&self) -> &str {
        &self.pd.ctx.name
    }

    fn modify(
        &self,
        call: &'static str,
        attr: &mut ibv_qp_attr,
        mask: c_int,
        detail: &str,
    ) -> Result<(), VerbsError> {
        // SAFETY: a live QP; `attr` a valid attribute block for `mask`.
        let rc = unsafe { (self.pd.ctx.verbs.f.modify_qp)(self.qp, attr, mask) };
        if rc != 0 {
            return Err(self.pd.ctx.err(call, errno(rc), detail));
        }
        Ok(())
    }

    /// RESET → INIT → RTR → RTS towards `remote` over `path`.
    pub fn connect(&self, path: Path, remote: &RemoteQp) -> Result<(), VerbsError> {
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_INIT,
            port_num: path.port,
            pkey_index: 0,
            qp_access_flags: ACCESS_ALL as c_uint,
            ..Default::default()
        };
        self.modify(
            "ibv_modify_qp(INIT)",
            &mut a,
            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
            &format!("QP {} port {}", self.qp_num, path.port),
        )?;

        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_RTR,
            path_mtu: path.mtu,
            dest_qp_num: remote.qp_num,
            rq_psn: 0,
            max_dest_rd_atomic: MAX_RD_ATOMIC,
            min_rnr_timer: MIN_RNR_TIMER,
            ..Default::default()
        };
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.port_num = path.port;
        if remote.gid != [0; 16] {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = ibv_gid { raw: remote.gid };
            a.ah_attr.grh.sgid_index = path.sgid_index;
            a.ah_attr.grh.hop_limit = 0xff;
        }
        let detail = format!(
            "QP {} -> remote QP {} (GID {}, LID {}) via port {} GID index {} MTU {}",
            self.qp_num,
            remote.qp_num,
            crate::wire::rdma::format_gid(&remote.gid),
            remote.lid,
            path.port,
            path.sgid_index,
            mtu_bytes(path.mtu)
        );
        self.modify(
            "ibv_modify_qp(RTR)",
            &mut a,
            IBV_QP_STATE
                | IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC
                | IBV_QP_MIN_RNR_TIMER,
            &detail,
        )?;

        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_RTS,
            timeout: TIMEOUT,
            retry_cnt: path.retry_cnt.min(7),
            rnr_retry: RNR_RETRY,
            sq_psn: 0,
            max_rd_atomic: MAX_RD_ATOMIC,
            ..Default::default()
        };
        self.modify(
            "ibv_modify_qp(RTS)",
            &mut a,
            IBV_QP_STATE
                | IBV_QP_TIMEOUT
                | IBV_QP_RETRY_CNT
                | IBV_QP_RNR_RETRY
                | IBV_QP_SQ_PSN
                | IBV_QP_MAX_QP_RD_ATOMIC,
            &detail,
        )
    }

    /// Moves the QP to the error state: every outstanding work request completes at once with
    /// `IBV_WC_WR_FLUSH_ERR` (how a deadline ends requests a silent peer would hold).
    pub fn set_error(&self) -> Result<(), VerbsError> {
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_ERR,
            ..Default::default()
        };
        self.modify(
            "ibv_modify_qp(ERR)",
            &mut a,
            IBV_QP_STATE,
            &format!("QP {}", self.qp_num),
        )
    }

    /// Posts `wrs` as one chain (one doorbell). Each local range is checked against its MR.
    /// On failure, the error says how many were posted (those will complete; the rest not).
    pub fn post(&self, wrs: &[Wr<'_>]) -> Result<(), VerbsError> {
        if wrs.is_empty() {
            return Ok(());
        }
        let device = &self.pd.ctx.name;
        let mut sges = Vec::with_capacity(wrs.len());
        for w in wrs {
            let end = w.offset.checked_add(w.len as usize);
            if w.len == 0 || end.is_none_or(|e| e > w.local.len) {
                return Err(VerbsError::Invalid {
                    device: device.clone(),
                    what: format!(
                        "local range [{}, +{}) outside its memory region of {} bytes (or empty)",
                        w.offset, w.len, w.local.len
                    ),
                });
            }
            if !Arc::ptr_eq(&w.local.pd, &self.pd) {
                return Err(VerbsError::Invalid {
                    device: device.clone(),
                    what: "the memory region belongs to another protection domain".into(),
                });
            }
            sges.push(ibv_sge {
                addr: (w.local.addr + w.offset) as u64,
                length: w.len,
                lkey: w.local.lkey,
            });
        }
        let mut chain: Vec<ibv_send_wr> = wrs
            .iter()
            .zip(sges.iter_mut())
            .map(|(w, sge)| ibv_send_wr {
                wr_id: w.wr_id,
                next: std::ptr::null_mut(),
                sg_list: sge,
                num_sge: 1,
                opcode: match w.op {
                    Op::Write => IBV_WR_RDMA_WRITE,
                    Op::Read => IBV_WR_RDMA_READ,
                },
                send_flags: if w.signaled { IBV_SEND_SIGNALED } else { 0 },
                imm_data: 0,
                remote_addr: w.remote_addr,
                rkey: w.rkey,
                _wr_rest: [0; 5],
                qp_type: 0,
                _pad: 0,
                _bind_mw_tso: [0; 6],
            })
            .collect();
        let base = chain.as_mut_ptr();
        for i in 1..chain.len() {
            // SAFETY: `i` and `i - 1` index `chain`, which is not moved while posting.
            unsafe { (*base.add(i - 1)).next = base.add(i) };
        }
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: a live QP whose context's ops table is the provider's; the chain and its
        // SGEs live until the call returns (the provider copies them into the send queue).
        let rc = unsafe {
            let Some(post) = (*(*self.qp).context).ops.post_send else {
                return Err(self.pd.ctx.err(
                    "ibv_post_send",
                    io::Error::from(io::ErrorKind::Unsupported),
                    "the provider has no post_send",
                ));
            };
            post(self.qp, base, &mut bad)
        };
        if rc != 0 {
            let posted = if bad.is_null() {
                0
            } else {
                (bad as usize - base as usize) / std::mem::size_of::<ibv_send_wr>()
            };
            let source = errno(rc);
            let fix = match source.raw_os_error() {
                Some(libc::ENOMEM) => format!("the send queue is full: keep at most {} work requests outstanding on this QP", self.max_send_wr),
                Some(libc::EINVAL) => "the QP is not in RTS (not connected, or in the error state after a failed request: rebuild it)".into(),
                _ => "see `dmesg`".into(),
            };
            return Err(VerbsError::Post {
                device: device.clone(),
                posted,
                total: wrs.len(),
                source,
                fix,
            });
        }
        Ok(())
    }
}
