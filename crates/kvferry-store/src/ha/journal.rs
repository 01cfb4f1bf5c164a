//! The HA leader's journal in etcd: every durable change of the master's state is written to
//! etcd before the request that made it is answered, so a new leader starts with everything
//! its predecessor acknowledged.
//!
//! Keys under `mooncake-store/<cluster_id>/journal/`:
//! - `log/<seq, 16 hex digits>`: postcard-encoded `Vec<Change>` (at most [`CHUNK`] bytes,
//!   LZ4-compressed behind a magic when that makes it smaller: see [`encode_chunks`]; a
//!   rebase from the [`Tail`] puts consecutive entries in one value behind `RANGE_MAGIC`,
//!   which names the last, under the first one's key),
//!   written in order by one writer thread, each in a transaction guarded by the leader's view
//!   key still being the one it created (its term): a deposed leader cannot append.
//! - `snap/<seq>/<i>`: a snapshot, the whole state after `log/<seq>` in chunks; `head` names
//!   the current one ([`Head`]). Written when the log since the last snapshot outgrows the
//!   snapshot (at least [`SNAPSHOT_MIN`] bytes): the log up to `seq` and the older snapshot are
//!   deleted in the same guarded transaction, and etcd's history compacted, so etcd holds at
//!   most about two snapshots plus their size of log.
//! - `term`: the term of the last leader that loaded the journal (see [`load`]).
//!
//! Group commit: request threads apply their change to the state, collect the marked changes
//! into the queue ([`JournalCore::collect`]) and wait for the writer ([`JournalCore::wait`]); the writer
//! takes everything queued in one etcd request (about 1 ms with fsync on this project's VM,
//! shared by every request queued meanwhile). With `--ha-replication standbys` the same writer
//! streams each batch to the standbys ([`Replicas`], [`super::sync`]) and, while the in-sync
//! set is not empty, does not write etcd: it sends the next batch without waiting, and the
//! threads reading the standbys' acknowledgements answer the requests ([`Release`]); when the
//! set empties it makes the etcd journal whole first ([`Writer`]'s `rebase`): it writes the
//! entries streamed since the journal was last whole, which it keeps ([`Tail`]), or else its
//! whole state as a snapshot. While it
//! sleeps it lends its links (`Lent`): a request that finds nothing in flight sends its
//! entry itself, one hop fewer.

use crate::error::StoreError;
use crate::master::journal::{Change, Image, IMAGE_PIECES};
use crate::master::State;
use crate::node::Master;
use kvferry::metadata::etcd::{EtcdClient, Owner};
use serde::{Deserialize, Serialize};
use super::link::{image_frames, run_frames, AckSink, Link, IMAGE_ENCODE_HOLD};
use super::sync::{InSync, Run, TailFrame, ToStandby};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The bytes of a segment's pool of space granted ahead to puts, by default (`--ha-grant-bytes`).
pub const GRANT_DEFAULT: u64 = 64 << 20;

/// Largest encoded value written to one key (etcd refuses requests over 1.5 MiB by default;
/// base64 in the JSON gateway adds a third).
pub const CHUNK: usize = 512 << 10;

/// The longest a leader holds the state's lock while it takes an image (a standby that
/// links, a snapshot): past it, the lock is let go between two pieces for [`IMAGE_GAP`].
const IMAGE_HOLD: Duration = Duration::from_millis(5);
const IMAGE_GAP: Duration = Duration::from_micros(200);

/// What [`Writer::image_in_pieces`] took.
struct Frozen {
    /// Queued before the image and not committed yet (none when `seq` is set).
    queued: Vec<Change>,
    /// The ticket `queued` completes.
    upto: u64,
    image: Vec<Change>,
    /// The image's position when what was queued was committed while it was taken.
    seq: Option<u64>,
}
/// A snapshot is written once the log since the last one is larger than this and than the
/// last snapshot.
pub const SNAPSHOT_MIN: u64 = 8 << 20;

/// How many of an image's changes a snapshot encodes at a time ([`Writer::write_snapshot`]):
/// a few chunks' worth.
const SNAPSHOT_PART: usize = 16_384;

/// `journal/head`: where the current snapshot is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Head {
    /// The snapshot holds the state after `log/<seq>` (0: after nothing).
    pub seq: u64,
    pub chunks: u32,
    pub bytes: u64,
}

pub fn prefix(cluster_id: &str) -> String {
    let id = cluster_id.strip_suffix('/').unwrap_or(cluster_id);
    format!("mooncake-store/{id}/journal/")
}

fn log_key(p: &str, seq: u64) -> String {
    format!("{p}log/{seq:016x}")
}

fn snap_dir(p: &str, seq: u64) -> String {
    format!("{p}snap/{seq:016x}/")
}

/// The key right after every key starting with `p` (etcd's prefix range end).
fn prefix_end(p: &str) -> String {
    let mut b = p.as_bytes().to_vec();
    if let Some(last) = b.last_mut() {
        *last += 1;
    }
    String::from_utf8_lossy(&b).into_owned()
}

/// A stored value that starts with this is an LZ4 block of the postcard encoding (its size,
/// u32 little-endian, after the magic); any other value is the bare postcard encoding (what
/// builds before compression wrote, and what is kept when compressing does not pay). A bare
/// `Vec<Change>` cannot start with it: its second byte would be a `Change` variant number
/// beyond the few there are.
const LZ4_MAGIC: &[u8; 4] = b"KVFz";
/// A log value that holds several entries starts with this, then the last entry's number (8
/// bytes, little-endian), then the stored value of their changes; its key names the first.
/// Written only by a rebase from the [`Tail`] (thousands of small entries in a few values);
/// every other value holds the one entry its key names. It cannot start a bare value either,
/// for the same reason as [`LZ4_MAGIC`]. Builds before it refuse such a journal (an entry
/// that does not decode): the masters of a cluster are upgraded together.
const RANGE_MAGIC: &[u8; 4] = b"KVFn";

/// The last entry a log value under `first`'s key holds, and the stored value of its changes.
fn log_range(first: u64, v: &[u8]) -> Result<(u64, &[u8]), String> {
    let Some(rest) = v.strip_prefix(RANGE_MAGIC) else { return Ok((first, v)) };
    let (last, rest) = rest.split_first_chunk::<8>().ok_or("a journal entry's range is cut short")?;
    let last = u64::from_le_bytes(*last);
    if last < first {
        return Err(format!("a journal entry under number {first} claims to end at {last}: it is corrupt"));
    }
    Ok((last, rest))
}

/// The largest decoded size a compressed value may claim (a raw chunk is at most [`CHUNK`],
/// one change larger than that gets a value of its own): a corrupt size is refused, never
/// allocated.
const MAX_DECODED: usize = 64 << 20;

/// A value as stored: compressed when that makes it smaller. etcd spends ~50 ns of CPU per
/// byte of a transaction on this project's VM (`docs/BENCHMARKS.md`), so every byte saved here
/// is etcd CPU saved, in the log as in snapshots.
fn pack(raw: Vec<u8>) -> Vec<u8> {
    let compressed = lz4_flex::block::compress(&raw);
    if compressed.len() + LZ4_MAGIC.len() + 4 >= raw.len() {
        return raw;
    }
    let mut v = Vec::with_capacity(LZ4_MAGIC.len() + 4 + compressed.len());
    v.extend_from_slice(LZ4_MAGIC);
    v.extend_from_slice(&(raw.len() as u32).to_le_bytes());
    v.extend_from_slice(&compressed);
    v
}

/// The postcard bytes of a stored value.
fn unpack(v: &[u8]) -> Result<std::borrow::Cow<'_, [u8]>, String> {
    let Some(rest) = v.strip_prefix(LZ4_MAGIC) else { return Ok(std::borrow::Cow::Borrowed(v)) };
    let (size, block) = rest.split_first_chunk::<4>().ok_or("a compressed journal entry is cut short")?;
    let size = u32::from_le_bytes(*size) as usize;
    if size > MAX_DECODED {
        return Err(format!("a compressed journal entry claims {size} bytes (at most {MAX_DECODED}): it is corrupt"));
    }
    let raw = lz4_flex::block::decompress(block, size).map_err(|e| format!("a compressed journal entry does not decompress ({e}): it is corrupt"))?;
    if raw.len() != size {
        return Err(format!("a compressed journal entry decompresses to {} bytes, not the {size} it claims: it is corrupt", raw.len()));
    }
    Ok(std::borrow::Cow::Owned(raw))
}

/// Encodes `changes` into values of at most [`CHUNK`] bytes (one change larger than that gets
/// a value of its own), each compressed when that pays.
pub fn encode_chunks(changes: &[Change]) -> Result<Vec<Vec<u8>>, StoreError> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut size = 0usize;
    for (i, c) in changes.iter().enumerate() {
        let n = postcard::experimental::serialized_size(c).map_err(|e| StoreError::Internal(format!("journal: encoding a change: {e}")))?;
        // (`CHUNK - 16`: room for the vector's length prefix.)
        if i > start && size + n > CHUNK - 16 {
            out.push(pack(postcard::to_stdvec(&changes[start..i]).map_err(|e| StoreError::Internal(format!("journal: encoding: {e}")))?));
            start = i;
            size = 0;
        }
        size += n;
    }
    if start < changes.len() {
        out.push(pack(postcard::to_stdvec(&changes[start..]).map_err(|e| StoreError::Internal(format!("journal: encoding: {e}")))?));
    }
    Ok(out)
}

/// The changes of one stored value (compressed or bare).
pub fn decode_chunk(v: &[u8]) -> Result<Vec<Change>, String> {
    postcard::from_bytes(&unpack(v)?).map_err(|e| format!("a journal entry is not readable ({e}); was it written by another kvferry version?"))
}

/// What [`load`] found.
pub struct Loaded {
    pub image: Image,
    /// The last log entry's sequence number (the next entry gets the one after).
    pub seq: u64,
    /// The leader that last loaded the journal (its view key's creation), if any.
    pub last_leader: Option<Owner>,
    pub head: Option<Head>,
    pub log_entries: usize,
    pub bytes: u64,
}

/// Reads the journal: the snapshot `head` names, then every log entry after it, in order.
pub fn load(etcd: &EtcdClient, cluster_id: &str) -> Result<Loaded, String> {
    let p = prefix(cluster_id);
    // What is stored cannot be read (no leader can start from it): what the operator can do.
    let corrupt = |e: String| format!("{e}; no master can lead from this journal: restore etcd's data from a backup, or delete the keys under {p} to start this cluster empty (every object it held is then lost)");
    let mut image = Image::default();
    let mut bytes = 0u64;
    let head = match etcd.get_kv(&format!("{p}head")).map_err(|e| e.to_string())? {
        Some(kv) => Some(postcard::from_bytes::<Head>(&kv.value).map_err(|e| corrupt(format!("the journal head is not readable ({e})")))?),
        None => None,
    };
    let after = head.map_or(0, |h| h.seq);
    if let Some(h) = head {
        let dir = snap_dir(&p, h.seq);
        let chunks = etcd.range(&dir, &prefix_end(&dir), 64).map_err(|e| e.to_string())?;
        if chunks.len() != h.chunks as usize {
            return Err(corrupt(format!("the journal snapshot {dir} has {} of its {} chunks: etcd lost part of it", chunks.len(), h.chunks)));
        }
        for (_, kv) in chunks {
            bytes += kv.value.len() as u64;
            for c in decode_chunk(&kv.value).map_err(corrupt)? {
                image.apply(c);
            }
        }
    }
    let first = after.checked_add(1).ok_or_else(|| corrupt(format!("the journal's head names entry {after}, the last there can be")))?;
    let logs = etcd.range(&log_key(&p, first), &prefix_end(&format!("{p}log/")), 256).map_err(|e| e.to_string())?;
    let mut seq = after;
    let log_entries = logs.len();
    for (key, kv) in logs {
        let n = key.rsplit('/').next().and_then(|h| u64::from_str_radix(h, 16).ok()).ok_or_else(|| corrupt(format!("unexpected journal key {key}")))?;
        if Some(n) != seq.checked_add(1) {
            return Err(corrupt(format!("the journal skips from entry {seq} to {n}: etcd lost part of it")));
        }
        let (last, value) = log_range(n, &kv.value).map_err(corrupt)?;
        seq = last;
        bytes += kv.value.len() as u64;
        for c in decode_chunk(value).map_err(corrupt)? {
            image.apply(c);
        }
    }
    let last_leader = last_leader(etcd, cluster_id)?;
    Ok(Loaded { image, seq, last_leader, head, log_entries, bytes })
}

/// The leader that last loaded the journal (its `term` marker), if any.
pub fn last_leader(etcd: &EtcdClient, cluster_id: &str) -> Result<Option<Owner>, String> {
    Ok(match etcd.get_kv(&format!("{}term", prefix(cluster_id))).map_err(|e| e.to_string())? {
        Some(kv) => parse_term_marker(&String::from_utf8_lossy(&kv.value)),
        None => None,
    })
}

/// The journal's head and the largest entry number stored (head or log), without decoding
/// the entries: where a leader that does not load the journal (it starts from a standby's
/// mirror, or empty) continues the numbering.
pub fn stored_seq(etcd: &EtcdClient, cluster_id: &str) -> Result<(u64, Option<Head>), String> {
    let p = prefix(cluster_id);
    let head = match etcd.get_kv(&format!("{p}head")).map_err(|e| e.to_string())? {
        Some(kv) => postcard::from_bytes::<Head>(&kv.value).ok(),
        None => None,
    };
    let mut seq = head.map_or(0, |h| h.seq);
    let log = format!("{p}log/");
    for (key, kv) in etcd.range(&log, &prefix_end(&log), 256).map_err(|e| e.to_string())? {
        if let Some(n) = key.rsplit('/').next().and_then(|h| u64::from_str_radix(h, 16).ok()) {
            seq = seq.max(log_range(n, &kv.value).map_or(n, |(last, _)| last));
        }
    }
    Ok((seq, head))
}

/// What answers a request whose changes are not yet durable ([`JournalCore::defer`]): called
/// once with `Ok` when they are, or with the error to answer instead.
pub type Answer = Box<dyn FnOnce(Result<(), StoreError>) + Send>;

/// A deferred answer, answered exactly once: if it is dropped unanswered (a path that forgot
/// it), it answers that its outcome is unknown, so no client is left waiting.
struct Later {
    since: Instant,
    answer: Option<Answer>,
}

impl Later {
    fn answer(mut self, r: Result<(), StoreError>) {
        if let Some(a) = self.answer.take() {
            a(r);
        }
    }
}

impl Drop for Later {
    fn drop(&mut self) {
        if let Some(a) = self.answer.take() {
            a(outcome_unknown());
        }
    }
}

/// Answers taken out of the queue under its lock, answered after it is released.
fn answer_all(later: impl IntoIterator<Item = Later>, r: impl Fn() -> Result<(), StoreError>) {
    for l in later {
        l.answer(r());
    }
}

