//! Gets served from a disk, in one process: a master (offload on) on 127.0.0.1, an owner
//! client whose disk holds objects (beating by hand), and readers. Nothing is waited for but
//! the calls themselves.

use super::super::{Client, ClientConfig};
use crate::error::StoreError;
use crate::master::MasterConfig;
use crate::node::Master;
use crate::proto::{OffloadBeat, ReplicateConfig};
use crate::server::MasterServer;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

const KIB: usize = 1024;
const KEYS: [&str; 4] = ["k0", "k1", "k2", "k3"];

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

fn owner(master: &str, dir: &Path, staging: u64) -> Client {
    Client::setup(ClientConfig {
        master_server_addr: master.into(),
        global_segment_size: 1 << 20,
        local_buffer_size: 4 << 20,
        ssd_offload_path: Some(dir.to_path_buf()),
        ssd_offload_staging_size: staging,
        offload_interval: Duration::from_secs(3600),
        ..ClientConfig::default()
    })
    .unwrap()
}

/// A client without a segment or a disk of its own.
fn reader(master: &str, timeout: Duration) -> Client {
    Client::setup(ClientConfig {
        master_server_addr: master.into(),
        global_segment_size: 0,
        local_buffer_size: 4 << 20,
        ssd_read_timeout: timeout,
        ..ClientConfig::default()
    })
    .unwrap()
}

fn value(key: &str, len: usize) -> Vec<u8> {
    let seed = format!("{key}:");
    seed.bytes().cycle().take(len).collect()
}

/// Puts the four keys (200 KiB each) from `a`, has the master evict half of them to `a`'s
/// disk, and returns (on disk, in memory).
fn offload_half(s: &MasterServer, a: &Client) -> (Vec<&'static str>, Vec<&'static str>) {
    a.offload_beat().unwrap();
    for k in KEYS {
        a.put(k, &value(k, 200 * KIB), &ReplicateConfig::default())
            .unwrap();
    }
    let m = &s.master;
    let now = m.now();
    m.lock()
        .evict_background(400 * 1024, now, true, &m.stats, 0);
    assert_eq!(a.offload_beat().unwrap(), 2);
    a.offload_beat().unwrap(); // reports them done: their memory is freed
    let (disk, memory): (Vec<&str>, Vec<&str>) = KEYS
        .into_iter()
        .partition(|k| a.disk_tier().unwrap().contains(k));
    for k in &disk {
        let i = s.master.lock().key_info(k, m.now()).unwrap();
        assert!(i.replicas.is_empty() && i.disk_replica.is_some(), "{i:?}");
    }
    (disk, memory)
}

/// An object only on the owner's disk is served to another client, to the owner itself, in
/// batches mixed with objects in memory (`get_batch`, `batch_get_into`), and its size is
/// known; a buffer too small for it fails as for memory. (Before, such a get failed with
/// "unexpected answer DiskReplica".)
#[test]
fn a_get_of_an_object_only_on_disk_is_served_through_its_owner() {
    let (s, addr) = master();
    let dir = tempfile::tempdir().unwrap();
    let a = owner(&addr, dir.path(), 1 << 20);
    let (on_disk, in_memory) = offload_half(&s, &a);
    let b = reader(&addr, Duration::from_secs(5));
    for k in &on_disk {
        assert_eq!(
            b.get(k).unwrap(),
            value(k, 200 * KIB),
            "{k} to another client"
        );
        assert_eq!(a.get(k).unwrap(), value(k, 200 * KIB), "{k} to its owner");
        assert_eq!(b.get_size(k).unwrap(), 200 * 1024);
    }
    let got = b.get_batch(&KEYS);
    for (k, v) in KEYS.iter().zip(got) {
        assert_eq!(v.unwrap(), value(k, 200 * KIB), "{k} in a mixed batch");
    }
    // Into registered memory: each key its own 256 KiB.
    let mut buf = vec![0u8; 4 * 256 * KIB];
    let base = buf.as_mut_ptr() as u64;
    b.register_buffer(base, buf.len() as u64).unwrap();
    let items: Vec<(&str, u64, u64)> = KEYS
        .iter()
        .enumerate()
        .map(|(i, k)| (*k, base + (i * 256 * KIB) as u64, (256 * KIB) as u64))
        .collect();
    for r in b.batch_get_into(&items) {
        assert_eq!(r.unwrap(), 200 * 1024);
    }
    for (i, k) in KEYS.iter().enumerate() {
        let at = i * 256 * KIB;
        assert_eq!(&buf[at..at + 200 * KIB], &value(k, 200 * KIB)[..], "{k}");
    }
    let small = b.get_into(on_disk[0], base, 1024).unwrap_err();
    assert!(matches!(small, StoreError::BufferOverflow { need, .. } if need == 200 * 1024));
    b.unregister_buffer(base).unwrap();
    assert_eq!(in_memory.len(), 2);
}

