//! Registered memory: the only ranges a peer may read or write.
//!
//! Every remote access is checked against this registry before a byte moves. A check hands
//! out a [`RegionGuard`], held for as long as the access may touch the range. Unregistering
//! is a barrier: it removes the range (new checks fail), marks it revoked (every holder checks
//! [`RegionGuard::is_revoked`] after each system call and stops), asks the revocation hooks to
//! interrupt holders blocked in the kernel (the TCP server shuts their connections down), then
//! waits until every guard is dropped. It never gives up waiting: a holder that is still
//! running could still touch the range. Every holder's own loop is bounded (socket timeouts,
//! deadlines), so the wait is too.

use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// Largest length a range may have (Rust slices over it must not exceed `isize::MAX`).
pub(crate) const MAX_REGION_LEN: u64 = isize::MAX as u64;

/// One registered range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Region {
    pub addr: u64,
    pub len: u64,
    /// `cpu:N`, `cuda:N` or `*`.
    pub location: String,
    /// The GPU whose device memory this is (the CUDA driver said so at registration); `None`
    /// for host memory, which the CPU may touch directly. Device memory never is: every
    /// access goes through the driver's copies (`gpu/`).
    pub gpu: Option<u32>,
}

impl Region {
    pub fn end(&self) -> u64 {
        self.addr + self.len
    }
}

/// A registered range and whether it has been withdrawn.
#[derive(Debug)]
struct Entry {
    region: Region,
    revoked: AtomicBool,
}

/// Proof that `[addr, addr+len)` is registered, held while the range is accessed.
#[derive(Clone)]
pub(crate) struct RegionGuard {
    entry: Arc<Entry>,
}

impl RegionGuard {
    pub(crate) fn region(&self) -> &Region {
        &self.entry.region
    }

    /// The range is being unregistered: stop touching it and drop the guard.
    pub(crate) fn is_revoked(&self) -> bool {
        self.entry.revoked.load(Ordering::SeqCst)
    }
}

/// Asked when a range is revoked, so holders blocked in the kernel are woken (it must not
/// block; it runs in the unregistering thread).
pub(crate) type RevokeHook = Box<dyn Fn(&Region) + Send + Sync>;

/// The set of registered ranges of one engine.
#[derive(Default)]
pub(crate) struct MemoryRegistry {
    /// By start address: (registration sequence number, range).
    regions: RwLock<BTreeMap<u64, (u64, Arc<Entry>)>>,
    next_seq: AtomicU64,
    hooks: Mutex<Vec<RevokeHook>>,
}

