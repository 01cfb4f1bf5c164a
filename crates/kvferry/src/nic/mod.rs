//! The RDMA NICs of this host, found at run time (no build-time verbs dependency).
//!
//! This module reads the NICs, their ports, rates and GIDs from sysfs ([`sysfs`]), which needs
//! no library at all, ranks them by topology ([`topo`]), and asks `libibverbs.so.1` (loaded
//! with `dlopen` when asked, by [`crate::sys::ibverbs::verbs::Verbs`]) what it lists, so a host
//! without rdma-core runs every other transport and is told why RDMA is absent. The verbs
//! objects the RDMA transport is built on (`Context`, `Pd`, `Mr`, `Cq`, `Qp`) and their C
//! layouts live in [`crate::sys::ibverbs`]. [`probe`] never opens a device, registers memory or
//! creates a queue pair.

pub(crate) mod sysfs;
pub(crate) mod topo;

use crate::sys::ibverbs::verbs;

pub use sysfs::Nic;

use serde::Serialize;

/// What RDMA can do on this host, for `kvferry doctor` and the engine's transport choice.
#[derive(Debug, Clone, Serialize)]
pub struct Probe {
    /// `libibverbs.so.1` could be loaded (even if listing devices then failed).
    pub library: bool,
    /// `libibverbs.so.1` loaded and the devices it lists; or why not.
    #[serde(serialize_with = "verbs_json")]
    pub verbs: Result<Vec<String>, String>,
    /// The NICs sysfs shows (`/sys/class/infiniband`).
    pub nics: Vec<sysfs::Nic>,
}

/// `{"devices": [...]}` or `{"error": "..."}`.
fn verbs_json<S: serde::Serializer>(
    v: &Result<Vec<String>, String>,
    s: S,
) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut m = s.serialize_map(Some(1))?;
    match v {
        Ok(d) => m.serialize_entry("devices", d)?,
        Err(e) => m.serialize_entry("error", e)?,
    }
    m.end()
}

impl Probe {
    /// Usable: the library loads and at least one NIC has an active port.
    pub fn usable(&self) -> bool {
        self.verbs.as_ref().is_ok_and(|d| !d.is_empty())
            && self.nics.iter().any(|n| n.ports.iter().any(|p| p.active))
    }

    /// Why RDMA cannot be used here, and what to do; `None` when it can.
    pub fn why_not(&self) -> Option<String> {
        match &self.verbs {
            Err(e) => Some(e.clone()),
            Ok(d) if d.is_empty() => Some(
                "libibverbs loads but lists no RDMA device: no NIC with RDMA here (or its driver / rdma-core provider is missing: apt install ibverbs-providers; for testing, Soft-RoCE: rdma link add rxe0 type rxe netdev eth0)".into(),
            ),
            Ok(_) if !self.nics.iter().any(|n| n.ports.iter().any(|p| p.active)) => {
                Some("RDMA devices are present but no port is ACTIVE: check the cable/link (ibv_devinfo, rdma link show)".into())
            }
            Ok(_) => None,
        }
    }
}

/// One port of a NIC as `kvferry doctor` reports it: its state, and what the RDMA transport
/// would use there (the GID chosen as the transport chooses it, the active MTU).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct PortReport {
    pub device: String,
    pub port: u32,
    /// As sysfs says it, e.g. `4: ACTIVE`.
    pub state: String,
    pub active: bool,
    pub link_layer: String,
    pub rate: String,
    pub numa_node: Option<u32>,
    /// The GID index the transport would use (`MC_GID_INDEX` honoured), with the GID, its type
    /// and its IPv4 address when IPv4-mapped.
    pub gid_index: Option<u32>,
    pub gid: Option<String>,
    pub gid_type: Option<String>,
    pub gid_ipv4: Option<std::net::Ipv4Addr>,
    /// Active MTU in bytes (`ibv_query_port`; `None` until [`query_mtus`] read it).
    pub active_mtu: Option<u32>,
    /// Why the transport would not use this port, and what to do.
    pub problem: Option<String>,
}

