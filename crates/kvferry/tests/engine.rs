//! Two engines in one process on 127.0.0.1: data paths, bad input, faults.

use kvferry::testing::wire::handshake::{self, MsgType};
use kvferry::testing::wire::tcp::{self, DataHeader, Status};
use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn engine() -> TransferEngine {
    // TCP on purpose: these tests are about the TCP transport (same-host shared memory has tests/shm.rs).
    TransferEngine::new(Config {
        transfer_timeout: Duration::from_secs(5),
        transport: kvferry::TransportMode::Tcp,
        ..Config::default()
    })
    .expect("engine starts")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u8)
                .wrapping_mul(31)
                .wrapping_add(seed)
                .wrapping_add((i >> 12) as u8)
        })
        .collect()
}

fn req(op: Opcode, src: &[u8], target: u64, remote: u64, len: usize) -> TransferRequest {
    TransferRequest {
        opcode: op,
        source: src.as_ptr() as u64,
        target_id: target,
        target_offset: remote,
        length: len as u64,
    }
}

struct Pair {
    a: TransferEngine,
    b: TransferEngine,
    abuf: Vec<u8>,
    bbuf: Vec<u8>,
    seg: u64,
}

fn pair(size: usize) -> Pair {
    let a = engine();
    let b = engine();
    let abuf = pattern(size, 1);
    let bbuf = vec![0u8; size];
    a.register_memory(abuf.as_ptr() as u64, size as u64, "cpu:0")
        .unwrap();
    b.register_memory(bbuf.as_ptr() as u64, size as u64, "*")
        .unwrap();
    let seg = a.open_segment(b.segment_name()).unwrap();
    Pair {
        a,
        b,
        abuf,
        bbuf,
        seg,
    }
}

#[test]
fn write_then_read_many_sizes_and_batches() {
    let size = 40 << 20;
    let mut p = pair(size);
    let remote = p.bbuf.as_ptr() as u64;
    // WRITE: several sizes, one batch with mixed lengths including large (split) ones.
    let sizes = [1usize, 4096, 65536, 1 << 20, 16 << 20, 4093];
    let mut off = 0;
    let mut reqs = Vec::new();
    for &s in &sizes {
        reqs.push(TransferRequest {
            opcode: Opcode::Write,
            source: p.abuf.as_ptr() as u64 + off,
            target_id: p.seg,
            target_offset: remote + off,
            length: s as u64,
        });
        off += s as u64;
    }
    let st = p.a.transfer_sync(&reqs, Duration::from_secs(10)).unwrap();
    assert_eq!(st.status, TaskStatus::Completed, "{st:?}");
    assert_eq!(st.transferred_bytes, off);
    assert_eq!(
        &p.bbuf[..off as usize],
        &p.abuf[..off as usize],
        "written bytes landed"
    );
    assert!(
        p.bbuf[off as usize..].iter().all(|&b| b == 0),
        "nothing written past the requests"
    );

    // READ back into a fresh local region.
    let back = vec![0u8; off as usize];
    p.a.register_memory(back.as_ptr() as u64, off, "cpu:0")
        .unwrap();
    let mut reqs = Vec::new();
    let mut o = 0;
    for &s in &sizes {
        reqs.push(TransferRequest {
            opcode: Opcode::Read,
            source: back.as_ptr() as u64 + o,
            target_id: p.seg,
            target_offset: remote + o,
            length: s as u64,
        });
        o += s as u64;
    }
    let st = p.a.transfer_sync(&reqs, Duration::from_secs(10)).unwrap();
    assert_eq!(st.status, TaskStatus::Completed, "{st:?}");
    assert_eq!(back, p.abuf[..off as usize]);

    // Many small pipelined requests in one batch.
    p.bbuf.iter_mut().for_each(|b| *b = 0);
    let reqs: Vec<_> = (0..512u64)
        .map(|i| TransferRequest {
            opcode: Opcode::Write,
            source: p.abuf.as_ptr() as u64 + i * 4096,
            target_id: p.seg,
            target_offset: remote + i * 4096,
            length: 4096,
        })
        .collect();
    let st = p.a.transfer_sync(&reqs, Duration::from_secs(10)).unwrap();
    assert_eq!(st.status, TaskStatus::Completed);
    assert_eq!(&p.bbuf[..512 * 4096], &p.abuf[..512 * 4096]);
}

