//! What an HA leader replicates of its state, as pure data: [`Change`]s, the durable part of
//! the state they describe, and how a new leader rebuilds a [`State`] from them.
//!
//! Sans-IO: nothing here talks to etcd (that is `crate::ha::journal`). The leader's [`State`]
//! marks what a request changed (segments, clients, objects, space held back for readers);
//! [`State::take_changes`] turns the marks into changes that each carry an entity's *whole*
//! durable state (or its removal), so applying a change twice, or a later one over an earlier
//! one, gives the same result, and any prefix of the journal is a consistent state per entity.
//! [`State::image`] is the full state as changes (a snapshot).
//!
//! What is durable: clients, segments, objects (size, readable replicas, a write in progress
//! with its reserved space, owner, pins, group) and replicas held back for readers (a forced
//! remove or an upsert while a read was in flight). What is not: read leases and reads in
//! flight, access times, pings. A new leader therefore rebuilds conservatively
//! ([`Image::into_state`]): every object counts as being read for one lease TTL (so nothing a
//! reader of the old leader may still be reading is evicted or reused), held-back replicas are
//! freed only after one lease TTL, writes in progress stay in progress (their writer may end
//! them at the new leader, or they become zombies as usual), every client counts as having
//! just pinged, and read ids start in a range of their own (the term's), so a reader releasing
//! an id of the old leader can never release a read of the new one.

use super::alloc::SegmentSpace;
use super::{Object, Pending, Replica, SegState, State};
use crate::proto::{Segment, SoftPin};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};
use std::sync::Arc;

/// One replica as the journal names it: segment id, address, length.
pub type ReplicaRec = (u64, u64, u64);

/// An object's replicas as the journal names them: one is kept inline (Mooncake's and the
/// consumers' default is one replica), so a change of such an object allocates only its key
/// on the leader and on every standby that decodes it. Encoded as a sequence, like a `Vec`.
pub type ReplicaRecs = SmallVec<[ReplicaRec; 1]>;

/// Decodes a [`ReplicaRecs`] growing it as elements arrive: smallvec's own `Deserialize`
/// reserves the length the input claims before reading any element, so a corrupt or hostile
/// length would reserve gigabytes before the input runs out.
fn de_recs<'de, D: serde::Deserializer<'de>>(d: D) -> Result<ReplicaRecs, D::Error> {
    struct V;
    impl<'de> serde::de::Visitor<'de> for V {
        type Value = ReplicaRecs;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a sequence of replicas")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<ReplicaRecs, A::Error> {
            let mut out = ReplicaRecs::new();
            while let Some(r) = seq.next_element()? {
                out.push(r);
            }
            Ok(out)
        }
    }
    d.deserialize_seq(V)
}

/// A write in progress (space reserved, not yet readable).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingRec {
    /// The put's id, chosen by its client (what its `PutEnd` names).
    pub id: u64,
    #[serde(deserialize_with = "de_recs")]
    pub replicas: ReplicaRecs,
    pub size: u64,
    pub client: u64,
    pub soft_pin: SoftPin,
    pub soft_pin_ttl: u64,
}

/// An object's durable state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectRec {
    pub size: u64,
    #[serde(deserialize_with = "de_recs")]
    pub current: ReplicaRecs,
    pub pending: Option<PendingRec>,
    pub owner: u64,
    pub hard_pin: bool,
    /// Milliseconds of soft pin left when the change was taken (0: none).
    pub soft_pin_left: u64,
    pub group: Option<String>,
}

