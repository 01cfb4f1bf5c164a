//! A lane's queue as a sans-IO state machine: which requests wait, which are on the wire,
//! which connection (generation) they went out on, and what becomes of them when that
//! connection fails, a deadline passes, the lane idles or the engine stops.
//!
//! No sockets, no clock and no threads here: the lane's writer and reader threads
//! (`lane.rs`) hold this under their lock, pass in the time, do the system calls and act on
//! what the methods return. Every rule is therefore unit-tested below with synthetic times
//! and ops (the retry rule itself is [`super::rules::fate`]). `C` is the connection (an
//! `Arc<TcpStream>` in the lane, `()` or a number in tests); `O` a queued request.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// What the queue needs to know about a request.
pub(super) trait QueuedOp {
    fn len(&self) -> u64;
    /// The request's absolute deadline.
    fn deadline(&self) -> Instant;
    /// Counts one more survived failure (it goes out again on a new connection).
    fn retried(&mut self);
}

/// A connection quiet for this long is checked for a close by the peer before it is used.
pub(super) const STALE_CHECK_AFTER: Duration = Duration::from_millis(1);

pub(super) struct LaneQueue<O, C> {
    /// Not yet on the wire, in order.
    pub(super) pending: VecDeque<O>,
    /// No request in `pending` has an earlier deadline than this (a lower bound: requests
    /// that leave do not raise it), so [`LaneQueue::take_expired`] looks through the queue
    /// only once a deadline may have passed. `None`: nothing was queued since the last look.
    pending_due: Option<Instant>,
    /// Sent on connection `gen`, answers awaited in this order.
    pub(super) inflight: VecDeque<O>,
    conn: Option<C>,
    /// Bumped at every new connection; stale failures of older ones are ignored.
    gen: u64,
    shutdown: bool,
    /// A caller thread is running a request on the connection itself.
    inline: bool,
    /// The reader holds an op it is still receiving (taken off `inflight`).
    reading: bool,
    /// Idle too long: the connection is closed, the threads end; new work goes to new lanes.
    retired: bool,
    /// The segment was just opened: the writer connects before any request asks it to
    /// ([`LaneQueue::warm`]), so the first request finds the connection made.
    warm: bool,
    /// When work was last queued (or run inline) on this lane.
    last_used: Instant,
    /// When a request last went out on the connection.
    last_sent: Instant,
}

/// A run of pending requests moved to `inflight[first..first + n]`, to go out on `conn` in
/// one gathered write, which stops at the deadline of the request whose bytes are going out
/// ([`super::rules::deadline_at`]).
pub(super) struct Send<C> {
    pub(super) conn: C,
    pub(super) gen: u64,
    pub(super) first: usize,
    pub(super) n: usize,
    /// The reader was idle (nothing was in flight): wake it.
    pub(super) wake_reader: bool,
}

impl<O: QueuedOp, C: Clone> LaneQueue<O, C> {
    pub(super) fn new(now: Instant) -> LaneQueue<O, C> {
        LaneQueue {
            pending: VecDeque::new(),
            pending_due: None,
            inflight: VecDeque::new(),
            conn: None,
            gen: 0,
            shutdown: false,
            inline: false,
            reading: false,
            retired: false,
            warm: false,
            last_used: now,
            last_sent: now,
        }
    }

    /// Nothing queued, in flight or running inline.
    pub(super) fn idle(&self) -> bool {
        self.pending.is_empty() && self.inflight.is_empty() && !self.inline && !self.reading
    }

    pub(super) fn is_shutdown(&self) -> bool {
        self.shutdown
    }

    pub(super) fn is_retired(&self) -> bool {
        self.retired
    }

    /// Queues requests; gives them back if the lane closed (idle or stopping): they go to
    /// new lanes.
    pub(super) fn enqueue(&mut self, ops: Vec<O>, now: Instant) -> Result<(), Vec<O>> {
        if self.retired || self.shutdown {
            return Err(ops);
        }
        self.last_used = now;
        for op in &ops {
            self.note_due(op.deadline());
        }
        self.pending.extend(ops);
        Ok(())
    }

    fn note_due(&mut self, deadline: Instant) {
        self.pending_due = Some(self.pending_due.map_or(deadline, |d| d.min(deadline)));
    }

    /// The writer has nothing to do (and should sleep until woken).
    pub(super) fn writer_waits(&self) -> bool {
        (self.pending.is_empty() && !self.wants_connection() || self.inline)
            && !self.shutdown
            && !self.retired
    }

