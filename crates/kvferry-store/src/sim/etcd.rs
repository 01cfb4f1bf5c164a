//! The etcd journal in the simulation: a model of etcd's keys under the journal's prefix,
//! written only by the real writer's machine ([`JournalWriter`]: every transaction it asks
//! for is applied to the model, as `crate::ha::journal::Writer` runs them against etcd) and
//! read by every new leader with the real loader ([`load_from`], [`stored_from`]). Entries
//! are appended as the writer commits them, a snapshot is written when the machine says it
//! is due (or forced: a hand-off), the log it covers and the previous snapshot deleted; an
//! emptied in-sync set writes the entries streamed (a rebase), a standby that takes over its
//! mirror (the takeover's rebase), each followed by the writer's snapshot check; a leader may
//! die between a snapshot's chunks, and the next one collects what it left. etcd answers
//! some transactions with an error (before or after applying them) or a failed compare, and
//! the writer's machine retries or gives up ([`Journal::run`]); a writer that gives up
//! fences its leader, and nothing it failed to write is answered.
//!
//! Checked after every step: etcd holds at most [`bound`] bytes of values under the journal's
//! prefix, from the size of the state and the snapshot threshold alone.

use super::*;
use crate::ha::log::{encode_chunks_of, load_from, stored_from, Loaded, Read};
use crate::repl::writer::{Answer, Next, Txn};
use crate::repl::JournalWriter;

/// The journal's prefix in the model.
pub(super) const PREFIX: &str = "mooncake-store/sim/journal/";

/// What may lie under the prefix besides the snapshots and the log, and what one step may
/// append after the writer's last check (bytes).
const SLACK: u64 = 4 << 10;

/// The most bytes of values etcd may hold under the journal's prefix, for a state whose
/// snapshot (encoded as the writer encodes it) is `state` bytes and a snapshot threshold
/// `threshold`: `3 × state + threshold + SLACK`.
///
/// Derived from the writer's rule ([`JournalWriter::snapshot_due`], checked after every
/// commit, rebase and takeover): once a check found no snapshot due, the log after the head
/// is at most `max(threshold, S)`, S the head's snapshot; a snapshot that is due drains what
/// is queued into the log, writes the state's image as chunks under its own number, then
/// the head deleting the log it covers, then the previous snapshot. So between steps etcd
/// holds the head's snapshot (S), the log (`max(threshold, S)`), and the chunks of at most
/// one snapshot whose leader died before its head (G, collected by the next leader from the
/// journal): S + G + max(threshold, S) ≤ 3 × max(S, G) + threshold. S and G are images of
/// the state at their time, so `state` is the largest image begun since the head's snapshot
/// (the head's included), as the simulation measures it: not the state now, since a state
/// that shrank since its snapshot leaves that snapshot in etcd until the log outgrows it.
///
/// One more term, `unchecked`: the log a rebase wrote (the entries streamed while standbys
/// were in sync) whose leader died before its check could write the snapshot; it stays until
/// the next leader's first check. In a deployment it is at most the kept tail's cap
/// (`--ha-rebase-tail-bytes`): a rebase whose entries outgrew it writes the whole state.
pub(super) fn bound(state: u64, threshold: u64, unchecked: u64) -> u64 {
    3 * state + threshold + unchecked + SLACK
}

/// etcd's keys under the journal's prefix.
#[derive(Debug, Default)]
pub(super) struct Etcd {
    kv: BTreeMap<String, Vec<u8>>,
    rev: i64,
    /// Bytes of every value held.
    bytes: u64,
}

impl Etcd {
    /// Applies a transaction (its guard holds: only the leader of the term writes).
    fn apply(&mut self, t: &Txn) -> i64 {
        if let Some((from, to)) = &t.delete {
            let gone: Vec<String> = self
                .kv
                .range(from.clone()..to.clone())
                .map(|(k, _)| k.clone())
                .collect();
            for k in gone {
                if let Some(v) = self.kv.remove(&k) {
                    self.bytes -= v.len() as u64;
                }
            }
        }
        for (k, v) in &t.puts {
            self.bytes += v.len() as u64;
            if let Some(old) = self.kv.insert(k.clone(), v.clone()) {
                self.bytes -= old.len() as u64;
            }
        }
        self.rev += 1;
        self.rev
    }

    /// Bytes of values held under `p`.
    fn bytes_under(&self, p: &str) -> u64 {
        self.kv
            .range(p.to_string()..prefix_end(p))
            .map(|(_, v)| v.len() as u64)
            .sum()
    }
}

fn prefix_end(p: &str) -> String {
    crate::repl::writer::prefix_end(p)
}

