//! Removing the transfer-engine entries of clients the master dropped (Mooncake's
//! `--enable_metadata_cleanup_on_timeout`).
//!
//! A store client registers its engine in the metadata service (`mooncake/ram/<segment>`,
//! the segment descriptor, and `mooncake/rpc_meta/<segment>`, its handshake address) and
//! withdraws both when it closes. A client that dies leaves them behind: in an HTTP or Redis
//! service they stay forever (etcd's end with the engine's lease). When the master drops a
//! client that stopped pinging ([`crate::master::State::expire_clients`]), and this is
//! switched on, it removes the two entries of each segment it dropped, as Mooncake's master
//! does, from the service the cluster uses (the master's own embedded HTTP server, or an
//! http, etcd or redis service: Mooncake cleans HTTP services only).
//!
//! It never removes a live engine's entries, where Mooncake removes whatever the name holds:
//! - a name mounted again when its old client expires (a client restarted with the same
//!   `local_hostname`) is left alone, decided under the state lock ([`crate::node::Master::tick`]);
//! - the engine that `rpc_meta` names is probed first (a handshake `Probe`, as an engine
//!   does before it takes a name over), and entries whose engine answers are kept: a client
//!   that lost only the master (a partition, a master paused past the client TTL, after
//!   which every client looks silent), or a restarted engine that has not mounted yet;
//! - an HA master removes nothing unless it leads with a lease it can prove (a deposed
//!   leader that wakes from a pause expires every client).
//!
//! - what is removed is what was looked at before the probe, and only if unchanged
//!   ([`MetadataStore::remove_if`]): an engine that restarts under the name between the
//!   look and the removal writes both entries again, and those stay (etcd compares the
//!   writes' revisions, `kvferry metadata-server` its `ETag`, Redis the values, which
//!   differ because each kvferry `rpc_meta` write carries a random number). Against
//!   Mooncake's own HTTP servers the compare is a look before the removal: a window of one
//!   round trip is left there.
//!
//! What this is not: on the master's request path. The tick only queues names; one worker
//! thread talks to the service, so a slow or unreachable service delays nothing but the
//! cleanup. Failures are logged and counted, and retried ([`RETRIES`] times, [`RETRY_AFTER`]
//! apart); a cleanup queued by a leader that then died is not redone by the next one (that
//! one never saw the client expire).

use kvferry::metadata::{decode_rpc_meta, Keys, MetadataStore, RpcMeta};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Attempts after the first for a segment whose entries could not be removed.
pub const RETRIES: u32 = 3;
/// Time between attempts.
pub const RETRY_AFTER: Duration = Duration::from_secs(5);

/// Whether the engine an `rpc_meta` entry names answers.
pub type Probe = Box<dyn Fn(&RpcMeta) -> bool + Send>;
/// Opens the metadata service (on first use, and again after it failed).
pub type Connect = Box<dyn Fn() -> Result<Arc<dyn MetadataStore>, String> + Send>;

/// What became of the segments handed to the cleanup (`/metrics`:
/// `kvferry_master_metadata_cleanup_total{outcome}`).
#[derive(Default, Debug)]
pub struct CleanupStats {
    /// Segments whose entries are gone from the service (or were not there).
    pub removed: AtomicU64,
    /// Segments whose entries were kept: the name was mounted again or its engine answered.
    pub kept: AtomicU64,
    /// Segments whose entries could not be removed after every attempt.
    pub failed: AtomicU64,
}

/// The master's cleanup: off until [`Cleanup::start`].
#[derive(Default)]
pub struct Cleanup {
    queue: OnceLock<Sender<Vec<String>>>,
    pub stats: Arc<CleanupStats>,
}

