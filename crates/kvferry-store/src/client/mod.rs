//! The store client: contributes a segment, moves object bytes with the transfer engine.
//!
//! Writes: `PutStart` (the master picks replica locations) → one engine batch writes every
//! replica (a replica in this client's own segment is a memcpy) → `PutEnd`, or `PutRevoke` if
//! any write failed. Reads: `GetReplicaList` (grants a read lease) → read the closest replica
//! → if the lease ran out before the read finished the read fails (`LeaseExpired`), so a get
//! never returns bytes that might have been overwritten meanwhile. Once the transfer ended
//! the read is released (`ReleaseReads`, piggybacked on the client's next request, or sent
//! within 5 ms by a background thread when no request goes out), so
//! the master may reclaim the replicas at once if they were removed or replaced meanwhile.
//!
//! In central metadata mode a `local_hostname` without a port gets one, as Mooncake's client
//! does: a port bound (and held) in `KVFERRY_STORE_CLIENT_MIN_PORT..=KVFERRY_STORE_CLIENT_MAX_PORT`
//! (12300..=14300) is appended, and `host:port` is the segment name; a name another live
//! engine registered is retried with another port (`KVFERRY_STORE_CLIENT_SETUP_RETRIES`, 20; the `MC_STORE_CLIENT_*` names are aliases).
//!
//! This module holds the client's configuration, its setup and close, and the background
//! threads (pings, read releases, replica tasks: `tasks`); `rpc` talks to the master, `put` and `get` move values,
//! `staged` is the bytes API's local buffer and `keys` the calls that move no bytes;
//! `session` reserves space to write by ranges and keeps replica lists to read by ranges.

pub mod copy_out;
mod disk_read;
mod disk_readers;
mod get;
mod keys;
mod offload;
mod offload_config;
mod put;
mod rpc;
mod segments;
mod session;
mod staged;
mod start;
mod tasks;

pub use keys::Replica;
pub use session::{Range, ReadLease, Reservation};
pub use staged::Staged;

use crate::error::{StoreError, StoreResult};
use crate::master::alloc::SegmentSpace;
use crate::proto::{PingStatus, Request, Response, Segment};
use kvferry::hostbuf::HostBuffer;
use kvferry::{Config, TaskStatus, TransferEngine, TransferRequest};
use rpc::{Conn, Registration, Rpc, FAILOVER_WAIT};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
/// Mooncake's `setup()` arguments.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// This host's address (`host` or `host:port`), advertised to peers.
    pub local_hostname: String,
    /// Transfer-engine metadata: `P2PHANDSHAKE` or a metadata server URL.
    pub metadata_server: String,
    /// Memory this client contributes to the pool (0: a pure client).
    pub global_segment_size: u64,
    /// Staging memory for the bytes API (`put`, `get`); 0 disables it.
    pub local_buffer_size: u64,
    /// Mooncake's `protocol`: `rdma` makes the client's transfer engine RDMA-only (an RDMA
    /// segment descriptor; setup fails, saying why, on a host without a usable NIC); `tcp`
    /// leaves the engine's transport as configured (`auto` by default). See
    /// [`kvferry::Config::apply_initialize_args`].
    pub protocol: String,
    /// Mooncake's `rdma_devices`: the NICs to use, comma-separated; empty (or
    /// `auto-discovery`) for every NIC with an active port.
    pub device_name: String,
    /// `host:port` of the master.
    pub master_server_addr: String,
    /// How often to ping the master.
    pub ping_interval: Duration,
    /// Deadline of each transfer.
    pub transfer_timeout: Duration,
    /// The disk tier's directory (Mooncake's `enable_ssd_offload` with `ssd_offload_path`):
    /// the master's background eviction hands this client's objects to it instead of
    /// dropping them (with `--enable_offload` on the master). `None`: no disk tier.
    pub ssd_offload_path: Option<std::path::PathBuf>,
    /// The most bytes of records the disk tier holds (its least recently used records are
    /// evicted past it).
    pub ssd_offload_capacity: u64,
    /// How often the disk tier reports to the master and takes its orders.
    pub offload_interval: Duration,
    /// The registered buffer a client with a disk tier stages values in for readers (the
    /// largest value its disk serves; a batch larger than it is served in rounds).
    pub ssd_offload_staging_size: u64,
    /// How long a get waits for a disk copy's owner to stage it (a dead or stalled owner fails
    /// the get after this).
    pub ssd_read_timeout: Duration,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            local_hostname: "127.0.0.1".into(),
            metadata_server: "P2PHANDSHAKE".into(),
            global_segment_size: 16 << 20,
            local_buffer_size: 16 << 20,
            protocol: "tcp".into(),
            device_name: String::new(),
            master_server_addr: "127.0.0.1:50051".into(),
            ping_interval: Duration::from_secs(1),
            transfer_timeout: Duration::from_secs(60),
            ssd_offload_path: None,
            ssd_offload_capacity: 1 << 40,
            offload_interval: Duration::from_secs(1),
            ssd_offload_staging_size: 64 << 20,
            ssd_read_timeout: Duration::from_secs(5),
        }
    }
}

