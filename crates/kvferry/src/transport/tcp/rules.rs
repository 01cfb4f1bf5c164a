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

use crate::auth::{ClusterKey, Initiator, Opener, Protect, Protocol, Sealer};
use crate::batch::{FailCause, FailKind, Failure};
use crate::memory::{MemoryRegistry, RegionGuard};
use crate::wire::tcp::{
    self, DataHeader, Opcode, Status, AUTH_ANSWER_LEN, HEADER_LEN, SEALED_STATUS_LEN, STATUS_LEN,
};
use crate::wire::WireError;
use std::time::{Duration, Instant};

/// The cluster key's use on the TCP data port (`crate::auth`), with headers protected.
pub(super) const PROTOCOL: Protocol = Protocol("kvferry/tcp-data/1");

/// The handshake's protocol for what a connection protects: a connection asking for one
/// setting never completes a handshake under another (the setting rides in the opening
/// frame's header, and something on the path that changed it would break the handshake).
pub(super) fn protocol(p: Protect) -> Protocol {
    match p {
        Protect::Headers => PROTOCOL,
        Protect::Payload => Protocol("kvferry/tcp-data/1/payload"),
        Protect::Encrypt => Protocol("kvferry/tcp-data/1/encrypt"),
    }
}

/// Bytes of a body per protected chunk (`Protect::Payload`, `Protect::Encrypt`): a divisor
/// of the GPU staging chunk (1 MiB), so that no chunk straddles two.
pub(super) const CHUNK: usize = 32 << 10;
/// Bytes of a chunk's digest (BLAKE3) under `Protect::Payload`.
const DIGEST_LEN: usize = 32;

/// Bytes a chunk of body carries on the wire beyond itself under `p`.
#[cfg(test)]
pub(super) fn chunk_overhead(p: Protect) -> usize {
    match p {
        Protect::Headers => 0,
        Protect::Payload => DIGEST_LEN + crate::auth::TAG_LEN,
        Protect::Encrypt => crate::auth::TAG_LEN,
    }
}

/// Bytes of a body of `len` bytes on the wire under `p`.
#[cfg(test)]
pub(super) fn body_wire_len(p: Protect, len: u64) -> u64 {
    len + len.div_ceil(CHUNK as u64) * chunk_overhead(p) as u64
}

/// Appends one chunk (at most [`CHUNK`] bytes) of a body as it goes on the wire under `p`:
/// as it is, followed by its digest sealed, or sealed.
pub(super) fn seal_chunk(p: Protect, seal: &mut Sealer, chunk: &[u8], out: &mut Vec<u8>) {
    debug_assert!(chunk.len() <= CHUNK);
    match p {
        Protect::Headers => out.extend_from_slice(chunk),
        Protect::Payload => {
            out.extend_from_slice(chunk);
            seal.seal(blake3::hash(chunk).as_bytes(), out);
        }
        Protect::Encrypt => seal.seal(chunk, out),
    }
}

/// Appends a whole body as it goes on the wire under `p`, chunk by chunk.
pub(super) fn seal_body(p: Protect, seal: &mut Sealer, body: &[u8], out: &mut Vec<u8>) {
    for c in body.chunks(CHUNK) {
        seal_chunk(p, seal, c, out);
    }
}

/// Where the next bytes of a protected body go ([`Unseal::next`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Next {
    /// Up to this many bytes straight into the destination (a `Payload` chunk's bytes).
    Place(usize),
    /// Into [`Unseal::tail_mut`] (a `Payload` chunk's sealed digest, an `Encrypt` chunk).
    Tail,
}

/// Receiving a protected body, sans-IO, chunk by chunk: a `Payload` chunk's bytes land in
/// place and are hashed, then its sealed digest is opened and compared; an `Encrypt` chunk is
/// received whole and opened into place. A chunk counts as delivered only once it opened; one
/// that does not fails the request (`WireError::Unsealed`) before it is answered.
#[derive(Debug, Clone)]
pub(super) struct Unseal {
    p: Protect,
    /// Body bytes whose chunks have not opened yet.
    left: u64,
    /// Plain bytes of the chunk being received (0: none begun).
    chunk: usize,
    /// `Payload`: bytes of that chunk landed in place so far.
    placed: usize,
    tail: Vec<u8>,
    tail_have: usize,
    hash: blake3::Hasher,
}

