//! Tests of the mirror, the frame codec and the etcd records; a link's own tests, both
//! sides, are in `ha::link` and `ha::standby`. Must not need etcd.

use super::*;
use crate::ha::link::{run_frames, RUN_PIECE};
use crate::repl::TailFrame;
use std::sync::Arc;

mod tails;

impl Mirror {
    /// [`Mirror::take`] of a mirror that built nothing ahead.
    fn take_image(&self, term: i64) -> Option<(Image, u64, MirrorTail)> {
        self.take(term).map(|(t, seq, tail)| match t {
            Taken::Image(image) => (image, seq, tail),
            Taken::Built { .. } => panic!("a state built ahead"),
        })
    }
}

fn seg1() -> Change {
    Change::Mount {
        client: 7,
        seg: crate::proto::Segment {
            id: 1,
            name: "s1".into(),
            te_endpoint: "127.0.0.1:1".into(),
            base: 0,
            size: 1 << 20,
        },
    }
}

fn obj_at(key: &str, addr: u64) -> Change {
    Change::Object {
        key: key.into(),
        rec: ObjectRec {
            size: 100,
            current: smallvec::smallvec![(1, addr, 100)],
            pending: None,
            owner: 7,
            hard_pin: false,
            soft_pin_left: 0,
            group: None,
        },
    }
}

/// A mirror whose feed ended builds the master's state ahead (not while fed), and a
/// takeover gets that state, with every object; a leader that links again replaces the
/// mirror, and the state built from the old one is not used.
#[test]
fn a_mirror_whose_feed_ended_builds_the_state_ahead_for_a_takeover() {
    let m = Mirror::new("c", Duration::from_secs(5), 1 << 20).with_prebuilder(Prebuilder {
        clock: Instant::now(),
        lease_ms: 1000,
    });
    m.set_leader(Some((5, 50)));
    let c = m.hello("c", 5, 50).unwrap();
    m.apply(
        c,
        ToStandby::Image {
            seq: 3,
            changes: vec![seg1(), obj_at("a", 0), obj_at("b", 4096)],
            last: true,
        },
    )
    .unwrap();
    m.apply(
        c,
        ToStandby::Base {
            seq: 3,
            written: true,
        },
    )
    .unwrap();
    m.apply(
        c,
        ToStandby::Entry {
            seq: 4,
            changes: vec![obj_at("c", 8192)],
        },
    )
    .unwrap();
    m.prebuild();
    assert!(
        matches!(*locked(&m.prebuilt), Prebuild::None),
        "nothing is built while the leader feeds the mirror"
    );
    m.detach(c);
    m.prebuild();
    assert!(matches!(
        *locked(&m.prebuilt),
        Prebuild::Built { seq: 4, .. }
    ));
    assert_eq!(
        (m.status().objects, m.complete_term()),
        (3, Some(5)),
        "the mirror still says what it holds, and may lead"
    );
    match m.take(5) {
        Some((Taken::Built { state, rebuilt, .. }, 4, tail)) => {
            assert_eq!(
                (
                    rebuilt.objects,
                    state.summary().keys,
                    tail.after(3, 4).map(|t| t.len())
                ),
                (3, 3, Some(1))
            );
        }
        _ => panic!("the state built ahead"),
    }
    // Built again, then the leader links again: a new image replaces the mirror and the
    // state built from the old one.
    m.reopen();
    let c = m.hello("c", 5, 50).unwrap();
    m.apply(
        c,
        ToStandby::Image {
            seq: 9,
            changes: vec![seg1(), obj_at("a", 0)],
            last: true,
        },
    )
    .unwrap();
    m.detach(c);
    m.prebuild();
    assert!(matches!(
        *locked(&m.prebuilt),
        Prebuild::Built { seq: 9, .. }
    ));
    m.hello("c", 5, 50).unwrap();
    assert!(
        matches!(*locked(&m.prebuilt), Prebuild::None),
        "a hello drops it"
    );
    // A build under way is left to its end (which sees the hello and drops what it built):
    // cleared before it ends, a second build could start and a takeover not wait for it,
    // taking the image-less mirror.
    *locked(&m.prebuilt) = Prebuild::Building { objects: 1 };
    m.hello("c", 5, 50).unwrap();
    m.close();
    m.reopen();
    assert!(
        matches!(*locked(&m.prebuilt), Prebuild::Building { .. }),
        "only the build's end replaces its marker"
    );
    *locked(&m.prebuilt) = Prebuild::None;
    let c = m.hello("c", 5, 50).unwrap();
    m.apply(
        c,
        ToStandby::Image {
            seq: 12,
            changes: vec![seg1(), obj_at("x", 0), obj_at("y", 4096)],
            last: true,
        },
    )
    .unwrap();
    m.apply_pending();
    let (image, seq, _) = m.take_image(5).expect("complete");
    assert_eq!((image.objects(), seq), (2, 12));
}
use crate::master::changes::ObjectRec;
use proptest::prelude::*;

