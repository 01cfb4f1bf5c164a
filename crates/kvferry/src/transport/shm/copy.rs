//! Copying: jobs, worker threads, the bounds/epoch/in-flight protocol around every copy,
//! and the two copy paths (`memcpy` into a mapped peer buffer, cross-memory attach).

use super::attach::ShmPeer;
use super::cma::*;
use super::maps::PeerMap;
use super::{Shared, ShmInfo, CMA_BYTES, MAPPED_BYTES, MAX_IOV};
use crate::batch::{FailCause, FailKind};
use crate::transport::{Peer, Piece};
use crate::wire::tcp::Opcode;
use std::collections::VecDeque;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

pub(super) struct Job {
    pub(super) shm: Arc<ShmPeer>,
    pub(super) peer: Arc<Peer>,
    pub(super) pieces: Vec<Piece>,
    /// The pieces' remote ranges are the peer's GPU memory, opened through CUDA IPC.
    pub(super) gpu: bool,
}

#[derive(Default)]
pub(super) struct Queue {
    pub(super) jobs: VecDeque<Job>,
    pub(super) shutdown: bool,
    pub(super) workers: usize,
}

pub(super) fn worker(shared: Arc<Shared>) {
    loop {
        let job = {
            let mut q = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if let Some(j) = q.jobs.pop_front() {
                    break j;
                }
                if q.shutdown {
                    q.workers = q.workers.saturating_sub(1);
                    return;
                }
                q = shared.cv.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        run_job(&shared, job);
    }
}

pub(super) fn fail_all(pieces: Vec<Piece>, kind: FailKind, cause: FailCause, reason: &str) {
    for p in pieces {
        p.task.piece_failed(kind, cause.because(reason));
    }
}

pub(super) fn errno_reason(peer: &str, pid: i32, p: &Piece, e: &io::Error) -> String {
    match errno(e) {
        Some(Errno::SRCH) => format!("{peer}: process {pid} exited"),
        Some(Errno::FAULT) => format!(
            "{peer}: [0x{:x}, +{}) is not mapped in process {pid} (it freed or unmapped memory it still has registered?)",
            p.remote, p.len
        ),
        Some(Errno::PERM) | Some(Errno::ACCESS) => not_permitted(pid, "access to", e),
        _ => format!("{peer}: cross-memory copy of [0x{:x}, +{}) failed: {e}", p.remote, p.len),
    }
}

/// Fails the pieces whose deadline passed before they could be copied; marks the others
/// pending (every same-host copy path starts so).
pub(super) fn admit(peer: &Peer, pieces: &mut Vec<Piece>) {
    let now = Instant::now();
    pieces.retain(|p| {
        if now >= p.task.deadline() {
            p.task.piece_failed(
                FailKind::Timeout,
                format!(
                    "{}: the request waited past its deadline before it could be copied",
                    peer.name
                ),
            );
            false
        } else {
            p.task.set_pending();
            true
        }
    });
}

/// The peer's current descriptor and the epoch it was published at, or why the copies must
/// fail (the peer exited, restarted or stopped offering shared memory).
pub(super) fn current(
    shm: &ShmPeer,
    peer: &Peer,
) -> Result<(Arc<crate::wire::descriptor::SegmentDesc>, u64), String> {
    if shm.exited_lately() {
        return Err(format!("{}: process {} exited", peer.name, shm.pid));
    }
    let desc = peer.desc();
    match ShmInfo::cookie_epoch(&desc) {
        Some((c, e)) if c == shm.cookie => Ok((Arc::clone(&desc), e)),
        _ => Err(format!(
            "{}: the peer restarted or stopped offering shared memory during the transfer",
            peer.name
        )),
    }
}

/// What entering the copy window gave ([`enter`]).
pub(super) enum Entered {
    /// The in-flight counter is raised and the epoch is the descriptor's: copy, then
    /// lower the counter.
    Copy,
    /// The peer unregistered memory meanwhile: its descriptor was re-read; check again.
    Again,
    /// Give up, failing the pieces for this reason.
    Fail(String),
}

/// Raises our in-flight counter in the peer's control region and checks that its epoch is
/// still `desc_epoch` (both sequentially consistent: either the peer's `unregister` sees the
/// counter and waits, or we see its new epoch and do not copy); on a moved epoch, lowers the
/// counter and re-reads the descriptor (at most three times per job).
pub(super) fn enter(
    shared: &Shared,
    shm: &ShmPeer,
    peer: &Arc<Peer>,
    desc_epoch: u64,
    refreshed: &mut u32,
) -> Entered {
    let active = shm.ctl.active(shm.slot);
    active.fetch_add(1, Ordering::SeqCst);
    if shm.ctl.epoch().load(Ordering::SeqCst) == desc_epoch {
        return Entered::Copy;
    }
    active.fetch_sub(1, Ordering::SeqCst);
    if shm.ctl.closed().load(Ordering::SeqCst) != 0 {
        return Entered::Fail(format!("{}: the peer engine shut down", peer.name));
    }
    *refreshed += 1;
    let r = match *refreshed {
        1..=3 => shared.dir.refresh(peer),
        _ => Err("it keeps unregistering memory".to_string()),
    };
    match r {
        Ok(()) => Entered::Again,
        Err(e) => Entered::Fail(format!(
            "{}: its registrations changed and its descriptor cannot be re-read: {e}",
            peer.name
        )),
    }
}

/// Lowers the in-flight counter raised by [`enter`].
pub(super) fn leave(shm: &ShmPeer) {
    shm.ctl.active(shm.slot).fetch_sub(1, Ordering::SeqCst);
}

/// Copies the pieces of one job: check bounds and epoch, copy, check the peer still lives.
pub(super) fn run_job(shared: &Shared, job: Job) {
    let Job {
        shm,
        peer,
        mut pieces,
        gpu,
    } = job;
    if gpu {
        return super::gpu::run(shared, &shm, &peer, pieces);
    }
    admit(&peer, &mut pieces);
    let mut refreshed = 0;
    while !pieces.is_empty() {
        let (desc, desc_epoch) = match current(&shm, &peer) {
            Ok(d) => d,
            Err(why) => return fail_all(pieces, FailKind::Failed, FailCause::PeerLost, &why),
        };
        // Bounds: only ranges inside the peer's published buffers.
        pieces.retain(|p| {
            if desc.find_buffer(p.remote, p.len).is_some() {
                true
            } else {
                let e = crate::Error::RemoteNotRegistered {
                    segment: peer.name.clone(),
                    addr: p.remote,
                    len: p.len,
                };
                p.task.piece_failed(FailKind::Failed, &e);
                false
            }
        });
        if pieces.is_empty() {
            return;
        }
        let maps = shm.maps_for(&desc);
        let mapped: Vec<Option<(&Arc<PeerMap>, *mut u8)>> = pieces
            .iter()
            .map(|p| {
                maps.iter()
                    .find_map(|m| m.locate(p.remote, p.len).map(|at| (m, at)))
            })
            .collect();
        match enter(shared, &shm, &peer, desc_epoch, &mut refreshed) {
            Entered::Copy => {}
            Entered::Again => continue,
            Entered::Fail(why) => {
                return fail_all(pieces, FailKind::Failed, FailCause::PeerLost, &why)
            }
        }
        let (results, by_pid) = copy_all(shm.pid, &pieces, &mapped);
        drop(maps);
        leave(&shm);
        // A cross-memory copy reached the verified process only if its PID still names it
        // now: checked after every such copy. A copy into a mapped buffer reached the buffer
        // itself (its memfd, verified by identity, alive before and after the copy): no PID
        // was involved, so the 1 ms-fresh answer suffices there (one system call less per
        // small request).
        let gone = if by_pid {
            shm.exited()
        } else {
            shm.exited_lately()
        };
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
                    let len = p.len;
                    p.task.piece_done(len);
                }
                Err(e) => {
                    let reason = errno_reason(&peer.name, shm.pid, &p, &e);
                    let cause = match errno(&e) {
                        Some(Errno::SRCH) => FailCause::PeerLost,
                        Some(Errno::FAULT) => FailCause::RemoteNotRegistered,
                        _ => FailCause::Other,
                    };
                    p.task.piece_failed(FailKind::Failed, cause.because(reason));
                }
            }
        }
        return;
    }
}

