//! The store client: contributes a segment, moves object bytes with the transfer engine.
//!
//! Writes: `PutStart` (the master picks replica locations) → one engine batch writes every
//! replica (a replica in this client's own segment is a memcpy) → `PutEnd`, or `PutRevoke` if
//! any write failed. Reads: `GetReplicaList` (grants a read lease) → read the closest replica
//! → if the lease ran out before the read finished the read fails (`LeaseExpired`), so a get
//! never returns bytes that might have been overwritten meanwhile. Once the transfer ended
//! the read is released (`ReleaseReads`, piggybacked on the client's next request, or sent
//! within 5 ms by a background thread when no request goes out), so
//! the master may reclaim the replicas at once if they were removed or replaced meanwhile.
//!
//! In central metadata mode a `local_hostname` without a port gets one, as Mooncake's client
//! does: a port bound (and held) in `KVFERRY_STORE_CLIENT_MIN_PORT..=KVFERRY_STORE_CLIENT_MAX_PORT`
//! (12300..=14300) is appended, and `host:port` is the segment name; a name another live
//! engine registered is retried with another port (`KVFERRY_STORE_CLIENT_SETUP_RETRIES`, 20; the `MC_STORE_CLIENT_*` names are aliases).

use kvferry::transport::tcp::poll_read;
use crate::error::{StoreError, StoreResult};
use crate::master::alloc::SegmentSpace;
use crate::proto::{self, PingStatus, ReplicaDesc, ReplicaList, ReplicateConfig, Request, Response, Segment, WriteInFlight};
use kvferry::hostbuf::HostBuffer;
use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// Mooncake's `setup()` arguments.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// This host's address (`host` or `host:port`), advertised to peers.
    pub local_hostname: String,
    /// Transfer-engine metadata: `P2PHANDSHAKE` or a metadata server URL.
    pub metadata_server: String,
    /// Memory this client contributes to the pool (0: a pure client).
    pub global_segment_size: u64,
    /// Staging memory for the bytes API (`put`, `get`); 0 disables it.
    pub local_buffer_size: u64,
    /// `tcp` (the transfer engine picks the best transport it has per peer).
    pub protocol: String,
    pub device_name: String,
    /// `host:port` of the master.
    pub master_server_addr: String,
    /// How often to ping the master.
    pub ping_interval: Duration,
    /// Deadline of each transfer.
    pub transfer_timeout: Duration,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            local_hostname: "127.0.0.1".into(),
            metadata_server: "P2PHANDSHAKE".into(),
            global_segment_size: 16 << 20,
            local_buffer_size: 16 << 20,
            protocol: "tcp".into(),
            device_name: String::new(),
            master_server_addr: "127.0.0.1:50051".into(),
            ping_interval: Duration::from_secs(1),
            transfer_timeout: Duration::from_secs(60),
        }
    }
}

/// How long a client following the leader (`etcd://` master address) looks for one before a
/// call fails: long enough for Mooncake's 5 s lease to expire and a standby to take over.
const FAILOVER_WAIT: Duration = Duration::from_secs(20);
/// The bound of one RPC to a master found through etcd: a paused leader is given up on after
/// this long (a request that may have been applied is then not sent again; see `idempotent`).
const HA_RPC_TIMEOUT: Duration = Duration::from_secs(5);

/// Where the master is: one address, or the leader of an HA cluster found in etcd.
enum Target {
    Fixed,
    /// Mooncake's `etcd://h1:2379;h2:2379`: the leader's address is the value of
    /// `mooncake-store/<cluster_id>/master_view`.
    Etcd { etcd: kvferry::metadata::etcd::EtcdClient, key: String },
}

/// What a client re-registers when it finds a new leader that does not know it.
#[derive(Default)]
struct Registration {
    client: u64,
    segments: Vec<Segment>,
    /// Set once the first mount succeeded (before that, the mount itself is what is retried).
    mounted: bool,
}

/// This client's writes into segments whose bytes may still be landing: each batch's from
/// its start until it completed, or, if it did not (failed, timed out), until twice the
/// transfer timeout after it started (a target ends a request its own timeout after its
/// header: `TransferEngine`'s "Nothing hangs"). Reported to a master that did not know this
/// client ([`Rpc::report_writes`]): a master without HA that restarted knows nothing of the
/// writes its predecessor placed, and would give their space to new puts.
#[derive(Default)]
struct Writes {
    next: u64,
    /// Batch id -> its writes and until when they may land.
    running: std::collections::HashMap<u64, (Vec<PutWrite>, Instant)>,
}

/// One write of a put: the replica's segment (its endpoint), address and length.
type PutWrite = (String, u64, u64);

impl Writes {
    /// A batch of writes starts; its id, for [`Writes::ended`].
    fn start(&mut self, writes: Vec<PutWrite>, until: Instant) -> u64 {
        // (A walk only when batches linger: puts to a target that stopped answering fail
        // one after another, each kept for twice the timeout.)
        if self.running.len() >= 64 {
            let now = Instant::now();
            self.running.retain(|_, (_, t)| *t > now);
        }
        self.next += 1;
        self.running.insert(self.next, (writes, until));
        self.next
    }

    /// Batch `id` ended: forgotten if every write of it completed (the bytes landed), else
    /// kept until its time.
    fn ended(&mut self, id: u64, all_landed: bool) {
        if all_landed {
            self.running.remove(&id);
        }
    }

    /// What may still be landing, with the time left.
    fn report(&self, now: Instant) -> Vec<WriteInFlight> {
        self.running
            .values()
            .filter(|(_, until)| *until > now)
            .flat_map(|(w, until)| {
                let left_ms = until.saturating_duration_since(now).as_millis().min(u128::from(u64::MAX)) as u64;
                w.iter().map(move |(te, addr, size)| WriteInFlight { te_endpoint: te.clone(), addr: *addr, size: *size, left_ms: left_ms.max(1) })
            })
            .collect()
    }
}

/// A small pool of connections to the master; one request in flight per connection.
struct Rpc {
    target: Target,
    /// The master's (the leader's) address ("" when it must be looked up), and the last
    /// leader found: its address and term (0 when not known).
    addr: Mutex<(String, (String, i64))>,
    /// Counts leader changes seen by this client: a put whose `PutStart` and `PutEnd` were
    /// answered under different leaders was not stored.
    epoch: std::sync::atomic::AtomicU64,
    registration: Mutex<Registration>,
    /// This client's writes into segments that may still be running ([`Request::HoldWrites`]).
    writes: Mutex<Writes>,
    pool: Mutex<Vec<Chan>>,
    /// The connection of the background threads (pings, read releases): apart from the
    /// pool, so that the caller's requests keep to one connection (the master spins on the
    /// connection that just answered; a second one in turns spins a second core).
    aside: Mutex<Option<Chan>>,
    timeout: Duration,
    /// Bounded poll for the answer before sleeping (`KVFERRY_SPIN_US`): a master round trip
    /// is a few microseconds of work, and waking a sleeping core costs more on VMs.
    spin: Duration,
    /// The cluster key this client and the master prove to each other on every new
    /// connection (`KVFERRY_AUTH_KEY_FILE`; [`authenticate`]).
    auth: Option<kvferry::auth::ClusterKey>,
    /// What the key's handshake dials: the master of this client's cluster
    /// (`KVFERRY_STORE_CLUSTER_ID` / `MC_STORE_CLUSTER_ID`, else `mooncake_cluster`;
    /// [`proto::master_identity`]).
    identity: String,
}

/// A connection to the master: with the cluster key, the halves of the session it proved,
/// under which every frame both ways is sealed.
struct Chan {
    s: TcpStream,
    sealed: Option<(kvferry::auth::Sealer, kvferry::auth::Opener)>,
}

/// Which connection a call uses: one of the pool (callers' requests) or the background
/// threads' own ([`Rpc::aside`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Conn {
    Pool,
    Aside,
}

/// Whether sending `req` twice is harmless (it may have been applied by a master that then
/// stopped answering).
fn idempotent(req: &Request) -> bool {
    match req {
        Request::Ping { .. } | Request::GetReplicaList { .. } | Request::ExistKey { .. } | Request::ReleaseReads { .. } | Request::HoldWrites { .. } => true,
        Request::Batch(v) => v.iter().all(idempotent),
        _ => false,
    }
}

/// What a caller gets for a request that cannot be sent twice whose connection failed after
/// it was sent (the master killed, paused past the timeout, the link reset): the master may
/// have applied it, so the outcome is unknown ([`StoreError::OutcomeUnknown`], on which a put
/// revokes its start at the leader), not the socket's error, which is logged.
fn lost(e: StoreError) -> StoreError {
    tracing::warn!("{e}: the connection failed after the request was sent; its outcome is unknown");
    StoreError::OutcomeUnknown
}

/// Whether an idle pooled connection was closed (or reset) by the master: between requests
/// it has nothing to send, so anything readable is the end.
fn closed_by_peer(s: &TcpStream) -> bool {
    let mut b = [0u8; 1];
    match rustix::net::recv(s, &mut b, rustix::net::RecvFlags::DONTWAIT | rustix::net::RecvFlags::PEEK) {
        Ok(_) => true,
        Err(e) => e != rustix::io::Errno::AGAIN,
    }
}

/// The most bytes of a plain answer to the key's handshake read (an `AuthChallenge`, or a
/// refusal saying why).
const MAX_AUTH_ANSWER: usize = 64 << 10;

