//! Gets served from a disk (Mooncake's `batch_get_offload_object`): an object whose only copy
//! is on a client's disk tier is read by asking that client (the owner) to stage the record's
//! value in its staging buffer (registered memory), READing it from there over the transfer
//! engine, and telling the owner to release the space.
//!
//! The owner answers on its engine's handshake port ([`kvferry::TransferEngine::serve`]:
//! the engine's name is what the master lists as the disk copy's endpoint; with the cluster
//! key the call is authenticated as every handshake is). Each staging request runs on the
//! handshake connection's own thread (the port serves 256 at most), which takes the staging
//! space for its records in order and reads them together with the owner's readers
//! (`disk_readers.rs`, a small thread pool): the records of one request, and those of
//! requests from several readers, are read at once. A reader asks the owners of a batch at
//! once (a thread each but the first), and reads the batch's objects in memory beside them.
//! Reads are buffered `pread`s of whole records through the page cache, not `O_DIRECT`: a
//! record is one file whose value follows a header and the key (no alignment for `O_DIRECT`
//! without copying), it is read whole to check its checksum before a byte of it is handed
//! out, and repeated gets of hot records (a conversation's earlier turns) are then served
//! from memory.
//!
//! What a reader gets is never wrong: the owner stages a value only when its record's length
//! is the length the master named and its checksum holds ([`crate::disk::DiskTier::get_into`]);
//! a record that fails either is deleted, the master is told at the next beat, and the reader
//! gets [`StoreError::ObjectNotFound`]. Staged space is held for the reader for [`STAGED_TTL`]
//! at most (a reader that died frees it then); a reader whose READ ended later than that
//! refuses what it read. A value larger than the staging buffer is refused, naming the
//! setting; a batch that does not fit at once is staged in rounds. An owner that does not
//! answer within `ClientConfig::ssd_read_timeout` fails the get (the port's own deadline
//! bounds what it spends on one).

use super::disk_readers::{Readers, READERS};
use super::{Client, Inner};
use crate::error::{StoreError, StoreResult};
use crate::master::alloc::{Block, SegmentSpace};
use crate::proto::DiskReplicaList;
use kvferry::hostbuf::HostBuffer;
use kvferry::TransferRequest;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

/// How long an owner holds staged bytes for a reader that does not release them.
pub(super) const STAGED_TTL: Duration = Duration::from_secs(10);

/// How long a staging request waits for space in a staging buffer that others hold.
const SPACE_WAIT: Duration = Duration::from_secs(2);

/// Bytes of one owner's objects a reader asks for in one staging request, when a batch
/// holds more (its requests then run at once, within [`LANES`]).
const PART_BYTES: u64 = 4 << 20;

/// Staging requests of one batch in flight at once.
const LANES: usize = 8;

/// The most objects one staging request names.
const MAX_ITEMS: usize = 1024;

/// A record a staging request reads: its index, key, value length and staging address.
type Record = (usize, String, u64, u64);

/// A reader's request to an owner.
#[derive(Debug, Serialize, Deserialize)]
enum DiskCall {
    /// Stage these objects' values, each `(key, length the master named)`.
    Stage { items: Vec<(String, u64)> },
    /// The reader is done with a staged batch.
    Release { batch: u64 },
}

/// An owner's answer.
#[derive(Debug, Serialize, Deserialize)]
enum DiskAnswer {
    /// Per item, in order; the space of those staged is held under `batch` for `ttl_ms`.
    Staged {
        batch: u64,
        ttl_ms: u64,
        items: Vec<Staging>,
    },
    Released,
    Refused(StoreError),
}

/// One object of a [`DiskCall::Stage`].
#[derive(Debug, Serialize, Deserialize)]
enum Staging {
    /// Its value is at `addr` (in the owner's staging buffer, registered with its engine).
    At {
        addr: u64,
    },
    /// The disk does not hold it (any more), or its record failed its length or checksum.
    Absent,
    /// No room in the staging buffer now: ask again after releasing this batch.
    Later,
    Failed(StoreError),
}

