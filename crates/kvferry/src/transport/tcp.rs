//! TCP transport: Mooncake's TCP data protocol (v2 acknowledged framing, v1 for old peers).
//!
//! Target side ([`TcpServer`]): one thread per connection reads 24-byte headers, checks
//! `[addr, addr+size)` against the registry before touching memory, reads WRITE bodies
//! straight into the destination and answers with a status frame only after the last byte
//! landed; READ data goes out straight from registered memory. Small pipelined requests are
//! parsed from one buffered read and their status frames leave in one write.
//!
//! Initiator side ([`TcpTransport`]): per peer, `lanes` persistent connections. Each lane has
//! a writer thread (headers and bodies gathered into `writev`, requests pipelined) and a
//! reader thread (status frames matched in order, READ data received straight into local
//! memory). Requests larger than the split size are cut across lanes. Nothing spins: threads
//! block in the kernel or on condition variables, with a short socket timeout so deadlines
//! are enforced. A request is COMPLETED only when the target's status frame says its bytes
//! landed; towards a v1 peer each WRITE is followed by a 1-byte READ fence on the same
//! connection, whose answer proves the preceding body was consumed into memory.

use super::{Peer, Piece, Transport};
use crate::batch::{FailCause, FailKind, Failure};
use crate::memory::MemoryRegistry;
use crate::wire::descriptor::SegmentDesc;
use crate::wire::tcp::{self, DataHeader, Opcode, Status, HEADER_LEN, STATUS_LEN};
use std::collections::{HashMap, VecDeque};
use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Asked when a peer's data port refuses a connection (peer name, refused address, the
/// pieces that were to go there): the engine may re-read the peer's descriptor (a peer
/// restarted under the same name publishes new ports) and submit them again. Returns the
/// pieces it did not take; those fail with the connect error.
pub type RefusedHook = Arc<dyn Fn(&str, SocketAddr, Vec<Piece>) -> Vec<Piece> + Send + Sync>;

/// Socket timeout used to wake blocked threads so they can check deadlines.
const TICK: Duration = Duration::from_millis(100);
/// Buffered read size for headers, status frames and small bodies.
const RX_BUF: usize = 64 << 10;
const MAX_OPS_PER_WRITE: usize = 256;
/// Bodies at least this large are received straight into place, not through the buffer.
const DIRECT_MIN: usize = 32 << 10;
/// READ answers up to this size are copied into the outgoing buffer.
const SMALL_READ: usize = 16 << 10;
/// Flush the outgoing buffer before it grows past this.
const MAX_OUT: usize = 512 << 10;
const MAX_GATHER_BYTES: u64 = 1 << 20;

fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// The error of an I/O loop whose `stop` check fired: its deadline passed, the memory it
/// moves was unregistered, or the engine is shutting down.
fn stopped(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, format!("stopped while {what}: deadline passed, memory withdrawn or shutting down"))
}

/// Fills `buf` from `s`. `stop` is asked after every system call (a read that returned
/// bytes as much as one that timed out), so a peer that trickles bytes cannot hold the
/// caller past its deadline: the socket timeout bounds each call, `stop` bounds the whole.
fn read_full(s: &TcpStream, buf: &mut [u8], mut stop: impl FnMut() -> bool) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        match (&*s).read(&mut buf[got..]) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed by peer")),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted || is_timeout(&e) => {}
            Err(e) => return Err(e),
        }
        if got < buf.len() && stop() {
            return Err(stopped("receiving"));
        }
    }
    Ok(())
}

/// Sends every byte of `bufs`, asking `stop` after every system call (see [`read_full`]).
fn write_all_vectored(s: &TcpStream, mut bufs: &mut [IoSlice<'_>], mut stop: impl FnMut() -> bool) -> io::Result<()> {
    while !bufs.is_empty() {
        match (&*s).write_vectored(bufs) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "connection closed")),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted || is_timeout(&e) => {}
            Err(e) => return Err(e),
        }
        if !bufs.is_empty() && stop() {
            return Err(stopped("sending"));
        }
    }
    Ok(())
}

/// Keepalive probes and a user timeout on a data connection, so a peer whose host vanished
/// (no FIN, no RST) is noticed: an idle connection after about
/// `KEEPALIVE_IDLE + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL`, one with unacknowledged data
/// after `USER_TIMEOUT`.
fn keepalive(s: &TcpStream) {
    let sock = socket2::SockRef::from(s);
    let ka = socket2::TcpKeepalive::new().with_time(KEEPALIVE_IDLE).with_interval(KEEPALIVE_INTERVAL).with_retries(KEEPALIVE_COUNT);
    if let Err(e) = sock.set_tcp_keepalive(&ka) {
        tracing::debug!("TCP keepalive not set: {e}");
    }
    if let Err(e) = sock.set_tcp_user_timeout(Some(USER_TIMEOUT)) {
        tracing::debug!("TCP_USER_TIMEOUT not set: {e}");
    }
}

const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
const KEEPALIVE_COUNT: u32 = 5;
const USER_TIMEOUT: Duration = Duration::from_secs(20);

/// Only requests up to this size poll for their answer (larger ones take longer anyway).
const SPIN_MAX_BYTES: u64 = 64 << 10;

/// Polls the socket without blocking for at most `budget`, filling `buf` as far as data is
/// there. A bounded poll: on a machine whose idle cores wake slowly it halves the round trip
/// of a lone small request, and it never runs longer than `budget`.
fn poll_read(s: &TcpStream, buf: &mut [u8], budget: Duration) -> usize {
    if budget.is_zero() {
        return 0;
    }
    let start = Instant::now();
    let mut got = 0;
    while got < buf.len() && start.elapsed() < budget {
        // SAFETY: recv into the unfilled tail of `buf` on a socket we own.
        let n = unsafe { libc::recv(s.as_raw_fd(), buf[got..].as_mut_ptr() as *mut libc::c_void, buf.len() - got, libc::MSG_DONTWAIT) };
        if n > 0 {
            got += n as usize;
        } else if n == 0 {
            break; // EOF: the blocking read reports it
        } else {
            std::hint::spin_loop();
        }
    }
    got
}

/// A byte buffer with a read cursor, refilled from a socket.
struct RxBuf {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// Most bytes one fill may read: kept small when a large body is expected next, so the
    /// body goes straight to its destination instead of through this buffer.
    max_fill: usize,
}

