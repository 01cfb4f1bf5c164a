//! The state machine's side of the disk tier (Mooncake's SSD offload, with
//! `--enable_offload`): objects a background eviction takes are handed to the client whose
//! segment holds them, to persist on its disk, instead of being dropped.
//!
//! 1. A background eviction ([`State::evict_background`]) that picks an object with a
//!    replica on the segment of a client with a disk (one that reported with
//!    [`State::offload_beat`]) queues an offload task for that disk and counts the object's
//!    bytes as freed. The object stays readable from memory; the task holds a read of its
//!    replicas (as a reader's does: `super::objects`), so that neither they nor their space
//!    are freed or reused while the client copies them, for at most the offload timeout.
//! 2. The client's next beat takes the task, persists the bytes and reports it done. Then the
//!    object's memory replicas are freed, once no read of them is in flight, and its disk
//!    replica (disk, length) is recorded and journaled (`changes::Change::Disk`).
//! 3. A task reported failed, or not reported within the timeout ([`State::expire_offloads`]),
//!    ends as the eviction would have without a disk: the object is evicted.
//!
//! A report that names a task this state does not know (a takeover lost it, the object was
//! removed, upserted or evicted meanwhile) records nothing: the client is told to delete
//! the record instead. Records are deleted only when the state names no copy of the key on
//! that disk and hands no task of it to that disk, checked when the answer is made, so a
//! newer record of the key is never deleted for an older one.
//!
//! Which client holds which disk is not journaled: a new leader learns it from the next
//! beat. A disk's replicas go with its client (it stopped pinging: like its segments); a
//! client that restarts on the same directory reports the records it found
//! ([`OffloadBeat::recovered`]), and those the state still names are served again.

use super::{DiskReplica, Replica, State, Stats};
use crate::error::{StoreError, StoreResult};
use crate::proto::{DiskDesc, OffloadBeat, OffloadOrders, OffloadTask};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;

/// An object being persisted: by which disk, under which task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Offloading {
    disk: u64,
    task: u64,
}

/// An offload task handed out (or queued) and not reported yet.
struct Task {
    key: Box<str>,
    disk: u64,
    /// The read that holds the object's replicas while the client copies them.
    read: u64,
    /// When it is given up on (ms).
    until: u64,
}

/// A disk tier, as the state knows it from its client's beats.
struct Disk {
    client: u64,
    endpoint: String,
    /// Tasks for the next beat.
    queue: Vec<OffloadTask>,
    /// Keys whose record on this disk the state no longer names (checked again when sent).
    drops: Vec<Box<str>>,
    /// Tasks queued or handed out and not reported.
    in_flight: usize,
}

/// The disk tier's bookkeeping (none of it journaled: see the module's docs).
#[derive(Default)]
pub(super) struct Offload {
    /// How long a client has to report a task (ms); 0: offload is off.
    timeout: u64,
    /// The most tasks one disk has queued or in flight (more objects are evicted as without
    /// a disk): Mooncake's `--offloading_queue_limit`.
    limit: usize,
    disks: HashMap<u64, Disk>,
    /// Client -> its disk.
    by_client: HashMap<u64, u64>,
    /// (Ordered: the oldest are given up on first, and what the state does does not depend
    /// on a hash's seed.)
    tasks: BTreeMap<u64, Task>,
    next_task: u64,
}

/// The most drops one disk keeps for its next beat (more are left to its own eviction and
/// to reads that find the state names another copy: a record not named is never served).
const MAX_DROPS: usize = 1 << 16;

impl State {
    /// Turns offload on (`timeout` ms for a client to report a task, at most `per_disk` tasks
    /// per disk at once) or off (`timeout` 0). The driver sets it from its config, also on a
    /// state a takeover built.
    pub fn set_offload(&mut self, timeout: u64, per_disk: usize) {
        self.offload.timeout = timeout;
        self.offload.limit = per_disk.max(1);
    }

    /// Whether offload is on.
    pub fn offload_enabled(&self) -> bool {
        self.offload.timeout > 0
    }

    /// Offload tasks queued or handed out and not reported.
    pub fn offloads_in_flight(&self) -> usize {
        self.offload.tasks.len()
    }

    /// How readers find a disk replica.
    pub(super) fn disk_desc(&self, d: &DiskReplica, size: u64) -> DiskDesc {
        DiskDesc {
            endpoint: self
                .offload
                .disks
                .get(&d.disk)
                .map(|x| x.endpoint.clone())
                .unwrap_or_default(),
            disk: d.disk,
            size: d.len.min(size),
        }
    }

