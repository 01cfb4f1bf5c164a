//! Target side: the data listener and one thread per connection.

use super::sockio::*;
use super::target_conn::{End, ServeConn};
use crate::auth::{Keyed, Protect, Unproved};
use crate::memory::MemoryRegistry;
use crate::sys::net::{listener_gone, out_of_resources};
use std::collections::HashMap;
use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

// ------------------------------------------------------------------------------------------
// Target side
// ------------------------------------------------------------------------------------------

/// Most data connections served at once (one thread each); more are closed at accept.
pub(super) const MAX_DATA_CONNS: usize = 1024;
/// With a cluster key: most connections served at once that have not proved it yet (each
/// holds a thread for at most `stall` before it must), and most of those from one source
/// address. A flood without the key holds at most these; proved connections are not
/// counted.
pub(super) const MAX_UNPROVED: usize = 128;
pub(super) const MAX_UNPROVED_PER_SOURCE: usize = 32;

/// A served connection: a handle to shut it down, and the start of the registered range
/// its thread holds a guard on (0: none).
struct ConnSlot {
    /// The serving thread's own stream (one descriptor per connection, which a revocation
    /// shuts down and a fork child's copy lets go of).
    stream: Arc<TcpStream>,
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

/// The data listener of the local segment.
pub(crate) struct TcpServer {
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
    pub(crate) fn start(
        listener: TcpListener,
        registry: Arc<MemoryRegistry>,
        stall: Duration,
        spin: Duration,
        auth: Option<(Arc<Keyed>, Protect)>,
    ) -> io::Result<TcpServer> {
        Self::start_capped(listener, registry, stall, spin, MAX_DATA_CONNS, auth)
    }

