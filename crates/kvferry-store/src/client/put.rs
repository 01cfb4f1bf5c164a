//! Puts: reserving space at the master, writing every replica in one transfer batch, and
//! ending or revoking each reservation (across a failover too); the bytes API's puts stage
//! through the local buffer. Nothing here reads a value.

use super::rpc::{Conn, PutWrite};
use super::Client;
use crate::error::{StoreError, StoreResult};
use crate::proto::{ReplicateConfig, Request, Response};
use kvferry::{Opcode, TransferRequest};
use std::sync::atomic::Ordering;
use std::time::Instant;

impl Client {
    /// Writes `[addr, addr+len)` (registered memory) as `key`.
    pub fn put_from(
        &self,
        key: &str,
        addr: u64,
        len: u64,
        cfg: &ReplicateConfig,
    ) -> StoreResult<()> {
        self.batch_put_from_impl(&[(key, addr, len)], cfg, false)
            .pop()
            .unwrap_or_else(|| Err(StoreError::Internal("no result".into())))
    }

    /// Like [`Client::put_from`], replacing an existing value.
    pub fn upsert_from(
        &self,
        key: &str,
        addr: u64,
        len: u64,
        cfg: &ReplicateConfig,
    ) -> StoreResult<()> {
        self.batch_put_from_impl(&[(key, addr, len)], cfg, true)
            .pop()
            .unwrap_or_else(|| Err(StoreError::Internal("no result".into())))
    }

    /// Writes many values in one master round trip and one transfer batch.
    pub fn batch_put_from(
        &self,
        items: &[(&str, u64, u64)],
        cfg: &ReplicateConfig,
    ) -> Vec<StoreResult<()>> {
        self.batch_put_from_impl(items, cfg, false)
    }

    pub fn batch_upsert_from(
        &self,
        items: &[(&str, u64, u64)],
        cfg: &ReplicateConfig,
    ) -> Vec<StoreResult<()>> {
        self.batch_put_from_impl(items, cfg, true)
    }

    fn batch_put_from_impl(
        &self,
        items: &[(&str, u64, u64)],
        cfg: &ReplicateConfig,
        upsert: bool,
    ) -> Vec<StoreResult<()>> {
        let parts: Vec<[(u64, u64); 1]> = items.iter().map(|&(_, a, l)| [(a, l)]).collect();
        let items: Vec<(&str, &[(u64, u64)])> = items
            .iter()
            .zip(&parts)
            .map(|(&(k, _, _), p)| (k, &p[..]))
            .collect();
        self.batch_put_parts_impl(&items, cfg, upsert)
    }

    /// Stores, per key, the concatenation of its parts (`(addr, len)` ranges of registered
    /// memory, in order), each written straight into place in every replica: no copy however
    /// scattered the parts are (a KV cache's per-layer blocks).
    pub fn batch_put_from_parts(
        &self,
        items: &[(&str, &[(u64, u64)])],
        cfg: &ReplicateConfig,
        upsert: bool,
    ) -> Vec<StoreResult<()>> {
        self.batch_put_parts_impl(items, cfg, upsert)
    }