impl Read for Etcd {
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, String> {
        Ok(self.kv.get(key).cloned())
    }

    fn range(&self, from: &str, to: &str, _page: usize) -> Result<Vec<(String, Vec<u8>)>, String> {
        Ok(self
            .kv
            .range(from.to_string()..to.to_string())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect())
    }
}

/// The journal as the simulation keeps it: the model of etcd, the writer's machine of the
/// leader of the term (none between leaders), and what the bound is measured from.
pub(super) struct Journal {
    pub(super) etcd: Etcd,
    pub(super) writer: Option<JournalWriter>,
    /// The snapshot threshold of this run (small: a few hundred objects must outgrow it).
    pub(super) threshold: u64,
    /// The largest value the writer's encoding makes in this run.
    chunk: usize,
    /// The largest image (bytes) of every snapshot begun since the head's was.
    pub(super) images: u64,
    /// Chunks a leader left before its head: the next leader from the journal collects them.
    pub(super) garbage: bool,
    /// The snapshot being written, its chunks not written yet and its image's bytes
    /// ([`Journal::snapshot_begin`]).
    pub(super) writing: Option<(VecDeque<Vec<u8>>, u64)>,
    /// Bytes of log a rebase wrote that no completed check has seen since ([`bound`]).
    pub(super) unchecked: u64,
    /// etcd answers a leader's transactions with errors at random ([`Journal::run`]): per
    /// mille, drawn per run (none in a third of the runs); only while a leader's writer runs
    /// (`flaky`: not during a standby's takeover, whose writer retries until five lease TTLs).
    fail_permille: u32,
    pub(super) flaky: bool,
    /// The writer's machine gave up a transaction ([`JournalWriter::on_answer`]): the leader
    /// fences itself, nothing more is written.
    pub(super) gave_up: bool,
    /// Its own random source (seeded from the run's): etcd's answers.
    rng: StdRng,
    /// Transactions answered with an error and retried, of them applied all the same (the
    /// answer lost), and transactions given up.
    pub(super) failed: u64,
    pub(super) lost_answers: u64,
    pub(super) give_ups: u64,
}

impl Journal {
    pub(super) fn new(rng: &mut StdRng) -> Journal {
        Journal {
            etcd: Etcd::default(),
            writer: None,
            threshold: 1 << rng.random_range(11..=16u32),
            chunk: [1 << 10, 4 << 10, 512 << 10][rng.random_range(0..3usize)],
            images: 0,
            garbage: false,
            writing: None,
            unchecked: 0,
            fail_permille: [0, 10, 50][rng.random_range(0..3usize)],
            flaky: false,
            gave_up: false,
            rng: StdRng::seed_from_u64(rng.random()),
            failed: 0,
            lost_answers: 0,
            give_ups: 0,
        }
    }

    /// Runs a transaction as the writer does (`crate::ha::journal::Writer::txn`): etcd
    /// answers it written, or (while `flaky`) with an error before applying it, with an
    /// error after applying it (the answer lost: a timeout), or with the guard's compare
    /// failing (the leader's key is gone); the writer's machine says whether to retry or give
    /// up ([`JournalWriter::on_answer`], the lease provable or not). Given up: `None`, and
    /// nothing more is written (the leader fences itself, which the simulation then makes a
    /// crash).
    fn run(&mut self, t: &Txn) -> Option<i64> {
        for _ in 0..1000 {
            if self.gave_up {
                return None;
            }
            let roll = if self.flaky && self.fail_permille > 0 {
                self.rng.random_range(0..1000)
            } else {
                u32::MAX
            };
            let a = if roll < self.fail_permille / 2 {
                self.failed += 1;
                Answer::Failed
            } else if roll < self.fail_permille {
                self.etcd.apply(t);
                (self.failed, self.lost_answers) = (self.failed + 1, self.lost_answers + 1);
                Answer::Failed
            } else if roll < self.fail_permille + self.fail_permille / 10 {
                Answer::NotOwner
            } else {
                Answer::Written(self.etcd.apply(t))
            };
            let still = a != Answer::Failed || self.rng.random_bool(0.9);
            let Some(w) = self.writer.as_ref() else {
                return Some(self.etcd.apply(t));
            };
            match w.on_answer(a, 0, still) {
                Next::Done(rev) => return Some(rev),
                Next::Retry => {}
                Next::GiveUp => break,
            }
        }
        self.gave_up = true;
        self.give_ups += 1;
        None
    }

    fn encode(&self, changes: &[Change]) -> Vec<Vec<u8>> {
        encode_chunks_of(changes, self.chunk).unwrap_or_default()
    }

