//! Store errors, with Mooncake Store's numeric codes (`mooncake-store/include/types.h`).

use serde::{Deserialize, Serialize};

/// What went wrong in a store operation. Serialisable: the master sends it to clients.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum StoreError {
    #[error("object {0:?} not found")]
    ObjectNotFound(String),
    #[error("object {0:?} already exists; use upsert to replace it")]
    ObjectAlreadyExists(String),
    #[error("object {0:?} is leased by a reader; retry after the lease ends or pass force=true")]
    ObjectHasLease(String),
    #[error("the read lease of {0:?} expired before the read finished; the data may be torn, read it again")]
    LeaseExpired(String),
    #[error("object {0:?} is still being written (put not finished)")]
    ReplicaNotReady(String),
    #[error("no space for {size} bytes with {replicas} replica(s): {detail}")]
    NoAvailableHandle {
        size: u64,
        replicas: u32,
        detail: String,
    },
    #[error("invalid key {0:?}: keys are 1 to 4096 bytes")]
    InvalidKey(String),
    #[error("invalid parameters: {0}")]
    InvalidParams(String),
    #[error("segment {0} not found")]
    SegmentNotFound(String),
    #[error("segment {0} is already mounted")]
    SegmentAlreadyExists(String),
    #[error("client {0:x} is not known to the master (it restarted, or the client's TTL expired); remount")]
    UnknownClient(u64),
    #[error("transfer failed: {0}")]
    TransferFailed(String),
    #[error("master RPC failed: {0}")]
    Rpc(String),
    #[error("buffer too small: {need} bytes needed, {have} given")]
    BufferOverflow { need: u64, have: u64 },
    #[error("internal error: {0}")]
    Internal(String),
    /// Answered by a master that is not (or no longer) the leader of its HA cluster: nothing
    /// of the request was applied. Clients that follow the leader (`etcd://` master address)
    /// find the new one and send the request again. Last, so the other variants keep their
    /// wire numbers.
    #[error("this master is not the leader{}; nothing was applied, send the request to the leader", if .leader.is_empty() { String::new() } else { format!(" (the leader is {})", .leader) })]
    NotLeader { leader: String },
    /// The master failed over while this put was in flight: the object was not stored (the new
    /// leader does not know the write). Retryable: put it again.
    #[error("the master failed over while the put of {0:?} was in flight; the object was not stored, put it again")]
    MasterFailover(String),
    /// The request reached the master but its outcome is unknown: the leader applied it and
    /// stopped leading before its change was durable (in its etcd journal or on its in-sync
    /// standbys), or the connection failed after the request was sent (the master killed,
    /// paused past the timeout, the link reset). Unlike [`StoreError::NotLeader`], the
    /// request is not sent again on its own (a put's end is, once: see `Client::put_from`).
    #[error("the master may or may not have applied this request (it stopped leading before the change was durable, or the connection failed after the request was sent): check the state (exist, get) before repeating it; a put whose start is in doubt is revoked by the client, and a put whose end is in doubt was sent once more to the leader")]
    OutcomeUnknown,
    /// The client and the master do not share the cluster key (`KVFERRY_AUTH_KEY_FILE`):
    /// one side has none, or they hold different keys; the message says which and what to
    /// set. Nothing was applied. Last, so the other variants keep their wire numbers.
    #[error("not authenticated: {0}")]
    Unauthorized(String),
    /// A put or a replica copy/move of the object is in progress (Mooncake's
    /// `OBJECT_HAS_REPLICATION_TASK`). Last, so the other variants keep their wire numbers.
    #[error("object {0:?} is being written or copied (a put, copy or move is in progress); retry once it ended")]
    ObjectHasReplicationTask(String),
    /// No copy or move of the object by this client is in progress (Mooncake's
    /// `OBJECT_NO_REPLICATION_TASK`).
    #[error("no copy or move of {0:?} by this client is in progress (it was revoked, discarded, or the master failed over)")]
    ObjectNoReplicationTask(String),
    /// The object has no complete replica on the segment named (Mooncake's `REPLICA_NOT_FOUND`).
    #[error("no replica of {0}")]
    ReplicaNotFound(String),
    /// No task of this id is known (Mooncake's `TASK_NOT_FOUND`): never created, or finished
    /// long enough ago to have been pruned, or created before the master restarted.
    #[error("task {0} not found (finished tasks are kept for the last 10000 only, and not across a master restart or failover)")]
    TaskNotFound(String),
    /// Too many tasks wait for their client (Mooncake's `TASK_PENDING_LIMIT_EXCEEDED`).
    #[error("{0} tasks are already pending (the master's limit); retry once some have run")]
    TaskPendingLimitExceeded(u64),
    /// The client is not the one the task was assigned to (Mooncake's `ILLEGAL_CLIENT`).
    #[error("illegal client: {0}")]
    IllegalClient(String),
}

impl StoreError {
    /// Mooncake Store's error number.
    pub fn code(&self) -> i32 {
        match self {
            StoreError::ObjectNotFound(_) => -704,
            StoreError::ObjectAlreadyExists(_) => -705,
            StoreError::ObjectHasLease(_) => -706,
            StoreError::LeaseExpired(_) => -707,
            StoreError::ReplicaNotReady(_) => -703,
            StoreError::NoAvailableHandle { .. } => -200,
            StoreError::InvalidKey(_) => -400,
            StoreError::InvalidParams(_) => -600,
            StoreError::SegmentNotFound(_) => -101,
            StoreError::SegmentAlreadyExists(_) => -102,
            StoreError::UnknownClient(_) => -1010,
            StoreError::TransferFailed(_) => -800,
            StoreError::Rpc(_) => -900,
            StoreError::BufferOverflow { .. } => -10,
            StoreError::Internal(_) => -1,
            StoreError::NotLeader { .. } => -1011,
            StoreError::MasterFailover(_) => -900,
            StoreError::OutcomeUnknown => -900,
            // (Mooncake has no such error: kvferry's own number, next to NotLeader's.)
            StoreError::Unauthorized(_) => -1012,
            StoreError::ObjectHasReplicationTask(_) => -708,
            StoreError::ObjectNoReplicationTask(_) => -709,
            StoreError::ReplicaNotFound(_) => -710,
            StoreError::TaskNotFound(_) => -1400,
            StoreError::TaskPendingLimitExceeded(_) => -1401,
            StoreError::IllegalClient(_) => -601,
        }
    }
}

pub type StoreResult<T> = Result<T, StoreError>;
