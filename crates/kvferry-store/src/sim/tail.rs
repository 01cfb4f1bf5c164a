//! The entries the etcd journal lacks while standbys are in sync, in the simulation: the
//! leader's kept tail and the standbys' ([`crate::repl::Tail`], [`crate::repl::MirrorTail`],
//! the real machines, fed the real frames), and what the writer does with them: a rebase
//! when the in-sync set empties or the leader stops (the kept run, if it reaches the last
//! entry and fits log values, else the whole state: [`Roster::rebase_from`]); a standby's
//! takeover (the entries it kept after where etcd's journal ends, else its whole state:
//! [`crate::repl::MirrorTail::takeover`]), a standby linked while others were in sync
//! keeping the run it was sent with its image (`ToStandby::Run`); and the background
//! snapshot that starts a new run once one outgrew its cap ([`crate::repl::Tail::refresh_due`],
//! [`crate::repl::Tail::refreshed`], as `Writer::refresh_base`), given up when an in-sync
//! standby is late meanwhile. The invariants of [`super`] then say whether what they wrote
//! is whole: every acknowledged put readable after any failover, and etcd's size bounded.

use super::standbys::{us, ACK_TIMEOUT};
use super::*;
use crate::ha::log::{stored_from, tail_log_values};
use crate::repl::roster::{RebaseFrom, Roster};
use crate::repl::{MirrorTail, Takeover, ToStandby};

impl Sim {
    /// The in-sync set emptied: the etcd journal is made whole, as the real writer's rebase
    /// decides ([`Roster::rebase_from`]): from its kept run of the entries streamed, when it
    /// reaches the last one and each fits a log value (those go to etcd's log), else with
    /// the whole state (a snapshot after the next entry); then what is queued, and from now
    /// on the journal is etcd's.
    pub(super) fn rebase(&mut self, step: usize) -> Result<(), Failure> {
        let Some(mut s) = self.streaming.take() else {
            return Ok(());
        };
        let run = s.tail.take(s.seq);
        let mut values = None;
        let from = Roster::rebase_from(run.as_ref().map(crate::repl::Run::last), s.seq, || {
            values = run
                .as_ref()
                .and_then(|r| tail_log_values(etcd::PREFIX, &r.frames));
            values.is_some()
        });
        let whole = match (from, values) {
            (RebaseFrom::Tail, Some(values)) => {
                self.note(format!(
                    "no standby in sync: the {} entries after {} go to etcd's log from the kept tail",
                    values.len(),
                    run.as_ref().map_or(0, |r| r.base)
                ));
                self.counts.tail_rebases += 1;
                self.journal.rebase_values(values);
                false
            }
            _ => {
                self.note(format!(
                    "no standby in sync, no whole tail kept: the state goes to etcd whole after entry {}",
                    s.seq
                ));
                self.counts.whole_rebases += 1;
                true
            }
        };
        if whole {
            // (Nothing is committed before the snapshot's head: it holds every change queued,
            // whose answers go out once it is written.)
            let image = match self.leader.as_ref() {
                Some(l) => etcd::fixed_order(l.st.image(self.now)),
                None => return Ok(()),
            };
            if let Some(w) = self.journal.writer.as_mut() {
                w.set_seq(s.seq + 1);
            }
            if !self.journal.snapshot(&image, None) {
                self.streaming = Some(s);
                self.writer_gave_up();
                return Ok(());
            }
            self.journal.unchecked = 0;
            self.counts.snapshots += 1;
            while let Some(e) = self.pending.pop_front() {
                self.durable(step, e, false)?;
            }
            return self.check_snapshot(step, false);
        }
        if self.journal.gave_up {
            // (Nothing is answered: the leader fences itself with what it held.)
            self.streaming = Some(s);
            self.writer_gave_up();
            return Ok(());
        }
        // (The first `sent` are in the tail already.)
        for i in 0.. {
            let Some(e) = self.pending.pop_front() else {
                break;
            };
            self.durable(step, e, i >= s.sent)?;
        }
        self.check_snapshot(step, false)
    }

