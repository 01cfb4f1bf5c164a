//! Python bindings of kvferry: the extension module `kvferry._kvferry`.
//!
//! This module is deliberately small: one class, [`Core`], that owns a
//! [`kvferry::TransferEngine`] and takes integer addresses only. The Python package builds
//! the two public APIs on top of it:
//!
//! - `kvferry.Engine` (python/kvferry/_engine.py): the native API; accepts buffer-protocol
//!   objects and raises typed exceptions;
//! - `kvferry.mooncake.engine.TransferEngine`: Mooncake's API, names and return codes.
//!
//! Rules every method follows:
//! - anything that can block (network, waiting, unregistering) runs with the GIL released
//!   (`py.detach`), so many Python threads can transfer at once;
//! - `Core` is a frozen pyclass; its state sits behind Rust locks, so it can be shared freely
//!   between threads;
//! - errors become `kvferry._errors` exceptions carrying the reason and Mooncake's numeric
//!   code (`.code`); nothing on a user-input path panics or unwraps.
//! - memory the engine may touch is pinned by Python objects the core holds (`pins`):
//!   registrations until unregister returned, batches until they are freed (every task
//!   terminal), synchronous calls until every task is terminal;
//! - a batch is a [`kvferry::Batch`] handle, mapped from its Mooncake-compatible id in one
//!   table (`batches`); dropping one waits until every task is terminal, so a status reported
//!   over is over: no byte of it lands afterwards;
//! - in a process other than the one that created it (a fork() child) every method raises,
//!   and dropping it only forgets it (see `Drop for Core`); dropping it in its own process
//!   releases the GIL.

mod arrays;
mod embedded;
mod errors;
mod memory;
mod reg_order;
mod store;
mod store_session;

