//! Calls by key that move no bytes: whether keys exist, a value's size, where replicas
//! live, removals and replica clears, each one round trip to the master. Nothing here
//! touches the transfer engine.

use super::Client;
use crate::error::{StoreError, StoreResult};
use crate::proto::{DiskDesc, ReplicaDesc, Request, Response};

/// One copy of a value ([`Client::batch_get_replicas`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Replica {
    /// In a segment's memory.
    Memory(ReplicaDesc),
    /// On a client's disk (Mooncake's `LOCAL_DISK` replica): `endpoint` is the owner's engine.
    LocalDisk(DiskDesc),
}

impl Client {
    pub fn is_exist(&self, key: &str) -> StoreResult<bool> {
        match self.inner.call_one(Request::ExistKey {
            key: key.to_string(),
        })? {
            Response::Exists(b) => Ok(b),
            other => Err(StoreError::Rpc(format!("unexpected answer {other:?}"))),
        }
    }

    pub fn batch_is_exist(&self, keys: &[&str]) -> Vec<StoreResult<bool>> {
        self.exists_batch(
            keys,
            keys.iter()
                .map(|k| Request::ExistKey { key: k.to_string() })
                .collect(),
        )
    }

    fn exists_batch(&self, keys: &[&str], reqs: Vec<Request>) -> Vec<StoreResult<bool>> {
        match self.call_batch(reqs) {
            Ok(v) => v
                .into_iter()
                .map(|a| match a {
                    Response::Exists(b) => Ok(b),
                    Response::Err(e) => Err(e),
                    other => Err(StoreError::Rpc(format!("unexpected answer {other:?}"))),
                })
                .collect(),
            Err(e) => keys.iter().map(|_| Err(e.clone())).collect(),
        }
    }

    /// Whether `key` is readable now, without a read lease (Mooncake 0.3.14's `probe_key`):
    /// the object may go (be removed or evicted) before a later get.
    pub fn probe_key(&self, key: &str) -> StoreResult<bool> {
        match self.inner.call_one(Request::ProbeKey {
            key: key.to_string(),
        })? {
            Response::Exists(b) => Ok(b),
            other => Err(StoreError::Rpc(format!("unexpected answer {other:?}"))),
        }
    }

    /// [`Client::probe_key`] for several keys in one round trip.
    pub fn batch_probe_key(&self, keys: &[&str]) -> Vec<StoreResult<bool>> {
        self.exists_batch(
            keys,
            keys.iter()
                .map(|k| Request::ProbeKey { key: k.to_string() })
                .collect(),
        )
    }

    /// Size of `key`'s value.
    pub fn get_size(&self, key: &str) -> StoreResult<u64> {
        match self.inner.call_one(Request::GetReplicaList {
            key: key.to_string(),
        })? {
            Response::ReplicaList(l) => {
                self.inner.queue_releases([l.read_id]);
                Ok(l.size)
            }
            Response::DiskReplica(d) => {
                self.inner.queue_releases([d.read_id]);
                Ok(d.size)
            }
            other => Err(StoreError::Rpc(format!("unexpected answer {other:?}"))),
        }
    }

    pub fn remove(&self, key: &str, force: bool) -> StoreResult<()> {
        self.inner
            .call_one(Request::Remove {
                key: key.to_string(),
                force,
            })
            .map(|_| ())
    }

    pub fn remove_by_regex(&self, pattern: &str, force: bool) -> StoreResult<u64> {
        match self.inner.call_one(Request::RemoveByRegex {
            pattern: pattern.to_string(),
            force,
        })? {
            Response::Count(n) => Ok(n),
            other => Err(StoreError::Rpc(format!("unexpected answer {other:?}"))),
        }
    }

    /// Removes several keys in one round trip; per-key results (Mooncake's `batch_remove`).
    pub fn batch_remove(&self, keys: &[&str], force: bool) -> Vec<StoreResult<()>> {
        match self.call_batch(
            keys.iter()
                .map(|k| Request::Remove {
                    key: k.to_string(),
                    force,
                })
                .collect(),
        ) {
            Ok(v) => v.into_iter().map(|a| a.into_result().map(|_| ())).collect(),
            Err(e) => keys.iter().map(|_| Err(e.clone())).collect(),
        }
    }

    /// Where the memory replicas of each key live (Mooncake's `batch_get_replica_desc`,
    /// memory replicas only: a key whose only copy is on a disk has none; see
    /// [`Client::batch_get_replicas`]).
    pub fn batch_get_replica_desc(&self, keys: &[&str]) -> Vec<StoreResult<Vec<ReplicaDesc>>> {
        self.batch_get_replicas(keys)
            .into_iter()
            .map(|r| {
                r.map(|v| {
                    v.into_iter()
                        .filter_map(|x| match x {
                            Replica::Memory(d) => Some(d),
                            Replica::LocalDisk(_) => None,
                        })
                        .collect()
                })
            })
            .collect()
    }

    /// Where each key's copies live, as Mooncake's `batch_get_replica_desc` lists them: its
    /// memory replicas, or when none is left its copy on a client's disk (`LOCAL_DISK`, named
    /// by the owner's engine). Nothing is read, so the read granted with the answer is
    /// released at once.
    pub fn batch_get_replicas(&self, keys: &[&str]) -> Vec<StoreResult<Vec<Replica>>> {
        match self.replica_lists(keys.iter().copied()) {
            Ok((v, _)) => v
                .into_iter()
                .map(|a| match a {
                    Response::ReplicaList(l) => {
                        self.inner.queue_releases([l.read_id]);
                        Ok(l.replicas.into_iter().map(Replica::Memory).collect())
                    }
                    Response::DiskReplica(d) => {
                        self.inner.queue_releases([d.read_id]);
                        Ok(vec![Replica::LocalDisk(d.disk)])
                    }
                    Response::Err(e) => Err(e),
                    other => Err(StoreError::Rpc(format!("unexpected answer {other:?}"))),
                })
                .collect(),
            Err(e) => keys.iter().map(|_| Err(e.clone())).collect(),
        }
    }

    /// Mooncake's `batch_replica_clear`: drops the replicas of `keys` that this client wrote
    /// and nobody holds a lease on, on the segment named `segment` (everywhere if empty);
    /// returns the keys cleared (the others are skipped, as Mooncake does).
    pub fn batch_replica_clear(&self, keys: &[&str], segment: &str) -> StoreResult<Vec<String>> {
        let req = Request::BatchReplicaClear {
            client: self.inner.id,
            keys: keys.iter().map(|k| k.to_string()).collect(),
            segment: segment.to_string(),
        };
        match self.inner.call_one(req)? {
            Response::Keys(k) => Ok(k),
            other => Err(StoreError::Rpc(format!("unexpected answer {other:?}"))),
        }
    }

    pub fn remove_all(&self, force: bool) -> StoreResult<u64> {
        match self.inner.call_one(Request::RemoveAll { force })? {
            Response::Count(n) => Ok(n),
            other => Err(StoreError::Rpc(format!("unexpected answer {other:?}"))),
        }
    }
}
