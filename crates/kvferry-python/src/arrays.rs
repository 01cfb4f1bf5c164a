//! Mooncake 0.3.14's descriptor-array, page-table and scatter calls, and its transfer hints.
//!
//! The Python layer (`kvferry.mooncake.engine`) checks each array's shape, item size and
//! contiguity from its buffer (O(1) per array) and hands the raw bytes here; every element is
//! read and checked in Rust, and page tables are expanded inside the engine
//! ([`kvferry::TransferEngine::transfer_pages_sync`]). Adjacent descriptors are merged by the
//! engine (`transfer_sync_coalesced`, `Batch::submit_coalesced`).

use crate::errors::{self, raise, Kind};
use crate::{drop_pins, lock, opcode, Core, Held};
use kvferry::{Opcode, PageTable, TaskStatus, TransferEngine, TransferRequest, TransferStatus};
use pyo3::prelude::*;
use std::sync::Arc;
use std::time::Duration;

/// An array's 8-byte items, in native byte order. `signed`: the array holds int64, and a
/// negative item is refused (addresses, lengths and page indices are never negative).
fn items(py: Python<'_>, name: &str, raw: &[u8], signed: bool) -> PyResult<Vec<u64>> {
    if raw.len() % 8 != 0 {
        return Err(raise(
            py,
            Kind::InvalidArgument,
            format!("{name} must hold 8-byte integers (uint64/int64)"),
            -1,
        ));
    }
    let v: Vec<u64> = raw
        .chunks_exact(8)
        .map(|c| u64::from_ne_bytes(c.try_into().unwrap_or_default()))
        .collect();
    if signed {
        if let Some(i) = v.iter().position(|&x| (x as i64) < 0) {
            return Err(raise(
                py,
                Kind::InvalidArgument,
                format!(
                    "{name} must not contain negative values ({name}[{i}] is {})",
                    v[i] as i64
                ),
                -1,
            ));
        }
    }
    Ok(v)
}

fn requests(op: Opcode, target: u64, l: &[u64], r: &[u64], n: &[u64]) -> Vec<TransferRequest> {
    l.iter()
        .zip(r)
        .zip(n)
        .map(|((&source, &target_offset), &length)| TransferRequest {
            opcode: op,
            source,
            target_id: target,
            target_offset,
            length,
        })
        .collect()
}

/// The three descriptor arrays of a `*_arrays` call, decoded and checked to match.
fn descriptors(
    py: Python<'_>,
    locals: &[u8],
    remotes: &[u8],
    lengths: &[u8],
    signed: (bool, bool, bool),
) -> PyResult<(Vec<u64>, Vec<u64>, Vec<u64>)> {
    let l = items(py, "buffers", locals, signed.0)?;
    let r = items(py, "peer_buffer_addresses", remotes, signed.1)?;
    let n = items(py, "lengths", lengths, signed.2)?;
    if l.len() != r.len() || l.len() != n.len() {
        return Err(raise(
            py,
            Kind::InvalidArgument,
            format!(
                "buffers, peer_buffer_addresses and lengths must have the same length (got {}, {} and {})",
                l.len(),
                r.len(),
                n.len()
            ),
            -1,
        ));
    }
    Ok((l, r, n))
}

/// The engine's allowance for a synchronous call moving `bytes`: its transfer timeout plus
/// 1 ns per byte (Mooncake's).
fn sync_timeout(engine: &TransferEngine, bytes: u64) -> Duration {
    engine.config().transfer_timeout + Duration::from_nanos(bytes)
}

fn finish(py: Python<'_>, segment: &str, res: kvferry::Result<TransferStatus>) -> PyResult<u64> {
    match res {
        Ok(st) if st.status == TaskStatus::Completed => Ok(st.transferred_bytes),
        Ok(st) => Err(errors::transfer_failure(py, segment, &st)),
        Err(e) => Err(errors::engine(py, &e)),
    }
}

