//! The master on the network: one thread per RPC connection, one ticker thread.
//!
//! With the cluster key (`Master::auth`), a connection is served only once it proved the key
//! (`prove`): until then it holds one of at most [`MAX_UNPROVED`] places
//! ([`MAX_UNPROVED_PER_IP`] per source address; more are closed at accept), for at most
//! [`PROOF_DEADLINE`], reads at most a handshake-sized first frame into a fixed buffer, and
//! nothing of it is decoded or served. After the proof every frame both ways is sealed.
//! Without a key nothing on the wire changes; a request frame then costs at most its length
//! and `proto::decode_bound` of it in heap while it is decoded.
//!
//! This module holds the listener, the ticker and the connection loop (reading frames,
//! writing answers, deferred ones included); `handlers` applies a request to the master and
//! `auth` runs the cluster key's proof. Nothing here decides what a request does.

mod auth;
mod handlers;

pub use auth::{MAX_UNPROVED, MAX_UNPROVED_PER_IP, PROOF_DEADLINE};
pub use handlers::handle;

use crate::net::{accepted, keepalive, Spin, Unproved, UnprovedSlot};
use crate::node::Master;
use crate::proto::{self, Response};
use auth::{gate, prove, Gate};
use handlers::{apply, confirm_durable, mutates, Applied, JOURNAL_WAIT, RIDE_WAIT};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
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
///
/// On a connection that proved the cluster key every answer is sealed under its session
/// ([`Busy::sealer`]) right before it is written, under the lock that orders the writes: its
/// sequence number is that of its place on the wire.
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
    /// Seals what goes out on a connection that proved the cluster key.
    sealer: Option<kvferry::auth::Sealer>,
}

impl Busy {
    /// `frame` ([`frame_of`]) as it goes on the wire: sealed without its plain length prefix
    /// when the connection is sealed, else as it is.
    fn wire(&mut self, frame: Vec<u8>) -> Vec<u8> {
        match &mut self.sealer {
            None => frame,
            Some(sealer) => {
                let mut out = Vec::new();
                sealer.seal_frame(crate::frame::body(&frame), &mut out);
                out
            }
        }
    }
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
    fn wait_idle(&self) -> std::sync::MutexGuard<'_, Busy> {
        let mut b = self.busy();
        while b.sending {
            b.waiting = true;
            b = self.idle.wait(b).unwrap_or_else(|e| e.into_inner());
            b.waiting = false;
        }
        b
    }

    /// The connection thread's answer as it goes on the wire (after the deferred one, if any,
    /// went out whole: [`Busy::wire`]).
    fn next(&self, frame: Vec<u8>) -> Vec<u8> {
        self.wait_idle().wire(frame)
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
        let frame = self.busy().wire(frame);
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

/// Whether `s` has something to read within `bound` (an error counts: the read reports it).
fn readable_within(s: &TcpStream, bound: Duration) -> bool {
    let mut fds = [rustix::event::PollFd::new(s, rustix::event::PollFlags::IN)];
    let timeout = rustix::event::Timespec {
        tv_sec: bound.as_secs() as i64,
        tv_nsec: bound.subsec_nanos() as _,
    };
    !matches!(rustix::event::poll(&mut fds, Some(&timeout)), Ok(0))
}

/// Serves one RPC connection until it ends. With the cluster key, it first proves the key
/// within [`PROOF_DEADLINE`] ([`prove`]), holding `unproved`'s place meanwhile; every frame
/// after is sealed.
fn serve_conn(
    m: &Arc<Master>,
    s: &TcpStream,
    spin: &Spin,
    unproved: Option<UnprovedSlot>,
) -> std::io::Result<()> {
    let deadline = Instant::now() + PROOF_DEADLINE;
    s.set_nodelay(true)?;
    let mut body = Vec::new();
    let (sealer, mut opener) = match &m.auth {
        Some(key) => {
            let (sealer, opener) = prove(
                key,
                &proto::master_identity(&m.cluster_id),
                s,
                deadline,
                &mut body,
            )?;
            (Some(sealer), Some(opener))
        }
        None => (None, None),
    };
    drop(unproved);
    // The first request came with the proof.
    let mut have = opener.is_some();
    // An answer written by this thread waits for a client that stops reading at most this long
    // (deferred answers are sent without blocking, within the same bound: `Outbox::send`).
    s.set_write_timeout(Some(SLOW_ANSWER))?;
    let out = Arc::new(Outbox {
        sock: s.try_clone()?,
        busy: std::sync::Mutex::new(Busy {
            sealer,
            ..Busy::default()
        }),
        idle: std::sync::Condvar::new(),
    });
    let mut head = [0u8; kvferry::auth::FRAME_HEAD_LEN];
    let mut sealed = Vec::new();
    let mut deferred = false;
    // An answer went out before its changes were collected ([`Applied::Early`]), at this time.
    let mut owed: Option<Instant> = None;
    loop {
        if let Some(at) = owed {
            let left = RIDE_WAIT.saturating_sub(at.elapsed());
            if left.is_zero() || !readable_within(s, left) {
                let _ = m.journal.collect(m);
                owed = None;
            }
        }
        if !have {
            // Not after an answer left for the journal: that client is still waiting for it.
            let prefix: &mut [u8; 4] = (&mut head[..4])
                .try_into()
                .unwrap_or_else(|_| unreachable!("a sealed frame's head is longer than 4 bytes"));
            let got = if deferred || owed.is_some() {
                0
            } else {
                spin.poll(s, prefix)?
            };
            (&*s).read_exact(&mut prefix[got..])?;
            match &mut opener {
                None => read_plain(s, *prefix, &mut body)?,
                Some(o) => read_sealed(s, o, &mut head, &mut sealed, &mut body)?,
            }
        }
        have = false;
        // The previous request's answer, if it waited for the journal, is out first.
        drop(out.wait_idle());
        let req = proto::decode_request(&body).map(|req| gate(m.auth.is_some(), req));
        let resp = match req {
            Ok(Gate::Refuse(resp)) => {
                (&*s).write_all(&out.next(frame_of(&resp)))?;
                return Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!("{resp:?}"),
                ));
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
                        Box::new(move |durable| {
                            match durable.and_then(|()| confirm_durable(&m2, term)) {
                                Ok(()) => out2.send(frame),
                                Err(e) => out2.send(frame_of(&Response::Err(e))),
                            }
                        }),
                    );
                    deferred = true;
                    continue;
                }
            },
            Err(e) => Response::Err(e),
        };
        deferred = false;
        (&*s).write_all(&out.next(frame_of(&resp)))?;
    }
}

