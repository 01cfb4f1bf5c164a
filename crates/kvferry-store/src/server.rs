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
    match apply(m, req) {
        Applied::Now(resp) => resp,
        Applied::Later { ticket, term, resp } => match m.journal.wait(ticket, JOURNAL_WAIT) {
            Ok(()) => confirmed(m, term, resp),
            Err(e) => Response::Err(e),
        },
    }
}

/// A request applied: its answer, or the answer to send once its changes are durable (the
/// journal's `ticket`), if this master still leads `term` then.
enum Applied {
    Now(Response),
    Later { ticket: (i64, u64), term: i64, resp: Response },
}

fn apply(m: &Master, req: Request) -> Applied {
    let term = match m.gate.admit() {
        Ok(t) => t,
        Err(e) => return Applied::Now(Response::Err(e)),
    };
    let journaled = mutates(&req);
    let resp = handle_admitted(m, req, term);
    if journaled {
        if let Some(ticket) = m.journal.collect(m) {
            return Applied::Later { ticket, term, resp };
        }
    }
    Applied::Now(confirmed(m, term, resp))
}

/// `resp` if the master still leads `term` with its lease proven, else the refusal.
fn confirmed(m: &Master, term: i64, resp: Response) -> Response {
    match m.gate.confirm(term) {
        Ok(()) => resp,
        Err(e) => Response::Err(e),
    }
}

fn frame_of(resp: &Response) -> Vec<u8> {
    proto::encode(resp).unwrap_or_else(|e| proto::encode(&Response::Err(e)).unwrap_or_default())
}

/// The sending side of one RPC connection, shared by its thread and whoever sends an answer
/// that waited for the journal ([`Applied::Later`]): that answer goes out from the thread
/// that learnt the changes are durable (an acknowledgement reader, the journal's writer), so
/// the connection's thread goes back to reading at once instead of sleeping until then, and
/// the client gets its answer one thread wake-up sooner. At most one answer is outstanding
/// per connection: the connection's thread handles its next request only after the deferred
/// answer was sent in full, so answers keep their requests' order.
struct Outbox {
    sock: TcpStream,
    busy: std::sync::Mutex<bool>,
    idle: std::sync::Condvar,
}

/// How long a deferred answer that did not fit in the socket's buffer may take to be written
/// (a client that does not read its answers).
const SLOW_ANSWER: Duration = Duration::from_secs(30);

