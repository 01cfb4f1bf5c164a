//! Replica copy and move tasks (Mooncake 0.3.14's `ClientTaskManager`): a task is created
//! for one client (the owner of the replica to copy), waits until that client fetches it
//! (PENDING), runs there (PROCESSING) and ends as the client reports (SUCCESS or FAILED).
//!
//! As in Mooncake: at most [`TaskLimits::max_pending`] tasks wait and
//! [`TaskLimits::max_processing`] run at once; the last [`TaskLimits::max_finished`]
//! finished tasks are kept for queries (older ones are forgotten: `TASK_NOT_FOUND`); a task
//! pending for [`TaskLimits::pending_timeout_ms`] since it was created, or processing for
//! [`TaskLimits::processing_timeout_ms`] since it was handed out, fails ("pending timeout",
//! "processing timeout"). Unlike Mooncake, whose tasks of a client that went away wait for
//! those timeouts, a dropped client's tasks fail when the master drops it
//! (`Tasks::client_gone`).
//!
//! Not journaled: Mooncake's HA op log carries no task either (only its periodic snapshot
//! does), so a master that takes over knows no task of its predecessor (a query answers
//! `TASK_NOT_FOUND`). A copy in progress at the takeover is, at the new leader, a write in
//! progress like a put's (`master/copy.rs`): its client's end of it is refused and it
//! revokes it.
//!
//! Pure: time is an argument, ids come from the state's seeded generator.

use super::Splitmix;
use crate::error::{StoreError, StoreResult};
use crate::proto::{TaskAssignment, TaskId, TaskInfo, TaskKind, TaskStatus};
use std::collections::{HashMap, HashSet, VecDeque};

/// The task table's bounds and timeouts (Mooncake's defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskLimits {
    pub max_finished: usize,
    pub max_pending: usize,
    pub max_processing: usize,
    /// 0: none.
    pub pending_timeout_ms: u64,
    /// 0: none.
    pub processing_timeout_ms: u64,
    /// Handed to the client: how often it retries a copy that found no room.
    pub max_retry: u32,
}

impl Default for TaskLimits {
    fn default() -> Self {
        TaskLimits {
            max_finished: 10_000,
            max_pending: 10_000,
            max_processing: 10_000,
            pending_timeout_ms: 300_000,
            processing_timeout_ms: 300_000,
            max_retry: 10,
        }
    }
}

/// What a task copies: the key, the source segment, the targets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskWork {
    pub kind: TaskKind,
    pub key: String,
    pub source: String,
    pub targets: Vec<String>,
}

struct Task {
    work: TaskWork,
    status: TaskStatus,
    created: u64,
    updated: u64,
    client: u64,
    message: String,
}

/// The task table.
#[derive(Default)]
pub(super) struct Tasks {
    all: HashMap<TaskId, Task>,
    /// Per client, the tasks waiting to be fetched, oldest first.
    pending: HashMap<u64, VecDeque<TaskId>>,
    /// Per client, the tasks handed out and not ended.
    processing: HashMap<u64, HashSet<TaskId>>,
    /// Finished tasks, oldest first (the oldest are forgotten past `max_finished`).
    finished: VecDeque<TaskId>,
    n_pending: usize,
    n_processing: usize,
    pub(super) limits: TaskLimits,
    ids: Splitmix,
}

fn show(id: TaskId) -> String {
    format!("{:016x}-{:016x}", id.0, id.1)
}

impl Tasks {
    pub(super) fn seed(&mut self, seed: u64) {
        self.ids = Splitmix(seed ^ 0x7a5c_0b1e_d15c_a11e);
    }

    /// A number in `0..n` (`n > 0`) from the table's generator.
    pub(super) fn pick(&mut self, n: usize) -> usize {
        self.ids.below(n)
    }

    /// A task for `client`, pending; its id.
    pub(super) fn submit(&mut self, client: u64, work: TaskWork, now: u64) -> StoreResult<TaskId> {
        if self.n_pending >= self.limits.max_pending {
            return Err(StoreError::TaskPendingLimitExceeded(self.n_pending as u64));
        }
        let mut id = (self.ids.next(), self.ids.next());
        while id == (0, 0) || self.all.contains_key(&id) {
            id = (self.ids.next(), self.ids.next());
        }
        self.all.insert(
            id,
            Task {
                work,
                status: TaskStatus::Pending,
                created: now,
                updated: now,
                client,
                message: String::new(),
            },
        );
        self.pending.entry(client).or_default().push_back(id);
        self.n_pending += 1;
        Ok(id)
    }

    pub(super) fn query(&self, id: TaskId, now: u64) -> StoreResult<TaskInfo> {
        let t = self
            .all
            .get(&id)
            .ok_or_else(|| StoreError::TaskNotFound(show(id)))?;
        Ok(TaskInfo {
            id,
            kind: t.work.kind,
            status: t.status,
            created_ago_ms: now.saturating_sub(t.created),
            updated_ago_ms: now.saturating_sub(t.updated),
            assigned_client: t.client,
            message: t.message.clone(),
        })
    }