/// One request and its answer on `s`, plain frames, outside the pool (the key's handshake).
fn exchange(s: &mut TcpStream, req: &Request) -> Result<Response, String> {
    s.write_all(&proto::encode(req).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
    let mut prefix = [0u8; crate::frame::PREFIX_LEN];
    s.read_exact(&mut prefix).map_err(|e| e.to_string())?;
    let n = crate::frame::body_len(prefix, MAX_AUTH_ANSWER)
        .map_err(|t| format!("an answer of {} bytes to the key's handshake (at most {MAX_AUTH_ANSWER}): not a kvferry master of this version", t.len))?;
    let mut body = vec![0u8; n];
    s.read_exact(&mut body).map_err(|e| e.to_string())?;
    proto::decode(&body).map_err(|e| e.to_string())
}

/// Runs the cluster key's handshake ([`proto::STORE_RPC`], dialing `identity`) with the
/// master at `addr` on a new connection: the session's halves, under which every frame after
/// is sealed (the first request proves the key to the master). A master that cannot prove the
/// key, or refuses (another key, another cluster, no key), is not talked to. Its errors are
/// [`StoreError::Unauthorized`] (nothing to retry: a key or cluster id is missing or
/// differs) or, for the connection itself, [`StoreError::Rpc`].
fn authenticate(s: &mut TcpStream, key: &kvferry::auth::ClusterKey, identity: &str, addr: &str) -> StoreResult<(kvferry::auth::Sealer, kvferry::auth::Opener)> {
    let rpc = |e: String| StoreError::Rpc(format!("master at {addr}: authenticating: {e}"));
    let (init, hello) = kvferry::auth::Initiator::new(key, proto::STORE_RPC, identity).map_err(|r| StoreError::InvalidParams(format!("the store's cluster id ({identity:?}): {r}")))?;
    match exchange(s, &Request::AuthHello { hello }).map_err(rpc)? {
        Response::AuthChallenge { answer } => match init.finish(&answer) {
            Ok(session) => Ok(session.split()),
            Err(r) => Err(StoreError::Unauthorized(format!("the master at {addr} could not prove the cluster key: {r}"))),
        },
        Response::Err(StoreError::Unauthorized(why)) => Err(StoreError::Unauthorized(format!("the master at {addr}: {why}"))),
        // (A master of an earlier version does not know the request.)
        Response::Err(e) => Err(StoreError::Unauthorized(format!("the master at {addr} cannot authenticate clients ({e}): give it the cluster's key file (a kvferry master reading KVFERRY_AUTH_KEY_FILE), or unset KVFERRY_AUTH_KEY_FILE on this client"))),
        other => Err(rpc(format!("answered {other:?} to AuthHello"))),
    }
}

/// A call's failure: whether the request can have reached the master.
enum Failure {
    /// Nothing was sent (no connection): safe to send elsewhere.
    NotSent(StoreError),
    /// The connection failed after (part of) the request was sent.
    Lost(StoreError),
    /// The answer came but does not decode (not a master of this version).
    Garbled(StoreError),
}

impl Rpc {
    fn new(addr: &str, timeout: Duration, ecfg: &Config) -> StoreResult<Rpc> {
        let spin = ecfg.spin;
        let (target, timeout, first) = match addr.trim().split_once("://") {
            None => (Target::Fixed, timeout, addr.to_string()),
            Some(("etcd", rest)) => {
                let endpoints = kvferry::metadata::etcd::parse_endpoints(rest);
                if endpoints.is_empty() {
                    return Err(StoreError::InvalidParams(format!("master_server_addr {addr:?}: no etcd endpoint after etcd://")));
                }
                let key = crate::ha::master_view_key(&crate::ha::resolve_cluster_id(None, ecfg.store_cluster_id.as_deref()));
                (Target::Etcd { etcd: kvferry::metadata::etcd::EtcdClient::new(&endpoints, Duration::from_secs(2)), key }, HA_RPC_TIMEOUT, String::new())
            }
            Some((scheme, _)) => {
                return Err(StoreError::InvalidParams(format!("master_server_addr {addr:?}: {scheme}:// is not supported; use host:port or etcd://host:2379[;host:2379...]")))
            }
        };
        let auth = kvferry::auth::ClusterKey::from_config(ecfg.auth_key_file.as_deref()).map_err(|e| StoreError::InvalidParams(e.to_string()))?;
        let identity = proto::master_identity(&crate::ha::resolve_cluster_id(None, ecfg.store_cluster_id.as_deref()));
        Ok(Rpc { target, addr: Mutex::new((first, (String::new(), 0))), epoch: Default::default(), registration: Mutex::default(), writes: Mutex::default(), pool: Mutex::default(), aside: Mutex::default(), timeout, spin, auth, identity })
    }

    fn addr(&self) -> String {
        self.addr.lock().unwrap_or_else(|e| e.into_inner()).0.clone()
    }

    fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    fn connect(&self, addr: &str) -> StoreResult<Chan> {
        let fail = |e: String| StoreError::Rpc(format!("cannot reach the master at {addr}: {e} (is `kvferry master` running there?)"));
        let addrs: Vec<_> = addr.to_socket_addrs().map_err(|e| fail(e.to_string()))?.collect();
        let mut last = "no address".to_string();
        for a in addrs {
            match TcpStream::connect_timeout(&a, Duration::from_secs(5)) {
                Ok(mut s) => {
                    let _ = s.set_nodelay(true);
                    s.set_read_timeout(Some(self.timeout)).map_err(|e| fail(e.to_string()))?;
                    s.set_write_timeout(Some(self.timeout)).map_err(|e| fail(e.to_string()))?;
                    let sealed = match &self.auth {
                        Some(key) => Some(authenticate(&mut s, key, &self.identity, addr)?),
                        None => None,
                    };
                    return Ok(Chan { s, sealed });
                }
                Err(e) => last = e.to_string(),
            }
        }
        Err(fail(last))
    }

    /// One attempt at the current address; the answer, and the epoch of that address (the
    /// leader that answered).
    fn call_once(&self, req: &Request, conn: Conn) -> Result<(Response, u64), Failure> {
        let mut frame = proto::encode(req).map_err(Failure::NotSent)?;
        let (addr, epoch) = {
            // (Read together: `find_leader` changes both under this lock.)
            let cur = self.addr.lock().unwrap_or_else(|e| e.into_inner());
            (cur.0.clone(), self.epoch())
        };
        if addr.is_empty() {
            return Err(Failure::NotSent(StoreError::Rpc("no master leads the cluster (the etcd key is absent)".into())));
        }
        let mut pooled = match conn {
            Conn::Pool => self.pool.lock().unwrap_or_else(|e| e.into_inner()).pop(),
            Conn::Aside => self.aside.lock().unwrap_or_else(|e| e.into_inner()).take(),
        };
        if matches!(self.target, Target::Etcd { .. }) && pooled.as_ref().is_some_and(|c| closed_by_peer(&c.s)) {
            // The master went away (killed, stepped down): nothing sent, so any request may go
            // to the next one.
            self.drop_connections();
            return Err(Failure::NotSent(StoreError::Rpc(format!("the connection to the master at {addr} was closed by it"))));
        }
        let mut c = match pooled.take() {
            Some(c) => c,
            None => self.connect(&addr).map_err(Failure::NotSent)?,
        };
        let io = |e: std::io::Error| Failure::Lost(StoreError::Rpc(format!("master at {addr}: {e}")));
        if let Some((sealer, _)) = &mut c.sealed {
            let mut out = Vec::new();
            sealer.seal_frame(crate::frame::body(&frame), &mut out);
            frame = out;
        }
        c.s.write_all(&frame).map_err(io)?;
        let s = &mut c.s;
        let body = match &mut c.sealed {
            None => {
                let mut prefix = [0u8; 4];
                let got = poll_read(s, &mut prefix, self.spin);
                s.read_exact(&mut prefix[got..]).map_err(io)?;
                let n = proto::decode_len(prefix).map_err(Failure::Garbled)?;
                let mut body = vec![0u8; n];
                s.read_exact(&mut body).map_err(io)?;
                body
            }
            Some((_, opener)) => {
                use kvferry::auth::{frame_body_len, FRAME_HEAD_LEN};
                let garbled = |r: kvferry::auth::Refusal| Failure::Garbled(StoreError::Unauthorized(format!("the answer of the master at {addr}: {r}; something on the path between this client and the master altered the connection, which is closed")));
                let mut head = [0u8; FRAME_HEAD_LEN];
                let got = poll_read(s, &mut head, self.spin);
                s.read_exact(&mut head[got..]).map_err(io)?;
                let n = opener.open_frame_head(&head, proto::MAX_FRAME).map_err(garbled)?;
                let mut sealed = vec![0u8; frame_body_len(n)];
                s.read_exact(&mut sealed).map_err(io)?;
                let mut body = Vec::new();
                opener.open_frame_body(&sealed, &mut body).map_err(garbled)?;
                body
            }
        };
        let resp: Response = proto::decode(&body).map_err(Failure::Garbled)?;
        if matches!(resp, Response::Err(StoreError::Unauthorized(_))) {
            // (The master closes a connection it refuses.)
            return Ok((resp, epoch));
        }
        let s = c;
        match conn {
            Conn::Pool => self.pool.lock().unwrap_or_else(|e| e.into_inner()).push(s),
            Conn::Aside => *self.aside.lock().unwrap_or_else(|e| e.into_inner()) = Some(s),
        }
        Ok((resp, epoch))
    }

    /// Closes every idle connection (the pool's and the background threads').
    fn drop_connections(&self) {
        self.pool.lock().unwrap_or_else(|e| e.into_inner()).clear();
        *self.aside.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    fn call(&self, req: &Request) -> StoreResult<Response> {
        self.call_within(req, FAILOVER_WAIT, Conn::Pool)
    }

    /// Like [`Rpc::call`], looking for a leader for at most `wait`.
    fn call_within(&self, req: &Request, wait: Duration, conn: Conn) -> StoreResult<Response> {
        self.call_within_at(req, wait, conn).map(|(r, _)| r)
    }

    /// [`Rpc::call_within`], with the epoch of the leader that answered.
    fn call_within_at(&self, req: &Request, wait: Duration, conn: Conn) -> StoreResult<(Response, u64)> {
        let Target::Etcd { .. } = &self.target else {
            return match self.call_once(req, conn) {
                Ok(r) => Ok(r),
                Err(Failure::NotSent(e) | Failure::Garbled(e)) => Err(e),
                Err(Failure::Lost(e)) if idempotent(req) => Err(e),
                Err(Failure::Lost(e)) => Err(lost(e)),
            };
        };
        let deadline = Instant::now() + wait;
        if self.addr().is_empty() {
            self.find_leader(deadline)?;
        }
        loop {
            let err = match self.call_once(req, conn) {
                Ok((Response::Err(StoreError::NotLeader { leader }), _)) => StoreError::NotLeader { leader },
                Ok((Response::Err(StoreError::OutcomeUnknown), epoch)) => {
                    // Applied by a master that stopped leading: not sent again (the new leader
                    // may have the change). The next call finds the leader.
                    self.forget_leader();
                    return Ok((Response::Err(StoreError::OutcomeUnknown), epoch));
                }
                Ok(r) => return Ok(r),
                // (A key missing or different: no other master or later try changes that.)
                Err(Failure::NotSent(e @ StoreError::Unauthorized(_))) => return Err(e),
                Err(Failure::NotSent(e)) => e,
                Err(Failure::Lost(e) | Failure::Garbled(e)) if idempotent(req) => e,
                Err(Failure::Garbled(e)) => {
                    self.forget_leader();
                    return Err(e);
                }
                Err(Failure::Lost(e)) => {
                    // It may have been applied: not sent again. The next call finds the leader.
                    self.forget_leader();
                    return Err(lost(e));
                }
            };
            if Instant::now() >= deadline {
                return Err(StoreError::Rpc(format!("no leader answered within {wait:?}: {err}")));
            }
            tracing::debug!("master: {err}; looking for the leader");
            self.forget_leader();
            self.find_leader(deadline)?;
        }
    }

    fn call_ok(&self, req: &Request) -> StoreResult<Response> {
        self.call(req)?.into_result()
    }

    /// Drops the connections to the current master so that the next call reads the key.
    fn forget_leader(&self) {
        self.drop_connections();
        self.addr.lock().unwrap_or_else(|e| e.into_inner()).0.clear();
    }

    /// Reads the leader key until it names a master that answers (or `deadline`); on a new
    /// leader, re-registers this client there if it does not know it.
    fn find_leader(&self, deadline: Instant) -> StoreResult<()> {
        let Target::Etcd { etcd, key } = &self.target else { return Ok(()) };
        let mut last;
        loop {
            match etcd.get_kv(key) {
                Ok(Some(kv)) => {
                    let addr = String::from_utf8_lossy(&kv.value).into_owned();
                    match self.connect(&addr) {
                        Ok(s) => {
                            let changed = {
                                // A new term, or a new address (an etcd that lost its data counts
                                // revisions from 1 again). The epoch changes with the address,
                                // under its lock (`call_once` reads them together).
                                let mut cur = self.addr.lock().unwrap_or_else(|e| e.into_inner());
                                let found = (addr.clone(), kv.create_revision);
                                cur.0 = addr.clone();
                                let known = std::mem::replace(&mut cur.1, found.clone());
                                (known != found).then(|| self.epoch.fetch_add(1, Ordering::AcqRel) + 1)
                            };
                            self.pool.lock().unwrap_or_else(|e| e.into_inner()).push(s);
                            if let Some(e) = changed {
                                tracing::info!(term = kv.create_revision, epoch = e, "the store master leader is {addr}");
                                self.reregister();
                            }
                            return Ok(());
                        }
                        Err(e @ StoreError::Unauthorized(_)) => return Err(e),
                        Err(e) => last = e.to_string(),
                    }
                }
                Ok(None) => last = format!("no master leads (the key {key} is absent)"),
                Err(e) => last = e.to_string(),
            }
            if Instant::now() >= deadline {
                return Err(StoreError::Rpc(format!("no store master leader found through {} in time: {last}", etcd.location())));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Tells a master that did not know this client which of its writes may still be landing
    /// ([`Writes`]), so that it places nothing new there meanwhile. Best effort (a master of
    /// an older version refuses the request: logged).
    fn report_writes(&self, client: u64, conn: Conn) {
        let writes = self.writes.lock().unwrap_or_else(|e| e.into_inner()).report(Instant::now());
        if writes.is_empty() {
            return;
        }
        let n = writes.len();
        match self.call_once(&Request::HoldWrites { client, writes }, conn).map(|(r, _)| r) {
            Ok(Response::Ok) => tracing::warn!("the master did not know this client: told it of {n} writes that may still be landing, so that it gives their space to nothing else meanwhile"),
            Ok(other) => tracing::warn!("telling the master of {n} writes that may still be landing: {other:?}"),
            Err(Failure::NotSent(e) | Failure::Lost(e) | Failure::Garbled(e)) => tracing::warn!("telling the master of {n} writes that may still be landing: {e}"),
        }
    }

    /// On a new leader: a ping; remount when it does not know this client (one that started
    /// empty, or lost the client). Best effort: the ping thread remounts too.
    fn reregister(&self) {
        let (client, segments) = {
            let r = self.registration.lock().unwrap_or_else(|e| e.into_inner());
            if !r.mounted {
                return;
            }
            (r.client, r.segments.clone())
        };
        match self.call_once(&Request::Ping { client }, Conn::Pool).map(|(r, _)| r) {
            Ok(Response::Ping(PingStatus::NeedRemount)) => {
                match self.call_once(&Request::RemountSegments { client, segments }, Conn::Pool).map(|(r, _)| r) {
                    Ok(Response::Ok) => tracing::info!("remounted at the new leader {}", self.addr()),
                    Ok(other) => tracing::warn!("remount at the new leader: {other:?}"),
                    Err(Failure::NotSent(e) | Failure::Lost(e) | Failure::Garbled(e)) => tracing::warn!("remount at the new leader: {e}"),
                }
                self.report_writes(client, Conn::Pool);
            }
            Ok(_) => {}
            Err(Failure::NotSent(e) | Failure::Lost(e) | Failure::Garbled(e)) => tracing::debug!("ping of the new leader: {e}"),
        }
    }
}

struct Inner {
    engine: Arc<TransferEngine>,
    /// Set when the engine is shared ([`Client::with_engine`]): its owner's "closed" flag.
    /// Once set, every call fails with [`engine_closed`] instead of touching the engine.
    shared: Option<Arc<AtomicBool>>,
    rpc: Rpc,
    id: u64,
    /// The last put id this client chose (`Request::PutStart`'s `put`; the client id is
    /// random per client, so counting from 0 keeps ids distinct and their varints short).
    next_put: AtomicU64,
    segment: Option<(HostBuffer, Segment)>,
    /// The segment was unmounted at the master (by `close`, or by the pinger once the
    /// shared engine serving it was closed): never twice.
    unmounted: AtomicBool,
    staging: Option<(HostBuffer, Mutex<SegmentSpace>)>,
    closed: AtomicBool,
    cfg: ClientConfig,
    /// The process that set the client up (see Drop).
    pid: u32,
    /// Reads finished and not yet released at the master.
    releases: Mutex<Releases>,
    /// Holds the port appended to a bare `local_hostname` (central mode), as Mooncake does.
    _port: Option<TcpListener>,
}

/// Reads finished and not yet released at the master: carried by the next request, or sent
/// by the release thread once they waited [`RELEASE_AFTER`].
#[derive(Default)]
struct Releases {
    ids: Vec<u64>,
    /// When the oldest of `ids` was queued.
    since: Option<Instant>,
}

/// How long finished reads wait for a request to carry their release before the release
/// thread sends it on its own (a client that went idle).
const RELEASE_AFTER: Duration = Duration::from_millis(5);

impl Releases {
    fn queue(&mut self, ids: impl IntoIterator<Item = u64>, now: Instant) {
        let before = self.ids.len();
        self.ids.extend(ids);
        if before == 0 && !self.ids.is_empty() {
            self.since = Some(now);
        }
    }

    /// All of them (a request carries them).
    fn take(&mut self) -> Vec<u64> {
        self.since = None;
        std::mem::take(&mut self.ids)
    }

    /// All of them if the oldest waited [`RELEASE_AFTER`], else none.
    fn overdue(&mut self, now: Instant) -> Vec<u64> {
        match self.since {
            Some(t) if now.saturating_duration_since(t) >= RELEASE_AFTER => self.take(),
            _ => Vec::new(),
        }
    }
}

impl Inner {
    /// Unmounts this client's segment at the master, once, waiting at most `within` for a
    /// master to answer (across a failover: see `Rpc::call_within`).
    fn unmount_segment(&self, within: Duration) -> StoreResult<()> {
        match &self.segment {
            Some((_, seg)) if !self.unmounted.swap(true, Ordering::AcqRel) => {
                // No longer remounted at a new leader (a call in flight elsewhere may find one).
                self.rpc.registration.lock().unwrap_or_else(|e| e.into_inner()).mounted = false;
                self.rpc.call_within(&Request::UnmountSegment { client: self.id, segment: seg.id }, within, Conn::Pool).and_then(Response::into_result).map(|_| ())
            }
            _ => Ok(()),
        }
    }

    fn queue_releases(&self, ids: impl IntoIterator<Item = u64>) {
        self.releases.lock().unwrap_or_else(|e| e.into_inner()).queue(ids, Instant::now());
    }

    /// Sends `reqs` in one round trip, led by the releases of finished reads; the answers to
    /// `reqs`, in order.
    fn call_batch(&self, reqs: Vec<Request>) -> StoreResult<Vec<Response>> {
        self.call_batch_on(reqs, Conn::Pool)
    }

    fn call_batch_on(&self, reqs: Vec<Request>, conn: Conn) -> StoreResult<Vec<Response>> {
        self.call_batch_at(reqs, conn).map(|(a, _)| a)
    }

    /// [`Inner::call_batch_on`], with the epoch of the leader that answered.
    fn call_batch_at(&self, reqs: Vec<Request>, conn: Conn) -> StoreResult<(Vec<Response>, u64)> {
        let n = reqs.len();
        if n == 0 {
            return Ok((Vec::new(), self.rpc.epoch()));
        }
        let ids = self.releases.lock().unwrap_or_else(|e| e.into_inner()).take();
        let pre = usize::from(!ids.is_empty());
        let mut all = Vec::with_capacity(n + pre);
        if pre == 1 {
            all.push(Request::ReleaseReads { ids: ids.clone() });
        }
        all.extend(reqs);
        let answer = if all.len() == 1 {
            let r = all.pop().ok_or_else(|| StoreError::Internal("empty request list".into()))?;
            self.rpc.call_within_at(&r, FAILOVER_WAIT, conn).map(|(a, epoch)| (vec![a], epoch))
        } else {
            match self.rpc.call_within_at(&Request::Batch(all), FAILOVER_WAIT, conn) {
                Ok((Response::Batch(v), epoch)) if v.len() == n + pre => Ok((v.into_iter().skip(pre).collect(), epoch)),
                Ok((Response::Err(e), _)) => Err(e),
                Ok((other, _)) => Err(StoreError::Rpc(format!("unexpected answer to a batch: {other:?}"))),
                Err(e) => Err(e),
            }
        };
        if answer.is_err() && pre == 1 {
            self.queue_releases(ids); // not delivered: with the next request
        }
        answer
    }

    fn call_one(&self, req: Request) -> StoreResult<Response> {
        self.call_batch(vec![req])?.pop().ok_or_else(|| StoreError::Rpc("the master sent no answer".into()))?.into_result()
    }
}

/// Whether an engine failed to start because its segment name is taken (retry another port).
fn name_taken(e: &kvferry::Error) -> bool {
    match e {
        kvferry::Error::Metadata { reason, .. } => reason.contains("already registered") || reason.contains("Duplicate"),
        _ => false,
    }
}

/// Starts the engine. In central mode a `local_hostname` without a port gets a bound port
/// appended (retrying another one when the name is taken), as Mooncake's client does.
fn start_engine(cfg: &ClientConfig, mut ecfg: Config) -> StoreResult<(TransferEngine, Option<TcpListener>)> {
    let start = |ecfg: Config| TransferEngine::new(ecfg);
    let failed = |e: kvferry::Error| StoreError::InvalidParams(format!("starting the transfer engine: {e}"));
    let host = cfg.local_hostname.trim();
    if !ecfg.central() || host.is_empty() || kvferry::config::split_host_port(host).1.is_some() {
        return start(ecfg).map(|e| (e, None)).map_err(failed);
    }
    ecfg.validate().map_err(failed)?;
    let retries = ecfg.store_client_setup_retries;
    let (lo, hi) = ecfg.store_client_ports;
    let bare = kvferry::config::split_host_port(host).0;
    let mut last = String::from("no free port in the range");
    for _ in 0..retries {
        // Hold a free port of the range (Mooncake's AutoPortBinder: any address, random port).
        let mut held = None;
        for _ in 0..20 {
            let port = rand::random_range(lo..=hi);
            if let Ok(l) = TcpListener::bind(("0.0.0.0", port)) {
                held = Some((l, port));
                break;
            }
        }
        let Some((listener, port)) = held else { continue };
        let name = if bare.contains(':') { format!("[{bare}]:{port}") } else { format!("{bare}:{port}") };
        ecfg.local_hostname = name;
        match start(ecfg.clone()) {
            Ok(e) => return Ok((e, Some(listener))),
            Err(e) if name_taken(&e) => {
                tracing::info!("segment name {} is taken; retrying with another port: {e}", ecfg.local_hostname);
                last = e.to_string();
            }
            Err(e) => return Err(failed(e)),
        }
    }
    Err(StoreError::InvalidParams(format!(
        "local_hostname {host:?}: no free segment name {host}:<port> with a port in {lo}..={hi} after {retries} attempts (last: {last}); widen KVFERRY_STORE_CLIENT_MIN_PORT/KVFERRY_STORE_CLIENT_MAX_PORT (MC_STORE_CLIENT_*) or pass host:port"
    )))
}

/// A store client. Cheap to share between threads (`&Client` is enough).
pub struct Client {
    inner: Arc<Inner>,
}

/// Space in the client's local buffer (registered memory) holding one value: what the bytes
/// API stages through, and what [`Client::get_buffers`] hands out so a value can be used
/// where it landed, without a copy (Mooncake's `BufferHandle`). The space returns to the
/// local buffer when this is dropped; the local buffer itself stays mapped while any value
/// lives, even after the client closed.
pub struct Staged {
    inner: Arc<Inner>,
    block: Option<crate::master::alloc::Block>,
    addr: u64,
    len: usize,
}

impl Drop for Staged {
    fn drop(&mut self) {
        if let (Some(b), Some((_, space))) = (self.block.take(), &self.inner.staging) {
            space.lock().unwrap_or_else(|e| e.into_inner()).free(b);
        }
    }
}

impl std::fmt::Debug for Staged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Staged {{ addr: {:#x}, len: {} }}", self.addr, self.len)
    }
}

impl Staged {
    #[allow(clippy::mut_from_ref)] // the block is this value's alone (see below)
    fn bytes(&self) -> &mut [u8] {
        // SAFETY: a block of the staging buffer owned by this value alone; the buffer lives
        // as long as `inner`.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }

    /// The value's bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.bytes()
    }

    /// The value's bytes, to change in place (they are this value's alone).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.bytes()
    }

    /// Where the bytes are (inside the client's registered local buffer).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A copy in a new `Vec`, its fresh memory faulted in first (`prefault_fresh`).
    pub fn to_vec(&self) -> Vec<u8> {
        let src = self.as_slice();
        let mut v: Vec<u8> = Vec::with_capacity(src.len());
        // SAFETY: the Vec's spare capacity is its own allocation, not yet initialized.
        unsafe { prefault_fresh(v.as_mut_ptr(), src.len()) };
        v.extend_from_slice(src);
        v
    }

    /// Copies the value into `dst` (its length), faulting `dst`'s pages in first when it is
    /// fresh memory the caller just allocated (`prefault_fresh`).
    pub fn copy_into_fresh(&self, dst: &mut [u8]) {
        let n = dst.len().min(self.len);
        // SAFETY: `dst` is borrowed mutably: its pages are ours to fault in.
        unsafe { prefault_fresh(dst.as_mut_ptr(), dst.len()) };
        dst[..n].copy_from_slice(&self.as_slice()[..n]);
    }
}

/// Faults in `[ptr, ptr + len)`, memory just allocated for a large copy, in one system call
/// instead of a page fault per 4 KiB page on first write (on a VM each costs more than
/// copying the page): `MADV_POPULATE_WRITE` for 256 KiB and more, after `MADV_HUGEPAGE` on
/// its 2 MiB-aligned interior for 4 MiB and more (where the host's transparent huge pages
/// allow it). Measured here: 32 x 1 MiB into fresh `Vec`s 28 -> 13 ms; 8 x 16 MiB 106 -> 27 ms
/// (the first huge-page allocation after boot can be slower: the kernel compacts memory).
/// Failures are ignored: the copy then faults the pages as before.
///
/// # Safety
/// The range must be memory the caller owns and may write (its contents may be changed only
/// as a first write of zeros would: pages not yet present become zero pages).
unsafe fn prefault_fresh(ptr: *mut u8, len: usize) {
    const PAGE: usize = 4096;
    const HUGE: usize = 2 << 20;
    if len < 256 << 10 {
        return;
    }
    let start = ptr as usize;
    if len >= 4 << 20 {
        let (a, e) = ((start + HUGE - 1) & !(HUGE - 1), (start + len) & !(HUGE - 1));
        if e > a {
            // SAFETY: inside the caller's range (see above); advice only.
            let _ = unsafe { rustix::mm::madvise(a as *mut std::ffi::c_void, e - a, rustix::mm::Advice::LinuxHugepage) };
        }
    }
    let (a, e) = ((start + PAGE - 1) & !(PAGE - 1), (start + len) & !(PAGE - 1));
    if e > a {
        // SAFETY: inside the caller's range; populating only faults pages in.
        let _ = unsafe { rustix::mm::madvise(a as *mut std::ffi::c_void, e - a, rustix::mm::Advice::LinuxPopulateWrite) };
    }
}

impl Client {
    /// Starts a transfer engine, contributes `global_segment_size` bytes, mounts them at the
    /// master and starts pinging it.
    pub fn setup(cfg: ClientConfig) -> StoreResult<Client> {
        check_protocol(&cfg)?;
        let mut ecfg = Config::from_env().map_err(|e| StoreError::InvalidParams(e.to_string()))?;
        ecfg.local_hostname = cfg.local_hostname.clone();
        ecfg.metadata_server = cfg.metadata_server.clone();
        ecfg.transfer_timeout = cfg.transfer_timeout;
        let (engine, port) = start_engine(&cfg, ecfg)?;
        Client::build(cfg, Arc::new(engine), None, port)
    }

    /// Like [`Client::setup`] on an engine that is already running (Mooncake's
    /// `setup(..., engine)`): no second engine is started; the segment is mounted as the
    /// engine's own segment (its name, its listeners), and memory registered on the engine
    /// serves the store and the other way round. `cfg.local_hostname` must be empty, the
    /// engine's segment name, or its host part (anything else is refused: the segment can
    /// only carry the engine's name). `cfg.metadata_server` is ignored (the engine's is used).
    ///
    /// `engine_closed` is the owner's flag for "the engine was closed": once set, calls fail
    /// with a clear error instead of using it. Closing the client unmounts the segment and
    /// unregisters the client's own buffers from the engine; the engine keeps running.
    pub fn with_engine(mut cfg: ClientConfig, engine: Arc<TransferEngine>, engine_closed: Option<Arc<AtomicBool>>) -> StoreResult<Client> {
        check_protocol(&cfg)?;
        let name = engine.segment_name().to_string();
        let asked = cfg.local_hostname.trim();
        let (asked_host, asked_port) = kvferry::config::split_host_port(asked);
        let engine_host = kvferry::config::split_host_port(&name).0;
        let matches = asked.is_empty() || asked == name || (asked_port.is_none() && asked_host == engine_host);
        if !matches {
            return Err(StoreError::InvalidParams(format!(
                "local_hostname {asked:?} differs from the shared engine's segment name {name:?}; a store on a shared engine mounts the engine's own segment, so pass the engine's name (or its host, or \"\"), or set the store up without engine= to get a segment of its own"
            )));
        }
        cfg.local_hostname = name;
        cfg.metadata_server = engine.config().metadata_server.clone();
        let flag = engine_closed.unwrap_or_default();
        Client::build(cfg, engine, Some(flag), None)
    }

    fn build(cfg: ClientConfig, engine: Arc<TransferEngine>, shared: Option<Arc<AtomicBool>>, port: Option<TcpListener>) -> StoreResult<Client> {
        if shared.as_ref().is_some_and(|f| f.load(Ordering::Acquire)) {
            return Err(engine_closed());
        }
        let rpc = Rpc::new(&cfg.master_server_addr, Duration::from_secs(30), engine.config())?;
        let id: u64 = rand::random::<u64>() | 1;
        let mut segment = None;
        if cfg.global_segment_size > 0 {
            // Huge pages where the host enables them for shared memory. Every page is
            // allocated here, in setup (~1.1 s per GiB on the 2-vCPU VM): allocating from a
            // background thread instead made the first second after setup run at 57% of the
            // steady rate there (the zeroing competes with the traffic), against 91% now.
            let opts = kvferry::hostbuf::HostOptions { populate: true, huge_pages: true, shareable: true };
            let buf = HostBuffer::with(cfg.global_segment_size as usize, opts).map_err(|e| StoreError::InvalidParams(format!("global_segment_size: {e}")))?;
            engine.register_memory(buf.addr(), buf.len() as u64, "cpu:0").map_err(|e| StoreError::Internal(e.to_string()))?;
            let seg = Segment { id: rand::random(), name: engine.segment_name().to_string(), te_endpoint: engine.segment_name().to_string(), base: buf.addr(), size: buf.len() as u64 };
            segment = Some((buf, seg));
        }
        let mut staging = None;
        if cfg.local_buffer_size > 0 {
            let registered = HostBuffer::new(cfg.local_buffer_size as usize, true)
                .map_err(|e| StoreError::InvalidParams(format!("local_buffer_size: {e}")))
                .and_then(|buf| engine.register_memory(buf.addr(), buf.len() as u64, "cpu:0").map(|_| buf).map_err(|e| StoreError::Internal(e.to_string())));
            let buf = match registered {
                Ok(b) => b,
                Err(e) => {
                    // A shared engine outlives this call: withdraw the segment before it is freed.
                    if let (Some(_), Some((b, _))) = (&shared, &segment) {
                        let _ = engine.unregister_memory(b.addr());
                    }
                    return Err(e);
                }
            };
            let space = SegmentSpace::new(buf.addr(), buf.len() as u64);
            staging = Some((buf, Mutex::new(space)));
        }
        let inner = Arc::new(Inner { engine, shared, rpc, id, next_put: AtomicU64::new(0), segment, unmounted: AtomicBool::new(false), staging, closed: AtomicBool::new(false), cfg, pid: std::process::id(), releases: Mutex::default(), _port: port });
        // Register with the master even without a segment, so pings are recognised.
        match &inner.segment {
            Some((_, seg)) => inner.rpc.call_ok(&Request::MountSegment { client: id, segment: seg.clone() })?,
            None => inner.rpc.call_ok(&Request::RemountSegments { client: id, segments: Vec::new() })?,
        };
        *inner.rpc.registration.lock().unwrap_or_else(|e| e.into_inner()) = Registration { client: id, segments: inner.segment.iter().map(|(_, s)| s.clone()).collect(), mounted: true };
        let weak = Arc::downgrade(&inner);
        let every = inner.cfg.ping_interval;
        std::thread::Builder::new().name("kvf-store-ping".into()).spawn(move || ping_loop(weak, every)).map_err(|e| StoreError::Internal(e.to_string()))?;
        let weak = Arc::downgrade(&inner);
        std::thread::Builder::new().name("kvf-store-release".into()).spawn(move || release_loop(weak)).map_err(|e| StoreError::Internal(e.to_string()))?;
        Ok(Client { inner })
    }

    /// The transfer engine this client uses (register buffers for zero-copy calls with it).
    pub fn engine(&self) -> &TransferEngine {
        &self.inner.engine
    }

    /// This client's segment name: `host:port` (in central mode, the port appended to a bare
    /// `local_hostname`); what Mooncake's `get_hostname()` returns.
    pub fn segment_name(&self) -> &str {
        self.inner.engine.segment_name()
    }

    /// Registers a buffer for `put_from` / `get_into`.
    pub fn register_buffer(&self, addr: u64, len: u64) -> StoreResult<()> {
        self.inner.engine.register_memory(addr, len, "cpu:0").map_err(|e| StoreError::InvalidParams(e.to_string()))
    }

    pub fn unregister_buffer(&self, addr: u64) -> StoreResult<()> {
        self.inner.engine.unregister_memory(addr).map_err(|e| StoreError::InvalidParams(e.to_string()))
    }

    fn check_open(&self) -> StoreResult<()> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(StoreError::InvalidParams("the client is closed".into()));
        }
        if std::process::id() != self.inner.pid {
            // A forked child shares the parent's pooled master connections: either could read
            // the other's answer (another key's replicas). A child sets up its own client.
            return Err(StoreError::InvalidParams("this client was set up by another process (the parent of a fork); set up a new client in this process".into()));
        }
        if self.inner.shared.as_ref().is_some_and(|f| f.load(Ordering::Acquire)) {
            return Err(engine_closed());
        }
        Ok(())
    }

    fn segment_id(&self, endpoint: &str) -> StoreResult<u64> {
        self.inner.engine.open_segment(endpoint).map_err(|e| StoreError::TransferFailed(e.to_string()))
    }

    /// Writes `[addr, addr+len)` (registered memory) as `key`.
    pub fn put_from(&self, key: &str, addr: u64, len: u64, cfg: &ReplicateConfig) -> StoreResult<()> {
        self.batch_put_from_impl(&[(key, addr, len)], cfg, false).pop().unwrap_or_else(|| Err(StoreError::Internal("no result".into())))
    }

    /// Like [`Client::put_from`], replacing an existing value.
    pub fn upsert_from(&self, key: &str, addr: u64, len: u64, cfg: &ReplicateConfig) -> StoreResult<()> {
        self.batch_put_from_impl(&[(key, addr, len)], cfg, true).pop().unwrap_or_else(|| Err(StoreError::Internal("no result".into())))
    }

    /// Writes many values in one master round trip and one transfer batch.
    pub fn batch_put_from(&self, items: &[(&str, u64, u64)], cfg: &ReplicateConfig) -> Vec<StoreResult<()>> {
        self.batch_put_from_impl(items, cfg, false)
    }

    pub fn batch_upsert_from(&self, items: &[(&str, u64, u64)], cfg: &ReplicateConfig) -> Vec<StoreResult<()>> {
        self.batch_put_from_impl(items, cfg, true)
    }

    fn batch_put_from_impl(&self, items: &[(&str, u64, u64)], cfg: &ReplicateConfig, upsert: bool) -> Vec<StoreResult<()>> {
        let parts: Vec<[(u64, u64); 1]> = items.iter().map(|&(_, a, l)| [(a, l)]).collect();
        let items: Vec<(&str, &[(u64, u64)])> = items.iter().zip(&parts).map(|(&(k, _, _), p)| (k, &p[..])).collect();
        self.batch_put_parts_impl(&items, cfg, upsert)
    }

    /// Stores, per key, the concatenation of its parts (`(addr, len)` ranges of registered
    /// memory, in order), each written straight into place in every replica: no copy however
    /// scattered the parts are (a KV cache's per-layer blocks).
    pub fn batch_put_from_parts(&self, items: &[(&str, &[(u64, u64)])], cfg: &ReplicateConfig, upsert: bool) -> Vec<StoreResult<()>> {
        self.batch_put_parts_impl(items, cfg, upsert)
    }

    fn batch_put_parts_impl(&self, items: &[(&str, &[(u64, u64)])], cfg: &ReplicateConfig, upsert: bool) -> Vec<StoreResult<()>> {
        if let Err(e) = self.check_open() {
            return items.iter().map(|_| Err(e.clone())).collect();
        }
        let id = self.inner.id;
        let total = |parts: &[(u64, u64)]| parts.iter().map(|p| p.1).sum::<u64>();
        let first = self.inner.next_put.fetch_add(items.len() as u64, Ordering::Relaxed) + 1;
        let puts: Vec<u64> = (first..first + items.len() as u64).collect();
        let starts: Vec<Request> = items.iter().zip(&puts).map(|(&(k, parts), &put)| Request::PutStart { client: id, key: k.to_string(), size: total(parts), config: cfg.clone(), upsert, put }).collect();
        // The answers, and the leader that reserved the space (its epoch); a put ended under
        // another one may not be stored.
        let (answers, epoch) = match self.inner.call_batch_at(starts, Conn::Pool) {
            Ok(a) => a,
            Err(e) => {
                if e == StoreError::OutcomeUnknown {
                    self.revoke_unknown(items.iter().zip(&puts).map(|(&(k, _), &put)| (k, put)));
                }
                return items.iter().map(|_| Err(e.clone())).collect();
            }
        };
        let unknown = answers.iter().zip(items.iter().zip(&puts)).filter(|(a, _)| **a == Response::Err(StoreError::OutcomeUnknown));
        self.revoke_unknown(unknown.map(|(_, (&(k, _), &put))| (k, put)));
        let mut results: Vec<StoreResult<()>> = Vec::with_capacity(items.len());
        let mut reqs = Vec::new();
        let mut owner = Vec::new(); // request index -> item index
        // Each replica's range (endpoint, address, length): what may still be landing.
        let mut writes: Vec<PutWrite> = Vec::new();
        // Every item the master reserved space for is ended or revoked: one whose replica's
        // segment could not be opened (nothing written) too; left, it refused every put of
        // the key until the discard timeout, which Mooncake's API reports as stored.
        let reserved: Vec<bool> = answers.iter().map(|a| matches!(a, Response::Replicas(_))).collect();
        for (i, (a, &(_, parts))) in answers.into_iter().zip(items).enumerate() {
            match a {
                Response::Replicas(reps) => {
                    let mut ok = Ok(());
                    for r in reps {
                        match self.segment_id(&r.te_endpoint) {
                            Ok(seg) => {
                                writes.push((r.te_endpoint, r.addr, total(parts)));
                                let mut off = 0;
                                for &(addr, len) in parts.iter().filter(|p| p.1 > 0) {
                                    reqs.push(TransferRequest { opcode: Opcode::Write, source: addr, target_id: seg, target_offset: r.addr + off, length: len });
                                    owner.push(i);
                                    off += len;
                                }
                            }
                            Err(e) => ok = Err(e),
                        }
                    }
                    results.push(ok);
                }
                Response::Err(e) => results.push(Err(e)),
                other => results.push(Err(StoreError::Rpc(format!("unexpected answer {other:?}")))),
            }
        }
        if !reqs.is_empty() {
            // Until they landed, or (failed) until they can no longer land: what a master
            // that forgot this client is told ([`Writes`]).
            let started = Instant::now();
            let batch = self.inner.rpc.writes.lock().unwrap_or_else(|e| e.into_inner()).start(writes, started + self.inner.cfg.transfer_timeout * 2);
            let landed = match self.transfer(&reqs) {
                Ok(statuses) => {
                    let mut all = true;
                    for (k, st) in statuses.into_iter().enumerate() {
                        if let Err(e) = st {
                            results[owner[k]] = Err(e);
                            all = false;
                        }
                    }
                    all
                }
                Err(e) => {
                    for &o in &owner {
                        results[o] = Err(e.clone());
                    }
                    false
                }
            };
            self.inner.rpc.writes.lock().unwrap_or_else(|e| e.into_inner()).ended(batch, landed);
        }
        // Every reservation ends: written ones with a PutEnd, failed ones (a transfer error, a
        // replica whose segment did not open) with a PutRevoke.
        let ends: Vec<(usize, Request)> = items
            .iter()
            .enumerate()
            .filter(|(i, _)| reserved[*i])
            .map(|(i, &(k, _))| {
                let (key, put) = (k.to_string(), puts[i]);
                (i, if results[i].is_ok() { Request::PutEnd { client: id, key, put } } else { Request::PutRevoke { client: id, key, put } })
            })
            .collect();
        let was_ok: Vec<bool> = ends.iter().map(|(i, _)| results[*i].is_ok()).collect();
        let (mut ended, end_epoch) = match self.inner.call_batch_at(ends.iter().map(|(_, r)| r.clone()).collect(), Conn::Pool) {
            Ok((a, e)) => (Ok(a), e),
            Err(e) => (Err(e), self.inner.rpc.epoch()),
        };
        // PutEnds whose outcome is unknown (their leader stopped leading, or the connection
        // failed, after they were sent) are sent once more, to the leader found now: the bytes
        // are in place, so one that knows the write in progress (from the journal or its
        // mirror) completes it; one that does not, or that the first PutEnd reached, answers an
        // error, and the outcome stays unknown.
        let unknown: Vec<usize> = match &ended {
            Ok(answers) => (0..ends.len()).filter(|&k| was_ok[k] && answers[k] == Response::Err(StoreError::OutcomeUnknown)).collect(),
            Err(StoreError::OutcomeUnknown) => (0..ends.len()).filter(|&k| was_ok[k]).collect(),
            Err(_) => Vec::new(),
        };
        if !unknown.is_empty() {
            let again: Vec<Request> = unknown.iter().map(|&k| ends[k].1.clone()).collect();
            if let Ok(answers) = self.call_batch(again) {
                let mut all = match ended {
                    Ok(a) => a,
                    Err(e) => ends.iter().map(|_| Response::Err(e.clone())).collect(),
                };
                for (&k, a) in unknown.iter().zip(answers) {
                    if a == Response::Ok {
                        all[k] = Response::Ok;
                    }
                }
                ended = Ok(all);
            }
        }
        // A failover between PutStart and PutEnd whose new leader does not know the write (it
        // started empty): the put failed; say so, it is worth retrying.
        let failed_over = end_epoch != epoch;
        // (Not when the outcome is unknown: the end may have reached the new leader.)
        let fail = |i: usize, e: StoreError| if failed_over && e != StoreError::OutcomeUnknown { StoreError::MasterFailover(items[i].0.to_string()) } else { e };
        match ended {
            Ok(answers) => {
                for ((i, _), (a, ok)) in ends.iter().zip(answers.into_iter().zip(was_ok)) {
                    if let (Response::Err(e), true) = (a, ok) {
                        results[*i] = Err(fail(*i, e));
                    }
                }
            }
            Err(e) => {
                for (i, _) in &ends {
                    results[*i] = Err(fail(*i, e.clone()));
                }
            }
        }
        results
    }

    /// Runs transfer requests as one batch; per-request results.
    fn transfer(&self, reqs: &[TransferRequest]) -> StoreResult<Vec<StoreResult<()>>> {
        // Returns once every request is terminal: the caller's memory may then be reused.
        let statuses = self.inner.engine.transfer_sync_all(reqs, self.inner.cfg.transfer_timeout).map_err(|x| StoreError::TransferFailed(x.to_string()))?;
        Ok(statuses
            .into_iter()
            .map(|st| if st.status == TaskStatus::Completed { Ok(()) } else { Err(StoreError::TransferFailed(st.reason.unwrap_or_else(|| format!("{:?}", st.status)))) })
            .collect())
    }

    fn call_batch(&self, reqs: Vec<Request>) -> StoreResult<Vec<Response>> {
        self.inner.call_batch(reqs)
    }

    /// Puts whose start may or may not have reached the new leader
    /// ([`StoreError::OutcomeUnknown`]): revoked there, best effort, so that their keys are
    /// free for a retry at once instead of after the master's discard timeout (a revoke names
    /// the put, so it touches nothing else; one the leader does not know is an error,
    /// ignored).
    fn revoke_unknown<'a>(&self, puts: impl Iterator<Item = (&'a str, u64)>) {
        let id = self.inner.id;
        let revokes: Vec<Request> = puts.map(|(key, put)| Request::PutRevoke { client: id, key: key.to_string(), put }).collect();
        if revokes.is_empty() {
            return;
        }
        if let Err(e) = self.call_batch(revokes) {
            tracing::debug!("store: revoking puts whose start may have reached the new leader: {e}");
        }
    }

    fn pick<'a>(&self, list: &'a ReplicaList) -> Vec<&'a ReplicaDesc> {
        // The local replica first (a memcpy), then the others in the master's order.
        let me = self.segment_name();
        let mut v: Vec<&ReplicaDesc> = list.replicas.iter().filter(|r| r.te_endpoint == me).collect();
        v.extend(list.replicas.iter().filter(|r| r.te_endpoint != me));
        v
    }

    /// Reads `key` into `[addr, addr+cap)` (registered memory); returns its size.
    pub fn get_into(&self, key: &str, addr: u64, cap: u64) -> StoreResult<u64> {
        self.batch_get_into(&[(key, addr, cap)]).pop().unwrap_or_else(|| Err(StoreError::Internal("no result".into())))
    }

    /// Reads many keys with one master round trip and one transfer batch.
    pub fn batch_get_into(&self, items: &[(&str, u64, u64)]) -> Vec<StoreResult<u64>> {
        let parts: Vec<[(u64, u64); 1]> = items.iter().map(|&(_, a, l)| [(a, l)]).collect();
        let items: Vec<(&str, &[(u64, u64)])> = items.iter().zip(&parts).map(|(&(k, _, _), p)| (k, &p[..])).collect();
        self.batch_get_into_parts(&items)
    }

    /// Reads, per key, its value across its parts (`(addr, len)` ranges of registered memory,
    /// filled in order, each straight from the replica); returns the value's size. A value
    /// larger than the parts together fails with `BufferOverflow`, touching nothing.
    pub fn batch_get_into_parts(&self, items: &[(&str, &[(u64, u64)])]) -> Vec<StoreResult<u64>> {
        match self.replica_lists(items.iter().map(|&(k, _)| k)) {
            Ok((answers, t0)) => self.read_listed(items, answers, t0),
            Err(e) => items.iter().map(|_| Err(e.clone())).collect(),
        }
    }

    /// Asks the master for the replica lists of `keys` (each grants a lease and a read to
    /// release) in one round trip; the answers, and when they were asked for (the leases
    /// run from then).
    fn replica_lists<'k>(&self, keys: impl Iterator<Item = &'k str>) -> StoreResult<(Vec<Response>, Instant)> {
        self.check_open()?;
        let t0 = Instant::now();
        Ok((self.call_batch(keys.map(|k| Request::GetReplicaList { key: k.to_string() }).collect())?, t0))
    }

    /// Reads each item's value from the replicas its answer (to `GetReplicaList`, asked at
    /// `t0`) lists; then queues the releases of those reads.
    fn read_listed(&self, items: &[(&str, &[(u64, u64)])], answers: Vec<Response>, t0: Instant) -> Vec<StoreResult<u64>> {
        let mut results: Vec<StoreResult<u64>> = Vec::with_capacity(items.len());
        let mut lists: Vec<Option<ReplicaList>> = Vec::with_capacity(items.len());
        // Per item, the index (in `pick`'s order) of the replica read first.
        let mut first_used: Vec<usize> = Vec::with_capacity(items.len());
        let mut reqs = Vec::new();
        let mut owner = Vec::new();
        for (i, (a, &(key, parts))) in answers.into_iter().zip(items).enumerate() {
            let cap: u64 = parts.iter().map(|p| p.1).sum();
            match a {
                Response::ReplicaList(l) if l.size > cap => {
                    results.push(Err(StoreError::BufferOverflow { need: l.size, have: cap }));
                    // (Listed, so that the read it was granted is released below: unreleased, it
                    // held the object against eviction and its old space for a whole lease.)
                    lists.push(Some(l));
                    first_used.push(usize::MAX);
                }
                Response::ReplicaList(l) => {
                    // The first replica whose segment opens (one on a peer that died, not yet
                    // dropped by the master, does not fail the read while another is listed).
                    let mut found = Err(StoreError::ObjectNotFound(key.to_string()));
                    let mut used = usize::MAX;
                    for (j, r) in self.pick(&l).into_iter().enumerate() {
                        match self.segment_id(&r.te_endpoint) {
                            Ok(seg) => {
                                found = Ok((seg, r.addr));
                                used = j;
                                break;
                            }
                            Err(e) => found = Err(e),
                        }
                    }
                    match found {
                        Ok((seg, addr)) => {
                            for req in read_parts(parts, seg, addr, l.size) {
                                reqs.push(req);
                                owner.push(i);
                            }
                            results.push(Ok(l.size));
                        }
                        Err(e) => results.push(Err(e)),
                    }
                    lists.push(Some(l));
                    first_used.push(used);
                }
                Response::Err(e) => {
                    results.push(Err(e));
                    lists.push(None);
                    first_used.push(usize::MAX);
                }
                other => {
                    results.push(Err(StoreError::Rpc(format!("unexpected answer {other:?}"))));
                    lists.push(None);
                    first_used.push(usize::MAX);
                }
            }
        }
        if !reqs.is_empty() {
            let statuses = match self.transfer(&reqs) {
                Ok(s) => s,
                Err(e) => reqs.iter().map(|_| Err(e.clone())).collect(),
            };
            // The first failure of each key; its other replicas are tried, all parts again.
            let mut failed: Vec<(usize, StoreError)> = Vec::new();
            for (k, st) in statuses.into_iter().enumerate() {
                if let Err(e) = st {
                    if failed.last().is_none_or(|(i, _)| *i != owner[k]) {
                        failed.push((owner[k], e));
                    }
                }
            }
            for (i, first_err) in failed {
                let (key, parts) = items[i];
                let mut last: StoreResult<u64> = Err(first_err);
                if let Some(l) = &lists[i] {
                    for r in self.pick(l).into_iter().skip(first_used[i].saturating_add(1)) {
                        let one = self.segment_id(&r.te_endpoint).and_then(|seg| {
                            let again = read_parts(parts, seg, r.addr, l.size);
                            self.transfer(&again).and_then(|v| v.into_iter().collect::<StoreResult<Vec<()>>>())
                        });
                        last = one.map(|_| l.size);
                        if last.is_ok() {
                            break;
                        }
                    }
                }
                results[i] = last.map_err(|e| StoreError::TransferFailed(format!("{key}: {e}")));
            }
        }
        // A read that outlived its lease may have raced an overwrite: refuse it.
        let elapsed = t0.elapsed();
        for (i, l) in lists.iter().enumerate() {
            if let (Some(l), Ok(_)) = (l, &results[i]) {
                // (A millisecond early: the master counts whole milliseconds, so its lease may
                // end up to one before this client's count of it does.)
                if elapsed + Duration::from_millis(1) >= Duration::from_millis(l.lease_ttl_ms) {
                    results[i] = Err(StoreError::LeaseExpired(items[i].0.to_string()));
                }
            }
        }
        // Every transfer is terminal: the replicas read may be reclaimed.
        self.inner.queue_releases(lists.iter().flatten().map(|l| l.read_id));
        results
    }

    fn stage(&self, len: usize) -> StoreResult<Staged> {
        let Some((buf, space)) = &self.inner.staging else {
            return Err(StoreError::InvalidParams("this client has no local buffer (local_buffer_size = 0); use put_from/get_into with registered memory".into()));
        };
        let block = space.lock().unwrap_or_else(|e| e.into_inner()).allocate(len as u64).ok_or_else(|| StoreError::InvalidParams(format!(
            "{len} bytes do not fit in the free part of the local buffer ({} bytes); raise local_buffer_size",
            buf.len()
        )))?;
        Ok(Staged { inner: Arc::clone(&self.inner), addr: block.addr, len, block: Some(block) })
    }

    /// Stores `value` as `key` (copied through the local buffer).
    pub fn put(&self, key: &str, value: &[u8], cfg: &ReplicateConfig) -> StoreResult<()> {
        self.put_batch(&[(key, value)], cfg, false).pop().unwrap_or_else(|| Err(StoreError::Internal("no result".into())))
    }

    /// Stores `value` as `key`, replacing an existing value.
    pub fn upsert(&self, key: &str, value: &[u8], cfg: &ReplicateConfig) -> StoreResult<()> {
        self.put_batch(&[(key, value)], cfg, true).pop().unwrap_or_else(|| Err(StoreError::Internal("no result".into())))
    }

    /// Stores several values; per-key results.
    pub fn put_batch(&self, items: &[(&str, &[u8])], cfg: &ReplicateConfig, upsert: bool) -> Vec<StoreResult<()>> {
        let mut staged = Vec::with_capacity(items.len());
        for (_, v) in items {
            match self.stage(v.len().max(1)) {
                Ok(s) => {
                    s.bytes()[..v.len()].copy_from_slice(v);
                    staged.push(Ok(s));
                }
                Err(e) => staged.push(Err(e)),
            }
        }
        let ok: Vec<(usize, (&str, u64, u64))> = items
            .iter()
            .zip(&staged)
            .enumerate()
            .filter_map(|(i, ((k, v), s))| s.as_ref().ok().map(|s| (i, (*k, s.addr, v.len() as u64))))
            .collect();
        let rs = self.batch_put_from_impl(&ok.iter().map(|(_, x)| *x).collect::<Vec<_>>(), cfg, upsert);
        let mut out: Vec<StoreResult<()>> = staged.into_iter().map(|s| s.map(|_| ())).collect();
        for ((i, _), r) in ok.iter().zip(rs) {
            out[*i] = r;
        }
        out
    }

    /// Returns the value of `key` (`ObjectNotFound` if absent).
    pub fn get(&self, key: &str) -> StoreResult<Vec<u8>> {
        self.get_batch(&[key]).pop().unwrap_or_else(|| Err(StoreError::Internal("no result".into())))
    }

    /// Returns several values; per-key results.
    pub fn get_batch(&self, keys: &[&str]) -> Vec<StoreResult<Vec<u8>>> {
        self.get_buffers(keys).into_iter().map(|r| r.map(|s| s.to_vec())).collect()
    }

    /// Reads several values into the local buffer and hands each out where it landed (no
    /// copy; Mooncake's `batch_get_buffer`); per-key results. A value holds its space in the
    /// local buffer until dropped: a key whose value does not fit in what is free fails
    /// (`InvalidParams`, naming `local_buffer_size`).
    pub fn get_buffers(&self, keys: &[&str]) -> Vec<StoreResult<Staged>> {
        // One round trip: the replica lists give the sizes (space is staged for each) and
        // are what is read.
        let (answers, t0) = match self.replica_lists(keys.iter().copied()) {
            Ok(x) => x,
            Err(e) => return keys.iter().map(|_| Err(e.clone())).collect(),
        };
        let mut staged: Vec<StoreResult<Staged>> = Vec::with_capacity(keys.len());
        // Per key staged: its index, where it lands, and its answer.
        let mut idx: Vec<usize> = Vec::with_capacity(keys.len());
        let mut parts: Vec<[(u64, u64); 1]> = Vec::with_capacity(keys.len());
        let mut listed: Vec<Response> = Vec::with_capacity(keys.len());
        for (i, a) in answers.into_iter().enumerate() {
            staged.push(match a {
                Response::ReplicaList(l) => match self.stage(l.size as usize) {
                    Ok(s) => {
                        idx.push(i);
                        parts.push([(s.addr, s.len as u64)]);
                        listed.push(Response::ReplicaList(l));
                        Ok(s)
                    }
                    Err(e) => {
                        self.inner.queue_releases([l.read_id]); // nothing will be read
                        Err(e)
                    }
                },
                Response::Err(e) => Err(e),
                other => Err(StoreError::Rpc(format!("unexpected answer {other:?}"))),
            });
        }
        let items: Vec<(&str, &[(u64, u64)])> = idx.iter().zip(&parts).map(|(&i, p)| (keys[i], &p[..])).collect();
        let rs = self.read_listed(&items, listed, t0);
        let mut results: Vec<Option<StoreResult<u64>>> = (0..keys.len()).map(|_| None).collect();
        for (i, r) in idx.into_iter().zip(rs) {
            results[i] = Some(r);
        }
        staged
            .into_iter()
            .zip(results)
            .map(|(s, r)| match (s, r) {
                (Ok(mut s), Some(Ok(n))) => {
                    s.len = s.len.min(n as usize);
                    Ok(s)
                }
                (Ok(_), Some(Err(e))) | (Err(e), _) => Err(e),
                (Ok(_), None) => Err(StoreError::Internal("no result for a staged key".into())),
            })
            .collect()
    }

    pub fn is_exist(&self, key: &str) -> StoreResult<bool> {
        match self.inner.call_one(Request::ExistKey { key: key.to_string() })? {
            Response::Exists(b) => Ok(b),
            other => Err(StoreError::Rpc(format!("unexpected answer {other:?}"))),
        }
    }

    pub fn batch_is_exist(&self, keys: &[&str]) -> Vec<StoreResult<bool>> {
        match self.call_batch(keys.iter().map(|k| Request::ExistKey { key: k.to_string() }).collect()) {
            Ok(v) => v
                .into_iter()
                .map(|a| match a {
                    Response::Exists(b) => Ok(b),
                    Response::Err(e) => Err(e),
                    other => Err(StoreError::Rpc(format!("unexpected answer {other:?}"))),
                })
                .collect(),
            Err(e) => keys.iter().map(|_| Err(e.clone())).collect(),
        }
    }

    /// Size of `key`'s value.
    pub fn get_size(&self, key: &str) -> StoreResult<u64> {
        match self.inner.call_one(Request::GetReplicaList { key: key.to_string() })? {
            Response::ReplicaList(l) => {
                self.inner.queue_releases([l.read_id]);
                Ok(l.size)
            }
            other => Err(StoreError::Rpc(format!("unexpected answer {other:?}"))),
        }
    }

    pub fn remove(&self, key: &str, force: bool) -> StoreResult<()> {
        self.inner.call_one(Request::Remove { key: key.to_string(), force }).map(|_| ())
    }

    pub fn remove_by_regex(&self, pattern: &str, force: bool) -> StoreResult<u64> {
        match self.inner.call_one(Request::RemoveByRegex { pattern: pattern.to_string(), force })? {
            Response::Count(n) => Ok(n),
            other => Err(StoreError::Rpc(format!("unexpected answer {other:?}"))),
        }
    }

    /// Removes several keys in one round trip; per-key results (Mooncake's `batch_remove`).
    pub fn batch_remove(&self, keys: &[&str], force: bool) -> Vec<StoreResult<()>> {
        match self.call_batch(keys.iter().map(|k| Request::Remove { key: k.to_string(), force }).collect()) {
            Ok(v) => v.into_iter().map(|a| a.into_result().map(|_| ())).collect(),
            Err(e) => keys.iter().map(|_| Err(e.clone())).collect(),
        }
    }

    /// Where the replicas of each key live (Mooncake's `batch_get_replica_desc`); nothing is
    /// read, so the read granted with the answer is released at once.
    pub fn batch_get_replica_desc(&self, keys: &[&str]) -> Vec<StoreResult<Vec<ReplicaDesc>>> {
        match self.replica_lists(keys.iter().copied()) {
            Ok((v, _)) => v
                .into_iter()
                .map(|a| match a {
                    Response::ReplicaList(l) => {
                        self.inner.queue_releases([l.read_id]);
                        Ok(l.replicas)
                    }
                    Response::Err(e) => Err(e),
                    other => Err(StoreError::Rpc(format!("unexpected answer {other:?}"))),
                })
                .collect(),
            Err(e) => keys.iter().map(|_| Err(e.clone())).collect(),
        }
    }

    /// Mooncake's `batch_replica_clear`: drops the replicas of `keys` that this client wrote
    /// and nobody holds a lease on, on the segment named `segment` (everywhere if empty);
    /// returns the keys cleared (the others are skipped, as Mooncake does).
    pub fn batch_replica_clear(&self, keys: &[&str], segment: &str) -> StoreResult<Vec<String>> {
        let req = Request::BatchReplicaClear { client: self.inner.id, keys: keys.iter().map(|k| k.to_string()).collect(), segment: segment.to_string() };
        match self.inner.call_one(req)? {
            Response::Keys(k) => Ok(k),
            other => Err(StoreError::Rpc(format!("unexpected answer {other:?}"))),
        }
    }

    pub fn remove_all(&self, force: bool) -> StoreResult<u64> {
        match self.inner.call_one(Request::RemoveAll { force })? {
            Response::Count(n) => Ok(n),
            other => Err(StoreError::Rpc(format!("unexpected answer {other:?}"))),
        }
    }

    /// Unmounts this client's segment and stops pinging. Objects whose only replicas lived
    /// there disappear.
    pub fn close(&self) -> StoreResult<()> {
        if self.inner.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let ids = self.inner.releases.lock().unwrap_or_else(|e| e.into_inner()).take();
        // Closing does not wait for a failover (a master that lost the client drops its
        // segment when its TTL ends).
        let wait = Duration::from_secs(2);
        if !ids.is_empty() {
            // Best effort: unreleased reads end with their lease anyway.
            let _ = self.inner.rpc.call_within(&Request::ReleaseReads { ids }, wait, Conn::Pool);
        }
        let unmounted = self.inner.unmount_segment(wait);
        if self.inner.shared.is_some() {
            // The engine outlives this client: withdraw the client's buffers from it (a
            // barrier) before they are freed. Already gone if the engine was closed first.
            let addrs: Vec<u64> = self.inner.segment.iter().map(|(b, _)| b.addr()).chain(self.inner.staging.iter().map(|(b, _)| b.addr())).collect();
            for a in addrs {
                if let Err(e) = self.inner.engine.unregister_memory(a) {
                    tracing::debug!("unregistering the store's buffer at {a:#x} from the shared engine: {e}");
                }
            }
        }
        unmounted
    }
}

