//! Two-phase puts and kept replica lists (Mooncake 0.3.14's put and get sessions, its
//! ranged reads from a snapshot): space reserved now and written range by range later, then
//! ended (readable) or revoked; replica lists asked for once (each a read lease) and read by
//! ranges until released.

use super::rpc::Conn;
use super::Client;
use crate::error::{StoreError, StoreResult};
use crate::proto::{ReplicaDesc, ReplicaList, ReplicateConfig, Request, Response};
use kvferry::{Opcode, TransferRequest};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// One range of a ranged write or read: `len` bytes between local `addr` (registered memory)
/// and offset `off` of the value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    pub addr: u64,
    pub len: u64,
    pub off: u64,
}

/// Space the master reserved for a key (a put started, not ended): not readable until
/// [`Client::end_reserved`]. Dropped without an end or a revoke, the master discards it
/// after its `put_start_discard_timeout`.
#[derive(Debug)]
pub struct Reservation {
    key: String,
    put: u64,
    size: u64,
    replicas: Vec<ReplicaDesc>,
    /// The leader that reserved it: an end under another one may not be stored.
    epoch: u64,
}

impl Reservation {
    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn size(&self) -> u64 {
        self.size
    }
}

/// A key's replica list with its read lease, kept for reads by range until released
/// ([`Client::release_leases`]); the replicas are neither freed nor reused meanwhile.
#[derive(Debug)]
pub struct ReadLease {
    key: String,
    list: ReplicaList,
    at: Instant,
}

impl ReadLease {
    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn size(&self) -> u64 {
        self.list.size
    }

    /// Whether half of the lease has run out (Mooncake refreshes a snapshot then).
    pub fn half_spent(&self) -> bool {
        self.at.elapsed() * 2 >= Duration::from_millis(self.list.lease_ttl_ms)
    }
}

/// Checks `ranges` against a value of `size` bytes; their total length.
fn total(ranges: &[Range], size: u64) -> StoreResult<u64> {
    let mut sum = 0u64;
    for r in ranges {
        if r.off.checked_add(r.len).is_none_or(|end| end > size) {
            return Err(StoreError::InvalidParams(format!(
                "range [{}, +{}) is past the value's {size} bytes",
                r.off, r.len
            )));
        }
        sum = sum.saturating_add(r.len);
    }
    Ok(sum)
}

impl Client {
    /// Starts a put of each `(key, size)` without writing it (one round trip): space is
    /// reserved on `cfg.replica_num` segments, the key is not readable yet.
    pub fn reserve(
        &self,
        items: &[(&str, u64)],
        cfg: &ReplicateConfig,
    ) -> Vec<StoreResult<Reservation>> {
        if let Err(e) = self.check_open() {
            return items.iter().map(|_| Err(e.clone())).collect();
        }
        let id = self.inner.id;
        let n = items.len() as u64;
        let first = self.inner.next_put.fetch_add(n, Ordering::Relaxed) + 1;
        let starts = items
            .iter()
            .zip(first..)
            .map(|(&(k, size), put)| Request::PutStart {
                client: id,
                key: k.to_string(),
                size,
                config: cfg.clone(),
                upsert: false,
                put,
            })
            .collect();
        let (answers, epoch) = match self.inner.call_batch_at(starts, Conn::Pool) {
            Ok(a) => a,
            Err(e) => {
                if e == StoreError::OutcomeUnknown {
                    self.revoke_unknown(items.iter().zip(first..).map(|(&(k, _), p)| (k, p)));
                }
                return items.iter().map(|_| Err(e.clone())).collect();
            }
        };
        let mut unknown = Vec::new();
        let out = answers
            .into_iter()
            .zip(items.iter().zip(first..))
            .map(|(a, (&(key, size), put))| match a {
                Response::Replicas(replicas) => Ok(Reservation {
                    key: key.to_string(),
                    put,
                    size,
                    replicas,
                    epoch,
                }),
                Response::Err(e) => {
                    if e == StoreError::OutcomeUnknown {
                        unknown.push((key, put));
                    }
                    Err(e)
                }
                other => Err(StoreError::Rpc(format!("unexpected answer {other:?}"))),
            })
            .collect();
        self.revoke_unknown(unknown.into_iter());
        out
    }