#[test]
fn v1_framing_with_read_fence() {
    let a = TransferEngine::new(Config {
        tcp_proto: 1,
        ..Config::default()
    })
    .unwrap();
    let b = engine();
    let src = pattern(3 << 20, 9);
    let dst = vec![0u8; 3 << 20];
    a.register_memory(src.as_ptr() as u64, src.len() as u64, "*")
        .unwrap();
    b.register_memory(dst.as_ptr() as u64, dst.len() as u64, "*")
        .unwrap();
    let seg = a.open_segment(b.segment_name()).unwrap();
    let reqs: Vec<_> = (0..3u64)
        .map(|i| TransferRequest {
            opcode: Opcode::Write,
            source: src.as_ptr() as u64 + (i << 20),
            target_id: seg,
            target_offset: dst.as_ptr() as u64 + (i << 20),
            length: 1 << 20,
        })
        .collect();
    let st = a.transfer_sync(&reqs, Duration::from_secs(10)).unwrap();
    assert_eq!(st.status, TaskStatus::Completed, "{st:?}");
    assert_eq!(src, dst);
    let back = vec![0u8; 1 << 20];
    a.register_memory(back.as_ptr() as u64, 1 << 20, "*")
        .unwrap();
    let st = a
        .transfer_sync(
            &[req(
                Opcode::Read,
                &back,
                seg,
                dst.as_ptr() as u64 + (2 << 20),
                1 << 20,
            )],
            Duration::from_secs(10),
        )
        .unwrap();
    assert_eq!(st.status, TaskStatus::Completed);
    assert_eq!(back, src[2 << 20..]);
}

#[test]
fn bad_remote_address_fails_only_that_task() {
    let p = pair(1 << 20);
    let remote = p.bbuf.as_ptr() as u64;
    let b = p.a.allocate_batch(3).unwrap();
    b.submit(&[
        req(Opcode::Write, &p.abuf, p.seg, remote, 4096),
        req(
            Opcode::Write,
            &p.abuf,
            p.seg,
            remote + (1 << 20) - 100,
            4096,
        ), // crosses the end
        req(Opcode::Write, &p.abuf[8192..], p.seg, remote + 8192, 4096),
    ])
    .unwrap();
    b.wait(Duration::from_secs(5));
    drop(b);
    // Check with a fresh batch too.
    let b = p.a.allocate_batch(2).unwrap();
    b.submit(&[
        req(Opcode::Write, &p.abuf, p.seg, remote + (2 << 20), 16),
        req(Opcode::Write, &p.abuf, p.seg, remote + 4096, 16),
    ])
    .unwrap();
    let st = b.wait(Duration::from_secs(5));
    assert!(st.status.is_terminal(), "{st:?}");
    let bad = b.task_status(0).unwrap();
    assert_eq!(bad.status, TaskStatus::Failed);
    assert!(
        bad.reason
            .as_deref()
            .unwrap_or("")
            .contains("not inside any buffer"),
        "{bad:?}"
    );
    assert_eq!(bad.cause, Some(kvferry::FailCause::RemoteNotRegistered));
    assert_eq!(b.task_status(1).unwrap().status, TaskStatus::Completed);
    assert_eq!(&p.bbuf[..4096], &p.abuf[..4096]);
    assert_eq!(&p.bbuf[8192..12288], &p.abuf[8192..12288]);
    assert!(
        p.bbuf[(1 << 20) - 100..].iter().all(|&x| x == 0),
        "rejected write touched nothing"
    );
}

