//! Issue 45: a request reported over is over. Once a [`kvferry::Batch`] says a request is
//! terminal (its status, a wait), or once the batch is dropped, no byte of the request lands
//! in local memory any more, however the peer goes on sending.
//!
//! The hostile peer is a fake target speaking the TCP data protocol: its handshake port
//! answers late (a loaded peer; the request's clock starts at submit, not at the answer) and
//! its data port answers a READ's status at once, then trickles the data one byte every 2 ms,
//! past the request's deadline, until the engine cuts the connection.
//!
//! Every wait here is bounded; the fake peer stops on its own.

use kvferry::testing::wire::handshake::{self, MsgType};
use kvferry::testing::wire::tcp::{self as wire, DataHeader, Status, HEADER_LEN};
use kvferry::{Batch, Config, FailCause, Opcode, TaskStatus, TransferEngine, TransferRequest};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const REMOTE: u64 = 0x7000_0000;
const LEN: usize = 4096;

/// The fake peer: its segment name and, per data connection, a message once the trickle
/// ended (the engine cut the connection, or 20 s passed), with the bytes it sent.
struct Trickler {
    name: String,
    cut: mpsc::Receiver<usize>,
}

fn trickler(hs_delay: Duration) -> Trickler {
    let hs = TcpListener::bind("127.0.0.1:0").unwrap();
    let data = TcpListener::bind("127.0.0.1:0").unwrap();
    let (hs_port, data_port) = (
        hs.local_addr().unwrap().port(),
        data.local_addr().unwrap().port(),
    );
    let desc = format!(
        r#"{{"name":"127.0.0.1:{hs_port}","protocol":"tcp","tcp_data_port":{data_port},"tcp_proto_version":2,"buffers":[{{"name":"cpu:0","addr":{REMOTE},"length":16777216}}]}}"#
    );
    // The handshake port: every descriptor request answered after `hs_delay` (a slow peer,
    // not synchronisation). The thread blocks in `accept` and ends with the test process.
    std::thread::spawn(move || {
        for s in hs.incoming() {
            let Ok(mut s) = s else { continue };
            let desc = desc.clone();
            std::thread::spawn(move || {
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let mut len = [0u8; 8];
                if s.read_exact(&mut len).is_err() {
                    return;
                }
                let mut body = vec![0u8; (u64::from_le_bytes(len) as usize).min(1 << 20)];
                let _ = s.read_exact(&mut body);
                std::thread::sleep(hs_delay);
                let _ = s.write_all(&handshake::encode(MsgType::Metadata, desc.as_bytes()));
            });
        }
    });
    let (tx, cut) = mpsc::channel();
    std::thread::spawn(move || {
        // One data connection is all a lone READ takes.
        let Ok((mut s, _)) = data.accept() else {
            return;
        };
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut h = [0u8; HEADER_LEN];
        if s.read_exact(&mut h).is_err() {
            return;
        }
        let h = DataHeader::decode(&h).unwrap();
        assert_eq!(h.opcode, Opcode::Read);
        let _ = s.write_all(&wire::encode_status(Status::Ok));
        let until = Instant::now() + Duration::from_secs(20);
        let mut sent = 0;
        while sent < h.size as usize && Instant::now() < until {
            if s.write_all(&[0xEE]).is_err() {
                break;
            }
            sent += 1;
            std::thread::sleep(Duration::from_millis(2)); // the trickle's pace
        }
        let _ = tx.send(sent);
    });
    Trickler {
        name: format!("127.0.0.1:{hs_port}"),
        cut,
    }
}

/// The buffer's bytes now. It is made of atomics (laid out as bytes), so reading it while the
/// engine may still be writing it needs no `unsafe`.
fn snapshot(buf: &[AtomicU8]) -> Vec<u8> {
    buf.iter().map(|b| b.load(Ordering::Relaxed)).collect()
}

/// How the test learns that the READ is over.
#[derive(Debug, Clone, Copy)]
enum Report {
    /// `Batch::wait` returned a terminal status.
    Wait,
    /// `Batch::status` polled until terminal.
    Poll,
    /// The batch was dropped while the READ was in flight.
    Drop,
}

/// Runs one READ from the trickling peer, learns it is over as `how` says, then lets the
/// peer send until the engine cut it: the buffer must not change after the report.
fn read_from_trickler(how: Report) {
    let a = TransferEngine::new(Config {
        transfer_timeout: Duration::from_millis(600),
        transport: kvferry::TransportMode::Tcp,
        tcp_lanes: 1,
        ..Config::default()
    })
    .unwrap();
    let buf: Vec<AtomicU8> = (0..LEN).map(|_| AtomicU8::new(0)).collect();
    a.register_memory(buf.as_ptr() as u64, LEN as u64, "*")
        .unwrap();
    let peer = trickler(Duration::from_millis(300));
    let start = Instant::now();
    // Opened as part of the request, as Mooncake's API does: the descriptor comes late.
    let seg = a.open_segment(&peer.name).unwrap();
    let batch: Batch = a.allocate_batch(1).unwrap();
    batch
        .submit(&[TransferRequest {
            opcode: Opcode::Read,
            source: buf.as_ptr() as u64,
            target_id: seg,
            target_offset: REMOTE,
            length: LEN as u64,
        }])
        .unwrap();
    let st = match how {
        Report::Wait => Some(batch.wait(Duration::from_secs(10))),
        Report::Poll => {
            let until = Instant::now() + Duration::from_secs(10);
            loop {
                let st = batch.status();
                if st.status.is_terminal() {
                    break Some(st);
                }
                assert!(Instant::now() < until, "not terminal in 10 s: {st:?}");
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        Report::Drop => {
            assert!(!batch.is_done(), "the READ ended before it was dropped");
            drop(batch);
            None
        }
    };
    let took = start.elapsed();
    let reported = snapshot(&buf);
    let landed = reported.iter().filter(|&&x| x == 0xEE).count();
    if let Some(st) = &st {
        assert_eq!(st.status, TaskStatus::Timeout, "{how:?}: {st:?}");
        assert_eq!(st.cause, Some(FailCause::Timeout), "{how:?}: {st:?}");
    }
    assert!(
        landed > 0 && landed < LEN,
        "{how:?}: {landed} bytes had landed when the READ was over"
    );
    assert!(
        took < Duration::from_secs(3),
        "{how:?}: over after {took:?}"
    );
    let sent = peer
        .cut
        .recv_timeout(Duration::from_secs(25))
        .expect("the peer's trickle ends");
    assert!(sent < LEN, "{how:?}: the engine never cut the connection");
    let after = snapshot(&buf);
    assert_eq!(
        after.iter().filter(|&&x| x == 0xEE).count(),
        landed,
        "{how:?}: bytes landed after the READ was reported over ({sent} sent)"
    );
    assert!(
        after == reported,
        "{how:?}: the buffer changed after the report"
    );
}

#[test]
fn a_read_reported_over_by_wait_gets_no_more_bytes() {
    read_from_trickler(Report::Wait);
}

#[test]
fn a_read_reported_over_by_its_status_gets_no_more_bytes() {
    read_from_trickler(Report::Poll);
}

#[test]
fn a_read_whose_batch_was_dropped_gets_no_more_bytes() {
    read_from_trickler(Report::Drop);
}
