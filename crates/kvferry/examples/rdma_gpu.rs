//! GPU memory on RDMA NICs (GPUDirect RDMA) through the engine, run in the Soft-RoCE VM with
//! the tests' mock CUDA driver on `LD_LIBRARY_PATH`: `rdma_gpu 10.99.2.1 MODE`.
//!
//! - `MODE=refused` (mock built with the defaults: GPUs report DMA-BUF support, device
//!   memory the CPU cannot touch; no nvidia_peermem module in the VM): with
//!   `KVFERRY_TRANSPORT=rdma` registering GPU memory fails, and the error names DMA-BUF as the
//!   method tried and why it failed (Soft-RoCE imports no dma-buf); with `KVFERRY_GPU_RDMA=
//!   peermem` forced it fails with the kernel's "Bad address" and the missing module named.
//! - `MODE=direct` (mock built with `HOST_VISIBLE`: device pointers are pages a NIC can
//!   register, as nvidia-peermem makes them; `KVFERRY_GPU_RDMA=peermem`): two engines with
//!   `KVFERRY_TRANSPORT=rdma` register GPU memory on the NICs, WRITE and READ GPU→GPU, and
//!   every byte is compared through the driver; the mock's copy counter shows the driver
//!   copied nothing during the transfers (no staging: the NIC moved the bytes).
//!
//! Exits non-zero on any failure.

use kvferry::GpuRdma;
use kvferry::TransportMode;
use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest};
use std::process::ExitCode;
use std::time::Duration;

type Res<T> = Result<T, String>;

