//! What a mirror keeps for a takeover: the entries after where the leader's journal is whole,
//! and a joining standby's run.

use super::*;

/// A mirror keeps the entries after where the leader says its etcd journal is whole, as
/// they came, for a takeover to write to that journal after where it ends: exactly the
/// frames after that position when a run reaches back to it, none when none does, or when
/// the journal ends inside a frame (several log entries streamed as one). A run that
/// would pass the cap is dropped and nothing is kept until the next start; a background
/// snapshot's start keeps the current run until its head is written; at most two runs. A
/// new leader's feed starts them again; a failed takeover puts them back.
#[test]
fn a_mirror_keeps_the_entries_after_where_the_leaders_journal_is_whole_for_a_takeover() {
    let entry = |seq: u64| ToStandby::Entry {
        seq,
        changes: (0..10).map(|i| obj(&format!("k{seq}-{i}"), 1)).collect(),
    };
    let base = |seq: u64, written: bool| ToStandby::Base { seq, written };
    // Room for four entries (of two-digit numbers; those of one digit are a byte shorter).
    let cap = 4 * encode_frame(&entry(10)).unwrap().len() + 2;
    let m = Mirror::new("c", Duration::from_secs(5), cap);
    m.set_leader(Some((5, 50)));
    let c = m.hello("c", 5, 50).unwrap();
    m.apply(
        c,
        ToStandby::Image {
            seq: 4,
            changes: vec![obj("a", 1)],
            last: false,
        },
    )
    .unwrap();
    m.apply(c, base(4, true)).unwrap();
    m.apply(
        c,
        ToStandby::Image {
            seq: 4,
            changes: vec![obj("b", 1)],
            last: true,
        },
    )
    .unwrap();
    assert_eq!(m.apply(c, entry(5)).unwrap(), Some(5));
    assert_eq!(
        m.status().tail_bytes,
        0,
        "no run started (one said before the image was whole starts nothing): nothing kept"
    );
    assert_eq!(
        m.apply(c, base(5, true)).unwrap(),
        None,
        "a run's start acknowledges nothing"
    );
    // Entry 8 stands for log entries 6..=8 (appended to etcd in three values).
    for seq in [8, 9] {
        assert_eq!(m.apply(c, entry(seq)).unwrap(), Some(seq));
    }
    assert_eq!(m.status().tail_base, Some(5));
    let (image, seq, tail) = m.take_image(5).expect("complete");
    let run = tail.after(5, 9).expect("the run from 5");
    assert_eq!(
        run.iter().map(|f| (f.first, f.last)).collect::<Vec<_>>(),
        [(6, 8), (9, 9)]
    );
    for f in &run {
        assert_eq!(
            decode_frame::<ToStandby>(&f.frame).unwrap().map(|(e, _)| e),
            Some(entry(f.last)),
            "the frame as it was sent"
        );
    }
    let firsts =
        |v: Option<Vec<TailFrame>>| v.map(|v| v.iter().map(|f| f.first).collect::<Vec<_>>());
    assert_eq!(firsts(tail.after(8, 9)), Some(vec![9]));
    assert_eq!(
        firsts(tail.after(9, 9)),
        Some(vec![]),
        "the journal holds everything: nothing to write"
    );
    assert_eq!(
        firsts(tail.after(7, 9)),
        None,
        "the journal ends inside a frame"
    );
    assert_eq!(
        firsts(tail.after(4, 9)),
        None,
        "the journal ends before the run's start (entry 5 was not kept)"
    );
    assert_eq!(
        firsts(tail.after(10, 9)),
        None,
        "the journal holds more than the mirror"
    );
    assert_eq!(
        firsts(tail.after(5, 10)),
        None,
        "the frames do not reach the mirror's last entry"
    );
    m.restore(5, image, seq, tail);
    m.reopen();
    // (Restored: the same mirror, its tail too.)
    let (image, seq, tail) = m.take_image(5).expect("restored");
    assert_eq!((seq, firsts(tail.after(5, 9))), (9, Some(vec![6, 9])));
    m.restore(5, image, seq, tail);

    // A leader's hello starts the mirror and its tail again.
    let c = m.hello("c", 5, 50).unwrap();
    m.apply(
        c,
        ToStandby::Image {
            seq: 20,
            changes: vec![],
            last: true,
        },
    )
    .unwrap();
    assert_eq!(m.status().tail_bytes, 0, "none from the earlier feed");
    m.apply(c, base(20, true)).unwrap();
    for seq in [21, 22] {
        m.apply(c, entry(seq)).unwrap();
    }
    m.apply(c, base(21, false)).unwrap();
    assert_eq!(
        m.status().tail_base,
        Some(20),
        "a start that is not right after the last entry starts nothing"
    );
    // A background snapshot at 22: its run starts, and the current one is kept until its
    // head is written.
    m.apply(c, base(22, false)).unwrap();
    for seq in [23, 24] {
        m.apply(c, entry(seq)).unwrap();
    }
    let (image, seq, tail) = m.take_image(5).expect("complete");
    assert_eq!(
        (firsts(tail.after(20, 24)), firsts(tail.after(22, 24))),
        (Some(vec![21, 22, 23, 24]), Some(vec![23, 24])),
        "either run, whichever the journal ends at"
    );
    m.restore(5, image, seq, tail);
    m.reopen();
    let c = m.hello("c", 5, 50).unwrap();
    m.apply(
        c,
        ToStandby::Image {
            seq: 22,
            changes: vec![],
            last: true,
        },
    )
    .unwrap();
    m.apply(c, base(20, true)).unwrap();
    m.apply(c, base(22, false)).unwrap();
    m.apply(c, base(20, true)).unwrap();
    assert_eq!(m.status().tail_base, None, "a written start this mirror has no run from drops the others (they do not reach back to it)");
    m.apply(c, base(22, false)).unwrap();
    m.apply(c, entry(23)).unwrap();
    m.apply(c, base(22, true)).unwrap();
    assert_eq!(
        m.take_image(5).map(|(_, _, t)| firsts(t.after(22, 23))),
        Some(Some(vec![23]))
    );
    m.reopen();
    let c = m.hello("c", 5, 50).unwrap();
    m.apply(
        c,
        ToStandby::Image {
            seq: 30,
            changes: vec![],
            last: true,
        },
    )
    .unwrap();
    m.apply(c, base(30, true)).unwrap();
    m.apply(c, entry(31)).unwrap();
    m.apply(c, base(31, false)).unwrap();
    m.apply(c, entry(32)).unwrap();
    m.apply(c, base(32, false)).unwrap();
    m.apply(c, entry(33)).unwrap();
    let (image, seq, tail) = m.take_image(5).expect("complete");
    assert_eq!(
        (
            firsts(tail.after(30, 33)),
            firsts(tail.after(31, 33)),
            firsts(tail.after(32, 33))
        ),
        (None, Some(vec![32, 33]), Some(vec![33])),
        "at most two runs: the oldest goes"
    );
    m.restore(5, image, seq, tail);
    m.reopen();

    // A run that would pass the cap is dropped, and nothing is kept until the next start.
    let c = m.hello("c", 5, 50).unwrap();
    m.apply(
        c,
        ToStandby::Image {
            seq: 40,
            changes: vec![],
            last: true,
        },
    )
    .unwrap();
    m.apply(c, base(40, true)).unwrap();
    for seq in 41..=44 {
        m.apply(c, entry(seq)).unwrap();
    }
    assert!(m.status().tail_bytes > 0 && m.status().tail_bytes <= cap);
    m.apply(c, entry(45)).unwrap();
    assert_eq!(m.status().tail_bytes, 0, "outgrew the cap: dropped");
    m.apply(c, entry(46)).unwrap();
    assert_eq!(m.status().tail_bytes, 0, "and none kept after");
    m.apply(c, base(46, true)).unwrap();
    m.apply(c, entry(47)).unwrap();
    let (_, _, tail) = m.take_image(5).expect("complete");
    assert_eq!(
        (firsts(tail.after(40, 47)), firsts(tail.after(46, 47))),
        (None, Some(vec![47])),
        "an entry the journal lacks was dropped: the whole state is written instead"
    );

    // A standby that links while others are in sync gets, right after its image, the
    // entries from where the journal is whole up to its image, kept and not applied.
    m.reopen();
    let kept = |first: u64, last: u64| KeptFrame {
        first,
        last,
        frame: bytes::Bytes::from(encode_frame(&entry(last)).unwrap()),
    };
    let joined = |run: ToStandby| {
        m.reopen();
        let c = m.hello("c", 5, 50).unwrap();
        m.apply(
            c,
            ToStandby::Image {
                seq: 60,
                changes: vec![obj("z", 1)],
                last: true,
            },
        )
        .unwrap();
        assert_eq!(m.apply(c, run).unwrap(), None, "a run acknowledges nothing");
        m.apply(c, entry(61)).unwrap();
        m.apply_pending();
        assert_eq!(
            m.status().objects,
            11,
            "the run's entries are not applied: the image holds them"
        );
        m.take_image(5).expect("complete").2
    };
    let t = joined(ToStandby::Run {
        base: 57,
        frames: vec![kept(58, 58), kept(59, 60)],
    });
    assert_eq!(firsts(t.after(57, 61)), Some(vec![58, 59, 61]));
    assert_eq!(firsts(t.after(58, 61)), Some(vec![59, 61]));
    assert_eq!(
        t.after(57, 61).expect("whole")[1].frame.as_slice(),
        &encode_frame(&entry(60)).unwrap()[..],
        "the frame as the leader sent it"
    );
    assert_eq!(
        firsts(
            joined(ToStandby::Run {
                base: 60,
                frames: vec![]
            })
            .after(60, 61)
        ),
        Some(vec![61]),
        "an image at the run's start"
    );
    assert_eq!(
        joined(ToStandby::Run {
            base: 57,
            frames: vec![kept(58, 58), kept(59, 59)]
        })
        .after(57, 61)
        .map(|t| t.len()),
        None,
        "a run that does not end at the image is not kept"
    );
    assert_eq!(
        joined(ToStandby::Run {
            base: 57,
            frames: vec![kept(58, 58), kept(60, 60)]
        })
        .after(57, 61)
        .map(|t| t.len()),
        None,
        "nor one with a gap"
    );
    assert_eq!(
        joined(ToStandby::Run {
            base: 50,
            frames: (51..=60).map(|n| kept(n, n)).collect()
        })
        .after(50, 61)
        .map(|t| t.len()),
        None,
        "nor one over the cap"
    );

    let none = Mirror::new("c", Duration::from_secs(5), 0);
    none.set_leader(Some((5, 50)));
    let c = none.hello("c", 5, 50).unwrap();
    none.apply(
        c,
        ToStandby::Image {
            seq: 1,
            changes: vec![],
            last: true,
        },
    )
    .unwrap();
    none.apply(c, base(1, true)).unwrap();
    none.apply(c, entry(2)).unwrap();
    assert_eq!(
        none.take_image(5)
            .expect("complete")
            .2
            .after(1, 2)
            .map(|t| t.len()),
        None,
        "a cap of 0 keeps none"
    );
}

