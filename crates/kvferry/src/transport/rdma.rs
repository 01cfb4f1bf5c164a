//! The RDMA transport: one-sided RDMA WRITE/READ over RC queue pairs, on the verbs layer of
//! [`crate::sys::ibverbs::verbs`] (libibverbs loaded at run time).
//!
//! - **NICs**: every RDMA device with an active port 1 (or those `KVFERRY_RDMA_DEVICES`
//!   names), in name order; each has a PD, a CQ with its completion channel, and a poller
//!   thread. The GID index is chosen per NIC from sysfs (`MC_GID_INDEX` honoured).
//! - **Memory**: every registered range gets one MR per NIC ([`Transport::on_register`]); the
//!   descriptor publishes `protocol: "rdma"`, `devices` (name, LID, GID) and per-buffer
//!   `rkey`/`lkey` arrays in device order, plus a `priority_matrix` ([`crate::nic::topo`]:
//!   discovered from NUMA nodes and PCIe paths, or `KVFERRY_RDMA_TOPO`'s file), as Mooncake
//!   does (reference §1.5, §2.3). Buffers whose MRs are not yet made are left out of the
//!   descriptor (never published without keys).
//! - **Endpoints**: one RC QP per (peer, local NIC, peer NIC), made on first use by the peer's
//!   posting thread (`per_peer`: one per peer, so a peer that does not answer holds up only
//!   its own requests) through the `Connection` handshake message (§2.6) sent to the peer's handshake
//!   port; the peer ([`RdmaTransport::on_connection`]) makes its QP, brings it to RTS, answers
//!   with its QP number, GID and LID. A peer's NIC is chosen by name: the one with the local
//!   NIC's name if it has one (rail affinity), else the first preferred for the remote buffer's
//!   location in its `priority_matrix`, else its first device; its rkey is looked up at that
//!   name's position in its `devices`.
//! - **Data path**: a piece is cut into 64 KiB slices, striped over the local NICs the matrix
//!   prefers for its local memory's location (the others only when none connects), posted as
//!   chains of signaled work requests (one doorbell per chain) with at most [`MAX_OUTSTANDING`]
//!   per QP. A piece ends only when the completion of each of its slices arrived (its
//!   [`RegionGuard`] is held until then, so unregistering waits for posted work requests, and
//!   MRs are deregistered only after). A failed completion drops the endpoint (rebuilt on next
//!   use: the peer then replaces its QPs of the pair, so the endpoint's other QPs are flushed
//!   at once and their slices posted again, uncounted) and its slice is posted again on
//!   another NIC pair, at most [`MAX_RETRIES`] times
//!   (a path failure also pauses the pair); a status another pair would repeat (remote or
//!   local access, invalid request) fails the piece at once, naming it (`Ended::fate`).
//! - **Deadlines**: the poller looks at the deadlines of what is in flight every
//!   [`TICK`]; a QP holding a slice past its task's deadline is moved to the error state, which
//!   flushes its work requests at once (an RC QP cannot cancel one): the late piece ends
//!   TIMEOUT, and nothing touches its memory after; the other tasks' flushed slices are posted
//!   again (uncounted), so a deadline fails only its own task. Nothing is posted again past
//!   its deadline, at shutdown or into a range being unregistered. Connecting is bounded by
//!   the handshake timeouts.
//! - **Ports**: each poller reads its NIC's port every [`TICK`]; one no longer ACTIVE (link
//!   down) is used only when no other NIC connects, and the QPs holding its slices are
//!   flushed, so they go again on another NIC without using a retry (a NIC need not complete
//!   what its link lost: Soft-RoCE left READs in flight until their deadline).
//! - **Endpoint cache**: at most `KVFERRY_RDMA_MAX_ENDPOINTS`; beyond it the least recently
//!   used idle endpoint (no work request in flight) is closed (`lru_victims`).
//!
//! Mooncake compatibility of the handshake: 2 QPs per endpoint (Mooncake refuses a QP count
//! that differs from its own), as many as the peer sent when it connects to us, no `ready_ack`
//! field in our messages (a Mooncake peer then skips that round) and an answer to one it sends.
//!
//! `auto` (not `KVFERRY_TRANSPORT=rdma`): this engine initiates RDMA per piece where both
//! sides can key it ([`auto_route`]), the rest goes to TCP; it publishes a TCP descriptor (a
//! stock Mooncake TCP peer selects its transport by the target's `protocol` and could not
//! reach an `rdma` one), so peers reach it over TCP. A range the NICs cannot register is
//! still registered (TCP).
//!
//! Checked against a stock Mooncake engine in the Soft-RoCE VM, both directions
//! (`examples/rdma_mooncake`).
//!
//! A NIC pair that cannot be connected is paused for 30 s (tried again only when no other
//! pair works); its slices go over the pairs that connect. A local port that comes back
//! ACTIVE ends the pauses of its pairs (a connect made as its link went down fails for that).
//!
//! GPU memory is registered on the NICs as [`crate::gpu::direct`] allows (DMA-BUF or
//! nvidia-peermem, the one that worked kept) and then moved by the NICs unstaged: the router
//! offers pieces touching GPU memory to RDMA first, and `try_submit` takes those it carries as
//! they are.
//!
//! QPs made for peers that connect to us (passive, `passive.rs`) are bounded: per peer
//! (segment name) by what a peer with [`passive::PEER_NICS`] NICs can ask, and in all by
//! `KVFERRY_RDMA_MAX_PASSIVE_QPS`; a connection beyond either is refused (the peer's error
//! names the bound), never a live pair evicted (one-sided traffic gives the passive side no
//! way to tell an idle pair from a busy one). They are kept until the peer reconnects that
//! pair, or until it is found gone: once [`PASSIVE_SWEEP_AT`] pairs are held (or a connection
//! is refused), a connection starts a look (at most every [`PASSIVE_SWEEP_EVERY`], on a thread
//! of its own). In P2P mode it probes each peer's handshake address (its segment name,
//! `ip:port`); with a metadata service it asks the service for each peer's entry and probes
//! the address it names (or named at an earlier look); an address that refuses connections
//! has no engine there any more, and an entry absent for [`passive::ABSENT_GRACE`] with no
//! address ever known is a peer gone. The QPs made for a gone peer before the look began are
//! destroyed. A live peer is never cut off this way (its port answers, its entry is there).
//! Names that are no `ip:port` in P2P mode are kept until they reconnect (within the bounds).

use crate::batch::{FailCause, FailKind, TaskState};
use crate::memory::{Region, RegionGuard};
use crate::nic::{sysfs, topo};
use crate::sys::ibverbs::verbs::{
    self, Context, Cq, Mr, Op, Path, PortAttr, Qp, RemoteQp, Verbs, VerbsError, Wc, Wr,
};
use crate::transport::{
    Caps, Kinds, Mem, Needs, Peer, PeerDirectory, Piece, Prelude, Published, Reach, Transport,
};
use crate::wire::descriptor::{DeviceDesc, Protocols, SegmentDesc};
use crate::wire::handshake::MsgType;
use crate::wire::rdma::{format_gid, parse_gid, split_nic_path, ConnectionMsg};
use crate::wire::tcp::Opcode;
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

mod mr_table;
mod passive;
mod per_peer;
use mr_table::{Held, MrTable};
use passive::{Passive, PEER_NICS};
use per_peer::PerPeer;

/// A peer's posting thread ends after this long without work ([`per_peer`]).
const POSTER_IDLE: Duration = Duration::from_secs(5);

/// Size of one work request (Mooncake's `MC_SLICE_SIZE` default).
pub(crate) const SLICE: u64 = 64 << 10;
/// Send queue depth of a QP.
const MAX_WR: u32 = 256;
/// Work requests in flight per QP (below `MAX_WR`).
pub(crate) const MAX_OUTSTANDING: u32 = 128;
/// Completion queue entries per NIC (Mooncake's `MC_MAX_CQE_PER_CTX` default).
const CQ_DEPTH: u32 = 4096;
/// Work requests posted with one doorbell.
const CHAIN: usize = 16;
/// How often pollers look at deadlines and at shutdown.
pub(crate) const TICK: Duration = Duration::from_millis(100);
/// How long a NIC pair that could not be connected, or whose work request failed on the path
/// (`path_failure`), is left alone (while others work).
const PAUSE: Duration = Duration::from_secs(30);
/// The port used on every NIC (Mooncake's `MC_IB_PORT` default).
const PORT: u8 = 1;
/// RC QPs per endpoint: Mooncake's `MC_NUM_QP_PER_EP` default. Mooncake refuses a peer whose
/// QP count differs from its own, so the active side sends this many; the passive side makes as
/// many as the peer sent (at most `MAX_QPS_PER_EP`).
pub(crate) const QPS_PER_EP: usize = 2;
const MAX_QPS_PER_EP: usize = 16;
/// Times one slice is posted again on another NIC pair after its work request failed (a flush
/// because another task's deadline passed does not count: its own deadline bounds those).
pub(crate) const MAX_RETRIES: u8 = 3;
/// Not a completion status: posting the work request failed (the QP is broken).
const POST_FAILED: u32 = u32::MAX;
/// `IBV_WC_WR_FLUSH_ERR`: the work request was not executed, its QP went to the error state.
const FLUSHED: u32 = 5;
/// Our extra field in `Connection` messages: the sender's active MTU in bytes, so both sides
/// use the smaller of both ports' (a peer without it: our own).
const MTU_FIELD: &str = "kvferry_mtu";
/// Passive pairs (a peer NIC, one of ours) held before departed peers are looked for.
pub const PASSIVE_SWEEP_AT: usize = 16;
/// At most one look for departed peers per this long.
pub(crate) const PASSIVE_SWEEP_EVERY: Duration = Duration::from_secs(2);
/// How long a peer's handshake address may take to answer a look (no answer: kept).
const PASSIVE_PROBE_TIMEOUT: Duration = Duration::from_millis(300);

/// What the engine tells the transport.
pub(crate) struct RdmaOptions {
    /// This engine's segment name (the `<segment>` of its NIC paths).
    pub segment: String,
    /// Use only these devices (`KVFERRY_RDMA_DEVICES`); `None`: every device with an active port.
    pub devices: Option<Vec<String>>,
    /// `MC_GID_INDEX`: the GID index on every NIC, instead of the automatic choice.
    pub gid_index: Option<u32>,
    /// Connected endpoints kept (`KVFERRY_RDMA_MAX_ENDPOINTS`): beyond it the least recently
    /// used idle one is closed.
    pub max_endpoints: usize,
    /// QPs made for peers that connect to us, all together (`KVFERRY_RDMA_MAX_PASSIVE_QPS`).
    pub max_passive_qps: usize,
    /// `KVFERRY_TRANSPORT=rdma`: RDMA or nothing (a range that cannot be registered on the NICs
    /// is an error). `false` (`auto`): initiates RDMA where it works, TCP for the rest (see
    /// [`auto_route`]), and publishes a TCP descriptor.
    pub required: bool,
    /// QP transport retries before a work request fails (`KVFERRY_RDMA_RETRY_CNT`, 0-7).
    pub retry_cnt: u8,
    /// How GPU memory is registered on the NICs (`KVFERRY_GPU_RDMA`).
    pub gpu_rdma: crate::gpu::direct::GpuRdma,
    /// The NIC priority matrix file (`KVFERRY_RDMA_TOPO`, `MC_CUSTOM_TOPO_JSON`); `None`:
    /// discovered from sysfs.
    pub topo: Option<std::path::PathBuf>,
    /// Segment names are handshake addresses (`ip:port`), as in P2P mode: a peer that
    /// connected to us is looked for there. With a metadata service a name is whatever the
    /// peer was given, so the service is asked instead (see the module's doc).
    pub names_are_addresses: bool,
}

/// Whether `auto` sends a piece to a peer over RDMA (sans-IO): the peer must publish RDMA
/// devices, the local range must have memory regions on our NICs and the remote buffer keys
/// for each of the peer's devices. `Err` says why not (the piece then goes over TCP).
pub(crate) fn auto_route(
    peer: &SegmentDesc,
    local_has_mrs: bool,
    remote: u64,
    len: u64,
) -> Result<(), String> {
    if !peer.protocol.contains("rdma") || peer.devices.is_empty() {
        return Err(format!(
            "the peer publishes no RDMA devices (protocol {:?})",
            peer.protocol
        ));
    }
    if !local_has_mrs {
        return Err("the local range has no RDMA memory region (its registration on the NICs failed: GPU memory without DMA-BUF or nvidia-peermem, or host memory over the memlock limit)".into());
    }
    match peer.find_buffer(remote, len) {
        Some(b) if b.rkey.len() == peer.devices.len() => Ok(()),
        Some(b) => Err(format!(
            "the peer publishes {} rkeys for its {} devices on buffer 0x{:x}",
            b.rkey.len(),
            peer.devices.len(),
            b.addr
        )),
        // The engine re-reads the descriptor before a piece outside it is dispatched.
        None => Err("the remote range is not inside a buffer the peer published".into()),
    }
}

