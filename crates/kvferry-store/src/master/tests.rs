//! The state machine's unit tests (time is an argument: each test drives it).

use super::*;
use crate::master::changes::Change;
use crate::proto::{PingStatus, ReplicateConfig, Request, Response};

// (`#[cfg(test)]` again: the boundary check takes a module declared so for test code.)
#[cfg(test)]
mod failover;
#[cfg(test)]
mod held;
#[cfg(test)]
mod offload;
#[cfg(test)]
mod reads;
#[cfg(test)]
mod tasks;

/// Client 1's put 1 (most tests start one put of a key at a time).
const P1: PutId = PutId { client: 1, put: 1 };

fn seg(id: u64, size: u64) -> Segment {
    Segment {
        id,
        name: format!("seg{id}"),
        te_endpoint: format!("127.0.0.1:{}", 15000 + id),
        base: id << 32,
        size,
    }
}

fn setup(segs: &[(u64, u64)]) -> (State, MasterConfig, Stats) {
    let mut st = State::default();
    for &(id, size) in segs {
        st.mount(id, seg(id, size), 0).unwrap();
    }
    (st, MasterConfig::default(), Stats::default())
}

fn put(
    st: &mut State,
    m: &MasterConfig,
    s: &Stats,
    key: &str,
    size: u64,
    cfg: &ReplicateConfig,
    now: u64,
) -> StoreResult<Vec<ReplicaDesc>> {
    let r = st.put_start(m, s, P1, key, size, cfg, false, now)?;
    st.put_end(P1, key, now)?;
    Ok(r)
}

/// Mooncake 0.3.14's `probe_key`: a probe answers like `ExistKey` but grants no read lease
/// (a remove right after succeeds, where one after `ExistKey` is refused) and leaves the
/// access time that orders eviction alone; a put not ended yet is not readable.
#[test]
fn a_probe_grants_no_lease_and_leaves_the_access_time() {
    let (mut st, m, s) = setup(&[(1, 1 << 20)]);
    let probe = |st: &mut State, key: &str, now: u64| {
        let mut removed = None;
        let req = Request::ProbeKey { key: key.into() };
        let a = st.apply(&m, &s, &req, now, Attempt::Last, 0, &mut removed);
        assert_eq!(a.needs, Needs::Nothing, "a probe changes nothing durable");
        match a.result {
            Ok(Response::Exists(b)) => b,
            other => panic!("ProbeKey answered {other:?}"),
        }
    };
    put(&mut st, &m, &s, "a", 100, &ReplicateConfig::default(), 10).unwrap();
    let before = st.objects.get("a").map(|o| (o.lease_until, o.last_access));
    assert!(probe(&mut st, "a", 20));
    assert!(!probe(&mut st, "missing", 20));
    assert_eq!(
        st.objects.get("a").map(|o| (o.lease_until, o.last_access)),
        before
    );
    st.remove(&m, "a", false, 21)
        .expect("no lease after a probe");
    put(&mut st, &m, &s, "a", 100, &ReplicateConfig::default(), 30).unwrap();
    assert!(st.exist_key("a", 31, 100).unwrap());
    assert!(matches!(
        st.remove(&m, "a", false, 32),
        Err(StoreError::ObjectHasLease(_))
    ));
    st.put_start(
        &m,
        &s,
        P1,
        "pending",
        100,
        &ReplicateConfig::default(),
        false,
        40,
    )
    .unwrap();
    assert!(
        !probe(&mut st, "pending", 41),
        "a put not ended is not readable"
    );
    assert!(matches!(st.probe_key(""), Err(StoreError::InvalidKey(_))));
}