fn obj(key: &str, size: u64) -> Change {
    Change::Object {
        key: key.into(),
        rec: ObjectRec {
            size,
            current: smallvec::smallvec![(1, 4096, size)],
            pending: None,
            owner: 7,
            hard_pin: false,
            soft_pin_left: 0,
            group: None,
        },
    }
}

#[test]
fn frames_round_trip_and_partial_input_waits() {
    let f = ToStandby::Entry {
        seq: 9,
        changes: vec![obj("a", 10), Change::Forget { key: "b".into() }],
    };
    let bytes = encode_frame(&f).unwrap();
    for cut in 0..bytes.len() {
        assert_eq!(
            decode_frame::<ToStandby>(&bytes[..cut]).unwrap(),
            None,
            "{cut} bytes are not a frame yet"
        );
        assert!(
            !frame::whole(&bytes[..cut]),
            "a standby acknowledges rather than wait for the rest of a frame"
        );
    }
    assert!(
        frame::whole(&bytes),
        "another whole frame is read: applied before acknowledging"
    );
    let mut two = bytes.clone();
    two.extend(encode_frame(&ToLeader::Ack { seq: 3 }).unwrap());
    assert_eq!(
        decode_frame::<ToStandby>(&two).unwrap(),
        Some((f.clone(), bytes.len()))
    );
    assert_eq!(
        decode_frame::<ToLeader>(&two[bytes.len()..])
            .unwrap()
            .map(|x| x.0),
        Some(ToLeader::Ack { seq: 3 })
    );
    assert_eq!(read_frame::<ToStandby>(&mut &bytes[..]).unwrap(), f);
    assert!(
        read_frame::<ToStandby>(&mut &bytes[..bytes.len() - 1]).is_err(),
        "a frame cut short is an error"
    );
    let huge = ((MAX_FRAME + 1) as u32).to_le_bytes();
    assert!(
        decode_frame::<ToStandby>(&huge)
            .unwrap_err()
            .contains("claims"),
        "an oversized length is refused before any allocation"
    );
    // A hello (read from anyone who connects) or an acknowledgement claiming more than a
    // small frame is refused; a large claim followed by nothing is an error, not a
    // reservation of what it claims.
    let big = ((MAX_SMALL_FRAME + 1) as u32).to_le_bytes();
    assert!(read_frame_max::<ToStandby>(&mut &big[..], MAX_SMALL_FRAME)
        .unwrap_err()
        .contains("claims"));
    let claim = ((MAX_FRAME - 1) as u32).to_le_bytes();
    assert!(read_frame::<ToStandby>(&mut &claim[..])
        .unwrap_err()
        .contains("cut short"));
}

/// The link's wire bytes, pinned: the length prefix (u32 little-endian), then the postcard
/// body.
#[test]
fn frames_keep_their_wire_bytes() {
    let hello = ToStandby::Hello {
        cluster_id: "c".into(),
        term: 1,
        lease: 2,
        leader: "l".into(),
    };
    assert_eq!(
        encode_frame(&hello).unwrap(),
        [7, 0, 0, 0, 0, 1, b'c', 2, 4, 1, b'l']
    );
    assert_eq!(
        encode_frame(&ToStandby::Base {
            seq: 9,
            written: true
        })
        .unwrap(),
        [3, 0, 0, 0, 3, 9, 1]
    );
    assert_eq!(
        encode_frame(&ToLeader::Ack { seq: 300 }).unwrap(),
        [3, 0, 0, 0, 0, 0xac, 0x02]
    );
    assert_eq!(
        decode_frame::<ToLeader>(&[3, 0, 0, 0, 0, 0xac, 0x02, 9]).unwrap(),
        Some((ToLeader::Ack { seq: 300 }, 7))
    );
    assert_eq!(
        read_frame::<ToStandby>(&mut &[7, 0, 0, 0, 0, 1, b'c', 2, 4, 1, b'l'][..]).unwrap(),
        hello
    );
}