    /// Writes each item's ranges into every replica of its reservation (one transfer
    /// batch); per item the bytes written. A range past the reserved size fails its item
    /// before anything moves.
    pub fn write_reserved(&self, items: &[(&Reservation, &[Range])]) -> Vec<StoreResult<u64>> {
        if let Err(e) = self.check_open() {
            return items.iter().map(|_| Err(e.clone())).collect();
        }
        let mut results: Vec<StoreResult<u64>> = Vec::with_capacity(items.len());
        let (mut reqs, mut owner, mut writes) = (Vec::new(), Vec::new(), Vec::new());
        for (i, &(r, ranges)) in items.iter().enumerate() {
            let sum = match total(ranges, r.size) {
                Ok(s) => s,
                Err(e) => {
                    results.push(Err(e));
                    continue;
                }
            };
            let mut ok = Ok(sum);
            for rep in &r.replicas {
                match self.segment_id(&rep.te_endpoint) {
                    Ok(seg) => {
                        writes.push((rep.te_endpoint.clone(), rep.addr, r.size));
                        for g in ranges.iter().filter(|g| g.len > 0) {
                            reqs.push(TransferRequest {
                                opcode: Opcode::Write,
                                source: g.addr,
                                target_id: seg,
                                target_offset: rep.addr + g.off,
                                length: g.len,
                            });
                            owner.push(i);
                        }
                    }
                    Err(e) => ok = Err(e),
                }
            }
            results.push(ok);
        }
        if reqs.is_empty() {
            return results;
        }
        // Tracked as a put's writes are: a master that forgot this client is told of them.
        let until = Instant::now() + self.inner.cfg.transfer_timeout * 2;
        let batch = self.writes().start(writes, until);
        let mut landed = true;
        match self.transfer(&reqs) {
            Ok(statuses) => {
                for (k, st) in statuses.into_iter().enumerate() {
                    if let Err(e) = st {
                        results[owner[k]] = Err(e);
                        landed = false;
                    }
                }
            }
            Err(e) => {
                landed = false;
                for &o in &owner {
                    results[o] = Err(e.clone());
                }
            }
        }
        self.writes().ended(batch, landed);
        results
    }

