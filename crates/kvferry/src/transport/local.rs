//! Transfers to the engine's own segment: a checked memcpy.

use super::{Caps, Kinds, Mem, Needs, Peer, Piece, Prelude, Reach, Transport};
use crate::batch::{FailCause, FailKind};
use crate::memory::MemoryRegistry;
use crate::wire::descriptor::SegmentDesc;
use crate::wire::tcp::Opcode;
use std::sync::Arc;

pub(crate) struct LocalTransport {
    registry: Arc<MemoryRegistry>,
}

impl LocalTransport {
    pub(crate) fn new(registry: Arc<MemoryRegistry>) -> Self {
        LocalTransport { registry }
    }
}

impl Transport for LocalTransport {
    fn name(&self) -> &'static str {
        "local"
    }

    /// Host memory here to host or GPU memory of the engine's own segment (the driver copies
    /// into or out of GPU memory there); GPU memory here is staged into host buffers first.
    fn caps(&self) -> Caps {
        Caps {
            kinds: Kinds::local(Mem::Host),
            reach: Reach::Own,
            needs: Needs::Nothing,
            stageable: true,
        }
    }

    fn describe(&self, _desc: &mut SegmentDesc, _prelude: Prelude) {}

    fn reachable(&self, peer: &Arc<Peer>) -> Result<(), String> {
        if peer.id == 0 {
            Ok(())
        } else {
            Err("not this engine's own segment".into())
        }
    }

    fn submit(&self, _peer: &Arc<Peer>, pieces: Vec<Piece>, _inline: bool) {
        for p in pieces {
            let Some(remote) = self.registry.check(p.remote, p.len) else {
                p.task.piece_failed(
                    FailKind::Failed,
                    FailCause::RemoteNotRegistered.because(format!(
                        "local segment: [0x{:x}, +{}) is not inside registered memory",
                        p.remote, p.len
                    )),
                );
                continue;
            };
            if let Some(gpu) = remote.region().gpu {
                // GPU memory on the target side: the driver copies (the local side is host
                // memory: GPU-local pieces reach here as staged host buffers).
                let r = match (crate::gpu::cuda(), p.opcode) {
                    (Err(why), _) => Err(why.to_string()),
                    (Ok(c), Opcode::Write) => match p.host_bytes() {
                        Some(src) => c.htod(gpu, p.remote, src).map_err(|e| e.to_string()),
                        None => Err("the local range is not registered host memory".into()),
                    },
                    (Ok(c), Opcode::Read) => match p.host_bytes_mut() {
                        Some(dst) => c.dtoh(gpu, dst, p.remote).map_err(|e| e.to_string()),
                        None => Err("the local range is not registered host memory".into()),
                    },
                };
                match r {
                    Ok(()) => p.task.piece_done(p.len),
                    Err(e) => p.task.piece_failed(
                        FailKind::Failed,
                        format!("local segment, GPU {gpu} memory: {e}"),
                    ),
                }
                continue;
            }
            let (src, dst) = match p.opcode {
                Opcode::Write => (p.local, p.remote),
                Opcode::Read => (p.remote, p.local),
            };
            // SAFETY: both ranges lie inside registered memory (guards held), which the owner
            // promised stays valid while registered; `copy` tolerates overlap.
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, p.len as usize) };
            p.task.piece_done(p.len);
        }
    }

    fn shutdown(&self) {}
}
