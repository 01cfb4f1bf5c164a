//! The master's state machine: segments, clients, objects, leases, pins, eviction.
//!
//! Pure logic: every method takes the current time (`now`, milliseconds on the master's
//! monotonic clock) and does no I/O, so tests drive time explicitly. [`crate::Master`] (the
//! driver, `crate::node`) wraps it with a clock and a mutex; `crate::server` puts it on the
//! network. Nothing here outside tests names a driver, the clock, a lock, a thread, I/O or
//! the process's randomness (the random placement draws from the state's own generator,
//! [`State::seed_placement`]); a unit test (`boundaries.rs`) reads this directory to hold it
//! so.
//!
//! Data never passes through here. A writer asks `put_start` for replica locations, writes
//! them through the transfer engine, then calls `put_end` (readable) or `put_revoke`. A
//! reader asks `get_replica_list`, which grants a read lease and names the read (`read_id`).
//! Two things follow from it:
//! - the lease (Mooncake's): until it ends a remove without `force` is refused;
//! - the read in flight: until the reader releases it (`release_reads`, sent by the client
//!   once its transfer finished, piggybacked on its next request) or the lease runs out, the
//!   replicas it was given are neither evicted nor freed (a forced remove or an upsert frees
//!   them only then). So no reader ever sees reused bytes, and space held by finished reads
//!   comes back at once.
//!
//! [`State`]'s methods are split by concern: this module holds its types and queries;
//! `segments` mounts, clients and their expiry; `placement` where replicas go, grants and
//! eviction; `puts` a put's start, end and revocation; `objects` reads and removals;
//! `apply` one request applied and what its answer needs ([`State::apply`]);
//! [`changes`] what an HA leader journals of it and how a state is rebuilt from that.

pub mod alloc;
mod apply;
pub mod changes;
mod copy;
mod deferred;
mod objects;
mod offload;
mod placement;
mod puts;
mod segments;
pub mod shards;
pub mod tasks;

use crate::error::{StoreError, StoreResult};
use crate::proto::{ReplicaDesc, Segment, SoftPin};
use alloc::{Block, SegmentSpace};
pub use apply::{Applied, Needs};
use serde::Serialize;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Replica placement strategy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Preferred segments first, then from a random start, walking the list.
    Random,
    /// Preferred segments first, then the segments with the most free space (by ratio).
    FreeRatioFirst,
}

#[derive(Debug, Clone)]
pub struct MasterConfig {
    pub lease_ttl: Duration,
    pub client_ttl: Duration,
    pub default_soft_pin_ttl: Duration,
    pub allow_evict_soft_pinned: bool,
    pub eviction_high_watermark: f64,
    pub eviction_ratio: f64,
    pub put_start_discard_timeout: Duration,
    pub put_start_release_timeout: Duration,
    pub strategy: Strategy,
    /// How long a put that finds space held only by reads in flight waits for them to end
    /// before evicting objects written within this window or failing with NO_AVAILABLE_HANDLE.
    pub put_wait_for_reads: Duration,
    /// Offload (the disk tier, `--enable_offload`): how long a client has to report an
    /// object it was given to persist before the object is evicted as without a disk. Zero:
    /// offload is off ([`State::set_offload`]).
    pub offload_timeout: Duration,
    /// The most objects one disk has been given to persist and not reported
    /// (`--offloading_queue_limit`); more are evicted as without a disk.
    pub offloading_queue_limit: usize,
    /// Replica copy/move tasks: the table's bounds and timeouts (Mooncake's task manager
    /// flags).
    pub tasks: tasks::TaskLimits,
}