impl Unseal {
    pub(super) fn new(p: Protect, len: u64) -> Unseal {
        let tail = vec![
            0u8;
            if p == Protect::Encrypt {
                CHUNK + crate::auth::TAG_LEN
            } else {
                DIGEST_LEN + crate::auth::TAG_LEN
            }
        ];
        Unseal {
            p,
            left: len,
            chunk: 0,
            placed: 0,
            tail,
            tail_have: 0,
            hash: blake3::Hasher::new(),
        }
    }

    /// For the next body of `len` bytes (the buffers kept).
    pub(super) fn reset(&mut self, len: u64) {
        self.left = len;
        self.chunk = 0;
        self.placed = 0;
        self.tail_have = 0;
        self.hash.reset();
    }

    pub(super) fn protect(&self) -> Protect {
        self.p
    }

    /// Every chunk opened.
    pub(super) fn done(&self) -> bool {
        self.left == 0
    }

    fn tail_want(&self) -> usize {
        match self.p {
            Protect::Encrypt => self.chunk + crate::auth::TAG_LEN,
            _ => DIGEST_LEN + crate::auth::TAG_LEN,
        }
    }

    /// Where the next bytes go.
    pub(super) fn next(&mut self) -> Next {
        if self.chunk == 0 && self.left > 0 {
            self.chunk = (self.left as usize).min(CHUNK);
            self.placed = 0;
            self.tail_have = 0;
        }
        match self.p {
            Protect::Payload if self.placed < self.chunk => Next::Place(self.chunk - self.placed),
            _ => Next::Tail,
        }
    }

    /// The rest of the tail (call after [`Unseal::next`] said `Tail`).
    pub(super) fn tail_mut(&mut self) -> &mut [u8] {
        let want = self.tail_want();
        &mut self.tail[self.tail_have..want]
    }

    /// `bytes` landed in place (after `Place`).
    pub(super) fn placed(&mut self, bytes: &[u8]) {
        self.hash.update(bytes);
        self.placed += bytes.len();
    }

    /// `n` bytes landed in the tail: whether it is whole (then [`Unseal::open_tail`]).
    pub(super) fn tail_received(&mut self, n: usize) -> bool {
        self.tail_have += n;
        self.tail_have >= self.tail_want()
    }

    /// Opens the whole tail: a `Payload` chunk's digest compared with what landed in place, an
    /// `Encrypt` chunk opened into `dest` (at least the chunk's size). The chunk's size: for
    /// `Encrypt`, bytes now in `dest`.
    pub(super) fn open_tail(
        &mut self,
        open: &mut Opener,
        dest: &mut [u8],
    ) -> Result<usize, WireError> {
        let want = self.tail_want();
        let chunk = self.chunk;
        match self.p {
            Protect::Encrypt => {
                let dest = dest.get_mut(..chunk).ok_or(WireError::Unsealed)?;
                if open.open(&self.tail[..want], dest) != Ok(chunk) {
                    return Err(WireError::Unsealed);
                }
            }
            _ => {
                let mut digest = [0u8; DIGEST_LEN + crate::auth::TAG_LEN];
                let got = self.hash.finalize();
                self.hash.reset();
                if open.open(&self.tail[..want], &mut digest) != Ok(DIGEST_LEN) {
                    return Err(WireError::Unsealed);
                }
                // (`blake3::Hash` compares in constant time.)
                let sent: [u8; DIGEST_LEN] =
                    digest[..DIGEST_LEN].try_into().expect("a digest's bytes");
                if got != sent {
                    return Err(WireError::Unsealed);
                }
            }
        }
        self.left -= chunk as u64;
        self.chunk = 0;
        self.tail_have = 0;
        Ok(chunk)
    }
}

/// The initiator's side of the cluster key's handshake on a new connection, bound to the
/// segment it dials: the opening frame to send ([`AuthOpen::hello`]), then the target's
/// answer's first 8 bytes ([`AuthOpen::on_answer`]) and the rest of it ([`AuthOpen::finish`],
/// which gives the connection's session). Every refusal is `FailCause::Unauthorized` with what
/// to set; bytes that are none of these, `Protocol`.
pub(super) struct AuthOpen {
    init: Initiator,
    hello: Vec<u8>,
}

impl AuthOpen {
    /// Opens a handshake towards `segment` for a connection protecting `protect`.
    pub(super) fn new(
        key: &ClusterKey,
        segment: &str,
        protect: Protect,
        peer: &str,
    ) -> Result<AuthOpen, Failure> {
        let (init, msg) = Initiator::new(key, protocol(protect), segment.trim_start_matches('/'))
            .map_err(|r| FailCause::Unauthorized.because(format!("{peer}: {r}")))?;
        let mut hello = tcp::encode_auth_hello(msg.len(), protect.code()).to_vec();
        hello.extend_from_slice(&msg);
        Ok(AuthOpen { init, hello })
    }

