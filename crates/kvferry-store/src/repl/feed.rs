//! What feeds a standby's mirror, as a machine: which leader's connection may (the newest
//! term's, its last hello), which frame comes next (an image, then entries in order), what
//! is acknowledged (an entry once it is decoded and next, held in memory), what waits to be
//! applied, and the entries kept for a takeover ([`MirrorTail`]). The driver
//! (`crate::ha::sync::Mirror`) keeps it under a lock beside the image it applies the changes
//! to, checks the cluster and the leader etcd names before a hello, and owns the socket.

use super::{MirrorTail, ToStandby};
use crate::master::changes::Change;

#[derive(Debug, Default)]
pub struct Feed {
    /// The term of the leader it mirrors; connections of older terms are refused.
    pub term: i64,
    /// The connection that feeds it (0: none; others are refused).
    pub conn: u64,
    /// The last connection number given (a hello takes the next).
    pub next_conn: u64,
    /// The last entry received (decoded, in order) and so acknowledged.
    pub seq: u64,
    /// An image was received whole (and every entry since, in order).
    pub complete: bool,
    /// Taken over (this master leads from it): nothing more is applied.
    pub closed: bool,
    /// This master is stopping: its mirror is kept (for a takeover) but fed no more, so that a
    /// leader alive drops it from the in-sync set.
    pub sealed: bool,
    /// Received and acknowledged, with when they arrived (µs on the driver's clock), not
    /// applied to the image yet.
    pub pending: Vec<(u64, Vec<Change>)>,
    /// The entries received since where the leader's etcd journal is whole, as they came.
    pub tail: MirrorTail,
    /// The bytes of frames a run of the tail keeps (0: none).
    pub tail_cap: usize,
}

impl Feed {
    pub fn new(tail_cap: usize) -> Feed {
        Feed {
            tail_cap,
            ..Feed::default()
        }
    }

    /// A connection of `term` said hello (its cluster and its leadership checked by the
    /// driver): it feeds the mirror from now on, which starts empty (an image follows). Its
    /// connection number; refused while taken over or sealed, or for an older term.
    pub fn hello(&mut self, term: i64) -> Result<u64, String> {
        if self.closed {
            return Err("this master is taking over or leads".into());
        }
        if self.sealed {
            return Err("this standby is stopping".into());
        }
        if term < self.term {
            return Err(format!(
                "term {term} is older than the term {} this standby follows",
                self.term
            ));
        }
        let conn = self.next_conn + 1;
        *self = Feed {
            term,
            conn,
            next_conn: conn,
            tail_cap: self.tail_cap,
            ..Feed::default()
        };
        Ok(conn)
    }

    /// One frame of connection `conn` (`raw` as it came), at `now`: checked to be the next
    /// one, its changes pending until the driver applies them. The entry to acknowledge, if
    /// any; an error ends the connection.
    pub fn on_frame(
        &mut self,
        conn: u64,
        frame: ToStandby,
        raw: Vec<u8>,
        now: u64,
    ) -> Result<Option<u64>, String> {
        if self.conn != conn || self.closed {
            return Err("another leader's connection replaced this one".into());
        }
        let (ack, changes) = match frame {
            ToStandby::Hello { .. } => return Err("a second hello on one connection".into()),
            ToStandby::AuthHello { .. } | ToStandby::AuthProof { .. } => {
                return Err("an authentication step after the hello".into())
            }
            ToStandby::Image { seq, changes, last } => {
                if self.complete {
                    return Err("an image after the image".into());
                }
                if last {
                    self.seq = seq;
                    self.complete = true;
                }
                (last.then_some(seq), changes)
            }
            ToStandby::Entry { seq, changes } => {
                if !self.complete || seq <= self.seq {
                    return Err(format!(
                        "entry {seq} out of order (mirror at {}, complete: {})",
                        self.seq, self.complete
                    ));
                }
                let first = self.seq + 1;
                self.tail.push(first, seq, raw, self.tail_cap);
                self.seq = seq;
                (Some(seq), changes)
            }
            ToStandby::Base { seq, written } => {
                if self.complete {
                    let at = self.seq;
                    self.tail.base(seq, written, at, self.tail_cap);
                }
                (None, Vec::new())
            }
            ToStandby::Run { base, frames } => {
                if self.complete {
                    let at = self.seq;
                    self.tail.joined(base, frames, at, self.tail_cap);
                }
                (None, Vec::new())
            }
        };
        if !changes.is_empty() {
            self.pending.push((now, changes));
        }
        Ok(ack)
    }

    /// A complete mirror not taken over: what this member could lead from.
    pub fn leads_from(&self) -> bool {
        self.complete && !self.closed
    }

    /// A connection feeds it now.
    pub fn fed(&self) -> bool {
        self.conn != 0 && !self.closed
    }

    /// A complete mirror of `term` is taken for a takeover: nothing more is applied. Its last
    /// entry and the entries kept; `None` if it is not a complete mirror of `term`.
    pub fn take(&mut self, term: i64) -> Option<(u64, MirrorTail)> {
        if !self.leads_from() || self.term != term {
            return None;
        }
        self.closed = true;
        self.complete = false;
        Some((self.seq, std::mem::take(&mut self.tail)))
    }

    /// Fed no more (the master is stopping); what it holds stays.
    pub fn seal(&mut self) {
        self.sealed = true;
        self.conn = 0;
    }

    /// Connection `conn` ended: whether it was the one feeding the mirror (now none is).
    pub fn detach(&mut self, conn: u64) -> bool {
        if self.conn == conn {
            self.conn = 0;
            return true;
        }
        false
    }

    /// A mirror of `term` a failed takeover hands back: complete at `seq`, fed by nobody.
    pub fn restore(&mut self, term: i64, seq: u64, tail: MirrorTail) {
        *self = Feed {
            term,
            next_conn: self.next_conn,
            seq,
            complete: true,
            sealed: self.sealed,
            tail,
            tail_cap: self.tail_cap,
            ..Feed::default()
        };
    }

    /// This master leads: nothing is mirrored.
    pub fn close(&mut self) {
        *self = Feed {
            term: self.term,
            next_conn: self.next_conn,
            closed: true,
            sealed: self.sealed,
            tail_cap: self.tail_cap,
            ..Feed::default()
        };
    }

    /// Accepts feeds again (after leading or a lost campaign), of terms from the one it last
    /// mirrored; whether it was closed.
    pub fn reopen(&mut self) -> bool {
        if !self.closed {
            return false;
        }
        *self = Feed {
            term: self.term,
            next_conn: self.next_conn,
            sealed: self.sealed,
            tail_cap: self.tail_cap,
            ..Feed::default()
        };
        true
    }
}