    fn writes(&self) -> std::sync::MutexGuard<'_, super::rpc::Writes> {
        self.inner
            .rpc
            .writes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Ends reservations: their keys become readable (bytes never written read as whatever
    /// the space held). A failover since the reservation fails it (`MasterFailover`).
    pub fn end_reserved(&self, rs: &[&Reservation]) -> Vec<StoreResult<()>> {
        let id = self.inner.id;
        let reqs = rs
            .iter()
            .map(|r| Request::PutEnd {
                client: id,
                key: r.key.clone(),
                put: r.put,
            })
            .collect();
        let (answers, epoch) = match self.inner.call_batch_at(reqs, Conn::Pool) {
            Ok(a) => a,
            Err(e) => return rs.iter().map(|_| Err(e.clone())).collect(),
        };
        answers
            .into_iter()
            .zip(rs)
            .map(|(a, r)| match a.into_result() {
                Ok(_) => Ok(()),
                Err(e) if epoch != r.epoch && e != StoreError::OutcomeUnknown => {
                    Err(StoreError::MasterFailover(r.key.clone()))
                }
                Err(e) => Err(e),
            })
            .collect()
    }

    /// Revokes reservations: their space is freed, nothing was stored.
    pub fn revoke_reserved(&self, rs: &[&Reservation]) -> Vec<StoreResult<()>> {
        let id = self.inner.id;
        let reqs = rs
            .iter()
            .map(|r| Request::PutRevoke {
                client: id,
                key: r.key.clone(),
                put: r.put,
            })
            .collect();
        match self.call_batch(reqs) {
            Ok(a) => a.into_iter().map(|a| a.into_result().map(|_| ())).collect(),
            Err(e) => rs.iter().map(|_| Err(e.clone())).collect(),
        }
    }

    /// Asks for the replica lists of `keys` (one round trip; each a read lease), kept for
    /// [`Client::read_leased`] until released.
    pub fn lease_reads(&self, keys: &[&str]) -> Vec<StoreResult<ReadLease>> {
        match self.replica_lists(keys.iter().copied()) {
            Ok((answers, at)) => answers
                .into_iter()
                .zip(keys)
                .map(|(a, &key)| match a {
                    Response::ReplicaList(list) => Ok(ReadLease {
                        key: key.to_string(),
                        list,
                        at,
                    }),
                    Response::Err(e) => Err(e),
                    other => Err(StoreError::Rpc(format!("unexpected answer {other:?}"))),
                })
                .collect(),
            Err(e) => keys.iter().map(|_| Err(e.clone())).collect(),
        }
    }

    /// Reads each item's ranges from its kept replica list (one transfer batch; a replica
    /// that fails is followed by the next listed); per item the bytes read. A range past the
    /// value fails its item before anything moves; a read that outlived its lease fails with
    /// `LeaseExpired` (the replica may have been reused).
    pub fn read_leased(&self, items: &[(&ReadLease, &[Range])]) -> Vec<StoreResult<u64>> {
        if let Err(e) = self.check_open() {
            return items.iter().map(|_| Err(e.clone())).collect();
        }
        let mut results: Vec<StoreResult<u64>> = Vec::with_capacity(items.len());
        // Per item: the replicas in the order tried, and which one this batch reads.
        let mut order: Vec<Vec<&ReplicaDesc>> = Vec::with_capacity(items.len());
        let (mut reqs, mut owner) = (Vec::new(), Vec::new());
        for (i, &(l, ranges)) in items.iter().enumerate() {
            let reps = self.pick(&l.list);
            let read = total(ranges, l.list.size).and_then(|sum| {
                let seg = reps.first().map_or_else(
                    || Err(StoreError::ObjectNotFound(l.key.clone())),
                    |r| self.segment_id(&r.te_endpoint),
                )?;
                for g in ranges.iter().filter(|g| g.len > 0) {
                    reqs.push(range_read(g, seg, reps[0].addr));
                    owner.push(i);
                }
                Ok(sum)
            });
            results.push(read);
            order.push(reps);
        }
        let mut failed: Vec<usize> = Vec::new();
        if !reqs.is_empty() {
            match self.transfer(&reqs) {
                Ok(statuses) => {
                    for (k, st) in statuses.into_iter().enumerate() {
                        if st.is_err() && failed.last() != Some(&owner[k]) {
                            failed.push(owner[k]);
                        }
                    }
                }
                Err(_) => {
                    failed = (0..items.len()).filter(|i| owner.contains(i)).collect();
                }
            }
        }
        for i in failed {
            let (l, ranges) = items[i];
            let mut last = Err(StoreError::TransferFailed(format!(
                "{}: no replica could be read",
                l.key
            )));
            for r in order[i].iter().skip(1) {
                let one = self.segment_id(&r.te_endpoint).and_then(|seg| {
                    let again: Vec<TransferRequest> = ranges
                        .iter()
                        .filter(|g| g.len > 0)
                        .map(|g| range_read(g, seg, r.addr))
                        .collect();
                    self.transfer(&again)?
                        .into_iter()
                        .collect::<StoreResult<Vec<()>>>()
                });
                last = one.map(|_| ranges.iter().map(|g| g.len).sum());
                if last.is_ok() {
                    break;
                }
            }
            results[i] = last;
        }
        for (res, &(l, _)) in results.iter_mut().zip(items) {
            // (A millisecond early, as a get's check: the master counts whole milliseconds.)
            let lease = Duration::from_millis(l.list.lease_ttl_ms);
            if res.is_ok() && l.at.elapsed() + Duration::from_millis(1) >= lease {
                *res = Err(StoreError::LeaseExpired(l.key.clone()));
            }
        }
        results
    }

    /// Releases kept replica lists: their replicas may be reclaimed.
    pub fn release_leases<'a>(&self, leases: impl IntoIterator<Item = &'a ReadLease>) {
        self.inner
            .queue_releases(leases.into_iter().map(|l| l.list.read_id));
    }
}

fn range_read(g: &Range, seg: u64, remote: u64) -> TransferRequest {
    TransferRequest {
        opcode: Opcode::Read,
        source: g.addr,
        target_id: seg,
        target_offset: remote + g.off,
        length: g.len,
    }
}

#[cfg(test)]
#[path = "session_tests.rs"]
mod tests;
