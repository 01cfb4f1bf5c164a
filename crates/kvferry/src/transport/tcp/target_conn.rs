//! The target side of one data connection as a sans-IO state machine.
//!
//! [`ServeConn`] is fed what the socket delivered ([`ServeConn::handle_bytes`], or
//! [`ServeConn::body`] + [`ServeConn::on_body`] for a body received straight into place), is
//! told what the socket sent ([`ServeConn::on_sent`]) and what time it is
//! ([`ServeConn::handle_timeout`]), and says what to send next ([`ServeConn::transmit`]), by
//! when it must be woken ([`ServeConn::poll_timeout`]) and whether the connection is over
//! ([`ServeConn::closed`]). It never touches a socket and never reads the clock: the
//! connection thread in `server.rs` only moves bytes, so the protocol's rules — admission
//! before any byte lands, the answer only after the last byte landed, a deadline per request
//! however the bytes trickle, a revoked range never touched again, a half-received header
//! dropped after `stall` — are unit-tested below as sequences of calls with synthetic times.
//!
//! Memory: the machine holds the [`RegionGuard`] of the request it serves, and it alone turns
//! the admitted range into slices; it checks the guard's revocation before every copy and on
//! every [`ServeConn::handle_timeout`], and drops the guard when the request ends or the
//! connection closes (which is what lets `unregister` return).

use super::rules::{admit, Admission, HeaderClock};
use super::rules::{protocol, seal_chunk, Next, Unseal, CHUNK};
use super::sockio::{MAX_OUT, SMALL_READ};
use crate::auth::{Keyed, Opener, Protect, Sealer};
use crate::memory::{MemoryRegistry, RegionGuard};
use crate::wire::tcp::{self, DataHeader, Opcode, Status, HEADER_LEN, SEALED_HEADER_LEN};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why a served connection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum End {
    /// A request's deadline passed (a trickling or stalled peer), or a header began and did
    /// not complete within `stall`.
    Overdue,
    /// The range a request moves was unregistered while it was being served.
    Revoked,
    /// A request outside registered memory was answered REJECTED (v2) or dropped (v1).
    Rejected,
    /// The header could not be decoded.
    BadHeader(String),
    /// A copy to or from GPU memory failed (the request is not answered as done).
    Device(String),
    /// This target holds a cluster key and the connection did not prove it (why).
    Unauthorized(String),
}

/// Bytes of GPU memory staged per chunk: a connection's pinned buffer holds two (allocated at
/// its first GPU request), one copied to or from the GPU while the other is received or sent.
const GPU_CHUNK: usize = 1 << 20;

enum State {
    /// With a cluster key, before anything else: receiving the initiator's opening frame and
    /// the Noise message it announces (`pre` holds what came of them), until `until`.
    Hello {
        keyed: Arc<Keyed>,
        least: Protect,
        until: Instant,
    },
    /// Receiving a header (`have` bytes of it so far).
    Header,
    /// A WRITE body: `got` of `len` bytes landed at `addr`.
    Body {
        guard: RegionGuard,
        addr: u64,
        len: u64,
        got: u64,
        deadline: Instant,
        v2: bool,
        /// GPU memory: the body lands in half `half` of the pipe, `fill` bytes of it so
        /// far, and goes host→device per chunk (asynchronously, while the next chunk is
        /// received into the other half); the status leaves after every copy is done.
        gpu: Option<u32>,
        fill: usize,
        half: usize,
    },
    /// A READ answer sent straight from memory once `out` is gone: `sent` of `len` bytes.
    Answer {
        guard: RegionGuard,
        addr: u64,
        len: u64,
        sent: u64,
        deadline: Instant,
        /// GPU memory: half `half` of the pipe holds `[chunk_at, chunk_at + chunk_len)` of
        /// it, being sent; the other half is being filled with the `next` bytes after it.
        gpu: Option<u32>,
        chunk_at: u64,
        chunk_len: usize,
        half: usize,
        next: usize,
    },
    /// Sending what `out` holds, then closing with `End`.
    Closing(End),
    Closed(End),
}

/// One served data connection. See the module documentation.
pub(super) struct ServeConn {
    stall: Duration,
    hdr: [u8; SEALED_HEADER_LEN],
    have: usize,
    clock: HeaderClock,
    state: State,
    /// Status frames and gathered small READ answers, in request order, not yet sent.
    out: Vec<u8>,
    /// The last request was a large WRITE: the next is likely one too.
    large_write: bool,
    /// Where GPU bytes are staged (pinned host memory, a stream; made at the first GPU
    /// request, for that request's GPU).
    pipe: Option<crate::gpu::Pipe>,
    /// What came of the cluster key's opening frame so far (it is not a request header).
    pre: Vec<u8>,
    /// With a cluster key, once its handshake is done: the connection's session (every
    /// request header comes sealed, every status frame leaves sealed).
    sealed: Option<Session>,
    /// A keyed connection protecting the bytes moved: receiving the current WRITE body's
    /// chunks (kept between requests for its buffers).
    body_in: Option<Unseal>,
    /// The last [`ServeConn::body`] handed out `body_in`'s tail, not the destination.
    into_tail: bool,
}

/// A keyed connection's session, and whether the initiator proved it holds it (a request
/// header opened): until then only `proof_by` may pass.
struct Session {
    seal: Sealer,
    open: Opener,
    proof_by: Option<Instant>,
    /// What the connection protects (the initiator's choice, at least the target's own).
    protect: Protect,
}

impl Drop for ServeConn {
    fn drop(&mut self) {
        // Copies still queued may touch the range of the request being served: they end
        // before its guard goes (with `state`, after this).
        if let Some(p) = &mut self.pipe {
            let _ = p.sync();
        }
    }
}

/// The pipe of a connection for GPU `dev`, made at first use (a pipe for another GPU is
/// drained and replaced); or why GPU memory cannot be copied.
fn pipe(slot: &mut Option<crate::gpu::Pipe>, dev: u32) -> Result<&mut crate::gpu::Pipe, String> {
    if slot.as_ref().is_some_and(|p| p.dev() != dev) {
        *slot = None;
    }
    if slot.is_none() {
        *slot = Some(crate::gpu::Pipe::new(dev, GPU_CHUNK)?);
    }
    Ok(slot.as_mut().expect("just set"))
}

/// Copies `dst.len()` bytes of GPU `gpu`'s memory at `src` into `dst`.
fn gpu_dtoh(gpu: u32, dst: &mut [u8], src: u64) -> Result<(), String> {
    let cuda = crate::gpu::cuda().map_err(|e| e.to_string())?;
    cuda.dtoh(gpu, dst, src)
        .map_err(|e| format!("copying GPU {gpu} memory at 0x{src:x}: {e}"))
}

/// What to send: `out` first, then `body` (a READ answer straight from registered memory).
pub(super) struct Transmit<'a> {
    pub out: &'a [u8],
    pub body: &'a [u8],
}

impl ServeConn {
    pub(super) fn new(stall: Duration) -> ServeConn {
        ServeConn {
            stall,
            hdr: [0; SEALED_HEADER_LEN],
            have: 0,
            clock: HeaderClock::new(stall),
            state: State::Header,
            out: Vec::with_capacity(4096),
            large_write: false,
            pipe: None,
            pre: Vec::new(),
            sealed: None,
            body_in: None,
            into_tail: false,
        }
    }

    /// A connection to a target holding a cluster key (and known by `keyed.names`): the
    /// initiator's handshake, and its first sealed request header, must come within `stall` of
    /// `now` (the connection's start) before any request is served.
    /// `least`: what a connection must at least protect (`KVFERRY_AUTH_PROTECT` here).
    pub(super) fn with_key(
        stall: Duration,
        keyed: Arc<Keyed>,
        least: Protect,
        now: Instant,
    ) -> ServeConn {
        let mut c = ServeConn::new(stall);
        c.state = State::Hello {
            keyed,
            least,
            until: now + stall,
        };
        c
    }

    /// What the bytes moved on this connection go as (`Headers`: as they are).
    fn protect(&self) -> Protect {
        self.sealed.as_ref().map_or(Protect::Headers, |s| s.protect)
    }

    /// Bytes of a request header as it comes on this connection.
    fn hdr_len(&self) -> usize {
        if self.sealed.is_some() {
            SEALED_HEADER_LEN
        } else {
            HEADER_LEN
        }
    }

