//! `libcuda.so.1` loaded at run time (through `libloading`): a table of the driver-API entry
//! points used so far, each resolved once, and every failure an error that says what is
//! missing and what to do. Nothing links CUDA at build time: one build serves CUDA 12, CUDA 13
//! and hosts without a GPU.

use libloading::Library;
use std::ffi::{c_char, c_int, c_uint, CStr};

/// The driver's soname (stable across CUDA 12 and 13 drivers).
pub const LIBRARY: &str = "libcuda.so.1";

/// Why the CUDA driver cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("{path} cannot be loaded ({why}): no NVIDIA driver on this host, so GPU memory cannot be registered (CPU memory and every CPU transport work); install the NVIDIA driver (libcuda comes with it, not with the CUDA toolkit) or, in a container, run with the NVIDIA container toolkit (--gpus all)")]
    Missing { path: String, why: String },
    #[error("{path} has no symbol {symbol} ({why}): the NVIDIA driver is too old (CUDA 11.4 or newer needed)")]
    Symbol { path: String, symbol: &'static str, why: String },
    #[error("{call} failed with CUDA error {code} ({name}): {fix}")]
    Call { call: &'static str, code: i32, name: &'static str, fix: &'static str },
}

type CuInit = unsafe extern "C" fn(c_uint) -> c_int;
type CuDriverGetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
type CuDeviceGetCount = unsafe extern "C" fn(*mut c_int) -> c_int;
type CuDeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
type CuDeviceGetName = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
type CuDeviceTotalMem = unsafe extern "C" fn(*mut usize, c_int) -> c_int;
type CuDeviceGetAttribute = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int;
type CuDeviceGetPciBusId = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;

const ATTR_CC_MAJOR: c_int = 75;
const ATTR_CC_MINOR: c_int = 76;

/// The name and the fix of the CUDA errors the calls here can return.
fn explain(code: i32) -> (&'static str, &'static str) {
    match code {
        3 => ("CUDA_ERROR_NOT_INITIALIZED", "cuInit was not called or failed"),
        34 => ("CUDA_ERROR_STUB_LIBRARY", "a CUDA stub libcuda.so is found before the driver's: remove the stubs directory from LD_LIBRARY_PATH"),
        35 => ("CUDA_ERROR_INSUFFICIENT_DRIVER", "the driver is older than this CUDA runtime expects: update the NVIDIA driver"),
        100 => ("CUDA_ERROR_NO_DEVICE", "no GPU is visible: check CUDA_VISIBLE_DEVICES and that the container has the GPUs (--gpus all)"),
        101 => ("CUDA_ERROR_INVALID_DEVICE", "a device index is out of range"),
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
    Err(CudaError::Call { call, code, name, fix })
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
}

impl Driver {
    /// Loads [`LIBRARY`] and initialises it (`cuInit(0)`).
    pub fn load() -> Result<Driver, CudaError> {
        Driver::load_from(LIBRARY)
    }

    /// Loads and initialises the driver library at `path` (a soname or a file).
    pub fn load_from(path: &str) -> Result<Driver, CudaError> {
        // SAFETY: loading the NVIDIA driver library runs its constructors only.
        let lib = unsafe { Library::new(path) }.map_err(|e| CudaError::Missing { path: path.into(), why: e.to_string() })?;
        let sym = |symbol: &'static str, e: libloading::Error| CudaError::Symbol { path: path.into(), symbol, why: e.to_string() };
        // SAFETY: the types are the driver API's prototypes (cuda.h) for these symbols; the
        // `_v2` names are the ones cuda.h maps the plain names to since CUDA 3.2.
        unsafe {
            let init = *lib.get::<CuInit>(b"cuInit\0").map_err(|e| sym("cuInit", e))?;
            check("cuInit", init(0))?;
            Ok(Driver {
                driver_get_version: *lib.get(b"cuDriverGetVersion\0").map_err(|e| sym("cuDriverGetVersion", e))?,
                device_get_count: *lib.get(b"cuDeviceGetCount\0").map_err(|e| sym("cuDeviceGetCount", e))?,
                device_get: *lib.get(b"cuDeviceGet\0").map_err(|e| sym("cuDeviceGet", e))?,
                device_get_name: *lib.get(b"cuDeviceGetName\0").map_err(|e| sym("cuDeviceGetName", e))?,
                device_total_mem: *lib.get(b"cuDeviceTotalMem_v2\0").map_err(|e| sym("cuDeviceTotalMem_v2", e))?,
                device_get_attribute: *lib.get(b"cuDeviceGetAttribute\0").map_err(|e| sym("cuDeviceGetAttribute", e))?,
                device_get_pci_bus_id: *lib.get(b"cuDeviceGetPCIBusId\0").map_err(|e| sym("cuDeviceGetPCIBusId", e))?,
                _lib: lib,
            })
        }
    }

    /// The CUDA version the driver supports, e.g. 12040 for 12.4.
    pub fn version(&self) -> Result<i32, CudaError> {
        let mut v = 0;
        // SAFETY: a valid out-pointer.
        check("cuDriverGetVersion", unsafe { (self.driver_get_version)(&mut v) })?;
        Ok(v)
    }

    /// Every GPU the driver shows this process.
    pub fn devices(&self) -> Result<Vec<super::Gpu>, CudaError> {
        let mut n = 0;
        // SAFETY: valid out-pointers and buffers of the sizes passed, for every call below.
        unsafe {
            check("cuDeviceGetCount", (self.device_get_count)(&mut n))?;
            let mut out = Vec::with_capacity(n.max(0) as usize);
            for i in 0..n.max(0) {
                let mut dev = 0;
                check("cuDeviceGet", (self.device_get)(&mut dev, i))?;
                let mut name = [0 as c_char; 256];
                check("cuDeviceGetName", (self.device_get_name)(name.as_mut_ptr(), name.len() as c_int - 1, dev))?;
                let mut bus = [0 as c_char; 64];
                check("cuDeviceGetPCIBusId", (self.device_get_pci_bus_id)(bus.as_mut_ptr(), bus.len() as c_int - 1, dev))?;
                let mut mem = 0usize;
                check("cuDeviceTotalMem", (self.device_total_mem)(&mut mem, dev))?;
                let (mut major, mut minor) = (0, 0);
                check("cuDeviceGetAttribute", (self.device_get_attribute)(&mut major, ATTR_CC_MAJOR, dev))?;
                check("cuDeviceGetAttribute", (self.device_get_attribute)(&mut minor, ATTR_CC_MINOR, dev))?;
                out.push(super::Gpu {
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
