//! The handshake port: a listener answering Metadata, Notify, Probe (and refusing
//! Connection, which only RDMA uses), and the client that asks peers.
//!
//! One request per connection, as Mooncake does: read one frame (bounded in size and time),
//! answer one frame of the same type, half-close, close. A malformed or slow request only
//! costs its own connection.
//!
//! With a cluster key (`KVFERRY_AUTH_KEY_FILE`, [`crate::auth`]) the request is preceded, on
//! the same connection and within the same deadline, by the key's exchange in `Auth` frames
//! (the initiator's nonce; the engine's nonce and MAC; the initiator's proof, followed by the
//! request). An engine holding a key answers nothing else first: a request without the
//! exchange gets an `Auth` frame refusing it, saying why.

use crate::auth::{Answering, ClusterKey, Exchange, Opening};
use crate::error::{Error, Result};
use crate::wire::handshake::{self, Frame, MsgType, AUTH_CHALLENGE, AUTH_REFUSED, LEN_PREFIX};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most handshake connections served at once; more are closed at accept.
const MAX_CONCURRENT: usize = 256;
/// A request frame must arrive whole within this (however the bytes trickle in), and so
/// must the reply be sent: a slow client holds a slot at most this long.
const SERVER_IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Socket timeout of each read, so the whole-frame deadline is checked at least this often.
const TICK: Duration = Duration::from_millis(200);

/// Answers one request frame with a reply body.
pub type Handler = Arc<dyn Fn(&Frame) -> Vec<u8> + Send + Sync>;

/// The cluster key's exchange on the handshake port: the initiator opens it.
const AUTH: Exchange = Exchange { opener: "kvferry/handshake/initiator", answerer: "kvferry/handshake/engine" };

pub struct HandshakeServer {
    port: u16,
    listener: Arc<TcpListener>,
    shutdown: Arc<AtomicBool>,
}

impl HandshakeServer {
    /// Serves `listener`; with `auth`, every request must follow the key's exchange.
    pub fn start(listener: TcpListener, max_len: u64, handler: Handler, auth: Option<Arc<ClusterKey>>) -> std::io::Result<HandshakeServer> {
        let port = listener.local_addr()?.port();
        let listener = Arc::new(listener);
        let shutdown = Arc::new(AtomicBool::new(false));
        let active = Arc::new(AtomicUsize::new(0));
        let (l, sd) = (Arc::clone(&listener), Arc::clone(&shutdown));
        std::thread::Builder::new().name("kvf-handshake".into()).spawn(move || {
            loop {
                let stream = match l.accept() {
                    Ok((s, _)) => s,
                    Err(_) if sd.load(Ordering::Acquire) => break,
                    Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::EBADF | libc::ENOTSOCK)) => {
                        tracing::error!("handshake listener on port {port} stopped accepting ({e}); was it shut down by another process?");
                        break;
                    }
                    Err(e) => {
                        tracing::debug!("handshake listener: accept failed: {e}");
                        // Out of descriptors or memory: back off instead of spinning.
                        let out = matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM));
                        std::thread::sleep(if out { Duration::from_millis(100) } else { Duration::from_millis(1) });
                        continue;
                    }
                };
                if sd.load(Ordering::Acquire) {
                    break;
                }
                if active.fetch_add(1, Ordering::AcqRel) >= MAX_CONCURRENT {
                    active.fetch_sub(1, Ordering::AcqRel);
                    tracing::warn!("handshake: {MAX_CONCURRENT} requests already in progress; closing a new one");
                    continue;
                }
                let (h, a, key) = (Arc::clone(&handler), Arc::clone(&active), auth.clone());
                let spawned = std::thread::Builder::new().name("kvf-handshake-conn".into()).spawn(move || {
                    if let Err(e) = serve_one(&stream, max_len, &h, key.as_deref()) {
                        tracing::debug!("handshake request dropped: {e}");
                    }
                    a.fetch_sub(1, Ordering::AcqRel);
                });
                if spawned.is_err() {
                    active.fetch_sub(1, Ordering::AcqRel);
                }
            }
        })?;
        Ok(HandshakeServer { port, listener, shutdown })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn shutdown(&self) {
        self.shutdown.store(true, Ordering::Release);
        // Shutting down our own listening socket wakes the blocked accept().
        let _ = rustix::net::shutdown(&*self.listener, rustix::net::Shutdown::Both);
    }

    /// In a `fork()` child's copy: lets go of the parent's listening socket (see
    /// `crate::forked`), without shutting it down for the parent.
    pub(crate) fn release_inherited(&self) {
        crate::forked::detach(std::os::fd::AsFd::as_fd(&*self.listener));
    }
}

