//! The campaign machine against an in-memory etcd, on a fake clock: what it asks, when it
//! leads, from what, and how it steps down.

use super::fence::Fence;
use super::insync::{registration, InSync};
use super::*;
use kvferry::metadata::etcd::{Cond, Created, KeyValue, Owner};
use std::cell::RefCell;
use std::collections::BTreeMap;

const KEY: &str = "c/master_view";
const INSYNC: &str = "c/insync";
const SB: &str = "c/standby/";

/// etcd in memory: keys with their revisions and leases; leases never expire by themselves.
#[derive(Default)]
struct Mem {
    rev: i64,
    kv: BTreeMap<String, KeyValue>,
    leases: Vec<i64>,
    next_lease: i64,
    /// Every request, in order (for what the tests assert about the sequence).
    log: Vec<String>,
    /// Requests of these kinds fail.
    fail: Vec<&'static str>,
}

struct Fake(RefCell<Mem>);

impl Fake {
    fn new() -> Fake {
        Fake(RefCell::new(Mem::default()))
    }

    fn put(&self, key: &str, value: &[u8], lease: i64) {
        let mut m = self.0.borrow_mut();
        m.rev += 1;
        let rev = m.rev;
        let create = m.kv.get(key).map_or(rev, |kv| kv.create_revision);
        m.kv.insert(
            key.into(),
            KeyValue {
                value: value.to_vec(),
                create_revision: create,
                mod_revision: rev,
                lease,
            },
        );
    }

    fn call(&self, what: &'static str) -> Result<(), String> {
        let mut m = self.0.borrow_mut();
        m.log.push(what.into());
        match m.fail.contains(&what) {
            true => Err(format!("{what}: etcd unreachable")),
            false => Ok(()),
        }
    }

    fn log(&self) -> Vec<String> {
        std::mem::take(&mut self.0.borrow_mut().log)
    }
}

impl Etcd for Fake {
    fn get(&self, key: &str) -> Result<Option<KeyValue>, String> {
        self.call("get")?;
        Ok(self.0.borrow().kv.get(key).cloned())
    }

    fn range(&self, prefix: &str) -> Result<Vec<(String, KeyValue)>, String> {
        self.call("range")?;
        let m = self.0.borrow();
        Ok(m.kv
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect())
    }

    fn lease_grant(&self, _ttl_secs: i64) -> Result<i64, String> {
        self.call("grant")?;
        let mut m = self.0.borrow_mut();
        m.next_lease += 1;
        let l = m.next_lease;
        m.leases.push(l);
        Ok(l)
    }

    fn create_when(
        &self,
        key: &str,
        value: &[u8],
        lease: i64,
        conds: &[Cond],
    ) -> Result<Created, String> {
        self.call("create")?;
        let holds = {
            let m = self.0.borrow();
            if let Some(kv) = m.kv.get(key) {
                return Ok(Created::Lost(Some(kv.clone())));
            }
            conds.iter().all(|c| match c {
                Cond::ModRevision(k, rev) => m.kv.get(k).map_or(0, |kv| kv.mod_revision) == *rev,
                Cond::Absent(k) => !m.kv.contains_key(k),
            })
        };
        if !holds {
            return Ok(Created::Lost(None));
        }
        self.put(key, value, lease);
        Ok(Created::Won(self.0.borrow().rev))
    }

    fn lease_keepalive(&self, lease: i64) -> Result<bool, String> {
        self.call("keepalive")?;
        Ok(self.0.borrow().leases.contains(&lease))
    }

    fn lease_alive(&self, lease: i64) -> Result<bool, String> {
        self.call("lease_alive")?;
        Ok(self.0.borrow().leases.contains(&lease))
    }

    fn delete_if_owned(&self, key: &str, owner: Owner) -> Result<(), String> {
        self.call("delete")?;
        let mut m = self.0.borrow_mut();
        if m.kv.get(key).is_some_and(|kv| owner.holds(kv)) {
            m.kv.remove(key);
            m.rev += 1;
        }
        Ok(())
    }

    fn lease_revoke(&self, lease: i64) -> Result<(), String> {
        self.call("revoke")?;
        let mut m = self.0.borrow_mut();
        m.leases.retain(|l| *l != lease);
        m.kv.retain(|_, kv| kv.lease != lease);
        Ok(())
    }
}