    /// Asks the writer to connect now, with nothing to send yet (the peer's segment was just
    /// opened); counts as a use, so the lane stays open for its idle time. Whether the writer
    /// must be woken: false when connected, or closing.
    pub(super) fn warm(&mut self, now: Instant) -> bool {
        if self.retired || self.shutdown || self.conn.is_some() {
            return false;
        }
        self.warm = true;
        self.last_used = now;
        true
    }

    /// A connection was asked for by [`LaneQueue::warm`] and none is made yet.
    fn wants_connection(&self) -> bool {
        self.warm && self.conn.is_none()
    }

    /// The writer starts connecting: the request of [`LaneQueue::warm`] is taken (one
    /// attempt: a failure is left for the first request to meet and report).
    pub(super) fn connecting(&mut self) {
        self.warm = false;
    }

    /// The writer's thread ends: retired with nothing left to send.
    pub(super) fn writer_done(&self) -> bool {
        self.retired && self.pending.is_empty()
    }

    /// The reader has nothing to receive (and should sleep until woken).
    pub(super) fn reader_waits(&self) -> bool {
        (self.inflight.is_empty() || self.conn.is_none() || self.inline)
            && !self.shutdown
            && !self.retired
    }

    /// The reader's thread ends.
    pub(super) fn reader_done(&self) -> bool {
        self.shutdown || self.retired
    }

    /// Takes every request off the lane (engine shutdown): they fail.
    pub(super) fn drain_all(&mut self) -> Vec<O> {
        self.pending
            .drain(..)
            .chain(self.inflight.drain(..))
            .collect()
    }

    /// Takes the pending requests whose deadline passed, wherever they are in the queue (a
    /// short deadline queued behind a long one included): they end as timed out, never sent.
    /// The queue is looked through only when its earliest deadline may have passed.
    pub(super) fn take_expired(&mut self, now: Instant) -> Vec<O> {
        if self.pending_due.is_none_or(|d| d > now) {
            return Vec::new();
        }
        let (mut expired, mut due) = (Vec::new(), None::<Instant>);
        for op in std::mem::take(&mut self.pending) {
            let d = op.deadline();
            if d <= now {
                expired.push(op);
            } else {
                due = Some(due.map_or(d, |e| e.min(d)));
                self.pending.push_back(op);
            }
        }
        self.pending_due = due;
        expired
    }

    /// Whether the connection should be checked for a close by the peer before use: it
    /// has been quiet a while and no byte may be waiting on it (nothing in flight, not
    /// even the payload the reader is still receiving).
    pub(super) fn check_closed_by_peer(&self, now: Instant) -> Option<C> {
        if !self.inflight.is_empty()
            || self.reading
            || self.inline
            || now.saturating_duration_since(self.last_sent) < STALE_CHECK_AFTER
        {
            return None;
        }
        self.conn.clone()
    }

    /// Forgets the connection (it broke, or the peer closed it) and returns it to be shut.
    /// Requests in flight stay where they are: [`LaneQueue::on_conn_failed`] decides them.
    pub(super) fn drop_conn(&mut self) -> Option<C> {
        self.conn.take()
    }

    pub(super) fn connected(&self) -> bool {
        self.conn.is_some()
    }

    /// The current connection, if any.
    pub(super) fn conn_ref(&self) -> Option<&C> {
        self.conn.as_ref()
    }

    /// A new connection is up: requests go out on it as generation [`LaneQueue::gen`].
    pub(super) fn on_connected(&mut self, conn: C) -> u64 {
        self.gen += 1;
        self.conn = Some(conn);
        self.gen
    }

    /// Moves a run of pending requests (at most `max_ops`, stopping after the one that
    /// reaches `max_bytes`) to `inflight` and hands them to the connection. `None` without
    /// a connection or pending requests.
    pub(super) fn next_send(
        &mut self,
        now: Instant,
        max_ops: usize,
        max_bytes: u64,
    ) -> Option<Send<C>> {
        let conn = self.conn.clone()?;
        if self.pending.is_empty() {
            return None;
        }
        self.last_sent = now;
        let wake_reader = self.inflight.is_empty();
        let mut n = 0;
        let mut bytes = 0u64;
        while let Some(op) = self.pending.pop_front() {
            bytes += op.len();
            self.inflight.push_back(op);
            n += 1;
            if n >= max_ops || bytes >= max_bytes {
                break;
            }
        }
        Some(Send {
            conn,
            gen: self.gen,
            first: self.inflight.len() - n,
            n,
            wake_reader,
        })
    }

