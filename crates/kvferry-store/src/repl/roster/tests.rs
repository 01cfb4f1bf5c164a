//! The roster's decisions, one rule at a time, on a fake clock (µs).

use super::*;

const S: u64 = 1_000_000;

fn reg(addr: &str, mirror: Option<i64>) -> Registered {
    Registered {
        addr: addr.to_string(),
        mirror,
        runs: true,
        grants: true,
    }
}

fn regs(list: &[(&str, &str, Option<i64>)]) -> BTreeMap<String, Registered> {
    list.iter()
        .map(|(m, a, t)| (m.to_string(), reg(a, *t)))
        .collect()
}

fn names(p: &Polled) -> Vec<&str> {
    p.open.iter().map(|(m, _)| m.as_str()).collect()
}

#[test]
fn registrations_are_read_once_per_interval_whether_or_not_the_read_succeeds() {
    let mut r = Roster::new("me", 7, 200_000);
    assert!(r.poll(0), "the first time at once");
    assert!(!r.poll(199_999));
    assert!(r.poll(200_000));
    assert!(!r.poll(300_000), "a read that failed counts too");
}

#[test]
fn standbys_registered_are_linked_but_not_the_leader_itself_nor_one_linked_already() {
    let mut r = Roster::new("me", 7, 0);
    let p = r.on_registrations(
        0,
        regs(&[
            ("me", "m:1", None),
            ("a", "a:1", None),
            ("b", "b:1", Some(7)),
        ]),
    );
    assert_eq!(names(&p), ["a", "b"]);
    assert!(p.gone.is_empty());
    r.linked("a", "a:1", true, true, 5);
    let p = r.on_registrations(1, regs(&[("a", "a:1", None), ("b", "b:1", Some(7))]));
    assert_eq!(names(&p), ["b"], "a is linked");
    r.check(5).expect("invariants");
}

#[test]
fn a_broken_link_or_a_standby_gone_or_moved_is_dropped_and_a_failing_one_retried_less_and_less_often(
) {
    let mut r = Roster::new("me", 7, 0);
    r.linked("a", "a:1", true, true, 0);
    r.linked("b", "b:1", true, true, 0);
    r.linked("c", "c:1", true, true, 0);
    r.observe("a", 3, true);
    let p = r.on_registrations(10 * S, regs(&[("a", "a:1", None), ("b", "b:2", None)]));
    assert_eq!(p.gone, ["a", "b", "c"], "a broke, b moved, c is gone");
    assert_eq!(
        names(&p),
        ["b"],
        "b moved: linked at its new address at once; a waits"
    );
    assert!(r.links().is_empty());
    // a failed once at 10 s: tried again after 1 s, then 1, 2, 4 ... 32 s as it keeps failing.
    let again = |r: &mut Roster, t: u64| {
        names(&r.on_registrations(t, regs(&[("a", "a:1", None)]))) == ["a"]
    };
    assert!(!again(&mut r, 10 * S + S));
    assert!(again(&mut r, 10 * S + S + 1));
    assert_eq!(
        r.link_failed("a", "a:1", 12 * S),
        2 * S,
        "second failure in a row"
    );
    assert_eq!(r.link_failed("a", "a:1", 13 * S), 4 * S);
    assert!(!again(&mut r, 13 * S + 4 * S));
    assert!(again(&mut r, 13 * S + 4 * S + 1));
    for t in 14..30 {
        r.link_failed("a", "a:1", t * S);
    }
    assert_eq!(r.link_failed("a", "a:1", 30 * S), 32 * S, "at most 32 s");
    // Registered again at another address (restarted): tried at once, its count restarted.
    let p = r.on_registrations(30 * S, regs(&[("a", "a:9", None)]));
    assert_eq!(names(&p), ["a"]);
    assert_eq!(r.link_failed("a", "a:9", 30 * S), S);
}

