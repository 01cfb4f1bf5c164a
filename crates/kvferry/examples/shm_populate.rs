//! What filling the page tables of a second mapping of shared memory costs on this machine,
//! and what the copy after it costs, per way of filling: none (the copy takes a fault per
//! 4 KiB page), `MADV_POPULATE_WRITE` (a fault per page, in one call) and
//! `MADV_POPULATE_READ` (read faults map up to 16 neighbouring pages at once; writable on
//! shared memory). The owner allocates every page first (`fallocate`), as a store segment's
//! owner does, so the mapping measured is what a same-host peer maps (`transport/shm/maps.rs`
//! `PeerMap::fill` uses POPULATE_READ because of these numbers).
//!
//! `cargo run --release --example shm_populate -p kvferry [MiB]` (default 512)
use rustix::fs::{fallocate, ftruncate, memfd_create, FallocateFlags, MemfdFlags};
use rustix::mm::{madvise, mmap, munmap, Advice, MapFlags, ProtFlags};
use std::time::Instant;

fn main() {
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(512);
    let len = mib << 20;
    let fd = memfd_create("kvferry-populate", MemfdFlags::CLOEXEC).expect("memfd_create");
    ftruncate(&fd, len as u64).expect("ftruncate");
    // Every page allocated, none mapped here yet.
    fallocate(&fd, FallocateFlags::empty(), 0, len as u64).expect("fallocate");
    let src = vec![1u8; len];
    println!("{mib} MiB of shared memory, a second mapping filled, then copied into twice");
    for (name, advice) in [
        ("none", None),
        ("POPULATE_WRITE", Some(Advice::LinuxPopulateWrite)),
        ("POPULATE_READ", Some(Advice::LinuxPopulateRead)),
    ] {
        // SAFETY: a new shared mapping of our own memfd, of its whole length.
        let m = unsafe {
            mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )
        }
        .expect("mmap");
        // SAFETY: `m` is a live mapping of `len` bytes that nothing else references, until the
        // munmap below.
        let dst = unsafe { std::slice::from_raw_parts_mut(m.cast::<u8>(), len) };
        let t0 = Instant::now();
        if let Some(a) = advice {
            // SAFETY: advising our own mapping; fills page tables only.
            unsafe { madvise(m, len, a) }.expect("madvise");
        }
        let t1 = Instant::now();
        dst.copy_from_slice(&src);
        let t2 = Instant::now();
        dst.copy_from_slice(&src);
        let t3 = Instant::now();
        let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
        println!(
            "{name:>15}: fill {:7.1} ms, first copy {:7.1} ms, second copy {:7.1} ms",
            ms(t0, t1),
            ms(t1, t2),
            ms(t2, t3)
        );
        // SAFETY: our mapping; `dst` is not used after this.
        unsafe { munmap(m, len) }.expect("munmap");
    }
}
