//! TCP transport: Mooncake's TCP data protocol (v2 acknowledged framing, v1 for old peers).
//!
//! Target side ([`TcpServer`], `server.rs`): one thread per connection (at most
//! [`server::MAX_DATA_CONNS`]) reads 24-byte headers, checks `[addr, addr+size)` against the registry
//! before touching memory, reads WRITE bodies straight into the destination and answers with
//! a status frame only after the last byte landed; READ data goes out straight from
//! registered memory. Small pipelined requests are parsed from one buffered read and their
//! status frames leave in one write.
//!
//! Initiator side ([`TcpTransport`], `lane.rs`): per peer, `lanes` persistent connections.
//! Each lane has a writer thread (headers and bodies gathered into `writev`, requests
//! pipelined) and a reader thread (status frames matched in order, READ data received
//! straight into local memory). Requests larger than the split size are cut across lanes.
//! Lanes unused for `idle` close and their threads end. A lone small request may run in the
//! caller's thread when a lane is idle. A request is COMPLETED only when the target's status
//! frame says its bytes landed; towards a v1 peer each WRITE is followed by a 1-byte READ
//! fence on the same connection, whose answer proves the preceding body was consumed.
//!
//! What every loop obeys (`sockio.rs`): sockets have a short timeout, and after every system
//! call — one that moved bytes as much as one that timed out — the loop asks its `stop`
//! check: the request's absolute deadline, the engine's shutdown, and whether the memory it
//! moves was unregistered ([`crate::memory::RegionGuard::is_revoked`]). A peer that trickles
//! bytes therefore cannot hold a request, a thread or a registered range past its deadline.
//! Nothing spins: threads block in the kernel or on condition variables.

use super::{Caps, Kinds, Mem, Needs, Peer, PeerDirectory, Piece, Prelude, Reach, Transport};
use crate::batch::{FailCause, FailKind, Failure};
use crate::memory::MemoryRegistry;
use crate::wire::descriptor::SegmentDesc;
use std::io;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Asked when a peer's data port refuses a connection (peer name, refused address, the
/// pieces that were to go there): [`TcpTransport::on_refused`] re-reads the peer's descriptor
/// (a peer restarted under the same name publishes new ports) and submits them again. Returns
/// the pieces it did not take; those fail with the connect error.
pub(crate) type RefusedHook = Arc<dyn Fn(&str, SocketAddr, Vec<Piece>) -> Vec<Piece> + Send + Sync>;

mod lane;
mod queue;
mod rules;
mod server;
mod sockio;
mod target_conn;

pub(crate) use server::TcpServer;

use lane::{Lane, LaneState, PeerLanes, PeerMap, WireOp};

// ------------------------------------------------------------------------------------------
// Initiator side
// ------------------------------------------------------------------------------------------

/// Tuning of the initiator side.
#[derive(Debug, Clone)]
pub(crate) struct TcpOptions {
    pub lanes: usize,
    pub split_bytes: u64,
    /// Highest protocol version to use (a peer advertising less gets less).
    pub max_proto: u32,
    pub connect_timeout: Duration,
    /// Host published as `tcp_data_host`.
    pub advertised_host: String,
    /// Requests up to this size may run in the caller's thread when the lane is idle.
    pub inline_max: u64,
    /// How long the caller polls for the answer of a small inline request before sleeping.
    pub spin: Duration,
    /// A lane unused this long closes its connection and its threads end.
    pub idle: Duration,
    /// The cluster key (`KVFERRY_AUTH_KEY_FILE`) and this engine's segment name: every data
    /// connection runs the key's handshake (bound to the segment dialed) before its first
    /// request, and seals its headers; `None`: Mooncake's protocol as it is.
    pub auth: Option<Arc<crate::auth::Keyed>>,
    /// With the key: what data connections protect beyond the handshake
    /// (`KVFERRY_AUTH_PROTECT`); the target refuses connections asking for less.
    pub protect: crate::auth::Protect,
}

/// The TCP transport of one engine: its data server and its lanes to peers.
pub(crate) struct TcpTransport {
    opts: TcpOptions,
    server: TcpServer,
    peers: Arc<PeerMap>,
    shut: AtomicBool,
    refused: Arc<OnceLock<RefusedHook>>,
    /// The engine: where a peer's descriptor is re-read when its data port refuses.
    dir: Arc<dyn PeerDirectory>,
}

