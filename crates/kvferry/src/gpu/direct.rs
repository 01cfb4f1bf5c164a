//! GPUDirect RDMA: how GPU memory is registered with RDMA NICs, so that the NICs read and
//! write it directly (no staging through host memory).
//!
//! Two methods exist, and which one works depends on the host, not on how kvferry was built:
//! - **DMA-BUF**: the CUDA driver exports the allocation as a dma-buf file descriptor
//!   (`cuMemGetHandleForAddressRange`) and the NIC registers that (`ibv_reg_dmabuf_mr`, with
//!   the range's offset in the allocation). Needs the NVIDIA open kernel modules (the GPU
//!   reports `DMA_BUF_SUPPORTED`), rdma-core 34+, and a NIC driver and kernel that import
//!   dma-bufs (mlx5, Linux 5.12+). No extra kernel module; the default of recent Mooncake.
//! - **peermem**: a plain `ibv_reg_mr` of the device address, which works only while the
//!   `nvidia_peermem` (or Mellanox `nv_peer_mem`) kernel module is loaded; without it the
//!   kernel answers "Bad address" (Mooncake's most reported GPU failure).
//!
//! [`plan`] turns what the host has ([`Facts`]) and the setting (`KVFERRY_GPU_RDMA`, or
//! Mooncake's `WITH_NVIDIA_PEERMEM`) into the methods to try, in order; the RDMA transport
//! tries them per registration and keeps the first that worked for the next ones. Every
//! "cannot" names what the host lacks and the fix. This module decides; it registers nothing.

use serde::Serialize;
use std::fmt;

pub use crate::transport::rdma::{try_gpu_registration, GpuRegTry};

/// How GPU memory is to be registered with RDMA NICs (`KVFERRY_GPU_RDMA`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuRdma {
    /// DMA-BUF where the host supports it, else peermem where its module is loaded.
    #[default]
    Auto,
    /// DMA-BUF only (`WITH_NVIDIA_PEERMEM=0`).
    DmaBuf,
    /// Plain `ibv_reg_mr` of device addresses only (`WITH_NVIDIA_PEERMEM=1`).
    PeerMem,
}

impl GpuRdma {
    /// Parses `KVFERRY_GPU_RDMA`'s values.
    pub fn parse(v: &str) -> Option<GpuRdma> {
        match v.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Some(GpuRdma::Auto),
            "dmabuf" | "dma-buf" | "dma_buf" => Some(GpuRdma::DmaBuf),
            "peermem" | "nvidia-peermem" | "nvidia_peermem" => Some(GpuRdma::PeerMem),
            _ => None,
        }
    }

    /// Mooncake's `WITH_NVIDIA_PEERMEM`: `1`/`on`/`true` (any case) means peermem, any other
    /// value DMA-BUF.
    pub(crate) fn from_with_nvidia_peermem(v: &str) -> GpuRdma {
        match v.trim().to_ascii_lowercase().as_str() {
            "1" | "on" | "true" | "yes" => GpuRdma::PeerMem,
            _ => GpuRdma::DmaBuf,
        }
    }
}

/// One way of registering GPU memory with a NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    DmaBuf,
    PeerMem,
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Method::DmaBuf => "DMA-BUF",
            Method::PeerMem => "nvidia-peermem",
        })
    }
}

/// What the host offers for each method: `Ok` (with what was found) or why not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Facts {
    /// DMA-BUF: the driver exports dma-bufs for this GPU and libibverbs registers them.
    pub dmabuf: Result<(), String>,
    /// peermem: the kernel module that is loaded (`nvidia_peermem` or `nv_peer_mem`).
    pub peermem: Result<&'static str, String>,
}

/// The kernel modules that let a NIC register GPU memory by its address.
pub(crate) const PEERMEM_MODULES: [&str; 2] = ["nvidia_peermem", "nv_peer_mem"];

/// Which peermem module is loaded here (`/sys/module/<name>`), or why none is.
pub(crate) fn peermem_module() -> Result<&'static str, String> {
    peermem_module_in(std::path::Path::new("/sys/module"))
}

/// [`peermem_module`] against another sysfs module directory (tests).
pub(crate) fn peermem_module_in(sys_module: &std::path::Path) -> Result<&'static str, String> {
    PEERMEM_MODULES
        .into_iter()
        .find(|m| sys_module.join(m).exists())
        .ok_or_else(|| "the nvidia_peermem kernel module is not loaded (modprobe nvidia_peermem; Mellanox OFED's is nv_peer_mem)".to_string())
}

/// What this host offers for GPU `ordinal` (`verbs_dmabuf`: libibverbs has
/// `ibv_reg_dmabuf_mr`).
pub fn facts(ordinal: u32, verbs_dmabuf: bool) -> Facts {
    let dmabuf = match super::cuda() {
        Err(why) => Err(format!("the CUDA driver is not usable: {why}")),
        Ok(c) => c.driver().dmabuf_support(ordinal).and_then(|()| {
            if verbs_dmabuf {
                Ok(())
            } else {
                Err("libibverbs has no ibv_reg_dmabuf_mr (rdma-core 34 or newer has it: update rdma-core / ibverbs-providers)".into())
            }
        }),
    };
    Facts {
        dmabuf,
        peermem: peermem_module(),
    }
}

