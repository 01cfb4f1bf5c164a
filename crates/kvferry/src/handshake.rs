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
//!
//! Public: the client side ([`request`], [`answers`]). The listener (`server`) is the
//! engine's own.

pub(crate) mod server;

use crate::auth::{ClusterKey, Protocol};
use crate::error::{Error, Result};
use crate::wire::handshake::{self, AUTH_CHALLENGE, AUTH_HELLO, AUTH_REFUSED, LEN_PREFIX};
pub use crate::wire::handshake::{Frame, MsgType};
pub(crate) use server::{Handler, HandshakeServer};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Socket timeout of each read, so the whole-frame deadline is checked at least this often.
const TICK: Duration = Duration::from_millis(200);

/// The cluster key's use on the handshake port (`crate::auth`).
const PROTOCOL: Protocol = Protocol("kvferry/handshake/1");

/// Reads one sealed frame ([`crate::auth::Sealer::seal_frame`]) of at most `max` bytes by
/// `deadline`, growing the buffer only as bytes arrive.
fn read_sealed(
    s: &TcpStream,
    open: &mut crate::auth::Opener,
    max: u64,
    deadline: Instant,
) -> Result<Vec<u8>, String> {
    let mut head = [0u8; crate::auth::FRAME_HEAD_LEN];
    read_until(s, &mut head, deadline, "reading a sealed frame")?;
    let n = open
        .open_frame_head(&head, usize::try_from(max).unwrap_or(usize::MAX))
        .map_err(|r| format!("a sealed frame: {r}"))?;
    let want = crate::auth::frame_body_len(n);
    let mut sealed = Vec::new();
    while sealed.len() < want {
        let at = sealed.len();
        sealed.resize(at + (want - at).min(64 << 10), 0);
        read_until(
            s,
            &mut sealed[at..],
            deadline,
            "reading a sealed frame's body",
        )?;
    }
    let mut plain = Vec::new();
    open.open_frame_body(&sealed, &mut plain)
        .map_err(|r| format!("a sealed frame: {r}"))?;
    Ok(plain)
}

