//! The cluster key (`KVFERRY_AUTH_KEY_FILE`) on the engine's handshake and TCP data ports:
//! engines holding a key in common move bytes; an engine with another key, or none, is refused
//! at the handshake and at the data port, with the reason, and nothing of its requests touches
//! memory. A keyless host that relays, replays, reflects or floods gets nothing: a handshake
//! made for one segment is refused by another, every header after it is sealed to its
//! connection, and connections that have not proved the key are bounded. Engines in one
//! process on 127.0.0.1 (floods from 127.0.0.2), over TCP; the relay tests publish their
//! rewritten descriptors in a real Redis (`metadata_services`).

mod metadata_services;

use kvferry::auth::{ClusterKey, Initiator, Protocol, Sealer};
use kvferry::testing::wire::handshake::{self, MsgType};
use kvferry::testing::wire::tcp::{self, DataHeader, Status};
use kvferry::FailCause;
use kvferry::{Config, Error, Opcode, TaskStatus, TransferEngine, TransferRequest};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The data port's use of the key, as every initiator must name it (the wire's contract).
const DATA: Protocol = Protocol("kvferry/tcp-data/1");

/// A key file holding `lines` (one key per line), readable by its owner only, removed when the
/// test is done with it.
struct KeyFile(PathBuf);

impl Drop for KeyFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn key_file(name: &str, lines: &[&str]) -> KeyFile {
    use std::os::unix::fs::PermissionsExt;
    let p = std::env::temp_dir().join(format!("kvferry-auth-test-{}-{name}", std::process::id()));
    std::fs::write(
        &p,
        lines
            .iter()
            .map(|k| k.repeat(64 / k.len().max(1)))
            .collect::<Vec<_>>()
            .join("\n"),
    )
    .unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    KeyFile(p)
}

fn engine(key: Option<&KeyFile>) -> TransferEngine {
    TransferEngine::new(Config {
        transfer_timeout: Duration::from_secs(5),
        transport: kvferry::TransportMode::Tcp,
        auth_key_file: key.map(|k| k.0.clone()),
        ..Config::default()
    })
    .expect("engine starts")
}

