//! Space inside one mounted segment: best-fit over free ranges, coalesced on free.
//!
//! Why not the `offset-allocator` crate (Mooncake's choice, in C++): it reserves its node
//! table for a fixed maximum number of live allocations up front (128 Ki by default), so a
//! segment holding millions of small KV blocks needs hundreds of MiB of master memory before
//! the first put (Mooncake issue #1167), and the default limit silently refuses the 128 Ki+1st
//! object. Here memory grows with the number of *free ranges* only; each allocation costs
//! nothing beyond the replica record that names it. Allocation and free are O(log n).

use std::collections::{BTreeMap, BTreeSet};

/// Allocation granularity (and alignment): one cache line.
const ALIGN: u64 = 64;

/// Allocator over `[base, base + size)` of one segment.
pub struct SegmentSpace {
    base: u64,
    size: u64,
    used: u64,
    /// Free ranges: offset -> length.
    by_addr: BTreeMap<u64, u64>,
    /// Free ranges ordered by (length, offset), for best fit.
    by_size: BTreeSet<(u64, u64)>,
}

/// One allocated range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    pub addr: u64,
    pub len: u64,
    /// Bytes actually reserved (`len` rounded up to the granularity).
    cap: u64,
}

/// The bytes a block of `len` takes: `len` rounded up to the granularity (`None`: beyond
/// any address).
pub fn cap_of(len: u64) -> Option<u64> {
    len.max(1).checked_next_multiple_of(ALIGN)
}

impl Block {
    /// A block of no space (its segment is gone) that [`SegmentSpace::reserve`] would give
    /// for `addr`, `len` once the segment is back.
    pub fn held(addr: u64, len: u64) -> Block {
        Block {
            addr,
            len,
            cap: cap_of(len).unwrap_or(len),
        }
    }

    /// Bytes it takes in its segment (`len` rounded up to the granularity).
    pub fn cap(&self) -> u64 {
        self.cap
    }
}

impl SegmentSpace {
    pub fn new(base: u64, size: u64) -> SegmentSpace {
        let usable = size / ALIGN * ALIGN;
        let mut s = SegmentSpace {
            base,
            size,
            used: 0,
            by_addr: BTreeMap::new(),
            by_size: BTreeSet::new(),
        };
        if usable > 0 {
            s.insert_free(0, usable);
        }
        s
    }

    fn insert_free(&mut self, off: u64, len: u64) {
        self.by_addr.insert(off, len);
        self.by_size.insert((len, off));
    }

    fn remove_free(&mut self, off: u64, len: u64) {
        self.by_addr.remove(&off);
        self.by_size.remove(&(len, off));
    }

