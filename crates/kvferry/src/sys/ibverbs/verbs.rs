//! `libibverbs.so.1`, loaded at run time with `dlopen` (through `libloading`): a table of the
//! entry points used, each resolved once, and safe owners of the verbs objects built on them.
//! Nothing links verbs at build time, so a wheel or binary carries no `DT_NEEDED` on it and
//! starts on any host.
//!
//! Objects: [`Context`] (an opened device) → [`Pd`] → [`Mr`] (registered memory); [`Cq`] (a
//! completion queue with its completion channel) and [`Qp`] (an RC queue pair). Each holds a
//! reference to what it was made from, so destruction always runs child first (QP, CQ, channel,
//! MR, PD, device) whatever order the caller drops them in. Every failure is a [`VerbsError`]
//! that names the call, the device, the cause and the fix; completions with an error status
//! become [`WcError`], named (`IBV_WC_RETRY_EXC_ERR`, ...) and explained.
//!
//! The data path (`post_send`, `poll_cq`, `req_notify_cq`) is `static inline` in verbs.h and
//! goes through the context's ops table ([`super::ffi::ibv_context_ops`]), as the header does.

use super::ffi::*;
use libloading::Library;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::io;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod mr;
mod queue;

pub use mr::*;
pub use queue::*;

/// The soname loaded by default (rdma-core's stable ABI).
pub(crate) const LIBRARY: &str = "libibverbs.so.1";

/// Why a verbs operation failed, with what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    #[error("{path} cannot be loaded ({why}): RDMA is unavailable on this host; install rdma-core's user-space library and providers (Debian/Ubuntu: apt install libibverbs1 ibverbs-providers; RHEL: dnf install libibverbs) or use the tcp transport")]
    Missing { path: String, why: String },
    #[error("{path} has no symbol {symbol} ({why}): this rdma-core is too old or not libibverbs; install rdma-core >= 28")]
    Symbol {
        path: String,
        symbol: &'static str,
        why: String,
    },
    #[error("no RDMA device named {name:?} (found: {found}): check the name with `ibv_devices` or `rdma link show`, and the device filter")]
    NoDevice { name: String, found: String },
    #[error("{call} on {device} failed: {source}; {fix}")]
    Call {
        call: &'static str,
        device: String,
        source: io::Error,
        fix: String,
    },
    #[error("ibv_post_send on {device} failed after posting {posted} of {total} work requests: {source}; {fix}")]
    Post {
        device: String,
        posted: usize,
        total: usize,
        source: io::Error,
        fix: String,
    },
    #[error("invalid work request on {device}: {what}")]
    Invalid { device: String, what: String },
    #[error("no completion on {device} within {waited:?}: the peer's NIC does not answer (peer gone, or a path that drops packets: check the GID index and MTU on both sides, and that the peer is alive)")]
    Timeout { device: String, waited: Duration },
    #[error(transparent)]
    Completion(#[from] WcError),
}

/// A work completion whose status is not success.
#[derive(Debug, Clone, thiserror::Error)]
#[error("work request {wr_id} on {device} QP {qp_num} failed: {name} ({meaning}; vendor error {vendor_err:#x})")]
pub struct WcError {
    pub device: String,
    pub wr_id: u64,
    pub qp_num: u32,
    /// The `ibv_wc_status` value.
    pub status: u32,
    /// Its name in verbs.h, e.g. `IBV_WC_RETRY_EXC_ERR`.
    pub name: &'static str,
    /// What it means and what to check.
    pub meaning: &'static str,
    pub vendor_err: u32,
}

