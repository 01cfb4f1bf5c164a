//! The server's tests of answers that wait for the journal: puts answered at once in a
//! durable grant, mutations waiting for the journal alone, deferred answers in each
//! connection's order. Test code only.

use super::*;

/// With grants on, a batch of puts placed in space whose grant is durable is answered at
/// once, its changes left for the next collection: the puts' ends then go to the journal
/// in one entry with them, one change per key. A put placed in a grant not yet durable,
/// or a batch that also changes anything else, waits as before.
#[test]
fn puts_placed_in_a_durable_grant_are_answered_at_once_and_their_changes_ride_with_the_next() {
    let m = journaling_leader(5);
    m.lock().set_grant_bytes(1 << 20, 600_000);
    let ticket = |a: Applied| match a {
        Applied::Later { ticket, .. } => ticket,
        other => panic!(
            "answered before its changes were durable: {:?}",
            matches!(other, Applied::Early(_))
        ),
    };
    ticket(apply(
        &m,
        Request::MountSegment {
            client: 1,
            segment: seg(1, 1 << 30),
        },
    ));
    let starts = |from: usize| {
        Request::Batch(
            (from..from + 4)
                .map(|i| Request::PutStart {
                    client: 1,
                    key: format!("k{i}"),
                    size: 4096,
                    config: ReplicateConfig::default(),
                    upsert: false,
                    put: 1,
                })
                .collect(),
        )
    };
    let ends = |from: usize| {
        Request::Batch(
            (from..from + 4)
                .map(|i| Request::PutEnd {
                    client: 1,
                    key: format!("k{i}"),
                    put: 1,
                })
                .collect(),
        )
    };
    // The first puts carve the pool: its grant is not durable yet.
    ticket(apply(&m, starts(0)));
    ticket(apply(&m, ends(0)));
    m.journal.write_queued_for_test();
    assert!(
        m.journal.grants_durable() >= crate::master::grants_issued(),
        "the grant is durable with the entry that holds it"
    );
    match apply(&m, starts(4)) {
        Applied::Early(Response::Batch(r)) => assert!(
            r.iter().all(|r| matches!(r, Response::Replicas(_))),
            "{r:?}"
        ),
        _ => panic!("puts in a durable grant wait for their changes"),
    }
    assert_eq!(m.journal.stats().lag, 0, "nothing was collected for them");
    ticket(apply(&m, ends(4)));
    let mut taken = Vec::new();
    {
        let mut st = m.lock();
        assert!(
            st.take_changes(0).is_empty(),
            "the ends took the starts' changes along"
        );
    }
    m.journal.drain_for_test(&mut taken);
    use crate::master::changes::Change;
    let objects: Vec<&str> = taken
        .iter()
        .filter_map(|c| match c {
            Change::Object { key, rec } if rec.pending.is_none() && !rec.current.is_empty() => {
                Some(key.as_str())
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        objects.len(),
        4,
        "one change per key, the whole object: {taken:?}"
    );
    // A batch that also changes something else waits.
    let mixed = Request::Batch(vec![
        Request::PutStart {
            client: 1,
            key: "k8".into(),
            size: 4096,
            config: ReplicateConfig::default(),
            upsert: false,
            put: 1,
        },
        Request::Remove {
            key: "k0".into(),
            force: true,
        },
    ]);
    ticket(apply(&m, mixed));
    // Alone, through `handle` (no connection to carry its changes), it is collected at once.
    assert!(matches!(
        handle(&m, put_start("k9", 4096)),
        Response::Replicas(_)
    ));
    assert!(
        m.journal.stats().lag > 0 && m.lock().take_changes(0).is_empty(),
        "collected, not waited for"
    );
}

/// Whatever a request changed goes to the journal and its answer waits for it, however it
/// was applied: alone, as a batch (its changes taken under the hold of the state's lock it
/// was applied under), as a batch ending with a bulk removal (applied on its own, the lock
/// let go before); nothing is left marked behind. A read is answered at once.
#[test]
fn every_mutation_waits_for_the_journal_alone_batched_or_after_a_bulk_removal() {
    let m = journaling_leader(5);
    let later = |a: Applied| match a {
        Applied::Later { ticket, term, .. } => {
            assert_eq!(term, 5);
            assert!(
                m.lock().take_changes(0).is_empty(),
                "every change was taken into the journal with the request"
            );
            ticket
        }
        Applied::Now(r) | Applied::Early(r) => {
            panic!("answered before its changes were durable: {r:?}")
        }
    };
    let t1 = later(apply(
        &m,
        Request::MountSegment {
            client: 1,
            segment: seg(1, 1 << 20),
        },
    ));
    let puts = (0..3)
        .map(|i| Request::PutStart {
            client: 1,
            key: format!("k{i}"),
            size: 4096,
            config: ReplicateConfig::default(),
            upsert: false,
            put: 1,
        })
        .collect();
    let t2 = later(apply(&m, Request::Batch(puts)));
    let ends = (0..3)
        .map(|i| Request::PutEnd {
            client: 1,
            key: format!("k{i}"),
            put: 1,
        })
        .collect();
    let t3 = later(apply(&m, Request::Batch(ends)));
    let t4 = later(apply(
        &m,
        Request::Batch(vec![
            Request::ExistKey { key: "k0".into() },
            Request::RemoveAll { force: true },
        ]),
    ));
    assert!(
        t1 < t2 && t2 < t3 && t3 < t4,
        "each its own ticket, in order: {t1:?} {t2:?} {t3:?} {t4:?}"
    );
    assert!(
        matches!(
            apply(&m, Request::ExistKey { key: "k1".into() }),
            Applied::Now(Response::Exists(false))
        ),
        "removed, and a read waits for nothing"
    );
}

/// An answer that waits for the journal leaves from whoever makes the change durable, not
/// before; a client that sends its next request without reading (pipelining) gets the
/// answers in its requests' order; the term's end answers what still waited.
#[test]
fn deferred_answers_wait_for_the_journal_and_keep_each_connections_order() {
    let m = Arc::new(journaling_leader(5));
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server =
        MasterServer::start(Arc::clone(&m), listener, Duration::from_millis(50), 0).expect("start");
    let mut c = TcpStream::connect(addr).expect("connect");
    c.set_read_timeout(Some(Duration::from_millis(300)))
        .expect("timeout");
    let seg = |id| seg(id, 1 << 20);
    let mut two = proto::encode(&Request::MountSegment {
        client: 1,
        segment: seg(1),
    })
    .expect("encode");
    two.extend(proto::encode(&Request::ExistKey { key: "k".into() }).expect("encode"));
    c.write_all(&two).expect("send");
    let deferred = |n: usize| {
        let until = Instant::now() + Duration::from_secs(10);
        while m.journal.deferred_for_test() != n {
            assert!(
                Instant::now() < until,
                "the answer was not deferred within 10 s"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    deferred(1);
    let e = read_answer(&mut c).expect_err("nothing is answered before the mount is durable");
    assert!(
        matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
        "{e}"
    );
    assert_eq!(
        m.journal.deferred_for_test(),
        1,
        "the read waits behind the mount"
    );
    m.journal.write_queued_for_test();
    c.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    assert_eq!(
        read_answer(&mut c).expect("the mount's answer"),
        Response::Ok
    );
    assert_eq!(
        read_answer(&mut c).expect("then the read's"),
        Response::Exists(false)
    );
    // Applied and made durable, but the leader was fenced in between: it cannot know
    // whether a successor has the change, and says so instead of the success.
    c.write_all(
        &proto::encode(&Request::MountSegment {
            client: 1,
            segment: seg(4),
        })
        .expect("encode"),
    )
    .expect("send");
    deferred(1);
    m.gate.fence(5);
    m.journal.write_queued_for_test();
    assert_eq!(
        read_answer(&mut c).expect("an answer"),
        Response::Err(StoreError::OutcomeUnknown)
    );
    m.gate.lead_for_test(5, Duration::from_secs(60));
    // A mutation still waiting when the term ends is answered that its outcome is unknown
    // (it was applied; the new leader may have it), not left hanging.
    c.write_all(
        &proto::encode(&Request::MountSegment {
            client: 1,
            segment: seg(2),
        })
        .expect("encode"),
    )
    .expect("send");
    deferred(1);
    m.journal.deactivate();
    assert_eq!(
        read_answer(&mut c).expect("an answer"),
        Response::Err(StoreError::OutcomeUnknown)
    );
    // A request of the next term that never got past the gate: nothing applied, NotLeader.
    m.gate.fence(5);
    c.write_all(
        &proto::encode(&Request::MountSegment {
            client: 1,
            segment: seg(3),
        })
        .expect("encode"),
    )
    .expect("send");
    assert!(matches!(
        read_answer(&mut c).expect("an answer"),
        Response::Err(StoreError::NotLeader { .. })
    ));
    assert_eq!(
        m.lock().summary().segments,
        3,
        "the second and fourth mounts applied, the third not"
    );
    drop(server);
}

/// A request is applied, the state's lock let go, and another request's collection takes
/// its change, which the journal makes durable; then the leader is fenced. Its answer says
/// that its outcome is unknown, not `NotLeader` (nothing applied: send it again). One that
/// changed nothing before the fence is still answered `NotLeader`.
#[test]
fn a_request_whose_change_another_collected_is_not_answered_as_if_nothing_was_applied() {
    let m = journaling_leader(5);
    let mut changed = false;
    let (resp, held) = handle_admitted(
        &m,
        Request::MountSegment {
            client: 1,
            segment: seg(1, 1 << 20),
        },
        5,
        &mut changed,
        &mut true,
    );
    assert_eq!(resp, Response::Ok);
    assert!(
        held.is_none() && changed,
        "applied alone: the lock let go, a change marked"
    );
    assert!(
        m.journal.collect(&m).is_some(),
        "another request's collection took the mount"
    );
    m.journal.write_queued_for_test();
    m.gate.fence(5);
    match settle(&m, 5, true, changed, resp, None) {
        Applied::Now(r) => assert_eq!(
            r,
            Response::Err(StoreError::OutcomeUnknown),
            "the mount is durable"
        ),
        Applied::Later { .. } | Applied::Early(_) => panic!("nothing of it is outstanding"),
    }
    // A mutation that changed nothing (its key is absent) before the fence: NotLeader.
    m.gate.lead_for_test(5, Duration::from_secs(60));
    let mut changed = false;
    let (resp, held) = handle_admitted(
        &m,
        Request::Remove {
            key: "absent".into(),
            force: false,
        },
        5,
        &mut changed,
        &mut true,
    );
    assert!(matches!(resp, Response::Err(StoreError::ObjectNotFound(_))));
    assert!(!changed);
    m.gate.fence(5);
    match settle(&m, 5, true, changed, resp, held) {
        Applied::Now(r) => assert!(
            matches!(r, Response::Err(StoreError::NotLeader { .. })),
            "{r:?}"
        ),
        Applied::Later { .. } | Applied::Early(_) => panic!("it changed nothing"),
    }
    assert_eq!(m.lock().summary().segments, 1);
}