struct Nic {
    name: String,
    pd: verbs::Pd,
    cq: Cq,
    attr: PortAttr,
    gid_index: u8,
    gid: [u8; 16],
    /// Work requests posted on this NIC's QPs whose completion has not arrived, by `wr_id`.
    inflight: Mutex<HashMap<u64, Slice>>,
    /// At most [`CQ_DEPTH`] of them: the shared CQ never overruns, however many endpoints.
    credits: Credits,
    /// Its port is not ACTIVE (read by its poller every [`TICK`], `Shared::check_port`).
    down: AtomicBool,
    /// Times its port came back ACTIVE: a connect that fails across a change (it began as the
    /// link went or while it was down) failed for the link, and pauses nothing.
    ups: AtomicU64,
    /// Its poller has ended (shutdown): set and read under `inflight`'s lock, so nothing is
    /// posted that no poller would complete.
    closed: AtomicBool,
    ctx: Context,
}

/// One posted work request: slice `idx` of `piece`, on `ep` from local NIC `nic`.
struct Slice {
    piece: Arc<PieceState>,
    ep: Arc<Endpoint>,
    idx: u32,
    nic: usize,
    /// Times this slice was posted again after a failed work request.
    retries: u8,
}

/// A slice to post again (after a flush or a failed work request), for the posting thread.
struct Retry {
    piece: Arc<PieceState>,
    idx: u32,
    retries: u8,
    /// The local NIC whose pair failed: another is preferred.
    avoid: Option<usize>,
}

/// Slices (index, retries) of one piece to post again, avoiding one local NIC.
type RetryGroup = (Arc<PieceState>, Option<usize>, Vec<(u32, u8)>);

/// What the posting thread is given.
enum Work {
    Job(Job),
    Retry(Retry),
}

/// A piece in flight: ends when its last slice does. Holds what it takes to post any of its
/// slices again.
struct PieceState {
    task: Arc<TaskState>,
    peer: Arc<Peer>,
    op: Op,
    /// The local range's MRs (one per NIC) and the range's offset in them. Declared before
    /// the guard, so dropped before it: unregister finds them unshared.
    mrs: Arc<Held<Vec<Mr>>>,
    base: usize,
    remote: u64,
    /// For each local NIC: the peer's NIC used from it and the rkey there.
    routes: Vec<(DeviceDesc, u32)>,
    /// For each local NIC: whether the topology prefers it for the local range's location
    /// (slices go over these while any connects).
    near: Vec<bool>,
    len: u64,
    left: AtomicUsize,
    failure: Mutex<Option<(FailKind, FailCause, String)>>,
    /// Held until the last completion: unregistering the range waits for it.
    guard: RegionGuard,
}

/// What becomes of a slice whose work request did not succeed (sans-IO: the caller gives the
/// facts and acts on the answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Failed for good: the status says another pair would fail the same way (keys, bounds,
    /// local memory), or the retries are spent.
    Fail,
    /// Its own task's deadline passed.
    Timeout,
    /// The engine is shutting down.
    ShutDown,
    /// The local range is being unregistered: nothing may be posted on it any more.
    Revoked,
    /// Posted again. `counted`: it uses one of the slice's [`MAX_RETRIES`]; `avoid`: on
    /// another NIC pair if there is one.
    Again { counted: bool, avoid: bool },
}

/// What is known of a slice whose work request ended ([`Ended::fate`]).
#[derive(Debug, Clone, Copy, Default)]
struct Ended {
    /// The completion's status (or [`POST_FAILED`]).
    status: u32,
    /// Its QP was moved to the error state because another slice on it passed its deadline
    /// (or its NIC's port went down).
    flushed_for_deadline: bool,
    /// Its own task's deadline passed.
    past_deadline: bool,
    /// The engine is shutting down.
    shut: bool,
    /// Its local range is being unregistered.
    revoked: bool,
    /// Retries it used (on other NIC pairs).
    retries: u8,
    /// Its NIC's port is not ACTIVE.
    port_down: bool,
    /// Another slice of its piece failed for good already: the piece has failed, and
    /// posting this one again serves nothing (a request's own error, such as a refused key,
    /// flushes its endpoint, and its slices would otherwise go again, uncounted, on each
    /// endpoint they break).
    piece_failed: bool,
}

impl Ended {
    /// The slice's fate. One flushed for another slice's deadline whose own task still has
    /// time is posted again, uncounted (only the late task ends TIMEOUT); one whose NIC's port
    /// is down goes again on another NIC, uncounted (the link failed, not the request; its
    /// deadline bounds it); any other failure is retried on another pair at most
    /// [`MAX_RETRIES`] times, unless retrying cannot help.
    fn fate(self) -> Fate {
        if self.shut {
            Fate::ShutDown
        } else if self.revoked {
            Fate::Revoked
        } else if self.past_deadline {
            Fate::Timeout
        } else if matches!(self.status, 1 | 4 | 8 | 9 | 10) || self.piece_failed {
            // Local length/protection/access, remote invalid request or access: the request
            // itself is wrong (or the keys stale), on any pair.
            Fate::Fail
        } else if self.port_down {
            Fate::Again {
                counted: false,
                avoid: true,
            }
        } else if self.status == FLUSHED && self.flushed_for_deadline {
            Fate::Again {
                counted: false,
                avoid: false,
            }
        } else if self.retries >= MAX_RETRIES {
            Fate::Fail
        } else {
            Fate::Again {
                counted: true,
                avoid: true,
            }
        }
    }
}

/// A failure that says the path (this NIC pair) is broken, rather than the request: the pair
/// is paused.
fn path_failure(status: u32) -> bool {
    matches!(status, 7 | 12 | 13 | 19 | 20 | 21 | POST_FAILED)
}

/// The local NICs to try for a piece, in tiers (a later one only when none of the earlier
/// connects): from `first` in rotation, those neither paused nor `avoid`ed that the topology
/// prefers (`near`), then the other such ones, then `avoid` (when not paused), then the paused
/// ones.
fn pair_order(
    n: usize,
    first: usize,
    avoid: Option<usize>,
    paused: &[bool],
    near: &[bool],
) -> [Vec<usize>; 3] {
    let rot: Vec<usize> = (0..n).map(|k| (first + k) % n.max(1)).collect();
    let healthy = |i: &usize| !paused[*i] && Some(*i) != avoid;
    let preferred = rot
        .iter()
        .copied()
        .filter(|i| healthy(i) && near.get(*i).copied().unwrap_or(true))
        .collect();
    let others = rot
        .iter()
        .copied()
        .filter(|i| healthy(i) && !near.get(*i).copied().unwrap_or(true))
        .collect();
    let mut fallback: Vec<usize> = avoid.filter(|&a| a < n && !paused[a]).into_iter().collect();
    fallback.extend(rot.iter().copied().filter(|&i| paused[i]));
    [preferred, others, fallback]
}

/// The endpoints to close so that at most `max` stay: the least recently used idle ones
/// (`(key, last use, busy)`; a busy one, with work requests in flight or about to be posted,
/// is never closed, so the cache may exceed `max` while they are busy).
fn lru_victims<K>(entries: Vec<(K, u64, bool)>, max: usize) -> Vec<K> {
    let excess = entries.len().saturating_sub(max);
    let mut idle: Vec<(K, u64)> = entries
        .into_iter()
        .filter(|e| !e.2)
        .map(|(k, t, _)| (k, t))
        .collect();
    idle.sort_by_key(|e| e.1);
    idle.into_iter().take(excess).map(|e| e.0).collect()
}

impl PieceState {
    fn slice_end(&self, result: Result<(), (FailKind, FailCause, String)>) {
        if let Err(f) = result {
            self.failure
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(f);
        }
        if self.left.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        match self
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            None => self.task.piece_done(self.len),
            Some((kind, cause, why)) => self.task.piece_failed(kind, cause.because(why)),
        }
    }
}

/// A connected RC QP to one NIC of a peer.
struct Endpoint {
    /// Connected to the peer's QPs of the same index; chains are posted to them in turn.
    qps: Vec<Qp>,
    next_qp: AtomicUsize,
    key: EpKey,
    /// At most [`MAX_OUTSTANDING`] work requests in flight.
    credits: Credits,
    /// Moved to the error state because a slice passed its deadline: its flushed slices end
    /// TIMEOUT if their own deadline passed, else are posted again.
    expired: AtomicBool,
    /// A work request on it failed: it is forgotten, to be rebuilt on next use, and its other
    /// QPs were moved to the error state too (see [`Shared::complete`]); its flushed slices are
    /// posted again uncounted.
    broken: AtomicBool,
    /// When it was last used (the transport's use counter), for eviction.
    last_use: AtomicU64,
}

impl Endpoint {
    /// Moved to the error state by us (a deadline, a port down, another failure): what fails
    /// or is refused on it now says nothing of the pair.
    fn flushed(&self) -> bool {
        self.expired.load(Ordering::Acquire) || self.broken.load(Ordering::Acquire)
    }
}

/// (peer segment, local NIC index, peer NIC name).
type EpKey = (String, usize, String);

/// A bound on work requests in flight (an endpoint's, or a NIC's: its CQ must never overrun).
struct Credits {
    used: Mutex<u32>,
    freed: Condvar,
    max: u32,
}

impl Credits {
    fn new(max: u32) -> Credits {
        Credits {
            used: Mutex::new(0),
            freed: Condvar::new(),
            max,
        }
    }

    fn release(&self, n: u32) {
        let mut o = self.used.lock().unwrap_or_else(|e| e.into_inner());
        *o = o.saturating_sub(n);
        self.freed.notify_all();
    }

    /// Waits until `n` more work requests may be posted; false at `deadline`.
    fn acquire(&self, n: u32, deadline: Instant) -> bool {
        let mut o = self.used.lock().unwrap_or_else(|e| e.into_inner());
        while *o + n > self.max {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            o = self
                .freed
                .wait_timeout(o, (deadline - now).min(TICK))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        *o += n;
        true
    }
}

struct Job {
    peer: Arc<Peer>,
    pieces: Vec<Piece>,
}

/// What an RDMA transport holds ([`RdmaTransport::usage`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RdmaUsage {
    /// NIC pairs this engine connected to peers (cached endpoints).
    pub endpoints: usize,
    /// NIC pairs peers connected to this engine whose QPs it holds.
    pub passive: usize,
    /// The QPs of those pairs.
    pub passive_qps: usize,
    /// Registered ranges with memory regions on the NICs.
    pub regions: usize,
}

struct Shared {
    segment: String,
    nics: Vec<Nic>,
    /// MRs of each registered range (by start address), one per NIC in `nics` order.
    mrs: MrTable<Vec<Mr>>,
    endpoints: Mutex<HashMap<EpKey, Arc<Endpoint>>>,
    /// NIC pairs that could not be connected, and until when they are left alone.
    paused: Mutex<HashMap<EpKey, Instant>>,
    /// QPs made for peers that connected to us, by (their NIC path, our NIC index), with when
    /// they were made, and their bounds.
    passive: Mutex<Passive<Qp>>,
    /// A look for departed peers runs; when the last one started.
    sweep: Mutex<(bool, Option<Instant>)>,
    /// [`RdmaOptions::names_are_addresses`].
    names_are_addresses: bool,
    /// The engine: sends `Connection` messages to peers' handshake ports and re-reads their
    /// descriptors.
    dir: Arc<dyn PeerDirectory>,
    /// Peers whose keys were refused (`IBV_WC_REM_ACCESS_ERR`): their descriptor is re-read
    /// before their next request is posted (they may have registered again, with new keys).
    stale: Mutex<std::collections::HashSet<String>>,
    next_wr: AtomicU64,
    next_nic: AtomicUsize,
    /// Counts endpoint uses (the clock of `Endpoint::last_use`).
    clock: AtomicU64,
    max_endpoints: usize,
    /// `KVFERRY_TRANSPORT=rdma` (else `auto`).
    required: bool,
    retry_cnt: u8,
    gpu_rdma: crate::gpu::direct::GpuRdma,
    /// The NIC priority matrix (published; picks the NICs near a piece's local memory) and
    /// whether it came from a file (else GPU entries are added as GPU memory registers).
    topo: Mutex<topo::Matrix>,
    topo_from_file: bool,
    /// Where each NIC sits (for GPU entries), in `nics` order.
    places: Vec<topo::Place>,
    /// libibverbs has `ibv_reg_dmabuf_mr`.
    verbs_dmabuf: bool,
    /// The GPU registration method that worked last (tried first next time): 0 none yet,
    /// 1 DMA-BUF, 2 peermem.
    gpu_method: std::sync::atomic::AtomicU8,
    /// `auto`: registered ranges without MRs (their registration failed), by address,
    /// with why: requests from them go over TCP.
    unkeyed: Mutex<BTreeMap<u64, String>>,
    /// `auto`: peers already told (in the log) why they are not reached over RDMA.
    told: Mutex<std::collections::HashSet<String>>,
    /// The posting threads, one per peer ([`per_peer`]): new pieces and slices to post
    /// again. Closed at shutdown; once they have all ended nothing new can be posted (pollers
    /// wait for that before they end, so a slice posted during shutdown still gets its
    /// completion).
    posters: PerPeer<Work>,
    shut: AtomicBool,
}

/// The RDMA transport.
pub(crate) struct RdmaTransport {
    shared: Arc<Shared>,
}

fn fail_piece(p: Piece, kind: FailKind, cause: FailCause, why: String) {
    p.task.piece_failed(kind, cause.because(why));
}

impl Shared {
    /// Host memory on every NIC (plain `ibv_reg_mr`).
    fn register_host(&self, region: &Region) -> Result<Vec<Mr>, String> {
        reg_plain(&self.nic_pds(), region.addr, region.len)
    }