    fn batch_put_parts_impl(
        &self,
        items: &[(&str, &[(u64, u64)])],
        cfg: &ReplicateConfig,
        upsert: bool,
    ) -> Vec<StoreResult<()>> {
        if let Err(e) = self.check_open() {
            return items.iter().map(|_| Err(e.clone())).collect();
        }
        let id = self.inner.id;
        let total = |parts: &[(u64, u64)]| parts.iter().map(|p| p.1).sum::<u64>();
        let first = self
            .inner
            .next_put
            .fetch_add(items.len() as u64, Ordering::Relaxed)
            + 1;
        let puts: Vec<u64> = (first..first + items.len() as u64).collect();
        let starts: Vec<Request> = items
            .iter()
            .zip(&puts)
            .map(|(&(k, parts), &put)| Request::PutStart {
                client: id,
                key: k.to_string(),
                size: total(parts),
                config: cfg.clone(),
                upsert,
                put,
            })
            .collect();
        // The answers, and the leader that reserved the space (its epoch); a put ended under
        // another one may not be stored.
        let (answers, epoch) = match self.inner.call_batch_at(starts, Conn::Pool) {
            Ok(a) => a,
            Err(e) => {
                if e == StoreError::OutcomeUnknown {
                    self.revoke_unknown(items.iter().zip(&puts).map(|(&(k, _), &put)| (k, put)));
                }
                return items.iter().map(|_| Err(e.clone())).collect();
            }
        };
        let unknown = answers
            .iter()
            .zip(items.iter().zip(&puts))
            .filter(|(a, _)| **a == Response::Err(StoreError::OutcomeUnknown));
        self.revoke_unknown(unknown.map(|(_, (&(k, _), &put))| (k, put)));
        let mut results: Vec<StoreResult<()>> = Vec::with_capacity(items.len());
        let mut reqs = Vec::new();
        let mut owner = Vec::new(); // request index -> item index
                                    // Each replica's range (endpoint, address, length): what may still be landing.
        let mut writes: Vec<PutWrite> = Vec::new();
        // Every item the master reserved space for is ended or revoked: one whose replica's
        // segment could not be opened (nothing written) too; left, it refused every put of
        // the key until the discard timeout, which Mooncake's API reports as stored.
        let reserved: Vec<bool> = answers
            .iter()
            .map(|a| matches!(a, Response::Replicas(_)))
            .collect();
        for (i, (a, &(_, parts))) in answers.into_iter().zip(items).enumerate() {
            match a {
                Response::Replicas(reps) => {
                    let mut ok = Ok(());
                    for r in reps {
                        match self.segment_id(&r.te_endpoint) {
                            Ok(seg) => {
                                writes.push((r.te_endpoint, r.addr, total(parts)));
                                let mut off = 0;
                                for &(addr, len) in parts.iter().filter(|p| p.1 > 0) {
                                    reqs.push(TransferRequest {
                                        opcode: Opcode::Write,
                                        source: addr,
                                        target_id: seg,
                                        target_offset: r.addr + off,
                                        length: len,
                                    });
                                    owner.push(i);
                                    off += len;
                                }
                            }
                            Err(e) => ok = Err(e),
                        }
                    }
                    results.push(ok);
                }
                Response::Err(e) => results.push(Err(e)),
                other => results.push(Err(StoreError::Rpc(format!("unexpected answer {other:?}")))),
            }
        }
        if !reqs.is_empty() {
            // Until they landed, or (failed) until they can no longer land: what a master
            // that forgot this client is told ([`Writes`]).
            let started = Instant::now();
            let batch = self
                .inner
                .rpc
                .writes
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .start(writes, started + self.inner.cfg.transfer_timeout * 2);
            let landed = match self.transfer(&reqs) {
                Ok(statuses) => {
                    let mut all = true;
                    for (k, st) in statuses.into_iter().enumerate() {
                        if let Err(e) = st {
                            results[owner[k]] = Err(e);
                            all = false;
                        }
                    }
                    all
                }
                Err(e) => {
                    for &o in &owner {
                        results[o] = Err(e.clone());
                    }
                    false
                }
            };
            self.inner
                .rpc
                .writes
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .ended(batch, landed);
        }
        // Every reservation ends: written ones with a PutEnd, failed ones (a transfer error, a
        // replica whose segment did not open) with a PutRevoke.
        let ends: Vec<(usize, Request)> = items
            .iter()
            .enumerate()
            .filter(|(i, _)| reserved[*i])
            .map(|(i, &(k, _))| {
                let (key, put) = (k.to_string(), puts[i]);
                (
                    i,
                    if results[i].is_ok() {
                        Request::PutEnd {
                            client: id,
                            key,
                            put,
                        }
                    } else {
                        Request::PutRevoke {
                            client: id,
                            key,
                            put,
                        }
                    },
                )
            })
            .collect();
        let was_ok: Vec<bool> = ends.iter().map(|(i, _)| results[*i].is_ok()).collect();
        let (mut ended, end_epoch) = match self
            .inner
            .call_batch_at(ends.iter().map(|(_, r)| r.clone()).collect(), Conn::Pool)
        {
            Ok((a, e)) => (Ok(a), e),
            Err(e) => (Err(e), self.inner.rpc.epoch()),
        };
        // PutEnds whose outcome is unknown (their leader stopped leading, or the connection
        // failed, after they were sent) are sent once more, to the leader found now: the bytes
        // are in place, so one that knows the write in progress (from the journal or its
        // mirror) completes it; one that does not, or that the first PutEnd reached, answers an
        // error, and the outcome stays unknown.
        let unknown: Vec<usize> = match &ended {
            Ok(answers) => (0..ends.len())
                .filter(|&k| was_ok[k] && answers[k] == Response::Err(StoreError::OutcomeUnknown))
                .collect(),
            Err(StoreError::OutcomeUnknown) => (0..ends.len()).filter(|&k| was_ok[k]).collect(),
            Err(_) => Vec::new(),
        };
        if !unknown.is_empty() {
            let again: Vec<Request> = unknown.iter().map(|&k| ends[k].1.clone()).collect();
            if let Ok(answers) = self.call_batch(again) {
                let mut all = match ended {
                    Ok(a) => a,
                    Err(e) => ends.iter().map(|_| Response::Err(e.clone())).collect(),
                };
                for (&k, a) in unknown.iter().zip(answers) {
                    if a == Response::Ok {
                        all[k] = Response::Ok;
                    }
                }
                ended = Ok(all);
            }
        }
        // A failover between PutStart and PutEnd whose new leader does not know the write (it
        // started empty): the put failed; say so, it is worth retrying.
        let failed_over = end_epoch != epoch;
        // (Not when the outcome is unknown: the end may have reached the new leader.)
        let fail = |i: usize, e: StoreError| {
            if failed_over && e != StoreError::OutcomeUnknown {
                StoreError::MasterFailover(items[i].0.to_string())
            } else {
                e
            }
        };
        match ended {
            Ok(answers) => {
                for ((i, _), (a, ok)) in ends.iter().zip(answers.into_iter().zip(was_ok)) {
                    if let (Response::Err(e), true) = (a, ok) {
                        results[*i] = Err(fail(*i, e));
                    }
                }
            }
            Err(e) => {
                for (i, _) in &ends {
                    results[*i] = Err(fail(*i, e.clone()));
                }
            }
        }
        results
    }