fn check_protocol(cfg: &ClientConfig) -> StoreResult<()> {
    if cfg.protocol != "tcp" && cfg.protocol != "rdma" {
        return Err(StoreError::InvalidParams(format!("protocol {:?} is not supported; use \"tcp\"", cfg.protocol)));
    }
    Ok(())
}

/// The error of every call on a shared engine that its owner closed.
fn engine_closed() -> StoreError {
    StoreError::InvalidParams("the transfer engine this store shares was closed (engine closed before the store); close the store and set it up again on a running engine".into())
}

impl Drop for Inner {
    /// On a shared engine (which outlives this client) the client's buffers are withdrawn from
    /// it before they are freed, whichever way the client ends (a failed setup included).
    fn drop(&mut self) {
        if self.shared.is_none() || std::process::id() != self.pid {
            return;
        }
        let addrs: Vec<u64> = self.segment.iter().map(|(b, _)| b.addr()).chain(self.staging.iter().map(|(b, _)| b.addr())).collect();
        for a in addrs {
            // Already withdrawn by close(), or by the engine's owner closing it: ignored.
            let _ = self.engine.unregister_memory(a);
        }
    }
}

impl Client {
    /// In a `fork()` child holding a copy of the parent's client: its engine lets go of the
    /// parent's sockets ([`TransferEngine::release_inherited`]); nothing in the creating
    /// process. Dropping the copy does this too.
    pub fn release_inherited(&self) {
        if std::process::id() != self.inner.pid {
            self.inner.engine.release_inherited();
        }
    }
}