    pub(super) fn hello(&self) -> &[u8] {
        &self.hello
    }

    /// The answer's first 8 bytes: `Ok` when the Noise answer follows (`AUTH_ANSWER_LEN - 8`
    /// more bytes).
    pub(super) fn on_answer(&self, first: [u8; STATUS_LEN], peer: &str) -> Result<(), Failure> {
        match tcp::decode_auth_answer(first) {
            Ok(None) => Ok(()),
            Ok(Some(Status::Unauthorized)) => Err(FailCause::Unauthorized.because(format!(
                "{peer} refused this engine's cluster key handshake: it holds no key, or another key than this host's KVFERRY_AUTH_KEY_FILE (while a key changes, every host must accept both first), or it is not the engine of that segment name (a stale or rewritten address), or it requires a stronger KVFERRY_AUTH_PROTECT than this engine's; its log says which"
            ))),
            Ok(Some(s)) => Err(FailCause::Protocol.because(format!("{peer} answered the cluster key's opening frame with status {s:?}"))),
            Err(e) => Err(FailCause::Protocol.because(format!("{peer} answered the cluster key's opening frame with something else ({e}): it is not a kvferry engine holding a key"))),
        }
    }

    /// The rest of the answer (the Noise answer): the connection's session.
    pub(super) fn finish(self, rest: &[u8], peer: &str) -> Result<(Sealer, Opener), Failure> {
        debug_assert_eq!(rest.len(), AUTH_ANSWER_LEN - STATUS_LEN);
        let session = self.init.finish(rest).map_err(|r| {
            FailCause::Unauthorized.because(format!(
                "{peer}'s data port: its answer to the cluster key's handshake: {r}"
            ))
        })?;
        Ok(session.split())
    }
}

/// The frames of one request: its header, and for a WRITE to a v1 target a 1-byte READ of
/// the last byte written (the fence: its answer proves the body was consumed into memory).
/// The WRITE body goes between the two.
pub(super) fn request_frames(
    opcode: Opcode,
    remote: u64,
    len: u64,
    v2: bool,
) -> ([u8; HEADER_LEN], Option<[u8; HEADER_LEN]>) {
    let hdr = DataHeader {
        size: len,
        addr: remote,
        opcode,
        v2,
    }
    .encode();
    let fence = (opcode == Opcode::Write && !v2 && len > 0).then(|| {
        DataHeader {
            size: 1,
            addr: remote + len - 1,
            opcode: Opcode::Read,
            v2: false,
        }
        .encode()
    });
    (hdr, fence)
}

/// A request header as it goes on the wire into `out`: sealed under the connection's session
/// (`seal`: [`tcp::SEALED_HEADER_LEN`] bytes) or as it is ([`HEADER_LEN`]); how many bytes.
pub(super) fn put_header(
    hdr: &[u8; HEADER_LEN],
    seal: Option<&mut Sealer>,
    out: &mut [u8; tcp::SEALED_HEADER_LEN],
) -> usize {
    match seal {
        Some(s) => {
            s.seal_to(hdr, out);
            tcp::SEALED_HEADER_LEN
        }
        None => {
            out[..HEADER_LEN].copy_from_slice(hdr);
            HEADER_LEN
        }
    }
}

/// The deadline that bounds a gathered write once `written` of its bytes left: that of the
/// request whose bytes are going out (`ends`: where each request's bytes end in the write,
/// in order, and its deadline); `None` once all left. Requests already sent wait for their
/// answers under their own deadlines (the reader's), so a short one sent first does not cut
/// off the long one after it.
pub(super) fn deadline_at(ends: &[(u64, Instant)], written: u64) -> Option<Instant> {
    ends.iter().find(|(end, _)| *end > written).map(|(_, d)| *d)
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
    #[cfg(test)]
    pub(super) fn claimed(&self) -> bool {
        self.next != Expect::Status
    }
}

