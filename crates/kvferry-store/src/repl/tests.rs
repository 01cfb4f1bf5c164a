//! The machines on a fake clock: each rule of their docs, and the queue and the pipeline
//! together against a model over many seeds.

use super::*;
use crate::master::changes::Change;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

const MS: u64 = 1000;

fn change(i: u64) -> Change {
    Change::Forget {
        key: format!("k{i}"),
    }
}

#[test]
fn a_deferred_answer_comes_back_once_durable_unknown_or_timed_out_never_across_terms() {
    let mut q: Queue<u32> = Queue::new(7);
    assert!(!q.enqueue(Vec::new(), 0), "no changes, no ticket");
    assert!(q.enqueue(vec![change(1)], 0));
    assert!(q.enqueue(vec![change(2)], 0));
    assert_eq!(q.outstanding(), Some(2));
    assert_eq!(q.defer(7, 1, 10, 0), None);
    assert_eq!(q.defer(7, 2, 20, 0), None);
    assert_eq!(
        q.defer(6, 2, 30, 0),
        Some((30, Outcome::Unknown)),
        "another term's ticket: unknown at once"
    );
    let w = q.written(1);
    assert_eq!((w.tickets, w.ready), (1..2, vec![10]));
    assert_eq!(
        q.defer(7, 1, 11, 0),
        Some((11, Outcome::Durable)),
        "durable already: at once"
    );
    assert!(
        q.written(1).ready.is_empty() && q.written(1).tickets.is_empty(),
        "nothing twice"
    );
    assert_eq!(
        q.expire(5 * MS, 10 * MS),
        Vec::<u32>::new(),
        "not yet past the bound"
    );
    assert_eq!(q.expire(10 * MS, 10 * MS), vec![20]);
    assert_eq!(q.deferred(), 0);
    // A late acknowledgement of an ended term makes nothing of the next one durable.
    assert!(q.enqueue(vec![change(3)], 0));
    assert_eq!(q.defer(7, 3, 40, 0), None);
    assert_eq!(
        q.activate(8),
        vec![40],
        "the term's deferred answers end unknown"
    );
    q.set_enqueued_for_test(3);
    assert!(q.written_in(7, 3).tickets.is_empty());
    assert_eq!(q.written_upto(), 0);
    // A failed term answers nothing durable, and refuses what comes after.
    assert_eq!(q.defer(8, 1, 50, 0), None);
    assert_eq!(q.fail(), vec![50]);
    assert!(q.written_in(8, 3).tickets.is_empty());
    assert_eq!(q.defer(8, 1, 51, 0), Some((51, Outcome::Unknown)));
    assert!(!q.ask_hand_off(), "nothing to hand off after a failure");
}

#[test]
fn grants_count_as_durable_only_with_the_ticket_that_holds_them() {
    let mut q: Queue<()> = Queue::new(1);
    q.enqueue(vec![change(1)], 3);
    q.enqueue(vec![change(2)], 3); // no new grant: no mark
    q.enqueue(vec![change(3)], 5);
    assert_eq!(q.written(1).grants, Some(3));
    assert_eq!(q.written(2).grants, None, "ticket 2 held no new grant");
    assert_eq!(q.written(3).grants, Some(5));
}

#[test]
fn a_hand_off_is_pending_until_done_or_the_term_ends() {
    let mut q: Queue<()> = Queue::default();
    assert!(!q.ask_hand_off(), "not journaling: nothing to hand off");
    let mut q: Queue<()> = Queue::new(2);
    assert!(q.ask_hand_off());
    assert!(q.busy() && q.hand_off_asked());
    assert_eq!(q.hand_off_state(), None);
    q.handed_off();
    assert_eq!(q.hand_off_state(), Some(true));
    let mut q: Queue<()> = Queue::new(2);
    q.ask_hand_off();
    q.deactivate();
    assert_eq!(q.hand_off_state(), Some(false));
}

