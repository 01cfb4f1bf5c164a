//! `libcuda.so.1` loaded at run time (through `libloading`): a table of the driver-API entry
//! points used so far, each resolved once, and every failure an error that says what is
//! missing and what to do. Nothing links CUDA at build time: one build serves CUDA 12, CUDA 13
//! and hosts without a GPU.

use libloading::Library;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

/// The driver's soname (stable across CUDA 12 and 13 drivers).
pub(crate) const LIBRARY: &str = "libcuda.so.1";

/// Why the CUDA driver cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("{path} cannot be loaded ({why}): no NVIDIA driver on this host, so GPU memory cannot be registered (CPU memory and every CPU transport work); install the NVIDIA driver (libcuda comes with it, not with the CUDA toolkit) or, in a container, run with the NVIDIA container toolkit (--gpus all)")]
    Missing { path: String, why: String },
    #[error("{path} has no symbol {symbol} ({why}): the NVIDIA driver is too old (CUDA 11.4 or newer needed)")]
    Symbol {
        path: String,
        symbol: &'static str,
        why: String,
    },
    #[error("{call} failed with CUDA error {code} ({name}): {fix}")]
    Call {
        call: &'static str,
        code: i32,
        name: &'static str,
        fix: &'static str,
    },
}

type CuInit = unsafe extern "C" fn(c_uint) -> c_int;
type CuDriverGetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
type CuDeviceGetCount = unsafe extern "C" fn(*mut c_int) -> c_int;
type CuDeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
type CuDeviceGetName = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
type CuDeviceTotalMem = unsafe extern "C" fn(*mut usize, c_int) -> c_int;
type CuDeviceGetAttribute = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int;
type CuDeviceGetPciBusId = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
type CuDevicePrimaryCtxRetain = unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int;
type CuCtxPushCurrent = unsafe extern "C" fn(*mut c_void) -> c_int;
type CuCtxPopCurrent = unsafe extern "C" fn(*mut *mut c_void) -> c_int;
type CuPointerGetAttribute = unsafe extern "C" fn(*mut c_void, c_int, u64) -> c_int;
type CuMemAlloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
type CuMemFree = unsafe extern "C" fn(u64) -> c_int;
type CuMemcpyDtoH = unsafe extern "C" fn(*mut c_void, u64, usize) -> c_int;
type CuMemcpyHtoD = unsafe extern "C" fn(u64, *const c_void, usize) -> c_int;
type CuMemHostAlloc = unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> c_int;
type CuMemFreeHost = unsafe extern "C" fn(*mut c_void) -> c_int;
type CuStreamCreate = unsafe extern "C" fn(*mut *mut c_void, c_uint) -> c_int;
type CuHandle = unsafe extern "C" fn(*mut c_void) -> c_int;
type CuMemcpyDtoHAsync = unsafe extern "C" fn(*mut c_void, u64, usize, *mut c_void) -> c_int;
type CuMemcpyHtoDAsync = unsafe extern "C" fn(u64, *const c_void, usize, *mut c_void) -> c_int;
type CuEventCreate = unsafe extern "C" fn(*mut *mut c_void, c_uint) -> c_int;
type CuEventRecord = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;
type CuMemRetainAllocationHandle = unsafe extern "C" fn(*mut u64, *mut c_void) -> c_int;
type CuMemRelease = unsafe extern "C" fn(u64) -> c_int;
type CuIpcGetMemHandle = unsafe extern "C" fn(*mut IpcMemHandle, u64) -> c_int;
type CuIpcOpenMemHandle = unsafe extern "C" fn(*mut u64, IpcMemHandle, c_uint) -> c_int;
type CuIpcCloseMemHandle = unsafe extern "C" fn(u64) -> c_int;
type CuMemcpyDtoD = unsafe extern "C" fn(u64, u64, usize) -> c_int;
type CuMemGetHandleForAddressRange =
    unsafe extern "C" fn(*mut c_void, u64, usize, c_int, u64) -> c_int;

/// `CUipcMemHandle`: an opaque 64-byte name for a `cuMemAlloc` allocation that another
/// process on the same host can open.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcMemHandle(pub [u8; 64]);

/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`: open memory of another GPU with peer access enabled.
const IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;

/// The CUDA IPC entry points and the device-to-device copy (same-host GPU→GPU).
#[derive(Clone, Copy)]
struct IpcApi {
    get: CuIpcGetMemHandle,
    open: CuIpcOpenMemHandle,
    close: CuIpcCloseMemHandle,
    dtod: CuMemcpyDtoD,
}

const ATTR_CC_MAJOR: c_int = 75;
const ATTR_CC_MINOR: c_int = 76;
/// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`: the device can export its memory as a dma-buf.
const ATTR_DMA_BUF_SUPPORTED: c_int = 124;
/// `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`.
const RANGE_HANDLE_DMA_BUF_FD: c_int = 1;

