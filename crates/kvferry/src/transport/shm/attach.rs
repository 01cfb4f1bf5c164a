//! Attaching to a same-host peer: verifying that the published process serves the segment
//! and that cross-memory attach works both ways, and claiming a slot in its control region.

use super::cma::*;
use super::ctl::*;
use super::maps::filler::Budget;
use super::maps::MapCache;
use super::ShmInfo;
use crate::wire::tcp::Opcode;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// How long a "still alive" check stands in for the check before the next copy. A PID can
/// only be reused after its process exited, was reaped and the PID counter wrapped.
pub(super) const ALIVE_FOR_NS: u64 = 1_000_000;

/// A verified same-host peer process.
pub(crate) struct ShmPeer {
    pub(super) pid: i32,
    pub(super) pidfd: OwnedFd,
    /// When the pidfd last said "alive" ([`now_ns`]).
    pub(super) alive_at: AtomicU64,
    pub(super) ctl: CtlMap,
    pub(super) slot: usize,
    pub(super) owner: u64,
    pub(super) cookie: String,
    /// The peer's shareable buffers mapped here, for the descriptor they were read from.
    pub(super) maps: Mutex<MapCache>,
    /// The peer's GPU memory opened here through CUDA IPC.
    pub(super) gpu: super::gpu::Opens,
    /// The process that attached (see [`foreign`]).
    pub(super) home: u32,
    /// The engine's budget for filling peers' fully allocated buffers in the background
    /// (`Config::shm_background_fill`; see `maps.rs` `filler`); `None`: none.
    pub(super) background_fill: Option<Arc<Budget>>,
}

impl ShmPeer {
    pub(super) fn exited(&self) -> bool {
        let gone = exited(&self.pidfd);
        if !gone {
            self.alive_at.store(now_ns(), Ordering::Relaxed);
        }
        gone
    }

    /// Like [`ShmPeer::exited`], but trusts an "alive" answer younger than [`ALIVE_FOR_NS`].
    pub(super) fn exited_lately(&self) -> bool {
        if now_ns().saturating_sub(self.alive_at.load(Ordering::Relaxed)) < ALIVE_FOR_NS {
            return false;
        }
        self.exited()
    }