    /// A keyed connection whose initiator proved it holds the session (a sealed request
    /// header opened): it no longer counts among the unproved.
    pub(super) fn proved(&self) -> bool {
        self.sealed.as_ref().is_some_and(|s| s.proof_by.is_none())
    }

    /// Queues a status frame, sealed on a keyed connection.
    fn push_status(&mut self, st: Status) {
        let frame = tcp::encode_status(st);
        match &mut self.sealed {
            Some(s) => s.seal.seal(&frame, &mut self.out),
            None => self.out.extend_from_slice(&frame),
        }
    }

    /// Consumes bytes the socket delivered; returns how many it took. It stops taking bytes
    /// while a READ answer or a closing status waits to be sent ([`ServeConn::transmit`]) and
    /// once the connection is over; the caller keeps the rest for later.
    pub(super) fn handle_bytes(
        &mut self,
        registry: &MemoryRegistry,
        mut data: &[u8],
        now: Instant,
    ) -> usize {
        let total = data.len();
        while !data.is_empty() {
            match &mut self.state {
                State::Hello { until, .. } => {
                    let until = *until;
                    // The header first; then the message it announces (bounded there).
                    let want = HEADER_LEN
                        + tcp::auth_hello_len(&self.pre)
                            .map_or(0, |n| n.min(crate::auth::MAX_HELLO_LEN as u64) as usize);
                    let n = (want - self.pre.len()).min(data.len());
                    self.pre.extend_from_slice(&data[..n]);
                    data = &data[n..];
                    if now >= until {
                        self.close(End::Overdue);
                    } else if self.pre.len() == want {
                        self.on_hello();
                    }
                }
                State::Header => {
                    let hdr_len = self.hdr_len();
                    let n = (hdr_len - self.have).min(data.len());
                    self.hdr[self.have..self.have + n].copy_from_slice(&data[..n]);
                    self.have += n;
                    data = &data[n..];
                    if self.clock.overdue(self.have, now)
                        || self
                            .sealed
                            .as_ref()
                            .and_then(|s| s.proof_by)
                            .is_some_and(|by| now >= by)
                    {
                        self.close(End::Overdue);
                    } else if self.have == hdr_len {
                        self.have = 0;
                        self.clock = HeaderClock::new(self.stall);
                        self.on_header(registry, now);
                    }
                }
                State::Body { .. } => {
                    let Some(dst) = self.body() else { break };
                    let n = dst.len().min(data.len());
                    dst[..n].copy_from_slice(&data[..n]);
                    data = &data[n..];
                    self.on_body(n, now);
                }
                State::Answer { .. } | State::Closing(_) | State::Closed(_) => break,
            }
        }
        total - data.len()
    }

    /// The cluster key's opening frame: its header (`pre` holds just that), then the whole
    /// frame with its Noise message. A request in its place is refused (answered
    /// `Unauthorized` when it asked for status frames) before its body; a message of a size
    /// outside the handshake's, not sealed under a key held here or naming another segment is
    /// refused and the connection closed; otherwise the answer leaves and sealed request
    /// headers are awaited.
    fn on_hello(&mut self) {
        let refuse = |c: &mut ServeConn, v2: bool, why: String| {
            if v2 {
                c.push_status(Status::Unauthorized);
                c.state = State::Closing(End::Unauthorized(why));
            } else {
                c.close(End::Unauthorized(why));
            }
        };
        let State::Hello {
            keyed,
            least,
            until,
        } = std::mem::replace(&mut self.state, State::Header)
        else {
            return;
        };
        let Some(announced) = tcp::auth_hello_len(&self.pre) else {
            let v2 = self
                .pre
                .get(..HEADER_LEN)
                .and_then(|h| DataHeader::decode(h.try_into().ok()?).ok())
                .is_some_and(|h| h.v2);
            return refuse(self, v2, "a request before the cluster key's handshake: the initiator holds no KVFERRY_AUTH_KEY_FILE (or is a stock Mooncake engine)".into());
        };
        if announced < crate::auth::hello_len(0) as u64
            || announced > crate::auth::MAX_HELLO_LEN as u64
        {
            return refuse(
                self,
                true,
                format!(
                    "an opening frame announcing {announced} bytes, outside a handshake's {}..={}",
                    crate::auth::hello_len(0),
                    crate::auth::MAX_HELLO_LEN
                ),
            );
        }
        let code =
            tcp::auth_hello_protect(self.pre[..HEADER_LEN].try_into().expect("a header's bytes"));
        let asked = match Protect::from_code(code) {
            Some(p) if p >= least => p,
            Some(p) => return refuse(self, true, format!("the initiator asks KVFERRY_AUTH_PROTECT={} and this engine requires at least {}: set it there too", p.name(), least.name())),
            None => return refuse(self, true, format!("the initiator asks for protection {code}, which this engine does not know (a newer kvferry?)")),
        };
        if self.pre.len() < HEADER_LEN + announced as usize {
            self.state = State::Hello {
                keyed,
                least,
                until,
            };
            return;
        }
        let hello = std::mem::take(&mut self.pre);
        match keyed.answer(protocol(asked), &hello[HEADER_LEN..]) {
            Ok((session, answer)) => {
                self.out.extend_from_slice(&tcp::ANSWER_MAGIC.to_le_bytes());
                self.out.extend_from_slice(&answer);
                let (seal, open) = session.split();
                self.sealed = Some(Session {
                    seal,
                    open,
                    proof_by: Some(until),
                    protect: asked,
                });
                self.clock = HeaderClock::new(self.stall);
            }
            Err(r) => refuse(self, true, format!("the initiator's opening message: {r}")),
        }
    }

    fn on_header(&mut self, registry: &MemoryRegistry, now: Instant) {
        let mut plain = [0u8; SEALED_HEADER_LEN];
        let hdr: [u8; HEADER_LEN] = match &mut self.sealed {
            Some(s) => match s.open.open(&self.hdr, &mut plain) {
                Ok(HEADER_LEN) => {
                    s.proof_by = None;
                    plain[..HEADER_LEN].try_into().expect("a header's bytes")
                }
                // (Nothing can be said to the sender: it is not the session's other side.)
                _ => return self.close(End::Unauthorized("a request header that does not open under the connection's session (injected, replayed or altered by something on the path)".into())),
            },
            None if tcp::auth_hello_len(&self.hdr).is_some() => {
                // An initiator holding a cluster key, and this target none: say so, and close.
                self.push_status(Status::Unauthorized);
                self.state = State::Closing(End::Unauthorized("the initiator holds a cluster key and this target none (KVFERRY_AUTH_KEY_FILE is not set here)".into()));
                return;
            }
            None => self.hdr[..HEADER_LEN].try_into().expect("a header's bytes"),
        };
        let h = match DataHeader::decode(&hdr) {
            Ok(h) => h,
            Err(e) => return self.close(End::BadHeader(e.to_string())),
        };
        let Admission::Serve { guard, deadline } = admit(&h, registry, self.stall, now) else {
            tracing::debug!(
                addr = h.addr,
                size = h.size,
                "rejecting TCP request outside registered memory"
            );
            if h.v2 {
                self.push_status(Status::Rejected);
                self.state = State::Closing(End::Rejected);
            } else {
                self.close(End::Rejected);
            }
            return;
        };
        match h.opcode {
            Opcode::Write => {
                self.large_write = h.size >= super::sockio::DIRECT_MIN as u64;
                let gpu = guard.region().gpu;
                self.state = State::Body {
                    guard,
                    addr: h.addr,
                    len: h.size,
                    got: 0,
                    deadline,
                    v2: h.v2,
                    gpu,
                    fill: 0,
                    half: 0,
                };
                match (self.protect(), &mut self.body_in) {
                    (Protect::Headers, _) => {}
                    (_, Some(u)) => u.reset(h.size),
                    (p, none) => *none = Some(Unseal::new(p, h.size)),
                }
            }
            Opcode::Read => {
                self.large_write = false;
                if let Some(gpu) = guard.region().gpu {
                    return self.on_gpu_read(guard, gpu, &h, deadline, now);
                }
                if h.v2 {
                    self.push_status(Status::Ok);
                }
                if h.size as usize <= SMALL_READ && self.out.len() + h.size as usize <= MAX_OUT {
                    // Small answers are gathered and leave together.
                    // SAFETY: admitted: inside registered memory, kept registered by `guard`
                    // (not revoked: checked just below before the copy).
                    if guard.is_revoked() {
                        return self.close(End::Revoked);
                    }
                    let src =
                        unsafe { std::slice::from_raw_parts(h.addr as *const u8, h.size as usize) };
                    match &mut self.sealed {
                        Some(s) if s.protect != Protect::Headers => {
                            seal_chunk(s.protect, &mut s.seal, src, &mut self.out)
                        }
                        _ => self.out.extend_from_slice(src),
                    }
                } else {
                    self.state = State::Answer {
                        guard,
                        addr: h.addr,
                        len: h.size,
                        sent: 0,
                        deadline,
                        gpu: None,
                        chunk_at: 0,
                        chunk_len: 0,
                        half: 0,
                        next: 0,
                    };
                    self.fill_answer(now);
                }
            }
        }
    }

