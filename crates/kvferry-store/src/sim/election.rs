//! Deterministic simulation of the election and its fencing: several masters campaign for
//! one key in a model of etcd (revisions, leases with their TTL, create-if-absent and guarded
//! transactions, the journal's term marker, and the loss of all its data), over a network
//! that delays and loses requests and answers, while masters pause (SIGSTOP: nothing of
//! theirs runs, their fence keeps its bound), crash and restart, and are cut off from etcd.
//!
//! The masters run the real [`Fence`] and [`Renewals`]; how they campaign is modelled on
//! `ha::campaign` and `take_over` (poll the key every [`STANDBY_POLL`], grant a lease and
//! create the key if it is absent, write the term marker, wait one fence bound when the
//! marker does not name the leader last seen, renew and read the key back, then lead).
//!
//! Checked after every step: no two masters may ever admit requests during overlapping
//! times (each master's admitting interval runs from when it became leader to the end of its
//! fence, or its crash), and a master admits only as the leader of the term it won.

use crate::ha::fence::{Fence, Next, Renewal, Renewals};
use crate::ha::{Role, STANDBY_POLL};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;

const TTL: u64 = 5_000;
const BOUND: u64 = TTL * 2 / 3;
const EVERY: u64 = TTL / 4;
/// A request not answered within this is failed by its sender (`request_timeout`).
const TIMEOUT: u64 = TTL / 4;
const POLL: u64 = STANDBY_POLL.as_millis() as u64;
const STEPS: usize = 1500;

/// The key's value: who created it, at which revision, under which lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Kv {
    master: usize,
    create_rev: i64,
    lease: i64,
}

#[derive(Default)]
struct Etcd {
    rev: i64,
    key: Option<Kv>,
    /// lease -> when it expires
    leases: BTreeMap<i64, u64>,
    next_lease: i64,
    /// The last leader that marked the journal (revision, lease).
    marker: Option<(i64, i64)>,
}

impl Etcd {
    fn expire(&mut self, now: u64) {
        self.leases.retain(|_, &mut at| at > now);
        if self
            .key
            .is_some_and(|k| !self.leases.contains_key(&k.lease))
        {
            self.key = None;
            self.rev += 1;
        }
    }

