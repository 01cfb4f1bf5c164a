//! The replica copy/move tasks' messages (Mooncake 0.3.14's task manager): ids, kinds,
//! states, what a query answers, what a client is handed, and a copy's plan.

use super::{de_seq, ReplicaDesc};
use serde::{Deserialize, Serialize};

/// A task's id: Mooncake's UUID, two 64-bit halves (Python sees the pair).
pub type TaskId = (u64, u64);

/// What a task does (Mooncake's `TaskType`, same numbers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TaskKind {
    Copy = 0,
    Move = 1,
}

/// Where a task is (Mooncake's `TaskStatus`, same numbers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TaskStatus {
    Pending = 0,
    Processing = 1,
    Failed = 2,
    Success = 3,
}

/// Answer to [`Request::QueryTask`](super::Request::QueryTask) (Mooncake's `QueryTaskResponse`). Times are ages at the
/// master's answer (its clock is monotonic); the client turns them into epoch milliseconds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskInfo {
    pub id: TaskId,
    pub kind: TaskKind,
    pub status: TaskStatus,
    pub created_ago_ms: u64,
    pub updated_ago_ms: u64,
    pub assigned_client: u64,
    pub message: String,
}

/// A task handed to its client ([`Request::FetchTasks`](super::Request::FetchTasks); Mooncake's `TaskAssignment` with its
/// payload as fields).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskAssignment {
    pub id: TaskId,
    pub kind: TaskKind,
    pub key: String,
    /// The segment (name) whose replica is copied.
    pub source: String,
    /// The segments (names) to copy to (one for a move).
    #[serde(deserialize_with = "de_seq")]
    pub targets: Vec<String>,
    /// How often the client retries a copy that found no room (Mooncake's
    /// `max_retry_attempts`).
    pub max_retry: u32,
}

/// Answer to [`Request::CopyStart`](super::Request::CopyStart): the source replica to read (under read `read_id`,
/// released as a get's) and the room reserved for each new replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyPlan {
    pub source: ReplicaDesc,
    #[serde(deserialize_with = "de_seq")]
    pub targets: Vec<ReplicaDesc>,
    pub size: u64,
    pub read_id: u64,
}