use errors::{raise, Kind};
use kvferry::{
    Batch, Config, Error, FailCause, Opcode, TaskStatus, TransferEngine, TransferRequest,
    TransferStatus,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

/// (status, transferred_bytes, reason, cause code) as handed to Python.
type StatusTuple = (u8, u64, Option<String>, Option<u8>);

fn status_tuple(s: &TransferStatus) -> StatusTuple {
    (
        s.status as u8,
        s.transferred_bytes,
        s.reason.clone(),
        s.cause.map(FailCause::code),
    )
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Seconds (from Python) to a Duration, refusing NaN and negatives.
fn duration(py: Python<'_>, secs: f64) -> PyResult<Duration> {
    if !secs.is_finite() || secs < 0.0 {
        return Err(raise(
            py,
            Kind::InvalidArgument,
            format!("timeout must be a finite number of seconds >= 0, not {secs}"),
            -1,
        ));
    }
    // ~31 years: "forever" for our purposes, and far from Duration's overflow.
    Ok(Duration::from_secs_f64(secs.min(1e9)))
}

/// A length that fits a Python bytes object, or InvalidArgument.
fn byte_len(py: Python<'_>, length: u64) -> PyResult<usize> {
    usize::try_from(length)
        .ok()
        .filter(|&l| l <= isize::MAX as usize)
        .ok_or_else(|| {
            raise(
                py,
                Kind::InvalidArgument,
                format!("length {length} is too large"),
                -1,
            )
        })
}

fn opcode(py: Python<'_>, v: i64) -> PyResult<Opcode> {
    match v {
        0 => Ok(Opcode::Read),
        1 => Ok(Opcode::Write),
        _ => Err(raise(
            py,
            Kind::InvalidArgument,
            format!("opcode must be 0 (READ) or 1 (WRITE), not {v}"),
            -1,
        )),
    }
}

fn check_lengths(py: Python<'_>, locals: &[u64], remotes: &[u64], lengths: &[u64]) -> PyResult<()> {
    if locals.len() != remotes.len() || locals.len() != lengths.len() {
        return Err(raise(
            py,
            Kind::InvalidArgument,
            format!(
                "buffers, peer addresses and lengths must have the same number of entries (got {}, {} and {})",
                locals.len(),
                remotes.len(),
                lengths.len()
            ),
            -1,
        ));
    }
    Ok(())
}

fn build_requests(
    op: Opcode,
    target: u64,
    locals: &[u64],
    remotes: &[u64],
    lengths: &[u64],
) -> Vec<TransferRequest> {
    locals
        .iter()
        .zip(remotes)
        .zip(lengths)
        .map(|((&source, &target_offset), &length)| TransferRequest {
            opcode: op,
            source,
            target_id: target,
            target_offset,
            length,
        })
        .collect()
}

/// A kvferry transfer engine, integer addresses only (the low-level core of `kvferry.Engine`
/// and `kvferry.mooncake.engine.TransferEngine`; use those instead).
///
/// Core(local_hostname="127.0.0.1", metadata_server="P2PHANDSHAKE", protocol="", device_name="")
///
/// Configuration comes from the environment (`KVFERRY_*`, and Mooncake's `MC_*` aliases)
/// plus the arguments; `protocol` and `device_name` are Mooncake's `initialize` arguments
/// (`protocol="rdma"`: RDMA only; `device_name`: the NICs to use, comma-separated). Raises `kvferry.ConfigError` when the engine cannot start.
#[pyclass(frozen, module = "kvferry._kvferry", name = "Core")]
pub struct Core {
    // Field order matters: the engine is dropped before the managed mappings it may touch.
    engine: RwLock<Option<Arc<TransferEngine>>>,
    managed: Mutex<HashMap<u64, memory::Pages>>,
    /// The batches submitted and not yet freed, by id ([`Batch::id`], what Python holds), with
    /// what keeps their local buffers alive and exported (Python buffer exports, tensors):
    /// the pins go when the batch is freed, which happens only once every task is terminal.
    batches: Mutex<HashMap<u64, Held>>,
    /// How many of them Python released while in flight (`Held::released`): while none is,
    /// calls do not look through the table for ones to free.
    released: AtomicUsize,
    /// The same for registered ranges (by start address): held until unregister returned.
    reg_pins: Mutex<HashMap<u64, Py<PyAny>>>,
    /// The addresses of a registration or unregistration, claimed (without the GIL) across
    /// the engine call and its pins' update, so that the engine's ranges and `reg_pins`
    /// change together for each address: two threads registering and unregistering one
    /// buffer could otherwise interleave the two, and an unregister drop the pin of the
    /// registration made just after it, leaving registered memory that nothing keeps alive.
    /// Per address, so calls on other buffers go on (an unregister may wait seconds for
    /// accesses in progress). (Not `reg_pins` itself: `pin_of` takes that with the GIL held.)
    reg_order: reg_order::RegOrder,
    /// The process that created the engine: in another one (a fork() child) every method
    /// raises and dropping only forgets (see `Drop`).
    pid: u32,
    /// Set by `close()` before the engine is taken down; shared with the store clients set
    /// up on this engine (`StoreCore(..., engine=core)`), which then refuse every call. Its
    /// reference count, less this one, is the number of such clients still holding it.
    closed_flag: Arc<AtomicBool>,
}

/// A submitted batch as the core holds it.
struct Held {
    /// Shared with a thread waiting on it (without the table's lock).
    batch: Arc<Batch>,
    pins: Option<Py<PyAny>>,
    /// Released by Python while still in flight: freed by whichever call comes once it ended.
    released: bool,
}

/// The error every method raises in a process that did not create the engine.
fn foreign(py: Python<'_>, what: &str, owner: u32) -> PyErr {
    raise(
        py,
        Kind::Closed,
        format!(
            "this {what} belongs to process {owner} (it was inherited through fork() by process {}); create a new one in the child",
            std::process::id()
        ),
        -202,
    )
}

/// Drops `pins` with the GIL (Python reference counts change right away).
fn drop_pins<I: IntoIterator<Item = Py<PyAny>>>(py: Python<'_>, pins: I) {
    for p in pins {
        p.drop_ref(py);
    }
}

impl Core {
    /// Raises in a process that did not create the engine (a fork() child).
    fn owned(&self, py: Python<'_>) -> PyResult<()> {
        if std::process::id() != self.pid {
            return Err(foreign(py, "TransferEngine", self.pid));
        }
        Ok(())
    }

    /// The engine and this object's "closed" flag, for a store client that shares the engine.
    pub(crate) fn share(&self, py: Python<'_>) -> PyResult<(Arc<TransferEngine>, Arc<AtomicBool>)> {
        let e = self.engine(py)?;
        Ok((e, Arc::clone(&self.closed_flag)))
    }

    fn engine(&self, py: Python<'_>) -> PyResult<Arc<TransferEngine>> {
        self.owned(py)?;
        let engine = match &*self.engine.read().unwrap_or_else(|e| e.into_inner()) {
            Some(e) => Arc::clone(e),
            None => return Err(raise(py, Kind::Closed, "the engine is closed", -202)),
        };
        // Released batches that have ended since are freed (and their pins dropped) by
        // whichever call comes next.
        if self.released.load(Ordering::Acquire) > 0 {
            self.free_done(py, |_, h| h.released);
        }
        Ok(engine)
    }

    /// The batch with id `batch`.
    fn batch(&self, batch: u64) -> Result<Arc<Batch>, Error> {
        lock(&self.batches)
            .get(&batch)
            .map(|h| Arc::clone(&h.batch))
            .ok_or(Error::UnknownBatch(batch))
    }

    /// Frees the batches `which` picks among those that are done (every task terminal:
    /// dropping them does not wait) and drops their pins, with the GIL.
    fn free_done(&self, py: Python<'_>, which: impl Fn(u64, &Held) -> bool) {
        let freed: Vec<Held> = {
            let mut m = lock(&self.batches);
            let ids: Vec<u64> = m
                .iter()
                .filter(|(&id, h)| h.batch.is_done() && which(id, h))
                .map(|(&id, _)| id)
                .collect();
            ids.iter().filter_map(|id| m.remove(id)).collect()
        };
        let released = freed.iter().filter(|h| h.released).count();
        if released > 0 {
            self.released.fetch_sub(released, Ordering::AcqRel);
        }
        drop_pins(py, freed.into_iter().filter_map(|h| h.pins));
    }

    /// What `transfer` and `submit` check first: the opcode, matching list lengths, an open
    /// engine (whose released batches that finished since are freed here).
    fn prepare(
        &self,
        py: Python<'_>,
        opcode: i64,
        locals: &[u64],
        remotes: &[u64],
        lengths: &[u64],
    ) -> PyResult<(Opcode, Arc<TransferEngine>)> {
        let op = self::opcode(py, opcode)?;
        check_lengths(py, locals, remotes, lengths)?;
        let engine = self.engine(py)?;
        Ok((op, engine))
    }

    fn write_fallback(
        &self,
        py: Python<'_>,
        addr: u64,
        data: &[u8],
        why: std::io::Error,
    ) -> PyResult<()> {
        // Host memory only: the CPU never touches GPU memory (a device pointer faults).
        let inside = self.engine(py)?.registered().iter().any(|r| {
            r.gpu.is_none() && addr >= r.addr && addr.saturating_add(data.len() as u64) <= r.end()
        });
        if !inside {
            return Err(raise(
                py,
                Kind::AddressNotRegistered,
                format!("cannot check [0x{addr:x}, +{}) ({why}); only registered host memory can be written here", data.len()),
                -3,
            ));
        }
        // SAFETY: the range lies inside memory the user registered as a valid buffer.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len()) };
        Ok(())
    }

    fn read_fallback(
        &self,
        py: Python<'_>,
        addr: u64,
        out: &mut [u8],
        why: std::io::Error,
    ) -> PyResult<()> {
        let len = out.len() as u64;
        let inside = self
            .engine(py)?
            .registered()
            .iter()
            .any(|r| r.gpu.is_none() && addr >= r.addr && addr.saturating_add(len) <= r.end());
        if !inside {
            return Err(raise(
                py,
                Kind::AddressNotRegistered,
                format!("cannot check [0x{addr:x}, +{len}) ({why}); only registered host memory can be read here"),
                -3,
            ));
        }
        // SAFETY: the range lies inside memory the user registered as a valid buffer.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }
}

#[pymethods]
impl Core {
    #[new]
    #[pyo3(signature = (local_hostname = "127.0.0.1".to_string(), metadata_server = "P2PHANDSHAKE".to_string(), protocol = String::new(), device_name = String::new()))]
    fn new(
        py: Python<'_>,
        local_hostname: String,
        metadata_server: String,
        protocol: String,
        device_name: String,
    ) -> PyResult<Self> {
        let mut config = Config::from_env().map_err(|e| errors::engine(py, &e))?;
        config.local_hostname = local_hostname;
        config.metadata_server = metadata_server;
        // Mooncake's initialize(..., protocol, device_name) (see Config::apply_initialize_args).
        let args = config
            .apply_initialize_args(&protocol, &device_name, &|k| std::env::var(k).ok())
            .map_err(|e| errors::engine(py, &e))?;
        let engine = py
            .detach(move || {
                args.check_rdma(
                    &kvferry::host::rdma::probe(),
                    config.rdma_devices.as_deref(),
                )?;
                TransferEngine::new(config)
            })
            .map_err(|e| errors::engine(py, &e))?;
        Ok(Core {
            engine: RwLock::new(Some(Arc::new(engine))),
            managed: Mutex::default(),
            batches: Mutex::default(),
            released: AtomicUsize::new(0),
            reg_pins: Mutex::default(),
            reg_order: reg_order::RegOrder::default(),
            closed_flag: Arc::default(),
            pid: std::process::id(),
        })
    }

    /// In a `fork()` child: lets go of the parent engine's sockets and control region that
    /// this inherited copy holds (`TransferEngine::release_inherited`); nothing in the
    /// engine's own process. Called by the package's at-fork handler.
    fn release_inherited(&self) {
        if std::process::id() == self.pid {
            return;
        }
        // try_read: a thread of the parent may have held the lock at the fork.
        if let Ok(Some(e)) = self.engine.try_read().as_deref() {
            e.release_inherited();
        }
    }

    /// This engine's segment name, `host:rpc_port`: what peers pass as `target_hostname`.
    #[getter]
    fn segment_name(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.engine(py)?.segment_name().to_string())
    }

    /// The handshake (RPC) port.
    #[getter]
    fn rpc_port(&self, py: Python<'_>) -> PyResult<u16> {
        Ok(self.engine(py)?.rpc_port())
    }

    /// The TCP data port.
    #[getter]
    fn data_port(&self, py: Python<'_>) -> PyResult<u16> {
        Ok(self.engine(py)?.data_port())
    }

    /// Seconds after which an unfinished request fails with TIMEOUT (KVFERRY_TRANSFER_TIMEOUT
    /// or MC_TRANSFER_TIMEOUT).
    #[getter]
    fn transfer_timeout(&self, py: Python<'_>) -> PyResult<f64> {
        Ok(self.engine(py)?.config().transfer_timeout.as_secs_f64())
    }

    #[getter]
    fn closed(&self) -> bool {
        self.engine
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
    }

    /// The id of the process that created this engine (its methods raise in any other).
    #[getter]
    fn owner_pid(&self) -> u32 {
        self.pid
    }

    /// Registers ranges (all or none) so peers may read and write them. `pins[i]` (if any)
    /// is held until range `i` is unregistered (or the engine closed): what keeps its memory
    /// alive and exported.
    #[pyo3(signature = (addrs, lengths, location = "*".to_string(), pins = None))]
    fn register(
        &self,
        py: Python<'_>,
        addrs: Vec<u64>,
        lengths: Vec<u64>,
        location: String,
        pins: Option<Vec<Option<Py<PyAny>>>>,
    ) -> PyResult<()> {
        if addrs.len() != lengths.len() {
            return Err(raise(
                py,
                Kind::InvalidArgument,
                format!("{} addresses but {} lengths", addrs.len(), lengths.len()),
                -1,
            ));
        }
        if pins.as_ref().is_some_and(|p| p.len() != addrs.len()) {
            return Err(raise(
                py,
                Kind::InvalidArgument,
                "pins must have one entry per address",
                -1,
            ));
        }
        let engine = self.engine(py)?;
        let ranges: Vec<(u64, u64)> = addrs.iter().copied().zip(lengths).collect();
        let pins: Vec<Option<Py<PyAny>>> = pins.unwrap_or_default();
        // The pins that go (those of a failed registration, or replaced) come back out, to
        // be dropped with the GIL.
        let (result, gone) = py.detach(|| {
            let _order = self.reg_order.claim(&addrs);
            match engine.register_memory_batch(&ranges, &location) {
                Err(e) => (Err(e), pins.into_iter().flatten().collect::<Vec<_>>()),
                Ok(()) => {
                    let mut held = lock(&self.reg_pins);
                    let replaced = addrs
                        .iter()
                        .zip(pins)
                        .filter_map(|(a, p)| held.insert(*a, p?))
                        .collect();
                    (Ok(()), replaced)
                }
            }
        });
        drop_pins(py, gone);
        result.map_err(|e| errors::engine(py, &e))
    }

    /// Unregisters the ranges that start at `addrs` (all or none); waits for accesses in
    /// progress.
    fn unregister(&self, py: Python<'_>, addrs: Vec<u64>) -> PyResult<()> {
        let engine = self.engine(py)?;
        let (result, pins) = py.detach(|| {
            let _order = self.reg_order.claim(&addrs);
            match engine.unregister_memory_batch(&addrs) {
                Err(e) => (Err(e), Vec::new()),
                // Unregistering waited for accesses in progress: the memory may go now.
                Ok(()) => {
                    let mut held = lock(&self.reg_pins);
                    (
                        Ok(()),
                        addrs
                            .iter()
                            .filter_map(|a| held.remove(a))
                            .collect::<Vec<Py<PyAny>>>(),
                    )
                }
            }
        });
        drop_pins(py, pins);
        result.map_err(|e| errors::engine(py, &e))
    }

    /// The pin held for the registered range that contains [addr, addr+length), if any.
    fn pin_of(&self, py: Python<'_>, addr: u64, length: u64) -> PyResult<Option<Py<PyAny>>> {
        let engine = self.engine(py)?;
        let Some(r) = engine
            .registered()
            .into_iter()
            .find(|r| addr >= r.addr && addr.saturating_add(length) <= r.end())
        else {
            return Ok(None);
        };
        Ok(lock(&self.reg_pins).get(&r.addr).map(|p| p.clone_ref(py)))
    }

    /// Registered ranges as (addr, length, location), in address order.
    fn registered(&self, py: Python<'_>) -> PyResult<Vec<(u64, u64, String)>> {
        Ok(self
            .engine(py)?
            .registered()
            .into_iter()
            .map(|r| (r.addr, r.len, r.location))
            .collect())
    }

    /// Maps `length` bytes (rounded up to whole pages) and registers them; returns the address.
    #[pyo3(signature = (length, location = "cpu:0".to_string()))]
    fn allocate_managed(&self, py: Python<'_>, length: u64, location: String) -> PyResult<u64> {
        let engine = self.engine(py)?;
        let pages =
            memory::Pages::map(length).map_err(|m| raise(py, Kind::InvalidArgument, m, -1))?;
        let (addr, len) = (pages.addr, pages.len as u64);
        py.detach(|| engine.register_memory(addr, len, &location))
            .map_err(|e| errors::engine(py, &e))?;
        lock(&self.managed).insert(addr, pages);
        Ok(addr)
    }

    /// Unregisters and unmaps a buffer from `allocate_managed`. Returns False when `addr` is
    /// not one.
    fn free_managed(&self, py: Python<'_>, addr: u64) -> PyResult<bool> {
        if !lock(&self.managed).contains_key(&addr) {
            return Ok(false);
        }
        let engine = self.engine(py)?;
        match py.detach(|| engine.unregister_memory(addr)) {
            Ok(()) | Err(Error::NotRegistered { .. }) => {}
            Err(e) => return Err(errors::engine(py, &e)),
        }
        let pages = lock(&self.managed).remove(&addr);
        drop(pages);
        Ok(true)
    }

    /// Addresses and sizes of the buffers from `allocate_managed`.
    fn managed_buffers(&self, py: Python<'_>) -> PyResult<Vec<(u64, u64)>> {
        self.owned(py)?;
        let mut v: Vec<(u64, u64)> = lock(&self.managed)
            .values()
            .map(|p| (p.addr, p.len as u64))
            .collect();
        v.sort_unstable();
        Ok(v)
    }

    /// Opens (or looks up) a peer segment; returns its handle.
    fn open_segment(&self, py: Python<'_>, name: String) -> PyResult<u64> {
        let engine = self.engine(py)?;
        py.detach(|| engine.open_segment(&name))
            .map_err(|e| errors::engine(py, &e))
    }

    /// The buffers a segment registered, as (addr, length, location).
    fn segment_buffers(&self, py: Python<'_>, name: String) -> PyResult<Vec<(u64, u64, String)>> {
        let engine = self.engine(py)?;
        let desc = py
            .detach(|| {
                engine
                    .open_segment(&name)
                    .and_then(|id| engine.segment_descriptor(id))
            })
            .map_err(|e| errors::engine(py, &e))?;
        Ok(desc
            .buffers
            .into_iter()
            .map(|b| (b.addr, b.length, b.name))
            .collect())
    }

    #[allow(clippy::too_many_arguments)]
    /// Moves bytes between local `locals[i]` and `remotes[i]` of `segment` and waits up to
    /// `timeout` seconds (None: the engine's transfer timeout plus 1 ns per byte, as
    /// Mooncake's synchronous calls). Returns the bytes moved; raises on FAILED or TIMEOUT.
    /// `pins` is held until every task is terminal: the call returns only then.
    #[pyo3(signature = (segment, opcode, locals, remotes, lengths, timeout = None, pins = None))]
    fn transfer(
        &self,
        py: Python<'_>,
        segment: String,
        opcode: i64,
        locals: Vec<u64>,
        remotes: Vec<u64>,
        lengths: Vec<u64>,
        timeout: Option<f64>,
        pins: Option<Py<PyAny>>,
    ) -> PyResult<u64> {
        let (op, engine) = self.prepare(py, opcode, &locals, &remotes, &lengths)?;
        let timeout = match timeout {
            Some(t) => duration(py, t)?,
            None => {
                engine.config().transfer_timeout
                    + Duration::from_nanos(lengths.iter().fold(0u64, |a, &n| a.saturating_add(n)))
            }
        };
        let res = py.detach(|| {
            let id = engine.open_segment(&segment)?;
            let reqs = build_requests(op, id, &locals, &remotes, &lengths);
            // Adjacent requests merged (only the call's outcome is reported); a lone request
            // may run in this thread, several go to the transports' threads.
            engine.transfer_sync_coalesced(&reqs, timeout)
        });
        drop_pins(py, pins);
        match res {
            Ok(st) if st.status == TaskStatus::Completed => Ok(st.transferred_bytes),
            Ok(st) => Err(errors::transfer_failure(py, &segment, &st)),
            Err(e) => Err(errors::engine(py, &e)),
        }
    }

    /// Submits requests in a new batch and returns its id at once. `pins` is held until the
    /// batch is freed, which happens only once every task is terminal. `merge`: adjacent
    /// requests merged first, the batch then holding one task per merged run (for callers
    /// that read only the batch's status, as Mooncake's API).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (segment, opcode, locals, remotes, lengths, pins = None, merge = false))]
    fn submit(
        &self,
        py: Python<'_>,
        segment: String,
        opcode: i64,
        locals: Vec<u64>,
        remotes: Vec<u64>,
        lengths: Vec<u64>,
        pins: Option<Py<PyAny>>,
        merge: bool,
    ) -> PyResult<u64> {
        let (op, engine) = self.prepare(py, opcode, &locals, &remotes, &lengths)?;
        let b = py
            .detach(|| {
                let id = engine.open_segment(&segment)?;
                let reqs = build_requests(op, id, &locals, &remotes, &lengths);
                let b = engine.allocate_batch(reqs.len().max(1))?;
                // (On an error nothing was submitted: dropping the batch does not wait.)
                if merge {
                    b.submit_coalesced(&reqs)?;
                } else {
                    b.submit(&reqs)?;
                }
                Ok(b)
            })
            .map_err(|e| errors::engine(py, &e))?;
        let id = b.id();
        lock(&self.batches).insert(
            id,
            Held {
                batch: Arc::new(b),
                pins,
                released: false,
            },
        );
        Ok(id)
    }

    /// (status, transferred_bytes, reason, cause code) of a batch: WAITING (0) or PENDING (1)
    /// while any task is in flight; once every task is terminal, COMPLETED (4) when every
    /// task did, else the first failed task's FAILED (6) / TIMEOUT (5). A terminal status is
    /// final: nothing of the batch touches its buffers any more.
    fn batch_status(&self, py: Python<'_>, batch: u64) -> PyResult<StatusTuple> {
        self.engine(py)?;
        let b = self.batch(batch).map_err(|e| errors::engine(py, &e))?;
        Ok(status_tuple(&b.status()))
    }

    /// (status, transferred_bytes, reason) of task `task` of a batch.
    fn task_status(&self, py: Python<'_>, batch: u64, task: usize) -> PyResult<StatusTuple> {
        self.engine(py)?;
        let st = self
            .batch(batch)
            .and_then(|b| b.task_status(task))
            .map_err(|e| errors::engine(py, &e))?;
        Ok(status_tuple(&st))
    }

    /// Blocks until every task of the batch is terminal (not only until the first failure),
    /// or `timeout` seconds passed (None: no limit but the tasks' own deadlines, by which
    /// each ends); returns the batch status as `batch_status`.
    #[pyo3(signature = (batch, timeout = None))]
    fn wait_batch(
        &self,
        py: Python<'_>,
        batch: u64,
        timeout: Option<f64>,
    ) -> PyResult<StatusTuple> {
        let timeout = timeout.map(|t| duration(py, t)).transpose()?;
        self.engine(py)?;
        let b = self.batch(batch).map_err(|e| errors::engine(py, &e))?;
        let st = py.detach(|| match timeout {
            Some(t) => b.wait(t),
            None => b.wait_done(),
        });
        Ok(status_tuple(&st))
    }

    /// Frees a finished batch (and drops its pins); raises BatchBusy while a task is in flight.
    fn free_batch(&self, py: Python<'_>, batch: u64) -> PyResult<()> {
        self.engine(py)?;
        let held = {
            let mut m = lock(&self.batches);
            let h = m.get(&batch).ok_or(Error::UnknownBatch(batch));
            match h.map(|h| &h.batch) {
                Ok(b) if !b.is_done() => Err(Error::BatchBusy {
                    batch,
                    pending: b
                        .task_statuses()
                        .iter()
                        .filter(|s| !s.status.is_terminal())
                        .count(),
                }),
                Ok(_) => Ok(m.remove(&batch)),
                Err(e) => Err(e),
            }
        }
        .map_err(|e| errors::engine(py, &e))?;
        if held.as_ref().is_some_and(|h| h.released) {
            self.released.fetch_sub(1, Ordering::AcqRel);
        }
        // Done: dropping it does not wait.
        drop_pins(py, held.and_then(|h| h.pins));
        Ok(())
    }

    /// Frees a batch now if it has finished, else as soon as it has (returns False then);
    /// its pins are dropped when it is freed.
    fn release_batch(&self, py: Python<'_>, batch: u64) -> PyResult<bool> {
        self.engine(py)?;
        {
            let mut m = lock(&self.batches);
            let h = m
                .get_mut(&batch)
                .ok_or(Error::UnknownBatch(batch))
                .map_err(|e| errors::engine(py, &e))?;
            if !h.released {
                h.released = true;
                self.released.fetch_add(1, Ordering::AcqRel);
            }
        }
        self.free_done(py, |id, _| id == batch);
        Ok(!lock(&self.batches).contains_key(&batch))
    }

    /// Sends a notify message to a segment's handshake port. `name` defaults to this
    /// engine's segment name.
    #[pyo3(signature = (segment, msg, name = None))]
    fn send_notify(
        &self,
        py: Python<'_>,
        segment: String,
        msg: String,
        name: Option<String>,
    ) -> PyResult<()> {
        let engine = self.engine(py)?;
        py.detach(|| match &name {
            Some(n) => engine.send_notify_as(&segment, n, &msg),
            None => engine.send_notify(&segment, &msg),
        })
        .map_err(|e| {
            raise(
                py,
                errors::kind_of(&e),
                e.to_string(),
                errors::peer_code(&e),
            )
        })
    }

    /// Drains the notifies received so far, as (name, msg).
    fn get_notifies(&self, py: Python<'_>) -> PyResult<Vec<(String, String)>> {
        Ok(self
            .engine(py)?
            .get_notifies()
            .into_iter()
            .map(|n| (n.name, n.msg))
            .collect())
    }

    /// Like get_notifies, but waits up to `timeout` seconds for the first one; returns
    /// (empty) soon after the engine is closed by another thread.
    fn wait_notifies(&self, py: Python<'_>, timeout: f64) -> PyResult<Vec<(String, String)>> {
        let timeout = duration(py, timeout)?;
        let engine = self.engine(py)?;
        let closed = Arc::clone(&self.closed_flag);
        // (The engine is moved in: if close() ran meanwhile, the last reference goes here,
        // without the GIL, rather than in this thread with it.)
        let v = py.detach(move || {
            const SLICE: Duration = Duration::from_millis(200);
            let until = Instant::now().checked_add(timeout);
            loop {
                let left = until.map_or(Duration::MAX, |u| {
                    u.saturating_duration_since(Instant::now())
                });
                let v = engine.wait_notifies(left.min(SLICE));
                if !v.is_empty() || left <= SLICE || closed.load(Ordering::Acquire) {
                    return v;
                }
            }
        });
        Ok(v.into_iter().map(|n| (n.name, n.msg)).collect())
    }

    /// Checks that a segment's handshake port answers. Raises PeerUnreachable (code -102)
    /// or SegmentNotFound (code -101) otherwise.
    fn probe(&self, py: Python<'_>, segment: String) -> PyResult<()> {
        let engine = self.engine(py)?;
        py.detach(|| engine.probe(&segment)).map_err(|e| {
            let kind = match errors::kind_of(&e) {
                Kind::SegmentNotFound => Kind::SegmentNotFound,
                _ => Kind::PeerUnreachable,
            };
            raise(py, kind, e.to_string(), errors::peer_code(&e))
        })
    }

    /// Copies `data` to `addr`; the kernel checks the range, so a bad address raises
    /// instead of crashing.
    fn write_memory(&self, py: Python<'_>, addr: u64, data: &[u8]) -> PyResult<()> {
        self.owned(py)?;
        match memory::write_checked(addr, data) {
            Ok(()) => Ok(()),
            Err(memory::CopyError::Fault(m)) => Err(raise(py, Kind::InvalidArgument, m, -1)),
            Err(memory::CopyError::Unsupported(why)) => self.write_fallback(py, addr, data, why),
        }
    }

    /// Copies `length` bytes from `addr` into a new bytes object (checked like write_memory).
    fn read_memory<'py>(
        &self,
        py: Python<'py>,
        addr: u64,
        length: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.owned(py)?;
        let len = byte_len(py, length)?;
        let mut failure: Option<PyErr> = None;
        let bytes = PyBytes::new_with(py, len, |buf| {
            match memory::read_checked(addr, buf) {
                Ok(()) => {}
                Err(memory::CopyError::Fault(m)) => {
                    failure = Some(raise(py, Kind::InvalidArgument, m, -1))
                }
                Err(memory::CopyError::Unsupported(why)) => {
                    if let Err(e) = self.read_fallback(py, addr, buf, why) {
                        failure = Some(e);
                    }
                }
            }
            Ok(())
        })?;
        match failure {
            Some(e) => Err(e),
            None => Ok(bytes),
        }
    }

    /// Stops the engine: listeners close, requests still queued fail, managed buffers are
    /// unmapped. Every registered range is withdrawn first, which waits for accesses in
    /// progress, so no engine thread touches Python-owned memory after close() returns.
    /// Idempotent. With `unmap=False` managed buffers stay mapped until this object is freed
    /// (`kvferry.Engine` does that while views of them exist).
    #[pyo3(signature = (unmap = true))]
    fn close(&self, py: Python<'_>, unmap: bool) -> PyResult<()> {
        self.owned(py)?;
        let taken = self
            .engine
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let Some(engine) = taken else { return Ok(()) };
        // Store clients sharing the engine refuse calls from now on (they hold a clone of the
        // engine until they are closed; their registered buffers are withdrawn below).
        self.closed_flag.store(true, Ordering::Release);
        let flag = Arc::clone(&self.closed_flag);
        let (unique, sharing) = py.detach(move || {
            // Calls in progress on other threads hold clones; give them a moment to return.
            // Each store client sharing the engine holds one clone for as long as it lives.
            let stores = || Arc::strong_count(&flag).saturating_sub(2);
            let until = Instant::now() + Duration::from_secs(5);
            while Arc::strong_count(&engine) > 1 + stores() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(2));
            }
            retire(&engine);
            let sharing = stores();
            let unique = Arc::strong_count(&engine) == 1;
            if unique {
                drop(engine);
            } else {
                // A call still running (or a store sharing the engine) holds it: the last
                // reference is dropped by a thread of its own once the others are gone, so
                // the engine stops then (listeners, threads, metadata entries) and never on a
                // thread holding the GIL.
                let _ = std::thread::Builder::new().name("kvf-engine-drop".into()).spawn(move || {
                    while Arc::strong_count(&engine) > 1 {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    drop(engine);
                });
            }
            if sharing > 0 {
                tracing::info!("kvferry: engine closed while {sharing} store client(s) share it; they now refuse calls, and its listeners stop when they are closed");
            }
            (unique, sharing)
        });
        if unique {
            // No engine thread is left: every task is over (dropping a batch does not wait)
            // and nothing touches pinned memory any more.
            let held: Vec<Held> = lock(&self.batches).drain().map(|(_, h)| h).collect();
            self.released.store(0, Ordering::Release);
            let (batches, pins): (Vec<Arc<Batch>>, Vec<Option<Py<PyAny>>>) =
                held.into_iter().map(|h| (h.batch, h.pins)).unzip();
            py.detach(move || drop(batches));
            let pins: Vec<Py<PyAny>> = pins
                .into_iter()
                .flatten()
                .chain(lock(&self.reg_pins).drain().map(|(_, p)| p))
                .collect();
            drop_pins(py, pins);
            if unmap {
                lock(&self.managed).clear();
            }
        } else if sharing == 0 {
            tracing::warn!("kvferry: engine still in use by another thread at close(); managed buffers and pinned memory stay until the engine object is freed");
        }
        Ok(())
    }

    fn __repr__(&self) -> String {
        match &*self.engine.read().unwrap_or_else(|e| e.into_inner()) {
            Some(e) => format!("<kvferry._kvferry.Core segment={:?}>", e.segment_name()),
            None => "<kvferry._kvferry.Core closed>".to_string(),
        }
    }
}

