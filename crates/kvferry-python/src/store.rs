//! `StoreCore`: the store client for Python (integer addresses only; the Python package
//! `kvferry.store` and `kvferry.mooncake.store` build the public APIs on it).
//!
//! Every call that talks to the master or moves data releases the GIL. Failures raise the
//! exception class of `kvferry.store` named after the error (`ObjectNotFound`, …), carrying
//! Mooncake Store's numeric code as `.code`.

use kvferry_store::client::copy_out::{copy_fresh, FreshCopy};
use kvferry_store::{Client, ClientConfig, Replica, ReplicateConfig, SoftPin, StoreError};
use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyByteArray, PyBytes, PyModule};
use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::sync::{Mutex, RwLock};
use std::time::Duration;

/// One key's outcome in a batch: the value (if found), a Mooncake error code and a message.
type KeyResult = (Option<Py<PyBytes>>, i32, String);
/// Per key: an object holding the value (or None), the error code and message.
type KeyObject = (Option<Py<PyAny>>, i32, String);
/// Per key: its replicas as (segment, address, size), or None with the error code and message.
type ReplicaDescResult = (Option<Vec<(String, u64, u64, bool)>>, i32, String);

static STORE_MODULE: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

fn class_of(e: &StoreError) -> &'static str {
    match e {
        StoreError::ObjectNotFound(_) => "ObjectNotFound",
        StoreError::ObjectAlreadyExists(_) => "ObjectAlreadyExists",
        StoreError::ObjectHasLease(_) => "ObjectHasLease",
        StoreError::LeaseExpired(_) => "LeaseExpired",
        StoreError::ReplicaNotReady(_) => "ReplicaNotReady",
        StoreError::NoAvailableHandle { .. } => "NoAvailableHandle",
        StoreError::InvalidKey(_)
        | StoreError::InvalidParams(_)
        | StoreError::BufferOverflow { .. } => "StoreInvalidArgument",
        StoreError::SegmentNotFound(_)
        | StoreError::SegmentAlreadyExists(_)
        | StoreError::UnknownClient(_) => "StoreError",
        StoreError::TransferFailed(_) => "StoreTransferError",
        StoreError::Rpc(_)
        | StoreError::NotLeader { .. }
        | StoreError::MasterFailover(_)
        | StoreError::OutcomeUnknown => "MasterUnreachable",
        StoreError::Internal(_) | StoreError::Unauthorized(_) => "StoreError",
        StoreError::ObjectHasReplicationTask(_)
        | StoreError::ObjectNoReplicationTask(_)
        | StoreError::ReplicaNotFound(_)
        | StoreError::TaskNotFound(_)
        | StoreError::TaskPendingLimitExceeded(_)
        | StoreError::IllegalClient(_) => "StoreError",
    }
}

fn raise(py: Python<'_>, e: StoreError) -> PyErr {
    let msg = e.to_string();
    let module =
        match STORE_MODULE.get_or_try_init(py, || py.import("kvferry.store").map(Bound::unbind)) {
            Ok(m) => m.bind(py),
            Err(err) => {
                return PyRuntimeError::new_err(format!(
                    "{msg} (and kvferry.store could not be imported: {err})"
                ))
            }
        };
    match module
        .getattr(class_of(&e))
        .and_then(|cls| cls.call1((msg, e.code())))
    {
        Ok(exc) => PyErr::from_value(exc),
        Err(err) => err,
    }
}

fn closed() -> StoreError {
    StoreError::InvalidParams("the store is closed".into())
}

/// Replication settings as the tuple `ReplicateConfig._native()` builds:
/// (replica_num, soft_pin action 0/1/2, soft_pin_ttl_ms, with_hard_pin, preferred_segments, group_id).
#[derive(Clone, Debug, FromPyObject)]
pub struct PyReplicate(u32, u8, Option<u64>, bool, Vec<String>, Option<String>);

impl PyReplicate {
    pub(crate) fn into_config(self) -> ReplicateConfig {
        let PyReplicate(
            replica_num,
            soft_pin,
            soft_pin_ttl_ms,
            with_hard_pin,
            preferred_segments,
            group_id,
        ) = self;
        ReplicateConfig {
            replica_num,
            soft_pin: match soft_pin {
                1 => SoftPin::Enable,
                2 => SoftPin::Disable,
                _ => SoftPin::Preserve,
            },
            soft_pin_ttl_ms,
            with_hard_pin,
            preferred_segments,
            group_id: group_id.filter(|g| !g.is_empty()),
        }
    }
}