    /// Bytes of values under the journal's prefix (the model holds nothing else).
    pub(super) fn bytes(&self) -> u64 {
        self.etcd.bytes
    }

    /// The journal as a new leader loads it.
    pub(super) fn load(&self) -> Result<Loaded, String> {
        load_from(&self.etcd, PREFIX)
    }

    /// Appends `changes` as the writer commits them (one entry per value). False when the
    /// writer gave up (some of the values may be written: they are durable, unanswered).
    pub(super) fn append(&mut self, changes: &[Change]) -> bool {
        for v in self.encode(&fixed_order(changes.to_vec())) {
            let n = v.len() as u64;
            let Some(t) = self.writer.as_ref().map(|w| w.append(v)) else {
                return false;
            };
            if self.run(&t).is_none() {
                return false;
            }
            if let Some(w) = self.writer.as_mut() {
                w.appended(n);
            }
            if self.writing.is_some() {
                // (Appended while a snapshot's chunks are written: after its position, kept
                // by its head, and counted by the writer's next check.)
                self.unchecked += n;
            }
        }
        true
    }

    /// A leader starts the term after entry `seq` of a journal with `head` and `log_bytes`
    /// of log after it, and collects what a snapshot left behind.
    pub(super) fn start(&mut self, seq: u64, head: Option<crate::repl::Head>, log_bytes: u64) {
        let w = JournalWriter::new(PREFIX.to_string(), seq, head, log_bytes, self.threshold);
        let garbage = w.garbage();
        self.writer = Some(w);
        self.writing = None;
        self.gave_up = false;
        for t in &garbage {
            self.run(t);
        }
        self.garbage = false;
        self.images = head.map_or(0, |h| h.bytes);
    }

    /// Where the etcd journal ends, as a leader that does not load it reads it (a standby's
    /// takeover).
    fn start_stored(&mut self) -> Result<(), String> {
        let s = stored_from(&self.etcd, PREFIX)?;
        self.start(s.seq, s.head, s.log_bytes);
        Ok(())
    }

    /// Writes `image`, the state after the last entry (everything queued was appended
    /// first), as a snapshot: the whole of it, or only its first `cut` chunks (the leader
    /// dies before the rest and the head). Whether the head was written.
    pub(super) fn snapshot(&mut self, image: &[Change], cut: Option<usize>) -> bool {
        if !self.snapshot_begin(image) {
            return false;
        }
        match cut {
            Some(c) => {
                let _ = self.snapshot_more(c, false);
                self.snapshot_dropped();
                false
            }
            None => self.snapshot_more(usize::MAX, true) == Some(true),
        }
    }

    /// Begins writing `image` (the state after the writer's last entry) as the snapshot after
    /// that entry: the chunks a leader that died left under its number are cleared, and its
    /// chunks are kept to write ([`Journal::snapshot_more`]), entries being appended to the
    /// log between them as the real writer commits what requests queue meanwhile (the head
    /// keeps those). Whether it began.
    pub(super) fn snapshot_begin(&mut self, image: &[Change]) -> bool {
        let values: VecDeque<Vec<u8>> = self.encode(image).into();
        let bytes: u64 = values.iter().map(|v| v.len() as u64).sum();
        self.images = self.images.max(bytes);
        let Some(w) = self.writer.as_mut() else {
            return false;
        };
        let at = w.seq();
        let Some(clear) = w.begin_snapshot(at) else {
            return false;
        };
        if self.run(&clear).is_none() {
            return false;
        }
        self.writing = Some((values, bytes));
        true
    }

    /// Writes up to `n` more chunks of the snapshot being written and, once they are all
    /// written and with `head`, its head (deleting the log it covers, then the previous
    /// snapshot): `Some(true)` once the head is written, `Some(false)` with chunks or the head
    /// left, `None` when the writer gave up (its chunks are left for the next leader) or none
    /// is being written.
    pub(super) fn snapshot_more(&mut self, n: usize, head: bool) -> Option<bool> {
        let (mut values, bytes) = self.writing.take()?;
        for _ in 0..n {
            let Some(v) = values.pop_front() else {
                break;
            };
            let len = v.len() as u64;
            let t = self.writer.as_ref().and_then(|w| w.chunk(v))?;
            if self.run(&t).is_none() {
                // (The writer gave up between chunks: they are left for the next leader.)
                self.garbage = true;
                return None;
            }
            if let Some(w) = self.writer.as_mut() {
                w.chunk_written(len);
            }
        }
        if !values.is_empty() || !head {
            self.writing = Some((values, bytes));
            return Some(false);
        }
        let t = self.writer.as_ref().and_then(|w| w.head_txn(None))?;
        let Some(rev) = self.run(&t) else {
            self.garbage = true;
            return None;
        };
        let after = self.writer.as_mut().and_then(|w| w.head_written(rev))?;
        if let Some(t) = after.delete_old {
            self.run(&t);
        }
        self.images = bytes;
        Some(true)
    }