/// Moves descriptor arrays (`buffers`, `peer_buffer_addresses`, `lengths` as the raw bytes of
/// 8-byte integer arrays; `signed`: which hold int64) synchronously, adjacent descriptors
/// merged. Returns the bytes moved; raises as `Core.transfer`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(crate) fn transfer_arrays(
    py: Python<'_>,
    core: &Bound<'_, Core>,
    segment: String,
    opcode: i64,
    locals: &[u8],
    remotes: &[u8],
    lengths: &[u8],
    signed: (bool, bool, bool),
) -> PyResult<u64> {
    let op = self::opcode(py, opcode)?;
    let (l, r, n) = descriptors(py, locals, remotes, lengths, signed)?;
    let engine = core.get().engine(py)?;
    let bytes = n.iter().fold(0u64, |a, &x| a.saturating_add(x));
    let res = py.detach(|| {
        let id = engine.open_segment(&segment)?;
        engine.transfer_sync_coalesced(&requests(op, id, &l, &r, &n), sync_timeout(&engine, bytes))
    });
    finish(py, &segment, res)
}

/// Submits descriptor arrays as one batch (adjacent descriptors merged: the batch holds one
/// task per merged run) and returns its id at once; `pins` is held until the batch is freed.
#[pyfunction]
#[pyo3(signature = (core, segment, opcode, locals, remotes, lengths, signed, pins = None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn submit_arrays(
    py: Python<'_>,
    core: &Bound<'_, Core>,
    segment: String,
    opcode: i64,
    locals: &[u8],
    remotes: &[u8],
    lengths: &[u8],
    signed: (bool, bool, bool),
    pins: Option<Py<PyAny>>,
) -> PyResult<u64> {
    let op = self::opcode(py, opcode)?;
    let (l, r, n) = descriptors(py, locals, remotes, lengths, signed)?;
    submit_requests(py, core.get(), &segment, pins, |id| {
        Ok(requests(op, id, &l, &r, &n))
    })
}

/// Opens `segment`, builds the requests, submits them merged in a new batch held by the core.
fn submit_requests(
    py: Python<'_>,
    core: &Core,
    segment: &str,
    pins: Option<Py<PyAny>>,
    build: impl FnOnce(u64) -> kvferry::Result<Vec<TransferRequest>> + Send,
) -> PyResult<u64> {
    let engine = match core.engine(py) {
        Ok(e) => e,
        Err(e) => {
            drop_pins(py, pins);
            return Err(e);
        }
    };
    let b = py.detach(|| {
        let id = engine.open_segment(segment)?;
        let reqs = build(id)?;
        let b = engine.allocate_batch(reqs.len().max(1))?;
        // (On an error nothing was submitted: dropping the batch does not wait.)
        b.submit_coalesced(&reqs)?;
        Ok(b)
    });
    let b = match b {
        Ok(b) => b,
        Err(e) => {
            drop_pins(py, pins);
            return Err(errors::engine(py, &e));
        }
    };
    let id = b.id();
    lock(&core.batches).insert(
        id,
        Held {
            batch: Arc::new(b),
            pins,
            released: false,
        },
    );
    Ok(id)
}

/// Moves a page table synchronously (Mooncake 0.3.14's `batch_transfer_sync_*_pages`):
/// `src_pages`, `dst_pages` and `fields` (`F` rows of 5) as raw 8-byte integer arrays,
/// expanded and merged inside the engine. Returns the bytes moved.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(crate) fn transfer_pages(
    py: Python<'_>,
    core: &Bound<'_, Core>,
    segment: String,
    opcode: i64,
    src_pages: &[u8],
    dst_pages: &[u8],
    fields: &[u8],
    signed: (bool, bool, bool),
) -> PyResult<u64> {
    let op = self::opcode(py, opcode)?;
    let src = items(py, "src_pages", src_pages, signed.0)?;
    let dst = items(py, "dst_pages", dst_pages, signed.1)?;
    let flat = items(py, "fields", fields, false)?;
    if flat.len() % 5 != 0 {
        return Err(raise(
            py,
            Kind::InvalidArgument,
            "fields must be a C-contiguous [F, 5] array",
            -1,
        ));
    }
    let rows: Vec<[u64; 5]> = flat
        .chunks_exact(5)
        .map(|c| [c[0], c[1], c[2], c[3], c[4]])
        .collect();
    if signed.2 {
        // int64 rows: strides and bases must not be negative, lengths must be positive.
        if let Some(i) = rows.iter().position(|r| r.iter().any(|&x| (x as i64) < 0)) {
            return Err(raise(
                py,
                Kind::InvalidArgument,
                format!("fields rows need a positive length and non-negative strides (row {i} has a negative value; bases must not be negative either)"),
                -1,
            ));
        }
    }
    let table = PageTable {
        src_pages: &src,
        dst_pages: &dst,
        fields: &rows,
    };
    let count = table.len().map_err(|e| errors::engine(py, &e))?;
    let engine = core.get().engine(py)?;
    let bytes = rows.iter().fold(0u64, |a, r| {
        a.saturating_add(r[4].saturating_mul(src.len() as u64))
    });
    if count == 0 {
        return Ok(0);
    }
    let res = py.detach(|| {
        let id = engine.open_segment(&segment)?;
        engine.transfer_pages_sync(op, id, &table, sync_timeout(&engine, bytes))
    });
    finish(py, &segment, res)
}

