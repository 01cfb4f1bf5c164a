//! The master on the network: one thread per RPC connection, one ticker thread.
//!
//! With the cluster key (`Master::auth`), a connection is served only once it proved the key
//! (`prove`): until then it holds one of at most [`MAX_UNPROVED`] places
//! ([`MAX_UNPROVED_PER_IP`] per source address; more are closed at accept), for at most
//! [`PROOF_DEADLINE`], reads at most a handshake-sized first frame into a fixed buffer, and
//! nothing of it is decoded or served. After the proof every frame both ways is sealed.
//! Without a key nothing on the wire changes; a request frame then costs at most its length
//! and `proto::decode_bound` of it in heap while it is decoded.

use crate::error::StoreError;
use crate::master::{Attempt, Needs, State, OP_NAMES};
use crate::net::{accepted, keepalive, read_by, Spin, Unproved, UnprovedSlot};
use crate::node::Master;
use crate::proto::{self, PingStatus, Request, Response};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Applies one request to the master. A put that finds space held only by reads in flight
/// waits for them (one `put_wait_for_reads` per request, a batch included) on this
/// connection's thread, without holding the master's lock.
///
/// With HA, the request passes the master's [`crate::ha::Gate`] first (a standby or a fenced
/// leader applies nothing and answers `NotLeader`, naming the leader), and its answer passes
/// it again: an answer computed by a leader that lost its lease meanwhile is not sent (that
/// master's state is reset when it steps down). Between the two, a request that may change
/// durable state waits until the leader's journal holds the change (`crate::ha::journal`), so
/// whatever was answered survives a failover.
pub fn handle(m: &Master, req: Request) -> Response {
    match apply(m, req) {
        Applied::Now(resp) => resp,
        Applied::Later { ticket, term, resp } => match m.journal.wait(ticket, JOURNAL_WAIT) {
            Ok(()) => confirmed_durable(m, term, resp),
            Err(e) => Response::Err(e),
        },
        Applied::Early(resp) => {
            let _ = m.journal.collect(m);
            resp
        }
    }
}

/// A request applied: its answer, or the answer to send once its changes are durable (the
/// journal's `ticket`), if this master still leads `term` then.
enum Applied {
    Now(Response),
    Later { ticket: (i64, u64), term: i64, resp: Response },
    /// Answered before its changes were even collected: every change it made is a put
    /// placed in space whose grant is durable (`master::State::placed_granted`), which a new
    /// leader holds if the put's own change never reached it. Its changes go to the journal
    /// with the connection's next request (a put's end, one entry for both) or within
    /// [`RIDE_WAIT`] ([`serve_conn`]).
    Early(Response),
}

/// How long a connection whose last answer went out [`Applied::Early`] waits for its next
/// request before it hands that answer's changes to the journal itself.
const RIDE_WAIT: Duration = Duration::from_millis(1);

fn apply(m: &Master, req: Request) -> Applied {
    let term = match m.gate.admit() {
        Ok(t) => t,
        Err(e) => return Applied::Now(Response::Err(e)),
    };
    let journaled = mutates(&req);
    let (mut changed, mut ride) = (false, true);
    let (resp, held) = handle_admitted(m, req, term, &mut changed, &mut ride);
    if journaled && changed && ride {
        drop(held);
        m.journal.count_early();
        return Applied::Early(confirmed_durable(m, term, resp));
    }
    settle(m, term, journaled, changed, resp, held)
}

/// The second half of [`apply`]: what a request `journaled` (one that may mutate) changed goes
/// to the journal, under the hold of the state's lock it was applied under when the lock is
/// still held, and its answer waits for it.
///
/// One whose changes are not (or no longer) outstanding but that did change the state
/// (`changed`) had them taken by another request's collection when the state's lock was let
/// go (between a batch's holds, a put's tries, or applying and collecting), and they may be
/// durable: a master that no longer leads answers it `OutcomeUnknown`, not `NotLeader` (which
/// says nothing was applied, so send it again).
fn settle(m: &Master, term: i64, journaled: bool, changed: bool, resp: Response, held: Option<Held<'_>>) -> Applied {
    if !journaled {
        drop(held);
        return Applied::Now(confirmed(m, term, resp));
    }
    if let Some(ticket) = m.journal.collect_held(held.unwrap_or_else(|| m.lock()), m.now()) {
        return Applied::Later { ticket, term, resp };
    }
    Applied::Now(if changed { confirmed_durable(m, term, resp) } else { confirmed(m, term, resp) })
}

/// `resp` if the master still leads `term` with its lease proven, else the refusal.
fn confirmed(m: &Master, term: i64, resp: Response) -> Response {
    match m.gate.confirm(term) {
        Ok(()) => resp,
        Err(e) => Response::Err(e),
    }
}

/// [`confirmed`] for a request whose changes were applied and are durable now: a master that
/// no longer leads says the outcome is unknown to it, not `NotLeader` (which says nothing was
/// applied, and lets a client send the request again).
fn confirmed_durable(m: &Master, term: i64, resp: Response) -> Response {
    match confirm_durable(m, term) {
        Ok(()) => resp,
        Err(e) => Response::Err(e),
    }
}

/// Whether an answer to a request whose changes are durable may go out ([`confirmed_durable`]).
fn confirm_durable(m: &Master, term: i64) -> Result<(), StoreError> {
    m.gate.confirm(term).map_err(|_| StoreError::OutcomeUnknown)
}

fn frame_of(resp: &Response) -> Vec<u8> {
    proto::encode(resp).unwrap_or_else(|e| proto::encode(&Response::Err(e)).unwrap_or_default())
}

/// The sending side of one RPC connection, shared by its thread and whoever sends an answer
/// that waited for the journal ([`Applied::Later`]): that answer goes out from the thread
/// that learnt the changes are durable (an acknowledgement reader, the journal's writer), so
/// the connection's thread goes back to reading at once instead of sleeping until then, and
/// the client gets its answer one thread wake-up sooner. At most one answer is outstanding
/// per connection: the connection's thread handles its next request only after the deferred
/// answer was sent in full, so answers keep their requests' order.
///
/// On a connection that proved the cluster key every answer is sealed under its session
/// ([`Busy::sealer`]) right before it is written, under the lock that orders the writes: its
/// sequence number is that of its place on the wire.
struct Outbox {
    sock: TcpStream,
    busy: std::sync::Mutex<Busy>,
    idle: std::sync::Condvar,
}

#[derive(Default)]
struct Busy {
    /// A deferred answer is not sent in full yet.
    sending: bool,
    /// The connection's thread sleeps until it is (the sender wakes it only then: a wake-up
    /// is a system call even with nobody asleep).
    waiting: bool,
    /// Seals what goes out on a connection that proved the cluster key.
    sealer: Option<kvferry::auth::Sealer>,
}

impl Busy {
    /// `frame` ([`frame_of`]) as it goes on the wire: sealed without its plain length prefix
    /// when the connection is sealed, else as it is.
    fn wire(&mut self, frame: Vec<u8>) -> Vec<u8> {
        match &mut self.sealer {
            None => frame,
            Some(sealer) => {
                let mut out = Vec::new();
                sealer.seal_frame(crate::frame::body(&frame), &mut out);
                out
            }
        }
    }
}

/// How long a deferred answer that did not fit in the socket's buffer may take to be written
/// (a client that does not read its answers).
const SLOW_ANSWER: Duration = Duration::from_secs(30);

impl Outbox {
    fn busy(&self) -> std::sync::MutexGuard<'_, Busy> {
        self.busy.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until the deferred answer, if any, was sent in full (bounded: every deferred
    /// answer is answered, at the latest by the journal's expiry).
    fn wait_idle(&self) -> std::sync::MutexGuard<'_, Busy> {
        let mut b = self.busy();
        while b.sending {
            b.waiting = true;
            b = self.idle.wait(b).unwrap_or_else(|e| e.into_inner());
            b.waiting = false;
        }
        b
    }

    /// The connection thread's answer as it goes on the wire (after the deferred one, if any,
    /// went out whole: [`Busy::wire`]).
    fn next(&self, frame: Vec<u8>) -> Vec<u8> {
        self.wait_idle().wire(frame)
    }

    fn done(&self) {
        let mut b = self.busy();
        b.sending = false;
        let wake = b.waiting;
        drop(b);
        if wake {
            self.idle.notify_all();
        }
    }

    /// Sends a deferred answer without blocking the caller (an acknowledgement reader or the
    /// journal's writer, which answer many connections): what the socket does not take at
    /// once is written by a thread of its own, within [`SLOW_ANSWER`].
    fn send(self: Arc<Self>, frame: Vec<u8>) {
        use rustix::net::{send, SendFlags};
        let frame = self.busy().wire(frame);
        let flags = SendFlags::DONTWAIT | SendFlags::NOSIGNAL;
        let mut at = 0;
        while at < frame.len() {
            match send(&self.sock, &frame[at..], flags) {
                Ok(n) => at += n,
                Err(rustix::io::Errno::INTR) => {}
                Err(rustix::io::Errno::AGAIN) => break,
                Err(_) => {
                    // The connection is gone; its thread ends on its next read.
                    at = frame.len();
                }
            }
        }
        if at == frame.len() {
            return self.done();
        }
        let me = Arc::clone(&self);
        let spawned = std::thread::Builder::new().name("kvf-master-answer".into()).spawn(move || {
            let until = Instant::now() + SLOW_ANSWER;
            let mut at = at;
            while at < frame.len() {
                let left = until.saturating_duration_since(Instant::now());
                let mut fds = [rustix::event::PollFd::new(&me.sock, rustix::event::PollFlags::OUT)];
                let timeout = rustix::event::Timespec { tv_sec: left.as_secs() as i64, tv_nsec: left.subsec_nanos() as _ };
                if left.is_zero() || !matches!(rustix::event::poll(&mut fds, Some(&timeout)), Ok(_) | Err(rustix::io::Errno::INTR)) {
                    break;
                }
                match send(&me.sock, &frame[at..], flags) {
                    Ok(n) => at += n,
                    Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => {}
                    Err(_) => break,
                }
            }
            if at < frame.len() {
                tracing::debug!("master RPC: a client did not read its answer within {SLOW_ANSWER:?}; its connection is closed");
                let _ = me.sock.shutdown(Shutdown::Both);
            }
            me.done();
        });
        if spawned.is_err() {
            let _ = self.sock.shutdown(Shutdown::Both);
            self.done();
        }
    }
}

