//! The etcd journal's writer as a machine: where the journal lies in etcd (its keys), which
//! entry comes next, how many bytes of log and snapshot etcd holds, when a snapshot is due,
//! the transactions that write one and delete what it covers, the garbage a leader that died
//! mid-snapshot left, how a rebase's log values are batched, and whether a transaction that
//! failed is retried or the term given up.
//!
//! It runs no transaction: it answers what to run ([`Txn`], each guarded by the leader's key
//! by its driver) and is told what was written. The driver (`crate::ha::journal`'s
//! `Writer`) carries the transactions out against etcd; the simulator (`crate::sim`) carries
//! them out against its model of etcd and checks, after every step, that what the journal
//! holds there stays bounded ([`JournalWriter::snapshot_due`] is the rule that bounds it).
//! Times are microseconds on the driver's clock.
//!
//! Keys under the journal's prefix (`mooncake-store/<cluster_id>/journal/`):
//! - `log/<seq, 16 hex digits>`: an entry's changes (or, after a rebase from the kept
//!   entries, several consecutive entries' under the first one's key);
//! - `snap/<seq>/<i, 8 hex digits>`: the chunks of the snapshot of the state after entry
//!   `seq`; `head` ([`Head`]) names the current one;
//! - `term`: the term of the last leader that loaded the journal.

use serde::{Deserialize, Serialize};

/// `journal/head`: where the current snapshot is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Head {
    /// The snapshot holds the state after `log/<seq>` (0: after nothing).
    pub seq: u64,
    pub chunks: u32,
    pub bytes: u64,
}

/// The key of log entry `seq` under the journal's prefix `p`.
pub fn log_key(p: &str, seq: u64) -> String {
    format!("{p}log/{seq:016x}")
}

/// Where the chunks of the snapshot after entry `seq` lie.
pub fn snap_dir(p: &str, seq: u64) -> String {
    format!("{p}snap/{seq:016x}/")
}

/// The key right after every key starting with `p` (etcd's prefix range end).
pub fn prefix_end(p: &str) -> String {
    let mut b = p.as_bytes().to_vec();
    if let Some(last) = b.last_mut() {
        *last += 1;
    }
    String::from_utf8_lossy(&b).into_owned()
}

/// A rebase writes at most this many bytes of log values per transaction (etcd refuses
/// requests over 1.5 MiB by default, and base64 in its JSON gateway adds a third), and at
/// most this many keys (etcd's default limit is 128 operations).
pub const REBASE_TXN_BYTES: usize = 1 << 20;
pub const REBASE_TXN_KEYS: usize = 64;

/// One etcd transaction, run only while the leader's key is still this term's: `puts`, and
/// every key in `delete` (`from..to`) deleted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Txn {
    pub puts: Vec<(String, Vec<u8>)>,
    pub delete: Option<(String, String)>,
}

impl Txn {
    fn delete(from: String, to: String) -> Txn {
        Txn {
            puts: Vec::new(),
            delete: Some((from, to)),
        }
    }

    fn put(key: String, value: Vec<u8>) -> Txn {
        Txn {
            puts: vec![(key, value)],
            delete: None,
        }
    }

    /// Bytes of values it writes.
    pub fn bytes(&self) -> u64 {
        self.puts.iter().map(|(_, v)| v.len() as u64).sum()
    }
}

/// How a transaction ended, as the driver saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// Written at this revision.
    Written(i64),
    /// Not written: the leader's key is no longer this term's.
    NotOwner,
    /// etcd could not be reached, or answered an error.
    Failed,
}

/// What the driver does next with a transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// It was written at this revision.
    Done(i64),
    /// Run it again (after a short pause).
    Retry,
    /// Nothing more can be written in this term: the driver fences the leader.
    GiveUp,
}

/// What follows a snapshot's head once it is written ([`JournalWriter::head_written`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AfterHead {
    /// Deletes the snapshot the head named before (none when it named none).
    pub delete_old: Option<Txn>,
    /// etcd's history up to this revision is compacted (an error there only costs space).
    pub compact: i64,
}

/// A snapshot being written.
#[derive(Debug, Clone)]
struct Writing {
    at: u64,
    chunks: u32,
    bytes: u64,
    /// Log bytes when it began: what is appended meanwhile stays after its head.
    log_before: u64,
}

