//! Interop with stock Mooncake (the PyPI wheel), both directions, on 127.0.0.1.
//!
//! The Mooncake side is `tests/interop/mooncake_peer.py`, run with the Python named by
//! `KVFERRY_MOONCAKE_PYTHON`, else `.venv/mooncake` (a venv with
//! `mooncake-transfer-engine-non-cuda`; `scripts/test` creates it). A missing peer is a
//! failure unless `KVFERRY_SKIP_MOONCAKE=1` (see `mooncake_peer::python`). Each test runs
//! against Mooncake 0.3.14 too (`KVFERRY_MOONCAKE314_PYTHON`, else `.venv/mooncake314`:
//! `scripts/mooncake-venv 0.3.14`; NOT RUN, saying so, where neither is there).

mod mooncake_peer;

use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest};
use mooncake_peer::{pattern, python, python_0_3_14, sha, MooncakeTarget};
use serde_json::Value;
use std::time::Duration;

fn engine() -> TransferEngine {
    TransferEngine::new(Config {
        transfer_timeout: Duration::from_secs(10),
        ..Config::default()
    })
    .expect("engine")
}

/// Runs the Mooncake initiator against our segment; returns its JSON result.
#[allow(clippy::too_many_arguments)]
fn mooncake_initiator(
    py: &str,
    env: &[(&str, &str)],
    segment: &str,
    addr: u64,
    size: usize,
    op: &str,
    block: usize,
    batch: usize,
    seed: usize,
) -> Value {
    let (addr, size, block, batch, seed) = (
        addr.to_string(),
        size.to_string(),
        block.to_string(),
        batch.to_string(),
        seed.to_string(),
    );
    let args = [
        "initiator",
        "--segment",
        segment,
        "--remote-addr",
        &addr,
        "--size",
        &size,
        "--op",
        op,
        "--block",
        &block,
        "--batch",
        &batch,
        "--seed",
        &seed,
    ];
    mooncake_peer::run(py, &args, env)
}

#[test]
fn mooncake_initiator_to_kvferry_target() {
    let Some(py) = python() else { return };
    mooncake_initiator_to_kvferry(&py);
}

#[test]
fn mooncake_0_3_14_initiator_to_kvferry_target() {
    let Some(py) = python_0_3_14() else { return };
    mooncake_initiator_to_kvferry(&py);
}

fn mooncake_initiator_to_kvferry(py: &str) {
    let size = 16 << 20;
    let e = engine();
    let mem = vec![0u8; size];
    e.register_memory(mem.as_ptr() as u64, size as u64, "cpu:0")
        .unwrap();
    let addr = mem.as_ptr() as u64;
    for (env, label) in [(vec![], "v2"), (vec![("MC_TCP_PROTO", "1")], "v1")] {
        for (block, batch, seed) in [
            (4096usize, 128usize, 1usize),
            (65536, 32, 2),
            (1 << 20, 4, 3),
            (16 << 20, 1, 4),
        ] {
            let r = mooncake_initiator(
                py,
                &env,
                e.segment_name(),
                addr,
                size,
                "write",
                block,
                batch,
                seed,
            );
            assert_eq!(r["ok"], true, "{label} write block {block}: {r}");
            assert!(
                mem == pattern(size, seed),
                "{label}: bytes written by Mooncake (block {block}) landed exactly"
            );
            let r = mooncake_initiator(
                py,
                &env,
                e.segment_name(),
                addr,
                size,
                "read",
                block,
                batch,
                0,
            );
            assert_eq!(r["ok"], true, "{label} read block {block}: {r}");
            assert_eq!(
                r["sha256"],
                sha(&mem),
                "{label}: Mooncake read back our bytes (block {block})"
            );
        }
    }
    // Out-of-range address: Mooncake's call fails, our memory is untouched.
    let before = sha(&mem);
    let r = mooncake_initiator(
        py,
        &[],
        e.segment_name(),
        addr + size as u64 - 4096,
        8192,
        "write",
        8192,
        1,
        9,
    );
    assert_eq!(r["ok"], false, "{r}");
    assert_eq!(sha(&mem), before);
    // The engine still serves: a good write after the rejection.
    let r = mooncake_initiator(py, &[], e.segment_name(), addr, 4096, "write", 4096, 1, 5);
    assert_eq!(r["ok"], true, "{r}");
    // Probe from Mooncake.
    let r = mooncake_peer::run(py, &["probe", "--segment", e.segment_name()], &[]);
    assert_eq!(r["ret"], 0, "Mooncake probe of kvferry: {r}");
}