/// Withdraws every registered range (waiting for accesses in progress) before an engine is
/// dropped: the engine's threads stop asynchronously, and the memory may be freed next.
fn retire(engine: &TransferEngine) {
    for r in engine.registered() {
        let _ = engine.unregister_memory(r.addr);
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        let engine = self
            .engine
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let managed: Vec<memory::Pages> = self
            .managed
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .map(|(_, p)| p)
            .collect();
        // The batches (their pins stay in the table, dropped with it after this).
        let batches: Vec<Arc<Batch>> = self
            .batches
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(|h| Arc::clone(&h.batch))
            .collect();
        if std::process::id() != self.pid {
            // A fork() child's copy: the listeners, memfds, control region and metadata entries
            // are the parent's. Unregistering, shutting sockets down or punching holes here
            // would break the parent, and the engine's threads do not exist in this process.
            // Dropped there, the engine shuts nothing down and the managed buffers only close
            // their descriptors (both check the process that created them).
            drop(engine);
            drop(batches);
            drop(managed);
            return;
        }
        // Stopping the engine waits for accesses in progress and joins threads: never with
        // the GIL held (other Python threads would stall, and anything the engine's threads
        // wait on that needs the GIL would deadlock).
        let slow = slow_drop(|k| std::env::var(k).ok());
        Python::attach(|py| {
            py.detach(move || {
                if let Some(engine) = engine {
                    retire(&engine);
                    if let Some(d) = slow {
                        std::thread::sleep(d);
                    }
                    drop(engine);
                }
                // Each batch waits until its tasks are over (they are, unless the engine is
                // still shared: then by their deadlines); the table's own references to them
                // then drop without waiting.
                for b in batches {
                    b.wait_done();
                }
                // The managed mappings go last: no engine thread is left to touch them.
                drop(managed);
            })
        });
        // Pins (Python objects) go after the engine: its threads no longer touch their memory.
    }
}