fn serve_one(s: &TcpStream, max_len: u64, handler: &Handler, auth: Option<&ClusterKey>) -> std::io::Result<()> {
    s.set_read_timeout(Some(TICK))?;
    s.set_write_timeout(Some(TICK))?;
    // One deadline for the request and the reply: a client that reads the reply a little at
    // a time (each write making progress) holds its slot no longer than one that stalls.
    let deadline = Instant::now() + SERVER_IO_TIMEOUT;
    let read = |max: u64| read_frame(s, max, deadline).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e));
    let refuse = |why: String| -> std::io::Result<()> {
        let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        tracing::warn!(%peer, "handshake refused: {why}");
        let mut body = vec![AUTH_REFUSED];
        body.extend_from_slice(why.as_bytes());
        write_until(s, &handshake::encode(MsgType::Auth, &body), deadline, "sending the refusal").map_err(std::io::Error::other)?;
        let _ = s.shutdown(Shutdown::Both);
        Ok(())
    };
    // Before the exchange, a frame no larger than any request a peer without the key sends
    // (it is told why it is refused); an engine holding none takes what it always did.
    let mut frame = read(if auth.is_some() { max_len.min(4096) } else { max_len })?;
    match (auth, frame.kind) {
        (None, MsgType::Auth) => return refuse("the initiator holds a cluster key and this engine none (KVFERRY_AUTH_KEY_FILE is not set here)".into()),
        (None, _) => {}
        (Some(_), kind) if kind != MsgType::Auth => {
            return refuse("a request before the cluster key's exchange: the initiator holds no KVFERRY_AUTH_KEY_FILE (or is a stock Mooncake engine)".into())
        }
        (Some(key), _) => {
            let ans = match Answering::new(key, AUTH, std::mem::take(&mut frame.body)) {
                Ok((ans, nonce, mac)) => {
                    let mut body = vec![AUTH_CHALLENGE];
                    body.extend_from_slice(&nonce);
                    body.extend_from_slice(&mac);
                    write_until(s, &handshake::encode(MsgType::Auth, &body), deadline, "sending the challenge").map_err(std::io::Error::other)?;
                    ans
                }
                Err(r) => return refuse(format!("the initiator's opening frame: {r}")),
            };
            let proof = read(1 + crate::auth::MAC_LEN as u64)?;
            if proof.kind != MsgType::Auth {
                return refuse("the initiator sent a request instead of its proof of the cluster key".into());
            }
            if let Err(r) = ans.check(key, AUTH, &proof.body) {
                return refuse(format!("the initiator's proof of the cluster key: {r}"));
            }
            frame = read(max_len)?;
            if frame.kind == MsgType::Auth {
                return refuse("the initiator sent another exchange instead of its request".into());
            }
        }
    }
    let reply = handler(&frame);
    write_until(s, &handshake::encode(frame.kind, &reply), deadline, "sending the reply").map_err(std::io::Error::other)?;
    s.shutdown(Shutdown::Write)?;
    // Wait (bounded) for the client to close, as Mooncake does.
    let mut sink = [0u8; 64];
    let _ = (&*s).read(&mut sink);
    Ok(())
}