#[test]
fn local_segment_is_memcpy_and_checked() {
    let e = engine();
    let src = pattern(8192, 3);
    let dst = vec![0u8; 8192];
    e.register_memory_batch(
        &[(src.as_ptr() as u64, 8192), (dst.as_ptr() as u64, 8192)],
        "cpu:0",
    )
    .unwrap();
    let me = e.open_segment(e.segment_name()).unwrap();
    assert_eq!(me, kvferry::LOCAL_SEGMENT_ID);
    let st = e
        .transfer_sync(
            &[req(Opcode::Write, &src, me, dst.as_ptr() as u64, 8192)],
            Duration::from_secs(1),
        )
        .unwrap();
    assert_eq!(st.status, TaskStatus::Completed);
    assert_eq!(src, dst);
    let st = e
        .transfer_sync(
            &[req(
                Opcode::Write,
                &src,
                me,
                dst.as_ptr() as u64 + 4096,
                8192,
            )],
            Duration::from_secs(1),
        )
        .unwrap();
    assert_eq!(st.status, TaskStatus::Failed);
    assert_eq!(st.cause, Some(kvferry::FailCause::RemoteNotRegistered));
}

#[test]
fn bad_input_is_refused_with_reasons() {
    let p = pair(64 << 10);
    // Unknown segment names.
    let e = p.a.open_segment("127.0.0.1:1").unwrap_err().to_string();
    assert!(e.contains("127.0.0.1:1"), "{e}");
    let e = p.a.open_segment("no-port").unwrap_err().to_string();
    assert!(
        e.contains("no-port") && e.contains("<host>:<rpc port>"),
        "{e}"
    );
    // Zero-length completes at once; unregistered local buffer fails the task.
    let unreg = vec![0u8; 16];
    let st =
        p.a.transfer_sync(
            &[req(
                Opcode::Write,
                &p.abuf,
                p.seg,
                p.bbuf.as_ptr() as u64,
                0,
            )],
            Duration::from_secs(1),
        )
        .unwrap();
    assert_eq!(st.status, TaskStatus::Completed);
    let st =
        p.a.transfer_sync(
            &[req(
                Opcode::Write,
                &unreg,
                p.seg,
                p.bbuf.as_ptr() as u64,
                16,
            )],
            Duration::from_secs(1),
        )
        .unwrap();
    assert_eq!(st.status, TaskStatus::Failed);
    assert_eq!(st.cause, Some(kvferry::FailCause::LocalNotRegistered));
    assert!(st.reason.unwrap().contains("register"));
    // Unknown segment id.
    let st =
        p.a.transfer_sync(
            &[req(Opcode::Write, &p.abuf, 99, p.bbuf.as_ptr() as u64, 16)],
            Duration::from_secs(1),
        )
        .unwrap();
    assert_eq!(st.status, TaskStatus::Failed);
    assert_eq!(st.cause, Some(kvferry::FailCause::SegmentNotFound));
    // Capacity, unknown task.
    let b = p.a.allocate_batch(1).unwrap();
    let two = [req(Opcode::Write, &p.abuf, p.seg, p.bbuf.as_ptr() as u64, 16); 2];
    assert!(matches!(
        b.submit(&two),
        Err(kvferry::Error::TooManyRequests { .. })
    ));
    assert!(matches!(
        b.task_status(0),
        Err(kvferry::Error::UnknownTask { .. })
    ));
    assert!(p.a.allocate_batch(0).is_err());
    // Registration errors.
    assert!(matches!(
        p.a.register_memory(p.abuf.as_ptr() as u64 + 8, 8, "*"),
        Err(kvferry::Error::Overlap { .. })
    ));
    assert!(p.a.register_memory(unreg.as_ptr() as u64, 0, "*").is_err());
    assert!(p.a.unregister_memory(unreg.as_ptr() as u64).is_err());
}

