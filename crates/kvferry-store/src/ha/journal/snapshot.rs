//! The writer's images, snapshots and rebases: the state taken in pieces (the lock let go
//! between them), written to etcd as a snapshot, or the etcd journal made whole again when
//! the in-sync set empties, from the kept tail or from the whole state. Drives etcd and the
//! state's lock; what is durable is decided by the queue ([`crate::repl::Queue`]), what is
//! written to etcd and deleted there by the journal's machine ([`JournalWriter`]).

use super::*;
use crate::repl::roster::{RebaseFrom, Roster};
use crate::repl::{MirrorTail, Takeover};

/// The longest a leader holds the state's lock while it takes an image (a standby that
/// links, a snapshot): past it, the lock is let go between two pieces for [`IMAGE_GAP`].
const IMAGE_HOLD: Duration = Duration::from_millis(5);
const IMAGE_GAP: Duration = Duration::from_micros(200);

/// What [`Writer::image_in_pieces`] took.
pub(super) struct Frozen {
    /// Queued before the image and not committed yet (none when `seq` is set).
    pub(super) queued: Vec<Change>,
    /// The ticket `queued` completes.
    pub(super) upto: u64,
    pub(super) image: Vec<Change>,
    /// The image's position when what was queued was committed while it was taken.
    pub(super) seq: Option<u64>,
}

/// How many of an image's changes a snapshot encodes at a time ([`Writer::write_snapshot`]):
/// a few chunks' worth.
const SNAPSHOT_PART: usize = 16_384;

