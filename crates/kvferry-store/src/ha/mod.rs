//! Master high availability on etcd: leader election with fencing (Mooncake's contract).
//!
//! Masters started with `--enable_ha` campaign for the key
//! `mooncake-store/<cluster_id>/master_view`: each grants itself a lease and creates the key,
//! holding its advertised RPC address `"<ip>:<port>"`, in one transaction that succeeds only if
//! the key does not exist (`create_revision == 0`). The winner leads; its **term** is the key's
//! create revision (etcd revisions only grow while etcd keeps its data, so a later leader has
//! a larger term). What the leader checks and guards by is its key's **creation**, revision
//! and lease together ([`Owner`]): an etcd that lost its data counts revisions from 1 again,
//! and a new leader's key can carry the old leader's revision but never its lease. The
//! others stand by and poll the key (every [`STANDBY_POLL`]); when it disappears (the leader's
//! lease expired, or it stepped down) they campaign again.
//!
//! **Fencing.** The leader renews its lease every quarter of the TTL. etcd counts a lease's TTL
//! from when it handles the renewal, which is after the leader sent it: so the lease is alive
//! at least until `sent + TTL`. The leader answers RPCs only while `now < sent + 2/3 TTL` for
//! the last renewal that succeeded (and after which the key was read back with its own term):
//! a third of the TTL is left as margin. Every RPC asks the [`Gate`] before it is applied and
//! again before its answer is sent, so a leader that was paused (SIGSTOP) or cut off from etcd
//! refuses everything as soon as it runs again, whatever its threads were doing, before it
//! learns that it lost. Its elector thread then steps down: the master's state is reset, the
//! key deleted if it is still its own, the lease revoked, and it stands by again. A standby
//! answers every RPC with [`StoreError::NotLeader`] naming the leader. So two masters never
//! both accept requests: the new leader can only create the key after the old lease expired,
//! by which time the old leader has refused for a third of a TTL.
//!
//! **Replication.** Before it answers the request that made a durable change, the leader has
//! it acknowledged by every standby of its in-sync set ([`sync`], `--ha-replication
//! standbys`, the default) or, while that set is empty (or with `--ha-replication etcd`),
//! journaled in etcd ([`journal`]). A master that wins the key starts from its mirror (a
//! member of the set), from the journal (snapshot plus log: the set is empty), or empty (every
//! member is gone: the journal is stale and never served), conservatively: every
//! object counts as being read for one lease TTL, writes in progress stay in progress, every
//! client as just pinged (`crate::master::changes`). Journal writes are transactions guarded
//! by the leader's key, so a deposed leader cannot append; a leader that cannot write its
//! journal while it can prove its lease fences itself.
//!
//! **An etcd that lost its data.** The key then vanishes without the old leader's lease having
//! expired, so another master can win it while the old one still answers for the rest of its
//! fence bound. A new leader therefore serves at once only when the journal's `term` marker
//! names the leader it saw while standing by, revision and lease (etcd kept its history);
//! otherwise (a wiped etcd, a first start) it waits out one fence bound first, then reads its
//! key back before it serves. A deposed leader's step-down deletes the key, and its journal
//! appends land, only while the key is still its creation: with revisions alone, a leader of
//! the wiped etcd's first term could delete its successor's key (same revision) and two
//! masters answered as leaders at once (CI, store_ha
//! `etcd_restarted_with_or_without_its_data_masters_and_clients_recover`).
//!
//! [`Owner`]: kvferry::metadata::etcd::Owner

mod elect;
pub use crate::elect::fence;
pub mod journal;
pub mod link;
pub mod log;
pub mod standby;
pub mod sync;

