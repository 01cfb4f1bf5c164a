//! GPUs on this host, through the CUDA driver loaded at run time (groundwork of issue 13).
//!
//! Only `libcuda.so.1` — the driver API, whose soname and ABI are the same under CUDA 12 and
//! CUDA 13 drivers — is ever loaded, with `dlopen` when asked; never `libcudart`. A host
//! without a driver runs every CPU path and is told why GPU memory cannot be used. This module
//! reports the driver and the devices; it does not allocate, register or copy GPU memory yet.

pub mod driver;

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
        Err(e) => return Probe { driver_version: None, gpus: Vec::new(), unavailable: Some(e.to_string()) },
    };
    let version = d.version().ok();
    match d.devices() {
        Ok(gpus) if gpus.is_empty() => Probe { driver_version: version, gpus, unavailable: Some("the CUDA driver lists no GPU (CUDA_VISIBLE_DEVICES empty, or no device visible in this container)".into()) },
        Ok(gpus) => Probe { driver_version: version, gpus, unavailable: None },
        Err(e) => Probe { driver_version: version, gpus: Vec::new(), unavailable: Some(e.to_string()) },
    }
}