/// Reads exactly `buf.len()` bytes unless `deadline` passes first (checked after every
/// read, so bytes trickling in one at a time cannot stretch it).
fn read_until(s: &TcpStream, buf: &mut [u8], deadline: Instant, what: &str) -> Result<(), String> {
    let mut got = 0;
    while got < buf.len() {
        match (&*s).read(&mut buf[got..]) {
            Ok(0) => return Err(format!("{what}: connection closed after {got} of {} bytes", buf.len())),
            Ok(n) => got += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {}
            Err(e) => return Err(format!("{what}: {e}")),
        }
        if got < buf.len() && Instant::now() >= deadline {
            return Err(format!("{what}: only {got} of {} bytes before the deadline", buf.len()));
        }
    }
    Ok(())
}

/// Writes all of `buf` unless `deadline` passes first (checked after every write, which the
/// socket's send timeout bounds: a peer reading a little at a time cannot stretch it).
fn write_until(s: &TcpStream, buf: &[u8], deadline: Instant, what: &str) -> Result<(), String> {
    let mut sent = 0;
    while sent < buf.len() {
        match (&*s).write(&buf[sent..]) {
            Ok(0) => return Err(format!("{what}: connection closed after {sent} of {} bytes", buf.len())),
            Ok(n) => sent += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {}
            Err(e) => return Err(format!("{what}: {e}")),
        }
        if sent < buf.len() && Instant::now() >= deadline {
            return Err(format!("{what}: only {sent} of {} bytes taken by the peer before the deadline", buf.len()));
        }
    }
    Ok(())
}

fn read_frame(s: &TcpStream, max_len: u64, deadline: Instant) -> Result<Frame, String> {
    let mut prefix = [0u8; LEN_PREFIX];
    read_until(s, &mut prefix, deadline, "reading frame length")?;
    let len = handshake::decode_len(prefix, max_len).map_err(|e| e.to_string())?;
    // Grow as bytes arrive, so a lying length cannot make us allocate before they do.
    let mut payload = Vec::new();
    while payload.len() < len {
        let at = payload.len();
        let step = (len - at).min(64 << 10);
        payload.resize(at + step, 0);
        read_until(s, &mut payload[at..], deadline, "reading frame body")?;
    }
    Ok(handshake::decode_payload(&payload))
}

/// Whether an engine answers a `Probe` at `host:port`: connected within `connect`, answered
/// within 2 s. An engine asks this before it takes over a name whose `rpc_meta` names another
/// engine, and a store master before it removes a dropped client's entries. An engine that
/// refuses the probe for want of the cluster key answered: it is alive.
pub fn answers(host: &str, port: u16, connect: Duration, max_len: u64) -> bool {
    matches!(request(host, port, MsgType::Probe, b"{}", connect, Duration::from_secs(2), max_len, None), Ok(_) | Err(Error::Unauthorized { .. }))
}