/// The owner's side: the staging buffer and the batches staged in it.
pub(super) struct Stager {
    buf: HostBuffer,
    state: Mutex<Staged>,
    /// Signalled when space is freed.
    freed: Condvar,
    /// The threads that read records into the buffer.
    readers: Readers,
}

struct Staged {
    space: SegmentSpace,
    /// Batch -> its blocks, and when they are taken back unreleased.
    batches: HashMap<u64, (Vec<Block>, Instant)>,
    next: u64,
}

impl Staged {
    fn reclaim_expired(&mut self, now: Instant) -> bool {
        let gone: Vec<u64> = self
            .batches
            .iter()
            .filter(|(_, (_, until))| *until <= now)
            .map(|(&b, _)| b)
            .collect();
        for b in &gone {
            if let Some((blocks, _)) = self.batches.remove(b) {
                self.space.free_many(blocks);
            }
        }
        !gone.is_empty()
    }
}

impl Stager {
    /// A staging buffer of `size` bytes, registered with `engine`.
    pub(super) fn register(engine: &kvferry::TransferEngine, size: u64) -> StoreResult<Stager> {
        let buf = HostBuffer::new(size.max(4096) as usize, true)
            .map_err(|e| StoreError::InvalidParams(format!("ssd_offload_staging_size: {e}")))?;
        engine
            .register_memory(buf.addr(), buf.len() as u64, "cpu:0")
            .map_err(|e| StoreError::Internal(e.to_string()))?;
        Ok(Stager::new(buf))
    }

    fn new(buf: HostBuffer) -> Stager {
        let space = SegmentSpace::new(buf.addr(), buf.len() as u64);
        Stager {
            buf,
            state: Mutex::new(Staged {
                space,
                batches: HashMap::new(),
                next: 0,
            }),
            freed: Condvar::new(),
            readers: Readers::start(READERS),
        }
    }

