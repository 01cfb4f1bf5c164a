//! One posting thread per peer: a peer's work (pieces to post, slices to post again) runs in
//! the order it came, on a thread of its own, so a peer that does not answer its connect or
//! whose work requests hold every credit until their deadline stalls only its own requests,
//! never another peer's (one posting thread for all peers waited for it). A thread idle for a
//! while ends, and the next work for its peer starts another; once closed, new work is
//! refused, what a thread takes from its queue afterwards is handed to `gone` (work a handler
//! took itself while batching is its own to end), and [`PerPeer::finished`] says when every
//! thread has ended. A thread that panics hands what is still queued to `gone` as it ends.

use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Runs one unit of work for a peer (its name), with the thread's queue to take more from
/// (the posting thread batches retries that way).
pub(super) type Handler<W> = Arc<dyn Fn(&str, W, &Receiver<W>) + Send + Sync>;
/// What becomes of work that can no longer run (closed).
pub(super) type Gone<W> = Arc<dyn Fn(W) + Send + Sync>;

struct State<W> {
    /// The queue of each peer's thread (with the thread's number); `None` once closed.
    queues: Option<HashMap<String, (u64, Sender<W>)>>,
    next: u64,
    /// Threads running.
    live: usize,
}

pub(super) struct PerPeer<W: Send + 'static> {
    st: Arc<Mutex<State<W>>>,
    idle: Duration,
    handler: Handler<W>,
    gone: Gone<W>,
}

impl<W: Send + 'static> PerPeer<W> {
    pub(super) fn new(idle: Duration, handler: Handler<W>, gone: Gone<W>) -> PerPeer<W> {
        PerPeer {
            st: Arc::new(Mutex::new(State {
                queues: Some(HashMap::new()),
                next: 0,
                live: 0,
            })),
            idle,
            handler,
            gone,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<W>> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `work` for `peer`'s thread, starting one if it has none; gives the work back
    /// once closed, or if no thread can be started.
    pub(super) fn send(&self, peer: &str, work: W) -> Result<(), W> {
        let mut st = self.lock();
        let State { queues, next, live } = &mut *st;
        let Some(queues) = queues.as_mut() else {
            return Err(work);
        };
        // (Sent under the lock: a thread that ends removes its queue under it too, after
        // finding it empty, so nothing is sent to a queue whose thread is gone.)
        let work = match queues.get(peer) {
            Some((_, tx)) => match tx.send(work) {
                Ok(()) => return Ok(()),
                Err(mpsc::SendError(w)) => w,
            },
            None => work,
        };
        let (tx, rx) = mpsc::channel();
        let id = *next;
        *next += 1;
        let (st2, handler, gone, idle, name) = (
            Arc::clone(&self.st),
            Arc::clone(&self.handler),
            Arc::clone(&self.gone),
            self.idle,
            peer.to_string(),
        );
        let spawned = std::thread::Builder::new()
            .name("kvf-rdma-post".into())
            .spawn(move || run(&st2, &name, id, &rx, idle, &*handler, &*gone));
        match spawned {
            Ok(_) => {
                // (The thread cannot end before it takes this: ending takes the lock held here.)
                let _ = tx.send(work);
                queues.insert(peer.to_string(), (id, tx));
                *live += 1;
                Ok(())
            }
            Err(e) => {
                tracing::warn!("RDMA: cannot start a posting thread for {peer}: {e}");
                Err(work)
            }
        }
    }

    /// Closes: no more work is taken; each thread hands what is still queued to `gone` and
    /// ends.
    pub(super) fn close(&self) {
        let queues = self.lock().queues.take();
        drop(queues); // the senders: each thread's queue ends once drained
    }

    /// Closed, and every thread has ended.
    pub(super) fn finished(&self) -> bool {
        let st = self.lock();
        st.queues.is_none() && st.live == 0
    }

    /// Threads running.
    #[cfg(test)]
    fn live(&self) -> usize {
        self.lock().live
    }
}

/// Counts its thread out as it ends, however it ends (a handler that panics included): its
/// queue leaves the map first (if still there: so nothing more is sent to it), then whatever
/// is still queued goes to `gone`.
struct Ending<'a, W> {
    st: &'a Mutex<State<W>>,
    peer: &'a str,
    id: u64,
    rx: &'a Receiver<W>,
    gone: &'a (dyn Fn(W) + Send + Sync),
}

impl<W> Drop for Ending<'_, W> {
    fn drop(&mut self) {
        let lock = || self.st.lock().unwrap_or_else(|e| e.into_inner());
        let mine = {
            let mut g = lock();
            match g.queues.as_mut() {
                Some(q) if q.get(self.peer).is_some_and(|(id, _)| *id == self.id) => {
                    q.remove(self.peer)
                }
                _ => None,
            }
        };
        drop(mine); // (its sender: the queue holds only what was sent before)
        while let Ok(work) = self.rx.try_recv() {
            (self.gone)(work);
        }
        lock().live -= 1;
    }
}