/// The methods to try for GPU memory, in order, under `setting` on a host with `facts`; or
/// why GPU memory cannot be registered with the NICs at all (naming what is missing for each
/// method and the fix).
pub fn plan(setting: GpuRdma, facts: &Facts) -> Result<Vec<Method>, String> {
    match setting {
        GpuRdma::PeerMem => Ok(vec![Method::PeerMem]),
        GpuRdma::DmaBuf => match &facts.dmabuf {
            Ok(()) => Ok(vec![Method::DmaBuf]),
            Err(why) => Err(format!(
                "KVFERRY_GPU_RDMA=dmabuf (or WITH_NVIDIA_PEERMEM=0) asks for DMA-BUF, but {why}; {}",
                match &facts.peermem {
                    Ok(m) => format!("{m} is loaded: KVFERRY_GPU_RDMA=peermem (or auto) would use it"),
                    Err(_) => "alternatively load nvidia_peermem and set KVFERRY_GPU_RDMA=peermem".into(),
                }
            )),
        },
        GpuRdma::Auto => {
            let mut m = Vec::new();
            if facts.dmabuf.is_ok() {
                m.push(Method::DmaBuf);
            }
            if facts.peermem.is_ok() {
                m.push(Method::PeerMem);
            }
            if m.is_empty() {
                return Err(format!(
                    "neither way of registering GPU memory with RDMA NICs is available: DMA-BUF: {}; peermem: {}",
                    facts.dmabuf.as_ref().err().map_or("available", String::as_str),
                    facts.peermem.as_ref().err().map_or("available", String::as_str)
                ));
            }
            Ok(m)
        }
    }
}

/// For `kvferry doctor` and `features()`: the methods that would be tried on GPU `ordinal`
/// under `setting`, or why GPU memory cannot be registered with NICs.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub setting: String,
    pub methods: Vec<Method>,
    /// Why DMA-BUF / peermem is not available (absent when it is).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dmabuf_unavailable: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peermem_unavailable: Option<String>,
    /// Set when no method can be used (and then GPU memory goes over TCP, staged).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
}

/// [`Report`] for GPU `ordinal`.
pub fn report(setting: GpuRdma, ordinal: u32, verbs_dmabuf: bool) -> Report {
    let f = facts(ordinal, verbs_dmabuf);
    let p = plan(setting, &f);
    Report {
        setting: format!("{setting:?}").to_ascii_lowercase(),
        methods: p.as_ref().cloned().unwrap_or_default(),
        dmabuf_unavailable: f.dmabuf.err(),
        peermem_unavailable: f.peermem.err(),
        unavailable: p.err(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(dmabuf: bool, peermem: bool) -> Facts {
        Facts {
            dmabuf: if dmabuf {
                Ok(())
            } else {
                Err("GPU 0 reports DMA_BUF_SUPPORTED = 0".into())
            },
            peermem: if peermem {
                Ok("nvidia_peermem")
            } else {
                Err("the nvidia_peermem kernel module is not loaded".into())
            },
        }
    }

    #[test]
    fn auto_prefers_dmabuf_then_peermem_and_says_why_neither() {
        assert_eq!(
            plan(GpuRdma::Auto, &facts(true, true)).unwrap(),
            vec![Method::DmaBuf, Method::PeerMem]
        );
        assert_eq!(
            plan(GpuRdma::Auto, &facts(true, false)).unwrap(),
            vec![Method::DmaBuf]
        );
        assert_eq!(
            plan(GpuRdma::Auto, &facts(false, true)).unwrap(),
            vec![Method::PeerMem]
        );
        let e = plan(GpuRdma::Auto, &facts(false, false)).unwrap_err();
        assert!(
            e.contains("DMA_BUF_SUPPORTED = 0")
                && e.contains("nvidia_peermem kernel module is not loaded"),
            "{e}"
        );
    }

    #[test]
    fn a_forced_method_is_the_only_one_tried() {
        // WITH_NVIDIA_PEERMEM=1 is tried even where the module is not seen (a kernel with it
        // built in has no /sys/module entry); its registration error then explains.
        assert_eq!(
            plan(GpuRdma::PeerMem, &facts(true, false)).unwrap(),
            vec![Method::PeerMem]
        );
        assert_eq!(
            plan(GpuRdma::DmaBuf, &facts(true, true)).unwrap(),
            vec![Method::DmaBuf]
        );
        let e = plan(GpuRdma::DmaBuf, &facts(false, true)).unwrap_err();
        assert!(
            e.contains("asks for DMA-BUF")
                && e.contains("DMA_BUF_SUPPORTED = 0")
                && e.contains("nvidia_peermem is loaded"),
            "{e}"
        );
    }

    #[test]
    fn settings_parse_as_mooncake_spells_them() {
        assert_eq!(GpuRdma::parse("auto"), Some(GpuRdma::Auto));
        assert_eq!(GpuRdma::parse("DMABUF"), Some(GpuRdma::DmaBuf));
        assert_eq!(GpuRdma::parse("peermem"), Some(GpuRdma::PeerMem));
        assert_eq!(GpuRdma::parse("gdr"), None);
        for v in ["1", "ON", "true"] {
            assert_eq!(
                GpuRdma::from_with_nvidia_peermem(v),
                GpuRdma::PeerMem,
                "{v}"
            );
        }
        for v in ["0", "off", "no", ""] {
            assert_eq!(GpuRdma::from_with_nvidia_peermem(v), GpuRdma::DmaBuf, "{v}");
        }
    }

    #[test]
    fn the_peermem_module_is_found_by_either_name() {
        let dir = std::env::temp_dir().join(format!("kvf-sysmod-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(peermem_module_in(&dir)
            .unwrap_err()
            .contains("modprobe nvidia_peermem"));
        std::fs::create_dir_all(dir.join("nv_peer_mem")).unwrap();
        assert_eq!(peermem_module_in(&dir).unwrap(), "nv_peer_mem");
        std::fs::create_dir_all(dir.join("nvidia_peermem")).unwrap();
        assert_eq!(peermem_module_in(&dir).unwrap(), "nvidia_peermem");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
