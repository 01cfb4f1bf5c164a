//! Peers that fork, come and go, or are killed: what they leave behind in a survivor.
//!
//! These tests count this process's threads, descriptors and CPU time, so they run one at a
//! time (a lock) and over TCP only (same-host shared memory has its own tests in shm*.rs).
//! Child processes are this test binary run again (`child_entry`, selected by
//! `KVFERRY_LIFECYCLE_CHILD`); each is killed by its pid or exits by itself, and is waited for.

use kvferry::TransportMode;
use kvferry::{Config, Opcode, TaskStatus, TransferEngine, TransferRequest};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

static ALONE: Mutex<()> = Mutex::new(());

fn alone() -> std::sync::MutexGuard<'static, ()> {
    ALONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// An engine on TCP whose lanes close after `idle`. Ports come from a wide range: a
/// thousand peers in the default 2000 ports would reuse the names (`host:port`) of departed
/// ones, which is another test's subject (a peer restarted under its old name).
fn engine(idle: Duration) -> TransferEngine {
    TransferEngine::new(Config {
        transfer_timeout: Duration::from_secs(5),
        transport: TransportMode::Tcp,
        tcp_idle: idle,
        min_port: 20000,
        max_port: 60000,
        ..Config::default()
    })
    .expect("engine starts")
}