/// Receiving the answer to one request, sans-IO: fed the bytes as they come (buffered ones
/// with [`Answer::handle_bytes`], or straight into [`Answer::target`] then
/// [`Answer::on_received`]), it puts the status frame together, lands READ data in the
/// request's local memory and swallows the v1 fence byte, and says when the answer is whole.
/// The lane reader and the in-caller-thread path both drive it, so they cannot disagree on
/// what an answer is.
#[derive(Debug, Clone)]
pub(super) struct Answer {
    reply: Reply,
    /// A keyed connection protecting the bytes moved: READ data arrives in protected chunks.
    unseal: Option<Unseal>,
    /// The status frame as it comes: sealed ([`SEALED_STATUS_LEN`]) on a keyed connection.
    frame: [u8; SEALED_STATUS_LEN],
    frame_len: usize,
    fence: [u8; 1],
    /// Bytes of the current part (status frame, data or fence) received so far.
    have: usize,
    status: Option<Status>,
}

impl Answer {
    /// `sealed`: the connection is keyed, its status frames come sealed (and open with the
    /// connection's [`Opener`], passed to [`Answer::on_received`]).
    /// `sealed`: a keyed connection protecting headers only.
    #[cfg(test)]
    pub(super) fn new(opcode: Opcode, len: u64, v2: bool, sealed: bool) -> Answer {
        Self::protected(opcode, len, v2, sealed.then_some(Protect::Headers))
    }

    /// [`Answer::new`] on a keyed connection protecting `protect` (`None`: not keyed).
    pub(super) fn protected(
        opcode: Opcode,
        len: u64,
        v2: bool,
        protect: Option<Protect>,
    ) -> Answer {
        let frame_len = if protect.is_some() {
            SEALED_STATUS_LEN
        } else {
            STATUS_LEN
        };
        let unseal = protect
            .filter(|&p| p != Protect::Headers && opcode == Opcode::Read)
            .map(|p| Unseal::new(p, len));
        Answer {
            reply: Reply::new(opcode, len, v2),
            unseal,
            frame: [0; SEALED_STATUS_LEN],
            frame_len,
            fence: [0],
            have: 0,
            status: None,
        }
    }

    /// Still waiting for the (v2) status frame: the request is not yet off the connection's
    /// queue (a v2 request is claimed only once its status arrived).
    pub(super) fn awaiting_status(&self) -> bool {
        self.reply.expect() == Expect::Status
    }

    /// The answer is whole.
    pub(super) fn done(&self) -> bool {
        self.reply.expect() == Expect::Done
    }

    /// The target's verdict: `Ok` when the answer is whole without a status frame (v1).
    pub(super) fn status(&self) -> Option<Status> {
        match self.status {
            Some(s) => Some(s),
            None if self.done() => Some(Status::Ok),
            None => None,
        }
    }

    /// Where the next bytes of the answer go: the rest of the status frame, of the READ data
    /// (in `local`, the request's local memory) or the fence byte. `None` once done.
    pub(super) fn target<'a>(&'a mut self, local: &'a mut [u8]) -> Option<&'a mut [u8]> {
        let have = self.have;
        match self.reply.expect() {
            Expect::Status => Some(&mut self.frame[have..self.frame_len]),
            Expect::Data(n) => match &mut self.unseal {
                None => local.get_mut(have..n as usize),
                Some(u) => match u.next() {
                    Next::Place(k) => local.get_mut(have..have + k),
                    Next::Tail => Some(u.tail_mut()),
                },
            },
            Expect::Fence => Some(&mut self.fence[have..]),
            Expect::Done => None,
        }
    }