/// The requests of a scatter operation (Mooncake 0.3.14's `submit_scatter_*`): range `k`
/// moves fragment `j` between local `local_bases[k] + local_offsets[k][j]` and remote
/// `remote_bases[k] + remote_offsets[k][j]`, `lengths[k][j]` bytes, each fragment inside its
/// range's capacity on both sides (checked, no overflow).
pub(crate) struct Scatter {
    pub local_bases: Vec<u64>,
    pub local_caps: Vec<u64>,
    pub remote_bases: Vec<u64>,
    pub remote_caps: Vec<u64>,
    pub local_offsets: Vec<Vec<u64>>,
    pub remote_offsets: Vec<Vec<u64>>,
    pub lengths: Vec<Vec<u64>>,
}

impl Scatter {
    fn requests(&self, op: Opcode, target: u64) -> Result<Vec<TransferRequest>, String> {
        let k = self.local_bases.len();
        if [
            self.local_caps.len(),
            self.remote_bases.len(),
            self.remote_caps.len(),
            self.local_offsets.len(),
            self.remote_offsets.len(),
            self.lengths.len(),
        ]
        .iter()
        .any(|&n| n != k)
        {
            return Err("Scatter transfer range arrays have different sizes".into());
        }
        let mut out = Vec::new();
        for i in 0..k {
            let (lo, ro, n) = (
                &self.local_offsets[i],
                &self.remote_offsets[i],
                &self.lengths[i],
            );
            if lo.len() != ro.len() || lo.len() != n.len() {
                return Err(format!(
                    "Scatter transfer fragment arrays have different sizes at range {i}"
                ));
            }
            let (lb, lc) = (self.local_bases[i], self.local_caps[i]);
            let (rb, rc) = (self.remote_bases[i], self.remote_caps[i]);
            if lb.checked_add(lc).is_none() {
                return Err(format!(
                    "Scatter transfer local allocation range overflows the address space at range {i}"
                ));
            }
            if rb.checked_add(rc).is_none() {
                return Err(format!(
                    "Scatter transfer remote range overflows the address space at range {i}"
                ));
            }
            for j in 0..n.len() {
                let inside = |off: u64, cap: u64| off.checked_add(n[j]).is_some_and(|e| e <= cap);
                if !inside(lo[j], lc) || !inside(ro[j], rc) {
                    return Err(format!(
                        "invalid scatter transfer fragment: range {i} fragment {j} (local offset {}, remote offset {}, length {}) lies outside the range's capacities ({lc} local, {rc} remote)",
                        lo[j], ro[j], n[j]
                    ));
                }
                out.push(TransferRequest {
                    opcode: op,
                    source: lb + lo[j],
                    target_id: target,
                    target_offset: rb + ro[j],
                    length: n[j],
                });
            }
        }
        // (No fragment at all: an empty batch, which completes at once, as in Mooncake.)
        Ok(out)
    }
}

