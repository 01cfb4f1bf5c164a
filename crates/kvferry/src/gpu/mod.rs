//! GPUs on this host, through the CUDA driver loaded at run time (issue 13).
//!
//! Only `libcuda.so.1` — the driver API, whose soname and ABI are the same under CUDA 12 and
//! CUDA 13 drivers — is ever loaded, with `dlopen` when asked; never `libcudart`. A host
//! without a driver runs every CPU path and is told why GPU memory cannot be used. This module
//! reports the driver and the devices ([`probe`]), classifies registered memory
//! ([`classify`]), and stages GPU memory through host buffers ([`Bounce`], [`Pipe`],
//! [`stage`]); [`ipc`] shares it with other processes of the host; [`direct`] decides how RDMA
//! NICs register it (GPUDirect RDMA: DMA-BUF or nvidia-peermem).

use serde::Serialize;

/// One GPU as the driver describes it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Gpu {
    pub index: u32,
    pub name: String,
    /// Device memory in bytes.
    pub memory: u64,
    /// PCI bus id, e.g. `0000:17:00.0`.
    pub pci_bus_id: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
}

/// What the driver says, or why there is no usable driver.
#[derive(Debug, Clone, Serialize)]
pub struct Probe {
    /// The driver's CUDA version (e.g. 12040 for 12.4), when it loaded.
    pub driver_version: Option<i32>,
    pub gpus: Vec<Gpu>,
    /// Why GPU memory cannot be used here (and what to do); `None` when it can.
    pub unavailable: Option<String>,
}

/// Probes this host's CUDA driver.
pub fn probe() -> Probe {
    probe_with(driver::Driver::load())
}

/// Probes through an already loaded (or failed) driver.
pub fn probe_with(d: Result<driver::Driver, driver::CudaError>) -> Probe {
    let d = match d {
        Ok(d) => d,
        Err(e) => {
            return Probe {
                driver_version: None,
                gpus: Vec::new(),
                unavailable: Some(e.to_string()),
            }
        }
    };
    let version = d.version().ok();
    match d.devices() {
        Ok(gpus) if gpus.is_empty() => Probe { driver_version: version, gpus, unavailable: Some("the CUDA driver lists no GPU (CUDA_VISIBLE_DEVICES empty, or no device visible in this container)".into()) },
        Ok(gpus) => Probe { driver_version: version, gpus, unavailable: None },
        Err(e) => Probe { driver_version: version, gpus: Vec::new(), unavailable: Some(e.to_string()) },
    }
}

pub(crate) mod direct;
pub(crate) mod ipc;
pub(crate) mod stage;

use crate::error::{Error, Result};
use crate::sys::cuda::{self as driver, Context, CudaError, Driver, Pointer};
use std::sync::{Mutex, OnceLock};

/// The process's CUDA driver, loaded once at first use (a host without one pays one failed
/// `dlopen`, once; every later question is a cached answer).
pub struct Cuda {
    driver: Driver,
    /// Primary contexts retained so far, by device ordinal.
    contexts: Mutex<Vec<Option<Context>>>,
}

static CUDA: OnceLock<std::result::Result<Cuda, String>> = OnceLock::new();

/// The CUDA driver of this process, or why there is none usable for GPU memory (the reason
/// names the cause and the fix).
pub fn cuda() -> std::result::Result<&'static Cuda, &'static str> {
    let r = CUDA.get_or_init(|| {
        let d = Driver::load().map_err(|e| e.to_string())?;
        if let Some(why) = d.memory_unavailable() {
            return Err(why);
        }
        Ok(Cuda {
            driver: d,
            contexts: Mutex::new(Vec::new()),
        })
    });
    r.as_ref().map_err(|e| e.as_str())
}

/// Whether this process's CUDA driver has what staging GPU memory needs, or why not (the
/// reason names the cause and the fix): what staging checks, without the driver itself.
pub fn cuda_ready() -> std::result::Result<(), &'static str> {
    cuda().map(|_| ())
}

impl Cuda {
    pub fn driver(&self) -> &Driver {
        &self.driver
    }

