//! Faults on one RDMA queue pair must not spill over to other tasks (in the Soft-RoCE VM:
//! `rdma_faults 10.99.2.1`, devices `rxe0` and `rxe_lo`):
//!
//! 1. **A deadline fails only its own task.** The peer's QPs serving our `rxe_lo` pair are
//!    destroyed (a `Connection` message for the same NIC pair makes the peer replace them), so
//!    what is posted there stalls. A 1 MiB WRITE with a 300 ms deadline, then one with 30 s,
//!    go on the same QPs; at the first's deadline its QPs are flushed: it ends TIMEOUT, and the
//!    second's flushed work requests must be posted again (on `rxe0` or a rebuilt `rxe_lo`
//!    endpoint) and complete, every byte verified.
//! 2. **A failed work completion is retried on another NIC pair.** With
//!    `KVFERRY_RDMA_RETRY_CNT=6` (Soft-RoCE retries forever at Mooncake's 7), the slices posted
//!    on the `rxe_lo` pair whose peer QPs are gone end `IBV_WC_RETRY_EXC_ERR`; they must be
//!    posted again on `rxe0` and the 4 MiB WRITE / READ complete, bytes verified.
//! 3. **Endpoint eviction.** With `KVFERRY_RDMA_MAX_ENDPOINTS=1`, requests to two peers over
//!    two NICs still complete (endpoints closed and reconnected), bytes verified.
//! 4. **`auto` picks RDMA** to a peer that publishes RDMA devices, TCP to one that does not
//!    (and that peer reaches it over TCP: it publishes a TCP descriptor), bytes verified.
//! 5. **A failed request does not strand the others on its endpoint.** Over one NIC pair, a
//!    READ of a buffer the peer unregistered (its rkey refused: `IBV_WC_REM_ACCESS_ERR`) fails
//!    while a 16 MiB READ (then WRITE) of the same submission goes out on the same endpoint's
//!    QPs; the endpoint is flushed whole and rebuilt, and the peer then replaces its QPs of
//!    the pair. The 16 MiB request must complete, verified, its flushed work requests posted
//!    again. (The code before the flush passes this too: on Soft-RoCE the other QP's work
//!    requests finished before the peer replaced its QPs. It guards the flush and repost.)
//! 6. **A stalled peer holds up only its own requests.** A peer process is stopped (SIGSTOP)
//!    before this engine's first connection to it: connecting waits for the handshake's
//!    timeout. A WRITE to another peer submitted meanwhile must complete at once (before, one
//!    posting thread served every peer, and it waited behind the stalled connect).
//!
//! Exits non-zero on any failure.

use kvferry::TransportMode;
use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest};
use std::process::ExitCode;
use std::time::{Duration, Instant};

mod common;
use common::*;

const SIZE: usize = 16 << 20;

fn main() -> ExitCode {
    let host = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "10.99.2.1".into());
    if std::env::args().nth(2).as_deref() == Some("serve") {
        return finish("rdma_faults serve", "stopped", serve(&host));
    }
    finish("rdma_faults", "all checks passed", run(&host))
}

/// The peer process of check 6: an engine with a 1 MiB buffer; prints its segment name and
/// the buffer's address, then waits to be killed.
fn serve(host: &str) -> Res<()> {
    let e = TransferEngine::new(config(host)).map_err(|e| e.to_string())?;
    let b = Buf::new(1 << 20)?;
    e.register_memory(b.addr(), 1 << 20, "cpu:0")
        .map_err(|e| e.to_string())?;
    println!("{} {}", e.segment_name(), b.addr());
    std::thread::sleep(Duration::from_secs(600));
    Ok(())
}

fn config(host: &str) -> Config {
    Config {
        local_hostname: host.into(),
        transport: TransportMode::Rdma,
        transfer_timeout: Duration::from_secs(10),
        ..Config::default()
    }
}

/// Two engines with registered 16 MiB buffers, `a` having opened `b`.
struct Pair {
    a: TransferEngine,
    b: TransferEngine,
    ba: Buf,
    bb: Buf,
    peer: u64,
}

