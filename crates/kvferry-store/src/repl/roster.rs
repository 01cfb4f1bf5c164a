//! The leader's standbys as a machine: which standbys are linked, which registered (and the
//! mirror term each names), which failed to link and when to try them again, which are in
//! sync; and the writer's decisions about them: when to read the registrations, which links
//! to open and which to drop, who joins the in-sync set, who leaves it, whether the set
//! empties (a rebase), what a leader that stops (SIGTERM) does first, and where a rebase
//! takes what the etcd journal lacks from (the kept tail, or the whole state).
//!
//! It reads no clock (times are microseconds on the driver's monotonic clock), touches no
//! socket and no etcd: the driver (`crate::ha::journal`'s `Writer`) reads the registrations,
//! opens the links, tells it what the links say ([`Roster::observe`]: acknowledged, broken),
//! writes to etcd what it proposes (the in-sync set, always in etcd first) and then tells
//! it so ([`Roster::set_insync`], [`Roster::emptied`]). The simulator (`crate::sim`'s
//! standbys) drives the same machine on a simulated network, and [`Roster::check`] states
//! its invariants after every step.

use super::members::{self, LinkView};
use std::collections::BTreeMap;

/// One linked standby, as the leader knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub member: String,
    /// The replication address the link was opened to.
    pub addr: String,
    /// It takes `ToStandby::Base` frames (its registration says so).
    pub runs: bool,
    /// It reads grants of space ahead (its registration says so).
    pub grants: bool,
    /// The position of the image it was sent.
    pub image_seq: u64,
    /// The last entry it acknowledged.
    pub acked: u64,
    /// The link broke.
    pub dead: bool,
}

impl Peer {
    pub fn view(&self) -> LinkView {
        LinkView {
            dead: self.dead,
            acked: self.acked,
            image_seq: self.image_seq,
            grants: self.grants,
        }
    }
}

/// A standby's registration as the leader read it (`crate::elect::insync::Registration`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    /// Its replication address.
    pub addr: String,
    /// The mirror term it names.
    pub mirror: Option<i64>,
    pub runs: bool,
    pub grants: bool,
}

/// What reading the registrations decided ([`Roster::on_registrations`]).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Polled {
    /// Members whose link goes (it broke, or the standby is gone or registered at another
    /// address), and in-sync members without a link: to leave the set ([`Roster::leave`]).
    pub gone: Vec<String>,
    /// Standbys to link now (each gets an image, then every entry after it).
    pub open: Vec<(String, Registered)>,
}

/// What the in-sync set becomes when members leave it ([`Roster::leave`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leave {
    /// None of them was a member.
    Unchanged,
    /// The rest, to write to etcd before [`Roster::set_insync`].
    Rest(Vec<String>),
    /// The set empties: the etcd journal is made whole first (the rebase), then
    /// [`Roster::emptied`].
    Rebase,
}

/// Standbys joining the in-sync set ([`Roster::joining`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Join {
    /// Those that join.
    pub ready: Vec<String>,
    /// The set with them, to write to etcd before [`Roster::joined`].
    pub members: Vec<String>,
    /// The set was empty: everything up to here is in the etcd journal, the kept tail (the
    /// leader's and the standbys') starts here.
    pub first: bool,
}

/// What a leader that stops (SIGTERM) does before it fences itself and steps down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// Standbys are in sync: the etcd journal lacks their entries, so it is made whole (the
    /// rebase, emptying the set) before the leader's key goes, so that whoever leads next
    /// (a standby at once, from the journal) loses nothing acknowledged.
    RebaseThenStep,
    /// The etcd journal is whole already: step down at once.
    Step,
}

/// Where a rebase takes what the etcd journal lacks from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RebaseFrom {
    /// The kept run of entries after the journal's position reaches the last entry, and each
    /// fits a log value: those go to the log (a few transactions).
    Tail,
    /// The whole state, as a snapshot.
    Whole,
}

/// How long after a failed connection a standby is tried again (µs).
pub const RETRY_LINK_US: u64 = 1_000_000;

/// How long after its `n`th failed link in a row a standby is tried again (µs):
/// [`RETRY_LINK_US`], doubling up to 32 times that. Each try encodes an image of the whole
/// state (about 150 ms of the writer's time at a million objects on the dev VM), so a
/// standby that cannot link (unreachable, of another cluster, holding another cluster key)
/// must not cost that every second.
pub fn retry_link_after(n: u32) -> u64 {
    RETRY_LINK_US * (1u64 << n.saturating_sub(1).min(5))
}

/// A standby whose links failed: when last, how many times in a row at that address since
/// it was last in sync, and the address.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Failed {
    at: u64,
    times: u32,
    addr: String,
}