fn config(r: Option<PyReplicate>) -> ReplicateConfig {
    r.map(PyReplicate::into_config).unwrap_or_default()
}

/// A store client. Thread-safe; `close()` releases it.
#[pyclass(frozen, module = "kvferry._kvferry")]
pub struct StoreCore {
    client: RwLock<Option<Client>>,
    /// The engine object this client shares (`engine=`), kept alive as long as the client.
    _engine: Option<Py<crate::Core>>,
    /// What keeps registered buffer objects alive and exported, by address: dropped after
    /// `unregister_buffer` returned or the client stopped.
    pins: Mutex<HashMap<u64, Py<PyAny>>>,
    /// Buffers handed out by `alloc_from_mem_pool`: kept until this object goes (not at
    /// `close()`: the caller may still hold their addresses).
    pool: Mutex<Vec<crate::memory::Pages>>,
    /// The process that created the client: in a fork() child every method raises and
    /// dropping only forgets (the segment, its engine and the master session are the parent's).
    pid: u32,
}

impl StoreCore {
    fn owned(&self, py: Python<'_>) -> PyResult<()> {
        if std::process::id() != self.pid {
            return Err(raise(
                py,
                StoreError::InvalidParams(format!(
                    "this store client belongs to process {} (it was inherited through fork() by process {}); create a new one in the child",
                    self.pid,
                    std::process::id()
                )),
            ));
        }
        Ok(())
    }

    pub(crate) fn with<T>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Client) -> Result<T, StoreError> + Send,
    ) -> PyResult<T>
    where
        T: Send,
    {
        self.owned(py)?;
        let r = py.detach(|| {
            let g = self.client.read().unwrap_or_else(|e| e.into_inner());
            match g.as_ref() {
                Some(c) => f(c),
                None => Err(closed()),
            }
        });
        r.map_err(|e| raise(py, e))
    }

    /// Like `with`, but hands per-key results back to Python as (value | None, code, message).
    pub(crate) fn per_key<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Client) -> Vec<Result<T, StoreError>> + Send,
    ) -> PyResult<Vec<(Option<T>, i32, String)>> {
        self.owned(py)?;
        let r = py.detach(|| {
            let g = self.client.read().unwrap_or_else(|e| e.into_inner());
            g.as_ref().map(f)
        });
        match r {
            None => Err(raise(py, closed())),
            Some(v) => Ok(v
                .into_iter()
                .map(|x| match x {
                    Ok(t) => (Some(t), 0, String::new()),
                    Err(e) => (None, e.code(), format!("{}: {}", class_of(&e), e)),
                })
                .collect()),
        }
    }
}

/// Below this many bytes in all, `bytes_of` copies holding the GIL (releasing and taking it
/// back costs more than such a copy).
const DETACH_FROM: usize = 256 << 10;

/// New `bytes` objects holding `vals`, each copied once from where it landed in the local
/// buffer: the objects are made with their storage not yet written (no zeroing pass), then
/// filled by `copy_fresh` (fresh pages faulted in first, a large call split among threads),
/// without the GIL for a large call: no Python code can see the objects before this returns.
fn bytes_of(py: Python<'_>, vals: &[&kvferry_store::Staged]) -> PyResult<Vec<Py<PyBytes>>> {
    let mut objs = Vec::with_capacity(vals.len());
    let mut copies = Vec::with_capacity(vals.len());
    let mut total = 0usize;
    for v in vals {
        let len = v.len();
        if len == 0 {
            objs.push(PyBytes::new(py, b"").unbind());
            continue;
        }
        let n = pyo3::ffi::Py_ssize_t::try_from(len).map_err(|_| {
            PyRuntimeError::new_err(format!(
                "a value of {len} bytes is too large for a bytes object"
            ))
        })?;
        // SAFETY: we hold the GIL; a NULL source asks CPython for a new bytes object of `n`
        // bytes left for its creator to fill (NULL with the error set on failure, which
        // from_owned_ptr_or_err turns into the Python error), which is a `bytes`.
        let obj = unsafe {
            Bound::from_owned_ptr_or_err(
                py,
                pyo3::ffi::PyBytes_FromStringAndSize(std::ptr::null(), n),
            )?
            .cast_into_unchecked::<PyBytes>()
        };
        // SAFETY: the storage of the object just made (a non-empty one: never a shared
        // singleton), `len` bytes, which only this function can reach: the object lives in
        // `objs` until the copies end, and is handed to Python code only after.
        let dst = unsafe {
            std::slice::from_raw_parts_mut(
                pyo3::ffi::PyBytes_AsString(obj.as_ptr()).cast::<MaybeUninit<u8>>(),
                len,
            )
        };
        copies.push(FreshCopy::uninit(v.as_slice(), dst));
        objs.push(obj.unbind());
        total += len;
    }
    if total >= DETACH_FROM {
        py.detach(move || copy_fresh(copies));
    } else {
        copy_fresh(copies);
    }
    Ok(objs)
}

