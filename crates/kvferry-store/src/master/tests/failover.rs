//! A put whose start one leader applied and whose end or revoke the next leader receives:
//! the next leader's state is built from the journal's changes, as a takeover builds it
//! ([`changes::Image::into_state`]). Test code only (`#[cfg(test)]`, declared so for the
//! boundary check).

use super::*;

/// The next leader: every change `st` made since its journal was turned on (what its journal
/// made durable) built into a state of `term` at `now`.
fn next_leader(st: &mut State, term: i64, now: u64) -> State {
    let mut image = changes::Image::default();
    for c in st.take_changes(now) {
        image.apply(c);
    }
    let (next, report) = image.into_state(term, now, 5_000);
    assert_eq!(
        report.dropped_replicas + report.dropped_objects,
        0,
        "{report:?}"
    );
    next
}

/// A put started at one leader (the start durable, its bytes not written yet) and ended at
/// the next one completes there with the replica the first leader gave it, and reads back
/// from it; its space is not given to another put meanwhile. Revoked at the next leader
/// instead (the client was told `OutcomeUnknown`: it revokes the start wherever the leader
/// now is), the key is free at once for a new put, not refused `ObjectAlreadyExists` until
/// the discard timeout. The store_ha process tests
/// `a_put_in_flight_across_a_failover_completes_at_the_new_leader` and
/// `a_put_whose_leader_loses_its_term_before_the_start_is_durable_fails_as_unknown_and_is_revoked`
/// checked the same across a real failover.
#[test]
fn a_put_started_at_one_leader_is_ended_or_revoked_at_the_next() {
    let (m, s) = (MasterConfig::default(), Stats::default());
    for revoke in [false, true] {
        let mut st = State::default();
        st.journal_on();
        st.mount(1, seg(1, 1 << 20), 0).unwrap();
        st.register_client(1, 0);
        let before = put(&mut st, &m, &s, "before", 4096, &Default::default(), 0).unwrap();
        let w = PutId { client: 1, put: 2 };
        let given = st
            .put_start(&m, &s, w, "k", 8192, &Default::default(), false, 10)
            .unwrap();
        // The first leader dies; the next one is built from what its journal made durable.
        let mut next = next_leader(&mut st, 2, 20);
        next.register_client(1, 20);
        assert!(
            next.objects.get("k").is_some_and(|o| o.pending.is_some()),
            "the next leader knows the put in progress"
        );
        // Another client's put meanwhile never gets the bytes being written.
        next.register_client(3, 20);
        if let Ok(other) = next.put_start(
            &m,
            &s,
            PutId { client: 3, put: 1 },
            "other",
            1 << 19,
            &Default::default(),
            false,
            20,
        ) {
            let (a, b) = (&given[0], &other[0]);
            assert!(
                a.addr + a.size <= b.addr || b.addr + b.size <= a.addr,
                "another put was given the bytes of the put in progress: {a:?} {b:?}"
            );
        }
        if revoke {
            next.put_revoke(w, "k").expect("revoked at the next leader");
            assert!(
                matches!(
                    next.get_replica_list("k", 30, 5_000),
                    Err(StoreError::ObjectNotFound(_))
                ),
                "a revoked start is never served"
            );
            let again = PutId { client: 1, put: 3 };
            next.put_start(&m, &s, again, "k", 8192, &Default::default(), false, 40)
                .expect("the key is free at once after the revoke");
            next.put_end(again, "k", 50).expect("and its put completes");
        } else {
            next.put_end(w, "k", 30)
                .expect("the end completes the put the last leader started");
            let list = next.get_replica_list("k", 40, 5_000).expect("readable");
            assert_eq!(
                list.replicas
                    .iter()
                    .map(|r| (r.te_endpoint.clone(), r.addr, r.size))
                    .collect::<Vec<_>>(),
                given
                    .iter()
                    .map(|r| (r.te_endpoint.clone(), r.addr, r.size))
                    .collect::<Vec<_>>(),
                "served from the replica the first leader gave (where its bytes were written)"
            );
        }
        let list = next.get_replica_list("before", 60, 5_000).expect("before");
        assert_eq!(
            (list.replicas[0].addr, list.replicas[0].size),
            (before[0].addr, before[0].size),
            "what was put before the failover survives it"
        );
    }
}