/// `enum ibv_wc_status`: each status's name and what it means for the caller.
pub(crate) fn wc_status(status: u32) -> (&'static str, &'static str) {
    match status {
        0 => ("IBV_WC_SUCCESS", "success"),
        1 => ("IBV_WC_LOC_LEN_ERR", "local length error: a scatter/gather entry is longer than the message allows"),
        2 => ("IBV_WC_LOC_QP_OP_ERR", "local QP operation error: the work request is malformed or exceeds the QP's limits"),
        3 => ("IBV_WC_LOC_EEC_OP_ERR", "local EE context operation error"),
        4 => ("IBV_WC_LOC_PROT_ERR", "local protection error: the local buffer is not inside a live memory region with this lkey (deregistered, or the wrong PD)"),
        5 => ("IBV_WC_WR_FLUSH_ERR", "flushed: the QP went to the error state because of an earlier failure; this request was not executed"),
        6 => ("IBV_WC_MW_BIND_ERR", "memory window bind error"),
        7 => ("IBV_WC_BAD_RESP_ERR", "bad response from the peer's NIC"),
        8 => ("IBV_WC_LOC_ACCESS_ERR", "local access error: the local memory region does not allow this access (LOCAL_WRITE missing for a READ)"),
        9 => ("IBV_WC_REM_INV_REQ_ERR", "remote invalid request: the peer refused the request (length over its limit, or an operation its QP does not allow)"),
        10 => ("IBV_WC_REM_ACCESS_ERR", "remote access error: the rkey is wrong or the remote range is outside the peer's registered memory (or it was deregistered); re-read the peer's segment descriptor"),
        11 => ("IBV_WC_REM_OP_ERR", "remote operation error: the peer's NIC could not complete the operation"),
        12 => ("IBV_WC_RETRY_EXC_ERR", "transport retry counter exceeded: the peer's QP is gone or the path is wrong; check GID index / MTU, and that the peer process is alive"),
        13 => ("IBV_WC_RNR_RETRY_EXC_ERR", "receiver-not-ready retry counter exceeded: the peer posted no receive buffer"),
        14 => ("IBV_WC_LOC_RDD_VIOL_ERR", "local RDD violation"),
        15 => ("IBV_WC_REM_INV_RD_REQ_ERR", "remote invalid RD request"),
        16 => ("IBV_WC_REM_ABORT_ERR", "remote aborted the operation"),
        17 => ("IBV_WC_INV_EECN_ERR", "invalid EE context number"),
        18 => ("IBV_WC_INV_EEC_STATE_ERR", "invalid EE context state"),
        19 => ("IBV_WC_FATAL_ERR", "fatal error of the NIC: check `dmesg` and the device's health"),
        20 => ("IBV_WC_RESP_TIMEOUT_ERR", "response timeout: the peer did not answer"),
        21 => ("IBV_WC_GENERAL_ERR", "general error of the NIC"),
        22 => ("IBV_WC_TM_ERR", "tag matching error"),
        23 => ("IBV_WC_TM_RNDV_INCOMPLETE", "tag matching rendezvous incomplete"),
        _ => ("IBV_WC_UNKNOWN", "a status this build does not know"),
    }
}