struct Inner {
    engine: Arc<TransferEngine>,
    /// Set when the engine is shared ([`Client::with_engine`]): its owner's "closed" flag.
    /// Once set, every call fails with [`engine_closed`] instead of touching the engine.
    shared: Option<Arc<AtomicBool>>,
    rpc: Rpc,
    id: u64,
    /// The last put id this client chose (`Request::PutStart`'s `put`; the client id is
    /// random per client, so counting from 0 keeps ids distinct and their varints short).
    next_put: AtomicU64,
    segment: Option<(HostBuffer, Segment)>,
    /// The segment was unmounted at the master (by `close`, or by the pinger once the
    /// shared engine serving it was closed): never twice.
    unmounted: AtomicBool,
    staging: Option<(HostBuffer, Mutex<SegmentSpace>)>,
    closed: AtomicBool,
    cfg: ClientConfig,
    /// The process that set the client up (see Drop).
    pid: u32,
    /// Reads finished and not yet released at the master.
    releases: Mutex<Releases>,
    /// Holds the port appended to a bare `local_hostname` (central mode), as Mooncake does.
    _port: Option<TcpListener>,
    /// The disk tier ([`ClientConfig::ssd_offload_path`]).
    offload: Option<offload::Offloader>,
    /// Where the disk tier stages values for readers (with `offload`).
    stager: Option<disk_read::Stager>,
    /// Releases of values read from other clients' staging buffers, being sent.
    disk_releases: disk_readers::Releases,
    /// Segments mounted after setup (`segments.rs`) and those unmounted since, kept until
    /// no transfer can touch them any more.
    more: Mutex<segments::More>,
}

/// Reads finished and not yet released at the master: carried by the next request, or sent
/// by the release thread once they waited [`RELEASE_AFTER`].
#[derive(Default)]
struct Releases {
    ids: Vec<u64>,
    /// When the oldest of `ids` was queued.
    since: Option<Instant>,
}

/// How long finished reads wait for a request to carry their release before the release
/// thread sends it on its own (a client that went idle).
const RELEASE_AFTER: Duration = Duration::from_millis(5);

impl Releases {
    fn queue(&mut self, ids: impl IntoIterator<Item = u64>, now: Instant) {
        let before = self.ids.len();
        self.ids.extend(ids);
        if before == 0 && !self.ids.is_empty() {
            self.since = Some(now);
        }
    }

    /// All of them (a request carries them).
    fn take(&mut self) -> Vec<u64> {
        self.since = None;
        std::mem::take(&mut self.ids)
    }

    /// All of them if the oldest waited [`RELEASE_AFTER`], else none.
    fn overdue(&mut self, now: Instant) -> Vec<u64> {
        match self.since {
            Some(t) if now.saturating_duration_since(t) >= RELEASE_AFTER => self.take(),
            _ => Vec::new(),
        }
    }
}

impl Inner {
    /// Unmounts this client's segment at the master, once, waiting at most `within` for a
    /// master to answer (across a failover: see `Rpc::call_within`).
    fn unmount_segment(&self, within: Duration) -> StoreResult<()> {
        match &self.segment {
            Some((_, seg)) if !self.unmounted.swap(true, Ordering::AcqRel) => {
                // No longer remounted at a new leader (a call in flight elsewhere may find one).
                self.rpc
                    .registration
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .mounted = false;
                self.rpc
                    .call_within(
                        &Request::UnmountSegment {
                            client: self.id,
                            segment: seg.id,
                        },
                        within,
                        Conn::Pool,
                    )
                    .and_then(Response::into_result)
                    .map(|_| ())
            }
            _ => Ok(()),
        }
    }