    /// Puts whose start may or may not have reached the new leader
    /// ([`StoreError::OutcomeUnknown`]): revoked there, best effort, so that their keys are
    /// free for a retry at once instead of after the master's discard timeout (a revoke names
    /// the put, so it touches nothing else; one the leader does not know is an error,
    /// ignored).
    pub(super) fn revoke_unknown<'a>(&self, puts: impl Iterator<Item = (&'a str, u64)>) {
        let id = self.inner.id;
        let revokes: Vec<Request> = puts
            .map(|(key, put)| Request::PutRevoke {
                client: id,
                key: key.to_string(),
                put,
            })
            .collect();
        if revokes.is_empty() {
            return;
        }
        if let Err(e) = self.call_batch(revokes) {
            tracing::debug!(
                "store: revoking puts whose start may have reached the new leader: {e}"
            );
        }
    }

    /// Stores `value` as `key` (copied through the local buffer).
    pub fn put(&self, key: &str, value: &[u8], cfg: &ReplicateConfig) -> StoreResult<()> {
        self.put_batch(&[(key, value)], cfg, false)
            .pop()
            .unwrap_or_else(|| Err(StoreError::Internal("no result".into())))
    }

    /// Stores `value` as `key`, replacing an existing value.
    pub fn upsert(&self, key: &str, value: &[u8], cfg: &ReplicateConfig) -> StoreResult<()> {
        self.put_batch(&[(key, value)], cfg, true)
            .pop()
            .unwrap_or_else(|| Err(StoreError::Internal("no result".into())))
    }

    /// Stores several values; per-key results.
    pub fn put_batch(
        &self,
        items: &[(&str, &[u8])],
        cfg: &ReplicateConfig,
        upsert: bool,
    ) -> Vec<StoreResult<()>> {
        let mut staged = Vec::with_capacity(items.len());
        for (_, v) in items {
            match self.stage(v.len().max(1)) {
                Ok(s) => {
                    s.bytes()[..v.len()].copy_from_slice(v);
                    staged.push(Ok(s));
                }
                Err(e) => staged.push(Err(e)),
            }
        }
        let ok: Vec<(usize, (&str, u64, u64))> = items
            .iter()
            .zip(&staged)
            .enumerate()
            .filter_map(|(i, ((k, v), s))| {
                s.as_ref().ok().map(|s| (i, (*k, s.addr, v.len() as u64)))
            })
            .collect();
        let rs =
            self.batch_put_from_impl(&ok.iter().map(|(_, x)| *x).collect::<Vec<_>>(), cfg, upsert);
        let mut out: Vec<StoreResult<()>> = staged.into_iter().map(|s| s.map(|_| ())).collect();
        for ((i, _), r) in ok.iter().zip(rs) {
            out[*i] = r;
        }
        out
    }
}
