//! The campaign for the leader's key, as a machine: what a master asks etcd and in which
//! order, and what it decides from the answers, from standing by to leading and back.
//!
//! A round, every [`Config::poll`] while standing by: (a standby keeps its registration,
//! [`Out::Register`]) read the leader's key; while it is there, follow its leader (the
//! fence names it). Once it is gone, read the in-sync record (and the standbys'
//! registrations when it names members) and ask [`insync::eligibility`] whether this master
//! may lead and from what ([`Plan`]); grant a lease and create the key under it in one
//! transaction that holds only while the record (and, to start empty, every other member's
//! registration) is as read. Won: the driver loads the state ([`Out::TakeOver`], answered
//! with [`Campaign::on_taken`]); unless etcd's journal names the leader last seen (etcd kept
//! its history), one fence bound passes; the lease is renewed and the key read back as this
//! creation, and only then the fence lets this master lead ([`Out::Lead`]). Leading, the
//! [`Renewals`] say when to renew and when to step down; stepping down gives the lease back
//! (and the key with it; then the key, only if it is still this creation, should that fail), and after a takeover that failed the
//! next campaign waits longer each time, up to the lease TTL.
//!
//! A master that stops (`View::stopping`) never campaigns again, unless its mirror is the only
//! copy of what the next leader needs ([`insync::needed_at_stop`]): it then seals it
//! ([`Out::Seal`]) and leads from it once the key is gone, only to hand its state to etcd.
//!
//! One etcd request is out at a time ([`Out::Etcd`]); its answer comes back through
//! [`Campaign::on_etcd`], an error for one that failed or timed out. Times are milliseconds
//! on the driver's clock.

use super::fence::{Fence, Next, Renewal, Renewals};
use super::insync::{self, Eligibility, InSync};
use kvferry::metadata::etcd::{Cond, Created, KeyValue, Owner};
use std::collections::{HashMap, VecDeque};

/// What the campaign needs of etcd: the real client, or the simulator's model.
pub trait Etcd {
    fn get(&self, key: &str) -> Result<Option<KeyValue>, String>;
    /// Every key that starts with `prefix`.
    fn range(&self, prefix: &str) -> Result<Vec<(String, KeyValue)>, String>;
    /// A new lease's id.
    fn lease_grant(&self, ttl_secs: i64) -> Result<i64, String>;
    /// Creates `key` under `lease` if it is absent and every condition holds.
    fn create_when(
        &self,
        key: &str,
        value: &[u8],
        lease: i64,
        conds: &[Cond],
    ) -> Result<Created, String>;
    /// Renews `lease`: whether etcd still knew it.
    fn lease_keepalive(&self, lease: i64) -> Result<bool, String>;
    /// Whether etcd still knows `lease`, without renewing it.
    fn lease_alive(&self, lease: i64) -> Result<bool, String>;
    /// Deletes `key` if it is still the creation `owner`.
    fn delete_if_owned(&self, key: &str, owner: Owner) -> Result<(), String>;
    fn lease_revoke(&self, lease: i64) -> Result<(), String>;
}

/// A campaign's settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// This master's id: its RPC address, the leader key's value.
    pub me: String,
    /// The leader's key.
    pub key: String,
    /// The in-sync record's key.
    pub insync_key: String,
    /// The standbys' registrations: this, then the member's id.
    pub standby_prefix: String,
    /// The lease TTL.
    pub ttl: u64,
    /// How often a standby looks at the key.
    pub poll: u64,
    /// The fence bound: how long after a renewal was sent the leader may answer.
    pub bound: u64,
    /// How often the leader renews its lease.
    pub every: u64,
}

/// What the driver says of this master at each step.
#[derive(Debug, Clone, Copy, Default)]
pub struct View {
    /// It is stopping (SIGTERM).
    pub stopping: bool,
    /// The term of its complete mirror, if it is a standby that has one.
    pub mirror: Option<i64>,
}

