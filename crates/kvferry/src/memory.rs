//! Registered memory: the only ranges a peer may read or write.
//!
//! Every remote access is checked against this registry before a byte moves. A check hands
//! out a [`RegionGuard`]; unregistering a range first removes it (new accesses are rejected),
//! then waits until every guard on it is dropped, so memory is never touched after
//! `unregister` returns.

use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// One registered range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Region {
    pub addr: u64,
    pub len: u64,
    /// `cpu:N`, `cuda:N` or `*`.
    pub location: String,
}

impl Region {
    pub fn end(&self) -> u64 {
        self.addr + self.len
    }
}

/// Proof that `[addr, addr+len)` is registered, held while the range is accessed.
#[derive(Clone)]
pub struct RegionGuard {
    region: Arc<Region>,
}

impl RegionGuard {
    pub fn region(&self) -> &Region {
        &self.region
    }
}

/// The set of registered ranges of one engine.
#[derive(Default)]
pub struct MemoryRegistry {
    /// By start address: (registration sequence number, range).
    regions: RwLock<BTreeMap<u64, (u64, Arc<Region>)>>,
    next_seq: std::sync::atomic::AtomicU64,
}

/// Checks a location string: `*`, `cpu:N`, `cuda:N` and Mooncake's other device prefixes.
pub fn validate_location(location: &str) -> Result<()> {
    if location == "*" {
        return Ok(());
    }
    if let Some((kind, idx)) = location.split_once(':') {
        let known = ["cpu", "cuda", "npu", "musa", "hip", "maca", "segments"];
        if known.contains(&kind) && !idx.is_empty() {
            return Ok(());
        }
    }
    Err(Error::InvalidArgument(format!(
        "location {location:?} is not understood; use \"*\" (detect), \"cpu:<numa node>\" or \"cuda:<device>\""
    )))
}

impl MemoryRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers several ranges atomically: either all are added or none.
    pub fn register_batch(&self, ranges: &[(u64, u64)], location: &str) -> Result<Vec<Region>> {
        validate_location(location)?;
        let mut map = self.regions.write().unwrap_or_else(|e| e.into_inner());
        // Validate against the map and against each other before inserting anything.
        let mut sorted: Vec<(u64, u64)> = ranges.to_vec();
        sorted.sort_unstable();
        for (i, &(addr, len)) in sorted.iter().enumerate() {
            if len == 0 {
                return Err(Error::InvalidArgument(format!("cannot register 0x{addr:x} with length 0; pass the buffer's size")));
            }
            if addr == 0 {
                return Err(Error::InvalidArgument("cannot register address 0 (a null pointer)".into()));
            }
            let Some(end) = addr.checked_add(len) else {
                return Err(Error::InvalidArgument(format!("range 0x{addr:x} + {len} overflows the address space")));
            };
            if let Some(&(next, next_len)) = sorted.get(i + 1) {
                if next < end {
                    return Err(Error::Overlap { addr: next, len: next_len, other_addr: addr, other_len: len });
                }
            }
            if let Some(r) = overlapping(&map, addr, end) {
                return Err(Error::Overlap { addr, len, other_addr: r.addr, other_len: r.len });
            }
        }
        let out: Vec<Region> = ranges
            .iter()
            .map(|&(addr, len)| Region { addr, len, location: location.to_string() })
            .collect();
        for r in &out {
            let seq = self.next_seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            map.insert(r.addr, (seq, Arc::new(r.clone())));
        }
        Ok(out)
    }

    /// Removes the ranges starting at `addrs` (all or none), then waits up to `drain` for
    /// accesses in progress to finish.
    pub fn unregister_batch(&self, addrs: &[u64], drain: Duration) -> Result<Vec<Region>> {
        let removed: Vec<Arc<Region>> = {
            let mut map = self.regions.write().unwrap_or_else(|e| e.into_inner());
            if let Some(&addr) = addrs.iter().find(|a| !map.contains_key(a)) {
                return Err(Error::NotRegistered { addr });
            }
            addrs.iter().filter_map(|a| map.remove(a).map(|(_, r)| r)).collect()
        };
        let until = Instant::now() + drain;
        for r in &removed {
            // Guards hold clones of the Arc; wait until ours is the last one.
            while Arc::strong_count(r) > 1 && Instant::now() < until {
                std::thread::sleep(Duration::from_micros(200));
            }
            if Arc::strong_count(r) > 1 {
                tracing::warn!(addr = r.addr, "unregister: accesses still in progress after {drain:?}; range removed anyway");
            }
        }
        Ok(removed.iter().map(|r| (**r).clone()).collect())
    }

    /// Returns a guard if `[addr, addr+len)` lies inside one registered range.
    pub fn check(&self, addr: u64, len: u64) -> Option<RegionGuard> {
        let end = addr.checked_add(len)?;
        let map = self.regions.read().unwrap_or_else(|e| e.into_inner());
        let (_, (_, r)) = map.range(..=addr).next_back()?;
        (end <= r.end()).then(|| RegionGuard { region: Arc::clone(r) })
    }

    /// All registered ranges, in registration order (as Mooncake lists them in a segment
    /// descriptor: `get_first_buffer_address` is the oldest registered buffer).
    pub fn snapshot(&self) -> Vec<Region> {
        let map = self.regions.read().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<&(u64, Arc<Region>)> = map.values().collect();
        v.sort_unstable_by_key(|(seq, _)| *seq);
        v.into_iter().map(|(_, r)| (**r).clone()).collect()
    }
}