/// How long a request waits for its changes to reach the journal (the writer gives up, and
/// fences the leader, well before: when the lease can no longer be proven).
const JOURNAL_WAIT: Duration = Duration::from_secs(30);

/// Whether a request may change what the journal keeps (reads, pings and read releases only
/// touch leases and reads in flight, which are not replicated).
fn mutates(req: &Request) -> bool {
    match req {
        Request::GetReplicaList { .. } | Request::ExistKey { .. } | Request::Ping { .. } | Request::ReleaseReads { .. } | Request::AuthHello { .. } | Request::AuthProof { .. } => false,
        Request::Batch(reqs) => reqs.iter().any(mutates),
        _ => true,
    }
}

/// The state's lock, held.
type Held<'m> = std::sync::MutexGuard<'m, State>;

/// `req` applied, and the state's lock if it is still held from applying it (for the journal
/// to take the changes under the same hold).
/// `changed` is set when it changed durable state ([`State::marks`]).
/// `ride` is cleared unless every change it made was a put placed in space whose grant is
/// durable ([`Applied::Early`]).
fn handle_admitted<'m>(m: &'m Master, req: Request, term: i64, changed: &mut bool, ride: &mut bool) -> (Response, Option<Held<'m>>) {
    let deadline = Instant::now() + m.cfg.put_wait_for_reads;
    match req {
        Request::Batch(reqs) => {
            let (out, held) = handle_batch(m, reqs, deadline, term, changed, ride);
            (Response::Batch(out), held)
        }
        req => (handle_one(m, req, deadline, term, changed, ride), None),
    }
}

/// A request admitted under `term` is applied only to that term's state: one held up (the
/// thread descheduled) across a step-down and a new term is refused, not applied to state
/// that is not its own.
fn stale(st: &State, term: i64) -> Result<(), StoreError> {
    if st.term == term {
        Ok(())
    } else {
        Err(StoreError::NotLeader { leader: String::new() })
    }
}

/// Applies put start `req` under `term`; while the pool is full only of objects being read,
/// tries again every [`PUT_RETRY`] until `deadline`, letting go of the state's lock between
/// tries (the reads' ends free space).
fn put_start(m: &Master, req: &Request, deadline: Instant, term: i64, mut attempt: Attempt, changed: &mut bool, ride: &mut bool) -> Result<Response, StoreError> {
    loop {
        let last = Instant::now() >= deadline;
        if last {
            attempt = Attempt::Last;
        }
        let now = m.now();
        let mut st = m.lock();
        stale(&st, term)?;
        let r = start_put(&mut st, m, req, now, attempt, changed, ride);
        attempt = Attempt::Again;
        let retry = !last && matches!(r, Err(StoreError::NoAvailableHandle { .. })) && st.reads_in_flight(now);
        drop(st);
        if !retry {
            return r;
        }
        *ride = false;
        std::thread::sleep(PUT_RETRY);
    }
}

/// Starts put `req` on the state, whose lock the caller holds ([`State::apply`]): sets
/// `changed` if it changed durable state, and clears `ride` unless what it changed is a put
/// placed in space whose grant is durable ([`Needs::Granted`]).
fn start_put(st: &mut State, m: &Master, req: &Request, now: u64, attempt: Attempt, changed: &mut bool, ride: &mut bool) -> Result<Response, StoreError> {
    let a = st.apply(&m.cfg, &m.stats, req, now, attempt, m.journal.grants_durable(), &mut None);
    *changed |= a.needs != Needs::Nothing;
    if a.needs == Needs::Journal {
        *ride = false;
    }
    a.result
}

/// Applies `req` (not a put start, not a batch) to the state, whose lock the caller holds, at
/// `now` ([`State::apply`]); sets `changed` if it changed durable state (see [`settle`]). What
/// a bulk removal took out goes to `removed`, for the caller to drop after the lock.
fn apply_locked(st: &mut State, m: &Master, req: &Request, now: u64, changed: &mut bool, removed: &mut Option<crate::master::Removed>) -> Result<Response, StoreError> {
    let a = st.apply(&m.cfg, &m.stats, req, now, Attempt::Last, 0, removed);
    *changed |= a.needs != Needs::Nothing;
    a.result
}

/// How long a put that found space held only by reads in flight waits before trying again.
const PUT_RETRY: Duration = Duration::from_micros(500);

/// The index of `req`'s operation in [`OP_NAMES`] (`None`: a batch, which is no operation).
fn op_of(req: &Request) -> Option<usize> {
    Some(match req {
        Request::MountSegment { .. } => 0,
        Request::RemountSegments { .. } => 1,
        Request::UnmountSegment { .. } => 2,
        Request::Ping { .. } => 3,
        Request::PutStart { .. } => 4,
        Request::PutEnd { .. } => 5,
        Request::PutRevoke { .. } => 6,
        Request::GetReplicaList { .. } => 7,
        Request::ExistKey { .. } => 8,
        Request::Remove { .. } => 9,
        Request::RemoveAll { .. } => 10,
        Request::RemoveByRegex { .. } => 11,
        Request::ReleaseReads { .. } => 12,
        Request::BatchReplicaClear { .. } => 13,
        Request::HoldWrites { .. } => 14,
        Request::Batch(_) | Request::AuthHello { .. } | Request::AuthProof { .. } => return None,
    })
}

/// The answer to a request that [`op_of`] does not count: a batch within a batch, or an
/// authentication step anywhere but first on its connection ([`gate`]).
fn misplaced(req: &Request) -> Response {
    Response::Err(match req {
        Request::AuthHello { .. } | Request::AuthProof { .. } => StoreError::InvalidParams("the cluster key's handshake opens a connection (AuthHello, alone, as its first frame); not in a batch nor after".into()),
        _ => StoreError::InvalidParams("nested batches are not allowed".into()),
    })
}

/// What a connection does with a request ([`gate`]).
#[derive(Debug, PartialEq)]
pub(crate) enum Gate {
    /// Applied as usual.
    Pass(Request),
    /// Answered so, then the connection is closed.
    Refuse(Response),
}

fn unauthorized(why: impl Into<String>) -> Response {
    Response::Err(StoreError::Unauthorized(why.into()))
}

/// What a master does with a request of a connection: one holding the cluster key
/// (`keyed`) reads requests only on a connection that proved it ([`prove`]), so a handshake
/// step then is out of place; one without refuses a client that wants to authenticate (a
/// client holding a key must not talk to a master that cannot prove one).
pub(crate) fn gate(keyed: bool, req: Request) -> Gate {
    match req {
        Request::AuthHello { .. } if !keyed => Gate::Refuse(unauthorized("this master has no cluster key (KVFERRY_AUTH_KEY_FILE is unset where it runs): give it the cluster's key file, or unset KVFERRY_AUTH_KEY_FILE on this client")),
        req @ (Request::AuthHello { .. } | Request::AuthProof { .. }) => Gate::Refuse(misplaced(&req)),
        req => Gate::Pass(req),
    }
}

/// What a master holding the cluster key tells a connection whose first frame is not the
/// key's handshake.
const NEEDS_KEY: &str = "this master requires the cluster key: set KVFERRY_AUTH_KEY_FILE on this client to the cluster's key file (a stock Mooncake client cannot authenticate: serve those from a master without a key)";

/// How long a connection to a master holding the cluster key has, from its accept, to prove
/// the key: the handshake and its first sealed frame, whole. Until then the connection holds
/// one of the `Unproved` places, and nothing of it is decoded or served.
pub const PROOF_DEADLINE: Duration = Duration::from_secs(5);

/// The most connections not yet proved (`PROOF_DEADLINE`) a master holding the cluster key
/// keeps at once, in all; more are closed at accept.
pub const MAX_UNPROVED: usize = 256;

/// The most connections not yet proved a master holding the cluster key keeps at once from
/// one address; more are closed at accept.
pub const MAX_UNPROVED_PER_IP: usize = 64;

