//! What filling the page tables of a second mapping of shared memory costs on this machine,
//! and what the copy after it costs, per way of filling: none (the copy takes a fault per
//! 4 KiB page), `MADV_POPULATE_WRITE` (a fault per page, in one call) and
//! `MADV_POPULATE_READ` (read faults map up to 16 neighbouring pages at once; writable on
//! shared memory). The owner's mapping allocates every page first, as a store segment's owner
//! does, so the second mapping is what a same-host peer maps (`transport/shm/maps.rs`
//! `PeerMap::fill` uses POPULATE_READ because of these numbers).
//!
//! `cargo run --release --example shm_populate -p kvferry [MiB]` (default 512)
use rustix::fs::{ftruncate, memfd_create, MemfdFlags};
use rustix::mm::{madvise, mmap, munmap, Advice, MapFlags, ProtFlags};
use std::time::Instant;

fn main() {
    let mib: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(512);
    let len = mib << 20;
    let fd = memfd_create("kvferry-populate", MemfdFlags::CLOEXEC).expect("memfd_create");
    ftruncate(&fd, len as u64).expect("ftruncate");
    let map = || {
        // SAFETY: a new shared mapping of our own memfd, of its whole length.
        unsafe { mmap(std::ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, &fd, 0) }.expect("mmap")
    };
    let owner = map();
    // SAFETY: advising our own mapping; allocates every page, as the owner of a segment does.
    unsafe { madvise(owner, len, Advice::LinuxPopulateWrite) }.expect("MADV_POPULATE_WRITE (Linux 5.14)");
    let src = vec![1u8; len];
    println!("{mib} MiB of shared memory, a second mapping filled, then copied into twice");
    for (name, advice) in [("none", None), ("POPULATE_WRITE", Some(Advice::LinuxPopulateWrite)), ("POPULATE_READ", Some(Advice::LinuxPopulateRead))] {
        let m = map();
        let t0 = Instant::now();
        if let Some(a) = advice {
            // SAFETY: advising our own mapping; fills page tables only.
            unsafe { madvise(m, len, a) }.expect("madvise");
        }
        let t1 = Instant::now();
        // SAFETY: `m` is a live mapping of `len` bytes, not overlapping `src`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), m.cast::<u8>(), len) };
        let t2 = Instant::now();
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), m.cast::<u8>(), len) };
        let t3 = Instant::now();
        let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
        println!("{name:>15}: fill {:7.1} ms, first copy {:7.1} ms, second copy {:7.1} ms", ms(t0, t1), ms(t1, t2), ms(t2, t3));
        // SAFETY: our mapping, no longer used.
        unsafe { munmap(m, len) }.expect("munmap");
    }
    // SAFETY: as above.
    unsafe { munmap(owner, len) }.expect("munmap");
}
