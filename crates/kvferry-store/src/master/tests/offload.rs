//! Offload on eviction (the disk tier's side in the state machine, `master/offload.rs`):
//! what a background eviction hands to a client's disk, when its memory is freed, what a
//! report the state does not expect does, and what a takeover keeps. Test code only
//! (`#[cfg(test)]`, declared so for the boundary check).

use super::*;
use crate::proto::{OffloadBeat, OffloadDone, OffloadOrders, Response};

const KIB: u64 = 1024;
/// Client 1's disk.
const DISK: u64 = 0xd15c;
const TIMEOUT: u64 = 5_000;

/// Segment 1 (client 1's, 1 MiB) with offload on and client 1's disk known; four objects
/// of 256 KiB put at times 0..4, so that evicting 256 KiB takes "k0" first.
fn offloading() -> (State, MasterConfig, Stats) {
    let (mut st, m, s) = setup(&[(1, 1 << 20)]);
    st.set_offload(TIMEOUT, 100);
    assert_eq!(
        beat(&mut st, &s, 1, OffloadBeat::default(), 0),
        OffloadOrders::default()
    );
    for i in 0..4u64 {
        put(
            &mut st,
            &m,
            &s,
            &format!("k{i}"),
            256 * KIB,
            &Default::default(),
            i,
        )
        .unwrap();
    }
    (st, m, s)
}

/// Client `client`'s beat for [`DISK`] at `now` (its endpoint "disk:1").
fn beat(st: &mut State, s: &Stats, client: u64, b: OffloadBeat, now: u64) -> OffloadOrders {
    let b = OffloadBeat {
        disk: DISK,
        endpoint: "disk:1".into(),
        ..b
    };
    st.offload_beat(client, &b, now, s).unwrap()
}

fn done(task: u64, key: &str) -> OffloadBeat {
    OffloadBeat {
        done: vec![OffloadDone {
            task,
            key: key.into(),
        }],
        ..Default::default()
    }
}

fn located(st: &mut State, key: &str, now: u64) -> StoreResult<Response> {
    st.locate(key, now, 1_000)
}