fn run(
    e: &TransferEngine,
    op: Opcode,
    local: &[u8],
    seg: u64,
    remote: u64,
    block: usize,
    batch: usize,
) -> kvferry::TransferStatus {
    let reqs: Vec<_> = (0..local.len() / block)
        .map(|i| TransferRequest {
            opcode: op,
            source: local.as_ptr() as u64 + (i * block) as u64,
            target_id: seg,
            target_offset: remote + (i * block) as u64,
            length: block as u64,
        })
        .collect();
    let mut last = None;
    for chunk in reqs.chunks(batch) {
        let st = e.transfer_sync(chunk, Duration::from_secs(30)).unwrap();
        if st.status != TaskStatus::Completed {
            return st;
        }
        last = Some(st);
    }
    last.unwrap()
}

#[test]
fn kvferry_initiator_to_mooncake_target() {
    let Some(py) = python() else { return };
    kvferry_initiator_to_mooncake(&py);
}

#[test]
fn kvferry_initiator_to_mooncake_0_3_14_target() {
    let Some(py) = python_0_3_14() else { return };
    kvferry_initiator_to_mooncake(&py);
}

fn kvferry_initiator_to_mooncake(py: &str) {
    let size = 16 << 20;
    for (env, proto) in [(vec![], 2u32), (vec![], 1u32)] {
        let mut t = MooncakeTarget::start(py, &[], &env, size, 3);
        let e = TransferEngine::new(Config {
            tcp_proto: proto,
            ..Config::default()
        })
        .unwrap();
        let local = vec![0u8; size];
        e.register_memory(local.as_ptr() as u64, size as u64, "cpu:0")
            .unwrap();
        let seg = e.open_segment(&t.segment).unwrap();
        let desc = e.segment_descriptor(seg).unwrap();
        assert_eq!(desc.tcp_version(), 2, "Mooncake advertises v2");
        for (block, batch) in [
            (4096usize, 128usize),
            (65536, 64),
            (1 << 20, 8),
            (16 << 20, 1),
        ] {
            // READ Mooncake's pattern.
            let mut local_mut = local.clone();
            local_mut.fill(0);
            e.register_memory(local_mut.as_ptr() as u64, size as u64, "cpu:0")
                .unwrap();
            let st = run(&e, Opcode::Read, &local_mut, seg, t.addr, block, batch);
            assert_eq!(
                st.status,
                TaskStatus::Completed,
                "v{proto} read block {block}: {st:?}"
            );
            assert!(
                local_mut == pattern(size, 3),
                "v{proto}: read bytes match Mooncake's memory (block {block})"
            );
            e.unregister_memory(local_mut.as_ptr() as u64).unwrap();
        }
        for (block, batch, seed) in [
            (4096usize, 128usize, 11usize),
            (65536, 64, 12),
            (1 << 20, 8, 13),
            (16 << 20, 1, 14),
        ] {
            let src = pattern(size, seed);
            e.register_memory(src.as_ptr() as u64, size as u64, "cpu:0")
                .unwrap();
            let st = run(&e, Opcode::Write, &src, seg, t.addr, block, batch);
            assert_eq!(
                st.status,
                TaskStatus::Completed,
                "v{proto} write block {block}: {st:?}"
            );
            let theirs = t.ask(&format!("checksum 0 {size}"));
            assert_eq!(
                theirs["sha256"],
                sha(&src),
                "v{proto}: Mooncake's memory holds our bytes (block {block})"
            );
            e.unregister_memory(src.as_ptr() as u64).unwrap();
        }
        // A bad address fails that task and leaves Mooncake's memory unchanged.
        let before = t.ask(&format!("checksum 0 {size}"));
        let st = e
            .transfer_sync(
                &[TransferRequest {
                    opcode: Opcode::Write,
                    source: local.as_ptr() as u64,
                    target_id: seg,
                    target_offset: t.addr + size as u64 - 10,
                    length: 4096,
                }],
                Duration::from_secs(10),
            )
            .unwrap();
        assert_eq!(st.status, TaskStatus::Failed);
        assert_eq!(t.ask(&format!("checksum 0 {size}")), before);
        // Notify and probe towards Mooncake.
        e.send_notify(&t.segment, "from-kvferry").unwrap();
        let n = t.ask("notifies");
        assert_eq!(n["notifies"][0][1], "from-kvferry", "{n}");
        assert_eq!(n["notifies"][0][0], e.segment_name());
        e.probe(&t.segment).unwrap();
        drop(e);
        let _ = &mut t;
    }
}
