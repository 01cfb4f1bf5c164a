//! Other processes and this one: pidfds (rustix), cross-memory attach
//! (`process_vm_readv`/`process_vm_writev`, libc: rustix lacks them), the calling thread's
//! scheduling policy (`sched_setscheduler`, libc: rustix lacks it); for tests, forking a
//! child (`fork`/`_exit`, libc) and reaping it (`waitpid`, `kill`: rustix).

use std::io;
use std::os::fd::OwnedFd;

/// A pidfd of process `pid` (Linux 5.3).
pub(crate) fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    let pid = rustix::process::Pid::from_raw(pid)
        .ok_or_else(|| io::Error::from(rustix::io::Errno::SRCH))?;
    Ok(rustix::process::pidfd_open(
        pid,
        rustix::process::PidfdFlags::empty(),
    )?)
}

/// A duplicate of descriptor `fd` of the process behind `pidfd` (Linux 5.6; ptrace access
/// needed).
pub(crate) fn pidfd_getfd(pidfd: &OwnedFd, fd: i32) -> io::Result<OwnedFd> {
    Ok(rustix::process::pidfd_getfd(
        pidfd,
        fd,
        rustix::process::PidfdGetfdFlags::empty(),
    )?)
}

/// Whether the process behind `pidfd` has exited (the pidfd polls readable then).
pub(crate) fn exited(pidfd: &OwnedFd) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let mut p = [PollFd::new(pidfd, PollFlags::IN)];
    match rustix::event::poll(
        &mut p,
        Some(&Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        }),
    ) {
        Ok(0) => false,
        Ok(_) => !p[0].revents().is_empty(),
        Err(_) => true,
    }
}

/// One range of a cross-memory copy (`struct iovec`), here or in the peer.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub(crate) struct IoVec(libc::iovec);

impl IoVec {
    /// `[addr, +len)`.
    #[inline]
    pub(crate) fn new(addr: u64, len: usize) -> IoVec {
        IoVec(libc::iovec {
            iov_base: addr as usize as *mut libc::c_void,
            iov_len: len,
        })
    }

    /// The range's length in bytes.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.0.iov_len
    }
}

