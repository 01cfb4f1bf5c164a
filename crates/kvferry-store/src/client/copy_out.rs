//! Copying values out of the local buffer into memory just allocated for them: what the
//! bytes API's `get` returns (`Vec`s here, `bytes` objects in the Python binding). Such memory
//! is usually fresh from the kernel (glibc hands large freed blocks back), so the pages are
//! faulted in with one system call per range instead of a fault per page, and a large call's
//! bytes are split among threads: faulting and copying is most of such a `get`'s time, and it
//! scales with the CPUs. Nothing here talks to the master or moves bytes between hosts.

use std::mem::MaybeUninit;
use std::sync::{Mutex, OnceLock};

/// One value's copy: its bytes and the memory they go to (as long; fresh memory, written
/// only by this copy).
pub struct FreshCopy<'a> {
    src: &'a [u8],
    dst: &'a mut [MaybeUninit<u8>],
}

impl<'a> FreshCopy<'a> {
    /// `src` into `dst`, memory not yet initialised (a `Vec`'s spare capacity, a new
    /// object's storage). Copies `min(src.len(), dst.len())` bytes.
    pub fn uninit(src: &'a [u8], dst: &'a mut [MaybeUninit<u8>]) -> FreshCopy<'a> {
        let n = src.len().min(dst.len());
        FreshCopy {
            src: &src[..n],
            dst: &mut dst[..n],
        }
    }

    /// `src` into `dst`. Copies `min(src.len(), dst.len())` bytes.
    pub fn new(src: &'a [u8], dst: &'a mut [u8]) -> FreshCopy<'a> {
        // SAFETY: `MaybeUninit<u8>` has `u8`'s layout, and the copy writes only initialised
        // bytes, so `dst` stays valid `[u8]` for its owner.
        let dst = unsafe { &mut *(dst as *mut [u8] as *mut [MaybeUninit<u8>]) };
        FreshCopy::uninit(src, dst)
    }
}

/// Bytes of a call per thread it copies with: a call of less copies in the caller's thread.
/// (A thread costs tens of µs to start, and on a busy host it may wait milliseconds for a
/// CPU: measured here at a load of 9 on 2 vCPUs, two threads gained nothing on 16 or 32 MiB
/// and ~20% on 128 MiB.)
const PER_THREAD: usize = 32 << 20;
/// Below this many bytes in all a call copies in the caller's thread.
const SPLIT_FROM: usize = 2 * PER_THREAD;
/// The most bytes of one piece a thread takes at a time; pieces end on multiples of this in
/// the destination's addresses (whole pages: two threads never fault the same one).
const PIECE: usize = 4 << 20;
/// The most threads one call copies with (its own included).
const MAX_THREADS: usize = 8;

/// Copies every `(src, dst)` pair, faulting each destination's pages in first
/// (`prefault_fresh`). A call of 64 MiB or more in all is cut into pieces of up to 4 MiB
/// that a thread per 32 MiB (at most one per CPU, and 8) copy. When it returns every byte
/// is copied.
pub fn copy_fresh(copies: Vec<FreshCopy<'_>>) {
    let total: usize = copies.iter().map(|c| c.src.len()).sum();
    let threads = if total >= SPLIT_FROM {
        cpus().min(MAX_THREADS).min(total / PER_THREAD)
    } else {
        1
    };
    if threads <= 1 {
        for c in copies {
            copy_piece(c.src, c.dst, c.src.len() >= POPULATE_FROM);
        }
        return;
    }
    // Pieces: each value cut where its destination crosses a multiple of PIECE.
    let mut pieces: Vec<Piece<'_>> = Vec::new();
    for c in copies {
        let populate = c.src.len() >= POPULATE_FROM;
        let (mut src, mut dst) = (c.src, c.dst);
        while !src.is_empty() {
            let addr = dst.as_ptr() as usize;
            let to_boundary = PIECE - addr % PIECE;
            let n = to_boundary.min(src.len());
            let (s, s_rest) = src.split_at(n);
            let (d, d_rest) = std::mem::take(&mut dst).split_at_mut(n);
            pieces.push((s, d, populate));
            (src, dst) = (s_rest, d_rest);
        }
    }
    // Taken from the end: the last values' pieces first, whatever the order.
    let queue = Mutex::new(pieces);
    let work = || loop {
        let next = queue.lock().unwrap_or_else(|e| e.into_inner()).pop();
        match next {
            Some((s, d, populate)) => copy_piece(s, d, populate),
            None => break,
        }
    };
    std::thread::scope(|scope| {
        for _ in 1..threads {
            // A thread that cannot start leaves its share to the others (the caller's
            // thread below takes whatever is left).
            if std::thread::Builder::new()
                .name("kvferry-copy".into())
                .spawn_scoped(scope, work)
                .is_err()
            {
                break;
            }
        }
        work();
    });
}

/// Part of one value's copy: its bytes, where they go, whether to fault that in first.
type Piece<'a> = (&'a [u8], &'a mut [MaybeUninit<u8>], bool);

