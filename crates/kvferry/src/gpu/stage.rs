//! The initiator's side of a transfer whose local range is GPU memory: staged through host
//! bounce buffers with the driver's copies, so every transport moves host memory only.
//!
//! A piece whose local address lies in device memory ([`is_staged`]) is cut into chunks of
//! [`CHUNK`] bytes. For a WRITE each chunk is copied device→host into a bounce buffer, then
//! sent as a sub-piece (local = the bounce buffer, the same remote range, the original's
//! guard and deadline) through the engine's ordinary dispatch; for a READ the sub-piece lands
//! in the bounce buffer and is copied host→device once its transport reported it landed. Up
//! to [`WINDOW`] chunks are in flight at once, so the copy of one chunk overlaps the network
//! time of the others. The original piece ends once every chunk ended: COMPLETED only after
//! the last host→device copy returned (completed means landed in GPU memory), else with the
//! first chunk's failure. The bounce buffers live until their sub-piece is terminal
//! (terminal means untouched), then are reused.
//!
//! [`WORKERS`] worker threads per engine, started at first use, take jobs (one submission's
//! pieces for one peer) from one queue; a worker blocks only on sub-pieces, each of which ends
//! by the original's deadline.

use super::{cuda, Bounce, Cuda};
use crate::batch::{Batch, FailCause, FailKind, Failure, TaskState, TaskStatus};
use crate::transport::{Peer, Piece};
use crate::wire::tcp::Opcode;
use std::collections::VecDeque;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Bytes staged per chunk.
pub const CHUNK: usize = 4 << 20;
/// Chunks in flight at once per worker.
pub const WINDOW: usize = 4;
/// Worker threads per engine (so one peer's large job does not hold up another's).
pub const WORKERS: usize = 2;

/// How sub-pieces are handed to the transports (the engine's dispatch).
pub(crate) type Dispatch = Box<dyn Fn(&Arc<Peer>, Vec<Piece>) + Send + Sync>;

/// Whether `p`'s local range is GPU memory to stage: inside a device-memory region (a
/// sub-piece, whose local address is a bounce buffer, is not).
pub(crate) fn is_staged(p: &Piece) -> bool {
    let r = p.guard.region();
    r.gpu.is_some() && p.local >= r.addr && p.local < r.end()
}

/// Splits `pieces` into (host-local, GPU-local).
pub(crate) fn split(pieces: Vec<Piece>) -> (Vec<Piece>, Vec<Piece>) {
    if !pieces.iter().any(is_staged) {
        return (pieces, Vec::new());
    }
    pieces.into_iter().partition(|p| !is_staged(p))
}

/// Pieces for one peer, queued for the worker.
type Job = (Arc<Peer>, Vec<Piece>);

/// The staging worker of one engine.
#[derive(Default)]
pub(crate) struct Stager {
    tx: Mutex<Option<Sender<Job>>>,
}

impl Stager {
    /// Queues GPU-local pieces for `peer`; starts the worker with `make()` at first use.
    pub(crate) fn submit(&self, peer: &Arc<Peer>, pieces: Vec<Piece>, make: impl FnOnce() -> Dispatch) {
        let cuda = match cuda() {
            Ok(c) => c,
            Err(why) => return fail_all(pieces, FailKind::Failed, FailCause::Other.because(format!("GPU memory cannot be copied: {why}"))),
        };
        for p in &pieces {
            p.task.set_pending();
        }
        let mut slot = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            let (tx, rx) = channel::<Job>();
            let rx = Arc::new(Mutex::new(rx));
            let dispatch: Arc<Dispatch> = Arc::new(make());
            for _ in 0..WORKERS {
                let (rx, dispatch) = (Arc::clone(&rx), Arc::clone(&dispatch));
                let spawned = std::thread::Builder::new().name("kvf-gpu-stage".into()).spawn(move || {
                    let mut w = Worker { cuda, dispatch, spare: Vec::new() };
                    // Ends when the engine (and its sender) is gone.
                    loop {
                        let job = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                        let Ok((peer, pieces)) = job else { break };
                        w.run(&peer, pieces);
                    }
                });
                if let Err(e) = spawned {
                    if slot.is_some() {
                        break; // one worker is enough to go on
                    }
                    return fail_all(pieces, FailKind::Failed, format!("cannot start the GPU staging thread: {e}").into());
                }
                if slot.is_none() {
                    *slot = Some(tx.clone());
                }
            }
        }
        if let Some(tx) = slot.as_ref() {
            if let Err(std::sync::mpsc::SendError((_, pieces))) = tx.send((Arc::clone(peer), pieces)) {
                fail_all(pieces, FailKind::Failed, FailCause::ShutDown.because("engine shut down"));
            }
        }
    }
}

fn fail_all(pieces: Vec<Piece>, kind: FailKind, f: Failure) {
    for p in pieces {
        p.task.piece_failed(kind, f.clone());
    }
}

/// One original piece being staged.
struct Track {
    piece: Option<Piece>,
    /// Chunks not yet ended (in flight or not yet sent).
    left: usize,
    failed: Option<(FailKind, Failure)>,
}

