//! Takeovers that take time, and what a leader acknowledged: the load of a won key's state
//! lasts from nothing to three lease TTLs (a large state rebuilt, then written to etcd whole),
//! while the real [`TakeoverRenewals`] renews the key's lease and the standby's registration
//! over the lossy network; a pause, a cut or a lost renewal can let the lease run out, and the
//! takeover then fails when it proves its lease. The state is abstracted to a count of
//! acknowledged objects: a leader admitting under its key acknowledges puts, held by the
//! etcd journal while the in-sync set is empty, else by every mirror of its term (a set that
//! empties is rebased into the journal first); a takeover loads the journal's, the mirror's,
//! or nothing (starting empty, whose loss is explained), and writes it to the journal whole.
//!
//! Checked: a master admits only while etcd would still count its key's lease alive (as etcd
//! last renewed it: a leader whose lease expired never answers a write); a takeover nothing
//! disturbed (no pause, cut, lost message, wipe or key deleted by hand while it ran) keeps its
//! key's lease and its registration alive throughout and ends leading, however long its load;
//! a master leads only holding every object acknowledged before (unless a start from empty or
//! a wipe of etcd explains their loss).

use super::{Req, World, TTL};
use crate::elect::fence::{Keep, TakeoverRenewals};
use crate::elect::Plan;
use kvferry::metadata::etcd::Owner;
use rand::Rng;

/// What a takeover's load writes to the journal before its mark: nothing (it loaded the
/// journal), its mirror's objects, or an empty state.
#[derive(Debug, Clone, Copy)]
pub(super) enum Load {
    Journal,
    Whole(u64),
    Empty,
}

/// A takeover under way: from [`crate::elect::Out::TakeOver`] to `Lead` or `StepDown`.
pub(super) struct Taking {
    owner: Owner,
    plan: Plan,
    /// The load ends then (the machine is told through the journal's mark, sent then).
    load_until: u64,
    load: u64,
    marked: bool,
    renewals: TakeoverRenewals,
    /// The registration's lease it renews too, if it had one (and it is checked).
    reg: Option<i64>,
    /// The mirror it took over from: its term and objects (given back if it fails).
    mirror: Option<(i64, u64)>,
    /// Paused, cut off, a message of its lost, etcd wiped or the key deleted meanwhile.
    disturbed: bool,
}

impl World {
    /// Master `i` won `owner`'s key (checked by `took_over`): its load begins.
    pub(super) fn begin_takeover(
        &mut self,
        i: usize,
        owner: Owner,
        plan: Plan,
        mirror: Option<(i64, u64)>,
    ) {
        let load = if self.rng.random_bool(0.25) {
            self.rng.random_range(TTL..3 * TTL)
        } else {
            self.rng.random_range(0..TTL / 20)
        };
        let now = self.now;
        let me = self.nodes[i].m.config().me.clone();
        let reg = self.etcd.regs.get(&me).map(|kv| kv.lease);
        let leases: Vec<i64> = std::iter::once(owner.lease).chain(reg).collect();
        let every = self.nodes[i].m.config().every;
        // Whether the first renewal can reach etcd before a lease expires: the registration
        // was renewed last at the start of the campaign's round, several round trips ago (it
        // is checked only if so); the key's lease one round trip before the win, unless the
        // master was paused or cut off during the campaign (disturbed from the start).
        let lasts = |l: &i64| {
            self.etcd
                .leases
                .get(l)
                .is_some_and(|&at| at > now + every + self.delay)
        };
        // (So is a takeover whose key went before its win was heard: deleted by hand, wiped.)
        let ours = self.etcd.key.as_ref().is_some_and(|kv| owner.holds(kv));
        let disturbed = self.nodes[i].cut_until > now || !lasts(&owner.lease) || !ours;
        let reg = reg.filter(lasts);
        self.nodes[i].state = 0;
        self.nodes[i].taking = Some(Taking {
            owner,
            plan,
            load_until: now + load,
            load,
            marked: false,
            renewals: TakeoverRenewals::new(&leases, every, now),
            reg,
            mirror,
            disturbed,
        });
        self.note(format!(
            "master {i} loads term {}'s state for {load} ms",
            owner.create_revision
        ));
        self.takeover_step(i);
    }

    /// Master `i`'s takeover at `now`: the renewals due, and once its load is done the
    /// journal's mark (what tells the machine, `on_taken`).
    pub(super) fn takeover_step(&mut self, i: usize) {
        let now = self.now;
        let idle = self.nodes[i].out.is_none();
        let Some(t) = self.nodes[i].taking.as_mut() else {
            return;
        };
        let mark = (!t.marked && now >= t.load_until && idle).then(|| {
            let load = match t.plan {
                Plan::Journal => Load::Journal,
                Plan::Mirror(_) => Load::Whole(t.mirror.map_or(0, |m| m.1)),
                Plan::Empty => Load::Empty,
            };
            (t.owner, load)
        });
        t.marked |= mark.is_some();
        let keep = t.renewals.poll(now);
        if let Some((owner, load)) = mark {
            self.send(i, Req::Mark(owner, load));
        }
        if let Keep::Renew(leases) = keep {
            for lease in leases {
                self.send_keep(i, lease);
            }
        }
    }

