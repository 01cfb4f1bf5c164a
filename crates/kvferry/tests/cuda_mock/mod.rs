//! The mock `libcuda.so.1` (`mock_cuda.c`), built with `cc` into a directory of its own, so a
//! test process started with that directory in `LD_LIBRARY_PATH` loads it by soname, as it
//! would load the real driver.

use std::path::PathBuf;
use std::process::Command;

pub const SOURCE: &str = include_str!("mock_cuda.c");

/// Builds the mock with `defines` into `<tmp>/kvf-cuda-<name>-<pid>/libcuda.so.1`; that
/// directory.
pub fn build(name: &str, defines: &[&str]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvf-cuda-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("mock_cuda.c");
    std::fs::write(&src, SOURCE).unwrap();
    let out = dir.join("libcuda.so.1");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let st = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-pthread", "-o"])
        .arg(&out)
        .arg(&src)
        .args(defines.iter().map(|d| format!("-D{d}")))
        .status();
    assert!(st.is_ok_and(|s| s.success()), "building the mock libcuda needs a C compiler ({cc})");
    dir
}
