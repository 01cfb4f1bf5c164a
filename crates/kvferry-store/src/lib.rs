//! kvferry Store: a cluster-wide memory pool for KV-cache objects.
//!
//! A **master** (the state machine [`master`], driven by [`node`], served by [`server`])
//! holds metadata only: which clients contributed which memory segments, which object has
//! replicas where, leases, pins, eviction. **Clients** ([`client`]) contribute segments and
//! move object bytes among themselves with the kvferry transfer engine; data never passes
//! through the master.
//!
//! This crate is not the transfer engine (that is `kvferry`), and it does not speak Mooncake's
//! master protocol (coro_rpc/struct_pack): its RPC is its own ([`proto`]), chosen for a small
//! auditable codec. Mooncake compatibility is at the client API (`MooncakeDistributedStore` in
//! the Python package) and at the transfer-engine wire level.

#[cfg(test)]
mod boundaries;
pub mod cleanup;
pub mod client;
pub mod disk;
pub mod elect;
pub mod error;
pub mod frame;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzz;
pub mod ha;
pub mod master;
mod net;
pub mod node;
pub mod proto;
pub mod repl;
pub mod server;
#[cfg(test)]
mod sim;

pub use client::{Client, ClientConfig, Replica, Staged};
pub use error::{StoreError, StoreResult};
pub use master::{MasterConfig, Strategy};
pub use node::Master;
pub use proto::{ReplicateConfig, SoftPin};

/// The unit tests' allocator: counts, per thread, the bytes allocated and not freed, and
/// their peak ([`alloc_count::peak_during`]).
#[cfg(test)]
pub(crate) mod alloc_count {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    std::thread_local! {
        static LIVE: Cell<isize> = const { Cell::new(0) };
        static PEAK: Cell<isize> = const { Cell::new(0) };
    }

    pub struct Counting;

    fn count(delta: isize) {
        // (`try_with`: nothing is counted while the thread's locals are being torn down.)
        let _ = LIVE.try_with(|l| {
            let now = l.get() + delta;
            l.set(now);
            let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
        });
    }

    // SAFETY: every call is passed to the system allocator as it came.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            count(layout.size() as isize);
            // SAFETY: the caller's contract, passed on.
            unsafe { System.alloc(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            count(-(layout.size() as isize));
            // SAFETY: the caller's contract, passed on.
            unsafe { System.dealloc(ptr, layout) }
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            count(layout.size() as isize);
            // SAFETY: the caller's contract, passed on.
            unsafe { System.alloc_zeroed(layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            count(new_size as isize - layout.size() as isize);
            // SAFETY: the caller's contract, passed on.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }

    #[global_allocator]
    static A: Counting = Counting;

    /// What `f` returns, and the most bytes it held allocated on this thread at once (beyond
    /// what was allocated before it).
    pub fn peak_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
        let base = LIVE.with(|l| l.get());
        PEAK.with(|p| p.set(base));
        let r = f();
        (r, (PEAK.with(|p| p.get()) - base).max(0) as usize)
    }
}
