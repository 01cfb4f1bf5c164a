//! [`Batch`]: the handle of one batch of requests, owned by its caller.

use super::{Inner, TransferRequest};
use crate::batch::{Batch as Tasks, TransferStatus};
use crate::error::{Error, Result};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// A batch of requests ([`crate::TransferEngine::allocate_batch`]): submit requests into it,
/// read their status, wait for them.
///
/// It is the batch itself, not a name for one: dropping it waits until every request it
/// submitted is terminal (COMPLETED, FAILED or TIMEOUT), so no transport touches the memory
/// of its requests once the drop returned, and the caller may free or reuse it. The wait is
/// bounded: every request ends by its deadline (the engine's transfer timeout plus 1 ns per
/// byte, or less through [`Batch::submit_within`]). A batch may outlive its engine: its
/// requests then end as the engine shuts down.
///
/// A request reported terminal (by [`Batch::status`], [`Batch::task_status`] or a wait) is
/// over: no byte of it lands in local memory after that.
pub struct Batch {
    engine: Weak<Inner>,
    tasks: Arc<Tasks>,
    id: u64,
    /// The process that allocated it: in a `fork()` child the engine's threads do not exist,
    /// and a drop there does not wait for them.
    pid: u32,
}

impl Batch {
    pub(super) fn new(engine: &Arc<Inner>, id: u64, capacity: usize) -> Batch {
        Batch {
            engine: Arc::downgrade(engine),
            tasks: Arc::new(Tasks::new(capacity)),
            id,
            pid: std::process::id(),
        }
    }

    /// The engine's number for this batch (unique per engine, never 0).
    pub fn id(&self) -> u64 {
        self.id
    }

    pub(super) fn engine(&self) -> Result<Arc<Inner>> {
        self.engine.upgrade().ok_or(Error::Shutdown)
    }

    /// Submits requests into the batch. Problems with one request (unregistered range,
    /// unknown segment) fail that task with a reason; the call itself fails only when the
    /// batch's capacity would be exceeded or the engine is gone.
    pub fn submit(&self, requests: &[TransferRequest]) -> Result<()> {
        self.engine()?
            .submit(self.id, &self.tasks, requests, false, None)
    }

    /// [`Batch::submit`] with every request's deadline at most `timeout` from now (each is
    /// otherwise the transfer timeout plus 1 ns per byte): what a caller that waits `timeout`
    /// for the batch needs for the requests to end by then, not merely the wait.
    pub fn submit_within(&self, requests: &[TransferRequest], timeout: Duration) -> Result<()> {
        self.engine()?.submit(
            self.id,
            &self.tasks,
            requests,
            false,
            Instant::now().checked_add(timeout),
        )
    }

    /// [`Batch::submit`] through an engine the caller already holds, run in the caller's
    /// thread where a transport can if `inline`, every deadline at most `cap`.
    pub(super) fn submit_with(
        &self,
        engine: &Inner,
        requests: &[TransferRequest],
        inline: bool,
        cap: Option<Instant>,
    ) -> Result<()> {
        engine.submit(self.id, &self.tasks, requests, inline, cap)
    }

    /// Requests run in the caller's thread where a transport can (`transfer_sync`).
    pub(super) fn submit_inline(
        &self,
        engine: &Inner,
        requests: &[TransferRequest],
        cap: Option<Instant>,
    ) -> Result<()> {
        engine.submit(self.id, &self.tasks, requests, true, cap)
    }

    /// Aggregate status: terminal only once every task is (COMPLETED when all completed, else
    /// the first failed task's status, in submission order); PENDING or WAITING while any
    /// task runs, even after a sibling failed. Bytes are summed over completed tasks.
    pub fn status(&self) -> TransferStatus {
        self.tasks.status()
    }

    /// Status of task `task` (in submission order, from 0).
    pub fn task_status(&self, task: usize) -> Result<TransferStatus> {
        let tasks = self.tasks.tasks.lock().unwrap_or_else(|e| e.into_inner());
        tasks
            .get(task)
            .map(|t| t.status())
            .ok_or(Error::UnknownTask {
                batch: self.id,
                task,
                len: tasks.len(),
            })
    }

    /// Each task's status, in submission order.
    pub fn task_statuses(&self) -> Vec<TransferStatus> {
        self.tasks.statuses()
    }

    /// Whether every task submitted so far is terminal (then nothing of the batch touches
    /// local memory any more, and dropping it does not wait).
    pub fn is_done(&self) -> bool {
        self.tasks.unfinished() == 0
    }

    /// Blocks (without spinning) until every task is terminal or `timeout` passed; returns
    /// the batch status (terminal only when every task is, see [`Batch::status`]).
    pub fn wait(&self, timeout: Duration) -> TransferStatus {
        self.tasks.wait(timeout)
    }

    /// Blocks until every task is terminal (each ends by its deadline) and returns the batch
    /// status, which then is terminal.
    pub fn wait_done(&self) -> TransferStatus {
        self.tasks.wait_terminal();
        self.tasks.status()
    }
}

impl Drop for Batch {
    /// Waits until every task is terminal (see [`Batch`]). In a `fork()` child's copy it
    /// does not wait: the engine's threads are not in that process.
    fn drop(&mut self) {
        if self.tasks.unfinished() > 0 && std::process::id() == self.pid {
            self.tasks.wait_terminal();
        }
    }
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("id", &self.id)
            .field("capacity", &self.tasks.capacity)
            .field("unfinished", &self.tasks.unfinished())
            .finish()
    }
}
