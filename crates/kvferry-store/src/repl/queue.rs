//! The leader's journal queue: the changes requests applied, counted in tickets, which
//! tickets are durable, the answers waiting for theirs, and which grants of space ahead the
//! durable tickets hold. The driver (`crate::ha::journal::JournalCore`) keeps it under a lock,
//! wakes the threads it names and calls the answers it hands back; it decides nothing here.
//!
//! The rules: a ticket is durable only once the writer (or the in-sync standbys' release,
//! [`super::Pipeline`]) says everything up to it is, and only in its own term; an answer is
//! handed back exactly once, `Durable` only for a durable ticket of its term, `Unknown` when
//! the term ends or fails first, `TimedOut` past its bound.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;

use crate::master::changes::Change;

/// How a deferred answer ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Its changes are durable.
    Durable,
    /// The term ended or its journal failed first: the change may or may not survive.
    Unknown,
    /// Its changes were not durable within the bound it was given.
    TimedOut,
}

/// What became durable ([`Queue::written`]).
#[derive(Debug)]
pub struct Written<A> {
    /// The tickets that became durable (empty: none).
    pub tickets: Range<u64>,
    /// Every grant up to this number is in durable changes now.
    pub grants: Option<u64>,
    /// The deferred answers of those tickets, each to be answered [`Outcome::Durable`].
    pub ready: Vec<A>,
}

impl<A> Default for Written<A> {
    fn default() -> Self {
        Written {
            tickets: 0..0,
            grants: None,
            ready: Vec::new(),
        }
    }
}

/// The queue of one term (term 0: not journaling). `A` is whatever answers a deferred request.
#[derive(Debug)]
pub struct Queue<A> {
    term: i64,
    changes: Vec<Change>,
    /// Collections with changes, counted (the last ticket); `written` of them are durable.
    enqueued: u64,
    written: u64,
    /// The writer gave up (etcd unreachable past the fence bound, or the key is not ours):
    /// nothing more is durable in this term.
    failed: bool,
    /// The master is stopping: the writer puts the whole state in etcd and fences the leader;
    /// `handed_off` once done.
    handoff: bool,
    handed_off: bool,
    /// Something other than changes wants the writer (a standby's link broke).
    kicked: bool,
    /// Answers waiting for their ticket, with when they were deferred (this term's only).
    later: BTreeMap<u64, Vec<(u64, A)>>,
    /// (ticket, grant number): every grant up to the number is in the changes the ticket
    /// completes.
    grant_marks: VecDeque<(u64, u64)>,
}

impl<A> Default for Queue<A> {
    fn default() -> Self {
        Queue::new(0)
    }
}

impl<A> Queue<A> {
    /// The queue of `term` (0: not journaling).
    pub fn new(term: i64) -> Queue<A> {
        Queue {
            term,
            changes: Vec::new(),
            enqueued: 0,
            written: 0,
            failed: false,
            handoff: false,
            handed_off: false,
            kicked: false,
            later: BTreeMap::new(),
            grant_marks: VecDeque::new(),
        }
    }

    pub fn term(&self) -> i64 {
        self.term
    }

    /// Whether `term` is journaled here and its journal has not failed.
    pub fn live(&self, term: i64) -> bool {
        self.term != 0 && self.term == term && !self.failed
    }

    /// Every ticket up to this one is durable.
    pub fn written_upto(&self) -> u64 {
        self.written
    }

    /// Pretends `n` tickets were enqueued (tests of what waits for them).
    #[cfg(test)]
    pub fn set_enqueued_for_test(&mut self, n: u64) {
        self.enqueued = n;
    }

    /// Tickets enqueued and not yet durable.
    pub fn lag(&self) -> u64 {
        self.enqueued - self.written
    }

    /// The last ticket.
    pub fn enqueued(&self) -> u64 {
        self.enqueued
    }

    /// Whether changes wait to be taken.
    pub fn has_changes(&self) -> bool {
        !self.changes.is_empty()
    }

    pub fn changes_len(&self) -> usize {
        self.changes.len()
    }

    /// Adds `changes` as the next ticket, holding every grant up to `issued`; whether there
    /// were any (none: no ticket).
    pub fn enqueue(&mut self, changes: Vec<Change>, issued: u64) -> bool {
        if changes.is_empty() {
            return false;
        }
        self.changes.extend(changes);
        self.enqueued += 1;
        if issued > 0 && self.grant_marks.back().is_none_or(|&(_, g)| g < issued) {
            self.grant_marks.push_back((self.enqueued, issued));
        }
        true
    }

    /// The ticket a caller waits for: the last one, if not durable yet.
    pub fn outstanding(&self) -> Option<u64> {
        (self.enqueued > self.written).then_some(self.enqueued)
    }

    /// Everything queued, and the ticket that completes it.
    pub fn take(&mut self) -> (Vec<Change>, u64) {
        (std::mem::take(&mut self.changes), self.enqueued)
    }

    /// Puts back changes taken but not sent, ahead of nothing else: only valid before anything
    /// else was enqueued (the caller holds the queue throughout).
    pub fn untake(&mut self, changes: Vec<Change>) {
        debug_assert!(self.changes.is_empty());
        self.changes = changes;
    }

