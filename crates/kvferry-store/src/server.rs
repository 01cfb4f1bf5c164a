//! The master on the network: one thread per RPC connection, one ticker thread.

use crate::error::StoreError;
use crate::master::{Attempt, Master, PutId, State, OP_NAMES};
use crate::proto::{self, PingStatus, ReplicateConfig, Request, Response};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
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
}

/// A poller's place ([`Spin::slot`]).
struct Slot<'a>(&'a AtomicUsize);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How long HA replication's readers poll for their next frame ([`Spin::for_replication`]).
const REPLICATION_POLL: Duration = Duration::from_micros(100);

/// The CPUs this process may use.
fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
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
    fn wait_idle(&self) {
        let mut b = self.busy();
        while b.sending {
            b.waiting = true;
            b = self.idle.wait(b).unwrap_or_else(|e| e.into_inner());
            b.waiting = false;
        }
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

#[allow(clippy::too_many_arguments)]
fn put_start(m: &Master, put: PutId, key: &str, size: u64, config: &ReplicateConfig, upsert: bool, deadline: Instant, term: i64, mut attempt: Attempt, changed: &mut bool, ride: &mut bool) -> Result<Response, StoreError> {
    loop {
        let last = Instant::now() >= deadline;
        if last {
            attempt = Attempt::Last;
        }
        let now = m.now();
        let mut st = m.lock();
        stale(&st, term)?;
        let r = start_put(&mut st, m, changed, ride, |st| st.put_start_ex(&m.cfg, &m.stats, put, key, size, config, upsert, now, attempt));
        attempt = Attempt::Again;
        let retry = !last && matches!(r, Err(StoreError::NoAvailableHandle { .. })) && st.reads_in_flight(now);
        drop(st);
        if !retry {
            return r.map(Response::Replicas);
        }
        *ride = false;
        std::thread::sleep(PUT_RETRY);
    }
}

/// Starts a put (`f`) on the state, whose lock the caller holds, as [`marking`] does; clears
/// `ride` unless what it changed is a put placed in space whose grant is durable.
fn start_put<T>(st: &mut State, m: &Master, changed: &mut bool, ride: &mut bool, f: impl FnOnce(&mut State) -> T) -> T {
    if st.granting() {
        st.set_grants_durable(m.journal.grants_durable());
    }
    let before = st.marks();
    let r = marking(st, changed, f);
    if st.marks() != before && !st.placed_granted() {
        *ride = false;
    }
    r
}

/// Runs `f` on the state, whose lock the caller holds, and sets `changed` if it marked a
/// durable change ([`State::marks`]; see [`settle`]).
fn marking<T>(st: &mut State, changed: &mut bool, f: impl FnOnce(&mut State) -> T) -> T {
    let before = st.marks();
    let r = f(st);
    *changed |= st.marks() != before;
    r
}

/// An accepted connection; on an error (out of descriptors, EMFILE, and the like) `None`
/// after a short pause, so that an accept loop backs off instead of spinning.
pub(crate) fn accepted(conn: std::io::Result<TcpStream>, what: &str) -> Option<TcpStream> {
    match conn {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::warn!("{what}: {e}");
            std::thread::sleep(Duration::from_millis(20));
            None
        }
    }
}

