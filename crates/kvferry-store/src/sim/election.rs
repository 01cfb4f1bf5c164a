//! Deterministic simulation of the election and its fencing: several masters campaign for
//! one key in a model of etcd (revisions, leases with their TTL, create-if-absent guarded
//! transactions, the journal's term marker, the loss of all its data, and the leader's key
//! deleted by hand while its lease lives on), over a network
//! that delays and loses requests and answers, while masters pause (SIGSTOP: nothing of
//! theirs runs, their fence keeps its bound), crash and restart, and are cut off from etcd.
//!
//! The masters run the real [`Campaign`] with its [`Fence`] and [`Renewals`](crate::elect::fence::Renewals):
//! every request it asks is carried out by [`Campaign::execute`] against the model when it
//! arrives there; a takeover's load takes from nothing to three lease TTLs, its key's lease and
//! registration renewed meanwhile by the real
//! [`TakeoverRenewals`](crate::elect::fence::TakeoverRenewals), and ends with one request that
//! reads the journal's term marker and writes this leader's, as `take_over` does
//! (`crate::ha::elect`). What leaders acknowledged is a count ([`takeover`]).
//!
//! Standbys keep registrations naming their mirror's term; a leader makes a standby's mirror
//! whole, names it in the in-sync record once its registration says so, and drops members;
//! a member's mirror dies with it; a takeover empties the record (its state is then whole in
//! the journal).
//!
//! Checked after every step: no two masters may ever admit requests during overlapping
//! times (each master's admitting interval runs from when it became leader to the end of its
//! fence, or its crash), and a master admits only as the leader of the term it won, only while
//! etcd would count its lease alive; a takeover nothing disturbed ends leading, with every
//! acknowledged object ([`takeover`]). Checked
//! at every takeover, against what its transaction saw: from the journal only while the
//! in-sync record names no member; from its mirror only as a member with a mirror of the
//! record's term; empty only when no other member was registered with that mirror.

use crate::elect::fence::{Fence, Role};
use crate::elect::{Campaign, Config, Op, Out, Plan, View};
use crate::ha::STANDBY_POLL;
use kvferry::metadata::etcd::Owner;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::cell::RefCell;

mod model;
mod takeover;

use model::{At, Etcd, Won};

const TTL: u64 = 5_000;
const BOUND: u64 = TTL * 2 / 3;
const EVERY: u64 = TTL / 4;
/// A request not answered within this is failed by its sender (`request_timeout`).
const TIMEOUT: u64 = TTL / 4;
const POLL: u64 = STANDBY_POLL.as_millis() as u64;
const STEPS: usize = 1500;
/// The most outputs a master's machine may give in one turn without waiting or sending.
const POLLS_PER_TURN: u32 = 10_000;
const KEY: &str = "sim/master_view";
const INSYNC: &str = "sim/insync";
const STANDBY: &str = "sim/standby/";

/// A request on its way to etcd.
#[derive(Debug, Clone)]
enum Req {
    Op(Op),
    /// A takeover's load ([`Etcd::mark`]), and what it writes to the journal
    /// ([`takeover::Load`]).
    Mark(Owner, takeover::Load),
    /// A renewal by a takeover's [`crate::elect::fence::TakeoverRenewals`] (no answer awaited).
    Keep(i64),
}

/// An answer on its way back.
#[derive(Debug, Clone)]
enum Reply {
    Op(Result<crate::elect::Answer, String>),
    Mark(Result<Option<Owner>, String>),
}

struct Node {
    m: Campaign,
    fence: Fence,
    alive: bool,
    paused_until: u64,
    /// Cut off from etcd until then (its requests and answers are lost).
    cut_until: u64,
    /// Since when it admits, as leader of which term.
    leading_since: Option<(u64, i64)>,
    /// The request out: its number, when it was sent, whether it is a takeover's load.
    out: Option<(u64, u64, bool)>,
    sent: u64,
    /// Answers on their way to it: (arrives at, request number, reply).
    inbox: Vec<(u64, u64, Reply)>,
    /// The term of its complete mirror (lost when it dies; taken when it leads from it).
    mirror: Option<i64>,
    /// The objects its mirror holds, and its state's (a leader's).
    mirror_objects: u64,
    state: u64,
    taking: Option<takeover::Taking>,
}