/// A fake peer: its handshake port answers one Metadata request with a descriptor whose
/// data port accepts a connection and then neither reads nor answers for `hold`.
fn silent_peer(remote: u64, hold: Duration) -> (String, std::thread::JoinHandle<()>) {
    let data = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let hs = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let data_port = data.local_addr().unwrap().port();
    let hs_port = hs.local_addr().unwrap().port();
    let t = std::thread::spawn(move || {
        let desc = format!(
            r#"{{"name":"127.0.0.1:{hs_port}","protocol":"tcp","tcp_data_port":{data_port},"tcp_proto_version":2,"buffers":[{{"name":"cpu:0","addr":{remote},"length":16777216}}]}}"#
        );
        let (mut s, _) = hs.accept().unwrap();
        let mut len = [0u8; 8];
        s.read_exact(&mut len).unwrap();
        let mut body = vec![0u8; u64::from_le_bytes(len) as usize];
        s.read_exact(&mut body).unwrap();
        s.write_all(&handshake::encode(MsgType::Metadata, desc.as_bytes()))
            .unwrap();
        drop(s);
        let (conn, _) = data.accept().unwrap();
        std::thread::sleep(hold);
        drop(conn);
    });
    (format!("127.0.0.1:{hs_port}"), t)
}

/// Dropping a batch is a barrier: with a request in flight to a peer that never answers, the
/// drop returns only once the request ended (by its deadline), not at once.
#[test]
fn dropping_a_busy_batch_waits_until_it_is_over() {
    let a = TransferEngine::new(Config {
        transfer_timeout: Duration::from_millis(800),
        ..Config::default()
    })
    .unwrap();
    let buf = vec![1u8; 4096];
    a.register_memory(buf.as_ptr() as u64, 4096, "*").unwrap();
    let remote = 0x7000_0000u64;
    let (name, fake) = silent_peer(remote, Duration::from_secs(2));
    let seg = a.open_segment(&name).unwrap();
    let batch = a.allocate_batch(1).unwrap();
    let submitted = Instant::now();
    batch
        .submit(&[req(Opcode::Write, &buf, seg, remote, 4096)])
        .unwrap();
    assert!(!batch.is_done(), "{batch:?}");
    assert!(!batch.status().status.is_terminal());
    drop(batch);
    let took = submitted.elapsed();
    assert!(
        took >= Duration::from_millis(800),
        "the drop returned after {took:?}, before the request's deadline"
    );
    assert!(took < Duration::from_secs(2), "the drop took {took:?}");
    // Once more, waited for first: the status is then TIMEOUT and the drop does not wait.
    let batch = a.allocate_batch(1).unwrap();
    batch
        .submit(&[req(Opcode::Write, &buf, seg, remote, 4096)])
        .unwrap();
    let st = batch.wait(Duration::from_secs(5));
    assert_eq!(st.status, TaskStatus::Timeout, "{st:?}");
    assert!(batch.is_done());
    fake.join().unwrap();
}

#[test]
fn stalled_peer_times_out_and_dead_peer_fails() {
    let a = TransferEngine::new(Config {
        transfer_timeout: Duration::from_millis(700),
        ..Config::default()
    })
    .unwrap();
    let buf = vec![1u8; 1 << 20];
    a.register_memory(buf.as_ptr() as u64, buf.len() as u64, "*")
        .unwrap();
    let remote = 0x7000_0000u64;
    let (name, fake) = silent_peer(remote, Duration::from_secs(3));
    let seg = a.open_segment(&name).unwrap();
    let start = Instant::now();
    let st = a
        .transfer_sync(
            &[req(Opcode::Read, &buf, seg, remote, 4096)],
            Duration::from_secs(10),
        )
        .unwrap();
    let took = start.elapsed();
    assert_eq!(st.status, TaskStatus::Timeout, "{st:?}");
    assert_eq!(st.cause, Some(kvferry::FailCause::Timeout));
    assert!(
        took < Duration::from_secs(3),
        "timed out within the deadline plus a tick, took {took:?}"
    );
    fake.join().unwrap();
    // Now the peer is gone entirely: connection refused → FAILED quickly.
    let start = Instant::now();
    let st = a
        .transfer_sync(
            &[req(Opcode::Read, &buf, seg, remote, 4096)],
            Duration::from_secs(10),
        )
        .unwrap();
    assert!(
        matches!(st.status, TaskStatus::Failed | TaskStatus::Timeout),
        "{st:?}"
    );
    assert!(
        matches!(
            st.cause,
            Some(
                kvferry::FailCause::PeerUnreachable
                    | kvferry::FailCause::PeerLost
                    | kvferry::FailCause::Timeout
            )
        ),
        "{st:?}"
    );
    assert!(start.elapsed() < Duration::from_secs(3));
}

