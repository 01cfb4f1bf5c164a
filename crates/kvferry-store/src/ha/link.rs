//! The leader's side of a replication link: moves frames to one standby (sealed under the
//! cluster key's session, after proving the key to it) and reads its acknowledgements, and
//! encodes the image and the run a linking standby is sent. It decides nothing about what is
//! durable or who is in sync: the journal's writer (`super::journal`) does, from the
//! acknowledgements counted here.

use super::standby::{read_frame_in, wire, Incoming};
use super::sync::{
    encode_frame, locked, read_frame_max, standby_identity, KeptFrame, ToLeader, ToStandby,
    HA_LINK, IMAGE_PIECE, MAX_SMALL_FRAME,
};
use crate::master::changes::Change;
use crate::repl::TailFrame;
use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a link tells the leader's side as it happens (called from the link's threads).
pub trait AckSink: Send + Sync {
    /// The standby acknowledged more entries (its [`Link::acked`] grew).
    fn acked(&self);
    /// The link broke (its [`Link::dead`] is true).
    fn broke(&self);
}

/// The leader's connection to one standby: frames go out through a channel to its sender
/// thread (which connects first, so the leader's writer never waits on a slow or unreachable
/// standby); a reader thread records acknowledgements.
pub struct Link {
    pub member: String,
    pub addr: String,
    tx: Option<std::sync::mpsc::Sender<Queued>>,
    acked: Arc<AtomicU64>,
    dead: Arc<AtomicBool>,
    /// Bytes queued and not yet written: a standby that does not read (paused, overloaded)
    /// is cut off past [`Link::backlog_limit`] instead of growing the leader's memory.
    queued: Arc<AtomicU64>,
    /// The entry its image ends at (it is in sync once it acknowledged the last entry
    /// written, which is at least this).
    pub image_seq: u64,
    image_bytes: u64,
    sock: Arc<Mutex<Option<TcpStream>>>,
    /// With the cluster key, seals every frame of the link (the `Hello` first) right before
    /// it is written, by whichever of [`Link::send`] or the sender thread writes it: their
    /// writes never overlap, so the sequence numbers follow the wire.
    sealer: Arc<Mutex<Option<kvferry::auth::Sealer>>>,
    /// Whether the link is sealed (the cluster key is held).
    sealed: bool,
    /// It takes [`ToStandby::Base`] frames (its [`super::sync::registration`] says so).
    pub runs: bool,
    /// It reads [`Change::Granted`] (its [`super::sync::registration`] says so).
    pub grants: bool,
}

/// A frame queued for a link's sender thread: to be sealed as it is written (`seal`), or its
/// bytes as they go out.
struct Queued {
    bytes: Arc<Vec<u8>>,
    seal: bool,
}

/// How long connecting to a standby may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// A write to a standby that takes longer than this ends its link.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

