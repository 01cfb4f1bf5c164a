//! Cross-memory attach refused by the kernel (simulated: every `process_vm_readv/writev` of
//! this process fails with EPERM, as under `kernel.yama.ptrace_scope=1` between siblings).
//! Its own test binary: the switch is process-wide.

use kvferry::testing::shm::simulate_cma_denied;
use kvferry::TransportMode;
use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest};
use std::time::Duration;

fn engine_with(mode: TransportMode) -> TransferEngine {
    TransferEngine::new(Config {
        transfer_timeout: Duration::from_secs(5),
        transport: mode,
        ..Config::default()
    })
    .expect("engine starts")
}

#[test]
fn cma_not_permitted_falls_back_to_tcp_or_fails_when_shm_is_forced() {
    simulate_cma_denied(true);
    let b = engine_with(TransportMode::Auto);
    let dst = vec![0u8; 1 << 20];
    b.register_memory(dst.as_ptr() as u64, dst.len() as u64, "*")
        .unwrap();
    let src: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();

    // auto: the probe fails, TCP carries the data, the reason names the refusal.
    let a = engine_with(TransportMode::Auto);
    a.register_memory(src.as_ptr() as u64, src.len() as u64, "*")
        .unwrap();
    let seg = a.open_segment(b.segment_name()).unwrap();
    let t = a.segment_transport(seg).unwrap();
    assert_eq!(t.name, "tcp");
    let why = t.why_not_shm.unwrap();
    assert!(
        why.contains("not permitted") && why.contains("CAP_SYS_PTRACE"),
        "{why}"
    );
    let req = TransferRequest {
        opcode: Opcode::Write,
        source: src.as_ptr() as u64,
        target_id: seg,
        target_offset: dst.as_ptr() as u64,
        length: src.len() as u64,
    };
    let st = a.transfer_sync(&[req], Duration::from_secs(10)).unwrap();
    assert_eq!(st.status, TaskStatus::Completed, "{st:?}");
    assert_eq!(dst, src);

    // shm forced: the request fails with the same reason, nothing moves.
    let c = engine_with(TransportMode::Shm);
    let other = vec![9u8; 4096];
    c.register_memory(other.as_ptr() as u64, 4096, "*").unwrap();
    let seg = c.open_segment(b.segment_name()).unwrap();
    let req = TransferRequest {
        opcode: Opcode::Write,
        source: other.as_ptr() as u64,
        target_id: seg,
        target_offset: dst.as_ptr() as u64,
        length: 4096,
    };
    let st = c.transfer_sync(&[req], Duration::from_secs(10)).unwrap();
    assert_eq!(st.status, TaskStatus::Failed);
    assert!(st.reason.unwrap().contains("not permitted"));
    assert_eq!(&dst[..4096], &src[..4096]);

    // Allowed again: a new peer process identity (here: a new engine) is probed afresh.
    simulate_cma_denied(false);
    let d = engine_with(TransportMode::Auto);
    d.register_memory(src.as_ptr() as u64, src.len() as u64, "*")
        .unwrap();
    let seg = d.open_segment(b.segment_name()).unwrap();
    assert_eq!(d.segment_transport(seg).unwrap().name, "shm");
}