/// Test hook (tests/python/test_hardening.py): `KVFERRY_TEST_SLOW_DROP_MS` (read through
/// `var`) makes dropping an engine take that long, at most 10 s, inside the section that runs
/// without the GIL. Only in builds with the `test-hooks` feature (the wheel that
/// scripts/python-test builds with KVFERRY_WHEEL_PROFILE=ci); a release wheel has no such
/// hook, nor the variable's name.
#[cfg(feature = "test-hooks")]
fn slow_drop(var: impl Fn(&str) -> Option<String>) -> Option<Duration> {
    let ms = var("KVFERRY_TEST_SLOW_DROP_MS")?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ms.min(10_000)))
}

/// Without `test-hooks` (every release build): no hook.
#[cfg(not(feature = "test-hooks"))]
fn slow_drop(_var: impl Fn(&str) -> Option<String>) -> Option<Duration> {
    None
}

/// Copies `data` to `addr` without an engine (kernel-checked; raises on a bad range).
#[pyfunction]
fn write_memory(py: Python<'_>, addr: u64, data: &[u8]) -> PyResult<()> {
    match memory::write_checked(addr, data) {
        Ok(()) => Ok(()),
        Err(memory::CopyError::Fault(m)) => Err(raise(py, Kind::InvalidArgument, m, -1)),
        Err(memory::CopyError::Unsupported(why)) => Err(raise(
            py,
            Kind::InvalidArgument,
            format!("cannot check [0x{addr:x}, +{}) ({why}); initialize the engine and register the memory", data.len()),
            -1,
        )),
    }
}

