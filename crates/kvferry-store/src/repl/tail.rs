//! The entries the etcd journal lacks while standbys are in sync, kept on both sides so that
//! a rebase (the leader's, when the in-sync set empties; a standby's, when it takes over)
//! writes those to the log instead of the whole state: the leader's [`Tail`] and a
//! standby's [`MirrorTail`], each a few [`Run`]s of consecutive entries' frames. No I/O and
//! no clock: time is microseconds on the driver's monotonic clock, passed in.

use std::sync::Arc;
use std::time::Duration;

/// One entry as a standby received it: its frame, holding the changes of the leader's log
/// entries `first..=last` (the entry after the one before it; a leader that appended them to
/// etcd in several values streams them as one).
#[derive(Debug, Clone)]
pub struct TailFrame {
    pub first: u64,
    pub last: u64,
    pub frame: Arc<Vec<u8>>,
}

/// The entries a standby received since where the leader's etcd journal is whole, as they
/// came: what that journal lacks while standbys are in sync, so a standby that takes over
/// writes those to its log instead of its whole state
/// (`crate::ha::journal::Writer::rebase_at_takeover`), as a leader's own rebase writes its
/// [`Tail`]. The leader says where runs start (`ToStandby::Base`): when the
/// in-sync set becomes non-empty and at each background snapshot's position. A run keeps
/// every entry after its start, in order, until it would pass the cap; then it is dropped
/// (the takeover writes the whole state) and nothing is kept until the next start, so the
/// cost is bounded as the leader's is (before, a window of the last entries kept every frame,
/// and cost the standby 5-10% of its rate on 2 vCPUs). At most two runs: the current one and
/// the one from a background snapshot whose head is not written yet. Each frame is shared by
/// the runs that keep it.
#[derive(Debug, Default, Clone)]
pub struct MirrorTail {
    /// Oldest first.
    runs: Vec<Run>,
    /// A joining standby's run, while its `ToStandby::Run` frames come.
    joining: Option<Box<Run>>,
}

/// A run of consecutive entries' frames after `base`, at most a cap of bytes: the leader's
/// [`Tail`] and a standby's [`MirrorTail`] keep theirs alike.
#[derive(Debug, Clone)]
pub struct Run {
    /// The etcd journal is (or will be) whole up to this entry; the frames follow it.
    pub base: u64,
    pub frames: Vec<TailFrame>,
    pub bytes: usize,
}

impl Run {
    pub fn at(base: u64) -> Run {
        Run {
            base,
            frames: Vec::new(),
            bytes: 0,
        }
    }

    pub fn last(&self) -> u64 {
        self.frames.last().map_or(self.base, |f| f.last)
    }

    /// Whether the run is still whole with the frame of the log's entries `first..=last`
    /// added (it must follow the run's last entry and fit `cap`; else nothing is added).
    pub fn push(&mut self, first: u64, last: u64, frame: &Arc<Vec<u8>>, cap: usize) -> bool {
        if first > last
            || self.last().checked_add(1) != Some(first)
            || self.bytes + frame.len() > cap
        {
            return false;
        }
        self.bytes += frame.len();
        self.frames.push(TailFrame {
            first,
            last,
            frame: Arc::clone(frame),
        });
        true
    }
}

impl MirrorTail {
    /// Whether any run is kept (a frame that no run wants is not kept at all).
    pub fn keeps(&self) -> bool {
        !self.runs.is_empty()
    }

    /// The frame of the log's entries `first..=last` came: added to every run it follows
    /// and fits (within `cap` bytes); a run it does not is dropped.
    pub fn push(&mut self, first: u64, last: u64, frame: Vec<u8>, cap: usize) {
        // (An entry after the image: a joining run that did not reach the image never will.)
        self.joining = None;
        if !self.keeps() {
            return;
        }
        let frame = Arc::new(frame);
        self.runs.retain_mut(|r| r.push(first, last, &frame, cap));
    }

    /// `ToStandby::Base` came with the mirror's last entry `at`.
    pub fn base(&mut self, seq: u64, written: bool, at: u64, cap: usize) {
        if cap == 0 {
            self.runs.clear();
            return;
        }
        if written {
            // (A run from elsewhere does not reach back to where the journal is now.)
            self.runs.retain(|r| r.base == seq);
        }
        if seq == at && !self.runs.iter().any(|r| r.base == seq) {
            self.runs.push(Run::at(seq));
            if self.runs.len() > 2 {
                self.runs.remove(0);
            }
        }
    }

