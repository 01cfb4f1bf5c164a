//! The master's RPC with a cluster key: proofs, relays, floods.

use super::*;

use kvferry::auth::{ClusterKey, Initiator, Opener, Sealer};

fn key(text: &str) -> ClusterKey {
    ClusterKey::parse(text.as_bytes(), std::path::Path::new("k")).expect("key")
}

/// A master of cluster "c" holding `key` (if any), served on 127.0.0.1.
fn keyed_master(key: Option<ClusterKey>) -> (Arc<Master>, MasterServer, std::net::SocketAddr) {
    let mut m = Master::new(MasterConfig::default());
    m.auth = key;
    m.cluster_id = "c".into();
    let m = Arc::new(m);
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server =
        MasterServer::start(Arc::clone(&m), listener, Duration::from_millis(50), 0).expect("start");
    (m, server, addr)
}

/// A plain frame's answer.
fn plain_answer(c: &mut TcpStream) -> Response {
    read_answer(c).expect("an answer")
}

/// The client's side of the key's handshake, by hand, dialing `identity`: the connection
/// and its session's halves, or the master's plain answer when it refused. `hello` gets
/// the opening message's frame as sent.
fn handshake(
    addr: std::net::SocketAddr,
    k: &ClusterKey,
    identity: &str,
    hello: &mut Vec<u8>,
) -> Result<(TcpStream, Sealer, Opener), Response> {
    let mut c = TcpStream::connect(addr).expect("connect");
    c.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let (init, h) = Initiator::new(k, proto::STORE_RPC, identity).expect("hello");
    *hello = proto::encode(&Request::AuthHello { hello: h }).expect("encode");
    c.write_all(hello).expect("send");
    match plain_answer(&mut c) {
        Response::AuthChallenge { answer } => {
            let (s, o) = init
                .finish(&answer)
                .expect("the master proves the key")
                .split();
            Ok((c, s, o))
        }
        other => Err(other),
    }
}

fn sealed_frame(s: &mut Sealer, req: &Request) -> Vec<u8> {
    let mut out = Vec::new();
    s.seal_frame(&proto::encode(req).expect("encode")[4..], &mut out);
    out
}

fn sealed_answer(c: &mut TcpStream, o: &mut Opener) -> std::io::Result<Response> {
    let mut head = [0u8; kvferry::auth::FRAME_HEAD_LEN];
    c.read_exact(&mut head)?;
    let n = o
        .open_frame_head(&head, proto::MAX_FRAME)
        .map_err(std::io::Error::other)?;
    let mut sealed = vec![0u8; kvferry::auth::frame_body_len(n)];
    c.read_exact(&mut sealed)?;
    let mut body = Vec::new();
    o.open_frame_body(&sealed, &mut body)
        .map_err(std::io::Error::other)?;
    proto::decode(&body).map_err(|e| std::io::Error::other(e.to_string()))
}

fn closed(c: &mut TcpStream) -> bool {
    matches!(c.read(&mut [0u8; 1]), Ok(0) | Err(_))
}

fn refused_saying(r: Response, what: &str) -> String {
    match r {
        Response::Err(StoreError::Unauthorized(why)) if why.contains(what) => why,
        other => panic!("expected a refusal saying {what:?}: {other:?}"),
    }
}

