//! The state machine's segments and clients: mounts, unmounts and remounts, writes reported
//! still running, pings, and the expiry of clients that stopped pinging (with what their
//! segments held).

use super::alloc::SegmentSpace;
use super::{overlaps_any, Object, Replica, ReportedWrite, SegState, State, MAX_REPORTED_WRITES};
use crate::error::{StoreError, StoreResult};
use crate::proto::{PingStatus, Segment, WriteInFlight};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

impl State {
    pub fn mount(&mut self, client: u64, seg: Segment, now: u64) -> StoreResult<()> {
        if seg.size == 0 || seg.base.checked_add(seg.size).is_none() {
            return Err(StoreError::InvalidParams(format!(
                "segment {} has an invalid range (base {:#x}, size {})",
                seg.name, seg.base, seg.size
            )));
        }
        if let Some(s) = self.segments.get(&seg.id) {
            if s.client == client && s.seg == seg {
                if self.clients.insert(client, now).is_none() {
                    self.mark_client(client);
                }
                return Ok(()); // idempotent remount
            }
            return Err(StoreError::SegmentAlreadyExists(format!(
                "{} (id {:x})",
                seg.name, seg.id
            )));
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
        self.segments.insert(
            id,
            SegState {
                seg,
                client,
                space,
                writes_until,
                pool: None,
            },
        );
        Ok(())
    }

    /// Until when the writes reported into `seg`'s range (before it was mounted) run: 0 if
    /// none does.
    pub(super) fn reported_until(&mut self, seg: &Segment, now: u64) -> u64 {
        self.reported_writes.retain(|w| w.until > now);
        let end = seg.base.saturating_add(seg.size);
        self.reported_writes
            .iter()
            .filter(|w| *w.te_endpoint == *seg.te_endpoint && w.start < end && w.end > seg.base)
            .map(|w| w.until)
            .max()
            .unwrap_or(0)
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
    pub fn hold_writes(
        &mut self,
        client: u64,
        writes: &[WriteInFlight],
        now: u64,
        release: u64,
    ) -> StoreResult<usize> {
        self.reported_writes.retain(|w| w.until > now);
        // The mounted segments by endpoint (one engine may serve several).
        let mut by_endpoint: HashMap<&str, Vec<(u64, u64, u64)>> = HashMap::new();
        for (&id, s) in &self.segments {
            by_endpoint.entry(&s.seg.te_endpoint).or_default().push((
                id,
                s.seg.base,
                s.seg.base.saturating_add(s.seg.size),
            ));
        }
        // (segment, start, end, until) of the writes into mounted segments; the others kept.
        let mut hits: Vec<(u64, u64, u64, u64)> = Vec::new();
        let mut keep: Vec<ReportedWrite> = Vec::new();
        for w in writes {
            let (start, end, until) = (
                w.addr,
                w.addr.saturating_add(w.size.max(1)),
                now.saturating_add(w.left_ms.min(release)),
            );
            if until <= now {
                continue;
            }
            let before = hits.len();
            hits.extend(
                by_endpoint
                    .get(w.te_endpoint.as_str())
                    .into_iter()
                    .flatten()
                    .filter(|&&(_, b, e)| start < e && end > b)
                    .map(|&(id, _, _)| (id, start, end, until)),
            );
            if hits.len() == before {
                keep.push(ReportedWrite {
                    te_endpoint: w.te_endpoint.as_str().into(),
                    start,
                    end,
                    until,
                });
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
        let span = |r: &Replica| {
            (
                r.seg,
                r.block.addr,
                r.block.addr.saturating_add(r.block.len.max(1)),
            )
        };
        let exact: HashSet<(u64, u64, u64)> =
            hits.iter().map(|&(id, a, e, _)| (id, a, e)).collect();
        let mut ranges: Vec<(u64, u64, u64)> = exact.iter().copied().collect();
        ranges.sort_unstable();
        let (mut known, mut dropped, mut touched) = (HashSet::new(), Vec::new(), Vec::new());
        self.objects.retain(|k, o| {
            let mine: Vec<(u64, u64, u64)> = o
                .pending
                .iter()
                .filter(|p| p.client == client)
                .flat_map(|p| p.replicas.iter().map(span))
                .filter(|x| exact.contains(x))
                .collect();
            known.extend(mine.iter().copied());
            if o.drop_replicas(
                |r| overlaps_any(&ranges, r) && !mine.contains(&span(r)),
                |r| dropped.push(r),
            ) {
                touched.push(k.clone());
            }
            true
        });
        let mut held = HashSet::new();
        for &(id, a, e, until) in &hits {
            if let Some(s) = self
                .segments
                .get_mut(&id)
                .filter(|_| !known.contains(&(id, a, e)))
            {
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
            Some(s) if s.client != client => {
                return Err(StoreError::InvalidParams(format!(
                    "segment {seg_id:x} belongs to another client"
                )))
            }
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
    pub(super) fn drop_segments(&mut self, ids: &[u64], now: u64, release: u64) {
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
        self.orphaned.extend(
            self.deferred
                .replicas()
                .map(|(r, _)| r.seg)
                .filter(|s| ids.contains(s)),
        );
        for (r, started) in writing {
            self.orphaned.insert(r.seg);
            self.free_later(r, started.saturating_add(release).max(now));
        }
    }

    /// Forgets the dropped segments that have nothing held any more (their holds ran out,
    /// or they were mounted again): all of them once nothing at all is held, else one walk
    /// over what is held, at most once a minute, so that segments of clients gone for good
    /// do not pile up while anything else is held.
    pub(super) fn prune_orphaned(&mut self, now: u64) {
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
        let held: HashSet<u64> = self
            .deferred
            .replicas()
            .map(|(r, _)| r.seg)
            .filter(|s| !segments.contains_key(s))
            .collect();
        self.orphaned.retain(|s| held.contains(s));
    }

    /// Groups that lost members (removed from `objects` already) keep only the members still
    /// there; a group left empty goes. Each group is pruned once, however many of its
    /// members went: not once per member, which costs a group of thousands of objects going
    /// at once its size squared.
    pub(super) fn prune_groups(&mut self, mut grouped: Vec<Arc<str>>) {
        grouped.sort_unstable();
        grouped.dedup();
        let objects = &self.objects;
        for g in grouped {
            if let Some(group) = self.groups.get_mut(&g) {
                group
                    .members
                    .retain(|m| objects.get(m).is_some_and(|o| o.group.as_ref() == Some(&g)));
                if group.members.is_empty() {
                    self.groups.remove(&g);
                }
            }
        }
    }

    pub(super) fn forget(&mut self, key: &str) -> Option<Object> {
        let o = self.objects.remove(key)?;
        self.mark_key(key);
        if let Some(d) = o.disk {
            self.drop_on_disk(key, d.disk);
        }
        if let Some(g) = &o.group {
            self.leave_group(g, key);
        }
        Some(o)
    }

    /// `key` is no longer a member of group `g` (a group left empty goes).
    pub(super) fn leave_group(&mut self, g: &str, key: &str) {
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
    pub fn remount(
        &mut self,
        client: u64,
        segments: Vec<Segment>,
        now: u64,
        hold: u64,
    ) -> StoreResult<()> {
        self.register_client(client, now);
        let mut r = Ok(());
        for seg in segments {
            let (id, known) = (seg.id, self.segments.contains_key(&seg.id));
            match self.mount(client, seg, now) {
                Ok(()) if !known && hold > 0 => {
                    let blocks = self
                        .segments
                        .get_mut(&id)
                        .map(|s| s.space.take_all())
                        .unwrap_or_default();
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
        // (Ordered: what a state machine returns does not depend on a hash's seed.)
        let mut dead: std::collections::BTreeMap<u64, Vec<String>> = self
            .clients
            .iter()
            .filter(|(_, &t)| now.saturating_sub(t) > ttl)
            .map(|(&c, _)| (c, Vec::new()))
            .collect();
        if dead.is_empty() {
            return Vec::new();
        }
        for &c in dead.keys() {
            self.clients.remove(&c);
            self.mark_client(c);
            self.tasks.client_gone(c, now);
        }
        let mut segs = Vec::new();
        for &id in &self.seg_order {
            if let Some((names, s)) = self
                .segments
                .get(&id)
                .and_then(|s| Some((dead.get_mut(&s.client)?, s)))
            {
                names.push(s.seg.name.clone());
                segs.push(id);
            }
        }
        self.drop_segments(&segs, now, release);
        self.drop_client_disks(&dead.keys().copied().collect::<Vec<_>>());
        dead.into_iter().collect()
    }

    /// The names of the mounted segments (several clients may share one: their engine).
    pub fn mounted_names(&self) -> std::collections::HashSet<&str> {
        self.segments
            .values()
            .map(|s| s.seg.name.as_str())
            .collect()
    }
}