/// Copies `length` bytes from `addr` without an engine (kernel-checked).
#[pyfunction]
fn read_memory<'py>(py: Python<'py>, addr: u64, length: u64) -> PyResult<Bound<'py, PyBytes>> {
    let len = byte_len(py, length)?;
    let mut failure: Option<String> = None;
    let bytes = PyBytes::new_with(py, len, |buf| {
        match memory::read_checked(addr, buf) {
            Ok(()) => {}
            Err(memory::CopyError::Fault(m)) => failure = Some(m),
            Err(memory::CopyError::Unsupported(why)) => {
                failure = Some(format!("cannot check [0x{addr:x}, +{len}) ({why}); initialize the engine and register the memory"))
            }
        }
        Ok(())
    })?;
    match failure {
        Some(m) => Err(raise(py, Kind::InvalidArgument, m, -1)),
        None => Ok(bytes),
    }
}

/// The exception (not raised) for a batch or task status that is not COMPLETED:
/// TransferTimeout, AddressNotRegistered, SegmentNotFound or TransferError.
#[pyfunction]
#[pyo3(signature = (segment, status, transferred_bytes = 0, reason = None, cause = None))]
fn transfer_error(
    py: Python<'_>,
    segment: String,
    status: u8,
    transferred_bytes: u64,
    reason: Option<String>,
    cause: Option<u8>,
) -> Py<PyAny> {
    let st = TransferStatus {
        status: TaskStatus::from_u8(status),
        transferred_bytes,
        reason,
        cause: cause.map(FailCause::from_code),
    };
    errors::transfer_failure(py, &segment, &st)
        .into_value(py)
        .into_any()
}

