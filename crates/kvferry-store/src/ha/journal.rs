//! The HA leader's journal in etcd: every durable change of the master's state is written to
//! etcd before the request that made it is answered, so a new leader starts with everything
//! its predecessor acknowledged.
//!
//! Where it lives in etcd and how values are encoded: [`super::log`].
//!
//! Group commit: request threads apply their change to the state, collect the marked changes
//! into the queue ([`JournalCore::collect`]) and wait for the writer ([`JournalCore::wait`]); the writer
//! takes everything queued in one etcd request (about 1 ms with fsync on this project's VM,
//! shared by every request queued meanwhile). With `--ha-replication standbys` the same writer
//! streams each batch to the standbys ([`Replicas`], [`super::sync`]) and, while the in-sync
//! set is not empty, does not write etcd: it sends the next batch without waiting, and the
//! threads reading the standbys' acknowledgements answer the requests ([`Release`]); when the
//! set empties it makes the etcd journal whole first ([`Writer`]'s `rebase`): it writes the
//! entries streamed since the journal was last whole, which it keeps ([`Tail`]), or else its
//! whole state as a snapshot. While it
//! sleeps it lends its links (`Lent`): a request that finds nothing in flight sends its
//! entry itself, one hop fewer.

use super::link::{image_frames, run_frames, AckSink, Link, IMAGE_ENCODE_HOLD};
use super::log::{encode_chunks, prefix_end, tail_log_values};
pub use super::log::{
    last_leader, load, mark_term, prefix, stored_seq, Head, Loaded, Stored, CHUNK,
};
use super::sync::{InSync, ToStandby};
use crate::error::StoreError;
use crate::master::changes::{Change, IMAGE_PIECES};
use crate::master::State;
use crate::node::Master;
use crate::repl::{self, JournalWriter, Tail};
use kvferry::metadata::etcd::{EtcdClient, Owner};
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The bytes of a segment's pool of space granted ahead to puts, by default (`--ha-grant-bytes`).
pub const GRANT_DEFAULT: u64 = 64 << 20;

/// A snapshot is written once the log since the last one is larger than this and than the
/// last snapshot.
pub const SNAPSHOT_MIN: u64 = 8 << 20;

/// What answers a request whose changes are not yet durable ([`JournalCore::defer`]): called
/// once with `Ok` when they are, or with the error to answer instead.
pub type Answer = Box<dyn FnOnce(Result<(), StoreError>) + Send>;

/// A deferred answer, answered exactly once: if it is dropped unanswered (a path that forgot
/// it), it answers that its outcome is unknown, so no client is left waiting.
struct Later(Option<Answer>);

impl Later {
    fn answer(mut self, r: Result<(), StoreError>) {
        if let Some(a) = self.0.take() {
            a(r);
        }
    }
}

impl Drop for Later {
    fn drop(&mut self) {
        if let Some(a) = self.0.take() {
            a(outcome_unknown());
        }
    }
}

/// Answers taken out of the queue under its lock, answered after it is released.
fn answer_all(later: impl IntoIterator<Item = Later>, r: impl Fn() -> Result<(), StoreError>) {
    for l in later {
        l.answer(r());
    }
}

/// What a request whose changes were applied and not yet durable is answered when the term
/// ends first: not `NotLeader` (which says nothing was applied, and that a client may send the
/// request again to the new leader), since the change may have reached it.
fn outcome_unknown() -> Result<(), StoreError> {
    Err(StoreError::OutcomeUnknown)
}

/// What a request is answered when its changes were not durable within `bound`.
fn not_durable(bound: Duration) -> Result<(), StoreError> {
    Err(StoreError::Rpc(format!("the master could not make the change durable (in its etcd journal or on its in-sync standbys) within {bound:?}; the request may not survive a failover, retry it")))
}