use crate::error::StoreError;
use crate::node::Master;
use elect::{campaign, Standby};
use fence::Fence;
use kvferry::metadata::etcd::EtcdClient;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Mooncake's default cluster id (`DEFAULT_CLUSTER_ID` in mooncake-store/include/types.h).
pub const DEFAULT_CLUSTER_ID: &str = "mooncake_cluster";
/// Mooncake's lease TTL of the master view (`DEFAULT_MASTER_VIEW_LEASE_TTL_SEC`).
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(5);
/// How often a standby reads the key (and how soon after it vanished a standby campaigns).
pub const STANDBY_POLL: Duration = Duration::from_millis(200);

/// The cluster id: the one given (`--cluster_id`), else the environment's
/// (`KVFERRY_STORE_CLUSTER_ID` / `MC_STORE_CLUSTER_ID`, read into [`kvferry::Config`]), else
/// [`DEFAULT_CLUSTER_ID`]. Clients (which have no flag) resolve it the same way. (Mooncake's
/// master reads the variable only when `--cluster_id` is empty, since the flag defaults to
/// `mooncake_cluster`; its clients read it always. Here an unset flag defers to the variable,
/// so a master and its clients started with the same environment agree.)
pub fn resolve_cluster_id(given: Option<&str>, env: Option<&str>) -> String {
    let pick = |s: Option<&str>| {
        s.map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
    };
    pick(given)
        .or_else(|| pick(env))
        .unwrap_or_else(|| DEFAULT_CLUSTER_ID.to_string())
}

/// `mooncake-store/<cluster_id>/master_view` (a trailing `/` of the id dropped, as Mooncake).
pub fn master_view_key(cluster_id: &str) -> String {
    format!(
        "mooncake-store/{}/master_view",
        cluster_id.strip_suffix('/').unwrap_or(cluster_id)
    )
}

pub use crate::elect::fence::Role;

/// What `/ha_status` shows.
#[derive(Debug, Clone, serde::Serialize)]
pub struct HaStatus {
    pub enabled: bool,
    pub role: Role,
    pub term: i64,
    pub cluster_id: String,
    pub key: String,
    pub leader: String,
    /// This master's advertised RPC address.
    pub address: String,
    pub lease_ttl_ms: u64,
    /// Milliseconds since the last successful lease renewal was sent (leaders), else null.
    pub last_keepalive_age_ms: Option<u64>,
    /// Milliseconds this leader may still answer without another renewal, else null.
    pub fenced_in_ms: Option<u64>,
    pub lease_id: String,
    /// The journal of this term (leaders): entries, bytes, snapshots, changes not yet durable.
    pub journal: journal::JournalStats,
    /// The standbys that acknowledge this leader's changes in memory (its in-sync set;
    /// `--ha-replication standbys`); empty: changes are acknowledged by the etcd journal.
    pub insync: Vec<String>,
    /// This master's mirror of the leader's state (`--ha-replication standbys`), else null.
    pub mirror: Option<sync::MirrorStatus>,
}

/// The gate every RPC passes. Without HA it always admits (term 0).
pub struct Gate {
    enabled: AtomicBool,
    /// Step-downs completed (key deleted, lease revoked): what [`hand_off`] waits for.
    stepped_down: std::sync::atomic::AtomicU64,
    /// The master is stopping ([`hand_off`]): it campaigns no more.
    stopping: AtomicBool,
    /// The master won the key and is taking over (its state not yet in etcd, the mirror it
    /// took the only copy): [`hand_off`] waits for the takeover to end.
    taking_over: AtomicBool,
    /// This master's mirror, when it replicates to standbys: a member that holds one may be
    /// the only copy of what the next leader needs, so [`hand_off`] waits for its elector.
    mirror: std::sync::OnceLock<Arc<sync::Mirror>>,
    /// The elector thread has ended (stopping).
    elector_done: AtomicBool,
    /// The decisions ([`Fence`]), on this gate's clock ([`Gate::now`]).
    state: Mutex<Fence>,
    clock: Instant,
    info: Mutex<(String, String, String, Duration)>, // cluster id, key, address, lease TTL
}

