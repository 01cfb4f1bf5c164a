//! In-sync standbys in the simulation (`--ha-replication standbys`): a leader that streams
//! its entries to one to three standbys instead of writing etcd, released by their
//! acknowledgements through the real [`Pipeline`] (the least acknowledgement of the in-sync
//! set), on a network that delays entries and acknowledgements, standbys that pause and
//! links that break. Every decision about the standbys is the real writer's machine's,
//! [`Roster`]: the registrations read every [`POLL`] (links to open, links to drop, a
//! standby whose link failed tried again less and less often), who joins the set (it
//! acknowledged everything, its registration names this term's mirror), who leaves it (not
//! acknowledged the oldest entry within [`ACK_TIMEOUT`], or its link broke); when the set
//! empties the leader makes the etcd journal whole (the rebase, from its kept tail or the
//! whole state: `super::tail`). A leader that stops (SIGTERM) does what [`Roster::on_stop`]
//! says before its key goes and the next leader starts at once from the etcd journal
//! ([`Sim::stop`]). When the leader dies, an in-sync member takes over from what its mirror
//! received (the image it was sent, then its entries) and writes to etcd first what the
//! etcd journal lacks, as `Writer::rebase_at_takeover` does (`super::tail`).
//!
//! The invariants of [`super`] then say what the standbys must: an answer released by the
//! pipeline survives any failover or hand-off, because every member that could take over
//! holds it; and after every step the roster's own ([`Roster::check`]), with every member
//! of the set linked or on its way out.

use super::*;
use crate::repl::roster::{Leave, Registered, Stop};
use crate::repl::{Feed, KeptFrame, Pipeline, Roster, Tail, ToStandby};
use std::sync::Arc;

/// How long an in-sync standby may take to acknowledge (ms).
pub(super) const ACK_TIMEOUT: u64 = 100;
/// How often the leader reads the standbys' registrations (ms), as `crate::ha::STANDBY_POLL`.
pub(super) const POLL: u64 = 200;

/// The leader's member id in the roster (the standbys are named by their index).
const LEADER: &str = "leader";

fn name(i: usize) -> String {
    i.to_string()
}

/// One standby as the leader's stream reaches it.
#[derive(Debug, Default)]
pub(super) struct Standby {
    /// Frames in flight to it, in order: (arrives at, frame, its bytes as sent). Entries, and
    /// where the etcd journal is whole (`ToStandby::Base`).
    inbox: VecDeque<(u64, ToStandby, Vec<u8>)>,
    /// Acknowledgements in flight back: (arrives at, seq).
    acks: VecDeque<(u64, u64)>,
    /// Its mirror's feed, the real machine: what it accepts and acknowledges, and the
    /// changes received since the stream started (pending: the takeover applies them).
    pub(super) feed: Feed,
    /// The leader's connection.
    conn: u64,
    /// The leader links it and the link is alive (it left the set, or its link broke: the
    /// link was dropped with it).
    linked: bool,
    /// Stopped (SIGSTOP) until this time: it receives and acknowledges nothing before.
    paused_until: u64,
    /// Linked during the term (while others were in sync): its image is after where the
    /// etcd journal is whole, and the run before it came with it (`ToStandby::Run`).
    pub(super) relinked: bool,
}

/// A leader's stream to its standbys.
pub(super) struct Streaming {
    pub(super) pipe: Pipeline,
    /// The last entry sent (the etcd journal's numbering: entries streamed take the numbers
    /// after where it was whole, as the real writer's do).
    pub(super) seq: u64,
    pub(super) standbys: Vec<Standby>,
    /// The writer's machine: links, registrations, retries, the in-sync set (members named
    /// by their index into `standbys`).
    pub(super) roster: Roster,
    /// Entries of `pending` already sent, from its front.
    pub(super) sent: usize,
    /// The entries the etcd journal lacks, as the real writer keeps them ([`Tail`]: a run
    /// from where it is whole, dropped past its cap, started again by a background snapshot).
    pub(super) tail: Tail,
}

impl Streaming {
    /// Entries of `pending` already sent.
    pub(super) fn sent(&self) -> usize {
        self.sent
    }

