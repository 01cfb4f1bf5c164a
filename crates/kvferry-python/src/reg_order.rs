//! Orders the registrations and unregistrations of one engine by start address: a call
//! claims the addresses it names (all at once, waiting while another call holds any of
//! them) and holds them across the engine call and the pins' update, so that for each
//! address the engine's ranges and the pins change together. Calls on other addresses go on:
//! a register of an unrelated buffer does not wait behind an unregister that waits for
//! accesses in progress (one lock for the whole engine made it).

use std::collections::HashSet;
use std::sync::{Condvar, Mutex};

#[derive(Default)]
pub(crate) struct RegOrder {
    busy: Mutex<HashSet<u64>>,
    turn: Condvar,
}

/// The addresses of one call, held until dropped.
pub(crate) struct Claim<'a> {
    order: &'a RegOrder,
    addrs: Vec<u64>,
}

impl RegOrder {
    /// Claims `addrs` (duplicates allowed), waiting while another call holds any of them.
    pub(crate) fn claim(&self, addrs: &[u64]) -> Claim<'_> {
        let mut addrs = addrs.to_vec();
        addrs.sort_unstable();
        addrs.dedup();
        let mut busy = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        while addrs.iter().any(|a| busy.contains(a)) {
            busy = self.turn.wait(busy).unwrap_or_else(|e| e.into_inner());
        }
        busy.extend(addrs.iter().copied());
        Claim { order: self, addrs }
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        let mut busy = self.order.busy.lock().unwrap_or_else(|e| e.into_inner());
        for a in &self.addrs {
            busy.remove(a);
        }
        drop(busy);
        self.order.turn.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn a_claim_waits_only_for_its_own_addresses() {
        let order = RegOrder::default();
        let held = order.claim(&[0x1000, 0x1000]);
        std::thread::scope(|s| {
            // Another address: at once, while 0x1000 is held.
            let (tx, rx) = mpsc::channel();
            let o = &order;
            s.spawn(move || {
                let _c = o.claim(&[0x2000]);
                tx.send(()).unwrap();
            });
            rx.recv_timeout(Duration::from_secs(5))
                .expect("a claim of another address waited for 0x1000");
            // One that names 0x1000 too waits for it, then gets all of its addresses.
            let (tx, rx) = mpsc::channel();
            s.spawn(move || {
                let _c = o.claim(&[0x3000, 0x1000]);
                tx.send(()).unwrap();
            });
            assert!(
                rx.recv_timeout(Duration::from_millis(200)).is_err(),
                "a claim of 0x1000 did not wait for the one holding it"
            );
            assert!(
                order.busy.lock().unwrap().contains(&0x1000)
                    && !order.busy.lock().unwrap().contains(&0x3000),
                "all or nothing"
            );
            drop(held);
            rx.recv_timeout(Duration::from_secs(5))
                .expect("the waiting claim went on once 0x1000 was let go");
        });
        assert!(order.busy.lock().unwrap().is_empty(), "every claim let go");
    }
}