fn pair(cfg: &Config) -> Res<Pair> {
    let a = TransferEngine::new(cfg.clone()).map_err(|e| e.to_string())?;
    let b = TransferEngine::new(cfg.clone()).map_err(|e| e.to_string())?;
    let (ba, bb) = (Buf::new(SIZE)?, Buf::new(SIZE)?);
    a.register_memory(ba.addr(), SIZE as u64, "cpu:0")
        .map_err(|e| e.to_string())?;
    b.register_memory(bb.addr(), SIZE as u64, "cpu:0")
        .map_err(|e| e.to_string())?;
    let peer = a
        .open_segment(b.segment_name())
        .map_err(|e| e.to_string())?;
    Ok(Pair { a, b, ba, bb, peer })
}

impl Pair {
    fn req(&self, op: Opcode, off: u64, len: usize) -> TransferRequest {
        TransferRequest {
            opcode: op,
            source: self.ba.addr() + off,
            target_id: self.peer,
            target_offset: self.bb.addr() + off,
            length: len as u64,
        }
    }
}

fn deadline_fails_only_its_task(cfg: &Config, op: Opcode) -> Res<()> {
    // Both pairs connected, so both requests go on the same QPs; what is posted on the
    // rxe_lo pair stalls (the NIC retries).
    let mut p = pair_with_dead_rxe_lo(cfg)?;
    fill(p.ba.bytes(), 1000);
    fill(p.bb.bytes(), 2000);
    let (short, long) = (
        p.req(Opcode::Write, 0, 1 << 20),
        p.req(op, 1 << 20, 1 << 20),
    );
    let t0 = Instant::now();
    let (t1, t2) = std::thread::scope(|s| {
        let a = &p.a;
        let h1 = s.spawn(move || {
            a.transfer_sync(&[short], Duration::from_millis(300))
                .map(|r| (r, t0.elapsed()))
        });
        std::thread::sleep(Duration::from_millis(30));
        let h2 = s.spawn(move || {
            a.transfer_sync(&[long], Duration::from_secs(30))
                .map(|r| (r, t0.elapsed()))
        });
        (h1.join(), h2.join())
    });
    let ((t1, e1), (t2, e2)) = match (t1, t2) {
        (Ok(Ok(x)), Ok(Ok(y))) => (x, y),
        _ => return Err("a transfer failed to start, or its thread panicked".into()),
    };
    println!(
        "rdma_faults: (300 ms WRITE ended {:?} after {e1:?}: {}; 30 s {op:?} {:?} after {e2:?})",
        t1.status,
        t1.reason.clone().unwrap_or_default(),
        t2.status
    );
    if t2.status != TaskStatus::Completed {
        return Err(format!("a 30 s {op:?} queued on the same QPs as a 300 ms WRITE that expired ended {:?} ({:?}: {})", t2.status, t2.cause, t2.reason.unwrap_or_default()));
    }
    let (ba, bb) = (
        p.ba.bytes()[..2 << 20].to_vec(),
        p.bb.bytes()[..2 << 20].to_vec(),
    );
    compare(&format!("the 30 s {op:?}"), &bb[1 << 20..], &ba[1 << 20..])?;
    if t1.status != TaskStatus::Timeout {
        println!(
            "rdma_faults: inconclusive: the 300 ms WRITE ended {:?}, not TIMEOUT",
            t1.status
        );
        return Ok(());
    }
    println!("rdma_faults: a 300 ms WRITE ended TIMEOUT and a 30 s {op:?} queued behind it on the same QPs completed, 1 MiB verified");
    Ok(())
}

/// A [`pair`] whose endpoints on both NIC pairs are connected by a first 1 MiB WRITE, then
/// the peer's QPs of the `rxe_lo` pair destroyed ([`kill_peer_qps`]).
fn pair_with_dead_rxe_lo(cfg: &Config) -> Res<Pair> {
    let p = pair(cfg)?;
    let desc = p.a.segment_descriptor(p.peer).map_err(|e| e.to_string())?;
    let lo = desc
        .devices
        .iter()
        .find(|d| d.name == "rxe_lo")
        .ok_or("the peer has no rxe_lo")?
        .gid
        .clone();
    let st =
        p.a.transfer_sync(&[p.req(Opcode::Write, 0, 1 << 20)], Duration::from_secs(20))
            .map_err(|e| e.to_string())?;
    if st.status != TaskStatus::Completed {
        return Err(format!("the first WRITE: {st:?}"));
    }
    kill_peer_qps(&p.a, &p.b, "rxe_lo", &lo)?;
    Ok(p)
}

