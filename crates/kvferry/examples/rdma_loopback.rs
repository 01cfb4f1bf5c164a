//! RDMA WRITE and READ through real verbs between two RC queue pairs of this process on one
//! device (`rxe0` in the Soft-RoCE VM), every byte verified; then the error cases. Exits
//! non-zero on any failure. Used by `scripts/test` in the VM:
//! `rdma_loopback [device] [max_bytes]` (defaults: rxe0, 16 MiB).
//!
//! The queue pairs are connected as two engines would connect them: each side's `Connection`
//! message (NIC path, LID, GID, QP numbers) is encoded and decoded with `wire::rdma`, and the
//! path MTU is the smaller of both ports' active MTU. Transfers are cut into 64 KiB slices
//! with up to 32 work requests outstanding, posted in chains of 8.

use kvferry::testing::rdma::sysfs;
use kvferry::testing::rdma::verbs::{
    self, Context, Cq, Mr, Op, Path, PortAttr, Qp, RemoteQp, Verbs, VerbsError, Wc, Wr,
};
use kvferry::testing::wire::rdma::{format_gid, parse_gid, ConnectionMsg};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

const SLICE: usize = 64 << 10;
const DEPTH: usize = 32;
const CHAIN: usize = 8;
const PORT: u8 = 1;

mod common;
use common::*;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let dev = args.get(1).cloned().unwrap_or_else(|| "rxe0".into());
    let max: usize = match args.get(2).map(|s| s.parse()) {
        None => 16 << 20,
        Some(Ok(n)) if n >= 4096 => n,
        Some(_) => {
            eprintln!("usage: rdma_loopback [device] [max_bytes >= 4096]");
            return ExitCode::from(2);
        }
    };
    finish(
        "rdma_loopback",
        &format!("all checks passed on {dev}"),
        run(&dev, max),
    )
}

/// What a side of the connection knows about its own NIC.
struct Local {
    ctx: Context,
    port: PortAttr,
    gid_index: u8,
    gid: [u8; 16],
}

fn open(dev: &str) -> Res<Local> {
    let verbs = Arc::new(Verbs::load().map_err(|e| e.to_string())?);
    let ctx = Context::open(verbs, dev).map_err(|e| e.to_string())?;
    let port = ctx.query_port(PORT).map_err(|e| e.to_string())?;
    if !port.active() {
        return Err(format!(
            "{dev} port {PORT} is not ACTIVE (state {})",
            port.state
        ));
    }
    let nic = sysfs::nics()
        .into_iter()
        .find(|n| n.name == dev)
        .ok_or_else(|| format!("{dev} is not in {}", sysfs::ROOT))?;
    let p = nic
        .ports
        .iter()
        .find(|p| p.num == u32::from(PORT))
        .ok_or_else(|| format!("{dev} has no port {PORT} in sysfs"))?;
    let forced = std::env::var("MC_GID_INDEX")
        .ok()
        .and_then(|s| s.parse().ok());
    let idx = sysfs::select_gid(p, forced)
        .ok_or_else(|| format!("{dev} port {PORT}: no usable GID (MC_GID_INDEX={forced:?})"))?;
    let gid_index = u8::try_from(idx).map_err(|_| format!("GID index {idx} is over 255"))?;
    let gid = ctx.query_gid(PORT, gid_index).map_err(|e| e.to_string())?;
    Ok(Local {
        ctx,
        port,
        gid_index,
        gid,
    })
}

/// The `Connection` message a side sends for `qp` (what Mooncake's endpoint sends).
fn hello(l: &Local, me: &str, peer: &str, qp: &Qp) -> Vec<u8> {
    let dev = l.ctx.name();
    ConnectionMsg {
        local_nic_path: format!("{me}@{dev}"),
        local_lid: l.port.lid,
        local_gid: format_gid(&l.gid),
        peer_nic_path: format!("{peer}@{dev}"),
        qp_num: vec![qp.qp_num()],
        ..Default::default()
    }
    .encode()
}