impl Default for Gate {
    fn default() -> Self {
        Gate {
            enabled: AtomicBool::new(false),
            stepped_down: Default::default(),
            stopping: AtomicBool::new(false),
            taking_over: AtomicBool::new(false),
            mirror: std::sync::OnceLock::new(),
            elector_done: AtomicBool::new(false),
            state: Mutex::new(Fence::default()),
            clock: Instant::now(),
            info: Mutex::new((String::new(), String::new(), String::new(), Duration::ZERO)),
        }
    }
}

impl Gate {
    fn st(&self) -> std::sync::MutexGuard<'_, Fence> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Milliseconds on this gate's clock (what its [`Fence`] counts in).
    fn now(&self) -> u64 {
        self.ms(Instant::now())
    }

    /// `t` on this gate's clock, rounded down: a bound counted from a time rounded down ends
    /// no later than the exact one, and a time rounded down reaches it no sooner.
    fn ms(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.clock).as_millis() as u64
    }

    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Acquire)
    }

    /// Whether a request may be applied now; the leader's term if so. A leader whose lease it
    /// can no longer prove alive turns standby here, at once (its elector steps down after).
    pub fn admit(&self) -> Result<i64, StoreError> {
        if !self.enabled() {
            return Ok(0);
        }
        self.st().admit(self.now())
    }

    /// Whether the answer of a request admitted under `term` may be sent: still the leader of
    /// that term, lease still proven.
    pub fn confirm(&self, term: i64) -> Result<(), StoreError> {
        if !self.enabled() {
            return if term == 0 {
                Ok(())
            } else {
                Err(StoreError::NotLeader {
                    leader: String::new(),
                })
            };
        }
        self.st().confirm(term, self.now())
    }

    /// What this master's mirror holds (`--ha-replication standbys`), else `None`.
    pub fn mirror_status(&self) -> Option<sync::MirrorStatus> {
        self.mirror.get().map(|m| m.status())
    }

    pub fn role(&self) -> Role {
        let _ = self.admit(); // a leader past its bound reads as standby
        self.st().role()
    }

    pub fn leader(&self) -> String {
        let _ = self.admit();
        self.st().leader().to_string()
    }

    pub fn term(&self) -> i64 {
        self.st().term()
    }

    pub fn status(&self) -> HaStatus {
        let enabled = self.enabled();
        let role = self.role();
        let st = self.st().clone();
        let (cluster_id, key, address, ttl) =
            self.info.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let now = self.now();
        let (valid_until, last_keepalive) = st.bounds();
        HaStatus {
            enabled,
            role,
            term: st.term(),
            cluster_id,
            key,
            leader: st.leader().to_string(),
            address,
            lease_ttl_ms: ttl.as_millis() as u64,
            last_keepalive_age_ms: last_keepalive
                .filter(|_| role == Role::Leader)
                .map(|t| now.saturating_sub(t)),
            fenced_in_ms: valid_until
                .filter(|_| role == Role::Leader)
                .map(|t| t.saturating_sub(now)),
            lease_id: format!("{:x}", st.lease_id()),
            journal: Default::default(),
            insync: Vec::new(),
            mirror: None,
        }
    }

    #[cfg(test)]
    fn set_leader(&self, term: i64, address: &str, lease_id: i64, sent: Instant, bound: Duration) {
        let sent = self.ms(sent);
        self.st()
            .set_leader(term, address, lease_id, sent, bound.as_millis() as u64);
    }

    /// A renewal sent at `sent` succeeded (and the key is still ours); the elector's renewals
    /// go through [`Renewals`](fence::Renewals).
    #[cfg(test)]
    fn renewed(&self, term: i64, sent: Instant, bound: Duration) {
        let sent = self.ms(sent);
        self.st().renewed(term, sent, bound.as_millis() as u64);
    }

    /// Makes this gate a leader of `term` for `bound` without etcd (tests of what runs behind
    /// the gate).
    #[cfg(test)]
    pub(crate) fn lead_for_test(&self, term: i64, bound: Duration) {
        self.enabled.store(true, Ordering::Release);
        self.set_leader(term, "127.0.0.1:0", 1, Instant::now(), bound);
    }

    pub(crate) fn still_leader(&self, term: i64) -> bool {
        self.admit().is_ok_and(|t| t == term)
    }

    /// Refuses everything from now on in `term` (the journal cannot be written): the leader
    /// reads as fenced at once and its elector steps down.
    pub(crate) fn fence(&self, term: i64) {
        let now = self.now();
        self.st().fence(term, now);
    }
}

