//! The master's state machine: segments, clients, objects, leases, pins, eviction.
//!
//! Pure logic: every method takes the current time (`now`, milliseconds on the master's
//! monotonic clock) and does no I/O, so tests drive time explicitly. [`crate::Master`] (the
//! driver, `crate::node`) wraps it with a clock and a mutex; `crate::server` puts it on the
//! network.
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

pub mod alloc;
mod deferred;
pub mod journal;
pub mod shards;

use crate::error::{StoreError, StoreResult};
use crate::proto::{PingStatus, ReplicaDesc, ReplicaList, ReplicateConfig, Segment, SoftPin, WriteInFlight};
use alloc::{Block, SegmentSpace};
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
        let group = self.group_in(groups).filter(|g| g.last_access >= self.joined);
        self.lease_until.max(group.map_or(0, |g| g.lease_until))
    }

    /// When this object or (as reading one member counts for all) its group was last read.
    fn accessed(&self, groups: &Groups) -> u64 {
        self.last_access.max(self.group_in(groups).map_or(0, |g| g.last_access))
    }

    /// Its group, if it has one.
    fn group_in<'g>(&self, groups: &'g Groups) -> Option<&'g Group> {
        self.group.as_ref().and_then(|g| groups.get(g))
    }

    /// Whether no replica is left, readable or being written (the object must go).
    fn bare(&self) -> bool {
        self.current.is_empty() && self.pending.as_ref().is_none_or(|p| p.replicas.is_empty())
    }

    /// Takes out the replicas, readable or being written, that `gone` picks, handing each to
    /// `dropped`; whether any went.
    fn drop_replicas(&mut self, gone: impl Fn(&Replica) -> bool, mut dropped: impl FnMut(Replica)) -> bool {
        fn split(list: &mut Box<[Replica]>, gone: &impl Fn(&Replica) -> bool, dropped: &mut impl FnMut(Replica)) -> bool {
            if !list.iter().any(gone) {
                return false;
            }
            let (out, keep): (Vec<Replica>, Vec<Replica>) = list.iter().partition(|r| gone(r));
            out.into_iter().for_each(&mut *dropped);
            *list = keep.into_boxed_slice();
            true
        }
        let current = split(&mut self.current, &gone, &mut dropped);
        let pending = self.pending.as_mut().is_some_and(|p| split(&mut p.replicas, &gone, &mut dropped));
        current || pending
    }

    /// Whether a read of the current replicas may still be in flight.
    fn being_read(&self, reads: &HashMap<u64, u64>, now: u64) -> bool {
        self.reads.iter().any(|id| read_live(reads, *id, now))
    }

    /// Whether eviction may take this object now: stored, not being written or read, older
    /// than `min_age`, not hard-pinned, and (before the last pass) not soft-pinned.
    fn evictable(&self, reads: &HashMap<u64, u64>, now: u64, min_age: u64, last_pass: bool) -> bool {
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
        self.space.used() - self.pool.as_ref().map_or(0, |p| p.space.size() - p.space.used())
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
                self.pool = Some(Pool { space, gen: next_grant() });
                return Some((b, false));
            }
            self.space.free(carved);
        }
        self.space.allocate(size).map(|b| (b, false))
    }
}

/// Free space of a segment that the HA journal names as granted ([`journal::Change::Granted`])
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
    let (a, e) = (r.block.addr, r.block.addr.saturating_add(r.block.len.max(1)));
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