fn req(op: Opcode, src: &[u8], target: u64, remote: u64, len: usize) -> TransferRequest {
    TransferRequest {
        opcode: op,
        source: src.as_ptr() as u64,
        target_id: target,
        target_offset: remote,
        length: len as u64,
    }
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| d.count())
        .unwrap_or(0)
}

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Waits until `f()` is true or `within` passed; returns how long it took, or None.
fn settles(within: Duration, mut f: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < within {
        if f() {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f().then(|| start.elapsed())
}

/// CPU time (user + system) of this process.
fn process_cpu() -> Duration {
    // SAFETY: getrusage fills the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
    };
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Waits up to 10 s for the forked child `pid` to exit; its exit code (`None`: killed by a
/// signal). A child still running then is killed (by its pid) and the test fails, naming what
/// it was doing.
fn wait_child(pid: libc::pid_t, doing: &str) -> Option<i32> {
    use rustix::process::{kill_process, waitpid, Pid, Signal, WaitOptions};
    let pid = Pid::from_raw(pid).expect("a child's pid");
    let mut status = None;
    let exited = settles(Duration::from_secs(10), || {
        status = waitpid(Some(pid), WaitOptions::NOHANG)
            .expect("waitpid")
            .map(|(_, s)| s);
        status.is_some()
    });
    if exited.is_none() {
        let _ = kill_process(pid, Signal::KILL);
        let _ = waitpid(Some(pid), WaitOptions::empty());
        panic!("the child hung {doing}");
    }
    status.and_then(|s| s.exit_status())
}

/// Two engines (`b` the target, `a` the initiator) and a 64 KiB buffer registered on each:
/// `b`'s filled with `dst_byte`, `a`'s with `src_byte`.
fn registered_pair(
    dst_byte: u8,
    src_byte: u8,
) -> (TransferEngine, TransferEngine, Vec<u8>, Vec<u8>) {
    let b = engine(Duration::from_secs(5));
    let a = engine(Duration::from_secs(5));
    let dst = vec![dst_byte; 1 << 16];
    let src = vec![src_byte; 1 << 16];
    b.register_memory(dst.as_ptr() as u64, dst.len() as u64, "*")
        .unwrap();
    a.register_memory(src.as_ptr() as u64, src.len() as u64, "*")
        .unwrap();
    (b, a, dst, src)
}

/// A fork() child that drops its copy of an engine and exits leaves the parent's engine
/// working: listeners open (no accept loop spinning), memory and data path intact.
#[test]
fn a_forked_child_dropping_the_engine_leaves_the_parent_alone() {
    let _alone = alone();
    let (b, a, dst, src) = registered_pair(0x5C, 0x3A);
    // SAFETY: the child only drops its copy of the engine and _exits.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        drop(b);
        unsafe { libc::_exit(0) };
    }
    assert_eq!(
        wait_child(pid, "dropping its copy of the engine"),
        Some(0),
        "the child's drop of its copy did not end cleanly"
    );
    assert!(
        dst.iter().all(|&x| x == 0x5C),
        "the child touched the parent's memory"
    );
    let cpu0 = process_cpu();
    std::thread::sleep(Duration::from_millis(500));
    let spent = process_cpu() - cpu0;
    assert!(
        spent < Duration::from_millis(200),
        "the parent burnt {spent:?} of CPU in 500 ms idle: an accept loop spins"
    );
    let seg = a
        .open_segment(b.segment_name())
        .expect("the parent's handshake port still answers");
    let st = a
        .transfer_sync(
            &[req(
                Opcode::Write,
                &src,
                seg,
                dst.as_ptr() as u64,
                src.len(),
            )],
            Duration::from_secs(5),
        )
        .unwrap();
    assert_eq!(st.status, TaskStatus::Completed, "{st:?}");
    // SAFETY: plain reads of a buffer the transfer finished with.
    assert!(dst
        .iter()
        .all(|&x| unsafe { std::ptr::read_volatile(&x) } == 0x3A));
}

/// Inodes of the TCP sockets (IPv4 and IPv6) with local port in `local` or remote port in
/// `remote`, from /proc/net/tcp*.
fn tcp_inodes(local: &[u16], remote: &[u16]) -> Vec<u64> {
    let port = |a: &str| {
        a.rsplit(':')
            .next()
            .and_then(|p| u16::from_str_radix(p, 16).ok())
    };
    let mut out = Vec::new();
    for f in ["/proc/net/tcp", "/proc/net/tcp6"] {
        for line in std::fs::read_to_string(f)
            .unwrap_or_default()
            .lines()
            .skip(1)
        {
            let w: Vec<&str> = line.split_whitespace().collect();
            if w.len() < 10 {
                continue;
            }
            let (l, r) = (port(w[1]), port(w[2]));
            if l.is_some_and(|l| local.contains(&l)) || r.is_some_and(|r| remote.contains(&r)) {
                out.extend(w[9].parse::<u64>().ok().filter(|&i| i != 0));
            }
        }
    }
    out
}

/// How many of this process's descriptors refer to a socket in `inodes`.
fn fds_on(inodes: &[u64]) -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter(|l| {
                    l.to_str()
                        .and_then(|s| {
                            s.strip_prefix("socket:[")?
                                .strip_suffix(']')?
                                .parse::<u64>()
                                .ok()
                        })
                        .is_some_and(|i| inodes.contains(&i))
                })
                .count()
        })
        .unwrap_or(0)
}

