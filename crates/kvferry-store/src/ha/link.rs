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
use crate::master::journal::Change;
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
mod tests {
    use super::*;
    use crate::ha::standby::{serve, MAX_AUTH_HELLO_FRAME};
    use crate::ha::sync::{decode_frame, read_frame, read_frame_raw, Mirror, AUTH_HELLO};
    use crate::master::journal::ObjectRec;
    use std::io::Read;
    use std::net::TcpListener;

    fn obj(key: &str, size: u64) -> Change {
        Change::Object {
            key: key.into(),
            rec: ObjectRec {
                size,
                current: smallvec::smallvec![(1, 4096, size)],
                pending: None,
                owner: 7,
                hard_pin: false,
                soft_pin_left: 0,
                group: None,
            },
        }
    }

    struct Sink;
    impl AckSink for Sink {
        fn acked(&self) {}
        fn broke(&self) {}
    }

    fn cluster_key(c: char) -> Option<kvferry::auth::ClusterKey> {
        Some(
            kvferry::auth::ClusterKey::parse(
                c.to_string().repeat(64).as_bytes(),
                std::path::Path::new("k"),
            )
            .expect("key"),
        )
    }

    /// A standby of cluster "c", member "s", holding `key`, following the leader of term 5,
    /// served on 127.0.0.1: its mirror and address.
    fn standby(key: Option<kvferry::auth::ClusterKey>) -> (Arc<Mirror>, String) {
        let m = Arc::new(Mirror::new("c", Duration::from_secs(5), 1 << 20).with_auth(key, "s"));
        m.set_leader(Some((5, 50)));
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let m2 = Arc::clone(&m);
        std::thread::spawn(move || serve(listener, m2));
        (m, addr)
    }

    /// Links `member` at `addr` holding `key`, sends an image and an entry (an object each):
    /// the entry acknowledged, whether the link ended, and what the standby mirrors.
    fn link_to(
        member: &str,
        addr: &str,
        key: Option<kvferry::auth::ClusterKey>,
        m: &Mirror,
    ) -> (u64, bool, usize) {
        let hello = ToStandby::Hello {
            cluster_id: "c".into(),
            term: 5,
            lease: 50,
            leader: "l".into(),
        };
        let l = Link::open(member, addr, &hello, key, Arc::new(Sink)).expect("link");
        for f in [
            ToStandby::Image {
                seq: 1,
                changes: vec![obj("a", 1)],
                last: true,
            },
            ToStandby::Entry {
                seq: 2,
                changes: vec![obj("b", 1)],
            },
        ] {
            l.send(&Arc::new(encode_frame(&f).expect("frame")));
        }
        let until = Instant::now() + Duration::from_secs(5);
        while l.acked() < 2 && !l.dead() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        (l.acked(), l.dead(), m.status().objects)
    }

