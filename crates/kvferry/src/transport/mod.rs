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
//! - [`Transport::caps`] declares what it serves ([`Caps`]: which memory kinds on either
//!   side, which segments, what a peer must publish), as UCX's transports declare theirs
//!   (`uct_iface_attr`); the router (`crate::route`) picks by these declarations and never by
//!   a transport's name or type.
//! - [`Transport::on_register`] sees every registration before it is published, so RDMA can
//!   register MRs and publish keys through [`Transport::describe`].
//! - [`Transport::submit`] never blocks on the network. Each piece ends exactly once through
//!   its [`TaskState`]: done, failed with a reason, or timed out at the task's deadline (every
//!   loop checks the deadline after each system call, so no peer can stretch it).
//! - [`Transport::try_submit`] may refuse pieces (all, or some: RDMA in `auto` takes those it
//!   carries as they are), handing them back with the reason; the router then offers them to
//!   the next capable transport.
//! - A piece ends only when the transport will not touch its local memory again; its
//!   [`RegionGuard`] goes with it. A revoked guard ([`RegionGuard::is_revoked`]: the range is
//!   being unregistered) stops the piece between system calls.
//! - [`Transport::on_unregister`] returns only once no peer can reach the range through this
//!   transport any more (the target-side half of the unregister barrier).
//! - What a transport asks of the engine (a peer's descriptor re-read, a handshake message
//!   sent) it asks through the [`PeerDirectory`] it was given at construction.
//!
//! The engine's transports are assembled in `set.rs` (the only place that names them) and
//! routed by `crate::route`.

pub(crate) mod local;
pub(crate) mod rdma;
pub(crate) mod set;
pub(crate) mod shm;
pub(crate) mod tcp;

pub(crate) use rdma::RdmaUsage;

use crate::batch::TaskState;
use crate::memory::{Region, RegionGuard};
use crate::wire::descriptor::SegmentDesc;
use crate::wire::handshake::MsgType;
use crate::wire::tcp::Opcode;
use std::any::Any;
use std::sync::{Arc, RwLock};

/// A contiguous part of one request.
pub(crate) struct Piece {
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
    pub(crate) fn host_bytes(&self) -> Option<&[u8]> {
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
    pub(crate) fn host_bytes_mut(&self) -> Option<&mut [u8]> {
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
pub(crate) struct Peer {
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

/// The kind of memory `[remote, remote+len)` is in according to a peer's descriptor: GPU
/// memory when the buffer holding it is published as `cuda:N`, else host memory (also for a
/// range outside every buffer: the transport that takes it fails it, saying why).
pub(crate) fn remote_mem(desc: &SegmentDesc, remote: u64, len: u64) -> Mem {
    match desc.find_buffer(remote, len) {
        Some(b) if b.name.starts_with("cuda:") => Mem::Gpu,
        _ => Mem::Host,
    }
}

impl Peer {
    pub(crate) fn new(id: u64, name: String, host: String, desc: SegmentDesc) -> Peer {
        let gpu = std::sync::atomic::AtomicBool::new(publishes_gpu(&desc));
        Peer {
            id,
            name,
            host,
            desc: RwLock::new(Arc::new(desc)),
            gpu,
        }
    }

    /// Whether this is the engine's own segment (id 0).
    pub(crate) fn is_own(&self) -> bool {
        self.id == 0
    }

    /// Whether the cached descriptor publishes GPU memory.
    pub(crate) fn has_gpu(&self) -> bool {
        self.gpu.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The cached descriptor.
    pub(crate) fn desc(&self) -> Arc<SegmentDesc> {
        Arc::clone(&self.desc.read().unwrap_or_else(|e| e.into_inner()))
    }

    pub(crate) fn set_desc(&self, desc: SegmentDesc) {
        let mut d = self.desc.write().unwrap_or_else(|e| e.into_inner());
        self.gpu
            .store(publishes_gpu(&desc), std::sync::atomic::Ordering::Release);
        *d = Arc::new(desc);
    }
}

/// A kind of memory a piece's range lies in, on either side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Mem {
    /// Host memory: the CPU may touch it.
    Host,
    /// GPU device memory: reached only through the CUDA driver's copies (or a NIC it is
    /// registered on).
    Gpu,
}

impl Mem {
    /// The local side of `p`: the kind of the registered region it lies in.
    pub(crate) fn local_of(p: &Piece) -> Mem {
        if p.guard.region().gpu.is_some() {
            Mem::Gpu
        } else {
            Mem::Host
        }
    }

    fn word(self) -> &'static str {
        match self {
            Mem::Host => "host",
            Mem::Gpu => "GPU",
        }
    }
}

impl std::fmt::Display for Mem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.word())
    }
}

