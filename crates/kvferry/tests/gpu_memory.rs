//! GPU memory with the CUDA driver loaded at run time, against the mock `libcuda.so.1`
//! (`cuda_mock/mock_cuda.c`: device memory the CPU cannot touch, reached only through the
//! driver's copies). Each test runs its body in a child process whose `LD_LIBRARY_PATH`
//! holds the mock, so the engine loads it by soname as it loads the real driver; the child
//! bodies are `#[ignore]`d so that only their parent runs them.

mod cuda_mock;

use kvferry::testing::gpu::{self, Cuda};
use kvferry::TransportMode;
use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest, LOCAL_SEGMENT_ID};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// Runs the ignored test `name` of this binary in a child with `lib` (a directory holding a
/// `libcuda.so.1`) first in `LD_LIBRARY_PATH`, or with no `LD_LIBRARY_PATH` at all.
fn in_child(name: &str, lib: Option<&Path>) {
    in_child_with(name, lib, &[]);
}

/// [`in_child`] with more environment variables.
fn in_child_with(name: &str, lib: Option<&Path>, env: &[(&str, &str)]) {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args([
        name,
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("KVF_GPU_CHILD", "1")
    .envs(env.iter().copied());
    match lib {
        Some(d) => c.env("LD_LIBRARY_PATH", d),
        None => c.env_remove("LD_LIBRARY_PATH"),
    };
    let out = c.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "child {name} failed:\n{text}");
    assert!(
        text.contains("1 passed"),
        "child {name} did not run:\n{text}"
    );
}

fn child() -> bool {
    std::env::var_os("KVF_GPU_CHILD").is_some()
}

/// An engine over `mode`; in a child started with `KVF_TEST_KEY` (a key file) and
/// `KVF_TEST_PROTECT`, holding that cluster key and protecting that much.
fn engine(mode: TransportMode) -> TransferEngine {
    let auth_key_file = std::env::var_os("KVF_TEST_KEY").map(std::path::PathBuf::from);
    let auth_protect = std::env::var("KVF_TEST_PROTECT")
        .ok()
        .and_then(|p| kvferry::auth::Protect::parse(&p))
        .unwrap_or_default();
    TransferEngine::new(Config {
        transfer_timeout: Duration::from_secs(5),
        transport: mode,
        auth_key_file,
        auth_protect,
        ..Config::default()
    })
    .expect("engine starts")
}

/// Bytes that differ between any two 1 MiB chunks (so a chunk landing in another's place shows).
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u8)
                .wrapping_mul(31)
                .wrapping_add(seed)
                .wrapping_add((i >> 12) as u8)
                .wrapping_add(((i >> 20) as u8).wrapping_mul(101))
        })
        .collect()
}

/// `len` bytes of device memory on GPU `dev`, filled with `fill` through the driver.
fn gpu_alloc(c: &Cuda, dev: u32, fill: &[u8]) -> u64 {
    let p = c.on_device(dev, |d| d.mem_alloc(fill.len())).unwrap();
    c.htod(dev, p, fill).unwrap();
    p
}

/// The device bytes at `p`, read through the driver (the only way to see them).
fn gpu_read(c: &Cuda, dev: u32, p: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    c.dtoh(dev, &mut v, p).unwrap();
    v
}

/// The mock driver's run-time knobs (see mock_cuda.c), from the `libcuda.so.1` this process
/// (a child with the mock on `LD_LIBRARY_PATH`) loaded: one place holds the `unsafe`.
struct Knobs {
    _lib: libloading::Library,
    fail_copies: unsafe extern "C" fn(i32),
    copy_delay_us: unsafe extern "C" fn(u32),
    copies: unsafe extern "C" fn(i32) -> i64,
    queued: unsafe extern "C" fn() -> i64,
    max_queued: unsafe extern "C" fn() -> i64,
    reset_max_queued: unsafe extern "C" fn(),
    ipc_open: unsafe extern "C" fn() -> i64,
}

impl Knobs {
    fn load() -> Knobs {
        // SAFETY: the mock's exported knobs, with their C prototypes; dlopen of the already
        // loaded library returns it again, and it stays loaded while `_lib` lives.
        unsafe {
            let lib = libloading::Library::new("libcuda.so.1").expect("the mock driver");
            Knobs {
                fail_copies: *lib.get(b"mock_cuda_fail_copies\0").expect("knob"),
                copy_delay_us: *lib.get(b"mock_cuda_copy_delay_us\0").expect("knob"),
                copies: *lib.get(b"mock_cuda_copies\0").expect("knob"),
                queued: *lib.get(b"mock_cuda_queued\0").expect("knob"),
                max_queued: *lib.get(b"mock_cuda_max_queued\0").expect("knob"),
                reset_max_queued: *lib.get(b"mock_cuda_reset_max_queued\0").expect("knob"),
                ipc_open: *lib.get(b"mock_cuda_ipc_open\0").expect("knob"),
                _lib: lib,
            }
        }
    }
    /// Every copy returns `code` (0: copies work again).
    fn fail_copies(&self, code: i32) {
        // SAFETY (every method): a knob of the mock, plain values in and out.
        unsafe { (self.fail_copies)(code) }
    }
    /// Every copy takes `us` when it runs.
    fn copy_delay_us(&self, us: u32) {
        unsafe { (self.copy_delay_us)(us) }
    }
    /// Copies that touched GPU `dev`'s memory so far.
    fn copies(&self, dev: i32) -> i64 {
        unsafe { (self.copies)(dev) }
    }
    fn queued(&self) -> i64 {
        unsafe { (self.queued)() }
    }
    fn max_queued(&self) -> i64 {
        unsafe { (self.max_queued)() }
    }
    fn reset_max_queued(&self) {
        unsafe { (self.reset_max_queued)() }
    }
    /// Other processes' GPU memory opened here through CUDA IPC and not closed yet.
    fn ipc_open(&self) -> i64 {
        unsafe { (self.ipc_open)() }
    }
}

fn mock_dir() -> std::path::PathBuf {
    cuda_mock::build("mem", &["COUNT=2"])
}

#[test]
fn gpu_pointers_are_classified_with_their_allocation() {
    in_child("child_classification", Some(&mock_dir()));
}