impl PortReport {
    /// One line for people: `rxe0 port 1: 4: ACTIVE, Ethernet, 10 Gb/sec, GID 1 ... (RoCE v2,
    /// 10.99.2.1), active MTU 1024`, and the problem if there is one.
    pub fn line(&self) -> String {
        let mut l = format!(
            "{} port {}: {}, {}",
            self.device,
            self.port,
            self.state,
            if self.link_layer.is_empty() {
                "link layer unknown"
            } else {
                &self.link_layer
            }
        );
        if !self.rate.is_empty() {
            l += &format!(", {}", self.rate);
        }
        if let Some(n) = self.numa_node {
            l += &format!(", NUMA node {n}");
        }
        if let (Some(i), Some(g)) = (self.gid_index, &self.gid) {
            let kind = self
                .gid_type
                .as_deref()
                .filter(|k| !k.is_empty())
                .unwrap_or("type unknown");
            match self.gid_ipv4 {
                Some(ip) => l += &format!(", GID {i} {g} ({kind}, {ip})"),
                None => l += &format!(", GID {i} {g} ({kind})"),
            }
        }
        if let Some(m) = self.active_mtu {
            l += &format!(", active MTU {m}");
        }
        if let Some(p) = &self.problem {
            l += &format!(" -- {p}");
        }
        l
    }
}

/// Each port of `nics`, with the GID the transport would choose (`forced_gid`:
/// `MC_GID_INDEX`) and why a port would not be used. Pure: the MTU is read by [`query_mtus`].
pub fn port_reports(nics: &[sysfs::Nic], forced_gid: Option<u32>) -> Vec<PortReport> {
    let mut out = Vec::new();
    for n in nics {
        for p in &n.ports {
            let chosen =
                sysfs::select_gid(p, forced_gid).and_then(|i| p.gids.iter().find(|g| g.index == i));
            let problem = if !p.active {
                Some("not ACTIVE: check the cable/link (ibv_devinfo, rdma link show)".to_string())
            } else if chosen.is_none() {
                Some(match forced_gid {
                    Some(i) => format!("MC_GID_INDEX={i} does not exist on this port (its GIDs: {:?}); unset it or pick one of them", p.gids.iter().map(|g| g.index).collect::<Vec<_>>()),
                    None => "no usable GID (no RoCE v2 GID and no index 0): give the netdev an IP address, or set MC_GID_INDEX".to_string(),
                })
            } else if p.num != 1 {
                Some(
                    "the transport uses port 1 of each device (Mooncake's MC_IB_PORT default)"
                        .to_string(),
                )
            } else {
                None
            };
            out.push(PortReport {
                device: n.name.clone(),
                port: p.num,
                state: p.state.clone(),
                active: p.active,
                link_layer: p.link_layer.clone(),
                rate: p.rate.clone(),
                numa_node: n.numa_node,
                gid_index: chosen.map(|g| g.index),
                gid: chosen.map(|g| g.gid.clone()),
                gid_type: chosen.map(|g| g.kind.clone()),
                gid_ipv4: chosen.and_then(|g| g.ipv4),
                active_mtu: None,
                problem,
            });
        }
    }
    out
}

/// Reads the active MTU of each active port with `ibv_query_port` (opens each device once;
/// registers nothing, creates no queue pair). A failure becomes the port's problem.
pub fn query_mtus(reports: &mut [PortReport]) {
    let v = match verbs::Verbs::load() {
        Ok(v) => std::sync::Arc::new(v),
        Err(e) => {
            for r in reports.iter_mut().filter(|r| r.active) {
                r.problem.get_or_insert_with(|| e.to_string());
            }
            return;
        }
    };
    let mut opened: Vec<(String, Result<verbs::Context, String>)> = Vec::new();
    for r in reports.iter_mut().filter(|r| r.active) {
        if !opened.iter().any(|(n, _)| *n == r.device) {
            opened.push((
                r.device.clone(),
                verbs::Context::open(std::sync::Arc::clone(&v), &r.device)
                    .map_err(|e| e.to_string()),
            ));
        }
        let Some((_, ctx)) = opened.iter().find(|(n, _)| *n == r.device) else {
            continue;
        };
        let attr = ctx.as_ref().map_err(String::clone).and_then(|c| {
            u8::try_from(r.port)
                .map_err(|_| format!("port {} out of range", r.port))
                .and_then(|p| c.query_port(p).map_err(|e| e.to_string()))
        });
        match attr {
            Ok(a) => r.active_mtu = Some(a.mtu_bytes()),
            Err(e) => {
                r.problem.get_or_insert(e);
            }
        }
    }
}

/// Whether libibverbs loads and registers memory by DMA-BUF (`ibv_reg_dmabuf_mr`, rdma-core
/// 34+): one of the facts that decide how GPU memory is registered ([`crate::host::gpu::facts`]).
pub fn verbs_dmabuf() -> bool {
    verbs::Verbs::load().is_ok_and(|v| v.has_dmabuf())
}