/// An engine named `name` publishing itself in the metadata service at `meta`.
fn central(meta: &str, name: &str, key: &KeyFile) -> TransferEngine {
    TransferEngine::new(Config {
        local_hostname: name.into(),
        metadata_server: meta.into(),
        advertise_address: Some("127.0.0.1".into()),
        // (The keeper does not rewrite descriptors during a test: what the attacker wrote stays.)
        metadata_lease_ttl: Duration::from_secs(120),
        transfer_timeout: Duration::from_secs(5),
        transport: kvferry::TransportMode::Tcp,
        auth_key_file: Some(key.0.clone()),
        ..Config::default()
    })
    .unwrap_or_else(|e| panic!("engine {name}: {e}"))
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn write(from: &TransferEngine, src: &[u8], seg: u64, remote: u64) -> kvferry::TransferStatus {
    let r = TransferRequest {
        opcode: Opcode::Write,
        source: src.as_ptr() as u64,
        target_id: seg,
        target_offset: remote,
        length: src.len() as u64,
    };
    from.transfer_sync(&[r], Duration::from_secs(10))
        .expect("submitted")
}

fn unauthorized(e: Error) -> String {
    match e {
        Error::Unauthorized { .. } => e.to_string(),
        other => panic!("expected Unauthorized, got {other}"),
    }
}

#[test]
fn engines_holding_a_key_in_common_move_bytes_and_one_with_another_key_or_none_is_refused_at_the_handshake(
) {
    let (k1, k2) = (key_file("k1", &["a"]), key_file("k2", &["b"]));
    // Mid-change: one host opens with the old key and accepts the new, the other the reverse.
    let (old_new, new_old) = (key_file("on", &["a", "b"]), key_file("no", &["b", "a"]));
    let target = engine(Some(&k1));
    let buf = vec![0u8; 1 << 20];
    target
        .register_memory(buf.as_ptr() as u64, buf.len() as u64, "*")
        .unwrap();
    let remote = buf.as_ptr() as u64;

    let same = engine(Some(&k1));
    let src = pattern(1 << 20, 1);
    same.register_memory(src.as_ptr() as u64, src.len() as u64, "*")
        .unwrap();
    let seg = same
        .open_segment(target.segment_name())
        .expect("the same key: the handshake proves it");
    let st = write(&same, &src, seg, remote);
    assert_eq!(st.status, TaskStatus::Completed, "{st:?}");
    assert_eq!(buf, src);
    // And READ, several pieces pipelined on the keyed connections.
    let back = vec![0u8; 1 << 20];
    same.register_memory(back.as_ptr() as u64, back.len() as u64, "*")
        .unwrap();
    let reqs: Vec<_> = (0..16u64)
        .map(|i| TransferRequest {
            opcode: Opcode::Read,
            source: back.as_ptr() as u64 + i * 65536,
            target_id: seg,
            target_offset: remote + i * 65536,
            length: 65536,
        })
        .collect();
    let st = same.transfer_sync(&reqs, Duration::from_secs(10)).unwrap();
    assert_eq!(st.status, TaskStatus::Completed, "{st:?}");
    assert_eq!(back, src);
    // A lone small request (run in the caller's thread on an idle lane) too.
    let small = vec![0u8; 64];
    same.register_memory(small.as_ptr() as u64, 64, "*")
        .unwrap();
    let r = TransferRequest {
        opcode: Opcode::Read,
        source: small.as_ptr() as u64,
        target_id: seg,
        target_offset: remote + 64,
        length: 64,
    };
    assert_eq!(
        same.transfer_sync(&[r], Duration::from_secs(10))
            .unwrap()
            .status,
        TaskStatus::Completed
    );
    assert_eq!(small, src[64..128]);

    // A key changing: both hosts accept both keys, each opening with another.
    let (a, b) = (engine(Some(&old_new)), engine(Some(&new_old)));
    let bbuf = vec![0u8; 4096];
    b.register_memory(bbuf.as_ptr() as u64, 4096, "*").unwrap();
    let asrc = pattern(4096, 9);
    a.register_memory(asrc.as_ptr() as u64, 4096, "*").unwrap();
    let seg = a.open_segment(b.segment_name()).expect("mid-change");
    assert_eq!(
        write(&a, &asrc, seg, bbuf.as_ptr() as u64).status,
        TaskStatus::Completed
    );
    assert_eq!(bbuf, asrc);

    // Another key: the engine finds the opening message is not under its key.
    let other = engine(Some(&k2));
    let e = unauthorized(
        other
            .open_segment(target.segment_name())
            .expect_err("another key"),
    );
    assert!(
        e.contains("another key") && e.contains("KVFERRY_AUTH_KEY_FILE"),
        "{e}"
    );
    // No key, towards a keyed engine: refused, saying why.
    let none = engine(None);
    let e = unauthorized(
        none.open_segment(target.segment_name())
            .expect_err("no key"),
    );
    assert!(e.contains("holds no KVFERRY_AUTH_KEY_FILE"), "{e}");
    // A keyed engine towards one without a key: refused too (it would hand its KV cache to
    // a peer that proved nothing).
    let e = unauthorized(
        same.open_segment(none.segment_name())
            .expect_err("peer without a key"),
    );
    assert!(e.contains("this engine none"), "{e}");

    // A raw request without the handshake gets the refusal as an `Auth` frame; a liveness
    // probe still finds the engine alive.
    let mut s = TcpStream::connect(("127.0.0.1", target.rpc_port())).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(&handshake::encode(MsgType::Metadata, b"{}"))
        .unwrap();
    let mut reply = Vec::new();
    let _ = s.read_to_end(&mut reply);
    let (f, _) = handshake::decode(&reply, 1 << 20)
        .unwrap()
        .expect("a whole frame");
    assert_eq!(f.kind, MsgType::Auth);
    assert!(
        String::from_utf8_lossy(&f.body).contains("KVFERRY_AUTH_KEY_FILE"),
        "{:?}",
        String::from_utf8_lossy(&f.body)
    );
    assert!(
        !String::from_utf8_lossy(&reply).contains("buffers"),
        "no descriptor leaves before the handshake"
    );
    assert!(kvferry::handshake::answers(
        "127.0.0.1",
        target.rpc_port(),
        Duration::from_secs(1),
        1 << 20
    ));
}

/// The data port's handshake run by hand, dialing `segment`: the connection and its session,
/// or the status the target refused with.
fn data_handshake(
    port: u16,
    key: &ClusterKey,
    segment: &str,
) -> Result<(TcpStream, Sealer, Vec<u8>), Status> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let (init, msg) = Initiator::new(key, DATA, segment).unwrap();
    let mut wire = tcp::encode_auth_hello(msg.len(), 0).to_vec();
    wire.extend_from_slice(&msg);
    s.write_all(&wire).unwrap();
    let mut first = [0u8; 8];
    s.read_exact(&mut first).unwrap();
    if let Some(st) = tcp::decode_auth_answer(first).unwrap() {
        return Err(st);
    }
    let mut ans = [0u8; tcp::AUTH_ANSWER_LEN - 8];
    s.read_exact(&mut ans).unwrap();
    let (seal, _open) = init
        .finish(&ans)
        .expect("the target proves the key")
        .split();
    Ok((s, seal, wire))
}

