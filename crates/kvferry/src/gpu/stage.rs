//! The initiator's side of a transfer whose local range is GPU memory: staged through host
//! bounce buffers with the driver's copies, so every transport moves host memory only.
//!
//! `StagedTransport` is a transport decorator: it wraps a transport that moves host memory
//! (TCP, shared memory, the local copy) and serves pieces whose local range is GPU memory on
//! top of it, to the peers and remote memory kinds the wrapped one serves. The router picks it
//! by its declaration like any transport.
//!
//! Such a piece is cut into chunks of [`CHUNK`] bytes. For a WRITE each chunk is copied
//! device→host into a bounce buffer, then sent as a sub-piece (local = the bounce buffer, the
//! same remote range, the original's guard and deadline) through the wrapped transport; for a
//! READ the sub-piece lands in the bounce buffer and is copied host→device once its transport
//! reported it landed.
//!
//! The copies are asynchronous: queued on a stream per GPU and direction, each with an event
//! recorded behind it. Up to [`WINDOW`] chunks are in flight at once, so a chunk's copy runs
//! while earlier chunks are sent, received or copied the other way, and a device→host copy
//! (one copy engine) alongside a host→device one (the other). What is waited for, and when:
//! a WRITE chunk's bounce buffer is sent only after its copy's event; a READ chunk's bounce
//! buffer is reused, and its chunk counted done, only after its host→device copy's event; a
//! chunk whose piece failed is still waited for before its buffer is reused. The original
//! piece ends once every chunk ended: COMPLETED only after the last host→device copy was
//! waited for (completed means landed in GPU memory), else with the first chunk's failure.
//! The piece (and its registration guard) is held until then, so no queued copy touches a
//! range after `unregister` returned.
//!
//! [`WORKERS`] worker threads per engine (one `Stager`, shared by the engine's decorators),
//! started at first use, take jobs (one submission's pieces for one peer, and the transport
//! they go through) from one queue; a worker blocks only on sub-pieces, each of which ends by
//! the original's deadline.

use super::{cuda, Bounce, Cuda};
use crate::batch::{Batch, FailCause, FailKind, Failure, TaskState, TaskStatus};
use crate::sys::cuda::{CudaError, Handle};
use crate::transport::{Caps, Peer, Piece, Prelude, Transport};
use crate::wire::descriptor::SegmentDesc;
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
pub(crate) const WORKERS: usize = 2;

/// A transport decorator: pieces whose local range is GPU memory, staged through host bounce
/// buffers and moved by the wrapped transport (see the module's doc).
pub(crate) struct StagedTransport {
    inner: Arc<dyn Transport>,
    stager: Arc<Stager>,
}

impl StagedTransport {
    /// Stages over `inner` (a transport whose [`Caps::stageable`] holds), with the engine's
    /// staging workers.
    pub(crate) fn new(inner: Arc<dyn Transport>, stager: Arc<Stager>) -> StagedTransport {
        StagedTransport { inner, stager }
    }
}

impl Transport for StagedTransport {
    /// The wrapped transport's name: what carries the bytes, in reasons and diagnostics.
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    /// From GPU memory here, to the memory kinds and peers the wrapped transport serves from
    /// host memory.
    fn caps(&self) -> Caps {
        let c = self.inner.caps();
        Caps {
            kinds: c.kinds.staged(),
            stageable: false,
            ..c
        }
    }

    /// Nothing: the wrapped transport publishes what it needs itself.
    fn describe(&self, _desc: &mut SegmentDesc, _prelude: Prelude) {}

    fn reachable(&self, peer: &Arc<Peer>) -> Result<(), String> {
        self.inner.reachable(peer)
    }

    fn submit(&self, peer: &Arc<Peer>, pieces: Vec<Piece>, _inline: bool) {
        self.stager.submit(peer, pieces, Arc::clone(&self.inner));
    }

    /// Nothing: the wrapped transport is shut down by its owner; the workers end with the
    /// last decorator (their queue's sender goes with the [`Stager`]).
    fn shutdown(&self) {}
}

/// Where a job's chunks go: the peer, through the wrapped transport.
struct Dest {
    peer: Arc<Peer>,
    via: Arc<dyn Transport>,
}

