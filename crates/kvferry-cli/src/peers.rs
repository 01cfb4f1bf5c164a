//! Processes of other programs that the benches start (Mooncake's `transfer_engine_bench`, its
//! store and metadata servers, a Python running its client): each in a process group of its
//! own, so that stopping the group stops a console script and the binary it runs, and each
//! bounded in time.
//!
//! A peer is never allowed to hang a bench: a run that overstays its bound is killed with its
//! group and reported as such, with what it printed so far. And a bench that is itself stopped
//! (SIGINT, SIGTERM, SIGHUP) first kills (SIGKILL) every peer group it still has, then exits with
//! 128 + the signal: their own process groups do not get the terminal's Ctrl-C, and nothing
//! else would reap them. (kvferry's own children need none of this: they exit when their stdin,
//! a pipe from the bench, closes.)

use rustix::process::{Pid, Signal};
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

/// Process groups (their leaders' pids) of the peers alive now; `stopping` once this process
/// was asked to stop (no peer is started after that).
struct Groups {
    pids: Vec<i32>,
    stopping: bool,
}

static GROUPS: Mutex<Groups> = Mutex::new(Groups {
    pids: Vec::new(),
    stopping: false,
});
static HANDLER: Once = Once::new();

fn groups() -> std::sync::MutexGuard<'static, Groups> {
    GROUPS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sends `sig` to the process group led by `pid` (one this process created for its child; an
/// error means the group is gone already).
fn signal_group(pid: i32, sig: Signal) {
    if let Some(pid) = Pid::from_raw(pid) {
        let _ = rustix::process::kill_process_group(pid, sig);
    }
}

/// Installs, once, the thread that kills the tracked groups when this process is asked to stop.
fn install_handler() {
    HANDLER.call_once(|| {
        use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
        let mut signals = match signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("kvferry: cannot watch SIGINT/SIGTERM ({e}); if this bench is stopped, its peer processes may be left running");
                return;
            }
        };
        let spawned = std::thread::Builder::new().name("kvf-peer-reaper".into()).spawn(move || {
            if let Some(sig) = signals.forever().next() {
                // Under the lock: no peer starts after this (the bench's threads go on until
                // the exit below, and must not leave a new one behind).
                let mut g = groups();
                g.stopping = true;
                for &p in &g.pids {
                    signal_group(p, Signal::KILL);
                }
                std::process::exit(128 + sig);
            }
        });
        if let Err(e) = spawned {
            eprintln!("kvferry: cannot start the peer reaper ({e}); if this bench is stopped, its peer processes may be left running");
        }
    });
}

/// A peer process in a group of its own, killed with its group when dropped.
pub struct Peer {
    pub child: Child,
    /// [`Peer::stop`] ran: the group is gone and its id no longer ours to signal.
    stopped: bool,
}

impl Peer {
    /// Spawns `cmd` as the leader of a new process group and tracks it.
    pub fn spawn(cmd: &mut Command) -> std::io::Result<Peer> {
        install_handler();
        let mut g = groups();
        if g.stopping {
            return Err(std::io::Error::other("this process is stopping"));
        }
        let child = cmd.process_group(0).spawn()?;
        g.pids.push(child.id() as i32);
        Ok(Peer {
            child,
            stopped: false,
        })
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Asks the group to stop (SIGTERM), waits up to `grace`, then kills it. Once: later
    /// calls (a drop after an explicit stop) do nothing.
    pub fn stop(&mut self, grace: Duration) {
        if std::mem::replace(&mut self.stopped, true) {
            return;
        }
        let pid = self.child.id() as i32;
        if let Ok(None) = self.child.try_wait() {
            signal_group(pid, Signal::TERM);
            let until = Instant::now() + grace;
            while Instant::now() < until {
                if let Ok(Some(_)) = self.child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        // The leader may be gone while a process it started is not: kill the group anyway (a
        // group id is not reused while any member lives).
        signal_group(pid, Signal::KILL);
        let _ = self.child.wait();
        groups().pids.retain(|&p| p != pid);
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(10));
    }
}

/// What a bounded run left.
pub struct Bounded {
    /// `None` when it was killed for overstaying.
    pub status: Option<ExitStatus>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

impl Bounded {
    pub fn timed_out(&self) -> bool {
        self.status.is_none()
    }
}

/// Runs `cmd` (stdin null, stdout and stderr captured) in a process group of its own for at
/// most `bound`; past it, the group is killed and what it printed so far is returned.
pub fn output_within(cmd: &mut Command, bound: Duration) -> std::io::Result<Bounded> {
    let mut p = Peer::spawn(
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    )?;
    let reader = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut v);
            }
            v
        })
    };
    let out = reader(
        p.child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
    );
    let err = reader(
        p.child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
    );
    let until = Instant::now() + bound;
    let status = loop {
        match p.child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(20)),
            _ => break None,
        }
    };
    // Also kills what the leader started and left behind (their pipes would keep the readers
    // waiting).
    p.stop(Duration::ZERO);
    Ok(Bounded {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_that_overstays_is_killed_with_what_it_started_and_keeps_its_output() {
        let t = Instant::now();
        // The shell starts a grandchild that would keep the pipe open; it dies with the group.
        let r = output_within(
            Command::new("sh").args(["-c", "echo started; sleep 30 & echo $! >&2; wait"]),
            Duration::from_millis(500),
        )
        .unwrap();
        assert!(r.timed_out());
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "took {:?}",
            t.elapsed()
        );
        assert_eq!(String::from_utf8_lossy(&r.stdout), "started\n");
        let grandchild: i32 = String::from_utf8_lossy(&r.stderr)
            .trim()
            .parse()
            .expect("the shell printed its child's pid");
        // Dead: gone, or a zombie waiting for whoever adopted it to reap it.
        let running = || {
            std::fs::read_to_string(format!("/proc/{grandchild}/stat"))
                .is_ok_and(|st| st.rsplit(") ").next().is_some_and(|f| !f.starts_with('Z')))
        };
        let alive = (0..100).all(|_| {
            running() && {
                std::thread::sleep(Duration::from_millis(20));
                true
            }
        });
        assert!(
            !alive,
            "the shell's own child {grandchild} outlived the bound"
        );
    }

    #[test]
    fn a_run_within_its_bound_returns_its_status_and_output() {
        let r = output_within(
            Command::new("sh").args(["-c", "echo out; exit 3"]),
            Duration::from_secs(20),
        )
        .unwrap();
        assert_eq!(r.status.and_then(|s| s.code()), Some(3));
        assert_eq!(r.stdout, b"out\n");
    }
}
