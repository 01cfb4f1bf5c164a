//! Batches and per-task completion state, shared by the engine and every transport.
//!
//! A task is one [`crate::TransferRequest`]. A transport may cut it into several pieces; the
//! task becomes terminal when its last piece finishes. Invariant: a task is terminal only once
//! no thread of any transport will touch its local memory again, so a caller may reuse the
//! buffer as soon as it sees COMPLETED, FAILED or TIMEOUT.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Mooncake's task status values (same integers as its C API).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum TaskStatus {
    Waiting = 0,
    Pending = 1,
    Invalid = 2,
    Canceled = 3,
    Completed = 4,
    Timeout = 5,
    Failed = 6,
}

impl TaskStatus {
    /// The status with Mooncake's integer `v` (unknown values read as FAILED).
    pub fn from_u8(v: u8) -> TaskStatus {
        match v {
            0 => TaskStatus::Waiting,
            1 => TaskStatus::Pending,
            2 => TaskStatus::Invalid,
            3 => TaskStatus::Canceled,
            4 => TaskStatus::Completed,
            5 => TaskStatus::Timeout,
            _ => TaskStatus::Failed,
        }
    }

    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            TaskStatus::Completed | TaskStatus::Timeout | TaskStatus::Failed | TaskStatus::Canceled
        )
    }
}

/// Status of a task or a whole batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferStatus {
    pub status: TaskStatus,
    pub transferred_bytes: u64,
    /// Why the task failed or timed out.
    pub reason: Option<String>,
    /// The same as a code callers can act on (`None` unless FAILED or TIMEOUT).
    pub cause: Option<FailCause>,
}

/// Why a task failed, as a code (the reason text says it for people).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(u8)]
#[non_exhaustive]
pub enum FailCause {
    /// Anything not listed below.
    #[default]
    Other = 0,
    /// The local range is not inside memory registered with this engine.
    LocalNotRegistered = 1,
    /// The remote range is not inside a buffer the peer published.
    RemoteNotRegistered = 2,
    /// The segment is unknown, not open or cannot be looked up.
    SegmentNotFound = 3,
    /// The peer cannot be reached (connect, handshake, metadata).
    PeerUnreachable = 4,
    /// The peer went away mid-transfer (connection lost, process exited, engine shut down).
    PeerLost = 5,
    /// The peer broke the protocol (bad frame, wrong magic, unexpected data).
    Protocol = 6,
    /// The request's deadline passed.
    Timeout = 7,
    /// This engine is shut down.
    ShutDown = 8,
    /// The peer and this engine do not hold a cluster key in common (`KVFERRY_AUTH_KEY_FILE`
    /// set on one side only, or another key).
    Unauthorized = 9,
}

impl FailCause {
    /// The code as stored and as passed to bindings.
    pub fn code(self) -> u8 {
        self as u8
    }

    pub fn from_code(c: u8) -> FailCause {
        match c {
            1 => FailCause::LocalNotRegistered,
            2 => FailCause::RemoteNotRegistered,
            3 => FailCause::SegmentNotFound,
            4 => FailCause::PeerUnreachable,
            5 => FailCause::PeerLost,
            6 => FailCause::Protocol,
            7 => FailCause::Timeout,
            8 => FailCause::ShutDown,
            9 => FailCause::Unauthorized,
            _ => FailCause::Other,
        }
    }

    /// This cause with its reason text.
    pub fn because(self, reason: impl Into<String>) -> Failure {
        Failure {
            cause: self,
            reason: reason.into(),
        }
    }
}

/// A cause and its reason, as recorded for the first failed piece of a task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub cause: FailCause,
    pub reason: String,
}

impl From<String> for Failure {
    fn from(reason: String) -> Failure {
        FailCause::Other.because(reason)
    }
}

impl From<&str> for Failure {
    fn from(reason: &str) -> Failure {
        FailCause::Other.because(reason)
    }
}

impl From<&crate::Error> for FailCause {
    fn from(e: &crate::Error) -> FailCause {
        use crate::Error as E;
        match e {
            E::LocalNotRegistered { .. } | E::NotRegistered { .. } => FailCause::LocalNotRegistered,
            E::RemoteNotRegistered { .. } => FailCause::RemoteNotRegistered,
            E::UnknownSegmentId(_) | E::SegmentNotFound { .. } | E::SegmentNotRegistered { .. } => {
                FailCause::SegmentNotFound
            }
            E::NoTransport { .. } | E::Handshake { .. } | E::Metadata { .. } => {
                FailCause::PeerUnreachable
            }
            E::Wire { .. } | E::BadMetadata { .. } => FailCause::Protocol,
            E::Io { .. } => FailCause::PeerLost,
            E::Shutdown => FailCause::ShutDown,
            E::Unauthorized { .. } => FailCause::Unauthorized,
            _ => FailCause::Other,
        }
    }
}