/// Probes this host: loads the verbs library (once per call) and reads sysfs.
pub fn probe() -> Probe {
    let lib = verbs::Verbs::load();
    let library = lib.is_ok();
    let verbs = lib.map_err(|e| e.to_string()).and_then(|v| {
        v.device_names()
            .map_err(|e| format!("ibv_get_device_list failed: {e}"))
    });
    Probe {
        library,
        verbs,
        nics: sysfs::nics(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nic(active: bool) -> sysfs::Nic {
        let state = if active { "4: ACTIVE" } else { "1: DOWN" };
        sysfs::Nic {
            name: "rxe0".into(),
            numa_node: None,
            ports: vec![sysfs::Port {
                num: 1,
                state: state.into(),
                active,
                rate: String::new(),
                link_layer: "Ethernet".into(),
                gids: vec![],
            }],
        }
    }

    #[test]
    fn port_reports_say_state_gid_chosen_and_why_a_port_is_not_used() {
        use std::net::Ipv4Addr;
        let gid = |index: u32, kind: &str, ipv4: Option<Ipv4Addr>| sysfs::Gid {
            index,
            gid: format!("fe80:0000:0000:0000:0000:0000:0000:000{index}"),
            kind: kind.into(),
            ipv4,
        };
        let mut up = nic(true);
        up.ports[0].gids = vec![
            gid(0, "IB/RoCE v1", None),
            gid(1, "RoCE v2", Some(Ipv4Addr::new(10, 99, 2, 1))),
        ];
        up.ports[0].rate = "10 Gb/sec (1X QDR)".into();
        let r = port_reports(std::slice::from_ref(&up), None);
        assert_eq!(
            (
                r[0].gid_index,
                r[0].gid_type.as_deref(),
                r[0].problem.as_deref()
            ),
            (Some(1), Some("RoCE v2"), None)
        );
        let mut with_mtu = r[0].clone();
        with_mtu.active_mtu = Some(1024);
        assert_eq!(
            with_mtu.line(),
            "rxe0 port 1: 4: ACTIVE, Ethernet, 10 Gb/sec (1X QDR), GID 1 fe80:0000:0000:0000:0000:0000:0000:0001 (RoCE v2, 10.99.2.1), active MTU 1024"
        );
        let forced = port_reports(std::slice::from_ref(&up), Some(0));
        assert_eq!(forced[0].gid_index, Some(0), "MC_GID_INDEX honoured");
        let missing = port_reports(std::slice::from_ref(&up), Some(7));
        assert!(
            missing[0].gid_index.is_none()
                && missing[0]
                    .problem
                    .as_deref()
                    .is_some_and(|p| p.contains("MC_GID_INDEX=7") && p.contains("[0, 1]")),
            "{missing:?}"
        );
        let down = port_reports(&[nic(false)], None);
        assert!(
            down[0]
                .problem
                .as_deref()
                .is_some_and(|p| p.contains("ACTIVE"))
                && down[0].line().contains("1: DOWN")
        );
        let bare = port_reports(&[nic(true)], None);
        assert!(
            bare[0]
                .problem
                .as_deref()
                .is_some_and(|p| p.contains("no usable GID")),
            "{bare:?}"
        );
    }

    #[test]
    fn each_missing_piece_is_named_with_its_fix() {
        let no_lib = Probe {
            library: false,
            verbs: Err(
                "libibverbs.so.1 cannot be loaded (...): ... apt install libibverbs1 ...".into(),
            ),
            nics: vec![],
        };
        assert!(!no_lib.usable() && no_lib.why_not().unwrap().contains("apt install"));
        let no_dev = Probe {
            library: true,
            verbs: Ok(vec![]),
            nics: vec![],
        };
        assert!(!no_dev.usable() && no_dev.why_not().unwrap().contains("no RDMA device"));
        let down = Probe {
            library: true,
            verbs: Ok(vec!["rxe0".into()]),
            nics: vec![nic(false)],
        };
        assert!(!down.usable() && down.why_not().unwrap().contains("ACTIVE"));
        let up = Probe {
            library: true,
            verbs: Ok(vec!["rxe0".into()]),
            nics: vec![nic(true)],
        };
        assert!(up.usable() && up.why_not().is_none());
        // This host: whatever it has, the probe answers and explains an absence.
        let here = probe();
        assert_eq!(here.usable(), here.why_not().is_none());
    }
}
