//! Central metadata mode against real services: Debian's etcd and redis-server started on
//! free 127.0.0.1 ports (see `metadata_services`), and Mooncake's Python HTTP metadata server
//! (required, see `metadata_services`). Registration, look-up by name, transfers verified
//! byte for byte, Mooncake's key layout, removal on shutdown, etcd leases (a crashed engine
//! disappears), services restarted under running engines, peers restarted under the same
//! name, and the error cases.

mod metadata_services;

use kvferry::metadata::{connect, Keys, MetadataStore, StoreOptions};
use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest};
use metadata_services::races::{one_name_raced, removal_takes_only_the_write_seen};
use metadata_services::Service;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn config(meta: &str, name: &str) -> Config {
    Config {
        local_hostname: name.into(),
        metadata_server: meta.into(),
        advertise_address: Some("127.0.0.1".into()),
        transfer_timeout: Duration::from_secs(10),
        metadata_lease_ttl: Duration::from_secs(3),
        ..Config::default()
    }
}

/// Like [`config`], data over TCP even between engines of one host (`KVFERRY_TRANSPORT=tcp`
/// where the build has other transports).
fn tcp_config(meta: &str, name: &str) -> Config {
    let base = Config::from_lookup(&|k| (k == "KVFERRY_TRANSPORT").then(|| "tcp".to_string()))
        .expect("config");
    Config {
        local_hostname: name.into(),
        metadata_server: meta.into(),
        ..base.clone()
    }
    .with_test_defaults()
}

trait TestDefaults {
    fn with_test_defaults(self) -> Self;
}

impl TestDefaults for Config {
    fn with_test_defaults(self) -> Config {
        Config {
            advertise_address: Some("127.0.0.1".into()),
            transfer_timeout: Duration::from_secs(10),
            metadata_lease_ttl: Duration::from_secs(3),
            ..self
        }
    }
}

fn tcp_engine(meta: &str, name: &str) -> TransferEngine {
    TransferEngine::new(tcp_config(meta, name))
        .unwrap_or_else(|e| panic!("engine {name} on {meta}: {e}"))
}

fn engine(meta: &str, name: &str) -> TransferEngine {
    TransferEngine::new(config(meta, name))
        .unwrap_or_else(|e| panic!("engine {name} on {meta}: {e}"))
}

