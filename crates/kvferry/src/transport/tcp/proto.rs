//! The decisions of the TCP data protocol, sans-IO.
//!
//! Initiator side: what goes out, what comes back and in which order, when a loop must
//! stop, and what becomes of a request whose connection failed. Target side
//! ([`Admission`], [`HeaderClock`]): whether a request may touch memory and by when it must
//! be done, and how long a half-received header may take.
//!
//! Nothing here touches a socket or reads the clock: the lane threads, the in-caller-thread
//! path (`lane.rs`) and the server's connection threads (`server.rs`) feed it what the socket
//! did and the time, and act on the answer. The paths share it, so they cannot disagree on
//! the protocol, and the rules (deadlines, retries, the v1 fence, admission) are unit-tested
//! below with synthetic times: a peer that trickles one byte at a time is a loop of calls, not
//! a test that sleeps.

use crate::batch::{FailCause, FailKind, Failure};
use crate::memory::{MemoryRegistry, RegionGuard};
use crate::wire::tcp::{self, DataHeader, Opcode, Status, HEADER_LEN, STATUS_LEN};
use crate::wire::WireError;
use std::time::{Duration, Instant};

/// The frames of one request: its header, and for a WRITE to a v1 target a 1-byte READ of
/// the last byte written (the fence: its answer proves the body was consumed into memory).
/// The WRITE body goes between the two.
pub(super) fn request_frames(opcode: Opcode, remote: u64, len: u64, v2: bool) -> ([u8; HEADER_LEN], Option<[u8; HEADER_LEN]>) {
    let hdr = DataHeader { size: len, addr: remote, opcode, v2 }.encode();
    let fence = (opcode == Opcode::Write && !v2 && len > 0)
        .then(|| DataHeader { size: 1, addr: remote + len - 1, opcode: Opcode::Read, v2: false }.encode());
    (hdr, fence)
}

/// What the initiator receives next for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Expect {
    /// An 8-byte status frame (v2).
    Status,
    /// READ data: `len` bytes into local memory.
    Data(u64),
    /// The 1-byte answer to the v1 fence.
    Fence,
    /// Nothing more: the request is answered.
    Done,
}

/// The answer to one request, received step by step: v2 READ = status then data; v2 WRITE
/// = status; v1 READ = data; v1 WRITE = the fence byte.
#[derive(Debug, Clone)]
pub(super) struct Reply {
    opcode: Opcode,
    len: u64,
    next: Expect,
}

impl Reply {
    pub(super) fn new(opcode: Opcode, len: u64, v2: bool) -> Reply {
        let next = match (v2, opcode) {
            (true, _) => Expect::Status,
            (false, Opcode::Read) => Expect::Data(len),
            (false, Opcode::Write) => Expect::Fence,
        };
        Reply { opcode, len, next }
    }

    /// What to receive next.
    pub(super) fn expect(&self) -> Expect {
        self.next
    }

    /// The status frame arrived. `Ok(Rejected)` ends the request (the target closes the
    /// connection after it); an unreadable frame is a protocol error.
    pub(super) fn on_status(&mut self, frame: [u8; STATUS_LEN]) -> Result<Status, WireError> {
        debug_assert_eq!(self.next, Expect::Status);
        let s = tcp::decode_status(frame)?;
        self.next = match (s, self.opcode) {
            (Status::Ok, Opcode::Read) => Expect::Data(self.len),
            _ => Expect::Done,
        };
        Ok(s)
    }

    /// The data or the fence byte arrived in full.
    pub(super) fn on_payload(&mut self) {
        debug_assert!(matches!(self.next, Expect::Data(_) | Expect::Fence));
        self.next = Expect::Done;
    }

    /// Whether the request has been taken off the connection's queue by now: a v2 request
    /// once its status arrived, a v1 request at once (there is no status).
    pub(super) fn claimed(&self) -> bool {
        self.next != Expect::Status
    }
}

/// The stop rule every loop applies after every system call: the request's absolute
/// deadline, or its local memory being unregistered.
pub(super) fn must_stop(now: Instant, deadline: Instant, revoked: bool) -> bool {
    revoked || now >= deadline
}

/// What becomes of a request that was handed to a connection that then failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Fate {
    /// Send it again on a new connection.
    Retry,
    /// It ends so.
    End(FailKind, Failure),
}

/// How a connection failed, and what the request had seen of it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Failed {
    /// The connection broke (closed, reset) rather than a deadline passing.
    pub broken: bool,
    /// Connection failures the request already survived.
    pub attempts: u8,
    /// Its local memory was unregistered meanwhile.
    pub revoked: bool,
    pub deadline: Instant,
}

