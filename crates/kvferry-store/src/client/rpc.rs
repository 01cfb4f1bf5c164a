//! The client's link to the master: a small pool of connections (the cluster key's
//! handshake on each new one), calls with their failures told apart, and, behind an `etcd://`
//! address, finding the leader and registering again there. Nothing here moves object bytes:
//! the callers (`super`) do.

use crate::error::{StoreError, StoreResult};
use crate::net::poll_read;
use crate::proto::{self, PingStatus, Request, Response, Segment, WriteInFlight};
use kvferry::Config;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a client following the leader (`etcd://` master address) looks for one before a
/// call fails: long enough for Mooncake's 5 s lease to expire and a standby to take over.
pub(super) const FAILOVER_WAIT: Duration = Duration::from_secs(20);
/// The bound of one RPC to a master found through etcd: a paused leader is given up on after
/// this long (a request that may have been applied is then not sent again; see `idempotent`).
const HA_RPC_TIMEOUT: Duration = Duration::from_secs(5);

/// Where the master is: one address, or the leader of an HA cluster found in etcd.
pub(super) enum Target {
    Fixed,
    /// Mooncake's `etcd://h1:2379;h2:2379`: the leader's address is the value of
    /// `mooncake-store/<cluster_id>/master_view`.
    Etcd {
        etcd: kvferry::metadata::etcd::EtcdClient,
        key: String,
    },
}

/// What a client re-registers when it finds a new leader that does not know it.
#[derive(Default)]
pub(super) struct Registration {
    pub(super) client: u64,
    pub(super) segments: Vec<Segment>,
    /// Set once the first mount succeeded (before that, the mount itself is what is retried).
    pub(super) mounted: bool,
}

/// This client's writes into segments whose bytes may still be landing: each batch's from
/// its start until it completed, or, if it did not (failed, timed out), until twice the
/// transfer timeout after it started (a target ends a request its own timeout after its
/// header: `TransferEngine`'s "Nothing hangs"). Reported to a master that did not know this
/// client ([`Rpc::report_writes`]): a master without HA that restarted knows nothing of the
/// writes its predecessor placed, and would give their space to new puts.
#[derive(Default)]
pub(super) struct Writes {
    next: u64,
    /// Batch id -> its writes and until when they may land.
    pub(super) running: std::collections::HashMap<u64, (Vec<PutWrite>, Instant)>,
}

/// One write of a put: the replica's segment (its endpoint), address and length.
pub(super) type PutWrite = (String, u64, u64);