    /// `ToStandby::Run` came with the mirror's last entry `at` (its image's position): the
    /// run from `base`, continued from the frame before if it is of the same `base`, kept once
    /// it reaches `at`, if its frames are consecutive from `base` and fit the cap. The frames
    /// are `(first, last, frame)`, made only as far as the run takes them.
    pub fn joined<F: Into<(u64, u64, Arc<Vec<u8>>)>>(
        &mut self,
        base: u64,
        frames: impl IntoIterator<Item = F>,
        at: u64,
        cap: usize,
    ) {
        let mut run = match self.joining.take() {
            Some(r) if r.base == base => *r,
            _ => Run::at(base),
        };
        for (first, last, frame) in frames.into_iter().map(Into::into) {
            if !run.push(first, last, &frame, cap) {
                return;
            }
        }
        match run.last() {
            l if l == at && cap > 0 => self.runs = vec![run],
            l if l < at => self.joining = Some(Box::new(run)),
            _ => {}
        }
    }

    /// What a standby that takes over at entry `seq` (its state's last) writes to the etcd
    /// journal, which ends at `stored`, to make it whole before it serves, `tail` being what
    /// its mirror kept (`None`: it leads from no mirror, as one that starts empty): the
    /// entries after `stored` up to `seq` from a run that has them, when each fits a log value
    /// (`fits`, given those frames), else its whole state as a snapshot after the later of the
    /// two (no mirror, a journal ahead of the mirror, no run reaching back to `stored`, or an
    /// entry too large). Decided here, written by the driver
    /// (`crate::ha::journal::Writer::rebase_at_takeover`) and the simulator alike.
    pub fn takeover(
        tail: Option<&MirrorTail>,
        stored: u64,
        seq: u64,
        fits: impl FnOnce(&[TailFrame]) -> bool,
    ) -> Takeover {
        let frames = tail
            .filter(|_| seq >= stored)
            .and_then(|t| t.after(stored, seq));
        match frames {
            Some(frames) if fits(&frames) => Takeover::Tail(frames),
            _ => Takeover::Whole {
                at: seq.max(stored),
            },
        }
    }

    /// Bytes of frames kept.
    pub fn bytes(&self) -> usize {
        self.runs.iter().map(|r| r.bytes).sum()
    }

    /// Where the newest run starts, if one is kept.
    pub fn newest_base(&self) -> Option<u64> {
        self.runs.last().map(|r| r.base)
    }

    /// The entries after `stored` up to `upto` from a run that has them ([`tail_after`]);
    /// `Some` and empty when `stored` is `upto` (the journal holds everything).
    pub fn after(&self, stored: u64, upto: u64) -> Option<Vec<TailFrame>> {
        if stored == upto {
            return Some(Vec::new());
        }
        self.runs
            .iter()
            .rev()
            .find_map(|r| tail_after(&r.frames, stored, upto))
    }
}

/// What a standby's takeover writes to the etcd journal ([`MirrorTail::takeover`]).
#[derive(Debug, Clone)]
pub enum Takeover {
    /// These entries (after where the journal ends), to its log as a leader's rebase writes
    /// its own; the log then continues after the last.
    Tail(Vec<TailFrame>),
    /// The whole state, as the snapshot after entry `at`.
    Whole { at: u64 },
}

/// The entries after `stored` up to `upto` among `frames` (consecutive, oldest first): `None`
/// when they do not reach back to `stored`'s successor, do not end at `upto`, or no frame
/// starts right after `stored` (the journal ends inside one).
pub fn tail_after(frames: &[TailFrame], stored: u64, upto: u64) -> Option<Vec<TailFrame>> {
    if stored == upto {
        return Some(Vec::new());
    }
    if frames.last().map(|f| f.last) != Some(upto) {
        return None;
    }
    let from = frames
        .iter()
        .position(|f| Some(f.first) == stored.checked_add(1))?;
    frames.get(from..).map(<[TailFrame]>::to_vec)
}

/// The entries streamed to the in-sync standbys since the etcd journal's last position, which
/// the etcd journal does not have (it is not written while standbys are in sync): kept so
/// that when the in-sync set empties, the rebase writes them to the log after that position
/// (a few transactions) instead of the whole state, which grows with the pool (at a million
/// objects on the dev VM, `store-bench --ha --ha-parts rebase`: changing requests held 1.85 s
/// for the whole state, 0.17 s for a tail of 13 MB). A run starts where
/// the etcd journal is whole: when the set becomes non-empty (everything before was appended
/// to etcd), and again after each background snapshot written while standbys are in sync
/// (`crate::ha::journal::Writer`'s `refresh_base`, once a run outgrew the cap, at most every `every`,
/// `crate::ha::journal::BASE_EVERY` by default). A run that misses an entry or outgrows `cap` bytes of frames is
/// dropped: the rebase then writes the whole state, as before. The frames are the ones sent
/// to the standbys (shared, not copied).
pub struct Tail {
    cap: usize,
    every: Duration,
    /// The run the etcd journal's head (or its log) ends at.
    cur: Option<Run>,
    /// The run from a background snapshot's position, until its head is written.
    next: Option<Run>,
    /// The next image's position starts `next` ([`Tail::begin`]).
    want_next: bool,
    /// When the last run started (µs).
    started: u64,
    /// When the figures last showed its size, and whether a run was kept then
    /// ([`Tail::size_to_show`]).
    shown: Option<(u64, bool)>,
}