impl Link {
    /// Starts linking to `addr`: its sender thread connects, says `hello`, then sends what is
    /// queued; its reader thread records acknowledgements. Never blocks the caller on the
    /// network.
    /// With the cluster key (`auth`), the sender thread first runs the key's handshake,
    /// dialing the standby's [`standby_identity`] (`member` of `hello`'s cluster), and every
    /// frame after is sealed.
    pub fn open(
        member: &str,
        addr: &str,
        hello: &ToStandby,
        auth: Option<kvferry::auth::ClusterKey>,
        signal: Arc<dyn AckSink>,
    ) -> Result<Link, String> {
        let sa: std::net::SocketAddr = addr
            .parse()
            .map_err(|e| format!("the standby {member} announced {addr:?}, not an address: {e}"))?;
        let ToStandby::Hello { cluster_id, .. } = hello else {
            return Err("a link opens with a hello".into());
        };
        let identity = standby_identity(cluster_id, member);
        let hello = encode_frame(hello)?;
        let (tx, rx) = std::sync::mpsc::channel::<Queued>();
        let acked = Arc::new(AtomicU64::new(0));
        let dead = Arc::new(AtomicBool::new(false));
        let queued = Arc::new(AtomicU64::new(0));
        let sock: Arc<Mutex<Option<TcpStream>>> = Arc::default();
        let sealer: Arc<Mutex<Option<kvferry::auth::Sealer>>> = Arc::default();
        let sealed = auth.is_some();
        let (dead2, signal2, acked2, queued2, sock2, sealer2) = (
            Arc::clone(&dead),
            signal,
            Arc::clone(&acked),
            Arc::clone(&queued),
            Arc::clone(&sock),
            Arc::clone(&sealer),
        );
        let m = member.to_string();
        std::thread::Builder::new()
            .name("kvf-ha-send".into())
            .spawn(move || {
                let end = |why: String| {
                    tracing::warn!("HA replication: the standby {m}: {why}");
                    dead2.store(true, Ordering::Release);
                    signal2.broke();
                };
                let mut w = match TcpStream::connect_timeout(&sa, CONNECT_TIMEOUT) {
                    Ok(s) => s,
                    Err(e) => return end(format!("connecting to {sa}: {e}")),
                };
                let _ = w.set_nodelay(true);
                let _ = w.set_write_timeout(Some(WRITE_TIMEOUT));
                let mut inc = Incoming::Plain;
                if let Some(key) = &auth {
                    match prove_to_standby(&mut w, key, &identity) {
                        Ok((s, o)) => {
                            *locked(&sealer2) = Some(s);
                            inc = Incoming::sealed(o);
                        }
                        Err(e) => return end(e),
                    }
                }
                // What goes on the wire for `f`: sealed here when it is queued to be.
                let wire_of = |f: Queued| match f {
                    Queued { bytes, seal: true } => Arc::new(wire(locked(&sealer2).as_mut(), &bytes)),
                    Queued { bytes, seal: false } => bytes,
                };
                let r = match w.try_clone() {
                    Ok(r) => r,
                    Err(e) => return end(e.to_string()),
                };
                let (dead3, signal3, m3) = (Arc::clone(&dead2), Arc::clone(&signal2), m.clone());
                let reader = std::thread::Builder::new().name("kvf-ha-acks".into()).spawn(move || {
                    let mut r = std::io::BufReader::new(r);
                    let spin = crate::net::Spin::for_replication();
                    loop {
                        if r.buffer().is_empty() {
                            spin.readable(r.get_ref());
                        }
                        match read_frame_in::<ToLeader>(&mut r, &mut inc, MAX_SMALL_FRAME).map(|(f, _)| f) {
                            Ok(ToLeader::Ack { seq }) => {
                                acked2.fetch_max(seq, Ordering::AcqRel);
                                signal3.acked();
                            }
                            Ok(ToLeader::Refused { why }) => {
                                tracing::warn!("HA replication: the standby {m3} refused: {why}");
                                break;
                            }
                            Ok(ToLeader::AuthChallenge { .. }) => {
                                tracing::warn!("HA replication: the standby {m3} sent a handshake's answer after the handshake");
                                break;
                            }
                            Err(e) => {
                                tracing::debug!("HA replication: the standby {m3}'s connection ended: {e}");
                                break;
                            }
                        }
                    }
                    dead3.store(true, Ordering::Release);
                    signal3.broke();
                });
                if let Err(e) = reader {
                    return end(e.to_string());
                }
                if let Err(e) = w.write_all(&wire_of(Queued { bytes: Arc::new(hello), seal: sealed })) {
                    return end(format!("greeting: {e}"));
                }
                // From now on the writer may write entries itself while nothing is queued.
                match (w.try_clone(), sock2.lock()) {
                    (Ok(s), Ok(mut g)) => *g = Some(s),
                    _ => return end("cannot keep the connection".into()),
                }
                while let Ok(f) = rx.recv() {
                    let n = f.bytes.len() as u64;
                    if let Err(e) = w.write_all(&wire_of(f)) {
                        return end(format!("sending: {e}"));
                    }
                    queued2.fetch_sub(n, Ordering::AcqRel);
                }
                let _ = w.shutdown(std::net::Shutdown::Both);
                dead2.store(true, Ordering::Release);
                signal2.broke();
            })
            .map_err(|e| e.to_string())?;
        Ok(Link {
            member: member.to_string(),
            addr: addr.to_string(),
            tx: Some(tx),
            acked,
            dead,
            queued,
            image_seq: 0,
            image_bytes: 0,
            sock,
            sealer,
            sealed,
            runs: false,
            grants: false,
        })
    }