    /// The stream of the leader of `term` to `n` standbys, each linked (hello, and an image
    /// of the leader's state, which is the etcd journal as it is, whole up to entry `base`:
    /// nothing streamed yet) and in sync; the leader's tail (runs of at most `caps.0` bytes)
    /// and the standbys' (`caps.1`) start at `base`, every `every` ms at most after a run
    /// outgrew its cap.
    pub(super) fn new(
        n: usize,
        term: i64,
        base: u64,
        image: &[Change],
        (cap, mirror_cap, every): (usize, usize, u64),
        now: u64,
    ) -> Result<Streaming, String> {
        let mut standbys = Vec::with_capacity(n);
        let mut roster = Roster::new(LEADER, term, us(POLL));
        for i in 0..n {
            let mut sb = Standby {
                linked: true,
                feed: Feed::new(mirror_cap),
                ..Standby::default()
            };
            sb.conn = sb.feed.hello(term)?;
            sb.feed.on_frame(
                sb.conn,
                ToStandby::Image {
                    seq: base,
                    changes: image.to_vec(),
                    last: true,
                },
                Vec::new(),
                us(now),
            )?;
            standbys.push(sb);
            roster.linked(&name(i), &name(i), true, true, base);
        }
        let mut s = Streaming {
            pipe: Pipeline::default(),
            seq: base,
            standbys,
            roster,
            sent: 0,
            tail: Tail::new(cap, std::time::Duration::from_millis(every), us(now)),
        };
        // (Their registrations name this term's mirror: they join at once.)
        let polled = s.roster.on_registrations(us(now), s.registrations(term));
        if !polled.open.is_empty() || !polled.gone.is_empty() {
            return Err(format!("the roster would change links it has: {polled:?}"));
        }
        match s.roster.joining(base) {
            Some(j) if j.members.len() == n && j.first => {
                s.roster.joined(&j);
                // The set is no longer empty: everything up to here is in the etcd journal,
                // and the tails start here (the standbys told so, as the writer's `promote`).
                s.tail.start(base, us(now));
                for sb in &mut s.standbys {
                    sb.feed.on_frame(
                        sb.conn,
                        ToStandby::Base {
                            seq: base,
                            written: true,
                        },
                        Vec::new(),
                        us(now),
                    )?;
                }
            }
            j => {
                return Err(format!(
                    "{n} standbys linked at entry {base}, joining: {j:?}"
                ))
            }
        }
        Ok(s)
    }

    /// Sends `m` (`raw` its bytes) to every linked standby, after what is in flight to it
    /// (ordered per link, as TCP), each after its delay.
    pub(super) fn send(&mut self, m: &ToStandby, raw: &[u8], delays: &[u64], now: u64) {
        for (sb, d) in self
            .standbys
            .iter_mut()
            .zip(delays)
            .filter(|(sb, _)| sb.linked)
        {
            let at = sb.inbox.back().map_or(now + d, |&(t, _, _)| t.max(now + d));
            sb.inbox.push_back((at, m.clone(), raw.to_vec()));
        }
    }

    /// The standbys' registrations as etcd holds them: each at its address (its index),
    /// naming the mirror it holds complete.
    fn registrations(&self, term: i64) -> BTreeMap<String, Registered> {
        self.standbys
            .iter()
            .enumerate()
            .map(|(i, sb)| {
                let mirror = (sb.feed.leads_from() && sb.feed.term == term).then_some(term);
                (
                    name(i),
                    Registered {
                        addr: name(i),
                        mirror,
                        runs: true,
                        grants: true,
                    },
                )
            })
            .collect()
    }

    /// The in-sync members' indices.
    pub(super) fn members(&self) -> Vec<usize> {
        self.roster
            .insync()
            .iter()
            .filter_map(|m| m.parse().ok())
            .collect()
    }

    /// The roster's invariants after entry `self.seq`, and the simulation's agreement with
    /// it: a standby the simulation delivers to is linked in the roster.
    pub(super) fn check(&self) -> Result<(), String> {
        self.roster.check(self.seq)?;
        for (i, sb) in self.standbys.iter().enumerate() {
            if sb.linked && self.roster.link(&name(i)).is_none() {
                return Err(format!("standby {i} is fed without a link in the roster"));
            }
        }
        Ok(())
    }
}

/// Microseconds on the pipeline's clock from the simulation's milliseconds.
pub(super) fn us(ms: u64) -> u64 {
    ms * 1000
}

