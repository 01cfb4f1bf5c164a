//! The NIC priority matrix decides which NICs carry a piece (in the Soft-RoCE VM, with rxe0 and
//! rxe_lo: `rdma_topo 10.99.2.1`). Two engines with `KVFERRY_TRANSPORT=rdma` read a matrix
//! file (`KVFERRY_RDMA_TOPO`, Mooncake's `MC_CUSTOM_TOPO_JSON`) that prefers rxe_lo for
//! `cpu:0`; they publish it; 16 MiB written from memory registered as `cpu:0` leaves rxe0's
//! packet counter where it was, while memory registered as `*` (no entry) is striped over
//! both NICs. Every byte verified. Exits non-zero on any failure.

use kvferry::TransportMode;
use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest};
use std::process::ExitCode;
use std::time::Duration;

mod common;
use common::*;

const SIZE: usize = 16 << 20;

fn main() -> ExitCode {
    let host = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "10.99.2.1".into());
    finish("rdma_topo", "all checks passed", run(&host))
}

fn write_and_count(
    a: &TransferEngine,
    peer: u64,
    src: &kvferry::hostbuf::HostBuffer,
    dst: &kvferry::hostbuf::HostBuffer,
) -> Res<(u64, u64)> {
    let (r0, l0) = (sent("rxe0"), sent("rxe_lo"));
    let req = TransferRequest {
        opcode: Opcode::Write,
        source: src.addr(),
        target_id: peer,
        target_offset: dst.addr(),
        length: SIZE as u64,
    };
    let st = a
        .transfer_sync(&[req], Duration::from_secs(60))
        .map_err(|e| e.to_string())?;
    if st.status != TaskStatus::Completed {
        return Err(format!("a 16 MiB WRITE ended {:?}", st.status));
    }
    if src.slice(0, SIZE) != dst.slice(0, SIZE) {
        return Err("the bytes written differ".into());
    }
    Ok((sent("rxe0") - r0, sent("rxe_lo") - l0))
}

fn run(host: &str) -> Res<()> {
    let file = std::env::temp_dir().join(format!("kvf-topo-{}.json", std::process::id()));
    std::fs::write(
        &file,
        r#"{"cpu:0": [["rxe_lo"], ["rxe0"]], "cuda:0": [["rxe0"], ["rxe_lo", "mlx5_9"]]}"#,
    )
    .map_err(|e| e.to_string())?;
    let cfg = Config {
        local_hostname: host.into(),
        transport: TransportMode::Rdma,
        transfer_timeout: Duration::from_secs(30),
        rdma_topo: Some(file.clone()),
        ..Config::default()
    };
    let a = TransferEngine::new(cfg.clone()).map_err(|e| e.to_string())?;
    let b = TransferEngine::new(cfg).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_file(&file);
    let src = kvferry::hostbuf::HostBuffer::new(SIZE, false).map_err(|e| e.to_string())?;
    let dst = kvferry::hostbuf::HostBuffer::new(SIZE, false).map_err(|e| e.to_string())?;
    for (i, b) in src.slice_mut(0, SIZE).iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(13) ^ (i >> 11) as u8;
    }
    a.register_memory(src.addr(), SIZE as u64, "cpu:0")
        .map_err(|e| e.to_string())?;
    b.register_memory(dst.addr(), SIZE as u64, "cpu:0")
        .map_err(|e| e.to_string())?;
    let peer = a
        .open_segment(b.segment_name())
        .map_err(|e| e.to_string())?;
    let desc = a.segment_descriptor(peer).map_err(|e| e.to_string())?;
    let m = desc
        .priority_matrix
        .get("cpu:0")
        .cloned()
        .unwrap_or_default();
    if m != serde_json::json!([["rxe_lo"], ["rxe0"]]) {
        return Err(format!(
            "the peer publishes cpu:0 -> {m}, not the file's entry"
        ));
    }
    if desc
        .priority_matrix
        .get("cuda:0")
        .cloned()
        .unwrap_or_default()
        != serde_json::json!([["rxe0"], ["rxe_lo"]])
    {
        return Err(format!(
            "the file's cuda:0 entry, less the NIC it does not have, is not published: {:?}",
            desc.priority_matrix
        ));
    }
    // Warm-up: both NIC pairs connected (the first request may connect only some).
    write_and_count(&a, peer, &src, &dst)?;
    let (rxe0, lo) = write_and_count(&a, peer, &src, &dst)?;
    println!("rdma_topo: 16 MiB from cpu:0 memory: rxe0 sent {rxe0} packets, rxe_lo {lo}");
    if lo == 0 || rxe0 * 20 > lo {
        return Err(format!("cpu:0 memory should go over rxe_lo (the matrix prefers it): rxe0 sent {rxe0} packets, rxe_lo {lo}"));
    }
    // Memory registered as "*": no entry, so every NIC, striped.
    a.unregister_memory(src.addr()).map_err(|e| e.to_string())?;
    a.register_memory(src.addr(), SIZE as u64, "*")
        .map_err(|e| e.to_string())?;
    let (rxe0, lo) = write_and_count(&a, peer, &src, &dst)?;
    println!("rdma_topo: 16 MiB from * memory: rxe0 sent {rxe0} packets, rxe_lo {lo}");
    if rxe0 == 0 || lo == 0 {
        return Err(format!("memory without a matrix entry should be striped over both NICs: rxe0 sent {rxe0}, rxe_lo {lo}"));
    }
    println!(
        "rdma_topo: the matrix file picks the NICs (cpu:0 on rxe_lo only; * striped over both)"
    );
    Ok(())
}
