//! Real metadata services for tests: Debian's `etcd` and `redis-server`, and Mooncake's
//! `mooncake_http_metadata_server`, started on free 127.0.0.1 ports and stopped by pid.
//!
//! When a binary is missing the test fails with the install command, unless
//! `KVFERRY_SKIP_SERVICES=1` opts out explicitly: then it prints NOT RUN and returns.
//! Shared by `crates/kvferry/tests/metadata*.rs` and `crates/kvferry-cli/tests/metadata*.rs`.
#![allow(dead_code)]

#[path = "../mooncake_peer/mod.rs"]
pub mod mooncake_peer;
pub mod races;

use mooncake_peer::python as mooncake_python;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port on 127.0.0.1")
}

/// `which`: the path of `name` on PATH.
pub fn find_binary(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

fn missing(what: &str) -> Option<Service> {
    assert!(
        std::env::var("KVFERRY_SKIP_SERVICES").as_deref() == Ok("1"),
        "{what} is missing: apt-get install etcd-server etcd-client redis-server (scripts/test does), or set KVFERRY_SKIP_SERVICES=1 to leave these tests out"
    );
    eprintln!("NOT RUN (KVFERRY_SKIP_SERVICES=1): {what} is missing");
    None
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Etcd,
    Redis,
    MooncakeHttp,
}

/// A running service; killed (SIGKILL, by pid/process group) and its files removed on drop.
pub struct Service {
    pub kind: Kind,
    pub port: u16,
    peer_port: u16,
    pub dir: PathBuf,
    bin: PathBuf,
    /// Extra command-line arguments (e.g. redis-server's `--requirepass`).
    extra: Vec<String>,
    child: Option<Child>,
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "kvferry-svc-{tag}-{}-{}",
        std::process::id(),
        rand_suffix()
    ));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(Instant::now().elapsed().as_nanos() as u64);
    h.finish() & 0xffff_ffff
}

/// One HTTP GET on 127.0.0.1:port; the response text.
pub fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s =
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(300))
            .ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

impl Service {
    pub fn etcd() -> Option<Service> {
        let Some(bin) = find_binary("etcd") else {
            return missing("etcd (Debian package etcd-server)");
        };
        Some(Service::start(Kind::Etcd, bin, temp_dir("etcd")))
    }

    pub fn redis() -> Option<Service> {
        Service::redis_with(&[])
    }

    /// redis-server with extra arguments, e.g. `["--requirepass", "pw"]`. `ready` then
    /// accepts the NOAUTH answer too.
    pub fn redis_with(extra: &[&str]) -> Option<Service> {
        let Some(bin) = find_binary("redis-server") else {
            return missing("redis-server (Debian package redis-server)");
        };
        Some(Service::start_with(
            Kind::Redis,
            bin,
            temp_dir("redis"),
            extra,
        ))
    }

    /// Mooncake's Python HTTP metadata server from the venv of `KVFERRY_MOONCAKE_PYTHON`.
    pub fn mooncake_http() -> Option<Service> {
        let py = mooncake_python()?;
        let bin = Path::new(&py).with_file_name("mooncake_http_metadata_server");
        assert!(
            bin.is_file(),
            "{} is missing: the Mooncake venv lacks its HTTP metadata server",
            bin.display()
        );
        Some(Service::start(Kind::MooncakeHttp, bin, temp_dir("mchttp")))
    }

    fn start(kind: Kind, bin: PathBuf, dir: PathBuf) -> Service {
        Service::start_with(kind, bin, dir, &[])
    }

    fn start_with(kind: Kind, bin: PathBuf, dir: PathBuf, extra: &[&str]) -> Service {
        let mut last = String::new();
        let extra: Vec<String> = extra.iter().map(|a| a.to_string()).collect();
        for _ in 0..5 {
            let mut s = Service {
                kind,
                port: free_port(),
                peer_port: free_port(),
                dir: dir.clone(),
                bin: bin.clone(),
                extra: extra.clone(),
                child: None,
            };
            match s.spawn() {
                Ok(()) => return s,
                Err(e) => last = e,
            }
        }
        panic!("could not start {kind:?}: {last}");
    }