    fn queue_releases(&self, ids: impl IntoIterator<Item = u64>) {
        self.releases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .queue(ids, Instant::now());
    }

    /// Sends `reqs` in one round trip, led by the releases of finished reads; the answers to
    /// `reqs`, in order.
    fn call_batch(&self, reqs: Vec<Request>) -> StoreResult<Vec<Response>> {
        self.call_batch_on(reqs, Conn::Pool)
    }

    fn call_batch_on(&self, reqs: Vec<Request>, conn: Conn) -> StoreResult<Vec<Response>> {
        self.call_batch_at(reqs, conn).map(|(a, _)| a)
    }

    /// [`Inner::call_batch_on`], with the epoch of the leader that answered.
    fn call_batch_at(&self, reqs: Vec<Request>, conn: Conn) -> StoreResult<(Vec<Response>, u64)> {
        let n = reqs.len();
        if n == 0 {
            return Ok((Vec::new(), self.rpc.epoch()));
        }
        let ids = self
            .releases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let pre = usize::from(!ids.is_empty());
        let mut all = Vec::with_capacity(n + pre);
        if pre == 1 {
            all.push(Request::ReleaseReads { ids: ids.clone() });
        }
        all.extend(reqs);
        let answer = if all.len() == 1 {
            let r = all
                .pop()
                .ok_or_else(|| StoreError::Internal("empty request list".into()))?;
            self.rpc
                .call_within_at(&r, FAILOVER_WAIT, conn)
                .map(|(a, epoch)| (vec![a], epoch))
        } else {
            match self
                .rpc
                .call_within_at(&Request::Batch(all), FAILOVER_WAIT, conn)
            {
                Ok((Response::Batch(v), epoch)) if v.len() == n + pre => {
                    Ok((v.into_iter().skip(pre).collect(), epoch))
                }
                Ok((Response::Err(e), _)) => Err(e),
                Ok((other, _)) => Err(StoreError::Rpc(format!(
                    "unexpected answer to a batch: {other:?}"
                ))),
                Err(e) => Err(e),
            }
        };
        if answer.is_err() && pre == 1 {
            self.queue_releases(ids); // not delivered: with the next request
        }
        answer
    }

    fn call_one(&self, req: Request) -> StoreResult<Response> {
        self.call_batch(vec![req])?
            .pop()
            .ok_or_else(|| StoreError::Rpc("the master sent no answer".into()))?
            .into_result()
    }
}

/// A store client. Cheap to share between threads (`&Client` is enough).
pub struct Client {
    inner: Arc<Inner>,
}

impl Client {
    /// Starts a transfer engine, contributes `global_segment_size` bytes, mounts them at the
    /// master and starts pinging it.
    pub fn setup(cfg: ClientConfig) -> StoreResult<Client> {
        check_protocol(&cfg)?;
        let mut ecfg = Config::from_env().map_err(|e| StoreError::InvalidParams(e.to_string()))?;
        ecfg.local_hostname = cfg.local_hostname.clone();
        ecfg.metadata_server = cfg.metadata_server.clone();
        ecfg.transfer_timeout = cfg.transfer_timeout;
        let invalid = |e: kvferry::Error| StoreError::InvalidParams(e.to_string());
        let args = ecfg
            .apply_initialize_args(&cfg.protocol, &cfg.device_name, &|k| std::env::var(k).ok())
            .map_err(invalid)?;
        args.check_rdma(&kvferry::host::rdma::probe(), ecfg.rdma_devices.as_deref())
            .map_err(invalid)?;
        let (engine, port) = start::start_engine(&cfg, ecfg)?;
        Client::build(cfg, Arc::new(engine), None, port)
    }

