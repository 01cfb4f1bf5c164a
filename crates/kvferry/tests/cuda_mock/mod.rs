//! The mock `libcuda.so.1` (`mock_cuda.c`, the one mock CUDA driver of every test), built with
//! `cc` into a directory of its own, so a process started with that directory in
//! `LD_LIBRARY_PATH` loads it by soname, as it would load the real driver (or a test loads the
//! file by path). Used by this crate's `gpu_memory.rs` and `gpu_driver.rs`, and by
//! kvferry-cli's `doctor_gpu.rs` and `cli.rs` (through `#[path]`). The behaviours
//! (`NO_MEM`: probe only; `NO_BUS_ID`: too old for the probe; default: full memory) and the
//! other knobs are listed at the top of `mock_cuda.c`.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

const SOURCE: &str = include_str!("mock_cuda.c");

/// Builds the mock with `defines` (e.g. `"COUNT=2"`, `"NO_MEM"`) into
/// `<target>/tmp/kvf-cuda-<name>-<pid>/libcuda.so.1` (Cargo's directory for integration
/// tests' files: removed with the build, not left in the system's /tmp); that directory.
pub fn build(name: &str, defines: &[&str]) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("kvf-cuda-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    // Tests of one binary run in parallel and may build the same mock at once: each writes
    // its own files and renames the library into place (atomic), so a child process never
    // loads a half-written one.
    static UNIQUE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = UNIQUE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let src = dir.join(format!("mock_cuda-{n}.c"));
    std::fs::write(&src, SOURCE).unwrap_or_else(|e| panic!("writing {}: {e}", src.display()));
    let tmp = dir.join(format!("libcuda.so.1.{n}.tmp"));
    let out = dir.join("libcuda.so.1");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let st = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-pthread", "-o"])
        .arg(&tmp)
        .arg(&src)
        .args(defines.iter().map(|d| format!("-D{d}")))
        .status();
    assert!(
        st.is_ok_and(|s| s.success()),
        "building the mock libcuda needs a C compiler ({cc})"
    );
    std::fs::rename(&tmp, &out)
        .unwrap_or_else(|e| panic!("moving {} into place: {e}", tmp.display()));
    let _ = std::fs::remove_file(&src);
    dir
}

/// [`build`], then the library file itself (for `Driver::load_from`).
pub fn build_lib(name: &str, defines: &[&str]) -> PathBuf {
    build(name, defines).join("libcuda.so.1")
}
