//! The simulation's clients: puts placed and written (their writes landing late), ended
//! and acknowledged, reads checked against the bytes they find, removes, upserts and
//! revocations, mounts and unmounts, pauses that let the master forget a client.

use super::*;

impl Sim {
    /// Space given to a put: no write that may still land there, no live object there.
    pub(super) fn check_given(&self, step: usize, put: &Put) -> Result<(), Failure> {
        for &r in &put.replicas {
            if let Some(w) = self
                .writes
                .iter()
                .find(|w| w.tag != put.tag && overlaps(r, (w.seg, w.addr, w.len)))
            {
                return Err(self.fail(step, format!("{} was given {r:x?}, where a write of another put (tag {}) may still land (at t={})", put.key, w.tag, w.land_at)));
            }
            for (k, a) in &self.model {
                if let Some(x) = a.replicas.iter().find(|&&x| overlaps(r, x)) {
                    return Err(self.fail(
                        step,
                        format!(
                            "{} was given {r:x?}, which live object {k} holds ({x:x?})",
                            put.key
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    pub(super) fn cells(&mut self, (seg, addr, len): (u64, u64, u64)) -> Option<&mut [u32]> {
        let base = self.clients.iter().find(|c| c.seg.id == seg)?.seg.base;
        let from = ((addr - base) / CELL) as usize;
        let to = from + (len.max(1).div_ceil(CELL)) as usize;
        self.memory.get_mut(&seg)?.get_mut(from..to)
    }

    pub(super) fn seg_of(&self, d: &ReplicaDesc) -> Option<(u64, u64, u64)> {
        let c = self.clients.iter().find(|c| {
            c.seg.te_endpoint == d.te_endpoint
                && d.addr >= c.seg.base
                && d.addr < c.seg.base + c.seg.size
        })?;
        Some((c.seg.id, d.addr, d.size))
    }

    pub(super) fn start_put(&mut self, step: usize) -> Result<(), Failure> {
        let c = self.rng.random_range(0..self.clients.len());
        let (tag, put) = (self.next_tag, u64::from(self.next_tag));
        self.next_tag += 1;
        let key = format!("k{}", self.rng.random_range(0..400u32));
        let size = self.rng.random_range(1..=8192u64);
        let replica_num = if self.rng.random_bool(0.8) { 1 } else { 2 };
        let req = Request::PutStart {
            client: self.clients[c].id,
            key: key.clone(),
            size,
            config: ReplicateConfig {
                replica_num,
                ..ReplicateConfig::default()
            },
            upsert: false,
            put,
        };
        self.put_start(step, c, req, key, put, tag)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn put_start(
        &mut self,
        step: usize,
        c: usize,
        req: Request,
        key: String,
        put: u64,
        tag: u32,
    ) -> Result<(), Failure> {
        self.put_again(&key);
        // Most writes land within a few ms; some take up to the release timeout.
        let delay = if self.rng.random_bool(0.85) {
            self.rng.random_range(0..30)
        } else {
            self.rng.random_range(0..RELEASE - 1)
        };
        let p = Put {
            client: c,
            key,
            put,
            tag,
            replicas: Vec::new(),
            seen: self.dropped.clone(),
            gens: Vec::new(),
            removed: false,
            land_at: self.now + delay,
        };
        let first = self.request(&req, Some(Reply::Started(p.clone())));
        // The network delivers the request twice now and then: the copy must not place the
        // put again (its answer, if any, names the same replicas, or refuses).
        if self.rng.random_bool(0.05) && self.leader.is_some() {
            let again = self.request(&req, None);
            self.note(format!(
                "put {put}'s start delivered twice: {:?}",
                again
                    .as_ref()
                    .map(|r| r.as_ref().map(|_| ()).map_err(|e| e.to_string()))
            ));
            match (&first, &again) {
                (Some(Ok(Response::Replicas(a))), Some(Ok(Response::Replicas(b)))) if a != b => {
                    return Err(self.fail(
                        step,
                        format!("put {put} started twice got two placements: {a:?} then {b:?}"),
                    ));
                }
                (_, None) => {
                    return Err(self.fail(
                        step,
                        format!(
                            "put {put}'s second start was applied again (it waits for the journal)"
                        ),
                    ))
                }
                _ => {}
            }
        }
        match first {
            Some(Ok(Response::Replicas(rs))) => {
                let replicas = rs.iter().filter_map(|d| self.seg_of(d)).collect();
                self.started(step, Put { replicas, ..p })
            }
            _ => Ok(()),
        }
    }

    /// The client got its put's replicas: it writes them.
    pub(super) fn started(&mut self, step: usize, mut p: Put) -> Result<(), Failure> {
        self.check_given(step, &p)?;
        p.gens = p
            .replicas
            .iter()
            .map(|r| p.seen.get(&r.0).copied().unwrap_or(0))
            .collect();
        p.land_at = p.land_at.max(self.now);
        if p.land_at > self.now + 100 {
            self.counts.late_writes += 1;
        }
        self.note(format!(
            "client {} put {} of {} (tag {}) placed at {:x?}, lands at {}",
            p.client, p.put, p.key, p.tag, p.replicas, p.land_at
        ));
        for &(seg, addr, len) in &p.replicas {
            self.writes.push(Write {
                tag: p.tag,
                seg,
                addr,
                len,
                land_at: p.land_at,
            });
        }
        self.to_end.push(p);
        Ok(())
    }

    pub(super) fn acked(&mut self, p: Put) {
        self.counts.puts_acked += 1;
        self.note(format!(
            "put {} of {} (tag {}) acknowledged",
            p.put, p.key, p.tag
        ));
        // Replicas whose segment the master dropped since they were placed are not the
        // object's any more (that space may be given again once the segment is back).
        let kept: Vec<(u64, u64, u64)> = p
            .replicas
            .iter()
            .zip(&p.gens)
            .filter(|(r, g)| self.dropped.get(&r.0).copied().unwrap_or(0) == **g)
            .map(|(r, _)| *r)
            .collect();
        let may_be_lost = kept.len() != p.replicas.len();
        if p.removed {
            return;
        }
        self.model.insert(
            p.key.clone(),
            Acked {
                tag: p.tag,
                replicas: kept,
                may_be_lost,
            },
        );
    }

    pub(super) fn land(&mut self, step: usize, t: u64) -> Result<(), Failure> {
        let (due, rest): (Vec<Write>, Vec<Write>) = std::mem::take(&mut self.writes)
            .into_iter()
            .partition(|w| w.land_at <= t);
        self.writes = rest;
        for w in due {
            let r = (w.seg, w.addr, w.len);
            if let Some((k, _)) = self
                .model
                .iter()
                .find(|(_, a)| a.tag != w.tag && a.replicas.iter().any(|&x| overlaps(r, x)))
            {
                return Err(self.fail(
                    step,
                    format!(
                        "a write of tag {} landed on {r:x?}, bytes of live object {k}",
                        w.tag
                    ),
                ));
            }
            if let Some(rd) = self
                .reads
                .iter()
                .find(|rd| !rd.tags.contains(&w.tag) && rd.replicas.iter().any(|&x| overlaps(r, x)))
            {
                return Err(self.fail(
                    step,
                    format!(
                        "a write of tag {} landed on {r:x?}, which a read of {} in flight reads",
                        w.tag, rd.key
                    ),
                ));
            }
            if let Some(cells) = self.cells(r) {
                cells.fill(w.tag);
            }
        }
        Ok(())
    }

    pub(super) fn finish_reads(&mut self, step: usize, t: u64) -> Result<(), Failure> {
        let (done, rest): (Vec<Read>, Vec<Read>) = std::mem::take(&mut self.reads)
            .into_iter()
            .partition(|r| r.done_at <= t);
        self.reads = rest;
        for rd in done {
            for &r in &rd.replicas {
                if self
                    .cells(r)
                    .is_some_and(|c| c.iter().any(|x| !rd.tags.contains(x)))
                {
                    return Err(self.fail(
                        step,
                        format!(
                            "a read of {} at {r:x?} found bytes other than its put's (tags {:?})",
                            rd.key, rd.tags
                        ),
                    ));
                }
            }
            self.counts.reads_checked += 1;
        }
        Ok(())
    }

    /// Pings of the clients that run, and the master's periodic work.
    pub(super) fn tick(&mut self) {
        let now = self.now;
        for i in 0..self.clients.len() {
            if self.clients[i].silent_until > now {
                continue;
            }
            let id = self.clients[i].id;
            if let Some(Ok(Response::Ping(PingStatus::NeedRemount))) =
                self.request(&Request::Ping { client: id }, None)
            {
                self.clients[i].remount = true;
            }
            if self.clients[i].remount && self.clients[i].mounted {
                let req = Request::RemountSegments {
                    client: id,
                    segments: vec![self.clients[i].seg.clone()],
                };
                if let Some(Ok(_)) = self.request(&req, None) {
                    self.clients[i].remount = false;
                }
            }
        }
        let Some(l) = self.leader.as_mut() else {
            return;
        };
        let dead = l.st.expire_clients(now, CLIENT_TTL, RELEASE);
        l.st.expire_reads(now);
        l.st.release_deferred(now);
        for (c, _) in dead {
            self.counts.expiries += 1;
            self.note(format!("client {c} expired"));
            if let Some(seg) = self.clients.iter().find(|x| x.id == c).map(|x| x.seg.id) {
                self.segment_dropped(seg);
            }
        }
        self.collect(None);
    }

    /// Objects with a replica on `seg` may be lost (the master dropped the segment).
    pub(super) fn segment_dropped(&mut self, seg: u64) {
        *self.dropped.entry(seg).or_default() += 1;
        // A read of a dropped segment is its reader's to fail.
        for rd in &mut self.reads {
            rd.replicas.retain(|r| r.0 != seg);
        }
        for a in self.model.values_mut() {
            if a.replicas.iter().any(|r| r.0 == seg) {
                a.may_be_lost = true;
                a.replicas.retain(|r| r.0 != seg);
            }
        }
    }

    /// Puts whose writes landed send their end (again, after a failover, until answered).
    pub(super) fn end_puts(&mut self) {
        let now = self.now;
        let (ready, wait): (Vec<Put>, Vec<Put>) = std::mem::take(&mut self.to_end)
            .into_iter()
            .partition(|p| p.land_at <= now);
        self.to_end = wait;
        for p in ready {
            if self.leader.is_none() {
                self.to_end.push(p);
                continue;
            }
            let req = Request::PutEnd {
                client: self.clients[p.client].id,
                key: p.key.clone(),
                put: p.put,
            };
            self.put_again(&p.key);
            // An error: the put is lost (revoked, discarded, its change lost with a leader).
            match self.request(&req, Some(Reply::Ended(p.clone()))) {
                Some(Ok(_)) => self.acked(p),
                Some(Err(e)) => self.note(format!(
                    "put {} of {} (tag {}) failed to end: {e}",
                    p.put, p.key, p.tag
                )),
                // Applied, answered once durable: the value it replaces is no longer the
                // model's (its space may be given again: a read in flight of it is still
                // checked), and the new one is once acknowledged.
                None => {
                    self.model.remove(&p.key);
                }
            }
        }
    }

    pub(super) fn get(&mut self, step: usize) -> Result<(), Failure> {
        let Some(key) = self.pick_key() else {
            return Ok(());
        };
        let a = self.model[&key].clone();
        match self.request(&Request::GetReplicaList { key: key.clone() }, None) {
            Some(Ok(Response::ReplicaList(list))) => {
                let replicas: Vec<_> = list.replicas.iter().filter_map(|d| self.seg_of(d)).collect();
                let done_at = self.now + self.rng.random_range(0..LEASE);
                let mut tags = vec![a.tag];
                tags.extend(self.pending.iter().filter_map(|e| match &e.reply {
                    Some(Reply::Ended(p)) if p.key == key => Some(p.tag),
                    _ => None,
                }));
                self.reads.push(Read { key, tags, replicas, done_at });
            }
            Some(Err(StoreError::ObjectNotFound(_))) if a.may_be_lost => {
                self.model.remove(&key);
            }
            Some(Err(e)) if !a.may_be_lost => return Err(self.fail(step, format!("acknowledged {key} (tag {}, replicas {:x?}) is not readable at the leader of term {}: {e}", a.tag, a.replicas, self.term))),
            _ => {}
        }
        Ok(())
    }

    pub(super) fn pick_key(&mut self) -> Option<String> {
        if self.model.is_empty() {
            return None;
        }
        let i = self.rng.random_range(0..self.model.len());
        self.model.keys().nth(i).cloned()
    }

    pub(super) fn remove(&mut self) {
        let Some(key) = self.pick_key() else { return };
        let force = self.rng.random_bool(0.5);
        let r = self.request(
            &Request::Remove {
                key: key.clone(),
                force,
            },
            Some(Reply::Removed(key.clone())),
        );
        // Applied (answered now or once durable): no longer the model's.
        if matches!(r, None | Some(Ok(_))) && self.leader.is_some() {
            self.note(format!("{key} removed"));
            self.model.remove(&key);
            for e in &mut self.pending {
                if let Some(Reply::Ended(p)) = &mut e.reply {
                    p.removed |= p.key == key;
                }
            }
        }
    }

    pub(super) fn upsert_or_revoke(&mut self, step: usize) -> Result<(), Failure> {
        // An upsert of a live key: the old value stays readable until the new one ends.
        let Some(key) = self.pick_key() else {
            return Ok(());
        };
        let c = self.rng.random_range(0..self.clients.len());
        let (tag, put) = (self.next_tag, u64::from(self.next_tag));
        self.next_tag += 1;
        let size = self.rng.random_range(1..=8192u64);
        let req = Request::PutStart {
            client: self.clients[c].id,
            key: key.clone(),
            size,
            config: ReplicateConfig::default(),
            upsert: true,
            put,
        };
        self.put_start(step, c, req, key, put, tag)
    }

    pub(super) fn unmount_or_mount(&mut self) {
        let i = self.rng.random_range(0..self.clients.len());
        let c = &self.clients[i];
        let (id, seg) = (c.id, c.seg.clone());
        if c.mounted {
            self.counts.unmounts += 1;
            self.note(format!("client {id} unmounts {}", seg.id));
            // Applied now, answered or not: its objects may be gone.
            if self.leader.is_some() {
                let _ = self.request(
                    &Request::UnmountSegment {
                        client: id,
                        segment: seg.id,
                    },
                    None,
                );
                self.segment_dropped(seg.id);
                self.clients[i].mounted = false;
            }
        } else {
            let req = if self.rng.random_bool(0.5) {
                Request::MountSegment {
                    client: id,
                    segment: seg,
                }
            } else {
                Request::RemountSegments {
                    client: id,
                    segments: vec![seg],
                }
            };
            self.note(format!("client {id} mounts again"));
            if self.leader.is_some() {
                let _ = self.request(&req, None);
                self.clients[i].mounted = true;
            }
        }
    }

    pub(super) fn pause_client(&mut self) {
        let i = self.rng.random_range(0..self.clients.len());
        self.clients[i].silent_until =
            self.now + self.rng.random_range(CLIENT_TTL / 2..CLIENT_TTL * 2);
        self.note(format!(
            "client {} pauses until {}",
            self.clients[i].id, self.clients[i].silent_until
        ));
    }
}

impl Sim {
    /// `key` is put again (a start or an end sent): its removal no longer says it is gone,
    /// nor will one still waiting for the journal.
    pub(super) fn put_again(&mut self, key: &str) {
        self.gone.remove(key);
        for e in &mut self.pending {
            if matches!(&e.reply, Some(Reply::Removed(k)) if k == key) {
                e.reply = None;
            }
        }
    }

    /// A new leader holds none of the keys whose removal was acknowledged (the snapshots and
    /// logs it loaded, or the mirror a standby wrote to etcd, keep a removal as they keep a
    /// put: a key removed stays removed across any number of failovers).
    pub(super) fn check_gone(&mut self, step: usize) -> Result<(), Failure> {
        let now = self.now;
        let Some(l) = self.leader.as_ref() else {
            return Ok(());
        };
        let back = self
            .gone
            .iter()
            .find(|k| l.st.key_info(k, now).is_some_and(|i| i.complete))
            .cloned();
        self.counts.removals_checked += self.gone.len() as u64;
        match back {
            Some(k) => Err(self.fail(
                step,
                format!(
                    "{k}, whose removal was acknowledged, is back at the leader of term {}",
                    self.term
                ),
            )),
            None => Ok(()),
        }
    }
}