    /// Adds `cuda:<ordinal>` to a discovered matrix (once): the NICs nearest the GPU on PCIe
    /// (the driver, already loaded for this GPU memory, gives its PCI bus id).
    fn add_gpu_to_topology(&self, ordinal: u32) {
        let key = format!("cuda:{ordinal}");
        if self.topo_from_file
            || self
                .topo
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains_key(&key)
        {
            return;
        }
        let bus = crate::gpu::cuda()
            .ok()
            .and_then(|c| c.driver().devices().ok())
            .and_then(|g| g.into_iter().find(|g| g.index == ordinal))
            .map(|g| g.pci_bus_id);
        let Some(bus) = bus else { return };
        let gpu = topo::gpu_place(std::path::Path::new("/sys/bus/pci/devices"), ordinal, &bus);
        let entry = topo::gpu_entry(&self.places, &gpu);
        tracing::debug!("RDMA: {key} (PCI {bus}) prefers {:?}", entry[0]);
        self.topo
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, entry);
    }

    fn nic_pds(&self) -> Vec<(&str, &verbs::Pd)> {
        self.nics.iter().map(|n| (n.name.as_str(), &n.pd)).collect()
    }

    /// GPU memory of GPU `ordinal` on every NIC (GPUDirect RDMA): the methods
    /// [`crate::gpu::direct::plan`] allows, the one that worked last first; the first that
    /// registers on every NIC wins and is remembered. The error names each method tried and
    /// why it failed.
    fn register_gpu(&self, region: &Region, ordinal: u32) -> Result<Vec<Mr>, String> {
        use crate::gpu::direct::{self, Method};
        let what = format!(
            "GPU {ordinal} memory [0x{:x}, +{}) cannot be registered on the RDMA NICs",
            region.addr, region.len
        );
        let facts = direct::facts(ordinal, self.verbs_dmabuf);
        let mut plan =
            direct::plan(self.gpu_rdma, &facts).map_err(|why| format!("{what}: {why}"))?;
        if self.gpu_method.load(Ordering::Relaxed) == 2 && plan.first() == Some(&Method::DmaBuf) {
            plan.reverse();
        }
        let mut tried = Vec::new();
        for m in plan {
            match reg_gpu(m, &facts, &self.nic_pds(), region.addr, region.len, ordinal) {
                Ok(v) => {
                    self.gpu_method
                        .store(if m == Method::DmaBuf { 1 } else { 2 }, Ordering::Relaxed);
                    return Ok(v);
                }
                Err(e) => tried.push(format!("{m}: {e}")),
            }
        }
        Err(format!("{what}; tried {}", tried.join("; ")))
    }
}

/// `[addr, addr+len)` on each NIC's PD with plain `ibv_reg_mr` (host memory; GPU memory where
/// nvidia-peermem is loaded). The MRs made so far are dropped on failure.
fn reg_plain(pds: &[(&str, &verbs::Pd)], addr: u64, len: u64) -> Result<Vec<Mr>, String> {
    let mut v = Vec::with_capacity(pds.len());
    for (name, pd) in pds {
        // SAFETY: the engine's contract with the caller of register_memory: the range is
        // memory of this process, valid until unregister_memory returns, and peers may read
        // and write it meanwhile. on_unregister drops these MRs before that returns.
        let mr = unsafe { pd.reg_mr(addr as *mut u8, len as usize) }
            .map_err(|e| format!("registering [0x{addr:x}, +{len}) on {name}: {e}"))?;
        v.push(mr);
    }
    Ok(v)
}

/// GPU memory `[addr, addr+len)` of GPU `ordinal` on each NIC's PD with `method`: DMA-BUF
/// (the allocation exported once, as whole pages, and registered at the range's offset on
/// every NIC) or peermem (plain `ibv_reg_mr`; its error then says whether the module is
/// loaded).
fn reg_gpu(
    method: crate::gpu::direct::Method,
    facts: &crate::gpu::direct::Facts,
    pds: &[(&str, &verbs::Pd)],
    addr: u64,
    len: u64,
    ordinal: u32,
) -> Result<Vec<Mr>, String> {
    use crate::gpu::direct::Method;
    if method == Method::PeerMem {
        return reg_plain(pds, addr, len).map_err(|e| match &facts.peermem {
            Ok(_) => e,
            Err(why) => format!("{e} ({why})"),
        });
    }
    let cuda = crate::gpu::cuda().map_err(str::to_string)?;
    let (base, size) = match cuda.driver().classify(addr).map_err(|e| e.to_string())? {
        crate::sys::cuda::Pointer::Device { base, size, .. } => (base, size),
        crate::sys::cuda::Pointer::Host => {
            return Err("the driver does not report this range as GPU memory".into())
        }
    };
    if addr.saturating_add(len) > base.saturating_add(size) {
        return Err(format!("the range spans several CUDA allocations (VMM mappings) after [0x{base:x}, +{size}); one dma-buf covers one allocation: register each mapping on its own"));
    }
    // The export must be page-aligned: the allocation's pages (as NCCL exports them).
    let page = 4096u64;
    let start = base & !(page - 1);
    let end = base.saturating_add(size).div_ceil(page) * page;
    let fd = cuda
        .on_device(ordinal, |d| d.dmabuf_fd(start, end - start))
        .map_err(|e| e.to_string())?;
    let mut v = Vec::with_capacity(pds.len());
    for (name, pd) in pds {
        use std::os::fd::AsFd;
        v.push(
            pd.reg_dmabuf_mr(fd.as_fd(), addr - start, len as usize, addr)
                .map_err(|e| format!("on {name}: {e}"))?,
        );
    }
    Ok(v)
}

/// One registration method and what trying it gave ([`try_gpu_registration`]).
pub type GpuRegTry = (crate::gpu::direct::Method, Result<String, String>);

/// For `kvferry doctor`: registers 2 MiB of GPU `ordinal`'s memory on the first usable RDMA
/// NIC with each method `setting` allows, and deregisters it: whether each really works on
/// this host (the facts alone cannot tell whether the NIC's driver imports dma-bufs). `Err`:
/// why nothing could be tried.
pub fn try_gpu_registration(
    ordinal: u32,
    setting: crate::gpu::direct::GpuRdma,
) -> Result<Vec<GpuRegTry>, String> {
    use crate::gpu::direct;
    let probe = crate::nic::probe();
    if let Some(why) = probe.why_not() {
        return Err(why);
    }
    let verbs = Arc::new(Verbs::load().map_err(|e| e.to_string())?);
    let facts = direct::facts(ordinal, verbs.has_dmabuf());
    let methods = direct::plan(setting, &facts)?;
    let nic = probe
        .nics
        .iter()
        .find(|n| n.ports.iter().any(|p| p.active))
        .ok_or("no NIC with an active port")?;
    let ctx = Context::open(Arc::clone(&verbs), &nic.name).map_err(|e| e.to_string())?;
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let cuda = crate::gpu::cuda().map_err(str::to_string)?;
    let len = 2usize << 20;
    let mem = cuda
        .on_device(ordinal, |d| d.mem_alloc(len))
        .map_err(|e| format!("allocating 2 MiB on GPU {ordinal}: {e}"))?;
    let out = methods
        .into_iter()
        .map(|m| {
            let r = reg_gpu(
                m,
                &facts,
                &[(nic.name.as_str(), &pd)],
                mem,
                len as u64,
                ordinal,
            )
            .map(|mrs| {
                drop(mrs);
                format!(
                    "2 MiB of GPU {ordinal} memory registered on {} and deregistered",
                    nic.name
                )
            });
            (m, r)
        })
        .collect();
    if let Err(e) = cuda.on_device(ordinal, |d| d.mem_free(mem)) {
        tracing::warn!("freeing the 2 MiB doctor registered on GPU {ordinal}: {e}");
    }
    Ok(out)
}

impl RdmaTransport {
    /// Opens the NICs; an error says why RDMA cannot be used here (for `KVFERRY_TRANSPORT=rdma`
    /// to report, never a silent fallback).
    pub(crate) fn new(
        opts: RdmaOptions,
        dir: Arc<dyn PeerDirectory>,
    ) -> Result<RdmaTransport, String> {
        let probe = crate::nic::probe();
        if let Some(why) = probe.why_not() {
            return Err(why);
        }
        let verbs = Arc::new(Verbs::load().map_err(|e| e.to_string())?);
        let mut nics = Vec::new();
        let mut skipped = Vec::new();
        for n in &probe.nics {
            if let Some(only) = &opts.devices {
                if !only.iter().any(|d| d == &n.name) {
                    continue;
                }
            }
            let Some(port) = n
                .ports
                .iter()
                .find(|p| p.num == u32::from(PORT) && p.active)
            else {
                skipped.push(format!("{}: port {PORT} not active", n.name));
                continue;
            };
            let Some(gid_index) =
                sysfs::select_gid(port, opts.gid_index).and_then(|i| u8::try_from(i).ok())
            else {
                skipped.push(format!(
                    "{}: no usable GID (MC_GID_INDEX={:?})",
                    n.name, opts.gid_index
                ));
                continue;
            };
            let opened = (|| -> Result<Nic, VerbsError> {
                let ctx = Context::open(Arc::clone(&verbs), &n.name)?;
                let attr = ctx.query_port(PORT)?;
                let gid = ctx.query_gid(PORT, gid_index)?;
                let pd = ctx.alloc_pd()?;
                let cq = ctx.create_cq(CQ_DEPTH)?;
                Ok(Nic {
                    name: n.name.clone(),
                    pd,
                    cq,
                    attr,
                    gid_index,
                    gid,
                    inflight: Mutex::default(),
                    credits: Credits::new(CQ_DEPTH),
                    down: AtomicBool::new(false),
                    ups: AtomicU64::new(0),
                    closed: AtomicBool::new(false),
                    ctx,
                })
            })();
            match opened {
                Ok(nic) => nics.push(nic),
                Err(e) => skipped.push(format!("{}: {e}", n.name)),
            }
        }
        if nics.is_empty() {
            let found: Vec<&str> = probe.nics.iter().map(|n| n.name.as_str()).collect();
            return Err(match &opts.devices {
                Some(only) => format!(
                    "no usable RDMA device among KVFERRY_RDMA_DEVICES={} (found: {}; {})",
                    only.join(","),
                    found.join(", "),
                    skipped.join("; ")
                ),
                None => format!(
                    "no usable RDMA device (found: {}; {})",
                    found.join(", "),
                    skipped.join("; ")
                ),
            });
        }
        for s in &skipped {
            tracing::warn!("RDMA: not using {s}");
        }
        let names: Vec<String> = nics.iter().map(|n| n.name.clone()).collect();
        let places: Vec<topo::Place> = names
            .iter()
            .map(|n| topo::nic_place(std::path::Path::new(sysfs::ROOT), n))
            .collect();
        let matrix = match &opts.topo {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    format!(
                        "KVFERRY_RDMA_TOPO (MC_CUSTOM_TOPO_JSON) {}: {e}",
                        path.display()
                    )
                })?;
                let (m, unknown) = topo::parse(&text, &names).map_err(|e| {
                    format!(
                        "KVFERRY_RDMA_TOPO (MC_CUSTOM_TOPO_JSON) {}: {e}",
                        path.display()
                    )
                })?;
                if !unknown.is_empty() {
                    tracing::warn!("RDMA: the NIC priority matrix {} names NICs this engine does not use ({}); they are left out", path.display(), unknown.join(", "));
                }
                m
            }
            None => topo::cpu_entries(
                &places,
                &topo::numa_nodes(std::path::Path::new("/sys/devices/system/node")),
            ),
        };
        let nics_len = nics.len();
        let shared = Arc::new_cyclic(|weak: &Weak<Shared>| Shared {
            segment: opts.segment,
            nics,
            mrs: MrTable::default(),
            endpoints: Mutex::default(),
            paused: Mutex::default(),
            passive: Mutex::new(Passive::new(
                nics_len.max(1) * PEER_NICS * MAX_QPS_PER_EP,
                opts.max_passive_qps,
            )),
            sweep: Mutex::default(),
            names_are_addresses: opts.names_are_addresses,
            dir,
            stale: Mutex::default(),
            next_wr: AtomicU64::new(1),
            next_nic: AtomicUsize::new(0),
            clock: AtomicU64::new(0),
            max_endpoints: opts.max_endpoints.max(1),
            required: opts.required,
            retry_cnt: opts.retry_cnt.min(7),
            gpu_rdma: opts.gpu_rdma,
            topo: Mutex::new(matrix),
            topo_from_file: opts.topo.is_some(),
            places,
            verbs_dmabuf: verbs.has_dmabuf(),
            gpu_method: std::sync::atomic::AtomicU8::new(0),
            unkeyed: Mutex::default(),
            told: Mutex::default(),
            posters: PerPeer::new(POSTER_IDLE, poster(weak.clone()), Arc::new(gone)),
            shut: AtomicBool::new(false),
        });
        for i in 0..shared.nics.len() {
            let w = Arc::downgrade(&shared);
            std::thread::Builder::new()
                .name(format!("kvf-rdma-cq{i}"))
                .spawn(move || poller(w, i))
                .map_err(|e| format!("starting the RDMA completion thread: {e}"))?;
        }
        Ok(RdmaTransport { shared })
    }

    /// Answers a peer's `Connection` message: makes a QP on the NIC it names, connects it to
    /// the peer's QP and replies with ours; or a refusal saying why.
    pub(crate) fn on_connection(&self, body: &[u8]) -> Vec<u8> {
        let s = &self.shared;
        let m = match ConnectionMsg::decode(body) {
            Ok(m) => m,
            Err(e) => {
                return refusal(
                    "x@x",
                    &format!("{}@x", s.segment),
                    format!("kvferry: bad Connection message: {e}"),
                )
            }
        };
        let me = m.peer_nic_path.clone();
        let nic_name = split_nic_path(&m.peer_nic_path)
            .map(|(_, n)| n)
            .unwrap_or_default();
        let Some(idx) = s.nics.iter().position(|n| n.name == nic_name) else {
            let have: Vec<&str> = s.nics.iter().map(|n| n.name.as_str()).collect();
            return refusal(
                &me,
                &m.local_nic_path,
                format!(
                    "kvferry: no RDMA NIC named {nic_name:?} here (have: {})",
                    have.join(", ")
                ),
            );
        };
        let nic = &s.nics[idx];
        if m.ready_ack == Some(true) {
            // Mooncake's "ready" round (we never ask for it, but answer it): our QPs for that
            // peer reached RTS before we answered its request.
            let ours: Option<Vec<u32>> = s
                .passive
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&m.local_nic_path, idx)
                .map(|q| q.iter().map(Qp::qp_num).collect());
            let Some(qp_num) = ours else {
                return refusal(
                    &me,
                    &m.local_nic_path,
                    "kvferry: ready ACK for an unknown connection".into(),
                );
            };
            let ok = ConnectionMsg {
                local_nic_path: me,
                local_lid: nic.attr.lid,
                local_gid: format_gid(&nic.gid),
                peer_nic_path: m.local_nic_path,
                qp_num,
                ..Default::default()
            };
            return ok.encode();
        }
        let Some(gid) = parse_gid(&m.local_gid) else {
            return refusal(
                &me,
                &m.local_nic_path,
                "kvferry: the Connection message has no GID".into(),
            );
        };
        if m.qp_num.len() > MAX_QPS_PER_EP {
            return refusal(
                &me,
                &m.local_nic_path,
                format!(
                    "kvferry: {} QPs per endpoint asked, at most {MAX_QPS_PER_EP}",
                    m.qp_num.len()
                ),
            );
        }
        // Within the bounds before anything is made (checked again as they are installed).
        let fits = s.passive.lock().unwrap_or_else(|e| e.into_inner()).admit(
            &m.local_nic_path,
            idx,
            m.qp_num.len(),
        );
        if let Err(why) = fits {
            // Peers that left may free room for a later attempt.
            self.sweep_passive();
            return refusal(&me, &m.local_nic_path, why);
        }
        let mtu = path_mtu(&nic.attr, &m);
        let made = m
            .qp_num
            .iter()
            .map(|&remote| -> Result<Qp, VerbsError> {
                let qp = nic.pd.create_qp(&nic.cq, MAX_WR)?;
                qp.connect(
                    Path {
                        port: PORT,
                        sgid_index: nic.gid_index,
                        mtu,
                        retry_cnt: s.retry_cnt,
                    },
                    &RemoteQp {
                        qp_num: remote,
                        lid: m.local_lid,
                        gid,
                    },
                )?;
                Ok(qp)
            })
            .collect::<Result<Vec<Qp>, VerbsError>>();
        let qps = match made {
            Ok(qps) => qps,
            Err(e) => return refusal(&me, &m.local_nic_path, format!("kvferry: {e}")),
        };
        let reply = hello(&s.segment, nic, &m.local_nic_path, &qps);
        let n = qps.len();
        // A peer reconnecting the same NIC pair replaces its old QPs (it dropped its own).
        let (installed, held) = {
            let mut p = s.passive.lock().unwrap_or_else(|e| e.into_inner());
            let r = p.insert(&m.local_nic_path, idx, Instant::now(), qps);
            (r, p.pairs())
        };
        // (QPs replaced or refused are destroyed here, outside the lock.)
        if let Err((_, why)) = installed {
            self.sweep_passive();
            return refusal(&me, &m.local_nic_path, why);
        }
        tracing::debug!(peer = %m.local_nic_path, local = %nic.name, qps = n, "RDMA: accepted a connection");
        if held >= PASSIVE_SWEEP_AT {
            self.sweep_passive();
        }
        reply
    }

    /// What the transport holds.
    pub(crate) fn usage(&self) -> RdmaUsage {
        let s = &self.shared;
        let p = s.passive.lock().unwrap_or_else(|e| e.into_inner());
        RdmaUsage {
            endpoints: s.endpoints.lock().unwrap_or_else(|e| e.into_inner()).len(),
            passive: p.pairs(),
            passive_qps: p.qps(),
            regions: s.mrs.len(),
        }
    }

    /// Starts a look for departed peers (see the module's doc) unless one runs or ran within
    /// [`PASSIVE_SWEEP_EVERY`]. The thread holds the transport only while it reads or edits the
    /// table, never while it waits on a peer or on the metadata service.
    fn sweep_passive(&self) {
        {
            let mut g = self.shared.sweep.lock().unwrap_or_else(|e| e.into_inner());
            if g.0 || g.1.is_some_and(|t| t.elapsed() < PASSIVE_SWEEP_EVERY) {
                return;
            }
            *g = (true, Some(Instant::now()));
        }
        let weak = Arc::downgrade(&self.shared);
        let spawned = std::thread::Builder::new()
            .name("kvf-rdma-sweep".into())
            .spawn(move || sweep(&weak));
        if spawned.is_err() {
            self.shared
                .sweep
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .0 = false;
        }
    }
}