pub const OP_NAMES: [&str; 15] = [
    "mount", "remount", "unmount", "ping", "put_start", "put_end", "put_revoke", "get_replica_list", "exist_key", "remove", "remove_all", "remove_by_regex", "release_reads",
    "batch_replica_clear", "hold_writes",
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
    dirty: Option<Box<journal::Dirty>>,
    /// How many changes were marked into `dirty` ([`State::marks`]).
    marks: u64,
    grants: Grants,
    /// The last put placed every replica in granted space whose grant is durable.
    placed_granted: bool,
    /// The random placement's generator ([`Strategy::Random`]'s start): the state's own,
    /// seeded by its driver ([`State::seed_placement`]), never the process's.
    placement: Splitmix,
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
/// is tried again (`server.rs`) until they end or its wait (`put_wait_for_reads`) is over.
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
        State { next_read, ..State::default() }
    }

    /// Seeds the random placement's generator: its driver seeds it from the process's
    /// randomness (`crate::Master::install`); a test, with what it wants to see again.
    pub fn seed_placement(&mut self, seed: u64) {
        self.placement = Splitmix(seed);
    }

    fn desc(&self, r: &Replica) -> Option<ReplicaDesc> {
        self.segments.get(&r.seg).map(|s| ReplicaDesc { te_endpoint: s.seg.te_endpoint.clone(), addr: r.block.addr, size: r.block.len })
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
        let live: Vec<u64> = reads.iter().copied().filter(|id| read_live(&self.reads, *id, now)).collect();
        if live.is_empty() {
            return Some(r);
        }
        let release_at = live.iter().filter_map(|id| self.reads.get(id)).copied().max().unwrap_or(now);
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
        let ended: Vec<u64> = ids.iter().copied().filter(|id| self.reads.remove(id).is_some()).collect();
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
            keys: self.objects.values().filter(|o| !o.current.is_empty()).count(),
            bytes_used: self.used_bytes(),
            bytes_total: self.total_bytes(),
            clients: self.clients.len(),
            segments: self.segments.len(),
            pending_puts: self.objects.values().filter(|o| o.pending.is_some()).count(),
            deferred_frees: self.deferred.len(),
        }
    }

    pub fn segments_info(&self) -> Vec<SegmentInfo> {
        let mut v: Vec<SegmentInfo> = self
            .segments
            .values()
            .map(|s| SegmentInfo { id: s.seg.id, name: s.seg.name.clone(), te_endpoint: s.seg.te_endpoint.clone(), client: format!("{:x}", s.client), base: s.seg.base, size: s.space.size(), used: s.used() })
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
            complete: !o.current.is_empty(),
            leased_ms: o.lease_end(&self.groups).saturating_sub(now),
            reads_in_flight: o.reads.iter().filter(|id| read_live(&self.reads, **id, now)).count(),
            soft_pinned: o.soft_pin_until > now,
            hard_pinned: o.hard_pin,
            group: o.group.as_deref().map(str::to_string),
        })
    }

    // --- segments and clients ---------------------------------------------------------

    pub fn mount(&mut self, client: u64, seg: Segment, now: u64) -> StoreResult<()> {
        if seg.size == 0 || seg.base.checked_add(seg.size).is_none() {
            return Err(StoreError::InvalidParams(format!("segment {} has an invalid range (base {:#x}, size {})", seg.name, seg.base, seg.size)));
        }
        if let Some(s) = self.segments.get(&seg.id) {
            if s.client == client && s.seg == seg {
                if self.clients.insert(client, now).is_none() {
                    self.mark_client(client);
                }
                return Ok(()); // idempotent remount
            }
            return Err(StoreError::SegmentAlreadyExists(format!("{} (id {:x})", seg.name, seg.id)));
        }
        if self.clients.insert(client, now).is_none() {
            self.mark_client(client);
        }
        self.mark_segment(seg.id);
        self.seg_order.push(seg.id);
        let id = seg.id;
        let mut space = SegmentSpace::new(seg.base, seg.size);
        // Space held when this segment was dropped (a write that was in progress into it,
        // space readers may read) stays held: the segment is mounted again (its client was
        // forgotten, not its memory) and that writer may still be writing. What does not fit
        // the range mounted now cannot be written through it: forgotten.
        if self.orphaned.remove(&id) {
            self.deferred.retain_on(id, |r| match space.reserve(r.block.addr, r.block.len) {
                Some(_) => true,
                None => {
                    tracing::debug!(segment = id, addr = r.block.addr, len = r.block.len, "space held from before the segment was dropped lies outside it now; forgotten");
                    false
                }
            });
        }
        let writes_until = self.reported_until(&seg, now);
        self.segments.insert(id, SegState { seg, client, space, writes_until, pool: None });
        Ok(())
    }

    /// Until when the writes reported into `seg`'s range (before it was mounted) run: 0 if
    /// none does.
    fn reported_until(&mut self, seg: &Segment, now: u64) -> u64 {
        self.reported_writes.retain(|w| w.until > now);
        let end = seg.base.saturating_add(seg.size);
        self.reported_writes.iter().filter(|w| *w.te_endpoint == *seg.te_endpoint && w.start < end && w.end > seg.base).map(|w| w.until).max().unwrap_or(0)
    }

    /// Writes a client still has running (`Request::HoldWrites`), which it reports when this
    /// master did not know it (a master without HA that restarted knows nothing of the
    /// writes the one before it placed, and a segment mounted again is held for one read
    /// lease only): no new replica is placed in a segment such a write goes to until its
    /// time left (at most `release`, the put start release timeout) is over, and a replica
    /// this master placed in its range since (the report came late) is dropped, which a late
    /// write may overwrite (an object left without any goes): never served with bytes it did
    /// not write. A write into a segment not mounted yet is kept for it. A write this master
    /// knows (a put of `client` in progress here, on that very range: the client's pings
    /// stopped long enough for it to be dropped, not its puts) is left to it. Returns the
    /// segments held now.
    pub fn hold_writes(&mut self, client: u64, writes: &[WriteInFlight], now: u64, release: u64) -> StoreResult<usize> {
        self.reported_writes.retain(|w| w.until > now);
        // The mounted segments by endpoint (one engine may serve several).
        let mut by_endpoint: HashMap<&str, Vec<(u64, u64, u64)>> = HashMap::new();
        for (&id, s) in &self.segments {
            by_endpoint.entry(&s.seg.te_endpoint).or_default().push((id, s.seg.base, s.seg.base.saturating_add(s.seg.size)));
        }
        // (segment, start, end, until) of the writes into mounted segments; the others kept.
        let mut hits: Vec<(u64, u64, u64, u64)> = Vec::new();
        let mut keep: Vec<ReportedWrite> = Vec::new();
        for w in writes {
            let (start, end, until) = (w.addr, w.addr.saturating_add(w.size.max(1)), now.saturating_add(w.left_ms.min(release)));
            if until <= now {
                continue;
            }
            let before = hits.len();
            hits.extend(by_endpoint.get(w.te_endpoint.as_str()).into_iter().flatten().filter(|&&(_, b, e)| start < e && end > b).map(|&(id, _, _)| (id, start, end, until)));
            if hits.len() == before {
                keep.push(ReportedWrite { te_endpoint: w.te_endpoint.as_str().into(), start, end, until });
            }
        }
        if self.reported_writes.len().saturating_add(keep.len()) > MAX_REPORTED_WRITES {
            return Err(StoreError::InvalidParams(format!(
                "{} writes in flight reported into segments not mounted, {} kept already: at most {MAX_REPORTED_WRITES} are kept; nothing of this report was taken (the client reports again at its next remount)",
                keep.len(),
                self.reported_writes.len()
            )));
        }
        self.reported_writes.extend(keep);
        if hits.is_empty() {
            return Ok(0);
        }
        // One walk over the objects: every replica overlapping a reported range goes, but
        // the reporter's own write in progress on exactly such a range, which this master
        // placed and knows (`known`: its segment is not held for it either).
        let span = |r: &Replica| (r.seg, r.block.addr, r.block.addr.saturating_add(r.block.len.max(1)));
        let exact: HashSet<(u64, u64, u64)> = hits.iter().map(|&(id, a, e, _)| (id, a, e)).collect();
        let mut ranges: Vec<(u64, u64, u64)> = exact.iter().copied().collect();
        ranges.sort_unstable();
        let (mut known, mut dropped, mut touched) = (HashSet::new(), Vec::new(), Vec::new());
        self.objects.retain(|k, o| {
            let mine: Vec<(u64, u64, u64)> = o.pending.iter().filter(|p| p.client == client).flat_map(|p| p.replicas.iter().map(span)).filter(|x| exact.contains(x)).collect();
            known.extend(mine.iter().copied());
            if o.drop_replicas(|r| overlaps_any(&ranges, r) && !mine.contains(&span(r)), |r| dropped.push(r)) {
                touched.push(k.clone());
            }
            true
        });
        let mut held = HashSet::new();
        for &(id, a, e, until) in &hits {
            if let Some(s) = self.segments.get_mut(&id).filter(|_| !known.contains(&(id, a, e))) {
                s.writes_until = s.writes_until.max(until);
                held.insert(id);
            }
        }
        for key in touched {
            tracing::warn!(key = &*key, "a write reported still running overlaps this object's replica: the replica is dropped (never served with bytes it did not write)");
            self.mark_key(&key);
            if self.objects.get(&key).is_some_and(Object::bare) {
                self.forget(&key);
            }
        }
        // Held as long as anything may still touch them: the late write (at most `release`),
        // a writer of this master whose write in progress went (its put's start plus
        // `release`), a reader of one that was readable (a lease, far shorter).
        for r in dropped {
            self.free_later(r, now.saturating_add(release));
        }
        Ok(held.len())
    }

    /// Removes a segment and every replica in it; objects left without replicas disappear.
    /// Space of writes in progress there stays held (`release`: see `State::drop_segments`).
    pub fn unmount(&mut self, client: u64, seg_id: u64, now: u64, release: u64) -> StoreResult<()> {
        match self.segments.get(&seg_id) {
            None => return Err(StoreError::SegmentNotFound(format!("{seg_id:x}"))),
            Some(s) if s.client != client => return Err(StoreError::InvalidParams(format!("segment {seg_id:x} belongs to another client"))),
            Some(_) => {}
        }
        self.drop_segments(&[seg_id], now, release);
        Ok(())
    }

    /// Drops segments `ids` with every replica on them (objects left without any are
    /// forgotten), in one walk over the objects however many segments go (a client with many
    /// segments, or many clients expiring in one tick, cost one walk under the lock, not one
    /// each).
    ///
    /// The space of what may still be written or read there stays held, on no segment, in
    /// case the segment is mounted again ([`State::mount`] takes it back out of the space):
    /// held-back space until its time, and the replicas of writes in progress until their
    /// put's start plus `release` (the put start release timeout: their writer may still be
    /// writing, and a remount's hold of one read lease would not cover it). Held nowhere
    /// else: a segment never mounted again costs its entries until their time.
    fn drop_segments(&mut self, ids: &[u64], now: u64, release: u64) {
        if ids.is_empty() {
            return;
        }
        for &id in ids {
            self.mark_segment(id);
            self.segments.remove(&id);
        }
        let ids: HashSet<u64> = ids.iter().copied().collect();
        let on = |r: &Replica| ids.contains(&r.seg);
        self.seg_order.retain(|s| !ids.contains(s));
        // Objects left without any replica are removed in place (no key copied, no second
        // lookup: what `forget` does, for up to every object of the pool at once); marks and
        // group memberships are settled after the walk.
        let journaling = self.dirty.is_some();
        let (mut marks, mut grouped, mut writing) = (Vec::new(), Vec::new(), Vec::new());
        self.objects.retain(|k, o| {
            // (Their segments are gone: nothing to free.) A write in progress there keeps
            // its space held (below).
            if let Some(p) = &o.pending {
                writing.extend(p.replicas.iter().filter(|r| on(r)).map(|r| (*r, p.started)));
            }
            let hit = o.drop_replicas(on, drop);
            let keep = !o.bare();
            if !keep {
                if let Some(g) = &o.group {
                    grouped.push(Arc::clone(g));
                }
            }
            if journaling && (hit || !keep) {
                marks.push(k.clone());
            }
            keep
        });
        self.mark_keys_owned(marks);
        self.prune_groups(grouped);
        // The segments that keep something held: only those are looked for at a mount.
        self.orphaned.extend(self.deferred.replicas().map(|(r, _)| r.seg).filter(|s| ids.contains(s)));
        for (r, started) in writing {
            self.orphaned.insert(r.seg);
            self.free_later(r, started.saturating_add(release).max(now));
        }
    }

    /// Forgets the dropped segments that have nothing held any more (their holds ran out,
    /// or they were mounted again): all of them once nothing at all is held, else one walk
    /// over what is held, at most once a minute, so that segments of clients gone for good
    /// do not pile up while anything else is held.
    fn prune_orphaned(&mut self, now: u64) {
        if self.orphaned.is_empty() {
            return;
        }
        if self.deferred.is_empty() {
            self.orphaned.clear();
            return;
        }
        if now < self.orphans_pruned.saturating_add(60_000) {
            return;
        }
        self.orphans_pruned = now;
        let segments = &self.segments;
        let held: HashSet<u64> = self.deferred.replicas().map(|(r, _)| r.seg).filter(|s| !segments.contains_key(s)).collect();
        self.orphaned.retain(|s| held.contains(s));
    }

    /// Groups that lost members (removed from `objects` already) keep only the members still
    /// there; a group left empty goes. Each group is pruned once, however many of its
    /// members went: not once per member, which costs a group of thousands of objects going
    /// at once its size squared.
    fn prune_groups(&mut self, mut grouped: Vec<Arc<str>>) {
        grouped.sort_unstable();
        grouped.dedup();
        let objects = &self.objects;
        for g in grouped {
            if let Some(group) = self.groups.get_mut(&g) {
                group.members.retain(|m| objects.get(m).is_some_and(|o| o.group.as_ref() == Some(&g)));
                if group.members.is_empty() {
                    self.groups.remove(&g);
                }
            }
        }
    }

    fn forget(&mut self, key: &str) -> Option<Object> {
        let o = self.objects.remove(key)?;
        self.mark_key(key);
        if let Some(g) = &o.group {
            self.leave_group(g, key);
        }
        Some(o)
    }

    /// `key` is no longer a member of group `g` (a group left empty goes).
    fn leave_group(&mut self, g: &str, key: &str) {
        if let Some(group) = self.groups.get_mut(g) {
            group.members.retain(|m| &**m != key);
            if group.members.is_empty() {
                self.groups.remove(g);
            }
        }
    }

    /// Makes a client known (a pure client mounts nothing but must be able to put).
    /// A client's segments mounted again: the master did not know the client any more (it
    /// started empty, lost its state, or dropped the client when its pings stopped). A segment
    /// it did not know is held whole until `now + hold` (a read lease TTL): readers that an
    /// earlier master (or this one, before it dropped the segment) let read it may still be
    /// reading (a read is refused by its client once its lease ran out), so nothing new is
    /// placed there until then; the hold is journaled, like any replica held back.
    pub fn remount(&mut self, client: u64, segments: Vec<Segment>, now: u64, hold: u64) -> StoreResult<()> {
        self.register_client(client, now);
        let mut r = Ok(());
        for seg in segments {
            let (id, known) = (seg.id, self.segments.contains_key(&seg.id));
            match self.mount(client, seg, now) {
                Ok(()) if !known && hold > 0 => {
                    let blocks = self.segments.get_mut(&id).map(|s| s.space.take_all()).unwrap_or_default();
                    if !blocks.is_empty() {
                        tracing::info!(segment = id, hold_ms = hold, "a segment mounted again is held whole for one read lease (readers of the master that forgot it may still read it)");
                    }
                    for block in blocks {
                        self.free_later(Replica { seg: id, block }, now + hold);
                    }
                }
                Ok(()) => {}
                Err(e) => r = Err(e),
            }
        }
        r
    }

    pub fn register_client(&mut self, client: u64, now: u64) {
        if self.clients.insert(client, now).is_none() {
            self.mark_client(client);
        }
    }

    pub fn ping(&mut self, client: u64, now: u64) -> PingStatus {
        match self.clients.get_mut(&client) {
            Some(t) => {
                *t = now;
                PingStatus::Ok
            }
            None => PingStatus::NeedRemount,
        }
    }

    /// Drops clients that have not pinged within `ttl`, with their segments and replicas: each
    /// with the names of the segments it still had (none: it unmounted them, as a client that
    /// closes does, and nothing was lost).
    /// `release` is the put start release timeout (see `State::drop_segments`).
    pub fn expire_clients(&mut self, now: u64, ttl: u64, release: u64) -> Vec<(u64, Vec<String>)> {
        let mut dead: std::collections::HashMap<u64, Vec<String>> = self.clients.iter().filter(|(_, &t)| now.saturating_sub(t) > ttl).map(|(&c, _)| (c, Vec::new())).collect();
        if dead.is_empty() {
            return Vec::new();
        }
        for &c in dead.keys() {
            self.clients.remove(&c);
            self.mark_client(c);
        }
        let mut segs = Vec::new();
        for (&id, s) in &self.segments {
            if let Some(names) = dead.get_mut(&s.client) {
                names.push(s.seg.name.clone());
                segs.push(id);
            }
        }
        self.drop_segments(&segs, now, release);
        dead.into_iter().collect()
    }

    /// The names of the mounted segments (several clients may share one: their engine).
    pub fn mounted_names(&self) -> std::collections::HashSet<&str> {
        self.segments.values().map(|s| s.seg.name.as_str()).collect()
    }

    // --- allocation and eviction ---------------------------------------------------------

    fn place(&mut self, size: u64, cfg: &ReplicateConfig, strategy: Strategy, now: u64) -> Vec<Replica> {
        let want = cfg.replica_num.max(1) as usize;
        let mut order: Vec<u64> = Vec::with_capacity(self.seg_order.len());
        for name in &cfg.preferred_segments {
            for &id in &self.seg_order {
                let s = &self.segments[&id];
                if (&s.seg.name == name || &s.seg.te_endpoint == name) && !order.contains(&id) {
                    order.push(id);
                }
            }
        }
        let n = self.seg_order.len();
        if n > 0 {
            let mut rest: Vec<u64> = match strategy {
                Strategy::Random => {
                    let start = self.placement.below(n);
                    (0..n).map(|i| self.seg_order[(start + i) % n]).collect()
                }
                Strategy::FreeRatioFirst => {
                    let mut v = self.seg_order.clone();
                    v.sort_by(|a, b| self.segments[b].space.free_ratio().total_cmp(&self.segments[a].space.free_ratio()));
                    v
                }
            };
            rest.retain(|id| !order.contains(id));
            order.extend(rest);
        }
        let mut out = Vec::with_capacity(want);
        let grants = self.grants;
        let (mut granted, mut regranted) = (true, Vec::new());
        for id in order {
            if out.len() == want {
                break;
            }
            if let Some(s) = self.segments.get_mut(&id).filter(|s| s.writes_until <= now) {
                let before = s.pool.as_ref().map(|p| p.gen);
                if let Some((block, in_grant)) = s.allocate(size, &grants) {
                    granted &= in_grant;
                    out.push(Replica { seg: id, block });
                }
                if before != s.pool.as_ref().map(|p| p.gen) {
                    regranted.push(id);
                }
            }
        }
        for id in regranted {
            self.mark_grant(id);
        }
        self.placed_granted = granted && !out.is_empty();
        out
    }

    /// Turns granting space ahead on (`bytes` per pool at most) or off (0: every pool's unused
    /// space goes back to its segment), with `hold` ms for which a new leader holds what a
    /// grant named (an HA leader's journal writer sets it, as its standbys allow).
    pub fn set_grant_bytes(&mut self, bytes: u64, hold: u64) {
        if bytes == 0 {
            self.return_pools();
        }
        (self.grants.bytes, self.grants.hold) = (bytes, hold);
    }

    /// The grants up to `durable` are in acknowledged journal entries (`ha::journal`'s
    /// `JournalCore::grants_durable`; set before placing puts, `server.rs`).
    pub fn set_grants_durable(&mut self, durable: u64) {
        self.grants.durable = durable;
    }

    /// Whether space is granted ahead to puts now.
    pub fn granting(&self) -> bool {
        self.grants.bytes > 0
    }

    /// Whether the last put started placed every replica in space granted by a durable grant
    /// (its answer need not wait for its own change to be acknowledged).
    pub fn placed_granted(&self) -> bool {
        self.placed_granted
    }

    /// Every pool's unused space back to its segment (marked for the journal: the grant is
    /// then empty); whether there was any pool.
    fn return_pools(&mut self) -> bool {
        let mut returned = Vec::new();
        for (&id, s) in self.segments.iter_mut() {
            if let Some(p) = s.pool.take() {
                s.space.give_back(&p.space);
                returned.push(id);
            }
        }
        let any = !returned.is_empty();
        for id in returned {
            self.mark_grant(id);
        }
        any
    }

    /// Evicts unpinned, complete objects that no read in flight uses, least recently used
    /// first, until at least `target` bytes are freed. Soft-pinned objects go only if still
    /// short and allowed.
    pub fn evict(&mut self, target: u64, now: u64, allow_soft: bool, stats: &Stats) -> u64 {
        self.evict_aged(target, now, allow_soft, stats, 0)
    }

    /// Like [`State::evict`], sparing objects written less than `min_age` ms ago.
    pub fn evict_aged(&mut self, target: u64, now: u64, allow_soft: bool, stats: &Stats, min_age: u64) -> u64 {
        let mut freed = 0u64;
        for pass in 0..2 {
            if freed >= target || (pass == 1 && !allow_soft) {
                break;
            }
            let mut cands: Vec<(u64, Box<str>)> = self
                .objects
                .iter()
                .filter(|(_, o)| o.evictable(&self.reads, now, min_age, pass == 1))
                .map(|(k, o)| (o.accessed(&self.groups), k.clone()))
                .collect();
            cands.sort_unstable_by_key(|(t, _)| *t);
            for (_, key) in cands {
                if freed >= target {
                    break;
                }
                let group = self.objects.get(&key).and_then(|o| o.group.clone());
                // Group eviction: eligible members go together. (The member list, whose keys
                // are distinct, is walked once, and the group pruned once after: a check of
                // each member against the victims so far, and each member's removal from the
                // list, made evicting a group of n members n² steps under the state's lock.)
                let victims = match &group {
                    Some(g) => {
                        let mut v = self.groups.get(g).map(|g| g.members.clone()).unwrap_or_default();
                        if !v.contains(&key) {
                            v.push(key);
                        }
                        v
                    }
                    None => vec![key],
                };
                for v in victims {
                    let eligible = self.objects.get(&v).is_some_and(|o| o.evictable(&self.reads, now, min_age, pass == 1));
                    if !eligible {
                        continue;
                    }
                    if let Some(o) = self.objects.remove(&v) {
                        self.mark_key(&v);
                        for r in o.current.iter() {
                            freed += r.block.len;
                            self.free_now(*r);
                        }
                        stats.evicted_objects.fetch_add(1, Ordering::Relaxed);
                        stats.evicted_bytes.fetch_add(o.size, Ordering::Relaxed);
                    }
                }
                if let Some(g) = group {
                    self.prune_groups(vec![g]);
                }
            }
        }
        freed
    }

    /// Frees deferred replicas whose time has come. (Those whose reads all ended were freed
    /// when the last one ended: [`State::release_reads`], [`State::expire_reads`].)
    pub fn release_deferred(&mut self, now: u64) {
        self.reads_ended(&[], now);
    }

    // --- objects ---------------------------------------------------------------------------

    /// Starts a put, making room if needed by any eviction allowed (the last attempt).
    #[allow(clippy::too_many_arguments)]
    pub fn put_start(&mut self, m: &MasterConfig, stats: &Stats, put: PutId, key: &str, size: u64, cfg: &ReplicateConfig, upsert: bool, now: u64) -> StoreResult<Vec<ReplicaDesc>> {
        self.put_start_ex(m, stats, put, key, size, cfg, upsert, now, Attempt::Last)
    }

    /// Starts a put. Unless it is the last `attempt`, while reads are in flight (whose end may free space)
    /// objects written within `put_wait_for_reads` are not evicted: the caller retries
    /// (`NoAvailableHandle`) until the reads end or the wait is over.
    #[allow(clippy::too_many_arguments)]
    pub fn put_start_ex(&mut self, m: &MasterConfig, stats: &Stats, put: PutId, key: &str, size: u64, cfg: &ReplicateConfig, upsert: bool, now: u64, attempt: Attempt) -> StoreResult<Vec<ReplicaDesc>> {
        let PutId { client, put } = put;
        self.placed_granted = false;
        check_key(key)?;
        if size == 0 {
            return Err(StoreError::InvalidParams(format!("value of {key:?} is empty; values must be at least 1 byte")));
        }
        if cfg.replica_num == 0 || cfg.replica_num > 64 {
            return Err(StoreError::InvalidParams(format!("replica_num {} must be 1..=64", cfg.replica_num)));
        }
        if cfg.preferred_segments.len() > MAX_PREFERRED {
            return Err(StoreError::InvalidParams(format!("{} preferred segments; at most {MAX_PREFERRED} (each is compared with every segment, under the master's lock)", cfg.preferred_segments.len())));
        }
        if !self.clients.contains_key(&client) {
            return Err(StoreError::UnknownClient(client));
        }
        let discard = m.put_start_discard_timeout.as_millis() as u64;
        // A put in progress keeps the key until the discard timeout (whether a readable value
        // does is decided below, once a zombie put is discarded).
        if self.objects.get(key).and_then(|o| o.pending.as_ref()).is_some_and(|p| now.saturating_sub(p.started) < discard) {
            return Err(StoreError::ObjectAlreadyExists(key.to_string()));
        }
        // A zombie put (started, never ended, older than the discard timeout) loses its
        // space, but only after the release timeout: its writer may still be writing.
        let release = now + m.put_start_release_timeout.as_millis() as u64;
        if let Some(zombie) = self.objects.get_mut(key).and_then(|o| o.pending.take()) {
            self.mark_key(key);
            tracing::warn!(key, client = zombie.client, "discarding a put that never finished");
            for r in zombie.replicas.iter() {
                self.free_later(*r, release);
            }
            // A put that never finished leaves nothing readable: the key goes now, so that a
            // put that fails below does not leave a bare object that refuses every later put
            // of the key (`ObjectAlreadyExists`) and is never evicted.
            if self.objects.get(key).is_some_and(Object::bare) {
                self.forget(key);
            }
        }
        // A readable value stays unless this put replaces it on purpose (also when a zombie
        // upsert of it was just discarded: first writer wins, as in Mooncake).
        if !upsert && self.objects.get(key).is_some_and(|o| !o.current.is_empty()) {
            return Err(StoreError::ObjectAlreadyExists(key.to_string()));
        }
        let largest = self.segments.values().map(|s| s.space.size()).max().unwrap_or(0);
        if size > largest {
            return Err(StoreError::NoAvailableHandle {
                size,
                replicas: cfg.replica_num,
                detail: if largest == 0 { "no segment is mounted".into() } else { format!("the value is larger than any segment (largest {largest} bytes)") },
            });
        }
        let mut replicas = self.place(size, cfg, m.strategy, now);
        // Space granted ahead goes back before anything is evicted.
        if replicas.is_empty() && self.return_pools() {
            replicas = self.place(size, cfg, m.strategy, now);
        }
        if replicas.is_empty() && !self.deferred.is_empty() {
            // Space held by reads that ended (released or expired) comes back first.
            self.expire_reads(now);
            replicas = self.place(size, cfg, m.strategy, now);
        }
        // A try again while reads are still in flight evicts nothing more: the first try
        // evicted what the put needs, and each retry (every 500 µs for up to a second) evicted
        // as much again, most of a fragmented pool before the reads ended.
        let again = attempt == Attempt::Again && self.reads_in_flight(now);
        if replicas.is_empty() && !again {
            // Make room: at least this value, at least the configured ratio. While reads in
            // flight may still free space, objects just written are spared.
            let waiting = attempt != Attempt::Last && self.reads_in_flight(now);
            let min_age = if waiting { m.put_wait_for_reads.as_millis() as u64 } else { 0 };
            let total = self.total_bytes();
            let target = size.saturating_mul(u64::from(cfg.replica_num)).max((total as f64 * m.eviction_ratio) as u64);
            let freed = self.evict_aged(target, now, m.allow_evict_soft_pinned, stats, min_age);
            tracing::debug!(key, size, used = self.used_bytes(), total, freed, deferred = self.deferred.len(), "no free range for a put: evicted");
            replicas = self.place(size, cfg, m.strategy, now);
        }
        if replicas.is_empty() {
            return Err(StoreError::NoAvailableHandle {
                size,
                replicas: cfg.replica_num,
                detail: if self.reads_in_flight(now) {
                    "every segment is full of objects being read, pinned or being written (reads in flight did not end in time; retry, or raise the pool size)".into()
                } else {
                    "every segment is full of pinned objects or objects being written; retry later, remove objects or raise the pool size".into()
                },
            });
        }
        let descs = replicas.iter().filter_map(|r| self.desc(r)).collect();
        let soft_pin_ttl = cfg.soft_pin_ttl_ms.unwrap_or(m.default_soft_pin_ttl.as_millis() as u64);
        let pending = Box::new(Pending { id: put, replicas: replicas.into_boxed_slice(), size, client, started: now, soft_pin: cfg.soft_pin, soft_pin_ttl });
        self.mark_key(key);
        match self.objects.get_mut(key) {
            Some(o) => o.pending = Some(pending),
            None => {
                let group: Option<Arc<str>> = cfg.group_id.as_deref().filter(|g| !g.is_empty()).map(Arc::from);
                if let Some(g) = &group {
                    self.groups.entry(Arc::clone(g)).or_default().members.push(key.into());
                }
                self.objects.insert(
                    key.into(),
                    Object {
                        size,
                        current: Box::new([]),
                        pending: Some(pending),
                        lease_until: 0,
                        reads: Vec::new(),
                        written: now,
                        owner: client,
                        last_access: now,
                        soft_pin_until: 0,
                        hard_pin: cfg.with_hard_pin,
                        group,
                        joined: now,
                    },
                );
            }
        }
        Ok(descs)
    }

    /// Ends put `put` of `key` (its bytes landed): the object reads as it wrote.
    pub fn put_end(&mut self, put: PutId, key: &str, now: u64) -> StoreResult<()> {
        let PutId { client, put } = put;
        let o = self.objects.get(key).ok_or_else(|| StoreError::ObjectNotFound(key.to_string()))?;
        match &o.pending {
            Some(p) if p.client == client && p.id == put => {}
            Some(p) if p.client == client => return Err(StoreError::InvalidParams(format!("put {put} of {key:?} is not in progress: it was discarded as a zombie and this client is putting the key again (put {}); the earlier put is lost", p.id))),
            _ => return Err(StoreError::InvalidParams(format!("no put of {key:?} by this client is in progress (it was revoked, discarded as a zombie, or never started)"))),
        }
        self.mark_key(key);
        let o = self.objects.get_mut(key).ok_or_else(|| StoreError::ObjectNotFound(key.to_string()))?;
        let p = o.pending.take().expect("checked");
        if p.replicas.is_empty() {
            // Every replica's segment went away during the write.
            if o.current.is_empty() {
                self.forget(key);
            }
            return Err(StoreError::TransferFailed(format!("every replica of {key:?} was lost (its segment was unmounted) during the put")));
        }
        let old = std::mem::replace(&mut o.current, p.replicas);
        let old_reads = std::mem::take(&mut o.reads);
        o.size = p.size;
        o.written = now;
        o.owner = client;
        o.last_access = now;
        o.soft_pin_until = match p.soft_pin {
            SoftPin::Enable => now.saturating_add(p.soft_pin_ttl),
            SoftPin::Disable => 0,
            SoftPin::Preserve => o.soft_pin_until,
        };
        for r in old.iter() {
            self.free_after_reads(*r, &old_reads, now); // a reader may still be reading it
        }
        Ok(())
    }

    /// Revokes put `put` of `key`: its space is freed, nothing of it becomes readable.
    pub fn put_revoke(&mut self, put: PutId, key: &str) -> StoreResult<()> {
        let PutId { client, put } = put;
        let o = self.objects.get(key).ok_or_else(|| StoreError::ObjectNotFound(key.to_string()))?;
        match &o.pending {
            Some(p) if p.client == client && p.id == put => {}
            _ => return Err(StoreError::InvalidParams(format!("no put of {key:?} by this client is in progress"))),
        }
        self.mark_key(key);
        let o = self.objects.get_mut(key).ok_or_else(|| StoreError::ObjectNotFound(key.to_string()))?;
        let p = o.pending.take().expect("checked");
        let empty = o.current.is_empty();
        for r in p.replicas.iter() {
            self.free_now(*r);
        }
        if empty {
            self.forget(key);
        }
        Ok(())
    }

    fn touch(&mut self, key: &str, now: u64, lease: u64) -> StoreResult<()> {
        let o = self.objects.get_mut(key).ok_or_else(|| StoreError::ObjectNotFound(key.to_string()))?;
        if o.current.is_empty() {
            return Err(StoreError::ReplicaNotReady(key.to_string()));
        }
        o.lease_until = o.lease_until.max(now + lease);
        o.last_access = now;
        // The group's lease and access time, once for all its members (see `Group`).
        if let Some(g) = o.group.as_ref().and_then(|g| self.groups.get_mut(g)) {
            g.lease_until = g.lease_until.max(now + lease);
            g.last_access = now;
        }
        Ok(())
    }

    pub fn get_replica_list(&mut self, key: &str, now: u64, lease: u64) -> StoreResult<ReplicaList> {
        check_key(key)?;
        self.touch(key, now, lease)?;
        self.next_read += 1;
        let read_id = self.next_read;
        self.reads.insert(read_id, now + lease);
        let reads = &self.reads;
        let Some(o) = self.objects.get_mut(key) else { return Err(StoreError::ObjectNotFound(key.to_string())) };
        // Finished reads are pruned when the list reaches a power of two, not at every read:
        // n reads of one key in flight at once cost O(n) in all, not O(n²).
        if o.reads.len() >= 8 && o.reads.len().is_power_of_two() {
            o.reads.retain(|id| read_live(reads, *id, now));
        }
        o.reads.push(read_id);
        let Some(o) = self.objects.get(key) else { return Err(StoreError::ObjectNotFound(key.to_string())) };
        Ok(ReplicaList { replicas: o.current.iter().filter_map(|r| self.desc(r)).collect(), size: o.size, lease_ttl_ms: lease, read_id })
    }

    /// Forgets reads whose lease ran out (their readers fail the read themselves); the frees
    /// that waited only for them are due.
    pub fn expire_reads(&mut self, now: u64) {
        let mut ended = Vec::new();
        self.reads.retain(|id, until| {
            let live = *until > now;
            if !live {
                ended.push(*id);
            }
            live
        });
        self.reads_ended(&ended, now);
    }

    pub fn exist_key(&mut self, key: &str, now: u64, lease: u64) -> StoreResult<bool> {
        check_key(key)?;
        match self.touch(key, now, lease) {
            Ok(()) => Ok(true),
            Err(StoreError::ObjectNotFound(_)) | Err(StoreError::ReplicaNotReady(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    pub fn remove(&mut self, m: &MasterConfig, key: &str, force: bool, now: u64) -> StoreResult<()> {
        check_key(key)?;
        let o = self.objects.get(key).ok_or_else(|| StoreError::ObjectNotFound(key.to_string()))?;
        if !force {
            if o.leased(&self.groups, now) {
                return Err(StoreError::ObjectHasLease(key.to_string()));
            }
            if o.pending.is_some() {
                return Err(StoreError::ReplicaNotReady(key.to_string()));
            }
        }
        let Some(o) = self.forget(key) else { return Err(StoreError::ObjectNotFound(key.to_string())) };
        let mut free = Vec::new();
        self.release_space(m, &o, now, &mut free);
        for r in free {
            self.free_now(r);
        }
        Ok(())
    }

    /// The space of a removed object: its replicas are freed once no read of them is in
    /// flight, a write in progress keeps its space until its writer can no longer write.
    /// Replicas that may be freed at once are left in `free` for the caller.
    fn release_space(&mut self, m: &MasterConfig, o: &Object, now: u64, free: &mut Vec<Replica>) {
        let release = now + m.put_start_release_timeout.as_millis() as u64;
        for r in o.current.iter() {
            free.extend(self.free_after_reads_or_back(*r, &o.reads, now));
        }
        if let Some(p) = &o.pending {
            for r in p.replicas.iter() {
                self.free_later(*r, release);
            }
        }
    }

    /// Frees replicas at once, each segment's together ([`SegmentSpace::free_many`]).
    fn free_all_now(&mut self, mut free: Vec<Replica>) {
        free.sort_unstable_by_key(|r| r.seg);
        for run in free.chunk_by(|a, b| a.seg == b.seg) {
            if let Some(s) = self.segments.get_mut(&run[0].seg) {
                s.space.free_many(run.iter().map(|r| r.block).collect());
            }
        }
    }

    /// Mooncake's `BatchReplicaClear`: for each key this client wrote whose lease ended,
    /// drops its replicas on the segment named `segment` (all of them if empty; the object
    /// goes when none is left). Keys that are absent, another client's, leased, still being
    /// written (for an empty `segment`) or without a replica there are skipped. Returns the
    /// keys cleared.
    pub fn batch_replica_clear(&mut self, client: u64, keys: &[String], segment: &str, now: u64) -> Vec<String> {
        let mut cleared = Vec::new();
        for key in keys {
            let Some(o) = self.objects.get(key.as_str()) else { continue };
            if o.owner != client || o.leased(&self.groups, now) || o.current.is_empty() {
                continue;
            }
            let on_seg = |r: &Replica| self.segments.get(&r.seg).is_some_and(|s| s.seg.name == segment || s.seg.te_endpoint == segment);
            let (dropped, keep): (Vec<Replica>, Vec<Replica>) = if segment.is_empty() {
                if o.pending.is_some() {
                    continue;
                }
                (o.current.to_vec(), Vec::new())
            } else {
                o.current.iter().partition(|r| on_seg(r))
            };
            if dropped.is_empty() {
                continue;
            }
            let reads = o.reads.clone();
            let gone = keep.is_empty() && o.pending.is_none();
            if gone {
                self.forget(key);
            } else if let Some(o) = self.objects.get_mut(key.as_str()) {
                o.current = keep.into_boxed_slice();
                self.mark_key(key);
            }
            for r in dropped {
                self.free_after_reads(r, &reads, now);
            }
            cleared.push(key.clone());
        }
        cleared
    }

    /// Removes every object whose key matches `pred` (with `force`, also those being read or
    /// written); how many went. `RemoveAll` and `RemoveByRegex`.
    ///
    /// One walk over the objects, taking out those that go (no second lookup, the key copied only
    /// while journaling); their space is freed per segment at once ([`SegmentSpace::free_many`]), their keys are marked without
    /// hashing (`State::mark_keys_owned`) and their groups pruned once at the end. It holds the state's lock for
    /// up to every object of the pool (`RemoveAll`), so each removal must stay cheap.
    pub fn remove_matching(&mut self, m: &MasterConfig, pred: impl Fn(&str) -> bool, force: bool, now: u64) -> Removed {
        // (`retain`, as `HashMap::extract_if` needs a newer Rust than this crate's minimum:
        // the object moves out, only the key is copied.)
        let journaling = self.journaling();
        let (mut gone, mut keys) = (Vec::new(), Vec::new());
        let groups = &self.groups;
        self.objects.retain(|k, o| {
            if !(pred(k) && (force || (!o.leased(groups, now) && o.pending.is_none()))) {
                return true;
            }
            gone.push(std::mem::take(o));
            if journaling {
                keys.push(k.clone());
            }
            false
        });
        let (mut grouped, mut free) = (Vec::new(), Vec::with_capacity(gone.len()));
        for o in &mut gone {
            if let Some(g) = o.group.take() {
                grouped.push(g);
            }
            self.release_space(m, o, now, &mut free);
        }
        self.mark_keys_owned(keys);
        self.free_all_now(free);
        self.prune_groups(grouped);
        Removed { objects: gone }
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