/// What to do when `call` failed with `e` (the errno the library reported).
fn fix(call: &str, e: &io::Error, detail: &str) -> String {
    let errno = e.raw_os_error().unwrap_or(0);
    match (call, errno) {
        ("ibv_open_device", libc::EACCES | libc::EPERM) => {
            "the device file (/dev/infiniband/uverbs*) is not accessible: run as root or as a member of the group that owns it (often `rdma`)".into()
        }
        ("ibv_reg_mr", libc::ENOMEM | libc::EAGAIN) => {
            let limit = rustix::process::getrlimit(rustix::process::Resource::Memlock);
            let lim = |v: Option<u64>| v.map_or("unlimited".to_string(), |v| format!("{v} bytes"));
            format!(
                "{detail}: pinning it exceeds the locked-memory limit (ulimit -l: soft {}, hard {}); raise it (limits.conf `* - memlock unlimited`, systemd LimitMEMLOCK=infinity, docker --ulimit memlock=-1) or run with CAP_IPC_LOCK",
                lim(limit.current),
                lim(limit.maximum)
            )
        }
        ("ibv_reg_mr", libc::EFAULT) => format!("{detail}: the range is not mapped memory of this process"),
        ("ibv_reg_mr", libc::EINVAL) => format!("{detail}: the device refused the range or the access flags"),
        ("ibv_reg_mr", _) => format!("{detail}: the device could not register this memory"),
        ("ibv_reg_dmabuf_mr", libc::EOPNOTSUPP | libc::ENOSYS | libc::EPROTONOSUPPORT) => format!(
            "{detail}: this NIC's driver (or kernel) cannot register dma-bufs; load nvidia-peermem (modprobe nvidia_peermem) and set KVFERRY_GPU_RDMA=peermem, or use a NIC and kernel with dma-buf support (mlx5 on Linux 5.12+)"
        ),
        ("ibv_reg_dmabuf_mr", _) => format!("{detail}: the NIC refused the GPU memory's dma-buf (a CUDA VMM allocation, or a range outside the exported allocation?)"),
        ("ibv_create_qp", libc::EINVAL | libc::ENOMEM) => format!("{detail}: the device refused the queue sizes; lower them (see `ibv_devinfo -v`: max_qp_wr, max_sge)"),
        ("ibv_create_cq", libc::EINVAL | libc::ENOMEM) => format!("{detail}: the device refused the completion queue size; lower it (see `ibv_devinfo -v`: max_cqe)"),
        ("ibv_modify_qp(INIT)", _) => format!("{detail}: the port or its pkey index 0 is not usable (is the port ACTIVE? `ibv_devinfo`)"),
        ("ibv_modify_qp(RTR)", _) => format!(
            "{detail}: the QP could not be connected to the peer; check the GID index (MC_GID_INDEX; a RoCE v2 IPv4-mapped GID is usually right: `show_gids` or /sys/class/infiniband/<dev>/ports/<n>/gids), the path MTU (at most both ports' active MTU) and that the peer's QP number and GID are current"
        ),
        ("ibv_modify_qp(RTS)", _) => format!("{detail}: the device refused the send attributes (timeout, retry counts, outstanding reads)"),
        ("ibv_query_port", _) | ("ibv_query_gid", _) => format!("{detail}: the port or GID index does not exist on this device"),
        _ if !detail.is_empty() => detail.to_string(),
        _ => "see `ibv_devinfo` and `dmesg`".into(),
    }
}

macro_rules! fns {
    ($($field:ident : $sym:literal => fn($($arg:ty),*) $(-> $ret:ty)?;)*) => {
        /// The entry points of `libibverbs.so.1` used (exported functions; prototypes from verbs.h).
        struct Fns { $($field: unsafe extern "C" fn($($arg),*) $(-> $ret)?,)* }
        impl Fns {
            fn load(lib: &Library, path: &str) -> Result<Fns, VerbsError> {
                // SAFETY: each type is the prototype of <infiniband/verbs.h> for that symbol.
                unsafe {
                    Ok(Fns { $($field: *lib.get::<unsafe extern "C" fn($($arg),*) $(-> $ret)?>(concat!($sym, "\0").as_bytes())
                        .map_err(|e| VerbsError::Symbol { path: path.into(), symbol: $sym, why: e.to_string() })?,)* })
                }
            }
        }
    };
}

fns! {
    get_device_list: "ibv_get_device_list" => fn(*mut c_int) -> *mut *mut c_void;
    free_device_list: "ibv_free_device_list" => fn(*mut *mut c_void);
    get_device_name: "ibv_get_device_name" => fn(*mut c_void) -> *const c_char;
    open_device: "ibv_open_device" => fn(*mut c_void) -> *mut ibv_context;
    close_device: "ibv_close_device" => fn(*mut ibv_context) -> c_int;
    query_port: "ibv_query_port" => fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int;
    query_gid: "ibv_query_gid" => fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int;
    alloc_pd: "ibv_alloc_pd" => fn(*mut ibv_context) -> *mut c_void;
    dealloc_pd: "ibv_dealloc_pd" => fn(*mut c_void) -> c_int;
    reg_mr: "ibv_reg_mr" => fn(*mut c_void, *mut c_void, usize, c_int) -> *mut ibv_mr;
    dereg_mr: "ibv_dereg_mr" => fn(*mut ibv_mr) -> c_int;
    create_comp_channel: "ibv_create_comp_channel" => fn(*mut ibv_context) -> *mut ibv_comp_channel;
    destroy_comp_channel: "ibv_destroy_comp_channel" => fn(*mut ibv_comp_channel) -> c_int;
    create_cq: "ibv_create_cq" => fn(*mut ibv_context, c_int, *mut c_void, *mut ibv_comp_channel, c_int) -> *mut ibv_cq;
    destroy_cq: "ibv_destroy_cq" => fn(*mut ibv_cq) -> c_int;
    get_cq_event: "ibv_get_cq_event" => fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int;
    ack_cq_events: "ibv_ack_cq_events" => fn(*mut ibv_cq, c_uint);
    create_qp: "ibv_create_qp" => fn(*mut c_void, *mut ibv_qp_init_attr) -> *mut ibv_qp;
    modify_qp: "ibv_modify_qp" => fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;
    destroy_qp: "ibv_destroy_qp" => fn(*mut ibv_qp) -> c_int;
}