/// A request to etcd; [`Campaign::execute`] carries it out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Read the leader's key.
    Get,
    /// Read the in-sync record.
    GetInSync,
    /// Read the standbys' registrations.
    Registrations,
    /// Grant a lease of the TTL.
    Grant,
    /// Create the leader's key under `lease` if it is absent and `conds` hold.
    Create {
        lease: i64,
        conds: Vec<Cond>,
    },
    Keepalive(i64),
    /// Whether etcd still knows a lease (the last leader's), without renewing it.
    LeaseAlive(i64),
    /// Delete the leader's key if it is still this creation.
    Delete(Owner),
    Revoke(i64),
}

/// etcd's answer to an [`Op`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// To [`Op::Get`] and [`Op::GetInSync`].
    Key(Option<KeyValue>),
    /// To [`Op::Registrations`]: member -> (the mirror term its registration names, the
    /// registration's mod revision).
    Registrations(HashMap<String, (Option<i64>, i64)>),
    Lease(i64),
    Created(Created),
    /// To [`Op::Keepalive`] and [`Op::LeaseAlive`]: etcd still knew the lease.
    Alive(bool),
    Done,
}

/// Where a new leader's state comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// The etcd journal (the in-sync set is empty).
    Journal,
    /// This member's complete mirror of the in-sync record's term.
    Mirror(i64),
    /// Nothing: every member of the set is gone (what only they held is lost).
    Empty,
}

/// What the driver is to do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Out {
    /// Ask etcd, and give the answer to [`Campaign::on_etcd`].
    Etcd(Op),
    /// Nothing before this time (`u64::MAX`: until an answer comes).
    Wait(u64),
    /// Keep this standby's registration in etcd (naming its mirror's term).
    Register,
    /// The leader etcd names now, if any (a standby's mirror follows it).
    Leader(Option<Owner>),
    /// Stopping, this member's mirror is the only copy of what the next leader needs: seal it.
    Seal,
    /// The key is won: load the state `plan` names, install it for `owner`'s term and mark
    /// the journal, then tell [`Campaign::on_taken`].
    TakeOver {
        owner: Owner,
        plan: Plan,
    },
    /// The fence names this master the leader: serve.
    Lead {
        owner: Owner,
    },
    /// Stop serving `owner`'s term and forget the state (`failed`: the takeover did not end
    /// in leading). The key and the lease are given back next.
    StepDown {
        owner: Owner,
        failed: bool,
    },
    /// The key and the lease of `term` were given back (as far as etcd answered).
    SteppedDown {
        term: i64,
    },
    /// The campaign is over (the master stops): remove this standby's registration.
    Exit,
    Info(String),
    Warn(String),
}

/// What an answer to the request out goes on with.
#[derive(Debug)]
enum Step {
    StopRecord,
    StopRegs(InSync),
    Key,
    Record,
    Regs(InSync, Vec<Cond>),
    Grant(Plan, Vec<Cond>, u64),
    Create(Plan, i64, u64),
    /// The lease of a lost or failed creation is revoked; then the next round at this time.
    Revoked(u64),
    GiveBack(Owner),
    Exit,
    /// Whether the last leader's lease is gone; then serving may start at once.
    Seen(Owner, u64),
    Prove(Owner, u64),
    ProveKey(Owner, u64),
    Renew(Owner, u64, Renewals),
    RenewKey(Owner, u64, Renewals),
    Resign(Owner, u64),
    Resigned(i64, u64),
}

#[derive(Debug)]
enum Phase {
    /// Standing by; the next round at this time.
    Idle(u64),
    /// A request is out.
    Asked(Step),
    /// The driver loads the state; the key was created by a request sent at `won_at`.
    Taking {
        owner: Owner,
        won_at: u64,
    },
    /// Won and loaded; serves once `until` passed and a renewal proved the lease.
    Fencing {
        owner: Owner,
        until: u64,
    },
    Leading {
        owner: Owner,
        renewals: Renewals,
    },
    Done,
}

/// The campaign of one master ([module docs](crate::elect)).
#[derive(Debug)]
pub struct Campaign {
    cfg: Config,
    phase: Phase,
    out: VecDeque<Out>,
    /// The leader last seen while standing by (see "An etcd that lost its data", `crate::ha`).
    seen: Option<Owner>,
    /// Stopping, this member leads once more only to hand its mirror to etcd.
    bequeath: bool,
    failed_takeovers: u32,
    last_err: String,
    logged_leader: String,
    waiting_logged: bool,
}