/// Whether the target closed `s` without a byte more.
fn closed_silently(s: &mut TcpStream) -> bool {
    let mut rest = Vec::new();
    matches!(s.read_to_end(&mut rest), Ok(0)) || rest.is_empty()
}

/// A peer that learned a keyed engine's descriptor elsewhere (a metadata service, another
/// engine) still cannot reach its memory through the data port: without the key its
/// requests are refused; a handshake under another key, or made for another segment, is
/// refused; after a good handshake, a plain header (what a relay would inject) closes the
/// connection untouched; a captured handshake and sealed WRITE replayed on a new connection
/// land nothing; the handshake done right lets the WRITE in.
#[test]
fn a_keyed_engines_data_port_moves_nothing_for_a_connection_that_did_not_prove_the_key() {
    let k1 = key_file("d1", &["c"]);
    let target = engine(Some(&k1));
    let mut buf = vec![0u8; 65536];
    target
        .register_memory(buf.as_ptr() as u64, buf.len() as u64, "*")
        .unwrap();
    let remote = buf.as_ptr() as u64;
    let port = target.data_port();
    let name = target.segment_name().to_string();
    let key = ClusterKey::load(&k1.0).unwrap();
    let connect = || {
        let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s
    };

    // A WRITE straight away: answered Unauthorized, closed, nothing written.
    let mut s = connect();
    s.write_all(
        &DataHeader {
            size: 4096,
            addr: remote,
            opcode: Opcode::Write,
            v2: true,
        }
        .encode(),
    )
    .unwrap();
    let _ = s.write_all(&[0xAB; 4096]);
    let mut st = [0u8; 8];
    s.read_exact(&mut st).unwrap();
    assert_eq!(tcp::decode_status(st), Ok(Status::Unauthorized));
    assert_eq!(s.read(&mut st).unwrap_or(0), 0, "closed after the refusal");
    // A READ straight away: nothing of the memory leaves.
    let mut s = connect();
    s.write_all(
        &DataHeader {
            size: 4096,
            addr: remote,
            opcode: Opcode::Read,
            v2: true,
        }
        .encode(),
    )
    .unwrap();
    let mut all = Vec::new();
    let _ = s.read_to_end(&mut all);
    assert_eq!(all, tcp::encode_status(Status::Unauthorized).to_vec());
    // Another key; this key but another segment's name (a descriptor that sent it here).
    let other = ClusterKey::parse("z".repeat(64).as_bytes(), std::path::Path::new("z")).unwrap();
    assert_eq!(
        data_handshake(port, &other, &name).err(),
        Some(Status::Unauthorized),
        "another key"
    );
    assert_eq!(
        data_handshake(port, &key, "some-other-segment").err(),
        Some(Status::Unauthorized),
        "made for another segment"
    );
    // The handshake, then a plain header where a sealed one belongs: closed, nothing lands.
    let (mut s, _seal, _) = data_handshake(port, &key, &name).expect("handshake");
    s.write_all(
        &DataHeader {
            size: 4096,
            addr: remote,
            opcode: Opcode::Write,
            v2: true,
        }
        .encode(),
    )
    .unwrap();
    let _ = s.write_all(&[0xEE; 16 + 4096]);
    assert!(closed_silently(&mut s), "no status for an unsealed header");
    assert!(buf.iter().all(|&b| b == 0), "nothing landed");

    // The handshake done right, then a sealed WRITE: it lands. The bytes are captured.
    let (mut s, mut seal, mut captured) = data_handshake(port, &key, &name).expect("handshake");
    let mut req = Vec::new();
    seal.seal(
        &DataHeader {
            size: 4096,
            addr: remote,
            opcode: Opcode::Write,
            v2: true,
        }
        .encode(),
        &mut req,
    );
    req.extend_from_slice(&[0xCD; 4096]);
    s.write_all(&req).unwrap();
    let mut sealed_status = [0u8; tcp::SEALED_STATUS_LEN];
    s.read_exact(&mut sealed_status).unwrap();
    assert!(buf[..4096].iter().all(|&b| b == 0xCD) && buf[4096..].iter().all(|&b| b == 0));
    drop(s);
    // Replayed whole on a new connection (the same opening message, the same sealed WRITE,
    // 0xCD over bytes now zeroed): the target answers the opening message (it holds nothing
    // fresh from the target) but the sealed header does not open under the new session.
    captured.extend_from_slice(&req);
    // (No connection writes `buf` now: the one that did is closed.)
    buf[..4096].fill(0);
    let mut s = connect();
    s.write_all(&captured).unwrap();
    let mut answer = [0u8; tcp::AUTH_ANSWER_LEN];
    s.read_exact(&mut answer).unwrap();
    assert!(
        closed_silently(&mut s),
        "nothing answered to the replayed request"
    );
    assert!(
        buf.iter().all(|&b| b == 0),
        "the replayed WRITE landed nothing"
    );
}