impl TcpTransport {
    pub(crate) fn new(
        listener: TcpListener,
        registry: Arc<MemoryRegistry>,
        opts: TcpOptions,
        stall: Duration,
        dir: Arc<dyn PeerDirectory>,
    ) -> io::Result<Arc<TcpTransport>> {
        let server = TcpServer::start(
            listener,
            registry,
            stall,
            opts.spin,
            opts.auth.clone().map(|k| (k, opts.protect)),
        )?;
        let t = Arc::new(TcpTransport {
            opts,
            server,
            peers: Arc::default(),
            shut: AtomicBool::new(false),
            refused: Arc::default(),
            dir,
        });
        // The lanes' hook for a refused or lost connection (weak: lanes live in the transport).
        let w = Arc::downgrade(&t);
        let _ = t.refused.set(Arc::new(
            move |name: &str, refused: SocketAddr, pieces: Vec<Piece>| match w.upgrade() {
                Some(t) => t.on_refused(name, refused, pieces),
                None => pieces,
            },
        ));
        Ok(t)
    }

    /// A peer's data port refused a connection, or a connection to it was lost: re-reads its
    /// descriptor where segments are published (the metadata service, or its handshake
    /// port). Pieces whose remote range it no longer lists fail as not registered (a v1 target
    /// answers a request outside its memory only by closing the connection: this is how that
    /// is told apart from a lost peer). If it lists another data address (it restarted under
    /// the same name) the rest are queued there; otherwise they are handed back to fail as
    /// they were going to.
    fn on_refused(&self, name: &str, refused: SocketAddr, pieces: Vec<Piece>) -> Vec<Piece> {
        let Some(peer) = self.dir.peer_named(name) else {
            return pieces;
        };
        let desc = match self.dir.lookup(&peer) {
            Ok(d) => d,
            Err(e) => {
                tracing::debug!("{name} refused or lost a connection and its descriptor could not be refreshed: {e}");
                return pieces;
            }
        };
        let moved = matches!(TcpTransport::data_addr(&peer, &desc), Ok(a) if a != refused);
        let (ok, gone): (Vec<Piece>, Vec<Piece>) = pieces
            .into_iter()
            .partition(|p| desc.find_buffer(p.remote, p.len).is_some());
        peer.set_desc(desc);
        for p in gone {
            let e = crate::Error::RemoteNotRegistered {
                segment: name.to_string(),
                addr: p.remote,
                len: p.len,
            };
            p.task.piece_failed(FailKind::Failed, &e);
        }
        if !moved {
            return ok;
        }
        tracing::info!(
            segment = name,
            "peer moved to new ports (restarted?); retrying on its new descriptor"
        );
        if !ok.is_empty() {
            self.submit(&peer, ok, false);
        }
        Vec::new()
    }

    /// The data address of `peer` according to `desc` (what lanes connect to).
    pub(crate) fn data_addr(peer: &Peer, desc: &SegmentDesc) -> Result<SocketAddr, String> {
        let host = desc.data_host(&peer.host);
        (host, desc.tcp_data_port)
            .to_socket_addrs()
            .map_err(|e| format!("cannot resolve {host}: {e}"))?
            .next()
            .ok_or_else(|| format!("{host} resolves to no address"))
    }

    pub(crate) fn data_port(&self) -> u16 {
        self.server.port()
    }

    /// Peers with open lanes, and connections the data server is serving (for tests and
    /// `kvferry doctor`: what departed peers still cost).
    pub(crate) fn usage(&self) -> (usize, usize) {
        (
            self.peers.lock().unwrap_or_else(|e| e.into_inner()).len(),
            self.server.connections(),
        )
    }

