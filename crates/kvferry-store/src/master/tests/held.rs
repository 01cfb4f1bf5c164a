//! The state machine's tests of space held for writes that may still land: writes a client
//! reports after a restart, zombie puts, segments dropped and mounted again, and what a new
//! leader holds after a takeover, with the space accounted exactly through all of it. Test
//! code only (`#[cfg(test)]`, declared so for the boundary check): it may use what the state
//! machine must not (randomness included).

use super::*;
use crate::proto::WriteInFlight;

#[cfg(test)]
mod accounting;

/// A master without HA that restarted knows nothing of the writes its predecessor placed;
/// a client reports the ones it still has running (`Request::HoldWrites`): nothing new is
/// placed in their segments until their time is over, a replica placed in their range
/// since the restart is dropped (its object goes: never served with bytes a late write
/// may overwrite), and the segment serves again when the time is over.
#[test]
fn writes_reported_still_running_keep_new_puts_out_of_their_segments_until_they_are_over() {
    let (mut st, m, s) = setup(&[]);
    // The restarted master: both segments mounted again, held for a lease of 1 s.
    st.remount(1, vec![seg(1, 1 << 20)], 0, 1_000).unwrap();
    st.remount(2, vec![seg(2, 1 << 20)], 0, 1_000).unwrap();
    st.release_deferred(1_000);
    // The lease over, a put lands in segment 1 before the writer's report.
    let one = ReplicateConfig {
        preferred_segments: vec!["seg1".into()],
        ..Default::default()
    };
    let early = put(&mut st, &m, &s, "early", 4096, &one, 1_000).unwrap();
    assert_eq!(early[0].te_endpoint, seg(1, 0).te_endpoint);
    let other = put(
        &mut st,
        &m,
        &s,
        "other",
        4096,
        &ReplicateConfig {
            preferred_segments: vec!["seg2".into()],
            ..Default::default()
        },
        1_000,
    )
    .unwrap();
    // The writer's report: a write over the start of segment 1 (where "early" went),
    // 5 s left.
    let w = WriteInFlight {
        te_endpoint: seg(1, 0).te_endpoint,
        addr: 1 << 32,
        size: 64 << 10,
        left_ms: 5_000,
    };
    assert_eq!(
        st.hold_writes(9, std::slice::from_ref(&w), 1_100, 600_000)
            .unwrap(),
        1
    );
    assert!(
        st.objects.get("early").is_none(),
        "the object placed where the write lands went"
    );
    assert!(
        st.objects.get("other").is_some(),
        "an object elsewhere stays"
    );
    assert_eq!(other.len(), 1);
    // Nothing new in segment 1 until 6_100, even preferred; segment 2 serves.
    for i in 0..8 {
        let r = put(&mut st, &m, &s, &format!("k{i}"), 4096, &one, 1_200).unwrap();
        assert_eq!(
            r[0].te_endpoint,
            seg(2, 0).te_endpoint,
            "placed in the held segment: {r:?}"
        );
    }
    st.release_deferred(6_100);
    let r = put(&mut st, &m, &s, "late", 4096, &one, 6_100).unwrap();
    assert_eq!(
        r[0].te_endpoint,
        seg(1, 0).te_endpoint,
        "the write's time over, the segment serves again"
    );
    assert_ne!(
        r[0].addr, early[0].addr,
        "the dropped replica's space is still held"
    );
    // The dropped replica's space is held for the release timeout (a reader, or a writer
    // of a write in progress there, may still touch it), then comes back.
    assert_eq!(st.segments[&1].space.used(), 8192);
    st.release_deferred(601_099);
    assert_eq!(st.segments[&1].space.used(), 8192);
    st.release_deferred(601_100);
    assert_eq!(st.segments[&1].space.used(), 4096);
    // A report about a write whose time is over, or of no length, holds nothing.
    let done = WriteInFlight {
        left_ms: 0,
        ..w.clone()
    };
    assert_eq!(st.hold_writes(9, &[done], 6_200, 600_000).unwrap(), 0);
    assert!(put(&mut st, &m, &s, "again", 4096, &one, 6_200).is_ok());
    // A time left beyond the release timeout is cut to it.
    let long = WriteInFlight {
        left_ms: u64::MAX,
        ..w
    };
    st.hold_writes(9, &[long], 7_000, 600_000).unwrap();
    assert_eq!(st.segments[&1].writes_until, 607_000);
    // A write this master knows (the reporter's put in progress here, on that very
    // range: its pings stopped, not its put) is left to it: not dropped, nothing held.
    st.register_client(3, 8_000);
    let mine = PutId { client: 3, put: 1 };
    let r = st
        .put_start(
            &m,
            &s,
            mine,
            "mine",
            4096,
            &ReplicateConfig {
                preferred_segments: vec!["seg2".into()],
                ..Default::default()
            },
            false,
            8_000,
        )
        .unwrap();
    let known = WriteInFlight {
        te_endpoint: r[0].te_endpoint.clone(),
        addr: r[0].addr,
        size: r[0].size,
        left_ms: 5_000,
    };
    assert_eq!(
        st.hold_writes(3, std::slice::from_ref(&known), 8_100, 600_000)
            .unwrap(),
        0
    );
    assert_eq!(st.segments[&2].writes_until, 0);
    st.put_end(mine, "mine", 8_200)
        .expect("the write this master knew completes");
    // The same range reported by another client is not its write: the put goes.
    let r = st
        .put_start(
            &m,
            &s,
            PutId { client: 3, put: 2 },
            "theirs",
            4096,
            &ReplicateConfig {
                preferred_segments: vec!["seg2".into()],
                ..Default::default()
            },
            false,
            8_300,
        )
        .unwrap();
    let other = WriteInFlight {
        te_endpoint: r[0].te_endpoint.clone(),
        addr: r[0].addr,
        size: r[0].size,
        left_ms: 5_000,
    };
    let used = st.segments[&2].space.used();
    assert_eq!(st.hold_writes(9, &[other], 8_400, 600_000).unwrap(), 1);
    assert!(
        st.objects.get("theirs").is_none(),
        "a put in the range of another's late write goes"
    );
    // Its writer may still be writing: its space stays held until the release timeout.
    st.release_deferred(608_399);
    assert_eq!(st.segments[&2].space.used(), used);
    st.release_deferred(608_400);
    assert_eq!(st.segments[&2].space.used(), used - 4096);
}

