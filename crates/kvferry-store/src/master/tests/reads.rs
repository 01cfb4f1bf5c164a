//! Reads in flight and eviction: space given back when reads are released, evicted once for a
//! waiting put, never under a read in flight.

use super::*;

#[test]
fn released_reads_give_space_back_at_once() {
    let (mut st, m, s) = setup(&[(1, 64 << 10)]);
    let cfg = ReplicateConfig::default();
    put(&mut st, &m, &s, "a", 32 << 10, &cfg, 0).unwrap();
    let l = st.get_replica_list("a", 1, 10_000).unwrap();
    assert!(
        matches!(
            st.remove(&m, "a", false, 2),
            Err(StoreError::ObjectHasLease(_))
        ),
        "Mooncake's lease still refuses a plain remove"
    );
    st.remove(&m, "a", true, 2).unwrap();
    assert_eq!(
        st.used_bytes(),
        32 << 10,
        "the read in flight keeps the bytes"
    );
    // The same space cannot be handed out while the read is in flight...
    st.put_start(&m, &s, P1, "b", 32 << 10, &cfg, false, 3)
        .unwrap();
    assert!(matches!(
        st.put_start(&m, &s, P1, "c", 32 << 10, &cfg, false, 3),
        Err(StoreError::NoAvailableHandle { .. })
    ));
    assert!(st.reads_in_flight(3), "a caller may wait for it");
    // ...and comes back as soon as the reader says it finished, long before the lease ends.
    st.release_reads(&[l.read_id], 4);
    assert!(!st.reads_in_flight(4));
    assert_eq!(st.used_bytes(), 32 << 10, "only b's space is in use");
    st.put_start(&m, &s, P1, "c", 32 << 10, &cfg, false, 5)
        .unwrap();
    // An upsert's old replica follows the same rule.
    st.put_end(P1, "b", 6).unwrap();
    let l = st.get_replica_list("b", 7, 10_000).unwrap();
    st.put_revoke(P1, "c").unwrap();
    st.put_start(&m, &s, P1, "b", 16 << 10, &cfg, true, 8)
        .unwrap();
    st.put_end(P1, "b", 9).unwrap();
    assert_eq!(st.used_bytes(), 48 << 10, "old value kept for its reader");
    st.release_reads(&[l.read_id, 12345], 10);
    assert_eq!(
        st.used_bytes(),
        16 << 10,
        "freed on release; unknown ids are ignored"
    );
}

/// A put that waits for reads evicts what it needs once, not again at every retry (each
/// 500 µs for up to a second): in a fragmented pool whose freed ranges are not adjacent,
/// the retries evicted object after object.
#[test]
fn a_put_waiting_for_reads_evicts_once_not_at_every_retry() {
    let (mut st, m, s) = setup(&[(1, 64 << 10)]);
    let cfg = ReplicateConfig::default();
    for i in 0..16 {
        put(&mut st, &m, &s, &format!("o{i}"), 4 << 10, &cfg, 0).unwrap();
    }
    // Every other object is being read: whatever is evicted leaves 4 KiB holes apart.
    for i in (0..16).step_by(2) {
        st.get_replica_list(&format!("o{i}"), 1, 60_000).unwrap();
    }
    let p = PutId { client: 1, put: 9 };
    let e = st.put_start_ex(
        &m,
        &s,
        p,
        "big",
        8 << 10,
        &cfg,
        false,
        5_000,
        Attempt::First,
    );
    assert!(
        matches!(e, Err(StoreError::NoAvailableHandle { .. })),
        "{e:?}"
    );
    let after_first = s.evicted_objects.load(Ordering::Relaxed);
    assert!(after_first >= 1);
    for t in 0..5 {
        assert!(st
            .put_start_ex(
                &m,
                &s,
                p,
                "big",
                8 << 10,
                &cfg,
                false,
                5_001 + t,
                Attempt::Again
            )
            .is_err());
    }
    assert_eq!(
        s.evicted_objects.load(Ordering::Relaxed),
        after_first,
        "the retries evicted more"
    );
}

#[test]
fn eviction_spares_reads_in_flight_not_finished_ones() {
    let (mut st, m, s) = setup(&[(1, 64 << 10)]);
    let cfg = ReplicateConfig::default();
    put(&mut st, &m, &s, "r1", 32 << 10, &cfg, 0).unwrap();
    put(&mut st, &m, &s, "r2", 32 << 10, &cfg, 0).unwrap();
    let l1 = st.get_replica_list("r1", 1, 10_000).unwrap();
    let l2 = st.get_replica_list("r2", 2, 10_000).unwrap();
    assert_eq!(st.evict(1, 3, true, &s), 0, "both are being read");
    st.release_reads(&[l1.read_id], 4);
    assert_eq!(
        st.evict(1, 5, true, &s),
        32 << 10,
        "a finished read does not protect its object"
    );
    assert!(!st.exist_key("r1", 6, 0).unwrap() && st.exist_key("r2", 6, 0).unwrap());
    // While a read is in flight, a put that is not on its last try spares objects just
    // written (their writers are about to read them back) and asks the caller to wait.
    put(&mut st, &m, &s, "young", 32 << 10, &cfg, 7).unwrap();
    let e = st.put_start_ex(&m, &s, P1, "next", 32 << 10, &cfg, false, 8, Attempt::First);
    assert!(
        matches!(e, Err(StoreError::NoAvailableHandle { .. })),
        "{e:?}"
    );
    assert!(
        st.exist_key("young", 9, 0).unwrap(),
        "the object just written was not evicted"
    );
    // Once the read ended, the older object goes, not the young one.
    st.release_reads(&[l2.read_id], 10);
    st.put_start_ex(
        &m,
        &s,
        P1,
        "next",
        32 << 10,
        &cfg,
        false,
        11,
        Attempt::Again,
    )
    .unwrap();
    assert!(st.exist_key("young", 12, 0).unwrap() && !st.exist_key("r2", 12, 0).unwrap());
    // An abandoned read stops counting when its lease runs out.
    let l = st.get_replica_list("young", 13, 100).unwrap();
    assert!(st.reads_in_flight(50));
    st.expire_reads(200);
    assert!(!st.reads_in_flight(200) && l.read_id > 0);
}