/// Connects `qp` to the QP a received `Connection` message describes.
fn accept(l: &Local, qp: &Qp, wire: &[u8], peer_mtu: u32) -> Res<()> {
    let m = ConnectionMsg::decode(wire).map_err(|e| e.to_string())?;
    let gid = parse_gid(&m.local_gid).ok_or("no GID in the peer's message")?;
    let remote = RemoteQp {
        qp_num: m.qp_num[0],
        lid: m.local_lid,
        gid,
    };
    let path = Path {
        port: PORT,
        sgid_index: l.gid_index,
        mtu: l.port.active_mtu.min(peer_mtu),
        retry_cnt: kvferry::testing::rdma::verbs::RETRY_CNT,
    };
    qp.connect(path, &remote).map_err(|e| e.to_string())
}

/// Two connected RC QPs on `l`'s device, through an exchange of `Connection` messages.
fn pair(l: &Local, pd: &verbs::Pd, cq: &Cq) -> Res<(Qp, Qp)> {
    let qa = pd.create_qp(cq, DEPTH as u32).map_err(|e| e.to_string())?;
    let qb = pd.create_qp(cq, DEPTH as u32).map_err(|e| e.to_string())?;
    let (to_b, to_a) = (
        hello(l, "loopback-a", "loopback-b", &qa),
        hello(l, "loopback-b", "loopback-a", &qb),
    );
    accept(l, &qb, &to_b, l.port.active_mtu)?;
    accept(l, &qa, &to_a, l.port.active_mtu)?;
    Ok((qa, qb))
}

/// Moves `size` bytes between `local` (from offset 0) and the peer's `[raddr, raddr+size)` in
/// 64 KiB slices, up to [`DEPTH`] outstanding; returns when every slice's completion arrived.
#[allow(clippy::too_many_arguments)]
fn transfer(
    qp: &Qp,
    cq: &Cq,
    op: Op,
    local: &Mr,
    raddr: u64,
    rkey: u32,
    size: usize,
    deadline: Instant,
) -> Result<(), VerbsError> {
    let slices = size.div_ceil(SLICE);
    let (mut next, mut done, mut outstanding) = (0usize, 0usize, 0usize);
    let mut wcs = [Wc::default(); 32];
    let result = 'run: loop {
        while next < slices && outstanding < DEPTH {
            let n = (slices - next).min(DEPTH - outstanding).min(CHAIN);
            let chain: Vec<Wr<'_>> = (next..next + n)
                .map(|i| {
                    let off = i * SLICE;
                    Wr {
                        wr_id: i as u64,
                        op,
                        local,
                        offset: off,
                        len: (size - off).min(SLICE) as u32,
                        remote_addr: raddr + off as u64,
                        rkey,
                        signaled: true,
                    }
                })
                .collect();
            if let Err(e) = qp.post(&chain) {
                if let VerbsError::Post { posted, .. } = &e {
                    outstanding += posted;
                }
                break 'run Err(e);
            }
            next += n;
            outstanding += n;
        }
        if done == slices {
            break Ok(());
        }
        let got = match cq.wait(&mut wcs, deadline) {
            Ok(n) => n,
            Err(e) => break Err(e),
        };
        let mut failed = None;
        for wc in &wcs[..got] {
            outstanding -= 1;
            done += 1;
            if let Err(e) = wc.result(qp.device()) {
                failed.get_or_insert(e);
            }
        }
        if let Some(e) = failed {
            break Err(e.into());
        }
    };
    // Never leave with requests in flight: a failed QP flushes the rest (IBV_WC_WR_FLUSH_ERR).
    while outstanding > 0 {
        match cq.wait(&mut wcs[..outstanding.min(32)], deadline) {
            Ok(n) => outstanding -= n,
            Err(_) => break,
        }
    }
    result
}

fn mbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64().max(1e-9) / 1e6
}