/// A fork() child's copies of two engines let go of the parent's sockets when dropped: its
/// listening sockets (so the parent's ports would refuse connections once the parent died,
/// even while the child lives on), the connection its data server serves and the lane's
/// connection to the peer. The parent's engines keep working.
#[test]
fn a_forked_childs_copy_lets_go_of_the_parents_sockets() {
    let _alone = alone();
    let (b, a, dst, src) = registered_pair(0, 0x6B);
    let seg = a.open_segment(b.segment_name()).unwrap();
    let st = a
        .transfer_sync(
            &[req(
                Opcode::Write,
                &src,
                seg,
                dst.as_ptr() as u64,
                src.len(),
            )],
            Duration::from_secs(5),
        )
        .unwrap();
    assert_eq!(st.status, TaskStatus::Completed, "{st:?}");
    // b's listeners and the connection it serves (local ports), a's lane (remote port).
    let ports = [b.data_port(), b.rpc_port(), a.data_port(), a.rpc_port()];
    let inodes = tcp_inodes(&ports, &[b.data_port()]);
    let held = fds_on(&inodes);
    assert!(held >= 5, "4 listeners and a connection's two ends are this process's: {held} descriptors on {inodes:?}");
    // SAFETY: the child only reads /proc, drops its copies of the engines and _exits.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let before = fds_on(&inodes);
        drop(a);
        drop(b);
        let after = fds_on(&inodes);
        eprintln!("forked child: {before} descriptors on the parent's sockets before dropping its engine copies, {after} after");
        unsafe { libc::_exit(if before == held && after == 0 { 0 } else { 1 }) };
    }
    let code = wait_child(pid, "dropping its copies of the engines");
    assert_eq!(code, Some(0), "the child still held the parent's sockets after dropping its copies (its line above says how many)");
    // The parent's engines are untouched: the same connection serves another write.
    let src2 = vec![0x2Eu8; 1 << 16];
    a.register_memory(src2.as_ptr() as u64, src2.len() as u64, "*")
        .unwrap();
    let st = a
        .transfer_sync(
            &[req(
                Opcode::Write,
                &src2,
                seg,
                dst.as_ptr() as u64,
                src2.len(),
            )],
            Duration::from_secs(5),
        )
        .unwrap();
    assert_eq!(st.status, TaskStatus::Completed, "{st:?}");
    // SAFETY: plain reads of a buffer the transfer finished with.
    assert!(dst
        .iter()
        .all(|&x| unsafe { std::ptr::read_volatile(&x) } == 0x2E));
    assert_eq!(
        fds_on(&inodes),
        held,
        "the parent's descriptors are all still its own"
    );
}

/// When the process runs out of descriptors, the data and handshake listeners back off
/// instead of spinning on `EMFILE` (connections wait in the backlog), and serve again once
/// descriptors are back.
#[test]
fn accept_loops_back_off_when_descriptors_run_out() {
    let _alone = alone();
    let a = engine(Duration::from_secs(5));
    let b = engine(Duration::from_secs(5));
    let src = vec![1u8; 4096];
    let dst = vec![0u8; 4096];
    a.register_memory(src.as_ptr() as u64, 4096, "*").unwrap();
    b.register_memory(dst.as_ptr() as u64, 4096, "*").unwrap();
    let seg = a.open_segment(b.segment_name()).unwrap();
    // SAFETY: getrlimit/setrlimit on this process's own limit, restored below.
    let mut lim: libc::rlimit = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    let low = libc::rlimit {
        rlim_cur: (fds() + 4) as libc::rlim_t,
        rlim_max: lim.rlim_max,
    };
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &low) }, 0);
    let mut conns = Vec::new();
    for port in [b.data_port(), b.rpc_port()].iter().cycle().take(40) {
        if let Ok(c) = std::net::TcpStream::connect(("127.0.0.1", *port)) {
            conns.push(c);
        }
    }
    // Both accept loops now meet EMFILE with connections waiting.
    std::thread::sleep(Duration::from_millis(100));
    let cpu0 = process_cpu();
    std::thread::sleep(Duration::from_millis(500));
    let spent = process_cpu() - cpu0;
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
    drop(conns);
    assert!(
        spent < Duration::from_millis(200),
        "{spent:?} of CPU in 500 ms out of descriptors: an accept loop spins"
    );
    let st = a
        .transfer_sync(
            &[req(Opcode::Write, &src, seg, dst.as_ptr() as u64, 4096)],
            Duration::from_secs(5),
        )
        .unwrap();
    assert_eq!(
        st.status,
        TaskStatus::Completed,
        "serves again once descriptors are back: {st:?}"
    );
}