/// One look for departed peers (on its own thread): in P2P mode at each peer's name, its
/// handshake address; with a metadata service at each peer's entry there and the address it
/// names ([`Passive::judge`]). The QPs of those gone, made before the look began, are
/// destroyed.
fn sweep(weak: &Weak<Shared>) {
    let begun = Instant::now();
    let Some((peers, by_address, dir)) = weak.upgrade().map(|s| {
        let peers = s.passive.lock().unwrap_or_else(|e| e.into_inner()).peers();
        (peers, s.names_are_addresses, Arc::clone(&s.dir))
    }) else {
        return;
    };
    let gone = if by_address {
        passive::gone_by_address(peers.iter().map(String::as_str), refuses)
    } else {
        // Asked without the table locked; then judged with it (what is learnt is kept).
        let said: Vec<(String, Published)> = peers
            .into_iter()
            .map(|p| {
                let w = dir.published(&p);
                (p, w)
            })
            .collect();
        drop(dir);
        // The addresses to probe (named now, or known from an earlier look), probed without
        // the table locked.
        let Some(s) = weak.upgrade() else { return };
        let addrs: Vec<std::net::SocketAddr> = {
            let p = s.passive.lock().unwrap_or_else(|e| e.into_inner());
            said.iter()
                .filter_map(|(seg, w)| p.to_probe(seg, *w))
                .collect()
        };
        drop(s);
        let refused: std::collections::HashSet<std::net::SocketAddr> =
            addrs.into_iter().filter(|a| refuses(*a)).collect();
        let Some(s) = weak.upgrade() else { return };
        let now = Instant::now();
        let mut p = s.passive.lock().unwrap_or_else(|e| e.into_inner());
        said.into_iter()
            .filter(|(seg, w)| p.judge(seg, *w, now, |a| refused.contains(&a)))
            .map(|(seg, _)| seg)
            .collect()
    };
    let Some(s) = weak.upgrade() else { return };
    if !gone.is_empty() {
        let dropped = s
            .passive
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .release(&gone, begun);
        tracing::info!(peers = gone.len(), pairs = dropped.len(), "RDMA: released the QPs made for peers found gone (their handshake address refuses connections, or their metadata entry is gone)");
        drop(dropped); // destroyed outside the lock
    }
    s.sweep.lock().unwrap_or_else(|e| e.into_inner()).0 = false;
}

/// Whether nothing listens at `addr` (a connection is refused). No answer within
/// [`PASSIVE_PROBE_TIMEOUT`], or any other error, is not a refusal: the peer may be alive.
fn refuses(addr: std::net::SocketAddr) -> bool {
    std::net::TcpStream::connect_timeout(&addr, PASSIVE_PROBE_TIMEOUT)
        .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused)
}

/// A refusal (`reply_msg` set) in the form the message codec accepts.
fn refusal(me: &str, peer: &str, why: String) -> Vec<u8> {
    tracing::warn!("RDMA: refused a connection from {peer}: {why}");
    let path = |p: &str| {
        if split_nic_path(p).is_some() {
            p.to_string()
        } else {
            "unknown@unknown".to_string()
        }
    };
    ConnectionMsg {
        local_nic_path: path(me),
        peer_nic_path: path(peer),
        reply_msg: why,
        ..Default::default()
    }
    .encode()
}

/// Our `Connection` message for `qps` on `nic`, to `peer_nic_path`. No `ready_ack` field:
/// a Mooncake peer then considers the connection ready without the extra round.
fn hello(segment: &str, nic: &Nic, peer_nic_path: &str, qps: &[Qp]) -> Vec<u8> {
    let mut extra = Map::new();
    extra.insert(MTU_FIELD.into(), json!(nic.attr.mtu_bytes()));
    ConnectionMsg {
        local_nic_path: format!("{segment}@{}", nic.name),
        local_lid: nic.attr.lid,
        local_gid: format_gid(&nic.gid),
        peer_nic_path: peer_nic_path.into(),
        qp_num: qps.iter().map(Qp::qp_num).collect(),
        extra,
        ..Default::default()
    }
    .encode()
}

/// The path MTU: the smaller of our port's active MTU and the peer's (when it says it).
fn path_mtu(attr: &PortAttr, m: &ConnectionMsg) -> u32 {
    let theirs = m
        .extra
        .get(MTU_FIELD)
        .and_then(Value::as_u64)
        .and_then(|b| u32::try_from(b).ok())
        .and_then(verbs::mtu_enum);
    theirs.map_or(attr.active_mtu, |t| t.min(attr.active_mtu))
}

impl Shared {
    fn mrs_for(&self, addr: u64, len: u64) -> Option<(Arc<Held<Vec<Mr>>>, usize)> {
        let (start, v) = self.mrs.containing(addr)?;
        let first = v.first()?;
        let end = addr.checked_add(len)?;
        (end <= start + first.len() as u64).then(|| (Arc::clone(&v), (addr - start) as usize))
    }

