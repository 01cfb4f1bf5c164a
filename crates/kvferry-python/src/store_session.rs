//! Mooncake 0.3.14's put and get sessions and ranged-read snapshots over a [`StoreCore`]:
//! reservations and kept replica lists by key (`kvferry_store::client::session`); also the
//! segments a store mounts after setup (`allocate_and_mount_segment`).

use crate::store::{PyReplicate, StoreCore};
use kvferry_store::client::{Range, ReadLease, Reservation};
use kvferry_store::{Client, StoreError};
use pyo3::prelude::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Per-key results as the store's batch calls hand them to Python.
type Results<T> = Vec<(Option<T>, i32, String)>;

/// One store's open put reservations and kept replica lists, by key. Its calls hold no lock
/// while they talk to the master or move bytes (entries are shared, not borrowed).
#[pyclass(frozen, module = "kvferry._kvferry")]
pub(crate) struct StoreSessions {
    core: Py<StoreCore>,
    puts: Mutex<HashMap<String, Arc<Reservation>>>,
    gets: Mutex<HashMap<String, Arc<ReadLease>>>,
}

fn not_in(what: &str, key: &str) -> StoreError {
    StoreError::InvalidParams(format!("{key} is not in an open {what} of this store"))
}

fn ranges(v: &[(u64, u64, u64)]) -> Vec<Range> {
    v.iter()
        .map(|&(addr, len, off)| Range { addr, len, off })
        .collect()
}

impl StoreSessions {
    /// The entries of `keys` in `map` (an error for a key not there).
    fn entries<T>(
        map: &Mutex<HashMap<String, Arc<T>>>,
        keys: &[String],
        what: &str,
    ) -> Vec<Result<Arc<T>, StoreError>> {
        let m = map.lock().unwrap_or_else(|e| e.into_inner());
        keys.iter()
            .map(|k| m.get(k).cloned().ok_or_else(|| not_in(what, k)))
            .collect()
    }

    /// Runs `f` over the entries found (in one call) and merges its results with the errors
    /// of the keys not found.
    fn over_found<T, R: Send>(
        found: Vec<Result<Arc<T>, StoreError>>,
        f: impl FnOnce(&[&T]) -> Vec<Result<R, StoreError>>,
    ) -> Vec<Result<R, StoreError>> {
        let ok: Vec<&T> = found.iter().flatten().map(|a| &**a).collect();
        spread_back(&found, f(&ok))
    }

    fn on<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Client) -> Vec<Result<T, StoreError>> + Send,
    ) -> PyResult<Results<T>> {
        self.core.get().per_key(py, f)
    }
}

#[pymethods]
impl StoreSessions {
    #[new]
    fn new(core: Py<StoreCore>) -> Self {
        StoreSessions {
            core,
            puts: Mutex::default(),
            gets: Mutex::default(),
        }
    }

    /// Reserves each `(key, size)` (a put started, nothing written): per key None or an
    /// error. A key already reserved here keeps its reservation and fails.
    #[pyo3(signature = (keys, sizes, config=None))]
    fn put_start(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        sizes: Vec<u64>,
        config: Option<PyReplicate>,
    ) -> PyResult<Results<bool>> {
        let cfg = config.map(PyReplicate::into_config).unwrap_or_default();
        self.on(py, |c| {
            let items: Vec<(&str, u64)> = keys.iter().map(String::as_str).zip(sizes).collect();
            let res = c.reserve(&items, &cfg);
            let mut puts = self.puts.lock().unwrap_or_else(|e| e.into_inner());
            let mut out = Vec::with_capacity(res.len());
            let mut dup = Vec::new();
            for r in res {
                out.push(r.map(|r| {
                    if puts.contains_key(r.key()) {
                        dup.push(r);
                        return false;
                    }
                    puts.insert(r.key().to_string(), Arc::new(r));
                    true
                }));
            }
            drop(puts);
            // (A second reservation of a key reserved here: revoked, the first one kept.)
            let dups: Vec<&Reservation> = dup.iter().collect();
            let _ = c.revoke_reserved(&dups);
            out.into_iter()
                .zip(&keys)
                .map(|(r, k)| match r {
                    Ok(false) => Err(StoreError::ObjectAlreadyExists(k.clone())),
                    other => other,
                })
                .collect()
        })
    }

    /// Writes ranges `(local addr, len, offset in the value)` into each key's reservation:
    /// per key the bytes written.
    fn put_write(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        all_ranges: Vec<Vec<(u64, u64, u64)>>,
    ) -> PyResult<Results<u64>> {
        let found = Self::entries(&self.puts, &keys, "put session");
        let rs: Vec<Vec<Range>> = all_ranges.iter().map(|v| ranges(v)).collect();
        self.on(py, move |c| {
            per_found(&found, &rs, |items| c.write_reserved(items))
        })
    }