    /// [`TcpServer::start`] serving at most `max_conns` connections at once.
    fn start_capped(
        listener: TcpListener,
        registry: Arc<MemoryRegistry>,
        stall: Duration,
        spin: Duration,
        max_conns: usize,
        auth: Option<(Arc<Keyed>, Protect)>,
    ) -> io::Result<TcpServer> {
        let port = listener.local_addr()?.port();
        let listener = Arc::new(listener);
        let shutdown = Arc::new(AtomicBool::new(false));
        let conns: Conns = Arc::default();
        let weak = Arc::downgrade(&conns);
        registry.on_revoke(Box::new(move |r| {
            let Some(conns) = weak.upgrade() else { return };
            for slot in conns.lock().unwrap_or_else(|e| e.into_inner()).values() {
                if slot.holding.load(Ordering::SeqCst) == r.addr {
                    let _ = slot.stream.shutdown(Shutdown::Both);
                }
            }
        }));
        let (l, sd, cs) = (
            Arc::clone(&listener),
            Arc::clone(&shutdown),
            Arc::clone(&conns),
        );
        let accept = std::thread::Builder::new().name("kvf-tcp-accept".into()).spawn(move || {
            let mut next_id = 0u64;
            let mut warned = Instant::now() - Duration::from_secs(60);
            let unproved = Unproved::new(MAX_UNPROVED, MAX_UNPROVED_PER_SOURCE);
            loop {
                let (stream, from) = match l.accept() {
                    Ok(s) => s,
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
                if cs.lock().unwrap_or_else(|e| e.into_inner()).len() >= max_conns {
                    if warned.elapsed() > Duration::from_secs(10) {
                        warned = Instant::now();
                        tracing::warn!("TCP data listener: {max_conns} connections already served; closing a new one");
                    }
                    continue;
                }
                // With a key, a place among the unproved first (without one, Mooncake's
                // protocol has nothing to prove).
                let place = match auth.is_some().then(|| unproved.admit(from.ip())) {
                    Some(None) => {
                        if warned.elapsed() > Duration::from_secs(10) {
                            warned = Instant::now();
                            tracing::warn!("TCP data listener: {MAX_UNPROVED} connections have not proved the cluster key yet, or {MAX_UNPROVED_PER_SOURCE} from {}; closing a new one", from.ip());
                        }
                        continue;
                    }
                    Some(Some(p)) => Some(p),
                    None => None,
                };
                next_id += 1;
                let id = next_id;
                let holding = Arc::new(AtomicU64::new(0));
                let stream = Arc::new(stream);
                cs.lock().unwrap_or_else(|e| e.into_inner()).insert(id, ConnSlot { stream: Arc::clone(&stream), holding: Arc::clone(&holding) });
                let (reg, cs2, sd2, key) = (Arc::clone(&registry), Arc::clone(&cs), Arc::clone(&sd), auth.clone());
                let spawned = std::thread::Builder::new().name("kvf-tcp-serve".into()).spawn(move || {
                    let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                    if let Err(e) = serve_conn(&stream, &reg, stall, spin, &sd2, &holding, key, place) {
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
        Ok(TcpServer {
            port,
            listener,
            shutdown,
            conns,
            accept_thread: Mutex::new(Some(accept)),
        })
    }

    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// Connections being served now.
    pub(crate) fn connections(&self) -> usize {
        self.conns.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Stops accepting and shuts every connection down (their threads then end; the engine's
    /// unregister barrier waits for any that still hold a range).
    pub(crate) fn shutdown(&self) {
        self.shutdown.store(true, Ordering::Release);
        // Shutting down the listening socket makes the blocked accept() return.
        let _ = rustix::net::shutdown(&*self.listener, rustix::net::Shutdown::Both);
        for (_, c) in self.conns.lock().unwrap_or_else(|e| e.into_inner()).drain() {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        if let Some(t) = self
            .accept_thread
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = t.join();
        }
    }

    /// In a `fork()` child's copy: lets go of the parent's listening socket and of the
    /// connections it serves (those whose table is not locked), without shutting anything
    /// down for the parent (see `crate::forked`).
    pub(crate) fn release_inherited(&self) {
        use std::os::fd::AsFd;
        crate::forked::detach(self.listener.as_fd());
        if let Some(conns) = crate::forked::try_lock(&self.conns) {
            for c in conns.values() {
                crate::forked::detach(c.stream.as_fd());
            }
        }
    }
}

/// Moves the bytes of one connection for its [`ServeConn`]: what the machine says to send
/// leaves, what arrives is fed to it (a WRITE body straight into place), and after every
/// system call it is told the time, so its deadlines and revocation checks run however the
/// peer trickles. Blocking reads and writes time out after a second, which bounds how late a
/// passed deadline is seen when the peer sends nothing at all; an unregister shuts the
/// socket down (the revocation hook), which wakes a blocked call at once.
#[allow(clippy::too_many_arguments)]
fn serve_conn(
    s: &TcpStream,
    registry: &MemoryRegistry,
    stall: Duration,
    spin: Duration,
    shutdown: &AtomicBool,
    holding: &AtomicU64,
    auth: Option<(Arc<Keyed>, Protect)>,
    mut place: Option<crate::auth::Pass>,
) -> io::Result<()> {
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(1)))?;
    s.set_write_timeout(Some(Duration::from_secs(1)))?;
    keepalive(s);
    let mut rx = RxBuf::new();
    let mut c = match auth {
        Some((key, protect)) => ServeConn::with_key(stall, key, protect, Instant::now()),
        None => ServeConn::new(stall),
    };
    let _holding = Holding(holding);
    loop {
        let now = Instant::now();
        if rx.len() > 0 {
            let n = c.handle_bytes(registry, rx.data(), now);
            rx.consume(n);
            if place.is_some() && c.proved() {
                place = None;
            }
        }
        // Publish the range held before checking for its revocation: an unregister either
        // sees it (and shuts the socket down) or set the flag before this check.
        holding.store(c.holding(), Ordering::SeqCst);
        c.handle_timeout(now);
        if let Some(end) = c.closed() {
            return match end {
                End::Rejected | End::BadHeader(_) => {
                    tracing::debug!("closing TCP data connection: {end:?}");
                    Ok(())
                }
                End::Unauthorized(why) => {
                    let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                    tracing::warn!(%peer, "refused a TCP data connection: {why}");
                    Ok(())
                }
                End::Overdue => Err(stopped("serving a request (deadline passed)")),
                End::Revoked => Err(stopped("serving a request (memory unregistered)")),
                End::Device(why) => Err(io::Error::other(format!(
                    "serving a request in GPU memory: {why}"
                ))),
            };
        }
        if shutdown.load(Ordering::Acquire) {
            return Err(stopped("serving"));
        }
        if c.must_send() {
            send(s, &mut c, stall)?;
            continue;
        }
        // A WRITE body whose buffered part was taken: the rest straight into place.
        if let Some(dst) = c.body() {
            match (&*s).read(dst) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "connection closed by peer mid-body",
                    ))
                }
                Ok(n) => c.on_body(n, Instant::now()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted || is_timeout(&e) => {}
                Err(e) => return Err(e),
            }
            continue;
        }
        // Between requests (or mid-header): more bytes are needed. Take what is already
        // waiting; if nothing is, the gathered answers leave before this thread blocks.
        rx.max_fill = c.read_hint(RX_BUF);
        if rx.fill_nonblocking(s) {
            continue;
        }
        if !c.transmit().out.is_empty() {
            send(s, &mut c, stall)?;
        }
        // A peer that just got its answer often sends the next request at once: poll for it
        // briefly (bounded by KVFERRY_SPIN_US) before sleeping in the kernel.
        let poll_start = Instant::now();
        while rx.len() == 0 && poll_start.elapsed() < spin {
            if !rx.fill_nonblocking(s) {
                std::hint::spin_loop();
            }
        }
        if rx.len() == 0 {
            match rx.fill(s) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted || is_timeout(&e) => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// Sends what `c` has to send, telling it after every system call what left and the time.
/// Answers gathered between requests must leave within `stall`; a READ answer by its
/// request's deadline (the machine ends the connection then).
fn send(s: &TcpStream, c: &mut ServeConn, stall: Duration) -> io::Result<()> {
    let until = Instant::now() + stall;
    loop {
        let t = c.transmit();
        if t.out.is_empty() && t.body.is_empty() {
            return Ok(());
        }
        let n = match (&*s).write_vectored(&[IoSlice::new(t.out), IoSlice::new(t.body)]) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "connection closed",
                ))
            }
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted || is_timeout(&e) => 0,
            Err(e) => return Err(e),
        };
        let now = Instant::now();
        c.on_sent(n, now);
        c.handle_timeout(now);
        if c.closed().is_some() {
            return Ok(()); // the caller reports why
        }
        if c.poll_timeout().is_none() && now >= until {
            return Err(stopped("sending answers the peer does not read"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::tcp::{encode_status, DataHeader, Opcode, Status};

    fn server(cap: usize) -> (TcpServer, Arc<MemoryRegistry>, Vec<u8>) {
        let buf = vec![7u8; 4096];
        let reg = Arc::new(MemoryRegistry::new());
        reg.register_batch(&[(buf.as_ptr() as u64, 4096)], "*")
            .unwrap();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let s = TcpServer::start_capped(
            l,
            Arc::clone(&reg),
            Duration::from_secs(5),
            Duration::ZERO,
            cap,
            None,
        )
        .unwrap();
        (s, reg, buf)
    }

    /// A v2 READ of 8 bytes on `c`; true if it was answered.
    fn served(c: &mut TcpStream, addr: u64) -> bool {
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let h = DataHeader {
            size: 8,
            addr,
            opcode: Opcode::Read,
            v2: true,
        }
        .encode();
        if c.write_all(&h).is_err() {
            return false;
        }
        let mut a = [0u8; 16];
        c.read_exact(&mut a).is_ok() && a[..8] == encode_status(Status::Ok) && a[8..] == [7; 8]
    }

    use crate::testing::wait_for;

    /// Past the cap a new connection is closed at accept (its request unanswered), the ones
    /// served are not disturbed, and a slot freed by a departed peer is taken again.
    #[test]
    fn connections_past_the_cap_are_closed_and_freed_slots_are_reused() {
        let (srv, _reg, buf) = server(4);
        let addr = buf.as_ptr() as u64;
        let target = ("127.0.0.1", srv.port());
        let mut held: Vec<TcpStream> = (0..4)
            .map(|_| TcpStream::connect(target).unwrap())
            .collect();
        for c in &mut held {
            assert!(served(c, addr));
        }
        assert_eq!(srv.connections(), 4);
        let mut extra = TcpStream::connect(target).unwrap();
        assert!(
            !served(&mut extra, addr),
            "the fifth connection is closed, not served"
        );
        assert_eq!(srv.connections(), 4);
        for c in &mut held {
            assert!(served(c, addr), "the served ones go on");
        }
        drop(held.pop());
        wait_for("3 connections served", || srv.connections() == 3);
        let mut again = TcpStream::connect(target).unwrap();
        assert!(served(&mut again, addr), "a freed slot is taken again");
        srv.shutdown();
        assert_eq!(srv.connections(), 0);
    }

    /// Served connections get keepalive probes and a user timeout (a vanished host is
    /// noticed); the lanes call the same `keepalive`.
    #[test]
    fn data_connections_carry_keepalive_and_a_user_timeout() {
        let (srv, _reg, buf) = server(4);
        let mut c = TcpStream::connect(("127.0.0.1", srv.port())).unwrap();
        assert!(served(&mut c, buf.as_ptr() as u64));
        let conns = srv.conns.lock().unwrap();
        let served_side =
            socket2::SockRef::from(&conns.values().next().expect("one connection").stream);
        assert!(served_side.keepalive().unwrap());
        assert_eq!(served_side.tcp_keepalive_time().unwrap(), KEEPALIVE_IDLE);
        assert_eq!(
            served_side.tcp_keepalive_interval().unwrap(),
            KEEPALIVE_INTERVAL
        );
        assert_eq!(
            served_side.tcp_keepalive_retries().unwrap(),
            KEEPALIVE_COUNT
        );
        assert_eq!(served_side.tcp_user_timeout().unwrap(), Some(USER_TIMEOUT));
        drop(conns);
        srv.shutdown();
    }
}