/// Pieces for one peer, queued for the worker.
type Job = (Dest, Vec<Piece>);

/// The staging worker of one engine.
#[derive(Default)]
pub(crate) struct Stager {
    tx: Mutex<Option<Sender<Job>>>,
}

impl Stager {
    /// Queues GPU-local pieces for `peer`, their chunks to go through `via`; starts the
    /// workers at first use.
    fn submit(&self, peer: &Arc<Peer>, pieces: Vec<Piece>, via: Arc<dyn Transport>) {
        let cuda = match cuda() {
            Ok(c) => c,
            Err(why) => {
                return fail_all(
                    pieces,
                    FailKind::Failed,
                    FailCause::Other.because(format!("GPU memory cannot be copied: {why}")),
                )
            }
        };
        for p in &pieces {
            p.task.set_pending();
        }
        let mut slot = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            let (tx, rx) = channel::<Job>();
            let rx = Arc::new(Mutex::new(rx));
            for _ in 0..WORKERS {
                let rx = Arc::clone(&rx);
                let spawned = std::thread::Builder::new()
                    .name("kvf-gpu-stage".into())
                    .spawn(move || {
                        let mut w = Worker {
                            cuda,
                            spare: Vec::new(),
                            lanes: Vec::new(),
                        };
                        // Ends when the engine (and its sender) is gone.
                        loop {
                            let job = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                            let Ok((to, pieces)) = job else { break };
                            w.run(&to, pieces);
                        }
                    });
                if let Err(e) = spawned {
                    if slot.is_some() {
                        break; // one worker is enough to go on
                    }
                    return fail_all(
                        pieces,
                        FailKind::Failed,
                        format!("cannot start the GPU staging thread: {e}").into(),
                    );
                }
                if slot.is_none() {
                    *slot = Some(tx.clone());
                }
            }
        }
        if let Some(tx) = slot.as_ref() {
            let to = Dest {
                peer: Arc::clone(peer),
                via,
            };
            if let Err(std::sync::mpsc::SendError((_, pieces))) = tx.send((to, pieces)) {
                fail_all(
                    pieces,
                    FailKind::Failed,
                    FailCause::ShutDown.because("engine shut down"),
                );
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

/// Where a chunk is in the pipeline.
enum State {
    /// WRITE: its device→host copy into the bounce buffer is queued; the event marks its end.
    Copying(Handle),
    /// Its sub-piece is with a transport.
    Sending(Arc<Batch>),
    /// READ: its host→device copy out of the bounce buffer is queued; the event marks its end.
    Landing(Handle),
}

/// A chunk in flight: its bounce buffer is owned here until the chunk ended, so no queued
/// copy or transport can outlive the buffer it uses.
struct Flight {
    track: usize,
    off: u64,
    n: usize,
    dev: u32,
    bounce: Bounce,
    state: State,
}

/// The worker's copy queues on one GPU: one stream per direction (so a device→host copy and a
/// host→device copy can run at once, on the GPU's two copy engines) and its spare events.
struct Lanes {
    to_host: Handle,
    to_device: Handle,
    events: Vec<Handle>,
}

struct Worker {
    cuda: &'static Cuda,
    spare: Vec<Bounce>,
    /// By device ordinal, created at the device's first chunk.
    lanes: Vec<Option<Lanes>>,
}

impl Worker {
    /// Stages `pieces` for `peer`. Up to [`WINDOW`] chunks are in flight; each goes
    /// Copying (WRITE) → Sending → Landing (READ) → ended. Copies are queued on the GPU's
    /// streams without waiting, so a chunk's copy runs while earlier chunks are waited for,
    /// sent or copied the other way; a bounce buffer is read (sent) or reused only after the
    /// event recorded behind its copy was waited for, and a piece ends only once all its
    /// chunks did.
    fn run(&mut self, peer: &Dest, pieces: Vec<Piece>) {
        let mut tracks: Vec<Track> = pieces
            .into_iter()
            .map(|p| Track {
                left: (p.len as usize).div_ceil(CHUNK),
                piece: Some(p),
                failed: None,
            })
            .collect();
        let mut flights: VecDeque<Flight> = VecDeque::new();
        for i in 0..tracks.len() {
            let chunks = tracks[i].left;
            for k in 0..chunks {
                while flights.len() >= WINDOW {
                    self.retire(&mut tracks, &mut flights, peer);
                }
                let why = match tracks[i].piece.as_ref() {
                    Some(p) => stop(p, Instant::now()),
                    None => break,
                };
                if let Some((kind, f)) = why {
                    tracks[i].fail(kind, f);
                }
                if tracks[i].failed.is_some() {
                    tracks[i].left -= chunks - k;
                    break;
                }
                let Some(p) = tracks[i].piece.as_ref() else {
                    break;
                };
                let off = (k * CHUNK) as u64;
                let n = CHUNK.min((p.len - off) as usize);
                let dev = p.guard.region().gpu.unwrap_or(0);
                let (opcode, at) = (p.opcode, p.local + off);
                let mut bounce = self
                    .spare
                    .pop()
                    .unwrap_or_else(|| Bounce::new(self.cuda, CHUNK));
                let state = if opcode == Opcode::Write {
                    let dst = bounce.as_mut_slice().as_mut_ptr();
                    match self.queue(dev, Direction::ToHost, dst, at, n) {
                        Ok(e) => State::Copying(e),
                        Err(e) => {
                            self.spare.push(bounce);
                            tracks[i].fail(
                                FailKind::Failed,
                                format!("copying GPU {dev} memory at 0x{at:x} to host: {e}").into(),
                            );
                            tracks[i].left -= chunks - k;
                            break;
                        }
                    }
                } else {
                    State::Sending(self.send(peer, p, off, n, &bounce))
                };
                flights.push_back(Flight {
                    track: i,
                    off,
                    n,
                    dev,
                    bounce,
                    state,
                });
                self.pump(&mut tracks, &mut flights, peer, false);
            }
            tracks[i].settle();
        }
        while !flights.is_empty() {
            self.retire(&mut tracks, &mut flights, peer);
        }
    }

    /// Hands chunk `[off, off+n)` of `p` to the wrapped transport as a sub-piece on `bounce`
    /// (one it refuses fails, saying why).
    fn send(&self, to: &Dest, p: &Piece, off: u64, n: usize, bounce: &Bounce) -> Arc<Batch> {
        let batch = Arc::new(Batch::new(1));
        let task = Arc::new(TaskState::new(p.task.deadline(), Arc::clone(&batch.signal)));
        batch
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::clone(&task));
        let sub = Piece {
            opcode: p.opcode,
            local: bounce.addr(),
            remote: p.remote + off,
            len: n as u64,
            task,
            guard: p.guard.clone(),
        };
        if let Err((subs, why)) = to.via.try_submit(&to.peer, vec![sub], false) {
            let e = crate::Error::NoTransport {
                segment: to.peer.name.clone(),
                reason: why,
            };
            for s in subs {
                s.task.piece_failed(FailKind::Failed, &e);
            }
        }
        batch
    }

    /// Moves flights on without waiting for the network: every queued device→host copy but
    /// the newest (`all`: the newest too) is waited for and its chunk sent, and every
    /// sub-piece that already ended is finished (a READ's host→device copy queued).
    fn pump(
        &mut self,
        tracks: &mut [Track],
        flights: &mut VecDeque<Flight>,
        peer: &Dest,
        all: bool,
    ) {
        let newest_copy = if all {
            None
        } else {
            flights
                .iter()
                .rposition(|f| matches!(f.state, State::Copying(_)))
        };
        let mut kept = VecDeque::with_capacity(flights.len());
        for (idx, f) in std::mem::take(flights).into_iter().enumerate() {
            let ready = match &f.state {
                State::Copying(_) => Some(idx) != newest_copy,
                State::Sending(b) => b.unfinished() == 0,
                State::Landing(_) => false,
            };
            if !ready {
                kept.push_back(f);
                continue;
            }
            // A Copying flight becomes Sending: one step. A Sending one may become Landing.
            if let Some(f) = self.step(tracks, peer, f) {
                kept.push_back(f);
            }
        }
        *flights = kept;
    }

    /// Ends at least one flight (blocking as long as needed: sub-pieces end by their
    /// deadline, copies are bounded).
    fn retire(&mut self, tracks: &mut [Track], flights: &mut VecDeque<Flight>, peer: &Dest) {
        let before = flights.len();
        while !flights.is_empty() && flights.len() >= before {
            self.pump(tracks, flights, peer, true);
            if flights.len() < before {
                return;
            }
            // The oldest host→device copy (copies end in queue order: the shortest wait),
            // else the oldest chunk.
            let idx = flights
                .iter()
                .position(|f| matches!(f.state, State::Landing(_)))
                .unwrap_or(0);
            let Some(f) = flights.remove(idx) else { return };
            if let Some(f) = self.step(tracks, peer, f) {
                flights.insert(idx, f);
            }
        }
    }

    /// Advances `f` by one state, waiting for what it waits on; `None` once it ended.
    fn step(&mut self, tracks: &mut [Track], peer: &Dest, mut f: Flight) -> Option<Flight> {
        let t = &mut tracks[f.track];
        match f.state {
            State::Copying(e) => {
                if let Err(why) = self.wait(f.dev, Direction::ToHost, e) {
                    let at = t.piece.as_ref().map_or(0, |p| p.local + f.off);
                    t.fail(
                        FailKind::Failed,
                        format!("copying GPU {} memory at 0x{at:x} to host: {why}", f.dev).into(),
                    );
                }
                // The bounce buffer holds the chunk now: send it, unless the piece failed.
                match t.piece.as_ref() {
                    Some(p) if t.failed.is_none() => {
                        f.state = State::Sending(self.send(peer, p, f.off, f.n, &f.bounce));
                        Some(f)
                    }
                    _ => self.end(t, f),
                }
            }
            State::Sending(ref batch) => {
                batch.wait_terminal();
                let st = batch.wait_all(Duration::ZERO).pop();
                match (st, t.piece.as_ref()) {
                    (Some(s), Some(p)) if s.status == TaskStatus::Completed => {
                        if p.opcode == Opcode::Read && t.failed.is_none() {
                            let at = p.local + f.off;
                            if let Some((kind, why)) = stop(p, Instant::now()) {
                                t.fail(kind, why);
                            } else {
                                let src = f.bounce.as_slice().as_ptr();
                                match self.queue(
                                    f.dev,
                                    Direction::ToDevice,
                                    src.cast_mut(),
                                    at,
                                    f.n,
                                ) {
                                    Ok(e) => {
                                        f.state = State::Landing(e);
                                        return Some(f);
                                    }
                                    Err(e) => t.fail(
                                        FailKind::Failed,
                                        format!(
                                            "copying into GPU {} memory at 0x{at:x}: {e}",
                                            f.dev
                                        )
                                        .into(),
                                    ),
                                }
                            }
                        }
                    }
                    (Some(s), _) => {
                        let kind = if s.status == TaskStatus::Timeout {
                            FailKind::Timeout
                        } else {
                            FailKind::Failed
                        };
                        t.fail(
                            kind,
                            s.cause.unwrap_or_default().because(
                                s.reason.unwrap_or_else(|| "a staged chunk failed".into()),
                            ),
                        );
                    }
                    (None, _) => t.fail(FailKind::Failed, "a staged chunk vanished".into()),
                }
                self.end(t, f)
            }
            State::Landing(e) => {
                if let Err(why) = self.wait(f.dev, Direction::ToDevice, e) {
                    let at = t.piece.as_ref().map_or(0, |p| p.local + f.off);
                    t.fail(
                        FailKind::Failed,
                        format!("copying into GPU {} memory at 0x{at:x}: {why}", f.dev).into(),
                    );
                }
                self.end(t, f)
            }
        }
    }

    /// A chunk ended (every copy of it waited for): its buffer is free again, and the piece
    /// ends if it was its last chunk.
    fn end(&mut self, t: &mut Track, f: Flight) -> Option<Flight> {
        self.spare.push(f.bounce);
        t.left -= 1;
        t.settle();
        None
    }

    /// GPU `dev`'s streams and spare events, created at first use.
    fn lanes(&mut self, dev: u32) -> Result<&mut Lanes, CudaError> {
        let i = dev as usize;
        if self.lanes.len() <= i {
            self.lanes.resize_with(i + 1, || None);
        }
        let cuda = self.cuda;
        let slot = &mut self.lanes[i];
        let lanes = match slot.take() {
            Some(l) => l,
            None => {
                let (to_host, to_device) = cuda.on_device(dev, |d| {
                    let a = d.stream_create()?;
                    match d.stream_create() {
                        Ok(b) => Ok((a, b)),
                        Err(e) => {
                            let _ = d.stream_destroy(a);
                            Err(e)
                        }
                    }
                })?;
                Lanes {
                    to_host,
                    to_device,
                    events: Vec::new(),
                }
            }
        };
        Ok(slot.insert(lanes))
    }

    /// Queues a copy of `n` bytes between the host buffer at `host` and device address `at`
    /// on GPU `dev`'s stream for `dir`, and records an event behind it; the event.
    fn queue(
        &mut self,
        dev: u32,
        dir: Direction,
        host: *mut u8,
        at: u64,
        n: usize,
    ) -> Result<Handle, CudaError> {
        let cuda = self.cuda;
        let lanes = self.lanes(dev)?;
        let stream = dir.stream(lanes);
        let event = match lanes.events.pop() {
            Some(e) => e,
            None => cuda.on_device(dev, |d| d.event_create())?,
        };
        let r = cuda.on_device(dev, |d| {
            // SAFETY: `host` is a bounce buffer of at least `n` bytes owned by the flight this
            // copy belongs to, which keeps it, and lets nothing else read or write it, until
            // this event was waited for (`step` and `retire` end no flight before that); the
            // device range lies inside a registered region whose guard the piece holds until
            // every chunk of it ended.
            unsafe {
                match dir {
                    Direction::ToHost => d.dtoh_async(host, at, n, stream),
                    Direction::ToDevice => d.htod_async(at, host, n, stream),
                }
            }
            .and_then(|()| d.event_record(event, stream))
        });
        if r.is_err() {
            // A copy may be queued without its event: let it finish before the buffer is
            // reused.
            let _ = cuda.on_device(dev, |d| d.stream_sync(stream));
        }
        if let Some(l) = self.lanes.get_mut(dev as usize).and_then(Option::as_mut) {
            if r.is_err() {
                l.events.push(event);
            }
        }
        r.map(|()| event)
    }

    /// Waits for `event` (queued on GPU `dev`'s `dir` stream); it is free again after.
    fn wait(&mut self, dev: u32, dir: Direction, event: Handle) -> Result<(), CudaError> {
        let cuda = self.cuda;
        let r = cuda.on_device(dev, |d| d.event_sync(event));
        if let Some(l) = self.lanes.get_mut(dev as usize).and_then(Option::as_mut) {
            if r.is_err() {
                // Whatever the event says, nothing may still be queued on the buffer.
                let s = dir.stream(l);
                let _ = cuda.on_device(dev, |d| d.stream_sync(s));
            }
            l.events.push(event);
        }
        r
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Every flight ended before `run` returned: the streams are idle.
        for (dev, l) in self.lanes.iter_mut().enumerate() {
            if let Some(l) = l.take() {
                let _ = self.cuda.on_device(dev as u32, |d| {
                    for e in l.events {
                        let _ = d.event_destroy(e);
                    }
                    let _ = d.stream_destroy(l.to_host);
                    d.stream_destroy(l.to_device)
                });
            }
        }
    }
}

#[derive(Clone, Copy)]
enum Direction {
    ToHost,
    ToDevice,
}

impl Direction {
    fn stream(self, l: &Lanes) -> Handle {
        match self {
            Direction::ToHost => l.to_host,
            Direction::ToDevice => l.to_device,
        }
    }
}

/// Why a piece must not be copied any more: its range is being unregistered, or its
/// deadline passed.
fn stop(p: &Piece, now: Instant) -> Option<(FailKind, Failure)> {
    if p.guard.is_revoked() {
        return Some((
            FailKind::Failed,
            FailCause::Other.because(format!(
                "[0x{:x}, +{}) was unregistered during the transfer",
                p.local, p.len
            )),
        ));
    }
    (now >= p.task.deadline()).then(|| {
        (
            FailKind::Timeout,
            FailCause::Timeout.because("the deadline passed while staging GPU memory"),
        )
    })
}
