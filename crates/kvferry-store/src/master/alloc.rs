//! Space inside one mounted segment: Sebastian Aaltonen's O(1) offset allocator
//! (`offset-allocator` crate) over granules, so segments larger than 4 GiB fit its u32 units.

use offset_allocator::{Allocation, Allocator};

/// Allocator over `[base, base + size)` of one segment.
pub struct SegmentSpace {
    alloc: Allocator,
    base: u64,
    size: u64,
    /// log2 of the granule in bytes (64 B for segments up to 128 GiB).
    shift: u32,
    used: u64,
}

/// One allocated range.
#[derive(Clone, Copy)]
pub struct Block {
    pub addr: u64,
    pub len: u64,
    handle: Allocation,
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Block({:#x}, {})", self.addr, self.len)
    }
}

impl PartialEq for Block {
    fn eq(&self, o: &Block) -> bool {
        self.addr == o.addr && self.len == o.len
    }
}

impl Eq for Block {}

impl SegmentSpace {
    pub fn new(base: u64, size: u64) -> SegmentSpace {
        // Granules must number below 2^31 for the allocator's u32 arithmetic.
        let mut shift = 6;
        while (size >> shift) >= (1u64 << 31) {
            shift += 1;
        }
        let units = (size >> shift).max(1) as u32;
        SegmentSpace { alloc: Allocator::new(units), base, size, shift, used: 0 }
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

    /// Allocates `len` bytes (rounded up to the granule), or `None` if no free range fits.
    pub fn allocate(&mut self, len: u64) -> Option<Block> {
        let units = len.div_ceil(1 << self.shift).max(1);
        let units = u32::try_from(units).ok()?;
        let handle = self.alloc.allocate(units)?;
        let addr = self.base + (u64::from(handle.offset) << self.shift);
        let rounded = u64::from(units) << self.shift;
        if addr + len > self.base + self.size {
            // The last granule may extend past a size that is not a granule multiple.
            self.alloc.free(handle);
            return None;
        }
        self.used += rounded;
        Some(Block { addr, len, handle })
    }

    pub fn free(&mut self, b: Block) {
        let units = b.len.div_ceil(1 << self.shift).max(1);
        self.used = self.used.saturating_sub(units << self.shift);
        self.alloc.free(b.handle);
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
        let big = SegmentSpace::new(1 << 40, 300 << 30);
        assert!(big.shift > 6, "granule grows for a 300 GiB segment");
    }
}

#[cfg(test)]
mod frag_tests {
    use super::*;

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
        while let Some(_) = s.allocate(16 << 20) {
            n += 1;
        }
        assert!(n >= 56, "after mixed use and frees, 16 MiB blocks still fill the segment (got {n} of 64)");
    }
}