/// A write reported into a segment not mounted yet (its client remounts after the
/// writer's report) is kept for it: the segment of that endpoint covering the range,
/// once mounted, takes nothing new until the write's time is over; a segment of another
/// endpoint, or of that endpoint elsewhere, is not held. Too many reports are refused and
/// leave nothing kept.
#[test]
fn a_write_reported_before_its_segment_is_mounted_holds_that_segment_when_it_comes() {
    let (mut st, m, s) = setup(&[]);
    let ep = seg(1, 0).te_endpoint;
    let w = WriteInFlight {
        te_endpoint: ep.clone(),
        addr: (1 << 32) + 4096,
        size: 8192,
        left_ms: 3_000,
    };
    assert_eq!(
        st.hold_writes(9, std::slice::from_ref(&w), 100, 600_000)
            .unwrap(),
        0,
        "no segment of it is mounted"
    );
    // The same endpoint, another range (a second segment of that engine): not held.
    st.mount(
        7,
        Segment {
            id: 7,
            name: "elsewhere".into(),
            te_endpoint: ep.clone(),
            base: 9 << 32,
            size: 1 << 20,
        },
        200,
    )
    .unwrap();
    assert_eq!(st.segments[&7].writes_until, 0);
    st.mount(2, seg(2, 1 << 20), 200).unwrap();
    assert_eq!(st.segments[&2].writes_until, 0);
    st.mount(1, seg(1, 1 << 20), 300).unwrap();
    assert_eq!(
        st.segments[&1].writes_until, 3_100,
        "the reported write's time"
    );
    let one = ReplicateConfig {
        preferred_segments: vec!["seg1".into()],
        ..Default::default()
    };
    // (Segment 7 has the same endpoint and may take it: not where the write lands.)
    for i in 0..8 {
        let r = put(&mut st, &m, &s, &format!("k{i}"), 4096, &one, 400).unwrap();
        assert!(
            r[0].addr >> 32 != 1,
            "placed in segment 1, where a write may still land: {r:?}"
        );
    }
    // Reports past their time are forgotten.
    st.unmount(1, 1, 3_200, 600_000).unwrap();
    st.mount(1, seg(1, 1 << 20), 3_200).unwrap();
    assert_eq!(st.segments[&1].writes_until, 0);
    assert!(st.reported_writes.is_empty());
    // Over the limit: refused, nothing kept.
    let many = vec![
        WriteInFlight {
            te_endpoint: "gone:1".into(),
            ..w
        };
        MAX_REPORTED_WRITES + 1
    ];
    assert!(
        matches!(st.hold_writes(9, &many, 3_300, 600_000), Err(StoreError::InvalidParams(e)) if e.contains("at most"))
    );
    assert!(st.reported_writes.is_empty());
}