/// A put naming more preferred segments than the master compares under its lock is
/// refused before any work.
#[test]
fn oversized_requests_are_refused_before_they_cost_the_lock() {
    let (mut st, m, s) = setup(&[(1, 1 << 20)]);
    let many = ReplicateConfig {
        preferred_segments: vec!["x".into(); MAX_PREFERRED + 1],
        ..Default::default()
    };
    assert!(
        matches!(st.put_start(&m, &s, P1, "k", 4096, &many, false, 0), Err(StoreError::InvalidParams(w)) if w.contains("preferred"))
    );
    let some = ReplicateConfig {
        preferred_segments: vec!["seg1".into(); MAX_PREFERRED],
        ..Default::default()
    };
    st.put_start(&m, &s, P1, "k", 4096, &some, false, 0)
        .expect("at the limit");
}

#[test]
fn put_get_exists_remove() {
    let (mut st, m, s) = setup(&[(1, 1 << 20)]);
    let r = put(&mut st, &m, &s, "a", 1000, &ReplicateConfig::default(), 0).unwrap();
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].te_endpoint, "127.0.0.1:15001");
    assert!(matches!(
        put(&mut st, &m, &s, "a", 10, &ReplicateConfig::default(), 1),
        Err(StoreError::ObjectAlreadyExists(_))
    ));
    let l = st.get_replica_list("a", 2, 100).unwrap();
    assert_eq!((l.size, l.replicas.len()), (1000, 1));
    assert!(matches!(
        st.remove(&m, "a", false, 50),
        Err(StoreError::ObjectHasLease(_))
    ));
    st.remove(&m, "a", false, 200).unwrap();
    assert!(matches!(
        st.get_replica_list("a", 201, 100),
        Err(StoreError::ObjectNotFound(_))
    ));
    assert!(!st.exist_key("a", 201, 100).unwrap());
    assert_eq!(st.used_bytes(), 0);
    assert!(matches!(
        st.get_replica_list("", 0, 1),
        Err(StoreError::InvalidKey(_))
    ));
}

#[test]
fn replicas_on_distinct_segments_and_preferred() {
    let (mut st, m, s) = setup(&[(1, 1 << 20), (2, 1 << 20), (3, 1 << 20)]);
    let cfg = ReplicateConfig {
        replica_num: 3,
        ..Default::default()
    };
    let r = put(&mut st, &m, &s, "k", 4096, &cfg, 0).unwrap();
    let mut eps: Vec<_> = r.iter().map(|d| d.te_endpoint.clone()).collect();
    eps.sort();
    eps.dedup();
    assert_eq!(eps.len(), 3, "one replica per segment");
    let cfg = ReplicateConfig {
        replica_num: 5,
        preferred_segments: vec!["seg2".into()],
        ..Default::default()
    };
    let r = put(&mut st, &m, &s, "k2", 4096, &cfg, 0).unwrap();
    assert_eq!(r.len(), 3, "best effort: only 3 segments");
    assert_eq!(r[0].te_endpoint, "127.0.0.1:15002", "preferred first");
    let m2 = MasterConfig {
        strategy: Strategy::FreeRatioFirst,
        ..MasterConfig::default()
    };
    let r = put(&mut st, &m2, &s, "k3", 4096, &ReplicateConfig::default(), 0).unwrap();
    assert_eq!(r.len(), 1);
}

/// The random strategy's start comes from the state's own generator: states seeded alike
/// place alike, and one seed's starts spread over every segment.
#[test]
fn the_random_start_is_the_states_own_and_seeded() {
    let segs: Vec<(u64, u64)> = (1..=4).map(|id| (id, 1 << 20)).collect();
    let firsts = |seed: u64| {
        let (mut st, m, s) = setup(&segs);
        st.seed_placement(seed);
        (0..64)
            .map(|i| {
                put(
                    &mut st,
                    &m,
                    &s,
                    &format!("k{i}"),
                    4096,
                    &ReplicateConfig::default(),
                    0,
                )
                .unwrap()[0]
                    .te_endpoint
                    .clone()
            })
            .collect::<Vec<_>>()
    };
    let a = firsts(7);
    assert_eq!(a, firsts(7), "the same seed: the same placements");
    assert_ne!(a, firsts(8), "another seed: other placements");
    let mut spread = a.clone();
    spread.sort();
    spread.dedup();
    assert_eq!(spread.len(), 4, "every segment is a start: {a:?}");
}