impl Writes {
    /// A batch of writes starts; its id, for [`Writes::ended`].
    pub(super) fn start(&mut self, writes: Vec<PutWrite>, until: Instant) -> u64 {
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
    pub(super) fn ended(&mut self, id: u64, all_landed: bool) {
        if all_landed {
            self.running.remove(&id);
        }
    }

    /// What may still be landing, with the time left.
    pub(super) fn report(&self, now: Instant) -> Vec<WriteInFlight> {
        self.running
            .values()
            .filter(|(_, until)| *until > now)
            .flat_map(|(w, until)| {
                let left_ms = until
                    .saturating_duration_since(now)
                    .as_millis()
                    .min(u128::from(u64::MAX)) as u64;
                w.iter().map(move |(te, addr, size)| WriteInFlight {
                    te_endpoint: te.clone(),
                    addr: *addr,
                    size: *size,
                    left_ms: left_ms.max(1),
                })
            })
            .collect()
    }
}

/// A small pool of connections to the master; one request in flight per connection.
pub(super) struct Rpc {
    pub(super) target: Target,
    /// The master's (the leader's) address ("" when it must be looked up), and the last
    /// leader found: its address and term (0 when not known).
    addr: Mutex<(String, (String, i64))>,
    /// Counts leader changes seen by this client: a put whose `PutStart` and `PutEnd` were
    /// answered under different leaders was not stored.
    epoch: std::sync::atomic::AtomicU64,
    pub(super) registration: Mutex<Registration>,
    /// This client's writes into segments that may still be running ([`Request::HoldWrites`]).
    pub(super) writes: Mutex<Writes>,
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
pub(super) enum Conn {
    Pool,
    Aside,
}

/// Whether sending `req` twice is harmless (it may have been applied by a master that then
/// stopped answering).
pub(super) fn idempotent(req: &Request) -> bool {
    match req {
        Request::Ping { .. }
        | Request::GetReplicaList { .. }
        | Request::ExistKey { .. }
        | Request::ProbeKey { .. }
        | Request::QueryTask { .. }
        | Request::ReleaseReads { .. }
        | Request::HoldWrites { .. } => true,
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
    match rustix::net::recv(
        s,
        &mut b,
        rustix::net::RecvFlags::DONTWAIT | rustix::net::RecvFlags::PEEK,
    ) {
        Ok(_) => true,
        Err(e) => e != rustix::io::Errno::AGAIN,
    }
}

/// The most bytes of a plain answer to the key's handshake read (an `AuthChallenge`, or a
/// refusal saying why).
const MAX_AUTH_ANSWER: usize = 64 << 10;

/// One request and its answer on `s`, plain frames, outside the pool (the key's handshake).
fn exchange(s: &mut TcpStream, req: &Request) -> Result<Response, String> {
    s.write_all(&proto::encode(req).map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
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
fn authenticate(
    s: &mut TcpStream,
    key: &kvferry::auth::ClusterKey,
    identity: &str,
    addr: &str,
) -> StoreResult<(kvferry::auth::Sealer, kvferry::auth::Opener)> {
    let rpc = |e: String| StoreError::Rpc(format!("master at {addr}: authenticating: {e}"));
    let (init, hello) =
        kvferry::auth::Initiator::new(key, proto::STORE_RPC, identity).map_err(|r| {
            StoreError::InvalidParams(format!("the store's cluster id ({identity:?}): {r}"))
        })?;
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

/// How one exchange on a connection failed ([`Rpc::exchange_on`]).
enum Broke {
    /// The request was not wholly written: the master cannot have read it (it reads whole
    /// frames only, and the connection is not used again). `true`: because the connection
    /// had ended (closed, reset), not a timeout.
    Unsent(StoreError, bool),
    /// Written, then the connection ended (closed or reset) before any byte of the answer.
    NoAnswer(StoreError),
    /// Any other failure after the request was written (a timeout, the answer cut short).
    Lost(StoreError),
    /// The answer came but does not decode.
    Garbled(StoreError),
}

/// Whether an I/O error says the connection ended (closed or reset by the peer).
fn ended(e: &std::io::Error) -> bool {
    use std::io::ErrorKind as K;
    matches!(
        e.kind(),
        K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe | K::NotConnected | K::WriteZero
    )
}

/// Reads the first `buf.len()` bytes of an answer (its length prefix or sealed head), after
/// polling for them for `spin`. An error says whether the connection ended (EOF, reset)
/// before any of them came.
fn read_head(
    s: &mut TcpStream,
    buf: &mut [u8],
    spin: Duration,
) -> Result<(), (bool, std::io::Error)> {
    use std::io::ErrorKind as K;
    let mut got = poll_read(s, buf, spin);
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => {
                return Err((
                    got == 0,
                    std::io::Error::new(
                        K::UnexpectedEof,
                        "the connection was closed before the whole answer came",
                    ),
                ))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == K::Interrupted => {}
            Err(e) => return Err((got == 0 && ended(&e), e)),
        }
    }
    Ok(())
}

/// A call's failure: whether the request can have reached the master.
enum Failure {
    /// Nothing was sent (no connection), or not the whole request: safe to send elsewhere.
    NotSent(StoreError),
    /// The connection failed after (part of) the request was sent.
    Lost(StoreError),
    /// The answer came but does not decode (not a master of this version).
    Garbled(StoreError),
}

impl Rpc {
    pub(super) fn new(addr: &str, timeout: Duration, ecfg: &Config) -> StoreResult<Rpc> {
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
        let auth = kvferry::auth::ClusterKey::from_config(ecfg.auth_key_file.as_deref())
            .map_err(|e| StoreError::InvalidParams(e.to_string()))?;
        let identity = proto::master_identity(&crate::ha::resolve_cluster_id(
            None,
            ecfg.store_cluster_id.as_deref(),
        ));
        Ok(Rpc {
            target,
            addr: Mutex::new((first, (String::new(), 0))),
            epoch: Default::default(),
            registration: Mutex::default(),
            writes: Mutex::default(),
            pool: Mutex::default(),
            aside: Mutex::default(),
            timeout,
            spin,
            auth,
            identity,
        })
    }

    fn addr(&self) -> String {
        self.addr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .clone()
    }

    pub(super) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    fn connect(&self, addr: &str) -> StoreResult<Chan> {
        let fail = |e: String| {
            StoreError::Rpc(format!(
                "cannot reach the master at {addr}: {e} (is `kvferry master` running there?)"
            ))
        };
        let addrs: Vec<_> = addr
            .to_socket_addrs()
            .map_err(|e| fail(e.to_string()))?
            .collect();
        let mut last = "no address".to_string();
        for a in addrs {
            match TcpStream::connect_timeout(&a, Duration::from_secs(5)) {
                Ok(mut s) => {
                    let _ = s.set_nodelay(true);
                    s.set_read_timeout(Some(self.timeout))
                        .map_err(|e| fail(e.to_string()))?;
                    s.set_write_timeout(Some(self.timeout))
                        .map_err(|e| fail(e.to_string()))?;
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
    ///
    /// A connection taken from the pool may have died while idle (the master restarted, or
    /// stepped down): one found closed before anything is sent on it is dropped, with every
    /// other idle one, and the request goes on a new connection (behind an `etcd://` address
    /// the caller looks for the leader first). One that breaks under the request gets it
    /// once more, on a new connection, only where that cannot apply it twice: the request was
    /// not wholly written (a master reads whole frames only), or the connection ended before
    /// any byte of the answer and the request is [`idempotent`].
    fn call_once(&self, req: &Request, conn: Conn) -> Result<(Response, u64), Failure> {
        let frame = proto::encode(req).map_err(Failure::NotSent)?;
        let (addr, epoch) = {
            // (Read together: `find_leader` changes both under this lock.)
            let cur = self.addr.lock().unwrap_or_else(|e| e.into_inner());
            (cur.0.clone(), self.epoch())
        };
        if addr.is_empty() {
            return Err(Failure::NotSent(StoreError::Rpc(
                "no master leads the cluster (the etcd key is absent)".into(),
            )));
        }
        let mut pooled = match conn {
            Conn::Pool => self.pool.lock().unwrap_or_else(|e| e.into_inner()).pop(),
            Conn::Aside => self.aside.lock().unwrap_or_else(|e| e.into_inner()).take(),
        };
        if pooled.as_ref().is_some_and(|c| closed_by_peer(&c.s)) {
            // The master went away (killed, restarted, stepped down): nothing sent, and the
            // other idle connections are to the same process.
            self.drop_connections();
            pooled = None;
            if matches!(self.target, Target::Etcd { .. }) {
                // Any request may go to the next leader.
                return Err(Failure::NotSent(StoreError::Rpc(format!(
                    "the connection to the master at {addr} was closed by it"
                ))));
            }
            tracing::debug!(
                "the idle connection to the master at {addr} was closed by it (restarted?); connecting again"
            );
        }
        let reused = pooled.is_some();
        let mut c = match pooled {
            Some(c) => c,
            None => self.connect(&addr).map_err(Failure::NotSent)?,
        };
        let mut answer = self.exchange_on(&mut c, &frame, &addr);
        let again = match &answer {
            Err(Broke::Unsent(e, true)) => Some(e),
            Err(Broke::NoAnswer(e)) if idempotent(req) => Some(e),
            _ => None,
        };
        if let Some(e) = again.filter(|_| reused) {
            tracing::debug!(
                "{e} (an idle connection that had died); sending the request again on a new one"
            );
            self.drop_connections();
            c = self.connect(&addr).map_err(Failure::NotSent)?;
            answer = self.exchange_on(&mut c, &frame, &addr);
        }
        let resp = answer.map_err(|b| match b {
            Broke::Unsent(e, _) => Failure::NotSent(e),
            Broke::NoAnswer(e) | Broke::Lost(e) => Failure::Lost(e),
            Broke::Garbled(e) => Failure::Garbled(e),
        })?;
        if matches!(resp, Response::Err(StoreError::Unauthorized(_))) {
            // (The master closes a connection it refuses.)
            return Ok((resp, epoch));
        }
        match conn {
            Conn::Pool => self.pool.lock().unwrap_or_else(|e| e.into_inner()).push(c),
            Conn::Aside => *self.aside.lock().unwrap_or_else(|e| e.into_inner()) = Some(c),
        }
        Ok((resp, epoch))
    }

    /// Sends the encoded request `frame` on `c` (sealed under its session, if any) and reads
    /// the answer.
    fn exchange_on(&self, c: &mut Chan, frame: &[u8], addr: &str) -> Result<Response, Broke> {
        let fail = |e: std::io::Error| StoreError::Rpc(format!("master at {addr}: {e}"));
        let lost = |e: std::io::Error| Broke::Lost(fail(e));
        let head = |(none, e): (bool, std::io::Error)| {
            if none {
                Broke::NoAnswer(fail(e))
            } else {
                Broke::Lost(fail(e))
            }
        };
        let sealed_frame;
        let out = match &mut c.sealed {
            Some((sealer, _)) => {
                let mut out = Vec::new();
                sealer.seal_frame(crate::frame::body(frame), &mut out);
                sealed_frame = out;
                &sealed_frame[..]
            }
            None => frame,
        };
        c.s.write_all(out).map_err(|e| {
            let dead = ended(&e);
            Broke::Unsent(fail(e), dead)
        })?;
        let s = &mut c.s;
        let body = match &mut c.sealed {
            None => {
                let mut prefix = [0u8; 4];
                read_head(s, &mut prefix, self.spin).map_err(head)?;
                let n = proto::decode_len(prefix).map_err(Broke::Garbled)?;
                let mut body = vec![0u8; n];
                s.read_exact(&mut body).map_err(lost)?;
                body
            }
            Some((_, opener)) => {
                use kvferry::auth::{frame_body_len, FRAME_HEAD_LEN};
                let garbled = |r: kvferry::auth::Refusal| {
                    Broke::Garbled(StoreError::Unauthorized(format!("the answer of the master at {addr}: {r}; something on the path between this client and the master altered the connection, which is closed")))
                };
                let mut head_bytes = [0u8; FRAME_HEAD_LEN];
                read_head(s, &mut head_bytes, self.spin).map_err(head)?;
                let n = opener
                    .open_frame_head(&head_bytes, proto::MAX_FRAME)
                    .map_err(garbled)?;
                let mut sealed = vec![0u8; frame_body_len(n)];
                s.read_exact(&mut sealed).map_err(lost)?;
                let mut body = Vec::new();
                opener
                    .open_frame_body(&sealed, &mut body)
                    .map_err(garbled)?;
                body
            }
        };
        proto::decode(&body).map_err(Broke::Garbled)
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
    pub(super) fn call_within(
        &self,
        req: &Request,
        wait: Duration,
        conn: Conn,
    ) -> StoreResult<Response> {
        self.call_within_at(req, wait, conn).map(|(r, _)| r)
    }

    /// [`Rpc::call_within`], with the epoch of the leader that answered.
    pub(super) fn call_within_at(
        &self,
        req: &Request,
        wait: Duration,
        conn: Conn,
    ) -> StoreResult<(Response, u64)> {
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
                Ok((Response::Err(StoreError::NotLeader { leader }), _)) => {
                    StoreError::NotLeader { leader }
                }
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
                return Err(StoreError::Rpc(format!(
                    "no leader answered within {wait:?}: {err}"
                )));
            }
            tracing::debug!("master: {err}; looking for the leader");
            self.forget_leader();
            self.find_leader(deadline)?;
        }
    }

    pub(super) fn call_ok(&self, req: &Request) -> StoreResult<Response> {
        self.call(req)?.into_result()
    }

    /// Drops the connections to the current master so that the next call reads the key.
    fn forget_leader(&self) {
        self.drop_connections();
        self.addr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .clear();
    }

    /// Reads the leader key until it names a master that answers (or `deadline`); on a new
    /// leader, re-registers this client there if it does not know it.
    fn find_leader(&self, deadline: Instant) -> StoreResult<()> {
        let Target::Etcd { etcd, key } = &self.target else {
            return Ok(());
        };
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
                                (known != found)
                                    .then(|| self.epoch.fetch_add(1, Ordering::AcqRel) + 1)
                            };
                            self.pool.lock().unwrap_or_else(|e| e.into_inner()).push(s);
                            if let Some(e) = changed {
                                tracing::info!(
                                    term = kv.create_revision,
                                    epoch = e,
                                    "the store master leader is {addr}"
                                );
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
                return Err(StoreError::Rpc(format!(
                    "no store master leader found through {} in time: {last}",
                    etcd.location()
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Tells a master that did not know this client which of its writes may still be landing
    /// ([`Writes`]), so that it places nothing new there meanwhile. Best effort (a master of
    /// an older version refuses the request: logged).
    pub(super) fn report_writes(&self, client: u64, conn: Conn) {
        let writes = self
            .writes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .report(Instant::now());
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
        match self
            .call_once(&Request::Ping { client }, Conn::Pool)
            .map(|(r, _)| r)
        {
            Ok(Response::Ping(PingStatus::NeedRemount)) => {
                match self
                    .call_once(&Request::RemountSegments { client, segments }, Conn::Pool)
                    .map(|(r, _)| r)
                {
                    Ok(Response::Ok) => {
                        tracing::info!("remounted at the new leader {}", self.addr())
                    }
                    Ok(other) => tracing::warn!("remount at the new leader: {other:?}"),
                    Err(Failure::NotSent(e) | Failure::Lost(e) | Failure::Garbled(e)) => {
                        tracing::warn!("remount at the new leader: {e}")
                    }
                }
                self.report_writes(client, Conn::Pool);
            }
            Ok(_) => {}
            Err(Failure::NotSent(e) | Failure::Lost(e) | Failure::Garbled(e)) => {
                tracing::debug!("ping of the new leader: {e}")
            }
        }
    }
}