impl RxBuf {
    fn new() -> Self {
        RxBuf { buf: vec![0u8; RX_BUF].into_boxed_slice(), start: 0, end: 0, max_fill: RX_BUF }
    }
    fn len(&self) -> usize {
        self.end - self.start
    }
    fn clear(&mut self) {
        self.start = 0;
        self.end = 0;
    }
    /// Reads once (at least one byte or an error), compacting first.
    fn fill(&mut self, s: &TcpStream) -> io::Result<usize> {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let stop = (self.end + self.max_fill).min(self.buf.len());
        match (&*s).read(&mut self.buf[self.end..stop]) {
            Ok(0) => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed by peer")),
            Ok(n) => {
                self.end += n;
                Ok(n)
            }
            Err(e) => Err(e),
        }
    }
    /// Reads what is already waiting in the socket, without blocking. True if bytes came.
    fn fill_nonblocking(&mut self, s: &TcpStream) -> bool {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let stop = (self.end + self.max_fill).min(self.buf.len());
        if stop == self.end {
            return false;
        }
        // SAFETY: recv into the free tail of our buffer.
        let n = unsafe { libc::recv(s.as_raw_fd(), self.buf[self.end..stop].as_mut_ptr() as *mut libc::c_void, stop - self.end, libc::MSG_DONTWAIT) };
        if n > 0 {
            self.end += n as usize;
            true
        } else {
            false
        }
    }

    /// Ensures `n` buffered bytes, asking `stop` after every system call (see [`read_full`]).
    fn need(&mut self, s: &TcpStream, n: usize, mut stop: impl FnMut() -> bool) -> io::Result<()> {
        while self.len() < n {
            match self.fill(s) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted || is_timeout(&e) => {}
                Err(e) => return Err(e),
            }
            if self.len() < n && stop() {
                return Err(stopped("receiving"));
            }
        }
        Ok(())
    }
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        out.copy_from_slice(&self.buf[self.start..self.start + N]);
        self.start += N;
        out
    }
    /// Moves buffered bytes into `dst` (up to its length); returns how many.
    fn drain_into(&mut self, dst: &mut [u8]) -> usize {
        let n = dst.len().min(self.len());
        dst[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        n
    }
}

/// Reads `dst.len()` bytes: first what is buffered, then straight from the socket.
fn recv_into(rx: &mut RxBuf, s: &TcpStream, dst: &mut [u8], expired: impl FnMut() -> bool) -> io::Result<()> {
    let n = rx.drain_into(dst);
    read_full(s, &mut dst[n..], expired)
}

// ------------------------------------------------------------------------------------------
// Target side
// ------------------------------------------------------------------------------------------

/// Most data connections served at once (one thread each); more are closed at accept.
pub const MAX_DATA_CONNS: usize = 1024;

/// A served connection: a handle to shut it down, and the start of the registered range
/// its thread holds a guard on (0: none).
struct ConnSlot {
    stream: TcpStream,
    holding: Arc<AtomicU64>,
}

type Conns = Arc<Mutex<HashMap<u64, ConnSlot>>>;

/// Clears a connection's `holding` mark when the request's guard goes.
struct Holding<'a>(&'a AtomicU64);

impl Drop for Holding<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::Release);
    }
}

/// Whether an `accept` error means the listener itself is gone (shut down, closed).
fn listener_gone(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EINVAL | libc::EBADF | libc::ENOTSOCK))
}

/// Whether an `accept` error means resources ran out (back off instead of spinning).
fn out_of_resources(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM))
}