impl Node {
    fn new(i: usize, now: u64) -> Node {
        Node {
            m: Campaign::new(
                Config {
                    me: format!("m{i}"),
                    key: KEY.into(),
                    insync_key: "sim/insync".into(),
                    standby_prefix: "sim/standby/".into(),
                    ttl: TTL,
                    poll: POLL,
                    bound: BOUND,
                    every: EVERY,
                },
                now,
            ),
            fence: Fence::standby(),
            alive: true,
            paused_until: 0,
            cut_until: 0,
            leading_since: None,
            out: None,
            sent: 0,
            inbox: Vec::new(),
            mirror: None,
            mirror_objects: 0,
            state: 0,
            taking: None,
        }
    }
}

/// An interval a master admitted requests in: [from, until) as leader of `term`.
#[derive(Debug, Clone, Copy)]
struct Admitted {
    master: usize,
    term: i64,
    from: u64,
    until: u64,
}

struct World {
    rng: StdRng,
    now: u64,
    etcd: Etcd,
    nodes: Vec<Node>,
    /// Requests on their way to etcd: (arrives at, from, request number, request).
    outbox: Vec<(u64, usize, u64, Req)>,
    won: Won,
    history: Vec<Admitted>,
    trace: Vec<String>,
    pub leaderships: u64,
    /// Takeovers from a member's mirror, and starting empty.
    pub from_mirror: u64,
    pub empty: u64,
    /// Objects acknowledged that every later leader must hold (0 again when their loss is
    /// explained: a start from empty, etcd's data lost).
    acked: u64,
    /// Takeovers whose load outlasted the lease TTL and that led; takeovers that failed with
    /// their key's lease run out (renewals stopped: paused, cut off, lost).
    pub long_takeovers: u64,
    pub lapsed_takeovers: u64,
    /// The most a message takes one way: this seed's network (a LAN's etcd answers in a
    /// millisecond, a loaded one in a good part of the request timeout).
    delay: u64,
}

impl World {
    fn new(seed: u64) -> World {
        let mut rng = StdRng::seed_from_u64(seed);
        let n = rng.random_range(2..=4);
        let nodes = (0..n).map(|i| Node::new(i, i as u64 * 37)).collect();
        let delay = [2, 20, 200, TIMEOUT / 2][rng.random_range(0..4)];
        World {
            rng,
            now: 0,
            etcd: Etcd::default(),
            nodes,
            outbox: Vec::new(),
            won: Won::new(),
            history: Vec::new(),
            trace: Vec::new(),
            leaderships: 0,
            from_mirror: 0,
            empty: 0,
            acked: 0,
            long_takeovers: 0,
            lapsed_takeovers: 0,
            delay,
        }
    }

    fn note(&mut self, s: String) {
        if self.trace.len() == 40 {
            self.trace.remove(0);
        }
        self.trace.push(format!("t={} {s}", self.now));
    }

    fn send(&mut self, from: usize, req: Req) {
        let now = self.now;
        let n = &mut self.nodes[from];
        n.sent += 1;
        let id = n.sent;
        n.out = Some((id, now, matches!(req, Req::Mark(..))));
        if n.cut_until > now || self.rng.random_bool(0.02) {
            self.disturb(from);
            return; // lost: it times out
        }
        let at = now + self.rng.random_range(0..self.delay);
        self.outbox.push((at, from, id, req));
    }

    /// The admitting interval of `i` ends at `until` (its fence, or its crash).
    fn close(&mut self, i: usize, until: u64) {
        if let Some((from, term)) = self.nodes[i].leading_since.take() {
            self.history.push(Admitted {
                master: i,
                term,
                from,
                until: until.max(from),
            });
        }
    }