    /// Verifies a peer and claims a slot in its control region.
    /// `background_fill`: the attaching engine's budget for filling this peer's fully
    /// allocated buffers in the background (`None`: no background fill).
    pub(super) fn attach(
        info: &ShmInfo,
        owner: u64,
        segment: &str,
        background_fill: Option<Arc<Budget>>,
    ) -> Result<ShmPeer, String> {
        let pid = info.pid;
        let pidfd = pidfd_open(pid).map_err(|e| match errno(&e) {
            Some(Errno::SRCH) => format!("process {pid} does not exist (in this PID namespace)"),
            Some(Errno::NOSYS) => {
                "the kernel lacks pidfd_open (Linux 5.3 or newer is needed)".to_string()
            }
            _ => format!("pidfd_open({pid}) failed: {e}"),
        })?;
        let memfd = pidfd_getfd(&pidfd, info.ctl_fd).map_err(|e| match errno(&e) {
            Some(Errno::PERM) | Some(Errno::ACCESS) => not_permitted(pid, "taking a file descriptor of", &e),
            Some(Errno::NOSYS) => "the kernel lacks pidfd_getfd (Linux 5.6 or newer is needed)".to_string(),
            _ => format!("cannot take the control region (fd {}) of process {pid}: {e}; its descriptor may be stale", info.ctl_fd),
        })?;
        if !rustix::fs::fstat(&memfd).is_ok_and(|st| st.st_size as u64 >= CTL_LEN as u64) {
            return Err(format!(
                "fd {} of process {pid} is not a kvferry control region",
                info.ctl_fd
            ));
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
        let ctl = CtlMap::map(&memfd)
            .map_err(|e| format!("cannot map the control region of process {pid}: {e}"))?;
        drop(memfd);
        let header = ctl.header();
        if u64::from_le_bytes(header[..8].try_into().unwrap_or_default()) != CTL_MAGIC
            || ctl.cookie_hex() != info.cookie
        {
            return Err(format!("process {pid} is not the engine that published this descriptor (cookie differs: the PID was reused or the descriptor is stale)"));
        }
        // The region is written only by its owner: it names the segment that process serves.
        // A descriptor that points at another engine's process (to make us write there) fails.
        let owner_name = ctl.name();
        if owner_name != segment.trim_start_matches('/')
            && !same_endpoint(&owner_name, segment.trim_start_matches('/'))
        {
            return Err(format!(
                "process {pid} serves segment {owner_name:?}, not {segment:?} (open the segment by the exact name the peer reports, or its descriptor points at another engine)"
            ));
        }
        // The copy itself must work, both ways: ptrace rules, seccomp, LSMs.
        let mut seen = [0u8; 24];
        let l = [IoVec::new(seen.as_mut_ptr() as u64, seen.len())];
        let r = [IoVec::new(info.ctl_addr, seen.len())];
        match cma(pid, Opcode::Read, &l, &r) {
            Ok(24) if seen == header => {}
            Ok(_) => return Err(format!("process_vm_readv of process {pid} returned other bytes than its control region holds (stale descriptor?)")),
            Err(e) if matches!(errno(&e), Some(Errno::PERM) | Some(Errno::ACCESS)) => {
                return Err(not_permitted(pid, "process_vm_readv of", &e))
            }
            Err(e) => return Err(format!("process_vm_readv of process {pid} failed: {e}")),
        }
        let token: u64 = rand::random::<u64>() | 1;
        let tb = token.to_le_bytes();
        let l = [IoVec::new(tb.as_ptr() as u64, 8)];
        let r = [IoVec::new(info.ctl_addr + OFF_PROBE as u64, 8)];
        match cma(pid, Opcode::Write, &l, &r) {
            Ok(8) if ctl.word(OFF_PROBE).load(Ordering::SeqCst) == token => {}
            Ok(_) => {
                return Err(format!(
                    "process_vm_writev into process {pid} did not land in its control region"
                ))
            }
            Err(e) if matches!(errno(&e), Some(Errno::PERM) | Some(Errno::ACCESS)) => {
                return Err(not_permitted(pid, "process_vm_writev into", &e))
            }
            Err(e) => return Err(format!("process_vm_writev into process {pid} failed: {e}")),
        }
        if exited(&pidfd) {
            return Err(format!("process {pid} exited"));
        }
        let slot = claim_slot(&ctl, owner)
            .ok_or_else(|| format!("all {N_SLOTS} initiator slots of process {pid} are taken"))?;
        Ok(ShmPeer {
            pid,
            pidfd,
            alive_at: AtomicU64::new(now_ns()),
            ctl,
            slot,
            owner,
            cookie: info.cookie.clone(),
            maps: Mutex::default(),
            gpu: Default::default(),
            home: std::process::id(),
            background_fill,
        })
    }

    /// Whether the peer is gone: its process exited or its engine shut down.
    pub(super) fn departed(&self) -> bool {
        exited(&self.pidfd) || self.ctl.closed().load(Ordering::Acquire) != 0
    }
}

/// Whether two `host:port` segment names reach the same listener: same port, and the hosts
/// resolve to a common address (`localhost:1500` and `127.0.0.1:1500`). Only one process
/// listens on an address and port, so a process whose control region names one of them
/// serves the segment opened by the other.
pub(super) fn same_endpoint(a: &str, b: &str) -> bool {
    use std::net::ToSocketAddrs;
    let resolve = |n: &str| -> Vec<std::net::SocketAddr> {
        n.to_socket_addrs().map(|i| i.collect()).unwrap_or_default()
    };
    let (ra, rb) = (resolve(a), resolve(b));
    ra.iter().any(|x| rb.contains(x))
}

impl Drop for ShmPeer {
    fn drop(&mut self) {
        if foreign(self.home) {
            return; // a forked child: the slot is the parent's, the mapping is not here
        }
        let _ = self.ctl.owner(self.slot).compare_exchange(
            self.owner,
            0,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
    }
}