impl Campaign {
    /// A master standing by, its first round at `now`.
    pub fn new(cfg: Config, now: u64) -> Campaign {
        Campaign {
            cfg,
            phase: Phase::Idle(now),
            out: VecDeque::new(),
            seen: None,
            bequeath: false,
            failed_takeovers: 0,
            last_err: String::new(),
            logged_leader: String::new(),
            waiting_logged: false,
        }
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// It leads (from [`Out::Lead`] until it steps down).
    pub fn leading(&self) -> Option<Owner> {
        match self.phase {
            Phase::Leading { owner, .. } => Some(owner),
            _ => None,
        }
    }

    /// What to do next at `now`. `fence` is the one requests are admitted by.
    pub fn poll(&mut self, now: u64, view: &View, fence: &mut Fence) -> Out {
        if let Some(o) = self.out.pop_front() {
            return o;
        }
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Done => return Out::Exit,
            p @ (Phase::Asked(_) | Phase::Taking { .. }) => {
                self.phase = p;
                return Out::Wait(u64::MAX);
            }
            Phase::Idle(at) if now < at => {
                self.phase = Phase::Idle(at);
                return Out::Wait(at);
            }
            Phase::Idle(_) => self.round(view),
            Phase::Fencing { owner, until } if now < until => {
                self.phase = Phase::Fencing { owner, until };
                return Out::Wait(until);
            }
            Phase::Fencing { owner, .. } => {
                self.ask(Op::Keepalive(owner.lease), Step::Prove(owner, now))
            }
            Phase::Leading {
                owner,
                mut renewals,
            } => match renewals.poll(fence, now) {
                Next::Wait(until) => {
                    self.phase = Phase::Leading { owner, renewals };
                    return Out::Wait(until);
                }
                Next::Renew => self.ask(
                    Op::Keepalive(owner.lease),
                    Step::Renew(owner, now, renewals),
                ),
                Next::StepDown => self.step_down(now, fence, owner, false),
            },
        }
        self.out.pop_front().unwrap_or(Out::Wait(now))
    }

