//! Descriptors: pointing a descriptor number at another open file (`dup3`, libc: rustix's
//! needs to own the target, and the callers only borrow it).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// Makes descriptor `fd` refer to what `to` refers to (close-on-exec), in place: the number
/// stays open and owned by whoever owns it; only what it refers to changes.
pub(crate) fn redirect(fd: BorrowedFd<'_>, to: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: dup3 only replaces what the descriptor number refers to; the number stays
    // open, so no other owner's descriptor is closed or its number reused.
    if unsafe { libc::dup3(to.as_raw_fd(), fd.as_raw_fd(), libc::O_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