/// One replicated change: an entity's whole durable state, or its removal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Change {
    Client {
        id: u64,
        live: bool,
    },
    Mount {
        client: u64,
        seg: Segment,
    },
    Unmount {
        seg: u64,
    },
    Object {
        key: String,
        rec: ObjectRec,
    },
    Forget {
        key: String,
    },
    /// A replica no object names any more but a reader may still read: not reused for a
    /// lease TTL after a takeover. (What leaders before [`Change::HeldUntil`] wrote.)
    HeldBack {
        replica: ReplicaRec,
    },
    /// Space no object names any more that a reader may still read or a writer still write
    /// (a write in progress whose object or segment went): not reused for `left` ms after
    /// the change was taken, nor for less than a lease TTL after a takeover. Its segment
    /// may be gone: the space is then held in case it is mounted again.
    HeldUntil {
        replica: ReplicaRec,
        left: u64,
    },
    /// The space of segment `seg` granted ahead to puts by the leader of `term` (its whole
    /// pool, `(address, length)`; empty: none any more): once this change is acknowledged,
    /// a put placed there is answered before its own change is. A new leader holds, for
    /// `hold` ms (the leader's put release timeout) and at least a lease TTL, every byte the
    /// last grant of each term named that no replica it knows covers: a put whose change
    /// never reached it writes there and nowhere else. (Masters before this change cannot
    /// read a journal holding one; a leader grants only while every in-sync standby says it
    /// reads them, `ha::sync::GRANTS`.)
    Granted {
        seg: u64,
        term: i64,
        ranges: Vec<(u64, u64)>,
        hold: u64,
    },
    /// An object's copy on a client's disk (the disk tier): `Some((disk, length))`, or
    /// `None` (no copy any more). Follows the object's [`Change::Object`] whenever the copy
    /// changed or exists; a [`Change::Forget`] of the key ends it too. (Masters before this
    /// change cannot read a journal holding one; a leader writes one only with offload on.)
    Disk {
        key: String,
        copy: Option<(u64, u64)>,
    },
}

/// What a request changed, as marked by the state (only while journaling).
#[derive(Default)]
pub(super) struct Dirty {
    clients: BTreeSet<u64>,
    segments: BTreeSet<u64>,
    /// (foldhash, not std's SipHash: the keys were hashed once already by the state's map;
    /// hashing them again for every request was a tenth of the HA leader's time.)
    keys: hashbrown::HashSet<Box<str>>,
    /// Keys marked in bulk (by removals of many objects at once, each key once), kept as
    /// they come: neither hashed nor ordered, which for a million keys took most of a
    /// `RemoveAll`'s time. A key may be both here and in `keys` (or twice here, removed, put
    /// and removed again): its change is then taken twice, the same whole state each time,
    /// which replaying applies idempotently.
    bulk: Vec<Box<str>>,
    /// (replica, freed at this time at the latest)
    held_back: Vec<(ReplicaRec, u64)>,
    /// Segments whose pool of granted space changed.
    grants: BTreeSet<u64>,
    /// Keys whose disk copy changed (their [`Change::Disk`] follows their object's change).
    disk: hashbrown::HashSet<Box<str>>,
}

fn rec(r: &Replica) -> ReplicaRec {
    (r.seg, r.block.addr, r.block.len)
}

impl State {
    /// Starts marking changes (an HA leader); they are taken with [`State::take_changes`].
    pub fn journal_on(&mut self) {
        self.dirty.get_or_insert_with(Box::default);
    }

    pub fn journaling(&self) -> bool {
        self.dirty.is_some()
    }

    /// How many changes were marked into this state so far (while journaling; it only grows).
    /// A request that sees it move while it is applied under one hold of the state's lock
    /// changed durable state, which another request's journal collection may take (and
    /// make durable) once the state's lock is let go.
    pub fn marks(&self) -> u64 {
        self.marks
    }

    pub(super) fn mark_key(&mut self, key: &str) {
        if let Some(d) = &mut self.dirty {
            d.keys.get_or_insert_with(key, |k| k.into());
            self.marks += 1;
        }
    }

    /// Marks keys the caller owns already (no copy made) and that are distinct: the objects
    /// a bulk removal took out.
    pub(super) fn mark_keys_owned(&mut self, keys: impl IntoIterator<Item = Box<str>>) {
        if let Some(d) = &mut self.dirty {
            let before = d.bulk.len();
            d.bulk.extend(keys);
            self.marks += (d.bulk.len() - before) as u64;
        }
    }

    /// `key`'s disk copy changed (recorded or gone); its object is marked too.
    pub(super) fn mark_disk(&mut self, key: &str) {
        if let Some(d) = &mut self.dirty {
            d.disk.get_or_insert_with(key, |k| k.into());
            d.keys.get_or_insert_with(key, |k| k.into());
            self.marks += 1;
        }
    }

    pub(super) fn mark_grant(&mut self, id: u64) {
        if let Some(d) = &mut self.dirty {
            d.grants.insert(id);
            self.marks += 1;
        }
    }

