//! Round-trip latency of lone synchronous requests between two engines in one process.
//! `cargo run --release --example latency -p kvferry [size]`
use kvferry::{Config, Opcode, TransferEngine, TransferRequest};
use std::time::{Duration, Instant};

fn main() {
    let size: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(4096);
    let a = TransferEngine::new(Config::from_env().expect("config")).expect("engine a");
    let b = TransferEngine::new(Config::from_env().expect("config")).expect("engine b");
    let src = vec![1u8; size as usize];
    let dst = vec![0u8; size as usize];
    a.register_memory(src.as_ptr() as u64, size, "*")
        .expect("register");
    b.register_memory(dst.as_ptr() as u64, size, "*")
        .expect("register");
    let seg = a.open_segment(b.segment_name()).expect("open");
    for op in [Opcode::Write, Opcode::Read] {
        let r = [TransferRequest {
            opcode: op,
            source: src.as_ptr() as u64,
            target_id: seg,
            target_offset: dst.as_ptr() as u64,
            length: size,
        }];
        let mut v = Vec::new();
        for _ in 0..3000 {
            let t = Instant::now();
            let st = a
                .transfer_sync(&r, Duration::from_secs(5))
                .expect("transfer");
            v.push(t.elapsed().as_secs_f64() * 1e6);
            assert_eq!(st.status, kvferry::TaskStatus::Completed);
        }
        v.sort_by(|x, y| x.total_cmp(y));
        println!(
            "{op:?} {size} B: p50 {:.1} us, p10 {:.1} us, p99 {:.1} us",
            v[v.len() / 2],
            v[v.len() / 10],
            v[v.len() * 99 / 100]
        );
    }
}