/// The loaded library and its entry points (valid while `_lib` lives, i.e. as long as this
/// value; every verbs object holds an `Arc` of it).
pub struct Verbs {
    _lib: Library,
    f: Fns,
    /// `ibv_reg_dmabuf_mr` (rdma-core 34 and newer): registers a dma-buf (GPU memory without
    /// nvidia-peermem); `None` with an older library.
    reg_dmabuf_mr: Option<RegDmabufMr>,
}

type RegDmabufMr = unsafe extern "C" fn(*mut c_void, u64, usize, u64, c_int, c_int) -> *mut ibv_mr;

impl Verbs {
    /// Whether the library can register dma-bufs (`ibv_reg_dmabuf_mr`, rdma-core 34+).
    pub fn has_dmabuf(&self) -> bool {
        self.reg_dmabuf_mr.is_some()
    }

    /// Loads [`LIBRARY`] from the system's search path.
    pub fn load() -> Result<Verbs, VerbsError> {
        Verbs::load_from(LIBRARY)
    }

    /// Loads the verbs library at `path` (a soname or a file).
    pub fn load_from(path: &str) -> Result<Verbs, VerbsError> {
        // SAFETY: loading rdma-core's libibverbs runs its constructors, which only set up
        // its provider table; it is the library this module is written against.
        let lib = unsafe { Library::new(path) }.map_err(|e| VerbsError::Missing {
            path: path.into(),
            why: e.to_string(),
        })?;
        let f = Fns::load(&lib, path)?;
        // SAFETY: the prototype of <infiniband/verbs.h> for ibv_reg_dmabuf_mr.
        let reg_dmabuf_mr = unsafe { lib.get::<RegDmabufMr>(b"ibv_reg_dmabuf_mr\0") }
            .ok()
            .map(|f| *f);
        Ok(Verbs {
            _lib: lib,
            f,
            reg_dmabuf_mr,
        })
    }

    /// Calls `each(name, device)` for every device the library lists; the device pointers are
    /// valid only inside `each` (the list is freed after).
    fn with_devices<T>(
        &self,
        mut each: impl FnMut(&str, *mut c_void) -> Option<T>,
    ) -> io::Result<Option<T>> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the list is freed below and its entries are
        // only used before that.
        let list = unsafe { (self.f.get_device_list)(&mut n) };
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
        let mut found = None;
        for i in 0..n.max(0) as usize {
            // SAFETY: `list` holds `n` device pointers; a device name is a NUL-terminated
            // string owned by the device.
            let (dev, name) = unsafe {
                let dev = *list.add(i);
                let name = (self.f.get_device_name)(dev);
                if name.is_null() {
                    continue;
                }
                (dev, CStr::from_ptr(name).to_string_lossy().into_owned())
            };
            if let Some(v) = each(&name, dev) {
                found = Some(v);
                break;
            }
        }
        // SAFETY: the list returned above, freed once. Devices opened from it stay valid
        // (libibverbs reference-counts them).
        unsafe { (self.f.free_device_list)(list) };
        Ok(found)
    }

    /// The names of the RDMA devices the library lists (e.g. `mlx5_0`, `rxe0`); empty when
    /// there are none.
    pub fn device_names(&self) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        self.with_devices(|name, _| {
            names.push(name.to_string());
            None::<()>
        })?;
        Ok(names)
    }
}

