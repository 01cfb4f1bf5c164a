//! The disk tier end to end in one process: a master (offload on) on 127.0.0.1 and clients
//! with disk tiers, beating by hand (their threads' interval is an hour), so every step is
//! driven by the test, none waited for.

use super::super::{Client, ClientConfig};
use crate::error::StoreError;
use crate::master::{KeyInfo, MasterConfig};
use crate::node::Master;
use crate::proto::ReplicateConfig;
use crate::server::MasterServer;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const KIB: usize = 1024;

fn master() -> (MasterServer, String) {
    let m = Arc::new(Master::new(MasterConfig {
        offload_timeout: Duration::from_secs(60),
        ..MasterConfig::default()
    }));
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    (
        MasterServer::start(m, l, Duration::from_millis(20), 0).unwrap(),
        addr,
    )
}

fn client(master: &str, dir: &Path, capacity: u64) -> Result<Client, StoreError> {
    Client::setup(ClientConfig {
        master_server_addr: master.into(),
        global_segment_size: 1 << 20,
        local_buffer_size: 4 << 20,
        ssd_offload_path: Some(dir.to_path_buf()),
        ssd_offload_capacity: capacity,
        offload_interval: Duration::from_secs(3600),
        ..ClientConfig::default()
    })
}

fn value(key: &str, len: usize) -> Vec<u8> {
    let seed = format!("{key}:");
    seed.bytes().cycle().take(len).collect()
}

/// Puts `keys` of 200 KiB each, one after the other (the first is the least recently used).
fn put_all(c: &Client, keys: &[&str]) {
    for k in keys {
        c.put(k, &value(k, 200 * KIB), &ReplicateConfig::default())
            .unwrap();
    }
}

/// The master's background eviction of `bytes`, now.
fn evict(s: &MasterServer, bytes: usize) -> u64 {
    let m = &s.master;
    let now = m.now();
    m.lock()
        .evict_background(bytes as u64, now, true, &m.stats, 0)
}

fn info(s: &MasterServer, key: &str) -> Option<KeyInfo> {
    let now = s.master.now();
    s.master.lock().key_info(key, now)
}

/// Evicted objects go to the client's disk: served from memory until the client persisted
/// them and said so, then their memory is freed and the master names the disk copy (the
/// record holds the value). The client restarts on the directory: the records it reports are
/// named again, now at its new address. A second client given the same directory is
/// refused by name.
#[test]
fn evicted_objects_land_on_the_clients_disk_and_survive_its_restart() {
    let (s, addr) = master();
    let dir = tempfile::tempdir().unwrap();
    let a = client(&addr, dir.path(), 1 << 30).unwrap();
    assert_eq!(a.offload_beat().unwrap(), 0, "binds the disk");
    put_all(&a, &["k0", "k1", "k2", "k3"]);
    let used = s.master.lock().used_bytes();
    assert_eq!(evict(&s, 400 * KIB), 400 * 1024);
    assert_eq!(s.master.lock().used_bytes(), used, "nothing freed yet");
    for k in ["k0", "k1", "k2", "k3"] {
        assert_eq!(a.get(k).unwrap(), value(k, 200 * KIB), "served from memory");
    }
    assert_eq!(a.offload_beat().unwrap(), 2, "two tasks carried out");
    let disk = a.disk_tier().unwrap();
    // (Which two: the least recently used; the four were put within the same millisecond.)
    let on_disk: Vec<&str> = ["k0", "k1", "k2", "k3"]
        .into_iter()
        .filter(|k| disk.contains(k))
        .collect();
    assert_eq!(on_disk.len(), 2, "{on_disk:?}");
    for k in &on_disk {
        assert_eq!(disk.get(k).unwrap().unwrap(), value(k, 200 * KIB));
        assert!(
            info(&s, k).unwrap().disk_replica.is_none(),
            "not before the report"
        );
    }
    assert_eq!(a.offload_beat().unwrap(), 0, "reports them done");
    let freed = s.master.lock().used_bytes();
    assert!(freed <= used - 400 * 1024, "{freed} of {used}");
    for k in &on_disk {
        let i = info(&s, k).unwrap();
        assert!(i.replicas.is_empty() && i.complete, "{i:?}");
        assert_eq!(i.disk_replica.as_ref().unwrap().disk, disk.id());
        assert!(a.is_exist(k).unwrap());
    }
    let in_memory: Vec<&str> = ["k0", "k1", "k2", "k3"]
        .into_iter()
        .filter(|k| !on_disk.contains(k))
        .collect();
    // A second client on the same directory: refused while the first holds it.
    let other = tempfile::tempdir().unwrap();
    let e = client(&addr, dir.path(), 1 << 30).err().unwrap();
    assert!(e.to_string().contains("in use by another process"), "{e}");
    drop(other);
    // The first restarts (closes; a new process opens the directory).
    let id = disk.id();
    a.close().unwrap();
    drop(a);
    let b = client(&addr, dir.path(), 1 << 30).unwrap();
    assert_eq!(b.disk_tier().unwrap().id(), id);
    assert_eq!(b.offload_beat().unwrap(), 0);
    for k in &on_disk {
        let d = info(&s, k).unwrap().disk_replica.unwrap();
        assert_eq!((d.disk, d.endpoint.as_str()), (id, b.segment_name()));
        assert_eq!(
            b.disk_tier().unwrap().get(k).unwrap().unwrap(),
            value(k, 200 * KIB)
        );
    }
    for k in &in_memory {
        assert!(
            info(&s, k).is_none(),
            "{k} was in memory only, in the closed segment"
        );
    }
}

