//! The one abstraction every data path implements.
//!
//! A [`Transport`] moves [`Piece`]s between local registered memory and a peer's registered
//! memory. It is one-sided by design: the initiator names the remote virtual address, the
//! target only exposes (and checks) registered ranges. That is the shape of RDMA READ/WRITE
//! with per-NIC keys and of GPU memory registered or staged; the TCP transport emulates it
//! with a tiny server on the target. A transport may be absent at run time (no NIC, no
//! driver): the engine asks [`Transport::reachable`] per peer and reports why not.
//!
//! Contract:
//! - [`Transport::on_register`] sees every registration before it is published, so RDMA can
//!   register MRs and publish keys through [`Transport::describe`].
//! - [`Transport::submit`] never blocks on the network. Each piece ends exactly once through
//!   its [`TaskState`]: done, failed with a reason, or timed out at the task's deadline (every
//!   loop checks the deadline after each system call, so no peer can stretch it).
//! - A piece ends only when the transport will not touch its local memory again; its
//!   [`RegionGuard`] goes with it. A revoked guard ([`RegionGuard::is_revoked`]: the range is
//!   being unregistered) stops the piece between system calls.
//! - [`Transport::on_unregister`] returns only once no peer can reach the range through this
//!   transport any more (the target-side half of the unregister barrier).
//!
//! What a transport asks of the engine (a peer's descriptor re-read, a handshake message sent)
//! it asks through the [`PeerDirectory`] it was given at construction.
//!
//! The engine keeps its transports in order of preference and hands a peer's pieces to the
//! first whose [`Transport::reachable`] says yes (`engine.rs`, `dispatch`).

pub mod local;
pub mod rdma;
pub mod shm;
pub mod tcp;

use crate::batch::TaskState;
use crate::memory::{Region, RegionGuard};
use crate::wire::descriptor::SegmentDesc;
use crate::wire::handshake::MsgType;
use crate::wire::tcp::Opcode;
use std::sync::{Arc, RwLock};

/// A contiguous part of one request.
pub struct Piece {
    pub opcode: Opcode,
    /// Local virtual address (inside registered memory).
    pub local: u64,
    /// Remote virtual address (inside a buffer of the peer's descriptor).
    pub remote: u64,
    pub len: u64,
    pub task: Arc<TaskState>,
    /// Keeps the local range registered until the piece ends.
    pub guard: RegionGuard,
}

impl Piece {
    /// The local range as bytes, when it lies in registered *host* memory (`None` for GPU
    /// memory, which only the driver may touch, or a range outside its guard's region).
    /// The one place that turns a piece's address into a slice: the guard keeps the range
    /// registered until the piece ends, and registration is the caller's promise that the
    /// memory stays valid meanwhile (the engine's contract: memory is registered by
    /// address, and peers may read and write it while it is).
    pub fn host_bytes(&self) -> Option<&[u8]> {
        let r = self.guard.region();
        let inside = self.local >= r.addr
            && self
                .local
                .checked_add(self.len)
                .is_some_and(|e| e <= r.end());
        // SAFETY: see above; the bounds were checked against the guard's region.
        (r.gpu.is_none() && inside).then(|| unsafe {
            std::slice::from_raw_parts(self.local as *const u8, self.len as usize)
        })
    }

    /// [`Piece::host_bytes`] to write into (a READ's destination).
    #[allow(clippy::mut_from_ref)]
    pub fn host_bytes_mut(&self) -> Option<&mut [u8]> {
        let r = self.guard.region();
        let inside = self.local >= r.addr
            && self
                .local
                .checked_add(self.len)
                .is_some_and(|e| e <= r.end());
        // SAFETY: as `host_bytes`; the piece is the one writer of its range for its life
        // (concurrent transfers over one range are the caller's to order, as in Mooncake).
        (r.gpu.is_none() && inside).then(|| unsafe {
            std::slice::from_raw_parts_mut(self.local as *mut u8, self.len as usize)
        })
    }
}

/// A peer segment as the engine knows it.
pub struct Peer {
    /// The engine's handle for this segment (0 is the engine itself).
    pub id: u64,
    /// The segment name (`host:port` in P2P mode).
    pub name: String,
    /// Host part of the name: where the peer's listeners are.
    pub host: String,
    desc: RwLock<Arc<SegmentDesc>>,
    /// The descriptor publishes GPU memory (a `cuda:N` buffer): read on every dispatch, so a
    /// peer without GPU memory costs one atomic load there, not a descriptor look.
    gpu: std::sync::atomic::AtomicBool,
}