fn raw_store(url: &str) -> Arc<dyn MetadataStore> {
    connect(url, &StoreOptions::default())
        .expect("connect")
        .expect("not P2P")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// `b` writes a pattern into `a`'s buffer and reads it back into another local buffer.
fn write_then_read(b: &TransferEngine, seg: &str, remote: u64, len: usize, seed: u8) {
    let src = pattern(len, seed);
    let mut dst = vec![0u8; len];
    b.register_memory(src.as_ptr() as u64, len as u64, "cpu:0")
        .unwrap();
    b.register_memory(dst.as_mut_ptr() as u64, len as u64, "cpu:0")
        .unwrap();
    let id = b.open_segment(seg).unwrap();
    let w = TransferRequest {
        opcode: Opcode::Write,
        source: src.as_ptr() as u64,
        target_id: id,
        target_offset: remote,
        length: len as u64,
    };
    let s = b.transfer_sync(&[w], Duration::from_secs(10)).unwrap();
    assert_eq!(s.status, TaskStatus::Completed, "write to {seg}: {s:?}");
    let r = TransferRequest {
        opcode: Opcode::Read,
        source: dst.as_mut_ptr() as u64,
        target_id: id,
        target_offset: remote,
        length: len as u64,
    };
    let s = b.transfer_sync(&[r], Duration::from_secs(10)).unwrap();
    assert_eq!(s.status, TaskStatus::Completed, "read from {seg}: {s:?}");
    assert!(
        dst == src,
        "bytes read back from {seg} are the bytes written"
    );
    b.unregister_memory_batch(&[src.as_ptr() as u64, dst.as_ptr() as u64])
        .unwrap();
}

fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let until = Instant::now() + limit;
    while !f() {
        assert!(
            Instant::now() < until,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Registration, look-up, transfer, key layout, update on (un)register, removal on drop.
fn full_cycle(url: &str, tag: &str) {
    full_cycle_with(url, tag, None)
}

/// [`full_cycle`] with `KVFERRY_METADATA_CA_FILE` (https) for the store and both engines.
fn full_cycle_with(url: &str, tag: &str, ca_file: Option<&Path>) {
    let ca_file = ca_file.map(Path::to_path_buf);
    let store = connect(
        url,
        &StoreOptions {
            ca_file: ca_file.clone(),
            ..StoreOptions::default()
        },
    )
    .expect("connect")
    .expect("not P2P");
    let engine = |url: &str, name: &str| {
        TransferEngine::new(Config {
            metadata_ca_file: ca_file.clone(),
            ..config(url, name)
        })
        .unwrap_or_else(|e| panic!("engine {name} on {url}: {e}"))
    };
    let keys = Keys::new(None);
    let name_a = format!("{tag}-target");
    let a = engine(url, &name_a);
    assert_eq!(
        a.segment_name(),
        name_a,
        "central mode: the segment name is local_hostname as given"
    );
    let meta: serde_json::Value = serde_json::from_slice(
        &store
            .get(&keys.rpc_meta(&name_a))
            .unwrap()
            .expect("rpc_meta published"),
    )
    .unwrap();
    assert_eq!(meta["ip_or_host_name"], "127.0.0.1");
    assert_eq!(meta["rpc_port"], a.rpc_port());
    let len = 1 << 20;
    let mem = vec![0u8; len];
    a.register_memory(mem.as_ptr() as u64, len as u64, "cpu:0")
        .unwrap();
    let desc: serde_json::Value = serde_json::from_slice(
        &store
            .get(&keys.ram(&name_a))
            .unwrap()
            .expect("ram published"),
    )
    .unwrap();
    assert_eq!(desc["name"], name_a.as_str());
    assert_eq!(desc["tcp_data_port"], a.data_port());
    assert_eq!(
        desc["buffers"][0]["addr"],
        mem.as_ptr() as u64,
        "register_memory updates the published descriptor"
    );

    let b = engine(url, &format!("{tag}-initiator"));
    write_then_read(&b, &name_a, mem.as_ptr() as u64, len, 7);
    assert!(
        mem == pattern(len, 7),
        "the target's memory holds the written bytes"
    );
    b.probe(&name_a).expect("probe by name through rpc_meta");
    b.send_notify(&name_a, "hello").expect("notify by name");
    assert_eq!(a.wait_notifies(Duration::from_secs(5))[0].msg, "hello");

    a.unregister_memory(mem.as_ptr() as u64).unwrap();
    let desc: serde_json::Value =
        serde_json::from_slice(&store.get(&keys.ram(&name_a)).unwrap().unwrap()).unwrap();
    assert!(
        desc["buffers"].as_array().is_none_or(|b| b.is_empty()),
        "unregister updates the published descriptor: {desc}"
    );
    drop(a);
    assert_eq!(
        store.get(&keys.rpc_meta(&name_a)).unwrap(),
        None,
        "clean shutdown removes rpc_meta"
    );
    assert_eq!(
        store.get(&keys.ram(&name_a)).unwrap(),
        None,
        "clean shutdown removes the descriptor"
    );
}

#[test]
fn redis_full_cycle() {
    let Some(svc) = Service::redis() else { return };
    full_cycle(&svc.url(), "redis");
}

#[test]
fn etcd_full_cycle() {
    let Some(svc) = Service::etcd() else { return };
    full_cycle(&svc.url(), "etcd");
}

#[test]
fn mooncake_http_server_full_cycle() {
    let Some(svc) = Service::mooncake_http() else {
        return;
    };
    full_cycle(&svc.url(), "http");
}

/// `AUTH` (password alone, and ACL user + password) and `SELECT`, from the URL and from
/// `MC_REDIS_*` (the URL wins), and errors that say what to fix.
#[test]
fn redis_auth_and_database() {
    let Some(svc) = Service::redis_with(&[
        "--requirepass",
        "topsecret",
        "--user",
        "alice",
        "on",
        ">wonder",
        "~*",
        "&*",
        "+@all",
    ]) else {
        return;
    };
    let hp = format!("127.0.0.1:{}", svc.port);
    let open =
        |url: &str, opts: StoreOptions| connect(url, &opts).expect("connect").expect("not P2P");
    let e = open(&format!("redis://{hp}"), StoreOptions::default())
        .get("k")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("redis")
            && e.contains(&hp)
            && e.contains("requires a password")
            && e.contains("MC_REDIS_PASSWORD"),
        "{e}"
    );
    let e = open(&format!("redis://:wrong@{hp}"), StoreOptions::default())
        .get("k")
        .unwrap_err()
        .to_string();
    assert!(e.contains("AUTH refused") && e.contains(&hp), "{e}");
    let e = open(
        &format!("redis://alice:wrong@{hp}"),
        StoreOptions::default(),
    )
    .get("k")
    .unwrap_err()
    .to_string();
    assert!(e.contains("AUTH refused"), "{e}");

    open(
        &format!("redis://:topsecret@{hp}/3"),
        StoreOptions::default(),
    )
    .put("k", b"in db 3")
    .unwrap();
    assert_eq!(
        open(&format!("redis://:topsecret@{hp}"), StoreOptions::default())
            .get("k")
            .unwrap(),
        None,
        "db 0 is another database"
    );
    assert_eq!(
        open(
            &format!("redis://alice:wonder@{hp}/3"),
            StoreOptions::default()
        )
        .get("k")
        .unwrap()
        .as_deref(),
        Some(&b"in db 3"[..])
    );
    // MC_REDIS_PASSWORD / MC_REDIS_DB_INDEX (through Config) when the URL has none; the URL wins.
    let env = StoreOptions {
        redis_password: Some("topsecret".into()),
        redis_db: Some(3),
        ..StoreOptions::default()
    };
    assert_eq!(
        open(&format!("redis://{hp}"), env.clone())
            .get("k")
            .unwrap()
            .as_deref(),
        Some(&b"in db 3"[..])
    );
    assert_eq!(
        open(&format!("redis://{hp}/0"), env.clone())
            .get("k")
            .unwrap(),
        None,
        "the URL's database wins"
    );
    let user = StoreOptions {
        redis_username: Some("alice".into()),
        redis_password: Some("wonder".into()),
        ..env
    };
    assert_eq!(
        open(&format!("redis://{hp}"), user)
            .get("k")
            .unwrap()
            .as_deref(),
        Some(&b"in db 3"[..])
    );

    // Engines work through it end to end.
    full_cycle(&format!("redis://alice:wonder@{hp}/5"), "redis-auth");
}

/// Something that is not Redis at the address: a prompt error, not a hang or a panic.
#[test]
fn redis_url_pointing_at_another_server() {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for s in l.incoming().take(4) {
            let Ok(mut s) = s else { continue };
            let mut b = [0u8; 256];
            let _ = s.read(&mut b);
            let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
        }
    });
    let t = Instant::now();
    let e = raw_store(&format!("redis://127.0.0.1:{port}"))
        .get("k")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("redis") && e.contains(&format!("127.0.0.1:{port}")),
        "{e}"
    );
    assert!(e.contains("not Redis protocol"), "{e}");
    assert!(
        t.elapsed() < Duration::from_secs(8),
        "took {:?}",
        t.elapsed()
    );
}

