//! The CPU cost of posting one RDMA slice, measured through the engine (issue 12's
//! microbenchmark): two engines in this process with `KVFERRY_TRANSPORT=rdma`, 64 MiB
//! registered on each, batches of 16 WRITEs of 4 MiB (1024 slices of 64 KiB each), and the CPU
//! time of the engines' posting threads (`kvf-rdma-post`, read from
//! `/proc/self/task/<tid>/schedstat`) divided by the slices posted: cutting pieces into
//! slices, credits, the in-flight table, building the work-request chains and the provider's
//! `ibv_post_send` (its doorbell included). Completion handling (the poller threads) is
//! reported apart.
//!
//! `rdma_post_cost HOST` measures (in the Soft-RoCE VM: `KVFERRY_RDMA_DEVICES=rxe0`);
//! `rdma_post_cost calibrate` times a fixed CPU-bound loop, so that a run under emulation (the
//! VM's QEMU without KVM) can be scaled to the host's speed: run it on both and divide.

use kvferry::TransportMode;
use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest};
use std::time::{Duration, Instant};

const BUF: usize = 64 << 20;
const REQ: u64 = 4 << 20;
const SLICE: u64 = 64 << 10;
const ROUNDS: usize = 16;

/// Nanoseconds on CPU of this process's threads named `name` (summed).
fn thread_cpu_ns(name: &str) -> u64 {
    let mut total = 0;
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    for t in dir.flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if comm.trim() == name {
            let s = std::fs::read_to_string(t.path().join("schedstat")).unwrap_or_default();
            total += s
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    total
}

fn calibrate() {
    let n = 200_000_000u64;
    let t = Instant::now();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
    }
    let ns = t.elapsed().as_nanos() as f64 / n as f64;
    println!("rdma_post_cost: calibration loop {ns:.3} ns per iteration (checksum {x:x})");
}

fn main() {
    let host = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "10.99.2.1".into());
    if host == "calibrate" {
        return calibrate();
    }
    let cfg = Config {
        local_hostname: host,
        transport: TransportMode::Rdma,
        transfer_timeout: Duration::from_secs(60),
        ..Config::from_env().expect("configuration")
    };
    let a = TransferEngine::new(cfg.clone()).expect("engine a (RDMA)");
    let b = TransferEngine::new(cfg).expect("engine b (RDMA)");
    let ba = kvferry::hostbuf::HostBuffer::new(BUF, false).expect("buffer");
    let bb = kvferry::hostbuf::HostBuffer::new(BUF, false).expect("buffer");
    a.register_memory(ba.addr(), BUF as u64, "cpu:0")
        .expect("register");
    b.register_memory(bb.addr(), BUF as u64, "cpu:0")
        .expect("register");
    let peer = a.open_segment(b.segment_name()).expect("open segment");
    let batch: Vec<TransferRequest> = (0..BUF as u64 / REQ)
        .map(|i| TransferRequest {
            opcode: Opcode::Write,
            source: ba.addr() + i * REQ,
            target_id: peer,
            target_offset: bb.addr() + i * REQ,
            length: REQ,
        })
        .collect();
    // Warm-up: endpoints connected, pages touched.
    let st = a
        .transfer_sync(&batch, Duration::from_secs(60))
        .expect("warm-up");
    assert_eq!(st.status, TaskStatus::Completed, "warm-up batch");
    let (post0, poll0) = (
        thread_cpu_ns("kvf-rdma-post"),
        thread_cpu_ns("kvf-rdma-cq0"),
    );
    let t = Instant::now();
    for _ in 0..ROUNDS {
        let st = a
            .transfer_sync(&batch, Duration::from_secs(60))
            .expect("batch");
        assert_eq!(st.status, TaskStatus::Completed, "batch");
    }
    let secs = t.elapsed().as_secs_f64();
    let (post, poll) = (
        thread_cpu_ns("kvf-rdma-post") - post0,
        thread_cpu_ns("kvf-rdma-cq0") - poll0,
    );
    let slices = ROUNDS as u64 * BUF as u64 / SLICE;
    println!(
        "rdma_post_cost: {slices} slices of 64 KiB in {secs:.2} s ({:.3} GB/s); posting thread {:.0} ns CPU per slice, completion thread {:.0} ns per slice",
        (ROUNDS * BUF) as f64 / secs / 1e9,
        post as f64 / slices as f64,
        poll as f64 / slices as f64
    );
    calibrate();
}