impl Cleanup {
    /// Starts the worker that removes the entries of the segments queued from now on.
    pub fn start(&self, keys: Keys, connect: Connect, probe: Probe) -> Result<(), String> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.queue
            .set(tx)
            .map_err(|_| "the metadata cleanup is already started".to_string())?;
        let stats = Arc::clone(&self.stats);
        std::thread::Builder::new()
            .name("kvf-master-mdclean".into())
            .spawn(move || {
                Worker {
                    keys,
                    connect,
                    probe,
                    store: None,
                    stats,
                    retry_after: RETRY_AFTER,
                }
                .run(rx)
            })
            .map_err(|e| format!("cannot start the metadata cleanup thread: {e}"))?;
        Ok(())
    }

    pub fn enabled(&self) -> bool {
        self.queue.get().is_some()
    }

    /// Hands `names` (segments the master dropped, none mounted any more) to the worker;
    /// `kept` more were left alone because their names are mounted again.
    pub(crate) fn push(&self, names: Vec<String>, kept: usize) {
        let Some(q) = self.queue.get() else { return };
        self.stats.kept.fetch_add(kept as u64, Ordering::Relaxed);
        if !names.is_empty() {
            let _ = q.send(names);
        }
    }
}

/// The probe an engine uses before it takes a name over ([`kvferry::handshake::answers`]).
pub fn handshake_probe(connect: Duration, max_len: u64) -> Probe {
    Box::new(move |m: &RpcMeta| {
        kvferry::handshake::answers(&m.ip_or_host_name, m.rpc_port, connect, max_len)
    })
}

/// What one segment's cleanup did.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    Removed,
    /// Its engine answers at this address.
    Alive(String),
    /// An entry was written again after the look (an engine restarted under the name): what
    /// was written since stays.
    Rewritten,
    Failed(String),
}

/// Removes segment `name`'s `ram` and `rpc_meta` entries from `store`, unless the engine its
/// `rpc_meta` names answers `probe` (an entry that does not decode names no engine), and
/// each only if it still holds what was looked at before the probe.
pub fn clean(
    store: &dyn MetadataStore,
    keys: &Keys,
    probe: &dyn Fn(&RpcMeta) -> bool,
    name: &str,
) -> Outcome {
    let (ram_key, rpc_key) = (keys.ram(name), keys.rpc_meta(name));
    let look = |key: &String| {
        store
            .get_seen(key)
            .map_err(|e| Outcome::Failed(format!("reading {key}: {e}")))
    };
    // rpc_meta first, as an engine registers: a restart after this look rewrites it.
    let (rpc, ram) = match look(&rpc_key).and_then(|rpc| Ok((rpc, look(&ram_key)?))) {
        Ok(seen) => seen,
        Err(out) => return out,
    };
    if let Some(m) = rpc.as_ref().and_then(|s| decode_rpc_meta(&s.value).ok()) {
        if probe(&m) {
            return Outcome::Alive(format!("{}:{}", m.ip_or_host_name, m.rpc_port));
        }
    }
    // The descriptor first, as an engine withdraws: rpc_meta is what a restarted engine
    // checks before it takes the name over.
    let (mut errs, mut kept) = (Vec::new(), false);
    for (key, seen) in [(ram_key, ram), (rpc_key, rpc)] {
        let Some(seen) = seen else { continue };
        match store.remove_if(&key, &seen) {
            Ok(removed) => kept |= !removed,
            Err(e) => errs.push(format!("removing {key}: {e}")),
        }
    }
    if !errs.is_empty() {
        Outcome::Failed(errs.join("; "))
    } else if kept {
        Outcome::Rewritten
    } else {
        Outcome::Removed
    }
}

struct Worker {
    keys: Keys,
    connect: Connect,
    probe: Probe,
    store: Option<Arc<dyn MetadataStore>>,
    stats: Arc<CleanupStats>,
    retry_after: Duration,
}