/// The queue as its driver holds it: the machine ([`repl::Queue`]) and who sleeps on it.
#[derive(Default)]
struct Queue {
    m: repl::Queue<Later>,
    /// The writer sleeps for work: the next collection wakes it (and clears this). A wake-up
    /// is a system call even when nobody sleeps (std's condition variables do not count
    /// their waiters), and a busy writer needs none: it looks at the queue before it sleeps.
    writer_asleep: bool,
    /// Threads sleeping in [`JournalCore::wait`] or [`JournalCore::hand_off`] (deferred answers
    /// need no wake-up).
    waiting: usize,
    /// The writer's way to the standbys while it sleeps and streams ([`Lent`]).
    lent: Option<Lent>,
}

impl Queue {
    /// The writer sleeps with its links lent and nothing is in flight: the next changes go
    /// out on their request's thread ([`JournalCore::collect_held`]).
    fn lends(&self) -> bool {
        self.lent
            .as_ref()
            .is_some_and(|l| l.release.all_acknowledged())
            && !self.m.busy()
    }
}

/// What a streaming writer lends the request threads while it sleeps, so that a request whose
/// changes find it asleep with every entry acknowledged (a leader not under load) sends their
/// entry itself ([`JournalCore::collect_held`]): the writer's wake-up, a system call and two
/// switches, was one of the three hops a replicated request added (1 connection × 1 key:
/// +15% objects/s). Under load (an entry in flight) the changes wait for the writer as before,
/// which takes in one entry what comes meanwhile: sent by their own threads, every request
/// was an entry and an acknowledgement of its own, and the threads queued on the lock behind
/// each other's sends (16 and 64 connections × 32 keys 7-10% slower). Lent and taken back
/// under the queue's lock, and used only under it, so entries still leave one at a time, in
/// order, and the writer finds everything as the last sender left it (its sequence number
/// included).
pub(crate) struct Lent {
    /// The last entry sent.
    seq: u64,
    links: Vec<Link>,
    release: Arc<Release>,
    tail: Arc<Mutex<Tail>>,
}

/// The default cap of the [`Tail`] (`--ha-rebase-tail-bytes`).
pub const TAIL_DEFAULT: u64 = 64 << 20;

/// A background snapshot refreshes the etcd journal's base while standbys are in sync at most
/// this often by default ([`Tail`], `--ha-rebase-base-every`).
pub const BASE_EVERY: Duration = Duration::from_secs(60);

/// Counters shown on `/ha_status` and `/metrics`.
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub struct JournalStats {
    /// Log entries written in this term (one etcd transaction each).
    pub entries: u64,
    /// Changes those entries carried (group commit: every change queued while the previous
    /// transaction was in flight goes in the next).
    pub changes: u64,
    /// Microseconds spent in those transactions (request sent to answer read).
    pub write_us: u64,
    /// Bytes of log the etcd journal holds after its snapshot (a new term counts what its
    /// predecessors left).
    pub log_bytes: u64,
    /// Size of the current snapshot.
    pub snapshot_bytes: u64,
    pub snapshots: u64,
    /// How long the last snapshot's chunks and head took to encode and write (milliseconds;
    /// a rebase's requests wait that long).
    pub snapshot_write_ms: u64,
    /// Collections queued and not yet durable.
    pub lag: u64,
    /// The last sequence number written.
    pub seq: u64,
    /// Entries acknowledged by the in-sync standbys instead of etcd (`--ha-replication
    /// standbys`), and the microseconds spent waiting for them.
    pub streamed: u64,
    pub stream_wait_us: u64,
    /// Standbys in the in-sync set now.
    pub insync: u64,
    /// How long the last rebase (the in-sync set emptied) held changing requests
    /// (milliseconds), and how many entries it wrote from the [`Tail`] (0: it wrote the whole
    /// state as a snapshot).
    pub rebase_ms: u64,
    pub rebase_tail_entries: u64,
    /// The entries kept for the next rebase ([`Tail`]): bytes, and whether they are whole
    /// since the etcd journal's last position (otherwise it writes the whole state).
    pub tail_bytes: u64,
    pub tail_whole: bool,
    /// How long this leader's takeover took to rebuild the master's state (milliseconds),
    /// and whether it was built ahead from its mirror while the dead leader's lease ran out
    /// (`sync::Mirror::prebuild`: what is left is making it this term's).
    pub takeover_rebuild_ms: u64,
    pub takeover_prebuilt: bool,
    /// Requests answered before their changes were acknowledged in this term: puts placed in
    /// space whose grant was ("Puts answered before their start is acknowledged" in
    /// ARCHITECTURE.md).
    pub early_answers: u64,
    /// The writer sleeps with its links lent and every entry acknowledged: a request's changes
    /// go out now on the request's own thread (`Lent`; read when the figures are).
    pub lending: bool,
}