fn publishes_gpu(d: &SegmentDesc) -> bool {
    d.buffers.iter().any(|b| b.name.starts_with("cuda:"))
}

impl Peer {
    pub fn new(id: u64, name: String, host: String, desc: SegmentDesc) -> Peer {
        let gpu = std::sync::atomic::AtomicBool::new(publishes_gpu(&desc));
        Peer {
            id,
            name,
            host,
            desc: RwLock::new(Arc::new(desc)),
            gpu,
        }
    }

    /// Whether the cached descriptor publishes GPU memory.
    pub fn has_gpu(&self) -> bool {
        self.gpu.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The cached descriptor.
    pub fn desc(&self) -> Arc<SegmentDesc> {
        Arc::clone(&self.desc.read().unwrap_or_else(|e| e.into_inner()))
    }

    pub fn set_desc(&self, desc: SegmentDesc) {
        let mut d = self.desc.write().unwrap_or_else(|e| e.into_inner());
        self.gpu
            .store(publishes_gpu(&desc), std::sync::atomic::Ordering::Release);
        *d = Arc::new(desc);
    }
}

/// What a transport may ask of the engine that owns it: one interface, handed to each
/// transport at construction, for every call back up (a peer's descriptor re-read, a
/// handshake message sent). After the engine is gone every request fails (or finds no peer).
pub trait PeerDirectory: Send + Sync {
    /// The open peer segment called `name`.
    fn peer_named(&self, name: &str) -> Option<Arc<Peer>>;
    /// Re-reads `peer`'s descriptor from its engine's handshake port and installs it.
    fn refresh(&self, peer: &Peer) -> Result<(), String>;
    /// Reads `peer`'s descriptor where segments are published (the metadata service in
    /// central mode, else the peer's handshake port), without installing it.
    fn lookup(&self, peer: &Peer) -> Result<SegmentDesc, String>;
    /// Sends one handshake message to `peer`'s engine; the body of its answer.
    fn handshake(&self, peer: &Peer, kind: MsgType, body: &[u8]) -> Result<Vec<u8>, String>;
}

/// A directory without an engine behind it (transports built on their own, in tests).
#[cfg(test)]
pub(crate) struct Detached;

#[cfg(test)]
impl PeerDirectory for Detached {
    fn peer_named(&self, _name: &str) -> Option<Arc<Peer>> {
        None
    }
    fn refresh(&self, _peer: &Peer) -> Result<(), String> {
        Err("no engine".into())
    }
    fn lookup(&self, _peer: &Peer) -> Result<SegmentDesc, String> {
        Err("no engine".into())
    }
    fn handshake(&self, _peer: &Peer, _kind: MsgType, _body: &[u8]) -> Result<Vec<u8>, String> {
        Err("no engine".into())
    }
}

/// A data path.
pub trait Transport: Send + Sync {
    /// The protocol string published in descriptors (`tcp`, `rdma`, …).
    fn name(&self) -> &'static str;
    /// Adds what this transport publishes about the local segment.
    fn describe(&self, desc: &mut SegmentDesc);
    /// Called before a range is published (RDMA registers an MR here).
    fn on_register(&self, _region: &Region) -> crate::Result<()> {
        Ok(())
    }
    /// Called after a range is withdrawn.
    fn on_unregister(&self, _region: &Region) {}
    /// Whether this transport can move data to `peer` (deciding once and caching the answer
    /// where that takes work); the error says why not.
    fn reachable(&self, peer: &Arc<Peer>) -> Result<(), String>;
    /// Queues pieces for `peer`. Never blocks on the network. `inline`: the caller waits for
    /// them anyway (a synchronous call whose requests all go to this peer), so the transport
    /// may run them in the caller's thread when that is faster (TCP: a lone small request;
    /// shared memory: up to 1 MiB and 64 pieces; CUDA IPC: any).
    fn submit(&self, peer: &Arc<Peer>, pieces: Vec<Piece>, inline: bool);
    /// [`Transport::submit`] if `peer` is reachable, else the pieces back with the reason.
    /// One decision per call: a transport whose `reachable` takes work overrides this so the
    /// hot path decides once, not twice.
    fn try_submit(
        &self,
        peer: &Arc<Peer>,
        pieces: Vec<Piece>,
        inline: bool,
    ) -> Result<(), (Vec<Piece>, String)> {
        match self.reachable(peer) {
            Ok(()) => {
                self.submit(peer, pieces, inline);
                Ok(())
            }
            Err(e) => Err((pieces, e)),
        }
    }
    /// Stops threads and closes connections; queued pieces fail.
    fn shutdown(&self);
}
