//! The state machine's puts: a put's start (replica locations, with room made if it must),
//! its end (the object reads as it wrote) and its revocation.

use super::{
    check_key, Attempt, MasterConfig, Object, Pending, PutId, State, Stats, MAX_PREFERRED,
};
use crate::error::{StoreError, StoreResult};
use crate::proto::{ReplicaDesc, ReplicateConfig, SoftPin};
use std::sync::Arc;

impl State {
    /// Starts a put, making room if needed by any eviction allowed (the last attempt).
    #[allow(clippy::too_many_arguments)]
    pub fn put_start(
        &mut self,
        m: &MasterConfig,
        stats: &Stats,
        put: PutId,
        key: &str,
        size: u64,
        cfg: &ReplicateConfig,
        upsert: bool,
        now: u64,
    ) -> StoreResult<Vec<ReplicaDesc>> {
        self.put_start_ex(m, stats, put, key, size, cfg, upsert, now, Attempt::Last)
    }

    /// Starts a put. Unless it is the last `attempt`, while reads are in flight (whose end may free space)
    /// objects written within `put_wait_for_reads` are not evicted: the caller retries
    /// (`NoAvailableHandle`) until the reads end or the wait is over.
    #[allow(clippy::too_many_arguments)]
    pub fn put_start_ex(
        &mut self,
        m: &MasterConfig,
        stats: &Stats,
        put: PutId,
        key: &str,
        size: u64,
        cfg: &ReplicateConfig,
        upsert: bool,
        now: u64,
        attempt: Attempt,
    ) -> StoreResult<Vec<ReplicaDesc>> {
        let PutId { client, put } = put;
        self.placed_granted = false;
        check_key(key)?;
        if size == 0 {
            return Err(StoreError::InvalidParams(format!(
                "value of {key:?} is empty; values must be at least 1 byte"
            )));
        }
        if cfg.replica_num == 0 || cfg.replica_num > 64 {
            return Err(StoreError::InvalidParams(format!(
                "replica_num {} must be 1..=64",
                cfg.replica_num
            )));
        }
        if cfg.preferred_segments.len() > MAX_PREFERRED {
            return Err(StoreError::InvalidParams(format!("{} preferred segments; at most {MAX_PREFERRED} (each is compared with every segment, under the master's lock)", cfg.preferred_segments.len())));
        }
        if !self.clients.contains_key(&client) {
            return Err(StoreError::UnknownClient(client));
        }
        let discard = m.put_start_discard_timeout.as_millis() as u64;
        // A put in progress keeps the key until the discard timeout (whether a readable value
        // does is decided below, once a zombie put is discarded).
        if self
            .objects
            .get(key)
            .and_then(|o| o.pending.as_ref())
            .is_some_and(|p| now.saturating_sub(p.started) < discard)
        {
            return Err(StoreError::ObjectAlreadyExists(key.to_string()));
        }
        // A zombie put (started, never ended, older than the discard timeout) loses its
        // space, but only after the release timeout: its writer may still be writing.
        let release = now + m.put_start_release_timeout.as_millis() as u64;
        if let Some(zombie) = self.objects.get_mut(key).and_then(|o| o.pending.take()) {
            self.mark_key(key);
            tracing::warn!(
                key,
                client = zombie.client,
                "discarding a put that never finished"
            );
            for r in zombie.replicas.iter() {
                self.free_later(*r, release);
            }
            // A put that never finished leaves nothing readable: the key goes now, so that a
            // put that fails below does not leave a bare object that refuses every later put
            // of the key (`ObjectAlreadyExists`) and is never evicted.
            if self.objects.get(key).is_some_and(Object::bare) {
                self.forget(key);
            }
        }
        // A readable value stays unless this put replaces it on purpose (also when a zombie
        // upsert of it was just discarded: first writer wins, as in Mooncake).
        if !upsert && self.objects.get(key).is_some_and(|o| o.readable()) {
            return Err(StoreError::ObjectAlreadyExists(key.to_string()));
        }
        let largest = self
            .segments
            .values()
            .map(|s| s.space.size())
            .max()
            .unwrap_or(0);
        if size > largest {
            return Err(StoreError::NoAvailableHandle {
                size,
                replicas: cfg.replica_num,
                detail: if largest == 0 {
                    "no segment is mounted".into()
                } else {
                    format!("the value is larger than any segment (largest {largest} bytes)")
                },
            });
        }
        let mut replicas = self.place(size, cfg, m.strategy, now);
        // Space granted ahead goes back before anything is evicted.
        if replicas.is_empty() && self.return_pools() {
            replicas = self.place(size, cfg, m.strategy, now);
        }
        if replicas.is_empty() && !self.deferred.is_empty() {
            // Space held by reads that ended (released or expired) comes back first.
            self.expire_reads(now);
            replicas = self.place(size, cfg, m.strategy, now);
        }
        // A try again while reads are still in flight evicts nothing more: the first try
        // evicted what the put needs, and each retry (every 500 µs for up to a second) evicted
        // as much again, most of a fragmented pool before the reads ended.
        let again = attempt == Attempt::Again && self.reads_in_flight(now);
        if replicas.is_empty() && !again {
            // Make room: at least this value, at least the configured ratio. While reads in
            // flight may still free space, objects just written are spared.
            let waiting = attempt != Attempt::Last && self.reads_in_flight(now);
            let min_age = if waiting {
                m.put_wait_for_reads.as_millis() as u64
            } else {
                0
            };
            let total = self.total_bytes();
            let target = size
                .saturating_mul(u64::from(cfg.replica_num))
                .max((total as f64 * m.eviction_ratio) as u64);
            // With offload on, victims go to their client's disk as the background eviction's
            // do (their space comes back once the client reports them persisted, which the
            // put waits for as for reads); the last try drops what it must.
            let freed = if self.offload_enabled() && attempt != Attempt::Last {
                self.evict_background(target, now, m.allow_evict_soft_pinned, stats, min_age)
            } else {
                self.evict_aged(target, now, m.allow_evict_soft_pinned, stats, min_age)
            };
            tracing::debug!(
                key,
                size,
                used = self.used_bytes(),
                total,
                freed,
                deferred = self.deferred.len(),
                "no free range for a put: evicted"
            );
            replicas = self.place(size, cfg, m.strategy, now);
        }
        if replicas.is_empty() {
            return Err(StoreError::NoAvailableHandle {
                size,
                replicas: cfg.replica_num,
                detail: if self.reads_in_flight(now) {
                    "every segment is full of objects being read, pinned or being written (reads in flight did not end in time; retry, or raise the pool size)".into()
                } else {
                    "every segment is full of pinned objects or objects being written; retry later, remove objects or raise the pool size".into()
                },
            });
        }
        let descs = replicas.iter().filter_map(|r| self.desc(r)).collect();
        let soft_pin_ttl = cfg
            .soft_pin_ttl_ms
            .unwrap_or(m.default_soft_pin_ttl.as_millis() as u64);
        let pending = Box::new(Pending {
            id: put,
            replicas: replicas.into_boxed_slice(),
            size,
            client,
            started: now,
            soft_pin: cfg.soft_pin,
            soft_pin_ttl,
            copy: None,
        });
        self.mark_key(key);
        match self.objects.get_mut(key) {
            Some(o) => o.pending = Some(pending),
            None => {
                let group: Option<Arc<str>> = cfg
                    .group_id
                    .as_deref()
                    .filter(|g| !g.is_empty())
                    .map(Arc::from);
                if let Some(g) = &group {
                    self.groups
                        .entry(Arc::clone(g))
                        .or_default()
                        .members
                        .push(key.into());
                }
                self.objects.insert(
                    key.into(),
                    Object {
                        size,
                        current: Box::new([]),
                        pending: Some(pending),
                        lease_until: 0,
                        reads: Vec::new(),
                        written: now,
                        owner: client,
                        last_access: now,
                        soft_pin_until: 0,
                        hard_pin: cfg.with_hard_pin,
                        group,
                        joined: now,
                        disk: None,
                        offloading: None,
                    },
                );
            }
        }
        Ok(descs)
    }

