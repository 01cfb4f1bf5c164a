//! Replica copy and move tasks the master assigned to this client (Mooncake 0.3.14's task
//! poll thread and `Copy`/`Move`): fetched every ping interval by a thread of their own (a
//! copy may take longer than the client's TTL, so not in the pinger), each carried out and
//! reported (`CompleteTask`).
//!
//! A copy: `CopyStart` reserves room on the targets and leases the source (a replica in this
//! client's own segment, which is why the task came here) → one engine batch writes the
//! source's bytes to every target → `CopyEnd` (the new replicas are readable; a move's
//! source goes), or `PutRevoke` if a write failed. A copy that found no room is tried again
//! up to the task's `max_retry` times, 50 ms × the try apart (as Mooncake); any other error
//! fails the task at once.

use super::rpc::Conn;
use super::Inner;
use crate::error::{StoreError, StoreResult};
use crate::proto::{CopyPlan, Request, Response, TaskAssignment, TaskId, TaskInfo, TaskKind};
use kvferry::{Opcode, TaskStatus, TransferRequest};
use std::sync::atomic::Ordering;
use std::sync::Weak;
use std::time::{Duration, Instant};

/// Tasks fetched at once (Mooncake's `kTaskBatchSize`).
const BATCH: u32 = 10;

impl Inner {
    /// Fetches the tasks assigned to this client, runs them one by one and reports each; how
    /// many ran.
    pub(super) fn run_tasks(&self) -> StoreResult<usize> {
        let tasks = match self
            .call_batch_on(
                vec![Request::FetchTasks {
                    client: self.id,
                    max: BATCH,
                }],
                Conn::Aside,
            )?
            .pop()
        {
            Some(Response::Tasks(t)) => t,
            Some(Response::Err(e)) => return Err(e),
            other => {
                return Err(StoreError::Rpc(format!(
                    "unexpected answer to FetchTasks: {other:?}"
                )))
            }
        };
        for t in &tasks {
            let (ok, message) = match self.run_task(t) {
                Ok(()) => (true, "Task completed successfully".to_string()),
                Err(e) => {
                    tracing::warn!(key = t.key, "replica {:?} task failed: {e}", t.kind);
                    (
                        false,
                        format!("{e} (error {}; max retries: {})", e.code(), t.max_retry),
                    )
                }
            };
            let done = Request::CompleteTask {
                client: self.id,
                id: t.id,
                ok,
                message,
            };
            if let Err(e) = self.call_one(done) {
                tracing::warn!(key = t.key, "reporting a replica task's end: {e}");
            }
        }
        Ok(tasks.len())
    }