#[test]
#[ignore = "run by gpu_pointers_are_classified_with_their_allocation in a child process"]
fn child_classification() {
    assert!(child());
    let c = gpu::cuda().expect("the mock driver loads");
    let e = engine(TransportMode::Auto);
    let d0 = gpu_alloc(c, 0, &vec![0u8; 1 << 20]);
    let d1 = gpu_alloc(c, 1, &vec![0u8; 1 << 20]);
    // Interior pointers (as PyTorch's caching allocator hands out): the allocation's base and
    // size decide, and the published location is the GPU's.
    e.register_memory(d0 + 4096, 8192, "*").unwrap();
    e.register_memory(d1 + 512, 4096, "cuda:1").unwrap();
    let regs = e.registered();
    let r0 = regs.iter().find(|r| r.addr == d0 + 4096).unwrap();
    assert_eq!((r0.location.as_str(), r0.gpu), ("cuda:0", Some(0)));
    let r1 = regs.iter().find(|r| r.addr == d1 + 512).unwrap();
    assert_eq!((r1.location.as_str(), r1.gpu), ("cuda:1", Some(1)));
    let desc = e.local_descriptor();
    assert!(
        desc.buffers
            .iter()
            .any(|b| b.addr == d0 + 4096 && b.name == "cuda:0"),
        "{:?}",
        desc.buffers
    );
    // Past the end of the allocation, or on another GPU than the location says: refused.
    let err = e
        .register_memory(d0 + (1 << 20) - 100, 4096, "*")
        .unwrap_err()
        .to_string();
    assert!(err.contains("past the end of its GPU allocation"), "{err}");
    let err = e
        .register_memory(d0 + 65536, 4096, "cuda:1")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("memory of GPU 0") && err.contains("cuda:0"),
        "{err}"
    );
    // Host memory stays host memory: plain (unknown to the driver), and pinned.
    let host = vec![0u8; 8192];
    e.register_memory(host.as_ptr() as u64, 8192, "*").unwrap();
    let pinned = c.driver().host_alloc(8192).unwrap();
    e.register_memory(pinned as u64, 8192, "*").unwrap();
    for a in [host.as_ptr() as u64, pinned as u64] {
        let r = e.registered().into_iter().find(|r| r.addr == a).unwrap();
        assert_eq!((r.location.as_str(), r.gpu), ("*", None));
    }
    // cpu:N is taken as given, without asking the driver.
    let h2 = [0u8; 64];
    e.register_memory(h2.as_ptr() as u64, 64, "cpu:0").unwrap();
    assert_eq!(
        e.registered()
            .into_iter()
            .find(|r| r.addr == h2.as_ptr() as u64)
            .unwrap()
            .gpu,
        None
    );
    e.unregister_memory(d0 + 4096).unwrap();
    e.unregister_memory(d1 + 512).unwrap();
    e.unregister_memory(pinned as u64).unwrap();
    // SAFETY: from host_alloc, unregistered above.
    unsafe { c.driver().free_host(pinned).unwrap() };
}

#[test]
fn gpu_memory_moves_over_tcp_and_same_host_paths_every_byte_verified() {
    // A CUDA 12.4 and a CUDA 13.0 driver: the same soname and entry points.
    in_child("child_transfers", Some(&mock_dir()));
    in_child(
        "child_transfers",
        Some(&cuda_mock::build("cuda13", &["COUNT=2", "VERSION=13000"])),
    );
}

