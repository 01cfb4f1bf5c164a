//! `libibverbs.so.1` (rdma-core), loaded at run time: its C layouts ([`ffi`]) and the table of
//! its entry points with the safe owners of the objects made through it ([`verbs`]). What the
//! RDMA transport does with them (which NICs, which ports, how pieces are posted) lives in
//! `crate::nic` and `crate::transport::rdma`.

pub(crate) mod ffi;
pub(crate) mod verbs;