#[test]
fn peer_dropped_mid_transfer_fails_not_hangs() {
    let a = TransferEngine::new(Config {
        transfer_timeout: Duration::from_secs(3),
        ..Config::default()
    })
    .unwrap();
    let b = engine();
    let src = vec![5u8; 64 << 20];
    let dst = vec![0u8; 64 << 20];
    a.register_memory(src.as_ptr() as u64, src.len() as u64, "*")
        .unwrap();
    b.register_memory(dst.as_ptr() as u64, dst.len() as u64, "*")
        .unwrap();
    let seg = a.open_segment(b.segment_name()).unwrap();
    let reqs: Vec<_> = (0..16u64)
        .map(|i| TransferRequest {
            opcode: Opcode::Write,
            source: src.as_ptr() as u64 + (i << 22),
            target_id: seg,
            target_offset: dst.as_ptr() as u64 + (i << 22),
            length: 4 << 20,
        })
        .collect();
    let id = a.allocate_batch(16).unwrap();
    id.submit(&reqs).unwrap();
    drop(b); // the target goes away while data is moving
    let start = Instant::now();
    let st = id.wait(Duration::from_secs(10));
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "ended within the deadline"
    );
    // Either everything landed before the drop, or the batch reports the failure.
    assert!(
        matches!(
            st.status,
            TaskStatus::Completed | TaskStatus::Failed | TaskStatus::Timeout
        ),
        "{st:?}"
    );
    assert!(id.is_done(), "tasks never ended");
}

#[test]
fn notify_and_probe() {
    let p = pair(4096);
    p.a.send_notify(p.b.segment_name(), "hello").unwrap();
    p.a.send_notify(p.b.segment_name(), "again").unwrap();
    let got = p.b.get_notifies();
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].name, p.a.segment_name());
    assert_eq!(got[0].msg, "hello");
    assert!(p.b.get_notifies().is_empty(), "drained");
    p.a.probe(p.b.segment_name()).unwrap();
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    assert!(p.a.probe(&format!("127.0.0.1:{dead}")).is_err());
}

#[test]
fn many_engines_never_collide_on_ports() {
    let cfg = Config {
        min_port: 16000,
        max_port: 16031,
        ..Config::default()
    };
    let engines: Vec<_> = (0..8)
        .map(|_| TransferEngine::new(cfg.clone()).unwrap())
        .collect();
    let mut ports: Vec<u16> = engines
        .iter()
        .flat_map(|e| [e.rpc_port(), e.data_port()])
        .collect();
    assert!(ports.iter().all(|p| (16000..=16031).contains(p)));
    ports.sort();
    ports.dedup();
    assert_eq!(ports.len(), 16);
}

#[test]
fn wrong_advertised_address_is_an_error_not_a_silent_fallback() {
    let e = TransferEngine::new(Config {
        local_hostname: "203.0.113.7".into(),
        ..Config::default()
    })
    .err()
    .expect("must fail");
    let msg = e.to_string();
    assert!(
        msg.contains("203.0.113.7") && msg.contains("not an address of this host"),
        "{msg}"
    );
}

fn raw_handshake(port: u16, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    out
}

