//! Same-host GPU memory: a verified peer's GPU buffers, opened here through CUDA IPC and copied
//! with the driver (device to device, over NVLink where the GPUs have it; or to and from host
//! memory), as Mooncake's `nvlink_intra` does — under the same bounds, epoch and in-flight
//! protocol as every other same-host copy, so the peer's `unregister` stays a barrier.
//!
//! The publisher exports each registered GPU range when it registers it ([`Exports`]) and
//! lists the exports in its `kvferry_shm` field (`gpus`). An initiator that selected the peer
//! opens an export once (cached per export in the [`ShmPeer`]) and then copies
//! `[remote, +len)` at the opened address plus the remote range's offset in the export. A
//! range not covered by an export (CUDA virtual memory, an export that failed) is left to TCP.

use super::attach::ShmPeer;
use super::{Shared, FIELD};
use crate::batch::{FailCause, FailKind};
use crate::gpu::ipc::{self, Export, Opened};
use crate::memory::Region;
use crate::transport::{Peer, Piece};
use crate::wire::descriptor::SegmentDesc;
use crate::wire::tcp::Opcode;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Bytes this process moved to or from same-host peers' GPU memory through CUDA IPC.
static GPU_IPC_BYTES: AtomicU64 = AtomicU64::new(0);

/// Bytes this process has copied to or from same-host peers' GPU memory through CUDA IPC.
pub fn gpu_ipc_bytes() -> u64 {
    GPU_IPC_BYTES.load(Ordering::Relaxed)
}

/// A registered GPU range of the publisher and its CUDA IPC export.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct GpuExport {
    /// The range in the publisher's address space.
    pub addr: u64,
    pub len: u64,
    /// [`Export::encode`]'s form.
    pub export: String,
}

/// This engine's exports of its registered GPU ranges (by range start).
#[derive(Default)]
pub(super) struct Exports(Mutex<BTreeMap<u64, GpuExport>>);

impl Exports {
    pub(super) fn on_register(&self, r: &Region) {
        if r.gpu.is_none() {
            return;
        }
        match ipc::export(r.addr, r.len) {
            Ok(e) => {
                self.0.lock().unwrap_or_else(|e| e.into_inner()).insert(r.addr, GpuExport { addr: r.addr, len: r.len, export: e.encode() });
            }
            Err(why) => tracing::debug!("GPU memory [0x{:x}, +{}) is not offered to same-host peers through CUDA IPC ({why}); they reach it over TCP", r.addr, r.len),
        }
    }

    pub(super) fn on_unregister(&self, r: &Region) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&r.addr);
    }

    pub(super) fn list(&self) -> Vec<GpuExport> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }
}

/// The exports a descriptor publishes (none when it publishes no field or no GPU memory).
fn exports_of(desc: &SegmentDesc) -> Vec<GpuExport> {
    desc.extra
        .get(FIELD)
        .and_then(|v| v.get("gpus"))
        .and_then(|g| serde_json::from_value(g.clone()).ok())
        .unwrap_or_default()
}

/// The export covering `[remote, +len)` in `list`.
fn covering(list: &[GpuExport], remote: u64, len: u64) -> Option<&GpuExport> {
    // (A peer's descriptor: its export may claim a range past the end of the address space.)
    list.iter().find(|e| {
        remote >= e.addr
            && remote
                .checked_add(len)
                .zip(e.addr.checked_add(e.len))
                .is_some_and(|(end, limit)| end <= limit)
    })
}

/// What an initiator opened of one peer: per export string, the peer's unregister epoch of
/// the newest descriptor that listed it, and the mapping here (or why it could not be opened,
/// so it is not tried again for that export).
///
/// Kept only while the peer's live epoch (in its control region) is the one noted: an
/// unregister on the peer moves it, and the reaper then closes what was opened under the
/// older epoch ([`Opens::close_before`]: `cuIpcCloseMemHandle` once no copy holds it), within
/// [`super::REAP_INTERVAL`], as it unmaps the host buffers a peer freed. An export still
/// published is opened again by the next transfer that needs it.
#[derive(Default)]
pub(crate) struct Opens(Mutex<HashMap<String, (u64, Opening)>>);

