//! In-sync standbys in the simulation (`--ha-replication standbys`): a leader that streams
//! its entries to one to three standbys instead of writing etcd, released by their
//! acknowledgements through the real [`Pipeline`] (the least acknowledgement of the in-sync
//! set), on a network that delays entries and acknowledgements and standbys that pause. A
//! member that has not acknowledged the oldest entry within [`ACK_TIMEOUT`] leaves the set;
//! when the set empties the leader makes the etcd journal whole (the rebase: every entry
//! streamed, then what is queued). When the leader dies, an in-sync member takes over from
//! what its mirror received (the etcd journal at the stream's start, then its entries) and
//! writes that to etcd first, as `Writer::rebase_at_takeover` does. A standby that left the
//! set may link again (an image of the leader's state, then the entries after it) and join
//! the set once it holds everything (`repl::members::ready`); taking over, it writes its
//! image as etcd's snapshot.
//!
//! The invariants of [`super`] then say what the standbys must: an answer released by the
//! pipeline survives any failover, because every member that could take over holds it.

use super::*;
use crate::repl::members::{self, LinkView};
use crate::repl::{Feed, Pipeline, ToStandby};

/// How long an in-sync standby may take to acknowledge (ms).
pub(super) const ACK_TIMEOUT: u64 = 100;

/// One standby as the leader's stream reaches it.
#[derive(Debug, Default)]
pub(super) struct Standby {
    /// Entries in flight to it: (arrives at, seq, changes).
    inbox: VecDeque<(u64, u64, Vec<Change>)>,
    /// Acknowledgements in flight back: (arrives at, seq).
    acks: VecDeque<(u64, u64)>,
    /// Its mirror's feed, the real machine: what it accepts and acknowledges, and the
    /// changes received since the stream started (pending: the takeover applies them).
    feed: Feed,
    /// The leader's connection.
    conn: u64,
    /// The leader links it (it left the set: its link was dropped with it).
    linked: bool,
    /// Linked again during the term: its mirror starts from an image of the leader's state
    /// after entry `image_seq` (the first pending changes), not from the etcd journal.
    image: Option<u64>,
    /// The last entry the leader knows it acknowledged.
    acked: u64,
    /// Stopped (SIGSTOP) until this time: it receives and acknowledges nothing before.
    paused_until: u64,
}

/// A leader's stream to its standbys.
pub(super) struct Streaming {
    pipe: Pipeline,
    /// The last entry sent.
    seq: u64,
    standbys: Vec<Standby>,
    /// The in-sync set (indices into `standbys`).
    members: Vec<usize>,
    /// Entries of `pending` already sent, from its front.
    sent: usize,
    /// Every entry sent, in order (what the etcd journal lacks: the leader's tail).
    tail: Vec<Vec<Change>>,
}

impl Streaming {
    /// Entries of `pending` already sent.
    pub(super) fn sent(&self) -> usize {
        self.sent
    }

    /// The stream of the leader of `term` to `n` standbys, each linked (hello, and an image
    /// that is the etcd journal as it is: nothing streamed yet) and in sync.
    pub(super) fn new(n: usize, term: i64) -> Result<Streaming, String> {
        let mut standbys = Vec::with_capacity(n);
        for _ in 0..n {
            let mut sb = Standby {
                linked: true,
                ..Standby::default()
            };
            sb.conn = sb.feed.hello(term)?;
            sb.feed.on_frame(
                sb.conn,
                ToStandby::Image {
                    seq: 0,
                    changes: Vec::new(),
                    last: true,
                },
                Vec::new(),
                0,
            )?;
            standbys.push(sb);
        }
        Ok(Streaming {
            pipe: Pipeline::default(),
            seq: 0,
            standbys,
            members: (0..n).collect(),
            sent: 0,
            tail: Vec::new(),
        })
    }
}

/// Microseconds on the pipeline's clock from the simulation's milliseconds.
fn us(ms: u64) -> u64 {
    ms * 1000
}