/// The leader's standbys and its decisions about them (see the module's doc).
#[derive(Debug, Clone)]
pub struct Roster {
    /// This leader's member id: its own registration is not a standby.
    me: String,
    term: i64,
    /// How often registrations are read (µs).
    poll_every: u64,
    last_poll: Option<u64>,
    links: Vec<Peer>,
    /// The in-sync set as etcd holds it.
    insync: Vec<String>,
    failed: BTreeMap<String, Failed>,
    /// The mirror term each registered standby names, as last read.
    mirrors: BTreeMap<String, Option<i64>>,
}

impl Roster {
    pub fn new(me: &str, term: i64, poll_every_us: u64) -> Roster {
        Roster {
            me: me.to_string(),
            term,
            poll_every: poll_every_us,
            last_poll: None,
            links: Vec::new(),
            insync: Vec::new(),
            failed: BTreeMap::new(),
            mirrors: BTreeMap::new(),
        }
    }

    pub fn insync(&self) -> &[String] {
        &self.insync
    }

    pub fn streaming(&self) -> bool {
        !self.insync.is_empty()
    }

    pub fn links(&self) -> &[Peer] {
        &self.links
    }

    pub fn link(&self, member: &str) -> Option<&Peer> {
        self.links.iter().find(|l| l.member == member)
    }

    fn view(&self, member: &str) -> Option<LinkView> {
        self.link(member).map(Peer::view)
    }

    /// What a link says now: the last entry its standby acknowledged, and whether it broke
    /// (a broken link stays broken).
    pub fn observe(&mut self, member: &str, acked: u64, dead: bool) {
        if let Some(l) = self.links.iter_mut().find(|l| l.member == member) {
            l.acked = l.acked.max(acked);
            l.dead |= dead;
        }
    }

    /// Whether the registrations are to be read now (then the next read is due a poll
    /// interval from `now`, whether this one succeeds or not).
    pub fn poll(&mut self, now: u64) -> bool {
        if self
            .last_poll
            .is_some_and(|t| now.saturating_sub(t) < self.poll_every)
        {
            return false;
        }
        self.last_poll = Some(now);
        true
    }

    /// The registrations read at `now` (member → registration): links that broke are
    /// counted as failures (tried again after [`retry_link_after`]) and dropped with those
    /// whose standby is gone or registered at another address; the standbys not linked and
    /// not waiting out a failure at the same address are to be linked (one that registered
    /// again at another address, as one that restarted, is tried at once).
    pub fn on_registrations(&mut self, now: u64, regs: BTreeMap<String, Registered>) -> Polled {
        self.mirrors = regs.iter().map(|(m, r)| (m.clone(), r.mirror)).collect();
        let gone: Vec<String> = self
            .links
            .iter()
            .filter(|l| l.dead || regs.get(&l.member).map(|r| &r.addr) != Some(&l.addr))
            .map(|l| l.member.clone())
            .chain(
                self.insync
                    .iter()
                    .filter(|m| self.link(m).is_none())
                    .cloned(),
            )
            .collect();
        let dead: Vec<(String, String)> = self
            .links
            .iter()
            .filter(|l| l.dead)
            .map(|l| (l.member.clone(), l.addr.clone()))
            .collect();
        for (member, addr) in dead {
            self.link_failed(&member, &addr, now);
        }
        self.links.retain(|l| !gone.contains(&l.member));
        let open = regs
            .into_iter()
            .filter(|(m, r)| {
                *m != self.me
                    && self.link(m).is_none()
                    && self.failed.get(m).is_none_or(|f| {
                        f.addr != r.addr || now.saturating_sub(f.at) > retry_link_after(f.times)
                    })
            })
            .collect();
        Polled { gone, open }
    }

    /// Linking `member` at `addr` failed at `now`: when it is tried again (µs from `now`).
    pub fn link_failed(&mut self, member: &str, addr: &str, now: u64) -> u64 {
        let times = self
            .failed
            .get(member)
            .filter(|f| f.addr == addr)
            .map_or(0, |f| f.times)
            + 1;
        self.failed.insert(
            member.to_string(),
            Failed {
                at: now,
                times,
                addr: addr.to_string(),
            },
        );
        retry_link_after(times)
    }

    /// `member` is linked at `addr`, sent an image at `image_seq`.
    pub fn linked(&mut self, member: &str, addr: &str, runs: bool, grants: bool, image_seq: u64) {
        self.links.retain(|l| l.member != member);
        self.links.push(Peer {
            member: member.to_string(),
            addr: addr.to_string(),
            runs,
            grants,
            image_seq,
            acked: 0,
            dead: false,
        });
    }

