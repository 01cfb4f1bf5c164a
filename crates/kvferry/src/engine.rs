//! [`TransferEngine`]: memory registration, segments, batches, notifies.

use crate::batch::{Batch as Tasks, FailKind, TaskState, TransferStatus};
use crate::config::{split_host_port, Config};
use crate::error::{Error, Result};
use crate::handshake::{self, HandshakeServer};
use crate::memory::{MemoryRegistry, Region};
use crate::metadata::{Directory, Keys, RpcMeta, StoreOptions};
use crate::transport::set::{Build, TransportSet};
use crate::transport::{Peer, PeerDirectory, Piece, Prelude, RdmaUsage};
use crate::wire::descriptor::{BufferDesc, SegmentDesc};
use crate::wire::handshake::{parse_json, Frame, MsgType, NotifyMsg, ProbeReply};
use crate::Opcode;
use rand::Rng;
use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::{Duration, Instant};

mod handle;
mod plan;

pub use handle::Batch;
pub use plan::PageTable;

/// A segment handle returned by [`TransferEngine::open_segment`].
pub type SegmentId = u64;
/// The engine's own segment.
pub const LOCAL_SEGMENT_ID: SegmentId = 0;

/// One request: move `length` bytes between local `source` and remote `target_offset`
/// (an absolute virtual address inside a buffer the target registered).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferRequest {
    pub opcode: Opcode,
    pub source: u64,
    pub target_id: SegmentId,
    pub target_offset: u64,
    pub length: u64,
}

/// A received notify message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notify {
    pub name: String,
    pub msg: String,
}

struct Segments {
    by_name: HashMap<String, SegmentId>,
    by_id: Vec<Arc<Peer>>,
}

/// A service installed on an engine's handshake port ([`TransferEngine::serve`]): a
/// request's body in, the reply's body out.
pub type ServiceFn = Arc<dyn Fn(&[u8]) -> Vec<u8> + Send + Sync>;

struct Inner {
    config: Config,
    name: String,
    memory: Arc<MemoryRegistry>,
    /// The transports (through the trait only), their routes in order of preference (by
    /// `KVFERRY_TRANSPORT`) and what diagnostics report of them.
    transports: TransportSet,
    handshake: HandshakeServer,
    /// The cluster key (`KVFERRY_AUTH_KEY_FILE`): handshakes and data connections, both
    /// ways, prove it; `None`: Mooncake's protocols as they are.
    auth: Option<Arc<crate::auth::ClusterKey>>,
    segments: RwLock<Segments>,
    /// The number the next batch gets ([`Batch::id`]).
    next_batch: AtomicU64,
    notifies: Mutex<Vec<Notify>>,
    notify_cv: std::sync::Condvar,
    /// What answers `Service` requests ([`TransferEngine::serve`]); none: they are refused.
    service: RwLock<Option<ServiceFn>>,
    /// Central metadata mode: the service segments are published in and looked up from.
    directory: Option<Arc<Directory>>,
    /// The process that started the engine: only it may shut the engine down (see Drop).
    pid: u32,
    /// Requests whose remote range is not in the cached descriptor wait here for a refresh
    /// of it, done by a helper thread (started at first use): `submit` itself never waits
    /// for the network.
    refresher: Mutex<Option<std::sync::mpsc::Sender<RefreshJob>>>,
    me: Weak<Inner>,
}

/// The engine as its transports and its handshake server see it (a [`PeerDirectory`]),
/// handed to them at construction and bound to the engine once it is built: before that,
/// and after it is gone, no peer is found, every request fails and the handshake server
/// answers `{}`.
#[derive(Default)]
struct Link(OnceLock<Weak<Inner>>);

impl Link {
    fn engine(&self) -> std::result::Result<Arc<Inner>, String> {
        self.0
            .get()
            .and_then(Weak::upgrade)
            .ok_or_else(|| "the engine shut down".to_string())
    }

    fn on_handshake(&self, f: &Frame) -> Vec<u8> {
        match self.engine() {
            Ok(inner) => inner.on_handshake(f),
            Err(_) => b"{}".to_vec(),
        }
    }
}

impl PeerDirectory for Link {
    fn peer_named(&self, name: &str) -> Option<Arc<Peer>> {
        let inner = self.engine().ok()?;
        let id = *inner
            .segments
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .by_name
            .get(name)?;
        inner.peer(id).ok()
    }

    fn refresh(&self, peer: &Peer) -> std::result::Result<(), String> {
        self.engine()?.refresh_peer(peer)
    }

    fn lookup(&self, peer: &Peer) -> std::result::Result<SegmentDesc, String> {
        self.engine()?
            .refresh_descriptor(peer)
            .map_err(|e| e.to_string())
    }

    fn handshake(
        &self,
        peer: &Peer,
        kind: MsgType,
        body: &[u8],
    ) -> std::result::Result<Vec<u8>, String> {
        let inner = self.engine()?;
        let (h, p) = inner.rpc_addr(&peer.name).map_err(|e| e.to_string())?;
        inner
            .request(&peer.name, &h, p, kind, body)
            .map(|f| f.body)
            .map_err(|e| e.to_string())
    }

    fn published(&self, name: &str) -> crate::transport::Published {
        use crate::transport::Published;
        let dir = self.engine().ok().and_then(|e| e.directory.clone());
        match dir.map(|d| d.fetch_rpc_meta(name)) {
            Some(Ok(m)) => {
                Published::Listed(format!("{}:{}", m.ip_or_host_name, m.rpc_port).parse().ok())
            }
            Some(Err(Error::SegmentNotRegistered { .. })) => Published::Absent,
            _ => Published::Unknown,
        }
    }
}

