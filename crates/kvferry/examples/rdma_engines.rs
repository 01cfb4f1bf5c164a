//! Two transfer engines with `KVFERRY_TRANSPORT=rdma` in one process, moving data through
//! the engine API over real verbs (in the Soft-RoCE VM: `rdma_engines 10.99.2.1 [devices]`):
//! descriptors with devices and per-NIC keys, QPs connected through the engines' handshake
//! ports (`Connection` messages), WRITE and READ of 4 KiB-16 MiB and a batch of 64 requests,
//! every byte verified; then a remote range outside the peer's memory and a WRITE to memory
//! the peer unregistered, which must both fail. Exits non-zero on any failure.

use kvferry::TransportMode;
use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest};
use std::process::ExitCode;
use std::time::{Duration, Instant};

mod common;
use common::*;

const SIZE: usize = 16 << 20;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let host = args.get(1).cloned().unwrap_or_else(|| "10.99.2.1".into());
    let devices = args
        .get(2)
        .map(|d| d.split(',').map(str::to_string).collect());
    finish("rdma_engines", "all checks passed", run(&host, devices))
}

/// The passive side as a stock Mooncake engine drives it: its `Connection` message announces
/// `ready_ack` support and 2 QPs (here 3, to show the count is followed), the answer must carry
/// as many QPs and no `ready_ack` (so Mooncake skips the extra round), a `ready_ack: true`
/// round is answered, and one for an unknown connection refused.
fn handshake_as_mooncake_does(b: &TransferEngine, gid: &str) -> Res<()> {
    use kvferry::testing::wire::handshake::MsgType;
    use kvferry::testing::wire::rdma::ConnectionMsg;
    let ask = |m: &ConnectionMsg| -> Res<ConnectionMsg> {
        let host = b
            .segment_name()
            .rsplit_once(':')
            .map_or("127.0.0.1", |(h, _)| h);
        let f = kvferry::handshake::request(
            host,
            b.rpc_port(),
            MsgType::Connection,
            &m.encode(),
            Duration::from_secs(5),
            Duration::from_secs(10),
            1 << 20,
            None,
        )
        .map_err(|e| e.to_string())?;
        ConnectionMsg::decode(&f.body)
            .map_err(|e| format!("answer {}: {e}", String::from_utf8_lossy(&f.body)))
    };
    let req = ConnectionMsg {
        local_nic_path: "10.99.2.1:1@rxe0".into(),
        local_gid: gid.into(),
        peer_nic_path: format!("{}@rxe0", b.segment_name()),
        qp_num: vec![0x123, 0x124, 0x125],
        ready_ack: Some(false),
        ..Default::default()
    };
    let r = ask(&req)?;
    if r.refused().is_some()
        || r.qp_num.len() != 3
        || r.ready_ack.is_some()
        || r.local_nic_path != req.peer_nic_path
        || r.peer_nic_path != req.local_nic_path
    {
        return Err(format!("a Mooncake-style Connection was answered {r:?}"));
    }
    let ack = ask(&ConnectionMsg {
        ready_ack: Some(true),
        ..req.clone()
    })?;
    if let Some(why) = ack.refused() {
        return Err(format!("the ready ACK was refused: {why}"));
    }
    let stray = ask(&ConnectionMsg {
        ready_ack: Some(true),
        local_nic_path: "10.99.2.1:2@rxe0".into(),
        ..req.clone()
    })?;
    if stray.refused().is_none() {
        return Err("a ready ACK for an unknown connection was accepted".into());
    }
    let no_nic = ask(&ConnectionMsg {
        peer_nic_path: format!("{}@mlx5_7", b.segment_name()),
        ..req
    })?;
    let why = no_nic
        .refused()
        .ok_or("a Connection to a NIC it lacks was accepted")?
        .to_string();
    println!("rdma_engines: Mooncake-style handshake: 3 QPs answered with 3, ready ACK answered, a stray ACK and a missing NIC refused ({why})");
    Ok(())
}