/// How the leader makes a change durable before it answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Replication {
    /// Every change is a transaction in etcd's journal ([`journal`]).
    #[default]
    Etcd,
    /// Changes are acknowledged in memory by the in-sync standbys ([`sync`]), and by etcd's
    /// journal only while no standby is in sync.
    Standbys,
}

/// What a master needs to campaign.
#[derive(Debug, Clone)]
pub struct HaConfig {
    /// etcd endpoints (`host:port`).
    pub endpoints: Vec<String>,
    pub cluster_id: String,
    /// The RPC address clients should use (`ip:port`), written into the key.
    pub address: String,
    pub lease_ttl: Duration,
    /// The journal is snapshotted once its log outgrows this and the last snapshot
    /// ([`journal::SNAPSHOT_MIN`] by default).
    pub snapshot_bytes: u64,
    pub replication: Replication,
    /// With standbys in sync: the bytes of entries kept so that a rebase writes them instead
    /// of the whole state ([`crate::repl::Tail`]; [`journal::TAIL_DEFAULT`]; 0: none kept).
    pub rebase_tail_bytes: u64,
    /// The bytes of the last entries a standby keeps, so that its takeover writes them
    /// instead of the whole state (`sync::Mirror`'s tail; 0: none kept).
    pub standby_tail_bytes: u64,
    /// The least time between two background snapshots while standbys are in sync
    /// ([`journal::BASE_EVERY`]).
    pub rebase_base_every: Duration,
    /// With standbys in sync that all read grants: the bytes of free space a segment's pool
    /// of space granted ahead to puts takes at most (also at most 1/64 of the segment;
    /// [`journal::GRANT_DEFAULT`]; 0: none, every put waits for its change's acknowledgement).
    pub grant_bytes: u64,
}

impl HaConfig {
    /// How long after a renewal was sent the leader keeps answering: 2/3 of the TTL.
    pub fn fence_bound(&self) -> Duration {
        self.lease_ttl * 2 / 3
    }

    fn keepalive_every(&self) -> Duration {
        self.lease_ttl / 4
    }

    /// The bound of one etcd request: a quarter of the TTL (100 ms to 2 s).
    fn request_timeout(&self) -> Duration {
        (self.lease_ttl / 4).clamp(Duration::from_millis(100), Duration::from_secs(2))
    }

    /// How long an in-sync standby may take to acknowledge an entry before it leaves the set:
    /// a quarter of the fence bound (requests wait at most that long for a failed standby).
    pub fn ack_timeout(&self) -> Duration {
        self.fence_bound() / 4
    }
}