/// The same transfers between engines holding a cluster key, with the bytes moved
/// authenticated (`payload`) and sealed (`encrypt`): the protected chunks go through the GPU
/// staging on both sides (a chunk divides the 1 MiB staging chunk), every byte verified.
#[test]
fn gpu_memory_moves_over_keyed_connections_under_each_protection() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("kvferry-gpu-key-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let key = dir.join("key");
    std::fs::write(&key, "g".repeat(64)).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    for protect in ["payload", "encrypt"] {
        in_child_with(
            "child_transfers",
            Some(&mock_dir()),
            &[
                ("KVF_TEST_KEY", key.to_str().unwrap()),
                ("KVF_TEST_PROTECT", protect),
            ],
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// One side's buffer: host memory, or device memory of a GPU.
enum Buf {
    Host(Vec<u8>),
    Gpu(u32, u64),
}

impl Buf {
    fn new(c: &Cuda, gpu: Option<u32>, init: &[u8]) -> Buf {
        match gpu {
            None => Buf::Host(init.to_vec()),
            Some(d) => Buf::Gpu(d, gpu_alloc(c, d, init)),
        }
    }
    fn addr(&self) -> u64 {
        match self {
            Buf::Host(v) => v.as_ptr() as u64,
            Buf::Gpu(_, p) => *p,
        }
    }
    fn bytes(&self, c: &Cuda, len: usize) -> Vec<u8> {
        match self {
            Buf::Host(v) => v[..len].to_vec(),
            Buf::Gpu(d, p) => gpu_read(c, *d, *p, len),
        }
    }
}

#[test]
#[ignore = "run by gpu_memory_moves_over_tcp_and_same_host_paths_every_byte_verified in a child process"]
fn child_transfers() {
    assert!(child());
    let c = gpu::cuda().expect("the mock driver loads");
    let version = c.driver().version().unwrap();
    assert!(version == 12040 || version == 13000, "{version}");
    // Sizes around every chunk boundary: the target's 1 MiB staging chunk, the initiator's
    // 4 MiB chunk and its window of 4 chunks in flight.
    let sizes = [1usize, 4093, 65536, (1 << 20) + 3, (9 << 20) + 5, 17 << 20];
    let total: usize = sizes.iter().sum();
    for mode in [TransportMode::Tcp, TransportMode::Auto] {
        let a = engine(mode);
        let b = engine(mode);
        let seg = a.open_segment(b.segment_name()).unwrap();
        if mode == TransportMode::Auto {
            // Host memory of this same-host peer goes over shared memory (staged GPU chunks
            // too); its GPU memory over TCP.
            assert_eq!(
                a.segment_transport(seg).unwrap().name,
                "shm",
                "{:?}",
                a.segment_transport(seg)
            );
        }
        // (initiator side, target side): GPU→host, host→GPU, GPU→GPU on another device,
        // and the engine's own segment (local copy) GPU↔host.
        for (la, lb, own) in [
            (Some(0), None, false),
            (None, Some(1), false),
            (Some(0), Some(1), false),
            (Some(1), None, true),
            (None, Some(0), true),
        ] {
            let src = pattern(total, 7);
            let ab = Buf::new(c, la, &src);
            let bb = Buf::new(c, lb, &vec![0u8; total]);
            let back = Buf::new(c, la, &vec![0u8; total]);
            let (tgt_engine, tgt) = if own {
                (&a, LOCAL_SEGMENT_ID)
            } else {
                (&b, seg)
            };
            a.register_memory(ab.addr(), total as u64, "*").unwrap();
            a.register_memory(back.addr(), total as u64, "*").unwrap();
            tgt_engine
                .register_memory(bb.addr(), total as u64, "*")
                .unwrap();
            let what = format!("{mode:?} initiator {la:?} target {lb:?} own segment {own}");
            let reqs = |op: Opcode, local: u64| -> Vec<TransferRequest> {
                let mut off = 0u64;
                sizes
                    .iter()
                    .map(|&s| {
                        let r = TransferRequest {
                            opcode: op,
                            source: local + off,
                            target_id: tgt,
                            target_offset: bb.addr() + off,
                            length: s as u64,
                        };
                        off += s as u64;
                        r
                    })
                    .collect()
            };
            let st = a
                .transfer_sync(&reqs(Opcode::Write, ab.addr()), Duration::from_secs(20))
                .unwrap();
            assert_eq!(st.status, TaskStatus::Completed, "{what}: WRITE {st:?}");
            assert_eq!(st.transferred_bytes, total as u64);
            assert!(bb.bytes(c, total) == src, "{what}: written bytes differ");
            let st = a
                .transfer_sync(&reqs(Opcode::Read, back.addr()), Duration::from_secs(20))
                .unwrap();
            assert_eq!(st.status, TaskStatus::Completed, "{what}: READ {st:?}");
            assert!(back.bytes(c, total) == src, "{what}: read bytes differ");
            // Many small requests in one batch, pipelined.
            let n = 256u64;
            let small: Vec<TransferRequest> = (0..n)
                .map(|i| TransferRequest {
                    opcode: Opcode::Read,
                    source: back.addr() + i * 4096,
                    target_id: tgt,
                    target_offset: bb.addr() + i * 4096,
                    length: 4096,
                })
                .collect();
            let st = a.transfer_sync(&small, Duration::from_secs(20)).unwrap();
            assert_eq!(
                st.status,
                TaskStatus::Completed,
                "{what}: small READs {st:?}"
            );
            a.unregister_memory(ab.addr()).unwrap();
            a.unregister_memory(back.addr()).unwrap();
            tgt_engine.unregister_memory(bb.addr()).unwrap();
        }
        // Several threads at once, each its own GPU→GPU WRITE and READ back (the staging
        // workers and the target's connections serve them side by side).
        let part = (6 << 20) + 17;
        let threads = 4;
        let src = pattern(part * threads, 11);
        let ga = gpu_alloc(c, 0, &src);
        let gb = gpu_alloc(c, 1, &vec![0u8; part * threads]);
        let gback = gpu_alloc(c, 0, &vec![0u8; part * threads]);
        a.register_memory(ga, (part * threads) as u64, "*").unwrap();
        a.register_memory(gback, (part * threads) as u64, "cuda:0")
            .unwrap();
        b.register_memory(gb, (part * threads) as u64, "cuda:1")
            .unwrap();
        std::thread::scope(|s| {
            for t in 0..threads {
                let a = &a;
                s.spawn(move || {
                    let off = (t * part) as u64;
                    for (op, local) in [(Opcode::Write, ga), (Opcode::Read, gback)] {
                        let r = TransferRequest {
                            opcode: op,
                            source: local + off,
                            target_id: seg,
                            target_offset: gb + off,
                            length: part as u64,
                        };
                        let st = a.transfer_sync(&[r], Duration::from_secs(20)).unwrap();
                        assert_eq!(
                            st.status,
                            TaskStatus::Completed,
                            "{mode:?} thread {t} {op:?}: {st:?}"
                        );
                    }
                });
            }
        });
        assert!(
            gpu_read(c, 1, gb, part * threads) == src,
            "{mode:?}: concurrent writes differ"
        );
        assert!(
            gpu_read(c, 0, gback, part * threads) == src,
            "{mode:?}: concurrent reads differ"
        );
        for (e, p) in [(&a, ga), (&a, gback), (&b, gb)] {
            e.unregister_memory(p).unwrap();
        }
    }
}

#[test]
fn failed_gpu_copies_and_freed_gpu_buffers_fail_cleanly() {
    in_child("child_failures", Some(&mock_dir()));
}

#[test]
#[ignore = "run by failed_gpu_copies_and_freed_gpu_buffers_fail_cleanly in a child process"]
fn child_failures() {
    assert!(child());
    let c = gpu::cuda().expect("the mock driver loads");
    let knobs = Knobs::load();
    let a = engine(TransportMode::Tcp);
    let b = engine(TransportMode::Tcp);
    let seg = a.open_segment(b.segment_name()).unwrap();
    let len = (3 << 20) + 1;
    let src = pattern(len, 3);
    let ga = gpu_alloc(c, 0, &src);
    let gb = gpu_alloc(c, 1, &vec![0u8; len]);
    let host = vec![0u8; len];
    a.register_memory(ga, len as u64, "*").unwrap();
    a.register_memory(host.as_ptr() as u64, len as u64, "*")
        .unwrap();
    b.register_memory(gb, len as u64, "*").unwrap();
    let w = |source: u64| {
        vec![TransferRequest {
            opcode: Opcode::Write,
            source,
            target_id: seg,
            target_offset: gb,
            length: len as u64,
        }]
    };
    // The context destroyed under the transfer: every copy fails, the task FAILS, naming it.
    knobs.fail_copies(709);
    for source in [ga, host.as_ptr() as u64] {
        let st = a
            .transfer_sync(&w(source), Duration::from_secs(10))
            .unwrap();
        assert_eq!(st.status, TaskStatus::Failed, "{st:?}");
        if source == ga {
            assert!(
                st.reason
                    .as_deref()
                    .is_some_and(|r| r.contains("CUDA_ERROR_CONTEXT_IS_DESTROYED")),
                "{st:?}"
            );
        }
    }
    knobs.fail_copies(0);
    let st = a.transfer_sync(&w(ga), Duration::from_secs(10)).unwrap();
    assert_eq!(
        st.status,
        TaskStatus::Completed,
        "copies work again: {st:?}"
    );
    assert!(gpu_read(c, 1, gb, len) == src);
    // A GPU buffer freed while still registered: transfers fail, unregister works.
    c.on_device(1, |d| d.mem_free(gb)).unwrap();
    let st = a.transfer_sync(&w(ga), Duration::from_secs(10)).unwrap();
    assert_eq!(st.status, TaskStatus::Failed, "{st:?}");
    c.on_device(0, |d| d.mem_free(ga)).unwrap();
    let st = a.transfer_sync(&w(ga), Duration::from_secs(10)).unwrap();
    assert_eq!(st.status, TaskStatus::Failed, "{st:?}");
    assert!(
        st.reason
            .as_deref()
            .is_some_and(|r| r.contains("CUDA_ERROR_INVALID_VALUE")),
        "{st:?}"
    );
    b.unregister_memory(gb).unwrap();
    a.unregister_memory(ga).unwrap();
    a.unregister_memory(host.as_ptr() as u64).unwrap();
}

#[test]
fn without_a_usable_driver_gpu_locations_fail_clearly_and_nothing_is_touched() {
    // A driver that finds no GPU (first in the library path, so this holds on GPU hosts too).
    in_child(
        "child_no_driver",
        Some(&cuda_mock::build("nodev", &["INIT_RESULT=100", "COUNT=0"])),
    );
    // A driver too old for the memory calls: reported, not a crash.
    in_child(
        "child_no_driver",
        Some(&cuda_mock::build("nomem", &["NO_MEM"])),
    );
    // No libcuda at all (only where the host has none).
    if matches!(
        kvferry::testing::gpu::driver::Driver::load(),
        Err(kvferry::testing::gpu::driver::CudaError::Missing { .. })
    ) {
        in_child("child_no_driver", None);
    }
}

#[test]
#[ignore = "run by without_a_usable_driver_gpu_locations_fail_clearly_and_nothing_is_touched in a child process"]
fn child_no_driver() {
    assert!(child());
    let why = gpu::cuda().err().expect("no usable driver here");
    eprintln!("no usable driver: {why}");
    let a = engine(TransportMode::Tcp);
    let b = engine(TransportMode::Tcp);
    // Host memory registers as before (location "*": no driver asked).
    let src = pattern(65536, 9);
    a.register_memory(src.as_ptr() as u64, src.len() as u64, "*")
        .unwrap();
    assert_eq!(a.registered()[0].gpu, None);
    // The target meant this buffer to be GPU memory: refused, with the cause and the fix.
    let target = vec![0u8; 65536];
    let err = b
        .register_memory(target.as_ptr() as u64, 65536, "cuda:0")
        .unwrap_err()
        .to_string();
    assert!(err.contains("the CUDA driver is not usable here"), "{err}");
    assert!(
        err.contains("install the NVIDIA driver")
            || err.contains("CUDA_VISIBLE_DEVICES")
            || err.contains("too old"),
        "{err}"
    );
    // A transfer into it fails as not registered and touches nothing.
    let seg = a.open_segment(b.segment_name()).unwrap();
    let st = a
        .transfer_sync(
            &[TransferRequest {
                opcode: Opcode::Write,
                source: src.as_ptr() as u64,
                target_id: seg,
                target_offset: target.as_ptr() as u64,
                length: 65536,
            }],
            Duration::from_secs(10),
        )
        .unwrap();
    assert_eq!(st.status, TaskStatus::Failed, "{st:?}");
    assert!(
        target.iter().all(|&x| x == 0),
        "the unregistered buffer was touched"
    );
}

#[test]
fn unregister_of_gpu_memory_is_a_barrier_on_both_sides() {
    in_child("child_unregister_barrier", Some(&mock_dir()));
}

#[test]
#[ignore = "run by unregister_of_gpu_memory_is_a_barrier_on_both_sides in a child process"]
fn child_unregister_barrier() {
    assert!(child());
    let c = gpu::cuda().expect("the mock driver loads");
    let knobs = Knobs::load();
    let len = 64 << 20;
    // The initiator's GPU memory (GPU 0) unregistered mid-WRITE, then the target's (GPU 1).
    // A READ into the initiator's GPU memory too: its host→device copies are queued on a
    // stream and waited for later, and none may run after the unregister returned.
    for (op, target_side) in [
        (Opcode::Write, false),
        (Opcode::Write, true),
        (Opcode::Read, false),
    ] {
        let a = engine(TransportMode::Tcp);
        let b = engine(TransportMode::Tcp);
        let seg = a.open_segment(b.segment_name()).unwrap();
        let ga = gpu_alloc(c, 0, &pattern(len, 1));
        let gb = gpu_alloc(c, 1, &vec![0u8; len]);
        a.register_memory(ga, len as u64, "*").unwrap();
        b.register_memory(gb, len as u64, "*").unwrap();
        let (dev, e, p) = if target_side {
            (1, &b, gb)
        } else {
            (0, &a, ga)
        };
        let before = knobs.copies(dev);
        knobs.copy_delay_us(3000);
        let batch = a.allocate_batch(1).unwrap();
        batch
            .submit(&[TransferRequest {
                opcode: op,
                source: ga,
                target_id: seg,
                target_offset: gb,
                length: len as u64,
            }])
            .unwrap();
        std::thread::sleep(Duration::from_millis(30));
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while knobs.copies(dev) == before && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            knobs.copies(dev) > before,
            "the transfer touched GPU {dev} before the unregister ({op:?})"
        );
        e.unregister_memory(p).unwrap();
        let after = knobs.copies(dev);
        let st = batch.wait(Duration::from_secs(20));
        std::thread::sleep(Duration::from_millis(200));
        knobs.copy_delay_us(0);
        assert_eq!(knobs.copies(dev), after, "GPU {dev} memory was copied after unregister returned ({op:?}, target side {target_side})");
        assert_eq!(
            st.status,
            TaskStatus::Failed,
            "{op:?} target side {target_side}: {st:?}"
        );
        let _ = a.unregister_memory(ga);
        let _ = b.unregister_memory(gb);
    }
}

#[test]
fn initiator_staging_overlaps_its_copies_and_waits_for_each() {
    in_child("child_staging_pipeline", Some(&mock_dir()));
}

/// The initiator's staging pipeline (gpu/stage.rs) queues its copies on streams without
/// waiting, several at once. The mock runs a queued copy only when something waits for it, so
/// a chunk sent before its device→host copy was waited for carries stale bytes, a bounce
/// buffer reused too early lands the wrong chunk, and a READ reported COMPLETED before its
/// last host→device copy was waited for leaves that copy queued and its bytes missing: each
/// shows here (bytes compared, nothing left queued when the task ends).
#[test]
#[ignore = "run by initiator_staging_overlaps_its_copies_and_waits_for_each in a child process"]
fn child_staging_pipeline() {
    assert!(child());
    let c = gpu::cuda().expect("the mock driver loads");
    let knobs = Knobs::load();
    let chunk = gpu::stage::CHUNK;
    // More chunks than the window (every bounce buffer reused), and a short last one.
    let len = (gpu::stage::WINDOW + 2) * chunk + 12345;
    for mode in [TransportMode::Tcp, TransportMode::Auto] {
        let a = engine(mode);
        let b = engine(mode);
        let seg = a.open_segment(b.segment_name()).unwrap();
        let src0 = pattern(len, 21);
        let src1 = pattern(len, 22);
        let g0 = gpu_alloc(c, 0, &src0);
        let g1 = gpu_alloc(c, 1, &vec![0u8; len]);
        let host_a = vec![0u8; len];
        let host_b = src1.clone();
        a.register_memory(g0, len as u64, "*").unwrap();
        a.register_memory(g1, len as u64, "*").unwrap();
        b.register_memory(host_a.as_ptr() as u64, len as u64, "*")
            .unwrap();
        b.register_memory(host_b.as_ptr() as u64, len as u64, "*")
            .unwrap();
        let req = |opcode, source, target_offset| TransferRequest {
            opcode,
            source,
            target_id: seg,
            target_offset,
            length: len as u64,
        };

        // GPU 0 → host: every chunk sent only after its device→host copy was waited for.
        knobs.reset_max_queued();
        let st = a
            .transfer_sync(
                &[req(Opcode::Write, g0, host_a.as_ptr() as u64)],
                Duration::from_secs(20),
            )
            .unwrap();
        assert_eq!(st.status, TaskStatus::Completed, "{mode:?} WRITE {st:?}");
        assert_eq!(
            knobs.queued(),
            0,
            "{mode:?}: a copy is still queued after the WRITE ended"
        );
        assert!(
            host_a == src0,
            "{mode:?}: a chunk was sent before its device→host copy was waited for"
        );
        // The copies overlap: the next one is queued before the previous one is waited for.
        assert!(
            knobs.max_queued() >= 2,
            "{mode:?}: copies ran one at a time (at most {} queued)",
            knobs.max_queued()
        );

        // Host → GPU 1: COMPLETED only once the last host→device copy was waited for.
        let st = a
            .transfer_sync(
                &[req(Opcode::Read, g1, host_b.as_ptr() as u64)],
                Duration::from_secs(20),
            )
            .unwrap();
        assert_eq!(st.status, TaskStatus::Completed, "{mode:?} READ {st:?}");
        assert_eq!(
            knobs.queued(),
            0,
            "{mode:?}: COMPLETED while a host→device copy was still queued"
        );
        assert!(
            gpu_read(c, 1, g1, len) == src1,
            "{mode:?}: read bytes differ (a bounce buffer reused before its copy ran?)"
        );

        // Both directions and both GPUs in one batch: both streams of each GPU busy at once.
        c.htod(1, g1, &vec![0u8; len]).unwrap();
        let g0b = gpu_alloc(c, 0, &vec![0u8; len]);
        a.register_memory(g0b, len as u64, "cuda:0").unwrap();
        let host_c = vec![0u8; len];
        b.register_memory(host_c.as_ptr() as u64, len as u64, "*")
            .unwrap();
        let reqs = [
            req(Opcode::Read, g1, host_b.as_ptr() as u64),
            req(Opcode::Write, g0, host_c.as_ptr() as u64),
            req(Opcode::Read, g0b, host_b.as_ptr() as u64),
        ];
        let st = a.transfer_sync(&reqs, Duration::from_secs(20)).unwrap();
        assert_eq!(st.status, TaskStatus::Completed, "{mode:?} mixed {st:?}");
        assert_eq!(
            knobs.queued(),
            0,
            "{mode:?}: a copy is still queued after the mixed batch ended"
        );
        assert!(
            gpu_read(c, 1, g1, len) == src1 && gpu_read(c, 0, g0b, len) == src1,
            "{mode:?}: mixed batch: read bytes differ"
        );
        assert!(
            host_c == src0,
            "{mode:?}: mixed batch: written bytes differ"
        );
        for p in [g0, g1, g0b] {
            a.unregister_memory(p).unwrap();
        }
        for h in [&host_a, &host_b, &host_c] {
            b.unregister_memory(h.as_ptr() as u64).unwrap();
        }
    }
}

#[test]
fn vmm_mapped_gpu_memory_is_classified_across_its_mappings_and_moves() {
    in_child("child_vmm", Some(&mock_dir()));
}

/// CUDA virtual memory as PyTorch's expandable segments make it (`cuMemAddressReserve`, then
/// physical allocations `cuMemCreate`d and `cuMemMap`ped back to back, `cuMemSetAccess`): the
/// driver reports each mapping as its own range, so a tensor may span several.
struct Vmm {
    reserve: unsafe extern "C" fn(*mut u64, usize, usize, u64, u64) -> i32,
    create: unsafe extern "C" fn(*mut u64, usize, *const [i32; 8], u64) -> i32,
    map: unsafe extern "C" fn(u64, usize, usize, u64, u64) -> i32,
    set_access: unsafe extern "C" fn(u64, usize, *const [i32; 3], usize) -> i32,
    unmap: unsafe extern "C" fn(u64, usize) -> i32,
    release: unsafe extern "C" fn(u64) -> i32,
    free: unsafe extern "C" fn(u64, usize) -> i32,
}

impl Vmm {
    fn load(lib: &libloading::Library) -> Vmm {
        // SAFETY: the driver API's prototypes (cuda.h) for these symbols; the library stays
        // loaded for the whole child.
        unsafe {
            Vmm {
                reserve: *lib.get(b"cuMemAddressReserve\0").unwrap(),
                create: *lib.get(b"cuMemCreate\0").unwrap(),
                map: *lib.get(b"cuMemMap\0").unwrap(),
                set_access: *lib.get(b"cuMemSetAccess\0").unwrap(),
                unmap: *lib.get(b"cuMemUnmap\0").unwrap(),
                release: *lib.get(b"cuMemRelease\0").unwrap(),
                free: *lib.get(b"cuMemAddressFree\0").unwrap(),
            }
        }
    }

    /// Reserves `reserve` bytes and maps one `seg`-byte physical allocation per entry of
    /// `devs` (its GPU) back to back from the start; the base and the handles.
    fn segments(&self, reserve: usize, seg: usize, devs: &[i32]) -> (u64, Vec<u64>) {
        let mut base = 0u64;
        // SAFETY (each call): valid out-pointers and descriptors of cuda.h's layout
        // (CUmemAllocationProp: type, handle types, location {type, id}, ...;
        // CUmemAccessDesc: location {type, id}, flags).
        assert_eq!(unsafe { (self.reserve)(&mut base, reserve, 0, 0, 0) }, 0);
        let mut hs = Vec::new();
        for (i, &dev) in devs.iter().enumerate() {
            let prop = [1, 0, 1, dev, 0, 0, 0, 0];
            let mut h = 0u64;
            assert_eq!(unsafe { (self.create)(&mut h, seg, &prop, 0) }, 0);
            let at = base + (i * seg) as u64;
            assert_eq!(unsafe { (self.map)(at, seg, 0, h, 0) }, 0);
            assert_eq!(unsafe { (self.set_access)(at, seg, &[1, dev, 3], 1) }, 0);
            hs.push(h);
        }
        (base, hs)
    }

    fn drop_segments(&self, base: u64, reserve: usize, seg: usize, hs: &[u64]) {
        for (i, &h) in hs.iter().enumerate() {
            // SAFETY: mappings and handles made by `segments`, unregistered from every engine.
            assert_eq!(unsafe { (self.unmap)(base + (i * seg) as u64, seg) }, 0);
            assert_eq!(unsafe { (self.release)(h) }, 0);
        }
        assert_eq!(unsafe { (self.free)(base, reserve) }, 0);
    }
}

#[test]
#[ignore = "run by vmm_mapped_gpu_memory_is_classified_across_its_mappings_and_moves in a child process"]
fn child_vmm() {
    assert!(child());
    let c = gpu::cuda().expect("the mock driver loads");
    // SAFETY: the library the engine loaded (same soname), kept loaded while used.
    let lib = unsafe { libloading::Library::new("libcuda.so.1") }.unwrap();
    let vmm = Vmm::load(&lib);
    let seg = 2 << 20;
    // Three 2 MiB mappings of GPU 0, one of GPU 1, then 2 MiB reserved but not mapped.
    let reserve = 5 * seg;
    let (base, hs) = vmm.segments(reserve, seg, &[0, 0, 0, 1]);
    let src = pattern(3 * seg, 31);
    c.htod(0, base, &src).unwrap();
    // An interior range across all three GPU-0 mappings (odd offsets: every staging chunk of
    // both sides straddles a mapping boundary somewhere).
    let (off, len) = (4096 + 5, 3 * seg - 8192 - 11);
    let a = engine(TransportMode::Tcp);
    let b = engine(TransportMode::Tcp);
    a.register_memory(base + off as u64, len as u64, "*")
        .unwrap();
    let r = a
        .registered()
        .into_iter()
        .find(|r| r.addr == base + off as u64)
        .unwrap();
    assert_eq!((r.location.as_str(), r.gpu), ("cuda:0", Some(0)));
    // Refused: a range running from GPU 0's mappings into GPU 1's, and one running from a
    // mapping into reserved but unmapped addresses.
    let err = a
        .register_memory(base + (5 * seg / 2) as u64, seg as u64, "*")
        .unwrap_err()
        .to_string();
    assert!(err.contains("spans memory of GPU 0 and GPU 1"), "{err}");
    let err = a
        .register_memory(base + (3 * seg + 4096) as u64, seg as u64, "cuda:1")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("runs past the end of its GPU allocation")
            && err.contains("pass the tensor's size"),
        "{err}"
    );
    // VMM memory has no legacy CUDA IPC handle: exporting it says so.
    let err = gpu::ipc::export(base + off as u64, len as u64).unwrap_err();
    assert!(
        err.contains("CUDA virtual memory") && err.contains("expandable_segments"),
        "{err}"
    );

    // Initiator side: WRITE out of the VMM range, READ back into it.
    let seg_b = a.open_segment(b.segment_name()).unwrap();
    let host = vec![0u8; len];
    b.register_memory(host.as_ptr() as u64, len as u64, "*")
        .unwrap();
    let one = |opcode, source, target_offset| {
        [TransferRequest {
            opcode,
            source,
            target_id: seg_b,
            target_offset,
            length: len as u64,
        }]
    };
    let st = a
        .transfer_sync(
            &one(Opcode::Write, base + off as u64, host.as_ptr() as u64),
            Duration::from_secs(20),
        )
        .unwrap();
    assert_eq!(
        st.status,
        TaskStatus::Completed,
        "WRITE from VMM memory {st:?}"
    );
    assert!(
        host[..] == src[off..off + len],
        "WRITE from VMM memory: bytes differ"
    );
    c.htod(0, base, &vec![0u8; 3 * seg]).unwrap();
    let st = a
        .transfer_sync(
            &one(Opcode::Read, base + off as u64, host.as_ptr() as u64),
            Duration::from_secs(20),
        )
        .unwrap();
    assert_eq!(
        st.status,
        TaskStatus::Completed,
        "READ into VMM memory {st:?}"
    );
    assert!(
        gpu_read(c, 0, base + off as u64, len) == src[off..off + len],
        "READ into VMM memory: bytes differ"
    );

    // Target side: another VMM range of GPU 0 registered by the peer, written and read.
    let (tbase, ths) = vmm.segments(3 * seg, seg, &[0, 0, 0]);
    c.htod(0, tbase, &vec![0u8; 3 * seg]).unwrap();
    b.register_memory(tbase + off as u64, len as u64, "*")
        .unwrap();
    let src2 = pattern(len, 32);
    a.register_memory(src2.as_ptr() as u64, len as u64, "*")
        .unwrap();
    let st = a
        .transfer_sync(
            &one(Opcode::Write, src2.as_ptr() as u64, tbase + off as u64),
            Duration::from_secs(20),
        )
        .unwrap();
    assert_eq!(
        st.status,
        TaskStatus::Completed,
        "WRITE into the peer's VMM memory {st:?}"
    );
    assert!(
        gpu_read(c, 0, tbase + off as u64, len) == src2,
        "WRITE into the peer's VMM memory: bytes differ"
    );
    let back = vec![0u8; len];
    a.register_memory(back.as_ptr() as u64, len as u64, "*")
        .unwrap();
    let st = a
        .transfer_sync(
            &one(Opcode::Read, back.as_ptr() as u64, tbase + off as u64),
            Duration::from_secs(20),
        )
        .unwrap();
    assert_eq!(
        st.status,
        TaskStatus::Completed,
        "READ of the peer's VMM memory {st:?}"
    );
    assert!(back == src2, "READ of the peer's VMM memory: bytes differ");

    for p in [
        base + off as u64,
        src2.as_ptr() as u64,
        back.as_ptr() as u64,
    ] {
        a.unregister_memory(p).unwrap();
    }
    for p in [host.as_ptr() as u64, tbase + off as u64] {
        b.unregister_memory(p).unwrap();
    }
    vmm.drop_segments(base, reserve, seg, &hs);
    vmm.drop_segments(tbase, 3 * seg, seg, &ths);
}

#[test]
fn ipc_handles_share_gpu_memory_with_another_process() {
    in_child("child_ipc_export", Some(&mock_dir()));
}

/// Size of the range a child exports, and where in its allocation it starts.
const IPC_LEN: usize = (1 << 20) + 77;
const IPC_OFF: usize = 4096 + 3;

/// The exporting process: GPU 0 memory exported, opened and rewritten by another process (its
/// own child), every byte checked through the driver on both sides.
#[test]
#[ignore = "run by ipc_handles_share_gpu_memory_with_another_process in a child process"]
fn child_ipc_export() {
    assert!(child());
    let c = gpu::cuda().expect("the mock driver loads");
    let total = IPC_OFF + IPC_LEN + 8192;
    let before = pattern(total, 41);
    let g = gpu_alloc(c, 0, &before);
    // Refused, saying why: host memory, past the allocation's end, and opening one's own.
    let host = vec![0u8; 4096];
    let err = gpu::ipc::export(host.as_ptr() as u64, 4096).unwrap_err();
    assert!(err.contains("not GPU memory"), "{err}");
    let err = gpu::ipc::export(g + total as u64 - 10, 100).unwrap_err();
    assert!(
        err.contains("runs past the end of its GPU allocation"),
        "{err}"
    );
    let e = gpu::ipc::export(g + IPC_OFF as u64, IPC_LEN as u64).unwrap();
    assert_eq!(
        (e.ordinal, e.offset, e.len),
        (0, IPC_OFF as u64, IPC_LEN as u64)
    );
    assert_eq!(gpu::ipc::Export::decode(&e.encode()).unwrap(), e);
    let err = gpu::ipc::open(&e, 0)
        .err()
        .expect("a process cannot open its own handle");
    assert!(err.contains("another process"), "{err}");

    let lib = std::env::var_os("LD_LIBRARY_PATH").expect("the mock's directory");
    in_child_with(
        "child_ipc_import",
        Some(Path::new(&lib)),
        &[("KVF_IPC_EXPORT", &e.encode())],
    );
    let mut want = before.clone();
    want[IPC_OFF..IPC_OFF + IPC_LEN].copy_from_slice(&pattern(IPC_LEN, 42));
    assert!(
        gpu_read(c, 0, g, total) == want,
        "the other process's writes did not land exactly in the exported range"
    );
    c.on_device(0, |d| d.mem_free(g)).unwrap();
}

/// The importing process: opens the export on GPU 1, copies it device to device into its own
/// memory and checks it, then writes new bytes back into it.
#[test]
#[ignore = "run by child_ipc_export in a grandchild process"]
fn child_ipc_import() {
    assert!(child());
    let c = gpu::cuda().expect("the mock driver loads");
    let e = gpu::ipc::Export::decode(&std::env::var("KVF_IPC_EXPORT").unwrap()).unwrap();
    let opened = gpu::ipc::open(&e, 1).unwrap();
    assert_eq!((opened.len(), opened.on()), (IPC_LEN as u64, 1));
    let mine = gpu_alloc(c, 1, &vec![0u8; IPC_LEN]);
    c.dtod(1, mine, opened.addr(), IPC_LEN).unwrap();
    assert!(
        gpu_read(c, 1, mine, IPC_LEN)
            == pattern(IPC_OFF + IPC_LEN + 8192, 41)[IPC_OFF..IPC_OFF + IPC_LEN],
        "bytes read through the handle differ"
    );
    c.htod(1, mine, &pattern(IPC_LEN, 42)).unwrap();
    c.dtod(1, opened.addr(), mine, IPC_LEN).unwrap();
    drop(opened);
    c.on_device(1, |d| d.mem_free(mine)).unwrap();
}

#[test]
fn same_host_gpu_memory_moves_through_cuda_ipc() {
    in_child("child_ipc_target", Some(&mock_dir()));
}

const XFER: usize = (4 << 20) + 123;

/// The target process: GPU 0 memory registered (exported through CUDA IPC in its descriptor);
/// another process (its child) reads it and writes it, through the engine, while this engine
/// serves; then every byte is checked here.
#[test]
#[ignore = "run by same_host_gpu_memory_moves_through_cuda_ipc in a child process"]
fn child_ipc_target() {
    assert!(child());
    let c = gpu::cuda().expect("the mock driver loads");
    let e = engine(TransportMode::Auto);
    let g = gpu_alloc(c, 0, &pattern(XFER, 51));
    e.register_memory(g, XFER as u64, "cuda:0").unwrap();
    let d = e.local_descriptor();
    let gpus = d
        .extra
        .get("kvferry_shm")
        .and_then(|v| v.get("gpus"))
        .and_then(|v| v.as_array())
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        gpus.len(),
        1,
        "the GPU range is exported in the descriptor: {:?}",
        d.extra
    );
    let lib = std::env::var_os("LD_LIBRARY_PATH").expect("the mock's directory");
    in_child_with(
        "child_ipc_initiator",
        Some(Path::new(&lib)),
        &[
            ("KVF_TARGET", e.segment_name()),
            ("KVF_TARGET_GPU", &g.to_string()),
        ],
    );
    let mut want = pattern(XFER, 51);
    want[..XFER - 4096].copy_from_slice(&pattern(XFER - 4096, 52));
    want[XFER - 4096..].copy_from_slice(&pattern(4096, 53));
    assert!(
        gpu_read(c, 0, g, XFER) == want,
        "the other process's WRITEs did not land exactly in this GPU memory"
    );
    // Unregistered, the range leaves the exports.
    e.unregister_memory(g).unwrap();
    assert!(e
        .local_descriptor()
        .extra
        .get("kvferry_shm")
        .and_then(|v| v.get("gpus"))
        .is_none());
    c.on_device(0, |d| d.mem_free(g)).unwrap();
}