/// A batch whose second range cannot be registered on the NICs (nothing is mapped at 8 KiB:
/// below `vm.mmap_min_addr`) fails as a whole, and the first range's MRs, made before the
/// failure, are gone with it (no registration outlives the failed `register_memory_batch`).
fn failed_batch_leaves_no_mr(b: &TransferEngine) -> Res<()> {
    let before = b.rdma_usage().ok_or("b has no RDMA transport")?.regions;
    let ok = Buf::new(4096)?;
    let r = b.register_memory_batch(&[(ok.addr(), 4096), (8192, 4096)], "cpu:0");
    let after = b.rdma_usage().ok_or("b has no RDMA transport")?.regions;
    match r {
        Err(e) if after == before && !b.is_registered(ok.addr(), 1) => {
            println!("rdma_engines: a batch with a range the NICs refuse failed ({e}) and left no MR ({after} ranges keyed, as before)");
            Ok(())
        }
        r => Err(format!(
            "a batch with an unmapped range: {r:?}; ranges keyed {before} before, {after} after"
        )),
    }
}

/// A peer that asks for QPs without limit (the same segment name, a new device name each
/// time, 16 QPs each) is refused once it holds what a peer with 16 NICs could ask of `b`'s
/// NICs; the refusal names the cause, and nothing `b` held is evicted for it.
fn passive_bound_refuses(b: &TransferEngine, gid: &str) -> Res<()> {
    use kvferry::testing::wire::handshake::MsgType;
    use kvferry::testing::wire::rdma::ConnectionMsg;
    let host = b
        .segment_name()
        .rsplit_once(':')
        .map_or("127.0.0.1", |(h, _)| h)
        .to_string();
    let before = b.rdma_usage().ok_or("b has no RDMA transport")?;
    let nics = b.local_descriptor().devices.len();
    // The peer's name is an address that answers (a listener of ours), so the sweep a refusal
    // starts finds it alive: only the bound can refuse it. Dropped at the end, its pairs go
    // at a later sweep, as a departed peer's.
    let live = std::net::TcpListener::bind((host.as_str(), 0)).map_err(|e| e.to_string())?;
    let name = live.local_addr().map_err(|e| e.to_string())?.to_string();
    let mut accepted = 0;
    for i in 0.. {
        let m = ConnectionMsg {
            local_nic_path: format!("{name}@fake{i}"),
            local_gid: gid.into(),
            peer_nic_path: format!("{}@rxe0", b.segment_name()),
            qp_num: (0..16).map(|q| 0x1000 + q).collect(),
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
        let r = ConnectionMsg::decode(&f.body).map_err(|e| e.to_string())?;
        match r.refused() {
            None => accepted += 1,
            Some(why) if why.contains(&format!("too many RDMA connections from {name}")) => {
                let after = b.rdma_usage().ok_or("b has no RDMA transport")?;
                // Its 16 x NICs connections of 16 QPs are held (the sweeps may have released
                // other, departed peers' pairs meanwhile).
                if accepted != 16 * nics
                    || after.passive_qps < 256 * nics
                    || after.passive_qps > before.passive_qps + 256 * nics
                {
                    return Err(format!("the per-peer bound: {accepted} connections accepted, {after:?} held ({before:?} before)"));
                }
                println!("rdma_engines: a peer asking for QPs without limit was refused after {accepted} connections ({why})");
                drop(live);
                return Ok(());
            }
            Some(why) => return Err(format!("connection {i} refused for another cause: {why}")),
        }
        if i > 64 * nics {
            break;
        }
    }
    Err(format!(
        "{accepted} connections of 16 QPs accepted from one peer: no bound"
    ))
}

fn run(host: &str, devices: Option<Vec<String>>) -> Res<()> {
    let cfg = Config {
        local_hostname: host.into(),
        transport: TransportMode::Rdma,
        transfer_timeout: Duration::from_secs(10),
        rdma_devices: devices,
        ..Config::default()
    };
    let a = TransferEngine::new(cfg.clone()).map_err(|e| e.to_string())?;
    let b = TransferEngine::new(cfg.clone()).map_err(|e| e.to_string())?;
    let (mut ba, mut bb) = (Buf::new(SIZE)?, Buf::new(SIZE)?);
    a.register_memory(ba.addr(), SIZE as u64, "cpu:0")
        .map_err(|e| e.to_string())?;
    b.register_memory(bb.addr(), SIZE as u64, "cpu:0")
        .map_err(|e| e.to_string())?;
    let peer = a
        .open_segment(b.segment_name())
        .map_err(|e| e.to_string())?;
    let desc = a.segment_descriptor(peer).map_err(|e| e.to_string())?;
    let devs: Vec<&str> = desc.devices.iter().map(|d| d.name.as_str()).collect();
    let buf = desc
        .buffers
        .first()
        .ok_or("the peer's descriptor lists no buffer")?;
    if !desc.protocol.contains("rdma")
        || devs.is_empty()
        || buf.rkey.len() != devs.len()
        || buf.lkey.len() != devs.len()
    {
        return Err(format!(
            "the peer's descriptor is not an RDMA one: {}",
            String::from_utf8_lossy(&desc.encode())
        ));
    }
    println!(
        "rdma_engines: {} -> {}: protocol rdma, devices {devs:?}, rkeys {:?}, priority_matrix {}",
        a.segment_name(),
        b.segment_name(),
        buf.rkey,
        serde_json::Value::Object(desc.priority_matrix.clone())
    );
    handshake_as_mooncake_does(&b, &desc.devices[0].gid)?;
    passive_bound_refuses(&b, &desc.devices[0].gid)?;
    failed_batch_leaves_no_mr(&b)?;
    let via = a.segment_transport(peer).map_err(|e| e.to_string())?;
    if via.name != "rdma" {
        return Err(format!("requests to the peer go by {}, not rdma", via.name));
    }

    let (la, lb) = (ba.addr(), bb.addr());
    let one = |op: Opcode, len: usize, off: u64| TransferRequest {
        opcode: op,
        source: la + off,
        target_id: peer,
        target_offset: lb + off,
        length: len as u64,
    };
    for size in [4usize << 10, 64 << 10, 1 << 20, 16 << 20] {
        fill(&mut ba.bytes()[..size], size as u64);
        bb.bytes()[..size].fill(0);
        let t = Instant::now();
        let st = a
            .transfer_sync(&[one(Opcode::Write, size, 0)], Duration::from_secs(60))
            .map_err(|e| e.to_string())?;
        let took = t.elapsed();
        if st.status != TaskStatus::Completed || st.transferred_bytes != size as u64 {
            return Err(format!("WRITE {size} B: {st:?}"));
        }
        compare(
            &format!("WRITE {size} B"),
            &bb.bytes()[..size],
            &ba.bytes()[..size],
        )?;
        println!(
            "rdma_engines: WRITE {size} B verified ({:.1} ms)",
            took.as_secs_f64() * 1e3
        );

        fill(&mut bb.bytes()[..size], !(size as u64));
        ba.bytes()[..size].fill(0);
        let t = Instant::now();
        let st = a
            .transfer_sync(&[one(Opcode::Read, size, 0)], Duration::from_secs(60))
            .map_err(|e| e.to_string())?;
        let took = t.elapsed();
        if st.status != TaskStatus::Completed || st.transferred_bytes != size as u64 {
            return Err(format!("READ {size} B: {st:?}"));
        }
        compare(
            &format!("READ {size} B"),
            &ba.bytes()[..size],
            &bb.bytes()[..size],
        )?;
        println!(
            "rdma_engines: READ {size} B verified ({:.1} ms)",
            took.as_secs_f64() * 1e3
        );
    }

    // One batch of 64 requests of 64 KiB at different offsets.
    fill(&mut ba.bytes()[..4 << 20], 77);
    bb.bytes()[..4 << 20].fill(0);
    let reqs: Vec<TransferRequest> = (0..64u64)
        .map(|i| one(Opcode::Write, 64 << 10, i * (64 << 10)))
        .collect();
    let st = a
        .transfer_sync(&reqs, Duration::from_secs(60))
        .map_err(|e| e.to_string())?;
    if st.status != TaskStatus::Completed {
        return Err(format!("batch of 64 WRITEs: {st:?}"));
    }
    compare(
        "batch of 64 WRITEs",
        &bb.bytes()[..4 << 20],
        &ba.bytes()[..4 << 20],
    )?;
    println!("rdma_engines: a batch of 64 WRITEs of 64 KiB verified");

    // Many batches at once: 4 threads, each with its own 1 MiB of both buffers, 8 rounds of a
    // batch of 16 WRITEs of 64 KiB then 16 READs back, every byte compared each round.
    {
        let (sa, sb) = (&mut ba.bytes()[..4 << 20], &mut bb.bytes()[..4 << 20]);
        let a = &a;
        std::thread::scope(|s| -> Res<()> {
            let threads: Vec<_> = sa
                .chunks_mut(1 << 20)
                .zip(sb.chunks_mut(1 << 20))
                .enumerate()
                .map(|(t, (ca, cb))| {
                    s.spawn(move || -> Res<()> {
                        let (pa, pb) = (ca.as_ptr() as u64, cb.as_ptr() as u64);
                        let batch = |op: Opcode| -> Vec<TransferRequest> {
                            (0..16u64)
                                .map(|i| TransferRequest {
                                    opcode: op,
                                    source: pa + i * (64 << 10),
                                    target_id: peer,
                                    target_offset: pb + i * (64 << 10),
                                    length: 64 << 10,
                                })
                                .collect()
                        };
                        for round in 0..8u64 {
                            fill(ca, 1000 * t as u64 + round);
                            cb.fill(0);
                            let st = a
                                .transfer_sync(&batch(Opcode::Write), Duration::from_secs(60))
                                .map_err(|e| e.to_string())?;
                            if st.status != TaskStatus::Completed {
                                return Err(format!(
                                    "thread {t} round {round}: batch of 16 WRITEs {st:?}"
                                ));
                            }
                            compare(&format!("thread {t} round {round} WRITE"), cb, ca)?;
                            let want = ca.to_vec();
                            ca.fill(0);
                            let st = a
                                .transfer_sync(&batch(Opcode::Read), Duration::from_secs(60))
                                .map_err(|e| e.to_string())?;
                            if st.status != TaskStatus::Completed {
                                return Err(format!(
                                    "thread {t} round {round}: batch of 16 READs {st:?}"
                                ));
                            }
                            compare(&format!("thread {t} round {round} READ"), ca, &want)?;
                        }
                        Ok(())
                    })
                })
                .collect();
            for h in threads {
                h.join()
                    .map_err(|_| "a batch thread panicked".to_string())??;
            }
            Ok(())
        })?;
        println!("rdma_engines: 4 threads x 8 rounds of concurrent batches (16 WRITEs + 16 READs of 64 KiB) verified");
    }

    // A peer with rxe0 only: the pair from our rxe_lo to it cannot be connected (its RTR
    // towards a 127.0.0.1 GID fails), so that pair is paused and all slices go over rxe0.
    {
        let mut bd = Buf::new(1 << 20)?;
        let d = TransferEngine::new(Config {
            rdma_devices: Some(vec!["rxe0".into()]),
            ..cfg.clone()
        })
        .map_err(|e| e.to_string())?;
        d.register_memory(bd.addr(), 1 << 20, "cpu:0")
            .map_err(|e| e.to_string())?;
        let pd = a
            .open_segment(d.segment_name())
            .map_err(|e| e.to_string())?;
        let mut took = Vec::new();
        for seed in [55, 56] {
            fill(&mut ba.bytes()[..1 << 20], seed);
            let t = Instant::now();
            let req = TransferRequest {
                opcode: Opcode::Write,
                source: la,
                target_id: pd,
                target_offset: bd.addr(),
                length: 1 << 20,
            };
            let st = a
                .transfer_sync(&[req], Duration::from_secs(30))
                .map_err(|e| e.to_string())?;
            took.push(t.elapsed().as_secs_f64() * 1e3);
            if st.status != TaskStatus::Completed {
                return Err(format!("a WRITE to a peer with rxe0 only: {st:?}"));
            }
            compare(
                "a WRITE to a peer with rxe0 only",
                bd.bytes(),
                &ba.bytes()[..1 << 20],
            )?;
        }
        println!("rdma_engines: a peer with rxe0 only: 1 MiB WRITEs verified over the pairs that connect ({:.1} ms, then {:.1} ms)", took[0], took[1]);
        d.unregister_memory(bd.addr()).map_err(|e| e.to_string())?;
    }

    // With a cluster key: two keyed engines connect their QPs through the proved handshake
    // and move bytes over RDMA; a `Connection` message without the key, and an engine without
    // it, are refused, saying why (a QP is connected only in answer to a handshake, so this is
    // what keeps a peer without the key from RDMA access).
    {
        use kvferry::testing::wire::handshake::MsgType;
        let key = std::env::temp_dir().join(format!("kvferry-rdma-key-{}", std::process::id()));
        std::fs::write(&key, "r".repeat(64)).map_err(|e| e.to_string())?;
        std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .map_err(|e| e.to_string())?;
        let kcfg = Config {
            auth_key_file: Some(key.clone()),
            ..cfg.clone()
        };
        let ka = TransferEngine::new(kcfg.clone()).map_err(|e| e.to_string())?;
        let kb = TransferEngine::new(kcfg).map_err(|e| e.to_string())?;
        let _ = std::fs::remove_file(&key);
        let (mut xa, mut xb) = (Buf::new(1 << 20)?, Buf::new(1 << 20)?);
        ka.register_memory(xa.addr(), 1 << 20, "cpu:0")
            .map_err(|e| e.to_string())?;
        kb.register_memory(xb.addr(), 1 << 20, "cpu:0")
            .map_err(|e| e.to_string())?;
        let pk = ka
            .open_segment(kb.segment_name())
            .map_err(|e| e.to_string())?;
        let via = ka.segment_transport(pk).map_err(|e| e.to_string())?;
        if via.name != "rdma" {
            return Err(format!(
                "keyed engines: requests go by {}, not rdma",
                via.name
            ));
        }
        fill(xa.bytes(), 4242);
        let req = TransferRequest {
            opcode: Opcode::Write,
            source: xa.addr(),
            target_id: pk,
            target_offset: xb.addr(),
            length: 1 << 20,
        };
        let st = ka
            .transfer_sync(&[req], Duration::from_secs(30))
            .map_err(|e| e.to_string())?;
        if st.status != TaskStatus::Completed {
            return Err(format!("keyed engines: a 1 MiB WRITE over RDMA: {st:?}"));
        }
        compare(
            "keyed engines: a 1 MiB WRITE over RDMA",
            xb.bytes(),
            xa.bytes(),
        )?;
        let host = kb
            .segment_name()
            .rsplit_once(':')
            .map_or("127.0.0.1", |(h, _)| h)
            .to_string();
        let conn = kvferry::testing::wire::rdma::ConnectionMsg {
            local_nic_path: "10.99.2.1:1@rxe0".into(),
            local_gid: desc.devices[0].gid.clone(),
            peer_nic_path: format!("{}@rxe0", kb.segment_name()),
            qp_num: vec![0x321],
            ..Default::default()
        };
        let why = match kvferry::handshake::request(
            &host,
            kb.rpc_port(),
            MsgType::Connection,
            &conn.encode(),
            Duration::from_secs(5),
            Duration::from_secs(10),
            1 << 20,
            None,
        ) {
            Err(e @ kvferry::Error::Unauthorized { .. }) => e.to_string(),
            other => {
                return Err(format!(
                    "keyed engines: a Connection without the key was answered {other:?}"
                ))
            }
        };
        match a.open_segment(kb.segment_name()) {
            Err(kvferry::Error::Unauthorized { .. }) => {}
            other => {
                return Err(format!(
                    "keyed engines: an engine without the key opened the segment: {other:?}"
                ))
            }
        }
        println!("rdma_engines: with a cluster key: a 1 MiB WRITE over RDMA between keyed engines verified; a Connection without the key refused ({why}); an engine without it cannot open the segment");
    }

    // Outside the peer's registered memory: FAILED, nothing sent.
    let bad = TransferRequest {
        opcode: Opcode::Write,
        source: ba.addr(),
        target_id: peer,
        target_offset: bb.addr() + SIZE as u64,
        length: 4096,
    };
    let st = a
        .transfer_sync(&[bad], Duration::from_secs(20))
        .map_err(|e| e.to_string())?;
    if st.status != TaskStatus::Failed {
        return Err(format!("a WRITE outside the peer's memory: {st:?}"));
    }
    println!(
        "rdma_engines: a WRITE outside the peer's memory failed as it must ({:?}: {})",
        st.cause,
        st.reason.unwrap_or_default()
    );

    // Unregistering local memory is a barrier: with a 16 MiB READ into it in flight, it returns
    // only once no work request touches the range any more; the task is terminal by then.
    let batch = a.allocate_batch(1).map_err(|e| e.to_string())?;
    batch
        .submit(&[one(Opcode::Read, SIZE, 0)])
        .map_err(|e| e.to_string())?;
    // Long enough for the posting thread to have posted (a 16 MiB READ takes ~0.5 s here).
    std::thread::sleep(Duration::from_millis(100));
    let pending = batch.status().status;
    let t = Instant::now();
    a.unregister_memory(la).map_err(|e| e.to_string())?;
    let st = batch.status();
    if !st.status.is_terminal() {
        return Err(format!(
            "unregister_memory returned with a READ into the range still {:?}",
            st.status
        ));
    }
    println!("rdma_engines: unregister during a 16 MiB READ ({pending:?} when called) returned after {:.1} ms with the task {:?}", t.elapsed().as_secs_f64() * 1e3, st.status);
    drop(batch);
    a.register_memory(la, SIZE as u64, "cpu:0")
        .map_err(|e| e.to_string())?;

    // The peer unregisters its buffer: a WRITE to it fails (its descriptor re-read, or its MR
    // gone: a remote access error), within the deadline.
    b.unregister_memory(bb.addr()).map_err(|e| e.to_string())?;
    let t = Instant::now();
    let st = a
        .transfer_sync(&[one(Opcode::Write, 4096, 0)], Duration::from_secs(20))
        .map_err(|e| e.to_string())?;
    if st.status == TaskStatus::Completed {
        return Err("a WRITE to memory the peer unregistered completed".into());
    }
    println!(
        "rdma_engines: a WRITE to memory the peer unregistered ended {:?} in {:.1} ms ({:?}: {})",
        st.status,
        t.elapsed().as_secs_f64() * 1e3,
        st.cause,
        st.reason.unwrap_or_default()
    );

    // The failed QP was dropped and the refused keys marked stale: the peer registers the
    // same range again (new keys), and the next request re-reads its descriptor, builds a new
    // QP (a new Connection exchange) and lands.
    b.register_memory(lb, SIZE as u64, "cpu:0")
        .map_err(|e| e.to_string())?;
    fill(&mut ba.bytes()[..1 << 20], 99);
    bb.bytes()[..1 << 20].fill(0);
    let st = a
        .transfer_sync(&[one(Opcode::Write, 1 << 20, 0)], Duration::from_secs(20))
        .map_err(|e| e.to_string())?;
    if st.status != TaskStatus::Completed {
        return Err(format!(
            "a WRITE after the peer registered the range again: {st:?}"
        ));
    }
    compare(
        "a WRITE after the peer registered the range again",
        &bb.bytes()[..1 << 20],
        &ba.bytes()[..1 << 20],
    )?;
    println!("rdma_engines: after the failure the endpoint was rebuilt and the new keys read: a 1 MiB WRITE to the range the peer registered again verified");
    b.unregister_memory(lb).map_err(|e| e.to_string())?;

    // A peer that goes away after its QPs were connected: a request to it ends (FAILED, or
    // TIMEOUT when the NIC never reports the loss: its QP is flushed at the deadline) within
    // the deadline, and the engine does not hang.
    let bc = Buf::new(1 << 20)?;
    let cfg2 = cfg.clone();
    let c = TransferEngine::new(cfg).map_err(|e| e.to_string())?;
    c.register_memory(bc.addr(), 1 << 20, "cpu:0")
        .map_err(|e| e.to_string())?;
    let pc = a
        .open_segment(c.segment_name())
        .map_err(|e| e.to_string())?;
    let to_c = TransferRequest {
        opcode: Opcode::Write,
        source: la,
        target_id: pc,
        target_offset: bc.addr(),
        length: 1 << 20,
    };
    let st = a
        .transfer_sync(&[to_c], Duration::from_secs(20))
        .map_err(|e| e.to_string())?;
    if st.status != TaskStatus::Completed {
        return Err(format!("WRITE to a third engine: {st:?}"));
    }
    drop(c);
    let t = Instant::now();
    let st = a
        .transfer_sync(&[to_c], Duration::from_secs(3))
        .map_err(|e| e.to_string())?;
    let took = t.elapsed();
    if st.status == TaskStatus::Completed || took > Duration::from_secs(6) {
        return Err(format!(
            "a WRITE to an engine that went away: {st:?} after {took:?}"
        ));
    }
    println!(
        "rdma_engines: a WRITE to an engine that went away ended {:?} in {:.1} s, deadline 3 s ({:?}: {})",
        st.status,
        took.as_secs_f64(),
        st.cause,
        st.reason.unwrap_or_default()
    );
    drop(bc);

    // Peers that come and go, each writing into `b`: the QPs `b` made for them are released
    // once they are gone (their handshake address refuses connections), never a live peer's.
    // `b` registers its buffer again; `a` writes into it first (its first WRITE may meet the
    // old keys, as above), so that `a`'s pairs in `b` exist before any look.
    b.register_memory(lb, SIZE as u64, "cpu:0")
        .map_err(|e| e.to_string())?;
    let mut warmed = false;
    for _ in 0..2 {
        warmed = a
            .transfer_sync(&[one(Opcode::Write, 4096, 0)], Duration::from_secs(10))
            .map_err(|e| e.to_string())?
            .status
            == TaskStatus::Completed;
        if warmed {
            break;
        }
    }
    if !warmed {
        return Err("a could not write into b's buffer registered again".into());
    }
    let b_before = b.rdma_usage().ok_or("b has no RDMA transport")?.passive;
    let mut peak = b_before;
    let bp = Buf::new(4096)?;
    let visit = |peak: &mut usize| -> Res<TransferEngine> {
        let p = TransferEngine::new(cfg2.clone()).map_err(|e| e.to_string())?;
        p.register_memory(bp.addr(), 4096, "cpu:0")
            .map_err(|e| e.to_string())?;
        let to_b = p
            .open_segment(b.segment_name())
            .map_err(|e| e.to_string())?;
        let w = TransferRequest {
            opcode: Opcode::Write,
            source: bp.addr(),
            target_id: to_b,
            target_offset: lb,
            length: 4096,
        };
        let st = p
            .transfer_sync(&[w], Duration::from_secs(10))
            .map_err(|e| e.to_string())?;
        if st.status != TaskStatus::Completed {
            return Err(format!("a passing peer's WRITE: {st:?}"));
        }
        *peak = (*peak).max(b.rdma_usage().map_or(0, |u| u.passive));
        Ok(p)
    };
    const PEERS: usize = 40;
    for _ in 0..PEERS - 1 {
        drop(visit(&mut peak)?);
    }
    let last = visit(&mut peak)?;
    // Departed peers' pairs are released whenever 16 are held (a look at most every 2 s): what
    // stays is under that mark plus the live peers' pairs (`last`: at most 2 of its NICs x 2
    // of ours). Without the looks `b` would hold at least b_before + 40.
    let limit = kvferry::testing::rdma::PASSIVE_SWEEP_AT + 4;
    let t = Instant::now();
    let mut held = b.rdma_usage().map_or(0, |u| u.passive);
    while held > limit && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(100));
        held = b.rdma_usage().map_or(0, |u| u.passive);
    }
    if held > limit {
        return Err(format!("passive pairs of departed peers: {b_before} before, peak {peak}, {held} held 10 s after the last look (at most {limit} expected)"));
    }
    // `a` kept its pairs (made before the looks, its address answers): its WRITE into `b`
    // goes through at the first try.
    fill(&mut ba.bytes()[..1 << 20], 77);
    let st = a
        .transfer_sync(&[one(Opcode::Write, 1 << 20, 0)], Duration::from_secs(10))
        .map_err(|e| e.to_string())?;
    if st.status != TaskStatus::Completed {
        return Err(format!("the live peer's WRITE after the sweep: {st:?}"));
    }
    compare(
        "the live peer's WRITE after the sweep",
        &bb.bytes()[..1 << 20],
        &ba.bytes()[..1 << 20],
    )?;
    drop(last);
    b.unregister_memory(lb).map_err(|e| e.to_string())?;
    println!("rdma_engines: {PEERS} peers came and went: b held up to {peak} passive pairs, {held} once the departed were found gone ({b_before} before); the live peer's WRITE verified");

    a.unregister_memory(ba.addr()).map_err(|e| e.to_string())?;
    drop(a);
    drop(b);
    println!("rdma_engines: both engines dropped");
    Ok(())
}
