//! The cluster key (`KVFERRY_AUTH_KEY_FILE`) on the engine's handshake and TCP data ports:
//! engines holding a key in common move bytes; an engine with another key, or none, is refused
//! at the handshake and at the data port, with the reason, and nothing of its requests touches
//! memory. Engines in one process on 127.0.0.1, over TCP.

use kvferry::auth::{ClusterKey, Exchange, Opening};
use kvferry::batch::FailCause;
use kvferry::wire::handshake::{self, MsgType};
use kvferry::wire::tcp::{self, DataHeader, Status};
use kvferry::{Config, Error, Opcode, TaskStatus, TransferEngine, TransferRequest};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::Duration;

/// The data connection's exchange, as every initiator must run it (the wire's contract).
const DATA: Exchange = Exchange { opener: "kvferry/tcp-data/initiator", answerer: "kvferry/tcp-data/target" };

/// A key file holding `lines` (one key per line), removed when the test process ends its use.
struct KeyFile(PathBuf);

impl Drop for KeyFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn key_file(name: &str, lines: &[&str]) -> KeyFile {
    let p = std::env::temp_dir().join(format!("kvferry-auth-test-{}-{name}", std::process::id()));
    std::fs::write(&p, lines.iter().map(|k| k.repeat(64 / k.len().max(1))).collect::<Vec<_>>().join("\n")).unwrap();
    KeyFile(p)
}

