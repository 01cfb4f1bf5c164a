//! Raw-memory helpers: copies that cannot crash the interpreter, and page-aligned buffers.
//!
//! Mooncake's `write_bytes_to_buffer`/`read_bytes_from_buffer` `memcpy` to and from any
//! integer address, so a wrong address kills the process. Here the copy goes through
//! `process_vm_writev`/`process_vm_readv` on our own pid: the kernel checks the range and
//! answers EFAULT instead of delivering SIGSEGV. Where those calls are unavailable (seccomp
//! profiles that deny them), the caller falls back to a plain copy inside registered memory.

use kvferry::hostbuf::{HostBuffer, HostOptions};
use std::io;

/// Why a copy did not happen.
#[derive(Debug)]
pub enum CopyError {
    /// Part of the range is not mapped (or not writable) in this process.
    Fault(String),
    /// The kernel refuses `process_vm_*` here; only a plain copy is possible.
    Unsupported(io::Error),
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

fn classify(err: io::Error, what: &str, addr: u64, len: usize) -> CopyError {
    match err.raw_os_error() {
        Some(libc::EFAULT) => CopyError::Fault(format!(
            "cannot {what} [0x{addr:x}, +{len}): the range is not mapped {} in this process",
            if what == "write" {
                "writable"
            } else {
                "readable"
            }
        )),
        _ => CopyError::Unsupported(err),
    }
}

/// Copies `data` to the absolute address `addr` of this process.
pub fn write_checked(addr: u64, data: &[u8]) -> Result<(), CopyError> {
    let mut done = 0usize;
    while done < data.len() {
        let local = libc::iovec {
            iov_base: data[done..].as_ptr() as *mut libc::c_void,
            iov_len: data.len() - done,
        };
        let remote = libc::iovec {
            iov_base: (addr as usize + done) as *mut libc::c_void,
            iov_len: data.len() - done,
        };
        // SAFETY: the kernel validates the remote range; the local iovec points into `data`.
        let n = unsafe { libc::process_vm_writev(libc::getpid(), &local, 1, &remote, 1, 0) };
        if n < 0 {
            return Err(classify(
                io::Error::last_os_error(),
                "write",
                addr,
                data.len(),
            ));
        }
        if n == 0 {
            return Err(CopyError::Fault(format!(
                "cannot write [0x{addr:x}, +{}): nothing was written",
                data.len()
            )));
        }
        done += n as usize;
    }
    Ok(())
}

/// Copies `len` bytes from the absolute address `addr` of this process into `out`.
pub fn read_checked(addr: u64, out: &mut [u8]) -> Result<(), CopyError> {
    let len = out.len();
    let mut done = 0usize;
    while done < len {
        let local = libc::iovec {
            iov_base: out[done..].as_mut_ptr() as *mut libc::c_void,
            iov_len: len - done,
        };
        let remote = libc::iovec {
            iov_base: (addr as usize + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: the kernel validates the remote range; the local iovec points into `out`.
        let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
        if n < 0 {
            return Err(classify(io::Error::last_os_error(), "read", addr, len));
        }
        if n == 0 {
            return Err(CopyError::Fault(format!(
                "cannot read [0x{addr:x}, +{len}): nothing was read"
            )));
        }
        done += n as usize;
    }
    Ok(())
}

/// A page-aligned, zero-filled buffer from kvferry's allocator: memfd-backed, so a same-host
/// kvferry peer maps it and copies with `memcpy` (see `kvferry::hostbuf`).
pub struct Pages {
    pub addr: u64,
    pub len: usize,
    _buf: HostBuffer,
}

impl std::fmt::Debug for Pages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pages {{ addr: 0x{:x}, len: {} }}", self.addr, self.len)
    }
}

impl Pages {
    /// Maps at least `len` bytes (at least one page).
    pub fn map(len: u64) -> Result<Pages, String> {
        let page = page_size() as u64;
        let rounded = len
            .max(1)
            .checked_add(page - 1)
            .map(|v| v / page * page)
            .filter(|&v| v <= isize::MAX as u64)
            .ok_or_else(|| format!("cannot allocate {len} bytes: the size is too large"))?;
        let buf = HostBuffer::with(
            rounded as usize,
            HostOptions {
                populate: false,
                huge_pages: false,
                shareable: true,
            },
        )
        .map_err(|e| format!("cannot allocate {len} bytes: {e}"))?;
        Ok(Pages {
            addr: buf.addr(),
            len: buf.len(),
            _buf: buf,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checked_copies_and_faults() {
        let p = Pages::map(10).unwrap();
        assert_eq!(p.len % page_size(), 0);
        assert_eq!(p.addr as usize % page_size(), 0);
        assert!(
            kvferry::hostbuf::shareable_region(p.addr, p.len as u64).is_some(),
            "managed buffers are shareable"
        );
        write_checked(p.addr, b"hello").unwrap();
        let mut out = [0u8; 5];
        read_checked(p.addr, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        // Address 8 is never mapped.
        assert!(matches!(write_checked(8, b"x"), Err(CopyError::Fault(_))));
        assert!(matches!(
            read_checked(8, &mut out),
            Err(CopyError::Fault(_))
        ));
        assert!(Pages::map(u64::MAX).is_err());
    }
}