    /// The snapshot being written is given up with its leader: its chunks are left for the
    /// next one to collect.
    pub(super) fn snapshot_dropped(&mut self) {
        if self.writing.take().is_some() {
            self.garbage = true;
        }
    }

    /// `values`, the log after the etcd journal's last position as the real writer makes it
    /// from the kept tail (`tail_log_values`: consecutive entries sharing a value), go to its
    /// log, several per transaction, as a rebase from the kept tail writes them (the writer's
    /// position is already the last entry streamed).
    pub(super) fn rebase_values(&mut self, values: Vec<(String, Vec<u8>)>) {
        let bytes: u64 = values.iter().map(|(_, v)| v.len() as u64).sum();
        for t in JournalWriter::rebase_txns(values) {
            if self.run(&t).is_none() {
                return;
            }
        }
        if let Some(w) = self.writer.as_mut() {
            w.rebased(bytes);
        }
        self.unchecked += bytes;
    }

    /// A standby takes over at entry `seq`: the etcd journal is made whole with its mirror as
    /// [`crate::repl::MirrorTail::takeover`] decided: `values` (the entries it kept after where
    /// the journal ends, as log values) to its log, or its `whole` state as the snapshot after
    /// entry `seq` (the later of the journal's and the mirror's last entries).
    pub(super) fn take_over(
        &mut self,
        whole: Option<Vec<Change>>,
        values: Vec<(String, Vec<u8>)>,
        seq: u64,
    ) -> Result<(), String> {
        self.flaky = false;
        self.start_stored()?;
        match whole {
            None => {
                if let Some(w) = self.writer.as_mut() {
                    w.set_seq(seq);
                }
                self.rebase_values(values);
            }
            Some(whole) => {
                if let Some(w) = self.writer.as_mut() {
                    w.set_seq(seq + 1);
                }
                self.snapshot(&fixed_order(whole), None);
            }
        }
        Ok(())
    }
}

/// `changes` (an entry's, or a state's image) in a fixed order: the state's maps iterate in a
/// per-process hashed order, and the changes' bytes, compressed, would differ between two
/// runs of a seed. Only consecutive changes of clients, of keys (objects and forgotten keys)
/// or of held space are ordered, by their entity (stably: two of one entity keep theirs),
/// as those of different entities rebuild the same state in any order; everything else keeps
/// its place, which rebuilding depends on (held space after the mount of its segment, the
/// mount order).
pub(super) fn fixed_order(mut changes: Vec<Change>) -> Vec<Change> {
    /// The run a change may be ordered in, and its entity there.
    fn entity(c: &Change) -> (u8, String, (u64, u64, u64)) {
        match c {
            Change::Client { id, .. } => (1, String::new(), (*id, 0, 0)),
            Change::Object { key, .. } | Change::Forget { key } => (2, key.clone(), (0, 0, 0)),
            Change::HeldUntil { replica, .. } | Change::HeldBack { replica } => {
                (3, String::new(), *replica)
            }
            _ => (0, String::new(), (0, 0, 0)),
        }
    }
    let mut i = 0;
    while i < changes.len() {
        let r = entity(&changes[i]).0;
        let run = changes[i..]
            .iter()
            .position(|c| entity(c).0 != r)
            .unwrap_or(changes.len() - i);
        if r != 0 {
            changes[i..i + run].sort_by_cached_key(entity);
        }
        i += run.max(1);
    }
    changes
}