impl Default for MasterConfig {
    fn default() -> Self {
        MasterConfig {
            lease_ttl: Duration::from_secs(10),
            client_ttl: Duration::from_secs(10),
            default_soft_pin_ttl: Duration::from_secs(30 * 60),
            allow_evict_soft_pinned: true,
            eviction_high_watermark: 0.90,
            eviction_ratio: 0.05,
            put_start_discard_timeout: Duration::from_secs(30),
            put_start_release_timeout: Duration::from_secs(600),
            strategy: Strategy::Random,
            put_wait_for_reads: Duration::from_secs(1),
            offload_timeout: Duration::ZERO,
            offloading_queue_limit: 50_000,
            tasks: tasks::TaskLimits::default(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Replica {
    seg: u64,
    block: Block,
}

/// A write in progress.
struct Pending {
    /// The put's id, chosen by its client (`Request::PutStart`): only an end or revoke naming
    /// it ends this put.
    id: u64,
    replicas: Box<[Replica]>,
    size: u64,
    client: u64,
    started: u64,
    soft_pin: SoftPin,
    soft_pin_ttl: u64,
    /// Set when this write is a replica copy or move (`copy.rs`), not a put; not journaled.
    copy: Option<copy::CopyOf>,
}

/// (`Default` only as what a bulk removal leaves in the map's slot it empties: an object is
/// otherwise always created by a put.)
#[derive(Default)]
struct Object {
    size: u64,
    /// Readable replicas (empty until the first put ends).
    current: Box<[Replica]>,
    pending: Option<Box<Pending>>,
    lease_until: u64,
    /// Reads given this object's current replicas and not known to have finished.
    reads: Vec<u64>,
    /// When the current value was written (its put ended).
    written: u64,
    /// The client that wrote the current value.
    owner: u64,
    last_access: u64,
    soft_pin_until: u64,
    hard_pin: bool,
    group: Option<Arc<str>>,
    /// When it was made (its first put started): a read of its group leases it only if the
    /// read came after ([`Object::lease_end`]).
    joined: u64,
    /// A copy of the current value on a client's disk (the disk tier, `crate::disk`):
    /// recorded once that client reported it persisted ([`State::offload_beat`]), served
    /// when no memory replica is left. Journaled (`changes::Change::Disk`).
    disk: Option<DiskReplica>,
    /// The current value is being persisted by a client (an offload task handed out by a
    /// background eviction, [`offload`]); not journaled.
    offloading: Option<offload::Offloading>,
}

/// An object's copy on a disk tier: which disk (its id, chosen by the directory and kept
/// across restarts of its client) and the value's length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DiskReplica {
    disk: u64,
    len: u64,
}

impl Object {
    /// Whether a read lease holds this object: its own, or its group's (a read of one member
    /// leases every member, [`Group`]).
    fn leased(&self, groups: &Groups, now: u64) -> bool {
        self.lease_end(groups) > now
    }

    /// When the lease that holds this object ends: its own or its group's, the later. The
    /// group's only if it was last read after this object joined it: a member put after the
    /// group's reads was never read, as when each read leased the members there were then.
    fn lease_end(&self, groups: &Groups) -> u64 {
        let group = self
            .group_in(groups)
            .filter(|g| g.last_access >= self.joined);
        self.lease_until.max(group.map_or(0, |g| g.lease_until))
    }

    /// When this object or (as reading one member counts for all) its group was last read.
    fn accessed(&self, groups: &Groups) -> u64 {
        self.last_access
            .max(self.group_in(groups).map_or(0, |g| g.last_access))
    }

    /// Its group, if it has one.
    fn group_in<'g>(&self, groups: &'g Groups) -> Option<&'g Group> {
        self.group.as_ref().and_then(|g| groups.get(g))
    }

    /// Whether no replica is left, readable (in memory or on a disk) or being written (the
    /// object must go).
    fn bare(&self) -> bool {
        self.current.is_empty()
            && self.disk.is_none()
            && self.pending.as_ref().is_none_or(|p| p.replicas.is_empty())
    }

    /// Whether a value is readable: from memory or from a disk.
    fn readable(&self) -> bool {
        !self.current.is_empty() || self.disk.is_some()
    }

    /// Takes out the replicas, readable or being written, that `gone` picks, handing each to
    /// `dropped`; whether any went.
    fn drop_replicas(
        &mut self,
        gone: impl Fn(&Replica) -> bool,
        mut dropped: impl FnMut(Replica),
    ) -> bool {
        fn split(
            list: &mut Box<[Replica]>,
            gone: &impl Fn(&Replica) -> bool,
            dropped: &mut impl FnMut(Replica),
        ) -> bool {
            if !list.iter().any(gone) {
                return false;
            }
            let (out, keep): (Vec<Replica>, Vec<Replica>) = list.iter().partition(|r| gone(r));
            out.into_iter().for_each(&mut *dropped);
            *list = keep.into_boxed_slice();
            true
        }
        let current = split(&mut self.current, &gone, &mut dropped);
        let pending = self
            .pending
            .as_mut()
            .is_some_and(|p| split(&mut p.replicas, &gone, &mut dropped));
        current || pending
    }

    /// Whether a read of the current replicas may still be in flight.
    fn being_read(&self, reads: &HashMap<u64, u64>, now: u64) -> bool {
        self.reads.iter().any(|id| read_live(reads, *id, now))
    }

    /// Whether eviction may take this object now: stored, not being written or read, older
    /// than `min_age`, not hard-pinned, and (before the last pass) not soft-pinned.
    fn evictable(
        &self,
        reads: &HashMap<u64, u64>,
        now: u64,
        min_age: u64,
        last_pass: bool,
    ) -> bool {
        !self.current.is_empty()
            && self.pending.is_none()
            && !self.being_read(reads, now)
            && now.saturating_sub(self.written) >= min_age
            && !self.hard_pin
            && (last_pass || self.soft_pin_until <= now)
    }
}

fn read_live(reads: &HashMap<u64, u64>, id: u64, now: u64) -> bool {
    reads.get(&id).is_some_and(|&until| until > now)
}

struct SegState {
    seg: Segment,
    client: u64,
    space: SegmentSpace,
    /// Nothing new is placed here before this time (ms): a client reported a write into this
    /// segment still running that this master did not place ([`State::hold_writes`]).
    writes_until: u64,
    /// Space granted ahead to puts (an HA leader with grants on, [`State::set_grants`]).
    pool: Option<Pool>,
}

impl SegState {
    /// Bytes objects use (and held space): what a pool has not handed out yet is free.
    fn used(&self) -> u64 {
        self.space.used()
            - self
                .pool
                .as_ref()
                .map_or(0, |p| p.space.size() - p.space.used())
    }

