//! Initiator side: lanes (one connection, a writer and a reader thread each) to one peer.

use super::queue::{LaneQueue, QueuedOp};
use super::rules::{self, Answer, Failed, Fate};
use super::sockio::*;
use super::RefusedHook;
use crate::batch::{FailCause, FailKind, Failure};
use crate::transport::Piece;
use crate::wire::tcp::{
    Opcode, Status, HEADER_LEN, SEALED_HEADER_LEN, SEALED_STATUS_LEN, STATUS_LEN,
};
use crate::wire::WireError;
use std::collections::HashMap;
use std::io::{self, IoSlice};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// One request (or part of one) on the wire.
pub(super) struct WireOp {
    pub(super) piece: Piece,
    /// Connection failures survived so far.
    pub(super) attempts: u8,
}

/// One data connection of a lane: the socket and, with the cluster key, the session its
/// headers are sealed and its status frames opened under (the writer or an in-caller request
/// seals, the reader or an in-caller request opens: never two at once, so the locks are
/// never contended).
pub(super) struct DataConn {
    pub(super) s: TcpStream,
    seal: Option<Mutex<crate::auth::Sealer>>,
    open: Option<Mutex<crate::auth::Opener>>,
    /// What a keyed connection protects (`Headers` when not keyed: nothing else applies).
    protect: crate::auth::Protect,
}

impl DataConn {
    fn new(
        s: TcpStream,
        session: Option<(crate::auth::Sealer, crate::auth::Opener)>,
        protect: crate::auth::Protect,
    ) -> DataConn {
        let (seal, open) = session.map(|(a, b)| (Mutex::new(a), Mutex::new(b))).unzip();
        let protect = if seal.is_some() {
            protect
        } else {
            crate::auth::Protect::Headers
        };
        DataConn {
            s,
            seal,
            open,
            protect,
        }
    }

    /// How a READ answer comes on this connection: `None` when not keyed.
    fn answer_protect(&self) -> Option<crate::auth::Protect> {
        self.open.is_some().then_some(self.protect)
    }