    fn step(&mut self) -> Result<(), String> {
        match self.rng.random_range(0..100) {
            0..=1 => {
                let i = self.rng.random_range(0..self.nodes.len());
                let d = self.rng.random_range(1..3 * TTL);
                self.nodes[i].paused_until = self.now + d;
                self.disturb(i);
                self.note(format!("master {i} paused for {d} ms"));
            }
            2 => {
                let i = self.rng.random_range(0..self.nodes.len());
                if self.nodes[i].alive {
                    let end = self.nodes[i]
                        .fence
                        .bounds()
                        .0
                        .unwrap_or(self.now)
                        .min(self.now);
                    self.close(i, end);
                    self.nodes[i].alive = false;
                    self.nodes[i].taking = None;
                    self.note(format!("master {i} crashed"));
                } else {
                    self.nodes[i] = Node::new(i, self.now);
                    self.note(format!("master {i} restarted"));
                }
            }
            3 => {
                let i = self.rng.random_range(0..self.nodes.len());
                self.nodes[i].cut_until = self.now + self.rng.random_range(1..2 * TTL);
                self.disturb(i);
                self.note(format!(
                    "master {i} cut off from etcd until {}",
                    self.nodes[i].cut_until
                ));
            }
            4 if self.rng.random_bool(0.2) => {
                self.etcd = Etcd {
                    next_lease: self.etcd.next_lease + 1000,
                    ledger: std::mem::take(&mut self.etcd.ledger),
                    ..Etcd::default()
                };
                self.acked = 0; // the journal is gone: its loss is explained
                self.disturb_all();
                self.note("etcd lost its data".into());
            }
            6..=9 => self.replicate(),
            // An operator deletes the leader's key (`etcdctl del`): its lease lives on.
            5 if self.rng.random_bool(0.2) && self.etcd.key.is_some() => {
                self.etcd.key = None;
                self.etcd.rev += 1;
                self.disturb_all();
                self.note("the key was deleted by hand".into());
            }
            _ => {
                let by = self.rng.random_range(1..120);
                for _ in 0..by {
                    self.tick()?;
                }
            }
        }
        Ok(())
    }

    /// One millisecond.
    fn tick(&mut self) -> Result<(), String> {
        self.now += 1;
        let now = self.now;
        // Requests reach etcd; their answers go back.
        if self.outbox.iter().any(|o| o.0 <= now) {
            let (due, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.outbox)
                .into_iter()
                .partition(|o| o.0 <= now);
            self.outbox = rest;
            for (_, from, id, req) in due {
                let reply = match req {
                    Req::Keep(lease) => {
                        self.etcd.keepalive(lease, now);
                        continue;
                    }
                    Req::Op(op) => {
                        let at = At {
                            etcd: RefCell::new(&mut self.etcd),
                            won: RefCell::new(&mut self.won),
                            now,
                        };
                        Reply::Op(self.nodes[from].m.execute(&at, &op))
                    }
                    Req::Mark(owner, load) => {
                        let r = self.etcd.mark(owner, now);
                        if r.is_ok() {
                            self.loaded(from, owner, load);
                        }
                        Reply::Mark(r)
                    }
                };
                if self.nodes[from].cut_until <= now && !self.rng.random_bool(0.02) {
                    let at = now + self.rng.random_range(0..self.delay);
                    self.nodes[from].inbox.push((at, id, reply));
                } else {
                    self.disturb(from);
                }
            }
        }
        self.etcd.expire(now);
        for i in 0..self.nodes.len() {
            if !self.nodes[i].alive || self.nodes[i].paused_until > now {
                continue;
            }
            self.run(i)?;
        }
        self.check()
    }

