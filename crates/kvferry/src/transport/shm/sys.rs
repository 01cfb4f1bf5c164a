//! System calls of the same-host transport: pidfds, cross-memory attach, fork detection.

use crate::wire::tcp::Opcode;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// `kernel.yama.ptrace_scope`, if Yama is present.
pub fn ptrace_scope() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

/// Explains a refusal by the kernel's ptrace access rules.
pub(super) fn not_permitted(pid: i32, what: &str, e: &io::Error) -> String {
    let yama = match ptrace_scope() {
        Some(1) => "; kernel.yama.ptrace_scope=1 allows it only towards descendant processes: set it to 0 (sysctl kernel.yama.ptrace_scope=0) or give the initiator CAP_SYS_PTRACE",
        Some(2) => "; kernel.yama.ptrace_scope=2 allows it only with CAP_SYS_PTRACE",
        Some(3) => "; kernel.yama.ptrace_scope=3 forbids it entirely",
        _ => "",
    };
    format!(
        "{what} process {pid} is not permitted ({e}): cross-memory attach needs the same user and a dumpable peer, or CAP_SYS_PTRACE; a container's seccomp profile may also block it{yama}"
    )
}

pub(super) fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    let pid = rustix::process::Pid::from_raw(pid)
        .ok_or_else(|| io::Error::from_raw_os_error(libc::ESRCH))?;
    Ok(rustix::process::pidfd_open(
        pid,
        rustix::process::PidfdFlags::empty(),
    )?)
}

pub(super) fn pidfd_getfd(pidfd: &OwnedFd, fd: i32) -> io::Result<OwnedFd> {
    Ok(rustix::process::pidfd_getfd(
        pidfd,
        fd,
        rustix::process::PidfdGetfdFlags::empty(),
    )?)
}

/// Whether the process behind `pidfd` has exited (the pidfd polls readable then).
pub(super) fn exited(pidfd: &OwnedFd) -> bool {
    use rustix::event::{PollFd, PollFlags};
    let mut p = [PollFd::new(pidfd, PollFlags::IN)];
    match rustix::event::poll(
        &mut p,
        Some(&rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        }),
    ) {
        Ok(0) => false,
        Ok(_) => !p[0].revents().is_empty(),
        Err(_) => true,
    }
}

/// Whether this process is a child forked from the one that created a value (`home`): it
/// then holds copies of the creator's descriptors but none of its shared mappings (they
/// are `MADV_DONTFORK`), and must not act on the creator's behalf (no `closed` mark, no
/// slot changes, no `munmap` of ranges that in the child are not ours).
pub(super) fn foreign(home: u32) -> bool {
    std::process::id() != home
}

/// Marks a mapping not to be inherited by child processes.
pub(super) fn dontfork(ptr: *mut u8, len: usize) {
    // SAFETY: advising our own mapping; no memory is touched.
    if unsafe { libc::madvise(ptr as *mut libc::c_void, len, libc::MADV_DONTFORK) } != 0 {
        tracing::debug!(
            "madvise(MADV_DONTFORK) failed: {}",
            io::Error::last_os_error()
        );
    }
}

/// One cross-memory copy of matching local and remote iovecs. Returns bytes moved.
pub(super) fn cma(
    pid: i32,
    op: Opcode,
    local: &[libc::iovec],
    remote: &[libc::iovec],
) -> io::Result<usize> {
    if FORCE_DENIED.load(Ordering::Relaxed) {
        return Err(io::Error::from_raw_os_error(libc::EPERM));
    }
    // SAFETY: the local iovecs lie in memory registered with this engine (guards held); the
    // kernel checks the remote ones against the peer's address space and never faults us.
    let n = unsafe {
        match op {
            Opcode::Write => libc::process_vm_writev(
                pid,
                local.as_ptr(),
                local.len() as _,
                remote.as_ptr(),
                remote.len() as _,
                0,
            ),
            Opcode::Read => libc::process_vm_readv(
                pid,
                local.as_ptr(),
                local.len() as _,
                remote.as_ptr(),
                remote.len() as _,
                0,
            ),
        }
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

pub(super) static FORCE_DENIED: AtomicBool = AtomicBool::new(false);

/// Test hook: makes every cross-memory call of this process fail with EPERM, as under a
/// restrictive ptrace policy, so the TCP fallback can be exercised without one.
#[cfg(feature = "test-hooks")]
pub fn simulate_cma_denied(on: bool) {
    FORCE_DENIED.store(on, Ordering::Relaxed);
}

/// Monotonic nanoseconds since the first call.
pub(super) fn now_ns() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    BASE.get_or_init(Instant::now).elapsed().as_nanos() as u64
}