impl Sim {
    /// The writer's check after a commit, a rebase or a takeover: a snapshot when the machine
    /// says it is due (`forced`: regardless, as a hand-off), everything queued appended first
    /// (the image holds nothing the log does not). A leader may die between its chunks.
    pub(super) fn check_snapshot(&mut self, step: usize, forced: bool) -> Result<(), Failure> {
        if self.leader.is_none() || self.streaming.is_some() {
            return Ok(());
        }
        if self.journal.writing.is_some() {
            // (One is being written, its chunks between the writer's commits: a forced one
            // finishes it first.)
            if forced {
                self.snapshot_more(usize::MAX);
            }
            return Ok(());
        }
        let Some(w) = self.journal.writer.as_ref() else {
            return Ok(());
        };
        if !forced && !w.snapshot_due(false) {
            // (The log is within the rule's bound.)
            self.journal.unchecked = 0;
            return Ok(());
        }
        while let Some(e) = self.pending.pop_front() {
            self.durable(step, e, true)?;
        }
        let Some(l) = self.leader.as_ref() else {
            return Ok(());
        };
        let image = fixed_order(l.st.image(self.now));
        let crash = self.weights[8] > 0 && self.rng.random_bool(0.1);
        let cut = crash.then(|| self.rng.random_range(0..4usize));
        if cut.is_none() && !forced && self.rng.random_bool(0.5) {
            // Written in the background: its chunks between the next commits, which append
            // entries after its position (the head keeps them), as the real writer's.
            if self.journal.snapshot_begin(&image) {
                let at = self.journal.writer.as_ref().map_or(0, JournalWriter::seq);
                self.note(format!(
                    "snapshot of {} changes at entry {at} begun: its chunks go between the next commits",
                    image.len()
                ));
                let n = self.rng.random_range(0..3);
                self.snapshot_more(n);
            } else if self.journal.gave_up {
                self.writer_gave_up();
            }
            return Ok(());
        }
        if self.journal.snapshot(&image, cut) {
            self.journal.unchecked = 0;
            self.counts.snapshots += 1;
            let bytes = self
                .journal
                .writer
                .as_ref()
                .map_or(0, |w| w.snapshot_bytes());
            self.note(format!(
                "snapshot of {} changes, {bytes} bytes, at entry {}",
                image.len(),
                self.journal.writer.as_ref().map_or(0, JournalWriter::seq)
            ));
        } else if self.journal.gave_up {
            self.writer_gave_up();
        } else if cut.is_some() {
            self.counts.snapshots_cut += 1;
            self.note("the leader dies writing a snapshot, before its head".to_string());
            self.crash();
        }
        Ok(())
    }

    /// The writer's next turn on the snapshot being written in the background: `n` more of
    /// its chunks, and its head once they are all written.
    pub(super) fn snapshot_more(&mut self, n: usize) {
        match self.journal.snapshot_more(n, true) {
            Some(true) => {
                self.counts.snapshots += 1;
                self.counts.interleaved_snapshots += 1;
                self.note(format!(
                    "the snapshot's head is written, the log kept after it from entry {}",
                    self.journal
                        .writer
                        .as_ref()
                        .and_then(|w| w.head())
                        .map_or(0, |h| h.seq + 1)
                ));
            }
            Some(false) => {}
            None if self.journal.gave_up => self.writer_gave_up(),
            None => {}
        }
    }

    /// The writer of a standby that took over checks the rule once its rebase is written:
    /// a snapshot of its state (as it rebuilt it from its mirror) when one is due.
    pub(super) fn standby_check_snapshot(&mut self) {
        if !self
            .journal
            .writer
            .as_ref()
            .is_some_and(|w| w.snapshot_due(false))
        {
            self.journal.unchecked = 0;
            return;
        }
        match self.journal.load() {
            Ok(l) => {
                let (st, _) = l.image.into_state(self.term + 1, self.now, LEASE);
                if self
                    .journal
                    .snapshot(&fixed_order(st.image(self.now)), None)
                {
                    self.journal.unchecked = 0;
                    self.counts.snapshots += 1;
                    self.note("the standby that took over writes a snapshot".to_string());
                }
            }
            Err(e) => self.note(format!("the standby could not read etcd's journal: {e}")),
        }
    }

    /// etcd holds no more under the journal's prefix than [`bound`] allows.
    pub(super) fn check_etcd(&mut self, step: usize) -> Result<(), Failure> {
        let held = self.journal.bytes();
        let (state, threshold, unchecked) = (
            self.journal.images,
            self.journal.threshold,
            self.journal.unchecked,
        );
        let allowed = bound(state, threshold, unchecked);
        self.counts.etcd_peak_pct = self.counts.etcd_peak_pct.max(held * 100 / allowed);
        if held <= allowed {
            return Ok(());
        }
        let (log, snap) = (
            self.journal.etcd.bytes_under(&format!("{PREFIX}log/")),
            self.journal.etcd.bytes_under(&format!("{PREFIX}snap/")),
        );
        Err(self.fail(step, format!("etcd holds {held} bytes under the journal's prefix ({log} of log, {snap} of snapshots), more than the {allowed} allowed for a state of {state} bytes (the largest snapshot image since the head's), a snapshot threshold of {threshold} and {unchecked} bytes of a rebase not checked yet")))
    }
}