#[test]
fn a_standby_working_through_a_burst_is_late_only_one_bound_after_its_last_progress() {
    let mut p = Pipeline::default();
    for seq in 1..=3 {
        p.push(seq, if seq == 3 { 1 } else { 0 }, 100 * MS);
    }
    assert_eq!(
        p.oldest(),
        Some((1, 100 * MS)),
        "nothing released yet: the clock runs from the send"
    );
    assert_eq!(
        p.release(Some(1), 130 * MS),
        Some(Released {
            upto: 0,
            entries: 1,
            waited_us: 30 * MS
        })
    );
    assert_eq!(
        p.oldest(),
        Some((2, 130 * MS)),
        "entry 2's clock starts when entry 1 was released, not when it was sent"
    );
    assert_eq!(p.late(629 * MS, 500 * MS), None);
    assert_eq!(p.late(630 * MS, 500 * MS), Some(2));
    assert_eq!(p.late_at(500 * MS), Some(630 * MS));
    assert_eq!(
        p.release(Some(3), 700 * MS),
        Some(Released {
            upto: 1,
            entries: 2,
            waited_us: 1200 * MS
        })
    );
    assert_eq!(p.oldest(), None);
    // An entry sent long after the last release: its clock starts at its send.
    p.push(4, 2, 2000 * MS);
    assert_eq!(p.oldest(), Some((4, 2000 * MS)));
    assert_eq!(
        p.release(None, 3000 * MS),
        None,
        "no member: nothing is released"
    );
    assert_eq!(
        p.release(Some(3), 3000 * MS),
        None,
        "nothing acknowledged that far"
    );
}

#[test]
fn the_tail_keeps_a_whole_run_from_the_journals_position_or_none() {
    let f = |n: usize| Arc::new(vec![0u8; n]);
    let mut t = Tail::new(100, Duration::from_secs(1), 0);
    t.push(1, &f(10));
    assert_eq!(t.size(), (0, false), "nothing kept before a run starts");
    t.start(5, 0);
    for seq in 6..=8 {
        t.push(seq, &f(10));
    }
    assert_eq!(t.size(), (30, true));
    assert!(
        !t.refresh_due(5000 * MS),
        "a whole run needs no background snapshot"
    );
    assert!(
        t.take(9).is_none(),
        "a run that does not reach the last entry is not used"
    );
    assert_eq!(t.size(), (0, false), "and the tail is empty after a take");
    t.start(5, 0);
    t.push(6, &f(10));
    t.push(8, &f(10));
    assert_eq!(t.size(), (0, false), "a missing entry drops the run");
    assert!(
        t.upto(6).is_none(),
        "and none is sent to a standby that links"
    );
    t.start(5, 10_000 * MS);
    t.push(6, &f(60));
    t.push(7, &f(60));
    assert_eq!(t.size(), (0, false), "over the cap drops the run");
    assert!(
        t.refresh_due(11_000 * MS),
        "then a background snapshot is due"
    );
    assert!(
        !t.refresh_due(10_999 * MS),
        "but not before `every` since the run started"
    );
    // A background snapshot: its image at 7, entries 8 and 9 meanwhile.
    t.start(5, 0);
    t.push(6, &f(10));
    t.push(7, &f(10));
    assert!(!t.begin(7, 0), "no run begins unless asked for");
    t.want_next();
    assert!(t.begin(7, 0));
    t.push(8, &f(10));
    t.push(9, &f(10));
    assert_eq!(
        t.size(),
        (40, true),
        "the current run goes on until the head is written"
    );
    // A standby linking now, its image at 8, gets the current run up to there.
    let lasts = |u: Option<(u64, Vec<TailFrame>)>| {
        u.map(|(b, f)| (b, f.iter().map(|f| f.last).collect::<Vec<_>>()))
    };
    assert_eq!(lasts(t.upto(8)), Some((5, vec![6, 7, 8])));
    assert_eq!(
        lasts(t.upto(5)),
        Some((5, vec![])),
        "an image at the run's start: nothing before it"
    );
    assert_eq!(lasts(t.upto(4)), None, "an image before the run's start");
    assert_eq!(
        lasts(t.upto(10)),
        None,
        "an image after the run's last entry"
    );
    assert!(t.refreshed(true), "written: the standbys are told");
    assert_eq!(
        t.size(),
        (20, true),
        "then the run from the image's position"
    );
    let run = t.take(9).expect("whole");
    assert_eq!(
        (
            run.base,
            run.frames.iter().map(|f| f.last).collect::<Vec<_>>()
        ),
        (7, vec![8, 9])
    );
    // Given up: the current run stays.
    t.start(9, 0);
    t.want_next();
    t.begin(9, 0);
    t.push(10, &f(10));
    assert!(
        !t.refreshed(false),
        "given up: nothing to tell the standbys"
    );
    assert_eq!(t.take(10).map(|r| r.base), Some(9));
    let mut none = Tail::new(0, Duration::ZERO, 0);
    none.start(1, 0);
    none.push(2, &f(1));
    assert!(none.take(2).is_none(), "a cap of 0 keeps nothing");
    assert!(!none.refresh_due(u64::MAX));
}

