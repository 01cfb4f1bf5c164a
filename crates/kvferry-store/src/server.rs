//! The master on the network: one thread per RPC connection, one ticker thread.

use crate::error::StoreError;
use crate::master::{Master, OP_NAMES};
use crate::proto::{self, PingStatus, ReplicateConfig, Request, Response};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Applies one request to the master. A put that finds space held only by reads in flight
/// waits for them (one `put_wait_for_reads` per request, a batch included) on this
/// connection's thread, without holding the master's lock.
///
/// With HA, the request passes the master's [`crate::ha::Gate`] first (a standby or a fenced
/// leader applies nothing and answers `NotLeader`, naming the leader), and its answer passes
/// it again: an answer computed by a leader that lost its lease meanwhile is not sent (that
/// master's state is reset when it steps down). Between the two, a request that may change
/// durable state waits until the leader's journal holds the change (`crate::ha::journal`), so
/// whatever was answered survives a failover.
pub fn handle(m: &Master, req: Request) -> Response {
    let term = match m.gate.admit() {
        Ok(t) => t,
        Err(e) => return Response::Err(e),
    };
    let journaled = mutates(&req);
    let resp = handle_admitted(m, req, term);
    if journaled {
        if let Some(ticket) = m.journal.collect(m) {
            if let Err(e) = m.journal.wait(ticket, JOURNAL_WAIT) {
                return Response::Err(e);
            }
        }
    }
    match m.gate.confirm(term) {
        Ok(()) => resp,
        Err(e) => Response::Err(e),
    }
}

/// How long a request waits for its changes to reach the journal (the writer gives up, and
/// fences the leader, well before: when the lease can no longer be proven).
const JOURNAL_WAIT: Duration = Duration::from_secs(30);

/// Whether a request may change what the journal keeps (reads, pings and read releases only
/// touch leases and reads in flight, which are not replicated).
fn mutates(req: &Request) -> bool {
    match req {
        Request::GetReplicaList { .. } | Request::ExistKey { .. } | Request::Ping { .. } | Request::ReleaseReads { .. } => false,
        Request::Batch(reqs) => reqs.iter().any(mutates),
        _ => true,
    }
}

fn handle_admitted(m: &Master, req: Request, term: i64) -> Response {
    let deadline = Instant::now() + m.cfg.put_wait_for_reads;
    if let Request::Batch(reqs) = req {
        return Response::Batch(
            reqs.into_iter()
                .map(|r| if matches!(r, Request::Batch(_)) { Response::Err(StoreError::InvalidParams("nested batches are not allowed".into())) } else { handle_one(m, r, deadline, term) })
                .collect(),
        );
    }
    handle_one(m, req, deadline, term)
}

/// A request admitted under `term` is applied only to that term's state: one held up (the
/// thread descheduled) across a step-down and a new term is refused, not applied to state
/// that is not its own.
fn stale(st: &crate::master::State, term: i64) -> Result<(), StoreError> {
    if st.term == term {
        Ok(())
    } else {
        Err(StoreError::NotLeader { leader: String::new() })
    }
}

#[allow(clippy::too_many_arguments)]
fn put_start(m: &Master, client: u64, key: &str, size: u64, config: &ReplicateConfig, upsert: bool, deadline: Instant, term: i64) -> Result<Response, StoreError> {
    loop {
        let last = Instant::now() >= deadline;
        let now = m.now();
        let mut st = m.lock();
        stale(&st, term)?;
        let r = st.put_start_ex(&m.cfg, &m.stats, client, key, size, config, upsert, now, last);
        let retry = !last && matches!(r, Err(StoreError::NoAvailableHandle { .. })) && st.reads_in_flight(now);
        drop(st);
        if !retry {
            return r.map(Response::Replicas);
        }
        std::thread::sleep(Duration::from_micros(500));
    }
}