/// How often the journal's figures show the tail's size.
const TAIL_SHOWN_EVERY: Duration = Duration::from_millis(200);

fn since(now: u64, then: u64) -> Duration {
    Duration::from_micros(now.saturating_sub(then))
}

impl Tail {
    /// A tail of at most `cap` bytes of frames per run (0: none is kept), refreshed at most
    /// `every`, made at `now`.
    pub fn new(cap: usize, every: Duration, now: u64) -> Tail {
        Tail {
            cap,
            every,
            cur: None,
            next: None,
            want_next: false,
            started: now,
            shown: None,
        }
    }

    pub fn push(&mut self, seq: u64, frame: &Arc<Vec<u8>>) {
        let cap = self.cap;
        for r in [&mut self.cur, &mut self.next] {
            if r.as_mut()
                .is_some_and(|run| !run.push(seq, seq, frame, cap))
            {
                *r = None;
            }
        }
    }

    /// The etcd journal is whole up to `base` at `now`: a run starts there.
    pub fn start(&mut self, base: u64, now: u64) {
        self.clear();
        if self.cap > 0 {
            self.cur = Some(Run::at(base));
        }
        self.started = now;
    }

    pub fn clear(&mut self) {
        (self.cur, self.next, self.want_next) = (None, None, false);
    }

    /// An image's position is `at`: the run after it starts, if one was asked for (whether
    /// it did).
    pub fn begin(&mut self, at: u64, now: u64) -> bool {
        if std::mem::take(&mut self.want_next) && self.cap > 0 {
            self.next = Some(Run::at(at));
            self.started = now;
            return true;
        }
        false
    }

    /// The next image's position is to start a run ([`Tail::begin`]).
    pub fn want_next(&mut self) {
        self.want_next = true;
    }

    /// The background snapshot begun for a new run (`crate::ha::journal::Writer`'s
    /// `refresh_base`) ended: its head `written`, or given up (an in-sync standby was late
    /// meanwhile, and the writer must see to that first). Written, the run from its position
    /// is the current one, and the standbys that take runs are to be told that the journal is
    /// whole there (`ToStandby::Base` with `written`: what this returns); given up, that run
    /// goes, and the current one (if any) stays.
    pub fn refreshed(&mut self, written: bool) -> bool {
        if written {
            if let Some(r) = self.next.take() {
                self.cur = Some(r);
            }
        } else {
            self.next = None;
        }
        written
    }

    /// Where the current run starts and its frames up to entry `at` (for a standby whose
    /// image is at `at`: `ToStandby::Run`), if it is whole that far.
    pub fn upto(&self, at: u64) -> Option<(u64, Vec<TailFrame>)> {
        let r = self
            .cur
            .as_ref()
            .filter(|r| r.base <= at && r.last() >= at)?;
        let n = r.frames.partition_point(|f| f.last <= at);
        let frames = r.frames[..n].to_vec();
        (frames.last().map_or(r.base, |f| f.last) == at).then_some((r.base, frames))
    }

    /// The current run, if it is whole up to entry `upto`; the tail is empty after.
    pub fn take(&mut self, upto: u64) -> Option<Run> {
        let r = self.cur.take();
        self.clear();
        r.filter(|r| r.last() == upto)
    }

    /// Whether a background snapshot is due: the current run was dropped (it outgrew its
    /// cap), `every` after the last run started. (A run that is still whole needs none: the
    /// rebase would write at most the cap.)
    pub fn refresh_due(&self, now: u64) -> bool {
        self.cap > 0 && self.cur.is_none() && since(now, self.started) >= self.every
    }

    /// Bytes of the current run's frames, and whether there is one.
    pub fn size(&self) -> (u64, bool) {
        self.cur
            .as_ref()
            .map_or((0, false), |r| (r.bytes as u64, true))
    }

    /// [`Tail::size`] for the journal's figures when whether a run is kept changed since they
    /// last showed it, else at most every `TAIL_SHOWN_EVERY` (the writer turns once per
    /// commit: the figures' lock each time would be one more on the request path).
    pub fn size_to_show(&mut self, now: u64) -> Option<(u64, bool)> {
        let (bytes, whole) = self.size();
        if self
            .shown
            .is_some_and(|(t, w)| w == whole && since(now, t) < TAIL_SHOWN_EVERY)
        {
            return None;
        }
        self.shown = Some((now, whole));
        Some((bytes, whole))
    }
}