    /// Ends put `put` of `key` (its bytes landed): the object reads as it wrote.
    pub fn put_end(&mut self, put: PutId, key: &str, now: u64) -> StoreResult<()> {
        let PutId { client, put } = put;
        let o = self
            .objects
            .get(key)
            .ok_or_else(|| StoreError::ObjectNotFound(key.to_string()))?;
        match &o.pending {
            Some(p) if p.copy.is_some() => return Err(StoreError::InvalidParams(format!("{put} of {key:?} is a replica copy, not a put: a copy ends with CopyEnd"))),
            Some(p) if p.client == client && p.id == put => {}
            Some(p) if p.client == client => return Err(StoreError::InvalidParams(format!("put {put} of {key:?} is not in progress: it was discarded as a zombie and this client is putting the key again (put {}); the earlier put is lost", p.id))),
            _ => return Err(StoreError::InvalidParams(format!("no put of {key:?} by this client is in progress (it was revoked, discarded as a zombie, or never started)"))),
        }
        self.mark_key(key);
        let o = self
            .objects
            .get_mut(key)
            .ok_or_else(|| StoreError::ObjectNotFound(key.to_string()))?;
        let p = o.pending.take().expect("checked");
        if p.replicas.is_empty() {
            // Every replica's segment went away during the write.
            if !o.readable() {
                self.forget(key);
            }
            return Err(StoreError::TransferFailed(format!(
                "every replica of {key:?} was lost (its segment was unmounted) during the put"
            )));
        }
        let old = std::mem::replace(&mut o.current, p.replicas);
        let old_reads = std::mem::take(&mut o.reads);
        // A copy on a disk, or one being made, is of the value replaced: never served again.
        o.offloading = None;
        let stale = o.disk.take();
        o.size = p.size;
        o.written = now;
        o.owner = client;
        o.last_access = now;
        o.soft_pin_until = match p.soft_pin {
            SoftPin::Enable => now.saturating_add(p.soft_pin_ttl),
            SoftPin::Disable => 0,
            SoftPin::Preserve => o.soft_pin_until,
        };
        for r in old.iter() {
            self.free_after_reads(*r, &old_reads, now); // a reader may still be reading it
        }
        if let Some(d) = stale {
            self.mark_disk(key);
            self.drop_on_disk(key, d.disk);
        }
        Ok(())
    }

    /// Revokes put `put` of `key`: its space is freed, nothing of it becomes readable.
    pub fn put_revoke(&mut self, put: PutId, key: &str) -> StoreResult<()> {
        let PutId { client, put } = put;
        let o = self
            .objects
            .get(key)
            .ok_or_else(|| StoreError::ObjectNotFound(key.to_string()))?;
        match &o.pending {
            Some(p) if p.client == client && p.id == put => {}
            _ => {
                return Err(StoreError::InvalidParams(format!(
                    "no put of {key:?} by this client is in progress"
                )))
            }
        }
        self.mark_key(key);
        let o = self
            .objects
            .get_mut(key)
            .ok_or_else(|| StoreError::ObjectNotFound(key.to_string()))?;
        let p = o.pending.take().expect("checked");
        let empty = !o.readable();
        for r in p.replicas.iter() {
            self.free_now(*r);
        }
        if empty {
            self.forget(key);
        }
        Ok(())
    }
}