    pub(super) fn addr(&self) -> u64 {
        self.buf.addr()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, Staged> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A block of `len` bytes; with `wait` (the batch holds nothing yet), waits up to
    /// [`SPACE_WAIT`] for other batches to give space back.
    fn allocate(&self, len: u64, wait: bool) -> Option<Block> {
        let deadline = Instant::now() + SPACE_WAIT;
        let mut st = self.state();
        loop {
            if let Some(b) = st.space.allocate(len.max(1)) {
                return Some(b);
            }
            let now = Instant::now();
            if st.reclaim_expired(now) {
                continue;
            }
            if !wait || now >= deadline {
                return None;
            }
            // Wakes when space is released, or when the earliest batch expires.
            let until = st
                .batches
                .values()
                .map(|(_, u)| *u)
                .min()
                .unwrap_or(deadline)
                .min(deadline);
            st = self
                .freed
                .wait_timeout(st, until.saturating_duration_since(now))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn release(&self, batch: u64) {
        let mut st = self.state();
        if let Some((blocks, _)) = st.batches.remove(&batch) {
            st.space.free_many(blocks);
            self.freed.notify_all();
        }
    }
}

/// The owner's service: answers a reader's [`DiskCall`] (the body of a handshake request).
pub(super) fn serve(inner: &Weak<Inner>, body: &[u8]) -> Vec<u8> {
    let answer = match (inner.upgrade(), postcard::from_bytes::<DiskCall>(body)) {
        (None, _) => DiskAnswer::Refused(StoreError::InvalidParams(
            "this client is closed: its disk copies are no longer served".into(),
        )),
        (_, Err(e)) => DiskAnswer::Refused(StoreError::InvalidParams(format!(
            "a disk read request that does not decode ({e}): reader and owner run different \
             kvferry versions; upgrade both"
        ))),
        (Some(inner), Ok(call)) => inner.serve_disk(call),
    };
    postcard::to_allocvec(&answer).unwrap_or_default()
}

impl Inner {
    fn serve_disk(self: &Arc<Inner>, call: DiskCall) -> DiskAnswer {
        let (Some(off), Some(stager)) = (&self.offload, &self.stager) else {
            return DiskAnswer::Refused(StoreError::InvalidParams(
                "this client has no disk tier (enable_ssd_offload)".into(),
            ));
        };
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return DiskAnswer::Refused(StoreError::InvalidParams(
                "this client is closed: its disk copies are no longer served".into(),
            ));
        }
        let items = match call {
            DiskCall::Release { batch } => {
                stager.release(batch);
                return DiskAnswer::Released;
            }
            DiskCall::Stage { items } if items.len() > MAX_ITEMS => {
                return DiskAnswer::Refused(StoreError::InvalidParams(format!(
                    "{} objects in one disk read request; at most {MAX_ITEMS}",
                    items.len()
                )))
            }
            DiskCall::Stage { items } => items,
        };
        let disk = off.disk();
        // First the space: each item that is held and fits gets its block, in order, until
        // one does not fit now (it and those after it: `Later`).
        let mut out: Vec<Option<Staging>> = Vec::with_capacity(items.len());
        let mut blocks: Vec<Option<Block>> = Vec::with_capacity(items.len());
        let mut later = false;
        let mut any = false;
        for (key, len) in &items {
            let (staging, block) = if later {
                (Some(Staging::Later), None)
            } else if disk.len_of(key) != Some(*len) {
                // Not held (a record deleted at open, torn or cut short), or one of another
                // length than the master names: absent, and the master stops naming it at the
                // next beat (it drops only a copy it names on this disk).
                off.note_evicted(key.clone());
                (Some(Staging::Absent), None)
            } else if *len > stager.buf.len() as u64 {
                let e = StoreError::InvalidParams(format!(
                    "{key:?} is {len} bytes on the disk of {}, whose staging buffer for disk \
                     reads holds {} bytes: raise ssd_offload_staging_size there",
                    self.engine.segment_name(),
                    stager.buf.len()
                ));
                (Some(Staging::Failed(e)), None)
            } else if let Some(b) = stager.allocate(*len, !any) {
                any = true;
                (None, Some(b))
            } else {
                later = true;
                (Some(Staging::Later), None)
            };
            out.push(staging);
            blocks.push(block);
        }
        // Then the reads, at once: this thread and up to `READERS` of the owner's readers
        // take the records one by one from the list (this thread alone when the readers or
        // the CPUs are busy: no record waits for a hand-off). Each block is this request's
        // alone until it is released or expires.
        let work: Arc<Vec<Record>> = Arc::new(
            blocks
                .iter()
                .enumerate()
                .filter_map(|(i, b)| Some((i, items[i].0.clone(), items[i].1, b.as_ref()?.addr)))
                .collect(),
        );
        let next = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = mpsc::channel();
        for _ in 1..work.len().min(READERS + 1) {
            let (me, work, next, tx) = (
                Arc::clone(self),
                Arc::clone(&work),
                Arc::clone(&next),
                tx.clone(),
            );
            stager
                .readers
                .run(move || me.stage_records(&work, &next, &tx));
        }
        self.stage_records(&work, &next, &tx);
        drop(tx);
        for _ in 0..work.len() {
            // (A reader that ended without answering leaves its record unanswered: failed
            // below.)
            let Ok((i, s)) = rx.recv() else { break };
            out[i] = Some(s);
        }
        let mut kept = Vec::new();
        let mut st = stager.state();
        let answers: Vec<Staging> = out
            .into_iter()
            .zip(blocks)
            .map(|(s, b)| {
                let s = s.unwrap_or_else(|| {
                    Staging::Failed(StoreError::Internal(
                        "a disk reader thread ended without reading its record".into(),
                    ))
                });
                match (b, &s) {
                    (Some(b), Staging::At { .. }) => kept.push(b),
                    (Some(b), _) => st.space.free(b),
                    (None, _) => {}
                }
                s
            })
            .collect();
        stager.freed.notify_all();
        st.next += 1;
        let batch = st.next;
        if !kept.is_empty() {
            st.batches
                .insert(batch, (kept, Instant::now() + STAGED_TTL));
        }
        DiskAnswer::Staged {
            batch,
            ttl_ms: STAGED_TTL.as_millis() as u64,
            items: answers,
        }
    }

    /// Stages the records of `work` not taken yet, one by one (taking each from `next`),
    /// sending each answer by its index.
    fn stage_records(
        &self,
        work: &[Record],
        next: &AtomicUsize,
        tx: &mpsc::Sender<(usize, Staging)>,
    ) {
        while let Some((i, key, len, addr)) = work.get(next.fetch_add(1, Ordering::Relaxed)) {
            if tx.send((*i, self.stage_record(key, *len, *addr))).is_err() {
                return;
            }
        }
    }

    /// Reads `key`'s record (`len` bytes of value, as the master names it) into the staging
    /// block at `addr`.
    fn stage_record(&self, key: &str, len: u64, addr: u64) -> Staging {
        let (Some(off), Some(stager)) = (&self.offload, &self.stager) else {
            return Staging::Absent;
        };
        let at = (addr - stager.buf.addr()) as usize;
        // (The block is this request's alone until it is released or expires.)
        let dst = stager.buf.slice_mut(at, len as usize);
        match off.disk().get_into(key, dst) {
            Ok(Some(n)) if n as u64 == len => Staging::At { addr },
            Ok(_) | Err(crate::disk::DiskError::BufferTooSmall { .. }) => Staging::Absent,
            Err(e @ crate::disk::DiskError::Corrupt { .. }) => {
                // Deleted by the tier; the master stops naming it at the next beat.
                tracing::warn!(key, "{e}");
                off.note_evicted(key.to_string());
                Staging::Absent
            }
            Err(e) => Staging::Failed(StoreError::Internal(format!(
                "reading {key:?} from the disk of {}: {e}",
                self.engine.segment_name()
            ))),
        }
    }
}

/// A get's object found only on a disk: its index in the get, and where its value goes.
pub(super) struct DiskItem<'a> {
    pub(super) index: usize,
    pub(super) key: &'a str,
    pub(super) parts: &'a [(u64, u64)],
    pub(super) list: DiskReplicaList,
}

impl Client {
    fn disk_call(&self, owner: &str, call: &DiskCall) -> StoreResult<DiskAnswer> {
        let body = postcard::to_allocvec(call)
            .map_err(|e| StoreError::Internal(format!("encoding a disk read request: {e}")))?;
        let timeout = self.inner.cfg.ssd_read_timeout;
        let reply = self
            .inner
            .engine
            .call_service(owner, &body, timeout)
            .map_err(|e| {
                StoreError::TransferFailed(format!(
                    "the disk copy's owner {owner} did not answer within {timeout:?}: {e}"
                ))
            })?;
        postcard::from_bytes(&reply).map_err(|_| {
            StoreError::TransferFailed(format!(
                "the disk copy's owner {owner} answered something else than a disk read \
                 (its kvferry is older, or it has no disk tier)"
            ))
        })
    }