/// Copies `remote` ranges of process `pid` into the `local` ranges of this one, in order
/// (`process_vm_readv`); the bytes moved (fewer on a partial copy).
///
/// # Safety
/// Every `local` range must be memory of this process valid for writes for its length, and
/// not read or written by anyone else during the call.
#[inline]
pub(crate) unsafe fn process_vm_readv(
    pid: i32,
    local: &[IoVec],
    remote: &[IoVec],
) -> io::Result<usize> {
    // SAFETY: `IoVec` is a transparent `iovec` and the slices are live for the call; the
    // kernel checks `remote` against the peer's address space; `local` as the caller promised.
    let n = unsafe {
        libc::process_vm_readv(
            pid,
            local.as_ptr().cast(),
            local.len() as _,
            remote.as_ptr().cast(),
            remote.len() as _,
            0,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Copies the `local` ranges of this process into `remote` ranges of process `pid`, in order
/// (`process_vm_writev`); the bytes moved (fewer on a partial copy).
///
/// # Safety
/// Every `local` range must be memory of this process valid for reads for its length, and
/// not written by anyone else during the call.
#[inline]
pub(crate) unsafe fn process_vm_writev(
    pid: i32,
    local: &[IoVec],
    remote: &[IoVec],
) -> io::Result<usize> {
    // SAFETY: as in `process_vm_readv`; `local` is only read, as the caller promised.
    let n = unsafe {
        libc::process_vm_writev(
            pid,
            local.as_ptr().cast(),
            local.len() as _,
            remote.as_ptr().cast(),
            remote.len() as _,
            0,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Runs the calling thread only when nothing else wants its core (`SCHED_IDLE`; lowering
/// one's own policy needs no privilege).
pub(crate) fn sched_idle() -> io::Result<()> {
    let idle = libc::sched_param { sched_priority: 0 };
    // SAFETY: sets the calling thread's policy (pid 0); `idle` outlives the call.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &idle) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Forks this process: `Some(child's pid)` in the parent, `None` in the child, which must
/// end with [`exit_now`].
///
/// # Safety
/// The child of a multi-threaded process may only do what is safe after `fork` there: drop
/// values and make system calls, taking no lock another thread may hold, then `exit_now`.
#[cfg(test)]
pub(crate) unsafe fn fork() -> Option<rustix::process::Pid> {
    // SAFETY: the caller keeps the child to what is safe after fork.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", io::Error::last_os_error());
    rustix::process::Pid::from_raw(pid)
}

/// Ends this (forked) process with `code` at once, running none of the exit handlers it
/// inherited (`_exit`).
#[cfg(test)]
pub(crate) fn exit_now(code: i32) -> ! {
    // SAFETY: `_exit` ends the process; nothing runs after it.
    unsafe { libc::_exit(code) }
}

/// Waits up to 10 s for child `pid` to end, and its exit code (`None` if a signal ended it);
/// a child still running then is killed (by pid), reaped, and the test fails.
#[cfg(test)]
pub(crate) fn wait_child(pid: rustix::process::Pid) -> Option<i32> {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    use rustix::process::{waitpid, Signal, WaitOptions};
    // The child's pidfd becomes readable when it exits: wait on that, not on a clock.
    let fd = pidfd_open(pid.as_raw_nonzero().get()).expect("pidfd_open of our own child");
    let mut fds = [PollFd::new(&fd, PollFlags::IN)];
    let ten_s = Timespec {
        tv_sec: 10,
        tv_nsec: 0,
    };
    let ready = poll(&mut fds, Some(&ten_s)).expect("poll on the child's pidfd");
    if ready == 0 {
        let _ = rustix::process::kill_process(pid, Signal::KILL);
        let _ = waitpid(Some(pid), WaitOptions::empty());
        panic!("forked child {pid:?} did not exit within 10 s");
    }
    let (_, status) = waitpid(Some(pid), WaitOptions::empty())
        .expect("waitpid")
        .expect("an exited child has a status");
    status.exit_status()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cross_memory_attach_reads_and_writes_this_process() {
        let pid = std::process::id() as i32;
        let src = *b"kvferry";
        let mut dst = [0u8; 7];
        let l = [IoVec::new(dst.as_mut_ptr() as u64, dst.len())];
        let r = [IoVec::new(src.as_ptr() as u64, src.len())];
        // SAFETY: `dst` is ours, written only by this call.
        let n = unsafe { process_vm_readv(pid, &l, &r) };
        match n {
            Ok(n) => assert_eq!((n, &dst), (7, b"kvferry")),
            // A seccomp profile may deny it; the transport then falls back to TCP.
            Err(e) => assert_eq!(crate::sys::errno(&e), Some(rustix::io::Errno::PERM), "{e}"),
        }
        let mut back = [0u8; 7];
        let l = [IoVec::new(src.as_ptr() as u64, 7)];
        let r = [IoVec::new(back.as_mut_ptr() as u64, 7)];
        // SAFETY: `src` is only read.
        if unsafe { process_vm_writev(pid, &l, &r) }.is_ok() {
            assert_eq!(&back, b"kvferry");
        }
    }

    #[test]
    fn a_pidfd_sees_its_child_exit() {
        let me = pidfd_open(std::process::id() as i32).unwrap();
        assert!(!exited(&me));
        assert!(pidfd_open(0).is_err());
        let (rx, tx) = rustix::pipe::pipe().unwrap();
        // SAFETY: the child reads a pipe and exits.
        let Some(pid) = (unsafe { fork() }) else {
            let mut b = [0u8; 1];
            let _ = rustix::io::read(&rx, &mut b); // until the parent says go
            exit_now(0)
        };
        let fd = pidfd_open(pid.as_raw_nonzero().get()).unwrap();
        assert!(!exited(&fd), "the child waits for the parent's byte");
        rustix::io::write(&tx, b"g").unwrap();
        assert_eq!(wait_child(pid), Some(0));
        assert!(exited(&fd));
    }
}