    /// Allocates `size` bytes: with grants on, from the pool (a new one when it has no room:
    /// the old one's unused space goes back first), values over a quarter of a pool from the
    /// segment's space. Whether the block lies in a durable grant.
    fn allocate(&mut self, size: u64, g: &Grants) -> Option<(Block, bool)> {
        let want = g.bytes.min(self.space.size() / 64) / 64 * 64;
        let cap = alloc::cap_of(size)?;
        if want == 0 || cap > want / 4 {
            return self.space.allocate(size).map(|b| (b, false));
        }
        if let Some(p) = &mut self.pool {
            if let Some(b) = p.space.allocate(size) {
                return Some((b, p.gen <= g.durable));
            }
        }
        if let Some(old) = self.pool.take() {
            self.space.give_back(&old.space);
        }
        if let Some(carved) = self.space.allocate(want) {
            let mut space = SegmentSpace::new(carved.addr, carved.cap());
            if let Some(b) = space.allocate(size) {
                self.pool = Some(Pool {
                    space,
                    gen: next_grant(),
                });
                return Some((b, false));
            }
            self.space.free(carved);
        }
        self.space.allocate(size).map(|b| (b, false))
    }
}

/// Free space of a segment that the HA journal names as granted ([`changes::Change::Granted`])
/// before any put is placed in it: once that entry is acknowledged, a put placed wholly in
/// granted space may be answered before its own change is (a new leader holds what the last
/// grant it knows named and no replica it knows covers: a put it never heard of writes
/// there and nowhere else).
struct Pool {
    /// Over the block carved out of the segment's space (its blocks are freed to the
    /// segment's space, never back to the pool).
    space: SegmentSpace,
    /// The grant's number ([`next_grant`]): a put placed here rides only once the journal
    /// entry that holds it is acknowledged ([`State::set_grants`]'s `durable`).
    gen: u64,
}

/// Grant numbers, increasing across every state and term of the process: a new state's
/// grants are never taken for one its journal already made durable.
static GRANTS: AtomicU64 = AtomicU64::new(0);

fn next_grant() -> u64 {
    GRANTS.fetch_add(1, Ordering::Relaxed) + 1
}

/// The last grant number handed out (by any state of this process): a journal collection
/// that takes the changes marked so far, under the state's lock, covers every grant up to it.
pub fn grants_issued() -> u64 {
    GRANTS.load(Ordering::Relaxed)
}

/// How puts are granted space ahead (an HA leader's; [`State::set_grants`]).
#[derive(Debug, Clone, Copy, Default)]
struct Grants {
    /// Bytes a pool takes at most (also at most 1/64 of its segment); 0: grants are off.
    bytes: u64,
    /// Grants up to this number are in acknowledged journal entries.
    durable: u64,
    /// How long a new leader holds what a grant named that it knows no replica in (ms).
    hold: u64,
}

/// A write a client reported still running into a segment this master did not know when
/// the report came ([`State::hold_writes`]): applied to a segment of that endpoint covering
/// the range when one is mounted, until `until` (ms).
struct ReportedWrite {
    te_endpoint: Box<str>,
    start: u64,
    end: u64,
    until: u64,
}

/// Whether `r` overlaps one of `ranges` (`(segment, start, end)`, sorted): a binary search,
/// not a walk, since it is asked of every replica of every object.
fn overlaps_any(ranges: &[(u64, u64, u64)], r: &Replica) -> bool {
    let (a, e) = (
        r.block.addr,
        r.block.addr.saturating_add(r.block.len.max(1)),
    );
    // Ranges of this segment starting before `e`: any of them ending after `a`.
    let from = ranges.partition_point(|&(s, _, _)| s < r.seg);
    let to = ranges.partition_point(|&(s, start, _)| (s, start) < (r.seg, e));
    ranges[from..to].iter().any(|&(_, _, end)| end > a)
}

/// The most writes [`State::hold_writes`] keeps for segments not mounted yet (more are
/// refused: a client has at most a few batches in flight).
pub const MAX_REPORTED_WRITES: usize = 1 << 16;

/// Counters exported on `/metrics`.
#[derive(Default)]
pub struct Stats {
    pub ops: [AtomicU64; OP_NAMES.len()],
    pub errors: [AtomicU64; OP_NAMES.len()],
    pub evicted_objects: AtomicU64,
    pub evicted_bytes: AtomicU64,
}

pub const OP_NAMES: [&str; 24] = [
    "mount",
    "remount",
    "unmount",
    "ping",
    "put_start",
    "put_end",
    "put_revoke",
    "get_replica_list",
    "exist_key",
    "remove",
    "remove_all",
    "remove_by_regex",
    "release_reads",
    "batch_replica_clear",
    "hold_writes",
    "offload_beat",
    "probe_key",
    "create_copy_task",
    "create_move_task",
    "query_task",
    "fetch_tasks",
    "complete_task",
    "copy_start",
    "copy_end",
];

/// The master's objects by key.
type Objects = shards::Shards<Box<str>, Object, hashbrown::DefaultHashBuilder>;

/// Objects put with one `group_id` (Mooncake's): they share a read lease and are evicted
/// together. The lease and the last access are kept here, once for the group, not copied
/// into every member at each read (that made reading all n members of a group n² steps
/// under the state's lock); a member's own lease is the later of its own and its group's
/// ([`Object::lease_end`]).
#[derive(Default)]
struct Group {
    members: Vec<Box<str>>,
    lease_until: u64,
    last_access: u64,
}

type Groups = HashMap<Arc<str>, Group>;

/// The pool's state.
#[derive(Default)]
pub struct State {
    segments: HashMap<u64, SegState>,
    seg_order: Vec<u64>,
    clients: HashMap<u64, u64>, // client -> last ping
    /// In shards ([`shards::Shards`]), as a standby's mirror: one map grows by doubling, and the
    /// insert that grows it past 1.8 M objects held the lock 0.47-1.76 s
    /// (`examples/growth_pause.rs`); a shard moves a 64th of that.
    objects: Objects,
    groups: Groups,
    /// Replicas freed once their reads end or at a time ([`deferred::DeferredFrees`]).
    deferred: deferred::DeferredFrees,
    /// Segments dropped (or gone at a takeover) that may have space held in `deferred`
    /// ([`State::drop_segments`]): a mount of one of them takes that space back out; a mount
    /// of any other walks nothing. Pruned of segments with nothing held any more at most once
    /// a minute ([`State::prune_orphaned`]).
    orphaned: HashSet<u64>,
    /// When `orphaned` was last pruned (ms).
    orphans_pruned: u64,
    /// Writes reported still running into segments not mounted yet ([`State::hold_writes`]).
    reported_writes: Vec<ReportedWrite>,
    /// Reads in flight: id -> end of their lease.
    reads: HashMap<u64, u64>,
    next_read: u64,
    /// The HA term this state belongs to (0 without HA): a request admitted under another
    /// term is not applied to it.
    pub term: i64,
    /// What changed since the journal last took it (an HA leader only; `None`: not marked).
    dirty: Option<Box<changes::Dirty>>,
    /// How many changes were marked into `dirty` ([`State::marks`]).
    marks: u64,
    grants: Grants,
    /// The last put placed every replica in granted space whose grant is durable.
    placed_granted: bool,
    /// The random placement's generator ([`Strategy::Random`]'s start): the state's own,
    /// seeded by its driver ([`State::seed_placement`]), never the process's.
    placement: Splitmix,
    /// The disk tier's bookkeeping: which client holds which disk, the offload tasks handed
    /// out and not reported ([`offload::Offload`]).
    offload: offload::Offload,
    /// Replica copy and move tasks (`tasks.rs`); not journaled.
    tasks: tasks::Tasks,
}

/// A small deterministic generator (splitmix64): the state machine draws from it, not from
/// the process's randomness, so a state seeded alike places alike.
#[derive(Debug, Clone, Copy, Default)]
struct Splitmix(u64);

impl Splitmix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n > 0`), by the high bits of a 128-bit product (Lemire's).
    fn below(&mut self, n: usize) -> usize {
        ((self.next() as u128 * n as u128) >> 64) as usize
    }
}

/// The most preferred segments a put may name.
pub const MAX_PREFERRED: usize = 256;

/// A one-line summary of the pool.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Summary {
    pub keys: usize,
    pub bytes_used: u64,
    pub bytes_total: u64,
    pub clients: usize,
    pub segments: usize,
    pub pending_puts: usize,
    pub deferred_frees: usize,
}

/// Which try of a put's start this is: a put that finds space held only by reads in flight
/// is tried again (`server/handlers.rs`) until they end or its wait (`put_wait_for_reads`) is over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempt {
    /// The first: evicts what the put needs, sparing objects written within the wait while
    /// reads are in flight.
    First,
    /// Another while the wait lasts: takes back the space of reads that ended, and evicts
    /// nothing more unless no read is in flight any more.
    Again,
    /// The wait is over: evicts what the put needs, sparing nothing for readers.
    Last,
}

/// Names a put: the client that started it and the id it chose for it
/// (`Request::PutStart`'s `put`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PutId {
    pub client: u64,
    pub put: u64,
}

/// One segment as reported by `/get_all_segments`.
#[derive(Debug, Clone, Serialize)]
pub struct SegmentInfo {
    pub id: u64,
    pub name: String,
    pub te_endpoint: String,
    pub client: String,
    pub base: u64,
    pub size: u64,
    pub used: u64,
}

/// One object as reported by `/query_key`.
#[derive(Debug, Clone, Serialize)]
pub struct KeyInfo {
    pub key: String,
    pub size: u64,
    pub replicas: Vec<ReplicaDesc>,
    /// Its copy on a client's disk, if any.
    pub disk_replica: Option<crate::proto::DiskDesc>,
    pub complete: bool,
    pub leased_ms: u64,
    pub reads_in_flight: usize,
    pub soft_pinned: bool,
    pub hard_pinned: bool,
    pub group: Option<String>,
}

fn check_key(key: &str) -> StoreResult<()> {
    if key.is_empty() || key.len() > 4096 {
        return Err(StoreError::InvalidKey(key.chars().take(64).collect()));
    }
    Ok(())
}

impl State {
    /// An empty state whose read ids follow `next_read` (its driver picks it so that read
    /// ids of masters restarted at one address differ: `crate::Master::new`).
    pub fn with_reads_after(next_read: u64) -> State {
        State {
            next_read,
            ..State::default()
        }
    }

    /// Seeds the random placement's generator: its driver seeds it from the process's
    /// randomness (`crate::Master::install`); a test, with what it wants to see again.
    pub fn seed_placement(&mut self, seed: u64) {
        self.placement = Splitmix(seed);
        self.tasks.seed(seed);
    }

    fn desc(&self, r: &Replica) -> Option<ReplicaDesc> {
        self.segments.get(&r.seg).map(|s| ReplicaDesc {
            te_endpoint: s.seg.te_endpoint.clone(),
            addr: r.block.addr,
            size: r.block.len,
        })
    }

    fn free_now(&mut self, r: Replica) {
        if let Some(s) = self.segments.get_mut(&r.seg) {
            s.space.free(r.block);
        }
    }

    fn free_later(&mut self, r: Replica, at: u64) {
        self.mark_held_back(&r, at);
        self.deferred.push(r, at, &[]);
    }

    /// Frees `r` now if none of `reads` is in flight, else once they all ended.
    fn free_after_reads(&mut self, r: Replica, reads: &[u64], now: u64) {
        if let Some(r) = self.free_after_reads_or_back(r, reads, now) {
            self.free_now(r);
        }
    }

    /// [`State::free_after_reads`], leaving a replica that may be freed now to the caller.
    fn free_after_reads_or_back(&mut self, r: Replica, reads: &[u64], now: u64) -> Option<Replica> {
        let live: Vec<u64> = reads
            .iter()
            .copied()
            .filter(|id| read_live(&self.reads, *id, now))
            .collect();
        if live.is_empty() {
            return Some(r);
        }
        let release_at = live
            .iter()
            .filter_map(|id| self.reads.get(id))
            .copied()
            .max()
            .unwrap_or(now);
        self.mark_held_back(&r, release_at);
        self.deferred.push(r, release_at, &live);
        None
    }

    /// Whether any read is in flight (waiting for it may free space).
    pub fn reads_in_flight(&self, now: u64) -> bool {
        self.reads.values().any(|&until| until > now)
    }

    /// The reads named finished: their replicas may be reclaimed. (Only the frees waiting
    /// for them are looked at, and those due by time.)
    pub fn release_reads(&mut self, ids: &[u64], now: u64) {
        let ended: Vec<u64> = ids
            .iter()
            .copied()
            .filter(|id| self.reads.remove(id).is_some())
            .collect();
        self.reads_ended(&ended, now);
    }

    /// Frees the deferred replicas that waited only for the reads `ended` (each ends once),
    /// and those whose time came by `now`.
    fn reads_ended(&mut self, ended: &[u64], now: u64) {
        let mut free = Vec::new();
        for id in ended {
            self.deferred.read_ended(*id, &mut free);
        }
        self.deferred.due(now, &mut free);
        self.free_all_now(free);
        self.prune_orphaned(now);
    }

    pub fn total_bytes(&self) -> u64 {
        self.segments.values().map(|s| s.space.size()).sum()
    }

    pub fn used_bytes(&self) -> u64 {
        self.segments.values().map(SegState::used).sum()
    }

    pub fn summary(&self) -> Summary {
        Summary {
            keys: self.objects.values().filter(|o| o.readable()).count(),
            bytes_used: self.used_bytes(),
            bytes_total: self.total_bytes(),
            clients: self.clients.len(),
            segments: self.segments.len(),
            pending_puts: self
                .objects
                .values()
                .filter(|o| o.pending.is_some())
                .count(),
            deferred_frees: self.deferred.len(),
        }
    }

    pub fn segments_info(&self) -> Vec<SegmentInfo> {
        let mut v: Vec<SegmentInfo> = self
            .segments
            .values()
            .map(|s| SegmentInfo {
                id: s.seg.id,
                name: s.seg.name.clone(),
                te_endpoint: s.seg.te_endpoint.clone(),
                client: format!("{:x}", s.client),
                base: s.seg.base,
                size: s.space.size(),
                used: s.used(),
            })
            .collect();
        v.sort_by_key(|s| s.id);
        v
    }

    pub fn key_info(&self, key: &str, now: u64) -> Option<KeyInfo> {
        let o = self.objects.get(key)?;
        Some(KeyInfo {
            key: key.to_string(),
            size: o.size,
            replicas: o.current.iter().filter_map(|r| self.desc(r)).collect(),
            disk_replica: o.disk.map(|d| self.disk_desc(&d, o.size)),
            complete: o.readable(),
            leased_ms: o.lease_end(&self.groups).saturating_sub(now),
            reads_in_flight: o
                .reads
                .iter()
                .filter(|id| read_live(&self.reads, **id, now))
                .count(),
            soft_pinned: o.soft_pin_until > now,
            hard_pinned: o.hard_pin,
            group: o.group.as_deref().map(str::to_string),
        })
    }
}

/// What a bulk removal ([`State::remove_matching`]) took out of the state: how many objects,
/// and their memory, to be dropped once the state's lock is released (freeing a million
/// objects' allocations was about half of a `RemoveAll`'s time under the lock).
pub struct Removed {
    objects: Vec<Object>,
}

impl Removed {
    /// How many objects went.
    pub fn count(&self) -> u64 {
        self.objects.len() as u64
    }
}

#[cfg(test)]
mod tests;