impl Worker {
    fn run(mut self, rx: Receiver<Vec<String>>) {
        // (name, attempts left, when)
        let mut retry: Vec<(String, u32, Instant)> = Vec::new();
        loop {
            let wait = retry
                .iter()
                .map(|r| r.2)
                .min()
                .map(|t| t.saturating_duration_since(Instant::now()));
            let got = match wait {
                Some(w) => rx.recv_timeout(w),
                None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            };
            let mut todo: Vec<(String, u32)> = match got {
                Ok(names) => names.into_iter().map(|n| (n, RETRIES)).collect(),
                Err(RecvTimeoutError::Timeout) => Vec::new(),
                Err(RecvTimeoutError::Disconnected) => return,
            };
            let now = Instant::now();
            retry.retain(|(n, left, at)| {
                let due = *at <= now;
                if due {
                    todo.push((n.clone(), *left));
                }
                !due
            });
            for (name, left) in todo {
                match self.clean(&name) {
                    Outcome::Removed => {
                        self.stats.removed.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(segment = %name, "removed the metadata entries of a segment whose client stopped pinging");
                    }
                    Outcome::Alive(at) => {
                        self.stats.kept.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(segment = %name, engine = %at, "kept the metadata entries of a dropped segment: its engine answers (it lost only this master, or restarted under the same name)");
                    }
                    Outcome::Rewritten => {
                        self.stats.kept.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(segment = %name, "kept the metadata entries of a dropped segment: they were written again while it looked (an engine restarted under the same name)");
                    }
                    Outcome::Failed(why) if left > 0 => {
                        tracing::warn!(segment = %name, "metadata cleanup failed ({why}); retrying in {:?}", self.retry_after);
                        retry.push((name, left - 1, Instant::now() + self.retry_after));
                    }
                    Outcome::Failed(why) => {
                        self.stats.failed.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(segment = %name, "metadata cleanup gave up after {} attempts ({why}); remove {} and {} by hand once the service answers", RETRIES + 1, self.keys.ram(&name), self.keys.rpc_meta(&name));
                    }
                }
            }
        }
    }