    fn context(&self, ordinal: u32) -> std::result::Result<Context, CudaError> {
        let mut c = self.contexts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(Some(ctx)) = c.get(ordinal as usize) {
            return Ok(*ctx);
        }
        let ctx = self.driver.primary_context(ordinal)?;
        if c.len() <= ordinal as usize {
            c.resize(ordinal as usize + 1, None);
        }
        c[ordinal as usize] = Some(ctx);
        Ok(ctx)
    }

    /// Runs `f` with GPU `ordinal`'s primary context current (the caller's context restored).
    pub fn on_device<T>(
        &self,
        ordinal: u32,
        f: impl FnOnce(&Driver) -> std::result::Result<T, CudaError>,
    ) -> std::result::Result<T, CudaError> {
        let ctx = self.context(ordinal)?;
        self.driver.with_context(ctx, f)
    }

    /// Copies `dst.len()` bytes from device address `src` of GPU `ordinal`.
    pub fn dtoh(
        &self,
        ordinal: u32,
        dst: &mut [u8],
        src: u64,
    ) -> std::result::Result<(), CudaError> {
        self.on_device(ordinal, |d| d.dtoh(dst, src))
    }

    /// Copies `src` to device address `dst` of GPU `ordinal`.
    pub fn htod(&self, ordinal: u32, dst: u64, src: &[u8]) -> std::result::Result<(), CudaError> {
        self.on_device(ordinal, |d| d.htod(dst, src))
    }

    /// Copies `len` bytes from device address `src` to device address `dst` with GPU
    /// `ordinal`'s context current (either may be another GPU's memory, e.g. opened with
    /// [`ipc::open`]).
    pub fn dtod(
        &self,
        ordinal: u32,
        dst: u64,
        src: u64,
        len: usize,
    ) -> std::result::Result<(), CudaError> {
        self.on_device(ordinal, |d| d.dtod(dst, src, len))
    }
}

/// Host memory to stage GPU bytes in: pinned by the driver when it can, else plain heap.
pub(crate) struct Bounce {
    ptr: *mut u8,
    len: usize,
    pinned: bool,
    heap: Vec<u8>,
}

// SAFETY: the buffer is owned memory; moving it between threads moves the ownership.
unsafe impl Send for Bounce {}

impl Bounce {
    /// `len` bytes, pinned if the driver allows it.
    pub(crate) fn new(cuda: &Cuda, len: usize) -> Bounce {
        match cuda.driver.host_alloc(len) {
            Ok(ptr) if !ptr.is_null() => Bounce {
                ptr,
                len,
                pinned: true,
                heap: Vec::new(),
            },
            _ => {
                let mut heap = vec![0u8; len];
                Bounce {
                    ptr: heap.as_mut_ptr(),
                    len,
                    pinned: false,
                    heap,
                }
            }
        }
    }