/// The data listener of the local segment.
pub struct TcpServer {
    port: u16,
    listener: Arc<TcpListener>,
    shutdown: Arc<AtomicBool>,
    conns: Conns,
    accept_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl TcpServer {
    /// Serves `listener` until [`TcpServer::shutdown`]. `stall` bounds how long a request may
    /// take (plus 1 ns per byte, as the initiator's deadline) before the connection is
    /// dropped. A revoked range (unregister) shuts down the connections holding it.
    pub fn start(listener: TcpListener, registry: Arc<MemoryRegistry>, stall: Duration, spin: Duration) -> io::Result<TcpServer> {
        let port = listener.local_addr()?.port();
        let listener = Arc::new(listener);
        let shutdown = Arc::new(AtomicBool::new(false));
        let conns: Conns = Arc::default();
        let weak = Arc::downgrade(&conns);
        registry.on_revoke(Box::new(move |r| {
            let Some(conns) = weak.upgrade() else { return };
            for slot in conns.lock().unwrap_or_else(|e| e.into_inner()).values() {
                if slot.holding.load(Ordering::Acquire) == r.addr {
                    let _ = slot.stream.shutdown(Shutdown::Both);
                }
            }
        }));
        let (l, sd, cs) = (Arc::clone(&listener), Arc::clone(&shutdown), Arc::clone(&conns));
        let accept = std::thread::Builder::new().name("kvf-tcp-accept".into()).spawn(move || {
            let mut next_id = 0u64;
            let mut warned = Instant::now() - Duration::from_secs(60);
            loop {
                let stream = match l.accept() {
                    Ok((s, _)) => s,
                    Err(_) if sd.load(Ordering::Acquire) => break,
                    Err(e) if listener_gone(&e) => {
                        tracing::error!("TCP data listener on port {port} stopped accepting ({e}); was it shut down by another process?");
                        break;
                    }
                    Err(e) => {
                        if warned.elapsed() > Duration::from_secs(10) {
                            warned = Instant::now();
                            tracing::warn!("TCP data listener: accept failed: {e}");
                        }
                        // Out of descriptors or memory: back off instead of spinning.
                        std::thread::sleep(if out_of_resources(&e) { Duration::from_millis(100) } else { Duration::from_millis(1) });
                        continue;
                    }
                };
                if sd.load(Ordering::Acquire) {
                    break;
                }
                if cs.lock().unwrap_or_else(|e| e.into_inner()).len() >= MAX_DATA_CONNS {
                    if warned.elapsed() > Duration::from_secs(10) {
                        warned = Instant::now();
                        tracing::warn!("TCP data listener: {MAX_DATA_CONNS} connections already served; closing a new one");
                    }
                    continue;
                }
                next_id += 1;
                let id = next_id;
                let holding = Arc::new(AtomicU64::new(0));
                match stream.try_clone() {
                    Ok(c) => {
                        cs.lock().unwrap_or_else(|e| e.into_inner()).insert(id, ConnSlot { stream: c, holding: Arc::clone(&holding) });
                    }
                    Err(e) => {
                        tracing::warn!("TCP data listener: cannot track a new connection ({e}); closing it");
                        continue;
                    }
                }
                let (reg, cs2, sd2) = (Arc::clone(&registry), Arc::clone(&cs), Arc::clone(&sd));
                let spawned = std::thread::Builder::new().name("kvf-tcp-serve".into()).spawn(move || {
                    let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                    if let Err(e) = serve_conn(&stream, &reg, stall, spin, &sd2, &holding) {
                        if e.kind() != io::ErrorKind::UnexpectedEof {
                            tracing::debug!(%peer, "tcp data connection closed: {e}");
                        }
                    }
                    let _ = stream.shutdown(Shutdown::Both);
                    cs2.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
                });
                if spawned.is_err() {
                    cs.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
                }
            }
        })?;
        Ok(TcpServer { port, listener, shutdown, conns, accept_thread: Mutex::new(Some(accept)) })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Connections being served now.
    pub fn connections(&self) -> usize {
        self.conns.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Stops accepting and shuts every connection down (their threads then end; the engine's
    /// unregister barrier waits for any that still hold a range).
    pub fn shutdown(&self) {
        self.shutdown.store(true, Ordering::Release);
        // Shutting down the listening socket makes the blocked accept() return.
        let _ = rustix::net::shutdown(&*self.listener, rustix::net::Shutdown::Both);
        for (_, c) in self.conns.lock().unwrap_or_else(|e| e.into_inner()).drain() {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        if let Some(t) = self.accept_thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

fn serve_conn(
    s: &TcpStream,
    registry: &MemoryRegistry,
    stall: Duration,
    spin: Duration,
    shutdown: &AtomicBool,
    holding: &AtomicU64,
) -> io::Result<()> {
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(1)))?;
    s.set_write_timeout(Some(Duration::from_secs(1)))?;
    keepalive(s);
    let mut rx = RxBuf::new();
    let mut out: Vec<u8> = Vec::with_capacity(4096);
    loop {
        // Wait for the next header; flush acknowledgements before blocking, unless more
        // requests are already waiting (their answers then leave together).
        if rx.len() < HEADER_LEN && out.len() < MAX_OUT && rx.fill_nonblocking(s) && rx.len() >= HEADER_LEN {
            // Another request is here: keep going, the flush can wait for it.
        }
        if rx.len() < HEADER_LEN {
            if !out.is_empty() {
                let until = Instant::now() + stall;
                write_all_vectored(s, &mut [IoSlice::new(&out)], || Instant::now() >= until || shutdown.load(Ordering::Acquire))?;
                out.clear();
            }
            // A peer that just got its answer often sends the next request at once: poll for
            // it briefly (bounded by KVFERRY_SPIN_US) before sleeping in the kernel.
            let poll_start = Instant::now();
            while rx.len() < HEADER_LEN && poll_start.elapsed() < spin {
                if !rx.fill_nonblocking(s) {
                    std::hint::spin_loop();
                }
            }
            // An idle connection may wait for its next header as long as it likes; once a
            // header has begun, the rest must come within `stall`.
            let mut started: Option<Instant> = (rx.len() > 0).then(Instant::now);
            while rx.len() < HEADER_LEN {
                match rx.fill(s) {
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted || is_timeout(&e) => {}
                    Err(e) => return Err(e),
                }
                if shutdown.load(Ordering::Acquire) {
                    return Err(stopped("waiting for a request"));
                }
                if rx.len() > 0 && rx.len() < HEADER_LEN && started.get_or_insert_with(Instant::now).elapsed() > stall {
                    return Err(stopped("receiving a request header"));
                }
            }
        }
        let h = match DataHeader::decode(&rx.take::<HEADER_LEN>()) {
            Ok(h) => h,
            Err(e) => {
                tracing::debug!("closing TCP data connection: {e}");
                return Ok(());
            }
        };
        let guard = if h.size > 0 { registry.check(h.addr, h.size) } else { None };
        let Some(guard) = guard else {
            tracing::debug!(addr = h.addr, size = h.size, "rejecting TCP request outside registered memory");
            if h.v2 {
                out.extend_from_slice(&tcp::encode_status(Status::Rejected));
                let until = Instant::now() + stall;
                write_all_vectored(s, &mut [IoSlice::new(&out)], || Instant::now() >= until || shutdown.load(Ordering::Acquire))?;
            }
            return Ok(());
        };
        holding.store(guard.region().addr, Ordering::Release);
        let _holding = Holding(holding);
        let len = h.size as usize;
        // The whole request must be done by then; checked after every system call, and
        // also stopped at once when the range is unregistered or the engine shuts down.
        let deadline = Instant::now() + stall + Duration::from_nanos(h.size);
        let stop = || Instant::now() >= deadline || shutdown.load(Ordering::Acquire) || guard.is_revoked();
        // A large body is likely followed by another: read the next header on its own.
        rx.max_fill = if h.opcode == Opcode::Write && len >= DIRECT_MIN { HEADER_LEN } else { RX_BUF };
        match h.opcode {
            Opcode::Write => {
                // SAFETY: the range lies inside registered memory and the guard keeps it
                // registered until we are done; a revoked guard stops the loop between
                // system calls, before the unregister barrier lets go.
                let dst = unsafe { std::slice::from_raw_parts_mut(h.addr as *mut u8, len) };
                recv_into(&mut rx, s, dst, stop)?;
                if h.v2 {
                    out.extend_from_slice(&tcp::encode_status(Status::Ok));
                }
            }
            Opcode::Read => {
                // SAFETY: as above; reading registered memory.
                let src = unsafe { std::slice::from_raw_parts(h.addr as *const u8, len) };
                if h.v2 {
                    out.extend_from_slice(&tcp::encode_status(Status::Ok));
                }
                if len <= SMALL_READ && out.len() + len <= MAX_OUT {
                    // Small answers are gathered and leave together before the next block.
                    out.extend_from_slice(src);
                    continue;
                }
                write_all_vectored(s, &mut [IoSlice::new(&out), IoSlice::new(src)], stop)?;
                out.clear();
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// Initiator side
// ------------------------------------------------------------------------------------------

/// Tuning of the initiator side.
#[derive(Debug, Clone)]
pub struct TcpOptions {
    pub lanes: usize,
    pub split_bytes: u64,
    /// Highest protocol version to use (a peer advertising less gets less).
    pub max_proto: u32,
    pub connect_timeout: Duration,
    /// Host published as `tcp_data_host`.
    pub advertised_host: String,
    /// Requests up to this size may run in the caller's thread when the lane is idle.
    pub inline_max: u64,
    /// How long the caller polls for the answer of a small inline request before sleeping.
    pub spin: Duration,
    /// A lane unused this long closes its connection and its threads end.
    pub idle: Duration,
}

/// One request (or part of one) on the wire.
struct WireOp {
    piece: Piece,
    /// Connection failures survived so far.
    attempts: u8,
}

struct LaneState {
    pending: VecDeque<WireOp>,
    inflight: VecDeque<WireOp>,
    conn: Option<Arc<TcpStream>>,
    /// Bumped at every new connection; stale failures of older ones are ignored.
    gen: u64,
    shutdown: bool,
    /// A caller thread is running a request on the connection itself.
    inline: bool,
    /// The reader holds an op it is still receiving.
    reading: bool,
    /// Idle too long: the connection is closed, the threads end; new work goes to new lanes.
    retired: bool,
    /// When work was last queued (or run inline) on this lane.
    last_used: Instant,
    /// When a request last went out on the connection.
    last_sent: Instant,
}

impl LaneState {
    fn new() -> LaneState {
        LaneState {
            pending: VecDeque::new(),
            inflight: VecDeque::new(),
            conn: None,
            gen: 0,
            shutdown: false,
            inline: false,
            reading: false,
            retired: false,
            last_used: Instant::now(),
            last_sent: Instant::now(),
        }
    }

    /// Nothing queued, in flight or running inline.
    fn idle(&self) -> bool {
        self.pending.is_empty() && self.inflight.is_empty() && !self.inline && !self.reading
    }

    /// Drops the connection if it has been quiet a while and the peer closed it meanwhile
    /// (it exited, or a new process took its port): requests then go on a new connection
    /// instead of failing on a dead one. Only called with nothing in flight, when no byte
    /// may be waiting on the socket.
    fn drop_if_closed_by_peer(&mut self) {
        if !self.inflight.is_empty() || self.last_sent.elapsed() < STALE_CHECK_AFTER {
            return;
        }
        let Some(c) = &self.conn else { return };
        let mut b = [0u8; 1];
        let closed = match rustix::net::recv(&**c, &mut b, rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT) {
            Err(rustix::io::Errno::AGAIN) => false,
            Err(rustix::io::Errno::INTR) => false,
            // EOF, a reset, or bytes nobody asked for: not a connection to send on.
            _ => true,
        };
        if closed {
            if let Some(c) = self.conn.take() {
                let _ = c.shutdown(Shutdown::Both);
            }
        }
    }
}

/// A connection quiet for this long is checked for a close by the peer before it is used.
const STALE_CHECK_AFTER: Duration = Duration::from_millis(1);

type PeerMap = Mutex<HashMap<(SocketAddr, bool), Arc<PeerLanes>>>;

struct Lane {
    target: SocketAddr,
    peer_name: String,
    v2: bool,
    connect_timeout: Duration,
    spin: Duration,
    st: Mutex<LaneState>,
    wake_writer: Condvar,
    wake_reader: Condvar,
    /// Bytes queued or in flight, for lane choice.
    load: AtomicU64,
    refused: Arc<OnceLock<RefusedHook>>,
    idle: Duration,
    /// The transport's map of peers, to leave it when idle (weak: no cycle).
    home: std::sync::Weak<PeerMap>,
    key: (SocketAddr, bool),
}

enum ConnFailure {
    /// The connection broke; unacknowledged ops may be retried once.
    Broken(String),
    /// A deadline passed.
    Deadline,
}

impl Lane {
    fn lock(&self) -> std::sync::MutexGuard<'_, LaneState> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn end_op(&self, op: WireOp, result: Result<(), (FailKind, Failure)>) {
        self.load.fetch_sub(op.piece.len, Ordering::AcqRel);
        match result {
            Ok(()) => op.piece.task.piece_done(op.piece.len),
            Err((kind, reason)) => op.piece.task.piece_failed(kind, reason),
        }
    }

    /// Closes connection `gen` and decides the fate of every op that was sent on it.
    fn fail_conn(&self, gen: u64, why: ConnFailure) {
        let mut ended = Vec::new();
        {
            let mut st = self.lock();
            if st.gen != gen || st.conn.is_none() {
                return;
            }
            if let Some(c) = st.conn.take() {
                let _ = c.shutdown(Shutdown::Both);
            }
            let now = Instant::now();
            let reason = match &why {
                ConnFailure::Broken(r) => r.clone(),
                ConnFailure::Deadline => "deadline passed".into(),
            };
            let inflight: Vec<WireOp> = st.inflight.drain(..).collect();
            for mut op in inflight.into_iter().rev() {
                match self.fate(&op, matches!(why, ConnFailure::Broken(_)), now, &reason) {
                    None => {
                        op.attempts += 1;
                        st.pending.push_front(op);
                    }
                    Some((kind, f)) => ended.push((op, kind, f)),
                }
            }
            self.wake_writer.notify_all();
        }
        for (op, kind, reason) in ended {
            self.end_op(op, Err((kind, reason)));
        }
    }

    /// What becomes of an op that was handed to a connection that then failed: `None` to
    /// retry it on a new connection, else how it ends.
    ///
    /// Only READs are retried (once): the old connection is ours alone to receive on, so a
    /// retry cannot race it. A WRITE that may have left is never sent again: the target's
    /// thread may still be copying the old connection's bytes into the range, and they
    /// could land after the retry's.
    fn fate(&self, op: &WireOp, broken: bool, now: Instant, reason: &str) -> Option<(FailKind, Failure)> {
        if op.piece.guard.is_revoked() {
            let why = format!("the local range 0x{:x} was unregistered while the request to {} was in flight", op.piece.local, self.peer_name);
            return Some((FailKind::Failed, FailCause::LocalNotRegistered.because(why)));
        }
        if op.piece.task.deadline() <= now {
            let why = format!("no answer from {} ({}) before the deadline", self.peer_name, self.target);
            return Some((FailKind::Timeout, FailCause::Timeout.because(why)));
        }
        if broken && op.attempts == 0 && op.piece.opcode == Opcode::Read {
            return None;
        }
        let tail = if op.piece.opcode == Opcode::Write { "; the WRITE may have partly landed and is not retried" } else { "" };
        Some((FailKind::Failed, FailCause::PeerLost.because(format!("connection to {} ({}) failed: {reason}{tail}", self.peer_name, self.target))))
    }

    /// Closes this lane and every other lane of its peer if all of them have been idle for
    /// `idle`: their threads end and the peer leaves the transport's map, so a departed
    /// peer costs nothing after that. Work submitted meanwhile sees `retired` and goes to
    /// new lanes.
    fn retire_if_idle(&self) {
        let Some(home) = self.home.upgrade() else { return };
        let mut peers = home.lock().unwrap_or_else(|e| e.into_inner());
        let Some(entry) = peers.get(&self.key).cloned() else { return };
        if !entry.lanes.iter().any(|l| std::ptr::eq(&**l, self)) {
            return;
        }
        // Lane locks in index order (nothing else holds two at once).
        let mut guards: Vec<_> = entry.lanes.iter().map(|l| l.lock()).collect();
        if !guards.iter().all(|g| g.idle() && !g.shutdown && g.last_used.elapsed() >= self.idle) {
            return;
        }
        for (g, l) in guards.iter_mut().zip(&entry.lanes) {
            g.retired = true;
            if let Some(c) = g.conn.take() {
                let _ = c.shutdown(Shutdown::Both);
            }
            l.wake_writer.notify_all();
            l.wake_reader.notify_all();
        }
        drop(guards);
        peers.remove(&self.key);
        tracing::debug!(peer = %self.peer_name, "TCP lanes idle for {:?}: closed", self.idle);
    }

    fn writer_loop(self: Arc<Self>) {
        let mut iov_hdrs: Vec<[u8; HEADER_LEN]> = Vec::with_capacity(MAX_OPS_PER_WRITE * 2);
        loop {
            let mut st = self.lock();
            while (st.pending.is_empty() || st.inline) && !st.shutdown && !st.retired {
                let (g, to) = self.wake_writer.wait_timeout(st, self.idle).unwrap_or_else(|e| e.into_inner());
                st = g;
                if to.timed_out() && st.idle() && st.last_used.elapsed() >= self.idle {
                    drop(st);
                    self.retire_if_idle();
                    st = self.lock();
                }
            }
            if st.retired && st.pending.is_empty() {
                return;
            }
            if st.shutdown {
                let ops: Vec<WireOp> = {
                    let s = &mut *st;
                    s.pending.drain(..).chain(s.inflight.drain(..)).collect()
                };
                drop(st);
                for op in ops {
                    self.end_op(op, Err((FailKind::Failed, FailCause::ShutDown.because("engine shut down"))));
                }
                return;
            }
            // Expire what can no longer make its deadline before sending it.
            let now = Instant::now();
            let mut expired = Vec::new();
            while st.pending.front().is_some_and(|op| op.piece.task.deadline() <= now) {
                if let Some(op) = st.pending.pop_front() {
                    expired.push(op);
                }
            }
            if !expired.is_empty() {
                drop(st);
                for op in expired {
                    self.end_op(op, Err((FailKind::Timeout, FailCause::Timeout.because(format!("not sent to {} before the deadline", self.peer_name)))));
                }
                continue;
            }
            st.drop_if_closed_by_peer();
            if st.conn.is_none() {
                drop(st);
                self.connect();
                continue;
            }
            let conn = Arc::clone(st.conn.as_ref().expect("checked"));
            st.last_sent = Instant::now();
            let gen = st.gen;
            // Gather a run of ops into one writev.
            let mut n = 0;
            let mut bytes = 0u64;
            let mut earliest = Instant::now() + Duration::from_secs(3600);
            let mut guards: Vec<crate::memory::RegionGuard> = Vec::new();
            if st.inflight.is_empty() {
                self.wake_reader.notify_one();
            }
            while let Some(op) = st.pending.pop_front() {
                bytes += op.piece.len;
                earliest = earliest.min(op.piece.task.deadline());
                op.piece.task.set_pending();
                st.inflight.push_back(op);
                n += 1;
                if n >= MAX_OPS_PER_WRITE || bytes >= MAX_GATHER_BYTES {
                    break;
                }
            }
            let first = st.inflight.len() - n;
            iov_hdrs.clear();
            let mut bodies: Vec<(u64, u64)> = Vec::with_capacity(n);
            for op in st.inflight.range(first..) {
                let p = &op.piece;
                if !guards.iter().any(|g| std::ptr::eq(g.region(), p.guard.region())) {
                    guards.push(p.guard.clone());
                }
                iov_hdrs.push(DataHeader { size: p.len, addr: p.remote, opcode: p.opcode, v2: self.v2 }.encode());
                if p.opcode == Opcode::Write {
                    bodies.push((p.local, p.len));
                    if !self.v2 {
                        // v1 fence: a 1-byte READ of the last byte written answers only after
                        // the target consumed the body into memory.
                        iov_hdrs.push(DataHeader { size: 1, addr: p.remote + p.len - 1, opcode: Opcode::Read, v2: false }.encode());
                    }
                } else {
                    bodies.push((0, 0));
                }
            }
            drop(st);
            // Build the iovec list: header, body (WRITE), [fence header].
            let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(n * 3);
            let mut h = 0;
            for &(addr, len) in &bodies {
                iov.push(IoSlice::new(&iov_hdrs[h]));
                h += 1;
                if len > 0 {
                    // SAFETY: local ranges were checked against the registry at submit and
                    // the piece's guard keeps them registered.
                    iov.push(IoSlice::new(unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) }));
                    if !self.v2 {
                        iov.push(IoSlice::new(&iov_hdrs[h]));
                        h += 1;
                    }
                }
            }
            let mut rest: &mut [IoSlice<'_>] = &mut iov;
            let result = loop {
                // writev takes at most IOV_MAX (1024) entries.
                let take = rest.len().min(1000);
                let (now_part, later) = std::mem::take(&mut rest).split_at_mut(take);
                let r = write_all_vectored(&conn, now_part, || Instant::now() >= earliest || guards.iter().any(|g| g.is_revoked()));
                if r.is_err() || later.is_empty() {
                    break r;
                }
                rest = later;
            };
            drop(guards);
            if let Err(e) = result {
                let why = if e.kind() == io::ErrorKind::TimedOut { ConnFailure::Deadline } else { ConnFailure::Broken(e.to_string()) };
                self.fail_conn(gen, why);
            }
        }
    }

    fn connect(&self) {
        let deadline = self.lock().pending.front().map(|op| op.piece.task.deadline());
        let timeout = deadline
            .map(|d| d.saturating_duration_since(Instant::now()))
            .unwrap_or(self.connect_timeout)
            .min(self.connect_timeout)
            .max(Duration::from_millis(1));
        let r = TcpStream::connect_timeout(&self.target, timeout).and_then(|s| {
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(TICK))?;
            s.set_write_timeout(Some(TICK))?;
            keepalive(&s);
            Ok(s)
        });
        match r {
            Ok(s) => {
                let mut st = self.lock();
                st.gen += 1;
                st.conn = Some(Arc::new(s));
                self.wake_reader.notify_all();
            }
            Err(e) => {
                let mut ops: Vec<WireOp> = self.lock().pending.drain(..).collect();
                if let (io::ErrorKind::ConnectionRefused, Some(hook)) = (e.kind(), self.refused.get()) {
                    // Maybe the peer restarted with new ports: let the engine refresh and retry once.
                    let (retry, keep): (Vec<WireOp>, Vec<WireOp>) = ops.into_iter().partition(|op| op.attempts < 2);
                    let pieces: Vec<Piece> = retry.into_iter().map(|op| {
                        self.load.fetch_sub(op.piece.len, Ordering::AcqRel);
                        op.piece
                    }).collect();
                    ops = keep;
                    for p in hook(&self.peer_name, self.target, pieces) {
                        self.load.fetch_add(p.len, Ordering::AcqRel);
                        ops.push(WireOp { piece: p, attempts: 2 });
                    }
                }
                let reason = format!(
                    "cannot connect to the TCP data port of {} at {}: {e} (is the peer alive and is its address reachable from here?)",
                    self.peer_name, self.target
                );
                let (kind, cause) =
                    if e.kind() == io::ErrorKind::TimedOut { (FailKind::Timeout, FailCause::Timeout) } else { (FailKind::Failed, FailCause::PeerUnreachable) };
                for op in ops {
                    self.end_op(op, Err((kind, cause.because(reason.clone()))));
                }
            }
        }
    }

    fn reader_loop(self: Arc<Self>) {
        let mut rx = RxBuf::new();
        let mut my_gen = 0;
        let mut fence = [0u8; 1];
        loop {
            let (conn, gen, deadline, opcode, local, len, guard) = {
                let mut st = self.lock();
                while (st.inflight.is_empty() || st.conn.is_none() || st.inline) && !st.shutdown && !st.retired {
                    st = self.wake_reader.wait(st).unwrap_or_else(|e| e.into_inner());
                }
                if st.shutdown || st.retired {
                    return;
                }
                let (Some(front), Some(conn)) = (st.inflight.front(), st.conn.as_ref()) else { continue };
                let p = &front.piece;
                (Arc::clone(conn), st.gen, p.task.deadline(), p.opcode, p.local, p.len, p.guard.clone())
            };
            if gen != my_gen {
                rx.clear();
                my_gen = gen;
            }
            let expired = || Instant::now() >= deadline || guard.is_revoked();
            // Large READ data goes straight into local memory: read only the status first.
            rx.max_fill = if opcode == Opcode::Read && len as usize >= DIRECT_MIN { STATUS_LEN } else { RX_BUF };
            // 1. Status frame (v2), before anything is taken off the queue.
            let status = if self.v2 {
                if let Err(e) = rx.need(&conn, STATUS_LEN, expired) {
                    self.fail_conn(gen, if e.kind() == io::ErrorKind::TimedOut { ConnFailure::Deadline } else { ConnFailure::Broken(e.to_string()) });
                    continue;
                }
                match tcp::decode_status(rx.take::<STATUS_LEN>()) {
                    Ok(s) => s,
                    Err(e) => {
                        // Not a protocol we can follow: fail the front op, drop the connection.
                        let op = self.pop_front(gen);
                        self.done_reading();
                        self.fail_conn(gen, ConnFailure::Broken(e.to_string()));
                        if let Some(op) = op {
                            self.end_op(op, Err((FailKind::Failed, FailCause::Protocol.because(format!("{}: {e}", self.peer_name)))));
                        }
                        continue;
                    }
                }
            } else {
                Status::Ok
            };
            // 2. The op is ours now.
            let Some(op) = self.pop_front(gen) else { continue };
            if status == Status::Rejected {
                self.done_reading();
                let reason = format!(
                    "{} rejected [0x{:x}, +{}): not inside memory it has registered",
                    self.peer_name, op.piece.remote, op.piece.len
                );
                self.end_op(op, Err((FailKind::Failed, FailCause::RemoteNotRegistered.because(reason))));
                // The target closes after a rejection; the others go again on a new connection.
                self.fail_conn(gen, ConnFailure::Broken("target closed the connection after rejecting a request".into()));
                continue;
            }
            // 3. Payload: READ data, or the v1 fence byte after a WRITE.
            let r = match (opcode, self.v2) {
                (Opcode::Read, _) => {
                    // SAFETY: the local range is registered (checked at submit, guard held).
                    let dst = unsafe { std::slice::from_raw_parts_mut(local as *mut u8, len as usize) };
                    recv_into(&mut rx, &conn, dst, expired)
                }
                (Opcode::Write, false) => recv_into(&mut rx, &conn, &mut fence, expired),
                (Opcode::Write, true) => Ok(()),
            };
            self.done_reading();
            match r {
                Ok(()) => self.end_op(op, Ok(())),
                Err(e) => {
                    let timed_out = e.kind() == io::ErrorKind::TimedOut;
                    // Put the op back at the head so fail_conn retries or ends it with the rest.
                    {
                        let mut st = self.lock();
                        if st.gen == gen && st.conn.is_some() {
                            st.inflight.push_front(op);
                        } else {
                            drop(st);
                            self.end_op(op, Err((FailKind::Failed, FailCause::PeerLost.because(format!("connection to {} lost: {e}", self.peer_name)))));
                            continue;
                        }
                    }
                    self.fail_conn(gen, if timed_out { ConnFailure::Deadline } else { ConnFailure::Broken(e.to_string()) });
                }
            }
        }
    }

    fn pop_front(&self, gen: u64) -> Option<WireOp> {
        let mut st = self.lock();
        if st.gen != gen {
            return None;
        }
        let op = st.inflight.pop_front();
        st.reading = op.is_some();
        op
    }

    fn done_reading(&self) {
        let mut st = self.lock();
        st.reading = false;
        if !st.pending.is_empty() {
            self.wake_writer.notify_all();
        }
    }

    /// Runs one request in the calling thread if the lane is connected and idle: no thread
    /// hand-off, so a lone small request costs one round trip. Gives the piece back otherwise.
    fn run_inline(&self, piece: Piece) -> Result<(), Piece> {
        let (conn, gen) = {
            let mut st = self.lock();
            let idle = st.idle() && !st.shutdown && !st.retired;
            if idle {
                st.drop_if_closed_by_peer();
            }
            match (&st.conn, idle) {
                (Some(c), true) => {
                    let c = Arc::clone(c);
                    st.inline = true;
                    st.last_used = Instant::now();
                    st.last_sent = st.last_used;
                    (c, st.gen)
                }
                _ => return Err(piece),
            }
        };
        self.load.fetch_add(piece.len, Ordering::AcqRel);
        piece.task.set_pending();
        let deadline = piece.task.deadline();
        let expired = || Instant::now() >= deadline || piece.guard.is_revoked();
        let p = &piece;
        let result: io::Result<Status> = (|| {
            let hdr = DataHeader { size: p.len, addr: p.remote, opcode: p.opcode, v2: self.v2 }.encode();
            let fence = DataHeader { size: 1, addr: p.remote + p.len - 1, opcode: Opcode::Read, v2: false }.encode();
            // SAFETY: the local range is registered (checked at submit, guard held).
            let local = unsafe { std::slice::from_raw_parts_mut(p.local as *mut u8, p.len as usize) };
            match (p.opcode, self.v2) {
                (Opcode::Write, true) => write_all_vectored(&conn, &mut [IoSlice::new(&hdr), IoSlice::new(local)], expired)?,
                (Opcode::Write, false) => write_all_vectored(&conn, &mut [IoSlice::new(&hdr), IoSlice::new(local), IoSlice::new(&fence)], expired)?,
                (Opcode::Read, _) => write_all_vectored(&conn, &mut [IoSlice::new(&hdr)], expired)?,
            }
            let status = if self.v2 {
                let mut st = [0u8; STATUS_LEN];
                let got = if p.len <= SPIN_MAX_BYTES { poll_read(&conn, &mut st, self.spin) } else { 0 };
                read_full(&conn, &mut st[got..], expired)?;
                tcp::decode_status(st).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?
            } else {
                Status::Ok
            };
            if status == Status::Ok {
                match p.opcode {
                    Opcode::Read => read_full(&conn, local, expired)?,
                    Opcode::Write if !self.v2 => read_full(&conn, &mut [0u8; 1], expired)?,
                    Opcode::Write => {}
                }
            }
            Ok(status)
        })();
        let op = WireOp { piece, attempts: 0 };
        let mut st = self.lock();
        st.inline = false;
        let outcome = match result {
            Ok(Status::Ok) => Ok(()),
            Ok(Status::Rejected) => {
                let reason = format!("{} rejected [0x{:x}, +{}): not inside memory it has registered", self.peer_name, op.piece.remote, op.piece.len);
                Err((FailKind::Failed, FailCause::RemoteNotRegistered.because(reason)))
            }
            Err(e) if e.kind() == io::ErrorKind::TimedOut => match self.fate(&op, false, Instant::now(), &e.to_string()) {
                Some(f) => Err(f),
                None => Err((FailKind::Timeout, FailCause::Timeout.because(format!("no answer from {} ({}) before the deadline", self.peer_name, self.target)))),
            },
            Err(e) if e.kind() == io::ErrorKind::InvalidData => Err((FailKind::Failed, FailCause::Protocol.because(format!("{}: {e}", self.peer_name)))),
            Err(e) if op.piece.opcode == Opcode::Write || op.piece.guard.is_revoked() => match self.fate(&op, true, Instant::now(), &e.to_string()) {
                Some(f) => Err(f),
                None => Err((FailKind::Failed, FailCause::PeerLost.because(format!("connection to {} lost: {e}", self.peer_name)))),
            },
            Err(e) => {
                // Broken connection: hand the READ to the lane threads for one retry.
                if st.gen == gen {
                    if let Some(c) = st.conn.take() {
                        let _ = c.shutdown(Shutdown::Both);
                    }
                }
                tracing::debug!("inline request to {} failed ({e}); retrying on a new connection", self.peer_name);
                let mut op = op;
                op.attempts = 1;
                st.pending.push_front(op);
                self.wake_writer.notify_all();
                self.wake_reader.notify_all();
                return Ok(());
            }
        };
        if outcome.is_err() && st.gen == gen {
            // After a rejection or a protocol error the stream is not usable.
            if let Some(c) = st.conn.take() {
                let _ = c.shutdown(Shutdown::Both);
            }
        }
        // Wake the lane threads only if work queued up meanwhile: a needless wake-up costs a
        // context switch on the core the peer needs.
        if !st.pending.is_empty() {
            self.wake_writer.notify_all();
        }
        drop(st);
        self.end_op(op, outcome);
        Ok(())
    }

    fn stop(&self) {
        let mut st = self.lock();
        st.shutdown = true;
        if let Some(c) = st.conn.take() {
            let _ = c.shutdown(Shutdown::Both);
        }
        self.wake_writer.notify_all();
        self.wake_reader.notify_all();
    }
}

struct PeerLanes {
    lanes: Vec<Arc<Lane>>,
    rr: AtomicUsize,
}

impl PeerLanes {
    fn pick(&self) -> usize {
        let start = self.rr.fetch_add(1, Ordering::Relaxed);
        let n = self.lanes.len();
        (0..n)
            .map(|i| (start + i) % n)
            .min_by_key(|&i| self.lanes[i].load.load(Ordering::Relaxed))
            .unwrap_or(0)
    }
}

/// The TCP transport of one engine: its data server and its lanes to peers.
pub struct TcpTransport {
    opts: TcpOptions,
    server: TcpServer,
    peers: Arc<PeerMap>,
    shut: AtomicBool,
    refused: Arc<OnceLock<RefusedHook>>,
}

impl TcpTransport {
    pub fn new(listener: TcpListener, registry: Arc<MemoryRegistry>, opts: TcpOptions, stall: Duration) -> io::Result<Arc<TcpTransport>> {
        let server = TcpServer::start(listener, registry, stall, opts.spin)?;
        Ok(Arc::new(TcpTransport { opts, server, peers: Arc::default(), shut: AtomicBool::new(false), refused: Arc::default() }))
    }

    /// Installs the hook asked when a peer's data port refuses connections (once).
    pub fn set_refused_hook(&self, hook: RefusedHook) {
        let _ = self.refused.set(hook);
    }

    /// The data address of `peer` according to `desc` (what lanes connect to).
    pub fn data_addr(peer: &Peer, desc: &SegmentDesc) -> Result<SocketAddr, String> {
        let host = desc.data_host(&peer.host);
        (host, desc.tcp_data_port)
            .to_socket_addrs()
            .map_err(|e| format!("cannot resolve {host}: {e}"))?
            .next()
            .ok_or_else(|| format!("{host} resolves to no address"))
    }

    pub fn data_port(&self) -> u16 {
        self.server.port()
    }

    /// Peers with open lanes, and connections the data server is serving (for tests and
    /// `kvferry doctor`: what departed peers still cost).
    pub fn usage(&self) -> (usize, usize) {
        (self.peers.lock().unwrap_or_else(|e| e.into_inner()).len(), self.server.connections())
    }

    fn lanes_for(&self, peer: &Peer, desc: &SegmentDesc) -> Result<Arc<PeerLanes>, String> {
        let host = desc.data_host(&peer.host);
        let addr = (host, desc.tcp_data_port)
            .to_socket_addrs()
            .map_err(|e| format!("cannot resolve {host}: {e}"))?
            .next()
            .ok_or_else(|| format!("{host} resolves to no address"))?;
        let v2 = desc.tcp_version() >= 2 && self.opts.max_proto >= 2;
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = peers.get(&(addr, v2)) {
            return Ok(Arc::clone(p));
        }
        let mut lanes = Vec::with_capacity(self.opts.lanes);
        for _ in 0..self.opts.lanes {
            let lane = Arc::new(Lane {
                target: addr,
                peer_name: peer.name.clone(),
                v2,
                connect_timeout: self.opts.connect_timeout,
                spin: self.opts.spin,
                st: Mutex::new(LaneState::new()),
                wake_writer: Condvar::new(),
                wake_reader: Condvar::new(),
                load: AtomicU64::new(0),
                refused: Arc::clone(&self.refused),
                idle: self.opts.idle,
                home: Arc::downgrade(&self.peers),
                key: (addr, v2),
            });
            let (w, r) = (Arc::clone(&lane), Arc::clone(&lane));
            std::thread::Builder::new().name("kvf-lane-tx".into()).spawn(move || w.writer_loop()).map_err(|e| e.to_string())?;
            std::thread::Builder::new().name("kvf-lane-rx".into()).spawn(move || r.reader_loop()).map_err(|e| e.to_string())?;
            lanes.push(lane);
        }
        let p = Arc::new(PeerLanes { lanes, rr: AtomicUsize::new(0) });
        peers.insert((addr, v2), Arc::clone(&p));
        Ok(p)
    }
}

impl TcpTransport {
    /// Runs a lone request in the caller's thread when a lane to the peer is connected and
    /// idle (see [`Lane::run_inline`]); otherwise queues it like [`Transport::submit`].
    pub fn submit_one(&self, peer: &Arc<Peer>, piece: Piece) {
        let mut piece = piece;
        if piece.len <= self.opts.inline_max && !self.shut.load(Ordering::Acquire) {
            if let Ok(lanes) = self.lanes_for(peer, &peer.desc()) {
                // The first connected idle lane: lone requests keep using the same connection,
                // whose server thread is then still polling for the next one.
                for i in 0..lanes.lanes.len() {
                    match lanes.lanes[i].run_inline(piece) {
                        Ok(()) => return,
                        Err(p) => piece = p,
                    }
                }
            }
        }
        self.submit(peer, vec![piece])
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn describe(&self, desc: &mut SegmentDesc) {
        desc.tcp_data_port = self.server.port();
        desc.tcp_data_host = Some(self.opts.advertised_host.clone());
        desc.tcp_proto_version = Some(2);
    }

    fn reachable(&self, peer: &Peer) -> Result<(), String> {
        let d = peer.desc();
        if d.tcp_data_port == 0 {
            return Err(format!("segment {} publishes no TCP data port (protocol {:?})", peer.name, d.protocol));
        }
        Ok(())
    }

    fn submit(&self, peer: &Arc<Peer>, pieces: Vec<Piece>) {
        let fail_all = |pieces: Vec<Piece>, f: Failure| {
            for p in pieces {
                p.task.piece_failed(FailKind::Failed, f.clone());
            }
        };
        if self.shut.load(Ordering::Acquire) {
            return fail_all(pieces, FailCause::ShutDown.because("engine shut down"));
        }
        let desc = peer.desc();
        let lanes = match self.lanes_for(peer, &desc) {
            Ok(l) => l,
            Err(e) => return fail_all(pieces, FailCause::PeerUnreachable.because(e)),
        };
        let n = lanes.lanes.len();
        let mut per_lane: Vec<Vec<WireOp>> = (0..n).map(|_| Vec::new()).collect();
        for p in pieces {
            let chunks = if p.len > self.opts.split_bytes && n > 1 {
                p.len.div_ceil(self.opts.split_bytes).min(64)
            } else {
                1
            };
            if chunks == 1 {
                let i = lanes.pick();
                lanes.lanes[i].load.fetch_add(p.len, Ordering::AcqRel);
                per_lane[i].push(WireOp { piece: p, attempts: 0 });
                continue;
            }
            // Cut into `chunks` pieces of about equal size, 4 KiB aligned.
            let step = p.len.div_ceil(chunks).next_multiple_of(4096);
            let count = p.len.div_ceil(step);
            p.task.split(count as u32);
            let mut off = 0;
            while off < p.len {
                let len = step.min(p.len - off);
                let i = lanes.pick();
                lanes.lanes[i].load.fetch_add(len, Ordering::AcqRel);
                per_lane[i].push(WireOp {
                    piece: Piece { opcode: p.opcode, local: p.local + off, remote: p.remote + off, len, task: Arc::clone(&p.task), guard: p.guard.clone() },
                    attempts: 0,
                });
                off += len;
            }
        }
        let mut retired: Vec<Piece> = Vec::new();
        for (i, ops) in per_lane.into_iter().enumerate() {
            if ops.is_empty() {
                continue;
            }
            let lane = &lanes.lanes[i];
            let mut st = lane.lock();
            if st.retired || st.shutdown {
                // Closed as idle since we picked it (or shutting down): new lanes take these.
                drop(st);
                for op in ops {
                    lane.load.fetch_sub(op.piece.len, Ordering::AcqRel);
                    retired.push(op.piece);
                }
                continue;
            }
            st.last_used = Instant::now();
            st.pending.extend(ops);
            lane.wake_writer.notify_one();
        }
        if !retired.is_empty() {
            // A part of a split piece counts as one piece; submitting it again (and maybe
            // splitting it again) keeps the task's piece count right.
            self.submit(peer, retired);
        }
    }

    fn shutdown(&self) {
        self.shut.store(true, Ordering::Release);
        self.server.shutdown();
        for (_, p) in self.peers.lock().unwrap_or_else(|e| e.into_inner()).drain() {
            for l in &p.lanes {
                l.stop();
            }
        }
    }
}