    fn run_task(&self, t: &TaskAssignment) -> StoreResult<()> {
        let mut tries = 0u32;
        loop {
            match self.copy(t) {
                Err(StoreError::NoAvailableHandle { .. }) if tries < t.max_retry => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(50 * u64::from(tries)));
                }
                r => return r,
            }
        }
    }

    /// One try of task `t`'s copy (a move's too).
    fn copy(&self, t: &TaskAssignment) -> StoreResult<()> {
        let put = self.next_put.fetch_add(1, Ordering::Relaxed) + 1;
        let start = Request::CopyStart {
            client: self.id,
            key: t.key.clone(),
            source: t.source.clone(),
            targets: t.targets.clone(),
            put,
            remove_source: t.kind == TaskKind::Move,
        };
        let plan = match self.call_one(start) {
            Ok(Response::Copy(p)) => p,
            Ok(other) => {
                return Err(StoreError::Rpc(format!(
                    "unexpected answer to CopyStart: {other:?}"
                )))
            }
            Err(e) => {
                if e == StoreError::OutcomeUnknown {
                    self.revoke(&t.key, put);
                }
                return Err(e);
            }
        };
        let written = self.write_copies(&plan);
        self.queue_releases([plan.read_id]);
        match written {
            Ok(()) => self
                .call_one(Request::CopyEnd {
                    client: self.id,
                    key: t.key.clone(),
                    put,
                })
                .map(|_| ())
                .inspect_err(|_| self.revoke(&t.key, put)),
            Err(e) => {
                self.revoke(&t.key, put);
                Err(e)
            }
        }
    }

    /// Writes the source replica's bytes (in this client's memory) to every target.
    fn write_copies(&self, plan: &CopyPlan) -> StoreResult<()> {
        if plan.targets.is_empty() {
            return Ok(());
        }
        if plan.source.te_endpoint != self.engine.segment_name() {
            return Err(StoreError::InvalidParams(format!(
                "the replica to copy is in segment {}, not this client's ({}): the task went to the wrong client",
                plan.source.te_endpoint,
                self.engine.segment_name()
            )));
        }
        let mut reqs = Vec::with_capacity(plan.targets.len());
        for r in &plan.targets {
            let seg = self
                .engine
                .open_segment(&r.te_endpoint)
                .map_err(|e| StoreError::TransferFailed(e.to_string()))?;
            reqs.push(TransferRequest {
                opcode: Opcode::Write,
                source: plan.source.addr,
                target_id: seg,
                target_offset: r.addr,
                length: plan.size,
            });
        }
        // Until they landed (or can no longer land): what a master that forgot this client
        // is told, as for a put's writes.
        let writes = plan
            .targets
            .iter()
            .map(|r| (r.te_endpoint.clone(), r.addr, plan.size))
            .collect();
        let batch = self
            .rpc
            .writes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .start(writes, Instant::now() + self.cfg.transfer_timeout * 2);
        let result = match self
            .engine
            .transfer_sync_all(&reqs, self.cfg.transfer_timeout)
        {
            Ok(statuses) => match statuses
                .into_iter()
                .find(|s| s.status != TaskStatus::Completed)
            {
                None => Ok(()),
                Some(s) => Err(StoreError::TransferFailed(
                    s.reason.unwrap_or_else(|| format!("{:?}", s.status)),
                )),
            },
            Err(e) => Err(StoreError::TransferFailed(e.to_string())),
        };
        self.rpc
            .writes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .ended(batch, result.is_ok());
        result
    }

    /// Gives a copy's room back (best effort: one the master does not know is an error,
    /// ignored; its room is then freed as a zombie put's).
    fn revoke(&self, key: &str, put: u64) {
        if let Err(e) = self.call_one(Request::PutRevoke {
            client: self.id,
            key: key.to_string(),
            put,
        }) {
            tracing::debug!(key, "revoking a replica copy: {e}");
        }
    }
}

/// Fetches and runs this client's tasks every `every` (Mooncake polls every second); after a
/// failed fetch (no master, or an older one that does not know the request) twice as late
/// each time, up to 30 s, until one succeeds.
pub(super) fn task_loop(inner: Weak<Inner>, every: Duration) {
    let mut wait = every;
    loop {
        std::thread::sleep(wait);
        let Some(inner) = inner.upgrade() else { return };
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        match inner.run_tasks() {
            Ok(_) => wait = every,
            Err(e) => {
                tracing::debug!("fetching replica tasks: {e}");
                wait = (wait * 2).min(every.max(Duration::from_secs(30)));
            }
        }
    }
}

impl super::Client {
    /// Mooncake's `create_copy_task`: the master assigns a copy of `key` to `targets`
    /// (segment names) to the client owning one of its replicas; the task's id.
    pub fn create_copy_task(&self, key: &str, targets: &[String]) -> StoreResult<TaskId> {
        self.check_open()?;
        self.task_id(Request::CreateCopyTask {
            key: key.to_string(),
            targets: targets.to_vec(),
        })
    }

    /// Mooncake's `create_move_task`: `key`'s replica on segment `source` is to move to
    /// `target`; the task's id.
    pub fn create_move_task(&self, key: &str, source: &str, target: &str) -> StoreResult<TaskId> {
        self.check_open()?;
        self.task_id(Request::CreateMoveTask {
            key: key.to_string(),
            source: source.to_string(),
            target: target.to_string(),
        })
    }

    fn task_id(&self, req: Request) -> StoreResult<TaskId> {
        match self.inner.call_one(req)? {
            Response::Task(id) => Ok(id),
            other => Err(StoreError::Rpc(format!("unexpected answer {other:?}"))),
        }
    }

    /// Mooncake's `query_task`: where task `id` is.
    pub fn query_task(&self, id: TaskId) -> StoreResult<TaskInfo> {
        self.check_open()?;
        match self.inner.call_one(Request::QueryTask { id })? {
            Response::TaskInfo(i) => Ok(*i),
            other => Err(StoreError::Rpc(format!("unexpected answer {other:?}"))),
        }
    }

    /// Runs the tasks the master assigned to this client now (its thread does every ping
    /// interval); how many ran.
    pub fn run_tasks(&self) -> StoreResult<usize> {
        self.check_open()?;
        self.inner.run_tasks()
    }
}

#[cfg(test)]
#[path = "tasks_tests.rs"]
mod tests;
