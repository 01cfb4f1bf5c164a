//! Routing: which transport moves each piece, decided by what the transports declare.
//!
//! A [`Router`] holds the engine's preference order as data: a ranked list of routes, each a
//! transport and the piece kinds it is tried for at that rank (within what it declares,
//! [`Caps`]). A transport may hold two ranks: RDMA is tried first for pieces touching GPU
//! memory (GPUDirect, never staged) and after shared memory for host memory.
//!
//! Per piece: its kinds (local: the registered region's; remote: the peer's descriptor's
//! buffer, `cuda:N` or not) and whether the peer is the engine's own segment select the ranks
//! that may serve it; the first is asked ([`Transport::try_submit`]); what it refuses goes to
//! the next, the refusing transport excluded for those pieces from then on; what no rank
//! takes fails with every rank's reason. Nothing here knows a transport by name or type: the
//! ranks come from `transport::set`, which assembles the engine's transports.
//!
//! Hot path: a submission whose pieces are all of one kind (host memory to a peer without GPU
//! memory, the common case) is classified with one load per piece and handed on without an
//! allocation.

use crate::batch::FailKind;
use crate::error::Error;
use crate::transport::{remote_mem, Kinds, Mem, Peer, Piece, Reach, Transport};
use crate::wire::descriptor::SegmentDesc;
use std::sync::Arc;

/// One rank of the preference order.
struct Rank {
    transport: Arc<dyn Transport>,
    /// The transport's identity: a transport that refused pieces is not asked again for them
    /// at a later rank.
    id: usize,
    /// What it is tried for at this rank: its declared kinds, narrowed by the rank.
    kinds: Kinds,
    /// It reaches the engine's own segment (else only peers).
    own: bool,
}

/// The engine's routes, in order of preference.
pub(crate) struct Router {
    ranks: Vec<Rank>,
    /// Said before the reason when only one transport was asked and it refused (the mode
    /// that allows only it, e.g. `KVFERRY_TRANSPORT=shm`).
    only: Option<&'static str>,
}

/// A piece's (local, remote) memory kinds.
type Class = (Mem, Mem);

fn index((l, r): Class) -> usize {
    (l as usize) * 2 + r as usize
}

const CLASSES: [Class; 4] = [
    (Mem::Host, Mem::Host),
    (Mem::Host, Mem::Gpu),
    (Mem::Gpu, Mem::Host),
    (Mem::Gpu, Mem::Gpu),
];

impl Router {
    /// A router with no ranks yet; `only`: see [`Router::only`].
    pub(crate) fn new(only: Option<&'static str>) -> Router {
        Router {
            ranks: Vec::new(),
            only,
        }
    }

    /// Appends a rank: `transport`, tried for the pieces it declares it moves that `only`
    /// holds.
    pub(crate) fn rank(mut self, transport: &Arc<dyn Transport>, only: Kinds) -> Router {
        let caps = transport.caps();
        let id = match self
            .ranks
            .iter()
            .find(|r| Arc::ptr_eq(&r.transport, transport))
        {
            Some(r) => r.id,
            None => self.ranks.iter().map(|r| r.id + 1).max().unwrap_or(0),
        };
        assert!(id < 64, "at most 64 transports");
        self.ranks.push(Rank {
            transport: Arc::clone(transport),
            id,
            kinds: caps.kinds.and(only),
            own: caps.reach == Reach::Own,
        });
        self
    }

