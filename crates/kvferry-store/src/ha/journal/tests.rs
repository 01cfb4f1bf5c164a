//! The journal's drivers: answers, wake-ups, lending, links under load.

use super::*;
use crate::ha::log::{decode_chunk, log_key, log_range, REBASE_VALUE_MAX};
use crate::master::changes::Image;
use crate::master::changes::ObjectRec;
use crate::repl::roster::retry_link_after;
use crate::repl::TailFrame;

fn obj(i: usize) -> Change {
    Change::Object {
        key: format!("key-{i:06}"),
        rec: ObjectRec {
            size: 4096,
            current: smallvec::smallvec![(1, 4096 * i as u64, 4096)],
            pending: None,
            owner: 7,
            hard_pin: false,
            soft_pin_left: 0,
            group: None,
        },
    }
}

/// A deferred answer (a request whose thread went back to its connection) is answered
/// exactly once: when its ticket is written, when the term ends, fails or restarts, when it
/// waited too long, or, if a path forgot it, when it is dropped.
#[test]
fn a_deferred_answer_is_answered_exactly_once_when_written_never_across_terms() {
    use crate::master::MasterConfig;
    use std::sync::mpsc;
    let m = Master::new(MasterConfig::default());
    let j = &m.journal;
    let (tx, rx) = mpsc::channel::<(u32, Result<(), StoreError>)>();
    let answer = |id: u32| -> Answer {
        let tx = tx.clone();
        Box::new(move |r| tx.send((id, r)).expect("the test listens"))
    };
    let got =
        |rx: &mpsc::Receiver<(u32, Result<(), StoreError>)>| rx.try_iter().collect::<Vec<_>>();
    j.activate(5);
    j.q().m.set_enqueued_for_test(3);
    j.defer((5, 2), answer(1));
    j.defer((5, 3), answer(2));
    j.defer((4, 1), answer(3));
    assert_eq!(
        got(&rx),
        vec![(3, Err(StoreError::OutcomeUnknown))],
        "another term's ticket: refused at once"
    );
    j.done(1);
    assert!(
        got(&rx).is_empty(),
        "ticket 1 written: nothing deferred for it"
    );
    j.done(2);
    assert_eq!(got(&rx), vec![(1, Ok(()))]);
    j.defer((5, 2), answer(4));
    assert_eq!(
        got(&rx),
        vec![(4, Ok(()))],
        "written already: answered at once, on this thread"
    );
    // A late acknowledgement of another term answers nothing; the term's end refuses.
    j.done_in(4, 3);
    assert!(got(&rx).is_empty());
    j.deactivate();
    assert_eq!(got(&rx), vec![(2, Err(StoreError::OutcomeUnknown))]);
    j.done(3);
    assert!(got(&rx).is_empty(), "answered once only");
    // A restart of the term and a failed writer refuse what waited.
    j.activate(6);
    j.q().m.set_enqueued_for_test(2);
    j.defer((6, 1), answer(5));
    j.activate(7);
    assert_eq!(got(&rx), vec![(5, Err(StoreError::OutcomeUnknown))]);
    j.q().m.set_enqueued_for_test(2);
    j.defer((7, 1), answer(6));
    j.fail();
    assert_eq!(got(&rx), vec![(6, Err(StoreError::OutcomeUnknown))]);
    // Waiting too long: the journal's bounded-wait error, the others kept.
    j.activate(8);
    j.q().m.set_enqueued_for_test(3);
    j.defer((8, 1), answer(7));
    j.expire(Duration::ZERO);
    assert!(matches!(got(&rx)[..], [(7, Err(StoreError::Rpc(_)))]));
    j.defer((8, 2), answer(8));
    j.expire(Duration::from_secs(3600));
    assert!(got(&rx).is_empty(), "one deferred within its bound stays");
    j.done(2);
    assert_eq!(got(&rx), vec![(8, Ok(()))]);
    // Forgotten (dropped unanswered): refused, never left waiting.
    drop(Later(Some(answer(9))));
    assert_eq!(got(&rx), vec![(9, Err(StoreError::OutcomeUnknown))]);
}