    /// Master `i` does what is due at `now`.
    ///
    /// Its machine is polled until it waits or sends: at most [`POLLS_PER_TURN`] outputs (a
    /// machine that never waits fails the seed instead of hanging the run).
    fn run(&mut self, i: usize) -> Result<(), String> {
        let now = self.now;
        let view = View {
            stopping: false,
            mirror: self.nodes[i].mirror,
        };
        // Its fence, looked at as a request would (a leader past its bound turns standby).
        if let Some((_, term)) = self.nodes[i].leading_since {
            if !self.nodes[i].fence.admits(now) {
                let end = self.nodes[i].fence.bounds().0.unwrap_or(now).min(now);
                self.close(i, end);
                let _ = self.nodes[i].fence.admit(now);
                self.note(format!("master {i} fenced in term {term}"));
            }
        }
        self.takeover_step(i);
        // The answer to the request out, or its timeout (an answer to an earlier request,
        // timed out, is dropped: a connection's late answer never reaches the next request).
        if let Some((id, sent, load)) = self.nodes[i].out {
            let n = &mut self.nodes[i];
            n.inbox.retain(|r| r.1 == id);
            let reply = match n.inbox.first() {
                Some(&(at, _, _)) if at <= now => Some(n.inbox.remove(0).2),
                _ if now >= sent + TIMEOUT => Some(match load {
                    true => Reply::Mark(Err("timed out".into())),
                    false => Reply::Op(Err("timed out".into())),
                }),
                _ => None,
            };
            let Some(reply) = reply else { return Ok(()) };
            n.out = None;
            n.inbox.clear();
            match reply {
                Reply::Op(a) => n.m.on_etcd(now, a, &view, &mut n.fence),
                Reply::Mark(r) => n.m.on_taken(now, r, &mut n.fence),
            }
        }
        let mut turn = 0;
        loop {
            turn += 1;
            if turn > POLLS_PER_TURN {
                return Err(format!("no progress: master {i}'s machine gave more than {POLLS_PER_TURN} outputs at t={now} without waiting for anything"));
            }
            let n = &mut self.nodes[i];
            match n.m.poll(now, &view, &mut n.fence) {
                Out::Wait(_) => return Ok(()),
                Out::Etcd(op) => {
                    self.send(i, Req::Op(op));
                    return Ok(());
                }
                Out::TakeOver { owner, plan } => {
                    self.note(format!(
                        "master {i} won term {} ({plan:?})",
                        owner.create_revision
                    ));
                    let n = &self.nodes[i];
                    let mirror = n.mirror.map(|t| (t, n.mirror_objects));
                    self.took_over(i, owner, plan)?;
                    self.begin_takeover(i, owner, plan, mirror);
                    return Ok(());
                }
                Out::Lead { owner } => {
                    let term = owner.create_revision;
                    if self.nodes[i].fence.admits(now) {
                        self.nodes[i].leading_since = Some((now, term));
                        self.leaderships += 1;
                        let until = self.nodes[i].fence.bounds().0.unwrap_or(now);
                        self.note(format!("master {i} leads term {term} until {until}"));
                    }
                    self.led(i)?;
                }
                Out::StepDown { owner, failed } => {
                    let end = self.nodes[i].fence.bounds().0.unwrap_or(now).min(now);
                    self.close(i, end);
                    self.note(format!(
                        "master {i} steps down from term {} (takeover failed: {failed})",
                        owner.create_revision
                    ));
                    self.stepped_down(i, failed)?;
                }
                Out::Exit => return Ok(()),
                Out::Warn(w) => self.note(format!("master {i}: {w}")),
                Out::Register => {
                    if self.nodes[i].cut_until <= now {
                        let me = self.nodes[i].m.config().me.clone();
                        self.etcd.register(&me, self.nodes[i].mirror, now);
                    }
                }
                Out::Leader(_) | Out::Seal | Out::SteppedDown { .. } | Out::Info(_) => {}
            }
        }
    }

    /// Master `i` won `owner`'s key and takes over as `plan` says: checked against the in-sync
    /// record and registrations its transaction saw. From the journal only while the record
    /// names no member (it is stale otherwise); from its mirror only as a member with a mirror
    /// of the record's term; empty only when no other member was registered with that mirror.
    fn took_over(&mut self, i: usize, owner: Owner, plan: Plan) -> Result<(), String> {
        let me = self.nodes[i].m.config().me.clone();
        let Some((rec, alive)) = self.won.remove(&(owner.create_revision, owner.lease)) else {
            return Err(format!(
                "master {i} took over term {} it never won",
                owner.create_revision
            ));
        };
        let others: Vec<&String> = alive.iter().filter(|m| **m != me).collect();
        let ok = match plan {
            Plan::Journal => rec.members.is_empty(),
            Plan::Mirror(t) => {
                self.from_mirror += 1;
                self.nodes[i].mirror == Some(t) && rec.term == t && rec.members.contains(&me)
            }
            Plan::Empty => {
                self.empty += 1;
                !rec.members.is_empty() && others.is_empty()
            }
        };
        if !ok {
            return Err(format!("master {i} ({me}, mirror {:?}) took over as {plan:?} while the in-sync record was {rec:?} and {others:?} were registered with its mirror", self.nodes[i].mirror));
        }
        // A leader is not a standby: its mirror is taken, or no longer of use.
        self.nodes[i].mirror = None;
        self.nodes[i].mirror_objects = 0;
        Ok(())
    }