/// A relay that copies a connection's bytes both ways, and may put its own before the
/// initiator's first bytes after the handshake (`inject`, to the target) — what a host
/// without the key can do once a keyed engine connects to it.
fn relay(to: u16, inject: Option<Vec<u8>>, answer_len: usize) -> (u16, Arc<Mutex<Vec<u8>>>) {
    tampering_relay(to, inject, None, answer_len)
}

/// [`relay`], which may also flip a byte of the initiator's stream (`flip_at`: its offset from
/// the connection's start) on its way.
fn tampering_relay(
    to: u16,
    inject: Option<Vec<u8>>,
    flip_at: Option<usize>,
    answer_len: usize,
) -> (u16, Arc<Mutex<Vec<u8>>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let seen2 = Arc::clone(&seen);
    std::thread::spawn(move || {
        for a in l.incoming().flatten().take(4) {
            let Ok(b) = TcpStream::connect(("127.0.0.1", to)) else {
                return;
            };
            let (mut a2, mut b2) = (a.try_clone().unwrap(), b.try_clone().unwrap());
            let (inject, seen) = (inject.clone(), Arc::clone(&seen2));
            // Target → initiator: as it comes; once the answer passed, the injection goes. The
            // signal is sent before the answer is passed on: the initiator's next bytes (its
            // request) can only be read after that, so they always find the injection due.
            let (tx, rx) = std::sync::mpsc::channel::<()>();
            std::thread::spawn(move || {
                let mut b = b;
                let mut buf = [0u8; 65536];
                let mut passed = 0;
                while let Ok(n) = b.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    passed += n;
                    if passed >= answer_len {
                        let _ = tx.send(());
                    }
                    if a2.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = a2.shutdown(std::net::Shutdown::Both);
            });
            std::thread::spawn(move || {
                let mut a = a;
                let mut buf = [0u8; 65536];
                let mut injected = inject.is_none();
                let mut at = 0usize;
                while let Ok(n) = a.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    if let Some(f) = flip_at.filter(|&f| f >= at && f < at + n) {
                        buf[f - at] ^= 0x01;
                    }
                    at += n;
                    seen.lock().unwrap().extend_from_slice(&buf[..n]);
                    if !injected && rx.recv_timeout(Duration::from_millis(0)).is_ok() {
                        let _ = b2.write_all(inject.as_deref().unwrap_or_default());
                        injected = true;
                    }
                    if b2.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = b2.shutdown(std::net::Shutdown::Both);
            });
        }
    });
    (port, seen)
}