    /// A segment's grant as a change: its pool's whole block (none: empty).
    fn granted(&self, id: u64, s: &super::SegState) -> Change {
        let ranges = s
            .pool
            .as_ref()
            .map(|p| vec![(p.space.base(), p.space.size())])
            .unwrap_or_default();
        Change::Granted {
            seg: id,
            term: self.term,
            ranges,
            hold: self.grants.hold,
        }
    }

    pub(super) fn mark_segment(&mut self, id: u64) {
        if let Some(d) = &mut self.dirty {
            d.segments.insert(id);
            self.marks += 1;
        }
    }

    pub(super) fn mark_client(&mut self, id: u64) {
        if let Some(d) = &mut self.dirty {
            d.clients.insert(id);
            self.marks += 1;
        }
    }

    pub(super) fn mark_held_back(&mut self, r: &Replica, until: u64) {
        if let Some(d) = &mut self.dirty {
            d.held_back.push((rec(r), until));
            self.marks += 1;
        }
    }

    fn object_rec(o: &Object, now: u64) -> ObjectRec {
        ObjectRec {
            size: o.size,
            current: o.current.iter().map(rec).collect(),
            pending: o.pending.as_ref().map(|p| PendingRec {
                id: p.id,
                replicas: p.replicas.iter().map(rec).collect(),
                size: p.size,
                client: p.client,
                soft_pin: p.soft_pin,
                soft_pin_ttl: p.soft_pin_ttl,
            }),
            owner: o.owner,
            hard_pin: o.hard_pin,
            soft_pin_left: o.soft_pin_until.saturating_sub(now),
            group: o.group.as_deref().map(str::to_string),
        }
    }

    /// The changes marked since the last call, each with the entity's state now; empty when
    /// nothing durable changed (or not journaling).
    pub fn take_changes(&mut self, now: u64) -> Vec<Change> {
        let Some(d) = self.dirty.as_mut() else {
            return Vec::new();
        };
        if d.clients.is_empty()
            && d.segments.is_empty()
            && d.keys.is_empty()
            && d.bulk.is_empty()
            && d.held_back.is_empty()
            && d.grants.is_empty()
            && d.disk.is_empty()
        {
            return Vec::new();
        }
        let d = std::mem::take(&mut **d);
        let mut out = Vec::with_capacity(
            d.clients.len() + d.segments.len() + d.keys.len() + d.bulk.len() + d.held_back.len(),
        );
        for id in d.clients {
            out.push(Change::Client {
                id,
                live: self.clients.contains_key(&id),
            });
        }
        for id in d.segments {
            out.push(match self.segments.get(&id) {
                Some(s) => Change::Mount {
                    client: s.client,
                    seg: s.seg.clone(),
                },
                None => Change::Unmount { seg: id },
            });
        }
        for key in d.keys.into_iter().chain(d.bulk) {
            match self.objects.get(&key) {
                Some(o) => {
                    let disk = o.disk.is_some() || d.disk.contains(&key);
                    let copy = o.disk.map(|c| (c.disk, c.len));
                    let key = key.into_string();
                    if disk {
                        out.push(Change::Object {
                            key: key.clone(),
                            rec: State::object_rec(o, now),
                        });
                        out.push(Change::Disk { key, copy });
                    } else {
                        out.push(Change::Object {
                            key,
                            rec: State::object_rec(o, now),
                        });
                    }
                }
                None => out.push(Change::Forget {
                    key: key.into_string(),
                }),
            }
        }
        out.extend(
            d.held_back
                .into_iter()
                .map(|(replica, until)| Change::HeldUntil {
                    replica,
                    left: until.saturating_sub(now),
                }),
        );
        // (A segment gone since is an `Unmount`, which ends its grants.)
        out.extend(
            d.grants
                .into_iter()
                .filter_map(|id| Some(self.granted(id, self.segments.get(&id)?))),
        );
        out
    }

    /// The whole durable state as changes (a snapshot); marks are left as they are.
    pub fn image(&self, now: u64) -> Vec<Change> {
        let mut out = self.image_head(now);
        for shard in 0..IMAGE_PIECES {
            self.image_piece(shard, now, &mut out);
        }
        out
    }