    fn sealer(&self) -> Option<std::sync::MutexGuard<'_, crate::auth::Sealer>> {
        self.seal
            .as_ref()
            .map(|m| m.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn opener(&self) -> Option<std::sync::MutexGuard<'_, crate::auth::Opener>> {
        self.open
            .as_ref()
            .map(|m| m.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl std::ops::Deref for DataConn {
    type Target = TcpStream;
    fn deref(&self) -> &TcpStream {
        &self.s
    }
}

/// What one request of a gathered write sends: its header, its v1 fence, and the local
/// memory and length of its WRITE body (0: none), by its deadline.
type Outgoing = (
    [u8; HEADER_LEN],
    Option<[u8; HEADER_LEN]>,
    u64,
    u64,
    Instant,
);

/// A request's body in a gathered write: local memory (address, length) as it is, or the
/// range of the writer's scratch buffer holding it protected.
type Body = (u64, u64, Option<(usize, usize)>);

/// The lane's queue (sans-IO, `queue.rs`) with its connection.
pub(super) type LaneState = LaneQueue<WireOp, Arc<DataConn>>;

impl QueuedOp for WireOp {
    fn len(&self) -> u64 {
        self.piece.len
    }
    fn deadline(&self) -> Instant {
        self.piece.task.deadline()
    }
    fn retried(&mut self) {
        self.attempts += 1;
    }
}

/// Drops the connection if it has been quiet a while and the peer closed it meanwhile
/// (it exited, or a new process took its port): requests then go on a new connection
/// instead of failing on a dead one. The queue says when no byte may be waiting on the
/// socket ([`LaneQueue::check_closed_by_peer`]); this only peeks.
fn drop_if_closed_by_peer(st: &mut LaneState, now: Instant) {
    let Some(c) = st.check_closed_by_peer(now) else {
        return;
    };
    let mut b = [0u8; 1];
    let closed = match rustix::net::recv(
        &c.s,
        &mut b,
        rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT,
    ) {
        // EOF: the peer closed it.
        Ok((0, _)) => true,
        // Bytes nobody asked for: the reader reports that as a protocol error.
        Ok(_) => false,
        Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => false,
        // A reset or another error: not a connection to send on.
        Err(_) => true,
    };
    if closed {
        if let Some(c) = st.drop_conn() {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

pub(super) type PeerMap = Mutex<HashMap<(SocketAddr, bool), Arc<PeerLanes>>>;

pub(super) struct Lane {
    pub(super) target: SocketAddr,
    pub(super) peer_name: String,
    pub(super) v2: bool,
    pub(super) connect_timeout: Duration,
    pub(super) spin: Duration,
    pub(super) st: Mutex<LaneState>,
    pub(super) wake_writer: Condvar,
    pub(super) wake_reader: Condvar,
    /// Bytes queued or in flight, for lane choice.
    pub(super) load: AtomicU64,
    pub(super) refused: Arc<OnceLock<RefusedHook>>,
    /// Pieces waiting for the descriptor refresh that runs for this lane (`Some` while one
    /// runs: at most one thread per lane, which takes these when it is done with its own).
    pub(super) refreshing: Arc<Mutex<Option<Vec<Refresh>>>>,
    pub(super) idle: Duration,
    /// The transport's map of peers, to leave it when idle (weak: no cycle).
    pub(super) home: std::sync::Weak<PeerMap>,
    pub(super) key: (SocketAddr, bool),
    /// The cluster key: every connection proves it before its first request.
    pub(super) auth: Option<Arc<crate::auth::ClusterKey>>,
    /// What its connections protect with the key (`KVFERRY_AUTH_PROTECT`).
    pub(super) protect: crate::auth::Protect,
}

/// Pieces for a descriptor refresh, and how they end if it hands them back.
pub(super) type Refresh = (Vec<Piece>, (FailKind, Failure));

/// Held by a lane's refresh thread: if it ends other than by finding nothing more waiting (a
/// refresh that panicked), the lane may start another, and pieces still waiting end with
/// their failure.
struct RefreshDone<'a>(&'a Mutex<Option<Vec<Refresh>>>, bool);

impl Drop for RefreshDone<'_> {
    fn drop(&mut self) {
        if !self.1 {
            return;
        }
        let waiting = self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .unwrap_or_default();
        for (pieces, why) in waiting {
            for p in pieces {
                p.task.piece_failed(why.0, why.1.clone());
            }
        }
    }
}

/// A lane's refresh thread ([`Lane::refresh_off_lane`]): refreshes what waits in `queue`
/// until nothing does, then lets the lane start another.
fn refresh_queued(
    hook: &RefusedHook,
    name: &str,
    target: SocketAddr,
    queue: &Mutex<Option<Vec<Refresh>>>,
) {
    // However this ends (a refresh that panics included), the lane may refresh again and what
    // still waits in its queue ends (pieces a panicking refresh held are lost with it).
    let mut done = RefreshDone(queue, true);
    loop {
        let next = {
            let mut r = queue.lock().unwrap_or_else(|e| e.into_inner());
            match r.as_mut().map(std::mem::take) {
                Some(more) if !more.is_empty() => more,
                _ => {
                    // Nothing more: the lane may start another (under this lock hold).
                    *r = None;
                    done.1 = false;
                    return;
                }
            }
        };
        for (pieces, why) in next {
            // Pieces that waited here past their deadline end now, unrefreshed (the clock
            // read per batch: a refresh before may have taken long).
            let now = Instant::now();
            let (late, go): (Vec<Piece>, Vec<Piece>) =
                pieces.into_iter().partition(|p| p.task.deadline() <= now);
            for p in late {
                p.task.piece_failed(
                    FailKind::Timeout,
                    FailCause::Timeout.because(format!(
                        "the deadline passed while {name}'s descriptor was being re-read"
                    )),
                );
            }
            if !go.is_empty() {
                for p in hook(name, target, go) {
                    p.task.piece_failed(why.0, why.1.clone());
                }
            }
        }
    }
}

pub(super) enum ConnFailure {
    /// The connection broke; unacknowledged ops may be retried once.
    Broken(String),
    /// The target closed it after rejecting a request: the ops sent after that one were
    /// never taken (it serves in order), so each may go again once, even a WRITE.
    Untouched(String),
    /// A deadline passed.
    Deadline,
}

impl Lane {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, LaneState> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn end_op(&self, op: WireOp, result: Result<(), (FailKind, Failure)>) {
        self.load.fetch_sub(op.piece.len, Ordering::AcqRel);
        match result {
            Ok(()) => op.piece.task.piece_done(op.piece.len),
            Err((kind, reason)) => op.piece.task.piece_failed(kind, reason),
        }
    }

    /// Ends `first` and every op waiting to be sent with the same failure (nothing of them was
    /// sent, and a new connection would fare no better).
    fn end_pending(&self, first: Option<WireOp>, kind: FailKind, why: Failure) {
        let ops: Vec<WireOp> = first
            .into_iter()
            .chain(self.lock().pending.drain(..))
            .collect();
        for op in ops {
            self.end_op(op, Err((kind, why.clone())));
        }
    }

    /// Closes connection `gen` and decides the fate of every op that was sent on it.
    pub(super) fn fail_conn(&self, gen: u64, why: ConnFailure) {
        let ended = {
            let mut st = self.lock();
            let now = Instant::now();
            let reason = match &why {
                ConnFailure::Broken(r) | ConnFailure::Untouched(r) => r.clone(),
                ConnFailure::Deadline => "deadline passed".into(),
            };
            let broken = !matches!(why, ConnFailure::Deadline);
            let untouched = matches!(why, ConnFailure::Untouched(_));
            let Some((conn, ended)) =
                st.on_conn_failed(gen, |op| self.fate(op, broken, untouched, now, &reason))
            else {
                return;
            };
            let _ = conn.shutdown(Shutdown::Both);
            self.wake_writer.notify_all();
            ended
        };
        self.redirect_or_end(
            ended
                .into_iter()
                .map(|(op, (kind, f))| (op, kind, f))
                .collect(),
        );
    }

    /// Ends ops whose connection failed, except those that lost the peer: for them the
    /// transport re-reads the peer's descriptor first (`TcpTransport::on_refused`). If it now lists another data address (the
    /// peer restarted on other ports; whatever answered here, or took the old port over, is
    /// not it) they go there: no byte sent here can land in the new process, so even a WRITE
    /// is safe to send again. Otherwise they end as decided.
    pub(super) fn redirect_or_end(&self, ops: Vec<(WireOp, FailKind, Failure)>) {
        let hook = self.refused.get();
        let mut candidates = Vec::new();
        for (op, kind, f) in ops {
            let lost = matches!(f.cause, FailCause::PeerLost | FailCause::Protocol)
                && kind == FailKind::Failed;
            match hook {
                Some(_) if lost && op.attempts < 2 => candidates.push((op, f)),
                _ => self.end_op(op, Err((kind, f))),
            }
        }
        let Some(hook) = hook else { return };
        if candidates.is_empty() {
            return;
        }
        let first = candidates[0].1.clone();
        let pieces: Vec<Piece> = candidates
            .into_iter()
            .map(|(op, _)| {
                self.load.fetch_sub(op.piece.len, Ordering::AcqRel);
                op.piece
            })
            .collect();
        self.refresh_off_lane(hook, pieces, (FailKind::Failed, first));
    }

    /// Hands `pieces` (their peer refused or lost a connection; no longer counted in this
    /// lane's load) to the descriptor refresh, `hook`, on a thread of its own: it may
    /// wait for the peer's handshake port or the metadata service up to their timeouts, and
    /// this lane's writer and reader go on meanwhile (a reader that ran it read no answers
    /// for the requests sent on the lane's next connection until it returned). What the
    /// refresh hands back ends with `why`. One such thread per lane at most: pieces that come
    /// while it runs wait for it and go to a refresh of their own after (the peer may have
    /// moved again). Where no thread can be started it runs here.
    fn refresh_off_lane(&self, hook: &RefusedHook, pieces: Vec<Piece>, why: (FailKind, Failure)) {
        {
            let mut r = self.refreshing.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(waiting) = r.as_mut() {
                waiting.push((pieces, why));
                return;
            }
            *r = Some(vec![(pieces, why)]);
        }
        let (hook2, name, target, queue) = (
            Arc::clone(hook),
            self.peer_name.clone(),
            self.target,
            Arc::clone(&self.refreshing),
        );
        let spawned = std::thread::Builder::new()
            .name("kvferry-tcp-refresh".into())
            .spawn(move || refresh_queued(&hook2, &name, target, &queue));
        if let Err(e) = spawned {
            tracing::debug!("no thread for a descriptor refresh ({e}): run on the lane's");
            refresh_queued(hook, &self.peer_name, self.target, &self.refreshing);
        }
    }

    /// What becomes of an op that was handed to a connection that then failed (the rule
    /// is [`rules::fate`]): `None` to retry it on a new connection, else how it ends.
    pub(super) fn fate(
        &self,
        op: &WireOp,
        broken: bool,
        untouched: bool,
        now: Instant,
        reason: &str,
    ) -> Option<(FailKind, Failure)> {
        let f = Failed {
            broken,
            attempts: op.attempts,
            revoked: op.piece.guard.is_revoked(),
            deadline: op.piece.task.deadline(),
            untouched,
        };
        match rules::fate(
            op.piece.opcode,
            f,
            now,
            &format!("{} ({})", self.peer_name, self.target),
            reason,
        ) {
            Fate::Retry => None,
            Fate::End(kind, failure) => Some((kind, failure)),
        }
    }

    /// Closes this lane and every other lane of its peer if all of them have been idle for
    /// `idle`: their threads end and the peer leaves the transport's map, so a departed
    /// peer costs nothing after that. Work submitted meanwhile sees `retired` and goes to
    /// new lanes.
    pub(super) fn retire_if_idle(&self) {
        let Some(home) = self.home.upgrade() else {
            return;
        };
        let mut peers = home.lock().unwrap_or_else(|e| e.into_inner());
        let Some(entry) = peers.get(&self.key).cloned() else {
            return;
        };
        if !entry.lanes.iter().any(|l| std::ptr::eq(&**l, self)) {
            return;
        }
        // Lane locks in index order (nothing else holds two at once).
        let mut guards: Vec<_> = entry.lanes.iter().map(|l| l.lock()).collect();
        let now = Instant::now();
        if !guards.iter().all(|g| g.may_retire(now, self.idle)) {
            return;
        }
        for (g, l) in guards.iter_mut().zip(&entry.lanes) {
            if let Some(c) = g.retire() {
                let _ = c.shutdown(Shutdown::Both);
            }
            l.wake_writer.notify_all();
            l.wake_reader.notify_all();
        }
        drop(guards);
        peers.remove(&self.key);
        tracing::debug!(peer = %self.peer_name, "TCP lanes idle for {:?}: closed", self.idle);
    }

    pub(super) fn writer_loop(self: Arc<Self>) {
        // Each header as it goes: sealed on a keyed connection, its first HEADER_LEN bytes
        // otherwise (`hdr_lens`).
        let mut iov_hdrs: Vec<[u8; SEALED_HEADER_LEN]> = Vec::with_capacity(MAX_OPS_PER_WRITE * 2);
        let mut hdr_lens: Vec<usize> = Vec::with_capacity(MAX_OPS_PER_WRITE * 2);
        // Protected WRITE bodies of a run, as they go (`KVFERRY_AUTH_PROTECT` payload or
        // encrypt).
        let mut scratch: Vec<u8> = Vec::new();
        loop {
            let mut st = self.lock();
            while st.writer_waits() {
                let (g, to) = self
                    .wake_writer
                    .wait_timeout(st, self.idle)
                    .unwrap_or_else(|e| e.into_inner());
                st = g;
                if to.timed_out() && st.may_retire(Instant::now(), self.idle) {
                    drop(st);
                    self.retire_if_idle();
                    st = self.lock();
                }
            }
            if st.writer_done() {
                return;
            }
            if st.is_shutdown() {
                let ops = st.drain_all();
                drop(st);
                for op in ops {
                    self.end_op(
                        op,
                        Err((
                            FailKind::Failed,
                            FailCause::ShutDown.because("engine shut down"),
                        )),
                    );
                }
                return;
            }
            // Expire what can no longer make its deadline before sending it.
            let now = Instant::now();
            let expired = st.take_expired(now);
            if !expired.is_empty() {
                drop(st);
                for op in expired {
                    self.end_op(
                        op,
                        Err((
                            FailKind::Timeout,
                            FailCause::Timeout.because(format!(
                                "not sent to {} before the deadline",
                                self.peer_name
                            )),
                        )),
                    );
                }
                continue;
            }
            drop_if_closed_by_peer(&mut st, now);
            if !st.connected() {
                drop(st);
                self.connect();
                continue;
            }
            // Gather a run of ops into one writev.
            let Some(send) = st.next_send(now, MAX_OPS_PER_WRITE, MAX_GATHER_BYTES) else {
                continue;
            };
            let (conn, gen, n) = (send.conn, send.gen, send.n);
            if send.wake_reader {
                self.wake_reader.notify_one();
            }
            let mut guards: Vec<crate::memory::RegionGuard> = Vec::new();
            // What each request sends: its header, its WRITE body (local memory), its v1 fence.
            let mut items: Vec<Outgoing> = Vec::with_capacity(n);
            for op in st.inflight.range(send.first..send.first + n) {
                let p = &op.piece;
                p.task.set_pending();
                if !guards
                    .iter()
                    .any(|g| std::ptr::eq(g.region(), p.guard.region()))
                {
                    guards.push(p.guard.clone());
                }
                let (hdr, fence) = rules::request_frames(p.opcode, p.remote, p.len, self.v2);
                let body = if p.opcode == Opcode::Write { p.len } else { 0 };
                items.push((hdr, fence, p.local, body, p.task.deadline()));
            }
            drop(st);
            // Headers (and protected bodies) sealed in the order they go out, under the lock
            // the writer alone takes while it owns the connection.
            iov_hdrs.clear();
            hdr_lens.clear();
            scratch.clear();
            let mut seal = conn.sealer();
            let protect = conn.protect;
            let mut put = |h: &[u8; HEADER_LEN], seal: &mut Option<std::sync::MutexGuard<'_, crate::auth::Sealer>>| {
                let mut b = [0u8; SEALED_HEADER_LEN];
                hdr_lens.push(rules::put_header(h, seal.as_deref_mut(), &mut b));
                iov_hdrs.push(b);
                *hdr_lens.last().expect("just pushed") as u64
            };
            // Each request's body: none, local memory as it is, or a range of `scratch`
            // (protected).
            let mut bodies: Vec<Body> = Vec::with_capacity(n);
            // Where each op's bytes end in the stream, and its deadline: the write stops at
            // the deadline of the op whose bytes are going out, not at the earliest of the
            // run (a small request sent first with a short deadline failed the large one
            // after it, and every READ in flight, though they had time left).
            let mut ends: Vec<(u64, Instant)> = Vec::with_capacity(n);
            let mut at = 0u64;
            for (hdr, fence, local, len, deadline) in &items {
                at += put(hdr, &mut seal);
                match (protect, seal.as_deref_mut()) {
                    (p, Some(s)) if *len > 0 && p != crate::auth::Protect::Headers => {
                        let from = scratch.len();
                        // SAFETY: local ranges were checked against the registry at submit
                        // and the piece's guard (held in `guards`) keeps them registered.
                        rules::seal_body(
                            p,
                            s,
                            unsafe {
                                std::slice::from_raw_parts(*local as *const u8, *len as usize)
                            },
                            &mut scratch,
                        );
                        at += (scratch.len() - from) as u64;
                        bodies.push((0, 0, Some((from, scratch.len()))));
                    }
                    _ => {
                        at += len;
                        bodies.push((*local, *len, None));
                    }
                }
                // v1 fence: a 1-byte READ of the last byte written answers only after the
                // target consumed the body into memory.
                if let (Some(f), true) = (fence, *len > 0) {
                    at += put(f, &mut seal);
                }
                ends.push((at, *deadline));
            }
            drop(seal);
            // Build the iovec list: header, body (WRITE), [fence header].
            let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(n * 3);
            let mut h = 0;
            for &(addr, len, sealed) in &bodies {
                iov.push(IoSlice::new(&iov_hdrs[h][..hdr_lens[h]]));
                h += 1;
                if let Some((from, to)) = sealed {
                    iov.push(IoSlice::new(&scratch[from..to]));
                } else if len > 0 {
                    // SAFETY: local ranges were checked against the registry at submit and
                    // the piece's guard keeps them registered.
                    iov.push(IoSlice::new(unsafe {
                        std::slice::from_raw_parts(addr as *const u8, len as usize)
                    }));
                    if !self.v2 {
                        iov.push(IoSlice::new(&iov_hdrs[h][..hdr_lens[h]]));
                        h += 1;
                    }
                }
            }
            let mut rest: &mut [IoSlice<'_>] = &mut iov;
            let mut before = 0u64; // bytes written by the earlier writev calls of this run
            let result = loop {
                // writev takes at most IOV_MAX (1024) entries.
                let take = rest.len().min(1000);
                let (now_part, later) = std::mem::take(&mut rest).split_at_mut(take);
                let part: u64 = now_part.iter().map(|s| s.len() as u64).sum();
                let overdue = |written: u64| {
                    rules::deadline_at(&ends, before + written).is_some_and(|d| Instant::now() >= d)
                };
                let r = write_all_vectored(&conn, now_part, |written| {
                    overdue(written) || guards.iter().any(|g| g.is_revoked())
                });
                if r.is_err() || later.is_empty() {
                    break r;
                }
                before += part;
                rest = later;
            };
            drop(guards);
            if let Err(e) = result {
                let why = if e.kind() == io::ErrorKind::TimedOut {
                    ConnFailure::Deadline
                } else {
                    ConnFailure::Broken(e.to_string())
                };
                self.fail_conn(gen, why);
            }
        }
    }

    pub(super) fn connect(&self) {
        let deadline = {
            let mut st = self.lock();
            st.connecting();
            st.pending.front().map(|op| op.piece.task.deadline())
        };
        let timeout = deadline
            .map(|d| d.saturating_duration_since(Instant::now()))
            .unwrap_or(self.connect_timeout)
            .min(self.connect_timeout)
            .max(Duration::from_millis(1));
        let until = Instant::now() + timeout;
        let r = TcpStream::connect_timeout(&self.target, timeout).and_then(|s| {
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(TICK))?;
            s.set_write_timeout(Some(TICK))?;
            keepalive(&s);
            Ok(s)
        });
        // With a cluster key, the connection's handshake runs before it carries a request.
        let mut session = None;
        if let (Ok(s), Some(key)) = (&r, &self.auth) {
            match self.authenticate(s, key, until) {
                Ok(pair) => session = Some(pair),
                Err(refused) => {
                    tracing::warn!(
                        "TCP data connection to {} at {}: {}",
                        self.peer_name,
                        self.target,
                        refused.reason
                    );
                    let kind = if refused.cause == FailCause::Timeout {
                        FailKind::Timeout
                    } else {
                        FailKind::Failed
                    };
                    self.end_pending(None, kind, refused);
                    return;
                }
            }
        }
        match r {
            Ok(s) => {
                self.lock()
                    .on_connected(Arc::new(DataConn::new(s, session, self.protect)));
                self.wake_reader.notify_all();
            }
            Err(e) => {
                let mut ops: Vec<WireOp> = self.lock().pending.drain(..).collect();
                let reason = format!(
                    "cannot connect to the TCP data port of {} at {}: {e} (is the peer alive and is its address reachable from here?)",
                    self.peer_name, self.target
                );
                let (kind, cause) = if e.kind() == io::ErrorKind::TimedOut {
                    (FailKind::Timeout, FailCause::Timeout)
                } else {
                    (FailKind::Failed, FailCause::PeerUnreachable)
                };
                if let (io::ErrorKind::ConnectionRefused, Some(hook)) =
                    (e.kind(), self.refused.get())
                {
                    // Maybe the peer restarted with new ports: let the engine refresh and retry once.
                    let (retry, keep): (Vec<WireOp>, Vec<WireOp>) =
                        ops.into_iter().partition(|op| op.attempts < 2);
                    let pieces: Vec<Piece> = retry
                        .into_iter()
                        .map(|op| {
                            self.load.fetch_sub(op.piece.len, Ordering::AcqRel);
                            op.piece
                        })
                        .collect();
                    ops = keep;
                    if !pieces.is_empty() {
                        self.refresh_off_lane(hook, pieces, (kind, cause.because(reason.clone())));
                    }
                }
                for op in ops {
                    self.end_op(op, Err((kind, cause.because(reason.clone()))));
                }
            }
        }
    }

    /// The cluster key's handshake on a new connection, bound to this lane's segment name, by
    /// `until` (`rules::AuthOpen`): the connection's session, or the failure to end the waiting
    /// requests with when the target refuses or cannot answer it.
    fn authenticate(
        &self,
        s: &TcpStream,
        key: &crate::auth::ClusterKey,
        until: Instant,
    ) -> Result<(crate::auth::Sealer, crate::auth::Opener), Failure> {
        let stop = || Instant::now() >= until;
        let io_failed = |what: &str, e: io::Error| {
            let cause = if e.kind() == io::ErrorKind::TimedOut {
                FailCause::Timeout
            } else {
                FailCause::PeerUnreachable
            };
            cause.because(format!(
                "{} at {}: {what} the cluster key's handshake: {e}",
                self.peer_name, self.target
            ))
        };
        let open = rules::AuthOpen::new(key, &self.peer_name, self.protect, &self.peer_name)?;
        write_all_vectored(s, &mut [IoSlice::new(open.hello())], |_| stop())
            .map_err(|e| io_failed("sending", e))?;
        // (The target sends nothing beyond its answer before the first request: no byte of
        // the connection is read into this buffer ahead of the reader's.)
        let mut rx = RxBuf::new();
        let take = |rx: &mut RxBuf, n: usize| -> io::Result<Vec<u8>> {
            rx.need(s, n, stop)?;
            let b = rx.data()[..n].to_vec();
            rx.consume(n);
            Ok(b)
        };
        // A target that closes at once holds no key and does not look for one (an older
        // kvferry, or Mooncake).
        let first = take(&mut rx, STATUS_LEN).map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset => FailCause::Unauthorized.because(format!(
                "{} closed the connection at the cluster key's opening frame: it does not take a cluster key (a stock Mooncake engine or one without KVFERRY_AUTH_KEY_FILE); set the same key file on both, or unset it here",
                self.peer_name
            )),
            _ => io_failed("receiving the answer to", e),
        })?;
        open.on_answer(
            first
                .try_into()
                .unwrap_or_else(|_| unreachable!("STATUS_LEN bytes taken")),
            &self.peer_name,
        )?;
        let rest = take(&mut rx, crate::wire::tcp::AUTH_ANSWER_LEN - STATUS_LEN)
            .map_err(|e| io_failed("receiving the answer to", e))?;
        open.finish(&rest, &self.peer_name)
    }

    pub(super) fn reader_loop(self: Arc<Self>) {
        let mut rx = RxBuf::new();
        let mut my_gen = 0;
        loop {
            let (conn, gen, deadline, opcode, local, len, guard) = {
                let mut st = self.lock();
                while st.reader_waits() {
                    st = self.wake_reader.wait(st).unwrap_or_else(|e| e.into_inner());
                }
                if st.reader_done() {
                    return;
                }
                let Some((conn, gen, front)) = st.reader_front() else {
                    continue;
                };
                let p = &front.piece;
                (
                    conn,
                    gen,
                    p.task.deadline(),
                    p.opcode,
                    p.local,
                    p.len,
                    p.guard.clone(),
                )
            };
            if gen != my_gen {
                rx.clear();
                my_gen = gen;
            }
            let expired = || rules::must_stop(Instant::now(), deadline, guard.is_revoked());
            // Large READ data goes straight into local memory: read only the status first.
            rx.max_fill = if opcode == Opcode::Read && len as usize >= DIRECT_MIN {
                STATUS_LEN
            } else {
                RX_BUF
            };
            let mut ans = Answer::protected(opcode, len, self.v2, conn.answer_protect());
            // The reader alone opens this connection's status frames while it reads them.
            let mut opener = conn.opener();
            if conn.open.is_some() {
                rx.max_fill = rx.max_fill.max(SEALED_STATUS_LEN);
            }
            // 1. Status frame (v2), before anything is taken off the queue.
            let mut bad = None;
            while ans.awaiting_status() && bad.is_none() {
                if let Err(e) = rx.need(&conn, 1, expired) {
                    self.fail_conn(
                        gen,
                        if e.kind() == io::ErrorKind::TimedOut {
                            ConnFailure::Deadline
                        } else {
                            ConnFailure::Broken(e.to_string())
                        },
                    );
                    break;
                }
                match ans.handle_bytes(rx.data(), &mut [], opener.as_deref_mut()) {
                    Ok(n) => rx.consume(n),
                    Err(e) => bad = Some(e),
                }
            }
            if let Some(e) = bad {
                // Not a protocol we can follow: fail the front op, drop the connection.
                let op = self.pop_front(gen);
                self.done_reading();
                self.fail_conn(gen, ConnFailure::Broken(e.to_string()));
                if let Some(op) = op {
                    let f = FailCause::Protocol.because(format!("{}: {e}", self.peer_name));
                    self.redirect_or_end(vec![(op, FailKind::Failed, f)]);
                }
                continue;
            }
            if ans.awaiting_status() {
                continue; // the connection failed (handled above)
            }
            // 2. The op is ours now.
            let Some(op) = self.pop_front(gen) else {
                continue;
            };
            if ans.status() == Some(Status::Unauthorized) {
                // A target holding a cluster key, and this engine none: nothing of this
                // connection's requests was taken, and none will be on another.
                self.done_reading();
                self.fail_conn(
                    gen,
                    ConnFailure::Untouched(
                        "target refused a connection without the cluster key".into(),
                    ),
                );
                // (What was sent after it came back to wait for a new connection: it would be
                // refused the same way.)
                self.end_pending(Some(op), FailKind::Failed, unauthorized(&self.peer_name));
                continue;
            }
            if ans.status() == Some(Status::Rejected) {
                self.done_reading();
                let reason = format!(
                    "{} rejected [0x{:x}, +{}): not inside memory it has registered",
                    self.peer_name, op.piece.remote, op.piece.len
                );
                self.end_op(
                    op,
                    Err((
                        FailKind::Failed,
                        FailCause::RemoteNotRegistered.because(reason),
                    )),
                );
                // The target closes after a rejection without taking what followed: the others
                // go again on a new connection (WRITEs too: nothing of them can land late).
                self.fail_conn(
                    gen,
                    ConnFailure::Untouched(
                        "target closed the connection after rejecting a request".into(),
                    ),
                );
                continue;
            }
            // 3. Payload: READ data (buffered part, then straight into local memory), or the
            // v1 fence byte after a WRITE.
            let r = (|| -> io::Result<()> {
                let dst: &mut [u8] = if opcode == Opcode::Read {
                    // SAFETY: the local range is registered (checked at submit) and the
                    // guard keeps it so; a revoked guard stops the receive between calls.
                    unsafe { std::slice::from_raw_parts_mut(local as *mut u8, len as usize) }
                } else {
                    &mut []
                };
                while !ans.done() {
                    if rx.len() > 0 {
                        let n = ans
                            .handle_bytes(rx.data(), dst, opener.as_deref_mut())
                            .map_err(invalid_data)?;
                        rx.consume(n);
                        continue;
                    }
                    let n = read_some(&conn, ans.target(dst).unwrap_or_default())?;
                    ans.on_received(n, dst, opener.as_deref_mut())
                        .map_err(invalid_data)?;
                    if !ans.done() && expired() {
                        return Err(stopped("receiving"));
                    }
                }
                Ok(())
            })();
            self.done_reading();
            match r {
                Ok(()) => self.end_op(op, Ok(())),
                Err(e) => {
                    let timed_out = e.kind() == io::ErrorKind::TimedOut;
                    // Back at the head so fail_conn retries or ends it with the rest; if
                    // its connection was already handled, it ends alone.
                    let back = self.lock().put_back(gen, op);
                    if let Err(op) = back {
                        let fate =
                            self.fate(&op, !timed_out, false, Instant::now(), &e.to_string());
                        let end = fate.unwrap_or((
                            FailKind::Failed,
                            FailCause::PeerLost
                                .because(format!("connection to {} lost: {e}", self.peer_name)),
                        ));
                        self.end_op(op, Err(end));
                        continue;
                    }
                    self.fail_conn(
                        gen,
                        if timed_out {
                            ConnFailure::Deadline
                        } else {
                            ConnFailure::Broken(e.to_string())
                        },
                    );
                }
            }
        }
    }

    pub(super) fn pop_front(&self, gen: u64) -> Option<WireOp> {
        self.lock().take_front(gen)
    }

    /// The reader is done with its op.
    pub(super) fn done_reading(&self) {
        if self.lock().done_reading() {
            self.wake_writer.notify_all();
        }
    }

    /// Runs one request in the calling thread if the lane is connected and idle: no thread
    /// hand-off, so a lone small request costs one round trip. Gives the piece back otherwise.
    pub(super) fn run_inline(&self, piece: Piece) -> Result<(), Piece> {
        let (conn, gen) = {
            let mut st = self.lock();
            let now = Instant::now();
            if st.idle() && !st.is_shutdown() && !st.is_retired() {
                drop_if_closed_by_peer(&mut st, now);
            }
            match st.begin_inline(now) {
                Some(c) => c,
                None => return Err(piece),
            }
        };
        self.load.fetch_add(piece.len, Ordering::AcqRel);
        piece.task.set_pending();
        let deadline = piece.task.deadline();
        let expired = || rules::must_stop(Instant::now(), deadline, piece.guard.is_revoked());
        let p = &piece;
        let result: io::Result<Status> = (|| {
            let (hdr, fence) = rules::request_frames(p.opcode, p.remote, p.len, self.v2);
            // SAFETY: the local range is registered (checked at submit) and the guard keeps
            // it so; a revoked guard stops every loop below between system calls.
            let local =
                unsafe { std::slice::from_raw_parts_mut(p.local as *mut u8, p.len as usize) };
            // This thread owns the connection until `end_inline`: it seals and opens.
            let (mut hbuf, mut fbuf) = ([0u8; SEALED_HEADER_LEN], [0u8; SEALED_HEADER_LEN]);
            // A protected WRITE body, as it goes.
            let mut sealed_body = Vec::new();
            let (hlen, flen) = {
                let mut seal = conn.sealer();
                let h = rules::put_header(&hdr, seal.as_deref_mut(), &mut hbuf);
                if let (Some(s), true) = (
                    seal.as_deref_mut(),
                    p.opcode == Opcode::Write && conn.protect != crate::auth::Protect::Headers,
                ) {
                    rules::seal_body(conn.protect, s, local, &mut sealed_body);
                }
                (
                    h,
                    fence.map_or(0, |f| rules::put_header(&f, seal.as_deref_mut(), &mut fbuf)),
                )
            };
            let body: &[u8] = if sealed_body.is_empty() {
                local
            } else {
                &sealed_body
            };
            match p.opcode {
                Opcode::Write => write_all_vectored(
                    &conn,
                    &mut [
                        IoSlice::new(&hbuf[..hlen]),
                        IoSlice::new(body),
                        IoSlice::new(&fbuf[..flen]),
                    ],
                    |_| expired(),
                )?,
                Opcode::Read => {
                    write_all_vectored(&conn, &mut [IoSlice::new(&hbuf[..hlen])], |_| expired())?
                }
            }
            let mut ans = Answer::protected(p.opcode, p.len, self.v2, conn.answer_protect());
            let mut opener = conn.opener();
            let dst: &mut [u8] = if p.opcode == Opcode::Read {
                local
            } else {
                &mut []
            };
            if ans.awaiting_status() && p.len <= SPIN_MAX_BYTES {
                let got = ans
                    .target(dst)
                    .map_or(0, |t| poll_read(&conn, t, self.spin));
                ans.on_received(got, dst, opener.as_deref_mut())
                    .map_err(invalid_data)?;
            }
            while !ans.done() {
                let n = read_some(&conn, ans.target(dst).unwrap_or_default())?;
                ans.on_received(n, dst, opener.as_deref_mut())
                    .map_err(invalid_data)?;
                if !ans.done() && expired() {
                    return Err(stopped("receiving"));
                }
            }
            Ok(ans.status().unwrap_or(Status::Ok))
        })();
        let op = WireOp { piece, attempts: 0 };
        let mut st = self.lock();
        let outcome = match result {
            Ok(Status::Ok) => Ok(()),
            Ok(Status::Rejected) => {
                let reason = format!(
                    "{} rejected [0x{:x}, +{}): not inside memory it has registered",
                    self.peer_name, op.piece.remote, op.piece.len
                );
                Err((
                    FailKind::Failed,
                    FailCause::RemoteNotRegistered.because(reason),
                ))
            }
            Ok(Status::Unauthorized) => Err((FailKind::Failed, unauthorized(&self.peer_name))),
            Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                match self.fate(&op, false, false, Instant::now(), &e.to_string()) {
                    Some(f) => Err(f),
                    None => Err((
                        FailKind::Timeout,
                        FailCause::Timeout.because(format!(
                            "no answer from {} ({}) before the deadline",
                            self.peer_name, self.target
                        )),
                    )),
                }
            }
            Err(e) if e.kind() == io::ErrorKind::InvalidData => Err((
                FailKind::Failed,
                FailCause::Protocol.because(format!("{}: {e}", self.peer_name)),
            )),
            Err(e) if op.piece.opcode == Opcode::Write || op.piece.guard.is_revoked() => {
                match self.fate(&op, true, false, Instant::now(), &e.to_string()) {
                    Some(f) => Err(f),
                    None => Err((
                        FailKind::Failed,
                        FailCause::PeerLost
                            .because(format!("connection to {} lost: {e}", self.peer_name)),
                    )),
                }
            }
            Err(e) => {
                // Broken connection: hand the READ to the lane threads for one retry.
                if let Some(c) = st.end_inline(gen, true) {
                    let _ = c.shutdown(Shutdown::Both);
                }
                tracing::debug!(
                    "inline request to {} failed ({e}); retrying on a new connection",
                    self.peer_name
                );
                st.retry_from_inline(op);
                self.wake_writer.notify_all();
                self.wake_reader.notify_all();
                return Ok(());
            }
        };
        // After a rejection or a protocol error the stream is not usable.
        if let Some(c) = st.end_inline(gen, outcome.is_err()) {
            let _ = c.shutdown(Shutdown::Both);
        }
        // Wake the lane threads only if work queued up meanwhile: a needless wake-up costs a
        // context switch on the core the peer needs.
        if !st.pending.is_empty() {
            self.wake_writer.notify_all();
        }
        drop(st);
        match outcome {
            Err((kind, f)) => self.redirect_or_end(vec![(op, kind, f)]),
            outcome => self.end_op(op, outcome),
        }
        Ok(())
    }

    pub(super) fn stop(&self) {
        if let Some(c) = self.lock().stop() {
            let _ = c.shutdown(Shutdown::Both);
        }
        self.wake_writer.notify_all();
        self.wake_reader.notify_all();
    }
}

/// A target holding a cluster key refused a request of this engine, which holds none.
fn unauthorized(peer: &str) -> Failure {
    FailCause::Unauthorized.because(format!(
        "{peer} holds a cluster key and refuses engines without it: set its KVFERRY_AUTH_KEY_FILE here too"
    ))
}

/// An answer the protocol cannot follow, as an I/O error of the connection.
fn invalid_data(e: WireError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}

pub(super) struct PeerLanes {
    pub(super) lanes: Vec<Arc<Lane>>,
    pub(super) rr: AtomicUsize,
}

impl PeerLanes {
    pub(super) fn pick(&self) -> usize {
        let start = self.rr.fetch_add(1, Ordering::Relaxed);
        let n = self.lanes.len();
        (0..n)
            .map(|i| (start + i) % n)
            .min_by_key(|&i| self.lanes[i].load.load(Ordering::Relaxed))
            .unwrap_or(0)
    }
}