    /// A background eviction's victim `key`, handed to a disk instead of dropped if it can
    /// be: offload is on, a replica of it lies in a segment of a client with a disk whose
    /// queue has room, and it has no disk copy yet. Returns the bytes its memory replicas
    /// will free once the task is done.
    pub(super) fn try_offload(&mut self, key: &str, now: u64) -> Option<u64> {
        if self.offload.timeout == 0 {
            return None;
        }
        let o = self.objects.get(key)?;
        if o.disk.is_some() || o.offloading.is_some() || o.pending.is_some() {
            return None;
        }
        let (disk, replica) = o.current.iter().find_map(|r| {
            let client = self.segments.get(&r.seg)?.client;
            let disk = *self.offload.by_client.get(&client)?;
            Some((disk, *r))
        })?;
        let size = o.size;
        let bytes: u64 = o.current.iter().map(|r| r.block.len).sum();
        let limit = self.offload.limit;
        let d = self.offload.disks.get_mut(&disk)?;
        if d.in_flight >= limit {
            return None;
        }
        self.offload.next_task += 1;
        let task = self.offload.next_task;
        d.in_flight += 1;
        d.queue.push(OffloadTask {
            task,
            key: key.to_string(),
            addr: replica.block.addr,
            size,
        });
        self.next_read += 1;
        let read = self.next_read;
        let until = now.saturating_add(self.offload.timeout);
        self.reads.insert(read, until);
        self.offload.tasks.insert(
            task,
            Task {
                key: key.into(),
                disk,
                read,
                until,
            },
        );
        let o = self.objects.get_mut(key)?;
        o.reads.push(read);
        o.offloading = Some(Offloading { disk, task });
        Some(bytes)
    }

    /// Ends task `task` (reported or given up on): its read ends, its disk has room for
    /// another. Returns it, and whether its object is still the one it was handed for.
    fn end_task(&mut self, task: u64, now: u64) -> Option<(Task, bool)> {
        let t = self.offload.tasks.remove(&task)?;
        if let Some(d) = self.offload.disks.get_mut(&t.disk) {
            d.in_flight = d.in_flight.saturating_sub(1);
            d.queue.retain(|q| q.task != task);
        }
        let current = match self.objects.get_mut(&t.key) {
            Some(o) if o.offloading == Some(Offloading { disk: t.disk, task }) => {
                o.offloading = None;
                true
            }
            _ => false,
        };
        self.release_reads(&[t.read], now);
        Some((t, current))
    }

    /// Evicts `key`'s memory replicas (an offload that failed or timed out ends as the
    /// eviction that chose it would have without a disk): freed once no read is in flight;
    /// the object goes unless a disk copy is left.
    fn evict_memory(&mut self, key: &str, now: u64, stats: &Stats) {
        let Some(o) = self.objects.get_mut(key) else {
            return;
        };
        let gone = std::mem::take(&mut o.current);
        let reads = std::mem::take(&mut o.reads);
        let size = o.size;
        self.mark_key(key);
        if self.objects.get(key).is_some_and(super::Object::bare) {
            self.forget(key);
        }
        for r in gone.iter() {
            self.free_after_reads(*r, &reads, now);
        }
        stats.evicted_objects.fetch_add(1, Ordering::Relaxed);
        stats.evicted_bytes.fetch_add(size, Ordering::Relaxed);
    }

    /// Gives up on the tasks not reported in time: their objects are evicted. (Tasks are
    /// numbered in the order they were made, each given the same timeout: the walk stops at
    /// the first not due, so a tick costs what is due, not every task in flight.)
    pub fn expire_offloads(&mut self, now: u64, stats: &Stats) {
        let due: Vec<u64> = self
            .offload
            .tasks
            .iter()
            .take_while(|(_, t)| t.until <= now)
            .map(|(&id, _)| id)
            .collect();
        for id in due {
            if let Some((t, true)) = self.end_task(id, now) {
                tracing::warn!(
                    key = &*t.key,
                    disk = format!("{:x}", t.disk),
                    "an offload was not reported in time: the object is evicted"
                );
                self.evict_memory(&t.key, now, stats);
            }
        }
    }

    /// A copy of `key` on `disk` is no longer named (removed, replaced, its object gone):
    /// the disk's client is told to delete it.
    pub(super) fn drop_on_disk(&mut self, key: &str, disk: u64) {
        if let Some(d) = self.offload.disks.get_mut(&disk) {
            if d.drops.len() < MAX_DROPS {
                d.drops.push(key.into());
            }
        }
    }

    /// `key`'s copy on `disk` left it (evicted there, or lost): the object goes if nothing
    /// else of it is left.
    fn disk_copy_gone(&mut self, key: &str, disk: u64) {
        let Some(o) = self.objects.get_mut(key) else {
            return;
        };
        if o.disk.is_none_or(|d| d.disk != disk) {
            return;
        }
        o.disk = None;
        self.mark_key(key);
        self.mark_disk(key);
        if self.objects.get(key).is_some_and(super::Object::bare) {
            self.forget(key);
        }
    }