#[test]
fn a_standby_joins_only_having_acknowledged_everything_and_named_this_terms_mirror() {
    let mut r = Roster::new("me", 7, 0);
    r.on_registrations(
        0,
        regs(&[
            ("a", "a:1", Some(7)),
            ("b", "b:1", Some(6)),
            ("c", "c:1", Some(7)),
        ]),
    );
    r.linked("a", "a:1", true, true, 10);
    r.linked("b", "b:1", true, true, 10);
    r.linked("c", "c:1", true, true, 10);
    r.observe("a", 11, false);
    r.observe("b", 12, false);
    r.observe("c", 11, false);
    assert_eq!(
        r.joining(12),
        None,
        "a and c are one entry behind; b names term 6"
    );
    r.observe("a", 12, false);
    r.observe("c", 10, false);
    assert_eq!(
        r.link("c").map(|l| l.acked),
        Some(11),
        "acknowledgements only grow"
    );
    let j = r.joining(12).expect("a joins");
    assert_eq!(
        (j.ready.clone(), j.members.clone(), j.first),
        (vec!["a".to_string()], vec!["a".to_string()], true)
    );
    assert!(!r.streaming(), "not before etcd holds the set");
    r.joined(&j);
    assert!(r.streaming());
    r.observe("c", 12, false);
    let j = r.joining(12).expect("c joins");
    assert_eq!(
        (j.members, j.first),
        (vec!["a".to_string(), "c".to_string()], false)
    );
    // An image not acknowledged yet: not ready, even past the entries.
    r.linked("d", "d:1", true, true, 20);
    r.observe("d", 12, false);
    assert!(r
        .joining(12)
        .is_some_and(|j| !j.ready.contains(&"d".to_string())));
    r.check(20).expect("invariants");
}

#[test]
fn members_leave_when_late_or_broken_and_the_last_one_leaving_rebases() {
    let mut r = Roster::new("me", 7, 0);
    r.on_registrations(0, regs(&[("a", "a:1", Some(7)), ("b", "b:1", Some(7))]));
    for m in ["a", "b"] {
        r.linked(m, &format!("{m}:1"), true, true, 0);
        r.observe(m, 5, false);
    }
    let j = r.joining(5).expect("both");
    r.joined(&j);
    assert_eq!(r.failing(None), Vec::<String>::new());
    r.observe("a", 6, false);
    assert_eq!(
        r.failing(Some(6)),
        ["b"],
        "b has not acknowledged the late entry"
    );
    assert_eq!(r.leave(&["c".to_string()]), Leave::Unchanged);
    assert_eq!(
        r.leave(&["b".to_string()]),
        Leave::Rest(vec!["a".to_string()])
    );
    assert_eq!(
        r.insync(),
        ["a", "b"],
        "etcd first: the set is what etcd holds"
    );
    r.set_insync(vec!["a".to_string()]);
    assert_eq!(r.failing(None), Vec::<String>::new());
    assert_eq!(
        r.on_stop(),
        Stop::RebaseThenStep,
        "stopping with a member in sync"
    );
    r.observe("a", 6, true);
    assert_eq!(r.failing(None), ["a"], "its link broke");
    assert_eq!(r.leave(&["a".to_string()]), Leave::Rebase);
    r.emptied();
    assert_eq!(
        r.on_stop(),
        Stop::Step,
        "the etcd journal is whole: step down at once"
    );
    assert!(r.links().is_empty());
    r.check(6).expect("invariants");
}

#[test]
fn grants_only_while_in_sync_and_every_link_reads_them() {
    let mut r = Roster::new("me", 7, 0);
    r.on_registrations(0, regs(&[("a", "a:1", Some(7))]));
    r.linked("a", "a:1", true, true, 0);
    assert!(!r.grants_allowed(), "nobody in sync");
    let j = r.joining(0).expect("a");
    r.joined(&j);
    assert!(r.grants_allowed());
    r.linked("old", "o:1", false, false, 0);
    assert!(
        !r.grants_allowed(),
        "a linked standby that cannot read a grant"
    );
}

#[test]
fn a_rebase_writes_the_tail_only_when_it_reaches_the_last_entry_and_fits() {
    assert_eq!(Roster::rebase_from(Some(9), 9, || true), RebaseFrom::Tail);
    assert_eq!(Roster::rebase_from(Some(8), 9, || true), RebaseFrom::Whole);
    assert_eq!(Roster::rebase_from(None, 9, || true), RebaseFrom::Whole);
    assert_eq!(Roster::rebase_from(Some(9), 9, || false), RebaseFrom::Whole);
}

#[test]
fn the_invariants_catch_a_link_to_itself_twice_past_the_last_entry_or_a_failing_member() {
    let mut r = Roster::new("me", 7, 0);
    r.linked("me", "m:1", true, true, 0);
    assert!(r.check(0).is_err());
    let mut r = Roster::new("me", 7, 0);
    r.linked("a", "a:1", true, true, 0);
    r.observe("a", 3, false);
    assert!(r.check(2).is_err(), "acknowledged past the last entry");
    assert!(r.check(3).is_ok());
    r.set_insync(vec!["a".to_string()]);
    r.link_failed("a", "a:1", 0);
    assert!(r.check(3).is_err(), "in sync and failing");
}
