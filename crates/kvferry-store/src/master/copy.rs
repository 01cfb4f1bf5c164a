//! Replica copies and moves: the tasks that ask for them (Mooncake 0.3.14's
//! `CreateCopyTask`, `CreateMoveTask`, `QueryTask`, `FetchTasks`, `MarkTaskToComplete`;
//! the table is `tasks.rs`) and the copy itself, which the assigned client carries out
//! (Mooncake's `CopyStart`/`CopyEnd`, `MoveStart`/`MoveEnd`).
//!
//! A copy is a write in progress of the object ([`Pending`] with [`CopyOf`]): its room on the
//! targets is reserved, the object stays readable from its current replicas, no put, copy or
//! eviction of it starts meanwhile, a removal or a lost segment treats the reserved room as a
//! put's, and `PutRevoke` gives it back. The copier reads the source under a read of its own
//! (so a forced removal does not free the source under the copy). Its end adds the new
//! replicas to the current ones and, for a move, drops the source replica (freed once the
//! reads of it ended). Journaled as any write in progress, without [`CopyOf`]: a new leader
//! sees a put in progress whose end (a `CopyEnd`) it refuses, so the copier revokes it.

use super::tasks::TaskWork;
use super::{Pending, Replica, State};
use crate::error::{StoreError, StoreResult};
use crate::proto::{CopyPlan, SoftPin, TaskAssignment, TaskId, TaskInfo, TaskKind};

/// What makes a write in progress a copy: the replica copied, and whether it goes at the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct CopyOf {
    pub(super) source: Replica,
    pub(super) remove_source: bool,
}

impl State {
    fn seg_name(&self, r: &Replica) -> Option<&str> {
        self.segments.get(&r.seg).map(|s| s.seg.name.as_str())
    }

    fn mounted(&self, name: &str) -> bool {
        self.segments.values().any(|s| s.seg.name == name)
    }

    /// The client that owns the mounted segment named `name` (the first mounted).
    fn owner_of(&self, name: &str) -> Option<u64> {
        self.seg_order
            .iter()
            .filter_map(|id| self.segments.get(id))
            .find(|s| s.seg.name == name)
            .map(|s| s.client)
    }

    /// Mooncake's `CreateCopyTask`: a task for the owner of a replica of `key` (picked at
    /// random among its replicas' segments) to copy it to `targets`.
    pub fn create_copy_task(
        &mut self,
        key: &str,
        targets: &[String],
        now: u64,
    ) -> StoreResult<TaskId> {
        if targets.is_empty() {
            return Err(StoreError::InvalidParams(format!(
                "a copy of {key:?} names no target segment"
            )));
        }
        let o = self
            .objects
            .get(key)
            .ok_or_else(|| StoreError::ObjectNotFound(key.to_string()))?;
        if let Some(t) = targets.iter().find(|t| !self.mounted(t)) {
            return Err(StoreError::InvalidParams(format!(
                "target segment {t:?} is not mounted"
            )));
        }
        let mut names: Vec<String> = o
            .current
            .iter()
            .filter_map(|r| self.seg_name(r))
            .map(str::to_string)
            .collect();
        names.sort_unstable();
        names.dedup();
        if names.is_empty() {
            return Err(StoreError::Internal(format!(
                "{key:?} has no complete memory replica to copy from"
            )));
        }
        let source = names.swap_remove(self.tasks.pick(names.len()));
        let client = self
            .owner_of(&source)
            .ok_or_else(|| StoreError::Internal(format!("no client owns segment {source:?}")))?;
        let work = TaskWork {
            kind: TaskKind::Copy,
            key: key.to_string(),
            source,
            targets: targets.to_vec(),
        };
        self.tasks.submit(client, work, now)
    }

    /// Mooncake's `CreateMoveTask`: a task for the owner of `source` to copy `key`'s replica
    /// there to `target`, then drop it.
    pub fn create_move_task(
        &mut self,
        key: &str,
        source: &str,
        target: &str,
        now: u64,
    ) -> StoreResult<TaskId> {
        // (Before the key is looked up, as Mooncake's client refuses it.)
        if source == target {
            return Err(StoreError::InvalidParams(format!(
                "a move of {key:?} from {source:?} to itself"
            )));
        }
        let o = self
            .objects
            .get(key)
            .ok_or_else(|| StoreError::ObjectNotFound(key.to_string()))?;
        if !self.mounted(target) {
            return Err(StoreError::InvalidParams(format!(
                "target segment {target:?} is not mounted"
            )));
        }
        if !o.current.iter().any(|r| self.seg_name(r) == Some(source)) {
            return Err(StoreError::InvalidParams(format!(
                "{key:?} has no replica on segment {source:?}"
            )));
        }
        let client = self
            .owner_of(source)
            .ok_or_else(|| StoreError::Internal(format!("no client owns segment {source:?}")))?;
        let work = TaskWork {
            kind: TaskKind::Move,
            key: key.to_string(),
            source: source.to_string(),
            targets: vec![target.to_string()],
        };
        self.tasks.submit(client, work, now)
    }

    pub fn query_task(&self, id: TaskId, now: u64) -> StoreResult<TaskInfo> {
        self.tasks.query(id, now)
    }

    pub fn fetch_tasks(&mut self, client: u64, max: u32, now: u64) -> Vec<TaskAssignment> {
        self.tasks.fetch(client, max as usize, now)
    }