    /// The leader died while streaming: an in-sync member takes over from its mirror, and
    /// makes the etcd journal whole first as the tail's machine decides
    /// ([`crate::repl::MirrorTail::takeover`], as `Writer::rebase_at_takeover`): the entries
    /// it kept after where the journal ends, to its log, or its whole state (the image it was
    /// sent and every entry since) as a snapshot. (Whatever else is in flight to it is lost
    /// with the leader.)
    pub(super) fn take_over_from_standby(&mut self) {
        let Some(mut s) = self.streaming.take() else {
            return;
        };
        let members = s.members();
        if members.is_empty() {
            return;
        }
        let m = members[self.rng.random_range(0..members.len())];
        let feed = &mut s.standbys[m].feed;
        let Some((seq, tail)) = feed.take(self.term) else {
            self.note(format!(
                "standby {m} holds no complete mirror of term {}",
                self.term
            ));
            return;
        };
        let whole: Vec<Change> = std::mem::take(&mut feed.pending)
            .into_iter()
            .flat_map(|(_, c)| c)
            .collect();
        self.counts.standby_takeovers += 1;
        let stored = match stored_from(&self.journal.etcd, etcd::PREFIX) {
            Ok(st) => st.seq,
            Err(e) => {
                self.note(format!("the standby could not read etcd's journal: {e}"));
                return;
            }
        };
        let mut values = None;
        let plan = MirrorTail::takeover(Some(&tail), stored, seq, |frames| {
            values = tail_log_values(etcd::PREFIX, frames);
            values.is_some()
        });
        self.note(format!(
            "standby {m} takes over at entry {seq} of {} streamed, etcd's journal at {stored}: {}",
            s.seq,
            match &plan {
                Takeover::Tail(f) => format!("the {} entries it kept go to etcd's log", f.len()),
                Takeover::Whole { at } => format!("its whole state goes to etcd after entry {at}"),
            }
        ));
        let r = match (plan, values) {
            (Takeover::Tail(frames), Some(values)) => {
                self.counts.tail_takeovers += 1;
                if s.standbys[m].relinked && !frames.is_empty() {
                    self.counts.joined_tail_takeovers += 1;
                }
                self.journal.take_over(None, values, seq)
            }
            (Takeover::Tail(_), None) => {
                self.journal
                    .take_over(Some(whole), Vec::new(), seq.max(stored))
            }
            (Takeover::Whole { at }, _) => self.journal.take_over(Some(whole), Vec::new(), at),
        };
        match r {
            Ok(()) => self.standby_check_snapshot(),
            Err(e) => self.note(format!("the standby could not read etcd's journal: {e}")),
        }
    }

    /// While standbys are in sync, the writer's background snapshot when the leader's tail
    /// says one is due (its run outgrew its cap, at least `every` since it started), as
    /// `Writer::refresh_base`: what is queued is streamed, the image's position starts a new
    /// run (the standbys told: `ToStandby::Base`, not written), the snapshot goes to etcd
    /// (given up when an in-sync standby is late, or its link broke; a leader may die between
    /// its chunks), and the tail's machine says what becomes of the run and whether the
    /// standbys are told the journal is whole there ([`crate::repl::Tail::refreshed`]).
    pub(super) fn refresh_base(&mut self) {
        let now = self.now;
        if !self
            .streaming
            .as_ref()
            .is_some_and(|s| s.tail.refresh_due(us(now)))
        {
            return;
        }
        self.stream();
        let Some(image) = self
            .leader
            .as_ref()
            .map(|l| etcd::fixed_order(l.st.image(now)))
        else {
            return;
        };
        let n = self.streaming.as_ref().map_or(0, |s| s.standbys.len());
        let delays: Vec<u64> = (0..n).map(|_| self.link_delay()).collect();
        let crash = self.weights[8] > 0 && self.rng.random_bool(0.05);
        let cut = crash.then(|| self.rng.random_range(0..4usize));
        let Some(s) = self.streaming.as_mut() else {
            return;
        };
        let at = s.seq;
        s.tail.want_next();
        if s.tail.begin(at, us(now)) {
            let base = ToStandby::Base {
                seq: at,
                written: false,
            };
            s.send(&base, &[], &delays, now);
        }
        // (Given up when an in-sync standby is late or cut off: now, or while its chunks are
        // written, which takes time the simulation does not step through: one in five.)
        let late = s.pipe.late(us(now), us(ACK_TIMEOUT));
        let late_meanwhile = self.rng.random_bool(0.2);
        let attempt = s.roster.failing(late).is_empty() && !late_meanwhile;
        let cut = cut.filter(|_| attempt);
        let written = attempt && self.journal.snapshot(&image, cut);
        if self.journal.gave_up {
            self.writer_gave_up();
            return;
        }
        if cut.is_some() {
            self.counts.snapshots_cut += 1;
            self.note("the leader dies writing a background snapshot, before its head".to_string());
            self.crash();
            return;
        }
        let Some(s) = self.streaming.as_mut() else {
            return;
        };
        if s.tail.refreshed(written) {
            let base = ToStandby::Base {
                seq: at,
                written: true,
            };
            s.send(&base, &[], &delays, now);
        }
        if written {
            self.counts.refreshes += 1;
            self.counts.snapshots += 1;
        } else {
            self.counts.refreshes_given_up += 1;
        }
        self.note(format!(
            "background snapshot at entry {at} while standbys are in sync: {}",
            if written {
                "written, a new run starts there"
            } else {
                "given up"
            }
        ));
    }
}
