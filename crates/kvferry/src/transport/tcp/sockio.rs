//! Socket I/O shared by the server and the lanes: loops that ask a `stop` check after every
//! system call, socket options, and a receive buffer.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Socket timeout used to wake blocked threads so they can check deadlines.
pub(super) const TICK: Duration = Duration::from_millis(100);
/// Buffered read size for headers, status frames and small bodies.
pub(super) const RX_BUF: usize = 64 << 10;
pub(super) const MAX_OPS_PER_WRITE: usize = 256;
/// Bodies at least this large are received straight into place, not through the buffer.
pub(super) const DIRECT_MIN: usize = 32 << 10;
/// READ answers up to this size are copied into the outgoing buffer.
pub(super) const SMALL_READ: usize = 16 << 10;
/// Flush the outgoing buffer before it grows past this.
pub(super) const MAX_OUT: usize = 512 << 10;
pub(super) const MAX_GATHER_BYTES: u64 = 1 << 20;

pub(super) fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// The error of an I/O loop whose `stop` check fired: its deadline passed, the memory it
/// moves was unregistered, or the engine is shutting down.
pub(super) fn stopped(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        format!("stopped while {what}: deadline passed, memory withdrawn or shutting down"),
    )
}

/// One read into `buf`: how many bytes came, 0 when the socket's timeout passed or the call
/// was interrupted (the caller then asks its `stop` check). The end of the stream is an error.
pub(super) fn read_some(s: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    match (&*s).read(buf) {
        Ok(0) if !buf.is_empty() => Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed by peer",
        )),
        Ok(n) => Ok(n),
        Err(e) if e.kind() == io::ErrorKind::Interrupted || is_timeout(&e) => Ok(0),
        Err(e) => Err(e),
    }
}

/// Sends every byte of `bufs`, asking `stop` after every system call, so a peer that reads
/// slowly cannot hold the caller past its deadline.
pub(super) fn write_all_vectored(
    s: &TcpStream,
    mut bufs: &mut [IoSlice<'_>],
    mut stop: impl FnMut(u64) -> bool,
) -> io::Result<()> {
    let mut written = 0u64;
    while !bufs.is_empty() {
        match (&*s).write_vectored(bufs) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "connection closed",
                ))
            }
            Ok(n) => {
                IoSlice::advance_slices(&mut bufs, n);
                written += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted || is_timeout(&e) => {}
            Err(e) => return Err(e),
        }
        // (`stop` is told how many bytes this call wrote so far.)
        if !bufs.is_empty() && stop(written) {
            return Err(stopped("sending"));
        }
    }
    Ok(())
}

/// Keepalive probes and a user timeout on a data connection, so a peer whose host vanished
/// (no FIN, no RST) is noticed: an idle connection after about
/// `KEEPALIVE_IDLE + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL`, one with unacknowledged data
/// after `USER_TIMEOUT`.
pub(super) fn keepalive(s: &TcpStream) {
    let sock = socket2::SockRef::from(s);
    let ka = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_COUNT);
    if let Err(e) = sock.set_tcp_keepalive(&ka) {
        tracing::debug!("TCP keepalive not set: {e}");
    }
    if let Err(e) = sock.set_tcp_user_timeout(Some(USER_TIMEOUT)) {
        tracing::debug!("TCP_USER_TIMEOUT not set: {e}");
    }
}

pub(super) const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
pub(super) const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
pub(super) const KEEPALIVE_COUNT: u32 = 5;
pub(super) const USER_TIMEOUT: Duration = Duration::from_secs(20);

/// Only requests up to this size poll for their answer (larger ones take longer anyway).
pub(super) const SPIN_MAX_BYTES: u64 = 64 << 10;

/// Polls the socket without blocking for at most `budget`, filling `buf` as far as data is
/// there. A bounded poll: on a machine whose idle cores wake slowly it halves the round trip
/// of a lone small request, and it never runs longer than `budget`.
pub(super) fn poll_read(s: &TcpStream, buf: &mut [u8], budget: Duration) -> usize {
    if budget.is_zero() {
        return 0;
    }
    let start = Instant::now();
    let mut got = 0;
    while got < buf.len() && start.elapsed() < budget {
        match rustix::net::recv(s, &mut buf[got..], rustix::net::RecvFlags::DONTWAIT) {
            Ok((0, _)) => break, // EOF: the blocking read reports it
            Ok((n, _)) => got += n,
            Err(_) => std::hint::spin_loop(),
        }
    }
    got
}

/// A byte buffer with a read cursor, refilled from a socket.
pub(super) struct RxBuf {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// Most bytes one fill may read: kept small when a large body is expected next, so the
    /// body goes straight to its destination instead of through this buffer.
    pub(super) max_fill: usize,
}

impl RxBuf {
    pub(super) fn new() -> Self {
        RxBuf {
            buf: vec![0u8; RX_BUF].into_boxed_slice(),
            start: 0,
            end: 0,
            max_fill: RX_BUF,
        }
    }
    pub(super) fn len(&self) -> usize {
        self.end - self.start
    }
    /// The buffered bytes.
    pub(super) fn data(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }
    /// Drops the first `n` buffered bytes (taken by the caller).
    pub(super) fn consume(&mut self, n: usize) {
        self.start = (self.start + n).min(self.end);
    }
    pub(super) fn clear(&mut self) {
        self.start = 0;
        self.end = 0;
    }
    /// Reads once (at least one byte or an error), compacting first.
    pub(super) fn fill(&mut self, s: &TcpStream) -> io::Result<usize> {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let stop = (self.end + self.max_fill).min(self.buf.len());
        match (&*s).read(&mut self.buf[self.end..stop]) {
            Ok(0) => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed by peer",
            )),
            Ok(n) => {
                self.end += n;
                Ok(n)
            }
            Err(e) => Err(e),
        }
    }
    /// Reads what is already waiting in the socket, without blocking. True if bytes came.
    pub(super) fn fill_nonblocking(&mut self, s: &TcpStream) -> bool {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let stop = (self.end + self.max_fill).min(self.buf.len());
        if stop == self.end {
            return false;
        }
        match rustix::net::recv(
            s,
            &mut self.buf[self.end..stop],
            rustix::net::RecvFlags::DONTWAIT,
        ) {
            Ok((n, _)) if n > 0 => {
                self.end += n;
                true
            }
            _ => false,
        }
    }

    /// Ensures `n` buffered bytes, asking `stop` after every system call, so a peer that
    /// trickles bytes cannot hold the caller past its deadline.
    pub(super) fn need(
        &mut self,
        s: &TcpStream,
        n: usize,
        mut stop: impl FnMut() -> bool,
    ) -> io::Result<()> {
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
}
