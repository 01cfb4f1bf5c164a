//! One NIC's link taken down under load, then up again (in the Soft-RoCE VM, as root:
//! `rdma_link_down 10.99.2.1 [write|read] [ms]`): two engines with `KVFERRY_TRANSPORT=rdma`
//! stripe 16 MiB WRITEs and READs over rxe0 and rxe_lo; `ms` (100) into the fourth round's
//! WRITE (or READ) `ip link set va down` takes rxe0's port DOWN (a pulled cable) with slices in
//! flight on it. Every transfer must end by its deadline (none hangs), every round must
//! complete with every byte verified, and rxe0 must carry nothing after the cut (its packet
//! counter stays still) while rxe_lo carries it all; then `ip link set va up`, and the two
//! last rounds must use rxe0 again. (Deleting the device instead, `rdma link delete`, cannot be
//! shown on Soft-RoCE: the kernel waits for every process holding an rxe device to close it.)
//! Exits non-zero on any failure.

use kvferry::TransportMode;
use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest};
use std::process::ExitCode;
use std::time::{Duration, Instant};

mod common;
use common::*;

const SIZE: usize = 16 << 20;
const DEADLINE: Duration = Duration::from_secs(15);

fn main() -> ExitCode {
    log();
    let host = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "10.99.2.1".into());
    let cut_read = match std::env::args().nth(2).as_deref() {
        None | Some("write") => false,
        Some("read") => true,
        Some(other) => {
            eprintln!("rdma_link_down: the transfer to cut is write or read, not {other:?}");
            return ExitCode::from(2);
        }
    };
    let after = match std::env::args().nth(3).map(|a| a.parse::<u64>()) {
        None => Duration::from_millis(100),
        Some(Ok(ms)) => Duration::from_millis(ms),
        Some(Err(_)) => {
            eprintln!("rdma_link_down: the third argument is the cut's delay in milliseconds");
            return ExitCode::from(2);
        }
    };
    finish(
        "rdma_link_down",
        "all checks passed",
        run(&host, cut_read, after),
    )
}

/// Takes `va` (rxe0's netdev) down `after` it is called, on a thread: what it did, the port's
/// state after, and both NICs' packet counters then.
fn cut_after(after: Duration) -> std::thread::JoinHandle<(String, String, u64, u64)> {
    std::thread::spawn(move || {
        std::thread::sleep(after);
        let st = std::process::Command::new("ip")
            .args(["link", "set", "va", "down"])
            .status();
        let state =
            std::fs::read_to_string("/sys/class/infiniband/rxe0/ports/1/state").unwrap_or_default();
        (
            st.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string()),
            state.trim().to_string(),
            sent("rxe0"),
            sent("rxe_lo"),
        )
    })
}

