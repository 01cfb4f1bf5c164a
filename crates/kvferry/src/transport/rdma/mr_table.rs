//! The memory regions of each registered range (sans-IO: generic over what a registration
//! holds, so its rules are tested without NICs).
//!
//! The rule: once [`MrTable::withdraw`] returned, nothing registered for that range is left.
//! - A registration still being made when its range is unregistered (`register_memory` and
//!   `unregister_memory` racing: the registry lists a range before the transports made its
//!   MRs) is not installed: `withdraw` marks it and waits until its maker dropped what it made
//!   ([`MrTable::finish`]).
//! - A registration in use (a posting thread that looked it up) is deregistered when the last
//!   user lets go, and `withdraw` waits for that ([`Held`] signals its drop), instead of
//!   leaving it to outlive the unregister.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// What a registration holds, shared with its users; dropping the last one releases it and
/// tells the table.
pub(super) struct Held<T> {
    set: Option<T>,
    gone: Arc<Signal>,
}

impl<T> std::ops::Deref for Held<T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.set.as_ref().expect("present until dropped")
    }
}

impl<T> Drop for Held<T> {
    fn drop(&mut self) {
        // Released (deregistered) first, then said.
        drop(self.set.take());
        self.gone.set();
    }
}

/// A flag set once, waited on.
#[derive(Default)]
struct Signal {
    done: Mutex<bool>,
    cv: Condvar,
}

impl Signal {
    fn set(&self) {
        *self.done.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.cv.notify_all();
    }

    /// Waits until set, saying every 5 s what it waits for.
    fn wait(&self, what: &dyn Fn() -> String) {
        let mut d = self.done.lock().unwrap_or_else(|e| e.into_inner());
        while !*d {
            let (g, t) = self
                .cv
                .wait_timeout(d, Duration::from_secs(5))
                .unwrap_or_else(|e| e.into_inner());
            d = g;
            if t.timed_out() && !*d {
                tracing::warn!("{}", what());
            }
        }
    }
}

enum Slot<T> {
    /// Being made (by the registration numbered `.0`); `.1`: its range was unregistered
    /// meanwhile.
    Making(u64, bool),
    Made(Arc<Held<T>>),
}

/// Registrations by range start.
pub(super) struct MrTable<T> {
    slots: Mutex<(u64, BTreeMap<u64, Slot<T>>)>,
    changed: Condvar,
}

impl<T> Default for MrTable<T> {
    fn default() -> Self {
        MrTable {
            slots: Mutex::new((0, BTreeMap::new())),
            changed: Condvar::new(),
        }
    }
}

/// A registration being made ([`MrTable::begin`]). Dropped without [`MrTable::finish`] (the
/// maker panicked), it settles as a failed one, so an unregister waiting for it goes on.
#[must_use = "finish it"]
pub(super) struct Making<'a, T> {
    table: &'a MrTable<T>,
    addr: u64,
    n: u64,
    settled: bool,
}

impl<T> Drop for Making<'_, T> {
    fn drop(&mut self) {
        if !self.settled {
            self.table.settle(self.addr, self.n);
        }
    }
}