/// A record corrupted or truncated on the owner's disk is never served: the get reports the
/// object absent, the record is deleted, and after the owner's next beat the master no longer
/// names it.
#[test]
fn a_corrupt_or_truncated_record_is_absent_never_wrong() {
    let (s, addr) = master();
    let dir = tempfile::tempdir().unwrap();
    let a = owner(&addr, dir.path(), 1 << 20);
    let (on_disk, _) = offload_half(&s, &a);
    let b = reader(&addr, Duration::from_secs(5));
    let flipped = crate::disk::layout::object_path(dir.path(), on_disk[0]);
    let mut bytes = std::fs::read(&flipped).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&flipped, &bytes).unwrap();
    let cut = crate::disk::layout::object_path(dir.path(), on_disk[1]);
    let f = std::fs::OpenOptions::new().write(true).open(&cut).unwrap();
    f.set_len(1000).unwrap();
    drop(f);
    for k in &on_disk {
        match b.get(k) {
            Err(StoreError::ObjectNotFound(x)) => assert_eq!(&x, k),
            other => panic!("{k}: {other:?}"),
        }
        assert!(!a.disk_tier().unwrap().contains(k), "{k}'s record deleted");
    }
    a.offload_beat().unwrap();
    for k in &on_disk {
        assert!(!b.is_exist(k).unwrap(), "{k}: the master was told");
    }
}

/// A value larger than the owner's staging buffer is refused, naming the setting; values
/// that fit one at a time but not together are staged in rounds.
#[test]
fn staging_is_bounded_values_larger_than_it_are_refused_by_name() {
    let (s, addr) = master();
    let dir = tempfile::tempdir().unwrap();
    let a = owner(&addr, dir.path(), 256 * 1024);
    let (on_disk, _) = offload_half(&s, &a);
    let b = reader(&addr, Duration::from_secs(5));
    let got = b.get_batch(&on_disk);
    for (k, v) in on_disk.iter().zip(got) {
        assert_eq!(v.unwrap(), value(k, 200 * KIB), "{k}, one round each");
    }
    let dir2 = tempfile::tempdir().unwrap();
    let (s2, addr2) = master();
    let c = owner(&addr2, dir2.path(), 64 * 1024);
    let (on_disk, _) = offload_half(&s2, &c);
    let e = reader(&addr2, Duration::from_secs(5))
        .get(on_disk[0])
        .unwrap_err();
    assert!(e.to_string().contains("ssd_offload_staging_size"), "{e}");
    drop(s);
}

/// An owner that does not answer (stalled: its port takes the connection and says nothing)
/// fails the get after the reader's `ssd_read_timeout`, and one that is gone fails it at
/// once; neither hangs the get.
#[test]
fn a_stalled_or_dead_owner_fails_the_get_within_its_bound() {
    let (s, addr) = master();
    let dir = tempfile::tempdir().unwrap();
    let a = owner(&addr, dir.path(), 1 << 20);
    let (on_disk, _) = offload_half(&s, &a);
    // The master is told the disk is served at a port that never answers.
    let stalled = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = stalled.local_addr().unwrap().to_string();
    let beat = OffloadBeat {
        disk: a.disk_tier().unwrap().id(),
        endpoint: endpoint.clone(),
        ..OffloadBeat::default()
    };
    let m = &s.master;
    m.lock()
        .offload_beat(a.inner.id, &beat, m.now(), &m.stats)
        .unwrap();
    let bound = Duration::from_millis(300);
    let b = reader(&addr, bound);
    let t = Instant::now();
    let e = b.get(on_disk[0]).unwrap_err();
    let took = t.elapsed();
    assert!(e.to_string().contains("did not answer"), "{e}");
    assert!(e.to_string().contains(&endpoint), "{e}");
    assert!(
        took >= bound && took < bound + Duration::from_secs(2),
        "{took:?}"
    );
    drop(stalled); // gone: refused at connect
    let t = Instant::now();
    let e = b.get(on_disk[0]).unwrap_err();
    assert!(e.to_string().contains("did not answer"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}