fn last_error() -> io::Error {
    let e = io::Error::last_os_error();
    // Some providers return NULL without setting errno.
    if e.raw_os_error() == Some(0) {
        io::Error::other("the library gave no reason")
    } else {
        e
    }
}

fn errno(rc: c_int) -> io::Error {
    // Verbs calls return a positive errno, some a negative one, some -1 with errno set.
    if rc == -1 {
        last_error()
    } else {
        io::Error::from_raw_os_error(rc.abs())
    }
}

struct CtxInner {
    verbs: Arc<Verbs>,
    ctx: *mut ibv_context,
    name: String,
}

// SAFETY: libibverbs objects may be used from any thread (rdma-core's verbs are thread-safe;
// providers lock their queues); the pointers are owned here and freed once in Drop.
unsafe impl Send for CtxInner {}
unsafe impl Sync for CtxInner {}

impl Drop for CtxInner {
    fn drop(&mut self) {
        // SAFETY: opened in `Context::open`; every child holds an Arc of this, so none is left.
        let rc = unsafe { (self.verbs.f.close_device)(self.ctx) };
        if rc != 0 {
            tracing::warn!("ibv_close_device({}) failed: {}", self.name, errno(rc));
        }
    }
}

impl CtxInner {
    fn err(&self, call: &'static str, source: io::Error, detail: &str) -> VerbsError {
        let fix = fix(call, &source, detail);
        VerbsError::Call {
            call,
            device: self.name.clone(),
            source,
            fix,
        }
    }
}

/// The attributes of a port that connecting a QP needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortAttr {
    /// `enum ibv_port_state` (4: ACTIVE).
    pub state: u32,
    /// `enum ibv_mtu` (1: 256 B .. 5: 4096 B).
    pub active_mtu: u32,
    pub lid: u16,
    /// 1: InfiniBand, 2: Ethernet (RoCE).
    pub link_layer: u8,
}

impl PortAttr {
    pub fn active(&self) -> bool {
        self.state == IBV_PORT_ACTIVE
    }
    /// The active MTU in bytes.
    pub fn mtu_bytes(&self) -> u32 {
        mtu_bytes(self.active_mtu)
    }
}

/// Bytes of an `enum ibv_mtu` value (0 for an unknown one).
pub(crate) fn mtu_bytes(mtu: u32) -> u32 {
    if (1..=5).contains(&mtu) {
        128 << mtu
    } else {
        0
    }
}

/// The `enum ibv_mtu` value of a size in bytes (256..4096, a power of two).
pub(crate) fn mtu_enum(bytes: u32) -> Option<u32> {
    (1..=5).find(|&m| mtu_bytes(m) == bytes)
}

/// An opened RDMA device.
#[derive(Clone)]
pub struct Context {
    inner: Arc<CtxInner>,
}