/// The retry rule. Only READs are retried (once): the old connection is ours alone to
/// receive on, so a retry cannot race it. A WRITE that may have left is never sent again:
/// the target's thread may still be copying the old connection's bytes into the range, and
/// they could land after the retry's. Unregistered memory and passed deadlines end it.
pub(super) fn fate(opcode: Opcode, f: Failed, now: Instant, peer: &str, why: &str) -> Fate {
    if f.revoked {
        let reason = format!("the local memory was unregistered while the request to {peer} was in flight");
        return Fate::End(FailKind::Failed, FailCause::LocalNotRegistered.because(reason));
    }
    if now >= f.deadline {
        return Fate::End(FailKind::Timeout, FailCause::Timeout.because(format!("no answer from {peer} before the deadline")));
    }
    if f.broken && f.attempts == 0 && opcode == Opcode::Read {
        return Fate::Retry;
    }
    let tail = if opcode == Opcode::Write { "; the WRITE may have partly landed and is not sent again" } else { "" };
    Fate::End(FailKind::Failed, FailCause::PeerLost.because(format!("connection to {peer} failed: {why}{tail}")))
}

/// What the target does with a request header.
pub(super) enum Admission {
    /// Outside registered memory (or empty): answer REJECTED (v2) and close, touching nothing.
    Reject,
    /// Inside: move the bytes while holding `guard`, all of it by `deadline`.
    Serve { guard: RegionGuard, deadline: Instant },
}

/// Admits a request: only a non-empty range inside one registered range, which then stays
/// registered (the guard) until the request is done. The request must be done within `stall`
/// plus 1 ns per byte (the initiator's own allowance), however the bytes trickle.
pub(super) fn admit(h: &DataHeader, registry: &MemoryRegistry, stall: Duration, now: Instant) -> Admission {
    let guard = if h.size > 0 { registry.check(h.addr, h.size) } else { None };
    match guard {
        Some(guard) => Admission::Serve { guard, deadline: now + stall + Duration::from_nanos(h.size) },
        None => Admission::Reject,
    }
}

/// The target's clock for a request header: an idle connection may wait for the next one as
/// long as it likes; once its first byte came, the rest must come within `stall`.
#[derive(Debug, Clone, Copy)]
pub(super) struct HeaderClock {
    stall: Duration,
    since: Option<Instant>,
}

impl HeaderClock {
    pub(super) fn new(stall: Duration) -> HeaderClock {
        HeaderClock { stall, since: None }
    }

    /// After a system call: `have` bytes of the header are buffered. True when the header
    /// is overdue (the connection is to be dropped).
    pub(super) fn overdue(&mut self, have: usize, now: Instant) -> bool {
        if have == 0 || have >= HEADER_LEN {
            return false;
        }
        now.duration_since(*self.since.get_or_insert(now)) > self.stall
    }