    /// Connection `gen` failed (`broken`: closed or reset; else a deadline passed). `None`
    /// if that is not the current connection (another thread already handled it, or it
    /// was replaced): nothing changes. Otherwise the connection is forgotten and returned
    /// to be shut, and every request that was in flight on it is decided by `decide`
    /// (`None`: send it again — it goes back to the head of `pending`, in its order, with
    /// one more attempt counted — or how it ends, returned with it).
    #[allow(clippy::type_complexity)]
    pub(super) fn on_conn_failed<E>(
        &mut self,
        gen: u64,
        mut decide: impl FnMut(&O) -> Option<E>,
    ) -> Option<(C, Vec<(O, E)>)> {
        if self.gen != gen {
            return None;
        }
        let conn = self.conn.take()?;
        let mut ended = Vec::new();
        let inflight: Vec<O> = self.inflight.drain(..).collect();
        for mut op in inflight.into_iter().rev() {
            match decide(&op) {
                None => {
                    op.retried();
                    self.note_due(op.deadline());
                    self.pending.push_front(op);
                }
                Some(e) => ended.push((op, e)),
            }
        }
        ended.reverse();
        Some((conn, ended))
    }

    /// What the reader receives next: the oldest request in flight and its connection.
    pub(super) fn reader_front(&self) -> Option<(C, u64, &O)> {
        if self.inline {
            return None;
        }
        Some((self.conn.clone()?, self.gen, self.inflight.front()?))
    }

    /// The reader takes the oldest request in flight (its answer began) if connection
    /// `gen` is still current; it then counts as being read until
    /// [`LaneQueue::done_reading`].
    pub(super) fn take_front(&mut self, gen: u64) -> Option<O> {
        if self.gen != gen {
            return None;
        }
        let op = self.inflight.pop_front();
        self.reading = op.is_some();
        op
    }

    /// The reader is done with its request. True if the writer has work waiting.
    pub(super) fn done_reading(&mut self) -> bool {
        self.reading = false;
        !self.pending.is_empty()
    }

    /// A request whose receive failed goes back to the head of `inflight` so that
    /// [`LaneQueue::on_conn_failed`] decides it with the others — if its connection is still
    /// current. Otherwise (already failed and handled) it is given back to be ended alone.
    pub(super) fn put_back(&mut self, gen: u64, op: O) -> Result<(), O> {
        if self.gen == gen && self.conn.is_some() {
            self.inflight.push_front(op);
            Ok(())
        } else {
            Err(op)
        }
    }

    /// A caller thread may run one request on the connection itself when the lane is
    /// connected and idle: the lane's threads then stay off the connection until
    /// [`LaneQueue::end_inline`].
    pub(super) fn begin_inline(&mut self, now: Instant) -> Option<(C, u64)> {
        if !self.idle() || self.shutdown || self.retired {
            return None;
        }
        let conn = self.conn.clone()?;
        self.inline = true;
        self.last_used = now;
        self.last_sent = now;
        Some((conn, self.gen))
    }

    /// The inline request ended; `unusable`: the stream cannot carry more (rejection,
    /// protocol error, broken), then the connection is forgotten and returned to be shut.
    pub(super) fn end_inline(&mut self, gen: u64, unusable: bool) -> Option<C> {
        self.inline = false;
        if unusable && self.gen == gen {
            self.conn.take()
        } else {
            None
        }
    }

    /// An inline READ whose connection broke goes to the lane's threads for one retry (at
    /// the head of `pending`, counted as an attempt).
    pub(super) fn retry_from_inline(&mut self, mut op: O) {
        op.retried();
        self.note_due(op.deadline());
        self.pending.push_front(op);
    }

    /// Whether the lane has been idle for `idle` and may close.
    pub(super) fn may_retire(&self, now: Instant, idle: Duration) -> bool {
        self.idle()
            && !self.shutdown
            && !self.retired
            && now.saturating_duration_since(self.last_used) >= idle
    }

    /// Closes the lane as idle: its threads end; new work is refused (and goes to new lanes).
    pub(super) fn retire(&mut self) -> Option<C> {
        self.retired = true;
        self.conn.take()
    }

