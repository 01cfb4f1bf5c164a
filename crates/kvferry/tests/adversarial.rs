//! The engine's promises against slow, hostile and forked peers (issue 10).
//!
//! Every test here plays a hostile peer by hand: a raw TCP client against an engine's data
//! port, or a scripted fake peer (a handshake port serving a descriptor and a data port
//! running a script per connection) that an engine initiates transfers to. The promises:
//! - unregister (and dropping an engine) is a barrier: once it returns, no byte lands in the
//!   range and no byte of it leaves, however slowly the peer is sending or reading;
//! - nothing hangs: a peer that trickles bytes faster than any socket timeout still cannot
//!   keep a request past its deadline (the deadline is checked after every system call);
//! - a terminal status is the truth and is final: `transfer_sync` returns only once every
//!   request has ended, a batch is terminal only once every task is, and a buffer is not
//!   touched after its request ended;
//! - a WRITE that may have partly landed on a broken connection is not sent again (stale
//!   bytes of the old connection could land after the retry's);
//!
//! `fork()` children and departed peers are in `lifecycle.rs` (they count the process's CPU
//! time, threads and descriptors, so they run alone).
//!
//! Every test is bounded in time: fake peers stop on their own, waits have deadlines.

use kvferry::testing::wire::handshake::{self, MsgType};
use kvferry::testing::wire::tcp::{self as wire, DataHeader, Status, HEADER_LEN};
use kvferry::{Config, FailCause, Opcode, TaskStatus, TransferEngine, TransferRequest};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn engine(timeout: Duration) -> TransferEngine {
    TransferEngine::new(Config {
        transfer_timeout: timeout,
        transport: kvferry::TransportMode::Tcp,
        ..Config::default()
    })
    .expect("engine starts")
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

/// Reads the bytes of `buf` through a volatile pointer (other threads may be writing).
fn snapshot(buf: &[u8]) -> Vec<u8> {
    buf.iter()
        .map(|b| unsafe { std::ptr::read_volatile(b) })
        .collect()
}

/// Fills `buf` with `v` through its pointer (the engine may hold it; tests own it).
fn fill(buf: &[u8], v: u8) {
    unsafe { std::ptr::write_bytes(buf.as_ptr() as *mut u8, v, buf.len()) };
}

// ------------------------------------------------------------------------------------------
// A scripted fake peer
// ------------------------------------------------------------------------------------------

/// What a fake peer's data connection gets: the stream and a stop flag the script must
/// honour (it is set when the test ends).
type Script = dyn Fn(TcpStream, &AtomicBool) + Send + Sync;

struct FakePeer {
    name: String,
    stop: Arc<AtomicBool>,
    /// Data connections accepted so far.
    accepted: Arc<AtomicUsize>,
}

impl Drop for FakePeer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Accepts on `l` until `stop`, handing each connection to `f` on its own thread.
fn serve(l: TcpListener, stop: Arc<AtomicBool>, f: impl Fn(TcpStream) + Send + Sync + 'static) {
    l.set_nonblocking(true).unwrap();
    let f = Arc::new(f);
    std::thread::spawn(move || {
        let until = Instant::now() + Duration::from_secs(60);
        while !stop.load(Ordering::SeqCst) && Instant::now() < until {
            match l.accept() {
                Ok((s, _)) => {
                    s.set_nonblocking(false).unwrap();
                    let f = Arc::clone(&f);
                    std::thread::spawn(move || f(s));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    });
}

/// A descriptor: handshake and data port, TCP protocol version, and the buffers listed.
fn desc_json(hs_port: u16, data_port: u16, version: u32, buffers: &[u64]) -> String {
    let bufs: Vec<String> = buffers
        .iter()
        .map(|a| format!(r#"{{"name":"cpu:0","addr":{a},"length":16777216}}"#))
        .collect();
    format!(
        r#"{{"name":"127.0.0.1:{hs_port}","protocol":"tcp","tcp_data_port":{data_port},"tcp_proto_version":{version},"buffers":[{}]}}"#,
        bufs.join(",")
    )
}

/// What a fake peer's handshake port serves at its `n`th descriptor request (from 0), given
/// its handshake and data ports.
type Describe = dyn Fn(usize, u16, u16) -> String + Send + Sync;

/// A peer publishing one 16 MiB buffer at `remote` (v2 TCP protocol) whose data
/// connections run `script`.
fn fake_peer(remote: u64, script: Arc<Script>) -> FakePeer {
    fake_peer_with(
        Arc::new(move |_, hs, data| desc_json(hs, data, 2, &[remote])),
        script,
    )
}

/// A fake peer whose descriptor requests are answered by `describe`.
fn fake_peer_with(describe: Arc<Describe>, script: Arc<Script>) -> FakePeer {
    let data = TcpListener::bind("127.0.0.1:0").unwrap();
    let hs = TcpListener::bind("127.0.0.1:0").unwrap();
    let data_port = data.local_addr().unwrap().port();
    let hs_port = hs.local_addr().unwrap().port();
    let stop = Arc::new(AtomicBool::new(false));
    let accepted = Arc::new(AtomicUsize::new(0));
    let lookups = Arc::new(AtomicUsize::new(0));
    serve(hs, Arc::clone(&stop), move |mut s| {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut len = [0u8; 8];
        if s.read_exact(&mut len).is_err() {
            return;
        }
        let mut body = vec![0u8; (u64::from_le_bytes(len) as usize).min(1 << 20)];
        let _ = s.read_exact(&mut body);
        let desc = describe(lookups.fetch_add(1, Ordering::SeqCst), hs_port, data_port);
        let _ = s.write_all(&handshake::encode(MsgType::Metadata, desc.as_bytes()));
    });
    let (st, acc) = (Arc::clone(&stop), Arc::clone(&accepted));
    serve(data, Arc::clone(&stop), move |s| {
        acc.fetch_add(1, Ordering::SeqCst);
        s.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        script(s, &st);
    });
    FakePeer {
        name: format!("127.0.0.1:{hs_port}"),
        stop,
        accepted,
    }
}

/// Reads one request header (waiting up to 5 s).
fn read_header(s: &mut TcpStream, stop: &AtomicBool) -> Option<DataHeader> {
    let mut h = [0u8; HEADER_LEN];
    read_exactly(s, &mut h, stop)?;
    DataHeader::decode(&h).ok()
}

/// Reads exactly `buf.len()` bytes, tolerating read timeouts, until `stop` or 10 s.
fn read_exactly(s: &mut TcpStream, buf: &mut [u8], stop: &AtomicBool) -> Option<()> {
    let until = Instant::now() + Duration::from_secs(10);
    let mut got = 0;
    while got < buf.len() {
        if stop.load(Ordering::SeqCst) || Instant::now() > until {
            return None;
        }
        match s.read(&mut buf[got..]) {
            Ok(0) => return None,
            Ok(n) => got += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return None,
        }
    }
    Some(())
}

/// Sends `bytes` one at a time every `every` (faster than any socket timeout of the
/// engine), until the connection breaks, `stop` is set or 20 s passed.
fn trickle(s: &mut TcpStream, bytes: &[u8], every: Duration, stop: &AtomicBool) -> usize {
    let until = Instant::now() + Duration::from_secs(20);
    for (i, b) in bytes.iter().enumerate() {
        if stop.load(Ordering::SeqCst) || Instant::now() > until || s.write_all(&[*b]).is_err() {
            return i;
        }
        std::thread::sleep(every);
    }
    bytes.len()
}

/// Drains the socket slowly (`chunk` bytes every `every`) until it breaks, `stop` or 20 s.
fn slow_drain(s: &mut TcpStream, chunk: usize, every: Duration, stop: &AtomicBool) -> usize {
    let until = Instant::now() + Duration::from_secs(20);
    let mut buf = vec![0u8; chunk];
    let mut total = 0;
    while !stop.load(Ordering::SeqCst) && Instant::now() < until {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => total += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
        std::thread::sleep(every);
    }
    total
}

/// Closes with a reset (SO_LINGER 0) instead of a FIN.
fn reset(s: TcpStream) {
    let _ = socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO));
    drop(s);
}

const REMOTE: u64 = 0x7000_0000;

/// A READ's status then its data trickled 1 byte / 20 ms; a WRITE's body drained
/// 1 KiB / 10 ms. Either way bytes keep moving faster than any socket timeout.
fn trickling_script() -> Arc<Script> {
    Arc::new(|mut s: TcpStream, stop: &AtomicBool| {
        while let Some(h) = read_header(&mut s, stop) {
            match h.opcode {
                Opcode::Read => {
                    let _ = s.write_all(&wire::encode_status(Status::Ok));
                    if trickle(
                        &mut s,
                        &vec![0xEEu8; h.size as usize],
                        Duration::from_millis(20),
                        stop,
                    ) < h.size as usize
                    {
                        return;
                    }
                }
                Opcode::Write => {
                    slow_drain(&mut s, 1024, Duration::from_millis(10), stop);
                    return;
                }
            }
        }
    })
}

// ------------------------------------------------------------------------------------------
// Target side: the data server against hostile initiators
// ------------------------------------------------------------------------------------------

/// A raw client sends a WRITE header and then one byte every 50 ms. `unregister` must stop
/// it (the connection is shut down) and return promptly; once it returned, nothing lands.
#[test]
fn unregister_stops_a_trickling_writer_and_nothing_lands_after() {
    let b = engine(Duration::from_secs(3));
    let buf = vec![0u8; 1 << 20];
    b.register_memory(buf.as_ptr() as u64, buf.len() as u64, "*")
        .unwrap();
    let mut s = TcpStream::connect(("127.0.0.1", b.data_port())).unwrap();
    s.write_all(
        &DataHeader {
            size: 1 << 20,
            addr: buf.as_ptr() as u64,
            opcode: Opcode::Write,
            v2: true,
        }
        .encode(),
    )
    .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let st = Arc::clone(&stop);
    let writer = std::thread::spawn(move || {
        trickle(&mut s, &[0xAB; 1 << 20], Duration::from_millis(50), &st)
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        snapshot(&buf[..4]).contains(&0xAB),
        "the trickled bytes were landing before unregister"
    );
    let start = Instant::now();
    b.unregister_memory(buf.as_ptr() as u64).unwrap();
    let took = start.elapsed();
    fill(&buf, 0x11);
    std::thread::sleep(Duration::from_millis(400));
    stop.store(true, Ordering::SeqCst);
    let sent = writer.join().unwrap();
    assert!(
        took < Duration::from_millis(1500),
        "unregister took {took:?}: it waited for the trickle instead of stopping it"
    );
    assert!(
        snapshot(&buf).iter().all(|&x| x == 0x11),
        "bytes landed in the range after unregister returned"
    );
    assert!(
        sent < 40,
        "the writer kept sending after unregister ({sent} bytes): the connection was not shut down"
    );
}

/// A raw client asks for a 64 MiB READ and reads it slowly. `unregister` must cut it off:
/// nothing the owner writes into the range after unregister returned may reach the client.
#[test]
fn unregister_stops_a_slow_reader_and_nothing_leaks_after() {
    let b = engine(Duration::from_secs(3));
    let buf = vec![0x22u8; 64 << 20];
    b.register_memory(buf.as_ptr() as u64, buf.len() as u64, "*")
        .unwrap();
    let mut s = TcpStream::connect(("127.0.0.1", b.data_port())).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    s.write_all(
        &DataHeader {
            size: 64 << 20,
            addr: buf.as_ptr() as u64,
            opcode: Opcode::Read,
            v2: true,
        }
        .encode(),
    )
    .unwrap();
    let unregistered = Arc::new(AtomicBool::new(false));
    let u = Arc::clone(&unregistered);
    let reader = std::thread::spawn(move || {
        let until = Instant::now() + Duration::from_secs(10);
        let mut chunk = vec![0u8; 64 << 10];
        let (mut total, mut secret_bytes) = (0usize, 0usize);
        while Instant::now() < until {
            match s.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => {
                    total += n;
                    if u.load(Ordering::SeqCst) {
                        secret_bytes += chunk[..n].iter().filter(|&&x| x == 0x5A).count();
                    }
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => break,
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        (total, secret_bytes)
    });
    std::thread::sleep(Duration::from_millis(300));
    let start = Instant::now();
    b.unregister_memory(buf.as_ptr() as u64).unwrap();
    let took = start.elapsed();
    // The owner reuses the memory for something secret.
    fill(&buf, 0x5A);
    unregistered.store(true, Ordering::SeqCst);
    let (total, secret) = reader.join().unwrap();
    assert!(
        took < Duration::from_millis(1500),
        "unregister took {took:?}"
    );
    assert!(
        total < 64 << 20,
        "the whole range was sent: the reader was never cut off"
    );
    assert_eq!(
        secret, 0,
        "{secret} bytes written after unregister reached the reader"
    );
}

/// A header trickled one byte at a time (each faster than the server's socket timeout)
/// cannot hold a connection: the server drops it once the header is `stall` old.
#[test]
fn a_trickled_header_or_body_is_dropped_at_the_deadline() {
    let b = engine(Duration::from_millis(800));
    let buf = vec![0u8; 1 << 20];
    b.register_memory(buf.as_ptr() as u64, buf.len() as u64, "*")
        .unwrap();
    let hdr = DataHeader {
        size: 4096,
        addr: buf.as_ptr() as u64,
        opcode: Opcode::Write,
        v2: true,
    }
    .encode();
    for what in ["header", "body"] {
        let mut s = TcpStream::connect(("127.0.0.1", b.data_port())).unwrap();
        let stop = AtomicBool::new(false);
        let start = Instant::now();
        let sent = if what == "header" {
            trickle(&mut s, &hdr, Duration::from_millis(100), &stop)
        } else {
            s.write_all(&hdr).unwrap();
            trickle(&mut s, &[7u8; 4096], Duration::from_millis(50), &stop)
        };
        let took = start.elapsed();
        assert!(
            took < Duration::from_secs(3),
            "{what}: the connection was held {took:?} ({sent} bytes trickled)"
        );
    }
    assert!(
        buf[..4096].iter().all(|&x| x == 0 || x == 7),
        "only the trickled bytes"
    );
}

/// Dropping an engine is a barrier too: a trickling writer is cut off and nothing lands
/// after `drop` returned (the store unmaps its segment right after dropping its engine).
#[test]
fn dropping_the_engine_is_a_barrier() {
    let b = engine(Duration::from_secs(3));
    let buf = vec![0u8; 1 << 20];
    b.register_memory(buf.as_ptr() as u64, buf.len() as u64, "*")
        .unwrap();
    let mut s = TcpStream::connect(("127.0.0.1", b.data_port())).unwrap();
    s.write_all(
        &DataHeader {
            size: 1 << 20,
            addr: buf.as_ptr() as u64,
            opcode: Opcode::Write,
            v2: true,
        }
        .encode(),
    )
    .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let st = Arc::clone(&stop);
    let writer = std::thread::spawn(move || {
        trickle(&mut s, &[0xCD; 1 << 20], Duration::from_millis(20), &st)
    });
    std::thread::sleep(Duration::from_millis(200));
    let start = Instant::now();
    drop(b);
    let took = start.elapsed();
    fill(&buf, 0x33);
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::SeqCst);
    writer.join().unwrap();
    assert!(took < Duration::from_millis(1500), "drop took {took:?}");
    assert!(
        snapshot(&buf).iter().all(|&x| x == 0x33),
        "bytes landed after the engine was dropped"
    );
}

// ------------------------------------------------------------------------------------------
// Initiator side: lanes and the in-caller-thread path against hostile targets
// ------------------------------------------------------------------------------------------

/// Runs `reqs` either with `transfer_sync` (one request: the in-caller-thread path) or as
/// a submitted batch (lane threads), returning the batch status and how long it took.
fn run(
    a: &TransferEngine,
    reqs: &[TransferRequest],
    inline: bool,
) -> (kvferry::TransferStatus, Duration) {
    let start = Instant::now();
    let st = if inline {
        a.transfer_sync(reqs, Duration::from_secs(30)).unwrap()
    } else {
        let b = a.allocate_batch(reqs.len()).unwrap();
        b.submit(reqs).unwrap();
        let st = b.wait(Duration::from_secs(30));
        assert!(b.is_done(), "a terminal batch: every task ended");
        st
    };
    (st, start.elapsed())
}

/// A peer dripping READ data (1 byte / 20 ms) or draining a WRITE body slowly cannot keep
/// a request past its deadline, on the lane threads and in the caller's thread; after the
/// request ended its buffer is not touched any more.
#[test]
fn a_trickling_peer_cannot_hold_a_request_past_its_deadline() {
    let a = engine(Duration::from_millis(700));
    let buf = vec![0u8; 8 << 20];
    a.register_memory(buf.as_ptr() as u64, buf.len() as u64, "*")
        .unwrap();
    let peer = fake_peer(REMOTE, trickling_script());
    let seg = a.open_segment(&peer.name).unwrap();
    for (op, len) in [(Opcode::Read, 4096usize), (Opcode::Write, 8 << 20)] {
        for inline in [true, false] {
            fill(&buf, 0);
            let (st, took) = run(&a, &[req(op, &buf, seg, REMOTE, len)], inline);
            assert_eq!(
                st.status,
                TaskStatus::Timeout,
                "{op:?} inline={inline}: {st:?}"
            );
            assert_eq!(st.cause, Some(FailCause::Timeout));
            // Deadline: 700 ms + 1 ns/byte (8 ms for 8 MiB), then a tick to notice.
            assert!(
                took < Duration::from_millis(1800),
                "{op:?} inline={inline}: ended after {took:?}"
            );
            fill(&buf, 0x44);
            std::thread::sleep(Duration::from_millis(200));
            assert!(
                snapshot(&buf[..len]).iter().all(|&x| x == 0x44),
                "{op:?} inline={inline}: buffer touched after the request ended"
            );
        }
    }
}

/// A peer that stops mid-body (READ data half sent, WRITE body half read) times out.
#[test]
fn a_peer_that_stops_mid_body_times_out() {
    let a = engine(Duration::from_millis(600));
    let buf = vec![0u8; 8 << 20];
    a.register_memory(buf.as_ptr() as u64, buf.len() as u64, "*")
        .unwrap();
    let script: Arc<Script> = Arc::new(|mut s: TcpStream, stop: &AtomicBool| {
        if let Some(h) = read_header(&mut s, stop) {
            if h.opcode == Opcode::Read {
                let _ = s.write_all(&wire::encode_status(Status::Ok));
                let _ = s.write_all(&vec![1u8; h.size as usize / 2]);
            } else {
                let mut half = vec![0u8; h.size as usize / 2];
                let _ = read_exactly(&mut s, &mut half, stop);
            }
            while !stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    });
    let peer = fake_peer(REMOTE, script);
    let seg = a.open_segment(&peer.name).unwrap();
    for op in [Opcode::Read, Opcode::Write] {
        for inline in [true, false] {
            let (st, took) = run(&a, &[req(op, &buf, seg, REMOTE, 8 << 20)], inline);
            assert_eq!(
                st.status,
                TaskStatus::Timeout,
                "{op:?} inline={inline}: {st:?}"
            );
            assert!(
                took < Duration::from_millis(1700),
                "{op:?} inline={inline}: {took:?}"
            );
        }
    }
}

/// A peer that resets the connection after a partial answer: the request fails at once
/// (not at its deadline). A READ is retried once on a new connection; a WRITE that may have
/// partly landed is never sent again.
#[test]
fn a_reset_after_a_partial_write_fails_fast_and_writes_are_not_resent() {
    // One lane: the connection `open_segment` opens is the one the request goes on, so the
    // peer's count of connections is the request's (plus a READ's one retry).
    let a = TransferEngine::new(Config {
        transfer_timeout: Duration::from_secs(5),
        transport: kvferry::TransportMode::Tcp,
        tcp_lanes: 1,
        ..Config::default()
    })
    .expect("engine starts");
    let buf = vec![0u8; 1 << 20];
    a.register_memory(buf.as_ptr() as u64, buf.len() as u64, "*")
        .unwrap();
    let script: Arc<Script> = Arc::new(|mut s: TcpStream, stop: &AtomicBool| {
        if let Some(h) = read_header(&mut s, stop) {
            if h.opcode == Opcode::Read {
                let _ = s.write_all(&wire::encode_status(Status::Ok));
                let _ = s.write_all(&[9u8; 100]);
            } else {
                let mut part = vec![0u8; 4096];
                let _ = read_exactly(&mut s, &mut part, stop);
            }
            reset(s);
        }
    });
    for (op, inline, conns) in [
        (Opcode::Read, true, 2),
        (Opcode::Read, false, 2),
        (Opcode::Write, true, 1),
        (Opcode::Write, false, 1),
    ] {
        let peer = fake_peer(REMOTE, Arc::clone(&script));
        let seg = a.open_segment(&peer.name).unwrap();
        let (st, took) = run(&a, &[req(op, &buf, seg, REMOTE, 1 << 20)], inline);
        assert_eq!(
            st.status,
            TaskStatus::Failed,
            "{op:?} inline={inline}: {st:?}"
        );
        assert_eq!(
            st.cause,
            Some(FailCause::PeerLost),
            "{op:?} inline={inline}: {st:?}"
        );
        assert!(
            took < Duration::from_secs(2),
            "{op:?} inline={inline}: failed only after {took:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(
            peer.accepted.load(Ordering::SeqCst),
            conns,
            "{op:?} inline={inline}: connections used (a WRITE must not be resent)"
        );
    }
}

/// Unregistering local memory while a request into it is in flight (a READ from a
/// trickling peer) stops the request, returns promptly, and nothing lands afterwards.
#[test]
fn unregister_of_local_memory_stops_requests_in_flight() {
    let a = engine(Duration::from_secs(10));
    let buf = vec![0u8; 1 << 20];
    a.register_memory(buf.as_ptr() as u64, buf.len() as u64, "*")
        .unwrap();
    let peer = fake_peer(REMOTE, trickling_script());
    let seg = a.open_segment(&peer.name).unwrap();
    let b = a.allocate_batch(1).unwrap();
    b.submit(&[req(Opcode::Read, &buf, seg, REMOTE, 4096)])
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(snapshot(&buf[..4]).contains(&0xEE), "data was trickling in");
    let start = Instant::now();
    a.unregister_memory(buf.as_ptr() as u64).unwrap();
    let took = start.elapsed();
    fill(&buf, 0x66);
    let st = b.wait(Duration::from_secs(5));
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        took < Duration::from_millis(1500),
        "unregister took {took:?}"
    );
    assert_eq!(st.status, TaskStatus::Failed, "{st:?}");
    assert_eq!(st.cause, Some(FailCause::LocalNotRegistered), "{st:?}");
    assert!(
        snapshot(&buf[..4096]).iter().all(|&x| x == 0x66),
        "bytes landed after unregister returned"
    );
}

/// A v1 (legacy Mooncake) target rejects a request outside its memory only by closing the
/// connection. When the peer's descriptor, re-read, no longer lists the range, the request
/// fails as not registered, not as a lost peer; when it still does, as a lost peer.
#[test]
fn a_v1_rejection_is_told_apart_from_a_lost_peer() {
    let a = engine(Duration::from_secs(5));
    let buf = vec![0u8; 4096];
    a.register_memory(buf.as_ptr() as u64, 4096, "*").unwrap();
    let closes: Arc<Script> = Arc::new(|mut s: TcpStream, stop: &AtomicBool| {
        let _ = read_header(&mut s, stop);
        drop(s); // v1: "rejected" = closed, no answer
    });
    for (unregistered, cause) in [
        (true, FailCause::RemoteNotRegistered),
        (false, FailCause::PeerLost),
    ] {
        for op in [Opcode::Read, Opcode::Write] {
            // The first lookup (open_segment) lists the buffer; later ones do not when the
            // peer "unregistered" it.
            let describe: Arc<Describe> = Arc::new(move |n, hs, data| {
                desc_json(
                    hs,
                    data,
                    1,
                    if n == 0 || !unregistered {
                        &[REMOTE]
                    } else {
                        &[]
                    },
                )
            });
            let peer = fake_peer_with(describe, Arc::clone(&closes));
            let seg = a.open_segment(&peer.name).unwrap();
            let start = Instant::now();
            let st = a
                .transfer_sync(&[req(op, &buf, seg, REMOTE, 4096)], Duration::from_secs(5))
                .unwrap();
            assert_eq!(
                st.status,
                TaskStatus::Failed,
                "{op:?} unregistered={unregistered}: {st:?}"
            );
            assert_eq!(
                st.cause,
                Some(cause),
                "{op:?} unregistered={unregistered}: {st:?}"
            );
            assert!(
                start.elapsed() < Duration::from_secs(2),
                "{op:?}: failed after {:?}",
                start.elapsed()
            );
        }
    }
}

/// A v2 target that rejects a WRITE (its range was unregistered after the initiator read the
/// descriptor) closes without taking the WRITEs pipelined behind it: those go again on a new
/// connection and land (before, they failed as "may have partly landed" with the rejected one).
#[test]
fn writes_queued_behind_a_rejected_one_go_again_and_land() {
    const BAD: u64 = REMOTE;
    const GOOD: u64 = REMOTE + (1 << 20);
    let landed: Arc<std::sync::Mutex<Vec<u8>>> = Arc::default();
    let l2 = Arc::clone(&landed);
    let script: Arc<Script> = Arc::new(move |mut s: TcpStream, stop: &AtomicBool| {
        while let Some(h) = read_header(&mut s, stop) {
            if h.addr == BAD {
                // Wait until the next request is on the wire behind it (in flight), then
                // reject and close without taking it, as a kvferry or Mooncake target does.
                let mut next = [0u8; HEADER_LEN];
                let _ = read_exactly(&mut s, &mut next, stop);
                let _ = s.write_all(&wire::encode_status(Status::Rejected));
                return;
            }
            let mut body = vec![0u8; h.size as usize];
            if read_exactly(&mut s, &mut body, stop).is_none() {
                return;
            }
            *l2.lock().unwrap() = body;
            let _ = s.write_all(&wire::encode_status(Status::Ok));
        }
    });
    let a = TransferEngine::new(Config {
        transfer_timeout: Duration::from_secs(5),
        transport: kvferry::TransportMode::Tcp,
        tcp_lanes: 1,
        ..Config::default()
    })
    .unwrap();
    let buf = vec![0x5Au8; 8192];
    a.register_memory(buf.as_ptr() as u64, buf.len() as u64, "*")
        .unwrap();
    let peer = fake_peer(REMOTE, script);
    let seg = a.open_segment(&peer.name).unwrap();
    let st = a
        .transfer_sync_all(
            &[
                req(Opcode::Write, &buf, seg, BAD, 4096),
                req(Opcode::Write, &buf[4096..], seg, GOOD, 4096),
            ],
            Duration::from_secs(5),
        )
        .unwrap();
    assert_eq!(st[0].status, TaskStatus::Failed, "{:?}", st[0]);
    assert_eq!(
        st[0].cause,
        Some(FailCause::RemoteNotRegistered),
        "{:?}",
        st[0]
    );
    assert_eq!(
        st[1].status,
        TaskStatus::Completed,
        "the WRITE behind the rejected one: {:?}",
        st[1]
    );
    assert_eq!(*landed.lock().unwrap(), vec![0x5Au8; 4096]);
    assert_eq!(
        peer.accepted.load(Ordering::SeqCst),
        2,
        "sent again on a new connection"
    );
}

/// `submit` never waits for the network: a request whose remote range the cached
/// descriptor lacks is handed to the refresher, even when the peer answers descriptor
/// requests slowly; the request then goes through once the fresh descriptor lists it.
#[test]
fn submit_does_not_wait_for_a_slow_descriptor_refresh() {
    let a = engine(Duration::from_secs(5));
    let buf = vec![0u8; 4096];
    a.register_memory(buf.as_ptr() as u64, 4096, "*").unwrap();
    const LATER: u64 = 0x9000_0000;
    // The first lookup lists one buffer; later ones, after 1.5 s, a second one.
    let describe: Arc<Describe> = Arc::new(|n, hs, data| {
        if n > 0 {
            std::thread::sleep(Duration::from_millis(1500));
        }
        desc_json(
            hs,
            data,
            2,
            if n == 0 { &[REMOTE] } else { &[REMOTE, LATER] },
        )
    });
    let peer = fake_peer_with(describe, prompt_script());
    let seg = a.open_segment(&peer.name).unwrap();
    let b = a.allocate_batch(1).unwrap();
    let start = Instant::now();
    b.submit(&[req(Opcode::Read, &buf, seg, LATER, 4096)])
        .unwrap();
    let took = start.elapsed();
    assert!(
        took < Duration::from_millis(300),
        "submit took {took:?}: it waited for the descriptor"
    );
    let st = b.wait(Duration::from_secs(10));
    assert_eq!(st.status, TaskStatus::Completed, "{st:?}");
    assert!(
        start.elapsed() >= Duration::from_millis(1400),
        "completed before the refresh could have answered"
    );
    assert!(snapshot(&buf).iter().all(|&x| x == 0x77));
}

/// A lost connection's descriptor refresh (the peer may have restarted on other ports) runs
/// off the lane's threads: while the peer's handshake port takes 2 s to answer it, a READ sent
/// on the lane's next connection is answered at once. Before, the lane's reader (or writer)
/// ran the refresh and the lane moved nothing until it returned. The lost WRITE fails after
/// the refresh (the peer did not move), as may-have-landed.
#[test]
fn a_lost_peers_descriptor_refresh_does_not_hold_its_lane() {
    let refreshing = Arc::new(AtomicBool::new(false));
    let r2 = Arc::clone(&refreshing);
    let describe: Arc<Describe> = Arc::new(move |n, hs, data| {
        if n > 0 {
            r2.store(true, Ordering::SeqCst);
            std::thread::sleep(Duration::from_secs(2));
        }
        desc_json(hs, data, 2, &[REMOTE])
    });
    let conns = AtomicUsize::new(0);
    let answering = prompt_script();
    let script: Arc<Script> = Arc::new(move |mut s: TcpStream, stop: &AtomicBool| {
        if conns.fetch_add(1, Ordering::SeqCst) == 0 {
            // The first connection is lost once a request's header came: no answer.
            let _ = read_header(&mut s, stop);
            return;
        }
        answering(s, stop)
    });
    let a = TransferEngine::new(Config {
        transfer_timeout: Duration::from_secs(10),
        transport: kvferry::TransportMode::Tcp,
        tcp_lanes: 1,
        ..Config::default()
    })
    .unwrap();
    let buf = vec![0u8; 8192];
    a.register_memory(buf.as_ptr() as u64, buf.len() as u64, "*")
        .unwrap();
    let peer = fake_peer_with(describe, script);
    let seg = a.open_segment(&peer.name).unwrap();
    let lost = a.allocate_batch(1).unwrap();
    lost.submit(&[req(Opcode::Write, &buf[..4096], seg, REMOTE, 4096)])
        .unwrap();
    let until = Instant::now() + Duration::from_secs(5);
    while !refreshing.load(Ordering::SeqCst) {
        assert!(
            Instant::now() < until,
            "the lost WRITE started no descriptor refresh within 5 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let start = Instant::now();
    let st = a
        .transfer_sync(
            &[req(Opcode::Read, &buf[4096..], seg, REMOTE, 4096)],
            Duration::from_secs(10),
        )
        .unwrap();
    let took = start.elapsed();
    assert_eq!(st.status, TaskStatus::Completed, "{st:?}");
    assert!(
        took < Duration::from_secs(1),
        "the READ on the lane's next connection took {took:?}: it waited for the refresh (2 s)"
    );
    assert!(snapshot(&buf[4096..]).iter().all(|&x| x == 0x77));
    let st = lost.wait(Duration::from_secs(10));
    assert_eq!(
        (st.status, st.cause),
        (TaskStatus::Failed, Some(FailCause::PeerLost)),
        "{st:?}"
    );
}

// ------------------------------------------------------------------------------------------
// Terminal means terminal
// ------------------------------------------------------------------------------------------

/// Answers every request correctly (READ data: 0x77), each after `delay`.
fn answering_script(delay: Duration) -> Arc<Script> {
    Arc::new(move |mut s: TcpStream, stop: &AtomicBool| {
        while let Some(h) = read_header(&mut s, stop) {
            std::thread::sleep(delay);
            let _ = s.write_all(&wire::encode_status(Status::Ok));
            if h.opcode == Opcode::Read && s.write_all(&vec![0x77u8; h.size as usize]).is_err() {
                return;
            }
        }
    })
}

fn prompt_script() -> Arc<Script> {
    answering_script(Duration::ZERO)
}

/// A peer that answers a READ correctly, but only after `delay`.
fn late_peer(delay: Duration) -> FakePeer {
    fake_peer(REMOTE, answering_script(delay))
}

/// `transfer_sync`'s timeout is the request's deadline: a late answer ends as TIMEOUT and
/// does not land afterwards; an answer in time is COMPLETED (never TIMEOUT).
#[test]
fn transfer_sync_reports_what_happened_and_returns_only_when_done() {
    let a = engine(Duration::from_secs(10));
    let buf = vec![0u8; 4096];
    a.register_memory(buf.as_ptr() as u64, 4096, "*").unwrap();
    let slow = late_peer(Duration::from_millis(700));
    let seg = a.open_segment(&slow.name).unwrap();
    let start = Instant::now();
    let st = a
        .transfer_sync(
            &[req(Opcode::Read, &buf, seg, REMOTE, 4096)],
            Duration::from_millis(300),
        )
        .unwrap();
    let took = start.elapsed();
    assert_eq!(st.status, TaskStatus::Timeout, "{st:?}");
    assert!(took < Duration::from_millis(650), "returned after {took:?}");
    std::thread::sleep(Duration::from_millis(700));
    assert!(
        snapshot(&buf).iter().all(|&x| x == 0),
        "a TIMEOUT request's bytes landed after transfer_sync returned"
    );

    let quick = late_peer(Duration::from_millis(200));
    let seg = a.open_segment(&quick.name).unwrap();
    let st = a
        .transfer_sync(
            &[req(Opcode::Read, &buf, seg, REMOTE, 4096)],
            Duration::from_millis(1500),
        )
        .unwrap();
    assert_eq!(st.status, TaskStatus::Completed, "{st:?}");
    assert!(snapshot(&buf).iter().all(|&x| x == 0x77));
}

/// A batch with one task that fails at once and one still running is not terminal: a
/// caller that frees its buffers on a terminal status must not see FAILED yet.
#[test]
fn a_batch_is_terminal_only_when_every_task_is() {
    let a = engine(Duration::from_secs(10));
    let buf = vec![0u8; 8192];
    a.register_memory(buf.as_ptr() as u64, 8192, "*").unwrap();
    let slow = late_peer(Duration::from_millis(600));
    let seg = a.open_segment(&slow.name).unwrap();
    let b = a.allocate_batch(2).unwrap();
    // Task 0 is outside the peer's buffers (fails at submit); task 1 answers after 600 ms.
    b.submit(&[
        req(Opcode::Read, &buf, seg, 0x10, 16),
        TransferRequest {
            source: buf.as_ptr() as u64 + 4096,
            ..req(Opcode::Read, &buf, seg, REMOTE, 4096)
        },
    ])
    .unwrap();
    // (Task 0's range is not in the cached descriptor: it fails once a refresh confirms it.)
    let until = Instant::now() + Duration::from_secs(3);
    while b.task_status(0).unwrap().status != TaskStatus::Failed {
        assert!(Instant::now() < until, "task 0 never failed");
        std::thread::sleep(Duration::from_millis(5));
    }
    let early = b.status();
    assert!(
        !early.status.is_terminal(),
        "batch reported {early:?} while a task was still running"
    );
    assert!(!b.is_done(), "a batch with a running task is not done");
    let start = Instant::now();
    let st = b.wait(Duration::from_secs(5));
    assert!(
        start.elapsed() >= Duration::from_millis(400),
        "wait_batch returned at the first failure"
    );
    assert_eq!(st.status, TaskStatus::Failed, "{st:?}");
    assert_eq!(b.task_status(1).unwrap().status, TaskStatus::Completed);
    assert!(b.is_done());
}

// ------------------------------------------------------------------------------------------
// Bad input
// ------------------------------------------------------------------------------------------

#[test]
fn registration_longer_than_isize_max_is_refused() {
    let a = engine(Duration::from_secs(1));
    let e = a
        .register_memory(0x1000, (isize::MAX as u64) + 1, "*")
        .unwrap_err();
    assert!(matches!(e, kvferry::Error::InvalidArgument(_)), "{e}");
    assert!(a.registered().is_empty());
}

/// A handshake request trickled one byte every 100 ms is dropped once the whole frame is
/// overdue (5 s), not held for as long as bytes keep coming.
#[test]
fn a_trickled_handshake_frame_is_dropped() {
    let a = engine(Duration::from_secs(1));
    let mut s = TcpStream::connect(("127.0.0.1", a.rpc_port())).unwrap();
    let frame = handshake::encode(MsgType::Probe, &[b' '; 200]);
    let stop = AtomicBool::new(false);
    let start = Instant::now();
    let sent = trickle(&mut s, &frame, Duration::from_millis(100), &stop);
    let took = start.elapsed();
    assert!(sent < frame.len(), "the whole trickled frame was accepted");
    assert!(took < Duration::from_secs(8), "held for {took:?}");
    a.probe(&format!("127.0.0.1:{}", a.rpc_port()))
        .expect("the handshake port still answers");
}