    /// Reads `items` (objects only on disks) into their parts. Each owner's are asked for in
    /// requests of about [`PART_BYTES`] and [`MAX_ITEMS`] at most (the READ of one overlaps
    /// the disk reads of the others); the requests run [`LANES`] at most at once (a thread
    /// each but the first), each in rounds of what its owner's staging buffer takes at once.
    /// Returns each item's result, by its index (an item without one was not read).
    pub(super) fn read_from_disks(
        &self,
        items: Vec<DiskItem<'_>>,
    ) -> Vec<(usize, StoreResult<u64>)> {
        let mut by_owner: HashMap<String, Vec<DiskItem<'_>>> = HashMap::new();
        for it in items {
            by_owner
                .entry(it.list.disk.endpoint.clone())
                .or_default()
                .push(it);
        }
        let mut requests: Vec<(String, Vec<DiskItem<'_>>)> = Vec::new();
        for (owner, its) in by_owner {
            let total: u64 = its.iter().map(|it| it.list.size).sum();
            let parts = total.div_ceil(PART_BYTES).clamp(1, LANES as u64);
            let per = total.div_ceil(parts);
            let (mut part, mut bytes) = (Vec::new(), 0);
            for it in its {
                bytes += it.list.size;
                part.push(it);
                if bytes >= per || part.len() == MAX_ITEMS {
                    requests.push((owner.clone(), std::mem::take(&mut part)));
                    bytes = 0;
                }
            }
            if !part.is_empty() {
                requests.push((owner, part));
            }
        }
        let n = requests.len().min(LANES);
        let mut lanes: Vec<Vec<(String, Vec<DiskItem<'_>>)>> = (0..n).map(|_| Vec::new()).collect();
        for (i, r) in requests.into_iter().enumerate() {
            lanes[i % n].push(r);
        }
        self.read_lanes(lanes)
    }

    /// The requests of the last lane here, one after another; the other lanes (the same way)
    /// on another thread at once.
    fn read_lanes(
        &self,
        mut lanes: Vec<Vec<(String, Vec<DiskItem<'_>>)>>,
    ) -> Vec<(usize, StoreResult<u64>)> {
        let Some(lane) = lanes.pop() else {
            return Vec::new();
        };
        let here = || {
            lane.into_iter()
                .flat_map(|(owner, pending)| self.read_from_owner(&owner, pending))
                .collect::<Vec<_>>()
        };
        if lanes.is_empty() {
            return here();
        }
        let (mut results, others) = join(here, || self.read_lanes(lanes));
        results.extend(others.into_iter().flatten());
        results
    }

    /// Reads `pending` (objects only on `owner`'s disk) in rounds.
    fn read_from_owner(
        &self,
        owner: &str,
        mut pending: Vec<DiskItem<'_>>,
    ) -> Vec<(usize, StoreResult<u64>)> {
        let mut results = Vec::new();
        if owner.is_empty() {
            for it in pending {
                results.push((
                    it.index,
                    Err(StoreError::TransferFailed(format!(
                        "{}: its only copy is on a disk whose client has not reported to this \
                         master yet; retry in a moment",
                        it.key
                    ))),
                ));
            }
            return results;
        }
        while !pending.is_empty() {
            let before = pending.len();
            pending = self.disk_round(owner, pending, &mut results);
            if pending.len() == before {
                for it in pending.drain(..) {
                    results.push((
                        it.index,
                        Err(StoreError::TransferFailed(format!(
                            "{}: the staging buffer of {owner} stayed full for {:?} (other \
                             readers' values held it): retry, or give that client a larger \
                             ssd_offload_staging_size",
                            it.key, SPACE_WAIT
                        ))),
                    ));
                }
            }
        }
        results
    }

    /// One round for `owner`: stage, READ, release. Returns the items to stage again.
    fn disk_round<'a>(
        &self,
        owner: &str,
        items: Vec<DiskItem<'a>>,
        results: &mut Vec<(usize, StoreResult<u64>)>,
    ) -> Vec<DiskItem<'a>> {
        let fail_all = |items: Vec<DiskItem<'a>>, e: StoreError, results: &mut Vec<_>| {
            for it in items {
                results.push((it.index, Err(e.clone())));
            }
        };
        let t0 = Instant::now();
        let call = DiskCall::Stage {
            items: items
                .iter()
                .map(|it| (it.key.to_string(), it.list.size))
                .collect(),
        };
        let (batch, ttl, staged) = match self.disk_call(owner, &call) {
            Ok(DiskAnswer::Staged {
                batch,
                ttl_ms,
                items: s,
            }) if s.len() == items.len() => (batch, Duration::from_millis(ttl_ms), s),
            Ok(DiskAnswer::Refused(e)) | Err(e) => {
                fail_all(items, e, results);
                return Vec::new();
            }
            Ok(other) => {
                let e = StoreError::TransferFailed(format!(
                    "the disk copy's owner {owner} answered {other:?} to a staging request"
                ));
                fail_all(items, e, results);
                return Vec::new();
            }
        };
        let seg = match self.segment_id(owner) {
            Ok(s) => s,
            Err(e) => {
                fail_all(items, e, results);
                self.release_staged(owner, batch);
                return Vec::new();
            }
        };
        let mut again = Vec::new();
        let mut reqs: Vec<TransferRequest> = Vec::new();
        let mut owner_of: Vec<usize> = Vec::new();
        let mut reading: Vec<DiskItem<'a>> = Vec::new();
        for (it, s) in items.into_iter().zip(staged) {
            match s {
                Staging::At { addr } => {
                    for r in super::get::read_parts(it.parts, seg, addr, it.list.size) {
                        reqs.push(r);
                        owner_of.push(reading.len());
                    }
                    reading.push(it);
                }
                Staging::Absent => results.push((
                    it.index,
                    Err(StoreError::ObjectNotFound(it.key.to_string())),
                )),
                Staging::Later => again.push(it),
                Staging::Failed(e) => results.push((it.index, Err(e))),
            }
        }
        if !reading.is_empty() {
            let mut ok: Vec<StoreResult<()>> = reading.iter().map(|_| Ok(())).collect();
            match self.transfer(&reqs) {
                Ok(statuses) => {
                    for (k, st) in statuses.into_iter().enumerate() {
                        if let Err(e) = st {
                            ok[owner_of[k]] = Err(e);
                        }
                    }
                }
                Err(e) => ok.iter_mut().for_each(|o| *o = Err(e.clone())),
            }
            // Read after the owner may have reused the space: refused.
            let late = t0.elapsed() + Duration::from_millis(1) >= ttl;
            for (it, o) in reading.into_iter().zip(ok) {
                let r = match o {
                    Ok(()) if late => Err(StoreError::TransferFailed(format!(
                        "{}: reading it from the staging buffer of {owner} took longer than \
                         the {ttl:?} it is held; read it again",
                        it.key
                    ))),
                    Ok(()) => Ok(it.list.size),
                    Err(e) => Err(StoreError::TransferFailed(format!("{}: {e}", it.key))),
                };
                results.push((it.index, r));
            }
            self.release_staged(owner, batch);
        }
        again
    }

