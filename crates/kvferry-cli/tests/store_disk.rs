//! The disk tier end to end with real processes on 127.0.0.1: a `kvferry master
//! --enable_offload` and a `kvferry store-client --enable_offload` (Mooncake's command lines)
//! whose directory is killed mid-offload (SIGKILL), damaged, restarted on, and stalled
//! (SIGSTOP). A get returns the value it put or fails; never other bytes. Waits are polls of a
//! condition with a deadline, or a child's output.

mod common;
use kvferry_store::{Client, ClientConfig, Replica, ReplicateConfig, StoreError};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const KIB: usize = 1024;

struct Proc {
    child: Child,
    line: String,
}

impl Proc {
    fn start(cmd: &mut Command, tag: &str) -> Proc {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn kvferry");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        out.read_line(&mut line).expect("first line");
        assert!(line.starts_with(tag), "{tag} expected, got {line:?}");
        // (Its later lines are not read: it holds the pipe, and writes little.)
        std::mem::forget(out);
        Proc { child, line }
    }
    fn field(&self, key: &str) -> String {
        self.line
            .split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .expect("field")
            .to_string()
    }
    /// SIGKILL (this test's own child, by its pid), and reaped.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

fn store_client(master: &str, dir: &Path) -> Proc {
    Proc::start(
        common::kvferry()
            .args([
                "store-client",
                &format!("--master_server_address={master}"),
                "--global_segment_size=4MB",
                "--enable_offload",
                "--port=0",
            ])
            .env("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", dir)
            .env("MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS", "1"),
        "KVFERRY_STORE_CLIENT",
    )
}

fn value(key: &str, len: usize) -> Vec<u8> {
    let seed = xxhash_rust::xxh3::xxh3_64(key.as_bytes());
    (0..len)
        .map(|i| (seed.rotate_left((i % 64) as u32) as u8) ^ (i as u8))
        .collect()
}

fn wait_for<T>(what: &str, within: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let until = Instant::now() + within;
    loop {
        if let Some(t) = f() {
            return t;
        }
        assert!(Instant::now() < until, "{what} within {within:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every key reads back as put, or fails: the count of those read.
fn check_all(c: &Client, keys: &[String]) -> usize {
    let mut ok = 0;
    for k in keys {
        // (A failure is allowed: a value in the killed process's memory is gone.)
        if let Ok(v) = c.get(k) {
            assert_eq!(
                v,
                value(k, 256 * KIB),
                "{k}: other bytes than it was put with"
            );
            ok += 1;
        }
    }
    ok
}

/// A store-client is killed (SIGKILL) while the master hands it objects to persist, its
/// directory then gets a torn temporary file (what a kill mid-write leaves) and a truncated
/// record, and a new store-client starts on it: only whole records are served again (the
/// torn and the truncated are deleted, never read), every get returns the value put or
/// fails, and values on its disk are read back. Then the owner is stopped (SIGSTOP): a get of
/// its disk copy fails within the reader's bound instead of hanging.
#[test]
fn a_store_client_killed_mid_offload_serves_only_whole_records_after_its_restart() {
    let m = Proc::start(
        common::kvferry().args([
            "master",
            "--port",
            "0",
            "--metrics-port",
            "-1",
            "--summary-interval",
            "0",
            "--enable_offload=true",
            "--client-ttl",
            "30",
        ]),
        "KVFERRY_MASTER",
    );
    let master = m.field("rpc=");
    let dir = tempfile::tempdir().unwrap();
    let mut owner = store_client(&master, dir.path());
    let reader = Client::setup(ClientConfig {
        master_server_addr: master.clone(),
        global_segment_size: 0,
        local_buffer_size: 16 << 20,
        ssd_read_timeout: Duration::from_millis(500),
        transfer_timeout: Duration::from_secs(5),
        ..ClientConfig::default()
    })
    .unwrap();
    // 40 x 256 KiB through a 4 MiB pool: puts that need room hand objects to the disk.
    let keys: Vec<String> = (0..40).map(|i| format!("turn-{i:02}")).collect();
    for k in &keys[..24] {
        reader
            .put(k, &value(k, 256 * KIB), &ReplicateConfig::default())
            .unwrap();
    }
    let names: Vec<&str> = keys.iter().map(String::as_str).collect();
    let disk_copies = |c: &Client, at: Option<&str>| -> Vec<String> {
        keys.iter()
            .zip(c.batch_get_replicas(&names))
            .filter(|(_, r)| {
                matches!(r, Ok(v) if v.iter().any(|x| matches!(x, Replica::LocalDisk(d) if at.is_none_or(|a| d.endpoint == a))))
            })
            .map(|(k, _)| k.clone())
            .collect()
    };
    wait_for(
        "a copy on the disk named by the master",
        Duration::from_secs(20),
        || Some(()).filter(|_| !disk_copies(&reader, None).is_empty()),
    );
    // Killed while more puts hand it objects.
    let writer = {
        let (master, keys) = (master.clone(), keys[24..].to_vec());
        std::thread::spawn(move || {
            let c = Client::setup(ClientConfig {
                master_server_addr: master,
                global_segment_size: 0,
                local_buffer_size: 16 << 20,
                transfer_timeout: Duration::from_secs(5),
                ..ClientConfig::default()
            })
            .unwrap();
            for k in &keys {
                let _ = c.put(k, &value(k, 256 * KIB), &ReplicateConfig::default());
            }
        })
    };
    owner.kill();
    writer.join().unwrap();
    // What a kill in the middle of a write leaves, and a record the master names cut short.
    std::fs::write(dir.path().join("tmp").join("torn.0"), b"half a rec").unwrap();
    let named = disk_copies(&reader, None);
    let cut_key = &named[0];
    let h = format!("{:032x}", xxhash_rust::xxh3::xxh3_128(cut_key.as_bytes()));
    let cut = &dir
        .path()
        .join("objects")
        .join(&h[..2])
        .join(&h[2..4])
        .join(format!("{h}.kv"));
    let len = std::fs::metadata(cut).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(cut)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let owner = store_client(&master, dir.path());
    let seg = owner.field("segment=");
    assert!(
        !dir.path().join("tmp").join("torn.0").exists(),
        "the torn file was deleted at open"
    );
    assert!(!cut.exists(), "the truncated record was deleted at open");
    // The new client reports its records; the master names them at its address.
    let on_disk: Vec<String> = wait_for("records served again", Duration::from_secs(20), || {
        Some(disk_copies(&reader, Some(&seg))).filter(|v| !v.is_empty())
    });
    // The cut record is absent (its owner deleted it at open), and the master is told.
    if on_disk.contains(cut_key) {
        assert!(matches!(
            reader.get(cut_key),
            Err(StoreError::ObjectNotFound(_))
        ));
        wait_for(
            "the cut record no longer named",
            Duration::from_secs(20),
            || Some(()).filter(|_| !reader.is_exist(cut_key).unwrap()),
        );
    }
    let served: Vec<&String> = on_disk.iter().filter(|k| *k != cut_key).collect();
    assert!(!served.is_empty(), "{on_disk:?}");
    for k in &served {
        assert_eq!(
            reader.get(k).unwrap(),
            value(k, 256 * KIB),
            "{k} from the disk"
        );
    }
    assert!(check_all(&reader, &keys) >= served.len());
    // A stalled owner: the get fails within the reader's bound.
    common::pause(owner.child.id());
    let t = Instant::now();
    let e = reader.get(served[0]).unwrap_err();
    assert!(
        matches!(e, StoreError::TransferFailed(_)) && t.elapsed() < Duration::from_secs(5),
        "{e} after {:?}",
        t.elapsed()
    );
    let pid = rustix::process::Pid::from_raw(owner.child.id() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::CONT).unwrap();
}