    /// The first part of an image: clients, segments and held space (few), with room for
    /// every object; the objects follow in [`IMAGE_PIECES`] pieces ([`State::image_piece`]).
    /// A leader takes an image in pieces, each under a hold of the state's lock of its own
    /// (`ha::journal`'s `Writer::image_in_pieces`): a request applied between two pieces shows in the pieces
    /// after it and not in those before, and its changes follow the image in the journal
    /// anyway (whole entities, applied again idempotently), so the image and what follows
    /// it rebuild the leader's state as one taken at once would.
    pub fn image_head(&self, now: u64) -> Vec<Change> {
        let mut out = Vec::with_capacity(
            self.clients.len() + self.segments.len() + self.objects.len() + self.deferred.len(),
        );
        out.extend(
            self.clients
                .keys()
                .map(|&id| Change::Client { id, live: true }),
        );
        for id in &self.seg_order {
            if let Some(s) = self.segments.get(id) {
                out.push(Change::Mount {
                    client: s.client,
                    seg: s.seg.clone(),
                });
            }
        }
        out.extend(
            self.deferred
                .replicas()
                .map(|(r, until)| Change::HeldUntil {
                    replica: rec(r),
                    left: until.saturating_sub(now),
                }),
        );
        out.extend(self.seg_order.iter().filter_map(|id| {
            self.segments
                .get(id)
                .filter(|s| s.pool.is_some())
                .map(|s| self.granted(*id, s))
        }));
        out
    }

    /// Piece `i` (`0..IMAGE_PIECES`) of an image's objects, appended to `out`.
    pub fn image_piece(&self, i: usize, now: u64, out: &mut Vec<Change>) {
        for (k, o) in self.objects.shard_entries(i) {
            out.push(Change::Object {
                key: k.to_string(),
                rec: State::object_rec(o, now),
            });
            if let Some(c) = o.disk {
                out.push(Change::Disk {
                    key: k.to_string(),
                    copy: Some((c.disk, c.len)),
                });
            }
        }
    }
}

/// Pieces of an image's objects (the shards of the object map).
pub const IMAGE_PIECES: usize = super::shards::SHARDS;

/// The durable state as the journal describes it: changes applied in order.
#[derive(Debug, Default, PartialEq)]
pub struct Image {
    clients: BTreeSet<u64>,
    segments: HashMap<u64, (u64, Segment)>,
    /// Mount order (placement walks it).
    seg_order: Vec<u64>,
    /// (Hashed: a standby applies a `RemoveAll` or a dead client's objects as up to millions
    /// of changes in no particular order; an ordered map took ~2 µs each, 10x a hashed one.
    /// Rebuilding does not depend on the order: see [`Image::into_state`].)
    objects: super::shards::Shards<String, ObjectRec, hashbrown::DefaultHashBuilder>,
    /// (replica, ms it was still held for when the change was taken)
    held_back: Vec<(ReplicaRec, u64)>,
    /// The last grant of each term per segment: (segment, term) -> (ranges, hold in ms).
    grants: BTreeMap<(u64, i64), GrantRec>,
    /// Objects' copies on disks: key -> (disk, length).
    disk: HashMap<String, (u64, u64)>,
}

/// A grant as an image keeps it: its ranges `(address, length)` and how long a new leader
/// holds them (ms).
type GrantRec = (Vec<(u64, u64)>, u64);

/// What rebuilding found wrong in a journal (replicas that overlap or lie outside their
/// segment are dropped, never served).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Rebuilt {
    pub objects: usize,
    pub segments: usize,
    pub dropped_replicas: usize,
    pub dropped_objects: usize,
}

impl Image {
    pub fn apply(&mut self, c: Change) {
        match c {
            Change::Client { id, live: true } => {
                self.clients.insert(id);
            }
            Change::Client { id, live: false } => {
                self.clients.remove(&id);
            }
            Change::Mount { client, seg } => {
                if self
                    .segments
                    .insert(seg.id, (client, seg.clone()))
                    .is_none()
                {
                    self.seg_order.push(seg.id);
                }
            }
            Change::Unmount { seg } => {
                if self.segments.remove(&seg).is_some() {
                    self.seg_order.retain(|&s| s != seg);
                }
                // (What a put still writes there was held by the leader that unmounted it,
                // as a `HeldUntil` of the same entry.)
                self.grants.retain(|&(s, _), _| s != seg);
            }
            Change::Object { key, rec } => {
                self.objects.insert(key, rec);
            }
            Change::Forget { key } => {
                self.objects.remove(&key);
                self.disk.remove(&key);
            }
            Change::Disk { key, copy } => match copy {
                Some(c) => {
                    self.disk.insert(key, c);
                }
                None => {
                    self.disk.remove(&key);
                }
            },
            Change::HeldBack { replica } => self.held_back.push((replica, 0)),
            Change::HeldUntil { replica, left } => self.held_back.push((replica, left)),
            Change::Granted {
                seg,
                term,
                ranges,
                hold,
            } => {
                if ranges.is_empty() {
                    self.grants.remove(&(seg, term));
                } else {
                    self.grants.insert((seg, term), (ranges, hold));
                }
            }
        }
    }