/// Starts campaigning for `master` on a thread of its own (runs until the process ends). The
/// master refuses every request until it leads. Fails at once if etcd cannot be reached.
pub fn start(cfg: HaConfig, master: Arc<Master>) -> Result<(), String> {
    if cfg.lease_ttl < Duration::from_secs(1) {
        return Err(format!(
            "the HA lease TTL must be at least 1 s (etcd counts leases in seconds); got {:?}",
            cfg.lease_ttl
        ));
    }
    let etcd = EtcdClient::connect(&cfg.endpoints, cfg.request_timeout())
        .map_err(|e| format!("HA: {e}"))?;
    let key = master_view_key(&cfg.cluster_id);
    let standby = match cfg.replication {
        Replication::Etcd => None,
        Replication::Standbys => {
            // Leaders reach this master's mirror at its advertised host.
            let ip = replication_ip(&cfg.address)?;
            let l = std::net::TcpListener::bind((ip, 0))
                .map_err(|e| format!("HA replication: cannot bind a port on {ip}: {e}"))?;
            let addr = l.local_addr().map_err(|e| e.to_string())?.to_string();
            let prebuilder = sync::Prebuilder {
                clock: master.clock(),
                lease_ms: master.cfg.lease_ttl.as_millis() as u64,
            };
            let mirror = Arc::new(
                sync::Mirror::new(
                    &cfg.cluster_id,
                    master.cfg.lease_ttl,
                    usize::try_from(cfg.standby_tail_bytes).unwrap_or(usize::MAX),
                )
                .with_prebuilder(prebuilder)
                .with_auth(master.auth.clone(), &cfg.address),
            );
            let m = Arc::clone(&mirror);
            std::thread::Builder::new()
                .name("kvf-ha-mirror".into())
                .spawn(move || standby::serve(l, m))
                .map_err(|e| e.to_string())?;
            tracing::info!("HA: replication to standbys; this master's mirror is served at {addr}");
            let _ = master.gate.mirror.set(Arc::clone(&mirror));
            Some(Standby {
                mirror,
                addr,
                reg: None,
                published: None,
            })
        }
    };
    {
        *master.gate.st() = Fence::standby();
        *master.gate.info.lock().unwrap_or_else(|e| e.into_inner()) = (
            cfg.cluster_id.clone(),
            key.clone(),
            cfg.address.clone(),
            cfg.lease_ttl,
        );
    }
    master.gate.enabled.store(true, Ordering::Release);
    std::thread::Builder::new()
        .name("kvf-master-ha".into())
        .spawn(move || {
            campaign(&cfg, &etcd, &key, &master, standby);
            master.gate.elector_done.store(true, Ordering::Release);
        })
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// The IP a standby serves its mirror on: its advertised address's host (a name is resolved).
fn replication_ip(address: &str) -> Result<std::net::IpAddr, String> {
    let host = kvferry::split_host_port(address).0;
    if let Ok(ip) = host.parse() {
        return Ok(ip);
    }
    use std::net::ToSocketAddrs;
    (host, 0)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .map(|a| a.ip())
        .ok_or_else(|| format!("HA replication to standbys: the advertised address {address:?} does not resolve to an IP address to serve the mirror on (--advertise-address)"))
}

/// The master is stopping (SIGTERM): a leader makes the etcd journal whole (its in-sync
/// standbys' acknowledgements would die with the cluster otherwise: the rebase), refuses from then
/// on, and steps down (its key deleted: a standby takes over at once, from the journal). A
/// standby with a complete mirror waits for its elector: if the mirror is the only copy of
/// what the next leader needs ([`sync::needed_at_stop`]: the leader dead, no other member
/// alive) it first leads from it and hands off so. Whether that finished within `bound`; true
/// at once for another standby or without HA.
pub fn hand_off(master: &Master, bound: Duration) -> bool {
    if !master.gate.enabled() {
        return true;
    }
    // A leader whose gate lapsed just now (overloaded) still has its writer and its key until
    // its elector steps down: it hands off as well. A standby stops campaigning.
    master.gate.stopping.store(true, Ordering::SeqCst);
    let until = Instant::now() + bound;
    // A member holding a complete mirror may be the only copy of what the next leader needs
    // (the leader dead): its elector decides, and either ends or takes over to hand off.
    let holds_mirror = master
        .gate
        .mirror
        .get()
        .is_some_and(|m| m.complete_term().is_some());
    loop {
        // A takeover under way ends first (it writes the state to etcd before it leads):
        // stopping now would take the only copy of a mirror with this process.
        if !master.gate.taking_over.load(Ordering::SeqCst) {
            if master.gate.role() == Role::Leader || master.journal.active() {
                break;
            }
            if !holds_mirror || master.gate.elector_done.load(Ordering::Acquire) {
                return true;
            }
        }
        if Instant::now() > until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let before = master.gate.stepped_down.load(Ordering::Acquire);
    if !master
        .journal
        .hand_off(until.saturating_duration_since(Instant::now()))
    {
        return false;
    }
    while master.gate.stepped_down.load(Ordering::Acquire) == before {
        if Instant::now() > until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gate_admits_only_a_leader_within_its_bound() {
        let g = Gate::default();
        assert_eq!(
            g.admit(),
            Ok(0),
            "without HA every request is admitted, term 0"
        );
        g.enabled.store(true, Ordering::Release);
        g.st().set_standby(None);
        assert_eq!(
            g.admit(),
            Err(StoreError::NotLeader {
                leader: String::new()
            })
        );
        g.st().set_standby(Some(("10.0.0.1:50051", 7)));
        assert_eq!(
            g.admit(),
            Err(StoreError::NotLeader {
                leader: "10.0.0.1:50051".into()
            })
        );
        assert_eq!(
            (g.term(), g.role(), g.leader()),
            (7, Role::Standby, "10.0.0.1:50051".to_string())
        );

        let bound = Duration::from_millis(80);
        g.set_leader(9, "10.0.0.2:50051", 5, Instant::now(), bound);
        assert_eq!(g.admit(), Ok(9));
        assert_eq!(g.confirm(9), Ok(()));
        assert!(
            g.confirm(8).is_err(),
            "an answer computed under another term is not sent"
        );
        g.renewed(9, Instant::now(), bound);
        assert_eq!(g.status().role, Role::Leader);
        assert!(g.status().fenced_in_ms.is_some_and(|ms| ms <= 80));
        // No renewal within the bound: refused at once, and it reads as a standby.
        std::thread::sleep(bound + Duration::from_millis(20));
        assert!(matches!(g.admit(), Err(StoreError::NotLeader { .. })));
        assert_eq!(g.role(), Role::Standby);
        // A renewal that comes back late does not revive a fenced leader.
        g.renewed(9, Instant::now(), bound);
        assert!(g.admit().is_err());
        assert!(!g.still_leader(9));
    }

    #[test]
    fn a_standby_serves_its_mirror_on_its_advertised_host() {
        assert_eq!(
            replication_ip("10.1.2.3:50051"),
            Ok("10.1.2.3".parse().unwrap())
        );
        assert_eq!(replication_ip("[::1]:50051"), Ok("::1".parse().unwrap()));
        assert!(
            replication_ip("localhost:50051").is_ok_and(|ip| ip.is_loopback()),
            "a name is resolved"
        );
        assert!(replication_ip("no-such-host.invalid:1")
            .unwrap_err()
            .contains("--advertise-address"));
    }

    #[test]
    fn mooncakes_key_and_cluster_id() {
        assert_eq!(
            master_view_key("mooncake_cluster"),
            "mooncake-store/mooncake_cluster/master_view"
        );
        assert_eq!(master_view_key("c1/"), "mooncake-store/c1/master_view");
        assert_eq!(resolve_cluster_id(Some("flag"), Some("env")), "flag");
        assert_eq!(resolve_cluster_id(None, Some("env")), "env");
        assert_eq!(resolve_cluster_id(Some(" "), None), DEFAULT_CLUSTER_ID);
        let c = HaConfig {
            endpoints: vec![],
            cluster_id: "c".into(),
            address: "a:1".into(),
            lease_ttl: Duration::from_secs(5),
            snapshot_bytes: journal::SNAPSHOT_MIN,
            replication: Replication::Etcd,
            rebase_tail_bytes: journal::TAIL_DEFAULT,
            standby_tail_bytes: 0,
            rebase_base_every: journal::BASE_EVERY,
            grant_bytes: journal::GRANT_DEFAULT,
        };
        assert!(
            c.fence_bound() < c.lease_ttl && c.keepalive_every() < c.fence_bound() / 2,
            "at least two renewals fit in the bound"
        );
    }
}