    /// Ends (`revoke=False`: the keys become readable) or revokes reservations; per key None
    /// or an error (a key not reserved here: -600).
    fn put_finish(&self, py: Python<'_>, keys: Vec<String>, revoke: bool) -> PyResult<Results<()>> {
        let found: Vec<Result<Arc<Reservation>, StoreError>> = {
            let mut m = self.puts.lock().unwrap_or_else(|e| e.into_inner());
            keys.iter()
                .map(|k| m.remove(k).ok_or_else(|| not_in("put session", k)))
                .collect()
        };
        self.on(py, move |c| {
            Self::over_found(found, |rs| match revoke {
                true => c.revoke_reserved(rs),
                false => c.end_reserved(rs),
            })
        })
    }

    /// Asks for the replica lists of `keys` and keeps them (a key kept already: its list is
    /// replaced); per key the value's size or an error.
    fn get_start(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<Results<u64>> {
        self.on(py, |c| {
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let got = c.lease_reads(&refs);
            let mut old = Vec::new();
            let out = {
                let mut m = self.gets.lock().unwrap_or_else(|e| e.into_inner());
                got.into_iter()
                    .map(|r| {
                        r.map(|l| {
                            let size = l.size();
                            if let Some(o) = m.insert(l.key().to_string(), Arc::new(l)) {
                                old.push(o);
                            }
                            size
                        })
                    })
                    .collect()
            };
            c.release_leases(old.iter().map(|a| &**a));
            out
        })
    }

    /// Reads ranges `(local addr, len, offset in the value)` of each kept key: per key the
    /// bytes read. Lists whose lease is half spent are asked for again first.
    fn get_read(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        all_ranges: Vec<Vec<(u64, u64, u64)>>,
    ) -> PyResult<Results<u64>> {
        let stale: Vec<String> = {
            let m = self.gets.lock().unwrap_or_else(|e| e.into_inner());
            keys.iter()
                .filter(|k| m.get(*k).is_some_and(|l| l.half_spent()))
                .cloned()
                .collect()
        };
        if !stale.is_empty() {
            // A key gone since is dropped from the kept lists, and reads as not kept.
            let gone = self.get_start(py, stale.clone())?;
            let mut m = self.gets.lock().unwrap_or_else(|e| e.into_inner());
            for (k, (_, code, _)) in stale.iter().zip(gone) {
                if code != 0 {
                    m.remove(k);
                }
            }
        }
        let found = Self::entries(&self.gets, &keys, "get session or snapshot");
        let rs: Vec<Vec<Range>> = all_ranges.iter().map(|v| ranges(v)).collect();
        self.on(py, move |c| {
            per_found(&found, &rs, |items| c.read_leased(items))
        })
    }

    /// Mounts `size` more bytes of the client's memory as a segment: (its id, its size).
    fn mount_more(&self, py: Python<'_>, size: u64) -> PyResult<(u64, u64)> {
        self.core.get().with(py, move |c| c.mount_more(size))
    }

    /// Unmounts a segment `mount_more` mounted; its memory is freed after `grace_s` seconds
    /// and the longest a transfer may still touch it.
    fn unmount_more(&self, py: Python<'_>, id: u64, grace_s: u64) -> PyResult<()> {
        self.core.get().with(py, move |c| {
            c.unmount_more(id, std::time::Duration::from_secs(grace_s))
        })
    }

    /// Releases the kept lists of `keys` (all when None).
    #[pyo3(signature = (keys=None))]
    fn get_end(&self, py: Python<'_>, keys: Option<Vec<String>>) -> PyResult<()> {
        let gone: Vec<Arc<ReadLease>> = {
            let mut m = self.gets.lock().unwrap_or_else(|e| e.into_inner());
            match keys {
                Some(keys) => keys.iter().filter_map(|k| m.remove(k)).collect(),
                None => m.drain().map(|(_, l)| l).collect(),
            }
        };
        if gone.is_empty() {
            return Ok(());
        }
        self.core.get().with(py, move |c| {
            c.release_leases(gone.iter().map(|a| &**a));
            Ok(())
        })
    }
}

/// Calls `f` with the ranges of each key `found` (in order, keys not found left out) and
/// gives per key its result, or the error that found nothing for it.
fn per_found<T, R>(
    found: &[Result<Arc<T>, StoreError>],
    rs: &[Vec<Range>],
    f: impl FnOnce(&[(&T, &[Range])]) -> Vec<Result<R, StoreError>>,
) -> Vec<Result<R, StoreError>> {
    let items: Vec<(&T, &[Range])> = found
        .iter()
        .zip(rs)
        .filter_map(|(e, r)| e.as_ref().ok().map(|a| (&**a, &r[..])))
        .collect();
    spread_back(found, f(&items))
}

/// Per key of `found`, the next of `done` (the results of the keys found, in order) or the
/// error that found nothing for it.
fn spread_back<T, R>(
    found: &[Result<Arc<T>, StoreError>],
    done: Vec<Result<R, StoreError>>,
) -> Vec<Result<R, StoreError>> {
    let mut done = done.into_iter();
    found
        .iter()
        .map(|e| match e {
            Ok(_) => done
                .next()
                .unwrap_or_else(|| Err(StoreError::Internal("no result".into()))),
            Err(e) => Err(e.clone()),
        })
        .collect()
}