/// Pieces to a peer whose cached descriptor does not list their remote ranges.
struct RefreshJob {
    peer: Arc<Peer>,
    pieces: Vec<Piece>,
}

/// The data path requests to a segment take ([`TransferEngine::segment_transport`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentTransport {
    /// `local` (the engine's own segment), `shm` (same host, cross-memory attach) or `tcp`.
    pub name: &'static str,
    /// Why shared memory is not used for this segment, when it is not.
    pub why_not_shm: Option<String>,
}

/// The transfer engine: one local segment, any number of peers.
///
/// Dropping it stops its listeners and lanes; requests still queued fail.
pub struct TransferEngine {
    inner: Arc<Inner>,
}

/// Binds a listener on a random free port of the configured range.
fn bind_in_range(ip: IpAddr, cfg: &Config, what: &'static str) -> Result<TcpListener> {
    let mut rng = rand::rng();
    let span = u32::from(cfg.max_port - cfg.min_port) + 1;
    let attempts = 500.min(span as usize * 4);
    let mut last_err = None;
    for _ in 0..attempts {
        let port = rng.random_range(cfg.min_port..=cfg.max_port);
        match TcpListener::bind(SocketAddr::new(ip, port)) {
            Ok(l) => return Ok(l),
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => last_err = Some(e),
            Err(e) => {
                let hint = if e.kind() == io::ErrorKind::AddrNotAvailable {
                    format!("{ip} is not an address of this host; pass one of this host's addresses as local_hostname (`kvferry doctor` lists them) or set KVFERRY_BIND_ADDRESS")
                } else {
                    "check permissions and KVFERRY_BIND_ADDRESS".to_string()
                };
                return Err(Error::Bind {
                    what,
                    addr: format!("{ip}:{port}"),
                    hint,
                    source: e,
                });
            }
        }
    }
    Err(Error::Bind {
        what,
        addr: format!("{ip}:{}-{}", cfg.min_port, cfg.max_port),
        hint: "every port tried is in use; widen KVFERRY_MIN_PORT/KVFERRY_MAX_PORT".into(),
        source: last_err.unwrap_or_else(|| io::Error::from(io::ErrorKind::AddrInUse)),
    })
}

/// Resolves the advertised host to the address the listeners bind.
pub fn resolve_advertised(host: &str) -> Result<IpAddr> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(ip);
    }
    let addrs: Vec<IpAddr> = (host, 0u16)
        .to_socket_addrs()
        .map_err(|e| {
            Error::Config(format!(
                "cannot resolve local hostname {host:?}: {e}; pass an IP address of this host"
            ))
        })?
        .map(|a| a.ip())
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| Error::Config(format!("local hostname {host:?} resolves to no address")))
}

impl TransferEngine {
    /// Starts an engine: binds the handshake and TCP data listeners on the advertised address
    /// (or `KVFERRY_BIND_ADDRESS`) at random ports of the configured range.
    pub fn new(config: Config) -> Result<TransferEngine> {
        config.validate()?;
        // Central mode: connect to the metadata service first (an unreachable one fails fast).
        let directory = match crate::metadata::connect(
            &config.metadata_server,
            &StoreOptions::from_config(&config),
        )? {
            Some(store) => Some(Directory::new(
                store,
                Keys::new(config.metadata_cluster_id.as_deref()),
            )),
            None => None,
        };
        let host = config.advertised_host().to_string();
        if host.is_empty() {
            return Err(Error::Config(
                "local_hostname is empty; pass this host's IP address".into(),
            ));
        }
        let ip = resolve_advertised(&host)?;
        let bind_ip = config.bind_address.unwrap_or(ip);
        let hs_listener = bind_in_range(bind_ip, &config, "the handshake listener")?;
        let data_listener = bind_in_range(bind_ip, &config, "the TCP data listener")?;
        let port = hs_listener
            .local_addr()
            .map_err(|e| Error::io("reading the handshake port", e))?
            .port();
        let name = if directory.is_some() {
            // Central mode: the segment name is local_hostname exactly as given.
            config.local_hostname.trim().to_string()
        } else if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let memory = Arc::new(MemoryRegistry::new());
        // The cluster key, read once: a file that cannot be used stops the engine here.
        let auth = crate::auth::ClusterKey::from_config(config.auth_key_file.as_deref())
            .map_err(|e| Error::Config(e.to_string()))?
            .map(Arc::new);
        // The engine's one link for what its transports and handshake server ask of it.
        let link = Arc::new(Link::default());
        let transports = TransportSet::build(
            Build {
                config: &config,
                name: &name,
                host: &host,
                data_listener,
                memory: Arc::clone(&memory),
                auth: auth.clone(),
                central: directory.is_some(),
            },
            Arc::clone(&link) as Arc<dyn PeerDirectory>,
        )?;
        // The handshake server starts before the engine exists (starting its thread can fail,
        // and `new_cyclic` cannot return the error); until the engine is built, and after it
        // is gone, it answers `{}`.
        let l = Arc::clone(&link);
        let handler: handshake::Handler = Arc::new(move |f: &Frame| l.on_handshake(f));
        let keyed = auth.clone().map(|key| crate::auth::Keyed {
            key,
            names: vec![name.clone()],
        });
        let handshake =
            HandshakeServer::start(hs_listener, config.handshake_max_len, handler, keyed)
                .map_err(|e| Error::io("starting the handshake server's thread", e))?;
        let inner = Arc::new_cyclic(|weak: &Weak<Inner>| {
            let _ = link.0.set(weak.clone());
            let local_peer = Arc::new(Peer::new(
                LOCAL_SEGMENT_ID,
                name.clone(),
                host,
                SegmentDesc::new(name.clone()),
            ));
            Inner {
                name: name.clone(),
                transports,
                memory,
                handshake,
                auth,
                segments: RwLock::new(Segments {
                    by_name: HashMap::from([(name, LOCAL_SEGMENT_ID)]),
                    by_id: vec![local_peer],
                }),
                next_batch: AtomicU64::new(1),
                notifies: Mutex::default(),
                notify_cv: std::sync::Condvar::new(),
                service: RwLock::new(None),
                directory,
                config,
                pid: std::process::id(),
                refresher: Mutex::new(None),
                me: weak.clone(),
            }
        });
        tracing::info!(segment = %inner.name, data_port = inner.transports.diag.data_port(), "transfer engine started");
        let engine = TransferEngine { inner };
        // On error the engine is dropped here, which stops its listeners.
        engine.inner.start_refresher()?;
        if engine.inner.directory.is_some() {
            // On error the engine is dropped here, which stops its listeners.
            let host = engine.inner.config.advertised_host().to_string();
            engine.inner.register_central(&host, port)?;
        }
        Ok(engine)
    }