#[test]
fn too_large_and_full() {
    let (mut st, m, s) = setup(&[(1, 64 << 10)]);
    let e = put(
        &mut st,
        &m,
        &s,
        "big",
        1 << 20,
        &ReplicateConfig::default(),
        0,
    )
    .unwrap_err();
    assert!(e.to_string().contains("larger than any segment"), "{e}");
    // Fill with leased objects: no eviction possible.
    for i in 0..16 {
        put(
            &mut st,
            &m,
            &s,
            &format!("k{i}"),
            4096,
            &ReplicateConfig::default(),
            0,
        )
        .unwrap();
        st.get_replica_list(&format!("k{i}"), 0, 1_000_000).unwrap();
    }
    assert!(matches!(
        put(&mut st, &m, &s, "x", 4096, &ReplicateConfig::default(), 1),
        Err(StoreError::NoAvailableHandle { .. })
    ));
    // After the leases end, the put evicts the least recently used.
    st.get_replica_list("k0", 1_000_001, 10).unwrap(); // k0 now most recently used (and leased)
    put(
        &mut st,
        &m,
        &s,
        "x",
        4096,
        &ReplicateConfig::default(),
        1_000_002,
    )
    .unwrap();
    assert!(
        st.exist_key("k0", 1_000_003, 1).unwrap(),
        "leased/recent object kept"
    );
    let left = (1..16)
        .filter(|i| st.exist_key(&format!("k{i}"), 1_000_003, 1).unwrap())
        .count();
    assert_eq!(
        left, 14,
        "exactly one of the least recently used objects was evicted"
    );
    assert!(s.evicted_objects.load(Ordering::Relaxed) >= 1);
}

#[test]
fn eviction_skips_pinned_and_in_flight() {
    let (mut st, m, s) = setup(&[(1, 64 << 10)]);
    put(
        &mut st,
        &m,
        &s,
        "hard",
        16 << 10,
        &ReplicateConfig {
            with_hard_pin: true,
            ..Default::default()
        },
        0,
    )
    .unwrap();
    put(
        &mut st,
        &m,
        &s,
        "soft",
        16 << 10,
        &ReplicateConfig {
            soft_pin: SoftPin::Enable,
            soft_pin_ttl_ms: Some(1_000_000),
            ..Default::default()
        },
        0,
    )
    .unwrap();
    st.put_start(
        &m,
        &s,
        P1,
        "inflight",
        16 << 10,
        &ReplicateConfig::default(),
        false,
        0,
    )
    .unwrap();
    put(
        &mut st,
        &m,
        &s,
        "plain",
        16 << 10,
        &ReplicateConfig::default(),
        0,
    )
    .unwrap();
    // Needs 16 KiB: the plain object goes, not the others.
    put(
        &mut st,
        &m,
        &s,
        "new",
        16 << 10,
        &ReplicateConfig::default(),
        10,
    )
    .unwrap();
    assert!(!st.exist_key("plain", 11, 0).unwrap());
    assert!(st.exist_key("hard", 11, 0).unwrap());
    assert!(st.exist_key("soft", 11, 0).unwrap());
    st.put_end(P1, "inflight", 12).unwrap();
    // Now only soft-pinned objects are evictable (second pass).
    put(
        &mut st,
        &m,
        &s,
        "new2",
        16 << 10,
        &ReplicateConfig::default(),
        20,
    )
    .unwrap_or_default();
    assert!(
        st.exist_key("hard", 21, 0).unwrap(),
        "hard pin never evicted"
    );
    let no_soft = MasterConfig {
        allow_evict_soft_pinned: false,
        ..MasterConfig::default()
    };
    let r = put(
        &mut st,
        &no_soft,
        &s,
        "new3",
        16 << 10,
        &ReplicateConfig::default(),
        30,
    );
    assert!(r.is_ok() || matches!(r, Err(StoreError::NoAvailableHandle { .. })));
    assert!(st.exist_key("hard", 31, 0).unwrap());
}