    /// Tells `owner` that `batch` was read, from the client's releases thread (not waiting
    /// for its answer), or here if that thread cannot take it.
    fn release_staged(&self, owner: &str, batch: u64) {
        let call = DiskCall::Release { batch };
        let Ok(body) = postcard::to_allocvec(&call) else {
            return; // (Never: the owner takes the space back when its hold ends.)
        };
        let timeout = self.inner.cfg.ssd_read_timeout;
        if !self
            .inner
            .disk_releases
            .send(&self.inner.engine, timeout, owner, body)
        {
            if let Err(e) = self.disk_call(owner, &call) {
                // The owner takes the space back when its hold ends.
                tracing::debug!("releasing staged disk reads at {owner}: {e}");
            }
        }
    }
}

/// Runs `here` in this thread and `there` on another at once, or after `here` in this
/// thread if no thread starts; a panic in `there` goes on in this thread. (`there`'s result
/// is always `Some`.)
pub(super) fn join<A, B: Send>(
    here: impl FnOnce() -> A,
    there: impl FnOnce() -> B + Send,
) -> (A, Option<B>) {
    let cell = Mutex::new(Some(there));
    let take = || cell.lock().unwrap_or_else(|e| e.into_inner()).take();
    std::thread::scope(|s| {
        let spawned = std::thread::Builder::new()
            .name("kvf-disk-get".into())
            .spawn_scoped(s, || take().map(|f| f()));
        let a = here();
        let b = spawned
            .ok()
            .and_then(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
        (a, b.or_else(|| take().map(|f| f())))
    })
}

#[cfg(test)]
#[path = "disk_read_tests.rs"]
mod tests;
