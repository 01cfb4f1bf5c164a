//! Cross-memory attach as the same-host transport uses it (the calls themselves are
//! `crate::sys::proc`'s): the ptrace policy and what a refusal means, the test hook that
//! denies it; and the transport's fork detection and clock.

pub(super) use crate::sys::proc::{exited, pidfd_getfd, pidfd_open, IoVec};
use crate::sys::proc::{process_vm_readv, process_vm_writev};
pub(super) use crate::sys::{errno, Errno};
use crate::wire::tcp::Opcode;
use std::io;
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

/// Whether this process is a child forked from the one that created a value (`home`): it
/// then holds copies of the creator's descriptors but none of its shared mappings (they
/// are `MADV_DONTFORK`), and must not act on the creator's behalf (no `closed` mark, no
/// slot changes, no `munmap` of ranges that in the child are not ours).
pub(super) fn foreign(home: u32) -> bool {
    std::process::id() != home
}

/// One cross-memory copy of matching local and remote iovecs. Returns bytes moved.
pub(super) fn cma(pid: i32, op: Opcode, local: &[IoVec], remote: &[IoVec]) -> io::Result<usize> {
    if FORCE_DENIED.load(Ordering::Relaxed) {
        return Err(io::Error::from(Errno::PERM));
    }
    // SAFETY: the local iovecs lie in memory registered with this engine (guards held), the
    // piece's own range, which nothing else touches during its copy; the kernel checks the
    // remote ones against the peer's address space and never faults us.
    unsafe {
        match op {
            Opcode::Write => process_vm_writev(pid, local, remote),
            Opcode::Read => process_vm_readv(pid, local, remote),
        }
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