/// Condition variables the waiting requests are spread over, by ticket.
const WAKE_SLOTS: usize = 16;

/// The leader's journal queue (inactive, costing nothing, without HA or while standing by).
/// Shared ([`JournalCore`]) with the threads that read the standbys' acknowledgements, which
/// answer the requests whose entries every in-sync standby acknowledged ([`Release`]).
#[derive(Default)]
pub struct Journal {
    core: Arc<JournalCore>,
}

impl std::ops::Deref for Journal {
    type Target = JournalCore;
    fn deref(&self) -> &JournalCore {
        &self.core
    }
}

pub struct JournalCore {
    q: Mutex<Queue>,
    /// Wakes the writer.
    work: Condvar,
    /// Wakes the requests waiting for their changes to be durable: a request waits on the
    /// slot of its ticket, so a commit wakes only the requests it completes (those that
    /// collected after the batch was taken sleep on until theirs).
    durable: [Condvar; WAKE_SLOTS],
    stats: Mutex<JournalStats>,
    /// The in-sync standbys (member ids) while this master leads.
    insync: Mutex<Vec<String>>,
    /// Grants of space ahead ([`crate::master::State::set_grant_bytes`]) up to this number
    /// are in entries that are durable ([`Queue::grant_marks`]).
    grants_durable: AtomicU64,
    /// [`JournalStats::early_answers`] (counted without the stats' lock).
    early: AtomicU64,
    /// The machines' clock starts here ([`JournalCore::now_us`]).
    epoch: Instant,
}

