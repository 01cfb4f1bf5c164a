//! kvferry: a KV-cache transfer engine, wire-compatible with Mooncake's transfer engine.
//!
//! This crate is the engine library. Its API is the [`TransferEngine`] and what it takes
//! and gives ([`Config`], [`Batch`], [`TransferRequest`], [`TransferStatus`],
//! [`SegmentDesc`], [`Error`]): register memory, open peer segments, submit batches of
//! one-sided READ/WRITE requests, poll or wait for their status. Inside, it owns configuration, the sans-IO wire
//! codecs, registered memory, the transports (TCP, shared memory, RDMA, the local memcpy,
//! GPU staging), the routing of pieces to them by what each declares, and the handshake
//! port; none of that is public.
//!
//! A few modules are public because the other kvferry crates build on them: the cluster key
//! and its Noise sessions ([`auth`], [`auth_http`]), the metadata services ([`metadata`]),
//! the handshake port's client side ([`handshake`]), shareable host buffers ([`hostbuf`]),
//! and what `kvferry doctor` reports about this host ([`host`]).
//!
//! It is **not** a store (that is `kvferry-store`), not a command-line tool (that is
//! `kvferry-cli`) and not the Python binding (`kvferry-python`). It never links a
//! library a host may lack: RDMA verbs and CUDA are loaded at run time.
//!
//! Guarantees:
//! - A request is COMPLETED only once its bytes are in the destination's memory.
//! - A request reported terminal (COMPLETED, FAILED, TIMEOUT) is over: no byte of it lands in
//!   local memory after that, and dropping a [`Batch`] waits until each of its requests is.
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
//! // Or asynchronously: the batch is the caller's; dropping it waits until it is over.
//! let batch = engine.allocate_batch(1)?;
//! batch.submit(&[req])?;
//! let status = batch.wait(Duration::from_secs(30));
//! # Ok::<(), kvferry::Error>(())
//! ```

// Everything not re-exported below is internal: a `pub` item that nothing outside can reach
// is an error in CI (`-D warnings`), so the public API is what this file names.
#![warn(unreachable_pub)]
// Without `test-hooks` the `testing` surface is absent: items only it re-exports are then
// unreachable or unused. The lints run with it on (`cargo clippy --all-targets`).
#![cfg_attr(not(feature = "test-hooks"), allow(unreachable_pub, dead_code))]

pub mod auth;
pub mod auth_http;
mod batch;
mod config;
mod engine;
mod error;
mod forked;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzz;
mod gpu;
pub mod handshake;
pub mod hostbuf;
mod memory;
pub mod metadata;
mod nic;
mod route;
mod sys;
mod transport;
mod wire;

pub use batch::{FailCause, TaskStatus, TransferStatus};
pub use config::{split_host_port, Config, EnvVar, InitializeArgs, TransportMode, ENV_VARS};
pub use engine::{
    resolve_advertised, Batch, Notify, PageTable, SegmentId, SegmentTransport, ServiceFn,
    TransferEngine, TransferRequest, LOCAL_SEGMENT_ID,
};
pub use error::{Error, Result};
pub use gpu::direct::GpuRdma;
pub use wire::descriptor::{BufferDesc, DeviceDesc, Protocols, SegmentDesc};
pub use wire::tcp::Opcode;
pub use wire::WireError;

/// This host as `kvferry doctor`, the benchmarks and the binding's `capabilities()` see it:
/// its GPUs and how their memory would be registered on RDMA NICs, its RDMA NICs and ports,
/// and the same-host transport. Facts only: nothing here moves data.
pub mod host {
    /// The CUDA driver (loaded at run time) and its GPUs; GPUDirect RDMA (DMA-BUF or
    /// nvidia-peermem): which methods this host has, and which really register GPU memory.
    pub mod gpu {
        pub use crate::gpu::direct::{
            facts, plan, report, try_gpu_registration, Facts, GpuRegTry, Method, Report,
        };
        pub use crate::gpu::{cuda_ready, probe, Gpu, Probe};
    }
    /// libibverbs (loaded at run time), the RDMA NICs and their ports, from sysfs.
    pub mod rdma {
        pub use crate::nic::{
            port_reports, probe, query_mtus, verbs_dmabuf, Nic, PortReport, Probe,
        };
    }
    /// The same-host transport (cross-memory attach): this host's identity, the ptrace
    /// policy, and the bytes it has moved.
    pub mod shm {
        pub use crate::transport::shm::{bytes_moved, host_id, ptrace_scope};
    }
}

#[cfg(test)]
mod boundaries;
#[cfg(any(test, feature = "test-hooks"))]
mod source_scan;

/// What the tests share: for the unit tests, helpers; for the integration tests and the
/// examples (`test-hooks`, which this crate's dev-dependency on itself turns on), the
/// internals they drive directly: wire codecs, raw verbs, the CUDA driver, the handshake
/// server and the hooks that simulate failures. Not part of the API.
#[cfg(any(test, feature = "test-hooks"))]
#[doc(hidden)]
pub mod testing {
    #[cfg(test)]
    use std::time::{Duration, Instant};

    /// Waits until `f` holds, at most 10 s (then fails, naming `what`).
    #[cfg(test)]
    pub(crate) fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
        let until = Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(Instant::now() < until, "{what}: not within 10 s");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Reading Rust source for the boundary tests (this crate's and the store's).
    pub mod source_scan {
        pub use crate::source_scan::{children_dir, rule_hits, sources, strip, without_tests};
    }
    pub mod auth {
        pub use crate::auth::keyed::Keyed;
    }
    pub mod gpu {
        pub use crate::gpu::{cuda, probe, probe_with, Cuda};
        pub mod driver {
            pub use crate::sys::cuda::{CudaError, Driver};
        }
        pub mod ipc {
            pub use crate::gpu::ipc::{export, open, Export};
        }
        pub mod stage {
            pub use crate::gpu::stage::{CHUNK, WINDOW};
        }
    }
    pub mod handshake {
        pub use crate::handshake::server::{Handler, HandshakeServer};
    }
    pub mod rdma {
        pub use crate::transport::rdma::PASSIVE_SWEEP_AT;
        pub mod sysfs {
            pub use crate::nic::sysfs::{nics, select_gid, ROOT};
        }
        pub mod verbs {
            pub use crate::sys::ibverbs::verbs::{
                Context, Cq, Mr, Op, Path, Pd, PortAttr, Qp, RemoteQp, Verbs, VerbsError, Wc, Wr,
                RETRY_CNT,
            };
        }
    }
    pub mod shm {
        pub use crate::transport::shm::{
            bytes_moved, gpu_ipc_bytes, simulate_cma_denied, REAP_INTERVAL,
        };
    }
    pub mod wire {
        pub mod handshake {
            pub use crate::wire::handshake::{decode, encode, Frame, MsgType};
        }
        pub mod rdma {
            pub use crate::wire::rdma::{format_gid, parse_gid, ConnectionMsg};
        }
        pub mod tcp {
            pub use crate::wire::tcp::{
                decode_auth_answer, decode_status, encode_auth_hello, encode_status, DataHeader,
                Status, AUTH_ANSWER_LEN, HEADER_LEN, SEALED_HEADER_LEN, SEALED_STATUS_LEN,
            };
        }
    }
}
