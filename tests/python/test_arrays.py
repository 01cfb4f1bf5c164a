"""Mooncake 0.3.14's descriptor-array, page-table and scatter calls, and the transfer hints,
on kvferry's Mooncake API: bytes checked on the far side, bad input refused before anything
moves, Mooncake's return codes."""

from __future__ import annotations

import array
import logging

import numpy as np
import pytest

from conftest import HOST

from kvferry.mooncake import engine as mc

N = 1 << 20


@pytest.fixture
def bufs(te_pair):
    """(a, b, seg of b, local array registered on a, remote array registered on b)."""
    a, b = te_pair
    src = np.frombuffer(np.random.default_rng(7).bytes(N), dtype=np.uint8).copy()
    dst = np.zeros(N, dtype=np.uint8)
    assert a.register_memory(src.ctypes.data, N) == 0
    assert b.register_memory(dst.ctypes.data, N) == 0
    yield a, b, "%s:%d" % (HOST, b.get_rpc_port()), src, dst
    a.unregister_memory(src.ctypes.data)
    b.unregister_memory(dst.ctypes.data)


def _scattered(src, dst, n=256, size=1024, seed=1):
    rng = np.random.default_rng(seed)
    lp = rng.permutation(N // size)[:n].astype(np.uint64)
    rp = rng.permutation(N // size)[:n].astype(np.uint64)
    return (src.ctypes.data + lp * size), (dst.ctypes.data + rp * size), np.full(n, size, dtype=np.uint64), lp, rp


@pytest.mark.parametrize("dtype", [np.uint64, np.int64])
def test_sync_arrays_write_then_read(bufs, dtype):
    a, _, seg, src, dst = bufs
    l, r, n, lp, rp = _scattered(src, dst)
    assert a.batch_transfer_sync_write_arrays(seg, l.astype(dtype), r.astype(dtype), n.astype(dtype)) == 0
    for i in range(len(lp)):
        assert dst[int(rp[i]) * 1024:int(rp[i] + 1) * 1024].tobytes() == src[int(lp[i]) * 1024:int(lp[i] + 1) * 1024].tobytes()
    # Read them back into a cleared source.
    want = src.copy()
    src[:] = 0
    assert a.batch_transfer_sync_read_arrays(seg, l.astype(dtype), r.astype(dtype), n.astype(dtype)) == 0
    for i in range(len(lp)):
        s = slice(int(lp[i]) * 1024, int(lp[i] + 1) * 1024)
        assert src[s].tobytes() == want[s].tobytes()


def test_async_arrays_and_array_module(bufs):
    a, _, seg, src, dst = bufs
    l, r, n, lp, rp = _scattered(src, dst, n=64)
    # array.array('Q') is a buffer of 8-byte unsigned integers too.
    bid = a.batch_transfer_async_write_arrays(seg, array.array("Q", l.tolist()), array.array("Q", r.tolist()), array.array("Q", n.tolist()))
    assert bid != 0
    assert a.get_batch_transfer_status([bid]) == 0
    for i in range(len(lp)):
        assert dst[int(rp[i]) * 1024:int(rp[i] + 1) * 1024].tobytes() == src[int(lp[i]) * 1024:int(lp[i] + 1) * 1024].tobytes()
    src[:] = 0
    bid = a.batch_transfer_async_read_arrays(seg, l, r, n)
    assert bid != 0
    assert a.get_batch_transfer_status([bid]) == 0
    for i in range(len(lp)):
        assert src[int(lp[i]) * 1024:int(lp[i] + 1) * 1024].tobytes() == dst[int(rp[i]) * 1024:int(rp[i] + 1) * 1024].tobytes()


def test_adjacent_descriptors_become_one_task(bufs):
    """64 adjacent 4 KiB descriptors (contiguous on both sides) reach the engine as one task
    of 256 KiB: the batch has no task 1, and the bytes are right."""
    a, _, seg, src, dst = bufs
    k, size = 64, 4096
    l = src.ctypes.data + 8192 + np.arange(k, dtype=np.uint64) * size
    r = dst.ctypes.data + 65536 + np.arange(k, dtype=np.uint64) * size
    n = np.full(k, size, dtype=np.uint64)
    bid = a.batch_transfer_async_write_arrays(seg, l, r, n)
    assert bid != 0
    core = a._core
    st = core.wait_batch(bid)
    assert st[0] == 4 and st[1] == k * size, st
    assert core.task_status(bid, 0)[1] == k * size
    with pytest.raises(mc.KvferryError):
        core.task_status(bid, 1)
    assert a.get_batch_transfer_status([bid]) == 0
    assert dst[65536:65536 + k * size].tobytes() == src[8192:8192 + k * size].tobytes()
    # Adjacent on the local side only: not merged (64 tasks), the bytes still right.
    r2 = dst.ctypes.data + np.arange(k, dtype=np.uint64)[::-1].copy() * size
    bid = a.batch_transfer_async_write_arrays(seg, l, r2, n)
    core.wait_batch(bid)
    assert core.task_status(bid, k - 1)[0] == 4
    assert a.get_batch_transfer_status([bid]) == 0
    for i in range(k):
        j = k - 1 - i
        assert dst[j * size:(j + 1) * size].tobytes() == src[8192 + i * size:8192 + (i + 1) * size].tobytes()


def test_merging_never_crosses_a_registration(te_pair):
    """Two registrations side by side: a run of descriptors across their border is not
    merged into one range that no single registration holds (which would fail)."""
    a, b = te_pair
    src = np.arange(2 * 4096, dtype=np.uint8) % 251
    dst = np.zeros(2 * 4096, dtype=np.uint8)
    base = src.ctypes.data
    assert a.register_memory(base, 4096) == 0
    assert a.register_memory(base + 4096, 4096) == 0
    assert b.register_memory(dst.ctypes.data, 8192) == 0
    seg = "%s:%d" % (HOST, b.get_rpc_port())
    l = np.array([base, base + 4096], dtype=np.uint64)
    r = np.array([dst.ctypes.data, dst.ctypes.data + 4096], dtype=np.uint64)
    assert a.batch_transfer_sync_write_arrays(seg, l, r, np.array([4096, 4096], dtype=np.uint64)) == 0
    assert dst.tobytes() == src.tobytes()


@pytest.mark.parametrize("bad, match", [
    (lambda l: l.reshape(2, -1), "one-dimensional"),
    (lambda l: l.astype(np.uint32), "8-byte integers"),
    (lambda l: l.astype(np.float64), "8-byte integers"),
    (lambda l: np.repeat(l, 2)[::2], "contiguous"),
])
def test_arrays_of_the_wrong_shape_raise_and_move_nothing(bufs, bad, match):
    """TypeError naming the array, as Mooncake 0.3.14."""
    a, _, seg, src, dst = bufs
    l, r, n, _, _ = _scattered(src, dst, n=16)
    with pytest.raises(TypeError, match=match):
        a.batch_transfer_sync_write_arrays(seg, bad(l), r, n)
    with pytest.raises(TypeError, match=match):
        a.batch_transfer_async_read_arrays(seg, l, r, bad(n))
    assert not dst.any()


def test_arrays_bad_content_raises_and_moves_nothing(bufs):
    """Arrays of different lengths or a negative int64 item: ValueError, as Mooncake 0.3.14."""
    a, _, seg, src, dst = bufs
    l, r, n, _, _ = _scattered(src, dst, n=16)
    with pytest.raises(ValueError, match="must have the same length"):
        a.batch_transfer_sync_write_arrays(seg, l, r, n[:-1])
    neg = n.astype(np.int64)
    neg[3] = -1
    with pytest.raises(ValueError, match=r"lengths must not contain negative values \(lengths\[3\] is -1\)"):
        a.batch_transfer_sync_write_arrays(seg, l.astype(np.int64), r.astype(np.int64), neg)
    with pytest.raises(ValueError, match="must have the same length"):
        a.batch_transfer_async_write_arrays(seg, l, r, n[:-1])
    # bytes is a buffer, of 1-byte items.
    with pytest.raises(TypeError, match="8-byte integers"):
        a.batch_transfer_sync_write_arrays(seg, l.tobytes(), r, n)
    assert not dst.any()
    assert a.batch_transfer_sync_write_arrays(seg, l[:0], r[:0], n[:0]) == 0
    # A list is not a buffer: Mooncake's TypeError.
    with pytest.raises(TypeError, match="incompatible function arguments"):
        a.batch_transfer_sync_write_arrays(seg, l.tolist(), r, n)
    # An unregistered remote range: the transfer fails, -1.
    bad_r = r.copy()
    bad_r[0] = 4096
    assert a.batch_transfer_sync_write_arrays(seg, l, bad_r, n) == -1


def _fields(*rows):
    return np.array(rows, dtype=np.uint64).reshape(-1, 5)


@pytest.mark.parametrize("dtype", [np.uint64, np.int64])
def test_pages_write_and_read(bufs, dtype):
    """Two rows (K and V, as a vLLM layer lays them out) over scattered pages: F * P copies,
    each checked on the far side; then read back."""
    a, _, seg, src, dst = bufs
    P, page = 32, 2048
    rng = np.random.default_rng(3)
    sp = rng.permutation(128)[:P].astype(dtype)
    dp = rng.permutation(128)[:P].astype(dtype)
    ls, rs = src.ctypes.data, dst.ctypes.data
    half = N // 2
    fields = _fields((ls, page, rs, page, page), (ls + half, page, rs + half, page, 1000)).astype(dtype)
    assert a.batch_transfer_sync_write_pages(seg, sp, dp, fields, 0) == 0
    for off, ln in ((0, page), (half, 1000)):
        for i in range(P):
            s, d = off + int(sp[i]) * page, off + int(dp[i]) * page
            assert dst[d:d + ln].tobytes() == src[s:s + ln].tobytes()
    assert dst[half + int(dp[0]) * page + 1000:half + int(dp[0]) * page + page].sum() == 0
    want = src.copy()
    src[:] = 0
    assert a.batch_transfer_sync_read_pages(seg, sp, dp, fields, max_batch_size=8) == 0
    for off, ln in ((0, page), (half, 1000)):
        for i in range(P):
            s = off + int(sp[i]) * page
            assert src[s:s + ln].tobytes() == want[s:s + ln].tobytes()


def test_contiguous_pages_move_as_one_request(bufs):
    a, _, seg, src, dst = bufs
    pages = np.arange(100, dtype=np.uint64)
    assert a.batch_transfer_sync_write_pages(seg, pages, pages, _fields((src.ctypes.data, 4096, dst.ctypes.data, 4096, 4096))) == 0
    assert dst[:100 * 4096].tobytes() == src[:100 * 4096].tobytes()


def test_bad_page_tables_are_refused_whole(bufs):
    """ValueError (as Mooncake 0.3.14) and nothing moved; an address overflow too (Mooncake
    wraps it around and moves bytes to the wrapped address)."""
    a, _, seg, src, dst = bufs
    ls, rs = src.ctypes.data, dst.ctypes.data
    good = _fields((ls, 1024, rs, 1024, 1024))
    pages = np.arange(8, dtype=np.uint64)
    with pytest.raises(ValueError, match="src_pages and dst_pages must have the same length"):
        a.batch_transfer_sync_write_pages(seg, pages, pages[:-1], good)
    with pytest.raises(ValueError, match="positive length and non-negative strides"):
        a.batch_transfer_sync_write_pages(seg, pages, pages, _fields((ls, 1024, rs, 1024, 1024), (ls, 1024, rs, 1024, 0)))
    f = good.astype(np.int64)
    f[0, 3] = -1024
    with pytest.raises(ValueError, match="positive length and non-negative strides"):
        a.batch_transfer_sync_write_pages(seg, pages.astype(np.int64), pages.astype(np.int64), f)
    negp = pages.astype(np.int64)
    negp[2] = -1
    with pytest.raises(ValueError, match="dst_pages must not contain negative values"):
        a.batch_transfer_sync_write_pages(seg, pages.astype(np.int64), negp, good.astype(np.int64))
    # overflow: the last page's address passes 2**64 - 1 (the first pages are valid)
    big = pages.copy()
    big[-1] = 1 << 62
    with pytest.raises(ValueError, match="row 0, page 7.*overflows"):
        a.batch_transfer_sync_write_pages(seg, big, pages, good)
    assert not dst.any(), "a refused table moved bytes"
    with pytest.raises(TypeError, match=r"\[rows, 5\]"):
        a.batch_transfer_sync_write_pages(seg, pages, pages, good.reshape(-1))
    with pytest.raises(TypeError, match="C-contiguous"):
        a.batch_transfer_sync_write_pages(seg, pages, pages, np.asfortranarray(np.repeat(good, 2, axis=0)))
    with pytest.raises(TypeError):
        a.batch_transfer_sync_write_pages(seg, pages, pages, good, -1)
    # An empty page list moves nothing and succeeds.
    assert a.batch_transfer_sync_write_pages(seg, pages[:0], pages[:0], good) == 0


def _scatter_args(src, dst):
    ls, rs = src.ctypes.data, dst.ctypes.data
    return ([ls, ls + 65536], [65536, 65536], [rs + 4096, rs + 131072], [8192, 65536],
            [[0, 1000], [100]], [[10, 5000], [0]], [[500, 3000], [65000]])


def test_scatter_with_tickets(bufs, caplog):
    a, _, seg, src, dst = bufs
    args = _scatter_args(src, dst)
    t = a.scatter_transfer_sync_write_with_ticket(seg, *args)
    assert isinstance(t, mc.ScatterTransferTicket)
    assert t.drained and t.status == mc.ScatterTransferCompletionStatus.COMPLETED
    assert dst[4096 + 10:4096 + 510].tobytes() == src[0:500].tobytes()
    assert dst[4096 + 5000:4096 + 8000].tobytes() == src[1000:4000].tobytes()
    assert dst[131072:131072 + 65000].tobytes() == src[65536 + 100:65536 + 65100].tobytes()
    src[:] = 0
    t = a.submit_scatter_read(seg, *args)
    assert t.drain(-1) == mc.ScatterTransferCompletionStatus.COMPLETED and t.drained
    assert src[0:500].tobytes() == dst[4096 + 10:4096 + 510].tobytes()
    assert src[65536 + 100:65536 + 65100].tobytes() == dst[131072:131072 + 65000].tobytes()
    # Bad ranges: a ticket that ended FAILED_DRAINED (as Mooncake), the reason logged, and
    # nothing moved (Mooncake moves the other fragments of a range with a bad one).
    failed = mc.ScatterTransferCompletionStatus.FAILED_DRAINED
    bad = list(args)
    bad[5] = [[0, 1000], [1000]]
    dst[:] = 0
    with caplog.at_level(logging.WARNING, logger="kvferry"):
        t = a.submit_scatter_write(seg, *bad)
        assert t.drained and t.status == failed and t.drain(0) == failed
        assert "range 1 fragment 0" in caplog.text
        bad = list(args)
        bad[6] = [[500], [65000]]
        assert a.submit_scatter_write(seg, *bad).status == failed
        assert "different sizes at range 0" in caplog.text
        assert a.scatter_transfer_sync_write_with_ticket(seg, args[0][:1], *args[1:]).status == failed
        assert "range arrays have different sizes" in caplog.text
    assert not dst.any()
    # No fragment at all: COMPLETED.
    assert a.submit_scatter_write(seg, [], [], [], [], [], [], []).drain(1000) == mc.ScatterTransferCompletionStatus.COMPLETED
    assert [int(v) for v in mc.ScatterTransferCompletionStatus] == [0, -1, -2]
    # A remote range the peer never registered: the ticket ends FAILED_DRAINED.
    failing = list(args)
    failing[2] = [8, 16]
    t = a.submit_scatter_write(seg, *failing)
    assert t.drain(-1) == mc.ScatterTransferCompletionStatus.FAILED_DRAINED


def test_hints(bufs, caplog):
    a, _, seg, src, dst = bufs
    l, r, n, _, _ = _scattered(src, dst, n=4)
    # The transport this engine uses for the peer (shared memory or TCP, by KVFERRY_TRANSPORT)
    # is met; the other is -1 with the reason.
    with caplog.at_level(logging.WARNING, logger="kvferry"):
        rc = {t: a.batch_transfer_sync_write_arrays(seg, l, r, n, t) for t in ("tcp", "shm")}
    assert sorted(rc.values()) == [-1, 0], rc
    used = min(rc, key=lambda t: -rc[t])
    assert "cannot be met: this engine reaches %s over %s" % (seg, used) in caplog.text
    assert a.transfer_sync_write(seg, int(l[0]), int(r[0]), 16, transport_hint="unspec", nic_hint="") == 0
    with caplog.at_level(logging.WARNING, logger="kvferry"):
        assert a.transfer_sync_write(seg, int(l[0]), int(r[0]), 16, "rdma") == -1
        assert "transport_hint 'rdma' cannot be met" in caplog.text
        assert a.batch_transfer_sync_read(seg, [int(l[0])], [int(r[0])], [16], "nvlink") == -1
        assert a.batch_transfer_async_write(seg, [int(l[0])], [int(r[0])], [16], nic_hint="mlx5_0") == 0
        assert "nic_hint 'mlx5_0' cannot be met" in caplog.text
    with pytest.raises(ValueError, match="Unknown transport_hint"):
        a.transfer_sync_read(seg, int(l[0]), int(r[0]), 16, "carrier-pigeon")
    with pytest.raises(TypeError):
        a.transfer_sync_read(seg, int(l[0]), int(r[0]), 16, "", 5)


def test_register_memory_remote_accessible(te_pair):
    a, _ = te_pair
    buf = np.zeros(4096, dtype=np.uint8)
    assert a.register_memory(buf.ctypes.data, 4096, "cpu:0", remote_accessible=False) == 0
    assert a.unregister_memory(buf.ctypes.data) == 0
    assert a.register_memory(buf.ctypes.data, 4096, remote_accessible=True) == 0
    with pytest.raises(TypeError):
        a.register_memory(buf.ctypes.data + 1, 16, "*", "yes")


# -- parity with the stock 0.3.14 wheel ----------------------------------------------------

CASES314 = __import__("pathlib").Path(__file__).with_name("compat314_cases.py")

#: Where kvferry deliberately differs from stock 0.3.14 (which ignores both hints in its
#: non-TENT build, and wraps page addresses around 2**64): case -> (kvferry, stock) results.
DIVERGENT = {
    "pages_overflow": ({"raises": "ValueError"}, [0, True]),
    "scatter_fragment_outside": ("FAILED_DRAINED, nothing moved", "FAILED_DRAINED, the other fragments moved"),
    "hint_rdma": ([-1, False], [0, True]),
    "hint_unknown": ({"raises": "ValueError"}, [0, True]),
    "nic_hint": ([-1, False], [0, True]),
    "nic_hint_keyword": ([-1, False], [0, True]),
}


def _run314(python, impl):
    import json
    import os
    import subprocess

    env = dict(os.environ, MC_FORCE_TCP="1", KVFERRY_TRANSPORT="tcp")
    env.pop("KVFERRY_MOONCAKE_SHIM", None)
    r = subprocess.run([python, str(CASES314), impl], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_parity_with_stock_0_3_14():
    """The same calls on kvferry and on the stock 0.3.14 wheel (conftest's `stock_python`):
    same return values, exception types and bytes moved; Mooncake's message within kvferry's;
    only DIVERGENT differs, and only as listed."""
    import sys

    from conftest import stock_python

    stock_py = stock_python("0.3.14")  # fails, saying how to make it, where it is missing
    ours, stock = _run314(sys.executable, "kvferry"), _run314(stock_py, "mooncake")
    assert sorted(ours) == sorted(stock)
    bad = []
    for name in stock:
        (o, om), (s, sm) = ours[name], stock[name]
        if name in DIVERGENT:
            want = DIVERGENT[name][0]
            if name == "scatter_fragment_outside":
                ok = "FAILED_DRAINED" in str(o) and not om and "FAILED_DRAINED" in str(s)
            elif isinstance(want, dict):
                ok = isinstance(o, dict) and o["raises"] == want["raises"] and not om
            else:
                ok = [o, om] == want
            if not ok:
                bad.append("%s (divergent): kvferry %r, expected %r" % (name, [o, om], want))
            continue
        if isinstance(s, dict):
            ok = isinstance(o, dict) and o["raises"] == s["raises"] and s["msg"][:60] in o["msg"]
        else:
            ok = o == s
        if not ok or om != sm:
            bad.append("%s: kvferry %r, stock %r" % (name, [o, om], [s, sm]))
    assert not bad, "\n".join(bad)


def test_on_cuda_calls_wait_for_the_stream_then_move(bufs, monkeypatch):
    """The *_on_cuda calls (bound where SUPPORT_CUDA holds): the stream is synchronised first,
    then the bytes move; a failed synchronisation moves nothing; a failed transfer raises.
    Driven through a stand-in cuStreamSynchronize (the mock driver has none)."""
    from kvferry.mooncake import _cuda

    a, _, seg, src, dst = bufs
    calls = []

    def fake_sync(stream):
        calls.append(stream.value or 0)
        return 700 if stream.value == 0xBAD else 0

    monkeypatch.setattr(_cuda, "_SYNC", fake_sync)

    class OnCuda(_cuda._OnCuda):
        pass

    on = OnCuda()
    on._sync = a._sync
    ls, rs = src.ctypes.data, dst.ctypes.data
    assert on.transfer_write_on_cuda(seg, ls, rs, 4096, 0x1234) is None
    assert calls == [0x1234] and dst[:4096].tobytes() == src[:4096].tobytes()
    on.batch_transfer_write_on_cuda(seg, [ls + 8192, ls + 16384], [rs + 8192, rs + 16384], [100, 200])
    assert calls[-1] == 0
    assert dst[16384:16584].tobytes() == src[16384:16584].tobytes()
    src[:] = 0
    on.batch_transfer_read_on_cuda(seg, [ls], [rs], [4096], 7)
    on.transfer_read_on_cuda(seg, ls + 16384, rs + 16384, 200, stream_ptr=8)
    assert calls[-2:] == [7, 8]
    assert src[:4096].tobytes() == dst[:4096].tobytes() and src[16384:16584].tobytes() == dst[16384:16584].tobytes()
    dst[:] = 0
    with pytest.raises(RuntimeError, match="CUDA error 700; nothing was moved"):
        on.transfer_write_on_cuda(seg, ls + 1, rs, 100, 0xBAD)
    assert not dst.any()
    with pytest.raises(RuntimeError, match="failed"):
        on.transfer_write_on_cuda(seg, ls, 4096, 100)
    with pytest.raises(TypeError, match="incompatible function arguments"):
        on.transfer_write_on_cuda(seg, ls, rs, 100, -1)
    # The flag says whether the calls are there.
    assert mc.SUPPORT_CUDA == hasattr(mc.TransferEngine, "transfer_write_on_cuda")