/// What this host can move, decided at run time: {"tcp": True, "rdma": ..., "cuda": ..., ...}.
/// "rdma": libibverbs.so.1 loads and an RDMA port is usable (active, with a usable GID), so
/// engines send over RDMA to peers that publish RDMA devices (`KVFERRY_TRANSPORT` auto or
/// rdma). "cuda": the CUDA driver (libcuda.so.1, loaded at run time) is usable for GPU memory,
/// which then registers like host memory and moves staged through pinned host buffers.
/// "gpu_rdma": both, and a way for the NICs to register GPU memory (DMA-BUF or nvidia-peermem,
/// as `KVFERRY_GPU_RDMA` allows) is present, so RDMA moves it unstaged (`kvferry doctor`
/// tries each for real and says why not).
#[pyfunction]
fn features(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    let cuda = py.detach(|| kvferry::host::gpu::cuda_ready().is_ok());
    let rdma = py.detach(|| kvferry::host::rdma::probe().usable());
    let gpu_rdma = cuda
        && rdma
        && py.detach(|| {
            let setting = kvferry::Config::from_env()
                .map(|c| c.gpu_rdma)
                .unwrap_or_default();
            let verbs_dmabuf = kvferry::host::rdma::verbs_dmabuf();
            kvferry::host::gpu::plan(setting, &kvferry::host::gpu::facts(0, verbs_dmabuf)).is_ok()
        });
    for (k, v) in [
        ("tcp", true),
        ("rdma", rdma),
        ("cuda", cuda),
        ("gpu_rdma", gpu_rdma),
        ("efa", false),
        ("hip", false),
        ("musa", false),
        ("mnnvl", false),
        ("intra_nvlink", false),
    ] {
        d.set_item(k, v)?;
    }
    Ok(d)
}