    /// etcd's answer to the request out (an error: it failed or timed out).
    pub fn on_etcd(
        &mut self,
        now: u64,
        answer: Result<Answer, String>,
        view: &View,
        fence: &mut Fence,
    ) {
        let step = match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Asked(step) => step,
            other => {
                // (No request is out: nothing to go on with.)
                self.phase = other;
                return;
            }
        };
        let poll = now + self.cfg.poll;
        match step {
            Step::StopRecord => match answer.and_then(key).and_then(record) {
                Ok((rec, _)) if rec.members.contains(&self.cfg.me) => {
                    self.ask(Op::Registrations, Step::StopRegs(rec))
                }
                Ok(_) => self.exit(fence),
                Err(e) => self.stop_unknown(e, poll),
            },
            Step::StopRegs(rec) => match answer.and_then(registrations) {
                Ok(regs) => {
                    let alive = |m: &str| alive(&regs, m, rec.term);
                    if insync::needed_at_stop(&rec, &self.cfg.me, view.mirror, alive) {
                        if !self.bequeath {
                            self.out.push_back(Out::Seal);
                            self.out.push_back(Out::Info("stopping; this in-sync standby's mirror is the only copy of what the next leader needs: it leads once the leader's key is gone, only to hand its state to etcd (unless a leader alive drops it from the in-sync set first)".into()));
                        }
                        self.bequeath = true;
                        self.look();
                    } else {
                        self.exit(fence)
                    }
                }
                Err(e) => self.stop_unknown(e, poll),
            },
            Step::Key => match answer.and_then(key) {
                Ok(Some(kv)) => {
                    let owner = Owner::of(&kv);
                    self.seen = Some(owner);
                    let leader = String::from_utf8_lossy(&kv.value).into_owned();
                    fence.set_standby(Some((&leader, kv.create_revision)));
                    self.out.push_back(Out::Leader(Some(owner)));
                    if leader != self.logged_leader {
                        self.out.push_back(Out::Info(format!(
                            "standby; the leader is {leader} (term {})",
                            kv.create_revision
                        )));
                        self.logged_leader = leader;
                    }
                    self.phase = Phase::Idle(poll);
                }
                Ok(None) => {
                    self.out.push_back(Out::Leader(None));
                    self.ask(Op::GetInSync, Step::Record);
                }
                Err(e) => {
                    fence.set_standby(None);
                    self.report(e);
                    self.phase = Phase::Idle(poll);
                }
            },
            Step::Record => match answer.and_then(key).and_then(record) {
                Ok((rec, rev)) => {
                    let conds = vec![Cond::ModRevision(self.cfg.insync_key.clone(), rev)];
                    if rec.members.is_empty() {
                        self.campaign(now, Plan::Journal, conds);
                    } else {
                        self.ask(Op::Registrations, Step::Regs(rec, conds));
                    }
                }
                Err(e) => self.retry(e, poll),
            },
            Step::Regs(rec, mut conds) => match answer.and_then(registrations) {
                Ok(regs) => {
                    let alive = |m: &str| alive(&regs, m, rec.term);
                    match insync::eligibility(&rec, &self.cfg.me, view.mirror, alive) {
                        Eligibility::Journal => self.campaign(now, Plan::Journal, conds),
                        Eligibility::Mirror => self.campaign(now, Plan::Mirror(rec.term), conds),
                        Eligibility::Empty => {
                            // Every other member's registration as it was read (absent, or
                            // without a mirror of the record's term): one that registers or
                            // gains that mirror meanwhile fails the campaign.
                            conds.extend(rec.members.iter().filter(|m| **m != self.cfg.me).map(
                                |m| {
                                    Cond::ModRevision(
                                        format!("{}{m}", self.cfg.standby_prefix),
                                        regs.get(m).map_or(0, |r| r.1),
                                    )
                                },
                            ));
                            self.campaign(now, Plan::Empty, conds)
                        }
                        Eligibility::Wait => {
                            if !self.waiting_logged {
                                self.out.push_back(Out::Info("no leader, and an in-sync standby other than this master is alive: only it may lead; waiting".into()));
                                self.waiting_logged = true;
                            }
                            self.phase = Phase::Idle(poll);
                        }
                    }
                }
                Err(e) => self.retry(e, poll),
            },
            Step::Grant(plan, conds, sent) => match answer.and_then(lease) {
                Ok(lease) => self.ask(Op::Create { lease, conds }, Step::Create(plan, lease, sent)),
                Err(e) => self.retry(e, poll),
            },
            Step::Create(plan, lease, sent) => match answer.and_then(created) {
                Ok(Created::Won(term)) => {
                    let owner = Owner {
                        create_revision: term,
                        lease,
                    };
                    // A stop that came while this master campaigned gives the key back
                    // untouched, unless it won to lead from its mirror: that may be the only
                    // copy, so it takes over and hands off as any stopping member that holds
                    // it does.
                    if view.stopping && !matches!(plan, Plan::Mirror(_)) {
                        self.ask(Op::Revoke(lease), Step::GiveBack(owner));
                    } else {
                        self.phase = Phase::Taking {
                            owner,
                            won_at: sent,
                        };
                        self.out.push_back(Out::TakeOver { owner, plan });
                    }
                }
                Ok(Created::Lost(kv)) => {
                    // (The next round at once: the key is someone's now.)
                    if let Some(kv) = &kv {
                        let leader = String::from_utf8_lossy(&kv.value);
                        fence.set_standby(Some((&leader, kv.create_revision)));
                    } else {
                        fence.set_standby(None);
                    }
                    self.ask(Op::Revoke(lease), Step::Revoked(now));
                }
                Err(e) => {
                    self.report(e);
                    self.ask(Op::Revoke(lease), Step::Revoked(poll));
                }
            },
            Step::Revoked(at) => self.phase = Phase::Idle(at),
            Step::GiveBack(owner) => self.ask(Op::Delete(owner), Step::Exit),
            Step::Exit => self.exit(fence),
            Step::Seen(owner, won_at) => match answer.and_then(alive_lease) {
                Ok(false) => self.phase = Phase::Fencing { owner, until: now },
                Ok(true) => self.fence_wait(
                    now,
                    owner,
                    won_at,
                    "the previous leader's lease is still alive (its key was deleted, not expired)"
                        .into(),
                ),
                Err(e) => self.fence_wait(
                    now,
                    owner,
                    won_at,
                    format!("whether the previous leader's lease is gone: {e}"),
                ),
            },
            Step::Prove(owner, sent) => match answer.and_then(alive_lease) {
                Ok(true) => self.ask(Op::Get, Step::ProveKey(owner, sent)),
                Ok(false) => self.failed(
                    now,
                    fence,
                    owner,
                    "the lease expired while loading the journal".into(),
                ),
                Err(e) => self.failed(
                    now,
                    fence,
                    owner,
                    format!("renewing the lease after loading the journal: {e}"),
                ),
            },
            Step::ProveKey(owner, sent) => match answer.and_then(key) {
                Ok(Some(kv)) if owner.holds(&kv) => {
                    let term = owner.create_revision;
                    fence.set_leader(term, &self.cfg.me, owner.lease, sent, self.cfg.bound);
                    self.failed_takeovers = 0;
                    self.logged_leader = self.cfg.me.clone();
                    self.phase = Phase::Leading {
                        owner,
                        renewals: Renewals::new(term, self.cfg.every, self.cfg.bound, now),
                    };
                    self.out.push_back(Out::Lead { owner });
                }
                Ok(other) => self.failed(
                    now,
                    fence,
                    owner,
                    format!(
                        "the key {} is no longer this master's ({other:?})",
                        self.cfg.key
                    ),
                ),
                Err(e) => self.failed(
                    now,
                    fence,
                    owner,
                    format!("reading the key back after loading the journal: {e}"),
                ),
            },
            Step::Renew(owner, sent, renewals) => match answer.and_then(alive_lease) {
                Ok(true) => self.ask(Op::Get, Step::RenewKey(owner, sent, renewals)),
                Ok(false) => {
                    self.out.push_back(Out::Warn(format!(
                        "term {}: etcd no longer knows this master's lease (expired); stepping down",
                        owner.create_revision
                    )));
                    self.renewed(now, fence, owner, sent, renewals, Renewal::LeaseLost);
                }
                Err(e) => {
                    self.out.push_back(Out::Warn(format!(
                        "term {}: renewing the lease: {e}",
                        owner.create_revision
                    )));
                    self.renewed(now, fence, owner, sent, renewals, Renewal::Failed);
                }
            },
            Step::RenewKey(owner, sent, renewals) => {
                let outcome = match answer.and_then(key) {
                    Ok(Some(kv)) if owner.holds(&kv) => Renewal::Ours,
                    Ok(other) => {
                        self.out.push_back(Out::Warn(format!(
                            "term {}: the key {} is no longer this master's ({other:?}); stepping down",
                            owner.create_revision, self.cfg.key
                        )));
                        Renewal::KeyLost
                    }
                    Err(e) => {
                        self.out.push_back(Out::Warn(format!(
                            "term {}: reading the key back: {e}",
                            owner.create_revision
                        )));
                        Renewal::Failed
                    }
                };
                self.renewed(now, fence, owner, sent, renewals, outcome);
            }
            // The lease is revoked first: the key goes with it, in the same instant (a master
            // that then finds the key gone finds the lease gone too, and serves at once). The
            // key is then deleted in case the revocation failed, only if it is still this
            // creation: after etcd lost its data another master's key may carry the same
            // revision, but never this lease.
            Step::Resign(owner, at) => {
                self.ask(Op::Delete(owner), Step::Resigned(owner.create_revision, at))
            }
            Step::Resigned(term, at) => {
                self.out.push_back(Out::SteppedDown { term });
                self.phase = Phase::Idle(at);
            }
        }
    }

    /// The driver loaded the state after [`Out::TakeOver`]: the leader etcd's journal names
    /// as the last one (revision and lease), or why it could not.
    pub fn on_taken(&mut self, now: u64, taken: Result<Option<Owner>, String>, fence: &mut Fence) {
        let Phase::Taking { owner, won_at } = self.phase else {
            return;
        };
        match taken {
            // etcd kept its history only if the journal names the leader this master saw;
            // and that leader no longer answers only if its lease is gone (expired: it fenced
            // itself a third of a TTL before; revoked: it stepped down). Otherwise (a wiped
            // etcd, a first start, its key deleted by hand while it renews) it may still
            // answer until its fence bound ends, one bound after its last renewal.
            Ok(Some(last)) if Some(last) == self.seen => {
                self.ask(Op::LeaseAlive(last.lease), Step::Seen(owner, won_at))
            }
            Ok(last) => self.fence_wait(
                now,
                owner,
                won_at,
                format!("etcd's history does not show the previous leader (journal: {last:?}, seen: {:?})", self.seen),
            ),
            Err(e) => self.failed(now, fence, owner, e),
        }
    }

    /// Serves only once one fence bound from winning passed: a leader before may answer until
    /// then.
    fn fence_wait(&mut self, now: u64, owner: Owner, won_at: u64, why: String) {
        let until = won_at + self.cfg.bound;
        self.out.push_back(Out::Info(format!(
            "term {}: {why}; waiting {} ms (one fence bound from winning) before serving",
            owner.create_revision,
            until.saturating_sub(now)
        )));
        self.phase = Phase::Fencing { owner, until };
    }

    /// Carries `op` out against `etcd`.
    pub fn execute(&self, etcd: &impl Etcd, op: &Op) -> Result<Answer, String> {
        let c = &self.cfg;
        match op {
            Op::Get => etcd.get(&c.key).map(Answer::Key),
            Op::GetInSync => etcd.get(&c.insync_key).map(Answer::Key),
            Op::Registrations => Ok(Answer::Registrations(
                etcd.range(&c.standby_prefix)?
                    .into_iter()
                    .filter_map(|(k, kv)| {
                        let v = String::from_utf8_lossy(&kv.value);
                        Some((
                            k.strip_prefix(&c.standby_prefix)?.to_string(),
                            (insync::parse_registration(&v).mirror, kv.mod_revision),
                        ))
                    })
                    .collect(),
            )),
            Op::Grant => etcd
                .lease_grant(c.ttl.div_ceil(1000) as i64)
                .map(Answer::Lease),
            Op::Create { lease, conds } => etcd
                .create_when(&c.key, c.me.as_bytes(), *lease, conds)
                .map(Answer::Created),
            Op::Keepalive(lease) => etcd.lease_keepalive(*lease).map(Answer::Alive),
            Op::LeaseAlive(lease) => etcd.lease_alive(*lease).map(Answer::Alive),
            Op::Delete(owner) => etcd.delete_if_owned(&c.key, *owner).map(|_| Answer::Done),
            Op::Revoke(lease) => etcd.lease_revoke(*lease).map(|_| Answer::Done),
        }
    }

    fn ask(&mut self, op: Op, step: Step) {
        self.phase = Phase::Asked(step);
        self.out.push_back(Out::Etcd(op));
    }

    /// A round: stopping, first whether this member must lead once more; then look.
    fn round(&mut self, view: &View) {
        if !view.stopping {
            return self.look();
        }
        match view.mirror {
            Some(_) => self.ask(Op::GetInSync, Step::StopRecord),
            None => self.exit_now(),
        }
    }

    /// (A master that keeps no mirror has no registration: its driver ignores
    /// [`Out::Register`].)
    fn look(&mut self) {
        self.out.push_back(Out::Register);
        self.ask(Op::Get, Step::Key);
    }

    fn campaign(&mut self, now: u64, plan: Plan, conds: Vec<Cond>) {
        // A stopping member leads only from its mirror.
        if self.bequeath && !matches!(plan, Plan::Mirror(_)) {
            self.phase = Phase::Idle(now + self.cfg.poll);
            return;
        }
        self.waiting_logged = false;
        self.ask(Op::Grant, Step::Grant(plan, conds, now));
    }

    fn retry(&mut self, e: String, at: u64) {
        self.report(e);
        self.phase = Phase::Idle(at);
    }

    fn stop_unknown(&mut self, e: String, at: u64) {
        // (Only with a complete mirror.) etcd cannot say: keep trying (the stop's bound ends
        // it).
        self.report(format!(
            "stopping: whether this standby's mirror is still needed: {e}"
        ));
        self.phase = Phase::Idle(at);
    }

    fn report(&mut self, e: String) {
        if e != self.last_err {
            self.out.push_back(Out::Warn(e.clone()));
            self.last_err = e;
        }
    }

    fn exit(&mut self, fence: &mut Fence) {
        fence.set_standby(None);
        self.exit_now();
    }

    fn exit_now(&mut self) {
        self.phase = Phase::Done;
        self.out.push_back(Out::Exit);
    }

    fn failed(&mut self, now: u64, fence: &mut Fence, owner: Owner, e: String) {
        self.failed_takeovers = self.failed_takeovers.saturating_add(1);
        self.out.push_back(Out::Warn(format!(
            "term {}: won the key but cannot take over: {e}; stepping down",
            owner.create_revision
        )));
        self.step_down(now, fence, owner, true);
    }

    fn renewed(
        &mut self,
        now: u64,
        fence: &mut Fence,
        owner: Owner,
        sent: u64,
        mut renewals: Renewals,
        outcome: Renewal,
    ) {
        if renewals.on_renewal(fence, sent, outcome) {
            self.step_down(now, fence, owner, false);
        } else {
            self.phase = Phase::Leading { owner, renewals };
        }
    }

    /// Stepping down: refuse, forget, give the key and the lease back so the others take
    /// over at once. After a takeover that failed, the next campaign waits, longer each time
    /// up to the lease TTL (a journal that cannot be read fails every takeover: without a
    /// pause each master would loop through grant, create, load and delete, adding etcd
    /// revisions as fast as etcd answers).
    fn step_down(&mut self, now: u64, fence: &mut Fence, owner: Owner, failed: bool) {
        fence.set_standby(None);
        self.out.push_back(Out::StepDown { owner, failed });
        let wait = match self.failed_takeovers {
            0 => 0,
            n => (self.cfg.poll << n.min(6)).min(self.cfg.ttl),
        };
        self.ask(Op::Revoke(owner.lease), Step::Resign(owner, now + wait));
    }
}