/// A write in progress into a segment whose client the master dropped (its pings stopped,
/// its memory still there) may still land after the client mounts the segment again:
/// the write's space stays held past the remount's read lease, until the put's start plus
/// the release timeout, and is given back then. A new leader rebuilt from the journal
/// taken while the segment was gone holds it the same.
#[test]
fn a_write_in_progress_into_a_dropped_segment_keeps_its_space_after_the_segment_comes_back() {
    let (mut st, m, s) = setup(&[]);
    st.journal_on();
    st.mount(1, seg(1, 1 << 20), 0).unwrap();
    st.register_client(2, 0);
    let writer = PutId { client: 2, put: 7 };
    let w = st
        .put_start(
            &m,
            &s,
            writer,
            "w",
            256 << 10,
            &ReplicateConfig::default(),
            false,
            1_000,
        )
        .unwrap();
    let (wa, we) = (w[0].addr, w[0].addr + w[0].size);
    st.ping(2, 10_000);
    let dead = st.expire_clients(10_001, 10_000, 600_000);
    assert_eq!(dead.len(), 1, "client 1 stopped pinging: {dead:?}");
    assert!(
        st.put_end(writer, "w", 10_002).is_err(),
        "the write's object went with the segment"
    );
    assert_eq!(st.deferred.len(), 1, "its space is held, on no segment");
    let mut image = changes::Image::default();
    for c in st.image(10_002) {
        image.apply(c);
    }
    let (back, _) = image.into_state(3, 10_002, 5_000);
    for (name, mut st) in [("this master", st), ("a new leader", back)] {
        st.remount(1, vec![seg(1, 1 << 20)], 10_100, 5_000).unwrap();
        st.release_deferred(15_100);
        for i in 0..12 {
            let r = put(
                &mut st,
                &m,
                &s,
                &format!("k{i}"),
                64 << 10,
                &ReplicateConfig::default(),
                15_100,
            )
            .unwrap_or_else(|e| panic!("{name}: the rest of the segment serves: {e}"));
            assert!(
                r[0].addr >= we || r[0].addr + r[0].size <= wa,
                "{name}: k{i} was placed on the bytes a write may still land on"
            );
        }
        assert_eq!(
            st.used_bytes(),
            1 << 20,
            "{name}: the write's space is held until its release timeout"
        );
        st.release_deferred(600_999);
        assert_eq!(st.used_bytes(), 1 << 20, "{name}");
        st.release_deferred(601_000);
        assert_eq!(
            st.used_bytes(),
            12 * (64 << 10),
            "{name}: given back at the put's start plus the release timeout"
        );
        assert!(st.deferred.is_empty(), "{name}");
    }
    // A segment mounted again with another range keeps only what lies in it.
    let (mut st, m, s) = setup(&[(1, 1 << 20)]);
    st.register_client(2, 0);
    st.put_start(
        &m,
        &s,
        writer,
        "w",
        256 << 10,
        &ReplicateConfig::default(),
        false,
        0,
    )
    .unwrap();
    st.ping(2, 10_000);
    st.expire_clients(10_001, 10_000, 600_000);
    st.mount(
        1,
        Segment {
            base: (1 << 32) + (1 << 20),
            ..seg(1, 1 << 20)
        },
        10_002,
    )
    .unwrap();
    assert!(
        st.deferred.is_empty() && st.used_bytes() == 0,
        "nothing of the old range to hold"
    );
}

