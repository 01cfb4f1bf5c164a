//! RDMA NICs as sysfs shows them (`/sys/class/infiniband/<dev>/...`): ports, their state, rate,
//! link layer and GID table, and the NUMA node of the device. Pure reads of text files, no
//! library: the topology is known even where verbs cannot be loaded.

use serde::Serialize;
use std::net::Ipv4Addr;
use std::path::Path;

/// Where sysfs lists RDMA devices.
pub const ROOT: &str = "/sys/class/infiniband";

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Nic {
    pub name: String,
    /// NUMA node of the PCI device (`None`: unknown, or a software device such as rxe).
    pub numa_node: Option<u32>,
    pub ports: Vec<Port>,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Port {
    pub num: u32,
    /// As sysfs says it, e.g. `4: ACTIVE`.
    pub state: String,
    pub active: bool,
    /// Link rate as sysfs says it, e.g. `100 Gb/sec (4X EDR)`. (The active MTU is not in
    /// sysfs: it comes from `ibv_query_port` with the transport.)
    pub rate: String,
    /// `InfiniBand` or `Ethernet` (RoCE).
    pub link_layer: String,
    /// Non-empty GID table entries.
    pub gids: Vec<Gid>,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Gid {
    pub index: u32,
    /// The GID as sysfs prints it (8 groups of 4 hex digits).
    pub gid: String,
    /// `RoCE v2`, `IB/RoCE v1`, or empty when sysfs does not say.
    pub kind: String,
    /// The IPv4 address of an IPv4-mapped GID (`::ffff:a.b.c.d`).
    pub ipv4: Option<Ipv4Addr>,
}

fn read(p: &Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

/// The NICs under [`ROOT`].
pub fn nics() -> Vec<Nic> {
    nics_in(Path::new(ROOT))
}

/// The NICs under `root` (a directory laid out as `/sys/class/infiniband`), by name.
pub(crate) fn nics_in(root: &Path) -> Vec<Nic> {
    let Ok(dir) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut out: Vec<Nic> = dir
        .flatten()
        .map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let dev = root.join(&name);
            // -1 means "no NUMA information".
            let numa_node = read(&dev.join("device/numa_node"))
                .and_then(|s| s.parse::<i64>().ok())
                .and_then(|n| u32::try_from(n).ok());
            Nic {
                name,
                numa_node,
                ports: ports(&dev.join("ports")),
            }
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

fn ports(dir: &Path) -> Vec<Port> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<Port> = rd
        .flatten()
        .filter_map(|e| {
            let num: u32 = e.file_name().to_string_lossy().parse().ok()?;
            let p = dir.join(e.file_name());
            let state = read(&p.join("state")).unwrap_or_default();
            let active = state.ends_with("ACTIVE");
            let rate = read(&p.join("rate")).unwrap_or_default();
            let link_layer = read(&p.join("link_layer")).unwrap_or_default();
            Some(Port {
                num,
                state,
                active,
                rate,
                link_layer,
                gids: gids(&p),
            })
        })
        .collect();
    out.sort_by_key(|p| p.num);
    out
}

fn gids(port: &Path) -> Vec<Gid> {
    let Ok(rd) = std::fs::read_dir(port.join("gids")) else {
        return Vec::new();
    };
    let mut out: Vec<Gid> = rd
        .flatten()
        .filter_map(|e| {
            let index: u32 = e.file_name().to_string_lossy().parse().ok()?;
            let gid = read(&e.path())?;
            let groups: Vec<u16> = gid
                .split(':')
                .filter_map(|g| u16::from_str_radix(g, 16).ok())
                .collect();
            if groups.len() != 8 || groups.iter().all(|&g| g == 0) {
                return None; // an empty slot
            }
            let ipv4 = (groups[..5].iter().all(|&g| g == 0) && groups[5] == 0xffff).then(|| {
                Ipv4Addr::new(
                    (groups[6] >> 8) as u8,
                    groups[6] as u8,
                    (groups[7] >> 8) as u8,
                    groups[7] as u8,
                )
            });
            let kind =
                read(&port.join("gid_attrs/types").join(index.to_string())).unwrap_or_default();
            Some(Gid {
                index,
                gid,
                kind,
                ipv4,
            })
        })
        .collect();
    out.sort_by_key(|g| g.index);
    out
}

/// The GID index to use on `port`: `forced` (`MC_GID_INDEX`) if that entry exists; else the
/// first RoCE v2 IPv4-mapped GID (routable, what Mooncake's auto-selection looks for); else
/// any RoCE v2 GID; else index 0 when present (InfiniBand). `None`: no usable GID.
pub fn select_gid(port: &Port, forced: Option<u32>) -> Option<u32> {
    if let Some(i) = forced {
        return port.gids.iter().any(|g| g.index == i).then_some(i);
    }
    let v2 = |g: &&Gid| g.kind.eq_ignore_ascii_case("RoCE v2");
    port.gids
        .iter()
        .filter(v2)
        .find(|g| g.ipv4.is_some())
        .or_else(|| port.gids.iter().find(v2))
        .or_else(|| port.gids.iter().find(|g| g.index == 0))
        .map(|g| g.index)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(p: &Path, s: &str) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, format!("{s}\n")).unwrap();
    }

    /// A RoCE NIC as rxe/mlx5 lay it out: link-local v1/v2 GIDs, then IPv4-mapped ones.
    fn fixture(root: &Path) {
        let p = root.join("mlx5_1/ports/1");
        write(&root.join("mlx5_1/device/numa_node"), "1");
        write(&p.join("state"), "4: ACTIVE");
        write(&p.join("rate"), "100 Gb/sec (4X EDR)");
        write(&p.join("link_layer"), "Ethernet");
        let zero = "0000:0000:0000:0000:0000:0000:0000:0000";
        let ll = "fe80:0000:0000:0000:0250:56ff:fe8a:0001";
        let v4 = "0000:0000:0000:0000:0000:ffff:0a63:0201"; // 10.99.2.1
        for (i, (g, t)) in [
            (ll, "IB/RoCE v1"),
            (ll, "RoCE v2"),
            (v4, "IB/RoCE v1"),
            (v4, "RoCE v2"),
            (zero, ""),
        ]
        .iter()
        .enumerate()
        {
            write(&p.join(format!("gids/{i}")), g);
            write(&p.join(format!("gid_attrs/types/{i}")), t);
        }
        let q = root.join("rxe0/ports/1");
        write(&root.join("rxe0/device/numa_node"), "-1");
        write(&q.join("state"), "1: DOWN");
        write(&q.join("rate"), "10 Gb/sec (1X QDR)");
        write(&q.join("link_layer"), "Ethernet");
        write(&q.join("gids/0"), ll);
    }

    #[test]
    fn nics_ports_and_gids_are_read_from_sysfs() {
        let root = std::env::temp_dir().join(format!("kvf-sysfs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        fixture(&root);
        let nics = nics_in(&root);
        assert_eq!(
            nics.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(),
            ["mlx5_1", "rxe0"]
        );
        let (mlx, rxe) = (&nics[0], &nics[1]);
        assert_eq!((mlx.numa_node, rxe.numa_node), (Some(1), None));
        let p = &mlx.ports[0];
        assert_eq!(
            (p.num, p.active, p.rate.as_str(), p.link_layer.as_str()),
            (1, true, "100 Gb/sec (4X EDR)", "Ethernet")
        );
        assert_eq!(p.gids.len(), 4, "the empty slot is left out");
        assert_eq!(p.gids[3].ipv4, Some(Ipv4Addr::new(10, 99, 2, 1)));
        assert_eq!(p.gids[0].ipv4, None);
        assert_eq!(select_gid(p, None), Some(3), "RoCE v2, IPv4-mapped");
        assert_eq!(
            select_gid(p, Some(1)),
            Some(1),
            "MC_GID_INDEX wins when the entry exists"
        );
        assert_eq!(
            select_gid(p, Some(9)),
            None,
            "a forced index that does not exist is not replaced silently"
        );
        let q = &rxe.ports[0];
        assert!(!q.active);
        assert_eq!(select_gid(q, None), Some(0), "no type information: index 0");
        assert!(nics_in(&root.join("absent")).is_empty());
        let _ = std::fs::remove_dir_all(&root);
    }
}