/// The figures of the kept tail (`kvferry_master_ha_tail_bytes`, `_tail_whole`, set from
/// `Tail::size_to_show` on every writer turn): shown at once when whether a run is kept
/// changes (a rebase the roster decided took it), else at most every 200 ms.
#[test]
fn the_tail_figures_change_at_once_when_a_rebase_takes_the_run_else_at_most_every_200_ms() {
    use super::roster::{RebaseFrom, Roster};
    let f = |n: usize| Arc::new(vec![0u8; n]);
    let mut t = Tail::new(100, Duration::from_secs(1), 0);
    assert_eq!(t.size_to_show(0), Some((0, false)), "shown once at first");
    t.start(5, 0);
    t.push(6, &f(10));
    assert_eq!(t.size_to_show(MS), Some((10, true)), "a run kept: at once");
    t.push(7, &f(10));
    assert_eq!(
        t.size_to_show(100 * MS),
        None,
        "grown, shown at most every 200 ms"
    );
    assert_eq!(t.size_to_show(201 * MS), Some((20, true)));
    // The in-sync set empties: the roster says the rebase writes the kept run.
    let run = t.take(7);
    let from = Roster::rebase_from(run.as_ref().map(|r| r.last()), 7, || true);
    assert_eq!(from, RebaseFrom::Tail);
    assert_eq!(
        t.size_to_show(202 * MS),
        Some((0, false)),
        "taken by the rebase: none kept, shown at once"
    );
    assert_eq!(t.size_to_show(203 * MS), None);
}

/// A standby that takes over writes the entries the etcd journal lacks from its kept run
/// when one reaches back to where the journal ends and every entry fits a log value; else
/// its whole state, as the snapshot after the later of the journal's and its mirror's last
/// entry.
#[test]
fn a_takeover_writes_the_kept_entries_etcd_lacks_or_else_the_whole_state() {
    let frame = |n: u8| Arc::new(vec![n; 4]);
    let mut m = MirrorTail::default();
    // A run from entry 5 (the journal whole there when the set filled), entries 6..=9.
    m.base(5, true, 5, 1 << 20);
    for seq in 6..=9 {
        m.push(seq, seq, frame(seq as u8).to_vec(), 1 << 20);
    }
    let lasts = |t: Takeover| match t {
        Takeover::Tail(f) => Ok(f.iter().map(|f| f.last).collect::<Vec<_>>()),
        Takeover::Whole { at } => Err(at),
    };
    assert_eq!(
        lasts(MirrorTail::takeover(Some(&m), 5, 9, |_| true)),
        Ok(vec![6, 7, 8, 9])
    );
    assert_eq!(
        lasts(MirrorTail::takeover(Some(&m), 7, 9, |_| true)),
        Ok(vec![8, 9]),
        "the journal went on after the run's start (a rebase the mirror also has)"
    );
    assert_eq!(
        lasts(MirrorTail::takeover(Some(&m), 9, 9, |f| f.is_empty())),
        Ok(vec![]),
        "the journal holds everything: nothing to write"
    );
    assert_eq!(
        lasts(MirrorTail::takeover(Some(&m), 5, 9, |_| false)),
        Err(9),
        "an entry too large for a log value: the whole state"
    );
    assert_eq!(
        lasts(MirrorTail::takeover(Some(&m), 3, 9, |_| true)),
        Err(9),
        "the run does not reach back to where the journal ends"
    );
    assert_eq!(
        lasts(MirrorTail::takeover(Some(&m), 11, 9, |_| true)),
        Err(11),
        "a journal ahead of the mirror: the whole state after the journal's last entry"
    );
    let none = MirrorTail::default();
    assert_eq!(
        lasts(MirrorTail::takeover(Some(&none), 5, 9, |_| true)),
        Err(9),
        "no run kept"
    );
    assert_eq!(
        lasts(MirrorTail::takeover(Some(&none), 9, 9, |_| true)),
        Ok(vec![]),
        "no run, but nothing lacking"
    );
    assert_eq!(
        lasts(MirrorTail::takeover(None, 0, 0, |_| true)),
        Err(0),
        "no mirror (a leader that starts empty): its whole state, even over an empty journal"
    );
}

