//! What the same-host data path can reach on this machine, without the engine: single-thread
//! memcpy beside `process_vm_writev/readv` into a second process, per block size, with one
//! and two threads, one or 64 blocks per call. `huge` backs both buffers with transparent huge
//! pages. The numbers behind "Same-host transfers" in docs/ARCHITECTURE.md.
//!
//! `cargo run --release --example shm_ceiling -p kvferry [huge]`
use std::time::Instant;

const TOTAL: usize = 1 << 30;

fn buffer(len: usize, huge: bool, fill: u8) -> *mut u8 {
    // SAFETY: a fresh anonymous mapping, checked, then advised and filled.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert!(p != libc::MAP_FAILED, "mmap failed");
        if huge {
            libc::madvise(p, len, libc::MADV_HUGEPAGE);
        }
        std::ptr::write_bytes(p as *mut u8, fill, len);
        p as *mut u8
    }
}

fn cma(pid: i32, write: bool, l: &[libc::iovec], r: &[libc::iovec]) -> isize {
    // SAFETY: iovecs inside our buffer and the child's; the kernel checks the child's side.
    unsafe {
        if write {
            libc::process_vm_writev(pid, l.as_ptr(), l.len() as _, r.as_ptr(), r.len() as _, 0)
        } else {
            libc::process_vm_readv(pid, l.as_ptr(), l.len() as _, r.as_ptr(), r.len() as _, 0)
        }
    }
}

fn main() {
    let huge = std::env::args().nth(1).as_deref() == Some("huge");
    let mut fds = [0i32; 2];
    // SAFETY: a pipe to learn the child's buffer address; fork of a single-threaded process.
    let pid = unsafe {
        assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
        libc::fork()
    };
    if pid == 0 {
        let b = buffer(TOTAL, huge, 1) as u64;
        // SAFETY: writing 8 bytes to our pipe; then wait to be killed (or the parent to go).
        unsafe {
            libc::write(fds[1], &b as *const u64 as *const libc::c_void, 8);
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            libc::sleep(600);
        }
        std::process::exit(0);
    }
    let mut remote = 0u64;
    // SAFETY: reading the 8-byte address the child wrote.
    unsafe { libc::read(fds[0], &mut remote as *mut u64 as *mut libc::c_void, 8) };
    let local = buffer(TOTAL, huge, 2) as usize;
    let n = 256 << 20;
    let (a, b) = (buffer(n, huge, 3), buffer(n, huge, 0));
    let mut best: f64 = 0.0;
    for _ in 0..5 {
        let t = Instant::now();
        // SAFETY: two disjoint 256 MiB buffers of ours.
        unsafe { std::ptr::copy_nonoverlapping(a, b, n) };
        best = best.max(n as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    println!(
        "pages: {}; single-thread memcpy of 256 MiB: {best:.2} GB/s",
        if huge { "transparent huge" } else { "4 KiB" }
    );
    for write in [true, false] {
        for blk in [4096usize, 65536, 1 << 20, 16 << 20] {
            for (threads, want) in [(1usize, 1usize), (1, 64), (2, 1), (2, 64)] {
                // Up to 4 MiB per call; a variant that would repeat the one-per-call run is skipped.
                let per = want.min((4 << 20) / blk).max(1);
                if want > 1 && per == 1 {
                    continue;
                }
                let t = Instant::now();
                let bytes: usize = std::thread::scope(|s| {
                    let hs: Vec<_> = (0..threads)
                        .map(|th| {
                            s.spawn(move || {
                                let (region, base) = (TOTAL / threads, th * (TOTAL / threads));
                                let (mut bytes, mut off) = (0usize, 0usize);
                                while t.elapsed().as_secs_f64() < 0.4 {
                                    let (mut l, mut r) =
                                        (Vec::with_capacity(per), Vec::with_capacity(per));
                                    for _ in 0..per {
                                        let o = base + off % region;
                                        l.push(libc::iovec {
                                            iov_base: (local + o) as *mut libc::c_void,
                                            iov_len: blk,
                                        });
                                        r.push(libc::iovec {
                                            iov_base: (remote as usize + o) as *mut libc::c_void,
                                            iov_len: blk,
                                        });
                                        off += blk;
                                    }
                                    assert_eq!(
                                        cma(pid, write, &l, &r),
                                        (blk * per) as isize,
                                        "copy failed: {}",
                                        std::io::Error::last_os_error()
                                    );
                                    bytes += blk * per;
                                }
                                bytes
                            })
                        })
                        .collect();
                    hs.into_iter().map(|h| h.join().unwrap_or(0)).sum()
                });
                let gbps = bytes as f64 / t.elapsed().as_secs_f64() / 1e9;
                println!(
                    "cma {} {:>6} KiB x{per:<3} per call, {threads} thread(s): {gbps:6.2} GB/s ({:.2}x memcpy)",
                    if write { "write" } else { "read " },
                    blk >> 10,
                    gbps / best
                );
            }
        }
    }
    // SAFETY: the child we forked.
    unsafe { libc::kill(pid, libc::SIGKILL) };
}