    /// Drops what is queued (a test playing the writer).
    #[cfg(test)]
    pub fn clear_changes(&mut self) {
        self.changes.clear();
    }

    /// How `ticket` of `term` stands: `None` while pending.
    pub fn outcome(&self, term: i64, ticket: u64) -> Option<Outcome> {
        if !self.live(term) {
            Some(Outcome::Unknown)
        } else if self.written >= ticket {
            Some(Outcome::Durable)
        } else {
            None
        }
    }

    /// Keeps `answer` until `ticket` of `term` is durable, deferred at `now`; handed back with
    /// its outcome at once if that is known already.
    pub fn defer(&mut self, term: i64, ticket: u64, answer: A, now: u64) -> Option<(A, Outcome)> {
        match self.outcome(term, ticket) {
            Some(o) => Some((answer, o)),
            None => {
                self.later.entry(ticket).or_default().push((now, answer));
                None
            }
        }
    }

    /// Whether any deferred answer waits.
    pub fn has_deferred(&self) -> bool {
        !self.later.is_empty()
    }

    /// Deferred answers waiting.
    pub fn deferred(&self) -> usize {
        self.later.values().map(Vec::len).sum()
    }

    /// Everything up to `upto` is durable (in this queue's term: the caller checked it).
    pub fn written(&mut self, upto: u64) -> Written<A> {
        let mut out = Written::default();
        if upto > self.written {
            out.tickets = self.written + 1..upto + 1;
            self.written = upto;
        }
        while let Some(&(ticket, g)) = self.grant_marks.front() {
            if ticket > self.written {
                break;
            }
            out.grants = Some(g);
            self.grant_marks.pop_front();
        }
        while let Some(e) = self.later.first_entry() {
            if *e.key() > self.written {
                break;
            }
            out.ready.extend(e.remove().into_iter().map(|(_, a)| a));
        }
        out
    }

    /// [`Queue::written`] only if `term` is still journaled here and has not failed: a late
    /// acknowledgement of an ended or failed term makes nothing durable.
    pub fn written_in(&mut self, term: i64, upto: u64) -> Written<A> {
        if self.live(term) {
            self.written(upto)
        } else {
            Written::default()
        }
    }

    /// The deferred answers older than `bound` µs at `now`, each to be answered
    /// [`Outcome::TimedOut`].
    pub fn expire(&mut self, now: u64, bound: u64) -> Vec<A> {
        let mut late = Vec::new();
        for v in self.later.values_mut() {
            let (old, keep): (Vec<_>, Vec<_>) = std::mem::take(v)
                .into_iter()
                .partition(|(since, _)| now.saturating_sub(*since) >= bound);
            late.extend(old.into_iter().map(|(_, a)| a));
            *v = keep;
        }
        self.later.retain(|_, v| !v.is_empty());
        late
    }

    /// Every deferred answer, each to be answered [`Outcome::Unknown`].
    fn take_later(&mut self) -> Vec<A> {
        std::mem::take(&mut self.later)
            .into_values()
            .flatten()
            .map(|(_, a)| a)
            .collect()
    }

    /// Journals `term` from now on, empty; the previous term's deferred answers, each to be
    /// answered [`Outcome::Unknown`].
    pub fn activate(&mut self, term: i64) -> Vec<A> {
        std::mem::replace(self, Queue::new(term)).take_later()
    }

    /// Stops journaling; the deferred answers, each to be answered [`Outcome::Unknown`].
    pub fn deactivate(&mut self) -> Vec<A> {
        self.term = 0;
        self.changes.clear();
        self.take_later()
    }

    /// The writer gave up: nothing more is durable in this term; the deferred answers, each
    /// to be answered [`Outcome::Unknown`].
    pub fn fail(&mut self) -> Vec<A> {
        self.failed = true;
        self.changes.clear();
        self.take_later()
    }

    /// Asks the writer to hand off (the master stops); false when not journaling or failed
    /// (nothing to hand off).
    pub fn ask_hand_off(&mut self) -> bool {
        if self.term == 0 || self.failed {
            return false;
        }
        self.handoff = true;
        true
    }

    /// Whether a hand-off was asked for.
    pub fn hand_off_asked(&self) -> bool {
        self.handoff
    }

    /// The writer handed off.
    pub fn handed_off(&mut self) {
        self.handed_off = true;
    }

    /// How the hand-off stands: `Some(true)` done, `Some(false)` never will be (the term ended
    /// or failed), `None` pending.
    pub fn hand_off_state(&self) -> Option<bool> {
        if self.handed_off {
            Some(true)
        } else if self.term == 0 || self.failed {
            Some(false)
        } else {
            None
        }
    }

    /// Something other than changes wants the writer.
    pub fn kick(&mut self) {
        self.kicked = true;
    }

    /// Whether the writer was kicked (cleared).
    pub fn take_kick(&mut self) -> bool {
        std::mem::take(&mut self.kicked)
    }

    pub fn kicked(&self) -> bool {
        self.kicked
    }

    /// Whether the writer must not sleep: a hand-off or a kick is pending, or it failed.
    pub fn busy(&self) -> bool {
        self.failed || self.kicked || self.handoff
    }
}