/// A joining standby's run goes in frames of about [`RUN_PIECE`] bytes, the caller let in
/// between them; the standby keeps it once the frames reach its image, and not if an entry
/// comes first.
#[test]
fn a_run_for_a_joining_standby_goes_in_pieces_and_is_kept_once_whole() {
    let frames: Vec<TailFrame> = (58..=61)
        .map(|n| TailFrame {
            first: n,
            last: n,
            frame: Arc::new(vec![n as u8; RUN_PIECE / 2 + 1]),
        })
        .collect();
    let mut calls = 0;
    let pieces = run_frames(57, &frames, Duration::ZERO, || {
        calls += 1;
        true
    })
    .expect("frames");
    assert_eq!(
        (pieces.len(), calls),
        (4, 3),
        "a frame each (two would pass the piece's size), the caller let in between"
    );
    let decoded: Vec<(u64, Vec<KeptFrame>)> = pieces
        .iter()
        .map(|p| match decode_frame::<ToStandby>(p).expect("decodes") {
            Some((ToStandby::Run { base, frames }, _)) => (base, frames),
            other => panic!("a run frame, got {other:?}"),
        })
        .collect();
    let cap = 64 << 20;
    let mut t = MirrorTail::default();
    for (i, (base, kept)) in decoded.iter().cloned().enumerate() {
        assert!(
            t.after(57, 61).is_none(),
            "not kept before it reaches the image ({i} pieces)"
        );
        t.joined(base, kept, 61, cap);
    }
    let run = t.after(57, 61).expect("kept once whole");
    assert_eq!(
        run.iter()
            .map(|f| (f.first, f.frame.len(), f.frame[0]))
            .collect::<Vec<_>>(),
        (58..=61)
            .map(|n| (n, RUN_PIECE / 2 + 1, n as u8))
            .collect::<Vec<_>>()
    );
    let mut t = MirrorTail::default();
    for (base, kept) in decoded.iter().take(2).cloned() {
        t.joined(base, kept, 61, cap);
    }
    t.push(62, 62, vec![1], cap);
    t.joined(decoded[2].0, decoded[2].1.clone(), 61, cap);
    t.joined(decoded[3].0, decoded[3].1.clone(), 61, cap);
    assert!(
        t.after(57, 62).is_none() && t.after(57, 61).is_none(),
        "an entry came before the run reached the image: not kept"
    );
    let mut n = 0;
    assert!(
        run_frames(57, &frames, Duration::ZERO, || {
            n += 1;
            false
        })
        .is_err()
            && n == 1,
        "given up when the caller says so"
    );
}
