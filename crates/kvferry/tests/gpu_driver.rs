//! The CUDA driver loaded at run time, against mock `libcuda` libraries built here with `cc`
//! (a real driver only on GPU hosts): what is reported, and what each failure says.

mod cuda_mock;

use kvferry::testing::gpu::{self, driver::Driver};
use std::path::{Path, PathBuf};

/// A mock driver library built with `defines` (`cuda_mock/mock_cuda.c`, probe only: the
/// probe needs no memory entry points); its path.
fn mock(name: &str, defines: &[&str]) -> PathBuf {
    cuda_mock::build_lib(&format!("drv-{name}"), &[defines, &["NO_MEM"]].concat())
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn a_driver_reports_its_version_and_gpus() {
    let lib = mock("cuda_ok", &["INIT_RESULT=0", "COUNT=2"]);
    let p = gpu::probe_with(Driver::load_from(path(&lib)));
    assert_eq!(p.driver_version, Some(12040));
    assert!(p.unavailable.is_none(), "{:?}", p.unavailable);
    assert_eq!(p.gpus.len(), 2);
    assert_eq!(
        (p.gpus[1].name.as_str(), p.gpus[1].pci_bus_id.as_str()),
        ("Mock H200 #1", "0000:18:00.0")
    );
    assert_eq!(
        (p.gpus[0].memory, p.gpus[0].compute_capability),
        (141 << 30, (9, 0))
    );
}

#[test]
fn each_failure_says_what_is_missing_and_what_to_do() {
    let no_dev = mock("cuda_nodev", &["INIT_RESULT=100", "COUNT=0"]);
    let e = Driver::load_from(path(&no_dev))
        .err()
        .expect("cuInit fails")
        .to_string();
    assert!(
        e.contains("CUDA_ERROR_NO_DEVICE") && e.contains("CUDA_VISIBLE_DEVICES"),
        "{e}"
    );
    let stub = mock("cuda_stub", &["INIT_RESULT=34", "COUNT=0"]);
    assert!(Driver::load_from(path(&stub))
        .err()
        .unwrap()
        .to_string()
        .contains("LD_LIBRARY_PATH"));
    let zero = mock("cuda_zero", &["INIT_RESULT=0", "COUNT=0"]);
    let p = gpu::probe_with(Driver::load_from(path(&zero)));
    assert!(
        p.gpus.is_empty()
            && p.unavailable
                .as_deref()
                .is_some_and(|u| u.contains("no GPU")),
        "{p:?}"
    );
    let old = mock("cuda_old", &["INIT_RESULT=0", "COUNT=1", "NO_BUS_ID"]);
    let e = Driver::load_from(path(&old))
        .err()
        .expect("a symbol is missing")
        .to_string();
    assert!(
        e.contains("cuDeviceGetPCIBusId") && e.contains("too old"),
        "{e}"
    );
    let e = Driver::load_from("/nonexistent/libcuda.so.1")
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("install the NVIDIA driver") && e.contains("every CPU transport work"),
        "{e}"
    );
}

/// This host: with a driver, GPUs are listed; without, the probe says why and nothing fails.
#[test]
fn this_host_is_probed_without_failing() {
    let p = gpu::probe();
    assert_eq!(p.unavailable.is_none(), !p.gpus.is_empty(), "{p:?}");
    if p.driver_version.is_none() {
        assert!(
            p.unavailable
                .as_deref()
                .is_some_and(|u| u.contains("libcuda.so.1")),
            "{p:?}"
        );
    }
}