    /// The engine stops: the threads end, what is queued fails.
    pub(super) fn stop(&mut self) -> Option<C> {
        self.shutdown = true;
        self.conn.take()
    }
}

#[cfg(test)]
mod tests {
    use super::super::rules::{self, Failed, Fate};
    use super::*;
    use crate::batch::FailKind;
    use crate::wire::tcp::Opcode;

    #[derive(Debug, PartialEq)]
    struct Op {
        id: u32,
        opcode: Opcode,
        len: u64,
        deadline: Instant,
        attempts: u8,
    }

    impl QueuedOp for Op {
        fn len(&self) -> u64 {
            self.len
        }
        fn deadline(&self) -> Instant {
            self.deadline
        }
        fn retried(&mut self) {
            self.attempts += 1;
        }
    }

    fn op(id: u32, opcode: Opcode, len: u64, deadline: Instant) -> Op {
        Op {
            id,
            opcode,
            len,
            deadline,
            attempts: 0,
        }
    }

    fn ids<'a>(ops: impl IntoIterator<Item = &'a Op>) -> Vec<u32> {
        ops.into_iter().map(|o| o.id).collect()
    }

    /// The lane's decision: the retry rule of the protocol, for a broken connection.
    fn decide(now: Instant, broken: bool) -> impl FnMut(&Op) -> Option<FailKind> {
        move |o: &Op| {
            let f = Failed {
                broken,
                attempts: o.attempts,
                revoked: false,
                deadline: o.deadline,
                untouched: false,
            };
            match rules::fate(o.opcode, f, now, "peer", "reset") {
                Fate::Retry => None,
                Fate::End(kind, _) => Some(kind),
            }
        }
    }

    /// A lane warmed when its segment is opened has its writer connect with nothing queued,
    /// once: after the attempt (made or failed) the writer sleeps again; a connected or
    /// closing lane is not woken; the warm-up counts as a use for the idle bound.
    #[test]
    fn a_warmed_lane_connects_once_with_nothing_queued() {
        let t0 = Instant::now();
        let idle = Duration::from_secs(5);
        let mut q: LaneQueue<Op, u32> = LaneQueue::new(t0);
        assert!(q.writer_waits(), "nothing to do before the warm-up");
        let t1 = t0 + Duration::from_secs(4);
        assert!(q.warm(t1), "an unconnected lane wakes its writer");
        assert!(
            !q.writer_waits() && !q.connected(),
            "the writer must connect"
        );
        assert!(!q.may_retire(t0 + idle, idle), "the warm-up is a use");
        q.connecting();
        assert!(
            q.writer_waits(),
            "one attempt: a failed one is not repeated"
        );
        assert!(q.warm(t1));
        q.connecting();
        q.on_connected(7);
        assert!(q.writer_waits() && q.next_send(t1, 256, 1 << 20).is_none());
        assert!(!q.warm(t1), "a connected lane is not woken");
        assert!(q.may_retire(t1 + idle, idle));
        let mut closing: LaneQueue<Op, u32> = LaneQueue::new(t0);
        closing.retire();
        assert!(!closing.warm(t0) && closing.writer_done());
        let mut stopped: LaneQueue<Op, u32> = LaneQueue::new(t0);
        stopped.stop();
        assert!(!stopped.warm(t0));
    }

    #[test]
    fn a_broken_connection_sends_its_reads_again_in_order_and_ends_its_writes() {
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(10);
        let mut q: LaneQueue<Op, u32> = LaneQueue::new(t0);
        let gen = q.on_connected(7);
        let ops = vec![
            op(1, Opcode::Read, 4096, later),
            op(2, Opcode::Write, 4096, later),
            op(3, Opcode::Read, 4096, later),
        ];
        q.enqueue(ops, t0).unwrap();
        let s = q.next_send(t0, 256, 1 << 20).unwrap();
        assert_eq!(
            (s.conn, s.gen, s.first, s.n, s.wake_reader),
            (7, gen, 0, 3, true)
        );
        q.enqueue(vec![op(4, Opcode::Read, 4096, later)], t0)
            .unwrap();
        let (conn, ended) = q.on_conn_failed(gen, decide(t0, true)).unwrap();
        assert_eq!(conn, 7);
        // The WRITE may have partly landed: it is never sent again.
        assert_eq!(
            ended.iter().map(|(o, k)| (o.id, *k)).collect::<Vec<_>>(),
            vec![(2, FailKind::Failed)]
        );
        // The READs go first, in their order, one attempt counted, before what was pending.
        assert_eq!(ids(&q.pending), vec![1, 3, 4]);
        assert_eq!(
            q.pending.iter().map(|o| o.attempts).collect::<Vec<_>>(),
            vec![1, 1, 0]
        );
        assert!(q.inflight.is_empty() && !q.connected());
        // A second failure of the same connection (the other thread saw it too) changes nothing.
        assert!(q.on_conn_failed(gen, decide(t0, true)).is_none());
        // On the next connection, a READ that already survived a failure is not retried again.
        let gen2 = q.on_connected(8);
        q.next_send(t0, 256, 1 << 20).unwrap();
        let (_, ended) = q.on_conn_failed(gen2, decide(t0, true)).unwrap();
        assert_eq!(ids(ended.iter().map(|(o, _)| o)), vec![1, 3]);
        assert_eq!(ids(&q.pending), vec![4]);
    }

    #[test]
    fn a_deadline_ends_what_was_in_flight_and_nothing_is_retried() {
        let t0 = Instant::now();
        let mut q: LaneQueue<Op, ()> = LaneQueue::new(t0);
        let gen = q.on_connected(());
        q.enqueue(
            vec![
                op(1, Opcode::Read, 1, t0 + Duration::from_millis(5)),
                op(2, Opcode::Read, 1, t0 + Duration::from_secs(5)),
            ],
            t0,
        )
        .unwrap();
        q.next_send(t0, 256, 1 << 20).unwrap();
        // The connection is dropped because op 1's deadline passed: op 1 times out; op 2
        // was not broken by the peer either (no retry on a deadline), so it fails.
        let now = t0 + Duration::from_millis(6);
        let (_, ended) = q.on_conn_failed(gen, decide(now, false)).unwrap();
        assert_eq!(
            ended.iter().map(|(o, k)| (o.id, *k)).collect::<Vec<_>>(),
            vec![(1, FailKind::Timeout), (2, FailKind::Failed)]
        );
        assert!(q.pending.is_empty());
    }

    #[test]
    fn requests_past_their_deadline_are_never_sent() {
        let t0 = Instant::now();
        let mut q: LaneQueue<Op, ()> = LaneQueue::new(t0);
        q.on_connected(());
        let soon = t0 + Duration::from_millis(1);
        let later = t0 + Duration::from_secs(1);
        q.enqueue(
            vec![
                op(1, Opcode::Write, 1, soon),
                op(2, Opcode::Write, 1, soon),
                op(3, Opcode::Write, 1, later),
            ],
            t0,
        )
        .unwrap();
        assert!(q.take_expired(t0).is_empty());
        let now = t0 + Duration::from_millis(2);
        assert_eq!(ids(&q.take_expired(now)), vec![1, 2]);
        let s = q.next_send(now, 256, 1 << 20).unwrap();
        assert_eq!((s.first, s.n), (0, 1));
        assert_eq!(ids(&q.inflight), vec![3]);
    }

    /// A short deadline queued behind longer ones ends when it passes, not once the requests
    /// before it have gone (the queue was looked at from its front only); the others keep
    /// their order. A request sent again after a failed connection counts too.
    #[test]
    fn a_short_deadline_behind_long_ones_expires_in_time() {
        let t0 = Instant::now();
        let mut q: LaneQueue<Op, ()> = LaneQueue::new(t0);
        let (soon, later) = (t0 + Duration::from_millis(1), t0 + Duration::from_secs(1));
        q.enqueue(
            vec![
                op(1, Opcode::Write, 1, later),
                op(2, Opcode::Write, 1, soon),
                op(3, Opcode::Write, 1, later),
                op(4, Opcode::Read, 1, soon),
            ],
            t0,
        )
        .unwrap();
        assert!(q.take_expired(t0).is_empty());
        let now = t0 + Duration::from_millis(2);
        assert_eq!(ids(&q.take_expired(now)), vec![2, 4]);
        assert_eq!(ids(&q.pending), vec![1, 3]);
        assert!(q.take_expired(now).is_empty());
        // On the wire, then its connection fails: back in `pending`, and it expires there.
        q.on_connected(());
        q.enqueue(
            vec![op(5, Opcode::Read, 1, t0 + Duration::from_millis(5))],
            now,
        )
        .unwrap();
        let s = q.next_send(now, 256, 1 << 20).unwrap();
        assert_eq!(s.n, 3);
        // Looked at past op 5's deadline while it is on the wire: nothing pending, and the
        // bound forgets it; the failed connection's requests set it again.
        assert!(q.take_expired(t0 + Duration::from_millis(6)).is_empty());
        q.on_conn_failed(s.gen, |_| None::<()>).unwrap();
        assert_eq!(ids(&q.pending), vec![1, 3, 5]);
        assert_eq!(ids(&q.take_expired(t0 + Duration::from_millis(6))), vec![5]);
        assert_eq!(ids(&q.pending), vec![1, 3]);
    }

    #[test]
    fn a_gathered_write_stops_at_the_op_and_byte_limits() {
        let t0 = Instant::now();
        let mut q: LaneQueue<Op, ()> = LaneQueue::new(t0);
        // No connection: nothing goes out.
        q.enqueue(
            (0..10)
                .map(|i| {
                    op(
                        i,
                        Opcode::Write,
                        100,
                        t0 + Duration::from_secs(10 - i as u64),
                    )
                })
                .collect(),
            t0,
        )
        .unwrap();
        assert!(q.next_send(t0, 4, 1 << 20).is_none());
        q.on_connected(());
        let s = q.next_send(t0, 4, 1 << 20).unwrap();
        assert_eq!((s.first, s.n, s.wake_reader), (0, 4, true));
        // Byte limit: the op that reaches it is the last of the run.
        let s = q.next_send(t0, 256, 250).unwrap();
        assert_eq!((s.first, s.n, s.wake_reader), (4, 3, false));
        let s = q.next_send(t0, 256, 1 << 20).unwrap();
        assert_eq!((s.first, s.n), (7, 3));
        assert!(q.next_send(t0, 256, 1 << 20).is_none());
        assert_eq!(ids(&q.inflight), (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn the_reader_takes_answers_only_for_its_connection() {
        let t0 = Instant::now();
        let far = t0 + Duration::from_secs(10);
        let mut q: LaneQueue<Op, u32> = LaneQueue::new(t0);
        assert!(q.reader_waits());
        let g1 = q.on_connected(1);
        q.enqueue(
            vec![op(1, Opcode::Read, 1, far), op(2, Opcode::Read, 1, far)],
            t0,
        )
        .unwrap();
        assert!(q.reader_waits(), "nothing in flight yet");
        q.next_send(t0, 256, 1 << 20).unwrap();
        let (c, g, front) = q.reader_front().unwrap();
        assert_eq!((c, g, front.id), (1, g1, 1));
        let first = q.take_front(g1).unwrap();
        assert!(!q.idle(), "an answer being received keeps the lane busy");
        assert!(
            q.check_closed_by_peer(t0 + Duration::from_secs(1))
                .is_none(),
            "bytes may be waiting: no peek"
        );
        // Its receive fails; meanwhile the writer replaced the connection.
        q.on_conn_failed(g1, decide(t0, true)).unwrap();
        let g2 = q.on_connected(2);
        // The op is not put back on a connection it never went out on: it ends alone.
        let back = q.put_back(g1, first).unwrap_err();
        assert_eq!(back.id, 1);
        q.done_reading();
        // An answer on the old connection cannot claim a request sent on the new one.
        q.next_send(t0, 256, 1 << 20).unwrap();
        assert!(q.take_front(g1).is_none());
        assert_eq!(q.take_front(g2).unwrap().id, 2);
        // A failure of the current connection: the op goes back to be decided with the rest.
        let op2 = op(2, Opcode::Read, 1, far);
        q.put_back(g2, op2).unwrap();
        assert_eq!(ids(&q.inflight), vec![2]);
    }

    #[test]
    fn an_inline_request_keeps_the_lane_threads_off_the_connection() {
        let t0 = Instant::now();
        let far = t0 + Duration::from_secs(10);
        let mut q: LaneQueue<Op, u32> = LaneQueue::new(t0);
        assert!(q.begin_inline(t0).is_none(), "not connected");
        let g = q.on_connected(3);
        let (c, gi) = q.begin_inline(t0).unwrap();
        assert_eq!((c, gi), (3, g));
        assert!(q.begin_inline(t0).is_none(), "one at a time");
        // Work queued meanwhile waits: neither thread touches the connection.
        q.enqueue(vec![op(1, Opcode::Read, 1, far)], t0).unwrap();
        assert!(q.writer_waits());
        assert!(q.end_inline(g, false).is_none());
        assert!(!q.writer_waits());
        assert!(q.begin_inline(t0).is_none(), "not idle: work is pending");
        q.next_send(t0, 256, 1 << 20).unwrap();
        q.take_front(g).unwrap();
        q.done_reading();
        // A broken inline READ: the connection goes, the request is retried by the threads.
        let (_, g) = q.begin_inline(t0).unwrap();
        assert_eq!(q.end_inline(g, true), Some(3));
        q.retry_from_inline(op(2, Opcode::Read, 1, far));
        assert_eq!(q.pending.front().map(|o| (o.id, o.attempts)), Some((2, 1)));
        assert!(q.end_inline(g, true).is_none(), "already forgotten");
    }

    #[test]
    fn an_idle_lane_retires_and_refuses_new_work_a_busy_one_never() {
        let t0 = Instant::now();
        let idle = Duration::from_secs(30);
        let far = t0 + Duration::from_secs(100);
        let mut q: LaneQueue<Op, u32> = LaneQueue::new(t0);
        q.on_connected(1);
        assert!(!q.may_retire(t0 + Duration::from_secs(29), idle));
        assert!(q.may_retire(t0 + idle, idle));
        q.enqueue(vec![op(1, Opcode::Write, 1, far)], t0 + idle)
            .unwrap();
        assert!(
            !q.may_retire(t0 + Duration::from_secs(1000), idle),
            "work pending"
        );
        q.next_send(t0 + idle, 256, 1 << 20).unwrap();
        assert!(
            !q.may_retire(t0 + Duration::from_secs(1000), idle),
            "work in flight"
        );
        let g = q.reader_front().unwrap().1;
        q.take_front(g).unwrap();
        assert!(
            !q.may_retire(t0 + Duration::from_secs(1000), idle),
            "an answer being received"
        );
        q.done_reading();
        assert!(
            !q.may_retire(t0 + idle + Duration::from_secs(29), idle),
            "last used when the work came"
        );
        assert!(q.may_retire(t0 + idle + idle, idle));
        assert_eq!(q.retire(), Some(1));
        assert!(q.writer_done() && q.reader_done() && !q.writer_waits() && !q.reader_waits());
        let refused = q
            .enqueue(vec![op(2, Opcode::Write, 1, far)], t0)
            .unwrap_err();
        assert_eq!(ids(&refused), vec![2]);
    }

    #[test]
    fn a_stopped_lane_gives_up_everything_queued_or_in_flight() {
        let t0 = Instant::now();
        let far = t0 + Duration::from_secs(100);
        let mut q: LaneQueue<Op, u32> = LaneQueue::new(t0);
        q.on_connected(1);
        q.enqueue(
            vec![op(1, Opcode::Write, 1, far), op(2, Opcode::Read, 1, far)],
            t0,
        )
        .unwrap();
        q.next_send(t0, 1, 1 << 20).unwrap();
        assert_eq!(q.stop(), Some(1));
        assert!(q.is_shutdown() && q.reader_done() && !q.writer_waits());
        assert_eq!(ids(&q.drain_all()), vec![2, 1]);
        assert!(q.enqueue(vec![op(3, Opcode::Read, 1, far)], t0).is_err());
    }

    #[test]
    fn a_quiet_connection_is_checked_for_a_peer_close_before_use() {
        let t0 = Instant::now();
        let mut q: LaneQueue<Op, u32> = LaneQueue::new(t0);
        assert!(
            q.check_closed_by_peer(t0 + Duration::from_secs(1))
                .is_none(),
            "no connection"
        );
        q.on_connected(5);
        q.enqueue(
            vec![op(1, Opcode::Read, 1, t0 + Duration::from_secs(9))],
            t0,
        )
        .unwrap();
        q.next_send(t0, 256, 1 << 20).unwrap();
        assert!(
            q.check_closed_by_peer(t0 + Duration::from_secs(1))
                .is_none(),
            "an answer is awaited"
        );
        let g = q.reader_front().unwrap().1;
        q.take_front(g).unwrap();
        q.done_reading();
        assert!(q.check_closed_by_peer(t0).is_none(), "just used");
        assert_eq!(q.check_closed_by_peer(t0 + STALE_CHECK_AFTER), Some(5));
        assert_eq!(q.drop_conn(), Some(5));
        assert!(!q.connected());
    }
}