    /// The endpoint to `peer`'s NIC `dev` from local NIC `nic`, connecting it if needed.
    fn endpoint(
        &self,
        peer: &Peer,
        desc: &SegmentDesc,
        nic: usize,
        dev: &DeviceDesc,
    ) -> Result<Arc<Endpoint>, String> {
        let key: EpKey = (peer.name.clone(), nic, dev.name.clone());
        if let Some(ep) = self
            .endpoints
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
        {
            ep.last_use.store(
                self.clock.fetch_add(1, Ordering::Relaxed),
                Ordering::Relaxed,
            );
            return Ok(Arc::clone(ep));
        }
        let n = &self.nics[nic];
        let server = desc
            .rdma_server_name
            .clone()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| desc.name.clone());
        let peer_path = format!("{server}@{}", dev.name);
        let qps = (0..QPS_PER_EP)
            .map(|_| n.pd.create_qp(&n.cq, MAX_WR))
            .collect::<Result<Vec<Qp>, VerbsError>>()
            .map_err(|e| e.to_string())?;
        let reply = self
            .dir
            .handshake(
                peer,
                MsgType::Connection,
                &hello(&self.segment, n, &peer_path, &qps),
            )
            .map_err(|e| {
                format!(
                    "RDMA handshake with {peer_path} from {} failed: {e}",
                    n.name
                )
            })?;
        let r = ConnectionMsg::decode(&reply).map_err(|e| {
            // A refusal need not carry NIC paths (a peer without RDMA answers only `reply_msg`).
            let refused = serde_json::from_slice::<Value>(&reply).ok().and_then(|v| {
                v.get("reply_msg")
                    .and_then(Value::as_str)
                    .filter(|r| !r.is_empty())
                    .map(str::to_string)
            });
            match refused {
                Some(why) => format!(
                    "{peer_path} refused the RDMA connection from {}: {why}",
                    n.name
                ),
                None => format!("RDMA handshake with {peer_path}: bad answer: {e}"),
            }
        })?;
        if let Some(why) = r.refused() {
            return Err(format!(
                "{peer_path} refused the RDMA connection from {}: {why}",
                n.name
            ));
        }
        let gid = parse_gid(&r.local_gid)
            .or_else(|| parse_gid(&dev.gid))
            .ok_or_else(|| format!("{peer_path} published no GID"))?;
        let path = Path {
            port: PORT,
            sgid_index: n.gid_index,
            mtu: path_mtu(&n.attr, &r),
            retry_cnt: self.retry_cnt,
        };
        if r.qp_num.len() != qps.len() {
            return Err(format!(
                "{peer_path} answered with {} QPs for our {}",
                r.qp_num.len(),
                qps.len()
            ));
        }
        for (qp, &remote) in qps.iter().zip(&r.qp_num) {
            qp.connect(
                path,
                &RemoteQp {
                    qp_num: remote,
                    lid: r.local_lid,
                    gid,
                },
            )
            .map_err(|e| e.to_string())?;
        }
        tracing::debug!(peer = %peer_path, local = %n.name, remote_qps = ?r.qp_num, "RDMA: connected");
        let last_use = AtomicU64::new(self.clock.fetch_add(1, Ordering::Relaxed));
        let ep = Arc::new(Endpoint {
            qps,
            next_qp: AtomicUsize::new(0),
            key: key.clone(),
            credits: Credits::new(MAX_OUTSTANDING),
            expired: AtomicBool::new(false),
            broken: AtomicBool::new(false),
            last_use,
        });
        let evicted: Vec<Arc<Endpoint>> = {
            let mut eps = self.endpoints.lock().unwrap_or_else(|e| e.into_inner());
            eps.insert(key, Arc::clone(&ep));
            if eps.len() > self.max_endpoints {
                // Idle: only the cache holds it (slices in flight and posting threads hold
                // clones, each taken under this lock, so none can appear meanwhile).
                let view = eps
                    .iter()
                    .map(|(k, e)| {
                        (
                            k.clone(),
                            e.last_use.load(Ordering::Relaxed),
                            Arc::strong_count(e) > 1,
                        )
                    })
                    .collect();
                lru_victims(view, self.max_endpoints)
                    .into_iter()
                    .filter_map(|k| eps.remove(&k))
                    .collect()
            } else {
                Vec::new()
            }
        };
        for e in evicted {
            tracing::debug!(peer = %e.key.0, local = %self.nics[e.key.1].name, remote = %e.key.2, max = self.max_endpoints, "RDMA: closed the least recently used idle endpoint");
        }
        Ok(ep)
    }

    /// Drops `ep` from the cache (a failed QP is rebuilt on next use).
    fn forget(&self, ep: &Arc<Endpoint>) {
        let mut eps = self.endpoints.lock().unwrap_or_else(|e| e.into_inner());
        if eps.get(&ep.key).is_some_and(|e| Arc::ptr_eq(e, ep)) {
            eps.remove(&ep.key);
        }
    }

    fn run(&self, job: Job) {
        let Job { peer, pieces } = job;
        let stale = self
            .stale
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&peer.name);
        if stale {
            if let Err(e) = self.dir.refresh(&peer) {
                tracing::debug!(
                    "RDMA: re-reading the descriptor of {} after a refused key: {e}",
                    peer.name
                );
            }
        }
        for p in pieces {
            if self.shut.load(Ordering::Acquire) {
                fail_piece(
                    p,
                    FailKind::Failed,
                    FailCause::ShutDown,
                    "the engine is shut down".into(),
                );
                continue;
            }
            self.run_piece(&peer, p);
        }
    }

    fn run_piece(&self, peer: &Arc<Peer>, p: Piece) {
        let deadline = p.task.deadline();
        if Instant::now() >= deadline {
            return fail_piece(
                p,
                FailKind::Timeout,
                FailCause::Timeout,
                "the deadline passed before the request was posted".into(),
            );
        }
        if p.guard.is_revoked() {
            return fail_piece(
                p,
                FailKind::Failed,
                FailCause::LocalNotRegistered,
                "the local range is being unregistered".into(),
            );
        }
        let desc = peer.desc();
        let Some(buf) = desc.find_buffer(p.remote, p.len) else {
            let why = format!(
                "{}: [0x{:x}, +{}) is not inside a buffer it published",
                peer.name, p.remote, p.len
            );
            return fail_piece(p, FailKind::Failed, FailCause::RemoteNotRegistered, why);
        };
        let Some((mrs, base)) = self.mrs_for(p.local, p.len) else {
            return fail_piece(
                p,
                FailKind::Failed,
                FailCause::LocalNotRegistered,
                "the local range has no RDMA memory region".into(),
            );
        };
        let n_nics = self.nics.len();
        // Each local NIC with its peer NIC and the rkey there.
        let mut routes = Vec::with_capacity(n_nics);
        for nic in 0..n_nics {
            let Some((i, dev)) = remote_device(&desc, &self.nics[nic].name, &buf.name) else {
                return fail_piece(
                    p,
                    FailKind::Failed,
                    FailCause::Protocol,
                    format!("{} publishes no RDMA devices", peer.name),
                );
            };
            let Some(&rkey) = buf.rkey.get(i) else {
                return fail_piece(
                    p,
                    FailKind::Failed,
                    FailCause::Protocol,
                    format!(
                        "{} publishes no rkey for device {} of buffer 0x{:x}",
                        peer.name, dev.name, buf.addr
                    ),
                );
            };
            let Ok(rkey) = u32::try_from(rkey) else {
                return fail_piece(
                    p,
                    FailKind::Failed,
                    FailCause::Protocol,
                    format!("{}: rkey {rkey} is not 32-bit", peer.name),
                );
            };
            routes.push((dev.clone(), rkey));
        }
        let near = {
            let names: Vec<String> = self.nics.iter().map(|n| n.name.clone()).collect();
            topo::mask(
                &self.topo.lock().unwrap_or_else(|e| e.into_inner()),
                &p.guard.region().location,
                &names,
            )
        };
        let slices = p.len.div_ceil(SLICE) as usize;
        let first_nic = self.next_nic.fetch_add(1, Ordering::Relaxed);
        let op = match p.opcode {
            Opcode::Write => Op::Write,
            Opcode::Read => Op::Read,
        };
        p.task.set_pending();
        let piece = Arc::new(PieceState {
            task: Arc::clone(&p.task),
            peer: Arc::clone(peer),
            op,
            mrs,
            base,
            remote: p.remote,
            routes,
            near,
            len: p.len,
            left: AtomicUsize::new(slices),
            failure: Mutex::new(None),
            guard: p.guard,
        });
        // The NIC pairs to use, starting at a rotating NIC: as many as there are slices, each
        // connected; a pair that cannot be connected is paused and its slices go to the others
        // (a paused pair is tried again only when no other works).
        let (usable, why_not) = self.connect_pairs(&piece, &desc, first_nic, slices, None);
        if usable.is_empty() {
            let why = why_not.join("; ");
            for _ in 0..slices {
                piece.slice_end(Err((
                    FailKind::Failed,
                    FailCause::PeerUnreachable,
                    why.clone(),
                )));
            }
            return;
        }
        // Slice i goes over usable pair i % n; each pair's slices are posted in chains.
        let n_use = usable.len();
        for (k, (nic, ep)) in usable.iter().enumerate() {
            let mine: Vec<(u32, u8)> = (k..slices).step_by(n_use).map(|i| (i as u32, 0)).collect();
            self.post_slices(&piece, *nic, ep, &mine, deadline);
        }
    }

    /// Up to `want` connected NIC pairs for `piece` (local NIC index and endpoint), in the
    /// order of [`pair_order`]; a pair that cannot be connected is paused. Also says why the
    /// others could not be used.
    fn connect_pairs(
        &self,
        piece: &PieceState,
        desc: &SegmentDesc,
        first: usize,
        want: usize,
        avoid: Option<usize>,
    ) -> (Vec<(usize, Arc<Endpoint>)>, Vec<String>) {
        let n = self.nics.len();
        let key = |nic: usize| -> EpKey {
            (
                piece.peer.name.clone(),
                nic,
                piece.routes[nic].0.name.clone(),
            )
        };
        let paused: Vec<bool> = {
            let p = self.paused.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            // A NIC whose port is down counts as paused: used only when no other connects.
            (0..n)
                .map(|nic| {
                    self.nics[nic].down.load(Ordering::Acquire)
                        || p.get(&key(nic)).is_some_and(|&until| now < until)
                })
                .collect()
        };
        let mut usable: Vec<(usize, Arc<Endpoint>)> = Vec::new();
        let mut why_not: Vec<String> = Vec::new();
        for tier in pair_order(n, first, avoid, &paused, &piece.near) {
            for nic in tier {
                if usable.len() >= want {
                    break;
                }
                let dev = &piece.routes[nic].0;
                let ups = self.nics[nic].ups.load(Ordering::Acquire);
                match self.endpoint(&piece.peer, desc, nic, dev) {
                    Ok(ep) => {
                        self.paused
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .remove(&key(nic));
                        usable.push((nic, ep));
                    }
                    Err(e) => {
                        if self.pause(&key(nic), ups) {
                            tracing::warn!(
                                "RDMA: not using {} -> {}@{} for {PAUSE:?}: {e}",
                                self.nics[nic].name,
                                piece.peer.name,
                                dev.name
                            );
                        } else {
                            tracing::info!("RDMA: not using {} -> {}@{} (its link went down or came back meanwhile): {e}", self.nics[nic].name, piece.peer.name, dev.name);
                        }
                        why_not.push(e);
                    }
                }
            }
            if !usable.is_empty() {
                break;
            }
        }
        (usable, why_not)
    }

    /// Posts `slices` (index, retries so far) of `piece` on `ep` from local NIC `nic`, in
    /// chains, within the bounds on work requests in flight.
    fn post_slices(
        &self,
        piece: &Arc<PieceState>,
        nic: usize,
        ep: &Arc<Endpoint>,
        slices: &[(u32, u8)],
        deadline: Instant,
    ) {
        let rkey = piece.routes[nic].1;
        let nic_credits = &self.nics[nic].credits;
        let ups = self.nics[nic].ups.load(Ordering::Acquire);
        // A chain whose endpoint was flushed since it was chosen goes to a pair chosen anew
        // (uncounted; after what this peer's posting thread has queued).
        let again = |chain: &[(u32, u8)]| {
            self.retry_later(
                chain
                    .iter()
                    .map(|&(idx, retries)| Retry {
                        piece: Arc::clone(piece),
                        idx,
                        retries,
                        avoid: None,
                    })
                    .collect(),
            )
        };
        for chain in slices.chunks(CHAIN) {
            let n = chain.len() as u32;
            // Checked per chain: a connect or a wait for credits before it may have taken
            // until the range was being unregistered (whose barrier waits only for work
            // requests in flight) or past the deadline (past which nothing is posted).
            let stop = if self.shut.load(Ordering::Acquire) {
                Some((
                    FailKind::Failed,
                    FailCause::ShutDown,
                    "the engine shut down; the rest of the request is not posted".to_string(),
                ))
            } else if let Some(f) = piece
                .failure
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
            {
                // Another slice failed for good (a refused key, say): the piece has failed,
                // and posting the rest would only fail it again, breaking another endpoint.
                Some(f)
            } else if piece.guard.is_revoked() {
                Some((
                    FailKind::Failed,
                    FailCause::LocalNotRegistered,
                    "the local range is being unregistered; the rest of the request is not posted"
                        .to_string(),
                ))
            } else if Instant::now() >= deadline {
                Some((
                    FailKind::Timeout,
                    FailCause::Timeout,
                    format!(
                        "the deadline passed before the rest of the request was posted on {}",
                        self.nics[nic].name
                    ),
                ))
            } else {
                None
            };
            if let Some((kind, cause, why)) = stop {
                for _ in chain {
                    piece.slice_end(Err((kind, cause, why.clone())));
                }
                continue;
            }
            if ep.flushed() {
                again(chain);
                continue;
            }
            if !ep.credits.acquire(n, deadline) {
                for _ in chain {
                    piece.slice_end(Err((FailKind::Timeout, FailCause::Timeout, format!("{MAX_OUTSTANDING} work requests already in flight to the peer on {} at the deadline", self.nics[nic].name))));
                }
                continue;
            }
            if !nic_credits.acquire(n, deadline) {
                ep.credits.release(n);
                for _ in chain {
                    piece.slice_end(Err((
                        FailKind::Timeout,
                        FailCause::Timeout,
                        format!(
                            "{CQ_DEPTH} work requests already in flight on {} at the deadline",
                            self.nics[nic].name
                        ),
                    )));
                }
                continue;
            }
            if ep.flushed() {
                // Flushed while this waited for credits (which a flush gives back).
                ep.credits.release(n);
                nic_credits.release(n);
                again(chain);
                continue;
            }
            let ids: Vec<u64> = chain
                .iter()
                .map(|_| self.next_wr.fetch_add(1, Ordering::Relaxed))
                .collect();
            let wrs: Vec<Wr<'_>> = chain
                .iter()
                .zip(&ids)
                .map(|(&(i, _), &wr_id)| {
                    let off = u64::from(i) * SLICE;
                    let len = (piece.len - off).min(SLICE) as u32;
                    Wr {
                        wr_id,
                        op: piece.op,
                        local: &piece.mrs[nic],
                        offset: piece.base + off as usize,
                        len,
                        remote_addr: piece.remote + off,
                        rkey,
                        signaled: true,
                    }
                })
                .collect();
            // Registered before posting: a completion may arrive before post returns.
            {
                let mut inflight = self.nics[nic]
                    .inflight
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                if self.nics[nic].closed.load(Ordering::Acquire) {
                    drop(inflight);
                    ep.credits.release(n);
                    nic_credits.release(n);
                    for _ in chain {
                        piece.slice_end(Err((
                            FailKind::Failed,
                            FailCause::ShutDown,
                            format!(
                                "the engine shut down; {} completes nothing more",
                                self.nics[nic].name
                            ),
                        )));
                    }
                    continue;
                }
                for (&(idx, retries), &id) in chain.iter().zip(&ids) {
                    inflight.insert(
                        id,
                        Slice {
                            piece: Arc::clone(piece),
                            ep: Arc::clone(ep),
                            idx,
                            nic,
                            retries,
                        },
                    );
                }
            }
            let qp = &ep.qps[ep.next_qp.fetch_add(1, Ordering::Relaxed) % ep.qps.len()];
            if let Err(e) = qp.post(&wrs) {
                let posted = match &e {
                    VerbsError::Post { posted, .. } => *posted,
                    _ => 0,
                };
                let why = e.to_string();
                let unposted: Vec<Slice> = {
                    let mut inflight = self.nics[nic]
                        .inflight
                        .lock()
                        .unwrap_or_else(|e| e.into_inner());
                    ids[posted..]
                        .iter()
                        .filter_map(|id| inflight.remove(id))
                        .collect()
                };
                ep.credits.release((ids.len() - posted) as u32);
                nic_credits.release((ids.len() - posted) as u32);
                self.forget(ep);
                if !ep.flushed() {
                    self.pause(&ep.key, ups);
                }
                for sl in unposted {
                    self.failed(sl, POST_FAILED, &why);
                }
            }
        }
    }

    /// Hands `retries` to their peer's posting thread, to be posted again on a pair chosen
    /// anew ([`Shared::repost`]); once the posting threads are closed (shutdown) they end.
    fn retry_later(&self, retries: Vec<Retry>) {
        for r in retries {
            let peer = r.piece.peer.name.clone();
            if let Err(Work::Retry(r)) = self.posters.send(&peer, Work::Retry(r)) {
                let (cause, why) = if self.shut.load(Ordering::Acquire) {
                    (
                        FailCause::ShutDown,
                        "the engine shut down before a failed request could be posted again",
                    )
                } else {
                    (
                        FailCause::Other,
                        "no posting thread could be started to post a failed request again",
                    )
                };
                r.piece
                    .slice_end(Err((FailKind::Failed, cause, why.into())));
            }
        }
    }

    /// Leaves the NIC pair of `key` alone for [`PAUSE`] (tried only when no other works),
    /// after an attempt on it that began when its local port had come back `ups` times;
    /// whether it did. Not when that port is down (it counts as paused while it is) or came
    /// back since (the attempt failed for the link): a pause would outlast the link's return.
    /// (A port that comes back ends the pauses made before: [`Shared::check_port`].)
    fn pause(&self, key: &EpKey, ups: u64) -> bool {
        let nic = &self.nics[key.1];
        if nic.down.load(Ordering::Acquire) || nic.ups.load(Ordering::Acquire) != ups {
            return false;
        }
        self.paused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.clone(), Instant::now() + PAUSE);
        true
    }

    /// A slice whose work request failed with `status` (`why`): ends it, or hands it to the
    /// posting thread to be posted again ([`Ended::fate`]).
    fn failed(&self, sl: Slice, status: u32, why: &str) {
        let Slice {
            piece,
            ep,
            idx,
            nic,
            retries,
        } = sl;
        let expired = ep.expired.load(Ordering::Acquire);
        let past = piece.task.deadline() <= Instant::now();
        let flushed_by_us = ep.flushed();
        let piece_failed = piece
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some();
        let fate = Ended {
            status,
            flushed_for_deadline: flushed_by_us,
            past_deadline: past,
            shut: self.shut.load(Ordering::Acquire),
            revoked: piece.guard.is_revoked(),
            retries,
            port_down: self.nics[nic].down.load(Ordering::Acquire),
            piece_failed,
        }
        .fate();
        let name = &self.nics[nic].name;
        let tried = if retries > 0 {
            format!(" (after {retries} retries on other NIC pairs)")
        } else {
            String::new()
        };
        let end = match fate {
            Fate::Again { counted, avoid } => {
                self.retry_later(vec![Retry { piece, idx, retries: retries + u8::from(counted), avoid: avoid.then_some(nic) }]);
                return;
            }
            Fate::Timeout if expired => (FailKind::Timeout, FailCause::Timeout, format!("the deadline passed with the request in flight on {name}; its queue pair was flushed ({why})")),
            Fate::Timeout => (FailKind::Timeout, FailCause::Timeout, format!("the deadline passed; the request's last attempt on {name} failed: {why}")),
            Fate::ShutDown => (FailKind::Failed, FailCause::ShutDown, format!("the engine shut down with the request in flight on {name} ({why})")),
            Fate::Revoked => (FailKind::Failed, FailCause::LocalNotRegistered, format!("the local range is being unregistered; the request on {name} failed and is not posted again ({why})")),
            Fate::Fail if status == 10 => (FailKind::Failed, FailCause::RemoteNotRegistered, format!("{why}{tried}")),
            Fate::Fail => (FailKind::Failed, FailCause::PeerLost, format!("{why}{tried}")),
        };
        piece.slice_end(Err(end));
    }

    /// Posts again slices that were flushed or failed, each on a pair chosen anew (another
    /// than the failed one when there is one; the failed endpoint is rebuilt when it is the
    /// only one left).
    fn repost(&self, retries: Vec<Retry>) {
        // Grouped by piece and avoided NIC: each group goes as chains on one pair.
        let mut groups: Vec<RetryGroup> = Vec::new();
        let now = Instant::now();
        for r in retries {
            let end = if self.shut.load(Ordering::Acquire) {
                Some((
                    FailKind::Failed,
                    FailCause::ShutDown,
                    "the engine shut down before a failed request could be posted again"
                        .to_string(),
                ))
            } else if r.piece.guard.is_revoked() {
                Some((
                    FailKind::Failed,
                    FailCause::LocalNotRegistered,
                    "the local range is being unregistered; a failed request is not posted again"
                        .to_string(),
                ))
            } else if let Some(f) = r
                .piece
                .failure
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
            {
                Some(f)
            } else if r.piece.task.deadline() <= now {
                Some((
                    FailKind::Timeout,
                    FailCause::Timeout,
                    "the deadline passed before a flushed or failed request could be posted again"
                        .to_string(),
                ))
            } else {
                None
            };
            if let Some(end) = end {
                r.piece.slice_end(Err(end));
                continue;
            }
            match groups
                .iter_mut()
                .find(|g| Arc::ptr_eq(&g.0, &r.piece) && g.1 == r.avoid)
            {
                Some(g) => g.2.push((r.idx, r.retries)),
                None => groups.push((r.piece, r.avoid, vec![(r.idx, r.retries)])),
            }
        }
        for (piece, avoid, slices) in groups {
            let desc = piece.peer.desc();
            let first =
                avoid.map_or_else(|| self.next_nic.fetch_add(1, Ordering::Relaxed), |a| a + 1);
            let (usable, why_not) = self.connect_pairs(&piece, &desc, first, 1, avoid);
            match usable.first() {
                Some((nic, ep)) => {
                    tracing::debug!(peer = %piece.peer.name, slices = slices.len(), local = %self.nics[*nic].name, "RDMA: posting flushed or failed slices again");
                    self.post_slices(&piece, *nic, ep, &slices, piece.task.deadline());
                }
                None => {
                    let why = why_not.join("; ");
                    for _ in &slices {
                        piece.slice_end(Err((
                            FailKind::Failed,
                            FailCause::PeerUnreachable,
                            format!("no NIC pair to post a failed request again: {why}"),
                        )));
                    }
                }
            }
        }
    }

    /// One completion of NIC `nic`.
    fn complete(&self, nic: usize, wc: &Wc) {
        let Some(s) = self.nics[nic]
            .inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&wc.wr_id)
        else {
            tracing::debug!("RDMA: completion for unknown work request {}", wc.wr_id);
            return;
        };
        s.ep.credits.release(1);
        self.nics[nic].credits.release(1);
        match wc.result(&self.nics[nic].name) {
            Ok(()) => s.piece.slice_end(Ok(())),
            Err(e) => {
                // The QP is in the error state now: rebuilt on next use.
                self.forget(&s.ep);
                let ours = s.ep.flushed();
                // (When it was posted is not known here: only a port down now spares the pair.)
                if !ours
                    && path_failure(e.status)
                    && self.pause(&s.ep.key, self.nics[nic].ups.load(Ordering::Acquire))
                {
                    tracing::warn!(
                        "RDMA: pausing {} -> {}@{} for {PAUSE:?}: {e}",
                        self.nics[nic].name,
                        s.ep.key.0,
                        s.ep.key.2
                    );
                }
                if e.status == 10 {
                    // Its keys may be stale (the peer registered again): re-read before the next request.
                    self.stale
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(s.ep.key.0.clone());
                }
                let why = if s.ep.expired.load(Ordering::Acquire) {
                    e.name.to_string()
                } else {
                    e.to_string()
                };
                let ep = Arc::clone(&s.ep);
                self.failed(s, e.status, &why);
                // Its other QPs go to the error state too, at once: the endpoint is rebuilt on
                // next use, and the peer then replaces its QPs of this pair, the siblings'
                // included, under the work requests still in flight on them (other tasks'
                // slices, which then failed later, counted, after the transport's retries).
                // Flushed now, they go again at once, uncounted.
                if !ours && e.status != FLUSHED && !ep.broken.swap(true, Ordering::AcqRel) {
                    for qp in &ep.qps {
                        if let Err(e) = qp.set_error() {
                            tracing::debug!("RDMA: flushing the QPs of a failed endpoint: {e}");
                        }
                    }
                }
            }
        }
    }

    /// Reads the port of NIC `nic` (its poller, every [`TICK`]); whether it is down. A port
    /// that left ACTIVE (its link went down) is left out of new pairs while others connect,
    /// and its poller flushes the QPs holding its slices ([`Shared::expire`]), so that they go
    /// out again on another NIC at once: a NIC need not complete the work requests its link
    /// lost (Soft-RoCE left READs in flight until their deadline). ACTIVE again, it is used
    /// again.
    fn check_port(&self, nic: usize) -> bool {
        let n = &self.nics[nic];
        let down = match n.ctx.query_port(PORT) {
            Ok(a) => !a.active(),
            Err(e) => {
                tracing::debug!("RDMA: reading the port of {}: {e}", n.name);
                return false;
            }
        };
        if n.down.swap(down, Ordering::AcqRel) != down {
            if down {
                tracing::warn!("RDMA: the port of {} is no longer ACTIVE (link down?): its requests in flight go again on the other NICs, and new ones avoid it until it is back; check its link with `ibv_devinfo -d {}`", n.name, n.name);
            } else {
                // A pair that failed to connect while the link was down (or in the moment
                // before this poller saw it go) failed for the link: it is tried again now,
                // not when its pause ends.
                n.ups.fetch_add(1, Ordering::AcqRel);
                let unpaused = unpause_nic(
                    &mut self.paused.lock().unwrap_or_else(|e| e.into_inner()),
                    nic,
                );
                tracing::info!("RDMA: the port of {} is ACTIVE again ({unpaused} of its NIC pairs paused while it was down are tried again)", n.name);
            }
        }
        down
    }

    /// Flushes the QPs holding slices past their deadline (or everything, at shutdown or with
    /// the port down): an RC
    /// QP cannot cancel one work request, so every slice on them is flushed; the late ones end
    /// TIMEOUT and the others, whose tasks still have time, are posted again ([`Shared::failed`]).
    fn expire(&self, nic: usize, all: bool) {
        let now = Instant::now();
        let late: Vec<Arc<Endpoint>> = {
            let inflight = self.nics[nic]
                .inflight
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let mut v: Vec<Arc<Endpoint>> = Vec::new();
            for s in inflight.values() {
                if (all || s.piece.task.deadline() <= now)
                    && !s.ep.expired.load(Ordering::Acquire)
                    && !v.iter().any(|e| Arc::ptr_eq(e, &s.ep))
                {
                    v.push(Arc::clone(&s.ep));
                }
            }
            v
        };
        for ep in late {
            // Out of the cache before it is marked: a posting thread that sees the mark
            // chooses anew and must not get it back.
            self.forget(&ep);
            ep.expired.store(true, Ordering::Release);
            for qp in &ep.qps {
                if let Err(e) = qp.set_error() {
                    tracing::warn!("RDMA: flushing a QP (past its deadline, its port down or shutting down) failed: {e}");
                }
            }
        }
    }
}