/// TCP keepalive on `s`: a peer whose host vanished without closing is found after `idle`
/// and 3 probes 5 s apart (best effort: a socket that refuses it keeps working without).
pub(crate) fn keepalive(s: &TcpStream, idle: Duration) {
    let _ = rustix::net::sockopt::set_socket_keepalive(s, true)
        .and_then(|_| rustix::net::sockopt::set_tcp_keepidle(s, idle))
        .and_then(|_| rustix::net::sockopt::set_tcp_keepintvl(s, Duration::from_secs(5)))
        .and_then(|_| rustix::net::sockopt::set_tcp_keepcnt(s, 3));
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
/// authentication step anywhere but first on its connection ([`ConnAuth`]).
fn misplaced(req: &Request) -> Response {
    Response::Err(match req {
        Request::AuthHello { .. } | Request::AuthProof { .. } => StoreError::InvalidParams("authentication opens a connection, alone (AuthHello, then AuthProof), before any other request; not in a batch nor after".into()),
        _ => StoreError::InvalidParams("nested batches are not allowed".into()),
    })
}

/// What a connection's authentication ([`ConnAuth`]) does with a request.
#[derive(Debug, PartialEq)]
pub(crate) enum Gate {
    /// Applied as usual.
    Pass(Request),
    /// Answered so (a step of the exchange).
    Answer(Response),
    /// Answered so, then the connection is closed.
    Refuse(Response),
}

/// A connection's proof of the cluster key (`KVFERRY_AUTH_KEY_FILE`, [`kvferry::auth`]),
/// sans-IO. A master holding a key answers nothing but the exchange until the client proved
/// it: `AuthHello { client nonce }` → `AuthChallenge { master nonce, the master's MAC over
/// both }`, then `AuthProof { the client's MAC }` → `Ok`. Anything else before that is
/// refused, saying what to set, and the connection closed. A master without a key refuses
/// `AuthHello` (a client holding a key must not talk to a master that cannot prove one).
pub(crate) struct ConnAuth<'k> {
    key: Option<&'k kvferry::auth::ClusterKey>,
    state: AuthState,
}

enum AuthState {
    /// Requests are applied.
    Open,
    /// Nothing but `AuthHello` yet.
    Start,
    /// The master's challenge went out: nothing but the proof.
    Challenged(kvferry::auth::Answering),
}

fn unauthorized(why: impl Into<String>) -> Gate {
    Gate::Refuse(Response::Err(StoreError::Unauthorized(why.into())))
}

impl<'k> ConnAuth<'k> {
    pub(crate) fn new(key: Option<&'k kvferry::auth::ClusterKey>) -> ConnAuth<'k> {
        ConnAuth { key, state: if key.is_some() { AuthState::Start } else { AuthState::Open } }
    }

    pub(crate) fn on(&mut self, req: Request) -> Gate {
        let Some(key) = self.key else {
            return match req {
                Request::AuthHello { .. } => unauthorized("this master has no cluster key (KVFERRY_AUTH_KEY_FILE is unset where it runs): give it the cluster's key file, or unset KVFERRY_AUTH_KEY_FILE on this client"),
                req => Gate::Pass(req),
            };
        };
        match (&self.state, req) {
            (AuthState::Open, req @ (Request::AuthHello { .. } | Request::AuthProof { .. })) => Gate::Refuse(misplaced(&req)),
            (AuthState::Open, req) => Gate::Pass(req),
            (AuthState::Start, Request::AuthHello { nonce }) => match kvferry::auth::Answering::new(key, proto::AUTH, nonce) {
                Ok((answering, nonce, mac)) => {
                    self.state = AuthState::Challenged(answering);
                    Gate::Answer(Response::AuthChallenge { nonce, mac })
                }
                Err(r) => unauthorized(format!("the client's hello: {r}")),
            },
            (AuthState::Challenged(a), Request::AuthProof { mac }) => match a.check(key, proto::AUTH, &mac) {
                Ok(()) => {
                    self.state = AuthState::Open;
                    Gate::Answer(Response::Ok)
                }
                Err(r) => unauthorized(format!("the client's proof: {r}")),
            },
            (AuthState::Challenged(_), _) => unauthorized("the client sent a request before its proof (AuthProof)"),
            (AuthState::Start, _) => unauthorized("this master requires the cluster key: set KVFERRY_AUTH_KEY_FILE on this client to the cluster's key file (a stock Mooncake client cannot authenticate: serve those from a master without a key)"),
        }
    }
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
    let r = if let Request::PutStart { client, key, size, config, upsert, put } = &req {
        put_start(m, PutId { client: *client, put: *put }, key, *size, config, *upsert, deadline, term, Attempt::First, changed, ride)
    } else {
        *ride &= !mutates(&req);
        let now = m.now();
        let mut st = m.lock();
        if let Err(e) = stale(&st, term) {
            return Response::Err(e);
        }
        marking(&mut st, changed, |st| apply_locked(st, m, req, now, &mut removed))
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
            Request::PutStart { client, key, size, config, upsert, put } => {
                let put = PutId { client, put };
                let attempt = if *last { Attempt::Last } else { Attempt::First };
                let r = start_put(st, m, changed, ride, |st| st.put_start_ex(&m.cfg, &m.stats, put, &key, size, &config, upsert, *now, attempt));
                if !*last && matches!(r, Err(StoreError::NoAvailableHandle { .. })) && st.reads_in_flight(*now) {
                    held = None;
                    *ride = false;
                    std::thread::sleep(PUT_RETRY);
                    put_start(m, put, &key, size, &config, upsert, deadline, term, Attempt::Again, changed, ride)
                } else {
                    r.map(Response::Replicas)
                }
            }
            req => {
                *ride &= !mutates(&req);
                marking(st, changed, |st| apply_locked(st, m, req, *now, &mut None))
            }
        };
        out.push(counted(m, op, r));
    }
    (out, held.map(|h| h.0))
}