/// A disk full mid-offload evicts its least recently used record (the master told first:
/// that object is gone) and persists the new one; a value larger than the disk tier fails,
/// and its object is evicted as without a disk; a directory removed under the client fails
/// every task the same way. Never a copy named that the disk does not hold.
#[test]
fn a_full_or_vanished_disk_fails_offloads_cleanly() {
    let (s, addr) = master();
    let dir = tempfile::tempdir().unwrap();
    // Room for one record of 200 KiB (and its header), not two.
    let a = client(&addr, dir.path(), 300 * 1024).unwrap();
    a.offload_beat().unwrap();
    put_all(&a, &["k0", "k1", "k2", "k3"]);
    evict(&s, 400 * KIB);
    assert_eq!(a.offload_beat().unwrap(), 2);
    a.offload_beat().unwrap();
    // One of the two was persisted, then evicted from the disk for the other (the master
    // told first: that object is gone).
    let disk = a.disk_tier().unwrap();
    let on_disk: Vec<&str> = ["k0", "k1", "k2", "k3"]
        .into_iter()
        .filter(|k| disk.contains(k))
        .collect();
    assert_eq!(on_disk.len(), 1, "{on_disk:?}");
    let gone: Vec<&str> = ["k0", "k1", "k2", "k3"]
        .into_iter()
        .filter(|k| info(&s, k).is_none())
        .collect();
    assert_eq!(gone.len(), 1, "{gone:?}");
    assert!(info(&s, on_disk[0]).unwrap().disk_replica.is_some());
    let left: Vec<&str> = ["k0", "k1", "k2", "k3"]
        .into_iter()
        .filter(|k| !on_disk.contains(k) && !gone.contains(k))
        .collect();
    // The directory goes: the next offload fails, and its object is evicted.
    std::fs::remove_dir_all(dir.path()).unwrap();
    evict(&s, 200 * KIB);
    assert_eq!(a.offload_beat().unwrap(), 1);
    a.offload_beat().unwrap();
    let evicted: Vec<&str> = left
        .iter()
        .copied()
        .filter(|k| info(&s, k).is_none())
        .collect();
    assert_eq!(evicted.len(), 1, "the failed offload's object is evicted");
    assert!(!a.is_exist(evicted[0]).unwrap());
    for k in left.iter().filter(|k| !evicted.contains(k)) {
        assert_eq!(a.get(k).unwrap(), value(k, 200 * KIB), "untouched");
    }
    // A value larger than the disk tier.
    let small = tempfile::tempdir().unwrap();
    let (s, addr) = master();
    let b = client(&addr, small.path(), 100 * 1024).unwrap();
    b.offload_beat().unwrap();
    put_all(&b, &["big"]);
    evict(&s, 1);
    assert_eq!(b.offload_beat().unwrap(), 1);
    b.offload_beat().unwrap();
    assert!(info(&s, "big").is_none());
    assert!(!b.disk_tier().unwrap().contains("big"));
}
