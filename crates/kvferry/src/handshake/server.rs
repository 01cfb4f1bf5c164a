//! The handshake port's listener: one request per connection, read whole within a deadline,
//! answered by the engine's [`Handler`]; with the cluster key, only after the key's exchange.
//! Internal: the engine serves its port with it, and the integration tests through
//! `kvferry::testing`.

use super::{read_frame, read_sealed, write_until, PROTOCOL, TICK};
use crate::auth::Keyed;
use crate::wire::handshake::{
    self, Frame, MsgType, AUTH_CHALLENGE, AUTH_HELLO, AUTH_REFUSED, LEN_PREFIX,
};
use std::io::Read;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most handshake connections served at once; more are closed at accept.
const MAX_CONCURRENT: usize = 256;
/// Most of them from one source address (a flood from one host leaves room for the others).
const MAX_PER_SOURCE: usize = 64;
/// A request frame must arrive whole within this (however the bytes trickle in), and so
/// must the reply be sent: a slow client holds a slot at most this long.
const SERVER_IO_TIMEOUT: Duration = Duration::from_secs(5);

/// Answers one request frame with a reply body.
pub type Handler = Arc<dyn Fn(&Frame) -> Vec<u8> + Send + Sync>;

/// Most payload bytes of the frame that opens a keyed handshake: its type byte, a tag byte
/// and the opening message. Nothing larger is read before the proof.
const HELLO_FRAME_MAX: u64 = 2 + crate::auth::MAX_HELLO_LEN as u64;

pub struct HandshakeServer {
    port: u16,
    listener: Arc<TcpListener>,
    shutdown: Arc<AtomicBool>,
}