/// The initiator process: GPU 1 and host memory of its own; READs and WRITEs against the
/// target's GPU 0 memory, all through CUDA IPC (the byte counter shows nothing went over TCP).
#[test]
#[ignore = "run by child_ipc_target in a grandchild process"]
fn child_ipc_initiator() {
    assert!(child());
    let c = gpu::cuda().expect("the mock driver loads");
    let target = std::env::var("KVF_TARGET").unwrap();
    let tg: u64 = std::env::var("KVF_TARGET_GPU").unwrap().parse().unwrap();
    let e = engine(TransportMode::Auto);
    let mine = gpu_alloc(c, 1, &vec![0u8; XFER]);
    e.register_memory(mine, XFER as u64, "*").unwrap();
    let mut host = vec![0u8; 8192];
    e.register_memory(host.as_ptr() as u64, host.len() as u64, "cpu:0")
        .unwrap();
    let seg = e.open_segment(&target).unwrap();
    assert_eq!(
        e.segment_transport(seg).unwrap().name,
        "shm",
        "a same-host peer"
    );
    let before = kvferry::testing::shm::gpu_ipc_bytes();
    let req = |op: Opcode, local: u64, remote_off: u64, len: usize| TransferRequest {
        opcode: op,
        source: local,
        target_id: seg,
        target_offset: tg + remote_off,
        length: len as u64,
    };
    // GPU <- peer GPU, the whole range.
    let st = e
        .transfer_sync(&[req(Opcode::Read, mine, 0, XFER)], Duration::from_secs(10))
        .unwrap();
    assert_eq!(st.status, TaskStatus::Completed, "{st:?}");
    assert!(
        gpu_read(c, 1, mine, XFER) == pattern(XFER, 51),
        "GPU<-GPU READ through CUDA IPC: bytes differ"
    );
    // Host <- peer GPU, an interior range.
    let st = e
        .transfer_sync(
            &[req(Opcode::Read, host.as_ptr() as u64, 1000, 8192)],
            Duration::from_secs(10),
        )
        .unwrap();
    assert_eq!(st.status, TaskStatus::Completed, "{st:?}");
    assert!(
        host[..] == pattern(XFER, 51)[1000..1000 + 8192],
        "host<-GPU READ through CUDA IPC: bytes differ"
    );
    // GPU -> peer GPU, and host -> peer GPU (its last page), in one batch.
    c.htod(1, mine, &pattern(XFER - 4096, 52)).unwrap();
    // Our own registered Vec, not in any transfer now.
    host[..4096].copy_from_slice(&pattern(4096, 53));
    let st = e
        .transfer_sync(
            &[
                req(Opcode::Write, mine, 0, XFER - 4096),
                req(
                    Opcode::Write,
                    host.as_ptr() as u64,
                    (XFER - 4096) as u64,
                    4096,
                ),
            ],
            Duration::from_secs(10),
        )
        .unwrap();
    assert_eq!(st.status, TaskStatus::Completed, "{st:?}");
    let moved = kvferry::testing::shm::gpu_ipc_bytes() - before;
    assert_eq!(
        moved,
        (XFER + 8192 + XFER) as u64,
        "every byte through CUDA IPC, none over TCP"
    );
    // Outside the exported range: refused, nothing touched.
    let st = e
        .transfer_sync(
            &[req(Opcode::Write, mine, XFER as u64 - 100, 4096)],
            Duration::from_secs(10),
        )
        .unwrap();
    assert_ne!(
        st.status,
        TaskStatus::Completed,
        "a WRITE past the peer's GPU range must fail"
    );
    e.unregister_memory(mine).unwrap();
    e.unregister_memory(host.as_ptr() as u64).unwrap();
    c.on_device(1, |d| d.mem_free(mine)).unwrap();
}