    /// In a `fork()` child holding a copy of its parent's engine: lets go of the parent's
    /// listening sockets, its connections to peers and its shared-memory control region, so
    /// that they close when the parent closes them or dies (its ports refuse connections even
    /// while the child lives), and shuts nothing down for the parent. The copy is unusable
    /// in the child anyway (the engine's threads do not exist there). Dropping the copy does
    /// this too; Python calls it right after a fork. Does nothing in the engine's own
    /// process. Left held until the child exits or execs: peers' mapped buffers and pidfds,
    /// connections whose table a thread of the parent had locked at the fork, the metadata
    /// client's connections, RDMA devices.
    pub fn release_inherited(&self) {
        if std::process::id() == self.inner.pid {
            return;
        }
        self.inner.handshake.release_inherited();
        for t in &self.inner.transports.all {
            t.release_inherited();
        }
    }

    /// With RDMA: the endpoints (NIC pairs it connected to peers) and passive pairs (peers
    /// connected to it) it holds; `None` without RDMA.
    pub fn rdma_usage(&self) -> Option<RdmaUsage> {
        self.inner.transports.diag.rdma_usage()
    }

    /// This engine's segment name (`host:port` in P2P mode).
    pub fn segment_name(&self) -> &str {
        &self.inner.name
    }

    /// The handshake (RPC) port.
    pub fn rpc_port(&self) -> u16 {
        self.inner.handshake.port()
    }

    /// The TCP data port.
    pub fn data_port(&self) -> u16 {
        self.inner.transports.diag.data_port()
    }

    /// TCP peers this engine holds lanes to, and connections its data server is serving:
    /// what peers cost now (lanes unused for `KVFERRY_TCP_IDLE_MS` are closed).
    pub fn tcp_usage(&self) -> (usize, usize) {
        self.inner.transports.diag.tcp_usage()
    }

    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// The descriptor this engine publishes.
    pub fn local_descriptor(&self) -> SegmentDesc {
        self.inner.local_descriptor()
    }

    /// Registers `[addr, addr+len)` so peers may read and write it.
    pub fn register_memory(&self, addr: u64, len: u64, location: &str) -> Result<()> {
        self.register_memory_batch(&[(addr, len)], location)
    }

    /// Registers several ranges; all or none.
    /// `*` and `cuda:N` ask the CUDA driver (when one is loaded) whether each range is GPU
    /// memory; such ranges are published as `cuda:N` and reached only through the driver.
    pub fn register_memory_batch(&self, ranges: &[(u64, u64)], location: &str) -> Result<()> {
        self.inner.check_home()?;
        let kinds = ranges
            .iter()
            .map(|&(a, l)| crate::gpu::classify(a, l, location))
            .collect::<Result<Vec<_>>>()?;
        let regions = self
            .inner
            .memory
            .register_classified(ranges, location, &kinds)?;
        for r in &regions {
            let registered = self
                .inner
                .transports
                .all
                .iter()
                .try_for_each(|t| t.on_register(r));
            if let Err(e) = registered {
                let addrs: Vec<u64> = regions.iter().map(|r| r.addr).collect();
                // Every transport lets go of every range of the batch (RDMA's MRs of the
                // ranges, and of the transports, that did register).
                for r in self
                    .inner
                    .memory
                    .unregister_batch(&addrs)
                    .unwrap_or_default()
                {
                    self.inner
                        .transports
                        .all
                        .iter()
                        .for_each(|t| t.on_unregister(&r));
                }
                return Err(e);
            }
        }
        // Central mode: peers learn of the new buffers from the service; all or none.
        if let Err(e) = self.inner.publish_descriptor() {
            let _ =
                self.unregister_memory_batch(&regions.iter().map(|r| r.addr).collect::<Vec<_>>());
            return Err(e);
        }
        Ok(())
    }