/// Sends one request to `host:port` and returns the reply frame; with `auth`, after the
/// cluster key's exchange (the engine must prove it too).
#[allow(clippy::too_many_arguments)]
pub fn request(
    host: &str,
    port: u16,
    kind: MsgType,
    body: &[u8],
    connect_timeout: Duration,
    io_timeout: Duration,
    max_len: u64,
    auth: Option<&ClusterKey>,
) -> Result<Frame> {
    let peer = format!("{host}:{port}");
    let fail = |reason: String| Error::Handshake { peer: peer.clone(), reason };
    let addrs: Vec<_> = (host, port)
        .to_socket_addrs()
        .map_err(|e| fail(format!("cannot resolve {host}: {e}")))?
        .collect();
    let mut last = String::from("no addresses");
    let mut stream = None;
    for a in &addrs {
        match TcpStream::connect_timeout(a, connect_timeout) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = format!("connect to {a}: {e}"),
        }
    }
    let s = stream.ok_or_else(|| fail(format!("{last} (is the peer running, and is {host} its advertised address?)")))?;
    s.set_read_timeout(Some(io_timeout.min(TICK))).map_err(|e| fail(e.to_string()))?;
    s.set_write_timeout(Some(io_timeout.min(TICK))).map_err(|e| fail(e.to_string()))?;
    let _ = s.set_nodelay(true);
    let deadline = Instant::now() + io_timeout;
    let refused = |reply: &Frame| Error::Unauthorized {
        peer: peer.clone(),
        reason: match reply.body.split_first() {
            Some((&AUTH_REFUSED, why)) => String::from_utf8_lossy(why).into_owned(),
            _ => "it answered the cluster key's exchange with something else".into(),
        },
    };
    let mut out = Vec::new();
    if let Some(key) = auth {
        let open = Opening::default();
        write_until(&s, &handshake::encode(MsgType::Auth, &open.nonce()), deadline, "sending the cluster key's opening frame").map_err(fail)?;
        let answer = read_frame(&s, max_len, deadline).map_err(|e| {
            fail(format!("{e} (at the cluster key's exchange: a peer that closes here does not take a cluster key, e.g. a stock Mooncake engine or one without KVFERRY_AUTH_KEY_FILE)"))
        })?;
        let challenge = match (answer.kind, answer.body.split_first()) {
            (MsgType::Auth, Some((&AUTH_CHALLENGE, rest))) if rest.len() == crate::auth::NONCE_LEN + crate::auth::MAC_LEN => rest,
            (MsgType::Auth, _) => return Err(refused(&answer)),
            _ => {
                return Err(Error::Unauthorized {
                    peer: peer.clone(),
                    reason: "it does not take a cluster key (a stock Mooncake engine, or a kvferry engine too old for one), and this engine holds one (KVFERRY_AUTH_KEY_FILE)".into(),
                })
            }
        };
        let (nonce, mac) = challenge.split_at(crate::auth::NONCE_LEN);
        let proof = open.prove(key, AUTH, nonce, mac).map_err(|r| Error::Unauthorized { peer: peer.clone(), reason: r.to_string() })?;
        out = handshake::encode(MsgType::Auth, &proof);
    }
    out.extend_from_slice(&handshake::encode(kind, body));
    write_until(&s, &out, deadline, "sending request").map_err(fail)?;
    let reply = read_frame(&s, max_len, Instant::now() + io_timeout).map_err(fail)?;
    let _ = s.shutdown(Shutdown::Both);
    if reply.kind == MsgType::Auth {
        return Err(refused(&reply));
    }
    if reply.kind != kind {
        return Err(Error::Wire {
            peer: peer.clone(),
            source: crate::wire::WireError::UnexpectedType { got: reply.kind as u8, expected: kind as u8 },
        });
    }
    Ok(reply)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer that takes 4 KiB every 50 ms lets every write make progress, so a socket send
    /// timeout never fires (before, a reply was written with `write_all` under one, and such a
    /// client held a server slot for as long as it liked); the deadline still ends the write.
    #[test]
    fn a_peer_reading_a_little_at_a_time_cannot_stretch_a_write_past_its_deadline() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let reader = std::thread::spawn(move || {
            let mut c = TcpStream::connect(addr).unwrap();
            c.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
            let mut buf = [0u8; 4096];
            while !stop2.load(Ordering::Acquire) {
                if matches!(c.read(&mut buf), Ok(0)) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let (s, _) = l.accept().unwrap();
        s.set_write_timeout(Some(TICK)).unwrap();
        let t = Instant::now();
        let e = write_until(&s, &vec![7u8; 256 << 20], t + Duration::from_millis(500), "the reply").unwrap_err();
        let took = t.elapsed();
        stop.store(true, Ordering::Release);
        drop(s);
        reader.join().unwrap();
        assert!(e.contains("before the deadline"), "{e}");
        assert!(took < Duration::from_millis(500) + TICK * 2, "ended {took:?} after it began");
    }
}