    /// Drops every kept replica overlapping a contested range (`(segment, start, end)`): of
    /// objects naming the same bytes none is served, whichever was rebuilt first. Objects left
    /// without replicas go. A corrupt journal has contested ranges, and so may a rebase's snapshot
    /// (taken in pieces, nothing committed meanwhile) whose following log entries were never
    /// written (an object removed or evicted and its space given to a new one between two
    /// pieces: both are in it).
    fn drop_contested(st: &mut State, mut contested: Vec<(u64, u64, u64)>, report: &mut Rebuilt) {
        contested.sort_unstable();
        let hit = |r: &Replica| super::overlaps_any(&contested, r);
        let mut freed = Vec::new();
        st.objects.retain(|_, o| {
            o.drop_replicas(hit, |r| freed.push(r));
            let keep = !o.bare();
            if !keep {
                report.dropped_objects += 1;
            }
            keep
        });
        report.dropped_replicas += freed.len();
        for r in freed {
            st.free_now(r);
        }
    }

    pub fn objects(&self) -> usize {
        self.objects.len()
    }

    /// The state a new leader of `term` starts from at `now` (see the module docs for what
    /// is assumed about what was not replicated); `lease` is the read lease TTL in ms. It
    /// journals ([`State::journal_on`]): the space it holds is its first changes.
    pub fn into_state(self, term: i64, now: u64, lease: u64) -> (State, Rebuilt) {
        let mut st = State {
            term,
            ..State::default()
        };
        let mut report = Rebuilt::default();
        // Read ids of this term never collide with an earlier term's.
        st.next_read = (term.max(0) as u64) << 40;
        st.next_read += 1;
        let takeover_read = st.next_read;
        st.reads.insert(takeover_read, now + lease);
        for id in &self.seg_order {
            if let Some((client, seg)) = self.segments.get(id) {
                let space = SegmentSpace::new(seg.base, seg.size);
                st.segments.insert(
                    *id,
                    SegState {
                        seg: seg.clone(),
                        client: *client,
                        space,
                        writes_until: 0,
                        pool: None,
                    },
                );
                st.seg_order.push(*id);
                // A segment's owner is alive until it stops pinging the new leader.
                st.clients.insert(*client, now);
            }
        }
        for id in &self.clients {
            st.clients.insert(*id, now);
        }
        report.segments = st.segments.len();
        // Replicas whose space could not be reserved: outside their segment, misaligned, or
        // bytes another object already took (a corrupt journal). Which of two objects naming
        // the same bytes comes first is up to the map's order, so neither keeps them (below).
        let mut contested: Vec<(u64, u64, u64)> = Vec::new();
        let take = |st: &mut State,
                    list: &[ReplicaRec],
                    report: &mut Rebuilt,
                    contested: &mut Vec<(u64, u64, u64)>|
         -> Box<[Replica]> {
            let mut out = Vec::with_capacity(list.len());
            for &(seg, addr, len) in list {
                match st
                    .segments
                    .get_mut(&seg)
                    .and_then(|s| s.space.reserve(addr, len))
                {
                    Some(block) => out.push(Replica { seg, block }),
                    None => {
                        report.dropped_replicas += 1;
                        if st.segments.contains_key(&seg) {
                            contested.push((seg, addr, addr.saturating_add(len.max(1))));
                        }
                    }
                }
            }
            out.into_boxed_slice()
        };
        // Objects in the order of their first replica's address: each reservation then takes
        // the start of the free range the previous one left (the map's order scattered them
        // over the segment, fragmenting its free ranges into as many as there were objects:
        // 2.3 µs per object, most of a takeover of a million objects).
        // (Indices sorted, not the ~180-byte entries themselves.)
        let mut objects: Vec<Option<(String, ObjectRec)>> =
            self.objects.into_iter().map(Some).collect();
        let at = |r: &ObjectRec| {
            r.current
                .first()
                .or_else(|| r.pending.as_ref().and_then(|p| p.replicas.first()))
                .map_or((0, 0), |&(seg, addr, _)| (seg, addr))
        };
        let mut order: Vec<((u64, u64), usize)> = objects
            .iter()
            .enumerate()
            .filter_map(|(i, o)| Some((at(&o.as_ref()?.1), i)))
            .collect();
        order.sort_unstable();
        for (key, rec) in order
            .into_iter()
            .filter_map(|(_, i)| objects.get_mut(i).and_then(Option::take))
        {
            let current = take(&mut st, &rec.current, &mut report, &mut contested);
            let disk = self
                .disk
                .get(&key)
                .map(|&(disk, len)| super::DiskReplica { disk, len });
            let pending = rec.pending.map(|p| {
                let replicas = take(&mut st, &p.replicas, &mut report, &mut contested);
                Box::new(Pending {
                    id: p.id,
                    replicas,
                    size: p.size,
                    client: p.client,
                    started: now,
                    soft_pin: p.soft_pin,
                    soft_pin_ttl: p.soft_pin_ttl,
                    copy: None,
                })
            });
            if current.is_empty()
                && disk.is_none()
                && pending.as_ref().is_none_or(|p| p.replicas.is_empty())
            {
                for r in current
                    .iter()
                    .chain(pending.iter().flat_map(|p| p.replicas.iter()))
                {
                    st.free_now(*r);
                }
                report.dropped_objects += 1;
                continue;
            }
            let group: Option<Arc<str>> = rec.group.as_deref().map(Arc::from);
            let reads = if current.is_empty() {
                Vec::new()
            } else {
                vec![takeover_read]
            };
            st.objects.insert(
                key.into_boxed_str(),
                Object {
                    size: rec.size,
                    current,
                    pending,
                    lease_until: now + lease,
                    reads,
                    written: now,
                    owner: rec.owner,
                    last_access: now,
                    soft_pin_until: if rec.soft_pin_left > 0 {
                        now.saturating_add(rec.soft_pin_left)
                    } else {
                        0
                    },
                    hard_pin: rec.hard_pin,
                    group,
                    joined: now,
                    disk,
                    offloading: None,
                },
            );
        }
        if !contested.is_empty() {
            Self::drop_contested(&mut st, contested, &mut report);
        }
        for (key, o) in st.objects.iter() {
            if let Some(g) = &o.group {
                st.groups
                    .entry(Arc::clone(g))
                    .or_default()
                    .members
                    .push(key.clone());
            }
        }
        report.objects = st.objects.len();
        // Held-back space a reader of the old leader may still read, or a writer still
        // write: free after the time it had left, and not before one lease. (Space that a
        // later change already handed to another object is not free: skipped.) On a segment
        // that went, it is held in case the segment is mounted again ([`State::drop_segments`]).
        // A journal names a range at each change, and an old hold the leader ended may
        // overlap a later one: each byte is held for the longest time any hold of it had
        // ([`held_pieces`]), whichever came first.
        // These holds are the rebuilt state's first changes (`HeldUntil`): what a grant named
        // is held only while the journal keeps that grant, which an `Unmount` of its segment
        // ends, so a later takeover from the journal would otherwise give those bytes to a
        // new put while a put answered early may still write them.
        st.journal_on();
        let mut by_seg: BTreeMap<u64, Vec<HeldRange>> = BTreeMap::new();
        for ((seg, addr, len), left) in self.held_back {
            let end = super::alloc::cap_of(len).map_or(u64::MAX, |cap| addr.saturating_add(cap));
            by_seg
                .entry(seg)
                .or_default()
                .push((addr, end, now.saturating_add(left.max(lease))));
        }
        // What a grant named that no replica known here covers: a put answered before its
        // change was acknowledged may write there (for as long as its release timeout).
        // Held after everything else was reserved, so the holds cover exactly that.
        for ((seg, _), (ranges, hold)) in self.grants {
            let Some(s) = st.segments.get(&seg) else {
                continue;
            };
            let free: Vec<(u64, u64)> = ranges
                .iter()
                .flat_map(|&(addr, len)| s.space.free_within(addr, addr.saturating_add(len)))
                .collect();
            by_seg.entry(seg).or_default().extend(
                free.into_iter()
                    .map(|(addr, len)| (addr, addr + len, now.saturating_add(hold.max(lease)))),
            );
        }
        for (seg, ranges) in by_seg {
            for (start, end, until) in held_pieces(ranges) {
                match st.segments.get_mut(&seg) {
                    Some(s) => {
                        if let Some(block) = s.space.reserve(start, end - start) {
                            st.free_later(Replica { seg, block }, until);
                        }
                    }
                    None => {
                        st.orphaned.insert(seg);
                        st.free_later(
                            Replica {
                                seg,
                                block: super::alloc::Block::held(start, end - start),
                            },
                            until,
                        );
                    }
                }
            }
        }
        (st, report)
    }
}