/// Reads exactly `buf.len()` bytes unless `deadline` passes first (checked after every
/// read, so bytes trickling in one at a time cannot stretch it).
fn read_until(s: &TcpStream, buf: &mut [u8], deadline: Instant, what: &str) -> Result<(), String> {
    let mut got = 0;
    while got < buf.len() {
        match (&*s).read(&mut buf[got..]) {
            Ok(0) => {
                return Err(format!(
                    "{what}: connection closed after {got} of {} bytes",
                    buf.len()
                ))
            }
            Ok(n) => got += n,
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(format!("{what}: {e}")),
        }
        if got < buf.len() && Instant::now() >= deadline {
            return Err(format!(
                "{what}: only {got} of {} bytes before the deadline",
                buf.len()
            ));
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
            Ok(0) => {
                return Err(format!(
                    "{what}: connection closed after {sent} of {} bytes",
                    buf.len()
                ))
            }
            Ok(n) => sent += n,
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(format!("{what}: {e}")),
        }
        if sent < buf.len() && Instant::now() >= deadline {
            return Err(format!(
                "{what}: only {sent} of {} bytes taken by the peer before the deadline",
                buf.len()
            ));
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
    matches!(
        request(
            host,
            port,
            MsgType::Probe,
            b"{}",
            connect,
            Duration::from_secs(2),
            max_len,
            None
        ),
        Ok(_) | Err(Error::Unauthorized { .. })
    )
}

/// Sends one request to `host:port` and returns the reply frame; with `auth` (the key, and the
/// segment name of the engine meant: it must be that engine's), after the cluster key's
/// handshake, the request and the reply sealed.
#[allow(clippy::too_many_arguments)]
pub fn request(
    host: &str,
    port: u16,
    kind: MsgType,
    body: &[u8],
    connect_timeout: Duration,
    io_timeout: Duration,
    max_len: u64,
    auth: Option<(&ClusterKey, &str)>,
) -> Result<Frame> {
    let peer = format!("{host}:{port}");
    let fail = |reason: String| Error::Handshake {
        peer: peer.clone(),
        reason,
    };
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
    let s = stream.ok_or_else(|| {
        fail(format!(
            "{last} (is the peer running, and is {host} its advertised address?)"
        ))
    })?;
    s.set_read_timeout(Some(io_timeout.min(TICK)))
        .map_err(|e| fail(e.to_string()))?;
    s.set_write_timeout(Some(io_timeout.min(TICK)))
        .map_err(|e| fail(e.to_string()))?;
    let _ = s.set_nodelay(true);
    let deadline = Instant::now() + io_timeout;
    let refused = |reply: &Frame| Error::Unauthorized {
        peer: peer.clone(),
        reason: match reply.body.split_first() {
            Some((&AUTH_REFUSED, why)) => String::from_utf8_lossy(why).into_owned(),
            _ => "it answered the cluster key's handshake with something else".into(),
        },
    };
    let request = handshake::encode(kind, body);
    let Some((key, dialed)) = auth else {
        write_until(&s, &request, deadline, "sending request").map_err(fail)?;
        let reply = read_frame(&s, max_len, Instant::now() + io_timeout).map_err(fail)?;
        let _ = s.shutdown(Shutdown::Both);
        return match reply.kind {
            MsgType::Auth => Err(refused(&reply)),
            k if k != kind => Err(Error::Wire {
                peer: peer.clone(),
                source: crate::wire::WireError::UnexpectedType {
                    got: reply.kind as u8,
                    expected: kind as u8,
                },
            }),
            _ => Ok(reply),
        };
    };
    let unauthorized = |r: crate::auth::Refusal| Error::Unauthorized {
        peer: peer.clone(),
        reason: r.to_string(),
    };
    let (init, hello) = crate::auth::Initiator::new(key, PROTOCOL, dialed.trim_start_matches('/'))
        .map_err(unauthorized)?;
    let mut opening = vec![AUTH_HELLO];
    opening.extend_from_slice(&hello);
    write_until(
        &s,
        &handshake::encode(MsgType::Auth, &opening),
        deadline,
        "sending the cluster key's opening frame",
    )
    .map_err(fail)?;
    let answer = read_frame(&s, max_len, deadline).map_err(|e| {
        fail(format!("{e} (at the cluster key's handshake: a peer that closes here does not take a cluster key, e.g. a stock Mooncake engine or one without KVFERRY_AUTH_KEY_FILE)"))
    })?;
    let session = match (answer.kind, answer.body.split_first()) {
        (MsgType::Auth, Some((&AUTH_CHALLENGE, rest))) => init.finish(rest).map_err(unauthorized)?,
        (MsgType::Auth, _) => return Err(refused(&answer)),
        _ => {
            return Err(Error::Unauthorized {
                peer: peer.clone(),
                reason: "it does not take a cluster key (a stock Mooncake engine, or a kvferry engine too old for one), and this engine holds one (KVFERRY_AUTH_KEY_FILE)".into(),
            })
        }
    };
    let (mut seal, mut open) = session.split();
    let mut out = Vec::new();
    seal.seal_frame(&request, &mut out);
    write_until(&s, &out, deadline, "sending request").map_err(fail)?;
    let plain = read_sealed(
        &s,
        &mut open,
        max_len + LEN_PREFIX as u64 + 1,
        Instant::now() + io_timeout,
    )
    .map_err(fail)?;
    let _ = s.shutdown(Shutdown::Both);
    match handshake::decode(&plain, max_len) {
        Ok(Some((reply, n))) if n == plain.len() && reply.kind == kind => Ok(reply),
        Ok(Some((reply, _))) => Err(Error::Wire {
            peer: peer.clone(),
            source: crate::wire::WireError::UnexpectedType {
                got: reply.kind as u8,
                expected: kind as u8,
            },
        }),
        Ok(None) => Err(fail("the sealed reply is not a whole frame".into())),
        Err(e) => Err(Error::Wire {
            peer: peer.clone(),
            source: e,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

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
            c.set_read_timeout(Some(Duration::from_millis(100)))
                .unwrap();
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
        // Made before the clock starts: filling 256 MiB is not the write's time.
        let reply = vec![7u8; 256 << 20];
        let t = Instant::now();
        let e = write_until(&s, &reply, t + Duration::from_millis(500), "the reply").unwrap_err();
        let took = t.elapsed();
        stop.store(true, Ordering::Release);
        drop(s);
        reader.join().unwrap();
        assert!(e.contains("before the deadline"), "{e}");
        assert!(
            took < Duration::from_millis(500) + TICK * 2,
            "ended {took:?} after it began"
        );
    }
}