    /// Like [`Client::setup`] on an engine that is already running (Mooncake's
    /// `setup(..., engine)`): no second engine is started; the segment is mounted as the
    /// engine's own segment (its name, its listeners), and memory registered on the engine
    /// serves the store and the other way round. `cfg.local_hostname` must be empty, the
    /// engine's segment name, or its host part (anything else is refused: the segment can
    /// only carry the engine's name). `cfg.metadata_server` is ignored (the engine's is used).
    ///
    /// `engine_closed` is the owner's flag for "the engine was closed": once set, calls fail
    /// with a clear error instead of using it. Closing the client unmounts the segment and
    /// unregisters the client's own buffers from the engine; the engine keeps running.
    pub fn with_engine(
        mut cfg: ClientConfig,
        engine: Arc<TransferEngine>,
        engine_closed: Option<Arc<AtomicBool>>,
    ) -> StoreResult<Client> {
        check_protocol(&cfg)?;
        let name = engine.segment_name().to_string();
        let asked = cfg.local_hostname.trim();
        let (asked_host, asked_port) = kvferry::split_host_port(asked);
        let engine_host = kvferry::split_host_port(&name).0;
        let matches = asked.is_empty()
            || asked == name
            || (asked_port.is_none() && asked_host == engine_host);
        if !matches {
            return Err(StoreError::InvalidParams(format!(
                "local_hostname {asked:?} differs from the shared engine's segment name {name:?}; a store on a shared engine mounts the engine's own segment, so pass the engine's name (or its host, or \"\"), or set the store up without engine= to get a segment of its own"
            )));
        }
        cfg.local_hostname = name;
        cfg.metadata_server = engine.config().metadata_server.clone();
        let flag = engine_closed.unwrap_or_default();
        Client::build(cfg, engine, Some(flag), None)
    }

    fn build(
        cfg: ClientConfig,
        engine: Arc<TransferEngine>,
        shared: Option<Arc<AtomicBool>>,
        port: Option<TcpListener>,
    ) -> StoreResult<Client> {
        if shared.as_ref().is_some_and(|f| f.load(Ordering::Acquire)) {
            return Err(engine_closed());
        }
        let rpc = Rpc::new(
            &cfg.master_server_addr,
            Duration::from_secs(30),
            engine.config(),
        )?;
        let id: u64 = rand::random::<u64>() | 1;
        // First: a directory another process holds, or none, fails the setup by name.
        let offload = match &cfg.ssd_offload_path {
            Some(dir) => Some(offload::Offloader::open(dir, cfg.ssd_offload_capacity)?),
            None => None,
        };
        let mut segment = None;
        if cfg.global_segment_size > 0 {
            // Huge pages where the host enables them for shared memory. Every page is
            // allocated here, in setup (~1.1 s per GiB on the 2-vCPU VM): allocating from a
            // background thread instead made the first second after setup run at 57% of the
            // steady rate there (the zeroing competes with the traffic), against 91% now.
            segment = Some(new_segment(
                &engine,
                cfg.global_segment_size,
                "global_segment_size",
            )?);
        }
        let mut staging = None;
        if cfg.local_buffer_size > 0 {
            let registered = HostBuffer::new(cfg.local_buffer_size as usize, true)
                .map_err(|e| StoreError::InvalidParams(format!("local_buffer_size: {e}")))
                .and_then(|buf| {
                    engine
                        .register_memory(buf.addr(), buf.len() as u64, "cpu:0")
                        .map(|_| buf)
                        .map_err(|e| StoreError::Internal(e.to_string()))
                });
            let buf = match registered {
                Ok(b) => b,
                Err(e) => {
                    // A shared engine outlives this call: withdraw the segment before it is freed.
                    if let (Some(_), Some((b, _))) = (&shared, &segment) {
                        let _ = engine.unregister_memory(b.addr());
                    }
                    return Err(e);
                }
            };
            let space = SegmentSpace::new(buf.addr(), buf.len() as u64);
            staging = Some((buf, Mutex::new(space)));
        }
        let stager = match &offload {
            Some(_) => match disk_read::Stager::register(&engine, cfg.ssd_offload_staging_size) {
                Ok(s) => Some(s),
                Err(e) => {
                    if shared.is_some() {
                        for a in segment
                            .iter()
                            .map(|(b, _)| b.addr())
                            .chain(staging.iter().map(|(b, _)| b.addr()))
                        {
                            let _ = engine.unregister_memory(a);
                        }
                    }
                    return Err(e);
                }
            },
            None => None,
        };
        let inner = Arc::new(Inner {
            engine,
            shared,
            rpc,
            id,
            next_put: AtomicU64::new(0),
            segment,
            unmounted: AtomicBool::new(false),
            staging,
            closed: AtomicBool::new(false),
            cfg,
            pid: std::process::id(),
            releases: Mutex::default(),
            _port: port,
            offload,
            stager,
            disk_releases: disk_readers::Releases::default(),
            more: Mutex::default(),
        });
        if inner.stager.is_some() {
            // Readers of this client's disk copies ask it here (`disk_read`).
            let weak = Arc::downgrade(&inner);
            inner.engine.serve(Some(Arc::new(move |body: &[u8]| {
                disk_read::serve(&weak, body)
            })));
        }
        // Register with the master even without a segment, so pings are recognised.
        match &inner.segment {
            Some((_, seg)) => inner.rpc.call_ok(&Request::MountSegment {
                client: id,
                segment: seg.clone(),
            })?,
            None => inner.rpc.call_ok(&Request::RemountSegments {
                client: id,
                segments: Vec::new(),
            })?,
        };
        *inner
            .rpc
            .registration
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Registration {
            client: id,
            segments: inner.segment.iter().map(|(_, s)| s.clone()).collect(),
            mounted: true,
        };
        let weak = Arc::downgrade(&inner);
        let every = inner.cfg.ping_interval;
        std::thread::Builder::new()
            .name("kvf-store-ping".into())
            .spawn(move || ping_loop(weak, every))
            .map_err(|e| StoreError::Internal(e.to_string()))?;
        let weak = Arc::downgrade(&inner);
        std::thread::Builder::new()
            .name("kvf-store-release".into())
            .spawn(move || release_loop(weak))
            .map_err(|e| StoreError::Internal(e.to_string()))?;
        let weak = Arc::downgrade(&inner);
        std::thread::Builder::new()
            .name("kvf-store-tasks".into())
            .spawn(move || tasks::task_loop(weak, every))
            .map_err(|e| StoreError::Internal(e.to_string()))?;
        if inner.offload.is_some() {
            let weak = Arc::downgrade(&inner);
            let every = inner.cfg.offload_interval;
            std::thread::Builder::new()
                .name("kvf-store-offload".into())
                .spawn(move || offload::offload_loop(weak, every))
                .map_err(|e| StoreError::Internal(e.to_string()))?;
        }
        Ok(Client { inner })
    }