/// What a request whose changes were applied and not yet durable is answered when the term
/// ends first: not `NotLeader` (which says nothing was applied, and that a client may send the
/// request again to the new leader), since the change may have reached it.
fn outcome_unknown() -> Result<(), StoreError> {
    Err(StoreError::OutcomeUnknown)
}

/// What a request is answered when its changes were not durable within `bound`.
fn not_durable(bound: Duration) -> Result<(), StoreError> {
    Err(StoreError::Rpc(format!("the master could not make the change durable (in its etcd journal or on its in-sync standbys) within {bound:?}; the request may not survive a failover, retry it")))
}

#[derive(Default)]
struct Queue {
    /// Journaling for this term (0: not leading).
    term: i64,
    changes: Vec<Change>,
    /// Collections with changes, counted; `written` of them are durable.
    enqueued: u64,
    written: u64,
    /// The writer gave up (etcd unreachable past the fence bound, or the key is not ours):
    /// nothing more is acknowledged in this term.
    failed: bool,
    /// The master is stopping: the writer puts the whole state in etcd (if standbys
    /// acknowledged it) and fences the leader; `handed_off` once done.
    handoff: bool,
    handed_off: bool,
    /// A standby's link broke since the writer last looked ([`JournalCore::kick`]).
    kicked: bool,
    /// The writer sleeps for work: the next collection wakes it (and clears this). A wake-up
    /// is a system call even when nobody sleeps (std's condition variables do not count
    /// their waiters), and a busy writer needs none: it looks at the queue before it sleeps.
    writer_asleep: bool,
    /// Threads sleeping in [`JournalCore::wait`] or [`JournalCore::hand_off`] (deferred answers
    /// need no wake-up).
    waiting: usize,
    /// Answers waiting for their ticket to be written, of this term only (taken out and
    /// answered whenever the term ends, fails or restarts).
    later: std::collections::BTreeMap<u64, Vec<Later>>,
    /// The writer's way to the standbys while it sleeps and streams ([`Lent`]).
    lent: Option<Lent>,
    /// (ticket, grant number): every grant up to the number is in the changes that the
    /// ticket completes (noted when changes are taken from the state, under its lock:
    /// [`crate::master::grants_issued`]).
    grant_marks: std::collections::VecDeque<(u64, u64)>,
}

/// What a streaming writer lends the request threads while it sleeps, so that a request whose
/// changes find it asleep with every entry acknowledged (a leader not under load) sends their
/// entry itself ([`JournalCore::collect_held`]): the writer's wake-up, a system call and two
/// switches, was one of the three hops a replicated request added (1 connection × 1 key:
/// +15% objects/s). Under load (an entry in flight) the changes wait for the writer as before,
/// which takes in one entry what comes meanwhile: sent by their own threads, every request
/// was an entry and an acknowledgement of its own, and the threads queued on the lock behind
/// each other's sends (16 and 64 connections × 32 keys 7-10% slower). Lent and taken back
/// under the queue's lock, and used only under it, so entries still leave one at a time, in
/// order, and the writer finds everything as the last sender left it (its sequence number
/// included).
pub(crate) struct Lent {
    /// The last entry sent.
    seq: u64,
    links: Vec<Link>,
    release: Arc<Release>,
    tail: Arc<Mutex<Tail>>,
}

/// The default cap of the [`Tail`] (`--ha-rebase-tail-bytes`).
pub const TAIL_DEFAULT: u64 = 64 << 20;

/// A background snapshot refreshes the etcd journal's base while standbys are in sync at most
/// this often by default ([`Tail`], `--ha-rebase-base-every`).
pub const BASE_EVERY: Duration = Duration::from_secs(60);

/// The entries streamed to the in-sync standbys since the etcd journal's last position, which
/// the etcd journal does not have (it is not written while standbys are in sync): kept so
/// that when the in-sync set empties, the rebase writes them to the log after that position
/// (a few transactions) instead of the whole state, which grows with the pool (at a million
/// objects on the dev VM, `store-bench --ha --ha-parts rebase`: changing requests held 1.85 s
/// for the whole state, 0.17 s for a tail of 13 MB). A run starts where
/// the etcd journal is whole: when the set becomes non-empty (everything before was appended
/// to etcd), and again after each background snapshot written while standbys are in sync
/// ([`Writer`]'s `refresh_base`, once a run outgrew the cap, at most every `every`,
/// [`BASE_EVERY`] by default). A run that misses an entry or outgrows `cap` bytes of frames is
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
    /// When the last run started.
    started: Instant,
    /// When the figures last showed its size, and whether a run was kept then
    /// ([`Tail::size_to_show`]).
    shown: Option<(Instant, bool)>,
}

/// How often the journal's figures show the tail's size.
const TAIL_SHOWN_EVERY: Duration = Duration::from_millis(200);

impl Tail {
    /// A tail of at most `cap` bytes of frames per run (0: none is kept), refreshed at most
    /// `every`.
    pub fn new(cap: usize, every: Duration) -> Tail {
        Tail { cap, every, cur: None, next: None, want_next: false, started: Instant::now(), shown: None }
    }

    fn push(&mut self, seq: u64, frame: &Arc<Vec<u8>>) {
        let cap = self.cap;
        for r in [&mut self.cur, &mut self.next] {
            if r.as_mut().is_some_and(|run| !run.push(seq, seq, frame, cap)) {
                *r = None;
            }
        }
    }

    /// The etcd journal is whole up to `base`: a run starts there.
    fn start(&mut self, base: u64) {
        self.clear();
        if self.cap > 0 {
            self.cur = Some(Run::at(base));
        }
        self.started = Instant::now();
    }

    fn clear(&mut self) {
        (self.cur, self.next, self.want_next) = (None, None, false);
    }

    /// An image's position is `at`: the run after it starts, if one was asked for (whether
    /// it did).
    fn begin(&mut self, at: u64) -> bool {
        if std::mem::take(&mut self.want_next) && self.cap > 0 {
            self.next = Some(Run::at(at));
            self.started = Instant::now();
            return true;
        }
        false
    }

    /// The background snapshot's head is written: its run is the current one.
    fn based(&mut self) {
        if let Some(r) = self.next.take() {
            self.cur = Some(r);
        }
    }

    /// Where the current run starts and its frames up to entry `at` (for a standby whose
    /// image is at `at`: [`ToStandby::Run`]), if it is whole that far.
    fn upto(&self, at: u64) -> Option<(u64, Vec<TailFrame>)> {
        let r = self.cur.as_ref().filter(|r| r.base <= at && r.last() >= at)?;
        let n = r.frames.partition_point(|f| f.last <= at);
        let frames = r.frames[..n].to_vec();
        (frames.last().map_or(r.base, |f| f.last) == at).then_some((r.base, frames))
    }

    /// The current run, if it is whole up to entry `upto`; the tail is empty after.
    fn take(&mut self, upto: u64) -> Option<Run> {
        let r = self.cur.take();
        self.clear();
        r.filter(|r| r.last() == upto)
    }

    /// Whether a background snapshot is due: the current run was dropped (it outgrew its
    /// cap), `every` after the last run started. (A run that is still whole needs none: the
    /// rebase would write at most the cap.)
    fn refresh_due(&self) -> bool {
        self.cap > 0 && self.cur.is_none() && self.started.elapsed() >= self.every
    }

    /// Bytes of the current run's frames, and whether there is one.
    fn size(&self) -> (u64, bool) {
        self.cur.as_ref().map_or((0, false), |r| (r.bytes as u64, true))
    }

    /// [`Tail::size`] for the journal's figures when whether a run is kept changed since they
    /// last showed it, else at most every [`TAIL_SHOWN_EVERY`] (the writer turns once per
    /// commit: the figures' lock each time would be one more on the request path).
    fn size_to_show(&mut self) -> Option<(u64, bool)> {
        let (bytes, whole) = self.size();
        if self.shown.is_some_and(|(t, w)| w == whole && t.elapsed() < TAIL_SHOWN_EVERY) {
            return None;
        }
        self.shown = Some((Instant::now(), whole));
        Some((bytes, whole))
    }
}

impl Queue {
    /// The writer sleeps with its links lent and nothing is in flight: the next changes go
    /// out on their request's thread ([`JournalCore::collect_held`]).
    fn lends(&self) -> bool {
        self.lent.as_ref().is_some_and(|l| l.release.all_acknowledged()) && !self.failed && !self.kicked && !self.handoff
    }

    /// The changes just enqueued (ticket `enqueued`) hold every grant up to `issued`.
    fn note_grants(&mut self, issued: u64) {
        if self.grant_marks.back().is_none_or(|&(_, g)| g < issued) && issued > 0 {
            self.grant_marks.push_back((self.enqueued, issued));
        }
    }

    /// The highest grant number whose ticket is written now (taken out), if any.
    fn grants_written(&mut self) -> Option<u64> {
        let mut out = None;
        while let Some(&(ticket, g)) = self.grant_marks.front() {
            if ticket > self.written {
                break;
            }
            out = Some(g);
            self.grant_marks.pop_front();
        }
        out
    }

    /// Everything queued, and the ticket that completes it.
    fn take(&mut self) -> (Vec<Change>, u64) {
        (std::mem::take(&mut self.changes), self.enqueued)
    }

    /// The deferred answers whose tickets are written.
    fn take_written(&mut self) -> Vec<Later> {
        let mut out = Vec::new();
        while let Some(e) = self.later.first_entry() {
            if *e.key() > self.written {
                break;
            }
            out.extend(e.remove());
        }
        out
    }

    fn take_later(&mut self) -> Vec<Later> {
        std::mem::take(&mut self.later).into_values().flatten().collect()
    }
}

/// Counters shown on `/ha_status` and `/metrics`.
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub struct JournalStats {
    /// Log entries written in this term (one etcd transaction each).
    pub entries: u64,
    /// Changes those entries carried (group commit: every change queued while the previous
    /// transaction was in flight goes in the next).
    pub changes: u64,
    /// Microseconds spent in those transactions (request sent to answer read).
    pub write_us: u64,
    /// Bytes of log written since the last snapshot.
    pub log_bytes: u64,
    /// Size of the current snapshot.
    pub snapshot_bytes: u64,
    pub snapshots: u64,
    /// How long the last snapshot's chunks and head took to encode and write (milliseconds;
    /// a rebase's requests wait that long).
    pub snapshot_write_ms: u64,
    /// Collections queued and not yet durable.
    pub lag: u64,
    /// The last sequence number written.
    pub seq: u64,
    /// Entries acknowledged by the in-sync standbys instead of etcd (`--ha-replication
    /// standbys`), and the microseconds spent waiting for them.
    pub streamed: u64,
    pub stream_wait_us: u64,
    /// Standbys in the in-sync set now.
    pub insync: u64,
    /// How long the last rebase (the in-sync set emptied) held changing requests
    /// (milliseconds), and how many entries it wrote from the [`Tail`] (0: it wrote the whole
    /// state as a snapshot).
    pub rebase_ms: u64,
    pub rebase_tail_entries: u64,
    /// The entries kept for the next rebase ([`Tail`]): bytes, and whether they are whole
    /// since the etcd journal's last position (otherwise it writes the whole state).
    pub tail_bytes: u64,
    pub tail_whole: bool,
    /// How long this leader's takeover took to rebuild the master's state (milliseconds),
    /// and whether it was built ahead from its mirror while the dead leader's lease ran out
    /// (`sync::Mirror::prebuild`: what is left is making it this term's).
    pub takeover_rebuild_ms: u64,
    pub takeover_prebuilt: bool,
    /// Requests answered before their changes were acknowledged in this term: puts placed in
    /// space whose grant was ("Puts answered before their start is acknowledged" in
    /// ARCHITECTURE.md).
    pub early_answers: u64,
    /// The writer sleeps with its links lent and every entry acknowledged: a request's changes
    /// go out now on the request's own thread (`Lent`; read when the figures are).
    pub lending: bool,
}

/// Condition variables the waiting requests are spread over, by ticket.
const WAKE_SLOTS: usize = 16;

/// The leader's journal queue (inactive, costing nothing, without HA or while standing by).
/// Shared ([`JournalCore`]) with the threads that read the standbys' acknowledgements, which
/// answer the requests whose entries every in-sync standby acknowledged ([`Release`]).
#[derive(Default)]
pub struct Journal {
    core: Arc<JournalCore>,
}

impl std::ops::Deref for Journal {
    type Target = JournalCore;
    fn deref(&self) -> &JournalCore {
        &self.core
    }
}

#[derive(Default)]
pub struct JournalCore {
    q: Mutex<Queue>,
    /// Wakes the writer.
    work: Condvar,
    /// Wakes the requests waiting for their changes to be durable: a request waits on the
    /// slot of its ticket, so a commit wakes only the requests it completes (those that
    /// collected after the batch was taken sleep on until theirs).
    durable: [Condvar; WAKE_SLOTS],
    stats: Mutex<JournalStats>,
    /// The in-sync standbys (member ids) while this master leads.
    insync: Mutex<Vec<String>>,
    /// Grants of space ahead ([`crate::master::State::set_grant_bytes`]) up to this number
    /// are in entries that are durable ([`Queue::grant_marks`]).
    grants_durable: AtomicU64,
    /// [`JournalStats::early_answers`] (counted without the stats' lock).
    early: AtomicU64,
}