proptest! {
    #[test]
    fn decoding_any_bytes_never_panics(b in proptest::collection::vec(any::<u8>(), 0..64)) {
        let _ = decode_frame::<ToStandby>(&b);
        let _ = decode_frame::<ToLeader>(&b);
        let _ = read_frame::<ToStandby>(&mut &b[..]);
    }
}

#[test]
fn a_mirror_applies_an_image_then_entries_in_order_from_its_newest_leader_only() {
    let m = Mirror::new("c", Duration::from_secs(5), 1 << 20);
    m.set_leader(Some((5, 50)));
    assert!(
        m.hello("other", 5, 50).is_err(),
        "another cluster's leader is refused"
    );
    assert!(
        m.hello("c", 5, 51).is_err(),
        "a master etcd does not name (another lease) is refused"
    );
    assert!(
        m.hello("c", 6, 50).is_err(),
        "a master etcd does not name (another term) is refused"
    );
    let c1 = m.hello("c", 5, 50).unwrap();
    assert!(
        m.apply(
            c1,
            ToStandby::Entry {
                seq: 1,
                changes: vec![]
            }
        )
        .is_err(),
        "an entry before the image is refused"
    );
    let c1 = m.hello("c", 5, 50).unwrap();
    assert_eq!(
        m.apply(
            c1,
            ToStandby::Image {
                seq: 4,
                changes: vec![obj("a", 1)],
                last: false
            }
        )
        .unwrap(),
        None
    );
    assert_eq!(
        m.complete_term(),
        None,
        "an image in progress is not a mirror to lead from"
    );
    assert_eq!(
        m.apply(
            c1,
            ToStandby::Image {
                seq: 4,
                changes: vec![obj("b", 2)],
                last: true
            }
        )
        .unwrap(),
        Some(4)
    );
    assert_eq!(m.complete_term(), Some(5));
    assert_eq!(
        m.apply(
            c1,
            ToStandby::Base {
                seq: 4,
                written: true
            }
        )
        .unwrap(),
        None,
        "a run's start acknowledges nothing"
    );
    assert_eq!(
        m.status().pending_changes,
        2,
        "acknowledged (held) before it is applied"
    );
    m.apply_pending();
    assert_eq!(m.status().pending_changes, 0);
    assert!(
        m.hello("c", 5, 99).is_err(),
        "a stranger's hello is refused ..."
    );
    assert_eq!(
        m.complete_term(),
        Some(5),
        "... and leaves the mirror and its feed as they were"
    );
    assert_eq!(
        m.apply(
            c1,
            ToStandby::Entry {
                seq: 6,
                changes: vec![Change::Forget { key: "a".into() }, obj("c", 3), obj("d", 4)]
            }
        )
        .unwrap(),
        Some(6)
    );
    assert!(
        m.apply(
            c1,
            ToStandby::Entry {
                seq: 6,
                changes: vec![]
            }
        )
        .is_err(),
        "an entry again is out of order"
    );
    assert_eq!(
        m.status().pending_changes,
        3,
        "the entry's changes are held, not applied: the takeover applies them"
    );
    m.set_leader(Some((4, 40)));
    assert!(
        m.hello("c", 4, 40).is_err(),
        "an older term's leader (a deposed one) is refused"
    );
    let (image, seq, tail) = m.take_image(5).expect("a complete mirror of term 5");
    assert_eq!(
        (image.objects(), seq),
        (3, 6),
        "b, c and d: the image and the entry applied"
    );
    assert_eq!(
        tail.after(4, 6)
            .map(|t| t.iter().map(|f| (f.first, f.last)).collect::<Vec<_>>()),
        Some(vec![(5, 6)]),
        "the entry as it came, standing for the log's entries after the run's start"
    );
    assert!(m.take_image(5).is_none(), "taken once");
    m.set_leader(Some((9, 90)));
    assert!(
        m.hello("c", 9, 90).is_err(),
        "a mirror taken over accepts nothing"
    );
    m.reopen();
    assert!(m.hello("c", 4, 40).is_err());
    let c9 = m.hello("c", 9, 90).unwrap();
    assert!(
        m.apply(
            c1,
            ToStandby::Entry {
                seq: 7,
                changes: vec![]
            }
        )
        .is_err(),
        "the replaced connection feeds nothing"
    );
    assert_eq!(
        m.apply(
            c9,
            ToStandby::Image {
                seq: 7,
                changes: vec![],
                last: true
            }
        )
        .unwrap(),
        Some(7)
    );
    assert!(
        m.take_image(5).is_none(),
        "a mirror of term 9 is not one of term 5"
    );
    // A takeover that failed puts its mirror back: complete, of the record's term, fed by
    // nobody until a leader says hello.
    let (image, seq, tail) = m.take_image(9).expect("complete");
    m.restore(9, image, seq, tail);
    assert_eq!(m.complete_term(), Some(9));
    assert!(
        m.apply(
            c9,
            ToStandby::Entry {
                seq: 8,
                changes: vec![]
            }
        )
        .is_err(),
        "the old connection no longer feeds it"
    );
    assert_eq!(
        m.take_image(9).map(|(i, s, t)| (i.objects(), s, t.bytes())),
        Some((0, 7, 0))
    );
}

