//! The owner's readers of disk records (`disk_read.rs`): a small pool of [`READERS`] threads
//! that read the records of staging requests beside the request's own thread, so that one
//! request's records, and the records of requests from several readers, are read at once
//! (the device sees a queue up to [`READERS`] deep instead of one read at a time).
//!
//! A thread pool of blocking, buffered reads, not `io_uring` (which this kernel allows): a
//! record read is an open, a header read, the value's read into the staging buffer and its
//! checksum, each step able to find the record gone or corrupt and delete it
//! ([`crate::disk::DiskTier::get_into`]); a pool runs that one checked path unchanged, where
//! `io_uring` would need a second read path (and a new dependency) whose buffers the kernel
//! writes while the request is in flight. What bounds a disk get here is the device's latency
//! at its queue depth and the round trips around it, not the cost of submitting a read, so
//! submission batching would not buy back that complexity.
//!
//! Bounded: [`READERS`] threads, started with the client; requests queue in order of arrival
//! (each request's jobs are bounded by `disk_read::MAX_ITEMS`, requests by the handshake
//! port's connections). A job whose thread cannot be started, or in a `fork()` child (which
//! has none of the parent's threads), runs in the caller's thread.

use kvferry::TransferEngine;
use std::sync::mpsc::{self, Receiver, Sender, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Threads reading records: the device's queue depth for disk gets.
pub(super) const READERS: usize = 8;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// The pool. Dropping it ends its threads once the jobs queued are done.
pub(super) struct Readers {
    tx: Option<Mutex<Sender<Job>>>,
    pid: u32,
}

impl Readers {
    /// Starts `n` threads (fewer if the system refuses some; none: jobs run inline).
    pub(super) fn start(n: usize) -> Readers {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let started = (0..n)
            .filter(|i| {
                let rx = Arc::clone(&rx);
                std::thread::Builder::new()
                    .name(format!("kvf-disk-rd{i}"))
                    .spawn(move || work(&rx))
                    .map_err(|e| tracing::warn!("starting a disk reader thread: {e}"))
                    .is_ok()
            })
            .count();
        Readers {
            tx: (started > 0).then(|| Mutex::new(tx)),
            pid: std::process::id(),
        }
    }

    /// Runs `job` on a reader thread (in this thread if there is none).
    pub(super) fn run(&self, job: impl FnOnce() + Send + 'static) {
        let job: Job = Box::new(job);
        let job = match &self.tx {
            Some(tx) if std::process::id() == self.pid => {
                match tx.lock().unwrap_or_else(|e| e.into_inner()).send(job) {
                    Ok(()) => return,
                    // (Every thread gone: the job comes back.)
                    Err(mpsc::SendError(job)) => job,
                }
            }
            _ => job,
        };
        job();
    }
}

/// A release queued: the owner, and the request's body.
type Release = (String, Vec<u8>);

/// Releases waiting for the releases' thread at most (more are sent by their callers).
const RELEASES_QUEUED: usize = 1024;

/// A reader's releases of staged batches (`disk_read.rs`), sent to their owners by a thread
/// of the client's own (started at the first), so that a get does not wait for the owner's
/// answer to one: the owner frees the space when the release comes, or when its hold ends.
#[derive(Default)]
pub(super) struct Releases {
    /// The thread's queue, and the process that started it (none in a `fork()` child).
    tx: Mutex<Option<(SyncSender<Release>, u32)>>,
}

impl Releases {
    /// Queues `body` (a release) for `owner`'s service, to be sent within `timeout`; false
    /// if it is not queued (no thread, or the queue is full): the caller sends it.
    pub(super) fn send(
        &self,
        engine: &Arc<TransferEngine>,
        timeout: Duration,
        owner: &str,
        body: Vec<u8>,
    ) -> bool {
        let mut tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        if tx.is_none() {
            let (t, rx) = mpsc::sync_channel::<Release>(RELEASES_QUEUED);
            // (Weak: the thread does not keep a closed client's engine.)
            let engine = Arc::downgrade(engine);
            let started = std::thread::Builder::new()
                .name("kvf-disk-rel".into())
                .spawn(move || {
                    for (owner, body) in rx {
                        let Some(engine) = engine.upgrade() else {
                            return;
                        };
                        if let Err(e) = engine.call_service(&owner, &body, timeout) {
                            tracing::debug!("releasing staged disk reads at {owner}: {e}");
                        }
                    }
                });
            match started {
                Ok(_) => *tx = Some((t, std::process::id())),
                Err(e) => {
                    tracing::debug!("starting the disk releases' thread: {e}");
                    return false;
                }
            }
        }
        match tx.as_ref() {
            Some((t, pid)) if *pid == std::process::id() => {
                match t.try_send((owner.to_string(), body)) {
                    Ok(()) => true,
                    Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => false,
                }
            }
            _ => false,
        }
    }
}

fn work(rx: &Mutex<Receiver<Job>>) {
    loop {
        // (The lock is held only while waiting for the next job, not while running it.)
        let next = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
        match next {
            // (A job that panics ends alone: its sender drops unanswered, the thread goes on.)
            Ok(job) => {
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            }
            Err(_) => return, // the pool was dropped
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Barrier;
    use std::time::Duration;

    /// `READERS` jobs run at once (each waits at a barrier for all the others: with fewer
    /// threads the barrier would never open and the receive would time out); more queue and
    /// all run.
    #[test]
    fn jobs_run_concurrently_up_to_the_pool_size_and_all_run() {
        let pool = Readers::start(READERS);
        let barrier = Arc::new(Barrier::new(READERS));
        let done = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = mpsc::channel();
        for _ in 0..READERS * 3 {
            let (b, d, tx) = (Arc::clone(&barrier), Arc::clone(&done), tx.clone());
            pool.run(move || {
                b.wait();
                d.fetch_add(1, Ordering::SeqCst);
                let _ = tx.send(());
            });
        }
        for i in 0..READERS * 3 {
            rx.recv_timeout(Duration::from_secs(10))
                .unwrap_or_else(|e| panic!("job {i} of {}: {e}", READERS * 3));
        }
        assert_eq!(done.load(Ordering::SeqCst), READERS * 3);
    }

    /// With no thread, a job runs in the caller's thread before `run` returns.
    #[test]
    fn without_threads_a_job_runs_inline() {
        let pool = Readers::start(0);
        let here = std::thread::current().id();
        let ran = Arc::new(Mutex::new(None));
        let r = Arc::clone(&ran);
        pool.run(move || *r.lock().unwrap() = Some(std::thread::current().id()));
        assert_eq!(*ran.lock().unwrap(), Some(here));
    }
}