/// A keyless host that can write the metadata service (which accepts any writer) points a
/// segment's entries at a keyed engine, or at itself relaying to one:
/// - the descriptor of segment `x` naming `b`'s data port: `a`'s connection reaches `b` with a
///   handshake made for `x`, which `b` refuses; nothing lands, the failure says why;
/// - `b`'s descriptor naming the relay: the handshake passes through (it was made for `b`),
///   but the relay's injected WRITE does not open at `b` (the connection closes, nothing of it
///   lands) and what it saw of `a`'s headers is sealed;
/// - `x`'s rpc_meta naming `b`'s handshake port: `b` refuses the handshake made for `x`, no
///   descriptor leaves;
/// - a relay on `b`'s handshake port that swaps the sealed request for its own: refused, no
///   descriptor leaves.
#[test]
fn a_keyless_relay_between_keyed_engines_reaches_nothing() {
    let Some(redis) = metadata_services::Service::redis() else {
        return;
    };
    let meta = format!("redis://127.0.0.1:{}", redis.port);
    let k = key_file("r1", &["r"]);
    let b = central(&meta, "seg-b", &k);
    let a = central(&meta, "seg-a", &k);
    let bbuf = vec![0u8; 1 << 16];
    b.register_memory(bbuf.as_ptr() as u64, bbuf.len() as u64, "*")
        .unwrap();
    let remote = bbuf.as_ptr() as u64;
    let src = pattern(8192, 4);
    a.register_memory(src.as_ptr() as u64, src.len() as u64, "*")
        .unwrap();
    let store = kvferry::metadata::connect(&meta, &kvferry::metadata::StoreOptions::default())
        .unwrap()
        .unwrap();
    let keys = kvferry::metadata::Keys::new(None);
    let desc_b: serde_json::Value = serde_json::from_slice(
        &store
            .get(&keys.ram("seg-b"))
            .unwrap()
            .expect("b's descriptor"),
    )
    .unwrap();
    let data_port_b = desc_b["tcp_data_port"].as_u64().unwrap() as u16;
    let publish = |name: &str, data_port: u16| {
        let mut d = desc_b.clone();
        d["name"] = name.into();
        d["tcp_data_port"] = data_port.into();
        store
            .put(&keys.ram(name), d.to_string().as_bytes())
            .unwrap();
        let meta_b = store
            .get(&keys.rpc_meta("seg-b"))
            .unwrap()
            .expect("b's rpc_meta");
        store.put(&keys.rpc_meta(name), &meta_b).unwrap();
    };

    // `x` sent straight to b's data port: a's handshake there, made for seg-x, is refused.
    publish("seg-x", data_port_b);
    let seg = a.open_segment("seg-x").expect("the rewritten descriptor");
    let st = write(&a, &src, seg, remote);
    assert_eq!(
        (st.status, st.cause),
        (TaskStatus::Failed, Some(FailCause::Unauthorized)),
        "{st:?}"
    );
    assert!(
        st.reason
            .as_deref()
            .unwrap_or("")
            .contains("not the engine of that segment name"),
        "{st:?}"
    );
    assert!(bbuf.iter().all(|&x| x == 0), "nothing landed");
    // So is a handshake-port request made for seg-x (its rpc_meta naming b's port).
    let key = ClusterKey::load(&k.0).unwrap();
    let e = unauthorized(
        kvferry::handshake::request(
            "127.0.0.1",
            b.rpc_port(),
            MsgType::Metadata,
            b"",
            Duration::from_secs(2),
            Duration::from_secs(3),
            1 << 20,
            Some((&key, "seg-x")),
        )
        .expect_err("made for seg-x"),
    );
    assert!(e.contains("seg-x") && e.contains("seg-b"), "{e}");

    // b's own descriptor rewritten to name a relay in front of b's data port, which injects a
    // WRITE of its own once the handshake passed.
    let evil = {
        let mut w = DataHeader {
            size: 4096,
            addr: remote,
            opcode: Opcode::Write,
            v2: true,
        }
        .encode()
        .to_vec();
        w.extend_from_slice(&[0x66; 4096]);
        w
    };
    let (relay_port, seen) = relay(data_port_b, Some(evil), tcp::AUTH_ANSWER_LEN);
    publish("seg-b", relay_port);
    let seg = a
        .open_segment("seg-b")
        .expect("b's handshake port answers for b");
    let st = write(&a, &src, seg, remote);
    assert_ne!(
        st.status,
        TaskStatus::Completed,
        "the connection the relay injected into is closed: {st:?}"
    );
    assert!(
        bbuf.iter().all(|&x| x != 0x66),
        "the relay's WRITE landed nothing"
    );
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.len() > tcp::SEALED_HEADER_LEN,
        "a's bytes went through the relay"
    );
    assert!(
        !seen.windows(8).any(|w| w == remote.to_le_bytes()),
        "a's request header (its address) crossed the relay sealed, not in the clear"
    );

    // A relay on b's handshake port that puts its own (unsealed) request where a's sealed one
    // goes: b answers nothing.
    let hs_b = b.rpc_port();
    let swap = handshake::encode(MsgType::Metadata, b"{}");
    let (hs_relay, _) = relay(hs_b, Some(swap), 8 + 1 + 1 + kvferry::auth::ANSWER_LEN);
    let r = kvferry::handshake::request(
        "127.0.0.1",
        hs_relay,
        MsgType::Metadata,
        b"",
        Duration::from_secs(2),
        Duration::from_secs(3),
        1 << 20,
        Some((&key, "seg-b")),
    );
    assert!(
        r.is_err(),
        "no descriptor through a relay that swapped the request: {r:?}"
    );
    let direct = kvferry::handshake::request(
        "127.0.0.1",
        hs_b,
        MsgType::Metadata,
        b"",
        Duration::from_secs(2),
        Duration::from_secs(3),
        1 << 20,
        Some((&key, "seg-b")),
    );
    assert!(
        direct.is_ok_and(|f| String::from_utf8_lossy(&f.body).contains("buffers")),
        "b still answers a keyed request"
    );
    drop((a, b));
}