#[test]
fn malformed_handshake_frames_close_only_their_connection() {
    let p = pair(4096);
    let port = p.b.rpc_port();
    assert!(
        raw_handshake(port, &0u64.to_le_bytes()).is_empty(),
        "zero length"
    );
    assert!(
        raw_handshake(port, &u64::MAX.to_le_bytes()).is_empty(),
        "oversized"
    );
    let mut trunc = 100u64.to_le_bytes().to_vec();
    trunc.extend_from_slice(b"\x01{\"na");
    assert!(raw_handshake(port, &trunc).is_empty(), "truncated");
    // Garbage JSON in a Notify is answered with an error, not a crash.
    let reply = raw_handshake(port, &handshake::encode(MsgType::Notify, b"not json"));
    assert!(!reply.is_empty());
    // Legacy untyped frame is a Connection: refused politely.
    let mut legacy = 2u64.to_le_bytes().to_vec();
    legacy.extend_from_slice(b"{}");
    let reply = raw_handshake(port, &legacy);
    assert!(String::from_utf8_lossy(&reply).contains("reply_msg"));
    // The engine still serves others.
    p.a.probe(p.b.segment_name()).unwrap();
    let id = p.a.open_segment(p.b.segment_name()).unwrap();
    let st =
        p.a.transfer_sync(
            &[req(
                Opcode::Write,
                &p.abuf,
                id,
                p.bbuf.as_ptr() as u64,
                4096,
            )],
            Duration::from_secs(5),
        )
        .unwrap();
    assert_eq!(st.status, TaskStatus::Completed);
}

#[test]
fn raw_data_requests_outside_registered_memory_are_rejected_untouched() {
    let p = pair(8192);
    let port = p.b.data_port();
    let inside = p.bbuf.as_ptr() as u64;
    let snapshot = p.bbuf.clone();
    for (addr, size) in [
        (inside + 4096, 8192u64),
        (inside - 1, 2),
        (0x10, 16),
        (inside, 0),
    ] {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(
            &DataHeader {
                size,
                addr,
                opcode: Opcode::Write,
                v2: true,
            }
            .encode(),
        )
        .unwrap();
        let _ = s.write_all(&vec![0xAB; size.min(1 << 16) as usize]);
        let mut st = [0u8; 8];
        s.read_exact(&mut st).unwrap();
        assert_eq!(
            tcp::decode_status(st).unwrap(),
            Status::Rejected,
            "addr {addr:x} size {size}"
        );
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        assert!(rest.is_empty(), "connection closed after rejection");
    }
    // Garbage header: connection closed, nothing written.
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(&[0x55u8; 24]).unwrap();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(rest.is_empty());
    assert_eq!(p.bbuf, snapshot, "target memory untouched");
    // Pipelined valid requests on one connection: statuses in order.
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut wire = Vec::new();
    for i in 0..3u64 {
        wire.extend_from_slice(
            &DataHeader {
                size: 16,
                addr: inside + i * 16,
                opcode: Opcode::Write,
                v2: true,
            }
            .encode(),
        );
        wire.extend_from_slice(&[i as u8 + 1; 16]);
    }
    wire.extend_from_slice(
        &DataHeader {
            size: 48,
            addr: inside,
            opcode: Opcode::Read,
            v2: true,
        }
        .encode(),
    );
    s.write_all(&wire).unwrap();
    let mut resp = [0u8; 8 * 4 + 48];
    s.read_exact(&mut resp).unwrap();
    for i in 0..4 {
        assert_eq!(
            tcp::decode_status(resp[i * 8..i * 8 + 8].try_into().unwrap()).unwrap(),
            Status::Ok
        );
    }
    assert_eq!(&resp[32..48], &[1u8; 16]);
    assert_eq!(&resp[64..80], &[3u8; 16]);
}