/// The name and the fix of the CUDA errors the calls here can return.
fn explain(code: i32) -> (&'static str, &'static str) {
    match code {
        1 => ("CUDA_ERROR_INVALID_VALUE", "an address or size the driver does not know (not GPU memory, or outside its allocation; freed?)"),
        2 => ("CUDA_ERROR_OUT_OF_MEMORY", "the GPU or pinned host memory is exhausted"),
        3 => ("CUDA_ERROR_NOT_INITIALIZED", "cuInit was not called or failed"),
        34 => ("CUDA_ERROR_STUB_LIBRARY", "a CUDA stub libcuda.so is found before the driver's: remove the stubs directory from LD_LIBRARY_PATH"),
        35 => ("CUDA_ERROR_INSUFFICIENT_DRIVER", "the driver is older than this CUDA runtime expects: update the NVIDIA driver"),
        100 => ("CUDA_ERROR_NO_DEVICE", "no GPU is visible: check CUDA_VISIBLE_DEVICES and that the container has the GPUs (--gpus all)"),
        101 => ("CUDA_ERROR_INVALID_DEVICE", "a device index is out of range"),
        201 => ("CUDA_ERROR_INVALID_CONTEXT", "no CUDA context is current on this thread (a bug in kvferry: report it)"),
        400 => ("CUDA_ERROR_INVALID_HANDLE", "a handle the driver does not know (a destroyed context or stream)"),
        700 => ("CUDA_ERROR_ILLEGAL_ADDRESS", "the GPU hit an illegal address; the CUDA context is unusable: restart the process"),
        709 => ("CUDA_ERROR_CONTEXT_IS_DESTROYED", "the CUDA context was destroyed under the transfer"),
        304 => ("CUDA_ERROR_OPERATING_SYSTEM", "the driver cannot talk to the kernel module: is nvidia.ko loaded (nvidia-smi)?"),
        999 => ("CUDA_ERROR_UNKNOWN", "the driver is in a bad state (nvidia-smi shows it); a reboot or driver reload may be needed"),
        _ => ("CUDA error", "see the CUDA driver API documentation for this code"),
    }
}

fn check(call: &'static str, code: c_int) -> Result<(), CudaError> {
    if code == 0 {
        return Ok(());
    }
    let (name, fix) = explain(code);
    Err(CudaError::Call {
        call,
        code,
        name,
        fix,
    })
}

/// The loaded driver (initialised) and its entry points (valid while `_lib` lives).
pub struct Driver {
    _lib: Library,
    driver_get_version: CuDriverGetVersion,
    device_get_count: CuDeviceGetCount,
    device_get: CuDeviceGet,
    device_get_name: CuDeviceGetName,
    device_total_mem: CuDeviceTotalMem,
    device_get_attribute: CuDeviceGetAttribute,
    device_get_pci_bus_id: CuDeviceGetPciBusId,
    /// The memory entry points: all present, or why not (the first missing symbol).
    mem: Result<MemApi, CudaError>,
    /// `cuMemRetainAllocationHandle` and `cuMemRelease` (virtual memory management, CUDA
    /// 10.2+), which tell memory mapped with `cuMemMap` apart; `None` if the driver lacks them.
    vmm: Option<(CuMemRetainAllocationHandle, CuMemRelease)>,
    /// CUDA IPC (`cuIpcGetMemHandle`, `cuIpcOpenMemHandle_v2`, `cuIpcCloseMemHandle`) and
    /// `cuMemcpyDtoD_v2`, or the first missing symbol.
    ipc: Result<IpcApi, CudaError>,
    /// `cuMemGetHandleForAddressRange` (CUDA 11.7+ drivers): GPU memory as a dma-buf file
    /// descriptor, which RDMA NICs register without nvidia-peermem; `None` if absent.
    dmabuf: Option<CuMemGetHandleForAddressRange>,
}