#[pymethods]
impl StoreCore {
    #[new]
    #[pyo3(signature = (local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol, device_name, master_server_addr, engine = None, ssd_offload_path = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        local_hostname: String,
        metadata_server: String,
        global_segment_size: u64,
        local_buffer_size: u64,
        protocol: String,
        device_name: String,
        master_server_addr: String,
        engine: Option<Py<crate::Core>>,
        ssd_offload_path: Option<String>,
    ) -> PyResult<Self> {
        let mut cfg = ClientConfig {
            local_hostname,
            metadata_server,
            global_segment_size,
            local_buffer_size,
            protocol,
            device_name,
            master_server_addr,
            ping_interval: Duration::from_secs(1),
            transfer_timeout: Duration::from_secs(60),
            ..ClientConfig::default()
        };
        if let Some(path) = ssd_offload_path {
            // Mooncake's enable_ssd_offload=True (its MOONCAKE_OFFLOAD_* variables too).
            cfg.enable_ssd_offload(&path, &|k| std::env::var(k).ok())
                .map_err(|e| raise(py, e))?;
        }
        let client = match &engine {
            // Mooncake's setup(..., engine): the store mounts the engine's own segment.
            Some(core) => {
                let (shared, flag) = core.get().share(py)?;
                py.detach(|| Client::with_engine(cfg, shared, Some(flag)))
            }
            None => py.detach(|| Client::setup(cfg)),
        }
        .map_err(|e| raise(py, e))?;
        Ok(StoreCore {
            client: RwLock::new(Some(client)),
            _engine: engine,
            pins: Mutex::default(),
            pool: Mutex::default(),
            pid: std::process::id(),
        })
    }

    /// Mooncake's `alloc_from_mem_pool`: `size` bytes of zero-filled, page-aligned memory
    /// from kvferry's allocator (memfd-backed, so same-host peers map it), not registered;
    /// its address, valid until this object is garbage-collected.
    fn alloc_from_mem_pool(&self, py: Python<'_>, size: u64) -> PyResult<u64> {
        self.owned(py)?;
        let pages =
            crate::memory::Pages::map(size).map_err(|m| raise(py, StoreError::InvalidParams(m)))?;
        let addr = pages.addr;
        self.pool
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(pages);
        Ok(addr)
    }

    /// In a `fork()` child: the inherited client's engine lets go of the parent's sockets
    /// (`Client::release_inherited`); nothing in the creating process. Called by the
    /// package's at-fork handler.
    fn release_inherited(&self) {
        if std::process::id() == self.pid {
            return;
        }
        // try_read: a thread of the parent may have held the lock at the fork.
        if let Ok(Some(c)) = self.client.try_read().as_deref() {
            c.release_inherited();
        }
    }

    /// This client's transfer-engine segment name.
    fn segment_name(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, |c| Ok(c.segment_name().to_string()))
    }

    /// Registers local memory; `pin` (if any) is held until it is unregistered.
    #[pyo3(signature = (addr, size, pin = None))]
    fn register_buffer(
        &self,
        py: Python<'_>,
        addr: u64,
        size: u64,
        pin: Option<Py<PyAny>>,
    ) -> PyResult<()> {
        self.with(py, |c| c.register_buffer(addr, size))?;
        if let Some(p) = pin {
            if let Some(old) = self
                .pins
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(addr, p)
            {
                old.drop_ref(py);
            }
        }
        Ok(())
    }

    fn unregister_buffer(&self, py: Python<'_>, addr: u64) -> PyResult<()> {
        self.with(py, |c| c.unregister_buffer(addr))?;
        let pin = self
            .pins
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&addr);
        if let Some(p) = pin {
            p.drop_ref(py);
        }
        Ok(())
    }

    #[pyo3(signature = (key, value, config=None, upsert=false))]
    fn put(
        &self,
        py: Python<'_>,
        key: String,
        value: Vec<u8>,
        config: Option<PyReplicate>,
        upsert: bool,
    ) -> PyResult<()> {
        let cfg = self::config(config);
        self.with(py, move |c| {
            if upsert {
                c.upsert(&key, &value, &cfg)
            } else {
                c.put(&key, &value, &cfg)
            }
        })
    }

    #[pyo3(signature = (keys, values, config=None, upsert=false))]
    fn put_batch(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        values: Vec<Vec<u8>>,
        config: Option<PyReplicate>,
        upsert: bool,
    ) -> PyResult<Vec<(Option<()>, i32, String)>> {
        if keys.len() != values.len() {
            return Err(raise(
                py,
                StoreError::InvalidParams(format!(
                    "{} keys but {} values",
                    keys.len(),
                    values.len()
                )),
            ));
        }
        let cfg = self::config(config);
        self.per_key(py, move |c| {
            let items: Vec<(&str, &[u8])> = keys
                .iter()
                .map(String::as_str)
                .zip(values.iter().map(Vec::as_slice))
                .collect();
            c.put_batch(&items, &cfg, upsert)
        })
    }

    /// The value as `bytes`, copied once from where it landed in the local buffer
    /// (`bytes_of`).
    fn get<'py>(&self, py: Python<'py>, key: String) -> PyResult<Bound<'py, PyBytes>> {
        let r = self.with(py, move |c| {
            c.get_buffers(&[key.as_str()])
                .pop()
                .unwrap_or_else(|| Err(StoreError::Internal("no result".into())))
        })?;
        let b = bytes_of(py, &[&r])?.pop();
        b.map(|b| b.into_bound(py))
            .ok_or_else(|| PyRuntimeError::new_err("get: no bytes object was made"))
    }

    /// Per key: the value as `bytes` (`bytes_of`), or None with the error code and message.
    fn get_batch(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<Vec<KeyResult>> {
        let r = self.per_key(py, move |c| {
            c.get_buffers(&keys.iter().map(String::as_str).collect::<Vec<_>>())
        })?;
        let found: Vec<&kvferry_store::Staged> =
            r.iter().filter_map(|(v, _, _)| v.as_ref()).collect();
        let mut objs = bytes_of(py, &found)?.into_iter();
        Ok(r.into_iter()
            .map(|(v, code, msg)| (v.and_then(|_| objs.next()), code, msg))
            .collect())
    }

    /// Per key: a new instance of `cls` (a `bytearray` subclass, called with no arguments)
    /// holding the value, or None with the error code and message. The value is copied once,
    /// from where it landed in the local buffer straight into the new object's storage
    /// (Mooncake's `batch_get_buffer`; before, it went through a `Vec` and `bytes` too).
    fn get_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        cls: Bound<'_, PyAny>,
    ) -> PyResult<Vec<KeyObject>> {
        let r = self.per_key(py, move |c| {
            c.get_buffers(&keys.iter().map(String::as_str).collect::<Vec<_>>())
        })?;
        let mut out = Vec::with_capacity(r.len());
        // Every object made first (`cls()` runs Python code), then every value copied at
        // once, still holding the GIL (`copy_fresh`: a large call split among threads).
        let mut fill: Vec<(Bound<'_, PyByteArray>, &kvferry_store::Staged)> = Vec::new();
        for (v, code, msg) in &r {
            let Some(v) = v else {
                out.push((None, *code, msg.clone()));
                continue;
            };
            let obj = cls.call0()?;
            let ba = obj.cast::<PyByteArray>().map_err(|_| {
                PyTypeError::new_err("get_buffers: cls() must return a bytearray (subclass)")
            })?;
            ba.resize(v.len())?;
            fill.push((ba.clone(), v));
            out.push((Some(obj.unbind()), 0, String::new()));
        }
        let copies = fill
            .iter()
            .map(|(ba, v)| {
                // SAFETY: each `ba` was resized above, and no Python code has run since the
                // last `cls()` (we hold the GIL until the copies end): nothing can resize or
                // free its storage while we copy into it. (Distinct objects: distinct
                // storage, borrowed once each.)
                FreshCopy::new(v.as_slice(), unsafe { ba.as_bytes_mut() })
            })
            .collect();
        copy_fresh(copies);
        Ok(out)
    }

    #[pyo3(signature = (key, addr, size, config=None, upsert=false))]
    fn put_from(
        &self,
        py: Python<'_>,
        key: String,
        addr: u64,
        size: u64,
        config: Option<PyReplicate>,
        upsert: bool,
    ) -> PyResult<()> {
        let cfg = self::config(config);
        self.with(py, move |c| {
            if upsert {
                c.upsert_from(&key, addr, size, &cfg)
            } else {
                c.put_from(&key, addr, size, &cfg)
            }
        })
    }

    fn get_into(&self, py: Python<'_>, key: String, addr: u64, size: u64) -> PyResult<u64> {
        self.with(py, move |c| c.get_into(&key, addr, size))
    }

    #[pyo3(signature = (keys, addrs, sizes, config=None, upsert=false))]
    fn batch_put_from(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        addrs: Vec<u64>,
        sizes: Vec<u64>,
        config: Option<PyReplicate>,
        upsert: bool,
    ) -> PyResult<Vec<(Option<()>, i32, String)>> {
        if keys.len() != addrs.len() || keys.len() != sizes.len() {
            return Err(raise(
                py,
                StoreError::InvalidParams(
                    "keys, buffers and sizes must have the same length".into(),
                ),
            ));
        }
        let cfg = self::config(config);
        self.per_key(py, move |c| {
            let items: Vec<(&str, u64, u64)> = keys
                .iter()
                .zip(addrs.iter().zip(&sizes))
                .map(|(k, (a, s))| (k.as_str(), *a, *s))
                .collect();
            if upsert {
                c.batch_upsert_from(&items, &cfg)
            } else {
                c.batch_put_from(&items, &cfg)
            }
        })
    }

    fn batch_get_into(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        addrs: Vec<u64>,
        sizes: Vec<u64>,
    ) -> PyResult<Vec<(Option<u64>, i32, String)>> {
        if keys.len() != addrs.len() || keys.len() != sizes.len() {
            return Err(raise(
                py,
                StoreError::InvalidParams(
                    "keys, buffers and sizes must have the same length".into(),
                ),
            ));
        }
        self.per_key(py, move |c| {
            let items: Vec<(&str, u64, u64)> = keys
                .iter()
                .zip(addrs.iter().zip(&sizes))
                .map(|(k, (a, s))| (k.as_str(), *a, *s))
                .collect();
            c.batch_get_into(&items)
        })
    }

    /// Per key, its parts (`ptrs[i][j]`, `sizes[i][j]`) put as one value, each written
    /// straight from registered memory into the replica.
    #[pyo3(signature = (keys, ptrs, sizes, config=None, upsert=false))]
    fn batch_put_from_parts(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ptrs: Vec<Vec<u64>>,
        sizes: Vec<Vec<u64>>,
        config: Option<PyReplicate>,
        upsert: bool,
    ) -> PyResult<Vec<(Option<()>, i32, String)>> {
        let parts = zip_parts(py, keys.len(), ptrs, sizes)?;
        let cfg = self::config(config);
        self.per_key(py, move |c| {
            let items: Vec<(&str, &[(u64, u64)])> = keys
                .iter()
                .zip(&parts)
                .map(|(k, p)| (k.as_str(), &p[..]))
                .collect();
            c.batch_put_from_parts(&items, &cfg, upsert)
        })
    }

    /// Per key, its value read across its parts in order, each straight from the replica;
    /// the value's size.
    fn batch_get_into_parts(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ptrs: Vec<Vec<u64>>,
        sizes: Vec<Vec<u64>>,
    ) -> PyResult<Vec<(Option<u64>, i32, String)>> {
        let parts = zip_parts(py, keys.len(), ptrs, sizes)?;
        self.per_key(py, move |c| {
            let items: Vec<(&str, &[(u64, u64)])> = keys
                .iter()
                .zip(&parts)
                .map(|(k, p)| (k.as_str(), &p[..]))
                .collect();
            c.batch_get_into_parts(&items)
        })
    }

    /// Per list of parts: whether every part lies in memory registered with this store's
    /// engine (then it can move without a copy).
    fn parts_registered(
        &self,
        py: Python<'_>,
        ptrs: Vec<Vec<u64>>,
        sizes: Vec<Vec<u64>>,
    ) -> PyResult<Vec<bool>> {
        let n = ptrs.len();
        let parts = zip_parts(py, n, ptrs, sizes)?;
        self.with(py, move |c| {
            Ok(parts
                .iter()
                .map(|p| {
                    p.iter()
                        .all(|&(a, l)| l == 0 || c.engine().is_registered(a, l))
                })
                .collect())
        })
    }

    fn is_exist(&self, py: Python<'_>, key: String) -> PyResult<bool> {
        self.with(py, move |c| c.is_exist(&key))
    }

    fn batch_is_exist(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
    ) -> PyResult<Vec<(Option<bool>, i32, String)>> {
        self.per_key(py, move |c| {
            c.batch_is_exist(&keys.iter().map(String::as_str).collect::<Vec<_>>())
        })
    }

    /// Mooncake 0.3.14's `probe_key`: whether `key` is readable, granting no read lease.
    fn probe_key(&self, py: Python<'_>, key: String) -> PyResult<bool> {
        self.with(py, move |c| c.probe_key(&key))
    }

    fn batch_probe_key(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
    ) -> PyResult<Vec<(Option<bool>, i32, String)>> {
        self.per_key(py, move |c| {
            c.batch_probe_key(&keys.iter().map(String::as_str).collect::<Vec<_>>())
        })
    }

    fn get_size(&self, py: Python<'_>, key: String) -> PyResult<u64> {
        self.with(py, move |c| c.get_size(&key))
    }

    #[pyo3(signature = (key, force=false))]
    fn remove(&self, py: Python<'_>, key: String, force: bool) -> PyResult<()> {
        self.with(py, move |c| c.remove(&key, force))
    }

    #[pyo3(signature = (pattern, force=false))]
    fn remove_by_regex(&self, py: Python<'_>, pattern: String, force: bool) -> PyResult<u64> {
        self.with(py, move |c| c.remove_by_regex(&pattern, force))
    }

    #[pyo3(signature = (force=false))]
    fn remove_all(&self, py: Python<'_>, force: bool) -> PyResult<u64> {
        self.with(py, move |c| c.remove_all(force))
    }

    /// Mooncake's `create_copy_task`: the task's id, a pair of 64-bit halves.
    fn create_copy_task(
        &self,
        py: Python<'_>,
        key: String,
        targets: Vec<String>,
    ) -> PyResult<(u64, u64)> {
        self.with(py, move |c| c.create_copy_task(&key, &targets))
    }

    /// Mooncake's `create_move_task`: the task's id.
    fn create_move_task(
        &self,
        py: Python<'_>,
        key: String,
        source: String,
        target: String,
    ) -> PyResult<(u64, u64)> {
        self.with(py, move |c| c.create_move_task(&key, &source, &target))
    }

    /// Mooncake's `query_task`: (id, type 0 copy / 1 move, status 0 PENDING / 1 PROCESSING /
    /// 2 FAILED / 3 SUCCESS, created and last updated in ms since the epoch, assigned client
    /// as a pair, message).
    #[allow(clippy::type_complexity)]
    fn query_task(
        &self,
        py: Python<'_>,
        id: (u64, u64),
    ) -> PyResult<((u64, u64), u8, u8, i64, i64, (u64, u64), String)> {
        self.with(py, move |c| {
            let q = c.query_task(id)?;
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as i64);
            let ago = |ms: u64| now.saturating_sub(ms as i64);
            Ok((
                q.id,
                q.kind as u8,
                q.status as u8,
                ago(q.created_ago_ms),
                ago(q.updated_ago_ms),
                (0, q.assigned_client),
                q.message,
            ))
        })
    }

    /// Where each key's replicas live (Mooncake's `batch_get_replica_desc`): per key a list of
    /// (transfer-engine segment, address, size, on a disk), one entry per complete replica; a
    /// copy on a client's disk (`LOCAL_DISK`) names the owner's engine and address 0.
    fn batch_get_replica_desc(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
    ) -> PyResult<Vec<ReplicaDescResult>> {
        self.per_key(py, move |c| {
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            c.batch_get_replicas(&refs)
                .into_iter()
                .map(|r| {
                    r.map(|v| {
                        v.into_iter()
                            .map(|d| match d {
                                Replica::Memory(d) => (d.te_endpoint, d.addr, d.size, false),
                                Replica::LocalDisk(d) => (d.endpoint, 0, d.size, true),
                            })
                            .collect()
                    })
                })
                .collect()
        })
    }

    /// Clears replicas of `keys` written by this client (Mooncake's rules: one segment's
    /// replicas, or every replica when `segment` is empty); returns the keys cleared.
    #[pyo3(signature = (keys, segment=String::new()))]
    fn batch_replica_clear(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        segment: String,
    ) -> PyResult<Vec<String>> {
        self.with(py, move |c| {
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            c.batch_replica_clear(&refs, &segment)
        })
    }

    /// Unmounts the segment and stops the client; later calls raise.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.owned(py)?;
        let taken = py.detach(|| {
            self.client
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .take()
        });
        match taken {
            Some(c) => {
                // What was registered through this store leaves the engine before it can be
                // freed: an engine shared with others (`engine=`) outlives this store and
                // would otherwise list freed memory as registered.
                let addrs = self.registered();
                let r = py.detach(move || {
                    withdraw(&c, addrs);
                    c.close()
                });
                // The client has stopped: nothing touches the registered buffers any more.
                let pins: Vec<Py<PyAny>> = self
                    .pins
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .drain()
                    .map(|(_, p)| p)
                    .collect();
                for p in pins {
                    p.drop_ref(py);
                }
                r.map_err(|e| raise(py, e))
            }
            None => Ok(()),
        }
    }

    fn closed(&self, py: Python<'_>) -> bool {
        // (Without the GIL: a close waiting for a long call to end holds the lock's writer
        // side, and every reader waits behind it.)
        py.detach(|| {
            self.client
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .is_none()
        })
    }
}