    /// Withdraws the range that starts at `addr`. A barrier: when it returns, no thread of
    /// this engine touches the range and no peer can reach it any more (accesses in progress
    /// are stopped between system calls and waited for).
    pub fn unregister_memory(&self, addr: u64) -> Result<()> {
        self.unregister_memory_batch(&[addr])
    }

    /// Like [`TransferEngine::unregister_memory`] for several ranges; all or none.
    pub fn unregister_memory_batch(&self, addrs: &[u64]) -> Result<()> {
        self.inner.check_home()?;
        let removed = self.inner.memory.unregister_batch(addrs)?;
        for r in &removed {
            // Each waits until no peer can reach the range through it any more (the registry
            // waited for our own accesses, RDMA's posted work requests included).
            for t in &self.inner.transports.all {
                t.on_unregister(r);
            }
        }
        // The memory is withdrawn whatever the service says; a failed update is retried by
        // the metadata keeper.
        if let Err(e) = self.inner.publish_descriptor() {
            tracing::warn!(
                "unregistered, but updating the published descriptor failed (will retry): {e}"
            );
        }
        Ok(())
    }

    /// Whether `[addr, addr+len)` lies inside one registered range.
    pub fn is_registered(&self, addr: u64, len: u64) -> bool {
        self.inner.memory.check(addr, len).is_some()
    }

    /// Registered ranges, in address order.
    pub fn registered(&self) -> Vec<Region> {
        self.inner.memory.snapshot()
    }

    /// Opens (or returns the cached handle of) a peer segment, fetching its descriptor over
    /// the handshake port. A newly opened segment's data path is set up before this returns
    /// or in the background (TCP: its connections are opened; shared memory: the peer is
    /// verified and its buffers mapped), so its first request does not pay for that; what
    /// fails there is reported by the first request.
    pub fn open_segment(&self, name: &str) -> Result<SegmentId> {
        let name = name.trim_start_matches('/');
        if let Some(&id) = self
            .inner
            .segments
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .by_name
            .get(name)
        {
            return Ok(id);
        }
        let (host, desc) = match &self.inner.directory {
            // Central mode: descriptor and handshake address from the metadata service.
            Some(dir) => {
                let desc = dir.fetch_segment(name)?;
                (dir.fetch_rpc_meta(name)?.ip_or_host_name, desc)
            }
            None => self.inner.fetch_p2p(name)?,
        };
        let mut segs = self
            .inner
            .segments
            .write()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(&id) = segs.by_name.get(name) {
            return Ok(id);
        }
        let id = segs.by_id.len() as SegmentId;
        let peer = Arc::new(Peer::new(id, name.to_string(), host, desc));
        segs.by_id.push(Arc::clone(&peer));
        segs.by_name.insert(name.to_string(), id);
        drop(segs);
        // The transport that will carry its requests gets ready for them now.
        if let Ok(t) = self.inner.transports.router.pick(&peer) {
            t.warm(&peer);
        }
        Ok(id)
    }

    /// The metadata service in use (central mode), `None` in P2PHANDSHAKE mode.
    pub fn metadata(&self) -> Option<&Arc<Directory>> {
        self.inner.directory.as_ref()
    }
}

impl Inner {
    /// P2P mode: the segment name is `host:rpc_port`; ask that port for the descriptor.
    fn fetch_p2p(&self, name: &str) -> Result<(String, SegmentDesc)> {
        let (host, port) = match split_host_port(name) {
            (h, Some(p)) if !h.is_empty() => (h.to_string(), p),
            _ => {
                return Err(Error::SegmentNotFound {
                    name: name.into(),
                    reason: "in P2PHANDSHAKE mode a segment name is \"<host>:<rpc port>\" (the peer's get_rpc_port())".into(),
                })
            }
        };
        let desc = self.fetch_descriptor(name, &host, port)?;
        Ok((host, desc))
    }
}

impl TransferEngine {
    /// Which data path carries requests to a segment (chosen on first use and cached per
    /// peer process), and why not shared memory when it is not used. Fails when no transport
    /// can reach the segment (e.g. `KVFERRY_TRANSPORT=shm` towards a peer on another host).
    pub fn segment_transport(&self, id: SegmentId) -> Result<SegmentTransport> {
        let peer = self.inner.peer(id)?;
        let t = self.inner.transports.router.pick(&peer)?;
        Ok(SegmentTransport {
            name: t.name(),
            why_not_shm: self.inner.transports.diag.why_not_same_host(&peer, t),
        })
    }

    /// The cached descriptor of an open segment.
    pub fn segment_descriptor(&self, id: SegmentId) -> Result<SegmentDesc> {
        if id == LOCAL_SEGMENT_ID {
            return Ok(self.local_descriptor());
        }
        Ok((*self.inner.peer(id)?.desc()).clone())
    }

    /// Allocates a batch that can hold `capacity` requests. The [`Batch`] is its caller's:
    /// dropping it waits until every request it submitted is terminal.
    pub fn allocate_batch(&self, capacity: usize) -> Result<Batch> {
        if capacity == 0 {
            return Err(Error::InvalidArgument(
                "batch capacity must be at least 1".into(),
            ));
        }
        let id = self.inner.next_batch.fetch_add(1, Ordering::Relaxed);
        Ok(Batch::new(&self.inner, id, capacity))
    }