fn config(me: &str) -> Config {
    Config {
        me: me.into(),
        key: KEY.into(),
        insync_key: INSYNC.into(),
        standby_prefix: SB.into(),
        ttl: 3_000,
        poll: 100,
        bound: 2_000,
        every: 750,
    }
}

/// A master with its machine and fence, driven against `etcd` the way the elector does.
struct Node {
    m: Campaign,
    fence: Fence,
    view: View,
}

impl Node {
    fn new(me: &str, now: u64) -> Node {
        Node {
            m: Campaign::new(config(me), now),
            fence: Fence::standby(),
            view: View::default(),
        }
    }

    /// Runs the machine at `now`, answering its requests at once, until it waits or hands
    /// something other than a request, a registration or a log line to its driver (returned,
    /// with `Out::Wait` the time it waits for).
    fn run(&mut self, etcd: &Fake, now: u64) -> Out {
        loop {
            match self.m.poll(now, &self.view, &mut self.fence) {
                Out::Etcd(op) => {
                    let a = self.m.execute(etcd, &op);
                    self.m.on_etcd(now, a, &self.view, &mut self.fence);
                }
                Out::Register | Out::Info(_) | Out::Warn(_) | Out::Leader(_) => {}
                other => return other,
            }
        }
    }

    /// Runs until it leads, taking over with `last` as the journal's last leader.
    fn lead_from_journal(
        &mut self,
        etcd: &Fake,
        mut now: u64,
        last: Option<Owner>,
    ) -> (Owner, u64) {
        for _ in 0..100 {
            match self.run(etcd, now) {
                Out::TakeOver { .. } => self.m.on_taken(now, Ok(last), &mut self.fence),
                Out::Lead { owner } => return (owner, now),
                Out::Wait(t) => now = t.max(now + 1),
                other => panic!("unexpected {other:?}"),
            }
        }
        panic!("never led");
    }
}

#[test]
fn a_master_leads_only_after_its_takeover_and_a_proof_of_its_lease_and_follows_a_leader_otherwise()
{
    let etcd = Fake::new();
    let mut a = Node::new("a:1", 0);
    // The key is absent, the in-sync set empty: campaign from the journal.
    let out = a.run(&etcd, 0);
    let Out::TakeOver { owner, plan } = out else {
        panic!("{out:?}")
    };
    assert_eq!(plan, Plan::Journal);
    assert_eq!(etcd.log(), ["get", "get", "grant", "create"]);
    assert!(!a.fence.admits(0), "no request admitted while taking over");
    // The journal names no leader this master saw: one fence bound from winning, then a
    // renewal and the key read back before the fence admits.
    a.m.on_taken(10, Ok(None), &mut a.fence);
    assert_eq!(a.run(&etcd, 10), Out::Wait(2_000));
    assert!(etcd.log().is_empty());
    assert_eq!(a.run(&etcd, 2_000), Out::Lead { owner });
    assert_eq!(etcd.log(), ["keepalive", "get"]);
    assert!(a.fence.admits(2_001) && a.fence.term() == owner.create_revision);
    assert_eq!(a.m.leading(), Some(owner));

    // Another master follows it: its fence names the leader, it looks again a poll later.
    let mut b = Node::new("b:1", 0);
    assert_eq!(b.run(&etcd, 100), Out::Wait(200));
    assert_eq!(b.fence.leader(), "a:1");
    assert!(!b.fence.admits(100));
    assert_eq!(etcd.log(), ["get"]);
}

#[test]
fn a_journal_naming_the_leader_last_seen_lets_the_new_leader_serve_without_waiting() {
    let etcd = Fake::new();
    let mut a = Node::new("a:1", 0);
    let (old, _) = a.lead_from_journal(&etcd, 0, None);
    let mut b = Node::new("b:1", 0);
    assert!(matches!(b.run(&etcd, 0), Out::Wait(_)));
    // The leader's lease ends: b campaigns, and the journal names the leader it saw.
    etcd.lease_revoke(old.lease).unwrap();
    etcd.log();
    let out = b.run(&etcd, 100);
    assert!(matches!(out, Out::TakeOver { .. }), "{out:?}");
    b.m.on_taken(100, Ok(Some(old)), &mut b.fence);
    assert!(matches!(b.run(&etcd, 100), Out::Lead { .. }));
    assert_eq!(
        etcd.log(),
        [
            "get",
            "get",
            "grant",
            "create",
            "lease_alive",
            "keepalive",
            "get"
        ]
    );
}