/// Checks a location string: `*`, `cpu:N`, `cuda:N` and Mooncake's other device prefixes.
pub(crate) fn validate_location(location: &str) -> Result<()> {
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
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Registers several ranges atomically: either all are added or none.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn register_batch(
        &self,
        ranges: &[(u64, u64)],
        location: &str,
    ) -> Result<Vec<Region>> {
        let kinds: Vec<(String, Option<u32>)> = ranges
            .iter()
            .map(|_| (location.to_string(), None))
            .collect();
        self.register_classified(ranges, location, &kinds)
    }

    /// [`MemoryRegistry::register_batch`] with each range's published location and GPU as
    /// classified by the driver (`gpu::classify`), in the order of `ranges`.
    pub(crate) fn register_classified(
        &self,
        ranges: &[(u64, u64)],
        location: &str,
        kinds: &[(String, Option<u32>)],
    ) -> Result<Vec<Region>> {
        validate_location(location)?;
        if kinds.len() != ranges.len() {
            return Err(Error::InvalidArgument(
                "one classification per range is needed".into(),
            ));
        }
        let mut map = self.regions.write().unwrap_or_else(|e| e.into_inner());
        // Validate against the map and against each other before inserting anything.
        let mut sorted: Vec<(u64, u64)> = ranges.to_vec();
        sorted.sort_unstable();
        for (i, &(addr, len)) in sorted.iter().enumerate() {
            if len == 0 {
                return Err(Error::InvalidArgument(format!(
                    "cannot register 0x{addr:x} with length 0; pass the buffer's size"
                )));
            }
            if addr == 0 {
                return Err(Error::InvalidArgument(
                    "cannot register address 0 (a null pointer)".into(),
                ));
            }
            if len > MAX_REGION_LEN {
                return Err(Error::InvalidArgument(format!(
                    "cannot register 0x{addr:x} with length {len}: longer than any buffer can be (at most {MAX_REGION_LEN} bytes); pass the buffer's size"
                )));
            }
            let Some(end) = addr.checked_add(len) else {
                return Err(Error::InvalidArgument(format!(
                    "range 0x{addr:x} + {len} overflows the address space"
                )));
            };
            if let Some(&(next, next_len)) = sorted.get(i + 1) {
                if next < end {
                    return Err(Error::Overlap {
                        addr: next,
                        len: next_len,
                        other_addr: addr,
                        other_len: len,
                    });
                }
            }
            if let Some(r) = overlapping(&map, addr, end) {
                return Err(Error::Overlap {
                    addr,
                    len,
                    other_addr: r.addr,
                    other_len: r.len,
                });
            }
        }
        let out: Vec<Region> = ranges
            .iter()
            .zip(kinds)
            .map(|(&(addr, len), (loc, gpu))| Region {
                addr,
                len,
                location: loc.clone(),
                gpu: *gpu,
            })
            .collect();
        for r in &out {
            let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
            map.insert(
                r.addr,
                (
                    seq,
                    Arc::new(Entry {
                        region: r.clone(),
                        revoked: AtomicBool::new(false),
                    }),
                ),
            );
        }
        Ok(out)
    }

    /// Installs a hook asked at every revocation (see [`RevokeHook`]).
    pub(crate) fn on_revoke(&self, hook: RevokeHook) {
        self.hooks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(hook);
    }

    /// Removes the ranges starting at `addrs` (all or none), then waits until no access is in
    /// progress on any of them (the barrier described in the module docs).
    pub(crate) fn unregister_batch(&self, addrs: &[u64]) -> Result<Vec<Region>> {
        let removed: Vec<Arc<Entry>> = {
            let mut map = self.regions.write().unwrap_or_else(|e| e.into_inner());
            if let Some(&addr) = addrs.iter().find(|a| !map.contains_key(a)) {
                return Err(Error::NotRegistered { addr });
            }
            addrs
                .iter()
                .filter_map(|a| map.remove(a).map(|(_, r)| r))
                .collect()
        };
        self.revoke(&removed);
        Ok(removed.iter().map(|r| r.region.clone()).collect())
    }

    /// Unregisters everything (engine shutdown) with the same barrier.
    pub(crate) fn unregister_all(&self) -> Vec<Region> {
        let removed: Vec<Arc<Entry>> = {
            let mut map = self.regions.write().unwrap_or_else(|e| e.into_inner());
            std::mem::take(&mut *map)
                .into_values()
                .map(|(_, r)| r)
                .collect()
        };
        self.revoke(&removed);
        removed.iter().map(|r| r.region.clone()).collect()
    }

    /// Marks `entries` revoked, wakes their holders and waits until none is left.
    fn revoke(&self, entries: &[Arc<Entry>]) {
        for e in entries {
            e.revoked.store(true, Ordering::SeqCst);
        }
        {
            let hooks = self.hooks.lock().unwrap_or_else(|e| e.into_inner());
            for e in entries {
                for h in hooks.iter() {
                    h(&e.region);
                }
            }
        }
        let start = Instant::now();
        let mut warned = start;
        for e in entries {
            // Guards hold clones of the Arc; wait until ours is the last one.
            let mut pause = Duration::from_micros(20);
            while Arc::strong_count(e) > 1 {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(2));
                if warned.elapsed() >= Duration::from_secs(5) {
                    warned = Instant::now();
                    tracing::warn!(
                        addr = e.region.addr,
                        "unregister: {} access(es) still in progress after {:?}; waiting for them to stop",
                        Arc::strong_count(e) - 1,
                        start.elapsed()
                    );
                }
            }
        }
    }

    /// Returns a guard if `[addr, addr+len)` lies inside one registered range.
    pub(crate) fn check(&self, addr: u64, len: u64) -> Option<RegionGuard> {
        let end = addr.checked_add(len)?;
        let map = self.regions.read().unwrap_or_else(|e| e.into_inner());
        let (_, (_, r)) = map.range(..=addr).next_back()?;
        (end <= r.region.end()).then(|| RegionGuard {
            entry: Arc::clone(r),
        })
    }

    /// All registered ranges, in registration order (as Mooncake lists them in a segment
    /// descriptor: `get_first_buffer_address` is the oldest registered buffer).
    pub(crate) fn snapshot(&self) -> Vec<Region> {
        let map = self.regions.read().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<&(u64, Arc<Entry>)> = map.values().collect();
        v.sort_unstable_by_key(|(seq, _)| *seq);
        v.into_iter().map(|(_, r)| r.region.clone()).collect()
    }
}