/// FailCause values: why a task failed, as codes (the reason text says it for people).
#[pyfunction]
fn fail_cause_names() -> Vec<(&'static str, u8)> {
    [
        (FailCause::Other, "OTHER"),
        (FailCause::LocalNotRegistered, "LOCAL_NOT_REGISTERED"),
        (FailCause::RemoteNotRegistered, "REMOTE_NOT_REGISTERED"),
        (FailCause::SegmentNotFound, "SEGMENT_NOT_FOUND"),
        (FailCause::PeerUnreachable, "PEER_UNREACHABLE"),
        (FailCause::PeerLost, "PEER_LOST"),
        (FailCause::Protocol, "PROTOCOL"),
        (FailCause::Timeout, "TIMEOUT"),
        (FailCause::ShutDown, "SHUT_DOWN"),
        (FailCause::Unauthorized, "UNAUTHORIZED"),
    ]
    .into_iter()
    .map(|(c, n)| (n, c.code()))
    .collect()
}

/// TaskStatus values (Mooncake's integers).
#[pyfunction]
fn task_status_names() -> Vec<(&'static str, u8)> {
    [
        TaskStatus::Waiting,
        TaskStatus::Pending,
        TaskStatus::Invalid,
        TaskStatus::Canceled,
        TaskStatus::Completed,
        TaskStatus::Timeout,
        TaskStatus::Failed,
    ]
    .into_iter()
    .map(|s| {
        let name = match s {
            TaskStatus::Waiting => "WAITING",
            TaskStatus::Pending => "PENDING",
            TaskStatus::Invalid => "INVALID",
            TaskStatus::Canceled => "CANCELED",
            TaskStatus::Completed => "COMPLETED",
            TaskStatus::Timeout => "TIMEOUT",
            TaskStatus::Failed => "FAILED",
        };
        (name, s as u8)
    })
    .collect()
}