/// Makes `b` replace its QPs for `a`'s endpoint `a@nic -> b@nic` (as when `a` reconnects that
/// pair), so the QPs `a` holds point to QPs that are gone.
fn kill_peer_qps(a: &TransferEngine, b: &TransferEngine, nic: &str, gid: &str) -> Res<()> {
    use kvferry::testing::wire::handshake::MsgType;
    use kvferry::testing::wire::rdma::ConnectionMsg;
    let host = b
        .segment_name()
        .rsplit_once(':')
        .map_or("127.0.0.1", |(h, _)| h)
        .to_string();
    let m = ConnectionMsg {
        local_nic_path: format!("{}@{nic}", a.segment_name()),
        local_gid: gid.into(),
        peer_nic_path: format!("{}@{nic}", b.segment_name()),
        qp_num: vec![0x7ff0, 0x7ff1],
        ..Default::default()
    };
    let f = kvferry::handshake::request(
        &host,
        b.rpc_port(),
        MsgType::Connection,
        &m.encode(),
        Duration::from_secs(5),
        Duration::from_secs(10),
        1 << 20,
        None,
    )
    .map_err(|e| e.to_string())?;
    let r = ConnectionMsg::decode(&f.body)
        .map_err(|e| format!("answer {}: {e}", String::from_utf8_lossy(&f.body)))?;
    match r.refused() {
        Some(why) => Err(format!("the peer refused the replacing Connection: {why}")),
        None => Ok(()),
    }
}