/// A server that accepts and never answers: connect (with AUTH and SELECT) and commands are
/// bounded by the timeout.
#[test]
fn redis_silent_server_times_out() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    // Accepted connections are kept open, unanswered.
    std::thread::spawn(move || l.incoming().flatten().collect::<Vec<_>>());
    let opts = StoreOptions {
        timeout: Duration::from_secs(1),
        ..StoreOptions::default()
    };
    for url in [
        format!("redis://127.0.0.1:{port}"),
        format!("redis://:pw@127.0.0.1:{port}/2"),
    ] {
        let t = Instant::now();
        let e = connect(&url, &opts)
            .unwrap()
            .unwrap()
            .get("k")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("redis")
                && e.contains(&format!("127.0.0.1:{port}"))
                && e.contains("timed out"),
            "{url}: {e}"
        );
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "{url}: took {:?}",
            t.elapsed()
        );
    }
}

/// A minimal HTTPS server with Mooncake's HTTP metadata contract (GET/PUT/DELETE
/// `?key=`, keep-alive), on rustls with a certificate for `localhost` and `127.0.0.1` issued by
/// a private CA made here.
mod tls_server {
    use std::collections::HashMap;
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::{Arc, Mutex};

    pub struct TlsServer {
        pub port: u16,
        /// The CA certificate (PEM) that issued the server's certificate.
        pub ca_pem: String,
    }

    type Map = Arc<Mutex<HashMap<String, Vec<u8>>>>;