/// Opening a segment connects its TCP lanes: the peer serves them before any request is
/// made, and the first request goes on them (it starts no thread and opens no connection).
#[test]
fn opening_a_segment_connects_its_lanes_before_the_first_request() {
    let _alone = alone();
    let idle = Duration::from_secs(60);
    let (a, b) = (engine(idle), engine(idle));
    let src = vec![5u8; 1 << 20];
    let dst = vec![0u8; 1 << 20];
    a.register_memory(src.as_ptr() as u64, src.len() as u64, "*")
        .unwrap();
    b.register_memory(dst.as_ptr() as u64, dst.len() as u64, "*")
        .unwrap();
    assert_eq!((a.tcp_usage(), b.tcp_usage()), ((0, 0), (0, 0)));
    let seg = a.open_segment(b.segment_name()).unwrap();
    let lanes = a.config().tcp_lanes;
    // (The handshake connection's serving thread may still be ending: threads settle too.)
    let mut last = usize::MAX;
    settles(Duration::from_secs(10), || {
        let (t, was) = (threads(), last);
        last = t;
        a.tcp_usage() == (1, 0) && b.tcp_usage() == (0, lanes) && t == was
    })
    .unwrap_or_else(|| {
        panic!(
            "after open_segment: lanes/conns {:?} -> {:?}, expected (1, 0) -> (0, {lanes})",
            a.tcp_usage(),
            b.tcp_usage()
        )
    });
    let before = threads();
    let st = a
        .transfer_sync(
            &[req(
                Opcode::Write,
                &src,
                seg,
                dst.as_ptr() as u64,
                src.len(),
            )],
            Duration::from_secs(5),
        )
        .unwrap();
    assert_eq!(st.status, TaskStatus::Completed, "{st:?}");
    assert_eq!(dst, src);
    assert_eq!(
        (a.tcp_usage(), b.tcp_usage()),
        ((1, 0), (0, lanes)),
        "the first request opened connections of its own"
    );
    assert!(
        threads() <= before,
        "the first request started threads: {before} -> {}",
        threads()
    );
}

/// 1000 peers come and go (20 alive at a time), each used once by a survivor: the
/// survivor's threads and descriptors come back to where they were within the lane idle
/// bound, and it holds no lane to any of them.
#[test]
fn departed_peers_leave_no_threads_or_descriptors() {
    let _alone = alone();
    let idle = Duration::from_millis(300);
    let a = engine(idle);
    let src = vec![7u8; 4096];
    a.register_memory(src.as_ptr() as u64, 4096, "*").unwrap();
    // Warm up (lazily started threads of the engine and the test harness).
    {
        let b = engine(idle);
        let dst = vec![0u8; 4096];
        b.register_memory(dst.as_ptr() as u64, 4096, "*").unwrap();
        let seg = a.open_segment(b.segment_name()).unwrap();
        assert_eq!(
            a.transfer_sync(
                &[req(Opcode::Write, &src, seg, dst.as_ptr() as u64, 4096)],
                Duration::from_secs(5)
            )
            .unwrap()
            .status,
            TaskStatus::Completed
        );
    }
    settles(Duration::from_secs(5), || a.tcp_usage() == (0, 0)).expect("warm-up lanes retire");
    let (t0, f0) = (threads(), fds());
    let start = Instant::now();
    let mut peak_threads = 0;
    for round in 0..50 {
        let peers: Vec<(TransferEngine, Vec<u8>)> = (0..20)
            .map(|_| {
                let b = engine(idle);
                let dst = vec![0u8; 4096];
                b.register_memory(dst.as_ptr() as u64, 4096, "*").unwrap();
                (b, dst)
            })
            .collect();
        for (b, dst) in &peers {
            let seg = a.open_segment(b.segment_name()).unwrap();
            let st = a
                .transfer_sync(
                    &[req(Opcode::Write, &src, seg, dst.as_ptr() as u64, 4096)],
                    Duration::from_secs(5),
                )
                .unwrap();
            assert_eq!(st.status, TaskStatus::Completed, "round {round}: {st:?}");
        }
        peak_threads = peak_threads.max(threads());
        drop(peers);
    }
    let churn = start.elapsed();
    let settled = settles(idle * 4 + Duration::from_secs(3), || {
        threads() <= t0 && fds() <= f0 && a.tcp_usage() == (0, 0)
    });
    eprintln!(
        "1000 peers in {churn:?}; threads {t0} -> peak {peak_threads} -> {}; fds {f0} -> {}; settled after {settled:?} (idle bound {idle:?})",
        threads(),
        fds()
    );
    assert!(
        settled.is_some(),
        "threads {t0} -> {}, fds {f0} -> {}, lanes/conns {:?}",
        threads(),
        fds(),
        a.tcp_usage()
    );
}

