//! Applying one request to the master: the gate of the HA term, the state's lock (a batch's
//! holds of it, a put's wait for reads), the operation's statistics, and what must reach the
//! journal before the answer goes out. Nothing here reads or writes a socket: the connection
//! loop (`super`) does.

use crate::error::StoreError;
use crate::master::{Attempt, Needs, State, OP_NAMES};
use crate::node::Master;
use crate::proto::{self, PingStatus, Request, Response};
use std::sync::atomic::Ordering;
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
pub(super) enum Applied {
    Now(Response),
    Later {
        ticket: (i64, u64),
        term: i64,
        resp: Response,
    },
    /// Answered before its changes were even collected: every change it made is a put
    /// placed in space whose grant is durable (`master::State::placed_granted`), which a new
    /// leader holds if the put's own change never reached it. Its changes go to the journal
    /// with the connection's next request (a put's end, one entry for both) or within
    /// [`RIDE_WAIT`] ([`serve_conn`](super::serve_conn)).
    Early(Response),
}

/// How long a connection whose last answer went out [`Applied::Early`] waits for its next
/// request before it hands that answer's changes to the journal itself.
pub(super) const RIDE_WAIT: Duration = Duration::from_millis(1);

pub(super) fn apply(m: &Master, req: Request) -> Applied {
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
pub(super) fn settle(
    m: &Master,
    term: i64,
    journaled: bool,
    changed: bool,
    resp: Response,
    held: Option<Held<'_>>,
) -> Applied {
    if !journaled {
        drop(held);
        return Applied::Now(confirmed(m, term, resp));
    }
    if let Some(ticket) = m
        .journal
        .collect_held(held.unwrap_or_else(|| m.lock()), m.now())
    {
        return Applied::Later { ticket, term, resp };
    }
    Applied::Now(if changed {
        confirmed_durable(m, term, resp)
    } else {
        confirmed(m, term, resp)
    })
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
pub(super) fn confirm_durable(m: &Master, term: i64) -> Result<(), StoreError> {
    m.gate.confirm(term).map_err(|_| StoreError::OutcomeUnknown)
}

/// How long a request waits for its changes to reach the journal (the writer gives up, and
/// fences the leader, well before: when the lease can no longer be proven).
pub(super) const JOURNAL_WAIT: Duration = Duration::from_secs(30);

/// Whether a request may change what the journal keeps (reads, pings and read releases only
/// touch leases and reads in flight, which are not replicated).
pub(super) fn mutates(req: &Request) -> bool {
    match req {
        Request::GetReplicaList { .. }
        | Request::ExistKey { .. }
        | Request::ProbeKey { .. }
        | Request::QueryTask { .. }
        | Request::Ping { .. }
        | Request::ReleaseReads { .. }
        | Request::AuthHello { .. }
        | Request::AuthProof { .. } => false,
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
pub(super) fn handle_admitted<'m>(
    m: &'m Master,
    req: Request,
    term: i64,
    changed: &mut bool,
    ride: &mut bool,
) -> (Response, Option<Held<'m>>) {
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
        Err(StoreError::NotLeader {
            leader: String::new(),
        })
    }
}

/// Applies put start `req` under `term`; while the pool is full only of objects being read,
/// tries again every [`PUT_RETRY`] until `deadline`, letting go of the state's lock between
/// tries (the reads' ends free space).
fn put_start(
    m: &Master,
    req: &Request,
    deadline: Instant,
    term: i64,
    mut attempt: Attempt,
    changed: &mut bool,
    ride: &mut bool,
) -> Result<Response, StoreError> {
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
        let retry = !last
            && matches!(r, Err(StoreError::NoAvailableHandle { .. }))
            && st.reads_in_flight(now);
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
fn start_put(
    st: &mut State,
    m: &Master,
    req: &Request,
    now: u64,
    attempt: Attempt,
    changed: &mut bool,
    ride: &mut bool,
) -> Result<Response, StoreError> {
    let a = st.apply(
        &m.cfg,
        &m.stats,
        req,
        now,
        attempt,
        m.journal.grants_durable(),
        &mut None,
    );
    *changed |= a.needs != Needs::Nothing;
    if a.needs == Needs::Journal {
        *ride = false;
    }
    a.result
}

/// Applies `req` (not a put start, not a batch) to the state, whose lock the caller holds, at
/// `now` ([`State::apply`]); sets `changed` if it changed durable state (see [`settle`]). What
/// a bulk removal took out goes to `removed`, for the caller to drop after the lock.
fn apply_locked(
    st: &mut State,
    m: &Master,
    req: &Request,
    now: u64,
    changed: &mut bool,
    removed: &mut Option<crate::master::Removed>,
) -> Result<Response, StoreError> {
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
        Request::OffloadBeat { .. } => 15,
        Request::ProbeKey { .. } => 16,
        Request::CreateCopyTask { .. } => 17,
        Request::CreateMoveTask { .. } => 18,
        Request::QueryTask { .. } => 19,
        Request::FetchTasks { .. } => 20,
        Request::CompleteTask { .. } => 21,
        Request::CopyStart { .. } => 22,
        Request::CopyEnd { .. } => 23,
        Request::Batch(_) | Request::AuthHello { .. } | Request::AuthProof { .. } => return None,
    })
}

/// The answer to a request that [`op_of`] does not count: a batch within a batch, or an
/// authentication step anywhere but first on its connection ([`gate`](super::auth::gate)).
pub(super) fn misplaced(req: &Request) -> Response {
    Response::Err(match req {
        Request::AuthHello { .. } | Request::AuthProof { .. } => StoreError::InvalidParams("the cluster key's handshake opens a connection (AuthHello, alone, as its first frame); not in a batch nor after".into()),
        _ => StoreError::InvalidParams("nested batches are not allowed".into()),
    })
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

fn handle_one(
    m: &Master,
    req: Request,
    deadline: Instant,
    term: i64,
    changed: &mut bool,
    ride: &mut bool,
) -> Response {
    let Some(op) = op_of(&req) else {
        return misplaced(&req);
    };
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
pub(super) const BATCH_HOLD: usize = 64;

/// Batches of at least this many requests count their answers' bytes (smaller ones cannot
/// come near the frame limit but through answers of a megabyte each).
const COUNT_ANSWERS_FROM: usize = 256;

/// The requests of a batch, in order, consecutive ones under one hold of the state's lock
/// (and one reading of the clock): taking the lock once per key made the lock's hand-over
/// between a master's many connections (a futex wake-up each) a large part of a batched
/// put's cost. A bulk removal, and a put that has to wait for reads to end, are applied on
/// their own as [`handle_one`] does.
/// Returns the answers, and the lock if the last of them was applied under it.
fn handle_batch<'m>(
    m: &'m Master,
    reqs: Vec<Request>,
    deadline: Instant,
    term: i64,
    changed: &mut bool,
    ride: &mut bool,
) -> (Vec<Response>, Option<Held<'m>>) {
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
            bytes += out[sized..]
                .iter()
                .map(|r| postcard::experimental::serialized_size(r).unwrap_or(0))
                .sum::<usize>();
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
        if matches!(
            req,
            Request::RemoveAll { .. } | Request::RemoveByRegex { .. }
        ) {
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
                if !*last
                    && matches!(r, Err(StoreError::NoAvailableHandle { .. }))
                    && st.reads_in_flight(*now)
                {
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