/// The queue without etcd: what a request waits for, what ends the wait.
#[test]
fn a_request_is_answered_only_once_its_changes_are_written_and_never_across_terms() {
    use crate::master::MasterConfig;
    use crate::proto::Segment;
    let m = Master::new(MasterConfig::default());
    let j = &m.journal;
    assert_eq!(j.collect(&m), None, "not journaling: nothing to wait for");
    {
        let mut st = m.lock();
        st.term = 5;
        st.journal_on();
    }
    j.activate(5);
    let seg = |id| Segment {
        id,
        name: format!("s{id}"),
        te_endpoint: format!("127.0.0.1:{id}"),
        base: id << 32,
        size: 1 << 20,
    };
    m.lock().mount(1, seg(1), 0).expect("mount");
    let t1 = j.collect(&m).expect("a change to wait for");
    assert_eq!(t1, (5, 1));
    // A second request's change while the first is unwritten: one batch covers both.
    m.lock().mount(2, seg(2), 0).expect("mount");
    let t2 = j.collect(&m).expect("ticket");
    assert_eq!(t2, (5, 2));
    assert!(
        matches!(
            j.wait(t1, Duration::from_millis(30)),
            Err(StoreError::Rpc(_))
        ),
        "not written: the wait is bounded"
    );
    let (batch, upto) = j
        .next(5, Duration::ZERO, None)
        .0
        .expect("the writer's batch");
    assert_eq!(
        (batch.len(), upto),
        (4, 2),
        "two clients and two segments, both requests' changes"
    );
    // A request already asleep is woken by the write (the wake comes after the queue's
    // lock is released, and is never lost): answered long before its bound.
    assert_eq!(
        woken(
            || j.wait(t1, Duration::from_secs(10)),
            || j.q().waiting > 0,
            || j.done(upto)
        ),
        Ok(())
    );
    assert_eq!(j.wait(t1, Duration::ZERO), Ok(()));
    assert_eq!(j.wait(t2, Duration::ZERO), Ok(()));
    // A writer already asleep is woken by the next change collected.
    let mut t5 = None;
    let got = woken(
        || {
            j.next(5, Duration::from_secs(10), None)
                .0
                .map(|(c, u)| (c.len(), u))
        },
        || j.q().writer_asleep,
        || {
            m.lock().mount(5, seg(5), 0).expect("mount");
            t5 = j.collect(&m);
        },
    );
    let t5 = t5.expect("ticket").1;
    assert_eq!(got, Some((2, t5)), "the client and the segment");
    j.done(t5);
    assert_eq!(j.collect(&m), None, "nothing outstanding");
    // A ticket of a term that ended is refused, even if a new term started since.
    m.lock().mount(3, seg(3), 0).expect("mount");
    let t3 = j.collect(&m).expect("ticket");
    j.deactivate();
    j.activate(6);
    assert!(
        matches!(
            j.wait(t3, Duration::from_secs(5)),
            Err(StoreError::OutcomeUnknown)
        ),
        "refused at once, not after the bound"
    );
    // A writer that gave up refuses every waiter.
    j.activate(5);
    m.lock().mount(4, seg(4), 0).expect("mount");
    let t4 = j.collect(&m).expect("ticket");
    j.fail();
    assert!(matches!(
        j.wait(t4, Duration::from_secs(5)),
        Err(StoreError::OutcomeUnknown)
    ));
    assert!(
        j.next(5, Duration::ZERO, None).0.is_none(),
        "the writer stops"
    );
}

