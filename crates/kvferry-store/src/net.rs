//! Socket helpers the store's network drivers share: the master's RPC connections
//! (`crate::server`) and HA replication's links (`crate::ha::sync`). Accept errors backed off,
//! TCP keepalive, reads bounded by a deadline, the cap on connections that did not prove the
//! cluster key yet, the bounded poll for a connection's next frame, and the one for a
//! client's answer ([`poll_read`]). Knows no request,
//! no state and no journal: it sits below every driver, and imports none of them.

use std::io::Read;
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Polls the socket without blocking for at most `budget`, filling `buf` as far as data is
/// there. A bounded poll: on a machine whose idle cores wake slowly it halves the round trip
/// of a lone small request, and it never runs longer than `budget`. (The engine's TCP lanes
/// have the same poll for their own connections.)
pub(crate) fn poll_read(s: &TcpStream, buf: &mut [u8], budget: Duration) -> usize {
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

/// The connections of a port that did not prove the cluster key yet, counted in all and per
/// source address, each bounded (`kvferry::auth::Unproved`): what a flood without the key can
/// hold is at most `total` connections, their threads and fixed buffers (a few hundred bytes
/// each), each for at most its deadline. Refusals are logged, a line a second at most.
pub(crate) struct Unproved {
    what: &'static str,
    total: usize,
    per_ip: usize,
    /// How long a connection has to prove the key (for the log line).
    deadline: Duration,
    places: Arc<kvferry::auth::Unproved>,
    /// Refused since the last log line, and when that was (one line a second at most).
    refused: std::sync::Mutex<(u64, Option<Instant>)>,
}

/// One [`Unproved`] place, given back when dropped.
pub(crate) type UnprovedSlot = kvferry::auth::Pass;

impl Unproved {
    pub(crate) fn new(
        what: &'static str,
        total: usize,
        per_ip: usize,
        deadline: Duration,
    ) -> Arc<Unproved> {
        Arc::new(Unproved {
            what,
            total,
            per_ip,
            deadline,
            places: kvferry::auth::Unproved::new(total, per_ip),
            refused: Default::default(),
        })
    }

    /// A place for a connection from `ip`, or `None` (then logged, a line a second at most)
    /// when `total` are held or `per_ip` from that address.
    pub(crate) fn admit(self: &Arc<Self>, ip: std::net::IpAddr) -> Option<UnprovedSlot> {
        if let Some(p) = self.places.admit(ip) {
            return Some(p);
        }
        let mut r = self.refused.lock().unwrap_or_else(|e| e.into_inner());
        r.0 += 1;
        if r.1.is_none_or(|at| at.elapsed() >= Duration::from_secs(1)) {
            tracing::warn!(
                "{}: closed {} connection(s) at accept, the last from {ip}: {} connections at most may be proving the cluster key at once ({} from one address), each for {:?} at most; a flood without the key, or more clients connecting at once than that",
                self.what, r.0, self.total, self.per_ip, self.deadline
            );
            *r = (0, Some(Instant::now()));
        }
        None
    }

    /// A place for a new connection `conn` of a port holding the cluster key (`keyed`);
    /// `Err` when there is none (close it); `Ok(None)` without a key (nothing to prove).
    pub(crate) fn place(
        self: &Arc<Self>,
        keyed: bool,
        conn: &TcpStream,
    ) -> Result<Option<UnprovedSlot>, ()> {
        if !keyed {
            return Ok(None);
        }
        let ip = conn.peer_addr().map_err(|_| ())?.ip();
        self.admit(ip).map(Some).ok_or(())
    }

    /// How many places are held (in all, from `ip`).
    #[cfg(test)]
    pub(crate) fn held(&self, ip: std::net::IpAddr) -> (usize, usize) {
        self.places.counted(ip)
    }
}

/// Reads `buf` whole from `s` by `deadline` (however the bytes trickle in).
pub(crate) fn read_by(mut s: &TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the cluster key was not proved in time",
            ));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
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
    pub(crate) bound: Duration,
    pub(crate) polling: AtomicUsize,
    pub(crate) limit: usize,
}

impl Spin {
    pub(crate) fn new(bound: Duration) -> Spin {
        Spin::for_cpus(bound, cpus())
    }

    pub(crate) fn for_cpus(bound: Duration, cpus: usize) -> Spin {
        Spin {
            bound: if cpus < 2 { Duration::ZERO } else { bound },
            polling: AtomicUsize::new(0),
            limit: cpus / 2,
        }
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

    pub(crate) fn for_replication_on(cpus: usize) -> Spin {
        Spin {
            bound: if cpus < 4 {
                Duration::ZERO
            } else {
                REPLICATION_POLL
            },
            polling: AtomicUsize::new(0),
            limit: cpus / 4,
        }
    }

    /// Polls `s` until it has bytes to read or is closed, within the bound and if fewer than
    /// the limit poll already; whether it has (false: the caller's blocking read sleeps in the
    /// kernel). Reads nothing.
    pub(crate) fn readable(&self, s: &TcpStream) -> bool {
        use rustix::net::{recv, RecvFlags};
        let Some(_slot) = self.slot() else {
            return false;
        };
        let start = Instant::now();
        let mut byte = [0u8; 1];
        loop {
            match recv(s, &mut byte, RecvFlags::DONTWAIT | RecvFlags::PEEK) {
                Ok(_) => return true, // (0: closed, which the read then finds)
                Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR)
                    if start.elapsed() < self.bound =>
                {
                    std::hint::spin_loop()
                }
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
    pub(crate) fn poll(&self, s: &TcpStream, prefix: &mut [u8; 4]) -> std::io::Result<usize> {
        use rustix::net::{recv, RecvFlags};
        let Some(_slot) = self.slot() else {
            return Ok(0);
        };
        let mut got = 0usize;
        let start = Instant::now();
        loop {
            if got == 4 || start.elapsed() >= self.bound {
                return Ok(got);
            }
            match recv(s, &mut prefix[got..], RecvFlags::DONTWAIT) {
                Ok((0, _)) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok((n, _)) => got += n,
                Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => {
                    std::hint::spin_loop()
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}