/// A same-host peer of engine `e`, running the ignored test `test` of this binary in a child
/// process (the mock's directory on its library path), told `e`'s segment and GPU buffer `g`.
struct IpcPeer {
    kid: std::process::Child,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
    err: std::thread::JoinHandle<String>,
}

impl IpcPeer {
    fn spawn(test: &str, e: &TransferEngine, g: u64, stdin: bool) -> IpcPeer {
        use std::io::BufRead;
        let lib = std::env::var_os("LD_LIBRARY_PATH").expect("the mock's directory");
        let mut kid = Command::new(std::env::current_exe().unwrap())
            .args([
                test,
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("KVF_GPU_CHILD", "1")
            .env("LD_LIBRARY_PATH", &lib)
            .env("KVF_TARGET", e.segment_name())
            .env("KVF_TARGET_GPU", g.to_string())
            .stdin(if stdin {
                std::process::Stdio::piped()
            } else {
                std::process::Stdio::null()
            })
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut err = kid.stderr.take().unwrap();
        let err = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = std::io::Read::read_to_string(&mut err, &mut s);
            s
        });
        let lines = std::io::BufReader::new(kid.stdout.take().unwrap()).lines();
        IpcPeer { kid, lines, err }
    }

    /// Waits for a line with `marker` (the test harness prints the test's name first, on the
    /// same line); fails with `what` if the peer ends first.
    fn wait_for(&mut self, marker: &str, what: &str) {
        let mut said = Vec::new();
        loop {
            match self.lines.next() {
                Some(Ok(l)) if l.contains(marker) => return,
                Some(Ok(l)) => said.push(l),
                _ => panic!("{what}: {said:?}"),
            }
        }
    }