    /// The in-sync members whose link broke or is missing, or that have not acknowledged
    /// `late` (the oldest entry in flight, past the acknowledgement bound).
    pub fn failing(&self, late: Option<u64>) -> Vec<String> {
        members::failing(&self.insync, |m| self.view(m), late)
    }

    /// `gone` leave: their links are dropped, and what the set becomes.
    pub fn leave(&mut self, gone: &[String]) -> Leave {
        self.links.retain(|l| !gone.contains(&l.member));
        if !self.insync.iter().any(|m| gone.contains(m)) {
            return Leave::Unchanged;
        }
        let rest: Vec<String> = self
            .insync
            .iter()
            .filter(|m| !gone.contains(m))
            .cloned()
            .collect();
        if rest.is_empty() {
            Leave::Rebase
        } else {
            Leave::Rest(rest)
        }
    }

    /// The linked standbys that may join the set after entry `seq` ([`members::ready`]: all
    /// acknowledged, their registration naming this term's mirror), if any.
    pub fn joining(&self, seq: u64) -> Option<Join> {
        let ready: Vec<String> = self
            .links
            .iter()
            .filter(|l| {
                !self.insync.contains(&l.member)
                    && members::ready(
                        l.view(),
                        seq,
                        self.term,
                        self.mirrors.get(&l.member).copied().flatten(),
                    )
            })
            .map(|l| l.member.clone())
            .collect();
        if ready.is_empty() {
            return None;
        }
        let mut members = self.insync.clone();
        members.extend(ready.iter().cloned());
        Some(Join {
            first: self.insync.is_empty(),
            ready,
            members,
        })
    }

    /// etcd holds `j`'s set: its standbys are in sync (their failures forgotten).
    pub fn joined(&mut self, j: &Join) {
        for m in &j.ready {
            self.failed.remove(m);
        }
        self.insync = j.members.clone();
    }

    /// etcd holds `members` as the set.
    pub fn set_insync(&mut self, members: Vec<String>) {
        self.insync = members;
    }

    /// The rebase emptied the set in etcd.
    pub fn emptied(&mut self) {
        self.insync.clear();
    }

    /// Whether puts may be granted space ahead ([`members::grants_allowed`]).
    pub fn grants_allowed(&self) -> bool {
        members::grants_allowed(&self.insync, self.links.iter().map(Peer::view), |m| {
            self.view(m)
        })
    }

    /// The leader stops (SIGTERM): what it does before it steps down.
    pub fn on_stop(&self) -> Stop {
        if self.streaming() {
            Stop::RebaseThenStep
        } else {
            Stop::Step
        }
    }

    /// Where a rebase takes what the etcd journal lacks from: the kept run (`run_ends_at`:
    /// the last entry it reaches, `None`: none kept) if it reaches the last entry `seq` and
    /// its entries fit log values (`fits`), else the whole state.
    pub fn rebase_from(
        run_ends_at: Option<u64>,
        seq: u64,
        fits: impl FnOnce() -> bool,
    ) -> RebaseFrom {
        if run_ends_at == Some(seq) && fits() {
            RebaseFrom::Tail
        } else {
            RebaseFrom::Whole
        }
    }

    /// The standbys linked that take `ToStandby::Base` frames.
    pub fn runs(&self) -> impl Iterator<Item = &str> {
        self.links
            .iter()
            .filter(|l| l.runs)
            .map(|l| l.member.as_str())
    }

    /// Its invariants, `Err` naming the first broken: every link is to a standby other than
    /// this leader, at most one per member; with `last` the last entry written, no standby
    /// acknowledged past it; the in-sync set names each member once, never this leader, and
    /// never one remembered as failing to link.
    pub fn check(&self, last: u64) -> Result<(), String> {
        for (i, l) in self.links.iter().enumerate() {
            if l.member == self.me {
                return Err(format!("the leader {} links to itself", self.me));
            }
            if self.links[..i].iter().any(|o| o.member == l.member) {
                return Err(format!("{} is linked twice", l.member));
            }
            if l.acked > last {
                return Err(format!(
                    "{} acknowledged entry {} past the last written, {last}",
                    l.member, l.acked
                ));
            }
        }
        for (i, m) in self.insync.iter().enumerate() {
            if self.insync[..i].contains(m) {
                return Err(format!("{m} is in the in-sync set twice"));
            }
            if self.failed.contains_key(m) {
                return Err(format!("{m} is in sync and remembered as failing to link"));
            }
            if *m == self.me {
                return Err(format!("the leader {m} is in its own in-sync set"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