impl JournalCore {
    fn q(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.q.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn stats(&self) -> JournalStats {
        let mut s = *self.stats.lock().unwrap_or_else(|e| e.into_inner());
        let q = self.q();
        s.lag = q.enqueued - q.written;
        s.early_answers = self.early.load(Ordering::Relaxed);
        s.lending = q.lends();
        s
    }

    /// A request was answered before its changes were acknowledged ([`JournalStats::early_answers`]).
    pub fn count_early(&self) {
        self.early.fetch_add(1, Ordering::Relaxed);
    }

    /// The in-sync standbys (`--ha-replication standbys`, leaders).
    pub fn insync(&self) -> Vec<String> {
        self.insync.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn set_insync(&self, members: &[String]) {
        *self.insync.lock().unwrap_or_else(|e| e.into_inner()) = members.to_vec();
        self.set_stats(|s| s.insync = members.len() as u64);
    }

    pub(crate) fn set_stats(&self, f: impl FnOnce(&mut JournalStats)) {
        f(&mut self.stats.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// Takes what the state marked as changed into the queue. Returns the ticket to wait for
    /// (covering changes another thread collected first, which may include this caller's)
    /// with its term, `None` when not journaling or nothing is outstanding.
    pub fn collect(&self, m: &Master) -> Option<(i64, u64)> {
        self.collect_held(m.lock(), m.now())
    }

    /// [`JournalCore::collect`] under a hold of the state's lock the caller already has (the
    /// one its request was applied under: taking the lock again for this was a second hand-over
    /// per request between the connections' threads); the lock is let go here.
    pub fn collect_held(&self, mut st: MutexGuard<'_, State>, now: u64) -> Option<(i64, u64)> {
        if !st.journaling() {
            return None;
        }
        let changes = st.take_changes(now);
        let issued = crate::master::grants_issued();
        let mut q = self.q();
        if q.term == 0 || q.term != st.term {
            return None;
        }
        let queued = !changes.is_empty();
        if queued && q.lends() {
            // The writer sleeps, nothing is in flight: this thread sends the entry ([`Lent`]).
            // The state's lock goes first: the queue's, held, keeps the changes in the order
            // they were applied.
            drop(st);
            q.changes.extend(changes);
            q.enqueued += 1;
            q.note_grants(issued);
            let ticket = (q.term, q.enqueued);
            self.send_lent(q);
            return Some(ticket);
        }
        let wake = queued && std::mem::take(&mut q.writer_asleep);
        if queued {
            q.changes.extend(changes);
            q.enqueued += 1;
            q.note_grants(issued);
        }
        let ticket = (q.enqueued > q.written).then_some((q.term, q.enqueued));
        // The writer is woken after both locks are released: woken under them, it would only
        // block on the queue's lock again, and every request would wait on the state's lock
        // for the system call (never lost: the writer looks at the queue under its lock
        // before it sleeps).
        drop(q);
        drop(st);
        if wake {
            self.work.notify_one();
        }
        ticket
    }

    /// Sends what is queued as the next entry through what the sleeping writer lent
    /// ([`Lent`]), under the queue's lock, as [`Writer`]'s `commit` does while standbys are in
    /// sync (entries pipelined: this one goes without waiting for the last one's
    /// acknowledgement). What takes more than one entry, or cannot be encoded, is left to the
    /// writer (woken; on an encoding error it ends the term, as for its own).
    fn send_lent(&self, mut q: MutexGuard<'_, Queue>) {
        let qr = &mut *q;
        let Some(lent) = qr.lent.as_mut() else { return };
        let seq = lent.seq + 1;
        let frame = (qr.changes.len() <= ENTRY_PIECE).then(|| {
            let (frame, changes) = entry_frame(seq, std::mem::take(&mut qr.changes));
            qr.changes = changes;
            frame
        });
        let Some(Ok(frame)) = frame else {
            qr.writer_asleep = false;
            drop(q);
            self.work.notify_one();
            return;
        };
        let changes = std::mem::take(&mut qr.changes);
        lent.seq = seq;
        lent.release.push(seq, qr.enqueued);
        send_all(&lent.links, &frame);
        lent.tail.lock().unwrap_or_else(|e| e.into_inner()).push(seq, &frame);
        self.count_streamed(changes.len(), seq);
        drop(q);
        drop(changes); // (freed outside the lock)
    }

    /// Entry `seq`, of `n` changes, went to the standbys.
    fn count_streamed(&self, n: usize, seq: u64) {
        self.set_stats(|s| {
            s.changes += n as u64;
            s.seq = seq;
        });
    }

    /// Waits until the changes of `ticket` (from [`JournalCore::collect`]) are in etcd, at most
    /// `bound`; refused if the term ended first.
    pub fn wait(&self, (term, ticket): (i64, u64), bound: Duration) -> Result<(), StoreError> {
        let until = Instant::now() + bound;
        let mut q = self.q();
        loop {
            if q.term != term || q.failed {
                return outcome_unknown();
            }
            if q.written >= ticket {
                return Ok(());
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return not_durable(bound);
            }
            q.waiting += 1;
            q = self.durable[ticket as usize % WAKE_SLOTS].wait_timeout(q, left).unwrap_or_else(|e| e.into_inner()).0;
            q.waiting -= 1;
        }
    }

    /// Like [`JournalCore::wait`] without a thread waiting: `answer` is called once, with `Ok`
    /// when the changes of `ticket` are durable (by the thread that learnt it: the writer or
    /// an acknowledgement reader), with `OutcomeUnknown` when the term ends or fails first, with a
    /// timeout error from [`JournalCore::expire`] after `bound`; at once, on this thread, if
    /// that is known already.
    pub fn defer(&self, (term, ticket): (i64, u64), answer: Answer) {
        let mut q = self.q();
        let now = if q.term != term || q.failed {
            Some(outcome_unknown())
        } else if q.written >= ticket {
            Some(Ok(()))
        } else {
            None
        };
        match now {
            Some(r) => {
                drop(q);
                answer(r);
            }
            None => q.later.entry(ticket).or_default().push(Later { since: Instant::now(), answer: Some(answer) }),
        }
    }

    /// Answers the deferred requests that waited longer than `bound` with the error
    /// [`JournalCore::wait`] gives (the master's ticker calls this; the writer fences the
    /// leader long before, when it can no longer prove its lease).
    pub fn expire(&self, bound: Duration) {
        let late: Vec<Later> = {
            let mut q = self.q();
            if q.later.is_empty() {
                return;
            }
            let mut late = Vec::new();
            for v in q.later.values_mut() {
                let (old, keep): (Vec<Later>, Vec<Later>) = std::mem::take(v).into_iter().partition(|l| l.since.elapsed() >= bound);
                late.extend(old);
                *v = keep;
            }
            q.later.retain(|_, v| !v.is_empty());
            late
        };
        answer_all(late, || not_durable(bound));
    }

    /// Wakes every waiter (the term ended, the writer failed, a hand-off finished).
    fn wake_all(&self) {
        for cv in &self.durable {
            cv.notify_all();
        }
    }

    /// Starts journaling `term` (the state must already journal).
    pub fn activate(&self, term: i64) {
        let later = std::mem::replace(&mut *self.q(), Queue { term, ..Queue::default() }).take_later();
        answer_all(later, outcome_unknown);
        self.set_stats(|s| *s = JournalStats::default());
        self.early.store(0, Ordering::Relaxed);
    }

    /// Stops journaling: the writer ends, waiters are refused.
    pub fn deactivate(&self) {
        self.set_insync(&[]);
        let mut q = self.q();
        q.term = 0;
        q.changes.clear();
        let later = q.take_later();
        drop(q);
        self.work.notify_all();
        self.wake_all();
        answer_all(later, outcome_unknown);
    }

    /// Whether a term is being journaled (this master leads, or has not stepped down yet).
    pub fn active(&self) -> bool {
        self.q().term != 0
    }

    /// Asks this term's writer to leave the state whole in the etcd journal and the leader
    /// fenced (the master is stopping); whether that was done within `bound` (true at once
    /// when not leading).
    pub fn hand_off(&self, bound: Duration) -> bool {
        let until = Instant::now() + bound;
        let mut q = self.q();
        if q.term == 0 || q.failed {
            return true;
        }
        q.handoff = true;
        self.work.notify_all();
        while !q.handed_off && q.term != 0 && !q.failed {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            q.waiting += 1;
            q = self.durable[0].wait_timeout(q, left).unwrap_or_else(|e| e.into_inner()).0;
            q.waiting -= 1;
        }
        q.handed_off
    }

    fn fail(&self) {
        let mut q = self.q();
        q.failed = true;
        q.changes.clear();
        let later = q.take_later();
        drop(q);
        self.wake_all();
        answer_all(later, outcome_unknown);
    }

    /// The next batch: everything queued, and the ticket it completes; `None` when the term
    /// ended. Waits at most `idle` for work (then returns an empty batch), lending `lend` to
    /// the request threads meanwhile; what was lent comes back, as they left it, either way.
    fn next(&self, term: i64, idle: Duration, lend: Option<Lent>) -> (Option<(Vec<Change>, u64)>, Option<Lent>) {
        let mut q = self.q();
        if q.term != term || q.failed {
            return (None, lend);
        }
        let mut lend = lend;
        if q.changes.is_empty() && !q.kicked {
            q.writer_asleep = true;
            q.lent = lend.take();
            q = self.work.wait_timeout(q, idle).unwrap_or_else(|e| e.into_inner()).0;
            q.writer_asleep = false;
            lend = q.lent.take();
            if q.term != term || q.failed {
                return (None, lend);
            }
        }
        q.kicked = false;
        (Some(q.take()), lend)
    }

    /// Plays the writer once without etcd: whatever is queued counts as durable (tests of
    /// what waits for the journal).
    #[cfg(test)]
    pub(crate) fn write_queued_for_test(&self) {
        let upto = self.q().enqueued;
        self.q().changes.clear();
        self.done(upto);
    }

    /// Takes what is queued into `out` (tests of what is collected).
    #[cfg(test)]
    pub(crate) fn drain_for_test(&self, out: &mut Vec<Change>) {
        out.append(&mut self.q().changes);
    }

    /// How many answers wait for the journal ([`JournalCore::defer`]).
    #[cfg(test)]
    pub(crate) fn deferred_for_test(&self) -> usize {
        self.q().later.values().map(Vec::len).sum()
    }

    /// Wakes the writer for something other than queued changes (a link broke): it looks at
    /// once, even if it was about to sleep.
    fn kick(&self) {
        self.q().kicked = true;
        self.work.notify_all();
    }

    fn done(&self, upto: u64) {
        let mut q = self.q();
        let newly = Self::mark_written(&mut q, upto);
        self.grants_written(&mut q);
        let ready = q.take_written();
        drop(q);
        self.wake_written(newly);
        answer_all(ready, || Ok(()));
    }

    /// [`JournalCore::done`] for `term` only: a late acknowledgement of an ended term (or of
    /// a failed one) answers nothing.
    fn done_in(&self, term: i64, upto: u64) {
        let mut q = self.q();
        if q.term == term && !q.failed {
            let newly = Self::mark_written(&mut q, upto);
            self.grants_written(&mut q);
            let ready = q.take_written();
            drop(q);
            self.wake_written(newly);
            answer_all(ready, || Ok(()));
        }
    }

    /// The grants in what is written now count as durable.
    fn grants_written(&self, q: &mut Queue) {
        if let Some(g) = q.grants_written() {
            self.grants_durable.fetch_max(g, Ordering::AcqRel);
        }
    }

    /// Grants up to this number are in durable journal entries: a put placed in their space
    /// is answered before its own change is acknowledged (`server.rs`).
    pub fn grants_durable(&self) -> u64 {
        self.grants_durable.load(Ordering::Acquire)
    }

    /// Records that everything up to `upto` is durable; the tickets that became so, if a
    /// thread sleeps in [`JournalCore::wait`] (else none: there is nobody to wake).
    fn mark_written(q: &mut Queue, upto: u64) -> std::ops::Range<u64> {
        let before = q.written;
        if upto <= before {
            return 0..0;
        }
        q.written = upto;
        if q.waiting == 0 {
            return 0..0;
        }
        before + 1..upto + 1
    }

    /// Wakes the requests waiting for `tickets`, after the queue's lock is released (woken
    /// under it they would only block on it again; never lost: a request looks at `written`
    /// under the lock before it sleeps).
    fn wake_written(&self, tickets: std::ops::Range<u64>) {
        if tickets.end - tickets.start >= WAKE_SLOTS as u64 {
            self.wake_all();
        } else {
            for t in tickets {
                self.durable[t as usize % WAKE_SLOTS].notify_all();
            }
        }
    }
}

/// The entries streamed to the in-sync standbys and not yet acknowledged by all of them, in
/// order. The threads reading the standbys' acknowledgements release them ([`AckSink`]): the
/// requests of an entry are answered by the acknowledgement that completes it, without a
/// hop through the writer, and the writer streams the next entry without waiting (entries
/// are pipelined). The writer changes the members only after etcd's in-sync record says so.
pub struct Release {
    core: Arc<JournalCore>,
    term: i64,
    pipe: Mutex<Pipe>,
}

#[derive(Default)]
struct Pipe {
    /// The in-sync standbys' acknowledged entries (their links' counters).
    members: Vec<Arc<AtomicU64>>,
    /// Entries sent: sequence number, the ticket it completes (0: none, a piece before the
    /// last of a commit: see [`pieces`]), when it was sent.
    pending: VecDeque<(u64, u64, Instant)>,
    /// When the last entry was released: the standbys' clock for the next one starts then if
    /// it was sent before ([`Release::oldest`]).
    progress: Option<Instant>,
}

impl Release {
    pub fn new(journal: &Journal, term: i64) -> Release {
        Release { core: Arc::clone(&journal.core), term, pipe: Mutex::default() }
    }

    fn pipe(&self) -> std::sync::MutexGuard<'_, Pipe> {
        self.pipe.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Entry `seq`, completing `ticket`, is about to be sent to the in-sync standbys.
    fn push(&self, seq: u64, ticket: u64) {
        self.pipe().pending.push_back((seq, ticket, Instant::now()));
    }

    /// Whether every entry sent was acknowledged by every member (none in flight).
    fn all_acknowledged(&self) -> bool {
        self.pipe().pending.is_empty()
    }

    /// The in-sync set changed (etcd says so already); entries its remaining members all
    /// acknowledged are released.
    fn set_members(&self, members: Vec<Arc<AtomicU64>>) {
        self.pipe().members = members;
        self.release();
    }

    /// Forgets every pending entry: the state they carry is in etcd (a rebase), their
    /// tickets answered by the writer.
    fn clear(&self) {
        let mut p = self.pipe();
        p.members.clear();
        p.pending.clear();
    }

    /// The oldest entry not acknowledged by every member, and since when the standbys have
    /// had it to apply: when it was sent, or when the entry before it was released if that
    /// was later. A standby that works through a long burst of entries (a `RemoveAll` of a
    /// million objects is a few hundred pieces and about half a second of applying) stays in
    /// sync as long as each piece follows the one before within the bound; one that stops
    /// acknowledging is late one bound after its last progress.
    fn oldest(&self) -> Option<(u64, Instant)> {
        let p = self.pipe();
        p.pending.front().map(|&(seq, _, sent)| (seq, p.progress.map_or(sent, |t| t.max(sent))))
    }

    /// Answers the requests of every entry each member acknowledged.
    fn release(&self) {
        let mut p = self.pipe();
        let Some(min) = p.members.iter().map(|a| a.load(Ordering::Acquire)).min() else { return };
        let (mut upto, mut n, mut waited) = (0u64, 0u64, 0u64);
        while let Some(&(seq, ticket, sent)) = p.pending.front() {
            if seq > min {
                break;
            }
            p.pending.pop_front();
            // (The largest: a piece carries no ticket, 0, and may follow a commit's last.)
            upto = upto.max(ticket);
            n += 1;
            waited += sent.elapsed().as_micros() as u64;
        }
        if n > 0 {
            p.progress = Some(Instant::now());
        }
        drop(p);
        if n > 0 {
            // Counted before the answers go out: a client that got its answer then sees it
            // in `/ha_status`.
            self.core.set_stats(|s| {
                s.streamed += n;
                s.stream_wait_us += waited;
            });
            // Tickets only grow: a concurrent release of an earlier one is a no-op after this
            // (as is ticket 0, only pieces released).
            self.core.done_in(self.term, upto);
        }
    }
}

impl AckSink for Release {
    fn acked(&self) {
        self.release();
    }

    fn broke(&self) {
        // The writer drops the member (or the links it no longer needs) at once.
        self.core.kick();
    }
}

/// The most changes one entry streamed to the standbys carries (a few hundred KiB; applying
/// them takes a few milliseconds).
const ENTRY_PIECE: usize = 4096;

/// A commit of `changes`, completing `ticket`, as the entries streamed for it: pieces of at
/// most `piece` changes, in order, only the last completing the ticket (0 for the others:
/// releasing them answers nothing). Every change carries its entity's whole state, so a
/// standby that took over after some of the pieces holds a consistent state per entity, of
/// a commit nobody was told had happened.
fn pieces(changes: Vec<Change>, ticket: u64, piece: usize) -> Vec<(Vec<Change>, u64)> {
    let piece = piece.max(1);
    // Nearly every commit: one entry, the changes moved, not copied.
    if changes.len() <= piece {
        return vec![(changes, ticket)];
    }
    let mut it = changes.into_iter();
    let mut out = Vec::with_capacity(it.len().div_ceil(piece).max(1));
    loop {
        let p: Vec<Change> = it.by_ref().take(piece).collect();
        if it.len() == 0 {
            out.push((p, ticket));
            return out;
        }
        out.push((p, 0));
    }
}

/// Entry `seq` of `changes` as a frame for the standbys, and the changes back (the entry owns
/// them while it is encoded: a caller that cannot send it may queue them again).
fn entry_frame(seq: u64, changes: Vec<Change>) -> (Result<Arc<Vec<u8>>, String>, Vec<Change>) {
    let entry = ToStandby::Entry { seq, changes };
    let frame = super::sync::encode_frame(&entry).map(Arc::new);
    match entry {
        ToStandby::Entry { changes, .. } => (frame, changes),
        _ => (frame, Vec::new()), // (built as an entry above)
    }
}

/// A rebase from the tail writes at most this many bytes of log values per transaction
/// (etcd refuses requests over 1.5 MiB by default, and base64 in its JSON gateway adds a
/// third), and at most this many keys (etcd's default limit is 128 operations).
const REBASE_TXN_BYTES: usize = 1 << 20;
const REBASE_TXN_KEYS: usize = 64;

/// The changes of a streamed entry ([`entry_frame`]'s `frame`, entry `seq`) as postcard
/// elements, and how many: the frame's body is the entry's postcard encoding, whose end is
/// exactly its `Vec<Change>` (a length, then the elements), taken as it is, not decoded and
/// encoded again. `None` if the frame is not entry `seq`.
fn entry_changes(seq: u64, frame: &[u8]) -> Option<(usize, &[u8])> {
    let head = postcard::to_stdvec(&ToStandby::Entry { seq, changes: Vec::new() }).ok()?;
    // (`head` ends with the empty vector's length, one byte.)
    let prefix = &head[..head.len() - 1];
    let changes = frame.get(4..)?.strip_prefix(prefix)?;
    postcard::take_from_bytes::<usize>(changes).ok()
}

/// The largest log value a rebase from the tail writes (one entry of [`ENTRY_PIECE`] large
/// changes may be over [`CHUNK`]; etcd takes requests of 1.5 MiB, base64 included).
const REBASE_VALUE_MAX: usize = 1 << 20;

/// The log values (key, value) of the entries `frames`, in order, one after the other: each
/// the streamed frame of entry `last` holding the changes of the log's entries `first..=last`
/// (a leader streams the entries it appended to etcd in several values as one; the leader's
/// own [`Tail`] holds one entry per frame). Consecutive entries share a value while their changes fit [`CHUNK`]
/// ([`RANGE_MAGIC`] when it holds more than one log entry). `None` if a frame is not its
/// entry, the frames are not consecutive, or one entry alone is over [`REBASE_VALUE_MAX`]
/// stored.
fn tail_log_values(prefix: &str, frames: &[TailFrame]) -> Option<Vec<(String, Vec<u8>)>> {
    struct Group {
        first: u64,
        last: u64,
        count: usize,
        elems: Vec<u8>,
    }
    let finish = |g: Group| -> Option<(String, Vec<u8>)> {
        let mut raw = postcard::to_stdvec(&g.count).ok()?;
        raw.extend_from_slice(&g.elems);
        let packed = pack(raw);
        let value = if g.last == g.first {
            packed
        } else {
            let mut v = Vec::with_capacity(RANGE_MAGIC.len() + 8 + packed.len());
            v.extend_from_slice(RANGE_MAGIC);
            v.extend_from_slice(&g.last.to_le_bytes());
            v.extend_from_slice(&packed);
            v
        };
        (value.len() <= REBASE_VALUE_MAX).then(|| (log_key(prefix, g.first), value))
    };
    let mut out = Vec::new();
    let mut group: Option<Group> = None;
    for &TailFrame { first, last, ref frame } in frames {
        let (n, elems) = entry_changes(last, frame)?;
        if first > last || group.as_ref().is_some_and(|g| g.last.checked_add(1) != Some(first)) {
            return None;
        }
        if group.as_ref().is_some_and(|g| g.elems.len() + elems.len() > CHUNK - 16) {
            out.push(finish(group.take()?)?);
        }
        let g = group.get_or_insert(Group { first, last, count: 0, elems: Vec::new() });
        g.last = last;
        g.count += n;
        g.elems.extend_from_slice(elems);
    }
    if let Some(g) = group {
        out.push(finish(g)?);
    }
    Some(out)
}

/// Sends `frame` to every linked standby.
fn send_all(links: &[Link], frame: &Arc<Vec<u8>>) {
    for l in links {
        l.send(frame);
    }
}

/// The writer of one term: appends what is queued, snapshots, gives up (and fences the
/// leader) when etcd cannot be written while the leadership can still be proven.
pub struct Writer<'a> {
    pub etcd: &'a EtcdClient,
    pub master: &'a Master,
    pub view_key: String,
    pub prefix: String,
    /// The leader's view key's creation: its revision is the term, and this writer's
    /// transactions are guarded by it.
    pub owner: Owner,
    pub seq: u64,
    pub head: Option<Head>,
    /// Snapshot once the log since the last snapshot is larger than this and than it.
    pub snapshot_bytes: u64,
    /// Replication to standbys (`--ha-replication standbys`), `None`: etcd only.
    pub sync: Option<Replicas>,
    /// The in-sync record's key ([`super::sync::insync_key`]): emptied with the head of a
    /// rebase, in either mode.
    pub insync_key: String,
    /// During a takeover (the key won, its lease renewed by the takeover's own thread, the
    /// gate not yet the leader's): a transaction that fails is retried until then, not given
    /// up at once (one etcd error among a large state's chunks failed the whole takeover).
    pub retry_until: Option<Instant>,
}

/// The leader's side of replication to standbys ([`super::sync`]).
pub struct Replicas {
    /// Where standbys register ([`super::sync::standby_prefix`]).
    pub standby_prefix: String,
    /// This leader's member id (its RPC address): its own registration is not a standby.
    pub me: String,
    pub hello: ToStandby,
    pub links: Vec<Link>,
    /// The in-sync set as etcd holds it now.
    pub insync: Vec<String>,
    /// Releases the entries the in-sync set acknowledged.
    pub release: Arc<Release>,
    /// How long an in-sync standby may take to acknowledge before it leaves the set.
    pub ack_timeout: Duration,
    last_poll: Option<Instant>,
    /// Standbys whose links failed: when last, how many times in a row at that replication
    /// address since they were last in sync (retried after [`retry_link_after`]; a standby
    /// registered again at another address, as one that restarted, is tried at once), and the
    /// address.
    failed: HashMap<String, (Instant, u32, String)>,
    /// The mirror term each registered standby's registration names, as last read: only one
    /// that names this leader's term is promoted ([`super::sync::registration`]).
    mirrors: HashMap<String, Option<i64>>,
    /// While a linking standby's image is taken: the entries committed meanwhile, which it
    /// gets after its image ([`Writer::open_link`]).
    catch_up: Option<Vec<Arc<Vec<u8>>>>,
    /// The entries the etcd journal lacks while standbys are in sync ([`Tail`]).
    tail: Arc<Mutex<Tail>>,
    /// Bytes of space granted ahead per segment pool while standbys allow it (0: never;
    /// `Replicas::grant_bytes_now`).
    pub grant_bytes: u64,
}

/// How long after a failed connection a standby is tried again.
const RETRY_LINK: Duration = Duration::from_secs(1);

/// How long after its `n`th failed link in a row a standby is tried again: [`RETRY_LINK`],
/// doubling up to 32 times that. Each try encodes an image of the whole state (about 150 ms
/// of the writer's time at a million objects on the dev VM), so a standby that cannot link
/// (unreachable, of another cluster, holding another cluster key) must not cost that every
/// second.
fn retry_link_after(n: u32) -> Duration {
    RETRY_LINK * (1u32 << n.saturating_sub(1).min(5))
}

impl Replicas {
    /// `tail`: the bytes of entries kept for a rebase (0: none) and the least time between
    /// two background snapshots ([`Tail`]).
    pub fn new(cluster_id: &str, me: &str, owner: Owner, ack_timeout: Duration, tail: (usize, Duration), journal: &Journal) -> Replicas {
        Replicas {
            standby_prefix: super::sync::standby_prefix(cluster_id),
            me: me.to_string(),
            hello: ToStandby::Hello { cluster_id: cluster_id.to_string(), term: owner.create_revision, lease: owner.lease, leader: me.to_string() },
            links: Vec::new(),
            insync: Vec::new(),
            release: Arc::new(Release::new(journal, owner.create_revision)),
            ack_timeout,
            last_poll: None,
            failed: HashMap::new(),
            mirrors: HashMap::new(),
            catch_up: None,
            tail: Arc::new(Mutex::new(Tail::new(tail.0, tail.1))),
            grant_bytes: 0,
        }
    }

    /// How much space puts are granted ahead now: the configured bytes while the in-sync set
    /// is not empty (the etcd journal alone is read by masters of every version) and every
    /// linked standby reads [`Change::Granted`]; else 0.
    fn grant_bytes_now(&self) -> u64 {
        let all = self.links.iter().all(|l| l.grants) && self.insync.iter().all(|m| self.link(m).is_some_and(|l| l.grants));
        if !self.insync.is_empty() && all {
            self.grant_bytes
        } else {
            0
        }
    }

    fn tail(&self) -> MutexGuard<'_, Tail> {
        self.tail.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn link(&self, member: &str) -> Option<&Link> {
        self.links.iter().find(|l| l.member == member)
    }

    /// Sends `changes` as entry `seq` to every linked standby, and keeps it for a standby
    /// whose image is being taken ([`Replicas::catch_up`]); none of either: nothing to do.
    /// An entry that cannot be encoded ends the term: a standby missing it must never be in
    /// sync.
    fn broadcast(&mut self, seq: u64, changes: Vec<Change>) -> Option<()> {
        if self.links.is_empty() && self.catch_up.is_none() {
            return Some(());
        }
        match entry_frame(seq, changes).0 {
            Ok(f) => {
                send_all(&self.links, &f);
                self.tail().push(seq, &f);
                if let Some(c) = self.catch_up.as_mut() {
                    c.push(f);
                }
                Some(())
            }
            Err(e) => {
                tracing::error!("HA replication: {e}");
                None
            }
        }
    }

    /// Tells the standbys that take it where the etcd journal is whole ([`ToStandby::Base`]),
    /// right after the last entry sent (this is the writer, not lent). An encoding error is
    /// only logged: the standbys then keep no run, and a takeover writes the whole state.
    fn base(&self, seq: u64, written: bool) {
        match super::sync::encode_frame(&ToStandby::Base { seq, written }) {
            Ok(f) => {
                let f = Arc::new(f);
                for l in self.links.iter().filter(|l| l.runs) {
                    l.send(&f);
                }
            }
            Err(e) => tracing::warn!("HA replication: {e}"),
        }
    }

    /// The in-sync set is `members` (etcd says so already).
    fn set_insync(&mut self, members: Vec<String>, journal: &Journal) {
        self.insync = members;
        journal.set_insync(&self.insync);
        // A member without a link acknowledges nothing (it holds every entry back until it
        // leaves the set, `Writer::check_insync`): never answered without it.
        let counters = self.insync.iter().map(|m| self.link(m).map_or_else(|| Arc::new(AtomicU64::new(0)), Link::ack_counter)).collect();
        self.release.set_members(counters);
    }
}

impl Writer<'_> {
    fn term(&self) -> i64 {
        self.owner.create_revision
    }

    /// One guarded transaction, retried while etcd cannot be reached and this master can still
    /// prove its lease; `None` when it must give up.
    fn txn(&self, puts: &[(String, Vec<u8>)], delete: Option<(&str, &str)>) -> Option<i64> {
        loop {
            match self.etcd.txn_if_owned(&self.view_key, self.owner, puts, delete) {
                Ok(Some(rev)) => return Some(rev),
                Ok(None) => {
                    tracing::warn!(term = self.term(), "HA journal: the view key is no longer this leader's; nothing more is written");
                    return None;
                }
                Err(e) => {
                    if !self.master.gate.still_leader(self.term()) && self.retry_until.is_none_or(|t| Instant::now() >= t) {
                        tracing::warn!(term = self.term(), "HA journal: {e}; the lease can no longer be proven, giving up");
                        return None;
                    }
                    tracing::warn!(term = self.term(), "HA journal: {e}; retrying");
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }

    fn append(&mut self, changes: &[Change]) -> Option<()> {
        let chunks = match encode_chunks(changes) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!("HA journal: {e}");
                return None;
            }
        };
        let mut left = changes.len() as u64;
        for c in chunks {
            let n = c.len() as u64;
            let key = log_key(&self.prefix, self.seq + 1);
            let t = Instant::now();
            self.txn(&[(key, c)], None)?;
            let us = t.elapsed().as_micros() as u64;
            self.seq += 1;
            self.master.journal.set_stats(|s| {
                s.entries += 1;
                s.changes += std::mem::take(&mut left); // counted with the first chunk
                s.write_us += us;
                s.log_bytes += n;
                s.seq = self.seq;
            });
        }
        Some(())
    }

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
    fn image_in_pieces(&mut self, commit_between: bool) -> Option<Frozen> {
        let master = self.master;
        let j = &master.journal;
        let mut now = master.now();
        let mut st = master.lock();
        let changes = st.take_changes(now);
        let issued = crate::master::grants_issued();
        let (mut queued, upto) = {
            let mut q = j.q();
            if q.term != self.term() || q.failed {
                return None;
            }
            if !changes.is_empty() {
                q.changes.extend(changes);
                q.enqueued += 1;
                q.note_grants(issued);
            }
            q.take()
        };
        let term = st.term;
        let mut image = st.image_head(now);
        let (start, mut held, mut longest, mut holds) = (Instant::now(), Instant::now(), Duration::ZERO, 1);
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
        tracing::info!(changes = image.len(), ms = start.elapsed().as_millis() as u64, holds, longest_hold_ms = longest.as_millis() as u64, "HA journal: an image of the state taken");
        if commit_between && seq.is_none() {
            seq = Some(self.commit_queued(&mut queued, upto, None)?);
        }
        Some(Frozen { queued, upto, image, seq })
    }

    /// At a gap of [`Writer::image_in_pieces`]: the first time (`seq` `None`), commits what
    /// was queued before the image (`queued`, completing ticket `upto`) and returns the
    /// image's position; then commits what requests queued since. The image's position.
    fn commit_queued(&mut self, queued: &mut Vec<Change>, upto: u64, seq: Option<u64>) -> Option<u64> {
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
                    if s.tail().begin(self.seq) {
                        s.base(self.seq, false);
                    }
                }
                self.seq
            }
        };
        self.commit_what_is_queued()?;
        Some(at)
    }