/// Ends the pauses of the NIC pairs from local NIC `nic` (its port is ACTIVE again: their
/// connects may have failed for its link alone); how many there were.
fn unpause_nic(paused: &mut HashMap<EpKey, Instant>, nic: usize) -> usize {
    let before = paused.len();
    paused.retain(|k, _| k.1 != nic);
    before - paused.len()
}

/// The peer NIC to use from the local NIC `local` for a remote buffer at `location`, and its
/// position in the peer's `devices` (where its keys are): the peer's NIC of the same name (rail
/// affinity), else the first of the location's (or `*`'s) preferred NICs in its
/// `priority_matrix` that it lists, else its first device. By name, never by guessed index.
fn remote_device<'d>(
    desc: &'d SegmentDesc,
    local: &str,
    location: &str,
) -> Option<(usize, &'d DeviceDesc)> {
    let by_name = |name: &str| {
        desc.devices
            .iter()
            .enumerate()
            .find(|(_, d)| d.name == name)
    };
    if let Some(hit) = by_name(local) {
        return Some(hit);
    }
    let prefs = desc
        .priority_matrix
        .get(location)
        .or_else(|| desc.priority_matrix.get("*"));
    let first_pref = prefs
        .and_then(|v| v.get(0))
        .and_then(Value::as_array)
        .and_then(|a| a.iter().filter_map(Value::as_str).find_map(by_name));
    first_pref.or_else(|| desc.devices.iter().enumerate().next())
}

