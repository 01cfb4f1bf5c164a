//! RDMA on this host, found and driven at run time (no build-time verbs dependency).
//!
//! This module loads `libibverbs.so.1` with `dlopen` when asked ([`verbs::Verbs`]), so a host
//! without rdma-core runs every other transport and is told why RDMA is absent; it reads the
//! NICs, their ports, rates and GIDs from sysfs ([`sysfs`]), which needs no library at all; and
//! it owns the verbs objects the RDMA transport is built on ([`verbs::Context`], [`verbs::Pd`],
//! [`verbs::Mr`], [`verbs::Cq`], [`verbs::Qp`]; their C layouts in [`ffi`]). [`probe`] never
//! opens a device, registers memory or creates a queue pair.

pub mod ffi;
pub mod sysfs;
pub mod verbs;

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
fn verbs_json<S: serde::Serializer>(v: &Result<Vec<String>, String>, s: S) -> Result<S::Ok, S::Error> {
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
        self.verbs.as_ref().is_ok_and(|d| !d.is_empty()) && self.nics.iter().any(|n| n.ports.iter().any(|p| p.active))
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

/// Probes this host: loads the verbs library (once per call) and reads sysfs.
pub fn probe() -> Probe {
    let lib = verbs::Verbs::load();
    let library = lib.is_ok();
    let verbs = lib.map_err(|e| e.to_string()).and_then(|v| v.device_names().map_err(|e| format!("ibv_get_device_list failed: {e}")));
    Probe { library, verbs, nics: sysfs::nics() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nic(active: bool) -> sysfs::Nic {
        let state = if active { "4: ACTIVE" } else { "1: DOWN" };
        sysfs::Nic { name: "rxe0".into(), numa_node: None, ports: vec![sysfs::Port { num: 1, state: state.into(), active, rate: String::new(), link_layer: "Ethernet".into(), gids: vec![] }] }
    }

    #[test]
    fn each_missing_piece_is_named_with_its_fix() {
        let no_lib = Probe { library: false, verbs: Err("libibverbs.so.1 cannot be loaded (...): ... apt install libibverbs1 ...".into()), nics: vec![] };
        assert!(!no_lib.usable() && no_lib.why_not().unwrap().contains("apt install"));
        let no_dev = Probe { library: true, verbs: Ok(vec![]), nics: vec![] };
        assert!(!no_dev.usable() && no_dev.why_not().unwrap().contains("no RDMA device"));
        let down = Probe { library: true, verbs: Ok(vec!["rxe0".into()]), nics: vec![nic(false)] };
        assert!(!down.usable() && down.why_not().unwrap().contains("ACTIVE"));
        let up = Probe { library: true, verbs: Ok(vec!["rxe0".into()]), nics: vec![nic(true)] };
        assert!(up.usable() && up.why_not().is_none());
        // This host: whatever it has, the probe answers and explains an absence.
        let here = probe();
        assert_eq!(here.usable(), here.why_not().is_none());
    }
}
