//! One request applied to the [`State`] at a given time: its answer and what must hold
//! before that answer may go out ([`Needs`]).
//!
//! Sans-IO: the caller (the RPC driver, `server/handlers.rs`, or the deterministic simulator) owns
//! the lock, the clock and the journal; this only decides. A put that finds the pool full of
//! objects being read is answered `NoAvailableHandle` here; waiting for those reads to end
//! and trying again ([`Attempt`]) is the driver's.

use super::{Attempt, MasterConfig, PutId, Removed, State, Stats};
use crate::error::StoreError;
use crate::proto::{Request, Response};

/// What a request's answer waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Needs {
    /// Nothing durable changed: the answer may go out at once (if the master still leads).
    Nothing,
    /// Durable state changed: the answer goes out once the journal holds the change (an HA
    /// leader; without HA nothing is journaled and this is [`Needs::Nothing`]'s equal).
    Journal,
    /// Every durable change is a put placed in space whose grant the journal already holds
    /// ([`State::placed_granted`]): a new leader holds that space even if this change never
    /// reaches it, so the answer may go out before the change is durable.
    Granted,
}

impl Needs {
    /// The needs of two requests answered together (one batch).
    pub fn and(self, other: Needs) -> Needs {
        match (self, other) {
            (Needs::Journal, _) | (_, Needs::Journal) => Needs::Journal,
            (Needs::Granted, _) | (_, Needs::Granted) => Needs::Granted,
            _ => Needs::Nothing,
        }
    }
}

/// A request applied ([`State::apply`]).
#[derive(Debug)]
pub struct Applied {
    pub result: Result<Response, StoreError>,
    pub needs: Needs,
}

impl State {
    /// Applies `req` (not a batch, nor the cluster key's handshake: those are refused) at
    /// `now`. A put start is tried as `attempt` says, placed in granted space only if its
    /// grant is among the first `grants_durable` ([`State::set_grants_durable`]). What a bulk
    /// removal took out goes to `removed`, for the caller to drop after it lets go of the
    /// state's lock (freeing a million keys is not done under it).
    #[allow(clippy::too_many_arguments)]
    pub fn apply(
        &mut self,
        cfg: &MasterConfig,
        stats: &Stats,
        req: &Request,
        now: u64,
        attempt: Attempt,
        grants_durable: u64,
        removed: &mut Option<Removed>,
    ) -> Applied {
        let before = self.marks();
        let put = matches!(req, Request::PutStart { .. });
        if put && self.granting() {
            self.set_grants_durable(grants_durable);
        }
        let result = self.apply_unmarked(cfg, stats, req, now, attempt, removed);
        let needs = match self.marks() == before {
            true => Needs::Nothing,
            false if put && self.placed_granted() => Needs::Granted,
            false => Needs::Journal,
        };
        Applied { result, needs }
    }

    fn apply_unmarked(
        &mut self,
        cfg: &MasterConfig,
        stats: &Stats,
        req: &Request,
        now: u64,
        attempt: Attempt,
        removed: &mut Option<Removed>,
    ) -> Result<Response, StoreError> {
        let lease = cfg.lease_ttl.as_millis() as u64;
        let release = cfg.put_start_release_timeout.as_millis() as u64;
        match req {
            // (Mounts are rare: their segments are copied.)
            Request::MountSegment { client, segment } => self.mount(*client, segment.clone(), now).map(|_| Response::Ok),
            Request::RemountSegments { client, segments } => self.remount(*client, segments.clone(), now, lease).map(|_| Response::Ok),
            Request::UnmountSegment { client, segment } => self.unmount(*client, *segment, now, release).map(|_| Response::Ok),
            Request::Ping { client } => Ok(Response::Ping(self.ping(*client, now))),
            Request::PutStart { client, key, size, config, upsert, put } => self.put_start_ex(cfg, stats, PutId { client: *client, put: *put }, key, *size, config, *upsert, now, attempt).map(Response::Replicas),
            Request::ReleaseReads { ids } => {
                self.release_reads(ids, now);
                Ok(Response::Ok)
            }
            Request::BatchReplicaClear { client, keys, segment } => Ok(Response::Keys(self.batch_replica_clear(*client, keys, segment, now))),
            Request::HoldWrites { client, writes } => {
                let (client, held) = (*client, self.hold_writes(*client, writes, now, release)?);
                tracing::info!(client = format!("{client:x}"), writes = writes.len(), segments = held, "a client reported writes still running that this master did not place: nothing new goes where they write until they are over");
                Ok(Response::Ok)
            }
            Request::PutEnd { client, key, put } => self.put_end(PutId { client: *client, put: *put }, key, now).map(|_| Response::Ok),
            Request::PutRevoke { client, key, put } => self.put_revoke(PutId { client: *client, put: *put }, key).map(|_| Response::Ok),
            Request::GetReplicaList { key } => self.locate(key, now, lease),
            Request::OffloadBeat { client, beat } => self.offload_beat(*client, beat, now, stats).map(Response::Offload),
            Request::ExistKey { key } => self.exist_key(key, now, lease).map(Response::Exists),
            Request::ProbeKey { key } => self.probe_key(key).map(Response::Exists),
            Request::Remove { key, force } => self.remove(cfg, key, *force, now).map(|_| Response::Ok),
            Request::RemoveAll { force } => Ok(Response::Count(removed.insert(self.remove_matching(cfg, |_| true, *force, now)).count())),
            // (Compiled under the state's lock: bounded, so that no pattern holds it long.)
            Request::RemoveByRegex { pattern, force } => match regex::RegexBuilder::new(pattern).size_limit(256 << 10).dfa_size_limit(1 << 20).build() {
                Ok(re) => Ok(Response::Count(removed.insert(self.remove_matching(cfg, |k| re.is_match(k), *force, now)).count())),
                Err(e) => Err(StoreError::InvalidParams(format!("bad regex {pattern:?}: {e}"))),
            },
            Request::CreateCopyTask { key, targets } => self.create_copy_task(key, targets, now).map(Response::Task),
            Request::CreateMoveTask { key, source, target } => self.create_move_task(key, source, target, now).map(Response::Task),
            Request::QueryTask { id } => self.query_task(*id, now).map(|i| Response::TaskInfo(Box::new(i))),
            Request::FetchTasks { client, max } => Ok(Response::Tasks(self.fetch_tasks(*client, *max, now))),
            Request::CompleteTask { client, id, ok, message } => self.complete_task(*client, *id, *ok, message, now).map(|_| Response::Ok),
            Request::CopyStart { client, key, source, targets, put, remove_source } => self.copy_start(*client, key, source, targets, *put, *remove_source, now, lease).map(|p| Response::Copy(Box::new(p))),
            Request::CopyEnd { client, key, put } => self.copy_end(*client, key, *put, now).map(|_| Response::Ok),
            Request::Batch(_) => Err(StoreError::InvalidParams("nested batches are not allowed".into())),
            Request::AuthHello { .. } | Request::AuthProof { .. } => Err(StoreError::InvalidParams("the cluster key's handshake opens a connection (AuthHello, alone, as its first frame); not in a batch nor after".into())),
        }
    }
}