fn handle_one(m: &Master, req: Request, deadline: Instant, term: i64) -> Response {
    let op = match &req {
        Request::MountSegment { .. } => 0,
        Request::RemountSegments { .. } => 1,
        Request::UnmountSegment { .. } => 2,
        Request::Ping { .. } => 3,
        Request::PutStart { .. } => 4,
        Request::PutEnd { .. } => 5,
        Request::PutRevoke { .. } => 6,
        Request::GetReplicaList { .. } => 7,
        Request::ExistKey { .. } => 8,
        Request::Remove { .. } => 9,
        Request::RemoveAll { .. } => 10,
        Request::RemoveByRegex { .. } => 11,
        Request::ReleaseReads { .. } => 12,
        Request::BatchReplicaClear { .. } => 13,
        Request::Batch(_) => return Response::Err(StoreError::InvalidParams("nested batches are not allowed".into())),
    };
    debug_assert!(op < OP_NAMES.len());
    m.stats.ops[op].fetch_add(1, Ordering::Relaxed);
    let now = m.now();
    let lease = m.cfg.lease_ttl.as_millis() as u64;
    // What a RemoveAll/RemoveByRegex took out: its memory is freed after the state's lock is
    // released (this is declared before the lock is taken, so dropped after it is let go).
    let mut _removed = None;
    let r = if let Request::PutStart { client, key, size, config, upsert } = &req {
        put_start(m, *client, key, *size, config, *upsert, deadline, term)
    } else {
        let mut st = m.lock();
        if let Err(e) = stale(&st, term) {
            return Response::Err(e);
        }
        match req {
            Request::MountSegment { client, segment } => st.mount(client, segment, now).map(|_| Response::Ok),
            Request::RemountSegments { client, segments } => {
                st.register_client(client, now);
                let mut r = Ok(Response::Ok);
                for s in segments {
                    if let Err(e) = st.mount(client, s, now) {
                        r = Err(e);
                    }
                }
                r
            }
            Request::UnmountSegment { client, segment } => st.unmount(client, segment).map(|_| Response::Ok),
            Request::Ping { client } => Ok(Response::Ping(st.ping(client, now))),
            Request::PutStart { client, key, size, config, upsert } => st.put_start(&m.cfg, &m.stats, client, &key, size, &config, upsert, now).map(Response::Replicas),
            Request::ReleaseReads { ids } => {
                st.release_reads(&ids, now);
                Ok(Response::Ok)
            }
            Request::BatchReplicaClear { client, keys, segment } => Ok(Response::Keys(st.batch_replica_clear(client, &keys, &segment, now))),
            Request::PutEnd { client, key } => st.put_end(client, &key, now).map(|_| Response::Ok),
            Request::PutRevoke { client, key } => st.put_revoke(client, &key).map(|_| Response::Ok),
            Request::GetReplicaList { key } => st.get_replica_list(&key, now, lease).map(Response::ReplicaList),
            Request::ExistKey { key } => st.exist_key(&key, now, lease).map(Response::Exists),
            Request::Remove { key, force } => st.remove(&m.cfg, &key, force, now).map(|_| Response::Ok),
            Request::RemoveAll { force } => Ok(Response::Count(_removed.insert(st.remove_matching(&m.cfg, |_| true, force, now)).count())),
            Request::RemoveByRegex { pattern, force } => match regex::Regex::new(&pattern) {
                Ok(re) => Ok(Response::Count(_removed.insert(st.remove_matching(&m.cfg, |k| re.is_match(k), force, now)).count())),
                Err(e) => Err(StoreError::InvalidParams(format!("bad regex {pattern:?}: {e}"))),
            },
            Request::Batch(_) => Err(StoreError::InvalidParams("nested batches are not allowed".into())),
        }
    };
    match r {
        Ok(resp) => {
            if resp == Response::Ping(PingStatus::NeedRemount) {
                m.stats.errors[op].fetch_add(1, Ordering::Relaxed);
            }
            resp
        }
        Err(e) => {
            m.stats.errors[op].fetch_add(1, Ordering::Relaxed);
            Response::Err(e)
        }
    }
}