fn run<W>(
    st: &Mutex<State<W>>,
    peer: &str,
    id: u64,
    rx: &Receiver<W>,
    idle: Duration,
    handler: &(dyn Fn(&str, W, &Receiver<W>) + Send + Sync),
    gone: &(dyn Fn(W) + Send + Sync),
) {
    let lock = || st.lock().unwrap_or_else(|e| e.into_inner());
    let _ending = Ending {
        st,
        peer,
        id,
        rx,
        gone,
    };
    loop {
        match rx.recv_timeout(idle) {
            Ok(work) => {
                if lock().queues.is_none() {
                    gone(work);
                } else {
                    handler(peer, work, rx);
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                let mut g = lock();
                // Work may have come between the timeout and the lock: take it first.
                if let Ok(work) = rx.try_recv() {
                    drop(g);
                    handler(peer, work, rx);
                    continue;
                }
                // Its queue goes (under the lock, so nothing more is sent to it).
                if let Some(q) = g.queues.as_mut() {
                    if q.get(peer).is_some_and(|(mine, _)| *mine == id) {
                        q.remove(peer);
                    }
                }
                return;
            }
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::wait_for;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Work: (the peer's sequence number, a gate the handler waits on before it returns).
    type Job = (u32, Option<Receiver<()>>);

    #[test]
    fn a_stalled_peer_holds_up_only_its_own_work_in_order_and_idle_threads_end() {
        let done: Arc<Mutex<Vec<(String, u32)>>> = Arc::default();
        let started = Arc::new(AtomicUsize::new(0));
        let (d2, s2) = (Arc::clone(&done), Arc::clone(&started));
        let handler: Handler<Job> =
            Arc::new(move |peer: &str, (n, gate): Job, _rx: &Receiver<Job>| {
                s2.fetch_add(1, Ordering::SeqCst);
                if let Some(g) = gate {
                    let _ = g.recv();
                }
                d2.lock().unwrap().push((peer.to_string(), n));
            });
        let gone_n = Arc::new(AtomicUsize::new(0));
        let g2 = Arc::clone(&gone_n);
        let p = PerPeer::new(
            Duration::from_millis(100),
            handler,
            Arc::new(move |_: Job| {
                g2.fetch_add(1, Ordering::SeqCst);
            }),
        );
        // The dead peer's first job stalls (a connect that does not answer).
        let (release, gate) = mpsc::channel();
        p.send("dead", (1, Some(gate))).unwrap();
        p.send("dead", (2, None)).unwrap();
        for n in 1..=3 {
            p.send("live", (n, None)).unwrap();
        }
        wait_for(
            "the live peer's work done while the dead one stalls",
            || done.lock().unwrap().len() == 3,
        );
        assert_eq!(
            *done.lock().unwrap(),
            [
                ("live".to_string(), 1),
                ("live".to_string(), 2),
                ("live".to_string(), 3)
            ]
        );
        assert_eq!(p.live(), 2);
        release.send(()).unwrap();
        wait_for("the dead peer's work, in order", || {
            done.lock().unwrap().len() == 5
        });
        assert_eq!(
            done.lock().unwrap()[3..],
            [("dead".to_string(), 1), ("dead".to_string(), 2)]
        );
        // Idle threads end; new work for a peer starts another.
        wait_for("idle posting threads to end", || p.live() == 0);
        p.send("live", (4, None)).unwrap();
        wait_for("work after the idle end", || {
            done.lock().unwrap().len() == 6
        });
        // Closed: queued work goes to `gone`, new work is refused, and every thread ends.
        let (release, gate) = mpsc::channel();
        p.send("slow", (1, Some(gate))).unwrap();
        p.send("slow", (2, None)).unwrap();
        wait_for("the slow peer's first job to start", || {
            started.load(Ordering::SeqCst) == 7
        });
        p.close();
        assert!(p.send("slow", (3, None)).is_err(), "closed");
        assert!(!p.finished(), "a thread still runs");
        release.send(()).unwrap();
        wait_for("every thread to end after close", || p.finished());
        assert_eq!(
            gone_n.load(Ordering::SeqCst),
            1,
            "the work queued behind the running one"
        );
    }

    /// A handler that panics ends its thread: what was queued behind goes to `gone`, the
    /// thread is counted out (so `finished` can become true), and the peer's next work starts
    /// another thread.
    #[test]
    fn a_panicking_handler_hands_back_what_was_queued_and_is_counted_out() {
        let ran = Arc::new(AtomicUsize::new(0));
        let r2 = Arc::clone(&ran);
        let handler: Handler<u32> = Arc::new(move |_: &str, n: u32, _: &Receiver<u32>| {
            std::thread::sleep(Duration::from_millis(20));
            assert!(n != 1, "job 1 panics (on purpose)");
            r2.fetch_add(1, Ordering::SeqCst);
        });
        let gone_n = Arc::new(AtomicUsize::new(0));
        let g2 = Arc::clone(&gone_n);
        let p = PerPeer::new(
            Duration::from_secs(10),
            handler,
            Arc::new(move |_: u32| {
                g2.fetch_add(1, Ordering::SeqCst);
            }),
        );
        p.send("peer", 1).unwrap();
        p.send("peer", 2).unwrap();
        p.send("peer", 3).unwrap();
        wait_for("the panicked thread to be counted out", || p.live() == 0);
        assert_eq!(
            (ran.load(Ordering::SeqCst), gone_n.load(Ordering::SeqCst)),
            (0, 2),
            "jobs 2 and 3 handed back"
        );
        p.send("peer", 4).unwrap();
        wait_for("a new thread for the peer", || {
            ran.load(Ordering::SeqCst) == 1
        });
        p.close();
        wait_for("every thread to end after close", || p.finished());
    }
}