#[test]
fn a_leaders_key_deleted_by_hand_while_its_lease_lives_makes_the_next_leader_wait_its_bound() {
    let etcd = Fake::new();
    let mut a = Node::new("a:1", 0);
    let (old, _) = a.lead_from_journal(&etcd, 0, None);
    let mut b = Node::new("b:1", 0);
    assert!(matches!(b.run(&etcd, 0), Out::Wait(_)));
    // `etcdctl del` of the key: a's lease lives on, and a answers until its next renewal
    // finds the key gone, or its bound ends if it is paused.
    etcd.0.borrow_mut().kv.remove(KEY);
    let out = b.run(&etcd, 100);
    assert!(matches!(out, Out::TakeOver { .. }), "{out:?}");
    b.m.on_taken(100, Ok(Some(old)), &mut b.fence);
    assert_eq!(
        b.run(&etcd, 100),
        Out::Wait(2_100),
        "one bound from winning"
    );
    assert!(!b.fence.admits(2_099));
    assert!(matches!(b.run(&etcd, 2_100), Out::Lead { .. }));
}

#[test]
fn the_in_sync_record_decides_who_may_lead_and_from_what() {
    // Another member is registered with a mirror of the record's term: only it may lead.
    let etcd = Fake::new();
    let rec = InSync {
        term: 7,
        members: vec!["a:1".into(), "b:1".into()],
    };
    etcd.put(INSYNC, &rec.to_bytes(), 0);
    etcd.put(
        &format!("{SB}b:1"),
        registration("b:9", Some(7)).as_bytes(),
        0,
    );
    let mut a = Node::new("a:1", 0);
    assert_eq!(a.run(&etcd, 0), Out::Wait(100));
    assert_eq!(etcd.log(), ["get", "get", "range"], "no lease granted");
    // This member holds a complete mirror of term 7: it leads from it.
    a.view.mirror = Some(7);
    let out = a.run(&etcd, 100);
    assert!(
        matches!(
            out,
            Out::TakeOver {
                plan: Plan::Mirror(7),
                ..
            }
        ),
        "{out:?}"
    );
    // The others all gone (b registered without that mirror): start empty, and the
    // transaction holds only while b's registration is as read.
    let etcd = Fake::new();
    etcd.put(INSYNC, &rec.to_bytes(), 0);
    etcd.put(&format!("{SB}b:1"), registration("b:9", None).as_bytes(), 0);
    let mut a = Node::new("a:1", 0);
    let out = a.run(&etcd, 0);
    assert!(
        matches!(
            out,
            Out::TakeOver {
                plan: Plan::Empty,
                ..
            }
        ),
        "{out:?}"
    );
    // ... and a registration that changes between the read and the transaction loses it.
    let etcd = Fake::new();
    etcd.put(INSYNC, &rec.to_bytes(), 0);
    let mut a = Node::new("a:1", 0);
    let mut polls = 0;
    loop {
        match a.m.poll(0, &a.view, &mut a.fence) {
            Out::Etcd(Op::Create { lease, conds }) => {
                assert!(conds.contains(&Cond::ModRevision(format!("{SB}b:1"), 0)));
                etcd.put(
                    &format!("{SB}b:1"),
                    registration("b:9", Some(7)).as_bytes(),
                    0,
                );
                let a2 = a.m.execute(&etcd, &Op::Create { lease, conds });
                assert_eq!(a2, Ok(Answer::Created(Created::Lost(None))));
                a.m.on_etcd(0, a2, &a.view, &mut a.fence);
                break;
            }
            Out::Etcd(op) => {
                let ans = a.m.execute(&etcd, &op);
                a.m.on_etcd(0, ans, &a.view, &mut a.fence);
            }
            _ => {}
        }
        polls += 1;
        assert!(polls < 50);
    }
    // The lease of the lost transaction is revoked; the next round sees b alive and waits.
    assert_eq!(a.run(&etcd, 0), Out::Wait(100));
    assert!(
        etcd.0.borrow().leases.is_empty(),
        "the lost campaign's lease was revoked"
    );
}