impl Sim {
    /// A delay on the network between the leader and a standby: most are short, a few long
    /// enough to make the standby late.
    pub(super) fn link_delay(&mut self) -> u64 {
        if self.rng.random_bool(0.95) {
            self.rng.random_range(0..5)
        } else {
            self.rng.random_range(0..3 * ACK_TIMEOUT)
        }
    }

    /// The writer streams what is queued and not yet sent, one entry per collection, to every
    /// standby (in sync or not: a late one is still linked until it leaves the set).
    pub(super) fn stream(&mut self) {
        let Some(s) = self.streaming.as_ref() else {
            return;
        };
        let (from, to) = (s.sent, self.pending.len());
        for i in from..to {
            let (changes, ticket) = (self.pending[i].changes.clone(), self.pending[i].ticket);
            let delays: Vec<u64> = (0..self.streaming.as_ref().map_or(0, |s| s.standbys.len()))
                .map(|_| self.link_delay())
                .collect();
            let now = self.now;
            let Some(s) = self.streaming.as_mut() else {
                return;
            };
            // (The entry takes the etcd journal's next number, as the real writer's
            // `next_seq`: a rebase from the tail writes it there.)
            s.seq += 1;
            if let Some(w) = self.journal.writer.as_mut() {
                w.set_seq(s.seq);
            }
            s.pipe.push(s.seq, ticket, us(now));
            let entry = ToStandby::Entry {
                seq: s.seq,
                changes,
            };
            let frame = Arc::new(crate::ha::sync::encode_frame(&entry).unwrap_or_default());
            s.send(&entry, &frame, &delays, now);
            s.tail.push(s.seq, &frame);
            s.sent += 1;
        }
    }

    /// When the next event of the stream comes: an entry or an acknowledgement arriving, or
    /// the oldest entry becoming late.
    pub(super) fn stream_next(&self) -> Option<u64> {
        let s = self.streaming.as_ref()?;
        let arrivals = s.standbys.iter().flat_map(|sb| {
            sb.inbox
                .front()
                .map(|e| e.0.max(sb.paused_until))
                .into_iter()
                .chain(sb.acks.front().map(|a| a.0))
        });
        let late = s.pipe.late_at(us(ACK_TIMEOUT)).map(|t| t.div_ceil(1000));
        arrivals.chain(late).min()
    }

    /// Everything of the stream due at `t`: standbys apply what arrived and acknowledge it,
    /// acknowledgements reach the leader, the pipeline releases what every member has, late
    /// members leave the set (and an empty set is rebased into etcd).
    pub(super) fn stream_events(&mut self, step: usize, t: u64) -> Result<(), Failure> {
        if self.streaming.is_none() {
            return Ok(());
        }
        let delays: Vec<u64> = (0..8).map(|_| self.link_delay()).collect();
        let Some(s) = self.streaming.as_mut() else {
            return Ok(());
        };
        let mut refused = None;
        for (i, sb) in s.standbys.iter_mut().enumerate() {
            while sb
                .inbox
                .front()
                .is_some_and(|e| e.0.max(sb.paused_until) <= t)
            {
                let Some((_, m, raw)) = sb.inbox.pop_front() else {
                    break;
                };
                let (seq, entry) = match &m {
                    ToStandby::Entry { seq, .. } => (*seq, true),
                    _ => (0, false),
                };
                match sb.feed.on_frame(sb.conn, m, raw, us(t)) {
                    Ok(None) if !entry => {}
                    Ok(Some(ack)) => {
                        let at = sb
                            .acks
                            .back()
                            .map_or(t + delays[i % 8], |&(a, _)| a.max(t + delays[i % 8]));
                        sb.acks.push_back((at, ack));
                    }
                    Ok(None) => {
                        refused = Some(format!("standby {i} did not acknowledge entry {seq}"))
                    }
                    Err(e) => refused = Some(format!("standby {i} refused entry {seq}: {e}")),
                }
            }
            while sb.acks.front().is_some_and(|a| a.0 <= t) {
                if let Some((_, seq)) = sb.acks.pop_front() {
                    s.roster.observe(&name(i), seq, false);
                }
            }
        }
        if let Some(what) = refused {
            return Err(self.fail(step, what));
        }
        // Linked standbys that hold everything join the set (the writer's rule).
        self.join();
        self.release(step)?;
        let Some(s) = self.streaming.as_mut() else {
            return Ok(());
        };
        if let Some(late) = s.pipe.late(us(t), us(ACK_TIMEOUT)) {
            let gone = s.roster.failing(Some(late));
            self.note(format!(
                "standbys {gone:?} did not acknowledge entry {late} within {ACK_TIMEOUT} ms"
            ));
            self.leave(step, &gone)?;
        }
        Ok(())
    }