/// A fake peer whose data port answers every request with `reply` bytes.
fn lying_peer(remote: u64, reply: [u8; 8]) -> String {
    let data = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let hs = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let data_port = data.local_addr().unwrap().port();
    let hs_port = hs.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let desc = format!(
            r#"{{"name":"127.0.0.1:{hs_port}","protocol":"tcp","tcp_data_port":{data_port},"tcp_proto_version":2,"buffers":[{{"name":"cpu:0","addr":{remote},"length":16777216}}]}}"#
        );
        for s in hs.incoming().flatten().take(4) {
            let mut s = s;
            let mut len = [0u8; 8];
            if s.read_exact(&mut len).is_err() {
                continue;
            }
            let mut body = vec![0u8; u64::from_le_bytes(len) as usize];
            let _ = s.read_exact(&mut body);
            let _ = s.write_all(&handshake::encode(MsgType::Metadata, desc.as_bytes()));
        }
    });
    std::thread::spawn(move || {
        for conn in data.incoming().flatten().take(8) {
            let mut conn = conn;
            std::thread::spawn(move || {
                let mut hdr = [0u8; 24];
                while conn.read_exact(&mut hdr).is_ok() {
                    if conn.write_all(&reply).is_err() {
                        return;
                    }
                }
            });
        }
    });
    format!("127.0.0.1:{hs_port}")
}

#[test]
fn wrong_status_magic_fails_the_task_with_the_reason() {
    let a = engine();
    let buf = vec![0u8; 4096];
    a.register_memory(buf.as_ptr() as u64, 4096, "*").unwrap();
    let remote = 0x7000_0000u64;
    let name = lying_peer(remote, *b"garbage!");
    let seg = a.open_segment(&name).unwrap();
    for op in [Opcode::Read, Opcode::Write] {
        let start = Instant::now();
        let st = a
            .transfer_sync(&[req(op, &buf, seg, remote, 4096)], Duration::from_secs(10))
            .unwrap();
        assert_eq!(st.status, TaskStatus::Failed, "{st:?}");
        assert!(
            st.reason.as_deref().unwrap_or("").contains("magic"),
            "{st:?}"
        );
        assert_eq!(st.cause, Some(kvferry::FailCause::Protocol));
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "failed at once, not at the deadline"
        );
        assert!(
            buf.iter().all(|&b| b == 0),
            "nothing received into local memory"
        );
    }
    // The same engine still works with a real peer.
    let b = engine();
    let dst = vec![0u8; 4096];
    b.register_memory(dst.as_ptr() as u64, 4096, "*").unwrap();
    let seg = a.open_segment(b.segment_name()).unwrap();
    let st = a
        .transfer_sync(
            &[req(Opcode::Write, &buf, seg, dst.as_ptr() as u64, 4096)],
            Duration::from_secs(5),
        )
        .unwrap();
    assert_eq!(st.status, TaskStatus::Completed);
}

#[test]
fn truncated_data_header_closes_only_that_connection() {
    let p = pair(4096);
    let mut s = TcpStream::connect(("127.0.0.1", p.b.data_port())).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(&[1u8; 10]).unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(rest.is_empty());
    let st =
        p.a.transfer_sync(
            &[req(
                Opcode::Write,
                &p.abuf,
                p.seg,
                p.bbuf.as_ptr() as u64,
                4096,
            )],
            Duration::from_secs(5),
        )
        .unwrap();
    assert_eq!(st.status, TaskStatus::Completed);
    assert_eq!(p.bbuf, p.abuf);
}

#[test]
fn many_threads_submit_at_once() {
    let p = pair(8 << 20);
    let remote = p.bbuf.as_ptr() as u64;
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let (a, abuf, seg) = (&p.a, &p.abuf, p.seg);
            s.spawn(move || {
                for round in 0..20u64 {
                    let base = t * (1 << 20) + (round % 4) * 65536;
                    let reqs: Vec<_> = (0..16u64)
                        .map(|i| TransferRequest {
                            opcode: Opcode::Write,
                            source: abuf.as_ptr() as u64 + base + i * 4096,
                            target_id: seg,
                            target_offset: remote + base + i * 4096,
                            length: 4096,
                        })
                        .collect();
                    let st = a.transfer_sync(&reqs, Duration::from_secs(10)).unwrap();
                    assert_eq!(st.status, TaskStatus::Completed, "{st:?}");
                }
            });
        }
    });
    for t in 0..8usize {
        let base = t << 20;
        assert_eq!(
            &p.bbuf[base..base + 4 * 65536],
            &p.abuf[base..base + 4 * 65536]
        );
    }
}

