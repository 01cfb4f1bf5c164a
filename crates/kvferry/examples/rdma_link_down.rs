//! One NIC's link taken down under load (in the Soft-RoCE VM, as root: `rdma_link_down
//! 10.99.2.1`; run it last, it leaves `va` down): two engines with `KVFERRY_TRANSPORT=rdma`
//! stripe 16 MiB WRITEs and READs over rxe0 and rxe_lo; 100 ms into the fourth round `ip link
//! set va down` takes rxe0's port DOWN (a pulled cable) with slices in flight on it. Every
//! transfer must
//! end by its deadline (none hangs), every round must complete with every byte verified, and
//! rxe0 must carry nothing after the cut (its packet counter stays still) while rxe_lo carries
//! it all. (Deleting the device instead, `rdma link delete`, cannot be shown on Soft-RoCE: the
//! kernel waits for every process holding an rxe device to close it.)
//! Exits non-zero on any failure.

use kvferry::config::TransportMode;
use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest};
use std::process::ExitCode;
use std::time::{Duration, Instant};

mod common;
use common::*;

const SIZE: usize = 16 << 20;
const DEADLINE: Duration = Duration::from_secs(15);

fn main() -> ExitCode {
    let host = std::env::args().nth(1).unwrap_or_else(|| "10.99.2.1".into());
    finish("rdma_link_down", "all checks passed", run(&host))
}

fn run(host: &str) -> Result<(), String> {
    let cfg = Config { local_hostname: host.into(), transport: TransportMode::Rdma, transfer_timeout: DEADLINE, ..Config::default() };
    let a = TransferEngine::new(cfg.clone()).map_err(|e| e.to_string())?;
    let b = TransferEngine::new(cfg).map_err(|e| e.to_string())?;
    let src = kvferry::hostbuf::HostBuffer::new(SIZE, false).map_err(|e| e.to_string())?;
    let dst = kvferry::hostbuf::HostBuffer::new(SIZE, false).map_err(|e| e.to_string())?;
    let back = kvferry::hostbuf::HostBuffer::new(SIZE, false).map_err(|e| e.to_string())?;
    a.register_memory(src.addr(), SIZE as u64, "cpu:0").map_err(|e| e.to_string())?;
    a.register_memory(back.addr(), SIZE as u64, "cpu:0").map_err(|e| e.to_string())?;
    b.register_memory(dst.addr(), SIZE as u64, "cpu:0").map_err(|e| e.to_string())?;
    let peer = a.open_segment(b.segment_name()).map_err(|e| e.to_string())?;
    let (lo0, r0) = (sent("rxe_lo"), sent("rxe0"));
    let mut cut = None;
    for round in 0..10u32 {
        let mut cutter = None;
        if round == 3 {
            let (r, lo) = (sent("rxe0"), sent("rxe_lo"));
            if r == r0 || lo == lo0 {
                return Err(format!("rounds 0-2 were not striped over both NICs (rxe0 sent {} packets, rxe_lo {})", r - r0, lo - lo0));
            }
            println!("rdma_link_down: rounds 0-2 striped (rxe0 sent {} packets, rxe_lo {}); taking va (rxe0) down 100 ms into round 3", r - r0, lo - lo0);
            // Mid-transfer: slices are in flight on rxe0 when its port goes down.
            cutter = Some(std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(100));
                let st = std::process::Command::new("ip").args(["link", "set", "va", "down"]).status();
                let state = std::fs::read_to_string("/sys/class/infiniband/rxe0/ports/1/state").unwrap_or_default();
                (st.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string()), state.trim().to_string(), sent("rxe0"), sent("rxe_lo"))
            }));
        }
        for (i, b) in src.slice_mut(0, SIZE).iter_mut().enumerate() {
            *b = (i as u8).wrapping_add(round as u8).wrapping_mul(7) ^ (i >> 13) as u8;
        }
        let t = Instant::now();
        let w = TransferRequest { opcode: Opcode::Write, source: src.addr(), target_id: peer, target_offset: dst.addr(), length: SIZE as u64 };
        let r = TransferRequest { opcode: Opcode::Read, source: back.addr(), target_id: peer, target_offset: dst.addr(), length: SIZE as u64 };
        let sw = a.transfer_sync(&[w], DEADLINE).map_err(|e| e.to_string())?;
        let sr = a.transfer_sync(&[r], DEADLINE).map_err(|e| e.to_string())?;
        let took = t.elapsed();
        if let Some(c) = cutter {
            let (st, state, r, lo) = c.join().map_err(|_| "the cutting thread panicked")?;
            println!("rdma_link_down: ip link set va down ({st}): rxe0 port {state}");
            cut = Some((r, lo));
        }
        if took > 2 * DEADLINE + Duration::from_secs(5) {
            return Err(format!("round {round} took {took:?}: a transfer outlived its deadline"));
        }
        if sw.status != TaskStatus::Completed || sr.status != TaskStatus::Completed || back.slice(0, SIZE) != src.slice(0, SIZE) {
            return Err(format!("round {round}: WRITE {:?} ({:?}), READ {:?} ({:?}), or the bytes read back differ", sw.status, sw.reason, sr.status, sr.reason));
        }
        println!("rdma_link_down: round {round}: WRITE and READ of 16 MiB verified in {:.1} s", took.as_secs_f64());
    }
    let (r, lo) = cut.ok_or("no cut")?;
    let (r_after, lo_after) = (sent("rxe0") - r, sent("rxe_lo") - lo);
    if r_after != 0 || lo_after == 0 {
        return Err(format!("after the cut rxe0 sent {r_after} packets and rxe_lo {lo_after}: the traffic did not move to rxe_lo"));
    }
    println!("rdma_link_down: rxe0's link down under load: the round it cut and 6 more completed over rxe_lo ({lo_after} packets after it, rxe0 none), none hung");
    Ok(())
}