/// The entry points that classify, allocate and copy memory (driver API since CUDA 11.x).
#[derive(Clone, Copy)]
struct MemApi {
    primary_ctx_retain: CuDevicePrimaryCtxRetain,
    ctx_push: CuCtxPushCurrent,
    ctx_pop: CuCtxPopCurrent,
    pointer_get_attribute: CuPointerGetAttribute,
    mem_alloc: CuMemAlloc,
    mem_free: CuMemFree,
    dtoh: CuMemcpyDtoH,
    htod: CuMemcpyHtoD,
    host_alloc: CuMemHostAlloc,
    free_host: CuMemFreeHost,
    stream_create: CuStreamCreate,
    stream_destroy: CuHandle,
    stream_sync: CuHandle,
    dtoh_async: CuMemcpyDtoHAsync,
    htod_async: CuMemcpyHtoDAsync,
    event_create: CuEventCreate,
    event_record: CuEventRecord,
    event_sync: CuHandle,
    event_destroy: CuHandle,
}

/// What the driver says about an address ([`Driver::classify`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pointer {
    /// Host memory: unknown to the driver (plain `malloc`/`mmap`), pinned, or managed
    /// (CPU-accessible): the CPU may touch it directly.
    Host,
    /// Device memory of GPU `ordinal`, inside the allocation `[base, base+size)`.
    Device { ordinal: u32, base: u64, size: u64 },
}

// cuda.h: CUpointer_attribute and CUmemorytype values.
const PA_MEMORY_TYPE: c_int = 2;
const PA_IS_MANAGED: c_int = 8;
const PA_DEVICE_ORDINAL: c_int = 9;
const PA_RANGE_START_ADDR: c_int = 11;
const PA_RANGE_SIZE: c_int = 12;
const MEMORYTYPE_DEVICE: u32 = 2;
const CUDA_ERROR_INVALID_VALUE: c_int = 1;
/// `CU_MEMHOSTALLOC_PORTABLE`: pinned for every context.
const MEMHOSTALLOC_PORTABLE: c_uint = 1;

impl Driver {
    /// Loads [`LIBRARY`] and initialises it (`cuInit(0)`).
    pub fn load() -> Result<Driver, CudaError> {
        Driver::load_from(LIBRARY)
    }