impl<T> MrTable<T> {
    /// Notes that the range at `addr` is being registered (before its MRs are made).
    pub(super) fn begin(&self, addr: u64) -> Making<'_, T> {
        let mut g = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        g.0 += 1;
        let n = g.0;
        // (A range registered again replaces what its earlier registration left.)
        let old = g.1.insert(addr, Slot::Making(n, false));
        drop(g);
        drop(old);
        Making {
            table: self,
            addr,
            n,
            settled: false,
        }
    }

    /// Installs what registering made, or drops it (deregistered) if the range was
    /// unregistered meanwhile: `Err(None)` says so (`Err(Some)`: `made`'s own error). Either
    /// way the registration is settled when this returns.
    pub(super) fn finish<E>(
        &self,
        mut m: Making<'_, T>,
        made: Result<T, E>,
    ) -> Result<(), Option<E>> {
        m.settled = true;
        let mut g = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let withdrawn = match g.1.get(&m.addr) {
            Some(Slot::Making(n, w)) if *n == m.n => *w,
            // Replaced by a later registration: this one is not current.
            _ => true,
        };
        match made {
            Ok(set) if !withdrawn => {
                let held = Held {
                    set: Some(set),
                    gone: Arc::default(),
                };
                g.1.insert(m.addr, Slot::Made(Arc::new(held)));
                Ok(())
            }
            made => {
                drop(g);
                // Released before the slot goes: `withdraw` waits for the slot.
                let failed = made.err();
                self.settle(m.addr, m.n);
                Err(failed)
            }
        }
    }

    /// Ends registration `n` of `addr` that installed nothing.
    fn settle(&self, addr: u64, n: u64) {
        let mut g = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(g.1.get(&addr), Some(Slot::Making(m, _)) if *m == n) {
            g.1.remove(&addr);
        }
        drop(g);
        self.changed.notify_all();
    }

    /// Removes the range at `addr`; when this returns, what it registered is released: a
    /// registration being made is waited for (and not installed), one in use is waited for
    /// until its last user let go.
    pub(super) fn withdraw(&self, addr: u64) {
        let mut g = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match g.1.get_mut(&addr) {
                None => return,
                Some(Slot::Making(_, w)) => {
                    *w = true;
                    g = self.changed.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                Some(Slot::Made(_)) => {
                    let Some(Slot::Made(held)) = g.1.remove(&addr) else {
                        unreachable!("matched above")
                    };
                    drop(g);
                    let gone = Arc::clone(&held.gone);
                    let users = Arc::strong_count(&held) - 1;
                    drop(held);
                    gone.wait(&|| {
                        format!("unregister of 0x{addr:x}: its RDMA memory regions are still held by {users} user(s) (a posting thread); waiting for them to let go")
                    });
                    return;
                }
            }
        }
    }

    /// The registration of the range starting at or before `addr`, with its start.
    pub(super) fn containing(&self, addr: u64) -> Option<(u64, Arc<Held<T>>)> {
        let g = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        g.1.range(..=addr).rev().find_map(|(&a, s)| match s {
            Slot::Made(h) => Some((a, Arc::clone(h))),
            Slot::Making(..) => None,
        })
    }

    /// The registration of the range starting at `addr`, if it is made.
    pub(super) fn get(&self, addr: u64) -> Option<Arc<Held<T>>> {
        let g = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        match g.1.get(&addr) {
            Some(Slot::Made(h)) => Some(Arc::clone(h)),
            _ => None,
        }
    }

    /// How many registrations are made.
    pub(super) fn len(&self) -> usize {
        let g = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        g.1.values().filter(|s| matches!(s, Slot::Made(_))).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;

    /// A fake registration: counts itself in `live` while it exists.
    struct Fake(Arc<AtomicUsize>);
    impl Fake {
        fn new(live: &Arc<AtomicUsize>) -> Fake {
            live.fetch_add(1, Ordering::SeqCst);
            Fake(Arc::clone(live))
        }
    }
    impl Drop for Fake {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_registration_made_while_its_range_is_unregistered_is_not_kept() {
        let t = Arc::new(MrTable::<Fake>::default());
        let live = Arc::new(AtomicUsize::new(0));
        let making = t.begin(0x1000);
        // The unregister arrives while the MRs are being made: it waits for them.
        let t2 = Arc::clone(&t);
        let live2 = Arc::clone(&live);
        let (tx, rx) = std::sync::mpsc::channel();
        let unregister = std::thread::spawn(move || {
            t2.withdraw(0x1000);
            tx.send(live2.load(Ordering::SeqCst)).unwrap();
        });
        assert!(
            rx.recv_timeout(Duration::from_millis(200)).is_err(),
            "withdraw returned while the registration was being made"
        );
        let made = Fake::new(&live);
        let r: Result<(), Option<String>> = t.finish(making, Ok(made));
        assert_eq!(r, Err(None), "not installed: its range was unregistered");
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(5)).unwrap(),
            0,
            "withdraw returned with the registration still held"
        );
        unregister.join().unwrap();
        assert_eq!(t.len(), 0);
        assert!(t.containing(0x1000).is_none());
    }

    #[test]
    fn a_failed_registration_leaves_nothing_and_a_made_one_is_found() {
        let t = MrTable::<Fake>::default();
        let live = Arc::new(AtomicUsize::new(0));
        // The first NIC's MR made, the second failing: the maker drops the first (Err).
        let m = t.begin(0x1000);
        let first = Fake::new(&live);
        drop(first);
        let r = t.finish(m, Err("on NIC 2: ENOMEM"));
        assert_eq!(r, Err(Some("on NIC 2: ENOMEM")));
        assert_eq!((t.len(), live.load(Ordering::SeqCst)), (0, 0));
        t.withdraw(0x1000); // nothing to wait for
        let m = t.begin(0x1000);
        t.finish::<()>(m, Ok(Fake::new(&live))).unwrap();
        assert_eq!(t.containing(0x1800).map(|(a, _)| a), Some(0x1000));
        assert!(t.get(0x1000).is_some());
        t.withdraw(0x1000);
        assert_eq!((t.len(), live.load(Ordering::SeqCst)), (0, 0));
    }

    #[test]
    fn a_maker_that_panicked_does_not_hold_up_unregister() {
        let t = MrTable::<Fake>::default();
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _m = t.begin(0x1000);
            panic!("the verbs layer panicked");
        }));
        assert!(panicked.is_err());
        t.withdraw(0x1000); // returns: nothing is being made any more
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn unregister_waits_for_a_user_of_the_registration() {
        let t = Arc::new(MrTable::<Fake>::default());
        let live = Arc::new(AtomicUsize::new(0));
        let m = t.begin(0x1000);
        t.finish::<()>(m, Ok(Fake::new(&live))).unwrap();
        // A posting thread looked it up (and lost its range guard, say, before this).
        let (_, user) = t.containing(0x1000).unwrap();
        let t2 = Arc::clone(&t);
        let live2 = Arc::clone(&live);
        let (tx, rx) = std::sync::mpsc::channel();
        let unregister = std::thread::spawn(move || {
            t2.withdraw(0x1000);
            tx.send(live2.load(Ordering::SeqCst)).unwrap();
        });
        assert!(
            rx.recv_timeout(Duration::from_millis(200)).is_err(),
            "withdraw returned while a user held the registration"
        );
        assert!(t.get(0x1000).is_none(), "no new user finds it");
        let at = Instant::now();
        drop(user);
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), 0);
        assert!(at.elapsed() < Duration::from_secs(5));
        unregister.join().unwrap();
    }
}