impl Outbox {
    fn busy(&self) -> std::sync::MutexGuard<'_, bool> {
        self.busy.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until the deferred answer, if any, was sent in full (bounded: every deferred
    /// answer is answered, at the latest by the journal's expiry).
    fn wait_idle(&self) {
        let mut b = self.busy();
        while *b {
            b = self.idle.wait(b).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn done(&self) {
        *self.busy() = false;
        self.idle.notify_all();
    }

    /// Sends a deferred answer without blocking the caller (an acknowledgement reader or the
    /// journal's writer, which answer many connections): what the socket does not take at
    /// once is written by a thread of its own, within [`SLOW_ANSWER`].
    fn send(self: Arc<Self>, frame: Vec<u8>) {
        use rustix::net::{send, SendFlags};
        let flags = SendFlags::DONTWAIT | SendFlags::NOSIGNAL;
        let mut at = 0;
        while at < frame.len() {
            match send(&self.sock, &frame[at..], flags) {
                Ok(n) => at += n,
                Err(rustix::io::Errno::INTR) => {}
                Err(rustix::io::Errno::AGAIN) => break,
                Err(_) => {
                    // The connection is gone; its thread ends on its next read.
                    at = frame.len();
                }
            }
        }
        if at == frame.len() {
            return self.done();
        }
        let me = Arc::clone(&self);
        let spawned = std::thread::Builder::new().name("kvf-master-answer".into()).spawn(move || {
            let until = Instant::now() + SLOW_ANSWER;
            let mut at = at;
            while at < frame.len() {
                let left = until.saturating_duration_since(Instant::now());
                let mut fds = [rustix::event::PollFd::new(&me.sock, rustix::event::PollFlags::OUT)];
                let timeout = rustix::event::Timespec { tv_sec: left.as_secs() as i64, tv_nsec: left.subsec_nanos() as _ };
                if left.is_zero() || !matches!(rustix::event::poll(&mut fds, Some(&timeout)), Ok(_) | Err(rustix::io::Errno::INTR)) {
                    break;
                }
                match send(&me.sock, &frame[at..], flags) {
                    Ok(n) => at += n,
                    Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => {}
                    Err(_) => break,
                }
            }
            if at < frame.len() {
                tracing::debug!("master RPC: a client did not read its answer within {SLOW_ANSWER:?}; its connection is closed");
                let _ = me.sock.shutdown(Shutdown::Both);
            }
            me.done();
        });
        if spawned.is_err() {
            let _ = self.sock.shutdown(Shutdown::Both);
            self.done();
        }
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

fn serve_conn(m: &Arc<Master>, s: &TcpStream, spin: Duration) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    s.set_nodelay(true)?;
    let out = Arc::new(Outbox { sock: s.try_clone()?, busy: std::sync::Mutex::new(false), idle: std::sync::Condvar::new() });
    let mut prefix = [0u8; 4];
    let mut body = Vec::new();
    let mut deferred = false;
    loop {
        // A client that just got an answer often asks again at once: poll briefly (bounded)
        // before sleeping in the kernel (not after an answer left for the journal: that
        // client is still waiting for it).
        let mut got = 0usize;
        let start = std::time::Instant::now();
        while got < 4 && !deferred && start.elapsed() < spin {
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
        // The previous request's answer, if it waited for the journal, is out first.
        out.wait_idle();
        let resp = match proto::decode::<Request>(&body) {
            Ok(req) => match apply(m, req) {
                Applied::Now(resp) => resp,
                Applied::Later { ticket, term, resp } => {
                    *out.busy() = true;
                    let (m2, out2) = (Arc::clone(m), Arc::clone(&out));
                    m.journal.defer(
                        ticket,
                        Box::new(move |durable| {
                            let resp = match durable {
                                Ok(()) => confirmed(&m2, term, resp),
                                Err(e) => Response::Err(e),
                            };
                            out2.send(frame_of(&resp));
                        }),
                    );
                    deferred = true;
                    continue;
                }
            },
            Err(e) => Response::Err(e),
        };
        deferred = false;
        (&*s).write_all(&frame_of(&resp))?;
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
                // Answers that waited for the journal too long get its error.
                m.journal.expire(JOURNAL_WAIT);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::master::MasterConfig;
    use crate::proto::Segment;

    fn read_answer(c: &mut TcpStream) -> std::io::Result<Response> {
        let mut len = [0u8; 4];
        c.read_exact(&mut len)?;
        let mut body = vec![0u8; proto::decode_len(len).map_err(|e| std::io::Error::other(e.to_string()))?];
        c.read_exact(&mut body)?;
        proto::decode(&body).map_err(|e| std::io::Error::other(e.to_string()))
    }

    /// An answer that waits for the journal leaves from whoever makes the change durable, not
    /// before; a client that sends its next request without reading (pipelining) gets the
    /// answers in its requests' order; the term's end answers what still waited.
    #[test]
    fn deferred_answers_wait_for_the_journal_and_keep_each_connections_order() {
        let m = Arc::new(Master::new(MasterConfig::default()));
        m.gate.lead_for_test(5, Duration::from_secs(60));
        {
            let mut st = m.lock();
            st.term = 5;
            st.journal_on();
        }
        m.journal.activate(5);
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = MasterServer::start(Arc::clone(&m), listener, Duration::from_millis(50), 0).expect("start");
        let mut c = TcpStream::connect(addr).expect("connect");
        c.set_read_timeout(Some(Duration::from_millis(300))).expect("timeout");
        let seg = |id| Segment { id, name: format!("s{id}"), te_endpoint: format!("127.0.0.1:{id}"), base: id << 32, size: 1 << 20 };
        let mut two = proto::encode(&Request::MountSegment { client: 1, segment: seg(1) }).expect("encode");
        two.extend(proto::encode(&Request::ExistKey { key: "k".into() }).expect("encode"));
        c.write_all(&two).expect("send");
        let deferred = |n: usize| {
            let until = Instant::now() + Duration::from_secs(10);
            while m.journal.deferred_for_test() != n {
                assert!(Instant::now() < until, "the answer was not deferred within 10 s");
                std::thread::sleep(Duration::from_millis(5));
            }
        };
        deferred(1);
        let e = read_answer(&mut c).expect_err("nothing is answered before the mount is durable");
        assert!(matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut), "{e}");
        assert_eq!(m.journal.deferred_for_test(), 1, "the read waits behind the mount");
        m.journal.write_queued_for_test();
        c.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        assert_eq!(read_answer(&mut c).expect("the mount's answer"), Response::Ok);
        assert_eq!(read_answer(&mut c).expect("then the read's"), Response::Exists(false));
        // A mutation still waiting when the term ends is refused, not left hanging.
        c.write_all(&proto::encode(&Request::MountSegment { client: 1, segment: seg(2) }).expect("encode")).expect("send");
        deferred(1);
        m.journal.deactivate();
        assert!(matches!(read_answer(&mut c).expect("an answer"), Response::Err(StoreError::NotLeader { .. })));
        drop(server);
    }
}