/// What something on the path can do to the bytes a keyed engine moves depends on
/// `KVFERRY_AUTH_PROTECT`: with `headers` (the default) a relay in front of the target that
/// flips one byte of a WRITE's body gets it landed (the threat model says so: only headers are
/// sealed); with `payload` or `encrypt` the WRITE fails instead. Each setting moves 1 MiB both
/// ways byte for byte when nothing is altered, and a target requiring more than an initiator
/// asks refuses it.
#[test]
fn what_the_path_can_do_to_the_bytes_moved_depends_on_the_protection_asked() {
    use kvferry::auth::Protect;
    let Some(redis) = metadata_services::Service::redis() else {
        return;
    };
    let meta = format!("redis://127.0.0.1:{}", redis.port);
    let k = key_file("p1", &["p"]);
    let with = |name: &str, protect: Protect| {
        let base = Config {
            local_hostname: name.into(),
            metadata_server: meta.clone(),
            advertise_address: Some("127.0.0.1".into()),
            metadata_lease_ttl: Duration::from_secs(120),
            transfer_timeout: Duration::from_secs(5),
            transport: kvferry::TransportMode::Tcp,
            auth_key_file: Some(k.0.clone()),
            ..Config::default()
        };
        TransferEngine::new(Config {
            auth_protect: protect,
            ..base
        })
        .unwrap_or_else(|e| panic!("engine {name}: {e}"))
    };
    let store = kvferry::metadata::connect(&meta, &kvferry::metadata::StoreOptions::default())
        .unwrap()
        .unwrap();
    let keys = kvferry::metadata::Keys::new(None);
    for (i, protect) in [Protect::Headers, Protect::Payload, Protect::Encrypt]
        .into_iter()
        .enumerate()
    {
        let (bn, an) = (format!("pb{i}"), format!("pa{i}"));
        let b = with(&bn, protect);
        let a = with(&an, protect);
        let bbuf = vec![0u8; 2 << 20];
        b.register_memory(bbuf.as_ptr() as u64, bbuf.len() as u64, "*")
            .unwrap();
        let remote = bbuf.as_ptr() as u64;
        let src = pattern(1 << 20, 6 + i as u8);
        a.register_memory(src.as_ptr() as u64, src.len() as u64, "*")
            .unwrap();
        let back = vec![0u8; 1 << 20];
        a.register_memory(back.as_ptr() as u64, back.len() as u64, "*")
            .unwrap();
        let seg = a.open_segment(&bn).expect("open");
        assert_eq!(
            write(&a, &src, seg, remote).status,
            TaskStatus::Completed,
            "{protect:?}"
        );
        assert_eq!(&bbuf[..1 << 20], &src[..], "{protect:?}");
        let r = TransferRequest {
            opcode: Opcode::Read,
            source: back.as_ptr() as u64,
            target_id: seg,
            target_offset: remote,
            length: 1 << 20,
        };
        assert_eq!(
            a.transfer_sync(&[r], Duration::from_secs(10))
                .unwrap()
                .status,
            TaskStatus::Completed,
            "{protect:?}"
        );
        assert_eq!(back, src, "{protect:?}: READ back");

        // Through a relay that flips the 100th byte of the next WRITE's body.
        let mut desc: serde_json::Value =
            serde_json::from_slice(&store.get(&keys.ram(&bn)).unwrap().unwrap()).unwrap();
        let data_port = desc["tcp_data_port"].as_u64().unwrap() as u16;
        let hello = 24 + kvferry::auth::hello_len(bn.len());
        let (relay_port, _) = tampering_relay(
            data_port,
            None,
            Some(hello + tcp::SEALED_HEADER_LEN + 100),
            tcp::AUTH_ANSWER_LEN,
        );
        desc["tcp_data_port"] = relay_port.into();
        // (b's own descriptor, rewritten: the handshake made for b passes through the relay.)
        store
            .put(&keys.ram(&bn), desc.to_string().as_bytes())
            .unwrap();
        let a2 = with(&format!("pa2{i}"), protect);
        a2.register_memory(src.as_ptr() as u64, src.len() as u64, "*")
            .unwrap();
        let seg = a2.open_segment(&bn).expect("open through the relay");
        let small = &src[..64 << 10];
        let st = write(&a2, small, seg, remote + (1 << 20));
        let landed = &bbuf[1 << 20..(1 << 20) + small.len()];
        match protect {
            Protect::Headers => {
                assert_eq!(
                    st.status,
                    TaskStatus::Completed,
                    "headers only: the body is not checked: {st:?}"
                );
                assert_eq!(
                    landed.iter().zip(small).filter(|(x, y)| x != y).count(),
                    1,
                    "the flipped byte landed"
                );
            }
            _ => assert_ne!(
                st.status,
                TaskStatus::Completed,
                "{protect:?}: an altered body fails the WRITE: {st:?}"
            ),
        }
    }
    // An initiator asking less than the target requires is refused, saying what to set.
    let b = with("pq-b", Protect::Encrypt);
    let a = with("pq-a", Protect::Headers);
    let bbuf = vec![0u8; 4096];
    b.register_memory(bbuf.as_ptr() as u64, 4096, "*").unwrap();
    let src = pattern(4096, 1);
    a.register_memory(src.as_ptr() as u64, 4096, "*").unwrap();
    let seg = a.open_segment("pq-b").expect("open");
    let st = write(&a, &src, seg, bbuf.as_ptr() as u64);
    assert_eq!(
        (st.status, st.cause),
        (TaskStatus::Failed, Some(FailCause::Unauthorized)),
        "{st:?}"
    );
    assert!(
        st.reason
            .as_deref()
            .unwrap_or("")
            .contains("KVFERRY_AUTH_PROTECT"),
        "{st:?}"
    );
}