    fn streaming(&self) -> bool {
        self.sync.as_ref().is_some_and(|s| !s.insync.is_empty())
    }

    /// Makes `changes` durable, then acknowledges `upto`: appended to etcd while no standby is
    /// in sync, otherwise acknowledged by every in-sync standby; streamed to every linked
    /// standby either way.
    fn commit(&mut self, changes: Vec<Change>, upto: u64) -> Option<()> {
        if let Some(s) = self.sync.as_mut().filter(|s| !s.insync.is_empty()) {
            // Answered when every in-sync standby acknowledged it ([`Release`]); the next
            // entry goes out without waiting for this one. A large commit goes as several
            // entries, so that the standbys' acknowledgements show their progress.
            let n = changes.len();
            for (piece, ticket) in pieces(changes, upto, ENTRY_PIECE) {
                self.seq += 1;
                s.release.push(self.seq, ticket);
                s.broadcast(self.seq, piece)?;
            }
            self.master.journal.count_streamed(n, self.seq);
            return Some(());
        }
        self.append(&changes)?;
        self.broadcast(changes)?;
        self.master.journal.done(upto);
        Some(())
    }

    /// Sends `changes` as entry `self.seq` to every linked standby ([`Replicas::broadcast`]).
    fn broadcast(&mut self, changes: Vec<Change>) -> Option<()> {
        match self.sync.as_mut() {
            Some(s) => s.broadcast(self.seq, changes),
            None => Some(()),
        }
    }