/// Child processes as peers, half of them SIGKILLed, half exiting by themselves: the
/// survivor releases their lanes within the idle bound.
#[test]
fn killed_peers_are_released_within_the_idle_bound() {
    let _alone = alone();
    let idle = Duration::from_millis(300);
    let a = engine(idle);
    let src = vec![9u8; 1 << 16];
    a.register_memory(src.as_ptr() as u64, src.len() as u64, "*")
        .unwrap();
    let (t0, f0) = (threads(), fds());
    let mut children: Vec<(Child, String, u64)> = (0..10).map(|_| spawn_child()).collect();
    for (_, name, addr) in &children {
        let seg = a.open_segment(name).unwrap();
        let st = a
            .transfer_sync(
                &[req(Opcode::Write, &src, seg, *addr, src.len())],
                Duration::from_secs(5),
            )
            .unwrap();
        assert_eq!(st.status, TaskStatus::Completed, "{st:?}");
    }
    let during = (threads(), fds());
    for (i, (c, _, _)) in children.iter_mut().enumerate() {
        if i % 2 == 0 {
            let _ = c.kill(); // SIGKILL
        } else {
            drop(c.stdin.take()); // the child exits when its stdin closes
        }
    }
    for (c, _, _) in children.iter_mut() {
        let _ = c.wait();
        drop(c.stdin.take());
    }
    let died = Instant::now();
    let settled = settles(idle * 4 + Duration::from_secs(3), || {
        threads() <= t0 && fds() <= f0 && a.tcp_usage() == (0, 0)
    });
    eprintln!(
        "10 child peers: threads {t0} -> {} -> {}, fds {f0} -> {} -> {}; released {:?} after the last died (idle bound {idle:?})",
        during.0,
        threads(),
        during.1,
        fds(),
        settled.map(|_| died.elapsed())
    );
    assert!(
        settled.is_some(),
        "threads {t0} -> {}, fds {f0} -> {}, lanes/conns {:?}",
        threads(),
        fds(),
        a.tcp_usage()
    );
}

/// Starts a child peer; returns it with its segment name and buffer address.
fn spawn_child() -> (Child, String, u64) {
    let exe = std::env::current_exe().unwrap();
    let mut c = Command::new(exe)
        .args(["child_entry", "--exact", "--nocapture", "--test-threads=1"])
        .env("KVFERRY_LIFECYCLE_CHILD", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let out = c.stdout.take().unwrap();
    let mut r = BufReader::new(out);
    while !line.contains("PEER ") {
        line.clear();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            let _ = c.kill();
            let _ = c.wait();
            panic!("child peer did not start");
        }
    }
    let mut parts = line[line.find("PEER ").unwrap_or(0)..]
        .split_whitespace()
        .skip(1);
    let name = parts.next().unwrap().to_string();
    let addr = parts.next().unwrap().parse().unwrap();
    (c, name, addr)
}

/// The child peer: an engine with a buffer; runs until its stdin closes (at most 30 s).
#[test]
fn child_entry() {
    if std::env::var_os("KVFERRY_LIFECYCLE_CHILD").is_none() {
        return;
    }
    let e = engine(Duration::from_secs(5));
    let buf = vec![0u8; 1 << 16];
    e.register_memory(buf.as_ptr() as u64, buf.len() as u64, "*")
        .unwrap();
    println!("PEER {} {}", e.segment_name(), buf.as_ptr() as u64);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::stdin().read_line(&mut s);
        let _ = tx.send(());
    });
    let _ = rx.recv_timeout(Duration::from_secs(30));
}