const SIZE: usize = 8 << 20;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let host = args.get(1).cloned().unwrap_or_else(|| "10.99.2.1".into());
    let r = match args.get(2).map(String::as_str) {
        Some("refused") => refused(&host),
        Some("direct") => direct(&host),
        other => Err(format!("MODE must be refused or direct, not {other:?}")),
    };
    match r {
        Ok(()) => {
            println!("rdma_gpu: all checks passed");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("rdma_gpu: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

fn cfg(host: &str, gpu_rdma: GpuRdma) -> Config {
    Config {
        local_hostname: host.into(),
        transport: TransportMode::Rdma,
        transfer_timeout: Duration::from_secs(20),
        gpu_rdma,
        ..Config::default()
    }
}

fn cuda() -> Res<&'static kvferry::testing::gpu::Cuda> {
    kvferry::testing::gpu::cuda()
        .map_err(|why| format!("the mock CUDA driver is not loaded (LD_LIBRARY_PATH?): {why}"))
}

fn refused(host: &str) -> Res<()> {
    let cuda = cuda()?;
    let p = cuda
        .on_device(0, |d| d.mem_alloc(SIZE))
        .map_err(|e| e.to_string())?;
    let e = TransferEngine::new(cfg(host, GpuRdma::Auto)).map_err(|e| e.to_string())?;
    let err = match e.register_memory(p, SIZE as u64, "cuda:0") {
        Ok(()) => return Err("GPU memory registered on Soft-RoCE with DMA-BUF: rxe imports no dma-buf, so this cannot be".into()),
        Err(err) => err.to_string(),
    };
    println!("rdma_gpu: auto: {err}");
    if !(err.contains("tried DMA-BUF") && err.contains("ibv_reg_dmabuf_mr") && err.contains("rxe"))
    {
        return Err(format!("the auto registration error does not name DMA-BUF, ibv_reg_dmabuf_mr and the NIC: {err}"));
    }
    if !e.registered().is_empty() {
        return Err("a refused registration left a range registered".into());
    }
    drop(e);
    let e = TransferEngine::new(cfg(host, GpuRdma::PeerMem)).map_err(|e| e.to_string())?;
    let err = match e.register_memory(p, SIZE as u64, "cuda:0") {
        Ok(()) => {
            return Err("device memory the CPU cannot map registered with plain ibv_reg_mr".into())
        }
        Err(err) => err.to_string(),
    };
    println!("rdma_gpu: peermem: {err}");
    if !(err.contains("tried nvidia-peermem")
        && err.contains("nvidia_peermem kernel module is not loaded"))
    {
        return Err(format!(
            "the peermem registration error does not name the missing module: {err}"
        ));
    }
    println!("rdma_gpu: GPU memory refused by Soft-RoCE with DMA-BUF and without nvidia-peermem, each saying why");
    Ok(())
}

/// The mock's count of copies that touched GPU `dev`'s memory (`mock_cuda_copies`).
fn mock_copies(dev: i32) -> Res<i64> {
    // SAFETY: the already loaded mock libcuda.so.1 (dlopen returns the same handle);
    // mock_cuda_copies(int) -> long reads a counter.
    unsafe {
        let lib = libloading::Library::new("libcuda.so.1").map_err(|e| e.to_string())?;
        let f = lib
            .get::<unsafe extern "C" fn(i32) -> i64>(b"mock_cuda_copies\0")
            .map_err(|e| format!("not the tests' mock driver: {e}"))?;
        Ok(f(dev))
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) ^ (i >> 12) as u8)
        .collect()
}

fn direct(host: &str) -> Res<()> {
    let cuda = cuda()?;
    let alloc = || {
        cuda.on_device(0, |d| d.mem_alloc(SIZE))
            .map_err(|e| e.to_string())
    };
    let (ga, gb) = (alloc()?, alloc()?);
    let a = TransferEngine::new(cfg(host, GpuRdma::PeerMem)).map_err(|e| e.to_string())?;
    let b = TransferEngine::new(cfg(host, GpuRdma::PeerMem)).map_err(|e| e.to_string())?;
    a.register_memory(ga, SIZE as u64, "cuda:0")
        .map_err(|e| format!("registering GPU memory with KVFERRY_GPU_RDMA=peermem: {e}"))?;
    b.register_memory(gb, SIZE as u64, "*")
        .map_err(|e| format!("registering GPU memory (*): {e}"))?;
    let peer = a
        .open_segment(b.segment_name())
        .map_err(|e| e.to_string())?;
    let desc = a.segment_descriptor(peer).map_err(|e| e.to_string())?;
    let buf = desc
        .buffers
        .iter()
        .find(|x| x.addr == gb)
        .ok_or("the peer's descriptor lacks its GPU buffer")?;
    if buf.name != "cuda:0" || buf.rkey.len() != desc.devices.len() || buf.rkey.is_empty() {
        return Err(format!(
            "the peer's GPU buffer is published as {:?} with {} rkeys for {} devices",
            buf.name,
            buf.rkey.len(),
            desc.devices.len()
        ));
    }
    let want = pattern(SIZE, 7);
    cuda.htod(0, ga, &want).map_err(|e| e.to_string())?;
    cuda.htod(0, gb, &vec![0u8; SIZE])
        .map_err(|e| e.to_string())?;
    let before = mock_copies(0)?;
    let req = |op: Opcode, off: u64, len: u64| TransferRequest {
        opcode: op,
        source: ga + off,
        target_id: peer,
        target_offset: gb + off,
        length: len,
    };
    // WRITE GPU -> GPU: a whole buffer and a batch of 64 KiB pieces.
    let st = a
        .transfer_sync(
            &[req(Opcode::Write, 0, SIZE as u64)],
            Duration::from_secs(60),
        )
        .map_err(|e| e.to_string())?;
    if st.status != TaskStatus::Completed {
        return Err(format!("GPU->GPU WRITE of {SIZE} B ended {:?}", st.status));
    }
    let copies = mock_copies(0)? - before;
    let mut got = vec![0u8; SIZE];
    cuda.dtoh(0, &mut got, gb).map_err(|e| e.to_string())?;
    if got != want {
        return Err("GPU->GPU WRITE over RDMA: the bytes in the peer's GPU memory differ".into());
    }
    if copies != 0 {
        return Err(format!("the driver copied GPU memory {copies} times during the WRITE: it was staged, not moved by the NIC"));
    }
    println!(
        "rdma_gpu: WRITE {SIZE} B GPU->GPU over RDMA verified, 0 driver copies (the NIC moved it)"
    );
    // READ GPU <- GPU: new bytes at the peer, read into ours in 64 KiB requests.
    let back = pattern(SIZE, 91);
    cuda.htod(0, gb, &back).map_err(|e| e.to_string())?;
    let before = mock_copies(0)?;
    let reqs: Vec<TransferRequest> = (0..SIZE as u64 / (64 << 10))
        .map(|i| req(Opcode::Read, i * (64 << 10), 64 << 10))
        .collect();
    let st = a
        .transfer_sync(&reqs, Duration::from_secs(60))
        .map_err(|e| e.to_string())?;
    if st.status != TaskStatus::Completed {
        return Err(format!(
            "a batch of {} GPU<-GPU READs of 64 KiB ended {:?}",
            reqs.len(),
            st.status
        ));
    }
    let copies = mock_copies(0)? - before;
    cuda.dtoh(0, &mut got, ga).map_err(|e| e.to_string())?;
    if got != back {
        return Err("GPU<-GPU READ over RDMA: the bytes in our GPU memory differ".into());
    }
    if copies != 0 {
        return Err(format!(
            "the driver copied GPU memory {copies} times during the READs: they were staged"
        ));
    }
    println!(
        "rdma_gpu: a batch of {} READs of 64 KiB GPU<-GPU over RDMA verified, 0 driver copies",
        reqs.len()
    );
    // Unregister is still a barrier, and the NICs forget the range: a WRITE to it now fails.
    b.unregister_memory(gb).map_err(|e| e.to_string())?;
    let st = a
        .transfer_sync(&[req(Opcode::Write, 0, 4096)], Duration::from_secs(20))
        .map_err(|e| e.to_string())?;
    if st.status == TaskStatus::Completed {
        return Err("a WRITE into GPU memory the peer unregistered completed".into());
    }
    println!(
        "rdma_gpu: a WRITE into GPU memory the peer unregistered ended {:?}",
        st.status
    );
    Ok(())
}