    /// The most a link may have queued: its image and 256 MiB more, or twice its image.
    fn backlog_limit(&self) -> u64 {
        (self.image_bytes + (256 << 20)).max(2 * self.image_bytes)
    }

    /// Sends a frame: written at once when nothing is queued and the socket takes it whole
    /// without blocking (the common case: no hop through the sender thread), else queued
    /// (what was not written of it, in order). False when the link is gone (or cut off: too
    /// much queued). Frames come from one sender at a time (the leader's writer, or a request
    /// thread it lent its links to, under the journal queue's lock: see `journal::Lent`), so
    /// with nothing queued the sender thread is idle and writing here keeps the order.
    ///
    /// On a sealed link a frame is sealed as it is written here, or queued to be sealed by
    /// the sender thread as it writes it; once sealed, its bytes are what goes out (what was
    /// not written of them is queued as they are).
    pub fn send(&self, frame: &Arc<Vec<u8>>) -> bool {
        if self.dead() {
            return false;
        }
        if self.queued.load(Ordering::Acquire) == 0 {
            let g = self.sock.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(sock) = g.as_ref() {
                let bytes = if self.sealed {
                    Arc::new(wire(locked(&self.sealer).as_mut(), frame))
                } else {
                    Arc::clone(frame)
                };
                match rustix::net::send(
                    sock,
                    &bytes,
                    rustix::net::SendFlags::DONTWAIT | rustix::net::SendFlags::NOSIGNAL,
                ) {
                    Ok(n) if n == bytes.len() => return true,
                    Ok(n) => {
                        drop(g);
                        return self.enqueue(Queued {
                            bytes: Arc::new(bytes[n..].to_vec()),
                            seal: false,
                        });
                    }
                    Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => {
                        drop(g);
                        return self.enqueue(Queued { bytes, seal: false });
                    }
                    Err(e) => {
                        drop(g);
                        tracing::warn!(
                            "HA replication: sending to the standby {}: {e}",
                            self.member
                        );
                        self.cut();
                        return false;
                    }
                }
            }
        }
        self.enqueue(Queued {
            bytes: Arc::clone(frame),
            seal: self.sealed,
        })
    }

    fn enqueue(&self, f: Queued) -> bool {
        let n = f.bytes.len() as u64;
        let q = self.queued.fetch_add(n, Ordering::AcqRel) + n;
        if q > self.backlog_limit() {
            tracing::warn!("HA replication: the standby {} does not keep up ({q} bytes queued); its link is cut", self.member);
            self.cut();
            return false;
        }
        self.tx.as_ref().is_some_and(|tx| tx.send(f).is_ok())
    }

    /// Queues an image's frames.
    pub fn send_image(&mut self, seq: u64, frames: &[Arc<Vec<u8>>]) {
        self.image_seq = seq;
        self.image_bytes = frames.iter().map(|f| f.len() as u64).sum();
        for f in frames {
            self.send(f);
        }
    }

    pub fn acked(&self) -> u64 {
        self.acked.load(Ordering::Acquire)
    }

    /// The counter behind [`Link::acked`], for whoever releases entries as it grows.
    pub fn ack_counter(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.acked)
    }

    /// What the writer's decisions about the in-sync set need of this link
    /// ([`crate::repl::members`]).
    pub fn view(&self) -> crate::repl::members::LinkView {
        crate::repl::members::LinkView {
            dead: self.dead(),
            acked: self.acked(),
            image_seq: self.image_seq,
            grants: self.grants,
        }
    }

    pub fn dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    fn cut(&self) {
        self.dead.store(true, Ordering::Release);
        if let Some(s) = self.sock.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.tx = None; // the sender thread ends once it drained the channel
        self.cut(); // or at once, if it is stuck writing; the reader ends too
    }
}

/// The image frames of `changes` (the state after entry `seq`), calling `between` between
/// two frames whenever `hold` of encoding passed since the last call (a leader commits what
/// requests queued meanwhile, [`IMAGE_ENCODE_HOLD`]: a million objects take 0.1-0.2 s to
/// encode); `between` returning false gives the image up (an error).
pub fn image_frames(
    seq: u64,
    changes: Vec<Change>,
    hold: Duration,
    between: impl FnMut() -> bool,
) -> Result<Vec<Arc<Vec<u8>>>, String> {
    let mut it = changes.into_iter().peekable();
    let mut done = false;
    let frames = std::iter::from_fn(|| {
        if done {
            return None;
        }
        let changes: Vec<Change> = it.by_ref().take(IMAGE_PIECE).collect();
        done = it.peek().is_none();
        Some(ToStandby::Image {
            seq,
            changes,
            last: done,
        })
    });
    encode_between(frames, hold, between)
}