/// A connection's proof of the cluster key (`KVFERRY_AUTH_KEY_FILE`, [`kvferry::auth`]) to
/// a master that holds it, within `deadline`: the client's opening message in a plain
/// [`Request::AuthHello`] frame (a length prefix over [`proto::MAX_AUTH_HELLO_FRAME`] is
/// refused before anything more is read; the body, in a fixed buffer, is not decoded but
/// for that one message), dialing this master's cluster ([`proto::master_identity`]); the
/// answer in a plain [`Response::AuthChallenge`]; then the client's first sealed frame, which
/// must open under the session (only a client that holds it can seal one: a replayed
/// handshake gets an answer, but nothing more). Returns the session's halves, the first
/// frame's body in `body`. Anything else is refused with the reason (in a plain frame before
/// the session, a sealed one after) and ends the connection (an error).
fn prove(key: &kvferry::auth::ClusterKey, identity: &str, s: &TcpStream, deadline: Instant, body: &mut Vec<u8>) -> std::io::Result<(kvferry::auth::Sealer, kvferry::auth::Opener)> {
    use kvferry::auth::{frame_body_len, Refusal, FRAME_HEAD_LEN};
    let refuse = |why: String, sealer: Option<&mut kvferry::auth::Sealer>| -> std::io::Error {
        let frame = frame_of(&unauthorized(why.clone()));
        let frame = match sealer {
            Some(sealer) => {
                let mut out = Vec::new();
                sealer.seal_frame(crate::frame::body(&frame), &mut out);
                out
            }
            None => frame,
        };
        let mut w = s;
        let _ = w.write_all(&frame);
        std::io::Error::new(std::io::ErrorKind::PermissionDenied, why)
    };
    let late = |e: std::io::Error, sealer: Option<&mut kvferry::auth::Sealer>| match e.kind() {
        std::io::ErrorKind::TimedOut => refuse(format!("the cluster key was not proved within {PROOF_DEADLINE:?} of connecting (the handshake and the first request)"), sealer),
        _ => e,
    };
    s.set_write_timeout(Some(PROOF_DEADLINE))?;
    let mut prefix = [0u8; crate::frame::PREFIX_LEN];
    read_by(s, &mut prefix, deadline).map_err(|e| late(e, None))?;
    let n = crate::frame::body_len(prefix, proto::MAX_AUTH_HELLO_FRAME)
        .map_err(|t| refuse(format!("{NEEDS_KEY} (its first frame claims {} bytes; the key's handshake is at most {})", t.len, proto::MAX_AUTH_HELLO_FRAME), None))?;
    let mut first = [0u8; proto::MAX_AUTH_HELLO_FRAME];
    read_by(s, &mut first[..n], deadline).map_err(|e| late(e, None))?;
    let Some(hello) = proto::auth_hello_of(&first[..n]) else { return Err(refuse(NEEDS_KEY.into(), None)) };
    let (session, answer) = match kvferry::auth::answer(key, proto::STORE_RPC, hello, &[identity]) {
        Ok(a) => a,
        Err(Refusal::Misdirected { meant, here }) => {
            return Err(refuse(format!("the client dialed {meant:?} and this master is {here:?}: it serves another cluster; give the client the master's cluster id (KVFERRY_STORE_CLUSTER_ID, or MC_STORE_CLUSTER_ID) or point it at a master of its own cluster"), None));
        }
        Err(r) => return Err(refuse(format!("the client's hello: {r}"), None)),
    };
    let mut w = s;
    w.write_all(&frame_of(&Response::AuthChallenge { answer }))?;
    let (mut sealer, mut opener) = session.split();
    let mut head = [0u8; FRAME_HEAD_LEN];
    read_by(s, &mut head, deadline).map_err(|e| late(e, Some(&mut sealer)))?;
    let why = |r: Refusal| format!("the connection's first frame after the handshake: {r}; nothing of it was applied");
    let n = match opener.open_frame_head(&head, proto::MAX_FRAME) {
        Ok(n) => n,
        Err(r) => return Err(refuse(why(r), Some(&mut sealer))),
    };
    // (The head opened: the client holds the session, so its frame may take memory.)
    let mut sealed = vec![0u8; frame_body_len(n)];
    read_by(s, &mut sealed, deadline).map_err(|e| late(e, Some(&mut sealer)))?;
    if let Err(r) = opener.open_frame_body(&sealed, body) {
        return Err(refuse(why(r), Some(&mut sealer)));
    }
    s.set_read_timeout(None)?;
    s.set_write_timeout(Some(SLOW_ANSWER))?;
    Ok((sealer, opener))
}

/// Counts `r` in the master's statistics of operation `op`.
fn counted(m: &Master, op: usize, r: Result<Response, StoreError>) -> Response {
    match r {
        Ok(resp) => {
            if resp == Response::Ping(PingStatus::NeedRemount) {
                m.stats.errors[op].fetch_add(1, Ordering::Relaxed);
            }
            resp
        }
        Err(e) => {
            m.stats.errors[op].fetch_add(1, Ordering::Relaxed);
            Response::Err(e)
        }
    }
}

fn handle_one(m: &Master, req: Request, deadline: Instant, term: i64, changed: &mut bool, ride: &mut bool) -> Response {
    let Some(op) = op_of(&req) else { return misplaced(&req) };
    debug_assert!(op < OP_NAMES.len());
    m.stats.ops[op].fetch_add(1, Ordering::Relaxed);
    // What a RemoveAll/RemoveByRegex took out: its memory is freed after the state's lock is
    // released (this is declared before the lock is taken, so dropped after it is let go).
    let mut removed = None;
    let r = if let Request::PutStart { .. } = &req {
        put_start(m, &req, deadline, term, Attempt::First, changed, ride)
    } else {
        *ride &= !mutates(&req);
        let now = m.now();
        let mut st = m.lock();
        if let Err(e) = stale(&st, term) {
            return Response::Err(e);
        }
        apply_locked(&mut st, m, &req, now, changed, &mut removed)
    };
    counted(m, op, r)
}

/// Sub-requests of one batch applied under one hold of the state's lock, at most (a batch of
/// thousands of keys lets other connections in between).
const BATCH_HOLD: usize = 64;

/// Batches of at least this many requests count their answers' bytes (smaller ones cannot
/// come near the frame limit but through answers of a megabyte each).
const COUNT_ANSWERS_FROM: usize = 256;