impl From<&crate::Error> for Failure {
    fn from(e: &crate::Error) -> Failure {
        FailCause::from(e).because(e.to_string())
    }
}

impl From<crate::Error> for Failure {
    fn from(e: crate::Error) -> Failure {
        Failure::from(&e)
    }
}

/// How a piece of a task ended badly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FailKind {
    Failed,
    Timeout,
}

/// Wakes waiters of a batch when its last task ends.
#[derive(Default)]
pub(crate) struct Signal {
    unfinished: AtomicUsize,
    lock: Mutex<()>,
    cv: Condvar,
}

impl Signal {
    fn notify(&self) {
        let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.cv.notify_all();
    }
}

/// Completion state of one task.
pub(crate) struct TaskState {
    status: AtomicU8,
    transferred: AtomicU64,
    /// Pieces not yet finished.
    pieces: AtomicU32,
    failure: AtomicU8,
    reason: OnceLock<Failure>,
    pub(crate) deadline: Instant,
    signal: Arc<Signal>,
}

const NO_FAILURE: u8 = 0;

impl TaskState {
    pub(crate) fn new(deadline: Instant, signal: Arc<Signal>) -> TaskState {
        signal.unfinished.fetch_add(1, Ordering::AcqRel);
        TaskState {
            status: AtomicU8::new(TaskStatus::Waiting as u8),
            transferred: AtomicU64::new(0),
            pieces: AtomicU32::new(1),
            failure: AtomicU8::new(NO_FAILURE),
            reason: OnceLock::new(),
            deadline,
            signal,
        }
    }

    /// The deadline by which the task must end.
    pub(crate) fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Declares that the task's single piece is being cut into `n` pieces (n >= 1).
    pub(crate) fn split(&self, n: u32) {
        if n > 1 {
            self.pieces.fetch_add(n - 1, Ordering::AcqRel);
        }
    }