    /// When a begun header becomes overdue; `None` while none has begun.
    pub(super) fn due(&self) -> Option<Instant> {
        self.since.map(|t| t + self.stall)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn drive(mut r: Reply, status: Option<[u8; 8]>) -> Vec<Expect> {
        let mut seen = vec![];
        loop {
            let e = r.expect();
            seen.push(e);
            match e {
                Expect::Status => {
                    r.on_status(status.expect("a status is expected")).unwrap();
                }
                Expect::Data(_) | Expect::Fence => r.on_payload(),
                Expect::Done => return seen,
            }
        }
    }

    #[test]
    fn replies_in_protocol_order() {
        let ok = tcp::encode_status(Status::Ok);
        let rej = tcp::encode_status(Status::Rejected);
        assert_eq!(drive(Reply::new(Opcode::Read, 10, true), Some(ok)), [Expect::Status, Expect::Data(10), Expect::Done]);
        assert_eq!(drive(Reply::new(Opcode::Write, 10, true), Some(ok)), [Expect::Status, Expect::Done]);
        assert_eq!(drive(Reply::new(Opcode::Read, 10, true), Some(rej)), [Expect::Status, Expect::Done]);
        assert_eq!(drive(Reply::new(Opcode::Read, 10, false), None), [Expect::Data(10), Expect::Done]);
        assert_eq!(drive(Reply::new(Opcode::Write, 10, false), None), [Expect::Fence, Expect::Done]);
        let mut r = Reply::new(Opcode::Read, 10, true);
        assert!(!r.claimed());
        assert!(r.on_status(*b"garbage!").is_err(), "a bad magic is a protocol error");
        assert!(Reply::new(Opcode::Write, 1, false).claimed(), "v1: nothing to wait for before the payload");
    }

    #[test]
    fn frames_carry_a_fence_only_for_v1_writes() {
        let (h, f) = request_frames(Opcode::Write, 0x1000, 64, false);
        assert_eq!(DataHeader::decode(&h).unwrap(), DataHeader { size: 64, addr: 0x1000, opcode: Opcode::Write, v2: false });
        assert_eq!(DataHeader::decode(&f.unwrap()).unwrap(), DataHeader { size: 1, addr: 0x1000 + 63, opcode: Opcode::Read, v2: false });
        assert!(request_frames(Opcode::Write, 0x1000, 64, true).1.is_none());
        assert!(request_frames(Opcode::Read, 0x1000, 64, false).1.is_none());
    }

    /// A peer that delivers one byte every 50 ms keeps every read short of any socket
    /// timeout; the loop still stops at the deadline because it asks after every call.
    #[test]
    fn a_trickle_stops_at_the_deadline_not_at_the_end() {
        let t0 = Instant::now();
        let deadline = t0 + Duration::from_millis(700);
        let (mut got, mut now) = (0u64, t0);
        let want = 4096;
        while got < want {
            now += Duration::from_millis(50); // one read returns one byte
            got += 1;
            if got < want && must_stop(now, deadline, false) {
                break;
            }
        }
        assert_eq!(got, 14, "stopped after the read that crossed the deadline");
        assert!(must_stop(t0, deadline, true), "a revoked range stops at once");
    }

    /// A header trickled one byte per 100 ms is overdue once `stall` passed since its first
    /// byte; an idle connection (no byte) never is.
    #[test]
    fn a_trickled_header_is_overdue_an_idle_connection_never() {
        let t0 = Instant::now();
        let mut c = HeaderClock::new(Duration::from_millis(800));
        for i in 0..1000u64 {
            assert!(!c.overdue(0, t0 + Duration::from_secs(i)), "idle for {i} s");
        }
        let mut have = 0;
        let mut now = t0 + Duration::from_secs(1000);
        loop {
            have += 1;
            if c.overdue(have, now) {
                break;
            }
            assert!(have < HEADER_LEN, "the whole header trickled in before the clock ran out");
            now += Duration::from_millis(100);
        }
        assert_eq!(have, 10, "overdue at the first byte more than 800 ms after the first");
        assert!(!c.overdue(HEADER_LEN, now), "a complete header is never overdue");
    }

    #[test]
    fn admission_needs_a_registered_nonempty_range_and_sets_the_deadline() {
        let reg = MemoryRegistry::new();
        reg.register_batch(&[(0x10000, 0x1000)], "*").unwrap();
        let now = Instant::now();
        let stall = Duration::from_secs(1);
        let hdr = |addr, size| DataHeader { size, addr, opcode: Opcode::Write, v2: true };
        assert!(matches!(admit(&hdr(0x10000, 0), &reg, stall, now), Admission::Reject), "empty");
        assert!(matches!(admit(&hdr(0x10800, 0x801), &reg, stall, now), Admission::Reject), "crosses the end");
        assert!(matches!(admit(&hdr(0x1000, 1), &reg, stall, now), Admission::Reject), "outside");
        assert!(matches!(admit(&hdr(u64::MAX, 2), &reg, stall, now), Admission::Reject), "wraps");
        match admit(&hdr(0x10800, 0x800), &reg, stall, now) {
            Admission::Serve { guard, deadline } => {
                assert_eq!(guard.region().addr, 0x10000);
                assert_eq!(deadline, now + stall + Duration::from_nanos(0x800));
            }
            Admission::Reject => panic!("inside registered memory"),
        }
    }

    #[test]
    fn only_reads_are_retried_and_only_once() {
        let now = Instant::now();
        let f = Failed { broken: true, attempts: 0, revoked: false, deadline: now + Duration::from_secs(1) };
        assert_eq!(fate(Opcode::Read, f, now, "p", "reset"), Fate::Retry);
        let end = |fate: Fate| match fate {
            Fate::End(k, f) => (k, f.cause),
            Fate::Retry => panic!("retried"),
        };
        assert_eq!(end(fate(Opcode::Write, f, now, "p", "reset")), (FailKind::Failed, FailCause::PeerLost));
        assert_eq!(end(fate(Opcode::Read, Failed { attempts: 1, ..f }, now, "p", "reset")), (FailKind::Failed, FailCause::PeerLost));
        assert_eq!(end(fate(Opcode::Read, Failed { broken: false, ..f }, now, "p", "stopped")), (FailKind::Failed, FailCause::PeerLost));
        assert_eq!(end(fate(Opcode::Read, f, now + Duration::from_secs(2), "p", "reset")), (FailKind::Timeout, FailCause::Timeout));
        assert_eq!(end(fate(Opcode::Read, Failed { revoked: true, ..f }, now, "p", "reset")), (FailKind::Failed, FailCause::LocalNotRegistered));
    }
}