/// A put that replaces a zombie (a put never ended, past the discard timeout) and then
/// fails (no room for it) leaves the key free, not a bare object refusing every later put.
#[test]
fn a_failed_put_over_a_zombie_leaves_the_key_free() {
    let (mut st, m, s) = setup(&[(1, 64 << 10)]);
    st.put_start(&m, &s, P1, "z", 4096, &ReplicateConfig::default(), false, 0)
        .unwrap();
    let later = m.put_start_discard_timeout.as_millis() as u64 + 1;
    assert!(matches!(
        st.put_start(
            &m,
            &s,
            P1,
            "z",
            1 << 20,
            &ReplicateConfig::default(),
            false,
            later
        ),
        Err(StoreError::NoAvailableHandle { .. })
    ));
    assert!(st.objects.get("z").is_none(), "no bare object left behind");
    put(
        &mut st,
        &m,
        &s,
        "z",
        4096,
        &ReplicateConfig::default(),
        later + 1,
    )
    .expect("the key is free");
    assert!(st.exist_key("z", later + 2, 1).unwrap());
}

/// A readable object whose upsert was abandoned (its client died after `PutStart`) still
/// refuses a plain put once the upsert is discarded: Mooncake's "first writer wins".
#[test]
fn a_plain_put_does_not_replace_a_value_whose_upsert_was_abandoned() {
    let (mut st, m, s) = setup(&[(1, 1 << 20)]);
    put(&mut st, &m, &s, "k", 4096, &ReplicateConfig::default(), 0).unwrap();
    let b = PutId { client: 1, put: 2 };
    st.put_start(&m, &s, b, "k", 4096, &ReplicateConfig::default(), true, 1)
        .unwrap();
    let later = m.put_start_discard_timeout.as_millis() as u64 + 2;
    let c = PutId { client: 1, put: 3 };
    assert!(matches!(
        st.put_start(
            &m,
            &s,
            c,
            "k",
            4096,
            &ReplicateConfig::default(),
            false,
            later
        ),
        Err(StoreError::ObjectAlreadyExists(_))
    ));
    assert!(
        st.get_replica_list("k", later, 1).is_ok(),
        "the first value is still served"
    );
    st.put_start(
        &m,
        &s,
        c,
        "k",
        4096,
        &ReplicateConfig::default(),
        true,
        later,
    )
    .expect("an upsert replaces it");
}

/// A range held back briefly (a read's object force-removed, then released early) and
/// then again for long (a write in progress there removed): both are in the journal, and
/// a new leader holds every byte for the longest time any hold of it had, whichever it
/// meets first, also when the ranges only overlap, and on a segment that went and comes
/// back. (Found by a review: the first hold met won, and the write's bytes were free
/// after one lease.)
#[test]
fn a_new_leader_holds_each_byte_for_the_longest_of_the_holds_the_journal_names() {
    for (first, dropped) in [(4096, false), (1024, false), (1024, true), (8192, true)] {
        let (mut st, m, s) = setup(&[(1, 1 << 20)]);
        st.journal_on();
        let mut image = changes::Image::default();
        for c in st.image(0) {
            image.apply(c);
        }
        st.register_client(2, 0);
        let w1 = PutId { client: 2, put: 1 };
        let r1 = st
            .put_start(
                &m,
                &s,
                w1,
                "k1",
                first,
                &ReplicateConfig::default(),
                false,
                0,
            )
            .unwrap();
        st.put_end(w1, "k1", 0).unwrap();
        let read = st.get_replica_list("k1", 0, 5_000).unwrap();
        st.remove(&m, "k1", true, 10).unwrap();
        st.release_reads(&[read.read_id], 20);
        let w2 = PutId { client: 2, put: 2 };
        let r2 = st
            .put_start(
                &m,
                &s,
                w2,
                "k2",
                4096,
                &ReplicateConfig::default(),
                false,
                30,
            )
            .unwrap();
        assert_eq!(r2[0].addr, r1[0].addr, "the write reuses the read's range");
        let now = if dropped {
            st.ping(2, 10_000);
            st.expire_clients(10_001, 10_000, 600_000);
            10_001
        } else {
            st.remove(&m, "k2", true, 40).unwrap();
            40
        };
        for c in st.take_changes(now) {
            image.apply(c);
        }
        let (mut back, _) = image.into_state(2, now + 60, 5_000);
        if dropped {
            back.mount(1, seg(1, 1 << 20), now + 100).unwrap();
        }
        let what = format!("first hold {first} bytes, segment dropped: {dropped}");
        back.release_deferred(now + 5_100);
        assert_eq!(
            back.used_bytes(),
            4096,
            "{what}: the write's 4096 bytes held past one lease"
        );
        back.release_deferred(600_000);
        assert_eq!(back.used_bytes(), 4096, "{what}");
        back.release_deferred(now + 600_100);
        assert_eq!(
            back.used_bytes(),
            0,
            "{what}: given back at the write's time"
        );
    }
}

