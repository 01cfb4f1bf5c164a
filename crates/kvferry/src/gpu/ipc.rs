//! GPU memory shared between processes of one host with CUDA IPC handles, for same-host
//! GPU→GPU transfers. A process [`export`]s a registered range of
//! its GPU memory (a `cuMemAlloc` allocation's handle, the range's offset in it and length);
//! another process [`open`]s it on one of its GPUs and copies device to device
//! ([`Cuda::dtod`](super::Cuda::dtod)), over NVLink where the GPUs have it.
//!
//! The shared-memory transport publishes the exports in its descriptor field and copies
//! same-host peers' GPU memory through them (`transport/shm/gpu.rs`). CUDA virtual memory
//! (`cuMemCreate`, PyTorch's expandable segments) has no legacy IPC handle: exporting it is
//! refused, saying so (such memory then moves over TCP).

use super::{cuda, Cuda};
use crate::sys::cuda::{IpcMemHandle, Pointer};

/// What another process of this host needs to reach `[addr, addr+len)` of this process's GPU
/// memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Export {
    /// The handle of the allocation holding the range.
    pub handle: IpcMemHandle,
    /// The GPU whose memory it is.
    pub ordinal: u32,
    /// The range's offset in the allocation.
    pub offset: u64,
    pub len: u64,
}

impl Export {
    /// A printable form (`<handle hex>:<gpu>:<offset>:<len>`), e.g. for a descriptor.
    pub fn encode(&self) -> String {
        let hex: String = self.handle.0.iter().map(|b| format!("{b:02x}")).collect();
        format!("{hex}:{}:{}:{}", self.ordinal, self.offset, self.len)
    }

    /// Parses [`Export::encode`]'s form.
    pub fn decode(s: &str) -> Result<Export, String> {
        let bad =
            || format!("not a CUDA IPC export (<128 hex digits>:<gpu>:<offset>:<len>): {s:?}");
        let mut parts = s.split(':');
        let (Some(hex), Some(gpu), Some(off), Some(len), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return Err(bad());
        };
        if hex.len() != 128 || !hex.is_ascii() {
            return Err(bad());
        }
        let mut handle = [0u8; 64];
        for (i, b) in handle.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(Export {
            handle: IpcMemHandle(handle),
            ordinal: gpu.parse().map_err(|_| bad())?,
            offset: off.parse().map_err(|_| bad())?,
            len: len.parse().map_err(|_| bad())?,
        })
    }
}

/// Exports `[addr, addr+len)` of this process's GPU memory for another process of this host.
pub fn export(addr: u64, len: u64) -> Result<Export, String> {
    let cuda =
        cuda().map_err(|why| format!("cannot export [0x{addr:x}, +{len}) with CUDA IPC: {why}"))?;
    let d = cuda.driver();
    let what = |e: crate::sys::cuda::CudaError| {
        format!("cannot export [0x{addr:x}, +{len}) with CUDA IPC: {e}")
    };
    let Pointer::Device {
        ordinal,
        base,
        size,
    } = d.classify(addr).map_err(what)?
    else {
        return Err(format!("cannot export [0x{addr:x}, +{len}) with CUDA IPC: it is not GPU memory (host memory is shared through kvferry's shared-memory path instead)"));
    };
    if d.is_vmm(addr) {
        return Err(format!(
            "cannot export [0x{addr:x}, +{len}) with CUDA IPC: it is CUDA virtual memory (cuMemCreate/cuMemMap, e.g. PyTorch's expandable_segments), which has no legacy IPC handle; \
             allocate it without expandable segments (PYTORCH_CUDA_ALLOC_CONF) for same-host GPU transfers, or let it go over TCP"
        ));
    }
    if addr
        .checked_add(len)
        .is_none_or(|end| end > base.saturating_add(size))
    {
        return Err(format!("cannot export [0x{addr:x}, +{len}) with CUDA IPC: it runs past the end of its GPU allocation [0x{base:x}, +{size})"));
    }
    let handle = cuda.on_device(ordinal, |d| d.ipc_get(base)).map_err(what)?;
    Ok(Export {
        handle,
        ordinal,
        offset: addr - base,
        len,
    })
}

/// Another process's GPU memory, opened here; closed when dropped.
pub struct Opened {
    cuda: &'static Cuda,
    on: u32,
    base: u64,
    offset: u64,
    len: u64,
}

impl Opened {
    /// The exported range's address in this process (a device address: reach it only
    /// through the driver's copies).
    pub fn addr(&self) -> u64 {
        self.base + self.offset
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The GPU whose context it was opened in.
    pub fn on(&self) -> u32 {
        self.on
    }
}

impl Drop for Opened {
    fn drop(&mut self) {
        let base = self.base;
        // SAFETY: opened by `open`; every copy of it is synchronous, so none is queued, and
        // nothing uses the address after the value is gone.
        if let Err(e) = self
            .cuda
            .on_device(self.on, |d| unsafe { d.ipc_close(base) })
        {
            tracing::warn!("closing GPU memory opened with CUDA IPC at 0x{base:x}: {e}");
        }
    }
}

/// Opens `e` (exported by another process of this host) in GPU `on`'s context (peer access to
/// the exporter's GPU enabled when it is another one).
pub fn open(e: &Export, on: u32) -> Result<Opened, String> {
    let cuda = cuda()
        .map_err(|why| format!("cannot open GPU memory of another process (CUDA IPC): {why}"))?;
    let base = cuda.on_device(on, |d| d.ipc_open(e.handle)).map_err(|err| {
        format!(
            "cannot open GPU {} memory of another process (CUDA IPC) on GPU {on}: {err}; a handle opens only in another process of the same host (and container IPC namespace), \
             while its exporter lives and keeps the allocation",
            e.ordinal
        )
    })?;
    Ok(Opened {
        cuda,
        on,
        base,
        offset: e.offset,
        len: e.len,
    })
}