    /// Loads and initialises the driver library at `path` (a soname or a file).
    pub fn load_from(path: &str) -> Result<Driver, CudaError> {
        // SAFETY: loading the NVIDIA driver library runs its constructors only.
        let lib = unsafe { Library::new(path) }.map_err(|e| CudaError::Missing {
            path: path.into(),
            why: e.to_string(),
        })?;
        let sym = |symbol: &'static str, e: libloading::Error| CudaError::Symbol {
            path: path.into(),
            symbol,
            why: e.to_string(),
        };
        // SAFETY: the types are the driver API's prototypes (cuda.h) for these symbols; the
        // `_v2` names are the ones cuda.h maps the plain names to since CUDA 3.2.
        unsafe {
            let init = *lib
                .get::<CuInit>(b"cuInit\0")
                .map_err(|e| sym("cuInit", e))?;
            check("cuInit", init(0))?;
            let mem = (|| -> Result<MemApi, CudaError> {
                Ok(MemApi {
                    primary_ctx_retain: *lib
                        .get(b"cuDevicePrimaryCtxRetain\0")
                        .map_err(|e| sym("cuDevicePrimaryCtxRetain", e))?,
                    ctx_push: *lib
                        .get(b"cuCtxPushCurrent_v2\0")
                        .map_err(|e| sym("cuCtxPushCurrent_v2", e))?,
                    ctx_pop: *lib
                        .get(b"cuCtxPopCurrent_v2\0")
                        .map_err(|e| sym("cuCtxPopCurrent_v2", e))?,
                    pointer_get_attribute: *lib
                        .get(b"cuPointerGetAttribute\0")
                        .map_err(|e| sym("cuPointerGetAttribute", e))?,
                    mem_alloc: *lib
                        .get(b"cuMemAlloc_v2\0")
                        .map_err(|e| sym("cuMemAlloc_v2", e))?,
                    mem_free: *lib
                        .get(b"cuMemFree_v2\0")
                        .map_err(|e| sym("cuMemFree_v2", e))?,
                    dtoh: *lib
                        .get(b"cuMemcpyDtoH_v2\0")
                        .map_err(|e| sym("cuMemcpyDtoH_v2", e))?,
                    htod: *lib
                        .get(b"cuMemcpyHtoD_v2\0")
                        .map_err(|e| sym("cuMemcpyHtoD_v2", e))?,
                    host_alloc: *lib
                        .get(b"cuMemHostAlloc\0")
                        .map_err(|e| sym("cuMemHostAlloc", e))?,
                    free_host: *lib
                        .get(b"cuMemFreeHost\0")
                        .map_err(|e| sym("cuMemFreeHost", e))?,
                    stream_create: *lib
                        .get(b"cuStreamCreate\0")
                        .map_err(|e| sym("cuStreamCreate", e))?,
                    stream_destroy: *lib
                        .get(b"cuStreamDestroy_v2\0")
                        .map_err(|e| sym("cuStreamDestroy_v2", e))?,
                    stream_sync: *lib
                        .get(b"cuStreamSynchronize\0")
                        .map_err(|e| sym("cuStreamSynchronize", e))?,
                    dtoh_async: *lib
                        .get(b"cuMemcpyDtoHAsync_v2\0")
                        .map_err(|e| sym("cuMemcpyDtoHAsync_v2", e))?,
                    htod_async: *lib
                        .get(b"cuMemcpyHtoDAsync_v2\0")
                        .map_err(|e| sym("cuMemcpyHtoDAsync_v2", e))?,
                    event_create: *lib
                        .get(b"cuEventCreate\0")
                        .map_err(|e| sym("cuEventCreate", e))?,
                    event_record: *lib
                        .get(b"cuEventRecord\0")
                        .map_err(|e| sym("cuEventRecord", e))?,
                    event_sync: *lib
                        .get(b"cuEventSynchronize\0")
                        .map_err(|e| sym("cuEventSynchronize", e))?,
                    event_destroy: *lib
                        .get(b"cuEventDestroy_v2\0")
                        .map_err(|e| sym("cuEventDestroy_v2", e))?,
                })
            })();
            let vmm = match (
                lib.get::<CuMemRetainAllocationHandle>(b"cuMemRetainAllocationHandle\0"),
                lib.get::<CuMemRelease>(b"cuMemRelease\0"),
            ) {
                (Ok(retain), Ok(release)) => Some((*retain, *release)),
                _ => None,
            };
            let ipc = (|| -> Result<IpcApi, CudaError> {
                Ok(IpcApi {
                    get: *lib
                        .get(b"cuIpcGetMemHandle\0")
                        .map_err(|e| sym("cuIpcGetMemHandle", e))?,
                    open: *lib
                        .get(b"cuIpcOpenMemHandle_v2\0")
                        .map_err(|e| sym("cuIpcOpenMemHandle_v2", e))?,
                    close: *lib
                        .get(b"cuIpcCloseMemHandle\0")
                        .map_err(|e| sym("cuIpcCloseMemHandle", e))?,
                    dtod: *lib
                        .get(b"cuMemcpyDtoD_v2\0")
                        .map_err(|e| sym("cuMemcpyDtoD_v2", e))?,
                })
            })();
            let dmabuf = lib
                .get::<CuMemGetHandleForAddressRange>(b"cuMemGetHandleForAddressRange\0")
                .ok()
                .map(|f| *f);
            Ok(Driver {
                vmm,
                ipc,
                dmabuf,
                driver_get_version: *lib
                    .get(b"cuDriverGetVersion\0")
                    .map_err(|e| sym("cuDriverGetVersion", e))?,
                device_get_count: *lib
                    .get(b"cuDeviceGetCount\0")
                    .map_err(|e| sym("cuDeviceGetCount", e))?,
                device_get: *lib
                    .get(b"cuDeviceGet\0")
                    .map_err(|e| sym("cuDeviceGet", e))?,
                device_get_name: *lib
                    .get(b"cuDeviceGetName\0")
                    .map_err(|e| sym("cuDeviceGetName", e))?,
                device_total_mem: *lib
                    .get(b"cuDeviceTotalMem_v2\0")
                    .map_err(|e| sym("cuDeviceTotalMem_v2", e))?,
                device_get_attribute: *lib
                    .get(b"cuDeviceGetAttribute\0")
                    .map_err(|e| sym("cuDeviceGetAttribute", e))?,
                device_get_pci_bus_id: *lib
                    .get(b"cuDeviceGetPCIBusId\0")
                    .map_err(|e| sym("cuDeviceGetPCIBusId", e))?,
                mem,
                _lib: lib,
            })
        }
    }

    /// The CUDA version the driver supports, e.g. 12040 for 12.4.
    pub fn version(&self) -> Result<i32, CudaError> {
        let mut v = 0;
        // SAFETY: a valid out-pointer.
        check("cuDriverGetVersion", unsafe {
            (self.driver_get_version)(&mut v)
        })?;
        Ok(v)
    }

    /// Every GPU the driver shows this process.
    pub fn devices(&self) -> Result<Vec<crate::gpu::Gpu>, CudaError> {
        let mut n = 0;
        // SAFETY: valid out-pointers and buffers of the sizes passed, for every call below.
        unsafe {
            check("cuDeviceGetCount", (self.device_get_count)(&mut n))?;
            let mut out = Vec::with_capacity(n.max(0) as usize);
            for i in 0..n.max(0) {
                let mut dev = 0;
                check("cuDeviceGet", (self.device_get)(&mut dev, i))?;
                let mut name = [0 as c_char; 256];
                check(
                    "cuDeviceGetName",
                    (self.device_get_name)(name.as_mut_ptr(), name.len() as c_int - 1, dev),
                )?;
                let mut bus = [0 as c_char; 64];
                check(
                    "cuDeviceGetPCIBusId",
                    (self.device_get_pci_bus_id)(bus.as_mut_ptr(), bus.len() as c_int - 1, dev),
                )?;
                let mut mem = 0usize;
                check("cuDeviceTotalMem", (self.device_total_mem)(&mut mem, dev))?;
                let (mut major, mut minor) = (0, 0);
                check(
                    "cuDeviceGetAttribute",
                    (self.device_get_attribute)(&mut major, ATTR_CC_MAJOR, dev),
                )?;
                check(
                    "cuDeviceGetAttribute",
                    (self.device_get_attribute)(&mut minor, ATTR_CC_MINOR, dev),
                )?;
                out.push(crate::gpu::Gpu {
                    index: i as u32,
                    name: CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned(),
                    memory: mem as u64,
                    pci_bus_id: CStr::from_ptr(bus.as_ptr()).to_string_lossy().into_owned(),
                    compute_capability: (major, minor),
                });
            }
            Ok(out)
        }
    }
}