    /// Standbys that hold everything join the set, as the roster decides.
    fn join(&mut self) {
        let Some(s) = self.streaming.as_mut() else {
            return;
        };
        if let Some(j) = s.roster.joining(s.seq) {
            s.roster.joined(&j);
            self.counts.members_joined += j.ready.len() as u64;
            self.note(format!(
                "standbys {:?} hold every entry: they join the in-sync set",
                j.ready
            ));
        }
    }

    /// `gone` leave: their links go (what was in flight to them is lost), and the set is
    /// what the roster says (an empty one rebased into etcd).
    fn leave(&mut self, step: usize, gone: &[String]) -> Result<(), Failure> {
        let Some(s) = self.streaming.as_mut() else {
            return Ok(());
        };
        let leave = s.roster.leave(gone);
        for m in gone {
            if let Some(sb) = m.parse::<usize>().ok().and_then(|i| s.standbys.get_mut(i)) {
                (sb.linked, sb.inbox, sb.acks) = (false, VecDeque::new(), VecDeque::new());
            }
        }
        match leave {
            Leave::Unchanged => Ok(()),
            Leave::Rest(rest) => {
                s.roster.set_insync(rest);
                self.counts.members_dropped += gone.len() as u64;
                self.note(format!("standbys {gone:?} leave the in-sync set"));
                self.release(step)
            }
            Leave::Rebase => {
                self.counts.members_dropped += gone.len() as u64;
                self.note(format!(
                    "standbys {gone:?} leave the in-sync set, empty now"
                ));
                self.rebase(step)
            }
        }
    }

    /// The writer reads the standbys' registrations when the roster says so: broken links
    /// and their members go, the standbys not linked are linked (an image of the leader's
    /// state after its last entry, then the entries after it), some of those links failing
    /// (tried again as the roster says).
    pub(super) fn poll_standbys(&mut self, step: usize) -> Result<(), Failure> {
        let (now, term) = (self.now, self.term);
        let Some(s) = self.streaming.as_mut() else {
            return Ok(());
        };
        if !s.roster.poll(us(now)) {
            return Ok(());
        }
        let regs = s.registrations(term);
        let polled = s.roster.on_registrations(us(now), regs);
        if !polled.gone.is_empty() {
            self.note(format!("standbys {:?}: their links went", polled.gone));
            self.leave(step, &polled.gone)?;
        }
        for (m, _) in polled.open {
            if let Ok(i) = m.parse::<usize>() {
                self.link(i);
            }
        }
        Ok(())
    }

    /// The pipeline releases what every in-sync member acknowledged: those entries' answers
    /// go out.
    fn release(&mut self, step: usize) -> Result<(), Failure> {
        let now = self.now;
        let Some(s) = self.streaming.as_mut() else {
            return Ok(());
        };
        let r = &s.roster;
        let min = r
            .insync()
            .iter()
            .map(|m| r.link(m).map_or(0, |l| l.acked))
            .min();
        let Some(r) = s.pipe.release(min, us(now)) else {
            return Ok(());
        };
        while self.pending.front().is_some_and(|e| e.ticket <= r.upto) {
            let Some(e) = self.pending.pop_front() else {
                break;
            };
            if let Some(s) = self.streaming.as_mut() {
                s.sent = s.sent.saturating_sub(1);
            }
            self.durable(step, e, false)?;
        }
        Ok(())
    }

