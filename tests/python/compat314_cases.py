#!/usr/bin/env python3
"""Mooncake 0.3.14's new TransferEngine calls, run against one implementation per process.

    python compat314_cases.py kvferry     # kvferry.mooncake.engine
    python compat314_cases.py mooncake    # the stock 0.3.14 wheel (mooncake-transfer-engine-cuda13)

Prints one JSON object {case: [result, moved]} on stdout: the call's return value (or
{"raises": type, "msg": first line}) and whether any byte of the target buffer changed.
test_arrays.py runs both and compares them; DIVERGENT there lists the deliberate differences.
Needs no numpy (array.array and memoryview casts make the arrays), so it runs in the stock
wheel's venv as it is.
"""

import array
import ctypes
import json
import os
import sys

os.environ.setdefault("MC_FORCE_TCP", "1")

if sys.argv[1] == "mooncake":
    import mooncake.engine as m
else:
    import kvferry.mooncake.engine as m

HOST, SIZE = "127.0.0.1", 1 << 20


def engine():
    e = m.TransferEngine()
    assert e.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    return e


t, te = engine(), engine()
seg = "%s:%d" % (HOST, t.get_rpc_port())
PATTERN = bytes(i % 251 for i in range(SIZE))
abuf = ctypes.create_string_buffer(PATTERN, SIZE)
bbuf = ctypes.create_string_buffer(SIZE)
A, B = ctypes.addressof(abuf), ctypes.addressof(bbuf)
assert te.register_memory(A, SIZE) == 0 and t.register_memory(B, SIZE) == 0
out = {}


def run(name, f):
    """Each case starts from the pattern on the initiator and zeros on the target; `moved`:
    whether any target byte changed (a READ changes none)."""
    ctypes.memmove(A, PATTERN, SIZE)
    ctypes.memset(B, 0, SIZE)
    try:
        r = f()
        v = r if isinstance(r, (int, str, bool, list, type(None))) else repr(r)
    except Exception as e:  # noqa: BLE001 - the type is the result
        v = {"raises": type(e).__name__, "msg": str(e).splitlines()[0][:120]}
    out[name] = [v, any(bbuf.raw)]


def q(*v, code="Q"):
    return array.array(code, v)


def rows(*r, code="Q"):
    flat = array.array(code, [x for row in r for x in row])
    return memoryview(flat).cast("B").cast(code, [len(r), 5])


L, R, N = q(A, A + 4096), q(B, B + 8192), q(100, 200)
run("arrays_ok", lambda: te.batch_transfer_sync_write_arrays(seg, L, R, N))
run("arrays_read_ok", lambda: te.batch_transfer_sync_read_arrays(seg, L, R, N))
run("arrays_int64", lambda: te.batch_transfer_sync_write_arrays(seg, q(*L, code="q"), q(*R, code="q"), q(*N, code="q")))
run("arrays_len_mismatch", lambda: te.batch_transfer_sync_write_arrays(seg, L, R, N[:1]))
run("arrays_list", lambda: te.batch_transfer_sync_write_arrays(seg, [A], [B], [10]))
run("arrays_u32", lambda: te.batch_transfer_sync_write_arrays(seg, L, R, q(*N, code="I")))
run("arrays_f64", lambda: te.batch_transfer_sync_write_arrays(seg, L, R, array.array("d", [1.0, 2.0])))
run("arrays_2d", lambda: te.batch_transfer_sync_write_arrays(seg, memoryview(L).cast("B").cast("Q", [1, 2]), R, N))
run("arrays_strided", lambda: te.batch_transfer_sync_write_arrays(seg, memoryview(q(A, 0, A + 4096, 0))[::2], R, N))
run("arrays_neg_len", lambda: te.batch_transfer_sync_write_arrays(seg, q(*L, code="q"), q(*R, code="q"), q(100, -1, code="q")))
run("arrays_bad_remote", lambda: te.batch_transfer_sync_write_arrays(seg, L, q(16, 32), N))
run("arrays_empty", lambda: te.batch_transfer_sync_write_arrays(seg, L[:0], R[:0], N[:0]))
run("arrays_bytes", lambda: te.batch_transfer_sync_write_arrays(seg, bytes(16), R, N))
run("async_arrays_ok", lambda: [te.get_batch_transfer_status([te.batch_transfer_async_write_arrays(seg, L, R, N)])])
run("async_arrays_mismatch", lambda: te.batch_transfer_async_write_arrays(seg, L, R, N[:1]))
run("async_read_arrays_ok", lambda: [te.get_batch_transfer_status([te.batch_transfer_async_read_arrays(seg, L, R, N)])])
P, F = q(0, 3), rows((A, 4096, B, 4096, 100))
run("pages_ok", lambda: te.batch_transfer_sync_write_pages(seg, P, P, F))
run("pages_read_ok", lambda: te.batch_transfer_sync_read_pages(seg, P, P, F))
run("pages_ok_max_batch", lambda: te.batch_transfer_sync_write_pages(seg, P, P, F, 1))
run("pages_int64", lambda: te.batch_transfer_sync_write_pages(seg, q(0, 3, code="q"), q(0, 3, code="q"), rows((A, 4096, B, 4096, 100), code="q")))
run("pages_mismatch", lambda: te.batch_transfer_sync_write_pages(seg, P, P[:1], F))
run("pages_zero_len", lambda: te.batch_transfer_sync_write_pages(seg, P, P, rows((A, 4096, B, 4096, 0))))
run("pages_neg_stride", lambda: te.batch_transfer_sync_write_pages(seg, q(0, 3, code="q"), q(0, 3, code="q"), rows((A, -4096, B, 4096, 10), code="q")))
run("pages_neg_page", lambda: te.batch_transfer_sync_write_pages(seg, q(0, -1, code="q"), q(0, 3, code="q"), rows((A, 4096, B, 4096, 10), code="q")))
run("pages_overflow", lambda: te.batch_transfer_sync_write_pages(seg, q(0, 1 << 62), P, F))
run("pages_flat_fields", lambda: te.batch_transfer_sync_write_pages(seg, P, P, q(A, 4096, B, 4096, 100)))
run("pages_shape_4", lambda: te.batch_transfer_sync_write_pages(seg, P, P, memoryview(q(A, 4096, B, 4096)).cast("B").cast("Q", [1, 4])))
run("pages_empty", lambda: te.batch_transfer_sync_write_pages(seg, P[:0], P[:0], F))
run("pages_neg_max_batch", lambda: te.batch_transfer_sync_write_pages(seg, P, P, F, -1))
SA = ([A, A + 65536], [65536, 65536], [B + 4096, B + 131072], [8192, 65536],
      [[0, 1000], [100]], [[10, 5000], [0]], [[500, 3000], [65000]])


