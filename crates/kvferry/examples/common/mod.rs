//! Helpers shared by the RDMA examples (`mod common;` in each): buffers, patterns, byte
//! comparison, NIC packet counters and the pass/fail exit. Not an example of its own (Cargo
//! builds `examples/<name>/main.rs` and `examples/<name>.rs`, not this `mod.rs`).
#![allow(dead_code)]

use std::process::ExitCode;

pub type Res<T> = Result<T, String>;

/// Page-aligned, zero-filled memory from kvferry's allocator (`HostBuffer`), which verbs
/// may touch while registered: it is only read or written when no work request touching it
/// is outstanding.
pub struct Buf(pub kvferry::hostbuf::HostBuffer);

impl Buf {
    pub fn new(len: usize) -> Res<Buf> {
        kvferry::hostbuf::HostBuffer::new(len, false)
            .map(Buf)
            .map_err(|e| format!("cannot allocate {len} bytes: {e}"))
    }
    pub fn addr(&self) -> u64 {
        self.0.addr()
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    /// Only between transfers (no request in flight touches the buffer then).
    pub fn bytes(&mut self) -> &mut [u8] {
        self.0.slice_mut(0, self.0.len())
    }
}

/// A xorshift pattern of `seed` (different seeds never match).
pub fn fill(b: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for c in b.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
}

/// `Err` naming the first byte that differs (or the lengths).
pub fn compare(what: &str, got: &[u8], want: &[u8]) -> Res<()> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} bytes, {} expected",
            got.len(),
            want.len()
        ));
    }
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(at) => Err(format!(
            "{what}: byte {at} differs (got {:#04x}, want {:#04x})",
            got[at], want[at]
        )),
    }
}

/// Packets NIC `dev` (port 1) sent so far (its `hw_counters`; 0 when unreadable).
pub fn sent(dev: &str) -> u64 {
    std::fs::read_to_string(format!(
        "/sys/class/infiniband/{dev}/ports/1/hw_counters/sent_pkts"
    ))
    .ok()
    .and_then(|s| s.trim().parse().ok())
    .unwrap_or(0)
}

/// Prints `<name>: <ok>` or `<name>: FAILED: <why>` and the exit status for it.
pub fn finish(name: &str, ok: &str, r: Res<()>) -> ExitCode {
    match r {
        Ok(()) => {
            println!("{name}: {ok}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("{name}: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Prints the engine's log on stderr: `RUST_LOG` when set, else its warnings (a NIC pair
/// paused, a connect that failed), so that a failed run in the VM says what the engine saw.
pub fn log() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("kvferry=warn"));
    // A second call (or another subscriber) is harmless: the first one stays.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
