//! The state machine's reads and removals of objects: read leases and reads in flight,
//! existence checks, removals one by one or in bulk, and clearing replicas by segment.

use super::{check_key, read_live, MasterConfig, Object, Removed, Replica, State};
use crate::error::{StoreError, StoreResult};
use crate::proto::{DiskReplicaList, ReplicaList, Response};

impl State {
    pub(super) fn touch(&mut self, key: &str, now: u64, lease: u64) -> StoreResult<()> {
        let o = self
            .objects
            .get_mut(key)
            .ok_or_else(|| StoreError::ObjectNotFound(key.to_string()))?;
        if !o.readable() {
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

    pub fn get_replica_list(
        &mut self,
        key: &str,
        now: u64,
        lease: u64,
    ) -> StoreResult<ReplicaList> {
        check_key(key)?;
        self.touch(key, now, lease)?;
        self.next_read += 1;
        let read_id = self.next_read;
        self.reads.insert(read_id, now + lease);
        let reads = &self.reads;
        let Some(o) = self.objects.get_mut(key) else {
            return Err(StoreError::ObjectNotFound(key.to_string()));
        };
        // Finished reads are pruned when the list reaches a power of two, not at every read:
        // n reads of one key in flight at once cost O(n) in all, not O(n²).
        if o.reads.len() >= 8 && o.reads.len().is_power_of_two() {
            o.reads.retain(|id| read_live(reads, *id, now));
        }
        o.reads.push(read_id);
        let Some(o) = self.objects.get(key) else {
            return Err(StoreError::ObjectNotFound(key.to_string()));
        };
        Ok(ReplicaList {
            replicas: o.current.iter().filter_map(|r| self.desc(r)).collect(),
            size: o.size,
            lease_ttl_ms: lease,
            read_id,
        })
    }

    /// `GetReplicaList`'s answer: the memory replicas ([`State::get_replica_list`]), or, when
    /// none is left, the copy on a disk (Mooncake's order: memory first), under the same read
    /// lease. The memory path looks the key up no more often than `get_replica_list` alone.
    pub fn locate(&mut self, key: &str, now: u64, lease: u64) -> StoreResult<Response> {
        let list = self.get_replica_list(key, now, lease)?;
        if !list.replicas.is_empty() {
            return Ok(Response::ReplicaList(list));
        }
        match self
            .objects
            .get(key)
            .and_then(|o| o.disk.map(|d| (d, o.size)))
        {
            Some((d, size)) => Ok(Response::DiskReplica(DiskReplicaList {
                disk: self.disk_desc(&d, size),
                size,
                lease_ttl_ms: lease,
                read_id: list.read_id,
            })),
            None => Ok(Response::ReplicaList(list)),
        }
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

    /// Whether `key` is readable now, touching nothing: no lease, no access time (Mooncake
    /// 0.3.14's `probe_key`).
    pub fn probe_key(&self, key: &str) -> StoreResult<bool> {
        check_key(key)?;
        Ok(self.objects.get(key).is_some_and(|o| o.readable()))
    }

    pub fn remove(
        &mut self,
        m: &MasterConfig,
        key: &str,
        force: bool,
        now: u64,
    ) -> StoreResult<()> {
        check_key(key)?;
        let o = self
            .objects
            .get(key)
            .ok_or_else(|| StoreError::ObjectNotFound(key.to_string()))?;
        if !force {
            if o.leased(&self.groups, now) {
                return Err(StoreError::ObjectHasLease(key.to_string()));
            }
            if o.pending.is_some() {
                return Err(StoreError::ReplicaNotReady(key.to_string()));
            }
        }
        let Some(o) = self.forget(key) else {
            return Err(StoreError::ObjectNotFound(key.to_string()));
        };
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
    pub(super) fn release_space(
        &mut self,
        m: &MasterConfig,
        o: &Object,
        now: u64,
        free: &mut Vec<Replica>,
    ) {
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

    /// Frees replicas at once, each segment's together ([`super::alloc::SegmentSpace::free_many`]).
    pub(super) fn free_all_now(&mut self, mut free: Vec<Replica>) {
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
    pub fn batch_replica_clear(
        &mut self,
        client: u64,
        keys: &[String],
        segment: &str,
        now: u64,
    ) -> Vec<String> {
        let mut cleared = Vec::new();
        for key in keys {
            let Some(o) = self.objects.get(key.as_str()) else {
                continue;
            };
            if o.owner != client || o.leased(&self.groups, now) || o.current.is_empty() {
                continue;
            }
            let on_seg = |r: &Replica| {
                self.segments
                    .get(&r.seg)
                    .is_some_and(|s| s.seg.name == segment || s.seg.te_endpoint == segment)
            };
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
    /// while journaling); their space is freed per segment at once ([`super::alloc::SegmentSpace::free_many`]), their keys are marked without
    /// hashing (`State::mark_keys_owned`) and their groups pruned once at the end. It holds the state's lock for
    /// up to every object of the pool (`RemoveAll`), so each removal must stay cheap.
    pub fn remove_matching(
        &mut self,
        m: &MasterConfig,
        pred: impl Fn(&str) -> bool,
        force: bool,
        now: u64,
    ) -> Removed {
        // (`retain`, as `HashMap::extract_if` needs a newer Rust than this crate's minimum:
        // the object moves out, only the key is copied.)
        let journaling = self.journaling();
        let (mut gone, mut keys, mut disk_keys) = (Vec::new(), Vec::new(), Vec::new());
        let groups = &self.groups;
        self.objects.retain(|k, o| {
            if !(pred(k) && (force || (!o.leased(groups, now) && o.pending.is_none()))) {
                return true;
            }
            disk_keys.push(o.disk.map(|_| k.clone()));
            gone.push(std::mem::take(o));
            if journaling {
                keys.push(k.clone());
            }
            false
        });
        let (mut grouped, mut free) = (Vec::new(), Vec::with_capacity(gone.len()));
        for (o, k) in gone.iter().zip(&disk_keys) {
            if let (Some(d), Some(k)) = (o.disk, k) {
                self.drop_on_disk(k, d.disk);
            }
        }
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