    fn apply(&mut self, from: usize, op: Op, now: u64) -> Reply {
        self.expire(now);
        match op {
            Op::Get => Reply::Key(self.key),
            Op::Campaign => {
                self.next_lease += 1;
                let lease = self.next_lease;
                self.leases.insert(lease, now + TTL);
                if self.key.is_some() {
                    self.leases.remove(&lease);
                    return Reply::Lost;
                }
                self.rev += 1;
                let kv = Kv {
                    master: from,
                    create_rev: self.rev,
                    lease,
                };
                self.key = Some(kv);
                Reply::Won(kv, self.marker)
            }
            Op::MarkTerm(kv) => {
                if self.key == Some(kv) {
                    self.marker = Some((kv.create_rev, kv.lease));
                    Reply::Done(true)
                } else {
                    Reply::Done(false)
                }
            }
            Op::Renew(kv) => match self.leases.get_mut(&kv.lease) {
                None => Reply::Renewed(Renewal::LeaseLost),
                Some(at) => {
                    *at = now + TTL;
                    Reply::Renewed(if self.key == Some(kv) {
                        Renewal::Ours
                    } else {
                        Renewal::KeyLost
                    })
                }
            },
            Op::Resign(kv) => {
                if self.key == Some(kv) {
                    self.key = None;
                    self.rev += 1;
                }
                self.leases.remove(&kv.lease);
                Reply::Done(true)
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Op {
    Get,
    /// Grant a lease and create the key under it if it is absent (one step here; two
    /// requests in `campaign`, which revokes the lease when the transaction loses).
    Campaign,
    MarkTerm(Kv),
    /// Renew the lease and read the key back.
    Renew(Kv),
    Resign(Kv),
}

#[derive(Debug, Clone, Copy)]
enum Reply {
    Key(Option<Kv>),
    Lost,
    Won(Kv, Option<(i64, i64)>),
    Done(bool),
    Renewed(Renewal),
    /// No answer within the timeout.
    TimedOut,
}

#[derive(Debug)]
enum Phase {
    Standby {
        next_poll: u64,
    },
    /// A request is out; `sent` is when.
    Waiting {
        sent: u64,
        then: After,
    },
    /// Won `kv`; serves once `until` passed and a renewal proved the lease.
    Wait {
        kv: Kv,
        until: u64,
    },
    Leading {
        kv: Kv,
        renewals: Renewals,
    },
}

#[derive(Debug)]
enum After {
    Poll,
    Campaign,
    Mark { kv: Kv, won_at: u64, wait: bool },
    Prove { kv: Kv },
    Renew { kv: Kv, renewals: Renewals },
    Resign,
}

struct Node {
    fence: Fence,
    phase: Phase,
    alive: bool,
    paused_until: u64,
    /// Cut off from etcd until then (its requests and answers are lost).
    cut_until: u64,
    /// The leader it saw last while standing by (revision, lease).
    seen: Option<(i64, i64)>,
    /// Since when it admits, as leader of which term.
    leading_since: Option<(u64, i64)>,
    /// Answers on their way to it: (arrives at, reply), in order.
    inbox: Vec<(u64, Reply)>,
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
    /// Requests on their way to etcd: (arrives at, from, op, sent).
    outbox: Vec<(u64, usize, Op)>,
    history: Vec<Admitted>,
    trace: Vec<String>,
    pub leaderships: u64,
}

impl World {
    fn new(seed: u64) -> World {
        let mut rng = StdRng::seed_from_u64(seed);
        let n = rng.random_range(2..=4);
        let nodes = (0..n)
            .map(|i| Node {
                fence: Fence::standby(),
                phase: Phase::Standby {
                    next_poll: i as u64 * 37,
                },
                alive: true,
                paused_until: 0,
                cut_until: 0,
                seen: None,
                leading_since: None,
                inbox: Vec::new(),
            })
            .collect();
        World {
            rng,
            now: 0,
            etcd: Etcd::default(),
            nodes,
            outbox: Vec::new(),
            history: Vec::new(),
            trace: Vec::new(),
            leaderships: 0,
        }
    }

    fn note(&mut self, s: String) {
        if self.trace.len() == 40 {
            self.trace.remove(0);
        }
        self.trace.push(format!("t={} {s}", self.now));
    }

    fn send(&mut self, from: usize, op: Op, then: After) {
        let now = self.now;
        self.nodes[from].phase = Phase::Waiting { sent: now, then };
        if self.nodes[from].cut_until > now || self.rng.random_bool(0.02) {
            return; // lost: it times out
        }
        let at = now + self.rng.random_range(0..TIMEOUT / 2);
        self.outbox.push((at, from, op));
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
                    self.note(format!("master {i} crashed"));
                } else {
                    self.nodes[i] = Node {
                        fence: Fence::standby(),
                        phase: Phase::Standby {
                            next_poll: self.now,
                        },
                        alive: true,
                        paused_until: 0,
                        cut_until: 0,
                        seen: None,
                        leading_since: None,
                        inbox: Vec::new(),
                    };
                    self.note(format!("master {i} restarted"));
                }
            }
            3 => {
                let i = self.rng.random_range(0..self.nodes.len());
                self.nodes[i].cut_until = self.now + self.rng.random_range(1..2 * TTL);
                self.note(format!(
                    "master {i} cut off from etcd until {}",
                    self.nodes[i].cut_until
                ));
            }
            4 if self.rng.random_bool(0.2) => {
                self.etcd = Etcd {
                    next_lease: self.etcd.next_lease + 1000,
                    ..Etcd::default()
                };
                self.note("etcd lost its data".into());
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
        let (due, rest): (Vec<_>, Vec<_>) = match self.outbox.iter().any(|o| o.0 <= now) {
            true => std::mem::take(&mut self.outbox)
                .into_iter()
                .partition(|o| o.0 <= now),
            false => (Vec::new(), Vec::new()),
        };
        if !due.is_empty() {
            self.outbox = rest;
        }
        for (_, from, op) in due {
            let reply = self.etcd.apply(from, op, now);
            if self.nodes[from].cut_until <= now && !self.rng.random_bool(0.02) {
                let at = now + self.rng.random_range(0..TIMEOUT / 2);
                self.nodes[from].inbox.push((at, reply));
            }
        }
        self.etcd.expire(now);
        for i in 0..self.nodes.len() {
            if !self.nodes[i].alive || self.nodes[i].paused_until > now {
                continue;
            }
            self.run(i);
        }
        self.check()
    }

    /// Master `i` does what is due at `now`.
    fn run(&mut self, i: usize) {
        let now = self.now;
        // Its fence, looked at as a request would (a leader past its bound turns standby).
        if let Some((_, term)) = self.nodes[i].leading_since {
            if !self.nodes[i].fence.admits(now) {
                let end = self.nodes[i].fence.bounds().0.unwrap_or(now).min(now);
                self.close(i, end);
                let _ = self.nodes[i].fence.admit(now);
                self.note(format!("master {i} fenced in term {term}"));
            }
        }
        let answer = match &self.nodes[i].phase {
            Phase::Waiting { sent, .. } => {
                let sent = *sent;
                match self.nodes[i].inbox.first() {
                    Some(&(at, reply)) if at <= now => {
                        self.nodes[i].inbox.remove(0);
                        Some((reply, sent))
                    }
                    _ if now >= sent + TIMEOUT => {
                        // (A late answer of this request is dropped with it.)
                        self.nodes[i].inbox.clear();
                        Some((Reply::TimedOut, sent))
                    }
                    _ => None,
                }
            }
            _ => {
                self.nodes[i].inbox.clear();
                None
            }
        };
        let phase = std::mem::replace(&mut self.nodes[i].phase, Phase::Standby { next_poll: now });
        self.nodes[i].phase = match (phase, answer) {
            (Phase::Standby { next_poll }, _) if now < next_poll => Phase::Standby { next_poll },
            (Phase::Standby { .. }, _) => {
                self.send(i, Op::Get, After::Poll);
                return;
            }
            (p @ Phase::Waiting { .. }, None) => p,
            (Phase::Waiting { then, sent }, Some((reply, _))) => {
                return self.answered(i, then, sent, reply)
            }
            (Phase::Wait { kv, until }, _) if now >= until => {
                self.send(i, Op::Renew(kv), After::Prove { kv });
                return;
            }
            (p @ Phase::Wait { .. }, _) => p,
            (Phase::Leading { kv, mut renewals }, _) => {
                match renewals.poll(&mut self.nodes[i].fence, now) {
                    Next::Wait(_) => Phase::Leading { kv, renewals },
                    Next::Renew => {
                        self.send(i, Op::Renew(kv), After::Renew { kv, renewals });
                        return;
                    }
                    Next::StepDown => return self.step_down(i, kv),
                }
            }
        };
    }

    fn step_down(&mut self, i: usize, kv: Kv) {
        let now = self.now;
        let end = self.nodes[i].fence.bounds().0.unwrap_or(now).min(now);
        self.close(i, end);
        self.nodes[i].fence.set_standby(None);
        self.note(format!("master {i} steps down from term {}", kv.create_rev));
        self.send(i, Op::Resign(kv), After::Resign);
    }

    fn answered(&mut self, i: usize, then: After, sent: u64, reply: Reply) {
        let now = self.now;
        let standby = Phase::Standby {
            next_poll: now + POLL,
        };
        match (then, reply) {
            (After::Poll, Reply::Key(Some(kv))) => {
                self.nodes[i].seen = Some((kv.create_rev, kv.lease));
                self.nodes[i]
                    .fence
                    .set_standby(Some(("leader", kv.create_rev)));
                self.nodes[i].phase = standby;
            }
            (After::Poll, Reply::Key(None)) => self.send(i, Op::Campaign, After::Campaign),
            (After::Campaign, Reply::Won(kv, marker)) => {
                // etcd kept its history only if its marker names the leader last seen.
                let wait = marker.is_none() || marker != self.nodes[i].seen;
                self.note(format!(
                    "master {i} won term {} (waits a fence bound: {wait})",
                    kv.create_rev
                ));
                self.send(
                    i,
                    Op::MarkTerm(kv),
                    After::Mark {
                        kv,
                        won_at: now,
                        wait,
                    },
                );
            }
            (After::Mark { kv, won_at, wait }, Reply::Done(true)) => {
                let until = if wait { won_at + BOUND } else { now };
                self.nodes[i].phase = Phase::Wait { kv, until };
            }
            (After::Prove { kv }, Reply::Renewed(Renewal::Ours)) => {
                self.nodes[i]
                    .fence
                    .set_leader(kv.create_rev, "me", kv.lease, sent, BOUND);
                if self.nodes[i].fence.admits(now) {
                    self.nodes[i].leading_since = Some((now, kv.create_rev));
                    self.leaderships += 1;
                    self.note(format!(
                        "master {i} leads term {} until {}",
                        kv.create_rev,
                        sent + BOUND
                    ));
                }
                self.nodes[i].phase = Phase::Leading {
                    kv,
                    renewals: Renewals::new(kv.create_rev, EVERY, BOUND, now),
                };
            }
            (After::Mark { kv, .. } | After::Prove { kv }, reply) => {
                // Lost the key while taking over, or etcd did not answer: it resigns.
                self.note(format!(
                    "master {i} gives up term {} ({reply:?})",
                    kv.create_rev
                ));
                self.nodes[i].fence.set_standby(None);
                self.send(i, Op::Resign(kv), After::Resign);
            }
            (After::Renew { kv, mut renewals }, reply) => {
                let outcome = match reply {
                    Reply::Renewed(o) => o,
                    _ => Renewal::Failed,
                };
                if renewals.on_renewal(&mut self.nodes[i].fence, sent, outcome) {
                    return self.step_down(i, kv);
                }
                self.nodes[i].phase = Phase::Leading { kv, renewals };
            }
            (After::Resign | After::Poll | After::Campaign, _) => self.nodes[i].phase = standby,
        }
    }

    fn check(&self) -> Result<(), String> {
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

/// Runs election seed `seed`: how many leaderships began.
pub fn run(seed: u64) -> Result<u64, String> {
    let mut w = World::new(seed);
    for _ in 0..STEPS {
        if let Err(e) = w.step() {
            return Err(format!("election seed {seed}: {e}\nreplay it alone: KVFERRY_SIM_SEED={seed} cargo test -p kvferry-store --lib sim::\nlast events:\n  {}", w.trace.join("\n  ")));
        }
    }
    Ok(w.leaderships)
}