    /// With a cluster key, a leader links only to a standby that answers its handshake and a
    /// standby follows only a leader whose first sealed frame opens: holding the same key,
    /// entries flow (sealed, many frames, large ones in several messages) and are
    /// acknowledged; another key, a key on one side only, or a link dialing another member
    /// (a relay, a stale address) and the link ends before the hello, the mirror untouched.
    #[test]
    fn a_replication_link_needs_the_same_cluster_key_on_both_sides() {
        // (The handshake's frames came last: the others keep their wire numbers.)
        let first = |f: Vec<u8>| f[4];
        assert_eq!(
            [
                first(encode_frame(&ToStandby::AuthHello { hello: vec![] }).unwrap()),
                first(encode_frame(&ToStandby::AuthProof { mac: vec![] }).unwrap())
            ],
            [AUTH_HELLO, 6]
        );
        assert_eq!(
            first(encode_frame(&ToLeader::AuthChallenge { answer: vec![] }).unwrap()),
            2
        );
        let longest = encode_frame(&ToStandby::AuthHello {
            hello: vec![7; kvferry::auth::MAX_HELLO_LEN],
        })
        .unwrap();
        assert_eq!(longest.len() - 4, MAX_AUTH_HELLO_FRAME);
        assert_eq!(
            crate::proto::bytes_variant(&longest[4..], AUTH_HELLO),
            Some(&[7u8; kvferry::auth::MAX_HELLO_LEN][..])
        );
        let link = |leader: Option<kvferry::auth::ClusterKey>,
                    standby_key: Option<kvferry::auth::ClusterKey>| {
            let (m, addr) = standby(standby_key);
            link_to("s", &addr, leader, &m)
        };
        assert_eq!(
            link(cluster_key('a'), cluster_key('a')),
            (2, false, 2),
            "the same key: linked, both objects mirrored"
        );
        assert_eq!(
            link(None, None),
            (2, false, 2),
            "no key on either side, as before"
        );
        for (leader, standby, what) in [
            (cluster_key('a'), cluster_key('b')),
            (cluster_key('a'), None),
            (None, cluster_key('a')),
        ]
        .into_iter()
        .zip(["another key", "the standby has none", "the leader has none"])
        .map(|((l, s), w)| (l, s, w))
        {
            let (acked, dead, objects) = link(leader, standby);
            assert_eq!(
                (acked, dead, objects),
                (0, true, 0),
                "{what}: the link ends, nothing is mirrored"
            );
        }
        let (m, addr) = standby(cluster_key('a'));
        assert_eq!(
            link_to("t", &addr, cluster_key('a'), &m),
            (0, true, 0),
            "a link dialing member t, at member s's address"
        );
        let k = cluster_key('a').expect("key");
        let mut c = TcpStream::connect(&addr).expect("connect");
        c.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let (_, hello) =
            kvferry::auth::Initiator::new(&k, HA_LINK, &standby_identity("c", "t")).expect("hello");
        c.write_all(&encode_frame(&ToStandby::AuthHello { hello }).expect("frame"))
            .expect("send");
        match read_frame::<ToLeader>(&mut c) {
            Ok(ToLeader::Refused { why }) => assert!(
                why.contains("meant for \"standby/c/t\"") && why.contains("\"standby/c/s\""),
                "{why}"
            ),
            other => panic!("expected a refusal naming both members: {other:?}"),
        }
        // Sealed frames of every size open in order on the standby.
        let (m, addr) = standby(cluster_key('a'));
        let hello = ToStandby::Hello {
            cluster_id: "c".into(),
            term: 5,
            lease: 50,
            leader: "l".into(),
        };
        let l = Link::open("s", &addr, &hello, cluster_key('a'), Arc::new(Sink)).expect("link");
        let many: Vec<Change> = (0..20_000).map(|i| obj(&format!("k{i:06}"), 1)).collect();
        l.send(&Arc::new(
            encode_frame(&ToStandby::Image {
                seq: 1,
                changes: many,
                last: true,
            })
            .expect("frame"),
        ));
        for seq in 2..200 {
            l.send(&Arc::new(
                encode_frame(&ToStandby::Entry {
                    seq,
                    changes: vec![obj(&format!("e{seq}"), 1)],
                })
                .expect("frame"),
            ));
        }
        let until = Instant::now() + Duration::from_secs(10);
        while l.acked() < 199 && !l.dead() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!((l.acked(), l.dead()), (199, false));
        m.apply_pending();
        assert_eq!(m.status().objects, 20_000 + 198);
    }

