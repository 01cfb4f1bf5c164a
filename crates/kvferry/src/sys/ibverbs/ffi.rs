//! The C structures and constants of `<infiniband/verbs.h>` (rdma-core) that kvferry uses,
//! declared by hand so that no verbs header or library is needed at build time.
//!
//! These layouts are rdma-core's stable ABI (`libibverbs.so.1`, symbol version IBVERBS_1.1;
//! unchanged since rdma-core v13). Structures the library allocates and we only read
//! (`ibv_context`, `ibv_qp`, `ibv_cq`) are declared as their prefix up to the last field used;
//! structures we allocate and pass in (`ibv_send_wr`, `ibv_sge`, `ibv_wc`, `ibv_qp_init_attr`,
//! `ibv_qp_attr`, `ibv_port_attr`) are declared whole. Sizes and offsets are asserted in
//! `tests::layouts_match_verbs_h` against the values `sizeof`/`offsetof` give for verbs.h of
//! rdma-core 44 on x86_64 (computed once with a C program compiled by `cc`; see that test).
//!
//! `ibv_post_send`, `ibv_poll_cq` and `ibv_req_notify_cq` are `static inline` in verbs.h: they
//! call `ctx->ops.post_send` / `ops.poll_cq` / `ops.req_notify_cq`, which is what
//! [`super::verbs`] does through [`ibv_context`].
#![allow(non_camel_case_types)]

use std::ffi::{c_int, c_uint, c_void};

/// `struct ibv_context_ops` (verbs.h): 32 function pointers; only the data-path ones are typed.
#[repr(C)]
pub(crate) struct ibv_context_ops {
    /// `_compat_query_device` .. `_compat_create_cq` (11 pointers, unused here).
    pub _before_poll_cq: [*mut c_void; 11],
    pub poll_cq:
        Option<unsafe extern "C" fn(cq: *mut ibv_cq, num_entries: c_int, wc: *mut ibv_wc) -> c_int>,
    pub req_notify_cq:
        Option<unsafe extern "C" fn(cq: *mut ibv_cq, solicited_only: c_int) -> c_int>,
    /// `_compat_cq_event` .. `_compat_destroy_qp` (12 pointers, unused here).
    pub _before_post_send: [*mut c_void; 12],
    pub post_send: Option<
        unsafe extern "C" fn(
            qp: *mut ibv_qp,
            wr: *mut ibv_send_wr,
            bad_wr: *mut *mut ibv_send_wr,
        ) -> c_int,
    >,
    pub post_recv: *mut c_void,
    /// `_compat_create_ah` .. `_compat_async_event` (5 pointers, unused here).
    pub _after: [*mut c_void; 5],
}

/// `struct ibv_context`, prefix (the library allocates it; `mutex` and `abi_compat` follow).
#[repr(C)]
pub(crate) struct ibv_context {
    pub device: *mut c_void,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
}

/// `struct ibv_qp`, prefix (the mutex, condition variable and `events_completed` follow).
#[repr(C)]
pub(crate) struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_uint,
    pub qp_type: c_uint,
}

/// `struct ibv_cq`, prefix (the mutex, condition variable and event counters follow).
#[repr(C)]
pub(crate) struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
}

/// `struct ibv_comp_channel`.
#[repr(C)]
pub(crate) struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

/// `struct ibv_mr`.
#[repr(C)]
pub(crate) struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut c_void,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// `struct ibv_send_wr`, with its unions flattened to the members used: `wr` is a 32-byte union
/// whose `rdma` member is `{ u64 remote_addr; u32 rkey; }`; `qp_type` a 4-byte union; the last
/// anonymous union (`bind_mw` / `tso`) 48 bytes.
#[repr(C)]
pub(crate) struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: c_uint,
    pub send_flags: c_uint,
    pub imm_data: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    pub _wr_rest: [u32; 5],
    pub qp_type: u32,
    pub _pad: u32,
    pub _bind_mw_tso: [u64; 6],
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct ibv_wc {
    pub wr_id: u64,
    pub status: c_uint,
    pub opcode: c_uint,
    pub vendor_err: u32,
    pub byte_len: u32,
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
pub(crate) struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub cap: ibv_qp_cap,
    pub qp_type: c_uint,
    pub sq_sig_all: c_int,
}