/// Unregisters `addrs` (what a store registered) from its client's engine, best effort: an
/// engine shared with others (`engine=`) outlives the store and would otherwise list memory
/// the store frees as registered.
fn withdraw(c: &Client, addrs: Vec<u64>) {
    for a in addrs {
        let _ = c.unregister_buffer(a);
    }
}

impl StoreCore {
    /// The addresses registered through this store that it keeps alive (pinned buffers, its
    /// memory pool's pages).
    fn registered(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .pins
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .copied()
            .collect();
        v.extend(
            self.pool
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .map(|p| p.addr),
        );
        v
    }
}

impl Drop for StoreCore {
    fn drop(&mut self) {
        let client = self
            .client
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let Some(client) = client else { return };
        if std::process::id() != self.pid {
            // A fork() child's copy: the client's Drop unmounts nothing there (the segment is
            // the parent's) and its engine and buffers only close their descriptors.
            drop(client);
            return;
        }
        // Stopping the client talks to the master and joins threads: not with the GIL held.
        // The pins (a field) are dropped after this, once the client has stopped and what
        // they kept alive has left the engine (see `close`).
        let addrs = self.registered();
        Python::attach(|py| {
            py.detach(move || {
                withdraw(&client, addrs);
                drop(client)
            })
        });
    }
}

/// Pairs per-key pointer and size lists into `(addr, len)` parts, checking the shapes.
fn zip_parts(
    py: Python<'_>,
    n: usize,
    ptrs: Vec<Vec<u64>>,
    sizes: Vec<Vec<u64>>,
) -> PyResult<Vec<Vec<(u64, u64)>>> {
    if ptrs.len() != n || sizes.len() != n {
        return Err(raise(
            py,
            StoreError::InvalidParams(format!(
                "{n} keys but {} pointer lists and {} size lists: one of each per key",
                ptrs.len(),
                sizes.len()
            )),
        ));
    }
    ptrs.into_iter()
        .zip(sizes)
        .enumerate()
        .map(|(i, (p, s))| {
            if p.len() != s.len() {
                return Err(raise(
                    py,
                    StoreError::InvalidParams(format!(
                        "key {i}: {} buffers but {} sizes",
                        p.len(),
                        s.len()
                    )),
                ));
            }
            if p.iter().zip(&s).any(|(&a, &l)| a == 0 && l > 0) {
                return Err(raise(
                    py,
                    StoreError::InvalidParams(format!("key {i}: a null buffer pointer")),
                ));
            }
            Ok(p.into_iter().zip(s).collect())
        })
        .collect()
}
