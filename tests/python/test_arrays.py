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
    a, _, seg, src, dst = bufs
    l, r, n, _, _ = _scattered(src, dst, n=16)
    with pytest.raises(ValueError, match=match):
        a.batch_transfer_sync_write_arrays(seg, bad(l), r, n)
    with pytest.raises(ValueError, match=match):
        a.batch_transfer_async_read_arrays(seg, l, r, bad(n))
    assert not dst.any()


def test_arrays_bad_content_is_minus_one_and_moves_nothing(bufs, caplog):
    a, _, seg, src, dst = bufs
    l, r, n, _, _ = _scattered(src, dst, n=16)
    with caplog.at_level(logging.WARNING, logger="kvferry"):
        assert a.batch_transfer_sync_write_arrays(seg, l, r, n[:-1]) == -1
        assert "same number of entries" in caplog.text
        neg = n.astype(np.int64)
        neg[3] = -1
        assert a.batch_transfer_sync_write_arrays(seg, l.astype(np.int64), r.astype(np.int64), neg) == -1
        assert "lengths[3] is negative" in caplog.text
        assert a.batch_transfer_async_write_arrays(seg, l, r, n[:-1]) == 0
    assert not dst.any()
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


def test_bad_page_tables_are_refused_whole(bufs, caplog):
    a, _, seg, src, dst = bufs
    ls, rs = src.ctypes.data, dst.ctypes.data
    good = _fields((ls, 1024, rs, 1024, 1024))
    pages = np.arange(8, dtype=np.uint64)
    with caplog.at_level(logging.WARNING, logger="kvferry"):
        # different lengths
        assert a.batch_transfer_sync_write_pages(seg, pages, pages[:-1], good) == -1
        assert "same length" in caplog.text
        # a zero length row
        assert a.batch_transfer_sync_write_pages(seg, pages, pages, _fields((ls, 1024, rs, 1024, 1024), (ls, 1024, rs, 1024, 0))) == -1
        assert "positive length" in caplog.text
        # a negative stride (int64 rows)
        f = good.astype(np.int64)
        f[0, 3] = -1024
        assert a.batch_transfer_sync_write_pages(seg, pages, pages, f) == -1
        # overflow: the last page's address passes 2**64 - 1 (the first pages are valid)
        big = pages.copy()
        big[-1] = (1 << 63)
        assert a.batch_transfer_sync_write_pages(seg, big, pages, good) == -1
        assert "overflows" in caplog.text
    assert not dst.any(), "a refused table moved bytes"
    with pytest.raises(ValueError, match=r"\[F, 5\]"):
        a.batch_transfer_sync_write_pages(seg, pages, pages, good.reshape(-1))
    with pytest.raises(ValueError, match="C-contiguous"):
        a.batch_transfer_sync_write_pages(seg, pages, pages, np.asfortranarray(np.repeat(good, 2, axis=0)))
    with pytest.raises(TypeError):
        a.batch_transfer_sync_write_pages(seg, pages, pages, good, -1)
    # An empty page list moves nothing and succeeds.
    assert a.batch_transfer_sync_write_pages(seg, pages[:0], pages[:0], good) == 0


def _scatter_args(src, dst):
    ls, rs = src.ctypes.data, dst.ctypes.data
    return ([ls, ls + 65536], [65536, 65536], [rs + 4096, rs + 131072], [8192, 65536],
            [[0, 1000], [100]], [[10, 5000], [0]], [[500, 3000], [65000]])


def test_scatter_with_tickets(bufs):
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
    # A fragment outside its remote range: ValueError, nothing moved.
    bad = list(args)
    bad[5] = [[0, 1000], [1000]]
    dst[:] = 0
    with pytest.raises(ValueError, match="range 1 fragment 0"):
        a.submit_scatter_write(seg, *bad)
    bad = list(args)
    bad[6] = [[500], [65000]]
    with pytest.raises(ValueError, match="different sizes at range 0"):
        a.submit_scatter_write(seg, *bad)
    with pytest.raises(ValueError, match="range arrays have different sizes"):
        a.submit_scatter_write(seg, args[0][:1], *args[1:])
    assert not dst.any()
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