    /// A renewal from master `i`'s takeover: nobody waits for its answer.
    fn send_keep(&mut self, i: usize, lease: i64) {
        let now = self.now;
        if self.nodes[i].cut_until > now || self.rng.random_bool(0.02) {
            self.disturb(i);
            return;
        }
        let at = now + self.rng.random_range(0..self.delay);
        self.outbox.push((at, i, 0, Req::Keep(lease)));
    }

    pub(super) fn disturb(&mut self, i: usize) {
        if let Some(t) = self.nodes[i].taking.as_mut() {
            t.disturbed = true;
        }
    }

    pub(super) fn disturb_all(&mut self) {
        for i in 0..self.nodes.len() {
            self.disturb(i);
        }
    }

    /// etcd marked the journal for `owner`'s term (master `from`'s, unless it died since):
    /// the state it loaded is written whole to the journal first (the in-sync set emptied by
    /// the mark).
    pub(super) fn loaded(&mut self, from: usize, owner: Owner, load: Load) {
        let state = match load {
            Load::Journal => self.etcd.objects,
            Load::Whole(n) => n,
            Load::Empty => {
                self.acked = 0; // what only the dead members held is lost, and said so
                0
            }
        };
        self.etcd.objects = state;
        let n = &mut self.nodes[from];
        if n.taking.as_ref().is_some_and(|t| t.owner == owner) {
            n.state = state;
        }
    }

    /// Master `i` leads after its takeover: with every object acknowledged before.
    pub(super) fn led(&mut self, i: usize) -> Result<(), String> {
        let Some(t) = self.nodes[i].taking.take() else {
            return Ok(());
        };
        if self.nodes[i].state < self.acked {
            return Err(format!(
                "master {i} leads term {} with {} objects, {} acknowledged before ({:?}, a load of {} ms)",
                t.owner.create_revision, self.nodes[i].state, self.acked, t.plan, t.load
            ));
        }
        if t.load > TTL {
            self.long_takeovers += 1;
        }
        Ok(())
    }

    /// Master `i` steps down; after a takeover that failed, its mirror is given back (the
    /// driver restores it). A takeover nothing disturbed never fails.
    pub(super) fn stepped_down(&mut self, i: usize, failed: bool) -> Result<(), String> {
        let Some(t) = self.nodes[i].taking.take() else {
            return Ok(());
        };
        if !failed {
            return Ok(());
        }
        if !t.disturbed {
            return Err(format!(
                "master {i}'s takeover of term {} ({:?}, a load of {} ms) failed though nothing disturbed it",
                t.owner.create_revision, t.plan, t.load
            ));
        }
        if self
            .etcd
            .ledger
            .get(&t.owner.lease)
            .is_some_and(|&at| at <= self.now)
        {
            self.lapsed_takeovers += 1;
        }
        if let Some((term, objects)) = t.mirror {
            self.nodes[i].mirror = Some(term);
            self.nodes[i].mirror_objects = objects;
        }
        Ok(())
    }

    /// The leader `l` of `term` acknowledges puts: held by every mirror of its term, and by
    /// the etcd journal too while the in-sync set (`members`) is empty.
    pub(super) fn ack(&mut self, l: usize, term: i64, members: bool) {
        let n = self.rng.random_range(1..=3);
        self.nodes[l].state += n;
        let state = self.nodes[l].state;
        self.acked = self.acked.max(state);
        // (Every standby streamed to gets it, in sync or not yet.)
        for j in 0..self.nodes.len() {
            if j != l && self.nodes[j].alive && self.nodes[j].mirror == Some(term) {
                self.nodes[j].mirror_objects = state;
            }
        }
        if !members {
            self.etcd.objects = state;
        }
    }

    /// After every step: a master admits only while its key's lease lives as etcd last
    /// renewed it; a takeover nothing disturbed keeps its leases alive.
    pub(super) fn check_leases(&self) -> Result<(), String> {
        let now = self.now;
        for (i, n) in self.nodes.iter().enumerate() {
            if n.alive && n.leading_since.is_some() && n.fence.admits(now) {
                let lease = n.fence.lease_id();
                let until = self.etcd.ledger.get(&lease).copied().unwrap_or(0);
                if until <= now {
                    return Err(format!("master {i} admits as the leader of term {} at {now}, but its lease {lease} expired at {until}", n.fence.term()));
                }
            }
            let Some(t) = n.taking.as_ref().filter(|t| n.alive && !t.disturbed) else {
                continue;
            };
            let lives = |l: i64| self.etcd.leases.contains_key(&l);
            let lost = match t.reg {
                _ if !lives(t.owner.lease) => Some(("its key's lease", t.owner.lease)),
                Some(r) if !lives(r) => Some(("its registration's lease", r)),
                _ => None,
            };
            if let Some((what, lease)) = lost {
                return Err(format!(
                    "master {i}'s takeover of term {} ({} ms into a load of {} ms, nothing disturbing it) let {what} ({lease}, expired at {:?}) run out",
                    t.owner.create_revision,
                    now + t.load - t.load_until,
                    t.load,
                    self.etcd.ledger.get(&lease)
                ));
            }
        }
        Ok(())
    }
}