    /// Where the next bytes of the current WRITE body go, to receive them straight into
    /// place (on a protected connection: into place up to the end of a `Payload` chunk, or
    /// into the tail being received); `None` when no body is expected (or its range was
    /// revoked: the connection then closes).
    pub(super) fn body(&mut self) -> Option<&mut [u8]> {
        if !matches!(self.state, State::Body { .. }) {
            return None;
        }
        let limit = match self.body_in.as_mut().map(Unseal::next) {
            Some(Next::Tail) => {
                self.into_tail = true;
                return self.body_in.as_mut().map(Unseal::tail_mut);
            }
            Some(Next::Place(n)) => n,
            None => usize::MAX,
        };
        self.into_tail = false;
        let d = self.dest()?;
        let k = d.len().min(limit);
        Some(&mut d[..k])
    }

    /// Where the rest of the current WRITE body lands (memory, or the GPU pipe's half);
    /// `None` when no body is expected (or its range was revoked: the connection then closes).
    fn dest(&mut self) -> Option<&mut [u8]> {
        let State::Body {
            guard,
            addr,
            len,
            got,
            gpu,
            fill,
            half,
            ..
        } = &self.state
        else {
            return None;
        };
        if guard.is_revoked() {
            self.close(End::Revoked);
            return None;
        }
        if let Some(dev) = *gpu {
            // GPU memory: into the current half of the pipe (once the copy out of it that
            // was queued two chunks ago is done), at most to the end of this chunk.
            let want = (GPU_CHUNK - *fill).min((*len - *got) as usize);
            let (fill, half) = (*fill, *half);
            let ready = pipe(&mut self.pipe, dev).and_then(|p| {
                p.wait(half)
                    .map_err(|e| format!("copying into GPU {dev} memory: {e}"))
            });
            if let Err(e) = ready {
                self.close(End::Device(e));
                return None;
            }
            return self
                .pipe
                .as_mut()
                .map(|p| &mut p.half_mut(half)[fill..fill + want]);
        }
        // SAFETY: the range was admitted (inside registered memory) and `guard` keeps it
        // registered while this state lives; it is not revoked (checked above), and the
        // unregister barrier waits for the guard, which goes only with this state.
        Some(unsafe {
            std::slice::from_raw_parts_mut((*addr + *got) as *mut u8, (*len - *got) as usize)
        })
    }

    /// `n` bytes of the current WRITE body landed (through [`ServeConn::body`]). On a
    /// protected connection, bytes in place are hashed (`Payload`), and a whole tail is opened:
    /// a digest that does not match, or a chunk that does not open, ends the connection
    /// without answering the request.
    pub(super) fn on_body(&mut self, n: usize, now: Instant) {
        let Some(mut u) = self
            .body_in
            .take()
            .filter(|_| matches!(self.state, State::Body { .. }))
        else {
            return self.landed(n, now);
        };
        if !self.into_tail {
            if let Some(d) = self.dest() {
                u.placed(&d[..n.min(d.len())]);
            }
            self.body_in = Some(u);
            return self.landed(n, now);
        }
        if !u.tail_received(n) {
            self.body_in = Some(u);
            return self.handle_timeout(now);
        }
        let Some(mut s) = self.sealed.take() else {
            return self.close(End::Unauthorized(
                "a protected body on a connection without a session".into(),
            ));
        };
        let opened = match u.protect() {
            Protect::Encrypt => match self.dest() {
                Some(d) => u.open_tail(&mut s.open, d),
                None => Err(crate::wire::WireError::Unsealed),
            },
            _ => u.open_tail(&mut s.open, &mut []),
        };
        self.sealed = Some(s);
        let encrypt = u.protect() == Protect::Encrypt;
        self.body_in = Some(u);
        match opened {
            Ok(k) if encrypt => self.landed(k, now),
            Ok(_) => self.landed(0, now),
            // (Nothing can be said to the sender: it is not the session's other side, or the
            // bytes were altered on the way.)
            Err(_) if matches!(self.state, State::Closed(_)) => {}
            Err(_) => self.close(End::Unauthorized("a WRITE body's chunk that does not open under the connection's session, or whose digest does not match what landed (altered on the path): the request is not answered".into())),
        }
    }

    /// `n` bytes of the current WRITE body are in place (received, or opened there).
    fn landed(&mut self, n: usize, now: Instant) {
        let State::Body {
            guard,
            addr,
            len,
            got,
            gpu,
            fill,
            half,
            ..
        } = &mut self.state
        else {
            return;
        };
        *got += n as u64;
        if let (Some(gpu), true) = (*gpu, n > 0) {
            *fill += n;
            if *fill == GPU_CHUNK || *got >= *len {
                // A chunk (or the body's end) is in the bounce buffer: to the GPU, unless the
                // range was revoked meanwhile.
                if guard.is_revoked() {
                    return self.close(End::Revoked);
                }
                let at = *addr + *got - *fill as u64;
                let (chunk, h, last) = (*fill, *half, *got >= *len);
                *fill = 0;
                *half ^= 1;
                // Queued; the next chunk is received into the other half meanwhile, and the
                // last one waits for every copy before the status is queued.
                let r = match self.pipe.as_mut() {
                    Some(p) => p
                        .htod(h, at, chunk)
                        .and_then(|()| if last { p.sync() } else { Ok(()) }),
                    None => return self.close(End::Device("no staging buffer".into())),
                };
                if let Err(e) = r {
                    return self.close(End::Device(format!(
                        "copying into GPU {gpu} memory at 0x{at:x}: {e}"
                    )));
                }
            }
        }
        let State::Body { len, got, v2, .. } = &mut self.state else {
            return;
        };
        // (A protected body is whole once its every chunk opened.)
        if *got >= *len && self.body_in.as_ref().is_none_or(Unseal::done) {
            if *v2 {
                self.push_status(Status::Ok);
            }
            self.state = State::Header;
        } else {
            self.handle_timeout(now);
        }
    }