/// The requests of a batch, in order, consecutive ones under one hold of the state's lock
/// (and one reading of the clock): taking the lock once per key made the lock's hand-over
/// between a master's many connections (a futex wake-up each) a large part of a batched
/// put's cost. A bulk removal, and a put that has to wait for reads to end, are applied on
/// their own as [`handle_one`] does.
/// Returns the answers, and the lock if the last of them was applied under it.
fn handle_batch<'m>(m: &'m Master, reqs: Vec<Request>, deadline: Instant, term: i64, changed: &mut bool, ride: &mut bool) -> (Vec<Response>, Option<Held<'m>>) {
    let mut out = Vec::with_capacity(reqs.len());
    // The lock held, with the time read when it was taken, whether the puts' wait for reads
    // is over, and how many requests it has been held for.
    let mut held: Option<(Held<'_>, u64, bool, usize)> = None;
    // A large batch's answers are counted as they come: past half a frame, the rest is not
    // applied (an answer over the frame limit used to replace every answer with one error,
    // after every put start had reserved its space and every get had started its read).
    let counting = reqs.len() >= COUNT_ANSWERS_FROM;
    let (mut bytes, mut sized) = (0usize, 0usize);
    for req in reqs {
        if counting {
            bytes += out[sized..].iter().map(|r| postcard::experimental::serialized_size(r).unwrap_or(0)).sum::<usize>();
            sized = out.len();
            if bytes > proto::MAX_FRAME / 2 {
                out.push(Response::Err(StoreError::InvalidParams(format!("not applied: the batch's answers reached {bytes} bytes, half the frame limit, before this request; send the rest in another batch"))));
                continue;
            }
        }
        let Some(op) = op_of(&req) else {
            out.push(misplaced(&req));
            continue;
        };
        if matches!(req, Request::RemoveAll { .. } | Request::RemoveByRegex { .. }) {
            held = None;
            out.push(handle_one(m, req, deadline, term, changed, ride));
            continue;
        }
        if held.as_ref().is_some_and(|h| h.3 >= BATCH_HOLD) {
            held = None;
        }
        let (st, now, last, n) = match &mut held {
            Some(h) => h,
            None => {
                let (last, now) = (Instant::now() >= deadline, m.now());
                held.insert((m.lock(), now, last, 0))
            }
        };
        *n += 1;
        m.stats.ops[op].fetch_add(1, Ordering::Relaxed);
        if let Err(e) = stale(st, term) {
            out.push(Response::Err(e));
            continue;
        }
        let r = match req {
            req @ Request::PutStart { .. } => {
                let attempt = if *last { Attempt::Last } else { Attempt::First };
                let r = start_put(st, m, &req, *now, attempt, changed, ride);
                if !*last && matches!(r, Err(StoreError::NoAvailableHandle { .. })) && st.reads_in_flight(*now) {
                    held = None;
                    *ride = false;
                    std::thread::sleep(PUT_RETRY);
                    put_start(m, &req, deadline, term, Attempt::Again, changed, ride)
                } else {
                    r
                }
            }
            req => {
                *ride &= !mutates(&req);
                apply_locked(st, m, &req, *now, changed, &mut None)
            }
        };
        out.push(counted(m, op, r));
    }
    (out, held.map(|h| h.0))
}

/// Whether `s` has something to read within `bound` (an error counts: the read reports it).
fn readable_within(s: &TcpStream, bound: Duration) -> bool {
    let mut fds = [rustix::event::PollFd::new(s, rustix::event::PollFlags::IN)];
    let timeout = rustix::event::Timespec { tv_sec: bound.as_secs() as i64, tv_nsec: bound.subsec_nanos() as _ };
    !matches!(rustix::event::poll(&mut fds, Some(&timeout)), Ok(0))
}

/// Serves one RPC connection until it ends. With the cluster key, it first proves the key
/// within [`PROOF_DEADLINE`] ([`prove`]), holding `unproved`'s place meanwhile; every frame
/// after is sealed.
fn serve_conn(m: &Arc<Master>, s: &TcpStream, spin: &Spin, unproved: Option<UnprovedSlot>) -> std::io::Result<()> {
    let deadline = Instant::now() + PROOF_DEADLINE;
    s.set_nodelay(true)?;
    let mut body = Vec::new();
    let (sealer, mut opener) = match &m.auth {
        Some(key) => {
            let (sealer, opener) = prove(key, &proto::master_identity(&m.cluster_id), s, deadline, &mut body)?;
            (Some(sealer), Some(opener))
        }
        None => (None, None),
    };
    drop(unproved);
    // The first request came with the proof.
    let mut have = opener.is_some();
    // An answer written by this thread waits for a client that stops reading at most this long
    // (deferred answers are sent without blocking, within the same bound: `Outbox::send`).
    s.set_write_timeout(Some(SLOW_ANSWER))?;
    let out = Arc::new(Outbox { sock: s.try_clone()?, busy: std::sync::Mutex::new(Busy { sealer, ..Busy::default() }), idle: std::sync::Condvar::new() });
    let mut head = [0u8; kvferry::auth::FRAME_HEAD_LEN];
    let mut sealed = Vec::new();
    let mut deferred = false;
    // An answer went out before its changes were collected ([`Applied::Early`]), at this time.
    let mut owed: Option<Instant> = None;
    loop {
        if let Some(at) = owed {
            let left = RIDE_WAIT.saturating_sub(at.elapsed());
            if left.is_zero() || !readable_within(s, left) {
                let _ = m.journal.collect(m);
                owed = None;
            }
        }
        if !have {
            // Not after an answer left for the journal: that client is still waiting for it.
            let prefix: &mut [u8; 4] = (&mut head[..4]).try_into().unwrap_or_else(|_| unreachable!("a sealed frame's head is longer than 4 bytes"));
            let got = if deferred || owed.is_some() { 0 } else { spin.poll(s, prefix)? };
            (&*s).read_exact(&mut prefix[got..])?;
            match &mut opener {
                None => read_plain(s, *prefix, &mut body)?,
                Some(o) => read_sealed(s, o, &mut head, &mut sealed, &mut body)?,
            }
        }
        have = false;
        // The previous request's answer, if it waited for the journal, is out first.
        drop(out.wait_idle());
        let req = proto::decode_request(&body).map(|req| gate(m.auth.is_some(), req));
        let resp = match req {
            Ok(Gate::Refuse(resp)) => {
                (&*s).write_all(&out.next(frame_of(&resp)))?;
                return Err(std::io::Error::new(std::io::ErrorKind::PermissionDenied, format!("{resp:?}")));
            }
            Ok(Gate::Pass(req)) => match (mutates(&req), apply(m, req)) {
                (_, Applied::Early(resp)) => {
                    owed.get_or_insert_with(Instant::now);
                    resp
                }
                // (Its collection took what an earlier answer left.)
                (true, Applied::Now(resp)) => {
                    owed = None;
                    resp
                }
                (false, Applied::Now(resp)) => resp,
                (_, Applied::Later { ticket, term, resp }) => {
                    owed = None;
                    out.busy().sending = true;
                    let (m2, out2) = (Arc::clone(m), Arc::clone(&out));
                    // Encoded here, and the answer freed here: the thread that sends it (an
                    // acknowledgement reader answering many connections) then only frees one
                    // buffer, not the answer's many small pieces allocated by this thread
                    // (a batch's answer is one per key; freeing them was a quarter of that
                    // reader's time at 16 connections x 128 keys).
                    let frame = frame_of(&resp);
                    drop(resp);
                    m.journal.defer(
                        ticket,
                        Box::new(move |durable| match durable.and_then(|()| confirm_durable(&m2, term)) {
                            Ok(()) => out2.send(frame),
                            Err(e) => out2.send(frame_of(&Response::Err(e))),
                        }),
                    );
                    deferred = true;
                    continue;
                }
            },
            Err(e) => Response::Err(e),
        };
        deferred = false;
        (&*s).write_all(&out.next(frame_of(&resp)))?;
    }
}

/// Reads a plain frame's body (`prefix` its length) into `body`, growing as its bytes arrive.
fn read_plain(s: &TcpStream, prefix: [u8; 4], body: &mut Vec<u8>) -> std::io::Result<()> {
    let n = proto::decode_len(prefix).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
    body.clear();
    s.take(n as u64).read_to_end(body)?;
    if body.len() != n {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

/// Reads the rest of a sealed frame whose head's first 4 bytes are in `head`, and opens it
/// into `body` (`sealed` holds its sealed bytes, growing as they arrive). A frame that does
/// not open (injected, replayed, altered) or claims more than [`proto::MAX_FRAME`] ends the
/// connection.
fn read_sealed(s: &TcpStream, o: &mut kvferry::auth::Opener, head: &mut [u8; kvferry::auth::FRAME_HEAD_LEN], sealed: &mut Vec<u8>, body: &mut Vec<u8>) -> std::io::Result<()> {
    let denied = |r: kvferry::auth::Refusal| std::io::Error::new(std::io::ErrorKind::PermissionDenied, format!("a frame of a connection that proved the cluster key: {r}"));
    (&*s).read_exact(&mut head[4..])?;
    let n = o.open_frame_head(head, proto::MAX_FRAME).map_err(denied)?;
    let len = kvferry::auth::frame_body_len(n);
    sealed.clear();
    s.take(len as u64).read_to_end(sealed)?;
    if sealed.len() != len {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    o.open_frame_body(sealed, body).map_err(denied)
}



/// A running master: RPC listener and ticker.
pub struct MasterServer {
    pub master: Arc<Master>,
    listener: Arc<TcpListener>,
    stop: Arc<AtomicBool>,
    port: u16,
}

impl MasterServer {
    /// Serves `listener`; ticks every `tick` (client expiry, deferred frees, eviction) and
    /// logs a summary line every `summary_every` ticks (0: never).
    pub fn start(master: Arc<Master>, listener: TcpListener, tick: Duration, summary_every: u32) -> std::io::Result<MasterServer> {
        Self::start_with_spin(master, listener, tick, summary_every, Duration::from_micros(50))
    }

    /// Like [`MasterServer::start`], with the bounded poll for a connection's next request
    /// (`Duration::ZERO`: always sleep in the kernel).
    pub fn start_with_spin(master: Arc<Master>, listener: TcpListener, tick: Duration, summary_every: u32, spin: Duration) -> std::io::Result<MasterServer> {
        let port = listener.local_addr()?.port();
        let listener = Arc::new(listener);
        let stop = Arc::new(AtomicBool::new(false));
        let (l, m, st) = (Arc::clone(&listener), Arc::clone(&master), Arc::clone(&stop));
        let spin = Arc::new(Spin::new(spin));
        let unproved = Unproved::new("master RPC", MAX_UNPROVED, MAX_UNPROVED_PER_IP, PROOF_DEADLINE);
        std::thread::Builder::new().name("kvf-master-accept".into()).spawn(move || {
            for conn in l.incoming() {
                if st.load(Ordering::Acquire) {
                    break;
                }
                let Some(conn) = accepted(conn, "master: accepting an RPC connection") else { continue };
                // With the cluster key, a place among the connections not proved yet, or the
                // connection is closed here (no thread, nothing read).
                let Ok(slot) = unproved.place(m.auth.is_some(), &conn) else { continue };
                // A client host that vanished (crashed, cut off) without closing is found by
                // TCP keepalive, so its thread, descriptor and buffer are not held for ever.
                keepalive(&conn, Duration::from_secs(30));
                let (m, spin) = (Arc::clone(&m), Arc::clone(&spin));
                let _ = std::thread::Builder::new().name("kvf-master-rpc".into()).spawn(move || {
                    if let Err(e) = serve_conn(&m, &conn, &spin, slot) {
                        if e.kind() != std::io::ErrorKind::UnexpectedEof {
                            tracing::debug!("master RPC connection closed: {e}");
                        }
                    }
                    let _ = conn.shutdown(Shutdown::Both);
                });
            }
        })?;
        let (m, st) = (Arc::clone(&master), Arc::clone(&stop));
        std::thread::Builder::new().name("kvf-master-tick".into()).spawn(move || {
            let mut n = 0u32;
            while !st.load(Ordering::Acquire) {
                std::thread::sleep(tick);
                m.tick();
                // Expiries and evictions are journaled too (nobody waits for them).
                let _ = m.journal.collect(&m);
                // Answers that waited for the journal too long get its error.
                m.journal.expire(JOURNAL_WAIT);
                n += 1;
                if summary_every > 0 && n % summary_every == 0 {
                    let s = m.lock().summary();
                    tracing::info!(
                        keys = s.keys, used = s.bytes_used, total = s.bytes_total, clients = s.clients, segments = s.segments,
                        evicted = m.stats.evicted_objects.load(Ordering::Relaxed), "master summary"
                    );
                }
            }
        })?;
        Ok(MasterServer { master, listener, stop, port })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        // SAFETY: shutting down our own listening socket wakes the blocked accept().
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
    }
}

impl Drop for MasterServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use crate::proto::ReplicateConfig;
    use crate::master::MasterConfig;
    use crate::proto::Segment;

    use kvferry::auth::{ClusterKey, Initiator, Opener, Sealer};

    fn key(text: &str) -> ClusterKey {
        ClusterKey::parse(text.as_bytes(), std::path::Path::new("k")).expect("key")
    }

    /// A master of cluster "c" holding `key` (if any), served on 127.0.0.1.
    fn keyed_master(key: Option<ClusterKey>) -> (Arc<Master>, MasterServer, std::net::SocketAddr) {
        let mut m = Master::new(MasterConfig::default());
        m.auth = key;
        m.cluster_id = "c".into();
        let m = Arc::new(m);
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = MasterServer::start(Arc::clone(&m), listener, Duration::from_millis(50), 0).expect("start");
        (m, server, addr)
    }

    /// A plain frame's answer.
    fn plain_answer(c: &mut TcpStream) -> Response {
        read_answer(c).expect("an answer")
    }

    /// The client's side of the key's handshake, by hand, dialing `identity`: the connection
    /// and its session's halves, or the master's plain answer when it refused. `hello` gets
    /// the opening message's frame as sent.
    fn handshake(addr: std::net::SocketAddr, k: &ClusterKey, identity: &str, hello: &mut Vec<u8>) -> Result<(TcpStream, Sealer, Opener), Response> {
        let mut c = TcpStream::connect(addr).expect("connect");
        c.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let (init, h) = Initiator::new(k, proto::STORE_RPC, identity).expect("hello");
        *hello = proto::encode(&Request::AuthHello { hello: h }).expect("encode");
        c.write_all(hello).expect("send");
        match plain_answer(&mut c) {
            Response::AuthChallenge { answer } => {
                let (s, o) = init.finish(&answer).expect("the master proves the key").split();
                Ok((c, s, o))
            }
            other => Err(other),
        }
    }

    fn sealed_frame(s: &mut Sealer, req: &Request) -> Vec<u8> {
        let mut out = Vec::new();
        s.seal_frame(&proto::encode(req).expect("encode")[4..], &mut out);
        out
    }

    fn sealed_answer(c: &mut TcpStream, o: &mut Opener) -> std::io::Result<Response> {
        let mut head = [0u8; kvferry::auth::FRAME_HEAD_LEN];
        c.read_exact(&mut head)?;
        let n = o.open_frame_head(&head, proto::MAX_FRAME).map_err(std::io::Error::other)?;
        let mut sealed = vec![0u8; kvferry::auth::frame_body_len(n)];
        c.read_exact(&mut sealed)?;
        let mut body = Vec::new();
        o.open_frame_body(&sealed, &mut body).map_err(std::io::Error::other)?;
        proto::decode(&body).map_err(|e| std::io::Error::other(e.to_string()))
    }

    fn closed(c: &mut TcpStream) -> bool {
        matches!(c.read(&mut [0u8; 1]), Ok(0) | Err(_))
    }

    fn refused_saying(r: Response, what: &str) -> String {
        match r {
            Response::Err(StoreError::Unauthorized(why)) if why.contains(what) => why,
            other => panic!("expected a refusal saying {what:?}: {other:?}"),
        }
    }

    /// A master holding the cluster key serves a connection only once it ran the key's
    /// handshake towards this master's cluster and its first sealed frame opened; every frame
    /// after is sealed both ways. Anything else is refused with the reason and the connection
    /// closed: a plain request first, a first frame longer than a handshake (refused on its
    /// length alone), another key, another cluster, a handshake step after the proof. A client
    /// whose file holds the master's key second (a key change) is served. A master without a
    /// key refuses a client that wants to authenticate.
    #[test]
    fn a_connection_proves_the_cluster_key_before_any_request_or_is_refused_saying_why() {
        let (a, b) = ("a".repeat(64), "b".repeat(64));
        let (m, _server, addr) = keyed_master(Some(key(&a)));
        let me = proto::master_identity("c");
        let mut hello = Vec::new();
        for k in [key(&a), key(&format!("{a}\n{b}"))] {
            let (mut c, mut s, mut o) = handshake(addr, &k, &me, &mut hello).expect("served");
            c.write_all(&sealed_frame(&mut s, &Request::MountSegment { client: 1, segment: seg(m.lock().summary().segments as u64 + 1, 1 << 20) })).expect("send");
            assert_eq!(sealed_answer(&mut c, &mut o).expect("answer"), Response::Ok);
            // Pipelined: both answers come, in order, sealed.
            let mut two = sealed_frame(&mut s, &Request::ExistKey { key: "k".into() });
            two.extend(sealed_frame(&mut s, &Request::Ping { client: 1 }));
            c.write_all(&two).expect("send");
            assert_eq!(sealed_answer(&mut c, &mut o).expect("answer"), Response::Exists(false));
            assert_eq!(sealed_answer(&mut c, &mut o).expect("answer"), Response::Ping(PingStatus::Ok));
            // The handshake is not run again on a proved connection.
            c.write_all(&sealed_frame(&mut s, &Request::AuthHello { hello: vec![0; 48] })).expect("send");
            assert!(matches!(sealed_answer(&mut c, &mut o).expect("answer"), Response::Err(StoreError::InvalidParams(_))));
            assert!(closed(&mut c));
        }
        assert_eq!(m.lock().summary().segments, 2);
        // A client opening with another key (it holds the master's second), or with no key.
        let e = handshake(addr, &key(&format!("{b}\n{a}")), &me, &mut hello).expect_err("refused");
        refused_saying(e, "another key");
        let mut raw = TcpStream::connect(addr).expect("connect");
        raw.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        raw.write_all(&proto::encode(&Request::MountSegment { client: 9, segment: seg(9, 1 << 20) }).expect("encode")).expect("send");
        refused_saying(plain_answer(&mut raw), "set KVFERRY_AUTH_KEY_FILE on this client");
        assert!(closed(&mut raw));
        // A first frame longer than any handshake: refused on its length, nothing more read.
        let mut big = TcpStream::connect(addr).expect("connect");
        big.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        big.write_all(&(proto::MAX_FRAME as u32).to_le_bytes()).expect("send");
        refused_saying(plain_answer(&mut big), &format!("claims {} bytes", proto::MAX_FRAME));
        // A client of another cluster.
        let e = handshake(addr, &key(&a), &proto::master_identity("other"), &mut hello).expect_err("refused");
        eprintln!("{}", refused_saying(e, "serves another cluster"));
        assert_eq!(m.lock().summary().segments, 2, "nothing of the refused connections applied");
        // A master without a key.
        assert!(matches!(gate(false, Request::AuthHello { hello: vec![] }), Gate::Refuse(Response::Err(StoreError::Unauthorized(w))) if w.contains("has no cluster key")));
        assert_eq!(gate(false, Request::Ping { client: 1 }), Gate::Pass(Request::Ping { client: 1 }));
        let (_open, _s2, open_addr) = keyed_master(None);
        assert!(matches!(handshake(open_addr, &key(&a), &me, &mut hello), Err(Response::Err(StoreError::Unauthorized(w))) if w.contains("has no cluster key")));
        // The step of an earlier exchange, anywhere.
        assert!(matches!(gate(true, Request::AuthProof { mac: vec![] }), Gate::Refuse(Response::Err(StoreError::InvalidParams(_)))));
        let j = journaling_leader(5);
        assert!(matches!(handle(&j, Request::Batch(vec![Request::AuthProof { mac: vec![] }])), Response::Batch(r) if matches!(&r[..], [Response::Err(StoreError::InvalidParams(_))])));
    }

    /// What a keyless host on the path can do with a keyed client's connection: replay its
    /// handshake and first sealed request on a new connection (the master answers the hello,
    /// which holds nothing fresh from it, but the replayed frame does not open there), inject
    /// a frame of its own after the handshake, or alter a sealed frame (its head or its
    /// body, first or later): each is refused and nothing of it is applied; a refusal after
    /// the handshake is sealed, so the client behind the relay reads why.
    #[test]
    fn a_replayed_handshake_or_an_injected_or_altered_frame_is_refused_and_nothing_applied() {
        let k = key(&"k".repeat(64));
        let (m, _server, addr) = keyed_master(Some(k.clone()));
        let me = proto::master_identity("c");
        assert_eq!(handle(&m, Request::MountSegment { client: 1, segment: seg(1, 1 << 20) }), Response::Ok);
        assert!(matches!(handle(&m, put_start("victim", 4096)), Response::Replicas(_)));
        assert_eq!(handle(&m, Request::PutEnd { client: 1, key: "victim".into(), put: 1 }), Response::Ok);
        let remove = Request::Remove { key: "victim".into(), force: true };
        let exists = |m: &Master| handle(m, Request::ExistKey { key: "victim".into() }) == Response::Exists(true);
        // A real client's connection, captured: its hello and first sealed frame (a mount).
        let mut hello = Vec::new();
        let (mut c, mut s, mut o) = handshake(addr, &k, &me, &mut hello).expect("served");
        let first = sealed_frame(&mut s, &Request::MountSegment { client: 2, segment: seg(2, 1 << 20) });
        c.write_all(&first).expect("send");
        assert_eq!(sealed_answer(&mut c, &mut o).expect("answer"), Response::Ok);
        assert_eq!(m.lock().summary().segments, 2);
        // Replayed on a new connection: answered, but the frame does not open; nothing applied.
        let mut r = TcpStream::connect(addr).expect("connect");
        r.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        r.write_all(&hello).expect("send");
        assert!(matches!(plain_answer(&mut r), Response::AuthChallenge { .. }), "a replayed hello gets an answer");
        r.write_all(&first).expect("send");
        let mut rest = Vec::new();
        let _ = r.read_to_end(&mut rest);
        assert!(!rest.is_empty() && rest.len() < 1024, "a sealed refusal the replayer cannot read, then the end: {} bytes", rest.len());
        assert_eq!(m.lock().summary().segments, 2, "the replayed mount was not applied");
        // A keyless relay injects its own (plain) request after a real handshake.
        let (mut c, _s, mut o) = handshake(addr, &k, &me, &mut hello).expect("served");
        // (Two removals in a batch: longer than a sealed frame's head, read whole as one.)
        c.write_all(&proto::encode(&Request::Batch(vec![remove.clone(), remove.clone()])).expect("encode")).expect("send");
        let why = refused_saying(sealed_answer(&mut c, &mut o).expect("the client reads why"), "does not open under this connection's session");
        assert!(why.contains("nothing of it was applied"), "{why}");
        assert!(closed(&mut c));
        assert!(exists(&m), "the injected removal was not applied");
        // It alters a real client's sealed first frame: its head, or its body.
        for at in [0, kvferry::auth::FRAME_HEAD_LEN + 3] {
            let (mut c, mut s, mut o) = handshake(addr, &k, &me, &mut hello).expect("served");
            let mut f = sealed_frame(&mut s, &remove);
            f[at] ^= 1;
            c.write_all(&f).expect("send");
            refused_saying(sealed_answer(&mut c, &mut o).expect("the client reads why"), "does not open");
            assert!(exists(&m), "an altered removal was not applied (byte {at})");
        }
        // Or a later frame: the connection ends, nothing applied.
        let (mut c, mut s, mut o) = handshake(addr, &k, &me, &mut hello).expect("served");
        c.write_all(&sealed_frame(&mut s, &Request::Ping { client: 1 })).expect("send");
        assert_eq!(sealed_answer(&mut c, &mut o).expect("answer"), Response::Ping(PingStatus::Ok));
        let mut f = sealed_frame(&mut s, &remove);
        let last = f.len() - 1;
        f[last] ^= 0x80;
        c.write_all(&f).expect("send");
        assert!(closed(&mut c));
        assert!(exists(&m), "an altered later removal was not applied");
        // (The removal itself, sealed and intact, is applied.)
        let (mut c, mut s, mut o) = handshake(addr, &k, &me, &mut hello).expect("served");
        c.write_all(&sealed_frame(&mut s, &remove)).expect("send");
        assert_eq!(sealed_answer(&mut c, &mut o).expect("answer"), Response::Ok);
        assert!(!exists(&m));
    }

    /// At most `total` connections hold a place before their proof, `per_ip` from one address;
    /// a place is given back when its connection proves the key or ends.
    #[test]
    fn connections_not_yet_proved_are_bounded_in_all_and_per_address() {
        let u = Unproved::new("test", 5, 3, PROOF_DEADLINE);
        let (a, b, c): (std::net::IpAddr, std::net::IpAddr, std::net::IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap(), "10.0.0.3".parse().unwrap());
        let from_a: Vec<_> = (0..3).map(|_| u.admit(a).expect("under the cap")).collect();
        assert!(u.admit(a).is_none(), "a fourth from one address");
        let from_b: Vec<_> = (0..2).map(|_| u.admit(b).expect("under the cap")).collect();
        assert!(u.admit(c).is_none(), "a sixth in all");
        assert_eq!(u.held(a), (5, 3));
        drop(from_a);
        assert_eq!(u.held(a), (2, 0));
        let more: Vec<_> = (0..3).map(|_| u.admit(c).expect("places given back")).collect();
        assert!(u.admit(a).is_none());
        drop((from_b, more));
        assert_eq!(u.held(b), (0, 0));
        assert_eq!((u.held(a), u.held(c)), ((0, 0), (0, 0)), "every place is back (and no address kept: kvferry::auth's test)");
    }

    /// A proof's reads end at its deadline however the bytes trickle in.
    #[test]
    fn a_proof_is_read_by_its_deadline_even_a_byte_at_a_time() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (s, _) = l.accept().expect("accept");
        let t = Instant::now();
        std::thread::scope(|sc| {
            sc.spawn(|| {
                for _ in 0..20 {
                    if c.write_all(&[1]).is_err() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(40));
                }
            });
            let e = read_by(&s, &mut [0u8; 16], Instant::now() + Duration::from_millis(200)).expect_err("not whole in time");
            assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
            assert!(t.elapsed() < Duration::from_millis(600), "{:?}", t.elapsed());
        });
        read_by(&s, &mut [0u8; 1], Instant::now() + Duration::from_secs(5)).expect("a byte that is there");
    }

    fn read_answer(c: &mut TcpStream) -> std::io::Result<Response> {
        let mut len = [0u8; 4];
        c.read_exact(&mut len)?;
        let mut body = vec![0u8; proto::decode_len(len).map_err(|e| std::io::Error::other(e.to_string()))?];
        c.read_exact(&mut body)?;
        proto::decode(&body).map_err(|e| std::io::Error::other(e.to_string()))
    }

    fn seg(id: u64, size: u64) -> Segment {
        Segment { id, name: format!("s{id}"), te_endpoint: format!("127.0.0.1:{id}"), base: id << 32, size }
    }

    /// A master leading `term`, its state journaling and its journal active (nothing writes
    /// it: tests drive the journal by hand).
    fn journaling_leader(term: i64) -> Master {
        let m = Master::new(MasterConfig::default());
        m.gate.lead_for_test(term, Duration::from_secs(60));
        {
            let mut st = m.lock();
            st.term = term;
            st.journal_on();
        }
        m.journal.activate(term);
        m
    }

    fn put_start(key: &str, size: u64) -> Request {
        Request::PutStart { client: 1, key: key.into(), size, config: ReplicateConfig::default(), upsert: false, put: 1 }
    }

    /// A removal's pattern is compiled with a bounded size under the state's lock: one that
    /// would compile to more is refused, saying so, and removes nothing.
    #[test]
    fn a_regex_removal_too_large_to_compile_is_refused() {
        let m = Master::new(MasterConfig::default());
        // (`\w{40}` compiles under regex's own 10 MiB limit, over this one.)
        let r = handle(&m, Request::RemoveByRegex { pattern: "\\w{40}".into(), force: false });
        assert!(matches!(&r, Response::Err(StoreError::InvalidParams(w)) if w.contains("bad regex")), "{r:?}");
        assert_eq!(handle(&m, Request::RemoveByRegex { pattern: "^k".into(), force: false }), Response::Count(0));
    }

    /// A batch whose answers would pass the frame limit stops applying its requests at half
    /// of it: the rest are answered "not applied", and the answer is sent (before, every
    /// request was applied and the whole answer replaced by one error).
    #[test]
    fn a_batch_stops_applying_before_its_answer_outgrows_a_frame() {
        let m = Master::new(MasterConfig::default());
        let long = Segment { te_endpoint: format!("127.0.0.1:1/{}", "x".repeat(8000)), ..seg(1, 4 << 20) };
        assert_eq!(handle(&m, Request::MountSegment { client: 1, segment: long }), Response::Ok);
        assert!(matches!(handle(&m, put_start("k", 4096)), Response::Replicas(_)));
        assert_eq!(handle(&m, Request::PutEnd { client: 1, key: "k".into(), put: 1 }), Response::Ok);
        let n = 6000; // 6000 answers of ~8 KB: 48 MB
        let Response::Batch(a) = handle(&m, Request::Batch((0..n).map(|_| Request::GetReplicaList { key: "k".into() }).collect())) else { panic!("not a batch's answer") };
        assert_eq!(a.len(), n);
        let served = a.iter().take_while(|r| matches!(r, Response::ReplicaList(_))).count();
        assert!((3000..5000).contains(&served), "{served} gets served before half a frame (32 MiB) of answers");
        assert!(a[served..].iter().all(|r| matches!(r, Response::Err(StoreError::InvalidParams(w)) if w.contains("not applied"))));
        assert!(proto::encode(&Response::Batch(a)).is_ok(), "the answer fits a frame");
    }

    /// A batch is answered request by request, in order, across several holds of the lock
    /// (more requests than one hold takes, a bulk removal and a nested batch among them),
    /// each request counted in the statistics as when sent alone.
    #[test]
    fn a_batch_answers_every_request_in_order_across_holds_of_the_lock() {
        let m = Master::new(MasterConfig::default());
        assert_eq!(handle(&m, Request::MountSegment { client: 1, segment: seg(1, 4 << 20) }), Response::Ok);
        let n = 2 * BATCH_HOLD + 22;
        let keys: Vec<String> = (0..n).map(|i| format!("k{i}")).collect();
        let mut starts: Vec<Request> = keys.iter().map(|k| put_start(k, 4096)).collect();
        starts.insert(BATCH_HOLD + 3, Request::Batch(vec![Request::Ping { client: 1 }]));
        let Response::Batch(a) = handle(&m, Request::Batch(starts)) else { panic!("not a batch's answer") };
        assert_eq!(a.len(), n + 1);
        for (i, r) in a.iter().enumerate() {
            if i == BATCH_HOLD + 3 {
                assert!(matches!(r, Response::Err(StoreError::InvalidParams(_))), "the nested batch: {r:?}");
            } else {
                assert!(matches!(r, Response::Replicas(v) if v.len() == 1), "put {i}: {r:?}");
            }
        }
        let mut ends: Vec<Request> = keys.iter().map(|k| Request::PutEnd { client: 1, key: k.clone(), put: 1 }).collect();
        ends.push(Request::PutEnd { client: 1, key: "never-started".into(), put: 1 });
        ends.push(Request::RemoveByRegex { pattern: "^k1".into(), force: false });
        ends.push(Request::ExistKey { key: "k0".into() });
        ends.push(Request::ExistKey { key: "k100".into() });
        ends.push(Request::RemoveByRegex { pattern: "(".into(), force: false });
        let Response::Batch(b) = handle(&m, Request::Batch(ends)) else { panic!("not a batch's answer") };
        assert!(b[..n].iter().all(|r| *r == Response::Ok), "{:?}", &b[..n]);
        assert!(matches!(b[n], Response::Err(_)), "a put that never started: {:?}", b[n]);
        // k1, k10-k19 and k100-k149.
        assert_eq!(b[n + 1], Response::Count(1 + 10 + (n as u64 - 100)));
        assert_eq!(b[n + 2..n + 4], [Response::Exists(true), Response::Exists(false)]);
        assert!(matches!(b[n + 4], Response::Err(StoreError::InvalidParams(_))), "{:?}", b[n + 4]);
        let ops = |op: usize| (m.stats.ops[op].load(Ordering::Relaxed), m.stats.errors[op].load(Ordering::Relaxed));
        assert_eq!(ops(4), (n as u64, 0), "PutStart");
        assert_eq!(ops(5), (n as u64 + 1, 1), "PutEnd");
        assert_eq!(ops(11), (2, 1), "RemoveByRegex");
        assert_eq!(ops(3), (0, 0), "the nested batch's ping was not applied");
    }

    /// A put in a batch that finds the space held by a read in flight lets the lock go, waits
    /// for the read to end and tries again; the requests after it see what it did.
    #[test]
    fn a_put_in_a_batch_waits_for_reads_without_the_lock_and_the_rest_follow_it() {
        let m = Arc::new(Master::new(MasterConfig { put_wait_for_reads: Duration::from_secs(5), ..MasterConfig::default() }));
        assert_eq!(handle(&m, Request::MountSegment { client: 1, segment: seg(1, 64 << 10) }), Response::Ok);
        for k in ["old", "read"] {
            assert!(matches!(handle(&m, put_start(k, 32 << 10)), Response::Replicas(_)));
            assert_eq!(handle(&m, Request::PutEnd { client: 1, key: k.into(), put: 1 }), Response::Ok);
        }
        let Response::ReplicaList(l) = handle(&m, Request::GetReplicaList { key: "read".into() }) else { panic!("no replica list") };
        let t = Instant::now();
        let reader = {
            let m = Arc::clone(&m);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                // Not blocked behind the batch: the put waits without the lock.
                assert_eq!(handle(&m, Request::ExistKey { key: "old".into() }), Response::Exists(true));
                assert_eq!(handle(&m, Request::ReleaseReads { ids: vec![l.read_id] }), Response::Ok);
            })
        };
        let exists = |k: &str| Request::ExistKey { key: k.into() };
        let batch = vec![exists("read"), put_start("new", 32 << 10), exists("old"), exists("read"), exists("new")];
        let Response::Batch(a) = handle(&m, Request::Batch(batch)) else { panic!("not a batch's answer") };
        reader.join().expect("the reader's checks");
        assert!(t.elapsed() >= Duration::from_millis(100), "the put did not wait for the read");
        assert!(t.elapsed() < Duration::from_secs(4), "the put gave up waiting instead of seeing the read end");
        assert_eq!(a[0], Response::Exists(true));
        assert!(matches!(a[1], Response::Replicas(_)), "{:?}", a[1]);
        let left = a[2..4].iter().filter(|r| **r == Response::Exists(true)).count();
        assert_eq!(left, 1, "one object made room for the put, seen by the requests after it: {:?}", &a[2..4]);
        assert_eq!(a[4], Response::Exists(false), "the new object is not complete");
    }

    /// Only `limit` connections poll at once; the others go to sleep in the kernel at once
    /// (and read nothing); a poll takes what arrived, a closed peer is an end of stream.
    #[test]
    fn at_most_the_limit_of_connections_poll_for_their_next_request() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (s, _) = l.accept().expect("accept");
        let spin = Spin { bound: Duration::from_secs(5), polling: AtomicUsize::new(1), limit: 1 };
        c.write_all(&[1, 2, 3, 4]).expect("send");
        let mut prefix = [0u8; 4];
        let t = Instant::now();
        assert_eq!(spin.poll(&s, &mut prefix).expect("poll"), 0, "over the limit: no poll");
        assert!(t.elapsed() < Duration::from_secs(1));
        assert_eq!(spin.polling.load(Ordering::Relaxed), 1, "the count is left as it was");
        spin.polling.store(0, Ordering::Relaxed);
        assert_eq!(spin.poll(&s, &mut prefix).expect("poll"), 4);
        assert_eq!(prefix, [1, 2, 3, 4]);
        assert_eq!(spin.polling.load(Ordering::Relaxed), 0);
        let quick = Spin { bound: Duration::from_millis(20), ..spin };
        assert_eq!(quick.poll(&s, &mut prefix).expect("poll"), 0, "nothing came within the bound");
        drop(c);
        let e = quick.poll(&s, &mut prefix).expect_err("the peer closed");
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
        assert_eq!(quick.polling.load(Ordering::Relaxed), 0);
    }

    /// A replication reader's poll returns once bytes arrived (reading none of them) or the
    /// peer closed, gives up after its bound, and polls only below its limit; under 4 CPUs
    /// nothing polls.
    #[test]
    fn a_replication_reader_polls_until_its_next_frame_arrives_and_reads_nothing() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (mut s, _) = l.accept().expect("accept");
        let spin = Spin { bound: Duration::from_secs(5), polling: AtomicUsize::new(0), limit: 1 };
        let t = Instant::now();
        std::thread::scope(|sc| {
            sc.spawn(|| {
                std::thread::sleep(Duration::from_millis(30));
                c.write_all(&[7]).expect("send");
            });
            assert!(spin.readable(&s), "the byte arrived within the bound");
        });
        assert!(t.elapsed() >= Duration::from_millis(25) && t.elapsed() < Duration::from_secs(4), "polled until it arrived: {:?}", t.elapsed());
        assert_eq!(spin.polling.load(Ordering::Relaxed), 0);
        let mut b = [0u8; 1];
        s.read_exact(&mut b).expect("the byte is still there");
        assert_eq!(b, [7]);
        let quick = Spin { bound: Duration::from_millis(20), ..spin };
        let t = Instant::now();
        assert!(!quick.readable(&s), "nothing came within the bound");
        assert!(t.elapsed() >= Duration::from_millis(20));
        quick.polling.store(1, Ordering::Relaxed);
        c.write_all(&[8]).expect("send");
        let t = Instant::now();
        assert!(!quick.readable(&s), "over the limit: no poll, even with a byte there");
        assert!(t.elapsed() < Duration::from_millis(20));
        quick.polling.store(0, Ordering::Relaxed);
        s.read_exact(&mut b).expect("read");
        drop(c);
        assert!(quick.readable(&s), "a closed peer ends the poll (the read finds the end)");
        assert_eq!(s.read(&mut b).expect("read"), 0);
        assert!(Spin::for_replication_on(2).bound.is_zero(), "two CPUs: no poll");
        assert_eq!(Spin::for_replication_on(16).limit, 4);
    }

    /// Half the CPUs poll at once; on one CPU nothing polls (the poller would hold the CPU its
    /// client needs): a request already there is read at once, and nothing is waited for.
    #[test]
    fn on_one_cpu_no_connection_polls() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (s, _) = l.accept().expect("accept");
        assert_eq!(Spin::for_cpus(Duration::from_micros(50), 16).limit, 8);
        assert_eq!(Spin::for_cpus(Duration::from_micros(50), 2).limit, 1);
        let one = Spin::for_cpus(Duration::from_secs(5), 1);
        let mut prefix = [0u8; 4];
        let t = Instant::now();
        assert_eq!(one.poll(&s, &mut prefix).expect("poll"), 0, "nothing there, nothing waited for");
        c.write_all(&[1, 2, 3, 4]).expect("send");
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(one.poll(&s, &mut prefix).expect("poll"), 0, "even what is there is left to the blocking read");
        assert!(t.elapsed() < Duration::from_secs(1), "no poll ran to its bound");
        assert_eq!(one.polling.load(Ordering::Relaxed), 0);
    }

    /// With grants on, a batch of puts placed in space whose grant is durable is answered at
    /// once, its changes left for the next collection: the puts' ends then go to the journal
    /// in one entry with them, one change per key. A put placed in a grant not yet durable,
    /// or a batch that also changes anything else, waits as before.
    #[test]
    fn puts_placed_in_a_durable_grant_are_answered_at_once_and_their_changes_ride_with_the_next() {
        let m = journaling_leader(5);
        m.lock().set_grant_bytes(1 << 20, 600_000);
        let ticket = |a: Applied| match a {
            Applied::Later { ticket, .. } => ticket,
            other => panic!("answered before its changes were durable: {:?}", matches!(other, Applied::Early(_))),
        };
        ticket(apply(&m, Request::MountSegment { client: 1, segment: seg(1, 1 << 30) }));
        let starts = |from: usize| Request::Batch((from..from + 4).map(|i| Request::PutStart { client: 1, key: format!("k{i}"), size: 4096, config: ReplicateConfig::default(), upsert: false, put: 1 }).collect());
        let ends = |from: usize| Request::Batch((from..from + 4).map(|i| Request::PutEnd { client: 1, key: format!("k{i}"), put: 1 }).collect());
        // The first puts carve the pool: its grant is not durable yet.
        ticket(apply(&m, starts(0)));
        ticket(apply(&m, ends(0)));
        m.journal.write_queued_for_test();
        assert!(m.journal.grants_durable() >= crate::master::grants_issued(), "the grant is durable with the entry that holds it");
        match apply(&m, starts(4)) {
            Applied::Early(Response::Batch(r)) => assert!(r.iter().all(|r| matches!(r, Response::Replicas(_))), "{r:?}"),
            _ => panic!("puts in a durable grant wait for their changes"),
        }
        assert_eq!(m.journal.stats().lag, 0, "nothing was collected for them");
        ticket(apply(&m, ends(4)));
        let mut taken = Vec::new();
        {
            let mut st = m.lock();
            assert!(st.take_changes(0).is_empty(), "the ends took the starts' changes along");
        }
        m.journal.drain_for_test(&mut taken);
        use crate::master::journal::Change;
        let objects: Vec<&str> = taken.iter().filter_map(|c| match c {
            Change::Object { key, rec } if rec.pending.is_none() && !rec.current.is_empty() => Some(key.as_str()),
            _ => None,
        }).collect();
        assert_eq!(objects.len(), 4, "one change per key, the whole object: {taken:?}");
        // A batch that also changes something else waits.
        let mixed = Request::Batch(vec![Request::PutStart { client: 1, key: "k8".into(), size: 4096, config: ReplicateConfig::default(), upsert: false, put: 1 }, Request::Remove { key: "k0".into(), force: true }]);
        ticket(apply(&m, mixed));
        // Alone, through `handle` (no connection to carry its changes), it is collected at once.
        assert!(matches!(handle(&m, put_start("k9", 4096)), Response::Replicas(_)));
        assert!(m.journal.stats().lag > 0 && m.lock().take_changes(0).is_empty(), "collected, not waited for");
    }

    /// Whatever a request changed goes to the journal and its answer waits for it, however it
    /// was applied: alone, as a batch (its changes taken under the hold of the state's lock it
    /// was applied under), as a batch ending with a bulk removal (applied on its own, the lock
    /// let go before); nothing is left marked behind. A read is answered at once.
    #[test]
    fn every_mutation_waits_for_the_journal_alone_batched_or_after_a_bulk_removal() {
        let m = journaling_leader(5);
        let later = |a: Applied| match a {
            Applied::Later { ticket, term, .. } => {
                assert_eq!(term, 5);
                assert!(m.lock().take_changes(0).is_empty(), "every change was taken into the journal with the request");
                ticket
            }
            Applied::Now(r) | Applied::Early(r) => panic!("answered before its changes were durable: {r:?}"),
        };
        let t1 = later(apply(&m, Request::MountSegment { client: 1, segment: seg(1, 1 << 20) }));
        let puts = (0..3).map(|i| Request::PutStart { client: 1, key: format!("k{i}"), size: 4096, config: ReplicateConfig::default(), upsert: false, put: 1 }).collect();
        let t2 = later(apply(&m, Request::Batch(puts)));
        let ends = (0..3).map(|i| Request::PutEnd { client: 1, key: format!("k{i}"), put: 1 }).collect();
        let t3 = later(apply(&m, Request::Batch(ends)));
        let t4 = later(apply(&m, Request::Batch(vec![Request::ExistKey { key: "k0".into() }, Request::RemoveAll { force: true }])));
        assert!(t1 < t2 && t2 < t3 && t3 < t4, "each its own ticket, in order: {t1:?} {t2:?} {t3:?} {t4:?}");
        assert!(matches!(apply(&m, Request::ExistKey { key: "k1".into() }), Applied::Now(Response::Exists(false))), "removed, and a read waits for nothing");
    }

    /// An answer that waits for the journal leaves from whoever makes the change durable, not
    /// before; a client that sends its next request without reading (pipelining) gets the
    /// answers in its requests' order; the term's end answers what still waited.
    #[test]
    fn deferred_answers_wait_for_the_journal_and_keep_each_connections_order() {
        let m = Arc::new(journaling_leader(5));
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = MasterServer::start(Arc::clone(&m), listener, Duration::from_millis(50), 0).expect("start");
        let mut c = TcpStream::connect(addr).expect("connect");
        c.set_read_timeout(Some(Duration::from_millis(300))).expect("timeout");
        let seg = |id| seg(id, 1 << 20);
        let mut two = proto::encode(&Request::MountSegment { client: 1, segment: seg(1) }).expect("encode");
        two.extend(proto::encode(&Request::ExistKey { key: "k".into() }).expect("encode"));
        c.write_all(&two).expect("send");
        let deferred = |n: usize| {
            let until = Instant::now() + Duration::from_secs(10);
            while m.journal.deferred_for_test() != n {
                assert!(Instant::now() < until, "the answer was not deferred within 10 s");
                std::thread::sleep(Duration::from_millis(5));
            }
        };
        deferred(1);
        let e = read_answer(&mut c).expect_err("nothing is answered before the mount is durable");
        assert!(matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut), "{e}");
        assert_eq!(m.journal.deferred_for_test(), 1, "the read waits behind the mount");
        m.journal.write_queued_for_test();
        c.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        assert_eq!(read_answer(&mut c).expect("the mount's answer"), Response::Ok);
        assert_eq!(read_answer(&mut c).expect("then the read's"), Response::Exists(false));
        // Applied and made durable, but the leader was fenced in between: it cannot know
        // whether a successor has the change, and says so instead of the success.
        c.write_all(&proto::encode(&Request::MountSegment { client: 1, segment: seg(4) }).expect("encode")).expect("send");
        deferred(1);
        m.gate.fence(5);
        m.journal.write_queued_for_test();
        assert_eq!(read_answer(&mut c).expect("an answer"), Response::Err(StoreError::OutcomeUnknown));
        m.gate.lead_for_test(5, Duration::from_secs(60));
        // A mutation still waiting when the term ends is answered that its outcome is unknown
        // (it was applied; the new leader may have it), not left hanging.
        c.write_all(&proto::encode(&Request::MountSegment { client: 1, segment: seg(2) }).expect("encode")).expect("send");
        deferred(1);
        m.journal.deactivate();
        assert_eq!(read_answer(&mut c).expect("an answer"), Response::Err(StoreError::OutcomeUnknown));
        // A request of the next term that never got past the gate: nothing applied, NotLeader.
        m.gate.fence(5);
        c.write_all(&proto::encode(&Request::MountSegment { client: 1, segment: seg(3) }).expect("encode")).expect("send");
        assert!(matches!(read_answer(&mut c).expect("an answer"), Response::Err(StoreError::NotLeader { .. })));
        assert_eq!(m.lock().summary().segments, 3, "the second and fourth mounts applied, the third not");
        drop(server);
    }

    /// A request is applied, the state's lock let go, and another request's collection takes
    /// its change, which the journal makes durable; then the leader is fenced. Its answer says
    /// that its outcome is unknown, not `NotLeader` (nothing applied: send it again). One that
    /// changed nothing before the fence is still answered `NotLeader`.
    #[test]
    fn a_request_whose_change_another_collected_is_not_answered_as_if_nothing_was_applied() {
        let m = journaling_leader(5);
        let mut changed = false;
        let (resp, held) = handle_admitted(&m, Request::MountSegment { client: 1, segment: seg(1, 1 << 20) }, 5, &mut changed, &mut true);
        assert_eq!(resp, Response::Ok);
        assert!(held.is_none() && changed, "applied alone: the lock let go, a change marked");
        assert!(m.journal.collect(&m).is_some(), "another request's collection took the mount");
        m.journal.write_queued_for_test();
        m.gate.fence(5);
        match settle(&m, 5, true, changed, resp, None) {
            Applied::Now(r) => assert_eq!(r, Response::Err(StoreError::OutcomeUnknown), "the mount is durable"),
            Applied::Later { .. } | Applied::Early(_) => panic!("nothing of it is outstanding"),
        }
        // A mutation that changed nothing (its key is absent) before the fence: NotLeader.
        m.gate.lead_for_test(5, Duration::from_secs(60));
        let mut changed = false;
        let (resp, held) = handle_admitted(&m, Request::Remove { key: "absent".into(), force: false }, 5, &mut changed, &mut true);
        assert!(matches!(resp, Response::Err(StoreError::ObjectNotFound(_))));
        assert!(!changed);
        m.gate.fence(5);
        match settle(&m, 5, true, changed, resp, held) {
            Applied::Now(r) => assert!(matches!(r, Response::Err(StoreError::NotLeader { .. })), "{r:?}"),
            Applied::Later { .. } | Applied::Early(_) => panic!("it changed nothing"),
        }
        assert_eq!(m.lock().summary().segments, 1);
    }
}