    /// In-sync standbys whose link broke, or that did not acknowledge the oldest pending entry
    /// within the bound, leave the set (in etcd first); then what the rest acknowledged is
    /// released.
    fn check_insync(&mut self) -> Option<()> {
        let (failed, late) = self.failing_members();
        if failed.is_empty() {
            return Some(());
        }
        let bound = self.sync.as_ref().map(|s| s.ack_timeout);
        tracing::warn!(term = self.term(), ?late, "HA replication: the standby(s) {failed:?} did not acknowledge within {bound:?} (or their connection broke); they leave the in-sync set");
        self.drop_members(&failed)
    }

    /// The in-sync standbys whose link broke or that did not acknowledge the oldest pending
    /// entry within the bound, and that entry if it is late.
    fn failing_members(&self) -> (Vec<String>, Option<u64>) {
        let Some(s) = self.sync.as_ref().filter(|s| !s.insync.is_empty()) else { return (Vec::new(), None) };
        let late = s.release.oldest().filter(|(_, sent)| sent.elapsed() >= s.ack_timeout).map(|(seq, _)| seq);
        (s.insync.iter().filter(|m| s.link(m).is_none_or(|l| l.dead() || late.is_some_and(|seq| l.acked() < seq))).cloned().collect(), late)
    }

    /// What the writer lends while it sleeps (its links, while standbys are in sync: see
    /// [`Lent`]), and how long it may sleep: an entry sent meanwhile starts its standbys'
    /// clock, so then at most one acknowledgement bound.
    fn lend(&mut self) -> (Duration, Option<Lent>) {
        let idle = self.idle();
        let seq = self.seq;
        match self.sync.as_mut().filter(|s| !s.insync.is_empty() && !s.links.is_empty()) {
            Some(s) => (idle.min(s.ack_timeout), Some(Lent { seq, links: std::mem::take(&mut s.links), release: Arc::clone(&s.release), tail: Arc::clone(&s.tail) })),
            None => (idle, None),
        }
    }

    /// Takes back what [`Writer::lend`] lent, with the entries sent through it.
    fn take_back(&mut self, lent: Option<Lent>) {
        let Some(lent) = lent else { return };
        self.seq = lent.seq;
        if let Some(s) = self.sync.as_mut() {
            s.links = lent.links;
        }
    }

    /// How long the writer may sleep before an in-sync standby may be late.
    fn idle(&self) -> Duration {
        let idle = Duration::from_millis(200);
        match self.sync.as_ref().and_then(|s| Some((s.release.oldest()?, s.ack_timeout))) {
            Some(((_, sent), bound)) => idle.min((sent + bound).saturating_duration_since(Instant::now()) + Duration::from_millis(1)),
            None => idle,
        }
    }

    /// Grants space ahead to puts, or stops (the pools' unused space goes back, as a change
    /// of the journal), as the standbys now allow ([`Replicas::grant_bytes_now`]); `off`
    /// stops regardless.
    fn update_grants(&self, off: bool) {
        let bytes = if off { 0 } else { self.sync.as_ref().map_or(0, Replicas::grant_bytes_now) };
        let hold = u64::try_from(self.master.cfg.put_start_release_timeout.as_millis()).unwrap_or(u64::MAX);
        let mut st = self.master.lock();
        if st.term == self.term() && st.granting() != (bytes > 0) {
            tracing::info!(term = self.term(), bytes, "HA replication: {}", if bytes > 0 { "puts are granted space ahead (answered before their change is acknowledged)" } else { "puts are no longer granted space ahead" });
        }
        if st.term == self.term() {
            st.set_grant_bytes(bytes, hold);
        }
    }

    /// Removes `gone` from the links and the in-sync set (in etcd first). When the set becomes
    /// empty the etcd journal is made whole again first ([`Writer::rebase`]).
    fn drop_members(&mut self, gone: &[String]) -> Option<()> {
        let term = self.term();
        let Some(s) = self.sync.as_mut() else { return Some(()) };
        s.links.retain(|l| !gone.contains(&l.member));
        if !s.insync.iter().any(|m| gone.contains(m)) {
            return Some(());
        }
        let rest: Vec<String> = s.insync.iter().filter(|m| !gone.contains(m)).cloned().collect();
        if rest.is_empty() {
            return self.rebase();
        }
        let rec = InSync { term, members: rest.clone() };
        self.txn(&[(self.insync_key.clone(), rec.to_bytes())], None)?;
        if let Some(s) = self.sync.as_mut() {
            s.set_insync(rest, &self.master.journal);
        }
        self.update_grants(false);
        Some(())
    }

    /// The in-sync set became empty: writes the whole state to the etcd journal as a
    /// snapshot, and empties the set in the same transaction as the journal's new head; from
    /// then on changes are appended to etcd again.
    fn rebase(&mut self) -> Option<()> {
        let started = Instant::now();
        if self.rebase_from_tail(started)? {
            return Some(());
        }
        // (Nothing is committed between the image's pieces: until the snapshot's head is in
        // etcd nothing can be made durable there.)
        let Frozen { queued, upto, image, .. } = self.image_in_pieces(false)?;
        self.seq += 1;
        if !queued.is_empty() {
            self.broadcast(queued)?;
        }
        self.write_snapshot(image, self.seq, Some(self.insync_cleared()), false)?;
        self.insync_emptied(upto, started, 0);
        tracing::warn!(term = self.term(), seq = self.seq, "HA replication: no standby is in sync; the state is in the etcd journal again (snapshot) and changes are written there");
        Some(())
    }

    /// The in-sync record, emptied by this leader (the rebase's last write).
    fn insync_cleared(&self) -> (String, Vec<u8>) {
        (self.insync_key.clone(), InSync { term: self.term(), members: Vec::new() }.to_bytes())
    }