    pub fn base(&self) -> u64 {
        self.base
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn used(&self) -> u64 {
        self.used
    }

    pub fn free_ratio(&self) -> f64 {
        if self.size == 0 {
            return 0.0;
        }
        1.0 - self.used as f64 / self.size as f64
    }

    /// Allocates `len` bytes, or `None` if no free range is large enough.
    pub fn allocate(&mut self, len: u64) -> Option<Block> {
        let cap = cap_of(len)?;
        let &(flen, off) = self.by_size.range((cap, 0)..).next()?;
        self.remove_free(off, flen);
        if flen > cap {
            self.insert_free(off + cap, flen - cap);
        }
        self.used += cap;
        Some(Block {
            addr: self.base + off,
            len,
            cap,
        })
    }

    /// Takes exactly `[addr, addr + len)` (rounded up to the granularity), as a block that
    /// [`SegmentSpace::allocate`] handed out once, when it lies wholly inside one free range:
    /// how a new HA leader rebuilds the space of replicas named by the journal. `None` (nothing
    /// taken) when the range is misaligned, outside the segment or overlaps used space.
    pub fn reserve(&mut self, addr: u64, len: u64) -> Option<Block> {
        let cap = cap_of(len)?;
        let off = addr.checked_sub(self.base)?;
        if off % ALIGN != 0 {
            return None;
        }
        let (&foff, &flen) = self.by_addr.range(..=off).next_back()?;
        let end = off.checked_add(cap)?;
        if end > foff + flen {
            return None;
        }
        self.remove_free(foff, flen);
        if off > foff {
            self.insert_free(foff, off - foff);
        }
        if foff + flen > end {
            self.insert_free(end, foff + flen - end);
        }
        self.used += cap;
        Some(Block { addr, len, cap })
    }

    /// Takes every free range, as blocks (a segment held whole: see `State::remount`).
    pub fn take_all(&mut self) -> Vec<Block> {
        let ranges: Vec<(u64, u64)> = self.by_addr.iter().map(|(&off, &len)| (off, len)).collect();
        ranges
            .into_iter()
            .filter_map(|(off, len)| self.reserve(self.base + off, len))
            .collect()
    }

    /// Returns a block; neighbouring free ranges merge.
    pub fn free(&mut self, b: Block) {
        let mut off = b.addr - self.base;
        let mut len = b.cap;
        self.used = self.used.saturating_sub(b.cap);
        if let Some((&poff, &plen)) = self.by_addr.range(..off).next_back() {
            if poff + plen == off {
                self.remove_free(poff, plen);
                off = poff;
                len += plen;
            }
        }
        if let Some(&nlen) = self.by_addr.get(&(off + len)) {
            self.remove_free(off + len, nlen);
            len += nlen;
        }
        self.insert_free(off, len);
    }

    /// Returns many blocks at once, as [`SegmentSpace::free`] of each would leave the space:
    /// blocks that lie side by side are joined first, so returning most of a segment (a
    /// `RemoveAll`, objects freed in no particular order) costs a few free-range updates
    /// instead of several per block. The blocks must be this space's and distinct.
    pub fn free_many(&mut self, mut blocks: Vec<Block>) {
        blocks.sort_unstable_by_key(|b| b.addr);
        let mut run: Option<Block> = None;
        for b in blocks {
            match &mut run {
                Some(r) if r.addr + r.cap == b.addr => r.cap += b.cap,
                _ => {
                    if let Some(r) = run.replace(b) {
                        self.free(r);
                    }
                }
            }
        }
        if let Some(r) = run {
            self.free(r);
        }
    }

    /// The free bytes of `[addr, end)`, as `(address, length)` ranges in address order: what
    /// a new HA leader holds of a pool its predecessor granted ([`super::State`]'s grants)
    /// once every replica it knows was reserved.
    pub fn free_within(&self, addr: u64, end: u64) -> Vec<(u64, u64)> {
        let (Some(lo), hi) = (addr.checked_sub(self.base), end.saturating_sub(self.base)) else {
            // (Starts before the segment: only the part inside it can be free.)
            return if end > self.base {
                self.free_within(self.base, end)
            } else {
                Vec::new()
            };
        };
        let mut out = Vec::new();
        let first = self
            .by_addr
            .range(..=lo)
            .next_back()
            .map(|(&o, _)| o)
            .unwrap_or(lo);
        for (&off, &len) in self.by_addr.range(first..hi) {
            let (s, e) = (off.max(lo), (off + len).min(hi));
            if s < e {
                out.push((self.base + s, e - s));
            }
        }
        out
    }

    /// Takes the free ranges of `pool` (a sub-space over a block this space handed out, whose
    /// own blocks are freed here, not to it) back: the pool's unused part is free here again.
    pub fn give_back(&mut self, pool: &SegmentSpace) {
        let ranges: Vec<(u64, u64)> = pool
            .by_addr
            .iter()
            .map(|(&off, &len)| (pool.base + off, len))
            .collect();
        for (addr, len) in ranges {
            self.free(Block {
                addr,
                len,
                cap: len,
            });
        }
    }

    /// Number of free ranges (fragmentation).
    pub fn free_ranges(&self) -> usize {
        self.by_addr.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_free_and_bounds() {
        let mut s = SegmentSpace::new(0x10000, 1 << 20);
        let a = s.allocate(1000).unwrap();
        let b = s.allocate(4096).unwrap();
        assert!(a.addr >= 0x10000 && a.addr + 1000 <= b.addr || b.addr + 4096 <= a.addr);
        assert!(s.used() >= 5096);
        assert!(s.allocate(2 << 20).is_none(), "larger than the segment");
        s.free(a);
        s.free(b);
        assert_eq!(s.used(), 0);
        let mut blocks = Vec::new();
        while let Some(b) = s.allocate(64 << 10) {
            assert!(b.addr + b.len <= 0x10000 + (1 << 20));
            blocks.push(b);
        }
        assert_eq!(blocks.len(), 16, "the segment fills exactly");
        assert_eq!(s.free_ranges(), 0, "full");
        for b in blocks.drain(..).rev() {
            s.free(b);
        }
        assert_eq!(s.free_ranges(), 1, "frees coalesce back into one range");
        assert_eq!(s.used(), 0);
    }
}

#[cfg(test)]
mod reserve_tests {
    use super::*;

    #[test]
    fn reserve_takes_exactly_the_free_blocks_named_and_nothing_used() {
        let mut a = SegmentSpace::new(0x10000, 1 << 20);
        let blocks: Vec<Block> = (0..5)
            .map(|i| a.allocate(1000 * (i + 1)).unwrap())
            .collect();
        // A second space rebuilt from the blocks' (addr, len) ends up identical.
        let mut b = SegmentSpace::new(0x10000, 1 << 20);
        for x in &blocks {
            assert_eq!(b.reserve(x.addr, x.len), Some(*x));
        }
        assert_eq!((b.used(), b.free_ranges()), (a.used(), a.free_ranges()));
        assert_eq!(
            b.allocate(4096),
            a.allocate(4096),
            "the same next allocation"
        );
        // Used, overlapping, misaligned or outside: refused, nothing changes.
        let used = b.used();
        assert_eq!(b.reserve(blocks[1].addr, 10), None);
        assert_eq!(b.reserve(blocks[1].addr - 64, 128), None);
        assert_eq!(b.reserve(blocks[4].addr + blocks[4].len + 1, 64), None);
        assert_eq!(b.reserve(0x100, 64), None);
        assert_eq!(b.reserve(0x10000 + (1 << 20) - 64, 128), None);
        assert_eq!(b.used(), used);
        // Freed, the space is reservable again and coalesces.
        b.free(blocks[2]);
        assert!(b.reserve(blocks[2].addr, blocks[2].len).is_some());
        for x in blocks {
            b.free(x);
        }
        assert!(b.used() > 0, "the extra allocation remains");
    }
}

#[cfg(test)]
mod frag_tests {
    use super::*;

    #[test]
    fn a_pool_carved_from_a_space_hands_out_its_blocks_and_gives_the_rest_back() {
        let mut s = SegmentSpace::new(0x10000, 1 << 20);
        let carved = s.allocate(64 << 10).unwrap();
        let mut pool = SegmentSpace::new(carved.addr, carved.cap());
        let a = pool.allocate(1000).unwrap();
        let b = pool.allocate(4096).unwrap();
        assert!(
            a.addr >= carved.addr && b.addr + 4096 <= carved.addr + (64 << 10),
            "the pool's blocks lie in what was carved"
        );
        assert_eq!(
            s.free_within(carved.addr, carved.addr + carved.cap()),
            vec![],
            "carved space is not free in the segment's space"
        );
        s.give_back(&pool);
        let free = s.free_within(carved.addr, carved.addr + carved.cap());
        let held: u64 = a.cap() + b.cap();
        assert_eq!(
            free.iter().map(|r| r.1).sum::<u64>(),
            (64 << 10) - held,
            "the pool's unused part is free again"
        );
        let overlaps =
            |&(at, len): &(u64, u64), x: &Block| at < x.addr + x.cap() && x.addr < at + len;
        assert!(
            free.iter().all(|r| !overlaps(r, &a) && !overlaps(r, &b)),
            "not the blocks handed out: {free:?}"
        );
        // Blocks handed out by the pool are freed to the segment's space.
        s.free(a);
        s.free(b);
        assert_eq!(s.used(), 0);
        assert_eq!(s.free_ranges(), 1);
        assert_eq!(s.free_within(0, u64::MAX), vec![(0x10000, 1 << 20)]);
        assert_eq!(
            s.free_within(0x10000 + 100 * 64, 0x10000 + 101 * 64),
            vec![(0x10000 + 100 * 64, 64)],
            "clipped to the range asked"
        );
    }

    #[test]
    fn mixed_sizes_then_large_blocks_fit() {
        let mut s = SegmentSpace::new(1 << 30, 1 << 30);
        for size in [4u64 << 10, 64 << 10, 1 << 20] {
            let mut v = Vec::new();
            while s.used() < (1 << 30) / 4 {
                v.push(s.allocate(size).expect("room"));
            }
            for b in v {
                s.free(b);
            }
        }
        assert_eq!(s.used(), 0);
        let mut n = 0;
        while s.allocate(16 << 20).is_some() {
            n += 1;
        }
        assert_eq!(
            n, 64,
            "after mixed use and frees, 16 MiB blocks fill the segment"
        );
    }

    #[test]
    fn millions_of_small_blocks_need_no_reservation() {
        let mut s = SegmentSpace::new(0, 1 << 40);
        let blocks: Vec<Block> = (0..1_000_000)
            .map(|_| s.allocate(4096).expect("room"))
            .collect();
        assert_eq!(s.used(), 4096 * 1_000_000);
        assert_eq!(s.free_ranges(), 1);
        for b in blocks.iter().step_by(2) {
            s.free(*b);
        }
        assert_eq!(s.free_ranges(), 500_001);
        for b in blocks.iter().skip(1).step_by(2) {
            s.free(*b);
        }
        assert_eq!(s.free_ranges(), 1);
    }

    /// The free ranges and bytes used: what two spaces must agree on.
    fn shape(s: &SegmentSpace) -> (u64, Vec<(u64, u64)>, usize) {
        (
            s.used(),
            s.by_addr.iter().map(|(&o, &l)| (o, l)).collect(),
            s.by_size.len(),
        )
    }

    proptest::proptest! {
        #[test]
        fn freeing_many_at_once_leaves_the_space_as_freeing_each(sizes in proptest::collection::vec(1u64..20_000, 1..200), pick in proptest::collection::vec(proptest::prelude::any::<bool>(), 200), order in proptest::prelude::any::<u64>()) {
            let mut one = SegmentSpace::new(1 << 20, 4 << 20);
            let blocks: Vec<Block> = sizes.iter().filter_map(|&n| one.allocate(n)).collect();
            // Some of them freed first (holes), the rest freed at once in a scrambled order.
            for (b, _) in blocks.iter().zip(&pick).filter(|(_, &p)| p) {
                one.free(*b);
            }
            let mut rest: Vec<Block> = blocks.iter().zip(&pick).filter(|(_, &p)| !p).map(|(b, _)| *b).collect();
            let n = rest.len().max(1);
            rest.rotate_left((order as usize) % n);
            let mut many = SegmentSpace::new(1 << 20, 4 << 20);
            for n in &sizes {
                many.allocate(*n);
            }
            for (b, _) in blocks.iter().zip(&pick).filter(|(_, &p)| p) {
                many.free(*b);
            }
            for b in &rest {
                one.free(*b);
            }
            many.free_many(rest);
            proptest::prop_assert_eq!(shape(&one), shape(&many));
        }
    }

    #[test]
    fn a_whole_segment_freed_at_once_is_one_range_again_in_few_updates() {
        let mut s = SegmentSpace::new(0, 1 << 30);
        let mut blocks: Vec<Block> = (0..100_000)
            .map(|i| s.allocate(1000 + (i % 7) * 500).expect("room"))
            .collect();
        // In no particular order (as a hash map hands objects out).
        blocks.sort_unstable_by_key(|b| b.addr.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        s.free_many(blocks);
        assert_eq!((s.used(), s.free_ranges()), (0, 1));
    }
}