    /// Reads the rest of its output and checks it succeeded; the lines.
    fn finish(mut self, who: &str) -> Vec<String> {
        let rest: Vec<String> = self.lines.by_ref().map_while(Result::ok).collect();
        assert!(
            self.kid.wait().unwrap().success(),
            "{who} failed: {rest:?}\n{}",
            self.err.join().unwrap_or_default()
        );
        rest
    }
}

#[test]
fn unregister_is_a_barrier_for_a_same_host_peer_copying_through_cuda_ipc() {
    in_child("child_ipc_barrier_target", Some(&mock_dir()));
}

/// The target: its GPU memory unregistered while another process's WRITE copies into it
/// through CUDA IPC (each copy made slow by the mock there). `unregister_memory` must wait for
/// the copy in flight; once it returned, the memory never changes again; a WRITE reported
/// COMPLETED landed.
#[test]
#[ignore = "run by unregister_is_a_barrier_for_a_same_host_peer_copying_through_cuda_ipc in a child process"]
fn child_ipc_barrier_target() {
    assert!(child());
    let c = gpu::cuda().expect("the mock driver loads");
    let e = engine(TransportMode::Auto);
    let len = 1 << 20;
    let g = gpu_alloc(c, 0, &pattern(len, 61));
    e.register_memory(g, len as u64, "cuda:0").unwrap();
    let mut peer = IpcPeer::spawn("child_ipc_barrier_initiator", &e, g, false);
    peer.wait_for("KVF_COPYING", "the initiator ended before copying");
    // The initiator's copy (800 ms in the mock) is in flight now.
    std::thread::sleep(Duration::from_millis(200));
    let t = std::time::Instant::now();
    e.unregister_memory(g).unwrap();
    let waited = t.elapsed();
    let frozen = gpu_read(c, 0, g, len);
    std::thread::sleep(Duration::from_millis(1000));
    assert!(
        gpu_read(c, 0, g, len) == frozen,
        "GPU memory changed after unregister_memory returned"
    );
    let rest = peer.finish("the initiator");
    let status = rest
        .iter()
        .find_map(|l| l.split("KVF_STATUS ").nth(1))
        .expect("the initiator's WRITE status")
        .trim()
        .to_string();
    if status == "Completed" {
        assert!(
            frozen == pattern(len, 62),
            "a WRITE reported COMPLETED did not land before unregister returned"
        );
    }
    assert!(
        waited >= Duration::from_millis(300),
        "unregister returned after {waited:?}, while a copy of 800 ms was in flight ({status})"
    );
    c.on_device(0, |d| d.mem_free(g)).unwrap();
}