/// Applies `req` (not a batch) to the state, whose lock the caller holds, at `now`; what a
/// bulk removal took out goes to `removed`, for the caller to drop after the lock.
fn apply_locked(st: &mut State, m: &Master, req: Request, now: u64, removed: &mut Option<crate::master::Removed>) -> Result<Response, StoreError> {
    let lease = m.cfg.lease_ttl.as_millis() as u64;
    match req {
        Request::MountSegment { client, segment } => st.mount(client, segment, now).map(|_| Response::Ok),
        Request::RemountSegments { client, segments } => st.remount(client, segments, now, lease).map(|_| Response::Ok),
        Request::UnmountSegment { client, segment } => st.unmount(client, segment, now, m.cfg.put_start_release_timeout.as_millis() as u64).map(|_| Response::Ok),
        Request::Ping { client } => Ok(Response::Ping(st.ping(client, now))),
        Request::PutStart { client, key, size, config, upsert, put } => st.put_start(&m.cfg, &m.stats, PutId { client, put }, &key, size, &config, upsert, now).map(Response::Replicas),
        Request::ReleaseReads { ids } => {
            st.release_reads(&ids, now);
            Ok(Response::Ok)
        }
        Request::BatchReplicaClear { client, keys, segment } => Ok(Response::Keys(st.batch_replica_clear(client, &keys, &segment, now))),
        Request::HoldWrites { client, writes } => {
            let held = st.hold_writes(client, &writes, now, m.cfg.put_start_release_timeout.as_millis() as u64)?;
            tracing::info!(client = format!("{client:x}"), writes = writes.len(), segments = held, "a client reported writes still running that this master did not place: nothing new goes where they write until they are over");
            Ok(Response::Ok)
        }
        Request::PutEnd { client, key, put } => st.put_end(PutId { client, put }, &key, now).map(|_| Response::Ok),
        Request::PutRevoke { client, key, put } => st.put_revoke(PutId { client, put }, &key).map(|_| Response::Ok),
        Request::GetReplicaList { key } => st.get_replica_list(&key, now, lease).map(Response::ReplicaList),
        Request::ExistKey { key } => st.exist_key(&key, now, lease).map(Response::Exists),
        Request::Remove { key, force } => st.remove(&m.cfg, &key, force, now).map(|_| Response::Ok),
        Request::RemoveAll { force } => Ok(Response::Count(removed.insert(st.remove_matching(&m.cfg, |_| true, force, now)).count())),
        // (Compiled under the state's lock: bounded, so that no pattern holds it long.)
        Request::RemoveByRegex { pattern, force } => match regex::RegexBuilder::new(&pattern).size_limit(256 << 10).dfa_size_limit(1 << 20).build() {
            Ok(re) => Ok(Response::Count(removed.insert(st.remove_matching(&m.cfg, |k| re.is_match(k), force, now)).count())),
            Err(e) => Err(StoreError::InvalidParams(format!("bad regex {pattern:?}: {e}"))),
        },
        req @ (Request::Batch(_) | Request::AuthHello { .. } | Request::AuthProof { .. }) => misplaced(&req).into_result(),
    }
}