/// CPUs this process may run on, asked once.
fn cpus() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Values this large have their pages faulted in before the copy.
const POPULATE_FROM: usize = 256 << 10;
const PAGE: usize = 4096;

/// Copies `src` into `dst` (as long), faulting `dst`'s whole pages in first when `populate`.
fn copy_piece(src: &[u8], dst: &mut [MaybeUninit<u8>], populate: bool) {
    if populate {
        prefault_fresh(dst);
    }
    let n = src.len().min(dst.len());
    // SAFETY: `src` and `dst` are live slices of at least `n` bytes; `dst` is borrowed
    // mutably, so they do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast::<u8>(), n) };
}

/// Faults in the whole pages of `dst`, memory just allocated for a copy, in one system call
/// instead of a page fault per 4 KiB page on first write (on a VM each costs more than
/// copying the page): `MADV_POPULATE_WRITE`. Measured here: 32 x 1 MiB into fresh `Vec`s
/// 28 -> 13 ms. No transparent huge pages are asked for (`MADV_HUGEPAGE`): on this project's
/// VM they made a call's fresh memory come from blocks the host had to fault in again, and
/// `get` of 32 x 16 MiB (glibc's default thresholds) ran at 0.2-0.3 GB/s with them against
/// 0.7-1.1 without. A failure is ignored: the copy then faults the pages as before.
fn prefault_fresh(dst: &mut [MaybeUninit<u8>]) {
    let start = dst.as_mut_ptr() as usize;
    let (a, e) = (
        (start + PAGE - 1) & !(PAGE - 1),
        (start + dst.len()) & !(PAGE - 1),
    );
    if e > a {
        // SAFETY: inside `dst`, borrowed mutably; populating only faults pages in (a page
        // not yet present becomes a zero page, as a first write of zeros would make it; its
        // bytes were uninitialised or are about to be overwritten by the copy).
        let _ = unsafe {
            rustix::mm::madvise(
                a as *mut std::ffi::c_void,
                e - a,
                rustix::mm::Advice::LinuxPopulateWrite,
            )
        };
    }
}

/// New `Vec`s holding copies of `srcs`, allocated here and filled by [`copy_fresh`].
pub(crate) fn to_vecs(srcs: &[&[u8]]) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = srcs.iter().map(|s| Vec::with_capacity(s.len())).collect();
    copy_fresh(
        srcs.iter()
            .zip(out.iter_mut())
            .map(|(s, v)| FreshCopy::uninit(s, v.spare_capacity_mut()))
            .collect(),
    );
    for (s, v) in srcs.iter().zip(out.iter_mut()) {
        // SAFETY: `copy_fresh` returned: the first `s.len()` bytes of `v`'s capacity (at
        // least that, allocated above) are initialised, copied from `s`.
        unsafe { v.set_len(s.len()) };
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(seed: u8, n: usize) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u64 * 31 + seed as u64 * 7 + (i >> 12) as u64) as u8)
            .collect()
    }

    /// Values of every size class (empty, under a page, unaligned, over the split and piece
    /// sizes, several pieces of one value) come out byte for byte, serially and split.
    #[test]
    fn copies_are_exact_whatever_their_sizes_and_split() {
        let sizes = [
            0,
            1,
            4095,
            4097,
            (256 << 10) + 3,
            (4 << 20) - 1,
            (4 << 20) + 4097,
            (9 << 20) + 13,
            1 << 20,
            (48 << 20) + 7,
        ];
        let srcs: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| pattern(i as u8, n))
            .collect();
        let refs: Vec<&[u8]> = srcs.iter().map(Vec::as_slice).collect();
        // Together: over SPLIT_FROM, split among threads where there are CPUs.
        assert!(sizes.iter().sum::<usize>() >= SPLIT_FROM);
        let out = to_vecs(&refs);
        assert_eq!(out.len(), srcs.len());
        for (i, (o, s)) in out.iter().zip(&srcs).enumerate() {
            assert!(o == s, "value {i} ({} bytes) differs", s.len());
        }
        // One by one: each under SPLIT_FROM is copied in the caller's thread.
        for (i, s) in refs.iter().enumerate() {
            assert!(to_vecs(&[*s])[0] == *s, "value {i} alone differs");
        }
        // Into initialised memory (a `bytearray`'s storage): every byte overwritten.
        let mut dsts: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0xAA; n]).collect();
        copy_fresh(
            refs.iter()
                .zip(dsts.iter_mut())
                .map(|(s, d)| FreshCopy::new(s, d))
                .collect(),
        );
        assert!(dsts == srcs);
    }

    /// A destination longer or shorter than its source gets the common length, no more.
    #[test]
    fn a_copy_takes_the_shorter_of_source_and_destination() {
        let src = pattern(3, 10_000);
        let mut long = vec![0u8; 12_000];
        let mut short = vec![0u8; 5_000];
        copy_fresh(vec![
            FreshCopy::new(&src, &mut long),
            FreshCopy::new(&src, &mut short),
        ]);
        assert_eq!(&long[..10_000], &src[..]);
        assert!(long[10_000..].iter().all(|&b| b == 0));
        assert_eq!(&short[..], &src[..5_000]);
    }
}