    /// The writer links standby `i` (the roster said so): it commits what is queued, sends
    /// it an image of the state after its last entry, then every entry after it; it joins the
    /// set once it acknowledged everything ([`Roster::joining`]). One link in five fails to
    /// connect (tried again as the roster says).
    fn link(&mut self, i: usize) {
        let now = self.now;
        if self.rng.random_bool(0.2) {
            if let Some(s) = self.streaming.as_mut() {
                let after = s.roster.link_failed(&name(i), &name(i), us(now));
                self.counts.link_failures += 1;
                self.note(format!(
                    "standby {i} cannot be reached: tried again after {} ms",
                    after / 1000
                ));
            }
            return;
        }
        self.stream();
        let (term, image) = match self.leader.as_ref() {
            Some(l) => (l.term, l.st.image(now)),
            None => return,
        };
        let Some(s) = self.streaming.as_mut() else {
            return;
        };
        let seq = s.seq;
        // (Its image is after where the etcd journal is whole: the leader's run up to the
        // image follows it, so that it keeps what the others keep: `ToStandby::Run`.)
        let run = s.tail.upto(seq).map(|(base, frames)| ToStandby::Run {
            base,
            frames: frames
                .into_iter()
                .map(|f| KeptFrame {
                    first: f.first,
                    last: f.last,
                    frame: bytes::Bytes::from(f.frame.to_vec()),
                })
                .collect(),
        });
        let sb = &mut s.standbys[i];
        let linked = sb.feed.hello(term).and_then(|conn| {
            sb.feed.on_frame(
                conn,
                ToStandby::Image {
                    seq,
                    changes: image,
                    last: true,
                },
                Vec::new(),
                us(now),
            )?;
            if let Some(run) = run {
                sb.feed.on_frame(conn, run, Vec::new(), us(now))?;
            }
            Ok(conn)
        });
        match linked {
            Ok(conn) => {
                (sb.conn, sb.linked, sb.relinked, sb.inbox, sb.acks) =
                    (conn, true, true, VecDeque::new(), VecDeque::new());
                s.roster.linked(&name(i), &name(i), true, true, seq);
                // (It acknowledges its image as it takes it.)
                s.roster.observe(&name(i), seq, false);
                self.counts.relinks += 1;
                self.note(format!("standby {i} links with an image at entry {seq}"));
            }
            Err(e) => self.note(format!("standby {i} refused the link: {e}")),
        }
    }

    /// The leader stops (SIGTERM): what the roster says first ([`Roster::on_stop`]: the
    /// etcd journal made whole while standbys are in sync), every request answered, then it
    /// steps down and the next leader starts at once, from the etcd journal.
    pub(super) fn stop(&mut self, step: usize) -> Result<(), Failure> {
        if self.leader.is_none() {
            return Ok(());
        }
        let stop = self
            .streaming
            .as_ref()
            .map_or(Stop::Step, |s| s.roster.on_stop());
        self.note(format!(
            "leader of term {} stops (SIGTERM): {stop:?}",
            self.term
        ));
        match stop {
            Stop::RebaseThenStep => {
                self.stream();
                self.rebase(step)?;
                if self.leader.is_none() {
                    return Ok(()); // (the writer gave up: fenced, a crash to its clients)
                }
            }
            Stop::Step => {
                // (What is queued is committed first, as the writer's last turn does.)
                self.streaming = None;
                while let Some(e) = self.pending.pop_front() {
                    self.durable(step, e, true)?;
                }
                self.check_snapshot(step, false)?;
                if self.leader.is_none() {
                    return Ok(());
                }
            }
        }
        if !self.pending.is_empty() {
            return Err(self.fail(
                step,
                format!(
                    "a stopping leader left {} requests unanswered",
                    self.pending.len()
                ),
            ));
        }
        // (A snapshot still being written is left for the next leader to collect.)
        self.journal.snapshot_dropped();
        self.leader = None;
        self.streaming = None;
        self.down_until = self.now;
        self.counts.hand_offs += 1;
        Ok(())
    }

    /// A standby stops (SIGSTOP) for a while.
    pub(super) fn pause_standby(&mut self) {
        let n = self.streaming.as_ref().map_or(0, |s| s.standbys.len());
        if n == 0 {
            return;
        }
        let i = self.rng.random_range(0..n);
        let until = self.now + self.rng.random_range(ACK_TIMEOUT / 2..4 * ACK_TIMEOUT);
        let breaks = self.rng.random_bool(0.3);
        if let Some(s) = self.streaming.as_mut() {
            let sb = &mut s.standbys[i];
            sb.paused_until = until;
            if breaks && sb.linked {
                // Its link breaks meanwhile (a write timed out): what was in flight is lost,
                // and the leader's link says so.
                (sb.linked, sb.inbox, sb.acks) = (false, VecDeque::new(), VecDeque::new());
                s.roster.observe(&name(i), 0, true);
                self.counts.link_breaks += 1;
            }
        }
        self.note(format!(
            "standby {i} pauses until {until}{}",
            if breaks { ", its link broken" } else { "" }
        ));
    }
}