/// `KVFERRY_TRANSPORT=rdma` never falls back silently: without a usable NIC the engine does not
/// start and says why (this host, CI); with one, it publishes an RDMA descriptor. The transfers
/// themselves are proved on Soft-RoCE in the VM (`scripts/test`: examples/rdma_engines).
#[test]
fn rdma_mode_starts_only_with_a_usable_nic_and_says_why_not() {
    let cfg = Config {
        transport: kvferry::TransportMode::Rdma,
        ..Config::default()
    };
    let probe = kvferry::host::rdma::probe();
    match (TransferEngine::new(cfg), probe.why_not()) {
        (Err(e), Some(why)) => {
            let e = e.to_string();
            assert!(
                e.contains("KVFERRY_TRANSPORT=rdma, but") && e.contains(&why),
                "{e}"
            );
        }
        (Ok(engine), None) => {
            let buf = vec![0u8; 1 << 20];
            engine
                .register_memory(buf.as_ptr() as u64, buf.len() as u64, "cpu:0")
                .unwrap();
            let d = engine.local_descriptor();
            assert!(d.protocol.contains("rdma") && !d.devices.is_empty());
            assert_eq!(d.buffers[0].rkey.len(), d.devices.len());
            engine.unregister_memory(buf.as_ptr() as u64).unwrap();
        }
        // A NIC that probes usable but cannot be opened (permissions): the error says so.
        (Err(e), None) => assert!(e.to_string().contains("KVFERRY_TRANSPORT=rdma, but"), "{e}"),
        (Ok(_), Some(why)) => panic!("started in rdma mode although {why}"),
    }
}

/// `KVFERRY_AUTO_RDMA=force` (Mooncake's `MC_FORCE_HCA=1`): `auto` that must open RDMA. Without
/// a usable NIC (this host, CI) the engine does not start and says why; with one it starts and
/// still publishes a TCP descriptor (auto).
#[test]
fn forced_rdma_in_auto_mode_starts_only_with_a_usable_nic_and_says_why_not() {
    let cfg = Config {
        rdma_forced: true,
        ..Config::default()
    };
    match (
        TransferEngine::new(cfg),
        kvferry::host::rdma::probe().why_not(),
    ) {
        (Err(e), Some(why)) => {
            let e = e.to_string();
            assert!(
                e.contains(
                    "KVFERRY_AUTO_RDMA=force (or Mooncake's MC_FORCE_HCA=1) asks for RDMA, but"
                ) && e.contains(&why),
                "{e}"
            );
        }
        (Ok(engine), None) => assert!(!engine.local_descriptor().protocol.contains("rdma")),
        (Err(e), None) => assert!(e.to_string().contains("asks for RDMA, but"), "{e}"),
        (Ok(_), Some(why)) => panic!("started with RDMA forced although {why}"),
    }
    // Unforced, the same host starts (RDMA or not).
    assert!(TransferEngine::new(Config::default()).is_ok());
}

/// An engine without RDMA refuses a `Connection` message with a reason, as Mooncake expects.
#[test]
fn a_connection_message_to_an_engine_without_rdma_is_refused_with_a_reason() {
    let e = engine();
    let body = br#"{"local_nic_path":"10.0.0.1:1@mlx5_0","local_lid":0,"local_gid":"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:01","peer_nic_path":"x:1@mlx5_0","qp_num":[5]}"#;
    let reply = kvferry::handshake::request(
        "127.0.0.1",
        e.rpc_port(),
        MsgType::Connection,
        body,
        Duration::from_secs(2),
        Duration::from_secs(5),
        1 << 20,
        None,
    )
    .unwrap();
    let m: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
    assert!(
        m["reply_msg"]
            .as_str()
            .is_some_and(|r| r.contains("no RDMA transport")),
        "{m}"
    );
}