fn overlapping(map: &BTreeMap<u64, (u64, Arc<Entry>)>, addr: u64, end: u64) -> Option<Region> {
    if let Some((_, (_, r))) = map.range(..end).next_back() {
        if r.region.end() > addr {
            return Some(r.region.clone());
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
        m.register_batch(&[(0x1000, 0x1000), (0x3000, 0x100)], "cpu:0")
            .unwrap();
        assert!(m.check(0x1000, 0x1000).is_some());
        assert!(m.check(0x1fff, 1).is_some());
        assert!(m.check(0x1fff, 2).is_none(), "crosses the end");
        assert!(m.check(0x2000, 1).is_none(), "gap");
        assert!(m.check(0xfff, 2).is_none(), "starts before");
        assert!(m.check(u64::MAX, 1).is_none());
        assert!(matches!(
            m.register_batch(&[(0x1800, 0x1000)], "*"),
            Err(Error::Overlap { .. })
        ));
        assert!(matches!(
            m.register_batch(&[(0x2f00, 0x200)], "*"),
            Err(Error::Overlap { .. })
        ));
        assert!(matches!(
            m.register_batch(&[(0x5000, 0)], "*"),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            m.register_batch(&[(0x5000, 16), (0x5008, 16)], "*"),
            Err(Error::Overlap { .. })
        ));
        assert!(
            m.check(0x5000, 1).is_none(),
            "failed batch registered nothing"
        );
        assert!(
            m.register_batch(&[(0x5000, 16)], "gpu").is_err(),
            "bad location"
        );
        assert!(matches!(
            m.unregister_batch(&[0x1001]),
            Err(Error::NotRegistered { .. })
        ));
        m.unregister_batch(&[0x1000]).unwrap();
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
            m2.unregister_batch(&[0x1000]).unwrap();
            start.elapsed()
        });
        // The holder sees the revocation, then lets go; unregister returns only after that.
        let seen = Instant::now();
        while !g.is_revoked() {
            assert!(seen.elapsed() < Duration::from_secs(5), "never revoked");
            std::thread::yield_now();
        }
        assert!(
            m.check(0x1000, 8).is_none(),
            "a revoked range hands out no new guard"
        );
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            !t.is_finished(),
            "unregister returned while a guard was held"
        );
        drop(g);
        let waited = t.join().unwrap();
        assert!(
            waited >= Duration::from_millis(250),
            "unregister returned while a guard was held"
        );
    }

    #[test]
    fn unregister_never_gives_up_and_hooks_run() {
        // A holder that lets go only after 1.5 s: the
        // barrier still waits, and the hook saw the revocation at once.
        let m = Arc::new(MemoryRegistry::new());
        let hooked = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let h = Arc::clone(&hooked);
        m.on_revoke(Box::new(move |r: &Region| {
            h.store(r.addr, Ordering::SeqCst)
        }));
        m.register_batch(&[(0x1000, 0x1000), (0x4000, 0x10)], "*")
            .unwrap();
        let g = m.check(0x1800, 8).unwrap();
        let holder = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(1500));
            drop(g);
        });
        let start = Instant::now();
        let all = m.unregister_all();
        assert!(
            start.elapsed() >= Duration::from_millis(1400),
            "returned after {:?}",
            start.elapsed()
        );
        assert_eq!(all.len(), 2);
        assert_ne!(hooked.load(Ordering::SeqCst), 0);
        holder.join().unwrap();
    }

    #[test]
    fn lengths_beyond_isize_are_refused() {
        let m = MemoryRegistry::new();
        let e = m
            .register_batch(&[(0x1000, MAX_REGION_LEN + 1)], "*")
            .unwrap_err();
        assert!(e.to_string().contains("longer than any buffer"), "{e}");
        assert!(m.check(0x1000, 1).is_none());
    }
}
