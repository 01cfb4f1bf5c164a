//! The master's driver: [`Master`] holds what the state machine ([`crate::master`]) must not
//! (the lock, the clock, the HA handles, the metadata cleanup, the cached summary, the cluster
//! key) and only moves requests and time into [`State`].
//!
//! [`State`] is pure: every method takes the time (`now`, milliseconds on [`Master::now`]'s
//! monotonic clock) and does no I/O, holds no lock, reads no clock and draws no process-global
//! randomness (this driver seeds its generator: [`State::seed_placement`]). This module puts a
//! [`State`] behind a mutex, reads the clock for it and runs its periodic work
//! ([`Master::tick`]); `crate::server` puts it on the network and `crate::ha` replicates it.
//! So the state machine's module imports none of them (a unit test, `boundaries.rs`, reads
//! `src/master/` and fails on any code there that names a driver, the clock, a lock, a
//! thread, I/O or the process's randomness).

use crate::master::{MasterConfig, State, Stats, Summary};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How old a summary [`Master::summary_recent`] hands out may be.
pub const SUMMARY_AGE: Duration = Duration::from_secs(1);

/// The master: state behind a mutex, a monotonic clock, counters.
pub struct Master {
    pub cfg: MasterConfig,
    start: Instant,
    pub state: Mutex<State>,
    pub stats: Stats,
    /// Whether this master may answer (HA: only while it leads with a lease it can prove).
    pub gate: crate::ha::Gate,
    /// The HA leader's journal queue (inactive otherwise).
    pub journal: crate::ha::journal::Journal,
    /// Removes the metadata entries of the segments of clients that stopped pinging (off
    /// until started: `--enable_metadata_cleanup_on_timeout`).
    pub cleanup: crate::cleanup::Cleanup,
    /// The last [`State::summary`] and when it was taken ([`Master::summary_recent`]).
    summary: Mutex<Option<(Instant, Summary)>>,
    /// The cluster key clients must prove before any request (`KVFERRY_AUTH_KEY_FILE`;
    /// `server/auth.rs` `prove`); `None`: any client, as Mooncake's master.
    pub auth: Option<kvferry::auth::ClusterKey>,
    /// The cluster this master serves (`crate::ha::resolve_cluster_id`, with or without HA):
    /// with the cluster key, clients dial it (`crate::proto::master_identity`) and one that
    /// dials another cluster is refused.
    pub cluster_id: String,
}

impl Master {
    pub fn new(cfg: MasterConfig) -> Master {
        // Read ids start at random high bits (an HA leader's are its term's, `into_state`): a
        // client's release of a read granted by an earlier master at this address (queued, sent
        // after a restart) must not end a read this one granted.
        let mut state = State::with_reads_after((rand::random::<u64>() >> 1) & !((1u64 << 40) - 1));
        state.seed_placement(rand::random());
        state.set_offload(
            cfg.offload_timeout.as_millis() as u64,
            cfg.offloading_queue_limit,
        );
        state.set_task_limits(cfg.tasks);
        Master {
            cfg,
            start: Instant::now(),
            state: Mutex::new(state),
            stats: Stats::default(),
            gate: crate::ha::Gate::default(),
            journal: Default::default(),
            cleanup: Default::default(),
            summary: Mutex::default(),
            auth: None,
            cluster_id: crate::ha::DEFAULT_CLUSTER_ID.to_string(),
        }
    }

    /// The pool's summary as of at most [`SUMMARY_AGE`] ago: taking one walks every object
    /// under the state's lock (every request waits), so health probes and metrics scrapes,
    /// however often they come, take at most one a second.
    pub fn summary_recent(&self) -> Summary {
        let mut cached = self.summary.lock().unwrap_or_else(|e| e.into_inner());
        match &*cached {
            Some((at, s)) if at.elapsed() < SUMMARY_AGE => s.clone(),
            _ => {
                let s = self.lock().summary();
                *cached = Some((Instant::now(), s.clone()));
                s
            }
        }
    }