    /// `self_signed`: the server's certificate is its own issuer (then `ca_pem` is that
    /// certificate) instead of being issued by a CA.
    pub fn start(self_signed: bool) -> TlsServer {
        let names = vec!["localhost".to_string(), "127.0.0.1".to_string()];
        let key = rcgen::KeyPair::generate().unwrap();
        let (cert, ca_pem) = if self_signed {
            let cert = rcgen::CertificateParams::new(names)
                .unwrap()
                .self_signed(&key)
                .unwrap();
            let pem = cert.pem();
            (cert, pem)
        } else {
            let ca_key = rcgen::KeyPair::generate().unwrap();
            let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            ca_params
                .distinguished_name
                .push(rcgen::DnType::CommonName, "kvferry test CA");
            let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).unwrap();
            (
                rcgen::CertificateParams::new(names)
                    .unwrap()
                    .signed_by(&key, &ca)
                    .unwrap(),
                ca.pem(),
            )
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )
            .unwrap();
        let config = Arc::new(config);
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let map: Map = Arc::default();
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                let (config, map) = (config.clone(), map.clone());
                std::thread::spawn(move || {
                    let _ = serve(s, config, map);
                });
            }
        });
        TlsServer { port, ca_pem }
    }

    fn serve(s: TcpStream, config: Arc<rustls::ServerConfig>, map: Map) -> std::io::Result<()> {
        let tls = rustls::ServerConnection::new(config).map_err(std::io::Error::other)?;
        let mut r = BufReader::new(rustls::StreamOwned::new(tls, s));
        loop {
            let mut line = String::new();
            if r.read_line(&mut line)? == 0 {
                return Ok(());
            }
            let mut parts = line.split_whitespace();
            let (method, target) = (
                parts.next().unwrap_or("").to_string(),
                parts.next().unwrap_or("").to_string(),
            );
            let mut len = 0usize;
            loop {
                let mut h = String::new();
                r.read_line(&mut h)?;
                if h.trim().is_empty() {
                    break;
                }
                if let Some((k, v)) = h.split_once(':') {
                    if k.eq_ignore_ascii_case("content-length") {
                        len = v.trim().parse().unwrap_or(0);
                    }
                }
            }
            let mut body = vec![0u8; len];
            r.read_exact(&mut body)?;
            let key = target
                .split_once("?key=")
                .map(|(_, k)| k.to_string())
                .unwrap_or_default();
            let mut m = map.lock().unwrap();
            let (status, out): (&str, Vec<u8>) = match method.as_str() {
                "GET" => match m.get(&key) {
                    Some(v) => ("200 OK", v.clone()),
                    None => ("404 Not Found", b"metadata not found".to_vec()),
                },
                "PUT" => {
                    m.insert(key, body);
                    ("200 OK", b"metadata updated".to_vec())
                }
                "DELETE" => match m.remove(&key) {
                    Some(_) => ("200 OK", b"metadata deleted".to_vec()),
                    None => ("404 Not Found", b"metadata not found".to_vec()),
                },
                _ => ("405 Method Not Allowed", Vec::new()),
            };
            drop(m);
            let head = format!(
                "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                out.len()
            );
            let w = r.get_mut();
            w.write_all(&[head.as_bytes(), &out].concat())?;
            w.flush()?;
        }
    }
}