impl Default for JournalCore {
    fn default() -> Self {
        JournalCore {
            q: Mutex::default(),
            work: Condvar::new(),
            durable: Default::default(),
            stats: Mutex::default(),
            insync: Mutex::default(),
            grants_durable: AtomicU64::new(0),
            early: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }
}

impl JournalCore {
    fn q(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.q.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The driver's clock for the machines: microseconds since this journal was made.
    pub(crate) fn now_us(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    pub fn stats(&self) -> JournalStats {
        let mut s = *self.stats.lock().unwrap_or_else(|e| e.into_inner());
        let q = self.q();
        s.lag = q.m.lag();
        s.early_answers = self.early.load(Ordering::Relaxed);
        s.lending = q.lends();
        s
    }

    /// A request was answered before its changes were acknowledged ([`JournalStats::early_answers`]).
    pub fn count_early(&self) {
        self.early.fetch_add(1, Ordering::Relaxed);
    }

    /// The in-sync standbys (`--ha-replication standbys`, leaders).
    pub fn insync(&self) -> Vec<String> {
        self.insync
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn set_insync(&self, members: &[String]) {
        *self.insync.lock().unwrap_or_else(|e| e.into_inner()) = members.to_vec();
        self.set_stats(|s| s.insync = members.len() as u64);
    }

    pub(crate) fn set_stats(&self, f: impl FnOnce(&mut JournalStats)) {
        f(&mut self.stats.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// Takes what the state marked as changed into the queue. Returns the ticket to wait for
    /// (covering changes another thread collected first, which may include this caller's)
    /// with its term, `None` when not journaling or nothing is outstanding.
    pub fn collect(&self, m: &Master) -> Option<(i64, u64)> {
        self.collect_held(m.lock(), m.now())
    }

    /// [`JournalCore::collect`] under a hold of the state's lock the caller already has (the
    /// one its request was applied under: taking the lock again for this was a second hand-over
    /// per request between the connections' threads); the lock is let go here.
    pub fn collect_held(&self, mut st: MutexGuard<'_, State>, now: u64) -> Option<(i64, u64)> {
        if !st.journaling() {
            return None;
        }
        let changes = st.take_changes(now);
        let issued = crate::master::grants_issued();
        let mut q = self.q();
        let term = q.m.term();
        if term == 0 || term != st.term {
            return None;
        }
        let queued = !changes.is_empty();
        if queued && q.lends() {
            // The writer sleeps, nothing is in flight: this thread sends the entry ([`Lent`]).
            // The state's lock goes first: the queue's, held, keeps the changes in the order
            // they were applied.
            drop(st);
            q.m.enqueue(changes, issued);
            let ticket = (term, q.m.enqueued());
            self.send_lent(q);
            return Some(ticket);
        }
        let wake = queued && std::mem::take(&mut q.writer_asleep);
        q.m.enqueue(changes, issued);
        let ticket = q.m.outstanding().map(|t| (term, t));
        // The writer is woken after both locks are released: woken under them, it would only
        // block on the queue's lock again, and every request would wait on the state's lock
        // for the system call (never lost: the writer looks at the queue under its lock
        // before it sleeps).
        drop(q);
        drop(st);
        if wake {
            self.work.notify_one();
        }
        ticket
    }

    /// Sends what is queued as the next entry through what the sleeping writer lent
    /// ([`Lent`]), under the queue's lock, as [`Writer`]'s `commit` does while standbys are in
    /// sync (entries pipelined: this one goes without waiting for the last one's
    /// acknowledgement). What takes more than one entry, or cannot be encoded, is left to the
    /// writer (woken; on an encoding error it ends the term, as for its own).
    fn send_lent(&self, mut q: MutexGuard<'_, Queue>) {
        let now = self.now_us();
        let qr = &mut *q;
        let Some(lent) = qr.lent.as_mut() else { return };
        let seq = lent.seq + 1;
        let frame = (qr.m.changes_len() <= ENTRY_PIECE).then(|| {
            let (changes, _) = qr.m.take();
            let (frame, changes) = entry_frame(seq, changes);
            (frame, changes)
        });
        let (frame, changes) = match frame {
            Some((Ok(frame), changes)) => (frame, changes),
            other => {
                if let Some((_, changes)) = other {
                    qr.m.untake(changes);
                }
                qr.writer_asleep = false;
                drop(q);
                self.work.notify_one();
                return;
            }
        };
        lent.seq = seq;
        lent.release.push(seq, qr.m.enqueued(), now);
        send_all(&lent.links, &frame);
        lent.tail
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(seq, &frame);
        self.count_streamed(changes.len(), seq);
        drop(q);
        drop(changes); // (freed outside the lock)
    }

    /// Entry `seq`, of `n` changes, went to the standbys.
    fn count_streamed(&self, n: usize, seq: u64) {
        self.set_stats(|s| {
            s.changes += n as u64;
            s.seq = seq;
        });
    }

    /// Waits until the changes of `ticket` (from [`JournalCore::collect`]) are in etcd, at most
    /// `bound`; refused if the term ended first.
    pub fn wait(&self, (term, ticket): (i64, u64), bound: Duration) -> Result<(), StoreError> {
        let until = Instant::now() + bound;
        let mut q = self.q();
        loop {
            if let Some(o) = q.m.outcome(term, ticket) {
                return result(o, bound);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return not_durable(bound);
            }
            q.waiting += 1;
            q = self.durable[ticket as usize % WAKE_SLOTS]
                .wait_timeout(q, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            q.waiting -= 1;
        }
    }

    /// Like [`JournalCore::wait`] without a thread waiting: `answer` is called once, with `Ok`
    /// when the changes of `ticket` are durable (by the thread that learnt it: the writer or
    /// an acknowledgement reader), with `OutcomeUnknown` when the term ends or fails first, with a
    /// timeout error from [`JournalCore::expire`] after `bound`; at once, on this thread, if
    /// that is known already.
    pub fn defer(&self, (term, ticket): (i64, u64), answer: Answer) {
        let now = self.now_us();
        let mut q = self.q();
        if let Some((later, o)) = q.m.defer(term, ticket, Later(Some(answer)), now) {
            drop(q);
            later.answer(result(o, Duration::ZERO));
        }
    }

    /// Answers the deferred requests that waited longer than `bound` with the error
    /// [`JournalCore::wait`] gives (the master's ticker calls this; the writer fences the
    /// leader long before, when it can no longer prove its lease).
    pub fn expire(&self, bound: Duration) {
        let now = self.now_us();
        let late = {
            let mut q = self.q();
            if !q.m.has_deferred() {
                return;
            }
            q.m.expire(now, u64::try_from(bound.as_micros()).unwrap_or(u64::MAX))
        };
        answer_all(late, || not_durable(bound));
    }

    /// Wakes every waiter (the term ended, the writer failed, a hand-off finished).
    fn wake_all(&self) {
        for cv in &self.durable {
            cv.notify_all();
        }
    }

    /// Starts journaling `term` (the state must already journal).
    pub fn activate(&self, term: i64) {
        let (later, stale) = {
            let mut q = self.q();
            q.writer_asleep = false;
            // (Links an ended term's writer left lent: never this term's to send on. Its writer
            // ends before a new term starts, taking them back, so normally none.)
            (q.m.activate(term), q.lent.take())
        };
        drop(stale);
        answer_all(later, outcome_unknown);
        self.set_stats(|s| *s = JournalStats::default());
        self.early.store(0, Ordering::Relaxed);
    }

    /// Stops journaling: the writer ends, waiters are refused.
    pub fn deactivate(&self) {
        self.set_insync(&[]);
        let later = self.q().m.deactivate();
        self.work.notify_all();
        self.wake_all();
        answer_all(later, outcome_unknown);
    }

    /// Whether a term is being journaled (this master leads, or has not stepped down yet).
    pub fn active(&self) -> bool {
        self.q().m.term() != 0
    }

    /// Asks this term's writer to leave the state whole in the etcd journal and the leader
    /// fenced (the master is stopping); whether that was done within `bound` (true at once
    /// when not leading).
    pub fn hand_off(&self, bound: Duration) -> bool {
        let until = Instant::now() + bound;
        let mut q = self.q();
        if !q.m.ask_hand_off() {
            return true;
        }
        self.work.notify_all();
        loop {
            if let Some(done) = q.m.hand_off_state() {
                return done;
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            q.waiting += 1;
            q = self.durable[0]
                .wait_timeout(q, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            q.waiting -= 1;
        }
    }

    fn fail(&self) {
        let later = self.q().m.fail();
        self.wake_all();
        answer_all(later, outcome_unknown);
    }

    /// The next batch: everything queued, and the ticket it completes; `None` when the term
    /// ended. Waits at most `idle` for work (then returns an empty batch), lending `lend` to
    /// the request threads meanwhile; what was lent comes back, as they left it, either way.
    fn next(
        &self,
        term: i64,
        idle: Duration,
        lend: Option<Lent>,
    ) -> (Option<(Vec<Change>, u64)>, Option<Lent>) {
        let mut q = self.q();
        if !q.m.live(term) {
            return (None, lend);
        }
        let mut lend = lend;
        if !q.m.has_changes() && !q.m.kicked() {
            q.writer_asleep = true;
            q.lent = lend.take();
            q = self
                .work
                .wait_timeout(q, idle)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            q.writer_asleep = false;
            lend = q.lent.take();
            if !q.m.live(term) {
                return (None, lend);
            }
        }
        q.m.take_kick();
        (Some(q.m.take()), lend)
    }

    /// Plays the writer once without etcd: whatever is queued counts as durable (tests of
    /// what waits for the journal).
    #[cfg(test)]
    pub(crate) fn write_queued_for_test(&self) {
        let upto = {
            let mut q = self.q();
            q.m.clear_changes();
            q.m.enqueued()
        };
        self.done(upto);
    }

    /// Takes what is queued into `out` (tests of what is collected).
    #[cfg(test)]
    pub(crate) fn drain_for_test(&self, out: &mut Vec<Change>) {
        out.append(&mut self.q().m.take().0);
    }

    /// How many answers wait for the journal ([`JournalCore::defer`]).
    #[cfg(test)]
    pub(crate) fn deferred_for_test(&self) -> usize {
        self.q().m.deferred()
    }

    /// Wakes the writer for something other than queued changes (a link broke): it looks at
    /// once, even if it was about to sleep.
    fn kick(&self) {
        self.q().m.kick();
        self.work.notify_all();
    }

    /// Everything up to `upto` is durable (the writer appended it in its own term).
    fn done(&self, upto: u64) {
        let mut q = self.q();
        let w = q.m.written(upto);
        self.finish_written(q, w);
    }

    /// [`JournalCore::done`] for `term` only: a late acknowledgement of an ended term (or of
    /// a failed one) answers nothing.
    fn done_in(&self, term: i64, upto: u64) {
        let mut q = self.q();
        let w = q.m.written_in(term, upto);
        self.finish_written(q, w);
    }

    /// Acts on what became durable: the grants it holds count as durable, the requests
    /// waiting for its tickets are woken (after the queue's lock is released: woken under it
    /// they would only block on it again; never lost, as a request looks under the lock
    /// before it sleeps) and the deferred ones answered.
    fn finish_written(&self, q: MutexGuard<'_, Queue>, w: repl::Written<Later>) {
        if let Some(g) = w.grants {
            self.grants_durable.fetch_max(g, Ordering::AcqRel);
        }
        let wake = q.waiting > 0;
        drop(q);
        if wake {
            self.wake_written(w.tickets);
        }
        answer_all(w.ready, || Ok(()));
    }

    /// Grants up to this number are in durable journal entries: a put placed in their space
    /// is answered before its own change is acknowledged (`server/handlers.rs`).
    pub fn grants_durable(&self) -> u64 {
        self.grants_durable.load(Ordering::Acquire)
    }

    /// Wakes the requests waiting for `tickets`.
    fn wake_written(&self, tickets: std::ops::Range<u64>) {
        if tickets.end - tickets.start >= WAKE_SLOTS as u64 {
            self.wake_all();
        } else {
            for t in tickets {
                self.durable[t as usize % WAKE_SLOTS].notify_all();
            }
        }
    }
}

/// What a deferred request is answered for `o` (`bound`: the one it was given).
fn result(o: repl::Outcome, bound: Duration) -> Result<(), StoreError> {
    match o {
        repl::Outcome::Durable => Ok(()),
        repl::Outcome::Unknown => outcome_unknown(),
        repl::Outcome::TimedOut => not_durable(bound),
    }
}

/// Releases the entries streamed to the in-sync standbys as every member acknowledges them
/// ([`repl::Pipeline`]): the threads reading the standbys' acknowledgements call it
/// ([`AckSink`]), so the requests of an entry are answered by the acknowledgement that
/// completes it, without a hop through the writer, and the writer streams the next entry
/// without waiting. The writer changes the members only after etcd's in-sync record says so.
pub struct Release {
    core: Arc<JournalCore>,
    term: i64,
    pipe: Mutex<Pipe>,
}

#[derive(Default)]
struct Pipe {
    /// The in-sync standbys' acknowledged entries (their links' counters).
    members: Vec<Arc<AtomicU64>>,
    m: repl::Pipeline,
}

impl Release {
    pub fn new(journal: &Journal, term: i64) -> Release {
        Release {
            core: Arc::clone(&journal.core),
            term,
            pipe: Mutex::default(),
        }
    }

    fn pipe(&self) -> std::sync::MutexGuard<'_, Pipe> {
        self.pipe.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Entry `seq`, completing `ticket`, is about to be sent to the in-sync standbys at `now`.
    fn push(&self, seq: u64, ticket: u64, now: u64) {
        self.pipe().m.push(seq, ticket, now);
    }

    /// Whether every entry sent was acknowledged by every member (none in flight).
    fn all_acknowledged(&self) -> bool {
        self.pipe().m.all_acknowledged()
    }

    /// The in-sync set changed (etcd says so already); entries its remaining members all
    /// acknowledged are released.
    fn set_members(&self, members: Vec<Arc<AtomicU64>>) {
        self.pipe().members = members;
        self.release();
    }

    /// Forgets every pending entry: the state they carry is in etcd (a rebase), their
    /// tickets answered by the writer.
    fn clear(&self) {
        let mut p = self.pipe();
        p.members.clear();
        p.m.clear();
    }

    /// [`repl::Pipeline::late`] at `now`.
    fn late(&self, now: u64, bound: Duration) -> Option<u64> {
        self.pipe()
            .m
            .late(now, u64::try_from(bound.as_micros()).unwrap_or(u64::MAX))
    }

    /// [`repl::Pipeline::late_at`].
    fn late_at(&self, bound: Duration) -> Option<u64> {
        self.pipe()
            .m
            .late_at(u64::try_from(bound.as_micros()).unwrap_or(u64::MAX))
    }

    /// The oldest entry in flight.
    #[cfg(test)]
    fn oldest_seq(&self) -> Option<u64> {
        self.pipe().m.oldest().map(|(seq, _)| seq)
    }

    /// Answers the requests of every entry each member acknowledged.
    fn release(&self) {
        let now = self.core.now_us();
        let mut p = self.pipe();
        let min = p.members.iter().map(|a| a.load(Ordering::Acquire)).min();
        let released = p.m.release(min, now);
        drop(p);
        if let Some(r) = released {
            // Counted before the answers go out: a client that got its answer then sees it
            // in `/ha_status`.
            self.core.set_stats(|s| {
                s.streamed += r.entries;
                s.stream_wait_us += r.waited_us;
            });
            // Tickets only grow: a concurrent release of an earlier one is a no-op after this
            // (as is ticket 0, only pieces released).
            self.core.done_in(self.term, r.upto);
        }
    }
}

impl AckSink for Release {
    fn acked(&self) {
        self.release();
    }

    fn broke(&self) {
        // The writer drops the member (or the links it no longer needs) at once.
        self.core.kick();
    }
}

/// The most changes one entry streamed to the standbys carries (a few hundred KiB; applying
/// them takes a few milliseconds).
const ENTRY_PIECE: usize = 4096;

/// A commit of `changes`, completing `ticket`, as the entries streamed for it: pieces of at
/// most `piece` changes, in order, only the last completing the ticket (0 for the others:
/// releasing them answers nothing). Every change carries its entity's whole state, so a
/// standby that took over after some of the pieces holds a consistent state per entity, of
/// a commit nobody was told had happened.
fn pieces(changes: Vec<Change>, ticket: u64, piece: usize) -> Vec<(Vec<Change>, u64)> {
    let piece = piece.max(1);
    // Nearly every commit: one entry, the changes moved, not copied.
    if changes.len() <= piece {
        return vec![(changes, ticket)];
    }
    let mut it = changes.into_iter();
    let mut out = Vec::with_capacity(it.len().div_ceil(piece).max(1));
    loop {
        let p: Vec<Change> = it.by_ref().take(piece).collect();
        if it.len() == 0 {
            out.push((p, ticket));
            return out;
        }
        out.push((p, 0));
    }
}

/// Entry `seq` of `changes` as a frame for the standbys, and the changes back (the entry owns
/// them while it is encoded: a caller that cannot send it may queue them again).
fn entry_frame(seq: u64, changes: Vec<Change>) -> (Result<Arc<Vec<u8>>, String>, Vec<Change>) {
    let entry = ToStandby::Entry { seq, changes };
    let frame = super::sync::encode_frame(&entry).map(Arc::new);
    match entry {
        ToStandby::Entry { changes, .. } => (frame, changes),
        _ => (frame, Vec::new()), // (built as an entry above)
    }
}

mod snapshot;
mod writer;

use writer::send_all;
pub use writer::{Replicas, Writer};

#[cfg(test)]
mod tests;