/// The initiator: one WRITE into the target's GPU memory through CUDA IPC, its copy slowed
/// to 800 ms by the mock; says when it starts and how it ended.
#[test]
#[ignore = "run by child_ipc_barrier_target in a grandchild process"]
fn child_ipc_barrier_initiator() {
    assert!(child());
    let c = gpu::cuda().expect("the mock driver loads");
    let knobs = Knobs::load();
    let e = engine(TransportMode::Auto);
    let len = 1 << 20;
    let mine = gpu_alloc(c, 1, &pattern(len, 62));
    e.register_memory(mine, len as u64, "*").unwrap();
    let seg = e
        .open_segment(&std::env::var("KVF_TARGET").unwrap())
        .unwrap();
    let tg: u64 = std::env::var("KVF_TARGET_GPU").unwrap().parse().unwrap();
    let before = kvferry::testing::shm::gpu_ipc_bytes();
    knobs.copy_delay_us(800_000);
    println!("KVF_COPYING");
    let st = e
        .transfer_sync(
            &[TransferRequest {
                opcode: Opcode::Write,
                source: mine,
                target_id: seg,
                target_offset: tg,
                length: len as u64,
            }],
            Duration::from_secs(10),
        )
        .unwrap();
    knobs.copy_delay_us(0);
    println!("KVF_STATUS {:?}", st.status);
    assert!(
        st.status != TaskStatus::Completed
            || kvferry::testing::shm::gpu_ipc_bytes() - before == len as u64,
        "a COMPLETED WRITE went through CUDA IPC"
    );
    e.unregister_memory(mine).unwrap();
}

