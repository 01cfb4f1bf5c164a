//! Replicas whose space is freed later: once every read given them has ended (a forced
//! remove or an upsert of an object being read), or at a time (the replicas of a write in
//! progress whose object went, held until its writer can no longer write; space a reader of
//! an earlier leader may still read).
//!
//! Indexed both ways, so that a read's end touches only the frees that wait for it and the
//! clock's advance only those that are due: every `ReleaseReads` (piggybacked on most of a
//! client's requests) walked the whole list under the state's lock before.

use super::Replica;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};

struct Deferred {
    replica: Replica,
    /// Reads not known to have ended yet; freed when it reaches 0 (only if it waited for
    /// reads at all: `by_reads`).
    waiting: usize,
    by_reads: bool,
    /// Freed at this time at the latest (what the journal carries, as time left).
    release_at: u64,
}

#[derive(Default)]
pub(super) struct DeferredFrees {
    next: u64,
    /// By id, which is the order they were deferred in (a snapshot lists them in it).
    all: BTreeMap<u64, Deferred>,
    /// (free at this time at the latest, id). Entries freed otherwise stay until their time
    /// comes or the heap is rebuilt ([`DeferredFrees::compact`]).
    by_time: BinaryHeap<Reverse<(u64, u64)>>,
    /// Read id -> the frees waiting for it.
    by_read: HashMap<u64, Vec<u64>>,
}

impl DeferredFrees {
    /// Frees `replica` at `release_at` at the latest, and before then as soon as every one of
    /// `reads` ended (`reads` empty: only at that time).
    pub(super) fn push(&mut self, replica: Replica, release_at: u64, reads: &[u64]) {
        let id = self.next;
        self.next += 1;
        self.all.insert(
            id,
            Deferred {
                replica,
                waiting: reads.len(),
                by_reads: !reads.is_empty(),
                release_at,
            },
        );
        self.by_time.push(Reverse((release_at, id)));
        for r in reads {
            self.by_read.entry(*r).or_default().push(id);
        }
        self.compact();
    }

    /// Read `read` ended (released by its reader, or its lease ran out): the replicas that
    /// waited for it and for nothing else go to `free`.
    pub(super) fn read_ended(&mut self, read: u64, free: &mut Vec<Replica>) {
        let Some(ids) = self.by_read.remove(&read) else {
            return;
        };
        for id in ids {
            let Some(d) = self.all.get_mut(&id) else {
                continue;
            };
            d.waiting = d.waiting.saturating_sub(1);
            if d.by_reads && d.waiting == 0 {
                free.extend(self.all.remove(&id).map(|d| d.replica));
            }
        }
    }

    /// The replicas whose time came by `now` go to `free`.
    pub(super) fn due(&mut self, now: u64, free: &mut Vec<Replica>) {
        while let Some(&Reverse((at, id))) = self.by_time.peek() {
            if at > now {
                break;
            }
            self.by_time.pop();
            free.extend(self.all.remove(&id).map(|d| d.replica));
        }
    }

    /// Keeps the frees on segment `seg` that `keep` keeps (it may take their space in a
    /// segment mounted again); the others are forgotten. Walks every free: a mount is rare.
    pub(super) fn retain_on(&mut self, seg: u64, mut keep: impl FnMut(&Replica) -> bool) {
        let before = self.all.len();
        self.all
            .retain(|_, d| d.replica.seg != seg || keep(&d.replica));
        if self.all.len() != before {
            self.compact();
        }
    }

    pub(super) fn len(&self) -> usize {
        self.all.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.all.is_empty()
    }

    /// The replicas waiting, in the order they were deferred, each with the time it is
    /// freed at the latest.
    pub(super) fn replicas(&self) -> impl Iterator<Item = (&Replica, u64)> {
        self.all.values().map(|d| (&d.replica, d.release_at))
    }

    /// Drops the index entries of frees that are gone, once they outnumber the live ones:
    /// memory stays proportional to what waits, and each entry is dropped once.
    fn compact(&mut self) {
        let live = self.all.len();
        if self.by_time.len() > 2 * live + 1024 {
            let all = &self.all;
            self.by_time.retain(|Reverse((_, id))| all.contains_key(id));
        }
        if self.by_read.len() > 2 * live + 1024 {
            let all = &self.all;
            self.by_read.retain(|_, ids| {
                ids.retain(|id| all.contains_key(id));
                !ids.is_empty()
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::master::alloc::SegmentSpace;

    /// A replica of 64 bytes at `addr` on segment `seg`.
    fn on(seg: u64, addr: u64) -> Replica {
        let mut space = SegmentSpace::new(addr, 64);
        Replica {
            seg,
            block: space.allocate(64).expect("room"),
        }
    }

    fn r(addr: u64) -> Replica {
        on(1, addr)
    }

    fn addrs(v: Vec<Replica>) -> Vec<u64> {
        v.into_iter().map(|r| r.block.addr).collect()
    }

    #[test]
    fn a_free_waits_for_all_its_reads_or_its_time_whichever_comes_first() {
        let mut d = DeferredFrees::default();
        d.push(r(0), 100, &[1, 2]);
        d.push(r(64), 50, &[2]);
        d.push(r(128), 30, &[]);
        let mut free = Vec::new();
        d.read_ended(1, &mut free);
        assert!(free.is_empty(), "read 2 still holds the first");
        d.due(29, &mut free);
        assert!(free.is_empty());
        d.due(30, &mut free);
        assert_eq!(addrs(std::mem::take(&mut free)), [128], "by time only");
        d.read_ended(2, &mut free);
        assert_eq!(
            addrs(std::mem::take(&mut free)),
            [0, 64],
            "both waited for read 2 last"
        );
        d.read_ended(2, &mut free);
        d.due(1000, &mut free);
        assert!(free.is_empty() && d.is_empty(), "each freed once");
        d.push(r(192), 10, &[3]);
        d.due(10, &mut free);
        assert_eq!(
            addrs(std::mem::take(&mut free)),
            [192],
            "its time came before its read ended"
        );
        d.read_ended(3, &mut free);
        assert!(free.is_empty());
    }

    #[test]
    fn forgotten_and_freed_entries_do_not_pile_up_in_the_indexes() {
        let mut d = DeferredFrees::default();
        let mut free = Vec::new();
        for i in 0..100_000u64 {
            d.push(r(i * 64), 1_000_000 + i, &[i]);
            d.read_ended(i, &mut free);
        }
        assert_eq!(free.len(), 100_000);
        assert!(d.is_empty());
        assert!(
            d.by_time.len() <= 1024 + 1,
            "{} time entries left for nothing waiting",
            d.by_time.len()
        );
        for i in 0..10_000u64 {
            d.push(on(2 + i % 2, i * 64), 5, &[1 << 40 | i]);
        }
        d.retain_on(2, |_| false);
        assert_eq!(d.len(), 5_000);
        assert!(d.replicas().all(|(r, at)| r.seg == 3 && at == 5));
        free.clear();
        d.due(5, &mut free);
        assert_eq!(free.len(), 5_000, "the forgotten ones are not freed");
    }
}