/// The writer's bookkeeping of the etcd journal in one term.
#[derive(Debug, Clone)]
pub struct JournalWriter {
    prefix: String,
    /// The last entry written (or streamed: standbys in sync number theirs alike).
    seq: u64,
    head: Option<Head>,
    /// A snapshot is due once the log outgrows this and the current snapshot.
    snapshot_min: u64,
    /// Bytes of log etcd holds after the head's snapshot.
    log_bytes: u64,
    /// Until then (a takeover, its lease kept by a thread of its own), a failed transaction
    /// is retried even when the lease can no longer be proven.
    retry_until: Option<u64>,
    writing: Option<Writing>,
}

impl JournalWriter {
    /// The writer of a term whose etcd journal under `prefix` ends at entry `seq`, with the
    /// snapshot `head` and `log_bytes` bytes of log after it (what the new leader loaded or
    /// read: a term that counted only its own would let every short term add its threshold
    /// of log).
    pub fn new(
        prefix: String,
        seq: u64,
        head: Option<Head>,
        log_bytes: u64,
        snapshot_min: u64,
    ) -> JournalWriter {
        JournalWriter {
            prefix,
            seq,
            head,
            snapshot_min,
            log_bytes,
            retry_until: None,
            writing: None,
        }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The last entry written or streamed.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Entries up to `seq` were streamed (to standbys, or lent), or a takeover continues there.
    pub fn set_seq(&mut self, seq: u64) {
        self.seq = seq;
    }

    /// The next entry's number, taken (an entry streamed to the in-sync standbys).
    pub fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    pub fn head(&self) -> Option<Head> {
        self.head
    }

    /// Bytes of log after the current snapshot.
    pub fn log_bytes(&self) -> u64 {
        self.log_bytes
    }

    /// Bytes of the current snapshot.
    pub fn snapshot_bytes(&self) -> u64 {
        self.head.map_or(0, |h| h.bytes)
    }

    /// A failed transaction is retried until `until` (`None`: given up as soon as the lease
    /// can no longer be proven).
    pub fn retry_until(&mut self, until: Option<u64>) {
        self.retry_until = until;
    }

    /// What to do after a transaction ended as `a` at `now`, while this master `still_leader`
    /// (it can prove its lease).
    pub fn on_answer(&self, a: Answer, now: u64, still_leader: bool) -> Next {
        match a {
            Answer::Written(rev) => Next::Done(rev),
            Answer::NotOwner => Next::GiveUp,
            Answer::Failed if still_leader || self.retry_until.is_some_and(|t| now < t) => {
                Next::Retry
            }
            Answer::Failed => Next::GiveUp,
        }
    }

    /// The transaction that appends `value` as the next entry.
    pub fn append(&self, value: Vec<u8>) -> Txn {
        Txn::put(log_key(&self.prefix, self.seq + 1), value)
    }

    /// The entry of [`JournalWriter::append`], of `bytes`, was written.
    pub fn appended(&mut self, bytes: u64) {
        self.seq += 1;
        self.log_bytes += bytes;
    }

    /// Whether a snapshot is due: the log since the current snapshot outgrew it and the
    /// threshold, and the etcd journal is being written (not while standbys are in sync,
    /// `streaming`: its base is refreshed apart). Checked after every commit, this bounds
    /// what etcd holds under the journal: at most the current snapshot, the log (no more than
    /// the larger of the threshold and the snapshot, plus what one commit wrote before the
    /// check), and while one is written or after its leader died writing it, one more
    /// snapshot of the state.
    pub fn snapshot_due(&self, streaming: bool) -> bool {
        !streaming && self.log_bytes > self.snapshot_min.max(self.snapshot_bytes())
    }

    /// Begins the snapshot of the state after entry `at`: first, chunks a leader that died
    /// mid-snapshot left under that number are deleted. `None` when the head already names
    /// the snapshot after `at`: deleting its chunks to write them again would leave a leader
    /// that dies meanwhile a head that names chunks etcd no longer holds, a journal no master
    /// can load (the simulator found it, with a snapshot forced right after another).
    pub fn begin_snapshot(&mut self, at: u64) -> Option<Txn> {
        if self.head.is_some_and(|h| h.seq == at) {
            return None;
        }
        self.writing = Some(Writing {
            at,
            chunks: 0,
            bytes: 0,
            log_before: self.log_bytes,
        });
        let dir = snap_dir(&self.prefix, at);
        let end = prefix_end(&dir);
        Some(Txn::delete(dir, end))
    }

    /// The transaction that writes `value` as the snapshot's next chunk (`None`: no snapshot
    /// is being written).
    pub fn chunk(&self, value: Vec<u8>) -> Option<Txn> {
        let w = self.writing.as_ref()?;
        Some(Txn::put(
            format!("{}{:08x}", snap_dir(&self.prefix, w.at), w.chunks),
            value,
        ))
    }

    /// The chunk of [`JournalWriter::chunk`], of `bytes`, was written.
    pub fn chunk_written(&mut self, bytes: u64) {
        if let Some(w) = self.writing.as_mut() {
            w.chunks += 1;
            w.bytes += bytes;
        }
    }

    /// The snapshot being written is given up: its chunks are deleted.
    pub fn abandon_snapshot(&mut self) -> Option<Txn> {
        let w = self.writing.take()?;
        let dir = snap_dir(&self.prefix, w.at);
        let end = prefix_end(&dir);
        Some(Txn::delete(dir, end))
    }

    /// Every chunk is written: the head naming them, with `also` in the same transaction,
    /// deleting the log the snapshot covers (`None`: no snapshot is being written, or the
    /// head cannot be encoded).
    pub fn head_txn(&self, also: Option<(String, Vec<u8>)>) -> Option<Txn> {
        let w = self.writing.as_ref()?;
        let head = Head {
            seq: w.at,
            chunks: w.chunks,
            bytes: w.bytes,
        };
        let mut puts = vec![(
            format!("{}head", self.prefix),
            postcard::to_stdvec(&head).ok()?,
        )];
        puts.extend(also);
        Some(Txn {
            puts,
            delete: Some((
                format!("{}log/", self.prefix),
                log_key(&self.prefix, w.at + 1),
            )),
        })
    }

    /// The head of [`JournalWriter::head_txn`] was written at `rev`: the snapshot is the
    /// current one, the log it covers gone (what was appended while its chunks were written
    /// stays); then the previous snapshot is deleted and etcd's history compacted.
    pub fn head_written(&mut self, rev: i64) -> Option<AfterHead> {
        let w = self.writing.take()?;
        let head = Head {
            seq: w.at,
            chunks: w.chunks,
            bytes: w.bytes,
        };
        let old = self.head.replace(head).filter(|h| h.seq != head.seq);
        self.log_bytes = self.log_bytes.saturating_sub(w.log_before);
        Some(AfterHead {
            delete_old: old.map(|h| {
                let d = snap_dir(&self.prefix, h.seq);
                let end = prefix_end(&d);
                Txn::delete(d, end)
            }),
            compact: rev,
        })
    }

    /// Deletes snapshot chunks the head does not name (a leader that died between writing a
    /// new head and deleting the old snapshot, or mid-snapshot, leaves them behind).
    pub fn garbage(&self) -> Vec<Txn> {
        let all = format!("{}snap/", self.prefix);
        match self.head {
            Some(h) => {
                let keep = snap_dir(&self.prefix, h.seq);
                vec![
                    Txn::delete(all.clone(), keep.clone()),
                    Txn::delete(prefix_end(&keep), prefix_end(&all)),
                ]
            }
            None => {
                let end = prefix_end(&all);
                vec![Txn::delete(all, end)]
            }
        }
    }

    /// A rebase's log `values` (keyed, in order), several per transaction.
    pub fn rebase_txns(values: Vec<(String, Vec<u8>)>) -> Vec<Txn> {
        let mut out = Vec::new();
        let mut batch: Vec<(String, Vec<u8>)> = Vec::new();
        let mut size = 0;
        for (k, v) in values {
            if !batch.is_empty()
                && (size + v.len() > REBASE_TXN_BYTES || batch.len() >= REBASE_TXN_KEYS)
            {
                out.push(Txn {
                    puts: std::mem::take(&mut batch),
                    delete: None,
                });
                size = 0;
            }
            size += v.len();
            batch.push((k, v));
        }
        if !batch.is_empty() {
            out.push(Txn {
                puts: batch,
                delete: None,
            });
        }
        out
    }

    /// A rebase wrote `bytes` of log values (the entries up to [`JournalWriter::seq`]).
    pub fn rebased(&mut self, bytes: u64) {
        self.log_bytes += bytes;
    }
}

#[cfg(test)]
mod tests;