fn serve_conn(m: &Master, s: &TcpStream, spin: Duration) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    s.set_nodelay(true)?;
    let mut prefix = [0u8; 4];
    let mut body = Vec::new();
    loop {
        // A client that just got an answer often asks again at once: poll briefly (bounded)
        // before sleeping in the kernel.
        let mut got = 0usize;
        let start = std::time::Instant::now();
        while got < 4 && start.elapsed() < spin {
            // SAFETY: recv into the unfilled tail of `prefix` on a socket we own.
            let n = unsafe { libc::recv(s.as_raw_fd(), prefix[got..].as_mut_ptr() as *mut libc::c_void, 4 - got, libc::MSG_DONTWAIT) };
            if n > 0 {
                got += n as usize;
            } else if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            } else {
                std::hint::spin_loop();
            }
        }
        (&*s).read_exact(&mut prefix[got..])?;
        let n = match proto::decode_len(prefix) {
            Ok(n) => n,
            Err(e) => return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string())),
        };
        body.clear();
        s.take(n as u64).read_to_end(&mut body)?;
        if body.len() != n {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let resp = match proto::decode::<Request>(&body) {
            Ok(req) => handle(m, req),
            Err(e) => Response::Err(e),
        };
        let frame = proto::encode(&resp).unwrap_or_else(|e| proto::encode(&Response::Err(e)).unwrap_or_default());
        (&*s).write_all(&frame)?;
    }
}

/// A running master: RPC listener and ticker.
pub struct MasterServer {
    pub master: Arc<Master>,
    listener: Arc<TcpListener>,
    stop: Arc<AtomicBool>,
    port: u16,
}

impl MasterServer {
    /// Serves `listener`; ticks every `tick` (client expiry, deferred frees, eviction) and
    /// logs a summary line every `summary_every` ticks (0: never).
    pub fn start(master: Arc<Master>, listener: TcpListener, tick: Duration, summary_every: u32) -> std::io::Result<MasterServer> {
        Self::start_with_spin(master, listener, tick, summary_every, Duration::from_micros(50))
    }

    /// Like [`MasterServer::start`], with the bounded poll for a connection's next request
    /// (`Duration::ZERO`: always sleep in the kernel).
    pub fn start_with_spin(master: Arc<Master>, listener: TcpListener, tick: Duration, summary_every: u32, spin: Duration) -> std::io::Result<MasterServer> {
        let port = listener.local_addr()?.port();
        let listener = Arc::new(listener);
        let stop = Arc::new(AtomicBool::new(false));
        let (l, m, st) = (Arc::clone(&listener), Arc::clone(&master), Arc::clone(&stop));
        std::thread::Builder::new().name("kvf-master-accept".into()).spawn(move || {
            for conn in l.incoming() {
                if st.load(Ordering::Acquire) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let m = Arc::clone(&m);
                let _ = std::thread::Builder::new().name("kvf-master-rpc".into()).spawn(move || {
                    if let Err(e) = serve_conn(&m, &conn, spin) {
                        if e.kind() != std::io::ErrorKind::UnexpectedEof {
                            tracing::debug!("master RPC connection closed: {e}");
                        }
                    }
                    let _ = conn.shutdown(Shutdown::Both);
                });
            }
        })?;
        let (m, st) = (Arc::clone(&master), Arc::clone(&stop));
        std::thread::Builder::new().name("kvf-master-tick".into()).spawn(move || {
            let mut n = 0u32;
            while !st.load(Ordering::Acquire) {
                std::thread::sleep(tick);
                m.tick();
                // Expiries and evictions are journaled too (nobody waits for them).
                let _ = m.journal.collect(&m);
                n += 1;
                if summary_every > 0 && n % summary_every == 0 {
                    let s = m.lock().summary();
                    tracing::info!(
                        keys = s.keys, used = s.bytes_used, total = s.bytes_total, clients = s.clients, segments = s.segments,
                        evicted = m.stats.evicted_objects.load(Ordering::Relaxed), "master summary"
                    );
                }
            }
        })?;
        Ok(MasterServer { master, listener, stop, port })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        // SAFETY: shutting down our own listening socket wakes the blocked accept().
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
    }
}

impl Drop for MasterServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}