impl State {
    /// A state built ahead by [`Image::into_state`] for term [`PREBUILT_TERM`] at `built` (ms),
    /// made the one `into_state(term, now, lease)` gives (a standby builds it while the dead
    /// leader's lease runs out, `ha::sync::Mirror::prebuild`; `now` ≥ `built`): the term and
    /// its takeover read, every object's read lease and times from `now`, its soft pin
    /// `now - built` later, every pending put started and every client seen at `now`. Space
    /// held back stays held until what was computed at `built`, one read lease at least from
    /// then: a reader of the old leader read before its death, which came before `built`.
    pub fn retarget(&mut self, term: i64, built: u64, now: u64, lease: u64) {
        let shift = now.saturating_sub(built);
        let old = self.next_read;
        let read = ((term.max(0) as u64) << 40) + 1;
        self.term = term;
        self.next_read = read;
        self.reads.remove(&old);
        self.reads.insert(read, now + lease);
        self.objects.retain(|_, o| {
            for r in o.reads.iter_mut().filter(|r| **r == old) {
                *r = read;
            }
            o.lease_until = now + lease;
            (o.written, o.last_access, o.joined) = (now, now, now);
            if o.soft_pin_until > 0 {
                o.soft_pin_until = o.soft_pin_until.saturating_add(shift);
            }
            if let Some(p) = o.pending.as_mut() {
                p.started = now;
            }
            true
        });
        for seen in self.clients.values_mut() {
            *seen = now;
        }
    }
}