/// The bounded poll for a connection's next request, shared by a master's connections: at
/// most `limit` of them poll at once (half the CPUs the process may use). A client that just
/// got an answer often asks again at once, and a poll answers it without two trips through
/// the scheduler; but sixteen connections' threads polling on two CPUs took the CPUs from the
/// clients and from the threads with work (two fifths of a batched put's CPU time in the
/// master, 2026-12-02), so the others sleep in the kernel at once. On one CPU nothing polls:
/// the poller would hold the only CPU that the client, or the thread it waits for, needs (a
/// master pinned to one CPU with 16 connections spent 4.1 µs per object created against 2.4
/// with 4 connections, 2026-12-04).
pub(crate) struct Spin {
    bound: Duration,
    polling: AtomicUsize,
    limit: usize,
}

impl Spin {
    fn new(bound: Duration) -> Spin {
        Spin::for_cpus(bound, cpus())
    }

    fn for_cpus(bound: Duration, cpus: usize) -> Spin {
        Spin { bound: if cpus < 2 { Duration::ZERO } else { bound }, polling: AtomicUsize::new(0), limit: cpus / 2 }
    }

    /// The poll of HA replication's two readers on the path of every acknowledged request: a
    /// standby's reader of its leader's entries, and a leader's reader of a standby's
    /// acknowledgements (`crate::ha::sync`). Each slept in the kernel between frames, and
    /// the wake-ups were most of an acknowledgement's wait on an idle 16-CPU virtual
    /// machine: polling took it from 35-48 µs to 24-31 µs (2026-12-04, docs/BENCHMARKS.md).
    /// Only on 4 CPUs or more, at most a quarter of them at once: on 2, the poller would take
    /// the CPU that the leader, the standby or the clients need.
    pub(crate) fn for_replication() -> &'static Spin {
        static SPIN: std::sync::OnceLock<Spin> = std::sync::OnceLock::new();
        SPIN.get_or_init(|| Spin::for_replication_on(cpus()))
    }

    fn for_replication_on(cpus: usize) -> Spin {
        Spin { bound: if cpus < 4 { Duration::ZERO } else { REPLICATION_POLL }, polling: AtomicUsize::new(0), limit: cpus / 4 }
    }

    /// Polls `s` until it has bytes to read or is closed, within the bound and if fewer than
    /// the limit poll already; whether it has (false: the caller's blocking read sleeps in the
    /// kernel). Reads nothing.
    pub(crate) fn readable(&self, s: &TcpStream) -> bool {
        use rustix::net::{recv, RecvFlags};
        let Some(_slot) = self.slot() else { return false };
        let start = Instant::now();
        let mut byte = [0u8; 1];
        loop {
            match recv(s, &mut byte, RecvFlags::DONTWAIT | RecvFlags::PEEK) {
                Ok(_) => return true, // (0: closed, which the read then finds)
                Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) if start.elapsed() < self.bound => std::hint::spin_loop(),
                Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => return false,
                Err(_) => return true, // (the read reports it)
            }
        }
    }

    /// A place among the pollers, given back when dropped; `None` when nothing polls here
    /// (no bound) or the limit already poll.
    fn slot(&self) -> Option<Slot<'_>> {
        if self.bound.is_zero() {
            return None;
        }
        if self.polling.fetch_add(1, Ordering::AcqRel) >= self.limit {
            self.polling.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Slot(&self.polling))
    }

    /// Polls `s` for up to 4 bytes (into `prefix`) within the bound, if fewer than the limit
    /// poll already: how many arrived.
    fn poll(&self, s: &TcpStream, prefix: &mut [u8; 4]) -> std::io::Result<usize> {
        use rustix::net::{recv, RecvFlags};
        let Some(_slot) = self.slot() else { return Ok(0) };
        let mut got = 0usize;
        let start = Instant::now();
        loop {
            if got == 4 || start.elapsed() >= self.bound {
                return Ok(got);
            }
            match recv(s, &mut prefix[got..], RecvFlags::DONTWAIT) {
                Ok((0, _)) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok((n, _)) => got += n,
                Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => std::hint::spin_loop(),
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// Whether `s` has something to read within `bound` (an error counts: the read reports it).
fn readable_within(s: &TcpStream, bound: Duration) -> bool {
    let mut fds = [rustix::event::PollFd::new(s, rustix::event::PollFlags::IN)];
    let timeout = rustix::event::Timespec { tv_sec: bound.as_secs() as i64, tv_nsec: bound.subsec_nanos() as _ };
    !matches!(rustix::event::poll(&mut fds, Some(&timeout)), Ok(0))
}

fn serve_conn(m: &Arc<Master>, s: &TcpStream, spin: &Spin) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    // An answer written by this thread waits for a client that stops reading at most this long
    // (deferred answers are sent without blocking, within the same bound: `Outbox::send`).
    s.set_write_timeout(Some(SLOW_ANSWER))?;
    let out = Arc::new(Outbox { sock: s.try_clone()?, busy: std::sync::Mutex::default(), idle: std::sync::Condvar::new() });
    let mut prefix = [0u8; 4];
    let mut body = Vec::new();
    let mut deferred = false;
    // An answer went out before its changes were collected ([`Applied::Early`]), at this time.
    let mut owed: Option<Instant> = None;
    let mut auth = ConnAuth::new(m.auth.as_ref());
    loop {
        if let Some(at) = owed {
            let left = RIDE_WAIT.saturating_sub(at.elapsed());
            if left.is_zero() || !readable_within(s, left) {
                let _ = m.journal.collect(m);
                owed = None;
            }
        }
        // Not after an answer left for the journal: that client is still waiting for it.
        let got = if deferred || owed.is_some() { 0 } else { spin.poll(s, &mut prefix)? };
        (&*s).read_exact(&mut prefix[got..])?;
        let n = match proto::decode_len(prefix) {
            Ok(n) => n,
            Err(e) => return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string())),
        };
        body.clear();
        s.take(n as u64).read_to_end(&mut body)?;
        if body.len() != n {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        // The previous request's answer, if it waited for the journal, is out first.
        out.wait_idle();
        let req = proto::decode::<Request>(&body).map(|req| auth.on(req));
        let resp = match req {
            Ok(Gate::Answer(resp)) => resp,
            Ok(Gate::Refuse(resp)) => {
                (&*s).write_all(&frame_of(&resp))?;
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
        (&*s).write_all(&frame_of(&resp))?;
    }
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
        std::thread::Builder::new().name("kvf-master-accept".into()).spawn(move || {
            for conn in l.incoming() {
                if st.load(Ordering::Acquire) {
                    break;
                }
                let Some(conn) = accepted(conn, "master: accepting an RPC connection") else { continue };
                // A client host that vanished (crashed, cut off) without closing is found by
                // TCP keepalive, so its thread, descriptor and buffer are not held for ever.
                keepalive(&conn, Duration::from_secs(30));
                let (m, spin) = (Arc::clone(&m), Arc::clone(&spin));
                let _ = std::thread::Builder::new().name("kvf-master-rpc".into()).spawn(move || {
                    if let Err(e) = serve_conn(&m, &conn, &spin) {
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
    use crate::master::MasterConfig;
    use crate::proto::Segment;

    /// The master's side of the cluster key's challenge-response, without sockets: nothing
    /// but the exchange before the proof; a wrong, replayed or late proof, a nonce of the
    /// wrong size, or a request before the proof closes the connection with the reason; a
    /// master without a key refuses a client that wants one. A client holding the key being
    /// replaced as its second key is still served.
    #[test]
    fn a_connection_proves_the_cluster_key_before_any_request_or_is_refused_saying_why() {
        use kvferry::auth::{ClusterKey, Opening};
        let key = |t: &str| ClusterKey::parse(t.as_bytes(), std::path::Path::new("k")).expect("key");
        let (a, b) = ("a".repeat(64), "b".repeat(64));
        let master = key(&a);
        let ping = || Request::Ping { client: 1 };
        let refused = |g: Gate, what: &str| match g {
            Gate::Refuse(Response::Err(StoreError::Unauthorized(why))) if why.contains(what) => why,
            other => panic!("expected a refusal saying {what:?}: {other:?}"),
        };
        // Without a key: everything passes; a client that wants to authenticate is told.
        let mut open = ConnAuth::new(None);
        assert_eq!(open.on(ping()), Gate::Pass(ping()));
        refused(open.on(Request::AuthHello { nonce: vec![0; 16] }), "has no cluster key");
        // With one: a request before the exchange is refused, naming what to set.
        refused(ConnAuth::new(Some(&master)).on(ping()), "set KVFERRY_AUTH_KEY_FILE on this client");
        refused(ConnAuth::new(Some(&master)).on(Request::AuthHello { nonce: vec![0; 3] }), "3 bytes");
        refused(ConnAuth::new(Some(&master)).on(Request::AuthProof { mac: vec![0; 32] }), "requires the cluster key");
        // The exchange, as a client holding `keys` does it (`client.rs` `authenticate`): it
        // checks the master's MAC, then proves the key.
        let hello = |c: &mut ConnAuth, keys: &ClusterKey| {
            let opening = Opening::default();
            match c.on(Request::AuthHello { nonce: opening.nonce() }) {
                Gate::Answer(Response::AuthChallenge { nonce, mac }) => opening.prove(keys, proto::AUTH, &nonce, &mac).expect("the master proves the key over both nonces"),
                other => panic!("no challenge: {other:?}"),
            }
        };
        let mut c = ConnAuth::new(Some(&master));
        let proof = hello(&mut c, &master);
        assert_eq!(c.on(Request::AuthProof { mac: proof.clone() }), Gate::Answer(Response::Ok));
        assert_eq!(c.on(ping()), Gate::Pass(ping()), "then requests are applied");
        assert!(matches!(c.on(Request::AuthHello { nonce: vec![0; 16] }), Gate::Refuse(Response::Err(StoreError::InvalidParams(_)))), "and the exchange is not started again");
        // Another connection: the first one's proof is worth nothing there (its nonces differ).
        let mut other = ConnAuth::new(Some(&master));
        hello(&mut other, &master);
        refused(other.on(Request::AuthProof { mac: proof }), "holds another key");
        // A client that signs with another key (it accepts the master's as its second), or
        // one that skips the proof.
        let mut wrong = ConnAuth::new(Some(&master));
        let proof = hello(&mut wrong, &key(&format!("{b}\n{a}")));
        refused(wrong.on(Request::AuthProof { mac: proof }), "holds another key");
        let mut skips = ConnAuth::new(Some(&master));
        hello(&mut skips, &master);
        refused(skips.on(ping()), "before its proof");
        // A key change: a client of its first step (the old key first, the new one second)
        // is served by a master of the first step and by one of the second (the new first).
        let mut rotating = ConnAuth::new(Some(&master));
        let proof = hello(&mut rotating, &key(&format!("{a}\n{b}")));
        assert_eq!(rotating.on(Request::AuthProof { mac: proof }), Gate::Answer(Response::Ok));
        let second = key(&format!("{b}\n{a}"));
        let mut c = ConnAuth::new(Some(&second));
        let proof = hello(&mut c, &key(&format!("{a}\n{b}")));
        assert_eq!(c.on(Request::AuthProof { mac: proof }), Gate::Answer(Response::Ok));
        // Not in a batch.
        let m = journaling_leader(5);
        assert!(matches!(handle(&m, Request::Batch(vec![Request::AuthProof { mac: vec![] }])), Response::Batch(r) if matches!(&r[..], [Response::Err(StoreError::InvalidParams(_))])));
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