    /// Convenience: one batch, submit, wait, free. Returns the batch status.
    ///
    /// `timeout` caps every request's deadline (each also has the engine's transfer timeout
    /// plus 1 ns per byte). The call returns only once every request is terminal, so when it
    /// returns no transport touches the caller's memory; a request still running at its
    /// deadline ends as TIMEOUT, one that completed reports COMPLETED.
    pub fn transfer_sync(
        &self,
        requests: &[TransferRequest],
        timeout: Duration,
    ) -> Result<TransferStatus> {
        self.run_sync(requests, timeout, Batch::status)
    }

    /// Like [`TransferEngine::transfer_sync`], returning each request's status (in order)
    /// instead of the batch's.
    pub fn transfer_sync_all(
        &self,
        requests: &[TransferRequest],
        timeout: Duration,
    ) -> Result<Vec<TransferStatus>> {
        self.run_sync(requests, timeout, Batch::task_statuses)
    }

    /// One batch, submitted as work the caller waits for (a transport may run it in this
    /// thread: see [`crate::transport::Transport::submit`]), waited for until every request
    /// is terminal, read by `outcome`, dropped.
    fn run_sync<T>(
        &self,
        requests: &[TransferRequest],
        timeout: Duration,
        outcome: impl FnOnce(&Batch) -> T,
    ) -> Result<T> {
        self.inner.check_home()?;
        let batch = self.allocate_batch(requests.len().max(1))?;
        let cap = Instant::now().checked_add(timeout);
        batch.submit_inline(&self.inner, requests, cap)?;
        batch.wait_done();
        Ok(outcome(&batch))
    }

    /// Sends a notify message to a segment's handshake port.
    pub fn send_notify(&self, segment: &str, msg: &str) -> Result<()> {
        self.send_notify_as(segment, &self.inner.name, msg)
    }

    /// Sends a notify message carrying `name` as the sender (Mooncake's `TransferNotify(name, msg)`).
    pub fn send_notify_as(&self, segment: &str, name: &str, msg: &str) -> Result<()> {
        let (host, port) = self.inner.rpc_addr(segment)?;
        let body = serde_json::to_vec(&NotifyMsg {
            name: name.to_string(),
            notify_msg: msg.to_string(),
        })
        .expect("serialisable");
        let reply = self
            .inner
            .request(segment, &host, port, MsgType::Notify, &body)?;
        let r: NotifyMsg = parse_json("notify reply", &reply.body).map_err(|e| Error::Wire {
            peer: segment.into(),
            source: e,
        })?;
        if r.notify_msg != "success" {
            return Err(Error::Handshake {
                peer: segment.into(),
                reason: format!("notify refused: {}", r.notify_msg),
            });
        }
        Ok(())
    }

    /// Drains the notifies received so far.
    pub fn get_notifies(&self) -> Vec<Notify> {
        std::mem::take(
            &mut *self
                .inner
                .notifies
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        )
    }