    /// The rebase begun at `started` emptied the in-sync set in etcd, and everything up to
    /// `upto` is durable there (`tail_entries`: written from the [`Tail`], 0: the whole state).
    fn insync_emptied(&mut self, upto: u64, started: Instant, tail_entries: u64) {
        if let Some(s) = self.sync.as_mut() {
            s.insync.clear();
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
    fn rebase_from_tail(&mut self, started: Instant) -> Option<bool> {
        let Some(run) = self.sync.as_ref().and_then(|s| s.tail().take(self.seq)) else { return Some(false) };
        let Some(values) = tail_log_values(&self.prefix, &run.frames) else {
            tracing::info!("HA journal: an entry streamed since the journal's last position does not fit a log value; the rebase writes the whole state");
            return Some(false);
        };
        self.rebase_with(values, run.base, run.frames.len() as u64, started)?;
        Some(true)
    }

    /// Writes `values`, the log after the etcd journal's last position `base` (`entries`
    /// streamed entries: [`tail_log_values`]), several per transaction, then what requests
    /// queued, as the writer appends it, and empties the in-sync set last.
    fn rebase_with(&mut self, values: Vec<(String, Vec<u8>)>, base: u64, entries: u64, started: Instant) -> Option<()> {
        let (values_n, bytes) = (values.len() as u64, values.iter().map(|(_, v)| v.len() as u64).sum::<u64>());
        let mut batch: Vec<(String, Vec<u8>)> = Vec::new();
        let mut size = 0;
        for (k, v) in values {
            if !batch.is_empty() && (size + v.len() > REBASE_TXN_BYTES || batch.len() >= REBASE_TXN_KEYS) {
                self.txn(&std::mem::take(&mut batch), None)?;
                size = 0;
            }
            size += v.len();
            batch.push((k, v));
        }
        if !batch.is_empty() {
            self.txn(&batch, None)?;
        }
        self.master.journal.set_stats(|s| {
            s.entries += values_n;
            s.log_bytes += bytes;
        });
        // What requests queued and no standby was sent: appended as the writer appends.
        let (queued, upto) = self.take_queued()?;
        if !queued.is_empty() {
            self.append(&queued)?;
            self.broadcast(queued)?;
        }
        self.txn(&[self.insync_cleared()], None)?;
        self.insync_emptied(upto, started, entries);
        tracing::warn!(term = self.term(), seq = self.seq, base, entries, values = values_n, bytes, ms = started.elapsed().as_millis() as u64, "HA replication: no standby is in sync; the entries since the etcd journal's last position are in its log now, and changes are written there");
        Some(())
    }

    /// While standbys are in sync: a snapshot written to etcd in the background (requests
    /// are not held: their entries go to the standbys between its pieces and chunks), whose
    /// position starts a new run of the [`Tail`]. Given up (its chunks deleted) when an
    /// in-sync standby is late meanwhile: the rebase that follows uses the run it had.
    fn refresh_base(&mut self) -> Option<()> {
        if let Some(s) = self.sync.as_ref() {
            s.tail().want_next = true;
        }
        let Frozen { image, seq, .. } = self.image_in_pieces(true)?;
        let at = seq.unwrap_or(self.seq);
        let written = self.write_snapshot(image, at, None, true)?;
        if let Some(s) = self.sync.as_ref() {
            let mut t = s.tail();
            if written {
                t.based();
            } else {
                t.next = None;
            }
            drop(t);
            if written {
                s.base(at, true);
            }
        }
        Some(())
    }


    /// Writes a snapshot of the state after everything queued, then deletes the log it covers
    /// and the previous snapshot. Requests are not held for it: what they queue is committed
    /// to the log between the image's pieces and between the snapshot's chunks, after the
    /// image's position, which the snapshot's head names.
    fn snapshot(&mut self) -> Option<()> {
        let Frozen { image, seq, .. } = self.image_in_pieces(true)?;
        let at = seq.unwrap_or(self.seq);
        self.write_snapshot(image, at, None, true).map(|_| ())
    }

    /// What requests queued, and the ticket that completes it (`None`: the term ended or the
    /// journal failed).
    fn take_queued(&self) -> Option<(Vec<Change>, u64)> {
        let mut q = self.master.journal.q();
        if q.term != self.term() || q.failed {
            return None;
        }
        Some(q.take())
    }

    /// Commits what requests queued (their changes, completing their ticket).
    fn commit_what_is_queued(&mut self) -> Option<()> {
        let (changes, ticket) = self.take_queued()?;
        if !changes.is_empty() {
            self.commit(changes, ticket)?;
        }
        Some(())
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
    fn write_snapshot(&mut self, image: Vec<Change>, at: u64, also: Option<(String, Vec<u8>)>, commit_between: bool) -> Option<bool> {
        let j = &self.master.journal;
        let started = Instant::now();
        let log_before = j.stats().log_bytes;
        let dir = snap_dir(&self.prefix, at);
        // (Chunks a leader that died mid-snapshot left under this number.)
        self.txn(&[], Some((&dir, &prefix_end(&dir))))?;
        let (mut bytes, mut n) = (0u64, 0u32);
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
                bytes += c.len() as u64;
                self.txn(&[(format!("{dir}{n:08x}"), c)], None)?;
                n += 1;
                if commit_between {
                    self.commit_what_is_queued()?;
                    if !self.failing_members().0.is_empty() {
                        tracing::info!(term = self.term(), seq = at, "HA journal: an in-sync standby is late; the background snapshot is given up");
                        self.txn(&[], Some((&dir, &prefix_end(&dir))))?;
                        return Some(false);
                    }
                }
            }
        }
        drop(image);
        if commit_between {
            self.commit_what_is_queued()?;
        }
        let head = Head { seq: at, chunks: n, bytes };
        let head_bytes = postcard::to_stdvec(&head).ok()?;
        let log_from = format!("{}log/", self.prefix);
        let log_to = log_key(&self.prefix, at + 1);
        let mut puts = vec![(format!("{}head", self.prefix), head_bytes)];
        puts.extend(also);
        let rev = self.txn(&puts, Some((&log_from, &log_to)))?;
        if let Some(old) = self.head.filter(|h| h.seq != head.seq) {
            let d = snap_dir(&self.prefix, old.seq);
            self.txn(&[], Some((&d, &prefix_end(&d))))?;
        }
        if let Err(e) = self.etcd.compact(rev) {
            tracing::debug!("HA journal: compacting etcd: {e}");
        }
        self.head = Some(head);
        j.set_stats(|s| {
            s.snapshots += 1;
            s.snapshot_bytes = bytes;
            s.snapshot_write_ms = started.elapsed().as_millis() as u64;
            // (What was appended after the image's position stays: about what was appended
            // while the chunks were written.)
            s.log_bytes = s.log_bytes.saturating_sub(log_before);
        });
        tracing::info!(term = self.term(), seq = at, last = self.seq, bytes, chunks = n, "HA journal: snapshot written, log compacted");
        Some(true)
    }

    /// Standbys that joined or left (their registrations in etcd, read every
    /// [`super::STANDBY_POLL`]): links opened (each starting with an image) or closed.
    fn poll_standbys(&mut self) -> Option<()> {
        let Some(s) = self.sync.as_mut() else { return Some(()) };
        if s.last_poll.is_some_and(|t| t.elapsed() < super::STANDBY_POLL) {
            return Some(());
        }
        s.last_poll = Some(Instant::now());
        let p = s.standby_prefix.clone();
        // Member -> (its mirror's address, the mirror term its registration names, whether it
        // takes `Base` frames and reads grants).
        #[allow(clippy::type_complexity)]
        let regs: HashMap<String, (String, Option<i64>, (bool, bool))> = match self.etcd.range(&p, &prefix_end(&p), 64) {
            Ok(kvs) => kvs
                .into_iter()
                .filter_map(|(k, kv)| {
                    let v = String::from_utf8(kv.value).ok()?;
                    let r = super::sync::parse_registration(&v);
                    Some((k.strip_prefix(&p)?.to_string(), (r.addr.to_string(), r.mirror, (r.runs, r.grants))))
                })
                .collect(),
            Err(e) => {
                tracing::debug!("HA replication: reading the standbys' registrations: {e}");
                return Some(());
            }
        };
        s.mirrors = regs.iter().map(|(m, r)| (m.clone(), r.1)).collect();
        let gone: Vec<String> = s
            .links
            .iter()
            .filter(|l| l.dead() || regs.get(&l.member).map(|r| &r.0) != Some(&l.addr))
            .map(|l| l.member.clone())
            .chain(s.insync.iter().filter(|m| s.link(m).is_none()).cloned())
            .collect();
        // A standby whose link died is tried again only after a while (it may be unreachable).
        let now = Instant::now();
        for l in s.links.iter().filter(|l| l.dead()) {
            let n = s.failed.get(&l.member).filter(|f| f.2 == l.addr).map_or(0, |f| f.1);
            s.failed.insert(l.member.clone(), (now, n + 1, l.addr.clone()));
        }
        if !gone.is_empty() {
            self.drop_members(&gone)?;
        }
        let Some(s) = self.sync.as_ref() else { return Some(()) };
        let new: Vec<(String, String, (bool, bool))> = regs
            .into_iter()
            .filter(|(m, (addr, _, _))| *m != s.me && s.link(m).is_none() && s.failed.get(m).is_none_or(|(t, n, at)| at != addr || t.elapsed() > retry_link_after(*n)))
            .map(|(m, (addr, _, can))| (m, addr, can))
            .collect();
        for (member, addr, (runs, grants)) in new {
            self.open_link(&member, &addr, runs, grants)?;
        }
        Some(())
    }

    /// Links a standby: hello, an image of the state after the last entry written (what was
    /// queued is committed first), then every entry after it. `runs`: it takes
    /// [`ToStandby::Base`] frames (its registration says so).
    fn open_link(&mut self, member: &str, addr: &str, runs: bool, grants: bool) -> Option<()> {
        if !grants && self.master.lock().granting() {
            // A standby of an earlier version would not decode a grant: none is made while it
            // is linked, and the pools' return is committed before its image (the entries
            // after it hold no grant).
            self.update_grants(true);
            let _ = self.master.journal.collect(self.master);
            self.commit_what_is_queued()?;
        }
        let Some(s) = self.sync.as_mut() else { return Some(()) };
        let sink: Arc<dyn AckSink> = s.release.clone();
        let mut link = match Link::open(member, addr, &s.hello, self.master.auth.clone(), sink) {
            Ok(l) => l,
            Err(e) => {
                let n = s.failed.get(member).filter(|f| f.2 == addr).map_or(0, |f| f.1) + 1;
                tracing::warn!("HA replication: {e}; retried in {:?}", retry_link_after(n));
                s.failed.insert(member.to_string(), (Instant::now(), n, addr.to_string()));
                return Some(());
            }
        };
        (link.runs, link.grants) = (runs, grants);
        // What is queued meanwhile is committed between the image's pieces and between its
        // frames' encoding (requests do not wait for the whole image) and goes to this standby
        // after its image.
        s.catch_up = Some(Vec::new());
        let Some(Frozen { image, seq, .. }) = self.image_in_pieces(true) else {
            if let Some(s) = self.sync.as_mut() {
                s.catch_up = None;
            }
            return None;
        };
        let at = seq.unwrap_or(self.seq);
        // (While standbys are in sync, what was enqueued before went out as entries that only
        // their acknowledgements answer, [`Release`]: answering them here, for the link of
        // another standby, would tell clients their changes are durable before they are.)
        let objects = image.len();
        // A standby that links while others are in sync gets the entries from where the etcd
        // journal is whole up to its image, for its takeover (the others started their runs
        // there when the set filled).
        let run = match self.sync.as_ref() {
            Some(s) if runs && !s.insync.is_empty() => s.tail().upto(at),
            _ => None,
        };
        let started = Instant::now();
        let mut ended = false;
        let mut between = || {
            ended = self.commit_what_is_queued().is_none();
            !ended
        };
        let encoded = image_frames(at, image, IMAGE_ENCODE_HOLD, &mut between);
        let run = match (&encoded, run) {
            (Ok(_), Some((base, frames))) => Some(run_frames(base, &frames, IMAGE_ENCODE_HOLD, &mut between)),
            _ => None,
        };
        let catch_up = self.sync.as_mut().and_then(|s| s.catch_up.take()).unwrap_or_default();
        if ended {
            return None;
        }
        let encode_ms = started.elapsed().as_millis() as u64;
        match encoded {
            Ok(frames) => {
                link.send_image(at, &frames);
                match run {
                    Some(Ok(frames)) => frames.iter().for_each(|f| {
                        link.send(f);
                    }),
                    Some(Err(e)) => tracing::info!("HA replication: the standby {member} gets no run of entries for its takeover: {e}"),
                    None => {}
                }
                for f in &catch_up {
                    link.send(f);
                }
            }
            Err(e) => {
                tracing::error!("HA replication: {e}");
                return Some(());
            }
        }
        tracing::info!(term = self.term(), seq = self.seq, changes = objects, encode_ms, "HA replication: the standby {member} ({addr}) linked; sending it the state");
        if let Some(s) = self.sync.as_mut() {
            s.links.push(link);
        }
        Some(())
    }

    /// Standbys that acknowledged everything written join the in-sync set (in etcd first).
    fn promote(&mut self) -> Option<()> {
        let term = self.term();
        let seq = self.seq;
        let Some(s) = self.sync.as_ref() else { return Some(()) };
        // (A standby whose registration does not name this term's mirror yet waits for it: a
        // member must say so in etcd before anyone relies on it, `sync::eligibility`.)
        let ready: Vec<String> = s
            .links
            .iter()
            .filter(|l| !l.dead() && !s.insync.contains(&l.member) && l.acked() >= seq.max(l.image_seq) && s.mirrors.get(&l.member) == Some(&Some(term)))
            .map(|l| l.member.clone())
            .collect();
        if ready.is_empty() {
            return Some(());
        }
        let mut members = s.insync.clone();
        let was_empty = members.is_empty();
        members.extend(ready.iter().cloned());
        self.txn(&[(self.insync_key.clone(), InSync { term, members: members.clone() }.to_bytes())], None)?;
        tracing::info!(term, seq, "HA replication: {ready:?} in sync; requests are now acknowledged by the in-sync set {members:?} instead of etcd");
        if let Some(s) = self.sync.as_mut() {
            if was_empty {
                // (Everything up to here was appended to etcd: the tail starts after it, the
                // standbys' too.)
                s.tail().start(seq);
                s.base(seq, true);
            }
            for m in &ready {
                s.failed.remove(m);
            }
            s.set_insync(members, &self.master.journal);
        }
        self.update_grants(false);
        Some(())
    }

    /// Deletes snapshot chunks that the head does not name (a leader that died between
    /// writing a new head and deleting the old snapshot leaves it behind).
    fn collect_garbage(&self) -> Option<()> {
        let all = format!("{}snap/", self.prefix);
        match self.head {
            Some(h) => {
                let keep = snap_dir(&self.prefix, h.seq);
                self.txn(&[], Some((&all, &keep)))?;
                self.txn(&[], Some((&prefix_end(&keep), &prefix_end(&all))))?;
            }
            None => {
                self.txn(&[], Some((&all, &prefix_end(&all))))?;
            }
        }
        Some(())
    }

    /// Makes the etcd journal whole with the state this leader starts from (taken over from
    /// a mirror, or empty), and empties the in-sync set: from then on the journal in etcd is
    /// whole again. The etcd journal ends at entry `stored`; the state is the mirror's at
    /// entry `seq`. With `tail`, the entries after `stored` up to `seq` as the mirror received
    /// them ([`super::sync::Mirror::take`]), they go to the log as a leader's rebase writes its
    /// own; else the whole state is written as a snapshot after the later of the two.
    /// Whether it wrote the tail (`Some(true)`) or the whole state.
    pub fn rebase_at_takeover(&mut self, stored: u64, seq: u64, tail: Option<Vec<super::sync::TailFrame>>) -> Option<bool> {
        let started = Instant::now();
        if let Some(frames) = tail.filter(|_| seq >= stored) {
            match tail_log_values(&self.prefix, &frames) {
                Some(values) => {
                    self.seq = seq;
                    return self.rebase_with(values, stored, frames.len() as u64, started).map(|_| true);
                }
                None => tracing::info!("HA journal: an entry the mirror received does not fit a log value; the takeover writes the whole state"),
            }
        }
        self.seq = seq.max(stored);
        self.rebase().map(|_| false)
    }

    /// Runs until the term ends or writing fails (then the leader is fenced at once).
    pub fn run(mut self) {
        let j = &self.master.journal;
        if self.collect_garbage().is_none() {
            tracing::warn!(term = self.term(), "HA journal: could not delete stale snapshot chunks");
        }
        loop {
            let (idle, lend) = self.lend();
            let (next, lent) = j.next(self.term(), idle, lend);
            self.take_back(lent);
            let Some((changes, upto)) = next else { break };
            if !changes.is_empty() && self.commit(changes, upto).is_none() {
                break;
            }
            if self.check_insync().is_none() {
                break;
            }
            if j.q().handoff {
                // Stopping: the state goes to etcd whole (the in-sync set emptied), nothing
                // more is acknowledged by standbys, and the leader refuses from now on.
                if self.streaming() && self.rebase().is_none() {
                    break;
                }
                self.sync = None;
                self.master.gate.fence(self.term());
                let mut q = j.q();
                q.handed_off = true;
                j.wake_all();
                continue;
            }
            if self.poll_standbys().is_none() || self.promote().is_none() {
                break;
            }
            let st = j.stats();
            if !self.streaming() && st.log_bytes > self.snapshot_bytes.max(st.snapshot_bytes) && self.snapshot().is_none() {
                break;
            }
            if self.streaming() && self.sync.as_ref().is_some_and(|s| s.tail().refresh_due()) && self.refresh_base().is_none() {
                break;
            }
            if let Some((bytes, whole)) = self.sync.as_ref().and_then(|s| s.tail().size_to_show()) {
                j.set_stats(|st| (st.tail_bytes, st.tail_whole) = (bytes, whole));
            }
        }
        self.sync = None; // links closed
        let ended = j.q().term != self.term();
        if !ended {
            // Nothing more can be made durable: refuse everything from now on.
            j.fail();
            self.master.gate.fence(self.term());
        }
    }
}

/// Writes the `term` marker, `"<term> <lease>"`: this leader (`owner`, its view key's
/// creation) loaded the journal. Whether the key was still `owner`'s.
pub fn mark_term(etcd: &EtcdClient, view_key: &str, cluster_id: &str, owner: Owner) -> Result<bool, String> {
    let marker = format!("{} {}", owner.create_revision, owner.lease);
    etcd.txn_if_owned(view_key, owner, &[(format!("{}term", prefix(cluster_id)), marker.into_bytes())], None).map(|r| r.is_some()).map_err(|e| e.to_string())
}

/// The leader a `term` marker names; `None` for anything else (an older build wrote the term
/// alone, which no longer names one leader: the new leader then waits out a fence bound).
fn parse_term_marker(s: &str) -> Option<Owner> {
    let (term, lease) = s.trim().split_once(' ')?;
    Some(Owner { create_revision: term.parse().ok()?, lease: lease.parse().ok()? })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::master::journal::ObjectRec;

    fn obj(i: usize) -> Change {
        Change::Object { key: format!("key-{i:06}"), rec: ObjectRec { size: 4096, current: smallvec::smallvec![(1, 4096 * i as u64, 4096)], pending: None, owner: 7, hard_pin: false, soft_pin_left: 0, group: None } }
    }

    #[test]
    fn chunks_stay_under_the_limit_and_decode_to_the_same_changes_in_order() {
        let changes: Vec<Change> = (0..40_000).map(obj).collect();
        let chunks = encode_chunks(&changes).expect("encode");
        assert!(chunks.len() > 1, "40k changes do not fit one value");
        assert!(chunks.iter().all(|c| c.len() <= CHUNK));
        assert!(chunks.iter().all(|c| c.starts_with(LZ4_MAGIC)), "similar changes compress");
        let back: Vec<Change> = chunks.iter().flat_map(|c| decode_chunk(c).expect("decode")).collect();
        assert_eq!(back, changes);
        assert!(encode_chunks(&[]).expect("empty").is_empty());
        assert!(decode_chunk(b"\xff\xff garbage").is_err());
    }

    /// Values written before compression (bare postcard) still load; a value compression does
    /// not shrink is kept bare; a bare `Vec<Change>` never looks compressed.
    #[test]
    fn bare_values_still_decode_and_incompressible_ones_stay_bare() {
        let changes: Vec<Change> = (0..500).map(obj).collect();
        let bare = postcard::to_stdvec(&changes).expect("encode");
        assert_eq!(decode_chunk(&bare).expect("an older build's entry"), changes);
        let packed = encode_chunks(&changes).expect("encode");
        assert_eq!(packed.len(), 1);
        assert!(packed[0].len() * 3 < bare.len(), "{} bytes compressed from {}", packed[0].len(), bare.len());
        let one = vec![Change::Forget { key: "k".into() }];
        assert_eq!(encode_chunks(&one).expect("encode"), vec![postcard::to_stdvec(&one).expect("encode")], "too small to pay: kept bare");
        // A bare encoding's first bytes: its length, then the first change's variant (< 6).
        let many: Vec<Change> = (0..(LZ4_MAGIC[0] as usize)).map(obj).collect();
        let b = postcard::to_stdvec(&many).expect("encode");
        assert_eq!(b[0], LZ4_MAGIC[0]);
        assert_ne!(b[1], LZ4_MAGIC[1]);
        assert_eq!(decode_chunk(&b).expect("decode"), many);
    }

    /// A corrupt compressed value is an error naming the corruption, never a panic or a huge
    /// allocation.
    #[test]
    fn corrupt_compressed_values_are_refused() {
        let good = encode_chunks(&(0..500).map(obj).collect::<Vec<_>>()).expect("encode").remove(0);
        let mut huge = good.clone();
        huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_chunk(&huge).is_err_and(|e| e.contains("claims")));
        assert!(decode_chunk(&good[..6]).is_err_and(|e| e.contains("cut short")));
        let mut flipped = good.clone();
        let n = flipped.len();
        flipped[n / 2] ^= 0x55;
        flipped.truncate(n - 3);
        assert!(decode_chunk(&flipped).is_err());
    }

