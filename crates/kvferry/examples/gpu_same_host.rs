//! Same-host GPU checks on the real driver (run by `scripts/gpu-check`; with the mock driver
//! of the tests, `LD_LIBRARY_PATH=<dir of the mock>`, it runs anywhere):
//!  1. VMM: three physical allocations of GPU 0 (`cuMemCreate`, the driver's granularity)
//!     mapped back to back (`cuMemMap`), as PyTorch's expandable segments make them; a range
//!     across all three registers as `cuda:0` and goes GPU→TCP→host and back, bytes compared.
//!  2. CUDA IPC: GPU 0 memory exported (`kvferry::host::gpu::ipc`), opened by a second process (this
//!     program again) on the last GPU, copied device to device both ways, bytes compared;
//!     GB/s beside a plain device-to-device copy between the same GPUs in one process.
//!  3. The engine's same-host GPU path: GPU 0 memory registered with an engine here, READ into
//!     the last GPU by an engine in a second process (the shared-memory transport opens the
//!     peer's CUDA IPC export and copies device to device), timed, bytes compared, and the
//!     bytes counted on the IPC path (none over TCP); GB/s beside the plain copy.
//!
//! Prints one JSON object (and writes `$OUT/gpu-same-host.json` when `OUT` is set); exits 1
//! when a check fails. Arguments: [MiB, default 256] [passes, default 3].

use kvferry::testing::gpu::{self, ipc, Cuda};
use kvferry::TransportMode;
use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest};
use std::time::{Duration, Instant};

fn fail(what: String) -> ! {
    eprintln!("gpu_same_host: {what}");
    std::process::exit(1);
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 16) as u8)
        .collect()
}