#[test]
fn a_registration_says_where_the_mirror_is_its_term_and_that_it_takes_runs() {
    assert_eq!(
        parse_registration(&registration("1.2.3.4:5", Some(7))),
        Registration {
            addr: "1.2.3.4:5",
            mirror: Some(7),
            runs: true,
            grants: true
        }
    );
    assert_eq!(
        parse_registration(&registration("1.2.3.4:5", None)),
        Registration {
            addr: "1.2.3.4:5",
            mirror: None,
            runs: true,
            grants: true
        }
    );
    assert_eq!(
        parse_registration("1.2.3.4:5 7 runs"),
        Registration {
            addr: "1.2.3.4:5",
            mirror: Some(7),
            runs: true,
            grants: false
        },
        "the last version's"
    );
    // As an earlier version wrote them, and as it reads these (its first two words).
    assert_eq!(
        parse_registration("1.2.3.4:5 7"),
        Registration {
            addr: "1.2.3.4:5",
            mirror: Some(7),
            runs: false,
            grants: false
        }
    );
    assert_eq!(
        parse_registration("1.2.3.4:5"),
        Registration {
            addr: "1.2.3.4:5",
            mirror: None,
            runs: false,
            grants: false
        }
    );
    let old = |v: &str| {
        let mut w = v.split_whitespace();
        (
            w.next().map(str::to_string),
            w.next().and_then(|t| t.parse::<i64>().ok()),
        )
    };
    assert_eq!(
        old(&registration("a:1", None)),
        (Some("a:1".to_string()), None)
    );
    assert_eq!(
        old(&registration("a:1", Some(3))),
        (Some("a:1".to_string()), Some(3))
    );
}

#[test]
fn a_stopping_member_is_needed_only_as_the_last_holder_of_its_terms_mirror() {
    let rec = InSync {
        term: 7,
        members: vec!["a:1".into(), "b:1".into()],
    };
    assert!(
        needed_at_stop(&rec, "a:1", Some(7), |_| false),
        "the only member alive with the record's mirror"
    );
    assert!(
        !needed_at_stop(&rec, "a:1", Some(7), |m| m == "b:1"),
        "another member alive holds it too"
    );
    assert!(
        !needed_at_stop(&rec, "a:1", Some(6), |_| false),
        "a mirror of another term is not what was acknowledged"
    );
    assert!(!needed_at_stop(&rec, "a:1", None, |_| false));
    assert!(
        !needed_at_stop(&rec, "c:1", Some(7), |_| false),
        "not a member: the leader did not wait for it"
    );
    assert!(
        !needed_at_stop(&InSync::default(), "a:1", Some(7), |_| false),
        "the set is empty: etcd holds everything"
    );
}

