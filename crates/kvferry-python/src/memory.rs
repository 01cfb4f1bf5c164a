//! Raw-memory helpers: copies that cannot crash the interpreter, and page-aligned buffers.
//!
//! Mooncake's `write_bytes_to_buffer`/`read_bytes_from_buffer` `memcpy` to and from any
//! integer address, so a wrong address kills the process. Here the copy goes through
//! `process_vm_writev`/`process_vm_readv` on our own pid: the kernel checks the range and
//! answers EFAULT instead of delivering SIGSEGV. Where those calls are unavailable (seccomp
//! profiles that deny them), the caller falls back to a plain copy inside registered memory.

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
            if what == "write" { "writable" } else { "readable" }
        )),
        _ => CopyError::Unsupported(err),
    }
}

/// Copies `data` to the absolute address `addr` of this process.
pub fn write_checked(addr: u64, data: &[u8]) -> Result<(), CopyError> {
    let mut done = 0usize;
    while done < data.len() {
        let local = libc::iovec { iov_base: data[done..].as_ptr() as *mut libc::c_void, iov_len: data.len() - done };
        let remote = libc::iovec { iov_base: (addr as usize + done) as *mut libc::c_void, iov_len: data.len() - done };
        // SAFETY: the kernel validates the remote range; the local iovec points into `data`.
        let n = unsafe { libc::process_vm_writev(libc::getpid(), &local, 1, &remote, 1, 0) };
        if n < 0 {
            return Err(classify(io::Error::last_os_error(), "write", addr, data.len()));
        }
        if n == 0 {
            return Err(CopyError::Fault(format!("cannot write [0x{addr:x}, +{}): nothing was written", data.len())));
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
        let local = libc::iovec { iov_base: out[done..].as_mut_ptr() as *mut libc::c_void, iov_len: len - done };
        let remote = libc::iovec { iov_base: (addr as usize + done) as *mut libc::c_void, iov_len: len - done };
        // SAFETY: the kernel validates the remote range; the local iovec points into `out`.
        let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
        if n < 0 {
            return Err(classify(io::Error::last_os_error(), "read", addr, len));
        }
        if n == 0 {
            return Err(CopyError::Fault(format!("cannot read [0x{addr:x}, +{len}): nothing was read")));
        }
        done += n as usize;
    }
    Ok(())
}

/// An anonymous, page-aligned, zero-filled mapping.
#[derive(Debug)]
pub struct Pages {
    pub addr: u64,
    pub len: usize,
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
        // SAFETY: an anonymous private mapping at a kernel-chosen address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                rounded as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(format!("cannot allocate {len} bytes: mmap failed: {}", io::Error::last_os_error()));
        }
        Ok(Pages { addr: p as u64, len: rounded as usize })
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        // SAFETY: the mapping was created by `Pages::map` and is unmapped once.
        unsafe {
            libc::munmap(self.addr as *mut libc::c_void, self.len);
        }
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
        write_checked(p.addr, b"hello").unwrap();
        let mut out = [0u8; 5];
        read_checked(p.addr, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        // Address 8 is never mapped.
        assert!(matches!(write_checked(8, b"x"), Err(CopyError::Fault(_))));
        assert!(matches!(read_checked(8, &mut out), Err(CopyError::Fault(_))));
        assert!(Pages::map(u64::MAX).is_err());
    }
}
