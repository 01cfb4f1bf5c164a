//! The entries streamed to the in-sync standbys and not yet acknowledged by all of them, in
//! order. The leader sends the next entry without waiting for the last one's
//! acknowledgements (entries are pipelined); an entry is released, and the ticket it
//! completes made durable ([`super::Queue::written_in`]), once the least acknowledgement
//! among the in-sync members reaches it. The driver (`crate::ha::journal::Release`) reads the
//! members' acknowledgement counters and the clock; this decides.

use std::collections::VecDeque;

/// What a release let go ([`Pipeline::release`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// Every ticket up to this one is durable (0: only pieces without a ticket went).
    pub upto: u64,
    /// Entries released.
    pub entries: u64,
    /// Microseconds they waited, summed.
    pub waited_us: u64,
}

#[derive(Debug, Default)]
pub struct Pipeline {
    /// Entries sent: sequence number, the ticket it completes (0: none, a piece before the
    /// last of a commit), when it was sent (µs).
    pending: VecDeque<(u64, u64, u64)>,
    /// When the last entry was released: the standbys' clock for the next one starts then if
    /// it was sent before ([`Pipeline::oldest`]).
    progress: Option<u64>,
}

impl Pipeline {
    /// Entry `seq`, completing `ticket` (0: none), is sent at `now`. Sequence numbers grow.
    pub fn push(&mut self, seq: u64, ticket: u64, now: u64) {
        debug_assert!(self.pending.back().is_none_or(|&(s, _, _)| s < seq));
        self.pending.push_back((seq, ticket, now));
    }

    /// Whether every entry sent was acknowledged by every member (none in flight).
    pub fn all_acknowledged(&self) -> bool {
        self.pending.is_empty()
    }

    /// Forgets every pending entry: the state they carry is in etcd (a rebase), their tickets
    /// made durable by the writer.
    pub fn clear(&mut self) {
        self.pending.clear();
    }

    /// The oldest entry not acknowledged by every member, and since when the standbys have
    /// had it to apply: when it was sent, or when the entry before it was released if that
    /// was later. A standby that works through a long burst of entries (a `RemoveAll` of a
    /// million objects is a few hundred pieces and about half a second of applying) stays in
    /// sync as long as each piece follows the one before within the bound; one that stops
    /// acknowledging is late one bound after its last progress.
    pub fn oldest(&self) -> Option<(u64, u64)> {
        self.pending
            .front()
            .map(|&(seq, _, sent)| (seq, self.progress.map_or(sent, |t| t.max(sent))))
    }

    /// The oldest pending entry if the standbys have had it `bound` µs or more at `now`: a
    /// member that has not acknowledged it is late.
    pub fn late(&self, now: u64, bound: u64) -> Option<u64> {
        self.oldest()
            .filter(|&(_, since)| now.saturating_sub(since) >= bound)
            .map(|(seq, _)| seq)
    }

    /// When, at the latest, the oldest pending entry becomes late ([`Pipeline::late`]).
    pub fn late_at(&self, bound: u64) -> Option<u64> {
        self.oldest().map(|(_, since)| since.saturating_add(bound))
    }

    /// Every member acknowledged up to entry `min` (the least of their acknowledgements;
    /// `None`: no member, nothing is released) at `now`: the entries up to it go.
    pub fn release(&mut self, min: Option<u64>, now: u64) -> Option<Released> {
        let min = min?;
        let mut r = Released {
            upto: 0,
            entries: 0,
            waited_us: 0,
        };
        while let Some(&(seq, ticket, sent)) = self.pending.front() {
            if seq > min {
                break;
            }
            self.pending.pop_front();
            // (The largest: a piece carries no ticket, 0, and may follow a commit's last.)
            r.upto = r.upto.max(ticket);
            r.entries += 1;
            r.waited_us += now.saturating_sub(sent);
        }
        if r.entries == 0 {
            return None;
        }
        self.progress = Some(now);
        Some(r)
    }
}