/// The queue and the pipeline driven together as the journal's drivers drive them: requests
/// enqueue and defer, the writer takes batches and streams them as entries in pieces,
/// members acknowledge in any interleaving, leave the set, the term ends or fails (an ended
/// term's release still running), answers expire. Checked against a model after every step: every answer comes back exactly once;
/// `Durable` only for a ticket whose entries every member in the set at its release had
/// acknowledged, in its own term; the grants watermark never passes a ticket not durable.
#[test]
fn the_queue_and_the_pipeline_answer_each_request_once_and_durable_only_when_every_member_has_it() {
    let seeds: u64 = std::env::var("KVFERRY_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    for seed in 0..seeds {
        run_pipeline_seed(seed);
    }
}

fn run_pipeline_seed(seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut now = 0u64;
    let mut term = 1i64;
    let mut q: Queue<u64> = Queue::new(term);
    let mut p = Pipeline::default();
    let mut seq = 0u64;
    // Members' acknowledged entries (the in-sync set) and, per ticket a batch completed, the
    // entry that carried its last piece.
    let mut members: Vec<u64> = vec![0; rng.random_range(1..=3)];
    let mut ticket_seq: BTreeMap<u64, u64> = BTreeMap::new();
    // Answer id -> (term, ticket); answered ids.
    let mut pending: BTreeMap<u64, (i64, u64)> = BTreeMap::new();
    let mut answered: BTreeMap<u64, Outcome> = BTreeMap::new();
    let mut next_id = 0u64;
    let mut durable_grant = 0u64;
    let mut grants_issued = 0u64;
    // The last term's pipeline, its members and its last entry.
    let mut stale: Option<(Pipeline, i64, Vec<u64>, u64)> = None;
    let mut answer = |id: u64,
                      o: Outcome,
                      pending: &mut BTreeMap<u64, (i64, u64)>,
                      answered: &mut BTreeMap<u64, Outcome>| {
        assert!(
            pending.remove(&id).is_some(),
            "seed {seed}: answer {id} unknown"
        );
        assert!(
            answered.insert(id, o).is_none(),
            "seed {seed}: answer {id} came back twice"
        );
    };
    for step in 0..300 {
        now += rng.random_range(0..20 * MS);
        match rng.random_range(0..100) {
            // A request's changes, deferred on their ticket.
            0..=34 => {
                if rng.random_bool(0.3) {
                    grants_issued += 1;
                }
                q.enqueue(vec![change(step)], grants_issued);
                if let Some(t) = q.outstanding() {
                    let id = next_id;
                    next_id += 1;
                    pending.insert(id, (term, t));
                    if let Some((id, o)) = q.defer(term, t, id, now) {
                        answer(id, o, &mut pending, &mut answered);
                    }
                }
            }
            // The writer streams what is queued, in pieces of at most two changes.
            35..=49 => {
                let (changes, upto) = q.take();
                let n = changes.len().div_ceil(2);
                for i in 0..n {
                    seq += 1;
                    let t = if i + 1 == n { upto } else { 0 };
                    p.push(seq, t, now);
                    if t > 0 {
                        ticket_seq.insert(t, seq);
                    }
                }
            }
            // An ended term's release, still running on its acknowledgement threads.
            50..=54 if stale.is_some() => {
                if let Some((sp, sterm, smembers, sseq)) = stale.as_mut() {
                    for m in smembers.iter_mut() {
                        *m = *sseq;
                    }
                    release(
                        &mut q,
                        sp,
                        smembers,
                        *sterm,
                        now,
                        &ticket_seq,
                        &mut durable_grant,
                        seed,
                        &mut pending,
                        &mut answered,
                        &mut answer,
                    );
                }
            }
            // A member acknowledges more (never past what was sent), then the release.
            50..=79 => {
                if let Some(m) = (!members.is_empty()).then(|| rng.random_range(0..members.len())) {
                    members[m] = rng.random_range(members[m]..=seq);
                }
                release(
                    &mut q,
                    &mut p,
                    &members,
                    term,
                    now,
                    &ticket_seq,
                    &mut durable_grant,
                    seed,
                    &mut pending,
                    &mut answered,
                    &mut answer,
                );
            }
            // A late member leaves the set (etcd said so); the rest release what they hold.
            80..=84 => {
                if members.len() > 1 {
                    let late = p.late(now, 100 * MS).is_some();
                    if late || rng.random_bool(0.3) {
                        let m = rng.random_range(0..members.len());
                        members.remove(m);
                        release(
                            &mut q,
                            &mut p,
                            &members,
                            term,
                            now,
                            &ticket_seq,
                            &mut durable_grant,
                            seed,
                            &mut pending,
                            &mut answered,
                            &mut answer,
                        );
                    }
                }
            }
            // Deferred answers past their bound.
            85..=89 => {
                for id in q.expire(now, 200 * MS) {
                    answer(id, Outcome::TimedOut, &mut pending, &mut answered);
                }
            }
            // The term fails, or ends and the next starts with a new set.
            90..=94 => {
                if rng.random_bool(0.5) {
                    for id in q.fail() {
                        answer(id, Outcome::Unknown, &mut pending, &mut answered);
                    }
                }
            }
            _ => {
                stale = Some((std::mem::take(&mut p), term, members.clone(), seq));
                term += 1;
                for id in q.activate(term) {
                    answer(id, Outcome::Unknown, &mut pending, &mut answered);
                }
                (p, seq, members, durable_grant, grants_issued) = (
                    Pipeline::default(),
                    0,
                    vec![0; rng.random_range(1..=3)],
                    0,
                    0,
                );
                ticket_seq.clear();
            }
        }
    }
    for id in q.deactivate() {
        answer(id, Outcome::Unknown, &mut pending, &mut answered);
    }
    assert_eq!(
        answered.len() as u64,
        next_id,
        "seed {seed}: every answer comes back"
    );
}