    pub fn complete_task(
        &mut self,
        client: u64,
        id: TaskId,
        ok: bool,
        message: &str,
        now: u64,
    ) -> StoreResult<()> {
        self.tasks.complete(client, id, ok, message, now)
    }

    /// Fails the tasks past their timeouts (the driver's tick).
    pub fn expire_tasks(&mut self, now: u64) {
        self.tasks.expire(now);
    }

    /// The task table's bounds and timeouts.
    pub fn set_task_limits(&mut self, limits: super::tasks::TaskLimits) {
        self.tasks.limits = limits;
    }

    /// How many tasks the table keeps.
    pub fn tasks_kept(&self) -> usize {
        self.tasks.len()
    }

    /// Starts copy `put` of `key` by `client`: room for a replica on each of `targets` that
    /// holds none, the source replica (on segment `source`) leased for the read.
    #[allow(clippy::too_many_arguments)]
    pub fn copy_start(
        &mut self,
        client: u64,
        key: &str,
        source: &str,
        targets: &[String],
        put: u64,
        remove_source: bool,
        now: u64,
        lease: u64,
    ) -> StoreResult<CopyPlan> {
        if !self.clients.contains_key(&client) {
            return Err(StoreError::UnknownClient(client));
        }
        let o = self
            .objects
            .get(key)
            .ok_or_else(|| StoreError::ObjectNotFound(key.to_string()))?;
        if o.pending.is_some() {
            return Err(StoreError::ObjectHasReplicationTask(key.to_string()));
        }
        let src = *o
            .current
            .iter()
            .find(|r| self.seg_name(r) == Some(source))
            .ok_or_else(|| StoreError::ReplicaNotFound(format!("{key:?} on segment {source:?}")))?;
        let size = o.size;
        let mut wanted: Vec<&String> = Vec::new();
        for t in targets {
            if remove_source && t == source {
                return Err(StoreError::InvalidParams(format!(
                    "a move of {key:?} from {source:?} to itself"
                )));
            }
            if !self.mounted(t) {
                return Err(StoreError::SegmentNotFound(t.clone()));
            }
            let held = o
                .current
                .iter()
                .any(|r| self.seg_name(r) == Some(t.as_str()));
            if !held && !wanted.contains(&t) {
                wanted.push(t);
            }
        }
        // The copier's read of the source: a forced removal frees it only once the read ended.
        let read_id = self.get_replica_list(key, now, lease)?.read_id;
        let mut placed: Vec<Replica> = Vec::new();
        for t in wanted {
            let got = self.seg_order.iter().copied().find_map(|id| {
                let s = self.segments.get_mut(&id)?;
                if s.seg.name != *t || s.writes_until > now {
                    return None;
                }
                s.space
                    .allocate(size)
                    .map(|block| Replica { seg: id, block })
            });
            match got {
                Some(r) => placed.push(r),
                None => {
                    for r in placed {
                        self.free_now(r);
                    }
                    self.release_reads(&[read_id], now);
                    return Err(StoreError::NoAvailableHandle {
                        size,
                        replicas: 1,
                        detail: format!("no room on segment {t:?} for a copy of {key:?}"),
                    });
                }
            }
        }
        let plan = CopyPlan {
            source: self
                .desc(&src)
                .ok_or_else(|| StoreError::Internal("source segment gone".into()))?,
            targets: placed.iter().filter_map(|r| self.desc(r)).collect(),
            size,
            read_id,
        };
        self.mark_key(key);
        let o = self
            .objects
            .get_mut(key)
            .ok_or_else(|| StoreError::ObjectNotFound(key.to_string()))?;
        o.pending = Some(Box::new(Pending {
            id: put,
            replicas: placed.into_boxed_slice(),
            size,
            client,
            started: now,
            soft_pin: SoftPin::Preserve,
            soft_pin_ttl: 0,
            copy: Some(CopyOf {
                source: src,
                remove_source,
            }),
        }));
        Ok(plan)
    }

    /// Ends copy `put` of `key` (its bytes landed): the new replicas are readable; a move's
    /// source replica goes (freed once the reads of it ended).
    pub fn copy_end(&mut self, client: u64, key: &str, put: u64, now: u64) -> StoreResult<()> {
        let o = self
            .objects
            .get(key)
            .ok_or_else(|| StoreError::ObjectNotFound(key.to_string()))?;
        match &o.pending {
            Some(p) if p.client == client && p.id == put && p.copy.is_some() => {}
            _ => return Err(StoreError::ObjectNoReplicationTask(key.to_string())),
        }
        self.mark_key(key);
        let o = self
            .objects
            .get_mut(key)
            .ok_or_else(|| StoreError::ObjectNotFound(key.to_string()))?;
        let Some(p) = o.pending.take() else {
            return Err(StoreError::ObjectNoReplicationTask(key.to_string()));
        };
        let Some(copy) = p.copy else {
            return Err(StoreError::ObjectNoReplicationTask(key.to_string()));
        };
        let mut current: Vec<Replica> = o.current.to_vec();
        let mut gone = None;
        if copy.remove_source {
            if let Some(i) = current.iter().position(|r| *r == copy.source) {
                gone = Some(current.remove(i));
            }
        }
        current.extend(p.replicas.iter().copied());
        o.current = current.into_boxed_slice();
        let reads = o.reads.clone();
        let bare = o.bare();
        if let Some(r) = gone {
            self.free_after_reads(r, &reads, now);
        }
        if bare {
            self.forget(key);
        }
        Ok(())
    }
}