impl HandshakeServer {
    /// Serves `listener`; with `auth`, every request must follow the key's exchange.
    pub fn start(
        listener: TcpListener,
        max_len: u64,
        handler: Handler,
        auth: Option<Keyed>,
    ) -> std::io::Result<HandshakeServer> {
        let port = listener.local_addr()?.port();
        let listener = Arc::new(listener);
        let shutdown = Arc::new(AtomicBool::new(false));
        // Every connection counts until it ends: one request per connection, so the time it
        // holds a place before its proof is all of its time, at most SERVER_IO_TIMEOUT.
        let active = crate::auth::Unproved::new(MAX_CONCURRENT, MAX_PER_SOURCE);
        let (l, sd) = (Arc::clone(&listener), Arc::clone(&shutdown));
        std::thread::Builder::new().name("kvf-handshake".into()).spawn(move || {
            let mut warned = Instant::now() - Duration::from_secs(60);
            loop {
                let (stream, from) = match l.accept() {
                    Ok(s) => s,
                    Err(_) if sd.load(Ordering::Acquire) => break,
                    Err(e) if crate::sys::net::listener_gone(&e) => {
                        tracing::error!("handshake listener on port {port} stopped accepting ({e}); was it shut down by another process?");
                        break;
                    }
                    Err(e) => {
                        tracing::debug!("handshake listener: accept failed: {e}");
                        // Out of descriptors or memory: back off instead of spinning.
                        let out = crate::sys::net::out_of_resources(&e);
                        std::thread::sleep(if out { Duration::from_millis(100) } else { Duration::from_millis(1) });
                        continue;
                    }
                };
                if sd.load(Ordering::Acquire) {
                    break;
                }
                let Some(place) = active.admit(from.ip()) else {
                    if warned.elapsed() > Duration::from_secs(10) {
                        warned = Instant::now();
                        tracing::warn!("handshake: {MAX_CONCURRENT} requests in progress, or {MAX_PER_SOURCE} from {}; closing a new one", from.ip());
                    }
                    continue;
                };
                let (h, key) = (Arc::clone(&handler), auth.clone());
                // (A thread that cannot start drops its place with the closure.)
                let _ = std::thread::Builder::new().name("kvf-handshake-conn".into()).spawn(move || {
                    let _place = place;
                    if let Err(e) = serve_one(&stream, max_len, &h, key.as_ref()) {
                        tracing::debug!("handshake request dropped: {e}");
                    }
                });
            }
        })?;
        Ok(HandshakeServer {
            port,
            listener,
            shutdown,
        })
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

fn serve_one(
    s: &TcpStream,
    max_len: u64,
    handler: &Handler,
    auth: Option<&Keyed>,
) -> std::io::Result<()> {
    s.set_read_timeout(Some(TICK))?;
    s.set_write_timeout(Some(TICK))?;
    // One deadline for the request and the reply: a client that reads the reply a little at
    // a time (each write making progress) holds its slot no longer than one that stalls.
    let deadline = Instant::now() + SERVER_IO_TIMEOUT;
    let read = |max: u64| {
        read_frame(s, max, deadline)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
    };
    let refuse = |why: String| -> std::io::Result<()> {
        let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        tracing::warn!(%peer, "handshake refused: {why}");
        let mut body = vec![AUTH_REFUSED];
        body.extend_from_slice(why.as_bytes());
        write_until(
            s,
            &handshake::encode(MsgType::Auth, &body),
            deadline,
            "sending the refusal",
        )
        .map_err(std::io::Error::other)?;
        let _ = s.shutdown(Shutdown::Both);
        Ok(())
    };
    let Some(keyed) = auth else {
        let frame = read(max_len)?;
        if frame.kind == MsgType::Auth {
            return refuse("the initiator holds a cluster key and this engine none (KVFERRY_AUTH_KEY_FILE is not set here)".into());
        }
        let reply = handler(&frame);
        write_until(
            s,
            &handshake::encode(frame.kind, &reply),
            deadline,
            "sending the reply",
        )
        .map_err(std::io::Error::other)?;
        return finish(s);
    };
    // Before the proof: one frame no larger than the opening message (a peer without the key
    // sending a request is told why it is refused).
    let frame = read(HELLO_FRAME_MAX)?;
    let hello = match (frame.kind, frame.body.split_first()) {
        (MsgType::Auth, Some((&AUTH_HELLO, hello))) => hello,
        (MsgType::Auth, _) => return refuse("an opening frame of another kind than this engine's (an older kvferry engine?): upgrade both sides".into()),
        _ => return refuse("a request before the cluster key's handshake: the initiator holds no KVFERRY_AUTH_KEY_FILE (or is a stock Mooncake engine)".into()),
    };
    let (session, answer) = match keyed.answer(PROTOCOL, hello) {
        Ok(a) => a,
        Err(r) => return refuse(format!("the initiator's opening message: {r}")),
    };
    let mut body = vec![AUTH_CHALLENGE];
    body.extend_from_slice(&answer);
    write_until(
        s,
        &handshake::encode(MsgType::Auth, &body),
        deadline,
        "sending the answer",
    )
    .map_err(std::io::Error::other)?;
    let (mut seal, mut open) = session.split();
    // The request, sealed: the first proof that the initiator holds the session (nothing
    // before it is decoded).
    let plain = read_sealed(s, &mut open, max_len + LEN_PREFIX as u64 + 1, deadline)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    let frame = match handshake::decode(&plain, max_len) {
        Ok(Some((f, n))) if n == plain.len() && f.kind != MsgType::Auth => f,
        _ => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "the sealed request is not one whole request frame",
            ))
        }
    };
    let reply = handler(&frame);
    let mut out = Vec::new();
    seal.seal_frame(&handshake::encode(frame.kind, &reply), &mut out);
    write_until(s, &out, deadline, "sending the reply").map_err(std::io::Error::other)?;
    finish(s)
}

/// After the reply: half-closes, and waits (bounded) for the client to close, as Mooncake does.
fn finish(s: &TcpStream) -> std::io::Result<()> {
    s.shutdown(Shutdown::Write)?;
    let mut sink = [0u8; 64];
    let _ = (&*s).read(&mut sink);
    Ok(())
}
