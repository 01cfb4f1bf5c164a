//! What an `accept` error means, by its error number: the listener is gone, or resources ran
//! out (both listeners, data and handshake, decide so).

use super::{errno, Errno};
use std::io;

/// Whether an `accept` error means the listener itself is gone (shut down, closed).
#[inline]
pub(crate) fn listener_gone(e: &io::Error) -> bool {
    matches!(errno(e), Some(Errno::INVAL | Errno::BADF | Errno::NOTSOCK))
}

/// Whether an `accept` error means descriptors or memory ran out (back off instead of
/// spinning).
#[inline]
pub(crate) fn out_of_resources(e: &io::Error) -> bool {
    matches!(
        errno(e),
        Some(Errno::MFILE | Errno::NFILE | Errno::NOBUFS | Errno::NOMEM)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_errors_are_told_apart_by_number() {
        let e = |n: Errno| io::Error::from(n);
        assert!(listener_gone(&e(Errno::BADF)) && !out_of_resources(&e(Errno::BADF)));
        assert!(out_of_resources(&e(Errno::MFILE)) && !listener_gone(&e(Errno::MFILE)));
        assert!(!listener_gone(&e(Errno::AGAIN)) && !out_of_resources(&e(Errno::AGAIN)));
        let other = io::Error::other("no number");
        assert!(!listener_gone(&other) && !out_of_resources(&other));
    }
}