    /// Marks the task as handed to the network.
    pub(crate) fn set_pending(&self) {
        let _ = self.status.compare_exchange(
            TaskStatus::Waiting as u8,
            TaskStatus::Pending as u8,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    /// One piece finished successfully, having moved `bytes`.
    pub(crate) fn piece_done(&self, bytes: u64) {
        self.transferred.fetch_add(bytes, Ordering::AcqRel);
        self.finish_piece();
    }

    /// One piece failed. The first failure's reason is kept.
    pub(crate) fn piece_failed(&self, kind: FailKind, reason: impl Into<Failure>) {
        let code = match kind {
            FailKind::Failed => TaskStatus::Failed,
            FailKind::Timeout => TaskStatus::Timeout,
        } as u8;
        if self
            .failure
            .compare_exchange(NO_FAILURE, code, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            let mut f = reason.into();
            if kind == FailKind::Timeout && f.cause == FailCause::Other {
                f.cause = FailCause::Timeout;
            }
            let _ = self.reason.set(f);
        }
        self.finish_piece();
    }

    fn finish_piece(&self) {
        if self.pieces.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let failure = self.failure.load(Ordering::Acquire);
        let final_status = if failure == NO_FAILURE {
            TaskStatus::Completed as u8
        } else {
            failure
        };
        self.status.store(final_status, Ordering::Release);
        let left = self.signal.unfinished.fetch_sub(1, Ordering::AcqRel) - 1;
        if left == 0 {
            self.signal.notify();
        }
    }

    pub(crate) fn status(&self) -> TransferStatus {
        let status = TaskStatus::from_u8(self.status.load(Ordering::Acquire));
        let failure = if status.is_terminal() {
            self.reason.get()
        } else {
            None
        };
        TransferStatus {
            status,
            transferred_bytes: self.transferred.load(Ordering::Acquire),
            reason: failure.map(|f| f.reason.clone()),
            cause: failure.map(|f| f.cause),
        }
    }
}

/// A batch: a fixed capacity of tasks submitted in one or more calls.
pub(crate) struct Batch {
    pub capacity: usize,
    pub tasks: Mutex<Vec<Arc<TaskState>>>,
    pub signal: Arc<Signal>,
}

impl Batch {
    pub(crate) fn new(capacity: usize) -> Batch {
        Batch {
            capacity,
            tasks: Mutex::new(Vec::with_capacity(capacity)),
            signal: Arc::new(Signal::default()),
        }
    }

    pub(crate) fn unfinished(&self) -> usize {
        self.signal.unfinished.load(Ordering::Acquire)
    }

    /// Terminal only once every task is: COMPLETED when all completed, else the first
    /// failed (or timed-out) task's status in submission order. While any task still runs
    /// the batch is PENDING (WAITING before any was handed to the network), even if a
    /// sibling already failed: a caller that sees a terminal batch may reuse every buffer
    /// of it. Bytes are summed over completed tasks.
    pub(crate) fn status(&self) -> TransferStatus {
        let tasks = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        let mut bytes = 0;
        let mut running: Option<TaskStatus> = None;
        let mut failure: Option<TransferStatus> = None;
        for t in tasks.iter() {
            let s = t.status();
            match s.status {
                TaskStatus::Completed => bytes += s.transferred_bytes,
                TaskStatus::Failed | TaskStatus::Timeout | TaskStatus::Canceled => {
                    if failure.is_none() {
                        failure = Some(s);
                    }
                }
                TaskStatus::Pending => running = Some(TaskStatus::Pending),
                _ => {
                    running.get_or_insert(TaskStatus::Waiting);
                }
            }
        }
        let status = match (running, failure) {
            (Some(r), _) => r,
            (None, Some(f)) => return f,
            (None, None) => TaskStatus::Completed,
        };
        TransferStatus {
            status,
            transferred_bytes: bytes,
            reason: None,
            cause: None,
        }
    }

    /// Blocks (without spinning) until every task is terminal or `timeout`.
    pub(crate) fn wait(&self, timeout: Duration) -> TransferStatus {
        self.wait_until(Instant::now().checked_add(timeout));
        self.status()
    }

    /// Blocks until every task is terminal, however long that takes: every transport ends
    /// each task by its deadline, so this returns by the latest deadline (a warning is logged
    /// every 5 s past it, which would be a bug).
    pub(crate) fn wait_terminal(&self) {
        let latest = self
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|t| t.deadline)
            .max();
        let mut until = latest.unwrap_or_else(Instant::now) + Duration::from_secs(5);
        while !self.wait_until(Some(until)) {
            tracing::warn!(
                "a batch has {} task(s) still running {:?} past their deadline",
                self.unfinished(),
                until.elapsed()
            );
            until = Instant::now() + Duration::from_secs(5);
        }
    }

    /// Waits until every task is terminal (true) or `until` passed (false; `None`: never).
    fn wait_until(&self, until: Option<Instant>) -> bool {
        let s = &self.signal;
        let mut g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
        while s.unfinished.load(Ordering::Acquire) > 0 {
            match until {
                None => g = s.cv.wait(g).unwrap_or_else(|e| e.into_inner()),
                Some(u) => {
                    let now = Instant::now();
                    if now >= u {
                        return false;
                    }
                    g =
                        s.cv.wait_timeout(g, u - now)
                            .unwrap_or_else(|e| e.into_inner())
                            .0;
                }
            }
        }
        true
    }
}

impl Batch {
    /// Blocks (without spinning) until every task is terminal or `timeout`; returns each
    /// task's status.
    pub(crate) fn wait_all(&self, timeout: Duration) -> Vec<TransferStatus> {
        self.wait_until(Instant::now().checked_add(timeout));
        self.statuses()
    }

    /// Each task's status, in submission order.
    pub(crate) fn statuses(&self) -> Vec<TransferStatus> {
        self.tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|t| t.status())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_pieces_complete_and_fail() {
        let sig = Arc::new(Signal::default());
        let t = TaskState::new(Instant::now(), Arc::clone(&sig));
        t.split(3);
        t.piece_done(30);
        t.piece_done(30);
        assert_eq!(t.status().status, TaskStatus::Waiting);
        t.piece_done(40);
        assert_eq!(
            t.status(),
            TransferStatus {
                status: TaskStatus::Completed,
                transferred_bytes: 100,
                reason: None,
                cause: None
            }
        );
        assert_eq!(sig.unfinished.load(Ordering::Acquire), 0);

        let t = TaskState::new(Instant::now(), Arc::clone(&sig));
        t.split(2);
        t.piece_failed(FailKind::Timeout, "slow");
        t.piece_failed(FailKind::Failed, "second reason is dropped");
        let s = t.status();
        assert_eq!(s.status, TaskStatus::Timeout);
        assert_eq!(s.reason.as_deref(), Some("slow"));
    }

    #[test]
    fn batch_wait_wakes_on_completion() {
        let b = Arc::new(Batch::new(2));
        let t = Arc::new(TaskState::new(Instant::now(), Arc::clone(&b.signal)));
        b.tasks.lock().unwrap().push(Arc::clone(&t));
        let t2 = Arc::clone(&t);
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            t2.piece_done(5);
        });
        let s = b.wait(Duration::from_secs(5));
        h.join().unwrap();
        assert_eq!(s.status, TaskStatus::Completed);
        assert_eq!(s.transferred_bytes, 5);
        assert_eq!(
            b.wait(Duration::from_millis(1)).status,
            TaskStatus::Completed
        );
    }
}