    /// `n` bytes landed in [`Answer::target`]; `open` opens a sealed status frame (a keyed
    /// connection's). An unreadable status frame, or one that does not open, is a protocol
    /// error (the connection cannot be followed any further).
    pub(super) fn on_received(
        &mut self,
        n: usize,
        local: &mut [u8],
        open: Option<&mut Opener>,
    ) -> Result<(), WireError> {
        if let (Expect::Data(len), Some(u)) = (self.reply.expect(), &mut self.unseal) {
            // Protected READ data: into place (hashed) or the tail (opened once whole, an
            // `Encrypt` chunk into place); only chunks that opened count.
            match u.next() {
                Next::Place(_) => {
                    u.placed(
                        local
                            .get(self.have..self.have + n)
                            .ok_or(WireError::Unsealed)?,
                    );
                    self.have += n;
                    return Ok(());
                }
                Next::Tail if u.tail_received(n) => {
                    let open = open.ok_or(WireError::Unsealed)?;
                    let dest = local.get_mut(self.have..).unwrap_or_default();
                    let k = u.open_tail(open, dest)?;
                    // (`Payload` bytes were counted as they landed, below; `Encrypt` now.)
                    self.have += if u.protect() == Protect::Encrypt {
                        k
                    } else {
                        0
                    };
                    if self.have as u64 >= len && u.done() {
                        self.have = 0;
                        self.reply.on_payload();
                    }
                    return Ok(());
                }
                Next::Tail => return Ok(()),
            }
        }
        self.have += n;
        match self.reply.expect() {
            Expect::Status if self.have >= self.frame_len => {
                self.have = 0;
                let mut plain = [0u8; SEALED_STATUS_LEN];
                let frame: [u8; STATUS_LEN] = match open {
                    Some(o) if self.frame_len == SEALED_STATUS_LEN => {
                        match o.open(&self.frame, &mut plain) {
                            Ok(STATUS_LEN) => plain[..STATUS_LEN].try_into().expect("8 bytes"),
                            _ => return Err(WireError::Unsealed),
                        }
                    }
                    Some(_) | None if self.frame_len == SEALED_STATUS_LEN => {
                        return Err(WireError::Unsealed)
                    }
                    _ => self.frame[..STATUS_LEN].try_into().expect("8 bytes"),
                };
                self.status = Some(self.reply.on_status(frame)?);
            }
            Expect::Data(len) if self.have as u64 >= len => {
                self.have = 0;
                self.reply.on_payload();
            }
            Expect::Fence if self.have >= 1 => {
                self.have = 0;
                self.reply.on_payload();
            }
            _ => {}
        }
        Ok(())
    }