fn run(dev: &str, max: usize) -> Res<()> {
    let l = open(dev)?;
    println!(
        "rdma_loopback: {dev} port {PORT} active, MTU {}, GID index {} ({}), LID {}",
        l.port.mtu_bytes(),
        l.gid_index,
        format_gid(&l.gid),
        l.port.lid
    );
    let pd = l.ctx.alloc_pd().map_err(|e| e.to_string())?;
    let cq = l.ctx.create_cq(256).map_err(|e| e.to_string())?;
    let (qa, qb) = pair(&l, &pd, &cq)?;
    println!(
        "rdma_loopback: QP {} <-> QP {} connected (Connection messages exchanged)",
        qa.qp_num(),
        qb.qp_num()
    );

    // One extra byte past `max` on the target holds a sentinel that must never change.
    let (mut a, mut b) = (Buf::new(max)?, Buf::new(max + 4096)?);
    // SAFETY: `a` and `b` outlive their MRs (dropped at the end of this function after them,
    // or deregistered explicitly below) and are only touched through `bytes()` between
    // transfers, when no work request is outstanding.
    let (mra, mrb) = unsafe {
        (
            pd.reg_mr(a.addr() as *mut u8, a.len())
                .map_err(|e| e.to_string())?,
            pd.reg_mr(b.addr() as *mut u8, b.len())
                .map_err(|e| e.to_string())?,
        )
    };
    println!(
        "rdma_loopback: registered {} + {} bytes (lkey/rkey {:#x}/{:#x}, {:#x}/{:#x})",
        a.len(),
        b.len(),
        mra.lkey(),
        mra.rkey(),
        mrb.lkey(),
        mrb.rkey()
    );

    for size in [4usize << 10, 64 << 10, 1 << 20, 16 << 20]
        .into_iter()
        .filter(|&s| s <= max)
    {
        let deadline = Instant::now() + Duration::from_secs(60);
        fill(&mut a.bytes()[..size], size as u64);
        b.bytes()[..size + 1].fill(0);
        b.bytes()[size] = 0xA5;
        let t = Instant::now();
        transfer(
            &qa,
            &cq,
            Op::Write,
            &mra,
            mrb.addr() as u64,
            mrb.rkey(),
            size,
            deadline,
        )
        .map_err(|e| format!("WRITE {size} B: {e}"))?;
        let took = t.elapsed();
        compare(
            &format!("WRITE {size} B"),
            &b.bytes()[..size],
            &a.bytes()[..size],
        )?;
        if b.bytes()[size] != 0xA5 {
            return Err(format!("WRITE {size} B wrote past its end"));
        }
        println!(
            "rdma_loopback: WRITE {size} B verified ({} slices, {:.1} ms, {:.0} MB/s)",
            size.div_ceil(SLICE),
            took.as_secs_f64() * 1e3,
            mbps(size, took)
        );

        fill(&mut b.bytes()[..size], !(size as u64));
        a.bytes()[..size].fill(0);
        let t = Instant::now();
        transfer(
            &qa,
            &cq,
            Op::Read,
            &mra,
            mrb.addr() as u64,
            mrb.rkey(),
            size,
            deadline,
        )
        .map_err(|e| format!("READ {size} B: {e}"))?;
        let took = t.elapsed();
        compare(
            &format!("READ {size} B"),
            &a.bytes()[..size],
            &b.bytes()[..size],
        )?;
        println!(
            "rdma_loopback: READ {size} B verified ({} slices, {:.1} ms, {:.0} MB/s)",
            size.div_ceil(SLICE),
            took.as_secs_f64() * 1e3,
            mbps(size, took)
        );
    }

    // A local range outside its MR is refused before anything is posted.
    let wr = Wr {
        wr_id: 0,
        op: Op::Write,
        local: &mra,
        offset: mra.len() - 10,
        len: 4096,
        remote_addr: mrb.addr() as u64,
        rkey: mrb.rkey(),
        signaled: true,
    };
    match qa.post(&[wr]) {
        Err(VerbsError::Invalid { what, .. }) => {
            println!("rdma_loopback: local range outside its MR refused before posting ({what})")
        }
        other => {
            return Err(format!(
                "a local range outside its MR was not refused: {:?}",
                other.err().map(|e| e.to_string())
            ))
        }
    }

    // Deregistering with nothing posted works, and reports success.
    let mut c = Buf::new(1 << 20)?;
    // SAFETY: `c` outlives the MR, deregistered at once.
    let mrc = unsafe { pd.reg_mr(c.addr() as *mut u8, c.len()) }.map_err(|e| e.to_string())?;
    mrc.dereg()
        .map_err(|e| format!("dereg of an idle MR: {e}"))?;
    c.bytes()[0] = 1;
    println!("rdma_loopback: dereg of an MR with nothing posted ok");

    // Error cases, each on a fresh pair (a failed request puts its QP in the error state).
    let bad_cases: [(&str, Op, u64, u32); 2] = [
        (
            "WRITE with a wrong rkey",
            Op::Write,
            mrb.addr() as u64,
            mrb.rkey() ^ 0x5a5a_0000,
        ),
        (
            "READ past the end of the remote MR",
            Op::Read,
            (mrb.addr() + mrb.len()) as u64,
            mrb.rkey(),
        ),
    ];
    for (what, op, raddr, rkey) in bad_cases {
        let (qc, _qd) = pair(&l, &pd, &cq)?;
        let t = Instant::now();
        match transfer(
            &qc,
            &cq,
            op,
            &mra,
            raddr,
            rkey,
            4096,
            Instant::now() + Duration::from_secs(20),
        ) {
            Err(VerbsError::Completion(e)) => println!(
                "rdma_loopback: {what} failed as it must: {} in {:.1} ms ({e})",
                e.name,
                t.elapsed().as_secs_f64() * 1e3
            ),
            Err(e) => return Err(format!("{what}: not a named completion error: {e}")),
            Ok(()) => return Err(format!("{what} succeeded")),
        }
    }
    // The peer's QP is gone: the request ends within its deadline, never hangs. Real NICs
    // report IBV_WC_RETRY_EXC_ERR after the retries (~0.5 s with timeout 14, retry_cnt 7);
    // Soft-RoCE on Debian's 6.1 kernel was seen not to report it within 30 s, so the deadline
    // ends the wait. Its own CQ: whatever the dying QP flushes stays out of the others' way.
    {
        let cq2 = l.ctx.create_cq(16).map_err(|e| e.to_string())?;
        let (qe, qf) = pair(&l, &pd, &cq2)?;
        drop(qf);
        let t = Instant::now();
        match transfer(
            &qe,
            &cq2,
            Op::Write,
            &mra,
            mrb.addr() as u64,
            mrb.rkey(),
            4096,
            Instant::now() + Duration::from_secs(5),
        ) {
            Err(VerbsError::Completion(e)) => println!(
                "rdma_loopback: WRITE to a destroyed QP failed: {} in {:.1} ms",
                e.name,
                t.elapsed().as_secs_f64() * 1e3
            ),
            Err(e @ VerbsError::Timeout { .. }) if t.elapsed() < Duration::from_secs(6) => {
                println!(
                    "rdma_loopback: WRITE to a destroyed QP ended at its deadline ({:.1} s): {e}",
                    t.elapsed().as_secs_f64()
                )
            }
            Err(e) => {
                return Err(format!(
                    "WRITE to a destroyed QP: {e} after {:?}",
                    t.elapsed()
                ))
            }
            Ok(()) => return Err("WRITE to a destroyed QP succeeded".into()),
        }
    }

    // The first pair still works after its siblings failed.
    fill(&mut a.bytes()[..4096], 42);
    transfer(
        &qa,
        &cq,
        Op::Write,
        &mra,
        mrb.addr() as u64,
        mrb.rkey(),
        4096,
        Instant::now() + Duration::from_secs(20),
    )
    .map_err(|e| format!("WRITE after the error cases: {e}"))?;
    compare(
        "WRITE after the error cases",
        &b.bytes()[..4096],
        &a.bytes()[..4096],
    )?;
    println!("rdma_loopback: first QP pair still transfers after the error cases");

    drop((qa, qb));
    mra.dereg().map_err(|e| e.to_string())?;
    mrb.dereg().map_err(|e| e.to_string())?;
    Ok(())
}