/// Copies every piece: into or out of the peer's memory mapped here where `mapped` has the
/// address, else by cross-memory attach (runs of the same opcode share one system call).
/// One result per piece, and whether any cross-memory (PID-addressed) copy was made.
///
/// A mapped copy counts only if the buffer was alive (not freed by its owner) before and
/// after it; otherwise it is redone by cross-memory attach, which reaches whatever the
/// address holds now (a new buffer there) or fails: never "done" into an orphaned memfd.
pub(super) fn copy_all(
    pid: i32,
    pieces: &[Piece],
    mapped: &[Option<(&Arc<PeerMap>, *mut u8)>],
) -> (Vec<io::Result<()>>, bool) {
    let mut out: Vec<io::Result<()>> = Vec::with_capacity(pieces.len());
    let mut by_pid = false;
    let mut mapped: Vec<Option<(&Arc<PeerMap>, *mut u8)>> = mapped
        .iter()
        .map(|m| m.filter(|(m, _)| m.alive()))
        .collect();
    let mut i = 0;
    while i < pieces.len() {
        if let Some((m, at)) = mapped[i] {
            let p = &pieces[i];
            m.prefault(at, p.len);
            // SAFETY: `p.local` lies in memory registered with this engine (its guard is
            // held); `at` lies inside a live shared mapping of the peer's sealed memfd
            // (`PeerMap::locate`), so neither side can fault; the ranges are in different
            // mappings, so they do not overlap.
            unsafe {
                match p.opcode {
                    Opcode::Write => {
                        std::ptr::copy_nonoverlapping(p.local as *const u8, at, p.len as usize)
                    }
                    Opcode::Read => std::ptr::copy_nonoverlapping(
                        at as *const u8,
                        p.local as *mut u8,
                        p.len as usize,
                    ),
                }
            }
            // The copy's stores come before the check (the owner clears `alive` before it
            // punches the pages out): alive now means it landed in the live buffer.
            std::sync::atomic::fence(Ordering::SeqCst);
            if !m.alive() {
                mapped[i] = None;
                continue; // redo by cross-memory attach
            }
            MAPPED_BYTES.fetch_add(p.len, Ordering::Relaxed);
            out.push(Ok(()));
            i += 1;
            continue;
        }
        let op = pieces[i].opcode;
        let mut j = i;
        while j < pieces.len() && j - i < MAX_IOV && pieces[j].opcode == op && mapped[j].is_none() {
            j += 1;
        }
        let run = &pieces[i..j];
        by_pid = true;
        let local: Vec<IoVec> = run
            .iter()
            .map(|p| IoVec::new(p.local, p.len as usize))
            .collect();
        let remote: Vec<IoVec> = run
            .iter()
            .map(|p| IoVec::new(p.remote, p.len as usize))
            .collect();
        let total: usize = local.iter().map(IoVec::len).sum();
        match cma(pid, op, &local, &remote) {
            Ok(n) if n == total => {
                CMA_BYTES.fetch_add(n as u64, Ordering::Relaxed);
                out.extend(run.iter().map(|_| Ok(())))
            }
            first => {
                // Partial or failed: the kernel stops at an iovec boundary. Keep the complete
                // prefix and redo the rest one by one to learn each outcome.
                let mut done = first.unwrap_or_default();
                for k in 0..run.len() {
                    let len = local[k].len();
                    if done >= len {
                        done -= len;
                        out.push(Ok(()));
                        continue;
                    }
                    done = 0;
                    out.push(match cma(pid, op, &local[k..=k], &remote[k..=k]) {
                        Ok(n) if n == len => Ok(()),
                        Ok(n) => Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            format!("copied {n} of {len} bytes"),
                        )),
                        Err(e) => Err(e),
                    });
                }
            }
        }
        i = j;
    }
    (out, by_pid)
}