#[allow(clippy::too_many_arguments)]
fn release(
    q: &mut Queue<u64>,
    p: &mut Pipeline,
    members: &[u64],
    term: i64,
    now: u64,
    ticket_seq: &BTreeMap<u64, u64>,
    durable_grant: &mut u64,
    seed: u64,
    pending: &mut BTreeMap<u64, (i64, u64)>,
    answered: &mut BTreeMap<u64, Outcome>,
    answer: &mut impl FnMut(u64, Outcome, &mut BTreeMap<u64, (i64, u64)>, &mut BTreeMap<u64, Outcome>),
) {
    let Some(r) = p.release(members.iter().copied().min(), now) else {
        return;
    };
    let w = q.written_in(term, r.upto);
    let min = members.iter().copied().min().unwrap_or(0);
    for id in w.ready {
        let (t_term, ticket) = pending
            .get(&id)
            .copied()
            .unwrap_or_else(|| panic!("seed {seed}: answer {id} unknown"));
        assert_eq!(
            t_term, term,
            "seed {seed}: an answer of term {t_term} made durable in term {term}"
        );
        // (A batch carries every ticket up to the one it completes.)
        let s = ticket_seq
            .range(ticket..)
            .next()
            .map_or(u64::MAX, |(_, &s)| s);
        assert!(
            s <= min,
            "seed {seed}: ticket {ticket} (entry {s}) durable while a member has only {min}"
        );
        answer(id, Outcome::Durable, pending, answered);
    }
    if let Some(g) = w.grants {
        assert!(
            g >= *durable_grant,
            "seed {seed}: the grants watermark went back"
        );
        *durable_grant = g;
    }
}

