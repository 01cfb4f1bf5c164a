//! The state machine's placement and eviction: where a put's replicas go (preferred segments,
//! then by [`Strategy`]), space granted ahead to puts (an HA leader's), and eviction.

use super::{Replica, State, Stats, Strategy};
use crate::proto::ReplicateConfig;
use std::sync::atomic::Ordering;

impl State {
    pub(super) fn place(
        &mut self,
        size: u64,
        cfg: &ReplicateConfig,
        strategy: Strategy,
        now: u64,
    ) -> Vec<Replica> {
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
                    v.sort_by(|a, b| {
                        self.segments[b]
                            .space
                            .free_ratio()
                            .total_cmp(&self.segments[a].space.free_ratio())
                    });
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
    /// `JournalCore::grants_durable`; set before placing puts, `server/handlers.rs`).
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
    pub(super) fn return_pools(&mut self) -> bool {
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
    pub fn evict_aged(
        &mut self,
        target: u64,
        now: u64,
        allow_soft: bool,
        stats: &Stats,
        min_age: u64,
    ) -> u64 {
        self.evict_inner(target, now, allow_soft, stats, min_age, false)
    }

    /// The background (watermark) eviction: like [`State::evict_aged`], but with offload on
    /// ([`State::set_offload`]) a victim with a replica on the segment of a client with a
    /// disk is handed to that disk instead of dropped, its bytes counted as freed though they
    /// come back only once the client reports it persisted (`offload`). A put that needs
    /// space now evicts this way too until its last try, which drops (`puts`).
    pub fn evict_background(
        &mut self,
        target: u64,
        now: u64,
        allow_soft: bool,
        stats: &Stats,
        min_age: u64,
    ) -> u64 {
        self.evict_inner(target, now, allow_soft, stats, min_age, true)
    }

    fn evict_inner(
        &mut self,
        target: u64,
        now: u64,
        allow_soft: bool,
        stats: &Stats,
        min_age: u64,
        offload: bool,
    ) -> u64 {
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
                        let mut v = self
                            .groups
                            .get(g)
                            .map(|g| g.members.clone())
                            .unwrap_or_default();
                        if !v.contains(&key) {
                            v.push(key);
                        }
                        v
                    }
                    None => vec![key],
                };
                for v in victims {
                    let eligible = self
                        .objects
                        .get(&v)
                        .is_some_and(|o| o.evictable(&self.reads, now, min_age, pass == 1));
                    if !eligible {
                        continue;
                    }
                    if offload {
                        if let Some(bytes) = self.try_offload(&v, now) {
                            freed += bytes;
                            continue;
                        }
                    }
                    // An object with a disk copy keeps it: only its memory replicas go.
                    if let Some(o) = self.objects.get_mut(&v).filter(|o| o.disk.is_some()) {
                        let gone = std::mem::take(&mut o.current);
                        let size = o.size;
                        self.mark_key(&v);
                        for r in gone.iter() {
                            freed += r.block.len;
                            self.free_now(*r);
                        }
                        stats.evicted_objects.fetch_add(1, Ordering::Relaxed);
                        stats.evicted_bytes.fetch_add(size, Ordering::Relaxed);
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
}