    fn clean(&mut self, name: &str) -> Outcome {
        let store = match &self.store {
            Some(s) => Arc::clone(s),
            None => match (self.connect)() {
                Ok(s) => {
                    self.store = Some(Arc::clone(&s));
                    s
                }
                Err(e) => {
                    return Outcome::Failed(format!("cannot reach the metadata service: {e}"))
                }
            },
        };
        let out = clean(&*store, &self.keys, &self.probe, name);
        if matches!(out, Outcome::Failed(_)) {
            // Reconnect next time (an etcd endpoint list re-probed, a Redis connection remade).
            self.store = None;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry::metadata::Backend;
    use std::collections::HashMap;
    use std::sync::Mutex;

    /// A metadata service in memory; `fail` makes every call fail.
    #[derive(Default)]
    struct Mem {
        map: Mutex<HashMap<String, Vec<u8>>>,
        fail: std::sync::atomic::AtomicBool,
        failed: AtomicU64,
    }

    impl Mem {
        fn check(&self) -> kvferry::Result<()> {
            if self.fail.load(Ordering::Relaxed) {
                self.failed.fetch_add(1, Ordering::Relaxed);
            }
            if self.fail.load(Ordering::Relaxed) {
                return Err(kvferry::Error::Metadata {
                    backend: "http",
                    location: "mem".into(),
                    reason: "unreachable".into(),
                });
            }
            Ok(())
        }
        fn has(&self, k: &str) -> bool {
            self.map.lock().unwrap().contains_key(k)
        }
    }

    impl MetadataStore for Mem {
        fn backend(&self) -> Backend {
            Backend::Http
        }
        fn location(&self) -> &str {
            "mem"
        }
        fn get(&self, key: &str) -> kvferry::Result<Option<Vec<u8>>> {
            self.check()?;
            Ok(self.map.lock().unwrap().get(key).cloned())
        }
        fn put(&self, key: &str, value: &[u8]) -> kvferry::Result<()> {
            self.check()?;
            self.map.lock().unwrap().insert(key.into(), value.to_vec());
            Ok(())
        }
        fn remove(&self, key: &str) -> kvferry::Result<()> {
            self.check()?;
            self.map.lock().unwrap().remove(key);
            Ok(())
        }
    }

    fn register(m: &Mem, keys: &Keys, name: &str, port: u16) {
        m.put(
            &keys.rpc_meta(name),
            format!(r#"{{"ip_or_host_name":"127.0.0.1","rpc_port":{port}}}"#).as_bytes(),
        )
        .unwrap();
        m.put(&keys.ram(name), b"{}").unwrap();
    }

    #[test]
    fn entries_go_unless_their_engine_answers_and_other_names_stay() {
        let m = Mem::default();
        let keys = Keys::new(Some("c1"));
        for (name, port) in [("dead:1", 1), ("live:2", 2), ("other:3", 3)] {
            register(&m, &keys, name, port);
        }
        m.put(&keys.rpc_meta("garbled:4"), b"not json").unwrap();
        m.put(&keys.ram("garbled:4"), b"{}").unwrap();
        m.put(&keys.ram("norpc:5"), b"{}").unwrap();
        let probed = Mutex::new(Vec::new());
        let probe = |r: &RpcMeta| {
            probed.lock().unwrap().push(r.rpc_port);
            r.rpc_port == 2
        };
        assert_eq!(clean(&m, &keys, &probe, "dead:1"), Outcome::Removed);
        assert!(
            !m.has("mooncake/c1/ram/dead:1") && !m.has("mooncake/c1/rpc_meta/dead:1"),
            "both entries, under the cluster's prefix"
        );
        assert_eq!(
            clean(&m, &keys, &probe, "live:2"),
            Outcome::Alive("127.0.0.1:2".into())
        );
        assert!(
            m.has("mooncake/c1/ram/live:2") && m.has("mooncake/c1/rpc_meta/live:2"),
            "a live engine keeps both"
        );
        assert_eq!(
            clean(&m, &keys, &probe, "garbled:4"),
            Outcome::Removed,
            "an rpc_meta that names no engine goes"
        );
        assert_eq!(
            clean(&m, &keys, &probe, "norpc:5"),
            Outcome::Removed,
            "a descriptor without rpc_meta goes"
        );
        assert!(!m.has("mooncake/c1/ram/norpc:5"));
        assert_eq!(
            clean(&m, &keys, &probe, "never:6"),
            Outcome::Removed,
            "nothing there: nothing to do, not an error"
        );
        assert!(
            m.has("mooncake/c1/ram/other:3") && m.has("mooncake/c1/rpc_meta/other:3"),
            "other names untouched"
        );
        assert_eq!(
            *probed.lock().unwrap(),
            vec![1, 2],
            "only decodable rpc_meta entries are probed"
        );
        m.fail.store(true, Ordering::Relaxed);
        assert!(
            matches!(clean(&m, &keys, &probe, "other:3"), Outcome::Failed(e) if e.contains("unreachable"))
        );
    }

    /// An engine that restarts under the name while its old entries are probed (here: the
    /// probe itself writes them again, as the restarted engine would between the look and
    /// the removal) keeps what it wrote; an entry changed behind one that did not is the
    /// only one kept.
    #[test]
    fn entries_written_again_after_the_look_stay() {
        let m = Mem::default();
        let keys = Keys::new(None);
        register(&m, &keys, "phoenix:1", 1);
        let again = |_: &RpcMeta| {
            m.put(
                &keys.rpc_meta("phoenix:1"),
                br#"{"ip_or_host_name":"127.0.0.1","rpc_port":7}"#,
            )
            .unwrap();
            m.put(&keys.ram("phoenix:1"), b"{\"reborn\":1}").unwrap();
            false
        };
        assert_eq!(clean(&m, &keys, &again, "phoenix:1"), Outcome::Rewritten);
        assert_eq!(
            m.get(&keys.rpc_meta("phoenix:1")).unwrap().as_deref(),
            Some(&br#"{"ip_or_host_name":"127.0.0.1","rpc_port":7}"#[..])
        );
        assert_eq!(
            m.get(&keys.ram("phoenix:1")).unwrap().as_deref(),
            Some(&b"{\"reborn\":1}"[..])
        );
        // Only the descriptor written again: the old rpc_meta goes, the new descriptor stays.
        register(&m, &keys, "half:2", 2);
        let ram_only = |_: &RpcMeta| {
            m.put(&keys.ram("half:2"), b"{\"new\":2}").unwrap();
            false
        };
        assert_eq!(clean(&m, &keys, &ram_only, "half:2"), Outcome::Rewritten);
        assert!(!m.has("mooncake/rpc_meta/half:2"));
        assert_eq!(
            m.get(&keys.ram("half:2")).unwrap().as_deref(),
            Some(&b"{\"new\":2}"[..])
        );
    }

    fn wait_for(what: &str, f: impl Fn() -> bool) {
        let until = Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(Instant::now() < until, "{what}: not within 10 s");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The worker counts each outcome; a service that fails keeps its names for a retry.
    #[test]
    fn the_worker_removes_keeps_and_counts() {
        let m = Arc::new(Mem::default());
        let keys = Keys::new(None);
        register(&m, &keys, "a:1", 1);
        register(&m, &keys, "b:2", 2);
        let c = Cleanup::default();
        c.push(vec!["a:1".into()], 5);
        assert_eq!(
            c.stats.kept.load(Ordering::Relaxed),
            0,
            "nothing counted before it starts"
        );
        let mm = Arc::clone(&m);
        c.start(
            keys.clone(),
            Box::new(move || Ok(Arc::clone(&mm) as Arc<dyn MetadataStore>)),
            Box::new(|r: &RpcMeta| r.rpc_port == 2),
        )
        .unwrap();
        assert!(
            c.start(
                keys,
                Box::new(|| Err("no".into())),
                Box::new(|_: &RpcMeta| false)
            )
            .is_err(),
            "started once"
        );
        c.push(vec!["a:1".into(), "b:2".into()], 1);
        wait_for("one removed, two kept", || {
            c.stats.removed.load(Ordering::Relaxed) == 1
                && c.stats.kept.load(Ordering::Relaxed) == 2
        });
        assert!(!m.has("mooncake/ram/a:1") && m.has("mooncake/ram/b:2"));
        assert_eq!(c.stats.failed.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_failed_removal_is_retried() {
        let m = Arc::new(Mem::default());
        let keys = Keys::new(None);
        register(&m, &keys, "a:1", 1);
        m.fail.store(true, Ordering::Relaxed);
        let (tx, rx) = std::sync::mpsc::channel();
        let stats = Arc::new(CleanupStats::default());
        let mm = Arc::clone(&m);
        let w = Worker {
            keys,
            connect: Box::new(move || Ok(Arc::clone(&mm) as Arc<dyn MetadataStore>)),
            probe: Box::new(|_: &RpcMeta| false),
            store: None,
            stats: Arc::clone(&stats),
            retry_after: Duration::from_millis(300),
        };
        let t = std::thread::spawn(move || w.run(rx));
        tx.send(vec!["a:1".into()]).unwrap();
        wait_for("a first attempt", || m.failed.load(Ordering::Relaxed) > 0);
        assert!(
            m.has("mooncake/ram/a:1"),
            "the service failed: nothing removed yet"
        );
        m.fail.store(false, Ordering::Relaxed);
        wait_for("the retry", || stats.removed.load(Ordering::Relaxed) == 1);
        assert_eq!(stats.failed.load(Ordering::Relaxed), 0, "not given up");
        assert!(!m.has("mooncake/ram/a:1") && !m.has("mooncake/rpc_meta/a:1"));
        drop(tx);
        t.join().unwrap();
    }

    #[test]
    fn a_service_that_stays_down_is_given_up_on_and_counted() {
        let m = Arc::new(Mem::default());
        m.fail.store(true, Ordering::Relaxed);
        let (tx, rx) = std::sync::mpsc::channel();
        let stats = Arc::new(CleanupStats::default());
        let mm = Arc::clone(&m);
        let w = Worker {
            keys: Keys::new(None),
            connect: Box::new(move || Ok(Arc::clone(&mm) as Arc<dyn MetadataStore>)),
            probe: Box::new(|_: &RpcMeta| false),
            store: None,
            stats: Arc::clone(&stats),
            retry_after: Duration::from_millis(10),
        };
        let t = std::thread::spawn(move || w.run(rx));
        tx.send(vec!["a:1".into()]).unwrap();
        wait_for("giving up", || stats.failed.load(Ordering::Relaxed) == 1);
        assert_eq!(
            m.failed.load(Ordering::Relaxed),
            u64::from(RETRIES) + 1,
            "one read per attempt, the first and {RETRIES} more"
        );
        drop(tx);
        t.join().unwrap();
    }

    fn seg(id: u64, name: &str) -> crate::proto::Segment {
        crate::proto::Segment {
            id,
            name: name.into(),
            te_endpoint: name.into(),
            base: id << 32,
            size: 1 << 20,
        }
    }

    /// The master's tick hands over the dropped segments' names, except one mounted again by
    /// another client, and only while it may answer (an HA leader fenced removes nothing).
    #[test]
    fn the_tick_queues_dropped_names_not_remounted_ones_nor_a_fenced_leaders() {
        let run = |fenced: bool| {
            let m = Arc::new(Mem::default());
            let keys = Keys::new(None);
            for (name, port) in [("gone:1", 1), ("again:2", 2), ("alive:3", 3)] {
                register(&m, &keys, name, port);
            }
            let master = crate::node::Master::new(crate::master::MasterConfig {
                client_ttl: Duration::ZERO,
                ..Default::default()
            });
            if fenced {
                master.gate.lead_for_test(7, Duration::ZERO);
            }
            let mm = Arc::clone(&m);
            master
                .cleanup
                .start(
                    keys,
                    Box::new(move || Ok(Arc::clone(&mm) as Arc<dyn MetadataStore>)),
                    Box::new(|_: &RpcMeta| false),
                )
                .unwrap();
            {
                let mut st = master.lock();
                // Clients 1 and 2 last pinged at 0; client 3 pings "later" than any tick.
                st.mount(1, seg(1, "gone:1"), 0).unwrap();
                st.mount(2, seg(2, "again:2"), 0).unwrap();
                st.mount(3, seg(3, "again:2"), u64::MAX / 2).unwrap();
                st.mount(3, seg(4, "alive:3"), u64::MAX / 2).unwrap();
            }
            std::thread::sleep(Duration::from_millis(5));
            master.tick();
            (m, master)
        };
        let (m, master) = run(false);
        wait_for("the dropped segment's entries removed", || {
            master.cleanup.stats.removed.load(Ordering::Relaxed) == 1
        });
        assert!(!m.has("mooncake/ram/gone:1") && !m.has("mooncake/rpc_meta/gone:1"));
        assert_eq!(
            master.cleanup.stats.kept.load(Ordering::Relaxed),
            1,
            "again:2 is mounted by client 3 now"
        );
        assert!(m.has("mooncake/ram/again:2") && m.has("mooncake/rpc_meta/alive:3"));
        let (m, master) = run(true);
        assert!(
            !master.lock().mounted_names().contains("gone:1"),
            "the fenced master's state dropped the client all the same"
        );
        std::thread::sleep(Duration::from_millis(200));
        assert!(
            m.has("mooncake/ram/gone:1") && m.has("mooncake/rpc_meta/gone:1"),
            "a fenced leader removes nothing"
        );
        let s = &master.cleanup.stats;
        assert_eq!(
            (
                s.removed.load(Ordering::Relaxed),
                s.kept.load(Ordering::Relaxed)
            ),
            (0, 0)
        );
    }
}