    /// A keyless host between a keyed leader and its standby forwards the handshake, then
    /// injects a frame of its own, or alters or replays one of the leader's: the standby
    /// takes nothing of it (the frame does not open) and the link ends. A leader's hello and
    /// first frame replayed on a new connection: answered, then refused.
    #[test]
    fn a_relayed_link_whose_frames_are_injected_altered_or_replayed_is_refused() {
        enum Then {
            Inject,
            Alter,
            Replay,
        }
        for then in [Then::Inject, Then::Alter, Then::Replay] {
            let (m, addr) = standby(cluster_key('a'));
            // The relay: forwards the leader's hello and the standby's answer (plain frames),
            // then does `then` with what the leader sends next.
            let relay = TcpListener::bind("127.0.0.1:0").expect("bind");
            let at = relay.local_addr().expect("addr").to_string();
            let (addr2, m2) = (addr.clone(), Arc::clone(&m));
            let t = std::thread::spawn(move || {
                let (mut leader, _) = relay.accept().expect("accept");
                let mut standby = TcpStream::connect(&addr2).expect("connect");
                for s in [&leader, &standby] {
                    s.set_read_timeout(Some(Duration::from_secs(5)))
                        .expect("timeout");
                }
                let (_, hello) = read_frame_raw::<ToStandby>(&mut leader, MAX_SMALL_FRAME)
                    .expect("the leader's hello");
                standby.write_all(&hello).expect("forward");
                let (_, answer) =
                    read_frame_raw::<ToLeader>(&mut standby, MAX_SMALL_FRAME).expect("the answer");
                leader.write_all(&answer).expect("forward");
                // What the leader sends next: its sealed Hello, whose size the relay knows (the
                // sealed form of the hello the test's leader says).
                let said = encode_frame(&ToStandby::Hello {
                    cluster_id: "c".into(),
                    term: 5,
                    lease: 50,
                    leader: "l".into(),
                })
                .expect("frame");
                let mut next = vec![
                    0u8;
                    kvferry::auth::FRAME_HEAD_LEN
                        + kvferry::auth::frame_body_len(said.len() - 4)
                ];
                leader
                    .read_exact(&mut next)
                    .expect("the leader's sealed hello");
                match then {
                    Then::Inject => {
                        let mut f = encode_frame(&ToStandby::Hello {
                            cluster_id: "c".into(),
                            term: 5,
                            lease: 50,
                            leader: "relay".into(),
                        })
                        .expect("frame");
                        f.extend(
                            encode_frame(&ToStandby::Image {
                                seq: 1,
                                changes: vec![obj("injected", 1)],
                                last: true,
                            })
                            .expect("frame"),
                        );
                        standby.write_all(&f).expect("inject");
                    }
                    Then::Alter => {
                        let last = next.len() - 1;
                        next[last] ^= 1;
                        standby.write_all(&next).expect("forward");
                    }
                    Then::Replay => {
                        // A new connection: the hello replayed is answered, the frames are not taken.
                        let mut again = TcpStream::connect(&addr2).expect("connect");
                        again
                            .set_read_timeout(Some(Duration::from_secs(5)))
                            .expect("timeout");
                        again.write_all(&hello).expect("replay");
                        assert!(
                            matches!(
                                read_frame::<ToLeader>(&mut again),
                                Ok(ToLeader::AuthChallenge { .. })
                            ),
                            "a replayed hello gets an answer"
                        );
                        again.write_all(&next).expect("replay");
                        let mut rest = Vec::new();
                        let _ = again.read_to_end(&mut rest);
                        assert_eq!(m2.status().objects, 0, "nothing replayed was taken");
                        // (The real connection is not forwarded.)
                        return;
                    }
                }
                let mut rest = Vec::new();
                let _ = standby.read_to_end(&mut rest);
            });
            let hello = ToStandby::Hello {
                cluster_id: "c".into(),
                term: 5,
                lease: 50,
                leader: "l".into(),
            };
            let l = Link::open("s", &at, &hello, cluster_key('a'), Arc::new(Sink)).expect("link");
            l.send(&Arc::new(
                encode_frame(&ToStandby::Image {
                    seq: 1,
                    changes: vec![obj("a", 1)],
                    last: true,
                })
                .expect("frame"),
            ));
            t.join().expect("the relay");
            m.apply_pending();
            let st = m.status();
            assert_eq!(
                (st.objects, st.fed, l.acked()),
                (0, false, 0),
                "nothing taken from the relay"
            );
        }
    }

    /// An image's frames hold its changes in order, the last one marked; the caller is let in
    /// between frames once the encoding took `hold`, and can give the image up there.
    #[test]
    fn an_image_is_encoded_in_frames_letting_its_caller_in_between() {
        let changes: Vec<Change> = (0..3 * IMAGE_PIECE + 5)
            .map(|i| obj(&format!("k{i}"), 1))
            .collect();
        let mut calls = 0;
        let frames = image_frames(9, changes.clone(), Duration::ZERO, || {
            calls += 1;
            true
        })
        .expect("frames");
        assert_eq!(
            (frames.len(), calls),
            (4, 3),
            "let in between each two frames"
        );
        let mut back = Vec::new();
        for (i, f) in frames.iter().enumerate() {
            match decode_frame::<ToStandby>(f).expect("decodes") {
                Some((
                    ToStandby::Image {
                        seq: 9,
                        changes,
                        last,
                    },
                    _,
                )) => {
                    assert_eq!(last, i == 3);
                    back.extend(changes);
                }
                other => panic!("an image frame, got {other:?}"),
            }
        }
        assert_eq!(back, changes);
        let mut calls = 0;
        assert!(
            image_frames(9, changes.clone(), Duration::from_secs(3600), || {
                calls += 1;
                true
            })
            .is_ok()
        );
        assert_eq!(calls, 0, "not before the hold");
        let mut n = 0;
        let r = image_frames(9, changes, Duration::ZERO, || {
            n += 1;
            n < 2
        });
        assert!(r.is_err() && n == 2, "given up when the caller says so");
    }
}