/// A device's primary context (retained for the life of the process, as PyTorch does).
#[derive(Clone, Copy)]
pub struct Context(*mut c_void);
// SAFETY: a CUcontext is a handle the driver lets any thread make current.
unsafe impl Send for Context {}
unsafe impl Sync for Context {}

impl Driver {
    fn mem(&self) -> Result<&MemApi, CudaError> {
        self.mem.as_ref().map_err(|e| match e {
            CudaError::Symbol { path, symbol, why } => CudaError::Symbol {
                path: path.clone(),
                symbol,
                why: why.clone(),
            },
            other => CudaError::Missing {
                path: LIBRARY.into(),
                why: other.to_string(),
            },
        })
    }

    /// Why GPU memory cannot be classified or copied with this driver (a missing entry point),
    /// or `None` when it can.
    pub fn memory_unavailable(&self) -> Option<String> {
        self.mem.as_ref().err().map(|e| e.to_string())
    }

    /// Retains the primary context of GPU `ordinal` (the one PyTorch and the CUDA runtime use).
    pub fn primary_context(&self, ordinal: u32) -> Result<Context, CudaError> {
        let m = self.mem()?;
        let mut dev = 0;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: valid out-pointers.
        unsafe {
            check("cuDeviceGet", (self.device_get)(&mut dev, ordinal as c_int))?;
            check(
                "cuDevicePrimaryCtxRetain",
                (m.primary_ctx_retain)(&mut ctx, dev),
            )?;
        }
        Ok(Context(ctx))
    }

    /// Runs `f` with `ctx` current on this thread, then restores what was current (the
    /// caller's thread may be PyTorch's: its context is left as it was).
    pub fn with_context<T>(
        &self,
        ctx: Context,
        f: impl FnOnce(&Self) -> Result<T, CudaError>,
    ) -> Result<T, CudaError> {
        let m = self.mem()?;
        // SAFETY: a context retained by `primary_context`; push/pop are balanced.
        check("cuCtxPushCurrent", unsafe { (m.ctx_push)(ctx.0) })?;
        let r = f(self);
        let mut popped = std::ptr::null_mut();
        // SAFETY: pops what was pushed above.
        let p = check("cuCtxPopCurrent", unsafe { (m.ctx_pop)(&mut popped) });
        let out = r?;
        p?;
        Ok(out)
    }