#[test]
fn a_stopping_master_exits_unless_its_mirror_is_the_only_copy_then_leads_from_it_alone() {
    // Without a mirror: it exits at once, asking etcd nothing.
    let etcd = Fake::new();
    let mut a = Node::new("a:1", 0);
    a.view.stopping = true;
    assert_eq!(a.run(&etcd, 0), Out::Exit);
    assert!(etcd.log().is_empty());
    // A member whose mirror is the only complete one: it seals it, and leads from it.
    let rec = InSync {
        term: 7,
        members: vec!["a:1".into(), "b:1".into()],
    };
    etcd.put(INSYNC, &rec.to_bytes(), 0);
    let mut a = Node::new("a:1", 0);
    a.view = View {
        stopping: true,
        mirror: Some(7),
    };
    assert_eq!(a.run(&etcd, 0), Out::Seal);
    let out = a.run(&etcd, 0);
    assert!(
        matches!(
            out,
            Out::TakeOver {
                plan: Plan::Mirror(7),
                ..
            }
        ),
        "{out:?}"
    );
    // Another member alive with it: this one may simply go.
    let etcd = Fake::new();
    etcd.put(INSYNC, &rec.to_bytes(), 0);
    etcd.put(
        &format!("{SB}b:1"),
        registration("b:9", Some(7)).as_bytes(),
        0,
    );
    let mut a = Node::new("a:1", 0);
    a.view = View {
        stopping: true,
        mirror: Some(7),
    };
    assert_eq!(a.run(&etcd, 0), Out::Exit);
    // A stop that comes while it campaigns from the journal gives the key back untouched.
    let etcd = Fake::new();
    let mut a = Node::new("a:1", 0);
    loop {
        match a.m.poll(0, &a.view, &mut a.fence) {
            Out::Etcd(op) => {
                let ans = a.m.execute(&etcd, &op);
                if let Ok(Answer::Created(Created::Won(_))) = ans {
                    a.view.stopping = true;
                }
                a.m.on_etcd(0, ans, &a.view, &mut a.fence);
            }
            Out::Exit => break,
            Out::TakeOver { .. } => panic!("took over while stopping"),
            _ => {}
        }
    }
    assert!(etcd.get(KEY).unwrap().is_none(), "the key was given back");
    assert!(etcd.0.borrow().leases.is_empty());
}

#[test]
fn a_failed_takeover_steps_down_gives_the_key_back_and_waits_longer_each_time() {
    let etcd = Fake::new();
    let mut a = Node::new("a:1", 0);
    let mut now = 0;
    let mut waits = Vec::new();
    for _ in 0..3 {
        let Out::TakeOver { owner, .. } = a.run(&etcd, now) else {
            panic!()
        };
        etcd.log();
        a.m.on_taken(now, Err("the journal cannot be read".into()), &mut a.fence);
        assert_eq!(
            a.run(&etcd, now),
            Out::StepDown {
                owner,
                failed: true
            }
        );
        assert_eq!(
            a.run(&etcd, now),
            Out::SteppedDown {
                term: owner.create_revision
            }
        );
        assert_eq!(etcd.log(), ["revoke", "delete"]);
        assert!(etcd.get(KEY).unwrap().is_none());
        let Out::Wait(t) = a.run(&etcd, now) else {
            panic!()
        };
        waits.push(t - now);
        now = t;
    }
    assert_eq!(waits, [200, 400, 800], "backing off, from the poll period");
}