/// The peer's QPs of our `rxe_lo` pair go: with a finite QP retry count, the slices posted
/// there end `IBV_WC_RETRY_EXC_ERR`; they must be posted again on `rxe0`, and the request
/// complete, bytes verified (WRITE and READ).
fn failed_completion_retried_on_another_pair(cfg: &Config) -> Res<()> {
    for op in [Opcode::Write, Opcode::Read] {
        let mut p = pair_with_dead_rxe_lo(cfg)?;
        fill(p.ba.bytes(), 7);
        fill(p.bb.bytes(), 8);
        let t = Instant::now();
        let st =
            p.a.transfer_sync(&[p.req(op, 0, 4 << 20)], Duration::from_secs(20))
                .map_err(|e| e.to_string())?;
        println!(
            "rdma_faults: ({op:?} with a dead pair ended {:?} after {:?}: {})",
            st.status,
            t.elapsed(),
            st.reason.clone().unwrap_or_default()
        );
        if st.status != TaskStatus::Completed {
            return Err(format!(
                "a 4 MiB {op:?} with the rxe_lo pair's peer QPs gone ended {:?} ({:?}: {})",
                st.status,
                st.cause,
                st.reason.unwrap_or_default()
            ));
        }
        let (ba, bb) = (
            p.ba.bytes()[..4 << 20].to_vec(),
            p.bb.bytes()[..4 << 20].to_vec(),
        );
        compare(&format!("the retried {op:?}"), &bb, &ba)?;
        println!("rdma_faults: a 4 MiB {op:?} whose rxe_lo slices failed (peer QPs gone) was retried on rxe0 and completed, verified ({:.0} ms)", t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(())
}

fn eviction(cfg: &Config) -> Res<()> {
    let cfg = Config {
        rdma_max_endpoints: 1,
        ..cfg.clone()
    };
    let mut p = pair(&cfg)?;
    let mut bc = Buf::new(1 << 20)?;
    let c = TransferEngine::new(cfg.clone()).map_err(|e| e.to_string())?;
    c.register_memory(bc.addr(), 1 << 20, "cpu:0")
        .map_err(|e| e.to_string())?;
    let pc =
        p.a.open_segment(c.segment_name())
            .map_err(|e| e.to_string())?;
    for round in 0..4u64 {
        fill(&mut p.ba.bytes()[..1 << 20], 20 + round);
        let st =
            p.a.transfer_sync(&[p.req(Opcode::Write, 0, 1 << 20)], Duration::from_secs(20))
                .map_err(|e| e.to_string())?;
        if st.status != TaskStatus::Completed {
            return Err(format!(
                "round {round}, WRITE to b with 1 cached endpoint: {st:?}"
            ));
        }
        let (ba, bb) = (
            p.ba.bytes()[..1 << 20].to_vec(),
            p.bb.bytes()[..1 << 20].to_vec(),
        );
        compare("WRITE to b", &bb, &ba)?;
        let req = TransferRequest {
            opcode: Opcode::Write,
            source: p.ba.addr(),
            target_id: pc,
            target_offset: bc.addr(),
            length: 1 << 20,
        };
        let st =
            p.a.transfer_sync(&[req], Duration::from_secs(20))
                .map_err(|e| e.to_string())?;
        if st.status != TaskStatus::Completed {
            return Err(format!(
                "round {round}, WRITE to c with 1 cached endpoint: {st:?}"
            ));
        }
        compare("WRITE to c", bc.bytes(), &ba)?;
    }
    println!("rdma_faults: with KVFERRY_RDMA_MAX_ENDPOINTS=1, 4 rounds of 1 MiB WRITEs to two peers over two NICs verified");
    c.unregister_memory(bc.addr()).map_err(|e| e.to_string())?;
    Ok(())
}

/// `KVFERRY_TRANSPORT=auto` on a host with active NICs: RDMA to a peer that publishes RDMA
/// devices, TCP to one that does not; it publishes a TCP descriptor.
fn auto_picks_rdma_when_both_sides_have_it(cfg: &Config) -> Res<()> {
    let auto = TransferEngine::new(Config {
        transport: TransportMode::Auto,
        ..cfg.clone()
    })
    .map_err(|e| e.to_string())?;
    let rdma = TransferEngine::new(cfg.clone()).map_err(|e| e.to_string())?;
    let tcp = TransferEngine::new(Config {
        transport: TransportMode::Tcp,
        ..cfg.clone()
    })
    .map_err(|e| e.to_string())?;
    let (mut ba, mut bb, mut bc) = (Buf::new(1 << 20)?, Buf::new(1 << 20)?, Buf::new(1 << 20)?);
    auto.register_memory(ba.addr(), 1 << 20, "cpu:0")
        .map_err(|e| e.to_string())?;
    rdma.register_memory(bb.addr(), 1 << 20, "cpu:0")
        .map_err(|e| e.to_string())?;
    tcp.register_memory(bc.addr(), 1 << 20, "cpu:0")
        .map_err(|e| e.to_string())?;
    let check = |from: &TransferEngine,
                 to: &TransferEngine,
                 src: &mut Buf,
                 dst: &mut Buf,
                 want: &str,
                 seed: u64|
     -> Res<()> {
        let id = from
            .open_segment(to.segment_name())
            .map_err(|e| e.to_string())?;
        let via = from.segment_transport(id).map_err(|e| e.to_string())?;
        if via.name != want {
            return Err(format!(
                "auto: requests from {} to {} go by {}, not {want} ({via:?})",
                from.segment_name(),
                to.segment_name(),
                via.name
            ));
        }
        fill(src.bytes(), seed);
        dst.bytes().fill(0);
        let req = TransferRequest {
            opcode: Opcode::Write,
            source: src.addr(),
            target_id: id,
            target_offset: dst.addr(),
            length: 1 << 20,
        };
        let st = from
            .transfer_sync(&[req], Duration::from_secs(20))
            .map_err(|e| e.to_string())?;
        if st.status != TaskStatus::Completed {
            return Err(format!("auto: a WRITE by {want}: {st:?}"));
        }
        let (s, d) = (src.bytes().to_vec(), dst.bytes().to_vec());
        compare(&format!("auto: a WRITE by {want}"), &d, &s)
    };
    check(&auto, &rdma, &mut ba, &mut bb, "rdma", 31)?;
    check(&auto, &tcp, &mut ba, &mut bc, "tcp", 33)?;
    check(&tcp, &auto, &mut bc, &mut ba, "tcp", 34)?;
    // It publishes a TCP descriptor (Mooncake TCP peers select their transport by it).
    let id = tcp
        .open_segment(auto.segment_name())
        .map_err(|e| e.to_string())?;
    let d = tcp.segment_descriptor(id).map_err(|e| e.to_string())?;
    if d.protocol.contains("rdma") || !d.devices.is_empty() {
        return Err(format!(
            "auto: the engine publishes {:?} with devices {:?}, not a TCP descriptor",
            d.protocol, d.devices
        ));
    }
    println!("rdma_faults: KVFERRY_TRANSPORT=auto: RDMA to a peer with RDMA, TCP to and from a peer without, 1 MiB WRITEs verified; it publishes a TCP descriptor");
    Ok(())
}

/// Check 5 (see the module's doc), for a READ and a WRITE in flight.
fn a_failed_request_does_not_strand_others_on_its_endpoint(cfg: &Config) -> Res<()> {
    let cfg = Config {
        rdma_devices: Some(vec!["rxe0".into()]),
        ..cfg.clone()
    };
    for op in [Opcode::Read, Opcode::Write] {
        // The peer registers `gone` before this engine reads its descriptor, which then
        // lists it; later the peer unregisters it (its key goes).
        let a = TransferEngine::new(cfg.clone()).map_err(|e| e.to_string())?;
        let b = TransferEngine::new(cfg.clone()).map_err(|e| e.to_string())?;
        let (ba, bb, gone) = (Buf::new(SIZE)?, Buf::new(SIZE)?, Buf::new(1 << 20)?);
        a.register_memory(ba.addr(), SIZE as u64, "cpu:0")
            .map_err(|e| e.to_string())?;
        b.register_memory(bb.addr(), SIZE as u64, "cpu:0")
            .map_err(|e| e.to_string())?;
        b.register_memory(gone.addr(), 1 << 20, "cpu:0")
            .map_err(|e| e.to_string())?;
        let peer = a
            .open_segment(b.segment_name())
            .map_err(|e| e.to_string())?;
        let mut p = Pair { a, b, ba, bb, peer };
        let first =
            p.a.transfer_sync(&[p.req(Opcode::Write, 0, 1 << 20)], Duration::from_secs(20))
                .map_err(|e| e.to_string())?;
        if first.status != TaskStatus::Completed {
            return Err(format!("the first WRITE: {first:?}"));
        }
        p.b.unregister_memory(gone.addr())
            .map_err(|e| e.to_string())?;
        fill(p.ba.bytes(), 31);
        fill(p.bb.bytes(), 32);
        let big = p.req(op, 0, SIZE);
        let bad = TransferRequest {
            opcode: Opcode::Read,
            source: p.ba.addr(),
            target_id: peer,
            target_offset: gone.addr(),
            length: 4096,
        };
        // One submission: the bad READ is posted first, and the 16 MiB request's slices go
        // out on both QPs of the endpoint while its refusal comes back.
        let t0 = Instant::now();
        let st =
            p.a.transfer_sync_all(&[bad, big], Duration::from_secs(20))
                .map_err(|e| e.to_string())?;
        let eb = t0.elapsed();
        let (rx, rb) = (&st[0], &st[1]);
        println!("rdma_faults: (16 MiB {op:?} ended {:?} after {eb:?}; the READ of an unregistered buffer {:?} {:?}: {})", rb.status, rx.status, rx.cause, rx.reason.clone().unwrap_or_default());
        if rx.status != TaskStatus::Failed
            || !rx
                .reason
                .as_deref()
                .unwrap_or_default()
                .contains("REM_ACCESS")
        {
            return Err(format!("a READ of a buffer the peer unregistered ended {:?} ({:?}), not FAILED by the peer's NIC (IBV_WC_REM_ACCESS_ERR)", rx.status, rx.reason));
        }
        if rb.status != TaskStatus::Completed {
            return Err(format!("a 16 MiB {op:?} in flight on the endpoint of a request that failed ended {:?} ({:?}: {})", rb.status, rb.cause, rb.reason.clone().unwrap_or_default()));
        }
        let (ba, bb) = (p.ba.bytes().to_vec(), p.bb.bytes().to_vec());
        compare(&format!("the 16 MiB {op:?}"), &bb, &ba)?;
        println!("rdma_faults: a 16 MiB {op:?} in flight on the endpoint of a request that failed (remote access) completed, verified ({:.0} ms)", eb.as_secs_f64() * 1e3);
    }
    Ok(())
}

/// Check 6 (see the module's doc).
fn a_stalled_peer_holds_up_only_its_own_requests(host: &str, cfg: &Config) -> Res<()> {
    use std::io::BufRead;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = std::process::Command::new(exe)
        .args([host, "serve"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting the peer process: {e}"))?;
    // (rustix, not a `kill` program the host may lack.)
    use rustix::process::{kill_process, Pid, Signal};
    let pid = i32::try_from(child.id())
        .ok()
        .and_then(Pid::from_raw)
        .ok_or("the peer process has no pid")?;
    let signal = |sig: Signal| kill_process(pid, sig).is_ok();
    let r = (|| -> Res<()> {
        let mut line = String::new();
        let out = child.stdout.take().ok_or("no stdout")?;
        std::io::BufReader::new(out)
            .read_line(&mut line)
            .map_err(|e| e.to_string())?;
        let (name, addr) = line
            .trim()
            .split_once(' ')
            .ok_or_else(|| format!("the peer process said {line:?}"))?;
        let addr: u64 = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
        let mut p = pair(cfg)?;
        let stalled = p.a.open_segment(name).map_err(|e| e.to_string())?;
        if !signal(Signal::STOP) {
            return Err("SIGSTOP to the peer process failed".into());
        }
        fill(p.ba.bytes(), 41);
        let to_stalled = TransferRequest {
            opcode: Opcode::Write,
            source: p.ba.addr(),
            target_id: stalled,
            target_offset: addr,
            length: 4096,
        };
        let live = p.req(Opcode::Write, 1 << 20, 1 << 20);
        let (rs, rl) = std::thread::scope(|s| {
            let a = &p.a;
            let hs = s.spawn(move || a.transfer_sync(&[to_stalled], Duration::from_secs(8)));
            std::thread::sleep(Duration::from_millis(100));
            let t = Instant::now();
            let hl = s.spawn(move || {
                a.transfer_sync(&[live], Duration::from_secs(20))
                    .map(|r| (r, t.elapsed()))
            });
            (hs.join(), hl.join())
        });
        let (rs, (rl, el)) = match (rs, rl) {
            (Ok(Ok(s)), Ok(Ok(l))) => (s, l),
            _ => return Err("a transfer failed to start, or its thread panicked".into()),
        };
        println!(
            "rdma_faults: (to the stopped peer: {:?}; to the live one: {:?} after {el:?})",
            rs.status, rl.status
        );
        if rl.status != TaskStatus::Completed {
            return Err(format!(
                "a WRITE to a live peer ended {:?} ({:?}: {})",
                rl.status,
                rl.cause,
                rl.reason.unwrap_or_default()
            ));
        }
        if el > Duration::from_secs(3) {
            return Err(format!("a WRITE to a live peer took {el:?} while another peer's connect stalled: it waited for it"));
        }
        let (ba, bb) = (
            p.ba.bytes()[1 << 20..2 << 20].to_vec(),
            p.bb.bytes()[1 << 20..2 << 20].to_vec(),
        );
        compare("the WRITE to the live peer", &bb, &ba)?;
        if rs.status == TaskStatus::Completed {
            return Err("a WRITE to a stopped peer completed".into());
        }
        println!("rdma_faults: a WRITE to a live peer completed in {:.0} ms while another peer's connect stalled (stopped process), verified", el.as_secs_f64() * 1e3);
        Ok(())
    })();
    signal(Signal::KILL);
    let _ = child.wait();
    r
}

fn run(host: &str) -> Res<()> {
    let cfg = config(host);
    deadline_fails_only_its_task(&cfg, Opcode::Write)?;
    deadline_fails_only_its_task(&cfg, Opcode::Read)?;
    failed_completion_retried_on_another_pair(&Config {
        rdma_retry_cnt: 6,
        ..cfg.clone()
    })?;
    eviction(&cfg)?;
    auto_picks_rdma_when_both_sides_have_it(&cfg)?;
    a_failed_request_does_not_strand_others_on_its_endpoint(&cfg)?;
    // (One NIC: a stalled connect then waits the handshake's 10 s once, not once per NIC.)
    a_stalled_peer_holds_up_only_its_own_requests(
        host,
        &Config {
            rdma_devices: Some(vec!["rxe0".into()]),
            ..cfg.clone()
        },
    )?;
    Ok(())
}
