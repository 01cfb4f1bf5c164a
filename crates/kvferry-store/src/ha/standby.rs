//! The standby's side of a replication link: serves the replication port, answers the
//! cluster key's handshake and takes only the leader etcd names, then reads that leader's
//! frames into the [`super::sync::Mirror`] and acknowledges what it took; also how a link's
//! frames are read and written, plain or sealed (both sides use it). It decides nothing about
//! what the mirror holds: the mirror checks every frame, and nothing is acknowledged that it
//! did not take.

use super::sync::{
    decode_frame, encode_frame, read_frame_max, read_frame_raw, standby_identity, Mirror, ToLeader,
    ToStandby, AUTH_HELLO, HA_LINK, MAX_FRAME, MAX_SMALL_FRAME,
};
use crate::frame;
use serde::Deserialize;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest body of the first frame a standby holding the cluster key reads: a
/// [`ToStandby::AuthHello`] with the longest opening message. A longer length prefix is
/// refused before anything more is read.
pub const MAX_AUTH_HELLO_FRAME: usize = 1 + 2 + kvferry::auth::MAX_HELLO_LEN;

/// How long a leader's connection to a standby holding the cluster key has, from its
/// accept, to prove it: the handshake and its first sealed frame (the `Hello`), whole.
pub const PROOF_DEADLINE: Duration = Duration::from_secs(5);

/// The most connections a standby holding the cluster key keeps at once that did not prove
/// it yet, in all and from one address (`crate::net`'s `Unproved`): more are closed at
/// accept. (Only leaders link, one link per standby.)
pub const MAX_UNPROVED_LINKS: (usize, usize) = (32, 8);

/// How a link's frames arrive: plain, or sealed under the link's session (then `next` is the
/// length of the next frame when its head was opened ahead, by [`whole_in`]).
pub(crate) enum Incoming {
    Plain,
    Sealed {
        opener: kvferry::auth::Opener,
        next: Option<usize>,
    },
}

impl Incoming {
    pub(super) fn sealed(opener: kvferry::auth::Opener) -> Incoming {
        Incoming::Sealed { opener, next: None }
    }
}

/// [`read_frame_raw`] of a link's next frame, plain or sealed ([`Incoming`]): the frame as
/// [`encode_frame`] made it (a sealed one opened). A sealed frame that does not open
/// (injected, replayed, altered on the path) is an error.
pub(super) fn read_frame_in<T: for<'de> Deserialize<'de>>(
    r: &mut impl Read,
    inc: &mut Incoming,
    max: usize,
) -> Result<(T, Vec<u8>), String> {
    use kvferry::auth::{frame_body_len, FRAME_HEAD_LEN, MAX_MSG};
    let Incoming::Sealed { opener, next } = inc else {
        return read_frame_raw(r, max);
    };
    let refused = |e: kvferry::auth::Refusal| format!("a replication frame: {e}");
    let n = match next.take() {
        Some(n) => n,
        None => {
            let mut head = [0u8; FRAME_HEAD_LEN];
            r.read_exact(&mut head).map_err(|e| e.to_string())?;
            opener
                .open_frame_head(&head, max.min(MAX_FRAME))
                .map_err(refused)?
        }
    };
    let prefix = frame::prefix(n, max.min(MAX_FRAME))
        .map_err(|t| refused(kvferry::auth::Refusal::FrameTooLarge(t.len, t.max)))?;
    let len = frame_body_len(n);
    // (Grown as the bytes arrive.)
    let mut sealed = Vec::with_capacity(len.min(1 << 20));
    r.take(len as u64)
        .read_to_end(&mut sealed)
        .map_err(|e| e.to_string())?;
    if sealed.len() != len {
        return Err("a replication frame is cut short".into());
    }
    let mut raw = Vec::with_capacity(frame::PREFIX_LEN + n);
    raw.extend_from_slice(&prefix);
    for chunk in sealed.chunks(MAX_MSG) {
        let at = raw.len();
        raw.resize(at + chunk.len(), 0);
        let k = opener.open(chunk, &mut raw[at..]).map_err(refused)?;
        raw.truncate(at + k);
    }
    match decode_frame(&raw)? {
        Some((m, _)) => Ok((m, raw)),
        None => Err("a replication frame is cut short".into()),
    }
}