    /// One beat of the disk tier now (its thread beats every `offload_interval`): reports
    /// what it did, carries out the master's orders; the tasks carried out.
    pub fn offload_beat(&self) -> StoreResult<usize> {
        self.check_open()?;
        self.inner.offload_beat()
    }

    /// The disk tier, if this client has one.
    pub fn disk_tier(&self) -> Option<&crate::disk::DiskTier> {
        self.inner.offload.as_ref().map(offload::Offloader::disk)
    }

    /// The transfer engine this client uses (register buffers for zero-copy calls with it).
    pub fn engine(&self) -> &TransferEngine {
        &self.inner.engine
    }

    /// This client's segment name: `host:port` (in central mode, the port appended to a bare
    /// `local_hostname`); what Mooncake's `get_hostname()` returns.
    pub fn segment_name(&self) -> &str {
        self.inner.engine.segment_name()
    }

    /// Registers a buffer for `put_from` / `get_into`.
    pub fn register_buffer(&self, addr: u64, len: u64) -> StoreResult<()> {
        self.inner
            .engine
            .register_memory(addr, len, "cpu:0")
            .map_err(|e| StoreError::InvalidParams(e.to_string()))
    }

    pub fn unregister_buffer(&self, addr: u64) -> StoreResult<()> {
        self.inner
            .engine
            .unregister_memory(addr)
            .map_err(|e| StoreError::InvalidParams(e.to_string()))
    }