    /// Like [`TransferEngine::get_notifies`], but blocks up to `timeout` until one arrives.
    pub fn wait_notifies(&self, timeout: Duration) -> Vec<Notify> {
        let until = Instant::now() + timeout;
        let mut q = self
            .inner
            .notifies
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        while q.is_empty() {
            let now = Instant::now();
            if now >= until {
                break;
            }
            q = self
                .inner
                .notify_cv
                .wait_timeout(q, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        std::mem::take(&mut *q)
    }

    /// Installs (or with `None` removes) the service that answers [`TransferEngine::call_service`]
    /// requests from peers on this engine's handshake port (under the cluster key when the
    /// engine holds one), each on the connection's own thread, within the port's deadline
    /// (5 s for the request, the answer and the reply together). One service per engine.
    pub fn serve(&self, service: Option<ServiceFn>) {
        *self
            .inner
            .service
            .write()
            .unwrap_or_else(|e| e.into_inner()) = service;
    }

    /// Sends `body` to the service `segment`'s engine installed ([`TransferEngine::serve`]) and
    /// returns its answer, within `timeout` for the exchange once connected (an engine that
    /// does not answer in time fails the call). An engine without a service answers an empty
    /// body.
    pub fn call_service(&self, segment: &str, body: &[u8], timeout: Duration) -> Result<Vec<u8>> {
        let (host, port) = self.inner.rpc_addr(segment)?;
        handshake::request(
            &host,
            port,
            MsgType::Service,
            body,
            self.config().handshake_connect_timeout.min(timeout),
            timeout,
            self.config().handshake_max_len,
            self.inner.auth.as_deref().map(|k| (k, segment)),
        )
        .map(|f| f.body)
    }

    /// Checks that a segment's handshake port answers.
    pub fn probe(&self, segment: &str) -> Result<()> {
        let (host, port) = self.inner.rpc_addr(segment)?;
        let reply = self
            .inner
            .request(segment, &host, port, MsgType::Probe, b"{}")?;
        let r: ProbeReply = parse_json("probe reply", &reply.body).map_err(|e| Error::Wire {
            peer: segment.into(),
            source: e,
        })?;
        if r.status != "success" {
            return Err(Error::Handshake {
                peer: segment.into(),
                reason: format!("probe answered {:?}", r.status),
            });
        }
        Ok(())
    }
}

impl Drop for TransferEngine {
    /// Shuts the engine down as a barrier: when `drop` returns, no thread of the engine
    /// touches registered memory any more and no peer can reach it (the caller may free it).
    ///
    /// In a process other than the one that started the engine (a `fork()` child dropping
    /// its copy) nothing is shut down: the listeners, metadata entries, shared control region
    /// and memory belong to the parent, and the engine's threads do not exist in the child
    /// (joining them would hang). The child lets go of the parent's sockets and control
    /// region ([`TransferEngine::release_inherited`]) and forgets the rest; what remains is
    /// closed when the child exits or execs (all descriptors are close-on-exec).
    fn drop(&mut self) {
        if std::process::id() != self.inner.pid {
            self.release_inherited();
            std::mem::forget(Arc::clone(&self.inner));
            return;
        }
        // Clean shutdown: leave the metadata service first, so peers stop finding us.
        if let Some(d) = &self.inner.directory {
            d.withdraw_all();
        }
        self.inner.handshake.shutdown();
        for t in &self.inner.transports.all {
            t.shutdown();
        }
        // The barrier: revoke every range and wait for whatever still holds one (a server
        // thread mid-request, a lane thread mid-receive, a copy job).
        for r in self.inner.memory.unregister_all() {
            for t in &self.inner.transports.all {
                t.on_unregister(&r);
            }
        }
    }
}

impl Inner {
    fn local_descriptor(&self) -> SegmentDesc {
        // Before the buffer snapshot: what is published then is never newer than the list.
        let preludes: Vec<Prelude> = self
            .transports
            .all
            .iter()
            .map(|t| t.before_describe())
            .collect();
        let mut d = SegmentDesc::new(self.name.clone());
        d.timestamp = timestamp();
        d.buffers = self
            .memory
            .snapshot()
            .into_iter()
            .map(|r| BufferDesc {
                name: r.location,
                addr: r.addr,
                length: r.len,
                rkey: vec![],
                lkey: vec![],
                extra: Default::default(),
            })
            .collect();
        for (t, p) in self.transports.all.iter().zip(preludes) {
            t.describe(&mut d, p);
        }
        d
    }

    /// Re-reads a peer's descriptor over its handshake port (asked by a transport through the
    /// [`Link`]: shared memory when the peer's unregister epoch moved, RDMA after a refused
    /// key).
    fn refresh_peer(&self, peer: &Peer) -> std::result::Result<(), String> {
        let (h, p) = self.rpc_addr(&peer.name).map_err(|e| e.to_string())?;
        let d = self
            .fetch_descriptor(&peer.name, &h, p)
            .map_err(|e| e.to_string())?;
        peer.set_desc(d);
        Ok(())
    }

    fn on_handshake(&self, f: &Frame) -> Vec<u8> {
        match f.kind {
            MsgType::Metadata => self.local_descriptor().encode(),
            MsgType::Notify => {
                match parse_json::<NotifyMsg>("notify", &f.body) {
                    Ok(n) => {
                        self.notifies.lock().unwrap_or_else(|e| e.into_inner()).push(Notify { name: n.name, msg: n.notify_msg });
                        self.notify_cv.notify_all();
                        br#"{"name":"","notify_msg":"success"}"#.to_vec()
                    }
                    Err(e) => serde_json::to_vec(&NotifyMsg { name: String::new(), notify_msg: e.to_string() }).expect("serialisable"),
                }
            }
            MsgType::Probe => br#"{"status":"success"}"#.to_vec(),
            MsgType::Service => {
                let service = self.service.read().unwrap_or_else(|e| e.into_inner()).clone();
                service.map(|s| s(&f.body)).unwrap_or_default()
            }
            // (The handshake server runs the key's exchange itself and never passes it on.)
            MsgType::Auth => b"{}".to_vec(),
            // A transport's own message (RDMA's `Connection`): the transport that answers it.
            MsgType::Connection => self.transports.all.iter().find_map(|t| t.on_handshake(f.kind, &f.body)).unwrap_or_else(|| serde_json::json!({
                "reply_msg": "kvferry: this engine has no RDMA transport; use TCP (publish protocol \"tcp\")",
            })
            .to_string()
            .into_bytes()),
        }
    }

    /// One handshake request to `segment`'s engine at `host:port` (with the cluster key,
    /// bound to `segment`: another engine refuses it).
    fn request(
        &self,
        segment: &str,
        host: &str,
        port: u16,
        kind: MsgType,
        body: &[u8],
    ) -> Result<Frame> {
        handshake::request(
            host,
            port,
            kind,
            body,
            self.config.handshake_connect_timeout,
            Duration::from_secs(10),
            self.config.handshake_max_len,
            self.auth.as_deref().map(|k| (k, segment)),
        )
    }

    /// Central mode: publishes rpc_meta and the descriptor, installs the refresh-on-refused
    /// hook and starts the keeper.
    fn register_central(self: &Arc<Self>, host: &str, port: u16) -> Result<()> {
        let Some(dir) = &self.directory else {
            return Ok(());
        };
        let meta = RpcMeta {
            ip_or_host_name: host.to_string(),
            rpc_port: port,
        };
        let (connect, max_len) = (
            self.config
                .handshake_connect_timeout
                .min(Duration::from_secs(1)),
            self.config.handshake_max_len,
        );
        let alive =
            |m: &RpcMeta| handshake::answers(&m.ip_or_host_name, m.rpc_port, connect, max_len);
        dir.publish_rpc_meta(&self.name, &meta, &alive)?;
        self.publish_descriptor()?;
        dir.start_keeper((self.config.metadata_lease_ttl / 3).max(Duration::from_millis(500)))?;
        tracing::info!(segment = %self.name, metadata = %dir.describe(), rpc_port = port, "registered in the metadata service");
        Ok(())
    }

    /// Central mode: publishes the current descriptor (after every (un)registration).
    fn publish_descriptor(&self) -> Result<()> {
        match &self.directory {
            Some(dir) => dir.publish_segment(&self.name, || self.local_descriptor()),
            None => Ok(()),
        }
    }

    /// Re-reads a peer's descriptor: from the metadata service in central mode, else over
    /// its handshake port.
    fn refresh_descriptor(&self, peer: &Peer) -> Result<SegmentDesc> {
        match &self.directory {
            Some(dir) => dir.fetch_segment(&peer.name),
            None => {
                let (h, p) = self.rpc_addr(&peer.name)?;
                self.fetch_descriptor(&peer.name, &h, p)
            }
        }
    }

    fn rpc_addr(&self, segment: &str) -> Result<(String, u16)> {
        if let Some(dir) = &self.directory {
            let m = dir.fetch_rpc_meta(segment.trim_start_matches('/'))?;
            return Ok((m.ip_or_host_name, m.rpc_port));
        }
        match split_host_port(segment) {
            (h, Some(p)) if !h.is_empty() => Ok((h.to_string(), p)),
            _ => Err(Error::SegmentNotFound {
                name: segment.into(),
                reason: "expected \"<host>:<rpc port>\"".into(),
            }),
        }
    }

    fn fetch_descriptor(&self, name: &str, host: &str, port: u16) -> Result<SegmentDesc> {
        let not_found = |reason: String| Error::SegmentNotFound {
            name: name.into(),
            reason,
        };
        let reply = self
            .request(
                name,
                host,
                port,
                MsgType::Metadata,
                &self.local_descriptor().encode(),
            )
            .map_err(|e| match e {
                // (Said as it is: the fix is the key, not the segment's name.)
                e @ Error::Unauthorized { .. } => e,
                e => not_found(e.to_string()),
            })?;
        let desc = SegmentDesc::decode(&reply.body)
            .map_err(|e| not_found(format!("its descriptor is invalid: {e}")))?;
        tracing::debug!(
            segment = name,
            buffers = desc.buffers.len(),
            data_port = desc.tcp_data_port,
            "fetched descriptor"
        );
        Ok(desc)
    }

    fn peer(&self, id: SegmentId) -> Result<Arc<Peer>> {
        self.segments
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .by_id
            .get(id as usize)
            .cloned()
            .ok_or(Error::UnknownSegmentId(id))
    }

    /// Refuses to act in a `fork()` child's copy of the engine: its transports' threads and
    /// the shared-memory control region (`MADV_DONTFORK`) do not exist there, so a transfer
    /// would wait forever or touch an unmapped (or, by then, someone else's) address.
    fn check_home(&self) -> Result<()> {
        let pid = std::process::id();
        if pid != self.pid {
            return Err(Error::Forked {
                owner: self.pid,
                pid,
            });
        }
        Ok(())
    }

    fn submit(
        &self,
        batch_id: u64,
        batch: &Tasks,
        requests: &[TransferRequest],
        inline: bool,
        cap: Option<Instant>,
    ) -> Result<()> {
        self.check_home()?;
        let now = Instant::now();
        // Mooncake's allowance: the transfer timeout plus 1 ns per byte (~1 GB/s floor).
        let deadline = |len: u64| {
            let d = now + self.config.transfer_timeout + Duration::from_nanos(len);
            cap.map_or(d, |c| c.min(d))
        };
        let tasks: Vec<Arc<TaskState>> = {
            let mut tasks = batch.tasks.lock().unwrap_or_else(|e| e.into_inner());
            if tasks.len() + requests.len() > batch.capacity {
                return Err(Error::TooManyRequests {
                    batch: batch_id,
                    capacity: batch.capacity,
                    wanted: requests.len(),
                });
            }
            let new: Vec<Arc<TaskState>> = requests
                .iter()
                .map(|r| {
                    Arc::new(TaskState::new(
                        deadline(r.length),
                        Arc::clone(&batch.signal),
                    ))
                })
                .collect();
            tasks.extend(new.iter().cloned());
            new
        };
        // Group pieces per peer so each transport sees one call per peer.
        let mut groups: Vec<(Arc<Peer>, Vec<Piece>)> = Vec::new();
        let mut stale: Vec<(Arc<Peer>, Vec<Piece>)> = Vec::new();
        // Requests of one batch mostly share a local region, a peer and a remote buffer: the
        // last of each is reused while the next request lies inside it (a guard still live
        // proves its range registered, as a fresh check would).
        let mut last_guard: Option<crate::memory::RegionGuard> = None;
        // (The peer, its descriptor, and the bounds of the last buffer a request fell in.)
        type LastPeer = (Arc<Peer>, Arc<SegmentDesc>, Option<(u64, u64)>);
        let mut last_peer: Option<LastPeer> = None;
        for (req, task) in requests.iter().zip(tasks) {
            if req.length == 0 {
                task.piece_done(0);
                continue;
            }
            let inside_last = last_guard.as_ref().filter(|g| {
                let r = g.region();
                !g.is_revoked()
                    && req.source >= r.addr
                    && req
                        .source
                        .checked_add(req.length)
                        .is_some_and(|e| e <= r.end())
            });
            let guard = match inside_last {
                Some(g) => g.clone(),
                None => match self.memory.check(req.source, req.length) {
                    Some(g) => {
                        last_guard = Some(g.clone());
                        g
                    }
                    None => {
                        task.piece_failed(
                            FailKind::Failed,
                            Error::LocalNotRegistered {
                                addr: req.source,
                                len: req.length,
                            },
                        );
                        continue;
                    }
                },
            };
            let cached = last_peer.as_mut().filter(|(p, _, _)| p.id == req.target_id);
            let (peer, desc, buffer) = match cached {
                Some(c) => c,
                None => match self.peer(req.target_id) {
                    Ok(p) => {
                        let d = p.desc();
                        last_peer.insert((p, d, None))
                    }
                    Err(e) => {
                        task.piece_failed(FailKind::Failed, &e);
                        continue;
                    }
                },
            };
            let piece = Piece {
                opcode: req.opcode,
                local: req.source,
                remote: req.target_offset,
                len: req.length,
                task,
                guard,
            };
            // The cached descriptor may be stale (the peer registered more memory, or
            // restarted): such pieces wait for a refresh, off this thread.
            let end = req.target_offset.checked_add(req.length);
            let in_buffer =
                |b: &(u64, u64)| req.target_offset >= b.0 && end.is_some_and(|e| e <= b.1);
            let known = peer.id == LOCAL_SEGMENT_ID
                || buffer.as_ref().is_some_and(in_buffer)
                || match desc.find_buffer(req.target_offset, req.length) {
                    Some(b) => {
                        *buffer = Some((b.addr, b.addr.saturating_add(b.length)));
                        true
                    }
                    None => false,
                };
            let into = if known { &mut groups } else { &mut stale };
            match into.iter_mut().rev().find(|(p, _)| p.id == peer.id) {
                Some((_, v)) => v.push(piece),
                None => into.push((Arc::clone(peer), vec![piece])),
            }
        }
        for (peer, pieces) in stale {
            self.refresh_then_dispatch(peer, pieces);
        }
        // Work runs in the caller's thread only when it reaches one peer: pieces for several
        // peers go to the transports' threads and move in parallel.
        let inline = inline && groups.len() == 1;
        for (peer, pieces) in groups {
            self.dispatch(&peer, pieces, inline);
        }
        Ok(())
    }

    /// Hands pieces whose remote range the cached descriptor lacks to the refresher thread:
    /// it re-reads the descriptor once, fails the pieces still outside it, dispatches the rest.
    fn refresh_then_dispatch(&self, peer: Arc<Peer>, pieces: Vec<Piece>) {
        if let Err(e) = self.start_refresher() {
            return fail_pieces(pieces, &e);
        }
        let slot = self.refresher.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tx) = slot.as_ref() {
            if let Err(std::sync::mpsc::SendError(job)) = tx.send(RefreshJob { peer, pieces }) {
                fail_pieces(job.pieces, &Error::Shutdown);
            }
        }
    }

    /// Starts the refresher thread (once; the engine starts it with itself).
    fn start_refresher(&self) -> Result<()> {
        let mut slot = self.refresher.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            let (tx, rx) = std::sync::mpsc::channel::<RefreshJob>();
            let me = self.me.clone();
            let spawned = std::thread::Builder::new()
                .name("kvf-refresh".into())
                .spawn(move || {
                    // Ends when the engine is gone (its sender dropped with it).
                    while let Ok(job) = rx.recv() {
                        match me.upgrade() {
                            Some(inner) => inner.refresh_job(job),
                            None => fail_pieces(job.pieces, &Error::Shutdown),
                        }
                    }
                });
            spawned.map_err(|e| Error::io("starting the descriptor refresh thread", e))?;
            *slot = Some(tx);
        }
        Ok(())
    }