/// The completion thread of NIC `nic`: ends when the transport is shut down and nothing is in
/// flight on the NIC any more.
fn poller(w: Weak<Shared>, nic: usize) {
    let mut wcs = [Wc::default(); 32];
    let mut shut_since: Option<Instant> = None;
    let mut port_read = Instant::now();
    loop {
        let Some(s) = w.upgrade() else { return };
        match s.nics[nic].cq.wait(&mut wcs, Instant::now() + TICK) {
            Ok(n) => {
                for wc in &wcs[..n] {
                    s.complete(nic, wc);
                }
            }
            Err(VerbsError::Timeout { .. }) => {}
            Err(e) => {
                tracing::warn!("RDMA: completion queue of {}: {e}", s.nics[nic].name);
                std::thread::sleep(TICK);
            }
        }
        let down = port_read.elapsed() >= TICK && {
            port_read = Instant::now();
            s.check_port(nic)
        };
        let shut = s.shut.load(Ordering::Acquire);
        s.expire(nic, shut || down);
        if shut {
            let since = *shut_since.get_or_insert_with(Instant::now);
            let mut inflight = s.nics[nic]
                .inflight
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if inflight.is_empty() && s.posters.finished() {
                s.nics[nic].closed.store(true, Ordering::Release);
                return;
            }
            // Flushed QPs complete at once; a device that never answers is given 10 s. (A
            // posting thread still waiting in a connect then posts nothing here: `closed`.)
            if since.elapsed() > Duration::from_secs(10) {
                s.nics[nic].closed.store(true, Ordering::Release);
                for (_, sl) in inflight.drain() {
                    sl.piece.slice_end(Err((
                        FailKind::Failed,
                        FailCause::ShutDown,
                        "the engine shut down; the NIC never completed this request".into(),
                    )));
                }
                return;
            }
        }
    }
}

/// What a peer's posting thread does with a unit of its work ([`per_peer`]): connects
/// endpoints and posts pieces, in order of submission, and posts again the slices the
/// completion threads hand back.
fn poster(w: Weak<Shared>) -> per_peer::Handler<Work> {
    Arc::new(move |_peer: &str, work: Work, rx: &mpsc::Receiver<Work>| {
        let Some(s) = w.upgrade() else {
            gone(work);
            return;
        };
        match work {
            Work::Job(job) => s.run(job),
            Work::Retry(r) => {
                // Flushes come in bursts: take every retry queued, then the job behind them.
                let mut retries = vec![r];
                let mut next = None;
                while let Ok(more) = rx.try_recv() {
                    match more {
                        Work::Retry(r) => retries.push(r),
                        Work::Job(j) => {
                            next = Some(j);
                            break;
                        }
                    }
                }
                s.repost(retries);
                if let Some(j) = next {
                    s.run(j);
                }
            }
        }
    })
}

/// Work that can no longer be posted: the engine shut down, or the peer's posting thread
/// panicked (what was queued behind the work it was doing).
fn gone(work: Work) {
    let (cause, why) = if std::thread::panicking() {
        (
            FailCause::Other,
            "the peer's posting thread failed (a bug: see the log) before it posted this",
        )
    } else {
        (FailCause::ShutDown, "the engine is shut down")
    };
    match work {
        Work::Job(job) => {
            for p in job.pieces {
                fail_piece(p, FailKind::Failed, cause, why.into());
            }
        }
        Work::Retry(r) => r
            .piece
            .slice_end(Err((FailKind::Failed, cause, why.into()))),
    }
}