impl Drop for Client {
    /// Unmounts the segment (the engine, dropped after, is the barrier for its memory). In a
    /// process other than the one that set the client up (a `fork()` child dropping its copy)
    /// nothing is unmounted or stopped: the segment and the master's view of it are the
    /// parent's; the engine lets go of the parent's sockets
    /// ([`TransferEngine::release_inherited`]) and the buffers of their descriptors.
    fn drop(&mut self) {
        if std::process::id() != self.inner.pid {
            self.release_inherited();
            return;
        }
        if let Err(e) = self.close() {
            tracing::debug!("closing the store client: {e}");
        }
    }
}

/// The READs that fill `parts` in order with the first `size` bytes of the replica at
/// `remote` in segment `seg` (parts past the value's end get nothing).
fn read_parts(parts: &[(u64, u64)], seg: u64, remote: u64, size: u64) -> Vec<TransferRequest> {
    let mut off = 0;
    let mut out = Vec::with_capacity(parts.len());
    for &(addr, len) in parts {
        let take = len.min(size - off);
        if take == 0 {
            continue;
        }
        out.push(TransferRequest { opcode: Opcode::Read, source: addr, target_id: seg, target_offset: remote + off, length: take });
        off += take;
    }
    out
}

/// Sends the releases of finished reads that no request carried within a few milliseconds
/// (a client that went idle), so a put waiting for space elsewhere is not held up until the
/// next ping. At most one small RPC per tick.
fn release_loop(inner: Weak<Inner>) {
    loop {
        std::thread::sleep(RELEASE_AFTER);
        let Some(inner) = inner.upgrade() else { return };
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        // Releases a request will carry in a moment are left to it (a busy client sends none
        // of its own).
        let ids = inner.releases.lock().unwrap_or_else(|e| e.into_inner()).overdue(Instant::now());
        if ids.is_empty() {
            continue;
        }
        // Not delivered: the reads end with their lease anyway.
        if let Err(e) = inner.rpc.call_within(&Request::ReleaseReads { ids }, FAILOVER_WAIT, Conn::Aside) {
            tracing::debug!("releasing finished reads: {e}");
        }
    }
}