/// A set of (local, remote) memory-kind pairs: the pieces a transport moves. A set of pairs,
/// not one set per side: shared memory moves host to host (cross-memory attach) and anything
/// to the peer's GPU memory (CUDA IPC), but not GPU to host memory.
#[derive(Clone, Copy, PartialEq, Eq, Default, Hash)]
pub(crate) struct Kinds(u8);

impl Kinds {
    /// Every pair.
    pub(crate) const ALL: Kinds = Kinds(0b1111);
    /// Host memory on both sides.
    pub(crate) const HOST: Kinds = Kinds::pair(Mem::Host, Mem::Host);
    /// Every pair with GPU memory on either side.
    pub(crate) const GPU: Kinds = Kinds(Kinds::ALL.0 & !Kinds::HOST.0);

    const fn bit(local: Mem, remote: Mem) -> u8 {
        1 << (local as u8 * 2 + remote as u8)
    }

    /// `local` to `remote` memory.
    pub(crate) const fn pair(local: Mem, remote: Mem) -> Kinds {
        Kinds(Kinds::bit(local, remote))
    }

    /// Every pair whose local side is `local`.
    pub(crate) const fn local(local: Mem) -> Kinds {
        Kinds(Kinds::bit(local, Mem::Host) | Kinds::bit(local, Mem::Gpu))
    }

    /// Every pair whose remote side is `remote`.
    pub(crate) const fn remote(remote: Mem) -> Kinds {
        Kinds(Kinds::bit(Mem::Host, remote) | Kinds::bit(Mem::Gpu, remote))
    }

    pub(crate) const fn or(self, other: Kinds) -> Kinds {
        Kinds(self.0 | other.0)
    }

    pub(crate) const fn and(self, other: Kinds) -> Kinds {
        Kinds(self.0 & other.0)
    }

    pub(crate) const fn contains(self, local: Mem, remote: Mem) -> bool {
        self.0 & Kinds::bit(local, remote) != 0
    }

    /// What staging GPU memory through host buffers serves on top of a transport that moves
    /// `self`: from local GPU memory, to every remote kind it moves from host memory.
    pub(crate) const fn staged(self) -> Kinds {
        let mut k = 0;
        if self.contains(Mem::Host, Mem::Host) {
            k |= Kinds::bit(Mem::Gpu, Mem::Host);
        }
        if self.contains(Mem::Host, Mem::Gpu) {
            k |= Kinds::bit(Mem::Gpu, Mem::Gpu);
        }
        Kinds(k)
    }

    /// The pairs, in a fixed order.
    pub(crate) fn pairs(self) -> impl Iterator<Item = (Mem, Mem)> {
        [
            (Mem::Host, Mem::Host),
            (Mem::Host, Mem::Gpu),
            (Mem::Gpu, Mem::Host),
            (Mem::Gpu, Mem::Gpu),
        ]
        .into_iter()
        .filter(move |&(l, r)| self.contains(l, r))
    }
}

impl std::fmt::Debug for Kinds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v: Vec<String> = self.pairs().map(|(l, r)| format!("{l}→{r}")).collect();
        write!(f, "{{{}}}", v.join(", "))
    }
}

/// Which segments a transport reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reach {
    /// The engine's own segment only.
    Own,
    /// Peers on this host only (verified, not assumed from a host name).
    SameHost,
    /// Peers on this host or another.
    AnyHost,
}

/// What a peer's descriptor must publish for a transport to reach it. Descriptive (for
/// diagnostics and the reader): [`Transport::reachable`] is what decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Needs {
    /// Nothing (the engine's own segment).
    Nothing,
    /// A TCP data port.
    TcpDataPort,
    /// The same-host field (`kvferry_shm`), naming a process this one may attach to.
    SameHostField,
    /// RDMA devices, and keys for the buffer a piece reaches.
    RdmaDevices,
}

/// What a transport declares it serves: the router (`crate::route`) picks by this, then asks
/// the transport itself ([`Transport::try_submit`]), which may still refuse a piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Caps {
    /// The (local, remote) memory kinds it moves.
    pub kinds: Kinds,
    /// Which segments it reaches.
    pub reach: Reach,
    /// What such a peer publishes.
    pub needs: Needs,
    /// It moves local host memory outside the engine's registrations as well (a staging
    /// decorator's bounce buffers), so staging may wrap it. RDMA cannot: its NICs reach only
    /// memory registered on them.
    pub stageable: bool,
}