impl Track {
    fn fail(&mut self, kind: FailKind, f: Failure) {
        if self.failed.is_none() {
            self.failed = Some((kind, f));
        }
    }

    /// Ends the original piece once no chunk is left.
    fn settle(&mut self) {
        if self.left > 0 {
            return;
        }
        if let Some(p) = self.piece.take() {
            match self.failed.take() {
                None => p.task.piece_done(p.len),
                Some((kind, f)) => p.task.piece_failed(kind, f),
            }
        }
    }
}

/// A chunk handed to a transport.
struct Flight {
    track: usize,
    off: u64,
    n: usize,
    bounce: Bounce,
    batch: Arc<Batch>,
}

struct Worker {
    cuda: &'static Cuda,
    dispatch: Arc<Dispatch>,
    spare: Vec<Bounce>,
}

impl Worker {
    fn run(&mut self, peer: &Arc<Peer>, pieces: Vec<Piece>) {
        let mut tracks: Vec<Track> = pieces
            .into_iter()
            .map(|p| Track { left: (p.len as usize).div_ceil(CHUNK), piece: Some(p), failed: None })
            .collect();
        let mut flights: VecDeque<Flight> = VecDeque::new();
        for i in 0..tracks.len() {
            let chunks = tracks[i].left;
            for k in 0..chunks {
                if tracks[i].failed.is_some() {
                    tracks[i].left -= chunks - k;
                    break;
                }
                while flights.len() >= WINDOW {
                    let f = flights.pop_front().expect("non-empty");
                    self.finish(&mut tracks, f);
                }
                let Some(p) = tracks[i].piece.as_ref() else { break };
                let off = (k * CHUNK) as u64;
                let n = CHUNK.min((p.len - off) as usize);
                let gpu = p.guard.region().gpu.unwrap_or(0);
                if let Some((kind, f)) = stop(p, Instant::now()) {
                    tracks[i].fail(kind, f);
                    tracks[i].left -= chunks - k;
                    break;
                }
                let mut bounce = self.spare.pop().unwrap_or_else(|| Bounce::new(self.cuda, CHUNK));
                if p.opcode == Opcode::Write {
                    let at = p.local + off;
                    if let Err(e) = self.cuda.dtoh(gpu, &mut bounce.as_mut_slice()[..n], at) {
                        self.spare.push(bounce);
                        tracks[i].fail(FailKind::Failed, format!("copying GPU {gpu} memory at 0x{at:x} to host: {e}").into());
                        tracks[i].left -= chunks - k;
                        break;
                    }
                }
                let batch = Arc::new(Batch::new(1));
                let task = Arc::new(TaskState::new(p.task.deadline(), Arc::clone(&batch.signal)));
                batch.tasks.lock().unwrap_or_else(|e| e.into_inner()).push(Arc::clone(&task));
                let sub = Piece { opcode: p.opcode, local: bounce.addr(), remote: p.remote + off, len: n as u64, task, guard: p.guard.clone() };
                (self.dispatch)(peer, vec![sub]);
                flights.push_back(Flight { track: i, off, n, bounce, batch });
            }
            tracks[i].settle();
        }
        while let Some(f) = flights.pop_front() {
            self.finish(&mut tracks, f);
        }
    }

    /// Waits for a chunk's sub-piece to end; a READ's bytes then go host→device.
    fn finish(&mut self, tracks: &mut [Track], f: Flight) {
        f.batch.wait_terminal();
        let st = f.batch.wait_all(Duration::ZERO).pop();
        let t = &mut tracks[f.track];
        match (st, t.piece.as_ref()) {
            (Some(s), Some(p)) if s.status == TaskStatus::Completed => {
                if p.opcode == Opcode::Read && t.failed.is_none() {
                    let gpu = p.guard.region().gpu.unwrap_or(0);
                    if let Some((kind, why)) = stop(p, Instant::now()) {
                        t.fail(kind, why);
                    } else if let Err(e) = self.cuda.htod(gpu, p.local + f.off, &f.bounce.as_slice()[..f.n]) {
                        t.fail(FailKind::Failed, format!("copying into GPU {gpu} memory at 0x{:x}: {e}", p.local + f.off).into());
                    }
                }
            }
            (Some(s), _) => {
                let kind = if s.status == TaskStatus::Timeout { FailKind::Timeout } else { FailKind::Failed };
                t.fail(kind, s.cause.unwrap_or_default().because(s.reason.unwrap_or_else(|| "a staged chunk failed".into())));
            }
            (None, _) => t.fail(FailKind::Failed, "a staged chunk vanished".into()),
        }
        self.spare.push(f.bounce);
        t.left -= 1;
        t.settle();
    }
}

/// Why a piece must not be copied any more: its range is being unregistered, or its
/// deadline passed.
fn stop(p: &Piece, now: Instant) -> Option<(FailKind, Failure)> {
    if p.guard.is_revoked() {
        return Some((FailKind::Failed, FailCause::Other.because(format!("[0x{:x}, +{}) was unregistered during the transfer", p.local, p.len))));
    }
    (now >= p.task.deadline()).then(|| (FailKind::Timeout, FailCause::Timeout.because("the deadline passed while staging GPU memory")))
}