/// The whole path: a background eviction hands "k0" to client 1's disk and counts its bytes
/// as freed, but its memory stays used and it stays readable from memory until the client
/// reports it persisted; then its memory is freed and reads are sent to the disk copy, which
/// `key_info` and the summary show.
#[test]
fn an_evicted_object_stays_in_memory_until_its_disk_copy_is_reported() {
    let (mut st, _m, s) = offloading();
    let used = st.used_bytes();
    let freed = st.evict_background(256 * KIB, 10_000, true, &s, 0);
    assert_eq!(freed, 256 * KIB);
    assert_eq!(st.used_bytes(), used, "nothing is freed before the report");
    assert_eq!(st.offloads_in_flight(), 1);
    match located(&mut st, "k0", 10_001) {
        Ok(Response::ReplicaList(l)) => {
            assert_eq!(l.replicas.len(), 1);
            st.release_reads(&[l.read_id], 10_001);
        }
        other => panic!("{other:?}"),
    }
    let orders = beat(&mut st, &s, 1, OffloadBeat::default(), 10_002);
    assert_eq!(orders.tasks.len(), 1);
    let t = &orders.tasks[0];
    assert_eq!((t.key.as_str(), t.size), ("k0", 256 * KIB));
    assert_eq!(t.addr, 1 << 32, "k0's bytes, in client 1's segment");
    assert_eq!(st.used_bytes(), used);
    let after = beat(&mut st, &s, 1, done(t.task, "k0"), 10_003);
    assert!(after.drop.is_empty() && after.tasks.is_empty(), "{after:?}");
    assert_eq!(st.used_bytes(), used - 256 * KIB, "freed once reported");
    match located(&mut st, "k0", 10_004) {
        Ok(Response::DiskReplica(d)) => {
            assert_eq!(
                (d.disk.endpoint.as_str(), d.disk.disk, d.size),
                ("disk:1", DISK, 256 * KIB)
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(st.exist_key("k0", 10_005, 1_000), Ok(true));
    let info = st.key_info("k0", 10_005).unwrap();
    assert!(info.replicas.is_empty() && info.complete);
    assert_eq!(info.disk_replica.unwrap().disk, DISK);
    assert_eq!(st.summary().keys, 4);
    assert_eq!(st.offloads_in_flight(), 0);
    // A put of the key is refused as for any object there; the others still read from memory.
    assert!(matches!(
        put(&mut st, &_m, &s, "k0", 10, &Default::default(), 10_006),
        Err(StoreError::ObjectAlreadyExists(_))
    ));
    assert!(matches!(
        located(&mut st, "k1", 10_007),
        Ok(Response::ReplicaList(_))
    ));
}

/// A read given the memory replica while the offload ran keeps it: the report records the
/// disk copy, but the space comes back only once that read is released.
#[test]
fn a_read_in_flight_keeps_the_memory_an_offload_frees() {
    let (mut st, _m, s) = offloading();
    let used = st.used_bytes();
    st.evict_background(256 * KIB, 10_000, true, &s, 0);
    let t = beat(&mut st, &s, 1, OffloadBeat::default(), 10_001).tasks[0].task;
    let read = match located(&mut st, "k0", 10_002) {
        Ok(Response::ReplicaList(l)) => l.read_id,
        other => panic!("{other:?}"),
    };
    beat(&mut st, &s, 1, done(t, "k0"), 10_003);
    assert!(matches!(
        located(&mut st, "k0", 10_004),
        Ok(Response::DiskReplica(_))
    ));
    assert_eq!(st.used_bytes(), used, "a reader may still be reading it");
    st.release_reads(&[read], 10_005);
    assert_eq!(st.used_bytes(), used - 256 * KIB);
}

/// A task not reported within the timeout ends as the eviction would have without a disk:
/// the object is evicted and its space freed. A late report of it records nothing, and the
/// client is told to delete the record; so is one for a task never given.
#[test]
fn an_offload_not_reported_in_time_is_evicted_and_its_late_record_dropped() {
    let (mut st, _m, s) = offloading();
    let used = st.used_bytes();
    st.evict_background(256 * KIB, 10_000, true, &s, 0);
    let t = beat(&mut st, &s, 1, OffloadBeat::default(), 10_001).tasks[0].task;
    st.expire_offloads(10_000 + TIMEOUT - 1, &s);
    assert_eq!(st.used_bytes(), used, "not yet");
    st.expire_offloads(10_000 + TIMEOUT, &s);
    assert_eq!(st.used_bytes(), used - 256 * KIB);
    assert!(matches!(
        located(&mut st, "k0", 20_000),
        Err(StoreError::ObjectNotFound(_))
    ));
    assert_eq!(
        s.evicted_objects.load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    let late = beat(&mut st, &s, 1, done(t, "k0"), 20_001);
    assert_eq!(late.drop, vec!["k0".to_string()]);
    let unknown = beat(&mut st, &s, 1, done(999, "k1"), 20_002);
    assert_eq!(unknown.drop, vec!["k1".to_string()], "k1 has no copy there");
    assert!(matches!(
        located(&mut st, "k1", 20_003),
        Ok(Response::ReplicaList(_))
    ));
}

/// A task the client reports failed (its disk full, an I/O error) evicts the object as
/// without a disk; until then it was served from memory.
#[test]
fn an_offload_reported_failed_evicts_the_object() {
    let (mut st, _m, s) = offloading();
    let used = st.used_bytes();
    st.evict_background(256 * KIB, 10_000, true, &s, 0);
    let t = beat(&mut st, &s, 1, OffloadBeat::default(), 10_001).tasks[0].task;
    assert!(matches!(
        located(&mut st, "k0", 10_002),
        Ok(Response::ReplicaList(_))
    ));
    let b = OffloadBeat {
        failed: vec![t],
        ..Default::default()
    };
    beat(&mut st, &s, 1, b, 10_003);
    assert!(matches!(
        located(&mut st, "k0", 10_004),
        Err(StoreError::ObjectNotFound(_))
    ));
    // (The read taken at 10_002 holds the space until it ends.)
    st.expire_reads(20_000);
    assert_eq!(st.used_bytes(), used - 256 * KIB);
}

/// An upsert replaces the value: a disk copy of the old one is never served again, and the
/// client is told to delete it; one being made when the upsert ended is dropped at its
/// report. A removal drops a disk copy too.
#[test]
fn an_upsert_or_a_removal_drops_the_disk_copy() {
    let (mut st, m, s) = offloading();
    st.evict_background(256 * KIB, 10_000, true, &s, 0);
    let t = beat(&mut st, &s, 1, OffloadBeat::default(), 10_001).tasks[0].task;
    beat(&mut st, &s, 1, done(t, "k0"), 10_002);
    let up = PutId { client: 1, put: 9 };
    st.put_start(&m, &s, up, "k0", 100, &Default::default(), true, 10_003)
        .unwrap();
    assert!(
        matches!(located(&mut st, "k0", 10_004), Ok(Response::DiskReplica(_))),
        "the old value until the upsert ends"
    );
    st.put_end(up, "k0", 10_005).unwrap();
    match located(&mut st, "k0", 10_006) {
        Ok(Response::ReplicaList(l)) => assert_eq!(l.size, 100),
        other => panic!("{other:?}"),
    }
    assert!(st.key_info("k0", 10_006).unwrap().disk_replica.is_none());
    assert_eq!(
        beat(&mut st, &s, 1, OffloadBeat::default(), 10_007).drop,
        vec!["k0".to_string()]
    );
    // An upsert while the copy is being made: the report is refused and the record dropped.
    st.evict_background(200 * KIB, 20_000, true, &s, 0);
    let t = beat(&mut st, &s, 1, OffloadBeat::default(), 20_001).tasks[0].clone();
    let up = PutId { client: 1, put: 10 };
    st.put_start(&m, &s, up, &t.key, 50, &Default::default(), true, 20_002)
        .unwrap();
    st.put_end(up, &t.key, 20_003).unwrap();
    let o = beat(&mut st, &s, 1, done(t.task, &t.key), 20_004);
    assert_eq!(o.drop, vec![t.key.clone()]);
    assert!(
        matches!(located(&mut st, &t.key, 20_005), Ok(Response::ReplicaList(l)) if l.size == 50)
    );
    // A removal of an object on the disk only.
    st.evict_background(200 * KIB, 30_000, true, &s, 0);
    let t = beat(&mut st, &s, 1, OffloadBeat::default(), 30_001).tasks[0].clone();
    beat(&mut st, &s, 1, done(t.task, &t.key), 30_002);
    st.remove(&m, &t.key, false, 40_000).unwrap();
    assert!(matches!(
        located(&mut st, &t.key, 40_001),
        Err(StoreError::ObjectNotFound(_))
    ));
    assert_eq!(
        beat(&mut st, &s, 1, OffloadBeat::default(), 40_002).drop,
        vec![t.key.clone()]
    );
}

/// What the client reports left its disk (its own eviction, a corrupt record) is no longer
/// served: the object goes. After a restart it reports the records it found: those the
/// state names stay, the others it is told to delete. A client that stops pinging takes its
/// disk's copies with it.
#[test]
fn copies_that_left_the_disk_or_that_the_state_does_not_name_go() {
    let (mut st, _m, s) = offloading();
    st.evict_background(512 * KIB, 10_000, true, &s, 0);
    let tasks = beat(&mut st, &s, 1, OffloadBeat::default(), 10_001).tasks;
    assert_eq!(tasks.len(), 2);
    let b = OffloadBeat {
        done: tasks
            .iter()
            .map(|t| OffloadDone {
                task: t.task,
                key: t.key.clone(),
            })
            .collect(),
        ..Default::default()
    };
    beat(&mut st, &s, 1, b, 10_002);
    let b = OffloadBeat {
        evicted: vec!["k0".into()],
        ..Default::default()
    };
    beat(&mut st, &s, 1, b, 10_003);
    assert!(matches!(
        located(&mut st, "k0", 10_004),
        Err(StoreError::ObjectNotFound(_))
    ));
    assert!(matches!(
        located(&mut st, "k1", 10_004),
        Ok(Response::DiskReplica(_))
    ));
    // Client 1 restarts as client 2 on the same directory.
    st.register_client(2, 10_005);
    let b = OffloadBeat {
        recovered: vec![
            ("k1".into(), 256 * KIB),
            ("k0".into(), 256 * KIB),
            ("k2".into(), 256 * KIB),
            ("k1x".into(), 1),
        ],
        ..Default::default()
    };
    let mut drop = beat(&mut st, &s, 2, b, 10_006).drop;
    drop.sort();
    assert_eq!(drop, ["k0", "k1x", "k2"], "k2 is in memory only");
    assert!(
        matches!(located(&mut st, "k1", 10_007), Ok(Response::DiskReplica(d)) if d.disk.endpoint == "disk:1")
    );
    // Client 2 stops pinging (client 1 too): k1, on its disk only, goes.
    st.expire_clients(10_007 + 60_000, 10_000, 1_000);
    assert!(matches!(
        located(&mut st, "k1", 80_000),
        Err(StoreError::ObjectNotFound(_))
    ));
}

/// Without offload a beat is refused by name and the background eviction drops, as does a
/// put's eviction with it on, and with it on an object whose segment's client has no disk.
#[test]
fn without_a_disk_eviction_drops_as_before() {
    let (mut st, m, s) = setup(&[(1, 1 << 20)]);
    let e = st
        .offload_beat(1, &OffloadBeat::default(), 0, &s)
        .unwrap_err();
    assert!(e.to_string().contains("--enable_offload"), "{e}");
    put(&mut st, &m, &s, "a", 256 * KIB, &Default::default(), 0).unwrap();
    assert_eq!(st.evict_background(1, 10_000, true, &s, 0), 256 * KIB);
    assert_eq!(st.used_bytes(), 0);
    st.set_offload(TIMEOUT, 100);
    put(&mut st, &m, &s, "b", 256 * KIB, &Default::default(), 10_001).unwrap();
    assert_eq!(st.evict_background(1, 20_000, true, &s, 0), 256 * KIB);
    assert_eq!(
        (st.used_bytes(), st.offloads_in_flight()),
        (0, 0),
        "client 1 has no disk"
    );
    let (mut st, m, s) = offloading();
    let _ = m;
    let used = st.used_bytes();
    assert_eq!(st.evict_aged(1, 10_000, true, &s, 0), 256 * KIB);
    assert_eq!(
        (st.used_bytes(), st.offloads_in_flight()),
        (used - 256 * KIB, 0)
    );
}

/// A disk's tasks in flight are bounded (`--offloading_queue_limit`): past it, victims are
/// dropped as without a disk.
#[test]
fn a_disks_tasks_in_flight_are_bounded() {
    let (mut st, _m, s) = offloading();
    st.set_offload(TIMEOUT, 1);
    let used = st.used_bytes();
    assert_eq!(
        st.evict_background(512 * KIB, 10_000, true, &s, 0),
        512 * KIB
    );
    assert_eq!(st.offloads_in_flight(), 1);
    assert_eq!(st.used_bytes(), used - 256 * KIB, "the second was dropped");
}

/// Disk copies are journaled: a new leader built from the journal serves them once the
/// disk's client reported to it (which client holds which disk is not journaled), and a
/// copy that left the disk is gone there too.
#[test]
fn disk_copies_survive_a_takeover() {
    let (mut st, _m, s) = offloading();
    st.journal_on();
    let mut image = changes::Image::default();
    for c in st.image(0) {
        image.apply(c);
    }
    st.evict_background(512 * KIB, 10_000, true, &s, 0);
    let tasks = beat(&mut st, &s, 1, OffloadBeat::default(), 10_001).tasks;
    let b = OffloadBeat {
        done: tasks
            .iter()
            .map(|t| OffloadDone {
                task: t.task,
                key: t.key.clone(),
            })
            .collect(),
        ..Default::default()
    };
    beat(&mut st, &s, 1, b, 10_002);
    let b = OffloadBeat {
        evicted: vec!["k1".into()],
        ..Default::default()
    };
    beat(&mut st, &s, 1, b, 10_003);
    let changes = st.take_changes(10_004);
    assert!(
        changes
            .iter()
            .any(|c| matches!(c, Change::Disk { key, copy: Some((DISK, _)) } if key == "k0")),
        "{changes:?}"
    );
    for c in changes {
        image.apply(c);
    }
    let (mut next, report) = image.into_state(2, 20_000, 1_000);
    assert_eq!(
        report.dropped_objects + report.dropped_replicas,
        0,
        "{report:?}"
    );
    next.set_offload(TIMEOUT, 100);
    assert!(matches!(
        located(&mut next, "k1", 20_001),
        Err(StoreError::ObjectNotFound(_))
    ));
    match located(&mut next, "k0", 20_001) {
        Ok(Response::DiskReplica(d)) => assert_eq!(
            (d.disk.disk, d.disk.endpoint.as_str()),
            (DISK, ""),
            "not readable until its client reports"
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(next.used_bytes(), 512 * KIB, "k2 and k3 in memory");
    beat(&mut next, &s, 1, OffloadBeat::default(), 20_002);
    assert!(
        matches!(located(&mut next, "k0", 20_003), Ok(Response::DiskReplica(d)) if d.disk.endpoint == "disk:1")
    );
    // An image taken now holds it too.
    let mut again = changes::Image::default();
    for c in next.image(20_004) {
        again.apply(c);
    }
    let (mut third, _) = again.into_state(3, 30_000, 1_000);
    assert!(matches!(
        located(&mut third, "k0", 30_001),
        Ok(Response::DiskReplica(_))
    ));
}

/// A put that needs space at once, with offload on, hands its victim to the disk as the
/// background eviction does (kept, readable from memory) and waits for it, instead of
/// dropping it; its space serves the put once the client reports the copy, and only the
/// put's last try drops. (Before, the first try dropped "k0".)
#[test]
fn a_put_that_needs_space_offloads_instead_of_dropping() {
    let (mut st, m, s) = offloading();
    let m = MasterConfig {
        eviction_ratio: 0.0,
        ..m
    };
    let id = PutId { client: 1, put: 99 };
    let cfg = ReplicateConfig::default();
    let first = st.put_start_ex(
        &m,
        &s,
        id,
        "k4",
        256 * KIB,
        &cfg,
        false,
        10_000,
        Attempt::First,
    );
    assert!(
        matches!(first, Err(StoreError::NoAvailableHandle { .. })),
        "{first:?}"
    );
    assert_eq!(st.offloads_in_flight(), 1, "k0 handed to the disk");
    assert!(st.key_info("k0", 10_000).is_some(), "not dropped");
    assert!(st.reads_in_flight(10_001), "the put waits for it");
    let orders = beat(&mut st, &s, 1, OffloadBeat::default(), 10_002);
    let t = &orders.tasks[0];
    assert_eq!(t.key, "k0");
    beat(&mut st, &s, 1, done(t.task, "k0"), 10_003);
    let again = st.put_start_ex(
        &m,
        &s,
        id,
        "k4",
        256 * KIB,
        &cfg,
        false,
        10_004,
        Attempt::Again,
    );
    assert!(again.is_ok(), "{again:?}");
    assert!(matches!(
        located(&mut st, "k0", 10_005),
        Ok(Response::DiskReplica(_))
    ));
    // The last try of another put drops (k1 evicted, not offloaded).
    let id2 = PutId {
        client: 1,
        put: 100,
    };
    let last = st.put_start_ex(
        &m,
        &s,
        id2,
        "k5",
        256 * KIB,
        &cfg,
        false,
        10_006,
        Attempt::Last,
    );
    assert!(last.is_ok(), "{last:?}");
    assert_eq!(st.offloads_in_flight(), 0);
}