#[test]
fn held_pieces_take_the_latest_time_of_the_ranges_covering_them() {
    use changes::held_pieces as pieces;
    assert_eq!(pieces(vec![]), []);
    assert_eq!(pieces(vec![(0, 64, 5)]), [(0, 64, 5)]);
    assert_eq!(
        pieces(vec![(0, 64, 5), (0, 64, 9), (0, 64, 7)]),
        [(0, 64, 9)],
        "the same range: the latest"
    );
    assert_eq!(
        pieces(vec![(0, 256, 9), (64, 128, 5)]),
        [(0, 64, 9), (64, 128, 9), (128, 256, 9)],
        "inside a later one"
    );
    assert_eq!(
        pieces(vec![(0, 128, 5), (64, 256, 9)]),
        [(0, 64, 5), (64, 128, 9), (128, 256, 9)],
        "overlapping"
    );
    assert_eq!(
        pieces(vec![(128, 192, 3), (0, 64, 5)]),
        [(0, 64, 5), (128, 192, 3)],
        "a gap is in no piece"
    );
    assert_eq!(
        pieces(vec![(0, 64, 5), (64, 128, 3), (64, 64, 9)]),
        [(0, 64, 5), (64, 128, 3)],
        "an empty range is none"
    );
}

/// Dropped segments are looked for at a mount only while something is held on them: a
/// dropped segment with nothing held is not remembered, and one whose holds ran out is
/// forgotten within a minute, while other holds go on. (Found by a review: with one
/// long hold anywhere, every segment ever dropped was kept.)
#[test]
fn dropped_segments_are_remembered_only_while_something_is_held_on_them() {
    let (mut st, m, s) = setup(&[(1, 1 << 20)]);
    st.put_start(&m, &s, P1, "z", 4096, &ReplicateConfig::default(), false, 0)
        .unwrap();
    st.remove(&m, "z", true, 0).unwrap();
    st.register_client(2, 0);
    for i in 0..1_000u64 {
        let id = 100 + i;
        st.mount(id, seg(id, 1 << 20), i).unwrap();
        if i % 10 == 0 {
            let w = PutId { client: 2, put: i };
            st.put_start(
                &m,
                &s,
                w,
                &format!("w{i}"),
                4096,
                &ReplicateConfig {
                    preferred_segments: vec![format!("seg{id}")],
                    ..Default::default()
                },
                false,
                i,
            )
            .unwrap();
        }
        st.unmount(id, id, i, 10_000).unwrap();
        st.release_deferred(i);
    }
    assert_eq!(
        st.orphaned.len(),
        100,
        "only the segments a write was in progress into"
    );
    st.release_deferred(70_000);
    assert!(
        st.orphaned.is_empty(),
        "their holds ran out: {} left",
        st.orphaned.len()
    );
    assert_eq!(st.deferred.len(), 1, "the long hold goes on");
}