/// Whether `r`'s buffer starts with a whole frame of the link ([`frame::whole`]; for a sealed
/// one its head is opened ahead, once, and taken out of the buffer).
fn whole_in(r: &mut std::io::BufReader<TcpStream>, inc: &mut Incoming) -> Result<bool, String> {
    use kvferry::auth::{frame_body_len, FRAME_HEAD_LEN};
    use std::io::BufRead;
    let Incoming::Sealed { opener, next } = inc else {
        return Ok(frame::whole(r.buffer()));
    };
    let n = match *next {
        Some(n) => n,
        None => {
            let Some(head) = r.buffer().first_chunk::<FRAME_HEAD_LEN>() else {
                return Ok(false);
            };
            let n = opener
                .open_frame_head(head, MAX_FRAME)
                .map_err(|e| format!("a replication frame: {e}"))?;
            r.consume(FRAME_HEAD_LEN);
            *next = Some(n);
            n
        }
    };
    Ok(r.buffer().len() >= frame_body_len(n))
}

/// `raw` ([`encode_frame`]) as it goes on a link: sealed, without its plain length, when the
/// link is sealed.
pub(super) fn wire(sealer: Option<&mut kvferry::auth::Sealer>, raw: &[u8]) -> Vec<u8> {
    match sealer {
        None => raw.to_vec(),
        Some(sealer) => {
            let mut out = Vec::new();
            sealer.seal_frame(frame::body(raw), &mut out);
            out
        }
    }
}

/// Serves the replication port of a standby: each connection (a leader) feeds `mirror`.
/// Runs until the process ends.
/// With the cluster key, at most [`MAX_UNPROVED_LINKS`] connections that did not prove it yet
/// are kept (more are closed at accept), each for at most [`PROOF_DEADLINE`].
pub fn serve(listener: TcpListener, mirror: Arc<Mirror>) {
    let unproved = crate::net::Unproved::new(
        "HA replication",
        MAX_UNPROVED_LINKS.0,
        MAX_UNPROVED_LINKS.1,
        PROOF_DEADLINE,
    );
    for conn in listener.incoming() {
        let Some(s) = crate::net::accepted(conn, "HA replication: accepting a leader's connection")
        else {
            continue;
        };
        let Ok(slot) = unproved.place(mirror.auth.is_some(), &s) else {
            continue;
        };
        let m = Arc::clone(&mirror);
        let _ = std::thread::Builder::new()
            .name("kvf-ha-standby".into())
            .spawn(move || {
                if let Err(e) = follow(s, &m, slot) {
                    tracing::debug!("HA replication: a leader's connection ended: {e}");
                }
            });
    }
}

/// What a leader's connection proved: its `Hello`, and with the cluster key the halves of
/// the link's session.
type Accepted = (ToStandby, Incoming, Option<kvferry::auth::Sealer>);