    pub(crate) fn addr(&self) -> u64 {
        self.ptr as u64
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes owned by this value.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes owned by this value, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Bounce {
    fn drop(&mut self) {
        if self.pinned {
            if let Ok(c) = cuda() {
                // SAFETY: allocated by `host_alloc` in `new`, not used after.
                let _ = unsafe { c.driver.free_host(self.ptr) };
            }
        }
        let _ = &self.heap;
    }
}

/// What registering `[addr, addr+len)` with `location` publishes: the location (`cuda:N` for
/// device memory found by the driver) and the GPU, if any.
///
/// `cpu:N` and Mooncake's other device prefixes are taken as given, without asking anything.
/// `*` asks the driver only when one loaded (a host without one: host memory, at the cost of
/// a cached check). `cuda:N` needs the driver: without one it fails, naming the cause and the
/// fix. Device memory must lie inside one allocation (its base and size come from the driver,
/// so interior pointers are fine) or, for CUDA virtual memory (`cuMemMap`), inside physical
/// allocations mapped back to back on the same GPU; and, for `cuda:N`, on GPU N.
pub(crate) fn classify(addr: u64, len: u64, location: &str) -> Result<(String, Option<u32>)> {
    let wanted = match location.strip_prefix("cuda:") {
        Some(n) => Some(n.parse::<u32>().map_err(|_| {
            Error::InvalidArgument(format!(
                "location {location:?}: the GPU index must be a number, e.g. \"cuda:0\""
            ))
        })?),
        None if location == "*" => None,
        None => return Ok((location.to_string(), None)),
    };
    let cuda = match (cuda(), wanted) {
        (Ok(c), _) => c,
        (Err(_), None) => return Ok((location.to_string(), None)),
        (Err(why), Some(_)) => {
            return Err(Error::InvalidArgument(format!("cannot register [0x{addr:x}, +{len}) as GPU memory ({location}): the CUDA driver is not usable here: {why}")))
        }
    };
    let bad = |e: CudaError| {
        Error::InvalidArgument(format!("cannot register [0x{addr:x}, +{len}) ({location}): asking the CUDA driver what memory it is failed: {e}"))
    };
    match cuda.driver.classify(addr).map_err(bad)? {
        // The driver says host memory: the CPU may touch it, whatever the label says.
        Pointer::Host => Ok((location.to_string(), None)),
        Pointer::Device {
            ordinal,
            base,
            size,
        } => {
            if let Some(n) = wanted {
                if n != ordinal {
                    return Err(Error::InvalidArgument(format!("cannot register [0x{addr:x}, +{len}) as {location}: it is memory of GPU {ordinal}; pass \"cuda:{ordinal}\" or \"*\"")));
                }
            }
            let end = addr.checked_add(len).ok_or_else(|| Error::InvalidArgument(format!("cannot register [0x{addr:x}, +{len}): the range wraps around the address space")))?;
            let past = |at: u64| {
                Error::InvalidArgument(format!(
                    "cannot register [0x{addr:x}, +{len}): it runs past the end of its GPU allocation [0x{base:x}, +{size}) (its GPU {ordinal} memory ends at 0x{at:x}); pass the tensor's size"
                ))
            };
            // CUDA virtual memory (cuMemCreate + cuMemMap, PyTorch's expandable segments):
            // physical allocations mapped side by side in one reserved range, each reported
            // as its own range; a registration may span several. Walk them: each must be
            // VMM-mapped memory of the same GPU starting exactly where the previous ended.
            let mut covered = base.saturating_add(size);
            let vmm = covered < end && cuda.driver.is_vmm(addr);
            while covered < end {
                if !vmm || !cuda.driver.is_vmm(covered) {
                    return Err(past(covered));
                }
                match cuda.driver.classify(covered).map_err(bad)? {
                    Pointer::Device { ordinal: o, base: b, size: s } if o == ordinal && b == covered && s > 0 => covered = b.saturating_add(s),
                    Pointer::Device { ordinal: o, .. } if o != ordinal => {
                        return Err(Error::InvalidArgument(format!(
                            "cannot register [0x{addr:x}, +{len}): it spans memory of GPU {ordinal} and GPU {o} (at 0x{covered:x}); register each GPU's part on its own"
                        )))
                    }
                    _ => return Err(past(covered)),
                }
            }
            Ok((format!("cuda:{ordinal}"), Some(ordinal)))
        }
    }
}

/// Double-buffered staging on one GPU (the TCP server's, one per connection): a pinned buffer
/// of two halves, a stream, and one event per half recording the last copy into or out of it.
/// While one half is copied to or from the GPU, the other is received into or sent from.
pub(crate) struct Pipe {
    cuda: &'static Cuda,
    dev: u32,
    half: usize,
    bounce: Bounce,
    stream: driver::Handle,
    events: [driver::Handle; 2],
    /// A copy into or out of this half is queued and not yet waited for.
    pending: [bool; 2],
}

// SAFETY: the handles are usable from any thread with their context current (every call
// below makes it so); the buffer is owned.
unsafe impl Send for Pipe {}

impl Pipe {
    /// A pipe of two halves of `half` bytes on GPU `dev`.
    pub(crate) fn new(dev: u32, half: usize) -> std::result::Result<Pipe, String> {
        let cuda = cuda().map_err(str::to_string)?;
        let (stream, events) = cuda
            .on_device(dev, |d| {
                let s = d.stream_create()?;
                let e0 = d.event_create()?;
                let e1 = d.event_create()?;
                Ok((s, [e0, e1]))
            })
            .map_err(|e| format!("creating a CUDA stream on GPU {dev}: {e}"))?;
        Ok(Pipe {
            cuda,
            dev,
            half,
            bounce: Bounce::new(cuda, 2 * half),
            stream,
            events,
            pending: [false; 2],
        })
    }

    pub(crate) fn dev(&self) -> u32 {
        self.dev
    }

    /// Waits until no copy into or out of half `h` is pending.
    pub(crate) fn wait(&mut self, h: usize) -> std::result::Result<(), CudaError> {
        if self.pending[h] {
            let e = self.events[h];
            self.cuda.on_device(self.dev, |d| d.event_sync(e))?;
            self.pending[h] = false;
        }
        Ok(())
    }

    /// Half `h` (to be touched only after [`Pipe::wait`] for it).
    pub(crate) fn half(&self, h: usize) -> &[u8] {
        &self.bounce.as_slice()[h * self.half..(h + 1) * self.half]
    }

    /// Half `h`, to receive into (only after [`Pipe::wait`] for it).
    pub(crate) fn half_mut(&mut self, h: usize) -> &mut [u8] {
        let n = self.half;
        &mut self.bounce.as_mut_slice()[h * n..(h + 1) * n]
    }

    /// Queues the copy of the first `n` bytes of half `h` to device address `dst`.
    pub(crate) fn htod(
        &mut self,
        h: usize,
        dst: u64,
        n: usize,
    ) -> std::result::Result<(), CudaError> {
        let n = n.min(self.half);
        let src = self.half(h).as_ptr();
        // SAFETY: half `h` is not touched again before `wait(h)` (or `sync`), which every
        // user of the pipe calls before reusing it; the buffer lives as long as the pipe, and
        // the pipe's drop waits for the stream.
        self.queue(h, |d, s| unsafe { d.htod_async(dst, src, n, s) })
    }

    /// Queues `copy` on the pipe's stream, then half `h`'s event after it. The half is
    /// pending once the copy is queued, even if recording its event then fails: `sync` and
    /// the drop must still wait for it before the half or the request's range is let go.
    fn queue(
        &mut self,
        h: usize,
        copy: impl FnOnce(&Driver, driver::Handle) -> std::result::Result<(), CudaError>,
    ) -> std::result::Result<(), CudaError> {
        let (s, e) = (self.stream, self.events[h]);
        let mut queued = false;
        let r = self.cuda.on_device(self.dev, |d| {
            copy(d, s)?;
            queued = true;
            d.event_record(e, s)
        });
        self.pending[h] |= queued;
        r
    }

    /// Queues the copy of `n` bytes at device address `src` into half `h`.
    pub(crate) fn dtoh(
        &mut self,
        h: usize,
        src: u64,
        n: usize,
    ) -> std::result::Result<(), CudaError> {
        let n = n.min(self.half);
        let dst = self.half_mut(h).as_mut_ptr();
        // SAFETY: as in `htod`: half `h` is read only after `wait(h)`.
        self.queue(h, |d, s| unsafe { d.dtoh_async(dst, src, n, s) })
    }

    /// Waits until every queued copy is done.
    pub(crate) fn sync(&mut self) -> std::result::Result<(), CudaError> {
        if self.pending != [false; 2] {
            let s = self.stream;
            let r = self.cuda.on_device(self.dev, |d| d.stream_sync(s));
            self.pending = [false; 2];
            r?;
        }
        Ok(())
    }
}

impl Drop for Pipe {
    fn drop(&mut self) {
        let _ = self.sync();
        let (s, e) = (self.stream, self.events);
        let _ = self.cuda.on_device(self.dev, |d| {
            let _ = d.event_destroy(e[0]);
            let _ = d.event_destroy(e[1]);
            d.stream_destroy(s)
        });
    }
}