    /// Takes buffered bytes: at most the rest of the current part, so that the caller can
    /// claim the request between the status frame and the data. Returns how many it took.
    pub(super) fn handle_bytes(
        &mut self,
        data: &[u8],
        local: &mut [u8],
        open: Option<&mut Opener>,
    ) -> Result<usize, WireError> {
        let Some(dst) = self.target(local) else {
            return Ok(0);
        };
        let n = dst.len().min(data.len());
        dst[..n].copy_from_slice(&data[..n]);
        self.on_received(n, local, open)?;
        Ok(n)
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
    /// The target is known not to have taken any of it: it closed the connection after
    /// rejecting an earlier request, and it serves a connection's requests in order.
    pub untouched: bool,
}

/// The retry rule. Only READs are retried (once): the old connection is ours alone to
/// receive on, so a retry cannot race it. A WRITE that may have left is never sent again:
/// the target's thread may still be copying the old connection's bytes into the range, and
/// they could land after the retry's. A request the target never took (queued behind one it
/// rejected before closing) goes again once, READ or WRITE: nothing of it can land late.
/// Unregistered memory and passed deadlines end it.
pub(super) fn fate(opcode: Opcode, f: Failed, now: Instant, peer: &str, why: &str) -> Fate {
    if f.revoked {
        let reason =
            format!("the local memory was unregistered while the request to {peer} was in flight");
        return Fate::End(
            FailKind::Failed,
            FailCause::LocalNotRegistered.because(reason),
        );
    }
    if now >= f.deadline {
        return Fate::End(
            FailKind::Timeout,
            FailCause::Timeout.because(format!("no answer from {peer} before the deadline")),
        );
    }
    if f.attempts == 0 && (f.untouched || (f.broken && opcode == Opcode::Read)) {
        return Fate::Retry;
    }
    let tail = if opcode == Opcode::Write {
        "; the WRITE may have partly landed and is not sent again"
    } else {
        ""
    };
    Fate::End(
        FailKind::Failed,
        FailCause::PeerLost.because(format!("connection to {peer} failed: {why}{tail}")),
    )
}

/// What the target does with a request header.
pub(super) enum Admission {
    /// Outside registered memory (or empty): answer REJECTED (v2) and close, touching nothing.
    Reject,
    /// Inside: move the bytes while holding `guard`, all of it by `deadline`.
    Serve {
        guard: RegionGuard,
        deadline: Instant,
    },
}

/// Admits a request: only a non-empty range inside one registered range, which then stays
/// registered (the guard) until the request is done. The request must be done within `stall`
/// plus 1 ns per byte (the initiator's own allowance), however the bytes trickle.
pub(super) fn admit(
    h: &DataHeader,
    registry: &MemoryRegistry,
    stall: Duration,
    now: Instant,
) -> Admission {
    let guard = if h.size > 0 {
        registry.check(h.addr, h.size)
    } else {
        None
    };
    match guard {
        Some(guard) => Admission::Serve {
            guard,
            deadline: now + stall + Duration::from_nanos(h.size),
        },
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
        assert_eq!(
            drive(Reply::new(Opcode::Read, 10, true), Some(ok)),
            [Expect::Status, Expect::Data(10), Expect::Done]
        );
        assert_eq!(
            drive(Reply::new(Opcode::Write, 10, true), Some(ok)),
            [Expect::Status, Expect::Done]
        );
        assert_eq!(
            drive(Reply::new(Opcode::Read, 10, true), Some(rej)),
            [Expect::Status, Expect::Done]
        );
        assert_eq!(
            drive(Reply::new(Opcode::Read, 10, false), None),
            [Expect::Data(10), Expect::Done]
        );
        assert_eq!(
            drive(Reply::new(Opcode::Write, 10, false), None),
            [Expect::Fence, Expect::Done]
        );
        let mut r = Reply::new(Opcode::Read, 10, true);
        assert!(!r.claimed());
        assert!(
            r.on_status(*b"garbage!").is_err(),
            "a bad magic is a protocol error"
        );
        assert!(
            Reply::new(Opcode::Write, 1, false).claimed(),
            "v1: nothing to wait for before the payload"
        );
    }

    /// Feeds `stream` to an answer in chunks of `chunk` bytes, as the reader does; returns
    /// the status and how many bytes were left over (the next answer's).
    fn feed(
        mut a: Answer,
        stream: &[u8],
        chunk: usize,
        local: &mut [u8],
    ) -> (Option<Status>, usize, bool) {
        let mut pos = 0;
        let mut claimed_before_data = true;
        while !a.done() && pos < stream.len() {
            let end = (pos + chunk).min(stream.len());
            let was_status = a.awaiting_status();
            pos += a.handle_bytes(&stream[pos..end], local, None).unwrap();
            if was_status && !a.awaiting_status() && !a.done() && local.iter().any(|&b| b != 0) {
                claimed_before_data = false; // data landed in the same call as the status
            }
        }
        (a.status(), stream.len() - pos, claimed_before_data)
    }

    #[test]
    fn answers_are_taken_part_by_part_however_the_bytes_are_cut() {
        let ok = tcp::encode_status(Status::Ok);
        for chunk in [1, 3, 8, 9, 64] {
            // v2 READ: status, data, then the next answer's bytes stay.
            let mut stream = ok.to_vec();
            stream.extend_from_slice(b"hello");
            stream.extend_from_slice(&ok);
            let mut local = [0u8; 5];
            let (st, left, claimed) = feed(
                Answer::new(Opcode::Read, 5, true, false),
                &stream,
                chunk,
                &mut local,
            );
            assert_eq!(
                (st, left, &local),
                (Some(Status::Ok), STATUS_LEN, b"hello"),
                "chunk {chunk}"
            );
            assert!(
                claimed,
                "the status is taken on its own, before any data (chunk {chunk})"
            );
            // v1 WRITE: the fence byte only.
            let (st, left, _) = feed(
                Answer::new(Opcode::Write, 5, false, false),
                b"xy",
                chunk,
                &mut [],
            );
            assert_eq!((st, left), (Some(Status::Ok), 1));
            // v2 REJECTED READ: nothing after the status is data.
            let mut stream = tcp::encode_status(Status::Rejected).to_vec();
            stream.extend_from_slice(b"zz");
            let mut local = [0u8; 5];
            let (st, left, _) = feed(
                Answer::new(Opcode::Read, 5, true, false),
                &stream,
                chunk,
                &mut local,
            );
            assert_eq!((st, left, local), (Some(Status::Rejected), 2, [0; 5]));
        }
        let mut a = Answer::new(Opcode::Read, 5, true, false);
        assert!(
            a.handle_bytes(b"garbage!", &mut [0; 5], None).is_err(),
            "a bad status frame is a protocol error"
        );
    }

    #[test]
    fn an_answer_received_straight_into_place() {
        let mut local = [0u8; 6];
        let mut a = Answer::new(Opcode::Read, 6, true, false);
        let frame = tcp::encode_status(Status::Ok);
        a.target(&mut local).unwrap()[..5].copy_from_slice(&frame[..5]);
        a.on_received(5, &mut local, None).unwrap();
        assert_eq!(
            a.target(&mut local).map(|t| t.len()),
            Some(3),
            "the rest of the status frame"
        );
        a.target(&mut local).unwrap().copy_from_slice(&frame[5..]);
        a.on_received(3, &mut local, None).unwrap();
        assert_eq!(a.status(), Some(Status::Ok));
        a.target(&mut local).unwrap()[..2].copy_from_slice(b"ab");
        a.on_received(2, &mut local, None).unwrap();
        a.target(&mut local).unwrap().copy_from_slice(b"cdef");
        a.on_received(4, &mut local, None).unwrap();
        assert!(a.done() && a.target(&mut local).is_none());
        assert_eq!(&local, b"abcdef");
    }

    /// On a keyed connection a status frame comes sealed: it is taken whole, however cut,
    /// and opened with the connection's session; one that does not open (altered, injected,
    /// replayed) or a plain one is a protocol error, and no data after it lands.
    #[test]
    fn a_keyed_connections_status_frames_open_only_under_its_session() {
        let key =
            crate::auth::ClusterKey::parse("k".repeat(64).as_bytes(), std::path::Path::new("k"))
                .unwrap();
        let (init, hello) = Initiator::new(&key, PROTOCOL, "t").unwrap();
        let (target, ans) = crate::auth::answer(&key, PROTOCOL, &hello, &["t"]).unwrap();
        let (_, mut open) = init.finish(&ans).unwrap().split();
        let (mut seal, _) = target.split();
        let sealed = |seal: &mut Sealer, s: Status| {
            let mut out = Vec::new();
            seal.seal(&tcp::encode_status(s), &mut out);
            out
        };
        for chunk in [1, 5, 24, 64] {
            let mut stream = sealed(&mut seal, Status::Ok);
            assert_eq!(stream.len(), SEALED_STATUS_LEN);
            stream.extend_from_slice(b"hello");
            let mut a = Answer::new(Opcode::Read, 5, true, true);
            let mut local = [0u8; 5];
            let mut pos = 0;
            while !a.done() {
                let end = (pos + chunk).min(stream.len());
                pos += a
                    .handle_bytes(&stream[pos..end], &mut local, Some(&mut open))
                    .unwrap();
            }
            assert_eq!(
                (a.status(), &local),
                (Some(Status::Ok), b"hello"),
                "chunk {chunk}"
            );
        }
        let replayed = sealed(&mut seal, Status::Ok);
        let mut a = Answer::new(Opcode::Write, 5, true, true);
        assert_eq!(
            a.handle_bytes(&replayed, &mut [], Some(&mut open)),
            Ok(SEALED_STATUS_LEN)
        );
        let mut a = Answer::new(Opcode::Write, 5, true, true);
        assert_eq!(
            a.handle_bytes(&replayed, &mut [], Some(&mut open)),
            Err(WireError::Unsealed),
            "the same frame again"
        );
        let mut altered = sealed(&mut seal, Status::Ok);
        altered[3] ^= 1;
        let mut a = Answer::new(Opcode::Read, 5, true, true);
        assert_eq!(
            a.handle_bytes(&altered, &mut [0; 5], Some(&mut open)),
            Err(WireError::Unsealed),
            "one bit flipped"
        );
        let mut plain = tcp::encode_status(Status::Ok).to_vec();
        plain.extend_from_slice(&[0; 16]);
        let mut a = Answer::new(Opcode::Write, 5, true, true);
        assert_eq!(
            a.handle_bytes(&plain, &mut [], Some(&mut open)),
            Err(WireError::Unsealed),
            "a plain status in its place"
        );
    }

    #[test]
    fn frames_carry_a_fence_only_for_v1_writes() {
        let (h, f) = request_frames(Opcode::Write, 0x1000, 64, false);
        assert_eq!(
            DataHeader::decode(&h).unwrap(),
            DataHeader {
                size: 64,
                addr: 0x1000,
                opcode: Opcode::Write,
                v2: false
            }
        );
        assert_eq!(
            DataHeader::decode(&f.unwrap()).unwrap(),
            DataHeader {
                size: 1,
                addr: 0x1000 + 63,
                opcode: Opcode::Read,
                v2: false
            }
        );
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
        assert!(
            must_stop(t0, deadline, true),
            "a revoked range stops at once"
        );
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
            assert!(
                have < HEADER_LEN,
                "the whole header trickled in before the clock ran out"
            );
            now += Duration::from_millis(100);
        }
        assert_eq!(
            have, 10,
            "overdue at the first byte more than 800 ms after the first"
        );
        assert!(
            !c.overdue(HEADER_LEN, now),
            "a complete header is never overdue"
        );
    }

