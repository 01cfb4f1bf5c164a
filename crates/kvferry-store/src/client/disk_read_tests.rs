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

/// One staging request's records are read at once (on the owner's readers) and each lands
/// in its own block with its own bytes; what is not on the disk is absent; the staging
/// buffer still bounds what one request stages (the rest: `Later`), and released space is
/// staged again.
#[test]
fn one_request_stages_its_records_at_once_within_the_buffer() {
    use super::{DiskAnswer, DiskCall, Staging};
    let (s, addr) = master();
    let dir = tempfile::tempdir().unwrap();
    let a = owner(&addr, dir.path(), 1 << 20);
    let (on_disk, in_memory) = offload_half(&s, &a);
    let stager = a.inner.stager.as_ref().unwrap();
    let stage = |keys: &[&str]| {
        let items = keys
            .iter()
            .map(|k| (k.to_string(), (200 * KIB) as u64))
            .collect();
        match a.inner.serve_disk(DiskCall::Stage { items }) {
            DiskAnswer::Staged { batch, items, .. } => (batch, items),
            other => panic!("{other:?}"),
        }
    };
    let staged_bytes = |at: u64| stager.buf.slice((at - stager.addr()) as usize, 200 * KIB);
    let (batch, got) = stage(&[on_disk[0], in_memory[0], on_disk[1]]);
    let (Staging::At { addr: x }, Staging::Absent, Staging::At { addr: y }) =
        (&got[0], &got[1], &got[2])
    else {
        panic!("{got:?}");
    };
    assert_ne!(x, y);
    assert_eq!(staged_bytes(*x), &value(on_disk[0], 200 * KIB)[..]);
    assert_eq!(staged_bytes(*y), &value(on_disk[1], 200 * KIB)[..]);
    a.inner.serve_disk(DiskCall::Release { batch });

    // A buffer that holds one value: the first staged, the second later; then it fits.
    let dir2 = tempfile::tempdir().unwrap();
    let (s2, addr2) = master();
    let c = owner(&addr2, dir2.path(), 256 * 1024);
    let (on_disk, _) = offload_half(&s2, &c);
    let stager = c.inner.stager.as_ref().unwrap();
    let items = |keys: &[&str]| DiskCall::Stage {
        items: keys
            .iter()
            .map(|k| (k.to_string(), (200 * KIB) as u64))
            .collect(),
    };
    let DiskAnswer::Staged {
        batch, items: got, ..
    } = c.inner.serve_disk(items(&on_disk))
    else {
        panic!()
    };
    assert!(
        matches!(&got[..], [Staging::At { .. }, Staging::Later]),
        "{got:?}"
    );
    c.inner.serve_disk(DiskCall::Release { batch });
    let DiskAnswer::Staged { items: got, .. } = c.inner.serve_disk(items(&on_disk[1..])) else {
        panic!()
    };
    let [Staging::At { addr: at }] = &got[..] else {
        panic!("{got:?}")
    };
    assert_eq!(
        stager.buf.slice((at - stager.addr()) as usize, 200 * KIB),
        &value(on_disk[1], 200 * KIB)[..]
    );
    drop(s);
}

/// Readers on several threads get objects from one owner whose staging buffer holds one
/// value at a time: each gets its value's bytes (the requests wait their turn for the
/// space, or are staged in rounds), none fails.
#[test]
fn concurrent_readers_share_a_bounded_staging_buffer() {
    let (s, addr) = master();
    let dir = tempfile::tempdir().unwrap();
    let a = owner(&addr, dir.path(), 256 * 1024);
    let (on_disk, _) = offload_half(&s, &a);
    std::thread::scope(|sc| {
        for t in 0..4 {
            let (addr, on_disk) = (&addr, &on_disk);
            sc.spawn(move || {
                let b = reader(addr, Duration::from_secs(10));
                for round in 0..3 {
                    for k in on_disk {
                        // Four readers take turns at a buffer with room for one value: a
                        // request that found it full for `SPACE_WAIT` is refused saying
                        // "retry" (on a loaded host, when the others' turns run long), and
                        // a retry gets the value.
                        let deadline = Instant::now() + Duration::from_secs(60);
                        let got = loop {
                            match b.get(k) {
                                Err(StoreError::TransferFailed(e))
                                    if e.contains("stayed full for")
                                        && Instant::now() < deadline => {}
                                r => break r.unwrap(),
                            }
                        };
                        assert_eq!(got, value(k, 200 * KIB), "{k}, reader {t}, round {round}");
                    }
                }
            });
        }
    });
}

/// A batch over objects on the disks of two owners and in memory returns each value's bytes,
/// into `get_batch`'s buffers and into registered memory (the owners are read at once, and
/// the memory part beside them).
#[test]
fn a_batch_over_several_owners_returns_each_values_bytes() {
    let (s, addr) = master();
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let owners = [
        owner(&addr, d1.path(), 1 << 20),
        owner(&addr, d2.path(), 1 << 20),
    ];
    let keys: Vec<String> = (0..8).map(|i| format!("m{i}")).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    for o in &owners {
        o.offload_beat().unwrap();
    }
    for (i, k) in keys.iter().enumerate() {
        owners[i % 2]
            .put(k, &value(k, 200 * KIB), &ReplicateConfig::default())
            .unwrap();
    }
    let m = &s.master;
    let now = m.now();
    m.lock()
        .evict_background(1200 * 1024, now, true, &m.stats, 0);
    for o in &owners {
        o.offload_beat().unwrap();
        o.offload_beat().unwrap();
    }
    let held: Vec<usize> = owners
        .iter()
        .map(|o| {
            keys.iter()
                .filter(|k| o.disk_tier().unwrap().contains(k))
                .count()
        })
        .collect();
    assert!(
        held.iter().all(|&n| n > 0),
        "objects on each disk: {held:?}"
    );
    let b = reader(&addr, Duration::from_secs(5));
    for (k, v) in keys.iter().zip(b.get_batch(&keys)) {
        assert_eq!(v.unwrap(), value(k, 200 * KIB), "{k}");
    }
    let mut buf = vec![0u8; keys.len() * 256 * KIB];
    let base = buf.as_mut_ptr() as u64;
    b.register_buffer(base, buf.len() as u64).unwrap();
    let items: Vec<(&str, u64, u64)> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| (*k, base + (i * 256 * KIB) as u64, (256 * KIB) as u64))
        .collect();
    for (k, r) in keys.iter().zip(b.batch_get_into(&items)) {
        assert_eq!(r.unwrap(), 200 * 1024, "{k}");
    }
    b.unregister_buffer(base).unwrap();
    for (i, k) in keys.iter().enumerate() {
        let at = i * 256 * KIB;
        assert_eq!(&buf[at..at + 200 * KIB], &value(k, 200 * KIB)[..], "{k}");
    }
}