#[test]
fn a_streamed_entry_is_answered_once_every_in_sync_standby_acknowledged_it_in_order_and_never_across_terms(
) {
    let j = Journal::default();
    j.activate(7);
    j.q().m.set_enqueued_for_test(3); // tickets 1..=3 collected
    let r = Release::new(&j, 7);
    let (a, b) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    r.set_members(vec![Arc::clone(&a), Arc::clone(&b)]);
    r.push(10, 1, j.now_us());
    r.push(11, 3, j.now_us());
    let written = || j.q().m.written_upto();
    a.store(11, Ordering::Release);
    r.acked();
    assert_eq!(
        written(),
        0,
        "one standby of two acknowledged: nothing is answered"
    );
    b.store(10, Ordering::Release);
    // The request of ticket 1, asleep, is woken by the acknowledgement that completes it.
    assert_eq!(
        woken(
            || j.wait((7, 1), Duration::from_secs(10)),
            || j.q().waiting > 0,
            || r.acked()
        ),
        Ok(())
    );
    assert_eq!(
        written(),
        1,
        "entry 10 is everywhere: its ticket is answered, entry 11's not yet"
    );
    assert_eq!(r.oldest_seq(), Some(11));
    // The slow member leaves the set (etcd said so first): what the rest has is answered.
    r.set_members(vec![Arc::clone(&a)]);
    assert_eq!(written(), 3);
    assert_eq!(r.oldest_seq(), None);
    // With no member nothing is released, whatever is acknowledged.
    r.set_members(Vec::new());
    j.q().m.set_enqueued_for_test(4);
    r.push(12, 4, j.now_us());
    a.store(12, Ordering::Release);
    r.acked();
    assert_eq!(written(), 3);
    // A broken link wakes the writer at once, even if it was not waiting yet.
    r.broke();
    let t = Instant::now();
    assert_eq!(
        j.next(7, Duration::from_secs(5), None)
            .0
            .map(|(c, _)| c.len()),
        Some(0)
    );
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "the writer looked at once"
    );
    // A late acknowledgement of an ended term answers nothing in the next one.
    j.deactivate();
    j.activate(8);
    j.q().m.set_enqueued_for_test(4);
    r.set_members(vec![Arc::clone(&a)]);
    assert_eq!(
        written(),
        0,
        "term 7's release does not touch term 8's tickets"
    );
    // Nor does one of a term whose writer gave up.
    let r8 = Release::new(&j, 8);
    r8.set_members(vec![Arc::clone(&a)]);
    j.fail();
    r8.push(12, 4, j.now_us());
    r8.acked();
    assert_eq!(written(), 0);
}

/// Runs `wait` on a thread of its own and `wake` once `asleep` says that thread sleeps in
/// the queue (it counts itself under the queue's lock before it sleeps): what `wait`
/// returned, checked to have come from the wake-up and not from the waits' 10 s bound.
fn woken<T: Send>(
    wait: impl FnOnce() -> T + Send,
    asleep: impl Fn() -> bool,
    wake: impl FnOnce(),
) -> T {
    std::thread::scope(|sc| {
        let waiter = sc.spawn(|| {
            let t = Instant::now();
            (wait(), t.elapsed())
        });
        let until = Instant::now() + Duration::from_secs(10);
        while !asleep() {
            assert!(
                Instant::now() < until,
                "the waiting thread never went to sleep"
            );
            std::thread::yield_now();
        }
        wake();
        let (got, took) = waiter.join().expect("the waiting thread");
        assert!(
            took < Duration::from_secs(5),
            "woken, not timed out: {took:?}"
        );
        got
    })
}

/// A journal of term 7 with `enqueued` tickets queued, and its release with one in-sync
/// member whose acknowledged entries the test sets.
fn one_member(enqueued: u64) -> (Journal, Release, Arc<AtomicU64>) {
    let j = Journal::default();
    j.activate(7);
    j.q().m.set_enqueued_for_test(enqueued);
    let r = Release::new(&j, 7);
    let a = Arc::new(AtomicU64::new(0));
    r.set_members(vec![Arc::clone(&a)]);
    (j, r, a)
}