#[test]
fn a_same_host_peers_gpu_memory_is_closed_soon_after_it_unregisters_it() {
    in_child("child_ipc_close_target", Some(&mock_dir()));
}

/// The exporter: its GPU memory read once by another process through CUDA IPC; then it
/// unregisters it and tells the importer, which must close its handle within the reaper's
/// bound without any further transfer to this engine.
#[test]
#[ignore = "run by a_same_host_peers_gpu_memory_is_closed_soon_after_it_unregisters_it in a child process"]
fn child_ipc_close_target() {
    use std::io::Write;
    assert!(child());
    let c = gpu::cuda().expect("the mock driver loads");
    let e = engine(TransportMode::Auto);
    let len = 1 << 20;
    let g = gpu_alloc(c, 0, &pattern(len, 71));
    e.register_memory(g, len as u64, "cuda:0").unwrap();
    let mut peer = IpcPeer::spawn("child_ipc_close_initiator", &e, g, true);
    peer.wait_for("KVF_OPENED", "the importer ended before opening");
    e.unregister_memory(g).unwrap();
    let mut stdin = peer.kid.stdin.take().unwrap();
    writeln!(stdin, "unregistered").unwrap();
    drop(stdin);
    peer.finish("the importer");
    c.on_device(0, |d| d.mem_free(g)).unwrap();
}

/// The importer: reads the exporter's GPU memory (opening it through CUDA IPC), says so, waits
/// until the exporter unregistered it, then counts the handles it holds open: none within
/// [`kvferry::testing::shm::REAP_INTERVAL`] (and the slack a loaded machine needs), with no
/// transfer to that peer meanwhile. Its engine stays alive throughout.
#[test]
#[ignore = "run by child_ipc_close_target in a grandchild process"]
fn child_ipc_close_initiator() {
    assert!(child());
    let c = gpu::cuda().expect("the mock driver loads");
    let knobs = Knobs::load();
    let e = engine(TransportMode::Auto);
    let len = 1 << 20;
    let mine = gpu_alloc(c, 1, &vec![0u8; len]);
    e.register_memory(mine, len as u64, "*").unwrap();
    let seg = e
        .open_segment(&std::env::var("KVF_TARGET").unwrap())
        .unwrap();
    let tg: u64 = std::env::var("KVF_TARGET_GPU").unwrap().parse().unwrap();
    let before = kvferry::testing::shm::gpu_ipc_bytes();
    let st = e
        .transfer_sync(
            &[TransferRequest {
                opcode: Opcode::Read,
                source: mine,
                target_id: seg,
                target_offset: tg,
                length: len as u64,
            }],
            Duration::from_secs(10),
        )
        .unwrap();
    assert_eq!(st.status, TaskStatus::Completed, "{st:?}");
    assert_eq!(
        kvferry::testing::shm::gpu_ipc_bytes() - before,
        len as u64,
        "the READ went through CUDA IPC"
    );
    assert_eq!(knobs.ipc_open(), 1, "the peer's memory is open here");
    println!("KVF_OPENED");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "unregistered", "the exporter's word");
    let t = std::time::Instant::now();
    let bound = kvferry::testing::shm::REAP_INTERVAL + Duration::from_secs(2);
    while knobs.ipc_open() != 0 {
        assert!(
            t.elapsed() < bound,
            "the peer's unregistered GPU memory is still open here after {:?} ({} handle(s))",
            t.elapsed(),
            knobs.ipc_open()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    println!("closed after {:?}", t.elapsed());
    e.unregister_memory(mine).unwrap();
    c.on_device(1, |d| d.mem_free(mine)).unwrap();
}