    fn lanes_for(&self, peer: &Peer, desc: &SegmentDesc) -> Result<Arc<PeerLanes>, String> {
        let host = desc.data_host(&peer.host);
        let addr = (host, desc.tcp_data_port)
            .to_socket_addrs()
            .map_err(|e| format!("cannot resolve {host}: {e}"))?
            .next()
            .ok_or_else(|| format!("{host} resolves to no address"))?;
        // (A keyed connection always frames v2: both sides are kvferry engines.)
        let v2 = (desc.tcp_version() >= 2 && self.opts.max_proto >= 2) || self.opts.auth.is_some();
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = peers.get(&(addr, v2)) {
            return Ok(Arc::clone(p));
        }
        let mut lanes = Vec::with_capacity(self.opts.lanes);
        for _ in 0..self.opts.lanes {
            let lane = Arc::new(Lane {
                target: addr,
                peer_name: peer.name.clone(),
                v2,
                connect_timeout: self.opts.connect_timeout,
                spin: self.opts.spin,
                st: Mutex::new(LaneState::new(Instant::now())),
                wake_writer: Condvar::new(),
                wake_reader: Condvar::new(),
                load: AtomicU64::new(0),
                refused: Arc::clone(&self.refused),
                refreshing: Arc::default(),
                idle: self.opts.idle,
                home: Arc::downgrade(&self.peers),
                key: (addr, v2),
                auth: self.opts.auth.as_ref().map(|k| Arc::clone(&k.key)),
                protect: self.opts.protect,
            });
            let (w, r) = (Arc::clone(&lane), Arc::clone(&lane));
            std::thread::Builder::new()
                .name("kvf-lane-tx".into())
                .spawn(move || w.writer_loop())
                .map_err(|e| e.to_string())?;
            std::thread::Builder::new()
                .name("kvf-lane-rx".into())
                .spawn(move || r.reader_loop())
                .map_err(|e| e.to_string())?;
            lanes.push(lane);
        }
        let p = Arc::new(PeerLanes {
            lanes,
            rr: AtomicUsize::new(0),
        });
        peers.insert((addr, v2), Arc::clone(&p));
        Ok(p)
    }
}

impl TcpTransport {
    /// Runs a lone request in the caller's thread when a lane to the peer is connected and
    /// idle (see `Lane::run_inline`); otherwise queues it like [`Transport::submit`].
    pub(crate) fn submit_one(&self, peer: &Arc<Peer>, piece: Piece) {
        let mut piece = piece;
        if piece.len <= self.opts.inline_max && !self.shut.load(Ordering::Acquire) {
            if let Ok(lanes) = self.lanes_for(peer, &peer.desc()) {
                // The first connected idle lane: lone requests keep using the same connection,
                // whose server thread is then still polling for the next one.
                for i in 0..lanes.lanes.len() {
                    match lanes.lanes[i].run_inline(piece) {
                        Ok(()) => return,
                        Err(p) => piece = p,
                    }
                }
            }
        }
        self.queue(peer, vec![piece])
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    /// Host memory here to host or GPU memory of any peer that publishes a data port (its
    /// server stages GPU memory through host buffers).
    fn caps(&self) -> Caps {
        Caps {
            kinds: Kinds::local(Mem::Host),
            reach: Reach::AnyHost,
            needs: Needs::TcpDataPort,
            stageable: true,
        }
    }

    fn describe(&self, desc: &mut SegmentDesc, _prelude: Prelude) {
        desc.tcp_data_port = self.server.port();
        desc.tcp_data_host = Some(self.opts.advertised_host.clone());
        desc.tcp_proto_version = Some(2);
    }

    fn reachable(&self, peer: &Arc<Peer>) -> Result<(), String> {
        let d = peer.desc();
        if d.tcp_data_port == 0 {
            return Err(format!(
                "segment {} publishes no TCP data port (protocol {:?})",
                peer.name, d.protocol
            ));
        }
        Ok(())
    }

    /// The peer's lanes are made and their writers connect (each in its own thread), so
    /// the first request neither starts threads nor waits for a connection (nor, with a
    /// cluster key, for its handshake) when it comes after them.
    fn warm(&self, peer: &Arc<Peer>) {
        if self.shut.load(Ordering::Acquire) {
            return;
        }
        let lanes = match self.lanes_for(peer, &peer.desc()) {
            Ok(l) => l,
            Err(e) => {
                tracing::debug!(segment = %peer.name, "not connecting ahead of the first request: {e}");
                return;
            }
        };
        let now = Instant::now();
        for l in &lanes.lanes {
            if l.lock().warm(now) {
                l.wake_writer.notify_one();
            }
        }
    }

    fn submit(&self, peer: &Arc<Peer>, pieces: Vec<Piece>, inline: bool) {
        if inline && pieces.len() == 1 {
            if let Some(p) = pieces.into_iter().next() {
                self.submit_one(peer, p);
            }
            return;
        }
        self.queue(peer, pieces)
    }

    fn shutdown(&self) {
        self.shut.store(true, Ordering::Release);
        self.server.shutdown();
        for (_, p) in self.peers.lock().unwrap_or_else(|e| e.into_inner()).drain() {
            for l in &p.lanes {
                l.stop();
            }
        }
    }

    fn release_inherited(&self) {
        self.release_fds();
    }
}

impl TcpTransport {
    /// In a `fork()` child's copy: lets go of the parent's data listener, the connections it
    /// serves and its lanes' connections to peers (each whose lock is free), shutting
    /// nothing down for the parent (see `crate::forked`).
    fn release_fds(&self) {
        use std::os::fd::AsFd;
        self.server.release_inherited();
        if let Some(peers) = crate::forked::try_lock(&self.peers) {
            for p in peers.values() {
                for l in &p.lanes {
                    if let Some(st) = crate::forked::try_lock(&l.st) {
                        if let Some(c) = st.conn_ref() {
                            crate::forked::detach(c.as_fd());
                        }
                    }
                }
            }
        }
    }