/// Reads a plain frame's body (`prefix` its length) into `body`, growing as its bytes arrive.
fn read_plain(s: &TcpStream, prefix: [u8; 4], body: &mut Vec<u8>) -> std::io::Result<()> {
    let n = proto::decode_len(prefix)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
    body.clear();
    s.take(n as u64).read_to_end(body)?;
    if body.len() != n {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

/// Reads the rest of a sealed frame whose head's first 4 bytes are in `head`, and opens it
/// into `body` (`sealed` holds its sealed bytes, growing as they arrive). A frame that does
/// not open (injected, replayed, altered) or claims more than [`proto::MAX_FRAME`] ends the
/// connection.
fn read_sealed(
    s: &TcpStream,
    o: &mut kvferry::auth::Opener,
    head: &mut [u8; kvferry::auth::FRAME_HEAD_LEN],
    sealed: &mut Vec<u8>,
    body: &mut Vec<u8>,
) -> std::io::Result<()> {
    let denied = |r: kvferry::auth::Refusal| {
        std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("a frame of a connection that proved the cluster key: {r}"),
        )
    };
    (&*s).read_exact(&mut head[4..])?;
    let n = o.open_frame_head(head, proto::MAX_FRAME).map_err(denied)?;
    let len = kvferry::auth::frame_body_len(n);
    sealed.clear();
    s.take(len as u64).read_to_end(sealed)?;
    if sealed.len() != len {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    o.open_frame_body(sealed, body).map_err(denied)
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
    pub fn start(
        master: Arc<Master>,
        listener: TcpListener,
        tick: Duration,
        summary_every: u32,
    ) -> std::io::Result<MasterServer> {
        Self::start_with_spin(
            master,
            listener,
            tick,
            summary_every,
            Duration::from_micros(50),
        )
    }

    /// Like [`MasterServer::start`], with the bounded poll for a connection's next request
    /// (`Duration::ZERO`: always sleep in the kernel).
    pub fn start_with_spin(
        master: Arc<Master>,
        listener: TcpListener,
        tick: Duration,
        summary_every: u32,
        spin: Duration,
    ) -> std::io::Result<MasterServer> {
        let port = listener.local_addr()?.port();
        let listener = Arc::new(listener);
        let stop = Arc::new(AtomicBool::new(false));
        let (l, m, st) = (
            Arc::clone(&listener),
            Arc::clone(&master),
            Arc::clone(&stop),
        );
        let spin = Arc::new(Spin::new(spin));
        let unproved = Unproved::new(
            "master RPC",
            MAX_UNPROVED,
            MAX_UNPROVED_PER_IP,
            PROOF_DEADLINE,
        );
        std::thread::Builder::new()
            .name("kvf-master-accept".into())
            .spawn(move || {
                for conn in l.incoming() {
                    if st.load(Ordering::Acquire) {
                        break;
                    }
                    let Some(conn) = accepted(conn, "master: accepting an RPC connection") else {
                        continue;
                    };
                    // With the cluster key, a place among the connections not proved yet, or the
                    // connection is closed here (no thread, nothing read).
                    let Ok(slot) = unproved.place(m.auth.is_some(), &conn) else {
                        continue;
                    };
                    // A client host that vanished (crashed, cut off) without closing is found by
                    // TCP keepalive, so its thread, descriptor and buffer are not held for ever.
                    keepalive(&conn, Duration::from_secs(30));
                    let (m, spin) = (Arc::clone(&m), Arc::clone(&spin));
                    let _ = std::thread::Builder::new()
                        .name("kvf-master-rpc".into())
                        .spawn(move || {
                            if let Err(e) = serve_conn(&m, &conn, &spin, slot) {
                                if e.kind() != std::io::ErrorKind::UnexpectedEof {
                                    tracing::debug!("master RPC connection closed: {e}");
                                }
                            }
                            let _ = conn.shutdown(Shutdown::Both);
                        });
                }
            })?;
        let (m, st) = (Arc::clone(&master), Arc::clone(&stop));
        std::thread::Builder::new()
            .name("kvf-master-tick".into())
            .spawn(move || {
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
                            keys = s.keys,
                            used = s.bytes_used,
                            total = s.bytes_total,
                            clients = s.clients,
                            segments = s.segments,
                            evicted = m.stats.evicted_objects.load(Ordering::Relaxed),
                            "master summary"
                        );
                    }
                }
            })?;
        Ok(MasterServer {
            master,
            listener,
            stop,
            port,
        })
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
mod tests;