impl Writer<'_> {
    /// An image of the state, its objects taken in pieces, starting from the state after
    /// exactly everything queued (what was marked goes to the queue first; `None` when the
    /// term ended): the lock is let go whenever one
    /// hold reached [`IMAGE_HOLD`] (a million objects took 0.4 s in one hold in a leader,
    /// every request of the master waiting: `cargo run --release -p kvferry-store --example
    /// image_pause`); what requests change in between is queued after `upto` and follows the
    /// image ([`State::image_head`]). With `commit_between`, what was queued before the image
    /// is committed at the first gap, and what requests queue meanwhile at every gap, so that
    /// they do not wait for the whole image: the image's position is then `seq` (entries after
    /// it may already be committed).
    pub(super) fn image_in_pieces(&mut self, commit_between: bool) -> Option<Frozen> {
        let master = self.master;
        let j = &master.journal;
        let mut now = master.now();
        let mut st = master.lock();
        let changes = st.take_changes(now);
        let issued = crate::master::grants_issued();
        let (mut queued, upto) = {
            let mut q = j.q();
            if !q.m.live(self.term()) {
                return None;
            }
            q.m.enqueue(changes, issued);
            q.m.take()
        };
        let term = st.term;
        let mut image = st.image_head(now);
        let (start, mut held, mut longest, mut holds) =
            (Instant::now(), Instant::now(), Duration::ZERO, 1);
        let mut seq = None;
        for piece in 0..IMAGE_PIECES {
            if held.elapsed() >= IMAGE_HOLD {
                longest = longest.max(held.elapsed());
                drop(st);
                if commit_between {
                    seq = Some(self.commit_queued(&mut queued, upto, seq)?);
                }
                // (Long enough for the requests woken by the unlock to take the lock first: one
                // that finds it taken again at once waits for the next gap.)
                std::thread::sleep(IMAGE_GAP);
                st = master.lock();
                // (A leader that stepped down meanwhile reset its state: what is left of it is
                // not this term's, and the image is given up with the term.)
                if st.term != term {
                    return None;
                }
                (held, holds) = (Instant::now(), holds + 1);
                now = master.now();
            }
            st.image_piece(piece, now, &mut image);
        }
        drop(st);
        longest = longest.max(held.elapsed());
        tracing::info!(
            changes = image.len(),
            ms = start.elapsed().as_millis() as u64,
            holds,
            longest_hold_ms = longest.as_millis() as u64,
            "HA journal: an image of the state taken"
        );
        if commit_between && seq.is_none() {
            seq = Some(self.commit_queued(&mut queued, upto, None)?);
        }
        Some(Frozen {
            queued,
            upto,
            image,
            seq,
        })
    }

    /// At a gap of [`Writer::image_in_pieces`]: the first time (`seq` `None`), commits what
    /// was queued before the image (`queued`, completing ticket `upto`) and returns the
    /// image's position; then commits what requests queued since. The image's position.
    pub(super) fn commit_queued(
        &mut self,
        queued: &mut Vec<Change>,
        upto: u64,
        seq: Option<u64>,
    ) -> Option<u64> {
        let at = match seq {
            Some(at) => at,
            None => {
                let before = std::mem::take(queued);
                if !before.is_empty() {
                    self.commit(before, upto)?;
                } else if !self.streaming() {
                    // Everything enqueued is in etcd already (appended by this writer).
                    self.master.journal.done(upto);
                }
                // (Those entries are in the image: a standby gets only the ones after it.)
                if let Some(s) = self.sync.as_mut() {
                    if let Some(c) = s.catch_up.as_mut() {
                        c.clear();
                    }
                    let seq = self.log.seq();
                    if s.tail().begin(seq, self.master.journal.now_us()) {
                        s.base(seq, false);
                    }
                }
                self.log.seq()
            }
        };
        self.commit_what_is_queued()?;
        Some(at)
    }

    /// The in-sync set became empty: writes the whole state to the etcd journal as a
    /// snapshot, and empties the set in the same transaction as the journal's new head; from
    /// then on changes are appended to etcd again.
    pub(super) fn rebase(&mut self) -> Option<()> {
        let started = Instant::now();
        if self.rebase_from_tail(started)? {
            return Some(());
        }
        // (Nothing is committed between the image's pieces: until the snapshot's head is in
        // etcd nothing can be made durable there.)
        let Frozen {
            queued,
            upto,
            image,
            ..
        } = self.image_in_pieces(false)?;
        let seq = self.log.next_seq();
        if !queued.is_empty() {
            self.broadcast(queued)?;
        }
        self.write_snapshot(image, seq, Some(self.insync_cleared()), false)?;
        self.insync_emptied(upto, started, 0);
        tracing::warn!(term = self.term(), seq, "HA replication: no standby is in sync; the state is in the etcd journal again (snapshot) and changes are written there");
        Some(())
    }

    /// The in-sync record, emptied by this leader (the rebase's last write).
    pub(super) fn insync_cleared(&self) -> (String, Vec<u8>) {
        (
            self.insync_key.clone(),
            InSync {
                term: self.term(),
                members: Vec::new(),
            }
            .to_bytes(),
        )
    }

    /// The rebase begun at `started` emptied the in-sync set in etcd, and everything up to
    /// `upto` is durable there (`tail_entries`: written from the [`Tail`], 0: the whole state).
    pub(super) fn insync_emptied(&mut self, upto: u64, started: Instant, tail_entries: u64) {
        if let Some(s) = self.sync.as_mut() {
            s.roster.emptied();
            s.release.clear();
            s.tail().clear();
        }
        let j = &self.master.journal;
        j.set_insync(&[]);
        j.done(upto);
        j.set_stats(|s| {
            s.rebase_ms = started.elapsed().as_millis() as u64;
            s.rebase_tail_entries = tail_entries;
        });
        self.update_grants(false);
    }

    /// The rebase when the entries the etcd journal lacks are all kept ([`Tail`]): they go to
    /// the log after its last position as they were streamed (consecutive entries sharing a
    /// value, several values per transaction: [`tail_log_values`]), then what is queued, as
    /// the writer appends it, and the in-sync set is emptied last. `Some(false)`: the tail is
    /// not whole (the caller writes the whole state).
    pub(super) fn rebase_from_tail(&mut self, started: Instant) -> Option<bool> {
        let seq = self.log.seq();
        let run = self.sync.as_ref().and_then(|s| s.tail().take(seq));
        let mut values = None;
        let from = Roster::rebase_from(run.as_ref().map(|r| r.last()), seq, || {
            values = run
                .as_ref()
                .and_then(|r| tail_log_values(self.log.prefix(), &r.frames));
            if values.is_none() {
                tracing::info!("HA journal: an entry streamed since the journal's last position does not fit a log value; the rebase writes the whole state");
            }
            values.is_some()
        });
        match (from, run, values) {
            (RebaseFrom::Tail, Some(run), Some(values)) => {
                self.rebase_with(values, run.base, run.frames.len() as u64, started)?;
                Some(true)
            }
            _ => Some(false),
        }
    }

    /// Writes `values`, the log after the etcd journal's last position `base` (`entries`
    /// streamed entries: [`tail_log_values`]), several per transaction, then what requests
    /// queued, as the writer appends it, and empties the in-sync set last.
    pub(super) fn rebase_with(
        &mut self,
        values: Vec<(String, Vec<u8>)>,
        base: u64,
        entries: u64,
        started: Instant,
    ) -> Option<()> {
        let (values_n, bytes) = (
            values.len() as u64,
            values.iter().map(|(_, v)| v.len() as u64).sum::<u64>(),
        );
        for t in JournalWriter::rebase_txns(values) {
            self.txn(&t)?;
        }
        self.log.rebased(bytes);
        let log_bytes = self.log.log_bytes();
        self.master.journal.set_stats(|s| {
            s.entries += values_n;
            s.log_bytes = log_bytes;
        });
        // What requests queued and no standby was sent: appended as the writer appends.
        let (queued, upto) = self.take_queued()?;
        if !queued.is_empty() {
            self.append(&queued)?;
            self.broadcast(queued)?;
        }
        self.put(vec![self.insync_cleared()])?;
        self.insync_emptied(upto, started, entries);
        tracing::warn!(term = self.term(), seq = self.log.seq(), base, entries, values = values_n, bytes, ms = started.elapsed().as_millis() as u64, "HA replication: no standby is in sync; the entries since the etcd journal's last position are in its log now, and changes are written there");
        Some(())
    }

    /// While standbys are in sync: a snapshot written to etcd in the background (requests
    /// are not held: their entries go to the standbys between its pieces and chunks), whose
    /// position starts a new run of the [`Tail`]. Given up (its chunks deleted) when an
    /// in-sync standby is late meanwhile: the rebase that follows uses the run it had.
    pub(super) fn refresh_base(&mut self) -> Option<()> {
        if let Some(s) = self.sync.as_ref() {
            s.tail().want_next();
        }
        let Frozen { image, seq, .. } = self.image_in_pieces(true)?;
        let at = seq.unwrap_or(self.log.seq());
        let written = self.write_snapshot(image, at, None, true)?;
        if let Some(s) = self.sync.as_ref() {
            // (The tail's machine decides what becomes of the run, and whether to tell.)
            let tell = s.tail().refreshed(written);
            if tell {
                s.base(at, true);
            }
        }
        Some(())
    }

    /// Writes a snapshot of the state after everything queued, then deletes the log it covers
    /// and the previous snapshot. Requests are not held for it: what they queue is committed
    /// to the log between the image's pieces and between the snapshot's chunks, after the
    /// image's position, which the snapshot's head names.
    pub(super) fn snapshot(&mut self) -> Option<()> {
        let Frozen { image, seq, .. } = self.image_in_pieces(true)?;
        let at = seq.unwrap_or(self.log.seq());
        self.write_snapshot(image, at, None, true).map(|_| ())
    }

    /// Writes `image` as the snapshot after entry `at`: its chunks, then the head (with `also`
    /// in the same transaction) deleting the log up to `at`, then the previous snapshot. With
    /// `commit_between`, what requests queue meanwhile is committed after each chunk and once
    /// more before the head (log entries after `at`, which the head keeps): so every change
    /// the image shows is in the log before the head names it.
    ///
    /// While standbys are in sync ([`Writer::refresh_base`]) it is given up, its chunks
    /// deleted, as soon as one of them is late (`Some(false)`): the writer must see to that
    /// first.
    pub(super) fn write_snapshot(
        &mut self,
        image: Vec<Change>,
        at: u64,
        also: Option<(String, Vec<u8>)>,
        commit_between: bool,
    ) -> Option<bool> {
        let started = Instant::now();
        // (Chunks a leader that died mid-snapshot left under this number.)
        let Some(clear) = self.log.begin_snapshot(at) else {
            // The head already names the snapshot after `at`: only `also` is left to write.
            if let Some(kv) = also {
                self.put(vec![kv])?;
            }
            return Some(true);
        };
        self.txn(&clear)?;
        // Encoded a part at a time, so that requests committed between chunks do not wait
        // for the whole image's encoding either.
        for part in image.chunks(SNAPSHOT_PART) {
            let chunks = match encode_chunks(part) {
                Ok(c) => c,
                Err(e) => {
                    tracing::error!("HA journal: {e}");
                    return None;
                }
            };
            for c in chunks {
                let n = c.len() as u64;
                self.txn(&self.log.chunk(c)?)?;
                self.log.chunk_written(n);
                if commit_between {
                    self.commit_what_is_queued()?;
                    if !self.failing_members().0.is_empty() {
                        tracing::info!(term = self.term(), seq = at, "HA journal: an in-sync standby is late; the background snapshot is given up");
                        if let Some(t) = self.log.abandon_snapshot() {
                            self.txn(&t)?;
                        }
                        return Some(false);
                    }
                }
            }
        }
        drop(image);
        if commit_between {
            self.commit_what_is_queued()?;
        }
        let rev = self.txn(&self.log.head_txn(also)?)?;
        let after = self.log.head_written(rev)?;
        if let Some(t) = after.delete_old {
            self.txn(&t)?;
        }
        if let Err(e) = self.etcd.compact(after.compact) {
            tracing::debug!("HA journal: compacting etcd: {e}");
        }
        let (bytes, chunks) = self.log.head().map_or((0, 0), |h| (h.bytes, h.chunks));
        let log_bytes = self.log.log_bytes();
        self.master.journal.set_stats(|s| {
            s.snapshots += 1;
            s.snapshot_bytes = bytes;
            s.snapshot_write_ms = started.elapsed().as_millis() as u64;
            // (What was appended after the image's position stays: about what was appended
            // while the chunks were written.)
            s.log_bytes = log_bytes;
        });
        tracing::info!(
            term = self.term(),
            seq = at,
            last = self.log.seq(),
            bytes,
            chunks,
            "HA journal: snapshot written, log compacted"
        );
        Some(true)
    }

    /// Deletes snapshot chunks that the head does not name (a leader that died between
    /// writing a new head and deleting the old snapshot leaves it behind).
    pub(super) fn collect_garbage(&self) -> Option<()> {
        for t in self.log.garbage() {
            self.txn(&t)?;
        }
        Some(())
    }

    /// Makes the etcd journal whole with the state this leader starts from (taken over from
    /// a mirror, or empty), and empties the in-sync set: from then on the journal in etcd is
    /// whole again. The etcd journal ends at entry `stored`; the state is the mirror's at
    /// entry `seq`, which kept `tail` ([`crate::ha::sync::Mirror::take`]). What is written
    /// is the tail's machine's decision ([`MirrorTail::takeover`]): the entries after
    /// `stored` up to `seq` as the mirror received them, to the log as a leader's rebase
    /// writes its own, or the whole state as a snapshot after the later of the two. Whether
    /// it wrote the tail (`Some(true)`) or the whole state.
    pub fn rebase_at_takeover(
        &mut self,
        stored: u64,
        seq: u64,
        tail: Option<&MirrorTail>,
    ) -> Option<bool> {
        let started = Instant::now();
        let mut values = None;
        let prefix = self.log.prefix().to_string();
        let plan = MirrorTail::takeover(tail, stored, seq, |frames| {
            values = tail_log_values(&prefix, frames);
            if values.is_none() {
                tracing::info!("HA journal: an entry the mirror received does not fit a log value; the takeover writes the whole state");
            }
            values.is_some()
        });
        let at = match (plan, values) {
            (Takeover::Tail(frames), Some(values)) => {
                self.log.set_seq(seq);
                return self
                    .rebase_with(values, stored, frames.len() as u64, started)
                    .map(|_| true);
            }
            // (A tail is planned only with its values made: not reached.)
            (Takeover::Tail(_), None) => seq.max(stored),
            (Takeover::Whole { at }, _) => at,
        };
        self.log.set_seq(at);
        self.rebase().map(|_| false)
    }
}