fn best_gbps(len: usize, passes: u32, mut copy: impl FnMut()) -> f64 {
    (0..passes.max(1))
        .map(|_| {
            let t = Instant::now();
            copy();
            len as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let cuda = gpu::cuda().unwrap_or_else(|why| fail(format!("GPU memory not usable: {why}")));
    if args.get(1).map(String::as_str) == Some("--import") {
        return import(cuda, &args[2..]);
    }
    if args.get(1).map(String::as_str) == Some("--engine-read") {
        return engine_read(cuda, &args[2..]);
    }
    let mib: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(256);
    let passes: u32 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(3);
    let last = gpu::probe().gpus.len().max(1) as u32 - 1;
    let vmm_ok = vmm(cuda);

    // IPC: GPU 0 memory, opened by another process on the last GPU.
    let len = mib << 20;
    let alloc = |dev: u32| {
        cuda.on_device(dev, |d| d.mem_alloc(len))
            .unwrap_or_else(|e| fail(format!("cuMemAlloc on GPU {dev}: {e}")))
    };
    let (src, dst) = (alloc(0), alloc(last));
    cuda.htod(0, src, &pattern(len, 1))
        .unwrap_or_else(|e| fail(format!("fill: {e}")));
    let local_gbps = best_gbps(len, passes, || {
        cuda.dtod(last, dst, src, len)
            .unwrap_or_else(|e| fail(format!("cuMemcpyDtoD: {e}")))
    });
    let e = ipc::export(src, len as u64).unwrap_or_else(|e| fail(e));
    let ipc_gbps = second_process(
        "importing",
        &[
            "--import",
            &e.encode(),
            &last.to_string(),
            &passes.to_string(),
        ],
    );
    let mut got = vec![0u8; len];
    cuda.dtoh(0, &mut got, src)
        .unwrap_or_else(|e| fail(format!("read back: {e}")));
    let ipc_ok = got == pattern(len, 2);
    // The engine's path: src (now pattern 2) registered here, read by another process's engine.
    let engine = TransferEngine::new(Config {
        transport: TransportMode::Auto,
        ..Config::default()
    })
    .unwrap_or_else(|e| fail(format!("engine: {e}")));
    engine
        .register_memory(src, len as u64, "cuda:0")
        .unwrap_or_else(|e| fail(format!("registering GPU 0 memory: {e}")));
    let engine_gbps = second_process(
        "reading",
        &[
            "--engine-read",
            engine.segment_name(),
            &src.to_string(),
            &len.to_string(),
            &last.to_string(),
            &passes.to_string(),
        ],
    );
    drop(engine);
    let _ = cuda.on_device(0, |d| d.mem_free(src));
    let _ = cuda.on_device(last, |d| d.mem_free(dst));

    let out = serde_json::json!({
        "vmm_registration_and_tcp": vmm_ok, "ipc_verified": ipc_ok, "bytes": len, "passes": passes, "gpus": [0, last],
        "ipc_dtod_gbps": ipc_gbps, "local_dtod_gbps": local_gbps, "ipc_vs_local": ipc_gbps / local_gbps,
        "engine_ipc_read_gbps": engine_gbps, "engine_ipc_vs_local": engine_gbps / local_gbps,
    });
    let text = serde_json::to_string_pretty(&out).unwrap_or_default();
    println!("{text}");
    if let Some(dir) = std::env::var_os("OUT") {
        let _ = std::fs::write(std::path::Path::new(&dir).join("gpu-same-host.json"), &text);
    }
    if !(vmm_ok && ipc_ok) {
        fail(format!("VMM check {vmm_ok}, IPC bytes {ipc_ok}"));
    }
}

/// Runs this program again with `args` and returns the GB/s it prints (`what` names it in
/// errors).
fn second_process(what: &str, args: &[&str]) -> f64 {
    let exe = std::env::current_exe().unwrap_or_else(|e| fail(format!("this program's path: {e}")));
    let out = std::process::Command::new(exe)
        .args(args)
        .output()
        .unwrap_or_else(|e| fail(format!("starting the {what} process: {e}")));
    let child = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        fail(format!(
            "the {what} process failed: {child}{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    child
        .trim()
        .parse()
        .unwrap_or_else(|_| fail(format!("the {what} process printed {child:?}")))
}

/// The second process: opens the export on GPU `args[1]`, times device-to-device copies out
/// of it, checks them, writes `pattern(len, 2)` back; prints the GB/s.
fn import(cuda: &'static Cuda, args: &[String]) {
    let e =
        ipc::Export::decode(args.first().map_or("", String::as_str)).unwrap_or_else(|e| fail(e));
    let on: u32 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(0);
    let passes: u32 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(3);
    let len = e.len as usize;
    let opened = ipc::open(&e, on).unwrap_or_else(|e| fail(e));
    let mine = cuda
        .on_device(on, |d| d.mem_alloc(len))
        .unwrap_or_else(|e| fail(format!("cuMemAlloc: {e}")));
    let gbps = best_gbps(len, passes, || {
        cuda.dtod(on, mine, opened.addr(), len)
            .unwrap_or_else(|e| fail(format!("cuMemcpyDtoD from the opened memory: {e}")))
    });
    let mut got = vec![0u8; len];
    cuda.dtoh(on, &mut got, mine)
        .unwrap_or_else(|e| fail(format!("read back: {e}")));
    if got != pattern(len, 1) {
        fail("bytes copied out of the opened memory differ".into());
    }
    cuda.htod(on, mine, &pattern(len, 2))
        .unwrap_or_else(|e| fail(format!("fill: {e}")));
    cuda.dtod(on, opened.addr(), mine, len)
        .unwrap_or_else(|e| fail(format!("cuMemcpyDtoD into the opened memory: {e}")));
    drop(opened);
    let _ = cuda.on_device(on, |d| d.mem_free(mine));
    println!("{gbps}");
}

/// The second process of check 3: an engine that READs `len` bytes of the peer segment's GPU
/// memory at `addr` into its own memory on GPU `on`, `passes` times; checks the bytes and that
/// they came through CUDA IPC; prints the best GB/s.
fn engine_read(cuda: &'static Cuda, args: &[String]) {
    let arg = |i: usize| args.get(i).cloned().unwrap_or_default();
    let (segment, addr, len, on, passes): (String, u64, usize, u32, u32) = (
        arg(0),
        arg(1).parse().unwrap_or(0),
        arg(2).parse().unwrap_or(0),
        arg(3).parse().unwrap_or(0),
        arg(4).parse().unwrap_or(3),
    );
    let e = TransferEngine::new(Config {
        transport: TransportMode::Auto,
        ..Config::default()
    })
    .unwrap_or_else(|e| fail(format!("engine: {e}")));
    let mine = cuda
        .on_device(on, |d| d.mem_alloc(len))
        .unwrap_or_else(|e| fail(format!("cuMemAlloc: {e}")));
    e.register_memory(mine, len as u64, "*")
        .unwrap_or_else(|e| fail(format!("registering GPU {on} memory: {e}")));
    let seg = e
        .open_segment(&segment)
        .unwrap_or_else(|e| fail(format!("open_segment {segment}: {e}")));
    let via = e.segment_transport(seg).map(|t| t.name).unwrap_or("?");
    if via != "shm" {
        fail(format!(
            "the same-host peer is reached by {via}, not shared memory"
        ));
    }
    let before = kvferry::testing::shm::gpu_ipc_bytes();
    let req = TransferRequest {
        opcode: Opcode::Read,
        source: mine,
        target_id: seg,
        target_offset: addr,
        length: len as u64,
    };
    let gbps = best_gbps(len, passes, || {
        let st = e
            .transfer_sync(std::slice::from_ref(&req), Duration::from_secs(60))
            .unwrap_or_else(|e| fail(format!("READ: {e}")));
        if st.status != TaskStatus::Completed {
            fail(format!(
                "READ of the peer's GPU memory ended {:?}: {:?}",
                st.status, st.reason
            ));
        }
    });
    let moved = kvferry::testing::shm::gpu_ipc_bytes() - before;
    if moved != len as u64 * u64::from(passes.max(1)) {
        fail(format!(
            "{moved} bytes went through CUDA IPC, not {} (the rest took another path)",
            len as u64 * u64::from(passes.max(1))
        ));
    }
    let mut got = vec![0u8; len];
    cuda.dtoh(on, &mut got, mine)
        .unwrap_or_else(|e| fail(format!("read back: {e}")));
    if got != pattern(len, 2) {
        fail("bytes read through the engine's same-host GPU path differ".into());
    }
    let _ = e.unregister_memory(mine);
    let _ = cuda.on_device(on, |d| d.mem_free(mine));
    println!("{gbps}");
}

type Reserve = unsafe extern "C" fn(*mut u64, usize, usize, u64, u64) -> i32;
type Granularity = unsafe extern "C" fn(*mut usize, *const [i32; 8], i32) -> i32;
type Create = unsafe extern "C" fn(*mut u64, usize, *const [i32; 8], u64) -> i32;
type Map = unsafe extern "C" fn(u64, usize, usize, u64, u64) -> i32;
type SetAccess = unsafe extern "C" fn(u64, usize, *const [i32; 3], usize) -> i32;
type Unmap = unsafe extern "C" fn(u64, usize) -> i32;
type Release = unsafe extern "C" fn(u64) -> i32;
type AddressFree = unsafe extern "C" fn(u64, usize) -> i32;

/// Check 1 (VMM); whether it passed (what failed is printed).
fn vmm(cuda: &'static Cuda) -> bool {
    // SAFETY: the driver kvferry loaded (same soname: the same library); the prototypes are
    // cuda.h's; the descriptors have cuda.h's layouts (CUmemAllocationProp: type, handle
    // types, location {type, id}, ...; CUmemAccessDesc: location {type, id}, flags).
    let r = unsafe {
        (|| -> Result<bool, String> {
            let lib = libloading::Library::new("libcuda.so.1").map_err(|e| e.to_string())?;
            let get = |name: &[u8]| -> Result<*mut std::ffi::c_void, String> {
                lib.get::<*mut std::ffi::c_void>(name)
                    .map(|s| *s)
                    .map_err(|e| format!("{}: {e}", String::from_utf8_lossy(name)))
            };
            let granularity: Granularity =
                std::mem::transmute(get(b"cuMemGetAllocationGranularity\0")?);
            let reserve: Reserve = std::mem::transmute(get(b"cuMemAddressReserve\0")?);
            let create: Create = std::mem::transmute(get(b"cuMemCreate\0")?);
            let map: Map = std::mem::transmute(get(b"cuMemMap\0")?);
            let set_access: SetAccess = std::mem::transmute(get(b"cuMemSetAccess\0")?);
            let unmap: Unmap = std::mem::transmute(get(b"cuMemUnmap\0")?);
            let release: Release = std::mem::transmute(get(b"cuMemRelease\0")?);
            let address_free: AddressFree = std::mem::transmute(get(b"cuMemAddressFree\0")?);
            let call = |what: &str, rc: i32| {
                if rc == 0 {
                    Ok(())
                } else {
                    Err(format!("{what} failed with CUDA error {rc}"))
                }
            };
            let prop = [1, 0, 1, 0, 0, 0, 0, 0];
            let mut g = 0usize;
            call(
                "cuMemGetAllocationGranularity",
                granularity(&mut g, &prop, 0),
            )?;
            let (seg, n) = (g.max(2 << 20), 3);
            let mut base = 0u64;
            call("cuMemAddressReserve", reserve(&mut base, seg * n, 0, 0, 0))?;
            let mut handles = Vec::new();
            for i in 0..n {
                let mut h = 0u64;
                call("cuMemCreate", create(&mut h, seg, &prop, 0))?;
                call("cuMemMap", map(base + (i * seg) as u64, seg, 0, h, 0))?;
                handles.push(h);
            }
            call("cuMemSetAccess", set_access(base, seg * n, &[1, 0, 3], 1))?;
            let ok = vmm_transfer(cuda, base, seg * n);
            for (i, &h) in handles.iter().enumerate() {
                let _ = unmap(base + (i * seg) as u64, seg);
                let _ = release(h);
            }
            let _ = address_free(base, seg * n);
            ok
        })()
    };
    r.unwrap_or_else(|e| {
        eprintln!("VMM check: {e}");
        false
    })
}

/// Registers an interior range across every mapping of `[base, +len)` and moves it over TCP.
fn vmm_transfer(cuda: &'static Cuda, base: u64, len: usize) -> Result<bool, String> {
    let (off, n) = (4096usize, len - 8192);
    let src = pattern(len, 3);
    cuda.htod(0, base, &src)
        .map_err(|e| format!("filling VMM memory: {e}"))?;
    let engine = || {
        TransferEngine::new(Config {
            transport: TransportMode::Tcp,
            ..Config::default()
        })
        .map_err(|e| e.to_string())
    };
    let (a, b) = (engine()?, engine()?);
    let p = base + off as u64;
    a.register_memory(p, n as u64, "*")
        .map_err(|e| format!("registering VMM memory: {e}"))?;
    let loc = a
        .registered()
        .into_iter()
        .find(|r| r.addr == p)
        .map(|r| r.location);
    if loc.as_deref() != Some("cuda:0") {
        return Err(format!("VMM memory registered as {loc:?}, not cuda:0"));
    }
    let host = vec![0u8; n];
    b.register_memory(host.as_ptr() as u64, n as u64, "*")
        .map_err(|e| e.to_string())?;
    let seg = a
        .open_segment(b.segment_name())
        .map_err(|e| e.to_string())?;
    let req = |opcode| {
        [TransferRequest {
            opcode,
            source: p,
            target_id: seg,
            target_offset: host.as_ptr() as u64,
            length: n as u64,
        }]
    };
    let st = a
        .transfer_sync(&req(Opcode::Write), Duration::from_secs(60))
        .map_err(|e| e.to_string())?;
    let write_ok = st.status == TaskStatus::Completed && host[..] == src[off..off + n];
    cuda.htod(0, base, &vec![0u8; len])
        .map_err(|e| format!("clearing VMM memory: {e}"))?;
    let st = a
        .transfer_sync(&req(Opcode::Read), Duration::from_secs(60))
        .map_err(|e| e.to_string())?;
    let mut got = vec![0u8; n];
    cuda.dtoh(0, &mut got, p)
        .map_err(|e| format!("reading VMM memory: {e}"))?;
    let read_ok = st.status == TaskStatus::Completed && got[..] == src[off..off + n];
    let _ = a.unregister_memory(p);
    let _ = b.unregister_memory(host.as_ptr() as u64);
    if !(write_ok && read_ok) {
        eprintln!("VMM check: WRITE ok {write_ok}, READ ok {read_ok}");
    }
    Ok(write_ok && read_ok)
}