/// An export opened here, or why it could not be.
type Opening = Result<Arc<Opened>, String>;

impl Opens {
    /// `e`, listed in the peer's descriptor of unregister epoch `epoch`, opened here (on the
    /// local GPU `near`, else the exporter's GPU, else GPU 0).
    fn open(&self, e: &GpuExport, near: Option<u32>, epoch: u64) -> Result<Arc<Opened>, String> {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, r)) = m.get_mut(&e.export) {
            *at = (*at).max(epoch);
            return r.clone();
        }
        let r = Export::decode(&e.export).and_then(|x| {
            let gpus = crate::gpu::cuda()
                .ok()
                .and_then(|c| c.driver().devices().ok())
                .map_or(0, |d| d.len() as u32);
            let on = near.unwrap_or(if x.ordinal < gpus { x.ordinal } else { 0 });
            ipc::open(&x, on).map(Arc::new)
        });
        if let Err(why) = &r {
            tracing::debug!("a same-host peer's GPU memory cannot be opened here ({why}); it is reached over TCP");
        }
        m.insert(e.export.clone(), (epoch, r.clone()));
        r
    }

    /// Closes what the peer no longer exports (once no copy uses it).
    fn retain(&self, list: &[GpuExport]) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|k, _| list.iter().any(|e| &e.export == k));
    }

    /// Closes (once no copy uses it) what was opened from descriptors older than the peer's
    /// live unregister epoch `live`: the peer unregistered something since. Returns how many
    /// entries were dropped.
    pub(super) fn close_before(&self, live: u64) -> usize {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let before = m.len();
        m.retain(|_, (at, _)| *at >= live);
        before - m.len()
    }

    pub(super) fn clear(&self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// Splits off the pieces whose remote range lies in GPU memory `peer` exports and that this
/// process can open: `(taken, rest)`.
pub(super) fn split(
    shm: &ShmPeer,
    desc: &SegmentDesc,
    pieces: Vec<Piece>,
) -> (Vec<Piece>, Vec<Piece>) {
    let list = exports_of(desc);
    if list.is_empty() {
        return (Vec::new(), pieces);
    }
    let epoch = super::ShmInfo::cookie_epoch(desc).map_or(0, |(_, e)| e);
    shm.gpu.retain(&list);
    pieces.into_iter().partition(|p| {
        covering(&list, p.remote, p.len)
            .is_some_and(|e| shm.gpu.open(e, p.guard.region().gpu, epoch).is_ok())
    })
}

/// Copies pieces into or out of the peer's GPU memory: bounds against the current descriptor,
/// the in-flight counter raised and the epoch checked around the copies (as every same-host
/// copy), then the driver's copy for each; done only if the peer process lived throughout.
pub(super) fn run(shared: &Shared, shm: &ShmPeer, peer: &Arc<Peer>, mut pieces: Vec<Piece>) {
    let cuda = match crate::gpu::cuda() {
        Ok(c) => c,
        Err(why) => {
            return super::copy::fail_all(
                pieces,
                FailKind::Failed,
                FailCause::Other,
                &format!("GPU memory cannot be copied: {why}"),
            )
        }
    };
    super::copy::admit(peer, &mut pieces);
    let mut refreshed = 0;
    while !pieces.is_empty() {
        let (desc, desc_epoch) = match super::copy::current(shm, peer) {
            Ok(d) => d,
            Err(why) => {
                return super::copy::fail_all(pieces, FailKind::Failed, FailCause::PeerLost, &why)
            }
        };
        let list = exports_of(&desc);
        // Bounds: only ranges inside exports of the current descriptor.
        let mut targets = Vec::with_capacity(pieces.len());
        pieces.retain(|p| {
            match covering(&list, p.remote, p.len)
                .filter(|_| desc.find_buffer(p.remote, p.len).is_some())
            {
                Some(e) => match shm.gpu.open(e, p.guard.region().gpu, desc_epoch) {
                    Ok(o) => {
                        targets.push((o, p.remote - e.addr));
                        true
                    }
                    Err(why) => {
                        p.task.piece_failed(
                            FailKind::Failed,
                            FailCause::Other.because(format!(
                                "{}: its GPU memory cannot be opened here: {why}",
                                peer.name
                            )),
                        );
                        false
                    }
                },
                None => {
                    let e = crate::Error::RemoteNotRegistered {
                        segment: peer.name.clone(),
                        addr: p.remote,
                        len: p.len,
                    };
                    p.task.piece_failed(FailKind::Failed, &e);
                    false
                }
            }
        });
        if pieces.is_empty() {
            return;
        }
        match super::copy::enter(shared, shm, peer, desc_epoch, &mut refreshed) {
            super::copy::Entered::Copy => {}
            super::copy::Entered::Again => continue,
            super::copy::Entered::Fail(why) => {
                return super::copy::fail_all(pieces, FailKind::Failed, FailCause::PeerLost, &why)
            }
        }
        let results: Vec<Result<(), String>> = pieces
            .iter()
            .zip(&targets)
            .map(|(p, (o, off))| {
                let remote = o.addr() + off;
                let len = p.len as usize;
                let on = o.on();
                let host =
                    "the local range is neither GPU memory nor registered host memory".to_string();
                match (p.opcode, p.guard.region().gpu) {
                    // Device to device (unified addressing routes it between GPUs).
                    (Opcode::Write, Some(_)) => cuda
                        .dtod(on, remote, p.local, len)
                        .map_err(|e| e.to_string()),
                    (Opcode::Read, Some(_)) => cuda
                        .dtod(on, p.local, remote, len)
                        .map_err(|e| e.to_string()),
                    (Opcode::Write, None) => p
                        .host_bytes()
                        .ok_or(host)
                        .and_then(|src| cuda.htod(on, remote, src).map_err(|e| e.to_string())),
                    (Opcode::Read, None) => p
                        .host_bytes_mut()
                        .ok_or(host)
                        .and_then(|dst| cuda.dtoh(on, dst, remote).map_err(|e| e.to_string())),
                }
            })
            .collect();
        super::copy::leave(shm);
        let gone = shm.exited();
        for (p, r) in pieces.into_iter().zip(results) {
            match r {
                _ if gone => p.task.piece_failed(
                    FailKind::Failed,
                    FailCause::PeerLost.because(format!(
                        "{}: process {} exited during the transfer",
                        peer.name, shm.pid
                    )),
                ),
                Ok(()) => {
                    GPU_IPC_BYTES.fetch_add(p.len, Ordering::Relaxed);
                    let len = p.len;
                    p.task.piece_done(len);
                }
                Err(e) => p.task.piece_failed(
                    FailKind::Failed,
                    FailCause::Other.because(format!(
                        "{}: GPU copy through CUDA IPC failed: {e}",
                        peer.name
                    )),
                ),
            }
        }
        return;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer's export list may claim any range: finding the export of a request never
    /// overflows (a debug build panicked on `addr + len` past the address space).
    #[test]
    fn covering_a_range_never_overflows_on_a_peers_exports() {
        let e = |addr: u64, len: u64| GpuExport {
            addr,
            len,
            export: String::new(),
        };
        let list = [e(u64::MAX - 10, 100), e(0x1000, 0x1000)];
        assert!(
            covering(&list, u64::MAX - 5, 1).is_none(),
            "an export past the end covers nothing"
        );
        assert_eq!(covering(&list, 0x1800, 0x800).map(|x| x.addr), Some(0x1000));
        assert!(covering(&list, 0x1800, 0x801).is_none());
        assert!(covering(&list, u64::MAX, 2).is_none());
    }
}