#[test]
fn a_feed_takes_an_image_then_entries_in_order_from_its_newest_connection_only() {
    let entry = |seq: u64| ToStandby::Entry {
        seq,
        changes: vec![change(seq)],
    };
    let image = |seq: u64, last: bool| ToStandby::Image {
        seq,
        changes: vec![change(0)],
        last,
    };
    let mut f = Feed::new(0);
    let c1 = f.hello(5).expect("hello");
    assert!(
        f.on_frame(c1, entry(1), Vec::new(), 0).is_err(),
        "an entry before the image"
    );
    let mut f = Feed::new(0);
    let c1 = f.hello(5).expect("hello");
    assert_eq!(
        f.on_frame(c1, image(7, false), Vec::new(), 0),
        Ok(None),
        "part of an image: nothing to acknowledge"
    );
    assert!(!f.leads_from());
    assert_eq!(f.on_frame(c1, image(7, true), Vec::new(), 0), Ok(Some(7)));
    assert!(f.leads_from() && f.fed());
    assert!(
        f.on_frame(c1, image(8, true), Vec::new(), 0).is_err(),
        "an image after the image"
    );
    assert_eq!(f.on_frame(c1, entry(8), Vec::new(), 10 * MS), Ok(Some(8)));
    assert!(
        f.on_frame(c1, entry(8), Vec::new(), 0).is_err(),
        "a replayed entry"
    );
    assert_eq!(
        f.on_frame(c1, entry(10), Vec::new(), 11 * MS),
        Ok(Some(10)),
        "entries need not be consecutive (a leader's pieces)"
    );
    assert!(f
        .on_frame(
            c1,
            ToStandby::Hello {
                cluster_id: "c".into(),
                term: 5,
                lease: 1,
                leader: "l".into()
            },
            Vec::new(),
            0
        )
        .is_err());
    assert_eq!(
        f.pending
            .iter()
            .map(|(t, c)| (*t, c.len()))
            .collect::<Vec<_>>(),
        vec![(0, 1), (0, 1), (10 * MS, 1), (11 * MS, 1)]
    );
    // An older term is refused; a newer one replaces the connection and starts empty.
    assert!(f.hello(4).is_err());
    let c2 = f.hello(6).expect("a newer term");
    assert!(
        f.on_frame(c1, entry(11), Vec::new(), 0).is_err(),
        "the replaced connection"
    );
    assert!(!f.leads_from() && f.pending.is_empty() && f.seq == 0);
    assert!(f.take(6).is_none(), "no image yet: nothing to lead from");
    f.on_frame(c2, image(20, true), Vec::new(), 0)
        .expect("image");
    assert!(f.take(5).is_none(), "another term's mirror");
    assert_eq!(f.take(6).map(|(seq, _)| seq), Some(20));
    assert!(
        f.on_frame(c2, entry(21), Vec::new(), 0).is_err(),
        "taken over: nothing more is applied"
    );
    assert!(
        f.hello(7).is_err(),
        "nor does a new leader feed it while it leads"
    );
    f.restore(6, 21, MirrorTail::default());
    assert!(
        f.leads_from() && !f.fed() && f.seq == 21,
        "a failed takeover hands it back"
    );
    f.close();
    assert!(f.reopen() && !f.reopen());
    f.seal();
    assert!(f.hello(9).is_err(), "a sealed mirror is fed no more");
}

#[test]
fn members_leave_the_set_when_late_or_cut_and_join_only_whole_and_registered() {
    use members::{failing, grants_allowed, ready, LinkView};
    let v = |acked: u64| LinkView {
        dead: false,
        acked,
        image_seq: 0,
        grants: true,
    };
    let set: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
    let links = |m: &str| match m {
        "a" => Some(v(10)),
        "b" => Some(v(7)),
        "c" => Some(LinkView {
            dead: true,
            ..v(10)
        }),
        _ => None,
    };
    assert_eq!(
        failing(&set, links, None),
        vec!["c"],
        "a dead link leaves; nothing late"
    );
    assert_eq!(
        failing(&set, links, Some(8)),
        vec!["b", "c"],
        "b has not acknowledged the late entry"
    );
    assert_eq!(
        failing(&["d".to_string()], links, None),
        vec!["d"],
        "a member without a link leaves"
    );
    assert!(ready(v(10), 10, 3, Some(3)));
    assert!(!ready(v(9), 10, 3, Some(3)), "behind the last entry");
    assert!(
        !ready(
            LinkView {
                image_seq: 12,
                ..v(10)
            },
            10,
            3,
            Some(3)
        ),
        "behind its own image"
    );
    assert!(
        !ready(v(10), 10, 3, Some(2)),
        "its registration names another term's mirror"
    );
    assert!(!ready(
        LinkView {
            dead: true,
            ..v(10)
        },
        10,
        3,
        Some(3)
    ));
    assert!(
        !grants_allowed(&[], [v(1)], |_| Some(v(1))),
        "no grants without an in-sync member"
    );
    assert!(grants_allowed(&set[..1], [v(1)], |_| Some(v(1))));
    assert!(
        !grants_allowed(
            &set[..1],
            [
                v(1),
                LinkView {
                    grants: false,
                    ..v(1)
                }
            ],
            |_| Some(v(1))
        ),
        "a linked standby that does not read grants"
    );
    assert!(
        !grants_allowed(&set[..1], [v(1)], |_| None),
        "a member without a link"
    );
}