impl Transport for RdmaTransport {
    fn name(&self) -> &'static str {
        "rdma"
    }

    /// Any memory on either side, GPU memory included (GPUDirect RDMA: registered on the
    /// NICs, never staged), to peers that publish RDMA devices; a piece goes only when its
    /// local range has memory regions on our NICs and the peer published keys for its remote
    /// buffer ([`auto_route`]), so staging's bounce buffers never can.
    fn caps(&self) -> Caps {
        Caps {
            kinds: Kinds::ALL,
            reach: Reach::AnyHost,
            needs: Needs::RdmaDevices,
            stageable: false,
        }
    }

    fn describe(&self, desc: &mut SegmentDesc, _prelude: Prelude) {
        let s = &self.shared;
        if !s.required {
            // `auto` initiates RDMA but publishes a TCP descriptor: a stock Mooncake engine picks
            // its transport by the target's `protocol`, so a Mooncake TCP peer could not reach
            // an engine that says `rdma` (checked in the VM by `examples/rdma_mooncake`).
            return;
        }
        desc.protocol = Protocols::One("rdma".into());
        desc.devices = s
            .nics
            .iter()
            .map(|n| DeviceDesc {
                name: n.name.clone(),
                lid: n.attr.lid,
                gid: format_gid(&n.gid),
                extra: Map::new(),
            })
            .collect();
        // A buffer whose MRs are still being made is not reachable over RDMA yet.
        desc.buffers.retain_mut(|b| match s.mrs.get(b.addr) {
            Some(v) => {
                b.rkey = v.iter().map(|m| u64::from(m.rkey())).collect();
                b.lkey = v.iter().map(|m| u64::from(m.lkey())).collect();
                true
            }
            None => false,
        });
        // The topology's entries, and every NIC preferred for any other location of a
        // published buffer and for `*`.
        let names: Vec<Value> = s.nics.iter().map(|n| json!(n.name)).collect();
        desc.priority_matrix.extend(topo::to_json(
            &s.topo.lock().unwrap_or_else(|e| e.into_inner()),
        ));
        let mut locations: Vec<String> = desc.buffers.iter().map(|b| b.name.clone()).collect();
        locations.push("*".into());
        for l in locations {
            desc.priority_matrix
                .entry(l)
                .or_insert_with(|| json!([names.clone(), []]));
        }
    }

    fn on_register(&self, region: &Region) -> crate::Result<()> {
        let s = &self.shared;
        let unkeyed = |why: String| {
            tracing::warn!("RDMA: [0x{:x}, +{}) is not registered on the NICs ({why}); requests from it go over TCP", region.addr, region.len);
            s.unkeyed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(region.addr, why);
        };
        if let Some(ordinal) = region.gpu {
            s.add_gpu_to_topology(ordinal);
        }
        let making = s.mrs.begin(region.addr);
        let registered = match region.gpu {
            Some(ordinal) => s.register_gpu(region, ordinal),
            None => s.register_host(region),
        };
        // (Not installed if the range was unregistered meanwhile: then dropped here.)
        match s.mrs.finish(making, registered) {
            Ok(()) => Ok(()),
            Err(None) => Err(crate::Error::Rdma(format!("[0x{:x}, +{}) was unregistered while it was being registered on the NICs; register it again if it is still wanted", region.addr, region.len))),
            Err(Some(why)) if !s.required => {
                unkeyed(why);
                Ok(())
            }
            Err(Some(why)) => Err(crate::Error::Rdma(why)),
        }
    }

    fn on_unregister(&self, region: &Region) {
        // The registry waited for every guard, so no work request of ours touches the range;
        // deregistering cuts peers off (their requests fail with a remote access error).
        self.shared
            .unkeyed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&region.addr);
        // Its MRs are deregistered when this returns: one still being made is not installed,
        // and a posting thread that still holds them (it cannot post: the range is revoked)
        // is waited for (`mr_table`).
        self.shared.mrs.withdraw(region.addr);
    }

    fn reachable(&self, peer: &Arc<Peer>) -> Result<(), String> {
        let d = peer.desc();
        if !d.protocol.contains("rdma") || d.devices.is_empty() {
            return Err(format!("segment {} publishes no RDMA devices (protocol {:?}): it has no RDMA transport, or no usable NIC", peer.name, d.protocol));
        }
        Ok(())
    }

    /// Pieces touching GPU memory (on either side) go when RDMA carries them as they are
    /// (GPUDirect: [`auto_route`]), whatever `KVFERRY_TRANSPORT` says; the others are handed
    /// back (to be staged, or to go over TCP). Host memory: with `KVFERRY_TRANSPORT=rdma` all
    /// pieces to a peer that publishes RDMA, or none; with `auto` each piece that can go, the
    /// rest handed back (TCP or shared memory carries them; why, logged once per peer).
    fn try_submit(
        &self,
        peer: &Arc<Peer>,
        pieces: Vec<Piece>,
        inline: bool,
    ) -> Result<(), (Vec<Piece>, String)> {
        let desc = peer.desc();
        let touches_gpu = |p: &Piece| {
            Mem::local_of(p) == Mem::Gpu
                || (peer.has_gpu()
                    && crate::transport::remote_mem(&desc, p.remote, p.len) == Mem::Gpu)
        };
        let gpu = pieces.iter().any(touches_gpu);
        if self.shared.required && !gpu {
            return match self.reachable(peer) {
                Ok(()) => {
                    self.submit(peer, pieces, inline);
                    Ok(())
                }
                Err(e) => Err((pieces, e)),
            };
        }
        let required = self.shared.required;
        let mut reach: Option<Result<(), String>> = None;
        let mut why = None;
        let (rdma, rest): (Vec<Piece>, Vec<Piece>) = pieces.into_iter().partition(|p| {
            let r = if required && !touches_gpu(p) {
                reach.get_or_insert_with(|| self.reachable(peer)).clone()
            } else {
                auto_route(
                    &desc,
                    self.shared.mrs_for(p.local, p.len).is_some(),
                    p.remote,
                    p.len,
                )
            };
            if let Err(e) = r {
                why.get_or_insert(e);
                return false;
            }
            true
        });
        if let (Some(why), false, false) = (&why, gpu, required) {
            if self
                .shared
                .told
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(peer.name.clone())
            {
                tracing::info!("KVFERRY_TRANSPORT=auto: requests to {} do not go over RDMA ({why}); TCP or shared memory carries them", peer.name);
            }
        }
        if !rdma.is_empty() {
            self.submit(peer, rdma, inline);
        }
        match why {
            Some(why) if !rest.is_empty() => Err((rest, why)),
            _ => Ok(()),
        }
    }

    fn on_handshake(&self, kind: MsgType, body: &[u8]) -> Option<Vec<u8>> {
        (kind == MsgType::Connection).then(|| self.on_connection(body))
    }

    fn submit(&self, peer: &Arc<Peer>, pieces: Vec<Piece>, _inline: bool) {
        let job = Job {
            peer: Arc::clone(peer),
            pieces,
        };
        match self.shared.posters.send(&peer.name, Work::Job(job)) {
            Ok(()) => {}
            Err(work) if self.shared.shut.load(Ordering::Acquire) => gone(work),
            Err(Work::Job(job)) => {
                for p in job.pieces {
                    fail_piece(
                        p,
                        FailKind::Failed,
                        FailCause::Other,
                        format!(
                            "no posting thread could be started for {} (out of threads?)",
                            peer.name
                        ),
                    );
                }
            }
            Err(work) => gone(work),
        }
    }

    fn shutdown(&self) {
        self.shared.shut.store(true, Ordering::Release);
        // Each posting thread fails what is still queued, then ends.
        self.shared.posters.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_whose_handshake_address_refuses_are_the_departed_ones() {
        let live = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let (live_addr, dead_addr) = (live.local_addr().unwrap(), dead.local_addr().unwrap());
        drop(dead);
        let paths = [
            format!("{live_addr}@mlx5_0"),
            format!("{dead_addr}@mlx5_0"),
            format!("{dead_addr}@mlx5_1"),
            "node-7@mlx5_0".to_string(),
            "garbage".to_string(),
        ];
        let gone = passive::gone_by_address(
            paths
                .iter()
                .filter_map(|p| split_nic_path(p).map(|(s, _)| s)),
            refuses,
        );
        assert_eq!(
            gone,
            [dead_addr.to_string()].into_iter().collect(),
            "only the address that refuses; a name is never looked up"
        );
        // A name that is not an address is not even asked about.
        let asked = std::sync::Mutex::new(Vec::new());
        passive::gone_by_address(["node-7", "10.0.0.1:15000"].into_iter(), |a| {
            asked.lock().unwrap().push(a);
            false
        });
        assert_eq!(
            *asked.lock().unwrap(),
            vec!["10.0.0.1:15000".parse::<std::net::SocketAddr>().unwrap()]
        );
    }

    #[test]
    fn the_path_mtu_is_the_smaller_of_both_ports() {
        let attr = PortAttr {
            state: 4,
            active_mtu: 5,
            lid: 0,
            link_layer: 2,
        };
        let mut m = ConnectionMsg::default();
        assert_eq!(path_mtu(&attr, &m), 5, "a peer that does not say: ours");
        m.extra.insert(MTU_FIELD.into(), json!(1024));
        assert_eq!(path_mtu(&attr, &m), 3);
        let small = PortAttr {
            active_mtu: 2,
            ..attr
        };
        assert_eq!(path_mtu(&small, &m), 2);
        m.extra.insert(MTU_FIELD.into(), json!(1500));
        assert_eq!(path_mtu(&attr, &m), 5, "not an MTU: ignored");
    }

    #[test]
    fn the_peer_nic_is_chosen_by_name() {
        let mut d = SegmentDesc::new("peer:1");
        let dev = |n: &str| DeviceDesc {
            name: n.into(),
            lid: 0,
            gid: String::new(),
            extra: Map::new(),
        };
        d.devices = vec![dev("mlx5_0"), dev("mlx5_1"), dev("mlx5_2")];
        d.priority_matrix
            .insert("cuda:0".into(), json!([["mlx5_2", "mlx5_1"], ["mlx5_0"]]));
        d.priority_matrix
            .insert("*".into(), json!([["mlx5_1"], []]));
        fn pick(d: &SegmentDesc, local: &str, loc: &str) -> Option<(usize, String)> {
            remote_device(d, local, loc).map(|(i, dv)| (i, dv.name.clone()))
        }
        assert_eq!(
            pick(&d, "mlx5_1", "cuda:0"),
            Some((1, "mlx5_1".into())),
            "same name first (rail affinity)"
        );
        assert_eq!(
            pick(&d, "rxe0", "cuda:0"),
            Some((2, "mlx5_2".into())),
            "then the location's first preferred, at its index in devices"
        );
        assert_eq!(
            pick(&d, "rxe0", "cpu:3"),
            Some((1, "mlx5_1".into())),
            "an unknown location falls back to *"
        );
        d.priority_matrix.clear();
        assert_eq!(
            pick(&d, "rxe0", "cpu:0"),
            Some((0, "mlx5_0".into())),
            "no matrix: the first device"
        );
        d.priority_matrix
            .insert("cpu:0".into(), json!([["mlx5_9"], []]));
        assert_eq!(
            pick(&d, "rxe0", "cpu:0"),
            Some((0, "mlx5_0".into())),
            "a preferred NIC it does not list is not guessed"
        );
        d.devices.clear();
        assert_eq!(pick(&d, "rxe0", "cpu:0"), None);
    }

    #[test]
    fn credits_bound_what_is_in_flight_and_waits_end_at_the_deadline() {
        let c = Arc::new(Credits::new(4));
        let soon = Instant::now() + Duration::from_millis(50);
        assert!(c.acquire(3, soon) && c.acquire(1, soon));
        let t = Instant::now();
        assert!(
            !c.acquire(1, soon),
            "full: waits for the deadline, then says no"
        );
        assert!(t.elapsed() >= Duration::from_millis(40) && t.elapsed() < Duration::from_secs(2));
        let c2 = Arc::clone(&c);
        let freer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            c2.release(2);
        });
        assert!(
            c.acquire(2, Instant::now() + Duration::from_secs(5)),
            "a release wakes the waiter"
        );
        freer.join().unwrap();
        assert!(!c.acquire(5, Instant::now()), "more than the bound: never");
    }

    #[test]
    fn a_deadline_fails_only_the_late_task_and_flushed_slices_of_others_go_again() {
        assert_eq!(
            Ended {
                status: FLUSHED,
                flushed_for_deadline: true,
                past_deadline: true,
                ..Ended::default()
            }
            .fate(),
            Fate::Timeout,
            "the late task itself"
        );
        assert_eq!(
            Ended {
                status: FLUSHED,
                flushed_for_deadline: true,
                ..Ended::default()
            }
            .fate(),
            Fate::Again {
                counted: false,
                avoid: false
            },
            "another task's slice on the flushed QP: posted again"
        );
        assert_eq!(
            Ended {
                status: FLUSHED,
                flushed_for_deadline: true,
                retries: MAX_RETRIES,
                ..Ended::default()
            }
            .fate(),
            Fate::Again {
                counted: false,
                avoid: false
            },
            "flushes by others' deadlines use no retry"
        );
        assert_eq!(
            Ended {
                status: FLUSHED,
                flushed_for_deadline: true,
                revoked: true,
                ..Ended::default()
            }
            .fate(),
            Fate::Revoked,
            "never posted again into a range being unregistered"
        );
        assert_eq!(
            Ended {
                status: FLUSHED,
                flushed_for_deadline: true,
                shut: true,
                ..Ended::default()
            }
            .fate(),
            Fate::ShutDown,
            "nor during shutdown"
        );
    }

    #[test]
    fn a_failed_completion_is_retried_on_another_pair_a_bounded_number_of_times() {
        for status in [12, 13, 20, 21, POST_FAILED] {
            assert_eq!(
                Ended {
                    status,
                    ..Ended::default()
                }
                .fate(),
                Fate::Again {
                    counted: true,
                    avoid: true
                },
                "status {status}"
            );
            assert_eq!(
                Ended {
                    status,
                    retries: MAX_RETRIES - 1,
                    ..Ended::default()
                }
                .fate(),
                Fate::Again {
                    counted: true,
                    avoid: true
                }
            );
            assert_eq!(
                Ended {
                    status,
                    retries: MAX_RETRIES,
                    ..Ended::default()
                }
                .fate(),
                Fate::Fail,
                "retries spent"
            );
            assert!(path_failure(status), "the pair is paused after {status}");
        }
        // Flushed because an earlier request on its QP failed: retried too, counted.
        assert_eq!(
            Ended {
                status: FLUSHED,
                ..Ended::default()
            }
            .fate(),
            Fate::Again {
                counted: true,
                avoid: true
            }
        );
        assert!(!path_failure(FLUSHED));
        // The request itself is wrong: another pair would fail it the same way.
        for status in [1, 4, 8, 9, 10] {
            assert_eq!(
                Ended {
                    status,
                    ..Ended::default()
                }
                .fate(),
                Fate::Fail,
                "status {status}"
            );
            assert!(!path_failure(status));
        }
        assert_eq!(
            Ended {
                status: 12,
                past_deadline: true,
                ..Ended::default()
            }
            .fate(),
            Fate::Timeout,
            "no retry past the deadline"
        );
        assert_eq!(
            Ended {
                status: 12,
                revoked: true,
                ..Ended::default()
            }
            .fate(),
            Fate::Revoked
        );
        // A piece that failed for good already is not posted again, however its slice ended
        // (flushed with its endpoint, uncounted, included): each repost of a request with a
        // refused key would otherwise break another endpoint.
        for (status, flushed) in [(FLUSHED, true), (FLUSHED, false), (12, false)] {
            assert_eq!(
                Ended {
                    status,
                    flushed_for_deadline: flushed,
                    piece_failed: true,
                    ..Ended::default()
                }
                .fate(),
                Fate::Fail,
                "status {status}"
            );
        }
    }

    /// A slice whose NIC's port went down (flushed by its poller, or failed by the NIC) goes
    /// again on another NIC without using a retry, however many it used: the link failed, not
    /// the request. Its deadline, shutdown and unregistering still end it, and a request that
    /// is itself wrong still fails.
    #[test]
    fn a_slice_on_a_port_that_went_down_goes_again_elsewhere_uncounted() {
        for status in [FLUSHED, 12, 13, POST_FAILED] {
            for retries in [0, MAX_RETRIES] {
                assert_eq!(
                    Ended {
                        status,
                        flushed_for_deadline: true,
                        retries,
                        port_down: true,
                        ..Ended::default()
                    }
                    .fate(),
                    Fate::Again {
                        counted: false,
                        avoid: true
                    },
                    "status {status}, {retries} retries, flushed by its poller"
                );
                assert_eq!(
                    Ended {
                        status,
                        retries,
                        port_down: true,
                        ..Ended::default()
                    }
                    .fate(),
                    Fate::Again {
                        counted: false,
                        avoid: true
                    },
                    "status {status}, {retries} retries"
                );
            }
        }
        assert_eq!(
            Ended {
                status: FLUSHED,
                flushed_for_deadline: true,
                past_deadline: true,
                port_down: true,
                ..Ended::default()
            }
            .fate(),
            Fate::Timeout,
            "its own deadline passed"
        );
        assert_eq!(
            Ended {
                status: FLUSHED,
                flushed_for_deadline: true,
                shut: true,
                port_down: true,
                ..Ended::default()
            }
            .fate(),
            Fate::ShutDown
        );
        assert_eq!(
            Ended {
                status: FLUSHED,
                flushed_for_deadline: true,
                revoked: true,
                port_down: true,
                ..Ended::default()
            }
            .fate(),
            Fate::Revoked
        );
        assert_eq!(
            Ended {
                status: 10,
                port_down: true,
                ..Ended::default()
            }
            .fate(),
            Fate::Fail,
            "a wrong request fails on any NIC"
        );
    }

    #[test]
    fn a_port_back_up_ends_only_its_own_pairs_pauses() {
        let until = Instant::now() + PAUSE;
        let mut paused: HashMap<EpKey, Instant> = HashMap::new();
        paused.insert(("a:1".into(), 0, "rxe0".into()), until);
        paused.insert(("b:1".into(), 0, "rxe1".into()), until);
        paused.insert(("a:1".into(), 1, "rxe0".into()), until);
        assert_eq!(unpause_nic(&mut paused, 0), 2);
        assert_eq!(paused.len(), 1);
        assert!(
            paused.contains_key(&("a:1".to_string(), 1, "rxe0".to_string())),
            "another NIC's pause stays"
        );
        assert_eq!(unpause_nic(&mut paused, 0), 0);
    }

    #[test]
    fn pairs_are_tried_healthy_first_then_the_failed_one_then_paused_ones() {
        let none = [false; 3];
        let all = [true; 3];
        assert_eq!(
            pair_order(3, 1, None, &none, &all),
            [vec![1, 2, 0], vec![], vec![]]
        );
        assert_eq!(
            pair_order(3, 2, Some(1), &none, &all),
            [vec![2, 0], vec![], vec![1]],
            "the failed pair only when no other connects"
        );
        assert_eq!(
            pair_order(3, 0, Some(1), &[true, false, false], &all),
            [vec![2], vec![], vec![1, 0]]
        );
        assert_eq!(
            pair_order(1, 5, Some(0), &[false], &[true]),
            [vec![], vec![], vec![0]],
            "one NIC: its endpoint is rebuilt"
        );
        assert_eq!(
            pair_order(2, 0, Some(0), &[true, false], &[true; 2]),
            [vec![1], vec![], vec![0]],
            "a paused failed pair is listed once"
        );
    }

    #[test]
    fn the_nics_near_the_memory_come_first_and_the_far_ones_only_when_none_connects() {
        let none = [false; 4];
        let near = [false, true, false, true];
        assert_eq!(
            pair_order(4, 0, None, &none, &near),
            [vec![1, 3], vec![0, 2], vec![]]
        );
        assert_eq!(
            pair_order(4, 2, Some(3), &none, &near),
            [vec![1], vec![2, 0], vec![3]],
            "a retry avoids the failed near NIC"
        );
        assert_eq!(
            pair_order(4, 0, None, &[false, true, false, true], &near),
            [vec![], vec![0, 2], vec![1, 3]],
            "near NICs paused: the far ones"
        );
    }

    #[test]
    fn eviction_closes_the_least_recently_used_idle_endpoints_only() {
        let e = |k: &'static str, t: u64, busy: bool| (k, t, busy);
        assert!(
            lru_victims(vec![e("a", 1, false), e("b", 2, false)], 2).is_empty(),
            "within the bound"
        );
        assert_eq!(
            lru_victims(
                vec![e("a", 5, false), e("b", 2, false), e("c", 9, false)],
                2
            ),
            vec!["b"]
        );
        assert_eq!(
            lru_victims(
                vec![
                    e("a", 5, false),
                    e("b", 2, true),
                    e("c", 9, false),
                    e("d", 1, false)
                ],
                2
            ),
            vec!["d", "a"],
            "busy ones are skipped"
        );
        assert!(
            lru_victims(vec![e("a", 1, true), e("b", 2, true)], 1).is_empty(),
            "all busy: over the bound until they are idle"
        );
    }

    #[test]
    fn auto_sends_over_rdma_only_what_both_sides_can_key() {
        let dev = |n: &str| DeviceDesc {
            name: n.into(),
            lid: 0,
            gid: "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:05".into(),
            extra: Map::new(),
        };
        let mut d = SegmentDesc::new("peer:1");
        let buf = |rkeys: Vec<u64>| crate::wire::descriptor::BufferDesc {
            name: "cpu:0".into(),
            addr: 0x1000,
            length: 0x1000,
            lkey: rkeys.clone(),
            rkey: rkeys,
            extra: Default::default(),
        };
        d.buffers = vec![buf(vec![])];
        let e = auto_route(&d, true, 0x1000, 16).unwrap_err();
        assert!(e.contains("no RDMA devices"), "a TCP peer: {e}");
        d.protocol = Protocols::One("rdma".into());
        d.devices = vec![dev("mlx5_0"), dev("mlx5_1")];
        d.buffers = vec![buf(vec![7, 8])];
        assert_eq!(
            auto_route(&d, true, 0x1000, 16),
            Ok(()),
            "both sides keyed: RDMA"
        );
        assert!(auto_route(&d, false, 0x1000, 16)
            .unwrap_err()
            .contains("local range has no RDMA memory region"));
        d.buffers = vec![buf(vec![7])];
        assert!(auto_route(&d, true, 0x1000, 16)
            .unwrap_err()
            .contains("1 rkeys for its 2 devices"));
        assert!(
            auto_route(&d, true, 0x9000, 16).is_err(),
            "outside its buffers"
        );
    }

    #[test]
    fn refusals_decode_as_refusals() {
        let r = refusal("a:1@rxe0", "b:2@mlx5_0", "no NIC".into());
        assert_eq!(ConnectionMsg::decode(&r).unwrap().refused(), Some("no NIC"));
        let r = refusal("garbage", "", "bad".into());
        assert_eq!(ConnectionMsg::decode(&r).unwrap().refused(), Some("bad"));
    }

    #[test]
    fn without_rdma_the_transport_says_why() {
        if crate::nic::probe().usable() {
            return;
        }
        let e = RdmaTransport::new(
            RdmaOptions {
                segment: "s:1".into(),
                devices: None,
                gid_index: None,
                max_endpoints: 4,
                max_passive_qps: 16384,
                required: true,
                retry_cnt: 7,
                gpu_rdma: Default::default(),
                topo: None,
                names_are_addresses: true,
            },
            Arc::new(crate::transport::Detached),
        )
        .err()
        .expect("no RDMA here");
        assert!(!e.is_empty());
    }
}
