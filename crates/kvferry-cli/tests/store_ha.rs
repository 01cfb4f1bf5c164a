//! Store master high availability against a real etcd (Debian's `etcd`, started by the test on
//! free 127.0.0.1 ports with a temporary data directory, killed by pid): two `kvferry master
//! --enable_ha` processes, one leader; a client with an `etcd://` master address follows it
//! through a SIGKILL; a leader paused (SIGSTOP) past its lease refuses requests as soon as it
//! runs again and stands by. Lease TTL 2 s. The leader has every durable change acknowledged
//! by its in-sync standbys (the default) or journaled in etcd (while none is in sync, or with
//! `--ha-replication etcd`), and a new leader starts from its mirror or the journal: objects
//! put before a failover stay readable with their bytes
//! (`repeated_leader_kills_under_load_never_two_leaders_never_wrong_bytes`).
//! `kvferry store-bench --ha`, the figures, runs here too, briefly.

mod common;
#[path = "../../kvferry/tests/metadata_services/mod.rs"]
mod metadata_services;

use kvferry::metadata::etcd::EtcdClient;
use kvferry_store::proto::{self, PingStatus, Request, Response};
use kvferry_store::{Client, ClientConfig, ReplicateConfig, StoreError};
use metadata_services::Service;
use rustix::process::{kill_process, Pid, Signal};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TTL: Duration = Duration::from_secs(2);

struct Master {
    child: Child,
    rpc: String,
    http: String,
    /// Its stderr (the log), printed when the test fails, removed after.
    log: PathBuf,
    /// The cluster key it holds (`KVFERRY_AUTH_KEY_FILE` in its environment): its
    /// `/ha_status` answers only requests signed with it.
    key: Option<kvferry::auth::ClusterKey>,
}

/// The `store-bench --ha` tests keep every CPU of a small host busy for a minute or more; the
/// fault tests' time bounds (a standby leads within 2 × TTL, a paused leader is fenced within
/// its bound) are about the masters, not about sharing two vCPUs with a benchmark (in one CI
/// run such an overlap left the standby of `a_rebase_under_load_...` finding the dead leader's
/// key for 9 s after its SIGKILL). So the benches run alone, the other tests beside each other.
static CPUS: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn alone() -> std::sync::RwLockWriteGuard<'static, ()> {
    CPUS.write().unwrap_or_else(|e| e.into_inner())
}

fn beside() -> std::sync::RwLockReadGuard<'static, ()> {
    CPUS.read().unwrap_or_else(|e| e.into_inner())
}

