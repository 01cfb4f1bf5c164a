//! Which RDMA NICs serve which memory: the NIC priority matrix (Mooncake's `priority_matrix`,
//! reference §1.5), from sysfs or from a file.
//!
//! A matrix maps a memory location (`cpu:<numa node>`, `cuda:<gpu>`) to two lists of NIC
//! names: *preferred* (the NICs closest to that memory) and *available* (the rest). Discovery
//! follows Mooncake's rules: for `cpu:N`, the NICs on NUMA node N are preferred; for
//! `cuda:N`, among the NICs on the GPU's NUMA node (or all, if none is), those with the shortest
//! PCIe path to the GPU. `KVFERRY_RDMA_TOPO` (Mooncake's `MC_CUSTOM_TOPO_JSON`) names a JSON
//! file that replaces discovery. The RDMA transport publishes the matrix in its descriptor
//! and stripes a piece over the NICs [`mask`] picks for its local memory's location.
//!
//! Pure functions over paths and values; the only I/O is reading sysfs and the file.

use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Location → [preferred NIC names, available NIC names].
pub(crate) type Matrix = BTreeMap<String, [Vec<String>; 2]>;

/// Where a device sits: its NUMA node and its resolved PCI sysfs path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Place {
    pub name: String,
    pub numa: Option<u32>,
    /// `/sys/devices/pci0000:00/0000:00:01.0/0000:17:00.0`-like, when known.
    pub pci: Option<PathBuf>,
}

fn numa_of(dev: &Path) -> Option<u32> {
    std::fs::read_to_string(dev.join("numa_node"))
        .ok()?
        .trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

/// NIC `name` under `ib_root` (`/sys/class/infiniband`): its `device` link resolved.
pub(crate) fn nic_place(ib_root: &Path, name: &str) -> Place {
    let dev = ib_root.join(name).join("device");
    Place {
        name: name.to_string(),
        numa: numa_of(&dev),
        pci: std::fs::canonicalize(&dev).ok(),
    }
}

/// A GPU by its PCI bus id (as the CUDA driver prints it, `0000:17:00.0`) under `pci_root`
/// (`/sys/bus/pci/devices`).
pub(crate) fn gpu_place(pci_root: &Path, index: u32, bus_id: &str) -> Place {
    let dev = pci_root.join(bus_id.to_ascii_lowercase());
    Place {
        name: format!("cuda:{index}"),
        numa: numa_of(&dev),
        pci: std::fs::canonicalize(&dev).ok(),
    }
}

/// The NUMA nodes under `root` (`/sys/devices/system/node`: `node0`, `node1`, ...); `[0]` when
/// none is listed.
pub(crate) fn numa_nodes(root: &Path) -> Vec<u32> {
    let mut v: Vec<u32> = std::fs::read_dir(root)
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.strip_prefix("node")?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    v.sort_unstable();
    if v.is_empty() {
        v.push(0);
    }
    v
}

/// PCIe distance: path components of `a` and `b` past their common prefix (Mooncake counts
/// the `/`s that differ). `usize::MAX` when either is unknown.
pub(crate) fn pci_distance(a: Option<&Path>, b: Option<&Path>) -> usize {
    let (Some(a), Some(b)) = (a, b) else {
        return usize::MAX;
    };
    let (a, b): (Vec<_>, Vec<_>) = (a.components().collect(), b.components().collect());
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    a.len() - common + b.len() - common
}

/// `cpu:N` for every NUMA node: the NICs on node N preferred, the others available (a NIC
/// without NUMA information, e.g. a software one, is available everywhere).
pub(crate) fn cpu_entries(nics: &[Place], nodes: &[u32]) -> Matrix {
    nodes
        .iter()
        .map(|&n| {
            let (pref, avail): (Vec<&Place>, Vec<&Place>) =
                nics.iter().partition(|p| p.numa == Some(n));
            (
                format!("cpu:{n}"),
                [
                    pref.iter().map(|p| p.name.clone()).collect(),
                    avail.iter().map(|p| p.name.clone()).collect(),
                ],
            )
        })
        .collect()
}

/// The entry of `gpu`: among the NICs on its NUMA node (all, if none is), those at the
/// shortest PCIe distance preferred; the rest available.
pub(crate) fn gpu_entry(nics: &[Place], gpu: &Place) -> [Vec<String>; 2] {
    let local: Vec<&Place> = nics
        .iter()
        .filter(|p| gpu.numa.is_some() && p.numa == gpu.numa)
        .collect();
    let candidates: Vec<&Place> = if local.is_empty() {
        nics.iter().collect()
    } else {
        local
    };
    let best = candidates
        .iter()
        .map(|p| pci_distance(p.pci.as_deref(), gpu.pci.as_deref()))
        .min()
        .unwrap_or(usize::MAX);
    let preferred: Vec<String> = candidates
        .iter()
        .filter(|p| pci_distance(p.pci.as_deref(), gpu.pci.as_deref()) == best)
        .map(|p| p.name.clone())
        .collect();
    let available = nics
        .iter()
        .filter(|p| !preferred.contains(&p.name))
        .map(|p| p.name.clone())
        .collect();
    [preferred, available]
}

/// A matrix from its JSON form (`{"cpu:0": [["mlx5_0"], ["mlx5_1"]], ...}`), keeping only the
/// NICs in `ours` (the others are named in the second value, to be logged); a location left
/// with no NIC is dropped.
pub(crate) fn parse(text: &str, ours: &[String]) -> Result<(Matrix, Vec<String>), String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let obj = v
        .as_object()
        .ok_or("not a JSON object of location -> [[preferred NICs], [available NICs]]")?;
    let mut m = Matrix::new();
    let mut unknown = Vec::new();
    for (loc, lists) in obj {
        let bad = || format!("{loc:?}: expected [[preferred NIC names], [available NIC names]]");
        let arr = lists
            .as_array()
            .filter(|a| !a.is_empty() && a.len() <= 2)
            .ok_or_else(bad)?;
        let mut tiers: [Vec<String>; 2] = Default::default();
        for (tier, list) in tiers.iter_mut().zip(arr) {
            for name in list.as_array().ok_or_else(bad)? {
                let name = name.as_str().ok_or_else(bad)?;
                if ours.iter().any(|o| o == name) {
                    tier.push(name.to_string());
                } else if !unknown.iter().any(|u| u == name) {
                    unknown.push(name.to_string());
                }
            }
        }
        if !tiers[0].is_empty() || !tiers[1].is_empty() {
            m.insert(loc.clone(), tiers);
        }
    }
    Ok((m, unknown))
}