/// A data port that accepts and then says nothing (a hung or hostile peer): the handshake
/// waits no longer than the requests' deadline, and they end TIMEOUT rather than hang.
#[test]
fn a_data_port_that_never_answers_the_handshake_fails_the_requests_by_their_deadline() {
    let k = key_file("s1", &["d"]);
    let key = Arc::new(ClusterKey::load(&k.0).unwrap());
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let data_port = silent.local_addr().unwrap().port();
    let held = Arc::new(Mutex::new(Vec::new()));
    let h2 = Arc::clone(&held);
    std::thread::spawn(move || {
        for s in silent.incoming().flatten().take(8) {
            h2.lock().unwrap().push(s);
        }
    });
    let hs = TcpListener::bind("127.0.0.1:0").unwrap();
    let hs_port = hs.local_addr().unwrap().port();
    let name = format!("127.0.0.1:{hs_port}");
    let remote = 0x1000_0000u64;
    let desc = format!(
        r#"{{"name":"{name}","protocol":"tcp","tcp_data_port":{data_port},"tcp_proto_version":2,"buffers":[{{"name":"cpu:0","addr":{remote},"length":16777216}}]}}"#
    );
    let handler: kvferry::testing::handshake::Handler = Arc::new(move |f: &handshake::Frame| {
        if f.kind == MsgType::Metadata {
            desc.clone().into_bytes()
        } else {
            b"{}".to_vec()
        }
    });
    let server = kvferry::testing::handshake::HandshakeServer::start(
        hs,
        1 << 20,
        handler,
        Some(kvferry::testing::auth::Keyed {
            key,
            names: vec![name.clone()],
        }),
    )
    .unwrap();
    let e = TransferEngine::new(Config {
        transfer_timeout: Duration::from_secs(2),
        transport: kvferry::TransportMode::Tcp,
        auth_key_file: Some(k.0.clone()),
        ..Config::default()
    })
    .expect("engine starts");
    let src = pattern(4096, 5);
    e.register_memory(src.as_ptr() as u64, 4096, "*").unwrap();
    let seg = e
        .open_segment(&name)
        .expect("the handshake port proves the key");
    let t = Instant::now();
    let st = write(&e, &src, seg, remote);
    let took = t.elapsed();
    assert_eq!(st.status, TaskStatus::Timeout, "{st:?}");
    assert!(
        took < Duration::from_secs(4),
        "ended {took:?} after it began (deadline 2 s)"
    );
    assert!(
        !held.lock().unwrap().is_empty(),
        "the engine did connect to the silent port"
    );
    server.shutdown();
}