    fn check_open(&self) -> StoreResult<()> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(StoreError::InvalidParams("the client is closed".into()));
        }
        if std::process::id() != self.inner.pid {
            // A forked child shares the parent's pooled master connections: either could read
            // the other's answer (another key's replicas). A child sets up its own client.
            return Err(StoreError::InvalidParams("this client was set up by another process (the parent of a fork); set up a new client in this process".into()));
        }
        if self
            .inner
            .shared
            .as_ref()
            .is_some_and(|f| f.load(Ordering::Acquire))
        {
            return Err(engine_closed());
        }
        Ok(())
    }

    fn segment_id(&self, endpoint: &str) -> StoreResult<u64> {
        self.inner
            .engine
            .open_segment(endpoint)
            .map_err(|e| StoreError::TransferFailed(e.to_string()))
    }

    /// Runs transfer requests as one batch; per-request results.
    fn transfer(&self, reqs: &[TransferRequest]) -> StoreResult<Vec<StoreResult<()>>> {
        // Returns once every request is terminal: the caller's memory may then be reused.
        let statuses = self
            .inner
            .engine
            .transfer_sync_all(reqs, self.inner.cfg.transfer_timeout)
            .map_err(|x| StoreError::TransferFailed(x.to_string()))?;
        Ok(statuses
            .into_iter()
            .map(|st| {
                if st.status == TaskStatus::Completed {
                    Ok(())
                } else {
                    Err(StoreError::TransferFailed(
                        st.reason.unwrap_or_else(|| format!("{:?}", st.status)),
                    ))
                }
            })
            .collect())
    }

    fn call_batch(&self, reqs: Vec<Request>) -> StoreResult<Vec<Response>> {
        self.inner.call_batch(reqs)
    }

    /// Unmounts this client's segment and stops pinging. Objects whose only replicas lived
    /// there disappear.
    pub fn close(&self) -> StoreResult<()> {
        if self.inner.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let ids = self
            .inner
            .releases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        // Closing does not wait for a failover (a master that lost the client drops its
        // segment when its TTL ends).
        let wait = Duration::from_secs(2);
        if !ids.is_empty() {
            // Best effort: unreleased reads end with their lease anyway.
            let _ = self
                .inner
                .rpc
                .call_within(&Request::ReleaseReads { ids }, wait, Conn::Pool);
        }
        let more = self.unmount_all_more(wait);
        let unmounted = self.inner.unmount_segment(wait);
        if self.inner.shared.is_some() {
            for a in more {
                let _ = self.inner.engine.unregister_memory(a);
            }
            // The engine outlives this client: withdraw the client's buffers from it (a
            // barrier) before they are freed. Already gone if the engine was closed first.
            let addrs: Vec<u64> = self
                .inner
                .segment
                .iter()
                .map(|(b, _)| b.addr())
                .chain(self.inner.staging.iter().map(|(b, _)| b.addr()))
                .chain(self.inner.stager.iter().map(disk_read::Stager::addr))
                .collect();
            if self.inner.stager.is_some() {
                self.inner.engine.serve(None);
            }
            for a in addrs {
                if let Err(e) = self.inner.engine.unregister_memory(a) {
                    tracing::debug!(
                        "unregistering the store's buffer at {a:#x} from the shared engine: {e}"
                    );
                }
            }
        }
        unmounted
    }
}

fn check_protocol(cfg: &ClientConfig) -> StoreResult<()> {
    if cfg.protocol != "tcp" && cfg.protocol != "rdma" {
        return Err(StoreError::InvalidParams(format!(
            "protocol {:?} is not supported; use \"tcp\"",
            cfg.protocol
        )));
    }
    Ok(())
}

/// The error of every call on a shared engine that its owner closed.
fn engine_closed() -> StoreError {
    StoreError::InvalidParams("the transfer engine this store shares was closed (engine closed before the store); close the store and set it up again on a running engine".into())
}

impl Drop for Inner {
    /// On a shared engine (which outlives this client) the client's buffers are withdrawn from
    /// it before they are freed, whichever way the client ends (a failed setup included).
    fn drop(&mut self) {
        if self.shared.is_none() || std::process::id() != self.pid {
            return;
        }
        let addrs: Vec<u64> = self
            .segment
            .iter()
            .map(|(b, _)| b.addr())
            .chain(self.staging.iter().map(|(b, _)| b.addr()))
            .chain(self.stager.iter().map(disk_read::Stager::addr))
            .collect();
        for a in addrs {
            // Already withdrawn by close(), or by the engine's owner closing it: ignored.
            let _ = self.engine.unregister_memory(a);
        }
    }
}

impl Client {
    /// In a `fork()` child holding a copy of the parent's client: its engine lets go of the
    /// parent's sockets ([`TransferEngine::release_inherited`]); nothing in the creating
    /// process. Dropping the copy does this too.
    pub fn release_inherited(&self) {
        if std::process::id() != self.inner.pid {
            self.inner.engine.release_inherited();
        }
    }
}

