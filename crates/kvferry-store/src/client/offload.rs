//! The client's disk tier (Mooncake's SSD offload: `setup(..., enable_ssd_offload=True,
//! ssd_offload_path=DIR)`, `mooncake_client --enable_offload`): a [`DiskTier`] on the
//! directory, and a thread that beats to the master (`Request::OffloadBeat`).
//!
//! Each beat reports what was done since the last (tasks persisted or failed, records that
//! left the disk, and after a restart the records found, a piece at a time) and takes the
//! master's orders: first the records to delete, then the objects to persist, each read from
//! this client's own segment (the master holds those bytes for the task) and written with
//! [`DiskTier::put`] (durable before it returns). A full disk evicts its least recently used
//! records in two phases: taken out of the index, the master told (a beat naming them), then
//! deleted; if the master cannot be told they are put back and the task fails. Any other
//! error fails the task, which the master ends as an eviction without a disk: the object was
//! served from memory until then and is absent after, never wrong.
//!
//! Blocking I/O on this one thread, not `io_uring`: a record is written once, by this
//! thread, at the pace of evictions, and `fdatasync` per record dominates its cost; the
//! page cache serves repeated reads.

use super::{Conn, Inner};
use crate::disk::{DiskError, DiskTier};
use crate::error::{StoreError, StoreResult};
use crate::proto::{OffloadBeat, OffloadDone, OffloadOrders, OffloadTask, Request, Response};
use std::path::Path;
use std::sync::{Mutex, Weak};
use std::time::Duration;

/// Records found at open reported per beat (a beat stays a small frame).
const RECOVERED_PER_BEAT: usize = 4096;

/// Beats run back to back while each carries out tasks (then the thread waits its interval).
const ROUNDS_PER_TICK: usize = 8;

/// A client's disk tier and what it has to report.
pub(super) struct Offloader {
    disk: DiskTier,
    report: Mutex<Report>,
}

#[derive(Default)]
struct Report {
    done: Vec<OffloadDone>,
    failed: Vec<u64>,
    evicted: Vec<String>,
    /// Records found at open not reported yet.
    recovered: Vec<(String, u64)>,
}

impl Offloader {
    /// Opens the disk tier on `dir` (which must exist; no other process may hold it), with
    /// `capacity` bytes of records at most.
    pub(super) fn open(dir: &Path, capacity: u64) -> StoreResult<Offloader> {
        let (disk, rec) = DiskTier::open(dir, capacity).map_err(|e| {
            StoreError::InvalidParams(format!("ssd_offload_path {}: {e}", dir.display()))
        })?;
        if rec.dropped > 0 {
            tracing::warn!(
                dir = %dir.display(),
                dropped = rec.dropped,
                "the offload directory held records that were not whole (a crash while \
                 writing): deleted"
            );
        }
        tracing::info!(
            dir = %dir.display(),
            disk = format!("{:x}", disk.id()),
            records = rec.objects.len(),
            "disk tier open"
        );
        Ok(Offloader {
            disk,
            report: Mutex::new(Report {
                recovered: rec.objects,
                ..Report::default()
            }),
        })
    }

    pub(super) fn disk(&self) -> &DiskTier {
        &self.disk
    }

    /// A record that left the disk other than by the master's order (found corrupt): the
    /// next beat tells the master.
    pub(super) fn note_evicted(&self, key: String) {
        self.report().evicted.push(key);
    }

    fn report(&self) -> std::sync::MutexGuard<'_, Report> {
        self.report.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What the next beat reports (taken out: [`Offloader::put_back`] if it was not sent).
    fn take(&self, endpoint: &str) -> OffloadBeat {
        let mut r = self.report();
        let n = r.recovered.len().min(RECOVERED_PER_BEAT);
        OffloadBeat {
            disk: self.disk.id(),
            endpoint: endpoint.to_string(),
            done: std::mem::take(&mut r.done),
            failed: std::mem::take(&mut r.failed),
            evicted: std::mem::take(&mut r.evicted),
            recovered: r.recovered.drain(..n).collect(),
        }
    }

    /// A beat that did not reach the master (or whose answer was lost): reported again with
    /// the next one (the master takes a report twice as once).
    fn put_back(&self, b: OffloadBeat) {
        let mut r = self.report();
        r.done.extend(b.done);
        r.failed.extend(b.failed);
        r.evicted.extend(b.evicted);
        r.recovered.extend(b.recovered);
    }
}