    #[test]
    fn admission_needs_a_registered_nonempty_range_and_sets_the_deadline() {
        let reg = MemoryRegistry::new();
        reg.register_batch(&[(0x10000, 0x1000)], "*").unwrap();
        let now = Instant::now();
        let stall = Duration::from_secs(1);
        let hdr = |addr, size| DataHeader {
            size,
            addr,
            opcode: Opcode::Write,
            v2: true,
        };
        assert!(
            matches!(admit(&hdr(0x10000, 0), &reg, stall, now), Admission::Reject),
            "empty"
        );
        assert!(
            matches!(
                admit(&hdr(0x10800, 0x801), &reg, stall, now),
                Admission::Reject
            ),
            "crosses the end"
        );
        assert!(
            matches!(admit(&hdr(0x1000, 1), &reg, stall, now), Admission::Reject),
            "outside"
        );
        assert!(
            matches!(
                admit(&hdr(u64::MAX, 2), &reg, stall, now),
                Admission::Reject
            ),
            "wraps"
        );
        match admit(&hdr(0x10800, 0x800), &reg, stall, now) {
            Admission::Serve { guard, deadline } => {
                assert_eq!(guard.region().addr, 0x10000);
                assert_eq!(deadline, now + stall + Duration::from_nanos(0x800));
            }
            Admission::Reject => panic!("inside registered memory"),
        }
    }