#[test]
fn upsert_keeps_old_replicas_until_the_lease_ends() {
    let (mut st, m, s) = setup(&[(1, 1 << 20)]);
    put(&mut st, &m, &s, "k", 4096, &ReplicateConfig::default(), 0).unwrap();
    let old = st.get_replica_list("k", 1, 1000).unwrap();
    let new = st
        .put_start(&m, &s, P1, "k", 8192, &ReplicateConfig::default(), true, 2)
        .unwrap();
    assert_ne!(new[0].addr, old.replicas[0].addr, "upsert writes elsewhere");
    assert_eq!(
        st.get_replica_list("k", 3, 10).unwrap().replicas,
        old.replicas,
        "readers see the old value meanwhile"
    );
    st.put_end(P1, "k", 4).unwrap();
    assert_eq!(st.get_replica_list("k", 5, 10).unwrap().size, 8192);
    let used = st.used_bytes();
    st.release_deferred(500);
    assert_eq!(st.used_bytes(), used, "old replica still leased");
    st.release_deferred(1002);
    assert!(st.used_bytes() < used, "freed after the lease");
}

/// A segment mounted again at a master that had forgotten it (started empty, or dropped
/// its client) may still be read by readers of the master that knew it: nothing is placed
/// there for one read lease. A segment the master knows is not held (an idempotent
/// remount), and neither is one mounted for the first time.
#[test]
fn a_segment_mounted_again_is_held_whole_for_one_read_lease() {
    let (mut st, m, s) = setup(&[]);
    st.remount(1, vec![seg(1, 1 << 20)], 100, 5_000).unwrap();
    let r = put(&mut st, &m, &s, "k", 4096, &ReplicateConfig::default(), 200);
    assert!(
        matches!(r, Err(StoreError::NoAvailableHandle { .. })),
        "placed in a segment old readers may still read: {r:?}"
    );
    assert_eq!(st.used_bytes(), 1 << 20, "held whole");
    st.remount(1, vec![seg(1, 1 << 20)], 300, 5_000).unwrap();
    st.release_deferred(5_099);
    assert!(
        put(
            &mut st,
            &m,
            &s,
            "k",
            4096,
            &ReplicateConfig::default(),
            5_099
        )
        .is_err(),
        "a remount of a known segment does not restart the hold, nor end it early"
    );
    st.release_deferred(5_100);
    put(
        &mut st,
        &m,
        &s,
        "k",
        4096,
        &ReplicateConfig::default(),
        5_100,
    )
    .expect("the lease over, the segment serves");
    assert_eq!(st.used_bytes(), 4096);
    // A first mount is not held.
    st.mount(2, seg(2, 1 << 20), 5_200).unwrap();
    st.remount(2, vec![seg(2, 1 << 20)], 5_300, 5_000).unwrap();
    assert_eq!(st.used_bytes(), 4096);
}

#[test]
fn dead_client_drops_its_replicas_others_still_serve() {
    let (mut st, m, s) = setup(&[(1, 1 << 20), (2, 1 << 20)]);
    let r = put(
        &mut st,
        &m,
        &s,
        "both",
        4096,
        &ReplicateConfig {
            replica_num: 2,
            ..Default::default()
        },
        0,
    )
    .unwrap();
    assert_eq!(r.len(), 2);
    put(
        &mut st,
        &m,
        &s,
        "only1",
        4096,
        &ReplicateConfig {
            preferred_segments: vec!["seg1".into()],
            ..Default::default()
        },
        0,
    )
    .unwrap();
    st.ping(2, 5000);
    let dead = st.expire_clients(10_001, 10_000, 600_000);
    assert_eq!(
        dead,
        vec![(1, vec!["seg1".to_string()])],
        "client 1 with its one segment"
    );
    let l = st.get_replica_list("both", 10_002, 1).unwrap();
    assert_eq!(l.replicas.len(), 1);
    assert_eq!(l.replicas[0].te_endpoint, "127.0.0.1:15002");
    assert!(matches!(
        st.get_replica_list("only1", 10_002, 1),
        Err(StoreError::ObjectNotFound(_))
    ));
    assert_eq!(st.ping(1, 10_003), PingStatus::NeedRemount);
}