fn ping_loop(inner: Weak<Inner>, every: Duration) {
    loop {
        std::thread::sleep(every);
        let Some(inner) = inner.upgrade() else { return };
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        if inner.shared.as_ref().is_some_and(|f| f.load(Ordering::Acquire)) {
            // The engine serving the segment was closed by its owner: nothing can read or
            // write the segment any more, so the master stops listing it (and placing
            // values there) now rather than when the store is closed.
            match inner.unmount_segment(Duration::from_secs(2)) {
                Ok(()) => tracing::info!("the shared transfer engine was closed: segment {} unmounted", inner.engine.segment_name()),
                Err(e) => tracing::warn!("the shared transfer engine was closed; unmounting its segment failed: {e}"),
            }
            return;
        }
        // Also delivers the releases of reads that finished since the last request.
        match inner.call_batch_on(vec![Request::Ping { client: inner.id }], Conn::Aside).and_then(|mut v| v.pop().ok_or_else(|| StoreError::Rpc("no answer".into()))) {
            Ok(Response::Ping(PingStatus::Ok)) => {}
            Ok(Response::Ping(PingStatus::NeedRemount)) if !inner.unmounted.load(Ordering::Acquire) => {
                tracing::warn!("the master does not know this client (it restarted?); remounting");
                let segments = inner.segment.iter().map(|(_, s)| s.clone()).collect();
                if let Err(e) = inner.rpc.call_ok(&Request::RemountSegments { client: inner.id, segments }) {
                    tracing::warn!("remount failed: {e}");
                }
                inner.rpc.report_writes(inner.id, Conn::Aside);
            }
            Ok(other) => tracing::warn!("unexpected ping answer {other:?}"),
            Err(e) => tracing::debug!("ping: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch's writes are reported while they run; once every one landed they are
    /// forgotten; a batch that did not land (failed, timed out) is reported until its time
    /// is over, with the time it has left.
    #[test]
    fn writes_are_reported_until_they_landed_or_can_no_longer_land() {
        let mut w = Writes::default();
        let t0 = Instant::now();
        let a = w.start(vec![("h:1".into(), 4096, 100)], t0 + Duration::from_secs(60));
        let b = w.start(vec![("h:2".into(), 0, 10), ("h:3".into(), 64, 1)], t0 + Duration::from_secs(60));
        let mut now = w.report(t0);
        now.sort_by(|x, y| x.te_endpoint.cmp(&y.te_endpoint));
        assert_eq!(now.iter().map(|x| (x.te_endpoint.as_str(), x.addr, x.size)).collect::<Vec<_>>(), vec![("h:1", 4096, 100), ("h:2", 0, 10), ("h:3", 64, 1)]);
        assert!(now.iter().all(|x| x.left_ms > 59_000 && x.left_ms <= 60_000), "{now:?}");
        w.ended(a, true);
        w.ended(b, false);
        let later = w.report(t0 + Duration::from_secs(30));
        assert_eq!(later.len(), 2, "the batch that did not land is still reported: {later:?}");
        assert!(later.iter().all(|x| x.left_ms > 29_000 && x.left_ms <= 30_000), "{later:?}");
        assert!(w.report(t0 + Duration::from_secs(61)).is_empty(), "its time over, nothing is reported");
        // Batches past their time are dropped as new ones start, once there are many.
        let over: Vec<u64> = (0..63).map(|_| w.start(vec![("h:4".into(), 0, 1)], Instant::now())).collect();
        w.start(Vec::new(), Instant::now() + Duration::from_secs(1));
        assert!(over.iter().all(|id| !w.running.contains_key(id)) && w.running.contains_key(&b), "{} kept", w.running.len());
    }

    #[test]
    fn finished_reads_wait_a_tick_for_a_request_to_carry_their_release() {
        let t0 = Instant::now();
        let mut r = Releases::default();
        assert!(r.overdue(t0 + RELEASE_AFTER).is_empty(), "nothing queued");
        r.queue([1, 2], t0);
        r.queue([3], t0 + RELEASE_AFTER / 2);
        assert!(r.overdue(t0 + RELEASE_AFTER / 2).is_empty(), "a busy client's next request carries them");
        assert_eq!(r.overdue(t0 + RELEASE_AFTER), vec![1, 2, 3], "the oldest waited a tick: all go");
        assert!(r.overdue(t0 + RELEASE_AFTER * 10).is_empty());
        r.queue([4], t0 + RELEASE_AFTER * 10);
        assert_eq!(r.take(), vec![4], "a request carries them at once");
        assert!(r.overdue(t0 + RELEASE_AFTER * 100).is_empty(), "and the clock restarts with the next one");
        r.queue([5], t0 + RELEASE_AFTER * 100);
        assert!(r.overdue(t0 + RELEASE_AFTER * 100 + RELEASE_AFTER / 2).is_empty());
    }

    #[test]
    fn only_requests_that_may_be_repeated_are_sent_again_after_a_lost_connection() {
        assert!(idempotent(&Request::Batch(vec![Request::ReleaseReads { ids: vec![1] }, Request::GetReplicaList { key: "k".into() }, Request::Ping { client: 1 }])));
        assert!(!idempotent(&Request::Batch(vec![Request::ExistKey { key: "k".into() }, Request::PutEnd { client: 1, key: "k".into(), put: 1 }])));
        for r in [Request::PutStart { client: 1, key: "k".into(), size: 1, config: ReplicateConfig::default(), upsert: false, put: 1 }, Request::Remove { key: "k".into(), force: false }, Request::UnmountSegment { client: 1, segment: 2 }] {
            assert!(!idempotent(&r), "{r:?}");
        }
    }

    #[test]
    fn master_addresses_are_host_port_or_etcd() {
        let cfg = Config::default();
        assert!(matches!(Rpc::new("127.0.0.1:50051", Duration::from_secs(1), &cfg).map(|r| r.target), Ok(Target::Fixed)));
        let r = Rpc::new("etcd://127.0.0.1:2379;127.0.0.1:2380", Duration::from_secs(1), &cfg).expect("etcd form");
        match &r.target {
            Target::Etcd { key, etcd } => assert_eq!((key.as_str(), etcd.location()), ("mooncake-store/mooncake_cluster/master_view", "etcd://127.0.0.1:2379,127.0.0.1:2380")),
            Target::Fixed => panic!("etcd:// is followed"),
        }
        let c = Config { store_cluster_id: Some("c7".into()), ..Config::default() };
        assert!(matches!(Rpc::new("etcd://h:1", Duration::from_secs(1), &c).map(|r| r.target), Ok(Target::Etcd { key, .. }) if key == "mooncake-store/c7/master_view"));
        for bad in ["etcd://", "redis://h:6379", "k8s://ns/lease"] {
            assert!(matches!(Rpc::new(bad, Duration::from_secs(1), &cfg), Err(StoreError::InvalidParams(_))), "{bad}");
        }
    }
}

