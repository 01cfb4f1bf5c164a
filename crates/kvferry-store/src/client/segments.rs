//! Segments mounted after setup (Mooncake's `allocate_and_mount_segment` and
//! `unmount_and_free_segment`): more of this client's memory offered to the pool, each a
//! segment of its own at the master, remounted with the setup's segment after a failover or
//! a master restart. An unmounted segment's memory is kept (registered) until no transfer
//! can touch it any more: a reader that was given one of its replicas may be reading it.

use super::rpc::Conn;
use super::Client;
use crate::error::{StoreError, StoreResult};
use crate::proto::{Request, Segment};
use kvferry::hostbuf::HostBuffer;
use std::time::{Duration, Instant};

/// The segments mounted after setup, and the memory of those unmounted since.
#[derive(Default)]
pub(super) struct More {
    mounted: Vec<(HostBuffer, Segment)>,
    /// Memory of unmounted segments, until when a transfer may still touch it.
    retired: Vec<(HostBuffer, Instant)>,
}

impl Client {
    /// Mounts `size` more bytes of this client's memory (allocated here, registered with its
    /// engine) as a segment of its own; its id and size.
    pub fn mount_more(&self, size: u64) -> StoreResult<(u64, u64)> {
        self.check_open()?;
        if size == 0 {
            return Err(StoreError::InvalidParams("a segment of 0 bytes".into()));
        }
        let (buf, seg) = super::new_segment(
            &self.inner.engine,
            size,
            &format!("a segment of {size} bytes"),
        )?;
        let engine = &self.inner.engine;
        let mounted = self.inner.rpc.call_ok(&Request::MountSegment {
            client: self.inner.id,
            segment: seg.clone(),
        });
        if let Err(e) = mounted {
            let _ = engine.unregister_memory(buf.addr());
            return Err(e);
        }
        let out = (seg.id, seg.size);
        self.registration().segments.push(seg.clone());
        self.more().mounted.push((buf, seg));
        Ok(out)
    }

    /// Unmounts a segment [`Client::mount_more`] mounted: its objects' replicas there are
    /// dropped at once; its memory is freed once `grace` and the longest a transfer may still
    /// touch it (twice the transfer timeout) have passed, by a later call or at close.
    pub fn unmount_more(&self, id: u64, grace: Duration) -> StoreResult<()> {
        self.check_open()?;
        let found = {
            let mut more = self.more();
            let at = more.mounted.iter().position(|(_, s)| s.id == id);
            at.map(|i| more.mounted.remove(i))
        };
        let Some((buf, seg)) = found else {
            return Err(StoreError::InvalidParams(format!(
                "segment {id:x} is not one this client mounted after setup"
            )));
        };
        self.registration().segments.retain(|s| s.id != id);
        let r = self.inner.rpc.call_ok(&Request::UnmountSegment {
            client: self.inner.id,
            segment: seg.id,
        });
        let until = Instant::now() + grace + self.inner.cfg.transfer_timeout * 2;
        let mut more = self.more();
        more.retired.push((buf, until));
        self.free_retired(&mut more, Instant::now());
        r.map(|_| ())
    }

    /// The segments mounted after setup: (id, size).
    pub fn more_segments(&self) -> Vec<(u64, u64)> {
        self.more()
            .mounted
            .iter()
            .map(|(_, s)| (s.id, s.size))
            .collect()
    }

    /// At close: unmounts every segment mounted after setup (best effort, within `wait`);
    /// the addresses of their memory, mounted or retired (freed with the client).
    pub(super) fn unmount_all_more(&self, wait: Duration) -> Vec<u64> {
        let more = self.more();
        for (_, seg) in &more.mounted {
            let _ = self.inner.rpc.call_within(
                &Request::UnmountSegment {
                    client: self.inner.id,
                    segment: seg.id,
                },
                wait,
                Conn::Pool,
            );
        }
        more.mounted
            .iter()
            .map(|(b, _)| b.addr())
            .chain(more.retired.iter().map(|(b, _)| b.addr()))
            .collect()
    }

    fn free_retired(&self, more: &mut More, now: Instant) {
        let engine = &self.inner.engine;
        more.retired.retain(|(b, until)| {
            let keep = *until > now;
            if !keep {
                let _ = engine.unregister_memory(b.addr());
            }
            keep
        });
    }

    fn more(&self) -> std::sync::MutexGuard<'_, More> {
        self.inner.more.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn registration(&self) -> std::sync::MutexGuard<'_, super::rpc::Registration> {
        self.inner
            .rpc
            .registration
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
#[path = "segments_tests.rs"]
mod tests;