/// Threads of this process now.
fn threads() -> usize {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap()
}

/// Resident memory of this process now, in bytes.
fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap()
        * 1024
}

/// Opens `n` connections to `port` from 127.0.0.2 (another source than the keyed engines'),
/// each sending `first` then holding the connection open.
fn flood(port: u16, n: usize, first: &[u8]) -> Vec<TcpStream> {
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        let sock =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        sock.bind(
            &"127.0.0.2:0"
                .parse::<std::net::SocketAddr>()
                .unwrap()
                .into(),
        )
        .unwrap();
        if sock
            .connect(&std::net::SocketAddr::from(([127, 0, 0, 1], port)).into())
            .is_err()
        {
            continue;
        }
        let mut s: TcpStream = sock.into();
        s.set_write_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let _ = s.write_all(first);
        held.push(s);
    }
    held
}

/// Without the key, 1000 idle connections and a stream of maximal frames against the
/// handshake and data ports of a keyed engine leave its threads and memory bounded (the
/// handshake port serves at most 256 connections, 64 from one source; the data port holds at
/// most 128 unproved, 32 from one source), while a keyed engine keeps moving bytes.
#[test]
fn floods_without_the_key_leave_threads_and_memory_bounded_and_keyed_peers_served() {
    let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    let _ = rustix::process::setrlimit(
        rustix::process::Resource::Nofile,
        rustix::process::Rlimit {
            current: nofile.maximum,
            maximum: nofile.maximum,
        },
    );
    let k = key_file("f1", &["f"]);
    let target = engine(Some(&k));
    let buf = vec![0u8; 1 << 20];
    target
        .register_memory(buf.as_ptr() as u64, buf.len() as u64, "*")
        .unwrap();
    let peer = engine(Some(&k));
    let src = pattern(1 << 20, 8);
    peer.register_memory(src.as_ptr() as u64, src.len() as u64, "*")
        .unwrap();
    let seg = peer.open_segment(target.segment_name()).expect("keyed");
    assert_eq!(
        write(&peer, &src, seg, buf.as_ptr() as u64).status,
        TaskStatus::Completed
    );
    let (threads0, rss0) = (threads(), rss());

    // Idle connections, and ones that send the largest frame each port reads before the
    // proof (a handshake frame claiming 128 MiB; an opening frame claiming 2^40 bytes).
    let mut held = flood(target.rpc_port(), 500, &[]);
    held.extend(flood(target.data_port(), 500, &[]));
    let mut huge = (128u64 << 20).to_le_bytes().to_vec();
    huge.push(MsgType::Auth as u8);
    huge.extend_from_slice(&[0u8; 4096]);
    held.extend(flood(target.rpc_port(), 100, &huge));
    held.extend(flood(
        target.data_port(),
        100,
        &tcp::encode_auth_hello(1 << 40, 0),
    ));
    let (threads1, rss1) = (threads(), rss());
    assert!(
        threads1 <= threads0 + 64 + 32 + 8,
        "threads {threads0} -> {threads1} with {} connections held",
        held.len()
    );
    assert!(rss1 < rss0 + (64 << 20), "resident memory {rss0} -> {rss1}");

    // A keyed engine is still served, handshake and data, within a usual time.
    let t = Instant::now();
    let fresh = engine(Some(&k));
    fresh
        .register_memory(src.as_ptr() as u64, src.len() as u64, "*")
        .unwrap();
    let seg = fresh
        .open_segment(target.segment_name())
        .expect("a keyed handshake during the flood");
    let st = write(&fresh, &src, seg, buf.as_ptr() as u64);
    assert_eq!(st.status, TaskStatus::Completed, "{st:?}");
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "served in {:?}",
        t.elapsed()
    );
    drop(held);
}