impl Context {
    /// Opens the device called `name` (e.g. `mlx5_0`, `rxe0`).
    pub fn open(verbs: Arc<Verbs>, name: &str) -> Result<Context, VerbsError> {
        let mut names = Vec::new();
        let opened = verbs
            .with_devices(|n, dev| {
                names.push(n.to_string());
                // SAFETY: `dev` is a device of the list, valid inside this closure.
                (n == name)
                    .then(|| unsafe { (verbs.f.open_device)(dev) })
                    .map(|ctx| (ctx, (!ctx.is_null()).then_some(()).ok_or_else(last_error)))
            })
            .map_err(|source| VerbsError::Call {
                call: "ibv_get_device_list",
                device: name.into(),
                fix: fix("ibv_get_device_list", &source, ""),
                source,
            })?;
        match opened {
            None => Err(VerbsError::NoDevice {
                name: name.into(),
                found: if names.is_empty() {
                    "none".into()
                } else {
                    names.join(", ")
                },
            }),
            Some((_, Err(source))) => Err(VerbsError::Call {
                call: "ibv_open_device",
                device: name.into(),
                fix: fix("ibv_open_device", &source, ""),
                source,
            }),
            Some((ctx, Ok(()))) => Ok(Context {
                inner: Arc::new(CtxInner {
                    verbs,
                    ctx,
                    name: name.into(),
                }),
            }),
        }
    }

    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// `ibv_query_port` on port `port` (1-based).
    pub fn query_port(&self, port: u8) -> Result<PortAttr, VerbsError> {
        let mut a = ibv_port_attr::default();
        // SAFETY: a live context; `a` is a zeroed ibv_port_attr, at least as large as the
        // compat layout the exported symbol writes.
        let rc = unsafe { (self.inner.verbs.f.query_port)(self.inner.ctx, port, &mut a) };
        if rc != 0 {
            return Err(self
                .inner
                .err("ibv_query_port", errno(rc), &format!("port {port}")));
        }
        Ok(PortAttr {
            state: a.state,
            active_mtu: a.active_mtu,
            lid: a.lid,
            link_layer: a.link_layer,
        })
    }

    /// `ibv_query_gid`: the GID at `index` of port `port`, as 16 bytes.
    pub fn query_gid(&self, port: u8, index: u8) -> Result<[u8; 16], VerbsError> {
        let mut g = ibv_gid::default();
        // SAFETY: a live context; `g` is a valid out-pointer.
        let rc = unsafe {
            (self.inner.verbs.f.query_gid)(self.inner.ctx, port, c_int::from(index), &mut g)
        };
        if rc != 0 {
            return Err(self.inner.err(
                "ibv_query_gid",
                errno(rc),
                &format!("port {port} GID index {index}"),
            ));
        }
        Ok(g.raw)
    }

    /// A protection domain.
    pub fn alloc_pd(&self) -> Result<Pd, VerbsError> {
        // SAFETY: a live context.
        let pd = unsafe { (self.inner.verbs.f.alloc_pd)(self.inner.ctx) };
        if pd.is_null() {
            return Err(self.inner.err("ibv_alloc_pd", last_error(), ""));
        }
        Ok(Pd {
            inner: Arc::new(PdInner {
                ctx: Arc::clone(&self.inner),
                pd,
            }),
        })
    }