    /// What to send now. Empty when nothing is waiting. (A protected answer leaves through
    /// `out`, chunk by chunk: [`ServeConn::fill_answer`].)
    pub(super) fn transmit(&self) -> Transmit<'_> {
        let body = if self.protect() == Protect::Headers {
            self.raw_answer()
        } else {
            &[]
        };
        Transmit {
            out: &self.out,
            body,
        }
    }

    /// What of a READ answer can be sent as it is now (from memory or the GPU pipe).
    fn raw_answer(&self) -> &[u8] {
        match &self.state {
            // SAFETY: admitted and guarded as in `body`; a revoked guard closes the
            // connection at the next `handle_timeout`, which the sender calls after every
            // system call, so at most the bytes of one call leave after revocation began
            // and none after the barrier (which waits for this state to go).
            State::Answer {
                gpu: Some(_),
                sent,
                chunk_at,
                chunk_len,
                half,
                ..
            } => match &self.pipe {
                // Waited for when it became the current half (`stage_answer`).
                Some(p) => &p.half(*half)[(*sent - *chunk_at) as usize..*chunk_len],
                None => &[],
            },
            State::Answer {
                addr, len, sent, ..
            } => unsafe {
                std::slice::from_raw_parts((*addr + *sent) as *const u8, (*len - *sent) as usize)
            },
            _ => &[],
        }
    }

    /// Whether sending must happen before more bytes are taken: a READ answer or a closing
    /// status waits, the gathered answers grew large, or a WRITE body is to be received
    /// while earlier requests' answers wait (they leave first: a body can take as long as its
    /// deadline, and the initiator's deadlines for those requests run meanwhile).
    pub(super) fn must_send(&self) -> bool {
        match self.state {
            State::Answer { .. } | State::Closing(_) => true,
            State::Body { .. } => !self.out.is_empty(),
            _ => self.out.len() >= MAX_OUT,
        }
    }

    /// `n` bytes of [`ServeConn::transmit`] left.
    pub(super) fn on_sent(&mut self, n: usize, now: Instant) {
        let from_out = n.min(self.out.len());
        self.out.drain(..from_out);
        let rest = (n - from_out) as u64;
        if self.protect() != Protect::Headers {
            if matches!(self.state, State::Answer { .. }) {
                if self.out.is_empty() {
                    self.fill_answer(now);
                }
                return;
            }
        } else if matches!(self.state, State::Answer { .. }) {
            return self.answered(rest, now);
        }
        if let State::Closing(_) = self.state {
            if self.out.is_empty() {
                let State::Closing(why) = std::mem::replace(&mut self.state, State::Header) else {
                    unreachable!()
                };
                self.state = State::Closed(why);
            }
        }
    }

    /// `rest` more bytes of the READ answer being sent left (or, protected, went into `out`).
    fn answered(&mut self, rest: u64, now: Instant) {
        match &mut self.state {
            State::Answer {
                len,
                sent,
                gpu,
                chunk_at,
                chunk_len,
                ..
            } => {
                *sent += rest;
                if *sent >= *len {
                    self.state = State::Header;
                } else if gpu.is_some() && *sent >= *chunk_at + *chunk_len as u64 {
                    // The staged chunk left: stage the next one (revocation checked first).
                    self.handle_timeout(now);
                    self.stage_answer();
                } else {
                    self.handle_timeout(now);
                }
            }
            State::Closing(_) if self.out.is_empty() => {
                let State::Closing(why) = std::mem::replace(&mut self.state, State::Header) else {
                    unreachable!()
                };
                self.state = State::Closed(why);
            }
            _ => {}
        }
    }

    /// The time passed (and any system call returned): ends the connection if the request
    /// it serves is overdue or its range was revoked, or a header began more than `stall` ago.
    pub(super) fn handle_timeout(&mut self, now: Instant) {
        match &self.state {
            State::Body {
                guard, deadline, ..
            }
            | State::Answer {
                guard, deadline, ..
            } => {
                if guard.is_revoked() {
                    self.close(End::Revoked);
                } else if now >= *deadline {
                    self.close(End::Overdue);
                }
            }
            State::Header => {
                if self.clock.overdue(self.have, now)
                    || self
                        .sealed
                        .as_ref()
                        .and_then(|s| s.proof_by)
                        .is_some_and(|by| now >= by)
                {
                    self.close(End::Overdue);
                }
            }
            State::Hello { until, .. } => {
                if now >= *until {
                    self.close(End::Overdue);
                }
            }
            State::Closing(_) | State::Closed(_) => {}
        }
    }

    /// When [`ServeConn::handle_timeout`] must be called at the latest; `None` when the
    /// connection is idle (it may wait for its next request as long as it likes).
    pub(super) fn poll_timeout(&self) -> Option<Instant> {
        match &self.state {
            State::Body { deadline, .. } | State::Answer { deadline, .. } => Some(*deadline),
            // (An unproved keyed connection may not idle: it holds a place among the unproved.)
            State::Header => match (
                self.clock.due(),
                self.sealed.as_ref().and_then(|s| s.proof_by),
            ) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
            State::Hello { until, .. } => Some(*until),
            _ => None,
        }
    }

    /// Why the connection is over, once it is (the caller closes the socket).
    pub(super) fn closed(&self) -> Option<&End> {
        match &self.state {
            State::Closed(e) => Some(e),
            _ => None,
        }
    }

    /// The start of the registered range the current request holds (0: none), for the
    /// revocation hook that shuts down connections holding a range.
    pub(super) fn holding(&self) -> u64 {
        match &self.state {
            State::Body { guard, .. } | State::Answer { guard, .. } => guard.region().addr,
            _ => 0,
        }
    }

    /// Between requests, with nothing of the next header received yet.
    #[cfg(test)]
    pub(super) fn idle(&self) -> bool {
        matches!(self.state, State::Header) && self.have == 0
    }

    /// How many bytes the next buffered read should take at most: after a large WRITE only
    /// the next header, so a large body that follows goes straight to its destination.
    pub(super) fn read_hint(&self, buffer: usize) -> usize {
        match &self.state {
            State::Header if self.large_write => self.hdr_len() - self.have,
            _ => buffer,
        }
    }

    /// A READ of GPU memory: its answer leaves from the bounce buffer, a chunk at a time,
    /// each copied device→host just before it is sent (the first before the status frame,
    /// so a failed copy is never answered OK).
    fn on_gpu_read(
        &mut self,
        guard: RegionGuard,
        gpu: u32,
        h: &DataHeader,
        deadline: Instant,
        now: Instant,
    ) {
        if guard.is_revoked() {
            return self.close(End::Revoked);
        }
        if h.size as usize <= SMALL_READ && self.out.len() + h.size as usize <= MAX_OUT {
            let mut data = vec![0u8; h.size as usize];
            if let Err(e) = gpu_dtoh(gpu, &mut data, h.addr) {
                return self.close(End::Device(e));
            }
            if h.v2 {
                self.push_status(Status::Ok);
            }
            match &mut self.sealed {
                Some(s) if s.protect != Protect::Headers => {
                    seal_chunk(s.protect, &mut s.seal, &data, &mut self.out)
                }
                _ => self.out.extend_from_slice(&data),
            }
            return;
        }
        self.state = State::Answer {
            guard,
            addr: h.addr,
            len: h.size,
            sent: 0,
            deadline,
            gpu: Some(gpu),
            chunk_at: 0,
            chunk_len: 0,
            half: 1,
            next: 0,
        };
        self.stage_answer();
        if h.v2 && !matches!(self.state, State::Closed(_)) {
            self.push_status(Status::Ok);
        }
        self.fill_answer(now);
    }

    /// A protected READ answer: when nothing else waits to be sent, its next chunk (at most
    /// [`CHUNK`] bytes of what [`ServeConn::transmit`] would send as it is) goes into `out`
    /// protected, and counts as sent.
    fn fill_answer(&mut self, now: Instant) {
        let Some(s) = &self.sealed else { return };
        if s.protect == Protect::Headers || self.out.len() >= MAX_OUT {
            return;
        }
        if let State::Answer { guard, .. } = &self.state {
            if guard.is_revoked() {
                return self.close(End::Revoked);
            }
        } else {
            return;
        }
        // (The session and `out` are taken out while the answer's bytes are borrowed.)
        let (Some(mut session), mut out) = (self.sealed.take(), std::mem::take(&mut self.out))
        else {
            return;
        };
        let raw = self.raw_answer();
        let k = raw.len().min(CHUNK);
        seal_chunk(session.protect, &mut session.seal, &raw[..k], &mut out);
        (self.sealed, self.out) = (Some(session), out);
        self.answered(k as u64, now);
    }

    /// Makes the chunk at `sent` of a GPU READ answer the current one: the first time its
    /// copy is queued here, later it was queued while the previous chunk was sent; it is
    /// waited for, then the chunk after it is queued into the other half (just sent).
    fn stage_answer(&mut self) {
        let State::Answer {
            guard,
            addr,
            len,
            sent,
            gpu: Some(gpu),
            chunk_at,
            chunk_len,
            half,
            next,
            ..
        } = &mut self.state
        else {
            return;
        };
        if guard.is_revoked() {
            return self.close(End::Revoked);
        }
        let dev = *gpu;
        let p = match pipe(&mut self.pipe, dev) {
            Ok(p) => p,
            Err(e) => return self.close(End::Device(e)),
        };
        let cur = *half ^ 1;
        let r = (|| {
            if *next == 0 {
                // Nothing prefetched (the first chunk): queue it now.
                *next = GPU_CHUNK.min((*len - *sent) as usize);
                p.dtoh(cur, *addr + *sent, *next)?;
            }
            p.wait(cur)?;
            *half = cur;
            *chunk_at = *sent;
            *chunk_len = *next;
            let after = *sent + *next as u64;
            *next = GPU_CHUNK.min((*len - after) as usize);
            if *next > 0 {
                p.dtoh(cur ^ 1, *addr + after, *next)?;
            }
            Ok::<(), crate::sys::cuda::CudaError>(())
        })();
        if let Err(e) = r {
            self.close(End::Device(format!("copying GPU {dev} memory: {e}")));
        }
    }

    fn close(&mut self, why: End) {
        // Copies still queued may touch the request's range: they end before its guard.
        if let Some(p) = &mut self.pipe {
            let _ = p.sync();
        }
        // Drops the guard of the request being served (if any) with the old state. Answers
        // of earlier requests still waiting leave first (those WRITEs landed: a connection
        // closed on a later request must not make them fail); not mid-answer, where `out`
        // ends with the status of the READ being answered.
        self.state = match self.state {
            State::Header | State::Body { .. } if !self.out.is_empty() => State::Closing(why),
            _ => State::Closed(why),
        };
    }
}

