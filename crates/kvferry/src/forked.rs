//! What a `fork()` child does with the descriptors it inherited from the parent's engine.
//!
//! A child gets a copy of every descriptor: the engine's listening sockets, its connections
//! to peers and its shared-memory control region. Kept open, they outlive the parent: after
//! the parent dies, its ports still accept connections (into a backlog nobody serves, so a
//! peer learns of the death only at its deadline, not from a refused connect), and a
//! connection the parent closed is not closed for the peer while the child holds a copy. The
//! child's copy of the engine cannot use them anyway (the engine's threads do not exist in
//! it), so it lets go of them: [`detach`] points each such descriptor at `/dev/null` rather
//! than closing it, so the number stays taken by the value that owns it (which the child
//! never drops: see `TransferEngine::release_inherited`) and cannot be reused under it.

use std::os::fd::{AsFd, BorrowedFd};

/// Makes `fd` refer to `/dev/null` (close-on-exec) instead of what it referred to: this
/// process no longer holds that socket or file. Best effort (a failure leaves `fd` as it was).
pub(crate) fn detach(fd: BorrowedFd<'_>) {
    use rustix::fs::{Mode, OFlags};
    let Ok(null) = rustix::fs::open("/dev/null", OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())
    else {
        return;
    };
    // The number stays open and owned by the same value. Callers detach only descriptors of
    // an inherited engine copy that is never used again.
    let _ = crate::sys::fd::redirect(fd, null.as_fd());
}

/// The lock if it is free. In a `fork()` child a lock that a thread of the parent held at the
/// fork stays held forever (that thread does not exist here): waiting for it would hang, so
/// what it guards is left alone.
pub(crate) fn try_lock<T>(m: &std::sync::Mutex<T>) -> Option<std::sync::MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_detached_socket_is_released_and_its_number_stays_taken() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let raw = l.as_raw_fd();
        detach(l.as_fd());
        // The listening socket is gone (this was its only descriptor): connecting is refused.
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
            "the port still accepts"
        );
        // The number is still open, now on /dev/null, and close-on-exec.
        let link = std::fs::read_link(format!("/proc/self/fd/{raw}")).unwrap();
        assert_eq!(link, std::path::Path::new("/dev/null"));
        let flags = rustix::io::fcntl_getfd(l.as_fd()).unwrap();
        assert!(flags.contains(rustix::io::FdFlags::CLOEXEC));
        let mut f = std::fs::File::from(l.as_fd().try_clone_to_owned().unwrap());
        assert_eq!(f.read(&mut [0u8; 8]).unwrap(), 0, "reads as /dev/null");
    }
}