    /// A completion queue of `cqe` entries with its own completion channel, so that
    /// [`Cq::wait`] can sleep in the kernel instead of spinning.
    pub fn create_cq(&self, cqe: u32) -> Result<Cq, VerbsError> {
        let f = &self.inner.verbs.f;
        // SAFETY: a live context.
        let ch = unsafe { (f.create_comp_channel)(self.inner.ctx) };
        if ch.is_null() {
            return Err(self.inner.err("ibv_create_comp_channel", last_error(), ""));
        }
        let chan = ChanInner {
            ctx: Arc::clone(&self.inner),
            ch,
        };
        let n = c_int::try_from(cqe).unwrap_or(c_int::MAX);
        // SAFETY: a live context and channel; no cq_context; completion vector 0.
        let cq = unsafe { (f.create_cq)(self.inner.ctx, n, std::ptr::null_mut(), ch, 0) };
        if cq.is_null() {
            return Err(self
                .inner
                .err("ibv_create_cq", last_error(), &format!("{cqe} entries")));
        }
        Ok(Cq {
            inner: Arc::new(CqInner {
                ctx: Arc::clone(&self.inner),
                cq,
                chan,
                armed: Mutex::new(()),
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a host with rdma-core (CI installs libibverbs1) the library loads and lists its
    /// devices (none on a plain VM); without it the error says what to install.
    #[test]
    fn loads_where_installed_and_says_what_to_install_where_not() {
        let installed = [
            "/usr/lib/x86_64-linux-gnu/libibverbs.so.1",
            "/usr/lib/aarch64-linux-gnu/libibverbs.so.1",
            "/usr/lib64/libibverbs.so.1",
        ]
        .iter()
        .any(|p| std::path::Path::new(p).exists());
        match Verbs::load() {
            Ok(v) => {
                assert!(
                    installed || std::env::var_os("LD_LIBRARY_PATH").is_some(),
                    "loaded from an unexpected place"
                );
                match v.device_names() {
                    Ok(names) => assert!(names.iter().all(|n| !n.is_empty())),
                    Err(e) => {
                        assert!(
                            !std::path::Path::new(crate::nic::sysfs::ROOT).exists(),
                            "devices in sysfs but not listed: {e}"
                        );
                        assert!(e.to_string().contains("rdma_rxe"), "{e}");
                    }
                }
            }
            Err(e) => {
                assert!(!installed, "installed but not loadable: {e}");
                assert!(e.to_string().contains("apt install libibverbs1"), "{e}");
            }
        }
        let e = Verbs::load_from("/nonexistent/libibverbs.so.1")
            .err()
            .expect("no such file");
        assert!(
            e.to_string().contains("cannot be loaded")
                && e.to_string().contains("use the tcp transport"),
            "{e}"
        );
        // A library that is not libibverbs.
        if let Err(e) = Verbs::load_from("libc.so.6") {
            assert!(e.to_string().contains("ibv_get_device_list"), "{e}");
        } else {
            panic!("libc is not libibverbs");
        }
    }
}

#[cfg(test)]
mod named_tests {
    use super::*;

    #[test]
    fn completion_errors_are_named_and_explained() {
        let wc = Wc {
            wr_id: 7,
            qp_num: 17,
            byte_len: 0,
            status: 12,
            opcode: 0,
            vendor_err: 0x81,
        };
        let e = wc.result("rxe0").unwrap_err().to_string();
        assert!(
            e.contains("IBV_WC_RETRY_EXC_ERR")
                && e.contains("check GID index / MTU")
                && e.contains("rxe0")
                && e.contains("QP 17"),
            "{e}"
        );
        let e = Wc { status: 10, ..wc }
            .result("mlx5_0")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("IBV_WC_REM_ACCESS_ERR") && e.contains("rkey"),
            "{e}"
        );
        assert!(Wc { status: 0, ..wc }.result("rxe0").is_ok());
        assert_eq!(wc_status(99).0, "IBV_WC_UNKNOWN");
        for s in 1..=23 {
            assert!(wc_status(s).0.starts_with("IBV_WC_") && wc_status(s).0 != "IBV_WC_UNKNOWN");
        }
    }

    #[test]
    fn mtus_convert_both_ways() {
        assert_eq!(
            (1..=5).map(mtu_bytes).collect::<Vec<_>>(),
            [256, 512, 1024, 2048, 4096]
        );
        assert_eq!((mtu_bytes(0), mtu_bytes(6)), (0, 0));
        assert_eq!(
            (mtu_enum(1024), mtu_enum(4096), mtu_enum(1500)),
            (Some(3), Some(5), None)
        );
    }

    #[test]
    fn failures_name_their_fix() {
        let memlock = fix(
            "ibv_reg_mr",
            &io::Error::from_raw_os_error(libc::ENOMEM),
            "registering 1 bytes",
        );
        assert!(
            memlock.contains("ulimit -l") && memlock.contains("CAP_IPC_LOCK"),
            "{memlock}"
        );
        let rtr = fix(
            "ibv_modify_qp(RTR)",
            &io::Error::from_raw_os_error(libc::EINVAL),
            "QP 1",
        );
        assert!(rtr.contains("GID index") && rtr.contains("MTU"), "{rtr}");
        // Opening a device that is not there names what is (on a host without RDMA: why not).
        if let Ok(v) = Verbs::load() {
            match Context::open(Arc::new(v), "no_such_dev0") {
                Err(VerbsError::NoDevice { name, .. }) => assert_eq!(name, "no_such_dev0"),
                Err(VerbsError::Call { call, source, .. }) => assert_eq!(
                    (call, source.kind()),
                    ("ibv_get_device_list", io::ErrorKind::Unsupported)
                ),
                Err(e) => panic!("unexpected: {e}"),
                Ok(_) => panic!("opened a device that does not exist"),
            }
        }
    }
}