#[test]
fn a_large_commit_streams_as_pieces_and_only_its_last_piece_answers() {
    let changes: Vec<Change> = (0..10_000).map(obj).collect();
    let ps = pieces(changes.clone(), 5, 4096);
    assert_eq!(
        ps.iter().map(|(p, t)| (p.len(), *t)).collect::<Vec<_>>(),
        vec![(4096, 0), (4096, 0), (1808, 5)]
    );
    assert_eq!(
        ps.into_iter().flat_map(|(p, _)| p).collect::<Vec<_>>(),
        changes,
        "in order, nothing lost or repeated"
    );
    let exact: Vec<(usize, u64)> = pieces(changes[..8192].to_vec(), 5, 4096)
        .iter()
        .map(|(p, t)| (p.len(), *t))
        .collect();
    assert_eq!(
        exact,
        vec![(4096, 0), (4096, 5)],
        "no empty piece after an exact multiple"
    );
    assert_eq!(
        pieces(changes[..3].to_vec(), 5, 4096)
            .iter()
            .map(|(p, t)| (p.len(), *t))
            .collect::<Vec<_>>(),
        vec![(3, 5)]
    );
    assert_eq!(
        pieces(changes[..3].to_vec(), 5, 0).len(),
        3,
        "a piece holds at least one change"
    );

    // Released piece by piece: the request is answered by the last piece only.
    let (j, r, a) = one_member(6);
    let written = || j.q().m.written_upto();
    for (seq, (_, ticket)) in (1..).zip(pieces((0..10_000).map(obj).collect(), 5, 4096)) {
        r.push(seq, ticket, j.now_us());
    }
    a.store(2, Ordering::Release);
    r.acked();
    assert_eq!(
        written(),
        0,
        "two pieces of three applied: the commit is not answered"
    );
    a.store(3, Ordering::Release);
    r.acked();
    assert_eq!(written(), 5);
    // A commit's last piece and the next commit's first piece acknowledged together: the
    // first commit is answered (the largest ticket, not the last entry's 0).
    r.push(4, 6, j.now_us());
    r.push(5, 0, j.now_us());
    a.store(5, Ordering::Release);
    r.acked();
    assert_eq!(written(), 6);
}

