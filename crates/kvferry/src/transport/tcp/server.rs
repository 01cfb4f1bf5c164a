//! Target side: the data listener and one thread per connection.

use super::proto::{admit, must_stop, Admission, HeaderClock};
use super::sockio::*;
use crate::memory::MemoryRegistry;
use crate::wire::tcp::{self, DataHeader, Opcode, Status, HEADER_LEN};
use std::collections::HashMap;
use std::io::{self, IoSlice};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
            let mut clock = HeaderClock::new(stall);
            let _ = clock.overdue(rx.len(), Instant::now());
            while rx.len() < HEADER_LEN {
                match rx.fill(s) {
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted || is_timeout(&e) => {}
                    Err(e) => return Err(e),
                }
                if shutdown.load(Ordering::Acquire) {
                    return Err(stopped("waiting for a request"));
                }
                if clock.overdue(rx.len(), Instant::now()) {
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
        let Admission::Serve { guard, deadline } = admit(&h, registry, stall, Instant::now()) else {
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
        // The whole request must be done by its deadline; checked after every system call,
        // and also stopped at once when the range is unregistered or the engine shuts down.
        let stop = || must_stop(Instant::now(), deadline, guard.is_revoked()) || shutdown.load(Ordering::Acquire);
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