/// A master holding the cluster key serves a connection only once it ran the key's
/// handshake towards this master's cluster and its first sealed frame opened; every frame
/// after is sealed both ways. Anything else is refused with the reason and the connection
/// closed: a plain request first, a first frame longer than a handshake (refused on its
/// length alone), another key, another cluster, a handshake step after the proof. A client
/// whose file holds the master's key second (a key change) is served. A master without a
/// key refuses a client that wants to authenticate.
#[test]
fn a_connection_proves_the_cluster_key_before_any_request_or_is_refused_saying_why() {
    let (a, b) = ("a".repeat(64), "b".repeat(64));
    let (m, _server, addr) = keyed_master(Some(key(&a)));
    let me = proto::master_identity("c");
    let mut hello = Vec::new();
    for k in [key(&a), key(&format!("{a}\n{b}"))] {
        let (mut c, mut s, mut o) = handshake(addr, &k, &me, &mut hello).expect("served");
        c.write_all(&sealed_frame(
            &mut s,
            &Request::MountSegment {
                client: 1,
                segment: seg(m.lock().summary().segments as u64 + 1, 1 << 20),
            },
        ))
        .expect("send");
        assert_eq!(sealed_answer(&mut c, &mut o).expect("answer"), Response::Ok);
        // Pipelined: both answers come, in order, sealed.
        let mut two = sealed_frame(&mut s, &Request::ExistKey { key: "k".into() });
        two.extend(sealed_frame(&mut s, &Request::Ping { client: 1 }));
        c.write_all(&two).expect("send");
        assert_eq!(
            sealed_answer(&mut c, &mut o).expect("answer"),
            Response::Exists(false)
        );
        assert_eq!(
            sealed_answer(&mut c, &mut o).expect("answer"),
            Response::Ping(PingStatus::Ok)
        );
        // The handshake is not run again on a proved connection.
        c.write_all(&sealed_frame(
            &mut s,
            &Request::AuthHello { hello: vec![0; 48] },
        ))
        .expect("send");
        assert!(matches!(
            sealed_answer(&mut c, &mut o).expect("answer"),
            Response::Err(StoreError::InvalidParams(_))
        ));
        assert!(closed(&mut c));
    }
    assert_eq!(m.lock().summary().segments, 2);
    // A client opening with another key (it holds the master's second), or with no key.
    let e = handshake(addr, &key(&format!("{b}\n{a}")), &me, &mut hello).expect_err("refused");
    refused_saying(e, "another key");
    let mut raw = TcpStream::connect(addr).expect("connect");
    raw.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    raw.write_all(
        &proto::encode(&Request::MountSegment {
            client: 9,
            segment: seg(9, 1 << 20),
        })
        .expect("encode"),
    )
    .expect("send");
    refused_saying(
        plain_answer(&mut raw),
        "set KVFERRY_AUTH_KEY_FILE on this client",
    );
    assert!(closed(&mut raw));
    // A first frame longer than any handshake: refused on its length, nothing more read.
    let mut big = TcpStream::connect(addr).expect("connect");
    big.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    big.write_all(&(proto::MAX_FRAME as u32).to_le_bytes())
        .expect("send");
    refused_saying(
        plain_answer(&mut big),
        &format!("claims {} bytes", proto::MAX_FRAME),
    );
    // A client of another cluster.
    let e = handshake(addr, &key(&a), &proto::master_identity("other"), &mut hello)
        .expect_err("refused");
    eprintln!("{}", refused_saying(e, "serves another cluster"));
    assert_eq!(
        m.lock().summary().segments,
        2,
        "nothing of the refused connections applied"
    );
    // A master without a key.
    assert!(
        matches!(gate(false, Request::AuthHello { hello: vec![] }), Gate::Refuse(Response::Err(StoreError::Unauthorized(w))) if w.contains("has no cluster key"))
    );
    assert_eq!(
        gate(false, Request::Ping { client: 1 }),
        Gate::Pass(Request::Ping { client: 1 })
    );
    let (_open, _s2, open_addr) = keyed_master(None);
    assert!(
        matches!(handshake(open_addr, &key(&a), &me, &mut hello), Err(Response::Err(StoreError::Unauthorized(w))) if w.contains("has no cluster key"))
    );
    // The step of an earlier exchange, anywhere.
    assert!(matches!(
        gate(true, Request::AuthProof { mac: vec![] }),
        Gate::Refuse(Response::Err(StoreError::InvalidParams(_)))
    ));
    let j = journaling_leader(5);
    assert!(
        matches!(handle(&j, Request::Batch(vec![Request::AuthProof { mac: vec![] }])), Response::Batch(r) if matches!(&r[..], [Response::Err(StoreError::InvalidParams(_))]))
    );
}