    /// A client with a disk tier reports (see [`OffloadBeat`]): binds the disk to the
    /// client, records the tasks done, evicts the objects of the tasks that failed, forgets
    /// the copies that left the disk, checks the records it recovered; answers with the next
    /// tasks and the records to delete.
    pub fn offload_beat(
        &mut self,
        client: u64,
        beat: &OffloadBeat,
        now: u64,
        stats: &Stats,
    ) -> StoreResult<OffloadOrders> {
        if self.offload.timeout == 0 {
            return Err(StoreError::InvalidParams(
                "this master runs without offload: start it with --enable_offload=true, or \
                 the client without enable_ssd_offload"
                    .into(),
            ));
        }
        if !self.clients.contains_key(&client) {
            return Err(StoreError::UnknownClient(client));
        }
        let disk = beat.disk;
        // One disk per client, one client per disk: a client restarted on the directory
        // takes its disk over.
        if let Some(old) = self.offload.by_client.insert(client, disk) {
            if old != disk {
                self.offload.disks.remove(&old);
            }
        }
        let d = self.offload.disks.entry(disk).or_insert_with(|| Disk {
            client,
            endpoint: String::new(),
            queue: Vec::new(),
            drops: Vec::new(),
            in_flight: 0,
        });
        if d.client != client {
            let old = std::mem::replace(&mut d.client, client);
            self.offload.by_client.remove(&old);
        }
        if d.endpoint != beat.endpoint {
            d.endpoint = beat.endpoint.clone();
        }
        for done in &beat.done {
            match self.end_task(done.task, now) {
                Some((t, true)) if t.disk == disk && *t.key == *done.key => {
                    self.offloaded(&done.key, disk, now)
                }
                _ => self.drop_on_disk(&done.key, disk),
            }
        }
        for &task in &beat.failed {
            if let Some((t, true)) = self.end_task(task, now) {
                tracing::warn!(
                    key = &*t.key,
                    disk = format!("{disk:x}"),
                    "a client could not persist an object: it is evicted"
                );
                self.evict_memory(&t.key, now, stats);
            }
        }
        for key in &beat.evicted {
            self.disk_copy_gone(key, disk);
        }
        for (key, len) in &beat.recovered {
            let named = self
                .objects
                .get(key.as_str())
                .is_some_and(|o| o.disk == Some(DiskReplica { disk, len: *len }));
            if !named {
                self.drop_on_disk(key, disk);
            }
        }
        let objects = &self.objects;
        let Some(d) = self.offload.disks.get_mut(&disk) else {
            return Ok(OffloadOrders::default());
        };
        let drop = std::mem::take(&mut d.drops)
            .into_iter()
            .filter(|k| {
                objects.get(k).is_none_or(|o| {
                    o.disk.is_none_or(|x| x.disk != disk)
                        && o.offloading.is_none_or(|x| x.disk != disk)
                })
            })
            .map(String::from)
            .collect();
        Ok(OffloadOrders {
            tasks: std::mem::take(&mut d.queue),
            drop,
        })
    }

    /// Task of `key` done on `disk`: the disk copy is recorded, the memory replicas freed
    /// once no read of them is in flight.
    fn offloaded(&mut self, key: &str, disk: u64, now: u64) {
        let Some(o) = self.objects.get_mut(key) else {
            return;
        };
        let gone: Vec<Replica> = std::mem::take(&mut o.current).into_vec();
        let reads = std::mem::take(&mut o.reads);
        o.disk = Some(DiskReplica { disk, len: o.size });
        self.mark_key(key);
        self.mark_disk(key);
        for r in gone {
            self.free_after_reads(r, &reads, now);
        }
    }

    /// Clients that stopped pinging: their disks' copies go with them (objects left without
    /// a copy go too), their tasks end at their time.
    pub(super) fn drop_client_disks(&mut self, clients: &[u64]) {
        let mut gone = Vec::new();
        for c in clients {
            if let Some(disk) = self.offload.by_client.remove(c) {
                self.offload.disks.remove(&disk);
                gone.push(disk);
            }
        }
        if gone.is_empty() {
            return;
        }
        let mut keys = Vec::new();
        for (k, o) in self.objects.iter() {
            if o.disk.is_some_and(|d| gone.contains(&d.disk)) {
                keys.push(k.clone());
            }
        }
        for k in keys {
            if let Some(d) = self.objects.get(&k).and_then(|o| o.disk) {
                self.disk_copy_gone(&k, d.disk);
            }
        }
    }
}