    fn spawn(&mut self) -> Result<(), String> {
        let (p, q) = (self.port, self.peer_port);
        let mut cmd = Command::new(&self.bin);
        match self.kind {
            Kind::Etcd => {
                let c = format!("http://127.0.0.1:{p}");
                let pe = format!("http://127.0.0.1:{q}");
                cmd.arg("--data-dir").arg(self.dir.join("data"));
                cmd.args([
                    "--listen-client-urls",
                    &c,
                    "--advertise-client-urls",
                    &c,
                    "--listen-peer-urls",
                    &pe,
                    "--initial-advertise-peer-urls",
                    &pe,
                ]);
                cmd.args([
                    "--initial-cluster",
                    &format!("default={pe}"),
                    "--log-level",
                    "error",
                ]);
            }
            Kind::Redis => {
                cmd.args([
                    "--port",
                    &p.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                ])
                .arg(&self.dir);
                cmd.args(&self.extra);
            }
            Kind::MooncakeHttp => {
                cmd.args([
                    "--host",
                    "127.0.0.1",
                    "--port",
                    &p.to_string(),
                    "--log-level",
                    "WARNING",
                ]);
            }
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("log"))
            .map_err(|e| e.to_string())?;
        let log2 = log.try_clone().map_err(|e| e.to_string())?;
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .process_group(0)
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", self.bin.display()))?;
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(Some(st)) = child.try_wait() {
                let log = std::fs::read_to_string(self.dir.join("log")).unwrap_or_default();
                return Err(format!(
                    "{:?} exited with {st}: {}",
                    self.kind,
                    log.chars()
                        .rev()
                        .take(2000)
                        .collect::<String>()
                        .chars()
                        .rev()
                        .collect::<String>()
                ));
            }
            if self.ready() {
                self.child = Some(child);
                return Ok(());
            }
            if Instant::now() > until {
                kill_group(&mut child);
                return Err(format!(
                    "{:?} did not become ready on port {p} within 20 s",
                    self.kind
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn ready(&self) -> bool {
        match self.kind {
            Kind::Etcd => {
                http_get(self.port, "/health").is_some_and(|r| r.contains("\"health\":\"true\""))
            }
            Kind::Redis => {
                let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) else {
                    return false;
                };
                let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
                let mut b = [0u8; 16];
                s.write_all(b"PING\r\n").is_ok()
                    && s.read(&mut b)
                        .map(|n| b[..n].starts_with(b"+PONG") || b[..n].starts_with(b"-NOAUTH"))
                        .unwrap_or(false)
            }
            Kind::MooncakeHttp => http_get(self.port, "/metadata?key=probe")
                .is_some_and(|r| r.starts_with("HTTP/1.1 404")),
        }
    }

    /// The connection string engines use.
    pub fn url(&self) -> String {
        match self.kind {
            Kind::Etcd => format!("etcd://127.0.0.1:{}", self.port),
            Kind::Redis => format!("redis://127.0.0.1:{}", self.port),
            Kind::MooncakeHttp => format!("http://127.0.0.1:{}/metadata", self.port),
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Kills the server (SIGKILL) and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            kill_group(&mut c);
        }
    }

    /// Starts it again on the same port; `wipe` removes its data first (etcd).
    pub fn restart(&mut self, wipe: bool) {
        self.stop();
        if wipe {
            let _ = std::fs::remove_dir_all(self.dir.join("data"));
        }
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            match self.spawn() {
                Ok(()) => return,
                Err(e) if Instant::now() > until => {
                    panic!("restarting {:?} on port {}: {e}", self.kind, self.port)
                }
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }
}

fn kill_group(c: &mut Child) {
    // SAFETY: signalling the process group we created for this child (its pid).
    unsafe { libc::kill(-(c.id() as i32), libc::SIGKILL) };
    let _ = c.kill();
    let _ = c.wait();
}

impl Drop for Service {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
