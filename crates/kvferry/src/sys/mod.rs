//! Every FFI and platform call of the engine, in one place (as mio's `sys/unix`): small safe
//! wrappers, each `unsafe` inside them with its SAFETY line, grouped by what they serve.
//! Outside this module no code names `libc::`, declares an `extern "C"` function or loads a
//! library (`crate::boundaries::platform_calls_and_ffi_live_in_sys_only`); the transports keep
//! their logic and call these wrappers.
//!
//! - [`mem`]: mappings (an owning [`mem::Mapping`]), `madvise` by named advice, hole punching,
//!   the page size.
//! - [`proc`]: pidfds, cross-memory attach (`process_vm_readv`/`writev`), the calling
//!   thread's scheduling policy; for tests, forking and reaping a child.
//! - [`fd`]: pointing a descriptor number elsewhere (`dup3`).
//! - [`net`]: what an `accept` error means.
//! - [`ibverbs`]: `libibverbs.so.1`, loaded at run time, its C layouts and the safe owners of
//!   its objects.
//! - [`cuda`]: `libcuda.so.1`, loaded at run time, and its driver-API table.
//!
//! rustix is used wherever it has the call (mappings, `madvise`, `fallocate`, `poll`, pidfds,
//! the page size, `waitpid`, `kill`, error numbers); libc remains only where rustix lacks it:
//! `process_vm_readv`/`process_vm_writev` and `sched_setscheduler` ([`proc`]), `dup3` onto a
//! descriptor this code does not own ([`fd`]: rustix's needs an owned target), `fork`/`_exit`
//! (test helpers in [`proc`]), and the error numbers of the verbs layer's explanations.
//! Safe rustix calls (memfds, `fstat`, sockets) are made where they are used: they need no
//! wrapper.

pub(crate) mod cuda;
pub(crate) mod fd;
pub(crate) mod ibverbs;
pub(crate) mod mem;
pub(crate) mod net;
pub(crate) mod proc;

pub(crate) use rustix::io::Errno;

/// The error number of an OS error, to match on by name (`Some(Errno::SRCH)`); `None` for
/// an error that carries none.
#[inline]
pub(crate) fn errno(e: &std::io::Error) -> Option<Errno> {
    e.raw_os_error().map(Errno::from_raw_os_error)
}