#[test]
fn a_leader_renews_and_steps_down_when_it_cannot_prove_its_lease() {
    let etcd = Fake::new();
    let mut a = Node::new("a:1", 0);
    let (owner, t0) = a.lead_from_journal(&etcd, 0, None);
    etcd.log();
    // Renewals every period while etcd answers.
    let (mut t1, mut next) = (t0, t0);
    while etcd.0.borrow().log.is_empty() {
        t1 = next;
        let Out::Wait(t) = a.run(&etcd, t1) else {
            panic!()
        };
        next = t;
    }
    assert_eq!(t1, t0 + 750, "the first renewal a period after leading");
    assert_eq!(etcd.log(), ["keepalive", "get"]);
    assert!(a.fence.admits(t1 + 1_999));
    // etcd stops answering: the fence ends a bound after the last renewal sent that succeeded,
    // and the machine steps down.
    etcd.0.borrow_mut().fail = vec!["keepalive"];
    let mut now = t1;
    let out = loop {
        now += 50;
        match a.run(&etcd, now) {
            Out::Wait(_) => {}
            other => break other,
        }
        assert!(now < t1 + 10_000);
    };
    assert_eq!(
        out,
        Out::StepDown {
            owner,
            failed: false
        }
    );
    assert!(!a.fence.admits(now));
    assert!(now >= t1 + 2_000, "not before its bound ended ({now})");
    // The key goes only if it is still this creation.
    etcd.0.borrow_mut().fail.clear();
    assert!(matches!(a.run(&etcd, now), Out::SteppedDown { .. }));
    assert!(etcd.get(KEY).unwrap().is_none());
    // And a leader whose key was taken (etcd lost its data) steps down at its next renewal.
    let mut b = Node::new("b:1", now);
    let (owner, t) = b.lead_from_journal(&etcd, now, None);
    etcd.0.borrow_mut().kv.clear();
    etcd.put(KEY, b"c:1", 99);
    let mut t = t;
    let out = loop {
        t += 50;
        match b.run(&etcd, t) {
            Out::Wait(_) => {}
            other => break other,
        }
    };
    assert_eq!(
        out,
        Out::StepDown {
            owner,
            failed: false
        }
    );
    assert_eq!(
        etcd.get(KEY).unwrap().unwrap().value,
        b"c:1",
        "another's key stays"
    );
}

/// An in-sync member whose campaign from its mirror fails (its transaction refused because
/// the in-sync record was rewritten between the read and the transaction; a lease that
/// cannot be granted; an etcd error on the transaction) is handed no takeover (the driver
/// takes the mirror only on [`Out::TakeOver`], `crate::ha::elect`), gives back any lease it
/// was granted, and campaigns again from the same mirror: once a campaign can succeed, it
/// leads from it, never empty nor from the journal. (The store_ha process test
/// `an_in_sync_standby_whose_campaign_fails_keeps_its_mirror_and_leads_from_it` checked the
/// same against a real etcd.)
#[test]
fn a_campaign_from_a_mirror_that_fails_campaigns_from_it_again_and_leads_from_it() {
    let etcd = Fake::new();
    let rec = InSync {
        term: 7,
        members: vec!["a:1".into(), "b:1".into()],
    };
    etcd.put(INSYNC, &rec.to_bytes(), 0);
    let mut a = Node::new("a:1", 0);
    a.view.mirror = Some(7);
    let mut now = 0;
    let mut failed = Vec::new();
    for how in ["record rewritten", "grant", "create"] {
        etcd.0.borrow_mut().fail = match how {
            "record rewritten" => vec![],
            other => vec![other],
        };
        let mut polls = 0;
        'round: loop {
            polls += 1;
            assert!(
                polls < 100,
                "{how}: the campaign never reached its transaction"
            );
            match a.m.poll(now, &a.view, &mut a.fence) {
                Out::Etcd(op) => {
                    let create = matches!(op, Op::Create { .. });
                    if create && how == "record rewritten" {
                        // The record written again as it is: its mod revision moves on.
                        etcd.put(INSYNC, &rec.to_bytes(), 0);
                    }
                    let ans = a.m.execute(&etcd, &op);
                    let end = (create && how != "grant") || (how == "grant" && op == Op::Grant);
                    if create && how == "record rewritten" {
                        assert_eq!(ans, Ok(Answer::Created(Created::Lost(None))));
                    }
                    a.m.on_etcd(now, ans, &a.view, &mut a.fence);
                    if end {
                        break 'round;
                    }
                }
                Out::TakeOver { plan, .. } => {
                    panic!("{how}: a failed campaign took over ({plan:?})")
                }
                Out::Wait(t) => now = t.max(now + 1),
                _ => {}
            }
        }
        // Whatever follows (the lease given back, a wait), no takeover before the next
        // round's etcd requests.
        etcd.0.borrow_mut().fail.clear();
        loop {
            match a.m.poll(now, &a.view, &mut a.fence) {
                Out::Etcd(Op::Revoke(l)) => {
                    let ans = a.m.execute(&etcd, &Op::Revoke(l));
                    a.m.on_etcd(now, ans, &a.view, &mut a.fence);
                }
                Out::Etcd(op) => {
                    // The next round has begun: answered, it goes on in the next iteration.
                    let ans = a.m.execute(&etcd, &op);
                    a.m.on_etcd(now, ans, &a.view, &mut a.fence);
                    break;
                }
                Out::TakeOver { plan, .. } => {
                    panic!("{how}: a failed campaign took over ({plan:?})")
                }
                Out::Wait(t) => now = t.max(now + 1),
                _ => {}
            }
        }
        assert!(
            etcd.0.borrow().leases.is_empty(),
            "{how}: the failed campaign's lease was given back"
        );
        assert!(
            etcd.get(KEY).unwrap().is_none(),
            "{how}: nobody holds the key"
        );
        failed.push(how);
    }
    assert_eq!(failed.len(), 3);
    // The campaign can succeed now: it takes over from the mirror it kept, and leads.
    let out = loop {
        match a.run(&etcd, now) {
            Out::Wait(t) => now = t.max(now + 1),
            other => break other,
        }
    };
    let Out::TakeOver { owner, plan } = out else {
        panic!("{out:?}")
    };
    assert_eq!(plan, Plan::Mirror(7), "from the mirror, never empty");
    a.m.on_taken(now, Ok(None), &mut a.fence);
    let led = loop {
        match a.run(&etcd, now) {
            Out::Wait(t) => now = t.max(now + 1),
            other => break other,
        }
    };
    assert_eq!(led, Out::Lead { owner });
}