impl Sim {
    /// A delay on the network between the leader and a standby: most are short, a few long
    /// enough to make the standby late.
    fn link_delay(&mut self) -> u64 {
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
            s.seq += 1;
            s.pipe.push(s.seq, ticket, us(now));
            for (sb, d) in s
                .standbys
                .iter_mut()
                .zip(delays)
                .filter(|(sb, _)| sb.linked)
            {
                // (Ordered per link, as TCP: never before the entry ahead of it.)
                let at = sb.inbox.back().map_or(now + d, |&(t, _, _)| t.max(now + d));
                sb.inbox.push_back((at, s.seq, changes.clone()));
            }
            s.tail.push(changes);
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
                let Some((_, seq, changes)) = sb.inbox.pop_front() else {
                    break;
                };
                match sb.feed.on_frame(
                    sb.conn,
                    ToStandby::Entry { seq, changes },
                    Vec::new(),
                    us(t),
                ) {
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
                    sb.acked = sb.acked.max(seq);
                }
            }
        }
        if let Some(what) = refused {
            return Err(self.fail(step, what));
        }
        // Linked standbys that hold everything join the set (the writer's rule).
        let term = self.term;
        if let Some(s) = self.streaming.as_mut() {
            let joining: Vec<usize> = (0..s.standbys.len())
                .filter(|i| !s.members.contains(i))
                .filter(|&i| {
                    let sb = &s.standbys[i];
                    sb.linked
                        && members::ready(
                            LinkView {
                                dead: false,
                                acked: sb.acked,
                                image_seq: sb.image.unwrap_or(0),
                                grants: true,
                            },
                            s.seq,
                            term,
                            Some(term),
                        )
                })
                .collect();
            if !joining.is_empty() {
                s.members.extend(&joining);
                self.counts.members_joined += joining.len() as u64;
                self.note(format!(
                    "standbys {joining:?} hold every entry: they join the in-sync set"
                ));
            }
        }
        self.release(step)?;
        let Some(s) = self.streaming.as_mut() else {
            return Ok(());
        };
        if let Some(late) = s.pipe.late(us(t), us(ACK_TIMEOUT)) {
            // (The writer's rule: `repl::members::failing`, members named by their index.)
            let names: Vec<String> = s.members.iter().map(usize::to_string).collect();
            let view = |m: &str| {
                m.parse::<usize>()
                    .ok()
                    .and_then(|i| s.standbys.get(i))
                    .map(|sb| LinkView {
                        dead: false,
                        acked: sb.acked,
                        image_seq: 0,
                        grants: true,
                    })
            };
            let gone: Vec<usize> = members::failing(&names, view, Some(late))
                .iter()
                .filter_map(|m| m.parse().ok())
                .collect();
            s.members.retain(|m| !gone.contains(m));
            // (Its link goes with it: what was in flight to it is lost.)
            for &m in &gone {
                let sb = &mut s.standbys[m];
                (sb.linked, sb.inbox, sb.acks) = (false, VecDeque::new(), VecDeque::new());
            }
            self.counts.members_dropped += gone.len() as u64;
            self.note(format!("standbys {gone:?} did not acknowledge entry {late} within {ACK_TIMEOUT} ms: they leave the in-sync set"));
            if self
                .streaming
                .as_ref()
                .is_some_and(|s| s.members.is_empty())
            {
                self.rebase(step)?;
            } else {
                self.release(step)?;
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
        let min = s.members.iter().map(|&m| s.standbys[m].acked).min();
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

    /// The in-sync set emptied: the entries streamed go to etcd's log (the leader's tail),
    /// then what is queued, and from now on the journal is etcd's.
    pub(super) fn rebase(&mut self, step: usize) -> Result<(), Failure> {
        let Some(s) = self.streaming.take() else {
            return Ok(());
        };
        self.note(format!(
            "no standby in sync: the {} entries streamed go to etcd's log",
            s.tail.len()
        ));
        let tail: Vec<Vec<Change>> = s.tail.into_iter().filter(|c| !c.is_empty()).collect();
        self.journal.rebase_entries(&tail);
        // (The first `sent` are in the tail already.)
        for i in 0.. {
            let Some(e) = self.pending.pop_front() else {
                break;
            };
            self.durable(step, e, i >= s.sent)?;
        }
        self.check_snapshot(step, false)
    }

    /// The leader died while streaming: an in-sync member takes over from its mirror, which it
    /// writes to etcd's log first. (Whatever else is in flight to it is lost with the leader.)
    pub(super) fn take_over_from_standby(&mut self) {
        let Some(mut s) = self.streaming.take() else {
            return;
        };
        if s.members.is_empty() {
            return;
        }
        let m = s.members[self.rng.random_range(0..s.members.len())];
        let feed = &mut s.standbys[m].feed;
        let Some((seq, _)) = feed.take(self.term) else {
            self.note(format!(
                "standby {m} holds no complete mirror of term {}",
                self.term
            ));
            return;
        };
        let mut mirror: Vec<Vec<Change>> = std::mem::take(&mut feed.pending)
            .into_iter()
            .map(|(_, c)| c)
            .collect();
        self.counts.standby_takeovers += 1;
        self.note(format!(
            "standby {m} takes over at entry {seq} of {} streamed",
            s.seq
        ));
        // Its mirror is an image and the entries after it, written to etcd as a snapshot (the
        // takeover's rebase of a whole state), or the entries after where etcd's journal is
        // whole, written to its log.
        let image = match s.standbys[m].image {
            Some(_) if !mirror.is_empty() => Some(mirror.remove(0)),
            Some(_) => Some(Vec::new()),
            None => None,
        };
        let entries: Vec<Vec<Change>> = mirror.into_iter().filter(|c| !c.is_empty()).collect();
        match self.journal.take_over(image, &entries) {
            Ok(()) => self.standby_check_snapshot(),
            Err(e) => self.note(format!("the standby could not read etcd's journal: {e}")),
        }
    }

    /// A standby that left the set links again: the writer commits what is queued, sends it
    /// an image of the state after its last entry, then every entry after it; it joins the
    /// set once it acknowledged everything ([`members::ready`]).
    pub(super) fn relink_standby(&mut self) {
        let out: Vec<usize> = match self.streaming.as_ref() {
            Some(s) => (0..s.standbys.len())
                .filter(|i| !s.members.contains(i))
                .collect(),
            None => return,
        };
        if out.is_empty() || self.leader.is_none() {
            return;
        }
        let i = out[self.rng.random_range(0..out.len())];
        self.stream();
        let now = self.now;
        let (term, image) = match self.leader.as_ref() {
            Some(l) => (l.term, l.st.image(now)),
            None => return,
        };
        let Some(s) = self.streaming.as_mut() else {
            return;
        };
        let seq = s.seq;
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
            Ok(conn)
        });
        match linked {
            Ok(conn) => {
                (sb.conn, sb.linked, sb.image, sb.acked, sb.inbox, sb.acks) =
                    (conn, true, Some(seq), seq, VecDeque::new(), VecDeque::new());
                self.counts.relinks += 1;
                self.note(format!(
                    "standby {i} links again with an image at entry {seq}"
                ));
            }
            Err(e) => self.note(format!("standby {i} refused the link: {e}")),
        }
    }

    /// A standby stops (SIGSTOP) for a while.
    pub(super) fn pause_standby(&mut self) {
        let n = self.streaming.as_ref().map_or(0, |s| s.standbys.len());
        if n == 0 {
            return;
        }
        let i = self.rng.random_range(0..n);
        let until = self.now + self.rng.random_range(ACK_TIMEOUT / 2..4 * ACK_TIMEOUT);
        if let Some(s) = self.streaming.as_mut() {
            s.standbys[i].paused_until = until;
        }
        self.note(format!("standby {i} pauses until {until}"));
    }
}