#[test]
fn a_sealed_mirror_is_fed_no_more_and_keeps_what_it_holds() {
    let m = Mirror::new("c", Duration::from_secs(5), 1 << 20);
    m.set_leader(Some((5, 50)));
    let c = m.hello("c", 5, 50).unwrap();
    assert_eq!(
        m.apply(
            c,
            ToStandby::Image {
                seq: 3,
                changes: vec![obj("a", 1)],
                last: true
            }
        )
        .unwrap(),
        Some(3)
    );
    m.apply_pending();
    assert_eq!(
        m.status(),
        MirrorStatus {
            term: 5,
            seq: 3,
            complete: true,
            fed: true,
            sealed: false,
            pending_changes: 0,
            objects: 1,
            tail_bytes: 0,
            tail_base: None
        }
    );
    m.seal();
    assert_eq!(
        m.status(),
        MirrorStatus {
            term: 5,
            seq: 3,
            complete: true,
            fed: false,
            sealed: true,
            pending_changes: 0,
            objects: 1,
            tail_bytes: 0,
            tail_base: None
        }
    );
    assert!(
        m.apply(
            c,
            ToStandby::Entry {
                seq: 4,
                changes: vec![obj("b", 1)]
            }
        )
        .is_err(),
        "its feed ended"
    );
    assert!(m.hello("c", 5, 50).is_err(), "no leader feeds it again");
    assert_eq!(m.complete_term(), Some(5), "still a mirror to lead from");
    assert_eq!(
        m.take_image(5).map(|(i, s, _)| (i.objects(), s)),
        Some((1, 3))
    );
    m.reopen();
    assert!(m.hello("c", 5, 50).is_err(), "sealed for good");

    // A connection that ended feeds its mirror no more, and says so.
    let m = Mirror::new("c", Duration::from_secs(5), 1 << 20);
    m.set_leader(Some((5, 50)));
    let c = m.hello("c", 5, 50).unwrap();
    assert!(m.status().fed);
    m.detach(c);
    assert!(!m.status().fed, "its connection ended");
    assert!(m
        .apply(
            c,
            ToStandby::Image {
                seq: 1,
                changes: vec![],
                last: true
            }
        )
        .is_err());
}

/// Held-back space is pruned from a mirror once two read leases passed, except what the
/// leader still held for longer (a write that may still land): that is taken over with
/// the time it has left.
#[test]
fn a_mirror_keeps_held_space_as_long_as_the_leader_held_it() {
    let m = Mirror::new("c", Duration::from_millis(1), 1 << 20);
    m.set_leader(Some((5, 50)));
    let c = m.hello("c", 5, 50).unwrap();
    let seg = crate::proto::Segment {
        id: 1,
        name: "s".into(),
        te_endpoint: "127.0.0.1:1".into(),
        base: 0,
        size: 1 << 20,
    };
    let changes = vec![
        Change::Mount { client: 7, seg },
        Change::HeldBack {
            replica: (1, 0, 4096),
        },
        Change::HeldUntil {
            replica: (1, 4096, 4096),
            left: 0,
        },
        Change::HeldUntil {
            replica: (1, 8192, 4096),
            left: 60_000,
        },
    ];
    assert_eq!(
        m.apply(
            c,
            ToStandby::Image {
                seq: 1,
                changes,
                last: true
            }
        )
        .unwrap(),
        Some(1)
    );
    m.apply_pending();
    // (Later than the read lease's two TTLs, 2 ms, after they came: no waiting needed.)
    m.apply_pending_at(Instant::now() + Duration::from_millis(20));
    let (image, _, _) = m.take_image(5).expect("a complete mirror");
    let (st, _) = image.into_state(6, 0, 1);
    assert_eq!(
        st.summary().deferred_frees,
        1,
        "only the range held for a minute is still held"
    );
    assert_eq!(st.used_bytes(), 4096);
    let mut st = st;
    st.release_deferred(58_000);
    assert_eq!(
        st.used_bytes(),
        4096,
        "held for what it had left (about a minute)"
    );
    st.release_deferred(60_001);
    assert_eq!(st.used_bytes(), 0);
}

#[test]
fn only_a_member_with_its_terms_mirror_leads_and_a_dead_set_means_starting_empty() {
    let rec = InSync {
        term: 7,
        members: vec!["a:1".into(), "b:1".into()],
    };
    assert_eq!(
        eligibility(&InSync::default(), "c:1", None, |_| true),
        Eligibility::Journal
    );
    assert_eq!(
        eligibility(&rec, "a:1", Some(7), |_| true),
        Eligibility::Mirror
    );
    assert_eq!(
        eligibility(&rec, "a:1", Some(6), |_| true),
        Eligibility::Wait,
        "a mirror of another term is not the one acknowledged"
    );
    assert_eq!(
        eligibility(&rec, "a:1", None, |_| false),
        Eligibility::Empty,
        "the only member left lost its mirror"
    );
    assert_eq!(
        eligibility(&rec, "c:1", None, |m| m == "b:1"),
        Eligibility::Wait,
        "a member is alive: only it may lead"
    );
    assert_eq!(
        eligibility(&rec, "c:1", None, |_| false),
        Eligibility::Empty
    );
    assert_eq!(InSync::parse(&rec.to_bytes()).unwrap(), rec);
    assert_eq!(InSync::parse(b"").unwrap(), InSync::default());
    assert!(InSync::parse(b"{").is_err());
}