    #[test]
    fn a_gathered_write_is_bounded_by_the_deadline_of_the_request_going_out() {
        let t0 = Instant::now();
        let (small, large) = (
            t0 + Duration::from_millis(500),
            t0 + Duration::from_millis(1040),
        );
        let small_bytes = HEADER_LEN as u64 + 4096;
        let ends = [
            (small_bytes, small),
            (small_bytes + HEADER_LEN as u64 + (512 << 20), large),
        ];
        assert_eq!(deadline_at(&ends, 0), Some(small));
        assert_eq!(deadline_at(&ends, small_bytes - 1), Some(small));
        assert_eq!(
            deadline_at(&ends, small_bytes),
            Some(large),
            "the small one left: the large one's deadline"
        );
        assert_eq!(deadline_at(&ends, ends[1].0), None);
    }

    #[test]
    fn only_reads_are_retried_and_only_once() {
        let now = Instant::now();
        let f = Failed {
            broken: true,
            attempts: 0,
            revoked: false,
            deadline: now + Duration::from_secs(1),
            untouched: false,
        };
        assert_eq!(fate(Opcode::Read, f, now, "p", "reset"), Fate::Retry);
        // Behind a rejected request, never taken by the target: a WRITE goes again too, once.
        let untouched = Failed {
            untouched: true,
            ..f
        };
        assert_eq!(
            fate(Opcode::Write, untouched, now, "p", "rejected"),
            Fate::Retry
        );
        assert_ne!(
            fate(
                Opcode::Write,
                Failed {
                    attempts: 1,
                    ..untouched
                },
                now,
                "p",
                "rejected"
            ),
            Fate::Retry
        );
        assert_ne!(
            fate(
                Opcode::Write,
                untouched,
                now + Duration::from_secs(2),
                "p",
                "rejected"
            ),
            Fate::Retry
        );
        let end = |fate: Fate| match fate {
            Fate::End(k, f) => (k, f.cause),
            Fate::Retry => panic!("retried"),
        };
        assert_eq!(
            end(fate(Opcode::Write, f, now, "p", "reset")),
            (FailKind::Failed, FailCause::PeerLost)
        );
        assert_eq!(
            end(fate(
                Opcode::Read,
                Failed { attempts: 1, ..f },
                now,
                "p",
                "reset"
            )),
            (FailKind::Failed, FailCause::PeerLost)
        );
        assert_eq!(
            end(fate(
                Opcode::Read,
                Failed { broken: false, ..f },
                now,
                "p",
                "stopped"
            )),
            (FailKind::Failed, FailCause::PeerLost)
        );
        assert_eq!(
            end(fate(
                Opcode::Read,
                f,
                now + Duration::from_secs(2),
                "p",
                "reset"
            )),
            (FailKind::Timeout, FailCause::Timeout)
        );
        assert_eq!(
            end(fate(
                Opcode::Read,
                Failed { revoked: true, ..f },
                now,
                "p",
                "reset"
            )),
            (FailKind::Failed, FailCause::LocalNotRegistered)
        );
    }
}