/// Whether member `m` is registered with a complete mirror of `term`.
fn alive(regs: &HashMap<String, (Option<i64>, i64)>, m: &str, term: i64) -> bool {
    regs.get(m).is_some_and(|(t, _)| *t == Some(term))
}

fn key(a: Answer) -> Result<Option<KeyValue>, String> {
    match a {
        Answer::Key(kv) => Ok(kv),
        other => Err(unexpected(&other)),
    }
}

/// The in-sync record and its mod revision (0: absent).
fn record(kv: Option<KeyValue>) -> Result<(InSync, i64), String> {
    let rec = InSync::parse(kv.as_ref().map_or(&[][..], |kv| &kv.value))?;
    Ok((rec, kv.map_or(0, |kv| kv.mod_revision)))
}

fn registrations(a: Answer) -> Result<HashMap<String, (Option<i64>, i64)>, String> {
    match a {
        Answer::Registrations(r) => Ok(r),
        other => Err(unexpected(&other)),
    }
}

fn lease(a: Answer) -> Result<i64, String> {
    match a {
        Answer::Lease(l) => Ok(l),
        other => Err(unexpected(&other)),
    }
}

fn created(a: Answer) -> Result<Created, String> {
    match a {
        Answer::Created(c) => Ok(c),
        other => Err(unexpected(&other)),
    }
}

fn alive_lease(a: Answer) -> Result<bool, String> {
    match a {
        Answer::Alive(b) => Ok(b),
        other => Err(unexpected(&other)),
    }
}

fn unexpected(a: &Answer) -> String {
    format!("etcd's answer does not fit the request ({a:?})")
}