fn run(host: &str, cut_read: bool, after: Duration) -> Result<(), String> {
    let cfg = Config {
        local_hostname: host.into(),
        transport: TransportMode::Rdma,
        transfer_timeout: DEADLINE,
        ..Config::default()
    };
    let a = TransferEngine::new(cfg.clone()).map_err(|e| e.to_string())?;
    let b = TransferEngine::new(cfg).map_err(|e| e.to_string())?;
    let src = kvferry::hostbuf::HostBuffer::new(SIZE, false).map_err(|e| e.to_string())?;
    let dst = kvferry::hostbuf::HostBuffer::new(SIZE, false).map_err(|e| e.to_string())?;
    let back = kvferry::hostbuf::HostBuffer::new(SIZE, false).map_err(|e| e.to_string())?;
    a.register_memory(src.addr(), SIZE as u64, "cpu:0")
        .map_err(|e| e.to_string())?;
    a.register_memory(back.addr(), SIZE as u64, "cpu:0")
        .map_err(|e| e.to_string())?;
    b.register_memory(dst.addr(), SIZE as u64, "cpu:0")
        .map_err(|e| e.to_string())?;
    let peer = a
        .open_segment(b.segment_name())
        .map_err(|e| e.to_string())?;
    let (lo0, r0) = (sent("rxe_lo"), sent("rxe0"));
    let mut cut = None;
    for round in 0..12u32 {
        if round == 10 {
            // Rounds 3-9 went over rxe_lo alone; the link comes back for the last two.
            let (r, lo) = cut.ok_or("no cut")?;
            let (r_after, lo_after) = (sent("rxe0") - r, sent("rxe_lo") - lo);
            if r_after != 0 || lo_after == 0 {
                return Err(format!("after the cut rxe0 sent {r_after} packets and rxe_lo {lo_after}: the traffic did not move to rxe_lo"));
            }
            println!("rdma_link_down: rxe0's link down under load: the round it cut and 6 more completed over rxe_lo ({lo_after} packets after it, rxe0 none), none hung");
            let st = std::process::Command::new("ip")
                .args(["link", "set", "va", "up"])
                .status()
                .map_err(|e| format!("ip link set va up: {e}"))?;
            let until = Instant::now() + Duration::from_secs(10);
            while !std::fs::read_to_string("/sys/class/infiniband/rxe0/ports/1/state")
                .unwrap_or_default()
                .contains("ACTIVE")
            {
                if Instant::now() > until {
                    return Err(format!("rxe0's port did not become ACTIVE within 10 s of `ip link set va up` ({st})"));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            // The engine reads its ports every 100 ms.
            std::thread::sleep(Duration::from_millis(300));
            cut = Some((sent("rxe0"), sent("rxe_lo")));
        }
        if round == 3 {
            let (r, lo) = (sent("rxe0"), sent("rxe_lo"));
            if r == r0 || lo == lo0 {
                return Err(format!(
                    "rounds 0-2 were not striped over both NICs (rxe0 sent {} packets, rxe_lo {})",
                    r - r0,
                    lo - lo0
                ));
            }
            let op = if cut_read { "READ" } else { "WRITE" };
            println!("rdma_link_down: rounds 0-2 striped (rxe0 sent {} packets, rxe_lo {}); taking va (rxe0) down {after:?} into round 3's {op}", r - r0, lo - lo0);
        }
        for (i, b) in src.slice_mut(0, SIZE).iter_mut().enumerate() {
            *b = (i as u8).wrapping_add(round as u8).wrapping_mul(7) ^ (i >> 13) as u8;
        }
        // Mid-transfer: slices are in flight on rxe0 when its port goes down (the thread starts
        // right before the transfer it cuts: under QEMU's emulation filling the buffer alone
        // can take longer than 100 ms).
        let mut cutter = None;
        let t = Instant::now();
        let w = TransferRequest {
            opcode: Opcode::Write,
            source: src.addr(),
            target_id: peer,
            target_offset: dst.addr(),
            length: SIZE as u64,
        };
        let r = TransferRequest {
            opcode: Opcode::Read,
            source: back.addr(),
            target_id: peer,
            target_offset: dst.addr(),
            length: SIZE as u64,
        };
        if round == 3 && !cut_read {
            cutter = Some(cut_after(after));
        }
        let sw = a.transfer_sync(&[w], DEADLINE).map_err(|e| e.to_string())?;
        if round == 3 && cut_read {
            cutter = Some(cut_after(after));
        }
        let sr = a.transfer_sync(&[r], DEADLINE).map_err(|e| e.to_string())?;
        let took = t.elapsed();
        if let Some(c) = cutter {
            let (st, state, r, lo) = c.join().map_err(|_| "the cutting thread panicked")?;
            println!("rdma_link_down: ip link set va down ({st}): rxe0 port {state}");
            cut = Some((r, lo));
        }
        if took > 2 * DEADLINE + Duration::from_secs(5) {
            return Err(format!(
                "round {round} took {took:?}: a transfer outlived its deadline"
            ));
        }
        if sw.status != TaskStatus::Completed
            || sr.status != TaskStatus::Completed
            || back.slice(0, SIZE) != src.slice(0, SIZE)
        {
            return Err(format!(
                "round {round}: WRITE {:?} ({:?}), READ {:?} ({:?}), or the bytes read back differ",
                sw.status, sw.reason, sr.status, sr.reason
            ));
        }
        println!(
            "rdma_link_down: round {round}: WRITE and READ of 16 MiB verified in {:.1} s",
            took.as_secs_f64()
        );
    }
    let (r, lo) = cut.ok_or("no cut")?;
    let (r_back, lo_back) = (sent("rxe0") - r, sent("rxe_lo") - lo);
    if r_back == 0 {
        return Err(format!("with its link back up rxe0 sent nothing in two rounds (rxe_lo {lo_back} packets): the engine did not use it again"));
    }
    println!("rdma_link_down: rxe0's link up again: two more rounds striped over both (rxe0 {r_back} packets, rxe_lo {lo_back})");
    Ok(())
}