    /// Hands out up to `max` of `client`'s pending tasks (within the processing limit).
    pub(super) fn fetch(&mut self, client: u64, max: usize, now: u64) -> Vec<TaskAssignment> {
        let mut out = Vec::new();
        let Some(queue) = self.pending.get_mut(&client) else {
            return out;
        };
        while out.len() < max && self.n_processing < self.limits.max_processing {
            let Some(id) = queue.pop_front() else { break };
            let Some(t) = self.all.get_mut(&id) else {
                continue;
            };
            if t.status != TaskStatus::Pending {
                continue;
            }
            self.n_pending = self.n_pending.saturating_sub(1);
            t.status = TaskStatus::Processing;
            t.updated = now;
            if self.processing.entry(client).or_default().insert(id) {
                self.n_processing += 1;
            }
            out.push(TaskAssignment {
                id,
                kind: t.work.kind,
                key: t.work.key.clone(),
                source: t.work.source.clone(),
                targets: t.work.targets.clone(),
                max_retry: self.limits.max_retry,
            });
        }
        if queue.is_empty() {
            self.pending.remove(&client);
        }
        out
    }

    /// `client` reports task `id` ended. A task already finished stays as it ended (Ok).
    pub(super) fn complete(
        &mut self,
        client: u64,
        id: TaskId,
        ok: bool,
        message: &str,
        now: u64,
    ) -> StoreResult<()> {
        let t = self
            .all
            .get(&id)
            .ok_or_else(|| StoreError::TaskNotFound(show(id)))?;
        if t.client != client {
            return Err(StoreError::IllegalClient(format!(
                "client {client:x} is not the one task {} was assigned to",
                show(id)
            )));
        }
        if matches!(t.status, TaskStatus::Success | TaskStatus::Failed) {
            return Ok(());
        }
        let status = if ok {
            TaskStatus::Success
        } else {
            TaskStatus::Failed
        };
        self.finish(id, status, message, now);
        Ok(())
    }

    /// Ends task `id` (known, not finished) as `status`, updating the counts and queues.
    fn finish(&mut self, id: TaskId, status: TaskStatus, message: &str, now: u64) {
        let Some(t) = self.all.get_mut(&id) else {
            return;
        };
        match t.status {
            TaskStatus::Pending => {
                self.n_pending = self.n_pending.saturating_sub(1);
                if let Some(q) = self.pending.get_mut(&t.client) {
                    q.retain(|x| *x != id);
                    if q.is_empty() {
                        self.pending.remove(&t.client);
                    }
                }
            }
            TaskStatus::Processing => {
                if let Some(set) = self.processing.get_mut(&t.client) {
                    if set.remove(&id) {
                        self.n_processing = self.n_processing.saturating_sub(1);
                    }
                    if set.is_empty() {
                        self.processing.remove(&t.client);
                    }
                }
            }
            TaskStatus::Success | TaskStatus::Failed => return,
        }
        t.status = status;
        t.message = message.to_string();
        t.updated = now;
        self.finished.push_back(id);
        while self.finished.len() > self.limits.max_finished {
            if let Some(old) = self.finished.pop_front() {
                self.all.remove(&old);
            }
        }
    }

    /// Fails the tasks past their timeouts.
    pub(super) fn expire(&mut self, now: u64) {
        let (p, q) = (
            self.limits.pending_timeout_ms,
            self.limits.processing_timeout_ms,
        );
        let mut late: Vec<(TaskId, &'static str)> = Vec::new();
        if p > 0 {
            late.extend(
                self.pending
                    .values()
                    .flatten()
                    .filter(|id| {
                        self.all
                            .get(id)
                            .is_some_and(|t| now.saturating_sub(t.created) > p)
                    })
                    .map(|id| (*id, "pending timeout")),
            );
        }
        if q > 0 {
            late.extend(
                self.processing
                    .values()
                    .flatten()
                    .filter(|id| {
                        self.all
                            .get(id)
                            .is_some_and(|t| now.saturating_sub(t.updated) > q)
                    })
                    .map(|id| (*id, "processing timeout")),
            );
        }
        late.sort_unstable();
        for (id, why) in late {
            self.finish(id, TaskStatus::Failed, why, now);
        }
    }

    /// Fails every pending or processing task of `client` (the master dropped it).
    pub(super) fn client_gone(&mut self, client: u64, now: u64) {
        let mut ids: Vec<TaskId> = self
            .pending
            .get(&client)
            .into_iter()
            .flatten()
            .chain(self.processing.get(&client).into_iter().flatten())
            .copied()
            .collect();
        ids.sort_unstable();
        for id in ids {
            self.finish(
                id,
                TaskStatus::Failed,
                "the assigned client went away (the master dropped it: its TTL expired)",
                now,
            );
        }
    }

    /// How many tasks are kept (all states).
    pub(super) fn len(&self) -> usize {
        self.all.len()
    }
}