/// The [`ToStandby::Run`] frames of the run from `base` (`frames`, consecutive), each of at
/// most about [`RUN_PIECE`] bytes (one frame at least), calling `between` as
/// [`image_frames`] does.
pub fn run_frames(
    base: u64,
    frames: &[TailFrame],
    hold: Duration,
    between: impl FnMut() -> bool,
) -> Result<Vec<Arc<Vec<u8>>>, String> {
    let mut rest = frames;
    let pieces = std::iter::from_fn(|| {
        if rest.is_empty() {
            return None;
        }
        let (mut n, mut bytes) = (0, 0);
        for f in rest {
            if n > 0 && bytes + f.frame.len() > RUN_PIECE {
                break;
            }
            (n, bytes) = (n + 1, bytes + f.frame.len());
        }
        let (piece, after) = rest.split_at(n);
        rest = after;
        let kept = piece
            .iter()
            .map(|f| KeptFrame {
                first: f.first,
                last: f.last,
                frame: bytes::Bytes::copy_from_slice(&f.frame),
            })
            .collect();
        Some(ToStandby::Run { base, frames: kept })
    });
    encode_between(pieces, hold, between)
}

/// Encodes `frames`, calling `between` between two of them whenever `hold` of encoding passed
/// since the last call; `between` returning false gives up (an error).
fn encode_between(
    frames: impl Iterator<Item = ToStandby>,
    hold: Duration,
    mut between: impl FnMut() -> bool,
) -> Result<Vec<Arc<Vec<u8>>>, String> {
    let mut out = Vec::new();
    let mut since = Instant::now();
    let mut frames = frames.peekable();
    while let Some(f) = frames.next() {
        out.push(Arc::new(encode_frame(&f)?));
        if frames.peek().is_some() && since.elapsed() >= hold {
            if !between() {
                return Err("given up by the leader's writer (its term ended)".into());
            }
            since = Instant::now();
        }
    }
    Ok(out)
}

/// About the most bytes of entries one [`ToStandby::Run`] frame carries.
pub const RUN_PIECE: usize = 4 << 20;

/// How long a leader encodes a linking standby's image ([`image_frames`]) before it commits
/// what requests queued meanwhile.
pub const IMAGE_ENCODE_HOLD: Duration = Duration::from_millis(5);

/// The leader's side of the cluster key's handshake on a new link, before its `Hello`: it
/// dials `identity` ([`standby_identity`]) and links only a standby that answers under the
/// key; the session's halves.
fn prove_to_standby(
    s: &mut TcpStream,
    key: &kvferry::auth::ClusterKey,
    identity: &str,
) -> Result<(kvferry::auth::Sealer, kvferry::auth::Opener), String> {
    let (init, hello) = kvferry::auth::Initiator::new(key, HA_LINK, identity)
        .map_err(|r| format!("dialing {identity:?}: {r}"))?;
    s.set_read_timeout(Some(CONNECT_TIMEOUT))
        .map_err(|e| e.to_string())?;
    s.write_all(&encode_frame(&ToStandby::AuthHello { hello })?)
        .map_err(|e| format!("authenticating: {e}"))?;
    let couldnt = "it and this leader could not prove the cluster key to each other";
    match read_frame_max::<ToLeader>(s, MAX_SMALL_FRAME)
        .map_err(|e| format!("authenticating: {e}"))?
    {
        ToLeader::AuthChallenge { answer } => {
            let session = init
                .finish(&answer)
                .map_err(|r| format!("{couldnt}: its answer: {r}"))?;
            s.set_read_timeout(None).map_err(|e| e.to_string())?;
            Ok(session.split())
        }
        ToLeader::Refused { why } => Err(format!("{couldnt}: it refused the link: {why}")),
        other => Err(format!(
            "it answered {other:?} to the cluster key's handshake"
        )),
    }
}

#[cfg(test)]
mod tests;
