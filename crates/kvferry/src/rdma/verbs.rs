//! `libibverbs.so.1`, loaded at run time with `dlopen` (through `libloading`): a table of the
//! few entry points used so far, each resolved once. Nothing links verbs at build time, so a
//! wheel or binary carries no `DT_NEEDED` on it and starts on any host.

use libloading::Library;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::io;

/// The soname loaded by default (rdma-core's stable ABI).
pub const LIBRARY: &str = "libibverbs.so.1";

/// Why the verbs library cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    #[error("{path} cannot be loaded ({why}): RDMA is unavailable on this host; install rdma-core's user-space library and providers (Debian/Ubuntu: apt install libibverbs1 ibverbs-providers; RHEL: dnf install libibverbs) or use the tcp transport")]
    Missing { path: String, why: String },
    #[error("{path} has no symbol {symbol} ({why}): this rdma-core is too old or not libibverbs; install rdma-core >= 28")]
    Symbol { path: String, symbol: &'static str, why: String },
}

type GetDeviceList = unsafe extern "C" fn(*mut c_int) -> *mut *mut c_void;
type FreeDeviceList = unsafe extern "C" fn(*mut *mut c_void);
type GetDeviceName = unsafe extern "C" fn(*mut c_void) -> *const c_char;

/// The loaded library and its entry points (valid while `_lib` lives, i.e. as long as this
/// value).
pub struct Verbs {
    _lib: Library,
    get_device_list: GetDeviceList,
    free_device_list: FreeDeviceList,
    get_device_name: GetDeviceName,
}

impl Verbs {
    /// Loads [`LIBRARY`] from the system's search path.
    pub fn load() -> Result<Verbs, VerbsError> {
        Verbs::load_from(LIBRARY)
    }

    /// Loads the verbs library at `path` (a soname or a file).
    pub fn load_from(path: &str) -> Result<Verbs, VerbsError> {
        // SAFETY: loading rdma-core's libibverbs runs its constructors, which only set up
        // its provider table; it is the library this module is written against.
        let lib = unsafe { Library::new(path) }.map_err(|e| VerbsError::Missing { path: path.into(), why: e.to_string() })?;
        let sym = |symbol: &'static str, e: libloading::Error| VerbsError::Symbol { path: path.into(), symbol, why: e.to_string() };
        // SAFETY: the types are the prototypes of <infiniband/verbs.h> for these symbols.
        unsafe {
            let get_device_list = *lib.get::<GetDeviceList>(b"ibv_get_device_list\0").map_err(|e| sym("ibv_get_device_list", e))?;
            let free_device_list = *lib.get::<FreeDeviceList>(b"ibv_free_device_list\0").map_err(|e| sym("ibv_free_device_list", e))?;
            let get_device_name = *lib.get::<GetDeviceName>(b"ibv_get_device_name\0").map_err(|e| sym("ibv_get_device_name", e))?;
            Ok(Verbs { _lib: lib, get_device_list, free_device_list, get_device_name })
        }
    }

    /// The names of the RDMA devices the library lists (e.g. `mlx5_0`, `rxe0`); empty when
    /// there are none.
    pub fn device_names(&self) -> io::Result<Vec<String>> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the list is freed below and its entries are
        // only read before that.
        let list = unsafe { (self.get_device_list)(&mut n) };
        if list.is_null() {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENOSYS) {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "the kernel offers no RDMA devices (no /sys/class/infiniband): load the NIC's RDMA driver and ib_uverbs, or rdma_rxe for Soft-RoCE",
                ));
            }
            return Err(e);
        }
        let mut names = Vec::with_capacity(n.max(0) as usize);
        for i in 0..n.max(0) as usize {
            // SAFETY: `list` holds `n` device pointers; a device name is a NUL-terminated
            // string owned by the device.
            unsafe {
                let dev = *list.add(i);
                let name = (self.get_device_name)(dev);
                if !name.is_null() {
                    names.push(CStr::from_ptr(name).to_string_lossy().into_owned());
                }
            }
        }
        // SAFETY: the list returned above, freed once.
        unsafe { (self.free_device_list)(list) };
        Ok(names)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a host with rdma-core (CI installs libibverbs1) the library loads and lists its
    /// devices (none on a plain VM); without it the error says what to install.
    #[test]
    fn loads_where_installed_and_says_what_to_install_where_not() {
        let installed = ["/usr/lib/x86_64-linux-gnu/libibverbs.so.1", "/usr/lib/aarch64-linux-gnu/libibverbs.so.1", "/usr/lib64/libibverbs.so.1"]
            .iter()
            .any(|p| std::path::Path::new(p).exists());
        match Verbs::load() {
            Ok(v) => {
                assert!(installed || std::env::var_os("LD_LIBRARY_PATH").is_some(), "loaded from an unexpected place");
                match v.device_names() {
                    Ok(names) => assert!(names.iter().all(|n| !n.is_empty())),
                    Err(e) => {
                        assert!(!std::path::Path::new(super::super::sysfs::ROOT).exists(), "devices in sysfs but not listed: {e}");
                        assert!(e.to_string().contains("rdma_rxe"), "{e}");
                    }
                }
            }
            Err(e) => {
                assert!(!installed, "installed but not loadable: {e}");
                assert!(e.to_string().contains("apt install libibverbs1"), "{e}");
            }
        }
        let e = Verbs::load_from("/nonexistent/libibverbs.so.1").err().expect("no such file");
        assert!(e.to_string().contains("cannot be loaded") && e.to_string().contains("use the tcp transport"), "{e}");
        // A library that is not libibverbs.
        if let Err(e) = Verbs::load_from("libc.so.6") {
            assert!(e.to_string().contains("ibv_get_device_list"), "{e}");
        } else {
            panic!("libc is not libibverbs");
        }
    }
}