/// The matrix as the descriptor publishes it.
pub(crate) fn to_json(m: &Matrix) -> Map<String, Value> {
    m.iter()
        .map(|(k, [p, a])| (k.clone(), json!([p, a])))
        .collect()
}

/// Which of `ours` (the local NICs, in order) carry memory at `location`: its preferred NICs;
/// if it names none of ours, its available ones; if none either (or the location is not in
/// the matrix), all.
pub(crate) fn mask(m: &Matrix, location: &str, ours: &[String]) -> Vec<bool> {
    if let Some([pref, avail]) = m.get(location) {
        for tier in [pref, avail] {
            let v: Vec<bool> = ours.iter().map(|n| tier.contains(n)).collect();
            if v.iter().any(|&b| b) {
                return v;
            }
        }
    }
    vec![true; ours.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn place(name: &str, numa: Option<u32>, pci: &str) -> Place {
        Place {
            name: name.into(),
            numa,
            pci: Some(PathBuf::from(pci)),
        }
    }

    /// Two sockets, two NICs each; GPU 0 under the same PCIe switch as mlx5_1.
    fn host() -> Vec<Place> {
        vec![
            place(
                "mlx5_0",
                Some(0),
                "/sys/devices/pci0000:00/0000:00:01.0/0000:10:00.0",
            ),
            place(
                "mlx5_1",
                Some(0),
                "/sys/devices/pci0000:00/0000:00:02.0/0000:11:00.0/0000:12:00.0",
            ),
            place(
                "mlx5_2",
                Some(1),
                "/sys/devices/pci0000:80/0000:80:01.0/0000:90:00.0",
            ),
            place(
                "mlx5_3",
                Some(1),
                "/sys/devices/pci0000:80/0000:80:02.0/0000:91:00.0",
            ),
        ]
    }

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn cpu_locations_prefer_their_numa_nodes_nics() {
        let m = cpu_entries(&host(), &[0, 1]);
        assert_eq!(
            m["cpu:0"],
            [names(&["mlx5_0", "mlx5_1"]), names(&["mlx5_2", "mlx5_3"])]
        );
        assert_eq!(
            m["cpu:1"],
            [names(&["mlx5_2", "mlx5_3"]), names(&["mlx5_0", "mlx5_1"])]
        );
        // Software NICs (no NUMA node): available everywhere, preferred nowhere, as Mooncake.
        let soft = [Place {
            name: "rxe0".into(),
            numa: None,
            pci: None,
        }];
        assert_eq!(
            cpu_entries(&soft, &[0])["cpu:0"],
            [vec![], names(&["rxe0"])]
        );
    }

    #[test]
    fn a_gpu_prefers_the_nics_nearest_on_pcie_within_its_numa_node() {
        let gpu = place(
            "cuda:0",
            Some(0),
            "/sys/devices/pci0000:00/0000:00:02.0/0000:11:00.0/0000:13:00.0",
        );
        assert_eq!(
            gpu_entry(&host(), &gpu),
            [names(&["mlx5_1"]), names(&["mlx5_0", "mlx5_2", "mlx5_3"])]
        );
        // No NUMA information on the GPU: every NIC is a candidate, the nearest wins.
        let gpu = place(
            "cuda:1",
            None,
            "/sys/devices/pci0000:80/0000:80:01.0/0000:90:00.0/0000:95:00.0",
        );
        assert_eq!(gpu_entry(&host(), &gpu)[0], names(&["mlx5_2"]));
        // Unknown PCI paths: all equally far, so all of the node's NICs are preferred.
        let gpu = Place {
            name: "cuda:2".into(),
            numa: Some(1),
            pci: None,
        };
        assert_eq!(
            gpu_entry(&host(), &gpu),
            [names(&["mlx5_2", "mlx5_3"]), names(&["mlx5_0", "mlx5_1"])]
        );
    }

    #[test]
    fn pcie_distance_counts_the_components_past_the_common_prefix() {
        let p = |s: &str| PathBuf::from(s);
        assert_eq!(pci_distance(Some(&p("/a/b/c")), Some(&p("/a/b/d"))), 2);
        assert_eq!(pci_distance(Some(&p("/a/b/c")), Some(&p("/a/x/y/z"))), 5);
        assert_eq!(pci_distance(None, Some(&p("/a"))), usize::MAX);
    }

    #[test]
    fn the_mask_falls_back_from_preferred_to_available_to_all() {
        let ours = names(&["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]);
        let m = cpu_entries(&host(), &[0, 1]);
        assert_eq!(mask(&m, "cpu:1", &ours), [false, false, true, true]);
        assert_eq!(
            mask(&m, "cpu:7", &ours),
            [true; 4],
            "a location not in the matrix: every NIC"
        );
        assert_eq!(mask(&m, "*", &ours), [true; 4]);
        let soft = cpu_entries(
            &[
                Place {
                    name: "rxe0".into(),
                    numa: None,
                    pci: None,
                },
                Place {
                    name: "rxe_lo".into(),
                    numa: None,
                    pci: None,
                },
            ],
            &[0],
        );
        assert_eq!(
            mask(&soft, "cpu:0", &names(&["rxe0", "rxe_lo"])),
            [true, true],
            "no preferred NIC: the available ones"
        );
        // Only some of our NICs filtered in (KVFERRY_RDMA_DEVICES): the preferred among them.
        assert_eq!(
            mask(&m, "cpu:0", &names(&["mlx5_1", "mlx5_2"])),
            [true, false]
        );
    }

    #[test]
    fn a_custom_matrix_file_is_read_and_checked() {
        let ours = names(&["mlx5_0", "mlx5_1"]);
        let (m, unknown) = parse(
            r#"{"cpu:0": [["mlx5_1"], ["mlx5_0", "mlx5_9"]], "cuda:0": [["mlx5_7"]]}"#,
            &ours,
        )
        .unwrap();
        assert_eq!(m["cpu:0"], [names(&["mlx5_1"]), names(&["mlx5_0"])]);
        assert!(
            !m.contains_key("cuda:0"),
            "a location with none of our NICs is dropped"
        );
        assert_eq!(unknown, names(&["mlx5_9", "mlx5_7"]));
        assert_eq!(to_json(&m)["cpu:0"], json!([["mlx5_1"], ["mlx5_0"]]));
        for bad in [
            "[1]",
            r#"{"cpu:0": "mlx5_0"}"#,
            r#"{"cpu:0": [[1]]}"#,
            r#"{"cpu:0": []}"#,
            "{",
        ] {
            assert!(parse(bad, &ours).is_err(), "{bad}");
        }
    }

    #[test]
    fn sysfs_places_and_numa_nodes_are_read() {
        let root = std::env::temp_dir().join(format!("kvf-topo-{}", std::process::id()));
        let pci = root.join("devices/pci0000:00/0000:00:01.0/0000:17:00.0");
        std::fs::create_dir_all(&pci).unwrap();
        std::fs::write(pci.join("numa_node"), "1\n").unwrap();
        std::fs::create_dir_all(root.join("ib/mlx5_0")).unwrap();
        std::os::unix::fs::symlink(&pci, root.join("ib/mlx5_0/device")).unwrap();
        let p = nic_place(&root.join("ib"), "mlx5_0");
        assert_eq!(
            (p.numa, p.pci),
            (Some(1), Some(std::fs::canonicalize(&pci).unwrap()))
        );
        std::fs::create_dir_all(root.join("bus")).unwrap();
        std::os::unix::fs::symlink(&pci, root.join("bus/0000:17:00.0")).unwrap();
        assert_eq!(
            gpu_place(&root.join("bus"), 0, "0000:17:00.0").numa,
            Some(1)
        );
        for n in ["node0", "node1", "possible"] {
            std::fs::create_dir_all(root.join("node").join(n)).unwrap();
        }
        assert_eq!(numa_nodes(&root.join("node")), vec![0, 1]);
        assert_eq!(numa_nodes(&root.join("none")), vec![0]);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