/// `https://` metadata server: verified against `KVFERRY_METADATA_CA_FILE` (by host name and by
/// IP address), refused without it, and errors naming the file, the URL and the fix.
#[test]
fn https_metadata_server_with_a_private_ca() {
    let srv = tls_server::start(false);
    let dir = std::env::temp_dir().join(format!("kvferry-https-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = dir.join("ca.pem");
    std::fs::write(&ca, &srv.ca_pem).unwrap();
    let with_ca = StoreOptions {
        ca_file: Some(ca.clone()),
        ..StoreOptions::default()
    };
    for host in ["localhost", "127.0.0.1"] {
        let url = format!("https://{host}:{}/metadata", srv.port);
        let store = connect(&url, &with_ca).unwrap().unwrap();
        store.put(&format!("k/{host}"), b"{\"v\":1}").unwrap();
        assert_eq!(
            store.get(&format!("k/{host}")).unwrap().as_deref(),
            Some(&b"{\"v\":1}"[..]),
            "{url}"
        );
        store.remove(&format!("k/{host}")).unwrap();
        assert_eq!(store.get(&format!("k/{host}")).unwrap(), None, "{url}");
    }
    let url = format!("https://localhost:{}/metadata", srv.port);

    // Without the CA: the built-in public roots do not know it.
    let t = Instant::now();
    let e = raw_store(&url).get("k").unwrap_err().to_string();
    assert!(
        e.contains("http") && e.contains(&url) && e.contains("KVFERRY_METADATA_CA_FILE"),
        "{e}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    // A CA file that is missing or holds no certificate: named, with what is wrong.
    let missing = dir.join("nope.pem");
    let e = connect(
        &url,
        &StoreOptions {
            ca_file: Some(missing.clone()),
            ..StoreOptions::default()
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("KVFERRY_METADATA_CA_FILE")
            && e.contains(&missing.display().to_string())
            && e.contains("cannot read"),
        "{e}"
    );
    let junk = dir.join("junk.pem");
    std::fs::write(&junk, "not a certificate\n").unwrap();
    let e = connect(
        &url,
        &StoreOptions {
            ca_file: Some(junk),
            ..StoreOptions::default()
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("no PEM certificate"), "{e}");
    // Plain http to the TLS port: an error, not a hang.
    let t = Instant::now();
    let opts = StoreOptions {
        timeout: Duration::from_secs(2),
        ..StoreOptions::default()
    };
    assert!(
        connect(&format!("http://127.0.0.1:{}/metadata", srv.port), &opts)
            .unwrap()
            .unwrap()
            .get("k")
            .is_err()
    );
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );

    // Engines register, find each other and move data through it.
    full_cycle_with(&url, "https", Some(&ca));

    // A self-signed server certificate, trusted as its own CA.
    let srv = tls_server::start(true);
    std::fs::write(&ca, &srv.ca_pem).unwrap();
    let store = connect(
        &format!("https://localhost:{}/metadata", srv.port),
        &with_ca,
    )
    .unwrap()
    .unwrap();
    store.put("k", b"1").unwrap();
    assert_eq!(store.get("k").unwrap().as_deref(), Some(&b"1"[..]));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cluster_id_namespaces_keys() {
    let Some(svc) = Service::redis() else { return };
    let url = svc.url();
    let store = raw_store(&url);
    let a = TransferEngine::new(Config {
        metadata_cluster_id: Some("blue".into()),
        ..config(&url, "node-a")
    })
    .unwrap();
    assert!(store
        .get("mooncake/blue/rpc_meta/node-a")
        .unwrap()
        .is_some());
    assert!(store.get("mooncake/blue/ram/node-a").unwrap().is_some());
    assert!(store.get("mooncake/rpc_meta/node-a").unwrap().is_none());
    // Another cluster does not see it; the same cluster does.
    let other = engine(&url, "node-b");
    let e = other.open_segment("node-a").unwrap_err().to_string();
    assert!(
        e.contains("segment node-a is not registered in redis"),
        "{e}"
    );
    let same = TransferEngine::new(Config {
        metadata_cluster_id: Some("blue".into()),
        ..config(&url, "node-c")
    })
    .unwrap();
    same.open_segment("node-a").unwrap();
    drop(a);
}

/// Set by the parent test: this process becomes an engine that registers, prints READY and
/// waits to be killed.
#[test]
fn child_engine() {
    let (Ok(url), Ok(name)) = (
        std::env::var("KVF_TEST_CHILD_META"),
        std::env::var("KVF_TEST_CHILD_NAME"),
    ) else {
        return;
    };
    let e = engine(&url, &name);
    let mem = vec![1u8; 4096];
    e.register_memory(mem.as_ptr() as u64, 4096, "cpu:0")
        .unwrap();
    println!("READY {}", e.rpc_port());
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

struct ChildEngine(std::process::Child);

impl ChildEngine {
    fn start(url: &str, name: &str) -> ChildEngine {
        use std::io::BufRead;
        let mut c = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_engine", "--nocapture", "--test-threads=1"])
            .env("KVF_TEST_CHILD_META", url)
            .env("KVF_TEST_CHILD_NAME", name)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let out = c.stdout.take().unwrap();
        let mut lines = std::io::BufReader::new(out).lines();
        assert!(
            lines.any(|l| l.map(|l| l.contains("READY ")).unwrap_or(false)),
            "child engine started"
        );
        ChildEngine(c)
    }

    /// SIGKILL: no clean shutdown, its entries stay behind.
    fn crash(mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for ChildEngine {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn etcd_lease_removes_a_crashed_engine() {
    let Some(svc) = Service::etcd() else { return };
    let url = svc.url();
    let store = raw_store(&url);
    let keys = Keys::new(None);
    let child = ChildEngine::start(&url, "crashy");
    assert!(store.get(&keys.rpc_meta("crashy")).unwrap().is_some());
    // Alive for longer than the TTL (3 s): the keeper renews the lease.
    std::thread::sleep(Duration::from_secs(5));
    assert!(
        store.get(&keys.ram("crashy")).unwrap().is_some(),
        "a live engine's entries outlive the TTL"
    );
    child.crash();
    let t = Instant::now();
    wait_until(
        "the crashed engine's entries to expire",
        Duration::from_secs(15),
        || {
            store.get(&keys.rpc_meta("crashy")).unwrap().is_none()
                && store.get(&keys.ram("crashy")).unwrap().is_none()
        },
    );
    eprintln!("crashed engine gone from etcd after {:?}", t.elapsed());
}

/// A service restarted under running engines: they publish themselves again.
fn service_restart(svc: &mut Service, wipe: bool) {
    let url = svc.url();
    let a = engine(&url, "survivor");
    let len = 64 << 10;
    let mem = vec![0u8; len];
    a.register_memory(mem.as_ptr() as u64, len as u64, "cpu:0")
        .unwrap();
    svc.restart(wipe);
    let store = raw_store(&url);
    let keys = Keys::new(None);
    let t = Instant::now();
    wait_until("the engine to re-register", Duration::from_secs(20), || {
        store
            .get(&keys.rpc_meta("survivor"))
            .ok()
            .flatten()
            .is_some()
            && store.get(&keys.ram("survivor")).ok().flatten().is_some()
    });
    eprintln!(
        "{:?} restarted (wiped: {wipe}): engine registered again after {:?}",
        svc.kind,
        t.elapsed()
    );
    let b = engine(&url, "newcomer");
    write_then_read(&b, "survivor", mem.as_ptr() as u64, len, 3);
}

#[test]
fn etcd_restarted_with_data_lost_engines_reregister() {
    let Some(mut svc) = Service::etcd() else {
        return;
    };
    service_restart(&mut svc, true);
}

#[test]
fn etcd_restarted_with_data_kept_engines_keep_working() {
    let Some(mut svc) = Service::etcd() else {
        return;
    };
    service_restart(&mut svc, false);
}

/// An etcd that lost its data counts revisions from 1 again, so a key created after the wipe
/// carries the revision of the key created before it. The guards the store's leader election
/// uses (`Owner`: revision and lease) still tell the two creations apart: the old holder can
/// neither delete the new key nor write under its guard; the new holder can.
#[test]
fn etcd_guards_name_one_creation_across_a_wipe() {
    use kvferry::metadata::etcd::{Created, EtcdClient, Owner};
    let Some(mut svc) = Service::etcd() else {
        return;
    };
    let connect = |port: u16| {
        EtcdClient::connect(&[format!("127.0.0.1:{port}")], Duration::from_secs(5)).expect("etcd")
    };
    let create = |etcd: &EtcdClient, value: &[u8]| {
        let (lease, _) = etcd.lease_grant(60).expect("lease");
        match etcd.create("view", value, lease).expect("create") {
            Created::Won(rev) => Owner {
                create_revision: rev,
                lease,
            },
            Created::Lost(kv) => panic!("the key exists: {kv:?}"),
        }
    };
    let old = create(&connect(svc.port), b"old");
    svc.restart(true);
    let etcd = connect(svc.port);
    let new = create(&etcd, b"new");
    assert_eq!(
        new.create_revision, old.create_revision,
        "a wiped etcd gives the new key the old key's revision (the hazard this guards)"
    );
    assert_ne!(new.lease, old.lease);
    let kv = etcd.get_kv("view").expect("get").expect("the new key");
    assert!(new.holds(&kv) && !old.holds(&kv));

    assert_eq!(
        etcd.txn_if_owned("view", old, &[("journal".into(), b"stale".to_vec())], None)
            .expect("txn"),
        None,
        "the old holder's write is refused"
    );
    assert_eq!(
        etcd.get_kv("journal").expect("get"),
        None,
        "and nothing was written"
    );
    assert!(
        !etcd.delete_if_owned("view", old).expect("delete"),
        "the old holder cannot delete the new key"
    );
    assert_eq!(
        etcd.get_kv("view")
            .expect("get")
            .expect("still there")
            .value,
        b"new"
    );

    assert!(etcd
        .txn_if_owned("view", new, &[("journal".into(), b"fresh".to_vec())], None)
        .expect("txn")
        .is_some());
    assert_eq!(
        etcd.get_kv("journal").expect("get").expect("written").value,
        b"fresh"
    );
    assert!(
        etcd.delete_if_owned("view", new).expect("delete"),
        "the holder deletes its own key"
    );
    assert_eq!(etcd.get_kv("view").expect("get"), None);
}

/// An engine whose entries were lost (its lease ran out: cut off from etcd longer than the
/// TTL; here, etcd wiped) while another engine took its segment name does not take the name
/// back when it reconnects: before, its keeper put its rpc_meta and descriptor over the other
/// engine's, and peers were sent one engine's descriptor under the other's address.
#[test]
fn an_engine_that_lost_its_name_does_not_take_it_back() {
    use kvferry::metadata::{Directory, RpcMeta};
    let Some(mut svc) = Service::etcd() else {
        return;
    };
    let url = svc.url();
    let keys = Keys::new(None);
    let a = Directory::new(raw_store(&url), keys.clone());
    let mine = RpcMeta {
        ip_or_host_name: "127.0.0.1".into(),
        rpc_port: 1111,
    };
    a.publish_rpc_meta("contested", &mine, &|_| true).unwrap();
    a.publish(&keys.ram("contested"), b"a's descriptor".to_vec())
        .unwrap();
    svc.restart(true); // a's lease and entries are gone
    let other = serde_json::to_vec(&RpcMeta {
        ip_or_host_name: "127.0.0.1".into(),
        rpc_port: 2222,
    })
    .unwrap();
    let b = raw_store(&url);
    wait_until("etcd to answer again", Duration::from_secs(20), || {
        b.put(&keys.rpc_meta("contested"), &other).is_ok()
    });
    b.put(&keys.ram("contested"), b"b's descriptor").unwrap();
    let _ = a.maintain();
    let _ = a.maintain();
    assert_eq!(
        b.get(&keys.rpc_meta("contested")).unwrap().as_deref(),
        Some(&other[..]),
        "the name stays with the engine that took it"
    );
    assert_eq!(
        b.get(&keys.ram("contested")).unwrap().as_deref(),
        Some(&b"b's descriptor"[..])
    );
    a.withdraw_all();
    assert!(
        b.get(&keys.rpc_meta("contested")).unwrap().is_some(),
        "withdrawing removes nothing of the other engine's"
    );
}

#[test]
fn one_name_raced_by_engines_starting_together() {
    if let Some(svc) = Service::etcd() {
        one_name_raced(&svc.url(), false);
        one_name_raced(&svc.url(), true);
    }
    if let Some(svc) = Service::redis() {
        one_name_raced(&svc.url(), false);
        one_name_raced(&svc.url(), true);
    }
    // (Over HTTP only a fresh name: Mooncake's contract has no remove-if-unchanged.)
    if let Some(svc) = Service::mooncake_http() {
        one_name_raced(&svc.url(), false);
    }
}

#[test]
fn a_removal_of_what_was_seen_leaves_what_was_written_since() {
    if let Some(svc) = Service::etcd() {
        removal_takes_only_the_write_seen(&svc.url(), true);
    }
    if let Some(svc) = Service::redis() {
        removal_takes_only_the_write_seen(&svc.url(), false);
    }
}

/// An engine restarts at the address its dead entry names and registers again, while another
/// engine that looked at the dead entry removes it "if unchanged": the restarted engine's
/// entry stays. On etcd the write's revision tells them apart; on Redis only the value can,
/// so each `rpc_meta` write carries a random number (before, the identical rewrite was
/// removed and the restarted engine lost its name). The restarted engine also takes its own
/// leftover back although its address answers (it is its own).
#[test]
fn a_restarted_engines_entry_is_not_taken_by_a_removal_of_its_dead_one() {
    use kvferry::metadata::{decode_rpc_meta, Directory, RpcMeta};
    let check = |url: &str| {
        let keys = Keys::new(None);
        let key = keys.rpc_meta("phoenix");
        let meta = RpcMeta {
            ip_or_host_name: "127.0.0.1".into(),
            rpc_port: 4242,
        };
        let first = Directory::new(raw_store(url), keys.clone());
        first
            .publish_rpc_meta("phoenix", &meta, &|_| false)
            .unwrap();
        let other = raw_store(url);
        let seen = other
            .get_seen(&key)
            .unwrap()
            .expect("the first incarnation's entry");
        // (Dropped without withdrawing: a crash leaves the entry.)
        std::mem::forget(first);
        let again = Directory::new(raw_store(url), keys.clone());
        again
            .publish_rpc_meta("phoenix", &meta, &|_| true)
            .expect("an engine takes its own leftover back");
        let now = other.get(&key).unwrap().expect("the new entry");
        assert_ne!(
            now, seen.value,
            "{url}: a rewrite at the same address is a different value"
        );
        assert_eq!(decode_rpc_meta(&now).unwrap(), meta);
        assert!(
            !other.remove_if(&key, &seen).unwrap(),
            "{url}: the removal of the dead entry took the restarted engine's"
        );
        assert_eq!(other.get(&key).unwrap(), Some(now), "{url}");
        again.withdraw_all();
    };
    if let Some(svc) = Service::etcd() {
        check(&svc.url());
    }
    if let Some(svc) = Service::redis() {
        check(&svc.url());
    }
}

#[test]
fn redis_restarted_engines_reregister() {
    let Some(mut svc) = Service::redis() else {
        return;
    };
    service_restart(&mut svc, true);
}

/// A peer restarts under the same name with new ports and the same buffer address: the
/// initiator's cached descriptor points at a dead data port, the connection is refused, the
/// engine re-reads the store and retries.
fn peer_restart_same_name(url: &str) {
    let len = 256 << 10;
    let mem = vec![0u8; len];
    let addr = mem.as_ptr() as u64;
    let a1 = tcp_engine(url, "phoenix");
    a1.register_memory(addr, len as u64, "cpu:0").unwrap();
    let old_port = a1.data_port();
    let b = tcp_engine(url, "watcher");
    write_then_read(&b, "phoenix", addr, len, 1);
    drop(a1);
    // The new incarnation must really have another data port: hold the old one while it
    // binds (ports are drawn at random from the range, so it could draw the same one; making
    // another engine while the first still lived would be a second live "phoenix").
    let hold = std::net::TcpListener::bind(("127.0.0.1", old_port))
        .expect("the old incarnation's data port is free once it is dropped");
    let a2 = tcp_engine(url, "phoenix");
    assert_ne!(a2.data_port(), old_port);
    drop(hold);
    a2.register_memory(addr, len as u64, "cpu:0").unwrap();
    write_then_read(&b, "phoenix", addr, len, 2);
    assert!(mem == pattern(len, 2));
    // And a new buffer at another address: found by the stale-descriptor refresh.
    let mem2 = vec![0u8; len];
    a2.register_memory(mem2.as_ptr() as u64, len as u64, "cpu:0")
        .unwrap();
    write_then_read(&b, "phoenix", mem2.as_ptr() as u64, len, 4);
}

#[test]
fn peer_restarted_under_same_name_redis() {
    let Some(svc) = Service::redis() else { return };
    peer_restart_same_name(&svc.url());
}

#[test]
fn peer_restarted_under_same_name_etcd() {
    let Some(svc) = Service::etcd() else { return };
    peer_restart_same_name(&svc.url());
}

/// A crashed engine left its rpc_meta behind (Redis: no lease; Mooncake's HTTP server refuses
/// to overwrite rpc_meta): its successor under the same name takes the stale entry over,
/// while a live engine keeps its name.
fn stale_takeover(url: &str) {
    let child = ChildEngine::start(url, "reborn");
    let e = TransferEngine::new(config(url, "reborn"))
        .err()
        .expect("a live engine keeps its name")
        .to_string();
    assert!(e.contains("already registered by a live engine"), "{e}");
    child.crash();
    let a = engine(url, "reborn");
    let mem = vec![0u8; 4096];
    a.register_memory(mem.as_ptr() as u64, 4096, "cpu:0")
        .unwrap();
    let b = engine(url, "checker");
    write_then_read(&b, "reborn", mem.as_ptr() as u64, 4096, 9);
}

#[test]
fn crashed_engine_name_is_reusable_redis() {
    let Some(svc) = Service::redis() else { return };
    stale_takeover(&svc.url());
}

#[test]
fn crashed_engine_name_is_reusable_mooncake_http() {
    let Some(svc) = Service::mooncake_http() else {
        return;
    };
    stale_takeover(&svc.url());
}

#[test]
fn not_registered_and_malformed_entries() {
    let Some(svc) = Service::redis() else { return };
    let url = svc.url();
    let store = raw_store(&url);
    let b = engine(&url, "reader");
    let e = b.open_segment("ghost").unwrap_err();
    assert!(
        e.to_string()
            .contains("segment ghost is not registered in redis"),
        "{e}"
    );
    assert_eq!(e.mooncake_code(), -200);
    store.put("mooncake/ram/garbage", b"{not json").unwrap();
    store
        .put(
            "mooncake/rpc_meta/garbage",
            br#"{"ip_or_host_name":"127.0.0.1","rpc_port":1}"#,
        )
        .unwrap();
    let e = b.open_segment("garbage").unwrap_err().to_string();
    assert!(
        e.contains("mooncake/ram/garbage") && e.contains("descriptor"),
        "{e}"
    );
    store.put("mooncake/ram/nolen", br#"{"name":"nolen","protocol":"tcp","tcp_data_port":5,"buffers":[{"name":"cpu:0","addr":4096}]}"#).unwrap();
    let e = b.open_segment("nolen").unwrap_err().to_string();
    assert!(e.contains("length"), "the missing field is named: {e}");
    store.put("mooncake/ram/noport", br#"{"name":"noport","protocol":"tcp","buffers":[{"name":"cpu:0","addr":4096,"length":10}]}"#).unwrap();
    let e = b.open_segment("noport").unwrap_err().to_string();
    assert!(e.contains("tcp_data_port"), "{e}");
    store
        .put(
            "mooncake/ram/nometa",
            br#"{"name":"nometa","protocol":"tcp","tcp_data_port":5}"#,
        )
        .unwrap();
    store
        .put("mooncake/rpc_meta/nometa", br#"{"rpc_port":5}"#)
        .unwrap();
    let e = b.open_segment("nometa").unwrap_err().to_string();
    assert!(e.contains("ip_or_host_name"), "{e}");
}

#[test]
fn unreachable_services_fail_fast_naming_backend_and_url() {
    let port = metadata_services::free_port();
    for (url, backend) in [
        (format!("http://127.0.0.1:{port}/metadata"), "http"),
        (format!("etcd://127.0.0.1:{port}"), "etcd"),
        (format!("redis://127.0.0.1:{port}"), "redis"),
        // A blackholed address: connect must time out, not hang.
        ("http://10.255.255.1:9/metadata".to_string(), "http"),
        ("etcd://10.255.255.1:9".to_string(), "etcd"),
        ("redis://10.255.255.1:9".to_string(), "redis"),
    ] {
        let t = Instant::now();
        let cfg = Config {
            metadata_timeout: Duration::from_secs(2),
            ..config(&url, "lonely")
        };
        let e = TransferEngine::new(cfg)
            .err()
            .unwrap_or_else(|| {
                panic!("{url}: an engine without its metadata service must not start")
            })
            .to_string();
        let took = t.elapsed();
        let shown = url
            .trim_end_matches("/metadata")
            .trim_start_matches("http://")
            .trim_start_matches("etcd://")
            .trim_start_matches("redis://");
        assert!(
            e.contains(backend) && e.contains(shown),
            "{url}: error names backend and address: {e}"
        );
        assert!(
            took < Duration::from_secs(8),
            "{url}: failed within a bounded time, took {took:?}"
        );
    }
}

#[test]
fn unknown_scheme_lists_supported() {
    let e = TransferEngine::new(config("zookeeper://h:2181", "x"))
        .err()
        .unwrap()
        .to_string();
    for s in ["P2PHANDSHAKE", "http://", "etcd://", "redis://"] {
        assert!(e.contains(s), "{e}");
    }
}
