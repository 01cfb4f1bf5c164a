//! GPU memory over TCP, verified and timed: two engines in this process (TCP only), a GPU
//! buffer on each side (GPU 0 and the last GPU), WRITEs GPU→TCP→GPU and READs back, every byte
//! compared through the driver; then the same transfers between host buffers, for the ratio.
//! Prints one JSON object (and writes it to `$OUT/gpu-tcp.json` when `OUT` is set); exits 1
//! when GPU memory cannot be used or a byte differs. `scripts/gpu-check` runs it on a GPU
//! machine; with the mock driver of the tests (`LD_LIBRARY_PATH=<dir of the mock>`) it runs
//! anywhere. Arguments: [MiB per pass, default 256] [passes, default 3].

use kvferry::TransportMode;
use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest};
use std::time::{Duration, Instant};

const REQ: u64 = 4 << 20;

fn main() {
    let mut args = std::env::args().skip(1);
    let mib: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(256);
    let passes: u32 = args.next().and_then(|a| a.parse().ok()).unwrap_or(3);
    let len = mib << 20;
    let cuda = match kvferry::testing::gpu::cuda() {
        Ok(c) => c,
        Err(why) => {
            eprintln!("GPU memory not usable: {why}");
            std::process::exit(1);
        }
    };
    let gpus = kvferry::host::gpu::probe().gpus.len().max(1) as u32;
    let (ga, gb) = (0u32, gpus - 1);
    let engine = || {
        TransferEngine::new(Config {
            transport: TransportMode::Tcp,
            ..Config::default()
        })
        .expect("engine starts")
    };
    let (a, b) = (engine(), engine());
    let seg = a.open_segment(b.segment_name()).expect("open segment");

    let pattern: Vec<u8> = (0..len as usize)
        .map(|i| (i as u8).wrapping_mul(31) ^ (i >> 16) as u8)
        .collect();
    let alloc = |dev: u32| {
        cuda.on_device(dev, |d| d.mem_alloc(len as usize))
            .expect("cuMemAlloc")
    };
    let (da, db) = (alloc(ga), alloc(gb));
    cuda.htod(ga, da, &pattern).expect("fill");
    cuda.htod(gb, db, &vec![0u8; len as usize]).expect("clear");
    let ha = pattern.clone();
    let hb = vec![0u8; len as usize];
    for (e, p) in [
        (&a, da),
        (&b, db),
        (&a, ha.as_ptr() as u64),
        (&b, hb.as_ptr() as u64),
    ] {
        e.register_memory(p, len, "*").expect("register");
    }

    let run = |op: Opcode, local: u64, remote: u64| -> f64 {
        let reqs: Vec<TransferRequest> = (0..len.div_ceil(REQ))
            .map(|i| TransferRequest {
                opcode: op,
                source: local + i * REQ,
                target_id: seg,
                target_offset: remote + i * REQ,
                length: REQ.min(len - i * REQ),
            })
            .collect();
        let mut best = 0f64;
        for _ in 0..passes {
            let t = Instant::now();
            let st = a
                .transfer_sync(&reqs, Duration::from_secs(120))
                .expect("transfer");
            let secs = t.elapsed().as_secs_f64();
            if st.status != TaskStatus::Completed {
                eprintln!("{op:?} failed: {st:?}");
                std::process::exit(1);
            }
            best = best.max(len as f64 / secs / 1e9);
        }
        best
    };
    let gpu_write = run(Opcode::Write, da, db);
    let mut got = vec![0u8; len as usize];
    cuda.dtoh(gb, &mut got, db).expect("read back");
    let write_ok = got == pattern;
    cuda.htod(ga, da, &vec![0u8; len as usize]).expect("clear");
    let gpu_read = run(Opcode::Read, da, db);
    cuda.dtoh(ga, &mut got, da).expect("read back");
    let read_ok = got == pattern;
    let host_write = run(Opcode::Write, ha.as_ptr() as u64, hb.as_ptr() as u64);
    let host_read = run(Opcode::Read, ha.as_ptr() as u64, hb.as_ptr() as u64);
    let host_ok = hb == pattern;
    let out = serde_json::json!({
        "bytes_per_pass": len, "passes": passes, "request_bytes": REQ, "gpus": [ga, gb],
        "gpu_tcp_write_gbps": gpu_write, "gpu_tcp_read_gbps": gpu_read,
        "host_tcp_write_gbps": host_write, "host_tcp_read_gbps": host_read,
        "gpu_vs_host_write": gpu_write / host_write, "gpu_vs_host_read": gpu_read / host_read,
        "verified": write_ok && read_ok && host_ok,
    });
    let text = serde_json::to_string_pretty(&out).unwrap_or_default();
    println!("{text}");
    if let Some(dir) = std::env::var_os("OUT") {
        let _ = std::fs::write(std::path::Path::new(&dir).join("gpu-tcp.json"), &text);
    }
    for (e, p) in [
        (&a, da),
        (&b, db),
        (&a, ha.as_ptr() as u64),
        (&b, hb.as_ptr() as u64),
    ] {
        let _ = e.unregister_memory(p);
    }
    let _ = cuda.on_device(ga, |d| d.mem_free(da));
    let _ = cuda.on_device(gb, |d| d.mem_free(db));
    if !(write_ok && read_ok && host_ok) {
        eprintln!("bytes differ: GPU write {write_ok}, GPU read {read_ok}, host {host_ok}");
        std::process::exit(1);
    }
}