/// The term a state built ahead is built for ([`State::retarget`]): no real term (an etcd
/// revision, at least 1).
pub const PREBUILT_TERM: i64 = 0;

/// `(start, end, until)`: bytes `[start, end)` of a segment held until a time (ms).
type HeldRange = (u64, u64, u64);

/// Ranges `[start, end)` each held until a time, as pieces that do not overlap, each held
/// until the latest time of the ranges that cover it (bytes no range covers are in none).
/// A sweep over the ranges' ends: O(n log n).
pub(super) fn held_pieces(mut ranges: Vec<HeldRange>) -> Vec<HeldRange> {
    ranges.retain(|r| r.0 < r.1);
    let mut bounds: Vec<u64> = ranges.iter().flat_map(|r| [r.0, r.1]).collect();
    bounds.sort_unstable();
    bounds.dedup();
    ranges.sort_unstable();
    // The times of the ranges covering the current piece, as a multiset (ranges end in any
    // order), and the ranges by their end, to take them out.
    let mut live: BTreeMap<u64, usize> = BTreeMap::new();
    let mut ending: BinaryHeap<Reverse<(u64, u64)>> = BinaryHeap::new();
    let (mut out, mut next) = (Vec::new(), 0);
    for w in bounds.windows(2) {
        let (a, b) = (w[0], w[1]);
        while let Some(&Reverse((end, until))) = ending.peek() {
            if end > a {
                break;
            }
            ending.pop();
            if let Some(n) = live.get_mut(&until) {
                *n -= 1;
                if *n == 0 {
                    live.remove(&until);
                }
            }
        }
        while let Some(&(start, end, until)) = ranges.get(next) {
            if start > a {
                break;
            }
            next += 1;
            *live.entry(until).or_default() += 1;
            ending.push(Reverse((end, until)));
        }
        if let Some((&until, _)) = live.last_key_value() {
            out.push((a, b, until));
        }
    }
    out
}

#[cfg(test)]
mod tests;