/// While the streaming writer sleeps and every entry is acknowledged, a request's changes
/// go to the standbys from the request's own thread (the writer not woken), as the next
/// entry after the writer's last, and are answered by the standby's acknowledgement; while
/// that entry is in flight, the next request's changes wait for the writer (woken), which
/// gets its links back with the sequence number moved on.
#[test]
fn an_entry_collected_while_the_writer_sleeps_leaves_from_the_requests_thread_in_sequence() {
    use super::super::sync::{encode_frame, read_frame, ToLeader};
    use crate::master::MasterConfig;
    use std::io::Write;
    let m = Master::new(MasterConfig::default());
    {
        let mut st = m.lock();
        st.term = 7;
        st.journal_on();
    }
    let j = &m.journal;
    j.activate(7);
    // A standby: the test reads what the leader sends and acknowledges by hand.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let release = Arc::new(Release::new(j, 7));
    let hello = ToStandby::Hello {
        cluster_id: "c".into(),
        term: 7,
        lease: 1,
        leader: "me".into(),
    };
    let sink: Arc<dyn AckSink> = release.clone();
    let link = Link::open("standby", &addr, &hello, None, sink).expect("link");
    let (mut standby, _) = listener.accept().expect("accept");
    standby
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    assert!(matches!(
        read_frame::<ToStandby>(&mut standby),
        Ok(ToStandby::Hello { term: 7, .. })
    ));
    release.set_members(vec![link.ack_counter()]);
    let lent = Lent {
        seq: 41,
        links: vec![link],
        release: Arc::clone(&release),
        tail: Arc::new(Mutex::new(Tail::new(0, BASE_EVERY, 0))),
    };
    let register = |client| {
        let mut st = m.lock();
        st.register_client(client, 0);
        j.collect_held(st, 0)
    };
    std::thread::scope(|sc| {
        let writer = sc.spawn(|| j.next(7, Duration::from_secs(20), Some(lent)));
        let until = Instant::now() + Duration::from_secs(10);
        while j.q().lent.is_none() {
            assert!(
                Instant::now() < until,
                "the writer did not go to sleep within 10 s"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let ticket = register(5).expect("a ticket");
        assert_eq!(ticket, (7, 1));
        match read_frame::<ToStandby>(&mut standby) {
            Ok(ToStandby::Entry { seq, changes }) => {
                assert_eq!(seq, 42, "the entry after the writer's last");
                assert_eq!(changes, vec![Change::Client { id: 5, live: true }]);
            }
            other => panic!("expected entry 42, got {other:?}"),
        }
        assert!(
            j.q().writer_asleep && !writer.is_finished(),
            "the writer was not woken"
        );
        assert_eq!(
            j.q().m.written_upto(),
            0,
            "not answered before the standby acknowledged it"
        );
        // Entry 42 in flight: the next changes go to the writer, which wakes with them.
        assert_eq!(register(6), Some((7, 2)));
        let (batch, lent) = writer.join().expect("the writer");
        assert_eq!(batch, Some((vec![Change::Client { id: 6, live: true }], 2)));
        let lent = lent.expect("the writer gets back what it lent");
        assert_eq!((lent.seq, lent.links.len()), (42, 1));
        standby
            .write_all(&encode_frame(&ToLeader::Ack { seq: 42 }).expect("encode"))
            .expect("ack");
        assert_eq!(
            j.wait(ticket, Duration::from_secs(10)),
            Ok(()),
            "answered by the acknowledgement"
        );
        standby
            .set_read_timeout(Some(Duration::from_millis(100)))
            .expect("timeout");
        let mut b = [0u8; 1];
        assert!(
            std::io::Read::read(&mut standby, &mut b).is_err(),
            "nothing more sent without the writer"
        );
    });
}

/// A standby linking while requests keep changing the state: the leader takes its image
/// in pieces and commits what is queued between them (to the in-sync member at once). The
/// new standby gets the image, then exactly the entries after the image's position, in
/// order, none twice (an entry it holds already, or a gap, would cut its link), and the
/// image with those entries holds what the leader holds. Fails when the entries committed
/// before the image's position are sent again, or those after it are not sent.
#[test]
fn a_standby_linking_under_load_gets_its_image_then_every_later_entry_once_in_order() {
    use super::super::sync::read_frame;
    use crate::master::{MasterConfig, PutId, Stats};
    use crate::proto::{ReplicateConfig, Segment};
    let (m, cfg, stats) = (
        Master::new(MasterConfig::default()),
        MasterConfig::default(),
        Stats::default(),
    );
    let put = |st: &mut State, client: u64, key: &str| {
        let id = PutId { client, put: 1 };
        st.put_start(
            &cfg,
            &stats,
            id,
            key,
            4096,
            &ReplicateConfig::default(),
            false,
            0,
        )
        .and_then(|_| st.put_end(id, key, 0))
        .expect("put");
    };
    {
        let mut st = m.lock();
        st.term = 7;
        st.journal_on();
        st.mount(
            1,
            Segment {
                id: 1,
                name: "seg1".into(),
                te_endpoint: "127.0.0.1:1".into(),
                base: 1 << 40,
                size: 1 << 38,
            },
            0,
        )
        .expect("mount");
        // Enough objects for an image of several holds of the lock.
        for i in 0..200_000 {
            put(&mut st, 1, &format!("old-{i}"));
        }
        let _ = st.take_changes(0);
    }
    let j = &m.journal;
    j.activate(7);
    let owner = Owner {
        create_revision: 7,
        lease: 1,
    };
    // (No etcd is reached: with a member in sync, commits go to the standbys only.)
    let etcd = EtcdClient::new(&["127.0.0.1:1".to_string()], Duration::from_secs(1));
    let mut sync = Replicas::new(
        "c",
        "me",
        owner,
        Duration::from_secs(60),
        (64 << 20, BASE_EVERY),
        j,
    );
    let standby = |name: &str, sync: &Replicas| {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let sink: Arc<dyn AckSink> = sync.release.clone();
        let link = Link::open(name, &addr, &sync.hello, None, sink).expect("link");
        let (sock, _) = listener.accept().expect("accept");
        sock.set_read_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        (link, sock, addr)
    };
    let (member, _member_sock, _) = standby("s1", &sync);
    sync.add_link(member);
    sync.set_insync(vec!["s1".to_string()], j);
    let mut w = Writer {
        etcd: &etcd,
        master: &m,
        view_key: "v".into(),
        owner,
        log: JournalWriter::new(prefix("c"), 100, None, 0, SNAPSHOT_MIN),
        sync: Some(sync),
        insync_key: "i".into(),
    };
    // The new standby's side of its link, opened by `open_link`.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (mut sock, added) = std::thread::scope(|sc| {
        // Requests changing the state all along: new objects, old ones removed.
        let load = sc.spawn(|| {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let mut st = m.lock();
                put(&mut st, 1, &format!("new-{n}"));
                let _ = st.remove(&cfg, &format!("old-{n}"), true, 0);
                let _ = j.collect_held(st, 0);
                n += 1;
            }
            n
        });
        let accept = sc.spawn(|| listener.accept().expect("accept").0);
        w.open_link("s2", &addr, false, false)
            .expect("the standby linked");
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let added = load.join().expect("load");
        (accept.join().expect("accept"), added)
    });
    let linked = w.log.seq();
    // What was queued after the link went out: committed as the writer would.
    if let (Some((changes, upto)), _) = j.next(7, Duration::ZERO, None) {
        if !changes.is_empty() {
            w.commit(changes, upto).expect("commit");
        }
    }
    sock.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    assert!(matches!(
        read_frame::<ToStandby>(&mut sock),
        Ok(ToStandby::Hello { term: 7, .. })
    ));
    let mut image = Image::default();
    let at = loop {
        match read_frame::<ToStandby>(&mut sock) {
            Ok(ToStandby::Image { seq, changes, last }) => {
                changes.into_iter().for_each(|c| image.apply(c));
                if last {
                    break seq;
                }
            }
            other => panic!("expected the image, got {other:?}"),
        }
    };
    let mut next = at + 1;
    while next <= w.log.seq() {
        match read_frame::<ToStandby>(&mut sock) {
            Ok(ToStandby::Entry { seq, changes }) => {
                assert_eq!(
                    seq, next,
                    "the entries after the image's position ({at}), in order, none twice"
                );
                changes.into_iter().for_each(|c| image.apply(c));
                next += 1;
            }
            other => panic!("expected entry {next}, got {other:?}"),
        }
    }
    assert!(added > 0 && linked > at, "entries were committed between the image's pieces: {added} puts, the image at {at}, the last entry at the link {linked}");
    assert_eq!(
        image.objects(),
        m.lock().summary().keys,
        "the image and the entries after it hold the leader's objects"
    );
}