    proptest::proptest! {
        #[test]
        fn decoding_any_value_never_panics(tail in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512), claimed in 0u32..(1 << 20)) {
            let _ = decode_chunk(&tail);
            if let Ok((_, v)) = log_range(1, &tail) {
                let _ = decode_chunk(v);
            }
            let mut v = LZ4_MAGIC.to_vec();
            v.extend_from_slice(&claimed.to_le_bytes());
            v.extend_from_slice(&tail);
            let _ = decode_chunk(&v);
        }
    }

    /// A deferred answer (a request whose thread went back to its connection) is answered
    /// exactly once: when its ticket is written, when the term ends, fails or restarts, when it
    /// waited too long, or, if a path forgot it, when it is dropped.
    #[test]
    fn a_deferred_answer_is_answered_exactly_once_when_written_never_across_terms() {
        use crate::master::MasterConfig;
        use std::sync::mpsc;
        let m = Master::new(MasterConfig::default());
        let j = &m.journal;
        let (tx, rx) = mpsc::channel::<(u32, Result<(), StoreError>)>();
        let answer = |id: u32| -> Answer {
            let tx = tx.clone();
            Box::new(move |r| tx.send((id, r)).expect("the test listens"))
        };
        let got = |rx: &mpsc::Receiver<(u32, Result<(), StoreError>)>| rx.try_iter().collect::<Vec<_>>();
        j.activate(5);
        j.q().enqueued = 3;
        j.defer((5, 2), answer(1));
        j.defer((5, 3), answer(2));
        j.defer((4, 1), answer(3));
        assert_eq!(got(&rx), vec![(3, Err(StoreError::OutcomeUnknown))], "another term's ticket: refused at once");
        j.done(1);
        assert!(got(&rx).is_empty(), "ticket 1 written: nothing deferred for it");
        j.done(2);
        assert_eq!(got(&rx), vec![(1, Ok(()))]);
        j.defer((5, 2), answer(4));
        assert_eq!(got(&rx), vec![(4, Ok(()))], "written already: answered at once, on this thread");
        // A late acknowledgement of another term answers nothing; the term's end refuses.
        j.done_in(4, 3);
        assert!(got(&rx).is_empty());
        j.deactivate();
        assert_eq!(got(&rx), vec![(2, Err(StoreError::OutcomeUnknown))]);
        j.done(3);
        assert!(got(&rx).is_empty(), "answered once only");
        // A restart of the term and a failed writer refuse what waited.
        j.activate(6);
        j.q().enqueued = 2;
        j.defer((6, 1), answer(5));
        j.activate(7);
        assert_eq!(got(&rx), vec![(5, Err(StoreError::OutcomeUnknown))]);
        j.q().enqueued = 2;
        j.defer((7, 1), answer(6));
        j.fail();
        assert_eq!(got(&rx), vec![(6, Err(StoreError::OutcomeUnknown))]);
        // Waiting too long: the journal's bounded-wait error, the others kept.
        j.activate(8);
        j.q().enqueued = 3;
        j.defer((8, 1), answer(7));
        std::thread::sleep(Duration::from_millis(30));
        j.defer((8, 2), answer(8));
        j.expire(Duration::from_millis(20));
        assert!(matches!(got(&rx)[..], [(7, Err(StoreError::Rpc(_)))]));
        j.done(2);
        assert_eq!(got(&rx), vec![(8, Ok(()))]);
        // Forgotten (dropped unanswered): refused, never left waiting.
        drop(Later { since: Instant::now(), answer: Some(answer(9)) });
        assert_eq!(got(&rx), vec![(9, Err(StoreError::OutcomeUnknown))]);
    }

    /// The queue without etcd: what a request waits for, what ends the wait.
    #[test]
    fn a_request_is_answered_only_once_its_changes_are_written_and_never_across_terms() {
        use crate::master::MasterConfig;
        use crate::proto::Segment;
        let m = Master::new(MasterConfig::default());
        let j = &m.journal;
        assert_eq!(j.collect(&m), None, "not journaling: nothing to wait for");
        {
            let mut st = m.lock();
            st.term = 5;
            st.journal_on();
        }
        j.activate(5);
        let seg = |id| Segment { id, name: format!("s{id}"), te_endpoint: format!("127.0.0.1:{id}"), base: id << 32, size: 1 << 20 };
        m.lock().mount(1, seg(1), 0).expect("mount");
        let t1 = j.collect(&m).expect("a change to wait for");
        assert_eq!(t1, (5, 1));
        // A second request's change while the first is unwritten: one batch covers both.
        m.lock().mount(2, seg(2), 0).expect("mount");
        let t2 = j.collect(&m).expect("ticket");
        assert_eq!(t2, (5, 2));
        assert!(matches!(j.wait(t1, Duration::from_millis(30)), Err(StoreError::Rpc(_))), "not written: the wait is bounded");
        let (batch, upto) = j.next(5, Duration::ZERO, None).0.expect("the writer's batch");
        assert_eq!((batch.len(), upto), (4, 2), "two clients and two segments, both requests' changes");
        // A request already asleep is woken by the write (the wake comes after the queue's
        // lock is released, and is never lost): answered long before its bound.
        assert_eq!(woken(|| j.wait(t1, Duration::from_secs(10)), || j.done(upto)), Ok(()));
        assert_eq!(j.wait(t1, Duration::ZERO), Ok(()));
        assert_eq!(j.wait(t2, Duration::ZERO), Ok(()));
        // A writer already asleep is woken by the next change collected.
        let mut t5 = None;
        let got = woken(
            || j.next(5, Duration::from_secs(10), None).0.map(|(c, u)| (c.len(), u)),
            || {
                m.lock().mount(5, seg(5), 0).expect("mount");
                t5 = j.collect(&m);
            },
        );
        let t5 = t5.expect("ticket").1;
        assert_eq!(got, Some((2, t5)), "the client and the segment");
        j.done(t5);
        assert_eq!(j.collect(&m), None, "nothing outstanding");
        // A ticket of a term that ended is refused, even if a new term started since.
        m.lock().mount(3, seg(3), 0).expect("mount");
        let t3 = j.collect(&m).expect("ticket");
        j.deactivate();
        j.activate(6);
        assert!(matches!(j.wait(t3, Duration::from_secs(5)), Err(StoreError::OutcomeUnknown)), "refused at once, not after the bound");
        // A writer that gave up refuses every waiter.
        j.activate(5);
        m.lock().mount(4, seg(4), 0).expect("mount");
        let t4 = j.collect(&m).expect("ticket");
        j.fail();
        assert!(matches!(j.wait(t4, Duration::from_secs(5)), Err(StoreError::OutcomeUnknown)));
        assert!(j.next(5, Duration::ZERO, None).0.is_none(), "the writer stops");
    }

    #[test]
    fn a_streamed_entry_is_answered_once_every_in_sync_standby_acknowledged_it_in_order_and_never_across_terms() {
        let j = Journal::default();
        j.activate(7);
        j.q().enqueued = 3; // tickets 1..=3 collected
        let r = Release::new(&j, 7);
        let (a, b) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        r.set_members(vec![Arc::clone(&a), Arc::clone(&b)]);
        r.push(10, 1);
        r.push(11, 3);
        let written = || j.q().written;
        a.store(11, Ordering::Release);
        r.acked();
        assert_eq!(written(), 0, "one standby of two acknowledged: nothing is answered");
        b.store(10, Ordering::Release);
        // The request of ticket 1, asleep, is woken by the acknowledgement that completes it.
        assert_eq!(woken(|| j.wait((7, 1), Duration::from_secs(10)), || r.acked()), Ok(()));
        assert_eq!(written(), 1, "entry 10 is everywhere: its ticket is answered, entry 11's not yet");
        assert_eq!(r.oldest().map(|(seq, _)| seq), Some(11));
        // The slow member leaves the set (etcd said so first): what the rest has is answered.
        r.set_members(vec![Arc::clone(&a)]);
        assert_eq!(written(), 3);
        assert_eq!(r.oldest(), None);
        // With no member nothing is released, whatever is acknowledged.
        r.set_members(Vec::new());
        j.q().enqueued = 4;
        r.push(12, 4);
        a.store(12, Ordering::Release);
        r.acked();
        assert_eq!(written(), 3);
        // A broken link wakes the writer at once, even if it was not waiting yet.
        r.broke();
        let t = Instant::now();
        assert_eq!(j.next(7, Duration::from_secs(5), None).0.map(|(c, _)| c.len()), Some(0));
        assert!(t.elapsed() < Duration::from_secs(1), "the writer looked at once");
        // A late acknowledgement of an ended term answers nothing in the next one.
        j.deactivate();
        j.activate(8);
        j.q().enqueued = 4;
        r.set_members(vec![Arc::clone(&a)]);
        assert_eq!(written(), 0, "term 7's release does not touch term 8's tickets");
        // Nor does one of a term whose writer gave up.
        let r8 = Release::new(&j, 8);
        r8.set_members(vec![Arc::clone(&a)]);
        j.fail();
        r8.push(12, 4);
        r8.acked();
        assert_eq!(written(), 0);
    }

    /// Runs `wait` on a thread of its own and `wake` once that thread is (almost surely)
    /// asleep: what `wait` returned, checked to have come from the wake-up and not from the
    /// waits' 10 s bound.
    fn woken<T: Send>(wait: impl FnOnce() -> T + Send, wake: impl FnOnce()) -> T {
        std::thread::scope(|sc| {
            let waiter = sc.spawn(|| {
                let t = Instant::now();
                (wait(), t.elapsed())
            });
            std::thread::sleep(Duration::from_millis(50));
            wake();
            let (got, took) = waiter.join().expect("the waiting thread");
            assert!(took < Duration::from_secs(5), "woken, not timed out: {took:?}");
            got
        })
    }

    /// A journal of term 7 with `enqueued` tickets queued, and its release with one in-sync
    /// member whose acknowledged entries the test sets.
    fn one_member(enqueued: u64) -> (Journal, Release, Arc<AtomicU64>) {
        let j = Journal::default();
        j.activate(7);
        j.q().enqueued = enqueued;
        let r = Release::new(&j, 7);
        let a = Arc::new(AtomicU64::new(0));
        r.set_members(vec![Arc::clone(&a)]);
        (j, r, a)
    }

    #[test]
    fn a_large_commit_streams_as_pieces_and_only_its_last_piece_answers() {
        let changes: Vec<Change> = (0..10_000).map(obj).collect();
        let ps = pieces(changes.clone(), 5, 4096);
        assert_eq!(ps.iter().map(|(p, t)| (p.len(), *t)).collect::<Vec<_>>(), vec![(4096, 0), (4096, 0), (1808, 5)]);
        assert_eq!(ps.into_iter().flat_map(|(p, _)| p).collect::<Vec<_>>(), changes, "in order, nothing lost or repeated");
        let exact: Vec<(usize, u64)> = pieces(changes[..8192].to_vec(), 5, 4096).iter().map(|(p, t)| (p.len(), *t)).collect();
        assert_eq!(exact, vec![(4096, 0), (4096, 5)], "no empty piece after an exact multiple");
        assert_eq!(pieces(changes[..3].to_vec(), 5, 4096).iter().map(|(p, t)| (p.len(), *t)).collect::<Vec<_>>(), vec![(3, 5)]);
        assert_eq!(pieces(changes[..3].to_vec(), 5, 0).len(), 3, "a piece holds at least one change");

        // Released piece by piece: the request is answered by the last piece only.
        let (j, r, a) = one_member(6);
        let written = || j.q().written;
        for (seq, (_, ticket)) in (1..).zip(pieces((0..10_000).map(obj).collect(), 5, 4096)) {
            r.push(seq, ticket);
        }
        a.store(2, Ordering::Release);
        r.acked();
        assert_eq!(written(), 0, "two pieces of three applied: the commit is not answered");
        a.store(3, Ordering::Release);
        r.acked();
        assert_eq!(written(), 5);
        // A commit's last piece and the next commit's first piece acknowledged together: the
        // first commit is answered (the largest ticket, not the last entry's 0).
        r.push(4, 6);
        r.push(5, 0);
        a.store(5, Ordering::Release);
        r.acked();
        assert_eq!(written(), 6);
    }

    #[test]
    fn a_standby_working_through_a_burst_is_late_only_one_bound_after_its_last_progress() {
        let (j, r, a) = one_member(1);
        let sent = Instant::now();
        for seq in 1..=3 {
            r.push(seq, if seq == 3 { 1 } else { 0 });
        }
        let (seq, since) = r.oldest().expect("pending");
        assert_eq!(seq, 1);
        assert!(since >= sent && since <= Instant::now(), "nothing released yet: the clock runs from the send");
        std::thread::sleep(Duration::from_millis(30));
        let before_ack = Instant::now();
        a.store(1, Ordering::Release);
        r.acked();
        let (seq, since) = r.oldest().expect("pending");
        assert_eq!(seq, 2);
        assert!(since >= before_ack, "entry 2's clock starts when entry 1 was released, not when it was sent ({:?} earlier)", before_ack - sent);
        // An entry sent long after the last release: its clock starts at its send.
        a.store(3, Ordering::Release);
        r.acked();
        assert_eq!(r.oldest(), None);
        std::thread::sleep(Duration::from_millis(30));
        j.q().enqueued = 2;
        let sent4 = Instant::now();
        r.push(4, 2);
        assert!(r.oldest().expect("pending").1 >= sent4);
    }

    /// While the streaming writer sleeps and every entry is acknowledged, a request's changes
    /// go to the standbys from the request's own thread (the writer not woken), as the next
    /// entry after the writer's last, and are answered by the standby's acknowledgement; while
    /// that entry is in flight, the next request's changes wait for the writer (woken), which
    /// gets its links back with the sequence number moved on.
    #[test]
    fn an_entry_collected_while_the_writer_sleeps_leaves_from_the_requests_thread_in_sequence() {
        use super::super::sync::{encode_frame, read_frame, ToLeader};
        use crate::master::MasterConfig;
        use std::io::Write;
        let m = Master::new(MasterConfig::default());
        {
            let mut st = m.lock();
            st.term = 7;
            st.journal_on();
        }
        let j = &m.journal;
        j.activate(7);
        // A standby: the test reads what the leader sends and acknowledges by hand.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let release = Arc::new(Release::new(j, 7));
        let hello = ToStandby::Hello { cluster_id: "c".into(), term: 7, lease: 1, leader: "me".into() };
        let sink: Arc<dyn AckSink> = release.clone();
        let link = Link::open("standby", &addr, &hello, None, sink).expect("link");
        let (mut standby, _) = listener.accept().expect("accept");
        standby.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        assert!(matches!(read_frame::<ToStandby>(&mut standby), Ok(ToStandby::Hello { term: 7, .. })));
        release.set_members(vec![link.ack_counter()]);
        let lent = Lent { seq: 41, links: vec![link], release: Arc::clone(&release), tail: Arc::new(Mutex::new(Tail::new(0, BASE_EVERY))) };
        let register = |client| {
            let mut st = m.lock();
            st.register_client(client, 0);
            j.collect_held(st, 0)
        };
        std::thread::scope(|sc| {
            let writer = sc.spawn(|| j.next(7, Duration::from_secs(20), Some(lent)));
            let until = Instant::now() + Duration::from_secs(10);
            while j.q().lent.is_none() {
                assert!(Instant::now() < until, "the writer did not go to sleep within 10 s");
                std::thread::sleep(Duration::from_millis(5));
            }
            let ticket = register(5).expect("a ticket");
            assert_eq!(ticket, (7, 1));
            match read_frame::<ToStandby>(&mut standby) {
                Ok(ToStandby::Entry { seq, changes }) => {
                    assert_eq!(seq, 42, "the entry after the writer's last");
                    assert_eq!(changes, vec![Change::Client { id: 5, live: true }]);
                }
                other => panic!("expected entry 42, got {other:?}"),
            }
            assert!(j.q().writer_asleep && !writer.is_finished(), "the writer was not woken");
            assert_eq!(j.q().written, 0, "not answered before the standby acknowledged it");
            // Entry 42 in flight: the next changes go to the writer, which wakes with them.
            assert_eq!(register(6), Some((7, 2)));
            let (batch, lent) = writer.join().expect("the writer");
            assert_eq!(batch, Some((vec![Change::Client { id: 6, live: true }], 2)));
            let lent = lent.expect("the writer gets back what it lent");
            assert_eq!((lent.seq, lent.links.len()), (42, 1));
            standby.write_all(&encode_frame(&ToLeader::Ack { seq: 42 }).expect("encode")).expect("ack");
            assert_eq!(j.wait(ticket, Duration::from_secs(10)), Ok(()), "answered by the acknowledgement");
            standby.set_read_timeout(Some(Duration::from_millis(100))).expect("timeout");
            let mut b = [0u8; 1];
            assert!(std::io::Read::read(&mut standby, &mut b).is_err(), "nothing more sent without the writer");
        });
    }

    /// A standby linking while requests keep changing the state: the leader takes its image
    /// in pieces and commits what is queued between them (to the in-sync member at once). The
    /// new standby gets the image, then exactly the entries after the image's position, in
    /// order, none twice (an entry it holds already, or a gap, would cut its link), and the
    /// image with those entries holds what the leader holds. Fails when the entries committed
    /// before the image's position are sent again, or those after it are not sent.
    #[test]
    fn a_standby_linking_under_load_gets_its_image_then_every_later_entry_once_in_order() {
        use super::super::sync::read_frame;
        use crate::master::{MasterConfig, PutId, Stats};
        use crate::proto::{ReplicateConfig, Segment};
        let (m, cfg, stats) = (Master::new(MasterConfig::default()), MasterConfig::default(), Stats::default());
        let put = |st: &mut State, client: u64, key: &str| {
            let id = PutId { client, put: 1 };
            st.put_start(&cfg, &stats, id, key, 4096, &ReplicateConfig::default(), false, 0).and_then(|_| st.put_end(id, key, 0)).expect("put");
        };
        {
            let mut st = m.lock();
            st.term = 7;
            st.journal_on();
            st.mount(1, Segment { id: 1, name: "seg1".into(), te_endpoint: "127.0.0.1:1".into(), base: 1 << 40, size: 1 << 38 }, 0).expect("mount");
            // Enough objects for an image of several holds of the lock.
            for i in 0..200_000 {
                put(&mut st, 1, &format!("old-{i}"));
            }
            let _ = st.take_changes(0);
        }
        let j = &m.journal;
        j.activate(7);
        let owner = Owner { create_revision: 7, lease: 1 };
        // (No etcd is reached: with a member in sync, commits go to the standbys only.)
        let etcd = EtcdClient::new(&["127.0.0.1:1".to_string()], Duration::from_secs(1));
        let mut sync = Replicas::new("c", "me", owner, Duration::from_secs(60), (64 << 20, BASE_EVERY), j);
        let standby = |name: &str, sync: &Replicas| {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            let addr = listener.local_addr().expect("addr").to_string();
            let sink: Arc<dyn AckSink> = sync.release.clone();
            let link = Link::open(name, &addr, &sync.hello, None, sink).expect("link");
            let (sock, _) = listener.accept().expect("accept");
            sock.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
            (link, sock, addr)
        };
        let (member, _member_sock, _) = standby("s1", &sync);
        sync.links.push(member);
        sync.set_insync(vec!["s1".to_string()], j);
        let mut w = Writer { etcd: &etcd, master: &m, view_key: "v".into(), prefix: prefix("c"), owner, seq: 100, head: None, snapshot_bytes: SNAPSHOT_MIN, sync: Some(sync), insync_key: "i".into(), retry_until: None };
        // The new standby's side of its link, opened by `open_link`.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let stop = std::sync::atomic::AtomicBool::new(false);
        let (mut sock, added) = std::thread::scope(|sc| {
            // Requests changing the state all along: new objects, old ones removed.
            let load = sc.spawn(|| {
                let mut n = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let mut st = m.lock();
                    put(&mut st, 1, &format!("new-{n}"));
                    let _ = st.remove(&cfg, &format!("old-{n}"), true, 0);
                    let _ = j.collect_held(st, 0);
                    n += 1;
                }
                n
            });
            let accept = sc.spawn(|| listener.accept().expect("accept").0);
            w.open_link("s2", &addr, false, false).expect("the standby linked");
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            let added = load.join().expect("load");
            (accept.join().expect("accept"), added)
        });
        let linked = w.seq;
        // What was queued after the link went out: committed as the writer would.
        if let (Some((changes, upto)), _) = j.next(7, Duration::ZERO, None) {
            if !changes.is_empty() {
                w.commit(changes, upto).expect("commit");
            }
        }
        sock.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
        assert!(matches!(read_frame::<ToStandby>(&mut sock), Ok(ToStandby::Hello { term: 7, .. })));
        let mut image = Image::default();
        let at = loop {
            match read_frame::<ToStandby>(&mut sock) {
                Ok(ToStandby::Image { seq, changes, last }) => {
                    changes.into_iter().for_each(|c| image.apply(c));
                    if last {
                        break seq;
                    }
                }
                other => panic!("expected the image, got {other:?}"),
            }
        };
        let mut next = at + 1;
        while next <= w.seq {
            match read_frame::<ToStandby>(&mut sock) {
                Ok(ToStandby::Entry { seq, changes }) => {
                    assert_eq!(seq, next, "the entries after the image's position ({at}), in order, none twice");
                    changes.into_iter().for_each(|c| image.apply(c));
                    next += 1;
                }
                other => panic!("expected entry {next}, got {other:?}"),
            }
        }
        assert!(added > 0 && linked > at, "entries were committed between the image's pieces: {added} puts, the image at {at}, the last entry at the link {linked}");
        assert_eq!(image.objects(), m.lock().summary().keys, "the image and the entries after it hold the leader's objects");
    }

    /// Streamed entries' frames give the log values of their changes without decoding them:
    /// read back as [`load`] reads the log (each key the next number, a value's range), they
    /// hold the same changes in order and end at the last entry, for small and large sequence
    /// numbers (the varint's length changes), empty entries, entries that fill a value and a
    /// frame that stands for several log entries (what a leader appended to etcd in several
    /// values, streamed as one); a frame of another entry, not an entry, or frames that are
    /// not consecutive give none.
    #[test]
    fn streamed_entries_frames_are_their_log_values() {
        let p = prefix("c");
        for (first, sizes) in [(1u64, vec![3usize]), (120, vec![0, 5, 4096, 4096, 1, 0, 300, 2000, 4096]), (u64::MAX - 12, vec![17, 2])] {
            let mut all = Vec::new();
            let mut next = first;
            let frames: Vec<TailFrame> = sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    let changes: Vec<Change> = (0..n).map(|k| obj(k + 7 * i)).collect();
                    all.extend(changes.iter().cloned());
                    // (The third frame of each stands for three log entries.)
                    let span = if i == 1 { 3 } else { 1 };
                    let (from, last) = (next, next + span - 1);
                    next = last + 1;
                    TailFrame { first: from, last, frame: entry_frame(last, changes).0.expect("frame") }
                })
                .collect();
            let values = tail_log_values(&p, &frames).expect("values");
            assert!(values.len() < frames.len() || frames.len() == 1, "entries share values");
            let (mut seq, mut back) = (first - 1, Vec::new());
            for (key, v) in &values {
                assert_eq!(*key, log_key(&p, seq + 1), "each value's key is the entry after the last one's");
                assert!(v.len() <= REBASE_VALUE_MAX);
                let (last, value) = log_range(seq + 1, v).expect("range");
                seq = last;
                back.extend(decode_chunk(value).expect("decodes"));
            }
            assert_eq!(seq, next - 1, "the values end at the last entry");
            assert_eq!(back, all, "the same changes in order");
        }
        let tf = |first: u64, last: u64, frame: &Arc<Vec<u8>>| TailFrame { first, last, frame: Arc::clone(frame) };
        let frame = entry_frame(5, vec![obj(1)]).0.expect("frame");
        assert!(tail_log_values(&p, &[tf(6, 6, &frame)]).is_none(), "another entry's frame");
        assert!(tail_log_values(&p, &[tf(6, 5, &frame)]).is_none(), "a range that ends before it starts");
        let other = entry_frame(7, vec![obj(2)]).0.expect("frame");
        assert!(tail_log_values(&p, &[tf(5, 5, &frame), tf(7, 7, &other)]).is_none(), "a gap between frames");
        assert!(tail_log_values(&p, &[tf(4, 5, &frame), tf(6, 7, &other)]).is_some(), "consecutive ranges");
        let hello = Arc::new(super::super::sync::encode_frame(&ToStandby::Hello { cluster_id: "c".into(), term: 1, lease: 2, leader: "l".into() }).expect("frame"));
        assert!(tail_log_values(&p, &[tf(1, 1, &hello)]).is_none(), "not an entry");
        assert!(log_range(9, b"KVFn\x05\0\0\0\0\0\0\0").is_err(), "a range that ends before it starts");
        assert!(log_range(9, b"KVFn\x05").is_err(), "a range cut short");
    }

    /// The tail keeps the entries after the etcd journal's position while they follow each
    /// other and fit the cap; one missing, or one over the cap, drops the run. A background
    /// snapshot's run, begun at its image's position, replaces the current one only once its
    /// head is written; a rebase takes the current run only if it reaches the last entry.
    /// A standby whose links keep failing is tried again after 1, 2, 4 ... 32 s, never less
    /// than the first wait nor more than the last.
    #[test]
    fn a_standby_that_cannot_link_is_tried_less_and_less_often() {
        let s = |n| retry_link_after(n).as_secs();
        assert_eq!([s(0), s(1), s(2), s(3), s(6), s(7), s(u32::MAX)], [1, 1, 2, 4, 32, 32, 32]);
    }

    #[test]
    fn the_tail_keeps_a_whole_run_from_the_journals_position_or_none() {
        let f = |n: usize| Arc::new(vec![0u8; n]);
        let mut t = Tail::new(100, Duration::ZERO);
        t.push(1, &f(10));
        assert_eq!(t.size(), (0, false), "nothing kept before a run starts");
        t.start(5);
        for seq in 6..=8 {
            t.push(seq, &f(10));
        }
        assert_eq!(t.size(), (30, true));
        assert!(!t.refresh_due(), "a whole run needs no background snapshot");
        assert!(t.take(9).is_none(), "a run that does not reach the last entry is not used");
        assert_eq!(t.size(), (0, false), "and the tail is empty after a take");
        t.start(5);
        t.push(6, &f(10));
        t.push(8, &f(10));
        assert_eq!(t.size(), (0, false), "a missing entry drops the run");
        assert!(t.upto(6).is_none(), "and none is sent to a standby that links");
        t.start(5);
        t.push(6, &f(60));
        t.push(7, &f(60));
        assert_eq!(t.size(), (0, false), "over the cap drops the run");
        assert!(t.refresh_due(), "then a background snapshot is due");
        t.every = Duration::from_secs(3600);
        assert!(!t.refresh_due(), "but not before `every` since the run started");
        t.every = Duration::ZERO;
        // A background snapshot: its image at 7, entries 8 and 9 meanwhile.
        t.start(5);
        t.push(6, &f(10));
        t.push(7, &f(10));
        t.begin(7);
        assert!(t.next.is_none(), "no run begins unless asked for");
        t.want_next = true;
        t.begin(7);
        t.push(8, &f(10));
        t.push(9, &f(10));
        assert_eq!(t.size(), (40, true), "the current run goes on until the head is written");
        // A standby linking now, its image at 8, gets the current run up to there.
        let lasts = |u: Option<(u64, Vec<TailFrame>)>| u.map(|(b, f)| (b, f.iter().map(|f| f.last).collect::<Vec<_>>()));
        assert_eq!(lasts(t.upto(8)), Some((5, vec![6, 7, 8])));
        assert_eq!(lasts(t.upto(5)), Some((5, vec![])), "an image at the run's start: nothing before it");
        assert_eq!(lasts(t.upto(4)), None, "an image before the run's start");
        assert_eq!(lasts(t.upto(10)), None, "an image after the run's last entry");
        t.based();
        assert_eq!(t.size(), (20, true), "then the run from the image's position");
        let run = t.take(9).expect("whole");
        assert_eq!((run.base, run.frames.iter().map(|f| f.last).collect::<Vec<_>>()), (7, vec![8, 9]));
        // Given up: the current run stays.
        t.start(9);
        t.want_next = true;
        t.begin(9);
        t.push(10, &f(10));
        t.next = None;
        assert_eq!(t.take(10).map(|r| r.base), Some(9));
        let mut none = Tail::new(0, Duration::ZERO);
        none.start(1);
        none.push(2, &f(1));
        assert!(none.take(2).is_none(), "a cap of 0 keeps nothing");
        assert!(!none.refresh_due());
    }

    #[test]
    fn keys_sort_in_sequence_order() {
        let p = prefix("c/");
        assert_eq!(p, "mooncake-store/c/journal/");
        assert!(log_key(&p, 9) < log_key(&p, 10) && log_key(&p, 0xff) < log_key(&p, 0x100));
        assert!(log_key(&p, u64::MAX) < prefix_end(&format!("{p}log/")));
        assert!(snap_dir(&p, 1) < prefix_end(&snap_dir(&p, 1)));
    }
}