    pub fn now(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// What [`Master::now`] counts from.
    pub fn clock(&self) -> Instant {
        self.start
    }

    pub fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The gate's HA status with this term's journal counters.
    pub fn ha_status(&self) -> crate::ha::HaStatus {
        let mut s = self.gate.status();
        s.journal = self.journal.stats();
        s.insync = self.journal.insync();
        s.mirror = self.gate.mirror_status();
        s
    }

    /// Forgets every client, segment and object; the state then belongs to `term` (HA: a
    /// master that starts leading, or steps down: -1, no term).
    pub fn reset(&self, term: i64) {
        let mut st = State::default();
        st.term = term;
        self.install(st);
    }

    /// Makes `st` this master's state (HA: the one a takeover built), its random placement
    /// seeded from the process's randomness (the state machine draws none itself).
    pub fn install(&self, mut st: State) {
        st.seed_placement(rand::random());
        st.set_offload(
            self.cfg.offload_timeout.as_millis() as u64,
            self.cfg.offloading_queue_limit,
        );
        st.set_task_limits(self.cfg.tasks);
        *self.lock() = st;
    }

    /// Periodic work: expire clients, release deferred space, evict above the watermark.
    /// Expiries, deferred frees and background eviction: bounded by what is due (never a
    /// walk over every object under the lock on every tick, which would stall every request
    /// of a master holding millions of objects; clients found dead cost one walk, however
    /// many they are: [`State::expire_clients`]).
    pub fn tick(&self) {
        let now = self.now();
        let mut st = self.lock();
        let dead = st.expire_clients(
            now,
            self.cfg.client_ttl.as_millis() as u64,
            self.cfg.put_start_release_timeout.as_millis() as u64,
        );
        let mut dropped = Vec::new();
        for (c, segments) in dead {
            if !segments.is_empty() {
                tracing::warn!(
                    client = format!("{c:x}"),
                    segments = segments.len(),
                    "client stopped pinging; its segments and replicas are dropped"
                );
            } else {
                // It unmounted everything (a client closes so): nothing lost, nothing to say.
                tracing::debug!(
                    client = format!("{c:x}"),
                    "client without segments stopped pinging; forgotten"
                );
            }
            dropped.extend(segments);
        }
        // Their metadata entries: not of a name mounted again (a client restarted under the
        // same name), and only by a master that may answer (a deposed HA leader waking from
        // a pause finds every client silent).
        if !dropped.is_empty() && self.cleanup.enabled() && self.gate.admit().is_ok() {
            dropped.sort_unstable();
            dropped.dedup();
            let n = dropped.len();
            // One set, not a walk per name: a thousand clients dying together, each with its
            // segment, would otherwise hold the lock for a million comparisons.
            let mounted = st.mounted_names();
            dropped.retain(|name| !mounted.contains(name.as_str()));
            let kept = n - dropped.len();
            self.cleanup.push(dropped, kept);
        }
        st.expire_offloads(now, &self.stats);
        st.expire_tasks(now);
        st.expire_reads(now);
        st.release_deferred(now);
        let (used, total) = (st.used_bytes(), st.total_bytes());
        if total > 0 && used as f64 > total as f64 * self.cfg.eviction_high_watermark {
            let over = used as f64 - total as f64 * self.cfg.eviction_high_watermark;
            let target = (over + total as f64 * self.cfg.eviction_ratio) as u64;
            // Background eviction is never urgent: objects just written are spared. With
            // offload on, what it takes goes to a client's disk if it can.
            st.evict_background(
                target,
                now,
                self.cfg.allow_evict_soft_pinned,
                &self.stats,
                self.cfg.put_wait_for_reads.as_millis() as u64,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::master::PutId;
    use crate::proto::{ReplicateConfig, Segment};

    fn seg(id: u64, size: u64) -> Segment {
        Segment {
            id,
            name: format!("seg{id}"),
            te_endpoint: format!("127.0.0.1:{}", 15000 + id),
            base: id << 32,
            size,
        }
    }

    /// Puts `key` (client 1's put 1) and ends it.
    fn put(st: &mut State, m: &Master, key: &str) {
        let p = PutId { client: 1, put: 1 };
        st.put_start(
            &m.cfg,
            &m.stats,
            p,
            key,
            4096,
            &ReplicateConfig::default(),
            false,
            0,
        )
        .unwrap();
        st.put_end(p, key, 0).unwrap();
    }

    /// Health probes and scrapes walk the objects at most once a second, however often they
    /// come (each walk holds the state's lock).
    #[test]
    fn the_summary_for_probes_is_taken_at_most_once_a_second() {
        let master = Master::new(MasterConfig::default());
        master.lock().mount(1, seg(1, 1 << 20), 0).unwrap();
        put(&mut master.lock(), &master, "a");
        let first = master.summary_recent();
        assert_eq!(first.keys, 1);
        put(&mut master.lock(), &master, "b");
        assert_eq!(
            master.summary_recent(),
            first,
            "within a second: the same summary, no second walk"
        );
        assert_eq!(master.lock().summary().keys, 2);
    }

    /// Two masters (one restarted at the same address) grant different read ids, so a client's
    /// queued release of the first one's read cannot end a read the second one granted.
    #[test]
    fn masters_grant_read_ids_of_their_own() {
        let first_read = || {
            let m = Master::new(MasterConfig::default());
            let mut st = m.lock();
            st.mount(1, seg(1, 1 << 20), 0).unwrap();
            put(&mut st, &m, "k");
            st.get_replica_list("k", 1, 1000).unwrap().read_id
        };
        let (a, b) = (first_read(), first_read());
        assert_ne!(
            a, b,
            "a restarted master grants the read ids its predecessor did"
        );
    }
}
