//! The engine's error type. Every message says what went wrong and what to do about it.

use crate::wire::WireError;

/// Errors returned by [`crate::TransferEngine`] and its parts.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("cannot register [0x{addr:x}, +{len}): it overlaps the registered range [0x{other_addr:x}, +{other_len}); unregister that range first or register a disjoint one")]
    Overlap {
        addr: u64,
        len: u64,
        other_addr: u64,
        other_len: u64,
    },
    #[error("address 0x{addr:x} is not the start of a registered range; pass the address given to register_memory")]
    NotRegistered { addr: u64 },
    #[error("local range [0x{addr:x}, +{len}) is not inside registered memory; register the buffer with register_memory before transferring from or into it")]
    LocalNotRegistered { addr: u64, len: u64 },
    #[error("remote range [0x{addr:x}, +{len}) is not inside any buffer registered by segment {segment}; check the peer's address (it may have unregistered or restarted)")]
    RemoteNotRegistered {
        segment: String,
        addr: u64,
        len: u64,
    },
    #[error("segment {0:?} is not open: call open_segment first")]
    UnknownSegmentId(u64),
    #[error("cannot open segment {name:?}: {reason}")]
    SegmentNotFound { name: String, reason: String },
    /// A batch id the Python binding does not know (the Rust API hands out [`crate::Batch`]
    /// handles, not ids).
    #[error("batch {0} does not exist (already freed, or never allocated)")]
    UnknownBatch(u64),
    #[error("batch {batch} holds {capacity} requests; submitting {wanted} more would exceed it (allocate a larger batch)")]
    TooManyRequests {
        batch: u64,
        capacity: usize,
        wanted: usize,
    },
    /// Freeing a batch (by id, in the Python binding) that still has tasks in flight.
    #[error("batch {batch} still has {pending} task(s) in flight; wait until every task is COMPLETED, FAILED or TIMEOUT before freeing it")]
    BatchBusy { batch: u64, pending: usize },
    #[error("task {task} of batch {batch} does not exist (the batch has {len} tasks)")]
    UnknownTask { batch: u64, task: usize, len: usize },
    #[error("no transport can reach segment {segment}: {reason}")]
    NoTransport { segment: String, reason: String },
    #[error("cannot bind {what} on {addr}: {source}; {hint}")]
    Bind {
        what: &'static str,
        addr: String,
        hint: String,
        source: std::io::Error,
    },
    #[error("handshake with {peer} failed: {reason}")]
    Handshake { peer: String, reason: String },
    #[error("{peer} and this engine do not hold a cluster key in common: {reason} (KVFERRY_AUTH_KEY_FILE must name the same key on every host, or be unset on all)")]
    Unauthorized { peer: String, reason: String },
    #[error("peer {peer} sent bad data: {source}")]
    Wire { peer: String, source: WireError },
    #[error("I/O error {context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error("the engine is shut down")]
    Shutdown,
    #[error("RDMA: {0}")]
    Rdma(String),
    #[error("metadata service {backend} at {location}: {reason}")]
    Metadata {
        backend: &'static str,
        location: String,
        reason: String,
    },
    #[error("segment {name} is not registered in {backend} ({location}): key {key} is absent; check the name (in central metadata mode a segment is named by its engine's local_hostname, exactly) and that the peer uses the same metadata server and cluster id")]
    SegmentNotRegistered {
        name: String,
        backend: &'static str,
        location: String,
        key: String,
    },
    #[error("metadata entry {key} is invalid: {reason}; the engine that wrote it is not Mooncake-compatible or the entry is corrupt (restart that engine to re-register it)")]
    BadMetadata { key: String, reason: String },
    #[error("this engine belongs to process {owner}; process {pid} inherited it through fork(), where its threads and shared mappings do not exist: create a new engine in the child")]
    Forked { owner: u32, pid: u32 },
}

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Error {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// Mooncake's numeric error code for this error (`mooncake-transfer-engine/include/error.h`).
    pub fn mooncake_code(&self) -> i32 {
        match self {
            Error::InvalidArgument(_)
            | Error::Config(_)
            | Error::UnknownBatch(_)
            | Error::UnknownTask { .. } => -1,
            Error::TooManyRequests { .. } => -2,
            Error::NotRegistered { .. }
            | Error::LocalNotRegistered { .. }
            | Error::RemoteNotRegistered { .. } => -3,
            Error::BatchBusy { .. } => -4,
            Error::Overlap { .. } => -7,
            Error::Bind { .. } | Error::Io { .. } | Error::Rdma(_) => -102,
            Error::Wire { .. } => -103,
            Error::Handshake { .. } | Error::Unauthorized { .. } => -104,
            Error::SegmentNotFound { .. } | Error::UnknownSegmentId(_) => -200,
            Error::NoTransport { .. } => -201,
            Error::Shutdown | Error::Forked { .. } => -202,
            Error::Metadata { .. } => -200,
            Error::SegmentNotRegistered { .. } => -200,
            Error::BadMetadata { .. } => -103,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