impl Drop for Client {
    /// Unmounts the segment (the engine, dropped after, is the barrier for its memory). In a
    /// process other than the one that set the client up (a `fork()` child dropping its copy)
    /// nothing is unmounted or stopped: the segment and the master's view of it are the
    /// parent's; the engine lets go of the parent's sockets
    /// ([`TransferEngine::release_inherited`]) and the buffers of their descriptors.
    fn drop(&mut self) {
        if std::process::id() != self.inner.pid {
            self.release_inherited();
            return;
        }
        if let Err(e) = self.close() {
            tracing::debug!("closing the store client: {e}");
        }
    }
}

/// Sends the releases of finished reads that no request carried within a few milliseconds
/// (a client that went idle), so a put waiting for space elsewhere is not held up until the
/// next ping. At most one small RPC per tick.
fn release_loop(inner: Weak<Inner>) {
    loop {
        std::thread::sleep(RELEASE_AFTER);
        let Some(inner) = inner.upgrade() else { return };
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        // Releases a request will carry in a moment are left to it (a busy client sends none
        // of its own).
        let ids = inner
            .releases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .overdue(Instant::now());
        if ids.is_empty() {
            continue;
        }
        // Not delivered: the reads end with their lease anyway.
        if let Err(e) =
            inner
                .rpc
                .call_within(&Request::ReleaseReads { ids }, FAILOVER_WAIT, Conn::Aside)
        {
            tracing::debug!("releasing finished reads: {e}");
        }
    }
}

fn ping_loop(inner: Weak<Inner>, every: Duration) {
    loop {
        std::thread::sleep(every);
        let Some(inner) = inner.upgrade() else { return };
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        if inner
            .shared
            .as_ref()
            .is_some_and(|f| f.load(Ordering::Acquire))
        {
            // The engine serving the segment was closed by its owner: nothing can read or
            // write the segment any more, so the master stops listing it (and placing
            // values there) now rather than when the store is closed.
            match inner.unmount_segment(Duration::from_secs(2)) {
                Ok(()) => tracing::info!(
                    "the shared transfer engine was closed: segment {} unmounted",
                    inner.engine.segment_name()
                ),
                Err(e) => tracing::warn!(
                    "the shared transfer engine was closed; unmounting its segment failed: {e}"
                ),
            }
            return;
        }
        // Also delivers the releases of reads that finished since the last request.
        match inner
            .call_batch_on(vec![Request::Ping { client: inner.id }], Conn::Aside)
            .and_then(|mut v| v.pop().ok_or_else(|| StoreError::Rpc("no answer".into())))
        {
            Ok(Response::Ping(PingStatus::Ok)) => {}
            Ok(Response::Ping(PingStatus::NeedRemount))
                if !inner.unmounted.load(Ordering::Acquire) =>
            {
                tracing::warn!("the master does not know this client (it restarted?); remounting");
                // (The setup's segment and those mounted since, as registered.)
                let segments = inner
                    .rpc
                    .registration
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .segments
                    .clone();
                if let Err(e) = inner.rpc.call_ok(&Request::RemountSegments {
                    client: inner.id,
                    segments,
                }) {
                    tracing::warn!("remount failed: {e}");
                }
                inner.rpc.report_writes(inner.id, Conn::Aside);
            }
            Ok(other) => tracing::warn!("unexpected ping answer {other:?}"),
            Err(e) => tracing::debug!("ping: {e}"),
        }
    }
}

/// A segment of `size` bytes of this process's memory: allocated (populated, huge pages where
/// the host has them, shareable so same-host peers map it), registered with `engine`, and
/// described under the engine's name with a random id. `what` names the setting in errors.
fn new_segment(
    engine: &TransferEngine,
    size: u64,
    what: &str,
) -> StoreResult<(HostBuffer, Segment)> {
    let opts = kvferry::hostbuf::HostOptions {
        populate: true,
        huge_pages: true,
        shareable: true,
    };
    let buf = HostBuffer::with(size as usize, opts)
        .map_err(|e| StoreError::InvalidParams(format!("{what}: {e}")))?;
    engine
        .register_memory(buf.addr(), buf.len() as u64, "cpu:0")
        .map_err(|e| StoreError::Internal(e.to_string()))?;
    let seg = Segment {
        id: rand::random(),
        name: engine.segment_name().to_string(),
        te_endpoint: engine.segment_name().to_string(),
        base: buf.addr(),
        size: buf.len() as u64,
    };
    Ok((buf, seg))
}

#[cfg(test)]
mod tests;