/// Clients that die together (one with two segments) go in one tick: every replica on
/// any of their segments is dropped, objects left with none are forgotten, the survivor's
/// replicas still serve and new puts land only on its segment.
#[test]
fn clients_dying_together_lose_every_segment_in_one_tick_and_only_those() {
    let mut st = State::default();
    for (client, id) in [(10, 1), (10, 2), (20, 3), (30, 4)] {
        st.mount(client, seg(id, 1 << 20), 0).unwrap();
    }
    st.register_client(1, 0);
    let (m, s) = (MasterConfig::default(), Stats::default());
    let all = ReplicateConfig {
        replica_num: 4,
        ..Default::default()
    };
    put(&mut st, &m, &s, "everywhere", 4096, &all, 0).unwrap();
    for (key, on) in [
        ("on1", "seg1"),
        ("on2", "seg2"),
        ("on3", "seg3"),
        ("on4", "seg4"),
    ] {
        put(
            &mut st,
            &m,
            &s,
            key,
            4096,
            &ReplicateConfig {
                preferred_segments: vec![on.into()],
                ..Default::default()
            },
            0,
        )
        .unwrap();
    }
    for (key, on, group) in [
        ("g-a", "seg1", "G"),
        ("g-b", "seg4", "G"),
        ("h-a", "seg2", "H"),
        ("h-b", "seg3", "H"),
    ] {
        put(
            &mut st,
            &m,
            &s,
            key,
            4096,
            &ReplicateConfig {
                preferred_segments: vec![on.into()],
                group_id: Some(group.into()),
                ..Default::default()
            },
            0,
        )
        .unwrap();
    }
    st.ping(30, 5000);
    let mut dead = st.expire_clients(10_001, 10_000, 600_000);
    dead.sort_unstable();
    for (_, names) in &mut dead {
        names.sort_unstable();
    }
    let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        dead,
        vec![
            (1, vec![]),
            (10, names(&["seg1", "seg2"])),
            (20, names(&["seg3"]))
        ],
        "client 1 (the writer, no segment) never pinged either"
    );
    assert_eq!(st.mounted_names(), ["seg4"].into_iter().collect());
    assert_eq!(st.seg_order, vec![4]);
    let l = st.get_replica_list("everywhere", 10_002, 1).unwrap();
    assert_eq!(
        l.replicas
            .iter()
            .map(|r| r.te_endpoint.as_str())
            .collect::<Vec<_>>(),
        ["127.0.0.1:15004"]
    );
    for gone in ["on1", "on2", "on3"] {
        assert!(
            matches!(
                st.get_replica_list(gone, 10_002, 1),
                Err(StoreError::ObjectNotFound(_))
            ),
            "{gone}"
        );
    }
    assert!(st.get_replica_list("on4", 10_002, 1).is_ok());
    assert_eq!(
        st.groups
            .get("G")
            .map(|g| g.members.iter().map(|k| k.to_string()).collect::<Vec<_>>()),
        Some(vec!["g-b".to_string()]),
        "a group keeps its surviving members"
    );
    assert!(!st.groups.contains_key("H"), "a group left empty goes");
    st.register_client(1, 10_003);
    let r = st
        .put_start(
            &m,
            &s,
            P1,
            "new",
            4096,
            &ReplicateConfig::default(),
            false,
            10_003,
        )
        .unwrap();
    assert_eq!(r[0].te_endpoint, "127.0.0.1:15004");
}