fn overlapping(map: &BTreeMap<u64, (u64, Arc<Region>)>, addr: u64, end: u64) -> Option<Arc<Region>> {
    if let Some((_, (_, r))) = map.range(..end).next_back() {
        if r.end() > addr {
            return Some(Arc::clone(r));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn register_check_unregister() {
        let m = MemoryRegistry::new();
        m.register_batch(&[(0x1000, 0x1000), (0x3000, 0x100)], "cpu:0").unwrap();
        assert!(m.check(0x1000, 0x1000).is_some());
        assert!(m.check(0x1fff, 1).is_some());
        assert!(m.check(0x1fff, 2).is_none(), "crosses the end");
        assert!(m.check(0x2000, 1).is_none(), "gap");
        assert!(m.check(0xfff, 2).is_none(), "starts before");
        assert!(m.check(u64::MAX, 1).is_none());
        assert!(matches!(m.register_batch(&[(0x1800, 0x1000)], "*"), Err(Error::Overlap { .. })));
        assert!(matches!(m.register_batch(&[(0x2f00, 0x200)], "*"), Err(Error::Overlap { .. })));
        assert!(matches!(m.register_batch(&[(0x5000, 0)], "*"), Err(Error::InvalidArgument(_))));
        assert!(matches!(m.register_batch(&[(0x5000, 16), (0x5008, 16)], "*"), Err(Error::Overlap { .. })));
        assert!(m.check(0x5000, 1).is_none(), "failed batch registered nothing");
        assert!(m.register_batch(&[(0x5000, 16)], "gpu").is_err(), "bad location");
        assert!(matches!(m.unregister_batch(&[0x1001], Duration::ZERO), Err(Error::NotRegistered { .. })));
        m.unregister_batch(&[0x1000], Duration::ZERO).unwrap();
        assert!(m.check(0x1000, 1).is_none());
        assert_eq!(m.snapshot().len(), 1);
    }

    #[test]
    fn unregister_waits_for_guards() {
        let m = Arc::new(MemoryRegistry::new());
        m.register_batch(&[(0x1000, 0x1000)], "*").unwrap();
        let g = m.check(0x1000, 8).unwrap();
        let m2 = Arc::clone(&m);
        let t = std::thread::spawn(move || {
            let start = Instant::now();
            m2.unregister_batch(&[0x1000], Duration::from_secs(5)).unwrap();
            start.elapsed()
        });
        std::thread::sleep(Duration::from_millis(50));
        drop(g);
        let waited = t.join().unwrap();
        assert!(waited >= Duration::from_millis(40), "unregister returned while a guard was held");
    }
}