/// Routes the engine's `tracing` output to stderr when KVFERRY_LOG is set (e.g. `info`,
/// `kvferry=debug`).
fn init_logging() {
    let Ok(filter) = std::env::var("KVFERRY_LOG") else {
        return;
    };
    if filter.trim().is_empty() {
        return;
    }
    let filter = tracing_subscriber::EnvFilter::try_new(filter.trim())
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// The `kvferry` command in this process: `argv` as `sys.argv` (argv[0] is the program
/// name), `self_command` how to start another copy of it (`[sys.executable, "-m", "kvferry"]`;
/// the subcommands that start children need it, since this process's executable is Python).
/// Returns the exit status. Runs with the GIL released, so other Python threads go on; the
/// subcommand owns the process's stdout/stderr file descriptors while it runs.
///
/// Signals: Python's SIGINT handler only sets a flag that nothing checks while this runs, so
/// Ctrl-C would not stop `kvferry master`; `kvferry.__main__.main` (the console script and
/// `python -m kvferry`) restores SIGINT's default first, so the command behaves as the binary
/// does (Ctrl-C and SIGTERM end it at once). Other callers should do the same or run it in a
/// subprocess.
#[pyfunction]
#[pyo3(signature = (argv, self_command = None))]
fn cli_main(
    py: Python<'_>,
    argv: Vec<std::ffi::OsString>,
    self_command: Option<Vec<std::ffi::OsString>>,
) -> i32 {
    py.detach(move || kvferry_cli::main_with_args_as(argv, self_command))
}

#[pymodule]
fn _kvferry(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging();
    m.add_class::<Core>()?;
    m.add_class::<store::StoreCore>()?;
    m.add_class::<embedded::EmbeddedMaster>()?;
    m.add_class::<store_session::StoreSessions>()?;
    m.add_function(wrap_pyfunction!(features, m)?)?;
    m.add_function(wrap_pyfunction!(task_status_names, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_error, m)?)?;
    m.add_function(wrap_pyfunction!(fail_cause_names, m)?)?;
    m.add_function(wrap_pyfunction!(write_memory, m)?)?;
    m.add_function(wrap_pyfunction!(read_memory, m)?)?;
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(arrays::transfer_arrays, m)?)?;
    m.add_function(wrap_pyfunction!(arrays::submit_arrays, m)?)?;
    m.add_function(wrap_pyfunction!(arrays::transfer_pages, m)?)?;
    m.add_function(wrap_pyfunction!(arrays::submit_scatter, m)?)?;
    m.add_function(wrap_pyfunction!(arrays::check_hints, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::slow_drop;

    /// Test hooks stay out of release wheels: the wheel is built with the features of
    /// pyproject.toml's [tool.maturin] (never `test-hooks`), and a build without it ignores
    /// the hook's variable. (`cargo test` builds this crate without `test-hooks` too; only
    /// scripts/python-test's ci wheel has it.)
    #[test]
    #[cfg(not(feature = "test-hooks"))]
    fn release_builds_have_no_test_hook() {
        assert_eq!(slow_drop(|_| Some("400".into())), None);
        let pyproject = include_str!("../../../pyproject.toml");
        let maturin = pyproject
            .split("[tool.maturin]")
            .nth(1)
            .expect("pyproject.toml has [tool.maturin]");
        let maturin = maturin.split("\n[").next().unwrap_or(maturin);
        let features = maturin
            .lines()
            .find(|l| l.trim_start().starts_with("features"))
            .expect("[tool.maturin] names the wheel's features");
        assert!(
            !features.contains("test-hooks"),
            "release wheels must not enable test-hooks: {features}"
        );
    }

    /// With `test-hooks`, the hook reads its variable (bounded to 10 s).
    #[test]
    #[cfg(feature = "test-hooks")]
    fn the_hook_reads_its_variable() {
        use std::time::Duration;
        let var = |v: &'static str| {
            move |k: &str| (k == "KVFERRY_TEST_SLOW_DROP_MS").then(|| v.to_string())
        };
        assert_eq!(slow_drop(var("400")), Some(Duration::from_millis(400)));
        assert_eq!(slow_drop(var("999999")), Some(Duration::from_secs(10)));
        assert_eq!(slow_drop(var("x")), None);
        assert_eq!(slow_drop(|_| None), None);
    }
}