    /// Whether `addr` is device memory and, if so, of which GPU and which allocation (its base
    /// and size: interior pointers, as PyTorch's caching allocator hands out, are answered
    /// with the whole allocation). Memory the driver does not know is host memory (the
    /// driver answers CUDA_ERROR_INVALID_VALUE for it).
    pub fn classify(&self, addr: u64) -> Result<Pointer, CudaError> {
        let m = self.mem()?;
        let get = |attr: c_int| -> Result<Option<u64>, CudaError> {
            let mut v = 0u64;
            // SAFETY: every attribute asked here is at most 8 bytes; `v` is 8 bytes, zeroed.
            match unsafe { (m.pointer_get_attribute)((&mut v as *mut u64).cast(), attr, addr) } {
                CUDA_ERROR_INVALID_VALUE => Ok(None),
                code => check("cuPointerGetAttribute", code).map(|()| Some(v)),
            }
        };
        // MEMORY_TYPE is a 4-byte enum: only the low half of `v` was written (little endian).
        match get(PA_MEMORY_TYPE)? {
            Some(t) if t as u32 == MEMORYTYPE_DEVICE => {}
            _ => return Ok(Pointer::Host),
        }
        if get(PA_IS_MANAGED)?.is_some_and(|v| v as u32 != 0) {
            return Ok(Pointer::Host);
        }
        let missing = |what| CudaError::Call {
            call: "cuPointerGetAttribute",
            code: 1,
            name: "CUDA_ERROR_INVALID_VALUE",
            fix: what,
        };
        let ordinal = get(PA_DEVICE_ORDINAL)?.ok_or(missing(
            "the driver gave no device ordinal for device memory",
        ))? as u32;
        let base = get(PA_RANGE_START_ADDR)?.ok_or(missing(
            "the driver gave no allocation start for device memory",
        ))?;
        let size = get(PA_RANGE_SIZE)?.ok_or(missing(
            "the driver gave no allocation size for device memory",
        ))?;
        Ok(Pointer::Device {
            ordinal,
            base,
            size,
        })
    }

    /// Whether `addr` lies in memory mapped with CUDA's virtual memory management
    /// (`cuMemCreate` + `cuMemMap`, as PyTorch's expandable segments allocate): the driver
    /// reports each physical allocation mapped into a reserved range as its own range, so a
    /// tensor may span several. `false` for `cuMemAlloc` memory, unknown memory, or a driver
    /// without the entry points.
    pub fn is_vmm(&self, addr: u64) -> bool {
        let Some((retain, release)) = self.vmm else {
            return false;
        };
        let mut h = 0u64;
        // SAFETY: a valid out-pointer; the driver only looks the address up (it fails for
        // memory that is not VMM-mapped). A retained handle is released at once.
        unsafe {
            if retain(&mut h, addr as *mut c_void) != 0 {
                return false;
            }
            let _ = release(h);
        }
        true
    }

    fn ipc(&self) -> Result<&IpcApi, CudaError> {
        self.ipc.as_ref().map_err(|e| match e {
            CudaError::Symbol { path, symbol, why } => CudaError::Symbol {
                path: path.clone(),
                symbol,
                why: why.clone(),
            },
            other => CudaError::Missing {
                path: LIBRARY.into(),
                why: other.to_string(),
            },
        })
    }

    /// The IPC handle of the `cuMemAlloc` allocation holding device address `p` (the whole
    /// allocation: its opener gets the allocation's base).
    pub fn ipc_get(&self, p: u64) -> Result<IpcMemHandle, CudaError> {
        let mut h = IpcMemHandle([0; 64]);
        // SAFETY: a valid out-pointer of the handle's size; the driver checks `p`.
        check("cuIpcGetMemHandle", unsafe { (self.ipc()?.get)(&mut h, p) })?;
        Ok(h)
    }