fn engine(key: Option<&KeyFile>) -> TransferEngine {
    TransferEngine::new(Config {
        transfer_timeout: Duration::from_secs(5),
        transport: kvferry::config::TransportMode::Tcp,
        auth_key_file: key.map(|k| k.0.clone()),
        ..Config::default()
    })
    .expect("engine starts")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn write(from: &TransferEngine, src: &[u8], seg: u64, remote: u64) -> kvferry::TransferStatus {
    let r = TransferRequest { opcode: Opcode::Write, source: src.as_ptr() as u64, target_id: seg, target_offset: remote, length: src.len() as u64 };
    from.transfer_sync(&[r], Duration::from_secs(10)).expect("submitted")
}

fn unauthorized(e: Error) -> String {
    match e {
        Error::Unauthorized { .. } => e.to_string(),
        other => panic!("expected Unauthorized, got {other}"),
    }
}

#[test]
fn engines_holding_a_key_in_common_move_bytes_and_one_with_another_key_or_none_is_refused_at_the_handshake() {
    let (k1, k2) = (key_file("k1", &["a"]), key_file("k2", &["b"]));
    // Mid-change: one host signs with the old key and accepts the new, the other the reverse.
    let (old_new, new_old) = (key_file("on", &["a", "b"]), key_file("no", &["b", "a"]));
    let target = engine(Some(&k1));
    let buf = vec![0u8; 1 << 20];
    target.register_memory(buf.as_ptr() as u64, buf.len() as u64, "*").unwrap();
    let remote = buf.as_ptr() as u64;

    let same = engine(Some(&k1));
    let src = pattern(1 << 20, 1);
    same.register_memory(src.as_ptr() as u64, src.len() as u64, "*").unwrap();
    let seg = same.open_segment(target.segment_name()).expect("the same key: the handshake proves it");
    let st = write(&same, &src, seg, remote);
    assert_eq!(st.status, TaskStatus::Completed, "{st:?}");
    assert_eq!(buf, src);
    // And READ, several pieces pipelined on the proved connections.
    let back = vec![0u8; 1 << 20];
    same.register_memory(back.as_ptr() as u64, back.len() as u64, "*").unwrap();
    let reqs: Vec<_> = (0..16u64)
        .map(|i| TransferRequest { opcode: Opcode::Read, source: back.as_ptr() as u64 + i * 65536, target_id: seg, target_offset: remote + i * 65536, length: 65536 })
        .collect();
    let st = same.transfer_sync(&reqs, Duration::from_secs(10)).unwrap();
    assert_eq!(st.status, TaskStatus::Completed, "{st:?}");
    assert_eq!(back, src);

    // A key changing: both hosts accept both keys, each signing with another.
    let (a, b) = (engine(Some(&old_new)), engine(Some(&new_old)));
    let bbuf = vec![0u8; 4096];
    b.register_memory(bbuf.as_ptr() as u64, 4096, "*").unwrap();
    let asrc = pattern(4096, 9);
    a.register_memory(asrc.as_ptr() as u64, 4096, "*").unwrap();
    let seg = a.open_segment(b.segment_name()).expect("mid-change");
    assert_eq!(write(&a, &asrc, seg, bbuf.as_ptr() as u64).status, TaskStatus::Completed);
    assert_eq!(bbuf, asrc);

    // Another key: the initiator finds the engine's MAC is not under its key.
    let other = engine(Some(&k2));
    let e = unauthorized(other.open_segment(target.segment_name()).expect_err("another key"));
    assert!(e.contains("another key") && e.contains("KVFERRY_AUTH_KEY_FILE"), "{e}");
    // No key, towards a keyed engine: refused, saying why.
    let none = engine(None);
    let e = unauthorized(none.open_segment(target.segment_name()).expect_err("no key"));
    assert!(e.contains("holds no KVFERRY_AUTH_KEY_FILE"), "{e}");
    // A keyed engine towards one without a key: refused too (it would hand its KV cache to
    // a peer that proved nothing).
    let e = unauthorized(same.open_segment(none.segment_name()).expect_err("peer without a key"));
    assert!(e.contains("this engine none"), "{e}");

    // A raw request without the exchange gets the refusal as an `Auth` frame; a liveness
    // probe still finds the engine alive.
    let mut s = TcpStream::connect(("127.0.0.1", target.rpc_port())).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(&handshake::encode(MsgType::Metadata, b"{}")).unwrap();
    let mut reply = Vec::new();
    let _ = s.read_to_end(&mut reply);
    let (f, _) = handshake::decode(&reply, 1 << 20).unwrap().expect("a whole frame");
    assert_eq!(f.kind, MsgType::Auth);
    assert!(String::from_utf8_lossy(&f.body).contains("KVFERRY_AUTH_KEY_FILE"), "{:?}", String::from_utf8_lossy(&f.body));
    assert!(!String::from_utf8_lossy(&reply).contains("buffers"), "no descriptor leaves before the exchange");
    assert!(kvferry::handshake::answers("127.0.0.1", target.rpc_port(), Duration::from_secs(1), 1 << 20));
}

/// A peer that learned a keyed engine's descriptor elsewhere (a metadata service, another
/// engine) still cannot reach its memory through the data port: without the key its
/// requests are refused, and so is a made-up proof; the exchange done right lets it in.
#[test]
fn a_keyed_engines_data_port_moves_nothing_for_a_connection_that_did_not_prove_the_key() {
    let k1 = key_file("d1", &["c"]);
    let target = engine(Some(&k1));
    let buf = vec![0u8; 65536];
    target.register_memory(buf.as_ptr() as u64, buf.len() as u64, "*").unwrap();
    let remote = buf.as_ptr() as u64;
    let port = target.data_port();
    let connect = || {
        let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s
    };

    // A WRITE straight away: answered Unauthorized, closed, nothing written.
    let mut s = connect();
    s.write_all(&DataHeader { size: 4096, addr: remote, opcode: Opcode::Write, v2: true }.encode()).unwrap();
    let _ = s.write_all(&[0xAB; 4096]);
    let mut st = [0u8; 8];
    s.read_exact(&mut st).unwrap();
    assert_eq!(tcp::decode_status(st), Ok(Status::Unauthorized));
    assert_eq!(s.read(&mut st).unwrap_or(0), 0, "closed after the refusal");
    // A READ straight away: nothing of the memory leaves.
    let mut s = connect();
    s.write_all(&DataHeader { size: 4096, addr: remote, opcode: Opcode::Read, v2: true }.encode()).unwrap();
    let mut all = Vec::new();
    let _ = s.read_to_end(&mut all);
    assert_eq!(all, tcp::encode_status(Status::Unauthorized).to_vec());
    // The opening frame, then a made-up proof.
    let mut s = connect();
    let open = Opening::default();
    s.write_all(&tcp::encode_auth_hello(&open.nonce().try_into().unwrap())).unwrap();
    let mut ch = [0u8; tcp::AUTH_CHALLENGE_LEN];
    s.read_exact(&mut ch).unwrap();
    s.write_all(&[0u8; tcp::AUTH_PROOF_LEN]).unwrap();
    s.read_exact(&mut st).unwrap();
    assert_eq!(tcp::decode_status(st), Ok(Status::Unauthorized));
    assert!(buf.iter().all(|&b| b == 0), "nothing landed");

    // The exchange under the key, then the same WRITE: it lands.
    let key = ClusterKey::load(&k1.0).unwrap();
    let mut s = connect();
    let open = Opening::default();
    s.write_all(&tcp::encode_auth_hello(&open.nonce().try_into().unwrap())).unwrap();
    s.read_exact(&mut ch).unwrap();
    assert_eq!(tcp::decode_auth_answer(ch[..8].try_into().unwrap()), Ok(None), "a challenge");
    let (nonce, mac) = ch[8..].split_at(kvferry::auth::NONCE_LEN);
    s.write_all(&open.prove(&key, DATA, nonce, mac).expect("the engine proves the key")).unwrap();
    s.read_exact(&mut st).unwrap();
    assert_eq!(tcp::decode_status(st), Ok(Status::Ok));
    s.write_all(&DataHeader { size: 4096, addr: remote, opcode: Opcode::Write, v2: true }.encode()).unwrap();
    s.write_all(&[0xCD; 4096]).unwrap();
    s.read_exact(&mut st).unwrap();
    assert_eq!(tcp::decode_status(st), Ok(Status::Ok));
    assert!(buf[..4096].iter().all(|&b| b == 0xCD) && buf[4096..].iter().all(|&b| b == 0));

    // An engine without the key, handed the keyed engine's descriptor by a relay that
    // answers its handshake: its transfer fails with the cause and the reason, and nothing
    // lands.
    let desc = kvferry::handshake::request("127.0.0.1", target.rpc_port(), MsgType::Metadata, b"", Duration::from_secs(2), Duration::from_secs(5), 1 << 20, Some(&key))
        .expect("a keyed request gets the descriptor");
    let relay = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let relay_name = format!("127.0.0.1:{}", relay.local_addr().unwrap().port());
    let mut json: serde_json::Value = serde_json::from_slice(&desc.body).unwrap();
    json["name"] = serde_json::Value::String(relay_name.clone());
    let body = json.to_string();
    std::thread::spawn(move || {
        for mut s in relay.incoming().flatten().take(4) {
            let mut len = [0u8; 8];
            if s.read_exact(&mut len).is_err() {
                continue;
            }
            let mut req = vec![0u8; u64::from_le_bytes(len) as usize];
            let _ = s.read_exact(&mut req);
            let _ = s.write_all(&handshake::encode(MsgType::Metadata, body.as_bytes()));
        }
    });
    let none = engine(None);
    let src = pattern(4096, 3);
    none.register_memory(src.as_ptr() as u64, 4096, "*").unwrap();
    let seg = none.open_segment(&relay_name).expect("the relay's descriptor");
    let st = write(&none, &src, seg, remote + 8192);
    assert_eq!(st.status, TaskStatus::Failed, "{st:?}");
    assert_eq!(st.cause, Some(FailCause::Unauthorized), "{st:?}");
    assert!(st.reason.as_deref().unwrap_or("").contains("KVFERRY_AUTH_KEY_FILE"), "{st:?}");
    assert!(buf[4096..].iter().all(|&b| b == 0), "nothing landed");
}

/// A data port that accepts and then says nothing (a hung or hostile peer, or one whose
/// handshake a relay with the key answered): the exchange waits no longer than the requests'
/// deadline, and they end TIMEOUT rather than hang.
#[test]
fn a_data_port_that_never_answers_the_exchange_fails_the_requests_by_their_deadline() {
    let k = key_file("s1", &["d"]);
    let key = std::sync::Arc::new(ClusterKey::load(&k.0).unwrap());
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let data_port = silent.local_addr().unwrap().port();
    let held = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let h2 = std::sync::Arc::clone(&held);
    std::thread::spawn(move || {
        for s in silent.incoming().flatten().take(8) {
            h2.lock().unwrap().push(s);
        }
    });
    let hs = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let hs_port = hs.local_addr().unwrap().port();
    let remote = 0x1000_0000u64;
    let desc = format!(
        r#"{{"name":"127.0.0.1:{hs_port}","protocol":"tcp","tcp_data_port":{data_port},"tcp_proto_version":2,"buffers":[{{"name":"cpu:0","addr":{remote},"length":16777216}}]}}"#
    );
    let handler: kvferry::handshake::Handler = std::sync::Arc::new(move |f: &handshake::Frame| if f.kind == MsgType::Metadata { desc.clone().into_bytes() } else { b"{}".to_vec() });
    let server = kvferry::handshake::HandshakeServer::start(hs, 1 << 20, handler, Some(key)).unwrap();
    let e = TransferEngine::new(Config {
        transfer_timeout: Duration::from_secs(2),
        transport: kvferry::config::TransportMode::Tcp,
        auth_key_file: Some(k.0.clone()),
        ..Config::default()
    })
    .expect("engine starts");
    let src = pattern(4096, 5);
    e.register_memory(src.as_ptr() as u64, 4096, "*").unwrap();
    let seg = e.open_segment(&format!("127.0.0.1:{hs_port}")).expect("the relay proves the key");
    let t = std::time::Instant::now();
    let st = write(&e, &src, seg, remote);
    let took = t.elapsed();
    assert_eq!(st.status, TaskStatus::Timeout, "{st:?}");
    assert!(took < Duration::from_secs(4), "ended {took:?} after it began (deadline 2 s)");
    assert!(!held.lock().unwrap().is_empty(), "the engine did connect to the silent port");
    server.shutdown();
}
