use super::*;
use crate::ha::standby::{serve, MAX_AUTH_HELLO_FRAME};
use crate::ha::sync::{decode_frame, read_frame, read_frame_raw, Mirror, AUTH_HELLO};
use crate::master::changes::ObjectRec;
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