    /// Opens another process's allocation in the current context; its base address here.
    pub fn ipc_open(&self, h: IpcMemHandle) -> Result<u64, CudaError> {
        let mut p = 0u64;
        // SAFETY: a valid out-pointer; the handle is passed by value as cuda.h declares.
        check("cuIpcOpenMemHandle", unsafe {
            (self.ipc()?.open)(&mut p, h, IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        })?;
        Ok(p)
    }

    /// Closes memory opened with [`Driver::ipc_open`].
    ///
    /// # Safety
    /// `p` came from [`Driver::ipc_open`], no copy into or out of it is queued, and it is not
    /// used after.
    pub unsafe fn ipc_close(&self, p: u64) -> Result<(), CudaError> {
        check("cuIpcCloseMemHandle", (self.ipc()?.close)(p))
    }

    /// Copies `len` bytes between device addresses and waits until they landed (a context
    /// current; the two may be memory of different GPUs: unified addressing routes the copy,
    /// over NVLink where there is one).
    pub fn dtod(&self, dst: u64, src: u64, len: usize) -> Result<(), CudaError> {
        // SAFETY: device addresses only; the driver checks both ranges.
        check("cuMemcpyDtoD", unsafe { (self.ipc()?.dtod)(dst, src, len) })?;
        // "No host-side synchronization is performed" for a device-to-device copy: it is only
        // queued. A transfer is complete when its bytes landed, and a same-host peer's
        // unregister waits only for copies in flight, so it is waited for here.
        self.sync_legacy()
    }

    /// Waits until everything queued on the legacy default stream (the synchronous copies')
    /// is done.
    fn sync_legacy(&self) -> Result<(), CudaError> {
        // SAFETY: the null stream is the current context's legacy default stream.
        check("cuStreamSynchronize", unsafe {
            (self.mem()?.stream_sync)(std::ptr::null_mut())
        })
    }

    /// Whether GPU `ordinal` can export its memory as a dma-buf: the driver has
    /// `cuMemGetHandleForAddressRange` and the device reports `DMA_BUF_SUPPORTED` (the open
    /// kernel module flavour, a recent enough driver); else why not.
    pub fn dmabuf_support(&self, ordinal: u32) -> Result<(), String> {
        if self.dmabuf.is_none() {
            return Err("the CUDA driver has no cuMemGetHandleForAddressRange (a driver for CUDA 11.7 or newer has it)".into());
        }
        let mut v = 0;
        // SAFETY: a valid out-pointer; the driver checks the ordinal.
        match check("cuDeviceGetAttribute", unsafe { (self.device_get_attribute)(&mut v, ATTR_DMA_BUF_SUPPORTED, ordinal as c_int) }) {
            Ok(()) if v != 0 => Ok(()),
            Ok(()) => Err(format!("GPU {ordinal} reports DMA_BUF_SUPPORTED = 0 (the NVIDIA open kernel modules, driver 515 or newer, and a kernel with dma-buf support are needed)")),
            Err(e) => Err(format!("GPU {ordinal}: DMA_BUF_SUPPORTED cannot be read: {e}")),
        }
    }

    /// The allocation `[base, base+size)` of device memory as a dma-buf file descriptor
    /// (`cuMemGetHandleForAddressRange`; a context of its GPU current). `base` and `size`
    /// must cover the allocation (as [`Driver::classify`] reports it), rounded out to whole pages.
    pub fn dmabuf_fd(&self, base: u64, size: u64) -> Result<std::os::fd::OwnedFd, CudaError> {
        let f = self.dmabuf.ok_or_else(|| CudaError::Symbol {
            path: LIBRARY.into(),
            symbol: "cuMemGetHandleForAddressRange",
            why: "not exported: DMA-BUF needs a driver for CUDA 11.7 or newer".into(),
        })?;
        let mut fd: c_int = -1;
        // SAFETY: the handle of type DMA_BUF_FD is an int written through the out-pointer; the
        // driver checks the range.
        check("cuMemGetHandleForAddressRange", unsafe {
            f(
                (&mut fd as *mut c_int).cast(),
                base,
                size as usize,
                RANGE_HANDLE_DMA_BUF_FD,
                0,
            )
        })?;
        if fd < 0 {
            return Err(CudaError::Call {
                call: "cuMemGetHandleForAddressRange",
                code: 1,
                name: "CUDA_ERROR_INVALID_VALUE",
                fix: "the driver returned no file descriptor",
            });
        }
        // SAFETY: a new descriptor the driver just opened for us; we own it from here.
        Ok(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
    }

    /// Allocates `len` bytes of device memory in the current context (`cuMemAlloc`).
    pub fn mem_alloc(&self, len: usize) -> Result<u64, CudaError> {
        let mut p = 0u64;
        // SAFETY: a valid out-pointer.
        check("cuMemAlloc", unsafe {
            (self.mem()?.mem_alloc)(&mut p, len)
        })?;
        Ok(p)
    }

    /// Frees device memory from [`Driver::mem_alloc`].
    pub fn mem_free(&self, p: u64) -> Result<(), CudaError> {
        // SAFETY: the driver checks the pointer.
        check("cuMemFree", unsafe { (self.mem()?.mem_free)(p) })
    }

    /// Copies `dst.len()` bytes from device address `src` (synchronous; a context current).
    pub fn dtoh(&self, dst: &mut [u8], src: u64) -> Result<(), CudaError> {
        // SAFETY: `dst` is writable host memory of that length; the driver checks `src`.
        check("cuMemcpyDtoH", unsafe {
            (self.mem()?.dtoh)(dst.as_mut_ptr().cast(), src, dst.len())
        })
    }

    /// Copies `src` to device address `dst` and waits until the bytes landed (a context
    /// current).
    pub fn htod(&self, dst: u64, src: &[u8]) -> Result<(), CudaError> {
        // SAFETY: `src` is readable host memory of that length; the driver checks `dst`.
        check("cuMemcpyHtoD", unsafe {
            (self.mem()?.htod)(dst, src.as_ptr().cast(), src.len())
        })?;
        // From pageable memory the call returns once the bytes are staged: "the DMA to final
        // destination may not have completed".
        self.sync_legacy()
    }

    /// Pinned host memory (`cuMemHostAlloc`, portable), for bounce buffers.
    pub fn host_alloc(&self, len: usize) -> Result<*mut u8, CudaError> {
        let mut p = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        check("cuMemHostAlloc", unsafe {
            (self.mem()?.host_alloc)(&mut p, len, MEMHOSTALLOC_PORTABLE)
        })?;
        Ok(p.cast())
    }

    /// Frees memory from [`Driver::host_alloc`].
    ///
    /// # Safety
    /// `p` came from [`Driver::host_alloc`] and is not used after.
    pub unsafe fn free_host(&self, p: *mut u8) -> Result<(), CudaError> {
        check("cuMemFreeHost", (self.mem()?.free_host)(p.cast()))
    }
}

/// A CUDA stream or event handle (valid in the context it was created in).
#[derive(Clone, Copy, Debug)]
pub struct Handle(*mut c_void);
// SAFETY: stream and event handles may be used from any thread with their context current.
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

/// `CU_STREAM_NON_BLOCKING`: no implicit synchronisation with the legacy default stream.
const STREAM_NON_BLOCKING: c_uint = 1;
/// `CU_EVENT_DISABLE_TIMING`: the cheapest event.
const EVENT_DISABLE_TIMING: c_uint = 2;

impl Driver {
    /// A stream of the current context.
    pub fn stream_create(&self) -> Result<Handle, CudaError> {
        let mut h = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        check("cuStreamCreate", unsafe {
            (self.mem()?.stream_create)(&mut h, STREAM_NON_BLOCKING)
        })?;
        Ok(Handle(h))
    }

    /// Destroys a stream (its work completes first).
    pub fn stream_destroy(&self, s: Handle) -> Result<(), CudaError> {
        // SAFETY: a stream from `stream_create`, not used after.
        check("cuStreamDestroy", unsafe {
            (self.mem()?.stream_destroy)(s.0)
        })
    }

    /// Waits until everything queued on `s` is done.
    pub fn stream_sync(&self, s: Handle) -> Result<(), CudaError> {
        // SAFETY: a live stream.
        check("cuStreamSynchronize", unsafe {
            (self.mem()?.stream_sync)(s.0)
        })
    }

    /// Queues a device→host copy on `s`.
    ///
    /// # Safety
    /// `dst` must stay valid and untouched by anyone else until the copy is waited for.
    pub unsafe fn dtoh_async(
        &self,
        dst: *mut u8,
        src: u64,
        len: usize,
        s: Handle,
    ) -> Result<(), CudaError> {
        check(
            "cuMemcpyDtoHAsync",
            (self.mem()?.dtoh_async)(dst.cast(), src, len, s.0),
        )
    }

    /// Queues a host→device copy on `s`.
    ///
    /// # Safety
    /// `src` must stay valid and unchanged until the copy is waited for.
    pub unsafe fn htod_async(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
        s: Handle,
    ) -> Result<(), CudaError> {
        check(
            "cuMemcpyHtoDAsync",
            (self.mem()?.htod_async)(dst, src.cast(), len, s.0),
        )
    }

    /// An event of the current context.
    pub fn event_create(&self) -> Result<Handle, CudaError> {
        let mut h = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        check("cuEventCreate", unsafe {
            (self.mem()?.event_create)(&mut h, EVENT_DISABLE_TIMING)
        })?;
        Ok(Handle(h))
    }

    /// Marks `e` done once everything queued on `s` so far is.
    pub fn event_record(&self, e: Handle, s: Handle) -> Result<(), CudaError> {
        // SAFETY: live handles of the current context.
        check("cuEventRecord", unsafe {
            (self.mem()?.event_record)(e.0, s.0)
        })
    }

    /// Waits for `e`.
    pub fn event_sync(&self, e: Handle) -> Result<(), CudaError> {
        // SAFETY: a live event.
        check("cuEventSynchronize", unsafe {
            (self.mem()?.event_sync)(e.0)
        })
    }

    /// Destroys an event.
    pub fn event_destroy(&self, e: Handle) -> Result<(), CudaError> {
        // SAFETY: an event from `event_create`, not used after.
        check("cuEventDestroy", unsafe {
            (self.mem()?.event_destroy)(e.0)
        })
    }
}