/// Checks a scatter operation's ranges (raises InvalidArgument naming the range and fragment,
/// before anything moves) and submits its fragments as one batch; returns the batch id.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(crate) fn submit_scatter(
    py: Python<'_>,
    core: &Bound<'_, Core>,
    segment: String,
    opcode: i64,
    local_bases: Vec<u64>,
    local_caps: Vec<u64>,
    remote_bases: Vec<u64>,
    remote_caps: Vec<u64>,
    local_offsets: Vec<Vec<u64>>,
    remote_offsets: Vec<Vec<u64>>,
    lengths: Vec<Vec<u64>>,
) -> PyResult<u64> {
    let op = self::opcode(py, opcode)?;
    let s = Scatter {
        local_bases,
        local_caps,
        remote_bases,
        remote_caps,
        local_offsets,
        remote_offsets,
        lengths,
    };
    // Checked before anything opens or moves (the segment id does not change the checks).
    s.requests(op, 0)
        .map_err(|m| raise(py, Kind::InvalidArgument, m, -1))?;
    submit_requests(py, core.get(), &segment, None, |id| {
        s.requests(op, id).map_err(kvferry::Error::InvalidArgument)
    })
}

/// Checks Mooncake's `transport_hint` and `nic_hint` against how this engine reaches
/// `segment`: Ok when the hint is what it uses (or empty / "unspec"); InvalidArgument for a
/// transport name Mooncake does not know; TransferError (-1 in the Mooncake API) with the
/// reason when the hint names something this engine does not or cannot use for `segment`.
#[pyfunction]
pub(crate) fn check_hints(
    py: Python<'_>,
    core: &Bound<'_, Core>,
    segment: String,
    transport_hint: &str,
    nic_hint: &str,
) -> PyResult<()> {
    const KNOWN: [&str; 10] = [
        "rdma",
        "mnnvl",
        "shm",
        "nvlink",
        "gds",
        "io_uring",
        "tcp",
        "ascend",
        "sunrise_link",
        "unspec",
    ];
    let hint = transport_hint.trim().to_ascii_lowercase();
    if !hint.is_empty() && !KNOWN.contains(&hint.as_str()) {
        return Err(raise(
            py,
            Kind::InvalidArgument,
            format!("Unknown transport_hint '{transport_hint}' (valid: rdma, mnnvl, shm, nvlink, gds, io_uring, tcp, ascend, sunrise_link, unspec, or empty string for no hint)"),
            -1,
        ));
    }
    let nic = nic_hint.trim();
    if (hint.is_empty() || hint == "unspec") && nic.is_empty() {
        return Ok(());
    }
    let cannot = |m: String| raise(py, Kind::Transfer, m, -1);
    if !["rdma", "shm", "tcp"].contains(&hint.as_str()) && !hint.is_empty() && hint != "unspec" {
        return Err(cannot(format!(
            "transport_hint '{hint}' cannot be met: kvferry moves data over tcp, shm (same host) and rdma only"
        )));
    }
    let engine = core.get().engine(py)?;
    let (used, why_not_shm, devices) = py
        .detach(|| {
            let id = engine.open_segment(&segment)?;
            let t = engine.segment_transport(id)?;
            let devices: Vec<String> = engine
                .local_descriptor()
                .devices
                .iter()
                .map(|d| d.name.clone())
                .collect();
            Ok((t.name, t.why_not_shm, devices))
        })
        .map_err(|e| errors::engine(py, &e))?;
    // The engine's own segment is reached by a memory copy, as shared memory is.
    let used = if used == "local" { "shm" } else { used };
    if !hint.is_empty() && hint != "unspec" && hint != used {
        let why = why_not_shm.map(|w| format!(" ({w})")).unwrap_or_default();
        return Err(cannot(format!(
            "transport_hint '{hint}' cannot be met: this engine reaches {segment} over {used}{why}; kvferry picks the transport per peer (KVFERRY_TRANSPORT)"
        )));
    }
    if !nic.is_empty() {
        if used != "rdma" {
            return Err(cannot(format!(
                "nic_hint '{nic}' cannot be met: this engine reaches {segment} over {used}, not through an RDMA NIC"
            )));
        }
        if !devices.iter().any(|d| d == nic) {
            return Err(cannot(format!(
                "nic_hint '{nic}' cannot be met: it is not one of this engine's NICs ({})",
                devices.join(", ")
            )));
        }
        if devices.len() > 1 {
            return Err(cannot(format!(
                "nic_hint '{nic}' cannot be met: kvferry spreads requests over all its NICs ({}); start the engine with device_name=\"{nic}\" to use that NIC only",
                devices.join(", ")
            )));
        }
    }
    Ok(())
}
