//! Gets: asking the master for replica lists (each a read lease), reading the closest
//! replica that opens (the others on failure), refusing a read that outlived its lease, and
//! queueing the reads' releases. Nothing here writes a value.

use super::{Client, Staged};
use crate::error::{StoreError, StoreResult};
use crate::proto::{DiskReplicaList, ReplicaDesc, ReplicaList, Request, Response};
use kvferry::{Opcode, TransferRequest};
use std::time::{Duration, Instant};

impl Client {
    pub(super) fn pick<'a>(&self, list: &'a ReplicaList) -> Vec<&'a ReplicaDesc> {
        // The local replica first (a memcpy), then the others in the master's order.
        let me = self.segment_name();
        let mut v: Vec<&ReplicaDesc> = list
            .replicas
            .iter()
            .filter(|r| r.te_endpoint == me)
            .collect();
        v.extend(list.replicas.iter().filter(|r| r.te_endpoint != me));
        v
    }

    /// Reads `key` into `[addr, addr+cap)` (registered memory); returns its size.
    pub fn get_into(&self, key: &str, addr: u64, cap: u64) -> StoreResult<u64> {
        self.batch_get_into(&[(key, addr, cap)])
            .pop()
            .unwrap_or_else(|| Err(StoreError::Internal("no result".into())))
    }

    /// Reads many keys with one master round trip and one transfer batch.
    pub fn batch_get_into(&self, items: &[(&str, u64, u64)]) -> Vec<StoreResult<u64>> {
        let parts: Vec<[(u64, u64); 1]> = items.iter().map(|&(_, a, l)| [(a, l)]).collect();
        let items: Vec<(&str, &[(u64, u64)])> = items
            .iter()
            .zip(&parts)
            .map(|(&(k, _, _), p)| (k, &p[..]))
            .collect();
        self.batch_get_into_parts(&items)
    }

    /// Reads, per key, its value across its parts (`(addr, len)` ranges of registered memory,
    /// filled in order, each straight from the replica); returns the value's size. A value
    /// larger than the parts together fails with `BufferOverflow`, touching nothing.
    pub fn batch_get_into_parts(&self, items: &[(&str, &[(u64, u64)])]) -> Vec<StoreResult<u64>> {
        match self.replica_lists(items.iter().map(|&(k, _)| k)) {
            Ok((answers, t0)) => self.read_listed(items, answers, t0),
            Err(e) => items.iter().map(|_| Err(e.clone())).collect(),
        }
    }

    /// Asks the master for the replica lists of `keys` (each grants a lease and a read to
    /// release) in one round trip; the answers, and when they were asked for (the leases
    /// run from then).
    pub(super) fn replica_lists<'k>(
        &self,
        keys: impl Iterator<Item = &'k str>,
    ) -> StoreResult<(Vec<Response>, Instant)> {
        self.check_open()?;
        let t0 = Instant::now();
        Ok((
            self.call_batch(
                keys.map(|k| Request::GetReplicaList { key: k.to_string() })
                    .collect(),
            )?,
            t0,
        ))
    }

    /// Reads each item's value from the replicas its answer (to `GetReplicaList`, asked at
    /// `t0`) lists; then queues the releases of those reads.
    fn read_listed(
        &self,
        items: &[(&str, &[(u64, u64)])],
        answers: Vec<Response>,
        t0: Instant,
    ) -> Vec<StoreResult<u64>> {
        let mut results: Vec<StoreResult<u64>> = Vec::with_capacity(items.len());
        let mut lists: Vec<Option<ReplicaList>> = Vec::with_capacity(items.len());
        // Per item, the index (in `pick`'s order) of the replica read first.
        let mut first_used: Vec<usize> = Vec::with_capacity(items.len());
        let mut reqs = Vec::new();
        let mut owner = Vec::new();
        // Objects found only on a disk (read through their owner, `disk_read`), and their
        // leases (index, lease, read id).
        let mut on_disk = Vec::new();
        let mut disk_leases: Vec<(usize, u64, u64)> = Vec::new();
        for (i, (a, &(key, parts))) in answers.into_iter().zip(items).enumerate() {
            let cap: u64 = parts.iter().map(|p| p.1).sum();
            match a {
                Response::ReplicaList(l) if l.size > cap => {
                    results.push(Err(StoreError::BufferOverflow {
                        need: l.size,
                        have: cap,
                    }));
                    // (Listed, so that the read it was granted is released below: unreleased, it
                    // held the object against eviction and its old space for a whole lease.)
                    lists.push(Some(l));
                    first_used.push(usize::MAX);
                }
                Response::ReplicaList(l) => {
                    // The first replica whose segment opens (one on a peer that died, not yet
                    // dropped by the master, does not fail the read while another is listed).
                    let mut found = Err(StoreError::ObjectNotFound(key.to_string()));
                    let mut used = usize::MAX;
                    for (j, r) in self.pick(&l).into_iter().enumerate() {
                        match self.segment_id(&r.te_endpoint) {
                            Ok(seg) => {
                                found = Ok((seg, r.addr));
                                used = j;
                                break;
                            }
                            Err(e) => found = Err(e),
                        }
                    }
                    match found {
                        Ok((seg, addr)) => {
                            for req in read_parts(parts, seg, addr, l.size) {
                                reqs.push(req);
                                owner.push(i);
                            }
                            results.push(Ok(l.size));
                        }
                        Err(e) => results.push(Err(e)),
                    }
                    lists.push(Some(l));
                    first_used.push(used);
                }
                Response::DiskReplica(d) => {
                    disk_leases.push((i, d.lease_ttl_ms, d.read_id));
                    if d.size > cap {
                        results.push(Err(StoreError::BufferOverflow {
                            need: d.size,
                            have: cap,
                        }));
                    } else {
                        // (Until its read says otherwise.)
                        results.push(Err(StoreError::TransferFailed(format!(
                            "{key}: not read from its disk"
                        ))));
                        on_disk.push(super::disk_read::DiskItem {
                            index: i,
                            key,
                            parts,
                            list: d,
                        });
                    }
                    lists.push(None);
                    first_used.push(usize::MAX);
                }
                Response::Err(e) => {
                    results.push(Err(e));
                    lists.push(None);
                    first_used.push(usize::MAX);
                }
                other => {
                    results.push(Err(StoreError::Rpc(format!("unexpected answer {other:?}"))));
                    lists.push(None);
                    first_used.push(usize::MAX);
                }
            }
        }
        // The objects in memory and those only on disks are read at once.
        let memory = |results: &mut Vec<StoreResult<u64>>| {
            if !reqs.is_empty() {
                let statuses = match self.transfer(&reqs) {
                    Ok(s) => s,
                    Err(e) => reqs.iter().map(|_| Err(e.clone())).collect(),
                };
                // The first failure of each key; its other replicas are tried, all parts again.
                let mut failed: Vec<(usize, StoreError)> = Vec::new();
                for (k, st) in statuses.into_iter().enumerate() {
                    if let Err(e) = st {
                        if failed.last().is_none_or(|(i, _)| *i != owner[k]) {
                            failed.push((owner[k], e));
                        }
                    }
                }
                for (i, first_err) in failed {
                    let (key, parts) = items[i];
                    let mut last: StoreResult<u64> = Err(first_err);
                    if let Some(l) = &lists[i] {
                        for r in self
                            .pick(l)
                            .into_iter()
                            .skip(first_used[i].saturating_add(1))
                        {
                            let one = self.segment_id(&r.te_endpoint).and_then(|seg| {
                                let again = read_parts(parts, seg, r.addr, l.size);
                                self.transfer(&again)
                                    .and_then(|v| v.into_iter().collect::<StoreResult<Vec<()>>>())
                            });
                            last = one.map(|_| l.size);
                            if last.is_ok() {
                                break;
                            }
                        }
                    }
                    results[i] =
                        last.map_err(|e| StoreError::TransferFailed(format!("{key}: {e}")));
                }
            }
        };
        let from_disks = if on_disk.is_empty() {
            memory(&mut results);
            Vec::new()
        } else if reqs.is_empty() {
            self.read_from_disks(on_disk)
        } else {
            let ((), d) =
                super::disk_read::join(|| memory(&mut results), || self.read_from_disks(on_disk));
            d.unwrap_or_default()
        };
        for (i, r) in from_disks {
            results[i] = r;
        }
        // A read that outlived its lease may have raced an overwrite: refuse it.
        let elapsed = t0.elapsed();
        for &(i, ttl, _) in &disk_leases {
            if results[i].is_ok()
                && elapsed + Duration::from_millis(1) >= Duration::from_millis(ttl)
            {
                results[i] = Err(StoreError::LeaseExpired(items[i].0.to_string()));
            }
        }
        for (i, l) in lists.iter().enumerate() {
            if let (Some(l), Ok(_)) = (l, &results[i]) {
                // (A millisecond early: the master counts whole milliseconds, so its lease may
                // end up to one before this client's count of it does.)
                if elapsed + Duration::from_millis(1) >= Duration::from_millis(l.lease_ttl_ms) {
                    results[i] = Err(StoreError::LeaseExpired(items[i].0.to_string()));
                }
            }
        }
        // Every transfer is terminal: the replicas read may be reclaimed.
        self.inner.queue_releases(
            lists
                .iter()
                .flatten()
                .map(|l| l.read_id)
                .chain(disk_leases.iter().map(|&(_, _, id)| id)),
        );
        results
    }

    /// Returns the value of `key` (`ObjectNotFound` if absent).
    pub fn get(&self, key: &str) -> StoreResult<Vec<u8>> {
        self.get_batch(&[key])
            .pop()
            .unwrap_or_else(|| Err(StoreError::Internal("no result".into())))
    }

    /// Returns several values; per-key results. Each value is read into the local buffer,
    /// then copied into its new `Vec` ([`copy_out`](super::copy_out): fresh pages faulted in
    /// first, a large call's bytes copied by several threads).
    pub fn get_batch(&self, keys: &[&str]) -> Vec<StoreResult<Vec<u8>>> {
        let staged = self.get_buffers(keys);
        let srcs: Vec<&[u8]> = staged
            .iter()
            .filter_map(|s| s.as_ref().ok().map(Staged::as_slice))
            .collect();
        let mut copies = super::copy_out::to_vecs(&srcs).into_iter();
        staged
            .into_iter()
            .map(|s| {
                s.and_then(|_| {
                    copies
                        .next()
                        .ok_or_else(|| StoreError::Internal("no copy for a staged value".into()))
                })
            })
            .collect()
    }

    /// Reads several values into the local buffer and hands each out where it landed (no
    /// copy; Mooncake's `batch_get_buffer`); per-key results. A value holds its space in the
    /// local buffer until dropped: a key whose value does not fit in what is free fails
    /// (`InvalidParams`, naming `local_buffer_size`).
    pub fn get_buffers(&self, keys: &[&str]) -> Vec<StoreResult<Staged>> {
        // One round trip: the replica lists give the sizes (space is staged for each) and
        // are what is read.
        let (answers, t0) = match self.replica_lists(keys.iter().copied()) {
            Ok(x) => x,
            Err(e) => return keys.iter().map(|_| Err(e.clone())).collect(),
        };
        let mut staged: Vec<StoreResult<Staged>> = Vec::with_capacity(keys.len());
        // Per key staged: its index, where it lands, and its answer.
        let mut idx: Vec<usize> = Vec::with_capacity(keys.len());
        let mut parts: Vec<[(u64, u64); 1]> = Vec::with_capacity(keys.len());
        let mut listed: Vec<Response> = Vec::with_capacity(keys.len());
        for (i, a) in answers.into_iter().enumerate() {
            staged.push(match a {
                Response::ReplicaList(ReplicaList { size, read_id, .. })
                | Response::DiskReplica(DiskReplicaList { size, read_id, .. }) => {
                    match self.stage(size as usize) {
                        Ok(s) => {
                            idx.push(i);
                            parts.push([(s.addr, s.len as u64)]);
                            listed.push(a);
                            Ok(s)
                        }
                        Err(e) => {
                            self.inner.queue_releases([read_id]); // nothing will be read
                            Err(e)
                        }
                    }
                }
                Response::Err(e) => Err(e),
                other => Err(StoreError::Rpc(format!("unexpected answer {other:?}"))),
            });
        }
        let items: Vec<(&str, &[(u64, u64)])> = idx
            .iter()
            .zip(&parts)
            .map(|(&i, p)| (keys[i], &p[..]))
            .collect();
        let rs = self.read_listed(&items, listed, t0);
        let mut results: Vec<Option<StoreResult<u64>>> = (0..keys.len()).map(|_| None).collect();
        for (i, r) in idx.into_iter().zip(rs) {
            results[i] = Some(r);
        }
        staged
            .into_iter()
            .zip(results)
            .map(|(s, r)| match (s, r) {
                (Ok(mut s), Some(Ok(n))) => {
                    s.len = s.len.min(n as usize);
                    Ok(s)
                }
                (Ok(_), Some(Err(e))) | (Err(e), _) => Err(e),
                (Ok(_), None) => Err(StoreError::Internal("no result for a staged key".into())),
            })
            .collect()
    }
}

/// The READs that fill `parts` in order with the first `size` bytes of the replica at
/// `remote` in segment `seg` (parts past the value's end get nothing).
pub(super) fn read_parts(
    parts: &[(u64, u64)],
    seg: u64,
    remote: u64,
    size: u64,
) -> Vec<TransferRequest> {
    let mut off = 0;
    let mut out = Vec::with_capacity(parts.len());
    for &(addr, len) in parts {
        let take = len.min(size - off);
        if take == 0 {
            continue;
        }
        out.push(TransferRequest {
            opcode: Opcode::Read,
            source: addr,
            target_id: seg,
            target_offset: remote + off,
            length: take,
        });
        off += take;
    }
    out
}