/// What a keyless host on the path can do with a keyed client's connection: replay its
/// handshake and first sealed request on a new connection (the master answers the hello,
/// which holds nothing fresh from it, but the replayed frame does not open there), inject
/// a frame of its own after the handshake, or alter a sealed frame (its head or its
/// body, first or later): each is refused and nothing of it is applied; a refusal after
/// the handshake is sealed, so the client behind the relay reads why.
#[test]
fn a_replayed_handshake_or_an_injected_or_altered_frame_is_refused_and_nothing_applied() {
    let k = key(&"k".repeat(64));
    let (m, _server, addr) = keyed_master(Some(k.clone()));
    let me = proto::master_identity("c");
    assert_eq!(
        handle(
            &m,
            Request::MountSegment {
                client: 1,
                segment: seg(1, 1 << 20)
            }
        ),
        Response::Ok
    );
    assert!(matches!(
        handle(&m, put_start("victim", 4096)),
        Response::Replicas(_)
    ));
    assert_eq!(
        handle(
            &m,
            Request::PutEnd {
                client: 1,
                key: "victim".into(),
                put: 1
            }
        ),
        Response::Ok
    );
    let remove = Request::Remove {
        key: "victim".into(),
        force: true,
    };
    let exists = |m: &Master| {
        handle(
            m,
            Request::ExistKey {
                key: "victim".into(),
            },
        ) == Response::Exists(true)
    };
    // A real client's connection, captured: its hello and first sealed frame (a mount).
    let mut hello = Vec::new();
    let (mut c, mut s, mut o) = handshake(addr, &k, &me, &mut hello).expect("served");
    let first = sealed_frame(
        &mut s,
        &Request::MountSegment {
            client: 2,
            segment: seg(2, 1 << 20),
        },
    );
    c.write_all(&first).expect("send");
    assert_eq!(sealed_answer(&mut c, &mut o).expect("answer"), Response::Ok);
    assert_eq!(m.lock().summary().segments, 2);
    // Replayed on a new connection: answered, but the frame does not open; nothing applied.
    let mut r = TcpStream::connect(addr).expect("connect");
    r.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    r.write_all(&hello).expect("send");
    assert!(
        matches!(plain_answer(&mut r), Response::AuthChallenge { .. }),
        "a replayed hello gets an answer"
    );
    r.write_all(&first).expect("send");
    let mut rest = Vec::new();
    let _ = r.read_to_end(&mut rest);
    assert!(
        !rest.is_empty() && rest.len() < 1024,
        "a sealed refusal the replayer cannot read, then the end: {} bytes",
        rest.len()
    );
    assert_eq!(
        m.lock().summary().segments,
        2,
        "the replayed mount was not applied"
    );
    // A keyless relay injects its own (plain) request after a real handshake.
    let (mut c, _s, mut o) = handshake(addr, &k, &me, &mut hello).expect("served");
    // (Two removals in a batch: longer than a sealed frame's head, read whole as one.)
    c.write_all(
        &proto::encode(&Request::Batch(vec![remove.clone(), remove.clone()])).expect("encode"),
    )
    .expect("send");
    let why = refused_saying(
        sealed_answer(&mut c, &mut o).expect("the client reads why"),
        "does not open under this connection's session",
    );
    assert!(why.contains("nothing of it was applied"), "{why}");
    assert!(closed(&mut c));
    assert!(exists(&m), "the injected removal was not applied");
    // It alters a real client's sealed first frame: its head, or its body.
    for at in [0, kvferry::auth::FRAME_HEAD_LEN + 3] {
        let (mut c, mut s, mut o) = handshake(addr, &k, &me, &mut hello).expect("served");
        let mut f = sealed_frame(&mut s, &remove);
        f[at] ^= 1;
        c.write_all(&f).expect("send");
        refused_saying(
            sealed_answer(&mut c, &mut o).expect("the client reads why"),
            "does not open",
        );
        assert!(exists(&m), "an altered removal was not applied (byte {at})");
    }
    // Or a later frame: the connection ends, nothing applied.
    let (mut c, mut s, mut o) = handshake(addr, &k, &me, &mut hello).expect("served");
    c.write_all(&sealed_frame(&mut s, &Request::Ping { client: 1 }))
        .expect("send");
    assert_eq!(
        sealed_answer(&mut c, &mut o).expect("answer"),
        Response::Ping(PingStatus::Ok)
    );
    let mut f = sealed_frame(&mut s, &remove);
    let last = f.len() - 1;
    f[last] ^= 0x80;
    c.write_all(&f).expect("send");
    assert!(closed(&mut c));
    assert!(exists(&m), "an altered later removal was not applied");
    // (The removal itself, sealed and intact, is applied.)
    let (mut c, mut s, mut o) = handshake(addr, &k, &me, &mut hello).expect("served");
    c.write_all(&sealed_frame(&mut s, &remove)).expect("send");
    assert_eq!(sealed_answer(&mut c, &mut o).expect("answer"), Response::Ok);
    assert!(!exists(&m));
}

/// At most `total` connections hold a place before their proof, `per_ip` from one address;
/// a place is given back when its connection proves the key or ends.
#[test]
fn connections_not_yet_proved_are_bounded_in_all_and_per_address() {
    let u = Unproved::new("test", 5, 3, PROOF_DEADLINE);
    let (a, b, c): (std::net::IpAddr, std::net::IpAddr, std::net::IpAddr) = (
        "10.0.0.1".parse().unwrap(),
        "10.0.0.2".parse().unwrap(),
        "10.0.0.3".parse().unwrap(),
    );
    let from_a: Vec<_> = (0..3).map(|_| u.admit(a).expect("under the cap")).collect();
    assert!(u.admit(a).is_none(), "a fourth from one address");
    let from_b: Vec<_> = (0..2).map(|_| u.admit(b).expect("under the cap")).collect();
    assert!(u.admit(c).is_none(), "a sixth in all");
    assert_eq!(u.held(a), (5, 3));
    drop(from_a);
    assert_eq!(u.held(a), (2, 0));
    let more: Vec<_> = (0..3)
        .map(|_| u.admit(c).expect("places given back"))
        .collect();
    assert!(u.admit(a).is_none());
    drop((from_b, more));
    assert_eq!(u.held(b), (0, 0));
    assert_eq!(
        (u.held(a), u.held(c)),
        ((0, 0), (0, 0)),
        "every place is back (and no address kept: kvferry::auth's test)"
    );
}

/// A proof's reads end at its deadline however the bytes trickle in.
#[test]
fn a_proof_is_read_by_its_deadline_even_a_byte_at_a_time() {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let mut c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
    let (s, _) = l.accept().expect("accept");
    let t = Instant::now();
    std::thread::scope(|sc| {
        sc.spawn(|| {
            for _ in 0..20 {
                if c.write_all(&[1]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(40));
            }
        });
        let e = read_by(
            &s,
            &mut [0u8; 16],
            Instant::now() + Duration::from_millis(200),
        )
        .expect_err("not whole in time");
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
        assert!(
            t.elapsed() < Duration::from_millis(600),
            "{:?}",
            t.elapsed()
        );
    });
    read_by(&s, &mut [0u8; 1], Instant::now() + Duration::from_secs(5))
        .expect("a byte that is there");
}