/// What a transport may ask of the engine that owns it: one interface, handed to each
/// transport at construction, for every call back up (a peer's descriptor re-read, a
/// handshake message sent). After the engine is gone every request fails (or finds no peer).
pub(crate) trait PeerDirectory: Send + Sync {
    /// The open peer segment called `name`.
    fn peer_named(&self, name: &str) -> Option<Arc<Peer>>;
    /// Re-reads `peer`'s descriptor from its engine's handshake port and installs it.
    fn refresh(&self, peer: &Peer) -> Result<(), String>;
    /// Reads `peer`'s descriptor where segments are published (the metadata service in
    /// central mode, else the peer's handshake port), without installing it.
    fn lookup(&self, peer: &Peer) -> Result<SegmentDesc, String>;
    /// Sends one handshake message to `peer`'s engine; the body of its answer.
    fn handshake(&self, peer: &Peer, kind: MsgType, body: &[u8]) -> Result<Vec<u8>, String>;
    /// What the metadata service says of segment `name` now (central mode; without a
    /// service: `Unknown`). Asked of peers that connected to us, which we may never have opened.
    fn published(&self, _name: &str) -> Published {
        Published::Unknown
    }
}

/// What the metadata service says of a peer ([`PeerDirectory::published`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Published {
    /// Its entry is there; the handshake address it names, when that is `ip:port` (a host
    /// name is not resolved in a sweep).
    Listed(Option<std::net::SocketAddr>),
    /// The service answered: no entry for that name.
    Absent,
    /// No answer (service unreachable, no metadata service): nothing is concluded.
    Unknown,
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

/// What a transport read before the registry's buffer list was ([`Transport::before_describe`]).
pub(crate) type Prelude = Option<Box<dyn Any + Send>>;

/// A data path.
pub(crate) trait Transport: Send + Sync {
    /// The protocol string published in descriptors (`tcp`, `rdma`, …).
    fn name(&self) -> &'static str;
    /// What it serves: the router picks by this declaration.
    fn caps(&self) -> Caps;
    /// Reads what it publishes that must not be newer than the buffer list (shared memory:
    /// its unregister epoch); called before the registry's snapshot, the answer handed to
    /// [`Transport::describe`].
    fn before_describe(&self) -> Prelude {
        None
    }
    /// Adds what this transport publishes about the local segment (`desc.buffers`: the
    /// registry's snapshot, taken after [`Transport::before_describe`]).
    fn describe(&self, desc: &mut SegmentDesc, prelude: Prelude);
    /// Called before a range is published (RDMA registers an MR here).
    fn on_register(&self, _region: &Region) -> crate::Result<()> {
        Ok(())
    }
    /// Called after a range is withdrawn.
    fn on_unregister(&self, _region: &Region) {}
    /// Whether this transport can move data to `peer` (deciding once and caching the answer
    /// where that takes work); the error says why not.
    fn reachable(&self, peer: &Arc<Peer>) -> Result<(), String>;
    /// The engine opened `peer`'s segment and this transport will carry its requests: sets
    /// up now what its first request would otherwise set up on its way (TCP: its lanes
    /// connect; shared memory: the peer is verified and its buffers are mapped), so that
    /// request costs what later ones do. Never blocks on the network; what fails here is
    /// left for the first request to meet and report.
    fn warm(&self, _peer: &Arc<Peer>) {}
    /// Queues pieces for `peer`. Never blocks on the network. `inline`: the caller waits for
    /// them anyway (a synchronous call whose requests all go to this peer), so the transport
    /// may run them in the caller's thread when that is faster (TCP: a lone small request;
    /// shared memory: up to 1 MiB and 64 pieces; CUDA IPC: any).
    fn submit(&self, peer: &Arc<Peer>, pieces: Vec<Piece>, inline: bool);
    /// [`Transport::submit`] if `peer` is reachable, else the pieces back with the reason (a
    /// transport may also take some and hand back the rest: the router offers what comes back
    /// to the next capable transport). One decision per call: a transport whose `reachable`
    /// takes work overrides this so the hot path decides once, not twice.
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
    /// Answers a handshake message meant for this transport (RDMA: a peer's `Connection`);
    /// `None`: not one of its.
    fn on_handshake(&self, _kind: MsgType, _body: &[u8]) -> Option<Vec<u8>> {
        None
    }
    /// In a `fork()` child's copy: lets go of what it inherited from the parent (listening
    /// sockets, connections, shared regions), shutting nothing down for the parent.
    fn release_inherited(&self) {}
}