    /// Queues pieces on the lanes to `peer` (cut across lanes when large).
    fn queue(&self, peer: &Arc<Peer>, pieces: Vec<Piece>) {
        let fail_all = |pieces: Vec<Piece>, f: Failure| {
            for p in pieces {
                p.task.piece_failed(FailKind::Failed, f.clone());
            }
        };
        if self.shut.load(Ordering::Acquire) {
            return fail_all(pieces, FailCause::ShutDown.because("engine shut down"));
        }
        let desc = peer.desc();
        let lanes = match self.lanes_for(peer, &desc) {
            Ok(l) => l,
            Err(e) => return fail_all(pieces, FailCause::PeerUnreachable.because(e)),
        };
        let n = lanes.lanes.len();
        let mut per_lane: Vec<Vec<WireOp>> = (0..n).map(|_| Vec::new()).collect();
        for p in pieces {
            let chunks = if p.len > self.opts.split_bytes && n > 1 {
                p.len.div_ceil(self.opts.split_bytes).min(64)
            } else {
                1
            };
            if chunks == 1 {
                let i = lanes.pick();
                lanes.lanes[i].load.fetch_add(p.len, Ordering::AcqRel);
                per_lane[i].push(WireOp {
                    piece: p,
                    attempts: 0,
                });
                continue;
            }
            // Cut into `chunks` pieces of about equal size, 4 KiB aligned.
            let step = p.len.div_ceil(chunks).next_multiple_of(4096);
            let count = p.len.div_ceil(step);
            p.task.split(count as u32);
            let mut off = 0;
            while off < p.len {
                let len = step.min(p.len - off);
                let i = lanes.pick();
                lanes.lanes[i].load.fetch_add(len, Ordering::AcqRel);
                per_lane[i].push(WireOp {
                    piece: Piece {
                        opcode: p.opcode,
                        local: p.local + off,
                        remote: p.remote + off,
                        len,
                        task: Arc::clone(&p.task),
                        guard: p.guard.clone(),
                    },
                    attempts: 0,
                });
                off += len;
            }
        }
        let mut retired: Vec<Piece> = Vec::new();
        for (i, ops) in per_lane.into_iter().enumerate() {
            if ops.is_empty() {
                continue;
            }
            let lane = &lanes.lanes[i];
            let queued = lane.lock().enqueue(ops, Instant::now());
            match queued {
                Ok(()) => lane.wake_writer.notify_one(),
                Err(ops) => {
                    // Closed as idle since we picked it (or shutting down): new lanes take these.
                    for op in ops {
                        lane.load.fetch_sub(op.piece.len, Ordering::AcqRel);
                        retired.push(op.piece);
                    }
                }
            }
        }
        if !retired.is_empty() {
            // A part of a split piece counts as one piece; submitting it again (and maybe
            // splitting it again) keeps the task's piece count right.
            self.queue(peer, retired);
        }
    }
}

#[cfg(any(test, feature = "fuzzing"))]
pub(crate) use target_conn::fuzz_drive;