/// The standby's side of a new connection, within `deadline`: without a cluster key, its
/// first frame (the leader's `Hello`, at most [`MAX_SMALL_FRAME`]); with one, the key's
/// handshake (`link::prove_to_standby`: the opening message in a plain frame whose length prefix
/// over [`MAX_AUTH_HELLO_FRAME`] is refused before anything more is read, read into a fixed
/// buffer, dialing `identity`), then the first sealed frame, which must open under the session
/// (only a leader holding it can seal one) and is the `Hello`. The error says why the
/// connection is refused (sent to the leader as [`ToLeader::Refused`] by the caller, sealed
/// with the sealer returned when the session exists).
fn accept_leader(
    s: &mut TcpStream,
    key: Option<&kvferry::auth::ClusterKey>,
    identity: &str,
    deadline: Instant,
) -> Result<Accepted, (String, Option<kvferry::auth::Sealer>)> {
    use crate::net::read_by;
    use kvferry::auth::FRAME_HEAD_LEN;
    let Some(key) = key else {
        s.set_read_timeout(Some(
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1)),
        ))
        .map_err(|e| (e.to_string(), None))?;
        return match read_frame_max(s, MAX_SMALL_FRAME).map_err(|e| (e, None))? {
            ToStandby::AuthHello { .. } => Err(("this standby has no cluster key (KVFERRY_AUTH_KEY_FILE is unset where it runs): give it the cluster's key file, or unset it on the leader".into(), None)),
            first => Ok((first, Incoming::Plain, None)),
        };
    };
    let io = |e: std::io::Error| (e.to_string(), None);
    let needs = "this standby requires the cluster key: set KVFERRY_AUTH_KEY_FILE on the leader to the cluster's key file";
    let mut prefix = [0u8; frame::PREFIX_LEN];
    read_by(s, &mut prefix, deadline).map_err(io)?;
    let n = frame::body_len(prefix, MAX_AUTH_HELLO_FRAME).map_err(|t| (format!("{needs} (its first frame claims {} bytes; the key's handshake is at most {MAX_AUTH_HELLO_FRAME})", t.len), None))?;
    let mut first = [0u8; MAX_AUTH_HELLO_FRAME];
    read_by(s, &mut first[..n], deadline).map_err(io)?;
    let Some(hello) = crate::proto::bytes_variant(&first[..n], AUTH_HELLO) else {
        return Err((needs.into(), None));
    };
    let (session, answer) = kvferry::auth::answer(key, HA_LINK, hello, &[identity])
        .map_err(|r| (format!("the leader's hello: {r}"), None))?;
    s.set_write_timeout(Some(PROOF_DEADLINE)).map_err(io)?;
    s.write_all(&encode_frame(&ToLeader::AuthChallenge { answer }).map_err(|e| (e, None))?)
        .map_err(io)?;
    let (sealer, opener) = session.split();
    let mut head = [0u8; FRAME_HEAD_LEN];
    let fail = |why: String, sealer| Err((why, Some(sealer)));
    if let Err(e) = read_by(s, &mut head, deadline) {
        return fail(e.to_string(), sealer);
    }
    let mut inc = Incoming::Sealed { opener, next: None };
    let Incoming::Sealed { opener, next } = &mut inc else {
        unreachable!("just made sealed")
    };
    match opener.open_frame_head(&head, MAX_SMALL_FRAME) {
        Ok(n) => *next = Some(n),
        Err(r) => {
            return fail(
                format!("the leader's first frame after the handshake: {r}"),
                sealer,
            )
        }
    }
    // (The head opened: the leader holds the session. Its hello is read by the deadline.)
    if let Err(e) = s.set_read_timeout(Some(
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1)),
    )) {
        return fail(e.to_string(), sealer);
    }
    match read_frame_in::<ToStandby>(s, &mut inc, MAX_SMALL_FRAME) {
        Ok((hello, _)) => Ok((hello, inc, Some(sealer))),
        Err(e) => fail(
            format!("the leader's first frame after the handshake: {e}"),
            sealer,
        ),
    }
}

fn follow(
    mut s: TcpStream,
    m: &Mirror,
    unproved: Option<crate::net::UnprovedSlot>,
) -> Result<(), String> {
    let _ = s.set_nodelay(true);
    // A leader says hello at once; a silent peer is not a leader.
    let deadline = Instant::now() + PROOF_DEADLINE;
    let (hello, inc, mut sealer) = match accept_leader(
        &mut s,
        m.auth.as_ref(),
        &standby_identity(&m.cluster_id, &m.member),
        deadline,
    ) {
        Ok(a) => a,
        Err((why, mut sealer)) => {
            let _ = s.write_all(&wire(
                sealer.as_mut(),
                &encode_frame(&ToLeader::Refused { why: why.clone() })?,
            ));
            return Err(why);
        }
    };
    drop(unproved);
    let ToStandby::Hello {
        cluster_id,
        term,
        lease,
        leader,
    } = hello
    else {
        let why = "the first frame is not a hello".to_string();
        let _ = s.write_all(&wire(
            sealer.as_mut(),
            &encode_frame(&ToLeader::Refused { why: why.clone() })?,
        ));
        return Err(why);
    };
    let conn = match m.hello(&cluster_id, term, lease) {
        Ok(c) => c,
        Err(why) => {
            let _ = s.write_all(&wire(
                sealer.as_mut(),
                &encode_frame(&ToLeader::Refused { why: why.clone() })?,
            ));
            return Err(why);
        }
    };
    tracing::info!(term, "HA replication: following the leader at {leader}");
    m.attach(conn, &s);
    let ended = entries(s, m, conn, inc, sealer);
    // (The mirror's copy of the socket would keep the connection open.)
    m.detach(conn);
    // Nothing feeds the mirror: if the leader died, this member may take over once its lease
    // runs out; the state is built meanwhile.
    m.prebuild();
    ended
}