#[test]
fn groups_share_leases_and_are_evicted_together() {
    let (mut st, m, s) = setup(&[(1, 64 << 10)]);
    let g = ReplicateConfig {
        group_id: Some("req-1".into()),
        ..Default::default()
    };
    put(&mut st, &m, &s, "g1", 16 << 10, &g, 0).unwrap();
    put(&mut st, &m, &s, "g2", 16 << 10, &g, 0).unwrap();
    st.get_replica_list("g1", 10, 100).unwrap();
    assert!(
        matches!(
            st.remove(&m, "g2", false, 20),
            Err(StoreError::ObjectHasLease(_))
        ),
        "lease shared by the group"
    );
    // A member put after the group's read was never read: the group's lease is not its.
    put(&mut st, &m, &s, "g3", 1 << 10, &g, 15).unwrap();
    assert_eq!(st.key_info("g3", 20).map(|k| k.leased_ms), Some(0));
    st.remove(&m, "g3", false, 20).expect("not leased");
    put(
        &mut st,
        &m,
        &s,
        "other",
        16 << 10,
        &ReplicateConfig::default(),
        20,
    )
    .unwrap();
    let freed = st.evict(1, 1000, true, &s);
    assert_eq!(
        freed,
        32 << 10,
        "both members of the group go together (they were least recently used)"
    );
    assert!(st.exist_key("other", 1001, 0).unwrap());
    assert!(st.groups.is_empty(), "the group left empty goes");
    // A member that is being read stays, and stays in its group.
    put(&mut st, &m, &s, "h1", 16 << 10, &g, 2000).unwrap();
    put(&mut st, &m, &s, "h2", 16 << 10, &g, 2000).unwrap();
    st.remove(&m, "other", true, 2001).unwrap();
    let read = st.get_replica_list("h1", 2002, 100_000).unwrap();
    st.objects.get_mut("h2").unwrap().lease_until = 0;
    st.groups.get_mut("req-1").unwrap().lease_until = 0; // (the group's shared lease set aside)
    st.evict(1, 3000, true, &s);
    assert!(st.exist_key("h1", 3001, 0).unwrap(), "read in flight: kept");
    assert!(!st.exist_key("h2", 3001, 0).unwrap());
    assert_eq!(
        st.groups.get("req-1").map(|g| g.members.len()),
        Some(1),
        "the group keeps its member left"
    );
    st.release_reads(&[read.read_id], 3002);
}

#[test]
fn batch_replica_clear_as_mooncake() {
    let (mut st, m, s) = setup(&[(1, 1 << 20), (2, 1 << 20)]);
    put(
        &mut st,
        &m,
        &s,
        "k",
        4096,
        &ReplicateConfig {
            replica_num: 2,
            ..Default::default()
        },
        0,
    )
    .unwrap();
    let keys = |v: &[&str]| v.iter().map(|k| k.to_string()).collect::<Vec<_>>();
    assert!(
        st.batch_replica_clear(2, &keys(&["k"]), "", 1).is_empty(),
        "another client's object is skipped"
    );
    st.get_replica_list("k", 1, 100).unwrap();
    assert!(
        st.batch_replica_clear(1, &keys(&["k"]), "seg1", 50)
            .is_empty(),
        "a leased object is skipped"
    );
    assert_eq!(
        st.batch_replica_clear(1, &keys(&["k", "missing", ""]), "seg1", 200),
        keys(&["k"])
    );
    let l = st.get_replica_list("k", 201, 10).unwrap();
    assert_eq!(l.replicas.len(), 1);
    assert_eq!(
        l.replicas[0].te_endpoint, "127.0.0.1:15002",
        "only seg1's replica went"
    );
    assert_eq!(st.used_bytes(), 4096, "its space came back");
    assert!(
        st.batch_replica_clear(1, &keys(&["k"]), "seg1", 300)
            .is_empty(),
        "no replica left there"
    );
    assert_eq!(
        st.batch_replica_clear(1, &keys(&["k"]), "", 300),
        keys(&["k"])
    );
    assert!(!st.exist_key("k", 301, 0).unwrap());
    assert_eq!(st.used_bytes(), 0);
}