/// A fresh file for a master's log.
fn log_file() -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    std::env::temp_dir().join(format!(
        "kvferry-store-ha-{}-{}.log",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// The last `n` lines of a master's log.
fn log_tail(log: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

impl Master {
    /// `mooncake`: Mooncake's gflags spellings, else kvferry's.
    fn start(etcd_port: u16, cluster: Option<&str>, mooncake: bool) -> Master {
        Master::start_with(etcd_port, cluster, mooncake, &[])
    }

    fn start_with(etcd_port: u16, cluster: Option<&str>, mooncake: bool, extra: &[&str]) -> Master {
        // A dead second endpoint, tried after the live one.
        Master::start_in(
            None,
            &format!("etcd://127.0.0.1:{etcd_port};127.0.0.1:1"),
            cluster,
            mooncake,
            extra,
            &[],
        )
    }

    /// A master of the default cluster with `env` set.
    fn start_env(etcd_port: u16, env: &[(&str, &str)]) -> Master {
        Master::start_in(
            None,
            &format!("etcd://127.0.0.1:{etcd_port}"),
            None,
            false,
            &[],
            env,
        )
    }

    /// A master in network namespace `netns` (`ip netns exec`, which execs the binary: the pid
    /// is the master's), using the etcd connection string `conn`.
    fn start_in(
        netns: Option<&str>,
        conn: &str,
        cluster: Option<&str>,
        mooncake: bool,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Master {
        let conn = conn.to_string();
        // (`--port P` in `extra` replaces the default 0: a master restarted at its address.)
        let port = extra
            .iter()
            .position(|a| *a == "--port")
            .and_then(|i| extra.get(i + 1))
            .copied()
            .unwrap_or("0");
        let extra: Vec<&str> = extra
            .iter()
            .enumerate()
            .filter(|(i, a)| **a != "--port" && (*i == 0 || extra[i - 1] != "--port"))
            .map(|(_, a)| *a)
            .collect();
        let mut args: Vec<String> = [
            "master",
            "--port",
            port,
            "--metrics-port",
            "0",
            "--summary-interval",
            "0",
            "--ha-lease-ttl",
            "2s",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if mooncake {
            args.extend([
                "--enable_ha".to_string(),
                "--ha_backend_connstring".into(),
                conn,
            ]);
            if let Some(c) = cluster {
                args.push(format!("--cluster_id={c}"));
            }
        } else {
            args.extend([
                "--enable-ha".to_string(),
                "--ha-backend-connstring".into(),
                conn,
            ]);
            if let Some(c) = cluster {
                args.extend(["--cluster-id".to_string(), c.to_string()]);
            }
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, env!("CARGO_BIN_EXE_kvferry")]);
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_kvferry")),
        };
        let log = log_file();
        let err = std::fs::File::create(&log).unwrap_or_else(|e| panic!("{}: {e}", log.display()));
        let mut child = cmd
            .args(&args)
            .env_remove("MC_STORE_CLUSTER_ID")
            .env("KVFERRY_LOG", "info")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err)
            .spawn()
            .expect("spawn kvferry master");
        let mut line = String::new();
        let read = BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line);
        if read.is_err() || !line.starts_with("KVFERRY_MASTER") {
            let _ = child.kill();
            let _ = child.wait();
            let said = log_tail(&log, 60);
            let _ = std::fs::remove_file(&log);
            panic!("the master did not start ({read:?}, its first line {line:?}); its log's end:\n{said}");
        }
        let field = |k: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(k))
                .unwrap_or_default()
                .to_string()
        };
        let key = kvferry_store::ha::master_view_key(
            cluster.unwrap_or(kvferry_store::ha::DEFAULT_CLUSTER_ID),
        );
        assert_eq!(field("ha="), key, "{line}");
        let key = env
            .iter()
            .find(|(k, _)| *k == "KVFERRY_AUTH_KEY_FILE")
            .and_then(|(_, f)| kvferry::auth::ClusterKey::load(Path::new(f)).ok());
        Master {
            child,
            rpc: field("rpc="),
            http: field("http="),
            log,
            key,
        }
    }

    fn role(&self) -> String {
        http_get(&self.http, "/role").1
    }

    fn signal(&self, sig: Signal) {
        signal(self.child.id(), sig);
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Master {
    fn drop(&mut self) {
        self.kill(); // SIGKILL ends a stopped process too
        if std::thread::panicking() {
            // What the master said, for the failure's reader.
            eprintln!(
                "--- master {} (pid {}), its log's end:\n{}",
                self.rpc,
                self.child.id(),
                log_tail(&self.log, 60)
            );
        }
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Sends `sig` to process `pid`, one this test started (by its pid, never by a name).
fn signal(pid: u32, sig: Signal) {
    let p = i32::try_from(pid)
        .ok()
        .and_then(Pid::from_raw)
        .unwrap_or_else(|| panic!("{pid} is not a process id"));
    kill_process(p, sig).unwrap_or_else(|e| panic!("kill({pid}, {sig:?}): {e}"));
}

fn http_get(addr: &str, path: &str) -> (u16, String) {
    http_get_with(addr, path, None)
}

/// [`http_get`], signed with `key` when given (`X-Kvferry-Auth`).
fn http_get_with(addr: &str, path: &str, key: Option<&kvferry::auth::ClusterKey>) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect to the master's HTTP port");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let auth = key
        .map(|k| {
            format!(
                "{}: {}\r\n",
                kvferry::auth_http::HEADER,
                kvferry::auth_http::sign_now(k, "GET", path, b"")
            )
        })
        .unwrap_or_default();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n"
    )
    .expect("send");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("answer");
    let code = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (
        code,
        out.split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default(),
    )
}

/// One request over a raw RPC connection.
fn rpc(s: &mut TcpStream, req: &Request) -> Response {
    try_rpc(s, req).unwrap_or_else(|e| panic!("{req:?}: {e}"))
}

/// [`rpc`], its failure returned.
fn try_rpc(s: &mut TcpStream, req: &Request) -> Result<Response, String> {
    s.write_all(&proto::encode(req).map_err(|e| format!("encode: {e}"))?)
        .map_err(|e| format!("send: {e}"))?;
    let mut prefix = [0u8; 4];
    s.read_exact(&mut prefix)
        .map_err(|e| format!("answer: {e}"))?;
    let mut body = vec![0u8; proto::decode_len(prefix).map_err(|e| format!("len: {e}"))?];
    s.read_exact(&mut body).map_err(|e| format!("body: {e}"))?;
    proto::decode(&body).map_err(|e| format!("decode: {e}"))
}

fn raw(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect to the master's RPC port");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    s
}

fn mount_request() -> Request {
    let segment = proto::Segment {
        id: 7,
        name: "127.0.0.1:1".into(),
        te_endpoint: "127.0.0.1:1".into(),
        base: 1 << 30,
        size: 1 << 20,
    };
    Request::MountSegment {
        client: 99,
        segment,
    }
}

/// Waits until exactly one of `ms` says it leads; its index.
fn one_leader(ms: &[&Master], within: Duration) -> usize {
    let until = Instant::now() + within;
    loop {
        let roles: Vec<String> = ms.iter().map(|m| m.role()).collect();
        let leaders: Vec<usize> = (0..ms.len()).filter(|&i| roles[i] == "leader").collect();
        assert!(leaders.len() <= 1, "two leaders at once: {roles:?}");
        if leaders.len() == 1 && roles.iter().filter(|r| *r == "standby").count() == ms.len() - 1 {
            return leaders[0];
        }
        assert!(
            Instant::now() < until,
            "no single leader within {within:?}: {roles:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn etcd_view(etcd: &EtcdClient, cluster: &str) -> Option<(String, i64)> {
    etcd.get_kv(&kvferry_store::ha::master_view_key(cluster))
        .expect("etcd get")
        .map(|kv| {
            (
                String::from_utf8_lossy(&kv.value).into_owned(),
                kv.create_revision,
            )
        })
}

/// A store client that finds the leader through the test's etcd (`etcd://`), contributing
/// `segment` bytes.
fn ha_client(etcd_port: u16, segment: u64) -> Client {
    Client::setup(ClientConfig {
        global_segment_size: segment,
        local_buffer_size: 16 << 20,
        master_server_addr: format!("etcd://127.0.0.1:{etcd_port}"),
        transfer_timeout: Duration::from_secs(10),
        ..ClientConfig::default()
    })
    .expect("client setup")
}

/// Puts `n` objects `<prefix><i>` of 4 KiB (their bytes: [`value`]); their keys.
fn put_keys(c: &Client, prefix: &str, n: usize) -> Vec<String> {
    let keys: Vec<String> = (0..n).map(|i| format!("{prefix}{i}")).collect();
    for k in &keys {
        c.put(k, &value(k, 4096), &ReplicateConfig::default())
            .unwrap_or_else(|e| panic!("put {k}: {e}"));
    }
    keys
}

fn value(key: &str, len: usize) -> Vec<u8> {
    let seed = xxhash_rust::xxh3::xxh3_64(key.as_bytes());
    (0..len)
        .map(|i| (seed.rotate_left((i % 64) as u32) as u8) ^ (i as u8))
        .collect()
}

#[test]
fn one_leader_and_a_client_that_follows_it_through_a_sigkill() {
    let _cpus = beside();
    let Some(etcd_svc) = Service::etcd() else {
        return;
    };
    let etcd = EtcdClient::connect(
        &[format!("127.0.0.1:{}", etcd_svc.port)],
        Duration::from_secs(2),
    )
    .expect("etcd");
    // One in Mooncake's spellings with the default cluster id said out loud, one in kvferry's
    // with none: the same key.
    let m1 = Master::start(etcd_svc.port, Some("mooncake_cluster"), true);
    let m2 = Master::start(etcd_svc.port, None, false);
    let mut ms = [m1, m2];
    let l = one_leader(&[&ms[0], &ms[1]], Duration::from_secs(10));
    let s = 1 - l;
    let (leader_addr, term) = etcd_view(&etcd, "mooncake_cluster").expect("the key exists");
    assert_eq!(
        leader_addr, ms[l].rpc,
        "the key holds the leader's RPC address"
    );
    // Renewals keep it: the same leader and term after twice the TTL. (A lease kept is
    // something that does not happen, the key's expiry: no event says so. What keeps it is
    // seen instead: the leader's renewals, each one its `last_keepalive_age_ms` falling. This
    // waits for a renewal sent after the key outlived its TTL twice over, and checks at every
    // look that the roles and etcd's key never changed meanwhile.)
    let since = Instant::now();
    let (mut renewals, mut last_age) = (0u32, None);
    loop {
        let st = ha_status(&ms[l]);
        let age = st["last_keepalive_age_ms"].as_u64();
        assert_eq!(
            (st["role"].as_str(), ms[s].role().as_str()),
            (Some("leader"), "standby"),
            "the leader keeps its lease ({renewals} renewals seen, {:?} after it led): {st}",
            since.elapsed()
        );
        assert_eq!(
            etcd_view(&etcd, "mooncake_cluster"),
            Some((leader_addr.clone(), term)),
            "same key, same term"
        );
        if age.is_some() && last_age.is_some() && age < last_age {
            renewals += 1;
            if since.elapsed() > 2 * TTL + Duration::from_millis(500) {
                break;
            }
        }
        last_age = age;
        assert!(
            since.elapsed() < 2 * TTL + Duration::from_secs(3),
            "no renewal seen after the key outlived its TTL twice ({renewals} before): {st}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "the leader's key outlived its TTL twice over: {renewals} renewals seen in {:?}",
        since.elapsed()
    );
    assert_eq!(
        (ms[l].role(), ms[s].role()),
        ("leader".to_string(), "standby".to_string()),
        "the leader keeps its lease"
    );
    assert_eq!(
        etcd_view(&etcd, "mooncake_cluster"),
        Some((leader_addr.clone(), term)),
        "same key, same term"
    );

    // The standby applies nothing and names the leader.
    let mut standby = raw(&ms[s].rpc);
    assert_eq!(
        rpc(&mut standby, &mount_request()),
        Response::Err(StoreError::NotLeader {
            leader: ms[l].rpc.clone()
        })
    );
    assert_eq!(
        rpc(&mut standby, &Request::GetReplicaList { key: "k".into() }),
        Response::Err(StoreError::NotLeader {
            leader: ms[l].rpc.clone()
        })
    );
    // Observability.
    let st: serde_json::Value =
        serde_json::from_str(&http_get(&ms[l].http, "/ha_status").1).expect("/ha_status is JSON");
    assert_eq!(
        (
            st["role"].as_str(),
            st["term"].as_i64(),
            st["cluster_id"].as_str(),
            st["lease_ttl_ms"].as_u64()
        ),
        (
            Some("leader"),
            Some(term),
            Some("mooncake_cluster"),
            Some(2000)
        ),
        "{st}"
    );
    assert!(
        st["last_keepalive_age_ms"]
            .as_u64()
            .is_some_and(|a| a < 2000),
        "{st}"
    );
    let sb: serde_json::Value =
        serde_json::from_str(&http_get(&ms[s].http, "/ha_status").1).expect("JSON");
    assert_eq!(
        (
            sb["role"].as_str(),
            sb["leader"].as_str(),
            sb["term"].as_i64()
        ),
        (Some("standby"), Some(ms[l].rpc.as_str()), Some(term)),
        "{sb}"
    );
    let leader: serde_json::Value =
        serde_json::from_str(&http_get(&ms[s].http, "/leader").1).expect("JSON");
    assert_eq!(
        (
            leader["present"].as_bool(),
            leader["leader_address"].as_str()
        ),
        (Some(true), Some(ms[l].rpc.as_str())),
        "{leader}"
    );
    let metrics = http_get(&ms[l].http, "/metrics").1;
    assert!(
        metrics.contains("kvferry_master_ha_is_leader 1")
            && metrics.contains(&format!("kvferry_master_ha_term {term}")),
        "{metrics}"
    );
    assert!(http_get(&ms[s].http, "/metrics")
        .1
        .contains("kvferry_master_ha_is_leader 0"));
    assert!(http_get(&ms[s].http, "/health")
        .1
        .contains("\"role\":\"standby\""));

    // A client that finds the master through etcd (Mooncake's form of the address).
    let c = Client::setup(ClientConfig {
        global_segment_size: 16 << 20,
        local_buffer_size: 16 << 20,
        master_server_addr: format!("etcd://127.0.0.1:{};127.0.0.1:1", etcd_svc.port),
        transfer_timeout: Duration::from_secs(10),
        ..ClientConfig::default()
    })
    .expect("a client with an etcd:// master address sets up");
    c.put(
        "before",
        &value("before", 8192),
        &ReplicateConfig::default(),
    )
    .expect("put through the leader");
    assert_eq!(c.get("before").expect("get"), value("before", 8192));

    // SIGKILL the leader: the standby leads within 2 TTL.
    let killed = Instant::now();
    ms[l].kill();
    let until = killed + 2 * TTL;
    while ms[s].role() != "leader" {
        assert!(
            Instant::now() < until,
            "the standby did not lead within 2 x TTL ({:?})",
            2 * TTL
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = killed.elapsed();
    let (addr, term2) = etcd_view(&etcd, "mooncake_cluster").expect("the key exists");
    assert_eq!(addr, ms[s].rpc, "the key holds the new leader's address");
    assert!(term2 > term, "terms grow: {term} then {term2}");

    // The client keeps working: it finds the new leader and remounts there. Its first call
    // after the kill may fail (a put in flight gets an error, never a silent success).
    let until = Instant::now() + Duration::from_secs(15);
    let mut first_err = None;
    loop {
        match c.put("after", &value("after", 8192), &ReplicateConfig::default()) {
            Ok(()) => break,
            Err(e) => first_err = first_err.or(Some(e)),
        }
        assert!(
            Instant::now() < until,
            "the client never worked with the new leader: {first_err:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        c.get("after").expect("get from the new leader"),
        value("after", 8192)
    );
    // The new leader loaded the old one's journal: what was put before the kill is there.
    assert_eq!(
        c.get("before")
            .expect("an object put before the failover survives it"),
        value("before", 8192)
    );
    let st: serde_json::Value =
        serde_json::from_str(&http_get(&ms[s].http, "/ha_status").1).expect("JSON");
    assert!(
        st["journal"]["entries"].as_u64().is_some_and(|n| n > 0)
            && st["journal"]["lag"].as_u64() == Some(0),
        "the new leader journals what it changes: {st}"
    );
    eprintln!("failover: the standby led {took:?} after the SIGKILL (TTL {TTL:?}); client's first error: {first_err:?}");
    let _ = c.close();
}

#[test]
fn a_paused_leader_refuses_requests_on_waking_and_stands_by() {
    let _cpus = beside();
    let Some(etcd_svc) = Service::etcd() else {
        return;
    };
    let etcd = EtcdClient::connect(
        &[format!("127.0.0.1:{}", etcd_svc.port)],
        Duration::from_secs(2),
    )
    .expect("etcd");
    let cluster = "c-pause";
    let ms = [
        Master::start(etcd_svc.port, Some(cluster), false),
        Master::start(etcd_svc.port, Some(cluster), true),
    ];
    let l = one_leader(&[&ms[0], &ms[1]], Duration::from_secs(10));
    let s = 1 - l;
    let (_, term) = etcd_view(&etcd, cluster).expect("the key");
    assert!(
        etcd_view(&etcd, "mooncake_cluster").is_none(),
        "--cluster_id namespaces the key"
    );

    // A connection to the leader, answered before the pause.
    let mut conn = raw(&ms[l].rpc);
    assert_eq!(
        rpc(&mut conn, &Request::Ping { client: 5 }),
        Response::Ping(PingStatus::NeedRemount)
    );

    common::pause(ms[l].child.id());
    let stopped = Instant::now();
    let until = stopped + 2 * TTL + Duration::from_secs(1);
    while ms[s].role() != "leader" {
        assert!(
            Instant::now() < until,
            "the standby did not take over from the paused leader"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (addr, term2) = etcd_view(&etcd, cluster).expect("the key");
    assert_eq!(addr, ms[s].rpc);
    assert!(term2 > term);

    // Wakes: the very first request is refused (its lease could not be proven), whatever its
    // elector thread has done yet.
    ms[l].signal(Signal::CONT);
    match rpc(&mut conn, &mount_request()) {
        Response::Err(StoreError::NotLeader { .. }) => {}
        other => {
            panic!("a leader woken after its lease expired must refuse at once; got {other:?}")
        }
    }
    // ... and stands by, naming the new leader.
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let old = ms[l].role();
        let new = ms[s].role();
        assert_eq!(new, "leader", "the new leader keeps leading");
        if old == "standby"
            && rpc(&mut conn, &mount_request())
                == Response::Err(StoreError::NotLeader {
                    leader: ms[s].rpc.clone(),
                })
        {
            break;
        }
        assert!(
            Instant::now() < until,
            "the woken leader did not stand by: /role {old}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let st: serde_json::Value =
        serde_json::from_str(&http_get(&ms[l].http, "/ha_status").1).expect("JSON");
    assert_eq!(
        (
            st["role"].as_str(),
            st["leader"].as_str(),
            st["term"].as_i64()
        ),
        (Some("standby"), Some(ms[s].rpc.as_str()), Some(term2)),
        "{st}"
    );
    assert_eq!(
        etcd_view(&etcd, cluster).map(|v| v.0),
        Some(ms[s].rpc.clone()),
        "the key holds the new leader's address"
    );
    // The new leader serves.
    let mut c = raw(&ms[s].rpc);
    assert_eq!(rpc(&mut c, &mount_request()), Response::Ok);
}

// Retired: `a_put_in_flight_across_a_failover_completes_at_the_new_leader` (a put whose
// PutStart one leader answered and whose PutEnd the next one receives completes there, with
// its bytes). Covered by `kvferry-store` `master/tests/failover.rs`
// `a_put_started_at_one_leader_is_ended_or_revoked_at_the_next` (the next leader built from the
// journal completes the put at the replica the first one gave, and gives its bytes to no other
// put meanwhile) and `sim/mod.rs` (puts whose ends are sent again after any number of
// failovers until answered, each acknowledged put read back with its own bytes), and, with
// real processes, `repeated_leader_kills_under_load_never_two_leaders_never_wrong_bytes` (a
// load of puts running across every kill).

// A leader cut off from etcd (etcd stopped with SIGSTOP; this test slept two thirds of a TTL
// to wait for the fence) is covered without a process: `kvferry-store` `ha/fence.rs`
// (`renewals_come_every_period_and_a_lost_key_or_lease_steps_down`: failed renewals extend
// nothing, past the bound it steps down) and `sim/election.rs` (masters cut off from etcd,
// requests and answers lost, then one leader again, never two admitting at once), with the
// end-to-end case kept here:
// `a_leader_cut_off_from_etcd_by_a_network_namespace_stops_accepting_writes`.

// Retired: `a_put_whose_leader_loses_its_term_before_the_start_is_durable_fails_as_unknown_and_is_revoked`
// (etcd stopped under a lone leader: the start applied but not durable fails `OutcomeUnknown`
// and is revoked at the next leader, the key free at once). Covered by `ha/journal/tests.rs`
// `a_request_is_answered_only_once_its_changes_are_written_and_never_across_terms` and
// `a_deferred_answer_is_answered_exactly_once_when_written_never_across_terms` (a term that
// ends before the write answers `OutcomeUnknown`), `repl/tests.rs`
// `a_deferred_answer_comes_back_once_durable_unknown_or_timed_out_never_across_terms`,
// `elect/tests.rs` `a_leader_renews_and_steps_down_when_it_cannot_prove_its_lease` (etcd
// silent: no admission past the bound, then a step-down), `master/tests/failover.rs`
// `a_put_started_at_one_leader_is_ended_or_revoked_at_the_next` (the revoke at the next leader
// frees the key at once), and the client's side by `tests/store.rs`
// `a_put_whose_start_has_an_unknown_outcome_fails_so_and_is_revoked_not_sent_again`.

#[test]
fn etcd_restarted_with_or_without_its_data_masters_and_clients_recover() {
    let _cpus = beside();
    let Some(mut etcd_svc) = Service::etcd() else {
        return;
    };
    let ms = [
        Master::start(etcd_svc.port, None, false),
        Master::start(etcd_svc.port, None, true),
    ];
    one_leader(&[&ms[0], &ms[1]], Duration::from_secs(10));
    let c = ha_client(etcd_svc.port, 16 << 20);
    c.put("k0", &value("k0", 4096), &ReplicateConfig::default())
        .expect("put");
    for (round, wipe) in [(1, false), (2, true)] {
        let before = etcd_view(
            &EtcdClient::connect(
                &[format!("127.0.0.1:{}", etcd_svc.port)],
                Duration::from_secs(2),
            )
            .expect("etcd"),
            "mooncake_cluster",
        );
        etcd_svc.restart(wipe);
        let etcd = EtcdClient::connect(
            &[format!("127.0.0.1:{}", etcd_svc.port)],
            Duration::from_secs(2),
        )
        .expect("etcd back");
        // One leader again (the same one if its lease survived), the key naming it. Right after
        // the restart the old leader may still answer for the rest of its fence bound while the
        // other wins the new key (etcd wiped): the settled state is what counts, so both are read
        // again until they agree (one_leader still fails on two leaders at once).
        let until = Instant::now() + Duration::from_secs(20);
        let (l, view) = loop {
            let l = one_leader(&[&ms[0], &ms[1]], Duration::from_secs(20));
            match etcd_view(&etcd, "mooncake_cluster") {
                Some(v) if v.0 == ms[l].rpc => break (l, v),
                other => assert!(
                    Instant::now() < until,
                    "round {round}: the key does not name the leader {}: {other:?}",
                    ms[l].rpc
                ),
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(wipe || before.is_some(), "round {round}");
        let key = format!("k{round}");
        let until = Instant::now() + Duration::from_secs(20);
        while let Err(e) = c.put(&key, &value(&key, 4096), &ReplicateConfig::default()) {
            assert!(
                Instant::now() < until,
                "round {round} (wipe {wipe}): the client never worked again: {e}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        assert_eq!(c.get(&key).expect("get"), value(&key, 4096));
        eprintln!(
            "round {round} (etcd data wiped: {wipe}): leader {} term {} (before: {before:?})",
            ms[l].rpc, view.1
        );
    }
    let _ = c.close();
}

/// Kills the leader again and again under a put/get load (`KVFERRY_TEST_HA_KILLS` rounds, the
/// issue's 20 by default, ~55 s here; fewer for a quick local run): each time a standby leads within
/// 2 TTL, never two leaders at once, the client works again, and no get ever returns wrong
/// bytes, and every object a put completed before the kills is still there with its bytes.
#[test]
fn repeated_leader_kills_under_load_never_two_leaders_never_wrong_bytes() {
    let _cpus = beside();
    let Some(etcd_svc) = Service::etcd() else {
        return;
    };
    let rounds: usize = std::env::var("KVFERRY_TEST_HA_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let mut ms = [
        Master::start(etcd_svc.port, None, false),
        Master::start(etcd_svc.port, None, true),
    ];
    let mut l = one_leader(&[&ms[0], &ms[1]], Duration::from_secs(10));
    let c = ha_client(etcd_svc.port, 32 << 20);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (oks, errs, gets) = (
        std::sync::atomic::AtomicU64::new(0),
        std::sync::atomic::AtomicU64::new(0),
        std::sync::atomic::AtomicU64::new(0),
    );
    let mut worst = Duration::ZERO;
    let stored = std::sync::Mutex::new(Vec::<String>::new());
    std::thread::scope(|sc| {
        std::thread::Builder::new()
            .name("load".into())
            .spawn_scoped(sc, || {
                use std::sync::atomic::Ordering::Relaxed;
                let mut n = 0u64;
                while !stop.load(Relaxed) {
                    let key = format!("load-{n}");
                    match c.put(&key, &value(&key, 4 << 10), &ReplicateConfig::default()) {
                        Ok(()) => {
                            stored
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push(key.clone());
                            oks.fetch_add(1, Relaxed)
                        }
                        Err(_) => errs.fetch_add(1, Relaxed),
                    };
                    // Any earlier key: its bytes, or not found; never other bytes.
                    let k = format!("load-{}", n / 2);
                    if let Ok(v) = c.get(&k) {
                        assert_eq!(v, value(&k, 4 << 10), "a get returned wrong bytes for {k}");
                        gets.fetch_add(1, Relaxed);
                    }
                    n += 1;
                    // (The load's pace, about 200 puts a second: it waits for nothing.)
                    std::thread::sleep(Duration::from_millis(5));
                }
            })
            .expect("load thread");
        for round in 0..rounds {
            let s = 1 - l;
            // Every other round the standby is in sync first (the failover is from its
            // mirror); otherwise it may not be yet (then from the etcd journal): both hold.
            if round % 2 == 0 {
                wait_insync(&ms[l], &[ms[s].rpc.as_str()], Duration::from_secs(5));
            }
            let killed = Instant::now();
            ms[l].kill();
            loop {
                let (a, b) = (
                    ms[s].role(),
                    ms[l].child.try_wait().ok().flatten().is_some(),
                );
                assert!(b, "the killed master is gone");
                if a == "leader" {
                    break;
                }
                assert!(
                    killed.elapsed() < 2 * TTL,
                    "round {round}: no leader within 2 TTL"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            worst = worst.max(killed.elapsed());
            // A fresh standby in place of the killed one.
            ms[l] = Master::start(etcd_svc.port, None, round % 2 == 0);
            let now = one_leader(&[&ms[0], &ms[1]], Duration::from_secs(5));
            assert_eq!(now, s, "round {round}: the new leader keeps leading");
            // The client works with it.
            let key = format!("probe-{round}");
            let until = Instant::now() + Duration::from_secs(15);
            while c
                .put(&key, &value(&key, 4096), &ReplicateConfig::default())
                .is_err()
            {
                assert!(
                    Instant::now() < until,
                    "round {round}: the client never worked with the new leader"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
            assert_eq!(c.get(&key).expect("get"), value(&key, 4096));
            // Each leader serves the load a while before it is killed.
            let served = oks.load(std::sync::atomic::Ordering::Relaxed);
            let until = Instant::now() + Duration::from_secs(5);
            while oks.load(std::sync::atomic::Ordering::Relaxed) < served + 20 {
                assert!(
                    Instant::now() < until,
                    "round {round}: the load made no progress with the new leader"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            l = s;
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    use std::sync::atomic::Ordering::Relaxed;
    // Zero objects lost: every put that returned Ok, before any of the kills, is readable with
    // its bytes (4 KiB values: nothing is evicted from the 32 MiB pool).
    let stored = stored.into_inner().unwrap_or_else(|e| e.into_inner());
    let lost: Vec<&String> = stored
        .iter()
        .filter(|k| c.get(k).ok() != Some(value(k, 4 << 10)))
        .collect();
    eprintln!("{rounds} kills: worst failover {worst:?}; load: {} puts ok, {} failed, {} gets verified; {} objects lost of {}", oks.load(Relaxed), errs.load(Relaxed), gets.load(Relaxed), lost.len(), stored.len());
    assert!(
        lost.is_empty(),
        "objects lost across {rounds} failovers: {} of {} (first: {:?})",
        lost.len(),
        stored.len(),
        lost.first()
    );
    assert!(oks.load(Relaxed) > 0 && gets.load(Relaxed) > 0);
    let _ = c.close();
}

/// Waits until `m` leads, at most `within`; fails with `what` otherwise.
fn wait_leader(m: &Master, within: Duration, what: &str) {
    let until = Instant::now() + within;
    while m.role() != "leader" {
        assert!(Instant::now() < until, "{what} within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn ha_status(m: &Master) -> serde_json::Value {
    serde_json::from_str(&http_get_with(&m.http, "/ha_status", m.key.as_ref()).1)
        .expect("/ha_status is JSON")
}

/// Waits until the leader `m` names `members` as its in-sync set.
fn wait_insync(m: &Master, members: &[&str], within: Duration) -> serde_json::Value {
    let until = Instant::now() + within;
    loop {
        let st = ha_status(m);
        let now: Vec<&str> = st["insync"]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_str()).collect())
            .unwrap_or_default();
        if now == members {
            return st;
        }
        assert!(
            Instant::now() < until,
            "the in-sync set did not become {members:?} within {within:?}: {st}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

// Retired: `an_in_sync_standby_acknowledges_in_memory_and_takes_over_with_every_object`
// (a standby in sync acknowledges in memory; killed, the leader is succeeded from its
// mirror with every object; a set that empties is rebased into etcd). Covered by
// `sim/standbys.rs` (the real `repl::Pipeline` and `repl::Feed`: takeovers from a member's
// mirror with every acknowledged put checked), `repl/tests.rs`
// `the_queue_and_the_pipeline_answer_each_request_once_and_durable_only_when_every_member_has_it`,
// `ha/journal/tests.rs` `a_standby_linking_under_load_gets_its_image_then_every_later_entry_once_in_order`,
// and, with real processes, `repeated_leader_kills_under_load_never_two_leaders_never_wrong_bytes`
// (in-sync takeovers under load) and `a_rebase_under_load_writes_what_etcd_lacks_and_a_lone_master_loads_every_object`.

// Retired: `a_put_answered_early_whose_start_died_with_the_leader_is_never_served_and_its_bytes_never_reused`.
// Covered by `sim/standbys.rs` and `sim/mod.rs` (puts answered early in durably granted space,
// leaders lost before the start's change left them, late writes: no space given twice while a
// write may land, across any number of takeovers; `KVFERRY_SIM_SEED=28` without the fix),
// `master/changes/tests.rs` `a_new_leader_holds_what_a_grant_named_that_no_replica_it_knows_covers`,
// and `server/tests.rs` `puts_placed_in_a_durable_grant_are_answered_at_once_and_their_changes_ride_with_the_next`.

/// Masters holding the cluster key (`KVFERRY_AUTH_KEY_FILE`) replicate to each other and fail
/// over as without one, and serve clients that hold it; a master holding another key
/// registers as a standby but the leader never links it (each side proves the key on the
/// replication link), so it never joins the in-sync set nor mirrors anything, and a client
/// with another key is refused at once.
#[test]
fn masters_holding_the_cluster_key_replicate_and_fail_over_and_one_with_another_key_never_joins() {
    let _cpus = beside();
    let Some(etcd_svc) = Service::etcd() else {
        return;
    };
    let dir = tempfile::tempdir().expect("temporary directory");
    let file = |name: &str, c: char| {
        let p = dir.path().join(name);
        std::fs::write(&p, c.to_string().repeat(64)).expect("key file");
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .expect("chmod 600");
        p.to_str().expect("path").to_string()
    };
    let (a, b) = (file("a", 'a'), file("b", 'b'));
    let with = |k: &str| Master::start_env(etcd_svc.port, &[("KVFERRY_AUTH_KEY_FILE", k)]);
    let mut ms = [with(&a), with(&a)];
    let l = one_leader(&[&ms[0], &ms[1]], Duration::from_secs(10));
    let s = 1 - l;
    wait_insync(&ms[l], &[ms[s].rpc.as_str()], Duration::from_secs(5));
    let other = with(&b);
    let client = |k: &str| {
        let engine = kvferry::TransferEngine::new(kvferry::Config {
            auth_key_file: Some(k.into()),
            ..kvferry::Config::default()
        })
        .expect("engine");
        let cfg = ClientConfig {
            local_hostname: String::new(),
            global_segment_size: 32 << 20,
            local_buffer_size: 16 << 20,
            master_server_addr: format!("etcd://127.0.0.1:{}", etcd_svc.port),
            transfer_timeout: Duration::from_secs(10),
            ..ClientConfig::default()
        };
        Client::with_engine(cfg, Arc::new(engine), None)
    };
    let c = client(&a).expect("a client holding the key");
    let keys = put_keys(&c, "auth-", 50);
    let t = Instant::now();
    match client(&b) {
        Err(StoreError::Unauthorized(why)) => assert!(
            why.contains("another key") && t.elapsed() < Duration::from_secs(5),
            "{why} after {:?}",
            t.elapsed()
        ),
        Err(e) => panic!("expected Unauthorized: {e}"),
        Ok(_) => panic!("a client with another key was served"),
    }
    // Meanwhile the leader tried to link the master with another key, more than once: its
    // log says twice that they could not prove the key to each other.
    let refused = || {
        std::fs::read_to_string(&ms[l].log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(&other.rpc) && l.contains("could not prove the cluster key"))
            .count()
    };
    let until = Instant::now() + Duration::from_secs(10);
    while refused() < 2 {
        assert!(Instant::now() < until, "the leader did not try twice to link the master with another key ({} refusals logged):\n{}", refused(), log_tail(&ms[l].log, 40));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        ha_status(&ms[l])["insync"],
        serde_json::json!([ms[s].rpc]),
        "the master with another key is not in sync"
    );
    let mirror = ha_status(&other)["mirror"].clone();
    assert!(
        mirror["objects"].as_u64().unwrap_or(0) == 0 && mirror["fed"] != true,
        "it mirrors nothing: {mirror}"
    );
    assert!(
        log_tail(&ms[l].log, 200).contains("could not prove the cluster key"),
        "the leader says why it does not link it:\n{}",
        log_tail(&ms[l].log, 40)
    );
    // The leader dies: the in-sync standby (the same key) leads with every object.
    ms[l].kill();
    wait_leader(&ms[s], 3 * TTL, "the in-sync standby leads");
    for k in &keys {
        assert_eq!(
            c.get(k)
                .unwrap_or_else(|e| panic!("{k} lost in the failover: {e}")),
            value(k, 4096)
        );
    }
    assert_ne!(
        other.role(),
        "leader",
        "the master with another key does not lead"
    );
    let _ = c.close();
}

/// A keyless host relaying a keyed leader's replication link: registered in etcd as a
/// standby (member `127.0.0.1:1`, at the relay's address), it copies the leader's bytes to
/// the in-sync standby's mirror port and back. The standby refuses the leader's handshake,
/// which dialed the member the registration names, not it; the leader says so and never
/// links that member, the in-sync set stays the real standby, whose own link still serves.
/// (Before, the exchange named no endpoint: the relayed link was taken, and its hello
/// replaced the standby's feed.)
#[test]
fn a_keyed_leaders_link_relayed_to_a_standby_of_another_member_is_refused() {
    use kvferry_store::ha::sync::{parse_registration, registration, standby_key};
    let _cpus = beside();
    let Some(etcd_svc) = Service::etcd() else {
        return;
    };
    let dir = tempfile::tempdir().expect("temporary directory");
    let key = dir.path().join("k");
    std::fs::write(&key, "k".repeat(64)).expect("key file");
    std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .expect("chmod 600");
    let key = key.to_str().expect("path").to_string();
    let ms = [
        Master::start_env(etcd_svc.port, &[("KVFERRY_AUTH_KEY_FILE", &key)]),
        Master::start_env(etcd_svc.port, &[("KVFERRY_AUTH_KEY_FILE", &key)]),
    ];
    let l = one_leader(&[&ms[0], &ms[1]], Duration::from_secs(10));
    let s = 1 - l;
    wait_insync(&ms[l], &[ms[s].rpc.as_str()], Duration::from_secs(5));
    let etcd = EtcdClient::connect(
        &[format!("127.0.0.1:{}", etcd_svc.port)],
        Duration::from_secs(2),
    )
    .expect("etcd");
    let cluster = kvferry_store::ha::DEFAULT_CLUSTER_ID;
    let reg = etcd
        .get_kv(&standby_key(cluster, &ms[s].rpc))
        .expect("etcd get")
        .expect("the standby's registration");
    let mirror = parse_registration(&String::from_utf8_lossy(&reg.value))
        .addr
        .to_string();
    // The relay: every connection copied both ways to the standby's mirror port.
    let relay = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let at = relay.local_addr().expect("addr").to_string();
    let relayed = Arc::new(AtomicU32::new(0));
    let n = Arc::clone(&relayed);
    std::thread::spawn(move || {
        for c in relay.incoming() {
            let Ok(mut c) = c else { continue };
            let Ok(mut m) = TcpStream::connect(&mirror) else {
                continue;
            };
            n.fetch_add(1, Ordering::Relaxed);
            let (Ok(mut c2), Ok(mut m2)) = (c.try_clone(), m.try_clone()) else {
                continue;
            };
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut c2, &mut m2);
                let _ = m2.shutdown(std::net::Shutdown::Both);
            });
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut m, &mut c);
                let _ = c.shutdown(std::net::Shutdown::Both);
            });
        }
    });
    let fake = standby_key(cluster, "127.0.0.1:1");
    etcd.put(&fake, registration(&at, None).as_bytes(), 0)
        .expect("register the relay");
    let until = Instant::now() + Duration::from_secs(15);
    let meant = format!("meant for \"standby/{cluster}/127.0.0.1:1\"");
    while !log_tail(&ms[l].log, 400).contains(&meant) {
        assert!(
            Instant::now() < until,
            "the leader never tried the relay, or did not say why it was refused:\n{}",
            log_tail(&ms[l].log, 40)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let tried = relayed.load(Ordering::Relaxed);
    assert!(tried >= 1, "the link went through the relay");
    // The leader tries the relayed member again (after 1 s, then 2 s ...) and is refused again:
    // it never links it.
    let until = Instant::now() + Duration::from_secs(10);
    while relayed.load(Ordering::Relaxed) <= tried {
        assert!(
            Instant::now() < until,
            "the leader did not try the relayed member again"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        ha_status(&ms[l])["insync"],
        serde_json::json!([ms[s].rpc]),
        "only the real standby is in sync"
    );
    assert_eq!(
        ha_status(&ms[s])["mirror"]["fed"],
        serde_json::json!(true),
        "the real standby is still fed by its own link: {}",
        ha_status(&ms[s])
    );
    let engine = kvferry::TransferEngine::new(kvferry::Config {
        auth_key_file: Some(key.clone().into()),
        ..kvferry::Config::default()
    })
    .expect("engine");
    let cfg = ClientConfig {
        local_hostname: String::new(),
        global_segment_size: 16 << 20,
        local_buffer_size: 16 << 20,
        master_server_addr: format!("etcd://127.0.0.1:{}", etcd_svc.port),
        transfer_timeout: Duration::from_secs(10),
        ..ClientConfig::default()
    };
    let c = Client::with_engine(cfg, Arc::new(engine), None).expect("a client holding the key");
    put_keys(&c, "relayed-", 10);
    wait_insync(&ms[l], &[ms[s].rpc.as_str()], Duration::from_secs(5));
    let _ = etcd.delete(&fake);
    let _ = c.close();
}

// Retired: `a_standby_that_joins_a_set_already_in_sync_takes_over_with_what_etcd_lacks`.
// Covered by the simulator (`kvferry-store` `sim/standbys.rs`, `sim/tail.rs`): standbys
// linked while others are in sync get the leader's run up to their image from the real
// `repl::Tail::upto` (`ToStandby::Run`, kept by the real `MirrorTail::joined`), the first
// members leave or die, and when the leader dies such a standby takes over writing what
// `MirrorTail::takeover` decides (the entries it kept after where etcd's journal ends, else its
// whole state; `joined_tail_takeovers` counts those that wrote the run they were sent), with
// every acknowledged put readable afterwards, checked after every step; the decision itself
// by `repl/tests.rs` `a_takeover_writes_the_kept_entries_etcd_lacks_or_else_the_whole_state`.
// The mutation "the kept run starts one entry late" (`tail_after`) fails 574 of the default
// 5000 seeds (12, 35, 48, ...: the journal skips an entry). The `/ha_status` mirror fields it also read are shown by the
// kept tests' `wait_insync`.

// Retired: `a_rebase_under_load_writes_what_etcd_lacks_and_a_lone_master_loads_every_object`.
// Covered by the simulator (`kvferry-store` `sim/tail.rs`), which drives the real kept tails
// (`repl::Tail` on the leader with a cap drawn per seed, 0 included; `MirrorTail` on the
// standbys, fed the real frames) under a stream of puts: the in-sync set empties (members
// late, cut, paused) or the leader stops, and the rebase writes what `Roster::rebase_from`
// decides (the kept run through the real `tail_log_values`, else the whole state); background
// snapshots while standbys are in sync start new runs (`Tail::refresh_due`, `Tail::refreshed`,
// given up when a member is late, the standbys told with `ToStandby::Base`); the leader dies
// and a standby takes over from its run from the promotion or from a background snapshot
// (`MirrorTail::takeover`); every later leader loads etcd's journal alone, and every
// acknowledged put is readable with its bytes, checked after every step. The mutation "a
// given-up background snapshot's run is used" (`Tail::refreshed`) fails seeds 476, 851, 2867,
// 3365, 3568, 3858 and 4573 of the default 5000.
// The driver's figures (`/metrics` `kvferry_master_ha_rebase_seconds`, `tail_whole`) are not
// asserted any more.

// Retired: `an_in_sync_standby_whose_campaign_fails_keeps_its_mirror_and_leads_from_it`.
// Covered by `elect/tests.rs`
// `a_campaign_from_a_mirror_that_fails_campaigns_from_it_again_and_leads_from_it` (the record
// rewritten under the transaction, a grant or a transaction failing: no takeover is handed
// out, so the driver, which takes the mirror only on `Out::TakeOver`, keeps it; the next
// campaign that can succeed leads from the mirror), `ha/sync/tests.rs`
// `a_mirror_keeps_the_entries_after_where_the_leaders_journal_is_whole_for_a_takeover` (a
// failed takeover puts the mirror back) and `sim/election.rs` (lost transactions, takeovers
// from a mirror only as a member holding it).

// Retired: `in_sync_members_that_all_restart_at_once_do_not_wait_for_each_other_forever`.
// Covered by `elect/tests.rs` `the_in_sync_record_decides_who_may_lead_and_from_what` (a member
// registered without a mirror of the record's term holds no one back: the campaign starts
// empty, guarded by the others' registrations) and `ha/sync/tests.rs`
// `a_registration_says_where_the_mirror_is_its_term_and_that_it_takes_runs`,
// `only_a_member_with_its_terms_mirror_leads_and_a_dead_set_means_starting_empty`.

// Retired: `a_takeover_longer_than_the_lease_ttl_still_leads_with_every_object` (a standby
// whose takeover of 1.2 million objects outlasts the lease TTL still leads with every object,
// its key's lease and its registration renewed meanwhile; one stopped with SIGTERM in the
// middle of its takeover finishes it before it exits). Covered by `elect/fence.rs`
// `a_takeover_renews_every_lease_it_needs_every_period_until_it_ends` (`TakeoverRenewals`,
// which the elector's keep-alive thread runs) and the election simulator
// (`kvferry-store` `sim/election/takeover.rs`): loads of up to three lease TTLs while the real
// `TakeoverRenewals` renews the key's lease and the registration over a network that delays
// and loses them, masters paused, cut off, etcd wiped meanwhile; checked after every step, a
// master admits only while etcd would count its lease alive, a takeover nothing disturbed
// keeps both leases alive and ends leading, and every leader holds every object acknowledged
// before (`long_takeovers` and `lapsed_takeovers` counted and asserted). The mutation "the
// takeover renews once, then never again" (`TakeoverRenewals::poll`) fails 255 of the
// 1 250 election seeds of the default run (0, 4, 10, 13, ...: the key's lease or the
// registration runs out during a load longer than the TTL); "it renews the key's lease
// only" fails 587 (0, 1, 3, 7, ...). A standby stopped in the middle of its takeover:
// `elect/tests.rs` `a_stopping_master_exits_unless_its_mirror_is_the_only_copy_then_leads_from_it_alone`
// (it takes over and then hands off), the hand-off by the simulator's `Sim::stop`; the process
// side (`ha::hand_off` waiting for the takeover and the writer) now runs in no process test.

// Retired: `a_paused_in_sync_standby_holds_a_request_one_acknowledgement_bound_then_leaves_the_set`.
// Covered by `repl/roster/tests.rs` `members_leave_when_late_or_broken_and_the_last_one_leaving_rebases`
// (a member that has not acknowledged the late entry leaves; the set is what etcd holds, the
// rest written first) and `a_standby_joins_only_having_acknowledged_everything_and_named_this_terms_mirror`
// (woken, it joins again once it holds everything), and by the simulator (`sim/standbys.rs`:
// standbys pause past the acknowledgement bound, `Roster::failing` makes them leave, the
// requests they held are answered by the rest or after the rebase, and they are linked and
// join again as the roster decides; every acknowledged put readable after any failover).
// The writer waking within one bound while its links are lent: `ha/journal/tests.rs`.

// Retired: `only_an_in_sync_standby_leads_next_and_losing_it_too_starts_empty_never_stale`.
// Covered by `elect/tests.rs` `the_in_sync_record_decides_who_may_lead_and_from_what` (another
// member alive with the record's mirror: no lease is even granted; none left: start empty,
// never from the stale journal; a registration that appears meanwhile fails the transaction),
// `ha/sync/tests.rs` `only_a_member_with_its_terms_mirror_leads_and_a_dead_set_means_starting_empty`,
// and `sim/standbys.rs` (only a member's mirror is taken over while the set is not empty).

// Retired: `a_leader_stopped_with_sigterm_leaves_its_state_in_etcd_and_hands_off_at_once`.
// Covered by `repl/roster/tests.rs` (`Roster::on_stop`: with a member in sync the etcd journal
// is made whole, the set emptied, before the key goes; without, it steps down at once) and by
// the simulator (`sim/standbys.rs` `Sim::stop`: a leader stopped with SIGTERM does what the
// roster says, answers every request, and the next leader starts at once from the etcd
// journal with every acknowledged put; the roster told to step down without the rebase
// fails seeds 8 and 23 of the default 5000). The stop's process side (`ha::hand_off`
// waiting for the writer, the elector stepping down) ran end to end in
// `a_takeover_longer_than_the_lease_ttl_still_leads_with_every_object`, retired too (above).

// Retired: `an_in_sync_standby_stopped_while_the_leader_is_dead_hands_its_mirror_to_etcd_first`.
// Covered by `elect/tests.rs`
// `a_stopping_master_exits_unless_its_mirror_is_the_only_copy_then_leads_from_it_alone` (the
// leader dead: sealed, it leads from its mirror to hand it to etcd) and
// `a_stopping_member_whose_leader_lives_waits_sealed_and_exits_once_the_record_drops_it`,
// `ha/sync/tests.rs` `a_stopping_member_is_needed_only_as_the_last_holder_of_its_terms_mirror`
// and `a_sealed_mirror_is_fed_no_more_and_keeps_what_it_holds`, `repl/tests.rs`
// `members_leave_the_set_when_late_or_cut_and_join_only_whole_and_registered`; the stop's
// hand-off to etcd by the simulator's `Sim::stop` (see the retired SIGTERM test above).

// Retired: `snapshots_bound_the_journal_and_a_new_leader_loads_them`.
// Covered by the simulator (`kvferry-store` `sim/etcd.rs`): thresholds of 2-64 KiB make
// leaders snapshot again and again across thousands of failovers per run; etcd's bytes under
// the journal's prefix are checked against `etcd::bound` after every step; snapshots are
// written both at once and in the background, their chunks between the writer's commits
// (entries appended after the snapshot's position, which its head keeps:
// `interleaved_snapshots`), leaders die between chunks; every new leader loads snapshot and
// log with the real loader, every acknowledged put reads back, and every key whose removal
// was acknowledged is absent (`Sim::check_gone`). The mutation "the head deletes the first
// entry after its position" (`JournalWriter::head_txn`) fails 250 of the default 5000 seeds
// (30, 42, 53, ...).

/// A network namespace with a veth pair to the test's namespace: `host_ip` and `etcd_ip` on
/// this side, `ns_ip` inside. Deleted (with the pair) when dropped.
struct NetNs {
    name: String,
    dev: String,
    host_ip: String,
    /// A second address on this side, for the way to etcd alone (it can be cut by itself).
    etcd_ip: String,
    ns_ip: String,
}

fn sh(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl NetNs {
    fn create() -> Result<NetNs, String> {
        let id = std::process::id() % 10_000;
        let k = std::process::id() % 250 + 1;
        let ns = NetNs {
            name: format!("kvfha{id}"),
            dev: format!("kvfha{id}b"),
            host_ip: format!("10.213.{k}.1"),
            etcd_ip: format!("10.213.{k}.3"),
            ns_ip: format!("10.213.{k}.2"),
        };
        let host_dev = format!("kvfha{id}a");
        sh(&["ip", "netns", "add", &ns.name])?;
        // From here on, Drop cleans up whatever was made.
        sh(&[
            "ip", "link", "add", &host_dev, "type", "veth", "peer", "name", &ns.dev,
        ])?;
        sh(&["ip", "link", "set", &ns.dev, "netns", &ns.name])?;
        sh(&[
            "ip",
            "addr",
            "add",
            &format!("{}/29", ns.host_ip),
            "dev",
            &host_dev,
        ])?;
        sh(&[
            "ip",
            "addr",
            "add",
            &format!("{}/29", ns.etcd_ip),
            "dev",
            &host_dev,
        ])?;
        sh(&["ip", "link", "set", &host_dev, "up"])?;
        sh(&[
            "ip",
            "netns",
            "exec",
            &ns.name,
            "ip",
            "addr",
            "add",
            &format!("{}/29", ns.ns_ip),
            "dev",
            &ns.dev,
        ])?;
        sh(&[
            "ip", "netns", "exec", &ns.name, "ip", "link", "set", &ns.dev, "up",
        ])?;
        sh(&[
            "ip", "netns", "exec", &ns.name, "ip", "link", "set", "lo", "up",
        ])?;
        Ok(ns)
    }

    /// Blackholes every packet from inside the namespace to `etcd_ip` (no reset, no error:
    /// as a cut link or a partition looks), or lets them through again. Done with a neighbour
    /// entry pointing at a MAC address nobody has (the peer drops the frames): no packet
    /// filter needed, which this VM's kernel lacks.
    fn cut(&self, cut: bool) -> Result<(), String> {
        let exec = ["ip", "netns", "exec", &self.name];
        if cut {
            sh(&[
                &exec[..],
                &[
                    "ip",
                    "neigh",
                    "replace",
                    &self.etcd_ip,
                    "lladdr",
                    "02:00:00:00:00:01",
                    "dev",
                    &self.dev,
                    "nud",
                    "permanent",
                ],
            ]
            .concat())
        } else {
            sh(&[
                &exec[..],
                &["ip", "neigh", "del", &self.etcd_ip, "dev", &self.dev],
            ]
            .concat())
        }
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = sh(&["ip", "netns", "del", &self.name]);
    }
}

/// Forwards connections to `listen` (on the veth's host side) to etcd on 127.0.0.1: how a
/// master inside the namespace reaches the test's etcd. Runs until the test process ends.
fn forward(listen: &str, etcd_port: u16) -> u16 {
    let l = std::net::TcpListener::bind(format!("{listen}:0")).expect("bind the forwarder");
    let port = l.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for c in l.incoming().flatten() {
            let Ok(up) = TcpStream::connect(("127.0.0.1", etcd_port)) else {
                continue;
            };
            let (Ok(c2), Ok(up2)) = (c.try_clone(), up.try_clone()) else {
                continue;
            };
            let pipe = |mut a: TcpStream, mut b: TcpStream| {
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut a, &mut b);
                    let _ = b.shutdown(std::net::Shutdown::Write);
                });
            };
            pipe(c, up);
            pipe(up2, c2);
        }
    });
    port
}

/// A leader in a network namespace of its own, cut off from etcd by blackholing its packets to
/// etcd (its clients still reach it): it refuses every request within 2/3 TTL of the cut, the
/// other master leads within 2 TTL, and once the cut heals the old leader stands by naming the
/// new one. Needs root (`ip netns`); `KVFERRY_SKIP_NETNS=1` skips it, loudly, where the
/// machine forbids namespaces.
#[test]
fn a_leader_cut_off_from_etcd_by_a_network_namespace_stops_accepting_writes() {
    let _cpus = beside();
    let Some(etcd_svc) = Service::etcd() else {
        return;
    };
    let ns = match NetNs::create() {
        Ok(ns) => ns,
        Err(e) if std::env::var("KVFERRY_SKIP_NETNS").is_ok_and(|v| v == "1") => {
            eprintln!("NOT RUN (KVFERRY_SKIP_NETNS=1): cannot create a network namespace: {e}");
            return;
        }
        Err(e) => panic!("this test creates a network namespace (root and iproute2 needed; KVFERRY_SKIP_NETNS=1 to skip): {e}"),
    };
    let fwd = forward(&ns.etcd_ip, etcd_svc.port);
    let conn = format!("etcd://{}:{fwd}", ns.etcd_ip);
    let a = Master::start_in(
        Some(&ns.name),
        &conn,
        None,
        false,
        &["--host", &ns.ns_ip],
        &[],
    );
    assert!(
        a.rpc.starts_with(&ns.ns_ip),
        "the namespaced master advertises its namespace's address: {}",
        a.rpc
    );
    let until = Instant::now() + Duration::from_secs(10);
    while a.role() != "leader" {
        assert!(Instant::now() < until, "the namespaced master never led");
        std::thread::sleep(Duration::from_millis(50));
    }
    let b = Master::start(etcd_svc.port, None, true);
    assert_eq!(
        one_leader(&[&a, &b], Duration::from_secs(5)),
        0,
        "the first master keeps leading"
    );
    let mut to_a = raw(&a.rpc);
    assert_eq!(
        rpc(&mut to_a, &mount_request()),
        Response::Ok,
        "the leader serves before the cut"
    );

    ns.cut(true).expect("cut the namespace off from etcd");
    let cut = Instant::now();
    let refused = loop {
        match rpc(&mut to_a, &Request::Ping { client: 99 }) {
            Response::Err(StoreError::NotLeader { .. }) => break cut.elapsed(),
            other => assert!(
                cut.elapsed() < TTL,
                "the cut-off leader still answers {other:?} after {:?}",
                cut.elapsed()
            ),
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // Its last renewal was sent before the cut: 2/3 TTL after it at the latest, refused.
    assert!(
        refused <= TTL * 2 / 3 + Duration::from_millis(400),
        "refused only {refused:?} after the cut (bound 2/3 TTL)"
    );
    assert!(
        matches!(
            rpc(&mut to_a, &mount_request()),
            Response::Err(StoreError::NotLeader { .. })
        ),
        "writes are refused too"
    );
    let until = cut + 2 * TTL + Duration::from_secs(1);
    while b.role() != "leader" {
        assert!(
            Instant::now() < until,
            "the other master did not lead within 2 TTL of the cut"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = cut.elapsed();
    // The new leader has the segment the old one acknowledged (its journal reached etcd).
    let segs = http_get(&b.http, "/get_all_segments").1;
    assert!(
        segs.contains("127.0.0.1:1"),
        "the mount acknowledged before the cut is known to the new leader: {segs}"
    );
    let mut to_b = raw(&b.rpc);
    assert_eq!(
        rpc(&mut to_b, &mount_request()),
        Response::Ok,
        "the new leader serves (the same mount again is idempotent)"
    );

    ns.cut(false).expect("heal the cut");
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        if a.role() == "standby"
            && rpc(&mut to_a, &mount_request())
                == Response::Err(StoreError::NotLeader {
                    leader: b.rpc.clone(),
                })
        {
            break;
        }
        assert!(
            Instant::now() < until,
            "the old leader did not stand by naming the new one after the cut healed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(one_leader(&[&a, &b], Duration::from_secs(2)), 1);
    eprintln!("netns cut: refused after {refused:?}, the other master led after {took:?}");
}

/// `kvferry store-bench --ha` (the figures in docs/BENCHMARKS.md) runs to the end against a
/// real etcd and reports each of them; its failovers lose nothing (it fails if one does).
#[test]
fn store_bench_ha_reports_every_figure() {
    let _cpus = alone();
    let Some(etcd_svc) = Service::etcd() else {
        return;
    };
    let (status, out) = store_bench_ha(
        etcd_svc.port,
        // Two of the six throughput points (the first, whose costs are read below, and the
        // one named below) and leaders of 20 000 objects: every figure is still printed and
        // read, in about a third of the time the defaults take.
        &[
            "--duration",
            "0.3",
            "--ha-points",
            "1x1,64x32",
            "--ha-link-objects",
            "20000",
        ],
        Duration::from_secs(240),
        |_| {},
    );
    assert!(status.success(), "{status:?}: {out}");
    for figure in [
        "MB per million objects",
        "a new leader loads it in",
        "64 connection(s), 32 key(s)/request",
        "HA etcd transactions",
        "HA standby acknowledgements",
        "HA standby",
        "the other master in sync",
        "4 client(s), 4 MiB x 8 per call",
        "1 client(s), 16 MiB x 8 per call",
        "objects lost: 0 of 1500",
        "per object: µs CPU, switches",
        "a standby linking to a leader of",
        "the same reads meanwhile (requests):",
        "the same puts meanwhile (requests):",
        "two written under a put load",
        "another client's puts meanwhile (requests):",
        "the in-sync set emptied at a leader of",
        "writing the entries kept since the etcd journal's last position",
        "writing the whole state (--ha-rebase-tail-bytes 0)",
        "a standby took over a leader of",
        "writing its whole state (--ha-standby-tail-bytes 0)",
    ] {
        assert!(out.contains(figure), "the report has {figure:?}: {out}");
    }
    // The standby that took over with its tail wrote entries from it.
    let takeover = out
        .lines()
        .find(|l| {
            l.contains("writing the entries it received since the etcd journal's last position")
        })
        .unwrap_or_default();
    let from_tail: u64 = takeover
        .rsplit('(')
        .next()
        .and_then(|t| t.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(
        from_tail > 0,
        "the takeover with its tail wrote entries from it: {takeover:?}"
    );
    // What each object cost was read, not left at zero: the first point's CPU and switches of
    // every setup (no HA; the etcd journal's leader; the standby pair's leader and mirror),
    // and the leader ratio.
    let costs = out
        .split("per object: µs CPU, switches")
        .nth(1)
        .and_then(|t| t.lines().nth(2))
        .unwrap_or_default();
    let figures: Vec<f64> = costs
        .split(|c: char| c == ',' || c == '+' || c.is_whitespace())
        .filter_map(|x| x.parse().ok())
        .skip(2)
        .collect();
    assert_eq!(figures.len(), 8, "1 x 1: eight figures in {costs:?}");
    assert!(
        figures.iter().all(|&f| f > 0.0),
        "every cost measured: {costs:?}"
    );
}

/// Runs `kvferry store-bench --ha` against the etcd on `port` with `args`, calling `during`
/// with its pid every 20 ms until it ends (killed past `bound`): its exit status and output.
fn store_bench_ha(
    port: u16,
    args: &[&str],
    bound: Duration,
    mut during: impl FnMut(u32),
) -> (std::process::ExitStatus, String) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let out_path = dir.path().join("store-bench-ha.out");
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["store-bench", "--ha", &format!("127.0.0.1:{port}")])
        .args(args)
        .env_remove("MC_STORE_CLUSTER_ID")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).expect("output file"))
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn store-bench");
    let until = Instant::now() + bound;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if Instant::now() > until {
            let _ = child.kill();
            let _ = child.wait();
            panic!("store-bench --ha {args:?} did not finish within {bound:?}");
        }
        during(child.id());
        std::thread::sleep(Duration::from_millis(20));
    };
    (
        status,
        std::fs::read_to_string(&out_path).unwrap_or_default(),
    )
}

/// The CPUs a thread may use, from a `Cpus_allowed_list` line ("0-3,6").
fn cpu_list(status: &str) -> Vec<usize> {
    let Some(list) = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
    else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        if let (Ok(a), Ok(b)) = (a.parse::<usize>(), b.parse::<usize>()) {
            out.extend(a..=b);
        }
    }
    out
}

/// `--ha-standby-cpu N` runs the standby's mirror on CPU N alone and every other thread of the
/// bench (its clients, the masters' request threads) off it, while the load runs: read from
/// the bench's threads' own `Cpus_allowed_list` as it runs.
#[test]
fn store_bench_ha_runs_the_standby_on_a_cpu_of_its_own_when_asked() {
    let _cpus = alone();
    let allowed = cpu_list(&std::fs::read_to_string("/proc/self/status").unwrap_or_default());
    if allowed.len() < 2 {
        eprintln!("NOT RUN: this test needs two CPUs (it may use {allowed:?})");
        return;
    }
    let Some(etcd_svc) = Service::etcd() else {
        return;
    };
    let cpu = *allowed.last().expect("two CPUs");
    // (thread name → CPU lists seen)
    let mut seen: std::collections::HashMap<String, Vec<Vec<usize>>> =
        std::collections::HashMap::new();
    let args = [
        "--duration",
        "1",
        "--ha-parts",
        "rate",
        "--ha-points",
        "4x32",
        "--ha-standby-cpu",
        &cpu.to_string(),
    ];
    let (status, out) = store_bench_ha(etcd_svc.port, &args, Duration::from_secs(120), |pid| {
        for t in std::fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = std::fs::read_to_string(t.path().join("comm"))
                .unwrap_or_default()
                .trim()
                .to_string();
            if matches!(
                name.as_str(),
                "kvf-ha-standby" | "kvf-master-rpc" | "kvf-bench-put"
            ) {
                let cpus =
                    cpu_list(&std::fs::read_to_string(t.path().join("status")).unwrap_or_default());
                if !cpus.is_empty() {
                    seen.entry(name).or_default().push(cpus);
                }
            }
        }
    });
    assert!(status.success(), "{status:?}: {out}");
    assert!(
        out.contains(&format!("the standby's mirror on CPU {cpu} alone")),
        "{out}"
    );
    assert!(
        out.contains("4 connection(s), 32 key(s)/request"),
        "the point is measured: {out}"
    );
    // The connection thread is seen pinned only after the bench pinned it (its first look may
    // come before); a load's whole measurement runs pinned, so it is seen so at the end.
    let standby = seen
        .get("kvf-ha-standby")
        .unwrap_or_else(|| panic!("the standby's thread was seen: {seen:?}"));
    assert!(
        standby.iter().any(|c| c == &vec![cpu]),
        "the mirror ran on CPU {cpu} alone: {standby:?}"
    );
    for name in ["kvf-master-rpc", "kvf-bench-put"] {
        let lists = seen
            .get(name)
            .unwrap_or_else(|| panic!("{name} threads were seen: {seen:?}"));
        assert!(
            lists.iter().all(|c| !c.contains(&cpu)),
            "{name} threads stay off CPU {cpu}: {lists:?}"
        );
    }
}