/// `union ibv_gid`: 16 bytes, 8-aligned in C (its other member is two `__be64`).
#[repr(C, align(8))]
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug)]
pub(crate) struct ibv_gid {
    pub raw: [u8; 16],
}

/// `struct ibv_global_route`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

/// `struct ibv_qp_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct ibv_qp_attr {
    pub qp_state: c_uint,
    pub cur_qp_state: c_uint,
    pub path_mtu: c_uint,
    pub path_mig_state: c_uint,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

/// `struct ibv_port_attr`. Passed to the exported `ibv_query_port` (the IBVERBS_1.1 compat
/// entry point, which writes the fields up to `link_layer`), zeroed first as verbs.h's inline
/// wrapper does, so `flags` and `port_cap_flags2` read as 0.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct ibv_port_attr {
    pub state: c_uint,
    pub max_mtu: c_uint,
    pub active_mtu: c_uint,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

// enum ibv_qp_type
pub(crate) const IBV_QPT_RC: c_uint = 2;
// enum ibv_qp_state
#[allow(dead_code)] // the enum's first value, for the reader
pub(crate) const IBV_QPS_RESET: c_uint = 0;
pub(crate) const IBV_QPS_INIT: c_uint = 1;
pub(crate) const IBV_QPS_RTR: c_uint = 2;
pub(crate) const IBV_QPS_RTS: c_uint = 3;
pub(crate) const IBV_QPS_ERR: c_uint = 6;
// enum ibv_qp_attr_mask
pub(crate) const IBV_QP_STATE: c_int = 1 << 0;
pub(crate) const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
pub(crate) const IBV_QP_PKEY_INDEX: c_int = 1 << 4;
pub(crate) const IBV_QP_PORT: c_int = 1 << 5;
pub(crate) const IBV_QP_AV: c_int = 1 << 7;
pub(crate) const IBV_QP_PATH_MTU: c_int = 1 << 8;
pub(crate) const IBV_QP_TIMEOUT: c_int = 1 << 9;
pub(crate) const IBV_QP_RETRY_CNT: c_int = 1 << 10;
pub(crate) const IBV_QP_RNR_RETRY: c_int = 1 << 11;
pub(crate) const IBV_QP_RQ_PSN: c_int = 1 << 12;
pub(crate) const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
pub(crate) const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
pub(crate) const IBV_QP_SQ_PSN: c_int = 1 << 16;
pub(crate) const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
pub(crate) const IBV_QP_DEST_QPN: c_int = 1 << 20;
// enum ibv_access_flags
pub(crate) const IBV_ACCESS_LOCAL_WRITE: c_int = 1;
pub(crate) const IBV_ACCESS_REMOTE_WRITE: c_int = 2;
pub(crate) const IBV_ACCESS_REMOTE_READ: c_int = 4;
// enum ibv_wr_opcode
pub(crate) const IBV_WR_RDMA_WRITE: c_uint = 0;
pub(crate) const IBV_WR_RDMA_READ: c_uint = 4;
// enum ibv_send_flags
pub(crate) const IBV_SEND_SIGNALED: c_uint = 2;
// enum ibv_port_state
pub(crate) const IBV_PORT_ACTIVE: c_uint = 4;
// IBV_LINK_LAYER_* (sysfs names the link layer; kept for the reader)
#[allow(dead_code)]
pub(crate) const IBV_LINK_LAYER_INFINIBAND: u8 = 1;
#[allow(dead_code)]
pub(crate) const IBV_LINK_LAYER_ETHERNET: u8 = 2;
// enum ibv_wc_opcode (completions are matched by work request id; kept for the reader)
#[allow(dead_code)]
pub(crate) const IBV_WC_RDMA_WRITE: c_uint = 1;
#[allow(dead_code)]
pub(crate) const IBV_WC_RDMA_READ: c_uint = 2;

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    /// The numbers are what this C program prints on x86_64 with rdma-core 44's verbs.h
    /// (`apt install libibverbs-dev`, `cc l.c && ./a.out`; the header is read once by a person,
    /// it is never a build dependency):
    /// `printf("%zu", sizeof(struct ibv_wc))`, `offsetof(struct ibv_qp_attr, ah_attr)`, ... for
    /// every number below. Prefix structures are checked on the offsets of their fields.
    #[test]
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    fn layouts_match_verbs_h() {
        assert_eq!(offset_of!(ibv_context, ops), 8);
        assert_eq!(size_of::<ibv_context_ops>(), 256);
        assert_eq!(
            offset_of!(ibv_context, ops) + offset_of!(ibv_context_ops, poll_cq),
            8 + 88
        );
        assert_eq!(offset_of!(ibv_context_ops, req_notify_cq), 96);
        assert_eq!(offset_of!(ibv_context_ops, post_send), 200);
        assert_eq!(offset_of!(ibv_context_ops, post_recv), 208);
        assert_eq!(
            (
                offset_of!(ibv_context, cmd_fd),
                offset_of!(ibv_context, async_fd),
                offset_of!(ibv_context, num_comp_vectors)
            ),
            (264, 268, 272)
        );

        assert_eq!(
            (
                offset_of!(ibv_qp, context),
                offset_of!(ibv_qp, handle),
                offset_of!(ibv_qp, qp_num),
                offset_of!(ibv_qp, state),
                offset_of!(ibv_qp, qp_type)
            ),
            (0, 48, 52, 56, 60)
        );
        assert_eq!(
            (
                offset_of!(ibv_cq, context),
                offset_of!(ibv_cq, channel),
                offset_of!(ibv_cq, cqe)
            ),
            (0, 8, 28)
        );
        assert_eq!(
            (
                size_of::<ibv_comp_channel>(),
                offset_of!(ibv_comp_channel, fd)
            ),
            (16, 8)
        );

        assert_eq!(size_of::<ibv_mr>(), 48);
        assert_eq!(
            (
                offset_of!(ibv_mr, addr),
                offset_of!(ibv_mr, length),
                offset_of!(ibv_mr, lkey),
                offset_of!(ibv_mr, rkey)
            ),
            (16, 24, 36, 40)
        );

        assert_eq!((size_of::<ibv_sge>(), align_of::<ibv_sge>()), (16, 8));
        assert_eq!(
            (size_of::<ibv_send_wr>(), align_of::<ibv_send_wr>()),
            (128, 8)
        );
        assert_eq!(
            (
                offset_of!(ibv_send_wr, next),
                offset_of!(ibv_send_wr, sg_list),
                offset_of!(ibv_send_wr, num_sge),
                offset_of!(ibv_send_wr, opcode),
                offset_of!(ibv_send_wr, send_flags)
            ),
            (8, 16, 24, 28, 32)
        );
        // wr.rdma.remote_addr, wr.rdma.rkey, qp_type, bind_mw
        assert_eq!(
            (
                offset_of!(ibv_send_wr, remote_addr),
                offset_of!(ibv_send_wr, rkey),
                offset_of!(ibv_send_wr, qp_type),
                offset_of!(ibv_send_wr, _bind_mw_tso)
            ),
            (40, 48, 72, 80)
        );

        assert_eq!(size_of::<ibv_wc>(), 48);
        assert_eq!(
            (
                offset_of!(ibv_wc, status),
                offset_of!(ibv_wc, opcode),
                offset_of!(ibv_wc, vendor_err),
                offset_of!(ibv_wc, byte_len),
                offset_of!(ibv_wc, qp_num)
            ),
            (8, 12, 16, 20, 28)
        );
        assert_eq!(
            (
                offset_of!(ibv_wc, wc_flags),
                offset_of!(ibv_wc, pkey_index),
                offset_of!(ibv_wc, dlid_path_bits)
            ),
            (36, 40, 45)
        );

        assert_eq!((size_of::<ibv_qp_cap>(), align_of::<ibv_qp_cap>()), (20, 4));
        assert_eq!(size_of::<ibv_qp_init_attr>(), 64);
        assert_eq!(
            (
                offset_of!(ibv_qp_init_attr, cap),
                offset_of!(ibv_qp_init_attr, qp_type),
                offset_of!(ibv_qp_init_attr, sq_sig_all)
            ),
            (32, 52, 56)
        );

        assert_eq!(
            (
                size_of::<ibv_global_route>(),
                align_of::<ibv_global_route>()
            ),
            (24, 8)
        );
        assert_eq!(
            (
                offset_of!(ibv_global_route, flow_label),
                offset_of!(ibv_global_route, sgid_index),
                offset_of!(ibv_global_route, traffic_class)
            ),
            (16, 20, 22)
        );
        assert_eq!(
            (size_of::<ibv_ah_attr>(), align_of::<ibv_ah_attr>()),
            (32, 8)
        );
        assert_eq!(
            (
                offset_of!(ibv_ah_attr, dlid),
                offset_of!(ibv_ah_attr, is_global),
                offset_of!(ibv_ah_attr, port_num)
            ),
            (24, 29, 30)
        );

        assert_eq!(
            (size_of::<ibv_qp_attr>(), align_of::<ibv_qp_attr>()),
            (144, 8)
        );
        assert_eq!(
            (
                offset_of!(ibv_qp_attr, path_mtu),
                offset_of!(ibv_qp_attr, dest_qp_num),
                offset_of!(ibv_qp_attr, qp_access_flags),
                offset_of!(ibv_qp_attr, cap)
            ),
            (8, 28, 32, 36)
        );
        assert_eq!(
            (
                offset_of!(ibv_qp_attr, ah_attr),
                offset_of!(ibv_qp_attr, alt_ah_attr),
                offset_of!(ibv_qp_attr, pkey_index)
            ),
            (56, 88, 120)
        );
        assert_eq!(
            (
                offset_of!(ibv_qp_attr, max_rd_atomic),
                offset_of!(ibv_qp_attr, max_dest_rd_atomic),
                offset_of!(ibv_qp_attr, min_rnr_timer),
                offset_of!(ibv_qp_attr, port_num),
                offset_of!(ibv_qp_attr, timeout),
                offset_of!(ibv_qp_attr, retry_cnt),
                offset_of!(ibv_qp_attr, rnr_retry),
                offset_of!(ibv_qp_attr, alt_timeout),
                offset_of!(ibv_qp_attr, rate_limit)
            ),
            (126, 127, 128, 129, 130, 131, 132, 134, 136)
        );

        assert_eq!(
            (size_of::<ibv_port_attr>(), align_of::<ibv_port_attr>()),
            (52, 4)
        );
        assert_eq!(
            (
                offset_of!(ibv_port_attr, active_mtu),
                offset_of!(ibv_port_attr, gid_tbl_len),
                offset_of!(ibv_port_attr, lid),
                offset_of!(ibv_port_attr, link_layer)
            ),
            (8, 12, 34, 46)
        );
        assert_eq!(
            (
                offset_of!(ibv_port_attr, flags),
                offset_of!(ibv_port_attr, port_cap_flags2)
            ),
            (47, 48)
        );
    }

    /// The enum values, as the same program printed them.
    #[test]
    fn constants_match_verbs_h() {
        assert_eq!(
            (
                IBV_QPT_RC,
                IBV_WR_RDMA_WRITE,
                IBV_WR_RDMA_READ,
                IBV_SEND_SIGNALED
            ),
            (2, 0, 4, 2)
        );
        assert_eq!(
            [
                IBV_QP_STATE,
                IBV_QP_AV,
                IBV_QP_PATH_MTU,
                IBV_QP_TIMEOUT,
                IBV_QP_RETRY_CNT,
                IBV_QP_RNR_RETRY,
                IBV_QP_RQ_PSN,
                IBV_QP_MAX_QP_RD_ATOMIC
            ],
            [1, 128, 256, 512, 1024, 2048, 4096, 8192]
        );
        assert_eq!(
            [
                IBV_QP_MIN_RNR_TIMER,
                IBV_QP_SQ_PSN,
                IBV_QP_MAX_DEST_RD_ATOMIC,
                IBV_QP_DEST_QPN,
                IBV_QP_PKEY_INDEX,
                IBV_QP_PORT,
                IBV_QP_ACCESS_FLAGS
            ],
            [32768, 65536, 131072, 1048576, 16, 32, 8]
        );
        assert_eq!(
            (IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPS_ERR),
            (1, 2, 3, 6)
        );
        assert_eq!(
            (
                IBV_ACCESS_LOCAL_WRITE,
                IBV_ACCESS_REMOTE_WRITE,
                IBV_ACCESS_REMOTE_READ,
                IBV_PORT_ACTIVE
            ),
            (1, 2, 4, 4)
        );
        assert_eq!(
            (
                IBV_LINK_LAYER_ETHERNET,
                IBV_LINK_LAYER_INFINIBAND,
                IBV_WC_RDMA_WRITE,
                IBV_WC_RDMA_READ
            ),
            (2, 1, 1, 2)
        );
    }
}
