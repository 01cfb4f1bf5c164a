//! kvferry: a KV-cache transfer engine, wire-compatible with Mooncake's transfer engine.
//!
//! This crate is the engine library. It owns configuration ([`config`]), the sans-IO wire
//! codecs ([`wire`]), registered memory ([`memory`]), the [`transport::Transport`] trait
//! and its implementations (TCP, shared memory, RDMA, the local memcpy, GPU staging), the
//! routing of pieces to them by what each declares (`route`), the handshake port
//! ([`handshake`]) and the [`TransferEngine`] that ties them together: register memory, open
//! peer segments, submit batches of one-sided READ/WRITE requests, poll or wait for their
//! status.
//!
//! It is **not** a store (that is `kvferry-store`), not a command-line tool (that is
//! `kvferry-cli`) and not the Python binding (`kvferry-python`). It never links a
//! library a host may lack: RDMA verbs ([`rdma`]) and CUDA ([`gpu`]) are loaded at run time.
//!
//! Guarantees:
//! - A request is COMPLETED only once its bytes are in the destination's memory.
//! - A peer can read or write only ranges this engine registered; anything else is refused
//!   before a byte is touched.
//! - Bad input from users or the network yields an [`Error`] or a FAILED task naming the
//!   cause; it never panics.
//! - A dead or stalled peer fails its requests by their deadline; nothing hangs.
//!
//! ```no_run
//! use kvferry::{Config, TransferEngine, TransferRequest, Opcode};
//! use std::time::Duration;
//! let engine = TransferEngine::new(Config::default())?;
//! let buf = vec![7u8; 4096];
//! engine.register_memory(buf.as_ptr() as u64, 4096, "cpu:0")?;
//! let peer = engine.open_segment("127.0.0.1:15123")?;
//! let remote_addr = engine.segment_descriptor(peer)?.buffers[0].addr;
//! let req = TransferRequest { opcode: Opcode::Write, source: buf.as_ptr() as u64, target_id: peer, target_offset: remote_addr, length: 4096 };
//! let status = engine.transfer_sync(&[req], Duration::from_secs(30))?;
//! # Ok::<(), kvferry::Error>(())
//! ```

pub mod auth;
pub mod auth_http;
pub mod batch;
pub mod config;
mod engine;
pub mod error;
mod forked;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzz;
pub mod gpu;
pub mod handshake;
pub mod hostbuf;
pub mod memory;
pub mod metadata;
pub mod rdma;
mod route;
pub mod transport;
pub mod wire;

pub use batch::{FailCause, TaskStatus, TransferStatus};
pub use config::Config;
pub use engine::{
    resolve_advertised, BatchId, Notify, SegmentId, SegmentTransport, TransferEngine,
    TransferRequest, LOCAL_SEGMENT_ID,
};
pub use error::{Error, Result};
pub use wire::tcp::Opcode;

#[cfg(test)]
mod boundaries;

/// What the unit tests share.
#[cfg(test)]
pub(crate) mod testing {
    use std::time::{Duration, Instant};

    /// Waits until `f` holds, at most 10 s (then fails, naming `what`).
    pub(crate) fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
        let until = Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(Instant::now() < until, "{what}: not within 10 s");
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}