impl Inner {
    /// One beat: report, then carry out the master's orders. Returns the tasks carried out.
    pub(super) fn offload_beat(&self) -> StoreResult<usize> {
        let Some(off) = &self.offload else {
            return Err(StoreError::InvalidParams(
                "this client has no disk tier: set it up with enable_ssd_offload and \
                 ssd_offload_path"
                    .into(),
            ));
        };
        let beat = off.take(self.engine.segment_name());
        let orders = match self.send_beat(beat.clone()) {
            Ok(o) => o,
            Err(e) => {
                off.put_back(beat);
                return Err(e);
            }
        };
        let mut orders = orders;
        let mut tasks = std::collections::VecDeque::from(std::mem::take(&mut orders.tasks));
        let mut drops = orders.drop;
        let mut carried = 0;
        loop {
            for key in drops.drain(..) {
                if let Err(e) = off.disk.remove(&key) {
                    tracing::warn!(key, "deleting a record the master no longer names: {e}");
                }
            }
            let Some(t) = tasks.pop_front() else { break };
            carried += 1;
            match self.persist(off, &t, &mut tasks, &mut drops) {
                Ok(()) => off.report().done.push(OffloadDone {
                    task: t.task,
                    key: t.key.clone(),
                }),
                Err(e) => {
                    tracing::warn!(key = t.key, "offload failed (the object is evicted): {e}");
                    off.report().failed.push(t.task);
                }
            }
        }
        Ok(carried)
    }

    fn send_beat(&self, beat: OffloadBeat) -> StoreResult<OffloadOrders> {
        let req = Request::OffloadBeat {
            client: self.id,
            beat: Box::new(beat),
        };
        match self
            .call_batch_on(vec![req], Conn::Aside)?
            .pop()
            .ok_or_else(|| StoreError::Rpc("the master sent no answer".into()))?
            .into_result()?
        {
            Response::Offload(o) => Ok(o),
            other => Err(StoreError::Rpc(format!(
                "unexpected answer to an offload beat: {other:?}"
            ))),
        }
    }

    /// Writes task `t`'s bytes (in this client's segment) to the disk, durably; a full disk
    /// evicts its least recently used records first (the master told before they go).
    /// (Orders that come with the answer to a beat sent meanwhile go to `tasks` and `drops`.)
    fn persist(
        &self,
        off: &Offloader,
        t: &OffloadTask,
        tasks: &mut std::collections::VecDeque<OffloadTask>,
        drops: &mut Vec<String>,
    ) -> StoreResult<()> {
        let Some((buf, seg)) = &self.segment else {
            return Err(StoreError::InvalidParams(
                "an offload task for a client without a segment".into(),
            ));
        };
        let inside = t.addr >= seg.base
            && t.addr
                .checked_add(t.size)
                .is_some_and(|e| e <= seg.base + buf.len() as u64);
        if !inside {
            return Err(StoreError::InvalidParams(format!(
                "offload task {} names bytes {:#x}+{} outside this client's segment",
                t.task, t.addr, t.size
            )));
        }
        let bytes = buf.slice((t.addr - seg.base) as usize, t.size as usize);
        let disk_err = |e: DiskError| StoreError::Internal(format!("disk tier: {e}"));
        match off.disk.put(&t.key, bytes) {
            Ok(()) => return Ok(()),
            Err(DiskError::Full { .. }) => {}
            Err(e) => return Err(disk_err(e)),
        }
        let need = (32 + t.key.len()) as u64 + t.size;
        let capacity = off.disk.usage().1;
        if need > capacity {
            return Err(StoreError::InvalidParams(format!(
                "a value of {} bytes does not fit a disk tier of {capacity} bytes: raise its \
                 size limit",
                t.size
            )));
        }
        let pending = off.disk.prepare_eviction(need, u64::MAX);
        let evicted: Vec<String> = pending.keys().map(str::to_string).collect();
        if evicted.is_empty() {
            off.disk.cancel_eviction(pending);
            return off.disk.put(&t.key, bytes).map_err(disk_err);
        }
        // The master stops naming them before their files go: told with everything else
        // there is to report (a task done a moment ago is recorded before its eviction is,
        // never after).
        let mut told = off.take(self.engine.segment_name());
        told.evicted.extend(evicted.iter().cloned());
        match self.send_beat(told.clone()) {
            Ok(orders) => {
                tasks.extend(orders.tasks);
                drops.extend(orders.drop);
                off.disk.finalize_eviction(pending).map_err(disk_err)?;
            }
            Err(e) => {
                told.evicted.truncate(told.evicted.len() - evicted.len());
                off.put_back(told);
                off.disk.cancel_eviction(pending);
                return Err(e);
            }
        }
        off.disk.put(&t.key, bytes).map_err(disk_err)
    }
}

/// The disk tier's thread: a beat every `every` (and back to back while there is work).
pub(super) fn offload_loop(inner: Weak<Inner>, every: Duration) {
    loop {
        std::thread::sleep(every);
        for _ in 0..ROUNDS_PER_TICK {
            let Some(inner) = inner.upgrade() else { return };
            if inner.closed.load(std::sync::atomic::Ordering::Acquire) {
                return;
            }
            match inner.offload_beat() {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!("offload beat: {e}");
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
#[path = "offload_tests.rs"]
mod tests;