def scatter(fn, args, endpoint=None):
    tk = fn(endpoint or seg, *args)
    st = tk.drain(5000)
    return [type(tk).__name__, str(st), int(st), tk.drained, str(tk.status)]


run("scatter_sync_ok", lambda: scatter(te.scatter_transfer_sync_write_with_ticket, SA))
run("scatter_submit_ok", lambda: scatter(te.submit_scatter_write, SA))
run("scatter_read_ok", lambda: scatter(te.submit_scatter_read, SA))
run("scatter_sync_read_ok", lambda: scatter(te.scatter_transfer_sync_read_with_ticket, SA))
run("scatter_fragment_outside", lambda: scatter(te.submit_scatter_write, SA[:5] + ([[0, 1000], [1000]],) + SA[6:]))
run("scatter_fragment_sizes", lambda: scatter(te.submit_scatter_write, SA[:6] + ([[500], [65000]],)))
run("scatter_range_sizes", lambda: scatter(te.submit_scatter_write, (SA[0][:1],) + SA[1:]))
run("scatter_empty", lambda: scatter(te.submit_scatter_write, ([], [], [], [], [], [], [])))
run("scatter_unregistered", lambda: scatter(te.submit_scatter_write, SA[:2] + ([8, 16],) + SA[3:]))
run("scatter_zero_length", lambda: scatter(te.submit_scatter_write, ([A], [100], [B], [100], [[0]], [[0]], [[0]])))
run("scatter_bad_segment", lambda: scatter(te.submit_scatter_write, SA, "127.0.0.1:1"))
run("scatter_status_values", lambda: [[k, int(v)] for k, v in m.ScatterTransferCompletionStatus.__members__.items()])
run("hint_tcp", lambda: te.transfer_sync_write(seg, A, B, 10, "tcp"))
run("hint_rdma", lambda: te.transfer_sync_write(seg, A, B, 10, "rdma"))
run("hint_unknown", lambda: te.transfer_sync_write(seg, A, B, 10, "pigeon"))
run("nic_hint", lambda: te.transfer_sync_write(seg, A, B, 10, "", "mlx5_0"))
run("nic_hint_keyword", lambda: te.batch_transfer_sync_write(seg, [A], [B], [10], nic_hint="mlx5_0"))
run("nic_hint_empty", lambda: [te.transfer_sync_read(seg, A, B, 10, nic_hint=""), te.batch_transfer_async_read(seg, [A], [B], [10], "", "") != 0])
c = ctypes.create_string_buffer(4096)
run("register_not_remote_accessible", lambda: [te.register_memory(ctypes.addressof(c), 4096, "cpu:0", remote_accessible=False), te.unregister_memory(ctypes.addressof(c))])
run("register_remote_accessible_kw", lambda: [te.register_memory(ctypes.addressof(c), 4096, remote_accessible=True), te.unregister_memory(ctypes.addressof(c))])
run("support_cuda_has_on_cuda", lambda: m.SUPPORT_CUDA == hasattr(te, "transfer_write_on_cuda"))
print(json.dumps(out))