/// Streamed entries' frames give the log values of their changes without decoding them:
/// read back as [`load`] reads the log (each key the next number, a value's range), they
/// hold the same changes in order and end at the last entry, for small and large sequence
/// numbers (the varint's length changes), empty entries, entries that fill a value and a
/// frame that stands for several log entries (what a leader appended to etcd in several
/// values, streamed as one); a frame of another entry, not an entry, or frames that are
/// not consecutive give none.
#[test]
fn streamed_entries_frames_are_their_log_values() {
    let p = prefix("c");
    for (first, sizes) in [
        (1u64, vec![3usize]),
        (120, vec![0, 5, 4096, 4096, 1, 0, 300, 2000, 4096]),
        (u64::MAX - 12, vec![17, 2]),
    ] {
        let mut all = Vec::new();
        let mut next = first;
        let frames: Vec<TailFrame> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let changes: Vec<Change> = (0..n).map(|k| obj(k + 7 * i)).collect();
                all.extend(changes.iter().cloned());
                // (The third frame of each stands for three log entries.)
                let span = if i == 1 { 3 } else { 1 };
                let (from, last) = (next, next + span - 1);
                next = last + 1;
                TailFrame {
                    first: from,
                    last,
                    frame: entry_frame(last, changes).0.expect("frame"),
                }
            })
            .collect();
        let values = tail_log_values(&p, &frames).expect("values");
        assert!(
            values.len() < frames.len() || frames.len() == 1,
            "entries share values"
        );
        let (mut seq, mut back) = (first - 1, Vec::new());
        for (key, v) in &values {
            assert_eq!(
                *key,
                log_key(&p, seq + 1),
                "each value's key is the entry after the last one's"
            );
            assert!(v.len() <= REBASE_VALUE_MAX);
            let (last, value) = log_range(seq + 1, v).expect("range");
            seq = last;
            back.extend(decode_chunk(value).expect("decodes"));
        }
        assert_eq!(seq, next - 1, "the values end at the last entry");
        assert_eq!(back, all, "the same changes in order");
    }
    let tf = |first: u64, last: u64, frame: &Arc<Vec<u8>>| TailFrame {
        first,
        last,
        frame: Arc::clone(frame),
    };
    let frame = entry_frame(5, vec![obj(1)]).0.expect("frame");
    assert!(
        tail_log_values(&p, &[tf(6, 6, &frame)]).is_none(),
        "another entry's frame"
    );
    assert!(
        tail_log_values(&p, &[tf(6, 5, &frame)]).is_none(),
        "a range that ends before it starts"
    );
    let other = entry_frame(7, vec![obj(2)]).0.expect("frame");
    assert!(
        tail_log_values(&p, &[tf(5, 5, &frame), tf(7, 7, &other)]).is_none(),
        "a gap between frames"
    );
    assert!(
        tail_log_values(&p, &[tf(4, 5, &frame), tf(6, 7, &other)]).is_some(),
        "consecutive ranges"
    );
    let hello = Arc::new(
        super::super::sync::encode_frame(&ToStandby::Hello {
            cluster_id: "c".into(),
            term: 1,
            lease: 2,
            leader: "l".into(),
        })
        .expect("frame"),
    );
    assert!(
        tail_log_values(&p, &[tf(1, 1, &hello)]).is_none(),
        "not an entry"
    );
    assert!(
        log_range(9, b"KVFn\x05\0\0\0\0\0\0\0").is_err(),
        "a range that ends before it starts"
    );
    assert!(log_range(9, b"KVFn\x05").is_err(), "a range cut short");
}

/// The tail keeps the entries after the etcd journal's position while they follow each
/// other and fit the cap; one missing, or one over the cap, drops the run. A background
/// snapshot's run, begun at its image's position, replaces the current one only once its
/// head is written; a rebase takes the current run only if it reaches the last entry.
/// A standby whose links keep failing is tried again after 1, 2, 4 ... 32 s, never less
/// than the first wait nor more than the last.
#[test]
fn a_standby_that_cannot_link_is_tried_less_and_less_often() {
    let s = |n| retry_link_after(n) / 1_000_000;
    assert_eq!(
        [s(0), s(1), s(2), s(3), s(6), s(7), s(u32::MAX)],
        [1, 1, 2, 4, 32, 32, 32]
    );
}