/// Takes the entries of connection `conn` until it ends.
fn entries(
    mut s: TcpStream,
    m: &Mirror,
    conn: u64,
    mut inc: Incoming,
    mut sealer: Option<kvferry::auth::Sealer>,
) -> Result<(), String> {
    // Entries come as the leader writes them; an idle leader sends nothing for a while. A
    // leader whose host died without closing the connection is found by TCP keepalive (idle
    // 10 s, then 3 probes 5 s apart), so this thread and its buffer do not wait forever.
    s.set_read_timeout(None).map_err(|e| e.to_string())?;
    crate::net::keepalive(&s, Duration::from_secs(10));
    let mut r =
        std::io::BufReader::with_capacity(1 << 20, s.try_clone().map_err(|e| e.to_string())?);
    let spin = crate::net::Spin::for_replication();
    // The last entry taken and not acknowledged yet.
    let mut unacked = None;
    loop {
        if r.buffer().is_empty() {
            spin.readable(&s);
        }
        let (f, raw) = read_frame_in::<ToStandby>(&mut r, &mut inc, MAX_FRAME)?;
        match m.take_frame(conn, f, raw) {
            // One acknowledgement for the entries that came together: while another whole
            // frame is already read, it is taken first (acknowledgements are cumulative; a
            // frame that acknowledges nothing, such as a `Base`, keeps what one before it
            // would). Acknowledged before they are applied (held in memory, checked to be
            // the next ones): the leader's wait is the network's, not the map's.
            Ok(ack) => {
                unacked = ack.or(unacked);
                if !whole_in(&mut r, &mut inc)? {
                    if let Some(seq) = unacked.take() {
                        s.write_all(&wire(
                            sealer.as_mut(),
                            &encode_frame(&ToLeader::Ack { seq })?,
                        ))
                        .map_err(|e| e.to_string())?;
                    }
                    m.apply_pending();
                }
            }
            Err(why) => {
                let _ = s.write_all(&wire(
                    sealer.as_mut(),
                    &encode_frame(&ToLeader::Refused { why: why.clone() })?,
                ));
                return Err(why);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ha::sync::read_frame;
    use crate::master::changes::{Change, ObjectRec};

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

    /// Frames that came together get one acknowledgement, of the last entry among them, even
    /// when a frame that acknowledges nothing (a run's start) comes after it: dropped, the
    /// leader would wait for an entry the standby holds until the standby left the set.
    #[test]
    fn an_entry_followed_by_a_run_start_in_one_read_is_acknowledged() {
        let m = Arc::new(Mirror::new("c", Duration::from_secs(5), 1 << 20));
        m.set_leader(Some((5, 50)));
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let m2 = Arc::clone(&m);
        std::thread::spawn(move || serve(listener, m2));
        let mut s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        s.write_all(
            &encode_frame(&ToStandby::Hello {
                cluster_id: "c".into(),
                term: 5,
                lease: 50,
                leader: "l".into(),
            })
            .expect("frame"),
        )
        .expect("hello");
        // (The hello is read on its own; what follows comes in one write, one read.)
        std::thread::sleep(Duration::from_millis(100));
        let mut bytes = Vec::new();
        for f in [
            ToStandby::Image {
                seq: 4,
                changes: vec![obj("a", 1)],
                last: true,
            },
            ToStandby::Entry {
                seq: 5,
                changes: vec![obj("b", 1)],
            },
            ToStandby::Base {
                seq: 5,
                written: true,
            },
        ] {
            bytes.extend(encode_frame(&f).expect("frame"));
        }
        s.write_all(&bytes).expect("frames");
        let mut acked = 0;
        while acked < 5 {
            match read_frame::<ToLeader>(&mut s) {
                Ok(ToLeader::Ack { seq }) => acked = seq,
                other => panic!(
                    "expected the acknowledgement of entry 5 (got {acked} so far), got {other:?}"
                ),
            }
        }
        assert_eq!(m.status().tail_base, Some(5));
    }
}