/// An in-sync member stopped (SIGTERM) while its mirror is the only copy of what the set
/// acknowledged seals it and stays, campaigning for nothing while the leader's key is there;
/// once the leader alive drops it from the in-sync record (having written etcd what the set
/// held), it exits without ever campaigning. (The leader dead instead, it leads from the
/// mirror to hand it to etcd:
/// `a_stopping_master_exits_unless_its_mirror_is_the_only_copy_then_leads_from_it_alone`.
/// The store_ha process test
/// `an_in_sync_standby_stopped_while_the_leader_is_dead_hands_its_mirror_to_etcd_first`
/// checked both against a real etcd.)
#[test]
fn a_stopping_member_whose_leader_lives_waits_sealed_and_exits_once_the_record_drops_it() {
    let etcd = Fake::new();
    etcd.put(KEY, b"b:1", 0);
    etcd.put(
        INSYNC,
        &InSync {
            term: 7,
            members: vec!["a:1".into()],
        }
        .to_bytes(),
        0,
    );
    let mut a = Node::new("a:1", 0);
    a.view = View {
        stopping: true,
        mirror: Some(7),
    };
    assert_eq!(a.run(&etcd, 0), Out::Seal, "the only copy: sealed");
    let mut now = 0;
    for _ in 0..10 {
        match a.run(&etcd, now) {
            Out::Wait(t) => now = t.max(now + 1),
            other => panic!("the leader alive and the record naming it: {other:?}"),
        }
    }
    assert!(
        !etcd.log().iter().any(|r| r == "grant" || r == "create"),
        "no campaign while the leader's key is there"
    );
    // The leader drops it from the set.
    etcd.put(
        INSYNC,
        &InSync {
            term: 7,
            members: vec![],
        }
        .to_bytes(),
        0,
    );
    let mut rounds = 0;
    loop {
        match a.run(&etcd, now) {
            Out::Wait(t) => now = t.max(now + 1),
            Out::Exit => break,
            other => panic!("{other:?}"),
        }
        rounds += 1;
        assert!(rounds < 5, "it did not exit once the record dropped it");
    }
    assert!(
        !etcd.log().iter().any(|r| r == "grant" || r == "create"),
        "it exits without campaigning"
    );
}