    /// The ranks, in order: each transport's name, what it is tried for there, and whether it
    /// serves the engine's own segment.
    #[cfg(test)]
    pub(crate) fn ranks(&self) -> impl Iterator<Item = (&'static str, Kinds, bool)> + '_ {
        self.ranks
            .iter()
            .map(|r| (r.transport.name(), r.kinds, r.own))
    }

    /// Hands each piece to the first transport, in order of preference, that serves its kinds
    /// and takes it; fails what none takes, with each one's reason.
    pub(crate) fn route(&self, peer: &Arc<Peer>, pieces: Vec<Piece>, inline: bool) {
        let Some(first) = pieces.first() else { return };
        let own = peer.is_own();
        // The peer's descriptor is read only when it publishes GPU memory.
        let desc = (!own && peer.has_gpu()).then(|| peer.desc());
        let class = |p: &Piece| classify(p, desc.as_deref());
        let c = class(first);
        if pieces.iter().all(|p| class(p) == c) {
            return self.route_class(peer, own, c, pieces, inline);
        }
        let mut by: [Vec<Piece>; 4] = Default::default();
        for p in pieces {
            by[index(class(&p))].push(p);
        }
        for (c, pieces) in CLASSES.into_iter().zip(by) {
            if !pieces.is_empty() {
                self.route_class(peer, own, c, pieces, inline);
            }
        }
    }

    fn route_class(
        &self,
        peer: &Arc<Peer>,
        own: bool,
        (l, r): Class,
        mut pieces: Vec<Piece>,
        inline: bool,
    ) {
        let mut refused = 0u64;
        let mut why: Vec<(&'static str, String)> = Vec::new();
        for rank in &self.ranks {
            if rank.own != own || !rank.kinds.contains(l, r) || refused & (1 << rank.id) != 0 {
                continue;
            }
            match rank.transport.try_submit(peer, pieces, inline) {
                Ok(()) => return,
                Err((back, e)) => {
                    pieces = back;
                    refused |= 1 << rank.id;
                    why.push((rank.transport.name(), e));
                    if pieces.is_empty() {
                        return;
                    }
                }
            }
        }
        let e = self.no_transport(peer, (l, r), why);
        for p in pieces {
            p.task.piece_failed(FailKind::Failed, &e);
        }
    }

    /// The transport that serves host memory to `peer`: the first that can reach it. The
    /// error lists why each could not.
    pub(crate) fn pick(&self, peer: &Arc<Peer>) -> Result<&Arc<dyn Transport>, Error> {
        let own = peer.is_own();
        let mut asked = 0u64;
        let mut why = Vec::new();
        for rank in &self.ranks {
            if rank.own != own
                || !rank.kinds.contains(Mem::Host, Mem::Host)
                || asked & (1 << rank.id) != 0
            {
                continue;
            }
            asked |= 1 << rank.id;
            match rank.transport.reachable(peer) {
                Ok(()) => return Ok(&rank.transport),
                Err(e) => why.push((rank.transport.name(), e)),
            }
        }
        Err(self.no_transport(peer, (Mem::Host, Mem::Host), why))
    }

    /// The error for pieces no transport took, with each one's reason.
    fn no_transport(&self, peer: &Peer, (l, r): Class, why: Vec<(&'static str, String)>) -> Error {
        let reason = match (self.only, why.as_slice()) {
            (_, []) => {
                format!("no transport of this engine moves {l} memory here to {r} memory of a peer")
            }
            (Some(only), [(_, e)]) => format!("{only}, but {e}"),
            (None, [(_, e)]) => e.clone(),
            _ => why
                .iter()
                .map(|(n, e)| format!("{n}: {e}"))
                .collect::<Vec<_>>()
                .join("; "),
        };
        Error::NoTransport {
            segment: peer.name.clone(),
            reason,
        }
    }
}

/// The kinds of `p`: local from its registered region, remote from the peer's descriptor
/// (`None`: it publishes no GPU memory, or it is the engine's own segment, whose local copy
/// serves either kind).
fn classify(p: &Piece, desc: Option<&SegmentDesc>) -> Class {
    let remote = match desc {
        Some(d) => remote_mem(d, p.remote, p.len),
        None => Mem::Host,
    };
    (Mem::local_of(p), remote)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::{Batch, TaskState, TaskStatus};
    use crate::memory::MemoryRegistry;
    use crate::transport::{Caps, Needs, Prelude};
    use crate::wire::descriptor::BufferDesc;
    use crate::wire::tcp::Opcode;
    use std::sync::Mutex;
    use std::time::{Duration, Instant};

    /// A transport that declares `caps`, refuses peers it was told to (and, of the others,
    /// pieces whose remote address is in `refuse`), and records what it took.
    struct Fake {
        name: &'static str,
        caps: Caps,
        unreachable: Option<&'static str>,
        refuse: Vec<u64>,
        took: Mutex<Vec<(u64, u64)>>,
        asked: Mutex<usize>,
    }

    impl Fake {
        fn new(name: &'static str, kinds: Kinds, reach: Reach) -> Fake {
            Fake {
                name,
                caps: Caps {
                    kinds,
                    reach,
                    needs: Needs::Nothing,
                    stageable: true,
                },
                unreachable: None,
                refuse: Vec::new(),
                took: Mutex::default(),
                asked: Mutex::default(),
            }
        }
        fn unreachable(mut self, why: &'static str) -> Fake {
            self.unreachable = Some(why);
            self
        }
        fn refusing(mut self, remote: u64) -> Fake {
            self.refuse.push(remote);
            self
        }
        fn took(&self) -> Vec<u64> {
            self.took.lock().unwrap().iter().map(|&(r, _)| r).collect()
        }
        fn asked(&self) -> usize {
            *self.asked.lock().unwrap()
        }
    }

    impl Transport for Fake {
        fn name(&self) -> &'static str {
            self.name
        }
        fn caps(&self) -> Caps {
            self.caps
        }
        fn describe(&self, _desc: &mut SegmentDesc, _prelude: Prelude) {}
        fn reachable(&self, _peer: &Arc<Peer>) -> Result<(), String> {
            match self.unreachable {
                Some(w) => Err(w.into()),
                None => Ok(()),
            }
        }
        fn submit(&self, _peer: &Arc<Peer>, pieces: Vec<Piece>, _inline: bool) {
            for p in pieces {
                self.took.lock().unwrap().push((p.remote, p.local));
                p.task.piece_done(p.len);
            }
        }
        fn try_submit(
            &self,
            peer: &Arc<Peer>,
            pieces: Vec<Piece>,
            inline: bool,
        ) -> Result<(), (Vec<Piece>, String)> {
            *self.asked.lock().unwrap() += 1;
            if let Err(e) = self.reachable(peer) {
                return Err((pieces, e));
            }
            let (no, yes): (Vec<Piece>, Vec<Piece>) = pieces
                .into_iter()
                .partition(|p| self.refuse.contains(&p.remote));
            self.submit(peer, yes, inline);
            if no.is_empty() {
                Ok(())
            } else {
                Err((no, format!("{} refuses", self.name)))
            }
        }
        fn shutdown(&self) {}
    }

    /// Registered memory to make pieces from: one host range, one GPU range (registered as
    /// GPU memory without a driver: nothing here touches it).
    struct Mem2 {
        reg: MemoryRegistry,
        host: Vec<u8>,
        gpu: u64,
        batch: Arc<Batch>,
    }

    impl Mem2 {
        fn new() -> Mem2 {
            let host = vec![0u8; 4096];
            let gpu = 0x7000_0000_0000u64;
            let reg = MemoryRegistry::new();
            reg.register_classified(
                &[(host.as_ptr() as u64, 4096), (gpu, 4096)],
                "*",
                &[("cpu:0".into(), None), ("cuda:0".into(), Some(0))],
            )
            .unwrap();
            Mem2 {
                reg,
                host,
                gpu,
                batch: Arc::new(Batch::new(64)),
            }
        }

        /// A 16-byte piece from host (or GPU) memory here to `remote`.
        fn piece(&self, gpu: bool, remote: u64) -> Piece {
            let local = if gpu {
                self.gpu
            } else {
                self.host.as_ptr() as u64
            };
            let task = Arc::new(TaskState::new(
                Instant::now() + Duration::from_secs(5),
                Arc::clone(&self.batch.signal),
            ));
            self.batch.tasks.lock().unwrap().push(Arc::clone(&task));
            Piece {
                opcode: Opcode::Write,
                local,
                remote,
                len: 16,
                task,
                guard: self.reg.check(local, 16).unwrap(),
            }
        }

        fn statuses(&self) -> Vec<(TaskStatus, Option<String>)> {
            self.batch
                .wait_all(Duration::ZERO)
                .into_iter()
                .map(|s| (s.status, s.reason))
                .collect()
        }
    }

    /// Remote addresses of a peer that publishes a host buffer at `HOST_R` and a GPU buffer
    /// at `GPU_R`.
    const HOST_R: u64 = 0x1000;
    const GPU_R: u64 = 0x9000;

    fn peer(id: u64) -> Arc<Peer> {
        let mut d = SegmentDesc::new("peer:1");
        for (name, addr) in [("cpu:0", HOST_R), ("cuda:0", GPU_R)] {
            d.buffers.push(BufferDesc {
                name: name.into(),
                addr,
                length: 0x1000,
                rkey: vec![],
                lkey: vec![],
                extra: Default::default(),
            });
        }
        Arc::new(Peer::new(id, "peer:1".into(), "peer".into(), d))
    }

    fn arc(f: &Arc<Fake>) -> Arc<dyn Transport> {
        Arc::clone(f) as Arc<dyn Transport>
    }

    /// The engine's `auto` order (with RDMA), on fakes: the own segment's copy; RDMA first for
    /// GPU memory; shared memory (host→host, anything→GPU); RDMA for host memory; staging over
    /// the own copy, shared memory (to host memory only) and TCP; TCP.
    struct Auto {
        local: Arc<Fake>,
        rdma: Arc<Fake>,
        shm: Arc<Fake>,
        tcp: Arc<Fake>,
        staged_local: Arc<Fake>,
        staged_shm: Arc<Fake>,
        staged_tcp: Arc<Fake>,
        router: Router,
    }

    fn auto(rdma: Fake, shm: Fake, tcp: Fake) -> Auto {
        let host_local = Kinds::local(Mem::Host);
        let gpu_local = Kinds::local(Mem::Gpu);
        // A staging decorator reaches what the transport it wraps reaches.
        let staged = |name, over: &Fake| Fake {
            unreachable: over.unreachable,
            ..Fake::new(name, gpu_local, over.caps.reach)
        };
        let local = Fake::new("local", host_local, Reach::Own);
        let staged_local = Arc::new(staged("staged-local", &local));
        let staged_shm = Arc::new(staged("staged-shm", &shm));
        let staged_tcp = Arc::new(staged("staged-tcp", &tcp));
        let (local, rdma, shm, tcp) = (
            Arc::new(local),
            Arc::new(rdma),
            Arc::new(shm),
            Arc::new(tcp),
        );
        let router = Router::new(None)
            .rank(&arc(&local), Kinds::ALL)
            .rank(&arc(&rdma), Kinds::GPU)
            .rank(&arc(&shm), Kinds::ALL)
            .rank(&arc(&rdma), Kinds::HOST)
            .rank(&arc(&staged_local), Kinds::ALL)
            .rank(&arc(&staged_shm), Kinds::remote(Mem::Host))
            .rank(&arc(&tcp), Kinds::ALL)
            .rank(&arc(&staged_tcp), Kinds::ALL);
        Auto {
            local,
            rdma,
            shm,
            tcp,
            staged_local,
            staged_shm,
            staged_tcp,
            router,
        }
    }

    fn rdma() -> Fake {
        Fake::new("rdma", Kinds::ALL, Reach::AnyHost)
    }
    fn shm() -> Fake {
        Fake::new(
            "shm",
            Kinds::HOST.or(Kinds::remote(Mem::Gpu)),
            Reach::SameHost,
        )
    }
    fn tcp() -> Fake {
        Fake::new("tcp", Kinds::local(Mem::Host), Reach::AnyHost)
    }

    #[test]
    fn kinds_are_pairs_and_staging_serves_gpu_memory_on_top() {
        let shm = Kinds::HOST.or(Kinds::remote(Mem::Gpu));
        assert!(shm.contains(Mem::Host, Mem::Host));
        assert!(shm.contains(Mem::Gpu, Mem::Gpu));
        assert!(!shm.contains(Mem::Gpu, Mem::Host));
        assert_eq!(
            Kinds::local(Mem::Host).staged(),
            Kinds::local(Mem::Gpu),
            "over TCP: GPU to host and GPU memory"
        );
        assert_eq!(shm.staged(), Kinds::local(Mem::Gpu));
        assert_eq!(Kinds::HOST.staged(), Kinds::pair(Mem::Gpu, Mem::Host));
        assert_eq!(Kinds::GPU.or(Kinds::HOST), Kinds::ALL);
        assert_eq!(format!("{:?}", Kinds::HOST), "{host→host}");
    }

    #[test]
    fn each_kind_of_piece_goes_to_the_first_capable_transport() {
        let m = Mem2::new();
        let a = auto(rdma().unreachable("no RDMA devices"), shm(), tcp());
        let p = peer(1);
        // Host→host, host→GPU, GPU→host, GPU→GPU to a same-host peer: shared memory,
        // shared memory (CUDA IPC), staged over shared memory, shared memory (CUDA IPC).
        a.router.route(
            &p,
            vec![
                m.piece(false, HOST_R),
                m.piece(false, GPU_R),
                m.piece(true, HOST_R + 16),
                m.piece(true, GPU_R + 16),
            ],
            false,
        );
        assert_eq!(a.shm.took(), [HOST_R, GPU_R, GPU_R + 16]);
        assert_eq!(a.staged_shm.took(), [HOST_R + 16]);
        assert!(a.tcp.took().is_empty() && a.staged_tcp.took().is_empty());
        // RDMA was asked about the GPU pieces only (and refused them, unreachable).
        assert_eq!(a.rdma.asked(), 3);
        assert!(m.statuses().iter().all(|s| s.0 == TaskStatus::Completed));
    }

    #[test]
    fn gpu_memory_tries_rdma_first_and_host_memory_after_shared_memory() {
        let m = Mem2::new();
        let a = auto(rdma(), shm().unreachable("another host"), tcp());
        let p = peer(1);
        a.router.route(
            &p,
            vec![m.piece(false, HOST_R), m.piece(true, GPU_R)],
            false,
        );
        assert_eq!(a.rdma.took(), [HOST_R, GPU_R]);
        assert_eq!(a.shm.asked(), 1, "host memory asks shared memory first");
        assert!(a.tcp.took().is_empty());
    }

    #[test]
    fn refused_pieces_fall_back_to_the_next_capable_transport() {
        let m = Mem2::new();
        // RDMA refuses one host piece (no keys for it), shared memory cannot reach the peer:
        // that piece goes over TCP, the other over RDMA.
        let a = auto(
            rdma().refusing(HOST_R + 16),
            shm().unreachable("another host"),
            tcp(),
        );
        let p = peer(1);
        a.router.route(
            &p,
            vec![m.piece(false, HOST_R), m.piece(false, HOST_R + 16)],
            false,
        );
        assert_eq!(a.rdma.took(), [HOST_R]);
        assert_eq!(a.tcp.took(), [HOST_R + 16]);
        // GPU memory RDMA refuses, to a peer shared memory cannot reach: staged over TCP
        // (host memory) and over TCP as it is (host→GPU: its server stages).
        let b = auto(
            rdma().refusing(GPU_R).refusing(HOST_R),
            shm().unreachable("another host"),
            tcp(),
        );
        b.router.route(
            &p,
            vec![m.piece(true, HOST_R), m.piece(false, GPU_R)],
            false,
        );
        assert_eq!(b.staged_tcp.took(), [HOST_R]);
        assert_eq!(b.tcp.took(), [GPU_R]);
        assert_eq!(b.staged_shm.asked(), 1, "staging over shared memory first");
        // A transport that refused a piece is not asked again for it at a later rank.
        assert_eq!(b.rdma.asked(), 2);
        assert!(m.statuses().iter().all(|s| s.0 == TaskStatus::Completed));
    }

    #[test]
    fn gpu_memory_that_shared_memory_cannot_open_is_staged_over_tcp() {
        let m = Mem2::new();
        // The peer's GPU export does not open here: GPU→GPU is staged over TCP (not over
        // shared memory, which reaches the peer's GPU memory only by CUDA IPC).
        let a = auto(rdma().unreachable("no RDMA"), shm().refusing(GPU_R), tcp());
        let p = peer(1);
        a.router.route(&p, vec![m.piece(true, GPU_R)], true);
        assert_eq!(a.staged_tcp.took(), [GPU_R]);
        assert_eq!(a.staged_shm.asked(), 0);
    }

    #[test]
    fn the_own_segment_goes_to_its_own_transports_only() {
        let m = Mem2::new();
        let a = auto(rdma(), shm(), tcp());
        let own = peer(0);
        a.router.route(
            &own,
            vec![m.piece(false, HOST_R), m.piece(true, HOST_R + 16)],
            true,
        );
        assert_eq!(a.local.took(), [HOST_R]);
        assert_eq!(a.staged_local.took(), [HOST_R + 16]);
        assert_eq!(a.rdma.asked() + a.shm.asked() + a.tcp.asked(), 0);
        assert_eq!(a.router.pick(&own).unwrap().name(), "local");
    }

    #[test]
    fn what_no_transport_takes_fails_with_each_ones_reason() {
        let m = Mem2::new();
        let a = auto(
            rdma().unreachable("no RDMA devices"),
            shm().unreachable("another host"),
            tcp().unreachable("no data port"),
        );
        let p = peer(1);
        a.router.route(&p, vec![m.piece(false, HOST_R)], false);
        let st = m.statuses();
        assert_eq!(st[0].0, TaskStatus::Failed);
        let why = st[0].1.clone().unwrap();
        assert!(
            why.contains("shm: another host; rdma: no RDMA devices; tcp: no data port"),
            "{why}"
        );
        let e = a.router.pick(&p).err().unwrap().to_string();
        assert!(
            e.contains("shm: another host; rdma: no RDMA devices"),
            "{e}"
        );
    }

    #[test]
    fn a_lone_transport_refusing_says_which_mode_allows_only_it() {
        let m = Mem2::new();
        let shm = Arc::new(shm().unreachable("it runs on another host"));
        let router = Router::new(Some("KVFERRY_TRANSPORT=shm")).rank(&arc(&shm), Kinds::ALL);
        let p = peer(1);
        router.route(&p, vec![m.piece(false, HOST_R)], false);
        let why = m.statuses()[0].1.clone().unwrap();
        assert!(
            why.contains("KVFERRY_TRANSPORT=shm, but it runs on another host"),
            "{why}"
        );
        // GPU→host: no rank serves it at all.
        router.route(&p, vec![m.piece(true, HOST_R)], false);
        let why = m.statuses()[1].1.clone().unwrap();
        assert!(
            why.contains("no transport of this engine moves GPU memory"),
            "{why}"
        );
    }

    #[test]
    fn pick_names_the_first_transport_that_reaches_the_peer() {
        let a = auto(rdma(), shm().unreachable("another host"), tcp());
        assert_eq!(a.router.pick(&peer(1)).unwrap().name(), "rdma");
        let b = auto(rdma().unreachable("no RDMA"), shm(), tcp());
        assert_eq!(b.router.pick(&peer(1)).unwrap().name(), "shm");
        let ranks: Vec<&str> = b.router.ranks().map(|(n, ..)| n).collect();
        assert_eq!(
            ranks,
            [
                "local",
                "rdma",
                "shm",
                "rdma",
                "staged-local",
                "staged-shm",
                "tcp",
                "staged-tcp"
            ]
        );
    }
}