#[test]
fn remove_all_and_regex_respect_leases() {
    let (mut st, m, s) = setup(&[(1, 1 << 20)]);
    for k in ["a1", "a2", "b1"] {
        put(&mut st, &m, &s, k, 100, &ReplicateConfig::default(), 0).unwrap();
    }
    st.get_replica_list("a2", 1, 1000).unwrap();
    let re = regex::Regex::new("^a").unwrap();
    assert_eq!(
        st.remove_matching(&m, |k| re.is_match(k), false, 2).count(),
        1
    );
    assert_eq!(
        st.remove_matching(&m, |_| true, false, 3).count(),
        1,
        "b1 only; a2 leased"
    );
    assert_eq!(
        st.remove_matching(&m, |_| true, true, 4).count(),
        1,
        "force"
    );
    assert_eq!(st.summary().keys, 0);
}

#[test]
fn remove_all_of_a_full_pool_frees_its_space_prunes_its_groups_and_keeps_what_is_read() {
    let (mut st, m, s) = setup(&[(1, 4 << 20), (2, 4 << 20)]);
    st.journal_on();
    let cfg = ReplicateConfig {
        replica_num: 2,
        ..Default::default()
    };
    let grouped = ReplicateConfig {
        replica_num: 2,
        group_id: Some("G".into()),
        ..Default::default()
    };
    let mut n = 0;
    // Sizes that do not divide the segments evenly: frees must join blocks of any size.
    // (Filled to 80%, below the eviction watermark: nothing is evicted.)
    while st.used_bytes() < (8 << 20) * 4 / 5 {
        put(
            &mut st,
            &m,
            &s,
            &format!("k{n}"),
            1000 + (n % 5) * 700,
            if n % 3 == 0 { &grouped } else { &cfg },
            0,
        )
        .expect("room");
        n += 1;
    }
    assert!(n > 1000, "the pool filled ({n} objects)");
    st.put_start(
        &m,
        &s,
        P1,
        "writing",
        100,
        &ReplicateConfig::default(),
        false,
        0,
    )
    .expect("room for a write in progress");
    let read = st.get_replica_list("k1", 1, 10_000).expect("k1 is there");
    let _ = st.take_changes(1);
    let held = read.replicas.iter().map(|r| r.size).sum::<u64>();
    let removed = st.remove_matching(&m, |_| true, true, 2);
    assert_eq!(
        removed.count(),
        n + 1,
        "every object, the one being written too (forced)"
    );
    assert_eq!(
        removed.objects.len(),
        n as usize + 1,
        "their memory goes back to the caller, to be freed out of the lock"
    );
    drop(removed);
    assert_eq!(st.summary().keys, 0);
    assert!(
        !st.groups.contains_key("G"),
        "the group went with its last member"
    );
    let forgotten = st
        .take_changes(2)
        .iter()
        .filter(|c| matches!(c, Change::Forget { .. }))
        .count() as u64;
    assert!(
        forgotten >= n,
        "every removal is journaled ({forgotten} of {n})"
    );
    // What a reader may still be reading is kept until its read ends; the rest is free
    // and whole again.
    assert!(
        st.used_bytes() >= held && st.deferred.len() == 3,
        "k1's two replicas and the write's one are held back ({} bytes used)",
        st.used_bytes()
    );
    st.release_reads(&[read.read_id], 3);
    st.release_deferred(10_000_000);
    assert_eq!(st.used_bytes(), 0);
    for id in [1, 2] {
        assert_eq!(
            st.segments[&id].space.free_ranges(),
            1,
            "segment {id}'s space is one free range again"
        );
    }
    assert!(
        put(
            &mut st,
            &m,
            &s,
            "big",
            4 << 20,
            &ReplicateConfig::default(),
            10_000_001
        )
        .is_ok(),
        "a segment-sized object fits"
    );
}