    fn refresh_job(&self, job: RefreshJob) {
        let RefreshJob { peer, pieces } = job;
        match self.refresh_descriptor(&peer) {
            Ok(d) => peer.set_desc(d),
            Err(e) => tracing::debug!("refreshing {}: {e}", peer.name),
        }
        let desc = peer.desc();
        let now = Instant::now();
        let mut ok = Vec::with_capacity(pieces.len());
        for p in pieces {
            if p.task.deadline() <= now {
                let why = format!(
                    "the descriptor of {} was still being refreshed at the deadline",
                    peer.name
                );
                p.task.piece_failed(
                    FailKind::Timeout,
                    crate::batch::FailCause::Timeout.because(why),
                );
            } else if desc.find_buffer(p.remote, p.len).is_none() {
                let e = Error::RemoteNotRegistered {
                    segment: peer.name.clone(),
                    addr: p.remote,
                    len: p.len,
                };
                p.task.piece_failed(FailKind::Failed, &e);
            } else {
                ok.push(p);
            }
        }
        if !ok.is_empty() {
            self.dispatch(&peer, ok, false);
        }
    }

    /// Hands pieces to the transports that serve them (`crate::route`: per piece, the first
    /// in order of preference that declares its memory kinds and this peer, and takes it).
    fn dispatch(&self, peer: &Arc<Peer>, pieces: Vec<Piece>, inline: bool) {
        self.transports.router.route(peer, pieces, inline);
    }
}

fn fail_pieces(pieces: Vec<Piece>, e: &Error) {
    for p in pieces {
        p.task.piece_failed(FailKind::Failed, e);
    }
}

fn timestamp() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    // Civil date from days since the epoch (Howard Hinnant's algorithm), UTC.
    let days = (secs / 86400) as i64;
    let rem = secs % 86400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn timestamp_shape() {
        let t = super::timestamp();
        assert_eq!(t.len(), 19, "{t}");
        assert!(t.starts_with("20"), "{t}");
    }
}