/// Fuzzing's entry to a target connection (`kvferry::fuzz`): drives a [`ServeConn`] with
/// `data` as an initiator would send it, however cut, checks that nothing outside the one
/// registered page was touched, and returns how many bytes of the page changed. The first
/// byte chooses: 0 a target without a key, 1 a target with a key fed `data` before any
/// handshake (as it is), 2, 3 and 4 a keyed target after a real handshake protecting
/// headers, payload or everything. Otherwise `data` is requests: 24 bytes of header (its
/// address taken as an offset from the page before the registered one, so requests land
/// inside, across and outside it; sealed under the session after a handshake) followed by as
/// many body bytes as the next byte says (protected as an initiator would when they are all of
/// the body the header announces). The second byte sets the size
/// of the pieces the bytes are cut into.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn fuzz_drive(data: &[u8]) -> usize {
    const PAGE: usize = 4096;
    let (Some(&mode), Some(&cut)) = (data.first(), data.get(1)) else {
        return 0;
    };
    let data = &data[2..];
    let mut mem = vec![0x5Au8; PAGE * 3];
    let reg = MemoryRegistry::new();
    let base = mem.as_mut_ptr() as u64 + PAGE as u64;
    if reg.register_batch(&[(base, PAGE as u64)], "*").is_err() {
        return 0;
    }
    let key = Arc::new(
        crate::auth::ClusterKey::parse(&[b'f'; 64], std::path::Path::new("fuzz")).expect("a key"),
    );
    let keyed = Arc::new(Keyed {
        key: Arc::clone(&key),
        names: vec!["t".into()],
    });
    let t0 = Instant::now();
    let stall = Duration::from_secs(1);
    // Modes 2, 3, 4: after a handshake protecting headers, payload, or everything.
    let protect = Protect::from_code((mode % 5).saturating_sub(2)).unwrap_or_default();
    let mut c = match mode % 5 {
        0 => ServeConn::new(stall),
        _ => ServeConn::with_key(stall, Arc::clone(&keyed), Protect::Headers, t0),
    };
    let mut now = t0;
    // Feeds bytes as cut; returns what the target sent meanwhile.
    let feed = |c: &mut ServeConn, bytes: &[u8], now: &mut Instant| -> Vec<u8> {
        let mut out = Vec::new();
        for piece in bytes.chunks(usize::from(cut).max(1)) {
            let mut piece = piece;
            while c.closed().is_none() {
                let n = c.handle_bytes(&reg, piece, *now);
                piece = &piece[n..];
                let t = c.transmit();
                out.extend_from_slice(t.out);
                out.extend_from_slice(t.body);
                let sent = t.out.len() + t.body.len();
                c.on_sent(sent, *now);
                *now += Duration::from_micros(50);
                c.handle_timeout(*now);
                if piece.is_empty() || (n == 0 && sent == 0) {
                    break;
                }
            }
        }
        out
    };
    let mut seal = None;
    if mode % 5 >= 2 {
        let Ok((init, hello)) = crate::auth::Initiator::new(&key, protocol(protect), "t") else {
            return 0;
        };
        let mut open = tcp::encode_auth_hello(hello.len(), protect.code()).to_vec();
        open.extend_from_slice(&hello);
        let answer = feed(&mut c, &open, &mut now);
        let Some(rest) = answer.get(8..) else {
            return 0;
        };
        let Ok(session) = init.finish(rest) else {
            return 0;
        };
        seal = Some(session.split().0);
    }
    if mode % 5 == 1 {
        feed(&mut c, data, &mut now);
    } else {
        let mut rest = data;
        while rest.len() > HEADER_LEN && c.closed().is_none() {
            let mut hdr: [u8; HEADER_LEN] =
                rest[..HEADER_LEN].try_into().expect("a header's bytes");
            let off =
                u64::from_le_bytes(hdr[8..16].try_into().expect("8 bytes")) % (3 * PAGE as u64);
            hdr[8..16].copy_from_slice(&(base - PAGE as u64 + off).to_le_bytes());
            let mut wire = Vec::new();
            match &mut seal {
                Some(s) => s.seal(&hdr, &mut wire),
                None => wire.extend_from_slice(&hdr),
            }
            let body = usize::from(rest.get(HEADER_LEN).copied().unwrap_or(0))
                .min(rest.len() - HEADER_LEN - 1);
            match &mut seal {
                // (As a protected initiator sends a body; a body cut short is sent as it is.)
                Some(s)
                    if protect != Protect::Headers
                        && u64::from_le_bytes(hdr[0..8].try_into().expect("8 bytes"))
                            == body as u64 =>
                {
                    super::rules::seal_body(
                        protect,
                        s,
                        &rest[HEADER_LEN + 1..HEADER_LEN + 1 + body],
                        &mut wire,
                    )
                }
                _ => wire.extend_from_slice(&rest[HEADER_LEN + 1..HEADER_LEN + 1 + body]),
            }
            feed(&mut c, &wire, &mut now);
            rest = &rest[HEADER_LEN + 1 + body..];
        }
    }
    drop(c);
    assert!(
        mem[..PAGE]
            .iter()
            .chain(&mem[2 * PAGE..])
            .all(|&b| b == 0x5A),
        "bytes outside the registered page were written"
    );
    mem[PAGE..2 * PAGE].iter().filter(|&&b| b != 0x5A).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::tcp::{encode_status, STATUS_LEN};

    const STALL: Duration = Duration::from_secs(1);

    struct Mem {
        buf: Vec<u8>,
        reg: MemoryRegistry,
    }

    fn mem(len: usize) -> Mem {
        let buf: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let reg = MemoryRegistry::new();
        reg.register_batch(&[(buf.as_ptr() as u64, len as u64)], "*")
            .unwrap();
        Mem { buf, reg }
    }

    impl Mem {
        fn addr(&self, off: usize) -> u64 {
            self.buf.as_ptr() as u64 + off as u64
        }
    }

    fn hdr(op: Opcode, addr: u64, size: u64, v2: bool) -> Vec<u8> {
        DataHeader {
            size,
            addr,
            opcode: op,
            v2,
        }
        .encode()
        .to_vec()
    }

    /// Sends everything the machine has to send; returns it.
    fn drain(c: &mut ServeConn, now: Instant) -> Vec<u8> {
        let t = c.transmit();
        let mut all = t.out.to_vec();
        all.extend_from_slice(t.body);
        c.on_sent(all.len(), now);
        all
    }

    /// Everything the connection sends until it has nothing more (as `server.rs` `send`).
    fn drain_all(c: &mut ServeConn, now: Instant) -> Vec<u8> {
        let mut all = Vec::new();
        loop {
            let d = drain(c, now);
            if d.is_empty() {
                return all;
            }
            all.extend_from_slice(&d);
        }
    }

    #[test]
    fn a_write_trickled_byte_by_byte_lands_and_is_answered_after_its_last_byte() {
        let m = mem(4096);
        let mut c = ServeConn::new(STALL);
        let mut stream = hdr(Opcode::Write, m.addr(100), 10, true);
        stream.extend_from_slice(b"0123456789");
        let now = Instant::now();
        for (i, b) in stream.iter().enumerate() {
            assert_eq!(c.handle_bytes(&m.reg, std::slice::from_ref(b), now), 1);
            if i + 1 < stream.len() {
                assert!(
                    c.transmit().out.is_empty(),
                    "no answer before the last byte landed (byte {i})"
                );
            }
        }
        assert_eq!(&m.buf[100..110], b"0123456789");
        assert_eq!(drain(&mut c, now), encode_status(Status::Ok));
        assert!(c.idle() && c.closed().is_none());
    }

    #[test]
    fn pipelined_requests_in_one_read_are_served_in_order() {
        let m = mem(4096);
        let mut c = ServeConn::new(STALL);
        let mut stream = hdr(Opcode::Write, m.addr(0), 4, true);
        stream.extend_from_slice(b"abcd");
        stream.extend(hdr(Opcode::Read, m.addr(0), 4, true));
        stream.extend(hdr(Opcode::Read, m.addr(2), 2, false));
        let now = Instant::now();
        assert_eq!(c.handle_bytes(&m.reg, &stream, now), stream.len());
        let mut want = encode_status(Status::Ok).to_vec();
        want.extend_from_slice(&encode_status(Status::Ok));
        want.extend_from_slice(b"abcd");
        want.extend_from_slice(b"cd");
        assert!(!c.must_send(), "small answers wait to be gathered");
        assert_eq!(drain(&mut c, now), want);
    }

    /// A landed WRITE's status leaves before the next WRITE's body is received (which may
    /// take that body's whole deadline), and is still sent when that next request ends the
    /// connection (overdue, revoked): the first WRITE landed and must not be reported failed.
    #[test]
    fn a_landed_writes_status_leaves_before_the_next_body_and_survives_its_failure() {
        let m = mem(1 << 20);
        let t0 = Instant::now();
        let mut stream = hdr(Opcode::Write, m.addr(0), 4, true);
        stream.extend_from_slice(b"abcd");
        stream.extend(hdr(Opcode::Write, m.addr(4096), 512 << 10, true));
        stream.push(0x11);
        let mut c = ServeConn::new(STALL);
        assert_eq!(c.handle_bytes(&m.reg, &stream, t0), stream.len());
        assert_eq!(&m.buf[..4], b"abcd");
        assert!(
            c.must_send(),
            "the first WRITE's status leaves before the thread waits for the second body"
        );
        assert_eq!(c.transmit().out, encode_status(Status::Ok));
        // Not sent (the socket was full), and the second body stalls past its deadline.
        c.handle_timeout(t0 + Duration::from_secs(60));
        assert_eq!(
            c.closed(),
            None,
            "closing, with the first WRITE's status still to send"
        );
        assert_eq!(
            c.holding(),
            0,
            "the second request's range is let go at once"
        );
        assert_eq!(
            drain(&mut c, t0 + Duration::from_secs(60)),
            encode_status(Status::Ok)
        );
        assert_eq!(c.closed(), Some(&End::Overdue));
        // With nothing waiting it closes at once, as before.
        let mut c = ServeConn::new(STALL);
        c.handle_bytes(&m.reg, &hdr(Opcode::Write, m.addr(0), 8, true), t0);
        assert!(!c.must_send());
        c.handle_timeout(t0 + Duration::from_secs(60));
        assert_eq!(c.closed(), Some(&End::Overdue));
    }

    #[test]
    fn a_large_read_is_sent_from_memory_and_blocks_input_until_sent() {
        let m = mem(1 << 20);
        let mut c = ServeConn::new(STALL);
        let now = Instant::now();
        let mut stream = hdr(Opcode::Read, m.addr(0), 1 << 20, true);
        stream.extend(hdr(Opcode::Read, m.addr(0), 1, true));
        assert_eq!(
            c.handle_bytes(&m.reg, &stream, now),
            HEADER_LEN,
            "the next header waits"
        );
        assert!(c.must_send());
        assert_eq!(c.holding(), m.addr(0));
        let t = c.transmit();
        assert_eq!(t.out, encode_status(Status::Ok));
        assert_eq!(t.body, &m.buf[..]);
        c.on_sent(STATUS_LEN + 1000, now);
        assert_eq!(
            c.transmit().body,
            &m.buf[1000..],
            "resumes where the socket stopped"
        );
        c.on_sent((1 << 20) - 1000, now);
        assert!(c.idle() && c.holding() == 0);
        assert_eq!(
            c.handle_bytes(&m.reg, &stream[HEADER_LEN..], now),
            HEADER_LEN
        );
    }

    #[test]
    fn outside_registered_memory_is_rejected_and_nothing_is_touched() {
        let m = mem(4096);
        let now = Instant::now();
        // v2: REJECTED, then closed; the body that follows is not taken.
        let mut c = ServeConn::new(STALL);
        let mut stream = hdr(Opcode::Write, m.addr(4000), 200, true);
        stream.extend(vec![0xEE; 200]);
        assert_eq!(c.handle_bytes(&m.reg, &stream, now), HEADER_LEN);
        assert_eq!(drain(&mut c, now), encode_status(Status::Rejected));
        assert_eq!(c.closed(), Some(&End::Rejected));
        assert!(m.buf[4000..]
            .iter()
            .enumerate()
            .all(|(i, b)| *b == ((4000 + i) % 251) as u8));
        // v1: nothing to answer with; closed at once.
        let mut c = ServeConn::new(STALL);
        c.handle_bytes(&m.reg, &hdr(Opcode::Read, 0x10, 8, false), now);
        assert_eq!(c.closed(), Some(&End::Rejected));
        assert!(c.transmit().out.is_empty());
        // Garbage.
        let mut c = ServeConn::new(STALL);
        c.handle_bytes(&m.reg, &[0xFF; HEADER_LEN], now);
        assert!(matches!(c.closed(), Some(End::BadHeader(_))));
    }

    /// One byte every 50 ms never lets a socket timeout fire; the request still ends at its
    /// deadline (stall + 1 ns per byte), and nothing after that lands.
    #[test]
    fn a_trickled_body_is_dropped_at_its_deadline() {
        let m = mem(4096);
        let mut c = ServeConn::new(STALL);
        let t0 = Instant::now();
        c.handle_bytes(&m.reg, &hdr(Opcode::Write, m.addr(0), 4096, true), t0);
        assert_eq!(
            c.poll_timeout(),
            Some(t0 + STALL + Duration::from_nanos(4096))
        );
        let mut now = t0;
        let mut fed = 0;
        while c.closed().is_none() {
            now += Duration::from_millis(50);
            fed += c.handle_bytes(&m.reg, &[0xAB], now);
            c.handle_timeout(now);
            assert!(fed < 4096);
        }
        assert_eq!(c.closed(), Some(&End::Overdue));
        assert_eq!(fed, 21, "the byte at 1.05 s was the last taken");
        assert_eq!(
            c.handle_bytes(&m.reg, &[0xAB; 10], now),
            0,
            "nothing lands after"
        );
        assert_eq!(m.buf[fed], (fed % 251) as u8);
        assert_eq!(c.holding(), 0, "the guard went with the request");
    }

    #[test]
    fn a_trickled_header_is_dropped_an_idle_connection_is_not() {
        let m = mem(64);
        let mut c = ServeConn::new(STALL);
        let t0 = Instant::now();
        c.handle_timeout(t0 + Duration::from_secs(3600));
        assert!(
            c.closed().is_none() && c.poll_timeout().is_none(),
            "idle for an hour is fine"
        );
        let h = hdr(Opcode::Write, m.addr(0), 8, true);
        let start = t0 + Duration::from_secs(3600);
        for (i, b) in h[..3].iter().enumerate() {
            c.handle_bytes(
                &m.reg,
                std::slice::from_ref(b),
                start + Duration::from_millis(300 * i as u64),
            );
        }
        assert!(c.closed().is_none());
        assert_eq!(
            c.poll_timeout(),
            Some(start + STALL),
            "a begun header has a deadline"
        );
        c.handle_timeout(start + Duration::from_millis(1100));
        assert_eq!(
            c.closed(),
            Some(&End::Overdue),
            "3 bytes, then nothing for 0.5 s: overdue 1 s after the first"
        );
    }

    #[test]
    fn a_revoked_range_is_never_touched_again() {
        let m = mem(8192);
        let now = Instant::now();
        // Mid WRITE body: unregister (another thread) revokes, then waits for the guard.
        let mut c = ServeConn::new(STALL);
        c.handle_bytes(&m.reg, &hdr(Opcode::Write, m.addr(0), 100, true), now);
        c.handle_bytes(&m.reg, &[1; 10], now);
        std::thread::scope(|s| {
            let unregister = s.spawn(|| m.reg.unregister_batch(&[m.addr(0)]).map(drop));
            let t = Instant::now();
            while c.body().is_some() {
                assert!(
                    t.elapsed() < Duration::from_secs(10),
                    "revocation never seen"
                );
                std::thread::yield_now();
            }
            unregister
                .join()
                .expect("unregister thread")
                .expect("unregister");
        });
        assert_eq!(c.closed(), Some(&End::Revoked));
        assert_eq!(c.handle_bytes(&m.reg, &[2; 90], now), 0);
        assert_eq!(&m.buf[..10], &[1; 10]);
        assert_eq!(m.buf[10], 10, "byte 10 untouched");
    }

    fn key(c: char) -> Arc<crate::auth::ClusterKey> {
        Arc::new(
            crate::auth::ClusterKey::parse(
                c.to_string().repeat(64).as_bytes(),
                std::path::Path::new("k"),
            )
            .expect("a key"),
        )
    }

    /// A target known as "t" holding key `c`.
    fn keyed(c: char) -> Arc<Keyed> {
        Arc::new(Keyed {
            key: key(c),
            names: vec!["t".into()],
        })
    }

    /// The initiator's side (`rules::AuthOpen`), dialing `segment`, run against a target's
    /// machine, the bytes fed `chunk` at a time: the session, or how the target refused.
    fn handshake(
        c: &mut ServeConn,
        m: &Mem,
        initiator: &crate::auth::ClusterKey,
        segment: &str,
        chunk: usize,
        now: Instant,
    ) -> Result<(Sealer, Opener), crate::batch::Failure> {
        let open = super::super::rules::AuthOpen::new(initiator, segment, Protect::Headers, "t")?;
        for part in open.hello().chunks(chunk) {
            c.handle_bytes(&m.reg, part, now);
        }
        let answer = drain(c, now);
        open.on_answer(answer[..STATUS_LEN].try_into().unwrap(), "t")?;
        open.finish(&answer[STATUS_LEN..], "t")
    }

    /// A request header sealed under `seal`.
    fn sealed_hdr(seal: &mut Sealer, op: Opcode, addr: u64, size: u64) -> Vec<u8> {
        let mut out = Vec::new();
        seal.seal(&hdr(op, addr, size, true), &mut out);
        out
    }

    /// A status frame opened under `open`.
    fn opened(open: &mut Opener, sealed: &[u8]) -> Status {
        let mut p = [0u8; 64];
        let n = open.open(sealed, &mut p).expect("opens");
        tcp::decode_status(p[..n].try_into().unwrap()).unwrap()
    }

    /// With a cluster key, nothing is read or written for a connection until its handshake is
    /// done and a sealed header opened: a request first is refused (`Unauthorized` when it
    /// asked for status frames) and touches nothing; a handshake under another key, or for
    /// another segment's name, is refused; the right one, however it trickles, lets sealed
    /// requests through; a plain or altered header after it closes the connection untouched;
    /// a connection that does not prove itself within `stall` of its start is closed.
    #[test]
    fn a_target_holding_a_key_serves_nothing_before_the_initiator_proved_it() {
        let mut m = mem(4096);
        let t0 = Instant::now();
        let data = vec![0xAB; 64];
        // A WRITE with no handshake: refused, nothing lands.
        for v2 in [true, false] {
            let mut c = ServeConn::with_key(STALL, keyed('a'), Protect::Headers, t0);
            let mut bytes = hdr(Opcode::Write, m.addr(0), 64, v2);
            bytes.extend_from_slice(&data);
            c.handle_bytes(&m.reg, &bytes, t0);
            let sent = drain(&mut c, t0);
            assert_eq!(
                sent,
                if v2 {
                    encode_status(Status::Unauthorized).to_vec()
                } else {
                    vec![]
                }
            );
            assert!(
                matches!(c.closed(), Some(End::Unauthorized(why)) if why.contains("KVFERRY_AUTH_KEY_FILE")),
                "{:?}",
                c.closed()
            );
            assert_eq!(&m.buf[..64], &mem(64).buf[..], "nothing written");
        }
        // A READ with no handshake: nothing of the memory leaves.
        let mut c = ServeConn::with_key(STALL, keyed('a'), Protect::Headers, t0);
        c.handle_bytes(&m.reg, &hdr(Opcode::Read, m.addr(0), 64, true), t0);
        assert_eq!(
            drain(&mut c, t0),
            encode_status(Status::Unauthorized).to_vec()
        );
        // Another key, another segment's name, an opening frame announcing more than a
        // handshake's size: refused at once.
        let mut c = ServeConn::with_key(STALL, keyed('a'), Protect::Headers, t0);
        let e = handshake(&mut c, &m, &key('b'), "t", 7, t0).expect_err("another key");
        assert_eq!(e.cause, crate::batch::FailCause::Unauthorized);
        assert!(
            matches!(c.closed(), Some(End::Unauthorized(why)) if why.contains("another key")),
            "{:?}",
            c.closed()
        );
        let mut c = ServeConn::with_key(STALL, keyed('a'), Protect::Headers, t0);
        handshake(&mut c, &m, &key('a'), "other-segment", 7, t0).expect_err("misdirected");
        assert!(
            matches!(c.closed(), Some(End::Unauthorized(why)) if why.contains("other-segment")),
            "{:?}",
            c.closed()
        );
        let mut c = ServeConn::with_key(STALL, keyed('a'), Protect::Headers, t0);
        c.handle_bytes(&m.reg, &tcp::encode_auth_hello(1 << 40, 0), t0);
        assert_eq!(
            drain(&mut c, t0),
            encode_status(Status::Unauthorized).to_vec()
        );
        assert!(matches!(c.closed(), Some(End::Unauthorized(_))));
        // The key, a byte at a time: then a sealed WRITE lands and is answered sealed; a plain
        // header, or a sealed one altered or replayed, closes the connection untouched.
        for bad in ["plain", "altered", "replayed"] {
            let mut c = ServeConn::with_key(STALL, keyed('a'), Protect::Headers, t0);
            let (mut seal, mut open) =
                handshake(&mut c, &m, &key('a'), "/t", 1, t0).expect("the same key");
            assert!(!c.proved(), "not before a sealed header opened");
            let h = sealed_hdr(&mut seal, Opcode::Write, m.addr(0), 64);
            let mut bytes = h.clone();
            bytes.extend_from_slice(&data);
            assert_eq!(c.handle_bytes(&m.reg, &bytes, t0), bytes.len());
            assert!(c.proved());
            assert_eq!(opened(&mut open, &drain(&mut c, t0)), Status::Ok);
            assert_eq!(&m.buf[..64], &data[..]);
            m.buf[..64].copy_from_slice(&mem(64).buf);
            let next = match bad {
                "plain" => hdr(Opcode::Write, m.addr(0), 64, true),
                "altered" => {
                    let mut x = sealed_hdr(&mut seal, Opcode::Write, m.addr(0), 64);
                    x[9] ^= 0x40;
                    x
                }
                _ => h,
            };
            let mut bytes = next;
            bytes.resize(SEALED_HEADER_LEN, 0);
            bytes.extend_from_slice(&data);
            c.handle_bytes(&m.reg, &bytes, t0);
            assert!(drain(&mut c, t0).is_empty(), "{bad}: nothing answered");
            assert!(
                matches!(c.closed(), Some(End::Unauthorized(why)) if why.contains("does not open")),
                "{bad}: {:?}",
                c.closed()
            );
            assert_eq!(&m.buf[..64], &mem(64).buf[..], "{bad}: nothing written");
        }
        // A handshake begun and not finished within `stall` of the connection's start.
        let mut c = ServeConn::with_key(STALL, keyed('a'), Protect::Headers, t0);
        assert_eq!(c.poll_timeout(), Some(t0 + STALL));
        c.handle_bytes(&m.reg, &tcp::encode_auth_hello(80, 0)[..10], t0);
        c.handle_timeout(t0 + STALL);
        assert_eq!(c.closed(), Some(&End::Overdue));
        // Nor may an idle unproved connection wait, before or after the handshake: it holds
        // one of the server's threads and a place among the unproved.
        let mut c = ServeConn::with_key(STALL, keyed('a'), Protect::Headers, t0);
        c.handle_timeout(t0 + STALL);
        assert_eq!(c.closed(), Some(&End::Overdue));
        let mut c = ServeConn::with_key(STALL, keyed('a'), Protect::Headers, t0);
        let _session = handshake(&mut c, &m, &key('a'), "t", 64, t0).expect("handshake");
        assert_eq!(c.poll_timeout(), Some(t0 + STALL), "the proof is still due");
        c.handle_timeout(t0 + STALL);
        assert_eq!(c.closed(), Some(&End::Overdue));
    }

    /// The initiator's side of a handshake asking for `protect`, against a target requiring at
    /// least `least`: the session, or the target's refusal.
    fn protected_handshake(
        c: &mut ServeConn,
        m: &Mem,
        protect: Protect,
        now: Instant,
    ) -> Result<(Sealer, Opener), crate::batch::Failure> {
        let open = super::super::rules::AuthOpen::new(&key('a'), "t", protect, "t")?;
        c.handle_bytes(&m.reg, open.hello(), now);
        let answer = drain(c, now);
        open.on_answer(answer[..STATUS_LEN].try_into().unwrap(), "t")?;
        open.finish(&answer[STATUS_LEN..], "t")
    }

    /// With the bytes moved protected (`payload`, `encrypt`): a WRITE of several chunks,
    /// however cut, lands and is answered; one byte of it altered on the way (in a chunk, or in
    /// its digest) leaves the request unanswered and the connection closed; a READ of several
    /// chunks leaves protected and the initiator's machine takes it back byte for byte, and
    /// refuses it altered. A target requiring more than the initiator asks refuses it.
    #[test]
    fn protected_bodies_land_and_leave_whole_and_altered_ones_are_refused() {
        let t0 = Instant::now();
        let len = 3 * CHUNK + 100;
        for protect in [Protect::Payload, Protect::Encrypt] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
            for cut in [1000usize, 65536, usize::MAX] {
                let m = mem(len);
                let mut c = ServeConn::with_key(STALL, keyed('a'), Protect::Headers, t0);
                let (mut seal, mut open) =
                    protected_handshake(&mut c, &m, protect, t0).expect("handshake");
                let mut wire = sealed_hdr(&mut seal, Opcode::Write, m.addr(0), len as u64);
                super::super::rules::seal_body(protect, &mut seal, &data, &mut wire);
                assert_eq!(
                    wire.len() as u64,
                    SEALED_HEADER_LEN as u64
                        + super::super::rules::body_wire_len(protect, len as u64)
                );
                if protect == Protect::Encrypt {
                    assert!(
                        !wire.windows(64).any(|w| w == &data[..64]),
                        "the bytes do not travel in the clear"
                    );
                }
                for piece in wire.chunks(cut.min(wire.len())) {
                    let mut piece = piece;
                    while !piece.is_empty() {
                        let n = c.handle_bytes(&m.reg, piece, t0);
                        piece = &piece[n..];
                        if n == 0 {
                            // Straight into place, as the connection thread does.
                            let dst = c.body().expect("a body expected");
                            let k = dst.len().min(piece.len());
                            dst[..k].copy_from_slice(&piece[..k]);
                            c.on_body(k, t0);
                            piece = &piece[k..];
                        }
                    }
                }
                assert_eq!(
                    opened(&mut open, &drain(&mut c, t0)),
                    Status::Ok,
                    "{protect:?}, pieces of {cut}"
                );
                assert_eq!(&m.buf[..len], &data[..], "{protect:?}, pieces of {cut}");
            }
            // Altered on the way: the last chunk's first byte, and the first chunk's last byte
            // of tail (digest or tag).
            for at in [
                SEALED_HEADER_LEN + 3 * (CHUNK + super::super::rules::chunk_overhead(protect)),
                SEALED_HEADER_LEN + CHUNK + super::super::rules::chunk_overhead(protect) - 1,
            ] {
                let m = mem(len);
                let mut c = ServeConn::with_key(STALL, keyed('a'), Protect::Headers, t0);
                let (mut seal, _) =
                    protected_handshake(&mut c, &m, protect, t0).expect("handshake");
                let mut wire = sealed_hdr(&mut seal, Opcode::Write, m.addr(0), len as u64);
                super::super::rules::seal_body(protect, &mut seal, &data, &mut wire);
                wire[at] ^= 0x20;
                c.handle_bytes(&m.reg, &wire, t0);
                assert!(
                    drain(&mut c, t0).is_empty(),
                    "{protect:?} altered at {at}: not answered"
                );
                assert!(
                    matches!(c.closed(), Some(End::Unauthorized(why)) if why.contains("does not open")),
                    "{protect:?}: {:?}",
                    c.closed()
                );
            }
            // A READ of several chunks, and a small one, read back through the initiator's
            // machine.
            for rlen in [len, 100] {
                let m = mem(len);
                let mut c = ServeConn::with_key(STALL, keyed('a'), Protect::Headers, t0);
                let (mut seal, mut open) =
                    protected_handshake(&mut c, &m, protect, t0).expect("handshake");
                c.handle_bytes(
                    &m.reg,
                    &sealed_hdr(&mut seal, Opcode::Read, m.addr(0), rlen as u64),
                    t0,
                );
                let wire = drain_all(&mut c, t0);
                assert_eq!(
                    wire.len() as u64,
                    tcp::SEALED_STATUS_LEN as u64
                        + super::super::rules::body_wire_len(protect, rlen as u64)
                );
                let mut local = vec![0u8; rlen];
                let mut a = super::super::rules::Answer::protected(
                    Opcode::Read,
                    rlen as u64,
                    true,
                    Some(protect),
                );
                let mut pos = 0;
                while !a.done() {
                    let end = (pos + 777).min(wire.len());
                    pos += a
                        .handle_bytes(&wire[pos..end], &mut local, Some(&mut open))
                        .expect("opens");
                }
                assert_eq!(pos, wire.len());
                assert_eq!(&local[..], &m.buf[..rlen], "{protect:?}: the READ back");
                // Altered: refused by the initiator's machine.
                let mut c = ServeConn::with_key(STALL, keyed('a'), Protect::Headers, t0);
                let (mut seal, mut open) =
                    protected_handshake(&mut c, &m, protect, t0).expect("handshake");
                c.handle_bytes(
                    &m.reg,
                    &sealed_hdr(&mut seal, Opcode::Read, m.addr(0), rlen as u64),
                    t0,
                );
                let mut wire = drain_all(&mut c, t0);
                let last = wire.len() - 1;
                wire[last] ^= 1;
                let mut a = super::super::rules::Answer::protected(
                    Opcode::Read,
                    rlen as u64,
                    true,
                    Some(protect),
                );
                assert_eq!(
                    a.handle_bytes(&wire[..tcp::SEALED_STATUS_LEN], &mut local, Some(&mut open)),
                    Ok(tcp::SEALED_STATUS_LEN)
                );
                let mut r = Ok(0);
                let mut pos = tcp::SEALED_STATUS_LEN;
                while r.is_ok() && pos < wire.len() {
                    r = a.handle_bytes(&wire[pos..], &mut local, Some(&mut open));
                    pos += *r.as_ref().unwrap_or(&0);
                }
                assert_eq!(
                    r,
                    Err(crate::wire::WireError::Unsealed),
                    "{protect:?}: an altered READ answer"
                );
                assert!(!a.done());
            }
        }
        // Less than the target requires: refused, saying what to set.
        let m = mem(64);
        let mut c = ServeConn::with_key(STALL, keyed('a'), Protect::Encrypt, t0);
        assert!(protected_handshake(&mut c, &m, Protect::Payload, t0).is_err());
        assert!(
            matches!(c.closed(), Some(End::Unauthorized(why)) if why.contains("KVFERRY_AUTH_PROTECT=payload") && why.contains("encrypt")),
            "{:?}",
            c.closed()
        );
        let mut c = ServeConn::with_key(STALL, keyed('a'), Protect::Payload, t0);
        assert!(
            protected_handshake(&mut c, &m, Protect::Encrypt, t0).is_ok(),
            "more than required is served"
        );
    }

    /// A target without a key answers an initiator holding one `Unauthorized` (the initiator
    /// then says the target holds none), rather than taking its opening frame for a request.
    #[test]
    fn a_target_without_a_key_tells_an_initiator_holding_one_so() {
        let m = mem(64);
        let t0 = Instant::now();
        let mut c = ServeConn::new(STALL);
        let e = handshake(&mut c, &m, &key('a'), "t", 40, t0).expect_err("no key there");
        assert_eq!(e.cause, crate::batch::FailCause::Unauthorized);
        assert!(e.reason.contains("holds no key"), "{}", e.reason);
        assert!(matches!(c.closed(), Some(End::Unauthorized(_))));
    }
}