    /// The leader streams to a standby: its mirror becomes whole for the leader's term, and
    /// once its registration says so, the leader names it in the in-sync record (in a
    /// transaction guarded by its key); or it drops a member from the record (late, or its
    /// link cut).
    fn replicate(&mut self) {
        let now = self.now;
        let Some(l) = (0..self.nodes.len()).find(|&i| {
            let n = &self.nodes[i];
            n.alive && n.paused_until <= now && n.leading_since.is_some() && n.fence.admits(now)
        }) else {
            return;
        };
        let Some(owner) = self.nodes[l].m.leading() else {
            return;
        };
        self.etcd.expire(now);
        if !self.etcd.key.as_ref().is_some_and(|kv| owner.holds(kv)) {
            return;
        }
        let term = owner.create_revision;
        let mut rec = self.etcd.record();
        if rec.term != term {
            return;
        }
        self.ack(l, term, !rec.members.is_empty());
        let j = self.rng.random_range(0..self.nodes.len());
        let m = self.nodes[j].m.config().me.clone();
        if j == l || !self.nodes[j].alive {
            return;
        }
        if rec.members.contains(&m) {
            if self.rng.random_bool(0.3) {
                rec.members.retain(|x| *x != m);
                if rec.members.is_empty() {
                    // The rebase: the journal made whole before the set empties.
                    self.etcd.objects = self.nodes[l].state;
                }
                self.etcd.set_insync(&rec);
                self.note(format!("leader {l} drops {m} from the in-sync set"));
            }
        } else if self.nodes[j].mirror != Some(term) {
            self.nodes[j].mirror = Some(term);
            self.nodes[j].mirror_objects = self.nodes[l].state;
            self.note(format!("{m}'s mirror is whole for term {term}"));
        } else if self.etcd.registered(&m) == Some(term) {
            rec.members.push(m.clone());
            self.etcd.set_insync(&rec);
            self.note(format!("leader {l} names {m} in sync"));
        }
    }

    fn check(&self) -> Result<(), String> {
        self.check_leases()?;
        let now = self.now;
        let live: Vec<Admitted> = self
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| {
                let (from, term) = n.leading_since?;
                let until = n.fence.bounds().0.unwrap_or(from);
                Some(Admitted {
                    master: i,
                    term,
                    from,
                    until,
                })
            })
            .collect();
        for a in &live {
            let n = &self.nodes[a.master];
            if n.fence.admits(now) && (n.fence.role() != Role::Leader || n.fence.term() != a.term) {
                return Err(format!(
                    "master {} admits but not as the leader of term {}",
                    a.master, a.term
                ));
            }
            for b in self
                .history
                .iter()
                .chain(live.iter())
                .filter(|b| b.master != a.master)
            {
                if a.from < b.until && b.from < a.until {
                    return Err(format!("two masters admit at once: {a:?} and {b:?}"));
                }
            }
        }
        Ok(())
    }
}

/// Runs election seed `seed`: how many leaderships began; of the takeovers, how many were
/// from a member's mirror, started empty, led after a load longer than the lease TTL, and
/// failed with their lease run out.
pub fn run(seed: u64) -> Result<[u64; 5], String> {
    let mut w = World::new(seed);
    for _ in 0..STEPS {
        if let Err(e) = w.step() {
            return Err(format!("election seed {seed}: {e}\nreplay it alone: KVFERRY_SIM_SEED={seed} cargo test -p kvferry-store --lib sim::\nlast events:\n  {}", w.trace.join("\n  ")));
        }
    }
    Ok([
        w.leaderships,
        w.from_mirror,
        w.empty,
        w.long_takeovers,
        w.lapsed_takeovers,
    ])
}
